//! Shared by the simulator's end-to-end tests: build the simulated libraries, and run test code
//! in a child process that loads them (the dynamic loader reads LD_LIBRARY_PATH only at start).
//!
//! Pattern:
//! ```ignore
//! #[test]
//! fn something() {
//!     if common::is_child() { /* client code: runs in the child, on the simulator */ return; }
//!     common::Child::new("something").preset("dgx1-v100").run().success();
//! }
//! ```
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The directory holding libcuda.so.1 and libnvidia-ml.so.1 (building them if needed).
pub fn sim_dir() -> PathBuf {
    cuvisor_testkit::built(&cuvisor_testkit::profile_dir_of_test()).join("sim")
}

pub fn is_child() -> bool {
    std::env::var_os("CUVISOR_TEST_CHILD").is_some()
}

/// A fresh simulator state file for one test.
pub fn state_file(tag: &str) -> PathBuf {
    let p = std::env::temp_dir().join(format!("cuvisor-test-{tag}-{}.state", std::process::id()));
    let _ = std::fs::remove_file(&p);
    p
}

/// Environment that makes a process run on the simulator.
pub fn sim_env(cmd: &mut Command, preset: &str, state: &Path) {
    cmd.env("LD_LIBRARY_PATH", sim_dir())
        .env("CUVISOR_SIM", preset)
        .env("CUVISOR_SIM_STATE", state);
}

pub struct Child {
    test: String,
    preset: String,
    state: PathBuf,
    env: Vec<(String, String)>,
}

impl Child {
    /// Re-runs test `test` of this binary in a child process on the simulator.
    pub fn new(test: &str) -> Child {
        Child {
            test: test.to_string(),
            preset: "single".into(),
            state: state_file(test),
            env: Vec::new(),
        }
    }
    pub fn preset(mut self, p: &str) -> Child {
        self.preset = p.into();
        self
    }
    pub fn state(mut self, p: &Path) -> Child {
        self.state = p.to_path_buf();
        self
    }
    pub fn env(mut self, k: &str, v: &str) -> Child {
        self.env.push((k.into(), v.into()));
        self
    }
    pub fn command(&self) -> Command {
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        cmd.args([
            self.test.as_str(),
            "--exact",
            "--nocapture",
            "--test-threads=1",
            // The child runs its test's body even when the parent test is #[ignore]d (and
            // was started with --ignored).
            "--include-ignored",
        ]);
        sim_env(&mut cmd, &self.preset, &self.state);
        cmd.env("CUVISOR_TEST_CHILD", "1");
        for (k, v) in &self.env {
            cmd.env(k, v);
        }
        cmd
    }
    /// Starts the child without waiting, its output captured for [`Ran::success`].
    pub fn spawn(&self) -> std::process::Child {
        use std::process::Stdio;
        self.command()
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn child test")
    }
    pub fn run(&self) -> Ran {
        Ran(self.command().output().expect("spawn child test"))
    }
}

pub struct Ran(pub Output);

impl Ran {
    pub fn stdout(&self) -> String {
        String::from_utf8_lossy(&self.0.stdout).into_owned()
    }
    pub fn stderr(&self) -> String {
        String::from_utf8_lossy(&self.0.stderr).into_owned()
    }
    /// Asserts the child passed (its assertions ran and held), showing its output if not.
    pub fn success(self) -> Ran {
        assert!(
            self.0.status.success() && self.stdout().contains("1 passed"),
            "child failed: {:?}\n--- stdout\n{}\n--- stderr\n{}",
            self.0.status,
            self.stdout(),
            self.stderr()
        );
        self
    }
}
