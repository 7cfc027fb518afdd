//! PyTorch 2.15 (the default PyPI build, CUDA 13.2), unmodified, on the simulator: its first
//! `torch.empty(..., device="cuda")`, plain and under `cuvisor run --memory 6Gi`
//! (torch215/first_alloc.py). It used to raise "CUDA error: named symbol not found": PyTorch
//! 2.15's allocator resolves driver entry points through cuGetProcAddress when it starts and
//! fails at the first one missing (docs/simulator.md, "PyTorch 2.15").
//!
//! Not part of CI: the venv is over 3 GB, so the tests are `#[ignore]`d, and the harness says so.
//! `scripts/frameworks.sh --set newest` installs `target/ci-tools/torch-2.15.0-cu132`; then
//! `cargo test -p cuvisor-sim --test torch215 -- --ignored` runs them (without the venv they print
//! a loud SKIPPED line).
mod common;
#[path = "common/python.rs"]
mod python;

use cuvisor_sim::model::Model;
use python::u;
use serde_json::Value;
use std::ffi::OsStr;
use std::path::PathBuf;

const MIB: u64 = 1 << 20;

fn venv(test: &str) -> Option<PathBuf> {
    let venv = cuvisor_testkit::profile_dir_of_test()
        .parent()
        .expect("target/")
        .join("ci-tools/torch-2.15.0-cu132");
    if venv.join("installed").exists() {
        return Some(venv);
    }
    eprintln!(
        "SKIPPED {test}: PyTorch 2.15 is not installed in {} (3+ GB; \
         scripts/frameworks.sh --set newest installs it)",
        venv.display()
    );
    None
}

fn first_alloc(venv: &std::path::Path, tag: &str, run: &[&str]) -> Value {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/torch215/first_alloc.py");
    python::python_probe(
        venv,
        &[OsStr::new(&script)],
        "single",
        tag,
        &["PYTORCH_CUDA_ALLOC_CONF", "CUDA_VISIBLE_DEVICES"],
        &[],
        run,
    )
}

fn pair(v: &Value, k: &str) -> (u64, u64) {
    (u(&v[k][0]), u(&v[k][1]))
}

/// What both runs see: the first allocation made and given back, a kernel launched. `idle`:
/// the free memory before it (the total less what PyTorch's context and modules take).
fn allocated(v: &Value, total: u64) -> u64 {
    assert_eq!(v["is_available"], true, "{v}");
    assert!(v["version"].as_str().unwrap().starts_with("2.15."), "{v}");
    let (idle, t) = pair(v, "mem_get_info");
    assert_eq!(t, total, "{v}");
    assert_eq!(v["empty"], serde_json::json!([256 * MIB, "cuda"]), "{v}");
    let (after, _) = pair(v, "mem_get_info_after_empty");
    assert!(idle - after >= 256 * MIB, "the tensor is taken: {v}");
    assert!(u(&v["reserved"]) >= 256 * MIB, "{v}");
    let (freed, _) = pair(v, "mem_get_info_after_free");
    assert!(
        freed > after && idle - freed < 256 * MIB,
        "empty_cache gives it back: {v}"
    );
    assert_eq!(v["elementwise"], serde_json::json!([1 << 20]), "{v}");
    idle
}

#[test]
#[ignore = "needs PyTorch 2.15 (3+ GB): scripts/frameworks.sh --set newest, then --ignored"]
fn pytorch_2_15_allocates_on_the_simulator() {
    let test = "pytorch_2_15_allocates_on_the_simulator";
    let Some(venv) = venv(test) else { return };
    let gpu = &Model::load("single").unwrap().devices[0];
    let v = first_alloc(&venv, "torch215-plain", &[]);
    let idle = allocated(&v, gpu.memory);
    // Its context takes its memory before the first allocation (the preset's context_memory).
    assert!(
        gpu.memory - idle >= gpu.context_memory && gpu.context_memory > 0,
        "free {idle} of {} with a context of {}",
        gpu.memory,
        gpu.context_memory
    );
}

#[test]
#[ignore = "needs PyTorch 2.15 (3+ GB): scripts/frameworks.sh --set newest, then --ignored"]
fn pytorch_2_15_allocates_under_cuvisor_run() {
    let test = "pytorch_2_15_allocates_under_cuvisor_run";
    let Some(venv) = venv(test) else { return };
    let v = first_alloc(&venv, "torch215-quota", python::QUOTA);
    allocated(&v, python::QUOTA_BYTES);
}
