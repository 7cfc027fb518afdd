//! Shared by the end-to-end tests: the simulator (built on demand), libcuvisor.so, and running
//! client code under LD_PRELOAD in child processes on its own simulator state and ledger.
#![allow(dead_code)]

#[path = "../../crates/sim/tests/common/mod.rs"]
mod sim;
pub use sim::{is_child, sim_dir, sim_env, state_file, Child, Ran};

use std::path::{Path, PathBuf};
use std::process::Command;

pub const MIB: u64 = 1 << 20;
pub const GIB: u64 = 1 << 30;

/// target/<profile>/deps/libcuvisor.so (cargo test builds it: it is this package's library).
pub fn libcuvisor() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap();
    let lib = deps.join("libcuvisor.so");
    assert!(lib.exists(), "{} missing", lib.display());
    lib
}

/// A fresh, empty directory for one test's ledger.
pub fn ledger_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("cuvisor-e2e-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Environment for a process under cuvisor with `limit` (None: no limit configured).
pub fn cuvisor_env(cmd: &mut Command, ledger: &Path, limit: Option<&str>) {
    cmd.env("LD_PRELOAD", libcuvisor())
        .env("CUVISOR_STATE_DIR", ledger)
        .env_remove("CUVISOR_CONFIG")
        .env_remove("CUVISOR_MEMORY_LIMIT");
    if let Some(l) = limit {
        cmd.env("CUVISOR_MEMORY_LIMIT", l);
    }
}

/// Compiles tests/c/NAME.c (plus extra args, e.g. link flags) into a temp executable.
pub fn compile_c(name: &str, extra: &[&str]) -> PathBuf {
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/c")
        .join(format!("{name}.c"));
    let out = std::env::temp_dir().join(format!("cuvisor-e2e-{name}-{}", std::process::id()));
    let status = Command::new("cc")
        .args(["-O1", "-Wall", "-o"])
        .arg(&out)
        .arg(&src)
        .args(extra)
        .status()
        .expect("cc");
    assert!(status.success(), "compiling {}", src.display());
    out
}
