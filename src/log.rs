//! One-line messages on stderr, prefixed "cuvisor: ". The level comes from `CUVISOR_LOG`
//! (error, warn, info, debug; default warn), read once at load. Never called on a hot path
//! except for a refusal, which is rate-limited by its caller.

use std::io::Write;
use std::sync::atomic::{AtomicU8, Ordering::Relaxed};

static LEVEL: AtomicU8 = AtomicU8::new(1);

pub fn set_level_from_env(v: Option<String>) {
    let level = match v.as_deref().map(str::trim) {
        Some("error") => 0,
        None | Some("") | Some("warn") => 1,
        Some("info") => 2,
        Some("debug") => 3,
        Some(other) => {
            LEVEL.store(1, Relaxed);
            warn(&format!(
                "CUVISOR_LOG={other:?} is not error, warn, info or debug; using warn"
            ));
            return;
        }
    };
    LEVEL.store(level, Relaxed);
}

fn emit(level: u8, msg: &str) {
    if level <= LEVEL.load(Relaxed) {
        // One write call per line, so lines of several processes do not interleave.
        let _ = std::io::stderr()
            .lock()
            .write_all(format!("cuvisor: {msg}\n").as_bytes());
    }
}

pub fn error(msg: &str) {
    emit(0, msg)
}
pub fn warn(msg: &str) {
    emit(1, msg)
}
pub fn info(msg: &str) {
    emit(2, msg)
}

/// An allocation refused because the configuration is broken (fail closed), at most once a second.
pub fn refused_broken(call: &str) {
    use std::sync::atomic::AtomicU64;
    static LAST: AtomicU64 = AtomicU64::new(0);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    if LAST.swap(now, Relaxed) != now {
        if let crate::Mode::Broken(why) = crate::mode() {
            error(&format!("{call} refused: cuvisor is misconfigured ({why})"));
        }
    }
}
