//! The seeds' two formulas for one multi-GPU allocation, from the link model.
//!
//! - **Communication efficiency** = sum(bytes_i x bandwidth_i) / sum(bytes_i) over the
//!   transfers of the job. The job here is a ring all-reduce over the allocation's GPUs, as
//!   NCCL runs it ([`cuvisor_fabric::ring::allreduce`] on the node's fabric,
//!   [`crate::topology::fabric::fabric`]): every GPU sends the same bytes at the sum of its
//!   rings' bandwidths, so the efficiency is the all-reduce's bus bandwidth
//!   ([`AllReduce::efficiency_gbps`]).
//! - **Topology loss rate** = 1 - efficiency / peak efficiency, the peak being the efficiency of
//!   the best group of as many GPUs on this node, whether free or not ([`ring::topology_loss`]).
//!   0 for a pick as good as any; on a DGX-1 V100 a pair across the sockets (15.75 GB/s, PCIe
//!   Gen3 through host memory) loses 0.685 to a pair with two NVLinks (50 GB/s).
//!
//! Single-GPU allocations have neither figure (nothing moves between GPUs): no series.
//!
//! The best group of a size is searched once per size and kept: every group of that size when
//! that is at most [`EXACT_BUDGET`] rings to try (all sizes on 8 GPUs; up to 5 of 16), else the
//! group the allocator prefers on an empty node, and never worse than the allocation itself, so
//! the loss stays in 0..=1. Where the picker's own cached `Allocator::allreduce` /
//! `Allocator::best_allreduce` exist, [`CommModel::allreduce`] and
//! [`CommModel::best_allreduce`] are the two functions to swap for them.

use crate::topology::{fabric, Allocator, Weights};
use cuvisor_fabric::ring::{self, AllReduce};
use cuvisor_fabric::Fabric;
use std::collections::HashMap;
use std::sync::Mutex;

/// The exhaustive search for the best group of a size tries at most this many directed rings
/// (groups x (size-1)!): 8 GPUs' worst size (6: 28 x 120) is 3360; 16 GPUs' size 5 is 104832.
pub const EXACT_BUDGET: u64 = 200_000;

/// What the metrics show for one multi-GPU allocation.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Comm {
    /// The allocation's communication efficiency (its all-reduce's bus bandwidth), GB/s.
    pub efficiency_gbps: f64,
    /// The same for the best group of as many GPUs on this node, GB/s.
    pub peak_gbps: f64,
    /// 1 - efficiency / peak, in 0..=1.
    pub loss: f64,
}

/// The node's link model, answering [`Comm`] for sets of its GPUs.
pub struct CommModel {
    allocator: Allocator,
    fabric: Fabric,
    uuids: Vec<Option<String>>,
    /// The best group of each size found so far.
    best: Mutex<HashMap<usize, (Vec<usize>, AllReduce)>>,
}

/// n choose k, saturating.
fn choose(n: u64, k: u64) -> u64 {
    (0..k).fold(1u64, |acc, i| acc.saturating_mul(n - i) / (i + 1))
}

/// Every k-subset of 0..n, in lexicographic order, to `visit`.
fn each_group(n: usize, k: usize, mut visit: impl FnMut(&[usize])) {
    let mut g: Vec<usize> = (0..k).collect();
    if k == 0 || k > n {
        return;
    }
    loop {
        visit(&g);
        // The rightmost index that can still move right.
        let Some(i) = (0..k).rev().find(|&i| g[i] < n - k + i) else {
            return;
        };
        g[i] += 1;
        for j in i + 1..k {
            g[j] = g[j - 1] + 1;
        }
    }
}

impl CommModel {
    /// The model of the allocator's node.
    pub fn new(allocator: Allocator) -> CommModel {
        let t = allocator.topology();
        CommModel {
            fabric: fabric::fabric(t),
            uuids: t.gpus().iter().map(|g| g.uuid.clone()).collect(),
            allocator,
            best: Mutex::new(HashMap::new()),
        }
    }

    /// The figures of the GPUs named by these UUIDs (repeats count once); None for fewer than
    /// two distinct GPUs, or a UUID this node does not have.
    pub fn of_uuids(&self, uuids: &[String]) -> Option<Comm> {
        let mut group = Vec::with_capacity(uuids.len());
        for u in uuids {
            let g = self
                .uuids
                .iter()
                .position(|x| x.as_deref() == Some(u.as_str()))?;
            if !group.contains(&g) {
                group.push(g);
            }
        }
        self.of_group(&group)
    }

    /// The figures of a group of GPU indices (distinct, in range); None for fewer than two.
    pub fn of_group(&self, group: &[usize]) -> Option<Comm> {
        if group.len() < 2 || group.iter().any(|&g| g >= self.fabric.len()) {
            return None;
        }
        let mut group = group.to_vec();
        group.sort_unstable();
        group.dedup();
        if group.len() < 2 {
            return None;
        }
        let efficiency_gbps = self.allreduce(&group).efficiency_gbps();
        let (_, best) = self.best_allreduce(group.len());
        // The fallback search may miss a group; the allocation itself is one of its size.
        let peak_gbps = best.efficiency_gbps().max(efficiency_gbps);
        Some(Comm {
            efficiency_gbps,
            peak_gbps,
            loss: ring::topology_loss(efficiency_gbps, peak_gbps),
        })
    }

    /// The modelled all-reduce over `group`. (To become `Allocator::allreduce`, cached.)
    fn allreduce(&self, group: &[usize]) -> AllReduce {
        ring::allreduce(&self.fabric, group)
    }

    /// The best group of `size` GPUs on this node and its all-reduce, searched once per size.
    /// (To become `Allocator::best_allreduce`.)
    fn best_allreduce(&self, size: usize) -> (Vec<usize>, AllReduce) {
        let mut cache = self.best.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(b) = cache.get(&size) {
            return b.clone();
        }
        let n = self.fabric.len();
        let rings_per_group = (1..size as u64).product::<u64>();
        let mut best: Option<(Vec<usize>, AllReduce)> = None;
        let mut consider = |g: &[usize]| {
            let a = self.allreduce(g);
            if best
                .as_ref()
                .is_none_or(|(_, b)| a.efficiency_gbps() > b.efficiency_gbps())
            {
                best = Some((g.to_vec(), a));
            }
        };
        if choose(n as u64, size as u64).saturating_mul(rings_per_group) <= EXACT_BUDGET {
            each_group(n, size, &mut consider);
        } else {
            let all: Vec<usize> = (0..n).collect();
            if let Ok(g) = self
                .allocator
                .preferred(&all, &[], size, &Weights::default())
            {
                consider(&g);
            }
        }
        let found = best.unwrap_or_else(|| (Vec::new(), self.allreduce(&[])));
        cache.insert(size, found.clone());
        found
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::topology::parse_topo_matrix;

    fn dgx1() -> CommModel {
        let m = cuvisor_sim::model::preset("dgx1-v100").unwrap();
        let t = parse_topo_matrix(&m.topo_matrix()).unwrap();
        CommModel::new(Allocator::new(t).unwrap())
    }

    #[test]
    fn groups_are_every_subset_once() {
        let mut seen = Vec::new();
        each_group(5, 3, |g| seen.push(g.to_vec()));
        assert_eq!(seen.len() as u64, choose(5, 3));
        assert_eq!(seen.first().unwrap(), &[0, 1, 2]);
        assert_eq!(seen.last().unwrap(), &[2, 3, 4]);
        seen.dedup();
        assert_eq!(seen.len(), 10);
        assert_eq!(choose(16, 8), 12870);
    }

    #[test]
    fn a_dgx1_pair_across_sockets_loses_to_a_two_nvlink_pair() {
        let m = dgx1();
        let near = m.of_group(&[0, 3]).unwrap();
        assert!((near.efficiency_gbps - 50.0).abs() < 1e-9, "{near:?}");
        assert!((near.peak_gbps - 50.0).abs() < 1e-9, "{near:?}");
        assert_eq!(near.loss, 0.0);
        let far = m.of_group(&[5, 0]).unwrap();
        // PCIe Gen3 x16: 16 x 8 GT/s x 128/130 / 8 bits.
        let gen3 = 16.0 * 8.0 * 128.0 / 130.0 / 8.0;
        assert!((far.efficiency_gbps - gen3).abs() < 1e-2, "{far:?}");
        assert!((far.loss - (1.0 - gen3 / 50.0)).abs() < 1e-3, "{far:?}");
        assert!(m.of_group(&[3]).is_none());
        assert!(m.of_group(&[3, 3]).is_none());
        assert!(m.of_group(&[3, 9]).is_none());
    }

    #[test]
    fn the_best_group_of_every_size_is_at_least_as_good_as_any() {
        let m = dgx1();
        for size in 2..=8 {
            let (best, a) = m.best_allreduce(size);
            assert_eq!(best.len(), size);
            each_group(8, size, |g| {
                let c = m.of_group(g).unwrap();
                assert!(c.efficiency_gbps <= a.efficiency_gbps() + 1e-9, "{g:?}");
                assert!((0.0..=1.0).contains(&c.loss), "{g:?}: {c:?}");
            });
        }
        // The whole box has nothing to lose to.
        assert_eq!(m.of_group(&(0..8).collect::<Vec<_>>()).unwrap().loss, 0.0);
    }
}
