//! Utilization, after the seeds' chart: 8 simulated GPUs (dgx1-v100) and 8 jobs that each keep a
//! GPU busy about 25 % of the time. Exclusive placement (one job per GPU, as whole-GPU scheduling
//! does) against shared placement (4 jobs per GPU under cuvisor's compute shares). Prints the
//! table and writes target/utilization.svg: the busy-% bars, and the share over time of a 1:3
//! `share` run on one GPU (each tenant: 20 ms of 1 ms kernels, synchronize, again). Also prints
//! the 1:3 split for 2 ms steps, where it does not hold (see the README).
//!
//! Run: `cargo bench --bench utilization`.
#[path = "../tests/common/mod.rs"]
mod common;

use cudarc::driver::sys as cu;
use std::ffi::c_void;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const WINDOW: Duration = Duration::from_secs(5);
const GPUS: usize = 8;

// SAFETY (for every `unsafe` block in this file): driver calls with valid out-pointers and live
// handles, as the driver API's contract asks.

fn ok(r: cu::CUresult) {
    assert_eq!(r, cu::CUresult::CUDA_SUCCESS);
}

/// Role "job": on GPU `ordinal`, launch `busy_ms` of sim_busy work then idle `idle_ms`, forever
/// (idle_ms 0: saturate). Prints iterations completed per second at the end of `secs`.
fn job(ordinal: i32, busy_ms: u64, idle_ms: u64, secs: u64) {
    let (mut ctx, mut m, mut f) = (
        std::ptr::null_mut(),
        std::ptr::null_mut(),
        std::ptr::null_mut(),
    );
    // SAFETY: see the file-level note.
    unsafe {
        ok(cu::cuInit(0));
        ok(cu::cuDevicePrimaryCtxRetain(&mut ctx, ordinal));
        ok(cu::cuCtxSetCurrent(ctx));
        ok(cu::cuModuleLoadData(
            &mut m,
            c"image".as_ptr() as *const c_void,
        ));
        ok(cu::cuModuleGetFunction(&mut f, m, c"sim_busy".as_ptr()));
    }
    let start = Instant::now();
    let mut iterations = 0u64;
    while start.elapsed() < Duration::from_secs(secs) {
        // One iteration: busy_ms of kernels (1 ms each), wait for them, then think for idle_ms.
        for _ in 0..busy_ms {
            let mut ns: u64 = 1_000_000;
            let mut args = [&mut ns as *mut u64 as *mut c_void];
            // SAFETY: see the file-level note.
            unsafe {
                ok(cu::cuLaunchKernel(
                    f,
                    1,
                    1,
                    1,
                    32,
                    1,
                    1,
                    0,
                    std::ptr::null_mut(),
                    args.as_mut_ptr(),
                    std::ptr::null_mut(),
                ))
            };
        }
        // SAFETY: see the file-level note.
        unsafe { ok(cu::cuStreamSynchronize(std::ptr::null_mut())) };
        iterations += 1;
        std::thread::sleep(Duration::from_millis(idle_ms));
    }
    println!("{:.2}", iterations as f64 / start.elapsed().as_secs_f64());
}

struct Run {
    state: std::path::PathBuf,
    coord: std::path::PathBuf,
}

impl Run {
    fn new(tag: &str) -> Run {
        let coord = common::ledger_dir(&format!("util-coord-{tag}"));
        Run {
            state: common::state_file(&format!("util-{tag}")),
            coord,
        }
    }
    /// A job process under cuvisor (its own container: own ledger) with `compute`.
    fn spawn(&self, n: usize, ordinal: usize, compute: &str, busy_ms: u64, idle_ms: u64) -> Child {
        let ledger = common::ledger_dir(&format!(
            "util-ledger-{}-{n}",
            self.coord.file_name().unwrap().to_string_lossy()
        ));
        let mut c = Command::new(std::env::current_exe().unwrap());
        c.env("CUVISOR_BENCH_ROLE", "job")
            .env(
                "JOB",
                format!("{ordinal} {busy_ms} {idle_ms} {}", WINDOW.as_secs() + 1),
            )
            .env("CUVISOR_SIM", "dgx1-v100")
            .env("CUVISOR_SIM_STATE", &self.state)
            .env("LD_LIBRARY_PATH", common::sim_dir())
            .stdout(Stdio::piped());
        common::cuvisor_env(&mut c, &ledger, Some("4Gi"));
        // After cuvisor_env, which gives each container a coordinator of its own.
        c.env("CUVISOR_COMPUTE", compute)
            .env("CUVISOR_COORD_DIR", &self.coord);
        c.spawn().unwrap()
    }
}

fn sim(state: &std::path::Path) -> cuvisor_sim::state::Shared {
    let model = cuvisor_sim::model::preset("dgx1-v100").unwrap();
    cuvisor_sim::state::Shared::attach_at(&model, state).unwrap()
}

/// Busy % of each GPU over the window, measured from the simulator's timeline.
fn busy_percent(state: &std::path::Path) -> Vec<f64> {
    let s = sim(state);
    (0..GPUS)
        .map(|d| s.device_utilization(d, WINDOW.as_nanos() as u64 - 500_000_000) as f64)
        .collect()
}

fn finish(children: Vec<Child>) -> Vec<f64> {
    children
        .into_iter()
        .map(|c| {
            let out = c.wait_with_output().unwrap();
            assert!(out.status.success());
            String::from_utf8_lossy(&out.stdout)
                .trim()
                .parse()
                .unwrap_or(0.0)
        })
        .collect()
}

/// (label, busy % per GPU, job iterations/s)
fn placement(tag: &str, gpu_of_job: impl Fn(usize) -> usize) -> (Vec<f64>, Vec<f64>) {
    let run = Run::new(tag);
    // 5 ms of work then 15 ms of thinking: 25 % of a GPU when alone.
    let kids: Vec<Child> = (0..8)
        .map(|j| run.spawn(j, gpu_of_job(j), "share=1", 5, 15))
        .collect();
    std::thread::sleep(WINDOW);
    let busy = busy_percent(&run.state);
    (busy, finish(kids))
}

/// Two saturating tenants with share=1 and share=3 on GPU 0, each launching `step_ms` of 1 ms
/// kernels then synchronizing, in a loop: their share every 250 ms.
fn share_over_time(step_ms: u64) -> Vec<(f64, f64, f64)> {
    let run = Run::new(&format!("share13-{step_ms}"));
    let kids = vec![
        run.spawn(100, 0, "share=1", step_ms, 0),
        run.spawn(101, 0, "share=3", step_ms, 0),
    ];
    let pids: Vec<u32> = kids.iter().map(|k| k.id()).collect();
    let s = sim(&run.state);
    let mut points = Vec::new();
    let t0 = Instant::now();
    let step = Duration::from_millis(250);
    while t0.elapsed() < WINDOW {
        std::thread::sleep(step);
        let since = cuvisor_sim::state::now_ns() - step.as_nanos() as u64;
        let busy: Vec<u64> = pids
            .iter()
            .map(|&pid| s.pid_busy_since(pid, 0, since))
            .collect();
        let total = step.as_nanos() as f64;
        points.push((
            t0.elapsed().as_secs_f64(),
            100.0 * busy[0] as f64 / total,
            100.0 * busy[1] as f64 / total,
        ));
    }
    for mut k in kids {
        let _ = k.kill();
        let _ = k.wait();
    }
    points
}

fn svg(exclusive: &[f64], shared: &[f64], series: &[(f64, f64, f64)]) -> String {
    let mut out = String::from(
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="900" height="380" font-family="sans-serif" font-size="12">"##,
    );
    out.push_str(r##"<rect width="900" height="380" fill="white"/><text x="20" y="22" font-size="14">GPU busy % per GPU, 8 jobs at 25 % each</text>"##);
    for (row, (label, vals, color)) in [
        ("exclusive (1 job/GPU)", exclusive, "#999"),
        ("shared (4 jobs/GPU, cuvisor)", shared, "#2a7"),
    ]
    .iter()
    .enumerate()
    {
        for (g, v) in vals.iter().enumerate() {
            let x = 40.0 + g as f64 * 50.0 + row as f64 * 22.0;
            let h = v * 2.5;
            out.push_str(&format!(
                r##"<rect x="{x}" y="{}" width="20" height="{h}" fill="{color}"/>"##,
                300.0 - h
            ));
        }
        out.push_str(&format!(r##"<rect x="40" y="{}" width="10" height="10" fill="{color}"/><text x="55" y="{}">{label}</text>"##, 330 + row * 18, 339 + row * 18));
    }
    for g in 0..GPUS {
        out.push_str(&format!(
            r##"<text x="{}" y="315">GPU{g}</text>"##,
            45 + g * 50
        ));
    }
    out.push_str(r##"<line x1="35" y1="50" x2="35" y2="300" stroke="black"/><text x="5" y="55">100</text><text x="15" y="300">0</text>"##);
    // Share over time, right panel.
    out.push_str(r##"<text x="480" y="22" font-size="14">share=1 vs share=3 on one GPU (% of GPU time)</text>"##);
    out.push_str(r##"<rect x="480" y="50" width="380" height="250" fill="none" stroke="black"/>"##);
    let tmax = series.last().map_or(1.0, |p| p.0);
    for (idx, color) in [(1, "#c33"), (2, "#36c")] {
        let pts: Vec<String> = series
            .iter()
            .map(|p| {
                let v = if idx == 1 { p.1 } else { p.2 };
                format!("{:.1},{:.1}", 480.0 + 380.0 * p.0 / tmax, 300.0 - 2.5 * v)
            })
            .collect();
        out.push_str(&format!(
            r##"<polyline points="{}" fill="none" stroke="{color}" stroke-width="2"/>"##,
            pts.join(" ")
        ));
    }
    for (y, v) in [(300.0 - 2.5 * 25.0, "25"), (300.0 - 2.5 * 75.0, "75")] {
        out.push_str(&format!(r##"<line x1="480" y1="{y}" x2="860" y2="{y}" stroke="#ccc" stroke-dasharray="4"/><text x="865" y="{}">{v}%</text>"##, y + 4.0));
    }
    out.push_str(r##"<text x="480" y="320" fill="#c33">share=1</text><text x="560" y="320" fill="#36c">share=3</text><text x="760" y="320">time (s)</text></svg>"##);
    out
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len() as f64
}

fn main() {
    if std::env::var("CUVISOR_BENCH_ROLE").as_deref() == Ok("job") {
        let a: Vec<u64> = std::env::var("JOB")
            .unwrap()
            .split(' ')
            .map(|x| x.parse().unwrap())
            .collect();
        return job(a[0] as i32, a[1], a[2], a[3]);
    }
    let (excl_busy, excl_rate) = placement("exclusive", |j| j);
    let (shared_busy, shared_rate) = placement("shared", |j| j / 4);
    // The plotted run: steps of 20 ms of kernels between synchronizations (a pipelined
    // program). Also measured: steps of 2 ms, a program that waits for the GPU almost at once.
    let series = share_over_time(20);
    let short = share_over_time(2);
    let used = |b: &[f64]| b.iter().filter(|&&x| x > 1.0).count();
    let used_mean = |b: &[f64]| {
        let v: Vec<f64> = b.iter().copied().filter(|&x| x > 1.0).collect();
        if v.is_empty() {
            0.0
        } else {
            mean(&v)
        }
    };
    println!("utilization, 8 jobs x 25 % GPU demand on 8 simulated GPUs ({}-s windows, from the simulator's timeline)", WINDOW.as_secs());
    println!(
        "{:<30} {:>10} {:>16} {:>16} {:>18}",
        "placement", "GPUs used", "busy % (used)", "busy % (all 8)", "job iterations/s"
    );
    println!(
        "{:<30} {:>10} {:>16.1} {:>16.1} {:>18.1}",
        "exclusive, 1 job per GPU",
        used(&excl_busy),
        used_mean(&excl_busy),
        mean(&excl_busy),
        mean(&excl_rate)
    );
    println!(
        "{:<30} {:>10} {:>16.1} {:>16.1} {:>18.1}",
        "shared, 4 jobs per GPU",
        used(&shared_busy),
        used_mean(&shared_busy),
        mean(&shared_busy),
        mean(&shared_rate)
    );
    for (what, points) in [("20 ms steps (plotted)", &series), ("2 ms steps", &short)] {
        let late: Vec<&(f64, f64, f64)> = points.iter().filter(|p| p.0 > 1.0).collect();
        let (a, b) = (
            late.iter().map(|p| p.1).sum::<f64>() / late.len().max(1) as f64,
            late.iter().map(|p| p.2).sum::<f64>() / late.len().max(1) as f64,
        );
        println!(
            "share=1 vs share=3 on one GPU, {what}, after the first second: {a:.1} % / {b:.1} % \
             (target 25 / 75)"
        );
    }
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/utilization.svg");
    std::fs::write(&path, svg(&excl_busy, &shared_busy, &series)).unwrap();
    println!("chart: {}", path.display());
}
