//! The device-plugin gRPC servers (one per resource, on `<socket_dir>/<endpoint>`), their
//! registration with kubelet, and re-registration when kubelet restarts.
//!
//! Each resource runs a loop: serve on its socket, then Register on `kubelet.sock`; then watch
//! both files every [`POLL`]. When kubelet restarts it re-creates `kubelet.sock` (a new inode)
//! and removes plugin sockets: a new kubelet socket means Register again; a missing or replaced
//! plugin socket means serve again, then Register. Allocations live in the plugin's registry,
//! which outlives every server. A resource that cannot be served (its socket cannot be bound)
//! ends [`run`] with the reason, so that the plugin exits rather than run without serving.
//!
//! Only the transport lives here: the answers are the domain's ([`crate::plugin`]), translated
//! into kubelet's messages ([`response`], [`status`]).
//!
//! Every accepted connection is wrapped in [`crate::authority::AuthorityFix`], so that a kubelet
//! that sends the socket path as `:authority` (before 1.26) is served.

use crate::answer::Answer;
use crate::api::device_plugin_server::{DevicePlugin, DevicePluginServer};
use crate::api::registration_client::RegistrationClient;
use crate::api::{self, VERSION};
use crate::authority::AuthorityFix;
use crate::layout;
use crate::plugin::{Plugin, Refusal};
use crate::registry::Kind;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::UnixListener;
use tokio_stream::Stream;
use tonic::transport::Server;
use tonic::{Request, Response, Status};

/// How often the sockets are checked (a kubelet restart is noticed within this).
pub const POLL: Duration = Duration::from_millis(250);

/// The socket file name of a resource's server.
pub fn endpoint(kind: Kind) -> &'static str {
    match kind {
        Kind::Gpu => layout::GPU_SOCKET,
        Kind::Memory => layout::MEMORY_SOCKET,
    }
}

/// The device list of a resource, as ListAndWatch sends it.
fn devices(plugin: &Plugin, kind: Kind) -> Vec<api::Device> {
    let h = plugin.health_of(kind);
    match kind {
        Kind::Gpu => plugin.inventory().gpu_devices(&h),
        Kind::Memory => plugin.inventory().memory_devices(&h),
    }
}

/// Allocate's answer for one container, as kubelet receives it.
pub fn response(a: Answer) -> api::ContainerAllocateResponse {
    let s = |p: &std::path::Path| p.to_string_lossy().into_owned();
    api::ContainerAllocateResponse {
        envs: a.envs.into_iter().collect(),
        mounts: a
            .mounts
            .iter()
            .map(|m| api::Mount {
                container_path: s(&m.container_path),
                host_path: s(&m.host_path),
                read_only: m.read_only,
            })
            .collect(),
        devices: a
            .devices
            .iter()
            .map(|d| api::DeviceSpec {
                container_path: s(&d.container_path),
                host_path: s(&d.host_path),
                permissions: d.permissions.clone(),
            })
            .collect(),
        annotations: a.annotations.into_iter().collect(),
        cdi_devices: a
            .cdi_devices
            .into_iter()
            .map(|name| api::CdiDevice { name })
            .collect(),
    }
}

/// A domain refusal as a gRPC status.
pub fn status(r: Refusal) -> Status {
    match r {
        Refusal::Invalid(m) => Status::invalid_argument(m),
        Refusal::Unavailable(m) => Status::failed_precondition(m),
        Refusal::Failed(m) => Status::internal(m),
    }
}

/// Serves every resource of `plugin` and keeps it registered until `shutdown` resolves, or
/// until a resource cannot be served (its socket cannot be bound): then the others are stopped
/// and the reason returned, so that the plugin exits instead of running without serving.
pub async fn run(
    plugin: Arc<Plugin>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), String> {
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut tasks = tokio::task::JoinSet::new();
    for (kind, _) in plugin.resources() {
        let p = plugin.clone();
        let rx = stop_rx.clone();
        tasks.spawn(async move { keep_registered(p, kind, rx).await });
    }
    let failed = tokio::select! {
        _ = shutdown => None,
        // Before the stop, a server task ends only when it cannot serve.
        Some(r) = tasks.join_next() => Some(r),
    };
    let _ = stop_tx.send(true);
    // The first failure is the reason.
    let mut result = failed.map_or(Ok(()), task_result);
    while let Some(r) = tasks.join_next().await {
        result = result.and(task_result(r));
    }
    result
}
async fn keep_registered(
    plugin: Arc<Plugin>,
    kind: Kind,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> Result<(), String> {
    let dir = plugin.config().socket_dir.clone();
    let sock = dir.join(endpoint(kind));
    let kubelet = dir.join(api::KUBELET_SOCKET);
    let name = plugin.resource_name(kind).to_string();
    'serve: loop {
        let (server_stop, server) = serve(plugin.clone(), kind, &sock).await?;
        let our_inode = inode(&sock);
        let mut registered: Option<u64> = None;
        loop {
            if *stop.borrow() {
                let _ = server_stop.send(());
                let _ = server.await;
                let _ = std::fs::remove_file(&sock);
                return Ok(());
            }
            if inode(&sock) != our_inode {
                eprintln!(
                    "cuvisor-device-plugin: {} was removed; serving again",
                    sock.display()
                );
                let _ = server_stop.send(());
                let _ = server.await;
                continue 'serve;
            }
            let k = inode(&kubelet);
            if k.is_some() && k != registered {
                match register(&kubelet, kind, &name).await {
                    Ok(()) => {
                        eprintln!("cuvisor-device-plugin: registered {name} with kubelet");
                        registered = k;
                    }
                    Err(e) => eprintln!("cuvisor-device-plugin: registering {name}: {e}"),
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(POLL) => {}
                _ = stop.changed() => {}
            }
        }
    }
}

/// Binds the socket and serves; returns a stopper and the server task, once it accepts.
async fn serve(
    plugin: Arc<Plugin>,
    kind: Kind,
    sock: &Path,
) -> Result<
    (
        tokio::sync::oneshot::Sender<()>,
        tokio::task::JoinHandle<Result<(), tonic::transport::Error>>,
    ),
    String,
> {
    if let Some(d) = sock.parent() {
        std::fs::create_dir_all(d).map_err(|e| format!("{}: {e}", d.display()))?;
    }
    let _ = std::fs::remove_file(sock);
    let listener = UnixListener::bind(sock).map_err(|e| format!("{}: {e}", sock.display()))?;
    // Each connection's `:authority` made acceptable to h2 (older kubelets send the
    // socket path): see crate::authority.
    let incoming = tokio_stream::StreamExt::map(
        tokio_stream::wrappers::UnixListenerStream::new(listener),
        |c| c.map(AuthorityFix::new),
    );
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let svc = DevicePluginServer::new(Service { plugin, kind });
    let task = tokio::spawn(
        Server::builder()
            .add_service(svc)
            .serve_with_incoming_shutdown(incoming, async {
                let _ = rx.await;
            }),
    );
    Ok((tx, task))
}

fn task_result(r: Result<Result<(), String>, tokio::task::JoinError>) -> Result<(), String> {
    r.unwrap_or_else(|e| Err(format!("a server task failed: {e}")))
}

fn inode(p: &Path) -> Option<u64> {
    std::fs::metadata(p).ok().map(|m| m.ino())
}

async fn register(kubelet: &Path, kind: Kind, name: &str) -> Result<(), String> {
    let ch = crate::unix::connect_unix(kubelet)
        .await
        .map_err(|e| e.to_string())?;
    RegistrationClient::new(ch)
        .register(api::RegisterRequest {
            version: VERSION.into(),
            endpoint: endpoint(kind).into(),
            resource_name: name.into(),
            options: Some(options()),
        })
        .await
        .map_err(|e| e.message().to_string())?;
    Ok(())
}

fn options() -> api::DevicePluginOptions {
    api::DevicePluginOptions {
        pre_start_required: false,
        get_preferred_allocation_available: true,
    }
}

struct Service {
    plugin: Arc<Plugin>,
    kind: Kind,
}

impl Service {
    fn preferred(
        &self,
        req: &api::ContainerPreferredAllocationRequest,
    ) -> Result<Vec<String>, Status> {
        let size = usize::try_from(req.allocation_size)
            .map_err(|_| Status::invalid_argument("allocation_size < 0"))?;
        self.plugin
            .preferred(
                self.kind,
                &req.available_device_i_ds,
                &req.must_include_device_i_ds,
                size,
            )
            .map_err(status)
    }
}

type DeviceStream =
    Pin<Box<dyn Stream<Item = Result<api::ListAndWatchResponse, Status>> + Send + 'static>>;

#[tonic::async_trait]
impl DevicePlugin for Service {
    async fn get_device_plugin_options(
        &self,
        _: Request<api::Empty>,
    ) -> Result<Response<api::DevicePluginOptions>, Status> {
        Ok(Response::new(options()))
    }

    type ListAndWatchStream = DeviceStream;

    async fn list_and_watch(
        &self,
        _: Request<api::Empty>,
    ) -> Result<Response<DeviceStream>, Status> {
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let plugin = self.plugin.clone();
        let kind = self.kind;
        let mut health = plugin.health();
        let mut allocations = plugin.registry_mut().subscribe();
        tokio::spawn(async move {
            let mut last: Option<Vec<api::Device>> = None;
            let mut health_open = true;
            loop {
                health.mark_unchanged();
                allocations.mark_unchanged();
                let devices = devices(&plugin, kind);
                if last.as_ref() != Some(&devices) {
                    let resp = api::ListAndWatchResponse {
                        devices: devices.clone(),
                    };
                    if tx.send(Ok(resp)).await.is_err() {
                        return;
                    }
                    last = Some(devices);
                }
                tokio::select! {
                    // The health checker gone: health stays as it is.
                    r = health.changed(), if health_open => health_open = r.is_ok(),
                    // The registry (and its sender) lives as long as the plugin.
                    r = allocations.changed() => if r.is_err() {
                        tx.closed().await;
                        return;
                    },
                    _ = tx.closed() => return,
                }
            }
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }

    async fn get_preferred_allocation(
        &self,
        req: Request<api::PreferredAllocationRequest>,
    ) -> Result<Response<api::PreferredAllocationResponse>, Status> {
        let mut out = Vec::new();
        for c in &req.get_ref().container_requests {
            out.push(api::ContainerPreferredAllocationResponse {
                device_i_ds: self.preferred(c)?,
            });
        }
        Ok(Response::new(api::PreferredAllocationResponse {
            container_responses: out,
        }))
    }

    async fn allocate(
        &self,
        req: Request<api::AllocateRequest>,
    ) -> Result<Response<api::AllocateResponse>, Status> {
        let mut out = Vec::new();
        for c in &req.get_ref().container_requests {
            let answer = self
                .plugin
                .allocate(self.kind, &c.devices_ids)
                .map_err(status)?;
            out.push(response(answer));
        }
        Ok(Response::new(api::AllocateResponse {
            container_responses: out,
        }))
    }

    async fn pre_start_container(
        &self,
        _: Request<api::PreStartContainerRequest>,
    ) -> Result<Response<api::PreStartContainerResponse>, Status> {
        Ok(Response::new(api::PreStartContainerResponse {}))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::answer::{DeviceNode, Mount};

    /// Every field of the domain's answer reaches kubelet's message, CDI names included.
    #[test]
    fn the_answer_is_translated_field_by_field() {
        let a = Answer {
            envs: [("NVIDIA_VISIBLE_DEVICES".into(), "GPU-1".into())].into(),
            mounts: vec![Mount::new(Path::new("/c"), Path::new("/h"), true)],
            devices: vec![DeviceNode {
                container_path: "/dev/nvidia3".into(),
                host_path: "/host/dev/nvidia3".into(),
                permissions: "rw".into(),
            }],
            cdi_devices: vec!["nvidia.com/gpu=GPU-1".into()],
            annotations: [("cuvisor.io/allocation".into(), "ab".into())].into(),
        };
        let r = response(a);
        assert_eq!(r.envs["NVIDIA_VISIBLE_DEVICES"], "GPU-1");
        assert_eq!(
            r.mounts,
            [api::Mount {
                container_path: "/c".into(),
                host_path: "/h".into(),
                read_only: true
            }]
        );
        assert_eq!(r.devices[0].host_path, "/host/dev/nvidia3");
        assert_eq!(r.devices[0].permissions, "rw");
        assert_eq!(r.cdi_devices[0].name, "nvidia.com/gpu=GPU-1");
        assert_eq!(r.annotations["cuvisor.io/allocation"], "ab");
        assert_eq!(
            status(Refusal::Unavailable("x".into())).code(),
            tonic::Code::FailedPrecondition
        );
    }
}
