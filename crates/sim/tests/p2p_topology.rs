//! One rule for peer access, seen through real clients on every preset: the simulated driver's
//! `cuDeviceCanAccessPeer` and `cuDeviceGetP2PAttribute` (called through cudarc's raw bindings,
//! the crate unmodified, loading `libcuda.so.1` dynamically) and NVML's `nvmlDeviceGetP2PStatus`
//! (through nvml-wrapper) give the interconnect model's answer (`cuvisor_fabric`, built from the
//! preset by `Model::fabric`) for every ordered pair of GPUs.
//!
//! What the answers must be, per pair (a, b), a != b:
//! - can access = ACCESS_SUPPORTED = (NVML READ status is OK) = `Fabric::p2p_supported(a, b)`;
//! - NVML NVLINK status OK = NATIVE_ATOMIC_SUPPORTED = an NVLink joins them, directly or through
//!   NVSwitches (read from the model's links, not from the fabric);
//! - PERFORMANCE_RANK: 0 over NVLink/NVSwitch ("0 means best possible link", lupinemachines/
//!   lupine issue #445), 1 over PCIe P2P, 0 where there is no peer access.
mod common;

use cudarc::driver::sys::{self, CUdevice_P2PAttribute, CUresult};
use cuvisor_sim::model::{LinkPeer, Model, PRESETS};
use nvml_wrapper::enum_wrappers::device::{P2pCapabilitiesIndex, P2pStatus};
use nvml_wrapper::Nvml;
use std::path::PathBuf;

fn nvml() -> Nvml {
    let dirs = std::env::var("LD_LIBRARY_PATH").expect("the child runs with LD_LIBRARY_PATH");
    let dir = dirs.split(':').next().unwrap_or_default();
    Nvml::builder()
        .lib_path(PathBuf::from(dir).join("libnvidia-ml.so.1").as_os_str())
        .init()
        .expect("nvmlInit on the simulator")
}

fn check(r: CUresult, what: &str) {
    assert_eq!(r, CUresult::CUDA_SUCCESS, "{what}");
}

/// `cuDeviceGetP2PAttribute(attr, a, b)` through cudarc's binding.
fn attr(attr: CUdevice_P2PAttribute, a: usize, b: usize) -> i32 {
    let mut v = -1;
    // SAFETY: `v` outlives the call; the ordinals are the machine's.
    check(
        unsafe { sys::cuDeviceGetP2PAttribute(&mut v, attr, a as i32, b as i32) },
        "cuDeviceGetP2PAttribute",
    );
    v
}

/// `cuDeviceCanAccessPeer(a, b)` through cudarc's binding.
fn can_access(a: usize, b: usize) -> i32 {
    let mut can = -1;
    // SAFETY: `can` outlives the call.
    check(
        unsafe { sys::cuDeviceCanAccessPeer(&mut can, a as i32, b as i32) },
        "cuDeviceCanAccessPeer",
    );
    can
}

/// NVLink joins a and b: a direct link, or both reach the NVSwitches.
fn nvlinked(m: &Model, a: usize, b: usize) -> bool {
    let switched = |d: usize| {
        m.devices[d]
            .links
            .iter()
            .any(|p| matches!(p, LinkPeer::Switch(_)))
    };
    m.direct_links(a, b) > 0 || (switched(a) && switched(b))
}

/// The child's checks on the preset it runs on; returns the pairs it checked.
fn check_every_pair() -> usize {
    let m = Model::from_env().expect("CUVISOR_SIM names a model");
    let f = m.fabric();
    let nvml = nvml();
    // SAFETY: plain driver initialisation.
    check(unsafe { sys::cuInit(0) }, "cuInit");
    let n = m.devices.len();
    let dev = |i: usize| nvml.device_by_index(i as u32).unwrap();
    let mut pairs = 0;
    for a in 0..n {
        for b in (0..n).filter(|&b| b != a) {
            let name = format!("{} GPU{a}->GPU{b}", m.name);
            let supported = f.p2p_supported(a, b);
            let nvlink = nvlinked(&m, a, b);
            use CUdevice_P2PAttribute::*;
            let can = can_access(a, b);
            let access = attr(CU_DEVICE_P2P_ATTRIBUTE_ACCESS_SUPPORTED, a, b);
            let atomic = attr(CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED, a, b);
            let rank = attr(CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK, a, b);
            let status = |cap| dev(a).p2p_status(&dev(b), cap).unwrap();
            let read = status(P2pCapabilitiesIndex::Read);
            let over_nvlink = status(P2pCapabilitiesIndex::NvLink);
            assert_eq!(can == 1, supported, "{name}: cuDeviceCanAccessPeer");
            assert_eq!(access == 1, supported, "{name}: ACCESS_SUPPORTED");
            assert_eq!(
                read == P2pStatus::Ok,
                supported,
                "{name}: NVML READ {read:?}"
            );
            if !supported {
                assert_eq!(read, P2pStatus::ChipsetNotSupported, "{name}");
            }
            assert_eq!(
                over_nvlink == P2pStatus::Ok,
                nvlink,
                "{name}: NVML NVLINK {over_nvlink:?}"
            );
            assert_eq!(atomic == 1, nvlink, "{name}: NATIVE_ATOMIC_SUPPORTED");
            let want_rank = i32::from(supported && !nvlink);
            assert_eq!(rank, want_rank, "{name}: PERFORMANCE_RANK");
            pairs += 1;
        }
    }
    pairs
}

#[test]
fn peer_answers_agree_with_the_fabric_on_every_preset_and_pair() {
    if common::is_child() {
        let n = Model::from_env().unwrap().devices.len();
        assert_eq!(check_every_pair(), n * (n - 1), "every ordered pair");
        return;
    }
    for preset in PRESETS {
        common::Child::new("peer_answers_agree_with_the_fabric_on_every_preset_and_pair")
            .preset(preset)
            .run()
            .success();
    }
}

/// The answers the rule gives on the boxes whose wiring is published, independent of the
/// fabric: DGX-1's cube-mesh leaves 0-5 without NVLink and across sockets (no peer access);
/// the h200's NVSwitches make every pair an NVLink peer; pcie-8 has PCIe peers under one root
/// complex only.
#[test]
fn peer_answers_on_the_published_boxes() {
    if common::is_child() {
        let m = Model::from_env().unwrap();
        // SAFETY: plain driver initialisation.
        check(unsafe { sys::cuInit(0) }, "cuInit");
        use CUdevice_P2PAttribute::CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK as RANK;
        match m.name.as_str() {
            "dgx1-v100" => {
                assert_eq!((can_access(0, 3), attr(RANK, 0, 3)), (1, 0), "NV2");
                assert_eq!((can_access(0, 5), can_access(5, 0)), (0, 0), "SYS");
            }
            "h200" => {
                for a in 0..8 {
                    for b in (0..8).filter(|&b| b != a) {
                        assert_eq!((can_access(a, b), attr(RANK, a, b)), (1, 0), "{a}->{b}");
                    }
                }
            }
            "pcie-8" => {
                assert_eq!((can_access(0, 1), attr(RANK, 0, 1)), (1, 1), "PIX");
                assert_eq!((can_access(0, 3), attr(RANK, 0, 3)), (1, 1), "PXB");
                assert_eq!((can_access(0, 4), attr(RANK, 0, 4)), (0, 0), "SYS");
            }
            other => panic!("no published answers for {other}"),
        }
        return;
    }
    for preset in ["dgx1-v100", "h200", "pcie-8"] {
        common::Child::new("peer_answers_on_the_published_boxes")
            .preset(preset)
            .run()
            .success();
    }
}
