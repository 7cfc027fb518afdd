//! kubelet's PodResources API v1 (`List` over `/var/lib/kubelet/pod-resources/kubelet.sock`):
//! which pod, namespace and container hold each device ID. The metrics label their series with
//! it, and [`PodCache`] answers [`crate::cleanup::Liveness`] for the sweeper.

use crate::registry::Allocation;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::Duration;

#[allow(clippy::all, missing_docs)]
pub mod v1 {
    tonic::include_proto!("v1");
}

/// Where kubelet serves the API by default.
pub use crate::config::POD_RESOURCES_SOCKET as SOCKET;

/// A container, as Kubernetes names it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Owner {
    pub namespace: String,
    pub pod: String,
    pub container: String,
}

/// (resource name, device ID) -> the container holding it.
pub type Owners = HashMap<(String, String), Owner>;

/// Every device of every container in a `List` answer.
pub fn owners(resp: &v1::ListPodResourcesResponse) -> Owners {
    let mut out = Owners::new();
    for pod in &resp.pod_resources {
        for c in &pod.containers {
            for d in &c.devices {
                for id in &d.device_ids {
                    out.insert(
                        (d.resource_name.clone(), id.clone()),
                        Owner {
                            namespace: pod.namespace.clone(),
                            pod: pod.name.clone(),
                            container: c.name.clone(),
                        },
                    );
                }
            }
        }
    }
    out
}

/// One `List` call on kubelet's socket.
pub async fn list(socket: &Path) -> Result<Owners, String> {
    let ch = crate::unix::connect_unix(socket)
        .await
        .map_err(|e| format!("PodResources {}: {e}", socket.display()))?;
    let resp = v1::pod_resources_lister_client::PodResourcesListerClient::new(ch)
        .list(v1::ListPodResourcesRequest {})
        .await
        .map_err(|e| format!("PodResources List: {e}"))?;
    Ok(owners(resp.get_ref()))
}

/// The last `List` answer, refreshed in the background; `None` until one succeeded (or when the
/// last one failed: stale owners must not keep dead allocations alive).
#[derive(Clone, Default)]
pub struct PodCache(Arc<RwLock<Option<Owners>>>);

impl PodCache {
    pub fn new() -> PodCache {
        PodCache::default()
    }

    pub fn set(&self, owners: Option<Owners>) {
        *self.0.write().unwrap_or_else(|e| e.into_inner()) = owners;
    }

    pub fn get(&self) -> Option<Owners> {
        self.0.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The owner of an allocation: the container holding its first device ID.
    pub fn owner_of(&self, a: &Allocation) -> Option<Owner> {
        let g = self.0.read().unwrap_or_else(|e| e.into_inner());
        let owners = g.as_ref()?;
        a.device_ids
            .iter()
            .find_map(|id| owners.get(&(a.resource.clone(), id.clone())).cloned())
    }

    /// Refreshes from `socket` every `every` (forever; run it as a task). A failure is logged
    /// once per run of failures and empties the cache.
    pub async fn refresh(self, socket: PathBuf, every: Duration) {
        let mut failing = false;
        loop {
            match list(&socket).await {
                Ok(o) => {
                    failing = false;
                    self.set(Some(o));
                }
                Err(e) => {
                    if !failing {
                        eprintln!(
                            "cuvisor-device-plugin: {e} (pod labels unknown until it answers)"
                        );
                    }
                    failing = true;
                    self.set(None);
                }
            }
            tokio::time::sleep(every).await;
        }
    }
}

impl crate::cleanup::Liveness for PodCache {
    fn in_use(&self, a: &Allocation) -> Option<bool> {
        let g = self.0.read().unwrap_or_else(|e| e.into_inner());
        let owners = g.as_ref()?;
        Some(
            a.device_ids
                .iter()
                .any(|id| owners.contains_key(&(a.resource.clone(), id.clone()))),
        )
    }
}
