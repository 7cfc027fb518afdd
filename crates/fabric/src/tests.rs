use super::ring::{allreduce, efficiency, rings, topology_loss};
use super::*;

/// DGX-1 (V100): the hybrid cube-mesh of NVIDIA's DGX-1 documentation, two GPUs per PCIe
/// switch, four per socket.
pub(crate) fn dgx1() -> Fabric {
    let links = [
        (0, 1, 1),
        (0, 2, 1),
        (0, 3, 2),
        (0, 4, 2),
        (1, 2, 2),
        (1, 3, 1),
        (1, 5, 2),
        (2, 3, 2),
        (2, 6, 1),
        (3, 7, 1),
        (4, 5, 1),
        (4, 6, 1),
        (4, 7, 2),
        (5, 6, 2),
        (5, 7, 1),
        (6, 7, 2),
    ];
    Fabric::new(machine(8, 3, 2, 0, 900.0), &links).unwrap()
}

fn machine(n: usize, pcie_gen: u32, nvlink_gen: u32, switch_links: u32, mem: f64) -> Vec<Gpu> {
    (0..n)
        .map(|i| Gpu {
            pcie_gen,
            numa_node: (i / 4) as u32,
            pcie_switch: (i / 2) as u32,
            pcie_root: (i / 2) as u32,
            nvlink_gen,
            switch_links,
            memory_gbps: mem,
        })
        .collect()
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-6 * b.abs().max(1.0)
}

#[test]
fn routes_follow_the_wiring() {
    let f = dgx1();
    let r = f.route(End::Gpu(0), End::Gpu(3), true);
    assert_eq!(r.kind, RouteKind::NvLink);
    assert_eq!(f.route_gbps(&r), 50.0, "two NVLink 2 links");
    // 0 and 5: no NVLink, different sockets: not peer-capable, staged through host memory.
    let r = f.route(End::Gpu(0), End::Gpu(5), true);
    assert_eq!(r.kind, RouteKind::Staged);
    assert_eq!(
        r.hops,
        vec![
            Resource::PcieUp(0),
            Resource::SwitchUp(0),
            Resource::Smp(0, 1),
            Resource::SwitchDown(2),
            Resource::PcieDown(5)
        ]
    );
    assert!(close(f.route_gbps(&r), 15.7536), "{}", f.route_gbps(&r));
    // Peer access not enabled: even NVLink peers copy through host memory.
    assert_eq!(
        f.route(End::Gpu(0), End::Gpu(3), false).kind,
        RouteKind::Staged
    );
    assert_eq!(
        f.route(End::Host, End::Gpu(2), false).hops,
        vec![Resource::PcieDown(2)]
    );
    assert_eq!(
        f.route(End::Gpu(2), End::Gpu(2), true).hops,
        vec![Resource::Memory(2)]
    );
    assert_eq!(f.capacity(Resource::Memory(2)), 450.0);
}

#[test]
fn pcie_peers_turn_in_their_switch() {
    let f = Fabric::new(machine(4, 4, 0, 0, 600.0), &[]).unwrap();
    let r = f.route(End::Gpu(0), End::Gpu(1), true);
    assert_eq!(r.kind, RouteKind::PcieP2p);
    assert_eq!(r.hops, vec![Resource::PcieUp(0), Resource::PcieDown(1)]);
    assert!(f.p2p_supported(0, 1) && !f.p2p_supported(0, 2));
    assert_eq!(
        f.route(End::Gpu(0), End::Gpu(2), true).kind,
        RouteKind::Staged
    );
}

#[test]
fn resource_indices_are_dense_and_match_the_list() {
    for f in [
        dgx1(),
        Fabric::new(machine(8, 4, 3, 12, 2039.0), &[]).unwrap(),
    ] {
        let all = f.resources();
        for (i, r) in all.iter().enumerate() {
            assert_eq!(f.index(*r), Some(i), "{r}");
        }
        assert_eq!(f.index(Resource::NvLink(0, 5)), None);
        assert_eq!(f.index(Resource::PcieUp(8)), None);
    }
}

#[test]
fn dgx1_rings_use_every_nvlink_as_nccl_does() {
    let f = dgx1();
    // All 8: the two-link ring both ways (50 + 50) and the one-link ring both ways (25 + 25):
    // 150 GB/s, each GPU's six links (nccl-tests on DGX-1V reports about 130 GB/s busbw).
    let a = allreduce(&f, &[0, 1, 2, 3, 4, 5, 6, 7]);
    assert!(close(a.busbw_gbps, 150.0), "{:?}", a.rings);
    // The 9-link quad {0,1,2,3}: four links per GPU inside it, 100 GB/s.
    let q = allreduce(&f, &[0, 1, 2, 3]);
    assert!(close(q.busbw_gbps, 100.0), "{:?}", q.rings);
    // {0,1,4,5}: a 4-cycle of 1,2,1,2 links: one ring each way at 25.
    let c = allreduce(&f, &[0, 1, 4, 5]);
    assert!(close(c.busbw_gbps, 50.0), "{:?}", c.rings);
    // A pair: both directions of its links.
    assert!(close(allreduce(&f, &[0, 3]).busbw_gbps, 50.0));
    // A pair without NVLink across sockets: through host memory, PCIe Gen3.
    assert!(close(allreduce(&f, &[0, 5]).busbw_gbps, 15.7536));
    assert!(q.time_ns(1 << 30) < c.time_ns(1 << 30));
}

#[test]
fn nvswitch_rings_get_the_port_bandwidth() {
    // DGX A100: 12 NVLink 3 links per GPU into the switches, 300 GB/s per direction.
    let f = Fabric::new(machine(8, 4, 3, 12, 2039.0), &[]).unwrap();
    let a = allreduce(&f, &(0..8).collect::<Vec<_>>());
    assert!(close(a.busbw_gbps, 300.0), "{:?}", a.rings);
    assert!(close(allreduce(&f, &[2, 6]).busbw_gbps, 300.0));
}

#[test]
fn pcie_rings_share_switch_uplinks_and_the_socket_link() {
    // Eight Gen4 GPUs, two per switch, four per socket, no NVLink: a ring through all eight
    // crosses each switch uplink once each way, and the socket link once each way.
    let f = Fabric::new(machine(8, 4, 0, 0, 600.0), &[]).unwrap();
    let a = allreduce(&f, &(0..8).collect::<Vec<_>>());
    assert!(
        a.busbw_gbps > 0.0 && a.busbw_gbps <= 2.0 * 31.504 + 1e-6,
        "{:?}",
        a.rings
    );
    for r in &a.rings {
        assert_eq!(r.order.len(), 8);
    }
}

#[test]
fn large_groups_use_greedy_rings() {
    let f = Fabric::new(
        (0..16)
            .map(|i| Gpu {
                pcie_gen: 4,
                numa_node: (i / 8) as u32,
                pcie_switch: (i / 2) as u32,
                pcie_root: (i / 4) as u32,
                nvlink_gen: 3,
                switch_links: 12,
                memory_gbps: 2039.0,
            })
            .collect(),
        &[],
    )
    .unwrap();
    let group: Vec<usize> = (0..16).collect();
    let r = rings(&f, &group);
    assert!(close(r.iter().map(|x| x.gbps).sum::<f64>(), 300.0), "{r:?}");
}

#[test]
fn one_gpu_has_no_ring_and_no_time() {
    let a = allreduce(&dgx1(), &[4]);
    assert!(a.rings.is_empty());
    assert_eq!(a.time_ns(1 << 30), 0);
    assert_eq!(a.efficiency_gbps(), 0.0);
}

#[test]
fn the_seeds_formulas() {
    assert_eq!(efficiency([(100, 50.0), (100, 25.0)]), 37.5);
    assert_eq!(efficiency([]), 0.0);
    assert_eq!(topology_loss(37.5, 50.0), 0.25);
    assert_eq!(topology_loss(60.0, 50.0), 0.0);
    assert_eq!(topology_loss(1.0, 0.0), 0.0);
    let f = dgx1();
    let best = allreduce(&f, &[0, 1, 2, 3]).efficiency_gbps();
    let worse = allreduce(&f, &[0, 1, 4, 5]).efficiency_gbps();
    assert!(topology_loss(worse, best) > 0.0 && worse < best);
}

#[test]
fn time_is_bytes_over_busbw_plus_latency() {
    let a = allreduce(&dgx1(), &[0, 3]);
    // 2 GPUs: 2(k-1)/k = 1: 1 GB at 50 GB/s = 20 ms, plus 2 steps of 2 us.
    assert_eq!(a.time_ns(1_000_000_000), 20_000_000 + 4_000);
}

#[test]
fn a_machine_without_gpus_is_a_fabric_with_nothing_in_it() {
    let f = Fabric::new(Vec::new(), &[]).unwrap();
    assert!(f.is_empty() && f.resources().is_empty());
    assert!(allreduce(&f, &[]).rings.is_empty());
    assert_eq!(
        Fabric::new(machine(2, 3, 2, 0, 0.0), &[(0, 2, 1)]),
        Err(FabricError::BadLink { a: 0, b: 2 })
    );
}

#[test]
fn no_ring_through_a_gpu_twice_or_one_the_machine_lacks() {
    let f = dgx1();
    assert!(rings(&f, &[0, 0]).is_empty());
    assert!(rings(&f, &[0, 8]).is_empty());
    assert_eq!(allreduce(&f, &[0, 0]).busbw_gbps, 0.0);
    assert_eq!(
        allreduce(&f, &[0, 0]).time_ns(1),
        u64::MAX,
        "no ring never completes"
    );
    // Huge all-reduces saturate instead of wrapping.
    assert!(allreduce(&f, &[0, 3]).time_ns(u64::MAX) >= u64::MAX / 60);
}
