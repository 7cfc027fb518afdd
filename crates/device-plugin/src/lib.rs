//! cuvisor's Kubernetes device plugin.
//!
//! # The shape
//!
//! Leaves first (they import nothing of the plugin's, or only other leaves), then the domain
//! (no gRPC: plain Rust, unit tests of its own), then the transport, then the binary. No file
//! imports one that imports it back.
//!
//! - Leaves:
//!   - [`config`]: the versioned configuration file; owns every default.
//!   - [`layout`]: the names of the plugin's files on disk and of its sockets.
//!   - [`cdi`]: the Container Device Interface: the spec's types, cuvisor's per-allocation
//!     spec (written atomically, removed with the allocation) and the CDI device names Allocate
//!     answers under each `[cdi] strategy` (imports only [`answer`]).
//!   - [`unix`]: a gRPC channel over a Unix socket.
//!   - [`api`]: the kubelet device-plugin API v1beta1 (generated from `proto/api.proto`).
//!   - [`registry`]: what has been allocated (kept on disk under the state root).
//!   - [`tenant_tree`]: the one walk over a tree a tenant could write: iterative, by directory
//!     descriptor, bounded in depth, entries and time, never following a link or crossing a
//!     mount.
//!   - [`install`]: `[host] install_from`: the library copied atomically from the image to
//!     the host at start-up.
//!   - [`topology`]: the GPUs of a node and how they are wired, and the allocator that picks
//!     the best connected set of GPUs for a multi-GPU request.
//!   - [`authority`]: each plugin connection's HTTP/2 `:authority` made acceptable to h2:
//!     kubelet before 1.26 (and grpc-java, grpcio) sends the socket path, which h2 refuses
//!     with PROTOCOL_ERROR before tonic sees the request; it becomes `localhost`.
//! - The domain:
//!   - [`inventory`]: the devices each resource advertises (whole GPUs, memory units).
//!   - [`plan`]: GetPreferredAllocation and Allocate's placement rules (best fit, spans).
//!   - [`answer`]: Allocate's answer for one container (env, mounts, device nodes, CDI
//!     device names, annotations), as a plain type.
//!   - [`inject`]: the host files behind an allocation, and its [`answer::Answer`].
//!   - [`ledger_dir`]: each memory allocation's ledger directory, a size-limited tmpfs.
//!   - [`coord`]: the GPU coordinators' boards (compute shares).
//!   - [`cleanup`]: removing the host directories of allocations whose container is gone.
//!   - [`plugin`]: the rules that answer kubelet's questions (device health per resource,
//!     preferred devices, Allocate), over the above; refusals as [`plugin::Refusal`].
//!   - [`health`]: GPU health from NVML (XIDs, NVLink), over a small `Source` trait.
//!   - [`status`]: the plugin's life for its exec probes (`cuvisor-device-plugin probe`): the
//!     status file's format and the rules that judge it alive or ready.
//! - The transport and the outside:
//!   - [`server`]: the gRPC servers, registration with kubelet, re-registration on restart;
//!     translates the domain's answers into kubelet's messages.
//!   - [`selfcheck`]: the running plugin asks its own sockets to answer and writes its status
//!     every [`status::PERIOD`], from the runtime that serves kubelet.
//!   - [`listing`]: ListAndWatch's device lists as kubelet receives them, and the start-up
//!     check that each fits in the 4 MiB kubelet receives ([`listing::check_list_sizes`],
//!     [`api::KUBELET_MAX_MESSAGE`]).
//!   - [`podresources`]: kubelet's PodResources API (pod names for metrics; the sweeper's
//!     liveness rule).
//!   - [`metrics`]: the Prometheus endpoint, bounded so that idle or slow clients cannot take
//!     descriptors or time from Allocate (at most [`metrics::MAX_CONNECTIONS`] open, a
//!     deadline for the request and for the response).
//!
//! # Interfaces for the health and metrics modules
//!
//! - Health: [`HealthSender`]/[`HealthReceiver`], a `tokio::sync::watch` of
//!   `GPU UUID -> healthy`. A GPU missing from the map is healthy. The server re-sends
//!   ListAndWatch for both resources whenever the map changes (a GPU's memory units follow its
//!   health), and whenever an allocation comes or goes: both resources are backed by the same
//!   GPUs, so a GPU held whole reports its memory units Unhealthy and a GPU with memory units in
//!   use reports itself Unhealthy (GetPreferredAllocation and Allocate refuse them too). Create
//!   the pair with [`health_channel`], give the receiver to [`plugin::Plugin::new`], keep the
//!   sender in the health checker.
//! - Metrics: [`registry::RegistryView`] (from [`plugin::Plugin::registry`]) is a read-only,
//!   cloneable view of the live allocations ([`registry::Allocation`]: resource, device IDs,
//!   GPUs with their byte quotas, host ledger directory).
//! - Cleanup with PodResources: implement [`cleanup::Liveness`] and pass it to
//!   [`cleanup::Sweeper::with_liveness`].
#![forbid(unsafe_code)]

pub mod answer;
pub mod api;
pub mod authority;
pub mod cdi;
pub mod cleanup;
pub mod config;
pub mod coord;
pub mod health;
pub mod inject;
pub mod install;
pub mod inventory;
pub mod layout;
pub mod ledger_dir;
pub mod listing;
pub mod metrics;
pub mod plan;
pub mod plugin;
pub mod podresources;
pub mod registry;
pub mod selfcheck;
pub mod server;
pub mod status;
pub mod tenant_glibc;
pub mod tenant_tree;
pub mod topology;
pub mod unix;

use std::collections::HashMap;

/// GPU UUID ("GPU-...") -> healthy. A GPU missing from the map is healthy.
pub type HealthMap = HashMap<String, bool>;
/// What the health checker holds.
pub type HealthSender = tokio::sync::watch::Sender<HealthMap>;
/// What the server watches: ListAndWatch re-sends on every change.
pub type HealthReceiver = tokio::sync::watch::Receiver<HealthMap>;

/// A health channel with every GPU healthy.
pub fn health_channel() -> (HealthSender, HealthReceiver) {
    tokio::sync::watch::channel(HealthMap::new())
}
