//! The workload of a compute tenant on the simulated GPU, shared by tests/timeslice.rs and
//! benches/timeslice.rs (each includes this file and runs it in a child process of its own).

use cudarc::driver::sys as cu;
use cuvisor_sim::state::now_ns;
use std::time::Duration;

// SAFETY (for every `unsafe` block in this file): driver calls with valid out-pointers and live
// handles, as the driver API's contract asks.

fn ok(r: cu::CUresult) {
    assert_eq!(r, cu::CUresult::CUDA_SUCCESS);
}

/// Launches `sim_busy` kernels of KERNEL_NS on one stream, by the path in HOW (plain, coop,
/// graph: four kernels of a quarter each), synchronizing the stream after every STEP_KERNELS
/// launches if given, until SECONDS have passed; with IDLE_AFTER it stops launching then. When
/// it stops it prints "stopped after N launches" (a line the parent may wait for), then sleeps
/// until SECONDS.
pub fn run() {
    let env = |k: &str| std::env::var(k).ok();
    let kernel_ns: u64 = env("KERNEL_NS").unwrap().parse().unwrap();
    let secs: f64 = env("SECONDS").unwrap().parse().unwrap();
    let idle_after: f64 = env("IDLE_AFTER").map_or(secs, |s| s.parse().unwrap());
    let how = env("HOW").unwrap_or_else(|| "plain".into());
    // Synchronize the stream after every this many launches (0: never).
    let step: u64 = env("STEP_KERNELS").map_or(0, |s| s.parse().unwrap());
    let (mut ctx, mut m, mut f, mut s) = (
        std::ptr::null_mut(),
        std::ptr::null_mut(),
        std::ptr::null_mut(),
        std::ptr::null_mut(),
    );
    // SAFETY: see the file-level note.
    unsafe {
        ok(cu::cuInit(0));
        ok(cu::cuDevicePrimaryCtxRetain(&mut ctx, 0));
        ok(cu::cuCtxSetCurrent(ctx));
        ok(cu::cuModuleLoadData(&mut m, c"image".as_ptr() as *const _));
        ok(cu::cuModuleGetFunction(&mut f, m, c"sim_busy".as_ptr()));
        ok(cu::cuStreamCreate(&mut s, 1));
    }
    let mut ns = kernel_ns;
    let mut args = [&mut ns as *mut u64 as *mut std::ffi::c_void];
    let params = args.as_mut_ptr();
    let plain = || {
        // SAFETY: see the file-level note.
        ok(unsafe { cu::cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, s, params, std::ptr::null_mut()) })
    };
    // A graph of four kernels of a quarter each.
    let mut exec = std::ptr::null_mut();
    if how == "graph" {
        let mut quarter = kernel_ns / 4;
        let mut qargs = [&mut quarter as *mut u64 as *mut std::ffi::c_void];
        let mut g = std::ptr::null_mut();
        // SAFETY: see the file-level note.
        unsafe {
            ok(cu::cuStreamBeginCapture_v2(
                s,
                cu::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL,
            ));
            for _ in 0..4 {
                ok(cu::cuLaunchKernel(
                    f,
                    1,
                    1,
                    1,
                    32,
                    1,
                    1,
                    0,
                    s,
                    qargs.as_mut_ptr(),
                    std::ptr::null_mut(),
                ));
            }
            ok(cu::cuStreamEndCapture(s, &mut g));
            ok(cu::cuGraphInstantiateWithFlags(&mut exec, g, 0));
        }
    }
    let t0 = now_ns();
    let mut launches = 0u64;
    while (now_ns() - t0) as f64 / 1e9 < idle_after {
        match how.as_str() {
            "plain" => plain(),
            "coop" => {
                // SAFETY: see the file-level note.
                ok(unsafe { cu::cuLaunchCooperativeKernel(f, 1, 1, 1, 32, 1, 1, 0, s, params) })
            }
            // SAFETY: see the file-level note.
            "graph" => ok(unsafe { cu::cuGraphLaunch(exec, s) }),
            other => panic!("HOW={other}"),
        }
        launches += 1;
        if step > 0 && launches.is_multiple_of(step) {
            // SAFETY: see the file-level note.
            ok(unsafe { cu::cuStreamSynchronize(s) });
        }
    }
    println!("stopped after {launches} launches");
    let rest = secs - (now_ns() - t0) as f64 / 1e9;
    if rest > 0.0 {
        std::thread::sleep(Duration::from_secs_f64(rest));
    }
}
