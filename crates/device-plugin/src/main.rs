//! `cuvisor-device-plugin`: the kubelet device plugin for cuvisor.
//!
//! ```text
//! cuvisor-device-plugin [--config FILE] [--sim PRESET|MODEL_FILE]
//! cuvisor-device-plugin probe [--config FILE] [--ready]
//! ```
//!
//! `--sim` runs on the simulated GPU (sets `CUVISOR_SIM` and loads the simulated
//! libnvidia-ml.so.1 from `sim/` next to this executable, where a workspace build puts it).
//!
//! Before anything runs: the soft open-files limit is raised to the hard one, and the
//! configuration is checked (socket paths against `sun_path`, then, after discovery, every
//! ListAndWatch response against kubelet's 4 MiB); `[host] install_from`, when set, is copied
//! to `[host] library` (install.rs) before NVML is opened. A refusal, a library that cannot be
//! installed, or a socket that cannot be served later, exits with status 2 and one line:
//! `cuvisor-device-plugin: <the reason>`.
//!
//! Then NVML is opened (`[nvml] library`; empty: the loader's search for libnvidia-ml.so.1). While
//! it cannot be, the plugin stays up and not ready, logs one line (again only when the reason
//! changes, or every 10 minutes) and tries again every `[nvml] retry_seconds`; with
//! `[nvml] fail_on_init_error = true` it exits instead (status 2, one line). This is NVIDIA's
//! device plugin's `FAIL_ON_INIT_ERROR`: NVIDIA/k8s-device-plugin
//! `internal/plugin/manager/factory.go` returns a null manager when `nvml.Init` fails and
//! `failOnInitError` is false ("nvml init failed", logged as a warning), and
//! `cmd/nvidia-device-plugin/main.go` then logs "No devices found. Waiting indefinitely." and
//! waits, never trying NVML again until it is restarted (SIGHUP or a kubelet restart); with it
//! true, start-up fails. cuvisor retries by itself, so that a driver installed after the plugin
//! (the GPU Operator's driver container) is picked up without a restart.
//!
//! Runs: the self-check (its own sockets asked every 2 s; the status file `probe` reads); the
//! health monitor (NVML XIDs and NVLink, a thread of its own) feeding ListAndWatch; the kubelet
//! gRPC servers; the PodResources cache (`[pod_resources]`) for pod labels and the sweeper's
//! liveness rule; the metrics endpoint (`metrics_address`, "": none); the sweeper (a thread of
//! its own).
//!
//! `probe` is the DaemonSet's liveness (and, with `--ready`, readiness) exec probe: it reads
//! the running plugin's status file under the state root (`status`) and exits 0 when the
//! plugin is alive (ready: registered with kubelet and serving), else 1, with one line.

use clap::{Parser, Subcommand};
use cuvisor_device_plugin::cleanup::Sweeper;
use cuvisor_device_plugin::config::{self, Config};
use cuvisor_device_plugin::install;
use cuvisor_device_plugin::metrics::{self, Metrics};
use cuvisor_device_plugin::plugin::Plugin;
use cuvisor_device_plugin::podresources::PodCache;
use cuvisor_device_plugin::status::{self, Life, Need, Stage};
use cuvisor_device_plugin::topology::{discover, Allocator};
use cuvisor_device_plugin::{health, layout, selfcheck, server};
use nvml_wrapper::Nvml;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::net::TcpListener;

#[derive(Parser, Debug)]
#[command(
    name = "cuvisor-device-plugin",
    version,
    about = "cuvisor's Kubernetes device plugin"
)]
struct Args {
    #[command(subcommand)]
    command: Option<Command>,
    /// The plugin's configuration file (TOML); without it, the defaults.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Run on the simulated GPU: a preset (single, dgx1-v100, dgx-a100, h200, pcie-8) or a machine file.
    #[arg(long)]
    sim: Option<String>,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Exit 0 when the plugin configured by FILE is alive (with --ready: registered with kubelet
    /// and serving), else 1; one line either way. For the DaemonSet's exec probes.
    Probe {
        /// The plugin's configuration file (its state root holds the status).
        #[arg(long)]
        config: Option<PathBuf>,
        /// Ready rather than alive.
        #[arg(long)]
        ready: bool,
    },
}

/// What a node needs for NVML, said with its failure.
const NVML_HINT: &str =
    "the plugin needs the NVIDIA driver's libnvidia-ml.so.1: in its container, \
                         NVIDIA_VISIBLE_DEVICES=all and NVIDIA_DRIVER_CAPABILITIES=utility with \
                         the nvidia runtime class or CDI, or [nvml] library";

/// While NVML stays unavailable with the same reason, the reason is logged again this often.
const NVML_LOG_AGAIN: Duration = Duration::from_secs(600);

fn fail(msg: String) -> ! {
    eprintln!("cuvisor-device-plugin: {msg}");
    std::process::exit(2);
}

fn probe(config: Option<&Path>, ready: bool) -> ! {
    let need = if ready { Need::Ready } else { Need::Alive };
    let verdict = match config {
        Some(p) => Config::load(p).map_err(|e| format!("not alive: {e}")),
        None => Ok(Config::default()),
    }
    .and_then(|cfg| status::probe(&cfg.state_root.join(layout::STATUS), need));
    match verdict {
        Ok(line) => {
            println!("cuvisor-device-plugin probe: {line}");
            std::process::exit(0)
        }
        Err(line) => {
            eprintln!("cuvisor-device-plugin probe: {line}");
            std::process::exit(1)
        }
    }
}

/// The simulated NVML next to this executable, for `--sim`; `CUVISOR_SIM` set to `spec`.
/// Called while the process is single-threaded (the environment is written).
fn sim_library(spec: &str) -> Result<PathBuf, String> {
    let exe = std::env::current_exe().map_err(|e| format!("this executable: {e}"))?;
    let lib = exe
        .parent()
        .map(|d| d.join("sim").join("libnvidia-ml.so.1"))
        .unwrap_or_default();
    if !lib.exists() {
        return Err(format!(
            "the simulated NVML is not built: {} does not exist (a `cargo build` of the \
             workspace builds it into target/<profile>/sim/)",
            lib.display()
        ));
    }
    std::env::set_var("CUVISOR_SIM", spec);
    Ok(lib)
}

/// NVML from `library` (empty: the loader's search for libnvidia-ml.so.1).
fn open_nvml(library: &Path) -> Result<Nvml, String> {
    if library.as_os_str().is_empty() {
        Nvml::init().map_err(|e| {
            format!("cannot initialise NVML (libnvidia-ml.so.1, the loader's search): {e}")
        })
    } else {
        Nvml::builder()
            .lib_path(library.as_os_str())
            .init()
            .map_err(|e| format!("cannot initialise NVML ({}): {e}", library.display()))
    }
}

/// NVML, once it opens: tried every `[nvml] retry_seconds` while it does not (see the module
/// docs), or the reason when `[nvml] fail_on_init_error`. `None`: terminated while waiting.
async fn wait_for_nvml(
    n: &config::Nvml,
    library: &Path,
    life: &Life,
    mut stop: Stop,
) -> Result<Option<Nvml>, String> {
    let mut said: Option<(String, Instant)> = None;
    loop {
        let e = match open_nvml(library) {
            Ok(nvml) => {
                if said.is_some() {
                    eprintln!("cuvisor-device-plugin: NVML opened; starting");
                }
                return Ok(Some(nvml));
            }
            Err(e) if n.fail_on_init_error => {
                return Err(format!(
                    "{e} ([nvml] fail_on_init_error = true: exiting; {NVML_HINT})"
                ))
            }
            Err(e) => e,
        };
        let again = match &said {
            None => true,
            Some((last, at)) => *last != e || at.elapsed() >= NVML_LOG_AGAIN,
        };
        if again {
            eprintln!(
                "cuvisor-device-plugin: {e}; not ready, trying again every {} s ([nvml] \
                 retry_seconds; fail_on_init_error = true exits instead; {NVML_HINT})",
                n.retry_seconds
            );
            said = Some((e.clone(), Instant::now()));
        }
        life.set_stage(Stage::WaitingForNvml(e));
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_secs(n.retry_seconds)) => {}
            _ = stop.wait_for(|s| *s) => return Ok(None),
        }
    }
}

/// How long opening NVML, one attempt, or discovering the GPUs may take before the plugin
/// counts as stuck (discovery reads every GPU and NVLink: seconds on an 8-GPU node).
const STARTUP_PATIENCE: Duration = Duration::from_secs(300);

/// Whether SIGTERM or SIGINT has come (see [`catch_termination`]).
type Stop = tokio::sync::watch::Receiver<bool>;

/// Catches SIGTERM and SIGINT from now on (one listener for the process's life, so that a
/// signal that comes between two waits is not lost once tokio's handler is installed).
fn catch_termination(rt: &tokio::runtime::Runtime) -> Stop {
    let (tx, rx) = tokio::sync::watch::channel(false);
    rt.spawn(async move {
        terminated().await;
        let _ = tx.send(true);
    });
    rx
}

/// SIGTERM (how kubelet stops a pod) or SIGINT.
async fn terminated() {
    use tokio::signal::unix::{signal, SignalKind};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
        }
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

/// Raises the soft limit on open files to the hard limit, as Go programs (kubelet among them)
/// do at startup: every Allocate opens files, every kubelet connection and every metrics client
/// holds a descriptor, and a container runtime's default soft limit (often 1024) is far below
/// its hard one. A limit that cannot be raised stays as it is.
fn raise_open_files_limit() -> std::io::Result<()> {
    let mut l = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit into `l`, which lives for the call.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut l) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    if l.rlim_cur < l.rlim_max {
        l.rlim_cur = l.rlim_max;
        // SAFETY: setrlimit reads one rlimit from `l`, which lives for the call.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &l) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// `[host] install_from`: the library copied from this image to `[host] library`, or the
/// plugin stops (status 2, one line): Allocate must never mount a library that is not there.
fn install_library(cfg: &Config) {
    let (from, to) = (&cfg.host.install_from, &cfg.host.library);
    if from.as_os_str().is_empty() {
        return;
    }
    match install::install(from, to) {
        Ok(install::Installed::Unchanged) => eprintln!(
            "cuvisor-device-plugin: {} already holds {}",
            to.display(),
            from.display()
        ),
        Ok(install::Installed::Copied(n)) => eprintln!(
            "cuvisor-device-plugin: installed {} at {} ({n} bytes)",
            from.display(),
            to.display()
        ),
        Err(e) => fail(e),
    }
}

fn main() {
    let args = Args::parse();
    if let Some(Command::Probe { config, ready }) = &args.command {
        probe(config.as_deref(), *ready);
    }
    if let Err(e) = raise_open_files_limit() {
        eprintln!("cuvisor-device-plugin: cannot raise the open files limit: {e}");
    }
    let cfg = match &args.config {
        Some(p) => Config::load(p).unwrap_or_else(|e| fail(e.0)),
        None => Config::default(),
    };
    // The library must load in every tenant image (host.tenant_glibc; tenant_glibc.rs): the one
    // Allocate will mount, checked before it replaces the node's when it comes from the image.
    let tenant_glibc = cfg.tenant_glibc();
    if cfg.host.install_from.as_os_str().is_empty() {
        cuvisor_device_plugin::tenant_glibc::check_library(&cfg.host.library, tenant_glibc)
    } else {
        cuvisor_device_plugin::tenant_glibc::check_install_source(
            &cfg.host.install_from,
            tenant_glibc,
        )
    }
    .unwrap_or_else(|e| fail(e));
    // Before NVML: the library is on the host even while the driver is not (yet) reachable.
    install_library(&cfg);
    // Still single-threaded: the simulated library reads CUVISOR_SIM at init.
    let library = match args.sim.as_deref() {
        Some(spec) => sim_library(spec).unwrap_or_else(|e| fail(e)),
        None => cfg.nvml.library.clone(),
    };
    let metrics_at = cfg.metrics_address().unwrap_or_else(|e| fail(e.0));
    let rt = tokio::runtime::Runtime::new().unwrap_or_else(|e| fail(format!("tokio: {e}")));
    // The self-check runs from now on: `probe` sees the plugin starting, or waiting for NVML.
    std::fs::create_dir_all(&cfg.state_root)
        .unwrap_or_else(|e| fail(format!("{}: {e}", cfg.state_root.display())));
    let stop = catch_termination(&rt);
    let status_path = cfg.state_root.join(layout::STATUS);
    // A start-up stage that stays as it is longer than an NVML retry plus STARTUP_PATIENCE is
    // stuck (NVML or discovery hanging on a GPU): the probe then says not alive.
    let life = Arc::new(Life::with_patience(
        Duration::from_secs(cfg.nvml.retry_seconds) + STARTUP_PATIENCE,
    ));
    rt.spawn(selfcheck::run(status_path.clone(), life.clone()));
    let nvml = match rt.block_on(wait_for_nvml(&cfg.nvml, &library, &life, stop.clone())) {
        Ok(Some(nvml)) => Arc::new(nvml),
        Ok(None) => {
            drop(rt);
            let _ = std::fs::remove_file(&status_path);
            return;
        }
        Err(e) => fail(e),
    };
    life.set_stage(Stage::Starting);
    let topology = discover(&nvml).unwrap_or_else(|e| fail(format!("GPU discovery: {e:?}")));
    let (health_tx, health_rx) = cuvisor_device_plugin::health_channel();
    // Publishes the first health map at once, then every change (XIDs, NVLink).
    let mut monitor = health::Monitor::spawn_nvml(
        nvml.clone(),
        (&cfg.health).into(),
        health::to_watch(health_tx),
    );
    let grace = Duration::from_secs(cfg.cleanup.grace_seconds);
    let interval = Duration::from_secs(cfg.cleanup.interval_seconds);
    let allocator =
        Allocator::new(topology.clone()).unwrap_or_else(|e| fail(format!("topology: {e:?}")));
    let comm_model = metrics::comm::CommModel::new(allocator.clone());
    let scorer = metrics::topology_scorer(allocator, &topology, cfg.topology);
    let plugin =
        Arc::new(Plugin::new(cfg, topology, health_rx.clone()).unwrap_or_else(|e| fail(e)));
    let cfg = plugin.config().clone();
    // Each ListAndWatch response must fit in what kubelet receives.
    cuvisor_device_plugin::listing::check_list_sizes(&cfg, plugin.inventory())
        .unwrap_or_else(|e| fail(e));
    eprintln!(
        "cuvisor-device-plugin: {} GPU(s), {} memory unit(s); sockets in {}",
        plugin.inventory().gpus().len(),
        plugin
            .inventory()
            .gpus()
            .iter()
            .map(|g| g.units)
            .sum::<u32>(),
        cfg.socket_dir.display()
    );
    life.set_stage(Stage::Running(
        plugin
            .resources()
            .into_iter()
            .map(|(kind, name)| (name, cfg.socket_dir.join(server::endpoint(kind))))
            .collect(),
    ));
    let result = rt.block_on(async move {
        let pods = PodCache::new();
        let pr = &cfg.pod_resources;
        if !pr.socket.as_os_str().is_empty() {
            tokio::spawn(
                pods.clone()
                    .refresh(pr.socket.clone(), Duration::from_secs(pr.refresh_seconds)),
            );
        }
        let mut sweeper = Sweeper::new(plugin.registry_mut().clone(), grace)
            .with_coord_dir(cfg.host_coord_dir())
            .with_cdi_dir(cfg.cdi.spec_dir.clone());
        if !pr.socket.as_os_str().is_empty() {
            sweeper = sweeper.with_liveness(Box::new(pods.clone()));
        }
        let cleanup = sweeper.stats();
        if let Some(addr) = metrics_at {
            let listener = TcpListener::bind(addr)
                .await
                .map_err(|e| format!("metrics_address {addr}: {e}"))?;
            let m = Metrics::new(plugin.registry(), pods.clone())
                .with_health(health_rx)
                .with_scorer(scorer)
                .with_comm_model(comm_model)
                .with_cleanup(cleanup)
                .with_status(cfg.state_root.join(layout::STATUS));
            eprintln!(
                "cuvisor-device-plugin: metrics on http://{}/metrics",
                listener
                    .local_addr()
                    .map_or_else(|e| e.to_string(), |a| a.to_string())
            );
            tokio::spawn(metrics::serve(listener, Arc::new(m)));
        }
        // The sweeper on a thread of its own: its walks over tenant trees, bounded as they
        // are, take no time from the runtime's workers that serve kubelet.
        std::thread::Builder::new()
            .name("cuvisor-sweeper".into())
            .spawn(move || loop {
                std::thread::sleep(interval);
                for (id, why) in sweeper.sweep() {
                    eprintln!("cuvisor-device-plugin: removed allocation {id} ({why:?})");
                }
            })
            .map_err(|e| format!("the sweeper's thread: {e}"))?;
        let mut stop = stop;
        server::run(plugin, life, async move {
            let _ = stop.wait_for(|s| *s).await;
        })
        .await
    });
    // The runtime (and the plugin with it) goes before the health thread, then NVML.
    drop(rt);
    monitor.stop();
    drop(nvml);
    let _ = std::fs::remove_file(&status_path);
    if let Err(e) = result {
        fail(e);
    }
}
