//! A fake kubelet: the Registration service on `kubelet.sock` in a directory (as kubelet serves
//! it in /var/lib/kubelet/device-plugins), every registration handed to the test; and a
//! DevicePlugin client on a plugin's socket in that directory.
//!
//! (tests/kubelet.rs keeps an equal one of its own; this one serves the tests that need no more.)

use cuvisor_device_plugin::api::device_plugin_client::DevicePluginClient;
use cuvisor_device_plugin::api::registration_server::{Registration, RegistrationServer};
use cuvisor_device_plugin::api::{self, RegisterRequest};
use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;
use tokio::sync::mpsc;
use tonic::transport::Channel;
use tonic::{Request, Response, Status};

struct FakeRegistration(mpsc::UnboundedSender<RegisterRequest>);

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

/// The Registration server, stopped when dropped.
pub struct Kubelet {
    regs: mpsc::UnboundedReceiver<RegisterRequest>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Kubelet {
    /// Serves `dir/kubelet.sock`. Call from within a tokio runtime.
    pub fn start(dir: &Path) -> Kubelet {
        let sock = dir.join("kubelet.sock");
        let _ = std::fs::remove_file(&sock);
        let listener = tokio::net::UnixListener::bind(&sock)
            .unwrap_or_else(|e| panic!("{}: {e}", sock.display()));
        let (tx, regs) = mpsc::unbounded_channel();
        let (stop, rx) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(RegistrationServer::new(FakeRegistration(tx)))
                .serve_with_incoming_shutdown(
                    tokio_stream::wrappers::UnixListenerStream::new(listener),
                    async {
                        let _ = rx.await;
                    },
                )
                .await;
        });
        Kubelet {
            regs,
            stop: Some(stop),
        }
    }

    /// The next registration, if one comes within `within`.
    pub async fn next(&mut self, within: Duration) -> Option<RegisterRequest> {
        tokio::time::timeout(within, self.regs.recv())
            .await
            .ok()
            .flatten()
    }

    /// The next `n` registrations, by resource name; an error naming how many came if they do
    /// not all come within `within`.
    pub async fn registrations(
        &mut self,
        n: usize,
        within: Duration,
    ) -> Result<HashMap<String, RegisterRequest>, String> {
        let mut out = HashMap::new();
        let deadline = tokio::time::Instant::now() + within;
        while out.len() < n {
            match tokio::time::timeout_at(deadline, self.regs.recv()).await {
                Ok(Some(r)) => {
                    out.insert(r.resource_name.clone(), r);
                }
                Ok(None) => return Err("the registration server stopped".into()),
                Err(_) => {
                    return Err(format!(
                        "only {} of {n} registrations within {within:?}",
                        out.len()
                    ))
                }
            }
        }
        Ok(out)
    }
}

impl Drop for Kubelet {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
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
