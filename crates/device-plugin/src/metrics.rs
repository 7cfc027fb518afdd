//! Prometheus metrics over HTTP (text exposition format 0.0.4): `GET /metrics`.
//!
//! Per container and GPU (labels `namespace`, `pod`, `container` from kubelet's PodResources
//! API — empty while it has not answered — plus `gpu_uuid` and `allocation`, the plugin's id
//! for the Allocate). Two sources, never mixed: the plugin's own records (the registry: what
//! Allocate granted), and the container's ledger (`crates/shm`'s `Ledger`), which the
//! container writes: every figure from it is a **claim**, shown as written, never trusted, and
//! its HELP line says so.
//!
//! | metric | type | source |
//! |---|---|---|
//! | `cuvisor_container_memory_limit_bytes` | gauge | **granted**: the quota Allocate gave, from the registry |
//! | `cuvisor_container_memory_claimed_limit_bytes` | gauge | claim: the ledger's `limit` as written |
//! | `cuvisor_container_memory_used_bytes` | gauge | claim: `used` |
//! | `cuvisor_container_memory_peak_bytes` | gauge | claim: `peak` |
//! | `cuvisor_container_memory_denied_total` | counter | claim: `denied` (allocations refused) |
//! | `cuvisor_container_gpu_seconds_total` | counter | claim: `gpu_ns` (GPU time used) |
//! | `cuvisor_container_throttled_seconds_total` | counter | claim: `throttled_ns` (held back by the share) |
//! | `cuvisor_container_launches_total` | counter | claim: `launches` |
//!
//! Per GPU (`gpu_uuid`): `cuvisor_gpu_memory_quota_bytes` (granted: the sum of the quotas
//! handed out), `cuvisor_gpu_allocations` (live allocations on it), `cuvisor_gpu_healthy` (1/0,
//! from the health checker); sums of the containers' claims: `cuvisor_gpu_memory_used_bytes`,
//! `cuvisor_gpu_memory_denied_total`, `cuvisor_gpu_seconds_total`,
//! `cuvisor_gpu_throttled_seconds_total`. Per resource: `cuvisor_allocations`. The sweeper
//! (`cleanup`): `cuvisor_cleanup_given_up_total` (removals of an allocation's directory given up
//! on for now, over the walk's bounds) and `cuvisor_cleanup_pending_directories` (directories
//! waiting for a later sweep). And `cuvisor_allocation_topology_score`, a histogram of the
//! topology score (0..1, the allocator's weighted total) of every multi-GPU allocation, observed
//! once per allocation.
//!
//! The seeds' two formulas, per multi-GPU allocation (an Allocate whose devices are on 2 or more
//! GPUs, whole GPUs or memory units; single-GPU allocations have no such series), from the link
//! model ([`comm`]), granted (the plugin's own figures, nothing from the container):
//!
//! | metric | type | labels | what |
//! |---|---|---|---|
//! | `cuvisor_allocation_comm_efficiency_bytes_per_second` | gauge | namespace, pod, container, allocation | sum(bytes_i x bw_i) / sum(bytes_i) of a ring all-reduce over its GPUs (its bus bandwidth) |
//! | `cuvisor_allocation_comm_peak_bytes_per_second` | gauge | the same | the same for the best group of as many GPUs on the node |
//! | `cuvisor_allocation_topology_loss_ratio` | gauge | the same | 1 - efficiency / peak (0..1) |
//! | `cuvisor_allocation_topology_loss` | histogram | | the loss of every multi-GPU allocation, observed once per allocation |
//!
//! The gauges go with the allocation (they are rendered from the registry's live allocations).
//!
//! PromQL (the seeds' "topology match" monitoring query, and memory against quota):
//!
//! ```promql
//! # p50 / p90 topology score of multi-GPU allocations over the last hour, per node
//! histogram_quantile(0.5, sum by (le, instance) (rate(cuvisor_allocation_topology_score_bucket[1h])))
//! histogram_quantile(0.9, sum by (le, instance) (rate(cuvisor_allocation_topology_score_bucket[1h])))
//! # mean score, and the share of allocations scoring 0.8 or less (the bucket counts observations <= its bound)
//! sum(rate(cuvisor_allocation_topology_score_sum[1h])) / sum(rate(cuvisor_allocation_topology_score_count[1h]))
//! sum(rate(cuvisor_allocation_topology_score_bucket{le="0.8"}[1h])) / sum(rate(cuvisor_allocation_topology_score_count[1h]))
//! # the seeds' "WHERE topology_score < 80": allocations whose topology loss stayed above 0.2
//! # for the last 10 minutes (and that existed 10 minutes ago)
//! min_over_time(cuvisor_allocation_topology_loss_ratio[10m]) > 0.2
//!   and cuvisor_allocation_topology_loss_ratio offset 10m
//! # p90 topology loss of the multi-GPU allocations made over the last hour
//! histogram_quantile(0.9, sum by (le) (rate(cuvisor_allocation_topology_loss_bucket[1h])))
//! # containers above 90% of their memory quota
//! cuvisor_container_memory_used_bytes / cuvisor_container_memory_limit_bytes > 0.9
//! # refused allocations per second, per pod
//! sum by (namespace, pod) (rate(cuvisor_container_memory_denied_total[5m]))
//! # fraction of the time a container was held back by its compute share
//! rate(cuvisor_container_throttled_seconds_total[5m])
//! ```

pub mod comm;

use crate::podresources::{Owner, PodCache};
use crate::registry::{Allocation, Kind, RegistryView};
use crate::HealthReceiver;
use comm::{Comm, CommModel};
use cuvisor_shm::ledger::Snapshot;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Write as _;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Upper bounds of the topology score histogram's buckets (`+Inf` is added).
pub const SCORE_BUCKETS: [f64; 10] = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0];

/// Upper bounds of the topology loss histogram's buckets (`+Inf` is added): 0 on its own (a
/// pick as good as the node allows), then the seeds' 0.2 threshold among them.
pub const LOSS_BUCKETS: [f64; 12] = [0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0];

/// The score of a set of GPUs (by UUID); `None` when it cannot be scored.
pub type Scorer = Box<dyn Fn(&[String]) -> Option<f64> + Send + Sync>;

/// A scorer from the node's allocator: the weighted total of [`crate::topology::Allocator::score`].
pub fn topology_scorer(
    allocator: crate::topology::Allocator,
    topology: &crate::topology::Topology,
    weights: crate::topology::Weights,
) -> Scorer {
    let uuids: Vec<Option<String>> = topology.gpus().iter().map(|g| g.uuid.clone()).collect();
    Box::new(move |set: &[String]| {
        let idx: Option<Vec<usize>> = set
            .iter()
            .map(|u| uuids.iter().position(|x| x.as_deref() == Some(u.as_str())))
            .collect();
        allocator.score(&idx?, &weights).ok().map(|s| s.total)
    })
}

/// A cumulative histogram.
#[derive(Clone, Debug, PartialEq)]
pub struct Histogram {
    /// Upper bounds of the buckets, ascending.
    pub bounds: &'static [f64],
    /// Counts per bucket of `bounds` (not cumulative; rendered cumulatively).
    pub counts: Vec<u64>,
    pub count: u64,
    pub sum: f64,
}

/// The topology score's ([`SCORE_BUCKETS`]).
impl Default for Histogram {
    fn default() -> Histogram {
        Histogram::new(&SCORE_BUCKETS)
    }
}

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Histogram {
        Histogram {
            bounds,
            counts: vec![0; bounds.len()],
            count: 0,
            sum: 0.0,
        }
    }

    pub fn observe(&mut self, v: f64) {
        if let Some(i) = self.bounds.iter().position(|&b| v <= b) {
            self.counts[i] += 1;
        }
        self.count += 1;
        self.sum += v;
    }

    fn write(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} histogram");
        let mut cum = 0;
        for (b, n) in self.bounds.iter().zip(&self.counts) {
            cum += n;
            let _ = writeln!(out, "{name}_bucket{{le=\"{b:?}\"}} {cum}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum {}", fmt_value(self.sum));
        let _ = writeln!(out, "{name}_count {}", self.count);
    }
}

/// What render shows of topology: the score histogram, and the seeds' two formulas per
/// multi-GPU allocation (by allocation id) with the histogram of their losses.
#[derive(Clone, Debug, PartialEq)]
pub struct TopologyFigures {
    pub scores: Histogram,
    pub comm: BTreeMap<String, Comm>,
    pub losses: Histogram,
}

impl Default for TopologyFigures {
    fn default() -> TopologyFigures {
        TopologyFigures {
            scores: Histogram::default(),
            comm: BTreeMap::new(),
            losses: Histogram::new(&LOSS_BUCKETS),
        }
    }
}

/// The per-allocation communication figures computed so far, and their losses' histogram.
struct CommState {
    /// Figures by allocation id (None: not computable, e.g. a UUID the node lacks), computed
    /// once per allocation, dropped when it goes.
    by_id: HashMap<String, Option<Comm>>,
    losses: Histogram,
}

/// What the endpoint reads.
pub struct Metrics {
    registry: RegistryView,
    pods: PodCache,
    health: Option<HealthReceiver>,
    scorer: Option<Scorer>,
    scores: Mutex<(Histogram, HashSet<String>)>,
    comm_model: Option<CommModel>,
    comm: Mutex<CommState>,
    cleanup: Option<Arc<crate::cleanup::CleanupStats>>,
    /// The plugin's status file: `/healthz` answers what `probe` answers from it.
    status: Option<std::path::PathBuf>,
}

impl Metrics {
    pub fn new(registry: RegistryView, pods: PodCache) -> Metrics {
        Metrics {
            registry,
            pods,
            health: None,
            scorer: None,
            scores: Mutex::new((Histogram::default(), HashSet::new())),
            comm_model: None,
            comm: Mutex::new(CommState {
                by_id: HashMap::new(),
                losses: Histogram::new(&LOSS_BUCKETS),
            }),
            cleanup: None,
            status: None,
        }
    }

    /// `/healthz` from the plugin's status file (`crate::status`, as `probe` reads it): 200 when
    /// alive, 503 with the reason when not. Without it, `/healthz` says only that this endpoint
    /// answers.
    pub fn with_status(mut self, path: std::path::PathBuf) -> Metrics {
        self.status = Some(path);
        self
    }

    /// The sweeper's counters (`Sweeper::stats`).
    pub fn with_cleanup(mut self, c: Arc<crate::cleanup::CleanupStats>) -> Metrics {
        self.cleanup = Some(c);
        self
    }

    pub fn with_health(mut self, h: HealthReceiver) -> Metrics {
        self.health = Some(h);
        self
    }

    pub fn with_scorer(mut self, s: Scorer) -> Metrics {
        self.scorer = Some(s);
        self
    }

    /// The node's link model: every multi-GPU allocation gets its communication efficiency and
    /// topology loss ([`comm`]).
    pub fn with_comm_model(mut self, m: CommModel) -> Metrics {
        self.comm_model = Some(m);
        self
    }

    /// The seeds' two formulas for every live multi-GPU allocation (computed once per
    /// allocation: its loss is observed then), and the loss histogram. Figures of allocations
    /// that are gone are dropped.
    fn comm_figures(&self, allocs: &[Allocation]) -> (BTreeMap<String, Comm>, Histogram) {
        let mut st = self.comm.lock().unwrap_or_else(|e| e.into_inner());
        let mut out = BTreeMap::new();
        if let Some(model) = &self.comm_model {
            for a in allocs {
                let figures = match st.by_id.get(&a.id) {
                    Some(f) => *f,
                    None => {
                        let uuids: Vec<String> = a.gpus.iter().map(|g| g.uuid.clone()).collect();
                        let f = model.of_uuids(&uuids);
                        if let Some(c) = &f {
                            st.losses.observe(c.loss);
                        }
                        st.by_id.insert(a.id.clone(), f);
                        f
                    }
                };
                if let Some(c) = figures {
                    out.insert(a.id.clone(), c);
                }
            }
            let live: HashSet<&str> = allocs.iter().map(|a| a.id.as_str()).collect();
            st.by_id.retain(|id, _| live.contains(id.as_str()));
        }
        (out, st.losses.clone())
    }

    /// Records a multi-GPU allocation's score (e.g. from Allocate); an allocation whose id was
    /// recorded is not scored again at scrape time.
    pub fn observe_score(&self, allocation_id: &str, score: f64) {
        let mut g = self.scores.lock().unwrap_or_else(|e| e.into_inner());
        if g.1.insert(allocation_id.to_string()) {
            g.0.observe(score);
        }
    }

    /// The exposition text now.
    pub fn render(&self) -> String {
        let allocs = self.registry.list();
        if let Some(scorer) = &self.scorer {
            for a in &allocs {
                if a.kind == Kind::Gpu && a.gpus.len() > 1 {
                    let seen = self
                        .scores
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .1
                        .contains(&a.id);
                    if !seen {
                        let uuids: Vec<String> = a.gpus.iter().map(|g| g.uuid.clone()).collect();
                        if let Some(s) = scorer(&uuids) {
                            self.observe_score(&a.id, s);
                        }
                    }
                }
            }
        }
        let health = self
            .health
            .as_ref()
            .map(|h| h.borrow().clone())
            .unwrap_or_default();
        let scores = self
            .scores
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .0
            .clone();
        let (comm, losses) = self.comm_figures(&allocs);
        let topo = TopologyFigures {
            scores,
            comm,
            losses,
        };
        let rows: Vec<(Allocation, Owner)> = allocs
            .into_iter()
            .map(|a| {
                let o = self.pods.owner_of(&a).unwrap_or_default();
                (a, o)
            })
            .collect();
        render(&rows, &health, &topo, self.cleanup.as_deref())
    }
}

/// One GPU entry of one container's ledger.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Usage {
    pub used: u64,
    pub limit: u64,
    pub peak: u64,
    pub denied: u64,
    pub gpu_ns: u64,
    pub throttled_ns: u64,
    pub launches: u64,
}

/// `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` from the ledger's 16 bytes.
pub fn uuid_string(b: [u8; 16]) -> String {
    cuvisor_shm::uuid::format(&b)
}

/// Every GPU entry of the ledger in `a`'s ledger directory that names one of the allocation's
/// own GPUs (empty if none or unreadable). The ledger is the container's to write: it is read
/// as a bounded, checked copy (`ledger::Snapshot`), never mapped, locked or followed through a
/// symlink, and what it says is shown, never trusted for anything else.
pub fn read_ledger(a: &Allocation) -> Vec<(String, Usage)> {
    let Some(dir) = &a.ledger_dir else {
        return Vec::new();
    };
    let Ok(snap) = Snapshot::read(dir) else {
        return Vec::new();
    };
    let mut seen = std::collections::HashSet::new();
    snap.devices
        .into_iter()
        .map(|e| (uuid_string(e.uuid), e))
        .filter(|(uuid, _)| a.gpus.iter().any(|g| &g.uuid == uuid))
        // One entry per GPU, the first: a planted ledger may list one GPU many times.
        .filter(|(uuid, _)| seen.insert(uuid.clone()))
        .map(|(uuid, e)| {
            (
                uuid,
                Usage {
                    used: e.used,
                    limit: e.limit,
                    peak: e.peak,
                    denied: e.denied,
                    gpu_ns: e.gpu_ns,
                    throttled_ns: e.throttled_ns,
                    launches: e.launches,
                },
            )
        })
        .collect()
}

/// A label value escaped for the text format (backslash, double quote, newline).
pub fn escape_label(v: &str) -> String {
    let mut s = String::with_capacity(v.len());
    for c in v.chars() {
        match c {
            '\\' => s.push_str("\\\\"),
            '"' => s.push_str("\\\""),
            '\n' => s.push_str("\\n"),
            c => s.push(c),
        }
    }
    s
}

fn labels(pairs: &[(&str, &str)]) -> String {
    let body: Vec<String> = pairs
        .iter()
        .map(|(k, v)| format!("{k}=\"{}\"", escape_label(v)))
        .collect();
    format!("{{{}}}", body.join(","))
}

/// One metric family: HELP, TYPE and its samples (label set, value).
struct Family {
    name: &'static str,
    kind: &'static str,
    help: &'static str,
    samples: Vec<(String, f64)>,
}

impl Family {
    fn new(name: &'static str, kind: &'static str, help: &'static str) -> Family {
        Family {
            name,
            kind,
            help,
            samples: Vec::new(),
        }
    }
    fn write(&self, out: &mut String) {
        let _ = writeln!(out, "# HELP {} {}", self.name, self.help);
        let _ = writeln!(out, "# TYPE {} {}", self.name, self.kind);
        for (l, v) in &self.samples {
            let _ = writeln!(out, "{}{l} {}", self.name, fmt_value(*v));
        }
    }
}

fn fmt_value(v: f64) -> String {
    if v.is_finite() && v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{}", v as i64)
    } else {
        format!("{v}")
    }
}

const NS: f64 = 1e9;

/// The exposition text for these allocations (each with its container), GPU health and
/// topology figures. Reads every allocation's ledger.
pub fn render(
    rows: &[(Allocation, Owner)],
    health: &crate::HealthMap,
    topo: &TopologyFigures,
    cleanup: Option<&crate::cleanup::CleanupStats>,
) -> String {
    let mut c_used = Family::new(
        "cuvisor_container_memory_used_bytes",
        "gauge",
        "Claimed by the container's ledger (container-written, not verified): GPU memory it holds now, per GPU.",
    );
    let mut c_limit = Family::new(
        "cuvisor_container_memory_limit_bytes",
        "gauge",
        "The GPU memory quota the plugin granted the container, per GPU (the plugin's own record).",
    );
    let mut c_claimed_limit = Family::new(
        "cuvisor_container_memory_claimed_limit_bytes",
        "gauge",
        "Claimed by the container's ledger (container-written, not verified): its limit as written there, per GPU.",
    );
    let mut c_peak = Family::new(
        "cuvisor_container_memory_peak_bytes",
        "gauge",
        "Claimed by the container's ledger (container-written, not verified): the most GPU memory it held at once, per GPU.",
    );
    let mut c_denied = Family::new(
        "cuvisor_container_memory_denied_total",
        "counter",
        "Claimed by the container's ledger (container-written, not verified): GPU memory allocations refused for the quota.",
    );
    let mut c_gpu = Family::new(
        "cuvisor_container_gpu_seconds_total",
        "counter",
        "Claimed by the container's ledger (container-written, not verified): GPU time its kernel launches used.",
    );
    let mut c_thr = Family::new(
        "cuvisor_container_throttled_seconds_total",
        "counter",
        "Claimed by the container's ledger (container-written, not verified): time its launching threads were held back by its compute share.",
    );
    let mut c_launch = Family::new(
        "cuvisor_container_launches_total",
        "counter",
        "Claimed by the container's ledger (container-written, not verified): kernel, cooperative and graph launches.",
    );
    let mut a_eff = Family::new(
        "cuvisor_allocation_comm_efficiency_bytes_per_second",
        "gauge",
        "The seeds' communication efficiency of a multi-GPU allocation, sum(bytes_i x bandwidth_i) / sum(bytes_i) over a ring all-reduce across its GPUs (its bus bandwidth), from the plugin's link model.",
    );
    let mut a_peak = Family::new(
        "cuvisor_allocation_comm_peak_bytes_per_second",
        "gauge",
        "The communication efficiency of the best group of as many GPUs on this node (the peak the topology loss compares with).",
    );
    let mut a_loss = Family::new(
        "cuvisor_allocation_topology_loss_ratio",
        "gauge",
        "The seeds' topology loss rate of a multi-GPU allocation: 1 - its communication efficiency / that of the best group of as many GPUs on this node (0..1).",
    );
    let mut by_gpu: BTreeMap<String, (Usage, u64)> = BTreeMap::new();
    let mut by_resource: BTreeMap<String, u64> = BTreeMap::new();
    for (a, o) in rows {
        *by_resource.entry(a.resource.clone()).or_default() += 1;
        if let Some(c) = topo.comm.get(&a.id) {
            let l = labels(&[
                ("namespace", &o.namespace),
                ("pod", &o.pod),
                ("container", &o.container),
                ("allocation", &a.id),
            ]);
            a_eff.samples.push((l.clone(), c.efficiency_gbps * 1e9));
            a_peak.samples.push((l.clone(), c.peak_gbps * 1e9));
            a_loss.samples.push((l, c.loss));
        }
        for g in &a.gpus {
            let e = by_gpu.entry(g.uuid.clone()).or_default();
            e.1 += 1;
            e.0.limit += g.quota.unwrap_or(0);
        }
        let ledger = read_ledger(a);
        // The limit is what Allocate granted, whatever the ledger says.
        for g in &a.gpus {
            if let Some(q) = g.quota {
                let l = labels(&[
                    ("namespace", &o.namespace),
                    ("pod", &o.pod),
                    ("container", &o.container),
                    ("gpu_uuid", &g.uuid),
                    ("allocation", &a.id),
                ]);
                c_limit.samples.push((l, q as f64));
            }
        }
        for (uuid, u) in ledger {
            let l = labels(&[
                ("namespace", &o.namespace),
                ("pod", &o.pod),
                ("container", &o.container),
                ("gpu_uuid", &uuid),
                ("allocation", &a.id),
            ]);
            c_used.samples.push((l.clone(), u.used as f64));
            c_claimed_limit.samples.push((l.clone(), u.limit as f64));
            c_peak.samples.push((l.clone(), u.peak as f64));
            c_denied.samples.push((l.clone(), u.denied as f64));
            c_gpu.samples.push((l.clone(), u.gpu_ns as f64 / NS));
            c_thr.samples.push((l.clone(), u.throttled_ns as f64 / NS));
            c_launch.samples.push((l, u.launches as f64));
            let e = by_gpu.entry(uuid).or_default();
            // Container-written numbers: a sum must not wrap (or panic) on a planted u64::MAX.
            e.0.used = e.0.used.saturating_add(u.used);
            e.0.denied = e.0.denied.saturating_add(u.denied);
            e.0.gpu_ns = e.0.gpu_ns.saturating_add(u.gpu_ns);
            e.0.throttled_ns = e.0.throttled_ns.saturating_add(u.throttled_ns);
        }
    }
    for uuid in health.keys() {
        by_gpu.entry(uuid.clone()).or_default();
    }

    let mut g_used = Family::new(
        "cuvisor_gpu_memory_used_bytes",
        "gauge",
        "Sum of the containers' ledger claims (container-written, not verified): GPU memory they hold on this GPU.",
    );
    let mut g_quota = Family::new(
        "cuvisor_gpu_memory_quota_bytes",
        "gauge",
        "Sum of the memory quotas handed out on this GPU.",
    );
    let mut g_denied = Family::new(
        "cuvisor_gpu_memory_denied_total",
        "counter",
        "Sum of the containers' ledger claims (container-written, not verified): allocations refused for the quota on this GPU.",
    );
    let mut g_gpu = Family::new(
        "cuvisor_gpu_seconds_total",
        "counter",
        "Sum of the containers' ledger claims (container-written, not verified): GPU time used on this GPU.",
    );
    let mut g_thr = Family::new(
        "cuvisor_gpu_throttled_seconds_total",
        "counter",
        "Sum of the containers' ledger claims (container-written, not verified): time held back by their compute shares on this GPU.",
    );
    let mut g_allocs = Family::new(
        "cuvisor_gpu_allocations",
        "gauge",
        "Live allocations (containers) on this GPU.",
    );
    let mut g_health = Family::new(
        "cuvisor_gpu_healthy",
        "gauge",
        "1 if the GPU is Healthy (no critical XID held, NVLinks up), else 0.",
    );
    for (uuid, (u, n)) in &by_gpu {
        let l = labels(&[("gpu_uuid", uuid)]);
        g_used.samples.push((l.clone(), u.used as f64));
        g_quota.samples.push((l.clone(), u.limit as f64));
        g_denied.samples.push((l.clone(), u.denied as f64));
        g_gpu.samples.push((l.clone(), u.gpu_ns as f64 / NS));
        g_thr.samples.push((l.clone(), u.throttled_ns as f64 / NS));
        g_allocs.samples.push((l.clone(), *n as f64));
        let ok = health.get(uuid).copied().unwrap_or(true);
        g_health.samples.push((l, if ok { 1.0 } else { 0.0 }));
    }
    let mut allocs = Family::new(
        "cuvisor_allocations",
        "gauge",
        "Live allocations, per extended resource.",
    );
    for (r, n) in &by_resource {
        allocs.samples.push((labels(&[("resource", r)]), *n as f64));
    }

    let mut given_up = Family::new(
        "cuvisor_cleanup_given_up_total",
        "counter",
        "Removals of an allocation's directory given up on for now (over the walk's bounds, or a mount in it); each is tried again at the next sweep.",
    );
    let mut pending = Family::new(
        "cuvisor_cleanup_pending_directories",
        "gauge",
        "Allocation directories given up on and waiting for a later sweep.",
    );
    if let Some(c) = cleanup {
        given_up
            .samples
            .push((String::new(), c.given_up_total() as f64));
        pending.samples.push((String::new(), c.pending() as f64));
    }

    let mut out = String::new();
    for f in [
        &c_used,
        &c_limit,
        &c_claimed_limit,
        &c_peak,
        &c_denied,
        &c_gpu,
        &c_thr,
        &c_launch,
        &g_used,
        &g_quota,
        &g_denied,
        &g_gpu,
        &g_thr,
        &g_allocs,
        &g_health,
        &allocs,
        &given_up,
        &pending,
        &a_eff,
        &a_peak,
        &a_loss,
    ] {
        f.write(&mut out);
    }
    topo.scores.write(
        &mut out,
        "cuvisor_allocation_topology_score",
        "Topology score (0..1) of multi-GPU allocations.",
    );
    topo.losses.write(
        &mut out,
        "cuvisor_allocation_topology_loss",
        "Topology loss rate (0..1, 1 - communication efficiency / the best on the node) of multi-GPU allocations, observed once per allocation.",
    );
    out
}

/// At most this many metrics connections are open at once (each holds a file descriptor).
pub const MAX_CONNECTIONS: usize = 32;
/// A client has this long from being accepted to the end of its request head.
pub const REQUEST_DEADLINE: Duration = Duration::from_secs(3);
/// The longest request head read; a longer one is answered 431 and closed.
pub const MAX_REQUEST_HEAD: usize = 8 * 1024;
/// Rendering and writing the response may take this long (a client that does not read its
/// response is cut off).
pub const RESPONSE_DEADLINE: Duration = Duration::from_secs(10);
/// How long the accept loop waits after a failed accept (EMFILE, ENFILE, ENOBUFS...) before
/// trying again, instead of spinning on the error.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// The open connections, oldest first, and whether each is still reading its request.
#[derive(Default)]
struct Slots {
    open: Vec<Slot>,
}

struct Slot {
    id: u64,
    reading: bool,
    task: tokio::task::AbortHandle,
}

fn slots(s: &Mutex<Slots>) -> std::sync::MutexGuard<'_, Slots> {
    s.lock().unwrap_or_else(|e| e.into_inner())
}

/// Serves `GET /metrics` and `GET /healthz` on `listener` until the task is dropped. One request
/// per connection.
///
/// The endpoint listens on every address of the node, so anyone on the pod network can reach it;
/// no number of idle or slow clients may take file descriptors (Allocate needs them) or time
/// from the plugin:
///
/// - at most [`MAX_CONNECTIONS`] are open; when a connection comes and all are taken, one is
///   closed at once to make room: the oldest still sending its request, else the oldest. So a
///   scraper or kubelet's liveness probe, which sends its request at once, gets in however many
///   idle, trickling or non-reading connections are held: to push it out, 32 new connections
///   must arrive between its connect and its request;
/// - the request head must arrive within [`REQUEST_DEADLINE`] of the accept and be at most
///   [`MAX_REQUEST_HEAD`] bytes; the response must be written within [`RESPONSE_DEADLINE`];
/// - one render at a time (reading every ledger), on a blocking thread; `/healthz` renders
///   nothing;
/// - a failed accept (out of descriptors) is retried after a pause, not in a busy loop.
pub async fn serve(listener: TcpListener, metrics: Arc<Metrics>) {
    let open = Arc::new(Mutex::new(Slots::default()));
    let render = Arc::new(tokio::sync::Mutex::new(()));
    let mut next_id = 0u64;
    loop {
        let conn = match listener.accept().await {
            Ok((conn, _)) => conn,
            Err(_) => {
                tokio::time::sleep(ACCEPT_BACKOFF).await;
                continue;
            }
        };
        let id = next_id;
        next_id += 1;
        let mut g = slots(&open);
        g.open.retain(|s| !s.task.is_finished());
        if g.open.len() >= MAX_CONNECTIONS {
            let i = g.open.iter().position(|s| s.reading).unwrap_or(0);
            g.open.remove(i).task.abort();
        }
        // Spawned under the lock: the task marks its slot only once it is there.
        let task = tokio::spawn(answer(
            conn,
            metrics.clone(),
            render.clone(),
            open.clone(),
            id,
        ));
        g.open.push(Slot {
            id,
            reading: true,
            task: task.abort_handle(),
        });
    }
}

/// One connection: the request head (bounded in size and time), then the response.
async fn answer(
    mut conn: TcpStream,
    metrics: Arc<Metrics>,
    render: Arc<tokio::sync::Mutex<()>>,
    open: Arc<Mutex<Slots>>,
    id: u64,
) {
    let deadline = tokio::time::Instant::now() + REQUEST_DEADLINE;
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    let complete = loop {
        if buf.windows(4).any(|w| w == b"\r\n\r\n") {
            break true;
        }
        if buf.len() > MAX_REQUEST_HEAD {
            break false;
        }
        match tokio::time::timeout_at(deadline, conn.read(&mut chunk)).await {
            Ok(Ok(n)) if n > 0 => buf.extend_from_slice(&chunk[..n]),
            // Closed, failed or too slow: nothing to answer.
            _ => return,
        }
    };
    if let Some(s) = slots(&open).open.iter_mut().find(|s| s.id == id) {
        s.reading = false;
    }
    let _ = tokio::time::timeout(RESPONSE_DEADLINE, async {
        let (status, ctype, body) = if complete {
            route(&buf, &metrics, &render).await
        } else {
            (
                "431 Request Header Fields Too Large",
                "text/plain; charset=utf-8",
                "request head too large\n".to_string(),
            )
        };
        let resp = format!(
            "HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        let _ = conn.write_all(resp.as_bytes()).await;
        let _ = conn.shutdown().await;
    })
    .await;
}

/// Status, content type and body for a request head.
async fn route(
    head: &[u8],
    metrics: &Arc<Metrics>,
    render: &Arc<tokio::sync::Mutex<()>>,
) -> (&'static str, &'static str, String) {
    let head = String::from_utf8_lossy(head);
    let mut parts = head.split_whitespace();
    let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let path = path.split('?').next().unwrap_or("");
    match (method, path) {
        ("GET", "/metrics") => {
            // The guard goes with the render: a response cut off by its deadline does not let
            // a second render start beside one still running.
            let guard = render.clone().lock_owned().await;
            let m = metrics.clone();
            let body = tokio::task::spawn_blocking(move || {
                let _guard = guard;
                m.render()
            })
            .await
            .unwrap_or_default();
            ("200 OK", "text/plain; version=0.0.4; charset=utf-8", body)
        }
        ("GET", "/") | ("GET", "/healthz") => match &metrics.status {
            None => ("200 OK", "text/plain; charset=utf-8", "ok\n".to_string()),
            Some(p) => match crate::status::probe(p, crate::status::Need::Alive) {
                Ok(line) => ("200 OK", "text/plain; charset=utf-8", line + "\n"),
                Err(line) => (
                    "503 Service Unavailable",
                    "text/plain; charset=utf-8",
                    line + "\n",
                ),
            },
        },
        _ => (
            "404 Not Found",
            "text/plain; charset=utf-8",
            "not found\n".to_string(),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_are_escaped() {
        assert_eq!(escape_label(r#"a"b\c"#), r#"a\"b\\c"#);
        assert_eq!(escape_label("x\ny"), "x\\ny");
        assert_eq!(labels(&[("pod", "p\"")]), "{pod=\"p\\\"\"}");
    }

    #[test]
    fn uuid_formats_like_nvml() {
        let mut b = [0u8; 16];
        for (i, x) in b.iter_mut().enumerate() {
            *x = i as u8;
        }
        assert_eq!(uuid_string(b), "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f");
    }

    #[test]
    fn histogram_buckets_are_cumulative() {
        let mut h = Histogram::default();
        for v in [0.05, 0.75, 0.8, 1.0] {
            h.observe(v);
        }
        let t = render(
            &[],
            &Default::default(),
            &TopologyFigures {
                scores: h,
                ..Default::default()
            },
            None,
        );
        assert!(t.contains("cuvisor_allocation_topology_score_bucket{le=\"0.1\"} 1\n"));
        assert!(t.contains("cuvisor_allocation_topology_score_bucket{le=\"0.7\"} 1\n"));
        assert!(t.contains("cuvisor_allocation_topology_score_bucket{le=\"0.8\"} 3\n"));
        assert!(t.contains("cuvisor_allocation_topology_score_bucket{le=\"1.0\"} 4\n"));
        assert!(t.contains("cuvisor_allocation_topology_score_bucket{le=\"+Inf\"} 4\n"));
        assert!(t.contains("cuvisor_allocation_topology_score_count 4\n"));
    }
}
