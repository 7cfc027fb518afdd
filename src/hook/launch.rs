//! Work submission: every path that starts work on a GPU draws from the container's compute
//! bucket (`timeslice`) before it reaches the driver: kernel launches (plain, Ex, cooperative,
//! each with its per-thread-stream variant) and graph launches. Forwarded untouched when no
//! compute policy is configured.
//!
//! Measurement: a sampled launch is bracketed by two events on its stream; the pair is read back
//! (cuEventQuery, then cuEventElapsedTime) on a later sampled launch or while a thread waits for
//! tokens, and the elapsed time goes to `timeslice` as the launch's run time.

use super::{hooks, Lib, Real};
use crate::timeslice::{estimate::Entry, fast_ns, now_ns, Compute, Gpu, Ticket};
use cuvisor_cuda_abi::cuda::*;
use std::ffi::{c_int, c_uint, c_void};
use std::sync::atomic::{AtomicI32, AtomicU32, AtomicU64, AtomicUsize, Ordering::*};

hooks! {
    Cuda cuLaunchKernel(f: CUfunction, gx: c_uint, gy: c_uint, gz: c_uint, bx: c_uint, by: c_uint, bz: c_uint, smem: c_uint, stream: CUstream, params: *mut *mut c_void, extra: *mut *mut c_void) => launch::<false>;
    Cuda cuLaunchKernel_ptsz(f: CUfunction, gx: c_uint, gy: c_uint, gz: c_uint, bx: c_uint, by: c_uint, bz: c_uint, smem: c_uint, stream: CUstream, params: *mut *mut c_void, extra: *mut *mut c_void) => launch::<true>;
    Cuda cuLaunchKernelEx(cfg: *const CUlaunchConfig, f: CUfunction, params: *mut *mut c_void, extra: *mut *mut c_void) => launch_ex::<false>;
    Cuda cuLaunchKernelEx_ptsz(cfg: *const CUlaunchConfig, f: CUfunction, params: *mut *mut c_void, extra: *mut *mut c_void) => launch_ex::<true>;
    Cuda cuLaunchCooperativeKernel(f: CUfunction, gx: c_uint, gy: c_uint, gz: c_uint, bx: c_uint, by: c_uint, bz: c_uint, smem: c_uint, stream: CUstream, params: *mut *mut c_void) => cooperative::<false>;
    Cuda cuLaunchCooperativeKernel_ptsz(f: CUfunction, gx: c_uint, gy: c_uint, gz: c_uint, bx: c_uint, by: c_uint, bz: c_uint, smem: c_uint, stream: CUstream, params: *mut *mut c_void) => cooperative::<true>;
    Cuda cuGraphLaunch(exec: CUgraphExec, stream: CUstream) => graph_launch::<false>;
    Cuda cuGraphLaunch_ptsz(exec: CUgraphExec, stream: CUstream) => graph_launch::<true>;
}

// Each entry point and its `_ptsz` form share one body: PTSZ says whether a NULL stream means
// the per-thread default stream (the `_ptsz` ABI) rather than the legacy one.

/// Graph execs and functions are both pointers (handles, in the simulator small integers):
/// keep their estimates apart.
const GRAPH_KEY: u64 = 1 << 63;

#[allow(clippy::too_many_arguments)]
fn launch<const PTSZ: bool>(
    real: impl Fn(
        CUfunction,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        CUstream,
        *mut *mut c_void,
        *mut *mut c_void,
    ) -> u32,
    f: CUfunction,
    gx: c_uint,
    gy: c_uint,
    gz: c_uint,
    bx: c_uint,
    by: c_uint,
    bz: c_uint,
    smem: c_uint,
    s: CUstream,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> u32 {
    throttled(f as u64, s, PTSZ, || {
        real(f, gx, gy, gz, bx, by, bz, smem, s, params, extra)
    })
}

#[allow(clippy::too_many_arguments)]
fn cooperative<const PTSZ: bool>(
    real: impl Fn(
        CUfunction,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        CUstream,
        *mut *mut c_void,
    ) -> u32,
    f: CUfunction,
    gx: c_uint,
    gy: c_uint,
    gz: c_uint,
    bx: c_uint,
    by: c_uint,
    bz: c_uint,
    smem: c_uint,
    s: CUstream,
    params: *mut *mut c_void,
) -> u32 {
    throttled(f as u64, s, PTSZ, || {
        real(f, gx, gy, gz, bx, by, bz, smem, s, params)
    })
}

/// The stream of a cuLaunchKernelEx config (NULL config: the driver's error, not ours).
fn config_stream(cfg: *const CUlaunchConfig) -> Option<CUstream> {
    if cfg.is_null() {
        return None;
    }
    // SAFETY: non-null and, by the driver API contract, a valid CUlaunchConfig.
    Some(unsafe { std::ptr::addr_of!((*cfg).hStream).read_unaligned() })
}

fn launch_ex<const PTSZ: bool>(
    real: impl Fn(*const CUlaunchConfig, CUfunction, *mut *mut c_void, *mut *mut c_void) -> u32,
    cfg: *const CUlaunchConfig,
    f: CUfunction,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> u32 {
    match config_stream(cfg) {
        Some(s) => throttled(f as u64, s, PTSZ, || real(cfg, f, params, extra)),
        None => real(cfg, f, params, extra),
    }
}

fn graph_launch<const PTSZ: bool>(
    real: impl Fn(CUgraphExec, CUstream) -> u32,
    exec: CUgraphExec,
    s: CUstream,
) -> u32 {
    // Graph memory (allocation nodes) is charged around the real launch (`graph.rs`).
    throttled(exec as u64 ^ GRAPH_KEY, s, PTSZ, || {
        super::graph::with_memory(exec, || real(exec, s))
    })
}

// ---- the rule --------------------------------------------------------------------------------

/// Draws the estimate of work `key` from the bucket (sleeping while it is in debt), then runs
/// `go` (the real launch) — bracketed by events when this launch is sampled.
#[inline]
fn throttled(key: u64, s: CUstream, ptsz: bool, go: impl FnOnce() -> u32) -> u32 {
    let Some(c) = crate::compute() else {
        return go();
    };
    let Some(ordinal) = current_ordinal() else {
        return go();
    };
    let Some(g) = c.gpu(ordinal, || device_info(ordinal)) else {
        return go();
    };
    let entry = c.estimates.entry(key);
    if entry.estimate() == 0 {
        hold_unmeasured(c);
    }
    let mut t = c.admit(g, entry);
    if t.owed_ns > 0 {
        c.wait(g, &mut t, || poll(c));
    }
    let rc = if c.sample(&t, entry) {
        poll(c);
        sampled(key, s, ptsz, ordinal, &t, go)
    } else {
        go()
    };
    if rc != SUCCESS {
        refund(c, g, entry, &t);
    }
    rc
}

/// At most this many launches of kernels not measured yet are on the GPU at once, per process.
const UNMEASURED_IN_FLIGHT: usize = 4;
/// The longest a launch waits for earlier unmeasured launches to come back.
const UNMEASURED_WAIT_NS: u64 = 200_000_000;

/// Launches of a kernel not measured yet are charged a guess ([`crate::timeslice::estimate`]'s
/// default); unbounded, a program starting behind other containers' queues could put hundreds
/// of them on the GPU before the first measurement returns, a backlog that a saturated GPU
/// (every share's rate summing to 1) never drains and that skews every share behind it. So such
/// a launch waits, polling in short sleeps, while [`UNMEASURED_IN_FLIGHT`] unmeasured launches
/// are still running (a warm-up cost only: the first launches of each kernel).
#[cold]
fn hold_unmeasured(c: &Compute) {
    let deadline = now_ns() + UNMEASURED_WAIT_NS;
    loop {
        poll(c);
        let n = SAMPLES
            .iter()
            .filter(|p| p.state.load(Acquire) == IN_FLIGHT && p.unmeasured.load(Relaxed) != 0)
            .count();
        if n < UNMEASURED_IN_FLIGHT || now_ns() > deadline {
            return;
        }
        std::thread::sleep(std::time::Duration::from_micros(50));
    }
}

#[cold]
fn refund(c: &Compute, g: &Gpu, entry: &Entry, t: &Ticket) {
    c.refund(g, entry, t);
}

// ---- the driver's answers (real entry points, never our wrappers) -----------------------------

const SUCCESS: u32 = err::SUCCESS;

static REAL_CTX_GET_DEVICE: Real = Real::new(Lib::Cuda, c"cuCtxGetDevice");
static REAL_CTX_GET_CURRENT: Real = Real::new(Lib::Cuda, c"cuCtxGetCurrent");
static REAL_DEVICE_GET_COUNT: Real = Real::new(Lib::Cuda, c"cuDeviceGetCount");
static REAL_DEVICE_GET_UUID: Real = Real::new(Lib::Cuda, c"cuDeviceGetUuid");
static REAL_DEVICE_TOTAL_MEM: Real = Real::new(Lib::Cuda, c"cuDeviceTotalMem_v2");
static REAL_EVENT_CREATE: Real = Real::new(Lib::Cuda, c"cuEventCreate");
static REAL_EVENT_DESTROY: Real = Real::new(Lib::Cuda, c"cuEventDestroy_v2");
static REAL_EVENT_RECORD: Real = Real::new(Lib::Cuda, c"cuEventRecord");
static REAL_EVENT_RECORD_PTSZ: Real = Real::new(Lib::Cuda, c"cuEventRecord_ptsz");
static REAL_EVENT_QUERY: Real = Real::new(Lib::Cuda, c"cuEventQuery");
static REAL_EVENT_ELAPSED: Real = Real::new(Lib::Cuda, c"cuEventElapsedTime");
static REAL_STREAM_QUERY: Real = Real::new(Lib::Cuda, c"cuStreamQuery");
static REAL_STREAM_QUERY_PTSZ: Real = Real::new(Lib::Cuda, c"cuStreamQuery_ptsz");
static REAL_STREAM_IS_CAPTURING: Real = Real::new(Lib::Cuda, c"cuStreamIsCapturing");
static REAL_STREAM_IS_CAPTURING_PTSZ: Real = Real::new(Lib::Cuda, c"cuStreamIsCapturing_ptsz");

fn call_real<F: Copy>(r: &Real) -> Option<F> {
    let a = r.get();
    // SAFETY: `r` names a driver export whose C signature is F (each caller below states it).
    (a != 0).then(|| unsafe { std::mem::transmute_copy::<usize, F>(&a) })
}

/// The ordinal of the current context's device (no driver call when only one is visible).
#[inline]
fn current_ordinal() -> Option<usize> {
    static COUNT: AtomicI32 = AtomicI32::new(-1);
    let mut n = COUNT.load(Relaxed);
    if n < 0 {
        let f = call_real::<unsafe extern "C" fn(*mut c_int) -> u32>(&REAL_DEVICE_GET_COUNT)?;
        // SAFETY: cuDeviceGetCount(int*) with a valid out-pointer.
        if unsafe { f(&mut n) } != SUCCESS {
            return None;
        }
        COUNT.store(n, Relaxed);
    }
    if n == 1 {
        return Some(0);
    }
    let f = call_real::<unsafe extern "C" fn(*mut CUdevice) -> u32>(&REAL_CTX_GET_DEVICE)?;
    let mut d = -1;
    // SAFETY: cuCtxGetDevice(CUdevice*) with a valid out-pointer.
    (unsafe { f(&mut d) } == SUCCESS)
        .then_some(d)
        .and_then(|d| usize::try_from(d).ok())
}

/// (UUID, physical memory) of a device, asked once per device.
fn device_info(ordinal: usize) -> Option<([u8; 16], u64)> {
    let uuid =
        call_real::<unsafe extern "C" fn(*mut CUuuid, CUdevice) -> u32>(&REAL_DEVICE_GET_UUID)?;
    let total =
        call_real::<unsafe extern "C" fn(*mut usize, CUdevice) -> u32>(&REAL_DEVICE_TOTAL_MEM)?;
    let (mut u, mut bytes) = (CUuuid::default(), 0usize);
    // SAFETY: cuDeviceGetUuid(CUuuid*, CUdevice) and cuDeviceTotalMem_v2(size_t*, CUdevice) with
    // valid out-pointers.
    let ok = unsafe {
        uuid(&mut u, ordinal as CUdevice) == SUCCESS
            && total(&mut bytes, ordinal as CUdevice) == SUCCESS
    };
    ok.then_some((u.bytes, bytes as u64))
}

// ---- samples: events around a launch, read back later -----------------------------------------

const FREE: u32 = 0;
const BUSY: u32 = 1;
const IN_FLIGHT: u32 = 2;
const PENDING: usize = 64;

/// One measurement in progress. `state` hands it between threads (FREE -> BUSY: a thread owns
/// it; IN_FLIGHT: its events are recorded and await reading).
struct Pending {
    state: AtomicU32,
    /// The context the events were made in (they are remade for another).
    ctx: AtomicUsize,
    start: AtomicUsize,
    end: AtomicUsize,
    key: AtomicU64,
    charged: AtomicU64,
    unmeasured: AtomicU32,
    ordinal: AtomicU32,
    /// Predicted wait behind other containers' work (ns), taken off the measurement.
    queued: AtomicU64,
    /// Host time of the start event when the stream was idle then (0: unknown), and when the
    /// queue model expected the launch to end: the measurement grounds the model.
    idle_at: AtomicU64,
    ends: AtomicU64,
}

#[allow(clippy::declare_interior_mutable_const)]
const NEW_PENDING: Pending = Pending {
    state: AtomicU32::new(FREE),
    ctx: AtomicUsize::new(0),
    start: AtomicUsize::new(0),
    end: AtomicUsize::new(0),
    key: AtomicU64::new(0),
    charged: AtomicU64::new(0),
    unmeasured: AtomicU32::new(0),
    ordinal: AtomicU32::new(0),
    queued: AtomicU64::new(0),
    idle_at: AtomicU64::new(0),
    ends: AtomicU64::new(0),
};
static SAMPLES: [Pending; PENDING] = [NEW_PENDING; PENDING];

type Record = unsafe extern "C" fn(CUevent, CUstream) -> u32;

/// Runs `go` between two event records on `s`, leaving the pair to be read back later. Without
/// a free pending entry, events, or on a capturing stream, just runs `go`.
#[cold]
fn sampled(
    key: u64,
    s: CUstream,
    ptsz: bool,
    ordinal: usize,
    t: &Ticket,
    go: impl FnOnce() -> u32,
) -> u32 {
    let Some(p) = SAMPLES.iter().find(|p| {
        p.state
            .compare_exchange(FREE, BUSY, AcqRel, Relaxed)
            .is_ok()
    }) else {
        return go();
    };
    let record = call_real::<Record>(if ptsz {
        &REAL_EVENT_RECORD_PTSZ
    } else {
        &REAL_EVENT_RECORD
    });
    let (Some(record), true, true) = (record, !capturing(s, ptsz), events_for_current_ctx(p))
    else {
        p.state.store(FREE, Release);
        return go();
    };
    let (e0, e1) = (
        p.start.load(Relaxed) as CUevent,
        p.end.load(Relaxed) as CUevent,
    );
    p.queued.store(t.ahead, Relaxed);
    p.ends.store(t.ends, Relaxed);
    p.idle_at
        .store(if idle(s, ptsz) { fast_ns() } else { 0 }, Relaxed);
    // SAFETY: cuEventRecord(CUevent, CUstream) with events we created in the current context and
    // the program's own stream.
    if unsafe { record(e0, s) } != SUCCESS {
        p.state.store(FREE, Release);
        return go();
    }
    let rc = go();
    // SAFETY: as above.
    if rc != SUCCESS || unsafe { record(e1, s) } != SUCCESS {
        p.state.store(FREE, Release);
        return rc;
    }
    p.key.store(key, Relaxed);
    p.charged.store(t.charged, Relaxed);
    p.unmeasured.store(t.unmeasured as u32, Relaxed);
    p.ordinal.store(ordinal as u32, Relaxed);
    p.state.store(IN_FLIGHT, Release);
    rc
}

/// Whether all work on `s` has completed (an event recorded now completes now).
fn idle(s: CUstream, ptsz: bool) -> bool {
    let r = if ptsz {
        &REAL_STREAM_QUERY_PTSZ
    } else {
        &REAL_STREAM_QUERY
    };
    // SAFETY: cuStreamQuery(CUstream) on the program's own stream.
    call_real::<unsafe extern "C" fn(CUstream) -> u32>(r)
        .is_some_and(|f| unsafe { f(s) } == SUCCESS)
}

/// Whether `s` is being captured into a graph (its launches then run only with the graph).
fn capturing(s: CUstream, ptsz: bool) -> bool {
    let r = if ptsz {
        &REAL_STREAM_IS_CAPTURING_PTSZ
    } else {
        &REAL_STREAM_IS_CAPTURING
    };
    let Some(f) = call_real::<unsafe extern "C" fn(CUstream, *mut c_int) -> u32>(r) else {
        return false;
    };
    let mut status = 0;
    // SAFETY: cuStreamIsCapturing(CUstream, CUstreamCaptureStatus*) with a valid out-pointer.
    unsafe { f(s, &mut status) == SUCCESS && status != 0 }
}

/// Makes sure the (owned) pending entry has two timing events of the current context.
fn events_for_current_ctx(p: &Pending) -> bool {
    let (Some(get), Some(create)) = (
        call_real::<unsafe extern "C" fn(*mut CUcontext) -> u32>(&REAL_CTX_GET_CURRENT),
        call_real::<unsafe extern "C" fn(*mut CUevent, c_uint) -> u32>(&REAL_EVENT_CREATE),
    ) else {
        return false;
    };
    let mut ctx: CUcontext = std::ptr::null_mut();
    // SAFETY: cuCtxGetCurrent(CUcontext*) with a valid out-pointer.
    if unsafe { get(&mut ctx) } != SUCCESS || ctx.is_null() {
        return false;
    }
    if p.ctx.load(Relaxed) == ctx as usize && p.start.load(Relaxed) != 0 {
        return true;
    }
    destroy_events(p);
    let (mut a, mut b): (CUevent, CUevent) = (std::ptr::null_mut(), std::ptr::null_mut());
    // SAFETY: cuEventCreate(CUevent*, flags 0 = default, timing enabled) with valid out-pointers.
    let ok = unsafe { create(&mut a, 0) == SUCCESS && create(&mut b, 0) == SUCCESS };
    p.start.store(a as usize, Relaxed);
    p.end.store(b as usize, Relaxed);
    p.ctx.store(ctx as usize, Relaxed);
    if !ok {
        destroy_events(p);
    }
    ok
}

fn destroy_events(p: &Pending) {
    let Some(destroy) = call_real::<unsafe extern "C" fn(CUevent) -> u32>(&REAL_EVENT_DESTROY)
    else {
        return;
    };
    for e in [&p.start, &p.end] {
        let h = e.swap(0, Relaxed);
        if h != 0 {
            // SAFETY: an event we created and nobody else holds.
            unsafe { destroy(h as CUevent) };
        }
    }
    p.ctx.store(0, Relaxed);
}

/// Reads back every measurement whose end event has completed.
#[cold]
fn poll(c: &Compute) {
    let (Some(query), Some(elapsed)) = (
        call_real::<unsafe extern "C" fn(CUevent) -> u32>(&REAL_EVENT_QUERY),
        call_real::<unsafe extern "C" fn(*mut f32, CUevent, CUevent) -> u32>(&REAL_EVENT_ELAPSED),
    ) else {
        return;
    };
    for p in &SAMPLES {
        if p.state.load(Relaxed) != IN_FLIGHT
            || p.state
                .compare_exchange(IN_FLIGHT, BUSY, AcqRel, Relaxed)
                .is_err()
        {
            continue;
        }
        let (e0, e1) = (
            p.start.load(Relaxed) as CUevent,
            p.end.load(Relaxed) as CUevent,
        );
        // SAFETY: cuEventQuery on an event we created.
        match unsafe { query(e1) } {
            SUCCESS => {
                let mut ms = 0f32;
                // SAFETY: cuEventElapsedTime(float*, CUevent, CUevent) on our two completed events.
                if unsafe { elapsed(&mut ms, e0, e1) } == SUCCESS && ms.is_finite() && ms >= 0.0 {
                    let ns = (ms as f64 * 1e6) as u64;
                    let at = p.idle_at.load(Relaxed);
                    if at != 0 {
                        c.ground(
                            p.ordinal.load(Relaxed) as usize,
                            p.ends.load(Relaxed),
                            at + ns,
                        );
                    }
                    c.measured(
                        p.ordinal.load(Relaxed) as usize,
                        p.key.load(Relaxed),
                        ns,
                        p.queued.load(Relaxed),
                        p.charged.load(Relaxed),
                        p.unmeasured.load(Relaxed) != 0,
                    );
                }
                p.state.store(FREE, Release);
            }
            err::NOT_READY => p.state.store(IN_FLIGHT, Release),
            _ => p.state.store(FREE, Release),
        }
    }
}
