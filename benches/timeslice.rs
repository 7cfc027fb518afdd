//! Compute time slices, the figures of issue 4, on one simulated GPU:
//!
//! A. Accuracy over 5-s windows (after 1 s of warm-up): tenants (each a process under cuvisor with
//!    a ledger directory of its own = a container, all on one simulator state and one coordinator
//!    directory) saturate the GPU with `sim_busy` kernels on a stream; what each gets is read from
//!    the simulator's own per-process busy time, never from cuvisor's counters. Bar: a `limit`
//!    tenant within +/- 2 pp of its cap, a `share` tenant within +/- 2 pp of weight / sum of
//!    weights; a lone share tenant, and the device after a tenant goes idle, >= 95 % busy.
//! B. What cuLaunchKernel costs under the cap (a compute policy configured, the bucket never
//!    empty: 1-ns kernels, alone on the GPU), hooked vs. direct (target: <= 60 ns added). Sampled
//!    launches (events around them) are part of the cost and counted.
//!
//! Run: `cargo bench --bench timeslice` (arguments: substrings of scenario names to run only
//! those, "launch" for part B; CUVISOR_BENCH_DETAIL=1 also shows each second of a window on
//! stderr). Each tenant and each measurement is a fresh process (the dynamic loader reads
//! LD_PRELOAD only at start): this binary re-runs itself with a role.
#[path = "../tests/common/mod.rs"]
mod common;
#[path = "../tests/common/workload.rs"]
mod workload;

use cuvisor_sim::state::{now_ns, Shared};
use std::ffi::c_void;
use std::io::BufRead;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const WARMUP: Duration = Duration::from_secs(1);
const WINDOW: Duration = Duration::from_secs(5);
/// The bar for limits and shares (percentage points).
const BAR_PP: f64 = 2.0;
/// The bar for a lone share tenant and a device whose other tenant went idle (%).
const BUSY_BAR: f64 = 95.0;
/// Added cost per cuLaunchKernel under the cap (ns).
const LAUNCH_TARGET_NS: f64 = 60.0;

// ---- part A: accuracy ------------------------------------------------------------------------

/// One simulated GPU: a simulator state and a coordinator directory shared by its tenants.
struct Gpu {
    state: PathBuf,
    coord: PathBuf,
    sim: Shared,
    tag: String,
}

struct Tenant {
    child: Child,
    ledger: PathBuf,
}

impl Gpu {
    fn new(tag: &str) -> Gpu {
        let state = common::state_file(&format!("bench-ts-{tag}"));
        let coord = common::ledger_dir(&format!("bench-ts-coord-{tag}"));
        let model = cuvisor_sim::model::preset("single").unwrap();
        let sim = Shared::attach_at(&model, &state).unwrap();
        Gpu {
            state,
            coord,
            sim,
            tag: tag.into(),
        }
    }

    /// Tenant `i` (its own container) with policy `compute`.
    fn tenant(
        &self,
        i: usize,
        compute: &str,
        kernel_ns: u64,
        secs: f64,
        idle: Option<f64>,
    ) -> Tenant {
        let ledger = common::ledger_dir(&format!("bench-ts-{}-{i}", self.tag));
        let mut c = Command::new(std::env::current_exe().unwrap());
        c.env("CUVISOR_BENCH_ROLE", "tenant")
            .env("KERNEL_NS", kernel_ns.to_string())
            .env("SECONDS", secs.to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if let Some(t) = idle {
            c.env("IDLE_AFTER", t.to_string());
        }
        common::sim_env(&mut c, "single", &self.state);
        common::cuvisor_env(&mut c, &ledger, Some("8Gi"));
        c.env("CUVISOR_COMPUTE", compute)
            .env("CUVISOR_COORD_DIR", &self.coord);
        Tenant {
            child: c.spawn().unwrap(),
            ledger,
        }
    }

    /// Busy ns of process `pid` on the simulated GPU in [since, now).
    fn busy(&self, pid: u32, since: u64) -> u64 {
        self.sim.pid_busy_since(pid, 0, since)
    }

    /// What each tenant got (% of the window) over `window` starting now.
    /// With CUVISOR_BENCH_DETAIL set, each second of the window goes to stderr too.
    fn shares(&self, tenants: &[Tenant], window: Duration) -> Vec<f64> {
        let t0 = now_ns();
        let of = |since: u64, t1: u64| -> Vec<f64> {
            tenants
                .iter()
                .map(|t| 100.0 * self.busy(t.child.id(), since) as f64 / (t1 - since) as f64)
                .collect()
        };
        if std::env::var_os("CUVISOR_BENCH_DETAIL").is_some() {
            let step = Duration::from_secs(1);
            let mut left = window;
            while left > Duration::ZERO {
                let since = now_ns();
                std::thread::sleep(step.min(left));
                left = left.saturating_sub(step);
                let s = of(since, now_ns());
                let text: Vec<String> = s.iter().map(|x| format!("{x:6.2}")).collect();
                eprintln!(
                    "  {:4.1} s: {} | busy {:6.2}",
                    (now_ns() - t0) as f64 / 1e9,
                    text.join(" "),
                    s.iter().sum::<f64>()
                );
            }
        } else {
            std::thread::sleep(window);
        }
        of(t0, now_ns())
    }
}

impl Drop for Gpu {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.state);
        let _ = std::fs::remove_dir_all(&self.coord);
    }
}

fn finish(tenants: Vec<Tenant>) {
    for t in tenants {
        let out = t.child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "tenant failed: {:?}\n--- stdout\n{}\n--- stderr\n{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let _ = std::fs::remove_dir_all(&t.ledger);
    }
}

#[derive(Clone, Copy)]
enum Bar {
    /// Within this many pp of `want`.
    Within(f64),
    /// At least this %.
    AtLeast(f64),
    /// Shown for information, no bar.
    Info,
}

struct Row {
    scenario: String,
    tenant: String,
    want: f64,
    got: f64,
    bar: Bar,
}

impl Row {
    fn pass(&self) -> bool {
        match self.bar {
            Bar::Within(pp) => (self.got - self.want).abs() <= pp,
            Bar::AtLeast(min) => self.got >= min,
            Bar::Info => true,
        }
    }
}

/// Tenants with these policies saturate the GPU with `kernel_ns` kernels; each one's share over
/// the window is held to the bar: a limit's cap, a share's weight / sum of weights.
fn steady(name: &str, policies: &[&str], kernel_ns: u64) -> Vec<Row> {
    let gpu = Gpu::new(&name.replace([' ', ':', ',', '/', '='], "-"));
    let secs = (WARMUP + WINDOW).as_secs_f64() + 0.5;
    let tenants: Vec<Tenant> = policies
        .iter()
        .enumerate()
        .map(|(i, p)| gpu.tenant(i, p, kernel_ns, secs, None))
        .collect();
    std::thread::sleep(WARMUP);
    let got = gpu.shares(&tenants, WINDOW);
    finish(tenants);
    let weight = |p: &str| p.strip_prefix("share=").map(|w| w.parse::<f64>().unwrap());
    let weights: f64 = policies.iter().filter_map(|p| weight(p)).sum();
    let lone_share = policies.len() == 1 && weight(policies[0]).is_some();
    let busy: f64 = got.iter().sum();
    let mut rows: Vec<Row> = policies
        .iter()
        .zip(got)
        .map(|(p, got)| {
            let (want, bar) = match (weight(p), p.strip_prefix("limit=")) {
                _ if lone_share => (100.0, Bar::AtLeast(BUSY_BAR)),
                (Some(w), _) => (100.0 * w / weights, Bar::Within(BAR_PP)),
                (None, Some(cap)) => (cap.parse().unwrap(), Bar::Within(BAR_PP)),
                _ => unreachable!("{p}"),
            };
            Row {
                scenario: name.into(),
                tenant: p.to_string(),
                want,
                got,
                bar,
            }
        })
        .collect();
    // Shares are work-conserving: with every tenant saturating, the device should be busy.
    if policies.len() > 1 && policies.iter().all(|p| weight(p).is_some()) {
        rows.push(Row {
            scenario: name.into(),
            tenant: "(device busy)".into(),
            want: 100.0,
            got: busy,
            bar: Bar::Info,
        });
    }
    rows
}

/// share=1 next to share=3; the weight-3 tenant stops launching 1 s after it started. From 1 s
/// after it stopped, for 1 s: the weight-1 tenant must have the GPU (the device >= 95 % busy).
fn idle_absorption(name: &str) -> Vec<Row> {
    let gpu = Gpu::new("idle");
    let a = gpu.tenant(0, "share=1", 1_000_000, 4.5, None);
    let mut b = gpu.tenant(1, "share=3", 1_000_000, 4.5, Some(1.0));
    let mut line = String::new();
    std::io::BufReader::new(b.child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert!(line.starts_with("stopped"), "{line:?}");
    std::thread::sleep(Duration::from_secs(1));
    let tenants = vec![a, b];
    let got = gpu.shares(&tenants, Duration::from_secs(1));
    finish(tenants);
    vec![
        Row {
            scenario: name.into(),
            tenant: "share=1 (share=3 idle)".into(),
            want: 100.0,
            got: got[0],
            bar: Bar::AtLeast(BUSY_BAR),
        },
        Row {
            scenario: name.into(),
            tenant: "device busy".into(),
            want: 100.0,
            got: got[0] + got[1],
            bar: Bar::AtLeast(BUSY_BAR),
        },
    ]
}

fn print_table(rows: &[Row]) {
    println!(
        "A. compute accuracy on one simulated GPU: {} s windows after {} s warm-up (idle absorption: 1 s window from 1 s after the tenant stopped); from the simulator's per-process busy time",
        WINDOW.as_secs(),
        WARMUP.as_secs()
    );
    println!(
        "{:<36} {:<24} {:>7} {:>7} {:>9} {:>9}  result",
        "scenario", "tenant", "want %", "got %", "error pp", "bar"
    );
    let mut last = "";
    for r in rows {
        let scenario = if r.scenario == last { "" } else { &r.scenario };
        last = &r.scenario;
        let bar = match r.bar {
            Bar::Within(pp) => format!("+/-{pp:.0} pp"),
            Bar::AtLeast(min) => format!(">={min:.0} %"),
            Bar::Info => "-".into(),
        };
        println!(
            "{:<36} {:<24} {:>7.2} {:>7.2} {:>+9.2} {:>9}  {}",
            scenario,
            r.tenant,
            r.want,
            r.got,
            r.got - r.want,
            bar,
            match (r.bar, r.pass()) {
                (Bar::Info, _) => "info",
                (_, true) => "PASS",
                (_, false) => "FAIL <<<",
            }
        );
    }
    let barred = rows.iter().filter(|r| !matches!(r.bar, Bar::Info)).count();
    let failed = rows.iter().filter(|r| !r.pass()).count();
    println!(
        "{} of {} rows within the bar{}",
        barred - failed,
        barred,
        if failed > 0 { "  <<< FAIL" } else { "" }
    );
}

// ---- part B: cost per launch under the cap ---------------------------------------------------

use common::{global_sym as sym, Launch, R};

/// Role "launch": loads the simulated driver globally (as a program linked with -lcuda has it),
/// resolves cuLaunchKernel through the global scope (libcuvisor's wrapper when preloaded), and
/// prints ns per launch call of a 1-ns sim_busy kernel on a stream, launches 400 ns apart:
/// best of 7 x 200,000 after warm-up.
fn measure_launch() {
    // LD_LIBRARY_PATH names the simulator's directory.
    // SAFETY: loading the simulated driver globally.
    let lib = unsafe { libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
    assert!(!lib.is_null());
    let init: extern "C" fn(u32) -> R = sym(c"cuInit");
    let retain: extern "C" fn(*mut *mut c_void, i32) -> R = sym(c"cuDevicePrimaryCtxRetain");
    let set: extern "C" fn(*mut c_void) -> R = sym(c"cuCtxSetCurrent");
    let load: extern "C" fn(*mut *mut c_void, *const c_void) -> R = sym(c"cuModuleLoadData");
    let get: extern "C" fn(*mut *mut c_void, *mut c_void, *const i8) -> R =
        sym(c"cuModuleGetFunction");
    let stream_create: extern "C" fn(*mut *mut c_void, u32) -> R = sym(c"cuStreamCreate");
    let launch: Launch = sym(c"cuLaunchKernel");
    let (mut ctx, mut m, mut f, mut s) = (
        std::ptr::null_mut(),
        std::ptr::null_mut(),
        std::ptr::null_mut(),
        std::ptr::null_mut(),
    );
    assert_eq!(init(0), 0);
    assert_eq!(retain(&mut ctx, 0), 0);
    assert_eq!(set(ctx), 0);
    assert_eq!(load(&mut m, c"image".as_ptr() as *const c_void), 0);
    assert_eq!(get(&mut f, m, c"sim_busy".as_ptr()), 0);
    assert_eq!(stream_create(&mut s, 1), 0);
    // A 1 ns kernel: its measured time (events around it) is about the launch call's own host
    // time, so launched back to back it would keep the GPU "busy" about 100 % of the time, at
    // the cap of a lone share. Under the cap is the case to price: after each launch the loop
    // spins GAP_NS (not timed), so the kernels use about a third of the GPU's time, and only the
    // launch calls are timed (rdtsc around each, converted to ns over the whole run).
    const GAP_NS: u64 = 400;
    let mut ns: u64 = 1;
    let mut args = [&mut ns as *mut u64 as *mut c_void];
    let mut one = || {
        launch(
            f,
            1,
            1,
            1,
            32,
            1,
            1,
            0,
            s,
            args.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    };
    // SAFETY: rdtsc has no preconditions (x86_64 only, as is this project's simulator).
    let tsc = || unsafe { std::arch::x86_64::_rdtsc() };
    // TSC ticks per ns, measured over 50 ms.
    let (t0, c0) = (Instant::now(), tsc());
    std::thread::sleep(std::time::Duration::from_millis(50));
    let per_ns = (tsc() - c0) as f64 / t0.elapsed().as_nanos() as f64;
    let gap = (GAP_NS as f64 * per_ns) as u64;
    let mut timed = |n: u64| {
        let mut spent = 0u64;
        for _ in 0..n {
            let a = tsc();
            let rc = one();
            let b = tsc();
            debug_assert_eq!(rc, 0);
            spent += b - a;
            while tsc() - b < gap {
                std::hint::spin_loop();
            }
        }
        spent as f64 / per_ns / n as f64
    };
    // Warm-up: the kernel's estimate learned (its first samples: every launch measured), rates
    // computed, the sampling interval settled.
    timed(300_000);
    let throttled = ledger_throttled;
    let before = throttled();
    let best = (0..7).map(|_| timed(200_000)).fold(f64::INFINITY, f64::min);
    println!("launch {best:.1} throttled {}", throttled() - before);
}

/// Time (ns) the container's launches were held back, from its ledger (0 without cuvisor).
fn ledger_throttled() -> u64 {
    use std::sync::atomic::Ordering::Relaxed;
    let Some(dir) = std::env::var_os("CUVISOR_STATE_DIR") else {
        return 0;
    };
    let path = PathBuf::from(dir).join(cuvisor_shm::ledger::FILE_NAME);
    cuvisor_shm::ledger::Ledger::open(&path, false).map_or(0, |l| {
        l.devices()
            .map(|(_, _, d)| d.throttled_ns.load(Relaxed))
            .sum()
    })
}

/// What one "launch" process measured.
struct Launches {
    /// ns per launch, best of its runs.
    ns: f64,
    /// ns throttled during the timed runs, and in all (warm-up included).
    throttled_timed: u64,
    throttled: u64,
    /// Launches the ledger counted.
    launches: u64,
}

fn launch_process(compute: Option<&str>, n: usize) -> Launches {
    let state = common::state_file(&format!("bench-ts-launch-{n}"));
    let ledger = common::ledger_dir(&format!("bench-ts-launch-{n}"));
    let coord = common::ledger_dir(&format!("bench-ts-launch-coord-{n}"));
    let mut c = Command::new(std::env::current_exe().unwrap());
    c.env("CUVISOR_BENCH_ROLE", "launch")
        .env("CUVISOR_SIM", "single")
        .env("CUVISOR_SIM_STATE", &state)
        .env("LD_LIBRARY_PATH", common::sim_dir());
    if let Some(p) = compute {
        common::cuvisor_env(&mut c, &ledger, Some("8Gi"));
        c.env("CUVISOR_COMPUTE", p).env("CUVISOR_COORD_DIR", &coord);
    }
    let out = c.output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let f: Vec<f64> = text
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect();
    let (mut throttled, mut launches) = (0, 0);
    if compute.is_some() {
        use std::sync::atomic::Ordering::Relaxed;
        let l =
            cuvisor_shm::ledger::Ledger::open(&ledger.join(cuvisor_shm::ledger::FILE_NAME), false)
                .unwrap();
        for (_, _, d) in l.devices() {
            throttled += d.throttled_ns.load(Relaxed);
            launches += d.launches.load(Relaxed);
        }
    }
    let _ = std::fs::remove_file(&state);
    let _ = std::fs::remove_dir_all(&ledger);
    let _ = std::fs::remove_dir_all(&coord);
    Launches {
        ns: f[0],
        throttled_timed: f[1] as u64,
        throttled,
        launches,
    }
}

/// Processes per side in part B.
const LAUNCH_ROUNDS: usize = 7;

fn launch_cost() {
    // Process placement moves a single measurement by tens of ns: alternate the sides and keep
    // each side's best (as benches/overhead.rs does).
    let sides: [(&str, Option<&str>); 4] = [
        ("direct (no LD_PRELOAD)", None),
        ("hooked, share=1 alone", Some("share=1")),
        ("hooked, limit=100", Some("limit=100")),
        ("(hooked, compute=none)", Some("none")),
    ];
    let mut best = [f64::INFINITY; 4];
    let (mut timed, mut all, mut launches) = ([0u64; 4], [0u64; 4], [0u64; 4]);
    let mut n = 0;
    for _ in 0..LAUNCH_ROUNDS {
        for (i, (_, p)) in sides.iter().enumerate() {
            let m = launch_process(*p, n);
            n += 1;
            best[i] = best[i].min(m.ns);
            timed[i] += m.throttled_timed;
            all[i] += m.throttled;
            launches[i] += m.launches;
        }
    }
    println!(
        "B. cuLaunchKernel under the cap (1-ns sim_busy kernels on a stream, launches 400 ns apart so the GPU is about a third busy, alone on it; only the launch calls timed; best of {LAUNCH_ROUNDS} processes x 7 x 200,000 launches per side, after 300,000 warm-up launches; sampled launches (events around them) included)"
    );
    println!(
        "{:<24} {:>10} {:>10} {:>7}  {:<8} {:>17} {:>17} {:>9}",
        "",
        "ns/launch",
        "added",
        "target",
        "result",
        "throttled, timed",
        "throttled, all",
        "launches"
    );
    println!("{:<24} {:>8.1}ns", sides[0].0, best[0]);
    for i in 1..sides.len() {
        let added = best[i] - best[0];
        let (target, result) = if sides[i].1 == Some("none") {
            // Interception alone, no compute policy: the floor under the figures above.
            ("-".to_string(), "ref")
        } else if added <= LAUNCH_TARGET_NS && timed[i] == 0 {
            (format!("{LAUNCH_TARGET_NS:.0}ns"), "PASS")
        } else {
            (format!("{LAUNCH_TARGET_NS:.0}ns"), "FAIL <<<")
        };
        println!(
            "{:<24} {:>8.1}ns {:>8.1}ns {:>7}  {:<8} {:>15}ns {:>15}ns {:>9}",
            sides[i].0, best[i], added, target, result, timed[i], all[i], launches[i]
        );
    }
    println!("(throttled: time the launching thread slept for tokens, summed over the side's processes; \"timed\": during the timed runs, which must be 0 for \"under the cap\")");
}

/// Runs one scenario (given its name) and returns its rows.
type Scenario = Box<dyn Fn(&str) -> Vec<Row>>;

// ---- main ------------------------------------------------------------------------------------

fn main() {
    match std::env::var("CUVISOR_BENCH_ROLE").as_deref() {
        Ok("tenant") => return workload::run(),
        Ok("launch") => return measure_launch(),
        _ => {}
    }
    // `cargo bench` passes --bench; other arguments select scenarios by substring.
    let filters: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let wanted = |name: &str| filters.is_empty() || filters.iter().any(|f| name.contains(f));
    // Build libcuvisor.so and the simulator for this profile before anything is timed.
    common::libcuvisor();
    let one_ms = 1_000_000;
    let scenarios: Vec<(&str, Scenario)> = vec![
        (
            "limit 30/70, 1 ms kernels",
            Box::new(move |n| steady(n, &["limit=30", "limit=70"], one_ms)),
        ),
        (
            "limit 30/70, 50 us kernels",
            Box::new(|n| steady(n, &["limit=30", "limit=70"], 50_000)),
        ),
        (
            "lone limit 30, 1 ms kernels",
            Box::new(move |n| steady(n, &["limit=30"], one_ms)),
        ),
        (
            "share 1:3, 1 ms kernels",
            Box::new(move |n| steady(n, &["share=1", "share=3"], one_ms)),
        ),
        (
            "share 1:2, 1 ms kernels",
            Box::new(move |n| steady(n, &["share=1", "share=2"], one_ms)),
        ),
        (
            "share 1,2,3,4, 1 ms kernels",
            Box::new(move |n| steady(n, &["share=1", "share=2", "share=3", "share=4"], one_ms)),
        ),
        (
            "share 1,1,2,2,3,3,4,4, 1 ms kernels",
            Box::new(move |n| {
                steady(
                    n,
                    &[
                        "share=1", "share=1", "share=2", "share=2", "share=3", "share=3",
                        "share=4", "share=4",
                    ],
                    one_ms,
                )
            }),
        ),
        (
            "idle absorption, share 1:3, 1 ms",
            Box::new(idle_absorption),
        ),
        (
            "lone share, 50 us kernels",
            Box::new(|n| steady(n, &["share=1"], 50_000)),
        ),
    ];
    let mut rows = Vec::new();
    for (name, run) in &scenarios {
        if wanted(name) {
            eprintln!("running: {name}");
            rows.extend(run(name));
        }
    }
    if !rows.is_empty() {
        print_table(&rows);
    }
    if wanted("launch") {
        if !rows.is_empty() {
            println!();
        }
        eprintln!("running: launch cost");
        launch_cost();
    }
}
