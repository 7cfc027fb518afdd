//! C programs on the simulator: one resolving entry points the way libcudart 12 does, one
//! linked directly against libcuda, one checking the memory contexts take (in the driver and in
//! NVML).
mod common;

use std::path::PathBuf;
use std::process::Command;

/// Compiles tests/c/NAME.c with the system C compiler (extra link flags after the source).
fn compile(name: &str, link: &[&str]) -> PathBuf {
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/c")
        .join(format!("{name}.c"));
    let out = std::env::temp_dir().join(format!("cuvisor-c-{name}-{}", std::process::id()));
    let status = Command::new("cc")
        .arg("-O1")
        .arg("-Wall")
        .arg("-o")
        .arg(&out)
        .arg(&src)
        .args(link)
        .status()
        .expect("run cc");
    assert!(status.success(), "compiling {}", src.display());
    out
}

#[test]
fn libcudart_style_resolution_through_cu_get_proc_address_v2() {
    let exe = compile("cudart_style", &["-ldl"]);
    let mut cmd = Command::new(&exe);
    common::sim_env(&mut cmd, "single", &common::state_file("cudart"));
    let out = cmd.output().unwrap();
    let (so, se) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(
        out.status.success() && so.contains("OK"),
        "stdout: {so}\nstderr: {se}"
    );
}

#[test]
fn a_directly_linked_program_fills_exactly_the_device() {
    let dir = common::sim_dir();
    let exe = compile("direct_link", &["-L", dir.to_str().unwrap(), "-lcuda"]);
    let mut cmd = Command::new(&exe);
    common::sim_env(&mut cmd, "single", &common::state_file("direct"));
    let out = cmd.output().unwrap();
    let so = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{so}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // 16 GiB device, nothing else on it but the program's context (its `context_memory`): as
    // many allocations of 1 GiB as fit beside the context, then out of memory, with what is
    // left over free.
    let gpu = &cuvisor_sim::model::preset("single").unwrap().devices[0];
    let (total, context) = (gpu.memory, gpu.context_memory);
    assert!(context > 0, "the preset's context takes memory");
    let n = (total - context) >> 30;
    let free = total - context - (n << 30);
    assert!(
        so.starts_with(&format!(
            "allocated {n} GiB, stopped with 2, free {free} of {total}"
        )),
        "{so}"
    );
}

/// Contexts take device memory, as cuMemGetInfo and NVML show (tests/c/context_memory.c, linked
/// against both simulated libraries), on each preset's GPU.
#[test]
fn contexts_take_their_memory_in_the_driver_and_in_nvml() {
    let dir = common::sim_dir();
    let d = dir.to_str().unwrap();
    let exe = compile("context_memory", &["-L", d, "-lcuda", "-lnvidia-ml"]);
    for preset in cuvisor_sim::model::PRESETS {
        let gpu = &cuvisor_sim::model::preset(preset).unwrap().devices[0];
        assert!(gpu.context_memory > 0, "{preset}: its contexts take memory");
        let mut cmd = Command::new(&exe);
        cmd.arg(gpu.context_memory.to_string());
        let state = common::state_file("ctxmem");
        common::sim_env(&mut cmd, preset, &state);
        let out = cmd.output().unwrap();
        let _ = std::fs::remove_file(&state);
        let (so, se) = (
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
        );
        assert!(
            out.status.success() && so.contains("OK"),
            "{preset}: stdout: {so}\nstderr: {se}"
        );
    }
}
