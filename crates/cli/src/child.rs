//! Running `cuvisor run`'s command: spawn it, pass the usual signals on to it (SIGINT, SIGTERM,
//! SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2), wait, and turn how it ended into cuvisor's exit status.
//! cuvisor outlives its command under those signals, so it always gets to remove its temporary
//! state afterwards.
//!
//! The command dies with cuvisor: it is started with PR_SET_PDEATHSIG(SIGKILL), so even a
//! SIGKILLed cuvisor (which can neither pass that on nor clean up) takes it along, and a command
//! whose cuvisor died before the prctl took effect never starts (the parent it sees is not
//! cuvisor any more). This covers the command itself, not processes it starts in turn: they
//! outlive it as orphans do. (The kernel clears the death signal when the command execs a
//! set-user-ID or set-group-ID program, or one with file capabilities.)
//!
//! The process-level FFI of `run` (the library probe's dlopen is in `library`).

use crate::{Failure, Result};
use std::ffi::{OsStr, OsString};
use std::io::ErrorKind;
use std::os::unix::process::ExitStatusExt as _;
use std::process::{Command, ExitStatus};
use std::sync::atomic::{AtomicI32, Ordering::SeqCst};

/// The signals passed on to the command.
const FORWARDED: [libc::c_int; 6] = [
    libc::SIGINT,
    libc::SIGTERM,
    libc::SIGHUP,
    libc::SIGQUIT,
    libc::SIGUSR1,
    libc::SIGUSR2,
];

/// `si_code` of a signal the kernel raised itself, as the terminal does for Ctrl-C (linux
/// `include/uapi/asm-generic/siginfo.h`; the libc crate does not export it).
const SI_KERNEL: libc::c_int = 0x80;

/// The running command's pid, 0 before it starts and once it has ended.
static CHILD: AtomicI32 = AtomicI32::new(0);
/// A signal that arrived while there was no command to pass it to yet.
static PENDING: AtomicI32 = AtomicI32::new(0);

extern "C" fn forward(sig: libc::c_int, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    // Async-signal-safe only: atomics, kill(2), errno.
    // SAFETY: the kernel passes a valid siginfo to an SA_SIGINFO handler.
    if !info.is_null() && unsafe { (*info).si_code } == SI_KERNEL {
        // Raised by the terminal (Ctrl-C, Ctrl-\) for the whole foreground process group, which
        // the command is in: passing it on would deliver it twice.
        return;
    }
    // SAFETY: errno is thread-local; kill may change it and the interrupted code may read it.
    let errno = unsafe { *libc::__errno_location() };
    let pid = CHILD.load(SeqCst);
    if pid > 0 {
        // SAFETY: plain syscall.
        unsafe { libc::kill(pid, sig) };
    } else {
        PENDING.store(sig, SeqCst);
        // The command may have started between the load and the store: whoever takes PENDING
        // first delivers it (see `deliver_pending`), so it arrives exactly once.
        let pid = CHILD.load(SeqCst);
        if pid > 0 {
            let s = PENDING.swap(0, SeqCst);
            if s != 0 {
                // SAFETY: plain syscall.
                unsafe { libc::kill(pid, s) };
            }
        }
    }
    // SAFETY: as above.
    unsafe { *libc::__errno_location() = errno };
}

/// Installs the forwarding handler for the signals in [`FORWARDED`], except where one is ignored
/// (as a shell does for `cmd &`, or nohup for SIGHUP): then it stays ignored, and the command
/// inherits that.
pub fn install_forwarding() {
    for sig in FORWARDED {
        // SAFETY: sigaction with zeroed (valid) structs; the handler is async-signal-safe.
        unsafe {
            let mut old: libc::sigaction = std::mem::zeroed();
            if libc::sigaction(sig, std::ptr::null(), &mut old) != 0
                || old.sa_sigaction == libc::SIG_IGN
            {
                continue;
            }
            let mut new: libc::sigaction = std::mem::zeroed();
            new.sa_sigaction = forward as *const () as libc::sighandler_t;
            new.sa_flags = libc::SA_SIGINFO | libc::SA_RESTART;
            libc::sigemptyset(&mut new.sa_mask);
            libc::sigaction(sig, &new, std::ptr::null_mut());
        }
    }
}

fn deliver_pending(pid: i32) {
    let s = PENDING.swap(0, SeqCst);
    if s != 0 {
        // SAFETY: plain syscall.
        unsafe { libc::kill(pid, s) };
    }
}

/// Waits until `pid` has ended without reaping it, so that no signal can be forwarded to a
/// process that reuses its pid between the wait and `CHILD` being cleared.
fn wait_unreaped(pid: i32) {
    loop {
        // SAFETY: waitid into a zeroed siginfo; WNOWAIT leaves the child waitable.
        let r = unsafe {
            let mut info: libc::siginfo_t = std::mem::zeroed();
            libc::waitid(
                libc::P_PID,
                pid as libc::id_t,
                &mut info,
                libc::WEXITED | libc::WNOWAIT,
            )
        };
        if r == 0 || std::io::Error::last_os_error().kind() != ErrorKind::Interrupted {
            return;
        }
    }
}

/// Makes the process `cmd` starts die (SIGKILL) when this one does, SIGKILL included; if this
/// process is gone before that is set, the new one exits instead of running. The parent that
/// counts is the thread that spawns: call it from the thread that lives as long as cuvisor does
/// (the main thread).
pub fn die_with_parent(cmd: &mut Command) {
    use std::os::unix::process::CommandExt as _;
    // SAFETY: getpid has no preconditions.
    let parent = unsafe { libc::getpid() };
    let hook = move || {
        // SAFETY: prctl(PR_SET_PDEATHSIG) and getppid are plain syscalls, async-signal-safe, as
        // the time between fork and exec requires; nothing here allocates or takes a lock (an
        // io::Error from an errno holds no allocation).
        unsafe {
            if libc::prctl(
                libc::PR_SET_PDEATHSIG,
                libc::SIGKILL as libc::c_ulong,
                0 as libc::c_ulong,
                0 as libc::c_ulong,
                0 as libc::c_ulong,
            ) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            // Reparented already: cuvisor died before the death signal was set.
            if libc::getppid() != parent {
                return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
            }
        }
        Ok(())
    };
    // SAFETY: the hook runs between fork and exec and only makes async-signal-safe syscalls
    // (see above).
    unsafe { cmd.pre_exec(hook) };
}

/// Runs `argv` with `env` added to cuvisor's environment and `unset` removed from it, passing
/// the signals in [`FORWARDED`] on, and returns how it ended; the command dies with cuvisor
/// (see [`die_with_parent`]). A command that cannot be started is an error
/// with the shell's status (127 not found, 126 otherwise).
pub fn run(argv: &[OsString], env: &[(OsString, OsString)], unset: &[&str]) -> Result<ExitStatus> {
    let Some((program, args)) = argv.split_first() else {
        return Err(Failure::Usage("no command to run".into()));
    };
    install_forwarding();
    let mut cmd = Command::new(program);
    for k in unset {
        cmd.env_remove(k);
    }
    cmd.args(args).envs(env.iter().map(|(k, v)| (k, v)));
    die_with_parent(&mut cmd);
    let mut child = cmd.spawn().map_err(|e| launch_error(program, &e))?;
    let pid = child.id() as i32;
    CHILD.store(pid, SeqCst);
    deliver_pending(pid);
    wait_unreaped(pid);
    CHILD.store(0, SeqCst);
    child
        .wait()
        .map_err(|e| Failure::Runtime(format!("waiting for {}: {e}", program.to_string_lossy())))
}

fn launch_error(program: &OsStr, e: &std::io::Error) -> Failure {
    let name = program.to_string_lossy();
    let code = if e.kind() == ErrorKind::NotFound {
        127
    } else {
        126
    };
    let what = if e.kind() == ErrorKind::NotFound && !name.contains('/') {
        format!("{name}: command not found")
    } else {
        format!("cannot run {name}: {e}")
    };
    Failure::Launch {
        code,
        message: what,
    }
}

/// cuvisor's exit status for how the command ended: its own, or 128 + the signal that ended it.
pub fn exit_code(status: ExitStatus) -> u8 {
    if let Some(code) = status.code() {
        // An exit status is 0..=255 on Unix.
        return u8::try_from(code & 0xff).unwrap_or(1);
    }
    match status.signal() {
        Some(sig) => u8::try_from(128 + (sig & 0x7f)).unwrap_or(255),
        None => 1,
    }
}

/// "exited with status 3", "was killed by signal 9 (SIGKILL)", for --verbose.
pub fn describe(status: ExitStatus) -> String {
    if let Some(code) = status.code() {
        return format!("exited with status {code}");
    }
    match status.signal() {
        Some(sig) => {
            let name = match sig {
                libc::SIGHUP => " (SIGHUP)",
                libc::SIGINT => " (SIGINT)",
                libc::SIGQUIT => " (SIGQUIT)",
                libc::SIGABRT => " (SIGABRT)",
                libc::SIGKILL => " (SIGKILL)",
                libc::SIGSEGV => " (SIGSEGV)",
                libc::SIGPIPE => " (SIGPIPE)",
                libc::SIGTERM => " (SIGTERM)",
                _ => "",
            };
            let core = if status.core_dumped() {
                ", core dumped"
            } else {
                ""
            };
            format!("was killed by signal {sig}{name}{core}")
        }
        None => format!("ended: {status}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_map_as_a_shell_maps_them() {
        assert_eq!(exit_code(ExitStatus::from_raw(0)), 0);
        assert_eq!(exit_code(ExitStatus::from_raw(7 << 8)), 7);
        assert_eq!(exit_code(ExitStatus::from_raw(255 << 8)), 255);
        assert_eq!(exit_code(ExitStatus::from_raw(libc::SIGTERM)), 143);
        assert_eq!(exit_code(ExitStatus::from_raw(libc::SIGKILL)), 137);
        // Core dumped (0x80) keeps the signal's number.
        assert_eq!(exit_code(ExitStatus::from_raw(libc::SIGSEGV | 0x80)), 139);
        assert_eq!(
            describe(ExitStatus::from_raw(libc::SIGSEGV | 0x80)),
            "was killed by signal 11 (SIGSEGV), core dumped"
        );
        assert_eq!(
            describe(ExitStatus::from_raw(3 << 8)),
            "exited with status 3"
        );
    }

    #[test]
    fn launch_failures_use_the_shells_statuses() {
        let e = std::io::Error::from(ErrorKind::NotFound);
        let Failure::Launch { code, message } = launch_error(OsStr::new("nosuchcmd"), &e) else {
            panic!()
        };
        assert_eq!(
            (code, message.as_str()),
            (127, "nosuchcmd: command not found")
        );
        let e = std::io::Error::from(ErrorKind::PermissionDenied);
        let Failure::Launch { code, .. } = launch_error(OsStr::new("/etc/passwd"), &e) else {
            panic!()
        };
        assert_eq!(code, 126);
    }
}
