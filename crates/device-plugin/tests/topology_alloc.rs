//! The allocator on the simulator presets and on fixtures: the DGX-1 request sequences, the
//! NVSwitch and PCIe boxes, and the exhaustive cross-check against a naive brute force.
//!
//! The tests up to the cross-check are those of the seeds' weighted score, which stays available
//! as `policy = "weighted"`; they run under it (`Weights::weighted()`), as they encode its
//! order (score, look-ahead for the same size, locality). The default policy, the modelled
//! all-reduce time with the look-ahead over sizes, has its own tests at the end of this file
//! (and in gpuallocator.rs, against NVIDIA's allocator).

mod support;

use cuvisor_device_plugin::topology::{
    parse_topo_matrix, Allocator, Memory, Policy, Structure, Topology, Weights,
};
use cuvisor_sim::model::{self, DGX1_LINKS, GIB};

fn preset(name: &str) -> Allocator {
    Allocator::new(support::from_model(&model::preset(name).unwrap())).unwrap()
}

fn fixture(name: &str) -> Allocator {
    Allocator::new(parse_topo_matrix(&support::fixture(name)).unwrap()).unwrap()
}

fn dgx1_links(a: usize, b: usize) -> u32 {
    DGX1_LINKS
        .iter()
        .find(|&&(x, y, _)| (x, y) == (a.min(b), a.max(b)))
        .map_or(0, |l| l.2)
}

/// Requests of `sizes`, one after another, nothing freed in between.
fn sequence(al: &Allocator, sizes: &[usize], w: &Weights) -> Vec<Vec<usize>> {
    let mut free: Vec<usize> = (0..al.topology().len()).collect();
    sizes
        .iter()
        .map(|&k| {
            let pick = al.preferred(&free, &[], k, w).unwrap();
            assert_eq!(pick.len(), k);
            free.retain(|g| !pick.contains(g));
            pick
        })
        .collect()
}

// ---- DGX-1 (V100 hybrid cube-mesh) ---------------------------------------------------------

#[test]
fn dgx1_four_pairs_each_get_two_nvlinks() {
    let w = Weights::weighted();
    for al in [preset("dgx1-v100"), fixture("dgx1-v100-nics.txt")] {
        let picks = sequence(&al, &[2, 2, 2, 2], &w);
        for p in &picks {
            assert_eq!(
                dgx1_links(p[0], p[1]),
                2,
                "{picks:?}: {p:?} is not a 2-NVLink pair"
            );
        }
        let mut all: Vec<usize> = picks.concat();
        all.sort_unstable();
        assert_eq!(all, (0..8).collect::<Vec<_>>());
    }
}

#[test]
fn dgx1_two_quads() {
    let w = Weights::weighted();
    for al in [preset("dgx1-v100"), fixture("dgx1-v100-nics.txt")] {
        assert_eq!(sequence(&al, &[4, 4], &w), [[0, 1, 2, 3], [4, 5, 6, 7]]);
        let s = al.score(&[0, 1, 2, 3], &w).unwrap();
        assert_eq!(s.structure, Structure::FullyConnected);
        assert_eq!(s.bandwidth, 0.75, "mean 1.5 links of a best pair's 2");
        assert!((s.total - 0.875).abs() < 1e-12, "{s:?}");
    }
}

#[test]
fn dgx1_mixed_sequences_never_strand_a_pair() {
    let w = Weights::weighted();
    let al = preset("dgx1-v100");
    // A quad first leaves the other quad, in which the pairs follow the 2-link edges.
    let picks = sequence(&al, &[4, 2, 2], &w);
    assert_eq!(picks[0], [0, 1, 2, 3]);
    for p in &picks[1..] {
        assert_eq!(dgx1_links(p[0], p[1]), 2, "{picks:?}");
    }
    // Singles keep the cube-mesh pairable: after any run of singles, pairs still get 2 links.
    let picks = sequence(&al, &[1, 1, 2, 2, 2], &w);
    for p in &picks[2..] {
        assert_eq!(dgx1_links(p[0], p[1]), 2, "{picks:?}");
    }
    // A single request looks ahead to pairs: from {0, 3, 4} it takes 3 (or 4), never 0, the
    // GPU both others need for a 2-NVLink pair.
    assert_eq!(al.preferred(&[0, 3, 4], &[], 1, &w).unwrap(), [3]);
    // Must-include is honoured and still gets its best partner.
    assert_eq!(
        al.preferred(&(0..8).collect::<Vec<_>>(), &[5], 2, &w)
            .unwrap(),
        [5, 6]
    );
    assert_eq!(
        al.preferred(&(0..8).collect::<Vec<_>>(), &[0, 7], 4, &w)
            .unwrap(),
        [0, 3, 4, 7],
        "the ring 0-3-7-4 through both must-include GPUs"
    );
    assert_eq!(al.structure(&[0, 3, 7, 4]).unwrap(), Structure::Ring);
}

// ---- dgx-a100 (NVSwitch) -----------------------------------------------------------------------

#[test]
fn dgx_a100_picks_are_fully_connected_and_local() {
    let w = Weights::weighted();
    let al = preset("dgx-a100");
    let t = al.topology().clone();
    assert_eq!(
        sequence(&al, &[2, 2, 2, 2], &w),
        [[0, 1], [2, 3], [4, 5], [6, 7]]
    );
    assert_eq!(sequence(&al, &[4, 4], &w), [[0, 1, 2, 3], [4, 5, 6, 7]]);
    for sizes in [
        &[3, 3, 2][..],
        &[1, 2, 4, 1],
        &[2, 4, 2],
        &[5, 3],
        &[6, 2],
        &[8],
    ] {
        for p in sequence(&al, sizes, &w) {
            assert_eq!(
                al.structure(&p).unwrap(),
                Structure::FullyConnected,
                "{p:?}"
            );
            assert!((al.score(&p, &w).unwrap().total - 1.0).abs() < 1e-12);
        }
    }
    // Among equals, one NUMA node (and within it whole PCIe switches).
    assert_eq!(
        sequence(&al, &[3, 3, 2], &w),
        [vec![0, 1, 2], vec![4, 5, 6], vec![3, 7]]
    );
    assert_eq!(
        sequence(&al, &[1, 2, 4, 1], &w),
        [vec![0], vec![2, 3], vec![4, 5, 6, 7], vec![1]]
    );
    let numa = |g: usize| t.gpus()[g].numa_node;
    let switch = |g: usize| t.gpus()[g].pcie_switch;
    assert_eq!((numa(0), numa(3), numa(4)), (Some(0), Some(0), Some(1)));
    assert_eq!((switch(2), switch(3)), (Some(2), Some(2)));
    // With GPU1 taken, a pair goes to the next whole switch, not to GPU0's orphan.
    assert_eq!(
        al.preferred(&[0, 2, 3, 4, 5, 6, 7], &[], 2, &w).unwrap(),
        [2, 3]
    );
}

#[test]
fn dgx_a100_from_text_is_fully_connected_too() {
    // The text shows NV12 and NUMA nodes but no PCIe paths: still fully connected, NUMA-local.
    let w = Weights::weighted();
    let al = fixture("dgx-a100-nics.txt");
    let picks = sequence(&al, &[4, 2, 2], &w);
    assert_eq!(picks, [vec![0, 1, 2, 3], vec![4, 5], vec![6, 7]]);
    let al = fixture("dgx2-nv6.txt");
    assert_eq!(
        al.preferred(&(0..16).collect::<Vec<_>>(), &[], 8, &w)
            .unwrap(),
        (0..8).collect::<Vec<_>>(),
        "one CPU socket's eight"
    );
}

// ---- pcie-8 ----------------------------------------------------------------------------------

#[test]
fn pcie_8_follows_the_pcie_tree() {
    let w = Weights::weighted();
    let al = preset("pcie-8");
    assert_eq!(
        sequence(&al, &[2, 2, 2, 2], &w),
        [[0, 1], [2, 3], [4, 5], [6, 7]]
    );
    assert_eq!(sequence(&al, &[4, 4], &w), [[0, 1, 2, 3], [4, 5, 6, 7]]);
    // A pair never straddles a switch while a whole switch is free.
    assert_eq!(
        al.preferred(&[1, 2, 3, 4, 6, 7], &[], 2, &w).unwrap(),
        [2, 3]
    );
    // Three GPUs: two behind one switch plus one under the same root.
    let p = al
        .preferred(&(0..8).collect::<Vec<_>>(), &[], 3, &w)
        .unwrap();
    assert_eq!(p, [0, 1, 2]);
    let s = al.score(&[0, 1], &w).unwrap();
    assert_eq!(
        s.structure,
        Structure::Disconnected,
        "no NVLink on this box"
    );
    assert_eq!(s.bandwidth, 1.0);
    assert!(al.score(&[0, 4], &w).unwrap().bandwidth < al.score(&[0, 2], &w).unwrap().bandwidth);
}

// ---- memory balance and fault domains ---------------------------------------------------------

#[test]
fn memory_balance_and_fault_domains_count() {
    let w = Weights::weighted();
    let mut al = preset("dgx-a100");
    // GPU1 is half full: a pair of two empty GPUs is better balanced.
    al.set_memory(
        1,
        Memory {
            total: 80 * GIB,
            free: 40 * GIB,
        },
    )
    .unwrap();
    let all: Vec<usize> = (0..8).collect();
    assert_eq!(al.preferred(&all, &[], 2, &w).unwrap(), [2, 3]);
    assert_eq!(al.score(&[0, 1], &w).unwrap().balance, 0.5);
    // Fault domains per baseboard half: a spread pair beats a pair in one domain when the
    // domain weight is all there is.
    let mut t: Topology = al.topology().clone();
    t.set_fault_domains(&[0, 0, 0, 0, 1, 1, 1, 1]).unwrap();
    let al = Allocator::new(t).unwrap();
    let spread = Weights {
        policy: Policy::Weighted,
        bandwidth: 0.0,
        topology: 0.0,
        balance: 0.0,
        domain: 1.0,
    };
    let p = al.preferred(&all, &[], 2, &spread).unwrap();
    assert!(p[0] < 4 && p[1] >= 4, "{p:?}");
    assert_eq!(al.score(&[0, 2], &w).unwrap().domain, 0.5);
}

// ---- exhaustive cross-check ------------------------------------------------------------------

/// Every size-k subset of `avail` containing `must`, by walking all bit masks: a naive
/// enumeration, independent of the allocator's search.
fn brute_best(al: &Allocator, avail: &[usize], must: &[usize], k: usize, w: &Weights) -> f64 {
    let n = al.topology().len();
    let mut best = f64::NEG_INFINITY;
    for mask in 0u32..(1 << n) {
        let group: Vec<usize> = (0..n).filter(|&g| mask & (1 << g) != 0).collect();
        if group.len() != k
            || !group.iter().all(|g| avail.contains(g))
            || !must.iter().all(|g| group.contains(g))
        {
            continue;
        }
        best = best.max(al.score(&group, w).unwrap().total);
    }
    best
}

/// For every subset of free GPUs and sizes 1-4 (and a must-include variant): the pick's score is
/// the best score there is.
fn cross_check(al: &Allocator, w: &Weights) -> usize {
    let n = al.topology().len();
    let mut checked = 0;
    for free_mask in 1u32..(1 << n) {
        let avail: Vec<usize> = (0..n).filter(|&g| free_mask & (1 << g) != 0).collect();
        for k in 1..=4.min(avail.len()) {
            for must in [&[][..], &avail[avail.len() - 1..]] {
                let pick = al.preferred(&avail, must, k, w).unwrap();
                assert_eq!(pick.len(), k);
                assert!(
                    pick.iter().all(|g| avail.contains(g)),
                    "{pick:?} not in {avail:?}"
                );
                assert!(
                    must.iter().all(|g| pick.contains(g)),
                    "{pick:?} lacks {must:?}"
                );
                let got = al.score(&pick, w).unwrap().total;
                let best = brute_best(al, &avail, must, k, w);
                assert!(
                    (got - best).abs() <= 1e-9,
                    "free {avail:?} must {must:?} size {k}: pick {pick:?} scores {got}, best is {best}"
                );
                checked += 1;
            }
        }
    }
    checked
}

#[test]
fn exhaustive_cross_check_dgx1() {
    let al = preset("dgx1-v100");
    // Sum over the 255 free sets of min(|set|, 4) sizes, with and without a must-include GPU.
    assert_eq!(cross_check(&al, &Weights::weighted()), 2 * 884);
}

#[test]
fn exhaustive_cross_check_dgx1_other_weights_memory_and_domains() {
    let mut t = support::from_model(&model::preset("dgx1-v100").unwrap());
    for (g, free) in [(1, 4), (2, 16), (5, 8), (6, 12)] {
        t.set_memory(
            g,
            Memory {
                total: 16 * GIB,
                free: free * GIB,
            },
        )
        .unwrap();
    }
    t.set_fault_domains(&[0, 0, 1, 1, 2, 2, 3, 3]).unwrap();
    let al = Allocator::new(t).unwrap();
    for w in [
        Weights::weighted(),
        Weights {
            policy: Policy::Weighted,
            bandwidth: 1.0,
            topology: 0.0,
            balance: 0.0,
            domain: 0.0,
        },
        Weights {
            policy: Policy::Weighted,
            bandwidth: 0.1,
            topology: 0.2,
            balance: 0.3,
            domain: 0.4,
        },
    ] {
        cross_check(&al, &w);
    }
}

#[test]
fn exhaustive_cross_check_other_presets() {
    for p in ["dgx-a100", "pcie-8"] {
        cross_check(&preset(p), &Weights::weighted());
    }
    cross_check(&fixture("dgx1-p100-soc.txt"), &Weights::weighted());
}

// ---- policy allreduce (the default) ------------------------------------------------------------

/// dgx1-v100 as the plugin sees it through NVML, and through its `nvidia-smi topo -m` text.
fn dgx1_both() -> [Allocator; 2] {
    let m = model::preset("dgx1-v100").unwrap();
    [
        Allocator::new(support::from_model(&m)).unwrap(),
        Allocator::new(parse_topo_matrix(&m.topo_matrix()).unwrap()).unwrap(),
    ]
}

fn nvlinks_inside(group: &[usize]) -> u32 {
    let mut links = 0;
    for (i, &a) in group.iter().enumerate() {
        for &b in &group[i + 1..] {
            links += dgx1_links(a, b);
        }
    }
    links
}

#[test]
fn dgx1_pairs_and_singles_first_do_not_break_both_quads() {
    let w = Weights::default();
    for al in dgx1_both() {
        for first in [&[2, 2][..], &[1, 1, 1, 1], &[1, 2], &[2, 1, 1], &[1, 1, 1]] {
            let mut sizes = first.to_vec();
            sizes.push(4);
            let picks = sequence(&al, &sizes, &w);
            let quad = picks.last().unwrap();
            assert_eq!(nvlinks_inside(quad), 9, "after {first:?}: {picks:?}");
            assert!(quad == &[0, 1, 2, 3] || quad == &[4, 5, 6, 7], "{picks:?}");
        }
        // The pairs themselves still get 2 NVLinks each.
        let picks = sequence(&al, &[2, 2, 2, 2], &w);
        assert!(picks.iter().all(|p| nvlinks_inside(p) == 2), "{picks:?}");
    }
}

#[test]
fn dgx1_pair_request_does_not_strand_the_other_pair() {
    // go-gpuallocator's policy test 01: {0, 2, 4, 5} free, 2 GPUs. {0, 4} has 2 NVLinks but
    // leaves {2, 5} across the sockets; {0, 2} and {4, 5} leave a 1-NVLink pair.
    for al in dgx1_both() {
        let pick = al
            .preferred(&[0, 2, 4, 5], &[], 2, &Weights::default())
            .unwrap();
        assert!(pick == [0, 2] || pick == [4, 5], "{pick:?}");
        let (bad, _) = al.objective_cost(&[0, 2, 4, 5], &[0, 4], &[]).unwrap();
        let (good, _) = al.objective_cost(&[0, 2, 4, 5], &pick, &[]).unwrap();
        assert!(good < bad, "{good} vs {bad}");
        assert!(
            al.allreduce(&[0, 4]).time_ns(1 << 28) < al.allreduce(&pick).time_ns(1 << 28),
            "{{0, 4}} alone is faster: the look-ahead is what keeps the pair"
        );
    }
}

#[test]
fn recent_request_sizes_enter_the_look_ahead() {
    let [al, _] = dgx1_both();
    let w = Weights::default();
    // From {0, 1, 2, 3, 4, 5}, 3 GPUs: a ring of 3 with what it leaves for pairs and quads.
    let free = [0, 1, 2, 3, 4, 5];
    let (_, plain) = al.objective_cost(&free, &[0, 1, 2], &[]).unwrap();
    assert_eq!(plain, [2, 3]);
    al.note_request(3);
    al.note_request(5);
    al.note_request(3);
    assert_eq!(al.recent_requests(), [3, 5, 3]);
    let (_, with) = al
        .objective_cost(&free, &[0, 1, 2], &al.recent_requests())
        .unwrap();
    assert_eq!(with, [2, 3], "5 does not fit in the 3 left");
    for _ in 0..4 {
        al.note_request(1);
    }
    assert_eq!(al.recent_requests(), [1, 1, 1, 1], "only the last four");
    let pick = al.preferred(&free, &[], 3, &w).unwrap();
    assert_eq!(pick.len(), 3);
}

#[test]
fn rings_against_trees_weighted_score_and_allreduce_model() {
    // {0, 1, 4, 5}: the ring 0-1-5-4 (6 NVLinks); {0, 2, 3, 4}: 7 NVLinks, but GPU4 reaches
    // only GPU0 (a tree). The weighted score ranks by shape first; the all-reduce model by
    // the rings NCCL can run.
    for al in dgx1_both() {
        let (ring, tree) = ([0, 1, 4, 5], [0, 2, 3, 4]);
        assert_eq!((nvlinks_inside(&ring), nvlinks_inside(&tree)), (6, 7));
        assert_eq!(al.structure(&ring).unwrap(), Structure::Ring);
        assert_eq!(al.structure(&tree).unwrap(), Structure::Tree);
        let w = Weights::weighted();
        let (sr, st) = (al.score(&ring, &w).unwrap(), al.score(&tree, &w).unwrap());
        let (ar, at) = (al.allreduce(&ring), al.allreduce(&tree));
        println!(
            "ring {ring:?}: weighted {:.4}, busbw {:.1} GB/s, {} us; tree {tree:?}: weighted \
             {:.4}, busbw {:.1} GB/s, {} us (256 MiB)",
            sr.total,
            ar.busbw_gbps,
            ar.time_ns(1 << 28) / 1000,
            st.total,
            at.busbw_gbps,
            at.time_ns(1 << 28) / 1000
        );
        assert!(
            sr.total > st.total,
            "the structure weight puts the ring first"
        );
        assert!(
            ar.time_ns(1 << 28) < at.time_ns(1 << 28),
            "a ring of NVLinks beats a tree whose rings must cross PCIe"
        );
    }
}

#[test]
fn best_allreduce_and_cached_allreduce() {
    let [al, text] = dgx1_both();
    let (group, ar) = al.best_allreduce(4);
    assert!(group == [0, 1, 2, 3] || group == [4, 5, 6, 7], "{group:?}");
    assert_eq!(ar.group, group);
    assert_eq!(al.allreduce(&group), ar);
    assert_eq!(text.best_allreduce(4).0, group);
    let (all, ar8) = al.best_allreduce(8);
    assert_eq!(all, (0..8).collect::<Vec<_>>());
    assert!(ar8.busbw_gbps > 0.0);
    assert_eq!(al.best_allreduce(9).0.len(), 8, "at most the node's GPUs");
    assert!(al.best_allreduce(0).0.is_empty());
    // Unknown GPUs are ignored, repeated ones count once.
    assert_eq!(al.allreduce(&[0, 3, 3, 42]).group, [0, 3]);
    // A clone shares the cache and gives the same answers.
    assert_eq!(al.clone().allreduce(&[0, 3]), al.allreduce(&[0, 3]));
}

#[test]
fn nvswitch_and_pcie_boxes_under_allreduce() {
    let w = Weights::default();
    // NVSwitch: every group is as fast; locality keeps picks on one switch and NUMA node.
    let al = preset("dgx-a100");
    assert_eq!(
        sequence(&al, &[2, 2, 2, 2], &w),
        [[0, 1], [2, 3], [4, 5], [6, 7]]
    );
    assert_eq!(sequence(&al, &[4, 4], &w), [[0, 1, 2, 3], [4, 5, 6, 7]]);
    // PCIe: pairs under one switch, quads under one socket.
    let al = preset("pcie-8");
    let t = al.topology().clone();
    for p in sequence(&al, &[2, 2, 2, 2], &w) {
        assert_eq!(
            t.gpus()[p[0]].pcie_switch,
            t.gpus()[p[1]].pcie_switch,
            "{p:?}"
        );
    }
    for p in sequence(&al, &[4, 4], &w) {
        assert!(
            p.iter()
                .all(|&g| t.gpus()[g].numa_node == t.gpus()[p[0]].numa_node),
            "{p:?}"
        );
    }
}
