//! Compute policies through the CLI, end to end on the simulated GPU: `cuvisor run --compute`
//! (its usage errors, the environment the command gets, the simulated GPU's coordinator beside
//! its state file) and `cuvisor sim load` run under it, whose shares are read from its own
//! output (the simulator's per-process busy time).
//!
//! The timed tests hold one lock, so that they do not compete for the CPU on small machines.

use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::Mutex;

mod support;
use support::*;

static SERIAL: Mutex<()> = Mutex::new(());

/// `cuvisor run --sim single --state STATE --compute POLICY -- cuvisor sim load LOAD...`,
/// started (not waited for).
fn spawn_load(scratch: &Scratch, state: &Path, policy: &str, load: &[&str]) -> (Child, String) {
    let mut args = vec![
        "run",
        "--sim",
        "single",
        "--state",
        state.to_str().unwrap(),
        "--compute",
        policy,
        "--",
        EXE,
        "sim",
        "load",
    ];
    args.extend_from_slice(load);
    let child = command(&args, scratch, &[])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start cuvisor run");
    (child, args.join(" "))
}

fn finish((child, args): (Child, String)) -> Ran {
    Ran {
        out: child.wait_with_output().unwrap(),
        args,
    }
    .exits(0)
}

/// What `sim load` printed: the interval rows as (elapsed s, kernels/s, share %), and the
/// average share of the summary line.
struct Load {
    rows: Vec<(f64, f64, f64)>,
    average: f64,
}

fn parse_load(ran: &Ran) -> Load {
    let out = ran.stdout();
    let mut lines = out.lines();
    let header = lines.next().unwrap_or_default();
    assert!(header.starts_with("sim load: pid "), "{}", ran.show());
    assert_eq!(
        lines.next(),
        Some("   elapsed  kernels/s  GPU share"),
        "{}",
        ran.show()
    );
    let mut rows = Vec::new();
    let mut average = None;
    for line in lines {
        if let Some(rest) = line.strip_prefix("sim load: average GPU share ") {
            average = Some(rest.split(' ').next().unwrap().parse().unwrap());
            continue;
        }
        let w: Vec<&str> = line.split_whitespace().collect();
        match w[..] {
            [t, "s", per_s, share, "%"] => rows.push((
                t.parse().unwrap(),
                per_s.parse().unwrap(),
                share.parse().unwrap(),
            )),
            _ => panic!("unexpected line {line:?}\n{}", ran.show()),
        }
    }
    Load {
        rows,
        average: average.unwrap_or_else(|| panic!("no summary line\n{}", ran.show())),
    }
}

impl Load {
    /// The mean share of the rows that end in (from, to] seconds.
    fn share_between(&self, from: f64, to: f64) -> f64 {
        let s: Vec<f64> = self
            .rows
            .iter()
            .filter(|r| r.0 > from && r.0 <= to)
            .map(|r| r.2)
            .collect();
        assert!(!s.is_empty(), "no rows in ({from}, {to}]: {:?}", self.rows);
        s.iter().sum::<f64>() / s.len() as f64
    }
}

fn within(got: f64, want: f64, what: &str) {
    println!("{what}: {got:.1} % (want {want} +/- 3)");
    assert!(
        (got - want).abs() <= 3.0,
        "{what}: got {got:.1} %, want {want} +/- 3 pp"
    );
}

/// Bad policies, and no quota at all, are usage errors (exit 2) with one exact line naming the
/// flag; the command never runs.
#[test]
fn compute_policies_are_checked_before_anything_runs() {
    let scratch = Scratch::new("bad");
    let marker = scratch.path("ran");
    let touch = format!("touch {}", marker.display());
    let limit = "a limit is a percentage of GPU time, more than 0 and at most 100";
    let share = "a share is a weight, more than 0 and at most 1000000 (or share=memory)";
    let forms = "expected limit=P, share=W, share=memory or none";
    let cases: Vec<(Vec<&str>, String)> = vec![
        (
            vec!["--compute", "limit=150"],
            format!("--compute limit=150: {limit}"),
        ),
        (
            vec!["--compute", "limit=0"],
            format!("--compute limit=0: {limit}"),
        ),
        (
            vec!["--compute", "limit=-5"],
            format!("--compute limit=-5: {limit}"),
        ),
        (
            vec!["--compute", "limit=abc"],
            format!("--compute limit=abc: \"abc\" is not a number: {limit}"),
        ),
        (
            vec!["--compute", "share=0"],
            format!("--compute share=0: {share}"),
        ),
        (
            vec!["--compute", "share=-1"],
            format!("--compute share=-1: {share}"),
        ),
        (
            vec!["--compute", "share=x"],
            format!("--compute share=x: \"x\" is not a number: {share}"),
        ),
        (
            vec!["--compute", "fair=2"],
            format!("--compute fair=2: {forms}"),
        ),
        (vec!["--compute", "30"], format!("--compute 30: {forms}")),
        (vec!["--compute", ""], format!("--compute \"\": {forms}")),
        (
            vec!["--compute", "share=memory"],
            "--compute share=memory: a share weighted by the memory quota needs --memory or \
             --memory-per-device too"
                .into(),
        ),
        (
            vec!["--memory", "1Gi", "--compute", "limit=101"],
            format!("--compute limit=101: {limit}"),
        ),
        (
            vec![],
            "give a quota: --memory SIZE, --memory-per-device ORDINAL=SIZE,..., or --compute \
             POLICY"
                .into(),
        ),
    ];
    for (flags, want) in cases {
        let mut args = vec!["run"];
        args.extend(flags);
        args.extend(["--sim", "single", "--", "sh", "-c", &touch]);
        let ran = cuvisor(&args, &scratch, &[]).exits(2);
        assert_eq!(ran.stderr(), format!("error: {want}\n"), "{}", ran.show());
        assert_eq!(ran.stdout(), "");
        assert!(!marker.exists(), "the command ran:\n{}", ran.show());
    }
    assert_eq!(scratch.leftovers(), Vec::<PathBuf>::new());
}

/// `sim load`'s flags are checked before the driver is touched (exit 2, one exact line).
#[test]
fn sim_load_flags_are_checked() {
    let scratch = Scratch::new("load-flags");
    let examples = "such as 1ms, 50us or 0.5s";
    for (flags, want) in [
        (
            &["--kernel", "5"][..],
            format!("--kernel 5: no unit (give one: ns, us, ms or s, {examples})"),
        ),
        (
            &["--kernel", "5h"],
            "--kernel 5h: unknown unit \"h\" (use ns, us, ms or s)".into(),
        ),
        (
            &["--kernel", "-1ms"],
            "--kernel -1ms: a duration cannot be negative".into(),
        ),
        (
            &["--kernel", "0us"],
            "--kernel 0us: a kernel runs more than 0 and at most 1s".into(),
        ),
        (
            &["--kernel", "2s"],
            "--kernel 2s: a kernel runs more than 0 and at most 1s".into(),
        ),
        (
            &["--seconds", "0"],
            "--seconds 0: the load runs for more than 0 seconds".into(),
        ),
        (
            &["--seconds", "ten"],
            format!("--seconds ten: not a duration (a number and a unit, {examples})"),
        ),
        (
            &["--every", "1ms"],
            "--every 1ms: at least 10ms (the simulator counts GPU time in 10 ms buckets)".into(),
        ),
        (
            &["--every", ""],
            format!("--every \"\": empty (give a duration {examples})"),
        ),
    ] {
        let mut args = vec!["sim", "load"];
        args.extend_from_slice(flags);
        let ran = cuvisor(&args, &scratch, &[]).exits(2);
        assert_eq!(ran.stderr(), format!("error: {want}\n"), "{}", ran.show());
        assert_eq!(ran.stdout(), "");
    }
}

/// `--compute` alone runs (memory unlimited: an inherited CUVISOR_MEMORY_LIMIT is removed); the
/// command sees the canonical policy and, on the simulator, CUVISOR_COORD_DIR=<state file>.coord
/// (created). Without the simulator, or when the environment already has one, CUVISOR_COORD_DIR
/// is left alone.
#[test]
fn compute_alone_runs_with_its_policy_and_the_simulators_coordinator() {
    let scratch = Scratch::new("env");
    let show = "printf '%s\\n' \"${CUVISOR_COMPUTE-unset}\" \"${CUVISOR_MEMORY_LIMIT-unset}\" \
                \"${CUVISOR_COORD_DIR-unset}\" \"$CUVISOR_SIM_STATE\"; \
                test -z \"$CUVISOR_COORD_DIR\" || test -d \"$CUVISOR_COORD_DIR\"";
    let run = |flags: &[&str], env: &[(&str, &str)]| -> Vec<String> {
        let mut args = vec!["run"];
        args.extend_from_slice(flags);
        args.extend(["--", "sh", "-c", show]);
        let ran = cuvisor(&args, &scratch, env).exits(0);
        ran.stdout().lines().map(String::from).collect()
    };
    let state = scratch.path("gpu");
    let state_s = state.to_str().unwrap();
    let coord = format!("{state_s}.coord");

    let v = run(
        &[
            "--compute",
            " share = 1 ",
            "--sim",
            "single",
            "--state",
            state_s,
        ],
        &[("CUVISOR_MEMORY_LIMIT", "1Gi")],
    );
    assert_eq!(v, ["share=1", "unset", &coord, state_s]);
    assert!(Path::new(&coord).is_dir());

    // Another run on the same state file gets the same coordinator; another state file, its own.
    let v = run(
        &[
            "--compute",
            "limit=30%",
            "--sim",
            "single",
            "--state",
            state_s,
        ],
        &[],
    );
    assert_eq!(v[..3], ["limit=30", "unset", &coord]);
    let other = scratch.path("other-gpu");
    let other_s = other.to_str().unwrap();
    let v = run(
        &[
            "--compute",
            "share=3",
            "--sim",
            "single",
            "--state",
            other_s,
        ],
        &[],
    );
    assert_eq!(v[..3], ["share=3", "unset", &format!("{other_s}.coord")]);

    // With a memory quota too; without the simulator CUVISOR_COORD_DIR is not set.
    let v = run(&["--memory", "1Gi", "--compute", "limit=12.50"], &[]);
    assert_eq!(v[..3], ["limit=12.5", "1073741824", "unset"]);
    // Without --compute, CUVISOR_COMPUTE is not set (the library's default applies).
    let v = run(
        &["--memory", "1Gi", "--sim", "single", "--state", state_s],
        &[],
    );
    assert_eq!(v[..3], ["unset", "1073741824", &coord]);

    // The user's CUVISOR_COORD_DIR is kept, and nothing is created beside the state file.
    let mine = scratch.path("mine");
    std::fs::create_dir_all(&mine).unwrap();
    let third = scratch.path("third-gpu");
    let v = run(
        &[
            "--compute",
            "none",
            "--sim",
            "single",
            "--state",
            third.to_str().unwrap(),
        ],
        &[("CUVISOR_COORD_DIR", mine.to_str().unwrap())],
    );
    assert_eq!(v[..3], ["none", "unset", mine.to_str().unwrap()]);
    assert!(!scratch.path("third-gpu.coord").exists());

    // A fresh state file in the temporary directory: the coordinator is beside it, and goes
    // with it.
    let v = run(&["--compute", "share=2", "--sim", "single"], &[]);
    assert!(v[3].starts_with(scratch.tmp().to_str().unwrap()), "{v:?}");
    assert_eq!(v[2], format!("{}.coord", v[3]));
    assert_eq!(scratch.leftovers(), Vec::<PathBuf>::new());
}

/// Without the simulator `sim load` fails with one line (exit 1) that says it needs it: no
/// libcuda.so.1 at all, or one that is not the simulator.
#[test]
fn sim_load_without_the_simulator_fails_in_one_line() {
    let scratch = Scratch::new("no-sim");
    let how = "run it as `cuvisor run --sim PRESET [--state FILE] --compute POLICY -- cuvisor \
               sim load`";
    // On a machine with a real driver this loads it, which has no sim_busy kernel.
    let ran = cuvisor(&["sim", "load", "--seconds", "1"], &scratch, &[]).exits(1);
    let err = ran.stderr();
    assert!(
        err.starts_with("error: sim load needs the simulated GPU, and ")
            && err.ends_with(&format!("; {how}\n")),
        "{}",
        ran.show()
    );
    assert_eq!(err.lines().count(), 1, "{}", ran.show());
    assert_eq!(ran.stdout(), "");
    // A libcuda.so.1 that is something else (here the simulated NVML).
    let fake = scratch.path("fake");
    std::fs::create_dir_all(&fake).unwrap();
    std::os::unix::fs::symlink(
        built().join("sim/libnvidia-ml.so.1"),
        fake.join("libcuda.so.1"),
    )
    .unwrap();
    let ran = cuvisor(
        &["sim", "load", "--seconds", "1"],
        &scratch,
        &[("LD_LIBRARY_PATH", fake.to_str().unwrap())],
    )
    .exits(1);
    assert_eq!(
        ran.stderr(),
        format!(
            "error: sim load needs the simulated GPU, and this libcuda.so.1 is not the simulator \
             (it has no cuInit); {how}\n"
        )
    );
}

/// Alone and not throttled (no cuvisor: the simulated driver on the library path), the load has
/// the whole GPU; it prints a row per interval and the summary.
#[test]
fn sim_load_alone_takes_the_whole_simulated_gpu() {
    let _l = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let scratch = Scratch::new("alone");
    let state = scratch.path("gpu");
    let ran = cuvisor(
        &[
            "sim",
            "load",
            "--seconds",
            "1.2",
            "--every",
            "400ms",
            "--kernel",
            "200us",
        ],
        &scratch,
        &[
            ("LD_LIBRARY_PATH", built().join("sim").to_str().unwrap()),
            ("CUVISOR_SIM", "single"),
            ("CUVISOR_SIM_STATE", state.to_str().unwrap()),
        ],
    )
    .exits(0);
    println!("{}", ran.stdout());
    let first = ran.stdout().lines().next().unwrap().to_string();
    assert!(
        first.ends_with(&format!(
            "200us kernels on GPU 0 of the single simulator (state {}) for 1200ms",
            state.display()
        )),
        "{first}"
    );
    let load = parse_load(&ran);
    assert_eq!(load.rows.len(), 3, "{}", ran.show());
    for &(t, per_s, share) in &load.rows[1..] {
        assert!(share >= 95.0, "{t} s: {share} %\n{}", ran.show());
        // 200 us kernels on a GPU of its own: about 5000 a second.
        assert!(
            per_s > 4_500.0 && per_s < 5_200.0,
            "{per_s}/s\n{}",
            ran.show()
        );
    }
    assert!(load.average >= 95.0, "{}", ran.show());
}

/// The demonstration: two `cuvisor run`s on one simulated GPU (one state file) with
/// shares 1 and 3, each running `cuvisor sim load`, get 25 % and 75 % of its time.
#[test]
fn shares_of_1_and_3_split_the_simulated_gpu_25_and_75_percent() {
    let _l = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let scratch = Scratch::new("shares");
    let state = scratch.path("gpu");
    let load = ["--seconds", "4", "--kernel", "1ms", "--every", "1s"];
    let a = spawn_load(&scratch, &state, "share=1", &load);
    let b = spawn_load(&scratch, &state, "share=3", &load);
    let (a, b) = (finish(a), finish(b));
    println!("{}{}", a.stdout(), b.stdout());
    let (la, lb) = (parse_load(&a), parse_load(&b));
    assert_eq!((la.rows.len(), lb.rows.len()), (4, 4));
    // The rows at 2 s and 3 s: both loads run all through them.
    within(la.share_between(1.5, 3.5), 25.0, "share=1 next to share=3");
    within(lb.share_between(1.5, 3.5), 75.0, "share=3 next to share=1");
    assert!(Path::new(&format!("{}.coord", state.display())).is_dir());
}

/// Two runs on different state files are different simulated machines, with coordinators of
/// their own: each has its GPU to itself whatever its weight.
#[test]
fn runs_on_different_state_files_do_not_share() {
    let _l = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let scratch = Scratch::new("apart");
    let load = ["--seconds", "1.5", "--every", "500ms"];
    let a = spawn_load(&scratch, &scratch.path("gpu-a"), "share=1", &load);
    let b = spawn_load(&scratch, &scratch.path("gpu-b"), "share=3", &load);
    for ran in [finish(a), finish(b)] {
        let l = parse_load(&ran);
        println!("{}", ran.stdout());
        assert!(l.share_between(0.6, 1.6) >= 90.0, "{}", ran.show());
    }
}

/// A lone `limit=30` holds the load to 30 % of an otherwise idle simulated GPU.
#[test]
fn a_lone_limit_of_30_percent_holds_under_sim_load() {
    let _l = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let scratch = Scratch::new("limit");
    let ran = finish(spawn_load(
        &scratch,
        &scratch.path("gpu"),
        "limit=30",
        &["--seconds", "2.5", "--every", "500ms"],
    ));
    println!("{}", ran.stdout());
    let l = parse_load(&ran);
    within(l.share_between(0.6, 2.6), 30.0, "lone limit=30");
    within(l.average, 30.0, "lone limit=30, whole run");
}
