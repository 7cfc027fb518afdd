//! The GPU interconnect of one machine, as a set of directional resources each with a bandwidth.
//!
//! Three users share this one model, so that what the simulator measures and what the device
//! plugin predicts are the same thing:
//! - the simulated driver times every copy over the [`Route`] it takes ([`Fabric::route`]):
//!   each resource is a timeline in the simulator's shared state, so copies that share a link
//!   take turns on it (bandwidth shared), copies on different links overlap;
//! - the multi-GPU job (`cuvisor sim job`) runs a ring all-reduce over the rings [`ring::rings`]
//!   finds, as NCCL's ring algorithm does, one stream per ring;
//! - the device plugin places multi-GPU requests by the modelled all-reduce time
//!   ([`ring::AllReduce`]) and reports the seeds' communication efficiency and topology loss.
//!
//! What a resource is ([`Resource`]): one direction of a GPU's PCIe x16 link, of a PCIe switch's
//! uplink, of the SMP link between two NUMA nodes, of the bonded NVLinks between two GPUs, of a
//! GPU's NVLinks to the NVSwitch fabric, and a GPU's own memory (device-to-device copies).
//! Bandwidths are the published link rates ([`specs`]); real transfers reach 85-96 % of them, so
//! modelled times are a little optimistic, and equally so for every placement.
//!
//! Limits, on purpose: PCIe host bridges and the NVSwitch crossbar are non-blocking; host memory
//! is local to the GPU's NUMA node; latency is one figure per kind of route.

pub mod ring;
pub mod specs;

use std::fmt;

/// One GPU as the fabric sees it.
#[derive(Clone, Debug, PartialEq)]
pub struct Gpu {
    /// PCIe generation of the GPU's x16 host link (3, 4, 5, ...).
    pub pcie_gen: u32,
    pub numa_node: u32,
    /// Leaf PCIe switch (GPUs behind one switch share its uplink); any id, compared for equality.
    pub pcie_switch: u32,
    /// PCIe root complex (host bridge); GPUs under one root can reach each other peer-to-peer.
    pub pcie_root: u32,
    /// NVLink generation (1 = Pascal .. 5 = Blackwell); 0 without NVLink.
    pub nvlink_gen: u32,
    /// NVLinks that go to NVSwitches (0 on machines without them).
    pub switch_links: u32,
    /// Device memory bandwidth, GB/s (0 when unknown: device-to-device copies are then untimed).
    pub memory_gbps: f64,
}

/// A machine's interconnect: its GPUs and the direct NVLinks between them.
#[derive(Clone, Debug, PartialEq)]
pub struct Fabric {
    gpus: Vec<Gpu>,
    /// Direct NVLinks between GPUs a and b at `a * n + b` (symmetric).
    direct: Vec<u32>,
    /// Bandwidth of the SMP link between two NUMA nodes, per direction, GB/s.
    smp_gbps: f64,
    /// Dense numbers of the distinct PCIe switches and NUMA nodes.
    switches: Vec<u32>,
    nodes: Vec<u32>,
}

/// One end of a copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum End {
    /// Host memory near the GPU it is copied to or from.
    Host,
    Gpu(usize),
}

/// A direction-carrying part of the machine that copies share.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Resource {
    /// GPU g's PCIe x16 link, host to device.
    PcieDown(usize),
    /// GPU g's PCIe x16 link, device to host.
    PcieUp(usize),
    /// A PCIe switch's uplink to its root complex, towards the root (by dense switch number).
    SwitchUp(usize),
    /// ... and from the root.
    SwitchDown(usize),
    /// The SMP interconnect from NUMA node a to NUMA node b (dense node numbers).
    Smp(usize, usize),
    /// The bonded direct NVLinks from GPU a to GPU b.
    NvLink(usize, usize),
    /// GPU g's NVLinks into the NVSwitch fabric (sending).
    SwitchPortOut(usize),
    /// ... and out of it (receiving).
    SwitchPortIn(usize),
    /// GPU g's memory, for copies within it (read and write: half its bandwidth).
    Memory(usize),
}

impl fmt::Display for Resource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Resource::PcieDown(g) => write!(f, "GPU{g} PCIe host->device"),
            Resource::PcieUp(g) => write!(f, "GPU{g} PCIe device->host"),
            Resource::SwitchUp(s) => write!(f, "PCIe switch {s} uplink to root"),
            Resource::SwitchDown(s) => write!(f, "PCIe switch {s} uplink from root"),
            Resource::Smp(a, b) => write!(f, "SMP link NUMA{a}->NUMA{b}"),
            Resource::NvLink(a, b) => write!(f, "NVLink GPU{a}->GPU{b}"),
            Resource::SwitchPortOut(g) => write!(f, "GPU{g} NVSwitch port out"),
            Resource::SwitchPortIn(g) => write!(f, "GPU{g} NVSwitch port in"),
            Resource::Memory(g) => write!(f, "GPU{g} memory"),
        }
    }
}

/// The path of one copy: the resources it crosses, in order, and its fixed cost.
#[derive(Clone, Debug, PartialEq)]
pub struct Route {
    pub hops: Vec<Resource>,
    /// Start-up time of the copy, ns (see [`specs::latency_ns`]).
    pub latency_ns: u64,
    /// What carries it, for messages and metrics.
    pub kind: RouteKind,
}

/// What carries a copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RouteKind {
    /// Within one GPU's memory.
    Local,
    /// Host memory and a GPU, over the GPU's PCIe link.
    Pcie,
    /// Directly between two GPUs' NVLinks.
    NvLink,
    /// Through NVSwitches.
    NvSwitch,
    /// Peer-to-peer over PCIe (under one root complex).
    PcieP2p,
    /// Through host memory: peer access not enabled, or not possible on this path.
    Staged,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FabricError {
    /// More GPUs than [`MAX_GPUS`].
    TooManyGpus(usize),
    BadLink {
        a: usize,
        b: usize,
    },
}

impl fmt::Display for FabricError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FabricError::TooManyGpus(n) => {
                write!(f, "{n} GPUs; the fabric model handles at most {MAX_GPUS}")
            }
            FabricError::BadLink { a, b } => write!(f, "NVLink {a}-{b}: no such pair of GPUs"),
        }
    }
}

impl std::error::Error for FabricError {}

/// The most GPUs a fabric has (the simulator's and the allocator's limit).
pub const MAX_GPUS: usize = 16;

impl Fabric {
    /// A fabric of `gpus` with `links` direct NVLinks (a, b, count; listed once per pair, or
    /// split over several entries, which add up).
    pub fn new(gpus: Vec<Gpu>, links: &[(usize, usize, u32)]) -> Result<Fabric, FabricError> {
        // No GPUs is a machine too (a node whose GPUs are all bound elsewhere): no resources.
        let n = gpus.len();
        if n > MAX_GPUS {
            return Err(FabricError::TooManyGpus(n));
        }
        let mut direct = vec![0u32; n * n];
        for &(a, b, count) in links {
            if a >= n || b >= n || a == b {
                return Err(FabricError::BadLink { a, b });
            }
            direct[a * n + b] += count;
            direct[b * n + a] += count;
        }
        let dense = |key: fn(&Gpu) -> u32| {
            let mut v: Vec<u32> = gpus.iter().map(key).collect();
            v.sort_unstable();
            v.dedup();
            v
        };
        Ok(Fabric {
            switches: dense(|g| g.pcie_switch),
            nodes: dense(|g| g.numa_node),
            gpus,
            direct,
            smp_gbps: specs::SMP_GBPS,
        })
    }

    /// The same fabric with another SMP (socket-to-socket) bandwidth per direction.
    pub fn with_smp_gbps(mut self, gbps: f64) -> Fabric {
        self.smp_gbps = gbps;
        self
    }

    pub fn len(&self) -> usize {
        self.gpus.len()
    }

    pub fn is_empty(&self) -> bool {
        self.gpus.is_empty()
    }

    pub fn gpus(&self) -> &[Gpu] {
        &self.gpus
    }

    /// Direct NVLinks between a and b.
    pub fn direct_links(&self, a: usize, b: usize) -> u32 {
        self.direct[a * self.len() + b]
    }

    /// Both GPUs reach the NVSwitch fabric.
    fn switched(&self, a: usize, b: usize) -> bool {
        self.gpus[a].switch_links > 0 && self.gpus[b].switch_links > 0
    }

    /// Whether a and b can access each other's memory directly (what `cuDeviceCanAccessPeer`
    /// answers): over NVLink (direct or NVSwitch), or over PCIe when both are under one root
    /// complex. Across root complexes and sockets PCIe peer traffic is not supported by most
    /// chipsets (`nvidia-smi topo -p2p` prints "CNS", chipset not supported), and copies go
    /// through host memory.
    pub fn p2p_supported(&self, a: usize, b: usize) -> bool {
        a != b
            && (self.direct_links(a, b) > 0
                || self.switched(a, b)
                || self.gpus[a].pcie_root == self.gpus[b].pcie_root)
    }

    fn switch_of(&self, g: usize) -> usize {
        let s = self.gpus[g].pcie_switch;
        self.switches.iter().position(|&x| x == s).unwrap_or(0)
    }

    fn node_of(&self, g: usize) -> usize {
        let s = self.gpus[g].numa_node;
        self.nodes.iter().position(|&x| x == s).unwrap_or(0)
    }

    /// The PCIe hops from GPU a up to host memory (or the root), then down to GPU b; `host`:
    /// the traffic goes through host memory (not a switch-local P2P turn-around).
    fn pcie_hops(&self, a: usize, b: usize, host: bool) -> Vec<Resource> {
        let (sa, sb) = (self.switch_of(a), self.switch_of(b));
        let mut hops = vec![Resource::PcieUp(a)];
        let turn_in_switch = !host && sa == sb;
        if !turn_in_switch {
            hops.push(Resource::SwitchUp(sa));
            let (na, nb) = (self.node_of(a), self.node_of(b));
            if na != nb {
                hops.push(Resource::Smp(na, nb));
            }
            hops.push(Resource::SwitchDown(sb));
        }
        hops.push(Resource::PcieDown(b));
        hops
    }

    /// The route of a copy from `from` to `to`. `peer_enabled`: for copies between two GPUs,
    /// whether the copying context has peer access to the other (cuCtxEnablePeerAccess): "if
    /// peer access is not enabled ... the copy is staged through host memory" is what the CUDA
    /// Programming Guide's peer-to-peer section implies ("Memory copies ... between two devices
    /// ... are faster when peer-to-peer access is enabled").
    pub fn route(&self, from: End, to: End, peer_enabled: bool) -> Route {
        let route = |hops: Vec<Resource>, kind: RouteKind| Route {
            hops,
            latency_ns: specs::latency_ns(kind),
            kind,
        };
        match (from, to) {
            (End::Host, End::Host) => route(Vec::new(), RouteKind::Local),
            (End::Host, End::Gpu(g)) => route(vec![Resource::PcieDown(g)], RouteKind::Pcie),
            (End::Gpu(g), End::Host) => route(vec![Resource::PcieUp(g)], RouteKind::Pcie),
            (End::Gpu(a), End::Gpu(b)) if a == b => {
                route(vec![Resource::Memory(a)], RouteKind::Local)
            }
            (End::Gpu(a), End::Gpu(b)) => {
                let direct = peer_enabled && self.p2p_supported(a, b);
                if direct && self.direct_links(a, b) > 0 {
                    route(vec![Resource::NvLink(a, b)], RouteKind::NvLink)
                } else if direct && self.switched(a, b) {
                    route(
                        vec![Resource::SwitchPortOut(a), Resource::SwitchPortIn(b)],
                        RouteKind::NvSwitch,
                    )
                } else if direct {
                    route(self.pcie_hops(a, b, false), RouteKind::PcieP2p)
                } else {
                    route(self.pcie_hops(a, b, true), RouteKind::Staged)
                }
            }
        }
    }

    /// A resource's bandwidth per direction, GB/s (f64::INFINITY: not a bottleneck, e.g. the
    /// memory of a GPU whose bandwidth is unknown).
    pub fn capacity(&self, r: Resource) -> f64 {
        match r {
            Resource::PcieDown(g) | Resource::PcieUp(g) => {
                specs::pcie_x16_gbps(self.gpus[g].pcie_gen)
            }
            Resource::SwitchUp(s) | Resource::SwitchDown(s) => {
                // A switch's uplink is an x16 link of the generation of the GPUs behind it.
                let gen = self
                    .gpus
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| self.switch_of(*i) == s)
                    .map(|(_, g)| g.pcie_gen)
                    .max()
                    .unwrap_or(3);
                specs::pcie_x16_gbps(gen)
            }
            Resource::Smp(..) => self.smp_gbps,
            Resource::NvLink(a, b) => {
                self.direct_links(a, b) as f64
                    * specs::nvlink_gbps_per_link(self.gpus[a].nvlink_gen)
            }
            Resource::SwitchPortOut(g) | Resource::SwitchPortIn(g) => {
                self.gpus[g].switch_links as f64
                    * specs::nvlink_gbps_per_link(self.gpus[g].nvlink_gen)
            }
            Resource::Memory(g) => match self.gpus[g].memory_gbps {
                x if x > 0.0 => x / 2.0,
                _ => f64::INFINITY,
            },
        }
    }

    /// The bandwidth a lone copy gets on `route`: its slowest hop, GB/s.
    pub fn route_gbps(&self, route: &Route) -> f64 {
        route
            .hops
            .iter()
            .map(|&r| self.capacity(r))
            .fold(f64::INFINITY, f64::min)
    }

    /// Every resource of the machine, each once, in a fixed order: what the simulator gives a
    /// timeline each ([`Fabric::index`] is a resource's place in this list).
    pub fn resources(&self) -> Vec<Resource> {
        let n = self.len();
        let mut v = Vec::new();
        for g in 0..n {
            v.extend([
                Resource::PcieDown(g),
                Resource::PcieUp(g),
                Resource::SwitchPortOut(g),
                Resource::SwitchPortIn(g),
                Resource::Memory(g),
            ]);
        }
        for s in 0..self.switches.len() {
            v.extend([Resource::SwitchUp(s), Resource::SwitchDown(s)]);
        }
        for a in 0..self.nodes.len() {
            for b in 0..self.nodes.len() {
                if a != b {
                    v.push(Resource::Smp(a, b));
                }
            }
        }
        for a in 0..n {
            for b in 0..n {
                if self.direct_links(a, b) > 0 {
                    v.push(Resource::NvLink(a, b));
                }
            }
        }
        v
    }

    /// A resource's place in [`Fabric::resources`] (None for one this fabric does not have).
    pub fn index(&self, r: Resource) -> Option<usize> {
        let n = self.len();
        let (s, k) = (self.switches.len(), self.nodes.len());
        let base_sw = 5 * n;
        let base_smp = base_sw + 2 * s;
        let base_nv = base_smp + k * k.saturating_sub(1);
        Some(match r {
            Resource::PcieDown(g) if g < n => 5 * g,
            Resource::PcieUp(g) if g < n => 5 * g + 1,
            Resource::SwitchPortOut(g) if g < n => 5 * g + 2,
            Resource::SwitchPortIn(g) if g < n => 5 * g + 3,
            Resource::Memory(g) if g < n => 5 * g + 4,
            Resource::SwitchUp(i) if i < s => base_sw + 2 * i,
            Resource::SwitchDown(i) if i < s => base_sw + 2 * i + 1,
            Resource::Smp(a, b) if a < k && b < k && a != b => {
                base_smp + a * (k - 1) + if b > a { b - 1 } else { b }
            }
            Resource::NvLink(a, b) if a < n && b < n && self.direct_links(a, b) > 0 => {
                let before = (0..a * n + b).filter(|&i| self.direct[i] > 0).count();
                base_nv + before
            }
            _ => return None,
        })
    }
}

#[cfg(test)]
mod tests;
