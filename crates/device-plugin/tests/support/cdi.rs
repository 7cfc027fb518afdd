//! What a CDI-enabled container runtime does with the CDI device names it is given, written from
//! the CDI project's rules (cncf-tags/container-device-interface at v1.1.0; the files named
//! below), for the tests to apply to the container they run:
//!
//! - [`Registry::load`]: every `*.json` spec in the spec directories, in priority order (the
//!   later directory wins a device name both hold; a name twice in one directory is a conflict
//!   and resolves to nothing) — `pkg/cdi/cache.go` `refresh`, `pkg/cdi/spec-dirs.go`. Each spec
//!   is checked as the library loads it (unknown fields refused, `Spec::validate`).
//! - [`Registry::resolve`]: for each name asked for, in order, its spec's spec-wide edits the
//!   first time one of the spec's devices is asked for, then the device's own edits; a name that
//!   resolves to nothing is an error ("unresolvable CDI devices") — `pkg/cdi/cache.go`
//!   `InjectDevices`.
//! - [`apply`]: the edits to a container (`pkg/cdi/container-edits.go` `Apply`): `env` replaces
//!   a variable of the same name or is appended (runtime-tools `AddMultipleProcessEnv`);
//!   `deviceNodes` replace a node at the same path, `hostPath` defaulting to `path`, cgroup
//!   access `rwm` when no permissions are given (the node's type and numbers come from the host
//!   node: the harness stats it, as `fillMissingInfo` does); `mounts` replace a mount at the same
//!   container path, then are sorted stably by the depth of their destination (`sortMounts`);
//!   the harness makes every bind recursive (`rbind`), where runc would honour `bind` as given.
//!   What the harness cannot do as a runtime would is refused, loudly, never skipped: hooks (the
//!   real NVIDIA spec's `createContainer` hooks — `update-ldcache`, `create-symlinks` — would run
//!   here), `additionalGids`, explicit device numbers or owners, and mounts that are not binds.
#![allow(dead_code)]

use cuvisor_device_plugin::cdi::{self, ContainerEdits, Spec};
use cuvisor_testkit::container::{Device, Mount, Spec as Container};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The devices of the spec files found, by qualified name: (spec index, device index).
pub struct Registry {
    specs: Vec<(PathBuf, Spec)>,
    devices: BTreeMap<String, (usize, usize)>,
}

impl Registry {
    /// Loads every `*.json` file of `dirs` (lowest priority first).
    pub fn load(dirs: &[&Path]) -> Result<Registry, String> {
        let mut specs = Vec::new();
        let mut devices: BTreeMap<String, (usize, usize, usize)> = BTreeMap::new();
        let mut conflicts = Vec::new();
        for (prio, dir) in dirs.iter().enumerate() {
            let Ok(rd) = std::fs::read_dir(dir) else {
                continue;
            };
            let mut files: Vec<PathBuf> = rd
                .filter_map(Result::ok)
                .map(|e| e.path())
                .filter(|p| p.extension().is_some_and(|x| x == "json"))
                .collect();
            files.sort();
            for path in files {
                let text = std::fs::read(&path).map_err(|e| format!("{}: {e}", path.display()))?;
                let spec: Spec = serde_json::from_slice(&text)
                    .map_err(|e| format!("{}: {e}", path.display()))?;
                spec.validate()
                    .map_err(|e| format!("{}: {e}", path.display()))?;
                let s = specs.len();
                for (d, dev) in spec.devices.iter().enumerate() {
                    let name = cdi::qualified(&spec.kind, &dev.name);
                    match devices.get(&name) {
                        Some((p, _, _)) if *p == prio => conflicts.push(name.clone()),
                        _ => {}
                    }
                    devices.insert(name, (prio, s, d));
                }
                specs.push((path, spec));
            }
        }
        for c in conflicts {
            devices.remove(&c);
        }
        Ok(Registry {
            specs,
            devices: devices
                .into_iter()
                .map(|(k, (_, s, d))| (k, (s, d)))
                .collect(),
        })
    }

    /// The edits for `names`, in the order the runtime applies them.
    pub fn resolve(&self, names: &[String]) -> Result<Vec<ContainerEdits>, String> {
        let unresolved: Vec<&String> = names
            .iter()
            .filter(|n| !self.devices.contains_key(*n))
            .collect();
        if !unresolved.is_empty() {
            return Err(format!("unresolvable CDI devices {unresolved:?}"));
        }
        let mut seen = Vec::new();
        let mut out = Vec::new();
        for n in names {
            let (s, d) = self.devices[n];
            if !seen.contains(&s) {
                seen.push(s);
                out.push(self.specs[s].1.container_edits.clone());
            }
            out.push(self.specs[s].1.devices[d].container_edits.clone());
        }
        Ok(out)
    }
}

/// The CDI device names an Allocate answer asks for: `cdi_devices`, then the values of the
/// `cdi.k8s.io/` annotations (`pkg/cdi/annotations.go` `ParseAnnotations`), each checked as a
/// qualified name.
pub fn names_of(cdi_devices: &[String], annotations: &BTreeMap<String, String>) -> Vec<String> {
    let mut names: Vec<String> = cdi_devices.to_vec();
    for (k, v) in annotations {
        if k.starts_with(cdi::ANNOTATION_PREFIX) {
            names.extend(v.split(',').map(String::from));
        }
    }
    for n in &names {
        let (kind, name) = n
            .split_once('=')
            .unwrap_or_else(|| panic!("{n:?}: not a qualified CDI device name"));
        cdi::check_kind(kind).unwrap();
        cdi::check_device_name(name).unwrap();
    }
    names
}

fn depth(p: &Path) -> usize {
    p.components().count()
}

/// Applies `edits` to the container `c`, as `ContainerEdits.Apply` does.
pub fn apply(mut c: Container, edits: &[ContainerEdits]) -> Result<Container, String> {
    for e in edits {
        if !e.hooks.is_empty() {
            return Err(format!(
                "CDI hooks {:?}: not supported by this harness (a runtime would run them)",
                e.hooks.iter().map(|h| &h.hook_name).collect::<Vec<_>>()
            ));
        }
        if !e.additional_gids.is_empty() {
            return Err("CDI additionalGids: not supported by this harness".into());
        }
        for kv in &e.env {
            let (k, v) = kv.split_once('=').ok_or(format!("env {kv:?}"))?;
            c.envs.retain(|(ek, _)| ek != k);
            c.envs.push((k.into(), v.into()));
        }
        for d in &e.device_nodes {
            if d.kind.is_some() || d.major.is_some() || d.minor.is_some() {
                return Err(format!(
                    "device node {}: explicit type/numbers not supported by this harness \
                     (it takes them from the host node)",
                    d.path
                ));
            }
            if d.uid.is_some() || d.gid.is_some() || d.file_mode.is_some() {
                return Err(format!(
                    "device node {}: explicit owner/mode not supported by this harness",
                    d.path
                ));
            }
            let path = PathBuf::from(&d.path);
            c.devices.retain(|x| x.container_path != path);
            c.devices.push(Device {
                container_path: path,
                host_path: PathBuf::from(d.host_path.as_deref().unwrap_or(&d.path)),
                permissions: d.permissions.clone().unwrap_or_else(|| "rwm".into()),
            });
        }
        for m in &e.mounts {
            let bind = m.options.iter().any(|o| o == "bind" || o == "rbind")
                || m.kind.as_deref() == Some("bind");
            if !bind {
                return Err(format!(
                    "mount at {}: options {:?}: only bind mounts are supported by this harness",
                    m.container_path, m.options
                ));
            }
            // The last of "ro"/"rw" wins, as in mount(8) option lists.
            let read_only = m
                .options
                .iter()
                .rev()
                .find(|o| *o == "ro" || *o == "rw")
                .is_some_and(|o| o == "ro");
            let path = PathBuf::from(&m.container_path);
            c.mounts.retain(|x| x.container_path != path);
            c.mounts.push(Mount {
                container_path: path,
                host_path: PathBuf::from(&m.host_path),
                read_only,
            });
        }
        if !e.mounts.is_empty() {
            // Stable: mounts at the same depth keep their order.
            c.mounts.sort_by_key(|m| depth(&m.container_path));
        }
    }
    Ok(c)
}
