//! Chapters of the driver API checked from C (`tests/c/CHAPTER.c`, linked against the simulated
//! libcuda): each program checks every call's result and documented error codes (CUDA 13.5
//! `cuda.h`), prints one line per failed check and `OK` when none failed.
mod common;

use std::path::Path;
use std::process::Command;

/// Builds `tests/c/NAME.c` against the simulated libcuda and runs it on `preset`; it must exit 0
/// and print `OK`. The program and its state file are removed whether it passes or not.
fn chapter(name: &str, preset: &str) {
    chapter_env(name, preset, &[]);
}

/// As [`chapter`], with `env` set for the program.
fn chapter_env(name: &str, preset: &str, env: &[(&str, &str)]) {
    // Runs of one program differ by preset and environment: each has its own files.
    let tag: String = env.iter().map(|(_, v)| format!("-{v}")).collect();
    let dir = common::sim_dir();
    let src = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/c")
        .join(format!("{name}.c"));
    let exe = std::env::temp_dir().join(format!(
        "cuvisor-c-{name}-{preset}{tag}-{}",
        std::process::id()
    ));
    let status = Command::new("cc")
        .args(["-O1", "-Wall", "-Werror", "-o"])
        .arg(&exe)
        .arg(&src)
        .args(["-L", dir.to_str().unwrap(), "-lcuda", "-lpthread"])
        .status()
        .expect("run cc");
    assert!(status.success(), "compiling {}", src.display());
    let state = common::state_file(&format!("{name}-{preset}{tag}"));
    let mut cmd = Command::new(&exe);
    common::sim_env(&mut cmd, preset, &state);
    cmd.envs(env.iter().copied());
    let out = cmd.output().expect("run the program");
    let _ = std::fs::remove_file(&exe);
    let _ = std::fs::remove_file(&state);
    let (so, se) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(
        out.status.success() && so.lines().any(|l| l == "OK"),
        "{name} on {preset}: {}\n--- stdout\n{so}\n--- stderr\n{se}",
        out.status
    );
}

#[test]
fn tensor_maps_encode_what_cuda_h_allows_and_refuse_each_documented_violation() {
    chapter("tensor_map", "single");
}

#[test]
fn contexts_primary_created_stack_limits_cache_and_whole_context_events() {
    chapter("context", "single");
}

#[test]
fn peer_access_over_nvswitch() {
    chapter("peer", "dgx-a100");
}

#[test]
fn peer_access_over_pcie_stops_at_the_host_bridge() {
    chapter("peer", "pcie-8");
}

#[test]
fn pointer_attributes_on_every_kind_of_memory_and_page_locked_host_memory() {
    chapter("pointers", "single");
}

#[test]
fn modules_and_libraries_count_enumerate_and_name_their_kernels_lazily_loaded() {
    chapter_env("modules", "single", &[("CUDA_MODULE_LOADING", "LAZY")]);
}

#[test]
fn modules_under_eager_loading() {
    chapter_env("modules", "single", &[("CUDA_MODULE_LOADING", "EAGER")]);
}
