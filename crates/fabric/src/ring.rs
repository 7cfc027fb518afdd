//! The ring all-reduce over a group of GPUs, as NCCL's ring algorithm runs it, and the seeds'
//! two formulas.
//!
//! **Rings.** NCCL splits an all-reduce over several channels, each a ring through every GPU of
//! the group, so that the rings together use the links the group has (its topology search,
//! `ncclTopoCompute`, looks for as many rings as the links carry). [`rings`] does the same
//! greedily: the directed ring with the widest bottleneck on the capacity left (each resource's
//! bandwidth divided among the ring's edges that cross it), then again on what is left, until
//! a ring would add less than 1/16 of the first. Like NCCL, which searches one kind of path
//! per graph (NVLink, else PCIe, else through the host), later rings use no slower kind of
//! route than the first: a group joined by NVLink does not add rings through host memory. Groups of up to [`EXACT_GPUS`] GPUs try every
//! ring; larger ones build rings from every start by taking the widest next hop.
//!
//! **Time.** An all-reduce of S bytes over k GPUs moves 2(k-1)/k x S bytes over every ring edge
//! (a reduce-scatter then an all-gather, k-1 steps each), split over the rings in proportion to
//! their bandwidth. So it takes 2(k-1)/k x S / busbw plus 2(k-1) steps' latency, where busbw,
//! the sum of the rings' bandwidths, is what nccl-tests calls the bus bandwidth (its
//! PERFORMANCE.md: busbw = algbw x 2(n-1)/n for all-reduce).
//!
//! **The seeds' formulas.** Communication efficiency = sum(bytes_i x bandwidth_i) / sum(bytes_i)
//! over the transfers i of a job, here what each GPU sends in the all-reduce, at the rate it
//! sends it ([`AllReduce::efficiency_gbps`]; measured: [`efficiency`] over the job's per-GPU
//! bytes and send times); topology loss = 1 - efficiency / the efficiency of the best group of
//! the same size on the same machine ([`topology_loss`]).

use crate::{specs, End, Fabric, Resource, RouteKind};
use std::collections::HashMap;

/// Groups up to this size are searched exhaustively ((k-1)! directed rings: 5040 at 8).
pub const EXACT_GPUS: usize = 8;

/// A ring stops being added when it carries less than this share of the first.
const MIN_SHARE: f64 = 1.0 / 16.0;

/// At most this many rings (NCCL's MAXCHANNELS is 32; a ring per direction of every link of
/// an 8-GPU box is far fewer).
const MAX_RINGS: usize = 32;

/// One channel: GPUs in ring order (each sends to the next, the last to the first) and the
/// bandwidth it gets, GB/s.
#[derive(Clone, Debug, PartialEq)]
pub struct Ring {
    pub order: Vec<usize>,
    pub gbps: f64,
}

/// The modelled all-reduce over one group.
#[derive(Clone, Debug, PartialEq)]
pub struct AllReduce {
    pub group: Vec<usize>,
    pub rings: Vec<Ring>,
    /// Sum of the rings' bandwidths, GB/s (nccl-tests' busbw); infinite for one GPU.
    pub busbw_gbps: f64,
    /// Per-step latency of the slowest ring edge, ns.
    pub step_latency_ns: u64,
}

impl AllReduce {
    /// Modelled time of an all-reduce of `bytes`, ns (0 for one GPU).
    pub fn time_ns(&self, bytes: u64) -> u64 {
        let k = self.group.len() as u64;
        if k < 2 {
            return 0;
        }
        let moved = (2 * (k - 1) * bytes) / k;
        specs::transfer_ns(moved, self.busbw_gbps) + 2 * (k - 1) * self.step_latency_ns
    }

    /// nccl-tests' algorithm bandwidth for `bytes`, GB/s: bytes / time.
    pub fn algbw_gbps(&self, bytes: u64) -> f64 {
        match self.time_ns(bytes) {
            0 => f64::INFINITY,
            t => bytes as f64 / t as f64,
        }
    }

    /// The seeds' communication efficiency of this all-reduce, GB/s. Its transfers i are what
    /// each GPU sends (every GPU sends the same bytes, 2(k-1)/k x S), each at the rate the
    /// GPU sends at, the sum of its rings' bandwidths; so sum(bytes_i x bw_i) / sum(bytes_i)
    /// is the bus bandwidth. (Counting each ring's transfers apart instead would rate four
    /// 25 GB/s rings like one.) 0 for one GPU: nothing moves.
    pub fn efficiency_gbps(&self) -> f64 {
        if self.group.len() < 2 || !self.busbw_gbps.is_finite() {
            return 0.0;
        }
        self.busbw_gbps
    }
}

/// The seeds' communication efficiency of a set of transfers (bytes, bandwidth GB/s):
/// sum(bytes_i x bandwidth_i) / sum(bytes_i); 0 when nothing moved.
pub fn efficiency(transfers: impl IntoIterator<Item = (u64, f64)>) -> f64 {
    let (mut num, mut den) = (0.0, 0.0);
    for (bytes, gbps) in transfers {
        num += bytes as f64 * gbps;
        den += bytes as f64;
    }
    if den > 0.0 {
        num / den
    } else {
        0.0
    }
}

/// The seeds' topology loss rate: 1 - actual / peak, in 0..=1 (0 when the peak is 0).
pub fn topology_loss(actual: f64, peak: f64) -> f64 {
    if peak > 0.0 && peak.is_finite() {
        (1.0 - actual / peak).clamp(0.0, 1.0)
    } else {
        0.0
    }
}

/// How slow a kind of route is, for keeping later rings on the first ring's kind.
fn class(kind: RouteKind) -> u8 {
    match kind {
        RouteKind::Local | RouteKind::NvLink | RouteKind::NvSwitch => 0,
        RouteKind::PcieP2p | RouteKind::Pcie => 1,
        RouteKind::Staged => 2,
    }
}

/// A ring's edges' worst route class.
fn ring_class(f: &Fabric, order: &[usize]) -> u8 {
    (0..order.len())
        .map(|i| {
            let (a, b) = (order[i], order[(i + 1) % order.len()]);
            class(f.route(End::Gpu(a), End::Gpu(b), true).kind)
        })
        .max()
        .unwrap_or(0)
}

/// The resources a ring crosses, each with how many of its edges cross it.
type Uses = Vec<(Resource, u32)>;

/// The resources one ring crosses, each with how many of its edges cross it.
fn ring_uses(f: &Fabric, order: &[usize]) -> Uses {
    let mut uses: Vec<(Resource, u32)> = Vec::new();
    for i in 0..order.len() {
        let (a, b) = (order[i], order[(i + 1) % order.len()]);
        for r in f.route(End::Gpu(a), End::Gpu(b), true).hops {
            match uses.iter_mut().find(|(x, _)| *x == r) {
                Some((_, n)) => *n += 1,
                None => uses.push((r, 1)),
            }
        }
    }
    uses
}

/// A ring's bandwidth on the capacity left.
fn bottleneck(uses: &[(Resource, u32)], left: &HashMap<Resource, f64>) -> f64 {
    uses.iter()
        .map(|(r, n)| left[r] / *n as f64)
        .fold(f64::INFINITY, f64::min)
}

/// Every directed ring through `group` starting at its first GPU.
fn all_rings(group: &[usize]) -> Vec<Vec<usize>> {
    fn walk(rest: &mut Vec<usize>, path: &mut Vec<usize>, out: &mut Vec<Vec<usize>>) {
        if rest.is_empty() {
            out.push(path.clone());
            return;
        }
        for i in 0..rest.len() {
            let g = rest.remove(i);
            path.push(g);
            walk(rest, path, out);
            path.pop();
            rest.insert(i, g);
        }
    }
    let mut out = Vec::new();
    walk(&mut group[1..].to_vec(), &mut vec![group[0]], &mut out);
    out
}

/// Rings built from every start by always taking the widest next hop on the capacity left.
fn greedy_rings(f: &Fabric, group: &[usize], left: &HashMap<Resource, f64>) -> Vec<Vec<usize>> {
    let hop = |a: usize, b: usize| {
        f.route(End::Gpu(a), End::Gpu(b), true)
            .hops
            .iter()
            .map(|r| left[r])
            .fold(f64::INFINITY, f64::min)
    };
    group
        .iter()
        .map(|&start| {
            let mut order = vec![start];
            let mut rest: Vec<usize> = group.iter().copied().filter(|&g| g != start).collect();
            while !rest.is_empty() {
                let last = *order.last().unwrap_or(&start);
                let (i, _) =
                    rest.iter()
                        .enumerate()
                        .fold((0, f64::NEG_INFINITY), |best, (i, &g)| {
                            let w = hop(last, g);
                            if w > best.1 {
                                (i, w)
                            } else {
                                best
                            }
                        });
                order.push(rest.remove(i));
            }
            order
        })
        .collect()
}

/// The rings NCCL's ring algorithm would run over `group` (GPU indices of `f`, distinct), widest
/// first. Empty for fewer than two GPUs.
pub fn rings(f: &Fabric, group: &[usize]) -> Vec<Ring> {
    if group.len() < 2 {
        return Vec::new();
    }
    let mut left: HashMap<Resource, f64> = f
        .resources()
        .into_iter()
        .map(|r| (r, f.capacity(r)))
        .collect();
    let exact = (group.len() <= EXACT_GPUS).then(|| {
        all_rings(group)
            .into_iter()
            .map(|o| {
                let u = ring_uses(f, &o);
                (o, u)
            })
            .collect::<Vec<_>>()
    });
    let mut out: Vec<Ring> = Vec::new();
    let mut first_class: Option<u8> = None;
    while out.len() < MAX_RINGS {
        let candidates = match &exact {
            Some(c) => c.clone(),
            None => greedy_rings(f, group, &left)
                .into_iter()
                .map(|o| {
                    let u = ring_uses(f, &o);
                    (o, u)
                })
                .collect(),
        };
        let mut best: Option<(Vec<usize>, Uses, f64)> = None;
        for (o, u) in candidates {
            if first_class.is_some_and(|c| ring_class(f, &o) > c) {
                continue;
            }
            let b = bottleneck(&u, &left);
            if best.as_ref().is_none_or(|x| b > x.2 + 1e-9) {
                best = Some((o, u, b));
            }
        }
        let Some((order, uses, gbps)) = best else {
            break;
        };
        let floor = out.first().map_or(0.0, |r| r.gbps * MIN_SHARE);
        if !gbps.is_finite() || gbps <= floor || gbps <= 1e-9 {
            if !gbps.is_finite() && out.is_empty() {
                // Nothing on the way limits it (unknown bandwidths): one ring, unbounded.
                out.push(Ring { order, gbps });
            }
            break;
        }
        for (r, n) in &uses {
            if let Some(x) = left.get_mut(r) {
                *x -= gbps * *n as f64;
            }
        }
        first_class.get_or_insert_with(|| ring_class(f, &order));
        out.push(Ring { order, gbps });
    }
    out
}

/// The modelled all-reduce over `group`.
pub fn allreduce(f: &Fabric, group: &[usize]) -> AllReduce {
    let rings = rings(f, group);
    let busbw_gbps = if group.len() < 2 {
        f64::INFINITY
    } else {
        rings.iter().map(|r| r.gbps).sum()
    };
    let step_latency_ns = rings
        .iter()
        .flat_map(|r| {
            (0..r.order.len()).map(|i| {
                f.route(
                    End::Gpu(r.order[i]),
                    End::Gpu(r.order[(i + 1) % r.order.len()]),
                    true,
                )
                .latency_ns
            })
        })
        .max()
        .unwrap_or(0);
    AllReduce {
        group: group.to_vec(),
        rings,
        busbw_gbps,
        step_latency_ns,
    }
}
