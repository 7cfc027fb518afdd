//! NVIDIA's go-gpuallocator (the library NVIDIA's device plugin answers GetPreferredAllocation
//! with) as the reference for cuvisor's picker.
//!
//! Data, transcribed from github.com/NVIDIA/go-gpuallocator at commit
//! 876e7b7609bb839919e4eb06ce00607db76e907e (fixtures/go-gpuallocator/*, each file says where
//! from): the DGX-1 Volta and Pascal and 4x RTX 8000 link tables of gpuallocator/common_test.go,
//! the best-effort policy cases of TestBestEffortAllocate and the allocation sequences of
//! TestBestEffort*GPUAlloc* (gpuallocator/besteffort_test.go).
//!
//! Its objective, re-implemented here from its description (gpuallocator/besteffort_policy.go):
//! a pair of GPUs scores 100 per NVLink plus 10 (across CPUs), 20 (same CPU), 30 (host bridge),
//! 40 (several switches), 50 (one switch) or 60 (same board) for its PCIe path; a set scores the
//! sum over its pairs; the policy divides ALL available GPUs into sets of the request's size
//! (plus one set of the remainder) maximising the summed set scores, and hands out the best set
//! of that partition. So a pick G is as good, by its own objective, as
//! `go_value(G) = score(G) + best partition score of the other available GPUs`, and its own
//! pick has the maximum.

use cuvisor_device_plugin::topology::{Allocator, Gpu, Link, PcieLevel, Policy, Topology, Weights};
use std::collections::HashMap;
use std::path::PathBuf;

fn data(name: &str) -> String {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/go-gpuallocator")
        .join(name);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

fn lines(text: &str) -> impl Iterator<Item = &str> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
}

fn indices(s: &str) -> Vec<usize> {
    s.split([' ', ','])
        .filter(|x| !x.is_empty() && *x != "-")
        .map(|x| x.parse().unwrap())
        .collect()
}

/// One go-gpuallocator test node: its pair scores, and the same machine as a cuvisor topology.
struct Node {
    n: usize,
    /// go-gpuallocator's pair score (calculateGPUPairScore), n x n.
    pair: Vec<u32>,
    nvlinks: Vec<u32>,
    al: Allocator,
}

const NVLINK: [&str; 18] = [
    "SingleNVLINKLink",
    "TwoNVLINKLinks",
    "ThreeNVLINKLinks",
    "FourNVLINKLinks",
    "FiveNVLINKLinks",
    "SixNVLINKLinks",
    "SevenNVLINKLinks",
    "EightNVLINKLinks",
    "NineNVLINKLinks",
    "TenNVLINKLinks",
    "ElevenNVLINKLinks",
    "TwelveNVLINKLinks",
    "ThirteenNVLINKLinks",
    "FourteenNVLINKLinks",
    "FifteenNVLINKLinks",
    "SixteenNVLINKLinks",
    "SeventeenNVLINKLinks",
    "EighteenNVLINKLinks",
];

/// A P2P link type: its go-gpuallocator score and the `nvidia-smi topo -m` level it is
/// (internal/links/device.go maps NVML's topology levels onto these names).
fn pcie_type(t: &str) -> Option<(u32, PcieLevel)> {
    Some(match t {
        "P2PLinkCrossCPU" => (10, PcieLevel::System),
        "P2PLinkSameCPU" => (20, PcieLevel::Node),
        "P2PLinkHostBridge" => (30, PcieLevel::HostBridge),
        "P2PLinkMultiSwitch" => (40, PcieLevel::Multiple),
        "P2PLinkSingleSwitch" => (50, PcieLevel::Single),
        "P2PLinkSameBoard" => (60, PcieLevel::Internal),
        _ => return None,
    })
}

fn node(file: &str, nvlink_generation: u32) -> Node {
    let text = data(file);
    let rows: Vec<(usize, usize, String)> = lines(&text)
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (
                f[0].parse().unwrap(),
                f[1].parse().unwrap(),
                f[2].to_string(),
            )
        })
        .collect();
    let n = 1 + rows.iter().map(|r| r.0.max(r.1)).max().unwrap();
    let mut pair = vec![0u32; n * n];
    let mut nvlinks = vec![0u32; n * n];
    let mut level: Vec<Option<PcieLevel>> = vec![None; n * n];
    for (a, b, t) in &rows {
        let i = a * n + b;
        if let Some(k) = NVLINK.iter().position(|x| x == t) {
            pair[i] += 100 * (k as u32 + 1);
            nvlinks[i] += k as u32 + 1;
        } else {
            let (score, l) = pcie_type(t).unwrap_or_else(|| panic!("link type {t}"));
            pair[i] += score;
            level[i] = Some(l);
        }
    }
    let links = (0..n)
        .map(|a| {
            (0..n)
                .map(|b| {
                    if a == b {
                        return Topology::SELF_LINK;
                    }
                    let mut l = match nvlinks[a * n + b] {
                        0 => Link {
                            nvlink: None,
                            pcie: None,
                        },
                        k => Link::nvlink(k, Some(nvlink_generation), false),
                    };
                    l.pcie = level[a * n + b];
                    l
                })
                .collect()
        })
        .collect();
    let t = Topology::new((0..n).map(Gpu::new).collect(), links, 15.75).unwrap();
    Node {
        n,
        pair,
        nvlinks,
        al: Allocator::new(t).unwrap(),
    }
}

fn volta() -> Node {
    node("dgx1-volta.links", 2)
}

fn pascal() -> Node {
    node("dgx1-pascal.links", 1)
}

fn bits(mut m: u32) -> Vec<usize> {
    let mut v = Vec::new();
    while m != 0 {
        v.push(m.trailing_zeros() as usize);
        m &= m - 1;
    }
    v
}

fn mask(v: &[usize]) -> u32 {
    v.iter().fold(0, |m, &g| m | 1 << g)
}

/// go-gpuallocator's objective over one node, memoised.
struct Go<'a> {
    node: &'a Node,
    memo: HashMap<(u32, usize, bool), u32>,
}

impl<'a> Go<'a> {
    fn new(node: &'a Node) -> Go<'a> {
        Go {
            node,
            memo: HashMap::new(),
        }
    }

    /// calculateGPUSetScore.
    fn set_score(&self, m: u32) -> u32 {
        let g = bits(m);
        let n = self.node.n;
        let mut s = 0;
        for (i, &a) in g.iter().enumerate() {
            for &b in &g[i + 1..] {
                s += self.node.pair[a * n + b];
            }
        }
        s
    }

    /// The best partition score of `m` into sets of `k` and one set of the remainder
    /// (|m| mod k GPUs, the set go-gpuallocator pads), `rem`: that set is still to be made.
    fn partition(&mut self, m: u32, k: usize, rem: bool) -> u32 {
        if m == 0 {
            return 0;
        }
        if let Some(&v) = self.memo.get(&(m, k, rem)) {
            return v;
        }
        let low = m & m.wrapping_neg();
        let others = bits(m & !low);
        let r = m.count_ones() as usize % k;
        let mut best = 0;
        // The lowest GPU is in a full set of k, or in the remainder set.
        let mut sizes = vec![k];
        if rem && r > 0 {
            sizes.push(r);
        }
        for s in sizes {
            if s - 1 > others.len() {
                continue;
            }
            for combo in combinations(&others, s - 1) {
                let set = low | mask(&combo);
                let rest = m & !set;
                let rem_left = rem && s == k;
                if !rem_left && !(rest.count_ones() as usize).is_multiple_of(k) {
                    continue;
                }
                let v = self.set_score(set) + self.partition(rest, k, rem_left);
                best = best.max(v);
            }
        }
        self.memo.insert((m, k, rem), best);
        best
    }

    /// How good picking `g` from `avail` is by go-gpuallocator's objective.
    fn value(&mut self, avail: u32, g: u32) -> u32 {
        let k = g.count_ones() as usize;
        let rest = avail & !g;
        self.set_score(g) + self.partition(rest, k, true)
    }
}

fn combinations(items: &[usize], r: usize) -> Vec<Vec<usize>> {
    if r == 0 {
        return vec![Vec::new()];
    }
    let mut out = Vec::new();
    for i in 0..items.len() {
        for mut rest in combinations(&items[i + 1..], r - 1) {
            rest.insert(0, items[i]);
            out.push(rest);
        }
    }
    out
}

/// Whether the GPUs of `m` include two joined by NVLink.
fn has_nvlink_pair(node: &Node, m: u32) -> bool {
    let g = bits(m);
    g.iter()
        .enumerate()
        .any(|(i, &a)| g[i + 1..].iter().any(|&b| node.nvlinks[a * node.n + b] > 0))
}

struct Sweep {
    queries: usize,
    lower: usize,
    stranded: Vec<String>,
    differences: Vec<String>,
    /// Of the lower picks, those whose own all-reduce is slower than go-gpuallocator's answer's
    /// (traded for the look-ahead); the others are faster or as fast for the job asking.
    traded: usize,
}

/// Every (available set, size) query with more than one possible answer (size < available).
fn sweep(node: &Node, w: &Weights) -> Sweep {
    let mut go = Go::new(node);
    let n = node.n;
    let mut out = Sweep {
        queries: 0,
        lower: 0,
        stranded: Vec::new(),
        differences: Vec::new(),
        traded: 0,
    };
    for avail in 1u32..(1 << n) {
        let free = bits(avail);
        for size in 1..free.len() {
            out.queries += 1;
            let pick = node.al.preferred(&free, &[], size, w).unwrap();
            let pm = mask(&pick);
            let groups: Vec<u32> = combinations(&free, size).iter().map(|g| mask(g)).collect();
            let values: Vec<u32> = groups.iter().map(|&g| go.value(avail, g)).collect();
            let best = *values.iter().max().unwrap();
            let ours = go.value(avail, pm);
            let go_best: Vec<u32> = groups
                .iter()
                .zip(&values)
                .filter(|(_, &v)| v == best)
                .map(|(&g, _)| g)
                .collect();
            // A stranded pair: fewer of (the pick, the rest) keep an NVLink pair than with an
            // answer go-gpuallocator rates best (policy test 01: {0, 4} leaves {2, 5} apart,
            // {4, 5} leaves {0, 2} joined).
            let kept =
                |g: u32| has_nvlink_pair(node, g) as u32 + has_nvlink_pair(node, avail & !g) as u32;
            if go_best.iter().any(|&g| kept(g) > kept(pm)) {
                out.stranded.push(format!(
                    "free {free:?} size {size}: {pick:?} strands the rest"
                ));
            }
            if ours < best {
                out.lower += 1;
                if w.policy == Policy::AllReduce {
                    // Explained by the written objective: ours costs less than (or as much as)
                    // go-gpuallocator's answer under it.
                    let theirs = bits(go_best[0]);
                    let (c_ours, sizes) = node.al.objective_cost(&free, &pick, &[]).unwrap();
                    let (c_theirs, _) = node.al.objective_cost(&free, &theirs, &[]).unwrap();
                    let t = |g: &[usize]| node.al.allreduce(g).time_ns(256 << 20) / 1000;
                    if t(&pick) > t(&theirs) {
                        out.traded += 1;
                    }
                    out.differences.push(format!(
                        "free {free:?} size {size}: cuvisor {pick:?} (go value {ours}, all-reduce \
                         {} us, objective {} us) vs go-gpuallocator {theirs:?} (go value {best}, \
                         all-reduce {} us, objective {} us); look-ahead sizes {sizes:?}",
                        t(&pick),
                        c_ours / 1000,
                        t(&theirs),
                        c_theirs / 1000,
                    ));
                    assert!(
                        c_ours <= c_theirs,
                        "free {free:?} size {size}: {pick:?} is lower by go-gpuallocator's \
                         objective and not better by cuvisor's ({c_ours} > {c_theirs})"
                    );
                }
            }
        }
    }
    out
}

fn report(name: &str, s: &Sweep) {
    println!(
        "{name}: {} of {} picks lower by go-gpuallocator's partition objective ({:.1} %; {} of \
         them slower for the job, traded for the look-ahead (counted under allreduce)), {} \
         stranded pairs",
        s.lower,
        s.queries,
        100.0 * s.lower as f64 / s.queries as f64,
        s.traded,
        s.stranded.len()
    );
    for d in &s.differences {
        println!("  {d}");
    }
    for d in &s.stranded {
        println!("  stranded: {d}");
    }
}

#[test]
fn go_gpuallocator_besteffort_cases_through_preferred() {
    let node = volta();
    let w = Weights::default();
    let text = data("besteffort-cases.txt");
    let mut go = Go::new(&node);
    let mut cases = 0;
    for l in lines(&text) {
        let f: Vec<&str> = l.split('|').map(str::trim).collect();
        let (what, avail, must, size, want) = (
            f[0],
            indices(f[1]),
            indices(f[2]),
            f[3].parse::<usize>().unwrap(),
            indices(f[4]),
        );
        cases += 1;
        let got = node.al.preferred(&avail, &must, size, &w);
        match got {
            Err(e) => {
                // go-gpuallocator answers no GPUs; cuvisor refuses with the reason.
                assert!(
                    want.is_empty(),
                    "{what}: cuvisor refuses ({e}), go answers {want:?}"
                );
                println!("{what}: both refuse ({e})");
            }
            Ok(mut got) => {
                got.sort_unstable();
                let mut want = want.clone();
                want.sort_unstable();
                assert!(
                    !want.is_empty(),
                    "{what}: go refuses, cuvisor answers {got:?}"
                );
                if got == want {
                    println!("{what}: {got:?}, as go-gpuallocator");
                    continue;
                }
                // A different answer must be as good by go-gpuallocator's own objective (a tie
                // it breaks otherwise) and no worse by cuvisor's.
                let am = mask(&avail);
                let (vg, vw) = (go.value(am, mask(&got)), go.value(am, mask(&want)));
                let (cg, _) = node.al.objective_cost(&avail, &got, &[]).unwrap();
                let (cw, _) = node.al.objective_cost(&avail, &want, &[]).unwrap();
                println!(
                    "{what}: cuvisor {got:?} vs go-gpuallocator {want:?}: go value {vg} vs {vw}, \
                     objective {cg} vs {cw} ns"
                );
                assert!(vg >= vw && cg <= cw, "{what}: {got:?} instead of {want:?}");
            }
        }
    }
    assert_eq!(cases, 11);
}

#[test]
fn go_gpuallocator_policy_test_01_keeps_a_connected_pair() {
    // V100, {0, 2, 4, 5} free, 2 GPUs: {0, 4} (2 NVLinks) would strand {2, 5} across sockets.
    let node = volta();
    let pick = node
        .al
        .preferred(&[0, 2, 4, 5], &[], 2, &Weights::default())
        .unwrap();
    assert!(pick == [0, 2] || pick == [4, 5], "{pick:?}");
    assert_eq!(
        pick,
        [4, 5],
        "one PCIe switch breaks the tie, as go-gpuallocator"
    );
}

#[test]
fn go_gpuallocator_sequences_through_preferred() {
    let text = data("besteffort-sequences.txt");
    for l in lines(&text) {
        let (name, reqs) = l.split_once('|').unwrap();
        let node = match name.trim() {
            "DGX1Volta" => volta(),
            "DGX1Pascal" => pascal(),
            "4xRTX8000" => node("4xrtx8000.links", 2),
            other => panic!("node {other}"),
        };
        let mut go = Go::new(&node);
        let mut free: Vec<usize> = (0..node.n).collect();
        for r in reqs.split_whitespace() {
            let (size, want) = r.split_once(':').unwrap();
            let (size, want): (usize, Vec<usize>) = (size.parse().unwrap(), indices(want));
            if want.is_empty() {
                assert!(free.len() < size, "{name}: {free:?} left");
                continue;
            }
            let got = node
                .al
                .preferred(&free, &[], size, &Weights::default())
                .unwrap();
            let am = mask(&free);
            // Once an earlier pick differs, go-gpuallocator's answer may be taken: compare with
            // the best answer by its objective among the GPUs still free.
            let (top, top_value) = combinations(&free, size)
                .into_iter()
                .map(|g| {
                    let v = go.value(am, mask(&g));
                    (g, v)
                })
                .max_by_key(|x| x.1)
                .unwrap();
            let vg = go.value(am, mask(&got));
            println!(
                "{name}: free {free:?} size {size}: cuvisor {got:?} (go value {vg}), \
                 go-gpuallocator {want:?}, best by its objective {top:?} ({top_value})"
            );
            if vg < top_value {
                // Lower by go-gpuallocator's objective: then better by cuvisor's.
                let (c_got, _) = node.al.objective_cost(&free, &got, &[]).unwrap();
                let (c_top, _) = node.al.objective_cost(&free, &top, &[]).unwrap();
                assert!(
                    c_got < c_top,
                    "{name}: free {free:?}: {got:?} worse than {top:?}"
                );
            }
            free.retain(|g| !got.contains(g));
        }
    }
}

#[test]
fn go_gpuallocator_sweep_dgx1_volta_and_pascal() {
    let mut results = Vec::new();
    for (name, node) in [("DGX-1 Volta", volta()), ("DGX-1 Pascal", pascal())] {
        let before = sweep(&node, &Weights::weighted());
        report(
            &format!("{name}, policy weighted (the seeds' score)"),
            &before,
        );
        let after = sweep(&node, &Weights::default());
        report(&format!("{name}, policy allreduce (default)"), &after);
        results.push((name, after));
    }
    for (name, after) in &results {
        // Never a stranded pair where go-gpuallocator keeps one (it strands 24 on Volta and 12
        // on Pascal under the weighted policy). Every lower pick was checked in `sweep` to cost
        // less by cuvisor's objective, and is printed with its reason: go-gpuallocator's answer
        // has a slower all-reduce for the job asking (its group needs a PCIe edge in its rings:
        // link counts do not see that), or it leaves a slower pair for the next request.
        assert!(after.stranded.is_empty(), "{name}: {:?}", after.stranded);
        assert!(after.lower > 0 && after.differences.len() == after.lower);
    }
}
