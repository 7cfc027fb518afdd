//! Stream capture: work queued on a capturing stream becomes nodes of the capture's graph, the
//! same graph a program would build by hand; streams fork into and join a capture through
//! events; the capture modes decide which calls are refused. Facts from CUDA 13.5's `cuda.h`
//! doc comments (cited at each) and the real driver's answers where programs reported them.
//!
//! What the rest of the driver calls (kept narrow so that the stream and event code can move):
//! `capturing`, `refuse_if_capturing`, `refuse_ctx_sync`, `check_unsafe_call`,
//! `event_captured`, `forget_stream` and the `capture_*` hooks, each answering `None` when the
//! stream is not capturing.

use crate::exec::{self, Dims};
use crate::graph::*;
use crate::stream::{self, Stream};
use crate::{drv, export, mem, read, write, Res};
use cuvisor_cuda_abi::cuda::*;
use std::cell::Cell;
use std::collections::{HashMap, HashSet};
use std::ffi::{c_uint, c_void};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::*};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::thread::ThreadId;

/// `CUresult`: "the operation would have resulted in a merge of two independent capture
/// sequences" (902), "a fork that was not joined to the primary stream" (904), "a dependency
/// would have been created which crosses the capture sequence boundary" (905), "a disallowed
/// implicit dependency on a current capture sequence from cudaStreamLegacy" (906), "not permitted
/// on an event which was last recorded in a capturing stream" (907).
const STREAM_CAPTURE_MERGE: CUresult = 902;
const STREAM_CAPTURE_UNJOINED: CUresult = 904;
const STREAM_CAPTURE_ISOLATION: CUresult = 905;
const STREAM_CAPTURE_IMPLICIT: CUresult = 906;
const CAPTURED_EVENT: CUresult = 907;

/// `CU_STREAM_CAPTURE_STATUS_INVALIDATED`.
const CAPTURE_STATUS_INVALIDATED: i32 = 2;
/// `CUstreamCaptureMode`: GLOBAL 0, THREAD_LOCAL 1, RELAXED 2.
const CAPTURE_MODE_GLOBAL: i32 = 0;
const CAPTURE_MODE_RELAXED: i32 = 2;
/// `CUevent_record_flags` / `CUevent_wait_flags`: CU_EVENT_RECORD_EXTERNAL = CU_EVENT_WAIT_EXTERNAL
/// = 1, "When using stream capture, create an event record node / event wait node instead of
/// the default behavior"; the wait flag "is invalid outside of stream capture".
const EVENT_EXTERNAL: c_uint = 1;
/// `CUstreamUpdateCaptureDependencies_flags`: ADD 0, SET 1.
const SET_CAPTURE_DEPENDENCIES: c_uint = 1;

// ---- stream capture -------------------------------------------------------------------------------

/// A capture sequence: the graph it records into, its mode, the thread that began it.
struct Seq {
    /// "an id for the capture sequence, which is unique over the lifetime of the process"
    /// (cuStreamGetCaptureInfo).
    id: u64,
    graph: usize,
    g: Arc<Graph>,
    mode: i32,
    thread: ThreadId,
    /// The stream the capture began on (the only one that may end it).
    origin: usize,
    /// A rule of capture was broken: the sequence goes on but yields no graph.
    invalid: AtomicBool,
    /// The graph was made by the capture (cuStreamBeginCapture), not given
    /// (cuStreamBeginCaptureToGraph): an invalidated capture destroys it.
    own_graph: bool,
}

/// A stream taking part in a capture: its sequence and the nodes its next work depends on.
struct SCap {
    seq: Arc<Seq>,
    deps: Vec<usize>,
    /// The stream's context, and whether the stream synchronizes with the legacy stream (not
    /// created with CU_STREAM_NON_BLOCKING).
    ctx: usize,
    blocking: bool,
    /// What `dependencies_out` / `edgeData_out` of cuStreamGetCaptureInfo point at (node
    /// handles, and one all-zero `CUgraphEdgeData` each): their heap buffers stay put when the
    /// `SCap` moves, so the addresses handed out hold until the next query.
    out: Vec<usize>,
    out_edges: Vec<u64>,
}

/// Capturing streams, by the address of their `Stream`.
fn caps() -> MutexGuard<'static, HashMap<usize, SCap>> {
    static M: OnceLock<Mutex<HashMap<usize, SCap>>> = OnceLock::new();
    M.get_or_init(|| Mutex::new(HashMap::new()))
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// Event -> (capture id, the nodes it stands for).
type EventCaps = HashMap<usize, (u64, Vec<usize>)>;

/// Events last recorded in a capturing stream.
fn event_caps() -> MutexGuard<'static, EventCaps> {
    static M: OnceLock<Mutex<EventCaps>> = OnceLock::new();
    M.get_or_init(|| Mutex::new(HashMap::new()))
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

fn key(s: &Stream) -> usize {
    s as *const Stream as usize
}

thread_local! {
    /// The thread's stream capture interaction mode (cuThreadExchangeStreamCaptureMode); a
    /// thread starts in global mode ("This is the default mode").
    static CAPTURE_MODE: Cell<i32> = const { Cell::new(CAPTURE_MODE_GLOBAL) };
}

/// A destroyed stream leaves any capture it took part in (its address may name a new stream).
pub(crate) fn forget_stream(s: &Stream) {
    caps().remove(&key(s));
}

pub(crate) fn capturing(s: &Stream) -> bool {
    caps().contains_key(&key(s))
}

/// Whether `s` is its context's legacy stream while a blocking stream of that context captures:
/// "When a blocking stream is capturing, the legacy stream is in an unusable state until the
/// blocking stream capture is terminated. The legacy stream is not supported for stream
/// capture, but attempted use would have an implicit dependency on the capturing stream(s)"
/// (cuStreamIsCapturing). Work queued there answers CUDA_ERROR_STREAM_CAPTURE_IMPLICIT and, an
/// invalid operation, invalidates those captures (`invalidate`); the capture queries answer the
/// error without ("The blocking stream capture is not invalidated").
fn implicit(s: &Stream, invalidate: bool) -> Res {
    let m = caps();
    if m.is_empty() || m.contains_key(&key(s)) {
        return Ok(());
    }
    let ch = s.ctx_handle();
    if !s.is_legacy() {
        return Ok(());
    }
    let mut hit = false;
    for c in m.values().filter(|c| c.blocking && c.ctx == ch) {
        hit = true;
        if invalidate {
            c.seq.invalid.store(true, Release);
        }
    }
    if hit {
        Err(STREAM_CAPTURE_IMPLICIT)
    } else {
        Ok(())
    }
}

/// Work queued on a stream that is not capturing: refused where it is the legacy stream with a
/// blocking capture beside it (see `implicit`). Used by every `capture_*` hook.
fn not_captured(s: &Stream) -> Option<Res> {
    implicit(s, true).err().map(Err)
}

/// Records `kind` as the next node of `s`'s capture (None when `s` is not capturing). An
/// invalidated capture records nothing more: CUDA_ERROR_STREAM_CAPTURE_INVALIDATED ("the
/// current capture sequence on the stream has been invalidated due to a previous error").
pub(crate) fn capture_push(s: &Stream, kind: Kind) -> Option<Res> {
    let mut m = caps();
    let c = m.get_mut(&key(s))?;
    if c.seq.invalid.load(Acquire) {
        return Some(Err(err::STREAM_CAPTURE_INVALIDATED));
    }
    let i = c.seq.g.push(kind, std::mem::take(&mut c.deps));
    c.deps = vec![i];
    Some(Ok(()))
}

/// An operation that cannot be captured was asked of a capturing stream (synchronizing or
/// querying it): CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED ("not permitted when the stream is
/// capturing"), and the capture is invalidated: the real driver then ends it with
/// CUDA_ERROR_STREAM_CAPTURE_INVALIDATED (JuliaGPU/CUDA.jl#1229: cuStreamQuery during a capture
/// answered 900, the capture's end 901). Ok when `s` is not capturing.
pub(crate) fn refuse_if_capturing(s: &Stream) -> Res {
    implicit(s, true)?;
    match caps().get(&key(s)) {
        Some(c) => {
            c.seq.invalid.store(true, Release);
            Err(err::STREAM_CAPTURE_UNSUPPORTED)
        }
        None => Ok(()),
    }
}

/// cuCtxSynchronize while streams of the context capture: it would wait for a capturing
/// stream, which "is not permitted when the stream is capturing" (CUDA_ERROR_STREAM_CAPTURE_
/// UNSUPPORTED; cudaDeviceSynchronize during a capture answers so on the real driver,
/// NVlabs/instant-ngp#795), and those captures are invalidated.
pub(crate) fn refuse_ctx_sync(ch: usize) -> Res {
    let m = caps();
    let mut hit = false;
    for c in m.values().filter(|c| c.ctx == ch) {
        c.seq.invalid.store(true, Release);
        hit = true;
    }
    if hit {
        Err(err::STREAM_CAPTURE_UNSUPPORTED)
    } else {
        Ok(())
    }
}

/// A "potentially unsafe API call" (cuMemAlloc and the like, cuThreadExchangeStreamCaptureMode):
/// prohibited, with CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, where "the local thread has an
/// ongoing capture sequence that was not initiated with CU_STREAM_CAPTURE_MODE_RELAXED" or, in
/// global mode, "any other thread has a concurrent capture sequence initiated with
/// CU_STREAM_CAPTURE_MODE_GLOBAL"; relaxed threads are not prohibited. The capture sequences
/// the call conflicts with are invalidated.
pub(crate) fn check_unsafe_call() -> Res {
    let mode = CAPTURE_MODE.with(Cell::get);
    if mode == CAPTURE_MODE_RELAXED {
        return Ok(());
    }
    let me = std::thread::current().id();
    let m = caps();
    let mut bad = false;
    for c in m.values() {
        let s = &c.seq;
        if s.mode != CAPTURE_MODE_RELAXED
            && (s.thread == me || (mode == CAPTURE_MODE_GLOBAL && s.mode == CAPTURE_MODE_GLOBAL))
        {
            s.invalid.store(true, Release);
            bad = true;
        }
    }
    if bad {
        Err(err::STREAM_CAPTURE_UNSUPPORTED)
    } else {
        Ok(())
    }
}

/// Whether an event was last recorded in a capturing stream (cuEventQuery and
/// cuEventSynchronize then answer CUDA_ERROR_CAPTURED_EVENT).
pub(crate) fn event_captured(ev: usize) -> Res {
    if event_caps().contains_key(&ev) {
        Err(CAPTURED_EVENT)
    } else {
        Ok(())
    }
}

/// A kernel launch on a capturing stream: a kernel node (None when not capturing). `f` is the
/// function or library kernel launched, `ns` its run time as the launch computed it.
pub(crate) fn capture_kernel(
    s: &Stream,
    f: CUfunction,
    dims: &Dims,
    smem: c_uint,
    ns: u64,
) -> Option<Res> {
    if !capturing(s) {
        return not_captured(s);
    }
    let busy = exec::function_or_kernel(f).map(|x| x.busy).unwrap_or(false);
    let k = KernelNode {
        func: f as usize,
        kern: 0,
        grid: dims.grid,
        block: dims.block,
        smem,
        ns,
        arg: busy.then(|| KArg::new(ns)),
    };
    capture_push(s, Kind::Kernel(k))
}

/// cuLaunchHostFunc on a capturing stream: a host node.
pub(crate) fn capture_host(s: &Stream, f: HostFn, data: *mut c_void) -> Option<Res> {
    if !capturing(s) {
        return not_captured(s);
    }
    capture_push(
        s,
        Kind::Host(HostParams {
            f,
            data: data as usize,
        }),
    )
}

/// An async copy on a capturing stream: a memcpy node holding its `CUDA_MEMCPY3D` (None when
/// `s` is not capturing).
pub(crate) fn capture_copy(s: &Stream, c: &CUDA_MEMCPY3D) -> Option<Res> {
    if !capturing(s) {
        return not_captured(s);
    }
    capture_push(s, Kind::Memcpy(memcpy3d_node(c)))
}

/// An async memset (1D, or 2D with `pitch`) on a capturing stream: a memset node.
pub(crate) fn capture_memset(s: &Stream, m: MemsetParams) -> Option<Res> {
    if !capturing(s) {
        return not_captured(s);
    }
    if let Err(e) = check_memset(&m) {
        return Some(Err(e));
    }
    capture_push(s, Kind::Memset(m))
}

/// An async operation that a capture cannot record (peer and batched copies, 1D array copies):
/// refused on a capturing stream, which invalidates the capture (None when not capturing).
pub(crate) fn capture_unsupported(s: &Stream) -> Option<Res> {
    refuse_if_capturing(s).err().map(Err)
}

/// cuMemAllocAsync / cuMemAllocFromPoolAsync on stream `s` while it is captured: an allocation
/// node on device `dev` (None when `s` is not capturing).
pub(crate) fn capture_alloc(s: &Stream, dev: usize, size: u64) -> Option<Result<u64, CUresult>> {
    if !capturing(s) {
        return None;
    }
    Some(mem::graph_alloc_new(dev, size).and_then(|a| {
        let addr = a.addr;
        capture_push(s, Kind::Alloc(Arc::new(NodeAlloc(a))))
            .unwrap_or(Ok(()))
            .map(|_| addr)
    }))
}

/// cuMemFreeAsync on stream `s` while it is captured: a free node (None when not capturing).
pub(crate) fn capture_free(s: &Stream, addr: u64) -> Option<Res> {
    let g = caps().get(&key(s))?.seq.g.clone();
    Some(free_node(&g, addr).and_then(|k| capture_push(s, k).unwrap_or(Ok(()))))
}

/// cuEventRecord(WithFlags) on stream `s`. While `s` captures, the event stands for the
/// stream's current position in the capture (what a later cuStreamWaitEvent joins), and with
/// CU_EVENT_RECORD_EXTERNAL an event record node is made. Recorded outside a capture, the event
/// is no longer a captured one (None: the caller records it in time).
pub(crate) fn capture_event_record(s: &Stream, ev: usize, flags: c_uint) -> Option<Res> {
    let mut m = caps();
    let Some(c) = m.get_mut(&key(s)) else {
        event_caps().remove(&ev);
        return None;
    };
    if c.seq.invalid.load(Acquire) {
        return Some(Err(err::STREAM_CAPTURE_INVALIDATED));
    }
    if flags & EVENT_EXTERNAL != 0 {
        let i = c
            .seq
            .g
            .push(Kind::EventRecord(ev), std::mem::take(&mut c.deps));
        c.deps = vec![i];
    }
    event_caps().insert(ev, (c.seq.id, c.deps.clone()));
    Some(Ok(()))
}

/// cuStreamWaitEvent on stream `s`. An event recorded in a capture: a stream of the same
/// capture joins the event's position (its next work depends on both); a stream not capturing
/// joins the capture (a fork: "a second stream joins the capture by waiting on an event
/// recorded in a capturing stream", CUDA Programming Guide, "Cross-stream Dependencies and
/// Events"); a stream of another capture would merge two sequences
/// (CUDA_ERROR_STREAM_CAPTURE_MERGE). An event recorded outside any capture, waited on by a
/// capturing stream: with CU_EVENT_WAIT_EXTERNAL an event wait node; without it, a dependency
/// the graph cannot express that crosses the capture boundary
/// (CUDA_ERROR_STREAM_CAPTURE_ISOLATION). Outside capture the flag is invalid
/// (CUDA_ERROR_INVALID_VALUE: "This flag is invalid outside of stream capture").
pub(crate) fn capture_event_wait(s: &Stream, ev: usize, flags: c_uint) -> Option<Res> {
    let mut m = caps();
    let captured = event_caps().get(&ev).cloned();
    let k = key(s);
    match (m.get_mut(&k), captured) {
        (Some(c), Some((id, deps))) => {
            if c.seq.id != id {
                c.seq.invalid.store(true, Release);
                return Some(Err(STREAM_CAPTURE_MERGE));
            }
            for d in deps {
                if !c.deps.contains(&d) {
                    c.deps.push(d);
                }
            }
            Some(Ok(()))
        }
        (Some(c), None) => {
            if c.seq.invalid.load(Acquire) {
                return Some(Err(err::STREAM_CAPTURE_INVALIDATED));
            }
            if flags & EVENT_EXTERNAL == 0 {
                c.seq.invalid.store(true, Release);
                return Some(Err(STREAM_CAPTURE_ISOLATION));
            }
            let i = c
                .seq
                .g
                .push(Kind::EventWait(ev), std::mem::take(&mut c.deps));
            c.deps = vec![i];
            Some(Ok(()))
        }
        (None, Some((id, deps))) => {
            let Some(seq) = m.values().find(|c| c.seq.id == id).map(|c| c.seq.clone()) else {
                // The capture has ended: the event stands for nothing that can run.
                return Some(Err(STREAM_CAPTURE_ISOLATION));
            };
            m.insert(
                k,
                SCap {
                    seq,
                    deps,
                    ctx: s.ctx_handle(),
                    blocking: s.flags & CU_STREAM_NON_BLOCKING == 0,
                    out: Vec::new(),
                    out_edges: Vec::new(),
                },
            );
            Some(Ok(()))
        }
        (None, None) if flags & EVENT_EXTERNAL != 0 => Some(Err(err::INVALID_VALUE)),
        (None, None) => None,
    }
}

static NEXT_CAPTURE_ID: AtomicU64 = AtomicU64::new(1);

/// Begins a capture on `h` into `graph` (made here when None) with the given dependencies.
fn begin(h: CUstream, mode: i32, pt: bool, graph: Option<(usize, Vec<usize>)>) -> Res {
    let s = stream::stream(h, pt)?;
    // cuStreamBeginCapture: "Capture may not be initiated if stream is CU_STREAM_LEGACY".
    if s.is_legacy() {
        return Err(err::STREAM_CAPTURE_UNSUPPORTED);
    }
    if !(CAPTURE_MODE_GLOBAL..=CAPTURE_MODE_RELAXED).contains(&mode) {
        return Err(err::INVALID_VALUE);
    }
    let mut m = caps();
    let k = key(&s);
    if m.contains_key(&k) {
        return Err(err::ILLEGAL_STATE);
    }
    let own = graph.is_none();
    let (gh, deps) = match graph {
        Some(x) => x,
        None => (new_graph().0, Vec::new()),
    };
    let g = graphs().get(gh)?;
    m.insert(
        k,
        SCap {
            seq: Arc::new(Seq {
                id: NEXT_CAPTURE_ID.fetch_add(1, Relaxed),
                graph: gh,
                g,
                mode,
                thread: std::thread::current().id(),
                origin: k,
                invalid: AtomicBool::new(false),
                own_graph: own,
            }),
            deps,
            ctx: s.ctx_handle(),
            blocking: s.flags & CU_STREAM_NON_BLOCKING == 0,
            out: Vec::new(),
            out_edges: Vec::new(),
        },
    );
    Ok(())
}

/// cuStreamBeginCaptureToGraph (CUDA 12.3): captures into an existing graph, the first work
/// depending on `deps` (nodes of that graph); edge data, where given, must be the default
/// (all zero: the simulator's edges carry none).
fn begin_to_graph(
    h: CUstream,
    graph: CUgraph,
    deps: *const CUgraphNode,
    edges: *const u64,
    n: usize,
    mode: i32,
    pt: bool,
) -> Res {
    drv()?;
    let g = graphs().get(graph as usize)?;
    let d = dep_indices(&g, deps, n)?;
    check_default_edges(edges, n)?;
    begin(h, mode, pt, Some((graph as usize, d)))
}

/// The nodes `from` depends on, directly or not, and `from` themselves.
fn ancestors(g: &Graph, from: &[usize]) -> HashSet<usize> {
    let st = g.lock();
    let mut seen = HashSet::new();
    let mut todo: Vec<usize> = from.to_vec();
    while let Some(i) = todo.pop() {
        if seen.insert(i) {
            if let Some(Some(n)) = st.nodes.get(i) {
                todo.extend(&n.deps);
            }
        }
    }
    seen
}

/// cuStreamEndCapture: only on the stream the capture began on (another one of the sequence:
/// CUDA_ERROR_STREAM_CAPTURE_UNMATCHED, "the capture was not initiated in this stream"), from
/// the thread that began it unless relaxed (CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD). Every
/// stream that joined must have joined back ("a fork that was not joined to the primary
/// stream": CUDA_ERROR_STREAM_CAPTURE_UNJOINED); an invalidated capture yields "a NULL graph"
/// and CUDA_ERROR_STREAM_CAPTURE_INVALIDATED. The capture ends on every stream either way.
fn end_capture(h: CUstream, out: *mut CUgraph, pt: bool) -> Res {
    let s = stream::stream(h, pt)?;
    if out.is_null() {
        return Err(err::INVALID_VALUE);
    }
    let k = key(&s);
    let mut m = caps();
    let c = m.get(&k).ok_or(err::ILLEGAL_STATE)?;
    let seq = c.seq.clone();
    if seq.origin != k {
        return Err(err::STREAM_CAPTURE_UNMATCHED);
    }
    if seq.mode != CAPTURE_MODE_RELAXED && seq.thread != std::thread::current().id() {
        return Err(err::STREAM_CAPTURE_WRONG_THREAD);
    }
    let members: Vec<usize> = m
        .iter()
        .filter(|(_, c)| c.seq.id == seq.id)
        .map(|(&k, _)| k)
        .collect();
    let origin_deps = m.get(&k).map(|c| c.deps.clone()).unwrap_or_default();
    let others: Vec<Vec<usize>> = members
        .iter()
        .filter(|&&x| x != k)
        .filter_map(|x| m.get(x).map(|c| c.deps.clone()))
        .collect();
    for x in members {
        m.remove(&x);
    }
    drop(m);
    event_caps().retain(|_, (id, _)| *id != seq.id);
    let joined = ancestors(&seq.g, &origin_deps);
    let unjoined = others.iter().flatten().any(|d| !joined.contains(d));
    let fail = if seq.invalid.load(Acquire) {
        Some(err::STREAM_CAPTURE_INVALIDATED)
    } else if unjoined {
        Some(STREAM_CAPTURE_UNJOINED)
    } else {
        None
    };
    match fail {
        Some(e) => {
            if seq.own_graph {
                destroy_graph(seq.graph);
            }
            write(out, std::ptr::null_mut())?;
            Err(e)
        }
        None => write(out, seq.graph as CUgraph),
    }
}

/// Writes `v` where the caller asked for it (an optional out-parameter).
fn write_opt<T>(p: *mut T, v: T) -> Res {
    if p.is_null() {
        Ok(())
    } else {
        write(p, v)
    }
}

/// cuStreamGetCaptureInfo in all three forms: v1 (10.1) asks for status and id, v2 (11.3) adds
/// the graph and the dependencies, v3 (12.3) their edge data. The status is required; "If
/// edgeData_out is non-NULL then dependencies_out must be as well"; the other outputs are valid
/// only while the status is ACTIVE (the simulator leaves them alone otherwise). Edges here
/// carry no data, so a query without `edgeData_out` is never lossy (CUDA_ERROR_LOSSY_QUERY).
#[allow(clippy::too_many_arguments)]
fn capture_info(
    h: CUstream,
    status: *mut i32,
    id: *mut u64,
    graph: *mut CUgraph,
    deps: *mut *const CUgraphNode,
    edges: *mut *const c_void,
    ndeps: *mut usize,
    pt: bool,
) -> Res {
    let s = stream::stream(h, pt)?;
    if status.is_null() || (!edges.is_null() && deps.is_null()) {
        return Err(err::INVALID_VALUE);
    }
    implicit(&s, false)?;
    let mut m = caps();
    let Some(c) = m.get_mut(&key(&s)) else {
        return write(status, CU_STREAM_CAPTURE_STATUS_NONE);
    };
    if c.seq.invalid.load(Acquire) {
        return write(status, CAPTURE_STATUS_INVALIDATED);
    }
    let base = c.seq.g.base;
    c.out = c.deps.iter().map(|&i| node_handle(base, i)).collect();
    c.out_edges = vec![0; c.deps.len()];
    write(status, CU_STREAM_CAPTURE_STATUS_ACTIVE)?;
    write_opt(id, c.seq.id)?;
    write_opt(graph, c.seq.graph as CUgraph)?;
    let (d, e) = if c.deps.is_empty() {
        (std::ptr::null(), std::ptr::null())
    } else {
        (
            c.out.as_ptr() as *const CUgraphNode,
            c.out_edges.as_ptr() as *const c_void,
        )
    };
    write_opt(deps, d)?;
    write_opt(edges, e)?;
    write_opt(ndeps, c.deps.len())
}

fn is_capturing(h: CUstream, status: *mut i32, pt: bool) -> Res {
    let s = stream::stream(h, pt)?;
    implicit(&s, false)?;
    let v = match caps().get(&key(&s)) {
        None => CU_STREAM_CAPTURE_STATUS_NONE,
        Some(c) if c.seq.invalid.load(Acquire) => CAPTURE_STATUS_INVALIDATED,
        Some(_) => CU_STREAM_CAPTURE_STATUS_ACTIVE,
    };
    write(status, v)
}

/// cuStreamUpdateCaptureDependencies(_v2): "Modifies the dependency set of a capturing stream"
/// with nodes of the capture's graph; flags ADD (0) or SET (1); a stream not capturing is
/// CUDA_ERROR_ILLEGAL_STATE.
fn update_capture_deps(
    h: CUstream,
    deps: *const CUgraphNode,
    edges: *const u64,
    n: usize,
    flags: c_uint,
    pt: bool,
) -> Res {
    let s = stream::stream(h, pt)?;
    if flags > SET_CAPTURE_DEPENDENCIES {
        return Err(err::INVALID_VALUE);
    }
    check_default_edges(edges, n)?;
    let mut m = caps();
    let c = m.get_mut(&key(&s)).ok_or(err::ILLEGAL_STATE)?;
    let d = dep_indices(&c.seq.g, deps, n)?;
    if flags == SET_CAPTURE_DEPENDENCIES {
        c.deps = d;
    } else {
        for i in d {
            if !c.deps.contains(&i) {
                c.deps.push(i);
            }
        }
    }
    Ok(())
}

export! {
    /// CUDA 10.0's form: no mode argument (global mode).
    fn cuStreamBeginCapture(s: CUstream) { begin(s, CAPTURE_MODE_GLOBAL, false, None) }
    fn cuStreamBeginCapture_ptsz(s: CUstream) { begin(s, CAPTURE_MODE_GLOBAL, true, None) }
    fn cuStreamBeginCapture_v2(s: CUstream, mode: i32) { begin(s, mode, false, None) }
    fn cuStreamBeginCapture_v2_ptsz(s: CUstream, mode: i32) { begin(s, mode, true, None) }
    fn cuStreamBeginCaptureToGraph(s: CUstream, g: CUgraph, deps: *const CUgraphNode, edges: *const u64, n: usize, mode: i32) {
        begin_to_graph(s, g, deps, edges, n, mode, false)
    }
    fn cuStreamBeginCaptureToGraph_ptsz(s: CUstream, g: CUgraph, deps: *const CUgraphNode, edges: *const u64, n: usize, mode: i32) {
        begin_to_graph(s, g, deps, edges, n, mode, true)
    }
    fn cuStreamEndCapture(s: CUstream, g: *mut CUgraph) { end_capture(s, g, false) }
    fn cuStreamEndCapture_ptsz(s: CUstream, g: *mut CUgraph) { end_capture(s, g, true) }
    fn cuStreamIsCapturing(s: CUstream, status: *mut i32) { is_capturing(s, status, false) }
    fn cuStreamIsCapturing_ptsz(s: CUstream, status: *mut i32) { is_capturing(s, status, true) }
    fn cuStreamGetCaptureInfo(s: CUstream, status: *mut i32, id: *mut u64) {
        capture_info(s, status, id, std::ptr::null_mut(), std::ptr::null_mut(), std::ptr::null_mut(), std::ptr::null_mut(), false)
    }
    fn cuStreamGetCaptureInfo_ptsz(s: CUstream, status: *mut i32, id: *mut u64) {
        capture_info(s, status, id, std::ptr::null_mut(), std::ptr::null_mut(), std::ptr::null_mut(), std::ptr::null_mut(), true)
    }
    fn cuStreamGetCaptureInfo_v2(s: CUstream, status: *mut i32, id: *mut u64, g: *mut CUgraph, deps: *mut *const CUgraphNode, ndeps: *mut usize) {
        capture_info(s, status, id, g, deps, std::ptr::null_mut(), ndeps, false)
    }
    fn cuStreamGetCaptureInfo_v2_ptsz(s: CUstream, status: *mut i32, id: *mut u64, g: *mut CUgraph, deps: *mut *const CUgraphNode, ndeps: *mut usize) {
        capture_info(s, status, id, g, deps, std::ptr::null_mut(), ndeps, true)
    }
    fn cuStreamGetCaptureInfo_v3(s: CUstream, status: *mut i32, id: *mut u64, g: *mut CUgraph, deps: *mut *const CUgraphNode, edges: *mut *const c_void, ndeps: *mut usize) {
        capture_info(s, status, id, g, deps, edges, ndeps, false)
    }
    fn cuStreamGetCaptureInfo_v3_ptsz(s: CUstream, status: *mut i32, id: *mut u64, g: *mut CUgraph, deps: *mut *const CUgraphNode, edges: *mut *const c_void, ndeps: *mut usize) {
        capture_info(s, status, id, g, deps, edges, ndeps, true)
    }
    fn cuStreamUpdateCaptureDependencies(s: CUstream, deps: *const CUgraphNode, n: usize, flags: c_uint) {
        update_capture_deps(s, deps, std::ptr::null(), n, flags, false)
    }
    fn cuStreamUpdateCaptureDependencies_ptsz(s: CUstream, deps: *const CUgraphNode, n: usize, flags: c_uint) {
        update_capture_deps(s, deps, std::ptr::null(), n, flags, true)
    }
    fn cuStreamUpdateCaptureDependencies_v2(s: CUstream, deps: *const CUgraphNode, edges: *const u64, n: usize, flags: c_uint) {
        update_capture_deps(s, deps, edges, n, flags, false)
    }
    fn cuStreamUpdateCaptureDependencies_v2_ptsz(s: CUstream, deps: *const CUgraphNode, edges: *const u64, n: usize, flags: c_uint) {
        update_capture_deps(s, deps, edges, n, flags, true)
    }
    /// Sets the thread's capture mode to `*mode` and writes the previous one back.
    fn cuThreadExchangeStreamCaptureMode(mode: *mut i32) {
        drv()?;
        let want = read(mode as *const i32)?;
        if !(CAPTURE_MODE_GLOBAL..=CAPTURE_MODE_RELAXED).contains(&want) {
            return Err(err::INVALID_VALUE);
        }
        write(mode, CAPTURE_MODE.with(|m| m.replace(want)))
    }
}
