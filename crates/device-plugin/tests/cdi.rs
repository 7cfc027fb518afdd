//! CDI for real: the specs the plugin writes against the CDI project's JSON schema, and tenants
//! run in runc from nothing but the CDI device names Allocate answered, resolved and applied as a
//! CDI-enabled runtime does (tests/support/cdi.rs), held to their quota.
//!
//! The node: the plugin in this process (its library API; the answer as kubelet receives it,
//! through `server::response`, as tests/containers.rs takes it) on the simulated `single` GPU
//! (16 GiB, 1 GiB units), with `[cdi] strategy` `cdi-cri` or `cdi-annotations` and `spec_dir`
//! a directory of the test's. Beside it, in a lower-priority directory (as `/etc/cdi` is to
//! `/var/run/cdi`), a stand-in for NVIDIA's generated spec (`nvidia-ctk cdi generate`: kind
//! `nvidia.com/gpu`, the GPU named by index and by UUID, the driver's libraries and control
//! nodes spec-wide, `NVIDIA_VISIBLE_DEVICES=void`): the driver it brings is the simulator's
//! `libcuda.so.1` and `libnvidia-ml.so.1`, bind-mounted into `/usr/lib/x86_64-linux-gnu` (the
//! loader's system search path on Debian/Ubuntu, where the toolkit mounts the host's driver
//! libraries), so the tenant finds the "driver" only through CDI. The real spec's
//! `createContainer` hooks (ldcache, symlinks) are left out: the harness refuses hooks.
//!
//! The schema test needs Python's `jsonschema` in `target/ci-tools/jsonschema` (.ci/run installs
//! it); the container tests need root and runc. Without them each prints a loud SKIPPED line, or
//! fails when CI is set.

mod support;

use cuvisor_device_plugin::cdi::{self, ContainerEdits, DeviceNode, Spec};
use cuvisor_device_plugin::config::{Cdi, Config, HostPaths, LedgerDir, PodResources};
use cuvisor_device_plugin::plugin::Plugin;
use cuvisor_device_plugin::registry::Kind;
use cuvisor_device_plugin::{api, server};
use cuvisor_sim::model::Model;
use cuvisor_sim::state::Shared;
use cuvisor_testkit::container::{self, Spec as Container};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering::Acquire;
use std::sync::OnceLock;
use std::time::Duration;
use support::cdi::{apply, names_of, Registry};

const GIB: u64 = 1 << 30;
const LIMIT: Duration = Duration::from_secs(60);
/// Where every container sees the simulator's state directory (the "hardware"; not CDI's).
const SIM_DIR: &str = "/run/cuvisor-sim";
/// Where NVIDIA's spec puts the driver's libraries (Debian/Ubuntu hosts).
const DRIVER_LIBS: &str = "/usr/lib/x86_64-linux-gnu";

fn built() -> &'static Path {
    cuvisor_testkit::built(&cuvisor_testkit::profile_dir_of_test())
}

fn tenant() -> &'static Path {
    static EXE: OnceLock<PathBuf> = OnceLock::new();
    EXE.get_or_init(|| {
        cuvisor_testkit::compile_c(
            &Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/c/tenant.c"),
            Path::new(env!("CARGO_TARGET_TMPDIR")),
            "cdi_tenant",
        )
    })
}

struct Node {
    dir: PathBuf,
    plugin: Plugin,
    sim: Shared,
}

fn shared_dir(p: &Path) {
    std::fs::create_dir_all(p).unwrap();
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o1777)).unwrap();
}

impl Node {
    /// The plugin under `strategy`; `tmpfs`: each ledger directory a tmpfs (needs root).
    fn new(tag: &str, strategy: &str, tmpfs: bool) -> Node {
        let dir = std::env::temp_dir().join(format!("cuvisor-cdi-{tag}-{}", std::process::id()));
        cuvisor_device_plugin::ledger_dir::detach_all_under(&dir);
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("dev")).unwrap();
        let model = Model::load("single").unwrap();
        shared_dir(&dir.join("sim"));
        let state = dir.join("sim/sim.state");
        let sim = Shared::attach_at(&model, &state).unwrap();
        std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o666)).unwrap();
        let cfg = Config {
            socket_dir: dir.join("dp"),
            state_root: dir.join("state"),
            pod_resources: PodResources {
                socket: PathBuf::new(),
                ..PodResources::default()
            },
            host: HostPaths {
                library: built().join("deps/libcuvisor.so"),
                dev_dir: dir.join("dev"),
                ..HostPaths::default()
            },
            ledger_dir: LedgerDir {
                mount: if tmpfs { "tmpfs" } else { "none" }.into(),
                ..LedgerDir::default()
            },
            cdi: Cdi {
                strategy: strategy.into(),
                spec_dir: dir.join("run-cdi"),
                ..Cdi::default()
            },
            ..Config::default()
        };
        let (_, health) = cuvisor_device_plugin::health_channel();
        let plugin = Plugin::new(cfg, support::from_model(&model), health).unwrap();
        let node = Node { dir, plugin, sim };
        node.write_nvidia_spec();
        node
    }

    /// The static spec directory (lower priority), holding NVIDIA's stand-in spec.
    fn etc_cdi(&self) -> PathBuf {
        self.dir.join("etc-cdi")
    }

    fn spec_dirs(&self) -> [PathBuf; 2] {
        [self.etc_cdi(), self.plugin.cdi().spec_dir.clone()]
    }

    /// NVIDIA's spec, as `nvidia-ctk cdi generate` lays it out, for the simulated GPU.
    fn nvidia_spec(&self) -> Spec {
        let dev = |name: &str, make: bool| {
            let host = self.dir.join("dev").join(name);
            if make && !host.exists() && container::runc_version().is_ok() {
                container::fake_char_device(&host).unwrap();
            }
            DeviceNode {
                path: format!("/dev/{name}"),
                host_path: Some(host.to_string_lossy().into_owned()),
                ..DeviceNode::default()
            }
        };
        let gpu = &self.plugin.inventory().gpus()[0];
        let node = format!("nvidia{}", gpu.minor);
        let lib = |name: &str| cdi::CdiMount {
            host_path: built()
                .join("sim")
                .join(name)
                .to_string_lossy()
                .into_owned(),
            container_path: format!("{DRIVER_LIBS}/{name}"),
            options: ["ro", "nosuid", "nodev", "bind"].map(String::from).to_vec(),
            kind: None,
        };
        let per_gpu = ContainerEdits {
            device_nodes: vec![dev(&node, true)],
            ..ContainerEdits::default()
        };
        let mut spec = Spec {
            kind: "nvidia.com/gpu".into(),
            devices: [gpu.index.to_string(), gpu.uuid.clone()]
                .into_iter()
                .map(|name| cdi::Device {
                    name,
                    container_edits: per_gpu.clone(),
                    ..cdi::Device::default()
                })
                .collect(),
            container_edits: ContainerEdits {
                env: vec!["NVIDIA_VISIBLE_DEVICES=void".into()],
                device_nodes: vec![dev("nvidiactl", true), dev("nvidia-uvm", true)],
                mounts: vec![lib("libcuda.so.1"), lib("libnvidia-ml.so.1")],
                ..ContainerEdits::default()
            },
            ..Spec::default()
        };
        spec.cdi_version = cdi::min_version(&spec).into();
        spec
    }

    fn write_nvidia_spec(&self) {
        std::fs::create_dir_all(self.etc_cdi()).unwrap();
        let text = serde_json::to_vec_pretty(&self.nvidia_spec()).unwrap();
        std::fs::write(self.etc_cdi().join("nvidia.json"), text).unwrap();
    }

    /// Allocate for memory units `units` of GPU 0, as kubelet receives the answer.
    fn allocate(&self, units: std::ops::Range<u32>) -> api::ContainerAllocateResponse {
        let inv = self.plugin.inventory();
        let ids: Vec<String> = units.map(|k| inv.unit_id(0, k)).collect();
        server::response(self.plugin.allocate(Kind::Memory, &ids).unwrap())
    }

    /// The tenant's container: the CDI devices `names` resolved from the spec directories and
    /// applied, as `uid`, running the tenant with `steps`; plus the simulator's state (the
    /// "hardware"). Nothing else of cuvisor's or NVIDIA's.
    fn container(&self, names: &[String], uid: u32, steps: &[&str]) -> Result<Container, String> {
        let dirs = self.spec_dirs();
        let registry = Registry::load(&[&dirs[0], &dirs[1]])?;
        let edits = registry.resolve(names)?;
        let args = std::iter::once(tenant().to_string_lossy().into_owned())
            .chain(steps.iter().map(|s| s.to_string()));
        let c = Container::new(args)
            .user(uid, uid)
            .env("CUVISOR_SIM", "single")
            .env("CUVISOR_SIM_STATE", format!("{SIM_DIR}/sim.state"))
            .mount(SIM_DIR, self.dir.join("sim"), false)
            .host_path(built())
            .host_path(tenant().parent().unwrap());
        apply(c, &edits)
    }

    fn used(&self) -> u64 {
        self.sim.device(0).mem_used.load(Acquire)
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        cuvisor_device_plugin::ledger_dir::detach_all_under(&self.dir);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The CDI names of an answer (`cdi_devices`, or the `cdi.k8s.io/` annotation).
fn names(r: &api::ContainerAllocateResponse) -> Vec<String> {
    let devs: Vec<String> = r.cdi_devices.iter().map(|d| d.name.clone()).collect();
    names_of(&devs, &r.annotations.clone().into_iter().collect())
}

/// The Python that has `jsonschema`: `CUVISOR_JSONSCHEMA_PYTHON`, else the one .ci/run installs.
fn jsonschema_python(test: &str) -> Option<PathBuf> {
    let p = std::env::var_os("CUVISOR_JSONSCHEMA_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../../target/ci-tools/jsonschema/bin/python")
        });
    let ok = std::process::Command::new(&p)
        .args(["-c", "import jsonschema, referencing"])
        .output()
        .is_ok_and(|o| o.status.success());
    if ok {
        return Some(p);
    }
    let why = format!(
        "no Python with jsonschema at {} (.ci/run installs it: python3 -m venv \
         target/ci-tools/jsonschema && target/ci-tools/jsonschema/bin/pip install \
         jsonschema==4.26.0)",
        p.display()
    );
    if container::in_ci() {
        panic!("{test}: {why}. CI is set, so this fails instead of skipping");
    }
    eprintln!("\n*** SKIPPED {test}: {why} (with CI set this fails) ***\n");
    None
}

/// Validates `files` against the vendored schema: each file's verdict line.
fn validate(python: &Path, files: &[&Path]) -> Vec<String> {
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = std::process::Command::new(python)
        .arg(here.join("tests/support/cdi_validate.py"))
        .arg(here.join("tests/fixtures/cdi"))
        .args(files)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        matches!(out.status.code(), Some(0 | 1)),
        "the validator failed: {}\n{text}{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    text.lines().map(String::from).collect()
}

/// The spec the plugin writes for a memory allocation, and NVIDIA's stand-in, are valid
/// against the CDI project's schema (v1.1.0); the validator itself passes the schema's own good
/// example and fails its bad one, and fails our spec with its device's `containerEdits` taken
/// out (a required property), so a verdict of OK means something.
#[test]
fn the_cdi_specs_the_plugin_writes_validate_against_the_cdi_schema() {
    let test = "the_cdi_specs_the_plugin_writes_validate_against_the_cdi_schema";
    let Some(python) = jsonschema_python(test) else {
        return;
    };
    let node = Node::new("schema", "cdi-cri", false);
    let r = node.allocate(0..3);
    let id = &r.annotations["cuvisor.io/allocation"];
    let ours = cdi::spec_file(&node.plugin.cdi().spec_dir, id);
    assert!(ours.exists(), "no spec at {}", ours.display());
    let nvidia = node.etc_cdi().join("nvidia.json");
    let mut broken: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&ours).unwrap()).unwrap();
    broken["devices"][0]
        .as_object_mut()
        .unwrap()
        .remove("containerEdits");
    let broken_file = node.dir.join("broken.json");
    std::fs::write(&broken_file, broken.to_string()).unwrap();
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/cdi");
    let good = fixtures.join("good-spec-example.json");
    let bad = fixtures.join("bad-empty.json");
    let got = validate(&python, &[&ours, &nvidia, &good, &bad, &broken_file]);
    let verdict = |p: &Path| {
        got.iter()
            .find(|l| {
                l.split_once(' ')
                    .is_some_and(|(_, rest)| rest.starts_with(&*p.to_string_lossy()))
            })
            .cloned()
            .unwrap_or_else(|| panic!("no verdict for {}: {got:?}", p.display()))
    };
    assert!(verdict(&ours).starts_with("OK "), "{got:?}");
    assert!(verdict(&nvidia).starts_with("OK "), "{got:?}");
    assert!(verdict(&good).starts_with("OK "), "{got:?}");
    assert!(verdict(&bad).starts_with("INVALID "), "{got:?}");
    let b = verdict(&broken_file);
    assert!(
        b.starts_with("INVALID ") && b.contains("'containerEdits' is a required property"),
        "{got:?}"
    );
}

/// Under `cdi-cri` and `cdi-annotations`, Allocate's answer for 2 units carries no env, mounts
/// or device nodes of its own: the tenant's container is made from the CDI devices it names
/// alone (NVIDIA's GPU, bringing the "driver"; cuvisor's allocation, bringing the library, the
/// preload file, the limits file and the ledger), as uid 1000 in its own pid namespace. It sees
/// the 2 GiB quota as the GPU's memory, gets all of it, and is refused
/// (CUDA_ERROR_OUT_OF_MEMORY, 2) beyond it.
#[test]
fn a_tenant_made_from_the_cdi_devices_allocate_named_is_held_to_its_quota() {
    let test = "a_tenant_made_from_the_cdi_devices_allocate_named_is_held_to_its_quota";
    if !container::usable(test) {
        return;
    }
    for strategy in ["cdi-cri", "cdi-annotations"] {
        let node = Node::new(strategy, strategy, true);
        let r = node.allocate(0..2);
        assert!(
            r.envs.is_empty() && r.mounts.is_empty() && r.devices.is_empty(),
            "{strategy}: the plain fields hold something: {r:?}"
        );
        assert_eq!(
            r.cdi_devices.is_empty(),
            strategy == "cdi-annotations",
            "{r:?}"
        );
        let names = names(&r);
        assert_eq!(names.len(), 2, "{strategy}: {names:?}");
        let steps = [
            "id", "info", "alloc", "1024", "alloc", "1024", "alloc", "1", "free", "alloc", "3072",
            "alloc", "2048", "info", "free",
        ];
        let spec = node.container(&names, 1000, &steps).unwrap();
        assert!(
            !spec
                .envs
                .iter()
                .any(|(k, _)| k == "LD_LIBRARY_PATH" || k == "LD_PRELOAD"),
            "{spec:?}"
        );
        let out = container::run(&spec, LIMIT).unwrap();
        assert!(out.success(), "{strategy}: {out}");
        let id = out.stdout.lines().find(|l| l.starts_with("id ")).unwrap();
        let f: Vec<&str> = id.split(' ').collect();
        assert_eq!((f[1], f[3], f[5]), ("pid", "ppid", "uid"), "{out}");
        let (pid, ppid, uid): (u32, u32, u32) = (
            f[2].parse().unwrap(),
            f[4].parse().unwrap(),
            f[6].parse().unwrap(),
        );
        assert!(pid < 10 && ppid == 0 && uid == 1000, "{strategy}: {out}");
        let quota = 2 * GIB;
        let lines: Vec<&str> = out
            .stdout
            .lines()
            .filter(|l| !l.starts_with("id "))
            .collect();
        assert_eq!(
            lines,
            [
                format!("info free {quota} total {quota}").as_str(),
                "alloc 1024 0",
                "alloc 1024 0",
                "alloc 1 2",
                "free 0",
                "alloc 3072 2",
                "alloc 2048 0",
                &format!("info free 0 total {quota}"),
                "free 0",
                "done",
            ],
            "{strategy}: {out}"
        );
        assert!(
            out.stderr.contains("cuvisor: cuMemAlloc_v2 of") && out.stderr.contains("refused"),
            "{strategy}: no refusal from libcuvisor.so on stderr\n{out}"
        );
        assert_eq!(
            node.used(),
            0,
            "the tenant's memory went back when it exited"
        );
    }
}

/// The quota comes from cuvisor's CDI device and from nothing else: the same container made
/// from NVIDIA's device alone (the answer less `cuvisor.io/allocation=<id>`) runs on the
/// "driver" and sees the whole 16 GiB GPU, and gets 3 GiB where its quota is 2.
#[test]
fn without_cuvisors_cdi_device_the_tenant_is_not_held() {
    let test = "without_cuvisors_cdi_device_the_tenant_is_not_held";
    if !container::usable(test) {
        return;
    }
    let node = Node::new("dropped", "cdi-cri", true);
    let r = node.allocate(0..2);
    let nvidia_only: Vec<String> = names(&r)
        .into_iter()
        .filter(|n| !n.starts_with(cdi::KIND))
        .collect();
    assert_eq!(nvidia_only.len(), 1, "{r:?}");
    let spec = node
        .container(&nvidia_only, 1000, &["info", "alloc", "3072", "free"])
        .unwrap();
    let out = container::run(&spec, LIMIT).unwrap();
    assert!(out.success(), "{out}");
    // Not held: the simulator's own numbers, the GPU less what the tenant's context takes.
    let total = 16 * GIB;
    let ctx = Model::load("single").unwrap().devices[0].context_memory;
    assert!(ctx > 0, "the preset's contexts take memory");
    assert_eq!(
        out.stdout.lines().collect::<Vec<_>>(),
        [
            format!("info free {} total {total}", total - ctx).as_str(),
            "alloc 3072 0",
            "free 0",
            "done"
        ],
        "{out}"
    );
}

/// A name no spec holds fails the container's creation, as the runtime fails it
/// ("unresolvable CDI devices"); the allocation's spec, once the sweeper retires it, is such a
/// name.
#[test]
fn a_retired_allocations_cdi_device_no_longer_resolves() {
    let node = Node::new("retired", "cdi-cri", false);
    let r = node.allocate(0..1);
    let names = names(&r);
    let dirs = node.spec_dirs();
    Registry::load(&[&dirs[0], &dirs[1]])
        .unwrap()
        .resolve(&names)
        .unwrap();
    let sweeper = cuvisor_device_plugin::cleanup::Sweeper::new(
        node.plugin.registry_mut().clone(),
        Duration::ZERO,
    )
    .with_cdi_dir(node.plugin.cdi().spec_dir.clone());
    assert_eq!(sweeper.sweep().len(), 1);
    let e = Registry::load(&[&dirs[0], &dirs[1]])
        .unwrap()
        .resolve(&names)
        .unwrap_err();
    assert!(
        e.contains("unresolvable CDI devices") && e.contains(cdi::KIND),
        "{e}"
    );
}
