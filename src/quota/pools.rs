//! Stream-ordered memory pools, charged by what they reserve.
//!
//! A pool (cuMemPoolCreate, or a device's default pool behind cuMemAllocAsync) takes device
//! memory in granules and keeps what is freed reserved until a synchronization point, and for
//! good up to its release threshold. What a pool hands out says little about what it holds, so
//! the quota charges each pool's reserve (`CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT`, asked from the
//! driver), never its allocations:
//!
//! - **allocation**: a tentative charge first, the request rounded up to the pool granule (the
//!   most one allocation grows a pool by); the driver allocates; the pool's reserve is read and
//!   the pool's charge rises to it. The tentative charge is replaced by the pool's real growth.
//!   Growth beyond the tentative charge that the quota cannot cover is refused after the fact:
//!   the caller frees the allocation and trims the pool.
//! - **frees** (cuMemFreeAsync, cuMemFree of a pool pointer) give nothing back by themselves.
//! - **settling** re-reads the reserves and gives back what pools no longer hold: at
//!   synchronization points, trims, threshold changes, context teardown, memory queries (at most
//!   every 100 ms) and before an allocation is refused for the quota. When the quota is full and
//!   memory was freed into pools since, they are trimmed first (their unused reserve is the
//!   quota's, not the pool's to keep).
//! - **destroying** a pool with allocations outstanding: the driver keeps its memory until they
//!   are freed (cuMemPoolDestroy's documented behaviour) and the handle can no longer be asked
//!   about it. So cuvisor puts the destroy off: the pool is gone for the program, lives in the
//!   driver, stays charged by its reserve, and is destroyed for real at the first settling that
//!   finds nothing outstanding.
//!
//! Concurrency: one word per pool holds its charge, the allocations in flight on it and a
//! generation, so that allocators settle lock-free (two threads growing one pool are charged
//! once: the charge rises to the reserve read, it does not add up growths), and a settler lowers
//! a charge only if nothing committed since it read the reserve (a CAS on the whole word: the
//! generation moves with every commit). An allocation whose reserve read includes another
//! in-flight allocation's growth pays only its own bound and leaves the rest to that one.
//! Settlers run one at a time (a mutex: settling is not a hot path). A process that never uses
//! pools pays one atomic load, on refusals and memory queries only.
//!
//! No FFI here: the hook answers [`PoolDriver`] from the real driver; the tests below from a
//! model of it.

use super::{Quota, Refusal};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, AtomicU64, AtomicUsize, Ordering::*};
use std::sync::Mutex;

/// What the pool rules ask the driver.
pub trait PoolDriver {
    /// The pool's reserved bytes now (`CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT`); None when the
    /// driver does not say.
    fn reserved(&self, pool: u64) -> Option<u64>;
    /// The bytes allocated from it and not yet freed (`CU_MEMPOOL_ATTR_USED_MEM_CURRENT`).
    fn used(&self, pool: u64) -> Option<u64>;
    /// Releases the pool's unused reserve (`cuMemPoolTrimTo(pool, 0)`).
    fn trim(&self, pool: u64);
    /// Destroys a pool whose destroy was put off; true when the driver did.
    fn destroy(&self, pool: u64) -> bool;
}

/// The most one allocation can grow a pool by is the request rounded up to this (the pool
/// granularity of current GPUs, and the simulator's).
pub const POOL_GRANULE: u64 = 2 << 20;

/// Pools this process can have charged at once. A pool beyond that is refused (fail closed).
pub const CAPACITY: usize = 4096;

const UNIT: u64 = super::GRANULE; // charges are kept in 512-byte units
const UNITS_MASK: u64 = (1 << 36) - 1; // 32 TiB per pool
const INFLIGHT_SHIFT: u32 = 36;
const INFLIGHT_MAX: u64 = (1 << 11) - 1;
const DEAD: u64 = 1 << 47;
const GEN_SHIFT: u32 = 48;

fn units(w: u64) -> u64 {
    w & UNITS_MASK
}
fn inflight(w: u64) -> u64 {
    (w >> INFLIGHT_SHIFT) & INFLIGHT_MAX
}
/// `w` with `units` charged, `inflight` allocations in flight and the generation moved on.
fn next(w: u64, units: u64, inflight: u64) -> u64 {
    let generation = (w >> GEN_SHIFT).wrapping_add(1) << GEN_SHIFT;
    generation | (w & DEAD) | (inflight << INFLIGHT_SHIFT) | units.min(UNITS_MASK)
}
fn to_units(bytes: u64) -> u64 {
    bytes.div_ceil(UNIT)
}

const EMPTY: u64 = 0;
const TOMB: u64 = u64::MAX;
const BUSY: u64 = u64::MAX - 1;

const LIVE: u32 = 0;
/// Destroyed for the program, alive in the driver until its allocations are freed.
const PUT_OFF: u32 = 1;

#[derive(Default)]
struct Slot {
    key: AtomicU64,
    entry: AtomicU32,
    ordinal: AtomicI32,
    state: AtomicU32,
    word: AtomicU64,
}

pub struct Pools {
    slots: Box<[Slot]>,
    /// Keys in the table: 0 for a process that never used pools (the only cost it pays).
    live: AtomicUsize,
    /// Memory may have been freed into a pool since the last trim under pressure.
    freed: AtomicBool,
    last_settle_ms: AtomicU64,
    settler: Mutex<()>,
    registering: Mutex<()>,
}

/// An allocation from a pool, charged its bound, between the driver call and its settling.
#[derive(Debug)]
pub struct Ticket {
    slot: usize,
    entry: usize,
    /// The tentative charge, in units.
    tentative: u64,
}

/// Why an allocation from a pool cannot start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Denial {
    /// The quota (or the table of pools) has no room: CUDA_ERROR_OUT_OF_MEMORY.
    Refused(Refusal),
    /// The program destroyed the pool: CUDA_ERROR_INVALID_VALUE, as the driver would say.
    Destroyed,
}

/// What to do with cuMemPoolDestroy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Destroy {
    /// Nothing outstanding (or a pool cuvisor does not know): destroy it now, then call
    /// [`Quota::pool_destroyed`].
    Now,
    /// Allocations outstanding: put off (the caller resets the device's current pool if it was
    /// this one and answers success).
    PutOff,
    /// Already destroyed by the program: CUDA_ERROR_INVALID_VALUE.
    Again,
}

fn hash(k: u64) -> usize {
    (k.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 20) as usize
}

impl Default for Pools {
    fn default() -> Self {
        Pools::new()
    }
}

impl Pools {
    pub fn new() -> Pools {
        Pools {
            slots: (0..CAPACITY).map(|_| Slot::default()).collect(),
            live: AtomicUsize::new(0),
            freed: AtomicBool::new(false),
            last_settle_ms: AtomicU64::new(0),
            settler: Mutex::new(()),
            registering: Mutex::new(()),
        }
    }

    /// Whether this process has any pool on record (one load).
    #[inline]
    pub fn any(&self) -> bool {
        self.live.load(Relaxed) > 0
    }

    /// A pointer cuvisor did not record was freed: perhaps into a pool.
    #[inline]
    pub fn note_free(&self) {
        if self.any() {
            self.freed.store(true, Relaxed);
        }
    }

    fn find(&self, pool: u64) -> Option<usize> {
        let mut i = hash(pool) % CAPACITY;
        for _ in 0..CAPACITY {
            match self.slots[i].key.load(Acquire) {
                k if k == pool => return Some(i),
                EMPTY => return None,
                _ => i = (i + 1) % CAPACITY,
            }
        }
        None
    }

    /// The slot of `pool`, recorded as memory of ledger entry `entry` (CUDA device `ordinal`)
    /// if new. None when the table is full. Finding is lock-free; recording a new pool (once
    /// per pool) takes a lock, so that two threads meeting a new pool record it once.
    pub fn register(&self, pool: u64, entry: usize, ordinal: i32) -> Option<usize> {
        if pool == EMPTY || pool == TOMB || pool == BUSY {
            return None;
        }
        if let Some(i) = self.find(pool) {
            return Some(i);
        }
        let _one_at_a_time = self.registering.lock().unwrap_or_else(|e| e.into_inner());
        let mut i = hash(pool) % CAPACITY;
        let mut free = None;
        for _ in 0..CAPACITY {
            match self.slots[i].key.load(Acquire) {
                k if k == pool => return Some(i),
                EMPTY => {
                    free = free.or(Some(i));
                    break;
                }
                TOMB => free = free.or(Some(i)),
                _ => {}
            }
            i = (i + 1) % CAPACITY;
        }
        let i = free?;
        let s = &self.slots[i];
        // Only inserts change EMPTY or TOMB, and they hold the lock.
        s.key.store(BUSY, Release);
        let w = s.word.load(Acquire);
        s.word.store(next(w, 0, 0) & !DEAD, Release);
        s.entry.store(entry as u32, Relaxed);
        s.ordinal.store(ordinal, Relaxed);
        s.state.store(LIVE, Relaxed);
        s.key.store(pool, Release);
        self.live.fetch_add(1, Relaxed);
        Some(i)
    }

    /// Ledger entry and CUDA ordinal of a pool on record.
    pub fn device_of(&self, pool: u64) -> Option<(usize, i32)> {
        let s = &self.slots[self.find(pool)?];
        Some((s.entry.load(Relaxed) as usize, s.ordinal.load(Relaxed)))
    }

    /// The charged pools (handle, slot) — optionally only `only`, or those of ledger entry `on`.
    fn charged(&self, only: Option<u64>, on: Option<usize>) -> Vec<(u64, usize)> {
        let pick = |i: usize| {
            let s = &self.slots[i];
            let k = s.key.load(Acquire);
            let relevant = k != EMPTY && k != TOMB && k != BUSY;
            let on_entry = on.is_none_or(|e| s.entry.load(Relaxed) as usize == e);
            let w = s.word.load(Acquire);
            (relevant
                && on_entry
                && w & DEAD == 0
                && (units(w) > 0 || s.state.load(Relaxed) == PUT_OFF))
                .then_some((k, i))
        };
        match only {
            Some(p) => self.find(p).and_then(pick).into_iter().collect(),
            None if self.any() => (0..CAPACITY).filter_map(pick).collect(),
            None => Vec::new(),
        }
    }
}

impl Quota {
    /// Charges `bytes` on entry `e` for any allocation; a full quota first settles the pools
    /// (at most every 100 ms: nothing else lowers their reserves unseen) and, if memory was
    /// freed into pools since, trims those of this device, then tries once more.
    #[inline]
    pub fn charge_making_room(
        &self,
        e: usize,
        bytes: u64,
        d: &impl PoolDriver,
    ) -> Result<(), Refusal> {
        match self.charge(e, bytes) {
            Err(Refusal::Quota(_)) if self.pools.any() => {
                self.settle_pools_now_and_then(d);
                if let r @ Ok(()) = self.charge(e, bytes) {
                    return r;
                }
                if self.pools.freed.swap(false, Relaxed) {
                    for (pool, _) in self.pools.charged(None, Some(e)) {
                        d.trim(pool);
                    }
                    self.try_settle_pools(d);
                }
                self.charge(e, bytes)
            }
            r => r,
        }
    }

    /// Before the driver allocates `size` bytes from `pool`: records the pool (as memory of
    /// entry `entry`, device `ordinal`, if new) and charges the most the allocation can grow it
    /// by. The caller calls [`Quota::pool_commit`] after a successful driver call, or
    /// [`Quota::pool_abort`] after a failed one.
    pub fn pool_begin(
        &self,
        pool: u64,
        entry: usize,
        ordinal: i32,
        size: u64,
        d: &impl PoolDriver,
    ) -> Result<Ticket, Denial> {
        let bound = size.div_ceil(POOL_GRANULE).saturating_mul(POOL_GRANULE);
        let slot = self
            .pools
            .register(pool, entry, ordinal)
            .ok_or(Denial::Refused(Refusal::TooManyPools))?;
        let s = &self.pools.slots[slot];
        let entry = s.entry.load(Relaxed) as usize;
        self.charge_making_room(entry, bound, d)
            .map_err(Denial::Refused)?;
        let t = Ticket {
            slot,
            entry,
            tentative: to_units(bound),
        };
        match self.enter(&t, pool) {
            Ok(()) => Ok(t),
            Err(why) => {
                self.uncharge(entry, bound);
                Err(why)
            }
        }
    }

    /// Counts an allocation in flight on the ticket's slot, if it still holds `pool`.
    fn enter(&self, t: &Ticket, pool: u64) -> Result<(), Denial> {
        let s = &self.pools.slots[t.slot];
        let mut w = s.word.load(Acquire);
        loop {
            if w & DEAD != 0 || s.key.load(Acquire) != pool {
                return Err(Denial::Destroyed);
            }
            if inflight(w) == INFLIGHT_MAX {
                return Err(Denial::Refused(Refusal::TooManyPools));
            }
            match s
                .word
                .compare_exchange(w, next(w, units(w), inflight(w) + 1), AcqRel, Acquire)
            {
                Ok(_) => break,
                Err(now) => w = now,
            }
        }
        // The slot cannot be freed while we are in flight; it must still be this pool's.
        if s.key.load(Acquire) != pool || s.state.load(Acquire) == PUT_OFF {
            self.leave(t, 0);
            return Err(Denial::Destroyed);
        }
        Ok(())
    }

    /// No longer in flight, the pool's charge raised by `add` units.
    fn leave(&self, t: &Ticket, add: u64) {
        let s = &self.pools.slots[t.slot];
        let _ = s.word.fetch_update(AcqRel, Acquire, |w| {
            Some(next(w, units(w) + add, inflight(w).saturating_sub(1)))
        });
    }

    /// The driver failed the allocation: the tentative charge goes back.
    pub fn pool_abort(&self, t: Ticket) {
        self.leave(&t, 0);
        self.uncharge(t.entry, t.tentative * UNIT);
    }

    /// The driver allocated; `reserved` is the pool's reserve read after it. The pool's charge
    /// rises to it, paid by the tentative charge (the rest of which goes back). Err: the pool
    /// grew by more than the tentative charge and the quota has no room for the difference —
    /// it is charged anyway (it is held), and the caller frees the allocation, trims the pool,
    /// settles and refuses.
    pub fn pool_commit(&self, t: Ticket, reserved: Option<u64>) -> Result<(), Refusal> {
        let s = &self.pools.slots[t.slot];
        let Some(r) = reserved.map(to_units) else {
            // The driver does not say what the pool holds: the tentative charge stays on it.
            self.leave(&t, t.tentative);
            return Ok(());
        };
        loop {
            let w = s.word.load(Acquire);
            let c = units(w);
            let need = r.saturating_sub(c);
            // All the growth this commit sees is paid now, even what another allocation still
            // in flight will find already paid when it commits (it then pays nothing and gets
            // its bound back). Leaving part of it to the others undercounted: another's read of
            // the reserve may predate this growth, and it would commit with the stale value.
            // Near the quota this can refuse an allocation the others' bounds would have
            // covered; it never lets the ledger show less than the pool holds.
            let (add, extra) = if need <= t.tentative {
                (need, 0)
            } else {
                (need, need - t.tentative)
            };
            let mut over = None;
            if extra > 0 {
                if let Err(why) = self.charge(t.entry, extra * UNIT) {
                    self.force_charge(t.entry, extra * UNIT);
                    over = Some(why);
                }
            }
            let new = next(w, c + add, inflight(w).saturating_sub(1));
            if s.word.compare_exchange(w, new, AcqRel, Acquire).is_ok() {
                let refund = t.tentative + extra - add;
                if refund > 0 {
                    self.uncharge(t.entry, refund * UNIT);
                }
                return over.map_or(Ok(()), Err);
            }
            if extra > 0 {
                self.uncharge(t.entry, extra * UNIT);
            }
        }
    }

    /// An allocation the driver made from a pool other than the one it was charged for (a
    /// stream of another device): it pays all the growth of `pool` it finds, on its own entry.
    pub fn pool_commit_unplanned(
        &self,
        pool: u64,
        entry: usize,
        ordinal: i32,
        reserved: Option<u64>,
    ) -> Result<(), Refusal> {
        let slot = self
            .pools
            .register(pool, entry, ordinal)
            .ok_or(Refusal::TooManyPools)?;
        let t = Ticket {
            slot,
            entry: self.pools.slots[slot].entry.load(Relaxed) as usize,
            tentative: 0,
        };
        self.enter(&t, pool).map_err(|_| Refusal::TooManyPools)?;
        // Without an answer from the driver, nothing is known to have grown: keep what is.
        self.pool_commit(t, reserved.or(Some(0)))
    }

    /// Gives back what the pools (or only `only`) no longer reserve, and destroys the pools
    /// whose destroy was put off and that have nothing outstanding any more.
    pub fn settle_pools(&self, d: &impl PoolDriver, only: Option<u64>) {
        if !self.pools.any() {
            return;
        }
        let one_at_a_time = self.pools.settler.lock().unwrap_or_else(|e| e.into_inner());
        self.settle_locked(d, only, one_at_a_time);
    }

    /// [`Quota::settle_pools`] of every pool, unless another thread is settling (then it does
    /// the work): for the allocation path, which must not wait on a lock (one a thread held when
    /// the process forked would never be let go in the child).
    fn try_settle_pools(&self, d: &impl PoolDriver) {
        match self.pools.settler.try_lock() {
            Ok(g) => self.settle_locked(d, None, g),
            Err(std::sync::TryLockError::Poisoned(e)) => {
                self.settle_locked(d, None, e.into_inner())
            }
            Err(std::sync::TryLockError::WouldBlock) => {}
        }
    }

    fn settle_locked(
        &self,
        d: &impl PoolDriver,
        only: Option<u64>,
        _g: std::sync::MutexGuard<'_, ()>,
    ) {
        if only.is_none() {
            self.pools.last_settle_ms.store(super::now_ms(), Relaxed);
        }
        for (pool, i) in self.pools.charged(only, None) {
            let s = &self.pools.slots[i];
            // A destroy put off happens once nothing is outstanding; until then the pool's
            // reserve is settled like any pool's below.
            if s.state.load(Acquire) == PUT_OFF && d.used(pool) == Some(0) && d.destroy(pool) {
                self.remove_slot(i, pool, true);
                continue;
            }
            for _ in 0..8 {
                let w = s.word.load(Acquire);
                let Some(r) = d.reserved(pool).map(to_units) else {
                    break;
                };
                if r >= units(w) {
                    break; // only commits raise a charge
                }
                let new = next(w, r, inflight(w));
                if s.word.compare_exchange(w, new, AcqRel, Acquire).is_ok() {
                    self.uncharge(s.entry.load(Relaxed) as usize, (units(w) - r) * UNIT);
                    break;
                }
                // Something committed since the reserve was read: read it again.
            }
        }
    }

    /// [`Quota::settle_pools`] for memory queries and refusals: at most every 100 ms.
    pub fn settle_pools_now_and_then(&self, d: &impl PoolDriver) {
        if !self.pools.any() {
            return;
        }
        let last = self.pools.last_settle_ms.load(Relaxed);
        if super::now_ms().saturating_sub(last) >= 100 {
            self.try_settle_pools(d);
        }
    }

    /// Frees slot `i` of `pool` once nothing is in flight on it, giving its charge back (or,
    /// with `give_back` false, leaving it charged until the process exits). Under the settler
    /// lock. False if the slot no longer holds `pool`.
    fn remove_slot(&self, i: usize, pool: u64, give_back: bool) -> bool {
        let s = &self.pools.slots[i];
        let taken = loop {
            if s.key.load(Acquire) != pool {
                return false;
            }
            let w = s.word.load(Acquire);
            if inflight(w) > 0 {
                // An allocation from a pool being destroyed (the program's race): it ends soon.
                std::thread::yield_now();
                continue;
            }
            if s.word
                .compare_exchange(w, next(w, 0, 0) | DEAD, AcqRel, Acquire)
                .is_ok()
            {
                break units(w);
            }
        };
        if give_back && taken > 0 {
            self.uncharge(s.entry.load(Relaxed) as usize, taken * UNIT);
        }
        s.state.store(LIVE, Relaxed);
        s.key.store(TOMB, Release);
        self.pools.live.fetch_sub(1, Relaxed);
        true
    }

    /// cuMemPoolDestroy of `pool`, before the driver is asked: destroy it now, put it off, or
    /// refuse it (destroyed already).
    pub fn pool_destroy(&self, pool: u64, d: &impl PoolDriver) -> Destroy {
        let Some(i) = self.pools.find(pool) else {
            return Destroy::Now;
        };
        let s = &self.pools.slots[i];
        if s.state.load(Acquire) == PUT_OFF {
            return Destroy::Again;
        }
        if d.used(pool) == Some(0) {
            return Destroy::Now;
        }
        if s.state
            .compare_exchange(LIVE, PUT_OFF, AcqRel, Acquire)
            .is_err()
        {
            return Destroy::Again;
        }
        // A put-off pool stays on the settling list (`charged`) even with nothing charged.
        Destroy::PutOff
    }

    /// The driver destroyed `pool` (nothing outstanding): its charge goes back.
    pub fn pool_destroyed(&self, pool: u64) {
        let Some(i) = self.pools.find(pool) else {
            return;
        };
        let _g = self.pools.settler.lock().unwrap_or_else(|e| e.into_inner());
        self.remove_slot(i, pool, true);
    }

    /// What pool `pool` is charged now (for tests and metrics).
    pub fn pool_charge(&self, pool: u64) -> Option<u64> {
        let i = self.pools.find(pool)?;
        Some(units(self.pools.slots[i].word.load(Acquire)) * UNIT)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::sync::Arc;

    const MIB: u64 = 1 << 20;

    fn quota(tag: &str, limit: u64) -> Quota {
        crate::quota::tests::quota(&format!("pools-{tag}"), limit)
    }

    fn used(q: &Quota, e: usize) -> u64 {
        q.ledger.device(e).used_bytes()
    }

    /// A model of the driver's pools, as the simulator has them: growth in `chunk` steps
    /// (2 MiB: the granule), frees kept reserved, trims down to max(used, keep).
    #[derive(Default)]
    struct Model {
        pools: Mutex<HashMap<u64, (u64, u64, u64)>>, // (reserved, used, threshold)
        chunk: u64,
        destroyed: Mutex<Vec<u64>>,
    }

    impl Model {
        fn new(chunk: u64) -> Model {
            Model {
                chunk,
                ..Model::default()
            }
        }
        fn create(&self, pool: u64) {
            self.pools.lock().unwrap().insert(pool, (0, 0, 0));
        }
        fn alloc(&self, pool: u64, bytes: u64) {
            let mut m = self.pools.lock().unwrap();
            let p = m.get_mut(&pool).unwrap();
            let spare = p.0 - p.1;
            if spare < bytes {
                p.0 += (bytes - spare).div_ceil(self.chunk) * self.chunk;
            }
            p.1 += bytes;
        }
        fn free(&self, pool: u64, bytes: u64) {
            self.pools.lock().unwrap().get_mut(&pool).unwrap().1 -= bytes;
        }
        fn trim_to(&self, pool: u64, keep: u64) {
            let mut m = self.pools.lock().unwrap();
            let p = m.get_mut(&pool).unwrap();
            let floor = p.1.max(keep).div_ceil(POOL_GRANULE) * POOL_GRANULE;
            p.0 = p.0.min(floor.max(p.1));
        }
        fn sync(&self) {
            let keys: Vec<(u64, u64)> = self
                .pools
                .lock()
                .unwrap()
                .iter()
                .map(|(k, p)| (*k, p.2))
                .collect();
            for (k, t) in keys {
                self.trim_to(k, t);
            }
        }
        fn total(&self) -> u64 {
            self.pools.lock().unwrap().values().map(|p| p.0).sum()
        }
    }

    impl PoolDriver for Model {
        fn reserved(&self, pool: u64) -> Option<u64> {
            self.pools.lock().unwrap().get(&pool).map(|p| p.0)
        }
        fn used(&self, pool: u64) -> Option<u64> {
            self.pools.lock().unwrap().get(&pool).map(|p| p.1)
        }
        fn trim(&self, pool: u64) {
            self.trim_to(pool, 0);
        }
        fn destroy(&self, pool: u64) -> bool {
            self.destroyed.lock().unwrap().push(pool);
            self.pools.lock().unwrap().remove(&pool).is_some()
        }
    }

    /// Allocates through the rules: begin, the model allocates, commit. Ok(true) = held.
    fn alloc(q: &Quota, m: &Model, pool: u64, e: usize, bytes: u64) -> Result<(), Denial> {
        let t = q.pool_begin(pool, e, 0, bytes, m)?;
        m.alloc(pool, bytes);
        q.pool_commit(t, m.reserved(pool)).map_err(|r| {
            m.free(pool, bytes);
            m.trim(pool);
            q.settle_pools(m, Some(pool));
            Denial::Refused(r)
        })
    }

    #[test]
    fn a_pool_is_charged_its_reserve_and_frees_give_nothing_back() {
        let q = quota("reserve", 64 * MIB);
        let e = q.entry(0, || Some([1; 16])).unwrap();
        let m = Model::new(POOL_GRANULE);
        m.create(0x1000);
        alloc(&q, &m, 0x1000, e, 512).unwrap();
        assert_eq!(used(&q, e), 2 * MIB, "512 bytes reserve a granule");
        alloc(&q, &m, 0x1000, e, 3 * MIB).unwrap();
        assert_eq!(m.reserved(0x1000), Some(4 * MIB));
        assert_eq!(
            used(&q, e),
            4 * MIB,
            "the reserve, not the sum of the bounds"
        );
        m.free(0x1000, 3 * MIB);
        q.settle_pools(&m, None);
        assert_eq!(
            used(&q, e),
            4 * MIB,
            "freed memory stays reserved until a sync"
        );
        m.sync();
        q.settle_pools(&m, None);
        assert_eq!(used(&q, e), 2 * MIB, "what the sync released is given back");
        m.free(0x1000, 512);
        m.sync();
        q.settle_pools(&m, None);
        assert_eq!(used(&q, e), 0);
        assert_eq!(q.pool_charge(0x1000), Some(0));
        q.pool_destroyed(0x1000);
        assert!(!q.pools.any());
        let _ = std::fs::remove_dir_all(&q.config.state_dir);
    }

    #[test]
    fn many_pools_of_one_small_allocation_stop_at_the_quota() {
        let q = quota("many", 64 * MIB);
        let e = q.entry(0, || Some([2; 16])).unwrap();
        let m = Model::new(POOL_GRANULE);
        let mut fitted = 0;
        for p in 1..=100u64 {
            m.create(p << 12);
            if alloc(&q, &m, p << 12, e, 512).is_ok() {
                fitted += 1;
            }
            assert!(m.total() <= 64 * MIB);
        }
        assert_eq!(fitted, 32);
        let _ = std::fs::remove_dir_all(&q.config.state_dir);
    }

    #[test]
    fn a_full_quota_trims_pools_that_keep_freed_memory() {
        let q = quota("trim", 64 * MIB);
        let e = q.entry(0, || Some([3; 16])).unwrap();
        let m = Model::new(POOL_GRANULE);
        m.create(0x1000);
        m.pools.lock().unwrap().get_mut(&0x1000).unwrap().2 = 1 << 50;
        alloc(&q, &m, 0x1000, e, 48 * MIB).unwrap();
        m.free(0x1000, 48 * MIB);
        m.sync();
        q.settle_pools(&m, None);
        assert_eq!(
            used(&q, e),
            48 * MIB,
            "the threshold keeps it, so does the quota"
        );
        // Without a free since, a refusal does not trim.
        assert!(matches!(
            q.charge_making_room(e, 32 * MIB, &m),
            Err(Refusal::Quota(_))
        ));
        assert_eq!(m.reserved(0x1000), Some(48 * MIB));
        q.pools.note_free();
        q.charge_making_room(e, 32 * MIB, &m).unwrap();
        assert_eq!(m.reserved(0x1000), Some(0), "trimmed to make room");
        assert_eq!(used(&q, e), 32 * MIB);
        let _ = std::fs::remove_dir_all(&q.config.state_dir);
    }

    #[test]
    fn growth_beyond_the_bound_is_charged_and_refused_when_it_does_not_fit() {
        let q = quota("chunky", 64 * MIB);
        let e = q.entry(0, || Some([4; 16])).unwrap();
        // A driver that grows pools in 32 MiB chunks: more than the 2 MiB-rounded bound.
        let m = Model::new(32 * MIB);
        m.create(0x1000);
        alloc(&q, &m, 0x1000, e, MIB).unwrap();
        assert_eq!(
            used(&q, e),
            32 * MIB,
            "the real growth, though more than the bound"
        );
        m.create(0x2000);
        alloc(&q, &m, 0x2000, e, MIB).unwrap();
        assert_eq!(used(&q, e), 64 * MIB);
        m.create(0x3000);
        assert!(matches!(
            alloc(&q, &m, 0x3000, e, MIB),
            Err(Denial::Refused(Refusal::Quota(_)))
        ));
        // The bound itself did not fit (the quota is full): refused before the driver.
        assert_eq!(m.reserved(0x3000), Some(0));
        m.free(0x2000, MIB);
        m.sync();
        q.settle_pools(&m, None);
        assert_eq!(
            used(&q, e),
            2 * MIB,
            "the sync trimmed 0x1000 to the granule its 1 MiB needs"
        );
        // Room for the bound (2 MiB) but not the growth (32 MiB beside 2 + 40 MiB used).
        q.charge(e, 40 * MIB).unwrap();
        assert!(matches!(
            alloc(&q, &m, 0x3000, e, MIB),
            Err(Denial::Refused(Refusal::Quota(_)))
        ));
        assert_eq!(m.reserved(0x3000), Some(0), "freed and trimmed again");
        assert_eq!(used(&q, e), 42 * MIB, "and its charge gone with it");
        let _ = std::fs::remove_dir_all(&q.config.state_dir);
    }

    #[test]
    fn a_destroy_with_allocations_outstanding_is_put_off_until_they_are_freed() {
        let q = quota("putoff", 64 * MIB);
        let e = q.entry(0, || Some([5; 16])).unwrap();
        let m = Model::new(POOL_GRANULE);
        m.create(0x1000);
        alloc(&q, &m, 0x1000, e, 8 * MIB).unwrap();
        assert_eq!(q.pool_destroy(0x1000, &m), Destroy::PutOff);
        assert_eq!(q.pool_destroy(0x1000, &m), Destroy::Again);
        assert_eq!(
            q.pool_begin(0x1000, e, 0, MIB, &m).unwrap_err(),
            Denial::Destroyed
        );
        q.settle_pools(&m, None);
        assert_eq!(
            used(&q, e),
            8 * MIB,
            "outstanding: still charged, still alive"
        );
        assert!(m.destroyed.lock().unwrap().is_empty());
        m.free(0x1000, 8 * MIB);
        q.settle_pools(&m, None);
        assert_eq!(
            *m.destroyed.lock().unwrap(),
            vec![0x1000],
            "destroyed for real now"
        );
        assert_eq!(used(&q, e), 0);
        assert!(!q.pools.any());
        // An unused pool is destroyed at once.
        m.create(0x2000);
        alloc(&q, &m, 0x2000, e, MIB).unwrap();
        m.free(0x2000, MIB);
        assert_eq!(q.pool_destroy(0x2000, &m), Destroy::Now);
        assert!(m.destroy(0x2000));
        q.pool_destroyed(0x2000);
        assert_eq!(used(&q, e), 0);
        let _ = std::fs::remove_dir_all(&q.config.state_dir);
    }

    #[test]
    fn the_table_reuses_freed_slots_and_refuses_when_full() {
        let p = Pools::new();
        for k in 1..=CAPACITY as u64 {
            assert!(p.register(k << 12, 0, 0).is_some());
        }
        assert_eq!(p.register(0xdead_0000, 0, 0), None, "full");
        assert_eq!(
            p.register(5 << 12, 0, 0),
            p.find(5 << 12),
            "known pools still resolve"
        );
        let q = quota("table", 64 * MIB);
        q.pools.register(0x1000, 0, 0).unwrap();
        q.pool_destroyed(0x1000);
        assert_eq!(q.pools.find(0x1000), None);
        let i = q.pools.register(0x2000, 3, 1).unwrap();
        assert_eq!(q.pools.device_of(0x2000), Some((3, 1)));
        assert_eq!(q.pools.slots[i].word.load(Relaxed) & (DEAD | UNITS_MASK), 0);
        let _ = std::fs::remove_dir_all(&q.config.state_dir);
    }

    /// Two allocations in flight on one pool, each reading a reserve that holds both growths:
    /// the pool is charged its reserve once, never the sum, and never less along the way.
    #[test]
    fn two_allocations_in_flight_on_one_pool_are_charged_once() {
        let q = quota("once", 64 * MIB);
        let e = q.entry(0, || Some([7; 16])).unwrap();
        let m = Model::new(POOL_GRANULE);
        m.create(0x1000);
        for first_commits_first in [true, false] {
            let a = q.pool_begin(0x1000, e, 0, 3 * MIB, &m).unwrap();
            let b = q.pool_begin(0x1000, e, 0, 5 * MIB, &m).unwrap();
            m.alloc(0x1000, 3 * MIB);
            m.alloc(0x1000, 5 * MIB);
            let r = m.reserved(0x1000);
            let (x, y) = if first_commits_first { (a, b) } else { (b, a) };
            q.pool_commit(x, r).unwrap();
            assert!(used(&q, e) >= r.unwrap(), "never below the reserve");
            q.pool_commit(y, r).unwrap();
            assert_eq!(Some(used(&q, e)), r, "once: the reserve, not the sum");
            m.free(0x1000, 8 * MIB);
            m.sync();
            q.settle_pools(&m, None);
            assert_eq!(used(&q, e), 0);
        }
        let _ = std::fs::remove_dir_all(&q.config.state_dir);
    }

    /// Two threads allocating from and freeing into two shared pools, a third settling and
    /// syncing: at every instant the ledger holds at least what the pools reserve, the quota
    /// bounds what they reserve, and at the end it holds exactly that.
    #[test]
    fn racing_allocators_and_a_settler_never_undercount() {
        let q = Arc::new(quota("race", 96 * MIB));
        let e = q.entry(0, || Some([6; 16])).unwrap();
        let m = Arc::new(Model::new(POOL_GRANULE));
        m.create(0x1000);
        m.create(0x2000);
        let stop = Arc::new(AtomicBool::new(false));
        let checker = {
            let (q, m, stop) = (q.clone(), m.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut checks = 0u64;
                while !stop.load(SeqCst) {
                    // The model's lock freezes what is reserved while the ledger is read.
                    let pools = m.pools.lock().unwrap();
                    let reserved: u64 = pools.values().map(|p| p.0).sum();
                    let held = used(&q, e);
                    drop(pools);
                    assert!(reserved <= 96 * MIB, "{reserved} reserved");
                    assert!(held >= reserved, "ledger {held} < reserved {reserved}");
                    checks += 1;
                }
                checks
            })
        };
        let workers: Vec<_> = (0..2u64)
            .map(|t| {
                let (q, m) = (q.clone(), m.clone());
                std::thread::spawn(move || {
                    let mut rng = 0x2545_F491_4F6C_DD1Du64 ^ (t + 1);
                    let mut mine: Vec<(u64, u64)> = Vec::new();
                    for _ in 0..3000 {
                        rng ^= rng << 13;
                        rng ^= rng >> 7;
                        rng ^= rng << 17;
                        let pool = if rng & 1 == 0 { 0x1000 } else { 0x2000 };
                        let bytes = 512 * (1 + (rng >> 8) % 16384); // up to 8 MiB
                        if !(rng >> 40).is_multiple_of(3) || mine.is_empty() {
                            if alloc(&q, &m, pool, e, bytes).is_ok() {
                                mine.push((pool, bytes));
                            }
                        } else {
                            let (p, b) = mine.swap_remove(((rng >> 20) as usize) % mine.len());
                            m.free(p, b);
                            q.pools.note_free();
                        }
                    }
                    for (p, b) in mine {
                        m.free(p, b);
                    }
                })
            })
            .collect();
        let settler = {
            let (q, m, stop) = (q.clone(), m.clone(), stop.clone());
            std::thread::spawn(move || {
                while !stop.load(SeqCst) {
                    m.sync();
                    q.settle_pools(&*m, None);
                    std::thread::yield_now();
                }
            })
        };
        for w in workers {
            w.join().unwrap();
        }
        stop.store(true, SeqCst);
        settler.join().unwrap();
        assert!(checker.join().unwrap() > 0);
        m.sync();
        q.settle_pools(&*m, None);
        assert_eq!(m.total(), 0);
        assert_eq!(
            used(&q, e),
            0,
            "exactly 0 when everything is freed and trimmed"
        );
        let _ = std::fs::remove_dir_all(&q.config.state_dir);
    }

    /// Two allocations in flight on one pool, each reading the reserve right after its own
    /// driver call: B reads 1.5 GiB, A reads 3 GiB and commits first, then B commits with its
    /// stale read. Once, A paid only its bound and left the rest to B, which owed nothing by its
    /// stale read: 3 GiB reserved, 1.5 GiB charged. (Found by review.)
    #[test]
    fn two_allocations_in_flight_with_a_stale_reserve_read_are_charged_the_whole_growth() {
        for quota_mib in [8192, 4096] {
            let q = quota(&format!("stale-{quota_mib}"), quota_mib * MIB);
            let e = q.entry(0, || Some([7; 16])).unwrap();
            let m = Model::new(POOL_GRANULE);
            let pool = 0x1000;
            m.create(pool);
            let a = q.pool_begin(pool, e, 0, 1536 * MIB, &m).unwrap();
            let b = q.pool_begin(pool, e, 0, 1536 * MIB, &m).unwrap();
            m.alloc(pool, 1536 * MIB); // B's driver call
            let read_b = m.reserved(pool);
            m.alloc(pool, 1536 * MIB); // A's driver call
            let read_a = m.reserved(pool);
            let first = q.pool_commit(a, read_a);
            q.pool_commit(b, read_b).unwrap();
            if quota_mib == 8192 {
                assert!(first.is_ok());
                assert_eq!(
                    used(&q, e),
                    3072 * MIB,
                    "the ledger shows what the pool holds"
                );
            } else {
                // Both bounds and A's extra did not fit at once: A is refused (its caller frees
                // it and trims), and the ledger still shows at least what the pool holds.
                assert!(first.is_err());
                assert!(used(&q, e) >= 3072 * MIB, "{} MiB", used(&q, e) / MIB);
            }
        }
    }
}
