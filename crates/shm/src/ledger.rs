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
//! The layout is mirrored in `include/cuvisor.h`; bump [`VERSION`] on any change.

use crate::process;
use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::*};

/// "CUVLEDG1"
pub const MAGIC: u64 = 0x3147_4445_4c56_5543;
pub const VERSION: u32 = 2;
pub const MAX_DEVICES: usize = 16;
pub const MAX_PROCS: usize = 1024;
pub const FILE_NAME: &str = "ledger";

/// Device entry states.
pub const DEV_EMPTY: u32 = 0;
pub const DEV_CLAIMING: u32 = 1;
pub const DEV_READY: u32 = 2;

/// A process slot whose owner died and whose charges are being given back.
pub const PID_RECLAIMING: u32 = u32::MAX;

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
    /// Bytes it holds now (all its processes).
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
}

#[repr(C)]
pub struct ProcEntry {
    /// 0 = free, PID_RECLAIMING while its charges are given back.
    pub pid: AtomicU32,
    pub _pad: u32,
    /// /proc/PID/stat start time; 0 while the slot is being claimed.
    pub start_time: AtomicU64,
    /// Bytes held per device entry.
    pub charged: [AtomicU64; MAX_DEVICES],
}

#[repr(C)]
pub struct Layout {
    pub header: Header,
    pub devices: [DeviceEntry; MAX_DEVICES],
    pub procs: [ProcEntry; MAX_PROCS],
}

/// A refused charge: what was asked, what is in use, what the limit is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Denied {
    pub requested: u64,
    pub used: u64,
    pub limit: u64,
}

/// A mapped ledger. The mapping lives as long as the value (the library keeps it for good).
pub struct Ledger {
    layout: *const Layout,
    path: PathBuf,
    _file: File,
}

// SAFETY: Layout is made only of atomics and plain integers written before publication; the
// pointer stays valid (mapped) for the life of the Ledger.
unsafe impl Send for Ledger {}
// SAFETY: as above; all shared mutation goes through atomics.
unsafe impl Sync for Ledger {}

impl Drop for Ledger {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly what `open` mapped; no reference into it outlives self.
        unsafe {
            libc::munmap(
                self.layout as *mut libc::c_void,
                std::mem::size_of::<Layout>(),
            )
        };
    }
}

fn io_err(path: &Path, what: &str, e: std::io::Error) -> String {
    format!("ledger {}: {what}: {e}", path.display())
}

impl Ledger {
    /// Opens (creating and initialising if needed) `<dir>/ledger`.
    pub fn open_dir(dir: &Path) -> Result<Ledger, String> {
        std::fs::create_dir_all(dir).map_err(|e| io_err(dir, "create directory", e))?;
        Self::open(&dir.join(FILE_NAME), true)
    }

    /// Opens an existing ledger file; `create`: make it if missing.
    pub fn open(path: &Path, create: bool) -> Result<Ledger, String> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(create)
            .truncate(false)
            .open(path)
            .map_err(|e| io_err(path, "open", e))?;
        let fd = file.as_raw_fd();
        let size = std::mem::size_of::<Layout>();
        // SAFETY: fd is open for the duration; flock is released by the kernel if we die.
        if unsafe { libc::flock(fd, libc::LOCK_EX) } != 0 {
            return Err(io_err(path, "lock", std::io::Error::last_os_error()));
        }
        let mapped = (|| {
            let len = file.metadata().map_err(|e| io_err(path, "stat", e))?.len();
            if len < size as u64 {
                if len != 0 {
                    return Err(format!("ledger {}: {len} bytes, expected {size}: not a cuvisor ledger of this version", path.display()));
                }
                file.set_len(size as u64)
                    .map_err(|e| io_err(path, "resize", e))?;
            }
            // SAFETY: mapping `size` bytes of a file at least that long, shared between processes.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    size,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED,
                    fd,
                    0,
                )
            };
            if p == libc::MAP_FAILED {
                return Err(io_err(path, "mmap", std::io::Error::last_os_error()));
            }
            let layout = p as *mut Layout;
            // SAFETY: the mapping is valid, page aligned and zero-filled when new; every field is
            // an atomic or integer for which zero bytes are valid. We hold the flock, so nobody
            // else initialises concurrently.
            let header = unsafe { &(*layout).header };
            match header.magic.load(Acquire) {
                0 => {
                    // SAFETY: exclusive (flock held, magic unset): no reader trusts these yet.
                    unsafe {
                        (*layout).header.version = VERSION;
                        (*layout).header.size = size as u32;
                        (*layout).header.max_devices = MAX_DEVICES as u32;
                        (*layout).header.max_procs = MAX_PROCS as u32;
                        (*layout).header.container_id = random_id();
                    }
                    header.magic.store(MAGIC, Release);
                }
                MAGIC if header.version == VERSION && header.size == size as u32 => {}
                MAGIC => {
                    // SAFETY: unmapping what we just mapped before reporting.
                    unsafe { libc::munmap(p, size) };
                    return Err(format!(
                        "ledger {}: version {} (this cuvisor speaks {VERSION})",
                        path.display(),
                        header.version
                    ));
                }
                _ => {
                    // SAFETY: as above.
                    unsafe { libc::munmap(p, size) };
                    return Err(format!("ledger {}: not a cuvisor ledger", path.display()));
                }
            }
            Ok(layout as *const Layout)
        })();
        // SAFETY: fd still open.
        unsafe { libc::flock(fd, libc::LOCK_UN) };
        Ok(Ledger {
            layout: mapped?,
            path: path.to_path_buf(),
            _file: file,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The container's id (random, made with the file; never 0).
    pub fn container_id(&self) -> u64 {
        self.layout().header.container_id
    }

    fn layout(&self) -> &Layout {
        // SAFETY: valid while self lives (see Ledger).
        unsafe { &*self.layout }
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
    /// container's limit). None when all entries are taken.
    ///
    /// Finding an entry is lock-free; claiming a new one (once per GPU per container) holds the
    /// file's flock, so two processes cannot claim the same GPU twice.
    pub fn device_for(&self, uuid: [u8; 16], limit: u64) -> Option<usize> {
        if let Some(i) = self.find_device(uuid) {
            self.layout().devices[i].limit.fetch_min(limit, AcqRel);
            return Some(i);
        }
        let fd = self._file.as_raw_fd();
        // SAFETY: our own open descriptor; the kernel drops the lock if we die holding it.
        unsafe { libc::flock(fd, libc::LOCK_EX) };
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
        // SAFETY: as above.
        unsafe { libc::flock(fd, libc::LOCK_UN) };
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

    /// Claims a process slot for (pid, start). Reclaims dead processes' slots if all are taken.
    pub fn claim_proc(&self, pid: u32, start: u64) -> Option<usize> {
        for pass in 0..2 {
            for (i, s) in self.layout().procs.iter().enumerate() {
                if s.pid.load(Acquire) == pid && s.start_time.load(Acquire) == start {
                    return Some(i);
                }
                if s.pid.compare_exchange(0, pid, AcqRel, Relaxed).is_ok() {
                    s.start_time.store(start, Release);
                    return Some(i);
                }
            }
            if pass == 0 {
                self.reclaim_dead();
            }
        }
        None
    }

    /// Charges `bytes` on device entry `d` to process slot `p`, if the limit allows.
    pub fn try_charge(&self, d: usize, p: usize, bytes: u64) -> Result<(), Denied> {
        let e = &self.layout().devices[d];
        let limit = e.limit.load(Acquire);
        match e.used.fetch_update(AcqRel, Acquire, |u| {
            u.checked_add(bytes).filter(|&n| n <= limit)
        }) {
            Ok(prev) => {
                self.layout().procs[p].charged[d].fetch_add(bytes, AcqRel);
                e.peak.fetch_max(prev + bytes, Relaxed);
                Ok(())
            }
            Err(used) => Err(Denied {
                requested: bytes,
                used,
                limit,
            }),
        }
    }

    /// Counts a refused allocation (for metrics).
    pub fn note_denied(&self, d: usize) {
        self.layout().devices[d].denied.fetch_add(1, Relaxed);
    }

    pub fn uncharge(&self, d: usize, p: usize, bytes: u64) {
        saturating_sub(&self.layout().procs[p].charged[d], bytes);
        saturating_sub(&self.layout().devices[d].used, bytes);
    }

    /// Gives back everything slot `p` holds and frees it (normal exit).
    pub fn release_proc(&self, p: usize) {
        let s = &self.layout().procs[p];
        self.drain(s);
        s.start_time.store(0, Relaxed);
        s.pid.store(0, Release);
    }

    fn drain(&self, s: &ProcEntry) {
        for (d, c) in s.charged.iter().enumerate() {
            let bytes = c.swap(0, AcqRel);
            if bytes > 0 {
                saturating_sub(&self.layout().devices[d].used, bytes);
            }
        }
    }

    /// Gives back the charges of every process that has died. Returns how many.
    pub fn reclaim_dead(&self) -> usize {
        let mut n = 0;
        for s in self.layout().procs.iter() {
            let pid = s.pid.load(Acquire);
            if pid == 0 || pid == PID_RECLAIMING {
                continue;
            }
            let start = s.start_time.load(Acquire);
            if start == 0 || process::alive(pid, start) {
                continue;
            }
            if s.pid
                .compare_exchange(pid, PID_RECLAIMING, AcqRel, Relaxed)
                .is_ok()
            {
                self.drain(s);
                s.start_time.store(0, Relaxed);
                s.pid.store(0, Release);
                n += 1;
            }
        }
        n
    }

    /// Live process slots: (pid, entry).
    pub fn live_procs(&self) -> impl Iterator<Item = (u32, &ProcEntry)> {
        self.layout().procs.iter().filter_map(|s| {
            let pid = s.pid.load(Acquire);
            (pid != 0 && pid != PID_RECLAIMING).then_some((pid, s))
        })
    }
}

/// A random, non-zero 64-bit id (getrandom; the clock and pid if that fails).
pub fn random_id() -> u64 {
    let mut v = 0u64;
    // SAFETY: getrandom writes at most 8 bytes into `v`, which we own.
    let n = unsafe { libc::getrandom(&mut v as *mut u64 as *mut libc::c_void, 8, 0) };
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

fn saturating_sub(a: &AtomicU64, v: u64) {
    let _ = a.fetch_update(AcqRel, Relaxed, |x| Some(x.saturating_sub(v)));
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn temp_ledger(tag: &str) -> Ledger {
        let dir = std::env::temp_dir().join(format!("cuvisor-ledger-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        Ledger::open_dir(&dir).unwrap()
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
                        assert!(l.device(d).used.load(Relaxed) <= 1000);
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
        assert_eq!(l.device(d).used.load(Relaxed), 0);
        assert!(l.device(d).peak.load(Relaxed) <= 1000);
        let _ = std::fs::remove_dir_all(l.path().parent().unwrap());
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
        let _ = std::fs::remove_dir_all(l.path().parent().unwrap());
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
        let _ = std::fs::remove_dir_all(l.path().parent().unwrap());
    }

    #[test]
    fn a_dead_process_charges_come_back_and_pid_reuse_does_not_fool_it() {
        let l = temp_ledger("dead");
        let d = l.device_for([5; 16], 1 << 30).unwrap();
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        let p = l.claim_proc(pid, 424242).unwrap();
        l.try_charge(d, p, 600).unwrap();
        // Our own pid with a start time that is not ours: a "reused pid" slot, also dead.
        let (me, start) = process::me();
        let q = l.claim_proc(me, start + 7).unwrap();
        l.try_charge(d, q, 400).unwrap();
        assert_eq!(l.reclaim_dead(), 2);
        assert_eq!(l.device(d).used.load(Relaxed), 0);
        let r = l.claim_proc(me, start).unwrap();
        l.try_charge(d, r, 1).unwrap();
        assert_eq!(l.reclaim_dead(), 0, "we are alive");
        let _ = std::fs::remove_dir_all(l.path().parent().unwrap());
    }

    #[test]
    fn a_file_of_another_shape_is_refused() {
        let dir = std::env::temp_dir().join(format!("cuvisor-ledger-bad-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(FILE_NAME), b"not a ledger").unwrap();
        assert!(Ledger::open_dir(&dir)
            .err()
            .unwrap()
            .contains("not a cuvisor ledger of this version"));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
