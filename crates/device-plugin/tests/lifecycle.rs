//! The plugin binary's own life, end to end with the fake kubelet (tests/support/kubelet.rs) on
//! the simulated GPU: NVML absent at start (it waits, alive and not ready, then registers once
//! the library appears), `[nvml] fail_on_init_error`, and `cuvisor-device-plugin probe` against
//! a plugin that is stopped (its runtime cannot run) or was killed (its status file left behind).

mod support;

use cuvisor_device_plugin::api;
use cuvisor_device_plugin::api::device_plugin_client::DevicePluginClient;
use cuvisor_device_plugin::status::STALE_AFTER;
use cuvisor_device_plugin::unix::connect_unix;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use support::kubelet::Kubelet;

const EXE: &str = env!("CARGO_BIN_EXE_cuvisor-device-plugin");

/// target/<profile>/, with libcuvisor.so and the simulated libraries built.
fn built() -> &'static Path {
    cuvisor_testkit::built(Path::new(EXE).parent().unwrap())
}

/// A test's directory, removed at the end.
struct Scratch(PathBuf);

impl Scratch {
    fn new(tag: &str) -> Scratch {
        let p = std::env::temp_dir().join(format!("cuvisor-life-{tag}-{}", std::process::id()));
        cuvisor_device_plugin::ledger_dir::detach_all_under(&p);
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(p.join("dp")).unwrap();
        std::fs::create_dir_all(p.join("dev")).unwrap();
        std::fs::write(p.join("dev/nvidia0"), "").unwrap();
        Scratch(p)
    }
    fn dp(&self) -> PathBuf {
        self.0.join("dp")
    }
    /// The plugin's configuration, no metrics endpoint, with `sections` appended.
    fn config(&self, sections: &str) -> PathBuf {
        self.config_with("metrics_address = \"\"", sections)
    }
    /// The plugin's configuration, with `metrics` (its metrics keys) and `sections`.
    fn config_with(&self, metrics: &str, sections: &str) -> PathBuf {
        let p = self.0.join("plugin.toml");
        std::fs::write(
            &p,
            format!(
                "version = 1\nsocket_dir = {:?}\nstate_root = {:?}\n{metrics}\n\
                 [pod_resources]\nsocket = \"\"\n[host]\nlibrary = {:?}\ntenant_glibc = {:?}\ndev_dir = {:?}\n{sections}\n",
                self.dp(),
                self.0.join("state"),
                built().join("deps/libcuvisor.so"),
                cuvisor_testkit::glibc_here(),
                self.0.join("dev"),
            ),
        )
        .unwrap();
        p
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        cuvisor_device_plugin::ledger_dir::detach_all_under(&self.0);
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The plugin binary, killed when dropped (continued first, if stopped).
struct Plugin(Child);

impl Drop for Plugin {
    fn drop(&mut self) {
        signal(&self.0, "CONT");
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn signal(c: &Child, sig: &str) {
    let ok = Command::new("kill")
        .args([&format!("-{sig}"), &c.id().to_string()])
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    assert!(ok || sig == "CONT", "kill -{sig} {}", c.id());
}

/// The plugin on the simulated single GPU, its stderr to `log`: with `--sim` (the simulated
/// library next to the executable), or, without, the simulator chosen by `CUVISOR_SIM` and
/// NVML from `[nvml] library`.
fn spawn(s: &Scratch, cfg: &Path, sim_flag: bool, log: &Path) -> Plugin {
    let mut cmd = Command::new(EXE);
    cmd.arg("--config").arg(cfg);
    if sim_flag {
        cmd.args(["--sim", "single"]);
    } else {
        cmd.env("CUVISOR_SIM", "single");
    }
    let child = cmd
        .env("CUVISOR_SIM_STATE", s.0.join("sim.state"))
        .env_remove("LD_PRELOAD")
        .env_remove("CUVISOR_CONFIG")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log).unwrap())
        .spawn()
        .expect("start cuvisor-device-plugin");
    Plugin(child)
}

/// `cuvisor-device-plugin probe --config cfg [--ready]`: the exit code and its one line.
fn probe(cfg: &Path, ready: bool) -> (i32, String) {
    let mut cmd = Command::new(EXE);
    cmd.arg("probe").arg("--config").arg(cfg);
    if ready {
        cmd.arg("--ready");
    }
    let out = cmd.output().expect("run probe");
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert_eq!(text.lines().count(), 1, "one line: {text:?}");
    (out.status.code().unwrap_or(-1), text.trim_end().to_string())
}

/// Probes until the answer is `code` (within `within`); the last line.
fn probe_until(cfg: &Path, ready: bool, code: i32, within: Duration) -> String {
    probe_until_says(cfg, ready, code, "", within)
}

/// Probes until the answer is `code` with a line containing `says` (within `within`).
fn probe_until_says(cfg: &Path, ready: bool, code: i32, says: &str, within: Duration) -> String {
    let t = Instant::now();
    loop {
        let (c, line) = probe(cfg, ready);
        if c == code && line.contains(says) {
            return line;
        }
        assert!(
            t.elapsed() < within,
            "probe{} still {c} after {within:?}: {line}",
            if ready { " --ready" } else { "" }
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

async fn first_list(dir: &Path, endpoint: &str) -> Vec<api::Device> {
    let ch = connect_unix(&dir.join(endpoint)).await.expect("connect");
    let mut c = DevicePluginClient::new(ch);
    let mut s = c.list_and_watch(api::Empty {}).await.unwrap().into_inner();
    s.message().await.unwrap().expect("a first list").devices
}

/// NVML not there when the plugin starts (the toolkit or the driver comes later): the plugin
/// stays up, alive and not ready, says so in one line while retrying every second, and once the
/// library appears at `[nvml] library` it registers with kubelet and serves. (Before: it exited
/// with status 2 at the first failure, and kubelet restarted it in a loop.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_nvml_the_plugin_waits_not_ready_and_serves_once_the_library_appears() {
    let s = Scratch::new("late-nvml");
    let mut kubelet = Kubelet::start(&s.dp());
    let lib = s.0.join("driver/lib64/libnvidia-ml.so.1");
    let cfg = s.config(&format!("[nvml]\nlibrary = {lib:?}\nretry_seconds = 1\n"));
    let log = s.0.join("plugin.log");
    let mut plugin = spawn(&s, &cfg, false, &log);

    // (The first status may be "starting", written before the first attempt.)
    probe_until_says(
        &cfg,
        false,
        0,
        "alive: waiting for NVML",
        Duration::from_secs(10),
    );
    std::thread::sleep(Duration::from_millis(3500));
    assert!(plugin.0.try_wait().unwrap().is_none(), "the plugin exited");
    let (code, line) = probe(&cfg, true);
    assert_eq!(code, 1, "{line}");
    assert!(
        line.contains("alive, not ready: waiting for NVML"),
        "{line}"
    );
    assert!(
        line.contains(&lib.display().to_string()),
        "names the library: {line}"
    );
    let (code, line) = probe(&cfg, false);
    assert_eq!(code, 0, "{line}");
    // Three retries or more, one line.
    let text = std::fs::read_to_string(&log).unwrap();
    let said: Vec<&str> = text.lines().filter(|l| l.contains("NVML")).collect();
    assert_eq!(said.len(), 1, "one line while waiting: {text}");
    assert!(said[0].contains("trying again every 1 s"), "{}", said[0]);

    std::fs::create_dir_all(lib.parent().unwrap()).unwrap();
    std::fs::copy(built().join("sim/libnvidia-ml.so.1"), &lib).unwrap();
    let regs = kubelet.registrations(2, Duration::from_secs(30)).await;
    let mem = &regs["cuvisor.io/gpu-memory"];
    assert!(!first_list(&s.dp(), &mem.endpoint).await.is_empty());
    let line = probe_until(&cfg, true, 0, Duration::from_secs(10));
    assert!(
        line.starts_with("cuvisor-device-plugin probe: ready"),
        "{line}"
    );
    drop(plugin);
}

/// `[nvml] fail_on_init_error = true`: NVML missing ends the plugin at once, status 2, one line
/// naming the library and the key (NVIDIA's FAIL_ON_INIT_ERROR=true).
#[test]
fn fail_on_init_error_exits_at_once_with_one_line() {
    let s = Scratch::new("fail-init");
    let lib = s.0.join("none/libnvidia-ml.so.1");
    let cfg = s.config(&format!(
        "[nvml]\nlibrary = {lib:?}\nfail_on_init_error = true\n"
    ));
    let log = s.0.join("plugin.log");
    let mut plugin = spawn(&s, &cfg, false, &log);
    let t = Instant::now();
    let status = loop {
        if let Some(st) = plugin.0.try_wait().unwrap() {
            break st;
        }
        assert!(t.elapsed() < Duration::from_secs(10), "still running");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(status.code(), Some(2));
    let text = std::fs::read_to_string(&log).unwrap();
    assert_eq!(text.lines().count(), 1, "{text}");
    assert!(text.contains("fail_on_init_error = true"), "{text}");
    assert!(text.contains(&lib.display().to_string()), "{text}");
    let (code, line) = probe(&cfg, false);
    assert_eq!(code, 1, "an exited plugin is not alive: {line}");
}

/// The attack on liveness: a plugin whose runtime cannot run (here: the whole process stopped
/// with SIGSTOP) still has its sockets and its last status. The probe says not alive once the
/// status is older than STALE_AFTER, and alive again once the plugin runs again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_plugin_is_not_alive_once_its_status_is_stale() {
    let s = Scratch::new("stopped");
    let mut kubelet = Kubelet::start(&s.dp());
    let cfg = s.config("");
    let plugin = spawn(&s, &cfg, true, &s.0.join("plugin.log"));
    kubelet.registrations(2, Duration::from_secs(30)).await;
    probe_until(&cfg, true, 0, Duration::from_secs(10));

    signal(&plugin.0, "STOP");
    let line = probe_until(&cfg, false, 1, STALE_AFTER + Duration::from_secs(5));
    assert!(line.contains("s old"), "{line}");
    let (code, _) = probe(&cfg, true);
    assert_eq!(code, 1);
    signal(&plugin.0, "CONT");
    probe_until(&cfg, true, 0, Duration::from_secs(10));
    drop(plugin);
}

/// A status file left by a plugin that was killed (SIGKILL: no clean-up) is fresh but not
/// alive: its writer is gone. A new instance on the same state root is alive again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_status_left_by_a_killed_plugin_is_not_alive() {
    let s = Scratch::new("killed");
    let mut kubelet = Kubelet::start(&s.dp());
    let cfg = s.config("");
    let mut plugin = spawn(&s, &cfg, true, &s.0.join("plugin.log"));
    kubelet.registrations(2, Duration::from_secs(30)).await;
    probe_until(&cfg, true, 0, Duration::from_secs(10));
    plugin.0.kill().unwrap();
    plugin.0.wait().unwrap();
    assert!(
        s.0.join("state/plugin.status").exists(),
        "the status is left behind"
    );
    let (code, line) = probe(&cfg, false);
    assert_eq!(code, 1, "{line}");
    assert!(line.contains("previous instance"), "{line}");

    let again = spawn(&s, &cfg, true, &s.0.join("plugin2.log"));
    kubelet.registrations(2, Duration::from_secs(30)).await;
    probe_until(&cfg, true, 0, Duration::from_secs(10));
    drop(again);
}

/// SIGTERM (kubelet stopping the pod) while waiting for NVML ends the plugin at once, cleanly
/// (status 0, its status file removed), not after the next retry or the pod's grace period.
#[test]
fn sigterm_while_waiting_for_nvml_ends_the_plugin_at_once() {
    let s = Scratch::new("term-wait");
    let lib = s.0.join("none/libnvidia-ml.so.1");
    let cfg = s.config(&format!(
        "[nvml]\nlibrary = {lib:?}\nretry_seconds = 3600\n"
    ));
    let mut plugin = spawn(&s, &cfg, false, &s.0.join("plugin.log"));
    probe_until_says(&cfg, false, 0, "waiting for NVML", Duration::from_secs(10));
    signal(&plugin.0, "TERM");
    let t = Instant::now();
    let status = loop {
        if let Some(st) = plugin.0.try_wait().unwrap() {
            break st;
        }
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "still running after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(status.code(), Some(0));
    assert!(!s.0.join("state/plugin.status").exists());
}

/// `metrics_address` is where /metrics and /healthz listen, and /healthz answers the plugin's
/// state as `probe` does; giving `metrics_port` too stops the plugin with one line naming both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_address_serves_healthz_from_the_plugins_state_and_both_keys_are_refused() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let s = Scratch::new("metrics-address");
    let mut kubelet = Kubelet::start(&s.dp());
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let cfg = s.config_with(&format!("metrics_address = \"127.0.0.1:{port}\""), "");
    let plugin = spawn(&s, &cfg, true, &s.0.join("plugin.log"));
    kubelet.registrations(2, Duration::from_secs(30)).await;
    probe_until(&cfg, true, 0, Duration::from_secs(10));
    let mut c = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    c.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut resp = String::new();
    c.read_to_string(&mut resp).await.unwrap();
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
    assert!(
        resp.contains("alive: serving and registered with kubelet"),
        "{resp}"
    );
    drop(plugin);

    let both = s.config_with(
        &format!("metrics_address = \"127.0.0.1:{port}\"\nmetrics_port = {port}"),
        "",
    );
    let out = Command::new(EXE)
        .arg("--config")
        .arg(&both)
        .args(["--sim", "single"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains("metrics_address") && err.contains("metrics_port"),
        "{err}"
    );
}
