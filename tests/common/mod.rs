//! Shared by the end-to-end tests: the simulator (built on demand), libcuvisor.so, and running
//! client code under LD_PRELOAD in child processes on its own simulator state and ledger.
#![allow(dead_code)]

#[path = "../../crates/sim/tests/common/mod.rs"]
mod sim;
#[allow(unused_imports)]
pub use sim::{is_child, sim_dir, sim_env, state_file, Child, Ran};

use std::path::{Path, PathBuf};
use std::process::Command;

pub const MIB: u64 = 1 << 20;
pub const GIB: u64 = 1 << 30;

/// target/<profile>/deps/libcuvisor.so, built first if needed (`cargo test` builds it as this
/// package's library; `cargo bench` and `cargo test --test X` may not); or the library
/// CUVISOR_TEST_LIBRARY names, e.g. the shipped one built for glibc 2.17
/// (`CUVISOR_TEST_LIBRARY=target/shipped/libcuvisor.so cargo test --test interception`, as
/// .ci/run does).
pub fn libcuvisor() -> PathBuf {
    if let Some(given) = std::env::var_os("CUVISOR_TEST_LIBRARY").filter(|v| !v.is_empty()) {
        let p = std::path::absolute(Path::new(env!("CARGO_MANIFEST_DIR")).join(given))
            .expect("CUVISOR_TEST_LIBRARY as an absolute path");
        assert!(
            p.is_file(),
            "CUVISOR_TEST_LIBRARY={}: no such file",
            p.display()
        );
        return p;
    }
    cuvisor_testkit::built(&cuvisor_testkit::profile_dir_of_test()).join("deps/libcuvisor.so")
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
        // Compute shares are on by default: a coordinator of this container's own, so tests on
        // other simulator states (same GPU UUIDs) never share a GPU's time with it. Tests of
        // compute set a common one after this.
        .env("CUVISOR_COORD_DIR", ledger.join("coord"))
        .env_remove("CUVISOR_CONFIG")
        .env_remove("CUVISOR_MEMORY_LIMIT");
    if let Some(l) = limit {
        cmd.env("CUVISOR_MEMORY_LIMIT", l);
    }
}

/// Compiles tests/c/NAME.c (plus extra args, e.g. link flags) into a temp executable.
pub fn compile_c(name: &str, extra: &[&str]) -> PathBuf {
    compile_c_variant(name, "", extra)
}

/// As [`compile_c`], for one of several builds of the same source (`variant` names the output,
/// so builds with different flags do not overwrite each other).
pub fn compile_c_variant(name: &str, variant: &str, extra: &[&str]) -> PathBuf {
    let out = std::env::temp_dir().join(format!(
        "cuvisor-e2e-{name}{variant}-{}",
        std::process::id()
    ));
    cc(name, &out, extra);
    out
}

/// Compiles tests/c/NAME.c into a shared library `lib<NAME>-<pid>.so` in the temp directory.
pub fn compile_c_shared(name: &str, extra: &[&str]) -> PathBuf {
    let out = std::env::temp_dir().join(format!("lib{name}-{}.so", std::process::id()));
    let mut args = vec!["-shared", "-fPIC"];
    args.extend_from_slice(extra);
    cc(name, &out, &args);
    out
}

fn cc(name: &str, out: &Path, extra: &[&str]) {
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/c")
        .join(format!("{name}.c"));
    let status = Command::new("cc")
        .args(["-O1", "-Wall", "-Werror", "-o"])
        .arg(out)
        .arg(&src)
        .args(extra)
        .status()
        .expect("cc");
    assert!(status.success(), "compiling {}", src.display());
}

/// What `used` the container ledger in `dir` shows, per device entry in use.
pub fn ledger_used(dir: &Path) -> Vec<u64> {
    let ledger =
        cuvisor_shm::ledger::Ledger::open(&dir.join(cuvisor_shm::ledger::FILE_NAME), false)
            .expect("open the ledger");
    ledger.devices().map(|(_, _, e)| e.used_bytes()).collect()
}

/// A driver entry point's result (CUresult), for code that calls the driver through pointers.
pub type R = u32;
/// cuLaunchKernel's C signature.
pub type Launch = extern "C" fn(
    *mut std::ffi::c_void,
    u32,
    u32,
    u32,
    u32,
    u32,
    u32,
    u32,
    *mut std::ffi::c_void,
    *mut *mut std::ffi::c_void,
    *mut *mut std::ffi::c_void,
) -> R;

/// A driver export looked up in the global scope (libcuvisor's wrapper when it is preloaded);
/// `T` must be its function-pointer type.
pub fn global_sym<T>(name: &std::ffi::CStr) -> T {
    // SAFETY: dlsym with a NUL-terminated name; the caller names T as the export's C type.
    unsafe {
        let p = libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr());
        assert!(!p.is_null(), "{name:?} not found");
        std::mem::transmute_copy(&p)
    }
}

/// A machine file: the `single` preset's GPU (an A100 PCIe of 16 GiB, 108 SMs) whose contexts take
/// no device memory. For the tests that hold what libcuvisor reports, or the simulator's physical
/// use, to a quota: libcuvisor does not count a context's own memory against the quota yet (the
/// issue "Today's stacks held to their quotas"), so on a GPU whose contexts take memory, as the
/// presets' do, those numbers would be off by each process's context, which is not what these
/// tests are about. Written once per test process, into the profile directory (the same bytes
/// each time, renamed into place).
pub fn single_without_context_memory() -> String {
    static PATH: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    PATH.get_or_init(|| {
        let dir = cuvisor_testkit::profile_dir_of_test();
        let p = dir.join("single-no-context-memory.toml");
        let tmp = dir.join(format!(
            "single-no-context-memory.toml.{}",
            std::process::id()
        ));
        std::fs::write(
            &tmp,
            "name = \"single-no-context-memory\"\n\
             [[device]]\n\
             name = \"NVIDIA A100-PCIE-16GB (simulated)\"\n\
             memory = \"16Gi\"\n\
             sm_count = 108\n\
             compute_capability = \"8.0\"\n\
             context_memory = 0\n",
        )
        .expect("write the machine file");
        std::fs::rename(&tmp, &p).expect("rename the machine file into place");
        p
    })
    .to_str()
    .unwrap()
    .to_string()
}
