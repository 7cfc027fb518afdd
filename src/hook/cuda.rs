//! Driver API wrappers: every path that takes device memory is charged before the driver
//! allocates and given back exactly on its free; memory queries show the quota.
//!
//! Which device an allocation lands on: the current context's (asked from the driver, or known
//! when only one device is visible).
//!
//! Stream-ordered allocations (cuMemAllocAsync, cuMemAllocFromPoolAsync) are charged by what
//! their pool reserves, not by what it hands out: the rules are in `quota::pools`, the driver's
//! answers (a pool's reserve, trims, the current pool of a device) come from here. Their frees
//! give nothing back by themselves; synchronization points, trims, threshold changes, context
//! teardown and memory queries settle the pools' charges down to what they still reserve.
//!
//! Memory shared between processes (VMM handles exported as file descriptors or fabric handles,
//! legacy IPC handles) is charged once, to the container that allocated it, for as long as a
//! process of that container holds it: the rules are in `quota::shared`; here the driver's
//! answers are turned into the keys both sides know the memory by.

use super::device::{
    call_real, current_ordinal, device_count, entry_of, REAL_CTX_GET_CURRENT, REAL_CTX_GET_DEVICE,
};
use super::hooks;
use super::{procaddr, Lib, Real};
use crate::quota::modules::Gone;
use crate::quota::pools::{Denial, Destroy, PoolDriver};
use crate::quota::shared::{self, Exported, Via};
use crate::quota::{charged_size, Quota, Refusal};
use crate::Mode;
use cuvisor_cuda_abi::cuda::*;
use std::ffi::{c_char, c_int, c_uint, c_void};
use std::sync::atomic::{AtomicU32, Ordering::*};

hooks! {
    Cuda cuMemAlloc_v2(dptr: *mut CUdeviceptr, size: usize) => alloc_v2;
    Cuda cuMemAlloc(dptr: *mut c_uint, size: c_uint) => alloc_v1;
    Cuda cuMemAllocPitch_v2(dptr: *mut CUdeviceptr, pitch: *mut usize, width: usize, height: usize, elem: c_uint) => alloc_pitch_v2;
    Cuda cuMemAllocPitch(dptr: *mut c_uint, pitch: *mut c_uint, width: c_uint, height: c_uint, elem: c_uint) => alloc_pitch_v1;
    Cuda cuMemAllocManaged(dptr: *mut CUdeviceptr, size: usize, flags: c_uint) => alloc_managed;
    Cuda cuMemAllocAsync(dptr: *mut CUdeviceptr, size: usize, stream: CUstream) => alloc_async::<false>;
    Cuda cuMemAllocAsync_ptsz(dptr: *mut CUdeviceptr, size: usize, stream: CUstream) => alloc_async::<true>;
    Cuda cuMemAllocFromPoolAsync(dptr: *mut CUdeviceptr, size: usize, pool: CUmemoryPool, stream: CUstream) => alloc_from_pool::<false>;
    Cuda cuMemAllocFromPoolAsync_ptsz(dptr: *mut CUdeviceptr, size: usize, pool: CUmemoryPool, stream: CUstream) => alloc_from_pool::<true>;
    Cuda cuMemFree_v2(dptr: CUdeviceptr) => free_v2;
    Cuda cuMemFree(dptr: c_uint) => free_v1;
    Cuda cuMemFreeAsync(dptr: CUdeviceptr, stream: CUstream) => free_async;
    Cuda cuMemFreeAsync_ptsz(dptr: CUdeviceptr, stream: CUstream) => free_async;
    Cuda cuMemPoolCreate(pool: *mut CUmemoryPool, props: *const CUmemPoolProps) => pool_create;
    Cuda cuMemPoolDestroy(pool: CUmemoryPool) => pool_destroy;
    Cuda cuMemPoolTrimTo(pool: CUmemoryPool, keep: usize) => pool_trim;
    Cuda cuMemPoolSetAttribute(pool: CUmemoryPool, attr: c_int, value: *mut c_void) => pool_set_attribute;
    Cuda cuStreamSynchronize(stream: CUstream) => synchronized;
    Cuda cuStreamSynchronize_ptsz(stream: CUstream) => synchronized;
    Cuda cuEventSynchronize(event: CUevent) => synchronized;
    Cuda cuCtxSynchronize() => ctx_synchronized;
    Cuda cuCtxSynchronize_v2(ctx: CUcontext) => synchronized;
    Cuda cuMemExportToShareableHandle(out: *mut c_void, handle: CUmemGenericAllocationHandle, kind: c_int, flags: u64) => mem_export;
    Cuda cuMemImportFromShareableHandle(handle: *mut CUmemGenericAllocationHandle, os: *mut c_void, kind: c_int) => mem_import;
    Cuda cuIpcGetMemHandle(handle: *mut CUipcMemHandle, dptr: CUdeviceptr) => ipc_get;
    Cuda cuIpcOpenMemHandle_v2(dptr: *mut CUdeviceptr, handle: CUipcMemHandle, flags: c_uint) => ipc_open;
    Cuda cuIpcOpenMemHandle(dptr: *mut CUdeviceptr, handle: CUipcMemHandle, flags: c_uint) => ipc_open;
    Cuda cuIpcCloseMemHandle(dptr: CUdeviceptr) => ipc_close;
    Cuda cuMemCreate(handle: *mut CUmemGenericAllocationHandle, size: usize, prop: *const CUmemAllocationProp, flags: u64) => mem_create;
    Cuda cuMemRelease(handle: CUmemGenericAllocationHandle) => mem_release;
    Cuda cuMemRetainAllocationHandle(handle: *mut CUmemGenericAllocationHandle, addr: *mut c_void) => mem_retain;
    Cuda cuMemMap(ptr: CUdeviceptr, size: usize, offset: usize, handle: CUmemGenericAllocationHandle, flags: u64) => mem_map;
    Cuda cuMemUnmap(ptr: CUdeviceptr, size: usize) => mem_unmap;
    Cuda cuArrayCreate_v2(array: *mut CUarray, desc: *const CUDA_ARRAY_DESCRIPTOR) => array_create;
    Cuda cuArrayCreate(array: *mut CUarray, desc: *const CUDA_ARRAY_DESCRIPTOR_v1) => array_create_v1;
    Cuda cuArray3DCreate_v2(array: *mut CUarray, desc: *const CUDA_ARRAY3D_DESCRIPTOR) => array3d_create;
    Cuda cuArray3DCreate(array: *mut CUarray, desc: *const CUDA_ARRAY3D_DESCRIPTOR_v1) => array3d_create_v1;
    Cuda cuMipmappedArrayCreate(array: *mut CUmipmappedArray, desc: *const CUDA_ARRAY3D_DESCRIPTOR, levels: c_uint) => mipmapped_create;
    Cuda cuArrayDestroy(array: CUarray) => handle_destroy;
    Cuda cuMipmappedArrayDestroy(array: CUmipmappedArray) => handle_destroy;
    Cuda cuCtxCreate_v2(ctx: *mut CUcontext, flags: c_uint, dev: CUdevice) => ctx_create_v2;
    Cuda cuCtxCreate(ctx: *mut CUcontext, flags: c_uint, dev: CUdevice) => ctx_create_v1;
    Cuda cuCtxCreate_v3(ctx: *mut CUcontext, params: *mut c_void, nparams: c_int, flags: c_uint, dev: CUdevice) => ctx_create_v3;
    Cuda cuCtxCreate_v4(ctx: *mut CUcontext, params: *mut c_void, flags: c_uint, dev: CUdevice) => ctx_create_v4;
    Cuda cuCtxDestroy_v2(ctx: CUcontext) => ctx_destroy;
    Cuda cuDevicePrimaryCtxRetain(ctx: *mut CUcontext, dev: CUdevice) => primary_retain;
    Cuda cuDevicePrimaryCtxRelease(dev: CUdevice) => primary_release;
    Cuda cuDevicePrimaryCtxRelease_v2(dev: CUdevice) => primary_release;
    Cuda cuDevicePrimaryCtxReset(dev: CUdevice) => primary_reset;
    Cuda cuDevicePrimaryCtxReset_v2(dev: CUdevice) => primary_reset;
    Cuda cuMemGetInfo_v2(free: *mut usize, total: *mut usize) => mem_get_info_v2;
    Cuda cuMemGetInfo(free: *mut c_uint, total: *mut c_uint) => mem_get_info_v1;
    Cuda cuDeviceTotalMem_v2(bytes: *mut usize, dev: CUdevice) => total_mem_v2;
    Cuda cuDeviceTotalMem(bytes: *mut c_uint, dev: CUdevice) => total_mem_v1;
    Cuda cuGetProcAddress(symbol: *const c_char, pfn: *mut *mut c_void, version: c_int, flags: u64) => procaddr::get_proc_address;
    Cuda cuGetProcAddress_v2(symbol: *const c_char, pfn: *mut *mut c_void, version: c_int, flags: u64, status: *mut c_int) => procaddr::get_proc_address_v2;
}

const SUCCESS: u32 = err::SUCCESS;
const OOM: u32 = err::OUT_OF_MEMORY;

// ---- the driver's answers cuvisor itself needs (real entry points, never our wrappers) ----------

static REAL_MEM_FREE: Real = Real::new(Lib::Cuda, c"cuMemFree_v2");
static REAL_GET_ADDRESS_RANGE: Real = Real::new(Lib::Cuda, c"cuMemGetAddressRange_v2");
static REAL_PRIMARY_GET_STATE: Real = Real::new(Lib::Cuda, c"cuDevicePrimaryCtxGetState");
static REAL_POOL_GET_ATTRIBUTE: Real = Real::new(Lib::Cuda, c"cuMemPoolGetAttribute");
static REAL_DEVICE_GET_MEM_POOL: Real = Real::new(Lib::Cuda, c"cuDeviceGetMemPool");
static REAL_DEVICE_GET_DEFAULT_MEM_POOL: Real = Real::new(Lib::Cuda, c"cuDeviceGetDefaultMemPool");
static REAL_DEVICE_SET_MEM_POOL: Real = Real::new(Lib::Cuda, c"cuDeviceSetMemPool");
static REAL_POINTER_GET_ATTRIBUTE: Real = Real::new(Lib::Cuda, c"cuPointerGetAttribute");
static REAL_STREAM_GET_CTX: Real = Real::new(Lib::Cuda, c"cuStreamGetCtx");
static REAL_CTX_PUSH: Real = Real::new(Lib::Cuda, c"cuCtxPushCurrent_v2");
static REAL_CTX_POP: Real = Real::new(Lib::Cuda, c"cuCtxPopCurrent_v2");
static REAL_STREAM_IS_CAPTURING: Real = Real::new(Lib::Cuda, c"cuStreamIsCapturing");
static REAL_STREAM_IS_CAPTURING_PTSZ: Real = Real::new(Lib::Cuda, c"cuStreamIsCapturing_ptsz");

/// The ordinal of the device of `stream`'s context: cuMemAllocAsync allocates from the current
/// pool of the stream's device, which need not be the current context's.
fn stream_ordinal(stream: CUstream) -> Option<i32> {
    let h = stream as usize;
    if device_count() == 1 || h == 0 || h == CU_STREAM_LEGACY || h == CU_STREAM_PER_THREAD {
        return current_ordinal(); // the current context's own stream
    }
    type GetCtx = unsafe extern "C" fn(CUstream, *mut CUcontext) -> u32;
    type Ctx = unsafe extern "C" fn(*mut CUcontext) -> u32;
    let get = call_real::<GetCtx>(&REAL_STREAM_GET_CTX)?;
    let current = call_real::<Ctx>(&REAL_CTX_GET_CURRENT)?;
    let (mut ctx, mut cur) = (std::ptr::null_mut(), std::ptr::null_mut());
    // SAFETY: cuStreamGetCtx(stream, CUcontext*) and cuCtxGetCurrent(CUcontext*) with valid
    // out-pointers; the stream is the program's own argument.
    if unsafe { get(stream, &mut ctx) } != SUCCESS || unsafe { current(&mut cur) } != SUCCESS {
        return None;
    }
    if ctx == cur {
        return current_ordinal();
    }
    let push = call_real::<unsafe extern "C" fn(CUcontext) -> u32>(&REAL_CTX_PUSH)?;
    let pop = call_real::<Ctx>(&REAL_CTX_POP)?;
    // SAFETY: the stream's context made current on this thread for one question, then popped
    // again (the thread's stack is as it was).
    if unsafe { push(ctx) } != SUCCESS {
        return None;
    }
    let f = call_real::<unsafe extern "C" fn(*mut CUdevice) -> u32>(&REAL_CTX_GET_DEVICE);
    let mut d = -1;
    // SAFETY: cuCtxGetDevice(CUdevice*) with a valid out-pointer.
    let ok = f.is_some_and(|f| unsafe { f(&mut d) } == SUCCESS);
    let mut popped = std::ptr::null_mut();
    // SAFETY: cuCtxPopCurrent_v2(CUcontext*) with a valid out-pointer, undoing our push.
    unsafe { pop(&mut popped) };
    ok.then_some(d)
}

// ---- pointers from the program (its contract: NULL or valid) -------------------------------------

fn read<T: Copy>(p: *const T) -> Option<T> {
    // SAFETY: non-null and, by the driver API contract, valid for a read of T.
    (!p.is_null()).then(|| unsafe { p.read_unaligned() })
}

fn write<T>(p: *mut T, v: T) {
    if !p.is_null() {
        // SAFETY: non-null and, by the driver API contract, valid for a write of T.
        unsafe { p.write_unaligned(v) }
    }
}

// ---- the rules ----------------------------------------------------------------------------------

/// The common shape of a charged allocation: charge `bytes` on `ordinal` first, let the driver
/// allocate, give the charge back if it fails, record it under the key the driver returned.
fn charged(
    call: &str,
    ordinal: Option<i32>,
    bytes: u64,
    allocate: impl FnOnce() -> u32,
    key: impl FnOnce() -> u64,
    handles: bool,
) -> Option<u32> {
    let q = match crate::mode() {
        Mode::PassThrough => return None,
        Mode::Broken(_) => {
            crate::log::refused_broken(call);
            return Some(OOM);
        }
        Mode::Enforce(q) => q,
    };
    let ord = ordinal.or_else(current_ordinal).unwrap_or(-1);
    let Some(e) = entry_of(q, ord) else {
        q.log_refusal(call, ord, bytes, Refusal::NoEntry);
        return Some(OOM);
    };
    if let Err(why) = q.charge_making_room(e, bytes, &DriverPools) {
        q.log_refusal(call, ord, bytes, why);
        return Some(OOM);
    }
    let r = allocate();
    if r != SUCCESS {
        q.uncharge(e, bytes);
        return Some(r);
    }
    let table = if handles { &q.handles } else { &q.ptrs };
    q.record(table, key(), e, bytes);
    Some(r)
}

/// A free: forget the key first (so an address the driver hands out again right after cannot be
/// confused with this one), free, then give the charge back — or put it back if the free failed.
fn released(key: u64, free: impl FnOnce() -> u32, handles: bool) -> u32 {
    let Mode::Enforce(q) = crate::mode() else {
        return free();
    };
    let table = if handles { &q.handles } else { &q.ptrs };
    let Some((e, bytes)) = table.remove(key) else {
        if !handles {
            q.pools.note_free(); // perhaps into a pool, which may now be trimmed under pressure
        }
        return free();
    };
    let r = free();
    if r != SUCCESS {
        q.record(table, key, e, bytes);
    } else if bytes == 0 && !handles {
        q.shared.freed(key, &**q); // IPC-exported: its charge is a share's (see `ipc_get`)
    } else {
        q.uncharge(e, bytes);
    }
    r
}

/// A plain allocation of `size` bytes whose device pointer the driver writes to `dptr` (a 64-bit
/// `CUdeviceptr`, or the 32-bit v1 one): charged in 512-byte units, recorded by that pointer.
/// NULL or zero-sized requests go straight to the driver for its own INVALID_VALUE.
fn pointer_alloc<P: Copy + Into<u64>>(
    call: &str,
    dptr: *mut P,
    size: u64,
    allocate: impl Fn() -> u32,
) -> u32 {
    if dptr.is_null() || size == 0 {
        return allocate();
    }
    charged(
        call,
        None,
        charged_size(size),
        &allocate,
        || read(dptr).map_or(0, Into::into),
        false,
    )
    .unwrap_or_else(allocate)
}

fn alloc_v2(
    real: impl Fn(*mut CUdeviceptr, usize) -> u32,
    dptr: *mut CUdeviceptr,
    size: usize,
) -> u32 {
    pointer_alloc("cuMemAlloc_v2", dptr, size as u64, || real(dptr, size))
}

fn alloc_v1(real: impl Fn(*mut c_uint, c_uint) -> u32, dptr: *mut c_uint, size: c_uint) -> u32 {
    pointer_alloc("cuMemAlloc", dptr, size as u64, || real(dptr, size))
}

fn alloc_managed(
    real: impl Fn(*mut CUdeviceptr, usize, c_uint) -> u32,
    dptr: *mut CUdeviceptr,
    size: usize,
    flags: c_uint,
) -> u32 {
    pointer_alloc("cuMemAllocManaged", dptr, size as u64, || {
        real(dptr, size, flags)
    })
}

/// Whether stream `s` is being captured (`ptsz`: a NULL stream is the per-thread one). During
/// capture, cuMemAllocAsync and cuMemAllocFromPoolAsync make an allocation node: "the
/// allocation is owned by the graph instead of the memory pool" (CUDA driver API reference), so
/// the pool does not grow and nothing is taken until the graph runs, which is when it is charged
/// (`graph.rs`); `pool_alloc` charges such an allocation no bound up front but still settles the
/// pool after it. Any answer but "capturing" takes the bounded path.
fn capturing(s: CUstream, ptsz: bool) -> bool {
    let r = if ptsz {
        &REAL_STREAM_IS_CAPTURING_PTSZ
    } else {
        &REAL_STREAM_IS_CAPTURING
    };
    let Some(f) = call_real::<unsafe extern "C" fn(CUstream, *mut c_int) -> u32>(r) else {
        return false;
    };
    let mut status = CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: cuStreamIsCapturing(CUstream, CUstreamCaptureStatus*) with a valid out-pointer.
    unsafe { f(s, &mut status) == SUCCESS && status == CU_STREAM_CAPTURE_STATUS_ACTIVE }
}

fn alloc_async<const PTSZ: bool>(
    real: impl Fn(*mut CUdeviceptr, usize, CUstream) -> u32,
    dptr: *mut CUdeviceptr,
    size: usize,
    s: CUstream,
) -> u32 {
    let captured = capturing(s, PTSZ);
    pool_alloc("cuMemAllocAsync", dptr, size, Err(s), captured, || {
        real(dptr, size, s)
    })
}

fn alloc_from_pool<const PTSZ: bool>(
    real: impl Fn(*mut CUdeviceptr, usize, CUmemoryPool, CUstream) -> u32,
    dptr: *mut CUdeviceptr,
    size: usize,
    pool: CUmemoryPool,
    s: CUstream,
) -> u32 {
    let captured = capturing(s, PTSZ);
    pool_alloc(
        "cuMemAllocFromPoolAsync",
        dptr,
        size,
        Ok(pool),
        captured,
        || real(dptr, size, pool, s),
    )
}

// ---- stream-ordered pools: charged by what they reserve (rules in `quota::pools`) -------------

/// The driver's answers about pools, from the real entry points.
struct DriverPools;

fn pool_attribute(pool: u64, attribute: c_int) -> Option<u64> {
    type Get = unsafe extern "C" fn(CUmemoryPool, c_int, *mut c_void) -> u32;
    let f = call_real::<Get>(&REAL_POOL_GET_ATTRIBUTE)?;
    let mut v = 0u64;
    // SAFETY: cuMemPoolGetAttribute(pool, attr, void*) of a u64-valued attribute, our own
    // out-value; the pool handle is one the driver gave the program.
    let r = unsafe {
        f(
            pool as CUmemoryPool,
            attribute,
            &mut v as *mut u64 as *mut c_void,
        )
    };
    (r == SUCCESS).then_some(v)
}

impl PoolDriver for DriverPools {
    fn reserved(&self, pool: u64) -> Option<u64> {
        pool_attribute(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)
    }
    fn used(&self, pool: u64) -> Option<u64> {
        pool_attribute(pool, CU_MEMPOOL_ATTR_USED_MEM_CURRENT)
    }
    fn trim(&self, pool: u64) {
        type Trim = unsafe extern "C" fn(CUmemoryPool, usize) -> u32;
        if let Some(f) = call_real::<Trim>(&cuMemPoolTrimTo::REAL) {
            // SAFETY: cuMemPoolTrimTo(pool, 0) of a pool the driver gave the program.
            unsafe { f(pool as CUmemoryPool, 0) };
        }
    }
    fn destroy(&self, pool: u64) -> bool {
        type Destroy = unsafe extern "C" fn(CUmemoryPool) -> u32;
        // SAFETY: cuMemPoolDestroy of a pool whose destroy the program asked for (put off).
        call_real::<Destroy>(&cuMemPoolDestroy::REAL)
            .is_some_and(|f| unsafe { f(pool as CUmemoryPool) } == SUCCESS)
    }
}

/// The current memory pool of device `ordinal` (what cuMemAllocAsync allocates from).
fn current_pool(ordinal: i32) -> Option<u64> {
    device_pool(&REAL_DEVICE_GET_MEM_POOL, ordinal)
}

fn device_pool(r: &Real, ordinal: i32) -> Option<u64> {
    let f = call_real::<unsafe extern "C" fn(*mut CUmemoryPool, CUdevice) -> u32>(r)?;
    let mut p: CUmemoryPool = std::ptr::null_mut();
    // SAFETY: cuDevice(Get|GetDefault)MemPool(CUmemoryPool*, CUdevice) with a valid out-pointer.
    (unsafe { f(&mut p, ordinal) } == SUCCESS && !p.is_null()).then_some(p as u64)
}

/// A u64-sized-or-smaller attribute of the allocation at `ptr`.
fn pointer_attribute<T: Copy + Default>(ptr: u64, attribute: c_int) -> Option<T> {
    type Get = unsafe extern "C" fn(*mut c_void, c_int, CUdeviceptr) -> u32;
    let f = call_real::<Get>(&REAL_POINTER_GET_ATTRIBUTE)?;
    let mut v = T::default();
    // SAFETY: cuPointerGetAttribute(void*, attr, ptr) with an out-value of the attribute's type.
    (unsafe { f(&mut v as *mut T as *mut c_void, attribute, ptr) } == SUCCESS).then_some(v)
}

/// Gives back what pools no longer reserve (at synchronization points, trims, teardown).
fn settle_pools(only: Option<u64>) {
    if let Mode::Enforce(q) = crate::mode() {
        if q.pools.any() {
            q.settle_pools(&DriverPools, only);
        }
    }
}

/// For memory queries (NVML's too): at most every 100 ms, nothing at all without pools.
pub(super) fn settle_pools_now_and_then(q: &Quota) {
    q.settle_pools_now_and_then(&DriverPools);
}

/// A stream-ordered allocation of `size` bytes from `pool` (Ok), or from the current pool of
/// the device of stream `Err(stream)`, as cuMemAllocAsync takes. Charged the most it can grow
/// the pool by first; after the driver allocated, the pool's charge is settled at what it
/// reserves. A pool that grew past what the quota covers has the allocation freed and is
/// trimmed again.
fn pool_alloc(
    call: &str,
    dptr: *mut CUdeviceptr,
    size: usize,
    pool: Result<CUmemoryPool, CUstream>,
    captured: bool,
    allocate: impl Fn() -> u32,
) -> u32 {
    if dptr.is_null() || size == 0 {
        return allocate();
    }
    let q = match crate::mode() {
        Mode::PassThrough => return allocate(),
        Mode::Broken(_) => {
            crate::log::refused_broken(call);
            return OOM;
        }
        Mode::Enforce(q) => q,
    };
    let ord = match pool {
        Ok(_) => current_ordinal(),
        Err(stream) => stream_ordinal(stream),
    }
    .unwrap_or(-1);
    let Some(guess) = pool.map(|p| p as u64).ok().or_else(|| current_pool(ord)) else {
        q.log_refusal(call, ord, size as u64, Refusal::NoEntry);
        return OOM;
    };
    // A pool the program created is on the device its properties named; any other is taken to
    // be the current device's until its first allocation says otherwise.
    let pord = q.pools.device_of(guess).map_or(ord, |(_, o)| o);
    let Some(e) = entry_of(q, pord) else {
        q.log_refusal(call, pord, size as u64, Refusal::NoEntry);
        return OOM;
    };
    // A captured allocation is charged no bound (the pool does not grow: `capturing`), but it
    // is committed like any other: were the capture to end between the question and the call
    // (another thread ending it), the pool's growth is excess, charged, and refused beyond the
    // quota, so the race takes nothing uncharged.
    let bound = if captured { 0 } else { size as u64 };
    let ticket = match q.pool_begin(guess, e, pord, bound, &DriverPools) {
        Ok(t) => t,
        Err(Denial::Destroyed) => return err::INVALID_VALUE,
        Err(Denial::Refused(why)) => {
            q.log_refusal(call, pord, size as u64, why);
            return OOM;
        }
    };
    let r = allocate();
    if r != SUCCESS {
        q.pool_abort(ticket);
        return r;
    }
    let ptr = read(dptr).unwrap_or(0);
    // On a machine with more than one device, make sure: ask the driver which pool the memory
    // came from (a pool set current on the device since, say).
    let actual = match pool {
        Err(_) if device_count() > 1 => {
            pointer_attribute::<usize>(ptr, CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE)
                .map(|p| p as u64)
                .filter(|&p| p != 0)
                .unwrap_or(guess)
        }
        _ => guess,
    };
    let mut settled = q.pool_commit(ticket, &DriverPools);
    if actual != guess && settled.is_ok() {
        let o = pointer_attribute::<c_int>(ptr, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL).unwrap_or(ord);
        settled = match entry_of(q, o) {
            Some(e) => q.pool_commit_unplanned(actual, e, o, &DriverPools),
            None => Err(Refusal::NoEntry),
        };
    }
    if let Err(why) = settled {
        if let Some(f) = call_real::<unsafe extern "C" fn(CUdeviceptr) -> u32>(&REAL_MEM_FREE) {
            // SAFETY: cuMemFree_v2 of the pointer the driver just gave us, which nobody has seen.
            unsafe { f(ptr) };
        }
        DriverPools.trim(actual);
        q.settle_pools(&DriverPools, Some(actual));
        write(dptr, 0);
        q.log_refusal(call, pord, size as u64, why);
        return OOM;
    }
    r
}

/// A created pool is recorded with the device its properties name (host-located pools are not
/// device memory, and are charged to the current device if they are ever allocated from: on
/// the safe side).
fn pool_create(
    real: impl Fn(*mut CUmemoryPool, *const CUmemPoolProps) -> u32,
    pool: *mut CUmemoryPool,
    props: *const CUmemPoolProps,
) -> u32 {
    let r = real(pool, props);
    if let (SUCCESS, Mode::Enforce(q)) = (r, crate::mode()) {
        let on_device = read(props).filter(|p| p.location.type_ == CU_MEM_LOCATION_TYPE_DEVICE);
        if let (Some(h), Some(p)) = (read(pool), on_device) {
            if let Some(e) = entry_of(q, p.location.id) {
                q.pools.register(h as u64, e, p.location.id);
            }
        }
    }
    r
}

/// A pool with allocations outstanding keeps its memory after cuMemPoolDestroy until they are
/// freed, and its handle can no longer be asked what it holds: cuvisor puts such a destroy off
/// (see `quota::pools`) and does what the driver would have done at once, to the program.
fn pool_destroy(real: impl Fn(CUmemoryPool) -> u32, pool: CUmemoryPool) -> u32 {
    let Mode::Enforce(q) = crate::mode() else {
        return real(pool);
    };
    match q.pool_destroy(pool as u64, &DriverPools) {
        Destroy::Now => {
            let r = real(pool);
            if r == SUCCESS {
                q.pool_destroyed(pool as u64);
            }
            r
        }
        Destroy::Again => err::INVALID_VALUE,
        Destroy::PutOff => {
            // "Destroying the current mempool of a device sets the default mempool of that
            // device as the current mempool for that device."
            if let Some((_, ord)) = q.pools.device_of(pool as u64) {
                if current_pool(ord) == Some(pool as u64) {
                    type Set = unsafe extern "C" fn(CUdevice, CUmemoryPool) -> u32;
                    let default = device_pool(&REAL_DEVICE_GET_DEFAULT_MEM_POOL, ord);
                    if let (Some(f), Some(d)) =
                        (call_real::<Set>(&REAL_DEVICE_SET_MEM_POOL), default)
                    {
                        // SAFETY: cuDeviceSetMemPool(dev, its own default pool).
                        unsafe { f(ord, d as CUmemoryPool) };
                    }
                }
            }
            SUCCESS
        }
    }
}

fn pool_trim(real: impl Fn(CUmemoryPool, usize) -> u32, pool: CUmemoryPool, keep: usize) -> u32 {
    let r = real(pool, keep);
    if r == SUCCESS {
        settle_pools(Some(pool as u64));
    }
    r
}

fn pool_set_attribute(
    real: impl Fn(CUmemoryPool, c_int, *mut c_void) -> u32,
    pool: CUmemoryPool,
    attr: c_int,
    value: *mut c_void,
) -> u32 {
    let r = real(pool, attr, value);
    if r == SUCCESS {
        settle_pools(Some(pool as u64));
    }
    r
}

/// Stream, event and context synchronization: pools release what exceeds their threshold
/// there, and their charges follow (nothing but one load for a process without pools).
fn synchronized<H>(real: impl Fn(*mut H) -> u32, h: *mut H) -> u32 {
    let r = real(h);
    if r == SUCCESS {
        settle_pools(None);
    }
    r
}

fn ctx_synchronized(real: impl Fn() -> u32) -> u32 {
    let r = real();
    if r == SUCCESS {
        settle_pools(None);
    }
    r
}

/// Pitched allocations: the driver picks the pitch. We charge an upper bound (rows padded to
/// 512 bytes, the largest pitch alignment of current GPUs), then settle on the real pitch x
/// height once it is known; a pitch beyond the bound that the quota cannot cover is freed again.
fn pitched(
    call: &str,
    width: u64,
    height: u64,
    allocate: impl FnOnce() -> u32,
    result: impl FnOnce() -> (u64, u64),
) -> Option<u32> {
    let bound = width.div_ceil(512) * 512 * height;
    let mut actual = None;
    let r = charged(
        call,
        None,
        bound,
        allocate,
        || {
            let (ptr, pitch) = result();
            actual = Some((ptr, pitch * height));
            ptr
        },
        false,
    )?;
    let (Some((ptr, bytes)), Mode::Enforce(q)) = (actual, crate::mode()) else {
        return Some(r);
    };
    if bytes == bound {
        return Some(r);
    }
    let (e, _) = q.ptrs.remove(ptr)?;
    q.uncharge(e, bound);
    if let Err(why) = q.charge(e, bytes) {
        q.log_refusal(call, current_ordinal().unwrap_or(-1), bytes, why);
        if let Some(f) = call_real::<unsafe extern "C" fn(CUdeviceptr) -> u32>(&REAL_MEM_FREE) {
            // SAFETY: cuMemFree_v2 of the pointer the driver just gave us, which nobody has seen.
            unsafe { f(ptr) };
        }
        return Some(OOM);
    }
    q.record(&q.ptrs, ptr, e, bytes);
    Some(r)
}

fn alloc_pitch_v2(
    real: impl Fn(*mut CUdeviceptr, *mut usize, usize, usize, c_uint) -> u32,
    dptr: *mut CUdeviceptr,
    pitch: *mut usize,
    w: usize,
    h: usize,
    elem: c_uint,
) -> u32 {
    if dptr.is_null() || pitch.is_null() || w == 0 || h == 0 {
        return real(dptr, pitch, w, h, elem);
    }
    pitched(
        "cuMemAllocPitch_v2",
        w as u64,
        h as u64,
        || real(dptr, pitch, w, h, elem),
        || (read(dptr).unwrap_or(0), read(pitch).unwrap_or(0) as u64),
    )
    .unwrap_or_else(|| real(dptr, pitch, w, h, elem))
}

fn alloc_pitch_v1(
    real: impl Fn(*mut c_uint, *mut c_uint, c_uint, c_uint, c_uint) -> u32,
    dptr: *mut c_uint,
    pitch: *mut c_uint,
    w: c_uint,
    h: c_uint,
    elem: c_uint,
) -> u32 {
    if dptr.is_null() || pitch.is_null() || w == 0 || h == 0 {
        return real(dptr, pitch, w, h, elem);
    }
    pitched(
        "cuMemAllocPitch",
        w as u64,
        h as u64,
        || real(dptr, pitch, w, h, elem),
        || {
            (
                read(dptr).unwrap_or(0) as u64,
                read(pitch).unwrap_or(0) as u64,
            )
        },
    )
    .unwrap_or_else(|| real(dptr, pitch, w, h, elem))
}

fn free_v2(real: impl Fn(CUdeviceptr) -> u32, dptr: CUdeviceptr) -> u32 {
    released(dptr, || real(dptr), false)
}

fn free_v1(real: impl Fn(c_uint) -> u32, dptr: c_uint) -> u32 {
    released(dptr as u64, || real(dptr), false)
}

fn free_async(real: impl Fn(CUdeviceptr, CUstream) -> u32, dptr: CUdeviceptr, s: CUstream) -> u32 {
    released(dptr, || real(dptr, s), false)
}

/// VMM: physical memory on a device is charged at cuMemCreate (host-located memory is not
/// device memory and passes through); given back when it is released and no longer mapped.
fn mem_create(
    real: impl Fn(*mut CUmemGenericAllocationHandle, usize, *const CUmemAllocationProp, u64) -> u32,
    h: *mut CUmemGenericAllocationHandle,
    size: usize,
    prop: *const CUmemAllocationProp,
    flags: u64,
) -> u32 {
    let on_device = read(prop).filter(|p| p.location.type_ == CU_MEM_LOCATION_TYPE_DEVICE);
    match on_device {
        Some(p) if !h.is_null() && size > 0 => charged(
            "cuMemCreate",
            Some(p.location.id),
            size as u64,
            || real(h, size, prop, flags),
            || read(h).unwrap_or(0),
            true,
        )
        .unwrap_or_else(|| real(h, size, prop, flags)),
        _ => real(h, size, prop, flags),
    }
}

/// The key a shareable handle is known by in every process that has it (see `quota::shared`):
/// a POSIX descriptor by the file it is (its device and inode, which SCM_RIGHTS and
/// pidfd_getfd carry over), a fabric handle by its 64 bytes. 0 for other kinds.
fn shareable_key(kind: c_int, fd: Option<c_int>, bytes: *const u8) -> u64 {
    match kind {
        CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR => fd.map_or(0, |fd| {
            // SAFETY: libc::stat is plain data, for which zero bytes are a valid value.
            let mut st: libc::stat = unsafe { std::mem::zeroed() };
            // SAFETY: fstat on a descriptor number (any value: a bad one is EBADF) into a stat
            // buffer we own.
            if unsafe { libc::fstat(fd, &mut st) } == 0 {
                shared::file_key(st.st_dev, st.st_ino)
            } else {
                0
            }
        }),
        CU_MEM_HANDLE_TYPE_FABRIC => {
            read(bytes as *const [u8; CU_IPC_HANDLE_SIZE]).map_or(0, |b| shared::bytes_key(&b))
        }
        _ => 0,
    }
}

/// An exported handle's memory lives while any handle, mapping or exported descriptor of it
/// does, in any process (cuMemRelease, cuMemExportToShareableHandle): its charge moves to a
/// share of the container, held by this process until it exits and by the importers of the
/// container while they hold it (`quota::shared`). Taken out of the handle table, the charge is
/// given back by no release or unmap of this process.
fn mem_export(
    real: impl Fn(*mut c_void, CUmemGenericAllocationHandle, c_int, u64) -> u32,
    out: *mut c_void,
    h: CUmemGenericAllocationHandle,
    kind: c_int,
    flags: u64,
) -> u32 {
    let r = real(out, h, kind, flags);
    if let (SUCCESS, Mode::Enforce(q)) = (r, crate::mode()) {
        let key = shareable_key(kind, read(out as *const c_int), out as *const u8);
        // No room for a share: the charge stays with this process until it exits.
        let _: Exported = q.shared.export_vmm(h, q.handles.remove(h), key, &**q);
    }
    r
}

/// An import of memory the container allocated holds its share while the imported handle or a
/// mapping of it lives; another container's memory is charged nothing here. The share is held
/// before the driver imports, so that its last other holder cannot give the charge back while
/// the import is under way.
fn mem_import(
    real: impl Fn(*mut CUmemGenericAllocationHandle, *mut c_void, c_int) -> u32,
    out: *mut CUmemGenericAllocationHandle,
    os: *mut c_void,
    kind: c_int,
) -> u32 {
    let Mode::Enforce(q) = crate::mode() else {
        return real(out, os, kind);
    };
    let fd = c_int::try_from(os as usize).ok();
    let held = q
        .shared
        .before_import(shareable_key(kind, fd, os as *const u8), &**q);
    let r = real(out, os, kind);
    match (r, read(out)) {
        (SUCCESS, Some(h)) => q.shared.imported(Via::Vmm, h, held, &**q),
        _ => q.shared.not_imported(held, &**q),
    }
    r
}

/// Legacy IPC: the exported pointer's charge moves to a share of the container, held by this
/// process until it frees the pointer (by the driver's contract every importer has closed it by
/// then) and by the container's importers until their last close. Its record stays, with 0
/// bytes, so that its free lets the share go (`released`).
fn ipc_get(
    real: impl Fn(*mut CUipcMemHandle, CUdeviceptr) -> u32,
    handle: *mut CUipcMemHandle,
    dptr: CUdeviceptr,
) -> u32 {
    let r = real(handle, dptr);
    let (SUCCESS, Mode::Enforce(q), Some(hd)) = (r, crate::mode(), read(handle)) else {
        return r;
    };
    let key = shared::bytes_key(&hd.reserved);
    match q.ptrs.remove(dptr) {
        Some((e, bytes)) if bytes > 0 => {
            match q.shared.export_ipc(dptr, Some((e, bytes)), key, &**q) {
                Exported::Shared => q.record(&q.ptrs, dptr, e, 0),
                // No room for a share: a plain allocation still, given back at its free.
                _ => q.record(&q.ptrs, dptr, e, bytes),
            }
        }
        Some((e, _)) => {
            q.record(&q.ptrs, dptr, e, 0);
            let _ = q.shared.export_ipc(dptr, None, key, &**q);
        }
        None => {}
    }
    r
}

fn ipc_open(
    real: impl Fn(*mut CUdeviceptr, CUipcMemHandle, c_uint) -> u32,
    dptr: *mut CUdeviceptr,
    handle: CUipcMemHandle,
    flags: c_uint,
) -> u32 {
    let Mode::Enforce(q) = crate::mode() else {
        return real(dptr, handle, flags);
    };
    let held = q
        .shared
        .before_import(shared::bytes_key(&handle.reserved), &**q);
    let r = real(dptr, handle, flags);
    match (r, read(dptr)) {
        (SUCCESS, Some(p)) => q.shared.imported(Via::Ipc, p, held, &**q),
        _ => q.shared.not_imported(held, &**q),
    }
    r
}

fn ipc_close(real: impl Fn(CUdeviceptr) -> u32, dptr: CUdeviceptr) -> u32 {
    let r = real(dptr);
    if let (SUCCESS, Mode::Enforce(q)) = (r, crate::mode()) {
        q.shared.import_gone(Via::Ipc, dptr, &**q);
    }
    r
}

/// A retained handle (cuMemRetainAllocationHandle: one more reference to the memory mapped at an
/// address, to be released as often as retained) keeps the memory alive after the first release
/// and the last unmap, and the memory can be mapped again through it: like an exported handle,
/// it stays charged until the process exits (never less than the driver holds).
fn mem_retain(
    real: impl Fn(*mut CUmemGenericAllocationHandle, *mut c_void) -> u32,
    out: *mut CUmemGenericAllocationHandle,
    addr: *mut c_void,
) -> u32 {
    let r = real(out, addr);
    if let (SUCCESS, Mode::Enforce(q)) = (r, crate::mode()) {
        if let Some(h) = read(out) {
            q.pin_exported(h);
        }
    }
    r
}

/// A mapped handle's memory lives until its last mapping goes, whenever the program releases
/// it: so does its charge (see `quota::vmm`).
fn mem_release(
    real: impl Fn(CUmemGenericAllocationHandle) -> u32,
    h: CUmemGenericAllocationHandle,
) -> u32 {
    if let Mode::Enforce(q) = crate::mode() {
        let mut m = q.mappings.lock();
        if m.is_mapped(h) {
            let r = real(h);
            if r == SUCCESS {
                m.set_released(h);
            }
            return r;
        }
        if q.shared.is_import(Via::Vmm, h) {
            let r = real(h);
            if r == SUCCESS {
                q.shared.import_gone(Via::Vmm, h, &**q);
            }
            return r;
        }
    }
    released(h, || real(h), true)
}

fn mem_map(
    real: impl Fn(CUdeviceptr, usize, usize, CUmemGenericAllocationHandle, u64) -> u32,
    ptr: CUdeviceptr,
    size: usize,
    offset: usize,
    h: CUmemGenericAllocationHandle,
    flags: u64,
) -> u32 {
    let r = real(ptr, size, offset, h, flags);
    if let (SUCCESS, Mode::Enforce(q)) = (r, crate::mode()) {
        // Handles this process charged, and imports (which hold a share while mapped); not
        // host memory.
        if q.handles.get(h).is_some() || q.shared.is_import(Via::Vmm, h) {
            q.mappings.lock().map(ptr, size as u64, h);
        }
    }
    r
}

/// Unmapping the last mapping of a released handle frees its memory: its charge goes back (an
/// import's: its hold on the share goes). The
/// record is taken out before the driver call (as in `released`), so a handle value the driver
/// hands out again right after cannot be confused with it.
fn mem_unmap(real: impl Fn(CUdeviceptr, usize) -> u32, ptr: CUdeviceptr, size: usize) -> u32 {
    let Mode::Enforce(q) = crate::mode() else {
        return real(ptr, size);
    };
    let mut m = q.mappings.lock();
    let freed: Vec<(u64, Option<(usize, u64)>)> = m
        .freed_by_unmap(ptr, size as u64)
        .into_iter()
        .map(|h| (h, q.handles.remove(h)))
        .collect();
    let r = real(ptr, size);
    if r == SUCCESS {
        m.unmap(ptr, size as u64);
        for (h, charge) in freed {
            match charge {
                Some((e, bytes)) => q.uncharge(e, bytes),
                None => q.shared.import_gone(Via::Vmm, h, &**q), // an import's last mapping
            }
        }
    } else {
        for (h, (e, bytes)) in freed.into_iter().filter_map(|(h, c)| Some((h, c?))) {
            q.record(&q.handles, h, e, bytes);
        }
    }
    r
}

/// An array's descriptor, or the line saying there was none to read.
fn descriptor<T: Copy>(desc: *const T) -> Result<T, String> {
    read(desc).ok_or_else(|| "no array descriptor (CUDA_ERROR_INVALID_VALUE)".to_string())
}

fn array_create(
    real: impl Fn(*mut CUarray, *const CUDA_ARRAY_DESCRIPTOR) -> u32,
    a: *mut CUarray,
    desc: *const CUDA_ARRAY_DESCRIPTOR,
) -> u32 {
    let bytes = descriptor(desc)
        .and_then(|d| crate::quota::array_bytes(d.Width, d.Height, 1, d.Format, d.NumChannels, 1));
    handle_alloc("cuArrayCreate_v2", bytes, a, || real(a, desc))
}

fn array3d_create(
    real: impl Fn(*mut CUarray, *const CUDA_ARRAY3D_DESCRIPTOR) -> u32,
    a: *mut CUarray,
    desc: *const CUDA_ARRAY3D_DESCRIPTOR,
) -> u32 {
    let bytes = descriptor(desc).and_then(|d| {
        crate::quota::array_bytes(d.Width, d.Height, d.Depth, d.Format, d.NumChannels, 1)
    });
    handle_alloc("cuArray3DCreate_v2", bytes, a, || real(a, desc))
}

/// The CUDA 2.x form (32-bit extents), which cuGetProcAddress hands out below version 3020.
fn array_create_v1(
    real: impl Fn(*mut CUarray, *const CUDA_ARRAY_DESCRIPTOR_v1) -> u32,
    a: *mut CUarray,
    desc: *const CUDA_ARRAY_DESCRIPTOR_v1,
) -> u32 {
    let bytes = descriptor(desc).and_then(|d| {
        crate::quota::array_bytes(
            d.Width as usize,
            d.Height as usize,
            1,
            d.Format,
            d.NumChannels,
            1,
        )
    });
    handle_alloc("cuArrayCreate", bytes, a, || real(a, desc))
}

fn array3d_create_v1(
    real: impl Fn(*mut CUarray, *const CUDA_ARRAY3D_DESCRIPTOR_v1) -> u32,
    a: *mut CUarray,
    desc: *const CUDA_ARRAY3D_DESCRIPTOR_v1,
) -> u32 {
    let bytes = descriptor(desc).and_then(|d| {
        crate::quota::array_bytes(
            d.Width as usize,
            d.Height as usize,
            d.Depth as usize,
            d.Format,
            d.NumChannels,
            1,
        )
    });
    handle_alloc("cuArray3DCreate", bytes, a, || real(a, desc))
}

fn mipmapped_create(
    real: impl Fn(*mut CUmipmappedArray, *const CUDA_ARRAY3D_DESCRIPTOR, c_uint) -> u32,
    a: *mut CUmipmappedArray,
    desc: *const CUDA_ARRAY3D_DESCRIPTOR,
    levels: c_uint,
) -> u32 {
    let bytes = descriptor(desc).and_then(|d| {
        crate::quota::array_bytes(d.Width, d.Height, d.Depth, d.Format, d.NumChannels, levels)
    });
    handle_alloc("cuMipmappedArrayCreate", bytes, a, || real(a, desc, levels))
}

/// An allocation that returns an opaque handle in `*out` (arrays, mipmapped arrays): charged
/// `bytes` and recorded by handle. A NULL `out` goes to the driver for its own INVALID_VALUE.
/// A size that cannot be computed (Err: the line to print) is refused with
/// CUDA_ERROR_INVALID_VALUE, the driver's answer for such a descriptor, and never passed
/// through (the driver might take memory no one charged).
fn handle_alloc<H>(
    call: &str,
    bytes: Result<u64, String>,
    out: *mut *mut H,
    go: impl Fn() -> u32,
) -> u32 {
    if out.is_null() {
        return go();
    }
    match bytes {
        Ok(b) => charged(
            call,
            None,
            b,
            &go,
            || read(out).map_or(0, |x| x as u64),
            true,
        )
        .unwrap_or_else(&go),
        Err(why) => match crate::mode() {
            Mode::PassThrough => go(),
            Mode::Broken(_) => {
                crate::log::refused_broken(call);
                OOM
            }
            Mode::Enforce(q) => {
                q.log_unsized(call, &why);
                err::INVALID_VALUE
            }
        },
    }
}

/// Arrays, mipmapped arrays and contexts are opaque handles recorded in the handle table.
fn handle_destroy(real: impl Fn(*mut c_void) -> u32, h: *mut c_void) -> u32 {
    released(h as u64, || real(h), true)
}

// ---- context teardown: the driver frees what was allocated in the context ----------------------

/// Whether the driver no longer has an allocation starting at `ptr`: CUDA_ERROR_NOT_FOUND, or the
/// address now lies inside another allocation. Any other answer (no context, an old driver)
/// keeps the charge.
fn allocation_gone(ptr: u64) -> bool {
    type GetRange = unsafe extern "C" fn(*mut CUdeviceptr, *mut usize, CUdeviceptr) -> u32;
    let Some(f) = call_real::<GetRange>(&REAL_GET_ADDRESS_RANGE) else {
        return false;
    };
    let (mut base, mut size) = (0, 0);
    // SAFETY: cuMemGetAddressRange_v2(CUdeviceptr*, size_t*, CUdeviceptr) with valid out-pointers.
    match unsafe { f(&mut base, &mut size, ptr) } {
        err::NOT_FOUND => true,
        SUCCESS => base != ptr,
        _ => false,
    }
}

/// After a context went away with allocations still in it: give back what they were charged,
/// and what the modules loaded in it were.
fn after_teardown(gone: Gone) {
    if let Mode::Enforce(q) = crate::mode() {
        q.sweep(&q.ptrs, allocation_gone);
    }
    super::module::context_gone(gone);
    settle_pools(None);
    super::graph::settle_all();
}

fn ctx_destroy(real: impl Fn(CUcontext) -> u32, ctx: CUcontext) -> u32 {
    let r = handle_destroy(&real, ctx);
    if r == SUCCESS {
        after_teardown(Gone::Context(ctx as u64));
    }
    r
}

/// Whether device `dev`'s primary context is active (None: the driver did not say).
fn primary_active(dev: CUdevice) -> Option<bool> {
    type GetState = unsafe extern "C" fn(CUdevice, *mut c_uint, *mut c_int) -> u32;
    let f = call_real::<GetState>(&REAL_PRIMARY_GET_STATE)?;
    let (mut flags, mut active) = (0, 0);
    // SAFETY: cuDevicePrimaryCtxGetState(CUdevice, unsigned*, int*) with valid out-pointers.
    (unsafe { f(dev, &mut flags, &mut active) } == SUCCESS).then_some(active != 0)
}

// ---- context memory: `context_reserve` per context, which no allocation call shows -------------

fn reserve() -> u64 {
    match crate::mode() {
        Mode::Enforce(q) => q.config.context_reserve,
        _ => 0,
    }
}

fn ctx_create(call: &str, ctx: *mut CUcontext, dev: CUdevice, create: impl Fn() -> u32) -> u32 {
    let r = reserve();
    if r == 0 || ctx.is_null() {
        return create();
    }
    charged(
        call,
        Some(dev),
        r,
        &create,
        || read(ctx).map_or(0, |c| c as u64),
        true,
    )
    .unwrap_or_else(create)
}

fn ctx_create_v2(
    real: impl Fn(*mut CUcontext, c_uint, CUdevice) -> u32,
    ctx: *mut CUcontext,
    flags: c_uint,
    dev: CUdevice,
) -> u32 {
    ctx_create("cuCtxCreate_v2", ctx, dev, || real(ctx, flags, dev))
}

/// The CUDA 2.x entry point (cuGetProcAddress hands it out below version 3020): the same call.
fn ctx_create_v1(
    real: impl Fn(*mut CUcontext, c_uint, CUdevice) -> u32,
    ctx: *mut CUcontext,
    flags: c_uint,
    dev: CUdevice,
) -> u32 {
    ctx_create("cuCtxCreate", ctx, dev, || real(ctx, flags, dev))
}

fn ctx_create_v3(
    real: impl Fn(*mut CUcontext, *mut c_void, c_int, c_uint, CUdevice) -> u32,
    ctx: *mut CUcontext,
    p: *mut c_void,
    n: c_int,
    flags: c_uint,
    dev: CUdevice,
) -> u32 {
    ctx_create("cuCtxCreate_v3", ctx, dev, || real(ctx, p, n, flags, dev))
}

fn ctx_create_v4(
    real: impl Fn(*mut CUcontext, *mut c_void, c_uint, CUdevice) -> u32,
    ctx: *mut CUcontext,
    p: *mut c_void,
    flags: c_uint,
    dev: CUdevice,
) -> u32 {
    ctx_create("cuCtxCreate_v4", ctx, dev, || real(ctx, p, flags, dev))
}

/// Primary contexts are reference counted by the driver; we charge the reserve when this
/// process first retains one and give it back when it releases the last reference.
static PRIMARY_REFS: [AtomicU32; 64] = [const { AtomicU32::new(0) }; 64];

fn primary_retain(
    real: impl Fn(*mut CUcontext, CUdevice) -> u32,
    ctx: *mut CUcontext,
    dev: CUdevice,
) -> u32 {
    let (r, Some(refs)) = (
        reserve(),
        usize::try_from(dev).ok().and_then(|d| PRIMARY_REFS.get(d)),
    ) else {
        return real(ctx, dev);
    };
    if r == 0 {
        return real(ctx, dev);
    }
    loop {
        match refs.load(Acquire) {
            // Another thread is taking the first reference (and charging it): wait for it.
            PRIMARY_PENDING => std::thread::yield_now(),
            0 => {
                if refs
                    .compare_exchange(0, PRIMARY_PENDING, AcqRel, Acquire)
                    .is_err()
                {
                    continue;
                }
                // The first reference: charged like a context, once, recorded under a key no
                // pointer can have.
                let key = primary_key(dev);
                let res = charged(
                    "cuDevicePrimaryCtxRetain",
                    Some(dev),
                    r,
                    || real(ctx, dev),
                    || key,
                    true,
                )
                .unwrap_or_else(|| real(ctx, dev));
                refs.store(u32::from(res == SUCCESS), Release);
                return res;
            }
            _ => {
                let res = real(ctx, dev);
                if res == SUCCESS {
                    refs.fetch_add(1, AcqRel);
                }
                return res;
            }
        }
    }
}

/// PRIMARY_REFS while a thread takes a device's first reference.
const PRIMARY_PENDING: u32 = u32::MAX;

/// The key the primary context's reserve is recorded under (no pointer or handle has it).
fn primary_key(dev: CUdevice) -> u64 {
    u64::MAX - 2 - dev as u64
}

fn primary_release(real: impl Fn(CUdevice) -> u32, dev: CUdevice) -> u32 {
    let Some(refs) = usize::try_from(dev).ok().and_then(|d| PRIMARY_REFS.get(d)) else {
        return real(dev);
    };
    let res = real(dev);
    if res != SUCCESS {
        return res;
    }
    let dropped = refs.fetch_update(AcqRel, Acquire, |n| match n {
        0 | PRIMARY_PENDING => None,
        n => Some(n - 1),
    });
    if dropped == Ok(1) {
        if let Mode::Enforce(q) = crate::mode() {
            q.release(&q.handles, primary_key(dev));
        }
    }
    // The last reference destroyed the context, and with it what was allocated in it.
    if matches!(crate::mode(), Mode::Enforce(_)) && primary_active(dev) == Some(false) {
        after_teardown(Gone::Primary(dev));
    }
    res
}

/// cuDevicePrimaryCtxReset (what cudaDeviceReset calls): the primary context and everything
/// allocated in it are gone, whatever its reference count was.
fn primary_reset(real: impl Fn(CUdevice) -> u32, dev: CUdevice) -> u32 {
    let res = real(dev);
    if res == SUCCESS {
        if let Some(refs) = usize::try_from(dev).ok().and_then(|d| PRIMARY_REFS.get(d)) {
            refs.store(0, Release);
        }
        if let Mode::Enforce(q) = crate::mode() {
            q.release(&q.handles, primary_key(dev));
        }
        after_teardown(Gone::Primary(dev));
    }
    res
}

// ---- what the program is shown ------------------------------------------------------------------

/// (free, total) as the program should see them on the current device, from the physical ones.
fn shown(phys_free: u64, phys_total: u64, ordinal: Option<i32>) -> (u64, u64) {
    match crate::mode() {
        Mode::Enforce(q) => {
            let Some(e) = entry_of(q, ordinal.or_else(current_ordinal).unwrap_or(-1)) else {
                return (0, 0);
            };
            q.reclaim_now_and_then();
            settle_pools_now_and_then(q);
            let v = q.view(e, phys_free, phys_total);
            (v.free, v.total)
        }
        // Fail closed: nothing is free.
        Mode::Broken(_) => (0, phys_total),
        Mode::PassThrough => (phys_free, phys_total),
    }
}

fn mem_get_info_v2(
    real: impl Fn(*mut usize, *mut usize) -> u32,
    free: *mut usize,
    total: *mut usize,
) -> u32 {
    let (mut f, mut t) = (0usize, 0usize);
    let r = real(&mut f, &mut t);
    if r != SUCCESS || free.is_null() || total.is_null() {
        return if r == SUCCESS { real(free, total) } else { r };
    }
    let (f, t) = shown(f as u64, t as u64, None);
    write(free, f as usize);
    write(total, t as usize);
    r
}

fn mem_get_info_v1(
    real: impl Fn(*mut c_uint, *mut c_uint) -> u32,
    free: *mut c_uint,
    total: *mut c_uint,
) -> u32 {
    let (mut f, mut t) = (0, 0);
    let r = real(&mut f, &mut t);
    if r != SUCCESS || free.is_null() || total.is_null() {
        return if r == SUCCESS { real(free, total) } else { r };
    }
    let (f, t) = shown(f as u64, t as u64, None);
    write(free, f.min(u32::MAX as u64) as c_uint);
    write(total, t.min(u32::MAX as u64) as c_uint);
    r
}

fn total_mem_v2(
    real: impl Fn(*mut usize, CUdevice) -> u32,
    bytes: *mut usize,
    dev: CUdevice,
) -> u32 {
    let r = real(bytes, dev);
    if r == SUCCESS {
        if let Some(t) = read(bytes) {
            write(bytes, shown(t as u64, t as u64, Some(dev)).1 as usize);
        }
    }
    r
}

fn total_mem_v1(
    real: impl Fn(*mut c_uint, CUdevice) -> u32,
    bytes: *mut c_uint,
    dev: CUdevice,
) -> u32 {
    let r = real(bytes, dev);
    if r == SUCCESS {
        if let Some(t) = read(bytes) {
            write(
                bytes,
                shown(t as u64, t as u64, Some(dev)).1.min(u32::MAX as u64) as c_uint,
            );
        }
    }
    r
}
