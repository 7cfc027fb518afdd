//! The container ledger: one file per container (`<state dir>/ledger`), mapped by every CUDA
//! process of the container, the device plugin and the CLI.
//!
//! Per device (keyed by GPU UUID): the limit, the bytes in use, the peak, the number of refused
//! allocations, and the compute metrics (GPU time used, time throttled, launches). Per process: a slot (pid + start time) with the bytes it holds on each device, so
//! that when a process dies (SIGKILL included) whoever looks next gives its charges back.
//!
//! Concurrency: charging is one compare-and-swap loop on the device's `used` (never above the
//! limit), then an add on the process slot; nothing blocks, so no dead process can hold anything
//! up. The only lock is `flock` on the file while it is first initialised, which the kernel
//! drops if its holder dies.
//!
//! Shared memory (exported VMM handles, legacy IPC exports) outlives the process that
//! allocated it when another process holds it. Its charge then moves from the allocating
//! process's slot to a *share* entry of the container, which no process owns: each process of
//! the container that holds the memory holds a shared lease lock on the share's byte, and the
//! charge goes back once nobody holds one (every holder let go, or died). See
//! `src/quota/shared.rs` of the library for who holds what, and when.
//!
//! The layout is mirrored in `include/cuvisor.h`; bump [`VERSION`] on any change.

use crate::mapped::{self, Access, Flock, Mapped};
use crate::{lease, process};
use std::path::Path;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering::*};

/// "CUVLEDG1"
pub const MAGIC: u64 = 0x3147_4445_4c56_5543;
pub const VERSION: u32 = 4;
pub const MAX_DEVICES: usize = 16;
pub const MAX_PROCS: usize = 1024;
/// Share entries (memory that outlives its allocating process while another holds it).
pub const MAX_SHARES: usize = 4096;
pub const FILE_NAME: &str = "ledger";

/// Device entry states.
pub const DEV_EMPTY: u32 = 0;
pub const DEV_CLAIMING: u32 = 1;
pub const DEV_READY: u32 = 2;

/// A process slot whose owner died and whose charges are being given back.
pub const PID_RECLAIMING: u32 = u32::MAX;

/// Share entry states.
pub const SHARE_FREE: u32 = 0;
/// Being claimed: its claimer takes its lease, then makes it LIVE.
pub const SHARE_CLAIMING: u32 = 1;
pub const SHARE_LIVE: u32 = 2;
/// Nobody held it: its charge is being given back.
pub const SHARE_RECLAIMING: u32 = 3;
/// A share key that any import in the container matches (the memory was exported under more
/// than one key: erring toward counting, any import may be it).
pub const SHARE_ANY_KEY: u64 = u64::MAX;

/// `DeviceEntry::used` and `ProcEntry::charged` keep bytes in their low 48 bits (256 TiB); the
/// high 16 bits count changes (`used`) or operations in flight (`charged`).
pub const BYTES_MASK: u64 = (1 << 48) - 1;
/// One in the high 16 bits.
const TOP_ONE: u64 = 1 << 48;

#[repr(C)]
pub struct Header {
    pub magic: AtomicU64,
    pub version: u32,
    /// sizeof(Layout), so a reader can refuse a file of another shape.
    pub size: u32,
    pub max_devices: u32,
    pub max_procs: u32,
    /// A random id naming the container on every GPU coordinator (see `coordinator`).
    pub container_id: u64,
}

#[repr(C)]
pub struct DeviceEntry {
    /// DEV_EMPTY, DEV_CLAIMING (uuid being written), DEV_READY.
    pub state: AtomicU32,
    pub _pad: u32,
    /// The GPU's UUID, 16 bytes as two big-endian words (see [`DeviceEntry::uuid`]).
    pub uuid_words: [AtomicU64; 2],
    /// Bytes this container may hold on the device.
    pub limit: AtomicU64,
    /// Bytes it holds now (all its processes) in the low 48 bits ([`BYTES_MASK`]); the high 16
    /// bits count changes, so a repair can tell that nothing moved while it summed the slots.
    pub used: AtomicU64,
    pub peak: AtomicU64,
    /// Allocations refused for the quota.
    pub denied: AtomicU64,
    /// GPU time the container's launches used (ns; estimates corrected by measurement).
    pub gpu_ns: AtomicU64,
    /// Time its launching threads slept, held back by the compute share (ns, all threads).
    pub throttled_ns: AtomicU64,
    /// Work submissions counted (kernel, cooperative and graph launches).
    pub launches: AtomicU64,
}

impl DeviceEntry {
    pub fn uuid(&self) -> [u8; 16] {
        let mut b = [0u8; 16];
        b[..8].copy_from_slice(&self.uuid_words[0].load(Acquire).to_be_bytes());
        b[8..].copy_from_slice(&self.uuid_words[1].load(Acquire).to_be_bytes());
        b
    }
    fn set_uuid(&self, u: [u8; 16]) {
        let (hi, lo) = u.split_at(8);
        self.uuid_words[0].store(
            u64::from_be_bytes(hi.try_into().unwrap_or_default()),
            Release,
        );
        self.uuid_words[1].store(
            u64::from_be_bytes(lo.try_into().unwrap_or_default()),
            Release,
        );
    }
    /// Bytes in use (all the container's processes).
    pub fn used_bytes(&self) -> u64 {
        self.used.load(Acquire) & BYTES_MASK
    }
}

#[repr(C)]
pub struct ProcEntry {
    /// 0 = free, PID_RECLAIMING while its charges are given back; else the owner's pid as its
    /// own pid namespace numbers it (for people: liveness is the slot's lock, see `lease`).
    pub pid: AtomicU32,
    pub _pad: u32,
    /// /proc/PID/stat start time of the owner (for people).
    pub start_time: AtomicU64,
    /// The owner's pid namespace (inode of /proc/self/ns/pid; for people).
    pub pid_ns: AtomicU64,
    /// Per device entry: bytes held in the low 48 bits, operations in flight in the high 16.
    pub charged: [AtomicU64; MAX_DEVICES],
}

impl ProcEntry {
    /// Bytes this process holds on device entry `d`.
    pub fn charged_bytes(&self, d: usize) -> u64 {
        self.charged[d].load(Acquire) & BYTES_MASK
    }
}

/// Memory of the container that outlives the process that allocated it while others hold it
/// (an exported VMM allocation, an IPC-exported pointer). Held by whoever holds the shared
/// lease lock on byte [`lease::BASE`] + [`MAX_PROCS`] + its index.
#[repr(C)]
pub struct ShareEntry {
    /// SHARE_FREE, SHARE_CLAIMING, SHARE_LIVE, SHARE_RECLAIMING.
    pub state: AtomicU32,
    /// The device entry charged.
    pub device: AtomicU32,
    /// What an importer recognises the memory by (see the library's `quota::shared`); 0: none
    /// yet, [`SHARE_ANY_KEY`]: every import.
    pub key: AtomicU64,
    /// Bytes charged, in the low 48 bits; the high 16 count operations in flight (as a
    /// process slot's `charged`).
    pub bytes: AtomicU64,
    pub _reserved: u64,
}

#[repr(C)]
pub struct Layout {
    pub header: Header,
    pub devices: [DeviceEntry; MAX_DEVICES],
    pub procs: [ProcEntry; MAX_PROCS],
    pub shares: [ShareEntry; MAX_SHARES],
}

// SAFETY: atomics and integers only; zero bytes are a file not yet initialised.
unsafe impl mapped::Layout for Layout {
    const MAGIC: u64 = MAGIC;
    const WHAT: &'static str = "ledger";
    fn magic(&self) -> &AtomicU64 {
        &self.header.magic
    }
}

/// A refused charge: what was asked, what is in use, what the limit is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Denied {
    pub requested: u64,
    pub used: u64,
    pub limit: u64,
}

/// A mapped ledger, for the processes of its own container (and the CLI that made it). The
/// node daemon reads ledgers through [`Snapshot`] instead: a container can truncate its file.
pub struct Ledger {
    map: Mapped<Layout>,
    /// The slot this open file description holds the lease of (usize::MAX: none).
    own: AtomicUsize,
    /// The file's flock belongs to the open file description, which every thread of the
    /// process shares: it excludes other processes only. These exclude this process's other
    /// threads from reclaiming, and from claiming a device entry, at the same time.
    reclaiming: std::sync::Mutex<()>,
    claiming: std::sync::Mutex<()>,
    /// Share entries whose lease lock this open file description holds (one bit each): our own
    /// locks never conflict with us, so a reclaimer must know them apart.
    holding: [AtomicU64; MAX_SHARES / 64],
}

fn check(l: &Layout) -> Result<(), String> {
    let h = &l.header;
    if h.version != VERSION {
        return Err(format!(
            "version {} (this cuvisor speaks {VERSION})",
            h.version
        ));
    }
    if h.size as usize != std::mem::size_of::<Layout>()
        || h.max_devices as usize != MAX_DEVICES
        || h.max_procs as usize != MAX_PROCS
    {
        return Err("not a cuvisor ledger of this shape".into());
    }
    Ok(())
}

impl Ledger {
    /// Opens (creating and initialising if needed) `<dir>/ledger` as the device plugin's
    /// containers share it ([`Access::Shared`]: a file every uid of the container may write).
    pub fn open_dir(dir: &Path) -> Result<Ledger, String> {
        Self::open_dir_as(dir, Access::Shared)
    }

    /// Opens (creating and initialising if needed) `<dir>/ledger` with `access` (see
    /// [`Access`]): [`Access::Private`] where the environment alone configures cuvisor. The
    /// directory is made if missing and never reached through a symbolic link.
    pub fn open_dir_as(dir: &Path, access: Access) -> Result<Ledger, String> {
        let d = mapped::open_dir(dir, access, true).map_err(|e| format!("ledger directory {e}"))?;
        let path = dir.join(FILE_NAME);
        let file = mapped::open_in(&d, FILE_NAME, access, true)
            .map_err(|e| format!("ledger {}: open: {e}", path.display()))?;
        Self::from_file(file, &path, true, access.file_mode())
    }

    /// Opens an existing ledger file; `create`: make it if missing.
    pub fn open(path: &Path, create: bool) -> Result<Ledger, String> {
        let file = mapped::open_regular(path, true, create.then_some(0o666))
            .map_err(|e| format!("ledger {}: open: {e}", path.display()))?;
        Self::from_file(file, path, create, 0o666)
    }

    fn from_file(
        file: std::fs::File,
        path: &Path,
        create: bool,
        mode: u32,
    ) -> Result<Ledger, String> {
        let map = mapped::open_file::<Layout>(
            file,
            path,
            mapped::Open { create, mode },
            |l| {
                // SAFETY: `open` hands a new file over with the flock held and the magic unset:
                // no other process trusts these fields yet.
                unsafe {
                    (*l).header.version = VERSION;
                    (*l).header.size = std::mem::size_of::<Layout>() as u32;
                    (*l).header.max_devices = MAX_DEVICES as u32;
                    (*l).header.max_procs = MAX_PROCS as u32;
                    (*l).header.container_id = random_id();
                }
            },
            check,
        )?;
        Ok(Ledger {
            map,
            own: AtomicUsize::new(usize::MAX),
            reclaiming: std::sync::Mutex::new(()),
            claiming: std::sync::Mutex::new(()),
            holding: std::array::from_fn(|_| AtomicU64::new(0)),
        })
    }

    pub fn path(&self) -> &Path {
        self.map.path()
    }

    /// The container's id (random, made with the file; never 0).
    pub fn container_id(&self) -> u64 {
        self.layout().header.container_id
    }

    fn layout(&self) -> &Layout {
        &self.map
    }

    pub fn device(&self, d: usize) -> &DeviceEntry {
        &self.layout().devices[d]
    }

    pub fn procs(&self) -> &[ProcEntry] {
        &self.layout().procs
    }

    /// Device entries in use: (index, uuid, entry).
    pub fn devices(&self) -> impl Iterator<Item = (usize, [u8; 16], &DeviceEntry)> {
        self.layout()
            .devices
            .iter()
            .enumerate()
            .filter(|(_, e)| e.state.load(Acquire) == DEV_READY)
            .map(|(i, e)| (i, e.uuid(), e))
    }

    /// The entry for a GPU, claimed with `limit` if the ledger has none yet. An existing entry
    /// keeps its limit unless `limit` is lower (a process can tighten, never loosen, its
    /// container's limit). None when all entries are taken (or the file's lock cannot be had).
    ///
    /// Finding an entry is lock-free; claiming a new one (once per GPU per container) holds the
    /// file's flock, so two processes cannot claim the same GPU twice.
    pub fn device_for(&self, uuid: [u8; 16], limit: u64) -> Option<usize> {
        let limit = limit.min(BYTES_MASK);
        if let Some(i) = self.find_device(uuid) {
            self.layout().devices[i].limit.fetch_min(limit, AcqRel);
            return Some(i);
        }
        let _threads = self.claiming.lock().unwrap_or_else(|e| e.into_inner());
        let lock = Flock::exclusive(self.map.file(), mapped::LOCK_WAIT).ok()?;
        let found = self.find_device(uuid).or_else(|| {
            let devs = &self.layout().devices;
            let i = devs
                .iter()
                .position(|e| e.state.load(Acquire) == DEV_EMPTY)?;
            let e = &devs[i];
            e.state.store(DEV_CLAIMING, Release);
            e.set_uuid(uuid);
            e.used.store(0, Relaxed);
            e.peak.store(0, Relaxed);
            e.denied.store(0, Relaxed);
            e.gpu_ns.store(0, Relaxed);
            e.throttled_ns.store(0, Relaxed);
            e.launches.store(0, Relaxed);
            e.limit.store(limit, Relaxed); // before READY: no reader ever sees it unlimited
            e.state.store(DEV_READY, Release);
            Some(i)
        });
        drop(lock);
        let i = found?;
        self.layout().devices[i].limit.fetch_min(limit, AcqRel);
        Some(i)
    }

    fn find_device(&self, uuid: [u8; 16]) -> Option<usize> {
        self.layout()
            .devices
            .iter()
            .position(|e| e.state.load(Acquire) == DEV_READY && e.uuid() == uuid)
    }

    /// Claims a process slot for this process (`pid`, `start` and the pid namespace are written
    /// for people; the slot's lease lock, held on this ledger's open file description for as
    /// long as the process lives, is what makes it live). Reclaims dead processes' slots if all
    /// are taken.
    pub fn claim_proc(&self, pid: u32, start: u64) -> Option<usize> {
        let f = self.map.file();
        for pass in 0..2 {
            for (i, s) in self.layout().procs.iter().enumerate() {
                if s.pid.load(Acquire) != 0 {
                    continue;
                }
                // The lock first: a slot whose pid is set and whose lock nobody holds is dead,
                // so the lock must be held before the pid is published.
                if !lease::try_hold(f, i, false).unwrap_or(false) {
                    continue;
                }
                if s.pid.compare_exchange(0, pid, AcqRel, Relaxed).is_ok() {
                    s.start_time.store(start, Release);
                    s.pid_ns.store(process::pid_namespace(), Release);
                    self.own.store(i, Relaxed);
                    // What a previous owner's stragglers left in the slot after it was given
                    // back (a thread of an exiting process charging late) goes back now: we
                    // hold the lease, so nobody alive is left to finish it. (Under the reclaim
                    // lock: a reclaimer of this process sweeping free slots could drain it too.)
                    if s.charged.iter().any(|c| c.load(Acquire) != 0) {
                        let _threads = self.reclaiming.lock().unwrap_or_else(|e| e.into_inner());
                        if self.drain(s) {
                            self.repair();
                        }
                    }
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

    /// In a forked child: the parent's open file description (and so its slot's lease) is the
    /// parent's; the child takes a description of its own before it claims a slot.
    pub fn after_fork(&self) -> std::io::Result<()> {
        self.own.store(usize::MAX, Relaxed);
        for w in &self.holding {
            w.store(0, Relaxed); // the parent's description holds those, not ours
        }
        self.map.reopen_own()
    }

    /// Whether slot `p`'s owner is alive: its lease is held (by another open file description,
    /// or it is this one's own slot). Without a definite answer, alive: nothing is reclaimed on
    /// doubt.
    pub fn proc_alive(&self, p: usize) -> bool {
        p == self.own.load(Relaxed) || lease::held(self.map.file(), p, 1).unwrap_or(true)
    }

    /// Charges `bytes` on device entry `d` to process slot `p`, if the limit allows.
    ///
    /// Crash safety: the slot marks an operation in flight, then the device's `used` is raised
    /// (the commit, never above the limit), then the slot takes the bytes and clears the mark.
    /// A process killed anywhere in between leaves `used` at most `bytes` too high, which
    /// [`Ledger::reclaim_dead`] repairs; never too low.
    pub fn try_charge(&self, d: usize, p: usize, bytes: u64) -> Result<(), Denied> {
        self.charge_within(d, p, bytes, self.layout().devices[d].limit.load(Acquire))
    }

    /// As [`Ledger::try_charge`], held to `cap` too: the limit the caller's own configuration
    /// gives, since the entry's limit lives in a file the container can write.
    #[inline]
    pub fn try_charge_capped(
        &self,
        d: usize,
        p: usize,
        bytes: u64,
        cap: u64,
    ) -> Result<(), Denied> {
        let limit = self.layout().devices[d].limit.load(Acquire).min(cap);
        self.charge_within(d, p, bytes, limit)
    }

    /// Charges `bytes` that the device has already handed out (a pool that grew by more than
    /// was charged for it beforehand), above the limit if need be: the ledger must not show
    /// less than is held. The caller gives it back (or the allocation) right after.
    pub fn force_charge(&self, d: usize, p: usize, bytes: u64) {
        let _ = self.charge_within(d, p, bytes, BYTES_MASK);
    }

    fn charge_within(&self, d: usize, p: usize, bytes: u64, limit: u64) -> Result<(), Denied> {
        let e = &self.layout().devices[d];
        let slot = &self.layout().procs[p].charged[d];
        slot.fetch_add(TOP_ONE, AcqRel);
        step(1);
        match e.used.fetch_update(AcqRel, Acquire, |u| {
            (u & BYTES_MASK)
                .checked_add(bytes)
                .filter(|&n| n <= limit)
                .map(|n| n | ((u & !BYTES_MASK).wrapping_add(TOP_ONE)))
        }) {
            Ok(prev) => {
                step(2);
                slot.fetch_add(bytes.wrapping_sub(TOP_ONE), AcqRel);
                step(3);
                let now = (prev & BYTES_MASK) + bytes;
                if now > e.peak.load(Relaxed) {
                    e.peak.fetch_max(now, Relaxed);
                }
                Ok(())
            }
            Err(used) => {
                slot.fetch_sub(TOP_ONE, AcqRel);
                Err(Denied {
                    requested: bytes,
                    used: used & BYTES_MASK,
                    limit,
                })
            }
        }
    }

    /// Counts a refused allocation (for metrics).
    pub fn note_denied(&self, d: usize) {
        self.layout().devices[d].denied.fetch_add(1, Relaxed);
    }

    /// Gives back `bytes` of slot `p` on device entry `d`. Crash safety as in `try_charge`: the
    /// slot lets go first (marking the operation in flight), `used` after, so a kill in
    /// between over-counts, never under-counts.
    pub fn uncharge(&self, d: usize, p: usize, bytes: u64) {
        let slot = &self.layout().procs[p].charged[d];
        // One fetch_add (no CAS loop to retry under contention): the bytes out, a mark in.
        let prev = slot.fetch_add(TOP_ONE.wrapping_sub(bytes), AcqRel);
        let mut took = bytes;
        if prev & BYTES_MASK < bytes {
            // The slot held less than this free (never for a matched charge; a slot the
            // container rewrote): the subtraction borrowed from the marks. Put back what was
            // not there, which carries the mark back in; give back only what the slot held.
            took = prev & BYTES_MASK;
            slot.fetch_add(bytes - took, AcqRel);
        }
        step(4);
        sub_used(&self.layout().devices[d].used, took);
        step(5);
        slot.fetch_sub(TOP_ONE, AcqRel);
    }

    /// Gives back everything slot `p` holds and frees it (normal exit). Its lease stays held
    /// until the process ends: while it lives, a thread of it still inside an operation on the
    /// slot may leave bytes or a mark there, which only a reclaimer that sees the lease gone
    /// (the process dead) or the slot's next claimer gives back.
    pub fn release_proc(&self, p: usize) {
        let s = &self.layout().procs[p];
        let unsure = self.drain_live(s);
        s.start_time.store(0, Relaxed);
        s.pid_ns.store(0, Relaxed);
        s.pid.store(0, Release);
        if unsure {
            self.repair();
        }
    }

    /// Gives the slot's bytes back to the devices. Each device's part is taken and marked in
    /// flight in one swap, given back, then unmarked, so a repair never sums it half way and a
    /// drainer killed half way leaves a mark (and `used` too high) that the next one repairs.
    /// True when the slot was marked already (its owner, or a drainer, died inside an
    /// operation): `used` may then be too high until a repair.
    fn drain(&self, s: &ProcEntry) -> bool {
        self.drain_with(s, false)
    }

    /// `drain` for a slot whose owner is alive (this process, at exit): the marks of its
    /// operations still in flight (another thread) are kept for them to clear.
    fn drain_live(&self, s: &ProcEntry) -> bool {
        self.drain_with(s, true)
    }

    fn drain_with(&self, s: &ProcEntry, keep_marks: bool) -> bool {
        let mut unsure = false;
        for (d, c) in s.charged.iter().enumerate() {
            if c.load(Acquire) == 0 {
                continue;
            }
            let v = if keep_marks {
                c.fetch_update(AcqRel, Acquire, |v| {
                    Some((v & !BYTES_MASK).wrapping_add(TOP_ONE))
                })
                .unwrap_or(0)
            } else {
                c.swap(TOP_ONE, AcqRel)
            };
            step(6);
            unsure |= v & !BYTES_MASK != 0;
            sub_used(&self.layout().devices[d].used, v & BYTES_MASK);
            step(7);
            c.fetch_sub(TOP_ONE, AcqRel);
        }
        unsure
    }

    /// Gives back the charges of every process that has died, then repairs what a process
    /// killed inside an operation left over-counted. Returns how many slots were reclaimed.
    ///
    /// Runs under the file's flock, taken without waiting (someone else is reclaiming: 0), so a
    /// slot found in PID_RECLAIMING belongs to a reclaimer that died half way: this one
    /// finishes it.
    pub fn reclaim_dead(&self) -> usize {
        let Ok(_threads) = self.reclaiming.try_lock() else {
            return 0;
        };
        let Some(_lock) = Flock::try_exclusive(self.map.file()) else {
            return 0;
        };
        let mut n = 0;
        let mut unsure = false;
        for (i, s) in self.layout().procs.iter().enumerate() {
            let pid = s.pid.load(Acquire);
            if pid == 0 {
                // A free slot with something left in it by a process that died after giving it
                // back (a thread inside an operation when the process ended): once nobody holds
                // its lease (taking it succeeds), that is the dead's and goes back. (Never our
                // own: our description does not conflict with itself, so it would succeed.)
                if i != self.own.load(Relaxed)
                    && s.charged.iter().any(|c| c.load(Acquire) != 0)
                    && lease::try_hold(self.map.file(), i, false).unwrap_or(false)
                {
                    if s.pid.load(Acquire) == 0 {
                        unsure |= self.drain(s);
                    }
                    lease::release(self.map.file(), i);
                }
                continue;
            }
            if pid != PID_RECLAIMING && self.proc_alive(i) {
                continue;
            }
            if pid == PID_RECLAIMING
                || s.pid
                    .compare_exchange(pid, PID_RECLAIMING, AcqRel, Relaxed)
                    .is_ok()
            {
                step(8);
                unsure |= self.drain(s) || pid == PID_RECLAIMING;
                s.start_time.store(0, Relaxed);
                s.pid_ns.store(0, Relaxed);
                s.pid.store(0, Release);
                n += 1;
            }
        }
        unsure |= self.reclaim_shares();
        if unsure {
            self.repair();
        }
        n
    }

    // ---- shares: memory that outlives its allocating process while others hold it ----------

    /// The lease lock index of share entry `i` (after the process slots').
    fn share_lease(i: usize) -> usize {
        MAX_PROCS + i
    }

    pub fn shares(&self) -> &[ShareEntry] {
        &self.layout().shares
    }

    /// Whether this open file description holds share `i`'s lock.
    pub fn holds_share(&self, i: usize) -> bool {
        self.holding[i / 64].load(Acquire) & (1 << (i % 64)) != 0
    }

    fn note_holding(&self, i: usize, on: bool) {
        let bit = 1u64 << (i % 64);
        if on {
            self.holding[i / 64].fetch_or(bit, AcqRel);
        } else {
            self.holding[i / 64].fetch_and(!bit, AcqRel);
        }
    }

    /// Moves `bytes` that slot `p` holds on device entry `d` into a new share entry known by
    /// `key`, which this description then holds. None when every share entry is taken (the
    /// charge then stays the slot's, given back when the process ends).
    ///
    /// Callers in one process serialise their share calls (they share one description, and so
    /// one lock per share).
    pub fn share_open(&self, d: usize, p: usize, bytes: u64, key: u64) -> Option<usize> {
        let f = self.map.file();
        for pass in 0..2 {
            for (i, s) in self.layout().shares.iter().enumerate() {
                if s.state.load(Acquire) != SHARE_FREE
                    || s.state
                        .compare_exchange(SHARE_FREE, SHARE_CLAIMING, AcqRel, Relaxed)
                        .is_err()
                {
                    continue;
                }
                // The lock before LIVE: a LIVE share whose lock nobody holds is dead.
                if !lease::try_hold(f, Self::share_lease(i), true).unwrap_or(false) {
                    let _ = s
                        .state
                        .compare_exchange(SHARE_CLAIMING, SHARE_FREE, AcqRel, Relaxed);
                    continue;
                }
                s.device.store(d as u32, Relaxed);
                s.key.store(key, Relaxed);
                if s.state
                    .compare_exchange(SHARE_CLAIMING, SHARE_LIVE, AcqRel, Relaxed)
                    .is_err()
                {
                    // A reclaimer took it back before our lock was seen.
                    lease::release(f, Self::share_lease(i));
                    continue;
                }
                self.note_holding(i, true);
                // The slot lets go (marking the move in flight), the share takes the bytes, the
                // mark goes: a kill in between leaves the mark, and the next reclaim repairs
                // `used` from the sums (which count shares) rather than lose or double them.
                let slot = &self.layout().procs[p].charged[d];
                let prev = slot.fetch_add(TOP_ONE.wrapping_sub(bytes), AcqRel);
                let mut took = bytes;
                if prev & BYTES_MASK < bytes {
                    took = prev & BYTES_MASK;
                    slot.fetch_add(bytes - took, AcqRel);
                }
                step(9);
                s.bytes.fetch_add(took, AcqRel);
                slot.fetch_sub(TOP_ONE, AcqRel);
                return Some(i);
            }
            if pass == 0 {
                self.reclaim_dead();
            }
        }
        None
    }

    /// Makes this description a holder of every live share known by `key` (or by
    /// [`SHARE_ANY_KEY`]); returns them (those it held already included).
    pub fn share_hold(&self, key: u64) -> Vec<usize> {
        let f = self.map.file();
        let mut held = Vec::new();
        if key == 0 {
            return held;
        }
        for (i, s) in self.layout().shares.iter().enumerate() {
            let matches = |s: &ShareEntry| {
                s.state.load(Acquire) == SHARE_LIVE
                    && matches!(s.key.load(Acquire), k if k == key || k == SHARE_ANY_KEY)
            };
            if !matches(s) {
                continue;
            }
            if self.holds_share(i) {
                held.push(i);
                continue;
            }
            if !lease::try_hold(f, Self::share_lease(i), true).unwrap_or(false) {
                continue;
            }
            // Still the same live share now that our lock is in place (a reclaimer that saw no
            // lock may have taken it meanwhile).
            if matches(s) {
                self.note_holding(i, true);
                held.push(i);
            } else {
                lease::release(f, Self::share_lease(i));
            }
        }
        held
    }

    /// The memory of share `i` was exported again under another key: any import of the
    /// container may be it from now on (erring toward counting).
    pub fn share_widen(&self, i: usize, key: u64) {
        let s = &self.layout().shares[i];
        let _ = s.key.fetch_update(AcqRel, Acquire, |k| match k {
            0 => Some(key),
            k if k == key => None,
            _ => Some(SHARE_ANY_KEY),
        });
    }

    /// This description no longer holds share `i`; if nobody else does, its charge goes back.
    pub fn share_let_go(&self, i: usize) {
        if !self.holds_share(i) {
            return;
        }
        self.note_holding(i, false);
        lease::release(self.map.file(), Self::share_lease(i));
        self.reclaim_dead();
    }

    /// Lets go of every share this description holds (a normal exit).
    pub fn share_let_go_all(&self) {
        for i in 0..MAX_SHARES {
            if self.holds_share(i) {
                self.note_holding(i, false);
                lease::release(self.map.file(), Self::share_lease(i));
            }
        }
        self.reclaim_dead();
    }

    /// Whether share `i` is held by anyone (this description included).
    pub fn share_held(&self, i: usize) -> bool {
        self.holds_share(i) || lease::held(self.map.file(), Self::share_lease(i), 1).unwrap_or(true)
    }

    /// Gives a dead share's bytes back to its device: taken and marked in one swap, so that a
    /// reclaimer killed half way leaves a mark for the repair. True when it was marked already.
    fn drain_share(&self, s: &ShareEntry) -> bool {
        let v = s.bytes.swap(TOP_ONE, AcqRel);
        let d = (s.device.load(Acquire) as usize).min(MAX_DEVICES - 1);
        sub_used(&self.layout().devices[d].used, v & BYTES_MASK);
        s.bytes.fetch_sub(TOP_ONE, AcqRel);
        v & !BYTES_MASK != 0
    }

    /// Under the file's flock: gives back the shares nobody holds. True when a repair is due.
    fn reclaim_shares(&self) -> bool {
        let mut unsure = false;
        for (i, s) in self.layout().shares.iter().enumerate() {
            let st = s.state.load(Acquire);
            if st == SHARE_FREE || (st != SHARE_RECLAIMING && self.share_held(i)) {
                continue;
            }
            if st == SHARE_CLAIMING {
                // A claimer that died before its lock was seen (it held no bytes yet).
                let _ = s
                    .state
                    .compare_exchange(SHARE_CLAIMING, SHARE_FREE, AcqRel, Relaxed);
                continue;
            }
            // A RECLAIMING one found under the flock: its reclaimer died half way.
            if st == SHARE_RECLAIMING
                || s.state
                    .compare_exchange(SHARE_LIVE, SHARE_RECLAIMING, AcqRel, Relaxed)
                    .is_ok()
            {
                unsure |= self.drain_share(s) || st == SHARE_RECLAIMING;
                s.key.store(0, Relaxed);
                s.state.store(SHARE_FREE, Release);
            }
        }
        unsure
    }

    /// Sets each device's `used` to the sum of what the slots hold, when that sum can be had
    /// consistently: no operation in flight in any slot, and no change to `used` while summing
    /// (its change count; 65536 changes during one sum would fool it). Only after a process died
    /// inside an operation; bounded: it gives up after 100 tries and the next reclaim tries again.
    fn repair(&self) {
        for (d, e) in self.layout().devices.iter().enumerate() {
            if e.state.load(Acquire) != DEV_READY {
                continue;
            }
            for _ in 0..100 {
                let before = e.used.load(Acquire);
                let mut sum = 0u64;
                let mut busy = false;
                for s in self.layout().procs.iter() {
                    let c = s.charged[d].load(Acquire);
                    busy |= c & !BYTES_MASK != 0;
                    sum += c & BYTES_MASK;
                }
                for s in self.layout().shares.iter() {
                    if s.device.load(Acquire) as usize == d {
                        let b = s.bytes.load(Acquire);
                        busy |= b & !BYTES_MASK != 0;
                        sum += b & BYTES_MASK;
                    }
                }
                if busy || e.used.load(Acquire) != before {
                    std::thread::yield_now();
                    continue;
                }
                let after = sum.min(BYTES_MASK) | ((before & !BYTES_MASK).wrapping_add(TOP_ONE));
                if sum == before & BYTES_MASK
                    || e.used
                        .compare_exchange(before, after, AcqRel, Acquire)
                        .is_ok()
                {
                    break;
                }
            }
        }
    }

    /// Live process slots: (pid as its namespace numbers it, entry).
    pub fn live_procs(&self) -> impl Iterator<Item = (u32, &ProcEntry)> {
        self.layout().procs.iter().enumerate().filter_map(|(i, s)| {
            let pid = s.pid.load(Acquire);
            (pid != 0 && pid != PID_RECLAIMING && self.proc_alive(i)).then_some((pid, s))
        })
    }
}

/// A point where a test may kill this process (SIGKILL) to prove that no instant of a charge,
/// free or reclaim leaks for good; nothing outside this crate's unit tests.
#[cfg(test)]
fn step(n: u32) {
    if tests::KILL_AT.load(Relaxed) == n {
        // SAFETY: raise has no preconditions.
        unsafe { libc::raise(libc::SIGKILL) };
    }
}
#[cfg(not(test))]
#[inline(always)]
fn step(_: u32) {}

fn sub_used(used: &AtomicU64, v: u64) {
    if v == 0 {
        return;
    }
    let _ = used.fetch_update(AcqRel, Relaxed, |u| {
        Some((u & BYTES_MASK).saturating_sub(v) | ((u & !BYTES_MASK).wrapping_add(TOP_ONE)))
    });
}

/// One GPU entry of a ledger, as read by someone who does not trust it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceUsage {
    pub uuid: [u8; 16],
    pub limit: u64,
    pub used: u64,
    pub peak: u64,
    pub denied: u64,
    pub gpu_ns: u64,
    pub throttled_ns: u64,
    pub launches: u64,
}

/// A ledger as the node daemon reads it: a checked copy, never a mapping.
///
/// A container can write its ledger: truncate it (a mapping of it would raise SIGBUS), replace
/// it by a symlink, a FIFO or a directory, hold its locks, or write any bytes. So the file is
/// opened beneath its directory without following a symlink or blocking, must be a regular
/// file, is read with one bounded `pread` into memory of our own, and every value in it is a
/// claim (entries with other states are ignored; numbers are shown as the container wrote
/// them, never used to grant anything).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Snapshot {
    pub container_id: u64,
    pub devices: Vec<DeviceUsage>,
    /// Some process of the container holds a slot's lease (see `lease`): the container is
    /// running a CUDA process now.
    pub alive: bool,
}

impl Snapshot {
    /// Reads `<dir>/ledger`. `dir` is a directory the caller trusts (made by it); the ledger in
    /// it is not trusted.
    pub fn read(dir: &Path) -> Result<Snapshot, String> {
        let shown = dir.join(FILE_NAME);
        let e =
            |what: &str, err: std::io::Error| format!("ledger {}: {what}: {err}", shown.display());
        let file = mapped::open_beneath(dir, FILE_NAME).map_err(|err| e("open", err))?;
        let size = std::mem::size_of::<Layout>();
        let len = file.metadata().map_err(|err| e("stat", err))?.len();
        if len != size as u64 {
            return Err(format!(
                "ledger {}: {len} bytes, expected {size}: not a cuvisor ledger of this version",
                shown.display()
            ));
        }
        // Only the header and the device entries are read (1.3 KiB, not the 147 KiB of process
        // slots): a node with a thousand containers scrapes them all.
        let wanted = std::mem::offset_of!(Layout, procs);
        let mut copy = Box::<Layout>::new_uninit();
        // SAFETY: the box is `size` bytes we own; u8 has no invalid values and we only write.
        let bytes = unsafe { std::slice::from_raw_parts_mut(copy.as_mut_ptr().cast::<u8>(), size) };
        bytes.fill(0);
        let got = mapped::read_head(&file, &mut bytes[..wanted]).map_err(|err| e("read", err))?;
        if got < wanted {
            return Err(format!(
                "ledger {}: truncated while read ({got} bytes)",
                shown.display()
            ));
        }
        // SAFETY: every byte was written above (the process slots as zeros), and any bytes are a
        // valid Layout (atomics and integers only).
        let l = unsafe { copy.assume_init() };
        if l.header.magic.load(Relaxed) != MAGIC {
            return Err(format!("ledger {}: not a cuvisor ledger", shown.display()));
        }
        check(&l).map_err(|err| format!("ledger {}: {err}", shown.display()))?;
        let devices = l
            .devices
            .iter()
            .filter(|d| d.state.load(Relaxed) == DEV_READY)
            .map(|d| DeviceUsage {
                uuid: d.uuid(),
                limit: d.limit.load(Relaxed),
                used: d.used_bytes(),
                peak: d.peak.load(Relaxed),
                denied: d.denied.load(Relaxed),
                gpu_ns: d.gpu_ns.load(Relaxed),
                throttled_ns: d.throttled_ns.load(Relaxed),
                launches: d.launches.load(Relaxed),
            })
            .collect();
        Ok(Snapshot {
            container_id: l.header.container_id,
            devices,
            alive: lease::held(&file, 0, MAX_PROCS).unwrap_or(true),
        })
    }
}

/// Whether some process of the container whose ledger directory is `dir` is alive (holds a
/// slot's lease), asked without reading or mapping the ledger and without waiting. No ledger
/// file: Ok(false) (no CUDA process ever ran). A ledger that is not a regular file: an error.
pub fn any_alive(dir: &Path) -> std::io::Result<bool> {
    match mapped::open_beneath(dir, FILE_NAME) {
        Ok(f) => lease::held(&f, 0, MAX_PROCS),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e),
    }
}

/// A random, non-zero 64-bit id (getrandom; the clock and pid if that fails).
///
/// The system call, not glibc's `getrandom` wrapper: the wrapper exists only from glibc 2.25,
/// and the shipped library must load against glibc 2.17 (docs/glibc.md); `syscall` is there
/// since 2.2.5. A kernel without the call (before 3.17) answers ENOSYS: the fallback below.
pub fn random_id() -> u64 {
    let mut v = 0u64;
    // SAFETY: getrandom(2) writes at most 8 bytes into `v`, which we own; the arguments are
    // the buffer, its length and no flags, as the system call takes them.
    let n = unsafe {
        libc::syscall(
            libc::SYS_getrandom,
            &mut v as *mut u64 as *mut libc::c_void,
            8usize,
            0usize,
        )
    };
    if n != 8 {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: clock_gettime writes into the timespec we own.
        unsafe { libc::clock_gettime(libc::CLOCK_REALTIME, &mut ts) };
        v = (ts.tv_sec as u64).wrapping_mul(1_000_000_007)
            ^ ts.tv_nsec as u64
            ^ ((std::process::id() as u64) << 40);
    }
    v.max(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;

    /// The kill point this process dies at (see `step`); 0: none.
    pub(super) static KILL_AT: AtomicU32 = AtomicU32::new(0);

    fn temp_dir(tag: &str) -> std::path::PathBuf {
        cuvisor_testkit::fresh_dir(&format!("ledger-{tag}"))
    }

    fn temp_ledger(tag: &str) -> Ledger {
        Ledger::open_dir(&temp_dir(tag)).unwrap()
    }

    fn cleanup(l: &Ledger) {
        let _ = std::fs::remove_dir_all(l.path().parent().unwrap());
    }

    /// Waits (at most 2 s) until `cond` holds. A closed description's locks can outlive the
    /// close while another thread of this test binary forks to spawn a child (the child holds
    /// copies of every descriptor until it execs).
    fn eventually(what: &str, cond: impl Fn() -> bool) {
        let t = std::time::Instant::now();
        while !cond() {
            assert!(
                t.elapsed() < std::time::Duration::from_secs(2),
                "never: {what}"
            );
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }

    fn sum_slots(l: &Ledger, d: usize) -> u64 {
        l.procs().iter().map(|s| s.charged_bytes(d)).sum()
    }

    #[test]
    fn charges_never_pass_the_limit_under_contention() {
        let l = Arc::new(temp_ledger("contention"));
        let d = l.device_for([1; 16], 1000).unwrap();
        let (pid, start) = process::me();
        let p = l.claim_proc(pid, start).unwrap();
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let l = l.clone();
                std::thread::spawn(move || {
                    let mut held = 0;
                    for i in 0..20_000u64 {
                        let bytes = 1 + i % 97;
                        if l.try_charge(d, p, bytes).is_ok() {
                            held += bytes;
                        }
                        assert!(l.device(d).used_bytes() <= 1000);
                        if i % 3 == 0 && held > 0 {
                            l.uncharge(d, p, held);
                            held = 0;
                        }
                    }
                    l.uncharge(d, p, held);
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(l.device(d).used_bytes(), 0);
        assert_eq!(
            l.procs()[p].charged[d].load(Relaxed),
            0,
            "nothing in flight"
        );
        assert!(l.device(d).peak.load(Relaxed) <= 1000);
        cleanup(&l);
    }

    #[test]
    fn denial_reports_request_use_and_limit() {
        let l = temp_ledger("deny");
        let d = l.device_for([2; 16], 100).unwrap();
        let p = l.claim_proc(1, 1).unwrap();
        l.try_charge(d, p, 60).unwrap();
        assert_eq!(
            l.try_charge(d, p, 41),
            Err(Denied {
                requested: 41,
                used: 60,
                limit: 100
            })
        );
        l.try_charge(d, p, 40).unwrap();
        cleanup(&l);
    }

    #[test]
    fn a_forced_charge_shows_memory_held_past_the_limit() {
        let l = temp_ledger("force");
        let d = l.device_for([9; 16], 100).unwrap();
        let p = l.claim_proc(1, 1).unwrap();
        l.try_charge(d, p, 90).unwrap();
        l.force_charge(d, p, 30);
        assert_eq!(
            l.device(d).used_bytes(),
            120,
            "above the limit: what is held"
        );
        assert_eq!(l.procs()[p].charged_bytes(d), 120);
        assert!(l.try_charge(d, p, 1).is_err(), "nothing more fits");
        l.uncharge(d, p, 30);
        assert_eq!(l.device(d).used_bytes(), 90);
        l.try_charge(d, p, 10).unwrap();
        cleanup(&l);
    }

    #[test]
    fn devices_are_keyed_by_uuid_and_limits_only_tighten() {
        let l = temp_ledger("uuid");
        let a = l.device_for([3; 16], 100).unwrap();
        let b = l.device_for([4; 16], 200).unwrap();
        assert_ne!(a, b);
        assert_eq!(l.device_for([3; 16], 500).unwrap(), a);
        assert_eq!(
            l.device(a).limit.load(Relaxed),
            100,
            "a process cannot raise the limit"
        );
        l.device_for([3; 16], 50).unwrap();
        assert_eq!(l.device(a).limit.load(Relaxed), 50);
        assert_eq!(l.devices().count(), 2);
        cleanup(&l);
    }

    #[test]
    fn a_process_is_judged_by_its_lease_never_by_its_pid() {
        let dir = temp_dir("lease");
        let l = Ledger::open_dir(&dir).unwrap();
        let d = l.device_for([5; 16], 1 << 30).unwrap();
        let (me, start) = process::me();
        // A process that died, whose pid names a live process here (ours): as a pid from
        // another namespace would. Its lease went with its open file description.
        let gone = Ledger::open_dir(&dir).unwrap();
        let p = gone.claim_proc(me, start).unwrap();
        gone.try_charge(d, p, 600).unwrap();
        drop(gone);
        eventually("the lease goes with its description", || !l.proc_alive(p));
        // A live process whose pid means nothing here (another namespace's pid 999999).
        let live = Ledger::open_dir(&dir).unwrap();
        let q = live.claim_proc(999_999, 1).unwrap();
        live.try_charge(d, q, 400).unwrap();
        assert!(!l.proc_alive(p) && l.proc_alive(q));
        assert_eq!(l.reclaim_dead(), 1, "only the one without a lease");
        assert_eq!(l.device(d).used_bytes(), 400);
        assert_eq!(l.live_procs().count(), 1);
        assert!(any_alive(&dir).unwrap());
        assert_eq!(Snapshot::read(&dir).unwrap().devices[0].used, 400);
        drop(live);
        assert!(
            !any_alive(&dir).unwrap(),
            "no process of the container lives"
        );
        assert_eq!(l.reclaim_dead(), 1);
        assert_eq!(l.device(d).used_bytes(), 0);
        cleanup(&l);
    }

    #[test]
    fn a_share_stays_charged_while_any_description_holds_it_and_goes_with_the_last() {
        let dir = temp_dir("share");
        let l = Ledger::open_dir(&dir).unwrap();
        let d = l.device_for([14; 16], 1000).unwrap();
        // The exporter: a process (description) of its own that charges 600 and shares them.
        let exporter = Ledger::open_dir(&dir).unwrap();
        let p = exporter.claim_proc(1, 1).unwrap();
        exporter.try_charge(d, p, 600).unwrap();
        let s = exporter.share_open(d, p, 600, 77).unwrap();
        assert_eq!(
            exporter.procs()[p].charged_bytes(d),
            0,
            "moved out of the slot"
        );
        assert_eq!(l.device(d).used_bytes(), 600);
        // An importer of the same container, another description, finds it by its key only.
        let importer = Ledger::open_dir(&dir).unwrap();
        assert!(importer.share_hold(78).is_empty(), "another key");
        assert_eq!(importer.share_hold(77), vec![s]);
        // The exporter dies: its slot goes, the share stays (the importer holds it).
        drop(exporter);
        eventually("the exporter's lease is gone", || !l.proc_alive(p));
        l.reclaim_dead();
        assert_eq!(l.device(d).used_bytes(), 600, "still held by the importer");
        assert!(l.try_charge(d, l.claim_proc(2, 2).unwrap(), 401).is_err());
        // The importer lets go: nobody holds it, the charge goes back.
        importer.share_let_go(s);
        assert_eq!(l.device(d).used_bytes(), 0);
        assert_eq!(l.shares()[s].state.load(Relaxed), SHARE_FREE);
        // A holder that dies (its description closed) lets go as well.
        let exporter = Ledger::open_dir(&dir).unwrap();
        let p = exporter.claim_proc(3, 3).unwrap();
        exporter.try_charge(d, p, 300).unwrap();
        let s = exporter.share_open(d, p, 300, 5).unwrap();
        exporter.share_widen(s, 6);
        assert_eq!(
            l.shares()[s].key.load(Relaxed),
            SHARE_ANY_KEY,
            "two keys: any import"
        );
        let importer = Ledger::open_dir(&dir).unwrap();
        assert_eq!(importer.share_hold(1234), vec![s]);
        drop(exporter);
        drop(importer);
        eventually("both gone", || !l.share_held(s));
        l.reclaim_dead();
        assert_eq!(l.device(d).used_bytes(), 0);
        assert_eq!(sum_slots(&l, d), 0);
        cleanup(&l);
    }

    #[test]
    fn a_forked_child_takes_a_lease_of_its_own() {
        let dir = temp_dir("fork");
        let l = Ledger::open_dir(&dir).unwrap();
        let (me, start) = process::me();
        let p = l.claim_proc(me, start).unwrap();
        // What `after_fork` does in the child, done here on a second handle of the same
        // description: the fresh description claims another slot and the first one stays ours.
        let child_view = Ledger::open_dir(&dir).unwrap();
        child_view.after_fork().unwrap();
        let c = child_view.claim_proc(me, start + 1).unwrap();
        assert_ne!(c, p);
        drop(child_view);
        eventually("the child's lease goes with it", || !l.proc_alive(c));
        assert!(l.proc_alive(p));
        cleanup(&l);
    }

    #[test]
    fn a_file_of_another_shape_or_version_is_refused_not_a_crash() {
        let dir = temp_dir("bad");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(FILE_NAME), b"not a ledger").unwrap();
        assert!(Ledger::open_dir(&dir)
            .err()
            .unwrap()
            .contains("not a cuvisor ledger of this version"));
        assert!(Snapshot::read(&dir).is_err());
        std::fs::remove_file(dir.join(FILE_NAME)).unwrap();
        drop(Ledger::open_dir(&dir).unwrap());
        // The right magic and another version: once a use after munmap (SIGSEGV) while
        // reporting it.
        let mut bytes = std::fs::read(dir.join(FILE_NAME)).unwrap();
        bytes[8..12].copy_from_slice(&(VERSION + 1).to_ne_bytes());
        std::fs::write(dir.join(FILE_NAME), &bytes).unwrap();
        let e = Ledger::open_dir(&dir).err().unwrap();
        let other = format!("version {}", VERSION + 1);
        assert!(e.contains(&other), "{e}");
        assert!(Snapshot::read(&dir).err().unwrap().contains(&other));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_snapshot_reader_refuses_what_a_container_can_plant() {
        let dir = temp_dir("plant");
        std::fs::create_dir_all(&dir).unwrap();
        let t = std::time::Instant::now();
        // A FIFO: opening it for reading would block until a writer came.
        let c = std::ffi::CString::new(dir.join(FILE_NAME).to_str().unwrap()).unwrap();
        // SAFETY: a valid path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o666) }, 0);
        assert!(Snapshot::read(&dir).is_err());
        assert!(any_alive(&dir).is_err());
        std::fs::remove_file(dir.join(FILE_NAME)).unwrap();
        // A symlink to a host file.
        std::os::unix::fs::symlink("/etc/passwd", dir.join(FILE_NAME)).unwrap();
        assert!(Snapshot::read(&dir).is_err());
        std::fs::remove_file(dir.join(FILE_NAME)).unwrap();
        // A directory.
        std::fs::create_dir(dir.join(FILE_NAME)).unwrap();
        assert!(Snapshot::read(&dir).is_err());
        std::fs::remove_dir(dir.join(FILE_NAME)).unwrap();
        // A truncated ledger: an error, not SIGBUS.
        drop(Ledger::open_dir(&dir).unwrap());
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(dir.join(FILE_NAME))
            .unwrap();
        f.set_len(4096).unwrap();
        assert!(Snapshot::read(&dir).err().unwrap().contains("4096 bytes"));
        assert!(
            t.elapsed() < std::time::Duration::from_secs(1),
            "nothing blocked"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn repairs_race_with_charges_and_never_undercount() {
        let l = Arc::new(temp_ledger("repair"));
        let d = l.device_for([6; 16], 1 << 40).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let workers: Vec<_> = (0..4u64)
            .map(|w| {
                let l = l.clone();
                std::thread::spawn(move || {
                    let p = l.claim_proc(100 + w as u32, 1).unwrap();
                    l.try_charge(d, p, 1_000_000).unwrap(); // a base that saturation never hides
                    for i in 0..50_000u64 {
                        let b = 512 * (1 + (i * 7 + w) % 13);
                        l.try_charge(d, p, b).unwrap();
                        l.uncharge(d, p, b);
                    }
                })
            })
            .collect();
        let repairer = {
            let (l, stop) = (l.clone(), stop.clone());
            std::thread::spawn(move || {
                while !stop.load(Relaxed) {
                    l.repair();
                }
            })
        };
        for w in workers {
            w.join().unwrap();
        }
        stop.store(true, Relaxed);
        repairer.join().unwrap();
        assert_eq!(l.device(d).used_bytes(), 4_000_000);
        assert_eq!(sum_slots(&l, d), 4_000_000);
        cleanup(&l);
    }

    /// A free of more than the slot holds (a slot the container rewrote) gives back only what
    /// the slot held and leaves no mark behind.
    #[test]
    fn a_free_of_more_than_the_slot_holds_leaves_it_sound() {
        let l = temp_ledger("overfree");
        let d = l.device_for([13; 16], 1 << 30).unwrap();
        let p = l.claim_proc(1, 1).unwrap();
        let q = l.claim_proc(2, 1).unwrap();
        l.try_charge(d, q, 1000).unwrap(); // another process's charge, which must stay
        l.try_charge(d, p, 100).unwrap();
        l.uncharge(d, p, 300);
        assert_eq!(l.procs()[p].charged[d].load(Relaxed), 0);
        assert_eq!(l.device(d).used_bytes(), 1000);
        cleanup(&l);
    }

    /// Two threads of one process reclaiming at once (the flock is the description's, which
    /// they share) must not both drain one dead slot. (Found by review.)
    #[test]
    fn threads_of_one_process_reclaim_one_at_a_time() {
        let dir = temp_dir("threads-reclaim");
        let l = Arc::new(Ledger::open_dir(&dir).unwrap());
        let d = l.device_for([11; 16], 1 << 40).unwrap();
        let (me, start) = process::me();
        let mine = l.claim_proc(me, start).unwrap();
        l.try_charge(d, mine, 100).unwrap();
        for round in 0..200 {
            let gone = Ledger::open_dir(&dir).unwrap();
            let v = gone.claim_proc(1, 1).unwrap();
            gone.try_charge(d, v, 700).unwrap();
            drop(gone);
            eventually("the victim is dead", || !l.proc_alive(v));
            let ts: Vec<_> = (0..2)
                .map(|_| {
                    let l = l.clone();
                    std::thread::spawn(move || l.reclaim_dead())
                })
                .collect();
            let n: usize = ts.into_iter().map(|t| t.join().unwrap()).sum();
            assert!(n <= 1, "round {round}: reclaimed {n} times");
            l.reclaim_dead();
            assert_eq!(l.device(d).used_bytes(), 100, "round {round}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A process giving its slot back at exit while another of its threads is still inside a
    /// charge or a free: the slot keeps that thread's mark for it to clear (no wrapped marks
    /// left behind), and the books balance. (Found by review: 3 in 2000 left 0xffff << 48.)
    #[test]
    fn a_release_while_another_thread_charges_leaves_the_slot_sound() {
        let dir = temp_dir("release-race");
        let l = Arc::new(Ledger::open_dir(&dir).unwrap());
        let d = l.device_for([12; 16], 1 << 40).unwrap();
        for round in 0..2000 {
            let p = l.claim_proc(7, round).unwrap();
            let worker = {
                let l = l.clone();
                std::thread::spawn(move || {
                    for _ in 0..50 {
                        if l.try_charge(d, p, 512).is_ok() {
                            l.uncharge(d, p, 512);
                        }
                    }
                })
            };
            l.release_proc(p);
            worker.join().unwrap();
            let c = l.procs()[p].charged[d].load(Relaxed);
            assert_eq!(c & !BYTES_MASK, 0, "round {round}: marks left: {c:#x}");
            // What the worker charged after the release stays in the free slot, counted.
            assert_eq!(l.device(d).used_bytes(), sum_slots(&l, d), "round {round}");
            // The next claimer of the slot gives such leftovers back.
            let q = l.claim_proc(8, round).unwrap();
            l.release_proc(q);
            assert_eq!(sum_slots(&l, d), 0, "round {round}");
            assert_eq!(l.device(d).used_bytes(), 0, "round {round}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Run by `killed_at_every_step` in a child process: one charge, one free, one share and
    /// one reclaim,
    /// killed at the kill point CUVISOR_TEST_KILL_AT.
    #[test]
    #[ignore = "a child process of killed_at_every_step, not a test of its own"]
    fn killpoint_child() {
        let dir = std::env::var("CUVISOR_TEST_LEDGER").expect("run by killed_at_every_step");
        let at = std::env::var("CUVISOR_TEST_KILL_AT").unwrap();
        KILL_AT.store(at.parse().unwrap(), Relaxed);
        let l = Ledger::open_dir(Path::new(&dir)).unwrap();
        let d = l.device_for([9; 16], 1 << 30).unwrap();
        let (pid, start) = process::me();
        let p = l.claim_proc(pid, start).unwrap();
        l.try_charge(d, p, 1000).unwrap();
        l.uncharge(d, p, 400);
        l.share_open(d, p, 200, 42).unwrap(); // held until this process ends
        l.reclaim_dead(); // the victim's slot
        l.release_proc(p);
    }

    #[test]
    fn killed_at_every_step_nothing_leaks_for_good() {
        for at in 0..=9u32 {
            let dir = temp_dir(&format!("kill{at}"));
            let l = Ledger::open_dir(&dir).unwrap();
            let d = l.device_for([9; 16], 1 << 30).unwrap();
            let (me, start) = process::me();
            let mine = l.claim_proc(me, start).unwrap();
            l.try_charge(d, mine, 300).unwrap();
            // A process that died holding 700, for the child to reclaim.
            let victim = Ledger::open_dir(&dir).unwrap();
            let v = victim.claim_proc(1, 1).unwrap();
            victim.try_charge(d, v, 700).unwrap();
            drop(victim);
            eventually("the victim is dead", || !l.proc_alive(v));
            let status = std::process::Command::new(std::env::current_exe().unwrap())
                .args([
                    "--ignored",
                    "--exact",
                    "ledger::tests::killpoint_child",
                    "--test-threads=1",
                ])
                .env("CUVISOR_TEST_LEDGER", &dir)
                .env("CUVISOR_TEST_KILL_AT", at.to_string())
                .stdout(std::process::Stdio::null())
                .status()
                .unwrap();
            use std::os::unix::process::ExitStatusExt;
            if at == 0 {
                assert!(status.success(), "{status:?}");
            } else {
                assert_eq!(
                    status.signal(),
                    Some(libc::SIGKILL),
                    "kill point {at} reached"
                );
            }
            // Whatever the child left, at most an over-count, which the next reclaim repairs.
            assert!(
                l.device(d).used_bytes() >= 300,
                "kill point {at}: under-counted"
            );
            l.reclaim_dead();
            assert_eq!(
                l.device(d).used_bytes(),
                300,
                "kill point {at}: exact after the next reclaim"
            );
            assert_eq!(sum_slots(&l, d), 300);
            assert_eq!(l.live_procs().count(), 1);
            cleanup(&l);
        }
    }
}
