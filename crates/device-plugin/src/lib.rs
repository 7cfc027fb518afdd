//! cuvisor's Kubernetes device plugin.
//!
//! - [`topology`]: the GPUs of a node and how they are wired, and the allocator that picks the
//!   best connected set of GPUs for a multi-GPU request. No gRPC.
//! - [`api`]: the kubelet device-plugin API v1beta1 (generated from `proto/api.proto`).
//! - [`config`]: the plugin's versioned configuration file.
//! - [`inventory`]: the devices each resource advertises (whole GPUs, memory units).
//! - [`plan`]: GetPreferredAllocation and Allocate's placement rules (best fit, spans).
//! - [`inject`]: what Allocate puts into a container (files written on the host + the response).
//! - [`install`]: `[host] install_from`, the library copied atomically from the image to the host.
//! - [`ledger_dir`]: each memory allocation's ledger directory, a size-limited tmpfs of its own.
//! - [`registry`]: what has been allocated (kept on disk under the state root).
//! - [`cleanup`]: removing the host directories of allocations whose container is gone.
//! - [`tenant_tree`]: the one walk over a tree a tenant could write: iterative, by directory
//!   descriptor, bounded in depth, entries and time, never following a link or crossing a mount.
//! - [`server`]: the gRPC servers, registration with kubelet, re-registration on restart; the
//!   start-up check that each ListAndWatch response fits in the 4 MiB kubelet receives
//!   ([`server::check_list_sizes`], [`api::KUBELET_MAX_MESSAGE`]).
//! - [`authority`]: each plugin connection's HTTP/2 `:authority` made acceptable to h2: kubelet
//!   before 1.26 (and grpc-java, grpcio) sends the socket path, which h2 refuses with
//!   PROTOCOL_ERROR before tonic sees the request; it becomes `localhost`.
//! - [`metrics`]: the Prometheus endpoint, bounded so that idle or slow clients cannot take
//!   descriptors or time from Allocate (at most [`metrics::MAX_CONNECTIONS`] open, a deadline
//!   for the request and for the response).
//!
//! # Interfaces for the health and metrics modules
//!
//! - Health: [`HealthSender`]/[`HealthReceiver`], a `tokio::sync::watch` of
//!   `GPU UUID -> healthy`. A GPU missing from the map is healthy. The server re-sends
//!   ListAndWatch for both resources whenever the map changes (a GPU's memory units follow its
//!   health), and whenever an allocation comes or goes: both resources are backed by the same
//!   GPUs, so a GPU held whole reports its memory units Unhealthy and a GPU with memory units in
//!   use reports itself Unhealthy (GetPreferredAllocation and Allocate refuse them too). Create the pair with [`health_channel`], give the receiver to
//!   [`server::Plugin::new`], keep the sender in the health checker.
//! - Metrics: [`registry::RegistryView`] (from [`server::Plugin::registry`]) is a read-only,
//!   cloneable view of the live allocations ([`registry::Allocation`]: resource, device IDs,
//!   GPUs with their byte quotas, host ledger directory).
//! - Cleanup with PodResources: implement [`cleanup::Liveness`] and pass it to
//!   [`cleanup::Sweeper::with_liveness`].
#![forbid(unsafe_code)]

pub mod api;
pub mod authority;
pub mod cleanup;
pub mod config;
pub mod coord;
pub mod inject;
pub mod install;
pub mod inventory;
pub mod ledger_dir;
pub mod plan;
pub mod registry;
pub mod server;
pub mod tenant_tree;
pub mod topology;

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
pub mod health;
pub mod metrics;
pub mod podresources;
