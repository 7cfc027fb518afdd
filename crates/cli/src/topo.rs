//! `cuvisor smi topo -m`: the matrix `nvidia-smi topo -m` prints, from NVML queries only.
//!
//! Per pair of GPUs the cell is `NV#` when NVLinks join them, else the PCIe level of their common
//! ancestor (`nvmlDeviceGetTopologyCommonAncestor`). NVLinks are counted from each GPU's active
//! links and the PCI address of each link's far end (`nvmlDeviceGetNvLinkRemotePciInfo_v2`):
//! - a far end that is another GPU is a direct link to it;
//! - a far end that is no GPU is an NVSwitch (on NVSwitch systems NVML never names a peer GPU), and
//!   every GPU reaches every other through the switches with the smaller of the two GPUs' switch
//!   link counts: a DGX A100 shows NV12 everywhere, as nvidia-smi does.
//!
//! A link that is down does not count, so taking one down (`cuvisor sim fault nvlink-down`) shows
//! in the matrix.

use crate::args::{Target, TopoArgs};
use crate::machine;
use crate::{Failure, Result};
use nvml_wrapper::enum_wrappers::device::TopologyLevel;
use nvml_wrapper::{Device, Nvml};
use std::ffi::c_ulong;

/// NVML_NVLINK_MAX_LINKS.
const MAX_LINKS: u32 = 18;
/// cpuSet words asked for: 64 * 16 = 1024 CPUs.
const CPU_SET_WORDS: usize = 16;

/// The far end of one active NVLink.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkEnd {
    Gpu(usize),
    /// Not a GPU of this machine: an NVSwitch.
    Switch,
}

/// What NVML says about the machine's topology; [`render`] draws the matrix from it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Facts {
    /// Legend of the PCIe common ancestor of each pair ("X" on the diagonal, "N/A" if NVML failed).
    pub pcie: Vec<Vec<&'static str>>,
    /// The far ends of each GPU's active NVLinks.
    pub links: Vec<Vec<LinkEnd>>,
    pub cpu_affinity: Vec<Option<String>>,
    pub numa_node: Vec<Option<u32>>,
}

impl Facts {
    /// NVLinks' worth of bandwidth between two GPUs (0 = none).
    pub fn nvlinks(&self, a: usize, b: usize) -> usize {
        let direct = self.links[a]
            .iter()
            .filter(|&&e| e == LinkEnd::Gpu(b))
            .count();
        if direct > 0 {
            return direct;
        }
        let switch = |g: usize| {
            self.links[g]
                .iter()
                .filter(|&&e| e == LinkEnd::Switch)
                .count()
        };
        switch(a).min(switch(b))
    }
}

pub fn run(target: &Target, _args: &TopoArgs) -> Result<String> {
    // `-m` is the only mode, so it may be left out.
    let opened = machine::open_nvml(target)?;
    Ok(render(&gather(&opened.nvml)?))
}

pub fn legend(level: TopologyLevel) -> &'static str {
    match level {
        TopologyLevel::Internal => "X",
        TopologyLevel::Single => "PIX",
        TopologyLevel::Multiple => "PXB",
        TopologyLevel::HostBridge => "PHB",
        TopologyLevel::Node => "NODE",
        TopologyLevel::System => "SYS",
    }
}

fn device(nvml: &Nvml, i: usize) -> Result<Device<'_>> {
    nvml.device_by_index(i as u32)
        .map_err(|e| Failure::Runtime(format!("NVML: GPU {i}: {e}")))
}

/// Asks NVML for the topology of every pair of GPUs and every NVLink.
pub fn gather(nvml: &Nvml) -> Result<Facts> {
    let n = nvml
        .device_count()
        .map_err(|e| Failure::Runtime(format!("NVML: device count: {e}")))? as usize;
    let mut facts = Facts::default();
    let mut addresses = Vec::with_capacity(n);
    for i in 0..n {
        let pci = device(nvml, i)?
            .pci_info()
            .map_err(|e| Failure::Runtime(format!("NVML: GPU {i}: PCI info: {e}")))?;
        addresses.push((pci.domain, pci.bus, pci.device));
    }
    for a in 0..n {
        let dev = device(nvml, a)?;
        let mut row = Vec::with_capacity(n);
        for b in 0..n {
            row.push(if a == b {
                "X"
            } else {
                dev.topology_common_ancestor(device(nvml, b)?)
                    .map_or("N/A", legend)
            });
        }
        facts.pcie.push(row);
        let mut links = Vec::new();
        for l in 0..MAX_LINKS {
            let link = dev.link_wrapper_for(l);
            // Links past the device's count, and links that are down, do not count.
            if !matches!(link.is_active(), Ok(true)) {
                continue;
            }
            let Ok(remote) = link.remote_pci_info() else {
                continue;
            };
            let far = (remote.domain, remote.bus, remote.device);
            links.push(match addresses.iter().position(|&x| x == far) {
                Some(g) => LinkEnd::Gpu(g),
                None => LinkEnd::Switch,
            });
        }
        facts.links.push(links);
        facts.cpu_affinity.push(
            dev.cpu_affinity(CPU_SET_WORDS)
                .ok()
                .map(|words| cpu_ranges(&words))
                .filter(|s| !s.is_empty()),
        );
        facts.numa_node.push(dev.numa_node_id().ok());
    }
    Ok(facts)
}

/// A CPU set as NVML gives it (bit i of word i / BITS = CPU i) written as `nvidia-smi` writes it:
/// "0-15,32-47".
pub fn cpu_ranges(words: &[c_ulong]) -> String {
    let bits = c_ulong::BITS as usize;
    let mut ranges: Vec<(usize, usize)> = Vec::new();
    for (w, &word) in words.iter().enumerate() {
        for bit in 0..bits {
            if word >> bit & 1 == 0 {
                continue;
            }
            let cpu = w * bits + bit;
            match ranges.last_mut() {
                Some((_, end)) if *end + 1 == cpu => *end = cpu,
                _ => ranges.push((cpu, cpu)),
            }
        }
    }
    ranges
        .iter()
        .map(|&(a, b)| {
            if a == b {
                a.to_string()
            } else {
                format!("{a}-{b}")
            }
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// Draws the matrix: tab-separated cells, then the legend, as `nvidia-smi topo -m`.
pub fn render(f: &Facts) -> String {
    cuvisor_sim::model::render_topo_matrix(
        f.pcie.len(),
        |a, b| match f.nvlinks(a, b) {
            0 => f.pcie[a][b].to_string(),
            links => format!("NV{links}"),
        },
        |a| {
            let cpus = f.cpu_affinity[a]
                .clone()
                .unwrap_or_else(|| "N/A".to_string());
            let numa = f.numa_node[a].map_or_else(|| "N/A".to_string(), |x| x.to_string());
            (cpus, numa)
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use cuvisor_sim::model::{self, LinkPeer, Model, PcieLevel, PRESETS};

    /// The facts NVML would report for a model, derived from the model directly.
    fn facts_of(m: &Model) -> Facts {
        let n = m.devices.len();
        let level = |a, b| match m.pcie_level(a, b) {
            PcieLevel::Internal => TopologyLevel::Internal,
            PcieLevel::Single => TopologyLevel::Single,
            PcieLevel::Multiple => TopologyLevel::Multiple,
            PcieLevel::HostBridge => TopologyLevel::HostBridge,
            PcieLevel::Node => TopologyLevel::Node,
            PcieLevel::System => TopologyLevel::System,
        };
        Facts {
            pcie: (0..n)
                .map(|a| (0..n).map(|b| legend(level(a, b))).collect())
                .collect(),
            links: m
                .devices
                .iter()
                .map(|d| {
                    d.links
                        .iter()
                        .map(|p| match p {
                            LinkPeer::Gpu(g) => LinkEnd::Gpu(*g),
                            LinkPeer::Switch(_) => LinkEnd::Switch,
                        })
                        .collect()
                })
                .collect(),
            cpu_affinity: m
                .devices
                .iter()
                .map(|d| Some(cpu_ranges(&[model::cpu_set(d.numa_node)])))
                .collect(),
            numa_node: m.devices.iter().map(|d| Some(d.numa_node)).collect(),
        }
    }

    #[test]
    fn renders_like_the_reference_for_every_preset() {
        for p in PRESETS {
            let m = model::preset(p).unwrap();
            assert_eq!(render(&facts_of(&m)), m.topo_matrix(), "preset {p}");
        }
    }

    #[test]
    fn a_link_down_lowers_the_count() {
        let m = model::preset("dgx1-v100").unwrap();
        let mut f = facts_of(&m);
        assert_eq!(f.nvlinks(0, 3), 2);
        for (a, b) in [(0, 3), (3, 0)] {
            let i = f.links[a]
                .iter()
                .position(|&e| e == LinkEnd::Gpu(b))
                .unwrap();
            f.links[a].remove(i);
        }
        assert_eq!(f.nvlinks(0, 3), 1);
        assert_eq!(f.nvlinks(3, 0), 1);
        f.links[0].clear();
        let row0: Vec<String> = render(&f)
            .lines()
            .nth(1)
            .unwrap()
            .split('\t')
            .map(String::from)
            .collect();
        assert_eq!(
            row0[1..9],
            ["X", "PIX", "NODE", "NODE", "SYS", "SYS", "SYS", "SYS"]
        );
    }

    #[test]
    fn switch_links_bond_every_pair() {
        let m = model::preset("dgx-a100").unwrap();
        let mut f = facts_of(&m);
        assert_eq!(f.nvlinks(0, 7), 12);
        f.links[7].truncate(10);
        assert_eq!(f.nvlinks(0, 7), 10);
        assert_eq!(f.nvlinks(0, 1), 12);
    }

    #[test]
    fn cpu_sets() {
        assert_eq!(cpu_ranges(&[0xffff]), "0-15");
        assert_eq!(cpu_ranges(&[0xffff_0000]), "16-31");
        assert_eq!(cpu_ranges(&[1 << 63, 1]), "63-64");
        assert_eq!(
            cpu_ranges(&[0b1011, 0xffff_0000_0000_0000]),
            "0-1,3,112-127"
        );
        assert_eq!(cpu_ranges(&[0, 0]), "");
    }
}
