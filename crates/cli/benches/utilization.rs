//! The seeds' utilization chart, measured: GPU utilization and job throughput for vision, NLP
//! and scientific jobs on one simulated 8-GPU box, placed three ways (exclusive, basic sharing,
//! topology-optimized sharing; [`placement`]), with the communication efficiency and topology
//! loss each multi-GPU job measured next to the model's.
//!
//! Per box and kind, a stream of jobs (the fixed mix of 1-, 2- and 4-GPU jobs [`job_sizes`]
//! gives, every job `cuvisor sim job --kind K --gpus LIST --steps N --scale F --json`) is
//! queued at once and started first come, first served as its placement finds room. Exclusive
//! jobs run on the simulator directly, as on a node without cuvisor; sharing jobs under
//! `cuvisor run --sim BOX --state STATE --memory UNIT --compute share=1` (each its own container:
//! its own ledger; all on the box's one simulator state and compute coordinator). Utilization
//! is the simulator's own busy time of the box's GPUs (kernels on the device timelines,
//! `busy_total`) over GPUs x the stream's wall time, first start to last exit; throughput is
//! jobs per minute and job steps per second over the same time.
//!
//! `cargo bench --bench utilization`: every box (dgx1-v100 drawn as docs/utilization.svg;
//! dgx-a100, h200, pcie-8 as contrast), prints the table, writes target/utilization.svg and
//! target/utilization.md (the table, for docs/utilization.md).
//! `CUVISOR_BENCH_SHORT=1 cargo bench --bench utilization` (or `-- --short`, or run by `cargo
//! test --benches`; .ci/run runs it):
//! dgx1-v100 only, fewer and shorter jobs; asserts only that every job finished and that the
//! table has every cell (no timing assertions).
//! For finding out where utilization goes: CUVISOR_BENCH_BOXES=dgx1-v100,h200 and
//! CUVISOR_BENCH_KINDS=vision,nlp pick boxes and kinds; CUVISOR_BENCH_COMPUTE=POLICY runs the
//! sharing jobs under another `--compute` policy (none: the memory quota only), and
//! CUVISOR_BENCH_COMPUTE=without-cuvisor runs them on the simulator directly (same placement).

#[path = "utilization/chart.rs"]
mod chart;
#[path = "utilization/placement.rs"]
mod placement;
#[path = "utilization/report.rs"]
mod report;

use cuvisor_device_plugin::topology::{parse_topo_matrix, Allocator};
use placement::{Mode, Placer, UNITS};
use report::JobReport;
use std::collections::VecDeque;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const KINDS: [&str; 3] = ["vision", "nlp", "scientific"];
const BOXES: [&str; 4] = ["dgx1-v100", "dgx-a100", "h200", "pcie-8"];
/// The mix's seed (issue 18).
const SEED: u64 = 18;
/// A job that has not finished after this long fails the bench.
const JOB_TIMEOUT: Duration = Duration::from_secs(300);
/// The box whose GPU the plan's `--scale` is for (the others' scale by their speed-up).
const REFERENCE_BOX: &str = "dgx1-v100";
static REFERENCE_BOX_PROBE: std::sync::OnceLock<u64> = std::sync::OnceLock::new();

/// How much to run.
#[derive(Clone, Debug)]
struct Plan {
    short: bool,
    jobs: usize,
    steps: u32,
    scale: f64,
    /// The sharing jobs' `--compute` policy (CUVISOR_BENCH_COMPUTE, default share=1); None
    /// (CUVISOR_BENCH_COMPUTE=without-cuvisor): sharing jobs run on the simulator directly, as
    /// exclusive ones do, to see what cuvisor itself costs.
    compute: Option<String>,
    /// CUVISOR_BENCH_KINDS=vision,nlp: only these kinds.
    kinds: Vec<&'static str>,
}

impl Plan {
    fn from_env() -> Plan {
        // `cargo bench` passes --bench; without it (`cargo test --benches`, `--all-targets`)
        // the short form runs, not five minutes of jobs.
        let short = std::env::var("CUVISOR_BENCH_SHORT").is_ok_and(|v| !v.is_empty() && v != "0")
            || std::env::args().any(|a| a == "--short")
            || !std::env::args().any(|a| a == "--bench");
        let compute = match std::env::var("CUVISOR_BENCH_COMPUTE") {
            Ok(p) if p == "without-cuvisor" => None,
            Ok(p) if !p.is_empty() => Some(p),
            _ => Some("share=1".to_string()),
        };
        let only = std::env::var("CUVISOR_BENCH_KINDS").unwrap_or_default();
        let kinds = KINDS
            .iter()
            .copied()
            .filter(|k| only.is_empty() || only.split(',').any(|o| o == *k))
            .collect();
        let (jobs, steps, scale) = if short { (12, 4, 0.05) } else { (48, 10, 0.1) };
        Plan {
            short,
            jobs,
            steps,
            scale,
            compute,
            kinds,
        }
    }
}

/// The stream's job sizes: `n` draws from SplitMix64 seeded with [`SEED`], 1 GPU with
/// probability 1/2, 2 GPUs 1/3, 4 GPUs 1/6 (most jobs are small, as in any shared cluster;
/// every size occurs). The same sequence for every kind, mode and box, so that only the kind
/// and the placement differ.
fn job_sizes(n: usize) -> Vec<usize> {
    let mut x = SEED;
    (0..n)
        .map(|_| {
            x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^= z >> 31;
            match z % 6 {
                0..=2 => 1,
                3 | 4 => 2,
                _ => 4,
            }
        })
        .collect()
}

/// One simulated box and what runs jobs on it.
struct Machine {
    preset: &'static str,
    model: cuvisor_sim::model::Model,
    allocator: Allocator,
    /// target/<profile>/: the cuvisor binary, deps/libcuvisor.so, sim/libcuda.so.1.
    profile: PathBuf,
    cuvisor: PathBuf,
    scratch: PathBuf,
    /// The jobs' `--scale` on this box: the plan's, times how much faster its GPU computes
    /// than the V100 (the job scales its compute by tensor throughput), so that a step takes
    /// about as long on every box (about 100 ms) and process start-up weighs the same.
    scale: f64,
}

/// One stream's outcome.
#[derive(Clone, Debug)]
struct Stream {
    util: f64,
    /// Utilization from the first start until the queue emptied (every job placed): the
    /// placement's steady state, before the stream's tail leaves GPUs idle. None when no job
    /// ever waited (the whole stream fit at once).
    util_queued: Option<f64>,
    wall_s: f64,
    jobs: usize,
    steps: u64,
    /// (GPUs, report) of every multi-GPU job.
    multi: Vec<(Vec<usize>, JobReport)>,
}

impl Stream {
    fn jobs_per_min(&self) -> f64 {
        60.0 * self.jobs as f64 / self.wall_s
    }
    fn steps_per_s(&self) -> f64 {
        self.steps as f64 / self.wall_s
    }
    /// Mean over the multi-GPU jobs of a (measured, model) pair; None without any.
    fn mean(&self, f: impl Fn(&JobReport) -> (f64, f64)) -> Option<(f64, f64)> {
        if self.multi.is_empty() {
            return None;
        }
        let n = self.multi.len() as f64;
        let (a, b) = self
            .multi
            .iter()
            .map(|(_, r)| f(r))
            .fold((0.0, 0.0), |(a, b), (x, y)| (a + x, b + y));
        Some((a / n, b / n))
    }
}

struct Running {
    child: Child,
    gpus: Vec<usize>,
    out: PathBuf,
    err: PathBuf,
    started: Instant,
}

impl Machine {
    fn new(preset: &'static str, plan: &Plan) -> Option<Machine> {
        let model = cuvisor_sim::model::preset(preset)?;
        let topology = parse_topo_matrix(&model.topo_matrix())
            .unwrap_or_else(|e| panic!("{preset}: its topo -m does not parse: {e:?}"));
        let allocator = Allocator::new(topology)
            .unwrap_or_else(|e| panic!("{preset}: no allocator for its topology: {e:?}"));
        let profile = cuvisor_testkit::built(&cuvisor_testkit::profile_dir_of_test()).to_path_buf();
        let scratch = std::env::temp_dir().join(format!(
            "cuvisor-bench-utilization-{preset}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&scratch);
        std::fs::create_dir_all(&scratch).expect("a scratch directory in TMPDIR");
        let mut m = Machine {
            preset,
            model,
            allocator,
            cuvisor: PathBuf::from(env!("CARGO_BIN_EXE_cuvisor")),
            profile,
            scratch,
            scale: 1.0,
        };
        let reference = *REFERENCE_BOX_PROBE.get_or_init(|| m.vision_compute_ns(REFERENCE_BOX));
        let speedup = reference.max(1) as f64 / m.vision_compute_ns(preset).max(1) as f64;
        m.scale = (plan.scale * speedup).clamp(0.0001, 1.0);
        Some(m)
    }

    /// A one-GPU vision job's compute per step on `preset` at `--scale 0.01`, ns (the job's
    /// JSON `compute_ns`), run on the simulator directly.
    fn vision_compute_ns(&self, preset: &str) -> u64 {
        let state = self.scratch.join(format!("probe-{preset}.state"));
        let out = Command::new(&self.cuvisor)
            .args([
                "sim", "job", "--kind", "vision", "--gpus", "0", "--steps", "1",
            ])
            .args(["--scale", "0.01", "--json"])
            .env_remove("LD_PRELOAD")
            .env("CUVISOR_SIM", preset)
            .env("CUVISOR_SIM_STATE", &state)
            .env("LD_LIBRARY_PATH", self.profile.join("sim"))
            .output()
            .unwrap_or_else(|e| panic!("starting {}: {e}", self.cuvisor.display()));
        let _ = std::fs::remove_file(&state);
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "probing {preset}'s compute: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_str::<serde_json::Value>(text.trim())
            .ok()
            .and_then(|v| v.get("compute_ns").and_then(serde_json::Value::as_u64))
            .unwrap_or_else(|| panic!("probing {preset}'s compute: no compute_ns in {text}"))
    }

    fn gpus(&self) -> usize {
        self.model.devices.len()
    }

    /// One unit of a GPU's memory, MiB (the sharing jobs' quota).
    fn unit_mib(&self) -> u64 {
        (self.model.devices[0].memory / UNITS as u64) >> 20
    }

    /// The command for one job of `kind` on `gpus` in `mode` on the state file `state`.
    fn command(
        &self,
        plan: &Plan,
        mode: Mode,
        kind: &str,
        gpus: &[usize],
        state: &Path,
    ) -> Command {
        let list = gpus
            .iter()
            .map(|g| g.to_string())
            .collect::<Vec<_>>()
            .join(",");
        let job: Vec<String> = vec![
            "sim".into(),
            "job".into(),
            "--kind".into(),
            kind.into(),
            "--gpus".into(),
            list,
            "--steps".into(),
            plan.steps.to_string(),
            "--scale".into(),
            format!("{:.4}", self.scale),
            "--json".into(),
        ];
        let mut c = Command::new(&self.cuvisor);
        for v in [
            "LD_PRELOAD",
            "CUVISOR_COMPUTE",
            "CUVISOR_MEMORY_LIMIT",
            "CUVISOR_COORD_DIR",
            "CUVISOR_STATE_DIR",
            "CUVISOR_CONFIG",
        ] {
            c.env_remove(v);
        }
        if let (true, Some(policy)) = (mode.shared(), &plan.compute) {
            c.args(["run", "--sim", self.preset, "--state"])
                .arg(state)
                .args(["--memory", &format!("{}Mi", self.unit_mib())])
                .args(["--compute", policy, "--"])
                .arg(&self.cuvisor)
                .args(&job);
        } else {
            // As on a node without cuvisor: the simulated driver, nothing preloaded.
            c.args(&job)
                .env("CUVISOR_SIM", self.preset)
                .env("CUVISOR_SIM_STATE", state)
                .env("LD_LIBRARY_PATH", self.profile.join("sim"));
        }
        c
    }

    /// Runs one kind's stream of `sizes` in `mode`.
    fn stream(&self, plan: &Plan, kind: &str, mode: Mode, sizes: &[usize]) -> Stream {
        let tag = format!("{kind}-{}", mode.label().replace(' ', "-"));
        let state = self.scratch.join(format!("{tag}.state"));
        let shared = cuvisor_sim::state::Shared::attach_at(&self.model, &state)
            .unwrap_or_else(|e| panic!("simulator state {}: {e}", state.display()));
        let busy = |s: &cuvisor_sim::state::Shared| -> u64 {
            (0..self.gpus())
                .map(|d| {
                    s.device(d)
                        .busy_total
                        .load(std::sync::atomic::Ordering::Acquire)
                })
                .sum()
        };
        let busy0 = busy(&shared);
        let mut placer = Placer::new(mode, self.allocator.clone(), self.model.devices[0].memory);
        let mut free = vec![UNITS; self.gpus()];
        let mut queue: VecDeque<(usize, usize)> = sizes.iter().copied().enumerate().collect();
        let mut running: Vec<Running> = Vec::new();
        let mut done = Stream {
            util: 0.0,
            util_queued: None,
            wall_s: 0.0,
            jobs: 0,
            steps: 0,
            multi: Vec::new(),
        };
        let t0 = Instant::now();
        let mut queued: Option<(u64, Duration)> = None;
        let mut waited = false;
        loop {
            if queue.is_empty() && queued.is_none() {
                queued = Some((busy(&shared).saturating_sub(busy0), t0.elapsed()));
            }
            while let Some(&(i, size)) = queue.front() {
                let Some(gpus) = placer.place(&free, size) else {
                    waited = true;
                    break;
                };
                assert_eq!(gpus.len(), size, "{mode:?} placed {gpus:?} for {size} GPUs");
                placer.account(&mut free, &gpus, true);
                let (out, err) = (
                    self.scratch.join(format!("{tag}-{i}.out")),
                    self.scratch.join(format!("{tag}-{i}.err")),
                );
                let child = self
                    .command(plan, mode, kind, &gpus, &state)
                    .stdout(Stdio::from(std::fs::File::create(&out).unwrap()))
                    .stderr(Stdio::from(std::fs::File::create(&err).unwrap()))
                    .spawn()
                    .unwrap_or_else(|e| panic!("starting {}: {e}", self.cuvisor.display()));
                running.push(Running {
                    child,
                    gpus,
                    out,
                    err,
                    started: Instant::now(),
                });
                queue.pop_front();
            }
            if running.is_empty() {
                assert!(queue.is_empty(), "{tag}: a job that never fits: {queue:?}");
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
            let mut k = 0;
            while k < running.len() {
                let r = &mut running[k];
                let status = r.child.try_wait().expect("waiting for a job");
                let Some(status) = status else {
                    if r.started.elapsed() > JOB_TIMEOUT {
                        let _ = r.child.kill();
                        panic!(
                            "{} {tag}: a job on {:?} ran over {JOB_TIMEOUT:?}",
                            self.preset, r.gpus
                        );
                    }
                    k += 1;
                    continue;
                };
                let r = running.swap_remove(k);
                let text = std::fs::read_to_string(&r.out).unwrap_or_default();
                let errors = std::fs::read_to_string(&r.err).unwrap_or_default();
                assert!(
                    status.success(),
                    "{} {tag}: the job on {:?} failed ({status}):\n{errors}",
                    self.preset,
                    r.gpus
                );
                let report = JobReport::parse(&text).unwrap_or_else(|e| {
                    panic!(
                        "{} {tag}: {e}\nstdout: {text}\nstderr: {errors}",
                        self.preset
                    )
                });
                assert_eq!(
                    report.steps, plan.steps as u64,
                    "{} {tag}: the job on {:?} ran {} of {} steps",
                    self.preset, r.gpus, report.steps, plan.steps
                );
                placer.account(&mut free, &r.gpus, false);
                done.jobs += 1;
                done.steps += report.steps;
                if r.gpus.len() > 1 {
                    done.multi.push((r.gpus, report));
                }
            }
        }
        let wall = t0.elapsed();
        let busy_ns = busy(&shared).saturating_sub(busy0);
        done.wall_s = wall.as_secs_f64();
        let percent = |busy: u64, over: Duration| {
            100.0 * busy as f64 / (self.gpus() as f64 * over.as_nanos().max(1) as f64)
        };
        done.util = percent(busy_ns, wall);
        done.util_queued = queued.filter(|_| waited).map(|(b, t)| percent(b, t));
        drop(shared);
        let _ = std::fs::remove_file(&state);
        let _ = std::fs::remove_dir_all(state.with_extension("state.coord"));
        done
    }
}

/// The table's header and one row per kind x mode.
fn table(preset: &str, results: &[(usize, usize, Stream)]) -> String {
    let mut t = String::new();
    let _ = writeln!(
        t,
        "| {preset} | mode | GPU util % | util % while queued | seeds' % | jobs/min | steps/s | wall s | multi-GPU jobs | busbw GB/s meas / model | comm. efficiency GB/s meas / model | topology loss % meas / model | host-bound steps |"
    );
    let _ = writeln!(
        t,
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|---|---:|"
    );
    for (k, m, s) in results {
        let pair = |p: Option<(f64, f64)>, pct: bool| match p {
            Some((a, b)) if pct => format!("{:.1} / {:.1}", 100.0 * a, 100.0 * b),
            Some((a, b)) => format!("{a:.1} / {b:.1}"),
            None => "-".into(),
        };
        let _ = writeln!(
            t,
            "| {} | {} | {:.1} | {} | {:.0} | {:.1} | {:.2} | {:.1} | {} | {} | {} | {} | {} |",
            KINDS[*k],
            Mode::ALL[*m].label(),
            s.util,
            s.util_queued.map_or("-".into(), |u| format!("{u:.1}")),
            chart::SEEDS[*k].1[*m],
            s.jobs_per_min(),
            s.steps_per_s(),
            s.wall_s,
            s.multi.len(),
            pair(s.mean(|r| r.busbw), false),
            pair(s.mean(|r| r.efficiency), false),
            pair(s.mean(|r| r.loss), true),
            host_bound(s),
        );
    }
    t
}

/// "b of n": the multi-GPU jobs' steps whose all-reduce the host issued late, of all their steps.
fn host_bound(s: &Stream) -> String {
    let late: u64 = s.multi.iter().map(|(_, r)| r.host_bound_steps).sum();
    let all: u64 = s.multi.iter().map(|(_, r)| r.steps).sum();
    format!("{late} of {all}")
}

/// The short form's only checks: every cell of the table is there and is a number.
fn check_cells(plan: &Plan, preset: &str, results: &[(usize, usize, Stream)], sizes: &[usize]) {
    assert_eq!(
        results.len(),
        plan.kinds.len() * Mode::ALL.len(),
        "{preset}: rows"
    );
    let multi = sizes.iter().filter(|&&s| s > 1).count();
    for (k, m, s) in results {
        let cell = format!("{preset} {} {}", KINDS[*k], Mode::ALL[*m].label());
        assert_eq!(s.jobs, sizes.len(), "{cell}: jobs finished");
        assert!(
            s.util.is_finite() && s.util >= 0.0,
            "{cell}: utilization {}",
            s.util
        );
        assert!(s.wall_s > 0.0, "{cell}: wall time");
        assert_eq!(s.multi.len(), multi, "{cell}: multi-GPU job reports");
        for (gpus, r) in &s.multi {
            for (what, (a, b)) in [
                ("busbw", r.busbw),
                ("efficiency", r.efficiency),
                ("loss", r.loss),
            ] {
                assert!(
                    a.is_finite() && b.is_finite(),
                    "{cell}: job on {gpus:?}: {what} {a} / {b}"
                );
            }
        }
    }
}

fn main() {
    let plan = Plan::from_env();
    // CUVISOR_BENCH_BOXES=dgx1-v100,h200: only these boxes.
    let only = std::env::var("CUVISOR_BENCH_BOXES").unwrap_or_default();
    let boxes: Vec<&str> = BOXES
        .iter()
        .copied()
        .filter(|b| only.is_empty() || only.split(',').any(|o| o == *b))
        .take(if plan.short { 1 } else { BOXES.len() })
        .collect();
    let sizes = job_sizes(plan.jobs);
    let started = Instant::now();
    println!(
        "utilization: per box, per kind, a stream of {} jobs of {:?} GPUs (SplitMix64, seed {SEED}), \
         each `cuvisor sim job --steps {} --scale {}` (on {REFERENCE_BOX}; other boxes scale by their GPU's speed-up); {UNITS} memory units per GPU; sharing jobs {}{}",
        sizes.len(),
        sizes,
        plan.steps,
        plan.scale,
        plan.compute
            .as_ref()
            .map_or("without cuvisor".to_string(), |p| format!("under cuvisor run --compute {p}")),
        if plan.short { " (short form)" } else { "" }
    );
    let mut md = String::new();
    let mut drawn: Option<(String, [[f64; 3]; 3])> = None;
    for &preset in &boxes {
        let Some(machine) = Machine::new(preset, &plan) else {
            println!("{preset}: SKIPPED (no such simulator preset in this build)");
            let _ = writeln!(md, "{preset}: no such simulator preset in this build\n");
            continue;
        };
        let mut results = Vec::new();
        for (k, kind) in KINDS.iter().enumerate() {
            if !plan.kinds.contains(kind) {
                continue;
            }
            for (m, &mode) in Mode::ALL.iter().enumerate() {
                let s = machine.stream(&plan, kind, mode, &sizes);
                eprintln!(
                    "{preset} {kind} {}: {:.1} % busy ({} % while jobs queued), {:.1} s",
                    mode.label(),
                    s.util,
                    s.util_queued.map_or("-".into(), |u| format!("{u:.1}")),
                    s.wall_s
                );
                results.push((k, m, s));
            }
        }
        let t = table(preset, &results);
        println!(
            "\n{preset}: {} x {}, jobs at --scale {:.4}",
            machine.gpus(),
            machine.model.devices[0].name,
            machine.scale
        );
        println!("\n{t}");
        if !plan.short {
            println!("multi-GPU jobs ({preset}): GPUs: busbw GB/s, comm. efficiency GB/s, topology loss % (each measured/model), host-bound steps");
            for (k, m, s) in &results {
                for (gpus, r) in &s.multi {
                    println!(
                        "  {:<10} {:<27} {gpus:?}: {:.1}/{:.1}  {:.1}/{:.1}  {:.1}/{:.1}  {}",
                        KINDS[*k],
                        Mode::ALL[*m].label(),
                        r.busbw.0,
                        r.busbw.1,
                        r.efficiency.0,
                        r.efficiency.1,
                        100.0 * r.loss.0,
                        100.0 * r.loss.1,
                        r.host_bound_steps
                    );
                }
            }
        }
        let _ = writeln!(
            md,
            "{preset}: {} x {}, jobs at `--scale {:.4}`\n",
            machine.gpus(),
            machine.model.devices[0].name,
            machine.scale
        );
        md.push_str(&t);
        md.push('\n');
        check_cells(&plan, preset, &results, &sizes);
        if drawn.is_none() && plan.kinds.len() == KINDS.len() {
            let mut v = [[0.0; 3]; 3];
            for (k, m, s) in &results {
                v[*k][*m] = s.util;
            }
            let gpu = &machine.model.devices[0].name;
            drawn = Some((format!("{preset} ({} x {gpu})", machine.gpus()), v));
        }
        let _ = std::fs::remove_dir_all(&machine.scratch);
    }
    let target = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target");
    if let Some((machine, v)) = drawn {
        let svg = chart::svg(
            &format!("GPU utilization on a simulated {machine}"),
            &format!(
                "{} jobs per kind ({} x 1 GPU, {} x 2, {} x 4), {} steps each; filled: measured, outlined: the seeds' figures",
                sizes.len(),
                sizes.iter().filter(|&&s| s == 1).count(),
                sizes.iter().filter(|&&s| s == 2).count(),
                sizes.iter().filter(|&&s| s == 4).count(),
                plan.steps
            ),
            &v,
        );
        let path = target.join("utilization.svg");
        std::fs::write(&path, svg).expect("writing target/utilization.svg");
        std::fs::write(target.join("utilization.md"), &md).expect("writing target/utilization.md");
        println!("chart: {}", path.display());
    }
    println!(
        "utilization bench: {:.1} s wall",
        started.elapsed().as_secs_f64()
    );
}
