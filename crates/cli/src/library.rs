//! The interception library `cuvisor run` preloads, checked before anything runs. ld.so answers
//! an LD_PRELOAD entry it cannot load with one line on stderr and runs the program anyway, with
//! no quota: a run that fails open. So the library must be
//!
//! - a regular file (never read through a FIFO or a device; see `files`),
//! - an ELF shared object (ET_DYN) of this machine's class (64/32-bit), byte order and
//!   architecture,
//! - and load: a process of its own (`cuvisor __probe-library FILE`, hidden) dlopen()s it with
//!   RTLD_NOW | RTLD_LOCAL, every symbol bound at once, and reports dlerror. cuvisor itself never
//!   loads the library: it must not interpose anything in the process that sets up the limits.
//!   Before that the probe reads the library's symbol version needs (DT_VERNEED) and refuses one
//!   that needs a newer glibc than the probe's own, naming both (`needs glibc 2.34 (GLIBC_2.34
//!   of libc.so.6); the command's libc is glibc 2.31`) rather than dlerror's "version
//!   `GLIBC_2.34' not found". The probe's glibc is the command's: it is started as the command
//!   will be, by the same ld.so with the same LD_LIBRARY_PATH, so the libc.so.6 that ld.so
//!   resolves for it is the one the command gets, and `gnu_get_libc_version()` is that libc's
//!   own answer, with no path to guess (a command with a RUNPATH of its own could still bring
//!   another libc; a static one ignores LD_PRELOAD altogether).
//!
//! The probe runs with an empty environment (no CUVISOR_* variable, so the library's constructor
//! is inert, and no LD_PRELOAD) but the LD_LIBRARY_PATH the command will get, and is given
//! [`PROBE_TIMEOUT`] to answer.

use crate::child;
use crate::files::{self, Links, NotOpened};
use cuvisor_elf_needs::GlibcVersion;
use std::ffi::{CStr, CString, OsStr};
use std::io::Read as _;
use std::os::unix::ffi::OsStrExt as _;
use std::os::unix::process::ExitStatusExt as _;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The hidden subcommand that loads a library in a process of its own.
pub const PROBE: &str = "__probe-library";

/// How long the probe may take to load the library (its constructors included).
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(10);

const ET_DYN: u16 = 3;
#[cfg(target_pointer_width = "64")]
const CLASS: (u8, &str) = (2, "64-bit");
#[cfg(target_pointer_width = "32")]
const CLASS: (u8, &str) = (1, "32-bit");
#[cfg(target_endian = "little")]
const DATA: (u8, &str) = (1, "little-endian");
#[cfg(target_endian = "big")]
const DATA: (u8, &str) = (2, "big-endian");
#[cfg(target_arch = "x86_64")]
const MACHINE: Option<u16> = Some(62);
#[cfg(target_arch = "aarch64")]
const MACHINE: Option<u16> = Some(183);
#[cfg(target_arch = "x86")]
const MACHINE: Option<u16> = Some(3);
#[cfg(target_arch = "arm")]
const MACHINE: Option<u16> = Some(40);
#[cfg(target_arch = "riscv64")]
const MACHINE: Option<u16> = Some(243);
#[cfg(target_arch = "powerpc64")]
const MACHINE: Option<u16> = Some(21);
#[cfg(target_arch = "s390x")]
const MACHINE: Option<u16> = Some(22);
/// Elsewhere the architecture is left to the probe.
#[cfg(not(any(
    target_arch = "x86_64",
    target_arch = "aarch64",
    target_arch = "x86",
    target_arch = "arm",
    target_arch = "riscv64",
    target_arch = "powerpc64",
    target_arch = "s390x"
)))]
const MACHINE: Option<u16> = None;

/// An ELF `e_machine` as people name it.
fn machine_name(m: u16) -> String {
    let name = match m {
        3 => "i386",
        21 => "PowerPC64",
        22 => "s390",
        40 => "ARM",
        62 => "x86-64",
        183 => "AArch64",
        243 => "RISC-V",
        _ => return format!("ELF machine {m}"),
    };
    format!("{name} (ELF machine {m})")
}

/// Why `path` cannot be the library, or Ok. `ld_library_path`: the command's LD_LIBRARY_PATH,
/// where the library's own dependencies are looked for.
pub fn check(path: &Path, ld_library_path: Option<&OsStr>) -> Result<(), String> {
    let file = files::open_regular(path, Links::Follow).map_err(|e| match e {
        NotOpened::Missing => "no such file".to_string(),
        NotOpened::Refused(why) => why,
    })?;
    let mut head = [0u8; 64];
    let got = files::read_head(&file, &mut head).map_err(|e| format!("cannot read: {e}"))?;
    check_elf(&head[..got])?;
    probe(path, ld_library_path)
}

/// The ELF header's verdict: an ET_DYN object this machine can load.
fn check_elf(head: &[u8]) -> Result<(), String> {
    if head.len() < 4 || head[..4] != *b"\x7fELF" {
        return Err("not an ELF file, so not a shared library".into());
    }
    // e_ident: class, byte order; then e_type and e_machine, in that byte order.
    let too_short = || "too short for an ELF header".to_string();
    let class = *head.get(4).ok_or_else(too_short)?;
    if class != CLASS.0 {
        let theirs = match class {
            1 => "a 32-bit",
            2 => "a 64-bit",
            _ => "an unknown-class",
        };
        return Err(format!(
            "{theirs} ELF object; this machine loads {} ones",
            CLASS.1
        ));
    }
    let data = *head.get(5).ok_or_else(too_short)?;
    if data != DATA.0 {
        return Err(format!(
            "an ELF object of the other byte order; this machine is {}",
            DATA.1
        ));
    }
    let header_len = if class == 2 { 64 } else { 52 };
    if head.len() < header_len {
        return Err(too_short());
    }
    let half = |at: usize| {
        let b = [head[at], head[at + 1]];
        if data == 1 {
            u16::from_le_bytes(b)
        } else {
            u16::from_be_bytes(b)
        }
    };
    let e_type = half(16);
    if e_type != ET_DYN {
        let what = match e_type {
            1 => "a relocatable object (ET_REL)".to_string(),
            2 => "an executable (ET_EXEC)".to_string(),
            4 => "a core dump (ET_CORE)".to_string(),
            t => format!("an ELF file of type {t}"),
        };
        return Err(format!("{what}, not a shared object (ET_DYN)"));
    }
    let e_machine = half(18);
    if let Some(ours) = MACHINE.filter(|&m| m != e_machine) {
        return Err(format!(
            "a shared object for {}; this machine is {}",
            machine_name(e_machine),
            machine_name(ours)
        ));
    }
    Ok(())
}

/// Loads the library in `cuvisor __probe-library`, which says on stdout why it does not load.
fn probe(path: &Path, ld_library_path: Option<&OsStr>) -> Result<(), String> {
    let exe = std::env::current_exe()
        .map_err(|e| format!("cannot find this executable to load it with: {e}"))?;
    let mut cmd = Command::new(exe);
    cmd.arg(PROBE)
        .arg(path)
        .env_clear()
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    if let Some(p) = ld_library_path.filter(|p| !p.is_empty()) {
        cmd.env("LD_LIBRARY_PATH", p);
    }
    child::die_with_parent(&mut cmd);
    let mut probe = cmd
        .spawn()
        .map_err(|e| format!("cannot start a process to load it in: {e}"))?;
    let started = Instant::now();
    let mut pause = Duration::from_millis(1);
    let status = loop {
        match probe.try_wait() {
            Ok(Some(s)) => break s,
            Ok(None) if started.elapsed() >= PROBE_TIMEOUT => {
                let _ = probe.kill();
                let _ = probe.wait();
                return Err(format!(
                    "did not finish loading within {} s",
                    PROBE_TIMEOUT.as_secs()
                ));
            }
            Ok(None) => {
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(20));
            }
            Err(e) => return Err(format!("waiting for the process loading it: {e}")),
        }
    };
    let mut said = String::new();
    if let Some(out) = probe.stdout.take() {
        let _ = out.take(4096).read_to_string(&mut said);
    }
    let said = said.trim();
    if status.success() {
        return Ok(());
    }
    // dlerror starts with the path; the message names it already.
    let shown = path.display().to_string();
    let said = said
        .strip_prefix(&shown)
        .and_then(|s| s.strip_prefix(": "))
        .unwrap_or(said);
    match status.signal() {
        Some(sig) => Err(format!(
            "does not load: loading it killed the process (signal {sig})"
        )),
        None if said.is_empty() => Err(format!("does not load ({status})")),
        // The probe's own verdicts: a library that needs a newer glibc, or one that loads but
        // is not libcuvisor (or another version of it).
        None if said.starts_with("needs glibc")
            || said.starts_with("loads, but")
            || said.starts_with("is libcuvisor") =>
        {
            Err(said.to_string())
        }
        None => Err(format!("does not load: {said}")),
    }
}

/// `cuvisor __probe-library FILE`: dlopen FILE with RTLD_NOW | RTLD_LOCAL in this process; exit
/// 0 when it loads, else dlerror's message on stdout and exit 1.
pub fn probe_main(path: &Path) -> (String, u8) {
    let Ok(c) = CString::new(path.as_os_str().as_bytes()) else {
        return ("the path holds a NUL byte\n".into(), 1);
    };
    if let Some(why) = glibc_too_old(path) {
        return (format!("{why}\n"), 1);
    }
    // SAFETY: a NUL-terminated path. dlopen runs the library's constructors here, in a process
    // that exists for nothing else (environment emptied by `probe`).
    let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if !handle.is_null() {
        // SAFETY: a live handle and a NUL-terminated name; the symbol is only read as a u32,
        // which libcuvisor defines it as.
        let marker = unsafe { libc::dlsym(handle, c"cuvisor_ledger_version".as_ptr()) };
        if marker.is_null() {
            return (
                "loads, but is not libcuvisor (no cuvisor_ledger_version symbol): the command \
                 would run with no quota\n"
                    .into(),
                1,
            );
        }
        // SAFETY: as above: a u32 static of the library, mapped while the handle lives.
        let v = unsafe { *(marker as *const u32) };
        if v != cuvisor_shm::ledger::VERSION {
            return (
                format!(
                    "is libcuvisor for ledger version {v}, this cuvisor speaks {}: build them \
                     together\n",
                    cuvisor_shm::ledger::VERSION
                ),
                1,
            );
        }
        return (String::new(), 0);
    }
    // SAFETY: dlerror returns null or a NUL-terminated string valid until the next dl* call on
    // this thread; it is copied at once.
    let why = unsafe {
        let e = libc::dlerror();
        if e.is_null() {
            "dlopen failed without saying why".to_string()
        } else {
            CStr::from_ptr(e).to_string_lossy().into_owned()
        }
    };
    (format!("{why}\n"), 1)
}

/// The largest library the version check reads (libcuvisor.so is about 10 MiB with its debug
/// lines); a larger file is left to dlopen, which says what it says.
const MAX_READ: u64 = 512 << 20;

/// This process's glibc, as glibc itself says (`gnu_get_libc_version`).
fn running_glibc() -> Option<GlibcVersion> {
    // SAFETY: gnu_get_libc_version takes nothing and returns a pointer to a static,
    // NUL-terminated string in glibc (never freed).
    let v = unsafe { CStr::from_ptr(libc::gnu_get_libc_version()) };
    GlibcVersion::parse(v.to_str().ok()?)
}

/// Why the library at `path` cannot load against this process's glibc: a symbol version it
/// needs (`GLIBC_2.34`) is newer than the glibc here. None when it can, or when the file cannot
/// be read as ELF (dlopen then says why).
fn glibc_too_old(path: &Path) -> Option<String> {
    let file = files::open_regular(path, Links::Follow).ok()?;
    let mut bytes = Vec::new();
    (&file).take(MAX_READ).read_to_end(&mut bytes).ok()?;
    let needs = cuvisor_elf_needs::parse(&bytes).ok()?;
    let here = running_glibc()?;
    glibc_verdict(&needs, here)
}

/// The verdict on a library's needs against a glibc: the newest need beyond it, both named.
fn glibc_verdict(needs: &cuvisor_elf_needs::Dynamic, glibc: GlibcVersion) -> Option<String> {
    let (newest, need) = needs.newest_glibc_needed()?;
    (newest > glibc).then(|| {
        format!(
            "needs glibc {newest} ({} of {}); the command's libc is glibc {glibc}",
            need.version, need.file
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An ELF header of this machine, with the given type.
    fn header(e_type: u16) -> Vec<u8> {
        let mut h = vec![0u8; 64];
        h[..4].copy_from_slice(b"\x7fELF");
        h[4] = CLASS.0;
        h[5] = DATA.0;
        h[6] = 1;
        let put = |h: &mut Vec<u8>, at: usize, v: u16| {
            let b = if DATA.0 == 1 {
                v.to_le_bytes()
            } else {
                v.to_be_bytes()
            };
            h[at..at + 2].copy_from_slice(&b);
        };
        put(&mut h, 16, e_type);
        put(&mut h, 18, MACHINE.unwrap_or(0));
        h
    }

    #[test]
    fn a_library_needing_a_newer_glibc_is_named_with_both_versions() {
        let need = |file: &str, version: &str| cuvisor_elf_needs::VersionNeed {
            file: file.into(),
            version: version.into(),
        };
        let lib = cuvisor_elf_needs::Dynamic {
            needed: vec!["libc.so.6".into(), "libdl.so.2".into()],
            version_needs: vec![
                need("libc.so.6", "GLIBC_2.2.5"),
                need("libc.so.6", "GLIBC_2.34"),
                need("libdl.so.2", "GLIBC_2.3.4"),
                need("libc.so.6", "GLIBC_PRIVATE"),
            ],
            ..Default::default()
        };
        assert_eq!(
            glibc_verdict(&lib, GlibcVersion::new(2, 31)).as_deref(),
            Some("needs glibc 2.34 (GLIBC_2.34 of libc.so.6); the command's libc is glibc 2.31")
        );
        assert_eq!(glibc_verdict(&lib, GlibcVersion::new(2, 34)), None);
        assert_eq!(glibc_verdict(&lib, GlibcVersion::new(2, 36)), None);
        assert_eq!(
            glibc_verdict(
                &cuvisor_elf_needs::Dynamic::default(),
                GlibcVersion::new(2, 17)
            ),
            None
        );
        assert!(running_glibc().is_some_and(|v| v >= GlibcVersion::new(2, 17)));
    }

    #[test]
    fn only_shared_objects_of_this_machine_pass_the_header_check() {
        assert!(check_elf(&header(ET_DYN)).is_ok());
        assert_eq!(
            check_elf(b"localhost\n").unwrap_err(),
            "not an ELF file, so not a shared library"
        );
        assert_eq!(
            check_elf(&header(ET_DYN)[..20]).unwrap_err(),
            "too short for an ELF header"
        );
        assert_eq!(
            check_elf(&header(2)).unwrap_err(),
            "an executable (ET_EXEC), not a shared object (ET_DYN)"
        );
        assert_eq!(
            check_elf(&header(1)).unwrap_err(),
            "a relocatable object (ET_REL), not a shared object (ET_DYN)"
        );
        let mut other_class = header(ET_DYN);
        other_class[4] = 3 - CLASS.0;
        assert!(check_elf(&other_class)
            .unwrap_err()
            .ends_with(&format!("ELF object; this machine loads {} ones", CLASS.1)));
        let mut other_order = header(ET_DYN);
        other_order[5] = 3 - DATA.0;
        assert!(check_elf(&other_order)
            .unwrap_err()
            .starts_with("an ELF object of the other byte order"));
        if let Some(ours) = MACHINE {
            let mut other = header(ET_DYN);
            let m = if ours == 40 { 62u16 } else { 40u16 };
            let b = if DATA.0 == 1 {
                m.to_le_bytes()
            } else {
                m.to_be_bytes()
            };
            other[18..20].copy_from_slice(&b);
            assert_eq!(
                check_elf(&other).unwrap_err(),
                format!(
                    "a shared object for {}; this machine is {}",
                    machine_name(m),
                    machine_name(ours)
                )
            );
        }
    }
}
