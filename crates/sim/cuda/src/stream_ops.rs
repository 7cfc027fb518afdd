//! What streams are asked besides kernels and copies, where stream capture and the pools take
//! part: synchronization and queries (refused on a capturing stream, which they invalidate; a
//! synchronization trims the device's pools), host functions and callbacks (under capture a host
//! function is a host node), memory operations (cuStreamWaitValue*, cuStreamWriteValue*,
//! cuStreamBatchMemOp: refused under capture) and cuStreamDestroy (the stream leaves any capture
//! it took part in). Streams themselves, stream order and the driver threads that run queued
//! host work are `stream`.

use crate::stream::{stream, streams, wait_for, Stream};
use crate::{call_host, capture, drv, export, mem, read, Res};
use cuvisor_cuda_abi::cuda::*;
use cuvisor_sim::state::{now_ns, sleep_until};
use std::ffi::{c_uint, c_void};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::*};
use std::sync::Arc;

fn stream_sync(h: CUstream, pt: bool) -> Res {
    let s = stream(h, pt)?;
    capture::refuse_if_capturing(&s)?;
    wait_for(|| !s.busy());
    sleep_until(s.done_at());
    crate::pool::trim_pools_at_sync(s.dev);
    Ok(())
}

fn stream_query(h: CUstream, pt: bool) -> Res {
    let s = stream(h, pt)?;
    capture::refuse_if_capturing(&s)?;
    if !s.busy() && now_ns() >= s.done_at() {
        Ok(())
    } else {
        Err(err::NOT_READY)
    }
}

/// `CUhostFn`: `void (*)(void *userData)`.
type HostFn = Option<extern "C" fn(*mut c_void)>;
/// `CUstreamCallback`: `void (*)(CUstream hStream, CUresult status, void *userData)`.
type Callback = Option<extern "C" fn(CUstream, CUresult, *mut c_void)>;

/// cuLaunchHostFunc: `f(data)` on the stream's driver thread once the work before it is done;
/// work queued after it waits until it returns. A NULL function is CUDA_ERROR_INVALID_VALUE.
fn host_func(h: CUstream, f: HostFn, data: *mut c_void, pt: bool) -> Res {
    let s = stream(h, pt)?;
    let f = f.ok_or(err::INVALID_VALUE)?;
    // Under capture a host function becomes a host node of the graph (cuda.h: unlike
    // cuStreamAddCallback, cuLaunchHostFunc is supported in capture).
    if let Some(r) = capture::capture_host(&s, Some(f), data) {
        return r;
    }
    let data = data as usize;
    s.submit_host(move |s| {
        sleep_until(s.done_at());
        call_host(|| f(data as *mut c_void));
    });
    Ok(())
}

fn host_sync_mode(mode: c_uint) -> Res {
    if mode <= 1 {
        Ok(())
    } else {
        Err(err::INVALID_VALUE)
    }
}

/// cuStreamAddCallback: as a host function, called with (stream, CUDA_SUCCESS, userData): the
/// simulated device has no errors to report. "flags - Reserved for future use, must be 0"
/// (cuda.h), else CUDA_ERROR_INVALID_VALUE; a NULL callback is CUDA_ERROR_INVALID_VALUE. "This
/// function is not supported with cuStreamBeginCapture and cuStreamEndCapture, unlike
/// cuLaunchHostFunc" (cuda.h): CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED on a capturing stream.
fn add_callback(h: CUstream, cb: Callback, data: *mut c_void, flags: c_uint, pt: bool) -> Res {
    let s = stream(h, pt)?;
    let cb = cb.ok_or(err::INVALID_VALUE)?;
    if flags != 0 {
        return Err(err::INVALID_VALUE);
    }
    capture::refuse_if_capturing(&s)?;
    let (h, data) = (h as usize, data as usize);
    s.submit_host(move |s| {
        sleep_until(s.done_at());
        call_host(|| cb(h as CUstream, err::SUCCESS, data as *mut c_void));
    });
    Ok(())
}

// ---- memory operations --------------------------------------------------------------------------

/// `CUstreamWaitValue_flags`: the condition in the low bits (GEQ 0, EQ 1, AND 2, NOR 3), and
/// CU_STREAM_WAIT_VALUE_FLUSH (1 << 30), a flush of remote writes, of which the simulated device
/// has none.
const WAIT_FLUSH: u32 = 1 << 30;
/// `CUstreamWriteValue_flags`: DEFAULT 0, NO_MEMORY_BARRIER 1.
const WRITE_NO_MEMORY_BARRIER: u32 = 1;

/// Whether the value at the wait's address satisfies its condition (cuda.h,
/// `CUstreamWaitValue_flags`): GEQ "(int32_t)(*addr - value) >= 0" (a cyclic
/// greater-or-equal), EQ "*addr == value", AND "(*addr & value) != 0", NOR
/// "~(*addr | value) != 0"; 64-bit waits the same on 64 bits.
fn holds(cond: u32, cur: u64, value: u64, wide: bool) -> bool {
    let mask = if wide { u64::MAX } else { u32::MAX as u64 };
    let (cur, value) = (cur & mask, value & mask);
    match cond {
        0 if wide => (cur.wrapping_sub(value) as i64) >= 0,
        0 => (cur.wrapping_sub(value) as u32 as i32) >= 0,
        1 => cur == value,
        2 => cur & value != 0,
        _ => !(cur | value) & mask != 0,
    }
}

/// One memory operation, checked and ready to queue.
#[derive(Clone, Copy)]
enum MemOp {
    Wait {
        addr: u64,
        value: u64,
        cond: u32,
        wide: bool,
    },
    Write {
        addr: u64,
        value: u64,
        wide: bool,
    },
    /// A flush of remote writes or a memory barrier: nothing to do in a device whose writes are
    /// the host's.
    Fence,
}

/// The word at `addr` (validated by `mem::memop_target` when the operation was queued). The
/// device accesses it as one aligned word, which the host may change at any time.
fn load(addr: u64, wide: bool) -> u64 {
    if wide {
        // SAFETY: an 8-aligned device or registered host word (checked at enqueue); the
        // program keeps it alive while the operation is queued (the driver API's contract).
        unsafe { AtomicU64::from_ptr(addr as *mut u64) }.load(Acquire)
    } else {
        // SAFETY: a 4-aligned word, as above.
        unsafe { AtomicU32::from_ptr(addr as *mut u32) }.load(Acquire) as u64
    }
}

fn store(addr: u64, value: u64, wide: bool) {
    if wide {
        // SAFETY: as in `load`.
        unsafe { AtomicU64::from_ptr(addr as *mut u64) }.store(value, Release)
    } else {
        // SAFETY: as in `load`.
        unsafe { AtomicU32::from_ptr(addr as *mut u32) }.store(value as u32, Release)
    }
}

fn wait_op(addr: u64, value: u64, flags: u32, wide: bool) -> Result<MemOp, CUresult> {
    if flags & !(WAIT_FLUSH | 3) != 0 {
        return Err(err::INVALID_VALUE);
    }
    mem::memop_target(addr, if wide { 8 } else { 4 })?;
    Ok(MemOp::Wait {
        addr,
        value,
        cond: flags & 3,
        wide,
    })
}

fn write_op(addr: u64, value: u64, flags: u32, wide: bool) -> Result<MemOp, CUresult> {
    if flags & !WRITE_NO_MEMORY_BARRIER != 0 {
        return Err(err::INVALID_VALUE);
    }
    mem::memop_target(addr, if wide { 8 } else { 4 })?;
    Ok(MemOp::Write { addr, value, wide })
}

/// Queues checked operations in order: a write happens when the stream reaches it; a wait
/// blocks the stream (on its driver thread) until its condition holds.
fn enqueue(s: &Arc<Stream>, ops: Vec<MemOp>) {
    for op in ops {
        match op {
            MemOp::Wait {
                addr,
                value,
                cond,
                wide,
            } => {
                if !s.busy() && holds(cond, load(addr, wide), value, wide) {
                    continue; // already satisfied: nothing to wait for
                }
                s.submit_host(move |_| wait_for(|| holds(cond, load(addr, wide), value, wide)));
            }
            MemOp::Write { addr, value, wide } => s.submit(move |_| store(addr, value, wide)),
            MemOp::Fence => {}
        }
    }
}

fn mem_op(h: CUstream, pt: bool, op: impl FnOnce() -> Result<MemOp, CUresult>) -> Res {
    let s = stream(h, pt)?;
    // Memory operations captured would be a batch-memop node, which the graphs do not model.
    capture::refuse_if_capturing(&s)?;
    let op = op()?;
    enqueue(&s, vec![op]);
    Ok(())
}

/// `CUstreamBatchMemOpParams`: a 48-byte union tagged by its first field. Wait and write
/// operations: address at 8, value (32 or 64 bits) at 16, flags at 24; flush and barrier:
/// flags at 4.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct BatchParams {
    operation: u32,
    flags4: u32,
    address: u64,
    value: u64,
    flags: u32,
    _pad: u32,
    alias: u64,
    _rest: u64,
}

/// `CUstreamBatchMemOpType`.
const OP_WAIT_VALUE_32: u32 = 1;
const OP_WRITE_VALUE_32: u32 = 2;
const OP_FLUSH_REMOTE_WRITES: u32 = 3;
const OP_WAIT_VALUE_64: u32 = 4;
const OP_WRITE_VALUE_64: u32 = 5;
const OP_BARRIER: u32 = 6;

/// cuStreamBatchMemOp: "count - The number of operations in the array. Must be less than 256";
/// "flags - Reserved for future expansion; must be 0" (cuda.h). Every operation is checked
/// before any is queued. Atomic reductions (CUDA 13) are not modelled: CUDA_ERROR_NOT_SUPPORTED,
/// which cuda.h lists.
fn batch(h: CUstream, count: c_uint, p: *const BatchParams, flags: c_uint, pt: bool) -> Res {
    let s = stream(h, pt)?;
    if flags != 0 || count >= 256 || (count > 0 && p.is_null()) {
        return Err(err::INVALID_VALUE);
    }
    capture::refuse_if_capturing(&s)?;
    let mut ops = Vec::with_capacity(count as usize);
    for i in 0..count as usize {
        let b: BatchParams = read(p.wrapping_add(i))?;
        let _ = b.alias;
        ops.push(match b.operation {
            OP_WAIT_VALUE_32 => wait_op(b.address, b.value & 0xffff_ffff, b.flags, false)?,
            OP_WAIT_VALUE_64 => wait_op(b.address, b.value, b.flags, true)?,
            OP_WRITE_VALUE_32 => write_op(b.address, b.value & 0xffff_ffff, b.flags, false)?,
            OP_WRITE_VALUE_64 => write_op(b.address, b.value, b.flags, true)?,
            // "flags - Must be 0" (flushRemoteWrites); barrier: SYS 0 or GPU 1.
            OP_FLUSH_REMOTE_WRITES if b.flags4 == 0 => MemOp::Fence,
            OP_BARRIER if b.flags4 <= 1 => MemOp::Fence,
            8 => return Err(err::NOT_SUPPORTED),
            _ => return Err(err::INVALID_VALUE),
        });
    }
    enqueue(&s, ops);
    Ok(())
}

export! {
    /// Destroying a stream with work queued returns at once; the work still runs ("the
    /// resources associated with hStream will be released automatically after the device has
    /// completed all work in hStream", cuStreamDestroy, CUDA driver API reference).
    fn cuStreamDestroy_v2(s: CUstream) {
        drv()?;
        let st = streams().remove(s as usize)?;
        capture::forget_stream(&st);
        Ok(())
    }
    fn cuStreamSynchronize(s: CUstream) { stream_sync(s, false) }
    fn cuStreamSynchronize_ptsz(s: CUstream) { stream_sync(s, true) }
    fn cuStreamQuery(s: CUstream) { stream_query(s, false) }
    fn cuStreamQuery_ptsz(s: CUstream) { stream_query(s, true) }
    fn cuLaunchHostFunc(s: CUstream, f: HostFn, data: *mut c_void) { host_func(s, f, data, false) }
    fn cuLaunchHostFunc_ptsz(s: CUstream, f: HostFn, data: *mut c_void) { host_func(s, f, data, true) }
    /// CUDA 13.1's form: `syncMode`, CU_HOST_TASK_BLOCKING (0) or CU_HOST_TASK_SPINWAIT (1), says
    /// how the driver's thread waits for host tasks, which changes nothing the program sees;
    /// another value is CUDA_ERROR_INVALID_VALUE (cuda.h 13.5, `CUhostTaskSyncMode`).
    fn cuLaunchHostFunc_v2(s: CUstream, f: HostFn, data: *mut c_void, mode: c_uint) { host_sync_mode(mode)?; host_func(s, f, data, false) }
    fn cuLaunchHostFunc_v2_ptsz(s: CUstream, f: HostFn, data: *mut c_void, mode: c_uint) { host_sync_mode(mode)?; host_func(s, f, data, true) }
    fn cuStreamAddCallback(s: CUstream, cb: Callback, data: *mut c_void, flags: c_uint) { add_callback(s, cb, data, flags, false) }
    fn cuStreamAddCallback_ptsz(s: CUstream, cb: Callback, data: *mut c_void, flags: c_uint) { add_callback(s, cb, data, flags, true) }
    // The CUDA 8.0 memory operations (v1) and CUDA 11.7's (v2) differ in which devices enable
    // them by default, not in what they do.
    fn cuStreamWaitValue32(s: CUstream, a: CUdeviceptr, v: u32, flags: c_uint) { mem_op(s, false, || wait_op(a, v as u64, flags, false)) }
    fn cuStreamWaitValue32_ptsz(s: CUstream, a: CUdeviceptr, v: u32, flags: c_uint) { mem_op(s, true, || wait_op(a, v as u64, flags, false)) }
    fn cuStreamWaitValue32_v2(s: CUstream, a: CUdeviceptr, v: u32, flags: c_uint) { mem_op(s, false, || wait_op(a, v as u64, flags, false)) }
    fn cuStreamWaitValue32_v2_ptsz(s: CUstream, a: CUdeviceptr, v: u32, flags: c_uint) { mem_op(s, true, || wait_op(a, v as u64, flags, false)) }
    fn cuStreamWaitValue64(s: CUstream, a: CUdeviceptr, v: u64, flags: c_uint) { mem_op(s, false, || wait_op(a, v, flags, true)) }
    fn cuStreamWaitValue64_ptsz(s: CUstream, a: CUdeviceptr, v: u64, flags: c_uint) { mem_op(s, true, || wait_op(a, v, flags, true)) }
    fn cuStreamWaitValue64_v2(s: CUstream, a: CUdeviceptr, v: u64, flags: c_uint) { mem_op(s, false, || wait_op(a, v, flags, true)) }
    fn cuStreamWaitValue64_v2_ptsz(s: CUstream, a: CUdeviceptr, v: u64, flags: c_uint) { mem_op(s, true, || wait_op(a, v, flags, true)) }
    fn cuStreamWriteValue32(s: CUstream, a: CUdeviceptr, v: u32, flags: c_uint) { mem_op(s, false, || write_op(a, v as u64, flags, false)) }
    fn cuStreamWriteValue32_ptsz(s: CUstream, a: CUdeviceptr, v: u32, flags: c_uint) { mem_op(s, true, || write_op(a, v as u64, flags, false)) }
    fn cuStreamWriteValue32_v2(s: CUstream, a: CUdeviceptr, v: u32, flags: c_uint) { mem_op(s, false, || write_op(a, v as u64, flags, false)) }
    fn cuStreamWriteValue32_v2_ptsz(s: CUstream, a: CUdeviceptr, v: u32, flags: c_uint) { mem_op(s, true, || write_op(a, v as u64, flags, false)) }
    fn cuStreamWriteValue64(s: CUstream, a: CUdeviceptr, v: u64, flags: c_uint) { mem_op(s, false, || write_op(a, v, flags, true)) }
    fn cuStreamWriteValue64_ptsz(s: CUstream, a: CUdeviceptr, v: u64, flags: c_uint) { mem_op(s, true, || write_op(a, v, flags, true)) }
    fn cuStreamWriteValue64_v2(s: CUstream, a: CUdeviceptr, v: u64, flags: c_uint) { mem_op(s, false, || write_op(a, v, flags, true)) }
    fn cuStreamWriteValue64_v2_ptsz(s: CUstream, a: CUdeviceptr, v: u64, flags: c_uint) { mem_op(s, true, || write_op(a, v, flags, true)) }
    fn cuStreamBatchMemOp(s: CUstream, n: c_uint, p: *const BatchParams, flags: c_uint) { batch(s, n, p, flags, false) }
    fn cuStreamBatchMemOp_ptsz(s: CUstream, n: c_uint, p: *const BatchParams, flags: c_uint) { batch(s, n, p, flags, true) }
    fn cuStreamBatchMemOp_v2(s: CUstream, n: c_uint, p: *const BatchParams, flags: c_uint) { batch(s, n, p, flags, false) }
    fn cuStreamBatchMemOp_v2_ptsz(s: CUstream, n: c_uint, p: *const BatchParams, flags: c_uint) { batch(s, n, p, flags, true) }
}
