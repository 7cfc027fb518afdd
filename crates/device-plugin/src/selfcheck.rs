//! The running plugin checks itself and writes its status (`status`) every [`PERIOD`]: a task
//! on the same tokio runtime as the gRPC servers, so that a runtime that hangs stops writing,
//! and a client of its own sockets, so that a server that does not answer is seen as kubelet
//! would see it (GetDevicePluginOptions, within [`CHECK_TIMEOUT`]).

use crate::api::device_plugin_client::DevicePluginClient;
use crate::api::Empty;
use crate::status::{self, Life, Phase, Stage, CHECK_TIMEOUT, PERIOD};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Whether the server on `sock` answers GetDevicePluginOptions within [`CHECK_TIMEOUT`].
pub async fn answers(sock: &Path) -> Result<(), String> {
    let ask = async {
        let ch = crate::unix::connect_unix(sock)
            .await
            .map_err(|e| format!("connect: {e}"))?;
        DevicePluginClient::new(ch)
            .get_device_plugin_options(Empty {})
            .await
            .map(|_| ())
            .map_err(|e| format!("GetDevicePluginOptions: {}", e.message()))
    };
    match tokio::time::timeout(CHECK_TIMEOUT, ask).await {
        Ok(r) => r.map_err(|e| format!("{}: {e}", sock.display())),
        Err(_) => Err(format!(
            "{}: no answer within {} s",
            sock.display(),
            CHECK_TIMEOUT.as_secs()
        )),
    }
}

/// The status now: the stage, and once the servers run, whether each answers (asked twice,
/// half a second apart, before it counts as not answering: kubelet's restart removes the
/// sockets, and the server is back within its poll) and is registered.
pub async fn check(life: &Life) -> (Phase, String) {
    if let Some(still) = life.stuck_for() {
        let stage = match life.stage() {
            Stage::WaitingForNvml(_) => "an attempt to open NVML",
            _ => "opening NVML or discovering the GPUs",
        };
        return (
            Phase::Stuck,
            format!("{stage} has not returned for {} s", still.as_secs()),
        );
    }
    match life.stage() {
        Stage::Starting => (Phase::Starting, String::new()),
        Stage::WaitingForNvml(why) => (Phase::WaitingForNvml, why),
        Stage::Running(resources) => {
            let mut unregistered = Vec::new();
            for (name, sock) in &resources {
                if let Err(e) = answers(sock).await {
                    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
                    if answers(sock).await.is_err() {
                        return (Phase::NotServing, format!("{name}: {e}"));
                    }
                }
                if !life.registered(name) {
                    unregistered.push(name.as_str());
                }
            }
            if unregistered.is_empty() {
                (Phase::Ready, String::new())
            } else {
                (
                    Phase::Serving,
                    format!("not registered: {}", unregistered.join(", ")),
                )
            }
        }
    }
}

/// Checks and writes the status at `path` every [`PERIOD`], forever (run it as a task). A
/// status that cannot be written is logged once per run of failures.
pub async fn run(path: PathBuf, life: Arc<Life>) {
    let mut failing = false;
    loop {
        let (phase, detail) = check(&life).await;
        match status::write(&path, &status::now(phase, detail)) {
            Ok(()) => failing = false,
            Err(e) => {
                if !failing {
                    eprintln!("cuvisor-device-plugin: writing the status for probes: {e}");
                }
                failing = true;
            }
        }
        tokio::time::sleep(PERIOD).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(tag: &str) -> PathBuf {
        let d =
            std::env::temp_dir().join(format!("cuvisor-selfcheck-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    /// A gRPC server that is dead (its socket file left, nothing listening: ECONNREFUSED) or
    /// hung (the socket accepts, nothing answers) is not serving: the plugin's status says so
    /// within the check's timeouts, and the probe then says not alive.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_dead_or_hung_grpc_server_is_not_serving() {
        let d = scratch("dead");
        let dead = d.join("dead.sock");
        drop(std::os::unix::net::UnixListener::bind(&dead).unwrap());
        let hung = d.join("hung.sock");
        let _held = std::os::unix::net::UnixListener::bind(&hung).unwrap();
        for (name, sock) in [("dead", &dead), ("hung", &hung)] {
            let life = Life::new();
            life.set_registered(name, true);
            life.set_stage(Stage::Running(vec![(name.into(), sock.clone())]));
            let t = std::time::Instant::now();
            let (phase, detail) = check(&life).await;
            assert_eq!(phase, Phase::NotServing, "{name}: {detail}");
            assert!(detail.starts_with(&format!("{name}: ")), "{detail}");
            assert!(t.elapsed() < 3 * CHECK_TIMEOUT, "{name}: {:?}", t.elapsed());
            let s = status::now(phase, detail);
            let e =
                status::verdict(&s, status::Need::Alive, s.at_ms, status::start_ticks).unwrap_err();
            assert!(e.starts_with("not alive"), "{e}");
        }
        let _ = std::fs::remove_dir_all(d);
    }

    /// A start-up stage that stays as it is for longer than the patience (NVML or discovery
    /// hanging on a GPU that hangs the driver) is stuck, and stuck is not alive; the same
    /// stage set again (the next attempt) is progress. Without patience, never stuck.
    #[tokio::test]
    async fn a_start_up_that_does_not_move_on_is_stuck_and_not_alive() {
        // A life made now starts now (not at boot): not stuck at once.
        let life = Life::with_patience(std::time::Duration::from_millis(50));
        assert_eq!(check(&life).await.0, Phase::Starting);
        tokio::time::sleep(std::time::Duration::from_millis(120)).await;
        let (phase, detail) = check(&life).await;
        assert_eq!(phase, Phase::Stuck, "{detail}");
        assert!(detail.contains("discovering the GPUs"), "{detail}");
        let s = status::now(phase, detail);
        let e = status::verdict(&s, status::Need::Alive, s.at_ms, status::start_ticks).unwrap_err();
        assert!(e.starts_with("not alive"), "{e}");
        life.set_stage(Stage::WaitingForNvml("no libnvidia-ml.so.1".into()));
        assert_eq!(check(&life).await.0, Phase::WaitingForNvml);
        let forever = Life::new();
        tokio::time::sleep(std::time::Duration::from_millis(120)).await;
        assert_eq!(check(&forever).await.0, Phase::Starting);
    }

    /// Before the servers run, the stage is the phase: waiting for NVML is alive, not ready.
    #[tokio::test]
    async fn waiting_for_nvml_is_the_phase_with_its_reason() {
        let life = Life::new();
        assert_eq!(check(&life).await.0, Phase::Starting);
        life.set_stage(Stage::WaitingForNvml("no libnvidia-ml.so.1".into()));
        assert_eq!(
            check(&life).await,
            (Phase::WaitingForNvml, "no libnvidia-ml.so.1".into())
        );
    }
}
