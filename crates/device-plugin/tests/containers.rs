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
use cuvisor_device_plugin::plugin::Plugin;
use cuvisor_device_plugin::registry::Kind;
use cuvisor_sim::model::Model;
use cuvisor_sim::state::Shared;
use cuvisor_testkit::container::{self, Container, Spec};
use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering::Acquire;
use std::sync::OnceLock;
use std::time::Duration;

const GIB: u64 = 1 << 30;
/// The longest a tenant may take (each takes well under a second).
const LIMIT: Duration = Duration::from_secs(60);
/// Where every container sees the simulator's state directory.
const SIM_DIR: &str = "/run/cuvisor-sim";
/// The machine file in SIM_DIR (see `Node::new`).
const MACHINE: &str = "single-no-context-memory.toml";
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
        cuvisor_testkit::compile_c(
            &Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/c/tenant.c"),
            Path::new(env!("CARGO_TARGET_TMPDIR")),
            "dp_tenant",
        )
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
        cuvisor_device_plugin::ledger_dir::detach_all_under(&dir);
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("dev")).unwrap();
        for n in ["nvidia0", "nvidiactl", "nvidia-uvm"] {
            container::fake_char_device(&dir.join("dev").join(n)).unwrap();
        }
        shared_dir(&dir.join("sim"));
        // The `single` preset's GPU with contexts that take no memory: these tests hold the
        // simulator's physical use to the containers' quotas, and libcuvisor does not count a
        // context's own memory against a quota yet (the issue "Today's stacks held to their
        // quotas"); on the presets each tenant's context would add its share.
        std::fs::write(
            dir.join("sim").join(MACHINE),
            "name = \"single-no-context-memory\"\n\
             [[device]]\nname = \"NVIDIA A100-PCIE-16GB (simulated)\"\nmemory = \"16Gi\"\n\
             sm_count = 108\ncompute_capability = \"8.0\"\ncontext_memory = 0\n",
        )
        .unwrap();
        let model = Model::load(dir.join("sim").join(MACHINE).to_str().unwrap()).unwrap();
        let state = dir.join("sim/sim.state");
        let sim = Shared::attach_at(&model, &state).unwrap();
        std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o666)).unwrap();
        shared_dir(&dir.join("shared"));
        let cfg = Config {
            socket_dir: dir.join("dp"),
            state_root: dir.join("state"),
            metrics_address: Some(String::new()),
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
        let ids: Vec<String> = units.map(|k| inv.unit_id(0, k)).collect();
        // The domain's answer, as kubelet receives it.
        cuvisor_device_plugin::server::response(self.plugin.allocate(Kind::Memory, &ids).unwrap())
    }

    /// The container kubelet would make from Allocate's answer `r`, as `uid` (gid the same),
    /// running the tenant with `steps`; plus the simulator (libraries on LD_LIBRARY_PATH, state
    /// read-write) and the shared directory.
    fn spec(&self, r: &api::ContainerAllocateResponse, uid: u32, steps: &[&str]) -> Spec {
        let args = std::iter::once(tenant().to_string_lossy().into_owned())
            .chain(steps.iter().map(|s| s.to_string()));
        self.spec_of(r, uid, args)
    }

    /// As `spec`, with any command.
    fn spec_of(
        &self,
        r: &api::ContainerAllocateResponse,
        uid: u32,
        args: impl IntoIterator<Item = String>,
    ) -> Spec {
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
            .env("CUVISOR_SIM", format!("{SIM_DIR}/{MACHINE}"))
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
        // Allocations not swept leave their ledger directories' tmpfs mounted.
        cuvisor_device_plugin::ledger_dir::detach_all_under(&self.dir);
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

/// Legacy CUDA IPC across two containers of two uids: the exporting tenant allocates 1 GiB and
/// writes its IPC handle to the shared directory; the other opens it twice. The importer is
/// charged nothing, its opens and closes neither double nor remove the exporter's charge, and
/// when the exporter exits first the memory lives on (the driver keeps it for the open
/// handle) until the importer's last close.
#[test]
fn ipc_get_and_open_across_containers_charge_the_exporter_alone() {
    if !container::usable("ipc_get_and_open_across_containers_charge_the_exporter_alone") {
        return;
    }
    let node = Node::new("ipc");
    let (ra, rb) = (node.allocate(0..4), node.allocate(4..8));
    let handle = "/run/cuvisor-test/handle";
    let exporter = ["id", "alloc", "1024", "ipcget", handle, "info"];
    let exporter = exporter
        .iter()
        .chain(&["wait", "/run/cuvisor-test/go", "info"]);
    let exporter: Vec<&str> = exporter.copied().collect();
    let importer = [
        "id",
        "wait",
        handle,
        "ipcopen",
        handle,
        "ipcopen",
        handle,
        "info",
        "wait",
        "/run/cuvisor-test/go2",
        "ipcclose",
        "info",
        "wait",
        "/run/cuvisor-test/go3",
        "ipcclose",
        "info",
    ];
    let mut a = Container::start(&node.spec(&ra, 1000, &exporter)).unwrap();
    a.wait_for("ipcget ", LIMIT).unwrap();
    let mut b = Container::start(&node.spec(&rb, 2000, &importer)).unwrap();
    let opened = b.wait_for("info ", LIMIT).unwrap();
    assert!(
        opened.contains(&format!("info free {} total {}", 4 * GIB, 4 * GIB)),
        "the importer's container is charged nothing:\n{opened}"
    );
    assert_eq!(node.used(), GIB, "the memory is there once");
    node.go("go");
    let a = a.wait(LIMIT).unwrap();
    assert!(a.success(), "{a}");
    assert_eq!(
        after_id(&a.stdout),
        [
            "alloc 1024 0",
            "ipcget 0",
            &format!("info free {} total {}", 3 * GIB, 4 * GIB),
            "waited /run/cuvisor-test/go",
            &format!("info free {} total {}", 3 * GIB, 4 * GIB),
            "done",
        ],
        "the exporter is charged 1 GiB, before and after the importer's opens:\n{a}"
    );
    assert_eq!(
        node.used(),
        GIB,
        "the exporter exited; the importer holds it open"
    );
    node.go("go2");
    b.wait_for("ipcclose 0", LIMIT).unwrap();
    assert_eq!(node.used(), GIB, "one reference left");
    node.go("go3");
    let b = b.wait(LIMIT).unwrap();
    assert!(b.success(), "{b}");
    assert_eq!(
        after_id(&b.stdout),
        [
            format!("waited {handle}").as_str(),
            "ipcopen 0",
            "ipcopen 0",
            &format!("info free {} total {}", 4 * GIB, 4 * GIB),
            "waited /run/cuvisor-test/go2",
            "ipcclose 0",
            &format!("info free {} total {}", 4 * GIB, 4 * GIB),
            "waited /run/cuvisor-test/go3",
            "ipcclose 0",
            &format!("info free {} total {}", 4 * GIB, 4 * GIB),
            "done",
        ],
        "{b}"
    );
    assert_eq!(node.used(), 0, "the last close freed it");
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
/// file, the library, the preload file, the GPU coordinators' directory); the ledger directory
/// and the container's own coordinator state can.
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
            "/var/run/cuvisor/coord",
        ]
    );
    // A directory is written by creating a file in it.
    let script = format!(
        "for f in {}; do t=$f; [ -d \"$f\" ] && t=$f/probe; \
         if e=$( (: >> \"$t\") 2>&1 ); then echo \"writable $f\"; \
         else echo \"refused $f: ${{e##*: }}\"; fi; done; \
         : > /var/run/cuvisor/state/probe && echo 'writable state'; \
         : >> {} && echo 'writable own coordinator state'",
        ro.join(" "),
        own_mount(&r)
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
    want.push("writable own coordinator state".into());
    assert_eq!(out.stdout.lines().collect::<Vec<_>>(), want, "{out}");
}

/// The mount of the container's own coordinator state on GPU 0, from Allocate's answer.
fn own(r: &api::ContainerAllocateResponse) -> &api::Mount {
    let m = r
        .mounts
        .iter()
        .find(|m| {
            m.container_path
                .starts_with("/var/run/cuvisor/compute/gpu-")
        })
        .expect("a coordinator state mount");
    assert!(!m.read_only);
    m
}

/// Its host path.
fn own_state(r: &api::ContainerAllocateResponse) -> PathBuf {
    PathBuf::from(&own(r).host_path)
}

/// Its path in the container.
fn own_mount(r: &api::ContainerAllocateResponse) -> &str {
    &own(r).container_path
}

/// The rate (ppm of GPU time) the container's library last computed for it, read from its
/// coordinator state on the host.
fn grant_ppm(state: &Path) -> u64 {
    let b = std::fs::read(state).unwrap();
    let at = std::mem::offset_of!(cuvisor_shm::coordinator::State, grant_ppm);
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}

/// What a coordinator attack left: the attacker's output (see [`coordinator_attack`]), the
/// state names it tried, the victim's output and last rate, and the board before and after.
struct CoordAttack {
    out: container::Exited,
    names: Vec<String>,
    victim: container::Exited,
    ppm: u64,
    before: Vec<(usize, cuvisor_shm::coordinator::Entry)>,
    after: Vec<(usize, cuvisor_shm::coordinator::Entry)>,
}

/// The coordinator attacked from a tenant container, as root in it, while a victim (uid 1000,
/// 4 of the GPU's 16 GiB) runs kernels: the attacker (6 GiB) tries to append to the board and
/// to both states as every container sees them (the coordinators' directory), to create a state
/// file, to rename the board, then does `own` to its own state (`{own}` in it is its path) and
/// runs 20 kernels. Then the victim launches 400 more.
fn coordinator_attack(tag: &str, own: &str) -> CoordAttack {
    use cuvisor_shm::coordinator::{self, BoardWriter};
    let node = Node::new(tag);
    let (rv, ra) = (node.allocate(0..4), node.allocate(4..10));
    let uuid = cuvisor_shm::uuid::parse(&rv.envs["NVIDIA_VISIBLE_DEVICES"]).unwrap();
    let host_coord = node.dir.join("state/coord");
    let board = || {
        BoardWriter::open(&host_coord, uuid)
            .unwrap()
            .entries()
            .unwrap()
    };
    let before = board();
    assert_eq!(before.len(), 2, "one entry per container: {before:?}");
    let mut victim = Container::start(&node.spec(
        &rv,
        1000,
        &[
            "id",
            "launch",
            "5",
            "wait",
            "/run/cuvisor-test/go",
            "launch",
            "400",
        ],
    ))
    .unwrap();
    victim.wait_for("launch 5 ", LIMIT).unwrap();
    let dir = format!("/var/run/cuvisor/coord/{}", coordinator::dir_name(uuid));
    let names: Vec<String> = before
        .iter()
        .map(|(i, e)| coordinator::state_name(*i, e.container))
        .collect();
    for n in &names {
        assert!(
            host_coord
                .join(coordinator::dir_name(uuid))
                .join(n)
                .is_file(),
            "{n}"
        );
    }
    let script = format!(
        "for f in board {}; do if (: >> {dir}/$f) 2>/dev/null; \
         then echo \"writable $f\"; else echo \"refused $f\"; fi; done; \
         (: > {dir}/slot-09) 2>/dev/null && echo created || echo 'refused create'; \
         (mv {dir}/board {dir}/old) 2>/dev/null && echo renamed || echo 'refused rename'; \
         {} && echo 'broke own'; \
         exec {} launch 20",
        names.join(" "),
        own.replace("{own}", own_mount(&ra)),
        tenant().display()
    );
    let attack = node.spec_of(&ra, 0, ["/bin/sh".into(), "-c".into(), script]);
    let out = container::run(&attack, LIMIT).unwrap();
    node.go("go");
    let victim = victim.wait(LIMIT).unwrap();
    CoordAttack {
        out,
        names,
        victim,
        ppm: grant_ppm(&own_state(&rv)),
        before,
        after: board(),
    }
}

/// The attacker's lines, what the victim did, and its rate: it never faulted, and it reads
/// the attacker's broken state as a container that wants all its policy allows, so its rate is
/// exactly what its own policy guarantees next to that one (weights by memory, 4:6 GiB: 40 %).
/// The attacker, whose library cannot use its own state any more, is held to its memory
/// fraction on a private coordinator rather than freed, and says so in one line.
fn check_victim_and_attacker(a: &CoordAttack) {
    let out = &a.out;
    assert!(out.success(), "{out}");
    assert_eq!(
        out.stdout.lines().collect::<Vec<_>>(),
        [
            "refused board".to_string(),
            format!("refused {}", a.names[0]),
            format!("refused {}", a.names[1]),
            "refused create".into(),
            "refused rename".into(),
            "broke own".into(),
            "launch 20 0".into(),
            "done".into()
        ],
        "{out}"
    );
    let said: Vec<&str> = out
        .stderr
        .lines()
        .filter(|l| l.contains("coordinat"))
        .collect();
    assert!(
        said.len() == 1 && said[0].contains("not coordinated"),
        "one line about its own broken state: {out}"
    );
    let v = &a.victim;
    assert!(v.success(), "{v}");
    assert_eq!(
        after_id(&v.stdout),
        [
            "launch 5 0",
            "waited /run/cuvisor-test/go",
            "launch 400 0",
            "done"
        ],
        "{v}"
    );
    assert!(
        a.ppm.abs_diff(400_000) <= 2,
        "the victim's rate next to a broken state: {} ppm, want 400000 (weights 4:6)",
        a.ppm
    );
}

const TRUNCATE_OWN: &str = ": > {own}";

/// Listing a tenant (one that would never go stale), changing a policy (its own or another's),
/// taking the 64 entries, breaking the magic, renaming the board: the board reaches a container
/// read-only, and after the attack it is what the plugin wrote.
#[test]
fn a_tenant_cannot_list_a_tenant_change_a_policy_or_take_the_entries() {
    if !container::usable("a_tenant_cannot_list_a_tenant_change_a_policy_or_take_the_entries") {
        return;
    }
    let a = coordinator_attack("coord-board", TRUNCATE_OWN);
    assert!(a.out.stdout.starts_with("refused board\n"), "{}", a.out);
    assert!(
        a.out.stdout.contains("refused create\nrefused rename\n"),
        "{}",
        a.out
    );
    assert_eq!(a.after, a.before, "the board is the plugin's alone");
}

/// Poisoning another container's tokens or claims: its state reaches every other container
/// read-only (only its own container has it read-write, at its own path).
#[test]
fn a_tenant_cannot_write_another_containers_coordinator_state() {
    if !container::usable("a_tenant_cannot_write_another_containers_coordinator_state") {
        return;
    }
    let a = coordinator_attack("coord-poison", TRUNCATE_OWN);
    check_victim_and_attacker(&a);
}

/// Truncating its own state (once every tenant on the GPU died of SIGBUS): nobody else maps
/// it, and the others read it as a claim.
#[test]
fn a_tenant_truncating_its_coordinator_state_crashes_and_steers_no_one() {
    if !container::usable("a_tenant_truncating_its_coordinator_state_crashes_and_steers_no_one") {
        return;
    }
    let a = coordinator_attack("coord-truncate", TRUNCATE_OWN);
    check_victim_and_attacker(&a);
}

/// Rewriting its own state with garbage of the right size (magic, index, container, claims):
/// the same, since a state that does not read back as its own counts as a tenant wanting all
/// its policy allows.
#[test]
fn a_tenant_rewriting_its_coordinator_state_gains_nothing_over_the_others() {
    if !container::usable("a_tenant_rewriting_its_coordinator_state_gains_nothing_over_the_others")
    {
        return;
    }
    let a = coordinator_attack(
        "coord-garbage",
        "dd if=/dev/urandom of={own} bs=144 count=1 conv=notrunc 2>/dev/null",
    );
    check_victim_and_attacker(&a);
}

// ---------------------------------------------------------------------------------------------
// Attacks a tenant can make from inside its container, each of which once broke isolation.

/// The tenant's lines after `id`, for steps that print no `id`.
fn lines(out: &container::Exited) -> Vec<&str> {
    after_id(&out.stdout)
}

/// Pointing CUVISOR_CONFIG at a file the tenant wrote (`memory = 1Ti`), setting it empty, raising
/// CUVISOR_MEMORY_LIMIT, moving CUVISOR_STATE_DIR, emptying LD_PRELOAD: the quota stays the one
/// the plugin mounted (the library reads its fixed path, and comes in through /etc/ld.so.preload).
#[test]
fn a_tenant_cannot_raise_its_quota_through_its_environment() {
    if !container::usable("a_tenant_cannot_raise_its_quota_through_its_environment") {
        return;
    }
    let node = Node::new("forged");
    let r = node.allocate(0..2);
    std::fs::write(
        node.dir.join("shared/forged.conf"),
        format!("version = 1\nstate_dir = {SHARED}/st\nmemory = 1Ti\n"),
    )
    .unwrap();
    let quota = 2 * GIB;
    for (k, v) in [
        ("CUVISOR_CONFIG", format!("{SHARED}/forged.conf")),
        ("CUVISOR_CONFIG", String::new()),
        ("CUVISOR_MEMORY_LIMIT", "1Ti".into()),
        ("CUVISOR_STATE_DIR", format!("{SHARED}/st")),
        ("LD_PRELOAD", String::new()),
    ] {
        let spec = node
            .spec(&r, 1000, &["info", "alloc", "2048", "alloc", "1", "free"])
            .env(k, &v);
        let out = container::run(&spec, LIMIT).unwrap();
        assert_eq!(
            lines(&out),
            [
                format!("info free {quota} total {quota}").as_str(),
                "alloc 2048 0",
                "alloc 1 2",
                "free 0",
                "done"
            ],
            "{k}={v:?}\n{out}"
        );
    }
    assert!(
        !node.dir.join("shared/st").exists(),
        "no ledger where the tenant said"
    );
}

/// A set-user-ID program reads none of its caller's environment (AT_SECURE, as secure_getenv
/// does): a limit the caller sets, which the plain program honours (the environment may lower
/// the quota), and the log level, are ignored. Kubernetes lets setuid programs gain privileges
/// by default (allowPrivilegeEscalation unset), so the container does too.
#[test]
fn a_setuid_program_ignores_the_callers_environment() {
    if !container::usable("a_setuid_program_ignores_the_callers_environment") {
        return;
    }
    use std::os::unix::fs::PermissionsExt;
    let node = Node::new("setuid");
    // One allocation each: a lower limit a process sets is the whole container's from then on.
    let (r_plain, r_suid) = (node.allocate(0..2), node.allocate(2..4));
    let dir = node.dir.join("suid");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let suid = dir.join("tenant");
    std::fs::copy(tenant(), &suid).unwrap();
    std::os::unix::fs::chown(&suid, Some(0), Some(0)).unwrap();
    std::fs::set_permissions(&suid, std::fs::Permissions::from_mode(0o4755)).unwrap();
    let driver = built().join("sim/libcuda.so.1");
    let caller = |exe: &Path, r: &api::ContainerAllocateResponse| {
        node.spec_of(r, 1000, [exe.to_string_lossy().into_owned(), "info".into()])
            .env("CUVISOR_MEMORY_LIMIT", "1Mi")
            .env("CUVISOR_LOG", "info")
            .env("TENANT_LIBCUDA", driver.to_string_lossy())
            .host_path(&dir)
            .allow_setuid()
    };
    let plain = container::run(&caller(tenant(), &r_plain), LIMIT).unwrap();
    assert_eq!(
        lines(&plain),
        [
            format!("info free {} total {}", 1 << 20, 1 << 20).as_str(),
            "done"
        ],
        "the plain program honours the caller's lower limit\n{plain}"
    );
    assert!(plain.stderr.contains("cuvisor: enforcing"), "{plain}");
    let privileged = container::run(&caller(&suid, &r_suid), LIMIT).unwrap();
    let quota = 2 * GIB;
    assert_eq!(
        lines(&privileged),
        [format!("info free {quota} total {quota}").as_str(), "done"],
        "the setuid program takes the mounted file alone\n{privileged}"
    );
    assert!(
        !privileged.stderr.contains("cuvisor:"),
        "CUVISOR_LOG was read\n{privileged}"
    );
}

/// A tenant truncates its ledger in a loop, replaces it by a symlink to a host file, by a
/// version the plugin does not speak, and holds its flock: the plugin's metrics and sweeper,
/// run all along, neither crash (SIGBUS, SIGSEGV), nor hang, nor touch the host file, and
/// Allocate still answers.
#[test]
fn a_tenant_attacking_its_ledger_cannot_crash_hang_or_steer_the_plugin() {
    if !container::usable("a_tenant_attacking_its_ledger_cannot_crash_hang_or_steer_the_plugin") {
        return;
    }
    let node = Node::new("ledger-attack");
    let r = node.allocate(0..2);
    let made = container::run(&node.spec(&r, 1000, &["alloc", "1024"]), LIMIT).unwrap();
    assert!(made.success(), "{made}");
    let victim = node.dir.join("victim");
    std::fs::write(&victim, "host data\n").unwrap();
    let l = "/var/run/cuvisor/state/ledger";
    let script = format!(
        "end=$(($(date +%s) + 2)); \
         while [ $(date +%s) -lt $end ]; do truncate -s 0 {l}; truncate -s 200000 {l}; done; \
         echo truncated; rm -f {l}; ln -s {victim} {l}; sleep 1; echo linked; rm -f {l}; \
         printf 'CUVLEDG1\\143\\000\\000\\000' > {l}; truncate -s 200000 {l}; \
         flock {l} sleep 2; echo done",
        victim = victim.display()
    );
    let spec = node.spec_of(&r, 1000, ["/bin/sh".into(), "-c".into(), script]);
    let attacker = Container::start(&spec).unwrap();
    let metrics = cuvisor_device_plugin::metrics::Metrics::new(
        node.plugin.registry(),
        cuvisor_device_plugin::podresources::PodCache::new(),
    );
    let sweeper = cuvisor_device_plugin::cleanup::Sweeper::new(
        node.plugin.registry_mut().clone(),
        Duration::from_secs(3600),
    );
    let (mut scrapes, mut slowest) = (0, Duration::ZERO);
    let start = std::time::Instant::now();
    while !attacker.stdout().contains("done") {
        assert!(
            start.elapsed() < LIMIT,
            "the attack did not end\n{}",
            attacker.stderr()
        );
        let t = std::time::Instant::now();
        let text = metrics.render();
        assert!(text.contains("cuvisor_"), "{text}");
        assert!(sweeper.sweep().is_empty(), "nothing is removed");
        slowest = slowest.max(t.elapsed());
        scrapes += 1;
    }
    let out = attacker.wait(LIMIT).unwrap();
    assert!(out.success(), "{out}");
    assert!(scrapes > 10, "{scrapes} scrapes");
    assert!(
        slowest < Duration::from_millis(500),
        "a scrape took {slowest:?}"
    );
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "host data\n");
    let again = node.allocate(2..4);
    assert!(!again.mounts.is_empty(), "Allocate still answers");
}

/// kubelet restarts while a tenant runs: its PodResources socket goes away (the plugin's cache
/// has no answer) and comes back. Nothing is removed meanwhile: the tenant's ledger directory
/// stays and it allocates again afterwards. Only when kubelet no longer lists the pod is the
/// allocation removed.
#[test]
fn a_kubelet_restart_and_a_podresources_outage_remove_nothing() {
    if !container::usable("a_kubelet_restart_and_a_podresources_outage_remove_nothing") {
        return;
    }
    use cuvisor_device_plugin::cleanup::{Reason, Sweeper};
    use cuvisor_device_plugin::podresources::PodCache;
    let rt = tokio::runtime::Runtime::new().unwrap();
    let _in_rt = rt.enter();
    let node = Node::new("outage");
    let r = node.allocate(0..2);
    let inv = node.plugin.inventory();
    let ids: Vec<String> = (0..2).map(|k| inv.unit_id(0, k)).collect();
    let sock = node.dir.join("pod-resources.sock");
    let pods = support::pods::FakePods::default();
    pods.run("tenant", "cuvisor.io/gpu-memory", &ids);
    let mut kubelet = pods.serve(&sock);
    let cache = PodCache::new();
    rt.spawn(
        cache
            .clone()
            .refresh(sock.clone(), Duration::from_millis(20)),
    );
    let sweeper = Sweeper::new(node.plugin.registry_mut().clone(), Duration::ZERO)
        .with_liveness(Box::new(cache.clone()));
    let until = |what: &str, ok: &dyn Fn() -> bool| {
        let t = std::time::Instant::now();
        while !ok() {
            assert!(t.elapsed() < Duration::from_secs(10), "never: {what}");
            std::thread::sleep(Duration::from_millis(10));
        }
    };
    let steps = [
        "alloc",
        "1024",
        "wait",
        "/run/cuvisor-test/go",
        "alloc",
        "1024",
        "info",
        "free",
    ];
    let mut tenant = Container::start(&node.spec(&r, 1000, &steps)).unwrap();
    tenant.wait_for("alloc 1024 0", LIMIT).unwrap();
    until("kubelet answers", &|| cache.get().is_some());
    assert!(sweeper.sweep().is_empty());

    // kubelet goes away (a restart, an outage): no answer, nothing removed.
    kubelet.abort();
    let _ = std::fs::remove_file(&sock);
    until("the outage is seen", &|| cache.get().is_none());
    for _ in 0..20 {
        assert!(sweeper.sweep().is_empty(), "removed during the outage");
        std::thread::sleep(Duration::from_millis(20));
    }
    // kubelet is back, listing the pod.
    kubelet = pods.serve(&sock);
    until("kubelet answers again", &|| cache.get().is_some());
    assert!(sweeper.sweep().is_empty());
    node.go("go");
    let out = tenant.wait(LIMIT).unwrap();
    assert_eq!(
        lines(&out),
        [
            "alloc 1024 0",
            "waited /run/cuvisor-test/go",
            "alloc 1024 0",
            &format!("info free 0 total {}", 2 * GIB),
            "free 0",
            "done"
        ],
        "the tenant kept its allocation through the outage\n{out}"
    );
    // The pod ends: kubelet no longer lists it, and the allocation goes.
    pods.end("tenant");
    let allocation = r.annotations["cuvisor.io/allocation"].clone();
    until("the allocation is removed", &|| {
        sweeper.sweep() == vec![(allocation.clone(), Reason::Liveness)]
    });
    kubelet.abort();
}
