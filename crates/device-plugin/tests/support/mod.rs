//! Shared by the topology tests: a simulator model as the [`Topology`] NVML should report, and
//! what of it `nvidia-smi topo -m` text can show.
#![allow(dead_code)]

pub mod cdi;
pub mod kubelet;
pub mod pods;

use cuvisor_device_plugin::topology::model::{pcie_lane_gbps, DEFAULT_PCIE_LINK_GBPS};
use cuvisor_device_plugin::topology::{Gpu, Link, Memory, NvLink, PcieLevel, Topology};
use cuvisor_sim::model::{self, Model};

/// The topology the simulator's NVML should describe for `m`, fresh state (nothing allocated).
pub fn from_model(m: &Model) -> Topology {
    let n = m.devices.len();
    let gpus = m
        .devices
        .iter()
        .enumerate()
        .map(|(i, d)| Gpu {
            minor: Some(d.minor),
            uuid: Some(d.uuid.clone()),
            pci_bus_id: Some(d.pci_bus_id_nvml()),
            memory: Some(Memory {
                total: d.memory,
                free: d.memory,
            }),
            numa_node: Some(d.numa_node),
            cpu_affinity: Some(model::cpu_affinity(d.numa_node)),
            ..Gpu::new(i)
        })
        .collect();
    let links = (0..n)
        .map(|a| {
            (0..n)
                .map(|b| {
                    let level = PcieLevel::from_nvml(m.pcie_level(a, b) as u32)
                        .expect("the simulator's levels are NVML's");
                    let links = m.nvlink_bandwidth_links(a, b);
                    Link {
                        nvlink: (a != b && links > 0).then(|| NvLink {
                            links,
                            generation: Some(m.devices[a].nvlink_version),
                            via_switch: m.direct_links(a, b) == 0,
                        }),
                        pcie: Some(level),
                    }
                })
                .collect()
        })
        .collect();
    // The slowest GPU's x16 link, as the plugin reads it from NVML (the simulator answers each
    // GPU's generation from the model: `Device::pcie_generation`).
    let pcie = m
        .devices
        .iter()
        .map(|d| pcie_lane_gbps(d.pcie_generation()) * 16.0)
        .reduce(f64::min)
        .unwrap_or(DEFAULT_PCIE_LINK_GBPS);
    Topology::new(gpus, links, pcie).expect("a valid model")
}

/// `t` less what `nvidia-smi topo -m` cannot show: identities (UUID, bus id, minor), memory, NVLink generations, and
/// the PCIe path of NVLink pairs (and so the PCIe switch/root groups of their GPUs).
pub fn as_text_sees(t: &Topology) -> Topology {
    let n = t.len();
    let gpus = t
        .gpus()
        .iter()
        .map(|g| Gpu {
            numa_node: g.numa_node,
            cpu_affinity: g.cpu_affinity.clone(),
            fault_domain: g.fault_domain,
            ..Gpu::new(g.index)
        })
        .collect();
    let links = (0..n)
        .map(|a| {
            (0..n)
                .map(|b| {
                    let l = *t.link(a, b).expect("in range");
                    match l.nvlink {
                        Some(nv) if a != b => Link::nvlink(nv.links, None, nv.via_switch),
                        _ => l,
                    }
                })
                .collect()
        })
        .collect();
    Topology::new(gpus, links, DEFAULT_PCIE_LINK_GBPS).expect("a valid topology")
}

pub fn fixture(name: &str) -> String {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}
