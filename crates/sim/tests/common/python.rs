//! Running NVIDIA's runtime and the frameworks' Python clients on the simulator (the cudart,
//! CuPy and pynvml tests): one probe runner, the environment of a quota, the probes' JSON.
//! Apart from `common` because the root crate's benches include that and have no serde_json.
#![allow(dead_code)]

use crate::common::{sim_env, state_file};
use std::path::Path;
use std::process::Command;

/// `cuvisor run`'s options for the quota tests: the quota the issue names, on the 16 GiB
/// `single` GPU.
pub const QUOTA: &[&str] = &["--memory", "6Gi"];
pub const QUOTA_BYTES: u64 = 6 << 30;

/// `program`, on the simulator `model` with its state in `state`: plain (`LD_LIBRARY_PATH` on
/// the simulated driver) when `run` is empty, else as `cuvisor run RUN --sim MODEL --state STATE
/// -- PROGRAM` starts it (libcuvisor preloaded, a fresh ledger, the coordinator beside the state
/// file). cuvisor's own settings are cleared from the environment either way.
pub fn on_sim(program: &Path, run: &[&str], model: &str, state: &Path) -> Command {
    let mut cmd = if run.is_empty() {
        Command::new(program)
    } else {
        let exe = cuvisor_testkit::built(&cuvisor_testkit::profile_dir_of_test()).join("cuvisor");
        let mut c = Command::new(exe);
        c.arg("run")
            .args(run)
            .args(["--sim", model, "--state"])
            .arg(state)
            .arg("--")
            .arg(program);
        c
    };
    for k in [
        "LD_PRELOAD",
        "LD_LIBRARY_PATH",
        "CUVISOR_CONFIG",
        "CUVISOR_MEMORY_LIMIT",
        "CUVISOR_COMPUTE",
        "CUVISOR_STATE_DIR",
        "CUVISOR_COORD_DIR",
        "CUVISOR_SIM",
        "CUVISOR_SIM_STATE",
    ] {
        cmd.env_remove(k);
    }
    if run.is_empty() {
        sim_env(&mut cmd, model, state);
    }
    cmd
}

/// Removes a simulator state file and the coordinator directory `cuvisor run` made beside it.
pub fn remove_state(state: &Path) {
    let _ = std::fs::remove_file(state);
    let mut coord = state.as_os_str().to_owned();
    coord.push(".coord");
    let _ = std::fs::remove_dir_all(coord);
}

/// Runs `venv`'s python on `args` (a probe script and its arguments) on the simulator `model`,
/// under `cuvisor run RUN` unless `run` is empty (see [`on_sim`]), with `unset` removed from the
/// environment and `env` added; the JSON it prints (the process must succeed).
pub fn python_probe(
    venv: &Path,
    args: &[&std::ffi::OsStr],
    model: &str,
    tag: &str,
    unset: &[&str],
    env: &[(&str, &str)],
    run: &[&str],
) -> serde_json::Value {
    let state = state_file(tag);
    let mut cmd = on_sim(&venv.join("bin/python"), run, model, &state);
    cmd.args(args);
    for k in unset {
        cmd.env_remove(k);
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    json_of(&mut cmd, &state)
}

/// Runs `cmd` (made by [`on_sim`] on `state`), then removes the state; the JSON it printed (it
/// must succeed).
pub fn json_of(cmd: &mut Command, state: &Path) -> serde_json::Value {
    let out = cmd.output().expect("run the probe");
    remove_state(state);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}\n--- stdout\n{stdout}\n--- stderr\n{stderr}",
        out.status
    );
    serde_json::from_str(stdout.trim())
        .unwrap_or_else(|e| panic!("{cmd:?} printed no JSON ({e}):\n{stdout}\n{stderr}"))
}

/// What a runtime probe (cudart/probe.py, cudart/runtime.cu) saw of its allocators `names`, on
/// a GPU whose memory info says `total`, of which `idle` is free while nothing is allocated
/// (the total less what the process's context takes, on the plain simulator): each took its
/// 64 MiB out of `idle` and gave it back;
/// more than is free was cudaErrorMemoryAllocation (2), reported once by cudaGetLastError, and
/// the allocator worked again after it (managed memory on the plain simulator takes nothing until
/// touched). `refuses_managed`: whether managed memory beyond the free memory is
/// refused: under libcuvisor it is (it counts against the quota); the real driver lets managed
/// memory oversubscribe the GPU on Linux (pages migrate on demand), so the plain run leaves it
/// unchecked.
pub fn allocators_counted(
    v: &serde_json::Value,
    total: u64,
    idle: u64,
    names: &[&str],
    refuses_managed: bool,
) {
    const MIB: u64 = 1 << 20;
    for name in names {
        let key = |k: &str| format!("{name}{k}");
        let free = |k: &str| {
            let m = at(v, &key(k));
            assert_eq!(
                (u(&m[0]), u(&m[2])),
                (0, total),
                "{} answered {m:?}",
                key(k)
            );
            u(&m[1])
        };
        assert_eq!(u(&at(v, name)[0]), 0, "{name}: {:?}", at(v, name));
        let taken = idle - free("_taken");
        if *name == "cudaMallocManaged" && !refuses_managed {
            // Untouched managed memory is on no device (cuMemAllocManaged populates nothing;
            // see crates/sim/cuda/src/managed.rs). libcuvisor's quota counts all of it at once
            // (the other branch).
            assert_eq!(
                taken, 0,
                "{name} of 64 MiB took {taken} bytes before any touch"
            );
        } else {
            assert!(
                (64 * MIB..=66 * MIB).contains(&taken),
                "{name} of 64 MiB took {taken} bytes of the free memory"
            );
        }
        assert_eq!(u(&at(v, &key("_freed"))[0]), 0);
        assert_eq!(free("_after_free"), idle, "{name}: given back");
        if *name == "cudaMallocManaged" && !refuses_managed {
            continue;
        }
        assert_eq!(
            u(&at(v, &key("_too_large"))[0]),
            2,
            "{name} beyond the free memory"
        );
        assert_eq!(u(&at(v, &key("_last_error"))[0]), 2, "{name}'s error, once");
        for (i, r) in at(v, &key("_after_refusal")).iter().enumerate() {
            assert_eq!(u(r), 0, "{name} after a refusal, call {i}");
        }
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
