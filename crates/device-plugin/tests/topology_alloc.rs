//! The allocator on the simulator presets and on fixtures: the DGX-1 request sequences, the
//! NVSwitch and PCIe boxes, and the exhaustive cross-check against a naive brute force.

mod support;

use cuvisor_device_plugin::topology::{
    parse_topo_matrix, Allocator, Memory, Structure, Topology, Weights,
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
    let w = Weights::default();
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
    let w = Weights::default();
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
    let w = Weights::default();
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
    let w = Weights::default();
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
    let w = Weights::default();
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
    let w = Weights::default();
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
    let w = Weights::default();
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
    assert_eq!(cross_check(&al, &Weights::default()), 2 * 884);
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
        Weights::default(),
        Weights {
            bandwidth: 1.0,
            topology: 0.0,
            balance: 0.0,
            domain: 0.0,
        },
        Weights {
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
        cross_check(&preset(p), &Weights::default());
    }
    cross_check(&fixture("dgx1-p100-soc.txt"), &Weights::default());
}
