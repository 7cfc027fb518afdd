//! The plugin's image (scripts/build-image.sh: target/image/cuvisor-image.oci.tar) run as the
//! DaemonSet runs it, in runc, on the simulated GPU: unpacked by umoci into a bundle whose
//! process is the image's own (entrypoint, arguments, environment, user), with the DaemonSet's
//! mounts (the ConfigMap at /etc/cuvisor, kubelet's device-plugins and pod-resources
//! directories, the state root at its host path), the simulated libnvidia-ml.so.1 bind-mounted
//! where the NVIDIA container toolkit puts the driver's on a Debian/Ubuntu node
//! (/usr/lib/x86_64-linux-gnu/, its host path; `CUVISOR_SIM` stands for the driver), a
//! read-only root file system, and the default capabilities of a CRI runtime plus
//! CAP_SYS_ADMIN (each memory allocation's ledger tmpfs). No init container: the plugin
//! installs libcuvisor.so from the image onto the "host" itself (`[host] install_from`).
//!
//! The mounts and the configuration are a fixed list here, mirroring deploy/daemonset.yaml and
//! deploy/configmap.yaml (the test checks that the DaemonSet does mount each of these paths).
//!
//! Needs root, runc, umoci and the archive. Without one of them the test prints a loud
//! SKIPPED line; with CI set it fails.

mod support;

use cuvisor_device_plugin::api;
use cuvisor_testkit::container::{in_ci, usable};
use serde_json::{json, Value};
use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use support::kubelet::{client, Kubelet};

const EXE: &str = env!("CARGO_BIN_EXE_cuvisor-device-plugin");
/// scripts/build-image.sh tags the image with the crates' version.
const TAG: &str = env!("CARGO_PKG_VERSION");

// Inside the plugin's container, as the DaemonSet and its ConfigMap have them.
const CONFIG_DIR: &str = "/etc/cuvisor";
const DEVICE_PLUGINS: &str = "/var/lib/kubelet/device-plugins";
const POD_RESOURCES: &str = "/var/lib/kubelet/pod-resources";
const STATE_ROOT: &str = "/var/lib/cuvisor";
/// The toolkit mounts a driver library at its path on the node: here a Debian/Ubuntu one's.
const NVML_AT: &str = "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1";
/// The library in the image, and where the plugin installs it on the node.
const IMAGE_LIBRARY: &str = "/usr/local/lib/cuvisor/libcuvisor.so";
const HOST_LIBRARY: &str = "/var/lib/cuvisor/lib/libcuvisor.so";

/// The DaemonSet's ConfigMap (deploy/configmap.yaml), with `[host] install_from`.
const CONFIG: &str = r#"version = 1
socket_dir = "/var/lib/kubelet/device-plugins"
state_root = "/var/lib/cuvisor"
metrics_port = 9400

[pod_resources]
socket = "/var/lib/kubelet/pod-resources/kubelet.sock"
refresh_seconds = 10

[resources]
gpu = "cuvisor.io/gpu"
gpu_memory = "cuvisor.io/gpu-memory"
memory_unit = "1Gi"

[host]
library = "/var/lib/cuvisor/lib/libcuvisor.so"
install_from = "/usr/local/lib/cuvisor/libcuvisor.so"
"#;

fn archive() -> PathBuf {
    match std::env::var_os("CUVISOR_IMAGE_ARCHIVE") {
        Some(p) if !p.is_empty() => PathBuf::from(p),
        _ => Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/image/cuvisor-image.oci.tar"),
    }
}

/// Not runnable here: a loud SKIPPED line, or, with CI set, a failure.
fn cannot(test: &str, why: &str) -> bool {
    assert!(
        !in_ci(),
        "{test}: {why}. CI is set, so this fails instead of skipping"
    );
    // Straight to stderr, past the test harness's capture.
    let _ = writeln!(
        std::io::stderr(),
        "\n*** SKIPPED {test}: {why} (with CI set this fails) ***\n"
    );
    false
}

fn runnable(test: &str) -> bool {
    if !usable(test) {
        return false;
    }
    let a = archive();
    if !a.is_file() {
        return cannot(
            test,
            &format!(
                "no image archive at {} (build it: scripts/build-shipped.sh && scripts/build-image.sh)",
                a.display()
            ),
        );
    }
    match Command::new("umoci").arg("--version").output() {
        Ok(o) if o.status.success() => true,
        _ => cannot(test, "umoci is not installed (apt-get install umoci)"),
    }
}

fn run(cmd: &mut Command) {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?}: {}\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The test's directory: the image's layout and bundle, and the "node"'s directories.
struct Scratch(PathBuf);

impl Scratch {
    fn new(tag: &str) -> Scratch {
        let p = std::env::temp_dir().join(format!("cuvisor-image-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        for d in ["oci", "dp", "pod-resources", "state", "config", "runc"] {
            std::fs::create_dir_all(p.join(d)).unwrap();
        }
        Scratch(p)
    }
    fn at(&self, p: &str) -> PathBuf {
        self.0.join(p)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `runc run` of a bundle, in the foreground, output into files; killed and deleted when
/// dropped.
struct Running {
    id: String,
    root: PathBuf,
    out: PathBuf,
    child: Child,
}

impl Running {
    fn start(s: &Scratch, bundle: &Path) -> Running {
        let id = s.0.file_name().map_or_else(
            || "cuvisor-image".into(),
            |n| n.to_string_lossy().into_owned(),
        );
        let root = s.at("runc");
        let out = s.at("container.log");
        let log = std::fs::File::create(&out).unwrap();
        let child = Command::new("runc")
            .arg("--root")
            .arg(&root)
            .args(["run", "--no-pivot", "--bundle"])
            .arg(bundle)
            .arg(&id)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("runc run");
        Running {
            id,
            root,
            out,
            child,
        }
    }
    /// What the container (and runc) printed so far.
    fn output(&self) -> String {
        std::fs::read_to_string(&self.out).unwrap_or_default()
    }
    fn ended(&mut self) -> bool {
        self.child.try_wait().ok().flatten().is_some()
    }
    fn runc(&self, args: &[&str]) {
        let _ = Command::new("runc")
            .arg("--root")
            .arg(&self.root)
            .args(args)
            .stdin(Stdio::null())
            .output();
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.runc(&["kill", &self.id, "KILL"]);
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.child.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.runc(&["delete", "--force", &self.id]);
    }
}

/// The paths deploy/daemonset.yaml mounts into a container (`mountPath:` lines).
fn daemonset_mount_paths() -> Vec<String> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/daemonset.yaml");
    let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    text.lines()
        .filter_map(|l| l.trim().trim_start_matches("- ").strip_prefix("mountPath:"))
        .map(|v| v.trim().trim_matches(['"', '\'']).to_string())
        .collect()
}

fn bind(dest: &str, source: &Path, read_only: bool) -> Value {
    json!({
        "destination": dest,
        "type": "bind",
        "source": source,
        "options": ["rbind", if read_only { "ro" } else { "rw" }],
    })
}

/// How the driver's libnvidia-ml.so.1 reaches the plugin's container: the NVIDIA container
/// toolkit mounts it at its path on the node.
#[derive(Clone, Copy, Debug)]
enum Nvml {
    /// In a directory the image's loader searches on its own (a Debian/Ubuntu node's
    /// /usr/lib/x86_64-linux-gnu/): bind-mounted there.
    Searched(&'static str),
    /// In a directory it does not search (a RHEL-family node's /usr/lib64/), found through the
    /// ld.so.cache the toolkit's update-ldcache hook writes. The hook (NVIDIA/nvidia-container-toolkit
    /// `internal/ldconfig/ldconfig.go`, `UpdateLDCache`) runs the node's ldconfig on the container's
    /// root with `-f /etc/ld.so.conf -C /etc/ld.so.cache`, after creating /etc/ld.so.conf if
    /// missing, a drop-in `00-nvcr-*.conf` of the libraries' directories and a `zz-nvcr-*.conf` of
    /// the system directories it expects of the image (a non-Debian list when the image has no
    /// /etc/debian_version, as this one has not). Done so here, on the unpacked root, with the
    /// library placed at its path in it.
    Cached(&'static str),
}

/// The image unpacked into `s/bundle`, its runtime configuration (umoci's, from the image's)
/// given the DaemonSet's mounts, environment and security context, and the driver's NVML (the
/// simulated `lib`) as the toolkit gives it. Returns the bundle.
fn bundle(s: &Scratch, lib: &Path, nvml: Nvml, preset: &str) -> PathBuf {
    run(Command::new("tar")
        .arg("-xf")
        .arg(archive())
        .arg("-C")
        .arg(s.at("oci")));
    let bundle = s.at("bundle");
    run(Command::new("umoci")
        .arg("unpack")
        .arg("--image")
        .arg(format!("{}:{TAG}", s.at("oci").display()))
        .arg(&bundle));
    let path = bundle.join("config.json");
    let mut c: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();

    // The image's own process, as its config gives it: checked, then run as it is.
    let p = &mut c["process"];
    assert_eq!(
        p["args"],
        json!([
            "/usr/local/bin/cuvisor-device-plugin",
            "--config",
            "/etc/cuvisor/config.toml"
        ]),
        "the image's entrypoint"
    );
    let env: Vec<String> = serde_json::from_value(p["env"].clone()).unwrap();
    for want in [
        "NVIDIA_VISIBLE_DEVICES=all",
        "NVIDIA_DRIVER_CAPABILITIES=compute,utility",
    ] {
        assert!(
            env.iter().any(|e| e == want),
            "the image's env lacks {want}: {env:?}"
        );
    }
    p["env"]
        .as_array_mut()
        .unwrap()
        .push(json!(format!("CUVISOR_SIM={preset}")));
    p["terminal"] = json!(false);
    // What a Kubernetes container gets (testkit's default set), and CAP_SYS_ADMIN for the ledger
    // directories' tmpfs.
    let caps: Vec<&str> = cuvisor_testkit::container::CAPS
        .into_iter()
        .chain(["CAP_SYS_ADMIN"])
        .collect();
    p["capabilities"] = json!({ "bounding": caps, "effective": caps, "permitted": caps });
    c["root"]["readonly"] = json!(true);
    c["hostname"] = json!("cuvisor-device-plugin");

    std::fs::write(s.at("config/config.toml"), CONFIG).unwrap();
    let mounts = c["mounts"].as_array_mut().unwrap();
    mounts.extend([
        bind(CONFIG_DIR, &s.at("config"), true),
        bind(DEVICE_PLUGINS, &s.at("dp"), false),
        bind(POD_RESOURCES, &s.at("pod-resources"), true),
        bind(STATE_ROOT, &s.at("state"), false),
    ]);
    match nvml {
        Nvml::Searched(at) => mounts.push(bind(at, lib, true)),
        Nvml::Cached(at) => {
            let root = bundle.join("rootfs");
            let inside = root.join(&at[1..]);
            std::fs::create_dir_all(inside.parent().unwrap()).unwrap();
            std::fs::copy(lib, &inside).unwrap();
            let dir = Path::new(at).parent().unwrap().display().to_string();
            let confd = root.join("etc/ld.so.conf.d");
            std::fs::write(confd.join("00-nvcr-test.conf"), format!("{dir}\n")).unwrap();
            std::fs::write(
                confd.join("zz-nvcr-test.conf"),
                "/lib\n/usr/lib\n/lib64\n/usr/lib64\n/libx32\n/usr/libx32\n",
            )
            .unwrap();
            run(Command::new("ldconfig").arg("-r").arg(&root).args([
                "-f",
                "/etc/ld.so.conf",
                "-C",
                "/etc/ld.so.cache",
            ]));
        }
    }
    std::fs::write(&path, serde_json::to_string_pretty(&c).unwrap()).unwrap();
    bundle
}

/// The host path behind a path inside the plugin's container under the state root.
fn on_host(s: &Scratch, inside: &str) -> PathBuf {
    let rest = Path::new(inside)
        .strip_prefix(STATE_ROOT)
        .unwrap_or_else(|_| panic!("{inside}: not under the state root {STATE_ROOT}"));
    s.at("state").join(rest)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_image_runs_as_the_daemonset_runs_it_registers_and_allocates_the_library_it_installed()
{
    runs_as_the_daemonset(
        "the_image_runs_as_the_daemonset_runs_it",
        Nvml::Searched(NVML_AT),
    )
    .await;
}

/// On a RHEL-family node the toolkit puts the driver's NVML in /usr/lib64, which the image's
/// (Debian's) loader does not search: it is found through the ld.so.cache the toolkit's hook
/// writes from the image's /etc/ld.so.conf and drop-ins.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_rhel_node_the_driver_nvml_in_usr_lib64_is_found_through_the_toolkits_ldcache() {
    runs_as_the_daemonset(
        "on_a_rhel_node_the_driver_nvml_in_usr_lib64",
        Nvml::Cached("/usr/lib64/libnvidia-ml.so.1"),
    )
    .await;
}

/// The image run as the DaemonSet runs it, the driver's NVML given as `nvml`: it installs the
/// library on the node, registers both resources, and Allocate mounts the library it installed.
async fn runs_as_the_daemonset(test: &str, nvml: Nvml) {
    if !runnable(test) {
        return;
    }
    // The DaemonSet mounts what this test mounts.
    let paths = daemonset_mount_paths();
    for p in [CONFIG_DIR, DEVICE_PLUGINS, POD_RESOURCES, STATE_ROOT] {
        assert!(
            paths.iter().any(|m| m == p),
            "deploy/daemonset.yaml mounts no {p} (mountPaths: {paths:?}): this test and the \
             manifest disagree"
        );
    }
    let built = cuvisor_testkit::built(Path::new(EXE).parent().unwrap());
    let lib = built.join("sim/libnvidia-ml.so.1");
    assert!(
        lib.is_file(),
        "{}: the simulated NVML is not built",
        lib.display()
    );

    let s = Scratch::new(match nvml {
        Nvml::Searched(_) => "searched",
        Nvml::Cached(_) => "cached",
    });
    let bundle = bundle(&s, &lib, nvml, "single");
    let rootfs = bundle.join("rootfs");
    // Distroless: no shell to run an init container's script with.
    for sh in ["bin/sh", "usr/bin/sh", "bin/bash"] {
        assert!(!rootfs.join(sh).exists(), "the image has /{sh}");
    }
    let image_lib = std::fs::read(rootfs.join(&IMAGE_LIBRARY[1..])).expect("the image's library");

    let mut kubelet = Kubelet::start(&s.at("dp"));
    let mut plugin = Running::start(&s, &bundle);
    // Both resources register, within a minute, while the container runs.
    let mut regs = std::collections::HashMap::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while regs.len() < 2 {
        if let Some(r) = kubelet.next(Duration::from_millis(250)).await {
            regs.insert(r.resource_name.clone(), r);
            continue;
        }
        let why = if plugin.ended() {
            "the container ended"
        } else if Instant::now() > deadline {
            "a minute passed"
        } else {
            continue;
        };
        panic!(
            "{why} with {} of 2 registrations; the container printed:\n{}",
            regs.len(),
            plugin.output()
        );
    }
    let mem = &regs["cuvisor.io/gpu-memory"];
    assert_eq!(mem.version, "v1beta1");

    // What the plugin did before serving: the library, from its image, on the node.
    let installed = on_host(&s, HOST_LIBRARY);
    let out = plugin.output();
    assert!(
        out.contains(&format!("installed {IMAGE_LIBRARY} at {HOST_LIBRARY}")),
        "{out}"
    );
    let bytes = std::fs::read(&installed).unwrap_or_else(|e| {
        panic!(
            "{}: {e}; the container printed:\n{out}",
            installed.display()
        )
    });
    assert!(
        bytes == image_lib,
        "the installed library is not the image's"
    );
    let mode = std::fs::metadata(&installed).unwrap().permissions().mode();
    assert_eq!(mode & 0o7777, 0o755);

    // Allocate over the socket the plugin serves in kubelet's directory.
    let mut c = client(&s.at("dp"), &mem.endpoint).await;
    let mut watch = c.list_and_watch(api::Empty {}).await.unwrap().into_inner();
    let devices = watch
        .message()
        .await
        .unwrap()
        .expect("a first list")
        .devices;
    assert!(devices.len() >= 2, "{devices:?}");
    let ids: Vec<String> = devices[..2].iter().map(|d| d.id.clone()).collect();
    let answer = c
        .allocate(api::AllocateRequest {
            container_requests: vec![api::ContainerAllocateRequest { devices_ids: ids }],
        })
        .await
        .unwrap_or_else(|e| panic!("Allocate: {e}; the container printed:\n{}", plugin.output()))
        .into_inner()
        .container_responses
        .remove(0);
    let lib = answer
        .mounts
        .iter()
        .find(|m| m.container_path == IMAGE_LIBRARY)
        .unwrap_or_else(|| panic!("no mount of the library: {:?}", answer.mounts));
    assert_eq!(lib.host_path, HOST_LIBRARY, "the library Allocate mounts");
    assert!(lib.read_only);
    // Every host path of the answer is the node's: under the state root, mounted at its host
    // path, and there.
    for m in &answer.mounts {
        let p = on_host(&s, &m.host_path);
        assert!(
            p.exists(),
            "{} (for {}): not on the node",
            m.host_path,
            m.container_path
        );
    }
    drop(plugin);
}
