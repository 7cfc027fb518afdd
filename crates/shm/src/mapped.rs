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

/// Who may use the state (directories and files) cuvisor opens or makes.
///
/// Under the device plugin the plugin made the container's ledger directory (1777: a container
/// may run processes of several uids that share one ledger), so the library takes it as it is
/// and makes the ledger 0666 ([`Access::Shared`]). Where the environment alone configures
/// cuvisor (no limits file: `cuvisor run`, a user's own shell), nothing says who else may use
/// the state, so it is the caller's alone ([`Access::Private`]), or a group's where a setting
/// names one ([`Access::Group`], the self-service coordinator's `CUVISOR_COORD_GROUP`).
///
/// Whatever the access, the directory is never reached through a symbolic link in its last
/// component, and what is judged is the directory or file opened (`fstat` on its descriptor),
/// not the path, so nothing swapped in between the check and the use counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// Every uid's (the device plugin's containers, a limits file's author): one that exists is
    /// used as it is; a directory made here is 1777, a file 0666, whatever the umask.
    Shared,
    /// The caller's alone: directories 0700, files 0600 whatever the umask; one that exists
    /// must be owned by the caller's effective uid and writable by nobody else.
    Private,
    /// The caller's and group `gid`'s: directories 2770 and files 0660 of that group; one that
    /// exists must belong to that group and not be writable by others outside it.
    Group(u32),
}

impl Access {
    /// The mode of a directory made here.
    fn dir_mode(self) -> u32 {
        match self {
            Access::Shared => 0o1777,
            Access::Private => 0o700,
            Access::Group(_) => 0o2770,
        }
    }
    /// The mode of a file made here.
    pub fn file_mode(self) -> u32 {
        match self {
            Access::Shared => 0o666,
            Access::Private => 0o600,
            Access::Group(_) => 0o660,
        }
    }
    /// Why a directory or file with this status may not be used, if it may not.
    fn judge(self, st: &libc::stat) -> Result<(), String> {
        // SAFETY: geteuid has no preconditions.
        let euid = unsafe { libc::geteuid() };
        let mode = st.st_mode & 0o7777;
        match self {
            Access::Shared => Ok(()),
            Access::Private if st.st_uid != euid => Err(format!(
                "is owned by uid {}, not by this user (uid {euid}): refused",
                st.st_uid
            )),
            Access::Private if mode & 0o022 != 0 => Err(format!(
                "has mode {mode:04o}: others can write it: refused (chmod go-w, or remove it)"
            )),
            Access::Group(g) if st.st_gid != g => Err(format!(
                "belongs to group {}, not to the configured group {g}: refused",
                st.st_gid
            )),
            Access::Group(_) if mode & 0o002 != 0 => Err(format!(
                "has mode {mode:04o}: users outside the group can write it: refused"
            )),
            Access::Private | Access::Group(_) => Ok(()),
        }
    }
    /// Gives what this process just made its mode (and group), whatever the umask.
    fn apply(self, fd: libc::c_int, mode: u32) -> std::io::Result<()> {
        // SAFETY: fchown/fchmod on a descriptor the caller holds open.
        unsafe {
            if let Access::Group(g) = self {
                if libc::fchown(fd, u32::MAX, g) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            if libc::fchmod(fd, mode as libc::mode_t) != 0 {
                return Err(std::io::Error::last_os_error());
            }
        }
        Ok(())
    }
}

fn fstat(fd: libc::c_int) -> std::io::Result<libc::stat> {
    // SAFETY: zeroed stat is valid; fstat fills it for an open descriptor.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(st)
}

/// Opens the directory `path` for state of `access`, making it first when `create` (its
/// missing parents as `mkdir -p` would, itself with `access`'s mode whatever the umask). A
/// symbolic link in its place is refused, never followed; a directory that is there is judged
/// by `access` on its descriptor. The error is one line that starts with the path.
pub fn open_dir(path: &Path, access: Access, create: bool) -> Result<File, String> {
    let fail = |why: &dyn std::fmt::Display| format!("{} {why}", path.display());
    let c = c_path(path.as_os_str().as_bytes()).map_err(|e| fail(&e))?;
    let mut made = false;
    if create {
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).map_err(|e| fail(&format!(": cannot create: {e}")))?;
        }
        // SAFETY: a valid NUL-terminated path.
        if unsafe { libc::mkdir(c.as_ptr(), access.dir_mode() as libc::mode_t) } == 0 {
            made = true;
        } else {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EEXIST) {
                return Err(fail(&format!(": cannot create: {e}")));
            }
        }
    }
    // SAFETY: a valid NUL-terminated path.
    let fd = unsafe {
        libc::open(
            c.as_ptr(),
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        let e = std::io::Error::last_os_error();
        return Err(match std::fs::symlink_metadata(path) {
            Ok(m) if m.file_type().is_symlink() => {
                fail(&"is a symbolic link: refused, not followed")
            }
            Ok(m) if !m.is_dir() => fail(&"is not a directory"),
            _ => fail(&format!(": {e}")),
        });
    }
    // SAFETY: fd was just opened and is owned by nobody else.
    let dir = unsafe { File::from_raw_fd(fd) };
    let mut st = fstat(fd).map_err(|e| fail(&format!(": stat: {e}")))?;
    // SAFETY: geteuid has no preconditions.
    if made && st.st_uid == unsafe { libc::geteuid() } {
        access
            .apply(fd, access.dir_mode())
            .map_err(|e| fail(&format!(": cannot set its mode: {e}")))?;
        st = fstat(fd).map_err(|e| fail(&format!(": stat: {e}")))?;
    }
    access.judge(&st).map_err(|e| fail(&e))?;
    Ok(dir)
}

/// Opens the regular file `name` in `dir` (a directory [`open_dir`] opened) read-write, as
/// [`open_regular`] does (no symlink followed, no blocking), making it with `access`'s mode
/// (whatever the umask) when `create` and it is not there. A file that was there is judged by
/// `access` on its descriptor.
pub fn open_in(dir: &File, name: &str, access: Access, create: bool) -> std::io::Result<File> {
    if name.contains('/') {
        return Err(std::io::Error::from(std::io::ErrorKind::InvalidInput));
    }
    let c = c_path(name.as_bytes())?;
    let mode = access.file_mode();
    let at = |flags: libc::c_int| {
        // SAFETY: a valid dirfd and NUL-terminated name; the mode is read only with O_CREAT.
        unsafe { libc::openat(dir.as_raw_fd(), c.as_ptr(), flags, mode as libc::c_uint) }
    };
    let flags = UNTRUSTED | libc::O_RDWR;
    if create {
        let fd = at(flags | libc::O_CREAT | libc::O_EXCL);
        if fd >= 0 {
            let file = regular(fd)?;
            access.apply(fd, mode)?;
            return Ok(file);
        }
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EEXIST) {
            return Err(e);
        }
    }
    let file = regular(at(flags))?;
    access
        .judge(&fstat(file.as_raw_fd())?)
        .map_err(std::io::Error::other)?;
    Ok(file)
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
    let file = open_regular(path, true, how.create.then_some(how.mode))
        .map_err(|e| err(T::WHAT, path, "open", e))?;
    open_file(file, path, how, init, check)
}

/// As [`open`], for a file the caller opened (read-write, a regular file: [`open_in`]);
/// `path` names it in messages.
pub fn open_file<T: Layout>(
    file: File,
    path: &Path,
    how: Open,
    init: impl FnOnce(*mut T),
    check: impl FnOnce(&T) -> Result<(), String>,
) -> Result<Mapped<T>, String> {
    let what = T::WHAT;
    let size = std::mem::size_of::<T>();
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

    fn mode_of(p: &Path) -> (u32, u32, u32) {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::symlink_metadata(p).unwrap();
        (m.mode() & 0o7777, m.uid(), m.gid())
    }

    fn is_root() -> bool {
        // SAFETY: geteuid has no preconditions.
        unsafe { libc::geteuid() == 0 }
    }

    /// Private state is made 0700 / 0600 and is the caller's; opened again, it is accepted.
    #[test]
    fn private_state_is_made_for_the_caller_alone() {
        let d = scratch("private");
        let dir = d.join("a/b/state");
        let f = open_dir(&dir, Access::Private, true).unwrap();
        // SAFETY: geteuid has no preconditions.
        let me = unsafe { libc::geteuid() };
        assert_eq!(mode_of(&dir).0, 0o700);
        assert_eq!(mode_of(&dir).1, me);
        drop(open_in(&f, "file", Access::Private, true).unwrap());
        assert_eq!(mode_of(&dir.join("file")).0, 0o600);
        assert!(open_in(&f, "file", Access::Private, false).is_ok());
        assert!(open_dir(&dir, Access::Private, true).is_ok());
        let _ = std::fs::remove_dir_all(&d);
    }

    /// Attack: a symbolic link where the state directory goes (root then made a world-writable
    /// ledger wherever it pointed). Refused, in every access, and nothing made where it points.
    #[test]
    fn a_symlinked_state_dir_is_refused_not_followed() {
        let d = scratch("symlink");
        std::fs::create_dir(d.join("target")).unwrap();
        std::os::unix::fs::symlink(d.join("target"), d.join("link")).unwrap();
        std::os::unix::fs::symlink(d.join("absent"), d.join("dangling")).unwrap();
        for access in [Access::Private, Access::Shared, Access::Group(0)] {
            for link in ["link", "dangling"] {
                let e = open_dir(&d.join(link), access, true).unwrap_err();
                assert!(e.contains("symbolic link"), "{access:?} {link}: {e}");
            }
        }
        assert_eq!(std::fs::read_dir(d.join("target")).unwrap().count(), 0);
        assert!(!d.join("absent").exists());
        let _ = std::fs::remove_dir_all(&d);
    }

    /// Attack: another user pre-creates the state directory (or makes it writable to all), or
    /// plants a file in it. Private state refuses each, with the reason.
    #[test]
    fn state_of_another_user_or_writable_by_others_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let d = scratch("others");
        let dir = d.join("state");
        let f = open_dir(&dir, Access::Private, true).unwrap();
        for mode in [0o777, 0o1777, 0o770, 0o720, 0o702] {
            std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(mode)).unwrap();
            let e = open_dir(&dir, Access::Private, true).unwrap_err();
            assert!(e.contains("others can write it"), "{mode:o}: {e}");
        }
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        assert!(
            open_dir(&dir, Access::Private, true).is_ok(),
            "0755 of mine"
        );
        drop(open_in(&f, "file", Access::Private, true).unwrap());
        std::fs::set_permissions(dir.join("file"), std::fs::Permissions::from_mode(0o666)).unwrap();
        let e = open_in(&f, "file", Access::Private, true).unwrap_err();
        assert!(e.to_string().contains("others can write it"), "{e}");
        if !is_root() {
            println!("SKIPPED: the other-owner half needs root (chown)");
            let _ = std::fs::remove_dir_all(&d);
            return;
        }
        std::fs::set_permissions(dir.join("file"), std::fs::Permissions::from_mode(0o600)).unwrap();
        std::os::unix::fs::chown(dir.join("file"), Some(1001), None).unwrap();
        let e = open_in(&f, "file", Access::Private, true).unwrap_err();
        assert!(e.to_string().contains("owned by uid 1001"), "{e}");
        std::os::unix::fs::chown(&dir, Some(1001), Some(1001)).unwrap();
        let e = open_dir(&dir, Access::Private, true).unwrap_err();
        assert!(e.contains("owned by uid 1001, not by this user"), "{e}");
        assert_eq!(e.lines().count(), 1);
        // The same directory through a group setting: its group must be the one named.
        let e = open_dir(&dir, Access::Group(4242), true).unwrap_err();
        assert!(e.contains("not to the configured group 4242"), "{e}");
        assert!(open_dir(&dir, Access::Group(1001), true).is_ok());
        let _ = std::fs::remove_dir_all(&d);
    }

    /// A group's state is made 2770 / 0660 of that group, whatever the umask.
    #[test]
    fn group_state_is_made_for_the_group() {
        let d = scratch("group");
        // SAFETY: getegid has no preconditions.
        let g = unsafe { libc::getegid() };
        let dir = d.join("coord");
        let f = open_dir(&dir, Access::Group(g), true).unwrap();
        assert_eq!(mode_of(&dir).0, 0o2770);
        assert_eq!(mode_of(&dir).2, g);
        drop(open_in(&f, "board", Access::Group(g), true).unwrap());
        assert_eq!(mode_of(&dir.join("board")).0, 0o660);
        assert_eq!(mode_of(&dir.join("board")).2, g);
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
