//! `cuvisor run`'s temporary directory (`$TMPDIR/cuvisor-run-XXXXXX`, made by mkdtemp), for the
//! ledger and the simulator's state when none was given, and how the ones a killed cuvisor left
//! behind are found and removed.
//!
//! A run removes its directory when its command has ended. A SIGKILLed cuvisor cannot, so for
//! its whole life it holds an flock (LOCK_EX) on [`LOCK`] inside the directory; the kernel drops
//! it when cuvisor dies, however it dies. Every `cuvisor run` first sweeps `$TMPDIR`: a directory
//! is removed only when
//!
//! - its name is `cuvisor-run-` and six letters or digits (mkdtemp's),
//! - it is a directory itself, not a symbolic link, owned by this user,
//! - it holds [`LOCK`], a regular file (not a link), and LOCK_EX | LOCK_NB on it succeeds: its
//!   owner is dead,
//! - and after the lock was taken, the name still leads to the same directory and the same lock
//!   file (so one kept or removed in the meantime is left alone).
//!
//! Removal does not follow symbolic links (`std::fs::remove_dir_all`). A directory without the
//! lock is never removed: one that a run is just making (the lock appears, already held, by
//! rename), one of `--keep-state` (made without a lock, kept as asked), one of an older cuvisor.
//! The lock file is opened close-on-exec: the command does not inherit it.

use crate::{Failure, Result};
use std::ffi::{CString, OsString};
use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd as _;
use std::os::unix::ffi::{OsStrExt as _, OsStringExt as _};
use std::os::unix::fs::{MetadataExt as _, OpenOptionsExt as _};
use std::path::{Path, PathBuf};

/// The name's prefix; mkdtemp fills in six characters after it.
pub const PREFIX: &str = "cuvisor-run-";
/// The lock a live run holds in its directory.
pub const LOCK: &str = ".cuvisor-run.lock";

/// A private directory under $TMPDIR, removed when dropped unless kept.
pub struct Scratch {
    pub path: PathBuf,
    keep: bool,
    /// Held locked while this process lives; None with `keep`.
    _lock: Option<File>,
}

impl Scratch {
    /// Sweeps stale directories (see the module's doc), then makes a fresh one; with `keep` it
    /// holds no lock, so that no later run removes it.
    pub fn create(keep: bool) -> Result<Scratch> {
        let tmp = std::env::temp_dir();
        sweep(&tmp);
        let template = tmp.join(format!("{PREFIX}XXXXXX"));
        let fail = |e: String| {
            Failure::Runtime(format!(
                "cannot create a temporary directory {}: {e}",
                template.display()
            ))
        };
        let c = CString::new(template.as_os_str().as_bytes())
            .map_err(|_| fail("the path holds a NUL byte".into()))?;
        let mut bytes = c.into_bytes_with_nul();
        // SAFETY: a NUL-terminated, writable template ending in XXXXXX; mkdtemp fills it in.
        let made = unsafe { libc::mkdtemp(bytes.as_mut_ptr().cast()) };
        if made.is_null() {
            return Err(fail(std::io::Error::last_os_error().to_string()));
        }
        bytes.pop();
        let mut scratch = Scratch {
            path: PathBuf::from(OsString::from_vec(bytes)),
            keep,
            _lock: None,
        };
        if !keep {
            // Dropping `scratch` on failure removes the directory.
            scratch._lock = Some(hold_lock(&scratch.path).map_err(|e| {
                Failure::Runtime(format!(
                    "cannot lock the temporary directory {}: {e}",
                    scratch.path.display()
                ))
            })?);
        }
        Ok(scratch)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if !self.keep {
            // The lock goes with the directory, and is released after it (fields drop after
            // this body).
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

fn flock(file: &File, how: libc::c_int) -> std::io::Result<()> {
    loop {
        // SAFETY: flock on a descriptor `file` keeps open.
        if unsafe { libc::flock(file.as_raw_fd(), how) } == 0 {
            return Ok(());
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Creates the lock file in `dir` under a temporary name, locks it, and only then gives it its
/// name: a sweeper never finds it unlocked while its owner lives.
fn hold_lock(dir: &Path) -> std::io::Result<File> {
    let fresh = dir.join(format!("{LOCK}.new"));
    let file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&fresh)?;
    flock(&file, libc::LOCK_EX | libc::LOCK_NB)?;
    std::fs::rename(&fresh, dir.join(LOCK))?;
    Ok(file)
}

/// `cuvisor-run-` and six letters or digits, as mkdtemp writes them.
pub fn is_scratch_name(name: &[u8]) -> bool {
    name.strip_prefix(PREFIX.as_bytes())
        .is_some_and(|rest| rest.len() == 6 && rest.iter().all(u8::is_ascii_alphanumeric))
}

/// Removes the directories in `tmp` that runs which died left behind (see the module's doc);
/// returns how many. Nothing here fails a run: what cannot be looked at is left alone.
pub fn sweep(tmp: &Path) -> usize {
    let Ok(entries) = std::fs::read_dir(tmp) else {
        return 0;
    };
    // SAFETY: geteuid has no preconditions.
    let uid = unsafe { libc::geteuid() };
    let mut removed = 0;
    for entry in entries.flatten() {
        let name = entry.file_name();
        if !is_scratch_name(name.as_bytes()) {
            continue;
        }
        let dir = tmp.join(&name);
        // The dead owner's lock stays held by this run until the directory is gone.
        if let Some(_lock) = stale(&dir, uid) {
            if std::fs::remove_dir_all(&dir).is_ok() {
                removed += 1;
            }
        }
    }
    removed
}

/// The lock of `dir`, taken, when `dir` is a scratch directory of this user whose owner is
/// dead; None when it is not, or not surely.
fn stale(dir: &Path, uid: u32) -> Option<File> {
    let seen = std::fs::symlink_metadata(dir).ok()?;
    if !seen.is_dir() || seen.uid() != uid {
        return None;
    }
    let lock_path = dir.join(LOCK);
    let lock = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(&lock_path)
        .ok()?;
    let locked = lock.metadata().ok()?;
    if !locked.is_file() || locked.uid() != uid {
        return None;
    }
    // Fails while its owner lives.
    flock(&lock, libc::LOCK_EX | libc::LOCK_NB).ok()?;
    // Still the same directory by that name, still the same lock file in it.
    let same =
        |a: &std::fs::Metadata, b: &std::fs::Metadata| a.dev() == b.dev() && a.ino() == b.ino();
    let still = matches!(std::fs::symlink_metadata(dir), Ok(m) if m.is_dir() && same(&m, &seen))
        && matches!(std::fs::symlink_metadata(&lock_path), Ok(m) if same(&m, &locked));
    still.then_some(lock)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_mkdtemps_names_are_scratch_names() {
        assert!(is_scratch_name(b"cuvisor-run-a1B2c3"));
        for name in [
            &b"cuvisor-run-"[..],
            b"cuvisor-run-a1B2c",
            b"cuvisor-run-a1B2c3d",
            b"cuvisor-run-a1B2.3",
            b"cuvisor-run-../x/",
            b"xcuvisor-run-a1B2c3",
            b"cuvisor-cli-test-x",
        ] {
            assert!(!is_scratch_name(name), "{}", String::from_utf8_lossy(name));
        }
    }
}
