//! The memory quota, as plain Rust: which ledger entry a device is, charging before the driver
//! allocates, what each allocation was charged, and the memory a program is shown.
//!
//! No FFI here: `hook` asks the driver (for a device's UUID, for physical memory) and passes the
//! answers in, so everything below is unit-tested without a GPU.

pub mod graph;
pub mod modules;
pub mod pools;
pub mod shared;
pub mod table;
pub mod vmm;

use crate::config::Config;
use cuvisor_shm::ledger::{Denied, Ledger, MAX_DEVICES};
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering::*};
use table::Table;

/// Every allocation takes at least whole 512-byte units of device memory (cuMemAlloc's
/// alignment); a request is charged rounded up to that, so many small allocations cannot
/// together exceed the quota physically.
pub const GRANULE: u64 = 512;

pub fn charged_size(requested: u64) -> u64 {
    requested.div_ceil(GRANULE).saturating_mul(GRANULE)
}

/// CUDA ordinals we keep a resolved entry for (more would be a very large machine).
const MAX_ORDINALS: usize = 64;

/// `Quota::proc_slot` with no slot.
const NO_SLOT: usize = usize::MAX;

pub struct Quota {
    pub config: Config,
    pub ledger: Ledger,
    /// This process's slot in the ledger (a forked child takes its own: see `after_fork`);
    /// [`NO_SLOT`] once it was given back at exit (later charges are refused, later frees do
    /// nothing: the slot may be another process's by then).
    proc_slot: AtomicUsize,
    /// The process `proc_slot` belongs to. A child made by vfork() shares this memory and
    /// runs no fork handlers: if it calls exit(), the atexit handler runs here, in the child,
    /// on the parent's data, and must leave it alone.
    owner: AtomicU32,
    /// Per ledger device entry: the limit this process's own configuration gives it. Charges
    /// are held to it as well as to the entry's limit in the ledger, which the container can
    /// write.
    caps: [AtomicU64; MAX_DEVICES],
    /// CUDA ordinal -> ledger device entry + 1 (0: not resolved yet).
    entries: [AtomicU32; MAX_ORDINALS],
    /// Device pointers -> (entry, bytes).
    pub ptrs: Table,
    /// VMM physical handles, arrays and contexts -> (entry, bytes).
    pub handles: Table,
    /// Where charged VMM handles are mapped (a released handle stays charged while mapped).
    pub mappings: vmm::Mappings,
    /// Stream-ordered pools this process allocated from, charged by what they reserve.
    pub pools: pools::Pools,
    /// Loaded modules and libraries, charged by their variables.
    pub images: modules::Images,
    /// CUDA graph memory: each device's graph memory pool, charged by what it reserves.
    pub graph: graph::GraphMem,
    /// Memory shared with other processes (exported, imported) and the container's shares of
    /// the ledger this process holds.
    pub shared: shared::Shared,
    last_refusal_log: AtomicU64,
}

/// The ledger, as the rules of `shared` see it: this process's holds on the container's shares.
impl shared::Holds for Quota {
    fn open(&self, e: usize, bytes: u64, key: u64) -> Option<usize> {
        let slot = self.proc_slot.load(Relaxed);
        (slot != NO_SLOT)
            .then(|| self.ledger.share_open(e, slot, bytes, key))
            .flatten()
    }
    fn hold(&self, key: u64) -> Vec<usize> {
        self.ledger.share_hold(key)
    }
    fn widen(&self, share: usize, key: u64) {
        self.ledger.share_widen(share, key)
    }
    fn let_go(&self, share: usize) {
        self.ledger.share_let_go(share)
    }
}

/// A refused allocation, with what the message needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// Over the quota.
    Quota(Denied),
    /// The device has no ledger entry (all taken) or could not be identified.
    NoEntry,
    /// cuvisor's table of stream-ordered pools is full: a new pool cannot be accounted for.
    TooManyPools,
}

impl Quota {
    pub fn new(config: Config) -> Result<Quota, String> {
        let ledger = Ledger::open_dir_as(&config.state_dir, config.state_access)?;
        let (pid, start) = cuvisor_shm::process::me();
        let proc_slot = ledger.claim_proc(pid, start).ok_or_else(|| {
            format!(
                "ledger {}: all process slots are taken",
                ledger.path().display()
            )
        })?;
        Ok(Quota {
            config,
            ledger,
            proc_slot: AtomicUsize::new(proc_slot),
            owner: AtomicU32::new(pid),
            caps: std::array::from_fn(|_| AtomicU64::new(u64::MAX)),
            entries: std::array::from_fn(|_| AtomicU32::new(0)),
            ptrs: Table::new(1 << 20).ok_or("cannot reserve the allocation table")?,
            handles: Table::new(1 << 16).ok_or("cannot reserve the handle table")?,
            mappings: vmm::Mappings::default(),
            pools: pools::Pools::new(),
            images: modules::Images::default(),
            graph: graph::GraphMem::default(),
            shared: shared::Shared::default(),
            last_refusal_log: AtomicU64::new(0),
        })
    }

    /// In a child made by fork(): the parent's slot is the parent's, so the child claims its own
    /// (CUDA itself is unusable in a forked child, so it holds no charges to carry over). Without
    /// a description of its own the child claims nothing and is refused every allocation: a
    /// slot leased through the parent's description would look dead to the parent, and the
    /// parent's to the child.
    pub fn after_fork(&self) {
        self.shared.forget();
        let (pid, start) = cuvisor_shm::process::me();
        self.owner.store(pid, Relaxed);
        if let Err(e) = self.ledger.after_fork() {
            self.proc_slot.store(NO_SLOT, Relaxed);
            crate::log::error(&format!(
                "ledger {}: cannot reopen after fork ({e}): GPU memory allocations refused",
                self.ledger.path().display()
            ));
            return;
        }
        self.proc_slot.store(
            self.ledger.claim_proc(pid, start).unwrap_or(NO_SLOT),
            Relaxed,
        );
    }

    /// Whether the calling process is the one this state belongs to (false in a vfork child,
    /// which shares the parent's memory).
    pub fn is_owner(&self) -> bool {
        self.owner.load(Relaxed) == std::process::id()
    }

    /// At a normal exit: give back whatever this process still holds (only its own slot).
    /// The slot is let go first, so that a thread still charging or freeing meanwhile touches
    /// it no more.
    pub fn release_at_exit(&self) {
        if !self.is_owner() {
            return; // a vfork child's exit(): the slot and its charges are the parent's
        }
        let slot = self.proc_slot.swap(NO_SLOT, Relaxed);
        if slot != NO_SLOT && self.ledger.procs()[slot].pid.load(Relaxed) == std::process::id() {
            self.ledger.release_proc(slot);
        }
        // The shares this process held: given back now if nobody else holds them (the kernel
        // would drop the locks at exit anyway, but nobody would look until later).
        self.ledger.share_let_go_all();
    }

    /// The ledger entry of CUDA device `ordinal`; `uuid` asks the driver for its UUID the first
    /// time (then the answer is cached: one atomic load on the hot path).
    pub fn entry(&self, ordinal: i32, uuid: impl FnOnce() -> Option<[u8; 16]>) -> Option<usize> {
        let slot = self.entries.get(usize::try_from(ordinal).ok()?)?;
        match slot.load(Acquire) {
            0 => {
                let u = uuid()?;
                let limit = self.config.limit_for(ordinal as u32, &u);
                let e = self.ledger.device_for(u, limit)?;
                self.caps[e].fetch_min(limit, Relaxed);
                slot.store(e as u32 + 1, Release);
                Some(e)
            }
            n => Some(n as usize - 1),
        }
    }

    /// The ledger entry of a GPU known by UUID (NVML's view), created if this process has not
    /// touched it through CUDA yet. `ordinal` is NVML's index, for limits given by ordinal.
    pub fn entry_by_uuid(&self, uuid: [u8; 16], ordinal: u32) -> Option<usize> {
        let limit = self.config.limit_for(ordinal, &uuid);
        let e = match self.ledger.devices().find(|(_, u, _)| *u == uuid) {
            Some((i, _, _)) => i,
            None => self.ledger.device_for(uuid, limit)?,
        };
        self.caps[e].fetch_min(limit, Relaxed);
        Some(e)
    }

    /// Charges `bytes` on entry `e` before the driver allocates. A full quota first gives back
    /// what dead processes of the container still hold, then tries once more.
    pub fn charge(&self, e: usize, bytes: u64) -> Result<(), Refusal> {
        let slot = self.proc_slot.load(Relaxed);
        if slot == NO_SLOT {
            return Err(Refusal::NoEntry);
        }
        let cap = self.caps[e].load(Relaxed);
        match self.ledger.try_charge_capped(e, slot, bytes, cap) {
            Ok(()) => Ok(()),
            Err(_) if self.ledger.reclaim_dead() > 0 => self
                .ledger
                .try_charge_capped(e, slot, bytes, cap)
                .map_err(Refusal::Quota),
            Err(d) => Err(Refusal::Quota(d)),
        }
    }

    pub fn uncharge(&self, e: usize, bytes: u64) {
        let slot = self.proc_slot.load(Relaxed);
        if slot != NO_SLOT {
            self.ledger.uncharge(e, slot, bytes);
        }
    }

    /// Charges memory the driver has already handed out, above the quota if need be (see
    /// `pools`: the caller undoes the allocation right after).
    pub fn force_charge(&self, e: usize, bytes: u64) {
        let slot = self.proc_slot.load(Relaxed);
        if slot != NO_SLOT {
            self.ledger.force_charge(e, slot, bytes);
        }
    }

    /// Records what `key` was charged. If the table is full the charge stays (counted until the
    /// process exits) rather than be lost: the quota errs on the safe side.
    pub fn record(&self, table: &Table, key: u64, e: usize, bytes: u64) {
        if !table.insert(key, e, bytes) {
            crate::log::error(
                "allocation table full: this allocation stays charged until the process exits",
            );
        }
    }

    /// Gives back what `key` was charged; false if it was never charged here (imported memory,
    /// or allocated before cuvisor was loaded).
    pub fn release(&self, table: &Table, key: u64) -> bool {
        match table.remove(key) {
            // An IPC-exported pointer (see `shared`): its charge is its share's.
            Some((_, 0)) => {
                self.shared.freed(key, self);
                true
            }
            Some((e, bytes)) => {
                self.uncharge(e, bytes);
                true
            }
            None => false,
        }
    }

    /// VMM handle `h` was retained (cuMemRetainAllocationHandle), or exported when the ledger
    /// had no room for a share: an imported copy (in this process or another) keeps its
    /// memory alive after any release here, and no call tells when the last copy is gone. Its
    /// charge is taken out of the handle table, so no release or unmap gives it back: it stays
    /// charged until the process exits (see `vmm`).
    pub fn pin_exported(&self, h: u64) {
        let _ = self.handles.remove(h);
    }

    /// After a context was torn down, which frees what was allocated in it: gives back the
    /// charges of the keys `gone` says the driver no longer has. Only a definite answer counts;
    /// anything else keeps the charge (the quota errs on the safe side). Scans the whole table:
    /// for context teardown only, never an allocation path.
    pub fn sweep(&self, table: &Table, gone: impl Fn(u64) -> bool) -> usize {
        table
            .keys()
            .filter(|&k| gone(k) && self.release(table, k))
            .count()
    }

    /// What a program is shown for device entry `e`, given the physical (free, total):
    /// total = min(quota, physical), free = min(total - used, physical free), used.
    /// Never wraps: usage above the quota (a lowered limit) shows as free 0.
    pub fn view(&self, e: usize, phys_free: u64, phys_total: u64) -> MemView {
        let d = self.ledger.device(e);
        view(d.limit.load(Acquire), d.used_bytes(), phys_free, phys_total)
    }

    /// Reclaims dead processes' charges at most every 100 ms (for memory-info queries).
    pub fn reclaim_now_and_then(&self) {
        static LAST: AtomicU64 = AtomicU64::new(0);
        let now = now_ms();
        let last = LAST.load(Relaxed);
        if now.saturating_sub(last) >= 100
            && LAST.compare_exchange(last, now, Relaxed, Relaxed).is_ok()
        {
            self.ledger.reclaim_dead();
        }
    }

    /// One line on stderr for an allocation refused because its size cannot be computed, at
    /// most once a second (with the other refusals).
    pub fn log_unsized(&self, call: &str, why: &str) {
        if self.refusal_log_due() {
            crate::log::error(&format!("{call} refused: {why}"));
        }
    }

    /// Whether a refusal line may be printed now (at most one a second).
    fn refusal_log_due(&self) -> bool {
        let now = now_ms();
        let last = self.last_refusal_log.load(Relaxed);
        now.saturating_sub(last) >= 1000
            && self
                .last_refusal_log
                .compare_exchange(last, now, Relaxed, Relaxed)
                .is_ok()
    }

    /// One line on stderr for a refused allocation, at most once a second.
    pub fn log_refusal(&self, call: &str, ordinal: i32, requested: u64, why: Refusal) {
        if let Refusal::Quota(_) = why {
            if let Some(e) = self
                .entries
                .get(ordinal.max(0) as usize)
                .map(|s| s.load(Relaxed))
                .filter(|&n| n > 0)
            {
                self.ledger.note_denied(e as usize - 1);
            }
        }
        if self.refusal_log_due() {
            crate::log::error(&refusal_message(call, ordinal, requested, why));
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemView {
    pub free: u64,
    pub total: u64,
    pub used: u64,
}

pub fn view(limit: u64, used: u64, phys_free: u64, phys_total: u64) -> MemView {
    let total = limit.min(phys_total);
    let free = total.saturating_sub(used).min(phys_free);
    MemView {
        free,
        total,
        used: used.min(total),
    }
}

/// Bytes of a CUDA array (all mip levels), rounded up to 512 bytes: the size its format's
/// texel blocks give each level (cuda-abi's `array_bytes`: every format of the CUDA 13 headers,
/// checked arithmetic). Err (the line to print) where it cannot be computed, which is where the
/// driver refuses the descriptor too (an unknown format, a bad channel or level count, a zero
/// width, extents whose size overflows 64 bits): the allocation is refused, never passed through.
pub fn array_bytes(
    w: usize,
    h: usize,
    d: usize,
    format: i32,
    channels: u32,
    levels: u32,
) -> Result<u64, String> {
    cuvisor_cuda_abi::cuda::array_bytes(w as u64, h as u64, d as u64, format, channels, levels)
        .and_then(|b| b.checked_next_multiple_of(GRANULE))
        .ok_or_else(|| {
            format!(
                "an array of format {format:#x}, {channels} channel(s), {w} x {h} x {d}, \
                 {levels} level(s) has no size the driver would accept (CUDA_ERROR_INVALID_VALUE)"
            )
        })
}

pub fn refusal_message(call: &str, ordinal: i32, requested: u64, why: Refusal) -> String {
    match why {
        Refusal::Quota(d) => format!(
            "{call} of {} on GPU {ordinal} refused: {} of the {} quota in use, {} left",
            human(requested),
            human(d.used),
            human(d.limit),
            human(d.limit.saturating_sub(d.used))
        ),
        Refusal::NoEntry => format!(
            "{call} of {} on GPU {ordinal} refused: the container ledger has no room for this GPU",
            human(requested)
        ),
        Refusal::TooManyPools => format!(
            "{call} of {} on GPU {ordinal} refused: more than {} memory pools in use by this process",
            human(requested),
            pools::CAPACITY
        ),
    }
}

/// "1.50 GiB", "512.00 MiB", "300 B".
pub fn human(bytes: u64) -> String {
    const UNITS: [(&str, u64); 4] = [
        ("TiB", 1 << 40),
        ("GiB", 1 << 30),
        ("MiB", 1 << 20),
        ("KiB", 1 << 10),
    ];
    for (unit, size) in UNITS {
        if bytes >= size {
            return format!("{:.2} {unit}", bytes as f64 / size as f64);
        }
    }
    format!("{bytes} B")
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

const _: () = assert!(
    MAX_DEVICES < 256,
    "entry indices must fit the table's 8-bit field"
);

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::config::Target;

    /// A quota of `limit` on every device, with a scratch ledger of its own (also for
    /// `pools`' tests).
    pub(crate) fn quota(tag: &str, limit: u64) -> Quota {
        let dir = std::env::temp_dir().join(format!("cuvisor-quota-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        Quota::new(Config {
            limits: vec![(Target::All, limit)],
            caps: Vec::new(),
            state_dir: dir,
            state_access: crate::config::Access::Private,
            context_reserve: 0,
        })
        .unwrap()
    }

    #[test]
    fn the_view_never_wraps_or_exceeds_physical() {
        assert_eq!(
            view(6 << 30, 1 << 30, 15 << 30, 16 << 30),
            MemView {
                free: 5 << 30,
                total: 6 << 30,
                used: 1 << 30
            }
        );
        assert_eq!(
            view(6 << 30, 7 << 30, 15 << 30, 16 << 30).free,
            0,
            "over the limit (lowered): free 0, not a wrap"
        );
        assert_eq!(
            view(32 << 30, 0, 10 << 30, 16 << 30),
            MemView {
                free: 10 << 30,
                total: 16 << 30,
                used: 0
            },
            "quota above physical"
        );
        assert_eq!(
            view(6 << 30, 0, 1 << 30, 16 << 30).free,
            1 << 30,
            "others hold the card: physical free bounds it"
        );
    }

    #[test]
    fn charge_record_release_round_trip() {
        let q = quota("rt", 1000);
        let e = q.entry(0, || Some([7; 16])).unwrap();
        assert_eq!(q.entry(0, || panic!("cached")), Some(e));
        q.charge(e, 600).unwrap();
        q.record(&q.ptrs, 0x1000, e, 600);
        assert!(matches!(
            q.charge(e, 401),
            Err(Refusal::Quota(Denied {
                requested: 401,
                used: 600,
                limit: 1000
            }))
        ));
        assert!(q.release(&q.ptrs, 0x1000));
        assert!(!q.release(&q.ptrs, 0x1000), "released once");
        for k in 1..=3u64 {
            q.charge(e, 100).unwrap();
            q.record(&q.ptrs, k << 12, e, 100);
        }
        assert_eq!(
            q.sweep(&q.ptrs, |k| k == 2 << 12),
            1,
            "only what the driver lost"
        );
        assert_eq!(q.view(e, u64::MAX, u64::MAX).free, 800);
        assert_eq!(q.sweep(&q.ptrs, |_| false), 0);
        assert_eq!(q.sweep(&q.ptrs, |_| true), 2);
        assert_eq!(q.view(e, u64::MAX, u64::MAX).free, 1000);
        let _ = std::fs::remove_dir_all(&q.config.state_dir);
    }

    #[test]
    fn array_sizes() {
        assert_eq!(array_bytes(1024, 1024, 0, 0x20, 4, 1), Ok(16 << 20)); // float4
        assert_eq!(
            array_bytes(1024, 1024, 0, 1, 1, 3),
            Ok(1024 * 1024 + 512 * 512 + 256 * 256)
        );
        assert_eq!(array_bytes(10, 0, 0, 1, 1, 1), Ok(512), "rounded up to 512");
        assert_eq!(
            array_bytes(1920, 1080, 0, 0xb0, 1, 1),
            Ok((1920 * 1080 * 3 / 2u64).next_multiple_of(512)),
            "NV12: 12 bits a pixel"
        );
    }

    /// The sizes the library cannot compute are refusals, with the line to print.
    #[test]
    fn arrays_it_cannot_size_are_errors() {
        let err = array_bytes(1, 1, 1, 0x7777, 1, 1).unwrap_err();
        assert!(err.contains("format 0x7777"), "{err}");
        assert!(array_bytes(1 << 40, 1 << 40, 1 << 40, 0x20, 4, 1).is_err());
        assert!(
            array_bytes(1 << 62, 2, 0, 0x20, 4, 2).is_err(),
            "levels overflow"
        );
    }

    #[test]
    fn the_refusal_names_request_quota_and_use() {
        let m = refusal_message(
            "cuMemAlloc_v2",
            0,
            2 << 30,
            Refusal::Quota(Denied {
                requested: 2 << 30,
                used: 5 << 30,
                limit: 6 << 30,
            }),
        );
        assert_eq!(m, "cuMemAlloc_v2 of 2.00 GiB on GPU 0 refused: 5.00 GiB of the 6.00 GiB quota in use, 1.00 GiB left");
        assert_eq!(human(300), "300 B");
    }
}
