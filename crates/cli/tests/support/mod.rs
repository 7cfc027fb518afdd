//! What the CLI's end-to-end tests share: the built `cuvisor`, a scratch directory per test used
//! as TMPDIR, and running `cuvisor` with none of cuvisor's variables inherited.
#![allow(dead_code)] // each test crate uses its own part

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

pub const EXE: &str = env!("CARGO_BIN_EXE_cuvisor");

/// target/<profile>/, with libcuvisor.so and the simulated libraries built.
pub fn built() -> &'static Path {
    cuvisor_testkit::built(Path::new(EXE).parent().unwrap())
}

/// A directory of one test, removed when it ends; the runs of the test use `tmp/` in it as
/// TMPDIR, so that what `cuvisor run` leaves behind there can be checked.
pub struct Scratch(PathBuf);

impl Scratch {
    pub fn new(tag: &str) -> Scratch {
        let p = std::env::temp_dir().join(format!("cuvisor-cli-test-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(p.join("tmp")).unwrap();
        Scratch(p)
    }
    pub fn tmp(&self) -> PathBuf {
        self.0.join("tmp")
    }
    pub fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
    /// What `cuvisor run` left in TMPDIR.
    pub fn leftovers(&self) -> Vec<PathBuf> {
        std::fs::read_dir(self.tmp())
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect()
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub struct Ran {
    pub out: Output,
    pub args: String,
}

impl Ran {
    pub fn stdout(&self) -> String {
        String::from_utf8_lossy(&self.out.stdout).into_owned()
    }
    pub fn stderr(&self) -> String {
        String::from_utf8_lossy(&self.out.stderr).into_owned()
    }
    pub fn code(&self) -> Option<i32> {
        self.out.status.code()
    }
    pub fn show(&self) -> String {
        format!(
            "cuvisor {}: {:?}\n--- stdout\n{}--- stderr\n{}",
            self.args,
            self.out.status,
            self.stdout(),
            self.stderr()
        )
    }
    pub fn exits(self, code: i32) -> Ran {
        assert_eq!(self.code(), Some(code), "{}", self.show());
        self
    }
}

/// `cuvisor ARGS` with TMPDIR in `scratch`, none of cuvisor's variables (nor LD_PRELOAD and
/// LD_LIBRARY_PATH) inherited from the test's environment, plus `env`.
pub fn command(args: &[&str], scratch: &Scratch, env: &[(&str, &str)]) -> Command {
    built();
    let mut cmd = Command::new(EXE);
    cmd.args(args).env("TMPDIR", scratch.tmp());
    for k in [
        "CUVISOR_SIM",
        "CUVISOR_SIM_STATE",
        "CUVISOR_CONFIG",
        "CUVISOR_MEMORY_LIMIT",
        "CUVISOR_STATE_DIR",
        "CUVISOR_LOG",
        "CUVISOR_COMPUTE",
        "CUVISOR_COORD_DIR",
        "LD_PRELOAD",
        "LD_LIBRARY_PATH",
    ] {
        cmd.env_remove(k);
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd
}

pub fn cuvisor(args: &[&str], scratch: &Scratch, env: &[(&str, &str)]) -> Ran {
    Ran {
        out: command(args, scratch, env).output().expect("run cuvisor"),
        args: args.join(" "),
    }
}

/// `cuvisor ARGS` as [`cuvisor`] runs it, but the test fails (and cuvisor is killed) if it has
/// not ended within `limit`: for input that once made it hang.
pub fn cuvisor_within(
    limit: std::time::Duration,
    args: &[&str],
    scratch: &Scratch,
    env: &[(&str, &str)],
) -> Ran {
    use std::process::Stdio;
    let mut child = command(args, scratch, env)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run cuvisor");
    let started = std::time::Instant::now();
    while child.try_wait().unwrap().is_none() {
        if started.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("cuvisor {} still running after {limit:?}", args.join(" "));
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    Ran {
        out: child.wait_with_output().unwrap(),
        args: args.join(" "),
    }
}

/// A FIFO at `path` (mkfifo(1)).
pub fn mkfifo(path: &Path) {
    let ok = Command::new("mkfifo").arg(path).status().unwrap().success();
    assert!(ok, "mkfifo {}", path.display());
}
