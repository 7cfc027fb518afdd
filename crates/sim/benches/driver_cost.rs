//! The simulated driver's own cost per call: the baseline that interception overhead is
//! measured against later. Run: `cargo bench -p cuvisor-sim --bench driver_cost`.
//!
//! Loads target/<profile>/sim/libcuda.so.1 with dlopen, as a client would, and times
//! cuLaunchKernel (a 1 ns `sim_busy` kernel, so the timeline stays near the present) and a
//! cuMemAlloc_v2 + cuMemFree_v2 pair of 1 MiB. Prints the best of 5 runs, in ns per call.
#[path = "../tests/common/mod.rs"]
mod common;

use std::ffi::{c_void, CString};
use std::time::Instant;

type R = u32;

fn sym<T>(lib: *mut c_void, name: &str) -> T {
    let c = CString::new(name).unwrap();
    // SAFETY: lib is a live dlopen handle and c a NUL-terminated name.
    let p = unsafe { libc::dlsym(lib, c.as_ptr()) };
    assert!(!p.is_null(), "libcuda.so.1 lacks {name}");
    assert_eq!(std::mem::size_of::<T>(), std::mem::size_of::<*mut c_void>());
    // SAFETY: T is the function-pointer type of this entry point (same size as a pointer).
    unsafe { std::mem::transmute_copy(&p) }
}

fn best_of<F: FnMut()>(runs: usize, iters: u64, mut f: F) -> f64 {
    (0..runs)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..iters {
                f();
            }
            t.elapsed().as_nanos() as f64 / iters as f64
        })
        .fold(f64::INFINITY, f64::min)
}

fn main() {
    let dir = common::sim_dir();
    let state = common::state_file("bench");
    std::env::set_var("CUVISOR_SIM", "single");
    std::env::set_var("CUVISOR_SIM_STATE", &state);
    let path = CString::new(dir.join("libcuda.so.1").to_str().unwrap()).unwrap();
    // SAFETY: loading the simulated driver by path.
    let lib = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    assert!(!lib.is_null(), "dlopen {}", path.to_str().unwrap());

    let cu_init: extern "C" fn(u32) -> R = sym(lib, "cuInit");
    let retain: extern "C" fn(*mut *mut c_void, i32) -> R = sym(lib, "cuDevicePrimaryCtxRetain");
    let set_current: extern "C" fn(*mut c_void) -> R = sym(lib, "cuCtxSetCurrent");
    let load: extern "C" fn(*mut *mut c_void, *const c_void) -> R = sym(lib, "cuModuleLoadData");
    let get_fn: extern "C" fn(*mut *mut c_void, *mut c_void, *const i8) -> R =
        sym(lib, "cuModuleGetFunction");
    type Launch = extern "C" fn(
        *mut c_void,
        u32,
        u32,
        u32,
        u32,
        u32,
        u32,
        u32,
        *mut c_void,
        *mut *mut c_void,
        *mut *mut c_void,
    ) -> R;
    let launch: Launch = sym(lib, "cuLaunchKernel");
    let sync: extern "C" fn(*mut c_void) -> R = sym(lib, "cuStreamSynchronize");
    let alloc: extern "C" fn(*mut u64, usize) -> R = sym(lib, "cuMemAlloc_v2");
    let free: extern "C" fn(u64) -> R = sym(lib, "cuMemFree_v2");

    let mut ctx = std::ptr::null_mut();
    let (mut module, mut func) = (std::ptr::null_mut(), std::ptr::null_mut());
    assert_eq!(cu_init(0), 0);
    assert_eq!(retain(&mut ctx, 0), 0);
    assert_eq!(set_current(ctx), 0);
    assert_eq!(load(&mut module, c"image".as_ptr() as *const c_void), 0);
    assert_eq!(get_fn(&mut func, module, c"sim_busy".as_ptr()), 0);

    let mut ns: u64 = 1;
    let mut args = [&mut ns as *mut u64 as *mut c_void];
    let iters = 200_000;
    let launch_ns = best_of(5, iters, || {
        let r = launch(
            func,
            1,
            1,
            1,
            32,
            1,
            1,
            0,
            std::ptr::null_mut(),
            args.as_mut_ptr(),
            std::ptr::null_mut(),
        );
        debug_assert_eq!(r, 0);
    });
    assert_eq!(sync(std::ptr::null_mut()), 0);
    let pair_ns = best_of(5, iters, || {
        let mut p = 0u64;
        let r = alloc(&mut p, 1 << 20);
        debug_assert_eq!(r, 0);
        free(p);
    });
    println!("simulated driver cost (best of 5 x {iters} calls, this machine):");
    println!("  cuLaunchKernel              {launch_ns:>8.1} ns/call");
    println!("  cuMemAlloc_v2 + cuMemFree_v2 {pair_ns:>7.1} ns/pair (1 MiB)");
    let _ = std::fs::remove_file(state);
}
