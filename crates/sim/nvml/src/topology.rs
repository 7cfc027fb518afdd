//! Where devices sit: PCIe distance, CPU and NUMA affinity, and NVLinks.

use crate::device::{dev, handle, parse_bus_id, pci_info};
use crate::{export, read, sim, write, write_array, Res};
use cuvisor_cuda_abi::nvml::*;
use cuvisor_fabric::{End, Fabric, RouteKind};
use cuvisor_sim::model::LinkPeer;
use cuvisor_sim::Sim;
use std::ffi::{c_int, c_uint, c_ulong};
use std::sync::atomic::Ordering;

/// CPUs per simulated NUMA node (see `cuvisor_sim::model::cpu_affinity`).
const CPUS_PER_NODE: u32 = 16;

export! {
    /// The model's PCIe/CPU distance; a device with itself is NVML_TOPOLOGY_INTERNAL.
    fn nvmlDeviceGetTopologyCommonAncestor(
        device1: nvmlDevice_t,
        device2: nvmlDevice_t,
        path: *mut nvmlGpuTopologyLevel_t,
    ) {
        let (sim, a) = dev(device1)?;
        let (_, b) = dev(device2)?;
        write(path, sim.model.pcie_level(a, b) as nvmlGpuTopologyLevel_t)
    }

    /// The other GPUs no farther than `level`. Count protocol as documented: `*count` 0 asks for
    /// the number (NVML_SUCCESS); otherwise up to `*count` handles are written and `*count` says
    /// how many. (The docs say "GPUs found at level"; whether closer GPUs are included is not
    /// stated; they are here, as a caller looking for "nearest" ones expects.)
    fn nvmlDeviceGetTopologyNearestGpus(
        device: nvmlDevice_t,
        level: nvmlGpuTopologyLevel_t,
        count: *mut c_uint,
        devices: *mut nvmlDevice_t,
    ) {
        let (sim, d) = dev(device)?;
        if !VALID_LEVELS.contains(&level) {
            return Err(ret::ERROR_INVALID_ARGUMENT);
        }
        let found: Vec<usize> = (0..sim.model.devices.len())
            .filter(|&o| o != d && sim.model.pcie_level(d, o) as c_uint <= level)
            .collect();
        counted_handles(count, devices, &found)
    }

    /// The GPUs whose NUMA node holds CPU `cpu`; same count protocol as above.
    fn nvmlSystemGetTopologyGpuSet(cpu: c_uint, count: *mut c_uint, devices: *mut nvmlDevice_t) {
        let sim = sim()?;
        let found: Vec<usize> = (0..sim.model.devices.len())
            .filter(|&o| sim.model.devices[o].numa_node == cpu / CPUS_PER_NODE)
            .collect();
        counted_handles(count, devices, &found)
    }

    /// The CPUs of the device's NUMA node as a bitmap of `size` words (64 CPUs per word).
    fn nvmlDeviceGetCpuAffinity(device: nvmlDevice_t, size: c_uint, cpu_set: *mut c_ulong) {
        let (sim, d) = dev(device)?;
        cpu_bitmap(sim, d, size, cpu_set)
    }

    /// Node and socket scope are the same here: one NUMA node per socket.
    /// NVML binds threads only through nvmlDeviceSetCpuAffinity, which the simulator does not
    /// model: there is no binding of NVML's to clear, and the thread's affinity stays as it is.
    fn nvmlDeviceClearCpuAffinity(device: nvmlDevice_t) {
        dev(device)?;
        Ok(())
    }

    fn nvmlDeviceGetCpuAffinityWithinScope(
        device: nvmlDevice_t,
        size: c_uint,
        cpu_set: *mut c_ulong,
        scope: nvmlAffinityScope_t,
    ) {
        let (sim, d) = dev(device)?;
        check_scope(scope)?;
        cpu_bitmap(sim, d, size, cpu_set)
    }

    fn nvmlDeviceGetMemoryAffinity(
        device: nvmlDevice_t,
        size: c_uint,
        node_set: *mut c_ulong,
        scope: nvmlAffinityScope_t,
    ) {
        let (sim, d) = dev(device)?;
        check_scope(scope)?;
        let node = sim.model.devices[d].numa_node;
        bitmap(size, node_set, node..node.saturating_add(1))
    }

    fn nvmlDeviceGetNumaNodeId(device: nvmlDevice_t, node: *mut c_uint) {
        let (sim, d) = dev(device)?;
        write(node, sim.model.devices[d].numa_node)
    }

    /// Every simulated GPU is its own board.
    fn nvmlDeviceOnSameBoard(device1: nvmlDevice_t, device2: nvmlDevice_t, same: *mut c_int) {
        let (_, a) = dev(device1)?;
        let (_, b) = dev(device2)?;
        write(same, (a == b) as c_int)
    }

    /// NVML_FEATURE_DISABLED for a link taken down by fault injection (its bit in the device's
    /// `nvlink_down`), NVML_FEATURE_ENABLED otherwise. See [`link`] for the errors.
    fn nvmlDeviceGetNvLinkState(device: nvmlDevice_t, l: c_uint, is_active: *mut nvmlEnableState_t) {
        let (sim, d, _) = link(device, l)?;
        let down = sim.shared.device(d).nvlink_down.load(Ordering::Acquire) & (1u64 << l) != 0;
        write(is_active, if down { NVML_FEATURE_DISABLED } else { NVML_FEATURE_ENABLED })
    }

    /// An `nvmlNvlinkVersion_t`, not the NVLink generation: V100 reports NVML_NVLINK_VERSION_2_0
    /// (2); an A100 reports 5 (NVML_NVLINK_VERSION_3_1) on real drivers (hwloc issue #658, where
    /// NVIDIA's docs were corrected to call the value an enum).
    fn nvmlDeviceGetNvLinkVersion(device: nvmlDevice_t, l: c_uint, version: *mut c_uint) {
        let (sim, d, _) = link(device, l)?;
        let v = match sim.model.devices[d].nvlink_version {
            1 => nvlink_version::V1_0,
            2 => nvlink_version::V2_0,
            3 => nvlink_version::V3_1,
            4 => nvlink_version::V4_0,
            5 => nvlink_version::V5_0,
            _ => nvlink_version::INVALID,
        };
        write(version, v)
    }

    /// Answers for every link index below NVML_NVLINK_MAX_LINKS on an NVLink device (links the
    /// device does not have answer 0, NVML_NVLINK_CAP_VALID included), as real drivers do
    /// (TensorRT-LLM PR #19210: "the capability query answers for every index within it").
    fn nvmlDeviceGetNvLinkCapability(
        device: nvmlDevice_t,
        l: c_uint,
        cap: nvmlNvLinkCapability_t,
        result: *mut c_uint,
    ) {
        let (sim, d) = dev(device)?;
        let links = &sim.model.devices[d].links;
        if links.is_empty() {
            return Err(ret::ERROR_NOT_SUPPORTED);
        }
        if l >= NVML_NVLINK_MAX_LINKS || cap >= nvlink_cap::COUNT {
            return Err(ret::ERROR_INVALID_ARGUMENT);
        }
        let present = (l as usize) < links.len();
        let yes = match cap {
            nvlink_cap::P2P_SUPPORTED | nvlink_cap::P2P_ATOMICS | nvlink_cap::VALID => present,
            nvlink_cap::SYSMEM_ACCESS => present,
            // System-memory atomics over NVLink exist only with IBM POWER CPUs; no SLI bridges.
            _ => false,
        };
        write(result, yes as c_uint)
    }

    /// The peer GPU's PCI info, or on NVSwitch systems the switch's (NVML reports the switch, not
    /// a GPU, as the remote end). `pciSubSystemId` is documented as not filled; it is 0.
    fn nvmlDeviceGetNvLinkRemotePciInfo_v2(device: nvmlDevice_t, l: c_uint, pci: *mut nvmlPciInfo_t) {
        let (sim, _, peer) = link(device, l)?;
        let info = match peer {
            LinkPeer::Gpu(g) => {
                let p = &sim.model.devices[*g];
                pci_info(p.pci_domain, p.pci_bus, p.pci_device, p.pci_device_id)
            }
            LinkPeer::Switch(s) => {
                let sw = sim.model.nvswitches.get(*s).ok_or(ret::ERROR_UNKNOWN)?;
                let (domain, bus, device) = parse_bus_id(&sw.pci_bus_id).ok_or(ret::ERROR_UNKNOWN)?;
                pci_info(domain, bus, device, sw.pci_device_id)
            }
        };
        write(pci, info)
    }

    /// See [`p2p`]. NVML_ERROR_INVALID_ARGUMENT for an index past NVML_P2P_CAPS_INDEX_PCI
    /// (including NVML_P2P_CAPS_INDEX_UNKNOWN), a NULL `status`, or a device paired with itself (a
    /// device is not its own peer: the simulated cuDeviceCanAccessPeer answers 0 for it, and
    /// nvidia-smi prints "X" there without asking).
    fn nvmlDeviceGetP2PStatus(
        device1: nvmlDevice_t,
        device2: nvmlDevice_t,
        index: c_uint,
        status: *mut c_uint,
    ) {
        let (sim, a) = dev(device1)?;
        let (_, b) = dev(device2)?;
        if a == b {
            return Err(ret::ERROR_INVALID_ARGUMENT);
        }
        let s = p2p(&sim.fabric, a, b, index).ok_or(ret::ERROR_INVALID_ARGUMENT)?;
        write(status, s)
    }

    fn nvmlDeviceGetNvLinkRemoteDeviceType(
        device: nvmlDevice_t,
        l: c_uint,
        kind: *mut nvmlIntNvLinkDeviceType_t,
    ) {
        let (_, _, peer) = link(device, l)?;
        write(kind, match peer {
            LinkPeer::Gpu(_) => nvlink_device::GPU,
            LinkPeer::Switch(_) => nvlink_device::SWITCH,
        })
    }
}

/// `nvmlGpuP2PCapsIndex_t`.
pub mod p2p_caps {
    pub const READ: u32 = 0;
    pub const WRITE: u32 = 1;
    pub const NVLINK: u32 = 2;
    pub const ATOMICS: u32 = 3;
    /// NVML_P2P_CAPS_INDEX_PCI (formerly _PROP).
    pub const PCI: u32 = 4;
}

/// `nvmlGpuP2PStatus_t`.
pub mod p2p_status {
    pub const OK: u32 = 0;
    pub const CHIPSET_NOT_SUPPORTED: u32 = 1;
    pub const NOT_SUPPORTED: u32 = 5;
}

/// What `nvmlDeviceGetP2PStatus` answers for two distinct GPUs, from the interconnect model
/// (`cuvisor_fabric`), the same answers the simulated driver derives its peer queries from
/// (crates/sim/cuda `device::peer_access`, `cuDeviceGetP2PAttribute`): peers are GPUs joined by
/// NVLink (directly or through NVSwitches) or under one PCIe root complex (PIX, PXB),
/// `Fabric::p2p_supported`. Per capability:
/// - READ / WRITE: OK for peers; otherwise the path crosses host bridges, which the chipset does
///   not route peer traffic over: CHIPSET_NOT_SUPPORTED (`nvidia-smi topo -p2p` prints "CNS").
/// - NVLINK: OK when peer traffic goes over NVLink (the route of a peer copy is direct NVLink or
///   NVSwitch), else NOT_SUPPORTED.
/// - ATOMICS: OK over NVLink only (PCIe peer atomics are not modelled), else NOT_SUPPORTED.
/// - PCI: peer traffic over PCIe alone: OK under one root complex, else CHIPSET_NOT_SUPPORTED.
///
/// Links taken down by fault injection do not change the answers (nor cuDeviceCanAccessPeer's).
pub(crate) fn p2p(f: &Fabric, a: usize, b: usize, index: u32) -> Option<u32> {
    p2p_in(f, a, b, index)
}

/// [`p2p`] on a given fabric.
fn p2p_in(f: &Fabric, a: usize, b: usize, index: u32) -> Option<u32> {
    let peers = f.p2p_supported(a, b);
    let kind = f.route(End::Gpu(a), End::Gpu(b), true).kind;
    let nvlink = peers && matches!(kind, RouteKind::NvLink | RouteKind::NvSwitch);
    let pcie = a != b && f.gpus()[a].pcie_root == f.gpus()[b].pcie_root;
    let ok = |yes: bool, no: u32| if yes { p2p_status::OK } else { no };
    Some(match index {
        p2p_caps::READ | p2p_caps::WRITE => ok(nvlink || pcie, p2p_status::CHIPSET_NOT_SUPPORTED),
        p2p_caps::NVLINK | p2p_caps::ATOMICS => ok(nvlink, p2p_status::NOT_SUPPORTED),
        p2p_caps::PCI => ok(pcie, p2p_status::CHIPSET_NOT_SUPPORTED),
        _ => return None,
    })
}

/// The link a per-link NVLink query names. Errors: a device without NVLinks,
/// NVML_ERROR_NOT_SUPPORTED ("if the device doesn't support this feature"); an index past the
/// device's own links, NVML_ERROR_INVALID_ARGUMENT ("if device or link is invalid"; real drivers
/// answer INVALID_ARGUMENT for indices past a GPU's link count, TensorRT-LLM PR #17060).
fn link(
    h: nvmlDevice_t,
    l: c_uint,
) -> Result<(&'static Sim, usize, &'static LinkPeer), nvmlReturn_t> {
    let (sim, d) = dev(h)?;
    let links = &sim.model.devices[d].links;
    if links.is_empty() {
        return Err(ret::ERROR_NOT_SUPPORTED);
    }
    let peer = links.get(l as usize).ok_or(ret::ERROR_INVALID_ARGUMENT)?;
    Ok((sim, d, peer))
}

const VALID_LEVELS: [c_uint; 6] = [
    topo::INTERNAL,
    topo::SINGLE,
    topo::MULTIPLE,
    topo::HOSTBRIDGE,
    topo::NODE,
    topo::SYSTEM,
];

fn counted_handles(count: *mut c_uint, devices: *mut nvmlDevice_t, found: &[usize]) -> Res {
    let room = read(count)? as usize;
    if room == 0 {
        return write(count, found.len() as c_uint);
    }
    if devices.is_null() {
        return Err(ret::ERROR_INVALID_ARGUMENT);
    }
    let handles: Vec<nvmlDevice_t> = found.iter().take(room).map(|&i| handle(i)).collect();
    write_array(devices, &handles)?;
    write(count, handles.len() as c_uint)
}

fn check_scope(scope: nvmlAffinityScope_t) -> Res {
    match scope {
        NVML_AFFINITY_SCOPE_NODE | NVML_AFFINITY_SCOPE_SOCKET => Ok(()),
        _ => Err(ret::ERROR_INVALID_ARGUMENT),
    }
}

fn cpu_bitmap(sim: &Sim, d: usize, size: c_uint, cpu_set: *mut c_ulong) -> Res {
    let first = sim.model.devices[d].numa_node.saturating_mul(CPUS_PER_NODE);
    bitmap(size, cpu_set, first..first.saturating_add(CPUS_PER_NODE))
}

/// Writes `size` 64-bit words with the bits of `set` (bits past the words are dropped).
fn bitmap(size: c_uint, words: *mut c_ulong, set: std::ops::Range<u32>) -> Res {
    if size == 0 || words.is_null() {
        return Err(ret::ERROR_INVALID_ARGUMENT);
    }
    let bits = c_ulong::BITS;
    let out: Vec<c_ulong> = (0..size)
        .map(|w| {
            set.clone()
                .filter(|b| b / bits == w)
                .fold(0, |acc, b| acc | (1 << (b % bits)))
        })
        .collect();
    write_array(words, &out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use cuvisor_sim::model::preset;

    #[test]
    fn p2p_follows_nvlinks_and_root_complexes() {
        let dgx1 = preset("dgx1-v100").unwrap().fabric();
        assert_eq!(p2p_in(&dgx1, 0, 3, p2p_caps::NVLINK), Some(p2p_status::OK));
        assert_eq!(
            p2p_in(&dgx1, 0, 5, p2p_caps::READ),
            Some(p2p_status::CHIPSET_NOT_SUPPORTED)
        );
        assert_eq!(
            p2p_in(&dgx1, 0, 5, p2p_caps::ATOMICS),
            Some(p2p_status::NOT_SUPPORTED)
        );
        let pcie = preset("pcie-8").unwrap().fabric();
        assert_eq!(p2p_in(&pcie, 0, 3, p2p_caps::WRITE), Some(p2p_status::OK));
        assert_eq!(p2p_in(&pcie, 0, 3, p2p_caps::PCI), Some(p2p_status::OK));
        assert_eq!(
            p2p_in(&pcie, 0, 1, p2p_caps::ATOMICS),
            Some(p2p_status::NOT_SUPPORTED)
        );
        assert_eq!(
            p2p_in(&pcie, 0, 4, p2p_caps::PCI),
            Some(p2p_status::CHIPSET_NOT_SUPPORTED)
        );
        let a100 = preset("dgx-a100").unwrap().fabric();
        assert_eq!(p2p_in(&a100, 0, 7, p2p_caps::NVLINK), Some(p2p_status::OK));
        assert_eq!(p2p_in(&a100, 0, 7, 5), None, "NVML_P2P_CAPS_INDEX_UNKNOWN");
    }
}
