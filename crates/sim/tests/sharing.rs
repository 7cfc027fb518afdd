//! Memory shared between processes and managed memory, driven by a C client built against
//! CUDA 13.5's own `cuda.h` (from the nvcc wheel the nvcc tests install into
//! `target/ci-tools/`) and linked with `-lcuda`: see tests/c/sharing.c for what it checks.
//! Where the wheel cannot be had, the test prints a SKIPPED line, or fails when `CI` is set.
mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

/// CUDA 13.5's include directory (cuda.h), or None after a SKIPPED line.
fn cuda_include(test: &str) -> Option<PathBuf> {
    let inc = cuvisor_testkit::wheels::nvcc_13_5(test)?.join("include");
    Some(inc)
}

#[test]
fn pools_vmm_and_ipc_shared_across_processes_and_managed_memory() {
    let test = "pools_vmm_and_ipc_shared_across_processes_and_managed_memory";
    let Some(inc) = cuda_include(test) else {
        return;
    };
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/c/sharing.c");
    let exe = std::env::temp_dir().join(format!("cuvisor-c-sharing-{}", std::process::id()));
    let dir = common::sim_dir();
    let status = Command::new("cc")
        .args(["-O1", "-Wall", "-Werror", "-o"])
        .arg(&exe)
        .arg("-I")
        .arg(&inc)
        .arg(&src)
        .arg("-L")
        .arg(&dir)
        .args(["-lcuda", "-ldl"])
        .status()
        .expect("run cc");
    assert!(status.success(), "compiling {}", src.display());
    // Three GPUs at least (pool access names devices 1 and 2).
    let state = common::state_file("sharing");
    let mut cmd = Command::new(&exe);
    common::sim_env(&mut cmd, "pcie-8", &state);
    let out = cmd.output().expect("run the sharing client");
    let _ = std::fs::remove_file(&exe);
    let _ = std::fs::remove_file(&state);
    let (so, se) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(
        out.status.success() && so.trim_end().ends_with("OK"),
        "status {}\nstdout: {so}\nstderr: {se}",
        out.status
    );
}
