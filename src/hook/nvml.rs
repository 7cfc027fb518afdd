//! NVML wrappers: memory info shows the container's quota, as cuMemGetInfo does, so monitoring
//! inside the container and frameworks that size themselves with NVML agree with CUDA.

use super::hooks;
use super::{Lib, Real};
use crate::Mode;
use cuvisor_cuda_abi::nvml::{nvmlDevice_t, nvmlMemory_t, nvmlMemory_v2_t};
use std::ffi::{c_char, c_uint, CStr};

hooks! {
    Nvml nvmlDeviceGetMemoryInfo(dev: nvmlDevice_t, mem: *mut nvmlMemory_t) => memory_info;
    Nvml nvmlDeviceGetMemoryInfo_v2(dev: nvmlDevice_t, mem: *mut nvmlMemory_v2_t) => memory_info_v2;
}

static REAL_GET_UUID: Real = Real::new(Lib::Nvml, c"nvmlDeviceGetUUID");
static REAL_GET_INDEX: Real = Real::new(Lib::Nvml, c"nvmlDeviceGetIndex");

/// (ledger entry) of an NVML device, or None when not enforcing / unidentifiable.
fn entry(dev: nvmlDevice_t) -> Option<usize> {
    let Mode::Enforce(q) = crate::mode() else {
        return None;
    };
    let (uuid_fn, index_fn) = (REAL_GET_UUID.get(), REAL_GET_INDEX.get());
    if uuid_fn == 0 || index_fn == 0 {
        return None;
    }
    // SAFETY: the real nvmlDeviceGetUUID(nvmlDevice_t, char*, unsigned) and
    // nvmlDeviceGetIndex(nvmlDevice_t, unsigned*), called with our own buffers.
    let (uuid, index) = unsafe {
        let get_uuid: unsafe extern "C" fn(nvmlDevice_t, *mut c_char, c_uint) -> u32 =
            std::mem::transmute(uuid_fn);
        let get_index: unsafe extern "C" fn(nvmlDevice_t, *mut c_uint) -> u32 =
            std::mem::transmute(index_fn);
        let mut buf = [0 as c_char; 96];
        let mut index = 0;
        if get_uuid(dev, buf.as_mut_ptr(), buf.len() as c_uint) != 0
            || get_index(dev, &mut index) != 0
        {
            return None;
        }
        (
            CStr::from_ptr(buf.as_ptr())
                .to_str()
                .ok()
                .and_then(crate::config::parse_uuid)?,
            index,
        )
    };
    q.reclaim_now_and_then();
    super::cuda::settle_pools_now_and_then(q);
    q.entry_by_uuid(uuid, index)
}

/// Both memory-info versions: the real answer first, then (free, total, used) replaced by the
/// container's view. `fields` maps a filled struct to its (total, free, used) slots.
fn with_view<T>(
    r: u32,
    dev: nvmlDevice_t,
    mem: *mut T,
    fields: impl FnOnce(&mut T) -> (&mut u64, &mut u64, &mut u64),
) -> u32 {
    if r != 0 || mem.is_null() {
        return r;
    }
    if let (Some(e), Mode::Enforce(q)) = (entry(dev), crate::mode()) {
        // SAFETY: non-null and just filled (its version checked) by the real NVML.
        let (total, free, used) = fields(unsafe { &mut *mem });
        let v = q.view(e, *free, *total);
        (*total, *free, *used) = (v.total, v.free, v.used);
    }
    r
}

fn memory_info(
    real: impl Fn(nvmlDevice_t, *mut nvmlMemory_t) -> u32,
    dev: nvmlDevice_t,
    mem: *mut nvmlMemory_t,
) -> u32 {
    with_view(real(dev, mem), dev, mem, |m| {
        (&mut m.total, &mut m.free, &mut m.used)
    })
}

/// v2 also reports memory the driver reserves for itself; inside the container that is part of
/// nobody's quota, so it shows as 0 (total = free + used).
fn memory_info_v2(
    real: impl Fn(nvmlDevice_t, *mut nvmlMemory_v2_t) -> u32,
    dev: nvmlDevice_t,
    mem: *mut nvmlMemory_v2_t,
) -> u32 {
    with_view(real(dev, mem), dev, mem, |m| {
        m.reserved = 0;
        (&mut m.total, &mut m.free, &mut m.used)
    })
}
