//! Latency of the plugin's GetPreferredAllocation and Allocate on a 16-GPU machine (two DGX-1
//! V100 cube-meshes side by side, 80 GiB per GPU, so 1280 memory units of 1 GiB), in process
//! (no gRPC transport). Target: <= 1 ms each. Allocate includes writing the allocation's host
//! files (limits file, ledger directory and its tmpfs mount, record). Prints p50/p99/max in µs.
//! Run: `cargo bench -p cuvisor-device-plugin --bench allocate`.

use cuvisor_device_plugin::cleanup::{Liveness, Sweeper};
use cuvisor_device_plugin::config::Config;
use cuvisor_device_plugin::plugin::Plugin;
use cuvisor_device_plugin::registry::{Allocation, Kind};
use cuvisor_device_plugin::topology::{Gpu, Link, Memory, PcieLevel, Topology};
// The DGX-1 (V100) cube-mesh, as the simulator's preset has it.
use cuvisor_sim::model::DGX1_LINKS as DGX1;
use std::time::{Duration, Instant};

const GIB: u64 = 1 << 30;

fn machine() -> Topology {
    let n = 16;
    let level = |a: usize, b: usize| {
        if a / 2 == b / 2 {
            PcieLevel::Single
        } else if a / 4 == b / 4 {
            PcieLevel::Multiple
        } else if a / 8 == b / 8 {
            PcieLevel::Node
        } else {
            PcieLevel::System
        }
    };
    let links = (0..n)
        .map(|a| {
            (0..n)
                .map(|b| {
                    let mut l = Link::pcie(level(a, b));
                    if a != b && a / 8 == b / 8 {
                        let (x, y) = (a.min(b) % 8, a.max(b) % 8);
                        if let Some((_, _, c)) = DGX1.iter().find(|(p, q, _)| (*p, *q) == (x, y)) {
                            l.nvlink = Link::nvlink(*c, Some(2), false).nvlink;
                        }
                    }
                    l
                })
                .collect()
        })
        .collect();
    let gpus = (0..n)
        .map(|i| Gpu {
            uuid: Some(format!("GPU-00000000-0000-4000-8000-{i:012x}")),
            numa_node: Some(i as u32 / 8),
            memory: Some(Memory {
                total: 80 * GIB,
                free: 80 * GIB,
            }),
            ..Gpu::new(i)
        })
        .collect();
    Topology::new(gpus, links, 15.75).expect("valid")
}

fn stats(mut v: Vec<Duration>) -> (f64, f64, f64) {
    v.sort();
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    let p = |q: f64| us(v[((v.len() as f64 * q) as usize).min(v.len() - 1)]);
    (p(0.50), p(0.99), us(*v.last().unwrap()))
}

fn row(name: &str, v: Vec<Duration>) -> bool {
    let (p50, p99, max) = stats(v);
    let ok = p99 <= 1000.0;
    println!(
        "{name:<52} {p50:>9.1} {p99:>9.1} {max:>9.1}  {}",
        if ok { "ok" } else { "OVER 1 ms" }
    );
    ok
}

/// Every allocation's pod is gone (PodResources would say so once the pod is deleted).
struct AllGone;

impl Liveness for AllGone {
    fn in_use(&self, _: &Allocation) -> Option<bool> {
        Some(false)
    }
}

fn main() {
    let root = std::env::temp_dir().join(format!("cuvisor-dp-bench-{}", std::process::id()));
    cuvisor_device_plugin::ledger_dir::detach_all_under(&root);
    let _ = std::fs::remove_dir_all(&root);
    let cfg = Config {
        socket_dir: root.join("dp"),
        state_root: root.join("state"),
        ..Config::default()
    };
    let (_tx, rx) = cuvisor_device_plugin::health_channel();
    let plugin = Plugin::new(cfg, machine(), rx).expect("plugin");
    let inv = plugin.inventory();
    let uuids: Vec<String> = inv.gpus().iter().map(|g| g.uuid.clone()).collect();
    let all_units: Vec<String> = (0..16)
        .flat_map(|g| (0..inv.gpus()[g].units).map(move |k| (g, k)))
        .map(|(g, k)| inv.unit_id(g, k))
        .collect();
    // Memory with holes: GPU g has 80 - 4g free units (the best fit has to look at all).
    let holey: Vec<String> = (0..16)
        .flat_map(|g| (4 * g as u32..80).map(move |k| (g, k)))
        .map(|(g, k)| inv.unit_id(g, k))
        .collect();
    let n = 2000;
    // Allocations are swept between calls, untimed, as the plugin's sweeper would once their
    // pods are gone: each takes a coordinator entry on its GPUs, and a GPU has 64.
    let sweeper = Sweeper::new(plugin.registry_mut().clone(), Duration::ZERO)
        .with_coord_dir(plugin.config().host_coord_dir())
        .with_liveness(Box::new(AllGone));
    let time = |f: &mut dyn FnMut(usize)| -> Vec<Duration> {
        for i in 0..50 {
            f(i);
            sweeper.sweep();
        }
        (0..n)
            .map(|i| {
                let t = Instant::now();
                f(i);
                let d = t.elapsed();
                sweeper.sweep();
                d
            })
            .collect()
    };
    let pref = |kind: Kind, avail: &[String], must: &[String], size: usize| {
        plugin
            .preferred(kind, avail, must, size)
            .expect("preferred")
    };
    println!("16 GPUs (2 x DGX-1 cube-mesh), 80 GiB each, 1 GiB units; {n} calls each");
    println!(
        "{:<52} {:>9} {:>9} {:>9}",
        "call", "p50 µs", "p99 µs", "max µs"
    );
    let mut ok = true;
    for size in [1, 2, 4, 8] {
        ok &= row(
            &format!("GetPreferredAllocation gpu, 16 free, size {size}"),
            time(&mut |_| {
                pref(Kind::Gpu, &uuids, &[], size);
            }),
        );
    }
    let twelve: Vec<String> = uuids[2..14].to_vec();
    ok &= row(
        "GetPreferredAllocation gpu, 12 free, must 1, size 4",
        time(&mut |_| {
            pref(Kind::Gpu, &twelve, &twelve[..1], 4);
        }),
    );
    for (name, avail) in [("1280 free units", &all_units), ("holey, 800 free", &holey)] {
        ok &= row(
            &format!("GetPreferredAllocation memory, {name}, size 6"),
            time(&mut |_| {
                pref(Kind::Memory, avail, &[], 6);
            }),
        );
    }
    ok &= row(
        "Allocate memory, 6 units (writes host files)",
        time(&mut |i| {
            // GPUs 8-15: a GPU with memory units in use cannot be allocated whole (next row).
            let g = 8 + i % 8;
            let k0 = (i / 8 % 13) as u32 * 6;
            let ids: Vec<String> = (k0..k0 + 6).map(|k| inv.unit_id(g, k)).collect();
            plugin.allocate(Kind::Memory, &ids).expect("allocate");
        }),
    );
    ok &= row(
        "Allocate gpu, 2 GPUs",
        time(&mut |i| {
            let g = i % 4 * 2;
            plugin
                .allocate(Kind::Gpu, &[uuids[g].clone(), uuids[g + 1].clone()])
                .expect("allocate");
        }),
    );
    println!(
        "registry: {} live allocations at the end",
        plugin.registry().len()
    );
    // Each memory allocation mounted its ledger directory's tmpfs; none was swept.
    cuvisor_device_plugin::ledger_dir::detach_all_under(&root);
    let _ = std::fs::remove_dir_all(&root);
    if !ok {
        println!("some p99 over the 1 ms target");
    }
}
