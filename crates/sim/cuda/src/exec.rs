//! Execution: modules and functions, kernel launches, streams, events, graphs and stream capture.
//!
//! Time model: a kernel takes the device's timeline for its run time (`sim_busy*`: the first u64
//! parameter in ns; others: the model's default). The timeline is shared by every process, so
//! kernels of all processes run one after another. A stream remembers when its last work ends;
//! events, queries and synchronization follow from those times and the wall clock.
//! Copies and memsets take no simulated time.

use crate::ctx::{self, Context};
use crate::{cstr, drv, export, mem, read, write, Registry, Res};
use cuvisor_cuda_abi::cuda::*;
use cuvisor_image::{self as image, Image};
use cuvisor_sim::state::{now_ns, sleep_until};
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::ffi::{c_char, c_uint, c_void};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::*};
use std::sync::{Arc, Mutex, OnceLock};

pub(crate) struct Stream {
    pub dev: usize,
    pub flags: u32,
    pub priority: i32,
    ctx: AtomicUsize,
    /// When the last work queued on this stream ends (CLOCK_MONOTONIC ns).
    pub tail: AtomicU64,
    ctx_tail: Arc<AtomicU64>,
    /// The capture sequence in progress on this stream, if any.
    capture: Mutex<Option<Capture>>,
}

/// A capture sequence: the graph it records into, made at cuStreamBeginCapture (so that
/// cuStreamGetCaptureInfo can name it) and handed over at cuStreamEndCapture.
struct Capture {
    /// "an id for the capture sequence, which is unique over the lifetime of the process"
    /// (cuStreamGetCaptureInfo, CUDA driver API reference).
    id: u64,
    graph: usize,
    nodes: Arc<Graph>,
    /// What `dependencies_out` / `edgeData_out` point at: work captured from one stream is a
    /// chain, so the next node depends on the last one captured (if any), over an edge with
    /// no data (`CUgraphEdgeData`, 8 bytes, all zero: the default edge). Boxed so the
    /// addresses handed out stay put while the capture lasts.
    /// The node handle as an address (a `CUgraphNode` has the same size and layout).
    deps: Box<[usize; 1]>,
    edges: Box<[u64; 1]>,
}

impl Stream {
    pub fn new(dev: usize, flags: u32, priority: i32, ctx_tail: Arc<AtomicU64>) -> Stream {
        Stream {
            dev,
            flags,
            priority,
            ctx: AtomicUsize::new(0),
            tail: AtomicU64::new(0),
            ctx_tail,
            capture: Mutex::new(None),
        }
    }
    pub fn set_ctx(&self, h: usize) {
        self.ctx.store(h, Relaxed);
    }
    fn capturing(&self) -> bool {
        self.capture
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
    }
    /// Queues `dur` ns of work (or records it, while capturing).
    fn run(&self, node: Node) -> Res {
        {
            let cap = self.capture.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(c) = cap.as_ref() {
                c.nodes.push(Op::Kernel(node.ns));
                return Ok(());
            }
        }
        let d = drv()?;
        let not_before = self.tail.load(Acquire);
        let (_, end) = d
            .sim
            .shared
            .run_kernel(d.slot, self.dev, not_before, node.ns);
        self.tail.fetch_max(end, AcqRel);
        self.ctx_tail.fetch_max(end, AcqRel);
        Ok(())
    }
    fn done_at(&self) -> u64 {
        self.tail.load(Acquire)
    }
}

#[derive(Clone, Copy)]
struct Node {
    ns: u64,
}

struct Module {
    /// What the image defines, where the simulator can read it.
    image: Image,
    funcs: Mutex<HashMap<String, usize>>,
    /// The device memory behind each variable, per context: (context, name) → address; the name
    /// "" is the module's code (`module_code`).
    globals: Mutex<HashMap<(usize, String), u64>>,
}

pub(crate) struct Function {
    /// `sim_busy*`: run time comes from the first parameter.
    busy: bool,
    module: usize,
}

/// A library (CUDA 12.0's context-independent loading, `cuLibraryLoadData`): the module it is in
/// every context (the simulator's modules belong to no context, so one serves all), and the
/// kernels asked for by name.
struct Library {
    module: usize,
    kernels: Mutex<HashMap<String, usize>>,
}

/// A `CUkernel`: a function of a library, independent of the context. The simulator's function
/// objects are too, so it stands for the one function of that name in the library's module.
struct Kernel {
    function: usize,
}

struct Event {
    flags: u32,
    /// When the work before the record point ends; 0 = never recorded.
    time: AtomicU64,
}

/// A graph node: a kernel (its run time), a memory-allocation node, or a memory-free node (the
/// address it frees).
#[derive(Clone)]
enum Op {
    Kernel(u64),
    Alloc(Arc<NodeAlloc>),
    Free(u64),
}

/// A memory-allocation node's allocation, shared by its graph and the graph's executable: its
/// address is given back when both are gone (and the allocation is not live).
struct NodeAlloc(Arc<mem::GraphAlloc>);

impl Drop for NodeAlloc {
    fn drop(&mut self) {
        mem::graph_alloc_orphan(&self.0);
    }
}

struct Graph {
    /// Node handles are `base + index + 1` (see `node_handle`).
    base: usize,
    nodes: Mutex<Vec<Op>>,
}

impl Graph {
    fn push(&self, op: Op) -> usize {
        let mut n = self.nodes.lock().unwrap_or_else(|e| e.into_inner());
        n.push(op);
        node_handle(self.base, n.len() - 1)
    }
    fn len(&self) -> usize {
        self.nodes.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
}

struct GraphExec {
    nodes: Vec<Op>,
    /// CUgraphInstantiate_flags.
    flags: u64,
}

/// Node handles: each graph gets a range of 2^32 values of its own, far above any address a
/// registry handle (a heap pointer) can have, so that a node names its graph.
const NODE_RANGE: usize = 1 << 32;
const NODE_BASE: usize = 1 << 56;

fn node_handle(base: usize, index: usize) -> usize {
    base + index + 1
}

/// graph base -> graph handle.
fn graph_bases() -> &'static Mutex<HashMap<usize, usize>> {
    static M: OnceLock<Mutex<HashMap<usize, usize>>> = OnceLock::new();
    M.get_or_init(|| Mutex::new(HashMap::new()))
}

fn new_graph() -> (usize, Arc<Graph>) {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let base = NODE_BASE + NEXT.fetch_add(1, Relaxed) * NODE_RANGE;
    let (h, g) = graphs().insert(Graph {
        base,
        nodes: Mutex::new(Vec::new()),
    });
    graph_bases()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(base, h);
    (h, g)
}

/// The node behind a node handle.
fn node_of(h: CUgraphNode) -> Result<Op, CUresult> {
    let h = h as usize;
    let base =
        h.checked_sub(NODE_BASE).ok_or(err::INVALID_VALUE)? / NODE_RANGE * NODE_RANGE + NODE_BASE;
    let g = graph_bases()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&base)
        .copied()
        .ok_or(err::INVALID_VALUE)?;
    let g = graphs().get(g)?;
    let nodes = g.nodes.lock().unwrap_or_else(|e| e.into_inner());
    (h - base)
        .checked_sub(1)
        .and_then(|i| nodes.get(i).cloned())
        .ok_or(err::INVALID_VALUE)
}

fn streams() -> &'static Registry<Stream> {
    static R: OnceLock<Registry<Stream>> = OnceLock::new();
    R.get_or_init(Registry::new)
}
fn modules() -> &'static Registry<Module> {
    static R: OnceLock<Registry<Module>> = OnceLock::new();
    R.get_or_init(Registry::new)
}
fn functions() -> &'static Registry<Function> {
    static R: OnceLock<Registry<Function>> = OnceLock::new();
    R.get_or_init(Registry::new)
}
fn libraries() -> &'static Registry<Library> {
    static R: OnceLock<Registry<Library>> = OnceLock::new();
    R.get_or_init(Registry::new)
}
fn kernels() -> &'static Registry<Kernel> {
    static R: OnceLock<Registry<Kernel>> = OnceLock::new();
    R.get_or_init(Registry::new)
}
fn events() -> &'static Registry<Event> {
    static R: OnceLock<Registry<Event>> = OnceLock::new();
    R.get_or_init(Registry::new)
}
fn graphs() -> &'static Registry<Graph> {
    static R: OnceLock<Registry<Graph>> = OnceLock::new();
    R.get_or_init(Registry::new)
}
fn execs() -> &'static Registry<GraphExec> {
    static R: OnceLock<Registry<GraphExec>> = OnceLock::new();
    R.get_or_init(Registry::new)
}

thread_local! {
    /// The per-thread default stream of each context this thread used (CU_STREAM_PER_THREAD, or
    /// NULL passed to a `_ptsz`/`_ptds` entry point).
    static PER_THREAD: RefCell<HashMap<usize, Arc<Stream>>> = RefCell::new(HashMap::new());
}

/// Resolves a stream argument. `per_thread`: the entry point is a `_ptsz`/`_ptds` variant, for
/// which NULL means the per-thread default stream rather than the legacy one.
pub(crate) fn stream(h: CUstream, per_thread: bool) -> Result<Arc<Stream>, CUresult> {
    let h = h as usize;
    let legacy = h == CU_STREAM_LEGACY || (h == 0 && !per_thread);
    if legacy || h == CU_STREAM_PER_THREAD || h == 0 {
        let (ch, c) = ctx::current()?;
        if legacy {
            return Ok(c.legacy.clone());
        }
        return Ok(PER_THREAD.with(|m| {
            m.borrow_mut()
                .entry(ch)
                .or_insert_with(|| {
                    let s = Arc::new(Stream::new(c.dev, 0, 0, c.work_tail.clone()));
                    s.set_ctx(ch);
                    s
                })
                .clone()
        }));
    }
    drv()?;
    streams().get(h)
}

/// Waits for all work queued in a context.
pub(crate) fn sync_device_work(c: &Context) {
    sleep_until(c.work_tail.load(Acquire));
}

/// Run time of a launch: `sim_busy*` kernels say it in their first parameter (a u64, in ns),
/// passed either through `kernelParams` or the `extra` buffer.
fn kernel_ns(
    f: &Function,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> Result<u64, CUresult> {
    if !f.busy {
        return Ok(drv()?.sim.model.default_kernel_ns);
    }
    if !params.is_null() {
        let first: *const u64 = read(params as *const *const u64)?;
        return read(first);
    }
    if !extra.is_null() {
        let mut i = 0;
        loop {
            let key = read(unsafe_index(extra, i))? as usize;
            match key {
                CU_LAUNCH_PARAM_END => break,
                CU_LAUNCH_PARAM_BUFFER_POINTER => {
                    let buf = read(unsafe_index(extra, i + 1))?;
                    return read(buf as *const u64);
                }
                _ => i += 2,
            }
            if i > 64 {
                break;
            }
        }
    }
    // A sim_busy kernel has a parameter; launching it without one is the driver's INVALID_VALUE.
    Err(err::INVALID_VALUE)
}

/// `&arr[i]` for a caller-provided `void*` array (pointer arithmetic only; reads go through `read`).
fn unsafe_index(arr: *mut *mut c_void, i: usize) -> *const *mut c_void {
    arr.wrapping_add(i)
}

struct Dims {
    grid: [c_uint; 3],
    block: [c_uint; 3],
}

fn check_dims(d: &Dims, cooperative: bool, dev: usize) -> Res {
    let [gx, gy, gz] = d.grid;
    let [bx, by, bz] = d.block;
    if gx == 0 || gy == 0 || gz == 0 || bx == 0 || by == 0 || bz == 0 {
        return Err(err::INVALID_VALUE);
    }
    if gy > 65535 || gz > 65535 || bx > 1024 || by > 1024 || bz > 64 {
        return Err(err::INVALID_VALUE);
    }
    let threads = bx as u64 * by as u64 * bz as u64;
    if threads > 1024 {
        return Err(err::INVALID_VALUE);
    }
    if cooperative {
        // All blocks of a cooperative grid must be co-resident.
        let sm = drv()?.sim.model.devices[dev].sm_count as u64;
        let per_sm = (2048 / threads).min(32);
        if gx as u64 * gy as u64 * gz as u64 > sm * per_sm {
            return Err(err::COOPERATIVE_LAUNCH_TOO_LARGE);
        }
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn launch(
    f: CUfunction,
    dims: Dims,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
    h: CUstream,
    per_thread: bool,
    cooperative: bool,
) -> Res {
    drv()?;
    let func = function_or_kernel(f)?;
    let s = stream(h, per_thread)?;
    check_dims(&dims, cooperative, s.dev)?;
    let ns = kernel_ns(&func, params, extra)?;
    s.run(Node { ns })
}

fn launch_ex(
    cfg: *const CUlaunchConfig,
    f: CUfunction,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
    pt: bool,
) -> Res {
    let c: CUlaunchConfig = read(cfg)?;
    let mut cooperative = false;
    for i in 0..c.numAttrs as usize {
        let a: CUlaunchAttribute = read(c.attrs.wrapping_add(i))?;
        if a.id == CU_LAUNCH_ATTRIBUTE_COOPERATIVE && a.value[0] as u32 != 0 {
            cooperative = true;
        }
    }
    let dims = Dims {
        grid: [c.gridDimX, c.gridDimY, c.gridDimZ],
        block: [c.blockDimX, c.blockDimY, c.blockDimZ],
    };
    launch(f, dims, params, extra, c.hStream, pt, cooperative)
}

fn stream_sync(h: CUstream, pt: bool) -> Res {
    let s = stream(h, pt)?;
    if s.capturing() {
        return Err(err::STREAM_CAPTURE_UNSUPPORTED);
    }
    sleep_until(s.done_at());
    mem::trim_pools_at_sync(s.dev);
    Ok(())
}

fn stream_query(h: CUstream, pt: bool) -> Res {
    let s = stream(h, pt)?;
    if now_ns() >= s.done_at() {
        Ok(())
    } else {
        Err(err::NOT_READY)
    }
}

fn stream_wait_event(h: CUstream, ev: CUevent, flags: c_uint, pt: bool) -> Res {
    let s = stream(h, pt)?;
    let e = events().get(ev as usize)?;
    if flags & !1 != 0 {
        return Err(err::INVALID_VALUE);
    }
    s.tail.fetch_max(e.time.load(Acquire), AcqRel);
    Ok(())
}

fn event_record(ev: CUevent, h: CUstream, pt: bool) -> Res {
    let e = events().get(ev as usize)?;
    let s = stream(h, pt)?;
    if s.capturing() {
        return Ok(()); // becomes an event-record node of the captured graph; nothing to time now
    }
    e.time.store(s.done_at().max(now_ns()), Release);
    Ok(())
}

fn begin_capture(h: CUstream, mode: i32, pt: bool) -> Res {
    let s = stream(h, pt)?;
    if Arc::ptr_eq(&s, &ctx::current()?.1.legacy) {
        return Err(err::STREAM_CAPTURE_UNSUPPORTED); // the legacy stream cannot be captured
    }
    if !(0..=2).contains(&mode) {
        return Err(err::INVALID_VALUE);
    }
    let mut cap = s.capture.lock().unwrap_or_else(|e| e.into_inner());
    if cap.is_some() {
        return Err(err::ILLEGAL_STATE);
    }
    static NEXT_ID: AtomicU64 = AtomicU64::new(1);
    let (graph, nodes) = new_graph();
    *cap = Some(Capture {
        id: NEXT_ID.fetch_add(1, Relaxed),
        graph,
        nodes,
        deps: Box::new([0]),
        edges: Box::new([0]),
    });
    Ok(())
}

fn end_capture(h: CUstream, graph: *mut CUgraph, pt: bool) -> Res {
    let s = stream(h, pt)?;
    if graph.is_null() {
        return Err(err::INVALID_VALUE);
    }
    let c = s
        .capture
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .take()
        .ok_or(err::ILLEGAL_STATE)?;
    write(graph, c.graph as CUgraph)
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
/// the graph and the dependencies, v3 (12.3) their edge data. The CUDA driver API reference:
/// the status is required; "If edgeData_out is non-NULL then dependencies_out must be as
/// well"; the other outputs are valid only while the status is ACTIVE (the simulator leaves
/// them alone otherwise). Edges here carry no data, so a query without `edgeData_out` is
/// never lossy (CUDA_ERROR_LOSSY_QUERY).
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
    let s = stream(h, pt)?;
    if status.is_null() || (!edges.is_null() && deps.is_null()) {
        return Err(err::INVALID_VALUE);
    }
    let mut cap = s.capture.lock().unwrap_or_else(|e| e.into_inner());
    let Some(c) = cap.as_mut() else {
        return write(status, CU_STREAM_CAPTURE_STATUS_NONE);
    };
    let n = c.nodes.len();
    c.deps[0] = if n > 0 {
        node_handle(c.nodes.base, n - 1)
    } else {
        0
    };
    let count = usize::from(n > 0);
    write(status, CU_STREAM_CAPTURE_STATUS_ACTIVE)?;
    write_opt(id, c.id)?;
    write_opt(graph, c.graph as CUgraph)?;
    let (d, e) = if count > 0 {
        (
            c.deps.as_ptr() as *const CUgraphNode,
            c.edges.as_ptr() as *const c_void,
        )
    } else {
        (std::ptr::null(), std::ptr::null())
    };
    write_opt(deps, d)?;
    write_opt(edges, e)?;
    write_opt(ndeps, count)
}

/// `CUstreamCaptureMode`: CU_STREAM_CAPTURE_MODE_GLOBAL = 0, _THREAD_LOCAL = 1, _RELAXED = 2.
const CAPTURE_MODE_GLOBAL: i32 = 0;
const CAPTURE_MODE_RELAXED: i32 = 2;

thread_local! {
    /// The thread's stream capture interaction mode (cuThreadExchangeStreamCaptureMode); a
    /// thread starts in global mode. The simulator records it but does not refuse the calls a
    /// mode forbids during a capture.
    static CAPTURE_MODE: Cell<i32> = const { Cell::new(CAPTURE_MODE_GLOBAL) };
}

/// `CUstream`'s contexts (cuStreamGetCtx_v2, CUDA 12.5): the simulator has no green contexts,
/// so `*green` is always NULL, as the reference says for a stream of a regular context.
fn stream_ctx(h: CUstream, pctx: *mut CUcontext, green: *mut *mut c_void, pt: bool) -> Res {
    let st = stream(h, pt)?;
    if pctx.is_null() {
        return Err(err::INVALID_VALUE);
    }
    write_opt(green, std::ptr::null_mut())?;
    write(pctx, st.ctx.load(Relaxed) as CUcontext)
}

/// `CUDA_GRAPH_INSTANTIATE_PARAMS` (cuda.h, CUDA 12.0).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct InstantiateParams {
    flags: u64,
    upload_stream: CUstream,
    err_node_out: CUgraphNode,
    /// `CUgraphInstantiateResult`: CUDA_GRAPH_INSTANTIATE_SUCCESS = 0, _ERROR = 1.
    result_out: i32,
}

/// `CUgraphInstantiate_flags`: AUTO_FREE_ON_LAUNCH 1, UPLOAD 2, DEVICE_LAUNCH 4,
/// USE_NODE_PRIORITY 8.
const INSTANTIATE_FLAG_UPLOAD: u64 = 2;
const INSTANTIATE_FLAGS: u64 = 1 | 2 | 4 | 8;

/// cuGraphInstantiateWithParams (CUDA 12.0): instantiates, and reports through the struct.
/// With CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD the graph is uploaded into `hUploadStream`, which
/// takes no simulated time; the stream must still be one.
fn instantiate_with_params(
    exec: *mut CUgraphExec,
    graph: CUgraph,
    p: *mut InstantiateParams,
    pt: bool,
) -> Res {
    drv()?;
    let mut params = read(p as *const InstantiateParams)?;
    if params.flags & !INSTANTIATE_FLAGS != 0 {
        return Err(err::INVALID_VALUE);
    }
    if params.flags & INSTANTIATE_FLAG_UPLOAD != 0 {
        stream(params.upload_stream, pt)?;
    }
    let r = instantiate_flags(exec, graph, params.flags).and_then(|x| {
        if params.flags & INSTANTIATE_FLAG_UPLOAD == 0 {
            return Ok(());
        }
        // The upload maps the graph's memory now; a device that cannot give it fails the call
        // and the executable is not kept.
        upload(&x).inspect_err(|_| {
            if let Ok(h) = read(exec as *const CUgraphExec) {
                let _ = execs().remove(h as usize);
            }
        })
    });
    params.err_node_out = std::ptr::null_mut();
    params.result_out = i32::from(r.is_err());
    write(p, params)?;
    r
}

fn is_capturing(h: CUstream, status: *mut i32, pt: bool) -> Res {
    let s = stream(h, pt)?;
    write(
        status,
        if s.capturing() {
            CU_STREAM_CAPTURE_STATUS_ACTIVE
        } else {
            CU_STREAM_CAPTURE_STATUS_NONE
        },
    )
}

/// Per device: the most the graph's allocations hold at once while it runs (`peak`), and what
/// of that it frees again before it ends (`transient`).
fn graph_memory(nodes: &[Op]) -> HashMap<usize, (u64, u64)> {
    let mut m: HashMap<usize, (u64, u64, u64)> = HashMap::new(); // dev -> (now, peak, _)
    let mut mine: HashMap<u64, (usize, u64)> = HashMap::new();
    for op in nodes {
        match op {
            Op::Alloc(a) => {
                let e = m.entry(a.0.dev).or_default();
                e.0 += a.0.size;
                e.1 = e.1.max(e.0);
                mine.insert(a.0.addr, (a.0.dev, a.0.size));
            }
            Op::Free(addr) => {
                if let Some((dev, size)) = mine.remove(addr) {
                    let e = m.entry(dev).or_default();
                    e.0 -= size;
                }
            }
            Op::Kernel(_) => {}
        }
    }
    m.into_iter()
        .map(|(d, (now, peak, _))| (d, (peak, peak - now)))
        .collect()
}

/// Maps the physical memory a graph's allocations need, as cuGraphUpload does (and a launch
/// before it runs): the device's graph memory pool grows to cover them, or
/// CUDA_ERROR_OUT_OF_MEMORY.
fn upload(x: &GraphExec) -> Res {
    for (dev, (peak, _)) in graph_memory(&x.nodes) {
        mem::graph_reserve(dev, peak)?;
    }
    Ok(())
}

fn graph_upload(exec: CUgraphExec, h: CUstream, pt: bool) -> Res {
    let x = execs().get(exec as usize)?;
    stream(h, pt)?;
    upload(&x)
}

/// A launch: "If any allocations created by hGraphExec remain unfreed (from a previous launch)
/// and hGraphExec was not instantiated with CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH,
/// the launch will fail with CUDA_ERROR_INVALID_VALUE" (cuGraphLaunch, CUDA driver API
/// reference); with the flag, the launch frees them first. Then the graph's memory is mapped
/// (`upload`); a device that cannot give it fails the launch with CUDA_ERROR_OUT_OF_MEMORY,
/// nothing run. Then the nodes run in order: allocations become live, frees free them, kernels
/// take the device's timeline.
fn graph_launch(exec: CUgraphExec, h: CUstream, pt: bool) -> Res {
    let x = execs().get(exec as usize)?;
    let s = stream(h, pt)?;
    let allocs: Vec<&Arc<NodeAlloc>> = x
        .nodes
        .iter()
        .filter_map(|op| match op {
            Op::Alloc(a) => Some(a),
            _ => None,
        })
        .collect();
    if !allocs.is_empty() && s.capturing() {
        return Err(err::STREAM_CAPTURE_UNSUPPORTED);
    }
    if allocs.iter().any(|a| a.0.live()) {
        if x.flags & CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH == 0 {
            return Err(err::INVALID_VALUE);
        }
        for a in allocs.iter().filter(|a| a.0.live()) {
            mem::graph_alloc_free(a.0.addr)?;
        }
    }
    upload(&x)?;
    let ch = match s.ctx.load(Relaxed) {
        0 => ctx::current()?.0,
        c => c,
    };
    for op in &x.nodes {
        match op {
            Op::Kernel(ns) => s.run(Node { ns: *ns })?,
            Op::Alloc(a) => mem::graph_alloc_map(&a.0, ch)?,
            Op::Free(addr) => mem::graph_alloc_free(*addr)?,
        }
    }
    for (dev, (_, transient)) in graph_memory(&x.nodes) {
        mem::graph_running(dev, s.done_at(), transient);
    }
    Ok(())
}

fn instantiate(exec: *mut CUgraphExec, graph: CUgraph) -> Res {
    instantiate_flags(exec, graph, 0).map(|_| ())
}

fn instantiate_flags(
    exec: *mut CUgraphExec,
    graph: CUgraph,
    flags: u64,
) -> Result<Arc<GraphExec>, CUresult> {
    let g = graphs().get(graph as usize)?;
    let nodes = g.nodes.lock().unwrap_or_else(|e| e.into_inner()).clone();
    if exec.is_null() || flags & !INSTANTIATE_FLAGS != 0 {
        return Err(err::INVALID_VALUE);
    }
    let (x, xa) = execs().insert(GraphExec { nodes, flags });
    write(exec, x as CUgraphExec)?;
    Ok(xa)
}

/// Adds a node after checking the common arguments.
fn add_node(
    node: *mut CUgraphNode,
    graph: CUgraph,
    deps: *const CUgraphNode,
    ndeps: usize,
    op: impl FnOnce() -> Result<Op, CUresult>,
) -> Res {
    drv()?;
    let g = graphs().get(graph as usize)?;
    if node.is_null() || (ndeps > 0 && deps.is_null()) {
        return Err(err::INVALID_VALUE);
    }
    let h = g.push(op()?);
    write(node, h as CUgraphNode)
}

/// A memory-free node of `g` for `addr`: CUDA_ERROR_INVALID_VALUE for "an allocation twice in
/// the same graph", "an address that was not returned by an allocation node", "an invalid
/// address" (cuGraphAddMemFreeNode, CUDA driver API reference).
fn free_op(g: &Graph, addr: u64) -> Result<Op, CUresult> {
    mem::graph_alloc_at(addr).ok_or(err::INVALID_VALUE)?;
    let nodes = g.nodes.lock().unwrap_or_else(|e| e.into_inner());
    if nodes
        .iter()
        .any(|op| matches!(op, Op::Free(a) if *a == addr))
    {
        return Err(err::INVALID_VALUE);
    }
    Ok(Op::Free(addr))
}

/// cuMemAllocAsync / cuMemAllocFromPoolAsync on stream `s` while it is captured: an allocation
/// node on device `dev` (None when `s` is not capturing).
pub(crate) fn capture_alloc(s: &Stream, dev: usize, size: u64) -> Option<Result<u64, CUresult>> {
    let cap = s.capture.lock().unwrap_or_else(|e| e.into_inner());
    let c = cap.as_ref()?;
    Some(mem::graph_alloc_new(dev, size).map(|a| {
        let addr = a.addr;
        c.nodes.push(Op::Alloc(Arc::new(NodeAlloc(a))));
        addr
    }))
}

/// cuMemFreeAsync on stream `s` while it is captured: a free node (None when not capturing).
pub(crate) fn capture_free(s: &Stream, addr: u64) -> Option<Res> {
    let cap = s.capture.lock().unwrap_or_else(|e| e.into_inner());
    let c = cap.as_ref()?;
    Some(free_op(&c.nodes, addr).map(|op| {
        c.nodes.push(op);
    }))
}

fn add_kernel_node(
    node: *mut CUgraphNode,
    graph: CUgraph,
    deps: *const CUgraphNode,
    ndeps: usize,
    p: *const CUDA_KERNEL_NODE_PARAMS,
) -> Res {
    drv()?;
    let g = graphs().get(graph as usize)?;
    if node.is_null() || (ndeps > 0 && deps.is_null()) {
        return Err(err::INVALID_VALUE);
    }
    let p: CUDA_KERNEL_NODE_PARAMS = read(p)?;
    let func = functions().get(p.func as usize)?;
    let dims = Dims {
        grid: [p.gridDimX, p.gridDimY, p.gridDimZ],
        block: [p.blockDimX, p.blockDimY, p.blockDimZ],
    };
    check_dims(&dims, false, 0)?;
    // Kernel parameters are copied when the node is made, so the run time is fixed now.
    let ns = kernel_ns(&func, p.kernelParams, p.extra)?;
    write(node, g.push(Op::Kernel(ns)) as CUgraphNode)
}

fn host_func(
    h: CUstream,
    f: Option<extern "C" fn(*mut c_void)>,
    data: *mut c_void,
    pt: bool,
) -> Res {
    let s = stream(h, pt)?;
    let f = f.ok_or(err::INVALID_VALUE)?;
    let at = s.done_at();
    let data = data as usize;
    std::thread::spawn(move || {
        sleep_until(at);
        f(data as *mut c_void);
    });
    Ok(())
}

/// What the launches take: a `CUfunction`, or since CUDA 12.0 a `CUkernel` ("f - Function
/// CUfunction or Kernel CUkernel to launch", cuda.h on cuLaunchKernel, cuLaunchKernelEx and
/// cuLaunchCooperativeKernel), which runs as its function in the current context.
fn function_or_kernel(f: CUfunction) -> Result<Arc<Function>, CUresult> {
    match functions().get(f as usize) {
        Ok(func) => Ok(func),
        Err(e) => match kernels().get(f as usize) {
            Ok(k) => {
                ctx::current()?;
                functions().get(k.function)
            }
            Err(_) => Err(e),
        },
    }
}

/// A new module object of `image`, in no context.
fn new_module(image: Image) -> usize {
    modules()
        .insert(Module {
            image,
            funcs: Mutex::new(HashMap::new()),
            globals: Mutex::new(HashMap::new()),
        })
        .0
}

/// Whether a kernel of this name is a `sim_busy*` one, under C linkage (`sim_busy_ms`) or C++
/// linkage, whose Itanium-mangled name is `_Z` then the identifier's length and the identifier
/// (`_Z8sim_busyy` for `sim_busy(unsigned long long)`; Itanium C++ ABI, "Mangling",
/// <https://itanium-cxx-abi.github.io/cxx-abi/abi.html#mangling>). NVRTC and nvcc mangle
/// kernels so (CuPy's `name_expressions` resolve to such names).
fn is_busy(name: &str) -> bool {
    const BUSY: &str = "sim_busy";
    if name.starts_with(BUSY) {
        return true;
    }
    let Some(rest) = name.strip_prefix("_Z") else {
        return false;
    };
    let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
    match rest[..digits].parse::<usize>() {
        Ok(len) => rest[digits..]
            .get(..len)
            .is_some_and(|id| id.starts_with(BUSY)),
        Err(_) => false,
    }
}

/// The function `name` of module `m`, made on first ask; CUDA_ERROR_NOT_FOUND if the image
/// does not define that kernel (in an image the simulator cannot read, any name resolves).
fn module_function(module: usize, m: &Module, name: &str) -> Result<usize, CUresult> {
    if !m.image.has_kernel(name) {
        return Err(err::NOT_FOUND);
    }
    let mut funcs = m.funcs.lock().unwrap_or_else(|e| e.into_inner());
    Ok(*funcs.entry(name.to_string()).or_insert_with(|| {
        functions()
            .insert(Function {
                busy: is_busy(name),
                module,
            })
            .0
    }))
}

/// The variable `name` of module `m` in the current context: its address and size, its memory
/// allocated the first time it is asked for in a context (cuModuleLoadData* allocates every
/// variable at load; a library's are made as its contexts ask). CUDA_ERROR_NOT_FOUND if the
/// image defines no such variable.
fn module_global(m: &Module, name: &str) -> Result<(u64, u64), CUresult> {
    let (ch, _) = ctx::current()?;
    let size = m.image.global(name).ok_or(err::NOT_FOUND)?;
    let mut g = m.globals.lock().unwrap_or_else(|e| e.into_inner());
    let key = (ch, name.to_string());
    if let Some(&addr) = g.get(&key) {
        if mem::module_global_live(addr, ch) {
            return Ok((addr, size));
        }
    }
    let addr = mem::alloc_module_global(size)?;
    g.insert(key, addr);
    Ok((addr, size))
}

/// cuModuleGetGlobal_v2 / cuLibraryGetGlobal: both out-parameters are optional ("If one of them
/// is NULL, it is ignored", CUDA driver API reference).
fn get_global(
    dptr: *mut CUdeviceptr,
    bytes: *mut usize,
    module: usize,
    name: *const c_char,
) -> Res {
    let m = modules().get(module)?;
    let name = cstr(name)?;
    let (addr, size) = module_global(&m, name)?;
    write_opt(dptr, addr as CUdeviceptr)?;
    write_opt(bytes, size as usize)
}

/// Options come as `n` keys and `n` values; either array missing while `n` > 0 is the
/// caller's mistake. The simulator compiles nothing, so it ignores what they say.
fn check_options(n: c_uint, keys: *const c_void, values: *const c_void) -> Res {
    if n > 0 && (keys.is_null() || values.is_null()) {
        return Err(err::INVALID_VALUE);
    }
    Ok(())
}

/// CU_LIBRARY_BINARY_IS_PRESERVED (`CUlibraryOption` 1): a hint that `code` outlives the
/// library, with no parameter (the driver API reference, `CUlibraryOption`, describes none; the
/// driver "can choose to ignore it"). cuBLASLt 12.8 passes it alone with a NULL value array for
/// some of its loads (4 of 3515 during PyTorch's first fp32 GEMM, seen on the simulator), and
/// asks those libraries for kernels; CUDA 12 fp16 GEMMs run on real GPUs, so the driver accepts
/// that.
const CU_LIBRARY_BINARY_IS_PRESERVED: i32 = 1;

/// Library options: the value array may be NULL where every option is one without a parameter.
fn check_library_options(n: c_uint, keys: *const c_void, values: *const c_void) -> Res {
    if n > 0 && !keys.is_null() && values.is_null() {
        // SAFETY: the caller passes `n` options at `keys` (the driver API contract).
        let keys = unsafe { std::slice::from_raw_parts(keys as *const i32, n as usize) };
        if keys.iter().all(|&k| k == CU_LIBRARY_BINARY_IS_PRESERVED) {
            return Ok(());
        }
    }
    check_options(n, keys, values)
}

/// cuLibraryLoadData / cuLibraryLoadFromFile (CUDA 12.0): no current context is needed (the
/// library is loaded into contexts as they need it).
#[allow(clippy::too_many_arguments)]
fn load_library(
    library: *mut *mut c_void,
    code: *const c_void,
    image: impl FnOnce() -> Image,
    jit_n: c_uint,
    jit_keys: *const c_void,
    jit_values: *const c_void,
    lib_n: c_uint,
    lib_keys: *const c_void,
    lib_values: *const c_void,
) -> Res {
    drv()?;
    if library.is_null() || code.is_null() {
        return Err(err::INVALID_VALUE);
    }
    check_options(jit_n, jit_keys, jit_values)?;
    check_library_options(lib_n, lib_keys, lib_values)?;
    let image = image();
    // Any image loads: the simulator has no ISA to check.
    let (h, _) = libraries().insert(Library {
        module: new_module(image),
        kernels: Mutex::new(HashMap::new()),
    });
    write(library, h as *mut c_void)
}

/// Reads an image file (cuModuleLoad, cuLibraryLoadFromFile); one that cannot be read is
/// opaque (the caller checked it is a file).
fn image_file(path: &str) -> Image {
    std::fs::read(path).map_or(Image::Opaque, |b| image::from_bytes(&b))
}

pub(crate) fn load_module(module: *mut CUmodule, image: *const c_void) -> Res {
    // SAFETY: the caller's image, readable by the driver API's contract (see `image::from_ptr`).
    load_module_of(module, image, || unsafe { image::from_ptr(image) })
}

/// Loads `read()`'s image into the current context, with memory for each of its variables.
fn load_module_of(module: *mut CUmodule, code: *const c_void, read: impl FnOnce() -> Image) -> Res {
    ctx::current()?;
    if module.is_null() || code.is_null() {
        return Err(err::INVALID_VALUE);
    }
    // Any image loads: the simulator has no ISA to check.
    let image = read();
    let names: Vec<String> = image.globals().into_iter().map(|(n, _)| n).collect();
    let h = new_module(image);
    let m = modules().get(h)?;
    for n in names {
        if let Err(e) = module_global(&m, &n) {
            let _ = unload_module(h);
            return Err(e);
        }
    }
    if let Err(e) = module_code(&m) {
        let _ = unload_module(h);
        return Err(e);
    }
    write(module, h as CUmodule)
}

/// The module's code in the current context: device memory of its code sections' size
/// (`Image::code_bytes`), held with its variables (under the name "", which no symbol has) and
/// given back with them when the module is unloaded or the context goes. The real driver
/// copies a module's code into device memory when it loads it (cuModuleLoad*, which load
/// eagerly; a library's code is loaded into a context at first use under lazy loading, which
/// the simulator does not charge).
fn module_code(m: &Module) -> Res {
    let size = m.image.code_bytes();
    if size == 0 {
        return Ok(());
    }
    let (ch, _) = ctx::current()?;
    let addr = mem::alloc_module_global(size)?;
    let mut g = m.globals.lock().unwrap_or_else(|e| e.into_inner());
    g.insert((ch, String::new()), addr);
    Ok(())
}

/// Unloads a module and the functions got from it.
fn unload_module(module: usize) -> Res {
    let m = modules().remove(module)?;
    let funcs: Vec<usize> = m
        .funcs
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .values()
        .copied()
        .collect();
    for f in funcs {
        let _ = functions().remove(f);
    }
    for (_, addr) in m.globals.lock().unwrap_or_else(|e| e.into_inner()).drain() {
        mem::free_module_global(addr);
    }
    Ok(())
}

export! {
    fn cuModuleLoadData(module: *mut CUmodule, image: *const c_void) { load_module(module, image) }
    fn cuModuleLoadFatBinary(module: *mut CUmodule, image: *const c_void) { load_module(module, image) }
    fn cuModuleLoadDataEx(module: *mut CUmodule, image: *const c_void, nopts: c_uint, _opts: *mut c_void, _vals: *mut *mut c_void) {
        let _ = nopts;
        load_module(module, image)
    }
    fn cuModuleLoad(module: *mut CUmodule, fname: *const c_char) {
        let path = cstr(fname)?;
        if !std::path::Path::new(path).is_file() {
            return Err(err::FILE_NOT_FOUND);
        }
        load_module_of(module, fname as *const c_void, || image_file(path))
    }
    fn cuModuleUnload(module: CUmodule) {
        drv()?;
        unload_module(module as usize)
    }
    fn cuModuleGetFunction(hfunc: *mut CUfunction, module: CUmodule, name: *const c_char) {
        drv()?;
        let m = modules().get(module as usize)?;
        let name = cstr(name)?;
        if hfunc.is_null() {
            return Err(err::INVALID_VALUE);
        }
        write(hfunc, module_function(module as usize, &m, name)? as CUfunction)
    }

    fn cuLibraryLoadData(library: *mut *mut c_void, code: *const c_void, jit_keys: *const c_void, jit_values: *const c_void, jit_n: c_uint, lib_keys: *const c_void, lib_values: *const c_void, lib_n: c_uint) {
        // SAFETY: the caller's image, readable by the driver API's contract.
        load_library(library, code, || unsafe { image::from_ptr(code) }, jit_n, jit_keys, jit_values, lib_n, lib_keys, lib_values)
    }
    fn cuLibraryLoadFromFile(library: *mut *mut c_void, file: *const c_char, jit_keys: *const c_void, jit_values: *const c_void, jit_n: c_uint, lib_keys: *const c_void, lib_values: *const c_void, lib_n: c_uint) {
        drv()?;
        let path = cstr(file)?;
        if !std::path::Path::new(path).is_file() {
            return Err(err::FILE_NOT_FOUND);
        }
        load_library(library, file as *const c_void, || image_file(path), jit_n, jit_keys, jit_values, lib_n, lib_keys, lib_values)
    }
    /// The library goes, and with it its module, its kernels and their functions.
    fn cuLibraryUnload(library: *mut c_void) {
        drv()?;
        let l = libraries().remove(library as usize)?;
        for (_, k) in l.kernels.lock().unwrap_or_else(|e| e.into_inner()).drain() {
            let _ = kernels().remove(k);
        }
        unload_module(l.module)
    }
    /// The library's module in the current context.
    fn cuLibraryGetModule(pmod: *mut CUmodule, library: *mut c_void) {
        let l = libraries().get(library as usize)?;
        ctx::current()?;
        write(pmod, l.module as CUmodule)
    }
    /// The kernel `name`; one handle per name (any name resolves, as in cuModuleGetFunction).
    fn cuLibraryGetKernel(pkernel: *mut *mut c_void, library: *mut c_void, name: *const c_char) {
        drv()?;
        let l = libraries().get(library as usize)?;
        let name = cstr(name)?;
        if pkernel.is_null() {
            return Err(err::INVALID_VALUE);
        }
        let m = modules().get(l.module)?;
        let mut ks = l.kernels.lock().unwrap_or_else(|e| e.into_inner());
        let k = match ks.get(name) {
            Some(&k) => k,
            None => {
                let function = module_function(l.module, &m, name)?;
                let k = kernels().insert(Kernel { function }).0;
                ks.insert(name.to_string(), k);
                k
            }
        };
        write(pkernel, k as *mut c_void)
    }
    /// The variable `name` of the library, in the current context (as cuModuleGetGlobal_v2).
    fn cuLibraryGetGlobal(dptr: *mut CUdeviceptr, bytes: *mut usize, library: *mut c_void, name: *const c_char) {
        drv()?;
        let l = libraries().get(library as usize)?;
        get_global(dptr, bytes, l.module, name)
    }
    /// The kernel's function in the current context (cuda.h: "Returns in pFunc the handle of
    /// the function for the requested kernel kernel and the current context").
    fn cuKernelGetFunction(pfunc: *mut CUfunction, kernel: *mut c_void) {
        drv()?;
        let k = kernels().get(kernel as usize)?;
        ctx::current()?;
        write(pfunc, k.function as CUfunction)
    }
    /// The variable `name` of the module (see `module_global`).
    fn cuModuleGetGlobal_v2(dptr: *mut CUdeviceptr, bytes: *mut usize, module: CUmodule, name: *const c_char) {
        drv()?;
        get_global(dptr, bytes, module as usize, name)
    }
    fn cuFuncGetAttribute(value: *mut i32, attrib: i32, f: CUfunction) {
        drv()?;
        functions().get(f as usize)?;
        let v = match attrib {
            CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK => 1024,
            CU_FUNC_ATTRIBUTE_NUM_REGS => 32,
            1..=3 | 5..=7 | 8..=10 => 0,
            _ => return Err(err::INVALID_VALUE),
        };
        write(value, v)
    }
    fn cuFuncSetAttribute(f: CUfunction, _attrib: i32, _value: i32) {
        drv()?;
        functions().get(f as usize).map(|_| ())
    }
    fn cuFuncSetCacheConfig(f: CUfunction, _config: i32) {
        drv()?;
        functions().get(f as usize).map(|_| ())
    }
    fn cuFuncGetModule(module: *mut CUmodule, f: CUfunction) {
        drv()?;
        let func = functions().get(f as usize)?;
        write(module, func.module as CUmodule)
    }
    fn cuOccupancyMaxActiveBlocksPerMultiprocessor(blocks: *mut i32, f: CUfunction, block_size: i32, _smem: usize) {
        drv()?;
        functions().get(f as usize)?;
        if !(1..=1024).contains(&block_size) {
            return Err(err::INVALID_VALUE);
        }
        write(blocks, (2048 / block_size).min(32))
    }
    /// `flags` may be CU_OCCUPANCY_DEFAULT (0) or CU_OCCUPANCY_DISABLE_CACHING_OVERRIDE (1); the
    /// simulator has no cache configuration to override, so both answer as the call without flags.
    fn cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(blocks: *mut i32, f: CUfunction, block_size: i32, smem: usize, flags: c_uint) {
        if flags > 1 {
            return Err(err::INVALID_VALUE);
        }
        match cuOccupancyMaxActiveBlocksPerMultiprocessor(blocks, f, block_size, smem) {
            err::SUCCESS => Ok(()),
            e => Err(e),
        }
    }
    /// cuKernelGetAttribute (CUDA 12.0): a library kernel answers as the function it stands for
    /// in the current context (`cuKernelGetFunction`) does.
    fn cuKernelGetAttribute(value: *mut i32, attrib: i32, kernel: *mut c_void, dev: CUdevice) {
        drv()?;
        let k = kernels().get(kernel as usize)?;
        ctx::device(dev)?;
        match cuFuncGetAttribute(value, attrib, k.function as CUfunction) {
            err::SUCCESS => Ok(()),
            e => Err(e),
        }
    }
    fn cuKernelSetAttribute(attrib: i32, value: i32, kernel: *mut c_void, dev: CUdevice) {
        drv()?;
        let k = kernels().get(kernel as usize)?;
        ctx::device(dev)?;
        match cuFuncSetAttribute(k.function as CUfunction, attrib, value) {
            err::SUCCESS => Ok(()),
            e => Err(e),
        }
    }

    fn cuLaunchKernel(f: CUfunction, gx: c_uint, gy: c_uint, gz: c_uint, bx: c_uint, by: c_uint, bz: c_uint, _smem: c_uint, s: CUstream, params: *mut *mut c_void, extra: *mut *mut c_void) {
        launch(f, Dims { grid: [gx, gy, gz], block: [bx, by, bz] }, params, extra, s, false, false)
    }
    fn cuLaunchKernel_ptsz(f: CUfunction, gx: c_uint, gy: c_uint, gz: c_uint, bx: c_uint, by: c_uint, bz: c_uint, _smem: c_uint, s: CUstream, params: *mut *mut c_void, extra: *mut *mut c_void) {
        launch(f, Dims { grid: [gx, gy, gz], block: [bx, by, bz] }, params, extra, s, true, false)
    }
    fn cuLaunchCooperativeKernel(f: CUfunction, gx: c_uint, gy: c_uint, gz: c_uint, bx: c_uint, by: c_uint, bz: c_uint, _smem: c_uint, s: CUstream, params: *mut *mut c_void) {
        launch(f, Dims { grid: [gx, gy, gz], block: [bx, by, bz] }, params, std::ptr::null_mut(), s, false, true)
    }
    fn cuLaunchCooperativeKernel_ptsz(f: CUfunction, gx: c_uint, gy: c_uint, gz: c_uint, bx: c_uint, by: c_uint, bz: c_uint, _smem: c_uint, s: CUstream, params: *mut *mut c_void) {
        launch(f, Dims { grid: [gx, gy, gz], block: [bx, by, bz] }, params, std::ptr::null_mut(), s, true, true)
    }
    fn cuLaunchKernelEx(cfg: *const CUlaunchConfig, f: CUfunction, params: *mut *mut c_void, extra: *mut *mut c_void) {
        launch_ex(cfg, f, params, extra, false)
    }
    fn cuLaunchKernelEx_ptsz(cfg: *const CUlaunchConfig, f: CUfunction, params: *mut *mut c_void, extra: *mut *mut c_void) {
        launch_ex(cfg, f, params, extra, true)
    }
    fn cuLaunchHostFunc(s: CUstream, f: Option<extern "C" fn(*mut c_void)>, data: *mut c_void) { host_func(s, f, data, false) }
    fn cuLaunchHostFunc_ptsz(s: CUstream, f: Option<extern "C" fn(*mut c_void)>, data: *mut c_void) { host_func(s, f, data, true) }

    fn cuStreamCreate(out: *mut CUstream, flags: c_uint) { create_stream(out, flags, 0) }
    fn cuStreamCreateWithPriority(out: *mut CUstream, flags: c_uint, priority: i32) { create_stream(out, flags, priority) }
    fn cuStreamDestroy_v2(s: CUstream) {
        drv()?;
        streams().remove(s as usize).map(|_| ())
    }
    fn cuStreamSynchronize(s: CUstream) { stream_sync(s, false) }
    fn cuStreamSynchronize_ptsz(s: CUstream) { stream_sync(s, true) }
    fn cuStreamQuery(s: CUstream) { stream_query(s, false) }
    fn cuStreamQuery_ptsz(s: CUstream) { stream_query(s, true) }
    fn cuStreamWaitEvent(s: CUstream, e: CUevent, flags: c_uint) { stream_wait_event(s, e, flags, false) }
    fn cuStreamWaitEvent_ptsz(s: CUstream, e: CUevent, flags: c_uint) { stream_wait_event(s, e, flags, true) }
    fn cuStreamGetCtx(s: CUstream, pctx: *mut CUcontext) {
        let st = stream(s, false)?;
        write(pctx, st.ctx.load(Relaxed) as CUcontext)
    }
    fn cuStreamGetCtx_ptsz(s: CUstream, pctx: *mut CUcontext) {
        let st = stream(s, true)?;
        write(pctx, st.ctx.load(Relaxed) as CUcontext)
    }
    fn cuStreamGetCtx_v2(s: CUstream, pctx: *mut CUcontext, green: *mut *mut c_void) { stream_ctx(s, pctx, green, false) }
    fn cuStreamGetCtx_v2_ptsz(s: CUstream, pctx: *mut CUcontext, green: *mut *mut c_void) { stream_ctx(s, pctx, green, true) }
    fn cuStreamGetFlags(s: CUstream, flags: *mut c_uint) { write(flags, stream(s, false)?.flags) }
    fn cuStreamGetFlags_ptsz(s: CUstream, flags: *mut c_uint) { write(flags, stream(s, true)?.flags) }
    fn cuStreamGetPriority(s: CUstream, p: *mut i32) { write(p, stream(s, false)?.priority) }
    fn cuStreamGetPriority_ptsz(s: CUstream, p: *mut i32) { write(p, stream(s, true)?.priority) }

    /// CUDA 10.0's form: no mode argument (global mode).
    fn cuStreamBeginCapture(s: CUstream) { begin_capture(s, 0, false) }
    fn cuStreamBeginCapture_ptsz(s: CUstream) { begin_capture(s, 0, true) }
    fn cuStreamBeginCapture_v2(s: CUstream, mode: i32) { begin_capture(s, mode, false) }
    fn cuStreamBeginCapture_v2_ptsz(s: CUstream, mode: i32) { begin_capture(s, mode, true) }
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
    /// Sets the thread's capture mode to `*mode` and writes the previous one back.
    fn cuThreadExchangeStreamCaptureMode(mode: *mut i32) {
        drv()?;
        let want = read(mode as *const i32)?;
        if !(CAPTURE_MODE_GLOBAL..=CAPTURE_MODE_RELAXED).contains(&want) {
            return Err(err::INVALID_VALUE);
        }
        write(mode, CAPTURE_MODE.with(|m| m.replace(want)))
    }

    fn cuEventCreate(out: *mut CUevent, flags: c_uint) {
        ctx::current()?;
        if flags & !CU_EVENT_FLAGS_MASK != 0 {
            return Err(err::INVALID_VALUE);
        }
        if out.is_null() {
            return Err(err::INVALID_VALUE);
        }
        let (h, _) = events().insert(Event { flags, time: AtomicU64::new(0) });
        write(out, h as CUevent)
    }
    fn cuEventRecord(e: CUevent, s: CUstream) { event_record(e, s, false) }
    fn cuEventRecord_ptsz(e: CUevent, s: CUstream) { event_record(e, s, true) }
    fn cuEventRecordWithFlags(e: CUevent, s: CUstream, _flags: c_uint) { event_record(e, s, false) }
    fn cuEventRecordWithFlags_ptsz(e: CUevent, s: CUstream, _flags: c_uint) { event_record(e, s, true) }
    /// An event never recorded counts as complete (the driver's documented behaviour).
    fn cuEventQuery(e: CUevent) {
        drv()?;
        let ev = events().get(e as usize)?;
        if now_ns() >= ev.time.load(Acquire) { Ok(()) } else { Err(err::NOT_READY) }
    }
    fn cuEventSynchronize(e: CUevent) {
        drv()?;
        let ev = events().get(e as usize)?;
        sleep_until(ev.time.load(Acquire));
        // "the allocator will try to release memory back to the OS on the next call to stream,
        // event or context synchronize" (CU_MEMPOOL_ATTR_RELEASE_THRESHOLD).
        mem::trim_all_pools_at_sync();
        Ok(())
    }
    fn cuEventElapsedTime(ms: *mut f32, start: CUevent, end: CUevent) { elapsed(ms, start, end) }
    fn cuEventElapsedTime_v2(ms: *mut f32, start: CUevent, end: CUevent) { elapsed(ms, start, end) }
    fn cuEventDestroy_v2(e: CUevent) {
        drv()?;
        events().remove(e as usize).map(|_| ())
    }

    fn cuGraphCreate(g: *mut CUgraph, flags: c_uint) {
        drv()?;
        if g.is_null() || flags != 0 {
            return Err(err::INVALID_VALUE);
        }
        let (h, _) = new_graph();
        write(g, h as CUgraph)
    }
    fn cuGraphAddKernelNode(node: *mut CUgraphNode, g: CUgraph, deps: *const CUgraphNode, ndeps: usize, p: *const CUDA_KERNEL_NODE_PARAMS) {
        add_kernel_node(node, g, deps, ndeps, p)
    }
    /// The v2 parameter struct extends v1 at its end (kern, ctx), so the prefix reads the same.
    fn cuGraphAddKernelNode_v2(node: *mut CUgraphNode, g: CUgraph, deps: *const CUgraphNode, ndeps: usize, p: *const CUDA_KERNEL_NODE_PARAMS) {
        add_kernel_node(node, g, deps, ndeps, p)
    }
    fn cuGraphInstantiate(exec: *mut CUgraphExec, g: CUgraph, _err_node: *mut CUgraphNode, _log: *mut c_char, _log_size: usize) {
        instantiate(exec, g)
    }
    fn cuGraphInstantiate_v2(exec: *mut CUgraphExec, g: CUgraph, _err_node: *mut CUgraphNode, _log: *mut c_char, _log_size: usize) {
        instantiate(exec, g)
    }
    fn cuGraphInstantiateWithFlags(exec: *mut CUgraphExec, g: CUgraph, flags: u64) {
        instantiate_flags(exec, g, flags).map(|_| ())
    }
    fn cuGraphInstantiateWithParams(exec: *mut CUgraphExec, g: CUgraph, p: *mut InstantiateParams) {
        instantiate_with_params(exec, g, p, false)
    }
    fn cuGraphInstantiateWithParams_ptsz(exec: *mut CUgraphExec, g: CUgraph, p: *mut InstantiateParams) {
        instantiate_with_params(exec, g, p, true)
    }
    fn cuGraphLaunch(exec: CUgraphExec, s: CUstream) { graph_launch(exec, s, false) }
    fn cuGraphLaunch_ptsz(exec: CUgraphExec, s: CUstream) { graph_launch(exec, s, true) }
    fn cuGraphExecDestroy(exec: CUgraphExec) {
        drv()?;
        execs().remove(exec as usize).map(|_| ())
    }
    /// The graph goes; its allocation nodes' addresses go when its executable is gone too.
    fn cuGraphDestroy(g: CUgraph) {
        drv()?;
        let gr = graphs().remove(g as usize)?;
        graph_bases().lock().unwrap_or_else(|e| e.into_inner()).remove(&gr.base);
        Ok(())
    }
    fn cuGraphUpload(exec: CUgraphExec, s: CUstream) { graph_upload(exec, s, false) }
    fn cuGraphUpload_ptsz(exec: CUgraphExec, s: CUstream) { graph_upload(exec, s, true) }
    /// A memory-allocation node: an address now ("it returns the address of the allocation in
    /// nodeParams.dptr. The allocation's address remains fixed across instantiations and
    /// launches", CUDA driver API reference), memory only when the graph runs.
    fn cuGraphAddMemAllocNode(node: *mut CUgraphNode, g: CUgraph, deps: *const CUgraphNode, ndeps: usize, p: *mut CUDA_MEM_ALLOC_NODE_PARAMS) {
        add_node(node, g, deps, ndeps, || {
            let mut params: CUDA_MEM_ALLOC_NODE_PARAMS = read(p as *const CUDA_MEM_ALLOC_NODE_PARAMS)?;
            if params.poolProps.location.type_ != CU_MEM_LOCATION_TYPE_DEVICE {
                return Err(err::INVALID_VALUE);
            }
            let (dev, _) = ctx::device(params.poolProps.location.id)?;
            let a = mem::graph_alloc_new(dev, params.bytesize as u64)?;
            params.dptr = a.addr as CUdeviceptr;
            write(p, params)?;
            Ok(Op::Alloc(Arc::new(NodeAlloc(a))))
        })
    }
    fn cuGraphAddMemFreeNode(node: *mut CUgraphNode, g: CUgraph, deps: *const CUgraphNode, ndeps: usize, dptr: CUdeviceptr) {
        let gr = graphs().get(g as usize)?;
        add_node(node, g, deps, ndeps, || free_op(&gr, dptr as u64))
    }
    fn cuGraphMemAllocNodeGetParams(node: CUgraphNode, out: *mut CUDA_MEM_ALLOC_NODE_PARAMS) {
        drv()?;
        let Op::Alloc(a) = node_of(node)? else {
            return Err(err::INVALID_VALUE);
        };
        let props = CUmemPoolProps {
            allocType: CU_MEM_ALLOCATION_TYPE_PINNED,
            handleTypes: 0,
            location: CUmemLocation { type_: CU_MEM_LOCATION_TYPE_DEVICE, id: a.0.dev as i32 },
            win32SecurityAttributes: std::ptr::null_mut(),
            maxSize: 0,
            usage: 0,
            reserved: [0; 54],
        };
        write(out, CUDA_MEM_ALLOC_NODE_PARAMS {
            poolProps: props,
            accessDescs: std::ptr::null(),
            accessDescCount: 0,
            bytesize: a.0.bytesize as usize,
            dptr: a.0.addr as CUdeviceptr,
        })
    }
    fn cuGraphMemFreeNodeGetParams(node: CUgraphNode, dptr: *mut CUdeviceptr) {
        drv()?;
        let Op::Free(addr) = node_of(node)? else {
            return Err(err::INVALID_VALUE);
        };
        write(dptr, addr as CUdeviceptr)
    }
    /// `CUgraphNodeType` of a node the simulator makes: kernel, memory allocation, memory free.
    fn cuGraphNodeGetType(node: CUgraphNode, ty: *mut i32) {
        drv()?;
        write(ty, match node_of(node)? {
            Op::Kernel(_) => CU_GRAPH_NODE_TYPE_KERNEL,
            Op::Alloc(_) => CU_GRAPH_NODE_TYPE_MEM_ALLOC,
            Op::Free(_) => CU_GRAPH_NODE_TYPE_MEM_FREE,
        })
    }
    fn cuGraphGetNodes(g: CUgraph, nodes: *mut CUgraphNode, count: *mut usize) {
        drv()?;
        let gr = graphs().get(g as usize)?;
        let n = gr.len();
        if nodes.is_null() {
            return write(count, n);
        }
        let want = read(count as *const usize)?;
        for i in 0..want.min(n) {
            write(nodes.wrapping_add(i), node_handle(gr.base, i) as CUgraphNode)?;
        }
        write(count, want.min(n))
    }
}

fn create_stream(out: *mut CUstream, flags: c_uint, priority: i32) -> Res {
    let (ch, c) = ctx::current()?;
    if flags & !CU_STREAM_NON_BLOCKING != 0 || out.is_null() {
        return Err(err::INVALID_VALUE);
    }
    let (h, s) = streams().insert(Stream::new(
        c.dev,
        flags,
        priority.clamp(-5, 0),
        c.work_tail.clone(),
    ));
    s.set_ctx(ch);
    write(out, h as CUstream)
}

fn elapsed(ms: *mut f32, start: CUevent, end: CUevent) -> Res {
    drv()?;
    let a = events().get(start as usize)?;
    let b = events().get(end as usize)?;
    if (a.flags | b.flags) & CU_EVENT_DISABLE_TIMING != 0 {
        return Err(err::INVALID_HANDLE);
    }
    let (ta, tb) = (a.time.load(Acquire), b.time.load(Acquire));
    if ta == 0 || tb == 0 {
        return Err(err::INVALID_HANDLE);
    }
    let now = now_ns();
    if now < ta || now < tb {
        return Err(err::NOT_READY);
    }
    write(ms, (tb as f64 - ta as f64) as f32 / 1e6)
}
