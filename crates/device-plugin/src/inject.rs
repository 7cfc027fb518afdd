//! What Allocate puts into a container, and the host files behind it.
//!
//! For memory units, under `<state_root>/allocations/<id>/` on the host:
//! - `limits.conf`: the library's limits file (format: the root crate's src/config.rs), mounted
//!   read-only at the fixed path the library prefers over its environment
//!   (`cuvisor_shm::CONTAINER_LIMITS`); `memory.<GPU UUID> = units x unit size` per GPU,
//!   `state_dir` and `coord_dir` as the container sees them;
//! - `state/`: the container's ledger directory, mounted read-write at `container.state_dir`:
//!   a tmpfs of its own, bounded in size and inodes (`[ledger_dir]`, see `ledger_dir`);
//!
//! and per GPU, with a compute policy other than `none`: an entry on the GPU's coordinator board
//! (`coord`), its state file mounted read-write at `<container.coord_own_dir>/gpu-<UUID hex>`
//! (`coord_slot.<UUID>` in the limits file names the entry);
//!
//! plus, shared by all containers: the library (read-only), `<state_root>/ld.so.preload` at
//! `/etc/ld.so.preload` (read-only; names the in-container library, so a program that drops
//! LD_PRELOAD still loads it), and the GPU coordinators' directory (read-only: only the plugin
//! writes the boards, and each container writes its own state through its own mount). Envs:
//! `NVIDIA_VISIBLE_DEVICES` (UUIDs); no `CUVISOR_CONFIG`: the library finds the file at its fixed
//! path, and nothing the container sets or unsets makes it read another. Devices: `/dev/nvidiaN` of each GPU
//! (N its minor number, not its NVML index: see `devices`) and the control nodes that exist on
//! the host.
//!
//! Whole GPUs get the devices and `NVIDIA_VISIBLE_DEVICES` only: no quota, no library.
//!
//! The answer is the domain's [`Answer`]; `server` translates it for kubelet. The file names
//! are `layout`'s.

use crate::answer::{Answer, DeviceNode, Mount};
use crate::config::Config;
use crate::inventory::Inventory;
use crate::layout::{LIMITS, PRELOAD, STATE};
use crate::registry::{Allocation, GpuShare, Kind};
use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

/// The annotation that names the allocation behind a container.
pub const ALLOCATION_ANNOTATION: &str = "cuvisor.io/allocation";

/// An allocation made: its record and the container's answer.
pub struct Prepared {
    pub allocation: Allocation,
    pub answer: Answer,
}

fn io(p: &Path, e: std::io::Error) -> String {
    format!("{}: {e}", p.display())
}

/// A directory everyone may write (containers run as any user), created if missing.
fn shared_dir(p: &Path) -> Result<(), String> {
    std::fs::create_dir_all(p).map_err(|e| io(p, e))?;
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o1777)).map_err(|e| io(p, e))
}

/// Writes `<state_root>/ld.so.preload` and creates the coordinators' directory; at startup.
pub fn install_shared(cfg: &Config) -> Result<(), String> {
    std::fs::create_dir_all(&cfg.state_root).map_err(|e| io(&cfg.state_root, e))?;
    let p = cfg.state_root.join(PRELOAD);
    let want = format!("{}\n", cfg.container.library.display());
    if std::fs::read_to_string(&p).ok().as_deref() != Some(want.as_str()) {
        let tmp = p.with_extension("tmp");
        std::fs::write(&tmp, &want).map_err(|e| io(&tmp, e))?;
        std::fs::rename(&tmp, &p).map_err(|e| io(&p, e))?;
    }
    // Only the plugin writes here (containers see it read-only).
    let coord = cfg.host_coord_dir();
    std::fs::create_dir_all(&coord).map_err(|e| io(&coord, e))?;
    std::fs::set_permissions(&coord, std::fs::Permissions::from_mode(0o755))
        .map_err(|e| io(&coord, e))
}

fn now_unix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// The device specs for GPUs `gpus` (inventory positions): `/dev/nvidia<minor>` of each, at the
/// same path in the container, then the control nodes present on the host.
///
/// The node is named by the GPU's minor number (`nvmlDeviceGetMinorNumber`), not its NVML index:
/// the two can differ, and the index would then hand the container another GPU's node. NVIDIA's
/// own stack does the same: NVIDIA/k8s-device-plugin `internal/rm/nvml_devices.go`
/// (`nvmlDevice.GetPaths`: `fmt.Sprintf("/dev/nvidia%d", minor)` from `GetMinorNumber`) and
/// NVIDIA/nvidia-container-toolkit `internal/platform-support/dgpu` (`getDevNodePath`, likewise).
fn devices(cfg: &Config, inv: &Inventory, gpus: &[usize]) -> Vec<DeviceNode> {
    let spec = |name: &str| DeviceNode {
        container_path: Path::new("/dev").join(name),
        host_path: cfg.host.dev_dir.join(name),
        permissions: "rw".into(),
    };
    let mut out: Vec<DeviceNode> = gpus
        .iter()
        .map(|g| spec(&format!("nvidia{}", inv.gpus()[*g].minor)))
        .collect();
    for c in &cfg.host.control_devices {
        if cfg.host.dev_dir.join(c).exists() {
            out.push(spec(c));
        }
    }
    out
}

fn mount(container: &Path, host: &Path, read_only: bool) -> Mount {
    Mount::new(container, host, read_only)
}

/// The limits file for memory quotas `(uuid, bytes)` and coordinator entries `(uuid, index)`
/// (crates/shm's `LimitsFile`, which the library parses).
pub fn limits_file(cfg: &Config, quotas: &[(String, u64)], slots: &[(String, u32)]) -> String {
    use cuvisor_shm::limits::{LimitsFile, Target};
    LimitsFile {
        state_dir: cfg.container.state_dir.clone(),
        coord_dir: Some(cfg.container.coord_dir.clone()),
        memory: quotas
            .iter()
            .filter_map(|(uuid, bytes)| {
                Some((Target::Uuid(cuvisor_shm::uuid::parse(uuid)?), *bytes))
            })
            .collect(),
        context_reserve: cfg
            .resources
            .context_reserve
            .as_deref()
            .and_then(|c| cuvisor_shm::quantity::parse_quantity(c).ok()),
        compute: cfg.resources.compute.clone(),
        coord_own_dir: (!slots.is_empty()).then(|| cfg.container.coord_own_dir.clone()),
        coord_slots: slots
            .iter()
            .filter_map(|(uuid, i)| Some((cuvisor_shm::uuid::parse(uuid)?, *i)))
            .collect(),
    }
    .render()
}

fn new_dir(root: &Path) -> Result<(String, PathBuf), String> {
    for _ in 0..8 {
        let id = format!("{:016x}", cuvisor_shm::ledger::random_id());
        let dir = root.join(&id);
        match std::fs::create_dir(&dir) {
            Ok(()) => return Ok((id, dir)),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(io(&dir, e)),
        }
    }
    Err(format!("{}: no free allocation id", root.display()))
}

/// Allocate for memory units: `units` = units per GPU (inventory positions).
pub fn memory(
    cfg: &Config,
    inv: &Inventory,
    root: &Path,
    resource: &str,
    ids: &[String],
    units: &BTreeMap<usize, u32>,
) -> Result<Prepared, String> {
    let (id, dir) = new_dir(root)?;
    let result = (|| {
        let state = dir.join(STATE);
        shared_dir(&state)?;
        // A tmpfs of its own, so that what the tenant writes there is bounded (ledger_dir).
        crate::ledger_dir::prepare(&state, &cfg.ledger_dir)?;
        let c = &cfg.container;
        let mut own_mounts = Vec::new();
        let mut shares = Vec::new();
        for (g, n) in units {
            let gpu = &inv.gpus()[*g];
            let quota = u64::from(*n) * inv.unit_bytes();
            let compute = cfg.resources.compute.as_deref();
            let coord_slot = match crate::coord::policy(compute, quota, gpu.memory) {
                Some(p) => {
                    let (i, state) =
                        crate::coord::assign(&cfg.host_coord_dir(), &gpu.uuid, &id, p)?;
                    let uuid = cuvisor_shm::uuid::parse(&gpu.uuid).unwrap_or_default();
                    let at = c
                        .coord_own_dir
                        .join(cuvisor_shm::coordinator::dir_name(uuid));
                    own_mounts.push(mount(&at, &state, false));
                    Some(i)
                }
                None => None,
            };
            shares.push(GpuShare {
                uuid: gpu.uuid.clone(),
                units: *n,
                quota: Some(quota),
                coord_slot,
            });
        }
        let quotas: Vec<(String, u64)> = shares
            .iter()
            .map(|s| (s.uuid.clone(), s.quota.unwrap_or(0)))
            .collect();
        let slots: Vec<(String, u32)> = shares
            .iter()
            .filter_map(|s| Some((s.uuid.clone(), s.coord_slot?)))
            .collect();
        let limits = dir.join(LIMITS);
        std::fs::write(&limits, limits_file(cfg, &quotas, &slots)).map_err(|e| io(&limits, e))?;
        std::fs::set_permissions(&limits, std::fs::Permissions::from_mode(0o444))
            .map_err(|e| io(&limits, e))?;
        let gpus: Vec<usize> = units.keys().copied().collect();
        let answer = Answer {
            envs: [("NVIDIA_VISIBLE_DEVICES".to_string(), visible(inv, &gpus))]
                .into_iter()
                .collect(),
            mounts: vec![
                mount(&c.library, &cfg.host.library, true),
                mount(
                    Path::new("/etc/ld.so.preload"),
                    &cfg.state_root.join(PRELOAD),
                    true,
                ),
                mount(Path::new(cuvisor_shm::CONTAINER_LIMITS), &limits, true),
                mount(&c.state_dir, &state, false),
                mount(&c.coord_dir, &cfg.host_coord_dir(), true),
            ]
            .into_iter()
            .chain(own_mounts)
            .collect(),
            devices: devices(cfg, inv, &gpus),
            annotations: [(ALLOCATION_ANNOTATION.to_string(), id.clone())]
                .into_iter()
                .collect(),
            cdi_devices: Vec::new(),
        };
        Ok(Prepared {
            allocation: Allocation {
                id: id.clone(),
                kind: Kind::Memory,
                resource: resource.to_string(),
                device_ids: ids.to_vec(),
                gpus: shares,
                dir: dir.clone(),
                ledger_dir: Some(state),
                created_unix: now_unix(),
            },
            answer,
        })
    })();
    if result.is_err() {
        let uuids: Vec<String> = units.keys().map(|g| inv.gpus()[*g].uuid.clone()).collect();
        crate::coord::release_all(&cfg.host_coord_dir(), &uuids, &id);
        let _ = crate::ledger_dir::retire(&dir, &crate::tenant_tree::Bounds::default());
    }
    result
}

fn visible(inv: &Inventory, gpus: &[usize]) -> String {
    gpus.iter()
        .map(|g| inv.gpus()[*g].uuid.as_str())
        .collect::<Vec<_>>()
        .join(",")
}

/// Allocate for whole GPUs (inventory positions).
pub fn whole(
    cfg: &Config,
    inv: &Inventory,
    root: &Path,
    resource: &str,
    ids: &[String],
    gpus: &[usize],
) -> Result<Prepared, String> {
    let (id, dir) = new_dir(root)?;
    let answer = Answer {
        envs: [("NVIDIA_VISIBLE_DEVICES".to_string(), visible(inv, gpus))]
            .into_iter()
            .collect(),
        mounts: Vec::new(),
        devices: devices(cfg, inv, gpus),
        annotations: [(ALLOCATION_ANNOTATION.to_string(), id.clone())]
            .into_iter()
            .collect(),
        cdi_devices: Vec::new(),
    };
    Ok(Prepared {
        allocation: Allocation {
            id,
            kind: Kind::Gpu,
            resource: resource.to_string(),
            device_ids: ids.to_vec(),
            gpus: gpus
                .iter()
                .map(|g| GpuShare {
                    uuid: inv.gpus()[*g].uuid.clone(),
                    units: 0,
                    quota: None,
                    coord_slot: None,
                })
                .collect(),
            dir,
            ledger_dir: None,
            created_unix: now_unix(),
        },
        answer,
    })
}
