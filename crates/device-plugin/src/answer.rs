//! Allocate's answer for one container, as the domain states it: what the container runtime is
//! asked to add to the container. No gRPC here: `server` translates it into kubelet's
//! `ContainerAllocateResponse` field by field, and a later DRA driver can translate the same
//! answer into its own.
//!
//! - `envs`: environment variables (`NVIDIA_VISIBLE_DEVICES`, ...);
//! - `mounts`: bind mounts from the host;
//! - `devices`: device nodes from the host;
//! - `cdi_devices`: fully qualified CDI device names (`vendor.com/class=name`, the Container
//!   Device Interface), which the runtime resolves against the CDI specs on the node;
//! - `annotations`: annotations on the container (CDI's annotation form goes here too).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// One container's share of an Allocate answer.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Answer {
    pub envs: BTreeMap<String, String>,
    pub mounts: Vec<Mount>,
    pub devices: Vec<DeviceNode>,
    /// Fully qualified CDI device names (`vendor.com/class=name`).
    pub cdi_devices: Vec<String>,
    pub annotations: BTreeMap<String, String>,
}

/// A bind mount: `host_path` on the node at `container_path` in the container.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mount {
    pub container_path: PathBuf,
    pub host_path: PathBuf,
    pub read_only: bool,
}

/// A device node: `host_path` on the node at `container_path` in the container, with cgroup
/// permissions `permissions` ("rw", "r", "rwm").
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceNode {
    pub container_path: PathBuf,
    pub host_path: PathBuf,
    pub permissions: String,
}

impl Mount {
    pub fn new(container: &Path, host: &Path, read_only: bool) -> Mount {
        Mount {
            container_path: container.to_path_buf(),
            host_path: host.to_path_buf(),
            read_only,
        }
    }
}

impl Answer {
    /// The environment variable `key`, if set.
    pub fn env(&self, key: &str) -> Option<&str> {
        self.envs.get(key).map(String::as_str)
    }

    /// The mount at `container_path`, if any.
    pub fn mount_at(&self, container_path: &Path) -> Option<&Mount> {
        self.mounts
            .iter()
            .find(|m| m.container_path == container_path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mounts_are_found_by_their_container_path() {
        let a = Answer {
            mounts: vec![
                Mount::new(Path::new("/etc/ld.so.preload"), Path::new("/h/p"), true),
                Mount::new(
                    Path::new("/var/run/cuvisor/state"),
                    Path::new("/h/s"),
                    false,
                ),
            ],
            envs: [("NVIDIA_VISIBLE_DEVICES".into(), "GPU-1".into())].into(),
            ..Answer::default()
        };
        let m = a.mount_at(Path::new("/var/run/cuvisor/state")).unwrap();
        assert_eq!(
            (m.host_path.as_path(), m.read_only),
            (Path::new("/h/s"), false)
        );
        assert!(a.mount_at(Path::new("/var/run/cuvisor")).is_none());
        assert_eq!(a.env("NVIDIA_VISIBLE_DEVICES"), Some("GPU-1"));
        assert_eq!(a.env("CUVISOR_CONFIG"), None);
    }
}
