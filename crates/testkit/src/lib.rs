//! Support shared by the end-to-end tests and benchmarks of every package: they run real
//! processes that load `libcuvisor.so` and the simulated `libcuda.so.1`/`libnvidia-ml.so.1`,
//! which `cargo test -p <one package>` does not build by itself; and [`container`], which runs
//! them as OCI containers.

pub mod container;
pub mod wheels;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// target/<profile>/ for a test or bench binary (it lives in target/<profile>/deps/).
pub fn profile_dir_of_test() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    exe.parent()
        .and_then(Path::parent)
        .expect("target/<profile>/deps/<test>")
        .to_path_buf()
}

/// Builds libcuvisor.so, the cuvisor CLI and the simulated libraries into `profile_dir` (a
/// no-op when they are current; Cargo's build lock is free while tests run) and returns
/// `profile_dir`. Once per process. Afterwards `deps/libcuvisor.so`, `cuvisor` and
/// `sim/libcuda.so.1`, `sim/libnvidia-ml.so.1` exist there.
pub fn built(profile_dir: &Path) -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let profile = match profile_dir.file_name().and_then(|n| n.to_str()) {
            Some("debug") | None => "dev".to_string(),
            Some(p) => p.to_string(),
        };
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        let status = Command::new(cargo)
            .args([
                "build",
                "-q",
                "-p",
                "cuvisor",
                "-p",
                "cuvisor-cli",
                "-p",
                "cuvisor-sim-cuda",
                "-p",
                "cuvisor-sim-nvml",
            ])
            .args(["--profile", &profile])
            .env(
                "CARGO_TARGET_DIR",
                profile_dir.parent().expect("target/<profile>"),
            )
            .status()
            .expect("run cargo build for libcuvisor.so, cuvisor and the simulator");
        assert!(
            status.success(),
            "building libcuvisor.so, cuvisor and the simulated libraries failed"
        );
        for lib in [
            "deps/libcuvisor.so",
            "cuvisor",
            "sim/libcuda.so.1",
            "sim/libnvidia-ml.so.1",
        ] {
            let p = profile_dir.join(lib);
            assert!(p.exists(), "{} is missing", p.display());
        }
        profile_dir.to_path_buf()
    })
}

/// Compiles the C program `src` (with `-O1 -Wall -Werror -ldl`) to `<dir>/<name>-<pid>` and
/// returns its path: per pid, since other test runs may share the target directory. Call it once
/// per test binary (behind a `OnceLock`).
pub fn compile_c(src: &Path, dir: &Path, name: &str) -> PathBuf {
    let out = dir.join(format!("{name}-{}", std::process::id()));
    let status = Command::new("cc")
        .args(["-O1", "-Wall", "-Werror", "-o"])
        .arg(&out)
        .arg(src)
        .arg("-ldl")
        .status()
        .expect("run cc");
    assert!(status.success(), "compiling {}", src.display());
    out
}

/// `$TMPDIR/cuvisor-<name>-<pid>`, emptied and created: a scratch directory of this test
/// process's own.
pub fn fresh_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("cuvisor-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("create a scratch directory");
    d
}

/// How far a tenant's measured fraction of the GPU may be from its due in a test: 5 percentage
/// points. The compute issues' bar, +/- 2 pp, is the benchmark's (`cargo bench --bench
/// timeslice` reports every row against it over 5 s windows): a 2 s window in a test on a loaded
/// 2-core CI machine misses it by a fraction of a point when a tenant's own process waits for a
/// CPU (seen: 27.79 % for limit=30 in a fresh-clone CI run). 5 pp still fails a limiter that does
/// not hold (no cap: 50/50 where 30/70 is due) or a share rule that is wrong (1:3 as 1:1).
pub const SHARE_TOLERANCE: f64 = 0.05;

/// Asserts that a tenant's fraction of the GPU `got` is `want` +/- [`SHARE_TOLERANCE`],
/// printing it either way so that a run shows the figures.
pub fn assert_share_near(got: f64, want: f64, what: &str) {
    println!(
        "{what}: {:.2} % (want {:.0} +/- {:.0})",
        got * 100.0,
        want * 100.0,
        SHARE_TOLERANCE * 100.0
    );
    assert!(
        (got - want).abs() <= SHARE_TOLERANCE,
        "{what}: got {:.2} %, want {:.0} +/- {:.0} pp",
        got * 100.0,
        want * 100.0,
        SHARE_TOLERANCE * 100.0
    );
}

/// This machine's glibc version ("2.36"), as glibc itself says: the tests inject libraries built
/// here, which need it.
pub fn glibc_here() -> String {
    // SAFETY: gnu_get_libc_version takes nothing and returns a static NUL-terminated string.
    unsafe { std::ffi::CStr::from_ptr(libc::gnu_get_libc_version()) }
        .to_string_lossy()
        .into_owned()
}
