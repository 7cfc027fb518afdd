//! The `cuvisor` binary, run as a real process on the simulator: `smi` and `smi topo -m` through
//! the simulated libnvidia-ml.so.1, fault verbs checked on the shared state file they change, and
//! the errors bad input gets.

use cuvisor_sim::model::{self, Model, GIB, MIB, PRESETS};
use cuvisor_sim::state::Shared;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::Ordering::Acquire;

const EXE: &str = env!("CARGO_BIN_EXE_cuvisor");

/// target/<profile>/, with the simulated libraries (and libcuvisor.so) built.
fn sim_built() -> &'static Path {
    cuvisor_testkit::built(Path::new(EXE).parent().unwrap())
}

/// A state file of one test, deleted when the test ends.
struct State(PathBuf);

impl State {
    fn new(tag: &str) -> State {
        let p = std::env::temp_dir().join(format!(
            "cuvisor-cli-test-{tag}-{}.state",
            std::process::id()
        ));
        let _ = std::fs::remove_file(&p);
        State(p)
    }
    fn attach(&self, m: &Model) -> Shared {
        Shared::attach_at(m, &self.0).unwrap()
    }
}

impl Drop for State {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

struct Ran {
    out: Output,
    args: String,
}

impl Ran {
    fn stdout(&self) -> String {
        String::from_utf8_lossy(&self.out.stdout).into_owned()
    }
    fn stderr(&self) -> String {
        String::from_utf8_lossy(&self.out.stderr).into_owned()
    }
    fn code(&self) -> Option<i32> {
        self.out.status.code()
    }
    fn ok(self) -> Ran {
        assert_eq!(
            self.code(),
            Some(0),
            "cuvisor {} failed\n--- stdout\n{}\n--- stderr\n{}",
            self.args,
            self.stdout(),
            self.stderr()
        );
        self
    }
    /// Asserts exit code `code` and one line on stderr: "error: {message}".
    fn fails(self, code: i32, message: &str) -> Ran {
        assert_eq!(
            self.code(),
            Some(code),
            "cuvisor {}: want exit {code}\n--- stdout\n{}\n--- stderr\n{}",
            self.args,
            self.stdout(),
            self.stderr()
        );
        assert!(
            self.stderr().contains(message),
            "cuvisor {}: stderr lacks {message:?}:\n{}",
            self.args,
            self.stderr()
        );
        self
    }
}

/// Runs cuvisor with `args` on state file `state`, with CUVISOR_SIM unset unless `env` sets it.
fn cuvisor(args: &[&str], state: &State, env: &[(&str, &str)]) -> Ran {
    sim_built();
    let mut cmd = Command::new(EXE);
    cmd.args(args)
        .env_remove("CUVISOR_SIM")
        .env("CUVISOR_SIM_STATE", &state.0);
    for (k, v) in env {
        cmd.env(k, v);
    }
    Ran {
        out: cmd.output().expect("run cuvisor"),
        args: args.join(" "),
    }
}

#[test]
fn smi_lists_every_gpu_of_each_preset() {
    for p in PRESETS {
        let state = State::new(&format!("smi-{p}"));
        let m = model::preset(p).unwrap();
        let out = cuvisor(&["smi", "--sim", p], &state, &[]).ok().stdout();
        assert!(
            out.contains(&format!("| CUVISOR-SMI (simulator: {p})")),
            "{out}"
        );
        let (driver, cuda) = (
            &m.driver_release,
            format!(
                "{}.{}",
                m.driver_version / 1000,
                m.driver_version % 1000 / 10
            ),
        );
        assert!(out.contains(&format!("Driver Version: {driver}")), "{out}");
        assert!(out.contains(&format!("CUDA Version: {cuda}")), "{out}");
        for (i, d) in m.devices.iter().enumerate() {
            let first = out
                .lines()
                // NVML writes the bus id's hex digits in upper case.
                .find(|l| l.contains(&d.pci_bus_id_nvml().to_uppercase()))
                .unwrap_or_else(|| panic!("{p}: no row for GPU {i}:\n{out}"));
            let head = format!("|{i:>4}  ");
            assert!(first.starts_with(&head), "{p}: {first}");
            let name: String = d.name.chars().take(24).collect();
            assert!(first.contains(&name), "{p}: {first}");
            let total = format!("0MiB / {:>6}MiB", d.memory / MIB);
            assert!(
                out.contains(&total),
                "{p}: GPU {i} should show {total}:\n{out}"
            );
        }
        assert!(out.contains("No running processes found"), "{out}");
    }
}

#[test]
fn topo_matches_the_models_reference_matrix() {
    for p in PRESETS {
        let state = State::new(&format!("topo-{p}"));
        let want = model::preset(p).unwrap().topo_matrix();
        let got = cuvisor(&["smi", "topo", "-m", "--sim", p], &state, &[])
            .ok()
            .stdout();
        assert_eq!(got, want, "preset {p}");
    }
    // CUVISOR_SIM selects the simulator too, and -m may be left out.
    let state = State::new("topo-env");
    let got = cuvisor(&["smi", "topo"], &state, &[("CUVISOR_SIM", "dgx-a100")])
        .ok()
        .stdout();
    assert_eq!(got, model::preset("dgx-a100").unwrap().topo_matrix());
    let row0: Vec<&str> = got.lines().nth(1).unwrap().split('\t').collect();
    assert_eq!(
        row0[..9],
        ["GPU0", "X", "NV12", "NV12", "NV12", "NV12", "NV12", "NV12", "NV12"]
    );
}

#[test]
fn smi_shows_processes_and_reset_waits_for_them() {
    let state = State::new("procs");
    let m = model::preset("dgx1-v100").unwrap();
    let shared = state.attach(&m);
    let slot = shared.claim_slot().expect("a slot");
    assert!(shared.charge(slot, 2, GIB, m.devices[2].memory));
    let pid = std::process::id().to_string();

    let out = cuvisor(&["smi", "--sim", "dgx1-v100"], &state, &[])
        .ok()
        .stdout();
    let row = out
        .lines()
        .find(|l| l.contains(&format!(" {pid} ")))
        .unwrap_or_else(|| panic!("no process row for pid {pid}:\n{out}"));
    let cols: Vec<&str> = row.trim_matches('|').split_whitespace().collect();
    assert_eq!(cols[0], "2", "{row}");
    assert_eq!(cols[3], pid, "{row}");
    assert_eq!(cols[4], "C", "{row}");
    assert_eq!(*cols.last().unwrap(), "1024MiB", "{row}");
    assert!(out.contains("1024MiB /  16384MiB"), "{out}");
    assert!(!out.contains("No running processes found"), "{out}");

    // A live process holds a slot: reset refuses and says who.
    cuvisor(&["sim", "reset", "--sim", "dgx1-v100"], &state, &[]).fails(
        1,
        &format!("live processes still use the simulator (pid {pid})"),
    );
    assert!(state.0.exists());

    shared.release_slot(slot);
    let out = cuvisor(&["sim", "reset", "--sim", "dgx1-v100"], &state, &[])
        .ok()
        .stdout();
    assert!(out.contains("deleted"), "{out}");
    assert!(!state.0.exists());
    let out = cuvisor(&["sim", "reset", "--sim", "dgx1-v100"], &state, &[])
        .ok()
        .stdout();
    assert!(out.starts_with("nothing to reset"), "{out}");
}

#[test]
fn faults_change_the_shared_state() {
    let state = State::new("faults");
    let m = model::preset("dgx1-v100").unwrap();
    let sim = ["--sim", "dgx1-v100"];
    let run = |args: &[&str]| {
        let all: Vec<&str> = args.iter().chain(&sim).copied().collect();
        cuvisor(&all, &state, &[]).ok().stdout()
    };

    let out = run(&["sim", "fault", "xid", "--gpu", "3"]);
    assert_eq!(out, "GPU 3: raised XID 79 (event 1 on this GPU)\n");
    run(&["sim", "fault", "xid", "--gpu", "3", "--code", "48"]);
    let shared = state.attach(&m);
    let xids: Vec<u64> = shared.xids_after(3, 0).iter().map(|e| e.1).collect();
    assert_eq!(xids, [79, 48]);
    assert!(shared.xids_after(2, 0).is_empty());

    // GPU 0's links 2 and 3 go to GPU 3 (its links 0 and 1).
    let out = run(&["sim", "fault", "nvlink-down", "--gpu", "0", "--link", "3"]);
    assert_eq!(
        out,
        "GPU 0 NVLink 3 is down (and its other end, GPU 3 NVLink 1)\n"
    );
    assert_eq!(shared.device(0).nvlink_down.load(Acquire), 1 << 3);
    assert_eq!(shared.device(3).nvlink_down.load(Acquire), 1 << 1);
    // NVML sees it: the matrix shows one link fewer between 0 and 3, both ways.
    let topo = run(&["smi", "topo", "-m"]);
    let cell = |a: usize, b: usize| -> String {
        topo.lines()
            .nth(1 + a)
            .unwrap()
            .split('\t')
            .nth(1 + b)
            .unwrap()
            .to_string()
    };
    assert_eq!(
        (cell(0, 3), cell(3, 0)),
        ("NV1".into(), "NV1".into()),
        "{topo}"
    );
    assert_eq!(cell(0, 4), "NV2", "{topo}");

    run(&["sim", "fault", "nvlink-up", "--gpu", "3", "--link", "1"]);
    assert_eq!(shared.device(0).nvlink_down.load(Acquire), 0);
    assert_eq!(shared.device(3).nvlink_down.load(Acquire), 0);
    assert_eq!(run(&["smi", "topo", "-m"]), m.topo_matrix());

    let out = run(&["sim", "fault", "fail-alloc", "--gpu", "1", "--count", "3"]);
    assert_eq!(out, "GPU 1: the next 3 allocations will fail\n");
    assert_eq!(shared.device(1).fail_allocs.load(Acquire), 3);

    run(&["sim", "fault", "nvlink-down", "--gpu", "5", "--link", "0"]);
    assert_ne!(
        shared.device(1).nvlink_down.load(Acquire),
        0,
        "5's link 0 goes to 1"
    );
    run(&["sim", "fault", "clear", "--gpu", "1"]);
    assert_eq!(shared.device(1).fail_allocs.load(Acquire), 0);
    for g in 0..8 {
        assert_eq!(shared.device(g).nvlink_down.load(Acquire), 0, "GPU {g}");
    }

    run(&["sim", "fault", "nvlink-down", "--gpu", "6", "--link", "2"]);
    run(&["sim", "fault", "fail-alloc", "--gpu", "7", "--count", "1"]);
    let out = run(&["sim", "fault", "clear"]);
    assert_eq!(out.lines().count(), 8, "{out}");
    for g in 0..8 {
        assert_eq!(shared.device(g).nvlink_down.load(Acquire), 0, "GPU {g}");
        assert_eq!(shared.device(g).fail_allocs.load(Acquire), 0, "GPU {g}");
    }

    // An NVSwitch link has one GPU end.
    let a100 = State::new("faults-a100");
    let out = cuvisor(
        &["sim", "fault", "nvlink-down", "--gpu", "2", "--link", "11"],
        &a100,
        &[("CUVISOR_SIM", "dgx-a100")],
    )
    .ok()
    .stdout();
    assert_eq!(out, "GPU 2 NVLink 11 is down (it goes to NVSwitch 5)\n");
    let topo = cuvisor(&["smi", "topo", "-m", "--sim", "dgx-a100"], &a100, &[])
        .ok()
        .stdout();
    let row2: Vec<&str> = topo.lines().nth(3).unwrap().split('\t').collect();
    assert_eq!(row2[1..4], ["NV11", "NV11", "X"], "{topo}");
}

#[test]
fn bad_input_is_a_usage_error_that_says_what_is_wrong() {
    let state = State::new("bad");
    cuvisor(
        &["sim", "fault", "xid", "--gpu", "9", "--sim", "dgx1-v100"],
        &state,
        &[],
    )
    .fails(
        2,
        "error: GPU 9 does not exist (the dgx1-v100 simulator has GPUs 0-7)",
    );
    cuvisor(
        &["sim", "fault", "fail-alloc", "--gpu", "8", "--count", "1"],
        &state,
        &[("CUVISOR_SIM", "pcie-8")],
    )
    .fails(
        2,
        "GPU 8 does not exist (the pcie-8 simulator has GPUs 0-7)",
    );
    cuvisor(&["sim", "fault", "clear", "--gpu", "1"], &state, &[]).fails(
        2,
        "GPU 1 does not exist (the single simulator has only GPU 0)",
    );
    cuvisor(
        &[
            "sim",
            "fault",
            "nvlink-down",
            "--gpu",
            "0",
            "--link",
            "6",
            "--sim",
            "dgx1-v100",
        ],
        &state,
        &[],
    )
    .fails(
        2,
        "GPU 0 has no NVLink 6 (GPU 0 of the dgx1-v100 simulator has NVLinks 0-5)",
    );
    cuvisor(
        &[
            "sim",
            "fault",
            "nvlink-up",
            "--gpu",
            "0",
            "--link",
            "0",
            "--sim",
            "pcie-8",
        ],
        &state,
        &[],
    )
    .fails(2, "(GPU 0 of the pcie-8 simulator has no NVLinks)");
    assert!(!state.0.exists(), "rejected input must not touch the state");

    let ran = cuvisor(&["smi", "--sim", "dgx2"], &state, &[]).fails(
        2,
        "error: --sim dgx2: no such simulator preset; the presets are single, dgx1-v100, dgx-a100, h200, pcie-8",
    );
    assert!(ran.stdout().is_empty());
    cuvisor(
        &["smi", "topo", "-m"],
        &state,
        &[("CUVISOR_SIM", "dgx-h100")],
    )
    .fails(2, "CUVISOR_SIM=dgx-h100: no such simulator preset");
    cuvisor(&["smi", "--sim", "/nonexistent/machine.toml"], &state, &[]).fails(
        2,
        "--sim /nonexistent/machine.toml: cannot read /nonexistent/machine.toml",
    );

    // clap's own errors: exit 2 too.
    cuvisor(&["sim", "fault", "xid"], &state, &[]).fails(2, "--gpu <GPU>");
    cuvisor(&["sim", "fault", "xid", "--gpu", "x"], &state, &[])
        .fails(2, "invalid value 'x' for '--gpu <GPU>'");
    cuvisor(
        &["sim", "fault", "xid", "--gpu", "0", "--code", "0"],
        &state,
        &[],
    )
    .fails(2, "invalid value '0' for '--code <CODE>'");
    cuvisor(&["sim", "fault", "melt"], &state, &[]).fails(2, "unrecognized subcommand 'melt'");
    cuvisor(&["smi", "topo", "-x"], &state, &[]).fails(2, "unexpected argument '-x'");
    cuvisor(&[], &state, &[]).fails(2, "Usage: cuvisor");
}

#[test]
fn runtime_failures_exit_1() {
    // A state file made for another machine model.
    let state = State::new("other-model");
    drop(state.attach(&model::preset("single").unwrap()));
    cuvisor(
        &["sim", "fault", "xid", "--gpu", "0", "--sim", "pcie-8"],
        &state,
        &[],
    )
    .fails(1, "belongs to another machine model");
    cuvisor(&["sim", "reset", "--sim", "pcie-8"], &state, &[])
        .fails(1, "belongs to another machine model");
    cuvisor(&["smi", "--sim", "pcie-8"], &state, &[]).fails(
        1,
        &format!(
            "error: simulator state {}: belongs to another machine model",
            state.0.display()
        ),
    );
    assert!(state.0.exists());
}

#[test]
fn without_a_simulator_smi_uses_the_system_nvml() {
    let state = State::new("system");
    // No NVIDIA driver on the build machines: a clear failure that points at --sim. On a machine
    // with a GPU (or with the simulator on LD_LIBRARY_PATH) the system's NVML answers instead.
    let ran = cuvisor(&["smi"], &state, &[]);
    if ran.code() == Some(0) {
        assert!(
            ran.stdout().contains("| CUVISOR-SMI (NVML)"),
            "{}",
            ran.stdout()
        );
    } else {
        ran.fails(1, "cannot initialise NVML (libnvidia-ml.so.1)")
            .fails(1, "cuvisor smi --sim PRESET");
    }
}

#[test]
fn presets_are_listed() {
    let state = State::new("presets");
    let out = cuvisor(&["sim", "presets"], &state, &[]).ok().stdout();
    for p in PRESETS {
        assert!(out.lines().any(|l| l.starts_with(p)), "{p}:\n{out}");
    }
    assert!(out.contains("NVSwitch"), "{out}");
    let help = cuvisor(&["--help"], &state, &[]).ok().stdout();
    assert!(
        help.contains("Exit codes: 0 ok, 1 failure while running, 2 bad usage"),
        "{help}"
    );
}
