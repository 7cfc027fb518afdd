//! The device chapter, through a C client built against CUDA 13.5's own `cuda.h`
//! (`tests/c/device.c`): every attribute the header defines on every preset GPU, the cited ones
//! checked against the GPUs' published figures; the peer attributes against each preset's
//! topology; and the function attributes and occupancy of kernels nvcc 13.5 built
//! (`tests/c/device_kernels.cu`) against what ptxas reported allocating (`--resource-usage`)
//! and the occupancy formula worked out here by hand.
//!
//! Needs the nvcc 13.5 wheels (as `cudart_nvcc.rs`): without them it prints SKIPPED, or fails
//! under CI=true.
mod common;

use cuvisor_sim::model::{preset, Model, PcieLevel};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// What ptxas allocated to one kernel for one architecture.
#[derive(Clone, Copy, Debug, Default)]
struct Ptxas {
    regs: u32,
    smem: u32,
    stack: u32,
}

struct Built {
    nvcc: PathBuf,
    exe: PathBuf,
    cubin80: PathBuf,
    fatbin: PathBuf,
    /// (sm, kernel) → resources.
    ptxas: HashMap<(u32, String), Ptxas>,
}

/// ptxas's `--resource-usage` report: "Compiling entry function 'K' for 'sm_80'", then
/// "N bytes stack frame", "Used R registers, ..., S bytes smem, ...".
fn parse_ptxas(text: &str, out: &mut HashMap<(u32, String), Ptxas>) {
    let mut cur: Option<(u32, String)> = None;
    for line in text.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let name = rest.split('\'').next().unwrap().to_string();
            let sm = rest.split("'sm_").nth(1).unwrap();
            let sm: u32 = sm.trim_end_matches('\'').trim().parse().unwrap();
            cur = Some((sm, name));
            out.insert(cur.clone().unwrap(), Ptxas::default());
            continue;
        }
        let Some(key) = &cur else { continue };
        let e = out.get_mut(key).unwrap();
        let num_before = |word: &str| -> Option<u32> {
            let i = line.find(word)?;
            line[..i].split_whitespace().last()?.parse().ok()
        };
        if let Some(n) = num_before(" bytes stack frame") {
            e.stack = n;
        }
        if let Some(n) = num_before(" registers") {
            e.regs = n;
        }
        if let Some(n) = num_before(" bytes smem") {
            e.smem = n;
        }
    }
}

fn built() -> Option<&'static Built> {
    static B: OnceLock<Option<Built>> = OnceLock::new();
    B.get_or_init(|| {
        let cu13 = cuvisor_testkit::wheels::nvcc_13_5("device_chapter")?;
        let here = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/c");
        let out = std::env::temp_dir().join(format!("cuvisor-device-{}", std::process::id()));
        std::fs::create_dir_all(&out).unwrap();
        let mut ptxas = HashMap::new();
        let nvcc = |args: &[&str], to: &Path| {
            let args: Vec<&str> = args.iter().copied().chain(["--resource-usage"]).collect();
            cuvisor_testkit::wheels::nvcc(&cu13, &args, &here.join("device_kernels.cu"), to)
        };
        let cubin80 = out.join("k80.cubin");
        parse_ptxas(&nvcc(&["-cubin", "-arch=sm_80"], &cubin80), &mut ptxas);
        let fatbin = out.join("k.fatbin");
        parse_ptxas(
            &nvcc(
                &[
                    "-fatbin",
                    "-gencode=arch=compute_75,code=sm_75",
                    "-gencode=arch=compute_80,code=sm_80",
                    "-gencode=arch=compute_86,code=[sm_86,compute_86]",
                    "-gencode=arch=compute_90,code=sm_90",
                ],
                &fatbin,
            ),
            &mut ptxas,
        );
        let exe = out.join("device");
        let cc = Command::new("cc")
            .args(["-O1", "-Wall", "-Werror", "-o"])
            .arg(&exe)
            .arg(here.join("device.c"))
            .arg("-I")
            .arg(cu13.join("include"))
            .arg("-L")
            .arg(common::sim_dir())
            .arg("-lcuda")
            .arg("-ldl")
            .status()
            .expect("run cc");
        assert!(cc.success(), "compiling device.c");
        Some(Built {
            nvcc: cu13.join("bin/nvcc"),
            exe,
            cubin80,
            fatbin,
            ptxas,
        })
    })
    .as_ref()
}

/// device.c's output on `preset`, with `image` loaded for the occupancy part.
fn run(b: &Built, preset_name: &str, image: &Path) -> String {
    let mut cmd = Command::new(&b.exe);
    cmd.arg(image);
    common::sim_env(
        &mut cmd,
        preset_name,
        &common::state_file(&format!("device-{}", preset_name.replace(['/', '.'], "_"))),
    );
    let out = cmd.output().unwrap();
    let so = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success() && so.ends_with("OK\n"),
        "{preset_name}: {so}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    so
}

/// The `attr DEV A V` lines: (dev, a) → v.
fn attributes(out: &str) -> HashMap<(usize, i32), i64> {
    out.lines()
        .filter_map(|l| l.strip_prefix("attr "))
        .map(|l| {
            let v: Vec<i64> = l.split(' ').map(|x| x.parse().unwrap()).collect();
            ((v[0] as usize, v[1] as i32), v[2])
        })
        .collect()
}

/// Attributes every modelled GPU reports non-zero (or exactly so), whatever the board: CUDA C++
/// Programming Guide, "Technical Specifications per Compute Capability" (7.0 to 9.0), and what
/// the R580 Linux driver supports on bare metal (see `device.rs`).
const COMMON: &[(i32, i64, &str)] = &[
    (1, 1024, "MAX_THREADS_PER_BLOCK"),
    (5, 2147483647, "MAX_GRID_DIM_X"),
    (6, 65535, "MAX_GRID_DIM_Y"),
    (8, 49152, "MAX_SHARED_MEMORY_PER_BLOCK"),
    (9, 65536, "TOTAL_CONSTANT_MEMORY"),
    (10, 32, "WARP_SIZE"),
    (12, 65536, "MAX_REGISTERS_PER_BLOCK"),
    (21, 131072, "MAXIMUM_TEXTURE1D_WIDTH"),
    (22, 131072, "MAXIMUM_TEXTURE2D_WIDTH"),
    (23, 65536, "MAXIMUM_TEXTURE2D_HEIGHT"),
    (24, 16384, "MAXIMUM_TEXTURE3D_WIDTH"),
    (29, 2048, "MAXIMUM_TEXTURE2D_LAYERED_LAYERS"),
    (42, 32768, "MAXIMUM_TEXTURE1D_LAYERED_WIDTH"),
    (56, 131072, "MAXIMUM_SURFACE2D_WIDTH"),
    (82, 65536, "MAX_REGISTERS_PER_MULTIPROCESSOR"),
    (83, 1, "MANAGED_MEMORY"),
    (86, 0, "HOST_NATIVE_ATOMIC_SUPPORTED"),
    (88, 0, "PAGEABLE_MEMORY_ACCESS"),
    (89, 1, "CONCURRENT_MANAGED_ACCESS"),
    (95, 1, "COOPERATIVE_LAUNCH"),
    (102, 1, "VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED"),
    (103, 1, "HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED"),
    (104, 0, "HANDLE_TYPE_WIN32_HANDLE_SUPPORTED"),
    (110, 1, "GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED"),
    (115, 1, "MEMORY_POOLS_SUPPORTED"),
    (116, 1, "GPU_DIRECT_RDMA_SUPPORTED"),
    (119, 1, "MEMPOOL_SUPPORTED_HANDLE_TYPES (POSIX fd)"),
    (120, 0, "CLUSTER_LAUNCH (sm_90 only)"),
    (125, 1, "IPC_EVENT_SUPPORTED"),
    (131, -1, "NUMA_ID"),
    (133, 0, "MPS_ENABLED"),
];

/// Per board: `(attribute, value, what)`, from the sources `model::Specs` and `model::arch` cite.
fn board(name: &str) -> Vec<(i32, i64, &'static str)> {
    match name {
        // A100 whitepaper (1410 MHz, 5120-bit, 40 MB L2), 40GB PCIe datasheet (1555 GB/s), sm_80.
        "single" => vec![
            (13, 1_410_000, "CLOCK_RATE"),
            (36, 1_215_000, "MEMORY_CLOCK_RATE"),
            (37, 5120, "GLOBAL_MEMORY_BUS_WIDTH"),
            (38, 40 << 20, "L2_CACHE_SIZE"),
            (16, 108, "MULTIPROCESSOR_COUNT"),
            (39, 2048, "MAX_THREADS_PER_MULTIPROCESSOR"),
            (81, 164 * 1024, "MAX_SHARED_MEMORY_PER_MULTIPROCESSOR"),
            (97, 163 * 1024, "MAX_SHARED_MEMORY_PER_BLOCK_OPTIN"),
            (106, 32, "MAX_BLOCKS_PER_MULTIPROCESSOR"),
            (111, 1024, "RESERVED_SHARED_MEMORY_PER_BLOCK"),
            (108, 30 << 20, "MAX_PERSISTING_L2_CACHE_SIZE (75% of L2)"),
            (139, 0x20f1_10de, "GPU_PCI_DEVICE_ID"),
        ],
        // A100 80GB datasheet: 2039 GB/s on 5120 bits.
        "dgx-a100" => vec![
            (13, 1_410_000, "CLOCK_RATE"),
            (36, 1_593_000, "MEMORY_CLOCK_RATE"),
            (37, 5120, "GLOBAL_MEMORY_BUS_WIDTH"),
            (16, 108, "MULTIPROCESSOR_COUNT"),
            (140, 0x1463_10de, "GPU_PCI_SUBSYSTEM_ID"),
        ],
        // V100 whitepaper: 1530 MHz, 4096-bit HBM2 (900 GB/s), L2 6144 KB; sm_70: 96 KB per SM.
        "dgx1-v100" => vec![
            (13, 1_530_000, "CLOCK_RATE"),
            (36, 877_000, "MEMORY_CLOCK_RATE"),
            (37, 4096, "GLOBAL_MEMORY_BUS_WIDTH"),
            (38, 6 << 20, "L2_CACHE_SIZE"),
            (16, 80, "MULTIPROCESSOR_COUNT"),
            (81, 96 * 1024, "MAX_SHARED_MEMORY_PER_MULTIPROCESSOR"),
            (97, 96 * 1024, "MAX_SHARED_MEMORY_PER_BLOCK_OPTIN"),
            (111, 0, "RESERVED_SHARED_MEMORY_PER_BLOCK"),
            (108, 0, "MAX_PERSISTING_L2_CACHE_SIZE (sm_80+)"),
            (87, 2, "SINGLE_TO_DOUBLE_PRECISION_PERF_RATIO"),
        ],
        // An H200's nvidia-smi -q (max clocks 1980 / 3201 MHz, subsystem 10de:18be), six HBM3e
        // stacks (6144 bits), the H100 SXM5's deviceQuery (50 MiB L2, 3 copy engines); sm_90.
        "h200" => vec![
            (13, 1_980_000, "CLOCK_RATE"),
            (36, 3_201_000, "MEMORY_CLOCK_RATE"),
            (37, 6144, "GLOBAL_MEMORY_BUS_WIDTH"),
            (38, 50 << 20, "L2_CACHE_SIZE"),
            (40, 3, "ASYNC_ENGINE_COUNT"),
            (16, 132, "MULTIPROCESSOR_COUNT"),
            (75, 9, "COMPUTE_CAPABILITY_MAJOR"),
            (76, 0, "COMPUTE_CAPABILITY_MINOR"),
            (81, 228 * 1024, "MAX_SHARED_MEMORY_PER_MULTIPROCESSOR"),
            (97, 227 * 1024, "MAX_SHARED_MEMORY_PER_BLOCK_OPTIN"),
            (120, 1, "CLUSTER_LAUNCH"),
            (126, 4, "MEM_SYNC_DOMAIN_COUNT"),
            (127, 1, "TENSOR_MAP_ACCESS_SUPPORTED"),
            (139, 0x2335_10de, "GPU_PCI_DEVICE_ID"),
            (140, 0x18be_10de, "GPU_PCI_SUBSYSTEM_ID"),
        ],
        // An A10's deviceQuery (1695 MHz, 384-bit, 6 MiB L2, 1536 threads/SM); sm_86.
        "pcie-8" => vec![
            (13, 1_695_000, "CLOCK_RATE"),
            (36, 6_251_000, "MEMORY_CLOCK_RATE"),
            (37, 384, "GLOBAL_MEMORY_BUS_WIDTH"),
            (38, 6 << 20, "L2_CACHE_SIZE"),
            (16, 72, "MULTIPROCESSOR_COUNT"),
            (39, 1536, "MAX_THREADS_PER_MULTIPROCESSOR"),
            (81, 100 * 1024, "MAX_SHARED_MEMORY_PER_MULTIPROCESSOR"),
            (97, 99 * 1024, "MAX_SHARED_MEMORY_PER_BLOCK_OPTIN"),
            (106, 16, "MAX_BLOCKS_PER_MULTIPROCESSOR"),
        ],
        _ => unreachable!(),
    }
}

/// Per-SM limits of the occupancy formula, from the programming guide's table (not from the
/// simulator): threads, blocks, shared memory per SM, reserved per block, allocation unit.
fn sm_limits(sm: u32) -> (u32, u32, u32, u32, u32) {
    match sm {
        80 => (2048, 32, 164 * 1024, 1024, 128),
        86 => (1536, 16, 100 * 1024, 1024, 128),
        70 => (2048, 32, 96 * 1024, 0, 256),
        90 => (2048, 32, 228 * 1024, 1024, 128),
        _ => unreachable!(),
    }
}

/// Blocks per SM by the CUDA occupancy calculator's formula, default carveout: the least of the
/// warp limit, the register limit (registers per warp rounded to 256, warps per block rounded
/// to the 4 sub-partitions for the per-block check) and the shared-memory limit (static +
/// reserved + dynamic rounded to the allocation unit), and the blocks per SM.
fn formula(sm: u32, p: Ptxas, max_threads: u32, block: u32, dynamic: u32) -> u32 {
    let (threads, blocks, smem, reserved, unit) = sm_limits(sm);
    if block > max_threads {
        return 0;
    }
    let warps = block.div_ceil(32);
    let rpw = (p.regs * 32).div_ceil(256) * 256;
    let by_regs = if rpw * warps.div_ceil(4) * 4 > 65536 {
        0
    } else {
        (65536 / 4 / rpw) * 4 / warps
    };
    let cta = (p.smem + reserved + dynamic).div_ceil(unit) * unit;
    let by_smem = if cta > 49152 + reserved {
        0
    } else {
        smem.checked_div(cta).unwrap_or(u32::MAX) // no shared memory: no limit
    };
    (threads / 32 / warps).min(by_regs).min(by_smem).min(blocks)
}

/// The most threads a block of this kernel may have: 1024, its launch bounds, and the register
/// file (64 K registers, warps in fours).
fn max_threads(p: Ptxas, bound: u32) -> u32 {
    let rpw = (p.regs * 32).div_ceil(256) * 256;
    1024.min(bound).min(65536 / (rpw * 4) * 4 * 32)
}

fn check_attributes(name: &str, out: &str) {
    let m = preset(name).unwrap();
    let a = attributes(out);
    assert_eq!(
        a.len(),
        m.devices.len() * 161,
        "{name}: attributes 1..=161 on each device"
    );
    // The board's figures, where it has one, stand instead of the common one (sm_90's cluster
    // launch, say).
    let mut want: HashMap<i32, (i64, &str)> = HashMap::new();
    for &(k, v, what) in COMMON.iter().chain(board(name).iter()) {
        want.insert(k, (v, what));
    }
    for d in 0..m.devices.len() {
        for (&k, &(v, what)) in &want {
            assert_eq!(a[&(d, k)], v, "{name} GPU{d} {what} ({k})");
        }
        assert_eq!(a[&(d, 134)], m.devices[d].numa_node as i64, "HOST_NUMA_ID");
        // NVML repeats three of the figures, in MHz: they agree.
        let nvml = format!(
            "nvml {d} {} {} {}",
            a[&(d, 13)] / 1000,
            a[&(d, 36)] / 1000,
            a[&(d, 37)]
        );
        assert!(out.lines().any(|l| l == nvml), "{name}: want {nvml:?}");
    }
}

fn check_peers(name: &str, m: &Model, out: &str) {
    let mut seen = 0;
    for l in out.lines().filter_map(|l| l.strip_prefix("p2p ")) {
        let w: Vec<&str> = l.split(' ').collect();
        let (a, b): (usize, usize) = (w[0].parse().unwrap(), w[1].parse().unwrap());
        let field = |k: &str| -> u32 {
            let i = w.iter().position(|x| *x == k).unwrap();
            w[i + 1].parse().unwrap()
        };
        let nvlink = m.nvlink_bandwidth_links(a, b) > 0;
        let access = nvlink || m.pcie_level(a, b) <= PcieLevel::Multiple;
        assert_eq!(field("can") == 1, access, "{name} {a}->{b} can access");
        assert_eq!(
            field("access") == 1,
            access,
            "{name} {a}->{b} ACCESS_SUPPORTED"
        );
        assert_eq!(
            field("atomic") == 1,
            nvlink,
            "{name} {a}->{b} NATIVE_ATOMIC"
        );
        assert_eq!(field("partial"), 0);
        assert_eq!(
            field("caps") != 0,
            nvlink,
            "{name} {a}->{b} atomic capabilities"
        );
        seen += 1;
    }
    let n = m.devices.len();
    assert_eq!(seen, n * (n - 1), "{name}: every ordered pair");
}

/// (kernel, launch bound) of device_kernels.cu.
const KERNELS: &[(&str, u32)] = &[
    ("light", 1024),
    ("smem", 256),
    ("local", 1024),
    ("heavy", 1024),
];

fn check_occupancy(name: &str, sm: u32, b: &Built, out: &str, from_image: bool) {
    let sms = preset(name).map_or(132, |m| m.devices[0].sm_count);
    for &(k, bound) in KERNELS {
        let p = if from_image {
            b.ptxas[&(sm, k.to_string())]
        } else {
            // No cubin for the GPU: the simulator's documented defaults.
            Ptxas {
                regs: 32,
                smem: 0,
                stack: 0,
            }
        };
        let bound = if from_image { bound } else { 1024 };
        let mt = max_threads(p, bound);
        let func = out
            .lines()
            .find(|l| l.starts_with(&format!("func {k} ")))
            .unwrap();
        let want = format!(
            "func {k} max_threads {mt} shared {} const {} local {} regs {} ptx {sm} binary {sm} max_dynamic {}",
            p.smem,
            if from_image { 256 } else { 0 },
            p.stack,
            p.regs,
            49152 - p.smem
        );
        assert_eq!(func, want, "{name}");
        let mut best = (0, 0);
        for l in out
            .lines()
            .filter_map(|l| l.strip_prefix(&format!("occ {k} ")))
        {
            let v: Vec<u32> = l.split(' ').map(|x| x.parse().unwrap()).collect();
            assert_eq!(
                v[1],
                formula(sm, p, mt, v[0], 0),
                "{name} {k} block {}",
                v[0]
            );
            assert_eq!(
                v[2],
                formula(sm, p, mt, v[0], 20000),
                "{name} {k} block {} + 20000 B",
                v[0]
            );
        }
        // The best block size by the calculator's rule: most resident threads, the largest
        // block size among equals, walking down from the limit in warps.
        let mut blk = mt.div_ceil(32) * 32;
        while blk > 0 {
            let t = mt.min(blk);
            let n = formula(sm, p, mt, t, 0);
            if t * n > best.0 * best.1 {
                best = (t, n);
            }
            blk -= 32;
        }
        let pot = format!("potential {k} 0 {} {}", best.1 * sms, best.0);
        assert!(out.lines().any(|l| l == pot), "{name}: want {pot:?}");
    }
}

#[test]
fn every_attribute_of_cuda_h_on_every_preset_peers_and_occupancy_of_nvcc_built_kernels() {
    let Some(b) = built() else { return };
    for (name, image, sm, from_image) in [
        ("single", &b.cubin80, 80, true),
        ("dgx-a100", &b.fatbin, 80, true),
        ("pcie-8", &b.fatbin, 86, true),
        ("h200", &b.fatbin, 90, true),
        // CUDA 13 builds nothing for sm_70: the fat binary has no cubin a V100 runs.
        ("dgx1-v100", &b.fatbin, 70, false),
    ] {
        let out = run(b, name, image);
        check_attributes(name, &out);
        let m = preset(name).unwrap();
        if m.devices.len() > 1 {
            check_peers(name, &m, &out);
        }
        check_occupancy(name, sm, b, &out, from_image);
        // Hand-worked: `smem` on an A100 (12000 B static + 1 KiB reserved = 13056 B after
        // rounding to 128) with 60000 B of dynamic memory: 0 blocks under the 48 KiB default,
        // two of 73088 B in 164 KiB once opted in, none beyond the opted-in size.
        if sm == 80 {
            assert!(
                out.contains("optin before 0\noptin after 60000 2\noptin beyond 0\n"),
                "{out}"
            );
        }
    }
}

/// A `<<<>>>` program's own kernels, registered by libcudart 13.5 (nvcc links it statically):
/// cudaFuncGetAttributes and the runtime's occupancy calls answer what ptxas allocated and the
/// formula gives, and a kernel still launches (`tests/cudart/occupancy.cu`).
#[test]
fn runtime_registered_kernels_answer_the_runtime_occupancy_calls() {
    let Some(b) = built() else { return };
    let nvcc = &b.nvcc;
    let exe = b.exe.parent().unwrap().join("occupancy");
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/cudart/occupancy.cu");
    let ran = Command::new(nvcc)
        .args(["-arch=sm_80", "--resource-usage", "-o"])
        .arg(&exe)
        .arg(&src)
        .output()
        .expect("run nvcc");
    let text = String::from_utf8_lossy(&ran.stderr).to_string();
    assert!(ran.status.success(), "nvcc occupancy.cu: {text}");
    let mut ptxas = HashMap::new();
    parse_ptxas(&text, &mut ptxas);
    let mut cmd = Command::new(&exe);
    common::sim_env(&mut cmd, "single", &common::state_file("device-cudart"));
    let out = cmd.output().unwrap();
    let so = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success() && so.ends_with("OK\n"),
        "{so}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let sms = preset("single").unwrap().devices[0].sm_count;
    for &(k, bound) in KERNELS {
        let p = ptxas[&(80, k.to_string())];
        let mt = max_threads(p, bound);
        let want = format!(
            "func {k} max_threads {mt} shared {} local {} regs {} binary 80",
            p.smem, p.stack, p.regs
        );
        assert!(so.lines().any(|l| l == want), "want {want:?} in {so}");
        let mut seen = 0;
        for l in so
            .lines()
            .filter_map(|l| l.strip_prefix(&format!("occ {k} ")))
        {
            let v: Vec<u32> = l.split(' ').map(|x| x.parse().unwrap()).collect();
            assert_eq!(v[1], formula(80, p, mt, v[0], 0), "{k} block {}", v[0]);
            assert_eq!(
                v[2],
                formula(80, p, mt, v[0], 20000),
                "{k} block {} + 20000 B",
                v[0]
            );
            seen += 1;
        }
        assert_eq!(seen, 8, "{k}: {so}");
        let (mut best, mut blk) = ((0, 0), mt.div_ceil(32) * 32);
        while blk > 0 {
            let t = mt.min(blk);
            let n = formula(80, p, mt, t, 0);
            if t * n > best.0 * best.1 {
                best = (t, n);
            }
            blk -= 32;
        }
        let pot = format!("potential {k} 0 {} {}", best.1 * sms, best.0);
        assert!(so.lines().any(|l| l == pot), "want {pot:?} in {so}");
    }
}

/// A machine file's sm_90 GPU (beside the h200 preset's): the Hopper attributes (cluster
/// launch, TMA, four memory-synchronization domains, 228 KiB of shared memory per SM), the
/// occupancy of the fat binary's sm_90 cubin, and the cluster queries, which need sm_90 (the
/// other presets' `cluster` lines answer CUDA_ERROR_INVALID_VALUE, 1).
#[test]
fn an_sm_90_machine_file_has_clusters() {
    let Some(b) = built() else { return };
    let dir = std::env::temp_dir().join(format!("cuvisor-device-h100-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("h100.toml");
    std::fs::write(
        &file,
        "name = 'h100'\n[[device]]\nname = 'NVIDIA H100 (machine file)'\nmemory = '80Gi'\n\
         sm_count = 132\ncompute_capability = '9.0'\n",
    )
    .unwrap();
    let out = run(b, file.to_str().unwrap(), &b.fatbin);
    let a = attributes(&out);
    for (k, v, what) in [
        (120, 1, "CLUSTER_LAUNCH"),
        (126, 4, "MEM_SYNC_DOMAIN_COUNT"),
        (127, 1, "TENSOR_MAP_ACCESS_SUPPORTED"),
        (81, 228 * 1024, "MAX_SHARED_MEMORY_PER_MULTIPROCESSOR"),
        (97, 227 * 1024, "MAX_SHARED_MEMORY_PER_BLOCK_OPTIN"),
        (16, 132, "MULTIPROCESSOR_COUNT"),
    ] {
        assert_eq!(a[&(0, k)], v, "{what} ({k})");
    }
    check_occupancy("h100", 90, b, &out, true);
    // Portable clusters: 8 blocks, whatever the kernel (each fits at least one block per SM).
    for (k, _) in KERNELS {
        assert!(out.contains(&format!("cluster {k} 0 8\n")), "{k}: {out}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
