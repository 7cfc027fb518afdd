//! The simulated machine: devices, their PCIe/NUMA placement and NVLink wiring.
//!
//! A model comes from `CUVISOR_SIM`: a preset name (`single`, `dgx1-v100`, `dgx-a100`, `h200`,
//! `pcie-8`) or the path of a TOML or JSON file with the same fields as [`ModelFile`].

use serde::Deserialize;
use std::fmt::Write as _;

pub const GIB: u64 = 1 << 30;
pub const MIB: u64 = 1 << 20;
/// The most devices one simulated machine may have (the shared state is sized for it).
pub const MAX_DEVICES: usize = 16;
/// NVML's NVML_NVLINK_MAX_LINKS (18 since Hopper).
pub const MAX_NVLINKS: usize = 18;
/// The largest minor number a GPU's device node may have: the NVIDIA driver keeps 254 for
/// `/dev/nvidia-modeset` and 255 for `/dev/nvidiactl`.
pub const MAX_GPU_MINOR: u32 = 253;

pub const PRESETS: &[&str] = &["single", "dgx1-v100", "dgx-a100", "h200", "pcie-8"];

/// PCIe/CPU distance between two GPUs, as `nvidia-smi topo -m` and NVML's
/// `nvmlDeviceGetTopologyCommonAncestor` name it (values are `nvmlGpuTopologyLevel_t`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum PcieLevel {
    /// Same board (two GPUs on one card).
    Internal = 0,
    /// PIX: at most one PCIe switch between them.
    Single = 10,
    /// PXB: several PCIe switches, no host bridge.
    Multiple = 20,
    /// PHB: through one PCIe host bridge.
    HostBridge = 30,
    /// NODE: between host bridges of one NUMA node.
    Node = 40,
    /// SYS: across NUMA nodes (the SMP interconnect).
    System = 50,
}

impl PcieLevel {
    pub fn legend(self) -> &'static str {
        match self {
            PcieLevel::Internal => "X",
            PcieLevel::Single => "PIX",
            PcieLevel::Multiple => "PXB",
            PcieLevel::HostBridge => "PHB",
            PcieLevel::Node => "NODE",
            PcieLevel::System => "SYS",
        }
    }
}

/// Where the far end of one NVLink of a device goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LinkPeer {
    Gpu(usize),
    /// An NVSwitch, by index into [`Model::nvswitches`].
    Switch(usize),
}

#[derive(Clone, Debug, PartialEq)]
pub struct Device {
    pub name: String,
    pub uuid: String,
    pub pci_domain: u32,
    pub pci_bus: u32,
    pub pci_device: u32,
    /// PCI device id in the high 16 bits, vendor (0x10de) in the low, as NVML's pciDeviceId.
    pub pci_device_id: u32,
    /// The device node's minor number: the GPU is `/dev/nvidia<minor>`, what
    /// `nvmlDeviceGetMinorNumber` answers. Usually, but not always, the NVML index: the two are
    /// numbered independently (NVML enumerates, the kernel driver assigns minors as it probes).
    /// Presets use the index; model files may set it (`minor`).
    pub minor: u32,
    pub memory: u64,
    pub sm_count: u32,
    pub cc: (u32, u32),
    pub numa_node: u32,
    /// Leaf PCIe switch; GPUs behind one switch are PIX to each other.
    pub pcie_switch: u32,
    /// PCIe host bridge (root complex); GPUs under one but on different switches are PXB.
    pub pcie_root: u32,
    /// NVLink generation (2 = Volta, 3 = Ampere, 4 = Hopper); 0 when the device has none.
    pub nvlink_version: u32,
    /// The remote end of each NVLink, in link order.
    pub links: Vec<LinkPeer>,
    /// Device memory a context takes that no allocation call shows: charged while the context
    /// lives (a primary context while retained). Default [`context_memory_for`] its SM count
    /// (a few hundred MiB, as the real driver's); model files may set it (`context_memory`, 0
    /// for none).
    pub context_memory: u64,
    // ---- added by i17-device: the board's published figures (see [`Specs`]) ----
    pub specs: Specs,
}

impl Device {
    /// `cuDeviceGetPCIBusId`'s form: `dddd:bb:dd.0`.
    pub fn pci_bus_id_cuda(&self) -> String {
        format!(
            "{:04x}:{:02x}:{:02x}.0",
            self.pci_domain, self.pci_bus, self.pci_device
        )
    }
    /// NVML's `busId` form: `dddddddd:bb:dd.0`.
    pub fn pci_bus_id_nvml(&self) -> String {
        format!(
            "{:08x}:{:02x}:{:02x}.0",
            self.pci_domain, self.pci_bus, self.pci_device
        )
    }
    pub fn uuid_bytes(&self) -> [u8; 16] {
        parse_uuid(&self.uuid).unwrap_or_default()
    }
    /// The PCIe generation of the GPU's host interface (an x16 link): Gen3 on Volta (Tesla V100
    /// whitepaper, "PCIe Gen 3"), Gen4 on Ampere (A100 whitepaper and A10 datasheet, "PCIe
    /// Gen4"), Gen5 from Hopper on (an H100's `nvidia-smi -q`: "Max 5"). What NVML's link
    /// generation queries answer, and so what the device plugin's PCIe bandwidth is.
    pub fn pcie_generation(&self) -> u32 {
        match self.cc.0 {
            ..=7 => 3,
            8 => 4,
            _ => 5,
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct NvSwitch {
    pub pci_bus_id: String,
    /// PCI device id in the high 16 bits, vendor (0x10de) in the low, as NVML reports the remote
    /// end of a link into it (`nvmlDeviceGetNvLinkRemotePciInfo_v2`'s pciDeviceId).
    pub pci_device_id: u32,
}

/// PCI device id of the second-generation NVSwitch of HGX A100 boards: "1af1 GA100 [A100
/// NVSwitch]" (PCI ID database).
pub const NVSWITCH_A100_PCI_DEVICE_ID: u32 = 0x1af1_10de;
/// PCI device id of the third-generation NVSwitch of HGX H100/H200 boards: "22a3 GH100 [H100
/// NVSwitch]", as `lspci -nn` prints it on H100 and H20 HGX hosts ("NVIDIA Corporation GH100
/// [H100 NVSwitch] [10de:22a3]"; several outputs found with this project's code search).
pub const NVSWITCH_H100_PCI_DEVICE_ID: u32 = 0x22a3_10de;

#[derive(Clone, Debug, PartialEq)]
pub struct Model {
    pub name: String,
    pub devices: Vec<Device>,
    pub nvswitches: Vec<NvSwitch>,
    /// What cuDriverGetVersion reports (1000 * major + 10 * minor).
    pub driver_version: i32,
    /// NVML's system driver version string.
    pub driver_release: String,
    /// Run time of a kernel that does not say its own (`sim_busy*` kernels do).
    pub default_kernel_ns: u64,
}

/// What `cuDriverGetVersion` reports unless a model says otherwise: CUDA 13.0, as today's R580
/// drivers do (nvidia-smi's "CUDA Version" is this number: "Driver Version: 580.95.05  CUDA
/// Version: 13.0" on H100s in Unsloth's multi-GPU guide, one of several R580 outputs found with
/// this project's code search; the CUDA 13.0 release notes,
/// <https://docs.nvidia.com/cuda/archive/13.0.0/cuda-toolkit-release-notes/index.html>, ship it
/// with driver 580.65.06 or newer). Both runtimes accept it: libcudart 12.x runs on any newer
/// driver, and 13.x refuses only drivers older than 13.0 (cudaErrorInsufficientDriver, 35; both
/// seen with NVIDIA's own runtimes in `tests/cudart.rs`).
pub const DEFAULT_DRIVER_VERSION: i32 = 13000;

/// NVML's driver version string beside [`DEFAULT_DRIVER_VERSION`]: an R580 release that reports
/// CUDA 13.0 (the nvidia-smi output cited there).
pub const DEFAULT_DRIVER_RELEASE: &str = "580.95.05";

/// The most a machine file may hold: a real one is a few KiB.
pub const MAX_MODEL_FILE: u64 = 1 << 20;

/// What a file is, for messages: "a FIFO", "a directory", ...
pub fn file_kind(t: std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt as _;
    if t.is_dir() {
        "a directory"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else if t.is_socket() {
        "a socket"
    } else if t.is_symlink() {
        "a symbolic link"
    } else {
        "a regular file"
    }
}

/// A machine file's text. Only a regular file of at most [`MAX_MODEL_FILE`] bytes is read: the
/// file is checked before it is opened, opened with O_NONBLOCK (so a FIFO put there since
/// cannot block the open) and checked again on the descriptor, and the read stops past the
/// bound, so neither a FIFO, a device nor a huge file can hang or swamp the caller.
fn read_model_file(path: &str) -> Result<String, String> {
    use std::io::Read as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let regular = |m: std::fs::Metadata| {
        if !m.is_file() {
            Err(format!(
                "{path} is {}, not a machine file (a regular .toml/.json file)",
                file_kind(m.file_type())
            ))
        } else if m.len() > MAX_MODEL_FILE {
            Err(too_large(path, m.len()))
        } else {
            Ok(())
        }
    };
    regular(std::fs::metadata(path).map_err(|e| format!("cannot read {path}: {e}"))?)?;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
        .map_err(|e| format!("cannot read {path}: {e}"))?;
    regular(
        file.metadata()
            .map_err(|e| format!("cannot read {path}: {e}"))?,
    )?;
    let mut text = String::new();
    file.take(MAX_MODEL_FILE + 1)
        .read_to_string(&mut text)
        .map_err(|e| format!("cannot read {path}: {e}"))?;
    if text.len() as u64 > MAX_MODEL_FILE {
        return Err(too_large(path, text.len() as u64));
    }
    Ok(text)
}

fn too_large(path: &str, len: u64) -> String {
    format!("{path} holds more than {MAX_MODEL_FILE} bytes ({len}): not a machine file")
}

impl Model {
    /// The model `CUVISOR_SIM` names (default `single`).
    pub fn from_env() -> Result<Model, String> {
        match std::env::var("CUVISOR_SIM") {
            Ok(v) if !v.trim().is_empty() => Model::load(v.trim()),
            _ => Model::load("single"),
        }
    }

    /// A preset by name, or a TOML/JSON file by path.
    pub fn load(spec: &str) -> Result<Model, String> {
        if let Some(m) = preset(spec) {
            return Ok(m);
        }
        let looks_like_path =
            spec.contains('/') || spec.ends_with(".toml") || spec.ends_with(".json");
        if !looks_like_path {
            return Err(format!(
                "CUVISOR_SIM={spec:?} is neither a preset ({}) nor a .toml/.json file",
                PRESETS.join(", ")
            ));
        }
        let text = read_model_file(spec).map_err(|e| format!("CUVISOR_SIM: {e}"))?;
        let file: ModelFile = if spec.ends_with(".json") {
            serde_json::from_str(&text).map_err(|e| format!("CUVISOR_SIM: {spec}: {e}"))?
        } else {
            toml::from_str(&text).map_err(|e| format!("CUVISOR_SIM: {spec}: {e}"))?
        };
        file.into_model(spec)
    }

    /// NVLink count between two GPUs (0 when none, or through NVSwitch: see [`Model::nvlink_bandwidth_links`]).
    pub fn direct_links(&self, a: usize, b: usize) -> u32 {
        self.devices[a]
            .links
            .iter()
            .filter(|p| **p == LinkPeer::Gpu(b))
            .count() as u32
    }

    /// How many links' worth of NVLink bandwidth joins two GPUs: direct links, or for NVSwitch
    /// boxes the smaller of the two GPUs' switch link counts (every GPU reaches every other at its
    /// full switch bandwidth).
    pub fn nvlink_bandwidth_links(&self, a: usize, b: usize) -> u32 {
        if a == b {
            return 0;
        }
        let direct = self.direct_links(a, b);
        if direct > 0 {
            return direct;
        }
        let sw = |d: usize| {
            self.devices[d]
                .links
                .iter()
                .filter(|p| matches!(p, LinkPeer::Switch(_)))
                .count() as u32
        };
        sw(a).min(sw(b))
    }

    pub fn pcie_level(&self, a: usize, b: usize) -> PcieLevel {
        let (x, y) = (&self.devices[a], &self.devices[b]);
        if a == b {
            PcieLevel::Internal
        } else if x.pcie_switch == y.pcie_switch {
            PcieLevel::Single
        } else if x.pcie_root == y.pcie_root {
            PcieLevel::Multiple
        } else if x.numa_node == y.numa_node {
            PcieLevel::Node
        } else {
            PcieLevel::System
        }
    }

    /// A stable 64-bit fingerprint of everything that shapes the shared state.
    pub fn fingerprint(&self) -> u64 {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in format!("{self:?}").bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        h
    }

    /// The machine's interconnect, for timing copies and planning rings (`cuvisor_fabric`):
    /// each GPU's PCIe generation and place, its NVLinks (direct, or into NVSwitches) and its
    /// memory bandwidth (from its memory clock and bus width, as CUDA's deviceQuery computes it).
    pub fn fabric(&self) -> cuvisor_fabric::Fabric {
        let gpus = self
            .devices
            .iter()
            .map(|d| cuvisor_fabric::Gpu {
                pcie_gen: d.pcie_generation(),
                numa_node: d.numa_node,
                pcie_switch: d.pcie_switch,
                pcie_root: d.pcie_root,
                nvlink_gen: d.nvlink_version,
                switch_links: d
                    .links
                    .iter()
                    .filter(|p| matches!(p, LinkPeer::Switch(_)))
                    .count() as u32,
                // kHz x 2 (double data rate) x bus bytes.
                memory_gbps: d.specs.memory_clock_khz as f64
                    * 1e3
                    * 2.0
                    * (d.specs.memory_bus_width / 8) as f64
                    / 1e9,
            })
            .collect();
        let mut links = Vec::new();
        for a in 0..self.devices.len() {
            for b in a + 1..self.devices.len() {
                let n = self.direct_links(a, b);
                if n > 0 {
                    links.push((a, b, n));
                }
            }
        }
        // Built from a checked model: at most MAX_DEVICES (16) devices, links between distinct
        // devices, so the fabric's own checks cannot fail.
        cuvisor_fabric::Fabric::new(gpus, &links).expect("a checked model is a valid fabric")
    }

    /// The matrix `nvidia-smi topo -m` prints, with the same legend, straight from the model.
    pub fn topo_matrix(&self) -> String {
        render_topo_matrix(
            self.devices.len(),
            |a, b| match self.nvlink_bandwidth_links(a, b) {
                0 => self.pcie_level(a, b).legend().to_string(),
                links => format!("NV{links}"),
            },
            |a| {
                let node = self.devices[a].numa_node;
                (cpu_affinity(node), node.to_string())
            },
        )
    }
}

/// Renders `nvidia-smi topo -m`'s matrix for `n` GPUs: `cell(a, b)` for each pair a != b (NV#,
/// PIX, ...), `affinity(a)` the CPU and NUMA affinity columns of row a; then the legend.
pub fn render_topo_matrix(
    n: usize,
    cell: impl Fn(usize, usize) -> String,
    affinity: impl Fn(usize) -> (String, String),
) -> String {
    let mut out = String::from("\t");
    for i in 0..n {
        let _ = write!(out, "GPU{i}\t");
    }
    out.push_str("CPU Affinity\tNUMA Affinity\n");
    for a in 0..n {
        let _ = write!(out, "GPU{a}\t");
        for b in 0..n {
            let c = if a == b { "X".to_string() } else { cell(a, b) };
            let _ = write!(out, "{c}\t");
        }
        let (cpus, numa) = affinity(a);
        let _ = writeln!(out, "{cpus}\t{numa}");
    }
    out.push_str(TOPO_LEGEND);
    out
}

pub const TOPO_LEGEND: &str = "\nLegend:\n\n  X    = Self\n  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)\n  NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node\n  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)\n  PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)\n  PIX  = Connection traversing at most a single PCIe bridge\n  NV#  = Connection traversing a bonded set of # NVLinks\n";

/// The CPUs of a simulated NUMA node: 16 per node, as "0-15".
pub fn cpu_affinity(node: u32) -> String {
    format!("{}-{}", node * 16, node * 16 + 15)
}

/// The host CPU set a NUMA node's GPUs are near to (bit i = CPU i), as NVML's cpuSet words.
pub fn cpu_set(node: u32) -> u64 {
    0xffffu64 << ((node * 16) % 64)
}

pub use cuvisor_shm::uuid::{format as format_uuid, parse as parse_uuid};

/// A deterministic UUID for device `index` of machine `machine`.
fn make_uuid(machine: &str, index: usize) -> String {
    let mut b = [0u8; 16];
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for (i, chunk) in b.chunks_mut(8).enumerate() {
        for byte in format!("{machine}/{index}/{i}").bytes() {
            h ^= byte as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        chunk.copy_from_slice(&h.to_be_bytes());
    }
    b[6] = (b[6] & 0x0f) | 0x40; // RFC 4122 version 4 shape, like real GPU UUIDs
    b[8] = (b[8] & 0x3f) | 0x80;
    format_uuid(&b)
}

// ---- context memory (i17-torch) -------------------------------------------------------------
// What a bare context takes on a real GPU, with CUDA 12.2+ drivers (lazy module loading on by
// default on Linux since 12.2: NVIDIA developer forums, "How to enable the CUDA's lazy module
// loading", https://forums.developer.nvidia.com/t/290090; before 11.7 a context also held every
// kernel of every library loaded, ">1000MB" for PyTorch: ptrblck, pytorch/pytorch#107667; here
// module images charge their own code and variables as they load instead).
//
// Public measurements of a bare primary context (cudaMemGetInfo, or nvidia-smi's per-process
// memory, before any allocation):
//   - RTX 4060 Ti (34 SMs) 107 MiB, RTX PRO 6000 Blackwell (188 SMs) 555 MiB, "the cost scales
//     with SM count" (ggml-org/llama.cpp#23604, 2026);
//   - "120-550 MB depending on GPU" (ggml-org/llama.cpp#20595, 2026);
//   - H100 (132 SMs): "each primary context costs ~534 MiB" (meta-pytorch/torchcomms#777, 2026);
//   - RTX 3090 (82 SMs): "a flat 256 MiB", PyTorch 2.7.1, driver 610 (invoke-ai/InvokeAI#9413);
//   - A100 (108 SMs): its CUDA stack alone "216MB" (arcs-skku/EMDC_llvm#13); "~300MB" per
//     PyTorch context with lazy loading (ptrblck, pytorch/pytorch#107667, 2023).
// The two llama.cpp points give 8 MiB + 2.9 MiB per SM (the per-SM part being mostly each SM's
// share of the stack and local memory); it puts an A100 at 322 MiB (measured ~300), an RTX 3090
// at 246 (256), an H100 at 392 (534: Hopper takes more per SM than the fit). Rounded up to 2 MiB.
//   V100 (80 SMs) 240 MiB, A10 (72 SMs) 218 MiB, A100 (108 SMs) 322 MiB.

/// The device memory a bare context takes on a GPU of `sms` SMs (see the block above).
pub fn context_memory_for(sms: u32) -> u64 {
    const MIB: u64 = 1 << 20;
    let tenths = 80 + 29 * sms as u64; // 8 MiB + 2.9 MiB per SM, in tenths of MiB
    tenths.div_ceil(10).next_multiple_of(2) * MIB
}

struct Gpu {
    name: &'static str,
    memory: u64,
    sm: u32,
    cc: (u32, u32),
    pci_device_id: u32,
    nvlink: u32,
    // ---- added by i17-device ----
    specs: Specs,
}

const V100: Gpu = Gpu {
    name: "Tesla V100-SXM2-16GB",
    memory: 16 * GIB,
    sm: 80,
    cc: (7, 0),
    pci_device_id: 0x1db1_10de,
    nvlink: 2,
    specs: V100_SPECS,
};
const A100: Gpu = Gpu {
    name: "NVIDIA A100-SXM4-80GB",
    memory: 80 * GIB,
    sm: 108,
    cc: (8, 0),
    pci_device_id: 0x20b2_10de,
    nvlink: 3,
    specs: A100_SPECS,
};
const A10: Gpu = Gpu {
    name: "NVIDIA A10",
    memory: 24 * GIB,
    sm: 72,
    cc: (8, 6),
    pci_device_id: 0x2236_10de,
    nvlink: 0,
    specs: A10_SPECS,
};
/// NVIDIA H200 (SXM5, 141 GB HBM3e), as on HGX H200 / DGX H200 boards. Name and memory as
/// `nvidia-smi` prints them on 8 x H200 hosts: "NVIDIA H200", "143771MiB" total (the figure of
/// every H200 SXM output found with this project's code search, drivers 550.90.12 to 580.x; the
/// `nvidia-smi -q` of one, driver 550.90.12: "FB Memory Usage / Total: 143771 MiB", "Device
/// Id: 0x233510DE", "Sub System Id: 0x18BE10DE", PCIe "Max: 5", x16). 132 SMs and compute
/// capability 9.0 as the H100 SXM5, the same GH100 die (deviceQuery on 8 x H100 80GB HBM3,
/// thamada/nvidia-smi `nvsim/H100SXMx8_deviceQuery.py`: "(132) Multiprocessors", "9.0"). PCI
/// device 0x2335, the PCI ID database's "2335 GH100 [H200 SXM 141GB]" (NVIDIA's
/// mig-parted changelog: "Add H200 with PCI ID 0x233510DE").
const H200: Gpu = Gpu {
    name: "NVIDIA H200",
    memory: 143_771 * MIB,
    sm: 132,
    cc: (9, 0),
    pci_device_id: 0x2335_10de,
    nvlink: 4,
    specs: H200_SPECS,
};
const SINGLE: Gpu = Gpu {
    name: "NVIDIA A100-PCIE-16GB (simulated)",
    memory: 16 * GIB,
    sm: 108,
    cc: (8, 0),
    pci_device_id: 0x20f1_10de,
    nvlink: 0,
    specs: SINGLE_SPECS,
};

fn machine(name: &str, gpu: &Gpu, n: usize, place: impl Fn(usize) -> (u32, u32, u32)) -> Model {
    let devices = (0..n)
        .map(|i| {
            let (switch, root, numa) = place(i);
            Device {
                name: gpu.name.to_string(),
                uuid: make_uuid(name, i),
                pci_domain: 0,
                pci_bus: [
                    0x07, 0x0f, 0x47, 0x4e, 0x87, 0x90, 0xb7, 0xbd, 0xc1, 0xc5, 0xc9, 0xcd, 0xd1,
                    0xd5, 0xd9, 0xdd,
                ][i],
                pci_device: 0,
                pci_device_id: gpu.pci_device_id,
                minor: i as u32,
                memory: gpu.memory,
                sm_count: gpu.sm,
                cc: gpu.cc,
                numa_node: numa,
                pcie_switch: switch,
                pcie_root: root,
                nvlink_version: gpu.nvlink,
                links: Vec::new(),
                context_memory: context_memory_for(gpu.sm),
                specs: gpu.specs,
            }
        })
        .collect();
    Model {
        name: name.to_string(),
        devices,
        nvswitches: Vec::new(),
        driver_version: DEFAULT_DRIVER_VERSION,
        driver_release: DEFAULT_DRIVER_RELEASE.to_string(),
        default_kernel_ns: 10_000,
    }
}

/// A PCIe switch hangs under one root complex, and a root complex belongs to one NUMA node: a
/// machine whose devices say otherwise is no tree. Refused, because the two readings of it would
/// disagree: `pcie_level` (what `nvidia-smi topo -m` and NVML's common ancestor show) looks at
/// the switch first, the interconnect model (`Model::fabric`: peer access, copy routes) at the
/// root complex, so two GPUs on one switch under "two roots" would be PIX to NVML yet no peers
/// to the driver.
fn check_pcie_tree(devices: &[Device]) -> Result<(), String> {
    for (i, d) in devices.iter().enumerate() {
        for (j, o) in devices[..i].iter().enumerate() {
            if d.pcie_switch == o.pcie_switch && d.pcie_root != o.pcie_root {
                return Err(format!(
                    "devices {j} and {i} share PCIe switch {} but name roots {} and {}: a \
                     switch hangs under one root complex",
                    d.pcie_switch, o.pcie_root, d.pcie_root
                ));
            }
            if d.pcie_root == o.pcie_root && d.numa_node != o.numa_node {
                return Err(format!(
                    "devices {j} and {i} share PCIe root {} but name NUMA nodes {} and {}: a \
                     root complex belongs to one NUMA node",
                    d.pcie_root, o.numa_node, d.numa_node
                ));
            }
        }
    }
    Ok(())
}

/// Wire direct NVLinks: for each (a, b, count), `count` links on each side, in list order.
fn wire(m: &mut Model, pairs: &[(usize, usize, u32)]) -> Result<(), String> {
    for &(a, b, count) in pairs {
        if a >= m.devices.len() || b >= m.devices.len() || a == b {
            return Err(format!("nvlink {a}-{b}: no such pair of devices"));
        }
        for _ in 0..count {
            m.devices[a].links.push(LinkPeer::Gpu(b));
            m.devices[b].links.push(LinkPeer::Gpu(a));
        }
    }
    for (i, d) in m.devices.iter().enumerate() {
        if d.links.len() > MAX_NVLINKS {
            return Err(format!(
                "device {i} has {} NVLinks, at most {MAX_NVLINKS}",
                d.links.len()
            ));
        }
    }
    Ok(())
}

/// DGX-1 (V100) hybrid cube-mesh, as NVIDIA's DGX-1 documentation draws it.
pub const DGX1_LINKS: &[(usize, usize, u32)] = &[
    (0, 1, 1),
    (0, 2, 1),
    (0, 3, 2),
    (0, 4, 2),
    (1, 2, 2),
    (1, 3, 1),
    (1, 5, 2),
    (2, 3, 2),
    (2, 6, 1),
    (3, 7, 1),
    (4, 5, 1),
    (4, 6, 1),
    (4, 7, 2),
    (5, 6, 2),
    (5, 7, 1),
    (6, 7, 2),
];

pub fn preset(name: &str) -> Option<Model> {
    Some(match name {
        "single" => machine("single", &SINGLE, 1, |_| (0, 0, 0)),
        "dgx1-v100" => {
            let mut m = machine("dgx1-v100", &V100, 8, |i| {
                (i as u32 / 2, i as u32 / 2, i as u32 / 4)
            });
            wire(&mut m, DGX1_LINKS).expect("preset wiring is valid");
            m
        }
        "dgx-a100" => {
            // Six NVSwitches; every A100 has 12 links, two to each switch. NVML reports the
            // switch as the remote end of each link, never a peer GPU.
            let mut m = machine("dgx-a100", &A100, 8, |i| {
                (i as u32 / 2, i as u32 / 2, i as u32 / 4)
            });
            m.nvswitches = (0..6)
                .map(|s| NvSwitch {
                    pci_bus_id: format!("00000000:{:02x}:00.0", 0xc4 + s),
                    pci_device_id: NVSWITCH_A100_PCI_DEVICE_ID,
                })
                .collect();
            for d in &mut m.devices {
                d.links = (0..12).map(|l| LinkPeer::Switch(l / 2)).collect();
            }
            m
        }
        "h200" => h200(),
        "pcie-8" => machine("pcie-8", &A10, 8, |i| {
            (i as u32 / 2, i as u32 / 4, i as u32 / 4)
        }),
        _ => return None,
    })
}

/// NVSwitch chips on an HGX H100/H200 baseboard, and how many of each GPU's 18 NVLinks go to each
/// (in link order: links 0-4 to switch 0, 5-8 to 1, 9-12 to 2, 13-17 to 3). NVIDIA Fabric
/// Manager User Guide, "The NVIDIA HGX H100 GPU Baseboard": eight H100s and four
/// third-generation NVSwitches, every GPU's 18 NVLink 4 links into the switches; the 5/4/4/5
/// split as NVIDIA's HGX H100 baseboard diagrams draw it (UNVERIFIED against a stored copy: no
/// text of the split was found with this project's search; only the total, 18, shows in NVML).
pub const HGX_H100_SWITCH_LINKS: [usize; 4] = [5, 4, 4, 5];

/// The `h200` preset: a DGX H200 / HGX H200 box, 8 x H200 on four NVSwitches.
///
/// - NVLink: every GPU 18 links ([`HGX_H100_SWITCH_LINKS`]), so `nvidia-smi topo -m` shows NV18
///   between every pair, as on real 8 x H100/H200 boxes (e.g. the `topo -m` of an 8 x H100 80GB
///   HBM3 host with driver 580.126.20, and sgl-project/sglang issue #24966's on an HGX H20,
///   the same baseboard: NV18 in every GPU cell).
/// - PCIe and NUMA: GPUs 0-3 on NUMA node 0, 4-7 on node 1 (the same two `topo -m` outputs;
///   the DGX H100 User Guide's network-module table likewise puts GPUs 0-3 behind CPU 0 and 4-7
///   behind CPU 1). Each GPU behind its own PCIe switch (its NIC beside it: GPU0-NIC0 "PIX"),
///   two such switches under one upstream switch (GPU0-NIC1 "PXB") on one host bridge, the
///   pairs 0-1, 2-3, 4-5, 6-7 ("NODE" between pairs of a socket, "SYS" across sockets), as the
///   8 x H100 host's matrix shows. So GPU0-GPU1 is PXB, GPU0-GPU2 NODE, GPU0-GPU4 SYS.
/// - Bus ids from an 8 x H200 host's `nvidia-smi` (driver 570.158.01): 0a, 18, 3b, 44, 87, 90,
///   b9, c2; the NVSwitches at 05-08:00.0, as `lspci` lists them on an H100 HGX host.
fn h200() -> Model {
    let mut m = machine("h200", &H200, 8, |i| (i as u32, i as u32 / 2, i as u32 / 4));
    for (d, bus) in m
        .devices
        .iter_mut()
        .zip([0x0a, 0x18, 0x3b, 0x44, 0x87, 0x90, 0xb9, 0xc2])
    {
        d.pci_bus = bus;
    }
    m.nvswitches = (0..HGX_H100_SWITCH_LINKS.len())
        .map(|s| NvSwitch {
            pci_bus_id: format!("00000000:{:02x}:00.0", 0x05 + s),
            pci_device_id: NVSWITCH_H100_PCI_DEVICE_ID,
        })
        .collect();
    for d in &mut m.devices {
        d.links = HGX_H100_SWITCH_LINKS
            .iter()
            .enumerate()
            .flat_map(|(s, &n)| std::iter::repeat_n(LinkPeer::Switch(s), n))
            .collect();
    }
    m
}

/// A model file (TOML or JSON). Example:
///
/// ```toml
/// name = "two-a10"
/// [[device]]
/// name = "NVIDIA A10"
/// memory = "24Gi"
/// [[device]]
/// name = "NVIDIA A10"
/// memory = "24Gi"
/// pcie_switch = 0
/// minor = 3          # /dev/nvidia3 (default: the device's index)
/// [[nvlink]]
/// a = 0
/// b = 1
/// links = 4
/// ```
#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
pub struct ModelFile {
    pub name: Option<String>,
    #[serde(rename = "device", alias = "devices")]
    pub devices: Vec<DeviceFile>,
    #[serde(default, rename = "nvlink", alias = "nvlinks")]
    pub nvlinks: Vec<NvlinkFile>,
    /// NVSwitch boxes: links from every GPU to the switches (spread evenly over `nvswitches`).
    pub nvswitch_links_per_gpu: Option<u32>,
    pub nvswitches: Option<u32>,
    pub driver_version: Option<i32>,
    pub default_kernel_ns: Option<u64>,
}

#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
pub struct DeviceFile {
    pub name: Option<String>,
    pub uuid: Option<String>,
    /// Bytes, or a Kubernetes-style quantity ("16Gi", "512Mi").
    pub memory: Quantity,
    pub sm_count: Option<u32>,
    /// "8.0"
    pub compute_capability: Option<String>,
    pub numa_node: Option<u32>,
    pub pcie_switch: Option<u32>,
    pub pcie_root: Option<u32>,
    pub pci_bus: Option<u32>,
    /// The device node's minor number (`/dev/nvidia<minor>`, `nvmlDeviceGetMinorNumber`); default
    /// the device's index. Distinct per device, at most [`MAX_GPU_MINOR`].
    pub minor: Option<u32>,
    pub nvlink_version: Option<u32>,
    pub context_memory: Option<Quantity>,
}

#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
pub struct NvlinkFile {
    pub a: usize,
    pub b: usize,
    pub links: u32,
}

#[derive(Deserialize, Debug, Clone)]
#[serde(untagged)]
pub enum Quantity {
    Bytes(u64),
    Text(String),
}

impl Quantity {
    pub fn bytes(&self) -> Result<u64, String> {
        match self {
            Quantity::Bytes(b) => Ok(*b),
            Quantity::Text(t) => parse_quantity(t),
        }
    }
}

/// Parses "16Gi", "512Mi", "1.5Gi", "4G", "123" into bytes (cuvisor's one size parser).
pub fn parse_quantity(text: &str) -> Result<u64, String> {
    cuvisor_shm::quantity::parse_quantity(text).map_err(|e| format!("{text:?}: {e}"))
}

impl ModelFile {
    fn into_model(self, origin: &str) -> Result<Model, String> {
        let name = self.name.clone().unwrap_or_else(|| origin.to_string());
        if self.devices.is_empty() || self.devices.len() > MAX_DEVICES {
            return Err(format!(
                "{origin}: needs 1 to {MAX_DEVICES} devices, has {}",
                self.devices.len()
            ));
        }
        let mut m = machine(&name, &SINGLE, self.devices.len(), |i| {
            (i as u32, i as u32, 0)
        });
        for (i, (d, f)) in m.devices.iter_mut().zip(&self.devices).enumerate() {
            let err = |e: String| format!("{origin}: device {i}: {e}");
            if let Some(n) = &f.name {
                d.name = n.clone();
                if let Some(g) = [&V100, &A100, &H200, &A10, &SINGLE]
                    .iter()
                    .find(|g| g.name == n)
                {
                    d.specs = g.specs;
                }
            }
            if let Some(u) = &f.uuid {
                parse_uuid(u).ok_or_else(|| {
                    err(format!(
                        "uuid {u:?} is not GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"
                    ))
                })?;
                d.uuid = u.clone();
            }
            d.memory = f.memory.bytes().map_err(err)?;
            if d.memory == 0 {
                return Err(err("memory must be > 0".into()));
            }
            if let Some(s) = f.sm_count {
                d.sm_count = s;
                d.context_memory = context_memory_for(s);
            }
            if let Some(cc) = &f.compute_capability {
                let (a, b) = cc
                    .split_once('.')
                    .ok_or_else(|| err(format!("compute_capability {cc:?} is not MAJOR.MINOR")))?;
                d.cc = (
                    a.parse()
                        .map_err(|_| err(format!("bad compute_capability {cc:?}")))?,
                    b.parse()
                        .map_err(|_| err(format!("bad compute_capability {cc:?}")))?,
                );
            }
            d.numa_node = f.numa_node.unwrap_or(0);
            d.pcie_switch = f.pcie_switch.unwrap_or(i as u32);
            d.pcie_root = f.pcie_root.unwrap_or(d.pcie_switch);
            if let Some(b) = f.pci_bus {
                d.pci_bus = b;
            }
            if let Some(minor) = f.minor {
                if minor > MAX_GPU_MINOR {
                    return Err(err(format!(
                        "minor {minor} > {MAX_GPU_MINOR} (254 and 255 are nvidia-modeset's and \
                         nvidiactl's)"
                    )));
                }
                d.minor = minor;
            }
            d.nvlink_version = f.nvlink_version.unwrap_or(
                if self.nvlinks.is_empty() && self.nvswitch_links_per_gpu.is_none() {
                    0
                } else {
                    3
                },
            );
            if let Some(c) = &f.context_memory {
                d.context_memory = c.bytes().map_err(err)?;
            }
        }
        for (i, d) in m.devices.iter().enumerate() {
            if let Some(j) = m.devices[..i].iter().position(|o| o.minor == d.minor) {
                return Err(format!(
                    "{origin}: devices {j} and {i} both have minor {} (/dev/nvidia{})",
                    d.minor, d.minor
                ));
            }
        }
        check_pcie_tree(&m.devices).map_err(|e| format!("{origin}: {e}"))?;
        let pairs: Vec<_> = self.nvlinks.iter().map(|l| (l.a, l.b, l.links)).collect();
        wire(&mut m, &pairs).map_err(|e| format!("{origin}: {e}"))?;
        if let Some(per_gpu) = self.nvswitch_links_per_gpu {
            let switches = self.nvswitches.unwrap_or(1).max(1) as usize;
            if per_gpu as usize > MAX_NVLINKS {
                return Err(format!(
                    "{origin}: nvswitch_links_per_gpu {per_gpu} > {MAX_NVLINKS}"
                ));
            }
            // Hopper and later boards carry third-generation NVSwitches, older ones the A100's.
            let hopper = m.devices.iter().any(|d| d.nvlink_version >= 4);
            m.nvswitches = (0..switches)
                .map(|s| NvSwitch {
                    pci_bus_id: format!("00000000:{:02x}:00.0", 0xc4 + s),
                    pci_device_id: if hopper {
                        NVSWITCH_H100_PCI_DEVICE_ID
                    } else {
                        NVSWITCH_A100_PCI_DEVICE_ID
                    },
                })
                .collect();
            for d in &mut m.devices {
                d.links = (0..per_gpu as usize)
                    .map(|l| LinkPeer::Switch(l * switches / per_gpu as usize))
                    .collect();
            }
        }
        if let Some(v) = self.driver_version {
            m.driver_version = v;
        }
        if let Some(k) = self.default_kernel_ns {
            m.default_kernel_ns = k;
        }
        Ok(m)
    }
}

// ---- added by i17-device: per-GPU published figures and per-architecture limits ----------------

/// A board's published figures, what `cuDeviceGetAttribute` (and NVML, where it repeats the
/// fact) answers for it. Per preset GPU below, each with its sources.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Specs {
    /// Peak (boost) SM clock, kHz (CU_DEVICE_ATTRIBUTE_CLOCK_RATE).
    pub clock_khz: u32,
    /// Peak memory clock, kHz (CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE).
    pub memory_clock_khz: u32,
    /// Memory bus width, bits.
    pub memory_bus_width: u32,
    /// L2 cache, bytes.
    pub l2_cache: u32,
    /// Copy engines (CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT).
    pub async_engines: u32,
    /// FP32 to FP64 throughput ratio.
    pub single_to_double_ratio: u32,
    /// PCI subsystem id in the high 16 bits, subsystem vendor in the low
    /// (CU_DEVICE_ATTRIBUTE_GPU_PCI_SUBSYSTEM_ID, NVML's pciSubSystemId).
    pub pci_subsystem_id: u32,
}

/// Tesla V100-SXM2-16GB. NVIDIA Tesla V100 GPU Architecture whitepaper (WP-08608-001_v1.1,
/// Table 1, "Tesla V100 for NVLink"): GPU boost clock 1530 MHz, 4096-bit HBM2, L2 6144 KB, FP64
/// at half the FP32 rate (7.8 vs 15.7 TFLOPS). Memory clock 877 MHz: the HBM2 data rate that gives
/// the whitepaper's 900 GB/s on 4096 bits (877 MHz x 2 x 512 B = 898 GB/s). Copy engines: 6
/// (UNVERIFIED: as recalled from deviceQuery outputs of SXM2 V100s; no output found in this
/// project's corpora). Subsystem 10de:1212, the PCI ID database's "Tesla V100-SXM2-16GB".
pub const V100_SPECS: Specs = Specs {
    clock_khz: 1_530_000,
    memory_clock_khz: 877_000,
    memory_bus_width: 4096,
    l2_cache: 6 << 20,
    async_engines: 6,
    single_to_double_ratio: 2,
    pci_subsystem_id: 0x1212_10de,
};

/// NVIDIA A100-SXM4-80GB. NVIDIA A100 Tensor Core GPU Architecture whitepaper (V1.0, Table 3):
/// boost clock 1410 MHz, 5120-bit HBM2(e), L2 40 MB, FP64 9.7 vs FP32 19.5 TFLOPS (ratio 2); the
/// A100 80GB datasheet's 2039 GB/s on 5120 bits is a 1593 MHz memory clock (x 2 x 640 B).
/// Copy engines: 3, the value this simulator answered before (deviceQuery on A100s prints "with 3
/// copy engine(s)"; UNVERIFIED against a stored output). Subsystem 10de:1463 (PCI ID database).
pub const A100_SPECS: Specs = Specs {
    clock_khz: 1_410_000,
    memory_clock_khz: 1_593_000,
    memory_bus_width: 5120,
    l2_cache: 40 << 20,
    async_engines: 3,
    single_to_double_ratio: 2,
    pci_subsystem_id: 0x1463_10de,
};

/// NVIDIA A10. A deviceQuery-style output on an A10 (aalanwyr/face2cuda, `step2cuda/README.md`):
/// clock 1695 MHz, 384-bit bus, L2 6291456 bytes, 1536 threads per SM. The A10 datasheet's 600
/// GB/s GDDR6 on 384 bits is a 6251 MHz memory clock (x 2 x 48 B). Copy engines: 2, as an RTX
/// 3090 (the same GA102 chip) reports (Jumperkables/cuda-benchmarking, `00_deviceQuery/README.md`).
/// FP64 at 1/32 of FP32 (UNVERIFIED: the GA102 whitepaper gives 2 FP64 units per SM to 128 FP32).
/// Subsystem 10de:1482 (PCI ID database).
pub const A10_SPECS: Specs = Specs {
    clock_khz: 1_695_000,
    memory_clock_khz: 6_251_000,
    memory_bus_width: 384,
    l2_cache: 6 << 20,
    async_engines: 2,
    single_to_double_ratio: 32,
    pci_subsystem_id: 0x1482_10de,
};

/// The simulated A100-PCIE-16GB: an A100-PCIE-40GB's board (no such 16 GB card exists) with less
/// memory. A100 whitepaper as above; the 40GB PCIe datasheet's 1555 GB/s on 5120 bits is a 1215
/// MHz memory clock. Subsystem 10de:145f, the 40GB PCIe card's (PCI ID database).
pub const SINGLE_SPECS: Specs = Specs {
    clock_khz: 1_410_000,
    memory_clock_khz: 1_215_000,
    memory_bus_width: 5120,
    l2_cache: 40 << 20,
    async_engines: 3,
    single_to_double_ratio: 2,
    pci_subsystem_id: 0x145f_10de,
};

/// NVIDIA H200 SXM. Clocks from an H200's `nvidia-smi -q` (driver 550.90.12): "Max Clocks /
/// SM: 1980 MHz", "Memory: 3201 MHz" (also the HGX H200 spec of scitix/sichek:
/// `0x233510de: MaxClock SM 1980, Memory 3201`). Bus 6144 bits: six HBM3e stacks of 1024 bits
/// (the H100 SXM5's five active stacks give its 5120 bits, deviceQuery above); 3201 MHz x 2 x
/// 768 B = 4.92 TB/s, the "4.8 TB/s" of NVIDIA's H200 datasheet. L2 50 MiB (the H100 SXM5's
/// deviceQuery: "L2 Cache Size: 52428800 bytes"; same die). Copy engines: 3, what deviceQuery
/// prints on the H100 SXM5 ("Yes with 3 copy engine(s)"; UNVERIFIED on an H200 itself). FP64
/// at half FP32 (H200 datasheet: 34 vs 67 TFLOPS). Subsystem 10de:18be (the `nvidia-smi -q`
/// above; 10de:18bf is the other H200 SXM board).
pub const H200_SPECS: Specs = Specs {
    clock_khz: 1_980_000,
    memory_clock_khz: 3_201_000,
    memory_bus_width: 6144,
    l2_cache: 50 << 20,
    async_engines: 3,
    single_to_double_ratio: 2,
    pci_subsystem_id: 0x18be_10de,
};

/// What a compute capability fixes per SM and per block: CUDA C++ Programming Guide, "Technical
/// Specifications per Compute Capability" (threads, blocks, shared memory per SM and opt-in per
/// block), and the toolkit's `cuda_occupancy.h` (CUDA 13.5: `cudaOccMaxBlocksPerMultiprocessor`,
/// `cudaOccSMemAllocationGranularity`, `cudaOccAlignUpShmemSizeVoltaPlus`'s carveout steps,
/// `cudaOccSMemPerBlock`: the reserved 1 KiB per block from Ampere on).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Arch {
    pub max_threads_per_sm: u32,
    pub max_blocks_per_sm: u32,
    pub regs_per_sm: u32,
    pub shared_per_sm: u32,
    pub shared_optin_per_block: u32,
    pub reserved_shared_per_block: u32,
    /// Shared memory is allocated to a block in units of this many bytes.
    pub shared_granularity: u32,
    /// The shared-memory sizes an SM can be configured to (KiB), smallest first.
    pub carveouts_kib: &'static [u32],
}

const KIB: u32 = 1024;
const VOLTA_CARVEOUTS: &[u32] = &[0, 8, 16, 32, 64, 96];
const GA100_CARVEOUTS: &[u32] = &[0, 8, 16, 32, 64, 100, 132, 164];
const GA10X_CARVEOUTS: &[u32] = &[0, 8, 16, 32, 64, 100];
const HOPPER_CARVEOUTS: &[u32] = &[0, 8, 16, 32, 64, 100, 132, 164, 196, 228];

/// The limits of compute capability `cc`. Capabilities the table does not list take the nearest
/// lower one of the same major, else sm_80's.
pub fn arch(cc: (u32, u32)) -> Arch {
    let a = |threads, blocks, smem_kib: u32, optin_kib: u32, reserved, gran, carve| Arch {
        max_threads_per_sm: threads,
        max_blocks_per_sm: blocks,
        regs_per_sm: 65536,
        shared_per_sm: smem_kib * KIB,
        shared_optin_per_block: optin_kib * KIB,
        reserved_shared_per_block: reserved,
        shared_granularity: gran,
        carveouts_kib: carve,
    };
    match cc {
        (7, 0..=4) => a(2048, 32, 96, 96, 0, 256, VOLTA_CARVEOUTS),
        (7, _) => a(1024, 16, 64, 64, 0, 256, &[32, 64]),
        (8, 0) => a(2048, 32, 164, 163, KIB, 128, GA100_CARVEOUTS),
        (8, 7) => a(2048, 16, 164, 163, KIB, 128, GA100_CARVEOUTS),
        (8, 9) => a(1536, 24, 100, 99, KIB, 128, GA10X_CARVEOUTS),
        (8, _) => a(1536, 16, 100, 99, KIB, 128, GA10X_CARVEOUTS),
        (9, _) | (10, _) => a(2048, 32, 228, 227, KIB, 128, HOPPER_CARVEOUTS),
        (12, _) => a(1536, 24, 100, 99, KIB, 128, GA10X_CARVEOUTS),
        _ => a(2048, 32, 164, 163, KIB, 128, GA100_CARVEOUTS),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_have_the_documented_shape() {
        let s = preset("single").unwrap();
        assert_eq!(s.devices.len(), 1);
        assert_eq!(s.devices[0].memory, 16 * GIB);
        let d = preset("dgx1-v100").unwrap();
        assert_eq!(d.devices.len(), 8);
        assert!(
            d.devices
                .iter()
                .all(|x| x.memory == 16 * GIB && x.links.len() == 6),
            "V100 has 6 NVLinks, all used"
        );
        assert_eq!(d.direct_links(0, 3), 2);
        assert_eq!(d.direct_links(0, 1), 1);
        assert_eq!(d.direct_links(0, 5), 0);
        assert_eq!(d.pcie_level(0, 1), PcieLevel::Single);
        assert_eq!(d.pcie_level(0, 5), PcieLevel::System);
        assert_eq!(d.devices[3].numa_node, 0);
        assert_eq!(d.devices[4].numa_node, 1);
        let a = preset("dgx-a100").unwrap();
        assert!(a
            .devices
            .iter()
            .all(|x| x.links.len() == 12 && x.memory == 80 * GIB));
        assert_eq!(
            a.direct_links(0, 1),
            0,
            "through NVSwitch, no direct GPU peer"
        );
        assert_eq!(a.nvlink_bandwidth_links(0, 7), 12);
        let p = preset("pcie-8").unwrap();
        assert_eq!(p.pcie_level(0, 1), PcieLevel::Single);
        assert_eq!(p.pcie_level(0, 3), PcieLevel::Multiple);
        assert_eq!(p.pcie_level(0, 4), PcieLevel::System);
        assert_eq!(p.nvlink_bandwidth_links(0, 1), 0);
    }

    #[test]
    fn h200_preset_is_a_dgx_h200() {
        let m = preset("h200").unwrap();
        assert_eq!(m.devices.len(), 8);
        assert_eq!(
            m.driver_version, DEFAULT_DRIVER_VERSION,
            "CUDA 13.0 by default"
        );
        for (i, d) in m.devices.iter().enumerate() {
            assert_eq!(d.name, "NVIDIA H200");
            assert_eq!(d.memory, 143_771 * MIB, "nvidia-smi's 143771MiB");
            assert_eq!((d.sm_count, d.cc), (132, (9, 0)));
            assert_eq!(d.pci_device_id, 0x2335_10de);
            assert_eq!(d.pcie_generation(), 5);
            assert_eq!(d.nvlink_version, 4);
            assert_eq!(d.specs, H200_SPECS);
            assert_eq!(d.numa_node, i as u32 / 4, "GPUs 0-3 NUMA 0, 4-7 NUMA 1");
            assert_eq!(d.links.len(), 18, "18 NVLink 4 links per GPU");
            for (s, &n) in HGX_H100_SWITCH_LINKS.iter().enumerate() {
                let to_s = d
                    .links
                    .iter()
                    .filter(|p| **p == LinkPeer::Switch(s))
                    .count();
                assert_eq!(to_s, n, "GPU{i} to NVSwitch {s}");
            }
        }
        assert_eq!(m.nvswitches.len(), 4);
        assert!(m
            .nvswitches
            .iter()
            .all(|s| s.pci_device_id == NVSWITCH_H100_PCI_DEVICE_ID));
        assert_eq!(m.devices[0].pci_bus_id_nvml(), "00000000:0a:00.0");
        assert_eq!(m.devices[7].pci_bus_id_nvml(), "00000000:c2:00.0");
        assert_eq!(
            m.pcie_level(0, 1),
            PcieLevel::Multiple,
            "PXB: one upstream switch"
        );
        assert_eq!(m.pcie_level(0, 2), PcieLevel::Node);
        assert_eq!(m.pcie_level(0, 4), PcieLevel::System);
        for a in 0..8 {
            for b in 0..8 {
                if a != b {
                    assert_eq!(m.direct_links(a, b), 0, "no direct GPU-GPU NVLink");
                    assert_eq!(m.nvlink_bandwidth_links(a, b), 18);
                }
            }
        }
        // 4.8 TB/s HBM3e: the memory clock and bus give 4.92 TB/s.
        let f = m.fabric();
        let gbps = f.gpus()[0].memory_gbps;
        assert!((4800.0..5000.0).contains(&gbps), "{gbps}");
        assert_eq!(
            f.capacity(cuvisor_fabric::Resource::SwitchPortOut(3)),
            450.0,
            "18 x 25 GB/s per direction"
        );
        assert!((0..8).all(|a| (0..8).all(|b| f.p2p_supported(a, b) == (a != b))));
    }

    #[test]
    fn contexts_take_the_cited_memory_per_gpu() {
        const MIB: u64 = 1 << 20;
        // The fit's own measurement points (see "context memory" above), then the presets.
        assert_eq!(
            context_memory_for(34),
            108 * MIB,
            "RTX 4060 Ti, measured 107 MiB"
        );
        assert_eq!(
            context_memory_for(188),
            554 * MIB,
            "RTX PRO 6000, measured 555 MiB"
        );
        for (name, mib) in [
            ("single", 322),
            ("dgx-a100", 322),
            ("dgx1-v100", 240),
            ("h200", 392),
            ("pcie-8", 218),
        ] {
            for d in preset(name).unwrap().devices {
                assert_eq!(d.context_memory, mib * MIB, "{name}: {}", d.name);
            }
        }
        let f: ModelFile = toml::from_str(
            "[[device]]\nmemory = \"8Gi\"\nsm_count = 40\n[[device]]\nmemory = \"8Gi\"\ncontext_memory = 0\n",
        )
        .unwrap();
        let m = f.into_model("test").unwrap();
        assert_eq!(m.devices[0].context_memory, 124 * MIB, "from its SM count");
        assert_eq!(m.devices[1].context_memory, 0, "as the file says");
    }

    #[test]
    fn presets_number_device_nodes_by_index() {
        for name in PRESETS {
            let m = preset(name).unwrap();
            for (i, d) in m.devices.iter().enumerate() {
                assert_eq!(d.minor as usize, i, "{name} GPU{i}");
            }
        }
    }

    #[test]
    fn model_files_set_minors_and_bad_ones_say_why() {
        let dir = std::env::temp_dir().join(format!("cuvisor-model-minor-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("m.toml");
        std::fs::write(
            &p,
            "[[device]]\nmemory='8Gi'\nminor=3\n[[device]]\nmemory='8Gi'\nminor=1\n[[device]]\nmemory='8Gi'\n",
        )
        .unwrap();
        let m = Model::load(p.to_str().unwrap()).unwrap();
        let minors: Vec<u32> = m.devices.iter().map(|d| d.minor).collect();
        assert_eq!(minors, [3, 1, 2], "unset: the index");
        let j = dir.join("m.json");
        std::fs::write(
            &j,
            r#"{"devices":[{"memory":"2Gi","minor":7},{"memory":"2Gi"}]}"#,
        )
        .unwrap();
        let m = Model::load(j.to_str().unwrap()).unwrap();
        assert_eq!((m.devices[0].minor, m.devices[1].minor), (7, 1));
        std::fs::write(
            &p,
            "[[device]]\nmemory='8Gi'\n[[device]]\nmemory='8Gi'\nminor=0\n",
        )
        .unwrap();
        let e = Model::load(p.to_str().unwrap()).unwrap_err();
        assert!(e.contains("devices 0 and 1 both have minor 0"), "{e}");
        std::fs::write(&p, "[[device]]\nmemory='8Gi'\nminor=255\n").unwrap();
        let e = Model::load(p.to_str().unwrap()).unwrap_err();
        assert!(e.contains("minor 255 > 253"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A machine file that puts one PCIe switch under two root complexes (or one root complex in
    /// two NUMA nodes) would have NVML call two GPUs PIX while the driver, which follows the
    /// interconnect model's root complexes, refused them peer access: refused instead.
    #[test]
    fn a_machine_file_whose_switch_straddles_two_roots_is_refused() {
        let dir = std::env::temp_dir().join(format!("cuvisor-model-tree-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("m.toml");
        std::fs::write(
            &p,
            "[[device]]\nmemory='8Gi'\npcie_switch=0\npcie_root=0\n\
             [[device]]\nmemory='8Gi'\npcie_switch=0\npcie_root=1\n",
        )
        .unwrap();
        let e = Model::load(p.to_str().unwrap()).unwrap_err();
        assert!(
            e.contains("share PCIe switch 0 but name roots 0 and 1"),
            "{e}"
        );
        std::fs::write(
            &p,
            "[[device]]\nmemory='8Gi'\npcie_switch=0\npcie_root=0\n\
             [[device]]\nmemory='8Gi'\npcie_switch=1\npcie_root=0\nnuma_node=1\n",
        )
        .unwrap();
        let e = Model::load(p.to_str().unwrap()).unwrap_err();
        assert!(
            e.contains("share PCIe root 0 but name NUMA nodes 0 and 1"),
            "{e}"
        );
        // A consistent tree loads, and NVML's distance and the driver's peer rule agree on it.
        std::fs::write(
            &p,
            "[[device]]\nmemory='8Gi'\npcie_switch=0\npcie_root=0\n\
             [[device]]\nmemory='8Gi'\npcie_switch=0\npcie_root=0\n",
        )
        .unwrap();
        let m = Model::load(p.to_str().unwrap()).unwrap();
        assert_eq!(m.pcie_level(0, 1), PcieLevel::Single);
        assert!(m.fabric().p2p_supported(0, 1));
        for name in PRESETS {
            assert_eq!(
                check_pcie_tree(&preset(name).unwrap().devices),
                Ok(()),
                "{name}"
            );
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn uuids_are_unique_and_round_trip() {
        let d = preset("dgx1-v100").unwrap();
        let mut seen = std::collections::HashSet::new();
        for x in &d.devices {
            assert!(seen.insert(x.uuid.clone()));
            assert_eq!(format_uuid(&x.uuid_bytes()), x.uuid);
        }
    }

    #[test]
    fn topo_matrix_matches_nvidia_smi_cells() {
        let m = preset("dgx1-v100").unwrap().topo_matrix();
        let row0: Vec<&str> = m.lines().nth(1).unwrap().split('\t').collect();
        assert_eq!(
            &row0[..9],
            &["GPU0", "X", "NV1", "NV1", "NV2", "NV2", "SYS", "SYS", "SYS"]
        );
        // Every pair NV18, as `nvidia-smi topo -m` prints on 8 x H100/H200 boards.
        let m = preset("h200").unwrap().topo_matrix();
        for (a, row) in m.lines().skip(1).take(8).enumerate() {
            let cells: Vec<&str> = row.split('\t').collect();
            for (b, c) in cells[1..9].iter().enumerate() {
                assert_eq!(*c, if a == b { "X" } else { "NV18" }, "GPU{a}-GPU{b}");
            }
            assert_eq!(cells[10], if a < 4 { "0" } else { "1" }, "NUMA of GPU{a}");
        }
        let m = preset("pcie-8").unwrap().topo_matrix();
        let row0: Vec<&str> = m.lines().nth(1).unwrap().split('\t').collect();
        assert_eq!(
            &row0[..9],
            &["GPU0", "X", "PIX", "PXB", "PXB", "SYS", "SYS", "SYS", "SYS"]
        );
    }

    #[test]
    fn quantities() {
        assert_eq!(parse_quantity("16Gi").unwrap(), 16 * GIB);
        assert_eq!(parse_quantity("512Mi").unwrap(), 512 * MIB);
        assert_eq!(parse_quantity("1.5Gi").unwrap(), 3 * GIB / 2);
        assert_eq!(parse_quantity("4G").unwrap(), 4_000_000_000);
        assert_eq!(parse_quantity("6442450944").unwrap(), 6 * GIB);
        assert!(parse_quantity("4GB").unwrap_err().contains("unknown unit"));
        assert!(parse_quantity("Gi").is_err());
        assert!(parse_quantity("-1Gi").is_err());
    }

    #[test]
    fn model_files_load_and_bad_ones_say_why() {
        let dir = std::env::temp_dir().join(format!("cuvisor-model-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("m.toml");
        std::fs::write(&p, "name='two'\n[[device]]\nmemory='8Gi'\n[[device]]\nmemory=1073741824\nnuma_node=1\n[[nvlink]]\na=0\nb=1\nlinks=4\n").unwrap();
        let m = Model::load(p.to_str().unwrap()).unwrap();
        assert_eq!(m.devices[0].memory, 8 * GIB);
        assert_eq!(m.devices[1].memory, GIB);
        assert_eq!(m.direct_links(0, 1), 4);
        assert_eq!(m.pcie_level(0, 1), PcieLevel::System);
        let j = dir.join("m.json");
        std::fs::write(
            &j,
            r#"{"devices":[{"memory":"2Gi","compute_capability":"9.0"}]}"#,
        )
        .unwrap();
        assert_eq!(
            Model::load(j.to_str().unwrap()).unwrap().devices[0].cc,
            (9, 0)
        );
        std::fs::write(&p, "[[device]]\nmemory='8GB'\n").unwrap();
        assert!(Model::load(p.to_str().unwrap())
            .unwrap_err()
            .contains("unknown unit"));
        std::fs::write(&p, "[[device]]\nmemory='8Gi'\nbogus=1\n").unwrap();
        assert!(Model::load(p.to_str().unwrap())
            .unwrap_err()
            .contains("bogus"));
        assert!(Model::load("dgx2")
            .unwrap_err()
            .contains("neither a preset"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
