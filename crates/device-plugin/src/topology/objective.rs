//! The picker's objective: the modelled all-reduce time of this job plus that of the best
//! placements the GPUs it leaves allow for the requests that plausibly come next.
//!
//! **Time of a group.** T(G) is the time of an all-reduce of [`REFERENCE_BYTES`] (256 MiB, a
//! mid-sized model's gradient) over the group G, as `cuvisor_fabric::ring::allreduce` models
//! it on the node's interconnect (`topology::fabric::fabric`): NCCL-like rings over the NVLinks,
//! NVSwitch ports, PCIe links and socket link the group's traffic crosses, 2(k-1)/k x S bytes
//! over the rings' summed bandwidth plus 2(k-1) steps of latency. One GPU: 0. A group the model
//! finds no bandwidth for counts as [`UNREACHABLE_NS`].
//!
//! **Best time of a remainder.** B_s(R) = min T(H) over the groups H of s GPUs within R: the
//! best placement a request for s GPUs could still get.
//!
//! **The objective.** For a request of k GPUs with the available GPUs A, the picker takes the
//! group G (k GPUs of A, with every must-include GPU) that minimises
//!
//! ```text
//! cost(G) = T(G) + sum over s in L of B_s(A \ G)
//! ```
//!
//! where L, the sizes that plausibly come next, is the union of
//! - k itself (the same request again),
//! - the last [`RECENT`] request sizes the plugin saw ([`super::Allocator::note_request`]),
//! - buddy-style, the powers of two 2, 4, 8, 16 (a small request leaves the large groups
//!   whole; a large one leaves a connected pair where it can: a 3-GPU request from five DGX-1
//!   GPUs may take a ring 4 ms slower to leave a 2-NVLink pair instead of a 1-NVLink one, 5 ms
//!   faster),
//!
//! each counted once, keeping only 2 <= s <= |A \ G| (a single GPU has no all-reduce; a size
//! the remainder cannot hold is the same for every G, as every G leaves |A| - k GPUs), and
//! only sizes whose models fit [`SEARCH_BUDGET`] (on a 16-GPU node the look-ahead leaves out
//! 8 of 14, whose B would model 3003 8-GPU groups of 5040 rings each; on 8 GPUs nothing). So a
//! pick that is a little faster now but leaves the next job across sockets loses, and a pair
//! or a single GPU goes where it leaves a 9-NVLink quad whole (the powers of two protect
//! large well-connected groups, as a buddy allocator keeps large blocks whole).
//!
//! Among equal costs (exactly equal: integer nanoseconds), in this order: the faster T(G) (the
//! job asking gets the better of two groups that swap roles); the smaller N(A \ G),
//! the same objective one request further (N(R) = min over H of k GPUs in R of T(H) + sum over
//! s in L of B_s(R \ H): where the next request of the same size would go, and what it would
//! leave; on the DGX-1 a first pair {0, 3} beats {2, 3}, as {1, 2} then still leaves the quad
//! {4, 5, 6, 7} whole, while {0, 1} would be a 1-NVLink pair; only where the next request has
//! at most [`NEXT_PLACEMENTS`] placements, as on every 8-GPU node); the larger sum over the group's
//! pairs of their bandwidth (more NVLinks inside the group than its rings need: a
//! 3-GPU ring is as fast over 4 links as over 5, the other collectives are not); the smaller
//! sum over its pairs of their PCIe distance rank (PIX 1 .. SYS 5, the locality of the weighted
//! policy); the lowest GPU indices.
//!
//! **What it does not do.** It never weighs the current request against the future by more
//! than the sum says: a 2-NVLink pair that leaves the rest no NVLink pair at all costs the
//! rest's staged PCIe pair time, which is larger than the NVLink it gains. It ignores memory
//! balance and fault domains (the weighted policy, `policy = "weighted"`, keeps them). It is
//! a model: link rates are published figures, so times are a little optimistic, equally for
//! every group.
//!
//! **Limit.** A request whose models exceed [`SEARCH_BUDGET`] (on 16 GPUs: 6 to 12 of 16
//! free) is answered by the weighted policy's exact search instead (see [`super::alloc`]); every
//! request on a node of up to 10 GPUs is within it.
//!
//! **Cost.** T depends on the group only, so it is cached per group bit mask (2^n entries at
//! most), and so is B_s per remainder mask; a node's topology does not change, so after the
//! first requests a pick is table look-ups: every group of the request's size is looked at
//! (C(16, 8) = 12870 at most).

use cuvisor_fabric::ring::{self, AllReduce};
use cuvisor_fabric::Fabric;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

/// The gradient the all-reduce times are taken for, bytes.
pub const REFERENCE_BYTES: u64 = 256 << 20;

/// How many recent request sizes the look-ahead remembers.
pub const RECENT: usize = 4;

/// The most ring candidates the picker's models may try for one size (the placements of that
/// size times the rings each model tries: (s-1)! up to 8 GPUs): a look-ahead size over it is
/// left out, and a request over it is answered by the weighted policy's search. On 16 GPUs:
/// requests for 6 to 12 of 16 free GPUs, and look-ahead size 8 of 9..16 left; on 8 GPUs
/// nothing (8 of 8 is one group of 5040 rings).
pub const SEARCH_BUDGET: u64 = 250_000;

/// The ring candidates of modelling every group of `s` GPUs among `n`.
pub fn search_cost(n: usize, s: usize) -> u64 {
    let rings = if s <= fabric_exact() {
        (1..s.max(2) as u64).product::<u64>()
    } else {
        (s * s) as u64
    };
    placements(n, s).saturating_mul(rings)
}

fn fabric_exact() -> usize {
    ring::EXACT_GPUS
}

/// N is computed where the next request has at most this many placements (every 8-GPU node;
/// on 16 GPUs it would cost hundreds of 8-GPU all-reduce models per candidate), else 0.
pub const NEXT_PLACEMENTS: u64 = 70;

/// C(n, k).
pub fn placements(n: usize, k: usize) -> u64 {
    if k > n {
        return 0;
    }
    (0..k as u64).fold(1u64, |acc, i| acc * (n as u64 - i) / (i + 1))
}

/// The time a group without any modelled bandwidth counts as, ns (an hour).
pub const UNREACHABLE_NS: u64 = 3_600_000_000_000;

/// How GetPreferredAllocation picks GPUs (`[topology] policy`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Policy {
    /// Minimise the objective of this module (the default).
    #[default]
    AllReduce,
    /// The seeds' weighted score ([`super::score`]) with its look-ahead for the same size.
    Weighted,
}

/// Not computed yet (a packed value never has all bits set: times are clamped below 2^47).
const UNKNOWN: u64 = u64::MAX;

fn pack(time: u64, mask: u32) -> u64 {
    (time.min(UNREACHABLE_NS) << 16) | u64::from(mask & 0xffff)
}

fn unpack(v: u64) -> (u64, u32) {
    (v >> 16, (v & 0xffff) as u32)
}

pub(crate) fn bits(mut m: u32) -> impl Iterator<Item = usize> {
    std::iter::from_fn(move || {
        if m == 0 {
            None
        } else {
            let i = m.trailing_zeros() as usize;
            m &= m - 1;
            Some(i)
        }
    })
}

/// One value per group mask.
type Table = Arc<[AtomicU64]>;

/// The modelled all-reduces of one node, cached per group mask. Shared by an allocator's clones
/// (they have the same interconnect).
pub(crate) struct Cache {
    fabric: Fabric,
    /// T of each group mask, ns; UNKNOWN until computed.
    times: Box<[AtomicU64]>,
    reduces: Box<[OnceLock<AllReduce>]>,
    /// Per size s: per mask, B_s packed with the group that has it; UNKNOWN until computed.
    best: Box<[OnceLock<Box<[AtomicU64]>>]>,
    /// Per request size and look-ahead sizes: per mask R, N(R) (see [`Cache::next`]).
    next: Mutex<HashMap<(usize, Vec<usize>), Table>>,
}

impl fmt::Debug for Cache {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Cache")
            .field("gpus", &self.fabric.len())
            .finish_non_exhaustive()
    }
}

impl Cache {
    pub(crate) fn new(fabric: Fabric) -> Cache {
        let n = fabric.len();
        let size = 1usize << n;
        Cache {
            times: (0..size).map(|_| AtomicU64::new(UNKNOWN)).collect(),
            reduces: (0..size).map(|_| OnceLock::new()).collect(),
            best: (0..=n).map(|_| OnceLock::new()).collect(),
            next: Mutex::new(HashMap::new()),
            fabric,
        }
    }

    pub(crate) fn fabric(&self) -> &Fabric {
        &self.fabric
    }

    /// The modelled all-reduce over the GPUs of `mask` (a valid mask of this node).
    pub(crate) fn allreduce(&self, mask: u32) -> &AllReduce {
        self.reduces[mask as usize].get_or_init(|| {
            let group: Vec<usize> = bits(mask).collect();
            ring::allreduce(&self.fabric, &group)
        })
    }

    /// T(mask), ns.
    pub(crate) fn time(&self, mask: u32) -> u64 {
        let slot = &self.times[mask as usize];
        let t = slot.load(Ordering::Relaxed);
        if t != UNKNOWN {
            return t;
        }
        let t = time_of(self.allreduce(mask));
        slot.store(t, Ordering::Relaxed);
        t
    }

    /// B_s(mask) and the group that has it (lowest mask among equals); None when mask has
    /// fewer than s GPUs. s >= 1.
    pub(crate) fn best(&self, s: usize, mask: u32) -> Option<(u64, u32)> {
        if s == 0 || (mask.count_ones() as usize) < s || s >= self.best.len() {
            return None;
        }
        let table = self.best[s].get_or_init(|| {
            (0..self.times.len())
                .map(|_| AtomicU64::new(UNKNOWN))
                .collect()
        });
        Some(unpack(self.best_in(table, s, mask)))
    }

    /// The table of N for requests of `size` planning for `sizes`.
    fn next_table(&self, size: usize, sizes: &[usize]) -> Table {
        let mut map = self.next.lock().unwrap_or_else(|e| e.into_inner());
        map.entry((size, sizes.to_vec()))
            .or_insert_with(|| {
                (0..self.times.len())
                    .map(|_| AtomicU64::new(UNKNOWN))
                    .collect()
            })
            .clone()
    }

    /// N(R) = min over H of `size` GPUs within R of T(H) + sum over s in `sizes` of B_s(R \ H):
    /// the objective of the next request of the same size, placed in R; 0 when R cannot hold it.
    fn next(&self, table: &[AtomicU64], size: usize, sizes: &[usize], rest: u32) -> u64 {
        let slot = &table[rest as usize];
        let v = slot.load(Ordering::Relaxed);
        if v != UNKNOWN {
            return v;
        }
        let mut v = 0;
        let fits = rest.count_ones() as usize >= size && size > 0;
        if fits && placements(rest.count_ones() as usize, size) <= NEXT_PLACEMENTS {
            v = u64::MAX;
            let cands: Vec<u32> = bits(rest).map(|c| 1u32 << c).collect();
            combinations(&cands, size, |h| {
                let after = rest & !h;
                let c = sizes.iter().fold(self.time(h), |acc, &s| {
                    acc.saturating_add(self.best(s, after).map_or(0, |(t, _)| t))
                });
                v = v.min(c);
            });
        }
        slot.store(v, Ordering::Relaxed);
        v
    }

    fn best_in(&self, table: &[AtomicU64], s: usize, mask: u32) -> u64 {
        let slot = &table[mask as usize];
        let v = slot.load(Ordering::Relaxed);
        if v != UNKNOWN {
            return v;
        }
        let v = if mask.count_ones() as usize == s {
            pack(self.time(mask), mask)
        } else {
            // Every s-subset of mask lies within mask less one of its GPUs.
            bits(mask)
                .map(|b| self.best_in(table, s, mask & !(1 << b)))
                .min()
                .unwrap_or(UNKNOWN)
        };
        slot.store(v, Ordering::Relaxed);
        v
    }
}

/// An all-reduce's time for the reference gradient, ns.
pub fn time_of(ar: &AllReduce) -> u64 {
    if ar.group.len() >= 2 && (ar.busbw_gbps.is_nan() || ar.busbw_gbps <= 0.0) {
        return UNREACHABLE_NS;
    }
    ar.time_ns(REFERENCE_BYTES).min(UNREACHABLE_NS)
}

/// The request sizes seen last, newest last.
#[derive(Debug, Default)]
pub(crate) struct Recent(Mutex<Vec<usize>>);

impl Clone for Recent {
    fn clone(&self) -> Recent {
        Recent(Mutex::new(self.sizes()))
    }
}

impl Recent {
    pub(crate) fn note(&self, size: usize) {
        let mut v = self.0.lock().unwrap_or_else(|e| e.into_inner());
        v.push(size);
        if v.len() > RECENT {
            v.remove(0);
        }
    }

    pub(crate) fn sizes(&self) -> Vec<usize> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// The sizes L the look-ahead plans for: `size`, `recent` and the powers of two, each once,
/// ascending, those in 2..=`left` only whose models in `left` GPUs are within
/// [`SEARCH_BUDGET`].
pub fn lookahead_sizes(size: usize, recent: &[usize], left: usize) -> Vec<usize> {
    let mut v: Vec<usize> = std::iter::once(size)
        .chain(recent.iter().copied())
        .chain((1..5).map(|j| 1usize << j))
        .filter(|&s| (2..=left).contains(&s) && search_cost(left, s) <= SEARCH_BUDGET)
        .collect();
    v.sort_unstable();
    v.dedup();
    v
}

/// The group the objective picks: `size` GPUs of `avail` with all of `must`, as a mask.
/// `links(mask)` is the group's summed pair bandwidth, `locality[mask]` its PCIe distance rank
/// sum. Needs `must` within `avail` and |must| <= size <= |avail|.
pub(crate) fn pick(
    cache: &Cache,
    links: impl Fn(u32) -> u64,
    locality: &[u32],
    avail: u32,
    must: u32,
    size: usize,
    recent: &[usize],
) -> u32 {
    let cands: Vec<u32> = bits(avail & !must).map(|c| 1u32 << c).collect();
    let r = size.saturating_sub(must.count_ones() as usize);
    let left = avail.count_ones() as usize - size;
    let sizes = lookahead_sizes(size, recent, left);
    let cost = |g: u32| {
        let rest = avail & !g;
        sizes.iter().fold(cache.time(g), |acc, &s| {
            acc.saturating_add(cache.best(s, rest).map_or(0, |(t, _)| t))
        })
    };
    // The same request again after this one, then the sizes: only on ties (depth 2).
    let plan = lookahead_sizes(size, recent, left);
    let table = cache.next_table(size, &plan);
    let keys = |g: u32, cost: u64| Keys {
        cost,
        own: cache.time(g),
        next: cache.next(&table, size, &plan, avail & !g),
        links: links(g),
        locality: locality[g as usize],
        mask: g,
    };
    // The keys of the best group so far; all but the cost computed on cost ties only.
    let mut best: Option<Keys> = None;
    combinations(&cands, r, |combo| {
        let g = must | combo;
        let c = cost(g);
        match &best {
            Some(b) if c > b.cost => {}
            Some(b) if c == b.cost => {
                let k = keys(g, c);
                if k.before(b) {
                    best = Some(k);
                }
            }
            _ => best = Some(keys(g, c)),
        }
    });
    best.map_or(must, |b| b.mask)
}

/// Calls `f` with the union of every `r` of `items` (single-bit masks).
fn combinations(items: &[u32], r: usize, mut f: impl FnMut(u32)) {
    let m = items.len();
    if r > m {
        return;
    }
    let mut idx: Vec<usize> = (0..r).collect();
    loop {
        f(idx.iter().fold(0, |acc, &i| acc | items[i]));
        let mut i = r;
        loop {
            if i == 0 {
                return;
            }
            i -= 1;
            if idx[i] < m - r + i {
                break;
            }
        }
        idx[i] += 1;
        for j in i + 1..r {
            idx[j] = idx[j - 1] + 1;
        }
    }
}

/// A candidate group's order keys, compared in this order.
struct Keys {
    /// The objective (lower first).
    cost: u64,
    /// T(G): the job's own time (lower first).
    own: u64,
    /// N(A \ G): the objective of the next request of the same size (lower first).
    next: u64,
    /// Summed pair bandwidth inside the group (higher first).
    links: u64,
    /// PCIe distance rank sum (lower first).
    locality: u32,
    mask: u32,
}

impl Keys {
    fn before(&self, o: &Keys) -> bool {
        self.order(o) == std::cmp::Ordering::Less
    }

    fn order(&self, o: &Keys) -> std::cmp::Ordering {
        self.cost
            .cmp(&o.cost)
            .then(self.own.cmp(&o.own))
            .then(self.next.cmp(&o.next))
            .then(o.links.cmp(&self.links))
            .then(self.locality.cmp(&o.locality))
            .then_with(|| {
                if self.mask == o.mask {
                    std::cmp::Ordering::Equal
                } else if lex_less(self.mask, o.mask) {
                    std::cmp::Ordering::Less
                } else {
                    std::cmp::Ordering::Greater
                }
            })
    }
}

/// Whether the sorted index list of `a` comes before that of `b` (same size, a != b): the set
/// holding the lowest GPU in one but not the other does.
fn lex_less(a: u32, b: u32) -> bool {
    let d = a ^ b;
    d != 0 && a & (d & d.wrapping_neg()) != 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookahead_sizes_union_of_same_recent_and_powers_of_two() {
        assert_eq!(lookahead_sizes(2, &[], 6), [2, 4]);
        assert_eq!(lookahead_sizes(3, &[1, 3, 6], 7), [2, 3, 4, 6]);
        assert_eq!(
            lookahead_sizes(3, &[], 2),
            [2],
            "a smaller power of two counts"
        );
        assert_eq!(lookahead_sizes(1, &[], 1), Vec::<usize>::new());
        assert_eq!(
            lookahead_sizes(4, &[], 12),
            [2, 4],
            "C(12, 8) x 7! > the budget"
        );
        assert_eq!(
            lookahead_sizes(5, &[], 16),
            [2, 4, 5, 16],
            "C(16, 8) x 7! > the budget"
        );
        assert_eq!(lookahead_sizes(2, &[], 14), [2, 4]);
        assert_eq!(lookahead_sizes(2, &[], 8), [2, 4, 8]);
    }

    #[test]
    fn lex_order_of_masks() {
        assert!(lex_less(0b0011, 0b0101));
        assert!(!lex_less(0b0101, 0b0011));
        assert!(lex_less(0b1001, 0b1010), "[0, 3] before [1, 3]");
        assert!(!lex_less(0b0110, 0b0110));
    }

    #[test]
    fn placements_count() {
        assert_eq!(placements(8, 4), 70);
        assert_eq!(placements(16, 8), 12870);
        assert_eq!(placements(5, 0), 1);
        assert_eq!(search_cost(8, 8), 5040);
        assert!(search_cost(16, 6) > SEARCH_BUDGET && search_cost(16, 5) <= SEARCH_BUDGET);
        assert!(search_cost(16, 13) <= SEARCH_BUDGET && search_cost(16, 12) > SEARCH_BUDGET);
    }

    #[test]
    fn pack_keeps_time_order_then_mask() {
        assert!(pack(5, 0xffff) < pack(6, 0));
        assert_eq!(unpack(pack(123, 0b1010)), (123, 0b1010));
        assert_ne!(pack(u64::MAX, 0xffff), UNKNOWN);
    }

    #[test]
    fn recent_keeps_the_last_few() {
        let r = Recent::default();
        for s in 1..=6 {
            r.note(s);
        }
        assert_eq!(r.sizes(), [3, 4, 5, 6]);
        assert_eq!(r.clone().sizes(), [3, 4, 5, 6]);
    }
}
