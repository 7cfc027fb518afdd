//! The topology model: the GPUs of one node and, for every pair, how they are connected.
//!
//! Two sources fill it: [`super::discover`] (NVML, everything known) and [`super::parse_topo_matrix`]
//! (`nvidia-smi topo -m` text, which lacks UUIDs, memory, NVLink generations and, for pairs it
//! shows as `NV#`, the PCIe path). Unknown facts are `None`, never guessed into the model; the
//! bandwidth table ([`Link::bandwidth_gbps`]) says what is assumed when a fact is missing.

use std::fmt;

/// PCIe/CPU distance between two GPUs, as `nvidia-smi topo -m` and NVML's
/// `nvmlDeviceGetTopologyCommonAncestor` name it, nearest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum PcieLevel {
    /// Same board (a dual-GPU card such as the K80); NVML_TOPOLOGY_INTERNAL.
    Internal,
    /// `PIX`: at most one PCIe bridge/switch between them; NVML_TOPOLOGY_SINGLE.
    Single,
    /// `PXB`: several PCIe bridges, no host bridge; NVML_TOPOLOGY_MULTIPLE.
    Multiple,
    /// `PHB`: through one PCIe host bridge (the CPU's root complex); NVML_TOPOLOGY_HOSTBRIDGE.
    HostBridge,
    /// `NODE`: between host bridges within one NUMA node; NVML_TOPOLOGY_NODE.
    Node,
    /// `SYS` (`SOC` in old drivers): across NUMA nodes, over the SMP interconnect (QPI/UPI);
    /// NVML_TOPOLOGY_SYSTEM.
    System,
}

impl PcieLevel {
    pub const ALL: [PcieLevel; 6] = [
        PcieLevel::Internal,
        PcieLevel::Single,
        PcieLevel::Multiple,
        PcieLevel::HostBridge,
        PcieLevel::Node,
        PcieLevel::System,
    ];

    /// The current `nvidia-smi topo -m` legend name. `Internal` has none of its own in the
    /// matrix (nvidia-smi shows such pairs as `PIX`); it is written `PIX` too.
    pub fn legend(self) -> &'static str {
        match self {
            PcieLevel::Internal | PcieLevel::Single => "PIX",
            PcieLevel::Multiple => "PXB",
            PcieLevel::HostBridge => "PHB",
            PcieLevel::Node => "NODE",
            PcieLevel::System => "SYS",
        }
    }

    /// Distance rank used to keep picks local: 0 (same board) .. 5 (across NUMA nodes).
    pub fn rank(self) -> u32 {
        self as u32
    }

    /// The share of a PCIe x16 link's bandwidth that GPU-to-GPU traffic gets over this path.
    ///
    /// Estimates, not measurements: peer-to-peer under one switch runs at nearly the link rate;
    /// every further hop (several switches, the host bridge, the host-bridge interconnect,
    /// QPI/UPI between sockets, where P2P is often unavailable and copies bounce through host
    /// memory) costs more. What matters for placement is the order, which is strict.
    pub fn bandwidth_fraction(self) -> f64 {
        match self {
            PcieLevel::Internal | PcieLevel::Single => 1.0,
            PcieLevel::Multiple => 0.9,
            PcieLevel::HostBridge => 0.75,
            PcieLevel::Node => 0.6,
            PcieLevel::System => 0.4,
        }
    }

    /// From NVML's `nvmlGpuTopologyLevel_t` value (0, 10, .. 50).
    pub fn from_nvml(value: u32) -> Option<PcieLevel> {
        Some(match value {
            0 => PcieLevel::Internal,
            10 => PcieLevel::Single,
            20 => PcieLevel::Multiple,
            30 => PcieLevel::HostBridge,
            40 => PcieLevel::Node,
            50 => PcieLevel::System,
            _ => return None,
        })
    }
}

/// Per-link, per-direction NVLink bandwidth in GB/s by NVLink generation: the interconnect
/// model's table (`cuvisor_fabric::specs::nvlink_gbps_per_link`, with its sources). An unknown
/// generation (the `topo -m` text does not say) counts as 25 GB/s, right for generations 2-4.
pub fn nvlink_gbps_per_link(generation: Option<u32>) -> f64 {
    cuvisor_fabric::specs::nvlink_gbps_per_link(generation.unwrap_or(0))
}

/// PCIe x16 bandwidth per direction, GB/s, by PCIe generation (`cuvisor_fabric::specs`).
/// Unknown generations count as Gen3.
pub fn pcie_x16_gbps(generation: u32) -> f64 {
    cuvisor_fabric::specs::pcie_x16_gbps(generation)
}

/// One PCIe lane's bandwidth per direction, GB/s (`cuvisor_fabric::specs`).
pub fn pcie_lane_gbps(generation: u32) -> f64 {
    cuvisor_fabric::specs::pcie_lane_gbps(generation)
}

/// What [`Topology::pcie_link_gbps`] is when nothing says better: PCIe Gen3 x16.
pub const DEFAULT_PCIE_LINK_GBPS: f64 = 15.75;

/// Free and total device memory, bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Memory {
    pub total: u64,
    pub free: u64,
}

impl Memory {
    /// The free share, 0..=1 (a zero-sized device counts as full).
    pub fn free_fraction(&self) -> f64 {
        if self.total == 0 {
            0.0
        } else {
            (self.free.min(self.total)) as f64 / self.total as f64
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Gpu {
    /// NVML / nvidia-smi index; equals the position in [`Topology::gpus`].
    pub index: usize,
    /// The device node's minor number (`/dev/nvidia<minor>`, `nvmlDeviceGetMinorNumber`), which
    /// need not equal the index; `None` when unknown (`topo -m` text does not show it).
    pub minor: Option<u32>,
    pub uuid: Option<String>,
    /// NVML's form, `dddddddd:bb:dd.f`, lower case.
    pub pci_bus_id: Option<String>,
    pub memory: Option<Memory>,
    pub numa_node: Option<u32>,
    /// The CPUs near the GPU, as nvidia-smi prints them (`0-19,40-59`).
    pub cpu_affinity: Option<String>,
    /// The GPUs behind one leaf PCIe switch share this id (the lowest index among them). Derived
    /// from the pair levels; `None` when some pair's PCIe path is unknown.
    pub pcie_switch: Option<usize>,
    /// Likewise for the PCIe root complex (host bridge): GPUs at most `PHB` apart.
    pub pcie_root: Option<usize>,
    /// GPUs that fail together share a fault domain (an id; by default the lowest index on the
    /// same board, so every GPU of a board-per-GPU machine is its own). Operators can regroup
    /// them with [`Topology::set_fault_domains`] (e.g. by power supply or baseboard).
    pub fault_domain: usize,
}

impl Gpu {
    /// A GPU known only by its index.
    pub fn new(index: usize) -> Gpu {
        Gpu {
            index,
            minor: None,
            uuid: None,
            pci_bus_id: None,
            memory: None,
            numa_node: None,
            cpu_affinity: None,
            pcie_switch: None,
            pcie_root: None,
            fault_domain: index,
        }
    }
}

/// The NVLinks between two GPUs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NvLink {
    /// Bonded links (`NV#`). Through NVSwitch: the links' worth of bandwidth every pair gets,
    /// the smaller of the two GPUs' switch link counts.
    pub links: u32,
    /// NVLink generation (1 = Pascal .. 5 = Blackwell), when known.
    pub generation: Option<u32>,
    /// The links go to NVSwitches, not to the peer.
    pub via_switch: bool,
}

/// How two GPUs are connected.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Link {
    pub nvlink: Option<NvLink>,
    /// The PCIe path; `None` when unknown (`topo -m` shows `NV#` instead of it).
    pub pcie: Option<PcieLevel>,
}

impl Link {
    pub fn pcie(level: PcieLevel) -> Link {
        Link {
            nvlink: None,
            pcie: Some(level),
        }
    }

    pub fn nvlink(links: u32, generation: Option<u32>, via_switch: bool) -> Link {
        Link {
            nvlink: Some(NvLink {
                links,
                generation,
                via_switch,
            }),
            pcie: None,
        }
    }

    /// Bandwidth per direction, GB/s: the NVLinks' ([`nvlink_gbps_per_link`] x links) when there
    /// are any (traffic between NVLink peers takes NVLink, not PCIe), otherwise
    /// `pcie_link_gbps` x [`PcieLevel::bandwidth_fraction`]. A link with neither is 0.
    pub fn bandwidth_gbps(&self, pcie_link_gbps: f64) -> f64 {
        match (self.nvlink, self.pcie) {
            (Some(nv), _) => nvlink_gbps_per_link(nv.generation) * nv.links as f64,
            (None, Some(level)) => pcie_link_gbps * level.bandwidth_fraction(),
            (None, None) => 0.0,
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub enum TopologyError {
    /// `gpus[i].index` is not `i`.
    Index { position: usize, index: usize },
    /// The link matrix is not n x n.
    Shape { gpus: usize, rows: usize },
    /// `links[a][b]` differs from `links[b][a]`.
    Asymmetric { a: usize, b: usize },
    /// A pair with neither NVLink nor a PCIe level.
    Unknown { a: usize, b: usize },
    /// An NVLink entry with 0 links.
    ZeroLinks { a: usize, b: usize },
    /// The PCIe link bandwidth is not a positive number.
    PcieBandwidth(f64),
    /// `set_fault_domains` got the wrong number of entries.
    FaultDomains { gpus: usize, given: usize },
    /// No such GPU.
    NoGpu(usize),
}

impl fmt::Display for TopologyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TopologyError::Index { position, index } => {
                write!(f, "GPU at position {position} says it is GPU{index}")
            }
            TopologyError::Shape { gpus, rows } => {
                write!(f, "{gpus} GPUs need a {gpus}x{gpus} link matrix, got {rows} rows (or a short row)")
            }
            TopologyError::Asymmetric { a, b } => {
                write!(f, "GPU{a}-GPU{b} and GPU{b}-GPU{a} disagree")
            }
            TopologyError::Unknown { a, b } => {
                write!(f, "GPU{a}-GPU{b}: neither NVLink nor a PCIe path")
            }
            TopologyError::ZeroLinks { a, b } => write!(f, "GPU{a}-GPU{b}: NVLink with 0 links"),
            TopologyError::PcieBandwidth(v) => {
                write!(f, "PCIe link bandwidth {v} GB/s is not a positive number")
            }
            TopologyError::FaultDomains { gpus, given } => {
                write!(f, "{given} fault domains given for {gpus} GPUs")
            }
            TopologyError::NoGpu(i) => write!(f, "no GPU{i}"),
        }
    }
}

impl std::error::Error for TopologyError {}

/// The GPUs of a node and the link between every pair.
#[derive(Clone, Debug, PartialEq)]
pub struct Topology {
    gpus: Vec<Gpu>,
    /// n x n, row-major, symmetric; the diagonal holds [`Topology::SELF_LINK`].
    links: Vec<Link>,
    pcie_link_gbps: f64,
}

impl Topology {
    /// What the diagonal holds.
    pub const SELF_LINK: Link = Link {
        nvlink: None,
        pcie: Some(PcieLevel::Internal),
    };

    /// Checks and stores a topology: `gpus[i].index == i`, `links` n x n and symmetric (the
    /// diagonal is ignored), every pair with NVLink or a PCIe level. Derives each GPU's
    /// `pcie_switch` and `pcie_root` from the levels (their given values are replaced).
    /// `pcie_link_gbps` is the GPUs' PCIe link bandwidth per direction (see
    /// [`DEFAULT_PCIE_LINK_GBPS`]).
    pub fn new(
        mut gpus: Vec<Gpu>,
        links: Vec<Vec<Link>>,
        pcie_link_gbps: f64,
    ) -> Result<Topology, TopologyError> {
        let n = gpus.len();
        for (position, g) in gpus.iter().enumerate() {
            if g.index != position {
                return Err(TopologyError::Index {
                    position,
                    index: g.index,
                });
            }
        }
        if links.len() != n || links.iter().any(|row| row.len() != n) {
            return Err(TopologyError::Shape {
                gpus: n,
                rows: links.len(),
            });
        }
        if !(pcie_link_gbps.is_finite() && pcie_link_gbps > 0.0) {
            return Err(TopologyError::PcieBandwidth(pcie_link_gbps));
        }
        let mut flat = Vec::with_capacity(n * n);
        for (a, row) in links.iter().enumerate() {
            for (b, link) in row.iter().enumerate() {
                if a == b {
                    flat.push(Topology::SELF_LINK);
                    continue;
                }
                if *link != links[b][a] {
                    return Err(TopologyError::Asymmetric { a, b });
                }
                match link.nvlink {
                    Some(nv) if nv.links == 0 => return Err(TopologyError::ZeroLinks { a, b }),
                    None if link.pcie.is_none() => return Err(TopologyError::Unknown { a, b }),
                    _ => {}
                }
                flat.push(*link);
            }
        }
        let level = |a: usize, b: usize| flat[a * n + b].pcie;
        let switch = classes(n, |a, b| level(a, b).map(|l| l <= PcieLevel::Single));
        let root = classes(n, |a, b| level(a, b).map(|l| l <= PcieLevel::HostBridge));
        for (i, g) in gpus.iter_mut().enumerate() {
            g.pcie_switch = switch[i];
            g.pcie_root = root[i];
        }
        Ok(Topology {
            gpus,
            links: flat,
            pcie_link_gbps,
        })
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

    pub fn gpu(&self, index: usize) -> Option<&Gpu> {
        self.gpus.get(index)
    }

    /// The link between two GPUs; `None` for an index out of range.
    pub fn link(&self, a: usize, b: usize) -> Option<&Link> {
        let n = self.gpus.len();
        if a < n && b < n {
            self.links.get(a * n + b)
        } else {
            None
        }
    }

    /// PCIe link bandwidth per direction, GB/s, that the PCIe levels are fractions of.
    pub fn pcie_link_gbps(&self) -> f64 {
        self.pcie_link_gbps
    }

    /// Pair bandwidth per direction, GB/s ([`Link::bandwidth_gbps`]); 0 for a GPU with itself
    /// or an index out of range.
    pub fn bandwidth_gbps(&self, a: usize, b: usize) -> f64 {
        if a == b {
            return 0.0;
        }
        self.link(a, b)
            .map_or(0.0, |l| l.bandwidth_gbps(self.pcie_link_gbps))
    }

    /// Replaces a GPU's memory figures (free memory changes as containers come and go).
    pub fn set_memory(&mut self, index: usize, memory: Memory) -> Result<(), TopologyError> {
        let g = self
            .gpus
            .get_mut(index)
            .ok_or(TopologyError::NoGpu(index))?;
        g.memory = Some(memory);
        Ok(())
    }

    /// Regroups the GPUs into fault domains: `domains[i]` is GPU i's domain id.
    pub fn set_fault_domains(&mut self, domains: &[usize]) -> Result<(), TopologyError> {
        if domains.len() != self.gpus.len() {
            return Err(TopologyError::FaultDomains {
                gpus: self.gpus.len(),
                given: domains.len(),
            });
        }
        for (g, d) in self.gpus.iter_mut().zip(domains) {
            g.fault_domain = *d;
        }
        Ok(())
    }

    /// The matrix as `nvidia-smi topo -m` prints it (GPU columns, CPU and NUMA affinity, the
    /// current legend), for diagnosis; [`super::parse_topo_matrix`] reads it back.
    pub fn to_topo_matrix(&self) -> String {
        use std::fmt::Write as _;
        let n = self.gpus.len();
        let mut out = String::from("\t");
        for i in 0..n {
            let _ = write!(out, "GPU{i}\t");
        }
        out.push_str("CPU Affinity\tNUMA Affinity\n");
        for a in 0..n {
            let _ = write!(out, "GPU{a}\t");
            for b in 0..n {
                let cell = if a == b {
                    " X ".to_string()
                } else {
                    let l = self.links[a * n + b];
                    match (l.nvlink, l.pcie) {
                        (Some(nv), _) => format!("NV{}", nv.links),
                        (None, Some(level)) => level.legend().to_string(),
                        (None, None) => "SYS".to_string(),
                    }
                };
                let _ = write!(out, "{cell}\t");
            }
            let g = &self.gpus[a];
            let cpus = g.cpu_affinity.as_deref().unwrap_or("N/A");
            let numa = g
                .numa_node
                .map_or_else(|| "N/A".to_string(), |x| x.to_string());
            let _ = writeln!(out, "{cpus}\t{numa}");
        }
        out.push_str(LEGEND);
        out
    }
}

const LEGEND: &str = "\nLegend:\n\n  X    = Self\n  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)\n  NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node\n  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)\n  PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)\n  PIX  = Connection traversing at most a single PCIe bridge\n  NV#  = Connection traversing a bonded set of # NVLinks\n";

/// Equivalence classes of "near" (`near(a, b)`: Some(true) near, Some(false) not, None
/// unknown), each named by its lowest member; a GPU with any unknown pair gets `None`.
fn classes(n: usize, near: impl Fn(usize, usize) -> Option<bool>) -> Vec<Option<usize>> {
    let mut parent: Vec<usize> = (0..n).collect();
    fn find(parent: &mut [usize], mut x: usize) -> usize {
        while parent[x] != x {
            parent[x] = parent[parent[x]];
            x = parent[x];
        }
        x
    }
    let mut complete = vec![true; n];
    for a in 0..n {
        for b in a + 1..n {
            match near(a, b) {
                Some(true) => {
                    let (ra, rb) = (find(&mut parent, a), find(&mut parent, b));
                    // Name each class by its lowest member.
                    parent[ra.max(rb)] = ra.min(rb);
                }
                Some(false) => {}
                None => {
                    complete[a] = false;
                    complete[b] = false;
                }
            }
        }
    }
    (0..n)
        .map(|i| complete[i].then(|| find(&mut parent, i)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pcie4() -> Topology {
        use PcieLevel::*;
        let m = [
            [Internal, Single, Multiple, System],
            [Single, Internal, Multiple, System],
            [Multiple, Multiple, Internal, System],
            [System, System, System, Internal],
        ];
        let links = m
            .iter()
            .map(|r| r.iter().map(|l| Link::pcie(*l)).collect())
            .collect();
        Topology::new((0..4).map(Gpu::new).collect(), links, 16.0).unwrap()
    }

    #[test]
    fn derives_switches_and_roots() {
        let t = pcie4();
        let sw: Vec<_> = t.gpus().iter().map(|g| g.pcie_switch).collect();
        let root: Vec<_> = t.gpus().iter().map(|g| g.pcie_root).collect();
        assert_eq!(sw, [Some(0), Some(0), Some(2), Some(3)]);
        assert_eq!(root, [Some(0), Some(0), Some(0), Some(3)]);
        assert_eq!(t.bandwidth_gbps(0, 1), 16.0);
        assert_eq!(t.bandwidth_gbps(0, 3), 16.0 * 0.4);
        assert_eq!(t.bandwidth_gbps(2, 2), 0.0);
    }

    #[test]
    fn unknown_pcie_paths_leave_switches_unknown() {
        let links = vec![
            vec![
                Topology::SELF_LINK,
                Link::nvlink(2, None, false),
                Link::pcie(PcieLevel::Single),
            ],
            vec![
                Link::nvlink(2, None, false),
                Topology::SELF_LINK,
                Link::pcie(PcieLevel::System),
            ],
            vec![
                Link::pcie(PcieLevel::Single),
                Link::pcie(PcieLevel::System),
                Topology::SELF_LINK,
            ],
        ];
        let t = Topology::new((0..3).map(Gpu::new).collect(), links, 16.0).unwrap();
        assert_eq!(t.gpus()[0].pcie_switch, None);
        assert_eq!(t.gpus()[1].pcie_switch, None);
        assert_eq!(t.gpus()[2].pcie_switch, Some(0));
        assert_eq!(t.bandwidth_gbps(0, 1), 50.0);
    }

    #[test]
    fn bad_matrices_are_refused() {
        let gpus = || (0..2).map(Gpu::new).collect::<Vec<_>>();
        let s = Topology::SELF_LINK;
        let e = Topology::new(gpus(), vec![vec![s, Link::pcie(PcieLevel::Single)]], 16.0);
        assert!(matches!(e, Err(TopologyError::Shape { .. })));
        let e = Topology::new(
            gpus(),
            vec![
                vec![s, Link::pcie(PcieLevel::Single)],
                vec![Link::pcie(PcieLevel::System), s],
            ],
            16.0,
        );
        assert_eq!(e, Err(TopologyError::Asymmetric { a: 0, b: 1 }));
        let none = Link {
            nvlink: None,
            pcie: None,
        };
        let e = Topology::new(gpus(), vec![vec![s, none], vec![none, s]], 16.0);
        assert_eq!(e, Err(TopologyError::Unknown { a: 0, b: 1 }));
        let z = Link::nvlink(0, None, false);
        let e = Topology::new(gpus(), vec![vec![s, z], vec![z, s]], 16.0);
        assert_eq!(e, Err(TopologyError::ZeroLinks { a: 0, b: 1 }));
        let ok = Link::pcie(PcieLevel::Single);
        let e = Topology::new(gpus(), vec![vec![s, ok], vec![ok, s]], f64::NAN);
        assert!(matches!(e, Err(TopologyError::PcieBandwidth(_))));
        let mut g = gpus();
        g[1].index = 5;
        let e = Topology::new(g, vec![vec![s, ok], vec![ok, s]], 16.0);
        assert_eq!(
            e,
            Err(TopologyError::Index {
                position: 1,
                index: 5
            })
        );
        assert!(e.unwrap_err().to_string().contains("GPU5"));
    }

    #[test]
    fn bandwidth_table() {
        assert_eq!(nvlink_gbps_per_link(Some(1)), 20.0);
        assert_eq!(nvlink_gbps_per_link(Some(2)), 25.0);
        assert_eq!(nvlink_gbps_per_link(Some(3)), 25.0);
        // Hopper: 18 links x 25 GB/s = 450 GB/s per direction (900 GB/s bidirectional).
        assert_eq!(nvlink_gbps_per_link(Some(4)) * 18.0, 450.0);
        assert_eq!(nvlink_gbps_per_link(Some(5)) * 18.0, 900.0);
        assert_eq!(nvlink_gbps_per_link(None), 25.0);
        assert!((pcie_x16_gbps(3) - DEFAULT_PCIE_LINK_GBPS).abs() < 0.01);
        assert!((pcie_x16_gbps(4) - 31.5).abs() < 0.01);
        // Strictly decreasing with distance, and a single NVLink beats any PCIe path.
        let fr: Vec<f64> = PcieLevel::ALL[1..]
            .iter()
            .map(|l| l.bandwidth_fraction())
            .collect();
        assert!(fr.windows(2).all(|w| w[0] > w[1]));
        assert!(nvlink_gbps_per_link(Some(1)) > DEFAULT_PCIE_LINK_GBPS);
    }
}
