//! The plugin binary driven over real Unix sockets by a fake kubelet (a Registration server on
//! `kubelet.sock` in a temporary directory, and DevicePlugin clients), on the simulated GPU:
//! registration, ListAndWatch, GetPreferredAllocation, Allocate (response and host files), the
//! span rule, kubelet restarts; and an end-to-end run of the tf_stress twin under what Allocate
//! answered.

mod support;

use cuvisor_testkit::glibc_here;
use support::kubelet::Kubelet;

use cuvisor_device_plugin::api;
use cuvisor_device_plugin::api::device_plugin_client::DevicePluginClient;

use cuvisor_device_plugin::unix::connect_unix;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};
use tonic::transport::Channel;
use tonic::Status;

mod raw_h2;

const EXE: &str = env!("CARGO_BIN_EXE_cuvisor-device-plugin");
const GIB: u64 = 1 << 30;

/// target/<profile>/, with libcuvisor.so and the simulated libraries built.
fn built() -> &'static Path {
    cuvisor_testkit::built(Path::new(EXE).parent().unwrap())
}

/// A test's directory, removed at the end.
struct Scratch(PathBuf);

impl Scratch {
    fn new(tag: &str) -> Scratch {
        let p = std::env::temp_dir().join(format!("cuvisor-dp-{tag}-{}", std::process::id()));
        cuvisor_device_plugin::ledger_dir::detach_all_under(&p);
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(p.join("dp")).unwrap();
        // A fake /dev: the nodes Allocate hands out must exist on the "host".
        std::fs::create_dir_all(p.join("dev")).unwrap();
        for n in (0..8)
            .map(|i| format!("nvidia{i}"))
            .chain(["nvidiactl".into(), "nvidia-uvm".into()])
        {
            std::fs::write(p.join("dev").join(n), "").unwrap();
        }
        Scratch(p)
    }
    fn dp(&self) -> PathBuf {
        self.0.join("dp")
    }
    fn state_root(&self) -> PathBuf {
        self.0.join("state")
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        // A plugin killed with allocations leaves their ledger directories' tmpfs mounted.
        cuvisor_device_plugin::ledger_dir::detach_all_under(&self.0);
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The plugin binary, killed when dropped.
struct PluginProcess(Child);

impl Drop for PluginProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// This machine's glibc, as glibc says.
fn write_config(s: &Scratch, metrics_port: u16, sections: &str) -> PathBuf {
    let p = s.0.join("plugin.toml");
    let pod_resources = if sections.contains("[pod_resources]") {
        ""
    } else {
        "[pod_resources]\nsocket = \"\"\n"
    };
    std::fs::write(
        &p,
        format!(
            "version = 1\nsocket_dir = {:?}\nstate_root = {:?}\nmetrics_port = {metrics_port}\n\
             {pod_resources}{sections}\n\
             [host]\nlibrary = {:?}\ntenant_glibc = {:?}\ndev_dir = {:?}\ncontrol_devices = [\"nvidiactl\", \"nvidia-uvm\", \"nvidia-uvm-tools\"]\n",
            s.dp(),
            s.state_root(),
            built().join("deps/libcuvisor.so"),
            // The library of these tests is built here, for this machine's glibc, and so are
            // their tenants (the shipped one, built for 2.17: crates/elf-needs/tests/shipped.rs).
            glibc_here(),
            s.0.join("dev"),
        ),
    )
    .unwrap();
    p
}

fn spawn_plugin(s: &Scratch, preset: &str) -> PluginProcess {
    spawn_plugin_with(s, preset, 0, "")
}

fn spawn_plugin_with(
    s: &Scratch,
    preset: &str,
    metrics_port: u16,
    sections: &str,
) -> PluginProcess {
    spawn_plugin_under(s, preset, metrics_port, sections, None)
}

/// The plugin, started by `bash -c 'ulimit ULIMIT && exec ...'` when `ulimit` is given.
fn spawn_plugin_under(
    s: &Scratch,
    preset: &str,
    metrics_port: u16,
    sections: &str,
    ulimit: Option<&str>,
) -> PluginProcess {
    let cfg = write_config(s, metrics_port, sections);
    let mut cmd = match ulimit {
        None => Command::new(EXE),
        Some(u) => {
            let mut c = Command::new("bash");
            c.arg("-c")
                .arg(format!("ulimit {u} && exec \"$0\" \"$@\""))
                .arg(EXE);
            c
        }
    };
    let child = plugin_args(&mut cmd, s, preset, &cfg)
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start cuvisor-device-plugin");
    PluginProcess(child)
}

/// The plugin's arguments and environment: config `cfg`, the simulator's `preset` with the
/// scratch's state, nothing of cuvisor's own preloaded; stdout discarded.
fn plugin_args<'c>(cmd: &'c mut Command, s: &Scratch, preset: &str, cfg: &Path) -> &'c mut Command {
    cmd.arg("--config")
        .arg(cfg)
        .args(["--sim", preset])
        .env("CUVISOR_SIM_STATE", s.0.join("sim.state"))
        .env_remove("LD_PRELOAD")
        .env_remove("CUVISOR_CONFIG")
        .stdout(Stdio::null())
}

async fn client(dir: &Path, endpoint: &str) -> DevicePluginClient<Channel> {
    DevicePluginClient::new(
        connect_unix(&dir.join(endpoint))
            .await
            .expect("connect to the plugin"),
    )
}

async fn first_list(c: &mut DevicePluginClient<Channel>) -> Vec<api::Device> {
    let mut s = c.list_and_watch(api::Empty {}).await.unwrap().into_inner();
    s.message().await.unwrap().expect("a first list").devices
}

async fn preferred(
    c: &mut DevicePluginClient<Channel>,
    available: &[String],
    size: i32,
) -> Result<Vec<String>, Status> {
    let r = c
        .get_preferred_allocation(api::PreferredAllocationRequest {
            container_requests: vec![api::ContainerPreferredAllocationRequest {
                available_device_i_ds: available.to_vec(),
                must_include_device_i_ds: vec![],
                allocation_size: size,
            }],
        })
        .await?;
    Ok(r.into_inner().container_responses.remove(0).device_i_ds)
}

async fn allocate(
    c: &mut DevicePluginClient<Channel>,
    ids: &[String],
) -> Result<api::ContainerAllocateResponse, Status> {
    let r = c
        .allocate(api::AllocateRequest {
            container_requests: vec![api::ContainerAllocateRequest {
                devices_ids: ids.to_vec(),
            }],
        })
        .await?;
    Ok(r.into_inner().container_responses.remove(0))
}

fn units(uuid: &str, ks: std::ops::Range<u32>) -> Vec<String> {
    ks.map(|k| format!("{uuid}-mem-{k}")).collect()
}

fn mount<'a>(r: &'a api::ContainerAllocateResponse, container: &str) -> &'a api::Mount {
    r.mounts
        .iter()
        .find(|m| m.container_path == container)
        .unwrap_or_else(|| panic!("no mount at {container}: {:?}", r.mounts))
}

/// The pairs of the DGX-1 V100 cube-mesh joined by 2 NVLinks.
const TWO_LINK_PAIRS: [(usize, usize); 8] = [
    (0, 3),
    (0, 4),
    (1, 2),
    (1, 5),
    (2, 3),
    (4, 7),
    (5, 6),
    (6, 7),
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fake_kubelet_drives_the_plugin_on_dgx1_v100() {
    let s = Scratch::new("dgx1");
    let mut kubelet = Kubelet::start(&s.dp());
    let _plugin = spawn_plugin(&s, "dgx1-v100");

    // Registration: both resources, our version, our endpoints, preferred allocation on.
    let regs = kubelet.registrations(2, Duration::from_secs(30)).await;
    let gpu = &regs["cuvisor.io/gpu"];
    let mem = &regs["cuvisor.io/gpu-memory"];
    for (r, ep) in [(gpu, "cuvisor-gpu.sock"), (mem, "cuvisor-gpu-memory.sock")] {
        assert_eq!(r.version, "v1beta1");
        assert_eq!(r.endpoint, ep);
        assert!(
            s.dp().join(ep).exists(),
            "{ep} is served before registering"
        );
        assert!(
            r.options
                .as_ref()
                .unwrap()
                .get_preferred_allocation_available
        );
    }
    let mut gpus = client(&s.dp(), &gpu.endpoint).await;
    let mut mems = client(&s.dp(), &mem.endpoint).await;
    let opts = gpus
        .get_device_plugin_options(api::Empty {})
        .await
        .unwrap()
        .into_inner();
    assert!(opts.get_preferred_allocation_available && !opts.pre_start_required);
    assert!(gpus
        .pre_start_container(api::PreStartContainerRequest {
            devices_ids: vec![]
        })
        .await
        .is_ok());

    // ListAndWatch: 8 GPUs (NUMA 0 for 0-3, 1 for 4-7) and 8 x 16 memory units, all healthy.
    let list = first_list(&mut gpus).await;
    assert_eq!(list.len(), 8);
    let uuids: Vec<String> = list.iter().map(|d| d.id.clone()).collect();
    for (i, d) in list.iter().enumerate() {
        assert!(d.id.starts_with("GPU-"), "{}", d.id);
        assert_eq!(d.health, "Healthy");
        let numa = d.topology.as_ref().unwrap().nodes[0].id;
        assert_eq!(numa, if i < 4 { 0 } else { 1 }, "GPU {i}");
    }
    let mlist = first_list(&mut mems).await;
    assert_eq!(mlist.len(), 8 * 16);
    let ids: BTreeSet<&str> = mlist.iter().map(|d| d.id.as_str()).collect();
    assert_eq!(ids.len(), 128, "unit IDs are unique");
    assert!(ids.contains(format!("{}-mem-15", uuids[7]).as_str()));
    assert!(mlist
        .iter()
        .all(|d| d.health == "Healthy" && d.id.len() <= 63));

    // GetPreferredAllocation, memory: best fit among GPU 0 (6 free), 1 (16), 2 (8).
    let mut avail = units(&uuids[0], 10..16);
    avail.extend(units(&uuids[1], 0..16));
    avail.extend(units(&uuids[2], 8..16));
    for (size, gpu_i) in [(5, 0), (6, 0), (7, 2), (8, 2), (9, 1), (16, 1)] {
        let pick = preferred(&mut mems, &avail, size).await.unwrap();
        assert_eq!(pick.len(), size as usize);
        assert!(
            pick.iter()
                .all(|id| id.starts_with(&format!("{}-mem-", uuids[gpu_i]))),
            "size {size} should go to GPU {gpu_i}: {pick:?}"
        );
    }
    // Too big for any one GPU: spans, emptiest first.
    let pick = preferred(&mut mems, &avail, 20).await.unwrap();
    assert_eq!(pick.len(), 20);
    assert_eq!(
        pick.iter().filter(|id| id.starts_with(&uuids[1])).count(),
        16
    );

    // Whole GPUs, size 2 of 8 free: a pair joined by 2 NVLinks.
    let pick = preferred(&mut gpus, &uuids, 2).await.unwrap();
    let mut idx: Vec<usize> = pick
        .iter()
        .map(|u| uuids.iter().position(|x| x == u).unwrap())
        .collect();
    idx.sort();
    assert!(
        TWO_LINK_PAIRS.contains(&(idx[0], idx[1])),
        "{idx:?} is no 2-NVLink pair"
    );

    // Allocate 6 units of GPU 1: envs, mounts (read-only flags), devices, the limits file.
    let r = allocate(&mut mems, &units(&uuids[1], 0..6)).await.unwrap();
    assert_eq!(r.envs["NVIDIA_VISIBLE_DEVICES"], uuids[1]);
    assert!(
        !r.envs.contains_key("CUVISOR_CONFIG"),
        "the library finds the limits at their fixed path, not through the environment"
    );
    assert!(mount(&r, cuvisor_shm::CONTAINER_LIMITS).read_only);
    let lib = mount(&r, "/usr/local/lib/cuvisor/libcuvisor.so");
    assert!(lib.read_only);
    assert_eq!(
        Path::new(&lib.host_path),
        built().join("deps/libcuvisor.so")
    );
    let preload = mount(&r, "/etc/ld.so.preload");
    assert!(preload.read_only);
    assert_eq!(
        std::fs::read_to_string(&preload.host_path).unwrap(),
        "/usr/local/lib/cuvisor/libcuvisor.so\n"
    );
    let limits = mount(&r, "/var/run/cuvisor/limits.conf");
    assert!(limits.read_only);
    assert!(Path::new(&limits.host_path).starts_with(s.state_root()));
    let state = mount(&r, "/var/run/cuvisor/state");
    assert!(!state.read_only && Path::new(&state.host_path).is_dir());
    // Every GPU's coordinator read-only (only the plugin writes the boards), and the
    // container's own state on this GPU read-write, at a path of its own.
    let coord = mount(&r, "/var/run/cuvisor/coord");
    assert!(coord.read_only && Path::new(&coord.host_path).is_dir());
    let hex: String = cuvisor_shm::uuid::parse(&uuids[1])
        .unwrap()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let own = mount(&r, &format!("/var/run/cuvisor/compute/gpu-{hex}"));
    assert!(!own.read_only);
    let id = &r.annotations["cuvisor.io/allocation"];
    assert_eq!(
        Path::new(&own.host_path),
        Path::new(&coord.host_path).join(format!("gpu-{hex}/slot-00-{id}"))
    );
    let text = std::fs::read_to_string(&limits.host_path).unwrap();
    let lines: Vec<&str> = text.lines().filter(|l| !l.starts_with('#')).collect();
    assert_eq!(
        lines,
        [
            "version = 1".to_string(),
            "state_dir = /var/run/cuvisor/state".to_string(),
            "coord_dir = /var/run/cuvisor/coord".to_string(),
            format!("memory.{} = {}", uuids[1], 6 * GIB),
            "coord_own_dir = /var/run/cuvisor/compute".to_string(),
            format!("coord_slot.{} = 0", uuids[1]),
        ],
        "{text}"
    );
    assert!(
        !text.contains("compute ="),
        "no compute line: the default share follows memory"
    );
    let devs: Vec<(&str, &str, &str)> = r
        .devices
        .iter()
        .map(|d| {
            (
                d.container_path.as_str(),
                d.host_path.as_str(),
                d.permissions.as_str(),
            )
        })
        .collect();
    let dev = |n: &str| s.0.join("dev").join(n).to_string_lossy().into_owned();
    assert_eq!(
        devs,
        [
            ("/dev/nvidia1", dev("nvidia1").as_str(), "rw"),
            ("/dev/nvidiactl", dev("nvidiactl").as_str(), "rw"),
            ("/dev/nvidia-uvm", dev("nvidia-uvm").as_str(), "rw"),
        ],
        "nvidia-uvm-tools does not exist on this host and is left out"
    );

    // A set that spans GPUs when one could hold it: refused, with the reason.
    let mut span = units(&uuids[2], 0..3);
    span.extend(units(&uuids[3], 0..3));
    let e = allocate(&mut mems, &span)
        .await
        .expect_err("a needless span");
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    assert!(
        e.message().contains("span 2 GPUs") && e.message().contains("must fit on one GPU"),
        "{}",
        e.message()
    );
    // One that no GPU could hold alone (20 > 16 units): allowed, a quota per GPU.
    let mut big = units(&uuids[4], 0..16);
    big.extend(units(&uuids[5], 0..4));
    let r = allocate(&mut mems, &big).await.unwrap();
    assert_eq!(
        r.envs["NVIDIA_VISIBLE_DEVICES"],
        format!("{},{}", uuids[4], uuids[5])
    );
    let text =
        std::fs::read_to_string(&mount(&r, "/var/run/cuvisor/limits.conf").host_path).unwrap();
    assert!(
        text.contains(&format!("memory.{} = {}", uuids[4], 16 * GIB)),
        "{text}"
    );
    assert!(
        text.contains(&format!("memory.{} = {}", uuids[5], 4 * GIB)),
        "{text}"
    );

    // Whole GPUs: the devices and NVIDIA_VISIBLE_DEVICES.
    let r = allocate(&mut gpus, &[uuids[6].clone(), uuids[7].clone()])
        .await
        .unwrap();
    assert_eq!(
        r.envs["NVIDIA_VISIBLE_DEVICES"],
        format!("{},{}", uuids[6], uuids[7])
    );
    assert_eq!(r.devices[0].container_path, "/dev/nvidia6");

    // Fill GPUs 0, 2 and 3 to 4 free units each (GPU 1 already has 10 free).
    for g in [0, 2, 3] {
        allocate(&mut mems, &units(&uuids[g], 0..12)).await.unwrap();
    }
    allocate(&mut mems, &units(&uuids[1], 6..12)).await.unwrap();

    // kubelet restarts: its socket (and ours) removed, a new one created.
    kubelet.stop(&s.dp()).await;
    let restarted = Instant::now();
    let mut kubelet = Kubelet::start(&s.dp());
    let regs = kubelet.registrations(2, Duration::from_secs(5)).await;
    assert!(restarted.elapsed() < Duration::from_secs(5));
    assert_eq!(
        regs["cuvisor.io/gpu-memory"].endpoint,
        "cuvisor-gpu-memory.sock"
    );
    let mut mems = client(&s.dp(), "cuvisor-gpu-memory.sock").await;
    assert_eq!(first_list(&mut mems).await.len(), 128);
    // Allocations are remembered: GPUs 0-4 are nearly full, so the first GPU that could hold
    // a 6-unit request is GPU 5 with 12 free units (a plugin that forgot would name GPU 0, 16).
    let mut span = units(&uuids[0], 12..15);
    span.extend(units(&uuids[2], 12..15));
    let e = allocate(&mut mems, &span)
        .await
        .expect_err("GPU 5 alone can hold it");
    assert!(
        e.message()
            .contains(&format!("GPU {} alone has 12 free units", uuids[5])),
        "{}",
        e.message()
    );
    drop(kubelet);
}

/// Allocate's answer for 6 units on the `single` preset, applied by hand (the mounts mapped
/// back to host paths): the tf_stress twin sees exactly a 6 GiB GPU and passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allocate_applied_by_hand_holds_the_twin_to_6_gib() {
    let s = Scratch::new("e2e");
    let mut kubelet = Kubelet::start(&s.dp());
    let _plugin = spawn_plugin(&s, "single");
    let regs = kubelet.registrations(2, Duration::from_secs(30)).await;
    let mut mems = client(&s.dp(), &regs["cuvisor.io/gpu-memory"].endpoint).await;
    let list = first_list(&mut mems).await;
    assert_eq!(list.len(), 16);
    let avail: Vec<String> = list.iter().map(|d| d.id.clone()).collect();
    let pick = preferred(&mut mems, &avail, 6).await.unwrap();
    let r = allocate(&mut mems, &pick).await.unwrap();

    // What the runtime would do: bind mounts. Here: container paths in the limits file
    // rewritten to their host paths, CUVISOR_CONFIG and LD_PRELOAD on host paths.
    let to_host = |container: &str| -> String {
        let m = r
            .mounts
            .iter()
            .filter(|m| container.starts_with(&m.container_path))
            .max_by_key(|m| m.container_path.len())
            .unwrap_or_else(|| panic!("{container} is not mounted"));
        format!("{}{}", m.host_path, &container[m.container_path.len()..])
    };
    let limits_host = to_host(cuvisor_shm::CONTAINER_LIMITS);
    let mut text = std::fs::read_to_string(&limits_host).unwrap();
    for m in &r.mounts {
        text = text.replace(
            &format!(" {}\n", m.container_path),
            &format!(" {}\n", m.host_path),
        );
    }
    let mapped = s.0.join("limits-on-host.conf");
    std::fs::write(&mapped, &text).unwrap();
    let state_host = to_host("/var/run/cuvisor/state");
    assert!(
        text.contains(&format!("state_dir = {state_host}\n")),
        "{text}"
    );

    let twin = twin();
    let mut cmd = Command::new(&twin);
    for (k, v) in &r.envs {
        cmd.env(k, v);
    }
    let out = cmd
        .env("CUVISOR_CONFIG", &mapped)
        .env(
            "LD_PRELOAD",
            to_host("/usr/local/lib/cuvisor/libcuvisor.so"),
        )
        .env("LD_LIBRARY_PATH", built().join("sim"))
        .env("CUVISOR_SIM", "single")
        .env("CUVISOR_SIM_STATE", s.0.join("sim.state"))
        .env_remove("CUVISOR_MEMORY_LIMIT")
        .env_remove("CUVISOR_STATE_DIR")
        .output()
        .unwrap();
    let so = String::from_utf8_lossy(&out.stdout);
    let se = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{so}{se}");
    assert!(so.contains("total 6144 MiB, free 6144 MiB"), "{so}");
    assert!(so.contains("fraction 1.00: allocated 6144 MiB ok"), "{so}");
    assert!(
        so.contains("fraction 1.20: failed cleanly: CUDA_ERROR_OUT_OF_MEMORY"),
        "{so}"
    );
    assert!(so.ends_with("twin: PASS\n"), "{so}");
    // The ledger is in the allocation's state directory, with the 6 GiB limit.
    let ledger = cuvisor_shm::ledger::Ledger::open_dir(Path::new(&state_host)).unwrap();
    let limits: Vec<u64> = ledger
        .devices()
        .map(|(_, _, d)| d.limit.load(std::sync::atomic::Ordering::Acquire))
        .collect();
    assert_eq!(limits, [6 * GIB]);
    drop(kubelet);
}

/// The twin, compiled once per test binary.
fn twin() -> PathBuf {
    static EXE: OnceLock<PathBuf> = OnceLock::new();
    EXE.get_or_init(|| {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/tf_stress/twin.c");
        let out = Path::new(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("dp_tf_stress_twin-{}", std::process::id()));
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
    .clone()
}

use support::pods::FakePods;

type DeviceStream = tonic::Streaming<api::ListAndWatchResponse>;

async fn watch(c: &mut DevicePluginClient<Channel>) -> DeviceStream {
    c.list_and_watch(api::Empty {}).await.unwrap().into_inner()
}

/// ListAndWatch messages until one satisfies `ok`, within `within`; returns it and when it came.
async fn until(
    s: &mut DeviceStream,
    within: Duration,
    what: &str,
    ok: impl Fn(&[api::Device]) -> bool,
) -> (Vec<api::Device>, Instant) {
    let deadline = tokio::time::Instant::now() + within;
    let mut last = Vec::new();
    loop {
        match tokio::time::timeout_at(deadline, s.message()).await {
            Ok(Ok(Some(m))) => {
                if ok(&m.devices) {
                    return (m.devices, Instant::now());
                }
                last = m.devices;
            }
            Ok(r) => panic!("ListAndWatch ended waiting for {what}: {r:?}"),
            Err(_) => panic!(
                "no ListAndWatch update with {what} within {within:?}; last: {:?}",
                unhealthy(&last)
            ),
        }
    }
}

/// The IDs reported Unhealthy.
fn unhealthy(list: &[api::Device]) -> BTreeSet<String> {
    list.iter()
        .filter(|d| d.health != "Healthy")
        .map(|d| d.id.clone())
        .collect()
}

/// Exactly the devices whose ID starts with one of `prefixes` are Unhealthy.
fn only_unhealthy(list: &[api::Device], prefixes: &[&str]) -> bool {
    list.iter()
        .all(|d| (d.health == "Healthy") != prefixes.iter().any(|p| d.id.starts_with(p)))
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

async fn scrape(port: u16) -> std::io::Result<String> {
    http_get(port, "/metrics").await
}

async fn http_get(port: u16, path: &str) -> std::io::Result<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut c = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    c.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes())
        .await?;
    let mut out = String::new();
    c.read_to_string(&mut out).await?;
    Ok(out)
}

/// Health on the running binary: an XID injected on GPU 3 through the simulator turns GPU 3 and
/// its memory units Unhealthy in ListAndWatch, Healthy again once the 1 s hold has passed; an
/// NVLink of GPU 0 going down and up does the same. Then /metrics is scraped once: a memory
/// allocation shows up with its pod and its limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn xid_and_nvlink_reach_list_and_watch_and_metrics_are_served() {
    let s = Scratch::new("health");
    let mut kubelet = Kubelet::start(&s.dp());
    let pods = FakePods::default();
    let _kubelet = pods.serve(&s.0.join("pod-resources.sock"));
    let port = free_port();
    let _plugin = spawn_plugin_with(
        &s,
        "dgx1-v100",
        port,
        &format!(
            "[pod_resources]\nsocket = {:?}\nrefresh_seconds = 1\n\
             [health]\nxid_hold_seconds = 1\npoll_ms = 50\n",
            s.0.join("pod-resources.sock")
        ),
    );
    let regs = kubelet.registrations(2, Duration::from_secs(30)).await;
    let mut gpus = client(&s.dp(), &regs["cuvisor.io/gpu"].endpoint).await;
    let mut mems = client(&s.dp(), &regs["cuvisor.io/gpu-memory"].endpoint).await;
    let mut gw = watch(&mut gpus).await;
    let mut mw = watch(&mut mems).await;
    let (list, _) = until(&mut gw, Duration::from_secs(10), "a first list", |_| true).await;
    assert!(unhealthy(&list).is_empty(), "{:?}", unhealthy(&list));
    let uuids: Vec<String> = list.iter().map(|d| d.id.clone()).collect();
    let (mlist, _) = until(&mut mw, Duration::from_secs(10), "a first list", |_| true).await;
    assert_eq!(mlist.len(), 128);
    assert!(unhealthy(&mlist).is_empty());

    let model = cuvisor_sim::model::Model::load("dgx1-v100").unwrap();
    let sim = cuvisor_sim::state::Shared::attach_at(&model, &s.0.join("sim.state")).unwrap();
    assert_eq!(model.devices[3].uuid, uuids[3]);

    // XID 79 (fallen off the bus) on GPU 3. Raised again until seen, in case the monitor had
    // not registered its event set yet; the hold counts from the last one.
    let gpu3 = uuids[3].as_str();
    let mut raised;
    let list = loop {
        sim.raise_xid(3, 79);
        raised = Instant::now();
        match tokio::time::timeout(
            Duration::from_millis(700),
            until(&mut gw, Duration::from_secs(5), "GPU 3 Unhealthy", |l| {
                only_unhealthy(l, &[gpu3])
            }),
        )
        .await
        {
            Ok((l, _)) => break l,
            Err(_) => assert!(
                raised.elapsed() < Duration::from_secs(20),
                "the XID never reached ListAndWatch"
            ),
        }
    };
    assert_eq!(unhealthy(&list).len(), 1);
    let (mlist, _) = until(
        &mut mw,
        Duration::from_secs(5),
        "GPU 3's units Unhealthy",
        |l| only_unhealthy(l, &[&format!("{gpu3}-mem-")]),
    )
    .await;
    assert_eq!(unhealthy(&mlist).len(), 16);
    let (_, back) = until(&mut gw, Duration::from_secs(10), "GPU 3 Healthy", |l| {
        unhealthy(l).is_empty()
    })
    .await;
    assert!(
        back >= raised + Duration::from_secs(1),
        "Healthy {:?} after the XID, before the 1 s hold",
        back - raised
    );
    until(&mut mw, Duration::from_secs(5), "all units Healthy", |l| {
        unhealthy(l).is_empty()
    })
    .await;

    // NVLink 3 of GPU 0 down, then up.
    let gpu0 = uuids[0].as_str();
    sim.device(0)
        .nvlink_down
        .fetch_or(1 << 3, std::sync::atomic::Ordering::AcqRel);
    until(&mut gw, Duration::from_secs(5), "GPU 0 Unhealthy", |l| {
        only_unhealthy(l, &[gpu0])
    })
    .await;
    until(
        &mut mw,
        Duration::from_secs(5),
        "GPU 0's units Unhealthy",
        |l| only_unhealthy(l, &[&format!("{gpu0}-mem-")]),
    )
    .await;
    sim.device(0)
        .nvlink_down
        .fetch_and(!(1 << 3), std::sync::atomic::Ordering::AcqRel);
    until(&mut gw, Duration::from_secs(5), "GPU 0 Healthy", |l| {
        unhealthy(l).is_empty()
    })
    .await;

    // Metrics: 6 units of GPU 1 for pod ml/train; its limit (no CUDA process yet: the quota).
    let ids = units(&uuids[1], 0..6);
    let r = allocate(&mut mems, &ids).await.unwrap();
    assert_eq!(r.envs["NVIDIA_VISIBLE_DEVICES"], uuids[1]);
    pods.run("train", "cuvisor.io/gpu-memory", &ids);
    let want = format!(
        "cuvisor_container_memory_limit_bytes{{namespace=\"ml\",pod=\"train\",container=\"main\",\
         gpu_uuid=\"{}\",allocation=\"",
        uuids[1]
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    let text = loop {
        let text = scrape(port).await.unwrap_or_default();
        if text.contains(&want) || Instant::now() > deadline {
            break text;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    let line = text
        .lines()
        .find(|l| l.starts_with(&want))
        .unwrap_or_else(|| panic!("no {want} in\n{text}"));
    assert!(line.ends_with(&format!(" {}", 6 * GIB)), "{line}");
    for l in [
        format!(
            "cuvisor_gpu_memory_quota_bytes{{gpu_uuid=\"{}\"}} {}",
            uuids[1],
            6 * GIB
        ),
        format!("cuvisor_gpu_healthy{{gpu_uuid=\"{}\"}} 1", uuids[3]),
        "cuvisor_allocations{resource=\"cuvisor.io/gpu-memory\"} 1".to_string(),
    ] {
        assert!(text.lines().any(|x| x == l), "no {l} in\n{text}");
    }
    drop(kubelet);
}

/// Both resources are backed by the same GPUs: a GPU held whole hides its memory units, memory
/// units in use hide their GPU (Unhealthy in ListAndWatch, refused by GetPreferredAllocation and
/// Allocate), until the allocation is over (here: its pod leaves PodResources and the sweeper
/// removes it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gpu_is_never_given_whole_and_in_memory_units_at_once() {
    let s = Scratch::new("conflict");
    let mut kubelet = Kubelet::start(&s.dp());
    let pods = FakePods::default();
    let _kubelet = pods.serve(&s.0.join("pod-resources.sock"));
    let _plugin = spawn_plugin_with(
        &s,
        "dgx1-v100",
        0,
        &format!(
            "[pod_resources]\nsocket = {:?}\nrefresh_seconds = 1\n\
             [cleanup]\ngrace_seconds = 3\ninterval_seconds = 1\n",
            s.0.join("pod-resources.sock")
        ),
    );
    let regs = kubelet.registrations(2, Duration::from_secs(30)).await;
    let mut gpus = client(&s.dp(), &regs["cuvisor.io/gpu"].endpoint).await;
    let mut mems = client(&s.dp(), &regs["cuvisor.io/gpu-memory"].endpoint).await;
    let mut gw = watch(&mut gpus).await;
    let mut mw = watch(&mut mems).await;
    let (list, _) = until(&mut gw, Duration::from_secs(10), "a first list", |_| true).await;
    let uuids: Vec<String> = list.iter().map(|d| d.id.clone()).collect();
    until(&mut mw, Duration::from_secs(10), "a first list", |l| {
        unhealthy(l).is_empty()
    })
    .await;
    let mem_of = |g: usize| format!("{}-mem-", uuids[g]);

    // GPU 2 whole: its 16 units go Unhealthy, the GPU list does not change.
    allocate(&mut gpus, &[uuids[2].clone()]).await.unwrap();
    pods.run("whole", "cuvisor.io/gpu", &[uuids[2].clone()]);
    let (ml, _) = until(
        &mut mw,
        Duration::from_secs(5),
        "GPU 2's units Unhealthy",
        |l| only_unhealthy(l, &[&mem_of(2)]),
    )
    .await;
    assert_eq!(unhealthy(&ml).len(), 16);
    // Preferred: GPU 2's 8 units would be the best fit for 8; they are not offered.
    let mut avail = units(&uuids[2], 0..8);
    avail.extend(units(&uuids[5], 0..16));
    let pick = preferred(&mut mems, &avail, 8).await.unwrap();
    assert!(pick.iter().all(|id| id.starts_with(&mem_of(5))), "{pick:?}");
    let e = preferred(&mut mems, &units(&uuids[2], 0..8), 4)
        .await
        .expect_err("only units of a GPU held whole");
    assert_eq!(e.code(), tonic::Code::FailedPrecondition);
    assert!(
        e.message().contains("is allocated whole"),
        "{}",
        e.message()
    );
    let e = mems
        .get_preferred_allocation(api::PreferredAllocationRequest {
            container_requests: vec![api::ContainerPreferredAllocationRequest {
                available_device_i_ds: avail.clone(),
                must_include_device_i_ds: units(&uuids[2], 0..1),
                allocation_size: 2,
            }],
        })
        .await
        .expect_err("a must-include unit of a GPU held whole");
    assert!(e.message().contains("must-include"), "{}", e.message());
    let e = allocate(&mut mems, &units(&uuids[2], 0..4))
        .await
        .expect_err("units of a GPU held whole");
    assert_eq!(e.code(), tonic::Code::FailedPrecondition);
    assert!(
        e.message()
            .contains(&format!("GPU {} is allocated whole", uuids[2])),
        "{}",
        e.message()
    );

    // 4 units of GPU 5: GPU 5 goes Unhealthy as a whole GPU, and is refused.
    let ids5 = units(&uuids[5], 0..4);
    allocate(&mut mems, &ids5).await.unwrap();
    pods.run("frac", "cuvisor.io/gpu-memory", &ids5);
    until(&mut gw, Duration::from_secs(5), "GPU 5 Unhealthy", |l| {
        only_unhealthy(l, &[&uuids[5]])
    })
    .await;
    let pick = preferred(&mut gpus, &[uuids[5].clone(), uuids[6].clone()], 1)
        .await
        .unwrap();
    assert_eq!(pick, [uuids[6].clone()]);
    let e = allocate(&mut gpus, &[uuids[5].clone()])
        .await
        .expect_err("a GPU with memory units in use");
    assert_eq!(e.code(), tonic::Code::FailedPrecondition);
    assert!(
        e.message().contains("4 memory unit(s)") && e.message().contains("in use"),
        "{}",
        e.message()
    );
    // The rest of GPU 5's units are still there for memory requests.
    let more5 = units(&uuids[5], 4..8);
    allocate(&mut mems, &more5).await.unwrap();
    pods.run("frac-2", "cuvisor.io/gpu-memory", &more5);

    // The whole-GPU pod ends: once the sweeper drops it, GPU 2's units are Healthy again, and
    // so is nothing else that changed.
    pods.end("whole");
    let (ml, _) = until(
        &mut mw,
        Duration::from_secs(15),
        "GPU 2's units Healthy",
        |l| unhealthy(l).is_empty(),
    )
    .await;
    assert_eq!(ml.len(), 128);
    let ids2 = units(&uuids[2], 0..4);
    allocate(&mut mems, &ids2).await.unwrap();
    pods.run("frac-3", "cuvisor.io/gpu-memory", &ids2);
    until(
        &mut gw,
        Duration::from_secs(5),
        "GPUs 2 and 5 Unhealthy",
        |l| only_unhealthy(l, &[&uuids[2], &uuids[5]]),
    )
    .await;
    drop(kubelet);
}

/// Allocate names each GPU's device node by its minor number (`nvmlDeviceGetMinorNumber`), not
/// its NVML index: on a machine (a model file, `--sim <path>`) whose GPU 0 is `/dev/nvidia3` and
/// GPU 1 `/dev/nvidia1`, whole GPUs and memory units alike get those nodes, at the same path in
/// the container.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allocate_names_device_nodes_by_minor_number() {
    let s = Scratch::new("minor");
    let model = s.0.join("minors.toml");
    std::fs::write(
        &model,
        "name = \"minors\"\n\
         [[device]]\nmemory = \"4Gi\"\nminor = 3\n\
         [[device]]\nmemory = \"4Gi\"\nminor = 1\n",
    )
    .unwrap();
    let m = cuvisor_sim::model::Model::load(model.to_str().unwrap()).unwrap();
    let uuids: Vec<String> = m.devices.iter().map(|d| d.uuid.clone()).collect();
    let mut kubelet = Kubelet::start(&s.dp());
    let _plugin = spawn_plugin(&s, model.to_str().unwrap());
    let regs = kubelet.registrations(2, Duration::from_secs(30)).await;
    let mut gpus = client(&s.dp(), &regs["cuvisor.io/gpu"].endpoint).await;
    let mut mems = client(&s.dp(), &regs["cuvisor.io/gpu-memory"].endpoint).await;
    let listed: Vec<String> = first_list(&mut gpus)
        .await
        .into_iter()
        .map(|d| d.id)
        .collect();
    assert_eq!(listed, uuids, "ListAndWatch in index order");

    let dev = |n: &str| s.0.join("dev").join(n).to_string_lossy().into_owned();
    let gpu_nodes = |r: &api::ContainerAllocateResponse| -> Vec<(String, String)> {
        r.devices
            .iter()
            .filter(|d| {
                d.container_path
                    .strip_prefix("/dev/nvidia")
                    .is_some_and(|n| n.parse::<u32>().is_ok())
            })
            .map(|d| (d.container_path.clone(), d.host_path.clone()))
            .collect()
    };
    let node = |n: u32| (format!("/dev/nvidia{n}"), dev(&format!("nvidia{n}")));

    // GPU index 0, whole: /dev/nvidia3 (not /dev/nvidia0).
    let r = allocate(&mut gpus, &[uuids[0].clone()]).await.unwrap();
    assert_eq!(r.envs["NVIDIA_VISIBLE_DEVICES"], uuids[0]);
    assert_eq!(gpu_nodes(&r), [node(3)], "{:?}", r.devices);
    // Memory units of GPU index 1: /dev/nvidia1.
    let r = allocate(&mut mems, &units(&uuids[1], 0..2)).await.unwrap();
    assert_eq!(r.envs["NVIDIA_VISIBLE_DEVICES"], uuids[1]);
    assert_eq!(gpu_nodes(&r), [node(1)], "{:?}", r.devices);
    drop(kubelet);
}

/// The attack: 400 idle TCP connections to the metrics port (anyone on the pod network can open
/// them) took all of the plugin's file descriptors, and Allocate, which creates files, failed
/// with EMFILE (while the accept loop spun on the error). Here the plugin runs with 256
/// descriptors (soft and hard, so raising the soft limit does not help), 400 clients connect at
/// once and hold their connections without sending anything, and meanwhile Allocate succeeds,
/// ListAndWatch serves, and /healthz and /metrics answer at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_hundred_idle_metrics_connections_do_not_exhaust_the_plugins_descriptors() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let s = Scratch::new("idle-conns");
    let mut kubelet = Kubelet::start(&s.dp());
    let port = free_port();
    let _plugin = spawn_plugin_under(&s, "single", port, "", Some("-n 256"));
    let regs = kubelet.registrations(2, Duration::from_secs(30)).await;
    let mut mems = client(&s.dp(), &regs["cuvisor.io/gpu-memory"].endpoint).await;
    let list = first_list(&mut mems).await;
    assert_eq!(list.len(), 16);

    // 400 idle clients, all at once, each holding its connection until the test ends. (The
    // plugin's accept queue holds 128: the rest get in as their SYNs are sent again, from 1 s.)
    let connected = Arc::new(AtomicUsize::new(0));
    let (stop, stopped) = tokio::sync::watch::channel(false);
    for _ in 0..400 {
        let connected = connected.clone();
        let mut stopped = stopped.clone();
        tokio::spawn(async move {
            let c = tokio::net::TcpStream::connect(("127.0.0.1", port)).await;
            if c.is_ok() {
                connected.fetch_add(1, Ordering::Relaxed);
            }
            let _ = stopped.changed().await;
            drop(c);
        });
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let held = connected.load(Ordering::Relaxed);
    assert!(held > 256, "only {held} idle clients connected: no attack");

    let ids: Vec<String> = list[..2].iter().map(|d| d.id.clone()).collect();
    let r = allocate(&mut mems, &ids)
        .await
        .unwrap_or_else(|e| panic!("Allocate with {held} idle metrics clients: {e}"));
    assert!(
        r.mounts
            .iter()
            .any(|m| m.container_path == cuvisor_shm::CONTAINER_LIMITS),
        "a whole answer: the limits file is mounted"
    );
    assert_eq!(first_list(&mut mems).await.len(), 16);
    for path in ["/healthz", "/metrics"] {
        let resp = tokio::time::timeout(Duration::from_secs(2), http_get(port, path))
            .await
            .unwrap_or_else(|_| panic!("{path} did not answer within 2 s"))
            .unwrap_or_else(|e| panic!("{path}: {e}"));
        assert!(resp.starts_with("HTTP/1.1 200"), "{path}: {resp}");
    }
    let _ = stop.send(true);
    drop(kubelet);
}

/// The plugin raises its soft limit on open files to the hard limit (a container runtime's soft
/// default is often 1024, far below the hard one).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_low_soft_open_files_limit_is_raised_to_the_hard_limit() {
    let s = Scratch::new("nofile");
    let mut kubelet = Kubelet::start(&s.dp());
    let plugin = spawn_plugin_under(&s, "single", 0, "", Some("-S -n 64"));
    kubelet.registrations(2, Duration::from_secs(30)).await;
    let limits = std::fs::read_to_string(format!("/proc/{}/limits", plugin.0.id())).unwrap();
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .unwrap();
    let v: Vec<&str> = line.split_whitespace().collect();
    let (soft, hard) = (v[3], v[4]);
    assert_ne!(soft, "64", "{line}");
    assert_eq!(soft, hard, "{line}");
    drop(kubelet);
}

/// The plugin binary with config `cfg`, run until it exits (at most `within`): its exit code and
/// what it wrote to stderr. A plugin still running then is killed and the test fails: it kept
/// running with a configuration it cannot serve.
fn run_plugin_to_exit(
    s: &Scratch,
    preset: &str,
    cfg: &Path,
    within: Duration,
) -> (Option<i32>, String) {
    let mut child = plugin_args(&mut Command::new(EXE), s, preset, cfg)
        .stderr(Stdio::piped())
        .spawn()
        .expect("start cuvisor-device-plugin");
    let deadline = Instant::now() + within;
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the plugin was still running after {within:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut err = String::new();
    use std::io::Read;
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    (status.code(), err)
}

/// The plugin's stderr is one line, its reason for exiting, and it starts with `start`.
fn one_line_reason(err: &str, start: &str) -> String {
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(lines.len(), 1, "{err}");
    let line = lines[0].strip_prefix("cuvisor-device-plugin: ").unwrap();
    assert!(line.starts_with(start), "{line}");
    line.to_string()
}

/// The attack on the configuration: `memory_unit = "1Mi"` on a DGX-1 (8 x 16 GiB) makes
/// ListAndWatch's response 131072 devices, about 9 MB, over the 4 MiB kubelet's gRPC client
/// accepts: kubelet would drop the stream and never see the resource, while the plugin ran on.
/// Now the plugin refuses to start, with the reason and the smallest unit that fits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_1mi_memory_unit_on_a_dgx1_stops_the_plugin_with_the_smallest_unit_that_fits() {
    let s = Scratch::new("unit-1mi");
    let cfg = write_config(&s, 0, "[resources]\nmemory_unit = \"1Mi\"\n");
    let (code, err) = run_plugin_to_exit(&s, "dgx1-v100", &cfg, Duration::from_secs(20));
    assert_eq!(code, Some(2), "{err}");
    let line = one_line_reason(
        &err,
        "resources.memory_unit = \"1Mi\": the ListAndWatch response",
    );
    assert!(line.contains("(131072 memory units on 8 GPU(s))"), "{line}");
    assert!(line.contains("over the 4194304 bytes (4 MiB)"), "{line}");
    let unit = line
        .rsplit_once("the smallest memory_unit that fits is ")
        .map(|(_, u)| u.trim_matches('"').to_string())
        .unwrap_or_else(|| panic!("no unit that fits in {line}"));
    // That unit does start, and registers.
    let mut kubelet = Kubelet::start(&s.dp());
    let _plugin = spawn_plugin_with(
        &s,
        "dgx1-v100",
        0,
        &format!("[resources]\nmemory_unit = {unit:?}\n"),
    );
    let regs = kubelet.registrations(2, Duration::from_secs(30)).await;
    let mut mems = client(&s.dp(), &regs["cuvisor.io/gpu-memory"].endpoint).await;
    let n = first_list(&mut mems).await.len();
    let mib: u64 = unit.trim_end_matches("Mi").parse().unwrap();
    assert_eq!(
        n as u64,
        8 * ((16 << 10) / mib),
        "{unit} units of 8 x 16 GiB"
    );
    drop(kubelet);
}

/// A `socket_dir` so long that its sockets do not fit in a Unix socket address: the plugin ran
/// on, serving nothing. Now it exits at once with the reason.
#[test]
fn a_socket_dir_too_long_for_a_unix_socket_stops_the_plugin() {
    let s = Scratch::new("long-dir");
    let long = s.0.join("d".repeat(100));
    std::fs::create_dir_all(&long).unwrap();
    let cfg = write_config(&s, 0, "");
    let text = std::fs::read_to_string(&cfg).unwrap().replace(
        &format!("socket_dir = {:?}", s.dp()),
        &format!("socket_dir = {long:?}"),
    );
    std::fs::write(&cfg, text).unwrap();
    let (code, err) = run_plugin_to_exit(&s, "single", &cfg, Duration::from_secs(20));
    assert_eq!(code, Some(2), "{err}");
    let line = one_line_reason(&err, "");
    assert!(
        line.contains("socket_dir: the Unix socket path ") && line.contains("at most 107 bytes"),
        "{line}"
    );
}

/// The attack on the tenants: a library built on a newer machine than the tenant images (the
/// issue: built on glibc 2.36 it needs GLIBC_2.34; Ubuntu 20.04 has 2.31, UBI 8 2.28) is
/// skipped by ld.so in those images, through /etc/ld.so.preload, and their programs run with no
/// quota. Now the plugin refuses, at startup, a library that needs a newer glibc than
/// `[host] tenant_glibc`: exit 2 and one line naming both versions. (Here the tenants' glibc is
/// set one minor below the newest the library needs, whatever machine built it.)
#[test]
fn a_library_needing_a_newer_glibc_than_the_tenants_stops_the_plugin() {
    let s = Scratch::new("tenant-glibc");
    let lib = built().join("deps/libcuvisor.so");
    let needs = cuvisor_elf_needs::parse(&std::fs::read(&lib).unwrap()).unwrap();
    let (newest, need) = needs.newest_glibc_needed().expect("a glibc library");
    let older = cuvisor_elf_needs::GlibcVersion::new(newest.major, newest.minor - 1);
    let cfg = write_config(&s, 0, "");
    let text = std::fs::read_to_string(&cfg).unwrap().replace(
        &format!("tenant_glibc = {:?}", glibc_here()),
        &format!("tenant_glibc = \"{older}\""),
    );
    std::fs::write(&cfg, text).unwrap();
    let (code, err) = run_plugin_to_exit(&s, "single", &cfg, Duration::from_secs(20));
    assert_eq!(code, Some(2), "{err}");
    one_line_reason(
        &err,
        &format!(
            "host.library {} needs glibc {newest} ({} of {}), newer than host.tenant_glibc = \"{older}\"",
            lib.display(),
            need.version,
            need.file
        ),
    );
}

/// An image whose library needs a newer glibc than `[host] tenant_glibc` (an upgrade built
/// without scripts/build-shipped.sh) must not replace the node's library before the plugin
/// refuses it: kubelet starts existing tenants again from its checkpointed answers, which mount
/// whatever is at `[host] library`. Before, the copy came first and the check after.
#[test]
fn an_image_library_the_tenants_cannot_load_does_not_replace_the_nodes() {
    let s = Scratch::new("install-glibc");
    let lib = built().join("deps/libcuvisor.so");
    let needs = cuvisor_elf_needs::parse(&std::fs::read(&lib).unwrap()).unwrap();
    let (newest, _) = needs.newest_glibc_needed().expect("a glibc library");
    let older = cuvisor_elf_needs::GlibcVersion::new(newest.major, newest.minor - 1);
    // The node's library: one the tenants can load (here: any file the check does not judge,
    // standing for it; its bytes must survive).
    let node_lib = s.0.join("node-lib/libcuvisor.so");
    std::fs::create_dir_all(node_lib.parent().unwrap()).unwrap();
    std::fs::write(&node_lib, b"the node's library").unwrap();
    let cfg = write_config(&s, 0, "");
    let text = std::fs::read_to_string(&cfg)
        .unwrap()
        .replace(
            &format!("tenant_glibc = {:?}", glibc_here()),
            &format!("tenant_glibc = \"{older}\"\ninstall_from = {lib:?}"),
        )
        .replace(
            &format!("library = {lib:?}"),
            &format!("library = {node_lib:?}"),
        );
    std::fs::write(&cfg, &text).unwrap();
    assert!(
        text.contains("install_from") && text.contains("node-lib"),
        "{text}"
    );
    let (code, err) = run_plugin_to_exit(&s, "single", &cfg, Duration::from_secs(20));
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.lines()
            .last()
            .unwrap_or("")
            .contains("host.install_from"),
        "{err}"
    );
    assert_eq!(
        std::fs::read(&node_lib).unwrap(),
        b"the node's library",
        "the node's library was replaced: {err}"
    );
}

/// A socket directory that cannot be made (a file stands in its way): binding fails after
/// start-up. The plugin used to run on without serving; now it stops with the reason.
#[test]
fn a_socket_dir_that_cannot_be_served_stops_the_plugin() {
    let s = Scratch::new("unservable");
    std::fs::write(s.0.join("file"), "").unwrap();
    let blocked = s.0.join("file").join("dp");
    let cfg = write_config(&s, 0, "");
    let text = std::fs::read_to_string(&cfg).unwrap().replace(
        &format!("socket_dir = {:?}", s.dp()),
        &format!("socket_dir = {blocked:?}"),
    );
    std::fs::write(&cfg, text).unwrap();
    let (code, err) = run_plugin_to_exit(&s, "single", &cfg, Duration::from_secs(20));
    assert_eq!(code, Some(2), "{err}");
    let last = err.lines().last().unwrap_or("");
    assert!(
        last.starts_with("cuvisor-device-plugin: ")
            && last.contains(&s.0.join("file").display().to_string()),
        "{err}"
    );
}

/// The attack on compatibility: kubelet before 1.26 dials a plugin with the socket path as
/// HTTP/2 `:authority` (grpc-java too; grpcio sends it percent-encoded), and h2 under tonic
/// reset every such request with PROTOCOL_ERROR, so such a kubelet could not use the plugin.
/// Here a raw HTTP/2 client sends GetDevicePluginOptions with `:authority` = the socket path,
/// encoded as grpc-go does (literals with incremental indexing), then the same request again
/// from the dynamic table on the same connection, then a ListAndWatch; and on a second
/// connection the percent-encoded path, as a literal without indexing. Each is answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_with_the_socket_path_as_authority_are_served() {
    use prost::Message;
    let s = Scratch::new("authority");
    let mut kubelet = Kubelet::start(&s.dp());
    let _plugin = spawn_plugin(&s, "single");
    let regs = kubelet.registrations(2, Duration::from_secs(30)).await;
    let sock = s.dp().join(&regs["cuvisor.io/gpu-memory"].endpoint);
    let path = sock.display().to_string();
    tokio::task::spawn_blocking(move || {
        let options = |r: &raw_h2::Reply| {
            assert_eq!(r.reset, None, "the stream was reset: {r:?}");
            assert_eq!(r.goaway, None, "the connection went away: {r:?}");
            assert_eq!(r.header(":status"), Some("200"), "{r:?}");
            assert_eq!(r.header("grpc-status"), Some("0"), "{r:?}");
            api::DevicePluginOptions::decode(r.message().expect("a response message")).unwrap()
        };
        let mut c = raw_h2::Client::connect(&sock).unwrap();
        let m = "/v1beta1.DevicePlugin/GetDevicePluginOptions";
        let r = c
            .unary(&raw_h2::first_request(m, path.as_bytes()), &[])
            .unwrap();
        assert!(options(&r).get_preferred_allocation_available);
        // Again, every field from the dynamic table (the authority among them).
        let r = c.unary(&raw_h2::repeated_request(), &[]).unwrap();
        assert!(options(&r).get_preferred_allocation_available);
        // A streaming call on the same connection: the first list arrives.
        let mut b = Vec::new();
        raw_h2::indexed(&mut b, 3);
        raw_h2::indexed(&mut b, 6);
        raw_h2::indexing(&mut b, 4, b"/v1beta1.DevicePlugin/ListAndWatch");
        for i in [65, 64, 63] {
            // :authority, content-type, te (the new :path pushed them one down)
            raw_h2::indexed(&mut b, i);
        }
        let r = c.first_message(&b, &[]).unwrap();
        assert_eq!((r.reset, r.header(":status")), (None, Some("200")), "{r:?}");
        let list = api::ListAndWatchResponse::decode(r.message().unwrap()).unwrap();
        assert_eq!(list.devices.len(), 16);
        // grpcio's form, on a connection of its own: the path percent-encoded.
        let mut g = raw_h2::Client::connect(&sock).unwrap();
        let mut b = Vec::new();
        raw_h2::indexed(&mut b, 3);
        raw_h2::indexed(&mut b, 6);
        raw_h2::not_indexed(&mut b, 4, m.as_bytes());
        raw_h2::not_indexed(&mut b, 1, path.replace('/', "%2F").as_bytes());
        raw_h2::not_indexed(&mut b, 31, b"application/grpc");
        let r = g.unary(&b, &[]).unwrap();
        assert!(options(&r).get_preferred_allocation_available);
    })
    .await
    .unwrap();
    drop(kubelet);
}

/// Where a memory allocation's ledger directory is on the host.
fn ledger_dir_of(r: &api::ContainerAllocateResponse) -> PathBuf {
    PathBuf::from(&mount(r, "/var/run/cuvisor/state").host_path)
}

/// A process of the container, as far as the sweeper can tell: a lease held in the ledger
/// (dropped, the container has no live process).
fn live_process(state: &Path) -> cuvisor_shm::ledger::Ledger {
    let l = cuvisor_shm::ledger::Ledger::open_dir(state).unwrap();
    l.claim_proc(std::process::id(), 1).unwrap();
    l
}

/// A chain of `levels` directories under `at`, made by descriptor (no path names its bottom).
fn deep_tree(at: &Path, levels: usize) {
    use rustix::fs::{mkdirat, openat, Mode, OFlags, CWD};
    let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    let mut fd = openat(CWD, at, flags, Mode::empty()).unwrap();
    for _ in 0..levels {
        mkdirat(&fd, "d", Mode::from_raw_mode(0o755)).unwrap();
        fd = openat(&fd, "d", flags, Mode::empty()).unwrap();
    }
}

/// The attack (issue 15): a tenant builds a 100 000-level tree in its read-write ledger
/// directory; when its allocation is cleaned up, the plugin's `remove_dir_all` overflowed the
/// sweeper's stack and the plugin aborted, and again at every restart, since the tree stayed.
/// Driven here as kubelet would: three allocations, the first filled with the tree, the first
/// two with no live process left, the third still running. The plugin must keep serving, take
/// the tree and the second allocation away, and leave the third. `[ledger_dir] mount = "none"`:
/// the plain directory that can hold such a tree (a tmpfs allocation holds at most 64 inodes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deep_tree_in_a_tenants_ledger_dir_neither_crashes_nor_blocks_the_plugin() {
    let s = Scratch::new("deep-tree");
    // The tree on a tmpfs when one can be mounted (ext4 here takes 20 s for 100 000 levels,
    // tmpfs 1 s); the plugin sees a plain directory either way.
    std::fs::create_dir_all(s.state_root()).unwrap();
    let _ = rustix::mount::mount(
        "cuvisor-test",
        s.state_root(),
        "tmpfs",
        rustix::mount::MountFlags::empty(),
        c"size=512m",
    );
    let mut kubelet = Kubelet::start(&s.dp());
    let mut plugin = spawn_plugin_with(
        &s,
        "single",
        0,
        "[cleanup]\ngrace_seconds = 3\ninterval_seconds = 1\n[ledger_dir]\nmount = \"none\"\n",
    );
    let regs = kubelet.registrations(2, Duration::from_secs(30)).await;
    let mut mem = client(&s.dp(), &regs["cuvisor.io/gpu-memory"].endpoint).await;
    let uuid = first_list(&mut mem).await[0]
        .id
        .rsplit_once("-mem-")
        .unwrap()
        .0
        .to_string();
    let mut states = Vec::new();
    let mut live = Vec::new();
    for k in 0..3 {
        let r = allocate(&mut mem, &units(&uuid, k..k + 1)).await.unwrap();
        let state = ledger_dir_of(&r);
        // Within the 3 s grace: a process of the container holds its lease from here on.
        live.push(live_process(&state));
        states.push(state);
    }
    let t = Instant::now();
    deep_tree(&states[0], 100_000);
    eprintln!("100000 levels made in {:?}", t.elapsed());
    // The first two containers end; the third runs on.
    let alive = live.pop().unwrap();
    drop(live);
    let gone = |p: &Path| !p.parent().unwrap().exists();
    let deadline = Instant::now() + Duration::from_secs(180);
    while !(gone(&states[0]) && gone(&states[1])) {
        assert!(
            plugin.0.try_wait().unwrap().is_none(),
            "the plugin died: {:?}",
            plugin.0.try_wait()
        );
        assert!(
            Instant::now() < deadline,
            "not removed within 180 s: {} {}",
            gone(&states[0]),
            gone(&states[1])
        );
        // Serving all along.
        assert!(!first_list(&mut mem).await.is_empty());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(plugin.0.try_wait().unwrap().is_none(), "the plugin died");
    assert!(
        states[2].exists(),
        "the running container's directory stays"
    );
    // Its units are free again and Allocate works.
    let r = allocate(&mut mem, &units(&uuid, 0..2)).await.unwrap();
    assert!(ledger_dir_of(&r).is_dir());
    drop(alive);
    drop(kubelet);
}

/// The attack (issue 15): one tenant fills its ledger directory, which lived on the host file
/// system with no bound, until that file system is full and every later Allocate fails. Now the
/// directory is a tmpfs of its own (1 MiB, 64 inodes by default): the tenant's writes stop at
/// its bound (ENOSPC), and the next allocation's ledger and the next Allocate are unaffected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_filling_its_ledger_dir_fails_that_tenant_alone() {
    use std::io::Write;
    let s = Scratch::new("fill");
    let mut kubelet = Kubelet::start(&s.dp());
    let _plugin = spawn_plugin(&s, "single");
    let regs = kubelet.registrations(2, Duration::from_secs(30)).await;
    let mut mem = client(&s.dp(), &regs["cuvisor.io/gpu-memory"].endpoint).await;
    let uuid = first_list(&mut mem).await[0]
        .id
        .rsplit_once("-mem-")
        .unwrap()
        .0
        .to_string();
    let a = ledger_dir_of(&allocate(&mut mem, &units(&uuid, 0..1)).await.unwrap());
    // Bytes: 64 MiB asked, the bound is 1 MiB.
    let mut f = std::fs::File::create(a.join("fill")).unwrap();
    let chunk = vec![7u8; 1 << 20];
    let mut written = 0u64;
    let err = loop {
        match f.write(&chunk) {
            Ok(n) => written += n as u64,
            Err(e) => break e,
        }
        assert!(written <= 64 << 20, "64 MiB written: no bound");
    };
    assert_eq!(err.raw_os_error(), Some(libc::ENOSPC), "{err}");
    assert!(written <= 1 << 20, "{written} bytes");
    drop(f);
    std::fs::remove_file(a.join("fill")).unwrap();
    // Inodes: a thousand files asked, the bound is 64.
    let made = (0..1000)
        .take_while(|i| std::fs::write(a.join(format!("f{i}")), b"").is_ok())
        .count();
    assert!(made < 64, "{made} files");
    // Another tenant's ledger is made whole, and Allocate goes on.
    let b = ledger_dir_of(&allocate(&mut mem, &units(&uuid, 1..2)).await.unwrap());
    let l = cuvisor_shm::ledger::Ledger::open_dir(&b).unwrap();
    let d = l.device_for([9; 16], GIB).unwrap();
    let p = l.claim_proc(std::process::id(), 1).unwrap();
    l.try_charge(d, p, GIB / 2).unwrap();
    assert!(allocate(&mut mem, &units(&uuid, 2..3)).await.is_ok());
    drop(kubelet);
}

/// The plugin without CAP_SYS_ADMIN (here: dropped with setpriv) cannot mount the ledger
/// directories' tmpfs. Falling back to a plain directory would quietly reopen the hole above;
/// the plugin stops at start-up with the reason and the way out instead.
#[test]
fn a_plugin_that_cannot_mount_ledger_dirs_stops_with_the_reason() {
    let s = Scratch::new("no-mount");
    let cfg = write_config(&s, 0, "");
    let mut cmd = Command::new("setpriv");
    cmd.args([
        "--inh-caps=-sys_admin",
        "--bounding-set=-sys_admin",
        "--",
        EXE,
    ]);
    let mut child = plugin_args(&mut cmd, &s, "single", &cfg)
        .stderr(Stdio::piped())
        .spawn()
        .expect("setpriv");
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("the plugin ran on without being able to mount");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut err = String::new();
    use std::io::Read;
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    if err.contains("setpriv:") {
        assert!(std::env::var_os("CI").is_none(), "{err}");
        eprintln!("SKIPPED a_plugin_that_cannot_mount_ledger_dirs_stops_with_the_reason: {err}");
        return;
    }
    assert_eq!(status.code(), Some(2), "{err}");
    let line = one_line_reason(&err, "[ledger_dir] mount = \"tmpfs\": ");
    assert!(
        line.contains("CAP_SYS_ADMIN") && line.contains("mount = \"none\""),
        "{line}"
    );
}

/// The binary with `[cdi] strategy = "cdi-cri"`, over kubelet's gRPC: Allocate for 2 units
/// answers NVIDIA's GPU and cuvisor's allocation as CDI devices and nothing in the plain fields;
/// cuvisor's spec is in `spec_dir`, of its kind, mounting the limits file whose quota is 2 GiB.
/// A whole GPU answers NVIDIA's name alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_cdi_cri_allocate_answers_cdi_devices_over_grpc_and_writes_the_spec() {
    let s = Scratch::new("cdi");
    let spec_dir = s.0.join("run-cdi");
    let mut kubelet = Kubelet::start(&s.dp());
    let _plugin = spawn_plugin_with(
        &s,
        "dgx1-v100",
        0,
        &format!("[cdi]\nstrategy = \"cdi-cri\"\nspec_dir = {spec_dir:?}\n"),
    );
    let regs = kubelet.registrations(2, Duration::from_secs(30)).await;
    let mut mems = client(&s.dp(), &regs["cuvisor.io/gpu-memory"].endpoint).await;
    let avail: Vec<String> = first_list(&mut mems)
        .await
        .into_iter()
        .map(|d| d.id)
        .collect();
    let pick = preferred(&mut mems, &avail, 2).await.unwrap();
    let r = allocate(&mut mems, &pick).await.unwrap();
    let uuid = pick[0].split("-mem-").next().unwrap();
    let id = &r.annotations["cuvisor.io/allocation"];
    let names: Vec<&str> = r.cdi_devices.iter().map(|d| d.name.as_str()).collect();
    assert_eq!(
        names,
        [
            format!("nvidia.com/gpu={uuid}"),
            format!("cuvisor.io/allocation={id}")
        ]
    );
    assert!(
        r.envs.is_empty() && r.mounts.is_empty() && r.devices.is_empty(),
        "{r:?}"
    );
    let file = spec_dir.join(format!("cuvisor.io-allocation_{id}.json"));
    let spec: serde_json::Value = serde_json::from_slice(&std::fs::read(&file).unwrap()).unwrap();
    assert_eq!(spec["kind"], "cuvisor.io/allocation");
    assert_eq!(spec["devices"][0]["name"], id.as_str());
    let mounts = spec["devices"][0]["containerEdits"]["mounts"]
        .as_array()
        .unwrap();
    let limits = mounts
        .iter()
        .find(|m| m["containerPath"] == cuvisor_shm::CONTAINER_LIMITS)
        .unwrap_or_else(|| panic!("no limits file in {spec}"));
    let text = std::fs::read_to_string(limits["hostPath"].as_str().unwrap()).unwrap();
    assert!(
        text.contains(&format!("memory.{uuid} = {}", 2 * GIB)),
        "{text}"
    );
    // A whole GPU (another one: this one has units in use).
    let mut gpus = client(&s.dp(), &regs["cuvisor.io/gpu"].endpoint).await;
    let other = first_list(&mut gpus)
        .await
        .into_iter()
        .map(|d| d.id)
        .find(|g| g != uuid)
        .unwrap();
    let w = allocate(&mut gpus, std::slice::from_ref(&other))
        .await
        .unwrap();
    let names: Vec<&str> = w.cdi_devices.iter().map(|d| d.name.as_str()).collect();
    assert_eq!(names, [format!("nvidia.com/gpu={other}")]);
    assert!(w.envs.is_empty() && w.devices.is_empty() && w.mounts.is_empty());
    kubelet.stop(&s.dp()).await;
}
