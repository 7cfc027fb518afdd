//! The allocation table every way of taking device memory builds on, and graph memory.
//!
//! Physical memory is charged to the shared device state (so processes contend for real) and to
//! this process's slot (so NVML lists it and it is reclaimed if the process dies). Addresses come
//! from per-device arenas of host address space, so copies are plain memory moves.
//!
//! What the simulator models and how:
//! - cuMemAlloc/Pitch (`alloc.rs`, the entry points): charged at once, rounded up to 512 bytes.
//!   Managed memory is charged where its pages are resident, not at allocation (see
//!   `managed.rs`).
//! - classic allocation: `alloc.rs`; stream-ordered pools: `pool.rs`; VMM: `vmm.rs`; IPC
//!   handles: `ipc.rs`; managed memory: `managed.rs`; arrays: `array.rs`; page-locked host
//!   memory: `pointer.rs`; copies and memsets: `copy.rs`. This module keeps the allocation
//!   table, the arenas, the charge helpers they all use and graph memory. It depends on none
//!   of them, nor on streams or stream capture: an allocation of theirs brings its own arena and
//!   what its release does (`alloc_in`, `set_on_release`), and a context's teardown tells its
//!   caller which devices' pools to trim.
//! - arrays and mipmapped arrays: charged by their element size, not addressable for copies.
//! - memory shared between processes (VMM allocations exported as POSIX file descriptors,
//!   allocations exported with cuIpcGetMemHandle): at its first export its charge moves out of
//!   the creator's process slot into an entry of the shared state that no process owns
//!   (`cuvisor_sim::state::SharedMem`), held by every process that has a handle, a mapping or an
//!   opened IPC pointer to it; the memory goes when the last holder lets go or dies, whoever
//!   created it (see `vmm::phys_drop_if_unused` and `ipc::ipc_open` for the driver documentation this
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
use crate::{drv, export, read, write, Res};
use cuvisor_cuda_abi::cuda::*;
use cuvisor_sim::arena::{round_up, Arena, ALIGN};
use cuvisor_sim::state::now_ns;
use std::collections::{BTreeMap, HashMap};
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::*};
use std::sync::{Arc, Mutex, OnceLock, RwLock};

/// Granularity of cuMemCreate / cuMemAddressReserve and of pool growth.
pub(crate) const GRANULARITY: u64 = 2 << 20;
/// The host page: what a shared file can be mapped in.
pub const PAGE: u64 = 4096;
/// MAP_32BIT's window is the second GiB of the address space (0x4000_0000..0x8000_0000),
/// shared with anything else that asks for it: a quarter of it is ample for v1 callers.
const LOW_ARENA: u64 = 256 << 20;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Kind {
    Device,
    Managed,
    /// 32-bit v1 allocation.
    V1,
    Pool(usize),
    /// A pointer imported from another process's pool into imported pool `usize`
    /// (cuMemPoolImportPointer): the exporter's memory, in that pool's mapping.
    PoolImport(usize),
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

pub(crate) struct Alloc {
    pub size: u64,
    /// Bytes charged to the device for this allocation (0 for mappings and imports, and once
    /// the allocation is shared: see `share`).
    pub charged: u64,
    /// The shared-memory entry (index, generation) this allocation holds: an IPC-exported
    /// allocation of this process, or an opened IPC handle.
    pub share: Option<(usize, u64)>,
    pub dev: usize,
    pub ctx: usize,
    pub kind: Kind,
    pub dirty: AtomicBool,
    /// CU_POINTER_ATTRIBUTE_BUFFER_ID: "unique ID over a process lifetime. Subsequent
    /// allocations do not reuse IDs from previous freed allocations" (cuda.h).
    pub id: u64,
}

/// The next allocation's buffer id (see `Alloc::id`); never 0.
pub(crate) fn next_buffer_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Relaxed)
}

pub(crate) fn table() -> &'static RwLock<BTreeMap<u64, Alloc>> {
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

/// Address space for managed memory, which may exceed the device's (see managed.rs): eight
/// times all device memory together.
fn managed_arena() -> Result<&'static Arena, CUresult> {
    static A: OnceLock<Option<Arena>> = OnceLock::new();
    let d = drv()?;
    let total: u64 = d.sim.model.devices.iter().map(|x| x.memory).sum();
    A.get_or_init(|| Arena::new(8 * total, false))
        .as_ref()
        .ok_or(err::OUT_OF_MEMORY)
}

/// The (rounded) size of the allocation that starts at `addr`.
pub(crate) fn allocation_size(addr: u64) -> Option<u64> {
    table()
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .get(&addr)
        .map(|r| r.size)
}

/// Address space for cuMemAddressReserve: four times all device memory together.
pub(crate) fn va_arena() -> Result<&'static Arena, CUresult> {
    static A: OnceLock<Option<Arena>> = OnceLock::new();
    let d = drv()?;
    let total: u64 = d.sim.model.devices.iter().map(|x| x.memory).sum();
    A.get_or_init(|| Arena::new(4 * total, false))
        .as_ref()
        .ok_or(err::OUT_OF_MEMORY)
}

/// Runs `f` on the arena addresses of `kind` come from: `own` where the allocation has its own
/// (an IPC-capable pool's shared file), none for imported pool pointers (the exporter's).
fn with_arena<R>(
    kind: Kind,
    dev: usize,
    own: Option<&Arena>,
    f: impl FnOnce(&Arena) -> R,
) -> Result<R, CUresult> {
    if let Some(a) = own {
        return Ok(f(a));
    }
    match kind {
        Kind::V1 => low_arena().map(f),
        Kind::Mapped(_) => va_arena().map(f),
        Kind::PoolImport(_) => Err(err::INVALID_VALUE),
        Kind::Managed => managed_arena().map(f),
        _ => arena(dev).map(f),
    }
}

/// What the chapter an allocation belongs to does when it is freed, before its address goes
/// back (given the address): a pool takes its bytes back, managed memory its resident pages,
/// an IPC file mapping gives the arena its anonymous memory back.
pub(crate) type OnRelease = Box<dyn FnOnce(u64) + Send>;

/// Per allocation, where it needs them: its own arena and what its release does.
#[derive(Default)]
struct Extra {
    arena: Option<Arc<Arena>>,
    on_release: Option<OnRelease>,
}

fn extras() -> &'static Mutex<HashMap<u64, Extra>> {
    static E: OnceLock<Mutex<HashMap<u64, Extra>>> = OnceLock::new();
    E.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Makes `f` run when the allocation at `addr` is freed (replacing what was set).
pub(crate) fn set_on_release(addr: u64, f: OnRelease) {
    extras()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .entry(addr)
        .or_default()
        .on_release = Some(f);
}

/// Charges `bytes` of device `dev`; if the device looks full, first gives back the memory of
/// processes that died (the real driver frees it when they exit) and tries once more.
pub(crate) fn charge(dev: usize, bytes: u64) -> Res {
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

pub(crate) fn uncharge(dev: usize, bytes: u64) {
    if let Ok(d) = drv() {
        if bytes > 0 {
            d.sim.shared.uncharge(d.slot, dev, bytes);
        }
    }
}

/// Allocates `size` bytes on the current context's device; `charge_bytes` None = charge the
/// rounded size, Some(n) = charge n (pools charge on their own).
pub(crate) fn alloc(size: u64, kind: Kind, charge_bytes: Option<u64>) -> Result<u64, CUresult> {
    let (ch, c) = ctx::current()?;
    alloc_on(c.dev, ch, size, kind, charge_bytes)
}

pub(crate) fn alloc_on(
    dev: usize,
    ch: usize,
    size: u64,
    kind: Kind,
    charge_bytes: Option<u64>,
) -> Result<u64, CUresult> {
    alloc_in(dev, ch, size, kind, charge_bytes, None, None)
}

/// `alloc_on`, from arena `own` when given (held until the allocation is freed), running
/// `on_release` when it is.
pub(crate) fn alloc_in(
    dev: usize,
    ch: usize,
    size: u64,
    kind: Kind,
    charge_bytes: Option<u64>,
    own: Option<Arc<Arena>>,
    on_release: Option<OnRelease>,
) -> Result<u64, CUresult> {
    if size == 0 {
        return Err(err::INVALID_VALUE);
    }
    let rounded = round_up(size, ALIGN);
    let charged = charge_bytes.unwrap_or(rounded);
    if charged > 0 {
        charge(dev, charged)?;
    }
    // Page-sized device allocations start on a page (2 MiB ones on 2 MiB, as the driver's large
    // allocations do), so that one exported with cuIpcGetMemHandle can be mapped onto a shared
    // file in place (see ipc.rs); the charge is the same.
    let align = match kind {
        Kind::Device | Kind::Ipc if rounded >= GRANULARITY => GRANULARITY,
        Kind::Device | Kind::Ipc if rounded.is_multiple_of(PAGE) => PAGE,
        _ => ALIGN,
    };
    let addr = match with_arena(kind, dev, own.as_deref(), |a| {
        if align > ALIGN {
            a.alloc_aligned(rounded, align)
        } else {
            a.alloc(rounded)
        }
    })
    .ok()
    .flatten()
    {
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
        id: next_buffer_id(),
    };
    if own.is_some() || on_release.is_some() {
        extras().lock().unwrap_or_else(|e| e.into_inner()).insert(
            addr,
            Extra {
                arena: own,
                on_release,
            },
        );
    }
    table()
        .write()
        .unwrap_or_else(|e| e.into_inner())
        .insert(addr, rec);
    Ok(addr)
}

/// Frees the allocation that starts exactly at `addr` (an interior pointer is INVALID_VALUE,
/// as with the real driver). `want` filters which kinds this entry point may free.
pub(crate) fn free(addr: u64, want: impl Fn(Kind) -> bool) -> Res {
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
    let extra = extras()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .remove(&addr)
        .unwrap_or_default();
    if let Some(f) = extra.on_release {
        f(addr);
    }
    if rec.kind == Kind::Graph {
        graph_alloc_released(addr, rec.dirty.load(Relaxed));
        return;
    }
    let _ = with_arena(rec.kind, rec.dev, extra.arena.as_deref(), |a| {
        a.free(addr, rec.size, rec.dirty.load(Relaxed))
    });
    match rec.kind {
        // Pools and managed memory charge on their own (their `on_release` gives it back).
        Kind::Pool(_) | Kind::PoolImport(_) | Kind::Managed | Kind::Mapped(_) => {}
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
/// device `dev`. Returns the devices its freed allocations were on (their pools then trim, as
/// at a synchronization point: see ctx.rs).
pub(crate) fn free_context(ch: usize, dev: usize) -> Vec<usize> {
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
    devs.sort_unstable();
    devs.dedup();
    // The context's graph memory goes with it: its live graph allocations were freed above, and
    // what the device's graph memory pool still reserves is released (nothing runs any more).
    graph_trim(dev);
    devs
}

/// Checks that [addr, addr + n) lies inside one live device allocation; returns its device.
pub(crate) fn device_range(addr: u64, n: u64, mark_dirty: bool) -> Result<usize, CUresult> {
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

/// For the allocation holding `addr`, if it is a plain one (cuMemAlloc's or a 32-bit one: not a
/// pool's, a mapping, managed or a module's memory, not shared with another process): whether
/// it was ever written. A plain allocation that never was reads as zeros: its pages come zeroed
/// from its arena (a freed dirty block's are dropped, `Arena::free`), and in the simulator only
/// copies, memsets and stream memory writes write device memory (kernels move no bytes), each
/// marking its allocation dirty (`device_range`).
pub(crate) fn plain_dirty(addr: u64) -> Option<bool> {
    let t = table().read().unwrap_or_else(|e| e.into_inner());
    let (base, r) = t.range(..=addr).next_back()?;
    if addr >= base + r.size || !matches!(r.kind, Kind::Device | Kind::V1) || r.share.is_some() {
        return None;
    }
    let base = *base;
    let dirty = r.dirty.load(Relaxed);
    drop(t);
    if extras()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .contains_key(&base)
    {
        return None;
    }
    Some(dirty)
}

/// Makes [addr, addr + n) of a plain allocation (see [`plain_dirty`]) read as zeros, dropping
/// its whole pages rather than writing them.
pub(crate) fn zero_plain(addr: u64, n: u64) {
    match arena_of(addr) {
        Some(a) => a.zero(addr, n),
        // SAFETY: not reached for a plain allocation (it lies in an arena); the range is the
        // caller's checked device memory.
        None => unsafe { std::ptr::write_bytes(addr as *mut u8, 0, n as usize) },
    }
}

/// cuMemSetAccess's range: every byte of it in live allocations that follow each other without
/// a gap, one or several. PyTorch's expandable segments map a segment's 20 MiB handles side by
/// side and set access once over all of them, which the real driver accepts.
pub(crate) fn contiguous_range(addr: u64, n: u64) -> Res {
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

/// The target of a stream memory operation (cuStreamWaitValue*, cuStreamWriteValue*): a word
/// of device memory, or of host memory the caller registered (its "device pointer" from
/// cuMemHostGetDevicePointer is its host address here). "This function cannot be used with
/// managed memory (cuMemAllocManaged)" (cuda.h, cuStreamWaitValue32). The device accesses it
/// as one aligned word.
pub(crate) fn memop_target(addr: u64, n: u64) -> Res {
    if !addr.is_multiple_of(n) {
        return Err(err::INVALID_VALUE);
    }
    match device_range(addr, n, true) {
        Ok(_) => {}
        // freed, out of bounds or NULL; anything else is host memory the caller vouches for
        Err(e) if addr == 0 || in_any_arena(addr) => return Err(e),
        Err(_) => {}
    }
    let t = table().read().unwrap_or_else(|e| e.into_inner());
    if let Some((base, r)) = t.range(..=addr).next_back() {
        if r.kind == Kind::Managed && addr < base + r.size {
            return Err(err::INVALID_VALUE);
        }
    }
    Ok(())
}

/// Whether `addr` lies in the simulator's device address space (any arena), allocated or not.
pub(crate) fn in_any_arena(addr: u64) -> bool {
    arena_of(addr).is_some()
}

/// The arena whose address space holds `addr`, allocated or not.
pub(crate) fn arena_of(addr: u64) -> Option<&'static Arena> {
    let d = drv().ok()?;
    (0..d.sim.model.devices.len())
        .filter_map(|i| arena(i).ok())
        .chain(
            [low_arena(), va_arena(), managed_arena()]
                .into_iter()
                .flatten(),
        )
        .find(|a| a.contains(addr))
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
        id: next_buffer_id(),
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

// ---- memory shared between processes -------------------------------------------------------

/// How many of this process's handles and pointers hold each shared-memory entry: the entry's
/// lease is one lock per process, taken with the first and dropped with the last.
fn share_refs() -> &'static Mutex<HashMap<usize, u32>> {
    static R: OnceLock<Mutex<HashMap<usize, u32>>> = OnceLock::new();
    R.get_or_init(|| Mutex::new(HashMap::new()))
}

/// One more holder in this process of entry `i` (generation `generation`); false when that
/// memory is gone.
pub(crate) fn ref_share(i: usize, generation: u64) -> Result<(), CUresult> {
    let d = drv()?;
    let mut r = share_refs().lock().unwrap_or_else(|e| e.into_inner());
    if !d.sim.shared.share_hold(i, generation) {
        return Err(err::INVALID_VALUE);
    }
    *r.entry(i).or_insert(0) += 1;
    Ok(())
}

pub(crate) fn unref_share(i: usize) {
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
pub(crate) fn open_share(dev: usize, bytes: u64) -> Result<(usize, u64), CUresult> {
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

/// The device a `CUmemLocation` names (None: host memory).
pub(crate) fn location_device(loc: CUmemLocation) -> Result<Option<usize>, CUresult> {
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

// ---- what the pointer chapter reads -------------------------------------------------------------

/// What kind of memory an allocation is, as the pointer attributes tell it apart (`pointer`).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Class {
    /// cuMemAlloc / cuMemAllocPitch / v1 memory: what cuIpcGetMemHandle takes.
    Device,
    Managed,
    /// From a memory pool (its handle), a graph's memory node (no handle: 0).
    Pool(usize),
    /// A VMM mapping (cuMemMap) of a physical allocation (its handle).
    Mapped(usize),
    /// Another process's memory opened through an IPC handle.
    Ipc,
    /// The driver's own: a module's variables.
    Driver,
}

/// The allocation holding `ptr`, as the pointer attributes see it.
pub(crate) struct Found {
    pub base: u64,
    pub size: u64,
    pub dev: usize,
    pub ctx: usize,
    pub id: u64,
    pub class: Class,
}

/// The device allocation (of any kind) holding `ptr`, if any.
pub(crate) fn find(ptr: u64) -> Option<Found> {
    let t = table().read().unwrap_or_else(|e| e.into_inner());
    let (b, r) = t.range(..=ptr).next_back()?;
    if ptr >= b + r.size {
        return None;
    }
    let class = match r.kind {
        Kind::Device | Kind::V1 => Class::Device,
        Kind::Managed => Class::Managed,
        Kind::Pool(p) | Kind::PoolImport(p) => Class::Pool(p),
        Kind::Graph => Class::Pool(0),
        Kind::Mapped(h) => Class::Mapped(h),
        Kind::Ipc => Class::Ipc,
        Kind::ModuleGlobal => Class::Driver,
    };
    Some(Found {
        base: *b,
        size: r.size,
        dev: r.dev,
        ctx: r.ctx,
        id: r.id,
        class,
    })
}

export! {
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
}
