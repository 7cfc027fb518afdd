//! Chapters of the driver API checked from C (`tests/c/CHAPTER.c`, linked against the simulated
//! libcuda): each program checks every call's result and documented error codes (CUDA 13.5
//! `cuda.h`), prints one line per failed check and `OK` when none failed.
mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

/// Builds `tests/c/NAME.c` against the simulated libcuda and runs it on `preset`; it must exit 0
/// and print `OK`. The program and its state file are removed whether it passes or not.
fn chapter(name: &str, preset: &str) {
    chapter_env(name, preset, &[]);
}

/// As [`chapter`], with `env` set for the program.
fn chapter_env(name: &str, preset: &str, env: &[(&str, &str)]) {
    chapter_run(name, preset, env, &[]);
}

/// As [`chapter_env`], with arguments for the program.
fn chapter_run(name: &str, preset: &str, env: &[(&str, &str)], args: &[&str]) {
    // Runs of one program differ by preset, environment and arguments: each has its own files.
    let tag: String = env
        .iter()
        .map(|(_, v)| *v)
        .chain(args.first().copied())
        .map(|v| format!("-{v}"))
        .collect();
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
    cmd.args(args);
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
fn peer_access_over_the_h200s_nvswitches() {
    chapter("peer", "h200");
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

/// nvcc and what it needs (the versions cudart_nvcc.rs installs, so the venv is shared).
/// `cudart/module_kernels.cu` built by nvcc 13.5 with `flags` into `out_name` in the profile
/// directory; None (after a SKIPPED line, or a failure under CI) where the wheels cannot be had.
fn nvcc_image(test: &str, flags: &[&str], out_name: &str) -> Option<PathBuf> {
    let cu13 = cuvisor_testkit::wheels::nvcc_13_5(test)?;
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/cudart/module_kernels.cu");
    let out =
        cuvisor_testkit::profile_dir_of_test().join(format!("{out_name}-{}", std::process::id()));
    cuvisor_testkit::wheels::nvcc(&cu13, flags, &src, &out);
    Some(out)
}

/// The kernels of module_kernels.cu, as the image names them.
const NVCC_KERNELS: &[&str] = &["k_alpha", "_Z6k_betaPii", "_Z7k_gammaIdEvPT_"];

/// An nvcc-built image of each kind, loaded as a module and a library and linked, counts and
/// names exactly its kernels (`c/modules.c`'s image mode). The image is removed whether the
/// check passes or not.
#[test]
fn nvcc_built_cubin_fatbin_and_ptx_count_enumerate_and_link() {
    let test = "nvcc_built_cubin_fatbin_and_ptx_count_enumerate_and_link";
    let kinds: [(&str, &[&str], &str); 3] = [
        ("0", &["-cubin", "-arch=sm_80"], "module-kernels.cubin"),
        (
            "2",
            &[
                "-fatbin",
                "-gencode=arch=compute_80,code=sm_80",
                "-gencode=arch=compute_86,code=sm_86",
                "-gencode=arch=compute_80,code=compute_80",
            ],
            "module-kernels.fatbin",
        ),
        ("1", &["-ptx", "-arch=sm_80"], "module-kernels.ptx"),
    ];
    for (ty, flags, out) in kinds {
        let Some(image) = nvcc_image(test, flags, out) else {
            return;
        };
        let mut args = vec![ty, image.to_str().unwrap()];
        args.extend_from_slice(NVCC_KERNELS);
        let ran = std::panic::catch_unwind(|| chapter_run("modules", "single", &[], &args));
        let _ = std::fs::remove_file(&image);
        if let Err(e) = ran {
            std::panic::resume_unwind(e);
        }
    }
}

/// Error log management: callbacks register and unregister, the empty log's iterator and dumps,
/// and the codes cuda.h 13.5 documents (`tests/c/logs.c`).
#[test]
fn error_logs_register_callbacks_iterate_and_dump_an_empty_log() {
    chapter("logs", "single");
}
