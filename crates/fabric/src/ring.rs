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
//! **Cost.** The routes between the group's GPUs are built once per call, as dense resource
//! ids; every candidate ring's resources are counted once, flat; a candidate's bottleneck stops
//! as soon as it cannot beat the best so far. An 8-GPU group (5040 rings) takes about 0.5 ms.
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

use crate::{specs, End, Fabric, RouteKind};

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
        if self.busbw_gbps.is_nan() || self.busbw_gbps <= 0.0 {
            // No ring: it never completes.
            return u64::MAX;
        }
        let moved = (2 * (k as u128 - 1) * bytes as u128 / k as u128).min(u64::MAX as u128) as u64;
        specs::transfer_ns(moved, self.busbw_gbps)
            .saturating_add((2 * (k - 1)).saturating_mul(self.step_latency_ns))
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

/// The routes between the GPUs of one group, built once: for every ordered pair, the dense
/// resource ids ([`Fabric::index`]) its copy crosses, in order, and its route class.
struct Pairs {
    /// GPU -> position in the group.
    pos: Vec<usize>,
    k: usize,
    hops: Vec<Vec<usize>>,
    class: Vec<u8>,
}

impl Pairs {
    fn new(f: &Fabric, group: &[usize]) -> Pairs {
        let k = group.len();
        let mut pos = vec![usize::MAX; f.len()];
        for (i, &g) in group.iter().enumerate() {
            pos[g] = i;
        }
        let mut hops = Vec::with_capacity(k * k);
        let mut class_of = Vec::with_capacity(k * k);
        for &a in group {
            for &b in group {
                let route = f.route(End::Gpu(a), End::Gpu(b), true);
                hops.push(route.hops.iter().filter_map(|&r| f.index(r)).collect());
                class_of.push(class(route.kind));
            }
        }
        Pairs {
            pos,
            k,
            hops,
            class: class_of,
        }
    }

    fn at(&self, a: usize, b: usize) -> usize {
        self.pos[a] * self.k + self.pos[b]
    }

    /// A ring's edges' worst route class.
    fn ring_class(&self, order: &[usize]) -> u8 {
        (0..order.len())
            .map(|i| self.class[self.at(order[i], order[(i + 1) % order.len()])])
            .max()
            .unwrap_or(0)
    }

    /// Appends the resources one ring crosses to `uses`, each with how many of its edges cross
    /// it, in the order the ring first crosses them. `count`: scratch, one zero per resource
    /// (left zeroed).
    fn ring_uses(&self, order: &[usize], count: &mut [u32], uses: &mut Vec<(usize, u32)>) {
        let from = uses.len();
        for i in 0..order.len() {
            for &r in &self.hops[self.at(order[i], order[(i + 1) % order.len()])] {
                if count[r] == 0 {
                    uses.push((r, 0));
                }
                count[r] += 1;
            }
        }
        for u in &mut uses[from..] {
            u.1 = count[u.0];
            count[u.0] = 0;
        }
    }
}

/// Candidate rings, flat: ring i is `orders[i*k..][..k]`, crosses `uses[start[i]..start[i+1]]`
/// and has route class `class[i]`.
struct Candidates {
    k: usize,
    orders: Vec<usize>,
    uses: Vec<(usize, u32)>,
    start: Vec<usize>,
    class: Vec<u8>,
}

impl Candidates {
    fn new(k: usize) -> Candidates {
        Candidates {
            k,
            orders: Vec::new(),
            uses: Vec::new(),
            start: vec![0],
            class: Vec::new(),
        }
    }

    fn push(&mut self, p: &Pairs, order: &[usize], count: &mut [u32]) {
        self.orders.extend_from_slice(order);
        p.ring_uses(order, count, &mut self.uses);
        self.start.push(self.uses.len());
        self.class.push(p.ring_class(order));
    }

    fn len(&self) -> usize {
        self.class.len()
    }

    fn order(&self, i: usize) -> &[usize] {
        &self.orders[i * self.k..(i + 1) * self.k]
    }

    fn uses(&self, i: usize) -> &[(usize, u32)] {
        &self.uses[self.start[i]..self.start[i + 1]]
    }
}

/// A ring's bandwidth on the capacity left; None as soon as it cannot exceed `beat` (its
/// bandwidth is the minimum over its resources, so a partial minimum bounds it).
fn bottleneck(uses: &[(usize, u32)], left: &[f64], beat: f64) -> Option<f64> {
    let mut b = f64::INFINITY;
    for &(r, n) in uses {
        b = b.min(left[r] / n as f64);
        if b <= beat {
            return None;
        }
    }
    Some(b)
}

/// Calls `f` with every directed ring through `group` starting at its first GPU, in the order
/// of a depth-first walk that tries the remaining GPUs in their order.
fn all_rings(group: &[usize], mut f: impl FnMut(&[usize])) {
    fn walk(rest: &mut Vec<usize>, path: &mut Vec<usize>, f: &mut impl FnMut(&[usize])) {
        if rest.is_empty() {
            f(path);
            return;
        }
        for i in 0..rest.len() {
            let g = rest.remove(i);
            path.push(g);
            walk(rest, path, f);
            path.pop();
            rest.insert(i, g);
        }
    }
    walk(&mut group[1..].to_vec(), &mut vec![group[0]], &mut f);
}

/// Rings built from every start by always taking the widest next hop on the capacity left.
fn greedy_rings(p: &Pairs, group: &[usize], left: &[f64]) -> Vec<Vec<usize>> {
    let hop = |a: usize, b: usize| {
        p.hops[p.at(a, b)]
            .iter()
            .map(|&r| left[r])
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
/// first. Empty for fewer than two GPUs, and for a group that is no group of `f` (an index out
/// of range, a GPU twice): no ring goes through a GPU twice or one the machine lacks.
pub fn rings(f: &Fabric, group: &[usize]) -> Vec<Ring> {
    let distinct = group
        .iter()
        .enumerate()
        .all(|(i, &g)| g < f.len() && !group[..i].contains(&g));
    if group.len() < 2 || !distinct {
        return Vec::new();
    }
    let k = group.len();
    let resources = f.resources();
    let mut left: Vec<f64> = resources.iter().map(|&r| f.capacity(r)).collect();
    let pairs = Pairs::new(f, group);
    let mut count = vec![0u32; resources.len()];
    let exact = (k <= EXACT_GPUS).then(|| {
        let mut c = Candidates::new(k);
        all_rings(group, |o| c.push(&pairs, o, &mut count));
        c
    });
    let mut out: Vec<Ring> = Vec::new();
    let mut first_class: Option<u8> = None;
    while out.len() < MAX_RINGS {
        let greedy: Candidates;
        let candidates = match &exact {
            Some(c) => c,
            None => {
                let mut c = Candidates::new(k);
                for o in greedy_rings(&pairs, group, &left) {
                    c.push(&pairs, &o, &mut count);
                }
                greedy = c;
                &greedy
            }
        };
        // The first candidate with the widest bottleneck (a later one must beat it by 1e-9).
        let mut best: Option<(usize, f64)> = None;
        for i in 0..candidates.len() {
            if first_class.is_some_and(|fc| candidates.class[i] > fc) {
                continue;
            }
            let beat = best.map_or(f64::NEG_INFINITY, |x| x.1 + 1e-9);
            if let Some(b) = bottleneck(candidates.uses(i), &left, beat) {
                best = Some((i, b));
            }
        }
        let Some((i, gbps)) = best else {
            break;
        };
        let order = candidates.order(i).to_vec();
        let floor = out.first().map_or(0.0, |r| r.gbps * MIN_SHARE);
        if !gbps.is_finite() || gbps <= floor || gbps <= 1e-9 {
            if !gbps.is_finite() && out.is_empty() {
                // Nothing on the way limits it (unknown bandwidths): one ring, unbounded.
                out.push(Ring { order, gbps });
            }
            break;
        }
        for &(r, n) in candidates.uses(i) {
            left[r] -= gbps * n as f64;
        }
        first_class.get_or_insert(candidates.class[i]);
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
