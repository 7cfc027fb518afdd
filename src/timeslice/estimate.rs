//! What a launch costs, learned per CUfunction / per graph exec from measurements.
//!
//! A measurement is the time between two events recorded around a launch. On a shared GPU that
//! time includes queueing behind other containers' work, so a raw sample is an upper bound on
//! the run time, never a lower one. `timeslice` predicts the wait from the coordinator's model
//! of the GPU queue (other containers' launches at their estimates). A sample whose predicted
//! wait is zero is *clean*: the launch followed our own work or an idle GPU, and its raw time is
//! the run time (or more, when the model missed a wait). A key with clean samples is estimated
//! from them alone; only a key without any (a tenant whose every launch lands behind another
//! container's, e.g. a small cap next to a large one) uses raw minus the predicted wait — and
//! never more than its least raw sample. So estimates only lean on other containers' estimates
//! where they have to, which is what keeps two tenants that together saturate the GPU from
//! feeding each other's errors (one estimate too high, the other's predicted waits too large,
//! its estimate too low, and so on). The estimate is the 25th percentile of the samples used,
//! robust against a few inflated ones. Clean samples are kept apart from the others and decide
//! for [`CLEAN_TTL_NS`] after the last one, however many queued samples came since. Limitation:
//! a function whose run time varies with its arguments is charged that quantile.
//!
//! Until the first measurement of a key returns, its launches are charged [`DEFAULT_NS`] and
//! counted; the first measurement settles the difference for all of them, and while the key is
//! being learned (its first [`RING`] samples, every launch measured) each new estimate settles
//! them again (see [`Entry::record`], [`Entry::learning`]).

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::*};
use std::sync::Mutex;

/// Samples kept per key.
pub const RING: usize = 16;
/// What an unknown kernel is charged until it has been measured.
pub const DEFAULT_NS: u64 = 100_000;
/// One launch in this many is measured, once a key has an estimate...
pub const SAMPLE_EVERY: u32 = 16;
/// ...and, while its samples keep agreeing with the estimate (within 1/8), the interval
/// doubles up to this; a sample that disagrees brings it back to [`SAMPLE_EVERY`]. A sample
/// costs two event records and a read-back (on a real driver about a microsecond): a steady
/// kernel pays a few ns per launch for it, a changing one gets measured often. (Powers of two.)
pub const SAMPLE_EVERY_MAX: u32 = 256;

pub struct Entry {
    key: AtomicU64,
    /// The estimate (ns); 0 = not measured yet.
    est: AtomicU64,
    /// Launches charged DEFAULT_NS before the first measurement came back.
    unmeasured: AtomicU64,
    next: AtomicU32,
    /// Samples: run time (raw minus the predicted wait).
    ring: [AtomicU64; RING],
    /// The raw (event-measured) time of each sample.
    raw: [AtomicU64; RING],
    /// The clean samples (nothing predicted ahead: raw), kept apart so that a run of samples
    /// that queued behind other containers does not push them out, and when the last came.
    clean: [AtomicU64; RING],
    clean_next: AtomicU32,
    clean_at: AtomicU64,
    /// Launches charged the default that a measurement has settled, and at what estimate.
    bulk: Mutex<Bulk>,
    /// One launch in this many is measured (see [`SAMPLE_EVERY_MAX`]).
    every: AtomicU32,
}

#[derive(Default)]
struct Bulk {
    launches: u64,
    at: u64,
}

impl Entry {
    fn new() -> Entry {
        Entry {
            key: AtomicU64::new(0),
            est: AtomicU64::new(0),
            unmeasured: AtomicU64::new(0),
            next: AtomicU32::new(0),
            ring: std::array::from_fn(|_| AtomicU64::new(0)),
            raw: std::array::from_fn(|_| AtomicU64::new(0)),
            clean: std::array::from_fn(|_| AtomicU64::new(0)),
            clean_next: AtomicU32::new(0),
            clean_at: AtomicU64::new(0),
            bulk: Mutex::new(Bulk::default()),
            every: AtomicU32::new(SAMPLE_EVERY),
        }
    }

    /// (what a launch is charged, whether it is still unmeasured).
    #[inline]
    pub fn charge(&self) -> (u64, bool) {
        match self.est.load(Relaxed) {
            0 => {
                self.unmeasured.fetch_add(1, Relaxed);
                (DEFAULT_NS, true)
            }
            e => (e, false),
        }
    }

    /// Takes back a charge made by `charge` for a launch that failed.
    pub fn uncharge(&self, unmeasured: bool) {
        if unmeasured {
            let _ = self
                .unmeasured
                .fetch_update(Relaxed, Relaxed, |n| n.checked_sub(1));
        }
    }

    pub fn estimate(&self) -> u64 {
        self.est.load(Relaxed)
    }

    /// A measurement of one launch that was charged `charged` (of which `was_unmeasured` says
    /// whether it was a default charge): `raw` ns between its events, of which the coordinator's
    /// queue model predicted `ahead` to be waiting behind other containers' work. Returns the
    /// debt: what the launches charged so far still owe (positive) or were overcharged
    /// (negative), in ns.
    ///
    /// Why this is stable (see the module docs): a raw sample only errs upward (queueing adds,
    /// nothing subtracts), so the least raw sample in the ring caps the estimate; a clean sample
    /// (`ahead == 0`: by the model nothing of another container's sits between this launch and
    /// our own previous work) is raw, and a key that has clean samples is estimated from them
    /// alone, so its estimate never depends on other containers' estimates. Only a key with no
    /// clean sample uses raw minus the predicted wait, and a prediction that leaves nothing of
    /// the sample (`ahead >= raw`) is rejected as implausible.
    pub fn record(&self, raw: u64, ahead: u64, charged: u64, was_unmeasured: bool) -> i64 {
        self.record_at(super::now_ns(), raw, ahead, charged, was_unmeasured)
    }

    /// [`Entry::record`] at host time `now`.
    fn record_at(&self, now: u64, raw: u64, ahead: u64, charged: u64, was_unmeasured: bool) -> i64 {
        let raw = raw.max(1);
        let run = raw.checked_sub(ahead).filter(|&v| v > 0);
        if let Some(v) = run {
            let i = self.next.fetch_add(1, Relaxed) as usize % RING;
            self.raw[i].store(raw, Relaxed);
            self.ring[i].store(v, Relaxed);
            if ahead == 0 {
                let i = self.clean_next.fetch_add(1, Relaxed) as usize % RING;
                self.clean[i].store(v, Relaxed);
                self.clean_at.store(now, Relaxed);
            }
        }
        let est = match self.filtered(now) {
            0 => self.est.load(Relaxed), // every sample so far implausible: keep what we have
            e => e,
        };
        let agrees = run.is_some_and(|v| v.abs_diff(est) <= est / 4);
        self.every.store(
            if agrees {
                (self.every.load(Relaxed) * 2).min(SAMPLE_EVERY_MAX)
            } else {
                SAMPLE_EVERY
            },
            Relaxed,
        );
        if est == 0 {
            // Not measured yet and this sample was implausible: settle nothing (the launches
            // stay charged the default until a usable sample comes back).
            return 0;
        }
        let mut bulk = self.bulk.lock().unwrap_or_else(|e| e.into_inner());
        self.est.store(est, Release);
        let mut debt = 0;
        if self.learning() {
            // The launches charged the default, settled at an earlier estimate, follow this one.
            debt += bulk.launches as i64 * (est as i64 - bulk.at as i64);
        }
        // Launches charged the default and not settled yet (this one too, if it was): now.
        let n = self.unmeasured.swap(0, AcqRel);
        debt += n as i64 * (est as i64 - DEFAULT_NS as i64);
        bulk.launches += n;
        bulk.at = est;
        if !was_unmeasured {
            // What this launch used (filtered) minus what it was charged.
            debt += est as i64 - charged as i64;
        }
        debt
    }

    /// Whether the key is still being learned: its first [`RING`] samples. Every launch is
    /// measured meanwhile, and launches charged the default before the first measurement are
    /// settled again at each new estimate: a first sample that queued behind another
    /// container's burst (a run time ten times too long) must not leave a debt of seconds.
    #[inline]
    pub fn learning(&self) -> bool {
        self.next.load(Relaxed) < RING as u32
    }

    /// One launch in this many is measured now (a power of two).
    #[inline]
    pub fn every(&self) -> u32 {
        self.every.load(Relaxed)
    }

    /// The estimate (0: no sample): the 25th percentile of the clean samples if one came within
    /// [`CLEAN_TTL_NS`], else of the last [`RING`] samples; never above the least raw sample of
    /// those. (On a GPU saturated by several containers a kernel may go seconds without a clean
    /// sample; its clean ones stay the estimate meanwhile. Seen with four tenants: the last 16
    /// samples all queued, the predicted waits short of the real ones, and the estimate from them
    /// twice the run time, which halved the tenant's share.)
    fn filtered(&self, now: u64) -> u64 {
        let mut least_raw = u64::MAX;
        let mut all = [0u64; RING];
        let mut na = 0;
        for (s, r) in self.ring.iter().zip(&self.raw) {
            let x = s.load(Relaxed);
            if x != 0 {
                least_raw = least_raw.min(r.load(Relaxed).max(1));
                all[na] = x;
                na += 1;
            }
        }
        let mut clean = [0u64; RING];
        let mut nc = 0;
        let at = self.clean_at.load(Relaxed);
        if at != 0 && now.saturating_sub(at) < CLEAN_TTL_NS {
            for s in &self.clean {
                let x = s.load(Relaxed);
                if x != 0 {
                    least_raw = least_raw.min(x);
                    clean[nc] = x;
                    nc += 1;
                }
            }
        }
        let v = if nc > 0 {
            &mut clean[..nc]
        } else {
            &mut all[..na]
        };
        if v.is_empty() {
            return 0;
        }
        v.sort_unstable();
        v[(v.len() - 1) / 4].min(least_raw)
    }
}

/// How long clean samples decide a key's estimate after the last one came.
pub const CLEAN_TTL_NS: u64 = 5_000_000_000;

/// An open-addressing table, fixed size, lock-free: key -> entry. Keys are never removed (a
/// process has a bounded number of kernels; when full, launches are charged by a shared
/// overflow entry).
pub struct Estimates {
    entries: Box<[Entry]>,
    overflow: Entry,
}

impl Estimates {
    pub fn new(capacity: usize) -> Estimates {
        let n = capacity.next_power_of_two();
        Estimates {
            entries: (0..n).map(|_| Entry::new()).collect(),
            overflow: Entry::new(),
        }
    }

    /// The entry of `key` (non-zero), made on first use.
    #[inline]
    pub fn entry(&self, key: u64) -> &Entry {
        let key = key.max(1);
        let mask = self.entries.len() - 1;
        let mut i = (key.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 20) as usize & mask;
        for _ in 0..64 {
            let e = &self.entries[i];
            match e.key.load(Acquire) {
                k if k == key => return e,
                0 => match e.key.compare_exchange(0, key, AcqRel, Acquire) {
                    Ok(_) => return e,
                    Err(k) if k == key => return e,
                    Err(_) => {}
                },
                _ => {}
            }
            i = (i + 1) & mask;
        }
        &self.overflow
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_measurement_settles_every_default_charge() {
        let t = Estimates::new(64);
        let e = t.entry(42);
        let charges: Vec<_> = (0..5).map(|_| e.charge()).collect();
        assert!(charges.iter().all(|&(c, u)| c == DEFAULT_NS && u));
        // One of the five is measured: 1 ms.
        let debt = e.record(1_000_000, 0, DEFAULT_NS, true);
        assert_eq!(debt, 5 * (1_000_000 - DEFAULT_NS as i64));
        assert_eq!(e.charge(), (1_000_000, false));
        assert_eq!(e.record(1_000_000, 0, 1_000_000, false), 0);
    }

    /// Seen on the simulator under CPU load: a tenant's first sample queued behind the other
    /// tenant's startup burst (12.5 ms raw for a 1 ms kernel), its 100 launches charged the
    /// default were settled at that, and the tenant slept a second on a debt that was not real.
    #[test]
    fn default_charges_follow_the_estimate_while_it_is_learned() {
        let t = Estimates::new(64);
        let e = t.entry(5);
        for _ in 0..100 {
            e.charge();
        }
        let first = e.record(12_500_000, 800_000, DEFAULT_NS, true);
        assert_eq!(first, 100 * (11_700_000 - DEFAULT_NS as i64));
        assert!(e.learning());
        // The next sample is clean: 1 ms. The 100 default charges are settled again at 1 ms
        // (the clean sample decides), and this launch, charged 11.7 ms, gets its difference.
        let second = e.record(1_000_000, 0, 11_700_000, false);
        assert_eq!(
            second,
            100 * (1_000_000 - 11_700_000) + (1_000_000 - 11_700_000)
        );
        assert_eq!(e.estimate(), 1_000_000);
        // Once the ring is full the settled launches stay where they are.
        for _ in 2..RING {
            e.record(1_000_000, 0, 1_000_000, false);
        }
        assert!(!e.learning());
        // A faster sample caps the estimate at 0.9 ms: only this launch's difference is owed
        // back, not the 100 settled ones'.
        assert_eq!(e.record(900_000, 0, 1_000_000, false), -100_000);
        assert_eq!(e.estimate(), 900_000);
    }

    #[test]
    fn clean_samples_decide_and_others_estimates_cannot_move_them() {
        let t = Estimates::new(64);
        let e = t.entry(7);
        e.charge();
        e.record(50_000, 0, DEFAULT_NS, true);
        for _ in 0..7 {
            e.record(50_000, 0, 50_000, false);
        }
        // Samples that queued behind other containers, with the predicted wait too large (their
        // estimates too high) or too small: ignored while the ring holds clean samples.
        for (raw, ahead) in [
            (950_000u64, 930_000u64),
            (300_000, 100_000),
            (700_000, 690_000),
        ] {
            assert_eq!(e.record(raw, ahead, 50_000, false), 0, "{raw} - {ahead}");
        }
        // A clean sample inflated by a race (another container's kernel slipped in).
        e.record(1_050_000, 0, 50_000, false);
        assert_eq!(e.estimate(), 50_000);
        // A function that got faster: the quantile follows.
        for _ in 0..RING - 1 {
            e.record(40_000, 0, 50_000, false);
        }
        assert_eq!(e.record(40_000, 0, 50_000, false), -10_000);
        assert_eq!(e.estimate(), 40_000);
    }

    #[test]
    fn without_clean_samples_the_least_raw_sample_caps_the_estimate() {
        let t = Estimates::new(64);
        let e = t.entry(9);
        e.charge();
        // Predicted waits too small (others' estimates too low): 250 us left of each.
        e.record(300_000, 50_000, DEFAULT_NS, true);
        for _ in 0..3 {
            e.record(300_000, 50_000, 250_000, false);
        }
        assert_eq!(e.estimate(), 250_000);
        // One launch that barely queued: its raw time bounds the run time.
        e.record(180_000, 100, 250_000, false);
        assert_eq!(e.estimate(), 180_000);
        // A prediction that leaves nothing of the sample is rejected.
        assert_eq!(e.record(100_000, 200_000, 180_000, false), 0);
        assert_eq!(e.estimate(), 180_000);
    }

    #[test]
    fn an_implausible_first_sample_settles_nothing() {
        let t = Estimates::new(64);
        let e = t.entry(11);
        e.charge();
        e.charge();
        assert_eq!(e.record(100_000, 150_000, DEFAULT_NS, true), 0);
        assert_eq!(e.estimate(), 0);
        assert_eq!(e.record(400_000, 0, DEFAULT_NS, true), 2 * 300_000);
        assert_eq!(e.estimate(), 400_000);
    }

    #[test]
    fn a_steady_kernel_is_sampled_less_and_a_changing_one_more() {
        let t = Estimates::new(64);
        let e = t.entry(13);
        e.charge();
        e.record(100_000, 0, DEFAULT_NS, true);
        let mut seen = vec![e.every()];
        for _ in 0..8 {
            e.record(101_000, 0, 100_000, false);
            seen.push(e.every());
        }
        assert_eq!(seen, [32, 64, 128, 256, 256, 256, 256, 256, 256]);
        // A sample far from the estimate (the kernel changed, or it queued): back to often.
        e.record(300_000, 0, 100_000, false);
        assert_eq!(e.every(), SAMPLE_EVERY);
        // An implausible one (the predicted wait covers it all) too.
        e.record(101_000, 0, 100_000, false);
        assert_eq!(e.every(), 2 * SAMPLE_EVERY);
        e.record(100_000, 200_000, 100_000, false);
        assert_eq!(e.every(), SAMPLE_EVERY);
    }

    /// Four tenants on a saturated GPU: after its first clean samples a kernel's launches all
    /// queued behind others, with predicted waits short of the real ones.
    #[test]
    fn clean_samples_outlast_a_run_of_queued_ones_until_they_are_old() {
        let t = Estimates::new(64);
        let e = t.entry(21);
        let s = 1_000_000_000u64;
        e.charge();
        e.record_at(s, 1_000_000, 0, DEFAULT_NS, true);
        for _ in 0..3 {
            e.record_at(s, 1_000_000, 0, 1_000_000, false);
        }
        for i in 0..2 * RING as u64 {
            e.record_at(s + i * 10_000_000, 10_000_000, 7_800_000, 1_000_000, false);
        }
        assert_eq!(e.estimate(), 1_000_000, "the clean samples decide");
        // Five seconds without a clean sample: the queued ones (2.2 ms each) decide.
        e.record_at(
            s + CLEAN_TTL_NS + 1,
            10_000_000,
            7_800_000,
            1_000_000,
            false,
        );
        assert_eq!(e.estimate(), 2_200_000);
    }

    #[test]
    fn keys_get_their_own_entries_until_full() {
        let t = Estimates::new(4);
        let a = t.entry(1) as *const Entry;
        assert_eq!(a, t.entry(1) as *const Entry);
        let others: Vec<_> = (2..=4).map(|k| t.entry(k) as *const Entry).collect();
        assert!(!others.contains(&a));
        assert_eq!(t.entry(99) as *const Entry, &t.overflow as *const Entry);
    }
}
