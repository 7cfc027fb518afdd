//! Contexts, the registry every chapter builds on (device queries are in `device`): context
//! objects and their handles, primary contexts, cuCtxCreate v2..v4, the per-thread stack of
//! current contexts. It knows no other chapter: what ending or synchronizing a context asks of
//! them (streams, memory, pools, capture, the runtime's private table) is `ctx_end`'s.

use crate::{drv, export, write, Registry, Res};
use cuvisor_cuda_abi::cuda::{err, CUcontext, CUdevice, CUresult, CU_CTX_FLAGS_MASK};
use std::cell::RefCell;
use std::ffi::{c_uint, c_void};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::*};
use std::sync::{Arc, Mutex, OnceLock};

pub(crate) struct Context {
    pub dev: usize,
    pub flags: AtomicU32,
    /// Whether the context can do work: a created one until it is destroyed, a primary one while
    /// it is retained. A primary context's handle exists before and after (see [`primary_handle`]).
    pub alive: AtomicBool,
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

pub(crate) struct Primary {
    pub handle: usize,
    pub refs: u32,
    pub flags: u32,
}

pub(crate) fn primaries() -> &'static [Mutex<Primary>] {
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

pub(crate) use crate::device::device;

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
        work_tail,
        overhead: AtomicU64::new(0),
        id: {
            static NEXT: AtomicU64 = AtomicU64::new(1);
            NEXT.fetch_add(1, Relaxed)
        },
    };
    contexts().insert(ctx).0
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

/// The context can no longer work (`ctx_end` frees what the chapters hold for it first).
pub(crate) fn stop(h: usize) -> Res {
    contexts().get(h)?.alive.store(false, Release);
    Ok(())
}

/// Gives the context's own memory back.
pub(crate) fn release_own_memory(h: usize) -> Res {
    let c = contexts().get(h)?;
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

/// A destroyed context leaves the registry and every thread's stack (this thread's at least).
pub(crate) fn forget(h: usize) -> Res {
    contexts().remove(h)?;
    STACK.with(|s| s.borrow_mut().retain(|&x| x != h));
    Ok(())
}

/// Whether `h` is device `dev`'s primary context.
pub(crate) fn is_primary(h: usize, dev: usize) -> bool {
    primaries()[dev]
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .handle
        == h
}

pub(crate) fn check_flags(flags: c_uint) -> Res {
    if flags & !CU_CTX_FLAGS_MASK != 0 {
        return Err(err::INVALID_VALUE);
    }
    Ok(())
}

/// CUDA_ERROR_UNSUPPORTED_EXEC_AFFINITY (cuda.h 13.5): "the CUexecAffinityType passed to the
/// API call is not supported by the active device".
const UNSUPPORTED_EXEC_AFFINITY: CUresult = 224;

/// `CUctxCreateParams` (cuda.h 13.5).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CtxCreateParams {
    exec_affinity: *mut c_void,
    num_exec_affinity: i32,
    cig: *mut c_void,
}

/// Execution-affinity parameters of cuCtxCreate v3/v4: a count without an array (or a negative
/// one) is INVALID_VALUE ("Must be 0 if execAffinityParams is NULL"); any parameter asks for SM
/// partitioning, "Only supported Volta+ MPS" (cuda.h, `CUctxCreateParams`), which no simulated
/// context is: an unknown type is INVALID_VALUE, CU_EXEC_AFFINITY_TYPE_SM_COUNT
/// CUDA_ERROR_UNSUPPORTED_EXEC_AFFINITY (cuDeviceGetExecAffinitySupport answers 0 for it).
fn exec_affinity(params: *mut c_void, n: i32) -> Res {
    if n < 0 || (n > 0 && params.is_null()) {
        return Err(err::INVALID_VALUE);
    }
    for i in 0..n as usize {
        // CUexecAffinityParam: { CUexecAffinityType type; union { unsigned val; } param; }.
        let kind: i32 = crate::read((params as *const [i32; 2]).wrapping_add(i) as *const i32)?;
        if kind != 0 {
            return Err(err::INVALID_VALUE);
        }
    }
    if n > 0 {
        return Err(UNSUPPORTED_EXEC_AFFINITY);
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

export! {
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


    fn cuDevicePrimaryCtxGetState(dev: CUdevice, flags: *mut c_uint, active: *mut i32) {
        let (i, _) = device(dev)?;
        let p = primaries()[i].lock().unwrap_or_else(|e| e.into_inner());
        write(flags, p.flags)?;
        write(active, (p.refs > 0) as i32)
    }

    fn cuDevicePrimaryCtxSetFlags(dev: CUdevice, flags: c_uint) { primary_set_flags(dev, flags, false) }
    fn cuDevicePrimaryCtxSetFlags_v2(dev: CUdevice, flags: c_uint) { primary_set_flags(dev, flags, true) }

    fn cuCtxCreate_v2(pctx: *mut CUcontext, flags: c_uint, dev: CUdevice) {
        create_and_push(pctx, flags, dev)
    }

    /// The CUDA 2.x entry point, still exported by libcuda (cuGetProcAddress hands it out below
    /// version 3020): the same call.
    fn cuCtxCreate(pctx: *mut CUcontext, flags: c_uint, dev: CUdevice) {
        create_and_push(pctx, flags, dev)
    }

    /// v3 adds execution-affinity parameters (SM partitioning): see [`exec_affinity`].
    fn cuCtxCreate_v3(pctx: *mut CUcontext, params: *mut c_void, nparams: i32, flags: c_uint, dev: CUdevice) {
        exec_affinity(params, nparams)?;
        create_and_push(pctx, flags, dev)
    }

    /// v4 takes a `CUctxCreateParams*` (NULL allowed): execution affinity as v3; CIG parameters
    /// make a CUDA-in-graphics context, which "will fail with CUDA_ERROR_NOT_SUPPORTED if CIG is
    /// not supported by the device" (cuda.h): no simulated GPU supports it.
    fn cuCtxCreate_v4(pctx: *mut CUcontext, params: *mut CtxCreateParams, flags: c_uint, dev: CUdevice) {
        if !params.is_null() {
            let p: CtxCreateParams = crate::read(params)?;
            exec_affinity(p.exec_affinity, p.num_exec_affinity)?;
            if !p.cig.is_null() {
                drv()?;
                device(dev)?;
                return Err(err::NOT_SUPPORTED);
            }
        }
        create_and_push(pctx, flags, dev)
    }

    /// "Returns in *pExecAffinity the current value of type"; the one type,
    /// CU_EXEC_AFFINITY_TYPE_SM_COUNT, is not supported where cuDeviceGetExecAffinitySupport
    /// answers 0 (every simulated GPU: affinity needs MPS), hence
    /// CUDA_ERROR_UNSUPPORTED_EXEC_AFFINITY (UNVERIFIED: a real driver might report the whole
    /// device's SM count instead); any other type is INVALID_VALUE.
    fn cuCtxGetExecAffinity(out: *mut c_void, kind: i32) {
        current()?;
        if out.is_null() || kind != 0 {
            return Err(err::INVALID_VALUE);
        }
        Err(UNSUPPORTED_EXEC_AFFINITY)
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
