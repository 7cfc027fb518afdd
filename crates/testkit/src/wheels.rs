//! Pinned PyPI wheels for the tests that run NVIDIA's runtime and the frameworks on the
//! simulator: each set of packages is installed once into its own virtual environment under
//! `target/ci-tools/` (git-ignored), which later runs reuse.
//!
//! Where it cannot be installed (no network, no python3), [`venv`] prints a loud SKIPPED line
//! and answers None, or panics when `CI` is set: a test that needs a wheel never passes without
//! having run.

use std::path::PathBuf;
use std::process::Command;

/// How pip treats the packages' dependencies.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Deps {
    /// `--no-deps`: exactly the pinned packages (a runtime library wheel needs nothing else).
    None,
    /// Whatever the pinned packages require (a framework's own pins decide their versions).
    Resolve,
}

/// `target/ci-tools/<name>/`, a venv holding `packages` (`(name, version)`, pinned), installed
/// first if needed. None (after a SKIPPED line naming `test`) where it cannot be had, outside CI.
pub fn venv(test: &str, name: &str, packages: &[(&str, &str)], deps: Deps) -> Option<PathBuf> {
    let tools = crate::profile_dir_of_test()
        .parent()
        .expect("target/")
        .join("ci-tools");
    let venv = tools.join(name);
    // One install at a time in this process (its tests run as threads).
    static INSTALLING: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = INSTALLING.lock().unwrap_or_else(|e| e.into_inner());
    if venv.join("installed").exists() {
        return Some(venv);
    }
    // Installed beside its final place and renamed into it, so that two tests (or two test
    // processes) installing at once never see half a venv.
    let tmp = tools.join(format!("{name}.tmp-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    let install = || -> Result<(), String> {
        std::fs::create_dir_all(&tools).map_err(|e| format!("{}: {e}", tools.display()))?;
        run(Command::new("python3").arg("-m").arg("venv").arg(&tmp))?;
        let mut pip = Command::new(tmp.join("bin/pip"));
        pip.args(["install", "--quiet", "--disable-pip-version-check"]);
        if deps == Deps::None {
            pip.arg("--no-deps");
        }
        pip.args(packages.iter().map(|(p, v)| format!("{p}=={v}")));
        run(&mut pip)?;
        std::fs::write(tmp.join("installed"), "").map_err(|e| e.to_string())?;
        Ok(())
    };
    match install() {
        Ok(()) => {
            if std::fs::rename(&tmp, &venv).is_err() {
                // Another process got there first; theirs is as good.
                let _ = std::fs::remove_dir_all(&tmp);
            }
            Some(venv)
        }
        Err(why) => {
            let _ = std::fs::remove_dir_all(&tmp);
            let list: Vec<String> = packages.iter().map(|(p, v)| format!("{p}=={v}")).collect();
            let what = format!("cannot install {} from PyPI: {why}", list.join(" "));
            if crate::container::in_ci() {
                panic!("{test}: {what}. CI is set, so this fails instead of skipping");
            }
            use std::io::Write as _;
            let _ = writeln!(
                std::io::stderr(),
                "\n*** SKIPPED {test}: {what} (with CI set this fails) ***\n"
            );
            None
        }
    }
}

fn run(cmd: &mut Command) -> Result<(), String> {
    let out = cmd.output().map_err(|e| format!("{cmd:?}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{cmd:?}: {}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

/// nvcc 13.5 and CUDA 13.5's headers and static runtime, from PyPI (pinned; about 350 MB
/// installed in target/ci-tools/nvcc-13.5.37).
pub const NVCC_13_5: &[(&str, &str)] = &[
    ("nvidia-cuda-nvcc", "13.5.37"),
    ("nvidia-nvvm", "13.5.37"),
    ("nvidia-cuda-crt", "13.5.37"),
    ("nvidia-cuda-runtime", "13.5.37"),
];

/// `site-packages/nvidia/cu13` of the nvcc 13.5 venv (`bin/nvcc`, `include/cuda.h`,
/// `include/cudaTypedefs.h`), installed on first use; None after a SKIPPED line where it cannot
/// be installed (a failure under CI, see [`venv`]).
pub fn nvcc_13_5(test: &str) -> Option<PathBuf> {
    let venv = venv(test, "nvcc-13.5.37", NVCC_13_5, Deps::None)?;
    Some(
        std::fs::read_dir(venv.join("lib"))
            .expect("venv/lib")
            .flatten()
            .map(|py| py.path().join("site-packages/nvidia/cu13"))
            .find(|p| p.join("bin/nvcc").exists())
            .expect("nvidia/cu13/bin/nvcc in the nvcc venv"),
    )
}

/// Runs nvcc of `cu13` ([`nvcc_13_5`]) on `src` with `args`, writing `out`; panics with nvcc's
/// output when it fails. Returns what it printed (ptxas's `--resource-usage` report goes there).
pub fn nvcc(
    cu13: &std::path::Path,
    args: &[&str],
    src: &std::path::Path,
    out: &std::path::Path,
) -> String {
    let ran = Command::new(cu13.join("bin/nvcc"))
        .args(args)
        .arg("-o")
        .arg(out)
        .arg(src)
        .output()
        .expect("run nvcc");
    let text =
        String::from_utf8_lossy(&ran.stderr).into_owned() + &String::from_utf8_lossy(&ran.stdout);
    assert!(
        ran.status.success(),
        "nvcc {args:?} {}: {}\n{text}",
        src.display(),
        ran.status
    );
    text
}
