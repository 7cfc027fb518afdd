//! `cuvisor sim job`: a data-parallel training job over several simulated GPUs.
//!
//! One process drives N GPUs, as `ncclCommInitAll` does: it loads `libcuda.so.1` by name (so
//! that the libcuvisor.so `cuvisor run` preloads wraps it), retains every GPU's primary context,
//! enables peer access between every pair `cuDeviceCanAccessPeer` allows (as NCCL's P2P
//! transport does), and allocates a gradient buffer on each. Then every step:
//!
//! 1. **compute**: a `sim_busy` kernel of the step's compute time on every GPU;
//! 2. **communication**: a ring all-reduce of the gradient by peer copies
//!    (`cuMemcpyPeerAsync`), as NCCL's ring algorithm runs it: the rings are the interconnect
//!    model's channels (`cuvisor_fabric::ring::rings` over the simulator's machine), each ring
//!    on a stream of its own on every GPU, its share of the buffer proportional to its
//!    bandwidth, split into k chunks; a reduce-scatter then an all-gather, k-1 steps each; every
//!    step's chunk goes in [`SLICES`] slices, and each GPU's copy of a slice to its successor
//!    waits (`cuStreamWaitEvent`) for the slice its predecessor sent it the step before;
//! 3. **idle**: a host pause (data loading), the kind's duty cycle.
//!
//! The reductions are not separate kernels: NCCL reduces inside its one copy kernel as the data
//! arrives (its ring primitives `recvReduceSend`/`recvReduceCopySend`), so a reduction costs no
//! time of its own beyond the transfer. No value is computed (the simulator's kernels run no
//! code).
//!
//! Times come from CUDA events, i.e. the simulator's timeline, not the host's clock: per step,
//! compute (from the step's start to the last GPU's kernel end), communication (from there to
//! the last ring's last copy), idle (the rest, to the next step's start). Bandwidths follow
//! nccl-tests (its doc/PERFORMANCE.md): algbw = bytes / time, busbw = algbw x 2(n-1)/n for
//! all-reduce. Beside them the model's figures (`ring::allreduce`), and the seeds' communication
//! efficiency and topology loss, measured and modelled.
//!
//! Events are timed against a start event of their own GPU (events of different devices are not
//! compared: the real driver does not promise a common clock for them); the GPUs' start events
//! are recorded back to back on idle streams, so they stand for one instant up to the host's
//! gap between two calls (microseconds).

use crate::args::{JobArgs, Target};
use crate::libcuda::{self, error_name, sym, types::*};
use crate::load::{parse_duration, show_ns};
use crate::machine;
use crate::{Failure, Result};
use cuvisor_cuda_abi::cuda::{
    err, CUcontext, CUdevice, CUdeviceptr, CUevent, CUfunction, CUmodule, CUresult, CUstream,
};
use cuvisor_fabric::ring;
use cuvisor_sim::model::{Device, Model};
use std::ffi::{c_int, c_uint, c_void};
use std::fmt::Write as _;
use std::io::Write as _;

/// Slices per chunk. NCCL's ring all-reduce moves a chunk of ALLREDUCE_CHUNKSTEPS = NCCL_STEPS/2
/// buffer steps in slices of ALLREDUCE_SLICESTEPS = NCCL_STEPS/4 (nccl src/include/collectives.h),
/// two slices per chunk: the first is forwarded while the second arrives. More slices would only
/// add per-copy latency here (every copy costs the route's start-up time) and host calls.
pub(crate) const SLICES: usize = 2;

/// Bounds on the flags, far from anything real and far from overflow.
const MAX_STEPS: u64 = 1_000_000;
const MAX_GRADIENT: u64 = 64 << 30;
const MIN_GRADIENT: u64 = 4 << 10;
const MAX_COMPUTE_NS: u64 = 60_000_000_000;
const MAX_PAUSE_NS: u64 = 3_600_000_000_000;
const MIN_SCALE: f64 = 1e-4;
const DEFAULT_STEPS: u64 = 10;
/// Shortest kernel after scaling.
const MIN_KERNEL_NS: u64 = 1_000;

/// CU_STREAM_NON_BLOCKING, CU_EVENT_DEFAULT, CU_EVENT_DISABLE_TIMING.
const STREAM_NON_BLOCKING: c_uint = 1;
const EVENT_TIMED: c_uint = 0;
const EVENT_DISABLE_TIMING: c_uint = 2;

const NEEDS_SIM: &str = "sim job needs the simulated GPUs";
const HOW: &str = "run it as `cuvisor run --sim PRESET [--state FILE] -- cuvisor sim job ...`, or \
                   with LD_LIBRARY_PATH naming the directory of the simulated libcuda.so.1";

// ---- the kinds ----------------------------------------------------------------------------------

/// A kind of job, after the seeds' chart (vision, NLP, scientific), with the public figures its
/// parameters come from (docs/multi-gpu-job.md has the table and the sources).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Kind {
    pub name: &'static str,
    /// The model it stands for.
    pub model: &'static str,
    pub params: u64,
    /// Bytes per gradient element all-reduced (4: fp32, 2: fp16/bf16).
    pub bytes_per_param: u64,
    /// Forward + backward of one step on one Tesla V100-SXM2 (the reference GPU), ns.
    pub v100_compute_ns: u64,
    /// The seeds' "exclusive GPU" utilization for this kind: the share of time a job alone keeps
    /// its GPU's kernels busy, which sets the host pause (data loading, duty cycle).
    pub exclusive_util: f64,
}

pub(crate) const KINDS: [Kind; 3] = [
    // ResNet-50 v1.5: 25,557,032 parameters (torchvision's resnet50); PyTorch AMP keeps fp32
    // gradients, which DDP all-reduces. NVIDIA DeepLearningExamples (PyTorch ResNet50 v1.5
    // README, "Training performance: NVIDIA DGX-1 16GB"): 1200 img/s on one V100, mixed
    // precision, batch 256 per GPU: 256 / 1200 = 213.3 ms per step.
    Kind {
        name: "vision",
        model: "ResNet-50",
        params: 25_557_032,
        bytes_per_param: 4,
        v100_compute_ns: 213_333_333,
        exclusive_util: 0.22,
    },
    // BERT-large: 340 M parameters (Devlin et al. 2018, Table: BERT-LARGE 340M). NVIDIA's BERT
    // pretraining all-reduces fp16 gradients (--allreduce_post_accumulation_fp16). Its README
    // ("Pre-training NVIDIA DGX-1 With 16G"): 919.04 sequences/s on 8 V100, batch 16 per GPU,
    // sequence 128, mixed precision: 16 / 114.88 = 139.3 ms per step.
    Kind {
        name: "nlp",
        model: "BERT-large",
        params: 340_000_000,
        bytes_per_param: 2,
        v100_compute_ns: 139_276_000,
        exclusive_util: 0.18,
    },
    // Mixed: between the two in bytes per compute (vision 0.48 MB/ms, nlp 4.9 MB/ms; this one
    // 1.5 MB/ms): a 100 M-parameter fp32 surrogate model (400 MB) at 270 ms per step on a V100.
    // A stand-in chosen to sit between the two, not a published measurement.
    Kind {
        name: "scientific",
        model: "100M-parameter surrogate (assumed)",
        params: 100_000_000,
        bytes_per_param: 4,
        v100_compute_ns: 270_000_000,
        exclusive_util: 0.25,
    },
];

pub(crate) fn kind(name: &str) -> Option<&'static Kind> {
    KINDS.iter().find(|k| k.name == name)
}

/// Dense FP16 tensor-core throughput of a simulated GPU, FLOP/s: SMs x clock x FLOPs per SM
/// per clock, by architecture (V100 sm_70: 8 tensor cores x 64 FMA = 1024; A100 sm_80: 2048;
/// A10/L40 sm_86/89: 1024; H100/H200 sm_90: 4096). At the boost clocks these give the
/// datasheets' figures: V100 SXM2 125 TFLOPS, A100 312, A10 125, H100/H200 SXM 989.
pub(crate) fn tensor_flops(d: &Device) -> f64 {
    let per_sm_clk = match d.cc {
        (8, 0) => 2048.0,
        (9, _) | (10, _) => 4096.0,
        _ => 1024.0,
    };
    d.sm_count as f64 * d.specs.clock_khz as f64 * 1e3 * per_sm_clk
}

/// The V100-SXM2 that the kinds' compute times are measured on: 80 SMs at 1530 MHz.
const V100_FLOPS: f64 = 80.0 * 1_530_000_000.0 * 1024.0;

/// The kind's compute time on `d`: the V100 figure scaled by tensor throughput. Real speed-ups
/// fall short of the throughput ratio (ResNet-50 on A100: 2470 / 1200 = 2.06x in the same
/// README, against 2.5x), so on newer GPUs the compute is a little short and the job a
/// little more communication-bound than measured ones.
pub(crate) fn compute_ns_on(k: &Kind, d: &Device) -> u64 {
    let f = tensor_flops(d);
    if f <= 0.0 {
        return k.v100_compute_ns;
    }
    (k.v100_compute_ns as f64 * V100_FLOPS / f).round() as u64
}

/// The host pause that makes a lone one-GPU job's kernels busy `util` of the time:
/// compute / (compute + pause) = util.
pub(crate) fn pause_for(compute_ns: u64, util: f64) -> u64 {
    (compute_ns as f64 * (1.0 - util) / util).round() as u64
}

// ---- the flags ----------------------------------------------------------------------------------

/// When the job stops.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stop {
    Steps(u64),
    Time(u64),
}

/// The flags, checked, before the machine is known.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Flags {
    pub kind: &'static Kind,
    pub gpus: Vec<usize>,
    pub stop: Stop,
    pub gradient: Option<u64>,
    pub compute_ns: Option<u64>,
    pub pause_ns: Option<u64>,
    pub scale: f64,
    pub json: bool,
}

/// "0,3", "0-3,6": distinct ordinals, in the order given.
pub(crate) fn parse_gpus(text: &str) -> std::result::Result<Vec<usize>, String> {
    let t = text.trim();
    if t.is_empty() {
        return Err("empty: name at least one GPU (0,3 or 0-3)".into());
    }
    let num = |s: &str| {
        s.trim()
            .parse::<usize>()
            .map_err(|_| format!("{:?} is not a GPU number", s.trim()))
    };
    let mut out: Vec<usize> = Vec::new();
    for part in t.split(',') {
        let ids = match part.split_once('-') {
            Some((a, b)) => {
                let (a, b) = (num(a)?, num(b)?);
                if a > b {
                    return Err(format!("range {}: its start is after its end", part.trim()));
                }
                if b - a >= cuvisor_fabric::MAX_GPUS {
                    return Err(format!(
                        "range {}: more than {} GPUs",
                        part.trim(),
                        cuvisor_fabric::MAX_GPUS
                    ));
                }
                (a..=b).collect()
            }
            None => vec![num(part)?],
        };
        for g in ids {
            if out.contains(&g) {
                return Err(format!("GPU {g} is listed twice"));
            }
            out.push(g);
        }
    }
    if out.len() > cuvisor_fabric::MAX_GPUS {
        return Err(format!("at most {} GPUs", cuvisor_fabric::MAX_GPUS));
    }
    Ok(out)
}

fn usage(flag: &str, text: &str, why: impl std::fmt::Display) -> Failure {
    let shown = if text.is_empty() || text.contains(char::is_whitespace) {
        format!("{text:?}")
    } else {
        text.to_string()
    };
    Failure::Usage(format!("{flag} {shown}: {why}"))
}

pub(crate) fn flags(a: &JobArgs) -> Result<Flags> {
    let kind = kind(a.kind.trim()).ok_or_else(|| {
        let names: Vec<&str> = KINDS.iter().map(|k| k.name).collect();
        usage(
            "--kind",
            &a.kind,
            format!("unknown kind (use {})", names.join(", ")),
        )
    })?;
    let gpus = parse_gpus(&a.gpus).map_err(|e| usage("--gpus", &a.gpus, e))?;
    let stop = match (&a.steps, &a.seconds) {
        (Some(s), _) => {
            let n: u64 = s
                .trim()
                .parse()
                .map_err(|_| usage("--steps", s, "not a whole number of steps"))?;
            if !(1..=MAX_STEPS).contains(&n) {
                return Err(usage("--steps", s, format!("between 1 and {MAX_STEPS}")));
            }
            Stop::Steps(n)
        }
        (None, Some(s)) => {
            let ns = parse_duration(s, Some(1e9)).map_err(|e| usage("--seconds", s, e))?;
            if ns == 0 {
                return Err(usage(
                    "--seconds",
                    s,
                    "the job runs for more than 0 seconds",
                ));
            }
            Stop::Time(ns)
        }
        (None, None) => Stop::Steps(DEFAULT_STEPS),
    };
    let gradient = match &a.gradient {
        Some(s) => {
            let b =
                cuvisor_shm::quantity::parse_quantity(s).map_err(|e| usage("--gradient", s, e))?;
            if !(MIN_GRADIENT..=MAX_GRADIENT).contains(&b) {
                return Err(usage("--gradient", s, "between 4Ki and 64Gi"));
            }
            Some(b)
        }
        None => None,
    };
    let compute_ns = match &a.compute {
        Some(s) => {
            let ns = parse_duration(s, None).map_err(|e| usage("--compute", s, e))?;
            if !(MIN_KERNEL_NS..=MAX_COMPUTE_NS).contains(&ns) {
                return Err(usage("--compute", s, "between 1us and 60s"));
            }
            Some(ns)
        }
        None => None,
    };
    let pause_ns = match &a.pause {
        Some(s) => {
            let ns = parse_duration(s, None).map_err(|e| usage("--pause", s, e))?;
            if ns > MAX_PAUSE_NS {
                return Err(usage("--pause", s, "at most 1 hour"));
            }
            Some(ns)
        }
        None => None,
    };
    let scale: f64 = a
        .scale
        .trim()
        .parse()
        .map_err(|_| usage("--scale", &a.scale, "not a number (0.05, 1)"))?;
    if !(scale.is_finite() && (MIN_SCALE..=1.0).contains(&scale)) {
        return Err(usage("--scale", &a.scale, "between 0.0001 and 1"));
    }
    Ok(Flags {
        kind,
        gpus,
        stop,
        gradient,
        compute_ns,
        pause_ns,
        scale,
        json: a.json,
    })
}

/// What the job runs, on a known machine.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Plan {
    pub gpus: Vec<usize>,
    /// Gradient bytes all-reduced per step (scaled; a multiple of 4).
    pub bytes: u64,
    pub compute_ns: u64,
    pub pause_ns: u64,
}

/// The flags on `model`: the GPUs exist, the defaults come from the kind and the first GPU,
/// everything scaled.
pub(crate) fn plan(f: &Flags, model: &Model) -> Result<Plan> {
    let n = model.devices.len();
    if let Some(&g) = f.gpus.iter().find(|&&g| g >= n) {
        return Err(Failure::Usage(format!(
            "--gpus: GPU {g} does not exist: the {} simulator has {n} GPU{} (0-{})",
            model.name,
            if n == 1 { "" } else { "s" },
            n - 1
        )));
    }
    let k = f.kind;
    let dev = &model.devices[f.gpus[0]];
    let compute = f.compute_ns.unwrap_or_else(|| compute_ns_on(k, dev));
    let pause = f
        .pause_ns
        .unwrap_or_else(|| pause_for(compute, k.exclusive_util));
    let bytes = f.gradient.unwrap_or(k.params * k.bytes_per_param);
    let scaled = |x: u64| (x as f64 * f.scale).round() as u64;
    Ok(Plan {
        gpus: f.gpus.clone(),
        bytes: (scaled(bytes).max(MIN_GRADIENT)).div_ceil(4) * 4,
        compute_ns: scaled(compute).max(MIN_KERNEL_NS),
        pause_ns: scaled(pause),
    })
}

// ---- the ring schedule (plain arithmetic, tested against a simulated all-reduce) ---------------

/// One ring of the job: its order (positions in the job's GPU list), its model bandwidth, and
/// its part of the buffer cut into k chunks (offset, length in bytes).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct RingPlan {
    pub order: Vec<usize>,
    pub gbps: f64,
    pub chunks: Vec<(u64, u64)>,
}

/// Cuts `bytes` (a multiple of 4) over `rings` (order as positions, bandwidth) in proportion to
/// their bandwidths, in 4-byte elements; each ring's part into `k` chunks.
pub(crate) fn plan_rings(rings: &[(Vec<usize>, f64)], bytes: u64, k: usize) -> Vec<RingPlan> {
    let elems = bytes / 4;
    let total: f64 = rings.iter().map(|r| r.1).sum();
    let mut out = Vec::new();
    let mut at = 0u64;
    for (i, (order, gbps)) in rings.iter().enumerate() {
        let share = if i + 1 == rings.len() {
            elems - at
        } else if total > 0.0 && total.is_finite() {
            ((elems as f64 * gbps / total).floor() as u64).min(elems - at)
        } else {
            elems / rings.len() as u64
        };
        let chunks = (0..k as u64)
            .map(|c| {
                let (a, b) = (share * c / k as u64, share * (c + 1) / k as u64);
                ((at + a) * 4, (b - a) * 4)
            })
            .collect();
        out.push(RingPlan {
            order: order.clone(),
            gbps: *gbps,
            chunks,
        });
        at += share;
    }
    out
}

/// The chunk the GPU at ring position `p` sends at step `t` (0..2(k-1)): a reduce-scatter
/// (t < k-1: chunk p-t, which its successor adds its own to), then an all-gather (chunk p+1-j
/// at its step j: the reduced chunk it owns, then the ones it received).
pub(crate) fn chunk_sent(p: usize, t: usize, k: usize) -> usize {
    if t + 1 < k {
        (p + k - t % k) % k
    } else {
        let j = t + 1 - k;
        (p + 1 + k - j % k) % k
    }
}

/// Slice `s` of `SLICES` of a chunk (offset, length).
pub(crate) fn slice(chunk: (u64, u64), s: usize) -> (u64, u64) {
    let elems = chunk.1 / 4;
    let (a, b) = (
        elems * s as u64 / SLICES as u64,
        elems * (s as u64 + 1) / SLICES as u64,
    );
    (chunk.0 + a * 4, (b - a) * 4)
}

// ---- the driver, through dlopen/dlsym ----------------------------------------------------------

/// The entry points `sim job` calls.
struct Driver {
    init: Init,
    device_get_count: DeviceGetCount,
    device_can_access_peer: DeviceCanAccessPeer,
    primary_ctx_retain: PrimaryCtxRetain,
    ctx_set_current: CtxSetCurrent,
    ctx_enable_peer_access: CtxEnablePeerAccess,
    mem_alloc: MemAlloc,
    module_load_data: ModuleLoadData,
    module_get_function: ModuleGetFunction,
    stream_create: StreamCreate,
    launch_kernel: LaunchKernel,
    event_create: EventCreate,
    event_record: EventRecord,
    event_synchronize: EventSynchronize,
    event_elapsed_time: EventElapsedTime,
    stream_wait_event: StreamWaitEvent,
    memcpy_peer_async: MemcpyPeerAsync,
}

/// `Ok` for CUDA_SUCCESS, else "sim job: CALL: NAME".
fn check(r: CUresult, call: &str) -> Result<()> {
    libcuda::check(r, "sim job", call)
}

impl Driver {
    fn load() -> Result<Driver> {
        let lib = libcuda::open(NEEDS_SIM, HOW)?;
        Ok(Driver {
            init: sym!(lib, c"cuInit", Init),
            device_get_count: sym!(lib, c"cuDeviceGetCount", DeviceGetCount),
            device_can_access_peer: sym!(lib, c"cuDeviceCanAccessPeer", DeviceCanAccessPeer),
            primary_ctx_retain: sym!(lib, c"cuDevicePrimaryCtxRetain", PrimaryCtxRetain),
            ctx_set_current: sym!(lib, c"cuCtxSetCurrent", CtxSetCurrent),
            ctx_enable_peer_access: sym!(lib, c"cuCtxEnablePeerAccess", CtxEnablePeerAccess),
            mem_alloc: sym!(lib, c"cuMemAlloc_v2", MemAlloc),
            module_load_data: sym!(lib, c"cuModuleLoadData", ModuleLoadData),
            module_get_function: sym!(lib, c"cuModuleGetFunction", ModuleGetFunction),
            stream_create: sym!(lib, c"cuStreamCreate", StreamCreate),
            launch_kernel: sym!(lib, c"cuLaunchKernel", LaunchKernel),
            event_create: sym!(lib, c"cuEventCreate", EventCreate),
            event_record: sym!(lib, c"cuEventRecord", EventRecord),
            event_synchronize: sym!(lib, c"cuEventSynchronize", EventSynchronize),
            event_elapsed_time: sym!(lib, c"cuEventElapsedTime", EventElapsedTime),
            stream_wait_event: sym!(lib, c"cuStreamWaitEvent", StreamWaitEvent),
            memcpy_peer_async: sym!(lib, c"cuMemcpyPeerAsync", MemcpyPeerAsync),
        })
    }

    // (Each call below passes the driver what cuda.h documents: valid out-pointers to locals,
    // handles the driver gave, sizes within the buffers it allocated.)

    fn set_current(&self, ctx: CUcontext) -> Result<()> {
        // SAFETY: see above.
        check(unsafe { (self.ctx_set_current)(ctx) }, "cuCtxSetCurrent")
    }

    fn stream(&self) -> Result<CUstream> {
        let mut s: CUstream = std::ptr::null_mut();
        // SAFETY: see above.
        let r = unsafe { (self.stream_create)(&mut s, STREAM_NON_BLOCKING) };
        check(r, "cuStreamCreate")?;
        Ok(s)
    }

    fn event(&self, flags: c_uint) -> Result<CUevent> {
        let mut e: CUevent = std::ptr::null_mut();
        check(
            // SAFETY: see above.
            unsafe { (self.event_create)(&mut e, flags) },
            "cuEventCreate",
        )?;
        Ok(e)
    }

    fn record(&self, e: CUevent, s: CUstream) -> Result<()> {
        // SAFETY: see above.
        check(unsafe { (self.event_record)(e, s) }, "cuEventRecord")
    }

    fn wait(&self, s: CUstream, e: CUevent) -> Result<()> {
        // SAFETY: see above.
        check(
            unsafe { (self.stream_wait_event)(s, e, 0) },
            "cuStreamWaitEvent",
        )
    }

    fn sync(&self, e: CUevent) -> Result<()> {
        // SAFETY: see above.
        check(unsafe { (self.event_synchronize)(e) }, "cuEventSynchronize")
    }

    /// ns from `a` to `b` (both completed, timed).
    fn elapsed_ns(&self, a: CUevent, b: CUevent) -> Result<u64> {
        let mut ms = 0f32;
        // SAFETY: see above.
        let r = unsafe { (self.event_elapsed_time)(&mut ms, a, b) };
        check(r, "cuEventElapsedTime")?;
        Ok((ms.max(0.0) as f64 * 1e6).round() as u64)
    }
}

/// One GPU of the job: its context, kernel, buffer and streams, and its events.
struct Gpu {
    /// The CUDA ordinal (the simulator's device index).
    ordinal: usize,
    ctx: CUcontext,
    function: CUfunction,
    /// The gradient, which the all-reduce's copies write.
    buffer: CUdeviceptr,
    /// What the copies read: a buffer of the gradient's size the job never writes (see
    /// `Job::issue`).
    send: CUdeviceptr,
    compute: CUstream,
    /// One stream per ring.
    rings: Vec<CUstream>,
    /// Timed: the step's start on this GPU (two, by step parity: the previous step's start is
    /// still needed to time its period), its kernel's end, each ring's end.
    start: [CUevent; 2],
    kernel_done: CUevent,
    ring_done: Vec<CUevent>,
    /// A stream that only waits (used on the first GPU), and on it (timed): when every GPU's
    /// kernel had ended (the all-reduce's start) and when every GPU's rings had (its end). Waiting on other devices' events and recording
    /// here keeps every elapsed time between events of one device: "cudaEventElapsedTime() will
    /// fail if the two input events are associated to different devices" (CUDA C++ Programming
    /// Guide, "Stream and Event Behavior").
    probe: CUstream,
    ar_start: CUevent,
    ar_end: CUevent,
    /// Timed, per ring, ring step and slice: recorded just before and just after that copy on
    /// the ring's stream (its successor waits for the second).
    copies: Vec<Vec<[(CUevent, CUevent); SLICES]>>,
}

// SAFETY: a Gpu is driver handles (context, function, streams, events) and device addresses,
// which the driver API takes from any thread: contexts are made current per thread
// (cuCtxSetCurrent), and streams and events of a context may be used by every thread of the
// process (CUDA C++ Programming Guide, "Multi-Device System" and "Streams": any host thread may
// issue into a stream). The job only shares them with the scoped launching threads of a step.
unsafe impl Send for Gpu {}
// SAFETY: as above; nothing in a Gpu is mutated after it is opened.
unsafe impl Sync for Gpu {}

impl Gpu {
    fn open(drv: &Driver, ordinal: usize, bytes: u64, rings: usize, k: usize) -> Result<Gpu> {
        let dev = ordinal as CUdevice;
        let mut ctx: CUcontext = std::ptr::null_mut();
        check(
            // SAFETY: see Driver.
            unsafe { (drv.primary_ctx_retain)(&mut ctx, dev) },
            &format!("cuDevicePrimaryCtxRetain({ordinal})"),
        )?;
        drv.set_current(ctx)?;
        let not_sim = |call: &str, r: CUresult| {
            Failure::Runtime(format!(
                "{NEEDS_SIM}, and this libcuda.so.1 is not the simulator ({call}: {}); {HOW}",
                error_name(r)
            ))
        };
        let mut module: CUmodule = std::ptr::null_mut();
        // SAFETY: see Driver; the image is a NUL-terminated string, which the simulator accepts
        // as a module (a real driver refuses it).
        let r = unsafe { (drv.module_load_data)(&mut module, c"image".as_ptr().cast()) };
        if r != err::SUCCESS {
            return Err(not_sim("cuModuleLoadData", r));
        }
        let mut function: CUfunction = std::ptr::null_mut();
        // SAFETY: see Driver.
        let r = unsafe { (drv.module_get_function)(&mut function, module, c"sim_busy".as_ptr()) };
        if r != err::SUCCESS {
            return Err(not_sim("cuModuleGetFunction(sim_busy)", r));
        }
        let mut buffer: CUdeviceptr = 0;
        check(
            // SAFETY: see Driver.
            unsafe { (drv.mem_alloc)(&mut buffer, bytes as usize) },
            &format!("cuMemAlloc({bytes} bytes on GPU {ordinal}, the gradient)"),
        )?;
        let mut send: CUdeviceptr = 0;
        check(
            // SAFETY: see Driver.
            unsafe { (drv.mem_alloc)(&mut send, bytes as usize) },
            &format!("cuMemAlloc({bytes} bytes on GPU {ordinal}, the send buffer)"),
        )?;
        let compute = drv.stream()?;
        let mut ring_streams = Vec::new();
        let mut ring_done = Vec::new();
        let mut copies = Vec::new();
        for _ in 0..rings {
            ring_streams.push(drv.stream()?);
            ring_done.push(drv.event(EVENT_DISABLE_TIMING)?);
            let mut steps = Vec::new();
            for _ in 0..2 * k.saturating_sub(1) {
                let mut per = [(std::ptr::null_mut(), std::ptr::null_mut()); SLICES];
                for e in per.iter_mut() {
                    *e = (drv.event(EVENT_TIMED)?, drv.event(EVENT_TIMED)?);
                }
                steps.push(per);
            }
            copies.push(steps);
        }
        Ok(Gpu {
            ordinal,
            ctx,
            function,
            buffer,
            send,
            compute,
            rings: ring_streams,
            start: [drv.event(EVENT_TIMED)?, drv.event(EVENT_TIMED)?],
            kernel_done: drv.event(EVENT_DISABLE_TIMING)?,
            ring_done,
            probe: drv.stream()?,
            ar_start: drv.event(EVENT_TIMED)?,
            ar_end: drv.event(EVENT_TIMED)?,
            copies,
        })
    }

    fn launch(&self, drv: &Driver, ns: u64) -> Result<()> {
        let mut param = ns;
        let mut params = [(&mut param as *mut u64).cast::<c_void>()];
        // SAFETY: the function and stream are the driver's; `params` holds one pointer to a u64,
        // sim_busy's one parameter, read during the call; no `extra`.
        let r = unsafe {
            (drv.launch_kernel)(
                self.function,
                1,
                1,
                1,
                32,
                1,
                1,
                0,
                self.compute,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        };
        check(r, "cuLaunchKernel")
    }
}

// ---- one step -----------------------------------------------------------------------------------

/// One step's times, ns, from the step's start.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct StepTimes {
    /// Until the last GPU's kernel ended (the all-reduce can start everywhere).
    pub compute: u64,
    /// The all-reduce: from there to the last ring's last copy.
    pub comm: u64,
    /// From the step's start to the next one's.
    pub period: u64,
    /// When the host had issued the step's last copy (late: the timeline waited for the host).
    pub issued: u64,
}

impl StepTimes {
    pub fn idle(&self) -> u64 {
        self.period.saturating_sub(self.compute + self.comm)
    }
    /// The host issued copies after the all-reduce could have started.
    pub fn host_bound(&self) -> bool {
        self.comm > 0 && self.issued > self.compute
    }
}

struct Job<'d> {
    drv: &'d Driver,
    gpus: Vec<Gpu>,
    rings: Vec<RingPlan>,
    /// An idle stream on the first GPU, and an event on it, to see when the host was done.
    marker: CUstream,
    issued: CUevent,
}

impl Job<'_> {
    /// Queues step `i`: kernels, then the ring all-reduce.
    ///
    /// Each copy goes from the sender's send buffer (never written) to the same place in its
    /// successor's gradient: the route, bytes and order of every copy are the ring's, and no
    /// value is computed anyway. A never-written source costs the simulator no memcpy (it reads
    /// as zeros: `copy::transfer`), where copies out of the written gradient would be moved by
    /// the issuing thread at a few GB/s, far slower than the links the timeline models, and the
    /// host, not the interconnect, would set the all-reduce's time.
    ///
    /// The kernels are launched from a thread per GPU, as a data-parallel framework has one per
    /// GPU: under a compute policy, libcuvisor.so may hold a launch back (its token bucket makes
    /// the launching thread sleep), and one thread launching for every GPU in turn would start
    /// each GPU's kernel after the previous GPU's wait.
    fn issue(&self, i: usize, compute_ns: u64) -> Result<()> {
        let d = self.drv;
        let launched: Vec<Result<()>> = std::thread::scope(|scope| {
            let threads: Vec<_> = self
                .gpus
                .iter()
                .map(|g| {
                    scope.spawn(move || -> Result<()> {
                        d.set_current(g.ctx)?;
                        d.record(g.start[i % 2], g.compute)?;
                        g.launch(d, compute_ns)?;
                        d.record(g.kernel_done, g.compute)
                    })
                })
                .collect();
            threads
                .into_iter()
                .map(|t| {
                    t.join().unwrap_or_else(|_| {
                        Err(Failure::Runtime(
                            "sim job: a launching thread panicked".into(),
                        ))
                    })
                })
                .collect()
        });
        launched.into_iter().collect::<Result<()>>()?;
        // A GPU's rings start when every GPU's kernel has ended, as a collective starts when
        // every rank has joined it. (NCCL's first slices may go into a late receiver's buffer
        // before it joins; waiting for all keeps GPUs whose kernels the host launched a little
        // later from putting the early ones' copies behind theirs on a shared link.)
        for g in &self.gpus {
            d.set_current(g.ctx)?;
            for &s in &g.rings {
                for h in &self.gpus {
                    d.wait(s, h.kernel_done)?;
                }
            }
        }
        let k = self.gpus.len();
        if k > 1 {
            for t in 0..2 * (k - 1) {
                for (r, ring) in self.rings.iter().enumerate() {
                    for (p, &me) in ring.order.iter().enumerate() {
                        let succ = ring.order[(p + 1) % k];
                        let pred = ring.order[(p + k - 1) % k];
                        let (from, to) = (&self.gpus[me], &self.gpus[succ]);
                        d.set_current(from.ctx)?;
                        let chunk = ring.chunks[chunk_sent(p, t, k)];
                        for s in 0..SLICES {
                            if t > 0 {
                                d.wait(from.rings[r], self.gpus[pred].copies[r][t - 1][s].1)?;
                            }
                            d.record(from.copies[r][t][s].0, from.rings[r])?;
                            let (off, len) = slice(chunk, s);
                            if len > 0 {
                                check(
                                    // SAFETY: both buffers are of the gradient's size; `off + len`
                                    // lies within it; contexts and stream are the driver's.
                                    unsafe {
                                        (d.memcpy_peer_async)(
                                            to.buffer + off,
                                            to.ctx,
                                            from.send + off,
                                            from.ctx,
                                            len as usize,
                                            from.rings[r],
                                        )
                                    },
                                    "cuMemcpyPeerAsync",
                                )?;
                            }
                            d.record(from.copies[r][t][s].1, from.rings[r])?;
                        }
                    }
                }
            }
        }
        for g in &self.gpus {
            d.set_current(g.ctx)?;
            for (r, &s) in g.rings.iter().enumerate() {
                d.record(g.ring_done[r], s)?;
            }
        }
        let first = &self.gpus[0];
        d.set_current(first.ctx)?;
        for h in &self.gpus {
            d.wait(first.probe, h.kernel_done)?;
        }
        d.record(first.ar_start, first.probe)?;
        for h in &self.gpus {
            for &e in &h.ring_done {
                d.wait(first.probe, e)?;
            }
        }
        d.record(first.ar_end, first.probe)?;
        d.record(self.issued, self.marker)
    }

    /// Waits for step `i`'s work; its times (the period is filled in by the next step), and for
    /// each GPU the bytes it sent and the time it spent sending them.
    fn measure(&self, i: usize) -> Result<(StepTimes, Vec<(u64, u64)>)> {
        let d = self.drv;
        let first = &self.gpus[0];
        d.sync(first.ar_end)?;
        let mut t = StepTimes {
            compute: d.elapsed_ns(first.start[i % 2], first.ar_start)?,
            comm: d.elapsed_ns(first.ar_start, first.ar_end)?,
            ..StepTimes::default()
        };
        d.sync(self.issued)?;
        t.issued = d.elapsed_ns(first.start[i % 2], self.issued)?;
        // Each GPU's sending: its copies' bytes, and the time at least one of them was under way
        // (the union of their [before, after] spans, on its own device's clock). A GPU sends on
        // all its rings at once, so its rate is what all of them move together, as the model's
        // efficiency counts it (`AllReduce::efficiency_gbps`); the time it waits for its
        // predecessor's data is not sending.
        let k = self.gpus.len();
        let mut sends = Vec::new();
        for (me, g) in self.gpus.iter().enumerate() {
            let mut spans = Vec::new();
            let mut bytes = 0;
            for (r, ring) in self.rings.iter().enumerate() {
                let Some(p) = ring.order.iter().position(|&x| x == me) else {
                    continue;
                };
                for t in 0..2 * k.saturating_sub(1) {
                    let chunk = ring.chunks[chunk_sent(p, t, k)];
                    for s in 0..SLICES {
                        let (before, after) = g.copies[r][t][s];
                        d.sync(after)?;
                        let a = d.elapsed_ns(g.start[i % 2], before)?;
                        let b = d.elapsed_ns(g.start[i % 2], after)?;
                        spans.push((a, b.max(a)));
                        bytes += slice(chunk, s).1;
                    }
                }
            }
            sends.push((bytes, union_ns(&mut spans)));
        }
        Ok((t, sends))
    }

    /// Step `i`'s period: from its start to step i+1's (already recorded), on the first GPU.
    fn period(&self, i: usize) -> Result<u64> {
        let g = &self.gpus[0];
        self.drv.sync(g.start[(i + 1) % 2])?;
        self.drv.elapsed_ns(g.start[i % 2], g.start[(i + 1) % 2])
    }
}

// ---- the report ---------------------------------------------------------------------------------

/// What the model says of the job's group.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Modelled {
    pub busbw_gbps: f64,
    pub time_ns: u64,
    pub efficiency_gbps: f64,
    /// The best group of this size on the machine and its efficiency.
    pub best_group: Vec<usize>,
    pub best_efficiency_gbps: f64,
}

/// The best group of `k` GPUs of the machine by the model's all-reduce efficiency (brute force
/// over every group of that size: C(8,4) = 70 on an 8-GPU box).
pub(crate) fn best_group(f: &cuvisor_fabric::Fabric, k: usize) -> (Vec<usize>, f64) {
    let n = f.len();
    let mut best = (Vec::new(), -1.0);
    let mut group: Vec<usize> = (0..k).collect();
    if k == 0 || k > n {
        return (Vec::new(), 0.0);
    }
    loop {
        let e = ring::allreduce(f, &group).efficiency_gbps();
        if e > best.1 + 1e-9 {
            best = (group.clone(), e);
        }
        // Next combination in lexicographic order.
        let Some(i) = (0..k).rev().find(|&i| group[i] < n - k + i) else {
            break;
        };
        group[i] += 1;
        for j in i + 1..k {
            group[j] = group[j - 1] + 1;
        }
    }
    best
}

/// The length of the union of `spans` (start, end), ns.
pub(crate) fn union_ns(spans: &mut [(u64, u64)]) -> u64 {
    spans.sort_unstable();
    let mut total = 0;
    let mut reach = 0;
    for &(a, b) in spans.iter() {
        let a = a.max(reach);
        if b > a {
            total += b - a;
            reach = b;
        }
    }
    total
}

/// nccl-tests' busbw for all-reduce: algbw x 2(n-1)/n.
pub(crate) fn busbw(algbw: f64, n: usize) -> f64 {
    if n < 2 {
        return 0.0;
    }
    algbw * 2.0 * (n - 1) as f64 / n as f64
}

fn gbps(bytes: u64, ns: u64) -> f64 {
    if ns == 0 {
        0.0
    } else {
        bytes as f64 / ns as f64
    }
}

fn ms(ns: u64) -> f64 {
    ns as f64 / 1e6
}

fn pct(part: u64, whole: u64) -> f64 {
    if whole == 0 {
        0.0
    } else {
        part as f64 * 100.0 / whole as f64
    }
}

/// A JSON number (finite; else 0).
fn num(x: f64) -> String {
    if x.is_finite() {
        format!("{}", (x * 1e4).round() / 1e4)
    } else {
        "0".into()
    }
}

fn list(v: &[usize]) -> String {
    v.iter().map(usize::to_string).collect::<Vec<_>>().join(",")
}

/// A line on stdout; a closed stdout is not worth a panic.
fn say(text: &str) {
    let _ = std::io::stdout().write_all(text.as_bytes());
}

pub fn run(target: &Target, args: &JobArgs) -> Result<u8> {
    let flags = flags(args)?;
    let model = machine::sim_model(target)?;
    let plan = plan(&flags, &model)?;
    if let Some(spec) = &target.sim {
        // The simulated driver reads these; the process is still single-threaded here.
        std::env::set_var("CUVISOR_SIM", spec);
    }
    if let Some(s) = &target.state {
        std::env::set_var("CUVISOR_SIM_STATE", s);
    }
    let fabric = model.fabric();
    let k = plan.gpus.len();
    let modelled_rings = ring::rings(&fabric, &plan.gpus);
    let ar = ring::allreduce(&fabric, &plan.gpus);
    let (best, best_eff) = best_group(&fabric, k);
    let modelled = Modelled {
        busbw_gbps: if k > 1 { ar.busbw_gbps } else { 0.0 },
        time_ns: ar.time_ns(plan.bytes),
        efficiency_gbps: ar.efficiency_gbps(),
        best_group: best,
        best_efficiency_gbps: best_eff.max(0.0),
    };
    // Ring orders as positions in the job's GPU list.
    let pos = |g: usize| plan.gpus.iter().position(|&x| x == g).unwrap_or(0);
    let ring_specs: Vec<(Vec<usize>, f64)> = modelled_rings
        .iter()
        .map(|r| (r.order.iter().map(|&g| pos(g)).collect(), r.gbps))
        .collect();
    let rings = plan_rings(&ring_specs, plan.bytes, k);

    let drv = Driver::load()?;
    // SAFETY: see Driver.
    let r = unsafe { (drv.init)(0) };
    if r != err::SUCCESS {
        return Err(Failure::Runtime(format!(
            "{NEEDS_SIM}, and cuInit failed: {}; {HOW}",
            error_name(r)
        )));
    }
    let mut count: c_int = 0;
    check(
        // SAFETY: see Driver.
        unsafe { (drv.device_get_count)(&mut count) },
        "cuDeviceGetCount",
    )?;
    if let Some(&g) = plan.gpus.iter().find(|&&g| g >= count.max(0) as usize) {
        return Err(Failure::Usage(format!(
            "--gpus: GPU {g} is not visible to this process (the driver shows {count})"
        )));
    }
    let mut gpus = Vec::new();
    for &g in &plan.gpus {
        gpus.push(Gpu::open(&drv, g, plan.bytes, rings.len(), k)?);
    }
    // Peer access between every pair the driver allows, both ways, as NCCL's P2P transport
    // enables it (cudaDeviceEnablePeerAccess after cudaDeviceCanAccessPeer).
    let mut peers = 0;
    for a in &gpus {
        for b in &gpus {
            if a.ordinal == b.ordinal {
                continue;
            }
            let mut can: c_int = 0;
            check(
                // SAFETY: see Driver.
                unsafe {
                    (drv.device_can_access_peer)(
                        &mut can,
                        a.ordinal as CUdevice,
                        b.ordinal as CUdevice,
                    )
                },
                "cuDeviceCanAccessPeer",
            )?;
            if can == 1 {
                drv.set_current(a.ctx)?;
                check(
                    // SAFETY: see Driver.
                    unsafe { (drv.ctx_enable_peer_access)(b.ctx, 0) },
                    "cuCtxEnablePeerAccess",
                )?;
                peers += 1;
            }
        }
    }
    drv.set_current(gpus[0].ctx)?;
    let job = Job {
        drv: &drv,
        marker: drv.stream()?,
        issued: drv.event(EVENT_TIMED)?,
        gpus,
        rings,
    };

    let kind = flags.kind;
    if !flags.json {
        let mut head = String::new();
        let _ = writeln!(
            head,
            "sim job: {} ({}, gradient {} bytes), {} per step, pause {}, on GPUs {} of the {} \
             simulator (scale {})",
            kind.name,
            kind.model,
            plan.bytes,
            show_ns(plan.compute_ns),
            show_ns(plan.pause_ns),
            list(&plan.gpus),
            model.name,
            flags.scale
        );
        let _ = writeln!(
            head,
            "  peer access enabled on {peers} of {} ordered pairs; {} ring(s), {} slices per chunk:",
            k * (k - 1),
            job.rings.len(),
            SLICES
        );
        for r in &modelled_rings {
            let _ = writeln!(
                head,
                "    ring {}  {:.1} GB/s (model)",
                list(&r.order),
                r.gbps
            );
        }
        let _ = writeln!(
            head,
            "  step   time ms  compute ms  comm ms  idle ms   algbw GB/s  busbw GB/s"
        );
        say(&head);
    }

    // A warm-up step, not reported (as nccl-tests runs warm-up iterations): its copies touch
    // the buffers' pages for the first time.
    job.issue(0, plan.compute_ns)?;
    job.measure(0)?;
    std::thread::sleep(std::time::Duration::from_nanos(plan.pause_ns));

    // Steps 1..: step i's period is known once step i+1 has started.
    let mut steps: Vec<StepTimes> = Vec::new();
    let mut sends_total = vec![(0u64, 0u64); k];
    let started = std::time::Instant::now();
    loop {
        let i = steps.len() + 1;
        job.issue(i, plan.compute_ns)?;
        if let Some(prev) = steps.last_mut() {
            prev.period = job.period(i - 1)?;
            if !flags.json {
                say(&step_line(i - 1, prev, plan.bytes, k));
            }
        }
        let (t, sends) = job.measure(i)?;
        for (a, s) in sends_total.iter_mut().zip(&sends) {
            a.0 += s.0;
            a.1 += s.1;
        }
        steps.push(t);
        std::thread::sleep(std::time::Duration::from_nanos(plan.pause_ns));
        let done = match flags.stop {
            Stop::Steps(n) => steps.len() as u64 >= n,
            Stop::Time(ns) => started.elapsed().as_nanos() as u64 >= ns,
        };
        if done {
            break;
        }
    }
    // The last step's period: to a start marker recorded now, after its pause.
    {
        let i = steps.len();
        let g = &job.gpus[0];
        drv.set_current(g.ctx)?;
        drv.record(g.start[(i + 1) % 2], g.compute)?;
        if let Some(last) = steps.last_mut() {
            last.period = job.period(i)?;
            if !flags.json {
                say(&step_line(i, last, plan.bytes, k));
            }
        }
    }

    let n = steps.len() as u64;
    let avg = |f: fn(&StepTimes) -> u64| steps.iter().map(f).sum::<u64>() / n.max(1);
    let mean = StepTimes {
        compute: avg(|s| s.compute),
        comm: avg(|s| s.comm),
        period: avg(|s| s.period),
        issued: avg(|s| s.issued),
    };
    let host_bound = steps.iter().filter(|s| s.host_bound()).count();
    let algbw = gbps(plan.bytes, mean.comm);
    let measured_busbw = busbw(algbw, k);
    // The seeds' efficiency over what each GPU sent, at the rate it sent it.
    let measured_eff = if k > 1 {
        ring::efficiency(sends_total.iter().map(|&(b, t)| (b, gbps(b, t))))
    } else {
        0.0
    };
    let loss_measured = ring::topology_loss(measured_eff, modelled.best_efficiency_gbps);
    let loss_model = ring::topology_loss(modelled.efficiency_gbps, modelled.best_efficiency_gbps);

    if flags.json {
        let mut o = String::from("{");
        let _ = write!(
            o,
            "\"kind\":\"{}\",\"network\":\"{}\",\"machine\":\"{}\",\"gpus\":[{}],\"scale\":{},\
             \"gradient_bytes\":{},\"compute_ns\":{},\"pause_ns\":{},\"steps\":{},\"slices\":{},",
            kind.name,
            kind.model,
            model.name,
            list(&plan.gpus),
            num(flags.scale),
            plan.bytes,
            plan.compute_ns,
            plan.pause_ns,
            n,
            SLICES
        );
        let rings_json: Vec<String> = modelled_rings
            .iter()
            .map(|r| {
                format!(
                    "{{\"order\":[{}],\"gbps\":{}}}",
                    list(&r.order),
                    num(r.gbps)
                )
            })
            .collect();
        let _ = write!(o, "\"rings\":[{}],", rings_json.join(","));
        let steps_json: Vec<String> = steps
            .iter()
            .map(|s| {
                format!(
                    "{{\"step_ns\":{},\"compute_ns\":{},\"comm_ns\":{},\"idle_ns\":{},\"issued_ns\":{},\"host_bound\":{}}}",
                    s.period,
                    s.compute,
                    s.comm,
                    s.idle(),
                    s.issued,
                    s.host_bound()
                )
            })
            .collect();
        let _ = write!(o, "\"per_step\":[{}],", steps_json.join(","));
        let _ = write!(
            o,
            "\"average\":{{\"step_ns\":{},\"compute_ns\":{},\"comm_ns\":{},\"idle_ns\":{},\
             \"compute_pct\":{},\"comm_pct\":{},\"idle_pct\":{}}},",
            mean.period,
            mean.compute,
            mean.comm,
            mean.idle(),
            num(pct(mean.compute, mean.period)),
            num(pct(mean.comm, mean.period)),
            num(pct(mean.idle(), mean.period))
        );
        let _ = write!(
            o,
            "\"measured\":{{\"allreduce_ns\":{},\"algbw_gbps\":{},\"busbw_gbps\":{},\
             \"efficiency_gbps\":{},\"topology_loss\":{}}},",
            mean.comm,
            num(algbw),
            num(measured_busbw),
            num(measured_eff),
            num(loss_measured)
        );
        let _ = write!(
            o,
            "\"model\":{{\"allreduce_ns\":{},\"busbw_gbps\":{},\"efficiency_gbps\":{},\
             \"topology_loss\":{},\"best_group\":[{}],\"best_efficiency_gbps\":{}}},",
            modelled.time_ns,
            num(modelled.busbw_gbps),
            num(modelled.efficiency_gbps),
            num(loss_model),
            list(&modelled.best_group),
            num(modelled.best_efficiency_gbps)
        );
        let _ = writeln!(o, "\"host_bound_steps\":{host_bound}}}");
        say(&o);
    } else {
        let mut t = String::new();
        let _ = writeln!(
            t,
            "  average over {n} step(s): {:.3} ms = compute {:.3} ms ({:.1} %) + communication \
             {:.3} ms ({:.1} %) + idle {:.3} ms ({:.1} %)",
            ms(mean.period),
            ms(mean.compute),
            pct(mean.compute, mean.period),
            ms(mean.comm),
            pct(mean.comm, mean.period),
            ms(mean.idle()),
            pct(mean.idle(), mean.period)
        );
        if k > 1 {
            let _ = writeln!(
                t,
                "  all-reduce of {} bytes: measured {:.3} ms, algbw {:.1} GB/s, busbw {:.1} GB/s; \
                 model {:.3} ms, busbw {:.1} GB/s",
                plan.bytes,
                ms(mean.comm),
                algbw,
                measured_busbw,
                ms(modelled.time_ns),
                modelled.busbw_gbps
            );
            let _ = writeln!(
                t,
                "  communication efficiency: measured {:.1} GB/s, model {:.1} GB/s; topology loss \
                 against the best {k}-GPU group ({}: {:.1} GB/s): measured {:.1} %, model {:.1} %",
                measured_eff,
                modelled.efficiency_gbps,
                list(&modelled.best_group),
                modelled.best_efficiency_gbps,
                loss_measured * 100.0,
                loss_model * 100.0
            );
        }
        say(&t);
    }
    if host_bound > 0 {
        eprintln!(
            "sim job: warning: in {host_bound} of {n} step(s) the host was still issuing the \
             all-reduce's copies when it could start (a step is 2(k-1) x rings x {SLICES} copies \
             per GPU, each a few driver calls), so its measured time includes the host's; give \
             the kernels more time to cover that: a longer --compute or a larger --scale"
        );
    }
    Ok(0)
}

fn step_line(i: usize, s: &StepTimes, bytes: u64, k: usize) -> String {
    let algbw = gbps(bytes, s.comm);
    format!(
        "  {i:>4}  {:>8.3}  {:>10.3}  {:>7.3}  {:>7.3}  {:>11.1}  {:>10.1}{}\n",
        ms(s.period),
        ms(s.compute),
        ms(s.comm),
        ms(s.idle()),
        if k > 1 { algbw } else { 0.0 },
        busbw(algbw, k),
        if s.host_bound() { "  (host-bound)" } else { "" }
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(kind: &str, gpus: &str) -> JobArgs {
        JobArgs {
            kind: kind.into(),
            gpus: gpus.into(),
            steps: None,
            seconds: None,
            gradient: None,
            compute: None,
            pause: None,
            scale: "1".into(),
            json: false,
        }
    }

    fn refused(a: &JobArgs) -> String {
        match flags(a) {
            Err(Failure::Usage(m)) => m,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn gpu_lists_read_as_people_write_them() {
        assert_eq!(parse_gpus("0,3"), Ok(vec![0, 3]));
        assert_eq!(parse_gpus(" 0-3, 6 "), Ok(vec![0, 1, 2, 3, 6]));
        assert_eq!(parse_gpus("5"), Ok(vec![5]));
        for (text, why) in [
            ("", "empty"),
            ("0,0", "GPU 0 is listed twice"),
            ("0-3,2", "GPU 2 is listed twice"),
            ("x", "not a GPU number"),
            ("3-1", "start is after its end"),
            ("0,,1", "not a GPU number"),
            ("0-99", "more than 16 GPUs"),
        ] {
            let e = parse_gpus(text).unwrap_err();
            assert!(e.contains(why), "{text:?}: {e}");
        }
    }

    #[test]
    fn bad_flags_are_refused_with_their_name() {
        let mut a = args("audio", "0,1");
        assert!(refused(&a).starts_with("--kind audio: unknown kind"));
        a = args("nlp", "");
        assert!(refused(&a).starts_with("--gpus \"\": empty"));
        a = args("nlp", "0,1");
        a.steps = Some("0".into());
        assert!(refused(&a).starts_with("--steps 0: between 1"));
        a.steps = None;
        a.gradient = Some("100Ti".into());
        assert!(refused(&a).starts_with("--gradient 100Ti: between"));
        a.gradient = Some("-1".into());
        assert!(refused(&a).starts_with("--gradient -1:"));
        a.gradient = None;
        a.compute = Some("2h".into());
        assert!(refused(&a).starts_with("--compute 2h: unknown unit"));
        a.compute = Some("61s".into());
        assert!(refused(&a).starts_with("--compute 61s: between"));
        a.compute = None;
        a.scale = "0".into();
        assert!(refused(&a).starts_with("--scale 0: between"));
        a.scale = "NaN".into();
        assert!(refused(&a).starts_with("--scale NaN: between"));
        a.scale = "2".into();
        assert!(refused(&a).starts_with("--scale 2: between"));
        a.scale = "1".into();
        a.seconds = Some("0".into());
        assert!(refused(&a).starts_with("--seconds 0:"));
    }

    #[test]
    fn the_kinds_duty_cycle_gives_the_seeds_exclusive_utilization() {
        let v100 = cuvisor_sim::model::preset("dgx1-v100").unwrap();
        for k in &KINDS {
            let c = compute_ns_on(k, &v100.devices[0]);
            assert!(
                (c as f64 / k.v100_compute_ns as f64 - 1.0).abs() < 1e-3,
                "{}",
                k.name
            );
            let p = pause_for(c, k.exclusive_util);
            let util = c as f64 / (c + p) as f64;
            assert!((util - k.exclusive_util).abs() < 1e-6, "{}: {util}", k.name);
        }
        // An A100 computes 2.5x as fast (312 / 125 dense FP16 TFLOPS).
        let a100 = cuvisor_sim::model::preset("dgx-a100").unwrap();
        let r = tensor_flops(&a100.devices[0]) / tensor_flops(&v100.devices[0]);
        assert!((r - 2.49).abs() < 0.02, "{r}");
    }

    #[test]
    fn a_plan_scales_times_and_bytes_together_and_knows_the_machine() {
        let m = cuvisor_sim::model::preset("dgx1-v100").unwrap();
        let mut a = args("nlp", "0,3");
        let full = plan(&flags(&a).unwrap(), &m).unwrap();
        assert_eq!(full.bytes, 680_000_000);
        a.scale = "0.01".into();
        let small = plan(&flags(&a).unwrap(), &m).unwrap();
        assert_eq!(small.bytes, 6_800_000);
        assert_eq!(
            small.compute_ns,
            (full.compute_ns as f64 / 100.0).round() as u64
        );
        assert_eq!(
            small.pause_ns,
            (full.pause_ns as f64 / 100.0).round() as u64
        );
        let a = args("nlp", "0,8");
        match plan(&flags(&a).unwrap(), &m) {
            Err(Failure::Usage(e)) => assert!(e.contains("GPU 8 does not exist"), "{e}"),
            other => panic!("{other:?}"),
        }
    }

    /// The schedule, run on numbers: every GPU starts with its own values, sends are applied
    /// step by step as the copies would be (reduce-scatter adds, all-gather overwrites), and at
    /// the end every GPU holds the sum everywhere: the schedule is an all-reduce.
    #[test]
    fn the_ring_schedule_is_an_all_reduce() {
        for k in 2..=8usize {
            let rings = vec![
                ((0..k).collect::<Vec<_>>(), 30.0),
                ((0..k).rev().collect::<Vec<_>>(), 10.0),
            ];
            let bytes = 4 * 1000;
            let plans = plan_rings(&rings, bytes, k);
            let elems = (bytes / 4) as usize;
            // Every element belongs to exactly one chunk of one ring.
            let mut owner = vec![0; elems];
            for r in &plans {
                for &(off, len) in &r.chunks {
                    for e in off / 4..(off + len) / 4 {
                        owner[e as usize] += 1;
                    }
                }
            }
            assert!(owner.iter().all(|&c| c == 1), "k={k}");
            let mut data: Vec<Vec<u64>> = (0..k).map(|g| vec![1u64 << g; elems]).collect();
            for r in &plans {
                for t in 0..2 * (k - 1) {
                    let before = data.clone();
                    for (p, &me) in r.order.iter().enumerate() {
                        let succ = r.order[(p + 1) % k];
                        let chunk = r.chunks[chunk_sent(p, t, k)];
                        for s in 0..SLICES {
                            let (off, len) = slice(chunk, s);
                            for e in off / 4..(off + len) / 4 {
                                let e = e as usize;
                                data[succ][e] = if t + 1 < k {
                                    before[succ][e] + before[me][e]
                                } else {
                                    before[me][e]
                                };
                            }
                        }
                    }
                }
            }
            let all = (1u64 << k) - 1;
            for (g, d) in data.iter().enumerate() {
                assert!(d.iter().all(|&x| x == all), "k={k} GPU {g}");
            }
        }
    }

    #[test]
    fn a_gpus_send_time_counts_overlapping_copies_once() {
        assert_eq!(union_ns(&mut [(0, 10), (5, 15), (20, 30)]), 25);
        assert_eq!(union_ns(&mut [(20, 30), (0, 100)]), 100);
        assert_eq!(union_ns(&mut []), 0);
        assert_eq!(union_ns(&mut [(7, 7)]), 0);
    }

    #[test]
    fn rings_share_the_buffer_by_bandwidth() {
        let p = plan_rings(&[(vec![0, 1], 75.0), (vec![1, 0], 25.0)], 4000, 2);
        let len = |r: &RingPlan| r.chunks.iter().map(|c| c.1).sum::<u64>();
        assert_eq!((len(&p[0]), len(&p[1])), (3000, 1000));
        assert_eq!(p[1].chunks[0].0, 3000);
    }

    #[test]
    fn the_best_pair_on_a_dgx1_is_one_with_two_nvlinks() {
        let f = cuvisor_sim::model::preset("dgx1-v100").unwrap().fabric();
        let (g, e) = best_group(&f, 2);
        // Two GPUs joined by 2 NVLinks: 50 GB/s.
        assert!((e - 50.0).abs() < 1e-6, "{g:?} {e}");
        assert_eq!(f.direct_links(g[0], g[1]), 2);
        assert!((busbw(10.0, 8) - 17.5).abs() < 1e-9);
    }
}
