//! Removing the host directories of allocations whose container is gone.
//!
//! Kubelet never tells a device plugin that a container ended. Two rules say it is gone:
//! - **No live processes** (built in): the allocation is older than the grace period and its
//!   ledger has no live process slot (dead processes' slots are reclaimed first). A container
//!   that never ran a CUDA process has no ledger file at all: the same.
//! - **PodResources** (a hook): a [`Liveness`] that knows which device IDs kubelet still
//!   assigns to pods (kubelet's PodResources API). Its answer wins when it has one.
//!
//! Neither rule removes an allocation younger than the grace period.
//!
//! Whole-GPU allocations have no ledger: only a [`Liveness`] answer (or kubelet reusing their
//! devices, see [`crate::registry`]) removes them.

use crate::registry::{Allocation, Kind, Registry, ALLOCATIONS, RECORD};
use cuvisor_shm::ledger::{Ledger, FILE_NAME};
use std::path::Path;
use std::time::Duration;

/// Whether an allocation's container still exists, from a source such as kubelet's
/// PodResources API.
pub trait Liveness: Send + Sync {
    /// `Some(true)`: in use; `Some(false)`: its container is gone; `None`: unknown (the
    /// built-in rule decides).
    fn in_use(&self, allocation: &Allocation) -> Option<bool>;
}

/// Why an allocation was removed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    NoLiveProcesses,
    Liveness,
    /// A directory that the registry no longer holds (superseded, or no record).
    Orphan,
}

/// Applies the rules to the registry and the state root's directories.
pub struct Sweeper {
    registry: Registry,
    grace: Duration,
    liveness: Option<Box<dyn Liveness>>,
}

fn age(created_unix: u64) -> Duration {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    Duration::from_secs(now.saturating_sub(created_unix))
}

/// Live processes in the ledger of `dir` (0 when there is no ledger). Reclaims dead slots.
pub fn live_processes(ledger_dir: &Path) -> usize {
    let path = ledger_dir.join(FILE_NAME);
    if !path.exists() {
        return 0;
    }
    match Ledger::open(&path, false) {
        Ok(l) => {
            l.reclaim_dead();
            l.live_procs().count()
        }
        // Unreadable (being created?): treat as in use.
        Err(_) => 1,
    }
}

impl Sweeper {
    pub fn new(registry: Registry, grace: Duration) -> Sweeper {
        Sweeper {
            registry,
            grace,
            liveness: None,
        }
    }

    /// Adds the PodResources-style rule.
    pub fn with_liveness(mut self, l: Box<dyn Liveness>) -> Sweeper {
        self.liveness = Some(l);
        self
    }

    /// Whether an allocation is over, and why.
    /// Nothing younger than the grace period is removed, whatever the rules say: kubelet calls
    /// Allocate before it records the container, so a PodResources answer from just before
    /// (or just after) an Allocate may not list it yet.
    pub fn verdict(&self, a: &Allocation) -> Option<Reason> {
        if age(a.created_unix) < self.grace {
            return None;
        }
        if let Some(l) = &self.liveness {
            match l.in_use(a) {
                Some(true) => return None,
                Some(false) => return Some(Reason::Liveness),
                None => {}
            }
        }
        if a.kind == Kind::Gpu {
            return None;
        }
        let ledger = a.ledger_dir.clone().unwrap_or_else(|| a.dir.join("state"));
        (live_processes(&ledger) == 0).then_some(Reason::NoLiveProcesses)
    }

    /// One pass: removes what is over; returns (id, reason) of each removal.
    pub fn sweep(&self) -> Vec<(String, Reason)> {
        let mut removed = Vec::new();
        for a in self.registry.view().list() {
            if let Some(r) = self.verdict(&a) {
                self.registry.remove(&a.id);
                let _ = std::fs::remove_dir_all(&a.dir);
                removed.push((a.id, r));
            }
        }
        // Directories the registry does not hold (superseded allocations), past the grace
        // period and without live processes.
        let root = self.registry.root();
        debug_assert!(root.ends_with(ALLOCATIONS));
        let view = self.registry.view();
        if let Ok(rd) = std::fs::read_dir(root) {
            for e in rd.flatten() {
                let id = e.file_name().to_string_lossy().into_owned();
                if view.get(&id).is_some() {
                    continue;
                }
                let dir = e.path();
                let created = std::fs::metadata(dir.join(RECORD))
                    .or_else(|_| std::fs::metadata(&dir))
                    .and_then(|m| m.modified())
                    .ok()
                    .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                    .map(|d| d.as_secs())
                    .unwrap_or(0);
                if age(created) >= self.grace && live_processes(&dir.join("state")) == 0 {
                    let _ = std::fs::remove_dir_all(&dir);
                    removed.push((id, Reason::Orphan));
                }
            }
        }
        removed
    }
}
