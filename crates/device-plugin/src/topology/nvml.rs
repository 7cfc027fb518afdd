//! Discovery through NVML (nvml-wrapper): on a real driver or on the simulated
//! `libnvidia-ml.so.1`.
//!
//! Per GPU: index, device node minor number (`nvmlDeviceGetMinorNumber`: the N of
//! `/dev/nvidiaN`, not always the index), UUID, PCI bus id, memory, NUMA node (`nvmlDeviceGetNumaNodeId`), CPU
//! affinity, and the board it sits on (its fault domain). Per pair: the PCIe path
//! (`nvmlDeviceGetTopologyCommonAncestor`). Per NVLink of each GPU: whether it is up, its
//! version, and its remote end's PCI info. The remote end is a peer GPU when its bus id is one of
//! the GPUs'; otherwise it is an NVSwitch, unless its PCI device id is that of one of the GPUs
//! (a peer GPU this process cannot see, e.g. in a container given a subset: such links are
//! left out rather than mistaken for a switch). nvml-wrapper's `remote_device_type` is not used:
//! it always answers `Unknown` (it reads back a temporary).
//!
//! Pairs: direct NVLinks are counted from both ends and the smaller count is kept (a link down
//! at one end carries nothing). GPUs without direct links whose NVLinks both reach switches
//! get the smaller of their two switch link counts, `via_switch` (one switch fabric per node,
//! as on DGX/HGX boxes). A pair whose PCIe path NVML cannot tell and that has no NVLink is
//! taken to be `SYS` (the farthest); no other fact is guessed.

use super::model::{
    pcie_lane_gbps, Gpu, Link, Memory, PcieLevel, Topology, TopologyError, DEFAULT_PCIE_LINK_GBPS,
};
use nvml_wrapper::enum_wrappers::device::TopologyLevel;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::{Device, Nvml};
use std::fmt;

/// NVML_NVLINK_MAX_LINKS.
const MAX_LINKS: u32 = 18;
/// Words of 64 CPUs asked for when reading CPU affinity (up to 1024 CPUs).
const CPU_WORDS: usize = 16;

#[derive(Debug)]
pub enum DiscoverError {
    /// An NVML call every discovery needs failed.
    Nvml { what: String, source: NvmlError },
    /// NVML's answers do not form a valid topology.
    Topology(TopologyError),
}

impl fmt::Display for DiscoverError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DiscoverError::Nvml { what, source } => write!(f, "NVML: {what}: {source}"),
            DiscoverError::Topology(e) => write!(f, "NVML topology: {e}"),
        }
    }
}

impl std::error::Error for DiscoverError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            DiscoverError::Nvml { source, .. } => Some(source),
            DiscoverError::Topology(e) => Some(e),
        }
    }
}

fn nvml_err(what: impl Into<String>) -> impl FnOnce(NvmlError) -> DiscoverError {
    let what = what.into();
    move |source| DiscoverError::Nvml { what, source }
}

/// A PCI bus id in NVML's canonical form `dddddddd:bb:dd.f`, lower case, from either NVML's or
/// CUDA's (`dddd:bb:dd.f`) form; `None` when it is neither.
pub fn normalize_bus_id(id: &str) -> Option<String> {
    let id = id.trim().trim_end_matches('\0');
    let (domain, rest) = id.split_once(':')?;
    let (bus, rest) = rest.split_once(':')?;
    let (device, function) = rest.split_once('.')?;
    let hex = |s: &str| u32::from_str_radix(s, 16).ok();
    Some(format!(
        "{:08x}:{:02x}:{:02x}.{:x}",
        hex(domain)?,
        hex(bus)?,
        hex(device)?,
        hex(function)?
    ))
}

/// NVLink generation from an `nvmlNvlinkVersion_t` (1 = 1.0, 2 = 2.0, 3 = 2.2, 4 = 3.0,
/// 5 = 3.1, 6 = 4.0, 7 = 5.0); `None` for anything else.
pub fn nvlink_generation(version: u32) -> Option<u32> {
    Some(match version {
        1 => 1,
        2 | 3 => 2,
        4 | 5 => 3,
        6 => 4,
        7 => 5,
        _ => return None,
    })
}

/// A CPU bit mask (one `c_ulong`, 64 CPUs, per word on 64-bit Linux) as nvidia-smi prints it:
/// `0-19,40-59`.
pub fn cpu_list<W: Copy + Into<u64>>(words: &[W]) -> Option<String> {
    let bits = std::mem::size_of::<W>() * 8;
    let mut ranges: Vec<(usize, usize)> = Vec::new();
    for (w, word) in words.iter().enumerate() {
        let word: u64 = (*word).into();
        for bit in 0..bits {
            if word & (1u64 << bit) == 0 {
                continue;
            }
            let cpu = w * bits + bit;
            match ranges.last_mut() {
                Some((_, end)) if *end + 1 == cpu => *end = cpu,
                _ => ranges.push((cpu, cpu)),
            }
        }
    }
    if ranges.is_empty() {
        return None;
    }
    let parts: Vec<String> = ranges
        .iter()
        .map(|&(a, b)| {
            if a == b {
                a.to_string()
            } else {
                format!("{a}-{b}")
            }
        })
        .collect();
    Some(parts.join(","))
}

fn level(l: TopologyLevel) -> PcieLevel {
    match l {
        TopologyLevel::Internal => PcieLevel::Internal,
        TopologyLevel::Single => PcieLevel::Single,
        TopologyLevel::Multiple => PcieLevel::Multiple,
        TopologyLevel::HostBridge => PcieLevel::HostBridge,
        TopologyLevel::Node => PcieLevel::Node,
        TopologyLevel::System => PcieLevel::System,
    }
}

/// What one GPU's NVLinks reach.
#[derive(Default)]
struct Links {
    /// Active links to each peer GPU.
    to_gpu: Vec<u32>,
    /// Active links to NVSwitches.
    to_switch: u32,
    generation: Option<u32>,
}

fn nvlinks(dev: &Device, bus_ids: &[Option<String>], device_ids: &[u32]) -> Links {
    let mut out = Links {
        to_gpu: vec![0; bus_ids.len()],
        ..Links::default()
    };
    for l in 0..MAX_LINKS {
        let link = dev.link_wrapper_for(l);
        match link.is_active() {
            Ok(true) => {}
            // A link that is down carries nothing.
            Ok(false) => continue,
            // No NVLink on this device at all.
            Err(NvmlError::NotSupported) => break,
            // Past the device's links, or a link NVML will not describe.
            Err(_) => continue,
        }
        let Ok(remote) = link.remote_pci_info() else {
            continue;
        };
        let remote_bus = normalize_bus_id(&remote.bus_id);
        if let Some(peer) = bus_ids.iter().position(|b| b.is_some() && *b == remote_bus) {
            out.to_gpu[peer] += 1;
        } else if !device_ids.contains(&remote.pci_device_id) {
            out.to_switch += 1;
        }
        if out.generation.is_none() {
            out.generation = link.version().ok().and_then(nvlink_generation);
        }
    }
    out
}

/// Discovers the node's GPUs and their wiring through NVML (see the module docs).
pub fn discover(nvml: &Nvml) -> Result<Topology, DiscoverError> {
    let count = nvml.device_count().map_err(nvml_err("device count"))?;
    let devices: Vec<Device> = (0..count)
        .map(|i| {
            nvml.device_by_index(i)
                .map_err(nvml_err(format!("device {i}")))
        })
        .collect::<Result<_, _>>()?;
    let n = devices.len();

    let mut gpus = Vec::with_capacity(n);
    let mut bus_ids = Vec::with_capacity(n);
    let mut device_ids = Vec::with_capacity(n);
    for (i, dev) in devices.iter().enumerate() {
        let uuid = dev.uuid().map_err(nvml_err(format!("GPU{i} UUID")))?;
        let pci = dev
            .pci_info()
            .map_err(nvml_err(format!("GPU{i} PCI info")))?;
        let bus_id = normalize_bus_id(&pci.bus_id);
        bus_ids.push(bus_id.clone());
        device_ids.push(pci.pci_device_id);
        let memory = dev.memory_info().ok().map(|m| Memory {
            total: m.total,
            free: m.free,
        });
        let cpu_affinity = dev.cpu_affinity(CPU_WORDS).ok().and_then(|w| cpu_list(&w));
        gpus.push(Gpu {
            // Unknown (e.g. NVML_ERROR_NOT_SUPPORTED on WSL, where there is no /dev/nvidiaN)
            // is left unknown; the inventory then falls back to the index.
            minor: dev.minor_number().ok(),
            uuid: Some(uuid),
            pci_bus_id: bus_id,
            memory,
            numa_node: dev.numa_node_id().ok(),
            cpu_affinity,
            ..Gpu::new(i)
        });
    }

    // PCIe paths, and boards (same board: NVML_TOPOLOGY_INTERNAL or nvmlDeviceOnSameBoard).
    let mut pcie = vec![vec![None; n]; n];
    for a in 0..n {
        for b in a + 1..n {
            let l = nvml
                .topology_common_ancestor(&devices[a], &devices[b])
                .ok()
                .map(level);
            pcie[a][b] = l;
            pcie[b][a] = l;
            let same_board = l == Some(PcieLevel::Internal)
                || devices[a].is_on_same_board_as(&devices[b]).unwrap_or(false);
            if same_board {
                let d = gpus[a].fault_domain.min(gpus[b].fault_domain);
                gpus[b].fault_domain = d;
                gpus[a].fault_domain = d;
            }
        }
    }

    let links: Vec<Links> = devices
        .iter()
        .map(|d| nvlinks(d, &bus_ids, &device_ids))
        .collect();
    let matrix: Vec<Vec<Link>> = (0..n)
        .map(|a| {
            (0..n)
                .map(|b| {
                    if a == b {
                        return Topology::SELF_LINK;
                    }
                    let (x, y) = (&links[a], &links[b]);
                    let generation = match (x.generation, y.generation) {
                        (Some(p), Some(q)) => Some(p.min(q)),
                        (p, q) => p.or(q),
                    };
                    let direct = x.to_gpu[b].min(y.to_gpu[a]);
                    let mut link = if direct > 0 {
                        Link::nvlink(direct, generation, false)
                    } else if x.to_switch > 0 && y.to_switch > 0 {
                        Link::nvlink(x.to_switch.min(y.to_switch), generation, true)
                    } else {
                        Link::pcie(PcieLevel::System)
                    };
                    link.pcie = pcie[a][b].or(if link.nvlink.is_some() {
                        None
                    } else {
                        Some(PcieLevel::System)
                    });
                    link
                })
                .collect()
        })
        .collect();

    // The PCIe links' bandwidth: the slowest GPU's maximum generation and width.
    let pcie_gbps = devices
        .iter()
        .map(|d| match (d.max_pcie_link_gen(), d.max_pcie_link_width()) {
            (Ok(generation), Ok(width)) if width > 0 => {
                Some(pcie_lane_gbps(generation) * width as f64)
            }
            _ => None,
        })
        .collect::<Option<Vec<f64>>>()
        .and_then(|v| v.into_iter().reduce(f64::min))
        .unwrap_or(DEFAULT_PCIE_LINK_GBPS);

    Topology::new(gpus, matrix, pcie_gbps).map_err(DiscoverError::Topology)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bus_ids() {
        assert_eq!(
            normalize_bus_id("00000000:07:00.0").as_deref(),
            Some("00000000:07:00.0")
        );
        assert_eq!(
            normalize_bus_id("0000:C4:00.0").as_deref(),
            Some("00000000:c4:00.0")
        );
        assert_eq!(normalize_bus_id("garbage"), None);
        assert_eq!(normalize_bus_id("0000:zz:00.0"), None);
    }

    #[test]
    fn versions_to_generations() {
        assert_eq!(nvlink_generation(2), Some(2));
        assert_eq!(nvlink_generation(5), Some(3)); // A100 reports NVML_NVLINK_VERSION_3_1
        assert_eq!(nvlink_generation(6), Some(4));
        assert_eq!(nvlink_generation(0), None);
    }

    #[test]
    fn cpu_lists() {
        assert_eq!(cpu_list(&[0xffffu64]).as_deref(), Some("0-15"));
        assert_eq!(cpu_list(&[0u32, 1]).as_deref(), Some("32"));
        assert_eq!(cpu_list(&[0xffff_0000u64]).as_deref(), Some("16-31"));
        let dgx1 = [(0xf_ffffu64) | (0xf_ffff << 40), 0];
        assert_eq!(cpu_list(&dgx1).as_deref(), Some("0-19,40-59"));
        assert_eq!(cpu_list(&[1u64 << 63, 1]).as_deref(), Some("63-64"));
        assert_eq!(cpu_list(&[0b101u64]).as_deref(), Some("0,2"));
        assert_eq!(cpu_list(&[0u64, 0]), None);
    }
}
