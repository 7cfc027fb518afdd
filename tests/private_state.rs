//! Configured by the environment alone (no limits file, no `cuvisor run`), the state libcuvisor
//! makes is the user's own, and what it cannot read fails closed. Each test is an attack the
//! second red team made (issue 15), run as two non-root users (uids 1000 and 1001: processes
//! that load libcuvisor on the simulator, started with `CommandExt::uid`), sharing a TMPDIR as
//! they would share /tmp (a fresh directory of mode 1777). The owner runs with umask 0, under
//! which the library used to make its default ledger directory world-writable.
//!
//! Needs root (to start processes as other uids): without it each test prints SKIPPED, and
//! fails where CI=true.
mod common;
#[path = "common/workload.rs"]
mod workload;

use cudarc::driver::sys as cu;
use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const OWNER: u32 = 1000;
const OTHER: u32 = 1001;

/// In the child: allocates 64 MiB once and says what happened; with ACT=launch, launches
/// kernels instead (which joins the GPU's coordinator).
fn child() {
    if std::env::var("ACT").as_deref() == Ok("launch") {
        return workload::run();
    }
    let (mut ctx, mut p) = (std::ptr::null_mut(), 0);
    // SAFETY: driver calls (through libcuvisor) with valid out-pointers and live handles.
    let r = unsafe {
        assert_eq!(cu::cuInit(0), cu::CUresult::CUDA_SUCCESS);
        assert_eq!(
            cu::cuDevicePrimaryCtxRetain(&mut ctx, 0),
            cu::CUresult::CUDA_SUCCESS
        );
        assert_eq!(cu::cuCtxSetCurrent(ctx), cu::CUresult::CUDA_SUCCESS);
        cu::cuMemAlloc_v2(&mut p, 64 << 20)
    };
    match r {
        cu::CUresult::CUDA_SUCCESS => {
            println!("alloc: ok");
            // SAFETY: as above; p was just allocated.
            unsafe { cu::cuMemFree_v2(p) };
        }
        e => println!("alloc: refused {e:?}"),
    }
}

/// Whether this process can start others as other uids; says SKIPPED (or fails in CI) if not.
fn can_switch_users(test: &str) -> bool {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        return true;
    }
    assert!(
        std::env::var("CI").as_deref() != Ok("true"),
        "{test}: needs root to run processes as uids {OWNER} and {OTHER}"
    );
    println!("SKIPPED {test}: needs root to run processes as uids {OWNER} and {OTHER}");
    false
}

/// A TMPDIR both users reach and write, as /tmp (1777). Under this process's TMPDIR when other
/// users can reach it; otherwise under /tmp (CI's TMPDIR is a `mktemp -d`, 0700 and root's, which
/// uids 1000 and 1001 cannot enter).
fn shared_tmp(tag: &str) -> PathBuf {
    let tmp = std::env::temp_dir();
    let reachable = tmp
        .ancestors()
        .all(|a| std::fs::metadata(a).is_ok_and(|m| m.permissions().mode() & 0o001 != 0));
    let base = if reachable {
        tmp
    } else {
        PathBuf::from("/tmp")
    };
    let d = base.join(format!("cuvisor-private-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("create a scratch directory");
    std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o1777)).unwrap();
    d
}

/// Runs this test's child as `uid` (umask 0) with TMPDIR `tmp`, libcuvisor preloaded, a
/// simulator state of its own, no CUVISOR_* variable but `vars`.
fn run_as(test: &str, uid: u32, tmp: &Path, vars: &[(&str, &str)]) -> Output {
    let mut cmd = common::Child::new(test)
        .state(&tmp.join(format!("sim-{uid}.state")))
        .command();
    cmd.env("LD_PRELOAD", common::libcuvisor())
        .env("TMPDIR", tmp);
    for k in [
        "CUVISOR_CONFIG",
        "CUVISOR_MEMORY_LIMIT",
        "CUVISOR_STATE_DIR",
        "CUVISOR_CONTEXT_RESERVE",
        "CUVISOR_COMPUTE",
        "CUVISOR_COORD_DIR",
        "CUVISOR_COORD_GROUP",
    ] {
        cmd.env_remove(k);
    }
    for (k, v) in vars {
        cmd.env(k, v);
    }
    cmd.uid(uid).gid(uid);
    // SAFETY: umask is async-signal-safe and touches nothing of the parent.
    unsafe {
        cmd.pre_exec(|| {
            libc::umask(0);
            Ok(())
        })
    };
    cmd.output().unwrap()
}

/// A shell command run as `uid`; whether it succeeded.
fn sh_as(uid: u32, script: &str, arg: &Path) -> bool {
    Command::new("sh")
        .args(["-c", script, "sh"])
        .arg(arg)
        .uid(uid)
        .gid(uid)
        .status()
        .unwrap()
        .success()
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// The lines libcuvisor wrote.
fn said(o: &Output) -> Vec<String> {
    String::from_utf8_lossy(&o.stderr)
        .lines()
        .filter(|l| l.starts_with("cuvisor:"))
        .map(String::from)
        .collect()
}

fn show(o: &Output) -> String {
    format!(
        "{:?}\n--- stdout\n{}--- stderr\n{}",
        o.status,
        stdout(o),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// The child allocated.
fn allocated(o: &Output) -> bool {
    stdout(o).contains("alloc: ok")
}

/// The child was refused, with exactly one line from cuvisor that holds every one of `why`.
fn assert_refused_with_one_line(o: &Output, why: &[&str]) {
    assert!(
        stdout(o).contains("alloc: refused CUDA_ERROR_OUT_OF_MEMORY"),
        "{}",
        show(o)
    );
    let lines = said(o);
    assert_eq!(lines.len(), 1, "{}", show(o));
    for w in why {
        assert!(lines[0].contains(w), "{w:?} not said: {}", show(o));
    }
}

fn mode(p: &Path) -> (u32, u32) {
    let m = std::fs::symlink_metadata(p).unwrap();
    (m.mode() & 0o7777, m.uid())
}

/// Attack: another local user made `$TMPDIR/cuvisor-<owner uid>/` first (world-writable), and
/// the owner's processes used it as it was: a ledger that user could set full. Now the owner's
/// allocations are refused, with one line naming the directory and its owner, and nothing is
/// made in it.
#[test]
fn another_uid_pre_creating_the_default_ledger_dir_is_refused_with_one_line() {
    const TEST: &str = "another_uid_pre_creating_the_default_ledger_dir_is_refused_with_one_line";
    if common::is_child() {
        return child();
    }
    if !can_switch_users(TEST) {
        return;
    }
    let tmp = shared_tmp("precreated");
    let planted = tmp.join(format!("cuvisor-{OWNER}"));
    assert!(sh_as(OTHER, "mkdir -m 777 \"$1\"", &planted));
    let o = run_as(TEST, OWNER, &tmp, &[("CUVISOR_MEMORY_LIMIT", "1Gi")]);
    assert_refused_with_one_line(
        &o,
        &[
            &planted.display().to_string(),
            &format!("owned by uid {OTHER}, not by this user (uid {OWNER})"),
        ],
    );
    assert_eq!(
        std::fs::read_dir(&planted).unwrap().count(),
        0,
        "made in it"
    );
    // Root is held to the same rules.
    let planted = tmp.join("cuvisor-0");
    assert!(sh_as(OTHER, "mkdir -m 777 \"$1\"", &planted));
    let o = run_as(TEST, 0, &tmp, &[("CUVISOR_MEMORY_LIMIT", "1Gi")]);
    assert_refused_with_one_line(&o, &[&format!("owned by uid {OTHER}")]);
    let _ = std::fs::remove_dir_all(&tmp);
}

/// Attack: the default ledger was world-writable, so another user set it full and every
/// allocation of its owner was refused. Now the directory is 0700 and the ledger 0600, the
/// owner's (under umask 0 too), and the other user cannot open it for writing; each user's
/// own processes run on a ledger of their own.
#[test]
fn another_uid_cannot_write_the_owners_ledger() {
    const TEST: &str = "another_uid_cannot_write_the_owners_ledger";
    if common::is_child() {
        return child();
    }
    if !can_switch_users(TEST) {
        return;
    }
    let tmp = shared_tmp("ledger");
    let o = run_as(TEST, OWNER, &tmp, &[("CUVISOR_MEMORY_LIMIT", "1Gi")]);
    assert!(allocated(&o), "{}", show(&o));
    let dir = tmp.join(format!("cuvisor-{OWNER}"));
    let ledger = dir.join(cuvisor_shm::ledger::FILE_NAME);
    assert_eq!(mode(&dir), (0o700, OWNER));
    assert_eq!(mode(&ledger), (0o600, OWNER));
    assert!(
        !sh_as(OTHER, ": >> \"$1\"", &ledger),
        "uid {OTHER} could open the owner's ledger for writing"
    );
    let o = run_as(TEST, OTHER, &tmp, &[("CUVISOR_MEMORY_LIMIT", "1Gi")]);
    assert!(allocated(&o), "{}", show(&o));
    assert_eq!(mode(&tmp.join(format!("cuvisor-{OTHER}"))), (0o700, OTHER));
    let _ = std::fs::remove_dir_all(&tmp);
}

/// Attack: a state directory that is a symbolic link was followed, so root made a
/// world-writable ledger wherever another user pointed it. Now a symlink is refused, for
/// `CUVISOR_STATE_DIR` and the default alike, and nothing is made where it points.
#[test]
fn a_symlinked_state_dir_is_refused_not_followed() {
    const TEST: &str = "a_symlinked_state_dir_is_refused_not_followed";
    if common::is_child() {
        return child();
    }
    if !can_switch_users(TEST) {
        return;
    }
    let tmp = shared_tmp("symlink");
    let elsewhere = tmp.join("elsewhere");
    assert!(sh_as(OTHER, "mkdir -m 777 \"$1\"", &elsewhere));
    let link = tmp.join("state");
    assert!(sh_as(OTHER, "ln -s elsewhere \"$1\"", &link));
    let link_s = link.to_str().unwrap();
    let o = run_as(
        TEST,
        0,
        &tmp,
        &[
            ("CUVISOR_MEMORY_LIMIT", "1Gi"),
            ("CUVISOR_STATE_DIR", link_s),
        ],
    );
    assert_refused_with_one_line(&o, &[link_s, "is a symbolic link: refused, not followed"]);
    // The default directory of a non-root user, a link to a directory of its own.
    let default = tmp.join(format!("cuvisor-{OWNER}"));
    assert!(sh_as(OTHER, "ln -s elsewhere \"$1\"", &default));
    let o = run_as(TEST, OWNER, &tmp, &[("CUVISOR_MEMORY_LIMIT", "1Gi")]);
    assert_refused_with_one_line(&o, &["is a symbolic link"]);
    assert_eq!(
        std::fs::read_dir(&elsewhere).unwrap().count(),
        0,
        "followed"
    );
    let _ = std::fs::remove_dir_all(&tmp);
}

/// Attack: `CUVISOR_MEMORY_LIMIT=$QUOTA` with QUOTA unset (set but empty) ran with no quota at
/// all. Empty or blank, it now fails closed like any unreadable limit, the reason on the
/// refusal line; so do an empty state directory and an empty `CUVISOR_CONFIG`.
#[test]
fn an_empty_or_blank_memory_limit_fails_closed() {
    const TEST: &str = "an_empty_or_blank_memory_limit_fails_closed";
    if common::is_child() {
        return child();
    }
    if !can_switch_users(TEST) {
        return;
    }
    let tmp = shared_tmp("empty");
    for blank in ["", "  ", "\t"] {
        let o = run_as(TEST, OWNER, &tmp, &[("CUVISOR_MEMORY_LIMIT", blank)]);
        assert_refused_with_one_line(&o, &["misconfigured", "CUVISOR_MEMORY_LIMIT is set but"]);
    }
    for (key, also) in [
        ("CUVISOR_STATE_DIR", Some(("CUVISOR_MEMORY_LIMIT", "1Gi"))),
        (
            "CUVISOR_CONTEXT_RESERVE",
            Some(("CUVISOR_MEMORY_LIMIT", "1Gi")),
        ),
        ("CUVISOR_CONFIG", None),
    ] {
        let mut vars = vec![(key, "")];
        vars.extend(also);
        let o = run_as(TEST, OWNER, &tmp, &vars);
        assert_refused_with_one_line(&o, &[&format!("{key} is set but empty")]);
    }
    let _ = std::fs::remove_dir_all(&tmp);
}

/// Attack: the default coordinator directory was 1777 with 0666 files: any local user could
/// rewrite a GPU's board or another user's compute state. Now it is the user's alone (0700
/// directories, 0600 files), and another user cannot write it.
#[test]
fn the_default_coordinator_is_private_to_its_user() {
    const TEST: &str = "the_default_coordinator_is_private_to_its_user";
    if common::is_child() {
        return child();
    }
    if !can_switch_users(TEST) {
        return;
    }
    let tmp = shared_tmp("coord");
    let launch = [
        ("CUVISOR_MEMORY_LIMIT", "1Gi"),
        ("ACT", "launch"),
        ("KERNEL_NS", "100000"),
        ("SECONDS", "0.3"),
    ];
    let o = run_as(TEST, OWNER, &tmp, &launch);
    assert!(o.status.success() && said(&o).is_empty(), "{}", show(&o));
    let coord = tmp.join(format!("cuvisor-coord-{OWNER}"));
    assert_eq!(mode(&coord), (0o700, OWNER));
    let gpus: Vec<PathBuf> = std::fs::read_dir(&coord)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(gpus.len(), 1, "{gpus:?}");
    assert_eq!(mode(&gpus[0]), (0o700, OWNER));
    let files: Vec<PathBuf> = std::fs::read_dir(&gpus[0])
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert!(files.len() >= 2, "a board and a state: {files:?}");
    for f in &files {
        assert_eq!(mode(f), (0o600, OWNER), "{}", f.display());
        assert!(!sh_as(OTHER, ": >> \"$1\"", f), "{} writable", f.display());
    }
    // The other user's processes coordinate on a directory of their own.
    let o = run_as(TEST, OTHER, &tmp, &launch);
    assert!(o.status.success() && said(&o).is_empty(), "{}", show(&o));
    assert_eq!(
        mode(&tmp.join(format!("cuvisor-coord-{OTHER}"))),
        (0o700, OTHER)
    );
    let _ = std::fs::remove_dir_all(&tmp);
}

/// What must not break: under a limits file (the device plugin's, here through
/// `CUVISOR_CONFIG`) the state directory is the file author's, made for every uid of a
/// container (1777), and processes of two uids share one ledger, and so one quota.
#[test]
fn under_a_limits_file_two_uids_share_one_ledger() {
    const TEST: &str = "under_a_limits_file_two_uids_share_one_ledger";
    if common::is_child() {
        return child();
    }
    if !can_switch_users(TEST) {
        return;
    }
    let tmp = shared_tmp("file");
    let state = tmp.join("state");
    std::fs::create_dir(&state).unwrap();
    std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let conf = tmp.join("limits.conf");
    std::fs::write(
        &conf,
        format!(
            "version = 1\nstate_dir = {}\nmemory = 1Gi\n",
            state.display()
        ),
    )
    .unwrap();
    let conf = conf.to_str().unwrap();
    for uid in [OWNER, OTHER] {
        let o = run_as(TEST, uid, &tmp, &[("CUVISOR_CONFIG", conf)]);
        assert!(allocated(&o), "uid {uid}: {}", show(&o));
    }
    assert_eq!(
        mode(&state.join(cuvisor_shm::ledger::FILE_NAME)),
        (0o666, OWNER)
    );
    let _ = std::fs::remove_dir_all(&tmp);
}
