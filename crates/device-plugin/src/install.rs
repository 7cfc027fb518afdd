//! `[host] install_from`: the plugin puts libcuvisor.so on the host itself, at start-up, from
//! its own image, so that the DaemonSet needs no init container (and the image no shell and no
//! `cp`). Allocate then bind-mounts `[host] library` into GPU containers.
//!
//! The copy is atomic: a temporary file in the destination's own directory (same file system,
//! so `rename` is atomic), written, `fsync`ed, mode 0755, then renamed over `[host] library`,
//! and the directory `fsync`ed. A reader (a container runtime resolving a bind mount of the
//! library at that instant) sees the old file or the new one, never a part of one; containers
//! already running keep the inode they were given, so an upgrade never changes a library under
//! a running tenant. A symlink at the destination is replaced, never written through.
//!
//! A library already there with the same bytes (and mode 0755) is left alone: a plugin restart
//! changes nothing on the host.
//!
//! The source must be a regular file (opened without blocking, then checked on the open
//! descriptor): a directory, a device or a FIFO is refused with one line, and nothing on the
//! host changes.

use std::fs::{File, OpenOptions, Permissions};
use std::io::{Read, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// The installed library's mode: read and execute for all, as a shared library is installed.
pub const MODE: u32 = 0o755;

/// What [`install`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Installed {
    /// `to` already held the same bytes with mode 0755: left alone.
    Unchanged,
    /// `to` was written (created or replaced) with this many bytes.
    Copied(u64),
}

/// Copies `from` (a regular file) atomically to `to` (see the module's text). `to`'s directory
/// is created when missing. The error is one line naming the path at fault.
pub fn install(from: &Path, to: &Path) -> Result<Installed, String> {
    let at = |p: &Path, e: std::io::Error| format!("{}: {e}", p.display());
    let mut src = OpenOptions::new()
        .read(true)
        // A FIFO would block the open; a tty would become the controlling terminal.
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(from)
        .map_err(|e| format!("[host] install_from {}: {e}", from.display()))?;
    let meta = src.metadata().map_err(|e| at(from, e))?;
    if !meta.is_file() {
        return Err(format!(
            "[host] install_from {}: not a regular file ({}); nothing installed",
            from.display(),
            kind(&meta.file_type())
        ));
    }
    let mut bytes = Vec::with_capacity(usize::try_from(meta.len()).unwrap_or(0));
    src.read_to_end(&mut bytes).map_err(|e| at(from, e))?;

    let name = to
        .file_name()
        .ok_or_else(|| format!("[host] library {}: no file name", to.display()))?;
    let dir = match to.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    if unchanged(to, &bytes) {
        return Ok(Installed::Unchanged);
    }
    std::fs::create_dir_all(dir).map_err(|e| at(dir, e))?;

    // Unique among concurrent installers (an old and a new plugin during a rolling update):
    // each writes its own file and renames it; the last rename wins, whole.
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let tmp: PathBuf = dir.join(format!(
        ".{}.install-{}-{nanos}",
        name.to_string_lossy(),
        std::process::id()
    ));
    let written = (|| {
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(MODE)
            .open(&tmp)
            .map_err(|e| at(&tmp, e))?;
        f.write_all(&bytes).map_err(|e| at(&tmp, e))?;
        // The umask may have narrowed the mode given at creation.
        f.set_permissions(Permissions::from_mode(MODE))
            .map_err(|e| at(&tmp, e))?;
        f.sync_all().map_err(|e| at(&tmp, e))?;
        std::fs::rename(&tmp, to)
            .map_err(|e| format!("rename {} to {}: {e}", tmp.display(), to.display()))
    })();
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    // The rename itself durable: the directory's entry.
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| at(dir, e))?;
    Ok(Installed::Copied(bytes.len() as u64))
}

/// `to` is a regular file (not a link to one) with mode 0755 and exactly `bytes`.
fn unchanged(to: &Path, bytes: &[u8]) -> bool {
    let Ok(m) = std::fs::symlink_metadata(to) else {
        return false;
    };
    if !m.is_file() || m.len() != bytes.len() as u64 || m.permissions().mode() & 0o7777 != MODE {
        return false;
    }
    std::fs::read(to).is_ok_and(|have| have == bytes)
}

fn kind(t: &std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    if t.is_dir() {
        "a directory"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_socket() {
        "a socket"
    } else {
        "not a file"
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    /// A test's directory, removed at the end.
    struct Dir(PathBuf);
    impl Dir {
        fn new(tag: &str) -> Dir {
            let p =
                std::env::temp_dir().join(format!("cuvisor-install-{tag}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&p);
            std::fs::create_dir_all(&p).unwrap();
            Dir(p)
        }
        fn file(&self, name: &str, bytes: &[u8]) -> PathBuf {
            let p = self.0.join(name);
            std::fs::write(&p, bytes).unwrap();
            p
        }
        fn entries(&self, sub: &str) -> Vec<String> {
            let mut v: Vec<_> = std::fs::read_dir(self.0.join(sub))
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect();
            v.sort();
            v
        }
    }
    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn a_new_library_is_copied_with_mode_0755_into_a_directory_made_for_it() {
        let d = Dir::new("new");
        let from = d.file("image-lib.so", b"ELF new library");
        std::fs::set_permissions(&from, Permissions::from_mode(0o600)).unwrap();
        let to = d.0.join("state/lib/libcuvisor.so");
        assert_eq!(install(&from, &to), Ok(Installed::Copied(15)));
        assert_eq!(std::fs::read(&to).unwrap(), b"ELF new library");
        let m = std::fs::symlink_metadata(&to).unwrap();
        assert!(m.is_file());
        assert_eq!(m.permissions().mode() & 0o7777, 0o755);
        // No temporary file left behind.
        assert_eq!(d.entries("state/lib"), ["libcuvisor.so"]);
    }

    #[test]
    fn the_same_library_again_is_left_alone() {
        let d = Dir::new("same");
        let from = d.file("image-lib.so", b"ELF v1");
        let to = d.0.join("libcuvisor.so");
        assert_eq!(install(&from, &to), Ok(Installed::Copied(6)));
        let before = std::fs::metadata(&to).unwrap();
        assert_eq!(install(&from, &to), Ok(Installed::Unchanged));
        let after = std::fs::metadata(&to).unwrap();
        assert_eq!(
            (before.ino(), before.mtime_nsec()),
            (after.ino(), after.mtime_nsec())
        );
    }

    #[test]
    fn the_same_bytes_with_another_mode_are_installed_again_with_0755() {
        let d = Dir::new("mode");
        let from = d.file("image-lib.so", b"ELF v1");
        let to = d.file("libcuvisor.so", b"ELF v1");
        std::fs::set_permissions(&to, Permissions::from_mode(0o700)).unwrap();
        assert_eq!(install(&from, &to), Ok(Installed::Copied(6)));
        let m = std::fs::metadata(&to).unwrap();
        assert_eq!(m.permissions().mode() & 0o7777, 0o755);
    }

    /// An upgrade renames a new inode into place: a running container, which holds the old
    /// library (here: a hard link to its inode), keeps it whole.
    #[test]
    fn an_upgrade_replaces_the_library_by_rename_not_by_writing_into_the_old_one() {
        let d = Dir::new("upgrade");
        let to = d.file("libcuvisor.so", b"ELF old library, longer than the new");
        std::fs::hard_link(&to, d.0.join("held-by-a-running-container")).unwrap();
        let from = d.file("image-lib.so", b"ELF new");
        assert_eq!(install(&from, &to), Ok(Installed::Copied(7)));
        assert_eq!(std::fs::read(&to).unwrap(), b"ELF new");
        assert_eq!(
            std::fs::read(d.0.join("held-by-a-running-container")).unwrap(),
            b"ELF old library, longer than the new"
        );
    }

    #[test]
    fn a_symlink_at_the_destination_is_replaced_not_written_through() {
        let d = Dir::new("link");
        let elsewhere = d.file("elsewhere", b"not yours");
        let to = d.0.join("libcuvisor.so");
        std::os::unix::fs::symlink(&elsewhere, &to).unwrap();
        let from = d.file("image-lib.so", b"ELF lib");
        assert_eq!(install(&from, &to), Ok(Installed::Copied(7)));
        assert_eq!(std::fs::read(&elsewhere).unwrap(), b"not yours");
        assert!(std::fs::symlink_metadata(&to).unwrap().is_file());
        assert_eq!(std::fs::read(&to).unwrap(), b"ELF lib");
    }

    #[test]
    fn a_source_that_is_not_a_regular_file_is_refused_with_one_line_and_nothing_changes() {
        let d = Dir::new("notfile");
        let to = d.file("libcuvisor.so", b"ELF installed");
        std::fs::create_dir(d.0.join("a-dir")).unwrap();
        let fifo = d.0.join("a-fifo");
        rustix::fs::mknodat(
            rustix::fs::CWD,
            &fifo,
            rustix::fs::FileType::Fifo,
            rustix::fs::Mode::from_raw_mode(0o644),
            0,
        )
        .unwrap();
        for (src, what) in [
            (d.0.join("a-dir"), "a directory"),
            (fifo, "a FIFO"),
            (PathBuf::from("/dev/null"), "a character device"),
        ] {
            let e = install(&src, &to).unwrap_err();
            assert!(e.contains("not a regular file") && e.contains(what), "{e}");
            assert!(e.contains(&src.display().to_string()), "{e}");
            assert!(!e.contains('\n'), "one line: {e}");
        }
        let e = install(&d.0.join("missing.so"), &to).unwrap_err();
        assert!(e.contains("missing.so") && !e.contains('\n'), "{e}");
        assert_eq!(std::fs::read(&to).unwrap(), b"ELF installed");
        let mut names = d.entries("");
        names.retain(|n| n.starts_with('.'));
        assert!(names.is_empty(), "temporary files left: {names:?}");
    }

    #[test]
    fn a_destination_that_cannot_be_replaced_leaves_no_temporary_file() {
        let d = Dir::new("dirdest");
        let from = d.file("image-lib.so", b"ELF lib");
        // A non-empty directory where the library should be: rename fails.
        let to = d.0.join("libcuvisor.so");
        std::fs::create_dir_all(to.join("x")).unwrap();
        let e = install(&from, &to).unwrap_err();
        assert!(e.contains("libcuvisor.so") && !e.contains('\n'), "{e}");
        assert_eq!(d.entries(""), ["image-lib.so", "libcuvisor.so"]);
    }
}
