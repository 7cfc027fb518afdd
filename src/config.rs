//! Configuration: a read-only limits file (what the device plugin writes) and, where there is no
//! file, environment variables. Read once, at load time.
//!
//! Authority. Where the plugin mounted the limits file at its fixed in-container path
//! ([`cuvisor_shm::CONTAINER_LIMITS`]), that file alone grants: `CUVISOR_CONFIG` is not read and
//! the environment can only lower what the file says. Only where that path does not exist
//! (`cuvisor run`, tests) does `CUVISOR_CONFIG` name the file, or the environment alone decide.
//! In a setuid or setgid program (AT_SECURE) the environment is not read at all, as
//! `secure_getenv` would have it. A file is read only if it is a regular file (no FIFO, device
//! or symlink at the last component) of at most [`MAX_FILE`] bytes; an environment value that is
//! not UTF-8 is malformed. Every malformed value fails closed.
//!
//! The limits file's format is crates/shm's `limits::LimitsFile` (the plugin renders it with the
//! same type): `version`, `state_dir`, `coord_dir`, `memory` / `memory.<ordinal>` /
//! `memory.<GPU UUID>`, `context_reserve`, `compute`.
//!
//! Compute (`compute` in the file, `CUVISOR_COMPUTE` in the environment): `limit=P` caps the
//! container at P % of each GPU's time, even when the GPU is idle; `share=W` gives it weight W
//! among the containers busy on the GPU, idle time lent (work-conserving); `none` leaves
//! launches alone. Not given: a share whose weight is the container's memory fraction on that GPU
//! (quota / physical memory). With a file, the environment can only lower a file's `limit`.
//! `CUVISOR_COMPUTE` alone (no memory limit) limits compute and leaves memory unlimited. A
//! malformed compute value does not refuse memory: it is read as the smallest share
//! ([`MIN_SHARE`]: the container gets only time nobody else wants) with one line on stderr.
//!
//! Environment: `CUVISOR_MEMORY_LIMIT` ("6Gi" for every device, or "0=6Gi,1=2Gi"),
//! `CUVISOR_STATE_DIR`, `CUVISOR_CONTEXT_RESERVE`; for compute `CUVISOR_COMPUTE`,
//! `CUVISOR_COORD_DIR` and `CUVISOR_COORD_GROUP` (a group whose users share the self-service
//! coordinators). When a file is given the environment can only lower its limits. With neither
//! a file nor a limit the library passes everything through. A malformed value is an error:
//! the caller fails closed (refuses allocations), it never means "unlimited". A variable set
//! but empty or blank (`=$QUOTA` with QUOTA unset) is malformed, not unset: whoever set it meant
//! a value (a compute setting is then read as the smallest share, as any malformed one).
//!
//! Who may use the state (`Access`, crates/shm's `mapped`): with a limits file, every uid of
//! the container (the plugin made the directory for a container of several uids); with the
//! environment alone, the caller alone (0700 / 0600; another user's directory, one others can
//! write, or a symbolic link refused), or `CUVISOR_COORD_GROUP`'s group for the coordinators.

pub use cuvisor_shm::mapped::Access;
use std::path::{Path, PathBuf};

/// Sizes: "6Gi", "512Mi", "1.5Gi", "4G" (10^9), "6442450944" (one parser for every part of
/// cuvisor: crates/shm's `quantity`).
pub fn parse_quantity(text: &str) -> Result<u64, String> {
    cuvisor_shm::quantity::parse_quantity(text).map_err(|e| format!("{text:?}: {e}"))
}

pub use cuvisor_shm::limits::Target;

/// The compute policy of a container.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Compute {
    /// Launches are not throttled.
    None,
    /// At most this fraction of GPU time (0 < f <= 1).
    Limit(f64),
    /// This weight among the busy containers of a GPU.
    Share(f64),
    /// A share weighted by the memory fraction (quota / physical), per GPU.
    FromMemory,
}

/// The weight a malformed compute value is read as.
pub const MIN_SHARE: f64 = 0.001;

/// "limit=30", "share=2", "share=memory" (weighted by the memory quota's fraction), "none": the
/// grammar every part of cuvisor reads (crates/shm's `compute`).
pub fn parse_compute(text: &str) -> Result<Compute, String> {
    use cuvisor_shm::compute::{parse, ComputePolicy as P};
    match parse(text).map_err(|e| format!("{text:?}: {e}"))? {
        P::None => Ok(Compute::None),
        P::Limit(p) => Ok(Compute::Limit(p / 100.0)),
        P::Share(w) => Ok(Compute::Share(w)),
        P::ShareMemory => Ok(Compute::FromMemory),
    }
}

/// A compute value as read, or the smallest share (with the reason) when malformed.
fn compute_or_min(text: &str, what: &str, errors: &mut Vec<String>) -> Compute {
    parse_compute(text).unwrap_or_else(|e| {
        errors.push(format!(
            "{what}: {e}: using the smallest compute share ({MIN_SHARE})"
        ));
        Compute::Share(MIN_SHARE)
    })
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    /// The rules that grant memory (the file's, or the environment's when there is no file).
    pub limits: Vec<(Target, u64)>,
    /// Rules that can only lower a granted limit (the environment's, when a file is given).
    pub caps: Vec<(Target, u64)>,
    pub state_dir: PathBuf,
    /// Who may use the ledger: every uid where a limits file configures cuvisor (the device
    /// plugin made the directory for a container that may run several uids), the caller alone
    /// where the environment does (see `cuvisor_shm::mapped::Access`).
    pub state_access: Access,
    pub context_reserve: u64,
}

/// The compute settings (read next to [`Config`], from the same file and environment).
#[derive(Clone, Debug, PartialEq)]
pub struct ComputeConfig {
    pub compute: Compute,
    /// Where the GPU coordinators live (`CUVISOR_COORD_DIR`, `coord_dir` in the file).
    pub coord_dir: PathBuf,
    /// Who may use a coordinator this container lists itself on (self-service): every uid
    /// under a limits file (as before: a container of several uids), else the caller alone, or
    /// the group `CUVISOR_COORD_GROUP` names.
    pub coord_access: Access,
    /// The entries the device plugin listed the container in, by GPU (the file's `coord_slot.*`),
    /// and where their states are mounted (`coord_own_dir`): on those GPUs the board's policy
    /// holds, `compute` only caps it (see `src/timeslice`).
    pub managed: Vec<([u8; 16], u32)>,
    pub own_dir: Option<PathBuf>,
    /// Malformed compute values, read as the smallest share (to log once at load).
    pub errors: Vec<String>,
}

/// The environment as the library reads it: a value, nothing, or a value that is not UTF-8.
pub type Env<'a> = &'a dyn Fn(&str) -> Option<std::ffi::OsString>;

/// The largest limits file read.
pub const MAX_FILE: u64 = 64 << 10;

/// A variable's text, None when it is unset. Set but empty or blank (as `=$QUOTA` with QUOTA
/// unset gives) is an error naming it, as is a value that is not UTF-8: whoever set it meant
/// something, and nothing here reads "I could not read it" as "not configured".
fn var(env: Env, key: &str) -> Result<Option<String>, String> {
    match env(key) {
        None => Ok(None),
        Some(v) => match v.into_string() {
            Ok(t) if t.is_empty() => Err(format!("{key} is set but empty")),
            Ok(t) if t.trim().is_empty() => Err(format!("{key} is set but blank ({t:?})")),
            Ok(t) => Ok(Some(t)),
            Err(_) => Err(format!("{key} is not valid UTF-8")),
        },
    }
}

/// The limits file that applies, as (what names it, its text): the fixed in-container path when
/// it exists, else `CUVISOR_CONFIG`'s. None: no file.
fn limits_file(env: Env, fixed: &Path) -> Result<Option<(String, String)>, String> {
    let (name, path) = if std::fs::symlink_metadata(fixed).is_ok() {
        (fixed.display().to_string(), fixed.to_path_buf())
    } else {
        match var(env, "CUVISOR_CONFIG")? {
            None => return Ok(None),
            Some(p) => (format!("CUVISOR_CONFIG={p}"), PathBuf::from(p)),
        }
    };
    let text = read_bounded(&path).map_err(|e| format!("{name}: {e}"))?;
    Ok(Some((name, text)))
}

/// A regular file's text, at most [`MAX_FILE`] bytes, opened without blocking or following a
/// symlink.
fn read_bounded(path: &Path) -> Result<String, String> {
    use std::io::Read;
    let f = cuvisor_shm::mapped::open_regular(path, false, None).map_err(|e| e.to_string())?;
    let mut bytes = Vec::new();
    f.take(MAX_FILE + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| e.to_string())?;
    if bytes.len() as u64 > MAX_FILE {
        return Err(format!("larger than {MAX_FILE} bytes"));
    }
    String::from_utf8(bytes).map_err(|_| "not valid UTF-8".to_string())
}

/// The compute settings, once [`load`] has accepted the configuration.
pub fn load_compute(env: Env, fixed: &Path) -> ComputeConfig {
    // Not configured: a share weighted by the memory fraction on each GPU.
    let mut cc = ComputeConfig {
        compute: Compute::FromMemory,
        coord_dir: default_coord_dir(),
        coord_access: Access::Private,
        managed: Vec::new(),
        own_dir: None,
        errors: Vec::new(),
    };
    // `load` has read the same file and environment without error, or we would not be here.
    let file = limits_file(env, fixed).ok().flatten();
    if let Some(f) = file
        .as_ref()
        .and_then(|(_, text)| cuvisor_shm::limits::LimitsFile::parse(text).ok())
    {
        if let Some(c) = &f.compute {
            cc.compute = compute_or_min(c, "the limits file's compute", &mut cc.errors);
        }
        if let Some(d) = f.coord_dir {
            cc.coord_dir = d;
        }
        cc.managed = f.coord_slots;
        cc.own_dir = f.coord_own_dir;
    }
    if file.is_some() {
        cc.coord_access = Access::Shared;
    }
    let env_compute = match var(env, "CUVISOR_COMPUTE") {
        Ok(v) => v.map(|c| compute_or_min(&c, "CUVISOR_COMPUTE", &mut cc.errors)),
        Err(e) => {
            cc.errors.push(format!(
                "{e}: using the smallest compute share ({MIN_SHARE})"
            ));
            Some(Compute::Share(MIN_SHARE))
        }
    };
    if let Some(v) = env_compute {
        cc.compute = match (file.is_some(), cc.compute, v) {
            (false, _, v) => v,
            // With a file the environment can only tighten a limit.
            (true, Compute::Limit(a), Compute::Limit(b)) => Compute::Limit(a.min(b)),
            // A malformed value never loosens anything either.
            (true, _, Compute::Share(w)) if w == MIN_SHARE => Compute::Share(MIN_SHARE),
            (true, c, _) => c,
        };
    }
    if file.is_none() {
        // A coordinator directory or group that is set but cannot be read is not "the
        // default": the container is held to the smallest share, with the reason.
        let unreadable = |e: String, cc: &mut ComputeConfig| {
            cc.errors.push(format!(
                "{e}: using the smallest compute share ({MIN_SHARE})"
            ));
            cc.compute = Compute::Share(MIN_SHARE);
        };
        match var(env, "CUVISOR_COORD_DIR") {
            Ok(Some(d)) => cc.coord_dir = PathBuf::from(d),
            Ok(None) => {}
            Err(e) => unreadable(e, &mut cc),
        }
        match var(env, "CUVISOR_COORD_GROUP").and_then(|g| g.map(|g| group_id(&g)).transpose()) {
            Ok(Some(gid)) => cc.coord_access = Access::Group(gid),
            Ok(None) => {}
            Err(e) => unreadable(e, &mut cc),
        }
    }
    cc
}

/// `CUVISOR_COORD_GROUP`: a group's name or number.
fn group_id(text: &str) -> Result<u32, String> {
    let text = text.trim();
    if let Ok(gid) = text.parse::<u32>() {
        return Ok(gid);
    }
    let unknown = || format!("CUVISOR_COORD_GROUP: {text:?} is not a group on this machine");
    let name = std::ffi::CString::new(text).map_err(|_| unknown())?;
    // SAFETY: zeroed `group` is a valid out-parameter; getgrnam_r writes into it and into `buf`
    // (of the length given), and sets `found` to it or to null.
    let mut grp: libc::group = unsafe { std::mem::zeroed() };
    let mut buf = vec![0 as libc::c_char; 16 << 10];
    let mut found: *mut libc::group = std::ptr::null_mut();
    // SAFETY: as above.
    let rc = unsafe {
        libc::getgrnam_r(
            name.as_ptr(),
            &mut grp,
            buf.as_mut_ptr(),
            buf.len(),
            &mut found,
        )
    };
    if rc != 0 || found.is_null() {
        return Err(unknown());
    }
    Ok(grp.gr_gid)
}

impl Config {
    /// The limit for a device, or None if no rule names it. Several rules: the lowest wins.
    /// When rules name devices one by one, a device none of them names gets 0 (fail closed).
    pub fn limit_for(&self, ordinal: u32, uuid: &[u8; 16]) -> u64 {
        let applies = |(t, _): &&(Target, u64)| match t {
            Target::All => true,
            Target::Ordinal(o) => *o == ordinal,
            Target::Uuid(u) => u == uuid,
        };
        let granted = self
            .limits
            .iter()
            .filter(applies)
            .map(|(_, l)| *l)
            .min()
            .unwrap_or(0);
        self.caps
            .iter()
            .filter(applies)
            .map(|(_, l)| *l)
            .fold(granted, u64::min)
    }
}

/// What the environment and the limits file say. `Ok(None)`: nothing configured (pass-through).
/// `fixed`: the in-container limits path ([`cuvisor_shm::CONTAINER_LIMITS`] in production).
pub fn load(env: Env, fixed: &Path) -> Result<Option<Config>, String> {
    let file = limits_file(env, fixed)?;
    // Set but empty or blank: an error, as any unreadable limit (with a file too: the
    // environment may lower the file's limit, and one it cannot read lowers it to nothing).
    let env_limit = var(env, "CUVISOR_MEMORY_LIMIT")?;
    let env_reserve = var(env, "CUVISOR_CONTEXT_RESERVE")?;
    // A malformed compute value (not UTF-8, empty) is `load_compute`'s to read as the smallest
    // share; here it only says that something is configured.
    let env_compute = var(env, "CUVISOR_COMPUTE").unwrap_or_else(|_| Some(String::new()));
    // Read only where it is used (a file names its own ledger directory). Set but empty it is
    // an error, not the per-user default, which is another quota's ledger.
    let env_dir = match &file {
        None => var(env, "CUVISOR_STATE_DIR")?.map(PathBuf::from),
        Some(_) => None,
    };
    let mut cfg = match &file {
        Some((name, text)) => parse_file(text).map_err(|e| format!("{name}: {e}"))?,
        None if env_limit.is_none() && env_compute.is_none() => return Ok(None),
        None => Config {
            // Compute alone: memory is not limited.
            limits: if env_limit.is_none() {
                vec![(Target::All, u64::MAX)]
            } else {
                Vec::new()
            },
            caps: Vec::new(),
            state_dir: env_dir.unwrap_or_else(default_state_dir),
            state_access: Access::Private,
            context_reserve: 0,
        },
    };
    if let Some(l) = &env_limit {
        let rules = parse_env_limits(l).map_err(|e| format!("CUVISOR_MEMORY_LIMIT: {e}"))?;
        // With a file the environment can only lower what the file grants.
        if file.is_some() {
            cfg.caps.extend(rules);
        } else {
            cfg.limits.extend(rules);
        }
    }
    if let Some(r) = &env_reserve {
        let v = parse_quantity(r).map_err(|e| format!("CUVISOR_CONTEXT_RESERVE: {e}"))?;
        cfg.context_reserve = if file.is_some() {
            cfg.context_reserve.max(v)
        } else {
            v
        };
    }
    Ok(Some(cfg))
}

/// Where the ledger lives when nothing says: one per user, so all of a user's processes that are
/// not given a state directory share one quota.
fn default_state_dir() -> PathBuf {
    // SAFETY: getuid has no preconditions.
    let uid = unsafe { libc::getuid() };
    std::env::temp_dir().join(format!("cuvisor-{uid}"))
}

/// Where GPU coordinators live when nothing says: one directory per user, so that every
/// `cuvisor run` of a user on one machine shares each GPU's coordinator.
fn default_coord_dir() -> PathBuf {
    // SAFETY: getuid has no preconditions.
    let uid = unsafe { libc::getuid() };
    std::env::temp_dir().join(format!("cuvisor-coord-{uid}"))
}

fn parse_env_limits(text: &str) -> Result<Vec<(Target, u64)>, String> {
    use cuvisor_shm::quantity::MemoryLimit;
    Ok(
        match MemoryLimit::parse(text).map_err(|e| format!("{text:?}: {e}"))? {
            MemoryLimit::All(bytes) => vec![(Target::All, bytes)],
            MemoryLimit::PerDevice(list) => list
                .into_iter()
                .map(|(o, b)| (Target::Ordinal(o), b))
                .collect(),
        },
    )
}

pub use cuvisor_shm::uuid::parse as parse_uuid;

/// The limits file's memory settings (crates/shm's `LimitsFile`, which the plugin renders).
fn parse_file(text: &str) -> Result<Config, String> {
    let f = cuvisor_shm::limits::LimitsFile::parse(text)?;
    Ok(Config {
        limits: f.memory,
        caps: Vec::new(),
        state_dir: f.state_dir,
        state_access: Access::Shared,
        context_reserve: f.context_reserve.unwrap_or(0),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    use std::ffi::OsString;

    fn env(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<OsString> {
        let m: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| m.get(k).map(OsString::from)
    }

    /// No fixed in-container file: as outside a plugin-made container.
    const NO_FIXED: &str = "/nonexistent/cuvisor-test/limits.conf";

    fn load(e: impl Fn(&str) -> Option<OsString>) -> Result<Option<Config>, String> {
        super::load(&e, Path::new(NO_FIXED))
    }

    fn load_compute(e: impl Fn(&str) -> Option<OsString>) -> ComputeConfig {
        super::load_compute(&e, Path::new(NO_FIXED))
    }

    #[test]
    fn quantities_and_their_errors() {
        assert_eq!(parse_quantity("6Gi").unwrap(), 6 << 30);
        assert_eq!(parse_quantity("512Mi").unwrap(), 512 << 20);
        assert_eq!(parse_quantity("6442450944").unwrap(), 6 << 30);
        assert_eq!(parse_quantity("4G").unwrap(), 4_000_000_000);
        assert!(parse_quantity("4GB")
            .unwrap_err()
            .contains("unknown unit \"GB\""));
        assert!(parse_quantity("").unwrap_err().contains("empty"));
        assert!(parse_quantity("-1Gi").is_err());
        assert!(parse_quantity("1e30").is_err());
    }

    #[test]
    fn compute_policies_and_their_safe_reading() {
        assert_eq!(parse_compute("limit=30"), Ok(Compute::Limit(0.3)));
        assert_eq!(parse_compute(" share = 2 "), Ok(Compute::Share(2.0)));
        assert_eq!(parse_compute("none"), Ok(Compute::None));
        for bad in [
            "limit=0",
            "limit=130",
            "share=-1",
            "share=x",
            "fair=2",
            "30",
        ] {
            assert!(parse_compute(bad).is_err(), "{bad}");
        }
        let e = env(&[("CUVISOR_MEMORY_LIMIT", "1Gi")]);
        assert_eq!(
            load_compute(e).compute,
            Compute::FromMemory,
            "memory only: a share weighted by the memory fraction"
        );
        assert_eq!(parse_compute("share=memory").unwrap(), Compute::FromMemory);
        let e = env(&[("CUVISOR_COMPUTE", "limit=30")]);
        let c = load(&e).unwrap().unwrap();
        assert_eq!(
            c.limit_for(0, &[0; 16]),
            u64::MAX,
            "compute alone: memory unlimited"
        );
        assert_eq!(load_compute(&e).compute, Compute::Limit(0.3));
        let e = env(&[
            ("CUVISOR_MEMORY_LIMIT", "1Gi"),
            ("CUVISOR_COMPUTE", "limit=300"),
            ("CUVISOR_COORD_DIR", "/c"),
        ]);
        let c = load_compute(&e);
        assert_eq!(
            c.compute,
            Compute::Share(MIN_SHARE),
            "malformed: the smallest share"
        );
        assert!(c.errors[0].contains("CUVISOR_COMPUTE"));
        assert_eq!(c.coord_dir, PathBuf::from("/c"));
        assert_eq!(load(&e).unwrap().unwrap().limit_for(0, &[0; 16]), 1 << 30);

        let dir = std::env::temp_dir().join(format!("cuvisor-config-c-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("limits");
        std::fs::write(
            &f,
            "version = 1\nstate_dir = /s\nmemory = 1Gi\ncompute = limit=30\ncoord_dir = /k\n",
        )
        .unwrap();
        let path = f.to_str().unwrap();
        let e = env(&[("CUVISOR_CONFIG", path), ("CUVISOR_COMPUTE", "limit=20")]);
        assert!(load(&e).is_ok());
        let c = load_compute(&e);
        assert_eq!(
            c.compute,
            Compute::Limit(0.2),
            "the environment may tighten"
        );
        assert_eq!(c.coord_dir, PathBuf::from("/k"));
        let e = env(&[("CUVISOR_CONFIG", path), ("CUVISOR_COMPUTE", "share=9")]);
        assert_eq!(load_compute(&e).compute, Compute::Limit(0.3), "not loosen");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn nothing_configured_is_pass_through() {
        assert_eq!(load(env(&[])).unwrap(), None);
        assert_eq!(load(env(&[("CUVISOR_STATE_DIR", "/x")])).unwrap(), None);
    }

    #[test]
    fn env_limits_for_all_or_per_device() {
        let c = load(env(&[
            ("CUVISOR_MEMORY_LIMIT", "6Gi"),
            ("CUVISOR_STATE_DIR", "/s"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(c.limit_for(3, &[0; 16]), 6 << 30);
        assert_eq!(c.state_dir, PathBuf::from("/s"));
        let c = load(env(&[("CUVISOR_MEMORY_LIMIT", "0=6Gi,1=2Gi")]))
            .unwrap()
            .unwrap();
        assert_eq!(c.limit_for(0, &[0; 16]), 6 << 30);
        assert_eq!(c.limit_for(1, &[0; 16]), 2 << 30);
        assert_eq!(
            c.limit_for(2, &[0; 16]),
            0,
            "a device no rule names gets nothing: fail closed"
        );
        assert!(load(env(&[("CUVISOR_MEMORY_LIMIT", "4GB")]))
            .unwrap_err()
            .contains("unknown unit"));
        assert!(load(env(&[("CUVISOR_MEMORY_LIMIT", "x=1Gi")]))
            .unwrap_err()
            .contains("is not ORDINAL=SIZE"));
    }

    #[test]
    fn the_file_rules_and_the_environment_cannot_raise_it() {
        let dir = std::env::temp_dir().join(format!("cuvisor-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("limits");
        let uuid = "GPU-5f2ac1de-0000-4000-8000-000000000001";
        std::fs::write(&f, format!("# plugin\nversion = 1\nstate_dir = /run/c1\nmemory.{uuid} = 6Gi\ncontext_reserve = 300Mi\n")).unwrap();
        let path = f.to_str().unwrap();
        let u = parse_uuid(uuid).unwrap();
        let c = load(env(&[
            ("CUVISOR_CONFIG", path),
            ("CUVISOR_MEMORY_LIMIT", "10Gi"),
            ("CUVISOR_STATE_DIR", "/elsewhere"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(
            c.limit_for(0, &u),
            6 << 30,
            "the environment cannot raise the file's limit"
        );
        assert_eq!(c.state_dir, PathBuf::from("/run/c1"), "nor move the ledger");
        assert_eq!(c.context_reserve, 300 << 20);
        let c = load(env(&[
            ("CUVISOR_CONFIG", path),
            ("CUVISOR_MEMORY_LIMIT", "1Gi"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(c.limit_for(0, &u), 1 << 30, "but can lower it");
        assert_eq!(
            c.limit_for(0, &[9; 16]),
            0,
            "another GPU is not this container's"
        );

        for (text, why) in [
            ("memory = 6Gi\nstate_dir = /x\n", "version"),
            ("version = 2\nmemory = 1Gi\nstate_dir = /x\n", "version 2"),
            ("version = 1\nmemory = 6GB\nstate_dir = /x\n", "line 2"),
            (
                "version = 1\nmemroy = 6Gi\nstate_dir = /x\n",
                "unknown key \"memroy\"",
            ),
            (
                "version = 1\nmemory.GPU-zz = 1Gi\nstate_dir = /x\n",
                "neither a device ordinal",
            ),
            ("version = 1\nstate_dir = /x\n", "no memory limit"),
        ] {
            std::fs::write(&f, text).unwrap();
            let e = load(env(&[("CUVISOR_CONFIG", path)])).unwrap_err();
            assert!(
                e.contains(why) && e.contains("CUVISOR_CONFIG"),
                "{text:?}: {e}"
            );
        }
        assert!(load(env(&[("CUVISOR_CONFIG", "/nonexistent/limits")]))
            .unwrap_err()
            .contains("/nonexistent/limits"));
        let _ = std::fs::remove_dir_all(&dir);
    }

    fn scratch(tag: &str) -> PathBuf {
        cuvisor_testkit::fresh_dir(&format!("config-{tag}"))
    }

    #[test]
    fn the_mounted_file_rules_whatever_the_environment_names_or_unsets() {
        let d = scratch("fixed");
        let fixed = d.join("limits.conf");
        std::fs::write(&fixed, "version = 1\nstate_dir = /run/c1\nmemory = 1Gi\n").unwrap();
        let forged = d.join("forged.conf");
        std::fs::write(
            &forged,
            "version = 1\nstate_dir = /tmp/mine\nmemory = 1Ti\n",
        )
        .unwrap();
        let forged = forged.to_str().unwrap();
        for vars in [
            vec![],                           // CUVISOR_CONFIG unset
            vec![("CUVISOR_CONFIG", forged)], // pointed at a file the container wrote
            vec![("CUVISOR_CONFIG", "")],     // set empty
            vec![
                ("CUVISOR_MEMORY_LIMIT", "1Ti"),
                ("CUVISOR_STATE_DIR", "/tmp/mine"),
            ],
        ] {
            let e = env(&vars);
            let c = super::load(&e, &fixed).unwrap().unwrap();
            assert_eq!(c.limit_for(0, &[0; 16]), 1 << 30, "{vars:?}");
            assert_eq!(c.state_dir, PathBuf::from("/run/c1"), "{vars:?}");
        }
        let e = env(&[("CUVISOR_MEMORY_LIMIT", "512Mi")]);
        let c = super::load(&e, &fixed).unwrap().unwrap();
        assert_eq!(
            c.limit_for(0, &[0; 16]),
            512 << 20,
            "the environment may lower it"
        );
        let e = env(&[
            ("CUVISOR_COMPUTE", "share=9"),
            ("CUVISOR_COORD_DIR", "/tmp/c"),
        ]);
        let cc = super::load_compute(&e, &fixed);
        assert_eq!(cc.compute, Compute::FromMemory, "nor pick its own share");
        assert_eq!(cc.coord_dir, default_coord_dir(), "nor its coordinator");
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn values_that_are_not_utf8_fail_closed() {
        use std::os::unix::ffi::OsStringExt;
        let bad = || OsString::from_vec(vec![b'6', 0xff, b'G']);
        for key in [
            "CUVISOR_MEMORY_LIMIT",
            "CUVISOR_CONFIG",
            "CUVISOR_CONTEXT_RESERVE",
            "CUVISOR_STATE_DIR",
        ] {
            let e = |k: &str| (k == key).then(bad);
            let err = load(e).unwrap_err();
            assert!(err.contains(key) && err.contains("UTF-8"), "{key}: {err}");
        }
        // Compute: the smallest share (memory is still limited, by the file or the environment).
        let e = |k: &str| match k {
            "CUVISOR_COMPUTE" => Some(bad()),
            "CUVISOR_MEMORY_LIMIT" => Some(OsString::from("1Gi")),
            _ => None,
        };
        assert_eq!(load(e).unwrap().unwrap().limit_for(0, &[0; 16]), 1 << 30);
        let cc = load_compute(e);
        assert_eq!(cc.compute, Compute::Share(MIN_SHARE));
        assert!(cc.errors[0].contains("UTF-8"), "{:?}", cc.errors);
        // Compute alone, malformed: configured (memory unlimited, compute at the smallest share).
        let e = |k: &str| (k == "CUVISOR_COMPUTE").then(bad);
        assert!(load(e).unwrap().is_some());
    }

    /// `CUVISOR_MEMORY_LIMIT=$QUOTA` with QUOTA unset ran with no quota at all: set but empty
    /// or blank, every variable that grants, lowers or places a limit is an error naming it
    /// (the caller fails closed), with a file as without.
    #[test]
    fn an_empty_or_blank_limit_variable_fails_closed() {
        let d = scratch("empty");
        let fixed = d.join("limits.conf");
        std::fs::write(&fixed, "version = 1\nstate_dir = /run/c1\nmemory = 1Gi\n").unwrap();
        for blank in ["", " ", "\t", " \n "] {
            for (key, with_file) in [
                ("CUVISOR_MEMORY_LIMIT", false),
                ("CUVISOR_MEMORY_LIMIT", true),
                ("CUVISOR_CONTEXT_RESERVE", false),
                ("CUVISOR_CONTEXT_RESERVE", true),
                ("CUVISOR_STATE_DIR", false),
                ("CUVISOR_CONFIG", false),
            ] {
                let mut vars = vec![(key, blank)];
                if key != "CUVISOR_MEMORY_LIMIT" && key != "CUVISOR_CONFIG" {
                    vars.push(("CUVISOR_MEMORY_LIMIT", "1Gi"));
                }
                let e = env(&vars);
                let at = if with_file {
                    fixed.as_path()
                } else {
                    Path::new(NO_FIXED)
                };
                let err = super::load(&e, at).unwrap_err();
                assert!(
                    err.contains(key) && err.contains("is set but"),
                    "{key}={blank:?} (file: {with_file}): {err}"
                );
            }
        }
        // Where the file rules, CUVISOR_CONFIG and CUVISOR_STATE_DIR are not read at all.
        for key in ["CUVISOR_CONFIG", "CUVISOR_STATE_DIR"] {
            let e = env(&[(key, "")]);
            let c = super::load(&e, &fixed).unwrap().unwrap();
            assert_eq!(c.limit_for(0, &[0; 16]), 1 << 30);
        }
        let _ = std::fs::remove_dir_all(&d);
    }

    /// The compute settings read an empty or blank value as any malformed one: the smallest
    /// share, with the reason (never the default, nor another coordinator).
    #[test]
    fn an_empty_or_blank_compute_setting_is_the_smallest_share() {
        for key in [
            "CUVISOR_COMPUTE",
            "CUVISOR_COORD_DIR",
            "CUVISOR_COORD_GROUP",
        ] {
            for blank in ["", "  "] {
                let e = env(&[("CUVISOR_MEMORY_LIMIT", "1Gi"), (key, blank)]);
                assert!(load(&e).unwrap().is_some());
                let cc = load_compute(&e);
                assert_eq!(cc.compute, Compute::Share(MIN_SHARE), "{key}={blank:?}");
                assert!(
                    cc.errors
                        .iter()
                        .any(|m| m.contains(key) && m.contains("is set but")),
                    "{key}: {:?}",
                    cc.errors
                );
                assert_eq!(cc.coord_dir, default_coord_dir());
                assert_eq!(cc.coord_access, Access::Private);
            }
        }
        let e = env(&[
            ("CUVISOR_MEMORY_LIMIT", "1Gi"),
            ("CUVISOR_COORD_GROUP", "no-such-group-x"),
        ]);
        let cc = load_compute(&e);
        assert_eq!(cc.compute, Compute::Share(MIN_SHARE));
        assert!(cc.errors[0].contains("not a group"), "{:?}", cc.errors);
    }

    /// Where the state lives decides who may use it: the caller alone with the environment,
    /// every uid of the container with a limits file; a group only where a setting names it.
    #[test]
    fn state_is_private_unless_a_file_or_a_group_setting_says_otherwise() {
        let e = env(&[("CUVISOR_MEMORY_LIMIT", "1Gi")]);
        assert_eq!(load(&e).unwrap().unwrap().state_access, Access::Private);
        assert_eq!(load_compute(&e).coord_access, Access::Private);
        let e = env(&[
            ("CUVISOR_MEMORY_LIMIT", "1Gi"),
            ("CUVISOR_COORD_GROUP", "4242"),
        ]);
        assert_eq!(load_compute(&e).coord_access, Access::Group(4242));
        let e = env(&[
            ("CUVISOR_MEMORY_LIMIT", "1Gi"),
            ("CUVISOR_COORD_GROUP", "root"),
        ]);
        assert_eq!(load_compute(&e).coord_access, Access::Group(0));
        let d = scratch("access");
        let fixed = d.join("limits.conf");
        std::fs::write(&fixed, "version = 1\nstate_dir = /run/c1\nmemory = 1Gi\n").unwrap();
        let e = env(&[("CUVISOR_COORD_GROUP", "4242")]);
        assert_eq!(
            super::load(&e, &fixed).unwrap().unwrap().state_access,
            Access::Shared
        );
        assert_eq!(super::load_compute(&e, &fixed).coord_access, Access::Shared);
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn special_or_huge_files_are_refused_at_once() {
        let d = scratch("special");
        let t = std::time::Instant::now();
        let fifo = d.join("fifo");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a valid path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        assert!(super::load(&env(&[]), &fifo)
            .unwrap_err()
            .contains("regular"));
        for path in [fifo.to_str().unwrap(), "/dev/zero", "/proc/self/fd/0"] {
            let err = load(env(&[("CUVISOR_CONFIG", path)])).unwrap_err();
            assert!(err.contains(path), "{err}");
        }
        let big = d.join("big");
        std::fs::write(
            &big,
            format!("version = 1\n{}", "#".repeat(MAX_FILE as usize)),
        )
        .unwrap();
        assert!(load(env(&[("CUVISOR_CONFIG", big.to_str().unwrap())]))
            .unwrap_err()
            .contains("larger than"));
        std::os::unix::fs::symlink("/etc/hostname", d.join("link")).unwrap();
        assert!(
            super::load(&env(&[]), &d.join("link")).is_err(),
            "a symlink: refused, not followed"
        );
        assert!(
            t.elapsed() < std::time::Duration::from_secs(1),
            "nothing blocked"
        );
        let _ = std::fs::remove_dir_all(&d);
    }
}
