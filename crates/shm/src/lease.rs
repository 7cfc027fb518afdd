//! Liveness that holds across pid namespaces: a process is alive while it holds a lock.
//!
//! A pid names a process only inside its own pid namespace, and every container has its own: a
//! pid recorded by a process in a container means nothing (or another process) to the node
//! daemon and to other containers. So a shared table does not judge its slots by pid. Instead,
//! the process that owns slot `i` holds an open-file-description lock (`F_OFD_SETLK`, Linux
//! 3.15+) on byte [`BASE`] + `i` of the table's file for as long as it lives; the kernel drops it
//! when the process dies, however it dies. Anyone can ask, without waiting and without
//! mapping the file, whether a byte (or a range: "is any process of this container alive") is
//! held (`F_OFD_GETLK`). Pid reuse cannot fool it, and neither can a process of another
//! namespace.
//!
//! OFD locks belong to the open file description, not to the process: a child made by fork()
//! shares its parent's descriptions and so its locks. A table whose slots are per process has
//! the child open the file anew (`Mapped::reopen_own`) before it takes a lock of its own; a
//! table whose slots are per container (every process of the container holds a shared lock on
//! the container's byte) wants exactly the inherited behaviour.
//!
//! The bytes locked lie far past the end of the file ([`BASE`]): locks there are legal and
//! touch nothing that is read or written. A hostile process can hold locks too: it can keep its
//! own container's slots looking alive, which only keeps its own charges counted.

use std::os::fd::AsRawFd;

/// The first byte offset used for slot locks.
pub const BASE: i64 = 1 << 40;

fn flock_struct(kind: i32, start: i64, len: i64) -> libc::flock {
    // SAFETY: libc::flock is plain data; zero is a valid value for every field.
    let mut l: libc::flock = unsafe { std::mem::zeroed() };
    l.l_type = kind as libc::c_short;
    l.l_whence = libc::SEEK_SET as libc::c_short;
    l.l_start = start;
    l.l_len = len;
    l.l_pid = 0; // required by F_OFD_* commands
    l
}

/// Takes the lock on slot `i` for this open file description without waiting. `shared`: a read
/// lock (several holders), else exclusive (needs the file open for writing). false: held.
pub fn try_hold(f: &impl AsRawFd, i: usize, shared: bool) -> std::io::Result<bool> {
    let kind = if shared { libc::F_RDLCK } else { libc::F_WRLCK };
    let l = flock_struct(kind, BASE + i as i64, 1);
    // SAFETY: a valid descriptor and a fully initialised flock struct.
    if unsafe { libc::fcntl(f.as_raw_fd(), libc::F_OFD_SETLK, &l) } == 0 {
        return Ok(true);
    }
    match std::io::Error::last_os_error() {
        e if matches!(e.raw_os_error(), Some(libc::EAGAIN) | Some(libc::EACCES)) => Ok(false),
        e => Err(e),
    }
}

/// Drops this open file description's lock on slot `i`.
pub fn release(f: &impl AsRawFd, i: usize) {
    let l = flock_struct(libc::F_UNLCK, BASE + i as i64, 1);
    // SAFETY: as above.
    unsafe { libc::fcntl(f.as_raw_fd(), libc::F_OFD_SETLK, &l) };
}

/// Whether any open file description other than `f`'s own holds a lock on slots
/// `first..first + count`. Never waits; works on a descriptor opened read-only.
pub fn held(f: &impl AsRawFd, first: usize, count: usize) -> std::io::Result<bool> {
    let mut l = flock_struct(libc::F_WRLCK, BASE + first as i64, count as i64);
    // SAFETY: as above; F_OFD_GETLK writes the answer into `l`.
    if unsafe { libc::fcntl(f.as_raw_fd(), libc::F_OFD_GETLK, &mut l) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(l.l_type != libc::F_UNLCK as libc::c_short)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs::File;

    fn scratch(tag: &str) -> std::path::PathBuf {
        let p = std::env::temp_dir().join(format!("cuvisor-lease-{tag}-{}", std::process::id()));
        std::fs::write(&p, b"x").unwrap();
        p
    }

    #[test]
    fn a_lock_is_seen_by_other_descriptions_and_gone_with_its_holder() {
        let p = scratch("basic");
        let a = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&p)
            .unwrap();
        let b = File::open(&p).unwrap(); // read-only, as the node daemon opens it
        assert!(!held(&b, 0, 16).unwrap());
        assert!(try_hold(&a, 3, false).unwrap());
        assert!(held(&b, 0, 16).unwrap());
        assert!(held(&b, 3, 1).unwrap());
        assert!(!held(&b, 4, 1).unwrap(), "only byte 3");
        assert!(
            !held(&a, 3, 1).unwrap(),
            "a description does not conflict with itself"
        );
        let c = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&p)
            .unwrap();
        assert!(!try_hold(&c, 3, false).unwrap(), "exclusive");
        // The last descriptor of the description closes: the lock goes. (A thread of this test
        // process that forks to spawn a child holds copies of every descriptor until the child
        // execs, O_CLOEXEC or not: the lock may outlive `drop` by that long.)
        drop(a);
        let t = std::time::Instant::now();
        while held(&b, 0, 16).unwrap() {
            assert!(
                t.elapsed() < std::time::Duration::from_secs(2),
                "lock never dropped"
            );
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        let _ = std::fs::remove_file(&p);
    }

    #[test]
    fn a_killed_holder_releases_its_lock() {
        let p = scratch("killed");
        let b = File::open(&p).unwrap();
        // A child that takes the lock (flock(1) cannot: it uses flock(2)); python3 is on every
        // machine this project runs on, and fcntl.F_OFD_SETLK is Linux's 37.
        let mut child = std::process::Command::new("python3")
            .args([
                "-c",
                &format!(
                    "import fcntl,struct,os,time\n\
                     f=os.open({p:?},os.O_RDWR)\n\
                     fcntl.fcntl(f,37,struct.pack('hhqqi',{wr},0,{base},1,0))\n\
                     print('held',flush=True)\n\
                     time.sleep(60)",
                    p = p.to_str().unwrap(),
                    wr = libc::F_WRLCK,
                    base = BASE + 5
                ),
            ])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(child.stdout.take().unwrap()),
            &mut line,
        )
        .unwrap();
        assert_eq!(line.trim(), "held");
        assert!(held(&b, 5, 1).unwrap());
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(!held(&b, 5, 1).unwrap(), "SIGKILL drops the lock");
        let _ = std::fs::remove_file(&p);
    }
}
