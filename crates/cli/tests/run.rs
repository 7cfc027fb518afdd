//! `cuvisor run` end to end on the simulated GPU: the tf_stress driver-level twin
//! (examples/tf_stress/twin.c) under a quota, programs that never touch CUDA, exit statuses,
//! signals (passed on; the command dying with cuvisor), the environment and state directory the
//! command gets, bad input refused before anything runs (libraries that would not load, machine
//! and state files that are special files or not the simulator's), and what a killed run leaves
//! behind removed by the next.

use cuvisor_shm::ledger::{Ledger, FILE_NAME};
use std::io::{BufRead as _, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::Ordering::Acquire;
use std::sync::OnceLock;

mod support;
use support::*;

const GIB: u64 = 1 << 30;

/// The twin, compiled once per test binary (per pid: other test runs may share the target dir).
fn twin() -> &'static Path {
    static EXE: OnceLock<PathBuf> = OnceLock::new();
    EXE.get_or_init(|| {
        cuvisor_testkit::compile_c(
            &Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/tf_stress/twin.c"),
            Path::new(env!("CARGO_TARGET_TMPDIR")),
            "tf_stress_twin",
        )
    })
}

/// Lines of the twin's table: "fraction 0.30: ...".
fn fraction_line<'a>(out: &'a str, f: &str) -> &'a str {
    out.lines()
        .find(|l| l.starts_with(&format!("fraction {f}:")))
        .unwrap_or_else(|| panic!("no line for fraction {f}:\n{out}"))
}

/// The twin's table on a GPU of `mib` MiB with nothing in use.
fn assert_twin_table(out: &str, mib: u64) {
    assert!(
        out.contains(&format!("total {mib} MiB, free {mib} MiB")),
        "want a {mib} MiB GPU:\n{out}"
    );
    for (f, share) in [("0.30", 0.3), ("0.50", 0.5), ("0.80", 0.8), ("1.00", 1.0)] {
        let want = format!("allocated {:.0} MiB ok", mib as f64 * share);
        let line = fraction_line(out, f);
        assert!(line.ends_with(&want), "{line:?}, want {want:?}");
    }
    let line = fraction_line(out, "1.20");
    assert!(
        line.starts_with("fraction 1.20: failed cleanly: CUDA_ERROR_OUT_OF_MEMORY"),
        "{line}"
    );
    assert!(
        out.contains(&format!(
            "afterwards: 1 MiB allocation ok, free {mib} MiB of {mib} MiB"
        )),
        "{out}"
    );
    assert!(out.ends_with("twin: PASS\n"), "{out}");
}

fn ledger_of(state_dir: &Path) -> Ledger {
    Ledger::open(&state_dir.join(FILE_NAME), false).expect("the library wrote a ledger")
}

/// The twin itself, on the simulator without cuvisor: the whole 16 GiB device. This checks the
/// twin (and its expectations) independently of the library.
#[test]
fn the_twin_alone_sees_the_whole_simulated_device() {
    let scratch = Scratch::new("twin-alone");
    // The `single` preset's GPU, but with contexts that take no memory: the twin's table reasons
    // from a device with all of its memory free (its process's context takes some on the
    // presets, as on a real GPU), and the cuvisor runs below compare against that table.
    let machine = scratch.path("single-no-context-memory.toml");
    std::fs::write(
        &machine,
        "[[device]]\nname = \"NVIDIA A100-PCIE-16GB (simulated)\"\nmemory = \"16Gi\"\n\
         sm_count = 108\ncompute_capability = \"8.0\"\ncontext_memory = 0\n",
    )
    .unwrap();
    for resolve in ["procaddress", "dlsym"] {
        let out = Command::new(twin())
            .args(["--resolve", resolve])
            .env("LD_LIBRARY_PATH", built().join("sim"))
            .env("CUVISOR_SIM", &machine)
            .env(
                "CUVISOR_SIM_STATE",
                scratch.path(&format!("{resolve}.state")),
            )
            .env_remove("LD_PRELOAD")
            .output()
            .unwrap();
        let so = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{so}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_twin_table(&so, 16 * 1024);
    }
}

/// The README's main job: the twin under a 6 GiB quota on a 16 GiB simulated GPU sees a 6 GiB
/// GPU, gets every fraction up to all of it, and a clean out-of-memory (with one line from
/// cuvisor) for 1.2; the ledger ends empty with the refusal counted.
#[test]
fn the_twin_under_6gi_sees_a_6_gib_gpu_and_a_clean_refusal() {
    let scratch = Scratch::new("twin-6gi");
    for resolve in ["procaddress", "dlsym"] {
        let state = scratch.path(&format!("state-{resolve}"));
        let twin = twin().to_str().unwrap();
        let ran = cuvisor(
            &[
                "run",
                "--memory",
                "6Gi",
                "--sim",
                "single",
                "--state-dir",
                state.to_str().unwrap(),
                "--",
                twin,
                "--resolve",
                resolve,
            ],
            &scratch,
            &[],
        )
        .exits(0);
        assert_twin_table(&ran.stdout(), 6 * 1024);
        let refusals: Vec<String> = ran
            .stderr()
            .lines()
            .filter(|l| l.starts_with("cuvisor: "))
            .map(String::from)
            .collect();
        assert_eq!(refusals.len(), 1, "{}", ran.show());
        let ledger = ledger_of(&state);
        let devices: Vec<_> = ledger.devices().collect();
        assert_eq!(devices.len(), 1, "one GPU in the ledger");
        let (_, _, e) = devices[0];
        assert_eq!(e.limit.load(Acquire), 6 * GIB);
        assert_eq!(e.used_bytes(), 0, "everything given back");
        assert_eq!(e.peak.load(Acquire), 6 * GIB);
        assert_eq!(e.denied.load(Acquire), 1);
    }
    // The temporary directory for the simulator's state is gone.
    assert_eq!(scratch.leftovers(), Vec::<PathBuf>::new());
}

/// Per-device quotas, by CUDA ordinal, on an 8-GPU simulator.
#[test]
fn per_device_quotas_apply_by_ordinal() {
    let scratch = Scratch::new("per-device");
    for (device, mib) in [("0", 6 * 1024), ("1", 2 * 1024)] {
        let ran = cuvisor(
            &[
                "run",
                "--memory-per-device",
                "0=6Gi,1=2Gi",
                "--sim",
                "dgx1-v100",
                "--",
                twin().to_str().unwrap(),
                "--device",
                device,
            ],
            &scratch,
            &[],
        )
        .exits(0);
        assert_twin_table(&ran.stdout(), mib);
    }
}

/// --verbose says how the command runs and, afterwards, what the ledger holds.
#[test]
fn verbose_reports_the_setup_and_the_ledger() {
    let scratch = Scratch::new("verbose");
    let ran = cuvisor(
        &[
            "run",
            "--memory",
            "6Gi",
            "--sim",
            "single",
            "-v",
            "--",
            twin().to_str().unwrap(),
        ],
        &scratch,
        &[],
    )
    .exits(0);
    let err = ran.stderr();
    for want in [
        "cuvisor: running ",
        "with a quota of 6 GiB per GPU (CUVISOR_MEMORY_LIMIT=6442450944)",
        "libcuvisor.so\n",
        "(removed afterwards)",
        "cuvisor: simulated GPU single",
        "exited with status 0",
        ": quota 6 GiB, peak 6 GiB, in use 0 B, 1 allocation refused",
    ] {
        assert!(err.contains(want), "stderr lacks {want:?}:\n{}", ran.show());
    }
}

#[test]
fn programs_that_never_touch_cuda_run_unchanged() {
    let scratch = Scratch::new("no-cuda");
    let ran = cuvisor(
        &["run", "--memory", "1Gi", "--", "/bin/true"],
        &scratch,
        &[],
    )
    .exits(0);
    assert_eq!((ran.stdout(), ran.stderr()), (String::new(), String::new()));
    let ran = cuvisor(
        &[
            "run",
            "--memory",
            "1Gi",
            "--",
            "sh",
            "-c",
            "echo hello; echo oops >&2",
        ],
        &scratch,
        &[],
    )
    .exits(0);
    assert_eq!(
        (ran.stdout(), ran.stderr()),
        ("hello\n".to_string(), "oops\n".to_string())
    );
    // Python, where there is one: the interpreter starts and ends under the library untouched.
    if Command::new("python3")
        .args(["-c", "pass"])
        .status()
        .is_ok_and(|s| s.success())
    {
        let ran = cuvisor(
            &["run", "--memory", "1Gi", "--", "python3", "-c", "pass"],
            &scratch,
            &[],
        )
        .exits(0);
        assert_eq!((ran.stdout(), ran.stderr()), (String::new(), String::new()));
        let ran = cuvisor(
            &[
                "run",
                "--memory",
                "1Gi",
                "--",
                "python3",
                "-c",
                "import os; print(os.environ['CUVISOR_MEMORY_LIMIT'])",
            ],
            &scratch,
            &[],
        )
        .exits(0);
        assert_eq!(ran.stdout(), "1073741824\n");
    } else {
        eprintln!("python3 not found: its part of this test did not run");
    }
    assert_eq!(scratch.leftovers(), Vec::<PathBuf>::new());
}

#[test]
fn the_exit_status_is_the_commands() {
    let scratch = Scratch::new("status");
    let run = |cmd: &[&str]| {
        let mut args = vec!["run", "--memory", "1Gi", "--"];
        args.extend_from_slice(cmd);
        cuvisor(&args, &scratch, &[])
    };
    run(&["sh", "-c", "exit 7"]).exits(7);
    run(&["sh", "-c", "exit 255"]).exits(255);
    run(&["false"]).exits(1);
    // A signal: 128 + its number, as a shell reports it.
    run(&["sh", "-c", "kill -TERM $$"]).exits(143);
    run(&["sh", "-c", "kill -KILL $$"]).exits(137);
    // Cannot be started: 127 / 126, as shells and env(1) answer.
    let ran = run(&["cuvisor-no-such-command"]).exits(127);
    assert_eq!(
        ran.stderr(),
        "error: cuvisor-no-such-command: command not found\n"
    );
    let not_executable = scratch.path("data.txt");
    std::fs::write(&not_executable, "not a program").unwrap();
    let ran = run(&[not_executable.to_str().unwrap()]).exits(126);
    assert!(
        ran.stderr().starts_with("error: cannot run "),
        "{}",
        ran.show()
    );
    assert_eq!(scratch.leftovers(), Vec::<PathBuf>::new());
}

/// SIGINT and SIGTERM sent to cuvisor reach the command, which decides how to end; cuvisor
/// then exits with its status and cleans up.
#[test]
fn sigint_and_sigterm_are_passed_on() {
    let scratch = Scratch::new("signals");
    for (sig, name, code) in [(libc::SIGTERM, "TERM", 42), (libc::SIGINT, "INT", 43)] {
        signal_reaches_the_command(&scratch, sig, name, code);
    }
}

/// Sends `sig` to a `cuvisor run` whose command traps it (and exits `code`), with the run's
/// temporary directory there before; the command got it, cuvisor exited with its status and
/// removed the directory.
fn signal_reaches_the_command(scratch: &Scratch, sig: libc::c_int, name: &str, code: i32) {
    // Bounded: a command left behind ends by itself.
    let script = format!(
        "trap 'echo got {name}; exit {code}' {name}; echo ready; i=0; \
         while [ $i -lt 100 ]; do sleep 0.1; i=$((i+1)); done; exit 99"
    );
    let mut child = command(
        &["run", "--memory", "1Gi", "--", "sh", "-c", &script],
        scratch,
        &[],
    )
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    assert_eq!(lines.next().unwrap().unwrap(), "ready");
    assert_eq!(
        scratch.leftovers().len(),
        1,
        "the run's temporary directory"
    );
    // SAFETY: plain kill(2) of our own child.
    assert_eq!(unsafe { libc::kill(child.id() as i32, sig) }, 0);
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(code), "SIG{name}: {status}");
    assert_eq!(lines.next().unwrap().unwrap(), format!("got {name}"));
    assert_eq!(scratch.leftovers(), Vec::<PathBuf>::new(), "SIG{name}");
}

/// What the command gets: the library first in LD_PRELOAD, the quota in bytes, a fresh state
/// directory that is removed afterwards; with --sim, the simulated driver first on the library
/// path and a fresh simulator state in that directory.
#[test]
fn the_command_gets_the_library_the_quota_and_a_fresh_state_directory() {
    let scratch = Scratch::new("env");
    let show = "printf '%s\\n' \"$LD_PRELOAD\" \"$CUVISOR_MEMORY_LIMIT\" \"$CUVISOR_STATE_DIR\" \
                \"$LD_LIBRARY_PATH\" \"$CUVISOR_SIM\" \"$CUVISOR_SIM_STATE\"; \
                test -d \"$CUVISOR_STATE_DIR\"";
    let ran = cuvisor(
        &[
            "run", "--memory", "4G", "--sim", "single", "--", "sh", "-c", show,
        ],
        &scratch,
        &[
            ("LD_PRELOAD", "/nonexistent/libother.so"),
            ("LD_LIBRARY_PATH", "/opt/lib"),
        ],
    )
    .exits(0);
    let out = ran.stdout();
    let v: Vec<&str> = out.lines().collect();
    let lib = built().join("deps/libcuvisor.so");
    assert_eq!(
        v[0],
        format!("{}:/nonexistent/libother.so", lib.display()),
        "{out}"
    );
    assert_eq!(v[1], "4000000000");
    let state_dir = PathBuf::from(v[2]);
    assert!(state_dir.starts_with(scratch.tmp()), "{out}");
    assert_eq!(v[3], format!("{}:/opt/lib", built().join("sim").display()));
    assert_eq!(v[4], "single");
    assert_eq!(PathBuf::from(v[5]), state_dir.join("sim.state"));
    assert!(!state_dir.exists(), "the state directory was not removed");
    assert_eq!(scratch.leftovers(), Vec::<PathBuf>::new());

    // --keep-state keeps it and says where.
    let ran = cuvisor(
        &[
            "run",
            "--memory",
            "1Gi",
            "--keep-state",
            "--",
            "sh",
            "-c",
            show,
        ],
        &scratch,
        &[],
    )
    .exits(0);
    let kept = PathBuf::from(ran.stdout().lines().nth(2).unwrap());
    assert!(kept.is_dir());
    assert_eq!(ran.stderr(), format!("cuvisor: kept {}\n", kept.display()));
    std::fs::remove_dir_all(&kept).unwrap();

    // --state-dir is used as given (made absolute), created if missing, and kept; a
    // CUVISOR_SIM_STATE in the environment is kept too, so nothing temporary is needed.
    let given = scratch.path("given/state");
    let sim_state = scratch.path("sim.state");
    let ran = cuvisor(
        &[
            "run",
            "--memory",
            "1Gi",
            "--sim",
            "single",
            "--state-dir",
            given.to_str().unwrap(),
            "--",
            "sh",
            "-c",
            show,
        ],
        &scratch,
        &[("CUVISOR_SIM_STATE", sim_state.to_str().unwrap())],
    )
    .exits(0);
    let out = ran.stdout();
    let v: Vec<&str> = out.lines().collect();
    assert_eq!(PathBuf::from(v[2]), given);
    assert_eq!(PathBuf::from(v[5]), sim_state);
    assert!(given.is_dir());
    assert_eq!(scratch.leftovers(), Vec::<PathBuf>::new());
}

/// Bad quotas and bad simulator choices are usage errors (exit 2) that say what is wrong, and
/// the command never runs.
#[test]
fn bad_input_is_refused_before_anything_runs() {
    let scratch = Scratch::new("bad");
    let marker = scratch.path("ran");
    let touch = format!("touch {}", marker.display());
    let units = "(use Ki, Mi, Gi, Ti, k, M, G, T or plain bytes)";
    let cases: Vec<(Vec<&str>, String)> = vec![
        (
            vec!["--memory", "4GB"],
            format!("error: --memory 4GB: unknown unit \"GB\" {units}"),
        ),
        (
            vec!["--memory", "-1"],
            "error: --memory -1: a size cannot be negative".into(),
        ),
        (
            vec!["--memory", ""],
            "error: --memory \"\": empty (give a size such as 6Gi, 512Mi or 4G)".into(),
        ),
        (
            vec!["--memory", "0"],
            "error: --memory 0: a memory limit must be more than 0 bytes".into(),
        ),
        (
            vec!["--memory", "lots"],
            "error: --memory lots: not a size (a number with an optional unit, such as 6Gi, \
             512Mi or 4G)"
                .into(),
        ),
        (
            vec!["--memory-per-device", "0=1Gi,0=2Gi"],
            "error: --memory-per-device 0=1Gi,0=2Gi: device 0 is given twice".into(),
        ),
        (
            vec!["--memory-per-device", "1=1Gi", "--sim", "single"],
            "error: --memory-per-device: GPU 1 does not exist (the single simulator has only \
             GPU 0)"
                .into(),
        ),
        (
            vec!["--memory", "1Gi", "--sim", "dgx9"],
            "error: --sim dgx9: no such simulator preset".into(),
        ),
        (
            vec!["--memory", "1Gi", "--memory-per-device", "0=1Gi"],
            "cannot be used with".into(),
        ),
        (
            vec![],
            "error: give a quota: --memory SIZE, --memory-per-device ORDINAL=SIZE,..., or \
             --compute POLICY"
                .into(),
        ),
        (
            vec!["--memory", "1Gi", "--library", "/nonexistent/libcuvisor.so"],
            "error: --library /nonexistent/libcuvisor.so: no such file".into(),
        ),
    ];
    for (flags, want) in cases {
        let mut args = vec!["run"];
        args.extend(flags);
        args.extend(["--", "sh", "-c", &touch]);
        let ran = cuvisor(&args, &scratch, &[]).exits(2);
        assert!(
            ran.stderr().contains(&want),
            "want {want:?}\n{}",
            ran.show()
        );
        assert_eq!(ran.stdout(), "");
        assert!(!marker.exists(), "the command ran:\n{}", ran.show());
    }
    // "4G" is fine: 4e9 bytes.
    cuvisor(&["run", "--memory", "4G", "--", "true"], &scratch, &[]).exits(0);
    assert_eq!(scratch.leftovers(), Vec::<PathBuf>::new());
}

/// A cuvisor binary without the library beside it says so, and how to build it (exit 1).
#[test]
fn a_missing_library_is_a_clear_error() {
    let scratch = Scratch::new("no-lib");
    let lonely = scratch.path("bin/cuvisor");
    std::fs::create_dir_all(lonely.parent().unwrap()).unwrap();
    std::fs::copy(EXE, &lonely).unwrap();
    let marker = scratch.path("ran");
    let out = Command::new(&lonely)
        .args(["run", "--memory", "1Gi", "--", "touch"])
        .arg(&marker)
        .env("TMPDIR", scratch.tmp())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.starts_with("error: the interception library is not built: neither ")
            && err.contains("libcuvisor.so")
            && err.contains("`cargo build`"),
        "{err}"
    );
    assert!(!marker.exists());
}

fn python3_present() -> bool {
    Command::new("python3")
        .args(["-c", "pass"])
        .status()
        .is_ok_and(|s| s.success())
}

/// Makes the simulator's next `count` allocations on GPU 0 fail, in state file `state`.
fn fail_next_allocations(scratch: &Scratch, state: &Path, count: &str) {
    cuvisor(
        &["sim", "fault", "fail-alloc", "--gpu", "0", "--count", count],
        scratch,
        &[
            ("CUVISOR_SIM", "single"),
            ("CUVISOR_SIM_STATE", state.to_str().unwrap()),
        ],
    )
    .exits(0);
}

/// The twin is no rubber stamp: an allocation the driver refuses below the quota fails it.
#[test]
fn the_twin_fails_when_an_allocation_below_the_quota_is_refused() {
    let scratch = Scratch::new("twin-fault");
    let state = scratch.path("sim.state");
    fail_next_allocations(&scratch, &state, "1");
    let ran = cuvisor(
        &[
            "run",
            "--memory",
            "6Gi",
            "--sim",
            "single",
            "--state",
            state.to_str().unwrap(),
            "--",
            twin().to_str().unwrap(),
        ],
        &scratch,
        &[],
    )
    .exits(1);
    let out = ran.stdout();
    assert!(
        fraction_line(&out, "0.30").starts_with(
            "fraction 0.30: FAIL: 1843 MiB refused with CUDA_ERROR_OUT_OF_MEMORY (expected success)"
        ),
        "{out}"
    );
    assert!(fraction_line(&out, "0.50").ends_with("ok"), "{out}");
    assert!(out.ends_with("twin: FAIL (1 of 6 checks)\n"), "{out}");
}

/// examples/tf_stress/tf_stress.py's own logic (a process per fraction, the table, the exit
/// status), on the simulator under cuvisor, with a stand-in for TensorFlow
/// (tests/fakes: one cuMemAlloc per tensor, small ones in a 2 MiB region taken first) since CI
/// has no TensorFlow. TensorFlow itself runs it in `scripts/frameworks.sh --only tf`.
#[test]
fn tf_stress_py_runs_its_table_with_a_stand_in_tensorflow() {
    if !python3_present() {
        eprintln!("python3 not found: this test did not run");
        return;
    }
    let scratch = Scratch::new("tf-stress");
    let fake = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fakes");
    let script =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/tf_stress/tf_stress.py");
    let state = scratch.path("sim.state");
    let run = |scratch: &Scratch| {
        cuvisor(
            &[
                "run",
                "--memory",
                "6Gi",
                "--sim",
                "single",
                "--state",
                state.to_str().unwrap(),
                "--",
                "python3",
                script.to_str().unwrap(),
            ],
            scratch,
            &[
                ("PYTHONPATH", fake.to_str().unwrap()),
                // No __pycache__ in the source tree.
                ("PYTHONDONTWRITEBYTECODE", "1"),
            ],
        )
    };
    let ran = run(&scratch).exits(0);
    let out = ran.stdout();
    assert!(
        out.starts_with("GPU 0: total 6144 MiB, free 6142 MiB (cuMemGetInfo"),
        "free after TensorFlow's first 2 MiB region: {}",
        ran.show()
    );
    for (f, mib) in [
        ("0.30", 1842),
        ("0.50", 3071),
        ("0.80", 4913),
        ("1.00", 6142),
    ] {
        assert_eq!(
            fraction_line(&out, f),
            format!("fraction {f}: allocated {mib} MiB ok")
        );
    }
    assert!(
        fraction_line(&out, "1.20")
            .starts_with("fraction 1.20: failed cleanly: ResourceExhaustedError: OOM"),
        "{out}"
    );
    assert!(out.ends_with("tf_stress: PASS\n"), "{out}");

    // A refusal below the quota fails it.
    fail_next_allocations(&scratch, &state, "1");
    let ran = run(&scratch).exits(1);
    let out = ran.stdout();
    assert!(
        fraction_line(&out, "0.30")
            .starts_with("fraction 0.30: FAIL: 1843 MiB refused: ResourceExhaustedError"),
        "{out}"
    );
    assert!(out.ends_with("tf_stress: FAIL (1 of 5)\n"), "{out}");
}

/// scripts/gpu-check.sh's own logic (environment, one process per check, the rows, the table,
/// the exit status) on the simulator, with stand-ins for PyTorch and JAX (tests/fakes): all
/// rows pass with the library, and all fail without it (a library that enforces nothing).
#[test]
fn gpu_check_sh_runs_its_table_on_the_simulator_with_stand_ins() {
    if !python3_present() {
        eprintln!("python3 not found: this test did not run");
        return;
    }
    let scratch = Scratch::new("gpu-check");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/gpu-check.sh");
    let fakes = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fakes");
    let sim = built().join("sim");
    let check = |lib: &Path| {
        let out = Command::new("bash")
            .arg(&script)
            .args(["--quota", "4Gi", "--lib"])
            .arg(lib)
            .env("TMPDIR", scratch.tmp())
            .env("PYTHONPATH", &fakes)
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .env("LD_LIBRARY_PATH", &sim)
            .env("CUVISOR_SIM", "single")
            .env("CUVISOR_SIM_STATE", scratch.path("sim.state"))
            .env_remove("LD_PRELOAD")
            .env_remove("CUVISOR_CONFIG")
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let rows = [
        "torch: native allocator",
        "torch: expandable_segments",
        "torch: cudaMallocAsync",
        "torch: mem_get_info",
        "torch: device total_memory",
        "jax: preallocation (75%)",
        "twin (cuGetProcAddress_v2)",
        "twin (dlsym)",
    ];
    let (code, out, err) = check(&built().join("deps/libcuvisor.so"));
    assert_eq!(code, Some(0), "{out}{err}");
    for name in rows {
        let line = out
            .lines()
            .find(|l| l.starts_with(name))
            .unwrap_or_else(|| panic!("no row {name}:\n{out}"));
        assert!(line.ends_with("  PASS"), "{line}");
    }
    assert!(
        out.contains("OutOfMemoryError after 4.00 GiB (100.0%)"),
        "{out}"
    );
    assert!(
        out.contains("bytes_limit 3.00 GiB (75.0% of quota)"),
        "{out}"
    );
    assert!(out.ends_with("gpu-check: all 8 checks passed\n"), "{out}");
    assert_eq!(scratch.leftovers(), Vec::<PathBuf>::new());

    // Preloading something that is not cuvisor: every row fails, the logs are kept.
    let (code, out, err) = check(&built().join("sim/libnvidia-ml.so.1"));
    assert_eq!(code, Some(1), "{out}{err}");
    for name in rows {
        let line = out.lines().find(|l| l.starts_with(name)).unwrap();
        assert!(line.ends_with("  FAIL"), "{line}");
    }
    assert!(out.contains("gpu-check: 8 of 8 checks FAILED"), "{out}");
    assert_eq!(scratch.leftovers().len(), 1, "the kept work directory");
}

/// The probe's ledger reader (scripts/gpu_check_probe.py) reads what the Rust layout holds.
#[test]
fn the_probes_ledger_reader_matches_the_ledger() {
    if !python3_present() {
        eprintln!("python3 not found: this test did not run");
        return;
    }
    let scratch = Scratch::new("probe-ledger");
    let state = scratch.path("state");
    cuvisor(
        &[
            "run",
            "--memory",
            "6Gi",
            "--sim",
            "dgx1-v100",
            "--state-dir",
            state.to_str().unwrap(),
            "--",
            twin().to_str().unwrap(),
            "--device",
            "3",
        ],
        &scratch,
        &[],
    )
    .exits(0);
    let ledger = ledger_of(&state);
    let want: String = ledger
        .devices()
        .map(|(_, _, e)| {
            format!(
                "limit {} used {} peak {} denied {}\n",
                e.limit.load(Acquire),
                e.used_bytes(),
                e.peak.load(Acquire),
                e.denied.load(Acquire)
            )
        })
        .collect();
    assert!(want.starts_with("limit 6442450944 used 0 peak 6442450944 denied 1\n"));
    let probe = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/gpu_check_probe.py");
    let out = Command::new("python3")
        .arg(&probe)
        .arg("ledger")
        .arg(&state)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout), want);
}

/// A shared object that leaves one symbol to be found at load time, which no library has:
/// ld.so would preload it lazily and run the command; dlopen(RTLD_NOW) refuses it.
fn library_with_a_missing_symbol(scratch: &Scratch) -> PathBuf {
    let src = scratch.path("missing.c");
    std::fs::write(
        &src,
        "void cuvisor_test_missing(void);\nvoid cuvisor_test_f(void) { cuvisor_test_missing(); }\n",
    )
    .unwrap();
    let out = scratch.path("missing.so");
    let ok = Command::new("cc")
        .args(["-shared", "-fPIC", "-o"])
        .arg(&out)
        .arg(&src)
        .status()
        .expect("run cc")
        .success();
    assert!(ok, "compiling {}", src.display());
    out
}

/// The attack: `cuvisor run --library /etc/hostname -- CMD` ran CMD with no quota and exit 0
/// (ld.so skips a preload it cannot load, says so on stderr and runs the program anyway). Now
/// anything that is not a shared object of this machine that loads (RTLD_NOW) is refused, in
/// one line that names it and why, before anything runs or is made.
#[test]
fn library_etc_hostname_is_refused_instead_of_running_without_a_quota() {
    let scratch = Scratch::new("bad-library");
    let marker = scratch.path("ran");
    let touch = format!("touch {}", marker.display());
    let real = std::fs::read(built().join("deps/libcuvisor.so")).unwrap();
    // libcuvisor.so's ELF header with one 16-bit field changed (in this machine's byte order,
    // which the header has).
    let patched = |name: &str, at: usize, value: u16| {
        let mut head = real[..64].to_vec();
        head[at..at + 2].copy_from_slice(&value.to_ne_bytes());
        let p = scratch.path(name);
        std::fs::write(&p, head).unwrap();
        p
    };
    let hostname = scratch.path("hostname");
    std::fs::write(&hostname, "buildhost\n").unwrap();
    let dir = scratch.path("dir.so");
    std::fs::create_dir(&dir).unwrap();
    let fifo = scratch.path("fifo.so");
    mkfifo(&fifo);
    let (other, other_name) = if cfg!(target_arch = "arm") {
        (62, "x86-64")
    } else {
        (40, "ARM")
    };
    let short = scratch.path("short.so");
    std::fs::write(&short, &real[..64]).unwrap();
    let mut cases: Vec<(PathBuf, String)> = vec![
        (hostname, "not an ELF file, so not a shared library".into()),
        (dir, "is a directory, not a regular file".into()),
        (fifo, "is a FIFO, not a regular file".into()),
        (
            patched("exec.so", 16, 2),
            "an executable (ET_EXEC), not a shared object (ET_DYN)".into(),
        ),
        (
            patched("other-arch.so", 18, other),
            format!("a shared object for {other_name} (ELF machine {other}); this machine is "),
        ),
        // A good ELF header and nothing behind it.
        (short, "does not load: ".into()),
        (
            library_with_a_missing_symbol(&scratch),
            "does not load: undefined symbol: cuvisor_test_missing".into(),
        ),
        // A library that loads but is not libcuvisor (the simulator's NVML): it too would run
        // the command with no quota. (Found by review.)
        (
            built().join("sim/libnvidia-ml.so.1"),
            "loads, but is not libcuvisor".into(),
        ),
    ];
    if std::fs::read("/etc/hostname").is_ok_and(|h| !h.starts_with(b"\x7fELF")) {
        cases.push((
            "/etc/hostname".into(),
            "not an ELF file, so not a shared library".into(),
        ));
    }
    for (library, why) in cases {
        let lib = library.to_str().unwrap();
        let ran = cuvisor_within(
            std::time::Duration::from_secs(20),
            &[
                "run",
                "--memory",
                "1Gi",
                "--library",
                lib,
                "--",
                "sh",
                "-c",
                &touch,
            ],
            &scratch,
            &[],
        )
        .exits(2);
        let err = ran.stderr();
        assert!(
            err.starts_with(&format!("error: --library {lib}: {why}")) && err.lines().count() == 1,
            "want one line \"error: --library {lib}: {why}...\"\n{}",
            ran.show()
        );
        assert!(!marker.exists(), "the command ran:\n{}", ran.show());
        assert_eq!(scratch.leftovers(), Vec::<PathBuf>::new());
    }

    // The library found beside cuvisor is checked too (exit 1: cuvisor's own install is bad).
    let lonely = scratch.path("bin/cuvisor");
    std::fs::create_dir_all(lonely.parent().unwrap()).unwrap();
    std::fs::copy(EXE, &lonely).unwrap();
    let beside = scratch.path("bin/libcuvisor.so");
    std::fs::write(&beside, "not a library\n").unwrap();
    let out = Command::new(&lonely)
        .args(["run", "--memory", "1Gi", "--", "sh", "-c", &touch])
        .env("TMPDIR", scratch.tmp())
        .env_remove("LD_PRELOAD")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert_eq!(
        err,
        format!(
            "error: the interception library {}: not an ELF file, so not a shared library\n",
            beside.display()
        )
    );
    assert!(!marker.exists());
}

/// The attack: a libcuvisor.so built on a newer machine than the one it is used on (the issue:
/// built on glibc 2.36, it needs GLIBC_2.34; Ubuntu 20.04 has 2.31). dlerror's answer,
/// "version `GLIBC_2.34' not found", names neither glibc; the refusal names both, in one line,
/// and nothing runs. Made here from the built library with its newest needed GLIBC_ version
/// string rewritten in place (same length, digits made 9s: GLIBC_2.34 -> GLIBC_9.99), which no
/// glibc defines.
#[test]
fn library_needing_a_newer_glibc_is_refused_naming_both_versions() {
    let scratch = Scratch::new("newer-glibc");
    let marker = scratch.path("ran");
    let touch = format!("touch {}", marker.display());
    let mut lib = std::fs::read(built().join("deps/libcuvisor.so")).unwrap();
    let needs = cuvisor_elf_needs::parse(&lib).unwrap();
    let (_, newest) = needs.newest_glibc_needed().expect("it needs some glibc");
    let (file, from) = (newest.file.clone(), newest.version.clone());
    let to: String = from
        .chars()
        .enumerate()
        .map(|(i, c)| if i >= 6 && c.is_ascii_digit() { '9' } else { c })
        .collect();
    let (from_z, to_z) = (format!("{from}\0"), format!("{to}\0"));
    let mut rewritten = 0;
    let mut at = 0;
    while let Some(p) = lib[at..]
        .windows(from_z.len())
        .position(|w| w == from_z.as_bytes())
    {
        let start = at + p;
        lib[start..start + to_z.len()].copy_from_slice(to_z.as_bytes());
        rewritten += 1;
        at = start + to_z.len();
    }
    assert!(rewritten > 0, "{from} not found in the library");
    let newer = scratch.path("libcuvisor-newer.so");
    std::fs::write(&newer, &lib).unwrap();
    assert_eq!(
        cuvisor_elf_needs::parse(&lib)
            .unwrap()
            .newest_glibc_needed()
            .map(|(_, n)| n.version.clone()),
        Some(to.clone())
    );
    let lib = newer.to_str().unwrap();
    let ran = cuvisor_within(
        std::time::Duration::from_secs(20),
        &[
            "run",
            "--memory",
            "1Gi",
            "--library",
            lib,
            "--",
            "sh",
            "-c",
            &touch,
        ],
        &scratch,
        &[],
    )
    .exits(2);
    let want = format!(
        "error: --library {lib}: needs glibc {} ({to} of {file}); the command's libc is glibc {}\n",
        &to[6..],
        cuvisor_testkit::glibc_here()
    );
    assert_eq!(ran.stderr(), want, "{}", ran.show());
    assert!(!marker.exists(), "the command ran:\n{}", ran.show());
    assert_eq!(scratch.leftovers(), Vec::<PathBuf>::new());
}

/// The attack: `--sim FIFO` (a machine file that is a FIFO) hung `cuvisor run` in its read. A
/// machine file must be a regular file of at most 1 MiB: anything else is refused at once,
/// and nothing runs.
#[test]
fn sim_model_file_that_is_a_fifo_is_refused_instead_of_hanging() {
    let scratch = Scratch::new("sim-fifo");
    let marker = scratch.path("ran");
    let touch = format!("touch {}", marker.display());
    let fifo = scratch.path("model.toml");
    mkfifo(&fifo);
    let dir = scratch.path("dir.toml");
    std::fs::create_dir(&dir).unwrap();
    let huge = scratch.path("huge.toml");
    std::fs::write(&huge, format!("{}\n", "#".repeat(1 << 20))).unwrap();
    for (model, why) in [
        (
            &fifo,
            "is a FIFO, not a machine file (a regular .toml/.json file)",
        ),
        (
            &dir,
            "is a directory, not a machine file (a regular .toml/.json file)",
        ),
        (
            &huge,
            "holds more than 1048576 bytes (1048577): not a machine file",
        ),
    ] {
        let m = model.to_str().unwrap();
        let ran = cuvisor_within(
            std::time::Duration::from_secs(10),
            &[
                "run", "--memory", "1Gi", "--sim", m, "--", "sh", "-c", &touch,
            ],
            &scratch,
            &[],
        )
        .exits(2);
        assert_eq!(ran.stderr(), format!("error: --sim {m}: {m} {why}\n"));
        assert!(!marker.exists(), "the command ran:\n{}", ran.show());
    }
    // A machine file that is a plain file still works.
    let good = scratch.path("one.toml");
    std::fs::write(&good, "[[device]]\nmemory = '8Gi'\n").unwrap();
    cuvisor(
        &[
            "run",
            "--memory",
            "1Gi",
            "--sim",
            good.to_str().unwrap(),
            "--",
            "sh",
            "-c",
            &touch,
        ],
        &scratch,
        &[],
    )
    .exits(0);
    assert!(marker.exists());
    assert_eq!(scratch.leftovers(), Vec::<PathBuf>::new());
}

/// `<path>.coord`, where a coordinator beside `path` would be.
fn coord_beside(path: &Path) -> PathBuf {
    PathBuf::from(format!("{}.coord", path.display()))
}

/// The attack: `--state` naming a FIFO, a device or a directory (and before it, the same in
/// CUVISOR_SIM_STATE). Each is refused at once with the reason, never read, and nothing is made
/// beside it.
#[test]
fn state_that_is_a_fifo_device_or_directory_is_refused_without_hanging() {
    let scratch = Scratch::new("state-special");
    let marker = scratch.path("ran");
    let touch = format!("touch {}", marker.display());
    let fifo = scratch.path("fifo");
    mkfifo(&fifo);
    let dir = scratch.path("dir");
    std::fs::create_dir(&dir).unwrap();
    for (state, kind) in [
        (fifo.as_path(), "a FIFO"),
        (Path::new("/dev/zero"), "a character device"),
        (dir.as_path(), "a directory"),
    ] {
        let s = state.to_str().unwrap();
        let why =
            format!("is {kind}, not a regular file; give a simulator state file or a new path");
        let ran = cuvisor_within(
            std::time::Duration::from_secs(10),
            &[
                "run", "--memory", "1Gi", "--sim", "single", "--state", s, "--", "sh", "-c", &touch,
            ],
            &scratch,
            &[],
        )
        .exits(2);
        assert_eq!(ran.stderr(), format!("error: --state {s}: {why}\n"));
        let ran = cuvisor_within(
            std::time::Duration::from_secs(10),
            &[
                "run", "--memory", "1Gi", "--sim", "single", "--", "sh", "-c", &touch,
            ],
            &scratch,
            &[("CUVISOR_SIM_STATE", s)],
        )
        .exits(2);
        assert_eq!(
            ran.stderr(),
            format!("error: CUVISOR_SIM_STATE={s}: {why}\n")
        );
        assert!(!marker.exists(), "the command ran:\n{}", ran.show());
        assert!(!coord_beside(state).exists(), "made {s}.coord");
    }
    assert_eq!(scratch.leftovers(), Vec::<PathBuf>::new());
}

/// Creates the simulator's state file `state` for `model`, as any process on the simulator does.
fn make_state(scratch: &Scratch, model: &str, state: &Path) {
    cuvisor(
        &["sim", "fault", "fail-alloc", "--gpu", "0", "--count", "0"],
        scratch,
        &[
            ("CUVISOR_SIM", model),
            ("CUVISOR_SIM_STATE", state.to_str().unwrap()),
        ],
    )
    .exits(0);
    assert!(state.is_file());
}

/// The attack: `--state /etc/passwd` made /etc/passwd.coord. cuvisor creates nothing beside a
/// file that is not a simulator state file: a --state (or CUVISOR_SIM_STATE) that exists must
/// be one, of this machine model, not reached through a symbolic link, and a `.coord` that is
/// not a directory is not followed. Runs on one real state file still share its coordinator.
#[test]
fn state_etc_passwd_gets_nothing_made_beside_it() {
    let scratch = Scratch::new("state-passwd");
    let marker = scratch.path("ran");
    let touch = format!("touch {}", marker.display());
    let run = |state: &Path, cmd: &str| {
        cuvisor(
            &[
                "run",
                "--memory",
                "1Gi",
                "--sim",
                "single",
                "--state",
                state.to_str().unwrap(),
                "--",
                "sh",
                "-c",
                cmd,
            ],
            &scratch,
            &[],
        )
    };
    let passwd = scratch.path("passwd");
    std::fs::write(&passwd, "root:x:0:0:root:/root:/bin/bash\n").unwrap();
    let empty = scratch.path("empty");
    std::fs::write(&empty, "").unwrap();
    let other_model = scratch.path("dgx.state");
    make_state(&scratch, "dgx1-v100", &other_model);
    let real = scratch.path("gpu");
    make_state(&scratch, "single", &real);
    let link = scratch.path("link");
    std::os::unix::fs::symlink(&real, &link).unwrap();
    let not_ours = "exists and is not a cuvisor simulator state file: refused, so that nothing \
                    is made beside it (give a new path, or one a simulated run made)";
    for (state, why) in [
        (&passwd, not_ours.to_string()),
        (&empty, not_ours.to_string()),
        (
            &other_model,
            "the state of another simulated machine, not single (give a new path, or remove it)"
                .into(),
        ),
        (
            &link,
            "is a symbolic link, not a regular file; give a simulator state file or a new path"
                .into(),
        ),
    ] {
        let ran = run(state, &touch).exits(2);
        assert_eq!(
            ran.stderr(),
            format!("error: --state {}: {why}\n", state.display())
        );
        assert!(!marker.exists(), "the command ran:\n{}", ran.show());
        assert!(!coord_beside(state).exists(), "{}", ran.show());
    }
    // The same for the environment's state file.
    let ran = cuvisor(
        &[
            "run", "--memory", "1Gi", "--sim", "single", "--", "sh", "-c", &touch,
        ],
        &scratch,
        &[("CUVISOR_SIM_STATE", passwd.to_str().unwrap())],
    )
    .exits(2);
    assert_eq!(
        ran.stderr(),
        format!(
            "error: CUVISOR_SIM_STATE={}: {not_ours}\n",
            passwd.display()
        )
    );
    assert!(!coord_beside(&passwd).exists());

    // A `.coord` beside a real state file that is a symbolic link (to a directory) is refused.
    let planted = scratch.path("planted");
    let planted_state = scratch.path("planted.state");
    make_state(&scratch, "single", &planted_state);
    std::fs::create_dir(&planted).unwrap();
    std::os::unix::fs::symlink(&planted, coord_beside(&planted_state)).unwrap();
    let ran = run(&planted_state, &touch).exits(1);
    assert_eq!(
        ran.stderr(),
        format!(
            "error: the simulated GPU's coordinator directory {}: is a symbolic link, not a \
             directory\n",
            coord_beside(&planted_state).display()
        )
    );
    assert!(!marker.exists());
    assert_eq!(std::fs::read_dir(&planted).unwrap().count(), 0);

    // A real state file, and one not made yet: two runs side by side get one coordinator
    // beside it.
    let show = "echo \"$CUVISOR_COORD_DIR\"; test -d \"$CUVISOR_COORD_DIR\"; sleep 0.5";
    for state in [real.clone(), scratch.path("new-gpu")] {
        let spawn = || {
            command(
                &[
                    "run",
                    "--memory",
                    "1Gi",
                    "--sim",
                    "single",
                    "--state",
                    state.to_str().unwrap(),
                    "--",
                    "sh",
                    "-c",
                    show,
                ],
                &scratch,
                &[],
            )
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
        };
        let (a, b) = (spawn(), spawn());
        for side in [a, b] {
            let out = side.wait_with_output().unwrap();
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            assert_eq!(
                String::from_utf8_lossy(&out.stdout),
                format!("{}\n", coord_beside(&state).display())
            );
        }
        assert!(coord_beside(&state).is_dir());
    }
    assert_eq!(scratch.leftovers(), Vec::<PathBuf>::new());
}

/// Whether `pid` is a live process running `comm`: a zombie has ended, and a pid that another
/// program now has is not it.
fn alive(pid: i32, comm: &str) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    // "PID (COMM) STATE ..."
    let Some((head, rest)) = stat.rsplit_once(") ") else {
        return false;
    };
    head.ends_with(&format!("({comm}")) && !rest.starts_with(['Z', 'X'])
}

/// Polls `cond` every 10 ms for up to `limit`; whether it came true.
fn soon(limit: std::time::Duration, cond: impl Fn() -> bool) -> bool {
    let started = std::time::Instant::now();
    loop {
        if cond() {
            return true;
        }
        if started.elapsed() > limit {
            return false;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// `cuvisor run --memory 1Gi -- sh -c 'echo $$; exec sleep 30'`, once the command is `sleep`:
/// cuvisor and the command's pid.
fn run_sleeping(scratch: &Scratch) -> (std::process::Child, i32) {
    let mut child = command(
        &[
            "run",
            "--memory",
            "1Gi",
            "--",
            "sh",
            "-c",
            "echo $$; exec sleep 30",
        ],
        scratch,
        &[],
    )
    .stdout(Stdio::piped())
    .spawn()
    .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let pid: i32 = line.trim().parse().unwrap();
    assert!(
        soon(std::time::Duration::from_secs(5), || alive(pid, "sleep")),
        "the command never became sleep"
    );
    (child, pid)
}

/// SIGKILLs cuvisor and waits for it.
fn sigkill(mut cuvisor: std::process::Child) {
    // SAFETY: plain kill(2) of our own child.
    assert_eq!(unsafe { libc::kill(cuvisor.id() as i32, libc::SIGKILL) }, 0);
    cuvisor.wait().unwrap();
}

/// The attack: SIGKILL of `cuvisor run` (which can pass nothing on) left its command running,
/// under no cuvisor at all. The command now dies with it (PR_SET_PDEATHSIG), within a second.
#[test]
fn sigkill_of_cuvisor_run_kills_its_command_within_a_second() {
    let scratch = Scratch::new("sigkill");
    let (cuvisor, pid) = run_sleeping(&scratch);
    sigkill(cuvisor);
    let gone = soon(std::time::Duration::from_secs(1), || !alive(pid, "sleep"));
    if !gone {
        // SAFETY: plain kill(2); it is the sleep this test started.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    assert!(gone, "the command (pid {pid}) outlived cuvisor by a second");
}

/// The attack: SIGHUP (a closed terminal, a restarted session) killed `cuvisor run` and left
/// its command running and its temporary directory behind; SIGQUIT, SIGUSR1 and SIGUSR2 did
/// the same. Each now reaches the command, which decides how to end; cuvisor exits with its
/// status and removes its temporary state.
#[test]
fn sighup_of_cuvisor_run_reaches_the_command_and_the_scratch_is_removed() {
    let scratch = Scratch::new("sighup");
    for (sig, name, code) in [
        (libc::SIGHUP, "HUP", 44),
        (libc::SIGQUIT, "QUIT", 45),
        (libc::SIGUSR1, "USR1", 46),
        (libc::SIGUSR2, "USR2", 47),
    ] {
        signal_reaches_the_command(&scratch, sig, name, code);
    }
}

/// The attack's leftovers: a SIGKILLed `cuvisor run` cannot remove its temporary directory.
/// The next run does (its owner's lock is free), and nothing else: not a live run's, not a
/// --keep-state one's, not one without the lock, not one of another name, not a symbolic link
/// or what it leads to, not another user's.
#[test]
fn scratch_of_a_sigkilled_run_is_removed_by_the_next_run() {
    let scratch = Scratch::new("stale");
    let tmp = scratch.tmp();
    let (killed, pid) = run_sleeping(&scratch);
    let left = scratch.leftovers();
    assert_eq!(left.len(), 1, "{left:?}");
    let stale = left[0].clone();
    assert!(stale.join(".cuvisor-run.lock").is_file());
    sigkill(killed);
    assert!(soon(std::time::Duration::from_secs(1), || !alive(
        pid, "sleep"
    )));
    assert!(stale.is_dir(), "a SIGKILLed cuvisor cleaned up");

    // A live run.
    let mut live = command(
        &[
            "run",
            "--memory",
            "1Gi",
            "--",
            "sh",
            "-c",
            "trap 'exit 0' TERM; echo ready; i=0; while [ $i -lt 100 ]; do sleep 0.1; \
             i=$((i+1)); done",
        ],
        &scratch,
        &[],
    )
    .stdout(Stdio::piped())
    .spawn()
    .unwrap();
    let mut ready = String::new();
    BufReader::new(live.stdout.take().unwrap())
        .read_line(&mut ready)
        .unwrap();
    assert_eq!(ready, "ready\n");
    let live_dir: Vec<PathBuf> = scratch
        .leftovers()
        .into_iter()
        .filter(|p| *p != stale)
        .collect();
    assert_eq!(live_dir.len(), 1, "{live_dir:?}");
    // A kept one.
    let ran = cuvisor(
        &["run", "--memory", "1Gi", "--keep-state", "--", "true"],
        &scratch,
        &[],
    )
    .exits(0);
    let kept = PathBuf::from(ran.stderr().trim().strip_prefix("cuvisor: kept ").unwrap());
    // Look-alikes, each with a lock nobody holds.
    let lookalike = |name: &str| {
        let d = tmp.join(name);
        std::fs::create_dir(&d).unwrap();
        std::fs::write(d.join(".cuvisor-run.lock"), "").unwrap();
        d
    };
    let no_lock = tmp.join("cuvisor-run-nolock");
    std::fs::create_dir(&no_lock).unwrap();
    let long_name = lookalike("cuvisor-run-toolong");
    let elsewhere = lookalike("../elsewhere");
    std::fs::write(elsewhere.join("precious"), "x").unwrap();
    let link = tmp.join("cuvisor-run-link01");
    std::os::unix::fs::symlink(&elsewhere, &link).unwrap();
    // SAFETY: geteuid has no preconditions.
    let others = if unsafe { libc::geteuid() } == 0 {
        let d = lookalike("cuvisor-run-other1");
        std::os::unix::fs::chown(&d, Some(65534), Some(65534)).unwrap();
        Some(d)
    } else {
        eprintln!("not root: the part with another user's directory did not run");
        None
    };

    // The next run.
    cuvisor(&["run", "--memory", "1Gi", "--", "true"], &scratch, &[]).exits(0);
    assert!(!stale.exists(), "the dead run's directory is still there");
    for kept in [&live_dir[0], &kept, &no_lock, &long_name, &elsewhere]
        .into_iter()
        .chain(others.as_ref())
    {
        assert!(kept.is_dir(), "{} was removed", kept.display());
    }
    assert!(std::fs::symlink_metadata(&link).unwrap().is_symlink());
    assert!(elsewhere.join("precious").is_file());

    // The live run ends and removes its own.
    // SAFETY: plain kill(2) of our own child.
    assert_eq!(unsafe { libc::kill(live.id() as i32, libc::SIGTERM) }, 0);
    assert_eq!(live.wait().unwrap().code(), Some(0));
    assert!(!live_dir[0].exists());
}

/// Attack: `cuvisor run --state-dir D --memory 8Gi` on a directory an earlier `--memory 1Gi`
/// made was held to 1 GiB without a word (the ledger keeps the limit it was made with). Now,
/// with no live holder the new limits apply (a fresh ledger); while a process holds the ledger
/// under other limits the run is refused with one line naming it and both limits; the same
/// limits join it; once it is gone the new ones apply.
#[test]
fn a_state_dir_of_other_limits_gets_the_new_ones_or_a_refusal_naming_the_holder() {
    let scratch = Scratch::new("state-dir-limits");
    let state = scratch.path("state");
    let s = state.to_str().unwrap();
    let twin = twin().to_str().unwrap();
    let run = |memory: &str, cmd: &[&str]| {
        let mut args = vec![
            "run",
            "--memory",
            memory,
            "--sim",
            "single",
            "--state-dir",
            s,
            "--",
        ];
        args.extend_from_slice(cmd);
        args.into_iter().map(String::from).collect::<Vec<_>>()
    };
    let go = |args: &[String]| {
        let a: Vec<&str> = args.iter().map(String::as_str).collect();
        cuvisor(&a, &scratch, &[])
    };
    let limits = |state: &Path| -> Vec<u64> {
        ledger_of(state)
            .devices()
            .map(|(_, _, e)| e.limit.load(Acquire))
            .collect()
    };
    let ran = go(&run("1Gi", &[twin])).exits(0);
    assert_twin_table(&ran.stdout(), 1024);
    let ran = go(&run("8Gi", &[twin])).exits(0);
    assert_twin_table(&ran.stdout(), 8 * 1024);
    assert_eq!(limits(&state), vec![8 << 30]);

    // A live holder under 8 GiB: a command that loaded the library and sleeps.
    let holder_args = run("8Gi", &["sleep", "30"]);
    let a: Vec<&str> = holder_args.iter().map(String::as_str).collect();
    let mut holder = command(&a, &scratch, &[])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let t0 = std::time::Instant::now();
    while !cuvisor_shm::ledger::any_alive(&state).unwrap_or(false) {
        assert!(
            t0.elapsed().as_secs() < 10,
            "the holder never took the ledger"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let pids: Vec<u32> = ledger_of(&state).live_procs().map(|(p, _)| p).collect();
    assert_eq!(pids.len(), 1);
    let ran = go(&run("1Gi", &[twin])).exits(1);
    assert_eq!(ran.stdout(), "", "the command ran");
    let err = ran.stderr();
    assert_eq!(err.lines().count(), 1, "{}", ran.show());
    for want in [
        format!("error: --state-dir {s}: in use by "),
        format!("process {}", pids[0]),
        "under other limits (memory = 8589934592, compute = default".into(),
        "not this run's (memory = 1073741824, compute = default)".into(),
    ] {
        assert!(err.contains(&want), "{want:?} not in {}", ran.show());
    }
    // The same limits join it.
    let ran = go(&run("8Gi", &[twin])).exits(0);
    assert_twin_table(&ran.stdout(), 8 * 1024);
    holder.kill().unwrap();
    holder.wait().unwrap();
    // Gone: the new limits apply.
    let t0 = std::time::Instant::now();
    while cuvisor_shm::ledger::any_alive(&state).unwrap_or(true) {
        assert!(t0.elapsed().as_secs() < 10, "the holder's lease stayed");
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let ran = go(&run("1Gi", &[twin])).exits(0);
    assert_twin_table(&ran.stdout(), 1024);
    assert_eq!(limits(&state), vec![1 << 30]);
    // The directory and what cuvisor made in it are this user's alone.
    use std::os::unix::fs::MetadataExt as _;
    for p in [state.clone(), state.join(FILE_NAME)] {
        assert_eq!(
            std::fs::metadata(&p).unwrap().mode() & 0o077,
            0,
            "{}",
            p.display()
        );
    }
}
