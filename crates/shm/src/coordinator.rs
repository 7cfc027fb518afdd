//! The GPU coordinator: one file per physical GPU (`<coord dir>/gpu-<UUID hex>`), mapped by every
//! CUDA process of every container that uses the GPU. Each container holds a slot: its compute
//! policy (a cap or a weight), its token bucket in GPU-time ns (shared by the container's
//! processes), when it last launched work, when it was last held back, and the GPU time it has
//! consumed. Every process derives the refill rates from the slots on its own (see
//! `src/timeslice`); nothing here blocks, so no dead process can hold anyone up.
//!
//! A slot is claimed per (container id) under the file's flock (once per container per GPU) and
//! lists up to [`SLOT_PROCS`] of the container's live processes; a slot none of whose listed
//! processes lives, and which has not launched for [`STALE_NS`], is reclaimed. A container that
//! stops launching (SIGKILL included) drops out of the share computation by its `last_active`
//! alone, long before that.
//!
//! The layout is mirrored in `include/cuvisor.h`; bump [`COORD_VERSION`] on any change.

use crate::process;
use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI64, AtomicU32, AtomicU64, Ordering::*};

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
    layout: *const CoordLayout,
    path: PathBuf,
    file: File,
}

// SAFETY: CoordLayout is made of atomics and integers written before the magic is published; the
// mapping stays valid for the life of the value.
unsafe impl Send for Coordinator {}
// SAFETY: as above; shared mutation goes through atomics only.
unsafe impl Sync for Coordinator {}

impl Drop for Coordinator {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly what `open` mapped; no reference into it outlives self.
        unsafe {
            libc::munmap(
                self.layout as *mut libc::c_void,
                std::mem::size_of::<CoordLayout>(),
            )
        };
    }
}

/// `gpu-<32 hex digits>`: the coordinator file of a GPU.
pub fn file_name(uuid: [u8; 16]) -> String {
    let hex: String = uuid.iter().map(|b| format!("{b:02x}")).collect();
    format!("gpu-{hex}")
}

fn io_err(path: &Path, what: &str, e: std::io::Error) -> String {
    format!("coordinator {}: {what}: {e}", path.display())
}

struct Flock<'a>(&'a File);
impl<'a> Flock<'a> {
    fn new(f: &'a File) -> Flock<'a> {
        // SAFETY: our own open descriptor; the kernel drops the lock if we die holding it.
        unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) };
        Flock(f)
    }
}
impl Drop for Flock<'_> {
    fn drop(&mut self) {
        // SAFETY: as above.
        unsafe { libc::flock(self.0.as_raw_fd(), libc::LOCK_UN) };
    }
}

impl Coordinator {
    /// Opens (creating and initialising if needed) the coordinator of GPU `uuid` in `dir`.
    pub fn open_dir(dir: &Path, uuid: [u8; 16]) -> Result<Coordinator, String> {
        if !dir.is_dir() {
            std::fs::create_dir_all(dir).map_err(|e| io_err(dir, "create directory", e))?;
        }
        let path = dir.join(file_name(uuid));
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| io_err(&path, "open", e))?;
        let size = std::mem::size_of::<CoordLayout>();
        let layout = {
            let _lock = Flock::new(&file);
            let len = file.metadata().map_err(|e| io_err(&path, "stat", e))?.len();
            if len < size as u64 {
                if len != 0 {
                    return Err(format!(
                        "coordinator {}: {len} bytes, expected {size}: not a cuvisor coordinator of this version",
                        path.display()
                    ));
                }
                file.set_len(size as u64)
                    .map_err(|e| io_err(&path, "resize", e))?;
            }
            // SAFETY: mapping `size` bytes of a file at least that long, shared between processes.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    size,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED,
                    file.as_raw_fd(),
                    0,
                )
            };
            if p == libc::MAP_FAILED {
                return Err(io_err(&path, "mmap", std::io::Error::last_os_error()));
            }
            let layout = p as *mut CoordLayout;
            // SAFETY: the mapping is valid, page aligned, zero-filled when new; zero bytes are
            // valid for every field.
            let header = unsafe { &(*layout).header };
            let (hi, lo) = uuid.split_at(8);
            let words = [
                u64::from_be_bytes(hi.try_into().unwrap_or_default()),
                u64::from_be_bytes(lo.try_into().unwrap_or_default()),
            ];
            match header.magic.load(Acquire) {
                0 => {
                    // SAFETY: exclusive (flock held, magic unset): no reader trusts these yet.
                    unsafe {
                        (*layout).header.version = COORD_VERSION;
                        (*layout).header.size = size as u32;
                        (*layout).header.max_slots = MAX_SLOTS as u32;
                        (*layout).header.slot_procs = SLOT_PROCS as u32;
                        (*layout).header.uuid_words = words;
                    }
                    header.magic.store(COORD_MAGIC, Release);
                }
                COORD_MAGIC
                    if header.version == COORD_VERSION
                        && header.size == size as u32
                        && header.uuid_words == words => {}
                m => {
                    // SAFETY: unmapping what we just mapped before reporting.
                    unsafe { libc::munmap(p, size) };
                    return Err(format!(
                        "coordinator {}: {}",
                        path.display(),
                        if m == COORD_MAGIC {
                            "another version or another GPU's file"
                        } else {
                            "not a cuvisor coordinator"
                        }
                    ));
                }
            }
            layout as *const CoordLayout
        };
        Ok(Coordinator { layout, path, file })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn layout(&self) -> &CoordLayout {
        // SAFETY: valid while self lives (see Coordinator).
        unsafe { &*self.layout }
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
                let _lock = Flock::new(&self.file);
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
        self.list_proc(i, pid, start);
        Some(i)
    }

    fn find(&self, container: u64) -> Option<usize> {
        self.layout().slots.iter().position(|s| {
            s.state.load(Acquire) == SLOT_READY && s.container_id.load(Acquire) == container
        })
    }

    /// Lists (pid, start) in slot `i` (a dead process's entry is reused).
    pub fn list_proc(&self, i: usize, pid: u32, start: u64) {
        let s = &self.layout().slots[i];
        if s.procs
            .iter()
            .any(|p| p.pid.load(Acquire) == pid && p.start_time.load(Acquire) == start)
        {
            return;
        }
        for pass in 0..2 {
            for p in &s.procs {
                if p.pid.compare_exchange(0, pid, AcqRel, Relaxed).is_ok() {
                    p.start_time.store(start, Release);
                    return;
                }
            }
            if pass == 0 {
                for p in &s.procs {
                    let (q, st) = (p.pid.load(Acquire), p.start_time.load(Acquire));
                    if q != 0 && st != 0 && !process::alive(q, st) {
                        let _ = p.pid.compare_exchange(q, 0, AcqRel, Relaxed);
                    }
                }
            }
        }
    }

    /// Takes (pid, start) off slot `i` (at a normal exit).
    pub fn leave(&self, i: usize, pid: u32, start: u64) {
        for p in &self.layout().slots[i].procs {
            if p.pid.load(Acquire) == pid && p.start_time.load(Acquire) == start {
                p.start_time.store(0, Relaxed);
                p.pid.store(0, Release);
            }
        }
    }

    /// Gives back the slots of containers with no live listed process that have not launched
    /// for [`STALE_NS`]. Returns how many. Call with the flock held or accept a benign race
    /// (a slot is only freed from READY by a CAS).
    pub fn reclaim_dead(&self, now: u64) -> usize {
        let mut n = 0;
        for s in self.layout().slots.iter() {
            if s.state.load(Acquire) != SLOT_READY
                || now.saturating_sub(s.last_active.load(Acquire)) < STALE_NS
            {
                continue;
            }
            let live = s.procs.iter().any(|p| {
                let (q, st) = (p.pid.load(Acquire), p.start_time.load(Acquire));
                q != 0 && (st == 0 || process::alive(q, st))
            });
            if !live
                && s.state
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

    fn temp(tag: &str) -> (PathBuf, Coordinator) {
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
    fn a_dead_containers_slot_is_reclaimed_once_stale() {
        let (dir, c) = temp("reclaim");
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        let s = c.join(33, POLICY_SHARE, 1_000, pid, 4242, 10).unwrap();
        assert_eq!(c.reclaim_dead(10 + STALE_NS / 2), 0, "not stale yet");
        let (me, start) = process::me();
        let t = c.join(44, POLICY_SHARE, 1_000, me, start, 10).unwrap();
        assert_eq!(c.reclaim_dead(10 + STALE_NS), 1, "only the dead one");
        assert_eq!(c.slot(s).state.load(Relaxed), SLOT_FREE);
        assert_eq!(c.slot(t).state.load(Relaxed), SLOT_READY);
        c.leave(t, me, start);
        assert_eq!(c.reclaim_dead(10 + STALE_NS), 1, "nobody listed any more");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
