//! Kernel launches: cuLaunchKernel, cuLaunchCooperativeKernel and cuLaunchKernelEx (and their
//! per-thread forms), with a `CUfunction` or a `CUkernel` from `exec`'s registry. A launch on a
//! capturing stream becomes a kernel node of the capture's graph (`capture`); otherwise its run
//! time (`exec::kernel_ns`) takes the device's timeline in stream order, and lazy loading
//! counts the function loaded (`module_info`).

use crate::exec::{check_dims, function_or_kernel, kernel_ns, Dims};
use crate::stream::{stream, Stream};
use crate::{capture, drv, export, read, Res};
use cuvisor_cuda_abi::cuda::*;
use std::ffi::{c_uint, c_void};
use std::sync::Arc;

/// Kernel work for a stream: its run time on the device's timeline.
#[derive(Clone, Copy)]
pub(crate) struct Node {
    pub ns: u64,
}

impl Stream {
    /// Queues `node.ns` ns of kernel work in stream order (behind any host work queued on it).
    pub(crate) fn run(self: &Arc<Self>, node: Node) -> Res {
        drv()?;
        self.submit(move |s| {
            let _ = s.run_kernel_now(node.ns);
        });
        Ok(())
    }
}

#[allow(clippy::too_many_arguments)]
fn launch(
    f: CUfunction,
    dims: Dims,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
    h: CUstream,
    per_thread: bool,
    cooperative: bool,
) -> Res {
    drv()?;
    let func = function_or_kernel(f)?;
    let s = stream(h, per_thread)?;
    check_dims(&dims, cooperative, s.dev)?;
    let ns = kernel_ns(&func, params, extra)?;
    // Captured: a kernel node of the capture's graph.
    if let Some(r) = capture::capture_kernel(&s, f, &dims, 0, ns) {
        return r;
    }
    s.run(Node { ns })?;
    // Lazy loading loads a function at its first launch (`module_info`).
    crate::module_info::launched(f as usize);
    Ok(())
}

fn launch_ex(
    cfg: *const CUlaunchConfig,
    f: CUfunction,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
    pt: bool,
) -> Res {
    let c: CUlaunchConfig = read(cfg)?;
    let mut cooperative = false;
    for i in 0..c.numAttrs as usize {
        let a: CUlaunchAttribute = read(c.attrs.wrapping_add(i))?;
        if a.id == CU_LAUNCH_ATTRIBUTE_COOPERATIVE && a.value[0] as u32 != 0 {
            cooperative = true;
        }
    }
    let dims = Dims {
        grid: [c.gridDimX, c.gridDimY, c.gridDimZ],
        block: [c.blockDimX, c.blockDimY, c.blockDimZ],
    };
    launch(f, dims, params, extra, c.hStream, pt, cooperative)
}

export! {
    fn cuLaunchKernel(f: CUfunction, gx: c_uint, gy: c_uint, gz: c_uint, bx: c_uint, by: c_uint, bz: c_uint, _smem: c_uint, s: CUstream, params: *mut *mut c_void, extra: *mut *mut c_void) {
        launch(f, Dims { grid: [gx, gy, gz], block: [bx, by, bz] }, params, extra, s, false, false)
    }
    fn cuLaunchKernel_ptsz(f: CUfunction, gx: c_uint, gy: c_uint, gz: c_uint, bx: c_uint, by: c_uint, bz: c_uint, _smem: c_uint, s: CUstream, params: *mut *mut c_void, extra: *mut *mut c_void) {
        launch(f, Dims { grid: [gx, gy, gz], block: [bx, by, bz] }, params, extra, s, true, false)
    }
    fn cuLaunchCooperativeKernel(f: CUfunction, gx: c_uint, gy: c_uint, gz: c_uint, bx: c_uint, by: c_uint, bz: c_uint, _smem: c_uint, s: CUstream, params: *mut *mut c_void) {
        launch(f, Dims { grid: [gx, gy, gz], block: [bx, by, bz] }, params, std::ptr::null_mut(), s, false, true)
    }
    fn cuLaunchCooperativeKernel_ptsz(f: CUfunction, gx: c_uint, gy: c_uint, gz: c_uint, bx: c_uint, by: c_uint, bz: c_uint, _smem: c_uint, s: CUstream, params: *mut *mut c_void) {
        launch(f, Dims { grid: [gx, gy, gz], block: [bx, by, bz] }, params, std::ptr::null_mut(), s, true, true)
    }
    fn cuLaunchKernelEx(cfg: *const CUlaunchConfig, f: CUfunction, params: *mut *mut c_void, extra: *mut *mut c_void) {
        launch_ex(cfg, f, params, extra, false)
    }
    fn cuLaunchKernelEx_ptsz(cfg: *const CUlaunchConfig, f: CUfunction, params: *mut *mut c_void, extra: *mut *mut c_void) {
        launch_ex(cfg, f, params, extra, true)
    }
}
