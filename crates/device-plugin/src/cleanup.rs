//! Removing the host directories of allocations whose container is gone.
//!
//! Kubelet never tells a device plugin that a container ended. Two rules say it is gone:
//! - **PodResources** (a hook, on by default): a [`Liveness`] that knows which device IDs
//!   kubelet still assigns to pods (kubelet's PodResources API). When it is configured it alone
//!   decides, and while it has no answer (kubelet restarting, the socket gone) nothing is
//!   removed.
//! - **No live processes** (only when no [`Liveness`] is configured): the allocation is older
//!   than the grace period and no process of the container holds a lease in its ledger (a lock
//!   the kernel drops when the process dies: `cuvisor_shm::lease`). A container that never ran
//!   a CUDA process has no ledger file at all: the same. This rule cannot tell a container
//!   that is idle between two CUDA programs from one that is gone; PodResources can.
//!
//! Pids are never evidence here: the plugin runs in its pod's pid namespace and every
//! container has its own, so a pid a container recorded names nothing (or another process)
//! from here. The plugin never gives back a container's charges either: only the container's
//! own processes judge and reclaim its dead processes' slots. Neither rule removes an
//! allocation younger than the grace period. The ledger is opened beneath the allocation's
//! directory without following symlinks or blocking, and never mapped or locked.
//!
//! Whole-GPU allocations have no ledger: only a [`Liveness`] answer (or kubelet reusing their
//! devices, see [`crate::registry`]) removes them.
//!
//! A directory is removed by [`crate::ledger_dir::retire`]: its record, its tmpfs, then what is
//! left by [`crate::tenant_tree`]'s bounded walk, never recursion (a tenant's 100 000-level tree
//! once overflowed the sweeper's stack and aborted the plugin at every restart). A directory not
//! removed within the walk's bounds is given up on for now: one log line, counted in
//! [`CleanupStats`] (the metrics endpoint shows it), and tried again at every later sweep,
//! whatever its age, while the other allocations are removed as usual. Sweeps run on a thread
//! of their own (`main.rs`), so none of it takes time from the gRPC service.

use crate::layout::{ALLOCATIONS, RECORD, STATE};
use crate::registry::{Allocation, Kind, Registry};
use crate::tenant_tree::Bounds;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// What the sweeper could not finish, for the metrics endpoint.
#[derive(Debug, Default)]
pub struct CleanupStats {
    given_up: AtomicU64,
    pending: AtomicU64,
}

impl CleanupStats {
    /// Removals given up on (a directory given up on at three sweeps counts three times).
    pub fn given_up_total(&self) -> u64 {
        self.given_up.load(Relaxed)
    }
    /// Directories waiting for a later sweep now.
    pub fn pending(&self) -> u64 {
        self.pending.load(Relaxed)
    }
}

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
    /// A directory given up on at an earlier sweep (over the walk's bounds), finished now.
    Retried,
}

/// Applies the rules to the registry and the state root's directories.
pub struct Sweeper {
    registry: Registry,
    grace: Duration,
    liveness: Option<Box<dyn Liveness>>,
    /// The host's coordinators' directory, whose boards follow the registry (`coord`).
    coord_dir: Option<std::path::PathBuf>,
    /// `[cdi] spec_dir`: where a retired allocation's CDI spec is removed from.
    cdi_dir: Option<std::path::PathBuf>,
    /// What one directory's removal may take at one sweep.
    bounds: Bounds,
    /// Directories given up on, by allocation id: tried again at every sweep.
    pending: Mutex<BTreeMap<String, PathBuf>>,
    stats: Arc<CleanupStats>,
}

fn age(created_unix: u64) -> Duration {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    Duration::from_secs(now.saturating_sub(created_unix))
}

impl Sweeper {
    pub fn new(registry: Registry, grace: Duration) -> Sweeper {
        Sweeper {
            registry,
            grace,
            liveness: None,
            coord_dir: None,
            cdi_dir: None,
            bounds: Bounds::default(),
            pending: Mutex::default(),
            stats: Arc::default(),
        }
    }

    /// What one directory's removal may take at one sweep (default: [`Bounds::default`]).
    pub fn with_bounds(mut self, bounds: Bounds) -> Sweeper {
        self.bounds = bounds;
        self
    }

    /// The counters the metrics endpoint shows.
    pub fn stats(&self) -> Arc<CleanupStats> {
        self.stats.clone()
    }

    /// Removes directory `dir` of allocation `id`, or gives up on it for now: true when it is
    /// gone. The first give-up of a directory is logged, every one counted.
    fn retire(&self, id: &str, dir: &Path) -> bool {
        if let Some(cdi_dir) = &self.cdi_dir {
            if let Err(e) = crate::cdi::remove_spec(cdi_dir, id) {
                eprintln!("cuvisor-device-plugin: allocation {id}: its CDI spec: {e}");
            }
        }
        let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        let gone = match crate::ledger_dir::retire(dir, &self.bounds) {
            Ok(_) => {
                if pending.remove(id).is_some() {
                    eprintln!(
                        "cuvisor-device-plugin: allocation {id}: {} removed at last",
                        dir.display()
                    );
                }
                true
            }
            Err(g) => {
                self.stats.given_up.fetch_add(1, Relaxed);
                if pending.insert(id.to_string(), dir.to_path_buf()).is_none() {
                    eprintln!(
                        "cuvisor-device-plugin: allocation {id}: {g}; tried again at every sweep"
                    );
                }
                false
            }
        };
        self.stats.pending.store(pending.len() as u64, Relaxed);
        gone
    }

    /// Also removes each retired allocation's CDI spec from `dir` (`[cdi] spec_dir`), before
    /// its directory: no container is created from an allocation that is over.
    pub fn with_cdi_dir(mut self, dir: std::path::PathBuf) -> Sweeper {
        self.cdi_dir = Some(dir);
        self
    }

    /// Also takes off coordinator board entries no allocation holds any more, at each sweep.
    pub fn with_coord_dir(mut self, dir: std::path::PathBuf) -> Sweeper {
        self.coord_dir = Some(dir);
        self
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
            // Configured: it alone decides; no answer (an outage) removes nothing.
            return match l.in_use(a) {
                Some(false) => Some(Reason::Liveness),
                Some(true) | None => None,
            };
        }
        if a.kind == Kind::Gpu {
            return None;
        }
        let ledger = a.ledger_dir.clone().unwrap_or_else(|| a.dir.join(STATE));
        (!crate::ledger_dir::has_live_process(&ledger)).then_some(Reason::NoLiveProcesses)
    }

    /// One pass: removes what is over; returns (id, reason) of each directory removed. An
    /// allocation that is over leaves the registry at once, even when its directory is given up
    /// on for now.
    pub fn sweep(&self) -> Vec<(String, Reason)> {
        let mut removed = Vec::new();
        let retry: Vec<(String, PathBuf)> = self
            .pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|(id, dir)| (id.clone(), dir.clone()))
            .collect();
        for (id, dir) in retry {
            if self.retire(&id, &dir) {
                removed.push((id, Reason::Retried));
            }
        }
        for a in self.registry.view().list() {
            if let Some(r) = self.verdict(&a) {
                self.registry.remove(&a.id);
                if self.retire(&a.id, &a.dir) {
                    removed.push((a.id, r));
                }
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
                let tried = self
                    .pending
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .contains_key(&id);
                if view.get(&id).is_some() || tried {
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
                if age(created) >= self.grace
                    && !crate::ledger_dir::has_live_process(&dir.join(STATE))
                    && self.retire(&id, &dir)
                {
                    removed.push((id, Reason::Orphan));
                }
            }
        }
        if let Some(coord) = &self.coord_dir {
            let _boards = crate::coord::lock();
            for what in crate::coord::reconcile(coord, &self.registry) {
                eprintln!("cuvisor-device-plugin: coordinator {what}: no allocation holds it");
            }
        }
        removed
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::GpuShare;
    use cuvisor_shm::ledger::Ledger;
    use std::path::PathBuf;

    struct Fixed(Option<bool>);
    impl Liveness for Fixed {
        fn in_use(&self, _: &Allocation) -> Option<bool> {
            self.0
        }
    }

    fn scratch(tag: &str) -> (PathBuf, Registry, Allocation) {
        let root =
            std::env::temp_dir().join(format!("cuvisor-cleanup-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let registry = Registry::open(&root).unwrap();
        let dir = registry.root().join("00000000000000a1");
        std::fs::create_dir_all(dir.join("state")).unwrap();
        let a = Allocation {
            id: "00000000000000a1".into(),
            kind: Kind::Memory,
            resource: "cuvisor.io/gpu-memory".into(),
            device_ids: vec!["u-0".into()],
            gpus: vec![GpuShare {
                uuid: "GPU-00000000-0000-0000-0000-000000000001".into(),
                units: 1,
                quota: Some(1 << 30),
                coord_slot: None,
            }],
            ledger_dir: Some(dir.join("state")),
            dir,
            created_unix: 0, // long past the grace period
        };
        registry.insert(a.clone()).unwrap();
        (root, registry, a)
    }

    #[test]
    fn pid_evidence_never_removes_or_drains_a_live_container() {
        let (root, registry, a) = scratch("pid");
        let state = a.ledger_dir.clone().unwrap();
        // A process of the container: its pid (as its own namespace numbers it) names nothing
        // in ours, but it holds its slot's lease.
        let tenant = Ledger::open_dir(&state).unwrap();
        let d = tenant.device_for([1; 16], 1 << 30).unwrap();
        let p = tenant.claim_proc(4_000_000, 1).unwrap();
        tenant.try_charge(d, p, 6 << 20).unwrap();
        let sweeper = Sweeper::new(registry.clone(), Duration::ZERO);
        assert_eq!(sweeper.verdict(&a), None);
        assert!(sweeper.sweep().is_empty());
        assert_eq!(
            tenant.device(d).used_bytes(),
            6 << 20,
            "charges not drained"
        );
        assert!(state.join("ledger").exists());
        // The process dies (its description closes): now nothing of the container lives.
        drop(tenant);
        // (A thread of this test binary that forks holds copies of the description until its
        // child execs: the lease may outlive the drop by that long.)
        let t = std::time::Instant::now();
        while sweeper.verdict(&a).is_none() {
            assert!(t.elapsed() < Duration::from_secs(2), "the lease never went");
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(sweeper.verdict(&a), Some(Reason::NoLiveProcesses));
        let _ = std::fs::remove_dir_all(&root);
    }

    /// The attack: a tenant makes its ledger directory 100 000 levels deep. The sweep's
    /// `remove_dir_all` recursed once per level and overflowed its thread's stack (2 MiB, as
    /// tokio's workers have): the plugin aborted, and again at every restart. Now the tree is
    /// removed by the bounded walk on a thread of that size, the other allocation at the same
    /// sweep; over its time bound the tree is given up on, counted, and finished at later sweeps.
    #[test]
    fn a_deep_tree_in_a_tenants_ledger_dir_neither_crashes_nor_blocks_the_sweep() {
        let s = crate::tenant_tree::tests::FastScratch::new("sweep-deep");
        let registry = Registry::open(&s.0).unwrap();
        let mut dirs = Vec::new();
        for id in ["00000000000000a1", "00000000000000b2"] {
            let dir = registry.root().join(id);
            std::fs::create_dir_all(dir.join("state")).unwrap();
            std::fs::write(dir.join("limits.conf"), b"").unwrap();
            registry
                .insert(Allocation {
                    id: id.into(),
                    kind: Kind::Memory,
                    resource: "cuvisor.io/gpu-memory".into(),
                    device_ids: vec![format!("u-{id}")],
                    gpus: vec![],
                    ledger_dir: Some(dir.join("state")),
                    dir: dir.clone(),
                    created_unix: 0,
                })
                .unwrap();
            dirs.push(dir);
        }
        crate::tenant_tree::tests::deep_tree(&dirs[0].join("state"), 100_000);
        let sweeper = Sweeper::new(registry.clone(), Duration::ZERO).with_bounds(Bounds {
            max_time: Duration::from_millis(200),
            ..Bounds::default()
        });
        let stats = sweeper.stats();
        let (first, rest) = std::thread::Builder::new()
            .stack_size(2 << 20)
            .spawn(move || {
                let t = std::time::Instant::now();
                let first = sweeper.sweep();
                assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
                let mut rest = Vec::new();
                for _ in 0..200 {
                    if sweeper.pending.lock().unwrap().is_empty() {
                        break;
                    }
                    rest.extend(sweeper.sweep());
                }
                (first, rest)
            })
            .unwrap()
            .join()
            .expect("the sweep's thread died");
        assert_eq!(
            first,
            vec![("00000000000000b2".to_string(), Reason::NoLiveProcesses)],
            "the other allocation goes at the first sweep"
        );
        assert!(registry.view().is_empty(), "both left the registry at once");
        assert!(!dirs[1].exists());
        assert_eq!(
            rest,
            vec![("00000000000000a1".to_string(), Reason::Retried)]
        );
        assert!(!dirs[0].exists(), "finished at a later sweep");
        assert!(stats.given_up_total() >= 1);
        assert_eq!(stats.pending(), 0);
    }

    #[test]
    fn a_podresources_outage_removes_nothing() {
        let (root, registry, a) = scratch("outage");
        // No process at all: the built-in rule would remove it; the configured source is down.
        let sweeper =
            Sweeper::new(registry.clone(), Duration::ZERO).with_liveness(Box::new(Fixed(None)));
        assert_eq!(sweeper.verdict(&a), None);
        assert!(sweeper.sweep().is_empty());
        assert!(a.dir.exists());
        let sweeper = Sweeper::new(registry.clone(), Duration::ZERO)
            .with_liveness(Box::new(Fixed(Some(false))));
        assert_eq!(sweeper.verdict(&a), Some(Reason::Liveness));
        let _ = std::fs::remove_dir_all(&root);
    }

    #[test]
    fn a_planted_ledger_neither_removes_nor_blocks() {
        let (root, registry, a) = scratch("planted");
        let ledger = a.ledger_dir.clone().unwrap().join("ledger");
        let sweeper = Sweeper::new(registry.clone(), Duration::ZERO);
        let t = std::time::Instant::now();
        assert!(std::process::Command::new("mkfifo")
            .arg(&ledger)
            .status()
            .unwrap()
            .success());
        assert_eq!(
            sweeper.verdict(&a),
            None,
            "a FIFO: cannot be asked, so kept"
        );
        std::fs::remove_file(&ledger).unwrap();
        std::os::unix::fs::symlink("/etc/hostname", &ledger).unwrap();
        assert_eq!(sweeper.verdict(&a), None, "a symlink is not followed");
        assert!(t.elapsed() < Duration::from_secs(1));
        let _ = std::fs::remove_dir_all(&root);
    }
}
