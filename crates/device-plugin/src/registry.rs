//! What has been allocated, kept in memory and on disk (`allocation.json` in each allocation's
//! host directory), so that neither a kubelet restart nor a plugin restart loses track of it.
//!
//! Kubelet never says when a container ends; an allocation stays here until
//! [`crate::cleanup`] finds its container gone, or until kubelet hands one of its device IDs to
//! a new allocation (then the old one is over and is dropped from the registry; its directory
//! goes with the next sweep).

use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use crate::layout::{ALLOCATIONS, RECORD};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Kind {
    /// Whole GPUs.
    Gpu,
    /// Memory units.
    Memory,
}

/// One GPU of an allocation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuShare {
    pub uuid: String,
    /// Memory units on this GPU (0 for a whole GPU).
    pub units: u32,
    /// The memory quota in bytes (None: the whole GPU, no quota).
    pub quota: Option<u64>,
    /// The allocation's entry on the GPU's coordinator board (see `coord`), if it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub coord_slot: Option<u32>,
}

/// One Allocate of one container.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Allocation {
    /// Random hex id; also the directory's name.
    pub id: String,
    pub kind: Kind,
    /// The extended resource name.
    pub resource: String,
    /// The device IDs kubelet allocated.
    pub device_ids: Vec<String>,
    pub gpus: Vec<GpuShare>,
    /// The allocation's directory on the host (limits file, ledger directory).
    pub dir: PathBuf,
    /// The ledger directory on the host (`dir/state`), for metrics; None for whole GPUs.
    pub ledger_dir: Option<PathBuf>,
    /// Seconds since the epoch.
    pub created_unix: u64,
}

#[derive(Default)]
struct Inner {
    allocs: BTreeMap<String, Allocation>,
    /// device ID -> allocation id
    owner: HashMap<String, String>,
}

/// The plugin's registry (read-write).
#[derive(Clone)]
pub struct Registry {
    inner: Arc<RwLock<Inner>>,
    root: PathBuf,
    /// Bumped on every insert and removal (ListAndWatch re-sends: a GPU held whole hides its
    /// memory units, and memory units in use hide their GPU).
    changes: Arc<tokio::sync::watch::Sender<u64>>,
}

/// A read-only view of the registry, for metrics. Cheap to clone.
#[derive(Clone)]
pub struct RegistryView {
    inner: Arc<RwLock<Inner>>,
}

impl RegistryView {
    /// Every live allocation, by id.
    pub fn list(&self) -> Vec<Allocation> {
        read(&self.inner).allocs.values().cloned().collect()
    }
    pub fn get(&self, id: &str) -> Option<Allocation> {
        read(&self.inner).allocs.get(id).cloned()
    }
    /// The allocation that holds a device ID.
    pub fn owner_of(&self, device_id: &str) -> Option<Allocation> {
        let g = read(&self.inner);
        g.owner
            .get(device_id)
            .and_then(|id| g.allocs.get(id))
            .cloned()
    }
    pub fn len(&self) -> usize {
        read(&self.inner).allocs.len()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

fn read(l: &RwLock<Inner>) -> std::sync::RwLockReadGuard<'_, Inner> {
    l.read().unwrap_or_else(|e| e.into_inner())
}

fn write(l: &RwLock<Inner>) -> std::sync::RwLockWriteGuard<'_, Inner> {
    l.write().unwrap_or_else(|e| e.into_inner())
}

impl Registry {
    /// The registry of `state_root`, with the allocations recorded there.
    pub fn open(state_root: &Path) -> Result<Registry, String> {
        let root = state_root.join(ALLOCATIONS);
        std::fs::create_dir_all(&root).map_err(|e| format!("{}: {e}", root.display()))?;
        let mut found: Vec<Allocation> = Vec::new();
        for e in std::fs::read_dir(&root).map_err(|e| format!("{}: {e}", root.display()))? {
            let Ok(e) = e else { continue };
            let p = e.path().join(RECORD);
            match std::fs::read(&p).map(|b| serde_json::from_slice::<Allocation>(&b)) {
                Ok(Ok(a)) => found.push(a),
                Ok(Err(err)) => eprintln!("cuvisor-device-plugin: ignoring {}: {err}", p.display()),
                Err(_) => {} // no record: a directory being written or removed
            }
        }
        found.sort_by_key(|a| a.created_unix);
        let r = Registry {
            inner: Arc::default(),
            root,
            changes: Arc::new(tokio::sync::watch::channel(0).0),
        };
        {
            let mut g = write(&r.inner);
            for a in found {
                insert_locked(&mut g, a);
            }
        }
        Ok(r)
    }

    /// Where allocation directories go.
    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn view(&self) -> RegistryView {
        RegistryView {
            inner: self.inner.clone(),
        }
    }

    /// Changes on every insert and removal.
    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<u64> {
        self.changes.subscribe()
    }

    fn changed(&self) {
        self.changes.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// Records an allocation (writing its record into its directory first). Allocations that
    /// held any of its device IDs are over: they leave the registry.
    pub fn insert(&self, a: Allocation) -> Result<(), String> {
        let p = a.dir.join(RECORD);
        let json = serde_json::to_vec_pretty(&a).map_err(|e| e.to_string())?;
        std::fs::write(&p, json).map_err(|e| format!("{}: {e}", p.display()))?;
        insert_locked(&mut write(&self.inner), a);
        self.changed();
        Ok(())
    }

    /// Forgets an allocation (its directory is the caller's).
    pub fn remove(&self, id: &str) -> Option<Allocation> {
        let a = {
            let mut g = write(&self.inner);
            let a = g.allocs.remove(id)?;
            for d in &a.device_ids {
                if g.owner.get(d).is_some_and(|o| o == id) {
                    g.owner.remove(d);
                }
            }
            a
        };
        self.changed();
        Some(a)
    }

    /// Memory units in use per GPU UUID.
    pub fn units_in_use(&self) -> HashMap<String, u32> {
        let g = read(&self.inner);
        let mut m = HashMap::new();
        for a in g.allocs.values() {
            for s in &a.gpus {
                *m.entry(s.uuid.clone()).or_default() += s.units;
            }
        }
        m
    }

    /// GPUs held whole.
    pub fn whole_gpus_in_use(&self) -> Vec<String> {
        let g = read(&self.inner);
        g.allocs
            .values()
            .filter(|a| a.kind == Kind::Gpu)
            .flat_map(|a| a.gpus.iter().map(|s| s.uuid.clone()))
            .collect()
    }
}

fn insert_locked(g: &mut Inner, a: Allocation) {
    let stale: Vec<String> = a
        .device_ids
        .iter()
        .filter_map(|d| g.owner.get(d).cloned())
        .collect();
    for id in stale {
        if let Some(old) = g.allocs.remove(&id) {
            for d in &old.device_ids {
                g.owner.remove(d);
            }
        }
    }
    for d in &a.device_ids {
        g.owner.insert(d.clone(), a.id.clone());
    }
    g.allocs.insert(a.id.clone(), a);
}
