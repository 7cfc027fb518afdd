//! CUDA graphs and stream capture on the simulator, from two clients:
//! - `c/graphs.c`, a C program built against CUDA 13.5's own `cuda.h` (so every parameter struct
//!   has NVIDIA's layout) and linked with `-lcuda`: every node kind built by hand and launched,
//!   per-node parameters, edges, clones, updates, user objects, the generic node API, capture
//!   producing the same graph as the hand-built one, and the documented error codes;
//! - `cudart/graph.cu`, built by nvcc 13.5: a CUDA graph with a memory-allocation node
//!   (cudaGraphAddMemAllocNode) and a host node, and a captured cudaMallocAsync / cudaFreeAsync
//!   with a host function, run through the runtime.
//!
//! Both need NVIDIA's CUDA 13.5 wheels (headers, nvcc; installed once into `target/ci-tools/`):
//! where they cannot be had, a test prints a loud SKIPPED line, or fails when `CI` is set.
mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

/// `nvidia/cu13` of the nvcc venv (bin/nvcc, include/cuda.h), or None after a SKIPPED line.
fn cu13(test: &str) -> Option<PathBuf> {
    cuvisor_testkit::wheels::nvcc_13_5(test)
}

fn run_on_sim(exe: &Path, tag: &str) {
    let mut cmd = Command::new(exe);
    common::sim_env(&mut cmd, "single", &common::state_file(tag));
    let out = cmd.output().expect("run the program");
    let (so, se) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    let _ = std::fs::remove_file(exe);
    assert!(
        out.status.success() && so.lines().any(|l| l == "OK"),
        "{}: {}\nstdout: {so}\nstderr: {se}",
        exe.display(),
        out.status
    );
}

#[test]
fn graphs_c_builds_launches_updates_and_captures_graphs() {
    let Some(cu13) = cu13("graphs_c_builds_launches_updates_and_captures_graphs") else {
        return;
    };
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/c/graphs.c");
    let exe = std::env::temp_dir().join(format!("cuvisor-c-graphs-{}", std::process::id()));
    let sim = common::sim_dir();
    let status = Command::new("cc")
        .args(["-O1", "-Wall", "-Werror", "-o"])
        .arg(&exe)
        .arg(&src)
        .arg("-I")
        .arg(cu13.join("include"))
        .arg("-L")
        .arg(&sim)
        .args(["-lcuda", "-lpthread"])
        .status()
        .expect("run cc");
    assert!(status.success(), "compiling {}", src.display());
    run_on_sim(&exe, "graphs-c");
}

#[test]
fn an_nvcc_built_graph_with_a_memory_node_and_a_host_node_runs() {
    let Some(cu13) = cu13("an_nvcc_built_graph_with_a_memory_node_and_a_host_node_runs") else {
        return;
    };
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/cudart/graph.cu");
    let exe =
        cuvisor_testkit::profile_dir_of_test().join(format!("cudart-graph-{}", std::process::id()));
    cuvisor_testkit::wheels::nvcc(&cu13, &["-arch=sm_80"], &src, &exe);
    run_on_sim(&exe, "graph-cu");
}
