//! Tenants as real OCI containers (runc), built from what the plugin's Allocate answered: its
//! mounts (read-only where it says), its environment and its device nodes, used as they are.
//! Each tenant runs in its own pid namespace as its own uid, with nothing of cuvisor in its
//! command line or environment beyond Allocate's answer: libcuvisor.so gets in through the
//! `/etc/ld.so.preload` Allocate mounts.
//!
//! The node: the plugin in this process (its library API, as the benches drive it) on the
//! simulated `single` GPU (16 GiB, 1 GiB units). The simulator has no `/dev/nvidia*`, so the
//! plugin's `host.dev_dir` is a directory of stand-in character devices; its state file is
//! mode 0666 in a 1777 directory, mounted read-write into every container, as `/dev/nvidia*`
//! are open to every uid on a real node. What is asserted comes from what the tenants print and
//! from the simulator's state (what the "hardware" holds), never from the ledger's layout.
//!
//! Needs root and runc: without them each test prints a loud SKIPPED line, or fails when CI is
//! set (see `cuvisor_testkit::container`).

mod support;

use cuvisor_device_plugin::api;
use cuvisor_device_plugin::config::{Config, HostPaths, PodResources};
use cuvisor_device_plugin::registry::Kind;
use cuvisor_device_plugin::server::Plugin;
use cuvisor_sim::model::Model;
use cuvisor_sim::state::Shared;
use cuvisor_testkit::container::{self, Container, Spec};
use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::Ordering::Acquire;
use std::sync::OnceLock;
use std::time::Duration;

const GIB: u64 = 1 << 30;
/// The longest a tenant may take (each takes well under a second).
const LIMIT: Duration = Duration::from_secs(60);
/// Where every container sees the simulator's state directory.
const SIM_DIR: &str = "/run/cuvisor-sim";
/// A read-write directory shared by the test and its containers (to tell a tenant to go on).
const SHARED: &str = "/run/cuvisor-test";

/// target/<profile>/, with libcuvisor.so and the simulated libraries built.
fn built() -> &'static Path {
    cuvisor_testkit::built(&cuvisor_testkit::profile_dir_of_test())
}

/// tests/c/tenant.c, compiled once per test binary.
fn tenant() -> &'static Path {
    static EXE: OnceLock<PathBuf> = OnceLock::new();
    EXE.get_or_init(|| {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/c/tenant.c");
        let out = Path::new(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("dp_tenant-{}", std::process::id()));
        let status = Command::new("cc")
            .args(["-O1", "-Wall", "-Werror", "-o"])
            .arg(&out)
            .arg(&src)
            .arg("-ldl")
            .status()
            .expect("run cc");
        assert!(status.success(), "compiling {}", src.display());
        out
    })
}

/// A node: the plugin and the simulated GPU, in a directory removed at the end.
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
    fn new(tag: &str) -> Node {
        let dir = std::env::temp_dir().join(format!("cuvisor-ct-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("dev")).unwrap();
        for n in ["nvidia0", "nvidiactl", "nvidia-uvm"] {
            container::fake_char_device(&dir.join("dev").join(n)).unwrap();
        }
        let model = Model::load("single").unwrap();
        shared_dir(&dir.join("sim"));
        let state = dir.join("sim/sim.state");
        let sim = Shared::attach_at(&model, &state).unwrap();
        std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o666)).unwrap();
        shared_dir(&dir.join("shared"));
        let cfg = Config {
            socket_dir: dir.join("dp"),
            state_root: dir.join("state"),
            metrics_port: 0,
            pod_resources: PodResources {
                socket: PathBuf::new(),
                ..PodResources::default()
            },
            host: HostPaths {
                library: built().join("deps/libcuvisor.so"),
                dev_dir: dir.join("dev"),
                ..HostPaths::default()
            },
            ..Config::default()
        };
        let (_, health) = cuvisor_device_plugin::health_channel();
        let plugin = Plugin::new(cfg, support::from_model(&model), health).unwrap();
        Node { dir, plugin, sim }
    }

    /// Allocate for memory units `units` of GPU 0.
    fn allocate(&self, units: std::ops::Range<u32>) -> api::ContainerAllocateResponse {
        let inv = self.plugin.inventory();
        let ids = units.map(|k| inv.unit_id(0, k)).collect();
        self.plugin
            .allocate(
                Kind::Memory,
                &api::ContainerAllocateRequest { devices_ids: ids },
            )
            .unwrap()
    }

    /// The container kubelet would make from Allocate's answer `r`, as `uid` (gid the same),
    /// running the tenant with `steps`; plus the simulator (libraries on LD_LIBRARY_PATH, state
    /// read-write) and the shared directory.
    fn spec(&self, r: &api::ContainerAllocateResponse, uid: u32, steps: &[&str]) -> Spec {
        let args = std::iter::once(tenant().to_string_lossy().into_owned())
            .chain(steps.iter().map(|s| s.to_string()));
        let mut spec = Spec::new(args).user(uid, uid);
        let envs: BTreeMap<_, _> = r.envs.iter().collect();
        for (k, v) in envs {
            spec = spec.env(k, v);
        }
        for m in &r.mounts {
            spec = spec.mount(&m.container_path, &m.host_path, m.read_only);
        }
        for d in &r.devices {
            spec = spec.device(&d.container_path, &d.host_path, &d.permissions);
        }
        spec.env("LD_LIBRARY_PATH", built().join("sim").to_string_lossy())
            .env("CUVISOR_SIM", "single")
            .env("CUVISOR_SIM_STATE", format!("{SIM_DIR}/sim.state"))
            .mount(SIM_DIR, self.dir.join("sim"), false)
            .mount(SHARED, self.dir.join("shared"), false)
            .host_path(built())
            .host_path(tenant().parent().unwrap())
    }

    /// Tells tenants waiting on `name` (in the shared directory) to go on.
    fn go(&self, name: &str) {
        std::fs::write(self.dir.join("shared").join(name), "").unwrap();
    }

    /// Device memory in use on the simulated GPU, all processes together.
    fn used(&self) -> u64 {
        self.sim.device(0).mem_used.load(Acquire)
    }

    /// What each process the simulator knows holds on the GPU, smallest first.
    fn held(&self) -> Vec<u64> {
        let mut v: Vec<u64> = self
            .sim
            .live_procs()
            .map(|(_, s)| s.mem[0].load(Acquire))
            .collect();
        v.sort();
        v
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The tenant's `id` line: (pid, ppid, uid, gid).
fn id_of(stdout: &str) -> (u32, u32, u32, u32) {
    let line = stdout
        .lines()
        .find(|l| l.starts_with("id "))
        .unwrap_or_else(|| panic!("no id line in\n{stdout}"));
    let f: Vec<u32> = line
        .split(' ')
        .skip(1)
        .collect::<Vec<_>>()
        .chunks(2)
        .map(|kv| kv[1].parse().unwrap())
        .collect();
    (f[0], f[1], f[2], f[3])
}

/// stdout after the `id` line.
fn after_id(stdout: &str) -> Vec<&str> {
    stdout.lines().filter(|l| !l.starts_with("id ")).collect()
}

/// A tenant container made from Allocate's answer for 2 units, as uid 1000 in its own pid
/// namespace: it sees the 2 GiB quota as the GPU's memory, gets all of it, is refused
/// (CUDA_ERROR_OUT_OF_MEMORY, 2) beyond it and goes on; libcuvisor.so came in through the
/// preload file (its refusal line is on stderr).
#[test]
fn a_tenant_container_sees_its_quota_and_is_refused_beyond_it() {
    if !container::usable("a_tenant_container_sees_its_quota_and_is_refused_beyond_it") {
        return;
    }
    let node = Node::new("quota");
    let r = node.allocate(0..2);
    let steps = [
        "id", "info", "alloc", "1024", "alloc", "1024", "alloc", "1", "free", "alloc", "3072",
        "alloc", "2048", "info", "free",
    ];
    let out = container::run(&node.spec(&r, 1000, &steps), LIMIT).unwrap();
    assert!(out.success(), "{out}");
    let (pid, ppid, uid, gid) = id_of(&out.stdout);
    assert!(
        pid < 10 && ppid == 0,
        "pid {pid} ppid {ppid}: not the init of its own pid namespace\n{out}"
    );
    assert_eq!((uid, gid), (1000, 1000), "{out}");
    let quota = 2 * GIB;
    assert_eq!(
        after_id(&out.stdout),
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
        "{out}"
    );
    assert!(
        out.stderr.contains("cuvisor: cuMemAlloc_v2 of") && out.stderr.contains("refused"),
        "no refusal from libcuvisor.so on stderr\n{out}"
    );
    assert_eq!(
        node.used(),
        0,
        "the tenant's memory went back when it exited"
    );
}

/// Two tenants on one simulated GPU: uid 1000 with 4 units, uid 2000 with 6, each in a
/// container made from its own Allocate answer. Each fills its quota and is refused one more
/// MiB, launches 20 kernels, and waits until both hold their quotas; then the test notes what
/// the GPU holds and lets them go on (`procs`, `free`, `info`).
struct Pair {
    a: container::Exited,
    b: container::Exited,
    /// The simulated GPU while both held: memory in use, and what each process holds.
    used: u64,
    held: Vec<u64>,
    /// Memory in use once both ended.
    after: u64,
}

const PAIR: [(u32, u64); 2] = [(1000, 4 * GIB), (2000, 6 * GIB)];

fn pair(tag: &str) -> Pair {
    let node = Node::new(tag);
    let (ra, rb) = (node.allocate(0..4), node.allocate(4..10));
    let steps = |mib: &'static str| {
        [
            "id",
            "alloc",
            mib,
            "alloc",
            "1",
            "info",
            "launch",
            "20",
            "wait",
            "/run/cuvisor-test/go",
            "procs",
            // Both list the processes before either frees (else the faster one's free can
            // come before the slower one's list).
            "wait",
            "/run/cuvisor-test/go2",
            "free",
            "info",
        ]
    };
    let mut a = Container::start(&node.spec(&ra, PAIR[0].0, &steps("4096"))).unwrap();
    a.wait_for("launch 20 ", LIMIT).unwrap();
    let mut b = Container::start(&node.spec(&rb, PAIR[1].0, &steps("6144"))).unwrap();
    b.wait_for("launch 20 ", LIMIT).unwrap();
    let (used, held) = (node.used(), node.held());
    node.go("go");
    a.wait_for("procs ", LIMIT).unwrap();
    b.wait_for("procs ", LIMIT).unwrap();
    node.go("go2");
    let (a, b) = (a.wait(LIMIT).unwrap(), b.wait(LIMIT).unwrap());
    let after = node.used();
    Pair {
        a,
        b,
        used,
        held,
        after,
    }
}

/// The pair's outputs, each with its uid and quota.
fn both(p: &Pair) -> [(&container::Exited, u32, u64); 2] {
    [(&p.a, PAIR[0].0, PAIR[0].1), (&p.b, PAIR[1].0, PAIR[1].1)]
}

/// Each of two containers of two uids holds its own whole quota while the other holds its own,
/// each refused beyond its own, each as its uid and the init of its own pid namespace.
#[test]
fn two_containers_of_two_uids_hold_their_own_quotas_at_once() {
    if !container::usable("two_containers_of_two_uids_hold_their_own_quotas_at_once") {
        return;
    }
    let p = pair("pair");
    for (out, uid, quota) in both(&p) {
        assert!(out.success(), "{out}");
        let (pid, ppid, u, g) = id_of(&out.stdout);
        assert!(pid < 10 && ppid == 0, "pid {pid} ppid {ppid}\n{out}");
        assert_eq!((u, g), (uid, uid), "{out}");
        let mib = quota >> 20;
        let lines: Vec<&str> = after_id(&out.stdout)
            .into_iter()
            .filter(|l| !l.starts_with("procs "))
            .collect();
        assert_eq!(
            lines,
            [
                format!("alloc {mib} 0").as_str(),
                "alloc 1 2",
                &format!("info free 0 total {quota}"),
                "launch 20 0",
                "waited /run/cuvisor-test/go",
                "waited /run/cuvisor-test/go2",
                "free 0",
                &format!("info free {quota} total {quota}"),
                "done",
            ],
            "uid {uid}: {out}"
        );
    }
}

/// While both hold their quotas the GPU holds both: 10 GiB in use, one process with 4 GiB and
/// one with 6, and each tenant sees both in the driver's NVML process list.
#[test]
fn two_containers_on_one_gpu_each_see_the_others_memory() {
    if !container::usable("two_containers_on_one_gpu_each_see_the_others_memory") {
        return;
    }
    let p = pair("physical");
    assert_eq!(
        (p.used, &p.held),
        (10 * GIB, &vec![4 * GIB, 6 * GIB]),
        "the GPU while both held their quotas"
    );
    assert_eq!(p.after, 0, "all given back at the end");
    for (out, uid, _) in both(&p) {
        assert!(
            out.stdout
                .lines()
                .any(|l| l == format!("procs 2 used {}", 10 * GIB)),
            "uid {uid}: {out}"
        );
    }
}

/// Two containers of two uids on one GPU share its compute coordinator (the directory Allocate
/// mounts read-write for every container of the GPU): neither falls back to a private one.
#[test]
fn two_containers_of_two_uids_share_the_gpus_compute_coordinator() {
    if !container::usable("two_containers_of_two_uids_share_the_gpus_compute_coordinator") {
        return;
    }
    let p = pair("coord");
    for (out, uid, _) in both(&p) {
        assert!(out.success(), "{out}");
        assert!(!out.stderr.contains("not coordinated"), "uid {uid}: {out}");
    }
}

/// A tenant holding its whole quota (3 units) is killed with its container (`runc kill KILL`:
/// its pid namespace ends); a new container of the same allocation, whose tenant has the same
/// pid in its own namespace, gets the whole quota again: the dead tenant's charge is given back.
#[test]
fn a_killed_containers_quota_goes_whole_to_the_next_container() {
    if !container::usable("a_killed_containers_quota_goes_whole_to_the_next_container") {
        return;
    }
    let node = Node::new("kill");
    let r = node.allocate(0..3);
    let quota = 3 * GIB;
    let mut first =
        Container::start(&node.spec(&r, 1000, &["id", "alloc", "3072", "hold"])).unwrap();
    let so = first.wait_for("holding\n", LIMIT).unwrap();
    assert_eq!(after_id(&so), ["alloc 3072 0", "holding"]);
    assert_eq!(node.used(), quota);
    first.kill().unwrap();
    let killed = first.wait(LIMIT).unwrap();
    assert_eq!(killed.code(), Some(128 + 9), "{killed}");

    let steps = ["id", "info", "alloc", "3072", "info", "free"];
    let out = container::run(&node.spec(&r, 1000, &steps), LIMIT).unwrap();
    assert!(out.success(), "{out}");
    assert_eq!(
        id_of(&out.stdout).0,
        id_of(&killed.stdout).0,
        "the same pid, in another pid namespace"
    );
    assert_eq!(
        after_id(&out.stdout),
        [
            format!("info free {quota} total {quota}").as_str(),
            "alloc 3072 0",
            &format!("info free 0 total {quota}"),
            "free 0",
            "done",
        ],
        "{out}"
    );
    assert_eq!(node.used(), 0);
}

/// What Allocate mounts read-only cannot be written even by root in the container (the limits
/// file, the library, the preload file); the ledger directory can.
#[test]
fn allocate_read_only_mounts_are_read_only_in_the_container() {
    if !container::usable("allocate_read_only_mounts_are_read_only_in_the_container") {
        return;
    }
    let node = Node::new("ro");
    let r = node.allocate(0..1);
    let ro: Vec<&str> = r
        .mounts
        .iter()
        .filter(|m| m.read_only)
        .map(|m| m.container_path.as_str())
        .collect();
    assert_eq!(
        ro,
        [
            "/usr/local/lib/cuvisor/libcuvisor.so",
            "/etc/ld.so.preload",
            "/var/run/cuvisor/limits.conf",
        ]
    );
    let script = format!(
        "for f in {}; do if e=$( (: >> \"$f\") 2>&1 ); then echo \"writable $f\"; \
         else echo \"refused $f: ${{e##*: }}\"; fi; done; \
         : > /var/run/cuvisor/state/probe && echo 'writable state'",
        ro.join(" ")
    );
    let mut spec = node.spec(&r, 0, &[]);
    spec.args = ["/bin/sh", "-c", &script].map(String::from).to_vec();
    let out = container::run(&spec, LIMIT).unwrap();
    assert!(out.success(), "{out}");
    let mut want: Vec<String> = ro
        .iter()
        .map(|f| format!("refused {f}: Read-only file system"))
        .collect();
    want.push("writable state".into());
    assert_eq!(out.stdout.lines().collect::<Vec<_>>(), want, "{out}");
}
