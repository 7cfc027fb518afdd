//! CuPy, unmodified, on the simulator: the PyPI wheel `cupy-cuda12x` (which carries the CUDA
//! runtime statically linked) with NVRTC from `nvidia-cuda-nvrtc-cu12`, found by CuPy through
//! `cuda-pathfinder` in the venv's site-packages. `cupy/probe.py` runs it as a program would;
//! this checks what it saw, on the plain simulator and under `cuvisor run --memory 6Gi`.
//!
//! The wheels (about 245 MB to download: CuPy 137 MB, NVRTC 90 MB; 616 MB installed) are
//! installed once into `target/ci-tools/`; where they cannot be (no network, no python3), a test
//! prints a loud SKIPPED line, or fails when `CI` is set.
mod common;
#[path = "common/python.rs"]
mod python;

use python::u;

use cuvisor_sim::model::Model;
use serde_json::Value;
use std::path::{Path, PathBuf};

/// The newest releases when this test was written. CuPy's own dependencies are pinned too
/// (numpy < 2.6, cuda-pathfinder 1.x), so the install is the same every time.
const WHEELS: &[(&str, &str)] = &[
    ("cupy-cuda12x", "14.2.0"),
    ("numpy", "2.4.6"),
    ("cuda-pathfinder", "1.9.1"),
    ("nvidia-cuda-nvrtc-cu12", "12.9.86"),
    ("nvidia-cuda-runtime-cu12", "12.9.79"),
];

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

fn venv(test: &str) -> Option<PathBuf> {
    use cuvisor_testkit::wheels::{venv, Deps};
    venv(test, "cupy-cuda12x-14.2.0", WHEELS, Deps::None)
}

/// Runs probe.py on the `single` preset, under `cuvisor run RUN` unless `run` is empty; its
/// answers.
fn probe(venv: &Path, tag: &str, run: &[&str]) -> Value {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/cupy/probe.py");
    // A kernel cache of its own, so that NVRTC compiles every kernel in this run.
    let cache = std::env::temp_dir().join(format!("cuvisor-{tag}-{}.cupy", std::process::id()));
    let _ = std::fs::remove_dir_all(&cache);
    let cache_dir = cache.to_str().unwrap().to_string();
    let v = python::python_probe(
        venv,
        &[script.as_os_str()],
        "single",
        tag,
        &["CUDA_PATH"],
        &[("CUPY_CACHE_DIR", &cache_dir)],
        run,
    );
    let _ = std::fs::remove_dir_all(&cache);
    v
}

fn pair(v: &Value, key: &str) -> (u64, u64) {
    (u(&v[key][0]), u(&v[key][1]))
}

/// What CuPy saw on a GPU whose total is `total`: one device, `idle` of it free (the total less
/// its context's memory, on the plain simulator); 256 MiB through
/// the pool and back to the driver with free_all_blocks; OutOfMemoryError beyond the total and
/// allocations after it; NVRTC-compiled kernels that launch and synchronize, a RawKernel named
/// `sim_busy` (C linkage) and a templated one (C++, by name expression) taking the time their
/// first parameter says, and a module variable to copy into.
fn runs_with_total(v: &Value, total: u64, idle: u64) {
    assert_eq!(u(&v["getDeviceCount"]), 1, "{v}");
    assert_eq!(pair(v, "mem_info"), (idle, total), "{v}");

    let after_alloc = &v["pool_after_alloc"];
    assert_eq!(
        (u(&after_alloc[0]), u(&after_alloc[1])),
        (256 * MIB, 256 * MIB)
    );
    assert_eq!(
        u(&after_alloc[2]),
        idle - 256 * MIB,
        "the driver's free memory"
    );
    assert_eq!(
        pair(v, "pool_after_del"),
        (0, 256 * MIB),
        "the pool keeps it"
    );
    let after = &v["pool_after_free_all_blocks"];
    assert_eq!(
        (u(&after[0]), u(&after[1]), u(&after[2])),
        (0, 0, idle),
        "free_all_blocks gives it back"
    );

    let oom = v["too_large"].as_str().unwrap();
    assert!(oom.starts_with("OutOfMemoryError"), "{oom}");
    assert_eq!(pair(v, "after_oom"), (16 * MIB, 16 * MIB), "and it goes on");

    assert_eq!(v["x_plus_y"], serde_json::json!([1024, "float32"]));
    assert_eq!(u(&v["elementwise_kernel"][0]), 1024);
    let raw = v["raw_kernel_s"].as_f64().unwrap();
    assert!(
        (0.099..1.0).contains(&raw),
        "100 ms of sim_busy took {raw} s"
    );
    let templated = v["raw_module_s"].as_f64().unwrap();
    assert!(
        (0.049..1.0).contains(&templated),
        "50 ms of sim_busy_t<float> took {templated} s"
    );
    assert_eq!(v["get_global"], true);

    // What CuPy keeps at the end is its loaded modules' variables and code: a few KiB.
    let (free, t) = pair(v, "mem_info_at_end");
    assert_eq!(t, total);
    assert!(
        idle - free < MIB,
        "{free} of {total} free at the end, {idle} before"
    );
}

/// The plain simulator: CuPy sees the physical 16 GiB GPU.
#[test]
fn cupy_runs_on_the_simulator() {
    let test = "cupy_runs_on_the_simulator";
    let Some(venv) = venv(test) else {
        return;
    };
    let v = probe(&venv, test, &[]);
    // Free: the GPU less what CuPy's context takes.
    let gpu = &Model::load("single").unwrap().devices[0];
    assert!(gpu.context_memory > 0, "the preset's contexts take memory");
    runs_with_total(&v, gpu.memory, gpu.memory - gpu.context_memory);
}

/// Under `cuvisor run --memory 6Gi` on the 16 GiB GPU: CuPy sees 6 GiB, and a 13 GiB
/// allocation (within the GPU, beyond the quota) is its OutOfMemoryError.
#[test]
fn cupy_under_cuvisor_run_sees_the_quota() {
    let test = "cupy_under_cuvisor_run_sees_the_quota";
    let Some(venv) = venv(test) else {
        return;
    };
    let v = probe(&venv, test, python::QUOTA);
    assert!(Model::load("single").unwrap().devices[0].memory > 2 * python::QUOTA_BYTES + GIB);
    runs_with_total(&v, python::QUOTA_BYTES, python::QUOTA_BYTES);
}
