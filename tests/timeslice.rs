//! Compute time slices, end to end on the simulator: tenants (each a process under cuvisor with a
//! state directory of its own = a container) saturate one simulated GPU with `sim_busy` kernels;
//! what each gets is read from the simulator's own per-process busy time, never from cuvisor's
//! counters.
//!
//! Windows are 2 s, held to +/- 5 pp (`cuvisor_testkit::SHARE_TOLERANCE` says why); the issue's
//! +/- 2 pp bar is the benchmark's (`cargo bench --bench timeslice`, 5 s windows). The tests share one
//! lock so that they do not compete for CPU time on small CI machines.
mod common;
#[path = "common/workload.rs"]
mod workload;

use cuvisor_sim::state::{now_ns, Shared};
use cuvisor_testkit::assert_share_near as within;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Duration;

static SERIAL: Mutex<()> = Mutex::new(());

/// One tenant: a container of its own (ledger directory), on the shared simulator state and
/// coordinator directory.
struct Tenant {
    child: std::process::Child,
    ledger: PathBuf,
}

struct Gpu {
    state: PathBuf,
    coord: PathBuf,
    sim: Shared,
    tag: String,
}

impl Gpu {
    fn new(tag: &str) -> Gpu {
        let state = common::state_file(&format!("ts-{tag}"));
        let coord = common::ledger_dir(&format!("ts-coord-{tag}"));
        let model = cuvisor_sim::model::preset("single").unwrap();
        let sim = Shared::attach_at(&model, &state).unwrap();
        Gpu {
            state,
            coord,
            sim,
            tag: tag.into(),
        }
    }

    fn tenant(&self, test: &str, i: usize, compute: &str, vars: &[(&str, &str)]) -> Tenant {
        let ledger = common::ledger_dir(&format!("ts-{}-{i}", self.tag));
        let mut c = common::Child::new(test).state(&self.state);
        for (k, v) in vars {
            c = c.env(k, v);
        }
        let mut cmd = c.command();
        common::cuvisor_env(&mut cmd, &ledger, Some("8Gi"));
        cmd.env("CUVISOR_COMPUTE", compute)
            .env("CUVISOR_COORD_DIR", &self.coord)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        Tenant {
            child: cmd.spawn().unwrap(),
            ledger,
        }
    }

    /// Busy ns of process `pid` on the simulated GPU in [since, now).
    fn busy(&self, pid: u32, since: u64) -> u64 {
        self.sim.pid_busy_since(pid, 0, since)
    }

    /// Shares (fractions of the window) of each tenant over `window` starting now.
    fn shares(&self, tenants: &[&Tenant], window: Duration) -> Vec<f64> {
        let t0 = now_ns();
        std::thread::sleep(window);
        let t1 = now_ns();
        tenants
            .iter()
            .map(|t| self.busy(t.child.id(), t0) as f64 / (t1 - t0) as f64)
            .collect()
    }
}

impl Drop for Gpu {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.state);
        let _ = std::fs::remove_dir_all(&self.coord);
    }
}

fn finish(t: Tenant) {
    let out = t.child.wait_with_output().unwrap();
    common::Ran(out).success();
    let _ = std::fs::remove_dir_all(&t.ledger);
}

const WARMUP: Duration = Duration::from_millis(700);
const WINDOW: Duration = Duration::from_secs(2);

fn limits_30_70(test: &str, kernel_ns: &str) {
    let _l = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let gpu = Gpu::new(test);
    let v = [("KERNEL_NS", kernel_ns), ("SECONDS", "3.2")];
    let a = gpu.tenant(test, 0, "limit=30", &v);
    let b = gpu.tenant(test, 1, "limit=70", &v);
    std::thread::sleep(WARMUP);
    let s = gpu.shares(&[&a, &b], WINDOW);
    within(s[0], 0.30, "limit=30 next to limit=70");
    within(s[1], 0.70, "limit=70 next to limit=30");
    finish(a);
    finish(b);
}

#[test]
fn limits_of_30_and_70_percent_hold_with_1ms_kernels() {
    if common::is_child() {
        return workload::run();
    }
    limits_30_70(
        "limits_of_30_and_70_percent_hold_with_1ms_kernels",
        "1000000",
    );
}

#[test]
fn limits_of_30_and_70_percent_hold_with_50us_kernels() {
    if common::is_child() {
        return workload::run();
    }
    limits_30_70(
        "limits_of_30_and_70_percent_hold_with_50us_kernels",
        "50000",
    );
}

/// Alone on an idle GPU a limit still holds, and the container's ledger shows what it used
/// (as the simulator saw it), that it was held back, and how many launches it made.
#[test]
fn a_lone_limit_of_30_percent_holds_on_an_idle_gpu() {
    const T: &str = "a_lone_limit_of_30_percent_holds_on_an_idle_gpu";
    if common::is_child() {
        return workload::run();
    }
    let _l = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let gpu = Gpu::new(T);
    let a = gpu.tenant(
        T,
        0,
        "limit=30",
        &[("KERNEL_NS", "1000000"), ("SECONDS", "3.0")],
    );
    std::thread::sleep(WARMUP);
    let pid = a.child.id();
    let l = cuvisor_shm::ledger::Ledger::open(&a.ledger.join("ledger"), false).unwrap();
    use std::sync::atomic::Ordering::Relaxed;
    let metrics = || {
        let (_, _, d) = l.devices().next().unwrap();
        (
            d.gpu_ns.load(Relaxed),
            d.throttled_ns.load(Relaxed),
            d.launches.load(Relaxed),
        )
    };
    let (t0, m0) = (now_ns(), metrics());
    let s = gpu.shares(&[&a], WINDOW);
    let (busy, m1) = (gpu.busy(pid, t0), metrics());
    within(s[0], 0.30, "lone limit=30");
    let used = m1.0 - m0.0;
    println!(
        "ledger over the window: gpu {used} ns (simulator {busy} ns), throttled {} ns, {} launches",
        m1.1 - m0.1,
        m1.2 - m0.2
    );
    assert!(
        (used as f64 - busy as f64).abs() < 0.02 * busy as f64,
        "GPU time in the ledger {used} vs the simulator's {busy}"
    );
    assert!(m1.1 - m0.1 > WINDOW.as_nanos() as u64 / 2, "throttled");
    let ledger = a.ledger.clone();
    let out = a.child.wait_with_output().unwrap();
    let ran = common::Ran(out).success();
    let launches = metrics().2;
    let launched: u64 = ran
        .stdout()
        .lines()
        // (The child's test harness may have written "test NAME ... " ahead on the line.)
        .find_map(|l| l.split("stopped after ").nth(1))
        .and_then(|l| l.split_whitespace().next())
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        launches.abs_diff(launched) <= 32,
        "{launches} vs {launched}"
    );
    let _ = std::fs::remove_dir_all(&ledger);
}

/// Tenants of `weights` saturate one GPU with 1 ms kernels; each gets weight/sum of its time.
fn shares_hold(test: &str, weights: &[u32]) {
    shares_hold_with(test, weights, &[]);
}

fn shares_hold_with(test: &str, weights: &[u32], vars: &[(&str, &str)]) {
    let s = saturate(test, weights, vars);
    let sum: u32 = weights.iter().sum();
    for (i, (w, got)) in weights.iter().zip(&s).enumerate() {
        within(
            *got,
            *w as f64 / sum as f64,
            &format!("tenant {i}, share={w} of {sum}"),
        );
    }
}

/// Tenants of `weights` running 1 ms kernels (and `vars`) on one GPU: what each got over the
/// window, once they have all ended well.
fn saturate(test: &str, weights: &[u32], vars: &[(&str, &str)]) -> Vec<f64> {
    let _l = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let gpu = Gpu::new(test);
    let mut v = vec![("KERNEL_NS", "1000000"), ("SECONDS", "3.5")];
    v.extend_from_slice(vars);
    let tenants: Vec<Tenant> = weights
        .iter()
        .enumerate()
        .map(|(i, w)| gpu.tenant(test, i, &format!("share={w}"), &v))
        .collect();
    // Eight debug-build processes start on two cores in about half a second.
    std::thread::sleep(WARMUP + Duration::from_millis(300));
    let s = gpu.shares(&tenants.iter().collect::<Vec<_>>(), WINDOW);
    println!(
        "{weights:?} {vars:?}: {:?} % (GPU busy {:.1} %)",
        s.iter()
            .map(|x| (x * 1000.0).round() / 10.0)
            .collect::<Vec<_>>(),
        s.iter().sum::<f64>() * 100.0
    );
    tenants.into_iter().for_each(finish);
    s
}

#[test]
fn shares_of_1_and_3_converge_to_25_and_75_percent() {
    const T: &str = "shares_of_1_and_3_converge_to_25_and_75_percent";
    if common::is_child() {
        return workload::run();
    }
    shares_hold(T, &[1, 3]);
}

/// Programs that wait for the GPU at every step (20 kernels, then cuStreamSynchronize) are split
/// by weight too, although neither keeps work queued all the time.
#[test]
fn shares_of_1_and_3_hold_for_programs_that_synchronize_every_step() {
    const T: &str = "shares_of_1_and_3_hold_for_programs_that_synchronize_every_step";
    if common::is_child() {
        return workload::run();
    }
    shares_hold_with(T, &[1, 3], &[("STEP_KERNELS", "20")]);
}

/// With steps of only 2 kernels, the weight-3 program uses less than its part not because it has
/// nothing to run but because its every step waits behind the other's work: it must not lend
/// its part (it did: 42/58). Weight 1 gets its 25 %; weight 3 the rest, less the gaps its own
/// synchronizations leave (the GPU stays at least 95 % busy).
#[test]
fn a_program_that_waits_on_the_gpu_every_step_does_not_lend_its_share() {
    const T: &str = "a_program_that_waits_on_the_gpu_every_step_does_not_lend_its_share";
    if common::is_child() {
        return workload::run();
    }
    let s = saturate(T, &[1, 3], &[("STEP_KERNELS", "2")]);
    within(s[0], 0.25, "share=1 next to a synchronizing share=3");
    assert!(
        s[0] + s[1] >= 0.95,
        "GPU busy {:.1} %",
        (s[0] + s[1]) * 100.0
    );
}

#[test]
fn four_tenants_of_weights_1_to_4_get_10_20_30_40_percent() {
    const T: &str = "four_tenants_of_weights_1_to_4_get_10_20_30_40_percent";
    if common::is_child() {
        return workload::run();
    }
    shares_hold(T, &[1, 2, 3, 4]);
}

#[test]
fn eight_tenants_of_mixed_weights_each_get_weight_over_sum() {
    const T: &str = "eight_tenants_of_mixed_weights_each_get_weight_over_sum";
    if common::is_child() {
        return workload::run();
    }
    shares_hold(T, &[1, 1, 2, 2, 3, 3, 4, 4]);
}

/// When the weight-3 tenant stops launching, the weight-1 tenant has the GPU within a second
/// and the GPU stays busy.
#[test]
fn an_idle_tenants_time_goes_to_the_busy_one_within_a_second() {
    const T: &str = "an_idle_tenants_time_goes_to_the_busy_one_within_a_second";
    if common::is_child() {
        return workload::run();
    }
    let _l = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let gpu = Gpu::new(T);
    let a = gpu.tenant(
        T,
        0,
        "share=1",
        &[("KERNEL_NS", "1000000"), ("SECONDS", "3.5")],
    );
    let b = gpu.tenant(
        T,
        1,
        "share=3",
        &[
            ("KERNEL_NS", "1000000"),
            ("SECONDS", "3.5"),
            ("IDLE_AFTER", "1.0"),
        ],
    );
    // b stops at ~1.0 s (after its start); from 2.0 s on, a must have the GPU.
    std::thread::sleep(Duration::from_millis(2000));
    let s = gpu.shares(&[&a, &b], Duration::from_millis(1200));
    println!(
        "after b went idle: a {:.2} %, b {:.2} %",
        s[0] * 100.0,
        s[1] * 100.0
    );
    assert!(s[1] < 0.01, "b is idle");
    assert!(
        s[0] + s[1] >= 0.95,
        "GPU busy {:.2} %",
        (s[0] + s[1]) * 100.0
    );
    finish(a);
    finish(b);
}

#[test]
fn a_lone_share_tenant_gets_the_whole_gpu() {
    const T: &str = "a_lone_share_tenant_gets_the_whole_gpu";
    if common::is_child() {
        return workload::run();
    }
    let _l = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let gpu = Gpu::new(T);
    let a = gpu.tenant(
        T,
        0,
        "share=1",
        &[("KERNEL_NS", "50000"), ("SECONDS", "2.2")],
    );
    std::thread::sleep(WARMUP);
    let s = gpu.shares(&[&a], Duration::from_millis(1200));
    println!("lone share: {:.2} %", s[0] * 100.0);
    assert!(s[0] >= 0.95, "lone share got {:.2} %", s[0] * 100.0);
    finish(a);
}

/// Work started only through cuGraphLaunch, or only through cooperative launches, is held to the
/// cap like plain launches (unthrottled, either would take the whole GPU).
#[test]
fn graph_and_cooperative_launches_are_throttled_too() {
    const T: &str = "graph_and_cooperative_launches_are_throttled_too";
    if common::is_child() {
        return workload::run();
    }
    let _l = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let gpu = Gpu::new(T);
    let g = gpu.tenant(
        T,
        0,
        "limit=30",
        &[
            ("KERNEL_NS", "1000000"),
            ("SECONDS", "3.0"),
            ("HOW", "graph"),
        ],
    );
    let c = gpu.tenant(
        T,
        1,
        "limit=20",
        &[("KERNEL_NS", "200000"), ("SECONDS", "3.0"), ("HOW", "coop")],
    );
    std::thread::sleep(WARMUP);
    let s = gpu.shares(&[&g, &c], WINDOW);
    within(s[0], 0.30, "graph launches under limit=30");
    within(s[1], 0.20, "cooperative launches under limit=20");
    finish(g);
    finish(c);
}

/// A tenant killed with SIGKILL in the middle of its burst stops counting within a second: the
/// other then has the whole GPU.
#[test]
fn a_killed_tenants_share_is_released_within_a_second() {
    const T: &str = "a_killed_tenants_share_is_released_within_a_second";
    if common::is_child() {
        return workload::run();
    }
    let _l = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let gpu = Gpu::new(T);
    let v = [("KERNEL_NS", "1000000"), ("SECONDS", "3.5")];
    let a = gpu.tenant(T, 0, "share=1", &v);
    let mut b = gpu.tenant(T, 1, "share=1", &v);
    std::thread::sleep(WARMUP);
    let s = gpu.shares(&[&a, &b], Duration::from_millis(500));
    println!("before: a {:.2} %, b {:.2} %", s[0] * 100.0, s[1] * 100.0);
    assert!(s[1] > 0.3, "b was busy");
    b.child.kill().unwrap(); // SIGKILL
    b.child.wait().unwrap();
    std::thread::sleep(Duration::from_secs(1));
    let s = gpu.shares(&[&a], Duration::from_millis(800));
    println!("from 1 s after the kill: a {:.2} %", s[0] * 100.0);
    assert!(s[0] >= 0.95, "a got {:.2} %", s[0] * 100.0);
    finish(a);
    let _ = std::fs::remove_dir_all(&b.ledger);
}
