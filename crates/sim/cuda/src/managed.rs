//! Managed (unified) memory.

use crate::mem::{alloc, Kind};
use crate::{export, write};
use cuvisor_cuda_abi::cuda::*;
use std::ffi::c_uint;

export! {
    fn cuMemAllocManaged(dptr: *mut CUdeviceptr, size: usize, flags: c_uint) {
        if dptr.is_null() || !matches!(flags, CU_MEM_ATTACH_GLOBAL | CU_MEM_ATTACH_HOST) {
            return Err(err::INVALID_VALUE);
        }
        write(dptr, alloc(size as u64, Kind::Managed, None)?)
    }
}
