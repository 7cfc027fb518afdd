//! The simulated NVML under a real client: nvml-wrapper 0.13, unmodified, loading
//! `libnvidia-ml.so.1` from the simulator's directory. Each test re-runs itself in a child process
//! (`common::Child`) with its own preset and state file; the parent plays "another process" on the
//! same state (charging memory, running kernels, raising XIDs, taking links down).

mod common;

use cuvisor_sim::model::{self, LinkPeer, Model, PcieLevel, GIB};
use cuvisor_sim::state::Shared;
use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enum_wrappers::device::{
    ComputeMode, P2pCapabilitiesIndex, P2pStatus, TemperatureSensor, TopologyLevel,
};
use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::{Device, Nvml};
use std::ffi::{c_char, c_uint, CStr};
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

// NVML codes the raw calls below compare against (nvml.h; cuvisor-cuda-abi checks the values).
const NVML_SUCCESS: u32 = 0;
const NVML_ERROR_UNINITIALIZED: u32 = 1;
const NVML_ERROR_INVALID_ARGUMENT: u32 = 2;
const NVML_ERROR_NOT_FOUND: u32 = 6;
const NVML_ERROR_INSUFFICIENT_SIZE: u32 = 7;
const NVML_ERROR_ARGUMENT_VERSION_MISMATCH: u32 = 25;
const NVML_NVLINK_DEVICE_TYPE_GPU: u32 = 0;
const NVML_NVLINK_DEVICE_TYPE_SWITCH: u32 = 2;

/// `nvmlMemory_v2_t`, for calling the raw entry point with a wrong version.
#[repr(C)]
#[derive(Default)]
struct MemoryV2 {
    version: c_uint,
    total: u64,
    reserved: u64,
    free: u64,
    used: u64,
}

/// `nvmlTemperature_v1_t` and its version, `nvmlTemperature_v1` (nvml.h; 0x0100000C).
#[repr(C)]
#[derive(Default)]
struct TemperatureV1 {
    version: c_uint,
    sensor_type: c_uint,
    temperature: i32,
}
const TEMPERATURE_V1: c_uint = 0x0100_000C;

/// `nvmlProcessUtilizationInfo_v1_t` (40 bytes).
#[repr(C)]
#[derive(Default, Clone, Copy, Debug)]
struct ProcessUtilizationInfoV1 {
    time_stamp: u64,
    pid: c_uint,
    sm_util: c_uint,
    mem_util: c_uint,
    enc_util: c_uint,
    dec_util: c_uint,
    jpg_util: c_uint,
    ofa_util: c_uint,
}

/// `nvmlProcessesUtilizationInfo_v1_t` and its version, `nvmlProcessesUtilizationInfo_v1`
/// (0x01000018).
#[repr(C)]
struct ProcessesUtilizationInfoV1 {
    version: c_uint,
    count: c_uint,
    last_seen: u64,
    array: *mut ProcessUtilizationInfoV1,
}
const PROCESSES_UTILIZATION_INFO_V1: c_uint = 0x0100_0018;

/// nvmlDeviceGetProcessesUtilizationInfo with room for `room` samples (None: a NULL array):
/// the code, the count it wrote back and the samples.
fn processes_utilization(
    nvml: &Nvml,
    dev: &Device,
    version: c_uint,
    room: Option<usize>,
    last_seen: u64,
) -> (u32, u32, Vec<ProcessUtilizationInfoV1>) {
    let mut buf = vec![ProcessUtilizationInfoV1::default(); room.unwrap_or(0)];
    let mut info = ProcessesUtilizationInfoV1 {
        version,
        count: room.unwrap_or(0) as c_uint,
        last_seen,
        array: if room.is_some() {
            buf.as_mut_ptr()
        } else {
            std::ptr::null_mut()
        },
    };
    // SAFETY: the handle comes from a live Device of this Nvml; `info` and the `room` elements
    // of `buf` it points to outlive the call.
    let rc = unsafe {
        nvml.lib().nvmlDeviceGetProcessesUtilizationInfo(
            dev.handle(),
            (&mut info as *mut ProcessesUtilizationInfoV1).cast(),
        )
    };
    buf.truncate(info.count as usize);
    (rc, info.count, buf)
}

/// The simulated library, found the way the child's loader would (the parent put the simulator's
/// directory first on LD_LIBRARY_PATH), by full path so no real NVML can stand in for it.
fn lib_path() -> PathBuf {
    let dirs = std::env::var("LD_LIBRARY_PATH").expect("child runs with LD_LIBRARY_PATH");
    let dir = dirs.split(':').next().unwrap_or_default();
    PathBuf::from(dir).join("libnvidia-ml.so.1")
}

fn nvml() -> Nvml {
    let path = lib_path();
    Nvml::builder()
        .lib_path(path.as_os_str())
        .init()
        .expect("nvmlInit on the simulator")
}

fn model() -> Model {
    Model::from_env().expect("CUVISOR_SIM names a model")
}

/// A state file the parent prepares before it starts the child (a name of its own:
/// `Child::new` starts from a fresh file at the default one).
fn parent_state(test: &str) -> PathBuf {
    common::state_file(&format!("{test}-parent"))
}

/// The parent's view of a child's state file.
fn shared(preset: &str, state: &std::path::Path) -> (Model, Shared) {
    let m = model::preset(preset).unwrap();
    let s = Shared::attach_at(&m, state).unwrap();
    (m, s)
}

/// nvml-wrapper's `NvLink::remote_device_type` writes into a temporary and always reports
/// Unknown, so the entry point is called directly.
fn remote_device_type(nvml: &Nvml, dev: &Device, link: u32) -> (u32, u32) {
    let mut kind: u32 = 255;
    // SAFETY: the handle comes from a live Device of this Nvml; `kind` outlives the call.
    let rc = unsafe {
        nvml.lib()
            .nvmlDeviceGetNvLinkRemoteDeviceType(dev.handle(), link, &mut kind)
    };
    (rc, kind)
}

fn same_bus_id(nvml_id: &str, model_id: &str) -> bool {
    nvml_id.eq_ignore_ascii_case(model_id)
}

// ---- identity and topology of every preset -----------------------------------------------------

fn check_preset() {
    let m = model();
    let nvml = nvml();
    assert_eq!(nvml.device_count().unwrap() as usize, m.devices.len());
    assert_eq!(nvml.sys_driver_version().unwrap(), m.driver_release);
    assert_eq!(
        nvml.sys_nvml_version().unwrap(),
        format!("{}.{}", m.driver_version / 1000, m.driver_release)
    );
    assert_eq!(nvml.sys_cuda_driver_version().unwrap(), m.driver_version);

    let devices: Vec<Device> = (0..m.devices.len() as u32)
        .map(|i| nvml.device_by_index(i).unwrap())
        .collect();
    for (i, (dev, want)) in devices.iter().zip(&m.devices).enumerate() {
        assert_eq!(dev.index().unwrap() as usize, i);
        assert_eq!(dev.minor_number().unwrap(), want.minor);
        assert_eq!(dev.name().unwrap(), want.name);
        assert_eq!(dev.uuid().unwrap(), want.uuid);
        let mem = dev.memory_info().unwrap();
        assert_eq!(mem.total, want.memory, "device {i}");
        assert_eq!(
            (mem.used, mem.free),
            (0, want.memory),
            "fresh state: nothing used"
        );
        let pci = dev.pci_info().unwrap();
        assert!(
            same_bus_id(&pci.bus_id, &want.pci_bus_id_nvml()),
            "{} vs {}",
            pci.bus_id,
            want.pci_bus_id_nvml()
        );
        assert_eq!(
            (pci.domain, pci.bus, pci.device),
            (want.pci_domain, want.pci_bus, want.pci_device)
        );
        assert_eq!(pci.pci_device_id, want.pci_device_id);
        // The handle lookups find the same device.
        assert_eq!(
            nvml.device_by_uuid(want.uuid.as_str())
                .unwrap()
                .index()
                .unwrap() as usize,
            i
        );
        for id in [
            want.pci_bus_id_nvml(),
            want.pci_bus_id_cuda(),
            pci.bus_id.clone(),
        ] {
            assert_eq!(
                nvml.device_by_pci_bus_id(id.as_str())
                    .unwrap()
                    .index()
                    .unwrap() as usize,
                i,
                "{id}"
            );
        }
        let cc = dev.cuda_compute_capability().unwrap();
        assert_eq!((cc.major as u32, cc.minor as u32), want.cc);
        assert_eq!(dev.numa_node_id().unwrap(), want.numa_node);
        // 16 CPUs per NUMA node: node 0 -> 0xffff, node 1 -> 0xffff0000 in the first word.
        let words = dev.cpu_affinity(2).unwrap();
        assert_eq!(words[0], model::cpu_set(want.numa_node));
        assert_eq!(words[1], 0);
    }

    // Topology common ancestors agree with the model for every pair.
    for a in 0..devices.len() {
        for b in 0..devices.len() {
            let level = nvml
                .topology_common_ancestor(&devices[a], &devices[b])
                .unwrap();
            assert_eq!(level.as_c(), m.pcie_level(a, b) as u32, "{a}-{b}");
        }
    }

    // Peer-to-peer status agrees with the simulated driver's cuDeviceCanAccessPeer rule: NVLink
    // (direct or through NVSwitch) or one PCIe root complex (PIX/PXB) make peers.
    use P2pCapabilitiesIndex as Cap;
    for a in 0..devices.len() {
        for b in (0..devices.len()).filter(|&b| b != a) {
            let nvlink = m.nvlink_bandwidth_links(a, b) > 0;
            let pcie = m.pcie_level(a, b) <= PcieLevel::Multiple;
            let want = |yes: bool, no: P2pStatus| if yes { P2pStatus::Ok } else { no };
            let got = |cap| devices[a].p2p_status(&devices[b], cap).unwrap();
            let cns = P2pStatus::ChipsetNotSupported;
            assert_eq!(got(Cap::Read), want(nvlink || pcie, cns), "{a}-{b}");
            assert_eq!(got(Cap::Write), want(nvlink || pcie, cns), "{a}-{b}");
            assert_eq!(got(Cap::Prop), want(pcie, cns), "{a}-{b}");
            assert_eq!(
                got(Cap::NvLink),
                want(nvlink, P2pStatus::NotSupported),
                "{a}-{b}"
            );
            assert_eq!(
                got(Cap::Atomics),
                want(nvlink, P2pStatus::NotSupported),
                "{a}-{b}"
            );
        }
        // A device is not its own peer, and NVML_P2P_CAPS_INDEX_UNKNOWN is no capability.
        assert!(matches!(
            devices[a].p2p_status(&devices[a], Cap::Read),
            Err(NvmlError::InvalidArg)
        ));
        if let Some(other) = devices
            .get((a + 1) % devices.len())
            .filter(|_| devices.len() > 1)
        {
            assert!(matches!(
                devices[a].p2p_status(other, Cap::Unknown),
                Err(NvmlError::InvalidArg)
            ));
        }
    }

    // MIG: A100 (8.0) and Hopper or later can have it, and report it disabled, now and after
    // the next reset; any other GPU answers NOT_SUPPORTED (nvmlDeviceGetMigMode's documented
    // answer for a device without MIG).
    for (dev, want) in devices.iter().zip(&m.devices) {
        let capable = want.cc == (8, 0) || want.cc.0 >= 9;
        match dev.mig_mode() {
            Ok(mode) => {
                assert!(capable, "{}", want.name);
                assert_eq!((mode.current, mode.pending), (0, 0));
            }
            Err(NvmlError::NotSupported) => assert!(!capable, "{}", want.name),
            Err(e) => panic!("{}: {e:?}", want.name),
        }
        assert_eq!(dev.compute_mode().unwrap(), ComputeMode::Default);
    }

    // NVLinks: every link active, with the model's peer at the far end.
    for (i, (dev, want)) in devices.iter().zip(&m.devices).enumerate() {
        if want.links.is_empty() {
            assert!(matches!(
                dev.link_wrapper_for(0).is_active(),
                Err(NvmlError::NotSupported)
            ));
            assert!(matches!(
                dev.link_wrapper_for(0).remote_pci_info(),
                Err(NvmlError::NotSupported)
            ));
            continue;
        }
        for (l, peer) in want.links.iter().enumerate() {
            let link = dev.link_wrapper_for(l as u32);
            assert!(link.is_active().unwrap(), "device {i} link {l}");
            let remote = link.remote_pci_info().unwrap();
            let (rc, kind) = remote_device_type(&nvml, dev, l as u32);
            assert_eq!(rc, NVML_SUCCESS);
            match peer {
                LinkPeer::Gpu(g) => {
                    assert!(same_bus_id(
                        &remote.bus_id,
                        &m.devices[*g].pci_bus_id_nvml()
                    ));
                    assert_eq!(kind, NVML_NVLINK_DEVICE_TYPE_GPU);
                }
                LinkPeer::Switch(s) => {
                    assert!(same_bus_id(&remote.bus_id, &m.nvswitches[*s].pci_bus_id));
                    assert_eq!(kind, NVML_NVLINK_DEVICE_TYPE_SWITCH);
                }
            }
        }
        // Past the device's own links: an invalid link.
        let past = want.links.len() as u32;
        assert!(matches!(
            dev.link_wrapper_for(past).is_active(),
            Err(NvmlError::InvalidArg)
        ));
        assert_eq!(
            remote_device_type(&nvml, dev, past).0,
            NVML_ERROR_INVALID_ARGUMENT
        );
    }
}

#[test]
fn single_preset_through_nvml_wrapper() {
    if common::is_child() {
        check_preset();
        let nvml = nvml();
        let dev = nvml.device_by_index(0).unwrap();
        assert_eq!(dev.memory_info().unwrap().total, 16 * GIB);
        return;
    }
    common::Child::new("single_preset_through_nvml_wrapper")
        .run()
        .success();
}

#[test]
fn dgx1_v100_preset_through_nvml_wrapper() {
    if common::is_child() {
        check_preset();
        let nvml = nvml();
        let d = |i| nvml.device_by_index(i).unwrap();
        let level = |a, b| nvml.topology_common_ancestor(&d(a), &d(b)).unwrap().as_c();
        assert_eq!(level(0, 1), PcieLevel::Single as u32);
        assert_eq!(level(0, 2), PcieLevel::Node as u32);
        assert_eq!(level(0, 4), PcieLevel::System as u32);
        // The hybrid cube-mesh: count each GPU's links to each peer through remote PCI info.
        for &(a, b, n) in model::DGX1_LINKS {
            let peer_bus = d(b as u32).pci_info().unwrap().bus_id;
            let links = (0..6)
                .filter(|&l| {
                    d(a as u32)
                        .link_wrapper_for(l)
                        .remote_pci_info()
                        .unwrap()
                        .bus_id
                        == peer_bus
                })
                .count();
            assert_eq!(links as u32, n, "{a}-{b}");
        }
        // V100: NVLink 2.0 (NVML_NVLINK_VERSION_2_0), six links.
        assert_eq!(d(0).link_wrapper_for(5).version().unwrap(), 2);
        // Nearest GPUs by PCIe level, and the GPUs near a CPU (16 CPUs per NUMA node).
        let near = |level| -> Vec<u32> {
            let gpus = d(0).topology_nearest_gpus(level).unwrap();
            gpus.iter().map(|g| g.index().unwrap()).collect()
        };
        assert_eq!(near(TopologyLevel::Single), [1]);
        assert_eq!(near(TopologyLevel::Node), [1, 2, 3]);
        assert_eq!(near(TopologyLevel::System), [1, 2, 3, 4, 5, 6, 7]);
        let near_cpu = |cpu| -> Vec<u32> {
            let gpus = nvml.topology_gpu_set(cpu).unwrap();
            gpus.iter().map(|g| g.index().unwrap()).collect()
        };
        assert_eq!(near_cpu(3), [0, 1, 2, 3]);
        assert_eq!(near_cpu(17), [4, 5, 6, 7]);
        // Peers: 0-3 by two NVLinks, 0-1 by one and a PCIe switch; 0-5 neither (SYS).
        let p2p = |a, b, cap| d(a).p2p_status(&d(b), cap).unwrap();
        assert_eq!(p2p(0, 3, P2pCapabilitiesIndex::NvLink), P2pStatus::Ok);
        assert_eq!(p2p(0, 3, P2pCapabilitiesIndex::Atomics), P2pStatus::Ok);
        assert_eq!(p2p(0, 1, P2pCapabilitiesIndex::Prop), P2pStatus::Ok);
        assert_eq!(
            p2p(0, 5, P2pCapabilitiesIndex::Read),
            P2pStatus::ChipsetNotSupported
        );
        assert_eq!(
            p2p(0, 5, P2pCapabilitiesIndex::NvLink),
            P2pStatus::NotSupported
        );
        // V100: no MIG.
        assert!(matches!(d(0).mig_mode(), Err(NvmlError::NotSupported)));
        assert_eq!(d(0).memory_info().unwrap().total, 16 * GIB);
        return;
    }
    common::Child::new("dgx1_v100_preset_through_nvml_wrapper")
        .preset("dgx1-v100")
        .run()
        .success();
}

#[test]
fn dgx_a100_preset_through_nvml_wrapper() {
    if common::is_child() {
        check_preset();
        let nvml = nvml();
        let m = model();
        let d = nvml.device_by_index(3).unwrap();
        assert_eq!(d.memory_info().unwrap().total, 80 * GIB);
        // Twelve links, each to an NVSwitch (two per switch), never to a GPU.
        for l in 0..12 {
            let remote = d.link_wrapper_for(l).remote_pci_info().unwrap();
            assert!(same_bus_id(
                &remote.bus_id,
                &m.nvswitches[l as usize / 2].pci_bus_id
            ));
            assert!(
                nvml.device_by_pci_bus_id(remote.bus_id.as_str()).is_err(),
                "a switch is no GPU"
            );
            assert_eq!(
                remote_device_type(&nvml, &d, l).1,
                NVML_NVLINK_DEVICE_TYPE_SWITCH
            );
        }
        assert!(matches!(
            d.link_wrapper_for(12).is_active(),
            Err(NvmlError::InvalidArg)
        ));
        // A100: what real drivers report, NVML_NVLINK_VERSION_3_1.
        assert_eq!(d.link_wrapper_for(0).version().unwrap(), 5);
        // Every pair are NVLink peers through the switches, though no link joins them directly.
        let d7 = nvml.device_by_index(7).unwrap();
        assert_eq!(
            d.p2p_status(&d7, P2pCapabilitiesIndex::NvLink).unwrap(),
            P2pStatus::Ok
        );
        assert_eq!(
            d.p2p_status(&d7, P2pCapabilitiesIndex::Read).unwrap(),
            P2pStatus::Ok
        );
        return;
    }
    common::Child::new("dgx_a100_preset_through_nvml_wrapper")
        .preset("dgx-a100")
        .run()
        .success();
}

/// The h200 preset (a DGX H200) as nvml-wrapper sees it: eight "NVIDIA H200" of 143771 MiB,
/// eighteen active NVLink 4 links per GPU, each to one of four third-generation NVSwitches
/// (PCI device 10de:22a3, 5/4/4/5 links per switch), never to a GPU; every pair an NVLink peer;
/// PCIe distances PXB within a pair, NODE within a socket, SYS across.
#[test]
fn h200_preset_through_nvml_wrapper() {
    if common::is_child() {
        check_preset();
        let nvml = nvml();
        let m = model();
        let d = |i| nvml.device_by_index(i).unwrap();
        for i in 0..8 {
            let g = d(i);
            assert_eq!(g.name().unwrap(), "NVIDIA H200");
            assert_eq!(g.memory_info().unwrap().total, 143_771 * model::MIB);
            assert_eq!(g.pci_info().unwrap().pci_device_id, 0x2335_10de);
            // An H200 SXM's nvidia-smi: "700W" power cap.
            assert_eq!(g.power_management_limit().unwrap(), 700_000);
            let mut per_switch = [0; 4];
            for l in 0..18 {
                let link = g.link_wrapper_for(l);
                assert!(link.is_active().unwrap(), "GPU{i} link {l}");
                // NVML_NVLINK_VERSION_4_0 (6) on Hopper.
                assert_eq!(link.version().unwrap(), 6);
                let remote = link.remote_pci_info().unwrap();
                assert_eq!(remote.pci_device_id, model::NVSWITCH_H100_PCI_DEVICE_ID);
                let s = m
                    .nvswitches
                    .iter()
                    .position(|w| same_bus_id(&remote.bus_id, &w.pci_bus_id))
                    .expect("the remote end is one of the switches");
                per_switch[s] += 1;
                assert!(nvml.device_by_pci_bus_id(remote.bus_id.as_str()).is_err());
                assert_eq!(
                    remote_device_type(&nvml, &g, l),
                    (NVML_SUCCESS, NVML_NVLINK_DEVICE_TYPE_SWITCH)
                );
            }
            assert_eq!(per_switch, model::HGX_H100_SWITCH_LINKS, "GPU{i}");
            assert!(matches!(
                g.link_wrapper_for(18).is_active(),
                Err(NvmlError::InvalidArg)
            ));
        }
        let level = |a, b| nvml.topology_common_ancestor(&d(a), &d(b)).unwrap().as_c();
        assert_eq!(level(0, 1), PcieLevel::Multiple as u32);
        assert_eq!(level(2, 3), PcieLevel::Multiple as u32);
        assert_eq!(level(0, 3), PcieLevel::Node as u32);
        assert_eq!(level(3, 4), PcieLevel::System as u32);
        for a in 0..8 {
            for b in 0..8 {
                if a != b {
                    for cap in [
                        P2pCapabilitiesIndex::Read,
                        P2pCapabilitiesIndex::Write,
                        P2pCapabilitiesIndex::NvLink,
                        P2pCapabilitiesIndex::Atomics,
                    ] {
                        assert_eq!(d(a).p2p_status(&d(b), cap).unwrap(), P2pStatus::Ok);
                    }
                }
            }
        }
        return;
    }
    common::Child::new("h200_preset_through_nvml_wrapper")
        .preset("h200")
        .run()
        .success();
}

#[test]
fn pcie_8_preset_through_nvml_wrapper() {
    if common::is_child() {
        check_preset();
        let nvml = nvml();
        let d = |i| nvml.device_by_index(i).unwrap();
        let level = |a, b| nvml.topology_common_ancestor(&d(a), &d(b)).unwrap().as_c();
        assert_eq!(level(0, 1), PcieLevel::Single as u32);
        assert_eq!(level(0, 3), PcieLevel::Multiple as u32);
        assert_eq!(level(0, 4), PcieLevel::System as u32);
        assert_eq!(d(7).memory_info().unwrap().total, 24 * GIB);
        // No NVLink anywhere.
        assert!(matches!(
            d(0).link_wrapper_for(0).is_active(),
            Err(NvmlError::NotSupported)
        ));
        // PCIe peers behind one root complex (0-1 PIX, 0-3 PXB), none across it; no NVLink,
        // no peer atomics. A10 (8.6): no MIG.
        let p2p = |a, b, cap| d(a).p2p_status(&d(b), cap).unwrap();
        assert_eq!(p2p(0, 1, P2pCapabilitiesIndex::Read), P2pStatus::Ok);
        assert_eq!(p2p(0, 3, P2pCapabilitiesIndex::Write), P2pStatus::Ok);
        assert_eq!(
            p2p(0, 4, P2pCapabilitiesIndex::Read),
            P2pStatus::ChipsetNotSupported
        );
        assert_eq!(
            p2p(0, 1, P2pCapabilitiesIndex::NvLink),
            P2pStatus::NotSupported
        );
        assert_eq!(
            p2p(0, 1, P2pCapabilitiesIndex::Atomics),
            P2pStatus::NotSupported
        );
        assert!(matches!(d(0).mig_mode(), Err(NvmlError::NotSupported)));
        return;
    }
    common::Child::new("pcie_8_preset_through_nvml_wrapper")
        .preset("pcie-8")
        .run()
        .success();
}

// ---- fault injection seen through NVML ---------------------------------------------------------

#[test]
fn a_link_taken_down_reads_disabled() {
    if common::is_child() {
        let nvml = nvml();
        let d0 = nvml.device_by_index(0).unwrap();
        for l in 0..6 {
            assert_eq!(
                d0.link_wrapper_for(l).is_active().unwrap(),
                l != 3,
                "link {l}"
            );
        }
        let d5 = nvml.device_by_index(5).unwrap();
        assert!(!d5.link_wrapper_for(0).is_active().unwrap());
        assert!(d5.link_wrapper_for(1).is_active().unwrap());
        // The wiring does not change: a down link still names its peer.
        assert!(d0.link_wrapper_for(3).remote_pci_info().is_ok());
        return;
    }
    let child = common::Child::new("a_link_taken_down_reads_disabled").preset("dgx1-v100");
    let state = parent_state("a_link_taken_down_reads_disabled");
    let (_m, s) = shared("dgx1-v100", &state);
    s.device(0).nvlink_down.fetch_or(1 << 3, Ordering::AcqRel);
    s.device(5).nvlink_down.fetch_or(1 << 0, Ordering::AcqRel);
    child.state(&state).run().success();
    let _ = std::fs::remove_file(&state);
}

#[test]
fn an_injected_xid_reaches_event_wait() {
    if common::is_child() {
        let nvml = nvml();
        let d2 = nvml.device_by_index(2).unwrap();
        let types = d2.supported_event_types().unwrap();
        assert!(types.contains(EventTypes::CRITICAL_XID_ERROR));
        let set = nvml.create_event_set().unwrap();
        let set = d2
            .register_events(EventTypes::CRITICAL_XID_ERROR, set)
            .unwrap();
        // Nothing pending: the XID raised before registration is not delivered.
        assert!(matches!(set.wait(50), Err(NvmlError::Timeout)));
        std::fs::write(std::env::var("READY_FILE").unwrap(), b"registered").unwrap();
        let ev = set.wait(20_000).expect("the XID the parent raises");
        assert_eq!(ev.device.index().unwrap(), 2);
        assert!(ev.event_type.contains(EventTypes::CRITICAL_XID_ERROR));
        assert!(
            matches!(ev.event_data, Some(XidError::Value(79))),
            "{:?}",
            ev.event_data
        );
        // Device 3's XID was not registered for; nothing else is pending.
        assert!(matches!(set.wait(50), Err(NvmlError::Timeout)));
        set.release_events().unwrap();
        return;
    }
    let state = parent_state("an_injected_xid_reaches_event_wait");
    let ready = state.with_extension("ready");
    let _ = std::fs::remove_file(&ready);
    let (_m, s) = shared("dgx1-v100", &state);
    s.raise_xid(2, 13); // before the child registers: must not be delivered
    let child = common::Child::new("an_injected_xid_reaches_event_wait")
        .preset("dgx1-v100")
        .state(&state)
        .env("READY_FILE", ready.to_str().unwrap())
        .spawn();
    let deadline = Instant::now() + Duration::from_secs(60);
    while !ready.exists() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(ready.exists(), "the child never registered for events");
    s.raise_xid(3, 48);
    s.raise_xid(2, 79);
    common::Ran(child.wait_with_output().unwrap()).success();
    let _ = std::fs::remove_file(&ready);
    let _ = std::fs::remove_file(&state);
}

// ---- memory, processes and utilization come from the shared state ------------------------------

#[test]
fn memory_processes_and_utilization_follow_other_processes() {
    if common::is_child() {
        let parent: u32 = std::env::var("PARENT_PID").unwrap().parse().unwrap();
        let dead: u32 = std::env::var("DEAD_PID").unwrap().parse().unwrap();
        let nvml = nvml();
        let d0 = nvml.device_by_index(0).unwrap();
        let d1 = nvml.device_by_index(1).unwrap();

        // The dead process's 1 GiB went back when NVML looked; the parent's 3 GiB shows.
        let mem = d1.memory_info().unwrap();
        assert_eq!(mem.used, 3 * GIB);
        assert_eq!(mem.free, mem.total - 3 * GIB);
        let procs = d1.running_compute_processes().unwrap();
        assert_eq!(procs.len(), 1, "{procs:?}");
        assert_eq!(procs[0].pid, parent);
        assert_eq!(procs[0].used_gpu_memory, UsedGpuMemory::Used(3 * GIB));
        assert_eq!(
            (procs[0].gpu_instance_id, procs[0].compute_instance_id),
            (None, None)
        );
        assert!(procs.iter().all(|p| p.pid != dead));
        assert_eq!(d1.running_compute_processes_count().unwrap(), 1);
        assert!(d0.running_compute_processes().unwrap().is_empty());
        assert_eq!(d0.memory_info().unwrap().used, 0);

        // The parent queued an 800 ms kernel on device 1 just before starting us. (Not longer: the
        // per-process busy history is a PROC_BUCKETS x 10 ms ring, and time queued further ahead
        // than that laps it.)
        std::thread::sleep(Duration::from_millis(150));
        let busy = d1.utilization_rates().unwrap();
        assert!(busy.gpu >= 5, "{busy:?}");
        assert_eq!(d0.utilization_rates().unwrap().gpu, 0);
        let samples = d1.process_utilization_stats(None).unwrap();
        let mine: Vec<_> = samples.iter().filter(|s| s.pid == parent).collect();
        assert_eq!(mine.len(), 1, "{samples:?}");
        assert!(mine[0].sm_util > 0, "{samples:?}");
        let later = mine[0].timestamp + 10_000_000;
        assert!(matches!(
            d1.process_utilization_stats(later),
            Err(NvmlError::NotFound)
        ));
        assert!(matches!(
            d0.process_utilization_stats(None),
            Err(NvmlError::NotFound)
        ));

        // The struct-versioned form: the same samples, asked for as pynvml does (no array
        // first: INSUFFICIENT_SIZE and the count), jpg and ofa engines idle.
        let v1 = PROCESSES_UTILIZATION_INFO_V1;
        let (rc, n, _) = processes_utilization(&nvml, &d1, v1, None, 0);
        assert_eq!((rc, n), (NVML_ERROR_INSUFFICIENT_SIZE, 1));
        let (rc, n, _) = processes_utilization(&nvml, &d1, v1, Some(0), 0);
        assert_eq!((rc, n), (NVML_ERROR_INSUFFICIENT_SIZE, 1));
        let (rc, n, got) = processes_utilization(&nvml, &d1, v1, Some(4), 0);
        assert_eq!((rc, n), (NVML_SUCCESS, 1), "{got:?}");
        let s = got[0];
        assert_eq!(s.pid, parent);
        assert!(s.sm_util > 0 && s.sm_util <= 100, "{s:?}");
        assert_eq!((s.mem_util, s.enc_util, s.dec_util), (0, 0, 0));
        assert_eq!((s.jpg_util, s.ofa_util), (0, 0));
        assert!(
            s.time_stamp.abs_diff(mine[0].timestamp) < 5_000_000,
            "{s:?}"
        );
        let (rc, n, _) = processes_utilization(&nvml, &d1, v1, Some(4), s.time_stamp + 10_000_000);
        assert_eq!((rc, n), (NVML_ERROR_NOT_FOUND, 0));
        let (rc, n, _) = processes_utilization(&nvml, &d0, v1, Some(4), 0);
        assert_eq!((rc, n), (NVML_ERROR_NOT_FOUND, 0));
        // A struct of another version, or none.
        let (rc, _, _) = processes_utilization(&nvml, &d1, v1 + 1, Some(4), 0);
        assert_eq!(rc, NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
        let (rc, _, _) = processes_utilization(&nvml, &d1, 0x0200_0018, Some(4), 0);
        assert_eq!(rc, NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
        // SAFETY: a live handle and a NULL struct, which the call must refuse.
        let rc = unsafe {
            nvml.lib()
                .nvmlDeviceGetProcessesUtilizationInfo(d1.handle(), std::ptr::null_mut())
        };
        assert_eq!(rc, NVML_ERROR_INVALID_ARGUMENT);
        return;
    }
    let state = parent_state("memory_processes_and_utilization_follow_other_processes");
    let (m, s) = shared("dgx1-v100", &state);
    let slot = s.claim_slot().unwrap();
    assert!(s.charge(slot, 1, 3 * GIB, m.devices[1].memory));
    // A process that died holding 1 GiB on device 1 (its slot written as the driver would have).
    let mut gone = std::process::Command::new("true").spawn().unwrap();
    let dead = gone.id();
    let start = cuvisor_sim::state::process_start_time(dead).unwrap_or(12345);
    gone.wait().unwrap();
    let ghost = &s.procs()[200];
    ghost.pid.store(dead, Ordering::Relaxed);
    ghost.start_time.store(start, Ordering::Relaxed);
    ghost.mem[1].store(GIB, Ordering::Relaxed);
    s.device(1).mem_used.fetch_add(GIB, Ordering::AcqRel);
    s.run_kernel(slot, 1, 0, 800_000_000);
    common::Child::new("memory_processes_and_utilization_follow_other_processes")
        .preset("dgx1-v100")
        .state(&state)
        .env("PARENT_PID", &std::process::id().to_string())
        .env("DEAD_PID", &dead.to_string())
        .run()
        .success();
    s.release_slot(slot);
    assert_eq!(s.device(1).mem_used.load(Ordering::Acquire), 0);
    let _ = std::fs::remove_file(&state);
}

// ---- sensors and modes -------------------------------------------------------------------------

/// Raw nvmlDeviceGetTemperatureV with a struct of `version` asking for `sensor`.
fn temperature_v(nvml: &Nvml, dev: &Device, version: c_uint, sensor: c_uint) -> (u32, i32) {
    let mut t = TemperatureV1 {
        version,
        sensor_type: sensor,
        temperature: -1,
    };
    // SAFETY: a live handle; `t` outlives the call.
    let rc = unsafe {
        nvml.lib()
            .nvmlDeviceGetTemperatureV(dev.handle(), (&mut t as *mut TemperatureV1).cast())
    };
    (rc, t.temperature)
}

/// The simulated A100 PCIe's board power (its datasheet's 250 W) and idle draw (15 % of it), mW.
const A100_PCIE_MW: u32 = 250_000;
const A100_PCIE_IDLE_MW: u32 = 37_500;

/// Energy the simulator reports for a GPU idle all along but for `busy_ns` of kernels, at
/// CLOCK_MONOTONIC `now`, mJ.
fn a100_energy_mj(now: u64, busy_ns: u64) -> u64 {
    let extra = (A100_PCIE_MW - A100_PCIE_IDLE_MW) as u128;
    ((A100_PCIE_IDLE_MW as u128 * now as u128 + extra * busy_ns as u128) / 1_000_000_000) as u64
}

#[test]
fn sensors_and_modes_of_an_idle_gpu() {
    if common::is_child() {
        let nvml = nvml();
        let d = nvml.device_by_index(0).unwrap();
        assert_eq!(d.utilization_rates().unwrap().gpu, 0);
        assert_eq!(d.temperature(TemperatureSensor::Gpu).unwrap(), 33);
        assert_eq!(d.power_usage().unwrap(), A100_PCIE_IDLE_MW);
        assert_eq!(d.power_management_limit().unwrap(), A100_PCIE_MW);
        assert_eq!(d.power_management_limit_default().unwrap(), A100_PCIE_MW);
        assert_eq!(d.enforced_power_limit().unwrap(), A100_PCIE_MW);
        let t0 = cuvisor_sim::state::now_ns();
        let e = d.total_energy_consumption().unwrap();
        let t1 = cuvisor_sim::state::now_ns();
        assert!(
            (a100_energy_mj(t0, 0)..=a100_energy_mj(t1, 0)).contains(&e),
            "{e} mJ: the idle draw since boot"
        );
        assert!(d.total_energy_consumption().unwrap() >= e, "it only grows");
        assert_eq!(d.compute_mode().unwrap(), ComputeMode::Default);
        let mig = d.mig_mode().unwrap();
        assert_eq!((mig.current, mig.pending), (0, 0), "A100: MIG capable, off");

        // The versioned temperature query checks its struct.
        assert_eq!(
            temperature_v(&nvml, &d, TEMPERATURE_V1, 0),
            (NVML_SUCCESS, 33)
        );
        assert_eq!(
            temperature_v(&nvml, &d, 0, 0).0,
            NVML_ERROR_ARGUMENT_VERSION_MISMATCH
        );
        assert_eq!(
            temperature_v(&nvml, &d, TEMPERATURE_V1 + (1 << 24), 0).0,
            NVML_ERROR_ARGUMENT_VERSION_MISMATCH
        );
        assert_eq!(
            temperature_v(&nvml, &d, TEMPERATURE_V1, 1).0,
            NVML_ERROR_INVALID_ARGUMENT,
            "NVML_TEMPERATURE_GPU is the only sensor"
        );
        let lib = nvml.lib();
        let mut v: c_uint = 0;
        // SAFETY: raw calls with a live handle (or a forged one, which must be refused) and
        // out-pointers that are NULL or point at `v`.
        unsafe {
            let h = d.handle();
            let forged = (h as usize + 4096) as _;
            assert_eq!(
                lib.nvmlDeviceGetTemperatureV(h, std::ptr::null_mut()),
                NVML_ERROR_INVALID_ARGUMENT
            );
            assert_eq!(
                lib.nvmlDeviceGetTemperature(h, 0, std::ptr::null_mut()),
                NVML_ERROR_INVALID_ARGUMENT
            );
            assert_eq!(
                lib.nvmlDeviceGetTemperature(h, 7, &mut v),
                NVML_ERROR_INVALID_ARGUMENT
            );
            assert_eq!(
                lib.nvmlDeviceGetTemperature(forged, 0, &mut v),
                NVML_ERROR_INVALID_ARGUMENT
            );
            assert_eq!(
                lib.nvmlDeviceGetPowerUsage(h, std::ptr::null_mut()),
                NVML_ERROR_INVALID_ARGUMENT
            );
            assert_eq!(
                lib.nvmlDeviceGetEnforcedPowerLimit(h, std::ptr::null_mut()),
                NVML_ERROR_INVALID_ARGUMENT
            );
            assert_eq!(
                lib.nvmlDeviceGetPowerManagementLimit(forged, &mut v),
                NVML_ERROR_INVALID_ARGUMENT
            );
            assert_eq!(
                lib.nvmlDeviceGetTotalEnergyConsumption(h, std::ptr::null_mut()),
                NVML_ERROR_INVALID_ARGUMENT
            );
            assert_eq!(
                lib.nvmlDeviceGetComputeMode(h, std::ptr::null_mut()),
                NVML_ERROR_INVALID_ARGUMENT
            );
            assert_eq!(
                lib.nvmlDeviceGetMigMode(h, &mut v, std::ptr::null_mut()),
                NVML_ERROR_INVALID_ARGUMENT
            );
            assert_eq!(
                lib.nvmlDeviceGetP2PStatus(h, h, 0, std::ptr::null_mut()),
                NVML_ERROR_INVALID_ARGUMENT
            );
        }
        return;
    }
    common::Child::new("sensors_and_modes_of_an_idle_gpu")
        .run()
        .success();
}

/// Another process keeps the GPU busy for 4 s; a second or more into it, NVML's utilization is 100 %
/// and temperature and power read their full-load values; the energy counter holds the kernel
/// time at the board power.
#[test]
fn temperature_power_and_energy_follow_the_timeline() {
    // Long enough that a child slow to start still looks while it runs; short of the 5 s
    // per-process history (PROC_BUCKETS x 10 ms), which time queued further ahead laps.
    const KERNEL_NS: u64 = 4_000_000_000;
    if common::is_child() {
        let nvml = nvml();
        let d = nvml.device_by_index(0).unwrap();
        std::thread::sleep(Duration::from_millis(1100));
        assert_eq!(d.utilization_rates().unwrap().gpu, 100);
        assert_eq!(d.temperature(TemperatureSensor::Gpu).unwrap(), 63);
        assert_eq!(
            temperature_v(&nvml, &d, TEMPERATURE_V1, 0),
            (NVML_SUCCESS, 63)
        );
        assert_eq!(d.power_usage().unwrap(), A100_PCIE_MW);
        assert_eq!(d.enforced_power_limit().unwrap(), A100_PCIE_MW);
        let t0 = cuvisor_sim::state::now_ns();
        let e = d.total_energy_consumption().unwrap();
        let t1 = cuvisor_sim::state::now_ns();
        assert!(
            (a100_energy_mj(t0, KERNEL_NS)..=a100_energy_mj(t1, KERNEL_NS)).contains(&e),
            "{e} mJ"
        );
        return;
    }
    let test = "temperature_power_and_energy_follow_the_timeline";
    let state = parent_state(test);
    let (_m, s) = shared("single", &state);
    let slot = s.claim_slot().unwrap();
    s.run_kernel(slot, 0, 0, KERNEL_NS);
    common::Child::new(test).state(&state).run().success();
    s.release_slot(slot);
    let _ = std::fs::remove_file(&state);
}

// ---- library protocol: init/shutdown, errors, argument checks ----------------------------------

#[test]
fn init_is_reference_counted_and_errors_are_nvmls() {
    if common::is_child() {
        let nvml = nvml();
        let lib = nvml.lib();
        let mut n: c_uint = 0;
        // SAFETY: raw calls into the loaded library with valid out-pointers.
        unsafe {
            assert_eq!(lib.nvmlInit_v2(), NVML_SUCCESS); // 2 holders
            assert_eq!(lib.nvmlShutdown(), NVML_SUCCESS); // 1
            assert_eq!(lib.nvmlDeviceGetCount_v2(&mut n), NVML_SUCCESS);
            assert_eq!(n, 1);
            assert_eq!(lib.nvmlShutdown(), NVML_SUCCESS); // 0: shut down
            assert_eq!(lib.nvmlDeviceGetCount_v2(&mut n), NVML_ERROR_UNINITIALIZED);
            assert_eq!(lib.nvmlShutdown(), NVML_ERROR_UNINITIALIZED);
            assert_eq!(lib.nvmlInitWithFlags(0), NVML_SUCCESS); // back to 1, for Nvml's drop
            assert_eq!(
                lib.nvmlDeviceGetCount_v2(std::ptr::null_mut()),
                NVML_ERROR_INVALID_ARGUMENT
            );

            let text = |code| {
                CStr::from_ptr(lib.nvmlErrorString(code) as *const c_char)
                    .to_str()
                    .unwrap()
            };
            assert_eq!(text(0), "Success");
            assert_eq!(text(2), "Invalid Argument");
            assert_eq!(text(999), "Unknown Error");
            assert_eq!(text(12345), "Unknown Error");

            // Memory v2 checks its version field.
            let d = nvml.device_by_index(0).unwrap();
            let mut m = MemoryV2::default();
            let rc = lib.nvmlDeviceGetMemoryInfo_v2(d.handle(), (&mut m as *mut MemoryV2).cast());
            assert_eq!(rc, NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
            m.version = (std::mem::size_of::<MemoryV2>() | (2 << 24)) as c_uint;
            let rc = lib.nvmlDeviceGetMemoryInfo_v2(d.handle(), (&mut m as *mut MemoryV2).cast());
            assert_eq!(rc, NVML_SUCCESS);
            assert_eq!((m.total, m.reserved, m.used), (16 * GIB, 0, 0));

            // No process on the device: the count query succeeds with 0 (infos may be NULL).
            let mut count: c_uint = 0;
            let rc = lib.nvmlDeviceGetComputeRunningProcesses_v3(
                d.handle(),
                &mut count,
                std::ptr::null_mut(),
            );
            assert_eq!((rc, count), (NVML_SUCCESS, 0));
            // A forged handle is an invalid argument, not a crash.
            let forged = (d.handle() as usize + 4096) as _;
            assert_eq!(lib.nvmlDeviceGetCount_v2(&mut n), NVML_SUCCESS);
            assert_eq!(
                lib.nvmlDeviceGetIndex(forged, &mut n),
                NVML_ERROR_INVALID_ARGUMENT
            );
        }

        assert!(matches!(
            nvml.device_by_index(1),
            Err(NvmlError::InvalidArg)
        ));
        assert!(matches!(
            nvml.device_by_uuid("GPU-00000000-0000-4000-8000-000000000000"),
            Err(NvmlError::NotFound)
        ));
        assert!(matches!(
            nvml.device_by_pci_bus_id("not a bus id"),
            Err(NvmlError::InvalidArg)
        ));
        assert!(matches!(
            nvml.device_by_pci_bus_id("00000000:FF:00.0"),
            Err(NvmlError::NotFound)
        ));
        let d = nvml.device_by_index(0).unwrap();
        // What the simulator does not model answers NOT_SUPPORTED (the simulated A100 PCIe is
        // passively cooled: no fan of its own).
        assert!(matches!(d.fan_speed(0), Err(NvmlError::NotSupported)));
        assert!(matches!(
            d.running_graphics_processes().map(|v| v.len()),
            Ok(0)
        ));
        return;
    }
    common::Child::new("init_is_reference_counted_and_errors_are_nvmls")
        .run()
        .success();
}
