//! Every way device memory is taken and given back, plus copies and memsets.
//!
//! Physical memory is charged to the shared device state (so processes contend for real) and to
//! this process's slot (so NVML lists it and it is reclaimed if the process dies). Addresses come
//! from per-device arenas of host address space, so copies are plain memory moves.
//!
//! What the simulator models and how:
//! - cuMemAlloc/Pitch/Managed: charged at once, rounded up to 512 bytes. Managed memory is
//!   charged to the current device at allocation (the real driver charges pages as they migrate).
//! - stream-ordered pools: a pool reserves device memory in 2 MiB steps, keeps freed memory
//!   reserved and gives the excess over its release threshold back at synchronization points
//!   (stream, event and context synchronization, and a context's teardown, which waits for its
//!   work) or cuMemPoolTrimTo, as the real driver does. A pool destroyed with allocations still
//!   outstanding keeps its memory until the last of them is freed (see cuMemPoolDestroy).
//! - VMM: cuMemCreate charges the physical handle; mapping charges nothing more; the memory goes
//!   back when the handle is released and no longer mapped. Two mappings of one handle do not
//!   share bytes in the simulator.
//! - arrays and mipmapped arrays: charged by their element size, not addressable for copies.
//! - memory shared between processes (VMM allocations exported as POSIX file descriptors,
//!   allocations exported with cuIpcGetMemHandle): at its first export its charge moves out of
//!   the creator's process slot into an entry of the shared state that no process owns
//!   (`cuvisor_sim::state::SharedMem`), held by every process that has a handle, a mapping or an
//!   opened IPC pointer to it; the memory goes when the last holder lets go or dies, whoever
//!   created it (see `phys_drop_if_unused` and `ipc_open` for the driver documentation this
//!   follows). Imports charge nothing new. Not modelled: an exported descriptor that no process
//!   has imported keeps the real driver's memory alive (cuMemExportToShareableHandle: "Once all
//!   shareable handles are closed and the allocation is released, the allocated memory
//!   referenced will be released back to the OS"); here only handles, mappings and opened IPC
//!   pointers do.
//! - graph memory (memory-allocation nodes, and cuMemAllocAsync / cuMemAllocFromPoolAsync
//!   captured from a stream, which become such nodes): see "graph memory" below.
//! - v1 (32-bit) entry points: allocations live below 2 GiB (a 256 MiB arena), as a 32-bit
//!   `CUdeviceptr_v1` requires.

use crate::ctx;
use crate::exec;
use crate::{drv, export, read, write, Registry, Res};
use cuvisor_cuda_abi::cuda::*;
use cuvisor_sim::arena::{round_up, Arena, ALIGN};
use cuvisor_sim::state::now_ns;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::ffi::{c_int, c_uint, c_void};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::*};
use std::sync::{Arc, Mutex, OnceLock, RwLock};

/// Granularity of cuMemCreate / cuMemAddressReserve and of pool growth.
pub const GRANULARITY: u64 = 2 << 20;
/// MAP_32BIT's window is the second GiB of the address space (0x4000_0000..0x8000_0000),
/// shared with anything else that asks for it: a quarter of it is ample for v1 callers.
const LOW_ARENA: u64 = 256 << 20;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    Device,
    Managed,
    /// 32-bit v1 allocation.
    V1,
    Pool(usize),
    /// A VMM mapping of physical handle `usize`.
    Mapped(usize),
    /// An opened IPC handle (someone else's memory).
    Ipc,
    /// A module's `__device__` / `__constant__` variable: the driver's, freed with the module
    /// (or its context), never by cuMemFree.
    ModuleGlobal,
    /// A live allocation of a graph's memory-allocation node: backed by the device's graph
    /// memory pool (which is what is charged), its address owned by the node.
    Graph,
}

struct Alloc {
    size: u64,
    /// Bytes charged to the device for this allocation (0 for mappings and imports, and once
    /// the allocation is shared: see `share`).
    charged: u64,
    /// The shared-memory entry (index, generation) this allocation holds: an IPC-exported
    /// allocation of this process, or an opened IPC handle.
    share: Option<(usize, u64)>,
    dev: usize,
    ctx: usize,
    kind: Kind,
    dirty: AtomicBool,
}

fn table() -> &'static RwLock<BTreeMap<u64, Alloc>> {
    static T: OnceLock<RwLock<BTreeMap<u64, Alloc>>> = OnceLock::new();
    T.get_or_init(|| RwLock::new(BTreeMap::new()))
}

fn arena(dev: usize) -> Result<&'static Arena, CUresult> {
    static A: OnceLock<Vec<OnceLock<Option<Arena>>>> = OnceLock::new();
    let d = drv()?;
    let all = A.get_or_init(|| {
        (0..cuvisor_sim::model::MAX_DEVICES)
            .map(|_| OnceLock::new())
            .collect()
    });
    all[dev]
        .get_or_init(|| Arena::new(2 * d.sim.model.devices[dev].memory, false))
        .as_ref()
        .ok_or(err::OUT_OF_MEMORY)
}

fn low_arena() -> Result<&'static Arena, CUresult> {
    static A: OnceLock<Option<Arena>> = OnceLock::new();
    A.get_or_init(|| Arena::new(LOW_ARENA, true))
        .as_ref()
        .ok_or(err::OUT_OF_MEMORY)
}

/// Address space for cuMemAddressReserve: four times all device memory together.
fn va_arena() -> Result<&'static Arena, CUresult> {
    static A: OnceLock<Option<Arena>> = OnceLock::new();
    let d = drv()?;
    let total: u64 = d.sim.model.devices.iter().map(|x| x.memory).sum();
    A.get_or_init(|| Arena::new(4 * total, false))
        .as_ref()
        .ok_or(err::OUT_OF_MEMORY)
}

fn arena_for(kind: Kind, dev: usize) -> Result<&'static Arena, CUresult> {
    match kind {
        Kind::V1 => low_arena(),
        Kind::Mapped(_) => va_arena(),
        _ => arena(dev),
    }
}

/// Charges `bytes` of device `dev`; if the device looks full, first gives back the memory of
/// processes that died (the real driver frees it when they exit) and tries once more.
fn charge(dev: usize, bytes: u64) -> Res {
    let d = drv()?;
    let cap = d.sim.model.devices[dev].memory;
    if d.sim.shared.charge(d.slot, dev, bytes, cap) {
        return Ok(());
    }
    if d.sim.shared.reclaim_dead() > 0 && d.sim.shared.charge(d.slot, dev, bytes, cap) {
        return Ok(());
    }
    Err(err::OUT_OF_MEMORY)
}

fn uncharge(dev: usize, bytes: u64) {
    if let Ok(d) = drv() {
        if bytes > 0 {
            d.sim.shared.uncharge(d.slot, dev, bytes);
        }
    }
}

/// Allocates `size` bytes on the current context's device; `charge_bytes` None = charge the
/// rounded size, Some(n) = charge n (pools charge on their own).
fn alloc(size: u64, kind: Kind, charge_bytes: Option<u64>) -> Result<u64, CUresult> {
    let (ch, c) = ctx::current()?;
    alloc_on(c.dev, ch, size, kind, charge_bytes)
}

fn alloc_on(
    dev: usize,
    ch: usize,
    size: u64,
    kind: Kind,
    charge_bytes: Option<u64>,
) -> Result<u64, CUresult> {
    if size == 0 {
        return Err(err::INVALID_VALUE);
    }
    let rounded = round_up(size, ALIGN);
    let charged = charge_bytes.unwrap_or(rounded);
    if charged > 0 {
        charge(dev, charged)?;
    }
    let addr = match arena_for(kind, dev).ok().and_then(|a| a.alloc(rounded)) {
        Some(a) => a,
        None => {
            uncharge(dev, charged);
            return Err(err::OUT_OF_MEMORY);
        }
    };
    let rec = Alloc {
        size: rounded,
        charged,
        share: None,
        dev,
        ctx: ch,
        kind,
        dirty: AtomicBool::new(false),
    };
    table()
        .write()
        .unwrap_or_else(|e| e.into_inner())
        .insert(addr, rec);
    Ok(addr)
}

/// Frees the allocation that starts exactly at `addr` (an interior pointer is INVALID_VALUE,
/// as with the real driver). `want` filters which kinds this entry point may free.
fn free(addr: u64, want: impl Fn(Kind) -> bool) -> Res {
    drv()?;
    let rec = {
        let mut t = table().write().unwrap_or_else(|e| e.into_inner());
        match t.get(&addr) {
            Some(r) if want(r.kind) => t.remove(&addr).ok_or(err::INVALID_VALUE)?,
            _ => return Err(err::INVALID_VALUE),
        }
    };
    release(addr, rec);
    Ok(())
}

fn release(addr: u64, rec: Alloc) {
    if rec.kind == Kind::Graph {
        graph_alloc_released(addr, rec.dirty.load(Relaxed));
        return;
    }
    if let Ok(a) = arena_for(rec.kind, rec.dev) {
        a.free(addr, rec.size, rec.dirty.load(Relaxed));
    }
    match rec.kind {
        Kind::Pool(p) => {
            if let Ok(pool) = pools().get(p) {
                pool.give_back(rec.size);
                finish_destroyed(p, &pool);
            }
        }
        Kind::Mapped(_) => {}
        _ if rec.share.is_some() => {}
        _ => uncharge(rec.dev, rec.charged),
    }
    if let Some((i, _)) = rec.share {
        unref_share(i);
    }
}

/// Device memory for a module's variable of `size` bytes, in the current context (charged, as
/// the real driver's module memory takes device memory).
pub(crate) fn alloc_module_global(size: u64) -> Result<u64, CUresult> {
    alloc(size.max(1), Kind::ModuleGlobal, None)
}

/// Gives a module variable's memory back (nothing if its context already took it).
pub(crate) fn free_module_global(addr: u64) {
    let _ = free(addr, |k| k == Kind::ModuleGlobal);
}

/// Whether `addr` is still a module variable of context `ch` (a context's teardown frees them).
pub(crate) fn module_global_live(addr: u64, ch: usize) -> bool {
    table()
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .get(&addr)
        .is_some_and(|r| r.kind == Kind::ModuleGlobal && r.ctx == ch)
}

/// Frees everything a context owned (cuCtxDestroy, last primary release, primary reset) on
/// device `dev`.
pub(crate) fn free_context(ch: usize, dev: usize) {
    let mine: Vec<(u64, Alloc)> = {
        let mut t = table().write().unwrap_or_else(|e| e.into_inner());
        let keys: Vec<u64> = t
            .iter()
            .filter(|(_, r)| r.ctx == ch && !matches!(r.kind, Kind::Mapped(_)))
            .map(|(k, _)| *k)
            .collect();
        keys.into_iter()
            .filter_map(|k| t.remove(&k).map(|r| (k, r)))
            .collect()
    };
    let mut devs: Vec<usize> = mine.iter().map(|(_, r)| r.dev).collect();
    for (addr, rec) in mine {
        release(addr, rec);
    }
    // Tearing a context down waits for its work, as a context synchronization does, and pools
    // release what exceeds their threshold at a synchronization point.
    devs.sort_unstable();
    devs.dedup();
    for d in devs {
        trim_pools_at_sync(d);
    }
    // The context's graph memory goes with it: its live graph allocations were freed above, and
    // what the device's graph memory pool still reserves is released (nothing runs any more).
    graph_trim(dev);
    arrays().retain(|_, a| {
        if a.ctx == ch {
            uncharge(a.dev, a.charged);
            false
        } else {
            true
        }
    });
}

/// Checks that [addr, addr + n) lies inside one live device allocation; returns its device.
fn device_range(addr: u64, n: u64, mark_dirty: bool) -> Result<usize, CUresult> {
    let t = table().read().unwrap_or_else(|e| e.into_inner());
    let (base, r) = t.range(..=addr).next_back().ok_or(err::INVALID_VALUE)?;
    if addr.checked_add(n).is_none_or(|end| end > base + r.size) {
        return Err(err::INVALID_VALUE);
    }
    if mark_dirty && n > 0 {
        r.dirty.store(true, Relaxed);
    }
    Ok(r.dev)
}

/// cuMemSetAccess's range: every byte of it in live allocations that follow each other without
/// a gap, one or several. PyTorch's expandable segments map a segment's 20 MiB handles side by
/// side and set access once over all of them, which the real driver accepts.
fn contiguous_range(addr: u64, n: u64) -> Res {
    let end = addr.checked_add(n).ok_or(err::INVALID_VALUE)?;
    let t = table().read().unwrap_or_else(|e| e.into_inner());
    let (base, r) = t.range(..=addr).next_back().ok_or(err::INVALID_VALUE)?;
    let mut reach = base + r.size;
    if addr > reach || (n > 0 && addr == reach) {
        return Err(err::INVALID_VALUE);
    }
    while reach < end {
        reach += t.get(&reach).ok_or(err::INVALID_VALUE)?.size;
    }
    Ok(())
}

/// For unified-addressing copies: is this address device memory (checked), or host memory?
fn classify(addr: u64, n: u64, write: bool) -> Result<(), CUresult> {
    match device_range(addr, n, write) {
        Ok(_) => Ok(()),
        Err(_) if in_any_arena(addr) => Err(err::INVALID_VALUE), // freed or out of bounds
        Err(_) if addr == 0 => Err(err::INVALID_VALUE),
        Err(_) => Ok(()), // host memory: the caller vouches for it
    }
}

fn in_any_arena(addr: u64) -> bool {
    let d = match drv() {
        Ok(d) => d,
        Err(_) => return false,
    };
    (0..d.sim.model.devices.len()).any(|i| arena(i).map(|a| a.contains(addr)).unwrap_or(false))
        || low_arena().map(|a| a.contains(addr)).unwrap_or(false)
        || va_arena().map(|a| a.contains(addr)).unwrap_or(false)
}

/// A synchronous copy waits for the work queued before it in the context (legacy stream rules).
fn wait_for_context() -> Res {
    let (_, c) = ctx::current()?;
    exec::sync_device_work(&c);
    Ok(())
}

fn copy_htod(dst: u64, src: *const c_void, n: usize) -> Res {
    ctx::current()?;
    if src.is_null() && n > 0 {
        return Err(err::INVALID_VALUE);
    }
    device_range(dst, n as u64, true)?;
    crate::copy_bytes(dst, src as u64, n);
    Ok(())
}

fn copy_dtoh(dst: *mut c_void, src: u64, n: usize) -> Res {
    ctx::current()?;
    if dst.is_null() && n > 0 {
        return Err(err::INVALID_VALUE);
    }
    device_range(src, n as u64, false)?;
    crate::copy_bytes(dst as u64, src, n);
    Ok(())
}

fn copy_dtod(dst: u64, src: u64, n: usize) -> Res {
    ctx::current()?;
    device_range(src, n as u64, false)?;
    device_range(dst, n as u64, true)?;
    crate::copy_bytes(dst, src, n);
    Ok(())
}

fn copy_any(dst: u64, src: u64, n: usize) -> Res {
    ctx::current()?;
    classify(src, n as u64, false)?;
    classify(dst, n as u64, true)?;
    crate::copy_bytes(dst, src, n);
    Ok(())
}

fn memset(dst: u64, value: u32, elem: usize, count: usize) -> Res {
    ctx::current()?;
    let n = elem.checked_mul(count).ok_or(err::INVALID_VALUE)?;
    if !dst.is_multiple_of(elem as u64) {
        return Err(err::INVALID_VALUE);
    }
    device_range(dst, n as u64, true)?;
    let bytes = value.to_le_bytes();
    let pattern = &bytes[..elem];
    // SAFETY: [dst, dst + n) was just checked to lie inside one live allocation of ours.
    let buf = unsafe { std::slice::from_raw_parts_mut(dst as *mut u8, n) };
    for chunk in buf.chunks_exact_mut(elem) {
        chunk.copy_from_slice(pattern);
    }
    Ok(())
}

// ---- stream-ordered pools -----------------------------------------------------------------------

pub(crate) struct Pool {
    dev: usize,
    is_default: bool,
    /// cuMemPoolDestroy was called while allocations were outstanding: the handle is invalid
    /// to the program, but the pool (and what it reserves) lives until the last one is freed.
    destroyed: AtomicBool,
    st: Mutex<PoolState>,
}

#[derive(Default)]
struct PoolState {
    reserved: u64,
    used: u64,
    reserved_high: u64,
    used_high: u64,
    threshold: u64,
    reuse: [c_int; 3],
}

impl Pool {
    fn take(&self, bytes: u64) -> Res {
        let mut s = self.st.lock().unwrap_or_else(|e| e.into_inner());
        let spare = s.reserved - s.used;
        if spare < bytes {
            let grow = round_up(bytes - spare, GRANULARITY);
            charge(self.dev, grow)?;
            s.reserved += grow;
            s.reserved_high = s.reserved_high.max(s.reserved);
        }
        s.used += bytes;
        s.used_high = s.used_high.max(s.used);
        Ok(())
    }
    fn give_back(&self, bytes: u64) {
        let mut s = self.st.lock().unwrap_or_else(|e| e.into_inner());
        s.used = s.used.saturating_sub(bytes);
    }
    /// Returns reserved memory above max(used, keep) to the device.
    fn trim(&self, keep: u64) {
        let mut s = self.st.lock().unwrap_or_else(|e| e.into_inner());
        // Capped before rounding: a release threshold of UINT64_MAX ("never release", which
        // PyTorch's cudaMallocAsync backend sets) would overflow the rounding.
        let floor = round_up(s.used.max(keep).min(s.reserved), GRANULARITY).min(s.reserved);
        let excess = s.reserved - floor;
        if excess > 0 {
            s.reserved -= excess;
            uncharge(self.dev, excess);
        }
    }
}

fn pools() -> &'static Registry<Pool> {
    static R: OnceLock<Registry<Pool>> = OnceLock::new();
    R.get_or_init(Registry::new)
}

/// A pool the program may still use (not destroyed).
fn live_pool(h: usize) -> Result<Arc<Pool>, CUresult> {
    pools()
        .get(h)
        .ok()
        .filter(|p| !p.destroyed.load(Acquire))
        .ok_or(err::INVALID_VALUE)
}

/// A destroyed pool whose last outstanding allocation was just freed: its memory goes now.
fn finish_destroyed(h: usize, p: &Pool) {
    if p.destroyed.load(Acquire) && p.st.lock().unwrap_or_else(|e| e.into_inner()).used == 0 {
        p.trim(0);
        let _ = pools().remove(h);
    }
}

/// At a synchronization point that names no device (an event's), every device's pools trim.
pub(crate) fn trim_all_pools_at_sync() {
    if let Ok(d) = drv() {
        for dev in 0..d.sim.model.devices.len() {
            trim_pools_at_sync(dev);
        }
    }
}

/// (default pool, current pool) handles per device.
fn device_pools() -> &'static Vec<Mutex<(usize, usize)>> {
    static P: OnceLock<Vec<Mutex<(usize, usize)>>> = OnceLock::new();
    P.get_or_init(|| {
        (0..cuvisor_sim::model::MAX_DEVICES)
            .map(|_| Mutex::new((0, 0)))
            .collect()
    })
}

fn default_pool(dev: usize) -> usize {
    let mut p = device_pools()[dev]
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if p.0 == 0 {
        let (h, _) = pools().insert(Pool {
            dev,
            is_default: true,
            destroyed: AtomicBool::new(false),
            st: Mutex::new(PoolState::default()),
        });
        *p = (h, h);
    }
    p.0
}

fn current_pool(dev: usize) -> usize {
    default_pool(dev);
    device_pools()[dev]
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .1
}

/// At a synchronization point, pools on `dev` release what exceeds their threshold.
pub(crate) fn trim_pools_at_sync(dev: usize) {
    let list: Vec<Arc<Pool>> = {
        let mut v = Vec::new();
        pools().retain(|_, p| {
            if p.dev == dev && !p.destroyed.load(Acquire) {
                v.push(p.clone());
            }
            true
        });
        v
    };
    for p in list {
        let keep = p.st.lock().unwrap_or_else(|e| e.into_inner()).threshold;
        p.trim(keep);
    }
}

fn alloc_from_pool(
    dptr: *mut CUdeviceptr,
    size: usize,
    pool_h: usize,
    s: CUstream,
    pt: bool,
) -> Res {
    if dptr.is_null() || size == 0 {
        return Err(err::INVALID_VALUE);
    }
    let stream = exec::stream(s, pt)?;
    let pool = live_pool(pool_h)?;
    // "During stream capture, this function results in the creation of an allocation node. In
    // this case, the allocation is owned by the graph instead of the memory pool. The memory
    // pool's properties are used to set the node's creation parameters" (cuMemAllocAsync and
    // cuMemAllocFromPoolAsync, CUDA driver API reference): the pool grows by nothing, and the
    // graph's memory is taken from the device's graph memory pool when the graph runs.
    if let Some(r) = exec::capture_alloc(&stream, pool.dev, size as u64) {
        return write(dptr, r?);
    }
    let rounded = round_up(size as u64, ALIGN);
    pool.take(rounded)?;
    let ch = ctx::current()?.0;
    match alloc_on(pool.dev, ch, rounded, Kind::Pool(pool_h), Some(0)) {
        Ok(a) => write(dptr, a),
        Err(e) => {
            pool.give_back(rounded);
            let _ = stream;
            Err(e)
        }
    }
}

fn alloc_async(dptr: *mut CUdeviceptr, size: usize, s: CUstream, pt: bool) -> Res {
    let stream = exec::stream(s, pt)?;
    alloc_from_pool(dptr, size, current_pool(stream.dev), s, pt)
}

fn free_async(dptr: CUdeviceptr, s: CUstream, pt: bool) -> Res {
    let stream = exec::stream(s, pt)?;
    // "During stream capture, this function results in the creation of a free node"
    // (cuMemFreeAsync, CUDA driver API reference): nothing is freed now.
    if let Some(r) = exec::capture_free(&stream, dptr) {
        return r;
    }
    free(dptr, |_| true)
}

// ---- graph memory ----------------------------------------------------------------------------
//
// The CUDA Programming Guide, "Graph Memory Nodes" (CUDA 12/13; sections cited by number):
// - a memory-allocation node's address is fixed when the node is made and "remains fixed across
//   instantiations and launches" (cuGraphAddMemAllocNode); making it takes no physical memory;
// - "Physical memory cannot be allocated or mapped during graph instantiation because the stream
//   in which the graph will execute is unknown. Mapping is done instead during graph launch.
//   Calling cudaGraphUpload can separate out the cost of allocation from the launch by performing
//   all mappings for that graph immediately" (16.5.1);
// - the memory comes from a per-device graph memory pool ("cudaDeviceGraphMemTrim operates on a
//   different pool from cudaMemPoolTrimTo(). The graph memory pool is not exposed to the stream
//   ordered memory allocator", 16.6) which keeps it reserved after the graph completes:
//   "destroying a graph which contains memory nodes (even if their allocations are free) will
//   not immediately return physical memory to the OS"; cuDeviceGraphMemTrim "will unmap and
//   release any physical memory reserved by graph memory nodes that is not actively in use.
//   Allocations that have not been freed and graphs that are scheduled or running are
//   considered to be actively using the physical memory" (16.6);
// - graphs launched one after another share physical memory (16.4.2), so the pool grows only
//   when what is live now plus what a launch allocates exceeds what it reserves.
// The pool reserves in GRANULARITY steps (as stream-ordered pools do here; the real driver's step
// is not documented). Its reserve is charged to the device and to this process; its attributes
// (cuDeviceGetGraphMemAttribute) answer from the figures below: "used" is what live graph
// allocations and graphs still running hold, "reserved" what the pool holds.

/// The address of one memory-allocation node.
pub(crate) struct GraphAlloc {
    pub addr: u64,
    /// Rounded to ALIGN, as every allocation here.
    pub size: u64,
    /// What the node asked for (CUDA_MEM_ALLOC_NODE_PARAMS.bytesize).
    pub bytesize: u64,
    pub dev: usize,
    st: Mutex<GraphAllocState>,
}

#[derive(Default)]
struct GraphAllocState {
    /// Backed by the pool and usable (between the node's execution and its free).
    live: bool,
    /// The node's graph is gone: the address goes back when the allocation is freed.
    orphan: bool,
}

impl GraphAlloc {
    pub fn live(&self) -> bool {
        self.st.lock().unwrap_or_else(|e| e.into_inner()).live
    }
}

#[derive(Default)]
struct GraphPool {
    reserved: u64,
    reserved_high: u64,
    /// Bytes of live graph allocations.
    live: u64,
    used_high: u64,
    /// Graph launches still running: (when they end, the bytes they allocate and free inside).
    running: Vec<(u64, u64)>,
}

impl GraphPool {
    /// What is actively in use now: live allocations and graphs still running.
    fn in_use(&mut self) -> u64 {
        let now = now_ns();
        self.running.retain(|&(end, _)| end > now);
        self.live + self.running.iter().map(|&(_, b)| b).sum::<u64>()
    }
}

fn graph_pools() -> &'static Vec<Mutex<GraphPool>> {
    static P: OnceLock<Vec<Mutex<GraphPool>>> = OnceLock::new();
    P.get_or_init(|| {
        (0..cuvisor_sim::model::MAX_DEVICES)
            .map(|_| Mutex::new(GraphPool::default()))
            .collect()
    })
}

fn graph_pool(dev: usize) -> std::sync::MutexGuard<'static, GraphPool> {
    graph_pools()[dev].lock().unwrap_or_else(|e| e.into_inner())
}

/// Every node's allocation, by address (for free nodes, frees outside the graph, params).
fn graph_allocs() -> &'static Mutex<BTreeMap<u64, Arc<GraphAlloc>>> {
    static M: OnceLock<Mutex<BTreeMap<u64, Arc<GraphAlloc>>>> = OnceLock::new();
    M.get_or_init(|| Mutex::new(BTreeMap::new()))
}

/// A new memory-allocation node's address on device `dev`: address space only, no memory.
pub(crate) fn graph_alloc_new(dev: usize, bytesize: u64) -> Result<Arc<GraphAlloc>, CUresult> {
    if bytesize == 0 {
        return Err(err::INVALID_VALUE);
    }
    let size = bytesize
        .checked_add(ALIGN - 1)
        .map(|n| n / ALIGN * ALIGN)
        .ok_or(err::OUT_OF_MEMORY)?;
    let addr = arena(dev)?.alloc(size).ok_or(err::OUT_OF_MEMORY)?;
    let a = Arc::new(GraphAlloc {
        addr,
        size,
        bytesize,
        dev,
        st: Mutex::new(GraphAllocState::default()),
    });
    graph_allocs()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(addr, a.clone());
    Ok(a)
}

/// The memory-allocation node whose allocation starts at `addr`.
pub(crate) fn graph_alloc_at(addr: u64) -> Option<Arc<GraphAlloc>> {
    graph_allocs()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&addr)
        .cloned()
}

/// Makes sure device `dev`'s graph memory pool holds what is in use now plus `more` bytes,
/// growing it (charged to the device) if need be: CUDA_ERROR_OUT_OF_MEMORY when the device
/// cannot give it, with nothing changed.
pub(crate) fn graph_reserve(dev: usize, more: u64) -> Res {
    let mut p = graph_pool(dev);
    let want = p.in_use().saturating_add(more);
    if want > p.reserved {
        let grow = round_up(want - p.reserved, GRANULARITY);
        charge(dev, grow)?;
        p.reserved += grow;
        p.reserved_high = p.reserved_high.max(p.reserved);
    }
    Ok(())
}

/// A launch whose graph allocates and frees `bytes` inside itself, running until `end`: those
/// bytes stay in use (and unreleasable by a trim) until it ends.
pub(crate) fn graph_running(dev: usize, end: u64, bytes: u64) {
    if bytes > 0 {
        let mut p = graph_pool(dev);
        p.running.push((end, bytes));
        let used = p.live + p.running.iter().map(|&(_, b)| b).sum::<u64>();
        p.used_high = p.used_high.max(used);
    }
}

/// The allocation node ran: its memory, from the pool (reserved by `graph_reserve` before), is
/// now a live allocation of context `ch`. INVALID_VALUE if it still is (the launch's caller
/// checks that first).
pub(crate) fn graph_alloc_map(a: &GraphAlloc, ch: usize) -> Res {
    {
        let mut st = a.st.lock().unwrap_or_else(|e| e.into_inner());
        if st.live {
            return Err(err::INVALID_VALUE);
        }
        st.live = true;
    }
    {
        let mut p = graph_pool(a.dev);
        p.live += a.size;
        let used = p.live + p.running.iter().map(|&(_, b)| b).sum::<u64>();
        p.used_high = p.used_high.max(used);
    }
    let rec = Alloc {
        size: a.size,
        charged: 0,
        share: None,
        dev: a.dev,
        ctx: ch,
        kind: Kind::Graph,
        dirty: AtomicBool::new(false),
    };
    table()
        .write()
        .unwrap_or_else(|e| e.into_inner())
        .insert(a.addr, rec);
    Ok(())
}

/// A free node ran, or the program freed a live graph allocation (cuMemFree, cuMemFreeAsync).
pub(crate) fn graph_alloc_free(addr: u64) -> Res {
    free(addr, |k| k == Kind::Graph)
}

/// What `release` does for a graph allocation: the pool keeps the memory (reserved), the address
/// stays the node's unless its graph is gone.
fn graph_alloc_released(addr: u64, dirty: bool) {
    let Some(a) = graph_alloc_at(addr) else {
        return;
    };
    let orphan = {
        let mut st = a.st.lock().unwrap_or_else(|e| e.into_inner());
        st.live = false;
        st.orphan
    };
    {
        let mut p = graph_pool(a.dev);
        p.live = p.live.saturating_sub(a.size);
    }
    if orphan {
        graph_alloc_forget(&a, dirty);
    }
}

fn graph_alloc_forget(a: &GraphAlloc, dirty: bool) {
    graph_allocs()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .remove(&a.addr);
    if let Ok(ar) = arena(a.dev) {
        ar.free(a.addr, a.size, dirty);
    }
}

/// The node's graph was destroyed: its address goes back now, or when a live allocation of it
/// is freed ("The application must explicitly free the unfreed memory", 16.3.4).
pub(crate) fn graph_alloc_orphan(a: &GraphAlloc) {
    let live = {
        let mut st = a.st.lock().unwrap_or_else(|e| e.into_inner());
        st.orphan = true;
        st.live
    };
    if !live {
        graph_alloc_forget(a, true);
    }
}

/// cuDeviceGraphMemTrim, and a context's teardown: what the pool reserves beyond what is in use
/// goes back to the device.
pub(crate) fn graph_trim(dev: usize) {
    let mut p = graph_pool(dev);
    let keep = round_up(p.in_use(), GRANULARITY).min(p.reserved);
    let excess = p.reserved - keep;
    if excess > 0 {
        p.reserved = keep;
        uncharge(dev, excess);
    }
}

fn graph_attribute(dev: usize, attr: c_int) -> Result<u64, CUresult> {
    let mut p = graph_pool(dev);
    Ok(match attr {
        CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT => p.in_use(),
        CU_GRAPH_MEM_ATTR_USED_MEM_HIGH => p.used_high,
        CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT => p.reserved,
        CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH => p.reserved_high,
        _ => return Err(err::INVALID_VALUE),
    })
}

// ---- VMM ----------------------------------------------------------------------------------------

struct Phys {
    /// The device charged, if the memory is device memory we created (not an import).
    charged_dev: Option<usize>,
    dev: Option<usize>,
    size: u64,
    /// (handles of this process still to be released, mappings): the handle cuMemCreate or an
    /// import gave, and each cuMemRetainAllocationHandle of it.
    st: Mutex<(u32, u32)>,
    /// Once the memory was exported (and for every import of it): its shared-memory entry
    /// (index, generation), which holds the charge instead of this process.
    share: Mutex<Option<(usize, u64)>>,
    /// The exported file (a memfd naming the entry) that exports hand out duplicates of.
    export_fd: Mutex<c_int>,
    /// What cuMemGetAllocationPropertiesFromHandle answers: cuMemCreate's properties (an
    /// import's: its device, and the POSIX file descriptor it came as).
    prop: Prop,
}

/// The parts of a CUmemAllocationProp a handle keeps (its `win32HandleMetaData` pointer is
/// meaningless on Linux and not kept).
#[derive(Clone, Copy)]
struct Prop {
    type_: c_int,
    handle_types: c_int,
    location: CUmemLocation,
    alloc_flags: [u8; 8],
}

fn phys() -> &'static Registry<Phys> {
    static R: OnceLock<Registry<Phys>> = OnceLock::new();
    R.get_or_init(Registry::new)
}

/// Physical memory is reference counted by its handles and their mappings, as the driver API
/// documents for cuMemRelease: "The memory allocation will be freed when all outstanding
/// mappings to the memory are unmapped and when all outstanding references to the handle
/// (including it's shareable counterparts) are also released. [...] Each time a recipient
/// process imports a shareable handle, it needs to pair it with cuMemRelease for the handle to
/// be freed." (CUDA Driver API, Virtual Memory Management, cuMemRelease; also
/// https://nvidia.github.io/cuda-python/ cuda.bindings.driver.cuMemRelease). A handle of this
/// process goes when it is released and unmapped; shared memory goes when the last process
/// holding it lets go (or dies), whichever process created it.
fn phys_drop_if_unused(h: usize, p: &Phys) {
    let (refs, maps) = *p.st.lock().unwrap_or_else(|e| e.into_inner());
    if !(refs == 0 && maps == 0 && phys().remove(h).is_ok()) {
        return;
    }
    let fd = std::mem::replace(
        &mut *p.export_fd.lock().unwrap_or_else(|e| e.into_inner()),
        -1,
    );
    if fd >= 0 {
        // SAFETY: closing our own copy of the exported file (importers hold their own).
        unsafe { libc::close(fd) };
    }
    match (
        *p.share.lock().unwrap_or_else(|e| e.into_inner()),
        p.charged_dev,
    ) {
        (Some((i, _)), _) => unref_share(i),
        (None, Some(dev)) => uncharge(dev, p.size),
        (None, None) => {}
    }
}

/// How many of this process's handles and pointers hold each shared-memory entry: the entry's
/// lease is one lock per process, taken with the first and dropped with the last.
fn share_refs() -> &'static Mutex<HashMap<usize, u32>> {
    static R: OnceLock<Mutex<HashMap<usize, u32>>> = OnceLock::new();
    R.get_or_init(|| Mutex::new(HashMap::new()))
}

/// One more holder in this process of entry `i` (generation `generation`); false when that
/// memory is gone.
fn ref_share(i: usize, generation: u64) -> Result<(), CUresult> {
    let d = drv()?;
    let mut r = share_refs().lock().unwrap_or_else(|e| e.into_inner());
    if !d.sim.shared.share_hold(i, generation) {
        return Err(err::INVALID_VALUE);
    }
    *r.entry(i).or_insert(0) += 1;
    Ok(())
}

fn unref_share(i: usize) {
    let Ok(d) = drv() else { return };
    let mut r = share_refs().lock().unwrap_or_else(|e| e.into_inner());
    if let Some(n) = r.get_mut(&i) {
        *n -= 1;
        if *n == 0 {
            r.remove(&i);
            d.sim.shared.share_let_go(i);
        }
    }
}

/// Moves `bytes` charged to this process on `dev` into a new shared entry held by it.
fn open_share(dev: usize, bytes: u64) -> Result<(usize, u64), CUresult> {
    let d = drv()?;
    let mut r = share_refs().lock().unwrap_or_else(|e| e.into_inner());
    let (i, generation) = d
        .sim
        .shared
        .share_open(d.slot, dev, bytes)
        .ok_or(err::OUT_OF_MEMORY)?;
    *r.entry(i).or_insert(0) += 1;
    Ok((i, generation))
}

const RECORD_LEN: usize = 96;

/// A memfd naming shared entry (i, generation) of `size` bytes on `dev`: what an exported
/// descriptor carries to whoever imports it (SCM_RIGHTS, pidfd_getfd).
fn export_file(
    dev: Option<usize>,
    size: u64,
    i: usize,
    generation: u64,
) -> Result<c_int, CUresult> {
    let record = format!(
        "cuvisor-sim-vmm {} {size} {i} {generation}\n",
        dev.map(|d| d as i64).unwrap_or(-1)
    );
    if record.len() > RECORD_LEN {
        return Err(err::UNKNOWN);
    }
    // SAFETY: memfd_create with a static NUL-terminated name; we own the returned fd.
    let fd = unsafe { libc::memfd_create(c"cuvisor-sim-vmm".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(err::UNKNOWN);
    }
    // SAFETY: fd is ours; record is a live buffer of the given length.
    if unsafe { libc::pwrite(fd, record.as_ptr() as *const c_void, record.len(), 0) }
        != record.len() as isize
    {
        // SAFETY: closing our own fd.
        unsafe { libc::close(fd) };
        return Err(err::UNKNOWN);
    }
    Ok(fd)
}

fn reservations() -> &'static Mutex<BTreeMap<u64, u64>> {
    static R: OnceLock<Mutex<BTreeMap<u64, u64>>> = OnceLock::new();
    R.get_or_init(|| Mutex::new(BTreeMap::new()))
}

fn location_device(loc: CUmemLocation) -> Result<Option<usize>, CUresult> {
    match loc.type_ {
        CU_MEM_LOCATION_TYPE_DEVICE => {
            let d = drv()?;
            let i = usize::try_from(loc.id).map_err(|_| err::INVALID_DEVICE)?;
            if i >= d.sim.model.devices.len() {
                return Err(err::INVALID_DEVICE);
            }
            Ok(Some(i))
        }
        2..=4 => Ok(None), // HOST, HOST_NUMA, HOST_NUMA_CURRENT: host memory, no device charge
        _ => Err(err::INVALID_VALUE),
    }
}

// ---- arrays -------------------------------------------------------------------------------------

struct ArrayObj {
    dev: usize,
    ctx: usize,
    charged: u64,
}

fn arrays() -> &'static Registry<ArrayObj> {
    static R: OnceLock<Registry<ArrayObj>> = OnceLock::new();
    R.get_or_init(Registry::new)
}

/// Bytes of an array, or CUDA_ERROR_INVALID_VALUE where the driver refuses its descriptor
/// (see `array_bytes` in cuda-abi: every format of the CUDA 13 headers, checked arithmetic; a
/// size that does not fit in 64 bits needs extents beyond every device's maximum, which the
/// real driver refuses with CUDA_ERROR_INVALID_VALUE).
fn array_bytes(
    w: usize,
    h: usize,
    d: usize,
    format: c_int,
    channels: c_uint,
    levels: u32,
) -> Result<u64, CUresult> {
    cuvisor_cuda_abi::cuda::array_bytes(w as u64, h as u64, d as u64, format, channels, levels)
        .ok_or(err::INVALID_VALUE)
}

fn create_array(out: *mut CUarray, bytes: u64) -> Res {
    let (ch, c) = ctx::current()?;
    if out.is_null() {
        return Err(err::INVALID_VALUE);
    }
    let charged = bytes
        .checked_next_multiple_of(ALIGN)
        .ok_or(err::INVALID_VALUE)?;
    charge(c.dev, charged)?;
    let (h, _) = arrays().insert(ArrayObj {
        dev: c.dev,
        ctx: ch,
        charged,
    });
    write(out, h as CUarray)
}

fn destroy_array(h: usize) -> Res {
    drv()?;
    let a = arrays().remove(h)?;
    uncharge(a.dev, a.charged);
    Ok(())
}

// ---- host memory --------------------------------------------------------------------------------

fn host_allocs() -> &'static Mutex<HashSet<usize>> {
    static H: OnceLock<Mutex<HashSet<usize>>> = OnceLock::new();
    H.get_or_init(|| Mutex::new(HashSet::new()))
}

fn host_alloc(pp: *mut *mut c_void, size: usize) -> Res {
    ctx::current()?;
    if pp.is_null() {
        return Err(err::INVALID_VALUE);
    }
    // SAFETY: plain malloc of the requested size; ownership is tracked in host_allocs.
    let p = unsafe { libc::malloc(size.max(1)) };
    if p.is_null() {
        return Err(err::OUT_OF_MEMORY);
    }
    host_allocs()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(p as usize);
    write(pp, p)
}

/// Rate-limited reclaim of dead processes' memory before reporting free memory.
fn reclaim_now_and_then() {
    static LAST: AtomicU64 = AtomicU64::new(0);
    let now = now_ns();
    let last = LAST.load(Relaxed);
    if now.saturating_sub(last) > 50_000_000
        && LAST.compare_exchange(last, now, Relaxed, Relaxed).is_ok()
    {
        if let Ok(d) = drv() {
            d.sim.shared.reclaim_dead();
        }
    }
}

fn mem_info() -> Result<(u64, u64), CUresult> {
    let (_, c) = ctx::current()?;
    reclaim_now_and_then();
    let d = drv()?;
    let total = d.sim.model.devices[c.dev].memory;
    let used = d.sim.shared.device(c.dev).mem_used.load(Acquire);
    Ok((total.saturating_sub(used), total))
}

const IPC_MAGIC: u64 = 0x4356_4950_4331_0001;

export! {
    fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) {
        let (f, t) = mem_info()?;
        write(free, f as usize)?;
        write(total, t as usize)
    }
    /// v1 (CUDA 2.0): 32-bit out-parameters, clamped rather than wrapped.
    fn cuMemGetInfo(free: *mut c_uint, total: *mut c_uint) {
        let (f, t) = mem_info()?;
        write(free, f.min(u32::MAX as u64) as c_uint)?;
        write(total, t.min(u32::MAX as u64) as c_uint)
    }

    fn cuMemAlloc_v2(dptr: *mut CUdeviceptr, size: usize) {
        if dptr.is_null() {
            return Err(err::INVALID_VALUE);
        }
        write(dptr, alloc(size as u64, Kind::Device, None)?)
    }
    /// v1: a 32-bit `CUdeviceptr_v1`, so the memory comes from below 4 GiB.
    fn cuMemAlloc(dptr: *mut c_uint, size: c_uint) {
        if dptr.is_null() {
            return Err(err::INVALID_VALUE);
        }
        let a = alloc(size as u64, Kind::V1, None)?;
        write(dptr, a as c_uint)
    }
    fn cuMemFree_v2(dptr: CUdeviceptr) {
        if dptr == 0 {
            return Ok(()); // freeing NULL is a no-op
        }
        free(dptr, |k| !matches!(k, Kind::Mapped(_) | Kind::Ipc | Kind::ModuleGlobal))
    }
    fn cuMemFree(dptr: c_uint) {
        if dptr == 0 {
            return Ok(());
        }
        free(dptr as u64, |k| k == Kind::V1)
    }
    fn cuMemAllocPitch_v2(dptr: *mut CUdeviceptr, pitch: *mut usize, width: usize, height: usize, elem: c_uint) {
        if dptr.is_null() || pitch.is_null() || width == 0 || height == 0 || !matches!(elem, 4 | 8 | 16) {
            return Err(err::INVALID_VALUE);
        }
        let p = round_up(width as u64, ALIGN);
        let a = alloc(p.checked_mul(height as u64).ok_or(err::INVALID_VALUE)?, Kind::Device, None)?;
        write(pitch, p as usize)?;
        write(dptr, a)
    }
    fn cuMemAllocPitch(dptr: *mut c_uint, pitch: *mut c_uint, width: c_uint, height: c_uint, elem: c_uint) {
        if dptr.is_null() || pitch.is_null() || width == 0 || height == 0 || !matches!(elem, 4 | 8 | 16) {
            return Err(err::INVALID_VALUE);
        }
        let p = round_up(width as u64, ALIGN);
        let a = alloc(p * height as u64, Kind::V1, None)?;
        write(pitch, p as c_uint)?;
        write(dptr, a as c_uint)
    }
    fn cuMemAllocManaged(dptr: *mut CUdeviceptr, size: usize, flags: c_uint) {
        if dptr.is_null() || !matches!(flags, CU_MEM_ATTACH_GLOBAL | CU_MEM_ATTACH_HOST) {
            return Err(err::INVALID_VALUE);
        }
        write(dptr, alloc(size as u64, Kind::Managed, None)?)
    }

    fn cuMemGetAddressRange_v2(base: *mut CUdeviceptr, size: *mut usize, dptr: CUdeviceptr) {
        drv()?;
        let t = table().read().unwrap_or_else(|e| e.into_inner());
        let (b, r) = t.range(..=dptr).next_back().ok_or(err::NOT_FOUND)?;
        if dptr >= b + r.size {
            return Err(err::NOT_FOUND);
        }
        if !base.is_null() {
            write(base, *b)?;
        }
        if !size.is_null() {
            write(size, r.size as usize)?;
        }
        Ok(())
    }

    /// cuPointerGetAttributes: each attribute as cuPointerGetAttribute answers it. The driver
    /// documents that this call does not fail for a pointer it does not know; then the outputs the
    /// single-attribute call would refuse are left as they were.
    fn cuPointerGetAttributes(n: c_uint, attributes: *const c_int, data: *mut *mut c_void, ptr: CUdeviceptr) {
        drv()?;
        if n > 0 && (attributes.is_null() || data.is_null()) {
            return Err(err::INVALID_VALUE);
        }
        for i in 0..n as usize {
            // SAFETY: by the API contract both arrays hold `n` elements.
            let (a, d) = unsafe { (*attributes.add(i), *data.add(i)) };
            let _ = cuPointerGetAttribute(d, a, ptr);
        }
        Ok(())
    }
    fn cuPointerGetAttribute(data: *mut c_void, attribute: c_int, ptr: CUdeviceptr) {
        drv()?;
        let t = table().read().unwrap_or_else(|e| e.into_inner());
        let (b, r) = t.range(..=ptr).next_back().ok_or(err::INVALID_VALUE)?;
        if ptr >= b + r.size {
            return Err(err::INVALID_VALUE);
        }
        match attribute {
            CU_POINTER_ATTRIBUTE_CONTEXT => write(data as *mut CUcontext, r.ctx as CUcontext),
            CU_POINTER_ATTRIBUTE_MEMORY_TYPE => write(data as *mut c_uint, CU_MEMORYTYPE_DEVICE),
            CU_POINTER_ATTRIBUTE_DEVICE_POINTER => write(data as *mut CUdeviceptr, ptr),
            CU_POINTER_ATTRIBUTE_IS_MANAGED => write(data as *mut c_int, (r.kind == Kind::Managed) as c_int),
            CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL => write(data as *mut c_int, r.dev as c_int),
            CU_POINTER_ATTRIBUTE_RANGE_START_ADDR => write(data as *mut CUdeviceptr, *b),
            CU_POINTER_ATTRIBUTE_RANGE_SIZE => write(data as *mut usize, r.size as usize),
            CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE => match r.kind {
                Kind::Pool(p) => write(data as *mut CUmemoryPool, p as CUmemoryPool),
                _ => write(data as *mut CUmemoryPool, std::ptr::null_mut()),
            },
            _ => Err(err::INVALID_VALUE),
        }
    }

    fn cuMemAllocHost_v2(pp: *mut *mut c_void, size: usize) { host_alloc(pp, size) }
    fn cuMemHostAlloc(pp: *mut *mut c_void, size: usize, _flags: c_uint) { host_alloc(pp, size) }
    fn cuMemFreeHost(p: *mut c_void) {
        drv()?;
        if !host_allocs().lock().unwrap_or_else(|e| e.into_inner()).remove(&(p as usize)) {
            return Err(err::INVALID_VALUE);
        }
        // SAFETY: p came from our malloc in host_alloc and was still registered.
        unsafe { libc::free(p) };
        Ok(())
    }
    fn cuMemHostGetDevicePointer_v2(dptr: *mut CUdeviceptr, p: *mut c_void, flags: c_uint) {
        drv()?;
        if flags != 0 || p.is_null() {
            return Err(err::INVALID_VALUE);
        }
        write(dptr, p as CUdeviceptr)
    }
    fn cuMemHostRegister_v2(p: *mut c_void, size: usize, _flags: c_uint) {
        ctx::current()?;
        if p.is_null() || size == 0 { Err(err::INVALID_VALUE) } else { Ok(()) }
    }
    fn cuMemHostUnregister(p: *mut c_void) {
        ctx::current()?;
        if p.is_null() { Err(err::INVALID_VALUE) } else { Ok(()) }
    }

    fn cuMemcpyHtoD_v2(dst: CUdeviceptr, src: *const c_void, n: usize) { wait_for_context()?; copy_htod(dst, src, n) }
    fn cuMemcpyHtoD_v2_ptds(dst: CUdeviceptr, src: *const c_void, n: usize) { wait_for_context()?; copy_htod(dst, src, n) }
    fn cuMemcpyHtoD(dst: c_uint, src: *const c_void, n: c_uint) { wait_for_context()?; copy_htod(dst as u64, src, n as usize) }
    fn cuMemcpyDtoH_v2(dst: *mut c_void, src: CUdeviceptr, n: usize) { wait_for_context()?; copy_dtoh(dst, src, n) }
    fn cuMemcpyDtoH_v2_ptds(dst: *mut c_void, src: CUdeviceptr, n: usize) { wait_for_context()?; copy_dtoh(dst, src, n) }
    fn cuMemcpyDtoH(dst: *mut c_void, src: c_uint, n: c_uint) { wait_for_context()?; copy_dtoh(dst, src as u64, n as usize) }
    fn cuMemcpyDtoD_v2(dst: CUdeviceptr, src: CUdeviceptr, n: usize) { wait_for_context()?; copy_dtod(dst, src, n) }
    fn cuMemcpyDtoD_v2_ptds(dst: CUdeviceptr, src: CUdeviceptr, n: usize) { wait_for_context()?; copy_dtod(dst, src, n) }
    fn cuMemcpy(dst: CUdeviceptr, src: CUdeviceptr, n: usize) { wait_for_context()?; copy_any(dst, src, n) }
    fn cuMemcpy_ptds(dst: CUdeviceptr, src: CUdeviceptr, n: usize) { wait_for_context()?; copy_any(dst, src, n) }

    fn cuMemcpyHtoDAsync_v2(dst: CUdeviceptr, src: *const c_void, n: usize, s: CUstream) { exec::stream(s, false)?; copy_htod(dst, src, n) }
    fn cuMemcpyHtoDAsync_v2_ptsz(dst: CUdeviceptr, src: *const c_void, n: usize, s: CUstream) { exec::stream(s, true)?; copy_htod(dst, src, n) }
    fn cuMemcpyDtoHAsync_v2(dst: *mut c_void, src: CUdeviceptr, n: usize, s: CUstream) { exec::stream(s, false)?; copy_dtoh(dst, src, n) }
    fn cuMemcpyDtoHAsync_v2_ptsz(dst: *mut c_void, src: CUdeviceptr, n: usize, s: CUstream) { exec::stream(s, true)?; copy_dtoh(dst, src, n) }
    fn cuMemcpyDtoDAsync_v2(dst: CUdeviceptr, src: CUdeviceptr, n: usize, s: CUstream) { exec::stream(s, false)?; copy_dtod(dst, src, n) }
    fn cuMemcpyDtoDAsync_v2_ptsz(dst: CUdeviceptr, src: CUdeviceptr, n: usize, s: CUstream) { exec::stream(s, true)?; copy_dtod(dst, src, n) }
    fn cuMemcpyAsync(dst: CUdeviceptr, src: CUdeviceptr, n: usize, s: CUstream) { exec::stream(s, false)?; copy_any(dst, src, n) }
    fn cuMemcpyAsync_ptsz(dst: CUdeviceptr, src: CUdeviceptr, n: usize, s: CUstream) { exec::stream(s, true)?; copy_any(dst, src, n) }

    fn cuMemsetD8_v2(dst: CUdeviceptr, v: u8, n: usize) { wait_for_context()?; memset(dst, v as u32, 1, n) }
    fn cuMemsetD8_v2_ptds(dst: CUdeviceptr, v: u8, n: usize) { wait_for_context()?; memset(dst, v as u32, 1, n) }
    fn cuMemsetD16_v2(dst: CUdeviceptr, v: u16, n: usize) { wait_for_context()?; memset(dst, v as u32, 2, n) }
    fn cuMemsetD16_v2_ptds(dst: CUdeviceptr, v: u16, n: usize) { wait_for_context()?; memset(dst, v as u32, 2, n) }
    fn cuMemsetD32_v2(dst: CUdeviceptr, v: u32, n: usize) { wait_for_context()?; memset(dst, v, 4, n) }
    fn cuMemsetD32_v2_ptds(dst: CUdeviceptr, v: u32, n: usize) { wait_for_context()?; memset(dst, v, 4, n) }
    fn cuMemsetD8Async(dst: CUdeviceptr, v: u8, n: usize, s: CUstream) { exec::stream(s, false)?; memset(dst, v as u32, 1, n) }
    fn cuMemsetD8Async_ptsz(dst: CUdeviceptr, v: u8, n: usize, s: CUstream) { exec::stream(s, true)?; memset(dst, v as u32, 1, n) }
    fn cuMemsetD16Async(dst: CUdeviceptr, v: u16, n: usize, s: CUstream) { exec::stream(s, false)?; memset(dst, v as u32, 2, n) }
    fn cuMemsetD16Async_ptsz(dst: CUdeviceptr, v: u16, n: usize, s: CUstream) { exec::stream(s, true)?; memset(dst, v as u32, 2, n) }
    fn cuMemsetD32Async(dst: CUdeviceptr, v: u32, n: usize, s: CUstream) { exec::stream(s, false)?; memset(dst, v, 4, n) }
    fn cuMemsetD32Async_ptsz(dst: CUdeviceptr, v: u32, n: usize, s: CUstream) { exec::stream(s, true)?; memset(dst, v, 4, n) }

    fn cuDeviceGetDefaultMemPool(pool: *mut CUmemoryPool, dev: CUdevice) {
        let (i, _) = ctx::device(dev)?;
        write(pool, default_pool(i) as CUmemoryPool)
    }
    fn cuDeviceGetMemPool(pool: *mut CUmemoryPool, dev: CUdevice) {
        let (i, _) = ctx::device(dev)?;
        write(pool, current_pool(i) as CUmemoryPool)
    }
    fn cuDeviceSetMemPool(dev: CUdevice, pool: CUmemoryPool) {
        let (i, _) = ctx::device(dev)?;
        let p = live_pool(pool as usize)?;
        if p.dev != i {
            return Err(err::INVALID_DEVICE);
        }
        default_pool(i);
        device_pools()[i].lock().unwrap_or_else(|e| e.into_inner()).1 = pool as usize;
        Ok(())
    }
    fn cuMemPoolCreate(pool: *mut CUmemoryPool, props: *const CUmemPoolProps) {
        drv()?;
        let p: CUmemPoolProps = read(props)?;
        if p.allocType != CU_MEM_ALLOCATION_TYPE_PINNED || pool.is_null() {
            return Err(err::INVALID_VALUE);
        }
        let dev = location_device(p.location)?.ok_or(err::NOT_SUPPORTED)?;
        let (h, _) = pools().insert(Pool { dev, is_default: false, destroyed: AtomicBool::new(false), st: Mutex::new(PoolState::default()) });
        write(pool, h as CUmemoryPool)
    }
    /// The default pool cannot be destroyed. A pool with outstanding allocations is destroyed
    /// at once for the program, but its memory lives until the last of them is freed, as the
    /// driver API documents for cuMemPoolDestroy: "If any pointers obtained from this pool
    /// haven't been freed or the pool has free operations that haven't completed when
    /// cuMemPoolDestroy is invoked, the function will return immediately and the resources
    /// associated with the pool will be released automatically once there are no more
    /// outstanding allocations." (CUDA Driver API, Memory Pools; also
    /// https://nvidia.github.io/cuda-python/ cuda.bindings.driver.cuMemPoolDestroy).
    fn cuMemPoolDestroy(pool: CUmemoryPool) {
        drv()?;
        let p = live_pool(pool as usize)?;
        if p.is_default {
            return Err(err::INVALID_VALUE);
        }
        {
            let mut dp = device_pools()[p.dev].lock().unwrap_or_else(|e| e.into_inner());
            if dp.1 == pool as usize {
                dp.1 = dp.0;
            }
        }
        p.destroyed.store(true, Release);
        finish_destroyed(pool as usize, &p);
        Ok(())
    }
    fn cuMemPoolTrimTo(pool: CUmemoryPool, keep: usize) {
        drv()?;
        live_pool(pool as usize)?.trim(keep as u64);
        Ok(())
    }
    fn cuMemPoolGetAttribute(pool: CUmemoryPool, attribute: c_int, value: *mut c_void) {
        drv()?;
        let p = live_pool(pool as usize)?;
        let s = p.st.lock().unwrap_or_else(|e| e.into_inner());
        let v64 = |v: u64| write(value as *mut u64, v);
        match attribute {
            CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES..=CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES => {
                write(value as *mut c_int, s.reuse[(attribute - 1) as usize])
            }
            CU_MEMPOOL_ATTR_RELEASE_THRESHOLD => v64(s.threshold),
            CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT => v64(s.reserved),
            CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH => v64(s.reserved_high),
            CU_MEMPOOL_ATTR_USED_MEM_CURRENT => v64(s.used),
            CU_MEMPOOL_ATTR_USED_MEM_HIGH => v64(s.used_high),
            _ => Err(err::INVALID_VALUE),
        }
    }
    /// The high watermarks can only be reset (to the current value) by setting them to 0.
    fn cuMemPoolSetAttribute(pool: CUmemoryPool, attribute: c_int, value: *mut c_void) {
        drv()?;
        let p = live_pool(pool as usize)?;
        let mut s = p.st.lock().unwrap_or_else(|e| e.into_inner());
        match attribute {
            CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES..=CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES => {
                s.reuse[(attribute - 1) as usize] = read(value as *const c_int)?;
            }
            CU_MEMPOOL_ATTR_RELEASE_THRESHOLD => s.threshold = read(value as *const u64)?,
            CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH | CU_MEMPOOL_ATTR_USED_MEM_HIGH => {
                if read(value as *const u64)? != 0 {
                    return Err(err::INVALID_VALUE);
                }
                if attribute == CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH {
                    s.reserved_high = s.reserved;
                } else {
                    s.used_high = s.used;
                }
            }
            _ => return Err(err::INVALID_VALUE),
        }
        Ok(())
    }
    /// "Free unused memory that was cached on the specified device for use with graphs back to
    /// the OS. Blocks which are not in use by a graph that is either currently executing or
    /// scheduled to execute are freed" (CUDA driver API reference).
    fn cuDeviceGraphMemTrim(dev: CUdevice) {
        let (d, _) = ctx::device(dev)?;
        graph_trim(d);
        Ok(())
    }
    fn cuDeviceGetGraphMemAttribute(dev: CUdevice, attr: c_int, value: *mut c_void) {
        let (d, _) = ctx::device(dev)?;
        write(value as *mut u64, graph_attribute(d, attr)?)
    }
    /// Only the high watermarks can be set, and only to zero ("High watermark can only be reset
    /// to zero", CUDA driver API reference).
    fn cuDeviceSetGraphMemAttribute(dev: CUdevice, attr: c_int, value: *mut c_void) {
        let (d, _) = ctx::device(dev)?;
        if read(value as *const u64)? != 0 {
            return Err(err::INVALID_VALUE);
        }
        let mut p = graph_pool(d);
        match attr {
            CU_GRAPH_MEM_ATTR_USED_MEM_HIGH => p.used_high = 0,
            CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH => p.reserved_high = 0,
            _ => return Err(err::INVALID_VALUE),
        }
        Ok(())
    }
    fn cuMemAllocAsync(dptr: *mut CUdeviceptr, size: usize, s: CUstream) { alloc_async(dptr, size, s, false) }
    fn cuMemAllocAsync_ptsz(dptr: *mut CUdeviceptr, size: usize, s: CUstream) { alloc_async(dptr, size, s, true) }
    fn cuMemAllocFromPoolAsync(dptr: *mut CUdeviceptr, size: usize, pool: CUmemoryPool, s: CUstream) {
        alloc_from_pool(dptr, size, pool as usize, s, false)
    }
    fn cuMemAllocFromPoolAsync_ptsz(dptr: *mut CUdeviceptr, size: usize, pool: CUmemoryPool, s: CUstream) {
        alloc_from_pool(dptr, size, pool as usize, s, true)
    }
    fn cuMemFreeAsync(dptr: CUdeviceptr, s: CUstream) { free_async(dptr, s, false) }
    fn cuMemFreeAsync_ptsz(dptr: CUdeviceptr, s: CUstream) { free_async(dptr, s, true) }

    fn cuMemGetAllocationGranularity(g: *mut usize, prop: *const CUmemAllocationProp, _option: c_int) {
        drv()?;
        let p: CUmemAllocationProp = read(prop)?;
        location_device(p.location)?;
        write(g, GRANULARITY as usize)
    }
    fn cuMemCreate(handle: *mut CUmemGenericAllocationHandle, size: usize, prop: *const CUmemAllocationProp, flags: u64) {
        drv()?;
        let p: CUmemAllocationProp = read(prop)?;
        if handle.is_null() || flags != 0 || p.type_ != CU_MEM_ALLOCATION_TYPE_PINNED || size == 0 || !(size as u64).is_multiple_of(GRANULARITY) {
            return Err(err::INVALID_VALUE);
        }
        let dev = location_device(p.location)?;
        if let Some(d) = dev {
            charge(d, size as u64)?;
        }
        let prop = Prop { type_: p.type_, handle_types: p.requestedHandleTypes, location: p.location, alloc_flags: p.allocFlags };
        let (h, _) = phys().insert(Phys { charged_dev: dev, dev, size: size as u64, st: Mutex::new((1, 0)), share: Mutex::new(None), export_fd: Mutex::new(-1), prop });
        write(handle, h as u64)
    }
    fn cuMemRelease(handle: CUmemGenericAllocationHandle) {
        drv()?;
        let p = phys().get(handle as usize)?;
        {
            let mut st = p.st.lock().unwrap_or_else(|e| e.into_inner());
            if st.0 == 0 {
                return Err(err::INVALID_VALUE);
            }
            st.0 -= 1;
        }
        phys_drop_if_unused(handle as usize, &p);
        Ok(())
    }
    /// The properties the handle was made with (cuda.h 13.5, cuMemGetAllocationPropertiesFromHandle:
    /// "Retrieve the contents of the property structure defining properties for this handle";
    /// CUDA_ERROR_INVALID_VALUE among its documented codes, for a NULL `prop` or a handle that is
    /// not one). PyTorch 2.15 resolves this entry point when its CUDA allocator starts
    /// (c10::cuda::DriverAPI; its first allocation fails with "named symbol not found" where
    /// cuGetProcAddress does not find it). A minimal model: the i17-share branch models the VMM
    /// chapter (vmm.rs) in full and supersedes this at merge.
    fn cuMemGetAllocationPropertiesFromHandle(prop: *mut CUmemAllocationProp, handle: CUmemGenericAllocationHandle) {
        drv()?;
        if prop.is_null() {
            return Err(err::INVALID_VALUE);
        }
        let p = phys().get(handle as usize).map_err(|_| err::INVALID_VALUE)?;
        write(prop, CUmemAllocationProp {
            type_: p.prop.type_,
            requestedHandleTypes: p.prop.handle_types,
            location: p.prop.location,
            win32HandleMetaData: std::ptr::null_mut(),
            allocFlags: p.prop.alloc_flags,
        })
    }
    /// The handle of the memory mapped at `addr`, one more reference to release: "The handle is
    /// guaranteed to be the same handle value used when mapping the memory. If the address
    /// requested is not mapped, the function will fail. The returned handle must be released
    /// with corresponding number of calls to cuMemRelease." (CUDA Driver API, Virtual Memory
    /// Management, cuMemRetainAllocationHandle.) The memory then lives until that release too.
    fn cuMemRetainAllocationHandle(handle: *mut CUmemGenericAllocationHandle, addr: *mut c_void) {
        drv()?;
        if handle.is_null() {
            return Err(err::INVALID_VALUE);
        }
        let a = addr as u64;
        let h = {
            let t = table().read().unwrap_or_else(|e| e.into_inner());
            match t.range(..=a).next_back() {
                Some((b, r)) if a < b + r.size => match r.kind {
                    Kind::Mapped(h) => h,
                    _ => return Err(err::INVALID_VALUE),
                },
                _ => return Err(err::INVALID_VALUE),
            }
        };
        let p = phys().get(h).map_err(|_| err::INVALID_VALUE)?;
        p.st.lock().unwrap_or_else(|e| e.into_inner()).0 += 1;
        write(handle, h as u64)
    }
    fn cuMemAddressReserve(ptr: *mut CUdeviceptr, size: usize, _align: usize, _addr: CUdeviceptr, flags: u64) {
        drv()?;
        if ptr.is_null() || flags != 0 || size == 0 || !(size as u64).is_multiple_of(GRANULARITY) {
            return Err(err::INVALID_VALUE);
        }
        let a = va_arena()?.alloc(size as u64).ok_or(err::OUT_OF_MEMORY)?;
        reservations().lock().unwrap_or_else(|e| e.into_inner()).insert(a, size as u64);
        write(ptr, a)
    }
    fn cuMemAddressFree(ptr: CUdeviceptr, size: usize) {
        drv()?;
        let mut r = reservations().lock().unwrap_or_else(|e| e.into_inner());
        if r.get(&ptr) != Some(&(size as u64)) {
            return Err(err::INVALID_VALUE);
        }
        r.remove(&ptr);
        va_arena()?.free(ptr, size as u64, true);
        Ok(())
    }
    fn cuMemMap(ptr: CUdeviceptr, size: usize, offset: usize, handle: CUmemGenericAllocationHandle, flags: u64) {
        drv()?;
        let p = phys().get(handle as usize).map_err(|_| err::INVALID_VALUE)?;
        if flags != 0 || size == 0 || offset as u64 + size as u64 > p.size || !(size as u64).is_multiple_of(GRANULARITY) {
            return Err(err::INVALID_VALUE);
        }
        let inside = {
            let r = reservations().lock().unwrap_or_else(|e| e.into_inner());
            r.range(..=ptr).next_back().is_some_and(|(b, s)| ptr + size as u64 <= b + s)
        };
        if !inside {
            return Err(err::INVALID_VALUE);
        }
        let mut t = table().write().unwrap_or_else(|e| e.into_inner());
        let overlaps = t.range(..ptr + size as u64).next_back().is_some_and(|(b, r)| b + r.size > ptr);
        if overlaps {
            return Err(err::INVALID_VALUE);
        }
        p.st.lock().unwrap_or_else(|e| e.into_inner()).1 += 1;
        let ch = ctx::current().map(|c| c.0).unwrap_or(0);
        t.insert(ptr, Alloc { size: size as u64, charged: 0, share: None, dev: p.dev.unwrap_or(0), ctx: ch, kind: Kind::Mapped(handle as usize), dirty: AtomicBool::new(false) });
        Ok(())
    }
    fn cuMemUnmap(ptr: CUdeviceptr, size: usize) {
        drv()?;
        let end = ptr.checked_add(size as u64).ok_or(err::INVALID_VALUE)?;
        let gone: Vec<(u64, Alloc)> = {
            let mut t = table().write().unwrap_or_else(|e| e.into_inner());
            let keys: Vec<u64> = t.range(ptr..end).filter(|(_, r)| matches!(r.kind, Kind::Mapped(_))).map(|(k, _)| *k).collect();
            if keys.is_empty() {
                return Err(err::INVALID_VALUE);
            }
            keys.into_iter().filter_map(|k| t.remove(&k).map(|r| (k, r))).collect()
        };
        for (addr, rec) in gone {
            if rec.dirty.load(Relaxed) {
                // SAFETY: the range is inside our VA arena mapping and no longer mapped for the client.
                unsafe { libc::madvise(addr as *mut c_void, rec.size as usize, libc::MADV_DONTNEED) };
            }
            if let Kind::Mapped(h) = rec.kind {
                if let Ok(p) = phys().get(h) {
                    p.st.lock().unwrap_or_else(|e| e.into_inner()).1 -= 1;
                    phys_drop_if_unused(h, &p);
                }
            }
        }
        Ok(())
    }
    fn cuMemSetAccess(ptr: CUdeviceptr, size: usize, desc: *const CUmemAccessDesc, count: usize) {
        drv()?;
        if count == 0 {
            return Err(err::INVALID_VALUE);
        }
        for i in 0..count {
            let d: CUmemAccessDesc = read(desc.wrapping_add(i))?;
            location_device(d.location)?;
        }
        contiguous_range(ptr, size as u64)
    }
    fn cuMemExportToShareableHandle(out: *mut c_void, handle: CUmemGenericAllocationHandle, kind: c_int, _flags: u64) {
        drv()?;
        let p = phys().get(handle as usize)?;
        if kind != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR {
            return Err(err::NOT_SUPPORTED);
        }
        // The first export makes the memory shared: its charge leaves this process for an entry
        // that lives while any process holds the memory. Every export of one handle hands out a
        // duplicate of one file naming that entry.
        let mut share = p.share.lock().unwrap_or_else(|e| e.into_inner());
        let (i, generation) = match *share {
            Some(s) => s,
            None => {
                let s = open_share(p.dev.unwrap_or(0), if p.charged_dev.is_some() { p.size } else { 0 })?;
                *share = Some(s);
                s
            }
        };
        let mut own = p.export_fd.lock().unwrap_or_else(|e| e.into_inner());
        if *own < 0 {
            *own = export_file(p.dev, p.size, i, generation)?;
        }
        // SAFETY: duplicating our own open memfd; the caller owns the new descriptor.
        let fd = unsafe { libc::fcntl(*own, libc::F_DUPFD_CLOEXEC, 0) };
        if fd < 0 {
            return Err(err::UNKNOWN);
        }
        write(out as *mut c_int, fd)
    }
    fn cuMemImportFromShareableHandle(handle: *mut CUmemGenericAllocationHandle, os_handle: *mut c_void, kind: c_int) {
        drv()?;
        if kind != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR || handle.is_null() {
            return Err(err::INVALID_VALUE);
        }
        let fd = os_handle as usize as c_int;
        let mut buf = [0u8; RECORD_LEN];
        // SAFETY: reading at most buf.len() bytes into our own buffer from the caller's fd.
        let n = unsafe { libc::pread(fd, buf.as_mut_ptr() as *mut c_void, buf.len(), 0) };
        let text = std::str::from_utf8(&buf[..n.max(0) as usize]).map_err(|_| err::INVALID_VALUE)?;
        let line = text.split('\n').next().unwrap_or("");
        let mut parts = line.split(' ');
        if parts.next() != Some("cuvisor-sim-vmm") {
            return Err(err::INVALID_VALUE);
        }
        let mut num = || parts.next().and_then(|x| x.parse::<i64>().ok()).ok_or(err::INVALID_VALUE);
        let (dev, size, i, generation) = (num()?, num()?, num()?, num()?);
        // Imported memory is the exporter's: nothing new is charged, but this process holds it
        // (every handle to it gone: so is the memory, and the import fails).
        ref_share(i as usize, generation as u64)?;
        let (h, _) = phys().insert(Phys {
            charged_dev: None,
            dev: usize::try_from(dev).ok(),
            size: size as u64,
            st: Mutex::new((1, 0)),
            share: Mutex::new(Some((i as usize, generation as u64))),
            export_fd: Mutex::new(-1),
            prop: Prop {
                type_: CU_MEM_ALLOCATION_TYPE_PINNED,
                handle_types: CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                location: CUmemLocation { type_: if dev >= 0 { CU_MEM_LOCATION_TYPE_DEVICE } else { 2 }, id: dev.max(0) as c_int },
                alloc_flags: [0; 8],
            },
        });
        write(handle, h as u64)
    }

    /// The first export makes the allocation shared: its charge leaves this process for an
    /// entry that the allocation and every opened handle to it hold (see `ipc_open`).
    fn cuIpcGetMemHandle(handle: *mut CUipcMemHandle, dptr: CUdeviceptr) {
        drv()?;
        let mut t = table().write().unwrap_or_else(|e| e.into_inner());
        let r = t.get_mut(&dptr).filter(|r| matches!(r.kind, Kind::Device | Kind::V1)).ok_or(err::INVALID_VALUE)?;
        let (i, generation) = match r.share {
            Some(s) => s,
            None => {
                let s = open_share(r.dev, r.charged)?;
                r.charged = 0;
                r.share = Some(s);
                s
            }
        };
        let mut h = CUipcMemHandle { reserved: [0; 64] };
        let words = [IPC_MAGIC, process_token(), r.dev as u64, r.size, dptr, i as u64, generation];
        for (k, v) in words.iter().enumerate() {
            h.reserved[k * 8..k * 8 + 8].copy_from_slice(&v.to_le_bytes());
        }
        write(handle, h)
    }
    fn cuIpcOpenMemHandle_v2(pdptr: *mut CUdeviceptr, handle: CUipcMemHandle, _flags: c_uint) { ipc_open(pdptr, handle) }
    fn cuIpcOpenMemHandle(pdptr: *mut CUdeviceptr, handle: CUipcMemHandle, _flags: c_uint) { ipc_open(pdptr, handle) }
    fn cuIpcCloseMemHandle(dptr: CUdeviceptr) { ipc_close(dptr) }

    fn cuArrayCreate_v2(out: *mut CUarray, desc: *const CUDA_ARRAY_DESCRIPTOR) {
        let d: CUDA_ARRAY_DESCRIPTOR = read(desc)?;
        create_array(out, array_bytes(d.Width, d.Height, 1, d.Format, d.NumChannels, 1)?)
    }
    fn cuArray3DCreate_v2(out: *mut CUarray, desc: *const CUDA_ARRAY3D_DESCRIPTOR) {
        let d: CUDA_ARRAY3D_DESCRIPTOR = read(desc)?;
        create_array(out, array_bytes(d.Width, d.Height, d.Depth, d.Format, d.NumChannels, 1)?)
    }
    /// The CUDA 2.x forms: 32-bit extents (cuda.h `CUDA_ARRAY_DESCRIPTOR_v1`), otherwise the
    /// same (libcuda exports both; cuGetProcAddress hands these out below version 3020).
    fn cuArrayCreate(out: *mut CUarray, desc: *const CUDA_ARRAY_DESCRIPTOR_v1) {
        let d: CUDA_ARRAY_DESCRIPTOR_v1 = read(desc)?;
        create_array(out, array_bytes(d.Width as usize, d.Height as usize, 1, d.Format, d.NumChannels, 1)?)
    }
    fn cuArray3DCreate(out: *mut CUarray, desc: *const CUDA_ARRAY3D_DESCRIPTOR_v1) {
        let d: CUDA_ARRAY3D_DESCRIPTOR_v1 = read(desc)?;
        create_array(out, array_bytes(d.Width as usize, d.Height as usize, d.Depth as usize, d.Format, d.NumChannels, 1)?)
    }
    fn cuArrayDestroy(a: CUarray) { destroy_array(a as usize) }
    fn cuMipmappedArrayCreate(out: *mut CUmipmappedArray, desc: *const CUDA_ARRAY3D_DESCRIPTOR, levels: c_uint) {
        let d: CUDA_ARRAY3D_DESCRIPTOR = read(desc)?;
        let total = array_bytes(d.Width, d.Height, d.Depth, d.Format, d.NumChannels, levels)?;
        create_array(out as *mut CUarray, total)
    }
    fn cuMipmappedArrayDestroy(a: CUmipmappedArray) { destroy_array(a as usize) }
}

/// Names this process in IPC handles, machine-wide: pids repeat across pid namespaces (two
/// containers' processes are often both pid 1), so a handle carries this instead.
fn process_token() -> u64 {
    static T: OnceLock<u64> = OnceLock::new();
    *T.get_or_init(|| {
        let mut v = 0u64;
        // SAFETY: getrandom writes at most 8 bytes into `v`, which we own.
        let n = unsafe { libc::getrandom(&mut v as *mut u64 as *mut c_void, 8, 0) };
        if n == 8 && v != 0 {
            v
        } else {
            (std::process::id() as u64) << 32 | now_ns() & 0xffff_ffff
        }
    })
}

/// Opened IPC handles of this process: (entry, generation, context) -> (pointer, references).
type Opened = HashMap<(usize, u64, usize), (u64, u32)>;

fn ipc_opened() -> &'static Mutex<Opened> {
    static O: OnceLock<Mutex<Opened>> = OnceLock::new();
    O.get_or_init(|| Mutex::new(HashMap::new()))
}

/// cuIpcOpenMemHandle: "If the memory handle has already been opened by the current context,
/// the reference count on the handle is incremented by 1 and the existing device pointer is
/// returned." The opened memory is the exporter's allocation and charges nothing new; it lives
/// while it is open here, even after the exporter freed it (documented as undefined behaviour:
/// "Calling cuMemFree on an exported memory region before calling cuIpcCloseMemHandle in the
/// importing context will result in undefined behavior") or exited (undocumented; on NVIDIA
/// the memory is reported released at the importer's cuIpcCloseMemHandle, ROCm/hip#3580).
fn ipc_open(pdptr: *mut CUdeviceptr, handle: CUipcMemHandle) -> Res {
    let (ch, _) = ctx::current()?;
    let word = |i: usize| {
        u64::from_le_bytes(
            handle.reserved[i * 8..i * 8 + 8]
                .try_into()
                .unwrap_or_default(),
        )
    };
    if word(0) != IPC_MAGIC || pdptr.is_null() {
        return Err(err::INVALID_VALUE);
    }
    if word(1) == process_token() {
        return Err(err::INVALID_CONTEXT); // a process cannot open its own IPC handle
    }
    let dev = word(2) as usize;
    if dev >= drv()?.sim.model.devices.len() {
        return Err(err::INVALID_VALUE);
    }
    let (i, generation) = (word(5) as usize, word(6));
    let mut opened = ipc_opened().lock().unwrap_or_else(|e| e.into_inner());
    if let Some((a, n)) = opened.get_mut(&(i, generation, ch)) {
        *n += 1;
        return write(pdptr, *a);
    }
    ref_share(i, generation)?; // the allocation is gone (freed, and nobody else holds it)
    let a = match alloc_on(dev, ch, word(3), Kind::Ipc, Some(0)) {
        Ok(a) => a,
        Err(e) => {
            unref_share(i);
            return Err(e);
        }
    };
    if let Some(r) = table()
        .write()
        .unwrap_or_else(|e| e.into_inner())
        .get_mut(&a)
    {
        r.share = Some((i, generation));
    }
    opened.insert((i, generation, ch), (a, 1));
    write(pdptr, a)
}

/// cuIpcCloseMemHandle: "Decrements the reference count of the memory returned by
/// cuIpcOpenMemHandle by 1. When the reference count reaches 0, this API unmaps the memory."
fn ipc_close(dptr: CUdeviceptr) -> Res {
    drv()?;
    let mut opened = ipc_opened().lock().unwrap_or_else(|e| e.into_inner());
    let Some((k, (_, n))) = opened.iter_mut().find(|(_, (a, _))| *a == dptr) else {
        return Err(err::INVALID_VALUE);
    };
    *n -= 1;
    if *n > 0 {
        return Ok(());
    }
    let k = *k;
    opened.remove(&k);
    drop(opened);
    free(dptr, |k| k == Kind::Ipc)
}
