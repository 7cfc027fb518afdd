//! Compute shares over time: two saturating tenants on one simulated GPU (dgx1-v100, GPU 0)
//! under `share=1` and `share=3`, each launching 20 ms of 1 ms kernels, synchronizing, and
//! again. Prints their split after the first second and writes target/compute-share.svg (copied
//! to docs/compute-share.svg): each tenant's share every 250 ms. Also prints the 1:3 split for
//! 2 ms steps, where it does not hold (see docs/compute.md).
//!
//! (Placement, exclusive against shared GPUs, is `cargo bench --bench utilization`:
//! crates/cli/benches/utilization.rs, docs/utilization.md.)
//!
//! Run: `cargo bench --bench compute_share`.
#[path = "../tests/common/mod.rs"]
mod common;

use cudarc::driver::sys as cu;
use std::ffi::c_void;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const WINDOW: Duration = Duration::from_secs(5);

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
        let coord = common::ledger_dir(&format!("share-coord-{tag}"));
        Run {
            state: common::state_file(&format!("share-{tag}")),
            coord,
        }
    }
    /// A job process under cuvisor (its own container: own ledger) with `compute`.
    fn spawn(&self, n: usize, ordinal: usize, compute: &str, busy_ms: u64, idle_ms: u64) -> Child {
        let ledger = common::ledger_dir(&format!(
            "share-ledger-{}-{n}",
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

fn svg(series: &[(f64, f64, f64)]) -> String {
    let mut out = String::from(
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="440" height="340" font-family="sans-serif" font-size="12">"##,
    );
    out.push_str(r##"<rect width="440" height="340" fill="white"/><text x="20" y="22" font-size="14">share=1 vs share=3 on one GPU (% of GPU time)</text>"##);
    out.push_str(r##"<rect x="20" y="50" width="380" height="250" fill="none" stroke="black"/>"##);
    let tmax = series.last().map_or(1.0, |p| p.0);
    for (idx, color) in [(1, "#c33"), (2, "#36c")] {
        let pts: Vec<String> = series
            .iter()
            .map(|p| {
                let v = if idx == 1 { p.1 } else { p.2 };
                format!("{:.1},{:.1}", 20.0 + 380.0 * p.0 / tmax, 300.0 - 2.5 * v)
            })
            .collect();
        out.push_str(&format!(
            r##"<polyline points="{}" fill="none" stroke="{color}" stroke-width="2"/>"##,
            pts.join(" ")
        ));
    }
    for (y, v) in [(300.0 - 2.5 * 25.0, "25"), (300.0 - 2.5 * 75.0, "75")] {
        out.push_str(&format!(r##"<line x1="20" y1="{y}" x2="400" y2="{y}" stroke="#ccc" stroke-dasharray="4"/><text x="405" y="{}">{v}%</text>"##, y + 4.0));
    }
    out.push_str(r##"<text x="20" y="320" fill="#c33">share=1</text><text x="100" y="320" fill="#36c">share=3</text><text x="300" y="320">time (s)</text></svg>"##);
    out
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
    // The plotted run: steps of 20 ms of kernels between synchronizations (a pipelined
    // program). Also measured: steps of 2 ms, a program that waits for the GPU almost at once.
    let series = share_over_time(20);
    let short = share_over_time(2);
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
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/compute-share.svg");
    std::fs::write(&path, svg(&series)).unwrap();
    println!("chart: {}", path.display());
}
