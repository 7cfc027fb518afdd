//! The device-plugin gRPC servers (one per resource, on `<socket_dir>/<endpoint>`), their
//! registration with kubelet, and re-registration when kubelet restarts.
//!
//! Each resource runs a loop: serve on its socket, then Register on `kubelet.sock`; then watch
//! both files every [`POLL`]. When kubelet restarts it re-creates `kubelet.sock` (a new inode)
//! and removes plugin sockets: a new kubelet socket means Register again; a missing or replaced
//! plugin socket means serve again, then Register. Allocations live in the [`Registry`], which
//! outlives every server. A resource that cannot be served (its socket cannot be bound) ends
//! [`Plugin::run`] with the reason, so that the plugin exits rather than run without serving.
//!
//! Every accepted connection is wrapped in [`crate::authority::AuthorityFix`], so that a kubelet
//! that sends the socket path as `:authority` (before 1.26) is served.

use crate::api::device_plugin_server::{DevicePlugin, DevicePluginServer};
use crate::api::registration_client::RegistrationClient;
use crate::api::{self, VERSION};
use crate::authority::AuthorityFix;
use crate::config::Config;
use crate::inventory::Inventory;
use crate::registry::{Kind, Registry, RegistryView};
use crate::topology::Topology;
use crate::{inject, plan, HealthReceiver};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::net::{UnixListener, UnixStream};
use tokio_stream::Stream;
use tonic::transport::{Channel, Endpoint, Server, Uri};
use tonic::{Request, Response, Status};

/// How often the sockets are checked (a kubelet restart is noticed within this).
pub const POLL: Duration = Duration::from_millis(250);

/// The plugin: configuration, devices, registry, health.
pub struct Plugin {
    cfg: Config,
    inv: Inventory,
    registry: Registry,
    health: HealthReceiver,
    /// Serialises Allocate (free-unit accounting).
    allocating: Mutex<()>,
}

/// What the live allocations hold of one GPU.
#[derive(Clone, Debug, Default)]
struct Hold {
    /// The allocation holding it whole.
    whole: Option<String>,
    /// Memory units in use, and the allocations holding them.
    units: u32,
    by: Vec<String>,
}

/// Refuses a configuration whose ListAndWatch response, for a resource it advertises, would be
/// longer than kubelet accepts ([`api::KUBELET_MAX_MESSAGE`]): kubelet would drop the stream
/// and the resource would never appear. Checked on the message at its longest (every device
/// Unhealthy); for memory units, the reason names the smallest `memory_unit` that fits.
pub fn check_list_sizes(cfg: &Config, inv: &Inventory) -> Result<(), String> {
    let max = api::KUBELET_MAX_MESSAGE;
    let r = &cfg.resources;
    for (memory, name) in [(false, &r.gpu), (true, &r.gpu_memory)] {
        if name.is_empty() || inv.list_len(memory, max) <= max {
            continue;
        }
        let len = inv.list_len(memory, usize::MAX);
        let gpus = inv.gpus().len();
        let over = format!(
            "would be {len} bytes, over the {max} bytes (4 MiB) kubelet's gRPC client accepts \
             (grpc-go's default maximum receive message size)"
        );
        return Err(if memory {
            let units: u64 = inv.gpus().iter().map(|g| u64::from(g.units)).sum();
            let fix = match inv.smallest_unit_within(max) {
                Some(mib) => format!("; the smallest memory_unit that fits is \"{mib}Mi\""),
                None => String::new(),
            };
            format!(
                "resources.memory_unit = {:?}: the ListAndWatch response for {name} ({units} \
                 memory units on {gpus} GPU(s)) {over}{fix}",
                r.memory_unit
            )
        } else {
            format!("resources.gpu: the ListAndWatch response for {name} ({gpus} GPUs) {over}")
        });
    }
    Ok(())
}

/// The socket file name of a resource's server.
pub fn endpoint(kind: Kind) -> &'static str {
    match kind {
        Kind::Gpu => "cuvisor-gpu.sock",
        Kind::Memory => "cuvisor-gpu-memory.sock",
    }
}

impl Plugin {
    /// Checks the configuration, opens the registry under the state root (reloading recorded
    /// allocations) and writes the shared host files.
    pub fn new(cfg: Config, topology: Topology, health: HealthReceiver) -> Result<Plugin, String> {
        cfg.validate().map_err(|e| e.0)?;
        let unit = cfg.memory_unit_bytes().map_err(|e| e.0)?;
        let inv = Inventory::new(topology, unit)?;
        check_list_sizes(&cfg, &inv)?;
        inject::install_shared(&cfg)?;
        // Every Allocate mounts a tmpfs: a plugin that cannot says so now, not at each one.
        crate::ledger_dir::probe(&cfg.state_root, &cfg.ledger_dir)?;
        let registry = Registry::open(&cfg.state_root)?;
        // Boards from before a restart keep only the entries of recorded allocations.
        {
            let _boards = crate::coord::lock();
            crate::coord::reconcile(&cfg.host_coord_dir(), &registry);
        }
        Ok(Plugin {
            cfg,
            inv,
            registry,
            health,
            allocating: Mutex::new(()),
        })
    }

    pub fn config(&self) -> &Config {
        &self.cfg
    }

    pub fn inventory(&self) -> &Inventory {
        &self.inv
    }

    /// The allocations, read-only (for metrics).
    pub fn registry(&self) -> RegistryView {
        self.registry.view()
    }

    /// The read-write registry (for cleanup).
    pub fn registry_mut(&self) -> &Registry {
        &self.registry
    }

    /// The resources advertised, with their names.
    pub fn resources(&self) -> Vec<(Kind, String)> {
        let r = &self.cfg.resources;
        let mut v = Vec::new();
        if !r.gpu.is_empty() {
            v.push((Kind::Gpu, r.gpu.clone()));
        }
        if !r.gpu_memory.is_empty() {
            v.push((Kind::Memory, r.gpu_memory.clone()));
        }
        v
    }

    fn resource_name(&self, kind: Kind) -> &str {
        match kind {
            Kind::Gpu => &self.cfg.resources.gpu,
            Kind::Memory => &self.cfg.resources.gpu_memory,
        }
    }

    /// What the live allocations hold of each GPU (inventory position), leaving out those that
    /// an allocation of `ids` would supersede (kubelet handing out a device ID again means its
    /// previous holder is over).
    fn holds(&self, ids: &[String]) -> Vec<Hold> {
        let mut out = vec![Hold::default(); self.inv.gpus().len()];
        for a in self.registry.view().list() {
            if a.device_ids.iter().any(|d| ids.contains(d)) {
                continue;
            }
            for s in &a.gpus {
                let Some(g) = self.inv.gpu_by_uuid(&s.uuid) else {
                    continue;
                };
                match a.kind {
                    Kind::Gpu => out[g].whole = Some(a.id.clone()),
                    Kind::Memory => {
                        out[g].units += s.units;
                        out[g].by.push(a.id.clone());
                    }
                }
            }
        }
        out
    }

    /// Whether GPU `g` is taken by the other resource: held whole (for memory units), or some
    /// of its memory units in use (for the whole GPU). The reason, for error messages.
    fn taken_by_other(&self, kind: Kind, g: usize, h: &Hold) -> Option<String> {
        let uuid = &self.inv.gpus()[g].uuid;
        match kind {
            Kind::Memory => h.whole.as_ref().map(|id| {
                format!(
                    "GPU {uuid} is allocated whole ({}, allocation {id}); its memory units are \
                     not available until it is released",
                    self.cfg.resources.gpu
                )
            }),
            Kind::Gpu => (h.units > 0).then(|| {
                format!(
                    "GPU {uuid} has {} memory unit(s) of {} in use (allocation(s) {}); it cannot \
                     be allocated whole until they are released",
                    h.units,
                    self.cfg.resources.gpu_memory,
                    h.by.join(", ")
                )
            }),
        }
    }

    /// The device list of a resource under the current health. Both resources share the GPUs:
    /// while a GPU is allocated whole its memory units are reported Unhealthy, and while any of
    /// its memory units are allocated the whole GPU is, so that kubelet cannot hand out the same
    /// GPU twice.
    pub fn devices(&self, kind: Kind) -> Vec<api::Device> {
        let mut h = self.health.borrow().clone();
        for (g, hold) in self.holds(&[]).iter().enumerate() {
            if self.taken_by_other(kind, g, hold).is_some() {
                h.insert(self.inv.gpus()[g].uuid.clone(), false);
            }
        }
        match kind {
            Kind::Gpu => self.inv.gpu_devices(&h),
            Kind::Memory => self.inv.memory_devices(&h),
        }
    }

    /// The GPU (inventory position) of a device ID of `kind`.
    fn gpu_of(&self, kind: Kind, id: &str) -> Option<usize> {
        match kind {
            Kind::Gpu => self.inv.gpu_by_uuid(id),
            Kind::Memory => self.inv.parse_unit_id(id).map(|(g, _)| g),
        }
    }

    /// GetPreferredAllocation for one container.
    pub fn preferred(
        &self,
        kind: Kind,
        req: &api::ContainerPreferredAllocationRequest,
    ) -> Result<Vec<String>, Status> {
        let size = usize::try_from(req.allocation_size)
            .map_err(|_| Status::invalid_argument("allocation_size < 0"))?;
        let name = self.resource_name(kind);
        // Devices whose GPU the other resource holds are not offered (kubelet sees them
        // Unhealthy; this covers a request made before it saw the change).
        let holds = self.holds(&[]);
        let taken = |id: &String| {
            self.gpu_of(kind, id)
                .and_then(|g| self.taken_by_other(kind, g, &holds[g]))
        };
        if let Some(why) = req.must_include_device_i_ds.iter().find_map(taken) {
            return Err(Status::failed_precondition(format!(
                "{name}: a must-include device is not available: {why}"
            )));
        }
        let mut dropped = None;
        let available: Vec<String> = req
            .available_device_i_ds
            .iter()
            .filter(|id| match taken(id) {
                Some(why) => {
                    dropped.get_or_insert(why);
                    false
                }
                None => true,
            })
            .cloned()
            .collect();
        if let Some(why) = dropped {
            if available.len() < size {
                return Err(Status::failed_precondition(format!(
                    "{name}: {size} device(s) requested, {} available: {why}",
                    available.len()
                )));
            }
        }
        match kind {
            Kind::Memory => {
                plan::preferred_memory(&self.inv, &available, &req.must_include_device_i_ds, size)
            }
            Kind::Gpu => plan::preferred_gpus(
                &self.inv,
                &available,
                &req.must_include_device_i_ds,
                size,
                &self.cfg.topology,
            ),
        }
        .map_err(|e| Status::invalid_argument(format!("{name}: {e}")))
    }

    /// Allocate for one container: writes the host files, records the allocation.
    pub fn allocate(
        &self,
        kind: Kind,
        req: &api::ContainerAllocateRequest,
    ) -> Result<api::ContainerAllocateResponse, Status> {
        let name = self.resource_name(kind).to_string();
        let ids = &req.devices_ids;
        let _g = self.allocating.lock().unwrap_or_else(|e| e.into_inner());
        // Board entries are assigned and recorded before a sweep may reconcile the boards.
        let _boards = crate::coord::lock();
        // An allocation that loses a device ID to this one is over: it does not count.
        let holds = self.holds(ids);
        for id in ids {
            if let Some(g) = self.gpu_of(kind, id) {
                if let Some(why) = self.taken_by_other(kind, g, &holds[g]) {
                    return Err(Status::failed_precondition(format!("{name}: {why}")));
                }
            }
        }
        let prepared = match kind {
            Kind::Memory => {
                let units = plan::check_memory_units(&self.inv, &name, ids, |g| {
                    if holds[g].whole.is_some() {
                        0
                    } else {
                        self.inv.gpus()[g].units.saturating_sub(holds[g].units)
                    }
                })
                .map_err(Status::invalid_argument)?;
                inject::memory(
                    &self.cfg,
                    &self.inv,
                    self.registry.root(),
                    &name,
                    ids,
                    &units,
                )
            }
            Kind::Gpu => {
                let mut gpus = Vec::new();
                for id in ids {
                    let g = self.inv.gpu_by_uuid(id).ok_or_else(|| {
                        Status::invalid_argument(format!("{name}: unknown GPU {id:?}"))
                    })?;
                    if !gpus.contains(&g) {
                        gpus.push(g);
                    }
                }
                if gpus.is_empty() {
                    return Err(Status::invalid_argument(format!("{name}: no devices")));
                }
                inject::whole(
                    &self.cfg,
                    &self.inv,
                    self.registry.root(),
                    &name,
                    ids,
                    &gpus,
                )
            }
        }
        .map_err(|e| Status::internal(format!("{name}: {e}")))?;
        if let Err(e) = self.registry.insert(prepared.allocation.clone()) {
            let a = &prepared.allocation;
            let uuids: Vec<String> = a.gpus.iter().map(|g| g.uuid.clone()).collect();
            crate::coord::release_all(&self.cfg.host_coord_dir(), &uuids, &a.id);
            let _ = crate::ledger_dir::retire(
                &prepared.allocation.dir,
                &crate::tenant_tree::Bounds::default(),
            );
            return Err(Status::internal(format!("{name}: recording: {e}")));
        }
        Ok(prepared.response)
    }

    /// Serves every resource and keeps it registered until `shutdown` resolves, or until a
    /// resource cannot be served (its socket cannot be bound): then the others are stopped and
    /// the reason returned, so that the plugin exits instead of running without serving.
    pub async fn run(
        self: Arc<Self>,
        shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> Result<(), String> {
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let mut tasks = tokio::task::JoinSet::new();
        for (kind, _) in self.resources() {
            let p = self.clone();
            let rx = stop_rx.clone();
            tasks.spawn(async move { p.keep_registered(kind, rx).await });
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
        self: Arc<Self>,
        kind: Kind,
        mut stop: tokio::sync::watch::Receiver<bool>,
    ) -> Result<(), String> {
        let dir = self.cfg.socket_dir.clone();
        let sock = dir.join(endpoint(kind));
        let kubelet = dir.join(api::KUBELET_SOCKET);
        let name = self.resource_name(kind).to_string();
        'serve: loop {
            let (server_stop, server) = self.clone().serve(kind, &sock).await?;
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
        self: Arc<Self>,
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
        let svc = DevicePluginServer::new(Service { plugin: self, kind });
        let task = tokio::spawn(
            Server::builder()
                .add_service(svc)
                .serve_with_incoming_shutdown(incoming, async {
                    let _ = rx.await;
                }),
        );
        Ok((tx, task))
    }
}

fn task_result(r: Result<Result<(), String>, tokio::task::JoinError>) -> Result<(), String> {
    r.unwrap_or_else(|e| Err(format!("a server task failed: {e}")))
}

fn inode(p: &Path) -> Option<u64> {
    std::fs::metadata(p).ok().map(|m| m.ino())
}

/// A gRPC channel over a Unix socket.
pub async fn connect_unix(path: &Path) -> Result<Channel, tonic::transport::Error> {
    let path: PathBuf = path.to_path_buf();
    Endpoint::try_from("http://[::1]:50051")?
        .connect_timeout(Duration::from_secs(2))
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let p = path.clone();
            async move {
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(UnixStream::connect(p).await?))
            }
        }))
        .await
}

async fn register(kubelet: &Path, kind: Kind, name: &str) -> Result<(), String> {
    let ch = connect_unix(kubelet).await.map_err(|e| e.to_string())?;
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
        let mut health = plugin.health.clone();
        let mut allocations = plugin.registry.subscribe();
        tokio::spawn(async move {
            let mut last: Option<Vec<api::Device>> = None;
            let mut health_open = true;
            loop {
                health.mark_unchanged();
                allocations.mark_unchanged();
                let devices = plugin.devices(kind);
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
                device_i_ds: self.plugin.preferred(self.kind, c)?,
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
            out.push(self.plugin.allocate(self.kind, c)?);
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
