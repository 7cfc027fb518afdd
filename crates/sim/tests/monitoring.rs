//! The monitoring tools people run, unmodified, on the simulated NVML: `gpustat --json`,
//! nvitop's Python API and `nvitop --once`, and nvidia-ml-py's own `example.py`, pinned from
//! PyPI (`monitoring/probe.py` runs them while it holds memory and runs a kernel, with every NVML
//! call they make traced by `monitoring/trace/sitecustomize.py`); plain on the 8-GPU `dgx-a100`
//! and under `cuvisor run --memory 4Gi`, where the GPU's memory is the quota. And the queries
//! NVIDIA's k8s device plugin makes through go-nvml/go-nvlib, with the error paths of what
//! `crates/sim/nvml/src/board.rs` and `fields.rs` model, in C (`c/nvml_monitoring.c`, built
//! against nvml.h from `nvidia-nvml-dev`).
//!
//! The wheels (about 40 MB with pip) are installed once into `target/ci-tools/`; where they
//! cannot be had a test prints a loud SKIPPED line, or fails when `CI` is set.
mod common;
#[path = "common/python.rs"]
mod python;

use cuvisor_sim::model::{Model, MIB};
use python::u;
use serde_json::Value;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The newest releases on PyPI when this was written, and every dependency they pull on Linux,
/// pinned (installed with `--no-deps`): gpustat needs nvidia-ml-py, psutil and blessed; nvitop
/// nvidia-ml-py (< 13.616) and psutil; blessed wcwidth and jinxed.
const TOOLS: &[(&str, &str)] = &[
    ("gpustat", "1.1.1"),
    ("nvitop", "1.7.2"),
    ("nvidia-ml-py", "13.615.71"),
    ("psutil", "7.2.2"),
    ("blessed", "1.52.0"),
    ("wcwidth", "0.9.4"),
    ("jinxed", "2.1.0"),
];
/// nvml.h, as tests/surface.rs installs it (the same venv).
const NVML_DEV: &[(&str, &str)] = &[("nvidia-nvml-dev", "13.4.92")];

/// What probe.py holds, and how long its kernel runs while the tools look.
const HELD: u64 = 256 * MIB;
const KERNEL_NS: u64 = 5_000_000_000;

/// NVML calls the tools make that a real datacenter board also refuses, or that answer a
/// protocol code: (function, code).
const EXPECTED_REFUSALS: &[(&str, &str, &str)] = &[
    (
        "nvmlDeviceGetFanSpeed",
        "3",
        "passively cooled boards: nvidia-smi's Fan N/A",
    ),
    (
        "nvmlDeviceGetClockInfo",
        "3",
        "the video clock is not modelled",
    ),
    (
        "nvmlDeviceGetMaxClockInfo",
        "3",
        "the video clock is not modelled",
    ),
    (
        "nvmlDeviceGetDriverModel_v2",
        "3",
        "driver models are Windows-only",
    ),
    (
        "nvmlDeviceGetComputeRunningProcesses_v3",
        "7",
        "INSUFFICIENT_SIZE: pynvml asks for the count first",
    ),
    (
        "nvmlDeviceGetProcessUtilization",
        "7",
        "INSUFFICIENT_SIZE: pynvml asks for the count first",
    ),
    (
        "nvmlDeviceGetProcessUtilization",
        "6",
        "NOT_FOUND: a device no process ran on has no samples",
    ),
];

fn venv(test: &str) -> Option<PathBuf> {
    use cuvisor_testkit::wheels::{venv, Deps};
    venv(test, "gpustat-1.1.1+nvitop-1.7.2", TOOLS, Deps::None)
}

/// probe.py on `model`, under `cuvisor run RUN` unless `run` is empty.
fn probe(venv: &Path, model: &str, tag: &str, run: &[&str]) -> Value {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/monitoring/probe.py");
    let (held, kernel) = (HELD.to_string(), KERNEL_NS.to_string());
    python::python_probe(
        venv,
        &[script.as_os_str(), held.as_ref(), kernel.as_ref()],
        model,
        tag,
        &["PYTHONPATH", "NVML_TRACE"],
        &[],
        run,
    )
}

/// Whether the tool `key` finished while the kernel still ran (then NVML's last second was all
/// busy); on a machine too loaded for that, the utilization checks are left out and say so.
fn while_busy(v: &Value, key: &str) -> bool {
    let done = v[format!("{key}_done_s")].as_f64().unwrap();
    let busy = done < KERNEL_NS as f64 / 1e9 - 0.25;
    if !busy {
        eprintln!(
            "{key} finished {done:.1} s after the launch, past the kernel: utilization not checked"
        );
    }
    busy
}

/// What the tools showed of `model`: GPU 0's memory `total` and `used` (the GPU's, or under
/// `cuvisor run` the quota and the ledger's count) and the probe's own `proc_used`.
fn tools_saw(v: &Value, model: &Model, total: u64, used: u64, proc_used: u64) {
    let pid = u(&v["pid"]);
    let dev0 = &model.devices[0];

    // gpustat --json.
    let gpus = v["gpustat"]["gpus"].as_array().unwrap();
    assert_eq!(gpus.len(), model.devices.len());
    assert_eq!(
        v["gpustat"]["driver_version"],
        model.driver_release.as_str()
    );
    for (i, (g, d)) in gpus.iter().zip(&model.devices).enumerate() {
        assert_eq!(g["name"], d.name.as_str(), "gpustat GPU {i}");
        assert_eq!(g["uuid"], d.uuid.as_str(), "gpustat GPU {i}");
        assert_eq!(g["utilization.enc"], 0, "gpustat GPU {i}: {g}");
        assert_eq!(g["utilization.dec"], 0, "gpustat GPU {i}: {g}");
        assert!(g["fan.speed"].is_null(), "no fan on a passive board: {g}");
        if i > 0 {
            assert_eq!(u(&g["memory.used"]), 0, "gpustat GPU {i}");
            assert_eq!(g["processes"], serde_json::json!([]), "gpustat GPU {i}");
        }
    }
    let g = &gpus[0];
    assert_eq!(u(&g["memory.total"]), total / MIB, "{g}");
    assert_eq!(u(&g["memory.used"]), used / MIB, "{g}");
    let procs = g["processes"].as_array().unwrap();
    assert_eq!(procs.len(), 1, "{g}");
    assert_eq!(u(&procs[0]["pid"]), pid);
    assert_eq!(u(&procs[0]["gpu_memory_usage"]), proc_used / MIB);
    if while_busy(v, "gpustat") {
        assert!(u(&g["utilization.gpu"]) >= 90, "{g}");
        assert!(u(&g["temperature.gpu"]) > 33, "warmer than idle: {g}");
    }

    // nvitop's API.
    let snaps = v["nvitop"].as_array().unwrap();
    assert_eq!(snaps.len(), model.devices.len());
    for (i, (s, d)) in snaps.iter().zip(&model.devices).enumerate() {
        assert_eq!(s["name"], d.name.as_str(), "nvitop GPU {i}");
        assert_eq!(s["bus_id"], nvml_bus_id(d).as_str(), "nvitop GPU {i}");
        assert_eq!(u(&s["sm_clock"]), (d.specs.clock_khz / 1000) as u64, "{s}");
        assert_eq!(
            u(&s["memory_clock"]),
            (d.specs.memory_clock_khz / 1000) as u64,
            "{s}"
        );
        for (key, want) in [
            ("persistence_mode", "Enabled"),
            ("performance_state", "P0"),
            ("display_active", "Disabled"),
            ("display_mode", "Enabled"),
            ("compute_mode", "Default"),
            ("mig_mode", "Disabled"),
            ("fan_speed", "N/A"),
        ] {
            assert_eq!(s[key], want, "nvitop GPU {i} {key}: {s}");
        }
        assert_eq!(s["total_volatile_uncorrected_ecc_errors"], 0, "{s}");
        assert_eq!(s["encoder_utilization"], 0, "{s}");
        assert_eq!(u(&s["nvlink_link_count"]), d.links.len() as u64, "{s}");
    }
    let s = &snaps[0];
    assert_eq!(u(&s["memory_total"]), total, "{s}");
    assert_eq!(u(&s["memory_used"]), used, "{s}");
    assert_eq!(s["processes"], serde_json::json!([[pid, proc_used]]), "{s}");
    if while_busy(v, "nvitop") {
        assert!(u(&s["gpu_utilization"]) >= 90, "{s}");
    }

    // nvitop --once: the same, as text.
    let text = v["nvitop_once"].as_str().unwrap();
    assert!(
        text.contains(&format!("Driver Version: {}", model.driver_release)),
        "{text}"
    );
    let usage = format!("{:.1}MiB / {}", used as f64 / MIB as f64, human(total));
    assert!(text.contains(&usage), "{usage} in\n{text}");
    assert!(text.contains(&format!(" {pid} ")), "pid {pid} in\n{text}");
    assert!(
        text.contains(" P0 ") && !text.contains("N/A   N/A"),
        "{text}"
    );

    // nvidia-ml-py's example.py.
    let text = v["example"].as_str().unwrap();
    for want in [
        format!("<product_name>{}</product_name>", dev0.name),
        "<product_brand>NVIDIA</product_brand>".to_string(),
        format!("<uuid>{}</uuid>", dev0.uuid),
        "<virtualization_mode>None</virtualization_mode>".to_string(),
        format!("<gpu id=\"{}\">", nvml_bus_id(dev0)),
    ] {
        assert!(text.contains(&want), "{want} in\n{text}");
    }
    assert!(!text.contains("Error"), "{text}");

    // Every NVML call the tools made answered success, or what a real board answers too.
    let calls = v["calls"].as_object().unwrap();
    let mut unexpected = Vec::new();
    for (name, codes) in calls {
        for code in codes.as_object().unwrap().keys() {
            let known = EXPECTED_REFUSALS
                .iter()
                .any(|(n, c, _)| n == name && c == code);
            if code != "0" && !known {
                unexpected.push(format!("{name} answered {code}"));
            }
        }
    }
    assert!(
        unexpected.is_empty(),
        "unexpected NVML answers: {unexpected:?}"
    );
    for name in [
        "nvmlDeviceGetBrand",
        "nvmlDeviceGetVirtualizationMode",
        "nvmlDeviceGetPersistenceMode",
        "nvmlDeviceGetPerformanceState",
        "nvmlDeviceGetTotalEccErrors",
        "nvmlDeviceGetEncoderUtilization",
        "nvmlDeviceGetFieldValues",
        "nvmlDeviceGetGridLicensableFeatures_v4",
    ] {
        assert!(
            calls.contains_key(name),
            "the tools called {name}: {calls:?}"
        );
    }
}

/// NVML's `busId`: upper-case hex, as nvidia-smi prints it (`00000000:DB:00.0`).
fn nvml_bus_id(d: &cuvisor_sim::model::Device) -> String {
    format!(
        "{:08X}:{:02X}:{:02X}.0",
        d.pci_domain, d.pci_bus, d.pci_device
    )
}

/// nvitop's memory figure for a GPU's total (its `bytes2human`, nvitop 1.7.2 `api/utils.py`):
/// whole MiB below 20 GiB, GiB with two decimals below 100 GiB, with one below 1000 GiB.
fn human(bytes: u64) -> String {
    let gib = bytes as f64 / (1024 * MIB) as f64;
    if bytes >= 100 * 1024 * MIB {
        format!("{gib:.1}GiB")
    } else if bytes >= 20 * 1024 * MIB {
        format!("{gib:.2}GiB")
    } else {
        format!("{}MiB", bytes / MIB)
    }
}

#[test]
fn gpustat_nvitop_and_pynvml_example_show_the_model() {
    let test = "gpustat_nvitop_and_pynvml_example_show_the_model";
    let Some(venv) = venv(test) else { return };
    let model = Model::load("dgx-a100").unwrap();
    let v = probe(&venv, "dgx-a100", test, &[]);
    // The probe's context takes the model's context memory beside what it allocates.
    let held = HELD + model.devices[0].context_memory;
    tools_saw(&v, &model, model.devices[0].memory, held, held);
}

/// The box this project's real-hardware check runs on, as the tools see it: eight "NVIDIA
/// H200" of 143771 MiB (nvitop: "140.4GiB"), 18 NVLinks each (nvitop's link count), the
/// H200's clocks (1980 / 3201 MHz).
#[test]
fn gpustat_nvitop_and_pynvml_example_see_eight_h200s() {
    let test = "gpustat_nvitop_and_pynvml_example_see_eight_h200s";
    let Some(venv) = venv(test) else { return };
    let model = Model::load("h200").unwrap();
    assert_eq!(model.devices.len(), 8);
    assert!(model.devices.iter().all(|d| d.name == "NVIDIA H200"));
    assert_eq!(human(model.devices[0].memory), "140.4GiB");
    let v = probe(&venv, "h200", test, &[]);
    let held = HELD + model.devices[0].context_memory;
    tools_saw(&v, &model, model.devices[0].memory, held, held);
    let snaps = v["nvitop"].as_array().unwrap();
    for s in snaps {
        assert_eq!(s["name"], "NVIDIA H200", "{s}");
        assert_eq!(u(&s["nvlink_link_count"]), 18, "{s}");
        assert_eq!(
            (u(&s["sm_clock"]), u(&s["memory_clock"])),
            (1980, 3201),
            "{s}"
        );
    }
}

#[test]
fn under_cuvisor_run_the_tools_show_the_quota() {
    let test = "under_cuvisor_run_the_tools_show_the_quota";
    let Some(venv) = venv(test) else { return };
    let model = Model::load("single").unwrap();
    let v = probe(&venv, "single", test, &["--memory", "4Gi"]);
    // libcuvisor's NVML answers the ledger, which does not count contexts yet (the issue
    // "Today's stacks held to their quotas"); the process list passes the simulator's through.
    let ctx = model.devices[0].context_memory;
    tools_saw(&v, &model, 4 << 30, HELD, HELD + ctx);
}

// ---- the device plugin's queries, in C -----------------------------------------------------------

fn nvml_include(test: &str) -> Option<PathBuf> {
    use cuvisor_testkit::wheels::{venv, Deps};
    let v = venv(test, "nvidia-nvml-dev-13.4.92", NVML_DEV, Deps::None)?;
    let found = std::fs::read_dir(v.join("lib"))
        .expect("venv/lib")
        .flatten()
        .map(|py| py.path().join("site-packages/nvidia/cu13/include"))
        .find(|p| p.join("nvml.h").exists());
    Some(found.unwrap_or_else(|| panic!("nvml.h in {}", v.display())))
}

/// c/nvml_monitoring.c's lines on `preset`: key -> (code, values).
fn c_client(include: &Path, preset: &str) -> HashMap<String, (i64, String)> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/c/nvml_monitoring.c");
    let exe = std::env::temp_dir().join(format!("cuvisor-c-nvml-{}", std::process::id()));
    let dir = common::sim_dir();
    let status = Command::new("cc")
        .args(["-O1", "-Wall", "-Wno-deprecated-declarations", "-I"])
        .arg(include)
        .arg("-o")
        .arg(&exe)
        .arg(&src)
        .arg("-L")
        .arg(&dir)
        .arg("-lnvidia-ml")
        .status()
        .expect("run cc");
    assert!(status.success(), "compiling {}", src.display());
    let state = common::state_file(&format!("nvml-c-{preset}"));
    let mut cmd = Command::new(&exe);
    common::sim_env(&mut cmd, preset, &state);
    let out = cmd.output().unwrap();
    let _ = std::fs::remove_file(&exe);
    let _ = std::fs::remove_file(&state);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text.lines()
        .map(|l| {
            let mut p = l.splitn(3, ' ');
            let key = p.next().unwrap().to_string();
            let code = p.next().unwrap().parse().unwrap();
            (key, (code, p.next().unwrap_or("").to_string()))
        })
        .collect()
}

#[test]
fn the_device_plugins_queries_and_their_error_paths_in_c() {
    let test = "the_device_plugins_queries_and_their_error_paths_in_c";
    let Some(include) = nvml_include(test) else {
        return;
    };
    // NVML codes (nvml.h).
    const OK: i64 = 0;
    const UNINITIALIZED: i64 = 1;
    const INVALID_ARGUMENT: i64 = 2;
    const NOT_SUPPORTED: i64 = 3;
    const NOT_FOUND: i64 = 6;
    const INSUFFICIENT_SIZE: i64 = 7;
    const VERSION_MISMATCH: i64 = 25;
    for preset in ["dgx-a100", "pcie-8", "dgx1-v100", "h200"] {
        let model = Model::load(preset).unwrap();
        let r = c_client(&include, preset);
        let get = |k: &str| {
            r.get(k)
                .cloned()
                .unwrap_or_else(|| panic!("{preset}: no {k} in {r:?}"))
        };
        let ok = |k: &str| {
            let (code, v) = get(k);
            assert_eq!(code, OK, "{preset} {k}: {v}");
            v
        };
        let code = |k: &str| get(k).0;
        assert_eq!(code("unit_count_uninit"), UNINITIALIZED);
        assert_eq!(ok("driver_version"), model.driver_release);
        let major = model.driver_release.split('.').next().unwrap();
        assert_eq!(ok("driver_branch"), format!("r{major}_00"));
        assert_eq!(code("driver_branch_short"), INSUFFICIENT_SIZE);
        assert_eq!(code("driver_branch_null"), INVALID_ARGUMENT);
        assert_eq!(ok("unit_count"), "0", "no S-class units");
        assert_eq!(code("unit_handle_0"), INVALID_ARGUMENT);
        assert_eq!(code("unit_info_bad_unit"), INVALID_ARGUMENT);
        assert_eq!(ok("excluded_devices"), "0");
        assert_eq!(ok("hic_count"), "0", "no host interface cards");
        assert_eq!(code("hic_null"), INVALID_ARGUMENT);
        assert_eq!(code("serial_unknown"), NOT_FOUND);
        assert_eq!(code("uuid_unknown"), NOT_FOUND);
        assert_eq!(ok("count"), model.devices.len().to_string());
        assert_eq!(code("brand_bad_handle"), INVALID_ARGUMENT);
        for (i, d) in model.devices.iter().enumerate() {
            let k = |s: &str| format!("{i}.{s}");
            let mhz = |khz: u32| (khz / 1000).to_string();
            let bus = nvml_bus_id(d);
            let legacy = format!("0000:{:02X}:00.0", d.pci_bus);
            let device_id = format!("{:x}", d.pci_device_id);
            assert_eq!(ok(&k("name")), d.name);
            assert_eq!(ok(&k("uuid")), d.uuid);
            assert_eq!(ok(&k("brand")), "14", "NVML_BRAND_NVIDIA");
            assert_eq!(code(&k("brand_null")), INVALID_ARGUMENT);
            assert_eq!(ok(&k("pci_v3")), format!("{bus} {device_id}"));
            assert_eq!(
                ok(&k("pci_v1")),
                format!("{legacy} {device_id} 1"),
                "36 bytes"
            );
            assert_eq!(
                ok(&k("pci_ext")),
                format!("{bus} 3 2 {:x}", d.specs.pci_subsystem_id),
                "3D controller"
            );
            assert_eq!(code(&k("pci_ext_bad_version")), VERSION_MISMATCH);
            assert_eq!(ok(&k("minor")), d.minor.to_string());
            assert_eq!(ok(&k("memory")), d.memory.to_string());
            assert_eq!(ok(&k("cc")), format!("{}.{}", d.cc.0, d.cc.1));
            let mig_capable = d.cc == (8, 0) || d.cc.0 >= 9;
            if mig_capable {
                assert_eq!(ok(&k("mig_mode")), "0 0");
            } else {
                assert_eq!(code(&k("mig_mode")), NOT_SUPPORTED);
            }
            assert_eq!(ok(&k("max_mig_devices")), "0", "documented: 0 without MIG");
            // go-nvlib takes NOT_SUPPORTED for "no ATS/HMM" and "no fabric".
            assert_eq!(code(&k("addressing_mode")), NOT_SUPPORTED);
            assert_eq!(code(&k("fabric_info")), NOT_SUPPORTED);
            let family = match d.cc {
                (7, 0) => "88",
                (8, 0) => "92",
                (9, _) => "96",
                _ => "94",
            };
            assert_eq!(ok(&k("vbios")), format!("{family}.00.00.00.01"));
            assert_eq!(code(&k("vbios_short")), INSUFFICIENT_SIZE);
            for (key, want) in [
                ("persistence", "1"),
                ("display_mode", "1"),
                ("display_active", "0"),
                ("pstate", "0"),
                ("ecc", "1 1"),
                ("virtualization", "0"),
                ("ecc_errors", "0"),
                ("encoder", "0 167000"),
                ("decoder", "0 167000"),
                ("pcie_rx", "0"),
                ("grid", "0 0"),
            ] {
                assert_eq!(ok(&k(key)), want, "{preset} GPU {i} {key}");
            }
            assert_eq!(code(&k("ecc_errors_bad_type")), INVALID_ARGUMENT);
            // Nothing ran: "Idle" is the one reason; bits 0-8 are supported.
            assert_eq!(ok(&k("event_reasons")), "1");
            assert_eq!(ok(&k("supported_event_reasons")), "1ff");
            assert_eq!(ok(&k("encoder_stats")), "0 0 0");
            assert_eq!(ok(&k("encoder_sessions")), "0");
            assert_eq!(ok(&k("fbc_stats")), "0 0 0");
            assert_eq!(
                ok(&k("by_serial")),
                i.to_string(),
                "the serial names the board"
            );
            assert_eq!(code(&k("pcie_bad_counter")), INVALID_ARGUMENT);
            assert_eq!(ok(&k("clock_sm")), mhz(d.specs.clock_khz));
            assert_eq!(ok(&k("clock_mem")), mhz(d.specs.memory_clock_khz));
            assert_eq!(code(&k("clock_video")), NOT_SUPPORTED);
            assert_eq!(code(&k("clock_bad")), INVALID_ARGUMENT);
            let freqs = ok(&k("clock_freqs"));
            let min = if d.cc.0 < 8 { 135 } else { 210 };
            let nv = mhz(d.specs.clock_khz);
            assert!(
                freqs.starts_with(&format!(
                    "nvclock={nv}, nvclockmin={min}, nvclockmax={nv}, nvclockeditable=0, memclock={}",
                    mhz(d.specs.memory_clock_khz)
                )),
                "{freqs}"
            );
            assert_eq!(ok(&k("perf_modes")), format!("perf=0, {freqs}"));
            assert_eq!(code(&k("perf_modes_bad_version")), VERSION_MISMATCH);

            // Field values: ECC current, link count, link 0 TX, power instant, power average,
            // memory temperature, PCIe replays (not modelled), NVML_FI_MAX (out of range).
            let (c, fields) = get(&k("fields"));
            assert_eq!(c, OK, "{fields}");
            let f: Vec<Vec<u64>> = fields
                .split(' ')
                .map(|e| e.split(':').map(|x| x.parse().unwrap()).collect())
                .collect();
            let entry = |id: u64| {
                f.iter()
                    .find(|e| e[0] == id)
                    .unwrap_or_else(|| panic!("{fields}"))[1..]
                    .to_vec()
            };
            assert_eq!(entry(1), [0, 1, 1], "ECC on, unsigned int");
            let links = d.links.len() as u64;
            if d.nvlink_version > 0 {
                assert_eq!(entry(91), [0, 1, links]);
                assert_eq!(entry(138), [0, 3, 0], "no traffic recorded");
                assert_eq!(ok(&k("field_past_last_link")), "2", "invalid scope");
            } else {
                assert_eq!(entry(91)[0], NOT_SUPPORTED as u64);
                assert_eq!(entry(138)[0], NOT_SUPPORTED as u64);
            }
            let power = entry(186);
            assert_eq!(&power[..2], [0, 1]);
            assert!(power[2] > 0, "{power:?}");
            // Documented: average power on Ampere except GA100, and later.
            if d.cc.0 >= 8 && d.cc != (8, 0) {
                assert_eq!(entry(185), power);
            } else {
                assert_eq!(entry(185)[0], NOT_SUPPORTED as u64);
            }
            // HBM boards (V100, A100, H200: "Memory Current Temp" in an H200's nvidia-smi -q).
            let hbm = matches!(d.cc, (7, 0) | (8, 0) | (9, 0));
            assert_eq!(entry(82)[0], if hbm { 0 } else { NOT_SUPPORTED as u64 });
            assert_eq!(entry(94)[0], NOT_SUPPORTED as u64);
            assert_eq!(entry(308)[0], INVALID_ARGUMENT as u64);
            assert_eq!(code(&k("fields_null")), INVALID_ARGUMENT);
        }
    }
}
