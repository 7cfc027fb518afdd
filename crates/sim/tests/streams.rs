//! The stream and event chapters on the simulator: `c/streams.c` linked against libcuda (stream
//! order with callbacks and host functions, events, IPC events between two processes, memory
//! operations, stream attributes, the profiler) and `cudart/callbacks.cu`, built by nvcc 13.5,
//! for the same order through the CUDA runtime (cudaStreamAddCallback, cudaLaunchHostFunc).
//!
//! Where nvcc's wheels cannot be installed, the nvcc test prints a loud SKIPPED line, or fails
//! when `CI` is set (see cudart_nvcc.rs); a failing nvcc always fails it.
mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

/// Runs a checking program, then removes `scratch`; it must have exited 0 and printed `OK`.
fn passed(cmd: &mut Command, scratch: &[&Path]) {
    let out = cmd.output().expect("run the program");
    for p in scratch {
        let _ = std::fs::remove_file(p);
    }
    let (so, se) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(
        out.status.success() && so.lines().any(|l| l == "OK"),
        "{cmd:?}: {}\n--- stdout\n{so}\n--- stderr\n{se}",
        out.status
    );
}

#[test]
fn the_stream_and_event_chapters_from_c() {
    let dir = common::sim_dir();
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/c/streams.c");
    let exe = std::env::temp_dir().join(format!("cuvisor-c-streams-{}", std::process::id()));
    let status = Command::new("cc")
        .args(["-O1", "-Wall", "-o"])
        .arg(&exe)
        .arg(&src)
        .args(["-L", dir.to_str().unwrap(), "-lcuda", "-lpthread"])
        .status()
        .expect("run cc");
    assert!(status.success(), "compiling {}", src.display());
    let state = common::state_file("streams");
    let mut cmd = Command::new(&exe);
    common::sim_env(&mut cmd, "single", &state);
    passed(&mut cmd, &[&exe, &state]);
}

/// nvcc and what it needs (the versions cudart_nvcc.rs installs, so the venv is shared).
/// `cudart/NAME.cu` built for the simulated A100 (sm_80); None (after a SKIPPED line) where the
/// wheels cannot be had.
fn nvcc_built(test: &str, name: &str) -> Option<PathBuf> {
    let cu13 = cuvisor_testkit::wheels::nvcc_13_5(test)?;
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/cudart/{name}.cu"));
    let out = cuvisor_testkit::profile_dir_of_test()
        .join(format!("cudart-{name}-{}", std::process::id()));
    cuvisor_testkit::wheels::nvcc(&cu13, &["-arch=sm_80"], &src, &out);
    Some(out)
}

#[test]
fn stream_callbacks_and_host_functions_through_the_cuda_runtime() {
    let test = "stream_callbacks_and_host_functions_through_the_cuda_runtime";
    let Some(exe) = nvcc_built(test, "callbacks") else {
        return;
    };
    let state = common::state_file("callbacks");
    let mut cmd = Command::new(&exe);
    common::sim_env(&mut cmd, "single", &state);
    passed(&mut cmd, &[&exe, &state]);
}
