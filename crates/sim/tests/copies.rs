//! Copies, memsets, arrays, texture and surface objects on the simulator, from C and from the
//! CUDA runtime:
//! - `c/copies.c`, built against CUDA 13.5's `cuda.h` and linked with the simulated libcuda:
//!   every copy shape (2D with pitches and offsets, 3D sub-boxes, 1D and 2D/3D array round trips,
//!   mipmap levels, NV12 planes, batches, peer copies between two GPUs of the `dgx-a100` preset),
//!   2D memsets, texture and surface objects, each checked byte by byte, and the error codes;
//!   plainly and under `cuvisor run`.
//! - `c/copies_v1.c`: the CUDA 2.x ABI of the same (32-bit pointers, `CUDA_MEMCPY2D_v1`).
//! - `cudart/copies.cu`, built by nvcc 13.5: cudaMemcpy2D, cudaMallocArray +
//!   cudaMemcpy2DToArray / FromArray, cudaMemset2D, texture and surface object creation through
//!   the static libcudart, which reaches the driver through cuGetProcAddress.
//!
//! All need the CUDA 13.5 wheels (`cuda.h`, nvcc): where they cannot be installed the tests
//! print SKIPPED, or fail when `CI` is set (see `cuvisor_testkit::wheels::venv`).
mod common;
#[path = "common/python.rs"]
mod python;

use std::path::{Path, PathBuf};
use std::process::Command;

/// `site-packages/nvidia/cu13` of the nvcc venv (bin/nvcc, include/cuda.h), or None after a
/// SKIPPED line.
fn cu13(test: &str) -> Option<PathBuf> {
    cuvisor_testkit::wheels::nvcc_13_5(test)
}

/// Runs `exe` on the simulated `preset`, under `cuvisor run RUN -- exe` unless `run` is empty
/// (see `python::on_sim`): (exit status 0, stdout, stderr).
fn run_on_sim(exe: &Path, preset: &str, tag: &str, run: &[&str]) -> (bool, String, String) {
    let state = common::state_file(tag);
    let mut cmd = python::on_sim(exe, run, preset, &state);
    let out = cmd.output().expect("run the program");
    python::remove_state(&state);
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// tests/c/NAME.c built against CUDA 13.5's cuda.h (`extra` flags first) and the simulated
/// libcuda, into the temp directory.
fn build_c(name: &str, cu13: &Path, extra: &[&str]) -> PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/c/{name}.c"));
    let exe = std::env::temp_dir().join(format!("cuvisor-c-{name}-{}", std::process::id()));
    let built = Command::new("cc")
        .args(["-O1", "-Wall", "-Werror"])
        .args(extra)
        .arg("-I")
        .arg(cu13.join("include"))
        .arg("-o")
        .arg(&exe)
        .arg(&src)
        .arg("-L")
        .arg(common::sim_dir())
        .arg("-lcuda")
        .output()
        .expect("run cc");
    assert!(
        built.status.success(),
        "cc {}: {}",
        src.display(),
        String::from_utf8_lossy(&built.stderr)
    );
    exe
}

/// The number of checks a C client printed on its "OK <checks>" line.
fn checks(out: &str, err: &str) -> u64 {
    out.lines()
        .find_map(|l| l.strip_prefix("OK "))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("no OK line: {out}\n{err}"))
}

#[test]
fn c_client_copies_memsets_arrays_and_objects_byte_for_byte() {
    let test = "c_client_copies_memsets_arrays_and_objects_byte_for_byte";
    let Some(cu13) = cu13(test) else {
        return;
    };
    let exe = build_c("copies", &cu13, &[]);
    // Plainly, then under `cuvisor run --memory 6Gi` (libcuvisor counting the arrays, levels
    // and planes): the same checks hold, and the program's free memory is the same at its end
    // as at its start.
    let plain = run_on_sim(&exe, "dgx-a100", "c-copies", &[]);
    let quota = run_on_sim(&exe, "dgx-a100", "c-copies-quota", &["--memory", "6Gi"]);
    let _ = std::fs::remove_file(&exe);
    for (ok, out, err) in [plain, quota] {
        assert!(ok, "{out}\n{err}");
        // The count of checks is the program's own (a check skipped would be a smaller
        // number); tens of thousands of bytes are compared one by one.
        let n = checks(&out, &err);
        assert!(n > 10_000, "{n} checks: {out}");
    }
}

/// The CUDA 2.x ABI (32-bit pointers and sizes, CUDA_MEMCPY2D_v1/3D_v1 laid out as cuda.h
/// declares them for the driver's own build): 2D, 3D, 1D array and linear copies and memsets.
#[test]
fn c_client_v1_copies_with_32_bit_pointers_and_structs() {
    let test = "c_client_v1_copies_with_32_bit_pointers_and_structs";
    let Some(cu13) = cu13(test) else {
        return;
    };
    let exe = build_c("copies_v1", &cu13, &["-D__CUDA_API_VERSION_INTERNAL"]);
    let (ok, out, err) = run_on_sim(&exe, "single", "c-copies-v1", &[]);
    let _ = std::fs::remove_file(&exe);
    assert!(ok, "{out}\n{err}");
    let n = checks(&out, &err);
    assert!(n > 400, "{n} checks: {out}");
}

#[test]
fn an_nvcc_built_program_copies_2d_into_arrays_and_makes_surface_objects() {
    let test = "an_nvcc_built_program_copies_2d_into_arrays_and_makes_surface_objects";
    let Some(cu13) = cu13(test) else {
        return;
    };
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/cudart/copies.cu");
    let exe = cuvisor_testkit::profile_dir_of_test()
        .join(format!("cudart-copies-{}", std::process::id()));
    cuvisor_testkit::wheels::nvcc(&cu13, &["-arch=sm_80"], &src, &exe);
    let (ok, out, err) = run_on_sim(&exe, "single", "cudart-copies", &[]);
    let _ = std::fs::remove_file(&exe);
    assert!(ok, "{out}\n{err}");
    let done: u64 = out
        .lines()
        .find_map(|l| l.strip_prefix("DONE "))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("no DONE line: {out}\n{err}"));
    // 300 x 20 pitched bytes, 256 x 16 array bytes, 128 x 4 array bytes from device memory.
    assert_eq!(done, 300 * 20 + 256 * 16 + 128 * 4, "{out}");
}
