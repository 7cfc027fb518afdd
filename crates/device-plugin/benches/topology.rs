//! Latency of `Allocator::preferred` on 16-GPU machines, sizes 1..16 (target: <= 1 ms), under
//! both policies: `weighted` (the seeds' score, the default before issue 18) and `allreduce`
//! (the default: modelled all-reduce times, cached per group on first use; the `first` column
//! is the first call of each size on the machine, which fills that cache).
//! Run: `cargo bench -p cuvisor-device-plugin --bench topology` (`-- weighted` or `-- allreduce`
//! for one policy).
//!
//! Machines: an NVSwitch box (every pair NV6, PCIe switch per pair, two NUMA nodes: the worst
//! case for ties, where only look-ahead and locality tell groups apart), the same box as
//! `nvidia-smi topo -m` shows it (no PCIe paths: even more ties), two DGX-1 cube-meshes side by
//! side, and a PCIe-only tree. Each with all 16 GPUs free, and with 12 free (4 taken) plus one
//! must-include GPU. Each call is timed on its own; p50, p99 and max are printed in µs, with
//! the one-time `Allocator::new` cost. Then 20 random 16-GPU machines (random NVLink meshes,
//! PCIe levels, free memory and fault domains), summarised by their worst p50/p99.

use cuvisor_device_plugin::topology::{
    parse_topo_matrix, Allocator, Gpu, Link, Memory, PcieLevel, Policy, Topology, Weights,
};
// The DGX-1 (V100) cube-mesh, as the simulator's preset has it.
use cuvisor_sim::model::DGX1_LINKS as DGX1;
use std::time::{Duration, Instant};

/// PCIe: a switch per pair, a root per four, a NUMA node per eight.
fn pcie_level(a: usize, b: usize) -> PcieLevel {
    if a / 2 == b / 2 {
        PcieLevel::Single
    } else if a / 4 == b / 4 {
        PcieLevel::Multiple
    } else if a / 8 == b / 8 {
        PcieLevel::Node
    } else {
        PcieLevel::System
    }
}

fn machine(nvlinks: impl Fn(usize, usize) -> Option<(u32, bool)>) -> Topology {
    let n = 16;
    let links = (0..n)
        .map(|a| {
            (0..n)
                .map(|b| {
                    let mut l = Link::pcie(pcie_level(a, b));
                    if a != b {
                        if let Some((count, switch)) = nvlinks(a, b) {
                            l.nvlink = Link::nvlink(count, Some(2), switch).nvlink;
                        }
                    }
                    l
                })
                .collect()
        })
        .collect();
    let gpus = (0..n)
        .map(|i| Gpu {
            numa_node: Some(i as u32 / 8),
            ..Gpu::new(i)
        })
        .collect();
    Topology::new(gpus, links, 15.75).expect("valid")
}

/// A deterministic pseudo-random machine: NVLink (1-4 links) on `percent`% of the pairs,
/// random PCIe levels, free memory and fault domains.
fn random_machine(seed: u64, percent: u64) -> Topology {
    let mut x = seed;
    let mut next = |below: u64| {
        x = x
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (x >> 33) % below
    };
    let n = 16;
    let mut flat = vec![Topology::SELF_LINK; n * n];
    for a in 0..n {
        for b in a + 1..n {
            let mut l = Link::pcie(PcieLevel::ALL[1 + next(5) as usize]);
            if next(100) < percent {
                l.nvlink = Link::nvlink(1 + next(4) as u32, Some(3), false).nvlink;
            }
            flat[a * n + b] = l;
            flat[b * n + a] = l;
        }
    }
    let links = flat.chunks(n).map(<[Link]>::to_vec).collect();
    let gpus = (0..n)
        .map(|i| Gpu {
            numa_node: Some(i as u32 / 8),
            memory: Some(Memory {
                total: 80,
                free: 40 + next(3) * 20,
            }),
            fault_domain: next(4) as usize,
            ..Gpu::new(i)
        })
        .collect();
    Topology::new(gpus, links, 31.5).expect("valid")
}

/// Times `preferred` call by call: (first, p50, p99, max) in µs.
fn time(
    al: &Allocator,
    free: &[usize],
    must: &[usize],
    size: usize,
    w: &Weights,
) -> (f64, f64, f64, f64) {
    let t0 = Instant::now();
    let _ = al.preferred(free, must, size, w);
    let first = t0.elapsed().as_secs_f64() * 1e6;
    // Warm up, then time calls one by one for ~50 ms or 2000 calls.
    for _ in 0..20 {
        let _ = al.preferred(free, must, size, w);
    }
    let mut times = Vec::new();
    let begin = Instant::now();
    while times.len() < 2000 && begin.elapsed() < Duration::from_millis(50) {
        let t0 = Instant::now();
        let pick = al.preferred(free, must, size, w).expect("valid request");
        times.push(t0.elapsed());
        std::hint::black_box(pick);
    }
    times.sort_unstable();
    let max = times.last().map_or(0.0, |d| d.as_secs_f64() * 1e6);
    (
        first,
        percentile(&times, 0.5),
        percentile(&times, 0.99),
        max,
    )
}

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i].as_secs_f64() * 1e6
}

fn main() {
    let only: Option<String> = std::env::args().skip(1).find(|a| !a.starts_with('-'));
    for (name, policy) in [
        ("weighted", Policy::Weighted),
        ("allreduce", Policy::AllReduce),
    ] {
        if only.as_deref().is_some_and(|o| o != name) {
            continue;
        }
        run(
            name,
            &Weights {
                policy,
                ..Weights::default()
            },
        );
    }
}

fn run(policy: &str, w: &Weights) {
    let nvswitch = machine(|_, _| Some((6, true)));
    let text = nvswitch.to_topo_matrix();
    let nvswitch_text = parse_topo_matrix(&text).expect("own rendering parses");
    let cube = machine(|a, b| {
        if a / 8 != b / 8 {
            return None;
        }
        let (x, y) = (a.min(b) % 8, a.max(b) % 8);
        DGX1.iter()
            .find(|l| (l.0, l.1) == (x, y))
            .map(|l| (l.2, false))
    });
    let pcie = machine(|_, _| None);
    let machines = [
        ("nvswitch-16", nvswitch),
        ("nvswitch-16 (from topo -m text)", nvswitch_text),
        ("2x dgx1 cube-mesh", cube),
        ("pcie-16", pcie),
    ];
    let all: Vec<usize> = (0..16).collect();
    let some: Vec<usize> = all
        .iter()
        .copied()
        .filter(|g| ![1, 6, 10, 13].contains(g))
        .collect();
    let (mut worst, mut worst_first) = (0.0f64, 0.0f64);
    println!("\n==== policy {policy}: Allocator::preferred latency, 16 GPUs (µs per call)");
    for (name, t) in machines {
        let start = Instant::now();
        let al = Allocator::new(t).expect("16 GPUs");
        println!(
            "\n{name}: Allocator::new {:.0} µs",
            start.elapsed().as_secs_f64() * 1e6
        );
        println!("  free           size    first      p50      p99      max");
        for (label, free, must) in [("all 16", &all, &[][..]), ("12 + must 7", &some, &[7][..])] {
            for size in 1..=free.len() {
                let (first, p50, p99, max) = time(&al, free, must, size, w);
                worst = worst.max(p99);
                worst_first = worst_first.max(first);
                println!("  {label:<14} {size:>4} {first:>8.1} {p50:>8.1} {p99:>8.1} {max:>8.1}");
            }
        }
    }
    println!("\n20 random 16-GPU machines, all free, sizes 1..16: worst of each size");
    println!("  size  worst first  worst p50  worst p99");
    let randoms: Vec<Allocator> = (0..20u64)
        .map(|seed| {
            Allocator::new(random_machine(seed, [20, 50, 80, 100][seed as usize % 4]))
                .expect("16 GPUs")
        })
        .collect();
    for size in 1..=16 {
        let (mut firsts, mut p50s, mut p99s) = (0.0f64, 0.0f64, 0.0f64);
        for al in &randoms {
            let (first, p50, p99, _) = time(al, &all, &[], size, w);
            firsts = firsts.max(first);
            p50s = p50s.max(p50);
            p99s = p99s.max(p99);
        }
        worst = worst.max(p99s);
        worst_first = worst_first.max(firsts);
        println!("  {size:>4} {firsts:>12.1} {p50s:>10.1} {p99s:>10.1}");
    }
    println!(
        "\npolicy {policy}: worst p99 {worst:.1} µs (target 1000 µs); worst first call {:.1} ms",
        worst_first / 1000.0
    );
}
