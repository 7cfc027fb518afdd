//! Each memory allocation's ledger directory (`<state_root>/allocations/<id>/state`, mounted
//! read-write into the container): a size-limited tmpfs of its own, and how the plugin sets it
//! up and takes it down.
//!
//! # Why a tmpfs per allocation
//!
//! The directory is the container's to write, and it lived on the host file system under the
//! state root, with no bound: one tenant filling it filled `/var/lib/cuvisor` (and whatever
//! else shares that file system), and every later Allocate, which writes files there, failed.
//! Two ways to bound it were weighed:
//!
//! - **A small per-allocation file instead of a directory** (the ledger itself, bind-mounted as
//!   a file). What the container needs there is one file, `ledger` (`cuvisor_shm::ledger`,
//!   [`ledger_bytes`] long, created by the container's first CUDA process with `O_CREAT` and
//!   mapped read-write). But a file the tenant can write is a file the tenant can grow:
//!   `ftruncate` or a `pwrite` past its end takes host disk just the same; Linux has no
//!   per-file size limit the plugin could set (`RLIMIT_FSIZE` is the writer's own, and
//!   file-system quotas are per user, shared by every tenant of that uid). It would also move
//!   where the library finds its ledger, which every tenant already running relies on.
//! - **A size-limited mount per allocation**: a tmpfs with `size=` and `nr_inodes=`, mounted by
//!   the plugin at the allocation's `state` directory before Allocate answers; kubelet's bind
//!   mount of that directory then reaches the tmpfs. The kernel enforces both bounds: a tenant
//!   that fills it gets `ENOSPC` in its own directory, and nothing else notices. The inode
//!   bound also caps any tree it builds there (64 inodes: at most 63 levels), so the removal
//!   walk ([`crate::tenant_tree`]) is never handed a huge tree in this mode. Its pages are
//!   charged to the memory cgroup of the process that writes them: the tenant's.
//!
//! The mount is chosen (default `[ledger_dir] mount = "tmpfs"`, 1 MiB, 64 inodes: the ledger
//! is about 150 KiB). It needs `CAP_SYS_ADMIN` and, with the plugin in a container of its own,
//! `mountPropagation: Bidirectional` on the state root, both of which `deploy/daemonset.yaml`
//! gives it (the plugin already runs privileged for NVML and kubelet's socket directory).
//!
//! # When the plugin cannot mount
//!
//! It refuses to run (checked once at start-up, [`probe`]) and an Allocate whose mount fails
//! fails with the reason: falling back to a plain directory would quietly give back the hole
//! this closes (one tenant failing every other's Allocate), on exactly the nodes where no one
//! looks. An operator who cannot grant the capability sets `mount = "none"` and gets the old
//! plain directory, knowingly: the threat model lists what that leaves open.
//!
//! # Taking it down
//!
//! [`retire`] removes an allocation's directory: its record first (so that a restart does not
//! bring back an allocation being removed), then the tmpfs is detached (`MNT_DETACH` and
//! `UMOUNT_NOFOLLOW`: it never waits, and `state` is the plugin's own name, never a link), then
//! what is left (the plugin's files, and in `mount = "none"` the tenant's tree) goes through
//! [`crate::tenant_tree::remove`] under its bounds.

use crate::layout::{RECORD, STATE};
use crate::tenant_tree::{self, Bounds, GaveUp, Removed};
use rustix::io::Errno;
use rustix::mount::{MountFlags, UnmountFlags};
use std::ffi::CString;
use std::path::Path;

pub use crate::config::{ledger_bytes, LedgerDir};

/// The tmpfs's mount data.
fn data(cfg: &LedgerDir) -> Result<CString, String> {
    let size = cfg.validate()?;
    CString::new(format!("size={size},nr_inodes={},mode=1777", cfg.inodes))
        .map_err(|e| e.to_string())
}

/// Whether some process of the container whose ledger directory is `ledger_dir` is alive (holds
/// a lease in its ledger). No ledger: false. A ledger that cannot be asked (replaced by a FIFO,
/// a directory, a symlink): true, so that nothing the container plants removes anything.
pub fn has_live_process(ledger_dir: &Path) -> bool {
    cuvisor_shm::ledger::any_alive(ledger_dir).unwrap_or(true)
}

/// Mounts the allocation's tmpfs at `state` (an empty directory the plugin just made), when the
/// configuration asks for one. The reason, if it cannot.
pub fn prepare(state: &Path, cfg: &LedgerDir) -> Result<(), String> {
    if !cfg.mounts() {
        return Ok(());
    }
    let data = data(cfg)?;
    rustix::mount::mount(
        "cuvisor-ledger",
        state,
        "tmpfs",
        MountFlags::NOSUID | MountFlags::NODEV | MountFlags::NOEXEC,
        data.as_c_str(),
    )
    .map_err(|e| {
        format!(
            "{}: cannot mount the ledger directory's tmpfs ({}): {e}{}",
            state.display(),
            data.to_string_lossy(),
            if e == Errno::PERM {
                " (the plugin needs CAP_SYS_ADMIN: run it privileged, with mountPropagation: \
                 Bidirectional on the state root; or set [ledger_dir] mount = \"none\" for a \
                 plain directory with no bound on what tenants write to the host)"
            } else {
                ""
            }
        )
    })
}

/// At start-up: whether the plugin can mount the configured tmpfs, tried once at
/// `<state_root>/.ledger-dir-probe` (mounted, unmounted, removed).
pub fn probe(state_root: &Path, cfg: &LedgerDir) -> Result<(), String> {
    if !cfg.mounts() {
        return Ok(());
    }
    let at = state_root.join(".ledger-dir-probe");
    let _ = detach(&at);
    let _ = std::fs::remove_dir(&at);
    std::fs::create_dir(&at).map_err(|e| format!("{}: {e}", at.display()))?;
    let r = prepare(&at, cfg);
    let _ = detach(&at);
    let _ = std::fs::remove_dir(&at);
    r.map_err(|e| format!("[ledger_dir] mount = \"tmpfs\": {e}"))
}

/// Detaches whatever is mounted at `at` (never following a link there); nothing mounted: Ok.
fn detach(at: &Path) -> Result<(), String> {
    match rustix::mount::unmount(at, UnmountFlags::DETACH | UnmountFlags::NOFOLLOW) {
        Ok(()) | Err(Errno::INVAL | Errno::NOENT) => Ok(()),
        Err(e) => Err(format!("{}: unmount: {e}", at.display())),
    }
}

/// Removes allocation directory `dir`: its record, then its ledger directory's tmpfs, then
/// everything left, within `bounds` (see the module doc). What could not be removed stays for
/// a later call.
pub fn retire(dir: &Path, bounds: &Bounds) -> Result<Removed, GaveUp> {
    match std::fs::remove_file(dir.join(RECORD)) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        // (Not a file, say: the walk below deals with it.)
        Err(_) => {}
    }
    if let Err(e) = detach(&dir.join(STATE)) {
        return Err(GaveUp {
            path: dir.to_path_buf(),
            reason: e,
            done: Removed::default(),
        });
    }
    tenant_tree::remove(dir, bounds)
}

/// Detaches every mount under `root` (for tests and tear-downs: a plugin killed before it
/// removed its allocations leaves their tmpfs mounted), deepest first.
pub fn detach_all_under(root: &Path) {
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return;
    };
    let mut points: Vec<std::path::PathBuf> = info
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(unescape)
        .filter(|p| p.starts_with(root))
        .collect();
    points.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    for p in points {
        let _ = rustix::mount::unmount(&p, UnmountFlags::DETACH);
    }
}

/// A mount point as mountinfo writes it (space, tab, newline, backslash as `\ooo`).
fn unescape(s: &str) -> std::path::PathBuf {
    use std::os::unix::ffi::OsStringExt;
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            out.push((b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0'));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    std::ffi::OsString::from_vec(out).into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_section_is_valid_and_fits_the_ledger_twice() {
        let d = LedgerDir::default();
        assert_eq!(d.validate().unwrap(), 1 << 20);
        assert!(ledger_bytes() * 2 <= 1 << 20, "{}", ledger_bytes());
        for (bad, key) in [
            (
                LedgerDir {
                    mount: "overlay".into(),
                    ..LedgerDir::default()
                },
                "ledger_dir.mount",
            ),
            (
                LedgerDir {
                    size: "64Ki".into(),
                    ..LedgerDir::default()
                },
                "ledger_dir.size",
            ),
            (
                LedgerDir {
                    size: "1Gi".into(),
                    ..LedgerDir::default()
                },
                "ledger_dir.size",
            ),
            (
                LedgerDir {
                    inodes: 1,
                    ..LedgerDir::default()
                },
                "ledger_dir.inodes",
            ),
        ] {
            let e = bad.validate().unwrap_err();
            assert!(e.starts_with(key), "{e}");
        }
    }

    #[test]
    fn mountinfo_escapes_are_read() {
        assert_eq!(
            unescape("/tmp/a\\040b\\134c"),
            std::path::PathBuf::from("/tmp/a b\\c")
        );
        assert_eq!(unescape("/x\\04"), std::path::PathBuf::from("/x\\04"));
    }
}
