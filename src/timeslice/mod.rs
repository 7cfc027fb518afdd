//! Compute time slices, as plain Rust: a token bucket per container per GPU whose unit is GPU
//! time (ns), refilled at a rate that follows from the GPU coordinator's entries.
//!
//! - A launch draws its estimated run time ([`estimate`]) from the container's bucket (one atomic
//!   in the container's own coordinator state, shared by all its processes). A bucket that owes more
//!   than two such launches (at most [`LEAD_NS`]) makes the launching thread sleep until the
//!   refill has paid it; never a spin.
//! - A sampled fraction of launches is measured (`hook` records events around them and hands the
//!   elapsed time in later, [`Compute::measured`]); the difference between what was measured and
//!   what was charged is settled on the bucket, so long-run accounting follows the measurements.
//! - Refill rates ([`share`]) are recomputed by each process every [`RATE_PERIOD_NS`] from every
//!   entry of the GPU's coordinator: the policy the board lists, and a copy of each state (recent
//!   use, whether it is held back, last launch, the end of its queued work), read by `pread`.
//! - The queue model: each container keeps the end of its own queued work in its state; a launch
//!   starts after that and after the work the other containers added since the process's last
//!   launch, at the rate their states say they have been using the GPU (`others_ppm`). What
//!   sits between is the predicted wait behind other containers (`ahead`), taken off the
//!   launch's measured time ([`estimate`]).
//!
//! Hot path (a launch under the cap): a TSC read ([`clock::fast_ns`]), a few relaxed loads, a
//! fetch_sub on the bucket, a CAS on the container's own queue end and one thread-local access
//! (the count batch, which also picks the sampled launches). No lock, no syscall, no allocation;
//! nothing another container can write or truncate. Every [`RATE_PERIOD_NS`] the launch that
//! finds the rate due recomputes it instead (a `try_lock`, one `pread` of the board and one per
//! other container on the GPU): the price of reading other containers' states as copies rather
//! than through a mapping they could truncate.

pub mod clock;
pub mod estimate;
pub mod share;

pub use clock::{fast_ns, now_ns};

use crate::config::{Access, Compute as Spec, ComputeConfig, Config};
use cuvisor_shm::coordinator::{self, Coordinator, Peer, State, POLICY_LIMIT, POLICY_SHARE};
use cuvisor_shm::ledger::Ledger;
use estimate::{Entry, Estimates};
use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering::*};
use std::sync::{Mutex, OnceLock};

/// How often a process recomputes its container's refill rate on a GPU.
pub const RATE_PERIOD_NS: u64 = 10_000_000;
/// A container that launched within this window is active (shares are split among the active).
pub const ACTIVE_NS: u64 = 200_000_000;
/// A container that had to wait within this window wants more than it gets.
pub const THROTTLED_NS: u64 = 50_000_000;
/// A slot whose work was queued on the GPU at more than this fraction of recent recomputations
/// wants more than it gets (see `recompute`).
const QUEUED_WANTING: f64 = 0.5;
/// The bucket holds at most this much GPU time: the burst a container may queue after a pause.
pub const BURST_NS: i64 = 5_000_000;
/// A launch goes ahead while the bucket owes at most two of its own run time and at most this
/// much: each container keeps some work queued on the GPU, so a launching thread that the CPU
/// scheduler wakes late does not leave the GPU idle (the long-run rate is still the refill rate).
const LEAD_NS: i64 = 2_000_000;
/// The bucket is refilled at most this often (per container, any process).
const REFILL_NS: u64 = 50_000;
/// Longest wait of a throttled thread before one launch.
const MAX_SLEEP_NS: u64 = 1_000_000_000;
/// A waiting thread re-checks its debt (rate, settled measurements) at least this often.
const WAIT_SLICE_NS: u64 = RATE_PERIOD_NS;
/// Thread-local counts reach the shared counters after this many launches or this much time.
const FLUSH_LAUNCHES: u64 = 128;
const FLUSH_NS: i64 = 1_000_000;
/// The others' work added between two launches of ours is counted over at most this much time
/// (after a longer gap the GPU has run it).
const ARRIVALS_MAX_NS: u64 = 20_000_000;
/// CUDA ordinals we keep a GPU state for.
pub const MAX_ORDINALS: usize = 64;

/// What the process knows about one GPU.
pub struct Gpu {
    coord: Coordinator,
    /// The policy the board lists for the container.
    policy: u32,
    param: u64,
    /// A cap the container's own configuration puts below the board's policy (ppm; 10^6 none).
    cap_ppm: u64,
    /// The rate it is held to once its entry is gone from the board (the plugin took it off):
    /// its limit, or its memory fraction (ppm).
    orphan_ppm: u64,
    /// The container's ledger entry for this GPU (metrics), if it has one.
    ledger_entry: Option<usize>,
    /// The refill rate, ppm of GPU time.
    rate_ppm: AtomicU64,
    next_rate_at: AtomicU64,
    /// The rate at which the other containers have been adding work of late (their recent use
    /// as their states say, ppm of GPU time): between two launches of ours they add work ahead
    /// of our next one (see `queue`).
    others_ppm: AtomicU64,
    /// When this process last put a launch on the model (CLOCK_MONOTONIC ns).
    last_queued: AtomicU64,
    usage: Mutex<Usage>,
}

/// Per-entry use seen by this process at its last rate computation.
struct Usage {
    at: u64,
    /// The other entries, as read (a buffer, so that nothing is allocated).
    peers: [Peer; coordinator::MAX_SLOTS],
    ids: [u64; coordinator::MAX_SLOTS],
    consumed: [u64; coordinator::MAX_SLOTS],
    rate: [f64; coordinator::MAX_SLOTS],
    /// Smoothed fraction of recomputations at which the slot had work queued on the GPU (by the
    /// queue model).
    queued: [f64; coordinator::MAX_SLOTS],
}

impl Gpu {
    fn slot(&self) -> &State {
        self.coord.own()
    }
    /// The refill rate now, as a fraction of GPU time.
    pub fn rate(&self) -> f64 {
        self.rate_ppm.load(Relaxed) as f64 / 1e6
    }
}

/// How a launch was admitted: what it was charged (to give back if the driver refuses it).
#[derive(Clone, Copy, Debug)]
pub struct Ticket {
    pub charged: u64,
    pub unmeasured: bool,
    /// GPU time (ns) the bucket owed after this launch was charged: the thread waits for the
    /// refill to pay it before launching (0: none; see [`Compute::wait`]).
    pub owed_ns: u64,
    /// How long this launch should wait behind other containers' work before it runs, on the
    /// coordinator's model of the GPU queue (taken off its measured time; see `queue`).
    pub ahead: u64,
    /// When the launch's work should end on the queue model (see `queue`; 0: not queued yet).
    pub ends: u64,
    /// The launching thread's launch count (see [`Compute::sample`]).
    pub tick: u32,
}

pub struct Compute {
    spec: Spec,
    cfg: ComputeConfig,
    memory: Config,
    container: u64,
    ledger: &'static Ledger,
    pub estimates: Estimates,
    gpus: [OnceLock<Option<Box<Gpu>>>; MAX_ORDINALS],
}

#[derive(Clone, Copy)]
struct Batch {
    gpu: usize,
    launches: u64,
    ns: i64,
    /// The thread's launches, every GPU, never reset: picks the sampled ones.
    tick: u32,
}

thread_local! {
    static BATCH: Cell<Batch> = const { Cell::new(Batch { gpu: 0, launches: 0, ns: 0, tick: 0 }) };
}

impl Compute {
    /// None when the policy is `none`.
    pub fn new(cfg: ComputeConfig, memory: Config, ledger: &'static Ledger) -> Option<Compute> {
        if cfg.compute == Spec::None {
            return None;
        }
        Some(Compute {
            spec: cfg.compute,
            cfg,
            memory,
            container: ledger.container_id(),
            ledger,
            estimates: Estimates::new(4096),
            gpus: std::array::from_fn(|_| OnceLock::new()),
        })
    }

    /// The state of CUDA device `ordinal`; `info` asks the driver for (UUID, physical memory)
    /// the first time. None: not throttled (no coordinator could be opened: logged once).
    #[inline]
    pub fn gpu(
        &self,
        ordinal: usize,
        info: impl FnOnce() -> Option<([u8; 16], u64)>,
    ) -> Option<&Gpu> {
        let cell = self.gpus.get(ordinal)?;
        if let Some(g) = cell.get() {
            return g.as_deref();
        }
        cell.get_or_init(|| self.open_gpu(ordinal, info)).as_deref()
    }

    fn open_gpu(
        &self,
        ordinal: usize,
        info: impl FnOnce() -> Option<([u8; 16], u64)>,
    ) -> Option<Box<Gpu>> {
        let (uuid, physical) = info()?;
        let fraction = || {
            let quota = self.memory.limit_for(ordinal as u32, &uuid);
            if physical == 0 {
                1.0
            } else {
                (quota as f64 / physical as f64).min(1.0)
            }
        };
        let (policy, param) = match self.spec {
            Spec::Limit(f) => (POLICY_LIMIT, (f * 1e6).round().max(1.0) as u64),
            Spec::Share(w) => (POLICY_SHARE, (w * 1e3).round().max(1.0) as u64),
            Spec::FromMemory | Spec::None => {
                (POLICY_SHARE, (fraction() * 1e3).round().max(1.0) as u64)
            }
        };
        let now = now_ns();
        let managed = self
            .cfg
            .managed
            .iter()
            .find(|(u, _)| *u == uuid)
            .map(|(_, i)| *i as usize);
        let joined = match (managed, &self.cfg.own_dir) {
            (Some(i), Some(own)) => Coordinator::join_managed(
                &self.cfg.coord_dir,
                uuid,
                i,
                &own.join(coordinator::dir_name(uuid)),
            ),
            (Some(_), None) => {
                Err("the limits file lists a coordinator entry but no coord_own_dir".into())
            }
            (None, _) => Coordinator::join_self(
                &self.cfg.coord_dir,
                uuid,
                self.container,
                policy,
                param,
                self.cfg.coord_access,
                now,
            ),
        };
        let coord = match joined {
            Ok(c) => c,
            Err(e) => {
                crate::log::error(&format!(
                    "{e}: compute share of this GPU not coordinated with other containers"
                ));
                // A private coordinator: the policy still holds for this container alone. Where
                // the plugin listed the container, whatever broke its entry (its own state file
                // rewritten, say) must not free it from the others: it is held to a cap of its
                // limit, or of its memory fraction (the part a share guarantees at most when
                // every container's weight follows memory).
                let (policy, param) = match (managed, self.spec) {
                    (None, _) => (policy, param),
                    (Some(_), Spec::Limit(_)) => (POLICY_LIMIT, param),
                    (Some(_), _) => (POLICY_LIMIT, (fraction() * 1e6).round().max(1.0) as u64),
                };
                // One per container (its processes share its bucket), in its own temporary
                // directory: every uid's under a limits file (a container of several uids, as
                // its ledger), else this user's alone (as its ledger).
                let dir = std::env::temp_dir()
                    .join(format!("cuvisor-coord-private-{:016x}", self.container));
                let access = match self.cfg.coord_access {
                    Access::Shared => Access::Shared,
                    Access::Private | Access::Group(_) => Access::Private,
                };
                Coordinator::join_self(&dir, uuid, self.container, policy, param, access, now)
                    .ok()?
            }
        };
        // The board's policy; the container's own configuration may only cap it.
        let (policy, param) = (coord.entry().policy, coord.entry().param);
        let cap_ppm = match (managed, self.spec) {
            (Some(_), Spec::Limit(f)) => ((f * 1e6).round() as u64).clamp(1, 1_000_000),
            _ => 1_000_000,
        };
        let orphan_ppm = if policy == POLICY_LIMIT {
            param
        } else {
            ((fraction() * 1e6).round() as u64).clamp(1, 1_000_000)
        };
        coord.own().last_active.fetch_max(now, AcqRel);
        let ledger_entry = self
            .ledger
            .devices()
            .find(|(_, u, _)| *u == uuid)
            .map(|(i, _, _)| i)
            .or_else(|| {
                self.ledger
                    .device_for(uuid, self.memory.limit_for(ordinal as u32, &uuid))
            });
        let g = Box::new(Gpu {
            coord,
            policy,
            param,
            cap_ppm,
            orphan_ppm,
            ledger_entry,
            rate_ppm: AtomicU64::new(1_000_000),
            next_rate_at: AtomicU64::new(0),
            others_ppm: AtomicU64::new(0),
            last_queued: AtomicU64::new(0),
            usage: Mutex::new(Usage {
                at: now,
                peers: [Peer {
                    index: 0,
                    entry: coordinator::Entry::default(),
                    state: None,
                }; coordinator::MAX_SLOTS],
                ids: [0; coordinator::MAX_SLOTS],
                consumed: [0; coordinator::MAX_SLOTS],
                rate: [0.0; coordinator::MAX_SLOTS],
                queued: [0.0; coordinator::MAX_SLOTS],
            }),
        });
        self.recompute(&g);
        crate::log::info(&format!(
            "compute on GPU {ordinal}: {} {}, coordinator {}",
            if g.policy == POLICY_LIMIT {
                "limit"
            } else {
                "share"
            },
            if g.policy == POLICY_LIMIT {
                format!("{:.1}%", g.param as f64 / 1e4)
            } else {
                format!("weight {:.3}", g.param as f64 / 1e3)
            },
            g.coord.dir().display()
        ));
        Some(g)
    }

    /// Admits one launch of `entry` on `g`: draws its estimate from the bucket. The caller
    /// waits ([`Compute::wait`]) before launching when the ticket owes.
    #[inline]
    pub fn admit(&self, g: &Gpu, entry: &Entry) -> Ticket {
        let now = fast_ns();
        if now >= g.next_rate_at.load(Relaxed) {
            self.recompute(g);
        }
        let s = g.slot();
        if now.wrapping_sub(s.last_active.load(Relaxed)) > 1_000_000 {
            s.last_active.store(now, Relaxed);
        }
        let (cost, unmeasured) = entry.charge();
        let after = refill(g, s, now, cost as i64);
        // How far ahead of its refill the container may run: two of these launches, at most
        // LEAD_NS. Enough queued work that a late wake-up leaves the GPU busy; few enough
        // kernels that the others' measurements do not queue behind a long line of them. A
        // kernel longer than LEAD_NS may go once the bucket owes nothing before it (its own
        // run time is then the debt the next launch waits out): otherwise it would wait, with
        // the GPU idle, for the refill to pre-pay all of it, and a container alone on the GPU
        // with 100 ms kernels after each pause would get half the GPU (found by the multi-GPU
        // job of issue 18). Long-run rate unchanged: every launch still pays its run time.
        let lead = (2 * cost as i64).min(LEAD_NS.max(cost as i64));
        let tick = self.count(g, 1, cost as i64);
        let owed_ns = (-after - lead).max(0) as u64;
        // Queued now unless the thread must wait first (then when it wakes: see `wait`).
        let (ahead, ends) = if owed_ns == 0 {
            queue(g, now, cost)
        } else {
            (0, 0)
        };
        Ticket {
            charged: cost,
            unmeasured,
            ahead,
            ends,
            owed_ns,
            tick,
        }
    }

    /// Sleeps a throttled thread (and accounts the time) until the refill has paid what the
    /// bucket owed after its launch `t` was charged. It sleeps in slices of at most
    /// [`WAIT_SLICE_NS`]; after each it reads back measurements (`poll`), takes the current rate
    /// (another container went idle: it pays faster) and the bucket (a measurement settled
    /// an overcharge: it owes less), so a wait never outlives the debt that caused it.
    pub fn wait(&self, g: &Gpu, t: &mut Ticket, poll: impl Fn()) {
        let s = g.slot();
        let t0 = now_ns();
        s.throttled_at.store(t0, Relaxed);
        self.flush();
        let mut owed = t.owed_ns as f64;
        let mut now = t0;
        while owed > 0.0 && now - t0 < MAX_SLEEP_NS {
            let rate = g.rate().max(share::FLOOR);
            let ns = ((owed / rate) as u64).clamp(1, WAIT_SLICE_NS);
            std::thread::sleep(std::time::Duration::from_nanos(ns));
            let woke = now_ns();
            owed -= (woke - now) as f64 * rate;
            now = woke;
            s.throttled_at.store(now, Relaxed);
            poll();
            if now >= g.next_rate_at.load(Relaxed) {
                self.recompute(g);
            }
            owed = owed.min(-refill(g, s, now, 0) as f64);
        }
        let slept = now - t0;
        s.throttled_ns.fetch_add(slept, Relaxed);
        (t.ahead, t.ends) = queue(g, now, t.charged);
        if let Some(e) = g.ledger_entry {
            self.ledger.device(e).throttled_ns.fetch_add(slept, Relaxed);
        }
        self.flush();
    }

    /// A launch the driver refused: its charge comes back.
    pub fn refund(&self, g: &Gpu, entry: &Entry, t: &Ticket) {
        entry.uncharge(t.unmeasured);
        g.slot().tokens.fetch_add(t.charged as i64, AcqRel);
        self.count(g, u64::MAX, -(t.charged as i64)); // launches - 1
    }

    /// Whether this launch should be measured: every launch of a key still being learned (an
    /// unmeasured key is), then one in [`Entry::every`] per thread.
    #[inline]
    pub fn sample(&self, t: &Ticket, entry: &Entry) -> bool {
        entry.learning() || t.tick & (entry.every() - 1) == 0
    }

    /// A measurement came back: `raw` ns between the events around a launch of `key` on
    /// `ordinal` that was charged `charged`, `ahead` of which the queue model predicted to be
    /// waiting behind other containers. Settles the difference on the bucket.
    pub fn measured(
        &self,
        ordinal: usize,
        key: u64,
        raw: u64,
        ahead: u64,
        charged: u64,
        unmeasured: bool,
    ) {
        let debt = self
            .estimates
            .entry(key)
            .record(raw, ahead, charged, unmeasured);
        let Some(Some(g)) = self.gpus.get(ordinal).and_then(|c| c.get()) else {
            return;
        };
        if debt != 0 {
            g.slot().tokens.fetch_sub(debt, AcqRel);
            self.count(g, 0, debt);
        }
    }

    /// A measured launch that the queue model expected to end at `model_end` ended at
    /// `real_end` (host clock): the model follows (see `ground`).
    pub fn ground(&self, ordinal: usize, model_end: u64, real_end: u64) {
        if let Some(Some(g)) = self.gpus.get(ordinal).and_then(|c| c.get()) {
            if model_end != 0 {
                ground(g, model_end, real_end);
            }
        }
    }

    /// Adds to the thread's counts; flushes them to the shared counters now and then. Returns the
    /// thread's launch tick (one thread-local access for both).
    #[inline]
    fn count(&self, g: &Gpu, launches: u64, ns: i64) -> u32 {
        let key = g as *const Gpu as usize;
        BATCH.with(|b| {
            let mut v = b.get();
            if v.gpu != key {
                if v.gpu != 0 {
                    self.flush_batch(v);
                }
                v = Batch {
                    gpu: key,
                    launches: 0,
                    ns: 0,
                    tick: v.tick,
                };
            }
            v.launches = v.launches.wrapping_add(launches);
            v.ns += ns;
            if launches == 1 {
                v.tick = v.tick.wrapping_add(1);
            }
            if v.launches >= FLUSH_LAUNCHES || v.ns.abs() >= FLUSH_NS {
                self.flush_to(g, v);
                v.launches = 0;
                v.ns = 0;
            }
            b.set(v);
            v.tick
        })
    }

    /// Flushes this thread's counts (before it sleeps, at exit).
    pub fn flush(&self) {
        BATCH.with(|b| {
            let v = b.get();
            if v.gpu != 0 {
                self.flush_batch(v);
            }
            b.set(Batch {
                gpu: 0,
                launches: 0,
                ns: 0,
                tick: v.tick,
            });
        });
    }

    fn flush_batch(&self, v: Batch) {
        // The batch names a GPU state of ours: find it (a handful of pointer compares).
        let Some(g) = self
            .gpus
            .iter()
            .filter_map(|c| c.get().and_then(|g| g.as_deref()))
            .find(|g| *g as *const Gpu as usize == v.gpu)
        else {
            return;
        };
        self.flush_to(g, v);
    }

    /// Adds batch `v` (of `g`) to the shared counters.
    fn flush_to(&self, g: &Gpu, v: Batch) {
        add_signed(&g.slot().consumed_ns, v.ns);
        if let Some(e) = g.ledger_entry {
            let d = self.ledger.device(e);
            add_signed(&d.gpu_ns, v.ns);
            d.launches.fetch_add(v.launches, Relaxed);
        }
    }

    /// Recomputes this container's refill rate on `g` from every slot (at most one thread of the
    /// process at a time; the others keep the current rate).
    fn recompute(&self, g: &Gpu) {
        let Ok(mut u) = g.usage.try_lock() else {
            return;
        };
        let now = now_ns();
        clock::calibrate(now);
        if now < g.next_rate_at.load(Relaxed) {
            return;
        }
        g.next_rate_at.store(now + RATE_PERIOD_NS, Relaxed);
        let u = &mut *u;
        let (n, still_listed) = g.coord.peers(now, &mut u.peers);
        let dt = now.saturating_sub(u.at).max(1) as f64;
        u.at = now;
        let idle = share::View {
            kind: share::Kind::Share(0.0),
            active: false,
            wanting: false,
            usage: 0.0,
        };
        let kind = |e: &coordinator::Entry| {
            if e.policy == POLICY_LIMIT {
                share::Kind::Limit(e.param as f64 / 1e6)
            } else {
                share::Kind::Share(e.param as f64 / 1e3)
            }
        };
        // Our own view first, then every other entry's.
        let mut views = [idle; coordinator::MAX_SLOTS];
        let own = g.slot();
        let copy = coordinator::StateCopy {
            last_active: own.last_active.load(Relaxed),
            throttled_at: own.throttled_at.load(Relaxed),
            consumed_ns: own.consumed_ns.load(Relaxed),
            queued_until: own.queued_until.load(Relaxed),
            grant_ppm: 0,
        };
        views[0] = observe(u, now, dt, g.coord.index(), g.coord.entry(), Some(&copy));
        views[0].kind = kind(g.coord.entry());
        views[0].active = true;
        let mut others_use = 0.0;
        for k in 0..n {
            let p = u.peers[k];
            views[k + 1] = observe(u, now, dt, p.index, &p.entry, p.state.as_ref());
            views[k + 1].kind = kind(&p.entry);
            if p.state.is_some() && views[k + 1].active {
                others_use += views[k + 1].usage;
            }
        }
        g.others_ppm
            .store((others_use.clamp(0.0, 1.0) * 1e6) as u64, Relaxed);
        let mut rates = [0.0; coordinator::MAX_SLOTS];
        share::rates_into(&views[..n + 1], &mut rates[..n + 1]);
        let mut ppm = ((rates[0] * 1e6) as u64).min(g.cap_ppm);
        if !still_listed {
            // Taken off the board: no longer counted by the others, so held to a cap alone.
            ppm = ppm.min(g.orphan_ppm);
        }
        g.rate_ppm.store(ppm, Relaxed);
        own.grant_ppm.store(ppm, Relaxed);
    }

    /// At a normal exit: this thread's counts. (A self-service entry's lease goes with the
    /// process's descriptors; a forked child still running shares it.)
    pub fn at_exit(&self) {
        self.flush();
    }
}

/// One entry's view for the rate computation from what its state says (None: unreadable), its
/// use tracked in `u` by entry and container. The caller sets the kind. An entry whose state
/// does not read back counts as active and wanting: it gets what its policy allows, and the
/// others what theirs guarantees.
fn observe(
    u: &mut Usage,
    now: u64,
    dt: f64,
    i: usize,
    e: &coordinator::Entry,
    st: Option<&coordinator::StateCopy>,
) -> share::View {
    let unknown = share::View {
        kind: share::Kind::Share(0.0),
        active: true,
        wanting: true,
        usage: 0.0,
    };
    let Some(st) = st else {
        u.ids[i] = 0;
        return unknown;
    };
    let first = u.ids[i] != e.container;
    if first {
        u.ids[i] = e.container;
        u.consumed[i] = st.consumed_ns;
        u.rate[i] = f64::NAN; // no use measured yet
        u.queued[i] = 0.0;
    }
    let inst = st.consumed_ns.saturating_sub(u.consumed[i]) as f64 / dt;
    u.consumed[i] = st.consumed_ns;
    // A smoothed use (time constant ~ 5 periods); a claim of more than the GPU is capped. The
    // first measured period counts whole: tenants that start together must not see each other
    // as idle for the first 50 ms, when every launch is measured and estimates are learned.
    let inst = inst.min(1.5);
    u.rate[i] = if first {
        f64::NAN
    } else if u.rate[i].is_nan() {
        inst
    } else {
        u.rate[i] + 0.2 * (inst - u.rate[i])
    };
    let usage = if u.rate[i].is_nan() { 0.0 } else { u.rate[i] };
    let queued = st.queued_until > now;
    u.queued[i] += 0.2 * (f64::from(u8::from(queued)) - u.queued[i]);
    share::View {
        kind: unknown.kind,
        active: now.saturating_sub(st.last_active) < ACTIVE_NS,
        // Wants more than it gets: it had to wait for tokens recently, or its work was queued
        // on the GPU most of the time (a program that synchronizes every step uses less than
        // its part because the others' work is ahead of its own, not because it has nothing to
        // run: it must not lend its part).
        wanting: now.saturating_sub(st.throttled_at) < THROTTLED_NS || u.queued[i] > QUEUED_WANTING,
        usage,
    }
}

/// Refills the bucket of slot `s` for the time since its last refill (at most every
/// [`REFILL_NS`], by whichever thread of the container comes first) at the current rate, draws
/// `cost` from it, and returns the tokens left (negative: owed).
#[inline]
fn refill(g: &Gpu, s: &State, now: u64, cost: i64) -> i64 {
    let rate = g.rate_ppm.load(Relaxed).max(1);
    let last = s.refill_at.load(Relaxed);
    if now > last + REFILL_NS
        && s.refill_at
            .compare_exchange(last, now, AcqRel, Relaxed)
            .is_ok()
    {
        let add = ((now - last) as u128 * rate as u128 / 1_000_000) as i64;
        let after = |t: i64| (t + add).min(BURST_NS.max(t)) - cost;
        match s.tokens.fetch_update(AcqRel, Relaxed, |t| Some(after(t))) {
            Ok(prev) => after(prev),
            Err(t) => t, // unreachable: the closure always answers
        }
    } else {
        s.tokens.fetch_sub(cost, AcqRel) - cost
    }
}

/// Where the work the queue model expected to end at `model_end` really ended (`real_end`, from
/// a measurement whose start event is known in host time): moves the end of the container's own
/// queued work by the difference, so that the model follows the GPU instead of drifting with
/// the sum of estimate errors.
fn ground(g: &Gpu, model_end: u64, real_end: u64) {
    let delta = real_end as i64 - model_end as i64;
    if delta == 0 {
        return;
    }
    let shift = |t: u64| (t as i64 + delta).max(0) as u64;
    let _ = g.slot().queued_until.fetch_update(AcqRel, Relaxed, |t| {
        if t >= model_end {
            Some(shift(t))
        } else if real_end > t {
            Some(real_end) // the model had the GPU done earlier than it was
        } else {
            None
        }
    });
}

/// Puts `cost` of work launched at `now` on the model of the GPU queue (kernels of all
/// containers one after another, as the GPU runs them): after the container's own queued work
/// and what the others added since our last launch (at their recent rate of use). Returns how long
/// it should wait behind other containers' work (its start minus the later of `now` and the end
/// of the container's own previous work, which events on its stream do not count as waiting),
/// and when it should end.
#[inline]
fn queue(g: &Gpu, now: u64, cost: u64) -> (u64, u64) {
    // The others' work since our last launch sits between it and this one. (A plain load and
    // store: threads of the process racing here only blur which launch was last. At most
    // 2e7 ns x 1e6 ppm: no overflow in u64.)
    let ppm = g.others_ppm.load(Relaxed);
    let arrived = if ppm == 0 {
        0
    } else {
        let since = now.saturating_sub(g.last_queued.load(Relaxed));
        since.min(ARRIVALS_MAX_NS) * ppm / 1_000_000
    };
    g.last_queued.store(now, Relaxed);
    let own = g
        .slot()
        .queued_until
        .fetch_update(AcqRel, Relaxed, |q| Some((q + arrived).max(now) + cost))
        .unwrap_or(now);
    let start = (own + arrived).max(now);
    (start - own.max(now), start + cost)
}

fn add_signed(a: &AtomicU64, v: i64) {
    if v >= 0 {
        a.fetch_add(v as u64, Relaxed);
    } else {
        let _ = a.fetch_update(Relaxed, Relaxed, |x| {
            Some(x.saturating_sub(v.unsigned_abs()))
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Target;
    use std::path::PathBuf;

    fn setup(tag: &str, spec: Spec, coord: &std::path::Path) -> &'static Compute {
        let state = std::env::temp_dir().join(format!("cuvisor-ts-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&state);
        let ledger: &'static Ledger = Box::leak(Box::new(Ledger::open_dir(&state).unwrap()));
        let memory = Config {
            limits: vec![(Target::All, 1 << 30)],
            caps: Vec::new(),
            state_dir: state,
            state_access: crate::config::Access::Private,
            context_reserve: 0,
        };
        let cfg = ComputeConfig {
            compute: spec,
            coord_dir: coord.to_path_buf(),
            coord_access: crate::config::Access::Private,
            managed: Vec::new(),
            own_dir: None,
            errors: Vec::new(),
        };
        Box::leak(Box::new(Compute::new(cfg, memory, ledger).unwrap()))
    }

    fn coord_dir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("cuvisor-ts-coord-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    /// Launches as fast as the bucket allows for `ms` (kernels of `kernel_ns`, measured exactly
    /// every time) and returns the GPU time drawn per wall time.
    fn saturate(c: &Compute, g: &Gpu, key: u64, kernel_ns: u64, ms: u64) -> f64 {
        let e = c.estimates.entry(key);
        let t0 = now_ns();
        let mut drawn = 0u64;
        while now_ns() - t0 < ms * 1_000_000 {
            let mut t = c.admit(g, e);
            if t.owed_ns > 0 {
                c.wait(g, &mut t, || {});
            }
            drawn += kernel_ns;
            c.measured(0, key, kernel_ns, 0, t.charged, t.unmeasured);
        }
        drawn as f64 / (now_ns() - t0) as f64
    }

    #[test]
    fn a_limit_paces_to_its_cap_and_sleeps() {
        let dir = coord_dir("limit");
        let c = setup("limit", Spec::Limit(0.3), &dir);
        let g = c.gpu(0, || Some(([1; 16], 1 << 34))).unwrap();
        assert_eq!(g.rate(), 0.3);
        let got = saturate(c, g, 77, 200_000, 600);
        assert!((got - 0.3).abs() < 0.02, "{got}");
        assert!(
            g.slot().throttled_ns.load(Relaxed) > 300_000_000,
            "it slept"
        );
        c.flush();
        let used = c
            .ledger
            .device(g.ledger_entry.unwrap())
            .gpu_ns
            .load(Relaxed);
        assert!(used > 150_000_000, "metrics reach the ledger: {used}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_long_kernel_after_a_pause_is_not_held_back_until_the_bucket_prepays_it() {
        let dir = coord_dir("long");
        let c = setup("long", Spec::Share(1.0), &dir);
        let g = c.gpu(0, || Some(([3; 16], 1 << 34))).unwrap();
        assert_eq!(g.rate(), 1.0, "alone on the GPU");
        let key = 78;
        let e = c.estimates.entry(key);
        // Teach the estimate a 100 ms kernel, paying each launch's debt as the GPU would.
        for _ in 0..4 {
            let mut t = c.admit(g, e);
            if t.owed_ns > 0 {
                c.wait(g, &mut t, || {});
            }
            c.measured(0, key, 100_000_000, 0, t.charged, t.unmeasured);
        }
        // A pause, as a training step's data loading: the bucket refills (to its burst).
        std::thread::sleep(std::time::Duration::from_millis(250));
        let t = c.admit(g, e);
        assert!(
            t.charged >= 50_000_000,
            "the estimate learnt the long kernel: {}",
            t.charged
        );
        assert_eq!(t.owed_ns, 0, "a lone container's long kernel goes at once");
        // The next one waits out the debt the first left.
        let t2 = c.admit(g, e);
        assert!(t2.owed_ns > 40_000_000, "{}", t2.owed_ns);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn default_share_follows_the_memory_fraction_and_a_lone_share_gets_everything() {
        let dir = coord_dir("share");
        let c = setup("share", Spec::FromMemory, &dir);
        let g = c.gpu(0, || Some(([2; 16], 4 << 30))).unwrap();
        assert_eq!(g.param, 250, "1 GiB of 4 GiB: weight 0.25");
        assert_eq!(g.rate(), 1.0, "alone on the GPU");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn none_is_no_compute_at_all() {
        let cfg = ComputeConfig {
            compute: Spec::None,
            coord_dir: PathBuf::from("/nonexistent"),
            coord_access: crate::config::Access::Private,
            managed: Vec::new(),
            own_dir: None,
            errors: Vec::new(),
        };
        let state = std::env::temp_dir().join(format!("cuvisor-ts-none-{}", std::process::id()));
        let ledger: &'static Ledger = Box::leak(Box::new(Ledger::open_dir(&state).unwrap()));
        let memory = Config {
            limits: vec![],
            caps: vec![],
            state_dir: state,
            state_access: crate::config::Access::Private,
            context_reserve: 0,
        };
        assert!(Compute::new(cfg, memory, ledger).is_none());
    }
}
