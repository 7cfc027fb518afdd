//! The node's topology as the interconnect model (`cuvisor_fabric`) sees it: what the picker's
//! all-reduce times and the topology-loss metrics are computed on.
//!
//! Facts the topology lacks are filled in so that the model errs towards slow, never fast: a
//! GPU whose PCIe switch or root complex is unknown (a pair `topo -m` shows as `NV#`) gets one
//! of its own (no PCIe peer-to-peer assumed), an unknown NUMA node is the one of the GPUs the
//! PCIe levels put it with (`NODE` or nearer), else its own.

use super::model::{PcieLevel, Topology};
use cuvisor_fabric::{specs, Fabric, Gpu};

/// The PCIe generation whose x16 rate is nearest `gbps` (the topology keeps a bandwidth).
fn generation_of(gbps: f64) -> u32 {
    (1..=6)
        .min_by(|&a, &b| {
            let d = |g: u32| (specs::pcie_x16_gbps(g) - gbps).abs();
            d(a).total_cmp(&d(b))
        })
        .unwrap_or(3)
}

/// The interconnect model of `t`.
pub fn fabric(t: &Topology) -> Fabric {
    let n = t.len();
    let pcie_gen = generation_of(t.pcie_link_gbps());
    let level = |a: usize, b: usize| t.link(a, b).and_then(|l| l.pcie);
    // Unknown ids get values no known id has (known ones are GPU indices < 16).
    let own = |i: usize| (1000 + i) as u32;
    let numa = |i: usize| -> u32 {
        if let Some(node) = t.gpus()[i].numa_node {
            return node;
        }
        (0..n)
            .find(|&j| j == i || level(i, j).is_some_and(|l| l <= PcieLevel::Node))
            .map_or(own(i), |j| t.gpus()[j].numa_node.unwrap_or(own(j)))
    };
    let mut switch_links = vec![0u32; n];
    let mut nvlink_gen = vec![0u32; n];
    let mut direct = Vec::new();
    for a in 0..n {
        for b in 0..n {
            let Some(nv) = t.link(a, b).and_then(|l| l.nvlink) else {
                continue;
            };
            if a == b {
                continue;
            }
            // An unknown generation counts as 2-4 (25 GB/s a link), as the topology's own table.
            nvlink_gen[a] = nvlink_gen[a].max(nv.generation.unwrap_or(2));
            if nv.via_switch {
                switch_links[a] = switch_links[a].max(nv.links);
            } else if a < b {
                direct.push((a, b, nv.links));
            }
        }
    }
    let gpus = (0..n)
        .map(|i| {
            let g = &t.gpus()[i];
            Gpu {
                pcie_gen,
                numa_node: numa(i),
                pcie_switch: g.pcie_switch.map_or(own(i), |s| s as u32),
                pcie_root: g.pcie_root.map_or(own(i), |s| s as u32),
                nvlink_gen: nvlink_gen[i],
                switch_links: switch_links[i],
                // Device-to-device copies within a GPU do not enter placement.
                memory_gbps: 0.0,
            }
        })
        .collect();
    // A checked topology has distinct GPUs and links only between them; the allocator refuses
    // more than MAX_GPUS (16) GPUs before it builds one.
    match Fabric::new(gpus, &direct) {
        Ok(f) => f,
        Err(e) => unreachable!("a checked topology is a valid fabric: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::topology::parse_topo_matrix;
    use cuvisor_fabric::ring::allreduce;

    #[test]
    fn dgx1_from_its_topo_matrix_has_the_fabric_rings() {
        let m = cuvisor_sim::model::preset("dgx1-v100").unwrap();
        let t = parse_topo_matrix(&m.topo_matrix()).unwrap();
        let f = fabric(&t);
        let sim = m.fabric();
        for group in [
            vec![0, 1, 2, 3],
            vec![0, 1, 4, 5],
            vec![0, 3],
            (0..8).collect(),
        ] {
            let (a, b) = (allreduce(&f, &group), allreduce(&sim, &group));
            assert!(
                (a.busbw_gbps - b.busbw_gbps).abs() < 1e-6,
                "{group:?}: plugin {} vs simulator {}",
                a.busbw_gbps,
                b.busbw_gbps
            );
        }
    }

    #[test]
    fn pcie_generation_from_the_link_rate() {
        assert_eq!(generation_of(15.75), 3);
        assert_eq!(generation_of(31.5), 4);
        assert_eq!(generation_of(63.0), 5);
    }
}
