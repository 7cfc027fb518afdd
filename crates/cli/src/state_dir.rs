//! `cuvisor run --state-dir DIR`: a ledger directory kept across runs, so a run can find the
//! ledger of an earlier one. A ledger keeps the limit each GPU's entry was made with, and a
//! process can only lower it (see crates/shm's `ledger`), so a run given `--memory 8Gi` on a
//! directory an earlier `--memory 1Gi` made would be held to 1 GiB without a word. Instead:
//!
//! - DIR is this user's alone: made 0700 if missing; one that exists must be a directory of
//!   this user (not a symbolic link) that no one else can write (crates/shm's
//!   `mapped::open_dir`, `Access::Private`, as the library checks it).
//! - When no process holds the ledger (no live lease, see crates/shm's `lease`) and no other
//!   `cuvisor run` uses DIR, the run's limits apply: whatever ledger is there (its charges are
//!   all of dead processes) is removed, and the library makes a fresh one with the limits given.
//! - When one does, the run joins it only under the same limits (the memory quota and the
//!   compute policy, as recorded in [`LIMITS`], and no GPU entry of the ledger holding another
//!   limit); otherwise it is refused, naming the live processes and the limits they run under.
//!
//! Every run on DIR holds a shared lock on byte [`LIVE`] of [`LOCK`] for its whole life, and
//! decides the above holding byte [`GATE`] exclusively (waited for at most crates/shm's
//! `mapped::LOCK_WAIT`), so two runs starting at once cannot both take DIR for their own limits.
//! These are OFD locks (`lease`): the kernel drops them when cuvisor dies, however it dies.
//! Processes started outside `cuvisor run` with `CUVISOR_STATE_DIR=DIR` take no part but their
//! ledger leases; one that starts while a run decides may find its ledger removed under it.

use crate::{Failure, Result};
use cuvisor_shm::lease;
use cuvisor_shm::ledger::{self, Ledger, BYTES_MASK};
use cuvisor_shm::mapped::{self, Access};
use cuvisor_shm::quantity::MemoryLimit;
use std::fs::File;
use std::os::fd::AsRawFd as _;
use std::os::unix::fs::FileExt as _;
use std::path::Path;
use std::time::{Duration, Instant};

/// The lock file in DIR.
pub const LOCK: &str = "cuvisor-run.lock";
/// What the runs holding DIR run under: `memory = ...`, `compute = ...` (and `pid = ...`).
pub const LIMITS: &str = "cuvisor-run.limits";
/// The byte of [`LOCK`] held exclusively while a run decides.
const GATE: usize = 0;
/// The byte of [`LOCK`] every run on DIR holds shared for its life.
const LIVE: usize = 1;
/// The largest [`LIMITS`] file read.
const MAX_LIMITS: usize = 4096;

/// The limits a run gives the command.
pub struct Limits<'a> {
    /// None: `--compute` alone, memory not limited.
    pub memory: Option<&'a MemoryLimit>,
    /// The compute policy as the command gets it (`--compute`, else the environment's
    /// `CUVISOR_COMPUTE`, else "default").
    pub compute: String,
}

impl Limits<'_> {
    /// The lines of [`LIMITS`] that must match for a run to join.
    fn lines(&self) -> String {
        let memory = self
            .memory
            .map_or_else(|| "none".to_string(), |m| m.to_string());
        format!("memory = {memory}\ncompute = {}\n", self.compute)
    }

    /// Whether a ledger GPU entry's limit is one these limits give.
    fn grants(&self, limit: u64) -> bool {
        match self.memory {
            None => limit == BYTES_MASK,
            Some(MemoryLimit::All(b)) => limit == (*b).min(BYTES_MASK),
            Some(MemoryLimit::PerDevice(v)) => v.iter().any(|(_, b)| limit == (*b).min(BYTES_MASK)),
        }
    }
}

/// DIR, held by this run: the lock is held while this lives.
pub struct Held {
    _lock: File,
}

/// Takes DIR for a run under `want` (see the module's doc), or says why not.
pub fn claim(dir: &Path, want: &Limits) -> Result<Held> {
    let fail = |why: String| Failure::Runtime(format!("--state-dir {}: {why}", dir.display()));
    let d = mapped::open_dir(dir, Access::Private, true)
        .map_err(|e| Failure::Runtime(format!("--state-dir {e}")))?;
    let lock = mapped::open_in(&d, LOCK, Access::Private, true)
        .map_err(|e| fail(format!("{LOCK}: {e}")))?;
    let deadline = Instant::now() + mapped::LOCK_WAIT;
    loop {
        match lease::try_hold(&lock, GATE, false) {
            Ok(true) => break,
            Ok(false) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
            Ok(false) => {
                return Err(fail(format!(
                    "another cuvisor run kept {LOCK} locked for {:?}",
                    mapped::LOCK_WAIT
                )))
            }
            Err(e) => return Err(fail(format!("{LOCK}: {e}"))),
        }
    }
    let decided = decide(dir, &d, &lock, want).map_err(fail);
    if decided.is_ok() && !lease::try_hold(&lock, LIVE, true).unwrap_or(false) {
        lease::release(&lock, GATE);
        return Err(fail(format!("{LOCK}: cannot be held")));
    }
    lease::release(&lock, GATE);
    decided.map(|()| Held { _lock: lock })
}

/// Under the gate: whether this run may go on, and the ledger made ready for it.
fn decide(dir: &Path, d: &File, lock: &File, want: &Limits) -> std::result::Result<(), String> {
    let other_run = lease::held(lock, LIVE, 1).unwrap_or(true);
    let ledger_live = ledger::any_alive(dir).unwrap_or(true);
    if !other_run && !ledger_live {
        // Nobody uses the ledger: this run's limits apply, on a fresh ledger.
        let name = std::ffi::CString::new(ledger::FILE_NAME).map_err(|e| e.to_string())?;
        // SAFETY: a directory descriptor we hold and a NUL-terminated name.
        if unsafe { libc::unlinkat(d.as_raw_fd(), name.as_ptr(), 0) } != 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::NotFound {
                return Err(format!("cannot remove the old ledger: {e}"));
            }
        }
        return write_limits(d, want).map_err(|e| format!("{LIMITS}: {e}"));
    }
    let recorded = read_limits(d);
    let lines = recorded.as_deref().map(|t| {
        t.lines()
            .filter(|l| l.starts_with("memory =") || l.starts_with("compute ="))
            .map(|l| format!("{l}\n"))
            .collect::<String>()
    });
    let ledger = Ledger::open(&dir.join(ledger::FILE_NAME), false).ok();
    let held_other: Vec<u64> = ledger.as_ref().map_or_else(Vec::new, |l| {
        l.devices()
            .map(|(_, _, e)| e.limit.load(std::sync::atomic::Ordering::Acquire))
            .filter(|&limit| !want.grants(limit))
            .collect()
    });
    if lines.as_deref() == Some(want.lines().as_str()) && held_other.is_empty() {
        // The same limits: joined (named in the file as the latest run holding it).
        let _ = write_limits(d, want);
        return Ok(());
    }
    let mut holders: Vec<String> = Vec::new();
    if other_run {
        let pid = recorded.as_deref().and_then(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix("pid = "))
                .map(str::to_string)
        });
        holders.push(match pid {
            Some(p) => format!("cuvisor run (pid {p})"),
            None => "another cuvisor run".into(),
        });
    }
    if let Some(l) = &ledger {
        let pids: Vec<String> = l.live_procs().map(|(pid, _)| pid.to_string()).collect();
        if !pids.is_empty() {
            holders.push(format!("process {}", pids.join(", ")));
        }
    }
    if holders.is_empty() {
        holders.push("a live process".into());
    }
    let theirs = match &lines {
        Some(l) if !l.is_empty() => l.trim_end().replace('\n', ", "),
        _ => "limits cuvisor run did not record".into(),
    };
    let limits: Vec<String> = held_other.iter().map(|b| b.to_string()).collect();
    let ledger_says = if limits.is_empty() {
        String::new()
    } else {
        format!("; its ledger holds GPUs to {} bytes", limits.join(", "))
    };
    Err(format!(
        "in use by {} under other limits ({theirs}{ledger_says}), not this run's ({}): wait \
         for them to end, give the same limits, or another --state-dir",
        holders.join(" and "),
        want.lines().trim_end().replace('\n', ", ")
    ))
}

fn read_limits(d: &File) -> Option<String> {
    let f = mapped::open_in(d, LIMITS, Access::Private, false).ok()?;
    let mut buf = vec![0u8; MAX_LIMITS];
    let n = mapped::read_head(&f, &mut buf).ok()?;
    buf.truncate(n);
    String::from_utf8(buf).ok()
}

fn write_limits(d: &File, want: &Limits) -> std::io::Result<()> {
    let f = mapped::open_in(d, LIMITS, Access::Private, true)?;
    let text = format!(
        "# the limits of the cuvisor runs that hold this directory's ledger\n{}pid = {}\n",
        want.lines(),
        std::process::id()
    );
    f.set_len(0)?;
    f.write_all_at(text.as_bytes(), 0)
}
