//! Build script shared by the two simulated libraries.
//!
//! Cargo names a cdylib after its crate (`libcuvisor_sim_cuda.so`), but clients look for the
//! driver by its real names. This script gives the library the real SONAME and puts links with
//! the real file names in `target/<profile>/sim/`, pointing at the library Cargo is about to
//! write. So after a plain `cargo build`:
//!
//! ```text
//! target/debug/sim/libcuda.so.1       -> ../deps/libcuvisor_sim_cuda.so
//! target/debug/sim/libcuda.so         -> ../deps/libcuvisor_sim_cuda.so
//! target/debug/sim/libnvidia-ml.so.1  -> ../deps/libcuvisor_sim_nvml.so
//! target/debug/sim/libnvidia-ml.so    -> ../deps/libcuvisor_sim_nvml.so
//! ```
//!
//! and `LD_LIBRARY_PATH=target/debug/sim` makes any program load the simulator. The links point
//! into `deps/`, where Cargo always writes a cdylib (it copies it up to `target/debug/` only when
//! the package itself was asked for, not when it is built as another package's dependency, as
//! for `cargo run --bin cuvisor`).
use std::path::PathBuf;

fn main() {
    let pkg = std::env::var("CARGO_PKG_NAME").unwrap();
    let (soname, names, artifact): (&str, &[&str], &str) = match pkg.as_str() {
        "cuvisor-sim-cuda" => (
            "libcuda.so.1",
            &["libcuda.so.1", "libcuda.so"],
            "libcuvisor_sim_cuda.so",
        ),
        "cuvisor-sim-nvml" => (
            "libnvidia-ml.so.1",
            &["libnvidia-ml.so.1", "libnvidia-ml.so"],
            "libcuvisor_sim_nvml.so",
        ),
        other => panic!("install_names.rs used by unexpected package {other}"),
    };
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,{soname}");
    // OUT_DIR = target/<profile>/build/<pkg>-<hash>/out: the profile directory is three up.
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap());
    let profile_dir = out
        .ancestors()
        .nth(3)
        .expect("OUT_DIR layout")
        .to_path_buf();
    let sim_dir = profile_dir.join("sim");
    std::fs::create_dir_all(&sim_dir).expect("create target/<profile>/sim");
    for name in names {
        let link = sim_dir.join(name);
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(format!("../deps/{artifact}"), &link).expect("symlink");
    }
    // Not watching the links themselves: they resolve to the artifact, which is always newer than
    // this script's run, so Cargo would rebuild every time. If target/<profile>/sim is deleted by
    // hand, `cargo clean -p cuvisor-sim-cuda -p cuvisor-sim-nvml` brings it back.
    println!("cargo:rerun-if-changed=../install_names.rs");
}
