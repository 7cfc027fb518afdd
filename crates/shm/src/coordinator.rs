//! The GPU coordinator: one file per physical GPU (`<coord dir>/gpu-<UUID hex>`), mapped by every
//! CUDA process of every container that uses the GPU. Each container holds a slot: its compute
//! policy (a cap or a weight), its token bucket in GPU-time ns (shared by the container's
//! processes), when it last launched work, when it was last held back, and the GPU time it has
//! consumed. Every process derives the refill rates from the slots on its own (see
//! `src/timeslice`); nothing here blocks, so no dead process can hold anyone up.
//!
//! A slot is claimed per (container id) under the file's flock (once per container per GPU, the
//! lock waited for a bounded time) and every process of the container that uses the GPU holds a
//! shared lease on the slot (see `lease`: a lock the kernel drops when the process dies, valid
//! across pid namespaces, where the pids the slot lists for people mean nothing); a slot whose
//! lease nobody holds, and which has not launched for [`STALE_NS`], is reclaimed. A container
//! that stops launching (SIGKILL included) drops out of the share computation by its
//! `last_active` alone, long before that.
//!
//! The layout is mirrored in `include/cuvisor.h`; bump [`COORD_VERSION`] on any change.

use crate::lease;
use crate::mapped::{self, Flock, Mapped};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU32, AtomicU64, Ordering::*};

/// "CUVCORD1"
pub const COORD_MAGIC: u64 = 0x3144_524f_4356_5543;
pub const COORD_VERSION: u32 = 1;
pub const MAX_SLOTS: usize = 64;
/// Processes listed per slot (a container with more still works; only reclaiming its slot
/// then waits for [`STALE_NS`] of inactivity with no listed process alive).
pub const SLOT_PROCS: usize = 8;

/// Slot states.
pub const SLOT_FREE: u32 = 0;
pub const SLOT_CLAIMING: u32 = 1;
pub const SLOT_READY: u32 = 2;

/// Policies: a cap in parts per million of GPU time, never exceeded even when the GPU is idle.
pub const POLICY_LIMIT: u32 = 1;
/// A weight (in thousandths): a share of the GPU among active containers, idle time lent.
pub const POLICY_SHARE: u32 = 2;

/// A slot unused this long whose listed processes are all dead is given back (ns).
pub const STALE_NS: u64 = 2_000_000_000;

#[repr(C)]
pub struct CoordHeader {
    pub magic: AtomicU64,
    pub version: u32,
    /// sizeof(CoordLayout).
    pub size: u32,
    pub max_slots: u32,
    pub slot_procs: u32,
    /// The GPU's UUID as two big-endian words (as in the ledger).
    pub uuid_words: [u64; 2],
    /// A model of the GPU's queue: CLOCK_MONOTONIC ns at which the work every container has
    /// launched should end (launch times plus estimates, one after another).
    pub timeline: AtomicU64,
}

#[repr(C)]
pub struct SlotProc {
    /// 0 = free.
    pub pid: AtomicU32,
    pub _pad: u32,
    pub start_time: AtomicU64,
}

#[repr(C)]
pub struct Slot {
    /// SLOT_FREE, SLOT_CLAIMING, SLOT_READY.
    pub state: AtomicU32,
    /// POLICY_LIMIT or POLICY_SHARE.
    pub policy: AtomicU32,
    /// The container (its ledger's id).
    pub container_id: AtomicU64,
    /// POLICY_LIMIT: the cap in ppm of GPU time; POLICY_SHARE: the weight in thousandths.
    pub param: AtomicU64,
    /// The refill rate last computed for this slot (ppm of GPU time; for monitors).
    pub grant_ppm: AtomicU64,
    /// The token bucket: GPU-time ns the container may still launch (negative: in debt).
    pub tokens: AtomicI64,
    /// CLOCK_MONOTONIC ns up to which the bucket has been refilled.
    pub refill_at: AtomicU64,
    /// CLOCK_MONOTONIC ns of the container's last launch on this GPU.
    pub last_active: AtomicU64,
    /// CLOCK_MONOTONIC ns at which a launching thread of the container last had to wait.
    pub throttled_at: AtomicU64,
    /// GPU time the container has used on this GPU (ns, estimates corrected by measurement).
    pub consumed_ns: AtomicU64,
    /// Time its threads slept waiting for tokens (ns).
    pub throttled_ns: AtomicU64,
    /// Processes of the container using the GPU (for reclaiming the slot of a dead container).
    pub procs: [SlotProc; SLOT_PROCS],
    /// CLOCK_MONOTONIC ns at which the container's last launched work should end on the
    /// header's `timeline`.
    pub queued_until: AtomicU64,
    pub _reserved: [u64; 5],
}

#[repr(C)]
pub struct CoordLayout {
    pub header: CoordHeader,
    pub slots: [Slot; MAX_SLOTS],
}

/// A mapped coordinator file.
pub struct Coordinator {
    map: Mapped<CoordLayout>,
    /// Slots this process holds the lease of (its own container's).
    mine: [AtomicBool; MAX_SLOTS],
}

// SAFETY: atomics and integers only; zero bytes are a file not yet initialised.
unsafe impl mapped::Layout for CoordLayout {
    const MAGIC: u64 = COORD_MAGIC;
    const WHAT: &'static str = "coordinator";
    fn magic(&self) -> &AtomicU64 {
        &self.header.magic
    }
}

/// `gpu-<32 hex digits>`: the coordinator file of a GPU.
pub fn file_name(uuid: [u8; 16]) -> String {
    let hex: String = uuid.iter().map(|b| format!("{b:02x}")).collect();
    format!("gpu-{hex}")
}

impl Coordinator {
    /// Opens (creating and initialising if needed) the coordinator of GPU `uuid` in `dir`.
    pub fn open_dir(dir: &Path, uuid: [u8; 16]) -> Result<Coordinator, String> {
        if !dir.is_dir() {
            std::fs::create_dir_all(dir)
                .map_err(|e| format!("coordinator {}: create directory: {e}", dir.display()))?;
        }
        let path = dir.join(file_name(uuid));
        let size = std::mem::size_of::<CoordLayout>();
        let (hi, lo) = uuid.split_at(8);
        let words = [
            u64::from_be_bytes(hi.try_into().unwrap_or_default()),
            u64::from_be_bytes(lo.try_into().unwrap_or_default()),
        ];
        let map = mapped::open::<CoordLayout>(
            &path,
            // Every uid's containers on the GPU share it.
            mapped::Open {
                create: true,
                mode: 0o666,
            },
            |l| {
                // SAFETY: a new file, the flock held, the magic unset: no reader trusts it yet.
                unsafe {
                    (*l).header.version = COORD_VERSION;
                    (*l).header.size = size as u32;
                    (*l).header.max_slots = MAX_SLOTS as u32;
                    (*l).header.slot_procs = SLOT_PROCS as u32;
                    (*l).header.uuid_words = words;
                }
            },
            |l| {
                let h = &l.header;
                if h.version == COORD_VERSION && h.size as usize == size && h.uuid_words == words {
                    Ok(())
                } else {
                    Err("another version or another GPU's file".into())
                }
            },
        )?;
        Ok(Coordinator {
            map,
            mine: std::array::from_fn(|_| AtomicBool::new(false)),
        })
    }

    pub fn path(&self) -> &Path {
        self.map.path()
    }

    fn layout(&self) -> &CoordLayout {
        &self.map
    }

    pub fn header(&self) -> &CoordHeader {
        &self.layout().header
    }

    pub fn slot(&self, i: usize) -> &Slot {
        &self.layout().slots[i]
    }

    /// Slots in use: (index, slot).
    pub fn slots(&self) -> impl Iterator<Item = (usize, &Slot)> {
        self.layout()
            .slots
            .iter()
            .enumerate()
            .filter(|(_, s)| s.state.load(Acquire) == SLOT_READY)
    }

    /// The slot of `container` (claimed with `policy`/`param` if it has none), with process
    /// (pid, start) listed in it. A container already holding a slot keeps its policy; a lower
    /// cap tightens it. None when every slot is taken by a live container.
    pub fn join(
        &self,
        container: u64,
        policy: u32,
        param: u64,
        pid: u32,
        start: u64,
        now: u64,
    ) -> Option<usize> {
        let i = match self.find(container) {
            Some(i) => i,
            None => {
                let _lock = Flock::exclusive(self.map.file(), mapped::LOCK_WAIT).ok()?;
                match self.find(container) {
                    Some(i) => i,
                    None => {
                        let free = |me: &Self| {
                            me.layout()
                                .slots
                                .iter()
                                .position(|s| s.state.load(Acquire) == SLOT_FREE)
                        };
                        let i = free(self).or_else(|| {
                            self.reclaim_dead(now);
                            free(self)
                        })?;
                        let s = &self.layout().slots[i];
                        s.state.store(SLOT_CLAIMING, Release);
                        s.container_id.store(container, Relaxed);
                        s.policy.store(policy, Relaxed);
                        s.param.store(param, Relaxed);
                        s.grant_ppm.store(0, Relaxed);
                        s.tokens.store(0, Relaxed);
                        s.refill_at.store(now, Relaxed);
                        s.last_active.store(now, Relaxed);
                        s.throttled_at.store(0, Relaxed);
                        s.consumed_ns.store(0, Relaxed);
                        s.throttled_ns.store(0, Relaxed);
                        s.queued_until.store(0, Relaxed);
                        for p in &s.procs {
                            p.pid.store(0, Relaxed);
                            p.start_time.store(0, Relaxed);
                        }
                        s.state.store(SLOT_READY, Release);
                        i
                    }
                }
            }
        };
        let s = &self.layout().slots[i];
        if policy == POLICY_LIMIT && s.policy.load(Acquire) == POLICY_LIMIT {
            s.param.fetch_min(param, AcqRel);
        }
        s.last_active.fetch_max(now, AcqRel);
        if !self.mine[i].swap(true, AcqRel) {
            // Shared: every process of the container holds it; a forked child inherits it.
            let _ = lease::try_hold(self.map.file(), i, true);
        }
        self.list_proc(i, pid, start);
        Some(i)
    }

    fn find(&self, container: u64) -> Option<usize> {
        self.layout().slots.iter().position(|s| {
            s.state.load(Acquire) == SLOT_READY && s.container_id.load(Acquire) == container
        })
    }

    /// Lists (pid, start) in slot `i`, for people (a pid from another pid namespace means
    /// nothing here, so nothing is decided by it; a listed pid that is gone is overwritten).
    pub fn list_proc(&self, i: usize, pid: u32, start: u64) {
        let s = &self.layout().slots[i];
        if s.procs
            .iter()
            .any(|p| p.pid.load(Acquire) == pid && p.start_time.load(Acquire) == start)
        {
            return;
        }
        let free = s.procs.iter().find(|p| p.pid.load(Acquire) == 0);
        let p = free.unwrap_or(&s.procs[(pid as usize) % SLOT_PROCS]);
        p.pid.store(pid, Release);
        p.start_time.store(start, Release);
    }

    /// Takes (pid, start) off slot `i`'s list (at a normal exit). The lease stays held until
    /// the process's descriptors close: a forked child still running shares it.
    pub fn leave(&self, i: usize, pid: u32, start: u64) {
        for p in &self.layout().slots[i].procs {
            if p.pid.load(Acquire) == pid && p.start_time.load(Acquire) == start {
                p.start_time.store(0, Relaxed);
                p.pid.store(0, Release);
            }
        }
    }

    /// Gives back the slots of containers none of whose processes holds the slot's lease and
    /// that have not launched for [`STALE_NS`]. Returns how many. Never this process's own.
    /// Call with the flock held or accept a benign race (a slot is only freed from READY by a
    /// CAS).
    pub fn reclaim_dead(&self, now: u64) -> usize {
        let mut n = 0;
        for (i, s) in self.layout().slots.iter().enumerate() {
            if s.state.load(Acquire) != SLOT_READY
                || self.mine[i].load(Acquire)
                || now.saturating_sub(s.last_active.load(Acquire)) < STALE_NS
                || lease::held(self.map.file(), i, 1).unwrap_or(true)
            {
                continue;
            }
            if s.state
                .compare_exchange(SLOT_READY, SLOT_FREE, AcqRel, Relaxed)
                .is_ok()
            {
                n += 1;
            }
        }
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::process;

    fn temp(tag: &str) -> (std::path::PathBuf, Coordinator) {
        let dir = std::env::temp_dir().join(format!("cuvisor-coord-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let c = Coordinator::open_dir(&dir, [7; 16]).unwrap();
        (dir, c)
    }

    #[test]
    fn one_slot_per_container_and_caps_only_tighten() {
        let (dir, c) = temp("join");
        let (pid, start) = process::me();
        let a = c.join(11, POLICY_LIMIT, 300_000, pid, start, 5).unwrap();
        let b = c.join(22, POLICY_SHARE, 2_000, pid, start, 5).unwrap();
        assert_ne!(a, b);
        assert_eq!(c.join(11, POLICY_LIMIT, 500_000, pid, start, 6), Some(a));
        assert_eq!(c.slot(a).param.load(Relaxed), 300_000);
        c.join(11, POLICY_LIMIT, 100_000, pid, start, 6);
        assert_eq!(c.slot(a).param.load(Relaxed), 100_000);
        assert_eq!(c.slots().count(), 2);
        // Another process of the same file sees the same slots.
        let again = Coordinator::open_dir(&dir, [7; 16]).unwrap();
        assert_eq!(again.slots().count(), 2);
        assert!(
            Coordinator::open_dir(&dir, [8; 16]).is_ok(),
            "another GPU, another file"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_dead_containers_slot_is_reclaimed_once_stale_whatever_its_pids_say() {
        let (dir, c) = temp("reclaim");
        let (me, start) = process::me();
        // A container whose process is gone, though the pid it listed is a live one here (ours):
        // as a pid of another pid namespace would look.
        let gone = Coordinator::open_dir(&dir, [7; 16]).unwrap();
        let s = gone.join(33, POLICY_SHARE, 1_000, me, start, 10).unwrap();
        drop(gone);
        // (A forking thread elsewhere in this test binary can hold the closed description's
        // lock for an instant: wait for it to go.)
        let t = std::time::Instant::now();
        while lease::held(c.map.file(), s, 1).unwrap() {
            assert!(t.elapsed() < std::time::Duration::from_secs(2));
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        // A live container whose listed pid means nothing here.
        let live = Coordinator::open_dir(&dir, [7; 16]).unwrap();
        let t = live.join(44, POLICY_SHARE, 1_000, 999_999, 1, 10).unwrap();
        assert_eq!(c.reclaim_dead(10 + STALE_NS / 2), 0, "not stale yet");
        assert_eq!(
            c.reclaim_dead(10 + STALE_NS),
            1,
            "only the one without a lease"
        );
        assert_eq!(c.slot(s).state.load(Relaxed), SLOT_FREE);
        assert_eq!(c.slot(t).state.load(Relaxed), SLOT_READY);
        live.leave(t, 999_999, 1);
        assert_eq!(
            c.reclaim_dead(10 + STALE_NS),
            0,
            "off the list, but still holding the lease"
        );
        drop(live);
        let since = std::time::Instant::now();
        while lease::held(c.map.file(), t, 1).unwrap() {
            assert!(since.elapsed() < std::time::Duration::from_secs(2));
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert_eq!(c.reclaim_dead(10 + STALE_NS), 1);
        // Our own slot is never reclaimed by us.
        let u = c.join(55, POLICY_SHARE, 1_000, me, start, 10).unwrap();
        assert_eq!(c.reclaim_dead(10 + 10 * STALE_NS), 0);
        assert_eq!(c.slot(u).state.load(Relaxed), SLOT_READY);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
