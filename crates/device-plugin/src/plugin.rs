//! The plugin's domain: the node's GPUs (`inventory`), what is allocated (`registry`), and the
//! rules that answer kubelet's questions — which devices each resource reports healthy, which
//! devices to prefer (`plan`), and Allocate (`inject` writes the host files and states the
//! [`Answer`]). No gRPC here: `server` serves these answers to kubelet, translating them, and
//! a later DRA kubelet plugin can serve the same domain.
//!
//! A refusal is a [`Refusal`], whose kind the transport maps to its own codes.

use crate::answer::Answer;
use crate::config::Config;
use crate::inventory::Inventory;
use crate::registry::{Kind, Registry, RegistryView};
use crate::topology::Topology;
use crate::{cdi, inject, plan, HealthMap, HealthReceiver};
use std::path::Path;
use std::sync::Mutex;

/// Why a request is refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The request itself is wrong (unknown device IDs, a size that cannot be met).
    Invalid(String),
    /// A device asked for is held by the other resource.
    Unavailable(String),
    /// The plugin failed (host files, the registry).
    Failed(String),
}

impl Refusal {
    pub fn message(&self) -> &str {
        match self {
            Refusal::Invalid(m) | Refusal::Unavailable(m) | Refusal::Failed(m) => m,
        }
    }
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.message())
    }
}

/// The plugin: configuration, devices, registry, health.
pub struct Plugin {
    cfg: Config,
    inv: Inventory,
    registry: Registry,
    health: HealthReceiver,
    /// `[cdi]`, parsed: how Allocate names devices to the runtime.
    cdi: cdi::Settings,
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

/// Under a CDI strategy Allocate names NVIDIA's device of each GPU; a GPU that no spec the
/// plugin can see declares makes every tenant on it fail to start, so it is said once at startup,
/// with what to do (docs/cdi.md).
fn warn_undeclared_gpus(cdi: &cdi::Settings, inv: &Inventory) {
    let wanted: Vec<String> = inv
        .gpus()
        .iter()
        .map(|g| {
            cdi.nvidia_device(cdi::GpuRef {
                uuid: &g.uuid,
                index: g.index,
            })
        })
        .collect();
    let mut dirs: Vec<&Path> = cdi::DEFAULT_SPEC_DIRS.iter().map(Path::new).collect();
    if !dirs.contains(&cdi.spec_dir.as_path()) {
        dirs.push(&cdi.spec_dir);
    }
    let missing = cdi::undeclared(&dirs, &wanted);
    if !missing.is_empty() {
        eprintln!(
            "cuvisor-device-plugin: warning: no CDI spec in {} declares {}: containers given \
             them will not start (\"unresolvable CDI devices\"); write NVIDIA's spec on the node \
             (nvidia-ctk cdi generate --output=/var/run/cdi/nvidia.yaml) or set [cdi] nvidia_kind \
             and nvidia_device_name to the spec it has (docs/cdi.md)",
            dirs.iter()
                .map(|d| d.display().to_string())
                .collect::<Vec<_>>()
                .join(", "),
            missing.join(", ")
        );
    }
}

impl Plugin {
    /// Checks the configuration, opens the registry under the state root (reloading recorded
    /// allocations) and writes the shared host files.
    pub fn new(cfg: Config, topology: Topology, health: HealthReceiver) -> Result<Plugin, String> {
        cfg.validate().map_err(|e| e.0)?;
        let cdi = cfg.cdi.settings()?;
        let unit = cfg.memory_unit_bytes().map_err(|e| e.0)?;
        let inv = Inventory::new(topology, unit)?;
        inject::install_shared(&cfg)?;
        // Every Allocate mounts a tmpfs: a plugin that cannot says so now, not at each one.
        crate::ledger_dir::probe(&cfg.state_root, &cfg.ledger_dir)?;
        if cdi.strategy.is_cdi() {
            cdi::probe(&cdi.spec_dir)?;
        }
        let registry = Registry::open(&cfg.state_root)?;
        // The CDI specs of recorded allocations, back where the runtime reads them (kubelet
        // starts containers again from its checkpointed answers, naming them).
        if cdi.strategy.is_cdi() {
            for a in registry.view().list() {
                let kept = a.dir.join(crate::layout::CDI_SPEC);
                match cdi::reinstall(&cdi.spec_dir, &a.id, &kept) {
                    Ok(true) => eprintln!(
                        "cuvisor-device-plugin: allocation {}: its CDI spec put back in {}",
                        a.id,
                        cdi.spec_dir.display()
                    ),
                    Ok(false) => {}
                    Err(e) => eprintln!("cuvisor-device-plugin: allocation {}: {e}", a.id),
                }
            }
        }
        if cdi.strategy.is_cdi() {
            warn_undeclared_gpus(&cdi, &inv);
        }
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
            cdi,
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

    /// The name a resource is advertised under.
    pub fn resource_name(&self, kind: Kind) -> &str {
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

    /// The health each GPU of a resource is reported with: the health checker's, and
    /// Unhealthy where the other resource holds the GPU. Both resources share the GPUs: while a
    /// GPU is allocated whole its memory units are reported Unhealthy, and while any of its
    /// memory units are allocated the whole GPU is, so that kubelet cannot hand out the same GPU
    /// twice.
    pub fn health_of(&self, kind: Kind) -> HealthMap {
        let mut h = self.health.borrow().clone();
        for (g, hold) in self.holds(&[]).iter().enumerate() {
            if self.taken_by_other(kind, g, hold).is_some() {
                h.insert(self.inv.gpus()[g].uuid.clone(), false);
            }
        }
        h
    }

    /// The health checker's channel (the server re-sends device lists on its changes).
    pub fn health(&self) -> HealthReceiver {
        self.health.clone()
    }

    /// The GPU (inventory position) of a device ID of `kind`.
    fn gpu_of(&self, kind: Kind, id: &str) -> Option<usize> {
        match kind {
            Kind::Gpu => self.inv.gpu_by_uuid(id),
            Kind::Memory => self.inv.parse_unit_id(id).map(|(g, _)| g),
        }
    }

    /// GetPreferredAllocation for one container: `size` of the `available` device IDs, with
    /// every one of `must_include`.
    pub fn preferred(
        &self,
        kind: Kind,
        available: &[String],
        must_include: &[String],
        size: usize,
    ) -> Result<Vec<String>, Refusal> {
        let name = self.resource_name(kind);
        // Devices whose GPU the other resource holds are not offered (kubelet sees them
        // Unhealthy; this covers a request made before it saw the change).
        let holds = self.holds(&[]);
        let taken = |id: &String| {
            self.gpu_of(kind, id)
                .and_then(|g| self.taken_by_other(kind, g, &holds[g]))
        };
        if let Some(why) = must_include.iter().find_map(taken) {
            return Err(Refusal::Unavailable(format!(
                "{name}: a must-include device is not available: {why}"
            )));
        }
        let mut dropped = None;
        let available: Vec<String> = available
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
                return Err(Refusal::Unavailable(format!(
                    "{name}: {size} device(s) requested, {} available: {why}",
                    available.len()
                )));
            }
        }
        match kind {
            Kind::Memory => plan::preferred_memory(&self.inv, &available, must_include, size),
            Kind::Gpu => plan::preferred_gpus(
                &self.inv,
                &available,
                must_include,
                size,
                &self.cfg.topology,
            ),
        }
        .map_err(|e| Refusal::Invalid(format!("{name}: {e}")))
    }

    /// Allocate for one container and device IDs `ids`: writes the host files, records the
    /// allocation, answers what the container gets.
    pub fn allocate(&self, kind: Kind, ids: &[String]) -> Result<Answer, Refusal> {
        let name = self.resource_name(kind).to_string();
        let _g = self.allocating.lock().unwrap_or_else(|e| e.into_inner());
        // Board entries are assigned and recorded before a sweep may reconcile the boards.
        let _boards = crate::coord::lock();
        // An allocation that loses a device ID to this one is over: it does not count.
        let holds = self.holds(ids);
        for id in ids {
            if let Some(g) = self.gpu_of(kind, id) {
                if let Some(why) = self.taken_by_other(kind, g, &holds[g]) {
                    return Err(Refusal::Unavailable(format!("{name}: {why}")));
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
                .map_err(Refusal::Invalid)?;
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
                    let g = self
                        .inv
                        .gpu_by_uuid(id)
                        .ok_or_else(|| Refusal::Invalid(format!("{name}: unknown GPU {id:?}")))?;
                    if !gpus.contains(&g) {
                        gpus.push(g);
                    }
                }
                if gpus.is_empty() {
                    return Err(Refusal::Invalid(format!("{name}: no devices")));
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
        .map_err(|e| Refusal::Failed(format!("{name}: {e}")))?;
        let a = &prepared.allocation;
        // Under a CDI strategy the answer names CDI devices; a memory allocation's own spec is
        // written before kubelet hears of it, and goes with the allocation (the sweeper).
        let gpus: Vec<cdi::GpuRef<'_>> = a
            .gpus
            .iter()
            .filter_map(|s| {
                let g = &self.inv.gpus()[self.inv.gpu_by_uuid(&s.uuid)?];
                Some(cdi::GpuRef {
                    uuid: &g.uuid,
                    index: g.index,
                })
            })
            .collect();
        let (answer, spec) = cdi::settle(
            &self.cdi,
            &a.id,
            &gpus,
            a.kind == Kind::Memory,
            prepared.answer.clone(),
        );
        let recorded = match &spec {
            Some(spec) => cdi::write_spec_file(&a.dir.join(crate::layout::CDI_SPEC), spec)
                .and_then(|()| cdi::write_spec(&self.cdi.spec_dir, &a.id, spec).map(drop)),
            None => Ok(()),
        }
        .and_then(|()| {
            self.registry
                .insert(a.clone())
                .map_err(|e| format!("recording: {e}"))
        });
        if let Err(e) = recorded {
            let uuids: Vec<String> = a.gpus.iter().map(|g| g.uuid.clone()).collect();
            crate::coord::release_all(&self.cfg.host_coord_dir(), &uuids, &a.id);
            let _ = cdi::remove_spec(&self.cdi.spec_dir, &a.id);
            let _ = crate::ledger_dir::retire(&a.dir, &crate::tenant_tree::Bounds::default());
            return Err(Refusal::Failed(format!("{name}: {e}")));
        }
        Ok(answer)
    }

    /// `[cdi]`, parsed.
    pub fn cdi(&self) -> &cdi::Settings {
        &self.cdi
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{HostPaths, LedgerDir};
    use crate::topology::{Gpu, Link, Memory, PcieLevel};
    use std::path::{Path, PathBuf};

    const GIB: u64 = 1 << 30;

    /// Two 4 GiB GPUs whose minor numbers (7, 3) are not their indices, under a fresh state
    /// root with a plain ledger directory (no tmpfs: no mount needed).
    fn plugin(name: &str) -> (Plugin, PathBuf) {
        let root =
            std::env::temp_dir().join(format!("cuvisor-plugin-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(root.join("dev")).unwrap();
        std::fs::write(root.join("dev/nvidiactl"), "").unwrap();
        let gpus = [7, 3]
            .iter()
            .enumerate()
            .map(|(i, minor)| {
                let mut g = Gpu::new(i);
                g.uuid = Some(format!("GPU-{i:08x}-0000-0000-0000-000000000000"));
                g.memory = Some(Memory {
                    total: 4 * GIB,
                    free: 4 * GIB,
                });
                g.minor = Some(*minor);
                g
            })
            .collect();
        let links = vec![vec![Link::pcie(PcieLevel::Single); 2]; 2];
        let cfg = Config {
            state_root: root.join("state"),
            host: HostPaths {
                dev_dir: root.join("dev"),
                ..HostPaths::default()
            },
            ledger_dir: LedgerDir {
                mount: "none".into(),
                ..LedgerDir::default()
            },
            ..Config::default()
        };
        let topology = Topology::new(gpus, links, 16.0).unwrap();
        let (_tx, rx) = crate::health_channel();
        (Plugin::new(cfg, topology, rx).unwrap(), root)
    }

    fn ids(p: &Plugin, g: usize, units: std::ops::Range<u32>) -> Vec<String> {
        units.map(|k| p.inventory().unit_id(g, k)).collect()
    }

    #[test]
    fn a_whole_gpu_gets_its_own_node_by_minor_and_no_library() {
        let (p, root) = plugin("whole");
        let uuid = p.inventory().gpus()[1].uuid.clone();
        let a = p.allocate(Kind::Gpu, std::slice::from_ref(&uuid)).unwrap();
        assert_eq!(a.env("NVIDIA_VISIBLE_DEVICES"), Some(uuid.as_str()));
        let nodes: Vec<(&Path, &Path)> = a
            .devices
            .iter()
            .map(|d| (d.container_path.as_path(), d.host_path.as_path()))
            .collect();
        // GPU 1's node is /dev/nvidia3 (its minor), then the control nodes that exist.
        assert_eq!(
            nodes,
            [
                (
                    Path::new("/dev/nvidia3"),
                    root.join("dev/nvidia3").as_path()
                ),
                (
                    Path::new("/dev/nvidiactl"),
                    root.join("dev/nvidiactl").as_path()
                ),
            ]
        );
        assert!(a.mounts.is_empty(), "{:?}", a.mounts);
        assert!(a.cdi_devices.is_empty());
        assert!(a
            .annotations
            .contains_key(crate::inject::ALLOCATION_ANNOTATION));
        // Its memory units are the other resource's no more.
        let e = p.allocate(Kind::Memory, &ids(&p, 1, 0..1)).unwrap_err();
        assert!(matches!(e, Refusal::Unavailable(_)), "{e:?}");
        assert_eq!(p.health_of(Kind::Memory).get(&uuid), Some(&false));
        let _ = std::fs::remove_dir_all(root);
    }

    #[test]
    fn memory_units_get_the_library_the_limits_file_and_their_ledger_directory() {
        let (p, root) = plugin("memory");
        let a = p.allocate(Kind::Memory, &ids(&p, 0, 0..3)).unwrap();
        let c = &p.config().container;
        let preload = a.mount_at(Path::new("/etc/ld.so.preload")).unwrap();
        assert!(preload.read_only);
        assert!(a.mount_at(&c.library).unwrap().read_only);
        let limits = a
            .mount_at(Path::new(cuvisor_shm::CONTAINER_LIMITS))
            .unwrap();
        assert!(limits.read_only);
        let text = std::fs::read_to_string(&limits.host_path).unwrap();
        let uuid = &p.inventory().gpus()[0].uuid;
        assert!(
            text.contains(&format!("memory.{uuid} = {}", 3 * GIB)),
            "{text}"
        );
        assert!(!a.mount_at(&c.state_dir).unwrap().read_only);
        // The GPU held in part cannot be taken whole; a request of unknown IDs is invalid.
        let e = p
            .allocate(Kind::Gpu, std::slice::from_ref(uuid))
            .unwrap_err();
        assert!(matches!(e, Refusal::Unavailable(_)), "{e:?}");
        let e = p.allocate(Kind::Gpu, &["GPU-nope".into()]).unwrap_err();
        assert!(matches!(e, Refusal::Invalid(_)), "{e:?}");
        let _ = std::fs::remove_dir_all(root);
    }

    /// Under `cdi-cri`: a memory allocation's answer names NVIDIA's GPU and cuvisor's device and
    /// holds nothing else; cuvisor's spec is in `spec_dir` with the mounts the `envvar` answer
    /// gives, and leaves with the allocation when the sweeper retires it. A whole GPU gets
    /// NVIDIA's name only, and no spec.
    #[test]
    fn under_cdi_cri_an_allocation_answers_cdi_names_and_its_spec_goes_with_it() {
        let (envvar, root) = plugin("cdi-envvar");
        let want = envvar
            .allocate(Kind::Memory, &ids(&envvar, 0, 0..2))
            .unwrap();
        let _ = std::fs::remove_dir_all(root);
        let (p0, root) = plugin("cdi-cri");
        let spec_dir = root.join("cdi");
        let mut cfg = p0.config().clone();
        cfg.cdi.strategy = "cdi-cri".into();
        cfg.cdi.spec_dir = spec_dir.clone();
        drop(p0);
        let topology = || {
            Topology::new(
                (0..2)
                    .map(|i| {
                        let mut g = Gpu::new(i);
                        g.uuid = Some(format!("GPU-{i:08x}-0000-0000-0000-000000000000"));
                        g.memory = Some(Memory {
                            total: 4 * GIB,
                            free: 4 * GIB,
                        });
                        g.minor = Some([7, 3][i]);
                        g
                    })
                    .collect(),
                vec![vec![Link::pcie(PcieLevel::Single); 2]; 2],
                16.0,
            )
            .unwrap()
        };
        let (_tx, rx) = crate::health_channel();
        let p = Plugin::new(cfg, topology(), rx).unwrap();
        let a = p.allocate(Kind::Memory, &ids(&p, 0, 0..2)).unwrap();
        let id = a.annotations[crate::inject::ALLOCATION_ANNOTATION].clone();
        let uuid = p.inventory().gpus()[0].uuid.clone();
        assert_eq!(
            a.cdi_devices,
            [
                format!("nvidia.com/gpu={uuid}"),
                format!("cuvisor.io/allocation={id}")
            ]
        );
        assert!(
            a.envs.is_empty() && a.mounts.is_empty() && a.devices.is_empty(),
            "{a:?}"
        );
        let file = cdi::spec_file(&spec_dir, &id);
        let spec: cdi::Spec = serde_json::from_slice(&std::fs::read(&file).unwrap()).unwrap();
        spec.validate().unwrap();
        let mounts: Vec<(String, bool)> = spec.devices[0]
            .container_edits
            .mounts
            .iter()
            .map(|m| (m.container_path.clone(), m.options[0] == "ro"))
            .collect();
        let want: Vec<(String, bool)> = want
            .mounts
            .iter()
            .map(|m| (m.container_path.to_string_lossy().into_owned(), m.read_only))
            .collect();
        assert_eq!(mounts, want, "the envvar answer's mounts, as CDI mounts");
        // A restart puts a missing spec back from the allocation's copy.
        std::fs::remove_file(&file).unwrap();
        let (_tx2, rx2) = crate::health_channel();
        let p2 = Plugin::new(p.config().clone(), topology(), rx2).unwrap();
        assert!(file.exists(), "not put back at startup");
        drop(p2);
        // A whole GPU: NVIDIA's name, no spec of its own.
        let other = p.inventory().gpus()[1].uuid.clone();
        let w = p.allocate(Kind::Gpu, std::slice::from_ref(&other)).unwrap();
        assert_eq!(w.cdi_devices, [format!("nvidia.com/gpu={other}")]);
        assert!(w.devices.is_empty() && w.envs.is_empty());
        let wid = &w.annotations[crate::inject::ALLOCATION_ANNOTATION];
        assert!(!cdi::spec_file(&spec_dir, wid).exists());
        // The sweeper retires the memory allocation (no process in its ledger): its spec goes.
        let sweeper =
            crate::cleanup::Sweeper::new(p.registry_mut().clone(), std::time::Duration::ZERO)
                .with_cdi_dir(spec_dir.clone());
        let removed = sweeper.sweep();
        assert!(removed.iter().any(|(r, _)| *r == id), "{removed:?}");
        assert!(!file.exists(), "the spec outlived its allocation");
        let _ = std::fs::remove_dir_all(root);
    }

    /// Under a CDI strategy a `spec_dir` that cannot be written stops the plugin at startup,
    /// with the key's name, rather than failing every Allocate.
    #[test]
    fn a_cdi_spec_dir_that_cannot_be_written_stops_the_plugin_at_startup() {
        let (p0, root) = plugin("cdi-probe");
        let mut cfg = p0.config().clone();
        drop(p0);
        std::fs::write(root.join("file"), "").unwrap();
        cfg.cdi.strategy = "cdi-annotations".into();
        cfg.cdi.spec_dir = root.join("file/cdi");
        let topology = Topology::new(
            vec![{
                let mut g = Gpu::new(0);
                g.uuid = Some("GPU-00000000-0000-0000-0000-000000000000".into());
                g.memory = Some(Memory {
                    total: 4 * GIB,
                    free: 4 * GIB,
                });
                g
            }],
            vec![vec![Link::pcie(PcieLevel::Single)]],
            16.0,
        )
        .unwrap();
        let (_tx, rx) = crate::health_channel();
        let e = Plugin::new(cfg, topology, rx).err().expect("refused");
        assert!(e.starts_with("[cdi] spec_dir: "), "{e}");
        let _ = std::fs::remove_dir_all(root);
    }
}
