//! Opening a shared-memory file: the one way every layout of cuvisor (the ledger, the GPU
//! coordinator, the simulator's state) is created, checked and mapped.
//!
//! - The file is opened without following a symlink in its last component and without blocking
//!   (a FIFO or a device answers at once), and must be a regular file.
//! - Creation and first initialisation happen under the file's `flock`, which the kernel drops if
//!   its holder dies; the lock is waited for a bounded time only ([`LOCK_WAIT`]), so a process that
//!   holds it for good makes the opener fail with a clear error, never hang.
//! - The size must be exactly the layout's (0 when new: then it is sized here).
//! - The magic number is published last (Release) by the initialiser; a mapped file with the
//!   magic is checked by the layout's own rule (version, shape) *before* it is unmapped on error,
//!   so no error path reads the mapping after `munmap`.
//!
//! Mapping a file others can write means trusting them not to truncate it (a truncated mapping
//! raises SIGBUS on access). Only the processes of one container map that container's ledger;
//! the node daemon never maps a file a container can write (see `ledger::Snapshot`).

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering::*};
use std::time::{Duration, Instant};

/// How long an opener waits for another process's initialisation lock.
pub const LOCK_WAIT: Duration = Duration::from_secs(2);

/// A `#[repr(C)]` layout shared through a mapped file.
///
/// # Safety
/// Every bit pattern must be a valid value of the type (atomics and plain integers only), and
/// zero bytes must mean "not initialised".
pub unsafe trait Layout: Sized {
    /// The value [`Layout::magic`] holds once the file is initialised.
    const MAGIC: u64;
    /// What error messages call the file ("ledger").
    const WHAT: &'static str;
    fn magic(&self) -> &AtomicU64;
}

/// A mapped file of layout `T`. Unmapped on drop.
pub struct Mapped<T: Layout> {
    ptr: *mut T,
    file: File,
    path: PathBuf,
}

// SAFETY: T is made of atomics and integers (the Layout contract); the mapping stays valid for
// the life of the value and shared mutation goes through atomics.
unsafe impl<T: Layout> Send for Mapped<T> {}
// SAFETY: as above.
unsafe impl<T: Layout> Sync for Mapped<T> {}

impl<T: Layout> std::ops::Deref for Mapped<T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: mapped, page aligned, size_of::<T>() long, valid for any bytes (Layout).
        unsafe { &*self.ptr }
    }
}

impl<T: Layout> Drop for Mapped<T> {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly what `open` mapped; no reference into it outlives self.
        unsafe { libc::munmap(self.ptr.cast(), std::mem::size_of::<T>()) };
    }
}

impl<T: Layout> Mapped<T> {
    pub fn path(&self) -> &Path {
        &self.path
    }
    pub fn file(&self) -> &File {
        &self.file
    }
    /// In a forked child: the same file through an open file description of the child's own
    /// (so that locks the child takes are not the parent's; see `lease`). The descriptor number
    /// and the mapping stay; the inherited description is the parent's alone again.
    pub fn reopen_own(&self) -> std::io::Result<()> {
        let fd = self.file.as_raw_fd();
        let fresh = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(format!("/proc/self/fd/{fd}"))?;
        // SAFETY: both descriptors are open; dup2 atomically points `fd` at the new description
        // (O_CLOEXEC is per descriptor and dup2 clears it: set it again).
        unsafe {
            if libc::dup2(fresh.as_raw_fd(), fd) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC);
        }
        Ok(())
    }
}

/// How to open.
#[derive(Clone, Copy, Debug)]
pub struct Open {
    /// Create (and initialise) the file when it does not exist.
    pub create: bool,
    /// Mode of a file created here (before the umask); 0o666 for files every uid shares.
    pub mode: u32,
}

fn err(what: &str, path: &Path, how: &str, e: impl std::fmt::Display) -> String {
    format!("{what} {}: {how}: {e}", path.display())
}

/// What every open of a file someone else may have put in place adds: no symlink followed in
/// the last component, no blocking on a FIFO, no controlling terminal.
const UNTRUSTED: libc::c_int =
    libc::O_CLOEXEC | libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_NOCTTY;

fn not_regular() -> std::io::Error {
    std::io::Error::other("not a regular file")
}

/// The file of a descriptor just opened (`fd` from open(2), negative on failure), if it is a
/// regular file.
fn regular(fd: libc::c_int) -> std::io::Result<File> {
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: fd was just opened and is owned by nobody else.
    let file = unsafe { File::from_raw_fd(fd) };
    if !file.metadata()?.file_type().is_file() {
        return Err(not_regular());
    }
    Ok(file)
}

fn c_path(p: &[u8]) -> std::io::Result<std::ffi::CString> {
    std::ffi::CString::new(p).map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))
}

/// Opens a regular file without following a symlink or blocking on a special file. Something
/// else already there (a device, a FIFO) is refused before it is opened.
pub fn open_regular(path: &Path, write: bool, create: Option<u32>) -> std::io::Result<File> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if !m.file_type().is_file() => return Err(not_regular()),
        Err(e) if create.is_none() || e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    let c = c_path(path.as_os_str().as_bytes())?;
    let mut flags = UNTRUSTED | if write { libc::O_RDWR } else { libc::O_RDONLY };
    if create.is_some() {
        flags |= libc::O_CREAT;
    }
    // SAFETY: a valid NUL-terminated path; the mode argument is read only with O_CREAT.
    regular(unsafe { libc::open(c.as_ptr(), flags, create.unwrap_or(0) as libc::c_uint) })
}

/// Opens `name` inside `dir` read-only, as `open_regular` does (`dir` itself is not followed
/// through a symlink either), so that a directory the caller trusts cannot lead elsewhere.
pub fn open_beneath(dir: &Path, name: &str) -> std::io::Result<File> {
    if name.contains('/') {
        return Err(std::io::Error::from(std::io::ErrorKind::InvalidInput));
    }
    let (cdir, cname) = (
        c_path(dir.as_os_str().as_bytes())?,
        c_path(name.as_bytes())?,
    );
    // SAFETY: a valid NUL-terminated path.
    let d = unsafe {
        libc::open(
            cdir.as_ptr(),
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC,
        )
    };
    if d < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: d was just opened and is owned by nobody else.
    let dirf = unsafe { File::from_raw_fd(d) };
    // SAFETY: zeroed stat is valid; fstatat fills it for a valid dirfd and NUL-terminated name.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe {
        libc::fstatat(
            dirf.as_raw_fd(),
            cname.as_ptr(),
            &mut st,
            libc::AT_SYMLINK_NOFOLLOW,
        )
    } != 0
    {
        return Err(std::io::Error::last_os_error());
    }
    if st.st_mode & libc::S_IFMT != libc::S_IFREG {
        return Err(not_regular());
    }
    // SAFETY: a valid dirfd and NUL-terminated name.
    regular(unsafe { libc::openat(dirf.as_raw_fd(), cname.as_ptr(), libc::O_RDONLY | UNTRUSTED) })
}

/// Reads up to `buf.len()` bytes from the start of `file`; fewer only at its end.
pub fn read_head(file: &File, buf: &mut [u8]) -> std::io::Result<usize> {
    use std::os::unix::fs::FileExt as _;
    let mut got = 0;
    while got < buf.len() {
        match file.read_at(&mut buf[got..], got as u64) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(got)
}

/// `flock(LOCK_EX)` waited for at most [`LOCK_WAIT`]. The guard unlocks.
pub struct Flock<'a>(&'a File);

impl<'a> Flock<'a> {
    pub fn exclusive(f: &'a File, wait: Duration) -> std::io::Result<Flock<'a>> {
        let deadline = Instant::now() + wait;
        let mut pause = Duration::from_micros(50);
        loop {
            // SAFETY: our own open descriptor; the kernel drops the lock if we die holding it.
            if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
                return Ok(Flock(f));
            }
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EWOULDBLOCK) {
                return Err(e);
            }
            if Instant::now() >= deadline {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("locked by another process for {wait:?}"),
                ));
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(20));
        }
    }
    /// Without waiting: None when another process holds it.
    pub fn try_exclusive(f: &'a File) -> Option<Flock<'a>> {
        // SAFETY: as above.
        (unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0)
            .then_some(Flock(f))
    }
}

impl Drop for Flock<'_> {
    fn drop(&mut self) {
        // SAFETY: our own descriptor; unlocking is always allowed.
        unsafe { libc::flock(self.0.as_raw_fd(), libc::LOCK_UN) };
    }
}

/// Maps `file` (of `path`, exactly `size_of::<T>()` bytes long: the caller checked) as a `T`.
fn map<T: Layout>(file: File, path: &Path) -> Result<Mapped<T>, String> {
    // SAFETY: mapping `size_of::<T>()` bytes of a file exactly that long, shared between
    // processes.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            std::mem::size_of::<T>(),
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            file.as_raw_fd(),
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(err(T::WHAT, path, "mmap", std::io::Error::last_os_error()));
    }
    Ok(Mapped {
        ptr: p.cast::<T>(),
        file,
        path: path.to_path_buf(),
    })
}

/// Opens, creates if asked, checks and maps `path` as a `T`.
///
/// `init` fills a new file's fields (magic still 0, the flock held, nobody else reading);
/// `check` judges a file that has the magic (version, shape, identity) and says why not.
pub fn open<T: Layout>(
    path: &Path,
    how: Open,
    init: impl FnOnce(*mut T),
    check: impl FnOnce(&T) -> Result<(), String>,
) -> Result<Mapped<T>, String> {
    let what = T::WHAT;
    let size = std::mem::size_of::<T>();
    let file = open_regular(path, true, how.create.then_some(how.mode))
        .map_err(|e| err(what, path, "open", e))?;
    let lock = Flock::exclusive(&file, LOCK_WAIT).map_err(|e| err(what, path, "lock", e))?;
    let len = file
        .metadata()
        .map_err(|e| err(what, path, "stat", e))?
        .len();
    if len != size as u64 {
        if len != 0 || !how.create {
            return Err(format!(
                "{what} {}: {len} bytes, expected {size}: not a cuvisor {what} of this version",
                path.display()
            ));
        }
        file.set_len(size as u64)
            .map_err(|e| err(what, path, "resize", e))?;
        // The umask narrows a created file's mode; files every uid shares need it as asked.
        // (Only the owner may change it: a file someone else made keeps theirs.)
        use std::os::unix::fs::PermissionsExt;
        let _ = file.set_permissions(std::fs::Permissions::from_mode(how.mode));
    }
    let mapped = map::<T>(
        file.try_clone().map_err(|e| err(what, path, "dup", e))?,
        path,
    )?;
    // From here on an error drops `mapped` (unmapping) after the message is made.
    match mapped.magic().load(Acquire) {
        0 => {
            init(mapped.ptr);
            mapped.magic().store(T::MAGIC, Release);
        }
        m if m == T::MAGIC => {
            check(&mapped).map_err(|e| format!("{what} {}: {e}", path.display()))?
        }
        _ => return Err(format!("{what} {}: not a cuvisor {what}", path.display())),
    }
    drop(lock);
    drop(file);
    Ok(mapped)
}

/// Maps `path`, an initialised `T` someone else made (its magic set), without taking its flock:
/// for a file others can open, and so lock, but not write (a container's coordinator state,
/// which the device plugin made and other containers see read-only). The size must be exact and
/// `check` must accept it.
pub fn open_existing<T: Layout>(
    path: &Path,
    check: impl FnOnce(&T) -> Result<(), String>,
) -> Result<Mapped<T>, String> {
    let what = T::WHAT;
    let size = std::mem::size_of::<T>();
    let file = open_regular(path, true, None).map_err(|e| err(what, path, "open", e))?;
    let len = file
        .metadata()
        .map_err(|e| err(what, path, "stat", e))?
        .len();
    if len != size as u64 {
        return Err(format!(
            "{what} {}: {len} bytes, expected {size}: not a cuvisor {what} of this version",
            path.display()
        ));
    }
    let mapped = map::<T>(file, path)?;
    if mapped.magic().load(Acquire) != T::MAGIC {
        return Err(format!("{what} {}: not a cuvisor {what}", path.display()));
    }
    check(&mapped).map_err(|e| format!("{what} {}: {e}", path.display()))?;
    Ok(mapped)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[repr(C)]
    struct Tiny {
        magic: AtomicU64,
        version: u32,
        _pad: u32,
        value: AtomicU64,
    }
    // SAFETY: atomics and integers only.
    unsafe impl Layout for Tiny {
        const MAGIC: u64 = 0x5449_4e59;
        const WHAT: &'static str = "tiny";
        fn magic(&self) -> &AtomicU64 {
            &self.magic
        }
    }

    fn open_tiny(p: &Path, create: bool) -> Result<Mapped<Tiny>, String> {
        open::<Tiny>(
            p,
            Open {
                create,
                mode: 0o600,
            },
            // SAFETY: the file is new and ours alone (flock held, magic unset).
            |t| unsafe { (*t).version = 7 },
            |t| match t.version {
                7 => Ok(()),
                v => Err(format!("version {v}")),
            },
        )
    }

    fn scratch(tag: &str) -> PathBuf {
        cuvisor_testkit::fresh_dir(&format!("mapped-{tag}"))
    }

    #[test]
    fn created_once_then_shared() {
        let d = scratch("shared");
        let a = open_tiny(&d.join("f"), true).unwrap();
        a.value.store(5, Relaxed);
        let b = open_tiny(&d.join("f"), false).unwrap();
        assert_eq!(b.value.load(Relaxed), 5);
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn a_wrong_version_is_reported_without_touching_the_unmapped_file() {
        let d = scratch("version");
        let f = d.join("f");
        drop(open_tiny(&f, true).unwrap());
        // Version 3 with the right magic: the message comes from the check, before munmap.
        let mut bytes = std::fs::read(&f).unwrap();
        bytes[8..12].copy_from_slice(&3u32.to_ne_bytes());
        std::fs::write(&f, &bytes).unwrap();
        let e = open_tiny(&f, false).err().unwrap();
        assert!(e.contains("version 3"), "{e}");
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn special_files_symlinks_and_wrong_sizes_are_refused_at_once() {
        let d = scratch("special");
        let fifo = d.join("fifo");
        let c = std::ffi::CString::new(fifo.as_os_str().as_bytes()).unwrap();
        // SAFETY: a valid path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let t = Instant::now();
        assert!(open_tiny(&fifo, true).err().unwrap().contains("regular"));
        assert!(open_tiny(Path::new("/dev/zero"), false).is_err());
        assert!(t.elapsed() < Duration::from_secs(1), "no hang");
        std::os::unix::fs::symlink("/etc/hostname", d.join("link")).unwrap();
        assert!(
            open_tiny(&d.join("link"), true).is_err(),
            "symlink followed"
        );
        std::fs::write(d.join("short"), b"abc").unwrap();
        assert!(open_tiny(&d.join("short"), true)
            .err()
            .unwrap()
            .contains("3 bytes"));
        assert!(open_tiny(&d.join("absent"), false).is_err());
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn a_held_lock_is_waited_for_a_bounded_time() {
        let d = scratch("lock");
        let f = d.join("f");
        drop(open_tiny(&f, true).unwrap());
        let holder = std::fs::File::open(&f).unwrap();
        let _held = Flock::exclusive(&holder, Duration::ZERO).unwrap();
        let t = Instant::now();
        let e = open_tiny(&f, false).err().unwrap();
        assert!(e.contains("lock"), "{e}");
        assert!(t.elapsed() < LOCK_WAIT + Duration::from_secs(1));
        let _ = std::fs::remove_dir_all(&d);
    }
}
