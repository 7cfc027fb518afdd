//! Removing a directory tree a tenant could write, without letting the tree decide how long the
//! plugin works on it, how deep its stack goes, where it looks or whether it survives.
//!
//! An allocation's ledger directory is the container's to fill. A tenant made it 100 000
//! directories deep; `std::fs::remove_dir_all` recurses once per level, overflowed the sweeper's
//! worker-thread stack and aborted the plugin, at every restart, since the tree stayed. So every
//! walk over a tenant-writable tree goes through [`remove`]:
//!
//! - **Iterative**, with an explicit stack of directory descriptors: nothing recurses. Entries
//!   are named relative to the descriptor of their directory (`openat`, `unlinkat`, `fstat`),
//!   never by a path, so no path grows with the depth and no component is looked up twice.
//! - **Never follows a symbolic link or opens a special file**: directories are opened with
//!   `O_DIRECTORY | O_NOFOLLOW | O_NONBLOCK` (a symlink fails with `ELOOP`, anything not a
//!   directory with `ENOTDIR`, before it is opened); everything else is `unlinkat`ed, which
//!   removes a symlink itself, a FIFO or a device node without opening it.
//! - **Never crosses a mount point**: a directory on another device than the tree's root is not
//!   entered (it cannot be removed while mounted: the tree is given up on until it is not).
//! - **Bounded in depth**: at most [`Bounds::max_depth`] descriptors are open. A directory found
//!   at that depth is not entered but moved (`renameat2(RENAME_NOREPLACE)`) to the root of the
//!   tree, so a deeper tree is flattened as it is removed instead of refused: 100 000 levels go in
//!   one pass with 32 descriptors.
//! - **Bounded in entries and time** ([`Bounds::max_entries`], [`Bounds::max_time`]): a tree not
//!   removed within them is given up on *for now* ([`GaveUp`]); what was removed stays removed
//!   and the caller tries again later (the sweeper, at its next pass), so a huge tree goes in
//!   several passes and never holds up the rest.
//!
//! The path given is the caller's, up to its last component (the allocation's own directory
//! under the plugin's state root): only what is below it is the tenant's.

use rustix::fd::{AsFd, OwnedFd};
use rustix::fs::{self, AtFlags, Dir, FileType, Mode, OFlags, RenameFlags, CWD};
use rustix::io::Errno;
use std::ffi::{CStr, CString};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// How much one [`remove`] may do before it gives up for now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bounds {
    /// Directory descriptors open at once (the root's included); at least 2. A directory
    /// deeper than this is moved up to the root rather than entered.
    pub max_depth: usize,
    /// Directory entries looked at.
    pub max_entries: u64,
    /// Wall-clock time.
    pub max_time: Duration,
}

impl Default for Bounds {
    /// 32 descriptors, a million entries, 2 seconds: a ledger directory (one file of 150 KiB)
    /// takes a few microseconds; a tree of 100 000 levels about a second on tmpfs or ext4.
    fn default() -> Bounds {
        Bounds {
            max_depth: 32,
            max_entries: 1_000_000,
            max_time: Duration::from_secs(2),
        }
    }
}

/// What a pass that removed the whole tree did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Removed {
    /// Entries removed (the root included).
    pub entries: u64,
    /// Directories moved up to the root because they were deeper than the depth bound.
    pub hoisted: u64,
}

/// A tree not removed within its bounds, or with something in it that cannot be removed (a
/// mount point): what is left stays for a later pass.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GaveUp {
    pub path: PathBuf,
    /// Why, in words ("1000000 entries looked at", "2s spent", "a mount point at ...").
    pub reason: String,
    /// What this pass did remove.
    pub done: Removed,
}

impl std::fmt::Display for GaveUp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}: not removed for now: {} ({} entries removed this pass)",
            self.path.display(),
            self.reason,
            self.done.entries
        )
    }
}

/// One directory being emptied: its stream, its name in its parent, and whether anything in it
/// was removed or moved since its last read-through began.
struct Frame {
    dir: Dir,
    name: CString,
    progress: bool,
}

struct Walk {
    bounds: Bounds,
    start: Instant,
    seen: u64,
    done: Removed,
    /// The first thing that could not be removed (the pass goes on past it).
    stuck: Option<String>,
    /// Names given to directories moved up to the root.
    next_hoist: u64,
}

const DIR_FLAGS: OFlags = OFlags::RDONLY
    .union(OFlags::DIRECTORY)
    .union(OFlags::NOFOLLOW)
    .union(OFlags::NONBLOCK)
    .union(OFlags::CLOEXEC);

/// Removes `path` and everything under it, within `bounds`. `path` may be anything: a
/// directory is emptied and removed; a symlink, a FIFO, a file is unlinked, never followed or
/// opened. Missing: `Ok` with nothing removed.
pub fn remove(path: &Path, bounds: &Bounds) -> Result<Removed, GaveUp> {
    let mut w = Walk {
        bounds: Bounds {
            max_depth: bounds.max_depth.max(2),
            ..*bounds
        },
        start: Instant::now(),
        seen: 0,
        done: Removed::default(),
        stuck: None,
        next_hoist: 0,
    };
    let give_up = |w: &Walk, reason: String| GaveUp {
        path: path.to_path_buf(),
        reason,
        done: w.done,
    };
    let (parent, name) = match (path.parent(), path.file_name()) {
        (Some(p), Some(n)) => (
            if p.as_os_str().is_empty() {
                Path::new(".")
            } else {
                p
            },
            n,
        ),
        _ => return Err(give_up(&w, "not a path to remove".into())),
    };
    let Ok(name) = CString::new(name.as_bytes()) else {
        return Err(give_up(&w, "a NUL in the path".into()));
    };
    let parent = match fs::openat(CWD, parent, DIR_FLAGS, Mode::empty()) {
        Ok(p) => p,
        Err(Errno::NOENT) => return Ok(w.done),
        Err(e) => return Err(give_up(&w, format!("opening its parent: {e}"))),
    };
    match fs::openat(&parent, &name, DIR_FLAGS, Mode::empty()) {
        Err(Errno::NOENT) => Ok(w.done),
        Err(Errno::NOTDIR | Errno::LOOP) => match fs::unlinkat(&parent, &name, AtFlags::empty()) {
            Ok(()) => {
                w.done.entries += 1;
                Ok(w.done)
            }
            Err(Errno::NOENT) => Ok(w.done),
            Err(e) => Err(give_up(&w, format!("unlink: {e}"))),
        },
        Err(e) => Err(give_up(&w, format!("open: {e}"))),
        Ok(root) => {
            w.empty(root).map_err(|r| give_up(&w, r))?;
            match fs::unlinkat(&parent, &name, AtFlags::REMOVEDIR) {
                Ok(()) => {
                    w.done.entries += 1;
                    Ok(w.done)
                }
                Err(Errno::NOENT) => Ok(w.done),
                Err(e) => {
                    let why = w.stuck.take().unwrap_or_else(|| format!("rmdir: {e}"));
                    Err(give_up(&w, why))
                }
            }
        }
    }
}

impl Walk {
    /// Within the bounds: the reason if not.
    fn check(&self) -> Result<(), String> {
        if self.seen >= self.bounds.max_entries {
            return Err(format!("{} entries looked at", self.seen));
        }
        if self.start.elapsed() >= self.bounds.max_time {
            return Err(format!("{:?} spent", self.bounds.max_time));
        }
        Ok(())
    }

    fn note(&mut self, what: String) {
        self.stuck.get_or_insert(what);
    }

    /// Empties the directory `root` (leaves it in place).
    fn empty(&mut self, root: OwnedFd) -> Result<(), String> {
        let dev = fs::fstat(&root).map_err(|e| format!("fstat: {e}"))?.st_dev;
        let root_stream = Dir::read_from(&root).map_err(|e| format!("read: {e}"))?;
        let mut stack = vec![Frame {
            dir: root_stream,
            name: CString::default(),
            progress: false,
        }];
        // Set when a directory is moved up to the root: the root is read through again.
        let mut root_grew = false;
        loop {
            self.check()?;
            let depth = stack.len();
            let Some(top) = stack.last_mut() else {
                return Ok(());
            };
            let entry = match top.dir.read() {
                Some(Ok(e)) => Some(e),
                Some(Err(e)) => {
                    self.note(format!("reading a directory: {e}"));
                    None
                }
                None => None,
            };
            let Some(entry) = entry else {
                // The end of this directory.
                if top.progress || (depth == 1 && root_grew) {
                    // Something went: read it through again (entries added while it was read
                    // need not show); a read-through that removes nothing ends it.
                    top.progress = false;
                    root_grew &= depth != 1;
                    top.dir.rewind();
                    continue;
                }
                if depth == 1 {
                    return Ok(());
                }
                let Some(done) = stack.pop() else {
                    return Ok(());
                };
                let Some(parent) = stack.last_mut() else {
                    return Ok(());
                };
                drop(done.dir);
                match fs::unlinkat(
                    parent.dir.fd().map_err(|e| e.to_string())?,
                    &done.name,
                    AtFlags::REMOVEDIR,
                ) {
                    Ok(()) => {
                        self.done.entries += 1;
                        parent.progress = true;
                    }
                    Err(Errno::NOENT) => {}
                    Err(e) => self.note(format!("rmdir: {e}")),
                }
                continue;
            };
            let name: &CStr = entry.file_name();
            if name.to_bytes() == b"." || name.to_bytes() == b".." {
                continue;
            }
            self.seen += 1;
            let name = name.to_owned();
            let here = top.dir.fd().map_err(|e| e.to_string())?;
            if entry.file_type() != FileType::Directory {
                match fs::unlinkat(here, &name, AtFlags::empty()) {
                    Ok(()) => {
                        self.done.entries += 1;
                        top.progress = true;
                        continue;
                    }
                    Err(Errno::NOENT) => continue,
                    // A directory after all (unknown type, or replaced since it was listed).
                    Err(Errno::ISDIR) => {}
                    Err(e) => {
                        self.note(format!("unlink: {e}"));
                        continue;
                    }
                }
            }
            let sub = match fs::openat(here, &name, DIR_FLAGS, Mode::empty()) {
                Ok(sub) => sub,
                Err(Errno::NOENT) => continue,
                // Not a directory (any more): a symlink, a FIFO, a file: unlinked, not opened.
                Err(Errno::NOTDIR | Errno::LOOP) => {
                    match fs::unlinkat(here, &name, AtFlags::empty()) {
                        Ok(()) => {
                            self.done.entries += 1;
                            top.progress = true;
                        }
                        Err(Errno::NOENT) => {}
                        Err(e) => self.note(format!("unlink: {e}")),
                    }
                    continue;
                }
                Err(e) => {
                    self.note(format!("open: {e}"));
                    continue;
                }
            };
            match fs::fstat(&sub) {
                Ok(st) if st.st_dev == dev => {}
                Ok(_) => {
                    self.note(format!(
                        "a mount point at depth {depth} ({})",
                        name.to_string_lossy()
                    ));
                    continue;
                }
                Err(e) => {
                    self.note(format!("fstat: {e}"));
                    continue;
                }
            }
            if depth < self.bounds.max_depth {
                match Dir::new(sub) {
                    Ok(dir) => stack.push(Frame {
                        dir,
                        name,
                        progress: false,
                    }),
                    Err(e) => self.note(format!("read: {e}")),
                }
                continue;
            }
            // Too deep to enter: moved up to the root, emptied from there.
            drop(sub);
            loop {
                self.next_hoist += 1;
                let to = CString::new(format!(".cuvisor-deep-{}", self.next_hoist))
                    .map_err(|e| e.to_string())?;
                match fs::renameat_with(here, &name, root.as_fd(), &to, RenameFlags::NOREPLACE) {
                    Ok(()) => {
                        self.done.hoisted += 1;
                        top.progress = true;
                        root_grew = true;
                    }
                    Err(Errno::EXIST) => {
                        self.check()?;
                        continue;
                    }
                    Err(Errno::NOENT) => {}
                    Err(e) => self.note(format!("moving a deep directory up: {e}")),
                }
                break;
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn scratch(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("cuvisor-tree-{tag}-{}", std::process::id()));
        // (A scratch of an earlier run: removed the way under test, whatever its depth.)
        let _ = remove(&d, &Bounds::default());
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    /// A chain of `levels` directories under `at`, made by descriptor (a path that deep could
    /// not be named), with a file at the bottom.
    pub(crate) fn deep_tree(at: &Path, levels: usize) {
        let mut fd = fs::openat(CWD, at, DIR_FLAGS, Mode::empty()).unwrap();
        for _ in 0..levels {
            fs::mkdirat(&fd, "d", Mode::from_raw_mode(0o755)).unwrap();
            fd = fs::openat(&fd, "d", DIR_FLAGS, Mode::empty()).unwrap();
        }
        let f = fs::openat(
            &fd,
            "bottom",
            OFlags::WRONLY | OFlags::CREATE | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o644),
        )
        .unwrap();
        drop(f);
    }

    /// Runs `f` on a thread with a 256 KiB stack: a walk that recursed per level would
    /// overflow it long before 100 000 levels.
    fn on_small_stack<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
        std::thread::Builder::new()
            .stack_size(256 << 10)
            .spawn(f)
            .unwrap()
            .join()
            .unwrap()
    }

    /// A scratch directory on a tmpfs of its own where one can be mounted (100 000 levels take
    /// 20 s to make on this machine's ext4, 1 s on tmpfs), else a plain one. Unmounted when
    /// dropped.
    pub(crate) struct FastScratch(pub PathBuf, bool);

    impl FastScratch {
        pub(crate) fn new(tag: &str) -> FastScratch {
            let d = scratch(tag);
            let mounted = rustix::mount::mount(
                "cuvisor-test",
                &d,
                "tmpfs",
                rustix::mount::MountFlags::empty(),
                c"size=512m",
            )
            .is_ok();
            FastScratch(d, mounted)
        }
    }

    impl Drop for FastScratch {
        fn drop(&mut self) {
            if self.1 {
                let _ = rustix::mount::unmount(&self.0, rustix::mount::UnmountFlags::DETACH);
            }
            let _ = remove(&self.0, &Bounds::default());
        }
    }

    #[test]
    fn a_tree_100000_levels_deep_is_removed_in_one_pass_on_a_small_stack() {
        let s = FastScratch::new("deep");
        let d = &s.0;
        let tree = d.join("state");
        std::fs::create_dir(&tree).unwrap();
        deep_tree(&tree, 100_000);
        let t = Instant::now();
        let at = tree.clone();
        let r = on_small_stack(move || {
            remove(
                &at,
                &Bounds {
                    max_time: Duration::from_secs(60),
                    ..Bounds::default()
                },
            )
        })
        .unwrap();
        assert_eq!(r.entries, 100_002, "every level, the file and the root");
        assert!(r.hoisted > 3000, "{r:?}");
        assert!(!tree.exists());
        eprintln!("100000 levels: {r:?} in {:?}", t.elapsed());
    }

    #[test]
    fn a_wide_tree_is_removed() {
        let d = scratch("wide");
        let tree = d.join("state");
        for i in 0..50 {
            let sub = tree.join(format!("s{i}"));
            std::fs::create_dir_all(&sub).unwrap();
            for j in 0..200 {
                std::fs::write(sub.join(format!("f{j}")), b"x").unwrap();
            }
        }
        for j in 0..5000 {
            std::fs::write(tree.join(format!("top{j}")), b"").unwrap();
        }
        let r = remove(&tree, &Bounds::default()).unwrap();
        assert_eq!(r.entries, 50 + 50 * 200 + 5000 + 1);
        assert!(!tree.exists());
        std::fs::remove_dir(&d).unwrap();
    }

    #[test]
    fn a_symlink_to_a_host_directory_is_removed_and_the_directory_survives() {
        let d = scratch("link");
        let host = d.join("host");
        std::fs::create_dir_all(host.join("inner")).unwrap();
        std::fs::write(host.join("precious"), b"keep").unwrap();
        let tree = d.join("state");
        std::fs::create_dir_all(tree.join("a/b")).unwrap();
        std::os::unix::fs::symlink(&host, tree.join("link")).unwrap();
        std::os::unix::fs::symlink(&host, tree.join("a/b/link")).unwrap();
        std::os::unix::fs::symlink(host.join("precious"), tree.join("file-link")).unwrap();
        // At the depth bound, a symlink is not moved up or entered either.
        remove(
            &tree,
            &Bounds {
                max_depth: 2,
                ..Bounds::default()
            },
        )
        .unwrap();
        assert!(!tree.exists());
        assert_eq!(std::fs::read(host.join("precious")).unwrap(), b"keep");
        assert!(host.join("inner").is_dir());
        // The tree itself a symlink: the link goes, not what it names.
        std::os::unix::fs::symlink(&host, &tree).unwrap();
        assert_eq!(remove(&tree, &Bounds::default()).unwrap().entries, 1);
        assert!(host.join("precious").exists());
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_fifo_and_a_device_node_are_unlinked_without_being_opened() {
        let d = scratch("fifo");
        let tree = d.join("state");
        std::fs::create_dir_all(tree.join("sub")).unwrap();
        for p in [tree.join("fifo"), tree.join("sub/fifo")] {
            assert!(std::process::Command::new("mkfifo")
                .arg(&p)
                .status()
                .unwrap()
                .success());
        }
        // A node that would block or fail if opened (needs root; skipped quietly otherwise:
        // the FIFOs are the test).
        let _ = fs::mknodat(
            CWD,
            tree.join("sub/null"),
            FileType::CharacterDevice,
            Mode::from_raw_mode(0o666),
            fs::makedev(1, 3),
        );
        let t = Instant::now();
        let at = tree.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || tx.send(remove(&at, &Bounds::default())));
        let r = rx
            .recv_timeout(Duration::from_secs(1))
            .expect("a FIFO blocked the walk");
        r.unwrap();
        assert!(t.elapsed() < Duration::from_secs(1));
        assert!(!tree.exists());
        // The tree itself a FIFO.
        assert!(std::process::Command::new("mkfifo")
            .arg(&tree)
            .status()
            .unwrap()
            .success());
        assert_eq!(remove(&tree, &Bounds::default()).unwrap().entries, 1);
        std::fs::remove_dir(&d).unwrap();
    }

    #[test]
    fn a_tree_over_its_bounds_is_given_up_on_and_a_later_pass_finishes() {
        let d = scratch("bounds");
        let tree = d.join("state");
        std::fs::create_dir_all(tree.join("sub")).unwrap();
        for j in 0..1000 {
            std::fs::write(tree.join(format!("f{j}")), b"").unwrap();
            std::fs::write(tree.join(format!("sub/g{j}")), b"").unwrap();
        }
        let small = Bounds {
            max_entries: 300,
            ..Bounds::default()
        };
        let mut passes = 0;
        let total = loop {
            passes += 1;
            match remove(&tree, &small) {
                Ok(r) => break r,
                Err(g) => {
                    assert!(g.reason.contains("300 entries looked at"), "{g}");
                    assert!(g.done.entries > 0, "each pass gets somewhere: {g}");
                    assert!(passes < 20, "never finished: {g}");
                }
            }
        };
        assert!(passes >= 7, "2001 entries, 300 a pass: {passes}");
        assert!(!tree.exists(), "{total:?}");
        // No time at all: given up before the first entry, nothing lost.
        std::fs::create_dir_all(tree.join("x")).unwrap();
        let g = remove(
            &tree,
            &Bounds {
                max_time: Duration::ZERO,
                ..Bounds::default()
            },
        )
        .unwrap_err();
        assert!(g.reason.contains("spent"), "{g}");
        assert!(tree.join("x").is_dir());
        remove(&tree, &Bounds::default()).unwrap();
        std::fs::remove_dir(&d).unwrap();
    }

    /// A mount inside the tree (the tenant's tmpfs not yet unmounted, or anything mounted
    /// there): not entered, the tree given up on; unmounted, a later pass finishes.
    #[test]
    fn a_mount_point_in_the_tree_is_not_crossed() {
        let d = scratch("mnt");
        let tree = d.join("alloc");
        let state = tree.join("state");
        std::fs::create_dir_all(&state).unwrap();
        std::fs::write(tree.join("limits.conf"), b"").unwrap();
        if let Err(e) = rustix::mount::mount(
            "cuvisor-test",
            &state,
            "tmpfs",
            rustix::mount::MountFlags::empty(),
            c"size=64k",
        ) {
            assert!(
                std::env::var_os("CI").is_none(),
                "cannot mount a tmpfs: {e}"
            );
            eprintln!("SKIPPED a_mount_point_in_the_tree_is_not_crossed: cannot mount: {e}");
            return;
        }
        std::fs::write(state.join("ledger"), b"on the mount").unwrap();
        let g = remove(&tree, &Bounds::default()).unwrap_err();
        assert!(g.reason.contains("a mount point"), "{g}");
        assert_eq!(
            std::fs::read(state.join("ledger")).unwrap(),
            b"on the mount"
        );
        rustix::mount::unmount(&state, rustix::mount::UnmountFlags::DETACH).unwrap();
        remove(&tree, &Bounds::default()).unwrap();
        assert!(!tree.exists());
        std::fs::remove_dir(&d).unwrap();
    }
}
