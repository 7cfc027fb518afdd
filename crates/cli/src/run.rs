//! `cuvisor run`: a command under a device-memory quota and/or a compute policy, with
//! libcuvisor.so preloaded and a fresh ledger; with `--sim` (or `CUVISOR_SIM`), on the simulated
//! GPU.
//!
//! Everything the input can get wrong is checked before anything runs or is made: the quota,
//! the compute policy, the simulator model (a machine file must be a regular file of at most
//! 1 MiB: a FIFO or a device is never read), per-device ordinals against it, the simulated driver
//! being built, and
//!
//! - the library (`--library`, or the one beside cuvisor): a regular file, an ELF shared object
//!   of this machine that loads, checked in a process of its own (see `library`). ld.so skips a
//!   preload it cannot load and runs the command anyway, with no quota: that must not happen.
//! - the simulator's state file, when given (`--state`, else `CUVISOR_SIM_STATE`): absent, or a
//!   simulator state file of this model, not reached through a symbolic link (see
//!   `machine::check_state_file`). Anything else (`/etc/passwd`, a FIFO, `/dev/zero`, a
//!   directory) is refused, so that nothing is made beside a file cuvisor was not asked to use.
//!
//! A quota (`--memory`, `--memory-per-device`), a policy (`--compute`) or both must be given; a
//! policy alone leaves memory unlimited. The command then gets, on top of cuvisor's own
//! environment:
//!
//! ```text
//! LD_PRELOAD=<libcuvisor.so>[:<what was there>]
//! CUVISOR_MEMORY_LIMIT=<bytes> | 0=<bytes>,1=<bytes>     (canonical: plain bytes; removed from
//!                                                          the environment with --compute alone)
//! CUVISOR_STATE_DIR=<--state-dir (this user's; its limits applied or refused: see
//!                    `state_dir`), or a fresh temporary directory>
//! CUVISOR_COMPUTE=limit=P | share=W | share=memory | none (only with --compute; canonical:
//!                                                          limit=30, share=1. Not given: what the
//!                                                          environment has, else the library's
//!                                                          default, share=memory)
//! CUVISOR_LOG=<--log>                                     (only when given)
//! with the simulator also:
//! LD_LIBRARY_PATH=<exe dir>/sim[:<what was there>]
//! CUVISOR_SIM=<preset or file>
//! CUVISOR_SIM_STATE=<--state, else $CUVISOR_SIM_STATE, else a fresh file in the temporary dir>
//! CUVISOR_COORD_DIR=<the state file>.coord                (created if needed; kept as it is when
//!                                                          the environment already sets it)
//! ```
//!
//! The coordinator directory follows the simulator's state file because the state file *is* the
//! simulated machine: two `cuvisor run --sim single --state /tmp/gpu` side by side share one
//! simulated GPU and so must share its coordinator, `/tmp/gpu.coord` (the library's per-user
//! default would do too, but would also join runs on other state files, which are other
//! machines). It is made only beside a state file that passed the check above (or one in
//! cuvisor's temporary directory); a `<state file>.coord` that exists must be a directory, not a
//! symbolic link. Without the simulator `CUVISOR_COORD_DIR` is left alone: the library's per-user
//! default is the machine's.
//!
//! The command dies with cuvisor, even when cuvisor is SIGKILLed, and the usual signals sent to
//! cuvisor are passed on to it (see `child`); cuvisor then removes its temporary directory unless
//! `--keep-state`. What a SIGKILLed cuvisor leaves behind, the next `cuvisor run` removes (see
//! `scratch`).

use crate::args::{RunArgs, Target};
use crate::child;
use crate::library;
use crate::machine::{self, Source};
use crate::scratch::{self, Scratch};
use crate::state_dir;
use crate::{Failure, Result};
use cuvisor_shm::compute::{self, ComputePolicy};
use cuvisor_shm::ledger::{self, Ledger};
use cuvisor_shm::quantity::{LimitError, MemoryLimit};
use cuvisor_sim::model::{file_kind, Model};
use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::OsStrExt as _;
use std::path::{Path, PathBuf};

/// The library's file name, as Cargo writes the root package's cdylib.
pub const LIBRARY: &str = "libcuvisor.so";

pub fn run(target: &Target, args: &RunArgs) -> Result<u8> {
    let limit = memory_limit(args)?;
    let compute = compute_policy(args, limit.is_some())?;
    let sim = match machine::source(target) {
        Source::Sim { spec, from_flag } => {
            let model = machine::load_model(&spec, from_flag)?;
            Some((spec, model))
        }
        Source::System => None,
    };
    if let (Some((_, model)), Some(MemoryLimit::PerDevice(per))) = (&sim, &limit) {
        check_ordinals(model, per)?;
    }
    let exe_dir = exe_dir()?;
    let sim_dir = match sim {
        Some(_) => Some(sim_libraries(&exe_dir)?),
        None => None,
    };
    // The command's library path, where the library's own dependencies are looked for.
    let ld_library_path = match &sim_dir {
        Some(dir) => Some(prepend(dir, std::env::var_os("LD_LIBRARY_PATH"))),
        None => std::env::var_os("LD_LIBRARY_PATH"),
    };
    let library = match &args.library {
        Some(given) => given_library(given, ld_library_path.as_deref())?,
        None => {
            let found = find_library(&exe_dir)?;
            library::check(&found, ld_library_path.as_deref()).map_err(|why| {
                Failure::Runtime(format!(
                    "the interception library {}: {why}",
                    found.display()
                ))
            })?;
            found
        }
    };
    let state_dir = match &args.state_dir {
        Some(d) => Some(absolute(d)?),
        None => None,
    };
    // The simulator's state file, when one was given: checked before anything is made beside it.
    let given_state = match &sim {
        Some((_, model)) => {
            let given = given_state(target)?;
            if let Some(g) = &given {
                machine::check_state_file(&g.path, model)
                    .map_err(|why| Failure::Usage(format!("{}: {why}", g.origin)))?;
            }
            given
        }
        None => None,
    };
    // From here on cuvisor makes things it must remove: a signal is passed on to the command
    // (or kept for it until it starts), never the end of cuvisor.
    child::install_forwarding();
    // A private temporary directory, for whichever of the ledger and the simulator's state was
    // not given. Making one sweeps away those of runs that died; a run that needs none sweeps
    // too.
    let scratch = if state_dir.is_none() || (sim.is_some() && given_state.is_none()) {
        Some(Scratch::create(args.keep_state)?)
    } else {
        scratch::sweep(&std::env::temp_dir());
        None
    };
    // A directory given is kept across runs: the run's limits apply there, or it is refused
    // with the reason (see `state_dir`). Held until cuvisor ends.
    let mut _held = None;
    let state_dir = match (state_dir, &scratch) {
        (Some(d), _) => {
            let compute = match &compute {
                Some(p) => p.to_string(),
                None => std::env::var("CUVISOR_COMPUTE").unwrap_or_else(|_| "default".into()),
            };
            let want = state_dir::Limits {
                memory: limit.as_ref(),
                compute,
            };
            _held = Some(state_dir::claim(&d, &want)?);
            d
        }
        (None, Some(s)) => s.path.clone(),
        // Unreachable: a scratch directory exists whenever no state directory was given.
        (None, None) => return Err(Failure::Runtime("no state directory".into())),
    };
    let sim_setup = match (sim, sim_dir) {
        (Some((spec, _)), Some(dir)) => {
            // The state file in use, and whether to set CUVISOR_SIM_STATE to it (not when it is
            // the environment's already).
            let (file, set) = match (&given_state, &scratch) {
                (Some(g), _) => (g.path.clone(), g.from_flag),
                (None, Some(scratch)) => (scratch.path.join("sim.state"), true),
                // Unreachable: a scratch directory exists whenever no state file was given.
                (None, None) => return Err(Failure::Runtime("no simulator state file".into())),
            };
            let coord = match std::env::var_os("CUVISOR_COORD_DIR").filter(|d| !d.is_empty()) {
                Some(_) => None,
                None => {
                    let dir = coord_dir(&file);
                    make_coord_dir(&dir)?;
                    Some(dir)
                }
            };
            Some(SimSetup {
                spec,
                dir,
                state: set.then_some(file),
                coord,
            })
        }
        _ => None,
    };
    let setup = Setup {
        library,
        limit,
        compute,
        state_dir,
        log: args.log.clone(),
        sim: sim_setup,
    };
    let env = setup.environment(|k| std::env::var_os(k));
    let unset = setup.unset();

    let program = args
        .command
        .first()
        .map(|p| p.to_string_lossy().into_owned())
        .unwrap_or_default();
    if let Some(config) = std::env::var_os("CUVISOR_CONFIG").filter(|c| !c.is_empty()) {
        eprintln!(
            "cuvisor: warning: CUVISOR_CONFIG={} is set: the library takes its limits from that \
             file, and --memory and --compute cannot raise them",
            config.to_string_lossy()
        );
    }
    if args.verbose {
        let removed = scratch.is_some() && !args.keep_state;
        for line in setup.describe(&program, removed, |k| std::env::var_os(k)) {
            eprintln!("cuvisor: {line}");
        }
    }

    let status = child::run(&args.command, &env, &unset)?;

    if args.verbose {
        eprintln!("cuvisor: {program} {}", child::describe(status));
        for line in ledger_summary(&setup.state_dir) {
            eprintln!("cuvisor: {line}");
        }
    }
    if let Some(s) = &scratch {
        if args.keep_state {
            eprintln!("cuvisor: kept {}", s.path.display());
        }
    }
    drop(scratch);
    Ok(child::exit_code(status))
}

/// A flag's value as error messages show it: quoted when empty or holding whitespace.
fn shown(text: &str) -> String {
    if text.is_empty() || text.contains(char::is_whitespace) {
        format!("{text:?}")
    } else {
        text.to_string()
    }
}

/// The quota from `--memory` or `--memory-per-device` (None: neither, which `--compute` allows),
/// or the usage error naming the flag.
fn memory_limit(args: &RunArgs) -> Result<Option<MemoryLimit>> {
    let (flag, text, parsed) =
        match (&args.memory, &args.memory_per_device) {
            (Some(t), _) => ("--memory", t, MemoryLimit::parse(t)),
            (None, Some(t)) => ("--memory-per-device", t, MemoryLimit::parse_per_device(t)),
            (None, None) if args.compute.is_some() => return Ok(None),
            (None, None) => return Err(Failure::Usage(
                "give a quota: --memory SIZE, --memory-per-device ORDINAL=SIZE,..., or --compute \
                 POLICY"
                    .into(),
            )),
        };
    parsed.map(Some).map_err(|e| {
        let shown = shown(text);
        let hint = match (&e, flag) {
            (LimitError::Size { ordinal: None, .. }, "--memory") if text.contains(',') => {
                " (for one quota per GPU use --memory-per-device 0=6Gi,1=2Gi)"
            }
            _ => "",
        };
        Failure::Usage(format!("{flag} {shown}: {e}{hint}"))
    })
}

/// The policy from `--compute` (None when not given), or the usage error naming the flag.
/// `share=memory` weighs the share by the memory quota, so it needs one.
fn compute_policy(args: &RunArgs, has_quota: bool) -> Result<Option<ComputePolicy>> {
    let Some(text) = &args.compute else {
        return Ok(None);
    };
    let policy = compute::parse(text)
        .map_err(|e| Failure::Usage(format!("--compute {}: {e}", shown(text))))?;
    if policy == ComputePolicy::ShareMemory && !has_quota {
        return Err(Failure::Usage(format!(
            "--compute {}: a share weighted by the memory quota needs --memory or \
             --memory-per-device too",
            shown(text)
        )));
    }
    Ok(Some(policy))
}

/// The simulator state file `cuvisor run` was given, with where it came from.
struct GivenState {
    /// "--state FILE" or "CUVISOR_SIM_STATE=FILE", as given, for messages.
    origin: String,
    path: PathBuf,
    from_flag: bool,
}

/// `--state`, else a non-empty `CUVISOR_SIM_STATE`, made absolute; None: neither.
fn given_state(target: &Target) -> Result<Option<GivenState>> {
    if let Some(s) = &target.state {
        return Ok(Some(GivenState {
            origin: format!("--state {}", s.display()),
            path: absolute(s)?,
            from_flag: true,
        }));
    }
    match std::env::var_os("CUVISOR_SIM_STATE").filter(|v| !v.is_empty()) {
        Some(v) => Ok(Some(GivenState {
            origin: format!("CUVISOR_SIM_STATE={}", v.to_string_lossy()),
            path: absolute(Path::new(&v))?,
            from_flag: false,
        })),
        None => Ok(None),
    }
}

/// The simulated GPU's coordinator directory: `<state file>.coord`, beside the state file
/// (which is a simulator state file, or none yet: see `machine::check_state_file`).
fn coord_dir(state_file: &Path) -> PathBuf {
    let mut name = state_file.as_os_str().to_os_string();
    name.push(".coord");
    PathBuf::from(name)
}

/// Makes the coordinator directory if it is not there; something else by its name (a file, a
/// symbolic link, even to a directory) is refused, not followed.
fn make_coord_dir(dir: &Path) -> Result<()> {
    let fail = |why: String| {
        Failure::Runtime(format!(
            "the simulated GPU's coordinator directory {}: {why}",
            dir.display()
        ))
    };
    match std::fs::symlink_metadata(dir) {
        Ok(m) if m.is_dir() => Ok(()),
        Ok(m) => Err(fail(format!(
            "is {}, not a directory",
            file_kind(m.file_type())
        ))),
        // This user's alone (0700), as the library makes its coordinators by default.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            cuvisor_shm::mapped::open_dir(dir, cuvisor_shm::mapped::Access::Private, true)
                .map(drop)
                .map_err(|e| fail(format!("cannot create: {e}")))
        }
        Err(e) => Err(fail(e.to_string())),
    }
}

/// What `--verbose` says a policy means.
fn compute_meaning(p: &ComputePolicy) -> String {
    match p {
        ComputePolicy::None => "launches are not throttled".into(),
        ComputePolicy::Limit(pct) => {
            format!("at most {pct} % of each GPU's time, even when it is idle")
        }
        ComputePolicy::Share(w) => {
            format!("weight {w} among the containers busy on a GPU, idle time lent")
        }
        ComputePolicy::ShareMemory => {
            "a share weighted by the memory quota's fraction of each GPU".into()
        }
    }
}

fn check_ordinals(model: &Model, per: &[(u32, u64)]) -> Result<()> {
    for &(ordinal, _) in per {
        machine::check_gpu(model, ordinal as usize).map_err(|e| match e {
            Failure::Usage(m) => Failure::Usage(format!("--memory-per-device: {m}")),
            other => other,
        })?;
    }
    Ok(())
}

fn exe_dir() -> Result<PathBuf> {
    let exe = std::env::current_exe()
        .map_err(|e| Failure::Runtime(format!("cannot find this executable's path: {e}")))?;
    exe.parent()
        .map(Path::to_path_buf)
        .ok_or_else(|| Failure::Runtime(format!("{} has no directory", exe.display())))
}

/// libcuvisor.so next to the executable. `deps/` first: Cargo always writes the cdylib there,
/// and copies it up next to the binaries only when the library package itself was asked for
/// (not when built as the CLI's dependency), so the copy beside the binary can be stale.
/// An installed cuvisor has the library beside it.
pub fn find_library(exe_dir: &Path) -> Result<PathBuf> {
    let candidates = [exe_dir.join("deps").join(LIBRARY), exe_dir.join(LIBRARY)];
    match candidates.iter().find(|p| p.is_file()) {
        Some(p) => Ok(p.clone()),
        None => Err(Failure::Runtime(format!(
            "the interception library is not built: neither {} nor {} exists (`cargo build` \
             builds it next to the cuvisor binary; or give --library FILE)",
            candidates[1].display(),
            candidates[0].display()
        ))),
    }
}

/// `--library FILE`, made absolute, once it is known to be a shared object that loads (see
/// `library`): anything else would be ignored by ld.so, and the command would run with no quota.
fn given_library(given: &Path, ld_library_path: Option<&OsStr>) -> Result<PathBuf> {
    let abs = absolute(given)?;
    // ld.so splits LD_PRELOAD at spaces and colons.
    if abs
        .as_os_str()
        .as_bytes()
        .iter()
        .any(|b| matches!(b, b' ' | b':' | b'\t' | b'\n'))
    {
        return Err(Failure::Usage(format!(
            "--library {}: LD_PRELOAD cannot carry a path with spaces or colons",
            abs.display()
        )));
    }
    library::check(&abs, ld_library_path)
        .map_err(|why| Failure::Usage(format!("--library {}: {why}", given.display())))?;
    Ok(abs)
}

/// `sim/` next to the executable, with the simulated libcuda.so.1 in it.
fn sim_libraries(exe_dir: &Path) -> Result<PathBuf> {
    let dir = exe_dir.join("sim");
    if dir.join("libcuda.so.1").exists() {
        Ok(dir)
    } else {
        Err(Failure::Runtime(format!(
            "the simulated GPU is not built: {} does not exist (a `cargo build` of the workspace \
             builds it into target/<profile>/sim/)",
            dir.join("libcuda.so.1").display()
        )))
    }
}

fn absolute(p: &Path) -> Result<PathBuf> {
    std::path::absolute(p).map_err(|e| Failure::Runtime(format!("{}: {e}", p.display())))
}

struct SimSetup {
    spec: String,
    /// The directory holding the simulated libcuda.so.1 and libnvidia-ml.so.1.
    dir: PathBuf,
    /// The state file to set; None: keep the CUVISOR_SIM_STATE already in the environment.
    state: Option<PathBuf>,
    /// The coordinator directory to set (`<state file>.coord`); None: keep the
    /// CUVISOR_COORD_DIR already in the environment.
    coord: Option<PathBuf>,
}

/// Everything that decides the command's environment.
struct Setup {
    library: PathBuf,
    /// None: `--compute` alone, memory not limited.
    limit: Option<MemoryLimit>,
    /// None: not given, CUVISOR_COMPUTE left as it is.
    compute: Option<ComputePolicy>,
    state_dir: PathBuf,
    log: Option<String>,
    sim: Option<SimSetup>,
}

/// `first` ahead of a colon-separated list that may be unset or empty.
fn prepend(first: &Path, existing: Option<OsString>) -> OsString {
    let mut v = first.as_os_str().to_os_string();
    if let Some(rest) = existing.filter(|r| !r.is_empty()) {
        v.push(":");
        v.push(rest);
    }
    v
}

impl Setup {
    /// The variables to set for the command; `get` reads cuvisor's own environment.
    fn environment(&self, get: impl Fn(&str) -> Option<OsString>) -> Vec<(OsString, OsString)> {
        let mut env: Vec<(OsString, OsString)> = vec![(
            "LD_PRELOAD".into(),
            prepend(&self.library, get("LD_PRELOAD")),
        )];
        if let Some(limit) = &self.limit {
            env.push(("CUVISOR_MEMORY_LIMIT".into(), limit.to_string().into()));
        }
        env.push((
            "CUVISOR_STATE_DIR".into(),
            self.state_dir.as_os_str().into(),
        ));
        if let Some(policy) = &self.compute {
            env.push(("CUVISOR_COMPUTE".into(), policy.to_string().into()));
        }
        if let Some(level) = &self.log {
            env.push(("CUVISOR_LOG".into(), level.into()));
        }
        if let Some(sim) = &self.sim {
            env.push((
                "LD_LIBRARY_PATH".into(),
                prepend(&sim.dir, get("LD_LIBRARY_PATH")),
            ));
            env.push(("CUVISOR_SIM".into(), sim.spec.clone().into()));
            if let Some(state) = &sim.state {
                env.push(("CUVISOR_SIM_STATE".into(), state.as_os_str().into()));
            }
            if let Some(coord) = &sim.coord {
                env.push(("CUVISOR_COORD_DIR".into(), coord.as_os_str().into()));
            }
        }
        env
    }

    /// The variables to remove from the command's environment: an inherited memory limit when
    /// `--compute` alone says memory is not limited.
    fn unset(&self) -> Vec<&'static str> {
        match self.limit {
            None => vec!["CUVISOR_MEMORY_LIMIT"],
            Some(_) => Vec::new(),
        }
    }

    /// What --verbose says before the command runs; `get` reads cuvisor's own environment.
    fn describe(
        &self,
        program: &str,
        state_removed: bool,
        get: impl Fn(&str) -> Option<OsString>,
    ) -> Vec<String> {
        let first = match &self.limit {
            Some(limit) => {
                let quota = match limit {
                    MemoryLimit::All(b) => format!("{} per GPU", bytes(*b)),
                    MemoryLimit::PerDevice(v) => v
                        .iter()
                        .map(|(o, b)| format!("{} on GPU {o}", bytes(*b)))
                        .collect::<Vec<_>>()
                        .join(", "),
                };
                format!("running {program} with a quota of {quota} (CUVISOR_MEMORY_LIMIT={limit})")
            }
            None => format!("running {program} with no memory quota (CUVISOR_MEMORY_LIMIT unset)"),
        };
        let compute = match (
            &self.compute,
            get("CUVISOR_COMPUTE").filter(|c| !c.is_empty()),
        ) {
            (Some(p), _) => format!("compute {p}: {} (CUVISOR_COMPUTE={p})", compute_meaning(p)),
            (None, Some(c)) => format!(
                "compute: CUVISOR_COMPUTE={} from the environment",
                c.to_string_lossy()
            ),
            (None, None) => {
                "compute: CUVISOR_COMPUTE not set, the library's default applies (share=memory)"
                    .into()
            }
        };
        let mut lines = vec![
            first,
            compute,
            format!("LD_PRELOAD={}", self.library.display()),
            format!(
                "ledger in {}{}",
                self.state_dir.display(),
                if state_removed {
                    " (removed afterwards)"
                } else {
                    ""
                }
            ),
        ];
        if let Some(sim) = &self.sim {
            let state = match &sim.state {
                Some(s) => s.display().to_string(),
                None => get("CUVISOR_SIM_STATE")
                    .map(|s| s.to_string_lossy().into_owned())
                    .unwrap_or_default(),
            };
            lines.push(format!(
                "simulated GPU {} (libraries in {}, state {state})",
                sim.spec,
                sim.dir.display()
            ));
            lines.push(match &sim.coord {
                Some(c) => format!(
                    "compute coordinator in {} (CUVISOR_COORD_DIR: shared by every run on this \
                     state file)",
                    c.display()
                ),
                None => format!(
                    "compute coordinator in {} (CUVISOR_COORD_DIR from the environment)",
                    get("CUVISOR_COORD_DIR")
                        .map(|s| s.to_string_lossy().into_owned())
                        .unwrap_or_default()
                ),
            });
        }
        lines
    }
}

/// "6 GiB", "1.50 GiB", "512 MiB", "100 B".
fn bytes(b: u64) -> String {
    const UNITS: [(u64, &str); 4] = [
        (1 << 40, "TiB"),
        (1 << 30, "GiB"),
        (1 << 20, "MiB"),
        (1 << 10, "KiB"),
    ];
    for (size, unit) in UNITS {
        if b >= size {
            return if b.is_multiple_of(size) {
                format!("{} {unit}", b / size)
            } else {
                format!("{:.2} {unit}", b as f64 / size as f64)
            };
        }
    }
    format!("{b} B")
}

/// "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"
fn uuid_text(u: [u8; 16]) -> String {
    let hex: String = u.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "GPU-{}-{}-{}-{}-{}",
        &hex[..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..]
    )
}

/// What --verbose says after the command: the ledger's use, peak and refusals per GPU.
fn ledger_summary(state_dir: &Path) -> Vec<String> {
    let path = state_dir.join(ledger::FILE_NAME);
    if !path.exists() {
        return vec![format!(
            "no ledger in {} (the command did not use the GPU through cuvisor)",
            state_dir.display()
        )];
    }
    let ledger = match Ledger::open(&path, false) {
        Ok(l) => l,
        Err(e) => return vec![e],
    };
    // Charges of processes that died without giving them back (a SIGKILLed command).
    ledger.reclaim_dead();
    let mut lines: Vec<String> = ledger
        .devices()
        .map(|(_, uuid, e)| {
            use std::sync::atomic::Ordering::Acquire;
            let denied = e.denied.load(Acquire);
            let quota = match e.limit.load(Acquire) {
                // --compute alone: the library's "not limited".
                u64::MAX => "no quota".to_string(),
                l => format!("quota {}", bytes(l)),
            };
            let launches = e.launches.load(Acquire);
            // Counted only under a compute policy.
            let compute = if launches > 0 {
                format!(
                    "; {launches} launch{}, GPU time {:.2} s, throttled {:.2} s",
                    if launches == 1 { "" } else { "es" },
                    e.gpu_ns.load(Acquire) as f64 / 1e9,
                    e.throttled_ns.load(Acquire) as f64 / 1e9
                )
            } else {
                String::new()
            };
            format!(
                "{}: {quota}, peak {}, in use {}, {denied} allocation{} refused{compute}",
                uuid_text(uuid),
                bytes(e.peak.load(Acquire)),
                bytes(e.used_bytes()),
                if denied == 1 { "" } else { "s" }
            )
        })
        .collect();
    if lines.is_empty() {
        lines.push(format!("{}: no GPU was used", path.display()));
    }
    lines
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(memory: Option<&str>, per_device: Option<&str>) -> RunArgs {
        RunArgs {
            memory: memory.map(String::from),
            memory_per_device: per_device.map(String::from),
            compute: None,
            state_dir: None,
            keep_state: false,
            library: None,
            log: None,
            verbose: false,
            command: vec!["true".into()],
        }
    }

    fn usage<T: std::fmt::Debug>(r: Result<T>) -> String {
        match r {
            Err(Failure::Usage(m)) => m,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn quotas_are_checked_and_named_by_their_flag() {
        assert_eq!(
            memory_limit(&args(Some("4G"), None)).ok(),
            Some(Some(MemoryLimit::All(4_000_000_000)))
        );
        for (value, want) in [
            (
                "4GB",
                "--memory 4GB: unknown unit \"GB\" (use Ki, Mi, Gi, Ti, k, M, G, T or plain bytes)",
            ),
            ("-1", "--memory -1: a size cannot be negative"),
            ("", "--memory \"\": empty (give a size such as 6Gi, 512Mi or 4G)"),
            ("0", "--memory 0: a memory limit must be more than 0 bytes"),
            (
                "lots",
                "--memory lots: not a size (a number with an optional unit, such as 6Gi, 512Mi or 4G)",
            ),
            (
                "6Gi,2Gi",
                "--memory 6Gi,2Gi: unknown unit \"Gi,2Gi\" (use Ki, Mi, Gi, Ti, k, M, G, T or plain \
                 bytes) (for one quota per GPU use --memory-per-device 0=6Gi,1=2Gi)",
            ),
        ] {
            assert_eq!(usage(memory_limit(&args(Some(value), None))), want);
        }
        assert_eq!(
            usage(memory_limit(&args(None, Some("0=1Gi,0=2Gi")))),
            "--memory-per-device 0=1Gi,0=2Gi: device 0 is given twice"
        );
        assert_eq!(
            usage(memory_limit(&args(None, Some("6Gi")))),
            "--memory-per-device 6Gi: \"6Gi\" is not ORDINAL=SIZE (the form is ORDINAL=SIZE,..., \
             such as 0=6Gi,1=2Gi)"
        );
        // The per-device form is accepted through --memory as well, as CUVISOR_MEMORY_LIMIT
        // accepts it.
        assert_eq!(
            memory_limit(&args(Some("0=1Gi"), None)).ok(),
            Some(Some(MemoryLimit::PerDevice(vec![(0, 1 << 30)])))
        );
        // Neither: a usage error that names every way to give a quota, --compute included.
        assert_eq!(
            usage(memory_limit(&args(None, None))),
            "give a quota: --memory SIZE, --memory-per-device ORDINAL=SIZE,..., or --compute \
             POLICY"
        );
    }

    fn with_compute(memory: Option<&str>, compute: &str) -> RunArgs {
        RunArgs {
            compute: Some(compute.into()),
            ..args(memory, None)
        }
    }

    #[test]
    fn compute_policies_are_checked_named_by_their_flag_and_made_canonical() {
        // --compute alone: no memory quota, and no usage error for it.
        let a = with_compute(None, "share=1");
        assert_eq!(memory_limit(&a).ok(), Some(None));
        for (value, canonical) in [
            ("limit=30", "limit=30"),
            ("limit=30%", "limit=30"),
            (" share = 1 ", "share=1"),
            ("share=0.5", "share=0.5"),
            ("none", "none"),
        ] {
            let p = compute_policy(&with_compute(None, value), false).unwrap();
            assert_eq!(p.map(|p| p.to_string()).as_deref(), Some(canonical));
        }
        assert_eq!(
            compute_policy(&args(Some("1Gi"), None), true).ok(),
            Some(None)
        );
        for (value, want) in [
            (
                "limit=150",
                "--compute limit=150: a limit is a percentage of GPU time, more than 0 and at \
                 most 100",
            ),
            (
                "limit=0",
                "--compute limit=0: a limit is a percentage of GPU time, more than 0 and at most \
                 100",
            ),
            (
                "share=0",
                "--compute share=0: a share is a weight, more than 0 and at most 1000000 (or \
                 share=memory)",
            ),
            (
                "fair=2",
                "--compute fair=2: expected limit=P, share=W, share=memory or none",
            ),
            (
                "",
                "--compute \"\": expected limit=P, share=W, share=memory or none",
            ),
            (
                "share=memory",
                "--compute share=memory: a share weighted by the memory quota needs --memory or \
                 --memory-per-device too",
            ),
        ] {
            assert_eq!(
                usage(compute_policy(&with_compute(None, value), false)),
                want
            );
        }
        let p = compute_policy(&with_compute(Some("1Gi"), "share=memory"), true).unwrap();
        assert_eq!(p, Some(ComputePolicy::ShareMemory));
    }

    #[test]
    fn the_coordinator_sits_beside_the_state_file() {
        assert_eq!(
            coord_dir(Path::new("/tmp/gpu")),
            PathBuf::from("/tmp/gpu.coord")
        );
        assert_eq!(
            coord_dir(Path::new("/run/x/sim.state")),
            PathBuf::from("/run/x/sim.state.coord")
        );
    }

    #[test]
    fn per_device_ordinals_must_exist_on_the_simulator() {
        let m = cuvisor_sim::model::preset("single").unwrap();
        assert!(check_ordinals(&m, &[(0, 1)]).is_ok());
        let Err(Failure::Usage(msg)) = check_ordinals(&m, &[(0, 1), (1, 1)]) else {
            panic!()
        };
        assert_eq!(
            msg,
            "--memory-per-device: GPU 1 does not exist (the single simulator has only GPU 0)"
        );
    }

    fn setup(sim: Option<SimSetup>) -> Setup {
        Setup {
            library: "/opt/cuvisor/libcuvisor.so".into(),
            limit: Some(MemoryLimit::All(6 << 30)),
            compute: None,
            state_dir: "/tmp/cuvisor-run-abc".into(),
            log: Some("debug".into()),
            sim,
        }
    }

    fn lookup(env: &[(OsString, OsString)], k: &str) -> Option<String> {
        env.iter()
            .find(|(key, _)| key == k)
            .map(|(_, v)| v.to_string_lossy().into_owned())
    }

    #[test]
    fn the_environment_preloads_the_library_ahead_of_what_was_there() {
        let env = setup(None).environment(|k| match k {
            "LD_PRELOAD" => Some("/usr/lib/libjemalloc.so".into()),
            "LD_LIBRARY_PATH" => Some("/usr/local/cuda/lib64".into()),
            _ => None,
        });
        assert_eq!(
            lookup(&env, "LD_PRELOAD").as_deref(),
            Some("/opt/cuvisor/libcuvisor.so:/usr/lib/libjemalloc.so")
        );
        assert_eq!(
            lookup(&env, "CUVISOR_MEMORY_LIMIT").as_deref(),
            Some("6442450944")
        );
        assert_eq!(
            lookup(&env, "CUVISOR_STATE_DIR").as_deref(),
            Some("/tmp/cuvisor-run-abc")
        );
        assert_eq!(lookup(&env, "CUVISOR_LOG").as_deref(), Some("debug"));
        // Without the simulator, the library path and the simulator's variables are left alone,
        // and so is the compute policy without --compute.
        for k in [
            "LD_LIBRARY_PATH",
            "CUVISOR_SIM",
            "CUVISOR_SIM_STATE",
            "CUVISOR_COORD_DIR",
            "CUVISOR_COMPUTE",
        ] {
            assert_eq!(lookup(&env, k), None, "{k}");
        }
        assert_eq!(setup(None).unset(), Vec::<&str>::new());
        let env = setup(None).environment(|k| (k == "LD_PRELOAD").then(OsString::new));
        assert_eq!(
            lookup(&env, "LD_PRELOAD").as_deref(),
            Some("/opt/cuvisor/libcuvisor.so")
        );
    }

    #[test]
    fn the_simulator_comes_first_on_the_library_path() {
        let sim = |state: Option<&str>| SimSetup {
            spec: "dgx1-v100".into(),
            dir: "/w/target/debug/sim".into(),
            state: state.map(PathBuf::from),
            coord: state.map(|s| coord_dir(Path::new(s))),
        };
        let env = setup(Some(sim(Some("/tmp/cuvisor-run-abc/sim.state"))))
            .environment(|k| (k == "LD_LIBRARY_PATH").then(|| "/usr/lib64".into()));
        assert_eq!(
            lookup(&env, "LD_LIBRARY_PATH").as_deref(),
            Some("/w/target/debug/sim:/usr/lib64")
        );
        assert_eq!(lookup(&env, "CUVISOR_SIM").as_deref(), Some("dgx1-v100"));
        assert_eq!(
            lookup(&env, "CUVISOR_SIM_STATE").as_deref(),
            Some("/tmp/cuvisor-run-abc/sim.state")
        );
        assert_eq!(
            lookup(&env, "CUVISOR_COORD_DIR").as_deref(),
            Some("/tmp/cuvisor-run-abc/sim.state.coord")
        );
        // A state file (and a coordinator directory) already in the environment is kept (not
        // overridden).
        let env = setup(Some(sim(None))).environment(|_| None);
        assert_eq!(
            lookup(&env, "LD_LIBRARY_PATH").as_deref(),
            Some("/w/target/debug/sim")
        );
        assert_eq!(lookup(&env, "CUVISOR_SIM_STATE"), None);
        assert_eq!(lookup(&env, "CUVISOR_COORD_DIR"), None);
    }

    #[test]
    fn compute_alone_sets_the_policy_and_unsets_the_memory_limit() {
        let s = Setup {
            limit: None,
            compute: Some(ComputePolicy::Share(3.0)),
            ..setup(None)
        };
        let env = s.environment(|_| None);
        assert_eq!(lookup(&env, "CUVISOR_COMPUTE").as_deref(), Some("share=3"));
        assert_eq!(lookup(&env, "CUVISOR_MEMORY_LIMIT"), None);
        assert_eq!(s.unset(), ["CUVISOR_MEMORY_LIMIT"]);
        let said = s.describe("app", true, |_| None);
        assert_eq!(
            said[..2],
            [
                "running app with no memory quota (CUVISOR_MEMORY_LIMIT unset)",
                "compute share=3: weight 3 among the containers busy on a GPU, idle time lent \
                 (CUVISOR_COMPUTE=share=3)"
            ]
        );
        let said = setup(None).describe("app", true, |k| {
            (k == "CUVISOR_COMPUTE").then(|| "limit=50".into())
        });
        assert_eq!(
            said[1],
            "compute: CUVISOR_COMPUTE=limit=50 from the environment"
        );
    }

    #[test]
    fn the_library_is_looked_for_in_deps_first() {
        let dir = std::env::temp_dir().join(format!("cuvisor-find-lib-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("deps")).unwrap();
        let Err(Failure::Runtime(msg)) = find_library(&dir) else {
            panic!("found a library in an empty directory")
        };
        assert!(msg.contains("`cargo build`"), "{msg}");
        assert!(
            msg.contains(&dir.join(LIBRARY).display().to_string()),
            "{msg}"
        );
        std::fs::write(dir.join(LIBRARY), b"").unwrap();
        assert_eq!(find_library(&dir).ok(), Some(dir.join(LIBRARY)));
        std::fs::write(dir.join("deps").join(LIBRARY), b"").unwrap();
        assert_eq!(
            find_library(&dir).ok(),
            Some(dir.join("deps").join(LIBRARY))
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn sizes_and_uuids_read_as_people_write_them() {
        assert_eq!(bytes(6 << 30), "6 GiB");
        assert_eq!(bytes(3 << 29), "1.50 GiB");
        assert_eq!(bytes(512 << 20), "512 MiB");
        assert_eq!(bytes(0), "0 B");
        let mut u = [0u8; 16];
        u[0] = 0xab;
        u[15] = 0x01;
        assert_eq!(uuid_text(u), "GPU-ab000000-0000-0000-0000-000000000001");
    }
}
