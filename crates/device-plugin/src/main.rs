//! `cuvisor-device-plugin`: the kubelet device plugin for cuvisor.
//!
//! ```text
//! cuvisor-device-plugin [--config FILE] [--sim PRESET|MODEL_FILE]
//! ```
//!
//! `--sim` runs on the simulated GPU (sets `CUVISOR_SIM` and loads the simulated
//! libnvidia-ml.so.1 from `sim/` next to this executable, where a workspace build puts it).
//!
//! Before anything runs: the soft open-files limit is raised to the hard one, and the
//! configuration is checked (socket paths against `sun_path`, then, after discovery, every
//! ListAndWatch response against kubelet's 4 MiB); a refusal, or a socket that cannot be served
//! later, exits with status 2 and one line: `cuvisor-device-plugin: <the reason>`.
//!
//! Runs: the health monitor (NVML XIDs and NVLink, a thread of its own) feeding ListAndWatch;
//! the kubelet gRPC servers; the PodResources cache (`[pod_resources]`) for pod labels and the
//! sweeper's liveness rule; the metrics endpoint (`metrics_port`, 0: none); the sweeper (a
//! thread of its own).

use clap::Parser;
use cuvisor_device_plugin::cleanup::Sweeper;
use cuvisor_device_plugin::config::Config;
use cuvisor_device_plugin::health;
use cuvisor_device_plugin::metrics::{self, Metrics};
use cuvisor_device_plugin::plugin::Plugin;
use cuvisor_device_plugin::podresources::PodCache;
use cuvisor_device_plugin::server;
use cuvisor_device_plugin::topology::{discover, Allocator};
use nvml_wrapper::Nvml;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;

#[derive(Parser, Debug)]
#[command(
    name = "cuvisor-device-plugin",
    version,
    about = "cuvisor's Kubernetes device plugin"
)]
struct Args {
    /// The plugin's configuration file (TOML); without it, the defaults.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Run on the simulated GPU: a preset (single, dgx1-v100, dgx-a100, pcie-8) or a machine file.
    #[arg(long)]
    sim: Option<String>,
}

fn fail(msg: String) -> ! {
    eprintln!("cuvisor-device-plugin: {msg}");
    std::process::exit(2);
}

fn open_nvml(sim: Option<&str>) -> Result<Nvml, String> {
    match sim {
        None => Nvml::init().map_err(|e| {
            format!(
                "cannot initialise NVML (libnvidia-ml.so.1): {e}. Is the NVIDIA driver installed? \
                 To use the simulator instead: --sim PRESET"
            )
        }),
        Some(spec) => {
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
            // Still single-threaded: the simulated library reads this at init.
            std::env::set_var("CUVISOR_SIM", spec);
            Nvml::builder()
                .lib_path(lib.as_os_str())
                .init()
                .map_err(|e| {
                    format!(
                        "cannot initialise the simulated NVML {}: {e}",
                        lib.display()
                    )
                })
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

fn main() {
    let args = Args::parse();
    if let Err(e) = raise_open_files_limit() {
        eprintln!("cuvisor-device-plugin: cannot raise the open files limit: {e}");
    }
    let cfg = match &args.config {
        Some(p) => Config::load(p).unwrap_or_else(|e| fail(e.0)),
        None => Config::default(),
    };
    // The library must load in every tenant image (host.tenant_glibc; tenant_glibc.rs).
    cuvisor_device_plugin::tenant_glibc::check_library(&cfg.host.library, cfg.tenant_glibc())
        .unwrap_or_else(|e| fail(e));
    let nvml = Arc::new(open_nvml(args.sim.as_deref()).unwrap_or_else(|e| fail(e)));
    let topology = discover(&nvml).unwrap_or_else(|e| fail(format!("GPU discovery: {e:?}")));
    let rt = tokio::runtime::Runtime::new().unwrap_or_else(|e| fail(format!("tokio: {e}")));
    let (health_tx, health_rx) = cuvisor_device_plugin::health_channel();
    // Publishes the first health map at once, then every change (XIDs, NVLink).
    let mut monitor = health::Monitor::spawn_nvml(
        nvml.clone(),
        (&cfg.health).into(),
        health::to_watch(health_tx),
    );
    let grace = Duration::from_secs(cfg.cleanup.grace_seconds);
    let interval = Duration::from_secs(cfg.cleanup.interval_seconds);
    let scorer = metrics::topology_scorer(
        Allocator::new(topology.clone()).unwrap_or_else(|e| fail(format!("topology: {e:?}"))),
        &topology,
        cfg.topology,
    );
    let plugin =
        Arc::new(Plugin::new(cfg, topology, health_rx.clone()).unwrap_or_else(|e| fail(e)));
    let cfg = plugin.config().clone();
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
    let result = rt.block_on(async move {
        let pods = PodCache::new();
        let pr = &cfg.pod_resources;
        if !pr.socket.as_os_str().is_empty() {
            tokio::spawn(
                pods.clone()
                    .refresh(pr.socket.clone(), Duration::from_secs(pr.refresh_seconds)),
            );
        }
        let mut sweeper =
            Sweeper::new(plugin.registry_mut().clone(), grace).with_coord_dir(cfg.host_coord_dir());
        if !pr.socket.as_os_str().is_empty() {
            sweeper = sweeper.with_liveness(Box::new(pods.clone()));
        }
        let cleanup = sweeper.stats();
        if cfg.metrics_port != 0 {
            let listener = TcpListener::bind(("0.0.0.0", cfg.metrics_port))
                .await
                .map_err(|e| format!("metrics port {}: {e}", cfg.metrics_port))?;
            let m = Metrics::new(plugin.registry(), pods.clone())
                .with_health(health_rx)
                .with_scorer(scorer)
                .with_cleanup(cleanup);
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
        server::run(plugin, async {
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
        })
        .await
    });
    // The runtime (and the plugin with it) goes before the health thread, then NVML.
    drop(rt);
    monitor.stop();
    drop(nvml);
    if let Err(e) = result {
        fail(e);
    }
}
