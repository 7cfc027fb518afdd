//! Classic allocation: cuMemAlloc, cuMemAllocPitch and cuMemFree (and their v1 forms, whose
//! memory lives below 4 GiB) on the allocation table of `mem`, and cuMemGetInfo. cuMemAlloc is a
//! "potentially unsafe API call" of stream capture, refused where a capture the thread's mode
//! sees is under way (`capture::check_unsafe_call`).

use crate::mem::{alloc, free, Kind};
use crate::{capture, ctx, drv, export, write};
use cuvisor_cuda_abi::cuda::*;
use cuvisor_sim::arena::{round_up, ALIGN};
use cuvisor_sim::state::now_ns;
use std::ffi::c_uint;
use std::sync::atomic::{AtomicU64, Ordering::*};

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
        // cuMemAlloc is the "potentially unsafe API call" of stream capture's example
        // (cuThreadExchangeStreamCaptureMode): refused during a capture the thread's mode sees.
        capture::check_unsafe_call()?;
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
}
