//! Discovery through NVML on the simulated `libnvidia-ml.so.1`, for every preset: each test
//! re-runs itself in a child process whose loader finds the simulator first (see the simulator's
//! tests/common). The discovered topology must equal the preset's model, and, less what the text
//! cannot show, the topology parsed from the preset's `nvidia-smi topo -m` fixture.

#[path = "../../sim/tests/common/mod.rs"]
mod common;
mod support;

use cuvisor_device_plugin::topology::{discover, Allocator, Memory, Topology, Weights};
use cuvisor_sim::model::{self, Model, GIB};
use cuvisor_sim::state::Shared;
use nvml_wrapper::Nvml;
use std::path::PathBuf;
use std::sync::atomic::Ordering;

/// NVML from the simulator's directory, by full path, so that no real NVML can stand in.
fn nvml() -> Nvml {
    let dirs = std::env::var("LD_LIBRARY_PATH").expect("the child runs with LD_LIBRARY_PATH");
    let dir = dirs.split(':').next().unwrap_or_default();
    Nvml::builder()
        .lib_path(PathBuf::from(dir).join("libnvidia-ml.so.1").as_os_str())
        .init()
        .expect("nvmlInit on the simulator")
}

fn discovered() -> (Model, Topology) {
    let m = Model::from_env().expect("CUVISOR_SIM names a model");
    let t = discover(&nvml()).expect("discovery on the simulator");
    (m, t)
}

/// The child's checks for the preset it runs on.
fn check_preset() {
    let (m, t) = discovered();
    assert_eq!(t, support::from_model(&m), "discovered != modelled");
    let preset = std::env::var("CUVISOR_SIM").unwrap_or_default();
    let parsed = cuvisor_device_plugin::topology::parse_topo_matrix(&support::fixture(&format!(
        "sim-{preset}.txt"
    )))
    .expect("the preset's fixture parses");
    assert_eq!(
        support::as_text_sees(&t),
        parsed,
        "discovered (less what text lacks) != parsed fixture"
    );
}

macro_rules! preset_test {
    ($name:ident, $preset:literal) => {
        #[test]
        fn $name() {
            if common::is_child() {
                check_preset();
                return;
            }
            common::Child::new(stringify!($name))
                .preset($preset)
                .run()
                .success();
        }
    };
}

preset_test!(discovers_single, "single");
preset_test!(discovers_dgx1_v100, "dgx1-v100");
preset_test!(discovers_dgx_a100, "dgx-a100");
preset_test!(discovers_h200, "h200");
preset_test!(discovers_pcie_8, "pcie-8");

#[test]
fn every_preset_has_a_test() {
    assert_eq!(
        model::PRESETS,
        &["single", "dgx1-v100", "dgx-a100", "h200", "pcie-8"],
        "a new preset needs a discovery test and a fixture"
    );
}

/// What the NVSwitch box looks like through NVML: every remote end is a switch, never a GPU,
/// yet every pair is fully connected at 12 links (NVIDIA's allocator sees no NVLink here).
#[test]
fn nvswitch_links_are_recognised_by_bus_id() {
    if common::is_child() {
        let (_, t) = discovered();
        for a in 0..8 {
            for b in 0..8 {
                if a != b {
                    let nv = t
                        .link(a, b)
                        .unwrap()
                        .nvlink
                        .expect("NVLink via the switches");
                    assert_eq!(
                        (nv.links, nv.via_switch, nv.generation),
                        (12, true, Some(3))
                    );
                }
            }
        }
        assert_eq!(t.bandwidth_gbps(0, 5), 300.0);
        // Discovered PCIe paths keep picks on one PCIe switch among equals.
        let al = Allocator::new(t).unwrap();
        let all: Vec<usize> = (0..8).collect();
        assert_eq!(
            al.preferred(&all, &[], 2, &Weights::default()).unwrap(),
            [0, 1]
        );
        assert_eq!(
            al.preferred(&all, &[5], 2, &Weights::default()).unwrap(),
            [4, 5]
        );
        return;
    }
    common::Child::new("nvswitch_links_are_recognised_by_bus_id")
        .preset("dgx-a100")
        .run()
        .success();
}

/// A link taken down at one end carries nothing; memory another process holds is not free.
#[test]
fn down_links_and_used_memory_are_seen() {
    if common::is_child() {
        let (_, t) = discovered();
        // GPU0's links 2 and 3 go to GPU3 (DGX1_LINKS order); link 3 is down.
        assert_eq!(t.link(0, 3).unwrap().nvlink.unwrap().links, 1);
        assert_eq!(t.link(3, 0).unwrap().nvlink.unwrap().links, 1);
        assert_eq!(t.link(0, 4).unwrap().nvlink.unwrap().links, 2);
        assert_eq!(
            t.gpus()[2].memory,
            Some(Memory {
                total: 16 * GIB,
                free: 12 * GIB
            })
        );
        // GPU2 is a quarter used: a group with it is less balanced than one without.
        let al = Allocator::new(t).unwrap();
        // Memory balance is a term of the seeds' weighted score (policy "weighted"); the
        // all-reduce policy does not weigh it.
        let w = Weights::weighted();
        assert_eq!(al.score(&[1, 2], &w).unwrap().balance, 0.75);
        assert_eq!(al.score(&[2, 3], &w).unwrap().balance, 0.75);
        // 1-2 and 2-3 are 2-NVLink pairs, but GPU2 is unbalanced; 0-4 is a full 2-link pair
        // and 0-3 lost a link.
        let pick = al.preferred(&[0, 1, 2, 3, 4], &[], 2, &w).unwrap();
        assert_eq!(pick, [0, 4]);
        return;
    }
    let state = common::state_file("down_links_and_used_memory_are_seen-parent");
    let m = model::preset("dgx1-v100").unwrap();
    let s = Shared::attach_at(&m, &state).unwrap();
    s.device(0).nvlink_down.fetch_or(1 << 3, Ordering::AcqRel);
    let slot = s.claim_slot().expect("a process slot");
    assert!(s.charge(slot, 2, 4 * GIB, 16 * GIB));
    common::Child::new("down_links_and_used_memory_are_seen")
        .preset("dgx1-v100")
        .state(&state)
        .run()
        .success();
    s.release_slot(slot);
    let _ = std::fs::remove_file(&state);
}

/// Discovery records each GPU's device node minor number as NVML reports it, even where it is
/// not the index (a model file with GPU 0 at /dev/nvidia3 and GPU 1 at /dev/nvidia1).
#[test]
fn minor_numbers_are_discovered() {
    if common::is_child() {
        let (m, t) = discovered();
        let minors: Vec<Option<u32>> = t.gpus().iter().map(|g| g.minor).collect();
        assert_eq!(minors, [Some(3), Some(1)]);
        assert_eq!(t, support::from_model(&m), "discovered != modelled");
        return;
    }
    let dir = std::env::temp_dir().join(format!("cuvisor-minors-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("minors.toml");
    std::fs::write(
        &file,
        "[[device]]\nmemory = \"4Gi\"\nminor = 3\n[[device]]\nmemory = \"4Gi\"\nminor = 1\n",
    )
    .unwrap();
    common::Child::new("minor_numbers_are_discovered")
        .preset(file.to_str().unwrap())
        .run()
        .success();
    let _ = std::fs::remove_dir_all(&dir);
}
