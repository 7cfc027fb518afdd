//! Which device: what the driver wrappers ask the real driver about devices and the current
//! context (the visible device count, the current context's device, a device's UUID) and the
//! quota entry a device ordinal stands for. A leaf the wrapper rooms (`cuda`, `module`) build on.

use super::{Lib, Real};
use crate::quota::Quota;
use cuvisor_cuda_abi::cuda::*;
use std::ffi::c_int;
use std::sync::atomic::{AtomicI32, Ordering::*};

const SUCCESS: u32 = err::SUCCESS;

pub(super) static REAL_CTX_GET_DEVICE: Real = Real::new(Lib::Cuda, c"cuCtxGetDevice");
static REAL_DEVICE_GET_COUNT: Real = Real::new(Lib::Cuda, c"cuDeviceGetCount");
static REAL_DEVICE_GET_UUID: Real = Real::new(Lib::Cuda, c"cuDeviceGetUuid");
pub(super) static REAL_CTX_GET_CURRENT: Real = Real::new(Lib::Cuda, c"cuCtxGetCurrent");

pub(super) fn call_real<F: Copy>(r: &Real) -> Option<F> {
    let a = r.get();
    // SAFETY: `r` names a driver export whose C signature is F (each caller states it).
    (a != 0).then(|| unsafe { std::mem::transmute_copy::<usize, F>(&a) })
}

/// Visible device count, asked once (after cuInit succeeded; -1 until then).
#[inline]
pub(super) fn device_count() -> i32 {
    static COUNT: AtomicI32 = AtomicI32::new(-1);
    let c = COUNT.load(Relaxed);
    if c >= 0 {
        return c;
    }
    let mut n = 0;
    if let Some(f) = call_real::<unsafe extern "C" fn(*mut c_int) -> u32>(&REAL_DEVICE_GET_COUNT) {
        // SAFETY: cuDeviceGetCount(int*) with a valid out-pointer.
        if unsafe { f(&mut n) } == SUCCESS {
            COUNT.store(n, Relaxed);
            return n;
        }
    }
    -1
}

/// The ordinal of the current context's device.
#[inline]
pub(super) fn current_ordinal() -> Option<i32> {
    if device_count() == 1 {
        return Some(0); // one visible device: every allocation is on it, no driver call needed
    }
    let f = call_real::<unsafe extern "C" fn(*mut CUdevice) -> u32>(&REAL_CTX_GET_DEVICE)?;
    let mut d = -1;
    // SAFETY: cuCtxGetDevice(CUdevice*) with a valid out-pointer.
    (unsafe { f(&mut d) } == SUCCESS).then_some(d)
}

fn uuid_of(ordinal: i32) -> Option<[u8; 16]> {
    let f = call_real::<unsafe extern "C" fn(*mut CUuuid, CUdevice) -> u32>(&REAL_DEVICE_GET_UUID)?;
    let mut u = CUuuid::default();
    // SAFETY: cuDeviceGetUuid(CUuuid*, CUdevice) with a valid out-pointer.
    (unsafe { f(&mut u, ordinal) } == SUCCESS).then_some(u.bytes)
}

/// The quota's entry for device `ordinal` (found by its UUID, asked of the driver once).
#[inline]
pub(super) fn entry_of(q: &Quota, ordinal: i32) -> Option<usize> {
    q.entry(ordinal, || uuid_of(ordinal))
}
