//! Streams: the stream object, stream order with host work and the driver threads that run it
//! (what every chapter that queues work builds on), creation, the stream's properties,
//! attributes, and the profiler switches. What streams are asked besides kernels and copies
//! (synchronization, queries, host functions and callbacks, memory operations, destroy), where
//! stream capture and the pools take part, is `stream_ops`.
//!
//! Stream order. Device work takes no real time here (a kernel takes the device's timeline,
//! see `launch`; a copy or memset takes a copy engine and the links of its route, see
//! `copy_engine`, and moves its bytes when it is issued), so a stream is just the time its last
//! kernel, copy or memset ends (`tail`) until host work enters it. A host function "will be called after
//! currently enqueued work and will block work added after it" (cuda.h, cuLaunchHostFunc); a
//! callback is "called on the host after all currently enqueued items in the stream have
//! completed" and "will block later work in the stream until it is finished" (cuda.h,
//! cuStreamAddCallback; the CUDA Programming Guide's "Host Functions (Callbacks)" section says
//! the same of stream order). So a stream with host work pending has a queue, run in order by a
//! driver thread of its own: the host function runs once the stream's kernels are done, then
//! what was queued behind it (copies, kernels, event records, writes) happens in order. A wait
//! on memory (cuStreamWaitValue*) or on an event whose record is still queued elsewhere blocks
//! its stream the same way. Synchronization, queries and events recorded behind queued work
//! wait for the queue; the legacy stream's implicit synchronization holds (`implicit_deps`).
//!
//! What the simulator relies on is only what the guide and cuda.h promise: order within one
//! stream; host functions of independent streams "execute in undefined order and may be
//! serialized" (cuda.h), so each stream's queue runs on its own thread.

use crate::ctx::{self, Context};
use crate::{drv, export, read, write, Registry, Res};
use cuvisor_cuda_abi::cuda::*;
use cuvisor_sim::state::sleep_until;
use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::ffi::{c_uint, c_void};
use std::sync::atomic::{AtomicI32, AtomicU64, AtomicUsize, Ordering::*};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, Weak};
use std::time::Duration;

/// Work queued behind host work, run by the stream's driver thread.
type Work = Box<dyn FnOnce(&Stream) + Send>;

#[derive(Default)]
struct Queue {
    items: VecDeque<Work>,
    /// A driver thread is running this stream's queue (the item it runs included).
    draining: bool,
}

pub(crate) struct Stream {
    pub dev: usize,
    pub flags: u32,
    priority: AtomicI32,
    pub(crate) ctx: AtomicUsize,
    /// `cuStreamGetId`: unique among the process's streams.
    id: u64,
    /// When the last work queued on this stream ends (CLOCK_MONOTONIC ns).
    pub tail: AtomicU64,
    pub(crate) ctx_tail: Arc<AtomicU64>,
    queue: Mutex<Queue>,
    /// Items ever queued behind host work, and of those the ones run: an item that waits for
    /// this stream's work so far waits until `ran` reaches `queued` as it was then.
    queued: AtomicU64,
    ran: AtomicU64,
    /// The context's legacy (NULL) stream.
    legacy: bool,
    /// Attribute values set with cuStreamSetAttribute / cuStreamCopyAttributes, by id (the
    /// 64-byte `CUstreamAttrValue`).
    attrs: Mutex<HashMap<u32, [u8; 64]>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Stream {
    pub fn new(dev: usize, flags: u32, priority: i32, ctx_tail: Arc<AtomicU64>) -> Stream {
        static NEXT_ID: AtomicU64 = AtomicU64::new(1);
        Stream {
            dev,
            flags,
            priority: AtomicI32::new(priority),
            ctx: AtomicUsize::new(0),
            id: NEXT_ID.fetch_add(1, Relaxed),
            tail: AtomicU64::new(0),
            ctx_tail,
            queue: Mutex::new(Queue::default()),
            queued: AtomicU64::new(0),
            ran: AtomicU64::new(0),
            legacy: false,
            attrs: Mutex::new(HashMap::new()),
        }
    }
    /// Whether this is a context's legacy (NULL) stream.
    pub(crate) fn is_legacy(&self) -> bool {
        self.legacy
    }
    /// A context's legacy default stream.
    fn new_legacy(dev: usize, ctx_tail: Arc<AtomicU64>) -> Arc<Stream> {
        let mut s = Stream::new(dev, 0, 0, ctx_tail);
        s.legacy = true;
        enlist(Arc::new(s))
    }
    pub fn set_ctx(&self, h: usize) {
        self.ctx.store(h, Relaxed);
    }
    /// The stream's context handle (0 for none recorded).
    pub fn ctx_handle(&self) -> usize {
        self.ctx.load(Relaxed)
    }
    pub(crate) fn done_at(&self) -> u64 {
        self.tail.load(Acquire)
    }
    /// Host work (or work behind it) is still queued or running.
    pub(crate) fn busy(&self) -> bool {
        lock(&self.queue).draining
    }
    /// The context the stream belongs to, as a key of `pending`.
    fn ctx_key(&self) -> usize {
        Arc::as_ptr(&self.ctx_tail) as usize
    }

    /// Runs `w` in stream order: now, when nothing it must follow is pending; otherwise after
    /// it, on the stream's driver thread.
    pub(crate) fn submit(self: &Arc<Self>, w: impl FnOnce(&Stream) + Send + 'static) {
        self.submit_or(|| {}, w)
    }

    /// As `submit`; `queued` runs first (under the queue's lock) when `w` has to wait.
    pub(crate) fn submit_or(
        self: &Arc<Self>,
        queued: impl FnOnce(),
        w: impl FnOnce(&Stream) + Send + 'static,
    ) {
        let deps = implicit_deps(self);
        let q = lock(&self.queue);
        if !q.draining && deps.is_empty() {
            drop(q);
            w(self);
            return;
        }
        queued();
        self.push(q, after(deps, w));
    }

    /// Queues `w`, which may block (a host function, a wait), behind the stream's work; the
    /// stream's driver thread runs it and what follows.
    pub(crate) fn submit_host(self: &Arc<Self>, w: impl FnOnce(&Stream) + Send + 'static) {
        let deps = implicit_deps(self);
        let q = lock(&self.queue);
        self.push(q, after(deps, w));
    }

    fn push(self: &Arc<Self>, mut q: MutexGuard<'_, Queue>, w: Work) {
        q.items.push_back(w);
        self.queued.fetch_add(1, AcqRel);
        pending_add(self.ctx_key(), 1);
        if !q.draining {
            q.draining = true;
            DRAINING.fetch_add(1, AcqRel);
            let s = self.clone();
            std::thread::Builder::new()
                .name("cuvisor-sim-stream".into())
                .spawn(move || drain(s))
                .expect("a driver thread");
        }
    }

    /// Queues `dur` ns of kernel time on the device's timeline, after the stream's last work.
    pub(crate) fn run_kernel_now(&self, dur: u64) -> Res {
        let d = drv()?;
        let not_before = self.tail.load(Acquire);
        let (_, end) = d.sim.shared.run_kernel(d.slot, self.dev, not_before, dur);
        self.tail.fetch_max(end, AcqRel);
        self.ctx_tail.fetch_max(end, AcqRel);
        Ok(())
    }
}

/// The stream's driver thread: runs the queue in order until it is empty.
fn drain(s: Arc<Stream>) {
    loop {
        let w = {
            let mut q = lock(&s.queue);
            match q.items.pop_front() {
                Some(w) => w,
                None => {
                    q.draining = false;
                    DRAINING.fetch_sub(1, AcqRel);
                    drop(q);
                    notify();
                    return;
                }
            }
        };
        // A panicking host function must not take the queue (and every waiter) with it.
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| w(&s)));
        s.ran.fetch_add(1, AcqRel);
        pending_add(s.ctx_key(), -1);
        notify();
    }
}

/// Queues being drained in this process: while none is, no work waits for any.
static DRAINING: AtomicUsize = AtomicUsize::new(0);

/// Every stream of the process that may be synchronized with implicitly: created streams,
/// per-thread default streams and the contexts' legacy streams.
fn all_streams() -> &'static Mutex<Vec<Weak<Stream>>> {
    static A: OnceLock<Mutex<Vec<Weak<Stream>>>> = OnceLock::new();
    A.get_or_init(|| Mutex::new(Vec::new()))
}

/// The live streams of context `ctx` (its legacy stream, per-thread default streams and created
/// streams), for what acts on a whole context (cuCtxRecordEvent / cuCtxWaitEvent, `event_order`).
pub(crate) fn context_streams(ctx: usize) -> Vec<Arc<Stream>> {
    lock(all_streams())
        .iter()
        .filter_map(Weak::upgrade)
        .filter(|s| s.ctx.load(Relaxed) == ctx)
        .collect()
}

/// When timed work newly put on `s` may start: after `s`'s own work and, by the legacy default
/// stream's implicit synchronization ("Stream synchronization behavior", driver API reference:
/// the legacy stream waits on all blocking streams of its context, and they wait on it;
/// non-blocking streams take part in neither), after the work of the streams it synchronizes
/// with. Kernels need nothing more than their stream's tail (every kernel of a device runs on
/// one timeline); copies run on copy engines and links, so they ask this.
pub(crate) fn start_after(s: &Stream) -> u64 {
    implicitly_ordered_with(s)
        .iter()
        .map(|o| o.done_at())
        .fold(s.done_at(), u64::max)
}

/// The other streams work on `me` is implicitly ordered after, by the legacy default stream's
/// rule (see [`implicit_deps`]): the blocking streams of its context when `me` is the legacy
/// stream, the legacy stream when `me` is a blocking one; none for a non-blocking stream.
fn implicitly_ordered_with(me: &Stream) -> Vec<Arc<Stream>> {
    if me.flags & CU_STREAM_NON_BLOCKING != 0 {
        return Vec::new();
    }
    let key = me.ctx_key();
    lock(all_streams())
        .iter()
        .filter_map(Weak::upgrade)
        .filter(|o| {
            o.ctx_key() == key
                && !std::ptr::eq(&**o, me)
                && o.flags & CU_STREAM_NON_BLOCKING == 0
                && (me.legacy || o.legacy)
        })
        .collect()
}

fn enlist(s: Arc<Stream>) -> Arc<Stream> {
    let mut a = lock(all_streams());
    a.retain(|w| w.strong_count() > 0);
    a.push(Arc::downgrade(&s));
    s
}

/// What work on `me` must wait for besides its own stream. CUDA driver API reference, "Stream
/// synchronization behavior": "The legacy default stream is an implicit stream which
/// synchronizes with all other streams in the same CUcontext except for non-blocking streams
/// ... When an action is taken in the legacy stream ..., the legacy stream first waits on all
/// blocking streams, the action is queued in the legacy stream, and then all blocking streams
/// wait on the legacy stream"; the per-thread default stream "is not a non-blocking stream and
/// will synchronize with the legacy default stream if both are used in a program". Each is a
/// stream and how many of its queued items must have run. Kernels need nothing here: every
/// kernel of the device runs in one timeline.
fn implicit_deps(me: &Arc<Stream>) -> Vec<(Arc<Stream>, u64)> {
    if DRAINING.load(Acquire) == 0 {
        return Vec::new();
    }
    implicitly_ordered_with(me)
        .into_iter()
        .filter_map(|o| {
            let n = o.queued.load(Acquire);
            (o.ran.load(Acquire) < n).then_some((o, n))
        })
        .collect()
}

/// `w`, first waiting for `deps` (and taking their kernels' end as its own start).
fn after(deps: Vec<(Arc<Stream>, u64)>, w: impl FnOnce(&Stream) + Send + 'static) -> Work {
    if deps.is_empty() {
        return Box::new(w);
    }
    Box::new(move |s: &Stream| {
        wait_for(|| deps.iter().all(|(o, n)| o.ran.load(Acquire) >= *n));
        for (o, _) in &deps {
            s.tail.fetch_max(o.done_at(), AcqRel);
        }
        w(s)
    })
}

/// Queued items per context (key: its `work_tail`), for synchronous calls that wait for all
/// of a context's work.
fn pending() -> &'static Mutex<HashMap<usize, isize>> {
    static P: OnceLock<Mutex<HashMap<usize, isize>>> = OnceLock::new();
    P.get_or_init(|| Mutex::new(HashMap::new()))
}

fn pending_add(key: usize, n: isize) {
    let mut p = lock(pending());
    let e = p.entry(key).or_insert(0);
    *e += n;
    if *e <= 0 {
        p.remove(&key);
    }
}

/// Progress of any queue: waiters wait on this, queues notify it.
fn progress() -> &'static (Mutex<()>, Condvar) {
    static P: OnceLock<(Mutex<()>, Condvar)> = OnceLock::new();
    P.get_or_init(|| (Mutex::new(()), Condvar::new()))
}

fn notify() {
    let (m, cv) = progress();
    let _g = lock(m);
    cv.notify_all();
}

/// Blocks until `done()` holds. Queues of this process notify; a time-out polls what other
/// processes (IPC events) and host threads (memory that a wait watches) change.
pub(crate) fn wait_for(done: impl Fn() -> bool) {
    let (m, cv) = progress();
    let mut g = lock(m);
    while !done() {
        g = cv
            .wait_timeout(g, Duration::from_micros(200))
            .unwrap_or_else(|e| e.into_inner())
            .0;
    }
}

pub(crate) fn streams() -> &'static Registry<Stream> {
    static R: OnceLock<Registry<Stream>> = OnceLock::new();
    R.get_or_init(Registry::new)
}

thread_local! {
    /// The per-thread default stream of each context this thread used (CU_STREAM_PER_THREAD, or
    /// NULL passed to a `_ptsz`/`_ptds` entry point).
    static PER_THREAD: RefCell<HashMap<usize, Arc<Stream>>> = RefCell::new(HashMap::new());
}

/// Each context's legacy (NULL) stream, by context handle, made at its first use: streams know
/// their context, contexts know no streams (`ctx` is the registry the chapters build on).
fn legacy_streams() -> &'static Mutex<HashMap<usize, Arc<Stream>>> {
    static L: OnceLock<Mutex<HashMap<usize, Arc<Stream>>>> = OnceLock::new();
    L.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Context `ch`'s legacy stream.
pub(crate) fn legacy_stream(ch: usize, c: &Context) -> Arc<Stream> {
    lock(legacy_streams())
        .entry(ch)
        .or_insert_with(|| {
            let s = Stream::new_legacy(c.dev, c.work_tail.clone());
            s.set_ctx(ch);
            s
        })
        .clone()
}

/// A destroyed context's legacy stream goes with it (its handle may name a new context).
pub(crate) fn forget_context(ch: usize) {
    lock(legacy_streams()).remove(&ch);
}

/// A stream argument that must not be the legacy NULL stream ("hStream - The stream to enqueue
/// the operations in. Must not be legacy NULL stream", cuda.h 13.5 on the batched copies and
/// prefetches): NULL without the per-thread flag, and CU_STREAM_LEGACY, are
/// CUDA_ERROR_INVALID_VALUE; NULL through a `_ptsz` entry point is the per-thread stream.
pub(crate) fn not_legacy(h: CUstream, per_thread: bool) -> Result<Arc<Stream>, CUresult> {
    let v = h as usize;
    if v == CU_STREAM_LEGACY || (v == 0 && !per_thread) {
        return Err(err::INVALID_VALUE);
    }
    stream(h, per_thread)
}

/// Resolves a stream argument. `per_thread`: the entry point is a `_ptsz`/`_ptds` variant, for
/// which NULL means the per-thread default stream rather than the legacy one.
pub(crate) fn stream(h: CUstream, per_thread: bool) -> Result<Arc<Stream>, CUresult> {
    let h = h as usize;
    let legacy = h == CU_STREAM_LEGACY || (h == 0 && !per_thread);
    if legacy || h == CU_STREAM_PER_THREAD || h == 0 {
        let (ch, c) = ctx::current()?;
        if legacy {
            return Ok(legacy_stream(ch, &c));
        }
        return Ok(PER_THREAD.with(|m| {
            m.borrow_mut()
                .entry(ch)
                .or_insert_with(|| {
                    let s = enlist(Arc::new(Stream::new(c.dev, 0, 0, c.work_tail.clone())));
                    s.set_ctx(ch);
                    s
                })
                .clone()
        }));
    }
    drv()?;
    streams().get(h)
}

/// Waits until no item is queued behind host work in context `c`'s streams (their device work
/// may still be running: see [`sync_device_work`]).
pub(crate) fn wait_queued(c: &Context) {
    let key = Arc::as_ptr(&c.work_tail) as usize;
    wait_for(|| !lock(pending()).contains_key(&key));
}

/// Waits for all work queued in a context: its streams' queues, then its kernels.
pub(crate) fn sync_device_work(c: &Context) {
    wait_queued(c);
    sleep_until(c.work_tail.load(Acquire));
}

fn create_stream(out: *mut CUstream, flags: c_uint, priority: i32) -> Res {
    let (ch, c) = ctx::current()?;
    if flags & !CU_STREAM_NON_BLOCKING != 0 || out.is_null() {
        return Err(err::INVALID_VALUE);
    }
    let (h, s) = streams().insert(Stream::new(
        c.dev,
        flags,
        priority.clamp(-5, 0),
        c.work_tail.clone(),
    ));
    s.set_ctx(ch);
    enlist(s);
    write(out, h as CUstream)
}

/// `CUstream`'s contexts (cuStreamGetCtx_v2, CUDA 12.5): the simulator has no green contexts,
/// so `*green` is always NULL, as the reference says for a stream of a regular context.
fn stream_ctx(h: CUstream, pctx: *mut CUcontext, green: *mut *mut c_void, pt: bool) -> Res {
    let st = stream(h, pt)?;
    if pctx.is_null() {
        return Err(err::INVALID_VALUE);
    }
    if !green.is_null() {
        write(green, std::ptr::null_mut())?;
    }
    write(pctx, st.ctx.load(Relaxed) as CUcontext)
}

// ---- attributes ---------------------------------------------------------------------------------

/// `CUstreamAttrID` = `CUlaunchAttributeID`; the ones cuda.h marks "Valid for streams".
const ATTR_ACCESS_POLICY_WINDOW: u32 = 1;
const ATTR_SYNCHRONIZATION_POLICY: u32 = 3;
const ATTR_PRIORITY: u32 = 8;
const ATTR_MEM_SYNC_DOMAIN_MAP: u32 = 9;
const ATTR_MEM_SYNC_DOMAIN: u32 = 10;
const ATTR_NVLINK_UTIL_CENTRIC_SCHEDULING: u32 = 16;
const STREAM_ATTRS: [u32; 6] = [
    ATTR_ACCESS_POLICY_WINDOW,
    ATTR_SYNCHRONIZATION_POLICY,
    ATTR_PRIORITY,
    ATTR_MEM_SYNC_DOMAIN_MAP,
    ATTR_MEM_SYNC_DOMAIN,
    ATTR_NVLINK_UTIL_CENTRIC_SCHEDULING,
];
/// `CUsynchronizationPolicy`: AUTO 1, SPIN 2, YIELD 3, BLOCKING_SYNC 4.
const SYNC_POLICY_AUTO: u32 = 1;
const SYNC_POLICY_BLOCKING_SYNC: u32 = 4;

fn u32_at(v: &[u8; 64], off: usize) -> u32 {
    u32::from_le_bytes(v[off..off + 4].try_into().unwrap_or_default())
}

/// A stream attribute's value: what was set, else the default (no access policy window, the
/// AUTO synchronization policy, the stream's priority, the default domain and map).
fn attr_value(s: &Stream, id: u32) -> Result<[u8; 64], CUresult> {
    if !STREAM_ATTRS.contains(&id) {
        return Err(err::INVALID_VALUE);
    }
    let mut v = [0u8; 64];
    if id == ATTR_PRIORITY {
        v[..4].copy_from_slice(&s.priority.load(Relaxed).to_le_bytes());
        return Ok(v);
    }
    if let Some(x) = lock(&s.attrs).get(&id) {
        return Ok(*x);
    }
    match id {
        ATTR_SYNCHRONIZATION_POLICY => v[..4].copy_from_slice(&SYNC_POLICY_AUTO.to_le_bytes()),
        // `CUlaunchMemSyncDomainMap` {default_, remote}: the remote domain maps to 1 by default
        // ("Default domain ID is 0, remote domain ID is 1", CUDA programming guide, "Memory
        // Synchronization Domains").
        ATTR_MEM_SYNC_DOMAIN_MAP => v[1] = 1,
        _ => {}
    }
    Ok(v)
}

fn set_attr(s: &Stream, id: u32, v: [u8; 64]) -> Res {
    if !STREAM_ATTRS.contains(&id) {
        return Err(err::INVALID_VALUE);
    }
    match id {
        ATTR_SYNCHRONIZATION_POLICY
            if !(SYNC_POLICY_AUTO..=SYNC_POLICY_BLOCKING_SYNC).contains(&u32_at(&v, 0)) =>
        {
            return Err(err::INVALID_VALUE);
        }
        ATTR_PRIORITY => {
            // Clamped into the device's range, as cuStreamCreateWithPriority does.
            let p = u32_at(&v, 0) as i32;
            s.priority.store(p.clamp(-5, 0), Relaxed);
            return Ok(());
        }
        ATTR_ACCESS_POLICY_WINDOW => {
            // `CUaccessPolicyWindow` {base_ptr, num_bytes, hitRatio (float), hitProp, missProp}:
            // "hitRatio ... Must be between 0 and 1" ... "missProp ... cannot be
            // CU_ACCESS_PROPERTY_PERSISTING" (cuda.h).
            let ratio = f32::from_bits(u32_at(&v, 16));
            if !(0.0..=1.0).contains(&ratio) || u32_at(&v, 24) == 2 {
                return Err(err::INVALID_VALUE);
            }
        }
        _ => {}
    }
    lock(&s.attrs).insert(id, v);
    Ok(())
}

fn get_attribute(h: CUstream, id: u32, out: *mut [u8; 64], pt: bool) -> Res {
    let s = stream(h, pt)?;
    write(out, attr_value(&s, id)?)
}

fn set_attribute(h: CUstream, id: u32, v: *const [u8; 64], pt: bool) -> Res {
    let s = stream(h, pt)?;
    set_attr(&s, id, read(v)?)
}

/// cuStreamCopyAttributes: every stream attribute of `src` onto `dst`, in one context.
fn copy_attributes(dst: CUstream, src: CUstream, pt: bool) -> Res {
    let d = stream(dst, pt)?;
    let s = stream(src, pt)?;
    if d.ctx.load(Relaxed) != s.ctx.load(Relaxed) {
        return Err(err::INVALID_CONTEXT);
    }
    for id in STREAM_ATTRS {
        set_attr(&d, id, attr_value(&s, id)?)?;
    }
    Ok(())
}

export! {
    fn cuStreamCreate(out: *mut CUstream, flags: c_uint) { create_stream(out, flags, 0) }
    fn cuStreamCreateWithPriority(out: *mut CUstream, flags: c_uint, priority: i32) { create_stream(out, flags, priority) }
    fn cuStreamGetCtx(s: CUstream, pctx: *mut CUcontext) {
        let st = stream(s, false)?;
        write(pctx, st.ctx.load(Relaxed) as CUcontext)
    }
    fn cuStreamGetCtx_ptsz(s: CUstream, pctx: *mut CUcontext) {
        let st = stream(s, true)?;
        write(pctx, st.ctx.load(Relaxed) as CUcontext)
    }
    fn cuStreamGetCtx_v2(s: CUstream, pctx: *mut CUcontext, green: *mut *mut c_void) { stream_ctx(s, pctx, green, false) }
    fn cuStreamGetCtx_v2_ptsz(s: CUstream, pctx: *mut CUcontext, green: *mut *mut c_void) { stream_ctx(s, pctx, green, true) }
    fn cuStreamGetFlags(s: CUstream, flags: *mut c_uint) { write(flags, stream(s, false)?.flags) }
    fn cuStreamGetFlags_ptsz(s: CUstream, flags: *mut c_uint) { write(flags, stream(s, true)?.flags) }
    fn cuStreamGetPriority(s: CUstream, p: *mut i32) { write(p, stream(s, false)?.priority.load(Relaxed)) }
    fn cuStreamGetPriority_ptsz(s: CUstream, p: *mut i32) { write(p, stream(s, true)?.priority.load(Relaxed)) }
    /// CUDA 12.0: "Returns in streamId the unique Id of the stream" (cuda.h).
    fn cuStreamGetId(s: CUstream, id: *mut u64) { write(id, stream(s, false)?.id) }
    fn cuStreamGetId_ptsz(s: CUstream, id: *mut u64) { write(id, stream(s, true)?.id) }
    /// CUDA 12.8: the device of the stream's context.
    fn cuStreamGetDevice(s: CUstream, dev: *mut CUdevice) { write(dev, stream(s, false)?.dev as CUdevice) }
    fn cuStreamGetDevice_ptsz(s: CUstream, dev: *mut CUdevice) { write(dev, stream(s, true)?.dev as CUdevice) }

    fn cuStreamGetAttribute(s: CUstream, id: u32, out: *mut [u8; 64]) { get_attribute(s, id, out, false) }
    fn cuStreamGetAttribute_ptsz(s: CUstream, id: u32, out: *mut [u8; 64]) { get_attribute(s, id, out, true) }
    fn cuStreamSetAttribute(s: CUstream, id: u32, v: *const [u8; 64]) { set_attribute(s, id, v, false) }
    fn cuStreamSetAttribute_ptsz(s: CUstream, id: u32, v: *const [u8; 64]) { set_attribute(s, id, v, true) }
    fn cuStreamCopyAttributes(dst: CUstream, src: CUstream) { copy_attributes(dst, src, false) }
    fn cuStreamCopyAttributes_ptsz(dst: CUstream, src: CUstream) { copy_attributes(dst, src, true) }

    /// "Enables profile collection by the active profiling tool for the current context. If
    /// profiling is already enabled, then cuProfilerStart() has no effect"; returns
    /// CUDA_SUCCESS or CUDA_ERROR_INVALID_CONTEXT (CUDA driver API reference, "Profiler
    /// Control", 13.4). No tool is attached to the simulator: nothing to enable.
    fn cuProfilerStart() { ctx::current().map(|_| ()) }
    fn cuProfilerStop() { ctx::current().map(|_| ()) }
}
