//! Work submission: kernel launches (and, with the compute share, graph and cooperative
//! launches). Forwarded untouched while no compute limit is configured.

use super::hooks;
use cuvisor_cuda_abi::cuda::*;
use std::ffi::{c_uint, c_void};

hooks! {
    Cuda cuLaunchKernel(f: CUfunction, gx: c_uint, gy: c_uint, gz: c_uint, bx: c_uint, by: c_uint, bz: c_uint, smem: c_uint, stream: CUstream, params: *mut *mut c_void, extra: *mut *mut c_void) => launch;
    Cuda cuLaunchKernel_ptsz(f: CUfunction, gx: c_uint, gy: c_uint, gz: c_uint, bx: c_uint, by: c_uint, bz: c_uint, smem: c_uint, stream: CUstream, params: *mut *mut c_void, extra: *mut *mut c_void) => launch;
}

#[allow(clippy::too_many_arguments)]
fn launch(
    real: impl Fn(
        CUfunction,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        CUstream,
        *mut *mut c_void,
        *mut *mut c_void,
    ) -> u32,
    f: CUfunction,
    gx: c_uint,
    gy: c_uint,
    gz: c_uint,
    bx: c_uint,
    by: c_uint,
    bz: c_uint,
    smem: c_uint,
    s: CUstream,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> u32 {
    real(f, gx, gy, gz, bx, by, bz, smem, s, params, extra)
}
