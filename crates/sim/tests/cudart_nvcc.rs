//! An ordinary CUDA program on the simulator: `cudart/runtime.cu`, built by nvcc from NVIDIA's
//! CUDA 13 wheels (`nvidia-cuda-nvcc`, `nvidia-nvvm`, `nvidia-cuda-crt` and the runtime's
//! headers and static library from `nvidia-cuda-runtime`, pinned; about 350 MB installed once
//! into `target/ci-tools/`), plain and under `cuvisor run`. Its kernel goes through nvcc, ptxas
//! and fatbinary for real; the static libcudart registers the fat binary and launches the kernel
//! with `<<<>>>` (cudaLaunchKernel), as any CUDA program does.
//!
//! What is checked: the quota as the GPU's memory (cudaMemGetInfo, totalGlobalMem), every
//! allocator of the runtime counted (cudaMalloc, cudaMallocAsync, cudaMallocManaged,
//! cudaMallocPitch, cudaMalloc3DArray) and refused beyond the quota with
//! cudaErrorMemoryAllocation while the program goes on, a kernel timed by events, and the compute
//! policies holding a runtime-launched loop: limit=30 to 30 +/- 2 % of the GPU, shares of 1 and 3
//! to 25 and 75 +/- 2 %, read from the simulator's own per-process busy time.
//!
//! Where the wheels cannot be installed, a test prints a loud SKIPPED line, or fails when `CI`
//! is set: it never passes without having run. A failing nvcc always fails the test.
mod common;
#[path = "common/python.rs"]
mod python;

use python::{at, u};

use cuvisor_sim::model::Model;
use cuvisor_sim::state::{now_ns, Shared};
use cuvisor_testkit::assert_share_near as within;
use serde_json::Value;
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

/// nvcc and what it needs, at the version of the CUDA 13 runtime the cudart tests use.
/// The timed tests run one at a time, and not beside the others, so that they do not compete
/// for the CPU on small machines.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// runtime.cu built for the simulated A100 (sm_80: its cubin and PTX), once per test process,
/// into the profile directory. None (after a SKIPPED line) where the wheels cannot be had.
fn program(test: &str) -> Option<PathBuf> {
    static BUILT: OnceLock<Option<PathBuf>> = OnceLock::new();
    BUILT
        .get_or_init(|| {
            let cu13 = cuvisor_testkit::wheels::nvcc_13_5(test)?;
            let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/cudart/runtime.cu");
            let out = cuvisor_testkit::profile_dir_of_test()
                .join(format!("cudart-runtime-{}", std::process::id()));
            cuvisor_testkit::wheels::nvcc(&cu13, &["-arch=sm_80"], &src, &out);
            Some(out)
        })
        .clone()
}

/// `runtime memory` on the `single` GPU, under `cuvisor run RUN` unless `run` is empty; its JSON.
fn memory(program: &Path, tag: &str, run: &[&str]) -> Value {
    let state = common::state_file(tag);
    let mut cmd = python::on_sim(program, run, "single", &state);
    python::json_of(cmd.arg("memory"), &state)
}

/// What `runtime memory` saw on a GPU of `total` bytes: `idle` of it free (the total less the
/// context's memory, on the plain simulator) and `total` as totalGlobalMem, each
/// allocator's 64 MiB taken and given back, more than is free refused with
/// cudaErrorMemoryAllocation (2), reported once by cudaGetLastError, and the allocator working
/// again afterwards; a 50 ms kernel timed by events; nothing left at the end.
/// `refuses_managed`: see [`python::allocators_counted`].
fn saw(v: &Value, total: u64, idle: u64, refuses_managed: bool) {
    let free = |k: &str| {
        let m = at(v, k);
        assert_eq!(
            (u(&m[0]), u(&m[2])),
            (0, total),
            "{k} answered {m:?} in {v}"
        );
        u(&m[1])
    };
    assert_eq!(free("cudaMemGetInfo"), idle);
    let props = at(v, "cudaGetDeviceProperties");
    assert_eq!((u(&props[0]), u(&props[1])), (0, total), "totalGlobalMem");
    python::allocators_counted(v, total, idle, &ALLOCATORS, refuses_managed);
    assert!(u(&v["pitch"]) >= 4096, "a pitch of at least the row");
    assert_eq!(u(&at(v, "launch")[0]), 0, "the <<<>>> launch");
    assert_eq!(u(&at(v, "cudaEventSynchronize")[0]), 0);
    let ev = at(v, "cudaEventElapsedTime");
    let ms = ev[1].as_f64().unwrap();
    assert_eq!(u(&ev[0]), 0);
    assert!(
        (50.0..75.0).contains(&ms),
        "a 50 ms kernel between two events: {ms} ms"
    );
    assert_eq!(
        free("cudaMemGetInfo_at_end"),
        idle,
        "nothing held at the end"
    );
}

/// The runtime's allocators runtime.cu takes 64 MiB with (see
/// [`python::allocators_counted`]).
const ALLOCATORS: [&str; 5] = [
    "cudaMalloc",
    "cudaMallocAsync",
    "cudaMallocManaged",
    "cudaMallocPitch",
    "cudaMalloc3DArray",
];

#[test]
fn an_nvcc_built_program_runs_on_the_simulator() {
    let test = "an_nvcc_built_program_runs_on_the_simulator";
    let Some(program) = program(test) else {
        return;
    };
    let _one = serial();
    let gpu = &Model::load("single").unwrap().devices[0];
    assert!(gpu.context_memory > 0, "the preset's contexts take memory");
    let idle = gpu.memory - gpu.context_memory;
    saw(&memory(&program, test, &[]), gpu.memory, idle, false);
}

/// Under `cuvisor run --memory 6Gi`: 6 GiB is the GPU, and each allocator's 13 GiB (within the
/// 16 GiB GPU) is refused.
#[test]
fn an_nvcc_built_program_under_cuvisor_run_sees_and_keeps_to_its_quota() {
    let test = "an_nvcc_built_program_under_cuvisor_run_sees_and_keeps_to_its_quota";
    let Some(program) = program(test) else {
        return;
    };
    let _one = serial();
    let v = memory(&program, test, python::QUOTA);
    saw(&v, python::QUOTA_BYTES, python::QUOTA_BYTES, true);
}

/// One `cuvisor run ... -- runtime busy`: a container of its own on the simulated GPU.
struct Loop {
    child: Child,
    pid: u32,
    out: std::io::BufReader<std::process::ChildStdout>,
}

/// The simulated GPU the loops share: its state file (which `cuvisor run` puts the coordinator
/// beside) and a view of its per-process busy time.
struct Gpu {
    state: PathBuf,
    sim: Shared,
}

impl Gpu {
    fn new(tag: &str) -> Gpu {
        let state = common::state_file(tag);
        let model = cuvisor_sim::model::preset("single").unwrap();
        let sim = Shared::attach_at(&model, &state).unwrap();
        Gpu { state, sim }
    }

    /// Starts `runtime busy SECONDS 1000` (1 ms kernels) under `cuvisor run RUN`; returns once it
    /// printed its pid.
    fn start(&self, program: &Path, run: &[&str], seconds: f64) -> Loop {
        let mut child = python::on_sim(program, run, "single", &self.state)
            .args(["busy", &seconds.to_string(), "1000"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start cuvisor run");
        let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        out.read_line(&mut line).unwrap();
        let pid = line
            .strip_prefix("pid ")
            .and_then(|p| p.trim().parse().ok())
            .unwrap_or_else(|| panic!("the program printed {line:?}, not its pid"));
        Loop { child, pid, out }
    }

    /// Each loop's fraction of the GPU over `window` from now.
    fn shares(&self, loops: &[&Loop], window: Duration) -> Vec<f64> {
        let t0 = now_ns();
        std::thread::sleep(window);
        let t1 = now_ns();
        loops
            .iter()
            .map(|l| self.sim.pid_busy_since(l.pid, 0, t0) as f64 / (t1 - t0) as f64)
            .collect()
    }
}

impl Drop for Gpu {
    fn drop(&mut self) {
        python::remove_state(&self.state);
    }
}

/// Waits for a loop: it must have exited 0 after printing how many kernels it launched.
fn finish(mut l: Loop) {
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut l.out, &mut rest).unwrap();
    let out = l.child.wait_with_output().unwrap();
    assert!(
        out.status.success() && rest.starts_with("launched "),
        "{}\n--- stdout\n{rest}\n--- stderr\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

const WARMUP: Duration = Duration::from_millis(700);
const WINDOW: Duration = Duration::from_secs(2);
/// How long each loop runs: past the warm-up and the window.
const SECONDS: f64 = 3.5;

/// `cuvisor run --memory 6Gi --compute limit=30`: alone on an idle GPU, the loop gets 30 % of
/// it, not more.
#[test]
fn an_nvcc_built_loop_under_limit_30_gets_30_percent_of_the_gpu() {
    let test = "an_nvcc_built_loop_under_limit_30_gets_30_percent_of_the_gpu";
    let Some(program) = program(test) else {
        return;
    };
    let _one = serial();
    let gpu = Gpu::new(test);
    let run = ["--memory", "6Gi", "--compute", "limit=30"];
    let l = gpu.start(&program, &run, SECONDS);
    std::thread::sleep(WARMUP);
    let s = gpu.shares(&[&l], WINDOW);
    within(s[0], 0.30, "runtime loop under limit=30");
    finish(l);
}

/// Two `cuvisor run --compute share=W` on one GPU, W = 1 and 3: 25 % and 75 % of it.
#[test]
fn nvcc_built_loops_of_shares_1_and_3_get_25_and_75_percent() {
    let test = "nvcc_built_loops_of_shares_1_and_3_get_25_and_75_percent";
    let Some(program) = program(test) else {
        return;
    };
    let _one = serial();
    let gpu = Gpu::new(test);
    let a = gpu.start(
        &program,
        &["--memory", "6Gi", "--compute", "share=1"],
        SECONDS,
    );
    let b = gpu.start(
        &program,
        &["--memory", "6Gi", "--compute", "share=3"],
        SECONDS,
    );
    std::thread::sleep(WARMUP);
    let s = gpu.shares(&[&a, &b], WINDOW);
    within(s[0], 0.25, "runtime loop of share=1 next to share=3");
    within(s[1], 0.75, "runtime loop of share=3 next to share=1");
    finish(a);
    finish(b);
}

/// tests/cudart/device_array.cu built with a `__device__` array of `bytes` (nvcc's own
/// `-DBIG=...`), into the profile directory. None (after a SKIPPED line) where the wheels
/// cannot be had.
fn device_array(test: &str, bytes: u64) -> Option<PathBuf> {
    let cu13 = cuvisor_testkit::wheels::nvcc_13_5(test)?;
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/cudart/device_array.cu");
    let out = cuvisor_testkit::profile_dir_of_test().join(format!(
        "cudart-device-array-{bytes}-{}",
        std::process::id()
    ));
    let big = format!("-DBIG={bytes}ull");
    cuvisor_testkit::wheels::nvcc(&cu13, &["-arch=sm_80", &big], &src, &out);
    Some(out)
}

/// device_array's steps ("STEP ERROR NAME") and free memory, run on the `single` GPU under
/// `cuvisor run RUN` (plainly where `run` is empty). With CUDA_MODULE_LOADING=EAGER: under lazy
/// loading (the driver's default since CUDA 12.2, which cuModuleGetLoadingMode reports) the
/// runtime loads a module at its first use, not at its first call.
fn run_device_array(program: &Path, tag: &str, run: &[&str]) -> (String, String) {
    let state = common::state_file(tag);
    let out = python::on_sim(program, run, "single", &state)
        .env("CUDA_MODULE_LOADING", "EAGER")
        .output()
        .expect("run device_array");
    python::remove_state(&state);
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    );
    assert!(out.status.success(), "{stdout}\n{stderr}");
    (stdout, stderr)
}

/// The answer of `step` in device_array's output.
fn step<'a>(out: &'a str, step: &str) -> &'a str {
    out.lines()
        .find_map(|l| l.strip_prefix(step).and_then(|r| r.strip_prefix(' ')))
        .unwrap_or_else(|| panic!("no {step} in {out}"))
}

/// An nvcc-built program's `__device__` array is device memory the driver takes when the
/// runtime loads the program's fat binary (libcudart 13.5: cuLibraryLoadData; older runtimes:
/// the driver's private CUDART_INTERFACE table), which no cudaMalloc shows. Under
/// `cuvisor run --memory 1Gi`, a 1.25 GiB array is refused: the runtime reports
/// cudaErrorMemoryAllocation (2) from its first call on, as it does for any failed module load;
/// a 64 MiB one runs and is shown taken. Plainly on the simulator, the 1.25 GiB one loads
/// (the simulated GPU has 16 GiB): the refusal is the quota's.
#[test]
fn an_nvcc_built_program_with_a_device_array_beyond_its_quota_gets_cuda_error_memory_allocation() {
    let test = "an_nvcc_built_program_with_a_device_array_beyond_its_quota_gets_cuda_error_memory_allocation";
    let (Some(small), Some(big)) = (device_array(test, 64 << 20), device_array(test, 1280 << 20))
    else {
        return;
    };
    let _one = serial();
    let quota = ["--memory", "1Gi"];

    let (out, _) = run_device_array(&small, "device-array-small", &quota);
    for s in [
        "cudaMemGetInfo",
        "cudaGetSymbolAddress",
        "launch",
        "cudaDeviceSynchronize",
    ] {
        assert_eq!(step(&out, s), "0 cudaSuccess", "{s}: {out}");
    }
    // The array and the program's other variables, each rounded up to the 512-byte unit.
    let free: u64 = step(&out, "free")
        .split(' ')
        .next()
        .and_then(|f| f.parse().ok())
        .unwrap_or_else(|| panic!("free: {out}"));
    let taken = (1u64 << 30) - free;
    assert!(
        (64 << 20..=(64 << 20) + 4096).contains(&taken),
        "the array is shown taken ({taken} bytes): {out}"
    );

    let (out, err) = run_device_array(&big, "device-array-big", &quota);
    for s in ["cudaMemGetInfo", "cudaGetSymbolAddress", "launch"] {
        assert_eq!(
            step(&out, s),
            "2 cudaErrorMemoryAllocation",
            "{s}: {out}\n{err}"
        );
    }
    assert!(
        err.lines()
            .any(|l| l.starts_with("cuvisor: cuLibraryLoadData of 1.25 GiB on GPU 0 refused")),
        "one line naming the load: {err}"
    );

    let (out, _) = run_device_array(&big, "device-array-plain", &[]);
    assert_eq!(step(&out, "cudaGetSymbolAddress"), "0 cudaSuccess", "{out}");
    let gpu = &Model::load("single").unwrap().devices[0];
    // The simulator loads a library into a context at its first use (as the real driver does
    // under lazy loading): taken by the end, beside the context's own memory.
    assert_eq!(
        step(&out, "free_after"),
        (gpu.memory - gpu.context_memory - (1280 << 20)).to_string(),
        "{out}"
    );
}
