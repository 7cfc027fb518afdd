//! NVIDIA's own CUDA runtime, unmodified, on the simulator: libcudart from the PyPI wheels
//! `nvidia-cuda-runtime-cu12` and `nvidia-cuda-runtime` (13.x), pinned, driven from Python
//! through ctypes (`cudart/probe.py`).
//!
//! Each wheel (a few MB) is installed once into a virtual environment under
//! `target/ci-tools/`, which later runs reuse. Where it cannot be installed (no network, no
//! python3), a test prints a loud SKIPPED line, or fails when `CI` is set: it never passes
//! without having run.
mod common;
#[path = "common/python.rs"]
mod python;

use python::{at, u};

use cuvisor_sim::model::Model;
use serde_json::Value;
use std::path::{Path, PathBuf};

/// The runtimes tested: the newest 12.x and 13.x wheels when this test was written.
const CUDART12: (&str, &str) = ("nvidia-cuda-runtime-cu12", "12.9.79");
const CUDART13: (&str, &str) = ("nvidia-cuda-runtime", "13.5.37");

/// The venv holding one pinned runtime wheel (`target/ci-tools/<package>-<version>/`).
fn cudart_venv(test: &str, (package, version): (&str, &str)) -> Option<PathBuf> {
    use cuvisor_testkit::wheels::{venv, Deps};
    venv(
        test,
        &format!("{package}-{version}"),
        &[(package, version)],
        Deps::None,
    )
}

/// The runtime library inside the venv: `lib/python3.X/site-packages/nvidia/cuda_runtime/lib`
/// (12.x wheels) or `.../nvidia/cu13/lib` (13.x).
fn find_lib(venv: &Path, name: &str) -> PathBuf {
    let lib = venv.join("lib");
    for py in std::fs::read_dir(&lib).expect("venv/lib").flatten() {
        for dir in ["cuda_runtime", "cu13"] {
            let p = py
                .path()
                .join("site-packages/nvidia")
                .join(dir)
                .join("lib")
                .join(name);
            if p.exists() {
                return p;
            }
        }
    }
    panic!("{name} is not in {}", lib.display());
}

/// Runs probe.py against the runtime on the simulator's `single` preset; its answers.
fn probe(venv: &Path, lib: &Path, tag: &str) -> Value {
    probe_on(venv, lib, tag, "single", &[])
}

/// As [`probe`], on the machine `model` (a preset or a model file's path), under
/// `cuvisor run RUN` unless `run` is empty.
fn probe_on(venv: &Path, lib: &Path, tag: &str, model: &str, run: &[&str]) -> Value {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/cudart/probe.py");
    python::python_probe(
        venv,
        &[script.as_os_str(), lib.as_os_str()],
        model,
        tag,
        &[],
        &[],
        run,
    )
}

/// cudaSuccess, and what every call listed answered first.
fn all_succeeded(v: &Value, calls: &[&str]) {
    for c in calls {
        assert_eq!(u(&at(v, c)[0]), 0, "{c} answered {:?}", at(v, c));
    }
}

/// A model file under the temp dir, removed when dropped: `driver_version` and one 16 GiB
/// device.
struct ModelFile(PathBuf);

impl ModelFile {
    fn new(test: &str, driver_version: i32) -> ModelFile {
        let p = std::env::temp_dir().join(format!("cuvisor-{test}-{}.toml", std::process::id()));
        std::fs::write(
            &p,
            format!("driver_version = {driver_version}\n[[device]]\nmemory = \"16Gi\"\n"),
        )
        .unwrap();
        ModelFile(p)
    }
    fn path(&self) -> &str {
        self.0.to_str().unwrap()
    }
    fn model(&self) -> Model {
        Model::load(self.path()).unwrap()
    }
}

impl Drop for ModelFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// What probe.py saw, checked against the machine it ran on: every call succeeded, the device
/// and its memory are the model's, malloc and free move the free memory by what they take, an
/// over-large malloc is cudaErrorMemoryAllocation (2), the stream-ordered pool gives its memory
/// back at a sync, and events time what happened between them.
fn runs_on(v: &Value, model: &Model, runtime_version: u64) {
    let dev = &model.devices[0];
    all_succeeded(
        v,
        &[
            "cudaGetDeviceCount",
            "cudaRuntimeGetVersion",
            "cudaGetDeviceProperties",
            "cudaMemGetInfo",
            "cudaMalloc",
            "cudaFree",
            "cudaStreamCreate",
            "cudaMallocAsync",
            "cudaFreeAsync",
            "cudaStreamSynchronize",
            "cudaEventCreate",
            "cudaEventRecord",
            "cudaEventSynchronize",
            "cudaEventQuery",
            "cudaEventElapsedTime",
            "cudaEventDestroy",
            "cudaStreamDestroy",
            "cudaDeviceSynchronize",
            "cudaDeviceReset",
        ],
    );
    assert_eq!(u(&at(v, "cudaGetDeviceCount")[1]), 1);
    assert_eq!(u(&at(v, "cudaRuntimeGetVersion")[1]), runtime_version);
    assert_eq!(
        u(&at(v, "cudaDriverGetVersion")[1]),
        model.driver_version as u64
    );

    let props = at(v, "cudaGetDeviceProperties");
    assert_eq!(props[1], dev.name.as_str());
    let uuid: String = dev
        .uuid_bytes()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_eq!(props[2], uuid.as_str());
    assert_eq!(u(&props[3]), dev.memory);
    assert_eq!(
        (u(&props[4]), u(&props[5])),
        (dev.cc.0 as u64, dev.cc.1 as u64)
    );

    let mem = |k| {
        let m = at(v, k);
        (u(&m[1]), u(&m[2]))
    };
    // Free: the GPU's memory less what the program's context takes.
    let idle = dev.memory - dev.context_memory;
    assert!(dev.context_memory > 0, "the preset's contexts take memory");
    assert_eq!(mem("cudaMemGetInfo"), (idle, dev.memory));
    assert!(at(v, "cudaMalloc")[1].as_bool().unwrap());
    assert_eq!(
        mem("cudaMemGetInfo_after_malloc"),
        (idle - (64 << 20), dev.memory)
    );
    assert_eq!(mem("cudaMemGetInfo_after_free"), (idle, dev.memory));
    // cudaErrorMemoryAllocation, and not sticky: cudaGetLastError reports it once.
    assert_eq!(u(&at(v, "cudaMalloc_too_large")[0]), 2);
    assert_eq!(u(&at(v, "cudaGetLastError")[0]), 2);

    assert!(at(v, "cudaMallocAsync")[1].as_bool().unwrap());
    let (free_async, _) = mem("cudaMemGetInfo_after_malloc_async");
    assert!(
        free_async <= idle - (16 << 20),
        "the pool holds the allocation"
    );
    assert_eq!(
        mem("cudaMemGetInfo_after_free_async"),
        (idle, dev.memory),
        "freed and synchronized, a pool with release threshold 0 gives it back"
    );

    // Two events recorded 50 ms apart on an idle stream: the time between them is the wall
    // time between the records.
    let ev = at(v, "cudaEventElapsedTime");
    let (ms, inner, outer) = (
        ev[1].as_f64().unwrap(),
        ev[2].as_f64().unwrap(),
        ev[3].as_f64().unwrap(),
    );
    assert!(
        inner - 1.0 <= ms && ms <= outer + 1.0,
        "elapsed {ms} ms, records {inner}..{outer} ms apart"
    );
    python::allocators_counted(v, dev.memory, idle, &ALLOCATORS, false);
}

#[test]
fn cudart12_runs_on_the_simulator() {
    let test = "cudart12_runs_on_the_simulator";
    let Some(venv) = cudart_venv(test, CUDART12) else {
        return;
    };
    let lib = find_lib(&venv, "libcudart.so.12");
    let v = probe(&venv, &lib, test);
    runs_on(&v, &Model::load("single").unwrap(), 12090);
}

/// libcudart 13.5 on a driver reporting 13.0 passes what 12.9 does. On the way it resolves
/// `cuCtxGetDevice` and `cuCtxSynchronize` at 13000 (`cuCtxGetDevice_v2`,
/// `cuCtxSynchronize_v2`, which take the context) and calls them.
#[test]
fn cudart13_runs_on_a_13_0_driver() {
    let test = "cudart13_runs_on_a_13_0_driver";
    let Some(venv) = cudart_venv(test, CUDART13) else {
        return;
    };
    let lib = find_lib(&venv, "libcudart.so.13");
    let model = ModelFile::new(test, 13000);
    let v = probe_on(&venv, &lib, test, model.path(), &[]);
    runs_on(&v, &model.model(), 13050);
}

/// libcudart 13.x refuses a 12.x driver: cudaErrorInsufficientDriver (35), at 12.8 (12080, what
/// R570 drivers report). A model may set an older driver, and then the runtime says so.
#[test]
fn cudart13_refuses_a_12_8_driver() {
    let test = "cudart13_refuses_a_12_8_driver";
    let Some(venv) = cudart_venv(test, CUDART13) else {
        return;
    };
    let lib = find_lib(&venv, "libcudart.so.13");
    let model = ModelFile::new(test, 12080);
    let v = probe_on(&venv, &lib, test, model.path(), &[]);
    assert_eq!(u(&at(&v, "cudaGetDeviceCount")[0]), 35, "{v}");
    assert_eq!(u(&at(&v, "cudaDriverGetVersion")[1]), 12080);
}

/// probe.py under `cuvisor run --memory 6Gi` on `model`: memory info and totalGlobalMem show
/// the quota, every allocator is counted against it, and 13 GiB (within the 16 GiB GPU) is
/// refused by each.
fn sees_the_quota(test: &str, venv: &Path, lib: &Path, model: &str) {
    let v = probe_on(venv, lib, test, model, python::QUOTA);
    let quota = python::QUOTA_BYTES;
    all_succeeded(
        &v,
        &[
            "cudaGetDeviceCount",
            "cudaMemGetInfo",
            "cudaMalloc",
            "cudaFree",
        ],
    );
    let m = at(&v, "cudaMemGetInfo");
    assert_eq!(
        (u(&m[1]), u(&m[2])),
        (quota, quota),
        "the quota, not the 16 GiB GPU"
    );
    assert_eq!(
        u(&at(&v, "cudaGetDeviceProperties")[3]),
        quota,
        "totalGlobalMem is the quota too"
    );
    let m = at(&v, "cudaMemGetInfo_after_malloc");
    assert_eq!((u(&m[1]), u(&m[2])), (quota - (64 << 20), quota));
    // 13 GiB: within the GPU, beyond the quota.
    assert_eq!(u(&at(&v, "cudaMalloc_too_large")[0]), 2);
    python::allocators_counted(&v, quota, quota, &ALLOCATORS, true);
}

/// What probe.py's allocators beyond cudaMalloc answered.
const ALLOCATORS: [&str; 3] = ["cudaMallocManaged", "cudaMallocPitch", "cudaMalloc3DArray"];

#[test]
fn cudart12_under_cuvisor_run_sees_and_keeps_to_the_quota() {
    let test = "cudart12_under_cuvisor_run_sees_and_keeps_to_the_quota";
    let Some(venv) = cudart_venv(test, CUDART12) else {
        return;
    };
    let lib = find_lib(&venv, "libcudart.so.12");
    sees_the_quota(test, &venv, &lib, "single");
}

/// On the default model (whose driver reports 13.0, which both runtimes accept).
#[test]
fn cudart13_under_cuvisor_run_sees_and_keeps_to_the_quota() {
    let test = "cudart13_under_cuvisor_run_sees_and_keeps_to_the_quota";
    let Some(venv) = cudart_venv(test, CUDART13) else {
        return;
    };
    let lib = find_lib(&venv, "libcudart.so.13");
    assert_eq!(Model::load("single").unwrap().driver_version, 13000);
    sees_the_quota(test, &venv, &lib, "single");
}
