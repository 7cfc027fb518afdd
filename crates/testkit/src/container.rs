//! Tenants as real OCI containers, run with `runc`: each in its own pid, mount, ipc and uts
//! namespace, as the uid/gid it is given, with the mounts, environment and device nodes a device
//! plugin's Allocate answered (plus the test's own mounts).
//!
//! The container's root file system is the host's, read-only, so test binaries and the
//! simulator's libraries are seen at their host paths: the bundle's `rootfs/` holds one entry per
//! top-level host entry (a read-only recursive bind of it; symlinks copied), except `/proc`, `/dev`,
//! `/tmp` and `/run`, which are the container's own (proc, a tmpfs with runc's device nodes and
//! the specs' nodes, tmpfs, tmpfs). A mount point the host lacks inside the read-only tree (say
//! `/etc/ld.so.preload`, `/usr/local/lib/cuvisor/...`) is never created on the host: the deepest
//! directory that exists is covered by a read-only overlay of itself and a layer in the bundle
//! holding the missing entries.
//!
//! Device specs are resolved as a CRI runtime does: the host node is `stat`ed for its type and
//! numbers, which become `linux.devices` (runc makes the node) and a device-cgroup rule with the
//! spec's permissions. The simulated GPU has no `/dev/nvidia*`; [`fake_char_device`] makes a
//! stand-in (the numbers of `/dev/null`) for a plugin's `host.dev_dir`.
//!
//! Needs root and `runc` on PATH. Tests call [`usable`] first: without them it prints a loud
//! `SKIPPED` line and the test returns, except when `CI` is set, where it fails.

use serde_json::{json, Value};
use std::collections::{BTreeMap, VecDeque};
use std::ffi::OsString;
use std::io::Write;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// A bind mount: `host_path` at `container_path`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mount {
    pub container_path: PathBuf,
    pub host_path: PathBuf,
    pub read_only: bool,
}

/// A device node: the host's `host_path` (its type and numbers) at `container_path`, with
/// cgroup permissions `permissions` ("rw", "rwm", ...).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Device {
    pub container_path: PathBuf,
    pub host_path: PathBuf,
    pub permissions: String,
}

/// What to run, and with what: the shape of kubelet's `ContainerAllocateResponse` (envs,
/// mounts, devices) plus the process.
#[derive(Clone, Debug, Default)]
pub struct Spec {
    /// argv; `args[0]` an absolute path.
    pub args: Vec<String>,
    /// The whole environment (nothing is inherited); `PATH` gets a default if missing.
    pub envs: Vec<(String, String)>,
    /// In order, after the host's tree and the container's own file systems.
    pub mounts: Vec<Mount>,
    pub devices: Vec<Device>,
    pub uid: u32,
    pub gid: u32,
    /// Host paths the container must see at the same path (read-only) even where it has file
    /// systems of its own (`/tmp`, `/run`): a build directory, a test binary's directory.
    pub host_paths: Vec<PathBuf>,
    /// Let set-user-ID programs gain their privileges (`noNewPrivileges: false`), as a
    /// Kubernetes container does by default (`allowPrivilegeEscalation` unset).
    pub setuid: bool,
}

impl Spec {
    /// `args` run as root (uid 0, gid 0), with nothing mounted or set.
    pub fn new<S: Into<String>>(args: impl IntoIterator<Item = S>) -> Spec {
        Spec {
            args: args.into_iter().map(Into::into).collect(),
            ..Spec::default()
        }
    }
    pub fn user(mut self, uid: u32, gid: u32) -> Spec {
        (self.uid, self.gid) = (uid, gid);
        self
    }
    pub fn env(mut self, k: impl Into<String>, v: impl Into<String>) -> Spec {
        self.envs.push((k.into(), v.into()));
        self
    }
    pub fn mount(
        mut self,
        container: impl Into<PathBuf>,
        host: impl Into<PathBuf>,
        read_only: bool,
    ) -> Spec {
        self.mounts.push(Mount {
            container_path: container.into(),
            host_path: host.into(),
            read_only,
        });
        self
    }
    pub fn device(
        mut self,
        container: impl Into<PathBuf>,
        host: impl Into<PathBuf>,
        permissions: &str,
    ) -> Spec {
        self.devices.push(Device {
            container_path: container.into(),
            host_path: host.into(),
            permissions: permissions.into(),
        });
        self
    }
    pub fn allow_setuid(mut self) -> Spec {
        self.setuid = true;
        self
    }
    pub fn host_path(mut self, p: impl Into<PathBuf>) -> Spec {
        self.host_paths.push(p.into());
        self
    }
}

/// Whether this process can run containers: root, and `runc --version` answers. `Ok` is runc's
/// version line, `Err` the reason.
pub fn runc_version() -> Result<String, String> {
    static CHECK: OnceLock<Result<String, String>> = OnceLock::new();
    CHECK
        .get_or_init(|| {
            // SAFETY: geteuid has no preconditions.
            let euid = unsafe { libc::geteuid() };
            if euid != 0 {
                return Err(format!(
                    "not root (euid {euid}): runc needs root for namespaces, mounts and device nodes"
                ));
            }
            let out = Command::new("runc")
                .arg("--version")
                .output()
                .map_err(|e| {
                    format!("runc cannot be run ({e}): install it (`apt-get install runc`; .ci/run does)")
                })?;
            let text = String::from_utf8_lossy(&out.stdout).into_owned();
            if !out.status.success() {
                return Err(format!(
                    "`runc --version` failed ({}): {text}{}",
                    out.status,
                    String::from_utf8_lossy(&out.stderr)
                ));
            }
            Ok(text.lines().next().unwrap_or("runc").to_string())
        })
        .clone()
}

/// Whether `CI` is set (to anything but "", "0" or "false").
pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "0" && v != "false")
}

/// For a test that needs containers: true when they can run. Otherwise prints a loud
/// `SKIPPED <test>: <reason>` line (straight to stderr, past the test harness's capture) and
/// returns false, or, when `CI` is set, panics: CI must never pass a container test it did not
/// run.
pub fn usable(test: &str) -> bool {
    match runc_version() {
        Ok(_) => true,
        Err(why) if in_ci() => panic!(
            "{test}: cannot run containers: {why}. CI is set, so this fails instead of skipping"
        ),
        Err(why) => {
            let _ = writeln!(
                std::io::stderr(),
                "\n*** SKIPPED {test}: cannot run containers: {why} (with CI set this fails) ***\n"
            );
            false
        }
    }
}

/// Makes `path` a character device with `/dev/null`'s numbers (1:3), mode 0666: a stand-in for
/// a GPU's `/dev/nvidiaN` where the simulated GPU has none. Needs root.
pub fn fake_char_device(path: &Path) -> Result<(), String> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|_| format!("{}: NUL in path", path.display()))?;
    // SAFETY: a NUL-terminated path; mknod only creates a node.
    let r = unsafe { libc::mknod(c.as_ptr(), libc::S_IFCHR | 0o666, libc::makedev(1, 3)) };
    if r != 0 {
        return Err(format!(
            "mknod {}: {}",
            path.display(),
            std::io::Error::last_os_error()
        ));
    }
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666))
        .map_err(|e| format!("chmod {}: {e}", path.display()))
}

/// A finished container: runc's exit status (the process's exit code, or 128 + N after
/// signal N), and what it printed.
#[derive(Debug)]
pub struct Exited {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

impl Exited {
    /// The exit code runc reported.
    pub fn code(&self) -> Option<i32> {
        self.status.code()
    }
    /// The process exited with 0.
    pub fn success(&self) -> bool {
        self.status.success()
    }
}

impl std::fmt::Display for Exited {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}\n--- stdout\n{}--- stderr\n{}",
            self.status, self.stdout, self.stderr
        )
    }
}

/// A running container (`runc run` in the foreground, output into files of its bundle). Dropped:
/// killed if still running, `runc delete --force`d, its bundle removed.
pub struct Container {
    id: String,
    root: PathBuf,
    bundle: PathBuf,
    child: Child,
    exited: Option<ExitStatus>,
}

/// The directory for this process's bundles and runc's state (`runc --root`).
fn base_dir() -> PathBuf {
    std::env::temp_dir().join(format!("cuvisor-runc-{}", std::process::id()))
}

impl Container {
    /// Writes the bundle for `spec` and starts `runc run --no-pivot` on it.
    pub fn start(spec: &Spec) -> Result<Container, String> {
        runc_version()?;
        static SEQ: AtomicU32 = AtomicU32::new(0);
        let id = format!(
            "cuvisor-test-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        );
        let root = base_dir().join("runc");
        let bundle = base_dir().join(&id);
        let _ = std::fs::remove_dir_all(&bundle);
        std::fs::create_dir_all(&bundle).map_err(|e| io(&bundle, e))?;
        std::fs::create_dir_all(&root).map_err(|e| io(&root, e))?;
        let written = (|| {
            let config = config(spec, &bundle)?;
            let text = serde_json::to_string_pretty(&config).map_err(|e| e.to_string())?;
            let p = bundle.join("config.json");
            std::fs::write(&p, text).map_err(|e| io(&p, e))?;
            let file = |name: &str| {
                let p = bundle.join(name);
                std::fs::File::create(&p).map_err(|e| io(&p, e))
            };
            Ok::<_, String>((file("stdout")?, file("stderr")?))
        })();
        let (out, err) = match written {
            Ok(f) => f,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&bundle);
                return Err(e);
            }
        };
        let child = Command::new("runc")
            .arg("--root")
            .arg(&root)
            .args(["run", "--no-pivot", "--bundle"])
            .arg(&bundle)
            .arg(&id)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .map_err(|e| {
                let _ = std::fs::remove_dir_all(&bundle);
                format!("runc run: {e}")
            })?;
        Ok(Container {
            id,
            root,
            bundle,
            child,
            exited: None,
        })
    }

    /// The container's id (for runc).
    pub fn id(&self) -> &str {
        &self.id
    }

    /// What the container has printed to stdout so far.
    pub fn stdout(&self) -> String {
        std::fs::read_to_string(self.bundle.join("stdout")).unwrap_or_default()
    }

    /// What the container (and runc) printed to stderr so far.
    pub fn stderr(&self) -> String {
        std::fs::read_to_string(self.bundle.join("stderr")).unwrap_or_default()
    }

    fn poll(&mut self) -> Option<ExitStatus> {
        if self.exited.is_none() {
            self.exited = self.child.try_wait().ok().flatten();
        }
        self.exited
    }

    fn report(&self, what: &str) -> String {
        format!(
            "container {}: {what}\n--- stdout\n{}--- stderr\n{}",
            self.id,
            self.stdout(),
            self.stderr()
        )
    }

    /// Waits until stdout holds `needle`; returns stdout then. An error (with all output) if
    /// the container ends first or `timeout` passes.
    pub fn wait_for(&mut self, needle: &str, timeout: Duration) -> Result<String, String> {
        let deadline = Instant::now() + timeout;
        loop {
            let out = self.stdout();
            if out.contains(needle) {
                return Ok(out);
            }
            if let Some(s) = self.poll() {
                // It may have printed the line just before exiting.
                let out = self.stdout();
                if out.contains(needle) {
                    return Ok(out);
                }
                return Err(self.report(&format!("ended ({s}) without printing {needle:?}")));
            }
            if Instant::now() > deadline {
                return Err(self.report(&format!("no {needle:?} within {timeout:?}")));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// `runc kill ID KILL`: SIGKILL to the container's init (so, its pid namespace ends).
    pub fn kill(&self) -> Result<(), String> {
        let out = self
            .runc(&["kill", &self.id, "KILL"])
            .map_err(|e| format!("runc kill: {e}"))?;
        if out.status.success() {
            Ok(())
        } else {
            Err(format!(
                "runc kill {}: {}{}",
                self.id,
                out.status,
                String::from_utf8_lossy(&out.stderr)
            ))
        }
    }

    fn runc(&self, args: &[&str]) -> std::io::Result<std::process::Output> {
        Command::new("runc")
            .arg("--root")
            .arg(&self.root)
            .args(args)
            .stdin(Stdio::null())
            .output()
    }

    /// Waits for the container to end, at most `timeout` (then it is killed and this is an
    /// error with its output).
    pub fn wait(mut self, timeout: Duration) -> Result<Exited, String> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.poll() {
                return Ok(Exited {
                    status,
                    stdout: self.stdout(),
                    stderr: self.stderr(),
                });
            }
            if Instant::now() > deadline {
                let _ = self.kill();
                return Err(self.report(&format!("still running after {timeout:?}: killed")));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Container {
    fn drop(&mut self) {
        if self.poll().is_none() {
            let _ = self.kill();
            let deadline = Instant::now() + Duration::from_secs(10);
            while self.poll().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            if self.poll().is_none() {
                let _ = self.child.kill();
                let _ = self.child.wait();
            }
        }
        // `runc run` deletes its container when the process ends; this covers every other way
        // out (a runc killed or failed half way). An unknown id is an error we do not need.
        let _ = self.runc(&["delete", "--force", &self.id]);
        let _ = std::fs::remove_dir_all(&self.bundle);
        // Empty once the last container of this process is gone (runc makes --root again).
        let _ = std::fs::remove_dir(&self.root);
        let _ = std::fs::remove_dir(base_dir());
    }
}

/// Runs `spec` to its end, at most `timeout`.
pub fn run(spec: &Spec, timeout: Duration) -> Result<Exited, String> {
    Container::start(spec)?.wait(timeout)
}

fn io(p: &Path, e: std::io::Error) -> String {
    format!("{}: {e}", p.display())
}

/// Top-level paths that are the container's own file systems (not the host's).
const PRIVATE: [&str; 4] = ["/proc", "/dev", "/tmp", "/run"];

/// Docker's (and containerd's) default capability set: what a Kubernetes container gets. Only
/// the bounding set matters for a non-root user: execve gives it none of them.
pub const CAPS: [&str; 14] = [
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FSETID",
    "CAP_FOWNER",
    "CAP_MKNOD",
    "CAP_NET_RAW",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETFCAP",
    "CAP_SETPCAP",
    "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT",
    "CAP_KILL",
    "CAP_AUDIT_WRITE",
];

fn bind(dest: &Path, source: &Path, read_only: bool) -> Value {
    json!({
        "destination": dest,
        "type": "bind",
        "source": source,
        "options": ["rbind", if read_only { "ro" } else { "rw" }],
    })
}

fn kernel_fs(dest: &str, kind: &str, options: &[&str]) -> Value {
    json!({ "destination": dest, "type": kind, "source": kind, "options": options })
}

/// The bundle's `config.json` for `spec`; writes `rootfs/` and the overlay layers on the way.
fn config(spec: &Spec, bundle: &Path) -> Result<Value, String> {
    if spec.args.is_empty() {
        return Err("no args".into());
    }
    let rootfs = bundle.join("rootfs");
    std::fs::create_dir(&rootfs).map_err(|e| io(&rootfs, e))?;
    let mut mounts = Vec::new();

    // The host's tree, read-only.
    let mut top: Vec<_> = std::fs::read_dir("/")
        .map_err(|e| io(Path::new("/"), e))?
        .filter_map(Result::ok)
        .collect();
    top.sort_by_key(|e| e.file_name());
    for e in top {
        let host = Path::new("/").join(e.file_name());
        let inside = rootfs.join(e.file_name());
        let Ok(ft) = e.file_type() else { continue };
        if PRIVATE.iter().any(|p| host == Path::new(p)) {
            std::fs::create_dir(&inside).map_err(|e| io(&inside, e))?;
        } else if ft.is_symlink() {
            let target = std::fs::read_link(&host).map_err(|e| io(&host, e))?;
            std::os::unix::fs::symlink(target, &inside).map_err(|e| io(&inside, e))?;
        } else if ft.is_dir() {
            std::fs::create_dir(&inside).map_err(|e| io(&inside, e))?;
            mounts.push(bind(&host, &host, true));
        } else if ft.is_file() {
            std::fs::File::create(&inside).map_err(|e| io(&inside, e))?;
            mounts.push(bind(&host, &host, true));
        }
    }
    for p in PRIVATE {
        let inside = rootfs.join(&p[1..]);
        if !inside.exists() {
            std::fs::create_dir(&inside).map_err(|e| io(&inside, e))?;
        }
    }

    // The container's own.
    mounts.extend([
        kernel_fs("/proc", "proc", &["nosuid", "noexec", "nodev"]),
        kernel_fs(
            "/dev",
            "tmpfs",
            &["nosuid", "strictatime", "mode=755", "size=65536k"],
        ),
        kernel_fs(
            "/dev/pts",
            "devpts",
            &[
                "nosuid",
                "noexec",
                "newinstance",
                "ptmxmode=0666",
                "mode=0620",
            ],
        ),
        kernel_fs(
            "/dev/shm",
            "tmpfs",
            &["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"],
        ),
        kernel_fs("/dev/mqueue", "mqueue", &["nosuid", "noexec", "nodev"]),
        kernel_fs("/tmp", "tmpfs", &["nosuid", "nodev", "mode=1777"]),
        kernel_fs("/run", "tmpfs", &["nosuid", "nodev", "mode=755"]),
    ]);
    for p in &spec.host_paths {
        if !p.is_absolute() || !p.exists() {
            return Err(format!(
                "host path {}: must be absolute and exist",
                p.display()
            ));
        }
        mounts.push(bind(p, p, true));
    }

    // Mount points the host's read-only tree lacks: overlays, so nothing is made on the host.
    let mut missing: BTreeMap<PathBuf, Vec<(PathBuf, bool)>> = BTreeMap::new();
    let targets = spec
        .mounts
        .iter()
        .map(|m| (&m.container_path, m.host_path.is_dir()))
        .chain(spec.devices.iter().map(|d| (&d.container_path, false)));
    for (dest, is_dir) in targets {
        if !dest.is_absolute() {
            return Err(format!("{}: not an absolute path", dest.display()));
        }
        if let Some((dir, rest)) = missing_mount_point(dest)? {
            missing.entry(dir).or_default().push((rest, is_dir));
        }
    }
    let mut dirs: Vec<_> = missing.into_iter().collect();
    dirs.sort_by_key(|(d, _)| d.components().count());
    for (i, (dir, entries)) in dirs.into_iter().enumerate() {
        let layer = if dir == Path::new("/") {
            rootfs.clone()
        } else {
            bundle.join(format!("layer-{i}"))
        };
        for (rest, is_dir) in entries {
            let p = layer.join(&rest);
            let parent = p.parent().unwrap_or(&layer);
            std::fs::create_dir_all(parent).map_err(|e| io(parent, e))?;
            let made = if is_dir {
                std::fs::create_dir_all(&p)
            } else {
                std::fs::File::create(&p).map(drop)
            };
            made.map_err(|e| io(&p, e))?;
        }
        if layer != rootfs {
            let (l, d) = (layer.to_string_lossy(), dir.to_string_lossy());
            if l.contains([':', ',']) || d.contains([':', ',']) {
                return Err(format!("overlay of {d} with {l}: ':' or ',' in a path"));
            }
            mounts.push(json!({
                "destination": dir,
                "type": "overlay",
                "source": "overlay",
                "options": [format!("lowerdir={l}:{d}")],
            }));
        }
    }

    for m in &spec.mounts {
        if !m.host_path.exists() {
            return Err(format!(
                "mount {} at {}: no such host path",
                m.host_path.display(),
                m.container_path.display()
            ));
        }
        mounts.push(bind(&m.container_path, &m.host_path, m.read_only));
    }

    // Device nodes: as a CRI runtime resolves a device spec.
    let mut devices = Vec::new();
    let mut rules = vec![json!({ "allow": false, "access": "rwm" })];
    for d in &spec.devices {
        let md = std::fs::metadata(&d.host_path).map_err(|e| {
            format!(
                "device {} for {}: {e} (the node must exist on the host)",
                d.host_path.display(),
                d.container_path.display()
            )
        })?;
        let ft = md.file_type();
        let kind = if ft.is_char_device() {
            "c"
        } else if ft.is_block_device() {
            "b"
        } else {
            return Err(format!(
                "device {}: not a device node",
                d.host_path.display()
            ));
        };
        let rdev = md.rdev();
        let (major, minor) = (libc::major(rdev), libc::minor(rdev));
        devices.push(json!({
            "path": d.container_path,
            "type": kind,
            "major": major,
            "minor": minor,
            "fileMode": md.mode() & 0o777,
            "uid": md.uid(),
            "gid": md.gid(),
        }));
        rules.push(json!({
            "allow": true,
            "type": kind,
            "major": major,
            "minor": minor,
            "access": d.permissions,
        }));
    }

    let mut env: Vec<String> = spec.envs.iter().map(|(k, v)| format!("{k}={v}")).collect();
    if !spec.envs.iter().any(|(k, _)| k == "PATH") {
        env.push("PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into());
    }
    Ok(json!({
        "ociVersion": "1.0.2",
        "process": {
            "terminal": false,
            "user": { "uid": spec.uid, "gid": spec.gid },
            "args": spec.args,
            "env": env,
            "cwd": "/",
            "capabilities": { "bounding": CAPS, "effective": CAPS, "permitted": CAPS },
            "rlimits": [{ "type": "RLIMIT_NOFILE", "hard": 1024, "soft": 1024 }],
            "noNewPrivileges": !spec.setuid,
        },
        "root": { "path": "rootfs", "readonly": true },
        "hostname": "cuvisor-tenant",
        "mounts": mounts,
        "linux": {
            "namespaces": [
                { "type": "pid" },
                { "type": "mount" },
                { "type": "ipc" },
                { "type": "uts" },
            ],
            "devices": devices,
            "resources": { "devices": rules },
            "maskedPaths": [
                "/proc/acpi", "/proc/asound", "/proc/kcore", "/proc/keys",
                "/proc/latency_stats", "/proc/timer_list", "/proc/timer_stats",
                "/proc/sched_debug", "/proc/scsi", "/sys/firmware",
            ],
            "readonlyPaths": [
                "/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger",
            ],
        },
    }))
}

/// Where the host's read-only tree lacks the mount point `dest`, following symlinks as runc
/// does inside the root file system: (the deepest directory that exists, the rest of the path).
/// None when it exists, or lies in one of the container's own file systems (where runc makes it).
fn missing_mount_point(dest: &Path) -> Result<Option<(PathBuf, PathBuf)>, String> {
    fn parts(p: &Path) -> Vec<OsString> {
        p.components()
            .filter_map(|c| match c {
                Component::Normal(s) => Some(s.to_os_string()),
                Component::ParentDir => Some("..".into()),
                _ => None,
            })
            .collect()
    }
    let mut todo: VecDeque<OsString> = parts(dest).into();
    let mut cur = PathBuf::from("/");
    let mut links = 0;
    while let Some(c) = todo.pop_front() {
        if c == ".." {
            cur.pop();
            continue;
        }
        let next = cur.join(&c);
        if PRIVATE.iter().any(|p| next.starts_with(p)) {
            return Ok(None);
        }
        match std::fs::symlink_metadata(&next) {
            Ok(m) if m.file_type().is_symlink() => {
                links += 1;
                if links > 40 {
                    return Err(format!("{}: too many symlinks", dest.display()));
                }
                let target = std::fs::read_link(&next).map_err(|e| io(&next, e))?;
                if target.is_absolute() {
                    cur = PathBuf::from("/");
                }
                for p in parts(&target).into_iter().rev() {
                    todo.push_front(p);
                }
            }
            Ok(m) if !m.is_dir() && !todo.is_empty() => {
                return Err(format!(
                    "{}: {} is not a directory",
                    dest.display(),
                    next.display()
                ));
            }
            Ok(_) => cur = next,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let mut rest = PathBuf::from(c);
                rest.extend(todo);
                return Ok(Some((cur, rest)));
            }
            Err(e) => return Err(io(&next, e)),
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mount_points_are_found_missing_through_symlinks_and_not_in_private_trees() {
        // Not under /tmp or /run (the container's own trees): the build directory may be there
        // (a clone under /tmp), so /var/tmp.
        let d = Path::new("/var/tmp").join(format!("cuvisor-mp-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(d.join("real/sub")).unwrap();
        std::os::unix::fs::symlink(d.join("real"), d.join("abs")).unwrap();
        std::os::unix::fs::symlink("real/sub", d.join("rel")).unwrap();
        let got = |p: &str| missing_mount_point(&d.join(p)).unwrap();
        assert_eq!(got("real/sub"), None);
        assert_eq!(
            got("real/sub/a/b"),
            Some((d.join("real/sub"), PathBuf::from("a/b")))
        );
        assert_eq!(got("abs/x"), Some((d.join("real"), PathBuf::from("x"))));
        assert_eq!(got("rel/y"), Some((d.join("real/sub"), PathBuf::from("y"))));
        std::fs::remove_dir_all(&d).unwrap();
        // /var/run -> /run on Debian: the container's own tmpfs.
        assert_eq!(
            missing_mount_point(Path::new("/run/cuvisor/state")).unwrap(),
            None
        );
        assert_eq!(
            missing_mount_point(Path::new("/dev/nvidia0")).unwrap(),
            None
        );
    }
}
