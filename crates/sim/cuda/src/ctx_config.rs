//! What a context carries besides its stack position (`ctx`): its limits (cuCtxGetLimit /
//! cuCtxSetLimit), its cache preference (cuCtxGetCacheConfig / cuCtxSetCacheConfig), the
//! persisting-L2 reset, and the whole-context event record and wait of CUDA 12.5
//! (cuCtxRecordEvent / cuCtxWaitEvent, which `event_order` carries out).
//!
//! The settings live here, keyed by the context's `id` (unique for the life of the process, never
//! reused, unlike a handle), so that a context made after another one's destruction starts from
//! the defaults.

use crate::{ctx, device, drv, export, write, Res};
use cuvisor_cuda_abi::cuda::{err, CUcontext, CUresult};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Mutex, OnceLock};

/// CUDA_ERROR_UNSUPPORTED_LIMIT (cuda.h 13.5, `cudaError_enum`).
pub(crate) const UNSUPPORTED_LIMIT: CUresult = 215;

// `CUlimit` (cuda.h 13.5).
const STACK_SIZE: i32 = 0;
const PRINTF_FIFO_SIZE: i32 = 1;
const MALLOC_HEAP_SIZE: i32 = 2;
const DEV_RUNTIME_SYNC_DEPTH: i32 = 3;
const DEV_RUNTIME_PENDING_LAUNCH_COUNT: i32 = 4;
const MAX_L2_FETCH_GRANULARITY: i32 = 5;
const PERSISTING_L2_CACHE_SIZE: i32 = 6;
const SHMEM_SIZE: i32 = 7;
const CIG_ENABLED: i32 = 8;
const CIG_SHMEM_FALLBACK_ENABLED: i32 = 9;
const PER_BLOCK_MEMORY_SIZE: i32 = 10;
/// `CU_LIMIT_MAX`: one past the last limit.
const LIMIT_MAX: i32 = 11;

/// The deepest device-runtime sync depth: "This limit can be set smaller than the default or up
/// the maximum launch depth of 24" (cuCtxSetLimit, cuda.h).
const MAX_SYNC_DEPTH: usize = 24;
/// "Values can range from 0B to 128B" (CU_LIMIT_MAX_L2_FETCH_GRANULARITY, cuCtxSetLimit).
const MAX_L2_FETCH: usize = 128;

/// A new context's limits.
/// - stack 1024 bytes per thread, printf FIFO 1 MiB, malloc heap 8 MiB: the defaults the CUDA
///   C++ Programming Guide gives ("Heap Memory Allocation": "a default size of 8 megabytes";
///   cudaDeviceGetLimit reports 1024 and 1048576 for the other two on every GPU of the era,
///   UNVERIFIED per GPU);
/// - device-runtime sync depth 2 ("the default sync depth, two levels of grids") and 2048
///   pending launches ("the default (2048 launches)"), cuCtxSetLimit in cuda.h;
/// - L2 fetch granularity 32 bytes (UNVERIFIED; a hint the driver "can ignore or clamp");
/// - persisting L2 0 until set; CIG off (the simulator makes no CUDA-in-graphics context) with
///   its shared-memory fallback on (UNVERIFIED); per-block memory 0 (UNVERIFIED, CUDA 13.x).
fn defaults() -> [usize; LIMIT_MAX as usize] {
    [1024, 1 << 20, 8 << 20, 2, 2048, 32, 0, 0, 0, 1, 0]
}

#[derive(Default)]
struct Settings {
    limits: Option<[usize; LIMIT_MAX as usize]>,
    cache: i32,
}

fn settings() -> &'static Mutex<HashMap<u64, Settings>> {
    static S: OnceLock<Mutex<HashMap<u64, Settings>>> = OnceLock::new();
    S.get_or_init(|| Mutex::new(HashMap::new()))
}

fn with<R>(id: u64, f: impl FnOnce(&mut Settings) -> R) -> R {
    let mut s = settings().lock().unwrap_or_else(|e| e.into_inner());
    f(s.entry(id).or_default())
}

fn get_limit(value: *mut usize, limit: i32) -> Res {
    let (_, c) = ctx::current()?;
    if !(0..LIMIT_MAX).contains(&limit) {
        return Err(err::INVALID_VALUE);
    }
    // CU_LIMIT_SHMEM_SIZE is "A maximum size in bytes of shared memory available to CUDA kernels
    // on a CIG context" (cuda.h): the simulator makes none, so it is unsupported here
    // (UNVERIFIED: what a real driver answers for an ordinary context).
    if limit == SHMEM_SIZE {
        return Err(UNSUPPORTED_LIMIT);
    }
    let v = with(c.id, |s| s.limits.unwrap_or_else(defaults)[limit as usize]);
    write(value, v)
}

/// cuCtxSetLimit (cuda.h 13.5): "The driver is free to modify the requested value to meet h/w
/// requirements (this could be clamping to minimum or maximum values ...)".
fn set_limit(limit: i32, value: usize) -> Res {
    let (_, c) = ctx::current()?;
    let d = drv()?;
    let dev = &d.sim.model.devices[c.dev];
    let v = match limit {
        STACK_SIZE | PRINTF_FIFO_SIZE | MALLOC_HEAP_SIZE | PER_BLOCK_MEMORY_SIZE => value,
        // "This limit is only applicable to devices of compute capability < 9.0. Attempting to
        // set this limit on devices of other compute capability versions will result in the
        // error CUDA_ERROR_UNSUPPORTED_LIMIT"; past the maximum depth of 24: INVALID_VALUE.
        DEV_RUNTIME_SYNC_DEPTH => {
            if dev.cc.0 >= 9 {
                return Err(UNSUPPORTED_LIMIT);
            }
            if value > MAX_SYNC_DEPTH {
                return Err(err::INVALID_VALUE);
            }
            value
        }
        // "only applicable to devices of compute capability 3.5 and higher": every simulated GPU.
        DEV_RUNTIME_PENDING_LAUNCH_COUNT => value,
        MAX_L2_FETCH_GRANULARITY => value.min(MAX_L2_FETCH),
        // "purely a performance hint and it can be ignored or clamped": clamped to the device's
        // CU_DEVICE_ATTRIBUTE_MAX_PERSISTING_L2_CACHE_SIZE (0 where there is no set-aside).
        PERSISTING_L2_CACHE_SIZE => {
            let max = device::attribute(&d.sim.model, c.dev, 108)
                .unwrap_or(0)
                .max(0) as usize;
            value.min(max)
        }
        CIG_SHMEM_FALLBACK_ENABLED => (value != 0) as usize,
        // CU_LIMIT_SHMEM_SIZE and CU_LIMIT_CIG_ENABLED "Can only be queried, cannot be set"
        // (cuda.h; the code for trying is UNVERIFIED).
        SHMEM_SIZE | CIG_ENABLED => return Err(UNSUPPORTED_LIMIT),
        _ => return Err(err::INVALID_VALUE),
    };
    with(c.id, |s| {
        s.limits.get_or_insert_with(defaults)[limit as usize] = v
    });
    Ok(())
}

/// `CUfunc_cache`: PREFER_NONE 0, PREFER_SHARED 1, PREFER_L1 2, PREFER_EQUAL 3.
const FUNC_CACHE_MAX: i32 = 3;

export! {
    fn cuCtxGetLimit(value: *mut usize, limit: i32) { get_limit(value, limit) }
    fn cuCtxSetLimit(limit: i32, value: usize) { set_limit(limit, value) }

    /// "This is only a preference" (cuCtxSetCacheConfig, cuda.h): remembered and answered back;
    /// a value outside `CUfunc_cache` is CUDA_ERROR_INVALID_VALUE.
    fn cuCtxSetCacheConfig(config: i32) {
        let (_, c) = ctx::current()?;
        if !(0..=FUNC_CACHE_MAX).contains(&config) {
            return Err(err::INVALID_VALUE);
        }
        with(c.id, |s| s.cache = config);
        Ok(())
    }
    fn cuCtxGetCacheConfig(config: *mut i32) {
        let (_, c) = ctx::current()?;
        write(config, with(c.id, |s| s.cache))
    }

    /// "Resets all persisting lines in cache to normal status" (cuda.h): the simulator keeps no
    /// cache lines; a context is needed (UNVERIFIED: cuda.h lists SUCCESS and NOT_SUPPORTED).
    fn cuCtxResetPersistingL2Cache() {
        ctx::current()?;
        Ok(())
    }

    /// CUDA 12.5: the event captures all the work of `ctx` at the call (a NULL context is
    /// INVALID_CONTEXT here: cuda.h does not say NULL means the current one for this call;
    /// UNVERIFIED).
    fn cuCtxRecordEvent(hctx: CUcontext, ev: *mut c_void) {
        let (h, _) = named(hctx)?;
        crate::event_order::ctx_record(h, ev)
    }
    /// CUDA 12.5: all future work of `ctx` waits for the event's work ("hEvent may be from a
    /// different context or device than hCtx").
    fn cuCtxWaitEvent(hctx: CUcontext, ev: *mut c_void) {
        let (h, _) = named(hctx)?;
        crate::event_order::ctx_wait(h, ev)
    }
}

/// A context the caller names, able to work: CUDA_ERROR_INVALID_CONTEXT otherwise.
fn named(h: CUcontext) -> Result<(usize, std::sync::Arc<ctx::Context>), CUresult> {
    drv()?;
    if h.is_null() {
        return Err(err::INVALID_CONTEXT);
    }
    let c = ctx::get(h)?;
    if !c.alive.load(std::sync::atomic::Ordering::Acquire) {
        return Err(err::INVALID_CONTEXT);
    }
    Ok((h as usize, c))
}
