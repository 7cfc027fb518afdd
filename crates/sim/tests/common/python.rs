//! Running NVIDIA's runtime and the frameworks' Python clients on the simulator (the cudart,
//! CuPy and pynvml tests): one probe runner, the environment of a quota, the probes' JSON.
//! Apart from `common` because the root crate's benches include that and have no serde_json.
#![allow(dead_code)]

use crate::common::{sim_env, state_file};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Runs `venv`'s python on `args` (a probe script and its arguments) on the simulator `model`,
/// with cuvisor's own settings cleared and `unset` removed, then `env` added; the JSON it
/// prints (the process must succeed).
pub fn python_probe(
    venv: &Path,
    args: &[&std::ffi::OsStr],
    model: &str,
    tag: &str,
    unset: &[&str],
    env: &[(&str, &str)],
) -> serde_json::Value {
    let state = state_file(tag);
    let mut cmd = Command::new(venv.join("bin/python"));
    cmd.args(args);
    sim_env(&mut cmd, model, &state);
    for k in ["LD_PRELOAD", "CUVISOR_CONFIG", "CUVISOR_MEMORY_LIMIT"]
        .iter()
        .chain(unset)
    {
        cmd.env_remove(k);
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("run python");
    let _ = std::fs::remove_file(&state);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{args:?} failed: {}\n--- stdout\n{stdout}\n--- stderr\n{stderr}",
        out.status
    );
    serde_json::from_str(stdout.trim())
        .unwrap_or_else(|e| panic!("{args:?} printed no JSON ({e}):\n{stdout}\n{stderr}"))
}

/// A ledger directory of a test's own and the environment that runs a process under
/// libcuvisor with memory limit `limit`, as `cuvisor run --memory` sets it up (the library
/// preloaded, its ledger and coordinator in that directory). The directory goes on drop.
pub struct UnderQuota {
    pub ledger: PathBuf,
    vars: Vec<(&'static str, String)>,
}

impl UnderQuota {
    pub fn new(test: &str, limit: &str) -> UnderQuota {
        let libcuvisor = cuvisor_testkit::built(&cuvisor_testkit::profile_dir_of_test())
            .join("deps/libcuvisor.so");
        let ledger = std::env::temp_dir().join(format!("cuvisor-{test}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&ledger);
        std::fs::create_dir_all(&ledger).unwrap();
        let s = |p: &Path| p.to_str().unwrap().to_string();
        let vars = vec![
            ("LD_PRELOAD", s(&libcuvisor)),
            ("CUVISOR_STATE_DIR", s(&ledger)),
            ("CUVISOR_COORD_DIR", s(&ledger.join("coord"))),
            ("CUVISOR_MEMORY_LIMIT", limit.to_string()),
        ];
        UnderQuota { ledger, vars }
    }
    pub fn env(&self) -> Vec<(&str, &str)> {
        self.vars.iter().map(|(k, v)| (*k, v.as_str())).collect()
    }
}

impl Drop for UnderQuota {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.ledger);
    }
}

/// `v[key]` as an array (a probe's answer to one call).
pub fn at(v: &serde_json::Value, key: &str) -> Vec<serde_json::Value> {
    v[key]
        .as_array()
        .unwrap_or_else(|| panic!("{key} missing in {v}"))
        .clone()
}

/// A probe's integer.
pub fn u(v: &serde_json::Value) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("not an integer: {v}"))
}
