//! Health on the simulated NVML: an XID or an NVLink going down, injected through the simulator's
//! shared state (what `cuvisor sim fault xid|nvlink-down|nvlink-up` does), turns the GPU
//! Unhealthy, and it is Healthy again once the condition clears. Each test re-runs itself in a
//! child process whose loader finds the simulator (see the simulator's tests/common).

#[path = "../../sim/tests/common/mod.rs"]
mod common;

use cuvisor_device_plugin::health::{HealthConfig, HealthMap, Monitor};
use cuvisor_sim::model::Model;
use cuvisor_sim::state::Shared;
use nvml_wrapper::Nvml;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{channel, Receiver};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// NVML from the simulator's directory, by full path, so that no real NVML can stand in.
fn nvml() -> Nvml {
    let dirs = std::env::var("LD_LIBRARY_PATH").expect("the child runs with LD_LIBRARY_PATH");
    let dir = dirs.split(':').next().unwrap_or_default();
    Nvml::builder()
        .lib_path(PathBuf::from(dir).join("libnvidia-ml.so.1").as_os_str())
        .init()
        .expect("nvmlInit on the simulator")
}

/// The simulator's model and shared state, as the child's environment names them.
fn sim() -> (Model, Shared) {
    let m = Model::from_env().expect("CUVISOR_SIM names a model");
    let path = std::env::var("CUVISOR_SIM_STATE").expect("CUVISOR_SIM_STATE");
    let s = Shared::attach_at(&m, path.as_ref()).expect("attach the simulator state");
    (m, s)
}

struct Watch {
    rx: Receiver<(Instant, HealthMap)>,
    last: HealthMap,
    _monitor: Monitor,
}

impl Watch {
    fn start(cfg: HealthConfig) -> Watch {
        let (tx, rx) = channel();
        let monitor = Monitor::spawn_nvml(Arc::new(nvml()), cfg, move |h: &HealthMap| {
            let _ = tx.send((Instant::now(), h.clone()));
        });
        let mut w = Watch {
            rx,
            last: HealthMap::new(),
            _monitor: monitor,
        };
        let (_, first) = w.next(Duration::from_secs(10)).expect("a first health map");
        assert!(!first.is_empty() && first.values().all(|&h| h), "{first:?}");
        w
    }

    fn next(&mut self, timeout: Duration) -> Option<(Instant, HealthMap)> {
        let (t, h) = self.rx.recv_timeout(timeout).ok()?;
        self.last = h.clone();
        Some((t, h))
    }

    /// Waits until `uuid` has health `healthy`; returns when the monitor published it.
    fn until(&mut self, uuid: &str, healthy: bool) -> Instant {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let (t, h) = self.next(left).unwrap_or_else(|| {
                panic!("{uuid} never became healthy={healthy}: {:?}", self.last)
            });
            if h.get(uuid) == Some(&healthy) {
                return t;
            }
        }
    }
}

fn cfg(hold_s: u64) -> HealthConfig {
    HealthConfig {
        xid_hold_seconds: hold_s,
        poll_ms: 20,
        ..HealthConfig::default()
    }
}

#[test]
fn xid_makes_unhealthy_until_the_hold_passes_and_a_repeat_extends_it() {
    if common::is_child() {
        let (m, s) = sim();
        let uuid = &m.devices[2].uuid;
        let mut w = Watch::start(cfg(1));

        // An application XID (31, MMU fault) is not critical: nothing changes.
        s.raise_xid(2, 31);
        assert!(w.next(Duration::from_millis(300)).is_none(), "{:?}", w.last);

        s.raise_xid(2, 79);
        w.until(uuid, false);
        assert_eq!(w.last.values().filter(|&&h| !h).count(), 1, "{:?}", w.last);
        std::thread::sleep(Duration::from_millis(500));
        let repeat = Instant::now();
        s.raise_xid(2, 48);
        let back = w.until(uuid, true);
        assert!(
            back >= repeat + Duration::from_secs(1),
            "healthy again {:?} after the repeat, before the 1 s hold",
            back - repeat
        );
        assert!(w.last.values().all(|&h| h), "{:?}", w.last);
        return;
    }
    common::Child::new("xid_makes_unhealthy_until_the_hold_passes_and_a_repeat_extends_it")
        .preset("dgx1-v100")
        .run()
        .success();
}

#[test]
fn nvlink_down_makes_unhealthy_and_up_again_clears() {
    if common::is_child() {
        let (m, s) = sim();
        let uuid = &m.devices[0].uuid;
        let mut w = Watch::start(cfg(1));
        s.device(0).nvlink_down.fetch_or(1 << 3, Ordering::AcqRel);
        w.until(uuid, false);
        assert_eq!(w.last.values().filter(|&&h| !h).count(), 1, "{:?}", w.last);
        s.device(0)
            .nvlink_down
            .fetch_and(!(1 << 3), Ordering::AcqRel);
        w.until(uuid, true);
        return;
    }
    common::Child::new("nvlink_down_makes_unhealthy_and_up_again_clears")
        .preset("dgx1-v100")
        .run()
        .success();
}

/// The seeds' check: below a GB/s threshold (here one link's worth short of a V100's 6) is
/// Unhealthy, even for a link that was already down when the monitor started.
#[test]
fn nvlink_bandwidth_below_threshold_is_unhealthy() {
    if common::is_child() {
        let (m, s) = sim();
        let uuid = &m.devices[1].uuid;
        s.device(1).nvlink_down.fetch_or(1, Ordering::AcqRel);
        let (tx, rx) = channel();
        let _monitor = Monitor::spawn_nvml(
            Arc::new(nvml()),
            HealthConfig {
                nvlink_min_gbps: Some(140.0),
                ..cfg(1)
            },
            move |h: &HealthMap| {
                let _ = tx.send(h.clone());
            },
        );
        let first = rx.recv_timeout(Duration::from_secs(10)).unwrap();
        assert_eq!(first.get(uuid), Some(&false), "{first:?}");
        assert_eq!(first.values().filter(|&&h| !h).count(), 1, "{first:?}");
        s.device(1).nvlink_down.fetch_and(!1, Ordering::AcqRel);
        let h = rx.recv_timeout(Duration::from_secs(10)).unwrap();
        assert!(h.values().all(|&h| h), "{h:?}");
        return;
    }
    common::Child::new("nvlink_bandwidth_below_threshold_is_unhealthy")
        .preset("dgx1-v100")
        .run()
        .success();
}
