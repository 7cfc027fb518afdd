//! libcuvisor.so: loaded into every process of a container (LD_PRELOAD, /etc/ld.so.preload), it
//! interposes the CUDA driver API and NVML to hold the container to its device-memory quota.
//!
//! - `config`: the limits file and environment, read once at load.
//! - `quota`: the memory ledger's rules, plain Rust.
//! - `timeslice`: compute time slices (token buckets in GPU time over a per-GPU coordinator).
//! - `hook`: symbol interposition only (exported wrappers, dlsym, cuGetProcAddress).
//!
//! Modes: nothing configured = pure pass-through; a configuration that cannot be read or makes no
//! sense = every allocation refused with one clear line on stderr (fail closed), never unlimited.

mod config;
mod hook;
mod log;
mod quota;
mod timeslice;

use cuvisor_shm::CONTAINER_LIMITS;
use std::path::Path;
use std::sync::OnceLock;

pub enum Mode {
    /// No limits configured: every call goes straight to the driver.
    PassThrough,
    Enforce(Box<quota::Quota>),
    /// Misconfigured: allocations are refused, with this reason.
    Broken(String),
}

/// Says "this is libcuvisor" to `cuvisor run`, which refuses to preload a library without it
/// (any loadable shared object would otherwise run the command with no quota). The value is the
/// ledger layout this build speaks.
#[no_mangle]
#[allow(non_upper_case_globals)]
pub static cuvisor_ledger_version: u32 = cuvisor_shm::ledger::VERSION;

static MODE: OnceLock<Mode> = OnceLock::new();
static COMPUTE: OnceLock<Option<timeslice::Compute>> = OnceLock::new();

/// The compute policy, when launches are to be throttled (decided with the mode).
#[inline]
pub fn compute() -> Option<&'static timeslice::Compute> {
    if let Some(c) = COMPUTE.get() {
        return c.as_ref();
    }
    COMPUTE
        .get_or_init(|| match mode() {
            Mode::Enforce(q) => {
                let cc = config::load_compute(&environment, Path::new(CONTAINER_LIMITS));
                for e in &cc.errors {
                    log::error(e);
                }
                timeslice::Compute::new(cc, q.config.clone(), &q.ledger)
            }
            _ => None,
        })
        .as_ref()
}

/// The mode, decided at load time (or on first use, if a program calls in before our
/// constructor ran, e.g. from another library's constructor).
pub fn mode() -> &'static Mode {
    MODE.get_or_init(decide)
}

/// The mode if it has been decided (never decides it: for code that can run while it is
/// being decided, such as a `dlopen` from inside the configuration's own loading).
pub fn mode_if_decided() -> Option<&'static Mode> {
    MODE.get()
}

/// The environment as cuvisor reads it: nothing at all in a setuid or setgid program
/// (AT_SECURE, as `secure_getenv` decides), where the caller's environment must not steer a
/// privileged process (which file it reads, where it creates directories, what it prints).
fn environment(key: &str) -> Option<std::ffi::OsString> {
    // SAFETY: getauxval has no preconditions; AT_SECURE is always defined (0 when absent).
    if unsafe { libc::getauxval(libc::AT_SECURE) } != 0 {
        return None;
    }
    std::env::var_os(key)
}

fn decide() -> Mode {
    log::set_level_from_env(environment("CUVISOR_LOG").map(|v| v.to_string_lossy().into_owned()));
    let cfg = match config::load(&environment, Path::new(CONTAINER_LIMITS)) {
        Ok(None) => return Mode::PassThrough,
        Ok(Some(c)) => c,
        // Said once, on the first refused allocation (log::refused_broken): one line.
        Err(e) => return Mode::Broken(e),
    };
    match quota::Quota::new(cfg) {
        Ok(q) => {
            log::info(&format!(
                "enforcing memory limits, ledger {}",
                q.ledger.path().display()
            ));
            Mode::Enforce(Box::new(q))
        }
        Err(e) => Mode::Broken(e),
    }
}

/// Gives this process's charges back when it exits normally (a killed process's are reclaimed
/// by whoever looks next). An extern "C" callback cannot unwind: a panic here would abort the
/// user's program at its exit, so it is caught and dropped.
extern "C" fn release_at_exit() {
    let _ = std::panic::catch_unwind(|| {
        if let Some(Mode::Enforce(q)) = MODE.get() {
            if !q.is_owner() {
                // exit() in a vfork child runs this on the parent's memory: nothing here is
                // the child's to give back or flush.
                return;
            }
        }
        if let Some(Some(c)) = COMPUTE.get() {
            c.at_exit();
        }
        if let Some(Mode::Enforce(q)) = MODE.get() {
            q.release_at_exit();
        }
    });
}

/// In the child of a fork: a process slot of its own (see `Quota::after_fork`). Behind a panic
/// boundary, as above.
extern "C" fn after_fork_in_child() {
    let _ = std::panic::catch_unwind(|| {
        if let Some(Mode::Enforce(q)) = MODE.get() {
            q.after_fork();
        }
        // Compute needs nothing: the child shares its parent's coordinator lease and state.
    });
}

#[ctor::ctor(unsafe)]
fn load() {
    // Nothing here may unwind into the loader.
    let _ = std::panic::catch_unwind(|| {
        if let Mode::Enforce(_) = mode() {
            compute(); // read the compute settings at load, not on the first launch
                       // SAFETY: registering plain extern "C" functions with no captured state.
            unsafe {
                libc::atexit(release_at_exit);
                libc::pthread_atfork(None, None, Some(after_fork_in_child));
            }
        }
    });
}
