//! The GPU coordinators' boards as the plugin keeps them (`cuvisor_shm::coordinator`): each
//! memory allocation with a compute policy gets one entry on the board of each of its GPUs, with
//! its policy, and a state file of its own that Allocate mounts read-write into that container
//! alone. The coordinators' directory reaches every container read-only, so the board says
//! what the plugin wrote and nothing else: no container can list a tenant, change a policy or
//! take entries.
//!
//! The boards follow the registry: [`reconcile`] takes off every entry that no recorded
//! allocation holds (after a removal, a plugin restart), except those of an allocation whose
//! directory is still there with live processes (superseded, see `cleanup`). Allocate assigns
//! and records under [`lock`], and [`reconcile`] runs under it, so no entry is taken off between
//! its assignment and its record; an Allocate that fails takes its entries off at once.

use crate::layout::STATE;
use crate::registry::{Allocation, Registry};
use cuvisor_shm::compute::{self, ComputePolicy};
use cuvisor_shm::coordinator::{self, BoardWriter, POLICY_LIMIT, POLICY_SHARE};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

static LOCK: Mutex<()> = Mutex::new(());

/// Held while entries are assigned and recorded, or reconciled.
pub fn lock() -> MutexGuard<'static, ()> {
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// The board entry's (policy, parameter) for a container with memory quota `quota` on a GPU
/// of `physical` bytes under the configured `compute` (validated at startup; unset: a share
/// weighted by the memory fraction). None: `none`, no entry.
pub fn policy(compute: Option<&str>, quota: u64, physical: u64) -> Option<(u32, u64)> {
    let p = compute.map_or(Ok(ComputePolicy::ShareMemory), compute::parse);
    match p.unwrap_or(ComputePolicy::ShareMemory) {
        ComputePolicy::None => None,
        ComputePolicy::Limit(pct) => Some((
            POLICY_LIMIT,
            ((pct * 1e4).round() as u64).clamp(1, 1_000_000),
        )),
        ComputePolicy::Share(w) => Some((
            POLICY_SHARE,
            ((w * 1e3).round() as u64).clamp(1, coordinator::MAX_WEIGHT),
        )),
        ComputePolicy::ShareMemory => {
            let f = if physical == 0 {
                1.0
            } else {
                (quota as f64 / physical as f64).min(1.0)
            };
            Some((POLICY_SHARE, ((f * 1e3).round() as u64).max(1)))
        }
    }
}

/// The container number an allocation's entries carry: its id (16 hex digits, non-zero).
pub fn container_of(id: &str) -> Option<u64> {
    u64::from_str_radix(id, 16).ok().filter(|c| *c != 0)
}

/// Lists allocation `id` on GPU `uuid`'s board under `coord_dir` (the host's): (its entry, the
/// host path of its state file).
pub fn assign(
    coord_dir: &Path,
    uuid: &str,
    id: &str,
    (policy, param): (u32, u64),
) -> Result<(u32, PathBuf), String> {
    let bytes = cuvisor_shm::uuid::parse(uuid).ok_or_else(|| format!("GPU UUID {uuid:?}"))?;
    let container = container_of(id).ok_or_else(|| format!("allocation id {id:?}"))?;
    let (i, path) = BoardWriter::open(coord_dir, bytes)?.assign(container, policy, param)?;
    Ok((i as u32, path))
}

/// Takes allocation `id`'s entries off the boards of GPUs `uuids` (an Allocate that failed).
pub fn release_all(coord_dir: &Path, uuids: &[String], id: &str) {
    let Some(container) = container_of(id) else {
        return;
    };
    for u in uuids {
        let Some(bytes) = cuvisor_shm::uuid::parse(u) else {
            continue;
        };
        if let Ok(w) = BoardWriter::open(coord_dir, bytes) {
            for (i, e) in w.entries().unwrap_or_default() {
                if e.container == container {
                    let _ = w.release(i, container);
                }
            }
        }
    }
}

/// Whether allocation `a` holds entry `i` of GPU `uuid` for `container`.
fn holds(a: &Allocation, uuid: [u8; 16], i: usize, container: u64) -> bool {
    container_of(&a.id) == Some(container)
        && a.gpus.iter().any(|s| {
            s.coord_slot == Some(i as u32) && cuvisor_shm::uuid::parse(&s.uuid) == Some(uuid)
        })
}

/// Takes off every board entry under `coord_dir` that no allocation of `registry` holds and
/// whose allocation directory is not still there with live processes; call with [`lock`] held.
/// Returns what it took off, as "GPU entry: container".
pub fn reconcile(coord_dir: &Path, registry: &Registry) -> Vec<String> {
    let mut released = Vec::new();
    let Ok(rd) = std::fs::read_dir(coord_dir) else {
        return released;
    };
    let allocations = registry.view().list();
    let lingering = |container: u64| {
        let dir = registry.root().join(format!("{container:016x}"));
        dir.is_dir() && crate::ledger_dir::has_live_process(&dir.join(STATE))
    };
    for d in rd.flatten() {
        let name = d.file_name().to_string_lossy().into_owned();
        let Some(uuid) = name.strip_prefix("gpu-").and_then(parse_hex) else {
            continue;
        };
        if coordinator::dir_name(uuid) != name || !d.path().join(coordinator::BOARD).exists() {
            continue;
        }
        let Ok(w) = BoardWriter::open(coord_dir, uuid) else {
            continue;
        };
        for (i, e) in w.entries().unwrap_or_default() {
            if !allocations.iter().any(|a| holds(a, uuid, i, e.container))
                && !lingering(e.container)
                && w.release(i, e.container).is_ok()
            {
                released.push(format!("{name} entry {i}: {:016x}", e.container));
            }
        }
    }
    released
}

fn parse_hex(h: &str) -> Option<[u8; 16]> {
    if h.len() != 32 {
        return None;
    }
    let mut out = [0u8; 16];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(h.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn boards_follow_the_registry_and_spare_a_lingering_allocation() {
        use crate::registry::{GpuShare, Kind};
        let root = std::env::temp_dir().join(format!("cuvisor-coord-rec-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let registry = Registry::open(&root).unwrap();
        let coord = root.join("coord");
        let uuid = "GPU-00000000-0000-0000-0000-000000000001";
        let share = (POLICY_SHARE, 1_000);
        let (held, _) = assign(&coord, uuid, "00000000000000a1", share).unwrap();
        let (_, _) = assign(&coord, uuid, "00000000000000b2", share).unwrap();
        let (_, _) = assign(&coord, uuid, "00000000000000c3", share).unwrap();
        std::fs::create_dir_all(registry.root().join("00000000000000a1")).unwrap();
        registry
            .insert(Allocation {
                id: "00000000000000a1".into(),
                kind: Kind::Memory,
                resource: "r".into(),
                device_ids: vec!["u-0".into()],
                gpus: vec![GpuShare {
                    uuid: uuid.into(),
                    units: 1,
                    quota: Some(1),
                    coord_slot: Some(held),
                }],
                dir: registry.root().join("00000000000000a1"),
                ledger_dir: None,
                created_unix: 0,
            })
            .unwrap();
        // c3's directory is still there with a live process (superseded, not yet swept).
        let state = registry.root().join("00000000000000c3").join(STATE);
        let ledger = cuvisor_shm::ledger::Ledger::open_dir(&state).unwrap();
        let _p = ledger.claim_proc(1, 1).unwrap();
        let released = reconcile(&coord, &registry);
        assert_eq!(released.len(), 1, "{released:?}");
        assert!(released[0].ends_with("00000000000000b2"), "{released:?}");
        let bytes = cuvisor_shm::uuid::parse(uuid).unwrap();
        let left: Vec<u64> = BoardWriter::open(&coord, bytes)
            .unwrap()
            .entries()
            .unwrap()
            .iter()
            .map(|(_, e)| e.container)
            .collect();
        assert_eq!(left, [0xa1, 0xc3]);
        // A failed Allocate takes its entries off at once.
        release_all(&coord, &[uuid.to_string()], "00000000000000c3");
        assert_eq!(
            BoardWriter::open(&coord, bytes)
                .unwrap()
                .entries()
                .unwrap()
                .len(),
            1
        );
        let _ = std::fs::remove_dir_all(&root);
    }

    #[test]
    fn policies_become_entries() {
        assert_eq!(
            policy(Some("limit=30"), 1, 4),
            Some((POLICY_LIMIT, 300_000))
        );
        assert_eq!(policy(Some("share=2"), 1, 4), Some((POLICY_SHARE, 2_000)));
        assert_eq!(
            policy(Some("share=memory"), 1, 4),
            Some((POLICY_SHARE, 250))
        );
        assert_eq!(
            policy(None, 1, 4),
            Some((POLICY_SHARE, 250)),
            "unset: memory"
        );
        assert_eq!(policy(Some("none"), 1, 4), None);
        assert_eq!(
            policy(None, 8, 4),
            Some((POLICY_SHARE, 1_000)),
            "at most all of it"
        );
        assert_eq!(container_of("00000000000000a1"), Some(0xa1));
        assert_eq!(container_of("0000000000000000"), None);
        assert_eq!(container_of("../x"), None);
        assert_eq!(parse_hex(&"07".repeat(16)), Some([7; 16]));
        assert_eq!(parse_hex("07"), None);
    }
}
