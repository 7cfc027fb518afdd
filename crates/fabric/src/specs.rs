//! Published link figures. Every bandwidth is per direction, in GB/s (10^9 bytes per second).

use crate::RouteKind;

/// Per-link, per-direction NVLink bandwidth by generation.
///
/// | generation | GPUs | per link | links per GPU | per GPU, per direction |
/// |---|---|---|---|---|
/// | 1 | P100 | 20 | 4 | 80 |
/// | 2 | V100 | 25 | 6 | 150 |
/// | 3 | A100 | 25 | 12 | 300 |
/// | 4 | H100/H200 | 25 | 18 | 450 |
/// | 5 | B200 | 50 | 18 | 900 |
///
/// NVIDIA quotes bidirectional totals: P100 160 GB/s (Pascal whitepaper), V100 300 GB/s ("six
/// NVLinks ... 25 GB/s in each direction", Volta whitepaper), A100 600 GB/s over 12 links (Ampere
/// whitepaper), H100/H200 900 GB/s over 18 links (Hopper whitepaper; H200 datasheet "NVLink:
/// 900GB/s"), B200 1.8 TB/s. Measured: p2pBandwidthLatencyTest on V100-SXM2 gives 47.9 GB/s per
/// two-link pair, 95.8 % of the rate (Dell HPC, "Deep learning performance on V100", Table 3).
/// Generation 0 or unknown counts as 25, right for generations 2-4.
pub fn nvlink_gbps_per_link(generation: u32) -> f64 {
    match generation {
        1 => 20.0,
        g if g >= 5 => 50.0,
        _ => 25.0,
    }
}

/// One PCIe lane's bandwidth per direction: the signalling rate times the line code (8b/10b up
/// to Gen2, 128b/130b from Gen3), PCI-SIG's figures: Gen3 8 GT/s, Gen4 16, Gen5 32, Gen6 64.
/// Unknown generations count as Gen3.
pub fn pcie_lane_gbps(generation: u32) -> f64 {
    match generation {
        1 => 0.25,
        2 => 0.5,
        4 => 1.969,
        5 => 3.938,
        g if g >= 6 => 7.563,
        _ => 0.984_6, // Gen3: 8 GT/s x 128/130 / 8 bits
    }
}

/// A PCIe x16 link per direction (Gen3 15.75, Gen4 31.5, Gen5 63 GB/s). Measured: 54.3 GB/s
/// peer-to-peer over Gen5 x16, 0.86 of the rate (lukealonso/p2pmark's published run).
pub fn pcie_x16_gbps(generation: u32) -> f64 {
    pcie_lane_gbps(generation) * 16.0
}

/// The SMP link between two sockets, per direction: DGX-1's two Xeon E5-2698 v4 are joined by
/// two QPI links at 9.6 GT/s, 19.2 GB/s each per direction (Intel's QPI: 2 bytes per transfer
/// per direction), 38.4 in all. Newer sockets have more (UPI, xGMI); a fabric may say so
/// ([`crate::Fabric::with_smp_gbps`]). It only matters for PCIe traffic across sockets, which
/// each GPU's own x16 link already limits.
pub const SMP_GBPS: f64 = 38.4;

/// The fixed start-up cost of one copy, by what carries it. Orders of magnitude from published
/// measurements: p2pmark's best-pair P2P latency over PCIe Gen5 is 4.1 us; NVLink peers answer
/// in about 2 us in p2pBandwidthLatencyTest's latency matrix, copies through host memory in
/// about 10-20 us (P2P disabled columns). A copy within one GPU costs about what a kernel
/// launch does.
pub fn latency_ns(kind: RouteKind) -> u64 {
    match kind {
        RouteKind::Local => 2_000,
        RouteKind::NvLink | RouteKind::NvSwitch => 2_000,
        RouteKind::Pcie => 5_000,
        RouteKind::PcieP2p => 5_000,
        RouteKind::Staged => 12_000,
    }
}

/// The time a lone copy of `bytes` takes at `gbps` after `latency_ns`, ns.
pub fn copy_ns(bytes: u64, gbps: f64, latency_ns: u64) -> u64 {
    latency_ns + transfer_ns(bytes, gbps)
}

/// `bytes` at `gbps`, ns (0 at an infinite rate).
pub fn transfer_ns(bytes: u64, gbps: f64) -> u64 {
    if !gbps.is_finite() || gbps <= 0.0 {
        return 0;
    }
    (bytes as f64 / gbps).ceil() as u64
}
