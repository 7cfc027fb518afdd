//! NVIDIA's own Python bindings, unmodified, on the simulator: `nvidia-ml-py` (pynvml) for NVML
//! and `cuda-bindings` (13.x and 12.x) for the driver API, pinned, driven by
//! `python_nvml/probe.py`: the driver allocates memory and runs a kernel, then NVML reports the
//! memory, the process, its utilization and the board's sensors. Plain, and under
//! `cuvisor run --memory 6Gi`, where both sides must see the quota as the GPU's memory and
//! an allocation beyond it fails with CUDA_ERROR_OUT_OF_MEMORY while the program goes on.
//!
//! The wheels (about 30 MB each) are installed once into virtual environments under
//! `target/ci-tools/`, which later runs reuse. Where they cannot be installed (no network, no
//! python3 >= 3.11, which cuda-bindings 13.5 needs), a test prints a loud SKIPPED line, or
//! fails when `CI` is set: it never passes without having run.
mod common;
#[path = "common/python.rs"]
mod python;

use python::{at, u};

use cuvisor_sim::model::{Model, GIB, MIB};
use serde_json::Value;
use std::path::{Path, PathBuf};

/// The newest wheels on PyPI when this test was written. cuda-bindings declares one dependency,
/// cuda-pathfinder (which finds libcuda), pinned here too so that `--no-deps` installs exactly
/// these: 13.5 asks for cuda-pathfinder >= 1.4.2, 12.9.10 for ~= 1.1.
const PYNVML: (&str, &str) = ("nvidia-ml-py", "13.615.71");
const CUDA_BINDINGS13: (&str, &str) = ("cuda-bindings", "13.5.0");
const CUDA_BINDINGS12: (&str, &str) = ("cuda-bindings", "12.9.10");
const PATHFINDER: (&str, &str) = ("cuda-pathfinder", "1.9.1");

/// The quota the `cuvisor run` runs get, and an allocation within the 16 GiB GPU beyond it.
const QUOTA: u64 = python::QUOTA_BYTES;
const BEYOND_QUOTA: u64 = QUOTA + 2 * GIB;
/// What probe.py holds while NVML looks.
const HELD: u64 = 64 * MIB;

/// The venv holding pynvml and one cuda-bindings (`target/ci-tools/<names>/`).
fn venv(test: &str, bindings: (&str, &str)) -> Option<PathBuf> {
    use cuvisor_testkit::wheels::{venv, Deps};
    let packages = [PYNVML, bindings, PATHFINDER];
    let name: Vec<String> = packages.iter().map(|(p, v)| format!("{p}-{v}")).collect();
    venv(test, &name.join("+"), &packages, Deps::None)
}

/// Runs probe.py on the `single` preset, under `cuvisor run RUN` unless `run` is empty; its
/// answers.
fn probe(venv: &Path, tag: &str, beyond: u64, run: &[&str]) -> Value {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python_nvml/probe.py");
    let beyond = beyond.to_string();
    python::python_probe(
        venv,
        &[script.as_os_str(), beyond.as_ref()],
        "single",
        tag,
        &[],
        &[],
        run,
    )
}

/// probe.py under `cuvisor run --memory 6Gi` (a [`QUOTA`] quota).
fn probe_with_quota(venv: &Path, test: &str) -> Value {
    probe(venv, test, BEYOND_QUOTA, python::QUOTA)
}

/// The code a call answered (CUresult or nvmlReturn_t), and its values.
fn code(v: &Value, key: &str) -> u64 {
    u(&at(v, key)[0])
}

fn ok(v: &Value, key: &str) -> Vec<Value> {
    let a = at(v, key);
    assert_eq!(u(&a[0]), 0, "{key} answered {a:?}");
    a[1..].to_vec()
}

fn pair(v: &Value, key: &str) -> (u64, u64) {
    let a = ok(v, key);
    (u(&a[0]), u(&a[1]))
}

/// What probe.py saw on the simulated A100 PCIe 16 GiB, with `total` the memory the process is
/// given (the GPU's, or the quota): the driver API and NVML agree on it; the 64 MiB held shows
/// as used in both and as the process's in NVML's list; the allocation beyond `total` is
/// CUDA_ERROR_OUT_OF_MEMORY and the next one works; the 300 ms kernel shows as the process's
/// utilization, and temperature and power sit between idle and what 30 % of the last second
/// gives. `ctx`: what one context takes in the memory the process is shown (the preset's
/// `context_memory` on the plain simulator; 0 under libcuvisor, whose ledger does not count
/// contexts yet); `listed_ctx`: what one context adds to the process's usedGpuMemory in NVML's
/// process list (the simulator's, which libcuvisor passes through).
fn saw(v: &Value, total: u64, ctx: u64, listed_ctx: u64) {
    let m = Model::load("single").unwrap();
    let dev = &m.devices[0];
    let pid = u(&v["pid"]);

    // cuda-bindings.
    ok(v, "cuInit");
    assert_eq!(u(&ok(v, "cuDriverGetVersion")[0]), m.driver_version as u64);
    assert_eq!(u(&ok(v, "cuDeviceGetCount")[0]), 1);
    assert_eq!(ok(v, "cuDeviceGetName")[0], dev.name.as_str());
    assert_eq!(u(&ok(v, "cuDeviceTotalMem")[0]), total);
    ok(v, "cuDevicePrimaryCtxRetain");
    ok(v, "cuCtxSetCurrent_primary");
    assert_eq!(pair(v, "cuMemGetInfo_primary"), (total - ctx, total));
    ok(v, "cuCtxCreate");
    // Two contexts now: the primary one and the created one.
    let idle = total - 2 * ctx;
    assert_eq!(pair(v, "cuMemGetInfo"), (idle, total));
    ok(v, "cuMemAlloc");
    assert_eq!(pair(v, "cuMemGetInfo_after_alloc"), (idle - HELD, total));
    assert_eq!(
        code(v, "cuMemAlloc_beyond"),
        2,
        "CUDA_ERROR_OUT_OF_MEMORY: {:?}",
        at(v, "cuMemAlloc_beyond")
    );
    ok(v, "cuMemAlloc_after_oom");
    ok(v, "cuMemFree_after_oom");
    assert_eq!(pair(v, "cuMemGetInfo_after_oom"), (idle - HELD, total));
    for call in [
        "cuModuleLoadData",
        "cuModuleGetFunction",
        "cuLaunchKernel",
        "cuCtxSynchronize",
    ] {
        ok(v, call);
    }
    ok(v, "cuMemFree");
    assert_eq!(pair(v, "cuMemGetInfo_after_free"), (idle, total));
    ok(v, "cuCtxDestroy");
    ok(v, "cuDevicePrimaryCtxRelease");

    // pynvml, while the 64 MiB were held.
    assert_eq!(
        ok(v, "nvmlSystemGetDriverVersion")[0],
        m.driver_release.as_str()
    );
    assert_eq!(u(&ok(v, "nvmlDeviceGetCount")[0]), 1);
    assert_eq!(ok(v, "nvmlDeviceGetName")[0], dev.name.as_str());
    assert_eq!(ok(v, "nvmlDeviceGetUUID")[0], dev.uuid.as_str());
    let mem: Vec<u64> = ok(v, "nvmlDeviceGetMemoryInfo").iter().map(u).collect();
    let used = HELD + 2 * ctx;
    assert_eq!(mem, [total, used, total - used], "total, used, free");
    let mem: Vec<u64> = ok(v, "nvmlDeviceGetMemoryInfo_v2").iter().map(u).collect();
    assert_eq!(
        mem,
        [total, used, total - used, 0],
        "total, used, free, reserved"
    );
    let procs = ok(v, "nvmlDeviceGetComputeRunningProcesses");
    let procs: Vec<Vec<u64>> = procs[0]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p.as_array().unwrap().iter().map(u).collect())
        .collect();
    assert_eq!(
        procs,
        [vec![pid, HELD + 2 * listed_ctx]],
        "the probe and what it holds, its two contexts included"
    );

    // 300 ms of kernel just before: at most 30 % of the last second, more than none.
    let util = ok(v, "nvmlDeviceGetUtilizationRates");
    let (gpu, memory) = (u(&util[0]), u(&util[1]));
    assert!((1..=31).contains(&gpu), "gpu {gpu} %");
    assert_eq!(memory, 0, "memory traffic is not modelled");
    for key in [
        "nvmlDeviceGetProcessesUtilizationInfo",
        "nvmlDeviceGetProcessUtilization",
    ] {
        let samples = ok(v, key)[0].as_array().unwrap().clone();
        assert_eq!(samples.len(), 1, "{key}: {samples:?}");
        let s: Vec<u64> = samples[0].as_array().unwrap().iter().map(u).collect();
        assert_eq!(s[0], pid, "{key}: {s:?}");
        assert!((1..=31).contains(&s[1]), "{key}: sm {s:?}");
        assert!(s[2..].iter().all(|&x| x == 0), "{key}: mem/jpg/ofa {s:?}");
    }

    // The board: 33 °C idle + 30 °C at full load; 250 W, 15 % of it idle.
    for key in ["nvmlDeviceGetTemperature", "nvmlDeviceGetTemperatureV"] {
        let t = u(&ok(v, key)[0]);
        assert!((33..=42).contains(&t), "{key}: {t} °C");
    }
    let power = u(&ok(v, "nvmlDeviceGetPowerUsage")[0]);
    assert!((37_500..=103_375).contains(&power), "{power} mW");
    assert_eq!(u(&ok(v, "nvmlDeviceGetPowerManagementLimit")[0]), 250_000);
    assert_eq!(u(&ok(v, "nvmlDeviceGetEnforcedPowerLimit")[0]), 250_000);
    assert!(u(&ok(v, "nvmlDeviceGetTotalEnergyConsumption")[0]) > 0);
    assert_eq!(u(&ok(v, "nvmlDeviceGetComputeMode")[0]), 0, "DEFAULT");
    assert_eq!(
        ok(v, "nvmlDeviceGetMigMode")[0],
        serde_json::json!([0, 0]),
        "A100: MIG capable, disabled now and after reset"
    );
    assert_eq!(
        code(v, "nvmlDeviceGetP2PStatus_self"),
        2,
        "a device with itself: NVML_ERROR_INVALID_ARGUMENT"
    );
}

#[test]
fn pynvml_and_cuda_bindings_on_the_simulator() {
    let test = "pynvml_and_cuda_bindings_on_the_simulator";
    let Some(venv) = venv(test, CUDA_BINDINGS13) else {
        return;
    };
    let dev = &Model::load("single").unwrap().devices[0];
    assert!(dev.context_memory > 0, "the preset's contexts take memory");
    // Beyond the 16 GiB GPU.
    let v = probe(&venv, test, dev.memory + GIB, &[]);
    saw(&v, dev.memory, dev.context_memory, dev.context_memory);
}

#[test]
fn pynvml_and_cuda_bindings_under_cuvisor_run_see_the_quota() {
    let test = "pynvml_and_cuda_bindings_under_cuvisor_run_see_the_quota";
    let Some(venv) = venv(test, CUDA_BINDINGS13) else {
        return;
    };
    let ctx = Model::load("single").unwrap().devices[0].context_memory;
    saw(&probe_with_quota(&venv, test), QUOTA, 0, ctx);
}

/// cuda-bindings 12.x resolves the driver's entry points at CUDA 12 versions; the simulator's
/// 13.0 driver and libcuvisor answer them as they do 13.x's.
#[test]
fn cuda_bindings12_plain_and_under_cuvisor_run() {
    let test = "cuda_bindings12_plain_and_under_cuvisor_run";
    let Some(venv) = venv(test, CUDA_BINDINGS12) else {
        return;
    };
    let dev = &Model::load("single").unwrap().devices[0];
    let (gpu, ctx) = (dev.memory, dev.context_memory);
    saw(&probe(&venv, test, gpu + GIB, &[]), gpu, ctx, ctx);
    saw(&probe_with_quota(&venv, test), QUOTA, 0, ctx);
}
