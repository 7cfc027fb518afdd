//! CUDA graph memory, charged by what the device's graph memory pool reserves.
//!
//! What the driver does (the CUDA Programming Guide, "Graph Memory Nodes"; the driver API
//! reference): a memory-allocation node, made by cuGraphAddMemAllocNode or by capturing
//! cuMemAllocAsync / cuMemAllocFromPoolAsync ("the allocation is owned by the graph instead of
//! the memory pool"), gets its address when it is made and takes no memory then, nor at
//! instantiation ("Physical memory cannot be allocated or mapped during graph instantiation").
//! The memory is taken when the graph is launched or uploaded, from a per-device graph memory
//! pool that "is not exposed to the stream ordered memory allocator" and that keeps it after the
//! graph completes and its allocations are freed, until cuDeviceGraphMemTrim (or the context's
//! teardown). `CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT` says what the pool holds.
//!
//! So the quota charges, per device, that reservation — the memory the driver has taken for
//! graphs — and nothing at node creation, capture or instantiation:
//!
//! - **launch / upload** of an executable with allocation nodes: first a tentative charge of the
//!   most the launch can grow the pool by (each node's size rounded up to the pool granule,
//!   summed per device; learned from the graph's nodes when it was instantiated); the driver
//!   launches; the device's reservation is read and its charge set to it (the tentative charge
//!   pays the growth, the rest goes back). A launch the quota cannot cover is refused before the
//!   driver sees it — after the pool was trimmed, when it held memory no graph uses (that memory
//!   is the quota's, not the pool's to keep): the charge then drops to what the trim left.
//! - growth beyond the tentative charge (a driver reserving in larger steps than the granule) is
//!   charged all the same, above the quota if need be, and reported: the launch has happened and
//!   cannot be undone, but the ledger never shows less than the driver holds.
//! - **cuDeviceGraphMemTrim** and **context teardown** settle the charge down to the reservation.
//!
//! One launch with graph memory (or settling) at a time per process: the reservation read after a
//! launch must be that launch's. Launches of graphs without allocation nodes pay one atomic load.
//!
//! No FFI here: the hook answers [`GraphDriver`] from the real driver; the tests below from a
//! model of it.

use super::{Quota, Refusal};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering::*};
use std::sync::{Mutex, MutexGuard};

/// What the graph memory rules ask the driver.
pub trait GraphDriver {
    /// What device `ordinal`'s graph memory pool reserves
    /// (`CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT`); None when the driver does not say.
    fn reserved(&self, ordinal: i32) -> Option<u64>;
    /// Releases what the pool holds beyond what graphs use (`cuDeviceGraphMemTrim`).
    fn trim(&self, ordinal: i32);
}

/// The pool granule: each allocation node can grow the pool by its size rounded up to this
/// (as for stream-ordered pools; the graph pool's step is not documented).
pub const GRAPH_GRANULE: u64 = 2 << 20;

const ORDINALS: usize = 64;

/// Per device, the most one launch can grow the graph memory pool by: (CUDA ordinal, bytes).
pub type Bounds = Vec<(i32, u64)>;

/// The bounds of a graph whose allocation nodes are `(ordinal, bytesize)`.
pub fn bounds(nodes: impl IntoIterator<Item = (i32, u64)>) -> Bounds {
    let mut b: Bounds = Vec::new();
    for (ord, size) in nodes {
        let grow = size.div_ceil(GRAPH_GRANULE).saturating_mul(GRAPH_GRANULE);
        match b.iter_mut().find(|(o, _)| *o == ord) {
            Some((_, n)) => *n = n.saturating_add(grow),
            None => b.push((ord, grow)),
        }
    }
    b
}

pub struct GraphMem {
    /// Per CUDA ordinal: the ledger entry + 1 its graph memory is charged to (0: none yet).
    entry: [AtomicU32; ORDINALS],
    /// Per CUDA ordinal: the bytes charged for its graph memory pool.
    charged: [AtomicU64; ORDINALS],
    /// Executables with allocation nodes, and their bounds.
    execs: Mutex<HashMap<u64, Bounds>>,
    /// How many there are (0: every launch passes with one load).
    count: AtomicUsize,
    /// One launch with graph memory, or one settling, at a time.
    one: Mutex<()>,
}

/// A launch charged its bounds, between the driver call and [`Quota::graph_end`].
pub struct GraphTicket<'a> {
    _one: MutexGuard<'a, ()>,
    /// (ordinal, entry, tentative bytes).
    charges: Vec<(i32, usize, u64)>,
}

impl Default for GraphMem {
    fn default() -> Self {
        GraphMem {
            entry: std::array::from_fn(|_| AtomicU32::new(0)),
            charged: std::array::from_fn(|_| AtomicU64::new(0)),
            execs: Mutex::new(HashMap::new()),
            count: AtomicUsize::new(0),
            one: Mutex::new(()),
        }
    }
}

impl GraphMem {
    /// The bounds of executable `exec`, if it has allocation nodes.
    #[inline]
    pub fn bounds_of(&self, exec: u64) -> Option<Bounds> {
        if self.count.load(Relaxed) == 0 {
            return None;
        }
        self.lock_execs().get(&exec).cloned()
    }

    /// Executable `exec` was instantiated from a graph with allocation nodes.
    pub fn instantiated(&self, exec: u64, b: Bounds) {
        if b.is_empty() {
            return;
        }
        if self.lock_execs().insert(exec, b).is_none() {
            self.count.fetch_add(1, Relaxed);
        }
    }

    /// cuGraphExecDestroy: the handle may come back for another executable.
    pub fn destroyed(&self, exec: u64) {
        if self.count.load(Relaxed) > 0 && self.lock_execs().remove(&exec).is_some() {
            self.count.fetch_sub(1, Relaxed);
        }
    }

    /// Bytes charged for device `ordinal`'s graph memory.
    pub fn charged(&self, ordinal: i32) -> u64 {
        slot(ordinal).map_or(0, |i| self.charged[i].load(Relaxed))
    }

    fn lock_execs(&self) -> MutexGuard<'_, HashMap<u64, Bounds>> {
        self.execs.lock().unwrap_or_else(|e| e.into_inner())
    }
}

fn slot(ordinal: i32) -> Option<usize> {
    usize::try_from(ordinal).ok().filter(|&i| i < ORDINALS)
}

impl Quota {
    /// Before the driver launches or uploads an executable whose bounds are `need`
    /// ((ordinal, ledger entry, bytes) per device): charges them, trimming a device's graph
    /// memory pool first when its charge does not fit. Err: (ordinal, bytes, why) of the
    /// device whose charge the quota cannot cover; nothing stays charged.
    pub fn graph_begin(
        &self,
        need: &[(i32, usize, u64)],
        d: &impl GraphDriver,
    ) -> Result<GraphTicket<'_>, (i32, u64, Refusal)> {
        let one = self.graph.one.lock().unwrap_or_else(|e| e.into_inner());
        let mut t = GraphTicket {
            _one: one,
            charges: Vec::with_capacity(need.len()),
        };
        for &(ord, e, bytes) in need {
            let Some(i) = slot(ord) else {
                self.graph_undo(&t);
                return Err((ord, bytes, Refusal::NoEntry));
            };
            self.graph.entry[i].store(e as u32 + 1, Relaxed);
            let r = match self.charge(e, bytes) {
                Err(Refusal::Quota(_)) if self.graph.charged[i].load(Relaxed) > 0 => {
                    d.trim(ord);
                    self.graph_settle_locked(ord, d);
                    self.charge(e, bytes)
                }
                r => r,
            };
            if let Err(why) = r {
                self.graph_undo(&t);
                return Err((ord, bytes, why));
            }
            t.charges.push((ord, e, bytes));
        }
        Ok(t)
    }

    fn graph_undo(&self, t: &GraphTicket<'_>) {
        for &(_, e, bytes) in &t.charges {
            self.uncharge(e, bytes);
        }
    }

    /// After the driver call: each device's charge becomes its pool's reservation, paid from the
    /// tentative charge (the rest goes back). Err: a pool grew beyond its tentative charge and
    /// the quota has no room for the difference (it is charged anyway: the driver holds it).
    pub fn graph_end(&self, t: GraphTicket<'_>, d: &impl GraphDriver) -> Result<(), Refusal> {
        let mut over = Ok(());
        for &(ord, e, bytes) in &t.charges {
            let Some(i) = slot(ord) else { continue };
            let old = self.graph.charged[i].load(Relaxed);
            let Some(now) = d.reserved(ord) else {
                // The driver does not say: the tentative charge stays, as if all of it was taken.
                self.graph.charged[i].store(old.saturating_add(bytes), Relaxed);
                continue;
            };
            // What was charged in all (old + tentative) against what is held (now).
            let paid = old.saturating_add(bytes);
            if now <= paid {
                self.uncharge(e, paid - now);
            } else if let Err(why) = self.charge(e, now - paid) {
                self.force_charge(e, now - paid);
                over = Err(why);
            }
            self.graph.charged[i].store(now, Relaxed);
        }
        over
    }

    /// The driver's call failed: the tentative charges go back, and the reservations are read
    /// again (a failed launch may still have grown a pool).
    pub fn graph_abort(&self, t: GraphTicket<'_>, d: &impl GraphDriver) {
        let _ = self.graph_end(t, d);
    }

    /// After cuDeviceGraphMemTrim of `ordinal` (None: every device with graph memory charged, as
    /// after a context's teardown): the charge follows the reservation down (or up: memory the
    /// driver holds is charged, whichever way it was taken).
    pub fn graph_settle(&self, ordinal: Option<i32>, d: &impl GraphDriver) {
        if ordinal.is_none() && self.graph.entry.iter().all(|e| e.load(Relaxed) == 0) {
            return;
        }
        let _one = self.graph.one.lock().unwrap_or_else(|e| e.into_inner());
        match ordinal {
            Some(o) => self.graph_settle_locked(o, d),
            None => {
                for o in 0..ORDINALS {
                    if self.graph.entry[o].load(Relaxed) != 0 {
                        self.graph_settle_locked(o as i32, d);
                    }
                }
            }
        }
    }

    fn graph_settle_locked(&self, ord: i32, d: &impl GraphDriver) {
        let Some(i) = slot(ord) else { return };
        let e = match self.graph.entry[i].load(Relaxed) {
            0 => return,
            n => n as usize - 1,
        };
        let Some(now) = d.reserved(ord) else { return };
        let old = self.graph.charged[i].load(Relaxed);
        if now < old {
            self.uncharge(e, old - now);
        } else if now > old {
            self.force_charge(e, now - old);
        }
        self.graph.charged[i].store(now, Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quota::tests::quota;
    use std::cell::RefCell;

    const MIB: u64 = 1 << 20;

    /// The driver's graph memory pool of one device: what live allocations hold, what it
    /// reserves (grown in `step`s at launch, kept after frees, released by trim).
    struct Model {
        step: u64,
        live: RefCell<u64>,
        reserved: RefCell<u64>,
    }

    impl Model {
        fn new(step: u64) -> Model {
            Model {
                step,
                live: RefCell::new(0),
                reserved: RefCell::new(0),
            }
        }
        /// A launch whose allocations of `alloc` bytes stay live (`keep`) or are freed inside.
        fn launch(&self, alloc: u64, keep: bool) {
            let want = *self.live.borrow() + alloc;
            let mut r = self.reserved.borrow_mut();
            if want > *r {
                *r += (want - *r).div_ceil(self.step) * self.step;
            }
            if keep {
                *self.live.borrow_mut() += alloc;
            }
        }
        fn free(&self, bytes: u64) {
            *self.live.borrow_mut() -= bytes;
        }
    }

    impl GraphDriver for Model {
        fn reserved(&self, _: i32) -> Option<u64> {
            Some(*self.reserved.borrow())
        }
        fn trim(&self, _: i32) {
            let live = *self.live.borrow();
            *self.reserved.borrow_mut() = live.div_ceil(self.step) * self.step;
        }
    }

    fn used(q: &Quota, e: usize) -> u64 {
        q.ledger.device(e).used_bytes()
    }

    /// Launches a graph of one allocation node of `bytes` under the rules.
    fn launch(q: &Quota, m: &Model, e: usize, bytes: u64, keep: bool) -> Result<(), Refusal> {
        let b = bounds([(0, bytes)]);
        let t = q
            .graph_begin(&[(0, e, b[0].1)], m)
            .map_err(|(_, _, why)| why)?;
        m.launch(bytes, keep);
        q.graph_end(t, m)
    }

    #[test]
    fn a_launch_is_charged_the_reservation_and_nothing_before() {
        let q = quota("graph-launch", 1024 * MIB);
        let e = q.entry(0, || Some([1; 16])).unwrap();
        let m = Model::new(2 * MIB);
        launch(&q, &m, e, 600 * MIB, false).unwrap();
        assert_eq!(
            used(&q, e),
            600 * MIB,
            "kept by the pool after the graph's own free"
        );
        launch(&q, &m, e, 600 * MIB, false).unwrap();
        assert_eq!(used(&q, e), 600 * MIB, "a relaunch reuses the reservation");
        assert!(
            q.charge(e, 500 * MIB).is_err(),
            "the pool's memory is the quota's"
        );
        let _ = std::fs::remove_dir_all(&q.config.state_dir);
    }

    #[test]
    fn a_launch_beyond_the_quota_is_refused_before_the_driver_runs_it() {
        let q = quota("graph-refuse", 1024 * MIB);
        let e = q.entry(0, || Some([2; 16])).unwrap();
        let m = Model::new(2 * MIB);
        launch(&q, &m, e, 700 * MIB, true).unwrap();
        let r = launch(&q, &m, e, 400 * MIB, true);
        assert!(matches!(r, Err(Refusal::Quota(_))), "{r:?}");
        assert_eq!(*m.reserved.borrow(), 700 * MIB, "the driver never saw it");
        assert_eq!(used(&q, e), 700 * MIB, "nothing stays charged for it");
        let _ = std::fs::remove_dir_all(&q.config.state_dir);
    }

    #[test]
    fn a_full_quota_trims_the_graph_pool_before_refusing() {
        let q = quota("graph-trim", 1024 * MIB);
        let e = q.entry(0, || Some([3; 16])).unwrap();
        let m = Model::new(2 * MIB);
        launch(&q, &m, e, 600 * MIB, true).unwrap();
        m.free(600 * MIB); // freed outside the graph: the pool keeps it
        assert_eq!(used(&q, e), 600 * MIB);
        // Another graph of 800 MiB: 1400 MiB does not fit, but the pool holds 600 MiB nothing
        // uses. Trimmed, the launch fits.
        launch(&q, &m, e, 800 * MIB, false).unwrap();
        assert_eq!(used(&q, e), 800 * MIB);
        let _ = std::fs::remove_dir_all(&q.config.state_dir);
    }

    #[test]
    fn trim_and_teardown_settle_the_charge_down() {
        let q = quota("graph-settle", 1024 * MIB);
        let e = q.entry(0, || Some([4; 16])).unwrap();
        let m = Model::new(2 * MIB);
        launch(&q, &m, e, 300 * MIB, false).unwrap();
        assert_eq!(used(&q, e), 300 * MIB);
        m.trim(0);
        q.graph_settle(Some(0), &m);
        assert_eq!(used(&q, e), 0);
        launch(&q, &m, e, 100 * MIB, true).unwrap();
        m.free(100 * MIB);
        m.trim(0); // a context's teardown releases the pool
        q.graph_settle(None, &m);
        assert_eq!(used(&q, e), 0);
        let _ = std::fs::remove_dir_all(&q.config.state_dir);
    }

    #[test]
    fn growth_beyond_the_bound_is_charged_and_reported() {
        let q = quota("graph-step", 1024 * MIB);
        let e = q.entry(0, || Some([5; 16])).unwrap();
        let m = Model::new(256 * MIB); // a driver reserving in 256 MiB steps
        launch(&q, &m, e, MIB, true).unwrap();
        assert_eq!(used(&q, e), 256 * MIB, "the whole step is charged");
        m.free(MIB);
        m.trim(0);
        q.graph_settle(Some(0), &m);
        q.charge(e, 900 * MIB).unwrap();
        let r = launch(&q, &m, e, MIB, true);
        assert!(matches!(r, Err(Refusal::Quota(_))), "{r:?}");
        assert_eq!(q.graph.charged(0), 256 * MIB);
        assert_eq!(used(&q, e), 1156 * MIB, "never less than the driver holds");
        let _ = std::fs::remove_dir_all(&q.config.state_dir);
    }

    #[test]
    fn bounds_round_each_node_and_sum_per_device() {
        assert_eq!(
            bounds([(0, 1), (0, 3 * MIB), (1, 2 * MIB)]),
            vec![(0, 6 * MIB), (1, 2 * MIB)]
        );
        let g = GraphMem::default();
        assert_eq!(g.bounds_of(7), None);
        g.instantiated(7, vec![(0, 2 * MIB)]);
        g.instantiated(8, Vec::new());
        assert_eq!(g.bounds_of(7), Some(vec![(0, 2 * MIB)]));
        assert_eq!(g.bounds_of(8), None, "no allocation nodes: not recorded");
        g.destroyed(7);
        assert_eq!(g.bounds_of(7), None);
        assert_eq!(g.count.load(Relaxed), 0);
    }
}
