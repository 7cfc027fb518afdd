//! GPU health: NVML XID events and NVLink state, turned into Healthy/Unhealthy per GPU UUID for
//! ListAndWatch.
//!
//! Two conditions make a GPU Unhealthy:
//!
//! - **A critical XID** (NVML event sets, `nvmlEventTypeXidCriticalError`; NVML reports every XID
//!   under that type, so the list below decides). The GPU stays Unhealthy for
//!   [`HealthConfig::xid_hold_seconds`] after the *last* critical XID: a repeat extends the hold.
//!   `0` holds it until the plugin restarts (NVIDIA's device plugin behaviour).
//! - **NVLink**: a link that has been up since the monitor started is down now, or the GPU's
//!   active NVLink bandwidth (active links x per-link rate of their generation, GB/s per
//!   direction) is below [`HealthConfig::nvlink_min_gbps`] — the seeds' NVLink check, read from
//!   NVML instead of parsed from `nvidia-smi topo -m`. It clears as soon as the links are back.
//!   A link that is already down when the monitor starts is only caught by the GB/s threshold:
//!   NVML reports unconnected links (e.g. a PCIe card without a bridge) as inactive too, so
//!   "inactive" alone cannot mean "broken". NVLink *throughput* counters measure traffic, not
//!   capacity (an idle link reads 0 GB/s), so they are deliberately not used for health.
//!
//! The state machine ([`Tracker`]) is plain Rust over a small [`Source`] trait; [`NvmlSource`] is
//! the NVML implementation (real driver or the simulator), and tests can drive a fake.
//!
//! ## Default critical XIDs
//!
//! [`DEFAULT_CRITICAL_XIDS`] (owned by `config`, with the reason for each).

use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::{Device, EventSet, Nvml};
use serde::Deserialize;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::topology::model::nvlink_gbps_per_link;

pub use crate::config::DEFAULT_CRITICAL_XIDS;

/// NVML_NVLINK_MAX_LINKS.
const MAX_LINKS: u32 = 18;

/// Health thresholds (the `health` section of the plugin's config).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HealthConfig {
    /// XIDs that make a GPU Unhealthy.
    pub critical_xids: Vec<u64>,
    /// How long a GPU stays Unhealthy after its last critical XID; 0 = until the plugin restarts.
    pub xid_hold_seconds: u64,
    /// A GPU with NVLinks whose active NVLink bandwidth (GB/s per direction) is below this is
    /// Unhealthy. `None`: only links going down count.
    pub nvlink_min_gbps: Option<f64>,
    /// How often NVLink state is read, and the longest an XID wait blocks (ms).
    pub poll_ms: u64,
    /// Health checks off: every GPU is always Healthy.
    pub disabled: bool,
}

impl Default for HealthConfig {
    /// The defaults of the plugin config's `[health]` section (`config` owns them).
    fn default() -> Self {
        HealthConfig::from(&crate::config::Health::default())
    }
}

impl From<&crate::config::Health> for HealthConfig {
    /// The plugin config's `[health]` section (`nvlink_min_gbps` 0 = off).
    fn from(h: &crate::config::Health) -> HealthConfig {
        HealthConfig {
            critical_xids: h.xid_critical.clone(),
            xid_hold_seconds: h.xid_hold_seconds,
            nvlink_min_gbps: (h.nvlink_min_gbps > 0.0).then_some(h.nvlink_min_gbps),
            poll_ms: h.poll_ms,
            disabled: false,
        }
    }
}

impl HealthConfig {
    fn poll(&self) -> Duration {
        Duration::from_millis(self.poll_ms.max(1))
    }
}

pub use crate::HealthMap;

/// Why a GPU is Unhealthy.
#[derive(Debug, Clone, PartialEq)]
pub enum Condition {
    /// A critical XID, the last one seen.
    Xid(u64),
    /// NVLinks (indices) that were up and are down now.
    NvlinkDown(Vec<u32>),
    /// Active NVLink bandwidth below the threshold.
    NvlinkSlow { gbps: f64, min_gbps: f64 },
}

impl fmt::Display for Condition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Condition::Xid(x) => write!(f, "critical XID {x}"),
            Condition::NvlinkDown(l) => write!(f, "NVLink(s) {l:?} down"),
            Condition::NvlinkSlow { gbps, min_gbps } => {
                write!(f, "NVLink bandwidth {gbps:.1} GB/s < {min_gbps:.1} GB/s")
            }
        }
    }
}

/// One reading of a GPU's NVLinks.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LinkSample {
    /// Bit i set: link i is active.
    pub active: u64,
    /// Active NVLink bandwidth, GB/s per direction.
    pub gbps: f64,
}

/// Where the monitor reads events and link state.
pub trait Source {
    /// The GPUs' UUIDs, by index.
    fn uuids(&self) -> Vec<String>;
    /// Waits up to `timeout` for the next XID event: (GPU index, XID).
    fn next_xid(&mut self, timeout: Duration) -> Option<(usize, u64)>;
    /// The GPU's NVLinks now; `None` when it has no NVLink or they cannot be read.
    fn links(&mut self, gpu: usize) -> Option<LinkSample>;
}

#[derive(Debug, Default, Clone)]
struct GpuState {
    uuid: String,
    /// The last critical XID and when it was seen.
    xid: Option<(u64, Instant)>,
    /// Links seen active at some point since the monitor started.
    seen_active: u64,
    last: Option<LinkSample>,
}

/// The health state machine: feed it XIDs and link samples, ask who is healthy.
#[derive(Debug)]
pub struct Tracker {
    cfg: HealthConfig,
    gpus: Vec<GpuState>,
}

impl Tracker {
    pub fn new(cfg: HealthConfig, uuids: Vec<String>) -> Tracker {
        let gpus = uuids
            .into_iter()
            .map(|uuid| GpuState {
                uuid,
                ..GpuState::default()
            })
            .collect();
        Tracker { cfg, gpus }
    }

    /// Records an XID on GPU `gpu`; returns whether it is a critical one.
    pub fn on_xid(&mut self, gpu: usize, xid: u64, now: Instant) -> bool {
        let critical = self.cfg.critical_xids.contains(&xid);
        if let (true, Some(g)) = (critical, self.gpus.get_mut(gpu)) {
            g.xid = Some((xid, now));
        }
        critical
    }

    pub fn on_links(&mut self, gpu: usize, sample: Option<LinkSample>) {
        if let Some(g) = self.gpus.get_mut(gpu) {
            if let Some(s) = sample {
                g.seen_active |= s.active;
            }
            g.last = sample;
        }
    }

    /// Why GPU `gpu` is Unhealthy at `now` (empty: Healthy).
    pub fn conditions(&self, gpu: usize, now: Instant) -> Vec<Condition> {
        let mut out = Vec::new();
        let Some(g) = self.gpus.get(gpu) else {
            return out;
        };
        if self.cfg.disabled {
            return out;
        }
        if let Some((xid, at)) = g.xid {
            let hold = self.cfg.xid_hold_seconds;
            if hold == 0 || now.saturating_duration_since(at) < Duration::from_secs(hold) {
                out.push(Condition::Xid(xid));
            }
        }
        if let Some(s) = g.last {
            let down = g.seen_active & !s.active;
            if down != 0 {
                out.push(Condition::NvlinkDown(
                    (0..64).filter(|i| down & (1u64 << i) != 0).collect(),
                ));
            }
            if let Some(min) = self.cfg.nvlink_min_gbps {
                if g.seen_active != 0 && s.gbps < min {
                    out.push(Condition::NvlinkSlow {
                        gbps: s.gbps,
                        min_gbps: min,
                    });
                }
            }
        }
        out
    }

    pub fn health(&self, now: Instant) -> HealthMap {
        (0..self.gpus.len())
            .map(|i| {
                (
                    self.gpus[i].uuid.clone(),
                    self.conditions(i, now).is_empty(),
                )
            })
            .collect()
    }

    /// When the next XID hold ends (the health may change then without any new input).
    pub fn next_expiry(&self, now: Instant) -> Option<Instant> {
        if self.cfg.xid_hold_seconds == 0 {
            return None;
        }
        let hold = Duration::from_secs(self.cfg.xid_hold_seconds);
        self.gpus
            .iter()
            .filter_map(|g| g.xid.map(|(_, at)| at + hold))
            .filter(|&t| t > now)
            .min()
    }

    pub fn uuid(&self, gpu: usize) -> Option<&str> {
        self.gpus.get(gpu).map(|g| g.uuid.as_str())
    }
}

/// Runs the monitor until `stop` is set: publishes the health map at start and on every
/// change, and logs each change with its reason on stderr.
pub fn run<S: Source>(
    src: &mut S,
    cfg: &HealthConfig,
    stop: &AtomicBool,
    mut publish: impl FnMut(&HealthMap),
) {
    let mut t = Tracker::new(cfg.clone(), src.uuids());
    let n = src.uuids().len();
    let poll = cfg.poll();
    let mut next_links = Instant::now();
    let mut published: Option<HealthMap> = None;
    while !stop.load(Ordering::Acquire) {
        let now = Instant::now();
        if now >= next_links {
            for i in 0..n {
                let s = src.links(i);
                t.on_links(i, s);
            }
            next_links = now + poll;
        }
        let now = Instant::now();
        let h = t.health(now);
        if published.as_ref() != Some(&h) {
            for i in 0..n {
                let Some(uuid) = t.uuid(i) else { continue };
                let ok = h.get(uuid).copied().unwrap_or(true);
                let before = published.as_ref().map(|p| p.get(uuid) == Some(&ok));
                // At start only the Unhealthy ones are worth a line.
                if before == Some(true) || (before.is_none() && ok) {
                    continue;
                }
                if ok {
                    eprintln!("cuvisor-device-plugin: GPU {uuid} is Healthy");
                } else {
                    let why: Vec<String> = t
                        .conditions(i, now)
                        .iter()
                        .map(ToString::to_string)
                        .collect();
                    eprintln!(
                        "cuvisor-device-plugin: GPU {uuid} is Unhealthy: {}",
                        why.join(", ")
                    );
                }
            }
            publish(&h);
            published = Some(h);
        }
        let mut until = next_links;
        if let Some(e) = t.next_expiry(now) {
            until = until.min(e);
        }
        let wait = until.saturating_duration_since(Instant::now());
        if let Some((gpu, xid)) = src.next_xid(wait) {
            let critical = t.on_xid(gpu, xid, Instant::now());
            if !critical {
                eprintln!(
                    "cuvisor-device-plugin: GPU {} reported XID {xid} (not critical: ignored)",
                    t.uuid(gpu).unwrap_or("?")
                );
            }
        }
    }
}

/// A publisher for [`run`]/[`Monitor::spawn_nvml`] that feeds the server's health channel
/// ([`crate::HealthSender`]): ListAndWatch re-sends on every change.
pub fn to_watch(tx: crate::HealthSender) -> impl FnMut(&HealthMap) + Send + 'static {
    move |h: &HealthMap| {
        tx.send_replace(h.clone());
    }
}

/// A running monitor thread; stops (and joins) on drop.
pub struct Monitor {
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<()>>,
}

impl Monitor {
    /// Starts [`run`] on NVML in a thread of its own. The first health map is published before
    /// this returns an error-free monitor, so a caller sees every GPU at once.
    pub fn spawn_nvml(
        nvml: Arc<Nvml>,
        cfg: HealthConfig,
        publish: impl FnMut(&HealthMap) + Send + 'static,
    ) -> Monitor {
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let handle = std::thread::Builder::new()
            .name("cuvisor-health".into())
            .spawn(move || {
                let mut src = NvmlSource::new(&nvml, &cfg);
                run(&mut src, &cfg, &s, publish);
            })
            .expect("spawn the health thread");
        Monitor {
            stop,
            handle: Some(handle),
        }
    }

    /// Stops the monitor and waits for its thread (at most one poll interval).
    pub fn stop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

impl Drop for Monitor {
    fn drop(&mut self) {
        self.stop();
    }
}

/// NVML as a [`Source`]: an event set with every GPU registered for XID events (when the driver
/// supports it; otherwise only NVLink is watched), and NVLink state per link.
pub struct NvmlSource<'n> {
    devices: Vec<Device<'n>>,
    uuids: Vec<String>,
    set: Option<EventSet<'n>>,
    warned: bool,
}

impl<'n> NvmlSource<'n> {
    pub fn new(nvml: &'n Nvml, cfg: &HealthConfig) -> NvmlSource<'n> {
        let count = nvml.device_count().unwrap_or(0);
        let devices: Vec<Device<'n>> = (0..count)
            .filter_map(|i| nvml.device_by_index(i).ok())
            .collect();
        let uuids = devices
            .iter()
            .enumerate()
            .map(|(i, d)| d.uuid().unwrap_or_else(|_| format!("GPU{i}")))
            .collect();
        let mut set = if cfg.disabled {
            None
        } else {
            match nvml.create_event_set() {
                Ok(s) => Some(s),
                Err(e) => {
                    eprintln!("cuvisor-device-plugin: no NVML event set ({e}): XIDs not watched");
                    None
                }
            }
        };
        for (i, d) in devices.iter().enumerate() {
            let Some(s) = set.take() else { break };
            match d.register_events(EventTypes::CRITICAL_XID_ERROR, s) {
                Ok(s) => set = Some(s),
                Err(e) => {
                    // The set is gone with the error; XIDs of the others cannot be watched either
                    // without a fresh one, which would fail the same way.
                    eprintln!(
                        "cuvisor-device-plugin: GPU{i}: XID events not supported ({}): XIDs not \
                         watched",
                        e.error
                    );
                }
            }
        }
        NvmlSource {
            devices,
            uuids,
            set,
            warned: false,
        }
    }
}

impl Source for NvmlSource<'_> {
    fn uuids(&self) -> Vec<String> {
        self.uuids.clone()
    }

    fn next_xid(&mut self, timeout: Duration) -> Option<(usize, u64)> {
        let Some(set) = &self.set else {
            std::thread::sleep(timeout);
            return None;
        };
        let ms = timeout.as_millis().min(u32::MAX as u128) as u32;
        match set.wait(ms) {
            Ok(ev) => {
                let xid = match ev.event_data {
                    Some(XidError::Value(x)) => x,
                    _ => return None,
                };
                let uuid = ev.device.uuid().ok()?;
                let gpu = self.uuids.iter().position(|u| *u == uuid)?;
                Some((gpu, xid))
            }
            Err(NvmlError::Timeout) => None,
            Err(e) => {
                if !self.warned {
                    eprintln!("cuvisor-device-plugin: waiting for NVML events: {e}");
                    self.warned = true;
                }
                std::thread::sleep(timeout);
                None
            }
        }
    }

    fn links(&mut self, gpu: usize) -> Option<LinkSample> {
        let dev = self.devices.get(gpu)?;
        let mut s = LinkSample::default();
        let mut any = false;
        for l in 0..MAX_LINKS {
            let link = dev.link_wrapper_for(l);
            match link.is_active() {
                Ok(active) => {
                    any = true;
                    if active {
                        s.active |= 1u64 << l;
                        let generation = link
                            .version()
                            .ok()
                            .and_then(crate::topology::nvml::nvlink_generation);
                        s.gbps += nvlink_gbps_per_link(generation);
                    }
                }
                Err(NvmlError::NotSupported) => break,
                Err(_) => continue,
            }
        }
        any.then_some(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tracker(hold: u64, min: Option<f64>) -> Tracker {
        let cfg = HealthConfig {
            xid_hold_seconds: hold,
            nvlink_min_gbps: min,
            ..HealthConfig::default()
        };
        Tracker::new(cfg, vec!["GPU-a".into(), "GPU-b".into()])
    }

    #[test]
    fn a_critical_xid_holds_then_clears_and_a_repeat_extends() {
        let mut t = tracker(10, None);
        let t0 = Instant::now();
        assert!(t.on_xid(0, 79, t0));
        assert_eq!(t.conditions(0, t0), [Condition::Xid(79)]);
        assert!(t.health(t0)["GPU-b"]);
        assert!(!t.health(t0 + Duration::from_secs(9))["GPU-a"]);
        t.on_xid(0, 48, t0 + Duration::from_secs(9));
        assert!(!t.health(t0 + Duration::from_secs(12))["GPU-a"]);
        assert!(t.health(t0 + Duration::from_secs(19))["GPU-a"]);
        assert_eq!(t.next_expiry(t0), Some(t0 + Duration::from_secs(19)));
    }

    #[test]
    fn application_xids_are_ignored_and_hold_zero_is_sticky() {
        let mut t = tracker(0, None);
        let t0 = Instant::now();
        assert!(!t.on_xid(1, 13, t0));
        assert!(!t.on_xid(1, 31, t0));
        assert!(t.health(t0)["GPU-b"]);
        t.on_xid(1, 95, t0);
        assert!(!t.health(t0 + Duration::from_secs(100_000))["GPU-b"]);
        assert_eq!(t.next_expiry(t0), None);
    }

    #[test]
    fn a_link_that_was_up_and_is_down_is_unhealthy_until_it_is_back() {
        let mut t = tracker(10, None);
        let now = Instant::now();
        let up = LinkSample {
            active: 0b111111,
            gbps: 150.0,
        };
        t.on_links(0, Some(up));
        assert!(t.health(now)["GPU-a"]);
        t.on_links(
            0,
            Some(LinkSample {
                active: 0b110111,
                gbps: 125.0,
            }),
        );
        assert_eq!(t.conditions(0, now), [Condition::NvlinkDown(vec![3])]);
        t.on_links(0, Some(up));
        assert!(t.health(now)["GPU-a"]);
    }

    #[test]
    fn bandwidth_below_the_threshold_is_unhealthy_but_not_on_pcie_only_gpus() {
        let mut t = tracker(10, Some(140.0));
        let now = Instant::now();
        // Down from the start: only the threshold sees it.
        t.on_links(
            0,
            Some(LinkSample {
                active: 0b11111,
                gbps: 125.0,
            }),
        );
        t.on_links(
            1,
            Some(LinkSample {
                active: 0,
                gbps: 0.0,
            }),
        );
        assert!(matches!(
            t.conditions(0, now).as_slice(),
            [Condition::NvlinkSlow { .. }]
        ));
        assert!(t.health(now)["GPU-b"]);
    }

    /// The plugin config's `[health]` section, defaults and values, as the checker reads it.
    #[test]
    fn the_config_section_becomes_the_thresholds() {
        let d = crate::config::Config::default().health;
        assert_eq!(HealthConfig::from(&d), HealthConfig::default());
        assert_eq!(HealthConfig::default().critical_xids, DEFAULT_CRITICAL_XIDS);
        assert_eq!(HealthConfig::default().nvlink_min_gbps, None, "0 GB/s: off");
        let c = crate::config::Config::parse(
            "[health]\nxid_hold_seconds = 1\nnvlink_min_gbps = 20.5\npoll_ms = 50\n",
        )
        .unwrap();
        let h = HealthConfig::from(&c.health);
        assert_eq!(
            (h.xid_hold_seconds, h.poll_ms, h.nvlink_min_gbps),
            (1, 50, Some(20.5))
        );
    }

    #[test]
    fn disabled_is_always_healthy_and_config_parses() {
        let mut t = Tracker::new(
            HealthConfig {
                disabled: true,
                ..HealthConfig::default()
            },
            vec!["GPU-a".into()],
        );
        t.on_xid(0, 79, Instant::now());
        assert!(t.health(Instant::now())["GPU-a"]);
        let c: HealthConfig =
            serde_json::from_str(r#"{"critical_xids":[79],"xid_hold_seconds":5}"#).unwrap();
        assert_eq!(c.critical_xids, [79]);
        assert_eq!(c.poll_ms, 1000);
        assert!(serde_json::from_str::<HealthConfig>(r#"{"xid_hold":5}"#).is_err());
    }
}
