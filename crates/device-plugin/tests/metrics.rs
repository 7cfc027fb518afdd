//! The metrics endpoint end to end: real ledgers (as the library writes them) for two containers,
//! a fake kubelet PodResources server on a Unix socket naming their pods, and the text served
//! over HTTP checked for content and for the exposition format's rules.

mod support;

use cuvisor_device_plugin::health_channel;
use cuvisor_device_plugin::metrics::{self, Metrics};
use cuvisor_device_plugin::podresources::{v1, PodCache};
use cuvisor_device_plugin::registry::{Allocation, GpuShare, Kind, Registry};
use cuvisor_shm::ledger::Ledger;
use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tonic::{Request, Response, Status};

const GIB: u64 = 1 << 30;
const UUID_A: [u8; 16] = [0xaa; 16];
const UUID_B: [u8; 16] = [0xbb; 16];

fn tmp(tag: &str) -> PathBuf {
    let p = std::env::temp_dir().join(format!("cuvisor-metrics-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&p);
    std::fs::create_dir_all(&p).unwrap();
    p
}

struct FakeKubelet;

#[tonic::async_trait]
impl v1::pod_resources_lister_server::PodResourcesLister for FakeKubelet {
    async fn list(
        &self,
        _: Request<v1::ListPodResourcesRequest>,
    ) -> Result<Response<v1::ListPodResourcesResponse>, Status> {
        let dev = |r: &str, ids: &[&str]| v1::ContainerDevices {
            resource_name: r.into(),
            device_ids: ids.iter().map(|s| s.to_string()).collect(),
            topology: None,
        };
        let pod = |ns: &str, name: &str, c: &str, d: v1::ContainerDevices| v1::PodResources {
            name: name.into(),
            namespace: ns.into(),
            containers: vec![v1::ContainerResources {
                name: c.into(),
                devices: vec![d],
                ..Default::default()
            }],
        };
        Ok(Response::new(v1::ListPodResourcesResponse {
            pod_resources: vec![
                pod(
                    "ml",
                    "train-0",
                    "tf",
                    dev("cuvisor.io/gpu-memory", &["m-a-0", "m-a-1"]),
                ),
                // A pod name that needs escaping in a label value.
                pod(
                    "team \"x\"",
                    "odd\\pod",
                    "main",
                    dev("cuvisor.io/gpu-memory", &["m-b-0"]),
                ),
                pod("ml", "big", "w", dev("cuvisor.io/gpu", &["g0", "g1"])),
                pod("other", "p", "c", dev("nvidia.com/gpu", &["x"])),
            ],
        }))
    }

    async fn get_allocatable_resources(
        &self,
        _: Request<v1::AllocatableResourcesRequest>,
    ) -> Result<Response<v1::AllocatableResourcesResponse>, Status> {
        Ok(Response::new(Default::default()))
    }

    async fn get(
        &self,
        _: Request<v1::GetPodResourcesRequest>,
    ) -> Result<Response<v1::GetPodResourcesResponse>, Status> {
        Err(Status::unimplemented("not in this fake"))
    }
}

fn serve_fake_kubelet(sock: &Path) {
    let l = tokio::net::UnixListener::bind(sock).unwrap();
    tokio::spawn(async move {
        tonic::transport::Server::builder()
            .add_service(
                v1::pod_resources_lister_server::PodResourcesListerServer::new(FakeKubelet),
            )
            .serve_with_incoming(tokio_stream::wrappers::UnixListenerStream::new(l))
            .await
            .unwrap();
    });
}

/// A memory allocation with a ledger holding `used` of `limit` on `uuid`.
fn memory_alloc(
    root: &Path,
    id: &str,
    ids: &[&str],
    uuid: [u8; 16],
    limit: u64,
    used: u64,
) -> Allocation {
    let dir = root.join("allocations").join(id);
    let ledger_dir = dir.join("state");
    let l = Ledger::open_dir(&ledger_dir).unwrap();
    let d = l.device_for(uuid, limit).unwrap();
    let p = l.claim_proc(std::process::id(), 1).unwrap();
    l.try_charge(d, p, used).unwrap();
    assert!(l.try_charge(d, p, limit).is_err());
    l.note_denied(d);
    let e = l.device(d);
    e.gpu_ns
        .store(2_500_000_000, std::sync::atomic::Ordering::Release);
    e.throttled_ns
        .store(500_000_000, std::sync::atomic::Ordering::Release);
    e.launches.store(42, std::sync::atomic::Ordering::Release);
    // The charge stays: this process is alive.
    Allocation {
        id: id.into(),
        kind: Kind::Memory,
        resource: "cuvisor.io/gpu-memory".into(),
        device_ids: ids.iter().map(|s| s.to_string()).collect(),
        gpus: vec![GpuShare {
            uuid: metrics::uuid_string(uuid),
            units: ids.len() as u32,
            quota: Some(limit),
            coord_slot: None,
        }],
        dir,
        ledger_dir: Some(ledger_dir),
        created_unix: 0,
    }
}

async fn http_get(port: u16, path: &str) -> String {
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    out
}

/// The exposition format's rules this endpoint must keep: every sample's family has HELP and
/// TYPE lines before it, once; names and label names are valid; values parse.
fn check_format(text: &str) {
    let mut typed: HashSet<String> = HashSet::new();
    let mut helped: HashSet<String> = HashSet::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let name = rest.split(' ').next().unwrap();
            assert!(helped.insert(name.to_string()), "HELP twice: {name}");
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut it = rest.split(' ');
            let name = it.next().unwrap();
            let kind = it.next().unwrap();
            assert!(["counter", "gauge", "histogram"].contains(&kind), "{line}");
            assert!(helped.contains(name), "TYPE before HELP: {line}");
            assert!(typed.insert(name.to_string()), "TYPE twice: {name}");
            if kind == "counter" {
                assert!(name.ends_with("_total"), "counter without _total: {name}");
            }
            continue;
        }
        assert!(!line.starts_with('#'), "{line}");
        let name_end = line.find(['{', ' ']).unwrap();
        let name = &line[..name_end];
        assert!(
            name.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':'),
            "bad name {name}"
        );
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| name.strip_suffix(s).filter(|f| typed.contains(*f)))
            .unwrap_or(name);
        assert!(typed.contains(family), "sample before its TYPE: {line}");
        let value = line.rsplit(' ').next().unwrap();
        assert!(value.parse::<f64>().is_ok(), "bad value: {line}");
        if line.as_bytes()[name_end] == b'{' {
            // Label values: every quote inside is escaped.
            let labels = &line[name_end + 1..line.rfind('}').unwrap()];
            let mut chars = labels.chars();
            let mut in_value = false;
            while let Some(c) = chars.next() {
                match (in_value, c) {
                    (true, '\\') => {
                        let n = chars.next().unwrap();
                        assert!(['\\', '"', 'n'].contains(&n), "bad escape in {line}");
                    }
                    (true, '"') => in_value = false,
                    (false, '"') => in_value = true,
                    (true, '\n') => panic!("raw newline in {line}"),
                    _ => {}
                }
            }
            assert!(!in_value, "unterminated label value: {line}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_name_containers_from_pod_resources_and_read_their_ledgers() {
    let root = tmp("root");
    let reg = Registry::open(&root).unwrap();
    let a = memory_alloc(&root, "a1", &["m-a-0", "m-a-1"], UUID_A, 6 * GIB, 2 * GIB);
    let b = memory_alloc(&root, "b1", &["m-b-0"], UUID_B, GIB, 512 << 20);
    for al in [a, b] {
        reg.insert(al).unwrap();
    }
    let whole_dir = root.join("allocations").join("w1");
    std::fs::create_dir_all(&whole_dir).unwrap();
    reg.insert(Allocation {
        id: "w1".into(),
        kind: Kind::Gpu,
        resource: "cuvisor.io/gpu".into(),
        device_ids: vec!["g0".into(), "g1".into()],
        gpus: vec![
            GpuShare {
                uuid: "GPU-0".into(),
                units: 0,
                quota: None,
                coord_slot: None,
            },
            GpuShare {
                uuid: "GPU-1".into(),
                units: 0,
                quota: None,
                coord_slot: None,
            },
        ],
        dir: whole_dir,
        ledger_dir: None,
        created_unix: 0,
    })
    .unwrap();

    let sock = root.join("kubelet.sock");
    serve_fake_kubelet(&sock);
    let pods = PodCache::new();
    tokio::spawn(
        pods.clone()
            .refresh(sock.clone(), Duration::from_millis(50)),
    );
    for _ in 0..100 {
        if pods.get().is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let owners = pods.get().expect("the fake kubelet answered");
    assert_eq!(owners.len(), 6);

    let (htx, hrx) = health_channel();
    htx.send_replace([("GPU-1".to_string(), false)].into_iter().collect());
    let m = Metrics::new(reg.view(), pods.clone())
        .with_health(hrx)
        .with_scorer(Box::new(|set: &[String]| (set.len() == 2).then_some(0.75)));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(metrics::serve(listener, Arc::new(m)));

    let resp = http_get(port, "/metrics").await;
    let (head, text) = resp.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(head.contains("text/plain; version=0.0.4"), "{head}");
    check_format(text);

    let ua = metrics::uuid_string(UUID_A);
    let la = format!(
        "{{namespace=\"ml\",pod=\"train-0\",container=\"tf\",gpu_uuid=\"{ua}\",allocation=\"a1\"}}"
    );
    for (name, v) in [
        ("cuvisor_container_memory_used_bytes", (2 * GIB).to_string()),
        (
            "cuvisor_container_memory_limit_bytes",
            (6 * GIB).to_string(),
        ),
        ("cuvisor_container_memory_peak_bytes", (2 * GIB).to_string()),
        ("cuvisor_container_memory_denied_total", "1".into()),
        ("cuvisor_container_gpu_seconds_total", "2.5".into()),
        ("cuvisor_container_throttled_seconds_total", "0.5".into()),
        ("cuvisor_container_launches_total", "42".into()),
    ] {
        let line = format!("{name}{la} {v}\n");
        assert!(text.contains(&line), "missing {line}in\n{text}");
    }
    let ub = metrics::uuid_string(UUID_B);
    let lb = format!(
        "{{namespace=\"team \\\"x\\\"\",pod=\"odd\\\\pod\",container=\"main\",gpu_uuid=\"{ub}\",allocation=\"b1\"}}"
    );
    assert!(
        text.contains(&format!(
            "cuvisor_container_memory_used_bytes{lb} 536870912\n"
        )),
        "{text}"
    );
    for line in [
        format!(
            "cuvisor_gpu_memory_used_bytes{{gpu_uuid=\"{ua}\"}} {}\n",
            2 * GIB
        ),
        format!(
            "cuvisor_gpu_memory_quota_bytes{{gpu_uuid=\"{ua}\"}} {}\n",
            6 * GIB
        ),
        format!("cuvisor_gpu_allocations{{gpu_uuid=\"{ua}\"}} 1\n"),
        "cuvisor_gpu_healthy{gpu_uuid=\"GPU-1\"} 0\n".to_string(),
        "cuvisor_gpu_healthy{gpu_uuid=\"GPU-0\"} 1\n".to_string(),
        "cuvisor_allocations{resource=\"cuvisor.io/gpu-memory\"} 2\n".to_string(),
        "cuvisor_allocation_topology_score_bucket{le=\"0.8\"} 1\n".to_string(),
        "cuvisor_allocation_topology_score_bucket{le=\"0.7\"} 0\n".to_string(),
        "cuvisor_allocation_topology_score_count 1\n".to_string(),
    ] {
        assert!(text.contains(&line), "missing {line}in\n{text}");
    }
    // Scored once per allocation, not once per scrape.
    let again = http_get(port, "/metrics").await;
    assert!(again.contains("cuvisor_allocation_topology_score_count 1\n"));
    assert!(http_get(port, "/nope").await.starts_with("HTTP/1.1 404"));

    // Liveness for the sweeper: the memory allocations' containers exist.
    use cuvisor_device_plugin::cleanup::Liveness;
    for al in reg.view().list() {
        assert_eq!(pods.in_use(&al), Some(true), "{}", al.id);
    }
    let _ = std::fs::remove_dir_all(&root);
}

/// The attack: idle connections and clients that trickle their request a byte at a time. Each
/// held a descriptor and a task for as long as it liked (a 5 s wait per read, up to 16 KiB).
/// Now: at most `MAX_CONNECTIONS` stay open, the rest are closed at once; a trickler is cut off
/// at `REQUEST_DEADLINE`; and a probe still gets in while every slot is held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_and_trickling_metrics_clients_are_crowded_out_and_cut_off() {
    let root = tmp("slow");
    let reg = Registry::open(&root).unwrap();
    let m = Metrics::new(reg.view(), PodCache::new());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(metrics::serve(listener, Arc::new(m)));

    // Whether the server closed `c` within `within` (EOF or reset), sending nothing.
    async fn closed(c: &mut tokio::net::TcpStream, within: Duration) -> bool {
        let mut b = [0u8; 64];
        match tokio::time::timeout(within, c.read(&mut b)).await {
            Ok(Ok(0)) | Ok(Err(_)) => true,
            Ok(Ok(n)) => panic!("the server answered {:?}", &b[..n]),
            Err(_) => false,
        }
    }

    let n = 100;
    let mut idle = Vec::new();
    for _ in 0..n {
        idle.push(
            tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .unwrap(),
        );
    }
    let t0 = std::time::Instant::now();
    let mut cut = 0;
    for c in &mut idle {
        if closed(c, Duration::from_millis(20)).await {
            cut += 1;
        }
    }
    assert!(
        cut >= n - metrics::MAX_CONNECTIONS,
        "{cut} of {n} idle connections closed within {:?}; at most {} may stay",
        t0.elapsed(),
        32
    );

    // Every slot is held by an idle client: a probe still gets in and is answered.
    let resp = tokio::time::timeout(Duration::from_secs(1), http_get(port, "/healthz"))
        .await
        .expect("/healthz answered while the slots are held");
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");

    // A client that sends its request a byte every 200 ms is cut off at the deadline.
    let mut slow = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    let started = std::time::Instant::now();
    // A request head that never ends.
    let head = b"GET /metrics HTTP/1.1\r\nX-Slow: "
        .iter()
        .chain([b'a'; 200].iter());
    let mut cut_at = None;
    for b in head {
        if slow.write_all(&[*b]).await.is_err()
            || closed(&mut slow, Duration::from_millis(200)).await
        {
            cut_at = Some(started.elapsed());
            break;
        }
    }
    let cut_at = cut_at.expect("a trickling client was never cut off");
    assert!(
        cut_at >= Duration::from_secs(3) - Duration::from_millis(300)
            && cut_at <= Duration::from_secs(3) + Duration::from_secs(1),
        "cut off after {cut_at:?}, the deadline is {:?}",
        Duration::from_secs(3)
    );
    drop(idle);
    let _ = std::fs::remove_dir_all(&root);
}

/// A ledger a container planted: its one GPU listed in all 16 entries, each claiming
/// u64::MAX refusals and GPU time. The node's totals neither wrap nor panic (a debug build's
/// overflow check once made every scrape an empty answer), and the GPU has one series.
#[test]
fn a_planted_ledger_cannot_wrap_or_panic_the_gpu_totals() {
    use std::sync::atomic::Ordering::Release;
    let root = tmp("planted");
    let reg = Registry::open(&root).unwrap();
    let a = memory_alloc(&root, "p1", &["m-p-0"], UUID_A, GIB, 512);
    let l = Ledger::open_dir(a.ledger_dir.as_ref().unwrap()).unwrap();
    let (hi, lo) = UUID_A.split_at(8);
    for i in 0..cuvisor_shm::ledger::MAX_DEVICES {
        let e = l.device(i);
        e.uuid_words[0].store(u64::from_be_bytes(hi.try_into().unwrap()), Release);
        e.uuid_words[1].store(u64::from_be_bytes(lo.try_into().unwrap()), Release);
        e.denied.store(u64::MAX, Release);
        e.gpu_ns.store(u64::MAX, Release);
        e.throttled_ns.store(u64::MAX, Release);
        e.state.store(cuvisor_shm::ledger::DEV_READY, Release);
    }
    reg.insert(a).unwrap();
    let (_, health) = health_channel();
    let text = Metrics::new(reg.view(), PodCache::new())
        .with_health(health)
        .render();
    let uuid = metrics::uuid_string(UUID_A);
    let series: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("cuvisor_container_memory_used_bytes{") && l.contains(&uuid))
        .collect();
    assert_eq!(series.len(), 1, "{text}");
    let denied = text
        .lines()
        .find(|l| l.starts_with("cuvisor_gpu_") && l.contains("denied") && l.contains(&uuid))
        .unwrap_or_else(|| panic!("no per-GPU refusals series\n{text}"));
    assert!(
        denied.ends_with(&format!(" {}", u64::MAX as f64)),
        "{denied}"
    );
}

/// The attack: a container rewrites the `limit` of its ledger to 1 TiB. The metrics showed that
/// as the container's quota (`cuvisor_container_memory_limit_bytes` was read from the ledger);
/// now the quota shown is the one Allocate granted, from the plugin's registry, and the
/// ledger's figure is shown apart, under a name and HELP line that call it a claim.
#[test]
fn a_ledger_claiming_a_1_tib_limit_does_not_change_the_granted_quota_in_metrics() {
    use std::sync::atomic::Ordering::Release;
    const TIB: u64 = 1 << 40;
    let root = tmp("claimed-limit");
    let reg = Registry::open(&root).unwrap();
    let a = memory_alloc(&root, "c1", &["m-c-0"], UUID_A, GIB, 512 << 20);
    let l = Ledger::open_dir(a.ledger_dir.as_ref().unwrap()).unwrap();
    for i in 0..cuvisor_shm::ledger::MAX_DEVICES {
        l.device(i).limit.store(TIB, Release);
    }
    reg.insert(a).unwrap();
    let text = Metrics::new(reg.view(), PodCache::new()).render();
    check_format(&text);
    let uuid = metrics::uuid_string(UUID_A);
    let labels =
        format!("{{namespace=\"\",pod=\"\",container=\"\",gpu_uuid=\"{uuid}\",allocation=\"c1\"}}");
    for line in [
        format!("cuvisor_container_memory_limit_bytes{labels} {GIB}\n"),
        format!("cuvisor_container_memory_claimed_limit_bytes{labels} {TIB}\n"),
        format!("cuvisor_gpu_memory_quota_bytes{{gpu_uuid=\"{uuid}\"}} {GIB}\n"),
    ] {
        assert!(text.contains(&line), "missing {line}in\n{text}");
    }
    assert_eq!(
        text.matches("cuvisor_container_memory_limit_bytes{")
            .count(),
        1,
        "one granted limit per container and GPU\n{text}"
    );
    // Every figure read from the ledger says it is a claim.
    for name in [
        "cuvisor_container_memory_claimed_limit_bytes",
        "cuvisor_container_memory_used_bytes",
        "cuvisor_container_memory_peak_bytes",
        "cuvisor_container_memory_denied_total",
        "cuvisor_container_gpu_seconds_total",
        "cuvisor_container_throttled_seconds_total",
        "cuvisor_container_launches_total",
        "cuvisor_gpu_memory_used_bytes",
    ] {
        let help = text
            .lines()
            .find(|l| l.starts_with(&format!("# HELP {name} ")))
            .unwrap_or_else(|| panic!("no HELP for {name}\n{text}"));
        assert!(help.contains("not verified"), "{help}");
    }
    let _ = std::fs::remove_dir_all(&root);
}

/// /healthz answers what `probe` answers from the plugin's status file (it said "ok" whatever
/// the plugin's state): 200 for a fresh status of this running process, 503 naming the reason
/// for a status left by a process that is gone, and for no status at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthz_is_the_plugins_status_not_always_ok() {
    use cuvisor_device_plugin::status::{self, Phase};
    let root = tmp("healthz");
    let reg = Registry::open(&root).unwrap();
    let file = root.join("plugin.status");
    let m = Metrics::new(reg.view(), PodCache::new()).with_status(file.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(metrics::serve(listener, Arc::new(m)));

    let resp = http_get(port, "/healthz").await;
    assert!(resp.starts_with("HTTP/1.1 503"), "no status yet: {resp}");
    status::write(&file, &status::now(Phase::Ready, String::new())).unwrap();
    let resp = http_get(port, "/healthz").await;
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
    assert!(resp.contains("alive"), "{resp}");
    // The same status, as a process that has exited left it.
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let gone = child.id();
    child.wait().unwrap();
    let mut s = status::now(Phase::Ready, String::new());
    s.pid = gone;
    status::write(&file, &s).unwrap();
    let resp = http_get(port, "/healthz").await;
    assert!(resp.starts_with("HTTP/1.1 503"), "{resp}");
    assert!(resp.contains("previous instance"), "{resp}");
    let _ = std::fs::remove_dir_all(root);
}

/// One sample of the exposition text: family name, labels, value.
type Sample = (String, BTreeMap<String, String>, f64);

/// The samples of an exposition text, label values unescaped (`check_format` checks the rest).
fn parse_samples(text: &str) -> Vec<Sample> {
    let mut out = Vec::new();
    for line in text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
    {
        let name_end = line.find(['{', ' ']).unwrap();
        let name = line[..name_end].to_string();
        let mut labels = BTreeMap::new();
        let mut rest = &line[name_end..];
        if let Some(body) = rest.strip_prefix('{') {
            let mut chars = body.char_indices();
            let (mut key, mut value, mut in_value) = (String::new(), String::new(), false);
            let end = loop {
                let (i, c) = chars.next().expect("unterminated label set");
                match (in_value, c) {
                    (false, '}') => break i,
                    (false, '=' | ',') => {}
                    (false, '"') => in_value = true,
                    (false, c) => key.push(c),
                    (true, '\\') => match chars.next().unwrap().1 {
                        'n' => value.push('\n'),
                        c => value.push(c),
                    },
                    (true, '"') => {
                        in_value = false;
                        labels.insert(std::mem::take(&mut key), std::mem::take(&mut value));
                    }
                    (true, c) => value.push(c),
                }
            };
            rest = &body[end + 1..];
        }
        let value: f64 = rest
            .trim()
            .parse()
            .unwrap_or_else(|e| panic!("{line}: {e}"));
        out.push((name, labels, value));
    }
    out
}

/// The value of `name`'s one sample whose label `key` is `value`; None without one (and a panic
/// for more than one).
fn sample_where(samples: &[Sample], name: &str, key: &str, value: &str) -> Option<f64> {
    let found: Vec<&Sample> = samples
        .iter()
        .filter(|(n, l, _)| n == name && l.get(key).map(String::as_str) == Some(value))
        .collect();
    assert!(
        found.len() <= 1,
        "{name}{{{key}={value:?}}} twice: {found:?}"
    );
    found.first().map(|s| s.2)
}

/// A histogram's cumulative count in bucket `le`.
fn bucket(samples: &[Sample], name: &str, le: &str) -> f64 {
    sample_where(samples, &format!("{name}_bucket"), "le", le)
        .unwrap_or_else(|| panic!("no {name}_bucket{{le={le:?}}}"))
}

/// A whole-GPU allocation of these GPUs of the model.
fn gpu_alloc(root: &Path, id: &str, m: &cuvisor_sim::model::Model, gpus: &[usize]) -> Allocation {
    let dir = root.join("allocations").join(id);
    std::fs::create_dir_all(&dir).unwrap();
    let uuids: Vec<String> = gpus.iter().map(|&g| m.devices[g].uuid.clone()).collect();
    Allocation {
        id: id.into(),
        kind: Kind::Gpu,
        resource: "cuvisor.io/gpu".into(),
        device_ids: uuids.clone(),
        gpus: uuids
            .into_iter()
            .map(|uuid| GpuShare {
                uuid,
                units: 0,
                quota: None,
                coord_slot: None,
            })
            .collect(),
        dir,
        ledger_dir: None,
        created_unix: 0,
    }
}

/// The seeds' two formulas as metrics, on a DGX-1 V100 (hybrid cube mesh: GPUs 0 and 3 share
/// two NVLinks, 2 x 25 GB/s per direction, Volta whitepaper; 0 and 5 none, and sit on different
/// sockets, so their copies go through host memory at PCIe Gen3 x16, 15.75 GB/s). {0, 3} is as
/// good as a pair gets there: efficiency 50 GB/s, loss 0; {0, 5}: 15.75 GB/s, loss
/// 1 - 15.75/50 = 0.685; memory units spanning GPUs 4 and 5 (one link): 25 GB/s, loss 0.5.
/// Each allocation's gauges are there while it lives and go with it; the histogram counts
/// each allocation once; a single-GPU allocation has no series.
#[test]
fn multi_gpu_allocations_show_their_comm_efficiency_and_topology_loss_until_they_go() {
    use cuvisor_device_plugin::metrics::comm::CommModel;
    use cuvisor_device_plugin::topology::Allocator;
    const EFF: &str = "cuvisor_allocation_comm_efficiency_bytes_per_second";
    const PEAK: &str = "cuvisor_allocation_comm_peak_bytes_per_second";
    const LOSS: &str = "cuvisor_allocation_topology_loss_ratio";
    const HIST: &str = "cuvisor_allocation_topology_loss";
    // PCIe Gen3 x16: 16 lanes x 8 GT/s x 128/130 / 8 bits, bytes/s (the model rounds a lane to
    // 0.9846 GB/s: within 1e-4 of it).
    let gen3 = 16.0 * 8e9 * 128.0 / 130.0 / 8.0;
    let nvlink2 = 2.0 * 25e9;

    let root = tmp("comm");
    let m = cuvisor_sim::model::preset("dgx1-v100").unwrap();
    let reg = Registry::open(&root).unwrap();
    let model = CommModel::new(Allocator::new(support::from_model(&m)).unwrap());
    let metrics = Metrics::new(reg.view(), PodCache::new()).with_comm_model(model);
    let scrape = || {
        let text = metrics.render();
        check_format(&text);
        parse_samples(&text)
    };

    reg.insert(gpu_alloc(&root, "near", &m, &[0, 3])).unwrap();
    reg.insert(gpu_alloc(&root, "single", &m, &[2])).unwrap();
    let s = scrape();
    let eff = sample_where(&s, EFF, "allocation", "near").expect("near's efficiency");
    assert!((eff - nvlink2).abs() < 1e3, "{eff}");
    assert_eq!(sample_where(&s, PEAK, "allocation", "near"), Some(eff));
    assert_eq!(sample_where(&s, LOSS, "allocation", "near"), Some(0.0));
    // Labelled as the per-container series are, less the GPU: the allocation is one series.
    let (_, labels, _) = s
        .iter()
        .find(|(n, l, _)| n == LOSS && l["allocation"] == "near")
        .unwrap();
    assert_eq!(
        labels.keys().collect::<Vec<_>>(),
        ["allocation", "container", "namespace", "pod"]
    );
    for name in [EFF, PEAK, LOSS] {
        assert_eq!(sample_where(&s, name, "allocation", "single"), None);
        assert_eq!(s.iter().filter(|(n, ..)| n == name).count(), 1, "{name}");
    }
    assert_eq!(bucket(&s, HIST, "0.0"), 1.0);

    // Kubelet gives GPU 0 to a new allocation across the sockets: "near" is over.
    reg.insert(gpu_alloc(&root, "far", &m, &[0, 5])).unwrap();
    let s = scrape();
    for name in [EFF, PEAK, LOSS] {
        assert_eq!(sample_where(&s, name, "allocation", "near"), None, "{name}");
    }
    let eff = sample_where(&s, EFF, "allocation", "far").expect("far's efficiency");
    assert!((eff / gen3 - 1.0).abs() < 1e-4, "{eff} vs {gen3}");
    let peak = sample_where(&s, PEAK, "allocation", "far").unwrap();
    assert!((peak - nvlink2).abs() < 1e3, "{peak}");
    let loss = sample_where(&s, LOSS, "allocation", "far").unwrap();
    assert!((loss - (1.0 - eff / peak)).abs() < 1e-9, "{loss}");
    assert!((loss - (1.0 - gen3 / nvlink2)).abs() < 1e-4, "{loss}");
    assert!((loss - 0.685).abs() < 0.001, "{loss}");

    // Scraped again: the same figures, nothing observed twice.
    let again = scrape();
    assert_eq!(sample_where(&again, LOSS, "allocation", "far"), Some(loss));
    let count = |s: &[Sample]| {
        s.iter()
            .find(|(n, ..)| *n == format!("{HIST}_count"))
            .map(|x| x.2)
            .unwrap()
    };
    assert_eq!(count(&again), 2.0);
    assert_eq!(bucket(&again, HIST, "0.0"), 1.0);
    assert_eq!(bucket(&again, HIST, "0.6"), 1.0);
    assert_eq!(bucket(&again, HIST, "0.7"), 2.0);
    assert_eq!(bucket(&again, HIST, "+Inf"), 2.0);
    let sum = again
        .iter()
        .find(|(n, ..)| *n == format!("{HIST}_sum"))
        .unwrap()
        .2;
    assert!((sum - loss).abs() < 1e-9, "{sum}");

    // Memory units that had to span GPUs 4 and 5 (one NVLink 2 link between them: 25 GB/s per
    // direction) are a multi-GPU allocation too: loss 1 - 25/50.
    let mut span = gpu_alloc(&root, "span", &m, &[4, 5]);
    span.kind = Kind::Memory;
    span.resource = "cuvisor.io/gpu-memory".into();
    span.device_ids = vec!["m-4-0".into(), "m-5-0".into()];
    for g in &mut span.gpus {
        g.units = 1;
        g.quota = Some(GIB);
    }
    reg.insert(span).unwrap();
    let s = scrape();
    let eff = sample_where(&s, EFF, "allocation", "span").expect("span's efficiency");
    assert!((eff - 25e9).abs() < 1e3, "{eff}");
    assert_eq!(sample_where(&s, LOSS, "allocation", "span"), Some(0.5));
    assert_eq!(count(&s), 3.0);

    // The allocations go (the sweeper found their containers gone): so do their series; the
    // histogram keeps what it counted.
    reg.remove("far").unwrap();
    reg.remove("span").unwrap();
    let s = scrape();
    for name in [EFF, PEAK, LOSS] {
        assert_eq!(s.iter().filter(|(n, ..)| n == name).count(), 0, "{name}");
    }
    assert_eq!(count(&s), 3.0);
    let _ = std::fs::remove_dir_all(&root);
}
