//! State shared by every process that loads the simulated driver or NVML: a file mapped
//! `MAP_SHARED` (default under /dev/shm, `CUVISOR_SIM_STATE` names another).
//!
//! Everything in it is a plain atomic: no process can leave a lock behind when it dies.
//! - per device: physical memory in use, the execution timeline (the time at which the last
//!   queued kernel ends), busy time in 10 ms buckets (what NVML's utilization reads), injected
//!   faults (XID events, NVLinks down, allocations that must fail);
//! - per process: a slot (pid + start time) with its memory per device and its own busy buckets,
//!   so NVML can list processes and a process that dies (SIGKILL included) gives its memory back
//!   when anyone next looks;
//! - memory shared between processes (exported VMM allocations, IPC-exported allocations): an
//!   entry that no process owns, counted in its device's use until no live process holds it
//!   (each holder keeps a lease lock on the entry's byte, which the kernel drops when it dies);
//! - events shared between processes (cuIpcGetEventHandle): the time the last record completes,
//!   which every process that opened the event reads and writes;
//! - the interconnect (see [`Shared::reserve`]): per resource of the machine's fabric (one
//!   direction of a PCIe link, of bonded NVLinks, ...) the time its last reserved copy ends and
//!   the bytes it ever carried; per device its copy engines' timelines and the bytes its PCIe
//!   link carried per 10 ms (what NVML's PCIe throughput reads).

use crate::model::{Model, MAX_DEVICES};
use cuvisor_shm::lease;
use cuvisor_shm::mapped::{self, Mapped};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::*};

pub const MAGIC: u64 = 0x4355_5653_494d_0001; // "CUVSIM" v1
pub const LAYOUT_VERSION: u32 = 6;
pub const MAX_PROCS: usize = 256;
/// Allocations shared between processes at once.
pub const MAX_SHARED: usize = 1024;
/// Width of one utilization bucket.
pub const BUCKET_NS: u64 = 10_000_000;
/// Device history: 1024 buckets of 10 ms = 10.24 s.
pub const DEV_BUCKETS: usize = 1024;
/// Per-process history: 512 buckets = 5.12 s (kernels queued further ahead than that are not
/// fully reflected in per-process utilization). The file is sparse: unused slots cost nothing.
pub const PROC_BUCKETS: usize = 512;
pub const XID_RING: usize = 32;
/// Events exported with cuIpcGetEventHandle at once.
pub const MAX_IPC_EVENTS: usize = 1024;
/// `SharedEvent::time` of an event recorded behind work whose end is not known yet (a host
/// function still to run, a wait on memory): not complete.
pub const EVENT_PENDING: u64 = u64::MAX;
/// Interconnect resources with a timeline: a 16-GPU fabric has at most 5 x 16 per-GPU
/// resources, 2 x 16 switch uplinks, 16 x 15 SMP links and 16 x 15 bonded NVLinks (592).
pub const MAX_LINKS: usize = 640;
/// Copy engines per device with a timeline (CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT is at most a
/// few; more are clamped to this).
pub const MAX_ENGINES: usize = 16;
/// PCIe traffic history per device and direction: 256 buckets of 10 ms = 2.56 s.
pub const PCIE_BUCKETS: usize = 256;

/// A bucket packs (bucket number: high 40 bits, busy ns: low 24 bits) in one word, so that a
/// stale bucket (from one lap of the ring ago) reads as empty and is reset by whoever writes it.
const BUSY_BITS: u32 = 24;
const BUSY_MASK: u64 = (1 << BUSY_BITS) - 1;

#[repr(C)]
pub struct Header {
    pub magic: AtomicU64,
    pub version: u32,
    pub device_count: u32,
    pub fingerprint: u64,
    /// Bumped by every process that attaches; used to make pool/handle ids unique machine-wide.
    pub attach_count: AtomicU64,
}

#[repr(C)]
pub struct XidSlot {
    /// Sequence number of the event in this slot (0 = empty).
    pub seq: AtomicU64,
    pub xid: AtomicU64,
    pub time_ns: AtomicU64,
}

#[repr(C)]
pub struct DeviceShared {
    pub mem_used: AtomicU64,
    /// CLOCK_MONOTONIC ns at which the last queued kernel ends.
    pub timeline_end: AtomicU64,
    /// Total kernel time ever queued (ns).
    pub busy_total: AtomicU64,
    pub kernels: AtomicU64,
    /// Fault injection: the next N allocations on this device fail with CUDA_ERROR_OUT_OF_MEMORY.
    pub fail_allocs: AtomicU64,
    /// Fault injection: bit i set = NVLink i is down.
    pub nvlink_down: AtomicU64,
    pub xid_seq: AtomicU64,
    pub xids: [XidSlot; XID_RING],
    pub util: [AtomicU64; DEV_BUCKETS],
    /// Each copy engine's timeline.
    pub engines: [Timeline; MAX_ENGINES],
    /// Time copies and memsets read or wrote the device's memory, per 10 ms bucket (as `util`):
    /// NVML's memory utilization.
    pub mem_util: [AtomicU64; DEV_BUCKETS],
    /// KiB the device's PCIe link carried host to device (rx) and device to host (tx), per
    /// 10 ms bucket (packed as `util`'s buckets).
    pub pcie_rx: [AtomicU64; PCIE_BUCKETS],
    pub pcie_tx: [AtomicU64; PCIE_BUCKETS],
}

/// A timeline copies take turns on (a link's direction, a copy engine): when the last turn
/// taken ends, and the latest idle gap left before a turn taken for later, so that a copy due
/// now can use the time before a copy reserved behind a long kernel (`Shared::reserve`).
#[repr(C)]
pub struct Timeline {
    /// CLOCK_MONOTONIC ns at which the last turn ends.
    pub end: AtomicU64,
    /// The gap, packed: its first microsecond modulo 2^40 (read back as the value nearest now)
    /// and its length (`Timeline::pack`).
    pub gap: AtomicU64,
}

/// Bits of a packed gap that hold its length (see [`Timeline::pack`]).
const GAP_LEN_BITS: u32 = 24;

impl Timeline {
    /// The gap as [lo, hi) ns, rounded inwards; empty (lo >= hi) when there is none. A gap lies
    /// before the timeline's last turn: one that does not (a word written long ago, read back
    /// near now by its modulus) is none.
    fn gap_at(&self, now: u64) -> (u64, u64) {
        let g = self.gap.load(Acquire);
        let now_us = now / 1000;
        let lo_bits = g >> GAP_LEN_BITS;
        let len = g & ((1 << GAP_LEN_BITS) - 1);
        let modulus = 1u64 << (64 - GAP_LEN_BITS);
        let base = now_us & !(modulus - 1);
        let lo = [
            base.wrapping_sub(modulus),
            base,
            base.saturating_add(modulus),
        ]
        .into_iter()
        .map(|b| b | lo_bits)
        .min_by_key(|c| c.abs_diff(now_us))
        .unwrap_or(0);
        let (lo, hi) = (
            lo.saturating_mul(1000),
            lo.saturating_add(len).saturating_mul(1000),
        );
        if hi > believable(self.end.load(Acquire), now) {
            return (0, 0);
        }
        (lo, hi)
    }

    /// A gap packed in one word: its first microsecond modulo 2^40 (12.7 days) and its length
    /// in microseconds, at most 2^24 (16.7 s; a longer gap keeps its first 16.7 s).
    fn pack(lo_ns: u64, hi_ns: u64) -> u64 {
        let lo = lo_ns.div_ceil(1000);
        let len = (hi_ns / 1000)
            .saturating_sub(lo)
            .min((1 << GAP_LEN_BITS) - 1);
        (lo << GAP_LEN_BITS) | len
    }

    /// Where a turn of `busy` ns could start at the earliest, from `from`: in the gap when it
    /// fits there, else after the last turn.
    fn earliest(&self, from: u64, busy: u64, now: u64) -> u64 {
        let (lo, hi) = self.gap_at(now);
        let at = from.max(lo);
        if at.saturating_add(busy) <= hi {
            return at;
        }
        from.max(believable(self.end.load(Acquire), now))
    }

    /// Takes a turn of `busy` ns at exactly `start` if the timeline is free then (in its gap,
    /// or after its last turn); false, taking nothing, if it is not.
    fn try_take(&self, start: u64, busy: u64, now: u64) -> bool {
        let g = self.gap.load(Acquire);
        let (lo, hi) = self.gap_at(now);
        if start >= lo && start.saturating_add(busy) <= hi {
            return self
                .gap
                .compare_exchange(
                    g,
                    Timeline::pack(start.saturating_add(busy), hi),
                    AcqRel,
                    Acquire,
                )
                .is_ok();
        }
        let cur = self.end.load(Acquire);
        let free_from = believable(cur, now);
        if free_from > start {
            return false;
        }
        let ok = self
            .end
            .compare_exchange(cur, start.saturating_add(busy), AcqRel, Acquire)
            .is_ok();
        let idle_from = free_from.max(now);
        if ok && start > idle_from {
            self.gap.store(Timeline::pack(idle_from, start), Release);
        }
        ok
    }

    /// Takes a turn of `busy` ns at `start` or as soon after as it can be had; returns when
    /// it starts. In the gap if it still fits there (the gap then begins after it), otherwise
    /// after the last turn, leaving the idle time before it as the new gap. Lock-free: one CAS
    /// on a packed word claims gap time, so no two turns get the same; a gap recorded while
    /// another is being claimed may drop the older one (time then goes unused, never twice).
    fn take(&self, start: u64, busy: u64, now: u64) -> u64 {
        let g = self.gap.load(Acquire);
        let (lo, hi) = self.gap_at(now);
        if start >= lo
            && start.saturating_add(busy) <= hi
            && self
                .gap
                .compare_exchange(
                    g,
                    Timeline::pack(start.saturating_add(busy), hi),
                    AcqRel,
                    Acquire,
                )
                .is_ok()
        {
            return start;
        }
        let prev = self
            .end
            .fetch_update(AcqRel, Acquire, |x| {
                Some(believable(x, now).max(start).saturating_add(busy))
            })
            .map(|x| believable(x, now))
            .unwrap_or(start);
        let idle_from = prev.max(now);
        if start > idle_from {
            self.gap.store(Timeline::pack(idle_from, start), Release);
        }
        prev.max(start)
    }
}

/// One interconnect resource's timeline.
#[repr(C)]
pub struct LinkShared {
    /// When the copies reserved on it are done with it, and the idle gap before the latest.
    pub time: Timeline,
    /// Bytes every copy ever reserved on it carried.
    pub bytes: AtomicU64,
}

#[repr(C)]
pub struct ProcSlot {
    /// 0 = free, RECLAIMING while a sweeper gives a dead process's memory back.
    pub pid: AtomicU32,
    pub _pad: u32,
    /// Start time of the process (clock ticks since boot, /proc/PID/stat field 22): with the pid it
    /// names one process for good, so a reused pid is not mistaken for the dead one.
    pub start_time: AtomicU64,
    pub mem: [AtomicU64; MAX_DEVICES],
    pub util: [[AtomicU64; PROC_BUCKETS]; MAX_DEVICES],
}

const RECLAIMING: u32 = u32::MAX;

/// Shared-memory entry states.
const SHARED_FREE: u32 = 0;
const SHARED_CLAIMING: u32 = 1;
const SHARED_LIVE: u32 = 2;
const SHARED_RECLAIMING: u32 = 3;

/// Device memory shared between processes: it lives (and counts in `mem_used`) while any live
/// process holds it, whoever allocated it. Holders keep a shared lease lock on byte
/// `MAX_PROCS + index` of the lease range.
#[repr(C)]
pub struct SharedMem {
    pub state: AtomicU32,
    pub dev: AtomicU32,
    pub bytes: AtomicU64,
    /// Bumped at every claim, so that a handle naming an earlier life of the entry is refused.
    pub generation: AtomicU64,
}

/// An event exported by one process (cuIpcGetEventHandle) and opened by others: what a record
/// in any of them captured is what the others query, synchronize on and wait for.
#[repr(C)]
pub struct SharedEvent {
    /// The exporter's process slot + 1; 0 = free. The entry goes with its exporter's event
    /// (cuEventDestroy) or its exporter (exit, or death noticed by `reclaim_dead`).
    pub owner: AtomicU32,
    pub _pad: u32,
    /// Bumped at every claim, so that a handle naming an earlier life of the entry is refused.
    pub generation: AtomicU64,
    /// When the work the last record captured ends (CLOCK_MONOTONIC ns, one clock for every
    /// process); 0 = never recorded, [`EVENT_PENDING`] = not known yet.
    pub time: AtomicU64,
}

#[repr(C)]
pub struct Layout {
    pub header: Header,
    pub devices: [DeviceShared; MAX_DEVICES],
    pub procs: [ProcSlot; MAX_PROCS],
    pub shared: [SharedMem; MAX_SHARED],
    pub events: [SharedEvent; MAX_IPC_EVENTS],
    /// By `Fabric::index` of the model's fabric.
    pub links: [LinkShared; MAX_LINKS],
}

/// The mapped state. Lives for the life of the process once attached.
// SAFETY: atomics and integers only; zero bytes are a file not yet initialised.
unsafe impl mapped::Layout for Layout {
    const MAGIC: u64 = MAGIC;
    const WHAT: &'static str = "simulator state";
    fn magic(&self) -> &AtomicU64 {
        &self.header.magic
    }
}

pub struct Shared {
    layout: &'static Layout,
    pub path: PathBuf,
    map: &'static Mapped<Layout>,
    /// Shared-memory entries whose lease this process holds (its own locks never conflict with
    /// it, so it must know them apart).
    holding: [AtomicU64; MAX_SHARED / 64],
}

/// CLOCK_MONOTONIC in ns: one clock for every process on the machine.
pub fn now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into the timespec we own; CLOCK_MONOTONIC always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Sleeps until CLOCK_MONOTONIC reaches `t_ns`.
pub fn sleep_until(t_ns: u64) {
    loop {
        let now = now_ns();
        if now >= t_ns {
            return;
        }
        std::thread::sleep(std::time::Duration::from_nanos(t_ns - now));
    }
}

/// Start time of a live process (shared with the ledger's definition of "the same process").
pub use cuvisor_shm::process::start_time as process_start_time;

pub fn default_state_path(model: &Model) -> PathBuf {
    // SAFETY: getuid has no preconditions.
    let uid = unsafe { libc::getuid() };
    let dir = if Path::new("/dev/shm").is_dir() {
        PathBuf::from("/dev/shm")
    } else {
        std::env::temp_dir()
    };
    dir.join(format!(
        "cuvisor-sim-{uid}-{:016x}-v{LAYOUT_VERSION}.state",
        model.fingerprint()
    ))
}

/// One copy for [`Shared::reserve`] to time.
pub struct Transfer<'a> {
    pub fabric: &'a cuvisor_fabric::Fabric,
    pub route: &'a cuvisor_fabric::Route,
    pub bytes: u64,
    /// Each hop's rate is its capacity times this (1.0; less for pageable host memory, which
    /// the driver stages through a pinned buffer).
    pub rate: f64,
    /// The device whose copy engine drives the copy, and how many it has; None: no engine
    /// (a memset, done by the device's SMs).
    pub engine: Option<(usize, u32)>,
}

impl Shared {
    /// Maps the state file named by `CUVISOR_SIM_STATE` (or the default for this model),
    /// creating and initialising it if it is new.
    pub fn attach(model: &Model) -> Result<Shared, String> {
        let path = match std::env::var_os("CUVISOR_SIM_STATE") {
            Some(p) if !p.is_empty() => PathBuf::from(p),
            _ => default_state_path(model),
        };
        Self::attach_at(model, &path)
    }

    pub fn attach_at(model: &Model, path: &Path) -> Result<Shared, String> {
        let fingerprint = model.fingerprint();
        let devices = model.devices.len() as u32;
        // Every uid shares the simulated GPU, as every uid opens /dev/nvidia* on a real node.
        let map = mapped::open::<Layout>(
            path,
            mapped::Open {
                create: true,
                mode: 0o666,
            },
            |l| {
                // SAFETY: a new file, the flock held, the magic unset: nobody reads these yet.
                unsafe {
                    (*l).header.version = LAYOUT_VERSION;
                    (*l).header.device_count = devices;
                    (*l).header.fingerprint = fingerprint;
                }
            },
            |l| {
                if l.header.version == LAYOUT_VERSION && l.header.fingerprint == fingerprint {
                    Ok(())
                } else {
                    Err("belongs to another machine model (set CUVISOR_SIM_STATE to a new file, or remove it)".into())
                }
            },
        )?;
        // The state lives as long as the process (the simulated driver never detaches).
        let map: &'static Mapped<Layout> = Box::leak(Box::new(map));
        map.header.attach_count.fetch_add(1, Relaxed);
        Ok(Shared {
            layout: map,
            map,
            path: path.to_path_buf(),
            holding: std::array::from_fn(|_| AtomicU64::new(0)),
        })
    }

    pub fn header(&self) -> &Header {
        &self.layout.header
    }

    pub fn device(&self, d: usize) -> &DeviceShared {
        &self.layout.devices[d]
    }

    pub fn procs(&self) -> &[ProcSlot] {
        &self.layout.procs
    }

    /// Claims a slot for this process. None when all slots are taken by live processes.
    ///
    /// A slot is live while its owner holds its lease (see crates/shm's `lease`): processes in
    /// other pid namespaces (containers) share the simulated GPU as they share a real one, and
    /// their pids mean nothing here. The pid and start time are kept for NVML's process list.
    pub fn claim_slot(&self) -> Option<usize> {
        let pid = std::process::id();
        let start = process_start_time(pid).unwrap_or(1);
        let f = self.map.file();
        for pass in 0..2 {
            for (i, s) in self.layout.procs.iter().enumerate() {
                if s.pid.load(Relaxed) == pid
                    && s.start_time.load(Relaxed) == start
                    && !lease::held(f, i, 1).unwrap_or(true)
                    && lease::try_hold(f, i, false).unwrap_or(false)
                {
                    return Some(i); // already ours (a second attach in one process)
                }
                if s.pid.load(Acquire) != 0 || !lease::try_hold(f, i, false).unwrap_or(false) {
                    continue;
                }
                if s.pid.compare_exchange(0, pid, AcqRel, Relaxed).is_ok() {
                    // A new process has no history: the slot's last owner's busy buckets (its
                    // kernels, some queued ahead of now) are not this one's utilization.
                    for b in s.util.iter().flatten() {
                        b.store(0, Relaxed);
                    }
                    s.start_time.store(start, Release);
                    return Some(i);
                }
                lease::release(f, i);
            }
            if pass == 0 {
                self.reclaim_dead();
            }
        }
        None
    }

    /// Gives a slot back (normal process exit): its memory returns to the devices, and the
    /// shared memory it held is let go.
    pub fn release_slot(&self, i: usize) {
        let s = &self.layout.procs[i];
        self.drain_slot(s);
        s.start_time.store(0, Relaxed);
        s.pid.store(0, Release);
        self.events_let_go(i);
        lease::release(self.map.file(), i);
        for e in 0..MAX_SHARED {
            if self.holds(e) {
                self.note_holding(e, false);
                lease::release(self.map.file(), MAX_PROCS + e);
            }
        }
        self.reclaim_shared();
    }

    fn holds(&self, e: usize) -> bool {
        self.holding[e / 64].load(Acquire) & (1 << (e % 64)) != 0
    }

    fn note_holding(&self, e: usize, on: bool) {
        let bit = 1u64 << (e % 64);
        if on {
            self.holding[e / 64].fetch_or(bit, AcqRel);
        } else {
            self.holding[e / 64].fetch_and(!bit, AcqRel);
        }
    }

    /// Moves `bytes` of device `d` charged to process slot `slot` into a new shared entry,
    /// which this process then holds. Returns (entry, generation); None when all are taken.
    /// The slot lets go before the entry takes the bytes: a process killed in between leaves
    /// the device over-counted, never under.
    pub fn share_open(&self, slot: usize, d: usize, bytes: u64) -> Option<(usize, u64)> {
        let f = self.map.file();
        for (i, e) in self.layout.shared.iter().enumerate() {
            if e.state
                .compare_exchange(SHARED_FREE, SHARED_CLAIMING, AcqRel, Relaxed)
                .is_err()
            {
                continue;
            }
            if !lease::try_hold(f, MAX_PROCS + i, true).unwrap_or(false) {
                let _ = e
                    .state
                    .compare_exchange(SHARED_CLAIMING, SHARED_FREE, AcqRel, Relaxed);
                continue;
            }
            let generation = e.generation.fetch_add(1, AcqRel) + 1;
            e.dev.store(d as u32, Relaxed);
            e.bytes.store(0, Relaxed);
            if e.state
                .compare_exchange(SHARED_CLAIMING, SHARED_LIVE, AcqRel, Relaxed)
                .is_err()
            {
                lease::release(f, MAX_PROCS + i);
                continue;
            }
            self.note_holding(i, true);
            saturating_sub(&self.layout.procs[slot].mem[d], bytes);
            e.bytes.fetch_add(bytes, AcqRel);
            return Some((i, generation));
        }
        None
    }

    /// Makes this process a holder of entry `i` if it is still the shared memory of generation
    /// `generation`; false when that memory is gone.
    pub fn share_hold(&self, i: usize, generation: u64) -> bool {
        let Some(e) = self.layout.shared.get(i) else {
            return false;
        };
        let live =
            || e.state.load(Acquire) == SHARED_LIVE && e.generation.load(Acquire) == generation;
        if self.holds(i) {
            return live();
        }
        if !live() || !lease::try_hold(self.map.file(), MAX_PROCS + i, true).unwrap_or(false) {
            return false;
        }
        if live() {
            self.note_holding(i, true);
            true
        } else {
            lease::release(self.map.file(), MAX_PROCS + i);
            false
        }
    }

    /// This process no longer holds entry `i`; the last holder's letting go frees the memory.
    pub fn share_let_go(&self, i: usize) {
        if i < MAX_SHARED && self.holds(i) {
            self.note_holding(i, false);
            lease::release(self.map.file(), MAX_PROCS + i);
            self.reclaim_shared();
        }
    }

    /// Where the bytes of shared entry `i` of generation `generation` live when its memory is
    /// shared by file (an IPC-exported allocation): beside the state file, removed when the
    /// entry is freed.
    pub fn share_file(&self, i: usize, generation: u64) -> PathBuf {
        let mut p = self.path.clone().into_os_string();
        p.push(format!(".mem-{i}-{generation}"));
        PathBuf::from(p)
    }

    /// Frees the shared memory that no live process holds. Returns how much went.
    pub fn reclaim_shared(&self) -> usize {
        let f = self.map.file();
        let mut n = 0;
        for (i, e) in self.layout.shared.iter().enumerate() {
            let st = e.state.load(Acquire);
            if st == SHARED_FREE
                || st == SHARED_RECLAIMING
                || self.holds(i)
                || lease::held(f, MAX_PROCS + i, 1).unwrap_or(true)
            {
                continue;
            }
            if st == SHARED_CLAIMING {
                let _ = e
                    .state
                    .compare_exchange(SHARED_CLAIMING, SHARED_FREE, AcqRel, Relaxed);
                continue;
            }
            if e.state
                .compare_exchange(SHARED_LIVE, SHARED_RECLAIMING, AcqRel, Relaxed)
                .is_ok()
            {
                let d = (e.dev.load(Acquire) as usize).min(MAX_DEVICES - 1);
                saturating_sub(&self.layout.devices[d].mem_used, e.bytes.swap(0, AcqRel));
                let _ = std::fs::remove_file(self.share_file(i, e.generation.load(Acquire)));
                e.state.store(SHARED_FREE, Release);
                n += 1;
            }
        }
        n
    }

    fn drain_slot(&self, s: &ProcSlot) {
        for (d, m) in s.mem.iter().enumerate() {
            let bytes = m.swap(0, AcqRel);
            if bytes > 0 {
                saturating_sub(&self.layout.devices[d].mem_used, bytes);
            }
        }
    }

    /// Whether slot `i`'s owner lives: someone holds its lease (this process's own slots
    /// included: its own description never conflicts with itself, so those are asked apart).
    fn slot_alive(&self, i: usize) -> bool {
        let s = &self.layout.procs[i];
        let ours = s.pid.load(Acquire) == std::process::id()
            && process_start_time(std::process::id()) == Some(s.start_time.load(Acquire));
        ours || lease::held(self.map.file(), i, 1).unwrap_or(true)
    }

    /// Gives back the memory of every process that has died. Returns how many were reclaimed.
    pub fn reclaim_dead(&self) -> usize {
        let mut n = 0;
        for (i, s) in self.layout.procs.iter().enumerate() {
            let pid = s.pid.load(Acquire);
            if pid == 0 || pid == RECLAIMING || self.slot_alive(i) {
                continue;
            }
            if s.pid
                .compare_exchange(pid, RECLAIMING, AcqRel, Relaxed)
                .is_ok()
            {
                self.drain_slot(s);
                s.start_time.store(0, Relaxed);
                self.events_let_go(i);
                s.pid.store(0, Release);
                n += 1;
            }
        }
        n + self.reclaim_shared()
    }

    /// Claims a shared event for process slot `slot`: (entry, generation), None when all are
    /// taken. Its time starts as "never recorded".
    pub fn event_open(&self, slot: usize) -> Option<(usize, u64)> {
        for (i, e) in self.layout.events.iter().enumerate() {
            if e.owner
                .compare_exchange(0, slot as u32 + 1, AcqRel, Relaxed)
                .is_ok()
            {
                e.time.store(0, Release);
                return Some((i, e.generation.fetch_add(1, AcqRel) + 1));
            }
        }
        None
    }

    /// Shared event `i` if `generation` still names its current life.
    pub fn event(&self, i: usize, generation: u64) -> Option<&SharedEvent> {
        let e = self.layout.events.get(i)?;
        (e.owner.load(Acquire) != 0 && e.generation.load(Acquire) == generation).then_some(e)
    }

    /// Frees shared event `i` (its exporter destroyed it).
    pub fn event_close(&self, i: usize, generation: u64) {
        if let Some(e) = self.event(i, generation) {
            e.owner.store(0, Release);
        }
    }

    /// Frees the shared events exported by process slot `slot` (the process is gone).
    fn events_let_go(&self, slot: usize) {
        for e in &self.layout.events {
            let _ = e
                .owner
                .compare_exchange(slot as u32 + 1, 0, AcqRel, Relaxed);
        }
    }

    /// Live processes with their slots.
    pub fn live_procs(&self) -> impl Iterator<Item = (u32, &ProcSlot)> {
        self.layout.procs.iter().filter_map(|s| {
            let pid = s.pid.load(Acquire);
            (pid != 0 && pid != RECLAIMING).then_some((pid, s))
        })
    }

    /// Charges `bytes` of device `d` to process slot `slot`, if the device has room.
    pub fn charge(&self, slot: usize, d: usize, bytes: u64, capacity: u64) -> bool {
        if self.injected_failure(d) {
            return false;
        }
        self.charge_memory(slot, d, bytes, capacity)
    }

    /// As [`Shared::charge`], for memory that is no allocation (a context's own): injected
    /// allocation failures ("the next N allocations fail") do not apply to it.
    pub fn charge_memory(&self, slot: usize, d: usize, bytes: u64, capacity: u64) -> bool {
        let mine = &self.layout.procs[slot].mem[d];
        mine.fetch_add(bytes, AcqRel);
        let ok = self.take_device_memory(d, bytes, capacity);
        if !ok {
            mine.fetch_sub(bytes, AcqRel);
        }
        ok
    }

    /// Device `d`'s next allocation fails by fault injection ("the next N allocations fail"):
    /// consumes one of them.
    fn injected_failure(&self, d: usize) -> bool {
        let dev = &self.layout.devices[d];
        dev.fail_allocs.load(Relaxed) > 0
            && dev
                .fail_allocs
                .fetch_update(AcqRel, Relaxed, |n| n.checked_sub(1))
                .is_ok()
    }

    /// Adds `bytes` to device `d`'s memory in use if it stays within `capacity`.
    fn take_device_memory(&self, d: usize, bytes: u64, capacity: u64) -> bool {
        self.layout.devices[d]
            .mem_used
            .fetch_update(AcqRel, Acquire, |used| {
                used.checked_add(bytes).filter(|&u| u <= capacity)
            })
            .is_ok()
    }

    /// Charges `bytes` more to shared entry `i`, which this process holds, if its device has
    /// room (a pool shared between processes growing): the entry, not a process, carries it.
    pub fn share_charge(&self, i: usize, bytes: u64, capacity: u64) -> bool {
        let Some(e) = self.layout.shared.get(i).filter(|_| self.holds(i)) else {
            return false;
        };
        let d = (e.dev.load(Acquire) as usize).min(MAX_DEVICES - 1);
        if self.injected_failure(d) {
            return false;
        }
        let ok = self.take_device_memory(d, bytes, capacity);
        if ok {
            e.bytes.fetch_add(bytes, AcqRel);
        }
        ok
    }

    /// Gives `bytes` of shared entry `i` (held by this process) back to its device.
    pub fn share_uncharge(&self, i: usize, bytes: u64) {
        if let Some(e) = self.layout.shared.get(i).filter(|_| self.holds(i)) {
            let d = (e.dev.load(Acquire) as usize).min(MAX_DEVICES - 1);
            saturating_sub(&e.bytes, bytes);
            saturating_sub(&self.layout.devices[d].mem_used, bytes);
        }
    }

    pub fn uncharge(&self, slot: usize, d: usize, bytes: u64) {
        saturating_sub(&self.layout.procs[slot].mem[d], bytes);
        saturating_sub(&self.layout.devices[d].mem_used, bytes);
    }

    /// Queues `dur` ns of kernel time on device `d`'s timeline, no earlier than `not_before`.
    /// Returns (start, end). Kernels of all processes run one after another.
    pub fn run_kernel(&self, slot: usize, d: usize, not_before: u64, dur: u64) -> (u64, u64) {
        let dev = &self.layout.devices[d];
        let now = now_ns();
        let mut cur = dev.timeline_end.load(Acquire);
        let (start, end) = loop {
            let start = believable(cur, now)
                .max(now)
                .max(believable(not_before, now));
            let end = start.saturating_add(dur);
            match dev
                .timeline_end
                .compare_exchange_weak(cur, end, AcqRel, Acquire)
            {
                Ok(_) => break (start, end),
                Err(actual) => cur = actual,
            }
        };
        dev.busy_total.fetch_add(dur, Relaxed);
        dev.kernels.fetch_add(1, Relaxed);
        add_busy(&dev.util, start, end);
        add_busy(&self.layout.procs[slot].util[d], start, end);
        (start, end)
    }

    /// Times one copy over the interconnect: reserves its turn on every resource of its route
    /// and on a copy engine of the device that drives it, no earlier than `not_before`.
    /// Returns (start, end) in CLOCK_MONOTONIC ns.
    ///
    /// The model. Every resource (one direction of a link: see `cuvisor_fabric::Resource`) is a
    /// timeline: the time at which the copies reserved on it so far are done with it. A copy
    /// starts when it may (`not_before`: its stream's earlier work), its engine is free and
    /// every one of its hops is free: `start = max(now, not_before, engine, ends of its hops)`.
    /// Each hop r is then busy for the copy's bytes at r's rate:
    /// `end_r = max(end_r, start) + bytes / capacity_r`, so copies that share a link take it in
    /// turns (its bandwidth is shared, and the aggregate throughput is exactly the link's),
    /// while copies on different links overlap. The copy ends at
    /// `max(start + latency + bytes / bottleneck, the new ends of its hops)`.
    ///
    /// Copy engines: a device has `engines` of them (CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT),
    /// each its own timeline, separate from the kernels' (`run_kernel`): a copy takes the one
    /// free first, so copies overlap kernels and at most that many copies of one device run at
    /// once.
    ///
    /// Lock-free, across processes: every timeline is one atomic word moved by
    /// read-modify-write (`fetch_update`, a CAS loop), never a lock that a dying process could
    /// leave behind. Two copies that race for a link both see it as it was and are both put
    /// after what it holds by their own update, in whatever order their updates land; one that
    /// finds its engine taken in between goes after the copy that took it. A hop's update may
    /// thus move a little past `start`, and the copy's end follows it: never earlier than the
    /// model allows, at worst a little later than a global order would have put it.
    ///
    /// Gaps: a copy reserved for later (behind a long kernel) leaves the time before it idle;
    /// each timeline keeps the latest such gap ([`Timeline`]), and a copy that fits in it takes
    /// it there instead of after the later copy, as a real GPU would run a copy that is due
    /// while another waits. Only the latest gap is kept: one left by an earlier reservation is
    /// forgotten when a newer one opens (that time then goes unused).
    pub fn reserve(&self, t: &Transfer<'_>, not_before: u64) -> (u64, u64) {
        use cuvisor_fabric::{specs::transfer_ns, Resource};
        let f = t.fabric;
        let rate = if t.rate > 0.0 { t.rate } else { 1.0 };
        let hops: Vec<(usize, f64, Resource)> = t
            .route
            .hops
            .iter()
            .filter_map(|&r| Some((f.index(r)?, f.capacity(r) * rate, r)))
            .filter(|(i, ..)| *i < MAX_LINKS)
            .collect();
        let bottleneck = hops.iter().map(|h| h.1).fold(f64::INFINITY, f64::min);
        let now = now_ns();
        let from = now.max(believable(not_before, now));
        let lone = t
            .route
            .latency_ns
            .saturating_add(transfer_ns(t.bytes, bottleneck));
        let busy: Vec<u64> = hops.iter().map(|h| transfer_ns(t.bytes, h.1)).collect();
        // The engine that could start it first, then the start every hop allows; again from
        // there until every one of them can take it then (a gap that fits at one start may not
        // at a later one).
        let engines = t.engine.and_then(|(d, n)| {
            let dev = self.layout.devices.get(d)?;
            Some(&dev.engines[..(n as usize).clamp(1, MAX_ENGINES)])
        });
        let mut start = from;
        for _ in 0..4 {
            let before = start;
            if let Some(list) = engines {
                let at = list
                    .iter()
                    .map(|e| e.earliest(start, lone, now))
                    .min()
                    .unwrap_or(start);
                start = start.max(at);
            }
            for ((i, ..), b) in hops.iter().zip(&busy) {
                start = start.max(self.layout.links[*i].time.earliest(start, *b, now));
            }
            if start == before {
                break;
            }
        }
        let mut end = start.saturating_add(lone);
        for ((i, _, r), b) in hops.into_iter().zip(busy) {
            let link = &self.layout.links[i];
            let hop_start = link.time.take(start, b, now);
            let hop_end = hop_start.saturating_add(b);
            end = end.max(hop_end);
            link.bytes.fetch_add(t.bytes, Relaxed);
            let pcie = match r {
                Resource::PcieDown(g) => self.layout.devices.get(g).map(|d| &d.pcie_rx),
                Resource::PcieUp(g) => self.layout.devices.get(g).map(|d| &d.pcie_tx),
                _ => None,
            };
            if let Some(b) = pcie {
                add_spread(b, hop_start, hop_end, t.bytes.div_ceil(1024));
            }
            // The device memory the hop reads or writes (a hop between two GPUs touches both).
            let touched = match r {
                Resource::PcieDown(g)
                | Resource::PcieUp(g)
                | Resource::Memory(g)
                | Resource::SwitchPortOut(g)
                | Resource::SwitchPortIn(g) => [Some(g), None],
                Resource::NvLink(a, b) => [Some(a), Some(b)],
                _ => [None, None],
            };
            for g in touched.into_iter().flatten() {
                if let Some(d) = self.layout.devices.get(g) {
                    add_busy(&d.mem_util, hop_start, hop_end);
                }
            }
        }
        if let Some(list) = engines {
            // An engine free for the whole copy from its start; two copies that planned on the
            // same engine at once get two engines, as the hardware would give them, rather
            // than the second queueing its whole time behind the first. Only when every
            // engine is taken does the copy wait for the one free first.
            let dur = end - start;
            if !list.iter().any(|e| e.try_take(start, dur, now)) {
                if let Some(e) = list.iter().min_by_key(|e| e.earliest(start, dur, now)) {
                    let got = e.take(start, dur, now);
                    end = end.max(got.saturating_add(dur));
                }
            }
        }
        (start, end)
    }

    /// Bytes ever reserved on interconnect resource `i` (its `Fabric::index`).
    pub fn link_bytes(&self, i: usize) -> u64 {
        self.layout
            .links
            .get(i)
            .map_or(0, |l| l.bytes.load(Acquire))
    }

    /// KiB per second device `d`'s PCIe link carried during [now - window, now): host to device
    /// (`rx`) or device to host.
    pub fn pcie_kib_per_s(&self, d: usize, rx: bool, window_ns: u64) -> u64 {
        let dev = &self.layout.devices[d];
        let b = if rx { &dev.pcie_rx } else { &dev.pcie_tx };
        let window = window_ns.clamp(1, (PCIE_BUCKETS as u64 - 1) * BUCKET_NS);
        let now = now_ns();
        let kib = busy_between(b, now.saturating_sub(window), now);
        (kib as u128 * 1_000_000_000 / window as u128) as u64
    }

    /// Percent of [now - window, now) during which device `d` ran a kernel.
    pub fn device_utilization(&self, d: usize, window_ns: u64) -> u32 {
        busy_percent(&self.layout.devices[d].util, window_ns)
    }

    /// Percent of [now - window, now) during which copies or memsets read or wrote device
    /// `d`'s memory (kernels' own memory traffic is not modelled: they move no bytes here).
    pub fn memory_utilization(&self, d: usize, window_ns: u64) -> u32 {
        busy_percent(&self.layout.devices[d].mem_util, window_ns)
    }

    /// Busy ns of one process on device `d` during [since, now).
    pub fn proc_busy_since(&self, s: &ProcSlot, d: usize, since: u64) -> u64 {
        busy_between(&s.util[d], since, now_ns())
    }

    /// Busy ns of the live process `pid` on device `d` during [since, now); 0 if it is not
    /// listed (not started yet, or gone).
    pub fn pid_busy_since(&self, pid: u32, d: usize, since: u64) -> u64 {
        self.live_procs()
            .find(|(p, _)| *p == pid)
            .map_or(0, |(_, s)| self.proc_busy_since(s, d, since))
    }

    /// Records an XID event on device `d` (fault injection).
    pub fn raise_xid(&self, d: usize, xid: u64) -> u64 {
        let dev = &self.layout.devices[d];
        let seq = dev.xid_seq.fetch_add(1, AcqRel) + 1;
        let slot = &dev.xids[(seq as usize) % XID_RING];
        slot.seq.store(0, Release);
        slot.xid.store(xid, Relaxed);
        slot.time_ns.store(now_ns(), Relaxed);
        slot.seq.store(seq, Release);
        seq
    }

    /// XID events on device `d` with sequence number > `after`, oldest first.
    pub fn xids_after(&self, d: usize, after: u64) -> Vec<(u64, u64, u64)> {
        let dev = &self.layout.devices[d];
        let last = dev.xid_seq.load(Acquire);
        let first = after.max(last.saturating_sub(XID_RING as u64 - 1)) + 1;
        (first..=last)
            .filter_map(|seq| {
                let s = &dev.xids[(seq as usize) % XID_RING];
                let xid = s.xid.load(Relaxed);
                let t = s.time_ns.load(Relaxed);
                (s.seq.load(Acquire) == seq).then_some((seq, xid, t))
            })
            .collect()
    }
}

fn saturating_sub(a: &AtomicU64, v: u64) {
    let _ = a.fetch_update(AcqRel, Relaxed, |x| Some(x.saturating_sub(v)));
}

/// A timeline word as a copy may believe it: the state file is writable by every process that
/// uses the simulator, so a word more than [`HORIZON_NS`] ahead of now (or a wrapped one) is
/// read as now rather than trusted into an overflow.
fn believable(t: u64, now: u64) -> u64 {
    if t > now.saturating_add(HORIZON_NS) {
        now
    } else {
        t
    }
}

/// The furthest ahead a timeline may honestly reach: an hour of queued work.
pub const HORIZON_NS: u64 = 3_600_000_000_000;

fn add_busy(buckets: &[AtomicU64], start: u64, end: u64) {
    let mut t = start;
    while t < end {
        let b = t / BUCKET_NS;
        let upto = ((b + 1) * BUCKET_NS).min(end);
        let add = upto - t;
        let cell = &buckets[(b as usize) % buckets.len()];
        let _ = cell.fetch_update(AcqRel, Relaxed, |w| {
            let busy = if w >> BUSY_BITS == b {
                w & BUSY_MASK
            } else {
                0
            };
            Some((b << BUSY_BITS) | (busy + add).min(BUSY_MASK))
        });
        t = upto;
    }
}

/// Adds `amount` to the buckets over [start, end), in proportion to the time each covers (all
/// of it to `start`'s bucket for an empty range).
fn add_spread(buckets: &[AtomicU64], start: u64, end: u64, amount: u64) {
    let add = |b: u64, v: u64| {
        let cell = &buckets[(b as usize) % buckets.len()];
        let _ = cell.fetch_update(AcqRel, Relaxed, |w| {
            let old = if w >> BUSY_BITS == b {
                w & BUSY_MASK
            } else {
                0
            };
            Some((b << BUSY_BITS) | (old + v).min(BUSY_MASK))
        });
    };
    if end <= start {
        add(start / BUCKET_NS, amount);
        return;
    }
    let (mut t, mut left) = (start, amount);
    while t < end && left > 0 {
        let b = t / BUCKET_NS;
        let upto = ((b + 1) * BUCKET_NS).min(end);
        let part = if upto == end {
            left
        } else {
            ((amount as u128 * (upto - t) as u128) / (end - start) as u128) as u64
        }
        .min(left);
        add(b, part);
        left -= part;
        t = upto;
    }
}

fn bucket_busy(buckets: &[AtomicU64], b: u64) -> u64 {
    let w = buckets[(b as usize) % buckets.len()].load(Acquire);
    if w >> BUSY_BITS == b {
        w & BUSY_MASK
    } else {
        0
    }
}

/// Busy ns in [from, to), counting partial buckets in proportion.
fn busy_between(buckets: &[AtomicU64], from: u64, to: u64) -> u64 {
    let horizon = to.saturating_sub(buckets.len() as u64 * BUCKET_NS - BUCKET_NS);
    let from = from.max(horizon);
    if from >= to {
        return 0;
    }
    let mut total = 0u128;
    let (b0, b1) = (from / BUCKET_NS, (to - 1) / BUCKET_NS);
    for b in b0..=b1 {
        let lo = (b * BUCKET_NS).max(from);
        let hi = ((b + 1) * BUCKET_NS).min(to);
        total += bucket_busy(buckets, b) as u128 * (hi - lo) as u128 / BUCKET_NS as u128;
    }
    total as u64
}

fn busy_percent(buckets: &[AtomicU64], window: u64) -> u32 {
    let now = now_ns();
    let window = window.clamp(BUCKET_NS, (buckets.len() as u64 - 1) * BUCKET_NS);
    let busy = busy_between(buckets, now - window, now);
    ((busy * 100 + window / 2) / window).min(100) as u32
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::preset;

    fn temp_state(tag: &str) -> (Model, Shared) {
        let m = preset("dgx1-v100").unwrap();
        let p =
            std::env::temp_dir().join(format!("cuvisor-state-test-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_file(&p);
        let s = Shared::attach_at(&m, &p).unwrap();
        (m, s)
    }

    #[test]
    fn charge_respects_capacity_and_release_returns_it() {
        let (m, s) = temp_state("charge");
        let slot = s.claim_slot().unwrap();
        let cap = m.devices[0].memory;
        assert!(s.charge(slot, 0, cap - 10, cap));
        assert!(!s.charge(slot, 0, 11, cap));
        assert!(s.charge(slot, 0, 10, cap));
        assert_eq!(s.device(0).mem_used.load(Relaxed), cap);
        s.release_slot(slot);
        assert_eq!(s.device(0).mem_used.load(Relaxed), 0);
        let _ = std::fs::remove_file(&s.path);
    }

    #[test]
    fn injected_allocation_failures_are_counted_down() {
        let (_m, s) = temp_state("fail");
        let slot = s.claim_slot().unwrap();
        s.device(1).fail_allocs.store(2, Relaxed);
        assert!(!s.charge(slot, 1, 1, 100));
        assert!(!s.charge(slot, 1, 1, 100));
        assert!(s.charge(slot, 1, 1, 100));
        s.release_slot(slot);
        let _ = std::fs::remove_file(&s.path);
    }

    #[test]
    fn a_dead_process_slot_is_reclaimed_whatever_its_pid_says() {
        let (m, s) = temp_state("dead");
        // A slot written for a live pid (ours) whose lease nobody holds: a process of another
        // pid namespace that died, as far as anyone can tell.
        let slot = &s.procs()[7];
        slot.pid.store(std::process::id(), Relaxed);
        slot.start_time.store(12345, Relaxed);
        slot.mem[2].store(1000, Relaxed);
        s.device(2).mem_used.store(1000, Relaxed);
        assert_eq!(s.reclaim_dead(), 1);
        assert_eq!(s.device(2).mem_used.load(Relaxed), 0);
        assert_eq!(slot.pid.load(Relaxed), 0);
        // A claimed slot is leased: another attachment (another description) leaves it alone.
        let mine = s.claim_slot().unwrap();
        s.procs()[mine].pid.store(999_999, Relaxed); // a pid of another namespace
        let other = Shared::attach_at(&m, &s.path).unwrap();
        assert_eq!(other.reclaim_dead(), 0);
        let _ = std::fs::remove_file(&s.path);
    }

    /// A reused process slot once kept its dead owner's busy history, so for about 5 s a new
    /// process showed the old one's utilization in NVML.
    #[test]
    fn a_reused_process_slot_starts_with_no_utilization() {
        let (_m, s) = temp_state("reuse-util");
        let slot = s.claim_slot().unwrap();
        s.run_kernel(slot, 1, 0, 50_000_000); // 50 ms, most of it queued ahead of now
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert!(s.proc_busy_since(&s.procs()[slot], 1, 0) > 0);
        let pid = s.procs()[slot].pid.load(Relaxed);
        // By pid as by slot (the kernel still runs, so the later reading is no smaller).
        let by_pid = s.pid_busy_since(pid, 1, 0);
        let by_slot = s.proc_busy_since(&s.procs()[slot], 1, 0);
        assert!(
            0 < by_pid && by_pid <= by_slot,
            "{by_pid} by pid, {by_slot} by slot"
        );
        s.release_slot(slot);
        assert_eq!(s.pid_busy_since(pid, 1, 0), 0, "a pid no longer listed");
        let again = s.claim_slot().unwrap();
        assert_eq!(again, slot, "the first free slot again");
        assert_eq!(s.proc_busy_since(&s.procs()[again], 1, 0), 0);
        s.release_slot(again);
        let _ = std::fs::remove_file(&s.path);
    }

    #[test]
    fn kernels_serialise_on_the_timeline() {
        let (_m, s) = temp_state("timeline");
        let slot = s.claim_slot().unwrap();
        let (a0, a1) = s.run_kernel(slot, 0, 0, 1_000_000);
        let (b0, b1) = s.run_kernel(slot, 0, 0, 2_000_000);
        assert_eq!(a1 - a0, 1_000_000);
        assert_eq!(b0, a1, "second kernel starts when the first ends");
        assert_eq!(b1 - b0, 2_000_000);
        s.release_slot(slot);
        let _ = std::fs::remove_file(&s.path);
    }

    fn h2d(f: &cuvisor_fabric::Fabric, g: usize) -> cuvisor_fabric::Route {
        use cuvisor_fabric::End;
        f.route(End::Host, End::Gpu(g), false)
    }

    /// Two copies issued together over one PCIe link take it in turns: the second ends one
    /// copy's time after the first (the link's bandwidth is shared, its total throughput exact).
    #[test]
    fn copies_sharing_a_link_take_turns() {
        let (m, s) = temp_state("link-shared");
        let f = m.fabric();
        let r = h2d(&f, 0);
        let bytes = 15_750_000; // about 1 ms at PCIe Gen3 x16
        let one = cuvisor_fabric::specs::transfer_ns(bytes, f.capacity(r.hops[0]));
        assert!((999_000..1_001_000).contains(&one), "{one}");
        let t = Transfer {
            fabric: &f,
            route: &r,
            bytes,
            rate: 1.0,
            engine: Some((0, 6)),
        };
        let t0 = now_ns() + 200_000_000; // ahead of now, however slow this machine
        let (a0, a1) = s.reserve(&t, t0);
        let (b0, b1) = s.reserve(&t, t0);
        assert_eq!(a0, t0);
        assert_eq!(a1 - a0, r.latency_ns + one);
        assert_eq!(
            b0,
            a0 + one,
            "the second starts when the first is off the link"
        );
        assert_eq!(b1 - a0, r.latency_ns + 2 * one);
        let i = f.index(r.hops[0]).unwrap();
        assert_eq!(s.link_bytes(i), 2 * bytes);
        let _ = std::fs::remove_file(&s.path);
    }

    /// Copies over two different links overlap; copies of one device are limited to its copy
    /// engines (one engine here: the second waits for it even on another link).
    #[test]
    fn copies_on_two_links_overlap_and_engines_bound_them() {
        let (m, s) = temp_state("link-two");
        let f = m.fabric();
        let (r0, r1) = (h2d(&f, 0), h2d(&f, 1));
        let bytes = 15_750_000;
        let t0 = now_ns() + 200_000_000; // ahead of now, however slow this machine
        let on = |r, d| Transfer {
            fabric: &f,
            route: r,
            bytes,
            rate: 1.0,
            engine: Some((d, 1)),
        };
        let (a0, a1) = s.reserve(&on(&r0, 0), t0);
        let (b0, b1) = s.reserve(&on(&r1, 1), t0);
        assert_eq!((a0, a1), (b0, b1), "two devices, two links: side by side");
        // Device 0's one engine is busy until a1: a copy to the host (another link) waits.
        let up = f.route(
            cuvisor_fabric::End::Gpu(0),
            cuvisor_fabric::End::Host,
            false,
        );
        let (c0, _) = s.reserve(&on(&up, 0), t0);
        assert_eq!(c0, a1);
        let _ = std::fs::remove_file(&s.path);
    }

    /// A copy due now on a link that another copy holds from 100 ms on goes now, in the idle
    /// time before it; one that would not fit before it goes after it; the gap shrinks by
    /// what was taken.
    #[test]
    fn a_copy_due_now_fills_the_idle_time_before_a_copy_reserved_for_later() {
        let (m, s) = temp_state("link-gap");
        let f = m.fabric();
        let r = h2d(&f, 1);
        let t = |bytes| Transfer {
            fabric: &f,
            route: &r,
            bytes,
            rate: 1.0,
            engine: None,
        };
        let later = now_ns() + 100_000_000;
        let (a0, a1) = s.reserve(&t(15_750_000), later); // ~1 ms, 100 ms from now
        assert!(a0 >= later);
        let (b0, b1) = s.reserve(&t(15_750_000), 0);
        assert!(b1 < a0, "it fits before: {b0}..{b1} vs {a0}");
        assert!(b0 < now_ns() + 5_000_000, "and goes now");
        // ~150 ms of bytes do not fit in the ~99 ms left before it: after it.
        let (c0, _) = s.reserve(&t(2_362_500_000), 0);
        assert!(c0 >= a1 - r.latency_ns, "{c0} vs {a1}");
        // What is left of the gap is still there for a small copy.
        let (d0, d1) = s.reserve(&t(15_750_000), 0);
        // (The link is free again once the first copy's bytes have passed: its end less its
        // start-up latency; gaps are kept to the microsecond.)
        assert!(
            d0 + 1000 >= b1 - r.latency_ns && d1 < a0,
            "{d0}..{d1}, first {b0}..{b1}, later {a0}"
        );
        let _ = std::fs::remove_file(&s.path);
    }

    /// A gap packs into one word and reads back to the microsecond; a gap that does not lie
    /// before the timeline's last turn (a stale word) is none; a gap longer than 16.7 s keeps
    /// its first 16.7 s.
    #[test]
    fn a_timeline_gap_reads_back_and_a_stale_one_is_none() {
        let t = Timeline {
            end: AtomicU64::new(0),
            gap: AtomicU64::new(0),
        };
        let now = now_ns();
        t.end.store(now + 1_000_000_000, Release);
        t.gap
            .store(Timeline::pack(now + 10_000_000, now + 20_000_000), Release);
        let (lo, hi) = t.gap_at(now);
        assert!(lo >= now + 10_000_000 && lo < now + 10_001_000, "{lo}");
        assert!(hi <= now + 20_000_000 && hi > now + 19_999_000, "{hi}");
        t.end.store(now + 15_000_000, Release);
        assert_eq!(t.gap_at(now), (0, 0), "past the last turn: none");
        t.end.store(now + 60_000_000_000, Release);
        t.gap
            .store(Timeline::pack(now, now + 40_000_000_000), Release);
        let (lo, hi) = t.gap_at(now);
        assert!(hi - lo <= (1 << GAP_LEN_BITS) * 1000, "{}", hi - lo);
    }

    /// Pageable host memory (rate 0.5) holds the link twice as long as pinned.
    #[test]
    fn a_slower_rate_holds_the_link_longer() {
        let (m, s) = temp_state("link-rate");
        let f = m.fabric();
        let r = h2d(&f, 2);
        let bytes = 15_750_000;
        let one = cuvisor_fabric::specs::transfer_ns(bytes, f.capacity(r.hops[0]));
        let half = cuvisor_fabric::specs::transfer_ns(bytes, f.capacity(r.hops[0]) * 0.5);
        let t0 = now_ns() + 200_000_000;
        let t = Transfer {
            fabric: &f,
            route: &r,
            bytes,
            rate: 0.5,
            engine: None,
        };
        let (a0, a1) = s.reserve(&t, t0);
        assert_eq!(a1 - a0, r.latency_ns + half);
        assert!(
            half >= 2 * one - 1 && half <= 2 * one + 1,
            "{half} vs {one}"
        );
        let (b0, _) = s.reserve(&Transfer { rate: 1.0, ..t }, t0);
        assert_eq!(
            b0,
            a0 + half,
            "the link was held for the slower copy's whole time"
        );
        let _ = std::fs::remove_file(&s.path);
    }

    /// Review finding (issue 18): a multi-GPU job issues a whole all-reduce at once (every
    /// step's copies chained by cuStreamWaitEvent), so its later steps' copies are reserved on
    /// its device's copy engines for later; another tenant's copy on that device that is due
    /// now (a D2H on another link, with every engine idle now) must not wait for them, as it
    /// does not on a real GPU. Fails: one word per engine cannot fill the gap before a
    /// reservation. Ignored until the timelines can (run with --ignored to see it fail).
    #[test]
    fn a_copy_due_now_is_not_held_behind_another_tenants_copies_reserved_for_later() {
        let (m, s) = temp_state("engine-gap");
        let f = m.fabric();
        let engines = m.devices[0].specs.async_engines;
        let bytes = 15_750_000; // about 1 ms at PCIe Gen3 x16
        let t0 = now_ns() + 200_000_000;
        // Tenant A: one copy per engine, due 100 ms from t0 (steps of its all-reduce),
        // each on a different link (peer copies 0 -> b over NVLink).
        for b in [1usize, 2, 3, 4, 1, 2].iter().take(engines as usize) {
            let r = f.route(
                cuvisor_fabric::End::Gpu(0),
                cuvisor_fabric::End::Gpu(*b),
                true,
            );
            let t = Transfer {
                fabric: &f,
                route: &r,
                bytes,
                rate: 1.0,
                engine: Some((0, engines)),
            };
            s.reserve(&t, t0 + 100_000_000);
        }
        // Tenant B: a device-to-host copy on GPU 0, due at t0; its link (PCIe up) is idle.
        let up = f.route(
            cuvisor_fabric::End::Gpu(0),
            cuvisor_fabric::End::Host,
            false,
        );
        let t = Transfer {
            fabric: &f,
            route: &up,
            bytes,
            rate: 1.0,
            engine: Some((0, engines)),
        };
        let (start, _) = s.reserve(&t, t0);
        assert!(
            start < t0 + 10_000_000,
            "B's copy starts {} ms after it was due, behind A's later copies",
            (start - t0) / 1_000_000
        );
        let _ = std::fs::remove_file(&s.path);
    }

    /// Review finding: a timeline word in the world-writable state file (any tenant uid may
    /// map it) near u64::MAX makes every later copy over that link overflow `start + ...`:
    /// a panic inside the simulated driver's FFI entry point in a debug build, a wrapped end
    /// (copy "done" before it started) in release. `run_kernel` has the same shape.
    #[test]
    fn a_link_timeline_written_near_u64_max_does_not_overflow_a_copy() {
        let (m, s) = temp_state("link-overflow");
        let f = m.fabric();
        let r = h2d(&f, 0);
        let i = f.index(r.hops[0]).unwrap();
        s.layout.links[i].time.end.store(u64::MAX - 1000, Release);
        let t = Transfer {
            fabric: &f,
            route: &r,
            bytes: 1 << 20,
            rate: 1.0,
            engine: None,
        };
        let (a, b) = s.reserve(&t, 0);
        assert!(b >= a, "ends ({b}) before it starts ({a})");
        let _ = std::fs::remove_file(&s.path);
    }

    #[test]
    fn pcie_traffic_is_spread_over_its_buckets() {
        let buckets: Vec<AtomicU64> = (0..16).map(|_| AtomicU64::new(0)).collect();
        let base = 2_000 * BUCKET_NS;
        add_spread(&buckets, base + 5_000_000, base + 25_000_000, 4000);
        assert_eq!(bucket_busy(&buckets, 2000), 1000);
        assert_eq!(bucket_busy(&buckets, 2001), 2000);
        assert_eq!(bucket_busy(&buckets, 2002), 1000);
    }

    #[test]
    fn busy_buckets_sum_exactly() {
        let buckets: Vec<AtomicU64> = (0..16).map(|_| AtomicU64::new(0)).collect();
        let base = 1_000 * BUCKET_NS;
        add_busy(&buckets, base + 5_000_000, base + 25_000_000); // 5 ms, 10 ms, 5 ms
        assert_eq!(bucket_busy(&buckets, 1000), 5_000_000);
        assert_eq!(bucket_busy(&buckets, 1001), 10_000_000);
        assert_eq!(bucket_busy(&buckets, 1002), 5_000_000);
        assert_eq!(
            busy_between(&buckets, base, base + 3 * BUCKET_NS),
            20_000_000
        );
        // One lap later the same cells read as empty.
        assert_eq!(bucket_busy(&buckets, 1016), 0);
    }

    #[test]
    fn xid_ring_keeps_the_latest() {
        let (_m, s) = temp_state("xid");
        for i in 0..40 {
            s.raise_xid(3, 79 + i);
        }
        let ev = s.xids_after(3, 0);
        assert_eq!(ev.len(), XID_RING - 1);
        assert_eq!(ev.last().unwrap().1, 79 + 39);
        assert!(s.xids_after(3, 40).is_empty());
        let _ = std::fs::remove_file(&s.path);
    }

    #[test]
    fn another_model_is_refused() {
        let (_m, s) = temp_state("model");
        let other = preset("single").unwrap();
        assert!(Shared::attach_at(&other, &s.path)
            .err()
            .unwrap()
            .contains("another machine model"));
        let _ = std::fs::remove_file(&s.path);
    }
}
