//! A fake kubelet for the plugin binary's tests: a Registration server on `kubelet.sock` in a
//! directory (as kubelet serves it in /var/lib/kubelet/device-plugins), every RegisterRequest
//! handed to the test; and a DevicePlugin client on a plugin's socket in that directory.

use cuvisor_device_plugin::api::device_plugin_client::DevicePluginClient;
use cuvisor_device_plugin::api::registration_server::{Registration, RegistrationServer};
use cuvisor_device_plugin::api::{self, RegisterRequest};
use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;
use tokio::sync::mpsc;
use tonic::transport::Channel;
use tonic::{Request, Response, Status};

/// The fake kubelet's Registration service: every request goes to the test.
pub struct FakeRegistration(mpsc::UnboundedSender<RegisterRequest>);

#[tonic::async_trait]
impl Registration for FakeRegistration {
    async fn register(
        &self,
        req: Request<RegisterRequest>,
    ) -> Result<Response<api::Empty>, Status> {
        let _ = self.0.send(req.into_inner());
        Ok(Response::new(api::Empty {}))
    }
}

pub struct Kubelet {
    regs: mpsc::UnboundedReceiver<RegisterRequest>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

impl Kubelet {
    pub fn start(dir: &Path) -> Kubelet {
        let sock = dir.join("kubelet.sock");
        let _ = std::fs::remove_file(&sock);
        let listener = tokio::net::UnixListener::bind(&sock).unwrap();
        let (tx, regs) = mpsc::unbounded_channel();
        let (stop, rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            tonic::transport::Server::builder()
                .add_service(RegistrationServer::new(FakeRegistration(tx)))
                .serve_with_incoming_shutdown(
                    tokio_stream::wrappers::UnixListenerStream::new(listener),
                    async {
                        let _ = rx.await;
                    },
                )
                .await
                .unwrap();
        });
        Kubelet {
            regs,
            stop: Some(stop),
            task,
        }
    }

    /// The next registration, if one comes within `within`.
    pub async fn next(&mut self, within: Duration) -> Option<RegisterRequest> {
        tokio::time::timeout(within, self.regs.recv())
            .await
            .ok()
            .flatten()
    }

    /// The next `n` registrations, by resource name, within `within`.
    pub async fn registrations(
        &mut self,
        n: usize,
        within: Duration,
    ) -> HashMap<String, RegisterRequest> {
        let mut out = HashMap::new();
        let deadline = tokio::time::Instant::now() + within;
        while out.len() < n {
            let r = tokio::time::timeout_at(deadline, self.regs.recv())
                .await
                .unwrap_or_else(|_| {
                    panic!("only {} of {n} registrations within {within:?}", out.len())
                })
                .expect("registration channel open");
            out.insert(r.resource_name.clone(), r);
        }
        out
    }

    /// Stops like a kubelet that exits: its socket and the plugins' sockets are removed.
    pub async fn stop(mut self, dir: &Path) {
        let _ = self.stop.take().unwrap().send(());
        let _ = self.task.await;
        for e in std::fs::read_dir(dir).unwrap().flatten() {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// A DevicePlugin client on `dir/endpoint`.
pub async fn client(dir: &Path, endpoint: &str) -> DevicePluginClient<Channel> {
    DevicePluginClient::new(
        cuvisor_device_plugin::unix::connect_unix(&dir.join(endpoint))
            .await
            .unwrap_or_else(|e| panic!("connect to {endpoint}: {e}")),
    )
}
