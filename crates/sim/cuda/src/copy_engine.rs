//! Copy engines: how long copies and memsets take over the modelled interconnect.
//!
//! Every copy of the driver (`copy::transfer`'s callers) is described here as [`Part`]s: where
//! its bytes come from and go to (host memory, pinned or pageable; a device's memory) and
//! whether the copying contexts have peer access. A part takes the route the machine's fabric
//! gives it (`cuvisor_fabric::Fabric::route`: host<->device over the device's PCIe link, within
//! a device over its memory, between devices over NVLink, NVSwitch, PCIe peer-to-peer or staged
//! through host memory) and is timed by `cuvisor_sim::state::Shared::reserve`, on one of the
//! copy engines of the device that drives it (the stream's), each engine a timeline of its own
//! beside the kernels' so that copies overlap kernels as on real GPUs ("Some devices of compute
//! capability 2.x and higher can overlap copies to and from the device with kernel execution
//! ... asyncEngineCount device property ... is greater than zero", CUDA C++ Programming Guide,
//! "Overlap of Data Transfer and Kernel Execution"; two engines let a copy to and one from the
//! device run at once, "Concurrent Data Transfers").
//!
//! When the host waits: the CUDA driver API reference, "API synchronization behavior"
//! (<https://docs.nvidia.com/cuda/cuda-driver-api/api-sync-behavior.html>), quoted at
//! [`sync_waits`] and [`async_waits`].
//!
//! Pageable host memory is staged by the driver through a pinned buffer ("If pageable memory
//! must first be staged to pinned memory", API synchronization behavior), so it is slower:
//! [`PAGEABLE_RATE`].

use crate::{ctx, peer};
use cuvisor_fabric::{specs, End, Fabric, Resource, Route, RouteKind};
use cuvisor_sim::state::Transfer;
use cuvisor_sim::Sim;

/// Pageable host memory moves at this fraction of the link's rate. CUDA samples' bandwidthTest
/// (32 MB transfers) on a DGX A100 (A100-SXM4-80GB): pinned 25.7 GB/s host to device and 25.8
/// device to host, pageable 10.0 and 10.8 (0.39 and 0.42 of pinned); on a PCIe A100 80GB
/// (Dell): pinned 17.3 and 24.6, pageable 3.3 and 8.5 (gengwg's notes "Using NVIDIA GPU P2P
/// Benchmark tool", `--memory=pinned` / `--memory=pageable` runs, found with this project's code
/// search). The host's memory bandwidth sets it; the DGX's 0.4 is taken for every machine.
pub(crate) const PAGEABLE_RATE: f64 = 0.4;

/// One side of a copy, for timing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Place {
    /// Host memory; `pinned`: page-locked (cuMemAllocHost, cuMemHostAlloc, cuMemHostRegister).
    Host { pinned: bool },
    /// Device memory (or an array) of a device.
    Device(usize),
}

/// One checked copy of `bytes` bytes.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Part {
    pub src: Place,
    pub dst: Place,
    pub bytes: u64,
    /// For a copy between two devices: the contexts have peer access (see [`peer_between`]).
    pub peer: bool,
}

/// What a checked operation costs in device time.
#[derive(Debug, Default)]
pub(crate) enum Cost {
    /// Nothing (an empty copy).
    #[default]
    None,
    /// Copies, one after another.
    Copies(Vec<Part>),
    /// A memset of `bytes` on device `dev` (done by the device on its memory, no copy engine).
    Memset { dev: usize, bytes: u64 },
}

fn end_of(p: Place) -> End {
    match p {
        Place::Host { .. } => End::Host,
        Place::Device(d) => End::Gpu(d),
    }
}

/// The route a part takes.
pub(crate) fn route(f: &Fabric, p: &Part) -> Option<Route> {
    if matches!(p.src, Place::Host { .. }) && matches!(p.dst, Place::Host { .. }) {
        return None; // host to host: the CPU's memcpy, real time already
    }
    let fits = |x: Place| match x {
        Place::Device(d) => d < f.len(),
        Place::Host { .. } => true,
    };
    (fits(p.src) && fits(p.dst)).then(|| f.route(end_of(p.src), end_of(p.dst), p.peer))
}

fn pageable(p: &Part) -> bool {
    matches!(p.src, Place::Host { pinned: false }) || matches!(p.dst, Place::Host { pinned: false })
}

/// Times `cost` on device `dev` (the device that drives it: the stream's, or the current
/// context's for a synchronous copy), starting no earlier than `not_before`. Returns when it
/// ends (`not_before` for no cost).
pub(crate) fn charge(cost: &Cost, dev: usize, not_before: u64) -> u64 {
    // The driver's `Sim`, read through `Sim::global` rather than `drv()`, which answers
    // NOT_PERMITTED on a thread running a host function: a copy there is timed too.
    let Ok(sim) = Sim::global() else {
        return not_before;
    };
    let f = &sim.fabric;
    match cost {
        Cost::None => not_before,
        Cost::Copies(parts) => {
            let engines = sim
                .model
                .devices
                .get(dev)
                .map_or(1, |x| x.specs.async_engines.max(1));
            let mut at = not_before;
            for p in parts {
                let Some(r) = route(f, p) else { continue };
                let t = Transfer {
                    fabric: f,
                    route: &r,
                    bytes: p.bytes,
                    rate: if pageable(p) { PAGEABLE_RATE } else { 1.0 },
                    engine: Some((dev, engines)),
                };
                at = at.max(sim.shared.reserve(&t, at).1);
            }
            at
        }
        Cost::Memset { dev: m, bytes } => {
            if *m >= f.len() {
                return not_before;
            }
            // A memset writes its bytes once, where a copy within the device reads and writes
            // them (the Memory resource's rate is half the device's bandwidth): half the bytes.
            let r = Route {
                hops: vec![Resource::Memory(*m)],
                latency_ns: specs::latency_ns(RouteKind::Local),
                kind: RouteKind::Local,
            };
            let t = Transfer {
                fabric: f,
                route: &r,
                bytes: bytes.div_ceil(2),
                rate: 1.0,
                engine: None,
            };
            sim.shared.reserve(&t, not_before).1
        }
    }
}

/// Whether a synchronous copy (cuMemcpy, cuMemcpyHtoD, ... without "Async") returns only once
/// it is done. "For transfers from pageable host memory to device memory, a stream sync is
/// performed before the copy is initiated. The function will return once the pageable buffer
/// has been copied to the staging memory for DMA transfer to device memory" (modelled as the
/// end of the copy: the last chunk staged is most of it); "For transfers from pinned host
/// memory to device memory, the function is synchronous with respect to the host"; "For
/// transfers from device to either pageable or pinned host memory, the function returns only
/// once the copy has completed"; "For transfers from device memory to device memory, no
/// host-side synchronization is performed" (API synchronization behavior). Memsets: "The
/// synchronous memset functions are asynchronous with respect to the host except when the
/// target is pinned host memory or a Unified Memory region" (the same page): device memory
/// here, so no wait.
pub(crate) fn sync_waits(cost: &Cost) -> bool {
    match cost {
        Cost::Copies(parts) => parts
            .iter()
            .any(|p| matches!(p.src, Place::Host { .. }) || matches!(p.dst, Place::Host { .. })),
        Cost::None | Cost::Memset { .. } => false,
    }
}

/// Whether an asynchronous copy blocks the host until it is done: "For transfers between device
/// memory and pageable host memory, the function might be synchronous with respect to host";
/// "If pageable memory must first be staged to pinned memory, the driver may synchronize with
/// the stream and stage the copy into pinned memory"; "For all other transfers, the function
/// should be fully asynchronous" (API synchronization behavior). The simulator takes the "may":
/// pageable copies block.
pub(crate) fn async_waits(cost: &Cost) -> bool {
    matches!(cost, Cost::Copies(parts) if parts.iter().any(pageable))
}

/// Whether a copy between memory of contexts `a` and `b` (handles) goes directly: either has
/// peer access to the other (cuCtxEnablePeerAccess). The CUDA C++ Programming Guide,
/// "Peer-to-Peer Memory Copy": "if peer access is enabled between two devices via
/// cudaDeviceEnablePeerAccess() ..., peer-to-peer memory copy between these two devices no
/// longer needs to be staged through the host and is therefore faster" — "between these two
/// devices", no direction: the driver may push from the source or pull from the destination,
/// so a grant either way is taken to do (UNVERIFIED which one a real driver needs).
pub(crate) fn peer_between(a: usize, b: usize) -> bool {
    let id = |h: usize| ctx::get(h as cuvisor_cuda_abi::cuda::CUcontext).map(|c| c.id);
    match (id(a), id(b)) {
        (Ok(x), Ok(y)) => peer::enabled(x, y) || peer::enabled(y, x),
        _ => false,
    }
}
