//! Devices and contexts: device queries, primary contexts, cuCtxCreate v2..v4, the per-thread
//! stack of current contexts.

use crate::exec::Stream;
use crate::{cstr, drv, export, mem, write, write_cstr, Registry, Res};
use cuvisor_cuda_abi::cuda::{attr, err, CUcontext, CUdevice, CUresult, CUuuid, CU_CTX_FLAGS_MASK};
use cuvisor_sim::model::{Device, PcieLevel};
use std::cell::RefCell;
use std::ffi::{c_char, c_uint, c_void};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::*};
use std::sync::{Arc, Mutex, OnceLock};

pub(crate) struct Context {
    pub dev: usize,
    pub flags: AtomicU32,
    /// Whether the context can do work: a created one until it is destroyed, a primary one while
    /// it is retained. A primary context's handle exists before and after (see [`primary_handle`]).
    pub alive: AtomicBool,
    /// The context's legacy default stream (NULL / CU_STREAM_LEGACY).
    pub legacy: Arc<Stream>,
    /// When the last work queued in this context ends (what cuCtxSynchronize waits for).
    pub work_tail: Arc<AtomicU64>,
    /// Device memory the context itself takes while alive (the model's `context_memory`).
    overhead: AtomicU64,
    /// What `cuCtxGetId` answers: unique to this context object over the life of the process
    /// (never 0, never reused, even where a handle is).
    pub id: u64,
}

pub(crate) static CONTEXTS: OnceLock<Registry<Context>> = OnceLock::new();

pub(crate) fn contexts() -> &'static Registry<Context> {
    CONTEXTS.get_or_init(Registry::new)
}

thread_local! {
    static STACK: RefCell<Vec<usize>> = const { RefCell::new(Vec::new()) };
}

struct Primary {
    handle: usize,
    refs: u32,
    flags: u32,
}

fn primaries() -> &'static [Mutex<Primary>] {
    static P: OnceLock<Vec<Mutex<Primary>>> = OnceLock::new();
    P.get_or_init(|| {
        (0..cuvisor_sim::model::MAX_DEVICES)
            .map(|_| {
                Mutex::new(Primary {
                    handle: 0,
                    refs: 0,
                    flags: 0,
                })
            })
            .collect()
    })
}

/// The device behind an ordinal, after cuInit.
pub(crate) fn device(dev: CUdevice) -> Result<(usize, &'static Device), CUresult> {
    let d = drv()?;
    let i = usize::try_from(dev).map_err(|_| err::INVALID_DEVICE)?;
    d.sim
        .model
        .devices
        .get(i)
        .map(|x| (i, x))
        .ok_or(err::INVALID_DEVICE)
}

/// The calling thread's current context. A primary context that is current but not retained is
/// CUDA_ERROR_CONTEXT_IS_DESTROYED, which `cuda.h` documents as "the context current to the
/// calling thread ... is a primary context which has not yet been initialized".
pub(crate) fn current() -> Result<(usize, Arc<Context>), CUresult> {
    drv()?;
    let h = STACK
        .with(|s| s.borrow().last().copied())
        .ok_or(err::INVALID_CONTEXT)?;
    let c = contexts().get(h).map_err(|_| err::INVALID_CONTEXT)?;
    if !c.alive.load(Acquire) {
        return Err(err::CONTEXT_IS_DESTROYED);
    }
    Ok((h, c))
}

pub(crate) fn get(h: CUcontext) -> Result<Arc<Context>, CUresult> {
    contexts().get(h as usize).map_err(|_| err::INVALID_CONTEXT)
}

/// The context a CUDA 13 entry point names (`cuCtxGetDevice_v2`, `cuCtxSynchronize_v2`): `h`, or
/// the calling thread's current one where `h` is NULL ("If the specified context is NULL, the
/// API will ... operate on the current context", CUDA 13 driver API reference). A named primary
/// context that is not retained answers as [`current`] does for it (UNVERIFIED on a real driver).
pub(crate) fn given_or_current(h: CUcontext) -> Result<(usize, Arc<Context>), CUresult> {
    if h.is_null() {
        return current();
    }
    drv()?;
    let c = get(h)?;
    if !c.alive.load(Acquire) {
        return Err(err::CONTEXT_IS_DESTROYED);
    }
    Ok((h as usize, c))
}

/// A context object that cannot do work yet ([`activate`] makes it).
fn register(dev: usize, flags: u32) -> usize {
    let work_tail = Arc::new(AtomicU64::new(0));
    let ctx = Context {
        dev,
        flags: AtomicU32::new(flags),
        alive: AtomicBool::new(false),
        legacy: Arc::new(Stream::new(dev, 0, 0, work_tail.clone())),
        work_tail,
        overhead: AtomicU64::new(0),
        id: {
            static NEXT: AtomicU64 = AtomicU64::new(1);
            NEXT.fetch_add(1, Relaxed)
        },
    };
    let (h, c) = contexts().insert(ctx);
    c.legacy.set_ctx(h);
    h
}

/// Charges the context's own memory and lets it work.
fn activate(h: usize) -> Res {
    let d = drv()?;
    let c = contexts().get(h)?;
    let overhead = d.sim.model.devices[c.dev].context_memory;
    if overhead > 0
        && !d
            .sim
            .shared
            .charge_memory(d.slot, c.dev, overhead, d.sim.model.devices[c.dev].memory)
    {
        return Err(err::OUT_OF_MEMORY);
    }
    c.overhead.store(overhead, Release);
    c.alive.store(true, Release);
    Ok(())
}

/// Frees what the context holds (its allocations, its own memory); it can no longer work.
fn deactivate(h: usize) -> Res {
    let c = contexts().get(h)?;
    c.alive.store(false, Release);
    mem::free_context(h, c.dev);
    let overhead = c.overhead.swap(0, AcqRel);
    if overhead > 0 {
        let d = drv()?;
        d.sim.shared.uncharge(d.slot, c.dev, overhead);
    }
    Ok(())
}

fn create(dev: usize, flags: u32) -> Result<usize, CUresult> {
    drv()?;
    let h = register(dev, flags);
    if let Err(e) = activate(h) {
        let _ = contexts().remove(h);
        return Err(e);
    }
    Ok(h)
}

fn destroy(h: usize) -> Res {
    contexts().get(h)?;
    // What the runtime stored in the context goes first, while the context still answers.
    crate::export_table::context_gone(h);
    deactivate(h)?;
    contexts().remove(h)?;
    // A destroyed context leaves every thread's stack; this thread's at least.
    STACK.with(|s| s.borrow_mut().retain(|&x| x != h));
    Ok(())
}

fn check_flags(flags: c_uint) -> Res {
    if flags & !CU_CTX_FLAGS_MASK != 0 {
        return Err(err::INVALID_VALUE);
    }
    Ok(())
}

fn create_and_push(pctx: *mut CUcontext, flags: c_uint, dev: CUdevice) -> Res {
    if pctx.is_null() {
        return Err(err::INVALID_VALUE);
    }
    check_flags(flags)?;
    let (i, _) = device(dev)?;
    let h = create(i, flags)?;
    STACK.with(|s| s.borrow_mut().push(h));
    write(pctx, h as CUcontext)
}

fn attribute(d: &Device, a: i32) -> Option<i32> {
    Some(match a {
        attr::MAX_THREADS_PER_BLOCK => 1024,
        attr::MAX_BLOCK_DIM_X | attr::MAX_BLOCK_DIM_Y => 1024,
        attr::MAX_BLOCK_DIM_Z => 64,
        attr::MAX_GRID_DIM_X => i32::MAX,
        attr::MAX_GRID_DIM_Y | attr::MAX_GRID_DIM_Z => 65535,
        attr::MAX_SHARED_MEMORY_PER_BLOCK => 49152,
        attr::TOTAL_CONSTANT_MEMORY => 65536,
        attr::WARP_SIZE => 32,
        attr::MAX_PITCH => i32::MAX,
        attr::MAX_REGISTERS_PER_BLOCK | attr::MAX_REGISTERS_PER_MULTIPROCESSOR => 65536,
        attr::CLOCK_RATE => 1_410_000,
        attr::TEXTURE_ALIGNMENT => 512,
        attr::GPU_OVERLAP | attr::CONCURRENT_KERNELS | attr::UNIFIED_ADDRESSING => 1,
        attr::MULTIPROCESSOR_COUNT => d.sm_count as i32,
        attr::KERNEL_EXEC_TIMEOUT | attr::INTEGRATED | attr::COMPUTE_MODE | attr::TCC_DRIVER => 0,
        attr::CAN_MAP_HOST_MEMORY | attr::MANAGED_MEMORY | attr::CONCURRENT_MANAGED_ACCESS => 1,
        attr::ECC_ENABLED => 1,
        attr::PCI_BUS_ID => d.pci_bus as i32,
        attr::PCI_DEVICE_ID => d.pci_device as i32,
        attr::PCI_DOMAIN_ID => d.pci_domain as i32,
        attr::MEMORY_CLOCK_RATE => 1_593_000,
        attr::GLOBAL_MEMORY_BUS_WIDTH => 5120,
        attr::L2_CACHE_SIZE => 40 << 20,
        attr::MAX_THREADS_PER_MULTIPROCESSOR => 2048,
        attr::ASYNC_ENGINE_COUNT => 3,
        attr::COMPUTE_CAPABILITY_MAJOR => d.cc.0 as i32,
        attr::COMPUTE_CAPABILITY_MINOR => d.cc.1 as i32,
        attr::MAX_SHARED_MEMORY_PER_MULTIPROCESSOR => 167_936,
        attr::MULTI_GPU_BOARD => 0,
        attr::COOPERATIVE_LAUNCH => 1,
        attr::MAX_SHARED_MEMORY_PER_BLOCK_OPTIN => 166_912,
        attr::VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED => 1,
        attr::MAX_BLOCKS_PER_MULTIPROCESSOR => 32,
        attr::MEMORY_POOLS_SUPPORTED => 1,
        // CU_DEVICE_ATTRIBUTE_RESERVED_SHARED_MEMORY_PER_BLOCK (111): 1 KiB on sm_80, which is why
        // the opt-in maximum above is the per-SM 164 KiB less 1 KiB (CUDA C++ Programming Guide,
        // "Technical Specifications per Compute Capability": 163 KB opt-in per block on 8.0).
        111 => 1024,
        a if (0..attr::MAX).contains(&a) => 0,
        _ => return None,
    })
}

export! {
    fn cuDeviceGetCount(count: *mut i32) {
        let d = drv()?;
        write(count, d.sim.model.devices.len() as i32)
    }

    fn cuDeviceGet(out: *mut CUdevice, ordinal: i32) {
        device(ordinal)?;
        write(out, ordinal)
    }

    fn cuDeviceGetName(name: *mut c_char, len: i32, dev: CUdevice) {
        let (_, d) = device(dev)?;
        write_cstr(name, len, &d.name)
    }

    fn cuDeviceGetUuid(uuid: *mut CUuuid, dev: CUdevice) {
        let (_, d) = device(dev)?;
        write(uuid, CUuuid { bytes: d.uuid_bytes() })
    }

    /// Same as v1 on a device without MIG (v2 differs only for MIG instances).
    fn cuDeviceGetUuid_v2(uuid: *mut CUuuid, dev: CUdevice) {
        let (_, d) = device(dev)?;
        write(uuid, CUuuid { bytes: d.uuid_bytes() })
    }

    fn cuDeviceGetAttribute(pi: *mut i32, attrib: i32, dev: CUdevice) {
        let (_, d) = device(dev)?;
        write(pi, attribute(d, attrib).ok_or(err::INVALID_VALUE)?)
    }

    /// v1 (CUDA 2.0) reports through a 32-bit `unsigned int`: clamped, not wrapped.
    fn cuDeviceTotalMem(bytes: *mut c_uint, dev: CUdevice) {
        let (_, d) = device(dev)?;
        write(bytes, d.memory.min(u32::MAX as u64) as c_uint)
    }

    fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: CUdevice) {
        let (_, d) = device(dev)?;
        write(bytes, d.memory as usize)
    }

    fn cuDeviceComputeCapability(major: *mut i32, minor: *mut i32, dev: CUdevice) {
        let (_, d) = device(dev)?;
        write(major, d.cc.0 as i32)?;
        write(minor, d.cc.1 as i32)
    }

    fn cuDeviceGetPCIBusId(bus_id: *mut c_char, len: i32, dev: CUdevice) {
        let (_, d) = device(dev)?;
        write_cstr(bus_id, len, &d.pci_bus_id_cuda())
    }

    fn cuDeviceGetByPCIBusId(dev: *mut CUdevice, bus_id: *const c_char) {
        let want = cstr(bus_id)?.to_ascii_lowercase();
        let d = drv()?;
        let i = d
            .sim
            .model
            .devices
            .iter()
            .position(|x| x.pci_bus_id_cuda() == want || x.pci_bus_id_nvml() == want)
            .ok_or(err::INVALID_DEVICE)?;
        write(dev, i as CUdevice)
    }

    fn cuDeviceCanAccessPeer(can: *mut i32, dev: CUdevice, peer: CUdevice) {
        let (a, _) = device(dev)?;
        let (b, _) = device(peer)?;
        let m = &drv()?.sim.model;
        let ok = a != b && (m.nvlink_bandwidth_links(a, b) > 0 || m.pcie_level(a, b) <= PcieLevel::Multiple);
        write(can, ok as i32)
    }

    fn cuDevicePrimaryCtxRetain(pctx: *mut CUcontext, dev: CUdevice) {
        let (i, _) = device(dev)?;
        if pctx.is_null() {
            return Err(err::INVALID_VALUE);
        }
        let mut p = primaries()[i].lock().unwrap_or_else(|e| e.into_inner());
        let h = primary_object(i, &mut p);
        if p.refs == 0 {
            activate(h)?;
        }
        p.refs += 1;
        write(pctx, h as CUcontext)
    }

    fn cuDevicePrimaryCtxRelease(dev: CUdevice) { primary_release(dev) }
    fn cuDevicePrimaryCtxRelease_v2(dev: CUdevice) { primary_release(dev) }

    fn cuDevicePrimaryCtxGetState(dev: CUdevice, flags: *mut c_uint, active: *mut i32) {
        let (i, _) = device(dev)?;
        let p = primaries()[i].lock().unwrap_or_else(|e| e.into_inner());
        write(flags, p.flags)?;
        write(active, (p.refs > 0) as i32)
    }

    fn cuDevicePrimaryCtxSetFlags(dev: CUdevice, flags: c_uint) { primary_set_flags(dev, flags, false) }
    fn cuDevicePrimaryCtxSetFlags_v2(dev: CUdevice, flags: c_uint) { primary_set_flags(dev, flags, true) }
    fn cuDevicePrimaryCtxReset(dev: CUdevice) { primary_reset(dev) }
    fn cuDevicePrimaryCtxReset_v2(dev: CUdevice) { primary_reset(dev) }

    fn cuCtxCreate_v2(pctx: *mut CUcontext, flags: c_uint, dev: CUdevice) {
        create_and_push(pctx, flags, dev)
    }

    /// The CUDA 2.x entry point, still exported by libcuda (cuGetProcAddress hands it out below
    /// version 3020): the same call.
    fn cuCtxCreate(pctx: *mut CUcontext, flags: c_uint, dev: CUdevice) {
        create_and_push(pctx, flags, dev)
    }

    /// v3 adds execution-affinity parameters (SM partitioning), which the simulator accepts and ignores.
    fn cuCtxCreate_v3(pctx: *mut CUcontext, params: *mut c_void, nparams: i32, flags: c_uint, dev: CUdevice) {
        if nparams < 0 || (nparams > 0 && params.is_null()) {
            return Err(err::INVALID_VALUE);
        }
        create_and_push(pctx, flags, dev)
    }

    /// v4 takes a `CUctxCreateParams*` (execution affinity, CIG); NULL is allowed.
    fn cuCtxCreate_v4(pctx: *mut CUcontext, _params: *mut c_void, flags: c_uint, dev: CUdevice) {
        create_and_push(pctx, flags, dev)
    }

    fn cuCtxDestroy_v2(ctx: CUcontext) {
        drv()?;
        if ctx.is_null() {
            return Err(err::INVALID_VALUE);
        }
        let c = get(ctx)?;
        let is_primary = primaries()[c.dev].lock().unwrap_or_else(|e| e.into_inner()).handle == ctx as usize;
        if is_primary {
            return Err(err::INVALID_CONTEXT);
        }
        destroy(ctx as usize)
    }

    fn cuCtxPushCurrent_v2(ctx: CUcontext) {
        drv()?;
        get(ctx)?;
        STACK.with(|s| s.borrow_mut().push(ctx as usize));
        Ok(())
    }

    fn cuCtxPopCurrent_v2(pctx: *mut CUcontext) {
        drv()?;
        let h = STACK.with(|s| s.borrow_mut().pop()).ok_or(err::INVALID_CONTEXT)?;
        if !pctx.is_null() {
            write(pctx, h as CUcontext)?;
        }
        Ok(())
    }

    /// Replaces the top of the stack (pushes when empty); NULL pops.
    fn cuCtxSetCurrent(ctx: CUcontext) {
        drv()?;
        if ctx.is_null() {
            STACK.with(|s| s.borrow_mut().pop());
            return Ok(());
        }
        get(ctx)?;
        STACK.with(|s| {
            let mut s = s.borrow_mut();
            s.pop();
            s.push(ctx as usize);
        });
        Ok(())
    }

    fn cuCtxGetCurrent(pctx: *mut CUcontext) {
        drv()?;
        let h = STACK.with(|s| s.borrow().last().copied()).unwrap_or(0);
        write(pctx, h as CUcontext)
    }

    /// CUDA 12.0. The driver API reference (cuCtxGetId, as cuda-python's `ctx_get_id` carries
    /// it): an id unique for the life of the program; a NULL context means the current one.
    fn cuCtxGetId(ctx: CUcontext, id: *mut u64) {
        let (_, c) = given_or_current(ctx)?;
        write(id, c.id)
    }

    fn cuCtxGetDevice(dev: *mut CUdevice) {
        let (_, c) = current()?;
        write(dev, c.dev as CUdevice)
    }

    /// CUDA 13.0 (`cuGetProcAddress("cuCtxGetDevice", 13000)` answers it): the device of `ctx`,
    /// NULL meaning the current context.
    fn cuCtxGetDevice_v2(dev: *mut CUdevice, ctx: CUcontext) {
        let (_, c) = given_or_current(ctx)?;
        write(dev, c.dev as CUdevice)
    }

    fn cuCtxGetFlags(flags: *mut c_uint) {
        let (_, c) = current()?;
        write(flags, c.flags.load(Relaxed))
    }

    fn cuCtxSetFlags(flags: c_uint) {
        check_flags(flags)?;
        let (_, c) = current()?;
        c.flags.store(flags, Relaxed);
        Ok(())
    }

    fn cuCtxGetApiVersion(ctx: CUcontext, version: *mut c_uint) {
        drv()?;
        if !ctx.is_null() {
            get(ctx)?;
        } else {
            current()?;
        }
        write(version, 3020)
    }

    fn cuCtxGetStreamPriorityRange(least: *mut i32, greatest: *mut i32) {
        drv()?;
        if !least.is_null() {
            write(least, 0)?;
        }
        if !greatest.is_null() {
            write(greatest, -5)?;
        }
        Ok(())
    }

    fn cuCtxGetLimit(value: *mut usize, limit: i32) {
        current()?;
        let v = match limit {
            0 => 1024,       // CU_LIMIT_STACK_SIZE
            1 => 1 << 20,    // CU_LIMIT_PRINTF_FIFO_SIZE
            2 => 8 << 20,    // CU_LIMIT_MALLOC_HEAP_SIZE
            3 => 2,          // CU_LIMIT_DEV_RUNTIME_SYNC_DEPTH
            4 => 2048,       // CU_LIMIT_DEV_RUNTIME_PENDING_LAUNCH_COUNT
            5 => 32,         // CU_LIMIT_MAX_L2_FETCH_GRANULARITY
            6 => 0,          // CU_LIMIT_PERSISTING_L2_CACHE_SIZE
            // CU_LIMIT_CIG_ENABLED: non-zero only on a CUDA-in-graphics context (cuda-python's
            // `Limit` docs), which the simulator never makes. cuBLASLt 12.8 asks at handle creation.
            8 => 0,
            _ => return Err(err::INVALID_VALUE),
        };
        write(value, v)
    }

    fn cuCtxSetLimit(limit: i32, _value: usize) {
        current()?;
        if !(0..=6).contains(&limit) {
            return Err(err::INVALID_VALUE);
        }
        Ok(())
    }

    fn cuCtxEnablePeerAccess(peer: CUcontext, flags: c_uint) {
        current()?;
        get(peer)?;
        if flags != 0 {
            return Err(err::INVALID_VALUE);
        }
        Ok(())
    }

    fn cuCtxDisablePeerAccess(peer: CUcontext) {
        current()?;
        get(peer)?;
        Ok(())
    }

    fn cuCtxSynchronize() {
        let (_, c) = current()?;
        synchronize(&c);
        Ok(())
    }

    /// CUDA 13.0: waits for the work of `ctx`, NULL meaning the current context.
    fn cuCtxSynchronize_v2(ctx: CUcontext) {
        let (_, c) = given_or_current(ctx)?;
        synchronize(&c);
        Ok(())
    }
}

/// Waits for all work queued in the context; a synchronization point for its pools.
fn synchronize(c: &Context) {
    crate::exec::sync_device_work(c);
    mem::trim_pools_at_sync(c.dev);
}

/// The primary context of device `i`, made (not retained, so unable to work) on first need. Its
/// handle stays the same for the life of the process, retained or not: libcudart gets it
/// through its private table (`export_table`), makes it current and only then retains it.
fn primary_object(i: usize, p: &mut Primary) -> usize {
    if p.handle == 0 {
        p.handle = register(i, p.flags);
    }
    p.handle
}

/// The handle of device `dev`'s primary context, without retaining it.
pub(crate) fn primary_handle(dev: CUdevice) -> Result<usize, CUresult> {
    let (i, _) = device(dev)?;
    let mut p = primaries()[i].lock().unwrap_or_else(|e| e.into_inner());
    Ok(primary_object(i, &mut p))
}

fn primary_release(dev: CUdevice) -> Res {
    let (i, _) = device(dev)?;
    let h = {
        let mut p = primaries()[i].lock().unwrap_or_else(|e| e.into_inner());
        match p.refs {
            0 => return Err(err::INVALID_CONTEXT),
            1 => p.handle,
            _ => {
                p.refs -= 1;
                return Ok(());
            }
        }
    };
    // The last reference: what the runtime stored in the context goes first, outside the lock
    // (its destructors may call the driver back), while the context still answers.
    crate::export_table::context_gone(h);
    let mut p = primaries()[i].lock().unwrap_or_else(|e| e.into_inner());
    p.refs = p.refs.saturating_sub(1);
    if p.refs == 0 {
        deactivate(h)?;
    }
    Ok(())
}

fn primary_set_flags(dev: CUdevice, flags: c_uint, v2: bool) -> Res {
    check_flags(flags)?;
    let (i, _) = device(dev)?;
    let mut p = primaries()[i].lock().unwrap_or_else(|e| e.into_inner());
    // v1 refuses while the context is active; v2 (CUDA 11.0) allows it.
    if p.refs > 0 && !v2 {
        return Err(err::PRIMARY_CONTEXT_ACTIVE);
    }
    p.flags = flags;
    if p.handle != 0 {
        contexts().get(p.handle)?.flags.store(flags, Relaxed);
    }
    Ok(())
}

/// Frees every allocation of the primary context and drops what the runtime stored in it (its
/// destructors run, as a reset tears down the context's state); the context itself stays
/// retained.
fn primary_reset(dev: CUdevice) -> Res {
    let (i, _) = device(dev)?;
    let h = {
        let p = primaries()[i].lock().unwrap_or_else(|e| e.into_inner());
        (p.refs > 0).then_some(p.handle)
    };
    if let Some(h) = h {
        crate::export_table::context_gone(h);
        mem::free_context(h, i);
    }
    Ok(())
}
