//! The allocator: the best group of GPUs for a request, by exact search.
//!
//! [`Allocator::preferred`] answers kubelet's GetPreferredAllocation: given the free GPUs, the
//! ones that must be in the answer, and a size, it returns, among **all** groups of that size
//! that contain the must-include GPUs:
//!
//! - under `policy = "allreduce"` (the default, [`Policy::AllReduce`]), the group minimising
//!   [`super::objective`]'s cost: this job's modelled all-reduce time plus the best times the
//!   GPUs it leaves allow for the requests that plausibly come next (the same size, the sizes
//!   [`Allocator::note_request`] saw last, the powers of two). Every group is looked at, with
//!   the all-reduce models cached per group ([`Allocator::allreduce`],
//!   [`Allocator::best_allreduce`]). A request too large to model every group of
//!   ([`super::objective::SEARCH_BUDGET`]: 6 to 12 of 16 free GPUs) falls back to the search
//!   below.
//! - under `policy = "weighted"`, the group with the highest [`super::score`] (branch and bound
//!   over the subsets, so nothing is missed the way a BFS over neighbours misses groups; see the
//!   seeds). The rest of this text is about this search.
//!
//! Among groups whose scores are equal (within 1e-12), it plans for the next request, then for
//! locality, then for determinism, in this order:
//!
//! 1. **Look-ahead**: the group that leaves the best remaining GPUs for another request of the
//!    same size. Each remaining GPU is worth the sum of its bandwidths (MB/s) to its best
//!    `m - 1` remaining partners, where m = max(size, 2) (a size-1 request still protects
//!    pairs); the remaining GPUs' worths are added up, larger is better. A GPU stranded without a good
//!    partner lowers it, so on the DGX-1 cube-mesh four size-2 requests in a row each get a
//!    2-NVLink pair. (NVIDIA's go-gpuallocator instead maximises the score of a whole partition
//!    of the free GPUs into groups of the size, which may give the current request a worse
//!    group than the best one, and costs (n-1)!! partitions for pairs; this one never trades the
//!    current request's score for the future, and stays cheap.)
//! 2. **Locality**: the smaller sum over the group's pairs of their PCIe distance rank
//!    (PIX 1, PXB 2, PHB 3, NODE 4, SYS 5; for a pair whose PCIe path is unknown, NODE when
//!    both GPUs are on one NUMA node, else SYS). Keeps a pick on one PCIe switch / NUMA node
//!    when NVLink does not tell groups apart (NVSwitch boxes).
//! 3. The lowest GPU indices (lexicographically smallest sorted group).
//!
//! The search: a greedy pass (from every seed GPU, add the GPU with the most bandwidth to the
//! group so far) gives a floor; a depth-first walk over the candidates in index order then
//! prunes every branch whose upper bound is below the floor or the best so far. The bounds:
//! bandwidth, each newcomer's bandwidth to the partial group plus half its best links to the
//! other candidates; structure, from the partial group's cliqueness, its common NVLink
//! neighbours, its NVLink component and its members' degrees; balance and spread, from the
//! partial group. Because the walk visits groups in lexicographic order, a branch that can at
//! best tie the best so far on score, look-ahead and locality is pruned too (its groups would
//! lose on the last key), with matching bounds for look-ahead and locality. 16 GPUs, any size:
//! well under 1 ms (see `benches/topology.rs`).
//!
//! Limits: at most [`MAX_GPUS`] GPUs (the ring test uses a table over all subsets).

use super::model::{Memory, PcieLevel, Topology};
use super::objective::{self, Cache, Policy, Recent};
use super::score::{combine, Ingredients, Score, Structure, Weights};
use cuvisor_fabric::ring::AllReduce;
use cuvisor_fabric::Fabric;
use std::fmt;
use std::sync::Arc;

/// The most GPUs the allocator handles (DGX-2 / HGX-2 have 16).
pub const MAX_GPUS: usize = 16;

/// Scores closer than this are equal.
const EPS: f64 = 1e-12;

#[derive(Clone, Debug, PartialEq)]
pub enum AllocError {
    TooManyGpus {
        gpus: usize,
    },
    ZeroSize,
    /// A GPU index that the topology does not have.
    UnknownGpu {
        gpu: usize,
        gpus: usize,
    },
    /// A GPU listed twice in `list` ("available", "must_include" or "group").
    Duplicate {
        gpu: usize,
        list: &'static str,
    },
    MustIncludeUnavailable {
        gpu: usize,
    },
    MustIncludeTooMany {
        must_include: usize,
        size: usize,
    },
    NotEnoughAvailable {
        size: usize,
        available: usize,
    },
    EmptyGroup,
    Weights(String),
}

impl fmt::Display for AllocError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AllocError::TooManyGpus { gpus } => write!(
                f,
                "the topology has {gpus} GPUs; the allocator handles at most {MAX_GPUS}"
            ),
            AllocError::ZeroSize => write!(f, "a request for 0 GPUs"),
            AllocError::UnknownGpu { gpu, gpus } => write!(
                f,
                "GPU{gpu} does not exist (this node has {gpus} GPUs, GPU0..GPU{})",
                gpus.saturating_sub(1)
            ),
            AllocError::Duplicate { gpu, list } => write!(f, "GPU{gpu} is listed twice in {list}"),
            AllocError::MustIncludeUnavailable { gpu } => write!(
                f,
                "GPU{gpu} must be included but is not among the available GPUs"
            ),
            AllocError::MustIncludeTooMany { must_include, size } => write!(
                f,
                "{must_include} GPUs must be included in a request for {size}"
            ),
            AllocError::NotEnoughAvailable { size, available } => write!(
                f,
                "a request for {size} GPUs, but only {available} are available"
            ),
            AllocError::EmptyGroup => write!(f, "an empty group has no score"),
            AllocError::Weights(why) => write!(f, "scoring weights: {why}"),
        }
    }
}

impl std::error::Error for AllocError {}

/// A topology prepared for allocation: pair bandwidths, NVLink adjacency, the structure of every
/// subset, distances. Build once per node; update free memory with [`Allocator::set_memory`].
#[derive(Clone, Debug)]
pub struct Allocator {
    topology: Topology,
    n: usize,
    /// Pair bandwidth, MB/s, n x n (0 on the diagonal).
    bw: Vec<u64>,
    /// Best pair bandwidth on the machine, MB/s (>= 1).
    best_bw: u64,
    /// NVLink neighbours of each GPU, as a bit mask.
    adj: Vec<u32>,
    /// Structure of every subset (indexed by bit mask).
    structure: Vec<Structure>,
    /// Locality rank of each pair, n x n.
    rank: Vec<u32>,
    free: Vec<f64>,
    /// Dense fault-domain number of each GPU (0..domains).
    domain: Vec<u32>,
    domains: u32,
    /// Per GPU: its partners grouped by bandwidth, best first (bandwidth, mask).
    tiers: Vec<Vec<(u64, u32)>>,
    /// Per GPU: its partners grouped by locality rank, nearest first (rank, mask).
    rank_tiers: Vec<Vec<(u64, u32)>>,
    /// Locality rank sum of every subset (indexed by bit mask), the all-reduce policy's tie-break.
    locality: Vec<u32>,
    /// The modelled all-reduce of every group, computed on first use.
    cache: Arc<Cache>,
    /// The request sizes seen last ([`Allocator::note_request`]).
    recent: Recent,
}

/// The sum of the best `count` values `tiers` offers within `mask` (tiers in preference order),
/// and how many it found.
fn sum_best(tiers: &[(u64, u32)], mask: u32, count: usize) -> (u64, usize) {
    let mut need = count;
    let mut sum = 0u64;
    for &(value, m) in tiers {
        if need == 0 {
            break;
        }
        let take = ((m & mask).count_ones() as usize).min(need);
        sum += value * take as u64;
        need -= take;
    }
    (sum, count - need)
}

/// Groups each GPU's partners by `value(g, h)`, sorted by `order`.
fn make_tiers(
    n: usize,
    value: impl Fn(usize, usize) -> u64,
    descending: bool,
) -> Vec<Vec<(u64, u32)>> {
    (0..n)
        .map(|g| {
            let mut levels: Vec<u64> = (0..n).filter(|&h| h != g).map(|h| value(g, h)).collect();
            levels.sort_unstable();
            if descending {
                levels.reverse();
            }
            levels.dedup();
            levels
                .into_iter()
                .map(|l| {
                    let mask = (0..n)
                        .filter(|&h| h != g && value(g, h) == l)
                        .fold(0u32, |m, h| m | 1 << h);
                    (l, mask)
                })
                .collect()
        })
        .collect()
}

fn bits(mut m: u32) -> impl Iterator<Item = usize> {
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

impl Allocator {
    pub fn new(topology: Topology) -> Result<Allocator, AllocError> {
        let n = topology.len();
        if n > MAX_GPUS {
            return Err(AllocError::TooManyGpus { gpus: n });
        }
        let mut bw = vec![0u64; n * n];
        let mut adj = vec![0u32; n];
        let mut rank = vec![0u32; n * n];
        for a in 0..n {
            for b in 0..n {
                if a == b {
                    continue;
                }
                bw[a * n + b] = (topology.bandwidth_gbps(a, b) * 1000.0).round() as u64;
                let link = topology.link(a, b).copied().unwrap_or(Topology::SELF_LINK);
                if link.nvlink.is_some() {
                    adj[a] |= 1 << b;
                }
                rank[a * n + b] = match link.pcie {
                    Some(level) => level.rank(),
                    None => {
                        let (x, y) = (&topology.gpus()[a], &topology.gpus()[b]);
                        let near = match (x.numa_node, y.numa_node) {
                            (Some(p), Some(q)) => p == q,
                            _ => {
                                matches!((&x.cpu_affinity, &y.cpu_affinity), (Some(p), Some(q)) if p == q)
                            }
                        };
                        if near {
                            PcieLevel::Node.rank()
                        } else {
                            PcieLevel::System.rank()
                        }
                    }
                };
            }
        }
        let best_bw = bw.iter().copied().max().unwrap_or(0).max(1);
        let tiers = make_tiers(n, |a, b| bw[a * n + b], true);
        let rank_tiers = make_tiers(n, |a, b| rank[a * n + b] as u64, false);
        let mut ids: Vec<usize> = topology.gpus().iter().map(|g| g.fault_domain).collect();
        ids.sort_unstable();
        ids.dedup();
        let domain = topology
            .gpus()
            .iter()
            .map(|g| ids.binary_search(&g.fault_domain).unwrap_or(0) as u32)
            .collect();
        let free = topology
            .gpus()
            .iter()
            .map(|g| g.memory.map_or(1.0, |m| m.free_fraction()))
            .collect();
        // locality[mask] = locality[mask less its lowest GPU] + that GPU's ranks to the others.
        let mut locality = vec![0u32; 1 << n];
        for mask in 1..(1u32 << n) {
            let low = mask.trailing_zeros() as usize;
            let rest = mask & (mask - 1);
            locality[mask as usize] =
                locality[rest as usize] + bits(rest).map(|h| rank[low * n + h]).sum::<u32>();
        }
        Ok(Allocator {
            locality,
            cache: Arc::new(Cache::new(super::fabric::fabric(&topology))),
            recent: Recent::default(),
            structure: structure_table(n, &adj),
            n,
            bw,
            best_bw,
            adj,
            rank,
            free,
            domain,
            domains: ids.len().max(1) as u32,
            tiers,
            rank_tiers,
            topology,
        })
    }

    pub fn topology(&self) -> &Topology {
        &self.topology
    }

    /// The node's interconnect model.
    pub fn fabric(&self) -> &Fabric {
        self.cache.fabric()
    }

    /// Remembers the size of a request that arrived (the plugin calls it for every
    /// GetPreferredAllocation): the all-reduce policy's look-ahead plans for the last
    /// [`objective::RECENT`] sizes.
    pub fn note_request(&self, size: usize) {
        self.recent.note(size);
    }

    /// The request sizes remembered, oldest first.
    pub fn recent_requests(&self) -> Vec<usize> {
        self.recent.sizes()
    }

    /// The modelled all-reduce over `group` (GPU indices; unknown and repeated ones are
    /// ignored), cached per group.
    pub fn allreduce(&self, group: &[usize]) -> AllReduce {
        let mask = group
            .iter()
            .filter(|&&g| g < self.n)
            .fold(0u32, |m, &g| m | 1 << g);
        self.cache.allreduce(mask).clone()
    }

    /// The group of `size` GPUs (at most the node's) with the fastest modelled all-reduce on
    /// this node, and that all-reduce; cached. Among equals the lowest bit mask. The first call
    /// for a size models every group of it: on 8 GPUs a few ms; on 16 GPUs, for sizes whose
    /// [`objective::search_cost`] exceeds [`objective::SEARCH_BUDGET`] (6 to 12; 8 of 16 is
    /// 12870 groups of 5040 rings), seconds.
    pub fn best_allreduce(&self, size: usize) -> (Vec<usize>, AllReduce) {
        let all = if self.n == 0 {
            0
        } else {
            u32::MAX >> (32 - self.n)
        };
        let mask = match self.cache.best(size.min(self.n), all) {
            Some((_, mask)) => mask,
            None => 0,
        };
        (bits(mask).collect(), self.cache.allreduce(mask).clone())
    }

    /// The objective's cost of picking `group` from `available` for a request of its size,
    /// with the look-ahead sizes `recent` (see [`objective`]), ns; and the sizes planned for.
    pub fn objective_cost(
        &self,
        available: &[usize],
        group: &[usize],
        recent: &[usize],
    ) -> Result<(u64, Vec<usize>), AllocError> {
        let avail = self.mask_of(available, "available")?;
        let g = self.mask_of(group, "group")?;
        if g & !avail != 0 {
            return Err(AllocError::MustIncludeUnavailable {
                gpu: (g & !avail).trailing_zeros() as usize,
            });
        }
        let rest = avail & !g;
        let sizes = objective::lookahead_sizes(group.len(), recent, rest.count_ones() as usize);
        let cost = sizes.iter().fold(self.cache.time(g), |acc, &s| {
            acc.saturating_add(self.cache.best(s, rest).map_or(0, |(t, _)| t))
        });
        Ok((cost, sizes))
    }

    /// Records a GPU's current memory (the balance term uses the free fraction).
    pub fn set_memory(&mut self, gpu: usize, memory: Memory) -> Result<(), AllocError> {
        self.topology
            .set_memory(gpu, memory)
            .map_err(|_| AllocError::UnknownGpu { gpu, gpus: self.n })?;
        self.free[gpu] = memory.free_fraction();
        Ok(())
    }

    /// The NVLink structure of a group.
    pub fn structure(&self, group: &[usize]) -> Result<Structure, AllocError> {
        let mask = self.mask_of(group, "group")?;
        if mask == 0 {
            return Err(AllocError::EmptyGroup);
        }
        Ok(self.structure[mask as usize])
    }

    /// The score of a group (see [`super::score`]).
    pub fn score(&self, group: &[usize], weights: &Weights) -> Result<Score, AllocError> {
        weights.validate().map_err(AllocError::Weights)?;
        let mask = self.mask_of(group, "group")?;
        if mask == 0 {
            return Err(AllocError::EmptyGroup);
        }
        let k = group.len();
        let mut pair_mbps = 0u64;
        let mut min_pair = u64::MAX;
        for (i, &a) in group.iter().enumerate() {
            for &b in &group[i + 1..] {
                let v = self.bw[a * self.n + b];
                pair_mbps += v;
                min_pair = min_pair.min(v);
            }
        }
        let (mut min_free, mut max_free) = (f64::INFINITY, f64::NEG_INFINITY);
        let mut dmask = 0u32;
        for &g in group {
            min_free = min_free.min(self.free[g]);
            max_free = max_free.max(self.free[g]);
            dmask |= 1 << self.domain[g];
        }
        let x = Ingredients {
            k,
            pair_mbps,
            structure: self.structure[mask as usize],
            min_free,
            max_free,
            domains: dmask.count_ones(),
        };
        let t = combine(&weights.normalised(), &x, self.best_bw, self.domains);
        let pairs = k * (k - 1) / 2;
        Ok(Score {
            total: t.total,
            bandwidth: t.bandwidth,
            structure: x.structure,
            balance: t.balance,
            domain: t.domain,
            mean_pair_gbps: if pairs == 0 {
                0.0
            } else {
                pair_mbps as f64 / pairs as f64 / 1000.0
            },
            min_pair_gbps: if pairs == 0 {
                0.0
            } else {
                min_pair as f64 / 1000.0
            },
        })
    }

    /// The best group of `size` GPUs among `available` that contains every GPU of
    /// `must_include`, sorted by index, by `weights.policy` (see the module docs).
    pub fn preferred(
        &self,
        available: &[usize],
        must_include: &[usize],
        size: usize,
        weights: &Weights,
    ) -> Result<Vec<usize>, AllocError> {
        weights.validate().map_err(AllocError::Weights)?;
        if size == 0 {
            return Err(AllocError::ZeroSize);
        }
        let avail = self.mask_of(available, "available")?;
        let must = self.mask_of(must_include, "must_include")?;
        if let Some(gpu) = bits(must & !avail).next() {
            return Err(AllocError::MustIncludeUnavailable { gpu });
        }
        if must_include.len() > size {
            return Err(AllocError::MustIncludeTooMany {
                must_include: must_include.len(),
                size,
            });
        }
        if size > available.len() {
            return Err(AllocError::NotEnoughAvailable {
                size,
                available: available.len(),
            });
        }
        if must_include.len() == size {
            return Ok(bits(must).collect());
        }
        if size == available.len() {
            return Ok(bits(avail).collect());
        }
        let cost = objective::search_cost(
            available.len() - must_include.len(),
            size - must_include.len(),
        );
        if weights.policy == Policy::AllReduce && cost <= objective::SEARCH_BUDGET {
            let recent = self.recent.sizes();
            let links = |g: u32| -> u64 {
                bits(g)
                    .map(|a| bits(g).map(|b| self.bw[a * self.n + b]).sum::<u64>())
                    .sum()
            };
            let mask = objective::pick(
                &self.cache,
                links,
                &self.locality,
                avail,
                must,
                size,
                &recent,
            );
            return Ok(bits(mask).collect());
        }
        let mut s = Search::new(self, weights.normalised(), avail, must, size);
        let root = s.root();
        s.dfs(&root, 0, size - must_include.len());
        // The search always reaches a leaf: there are at least `size - |must|` candidates.
        Ok(s.best.map_or_else(Vec::new, |b| bits(b.mask).collect()))
    }

    fn mask_of(&self, list: &[usize], name: &'static str) -> Result<u32, AllocError> {
        let mut mask = 0u32;
        for &g in list {
            if g >= self.n {
                return Err(AllocError::UnknownGpu {
                    gpu: g,
                    gpus: self.n,
                });
            }
            if mask & (1 << g) != 0 {
                return Err(AllocError::Duplicate { gpu: g, list: name });
            }
            mask |= 1 << g;
        }
        Ok(mask)
    }

    /// Sum over the GPUs of `rest` of each one's bandwidth to its best `partners` partners
    /// within `rest` (the look-ahead worth); also each GPU's own worth in `worth`.
    fn lookahead(&self, rest: u32, partners: usize, worth: &mut [u64; MAX_GPUS]) -> u64 {
        let mut total = 0;
        for g in bits(rest) {
            let (sum, _) = sum_best(&self.tiers[g], rest, partners);
            worth[g] = sum;
            total += sum;
        }
        total
    }
}

/// The structure of every subset of `n` GPUs with NVLink adjacency `adj`.
fn structure_table(n: usize, adj: &[u32]) -> Vec<Structure> {
    let size = 1usize << n;
    let mut table = vec![Structure::Disconnected; size];
    let complete = (0..n).all(|v| adj[v] | 1 << v == (size - 1) as u32);
    let empty = adj.iter().all(|&a| a == 0);
    // reach[mask]: the ends v of paths that start at mask's lowest GPU and visit exactly mask.
    let mut reach = if complete || empty {
        Vec::new()
    } else {
        vec![0u32; size]
    };
    for mask in 1..size as u32 {
        let k = mask.count_ones();
        let lowest = mask.trailing_zeros() as usize;
        if !reach.is_empty() {
            if k == 1 {
                reach[mask as usize] = mask;
            }
            let ends = reach[mask as usize];
            let above = !((2u32 << lowest) - 1);
            for v in bits(ends) {
                for u in bits(adj[v] & !mask & above) {
                    reach[(mask | 1 << u) as usize] |= 1 << u;
                }
            }
        }
        table[mask as usize] = if bits(mask).all(|v| (adj[v] | 1 << v) & mask == mask) {
            Structure::FullyConnected
        } else if !connected(mask, adj) {
            Structure::Disconnected
        } else if k >= 4 && !reach.is_empty() && reach[mask as usize] & adj[lowest] != 0 {
            Structure::Ring
        } else {
            Structure::Tree
        };
    }
    table
}

fn connected(mask: u32, adj: &[u32]) -> bool {
    let mut seen = 1u32 << mask.trailing_zeros();
    loop {
        let next = bits(seen).fold(seen, |s, v| s | (adj[v] & mask));
        if next == seen {
            return seen == mask;
        }
        seen = next;
    }
}

#[derive(Clone, Copy)]
struct Best {
    score: f64,
    worth: u64,
    locality: u32,
    mask: u32,
}

/// A partial group and what adding each further GPU would bring.
#[derive(Clone)]
struct Node {
    mask: u32,
    pair_mbps: u64,
    locality: u32,
    min_free: f64,
    max_free: f64,
    domains: u32,
    clique: bool,
    /// GPUs adjacent (NVLink) to every member (all ones when empty).
    common: u32,
    /// Bandwidth from each GPU to the partial group, MB/s.
    gain: [u64; MAX_GPUS],
    /// Locality rank sum from each GPU to the partial group.
    near: [u32; MAX_GPUS],
}

/// The `r` largest (or smallest) of `values`, summed.
fn sum_extreme(values: &mut [u64], r: usize, largest: bool) -> u64 {
    values.sort_unstable();
    if largest {
        values.iter().rev().take(r).sum()
    } else {
        values.iter().take(r).sum()
    }
}

struct Search<'a> {
    al: &'a Allocator,
    w: [f64; 4],
    size: usize,
    avail: u32,
    must: u32,
    /// The GPUs to choose from (available, not must-include), ascending.
    cands: Vec<usize>,
    /// `suffix[i]`: the mask of `cands[i..]`.
    suffix: Vec<u32>,
    partners: usize,
    /// An upper bound on the look-ahead worth of any answer.
    worth_bound: u64,
    /// A lower bound on the best score (a greedy group's).
    floor: f64,
    best: Option<Best>,
}

impl<'a> Search<'a> {
    fn new(al: &'a Allocator, w: [f64; 4], avail: u32, must: u32, size: usize) -> Search<'a> {
        let cands: Vec<usize> = bits(avail & !must).collect();
        let mut suffix = vec![0u32; cands.len() + 1];
        for i in (0..cands.len()).rev() {
            suffix[i] = suffix[i + 1] | 1 << cands[i];
        }
        // The look-ahead counts each remaining GPU's best `size - 1` partners (at least one),
        // of which there are at most `left - 1` once this request is served.
        let left = avail.count_ones() as usize - size;
        let partners = (size.max(2) - 1).min(left.saturating_sub(1));
        let mut worth = [0u64; MAX_GPUS];
        let total = al.lookahead(avail, partners, &mut worth);
        // Any answer removes the must-include GPUs and `size - |must|` candidates: at least the
        // smallest worths among them; the others' worths can only fall.
        let mut cw: Vec<u64> = cands.iter().map(|&c| worth[c]).collect();
        let removed = bits(must).map(|g| worth[g]).sum::<u64>()
            + sum_extreme(&mut cw, size - must.count_ones() as usize, false);
        let mut s = Search {
            al,
            w,
            size,
            avail,
            must,
            cands,
            suffix,
            partners,
            worth_bound: total.saturating_sub(removed),
            floor: f64::NEG_INFINITY,
            best: None,
        };
        s.floor = s.greedy();
        s
    }

    fn root(&self) -> Node {
        let mut node = Node {
            mask: 0,
            pair_mbps: 0,
            locality: 0,
            min_free: f64::INFINITY,
            max_free: f64::NEG_INFINITY,
            domains: 0,
            clique: true,
            common: u32::MAX,
            gain: [0; MAX_GPUS],
            near: [0; MAX_GPUS],
        };
        for g in bits(self.must) {
            node = self.add(&node, g);
        }
        node
    }

    fn add(&self, node: &Node, x: usize) -> Node {
        let al = self.al;
        let n = al.n;
        let mut child = node.clone();
        child.mask |= 1 << x;
        child.pair_mbps += node.gain[x];
        child.locality += node.near[x];
        child.min_free = node.min_free.min(al.free[x]);
        child.max_free = node.max_free.max(al.free[x]);
        child.domains |= 1 << al.domain[x];
        child.clique = node.clique && al.adj[x] & node.mask == node.mask;
        child.common = node.common & al.adj[x];
        for c in 0..n {
            child.gain[c] += al.bw[c * n + x];
            child.near[c] += al.rank[c * n + x];
        }
        child
    }

    fn score_of(&self, node: &Node) -> f64 {
        let x = Ingredients {
            k: node.mask.count_ones() as usize,
            pair_mbps: node.pair_mbps,
            structure: self.al.structure[node.mask as usize],
            min_free: node.min_free,
            max_free: node.max_free,
            domains: node.domains.count_ones(),
        };
        combine(&self.w, &x, self.al.best_bw, self.al.domains).total
    }

    /// A good group, fast: from each seed, add the candidate with the most bandwidth to the
    /// group so far. Its score is a lower bound on the best.
    fn greedy(&self) -> f64 {
        let r = self.size - self.must.count_ones() as usize;
        let root = self.root();
        let seeds: Vec<Option<usize>> = if self.must != 0 {
            vec![None]
        } else {
            self.cands.iter().map(|&c| Some(c)).collect()
        };
        let mut floor = f64::NEG_INFINITY;
        for seed in seeds {
            let mut node = root.clone();
            let mut left = r;
            if let Some(c) = seed {
                node = self.add(&node, c);
                left -= 1;
            }
            for _ in 0..left {
                let pick = self
                    .cands
                    .iter()
                    .copied()
                    .filter(|&c| node.mask & (1 << c) == 0)
                    .max_by_key(|&c| (node.gain[c], std::cmp::Reverse(node.near[c])));
                match pick {
                    Some(c) => node = self.add(&node, c),
                    None => break,
                }
            }
            if node.mask.count_ones() as usize == self.size {
                floor = floor.max(self.score_of(&node));
            }
        }
        floor
    }

    /// An upper bound on the score of any completion of `node` by `r` GPUs of `cands[start..]`.
    fn score_bound(&self, node: &Node, start: usize, r: usize) -> f64 {
        let al = self.al;
        let k = self.size;
        let pool = self.suffix[start];
        let m = self.cands.len() - start;
        let pairs = (k * (k - 1) / 2) as u64;
        let bandwidth = if pairs == 0 {
            1.0
        } else {
            // Each newcomer brings its bandwidth to the group so far, and half of its pairs
            // with the other newcomers: at most half its r-1 best links within the pool.
            let mut twice = [0u64; MAX_GPUS];
            for (slot, &c) in twice.iter_mut().zip(&self.cands[start..]) {
                let (among, _) = sum_best(&al.tiers[c], pool & !(1 << c), r - 1);
                *slot = 2 * node.gain[c] + among;
            }
            let most = 2 * node.pair_mbps + sum_extreme(&mut twice[..m], r, true);
            (most as f64 / (2 * pairs) as f64 / al.best_bw as f64).min(1.0)
        };
        let structure = self.structure_bound(node, pool, r);
        let balance = if node.mask == 0 {
            1.0
        } else {
            1.0 - (node.max_free - node.min_free)
        };
        let denom = (k as u32).min(al.domains).max(1);
        let domain = (node.domains.count_ones() + r as u32).min(denom) as f64 / denom as f64;
        self.w[0] * bandwidth + self.w[1] * structure + self.w[2] * balance + self.w[3] * domain
    }

    /// The best structure any completion by `r` GPUs of `pool` can have.
    fn structure_bound(&self, node: &Node, pool: u32, r: usize) -> f64 {
        let al = self.al;
        let k = self.size;
        if k == 1 || node.mask == 0 {
            return 1.0;
        }
        if node.clique && (node.common & pool).count_ones() as usize >= r {
            return 1.0;
        }
        // Connected needs the group inside one NVLink component of group + pool of >= k GPUs.
        let reach = pool | node.mask;
        let mut seen = 1u32 << node.mask.trailing_zeros();
        loop {
            let next = bits(seen).fold(seen, |s, v| s | (al.adj[v] & reach));
            if next == seen {
                break;
            }
            seen = next;
        }
        if seen & node.mask != node.mask || (seen.count_ones() as usize) < k {
            return Structure::Disconnected.value();
        }
        // A ring needs every member to have two neighbours.
        let ring = k >= 4 && bits(node.mask).all(|v| (al.adj[v] & reach).count_ones() >= 2);
        if ring {
            Structure::Ring.value()
        } else {
            Structure::Tree.value()
        }
    }

    /// Whether no completion of `node` can beat the best group found so far. Groups found later
    /// in this depth-first order are lexicographically larger, so a completion that at best ties
    /// on score, look-ahead and locality loses too.
    fn hopeless(&self, node: &Node, start: usize, r: usize) -> bool {
        let bound = self.score_bound(node, start, r);
        if bound < self.floor - EPS {
            return true;
        }
        let Some(best) = self.best else {
            return false;
        };
        if bound < best.score - EPS {
            return true;
        }
        if bound > best.score + EPS {
            return false;
        }
        // At best a tie on the score: compare the look-ahead, then locality.
        let pool = self.suffix[start];
        let m = self.cands.len() - start;
        let worth_bound = if self.worth_bound <= best.worth {
            self.worth_bound
        } else {
            let mut worth = [0u64; MAX_GPUS];
            let total = self
                .al
                .lookahead(self.avail & !node.mask, self.partners, &mut worth);
            let mut cw = [0u64; MAX_GPUS];
            for (slot, &c) in cw.iter_mut().zip(&self.cands[start..]) {
                *slot = worth[c];
            }
            total.saturating_sub(sum_extreme(&mut cw[..m], r, false))
        };
        if worth_bound < best.worth {
            return true;
        }
        if worth_bound > best.worth {
            return false;
        }
        // Each newcomer adds its distance to the group so far and half its distances to the
        // other newcomers: at least half its r-1 nearest within the pool.
        let mut twice = [0u64; MAX_GPUS];
        for (slot, &c) in twice.iter_mut().zip(&self.cands[start..]) {
            let (among, _) = sum_best(&self.al.rank_tiers[c], pool & !(1 << c), r - 1);
            *slot = 2 * node.near[c] as u64 + among;
        }
        let least = 2 * node.locality as u64 + sum_extreme(&mut twice[..m], r, false);
        least >= 2 * best.locality as u64
    }

    fn dfs(&mut self, node: &Node, start: usize, r: usize) {
        if r == 0 {
            self.leaf(node);
            return;
        }
        if self.cands.len() - start < r || self.hopeless(node, start, r) {
            return;
        }
        for i in start..=self.cands.len() - r {
            let child = self.add(node, self.cands[i]);
            self.dfs(&child, i + 1, r - 1);
        }
    }

    fn leaf(&mut self, node: &Node) {
        let score = self.score_of(node);
        if let Some(best) = self.best {
            if score < best.score - EPS {
                return;
            }
        }
        let mut scratch = [0u64; MAX_GPUS];
        let worth = self
            .al
            .lookahead(self.avail & !node.mask, self.partners, &mut scratch);
        let better = match self.best {
            None => true,
            Some(best) => {
                score > best.score + EPS
                    || worth > best.worth
                    || (worth == best.worth && node.locality < best.locality)
            }
        };
        if better {
            self.best = Some(Best {
                score,
                worth,
                locality: node.locality,
                mask: node.mask,
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::topology::model::{Gpu, Link};

    /// A graph as a topology: NVLink (1 link) on `edges`, PCIe SYS elsewhere.
    fn graph(n: usize, edges: &[(usize, usize)]) -> Allocator {
        let links = (0..n)
            .map(|a| {
                (0..n)
                    .map(|b| {
                        if edges.contains(&(a, b)) || edges.contains(&(b, a)) {
                            Link::nvlink(1, Some(2), false)
                        } else {
                            Link::pcie(PcieLevel::System)
                        }
                    })
                    .collect()
            })
            .collect();
        let t = Topology::new((0..n).map(Gpu::new).collect(), links, 16.0).unwrap();
        Allocator::new(t).unwrap()
    }

    /// Hamiltonian cycle by trying every order (independent of the table's DP).
    fn has_cycle(group: &[usize], adj: &[u32]) -> bool {
        fn perms(rest: &mut Vec<usize>, path: &mut Vec<usize>, adj: &[u32]) -> bool {
            if rest.is_empty() {
                let (first, last) = (path[0], path[path.len() - 1]);
                return adj[last] & (1 << first) != 0;
            }
            for i in 0..rest.len() {
                let v = rest.remove(i);
                let ok = adj[path[path.len() - 1]] & (1 << v) != 0 && {
                    path.push(v);
                    let r = perms(rest, path, adj);
                    path.pop();
                    r
                };
                rest.insert(i, v);
                if ok {
                    return true;
                }
            }
            false
        }
        let mut rest = group[1..].to_vec();
        perms(&mut rest, &mut vec![group[0]], adj)
    }

    #[test]
    fn structure_table_matches_brute_force() {
        // A 4-cycle with a tail and a chord-free square: rings, trees and cliques mixed.
        let edges = [
            (0, 1),
            (1, 2),
            (2, 3),
            (3, 0),
            (3, 4),
            (4, 5),
            (5, 6),
            (6, 4),
            (0, 2),
        ];
        let al = graph(7, &edges);
        for mask in 1u32..(1 << 7) {
            let group: Vec<usize> = bits(mask).collect();
            let k = group.len();
            let pairs_linked = group
                .iter()
                .enumerate()
                .all(|(i, &a)| group[i + 1..].iter().all(|&b| al.adj[a] & (1 << b) != 0));
            let want = if pairs_linked {
                Structure::FullyConnected
            } else if !connected(mask, &al.adj) {
                Structure::Disconnected
            } else if k >= 4 && has_cycle(&group, &al.adj) {
                Structure::Ring
            } else {
                Structure::Tree
            };
            assert_eq!(al.structure(&group).unwrap(), want, "{group:?}");
        }
        assert_eq!(al.structure(&[0, 1, 2, 3]).unwrap(), Structure::Ring);
        assert_eq!(al.structure(&[0, 1, 2]).unwrap(), Structure::FullyConnected);
        assert_eq!(al.structure(&[1, 2, 3, 4]).unwrap(), Structure::Tree);
        assert_eq!(al.structure(&[0, 5]).unwrap(), Structure::Disconnected);
    }

    #[test]
    fn errors_are_clear() {
        let al = graph(4, &[(0, 1)]);
        let w = Weights::weighted();
        let e = |r: Result<Vec<usize>, AllocError>| r.unwrap_err();
        assert_eq!(e(al.preferred(&[0, 1], &[], 0, &w)), AllocError::ZeroSize);
        assert_eq!(
            e(al.preferred(&[0, 1], &[], 3, &w)),
            AllocError::NotEnoughAvailable {
                size: 3,
                available: 2
            }
        );
        assert_eq!(
            e(al.preferred(&[0, 1], &[2], 1, &w)),
            AllocError::MustIncludeUnavailable { gpu: 2 }
        );
        assert_eq!(
            e(al.preferred(&[0, 1, 2], &[0, 1], 1, &w)),
            AllocError::MustIncludeTooMany {
                must_include: 2,
                size: 1
            }
        );
        assert_eq!(
            e(al.preferred(&[0, 7], &[], 1, &w)),
            AllocError::UnknownGpu { gpu: 7, gpus: 4 }
        );
        assert_eq!(
            e(al.preferred(&[0, 0, 1], &[], 1, &w)),
            AllocError::Duplicate {
                gpu: 0,
                list: "available"
            }
        );
        let bad = Weights { domain: -0.1, ..w };
        assert!(matches!(
            e(al.preferred(&[0, 1], &[], 1, &bad)),
            AllocError::Weights(_)
        ));
        assert_eq!(al.score(&[], &w).unwrap_err(), AllocError::EmptyGroup);
        for err in [
            AllocError::NotEnoughAvailable {
                size: 3,
                available: 2,
            },
            AllocError::MustIncludeUnavailable { gpu: 2 },
        ] {
            assert!(err.to_string().contains('2'), "{err}");
        }
        // Must-include filling the request, or everything requested: answered as given.
        assert_eq!(al.preferred(&[0, 1, 2], &[2, 0], 2, &w).unwrap(), [0, 2]);
        assert_eq!(al.preferred(&[3, 1], &[], 2, &w).unwrap(), [1, 3]);
    }

    /// A deterministic pseudo-random generator (no dependency for tests).
    struct Lcg(u64);
    impl Lcg {
        fn next(&mut self, below: u64) -> u64 {
            self.0 = self
                .0
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (self.0 >> 33) % below
        }
    }

    fn random_topology(rng: &mut Lcg, n: usize, nvlink_percent: u64, uniform: bool) -> Topology {
        let mut flat = vec![Topology::SELF_LINK; n * n];
        for a in 0..n {
            for b in a + 1..n {
                let level = if uniform {
                    if a / 2 == b / 2 {
                        PcieLevel::Single
                    } else if a < n / 2 && b < n / 2 || a >= n / 2 && b >= n / 2 {
                        PcieLevel::Node
                    } else {
                        PcieLevel::System
                    }
                } else {
                    PcieLevel::ALL[1 + rng.next(5) as usize]
                };
                let l = if uniform {
                    Link {
                        pcie: Some(level),
                        ..Link::nvlink(12, Some(3), true)
                    }
                } else if rng.next(100) < nvlink_percent {
                    Link {
                        pcie: Some(level),
                        ..Link::nvlink(1 + rng.next(3) as u32, Some(2), false)
                    }
                } else {
                    Link::pcie(level)
                };
                flat[a * n + b] = l;
                flat[b * n + a] = l;
            }
        }
        let links = flat.chunks(n).map(<[Link]>::to_vec).collect();
        let gpus = (0..n)
            .map(|i| Gpu {
                numa_node: Some((2 * i / n) as u32),
                memory: Some(Memory {
                    total: 16,
                    free: if uniform { 16 } else { 8 + rng.next(3) * 4 },
                }),
                fault_domain: if uniform { i } else { rng.next(4) as usize },
                ..Gpu::new(i)
            })
            .collect();
        Topology::new(gpus, links, 16.0).unwrap()
    }

    /// The full order of `preferred` (score, look-ahead, locality, lowest indices), by brute
    /// force over every group.
    fn reference(al: &Allocator, avail: u32, must: u32, k: usize, w: &Weights) -> Vec<usize> {
        let partners = k.max(2) - 1;
        let mut all: Vec<(f64, u64, u32, Vec<usize>)> = Vec::new();
        for mask in 0u32..(1 << al.n) {
            if mask & !avail != 0 || mask & must != must || mask.count_ones() as usize != k {
                continue;
            }
            let group: Vec<usize> = bits(mask).collect();
            let score = al.score(&group, w).unwrap().total;
            let mut scratch = [0u64; MAX_GPUS];
            let worth = al.lookahead(avail & !mask, partners, &mut scratch);
            let mut locality = 0;
            for (i, &a) in group.iter().enumerate() {
                for &b in &group[i + 1..] {
                    locality += al.rank[a * al.n + b];
                }
            }
            all.push((score, worth, locality, group));
        }
        let top = all.iter().map(|x| x.0).fold(f64::NEG_INFINITY, f64::max);
        all.retain(|x| x.0 >= top - EPS);
        let most = all.iter().map(|x| x.1).max().unwrap_or(0);
        all.retain(|x| x.1 == most);
        let least = all.iter().map(|x| x.2).min().unwrap_or(0);
        all.retain(|x| x.2 == least);
        all.into_iter().map(|x| x.3).min().unwrap_or_default()
    }

    #[test]
    fn search_agrees_with_brute_force_on_every_key() {
        let mut rng = Lcg(7);
        let w = Weights::weighted();
        let mut queries = 0;
        for (n, percent, uniform, rounds) in [
            (8, 40, false, 60),
            (8, 0, false, 20),
            (12, 30, false, 12),
            (12, 100, false, 8),
            (16, 25, false, 4),
            (16, 0, true, 4),
        ] {
            for _ in 0..rounds {
                let al = Allocator::new(random_topology(&mut rng, n, percent, uniform)).unwrap();
                let full = (1u32 << n) - 1;
                let avail = if rng.next(3) == 0 {
                    full
                } else {
                    full & !(rng.next(1 << n) as u32 & rng.next(1 << n) as u32)
                };
                let free: Vec<usize> = bits(avail).collect();
                if free.is_empty() {
                    continue;
                }
                let k = 1 + rng.next(free.len().min(9) as u64) as usize;
                let must = if rng.next(2) == 0 {
                    0
                } else {
                    1 << free[rng.next(free.len() as u64) as usize]
                };
                let must_list: Vec<usize> = bits(must).collect();
                let got = al.preferred(&free, &must_list, k, &w).unwrap();
                let want = reference(&al, avail, must, k, &w);
                assert_eq!(got, want, "n {n} free {free:?} must {must_list:?} size {k}");
                queries += 1;
            }
        }
        assert!(queries > 90);
    }

    /// The all-reduce policy's pick has the least cost of all groups, the cost computed here
    /// from `ring::allreduce` directly (no cache) and B_s by brute force.
    #[test]
    fn allreduce_pick_has_the_least_objective_by_brute_force() {
        use crate::topology::objective::{lookahead_sizes, time_of};
        use cuvisor_fabric::ring;
        let mut rng = Lcg(11);
        let w = Weights::default();
        let mut queries = 0;
        for (n, percent) in [(6, 40), (7, 60), (7, 0), (8, 50)] {
            for _ in 0..3 {
                let t = random_topology(&mut rng, n, percent, false);
                let f = crate::topology::fabric::fabric(&t);
                let al = Allocator::new(t).unwrap();
                let time = |m: u32| time_of(&ring::allreduce(&f, &bits(m).collect::<Vec<_>>()));
                let best = |s: usize, r: u32| {
                    (0..1u32 << n)
                        .filter(|&h| h & !r == 0 && h.count_ones() as usize == s)
                        .map(time)
                        .min()
                };
                let full = (1u32 << n) - 1;
                let avail = full & !(rng.next(1 << n) as u32 & rng.next(1 << n) as u32);
                let free: Vec<usize> = bits(avail).collect();
                for k in 1..free.len() {
                    let cost = |g: u32| {
                        let rest = avail & !g;
                        let sizes = lookahead_sizes(k, &[], rest.count_ones() as usize);
                        sizes
                            .iter()
                            .fold(time(g), |acc, &s| acc + best(s, rest).unwrap_or(0))
                    };
                    let least = (0..1u32 << n)
                        .filter(|&g| g & !avail == 0 && g.count_ones() as usize == k)
                        .map(cost)
                        .min()
                        .unwrap();
                    let pick = al.preferred(&free, &[], k, &w).unwrap();
                    let pm = pick.iter().fold(0u32, |m, &g| m | 1 << g);
                    assert_eq!(cost(pm), least, "n {n} free {free:?} size {k}: {pick:?}");
                    queries += 1;
                }
            }
        }
        assert!(queries > 40, "{queries}");
    }

    #[test]
    fn too_many_gpus() {
        let n = MAX_GPUS + 1;
        let links = vec![vec![Link::pcie(PcieLevel::System); n]; n];
        let t = Topology::new((0..n).map(Gpu::new).collect(), links, 16.0).unwrap();
        assert_eq!(
            Allocator::new(t).unwrap_err(),
            AllocError::TooManyGpus { gpus: n }
        );
    }
}
