//! The plugin's life, as its exec probes see it: a small status file under the state root
//! ([`crate::layout::STATUS`]) that the running plugin rewrites every [`PERIOD`] from a task
//! of its tokio runtime (`selfcheck`), after asking its own gRPC sockets to answer; and the
//! rules by which `cuvisor-device-plugin probe` judges it.
//!
//! The file says who wrote it (pid and the process's start time, in clock ticks since boot, from
//! `/proc/<pid>/stat`), when (`CLOCK_BOOTTIME`, milliseconds: it does not jump with the wall
//! clock), and the plugin's [`Phase`]. The probe answers **alive** only when
//!
//! - the file is fresh (written within [`STALE_AFTER`]): a runtime that hangs, or a process that
//!   is stopped, stops writing it;
//! - its writer is still running: the pid exists *and* started at the recorded time, so that a
//!   file left by a previous instance is not taken for this one's (in a container the plugin is
//!   pid 1 every time; the start time tells the instances apart);
//! - the phase is not [`Phase::NotServing`] nor [`Phase::Stuck`]: a gRPC server that does not
//!   answer, or a start-up that hangs in NVML or discovery, is not alive;
//!   GetDevicePluginOptions on its socket, asked by the plugin itself, is not alive.
//!
//! and **ready** only when alive and [`Phase::Ready`]: every resource's server answers and is
//! registered with the kubelet that runs now. A plugin waiting for NVML is alive, not ready.
//!
//! No gRPC here: plain data and rules, with unit tests against a model of `/proc`.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Mutex;
use std::time::Duration;

/// How often the running plugin checks itself and rewrites its status.
pub const PERIOD: Duration = Duration::from_secs(2);
/// A status older than this is not alive (its writer does not run). A period plus the longest
/// a check of both resources may take when each answers only when asked again
/// (2 x ([`CHECK_TIMEOUT`] + 0.5 s + [`CHECK_TIMEOUT`]) = 9 s), with room to spare.
pub const STALE_AFTER: Duration = Duration::from_secs(20);
/// How long the plugin's own check of one socket may take.
pub const CHECK_TIMEOUT: Duration = Duration::from_secs(2);
/// The largest status file read.
const MAX_BYTES: u64 = 4096;

/// Where the plugin is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Phase {
    /// Configuration read; NVML, discovery and the servers not yet up.
    Starting,
    /// NVML cannot be opened (yet); trying again every `[nvml] retry_seconds`.
    WaitingForNvml,
    /// Every server answers; some resource is not registered with kubelet (yet).
    Serving,
    /// Every server answers and every resource is registered with the running kubelet.
    Ready,
    /// Some server does not answer on its socket.
    NotServing,
    /// Start-up has not moved on for longer than it may take ([`Life::with_patience`]): opening
    /// NVML or discovering the GPUs does not return (a GPU that hangs the driver). Not alive, so
    /// that kubelet starts the plugin again.
    Stuck,
}

/// The status file's content.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Status {
    pub pid: u32,
    /// The writer's start time, clock ticks after boot (`/proc/<pid>/stat`, field 22).
    pub start_ticks: u64,
    pub phase: Phase,
    /// Why the phase is what it is (the NVML error, the socket that did not answer).
    pub detail: String,
    /// When it was written: `CLOCK_BOOTTIME`, milliseconds.
    pub at_ms: u64,
}

/// What a probe asks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Need {
    Alive,
    Ready,
}

/// `CLOCK_BOOTTIME` in milliseconds: comparable between processes of one boot, and steady when
/// the wall clock is set.
pub fn boottime_ms() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Boottime);
    (t.tv_sec as u64)
        .saturating_mul(1000)
        .saturating_add(t.tv_nsec as u64 / 1_000_000)
}

/// The start time of process `pid` (clock ticks after boot), if it runs (a zombie, which has
/// exited and waits for its parent, does not).
pub fn start_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_start_ticks(&stat)
}

/// Field 22 (`starttime`) of a `/proc/<pid>/stat` line, unless field 3 (the state) says the
/// process has exited (`Z` zombie, `X` dead). The command name (field 2) is in parentheses and
/// may hold spaces and parentheses itself: fields are counted after the last ')'.
fn parse_start_ticks(stat: &str) -> Option<u64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_ascii_whitespace();
    // Fields 3.. follow: the state first; starttime is the 20th.
    if matches!(fields.next()?, "Z" | "X") {
        return None;
    }
    fields.nth(18)?.parse().ok()
}

/// This process's status in `phase`, as of now.
pub fn now(phase: Phase, detail: String) -> Status {
    let pid = std::process::id();
    Status {
        pid,
        start_ticks: start_ticks(pid).unwrap_or(0),
        phase,
        detail,
        at_ms: boottime_ms(),
    }
}

/// Writes `s` to `path` whole (a temporary file, then renamed over it).
pub fn write(path: &Path, s: &Status) -> Result<(), String> {
    let text = serde_json::to_string(s).map_err(|e| e.to_string())?;
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text + "\n").map_err(|e| format!("{}: {e}", tmp.display()))?;
    std::fs::rename(&tmp, path).map_err(|e| format!("{}: {e}", path.display()))
}

/// Reads the status at `path` (at most a few KiB).
pub fn read(path: &Path) -> Result<Status, String> {
    use std::io::Read;
    let f = std::fs::File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut text = String::new();
    f.take(MAX_BYTES)
        .read_to_string(&mut text)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))
}

/// The probe's verdict on `s` at boot time `now_ms`, where `start_ticks_of` looks a process up
/// (see the module docs): a one-line summary, or why not.
pub fn verdict(
    s: &Status,
    need: Need,
    now_ms: u64,
    start_ticks_of: impl Fn(u32) -> Option<u64>,
) -> Result<String, String> {
    let stale = STALE_AFTER.as_millis() as u64;
    if s.at_ms > now_ms.saturating_add(1000) {
        return Err(format!(
            "not alive: the status was written {} ms after now (another boot's file)",
            s.at_ms - now_ms
        ));
    }
    let age = now_ms.saturating_sub(s.at_ms);
    if start_ticks_of(s.pid) != Some(s.start_ticks) {
        return Err(format!(
            "not alive: the status was written by process {} (started at tick {}), which is \
             not running: a previous instance's file",
            s.pid, s.start_ticks
        ));
    }
    if age > stale {
        return Err(format!(
            "not alive: the status is {} s old (rewritten every {} s while the plugin's runtime \
             runs; stale after {} s)",
            age / 1000,
            PERIOD.as_secs(),
            STALE_AFTER.as_secs()
        ));
    }
    let phase = phase_name(s.phase);
    let why = if s.detail.is_empty() {
        String::new()
    } else {
        format!(": {}", s.detail)
    };
    if matches!(s.phase, Phase::NotServing | Phase::Stuck) {
        return Err(format!("not alive: {phase}{why}"));
    }
    if need == Need::Ready && s.phase != Phase::Ready {
        return Err(format!("alive, not ready: {phase}{why}"));
    }
    Ok(format!(
        "{}: {phase}{why} (process {}, status {} ms old)",
        match need {
            Need::Alive => "alive",
            Need::Ready => "ready",
        },
        s.pid,
        age
    ))
}

/// The probe: the status at `path` judged now against this machine's processes.
pub fn probe(path: &Path, need: Need) -> Result<String, String> {
    let s = read(path).map_err(|e| format!("not alive: no status: {e}"))?;
    verdict(&s, need, boottime_ms(), start_ticks)
}

fn phase_name(p: Phase) -> &'static str {
    match p {
        Phase::Starting => "starting",
        Phase::WaitingForNvml => "waiting for NVML",
        Phase::Serving => "serving, not registered with kubelet",
        Phase::Ready => "serving and registered with kubelet",
        Phase::NotServing => "a gRPC server does not answer",
        Phase::Stuck => "start-up does not move on",
    }
}

/// What the running plugin knows of itself between checks: where it is in its start-up, and
/// which resources are registered with the running kubelet (set by the server).
#[derive(Debug)]
pub struct Life {
    /// The stage, and when it was last set (`CLOCK_BOOTTIME` ms): each attempt to open NVML
    /// sets it again, so it tells how long start-up has not moved on.
    stage: Mutex<(Stage, u64)>,
    registered: Mutex<BTreeMap<String, bool>>,
    /// How long a start-up stage may stay as it is before the plugin counts as stuck; zero:
    /// forever.
    patience: Duration,
}

/// The start-up, before the servers run.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Stage {
    #[default]
    Starting,
    /// NVML cannot be opened: the reason.
    WaitingForNvml(String),
    /// The servers run: each resource's name and socket.
    Running(Vec<(String, std::path::PathBuf)>),
}

impl Default for Life {
    fn default() -> Life {
        Life::new()
    }
}

impl Life {
    /// A life starting now, never counted as stuck.
    pub fn new() -> Life {
        Life::with_patience(Duration::ZERO)
    }

    /// A life whose start-up stages (starting, waiting for NVML) count as stuck once one has
    /// stayed as it is for longer than `patience`.
    pub fn with_patience(patience: Duration) -> Life {
        Life {
            stage: Mutex::new((Stage::Starting, boottime_ms())),
            registered: Mutex::default(),
            patience,
        }
    }

    pub fn set_stage(&self, s: Stage) {
        *self.stage.lock().unwrap_or_else(|e| e.into_inner()) = (s, boottime_ms());
    }

    pub fn stage(&self) -> Stage {
        self.stage
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .0
            .clone()
    }

    /// How long a start-up stage has stayed as it is, if longer than the patience.
    pub fn stuck_for(&self) -> Option<Duration> {
        let (stage, since) = &*self.stage.lock().unwrap_or_else(|e| e.into_inner());
        let still = Duration::from_millis(boottime_ms().saturating_sub(*since));
        (!matches!(stage, Stage::Running(_)) && !self.patience.is_zero() && still > self.patience)
            .then_some(still)
    }

    /// Whether resource `name` is registered with the kubelet that runs now.
    pub fn set_registered(&self, name: &str, yes: bool) {
        self.registered
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(name.to_string(), yes);
    }

    pub fn registered(&self, name: &str) -> bool {
        self.registered
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(name)
            .copied()
            .unwrap_or(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ME: u32 = 41;
    const TICKS: u64 = 9000;

    fn status(phase: Phase, at_ms: u64) -> Status {
        Status {
            pid: ME,
            start_ticks: TICKS,
            phase,
            detail: String::new(),
            at_ms,
        }
    }

    /// A model of /proc: process ME, started at TICKS.
    fn procs(pid: u32) -> Option<u64> {
        (pid == ME).then_some(TICKS)
    }

    #[test]
    fn a_fresh_status_of_a_running_writer_is_alive_and_ready_only_when_registered() {
        let now = 1_000_000;
        assert!(verdict(&status(Phase::Ready, now - 500), Need::Ready, now, procs).is_ok());
        for p in [Phase::Starting, Phase::WaitingForNvml, Phase::Serving] {
            let s = status(p, now - 500);
            assert!(verdict(&s, Need::Alive, now, procs).is_ok(), "{p:?}");
            let e = verdict(&s, Need::Ready, now, procs).unwrap_err();
            assert!(e.starts_with("alive, not ready"), "{e}");
        }
    }

    #[test]
    fn a_status_not_rewritten_is_not_alive_hung_runtime() {
        let now = 1_000_000;
        let stale = STALE_AFTER.as_millis() as u64;
        let s = status(Phase::Ready, now - stale - 1);
        let e = verdict(&s, Need::Alive, now, procs).unwrap_err();
        assert!(e.contains("s old"), "{e}");
        assert!(verdict(&status(Phase::Ready, now - stale), Need::Alive, now, procs).is_ok());
    }

    #[test]
    fn a_file_from_a_previous_instance_is_not_alive_even_with_the_same_pid() {
        let now = 1_000_000;
        // The same pid (pid 1 in every container), another start time.
        let mut s = status(Phase::Ready, now - 100);
        s.start_ticks = TICKS - 1;
        let e = verdict(&s, Need::Alive, now, procs).unwrap_err();
        assert!(e.contains("previous instance"), "{e}");
        // A pid that is gone.
        s.pid = ME + 1;
        assert!(verdict(&s, Need::Alive, now, procs).is_err());
        // A file written "after now": from before a reboot.
        let s = status(Phase::Ready, now + 60_000);
        assert!(verdict(&s, Need::Alive, now, procs).is_err());
    }

    #[test]
    fn a_server_that_does_not_answer_is_not_alive() {
        let now = 1_000_000;
        let mut s = status(Phase::NotServing, now - 100);
        s.detail = "cuvisor.io/gpu: /dp/cuvisor-gpu.sock: timed out".into();
        let e = verdict(&s, Need::Alive, now, procs).unwrap_err();
        assert!(
            e.starts_with("not alive: ") && e.contains("timed out"),
            "{e}"
        );
    }

    #[test]
    fn start_ticks_are_read_after_the_last_parenthesis() {
        let line = "12 (a) b (c)) S 1 12 12 0 -1 4194560 1 0 0 0 0 0 0 0 20 0 1 0 777 1000 1";
        assert_eq!(parse_start_ticks(line), Some(777));
        assert_eq!(parse_start_ticks("12 (x) S 1"), None);
        let zombie = line.replace(") S ", ") Z ");
        assert_eq!(
            parse_start_ticks(&zombie),
            None,
            "an exited process does not run"
        );
        let me = std::process::id();
        assert!(start_ticks(me).is_some());
        assert_eq!(start_ticks(me), start_ticks(me));
    }

    #[test]
    fn a_written_status_reads_back_and_judges_alive_here() {
        let dir = std::env::temp_dir().join(format!("cuvisor-status-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("plugin.status");
        let s = now(Phase::Serving, "x".into());
        write(&p, &s).unwrap();
        assert_eq!(read(&p).unwrap(), s);
        assert!(probe(&p, Need::Alive).is_ok());
        assert!(probe(&p, Need::Ready).is_err());
        assert!(probe(&dir.join("none"), Need::Alive).is_err());
        let _ = std::fs::remove_dir_all(dir);
    }
}
