//! CUDA graphs and stream capture: graphs built by hand (every node kind a program makes:
//! kernel, memcpy, memset, host, child graph, empty, event record / wait, memory allocation /
//! free), their edges, clones, executables (instantiate, update, per-node parameters, enable,
//! launch in dependency order), user objects, and stream capture that records a stream's work
//! (forked and joined across streams through events) into the same graph a program would build.
//!
//! Facts come from CUDA 13.5's `cuda.h` (the doc comment of each function, cited by name) and
//! the CUDA Programming Guide, "CUDA Graphs".
//!
//! What the rest of the driver calls (kept narrow so that the stream and event code can move):
//! `capturing`, `refuse_if_capturing`, `check_unsafe_call`, `event_captured` and the
//! `capture_*` hooks, each answering `None` when the stream is not capturing.

use crate::exec::{self, Dims, Node, Stream};
use crate::{cstr, ctx, drv, export, mem, read, write, Registry, Res};
use cuvisor_cuda_abi::cuda::*;
use cuvisor_sim::state::{now_ns, sleep_until};
use std::cell::Cell;
use std::collections::{BTreeSet, HashMap, HashSet};
use std::ffi::{c_char, c_uint, c_void};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::*};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::thread::ThreadId;

// ---- values from cuda.h (CUDA 13.5) the ABI crate does not carry ---------------------------------

/// `CUresult`: "the operation would have resulted in a merge of two independent capture
/// sequences" (902), "a fork that was not joined to the primary stream" (904), "a dependency
/// would have been created which crosses the capture sequence boundary" (905), "a disallowed
/// implicit dependency on a current capture sequence from cudaStreamLegacy" (906), "not permitted
/// on an event which was last recorded in a capturing stream" (907), "the graph update was not
/// performed" (910).
const STREAM_CAPTURE_MERGE: CUresult = 902;
const STREAM_CAPTURE_UNJOINED: CUresult = 904;
const STREAM_CAPTURE_ISOLATION: CUresult = 905;
const STREAM_CAPTURE_IMPLICIT: CUresult = 906;
const CAPTURED_EVENT: CUresult = 907;
const GRAPH_EXEC_UPDATE_FAILURE: CUresult = 910;
const OPERATING_SYSTEM: CUresult = 304;

/// `CUgraphNodeType`.
const T_KERNEL: i32 = 0;
const T_MEMCPY: i32 = 1;
const T_MEMSET: i32 = 2;
const T_HOST: i32 = 3;
const T_GRAPH: i32 = 4;
const T_EMPTY: i32 = 5;
const T_WAIT_EVENT: i32 = 6;
const T_EVENT_RECORD: i32 = 7;
const T_MEM_ALLOC: i32 = 10;
const T_MEM_FREE: i32 = 11;

/// `CUgraphExecUpdateResult`.
const UPDATE_SUCCESS: i32 = 0;
const UPDATE_TOPOLOGY_CHANGED: i32 = 2;
const UPDATE_NODE_TYPE_CHANGED: i32 = 3;
const UPDATE_PARAMETERS_CHANGED: i32 = 5;

/// `CUmemorytype`: HOST 1, DEVICE 2, ARRAY 3, UNIFIED 4.
const MEMTYPE_ARRAY: c_uint = 3;
const MEMTYPE_UNIFIED: c_uint = 4;

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
/// `CUuserObject_flags`: CU_USER_OBJECT_NO_DESTRUCTOR_SYNC, "Currently it is required to pass"
/// (cuUserObjectCreate). `CUuserObjectRetain_flags`: CU_GRAPH_USER_OBJECT_MOVE.
const USER_OBJECT_NO_DESTRUCTOR_SYNC: c_uint = 1;
const GRAPH_USER_OBJECT_MOVE: c_uint = 1;

/// `CUgraphInstantiate_flags`: AUTO_FREE_ON_LAUNCH 1, UPLOAD 2, DEVICE_LAUNCH 4,
/// USE_NODE_PRIORITY 8.
const INSTANTIATE_FLAGS: u64 = 1 | 2 | 4 | 8;
const INSTANTIATE_FLAG_DEVICE_LAUNCH: u64 = 4;

type HostFn = Option<extern "C" fn(*mut c_void)>;

// ---- parameter structs (cuda.h layouts) -----------------------------------------------------------

/// `CUDA_MEMCPY3D` (v2).
#[repr(C)]
#[derive(Clone, Copy, PartialEq, Debug)]
pub struct Memcpy3D {
    src_x: usize,
    src_y: usize,
    src_z: usize,
    src_lod: usize,
    src_type: c_uint,
    src_host: usize,
    src_dev: u64,
    src_array: usize,
    reserved0: usize,
    src_pitch: usize,
    src_height: usize,
    dst_x: usize,
    dst_y: usize,
    dst_z: usize,
    dst_lod: usize,
    dst_type: c_uint,
    dst_host: usize,
    dst_dev: u64,
    dst_array: usize,
    reserved1: usize,
    dst_pitch: usize,
    dst_height: usize,
    width: usize,
    height: usize,
    depth: usize,
}

/// `CUDA_MEMCPY_NODE_PARAMS` (in `CUgraphNodeParams`).
#[repr(C)]
#[derive(Clone, Copy)]
struct MemcpyNodeParams {
    flags: i32,
    reserved: i32,
    ctx: usize,
    copy: Memcpy3D,
}

/// `CUDA_MEMSET_NODE_PARAMS` (v1; v2 appends the context).
#[repr(C)]
#[derive(Clone, Copy, PartialEq, Debug)]
pub struct MemsetParams {
    dst: u64,
    pitch: usize,
    value: c_uint,
    elem: c_uint,
    width: usize,
    height: usize,
}

/// `CUDA_HOST_NODE_PARAMS` (v1; v2 appends sync mode and context).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct HostParams {
    f: HostFn,
    data: usize,
}

/// `CUDA_KERNEL_NODE_PARAMS_v2` (= v3): v1, then `kern` and `ctx`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct KernelParamsV2 {
    v1: CUDA_KERNEL_NODE_PARAMS,
    kern: *mut c_void,
    ctx: *mut c_void,
}

/// `CUgraphNodeParams` (CUDA 12.2): type, 3 reserved ints, a 232-byte union, a reserved i64.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct NodeParams {
    ty: i32,
    reserved0: [i32; 3],
    u: [u64; 29],
    reserved2: i64,
}

/// `CUgraphExecUpdateResultInfo`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct UpdateResultInfo {
    result: i32,
    error_node: CUgraphNode,
    error_from: CUgraphNode,
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

// ---- nodes and graphs -----------------------------------------------------------------------------

/// A kernel node. The driver copies the parameters when the node is made ("Kernel parameters
/// ... are copied", cuGraphAddKernelNode); the simulator knows one parameter, a `sim_busy*`
/// kernel's run time, and keeps its copy so that cuGraphKernelNodeGetParams can point at it.
#[derive(Clone)]
struct KernelNode {
    func: usize,
    kern: usize,
    grid: [c_uint; 3],
    block: [c_uint; 3],
    smem: c_uint,
    ns: u64,
    arg: Option<Arc<KArg>>,
}

/// The copied first parameter of a `sim_busy*` kernel, and the one-entry `kernelParams` array
/// that points at it.
struct KArg {
    /// Kept alive for `ptrs`, which points at it.
    _val: Box<u64>,
    ptrs: Box<[usize; 1]>,
}

impl KArg {
    fn new(v: u64) -> Arc<KArg> {
        let val = Box::new(v);
        let ptrs = Box::new([&*val as *const u64 as usize]);
        Arc::new(KArg { _val: val, ptrs })
    }
}

/// A memory-allocation node's allocation, shared by its graph and the graph's executables: its
/// address is given back when all are gone (and the allocation is not live).
struct NodeAlloc(Arc<mem::GraphAlloc>);

impl Drop for NodeAlloc {
    fn drop(&mut self) {
        mem::graph_alloc_orphan(&self.0);
    }
}

#[derive(Clone)]
enum Kind {
    Kernel(KernelNode),
    Memcpy(Memcpy3D),
    Memset(MemsetParams),
    Host(HostParams),
    /// A child graph node of a graph: the graph the node owns (a clone of the one given).
    Child(usize),
    /// A child graph node of an executable: the child's nodes as instantiated.
    Inline(Arc<Vec<Option<NodeRec>>>),
    Empty,
    EventRecord(usize),
    EventWait(usize),
    Alloc(Arc<NodeAlloc>),
    Free(u64),
}

impl Kind {
    fn ty(&self) -> i32 {
        match self {
            Kind::Kernel(_) => T_KERNEL,
            Kind::Memcpy(_) => T_MEMCPY,
            Kind::Memset(_) => T_MEMSET,
            Kind::Host(_) => T_HOST,
            Kind::Child(_) | Kind::Inline(_) => T_GRAPH,
            Kind::Empty => T_EMPTY,
            Kind::EventRecord(_) => T_EVENT_RECORD,
            Kind::EventWait(_) => T_WAIT_EVENT,
            Kind::Alloc(_) => T_MEM_ALLOC,
            Kind::Free(_) => T_MEM_FREE,
        }
    }
}

/// A node: what it does, the nodes it depends on (indices in its graph, in edge order), and
/// (in an executable) whether it is enabled.
#[derive(Clone)]
struct NodeRec {
    kind: Kind,
    deps: Vec<usize>,
    enabled: bool,
}

pub(crate) struct Graph {
    /// Node handles are `base + index + 1` (see `node_handle`).
    base: usize,
    st: Mutex<GState>,
}

#[derive(Default)]
struct GState {
    /// Indexed by node; `None` where a node was destroyed (indices stay stable).
    nodes: Vec<Option<NodeRec>>,
    /// User objects this graph holds references to, and how many.
    uobjs: HashMap<usize, u32>,
    /// The graph this one was cloned from (its base): nodes keep their index in a clone.
    clone_of: Option<usize>,
    /// The executable of a graph with memory nodes ("there can be at most one executable graph
    /// in existence for that graph at a time", cuGraphInstantiate).
    mem_exec: Option<Weak<GraphExec>>,
}

impl Graph {
    fn lock(&self) -> MutexGuard<'_, GState> {
        self.st.lock().unwrap_or_else(|e| e.into_inner())
    }
    fn push(&self, kind: Kind, deps: Vec<usize>) -> usize {
        let mut st = self.lock();
        st.nodes.push(Some(NodeRec {
            kind,
            deps,
            enabled: true,
        }));
        st.nodes.len() - 1
    }
}

struct GraphExec {
    /// The base of the graph it was instantiated from: its node handles name this one's nodes.
    base: usize,
    nodes: Mutex<Vec<Option<NodeRec>>>,
    /// CUgraphInstantiate_flags.
    flags: u64,
    /// User-object references the executable holds (those of its graph at instantiation).
    uobjs: Vec<(usize, u32)>,
}

impl Drop for GraphExec {
    fn drop(&mut self) {
        for &(o, n) in &self.uobjs {
            let _ = user_object_release(o, n);
        }
    }
}

/// Node handles: each graph gets a range of 2^32 values of its own, far above any address a
/// registry handle (a heap pointer) can have, so that a node names its graph.
const NODE_RANGE: usize = 1 << 32;
const NODE_BASE: usize = 1 << 56;

fn node_handle(base: usize, index: usize) -> usize {
    base + index + 1
}

fn graphs() -> &'static Registry<Graph> {
    static R: OnceLock<Registry<Graph>> = OnceLock::new();
    R.get_or_init(Registry::new)
}
fn execs() -> &'static Registry<GraphExec> {
    static R: OnceLock<Registry<GraphExec>> = OnceLock::new();
    R.get_or_init(Registry::new)
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
        st: Mutex::new(GState::default()),
    });
    graph_bases()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(base, h);
    (h, g)
}

/// The graph a node handle belongs to, and the node's index (the node alive).
fn locate(h: CUgraphNode) -> Result<(Arc<Graph>, usize), CUresult> {
    let (base, i) = split(h)?;
    let g = graph_bases()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&base)
        .copied()
        .ok_or(err::INVALID_VALUE)?;
    let g = graphs().get(g).map_err(|_| err::INVALID_VALUE)?;
    if !matches!(g.lock().nodes.get(i), Some(Some(_))) {
        return Err(err::INVALID_VALUE);
    }
    Ok((g, i))
}

/// A node handle's (graph base, index).
fn split(h: CUgraphNode) -> Result<(usize, usize), CUresult> {
    let h = h as usize;
    let off = h.checked_sub(NODE_BASE).ok_or(err::INVALID_VALUE)?;
    let base = off / NODE_RANGE * NODE_RANGE + NODE_BASE;
    let i = (h - base).checked_sub(1).ok_or(err::INVALID_VALUE)?;
    Ok((base, i))
}

fn node_rec(h: CUgraphNode) -> Result<NodeRec, CUresult> {
    let (g, i) = locate(h)?;
    let st = g.lock();
    Ok(st.nodes[i].clone().expect("located"))
}

/// Replaces a node's kind, keeping its type: CUDA_ERROR_INVALID_VALUE for a node of another
/// type (each Set/GetParams function names "hNode - Node to ..." of its own kind).
fn set_kind(h: CUgraphNode, kind: Kind) -> Res {
    let (g, i) = locate(h)?;
    let mut st = g.lock();
    let n = st.nodes[i].as_mut().expect("located");
    if n.kind.ty() != kind.ty() {
        return Err(err::INVALID_VALUE);
    }
    let old = std::mem::replace(&mut n.kind, kind);
    drop(st);
    if let Kind::Child(c) = old {
        destroy_graph(c);
    }
    Ok(())
}

/// Reads the `n` node handles of `deps` as indices of `g`: each a live node of that graph,
/// none twice (CUDA_ERROR_INVALID_VALUE otherwise).
fn dep_indices(g: &Graph, deps: *const CUgraphNode, n: usize) -> Result<Vec<usize>, CUresult> {
    if n > 0 && deps.is_null() {
        return Err(err::INVALID_VALUE);
    }
    let st = g.lock();
    let mut out = Vec::with_capacity(n);
    for k in 0..n {
        let (base, i) = split(read(deps.wrapping_add(k))?)?;
        if base != g.base || !matches!(st.nodes.get(i), Some(Some(_))) || out.contains(&i) {
            return Err(err::INVALID_VALUE);
        }
        out.push(i);
    }
    Ok(out)
}

/// Adds a node after checking the common arguments; `make` builds it.
fn add_node(
    node: *mut CUgraphNode,
    graph: CUgraph,
    deps: *const CUgraphNode,
    ndeps: usize,
    make: impl FnOnce(&Graph) -> Result<Kind, CUresult>,
) -> Res {
    drv()?;
    let g = graphs().get(graph as usize)?;
    if node.is_null() {
        return Err(err::INVALID_VALUE);
    }
    let d = dep_indices(&g, deps, ndeps)?;
    let kind = make(&g)?;
    let i = g.push(kind, d);
    write(node, node_handle(g.base, i) as CUgraphNode)
}

/// Destroys a graph and the child graphs its nodes own, giving back its user-object references.
fn destroy_graph(h: usize) {
    let Ok(g) = graphs().remove(h) else { return };
    graph_bases()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .remove(&g.base);
    let (children, uobjs) = {
        let mut st = g.lock();
        let c: Vec<usize> = st
            .nodes
            .iter()
            .flatten()
            .filter_map(|n| match n.kind {
                Kind::Child(c) => Some(c),
                _ => None,
            })
            .collect();
        (c, std::mem::take(&mut st.uobjs))
    };
    for c in children {
        destroy_graph(c);
    }
    for (o, n) in uobjs {
        let _ = user_object_release(o, n);
    }
}

/// Whether graph `h`, or a child graph in it, has memory allocation or free nodes.
fn has_mem_nodes(h: usize) -> bool {
    let Ok(g) = graphs().get(h) else { return false };
    let nodes = g.lock().nodes.clone();
    nodes.iter().flatten().any(|n| match n.kind {
        Kind::Alloc(_) | Kind::Free(_) => true,
        Kind::Child(c) => has_mem_nodes(c),
        _ => false,
    })
}

/// A copy of graph `h` (cuGraphClone, and child graph nodes, which own a clone of the graph
/// they are given): same nodes at the same indices, child graphs cloned in turn. "Cloning is not
/// supported for graphs which contain memory allocation nodes, memory free nodes"
/// (cuGraphClone; cuGraphAddChildGraphNode: "this call will return an error"):
/// CUDA_ERROR_INVALID_VALUE.
fn clone_graph(h: usize) -> Result<usize, CUresult> {
    let g = graphs().get(h)?;
    if has_mem_nodes(h) {
        return Err(err::INVALID_VALUE);
    }
    let (mut nodes, uobjs) = {
        let st = g.lock();
        (st.nodes.clone(), st.uobjs.clone())
    };
    for n in nodes.iter_mut().flatten() {
        if let Kind::Child(c) = n.kind {
            n.kind = Kind::Child(clone_graph(c)?);
        }
    }
    for (&o, &n) in &uobjs {
        user_object_retain(o, n)?;
    }
    let (ch, c) = new_graph();
    let mut st = c.lock();
    st.nodes = nodes;
    st.uobjs = uobjs;
    st.clone_of = Some(g.base);
    Ok(ch)
}

/// The nodes of graph `h` as an executable holds them: child graphs inlined.
fn snapshot(h: usize) -> Result<Vec<Option<NodeRec>>, CUresult> {
    let g = graphs().get(h)?;
    let nodes = g.lock().nodes.clone();
    nodes
        .into_iter()
        .map(|n| {
            n.map(|mut r| {
                if let Kind::Child(c) = r.kind {
                    r.kind = Kind::Inline(Arc::new(snapshot(c)?));
                }
                Ok(r)
            })
            .transpose()
        })
        .collect()
}

/// A graph made of an executable's nodes (a graph launched into a capturing stream becomes a
/// child graph node holding such a graph).
fn graph_of(nodes: &[Option<NodeRec>]) -> usize {
    let mapped = nodes
        .iter()
        .map(|n| {
            n.clone().map(|mut r| {
                if let Kind::Inline(c) = &r.kind {
                    r.kind = Kind::Child(graph_of(c));
                }
                r.enabled = true;
                r
            })
        })
        .collect();
    let (h, g) = new_graph();
    g.lock().nodes = mapped;
    h
}

/// The live nodes in an order that respects every edge (the lowest index first among those
/// ready), or None if the edges make a cycle.
fn topo(nodes: &[Option<NodeRec>]) -> Option<Vec<usize>> {
    let mut indeg = vec![0usize; nodes.len()];
    let mut out: Vec<Vec<usize>> = vec![Vec::new(); nodes.len()];
    let mut ready = BTreeSet::new();
    let mut live = 0;
    for (i, n) in nodes.iter().enumerate() {
        let Some(n) = n else { continue };
        live += 1;
        indeg[i] = n.deps.len();
        for &d in &n.deps {
            out[d].push(i);
        }
        if n.deps.is_empty() {
            ready.insert(i);
        }
    }
    let mut order = Vec::with_capacity(live);
    while let Some(i) = ready.pop_first() {
        order.push(i);
        for &j in &out[i] {
            indeg[j] -= 1;
            if indeg[j] == 0 {
                ready.insert(j);
            }
        }
    }
    (order.len() == live).then_some(order)
}

/// What a launch runs, in order: child graphs inlined, disabled nodes left out ("Disabled nodes
/// are functionally equivalent to empty nodes", cuGraphNodeSetEnabled).
fn flat<'a>(nodes: &'a [Option<NodeRec>], out: &mut Vec<&'a Kind>) {
    for i in topo(nodes).unwrap_or_default() {
        let n = nodes[i].as_ref().expect("live");
        match &n.kind {
            Kind::Inline(c) => flat(c, out),
            _ if !n.enabled => {}
            k => out.push(k),
        }
    }
}

// ---- node parameters ------------------------------------------------------------------------------

/// A kernel node from its parameters: the function (or, in the v2 layout, the library kernel
/// when `func` is NULL), checked launch dimensions, and the run time from its parameters.
fn kernel_node(p: &CUDA_KERNEL_NODE_PARAMS, kern: *mut c_void) -> Result<KernelNode, CUresult> {
    let f = if p.func.is_null() { kern } else { p.func };
    let func = exec::function_or_kernel(f as CUfunction)?;
    let grid = [p.gridDimX, p.gridDimY, p.gridDimZ];
    let block = [p.blockDimX, p.blockDimY, p.blockDimZ];
    exec::check_dims(&Dims { grid, block }, false, 0)?;
    let ns = exec::kernel_ns(&func, p.kernelParams, p.extra)?;
    Ok(KernelNode {
        func: p.func as usize,
        kern: if p.func.is_null() { kern as usize } else { 0 },
        grid,
        block,
        smem: p.sharedMemBytes,
        ns,
        arg: func.busy.then(|| KArg::new(ns)),
    })
}

fn kernel_params(k: &KernelNode) -> KernelParamsV2 {
    KernelParamsV2 {
        v1: CUDA_KERNEL_NODE_PARAMS {
            func: k.func as CUfunction,
            gridDimX: k.grid[0],
            gridDimY: k.grid[1],
            gridDimZ: k.grid[2],
            blockDimX: k.block[0],
            blockDimY: k.block[1],
            blockDimZ: k.block[2],
            sharedMemBytes: k.smem,
            kernelParams: k.arg.as_ref().map_or(std::ptr::null_mut(), |a| {
                a.ptrs.as_ptr() as *mut *mut c_void
            }),
            extra: std::ptr::null_mut(),
        },
        kern: k.kern as *mut c_void,
        ctx: std::ptr::null_mut(),
    }
}

/// Checks a copy's description as the driver does before it runs: memory types host, device,
/// unified (arrays are the array chapter's; here CUDA_ERROR_NOT_SUPPORTED), reserved fields
/// NULL, pitches at least the width where more than one row is copied, heights at least the
/// copied height where more than one slice is (cuMemcpy3D: CUDA_ERROR_INVALID_VALUE).
fn check_copy(c: &Memcpy3D) -> Res {
    for t in [c.src_type, c.dst_type] {
        match t {
            CU_MEMORYTYPE_HOST | CU_MEMORYTYPE_DEVICE | MEMTYPE_UNIFIED => {}
            MEMTYPE_ARRAY => return Err(err::NOT_SUPPORTED),
            _ => return Err(err::INVALID_VALUE),
        }
    }
    if c.reserved0 != 0 || c.reserved1 != 0 {
        return Err(err::INVALID_VALUE);
    }
    let rows = c.height > 1 || c.depth > 1;
    if rows && (c.src_pitch < c.width || c.dst_pitch < c.width) {
        return Err(err::INVALID_VALUE);
    }
    if c.depth > 1 && (c.src_height < c.height || c.dst_height < c.height) {
        return Err(err::INVALID_VALUE);
    }
    Ok(())
}

/// Runs a 3D copy row by row (each row checked against the allocations: device memory must be
/// live and hold the row; host memory is the caller's).
fn run_copy(c: &Memcpy3D) -> Res {
    check_copy(c)?;
    let base = |t: c_uint, host: usize, dev: u64| {
        if t == CU_MEMORYTYPE_HOST {
            host as u64
        } else {
            dev
        }
    };
    let (sb, db) = (
        base(c.src_type, c.src_host, c.src_dev),
        base(c.dst_type, c.dst_host, c.dst_dev),
    );
    for z in 0..c.depth.max(1) {
        for y in 0..c.height.max(1) {
            let s = sb
                + (c.src_x
                    + (c.src_y + y) * c.src_pitch
                    + (c.src_z + z) * c.src_pitch * c.src_height) as u64;
            let d = db
                + (c.dst_x
                    + (c.dst_y + y) * c.dst_pitch
                    + (c.dst_z + z) * c.dst_pitch * c.dst_height) as u64;
            mem::copy_any(d, s, c.width)?;
        }
    }
    Ok(())
}

/// "elementSize: Size of each element in bytes. Must be 1, 2, or 4"; "pitch: Pitch of destination
/// device pointer. Unused if height is 1" (CUDA_MEMSET_NODE_PARAMS).
fn check_memset(m: &MemsetParams) -> Res {
    if !matches!(m.elem, 1 | 2 | 4) || m.width == 0 || m.height == 0 {
        return Err(err::INVALID_VALUE);
    }
    if m.height > 1 && m.pitch < m.width * m.elem as usize {
        return Err(err::INVALID_VALUE);
    }
    Ok(())
}

fn run_memset(m: &MemsetParams) -> Res {
    check_memset(m)?;
    for r in 0..m.height {
        mem::memset(
            m.dst + (r * m.pitch) as u64,
            m.value,
            m.elem as usize,
            m.width,
        )?;
    }
    Ok(())
}

fn host_node(p: HostParams) -> Result<Kind, CUresult> {
    if p.f.is_none() {
        return Err(err::INVALID_VALUE);
    }
    Ok(Kind::Host(p))
}

/// A host function at its place in the stream: it runs once the work before it has ended, and
/// what follows it in the launch waits for it to return (CUDA Programming Guide, "Host
/// Functions"). The simulator runs it in the launching thread after waiting for the stream.
/// Merge point: where the stream chapter runs host functions on a driver thread, host nodes
/// should go there (one call per node).
fn run_host(s: &Stream, p: &HostParams) {
    sleep_until(s.done_at());
    if let Some(f) = p.f {
        f(p.data as *mut c_void);
    }
}

/// An allocation node on the device `p.poolProps.location` names; the address goes back in
/// `p.dptr` ("it returns the address of the allocation in nodeParams.dptr. The allocation's
/// address remains fixed across instantiations and launches", cuGraphAddMemAllocNode).
fn alloc_node(p: *mut CUDA_MEM_ALLOC_NODE_PARAMS) -> Result<Kind, CUresult> {
    let mut params: CUDA_MEM_ALLOC_NODE_PARAMS = read(p as *const CUDA_MEM_ALLOC_NODE_PARAMS)?;
    if params.poolProps.location.type_ != CU_MEM_LOCATION_TYPE_DEVICE {
        return Err(err::INVALID_VALUE);
    }
    let (dev, _) = ctx::device(params.poolProps.location.id)?;
    let a = mem::graph_alloc_new(dev, params.bytesize as u64)?;
    params.dptr = a.addr as CUdeviceptr;
    write(p, params)?;
    Ok(Kind::Alloc(Arc::new(NodeAlloc(a))))
}

/// A memory-free node of `g` for `addr`: CUDA_ERROR_INVALID_VALUE for "an allocation twice in
/// the same graph", "an address that was not returned by an allocation node", "an invalid
/// address" (cuGraphAddMemFreeNode).
fn free_node(g: &Graph, addr: u64) -> Result<Kind, CUresult> {
    mem::graph_alloc_at(addr).ok_or(err::INVALID_VALUE)?;
    if g.lock()
        .nodes
        .iter()
        .flatten()
        .any(|n| matches!(n.kind, Kind::Free(a) if a == addr))
    {
        return Err(err::INVALID_VALUE);
    }
    Ok(Kind::Free(addr))
}

fn alloc_params(a: &mem::GraphAlloc) -> CUDA_MEM_ALLOC_NODE_PARAMS {
    CUDA_MEM_ALLOC_NODE_PARAMS {
        poolProps: CUmemPoolProps {
            allocType: CU_MEM_ALLOCATION_TYPE_PINNED,
            handleTypes: 0,
            location: CUmemLocation {
                type_: CU_MEM_LOCATION_TYPE_DEVICE,
                id: a.dev as i32,
            },
            win32SecurityAttributes: std::ptr::null_mut(),
            maxSize: 0,
            usage: 0,
            reserved: [0; 54],
        },
        accessDescs: std::ptr::null(),
        accessDescCount: 0,
        bytesize: a.bytesize as usize,
        dptr: a.addr as CUdeviceptr,
    }
}

/// The union of a `CUgraphNodeParams` as the struct `T`.
fn union_of<T: Copy>(p: &NodeParams) -> T {
    debug_assert!(std::mem::size_of::<T>() <= std::mem::size_of_val(&p.u));
    // SAFETY: T is a plain-data cuda.h struct no larger than the 232-byte union it is read from.
    unsafe { (p.u.as_ptr() as *const T).read_unaligned() }
}

fn set_union<T: Copy>(p: &mut NodeParams, v: T) {
    p.u = [0; 29];
    // SAFETY: as in `union_of`, writing into the union's bytes.
    unsafe { (p.u.as_mut_ptr() as *mut T).write_unaligned(v) }
}

/// The node a `CUgraphNodeParams` describes (cuGraphAddNode). A memory-allocation node's
/// address is written back into the struct, as cuGraphAddMemAllocNode does. Kinds the
/// simulator does not model (external semaphores, batch memory operations, conditional and
/// batch copy nodes) answer CUDA_ERROR_NOT_SUPPORTED.
fn kind_of_params(g: &Graph, p: *mut NodeParams) -> Result<Kind, CUresult> {
    let np = read(p as *const NodeParams)?;
    if np.reserved0 != [0; 3] || np.reserved2 != 0 {
        return Err(err::INVALID_VALUE);
    }
    match np.ty {
        T_KERNEL => {
            let k: KernelParamsV2 = union_of(&np);
            Ok(Kind::Kernel(kernel_node(&k.v1, k.kern)?))
        }
        T_MEMCPY => {
            let m: MemcpyNodeParams = union_of(&np);
            if m.flags != 0 || m.reserved != 0 {
                return Err(err::INVALID_VALUE);
            }
            check_copy(&m.copy)?;
            Ok(Kind::Memcpy(m.copy))
        }
        T_MEMSET => {
            let m: MemsetParams = union_of(&np);
            check_memset(&m)?;
            Ok(Kind::Memset(m))
        }
        T_HOST => host_node(union_of(&np)),
        T_GRAPH => {
            // CUDA_CHILD_GRAPH_NODE_PARAMS: the graph, then the ownership
            // (CU_GRAPH_CHILD_GRAPH_OWNERSHIP_CLONE 0, _MOVE 1).
            let (child, own): (usize, i32) = union_of(&np);
            graphs().get(child)?;
            match own {
                0 => Ok(Kind::Child(clone_graph(child)?)),
                1 => Ok(Kind::Child(child)),
                _ => Err(err::INVALID_VALUE),
            }
        }
        T_EMPTY => Ok(Kind::Empty),
        T_WAIT_EVENT => {
            let e: usize = union_of(&np);
            exec::event_exists(e)?;
            Ok(Kind::EventWait(e))
        }
        T_EVENT_RECORD => {
            let e: usize = union_of(&np);
            exec::event_exists(e)?;
            Ok(Kind::EventRecord(e))
        }
        T_MEM_ALLOC => {
            // CUDA_MEM_ALLOC_NODE_PARAMS_v2 begins as v1 does; dptr is written back in place.
            let at = (p as *mut u8).wrapping_add(16) as *mut CUDA_MEM_ALLOC_NODE_PARAMS;
            alloc_node(at)
        }
        T_MEM_FREE => free_node(g, union_of::<u64>(&np)),
        8 | 9 | 12..=18 => Err(err::NOT_SUPPORTED),
        _ => Err(err::INVALID_VALUE),
    }
}

/// Fills a `CUgraphNodeParams` from a node (cuGraphNodeGetParams).
fn params_of_kind(k: &Kind) -> Result<NodeParams, CUresult> {
    let mut p = NodeParams {
        ty: k.ty(),
        reserved0: [0; 3],
        u: [0; 29],
        reserved2: 0,
    };
    match k {
        Kind::Kernel(k) => set_union(&mut p, kernel_params(k)),
        Kind::Memcpy(c) => set_union(
            &mut p,
            MemcpyNodeParams {
                flags: 0,
                reserved: 0,
                ctx: 0,
                copy: *c,
            },
        ),
        Kind::Memset(m) => set_union(&mut p, *m),
        Kind::Host(h) => set_union(&mut p, *h),
        Kind::Child(c) => set_union(&mut p, (*c, 0i32)),
        Kind::Inline(_) | Kind::Empty => {}
        Kind::EventRecord(e) | Kind::EventWait(e) => set_union(&mut p, *e),
        Kind::Alloc(a) => set_union(&mut p, alloc_params(&a.0)),
        Kind::Free(a) => set_union(&mut p, *a),
    }
    Ok(p)
}

// ---- instantiate, update, launch ------------------------------------------------------------------

fn instantiate_flags(
    exec: *mut CUgraphExec,
    graph: CUgraph,
    flags: u64,
) -> Result<Arc<GraphExec>, CUresult> {
    drv()?;
    let g = graphs().get(graph as usize)?;
    if exec.is_null() || flags & !INSTANTIATE_FLAGS != 0 {
        return Err(err::INVALID_VALUE);
    }
    // DEVICE_LAUNCH "cannot be used in conjunction with
    // CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH" (cuGraphInstantiate).
    let both = INSTANTIATE_FLAG_DEVICE_LAUNCH | CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH;
    if flags & both == both {
        return Err(err::INVALID_VALUE);
    }
    let nodes = snapshot(graph as usize)?;
    // A graph whose edges make a cycle cannot run.
    if topo(&nodes).is_none() {
        return Err(err::INVALID_VALUE);
    }
    let mut ops = Vec::new();
    flat(&nodes, &mut ops);
    let has_mem = ops
        .iter()
        .any(|k| matches!(k, Kind::Alloc(_) | Kind::Free(_)));
    // "An attempt to instantiate a second executable graph before destroying the first with
    // cuGraphExecDestroy will result in an error" (a graph with allocation or free nodes; the
    // documented codes leave CUDA_ERROR_INVALID_VALUE).
    if has_mem
        && g.lock()
            .mem_exec
            .as_ref()
            .is_some_and(|w| w.strong_count() > 0)
    {
        return Err(err::INVALID_VALUE);
    }
    let uobjs: Vec<(usize, u32)> = g.lock().uobjs.iter().map(|(&o, &n)| (o, n)).collect();
    for &(o, n) in &uobjs {
        user_object_retain(o, n)?;
    }
    let (x, xa) = execs().insert(GraphExec {
        base: g.base,
        nodes: Mutex::new(nodes),
        flags,
        uobjs,
    });
    if let Err(e) = write(exec, x as CUgraphExec) {
        let _ = execs().remove(x);
        return Err(e);
    }
    if has_mem {
        g.lock().mem_exec = Some(Arc::downgrade(&xa));
    }
    Ok(xa)
}

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
    if params.flags & CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD != 0 {
        exec::stream(params.upload_stream, pt)?;
    }
    let r = instantiate_flags(exec, graph, params.flags).and_then(|x| {
        if params.flags & CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD == 0 {
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
    // `CUgraphInstantiateResult`: SUCCESS 0, ERROR 1, INVALID_STRUCTURE 2 ("invalid structure,
    // such as cycles"), with the node at fault in `hErrNode_out`.
    let stuck = r.as_ref().err().and_then(|_| cycle_node(graph));
    params.err_node_out = stuck.map_or(std::ptr::null_mut(), |h| h as CUgraphNode);
    params.result_out = match (&r, stuck) {
        (Ok(()), _) => 0,
        (Err(_), Some(_)) => 2,
        (Err(_), None) => 1,
    };
    write(p, params)?;
    r
}

/// A node of `graph` that a dependency cycle keeps from ever running (the lowest), if any.
fn cycle_node(graph: CUgraph) -> Option<usize> {
    let g = graphs().get(graph as usize).ok()?;
    let nodes = g.lock().nodes.clone();
    if topo(&nodes).is_some() {
        return None;
    }
    // Nodes whose dependencies can all run, repeatedly; what is left waits on a cycle.
    let mut ran = vec![false; nodes.len()];
    loop {
        let mut more = false;
        for (i, n) in nodes.iter().enumerate() {
            if let Some(n) = n {
                if !ran[i] && n.deps.iter().all(|&d| ran[d]) {
                    ran[i] = true;
                    more = true;
                }
            }
        }
        if !more {
            break;
        }
    }
    (0..nodes.len())
        .find(|&i| nodes[i].is_some() && !ran[i])
        .map(|i| node_handle(g.base, i))
}

/// Per device: the most the graph's allocations hold at once while it runs (`peak`), and what
/// of that it frees again before it ends (`transient`).
fn graph_memory(ops: &[&Kind]) -> HashMap<usize, (u64, u64)> {
    let mut m: HashMap<usize, (u64, u64)> = HashMap::new(); // dev -> (now, peak)
    let mut mine: HashMap<u64, (usize, u64)> = HashMap::new();
    for op in ops {
        match op {
            Kind::Alloc(a) => {
                let e = m.entry(a.0.dev).or_default();
                e.0 += a.0.size;
                e.1 = e.1.max(e.0);
                mine.insert(a.0.addr, (a.0.dev, a.0.size));
            }
            Kind::Free(addr) => {
                if let Some((dev, size)) = mine.remove(addr) {
                    m.entry(dev).or_default().0 -= size;
                }
            }
            _ => {}
        }
    }
    m.into_iter()
        .map(|(d, (now, peak))| (d, (peak, peak - now)))
        .collect()
}

/// Maps the physical memory a graph's allocations need, as cuGraphUpload does (and a launch
/// before it runs): the device's graph memory pool grows to cover them, or
/// CUDA_ERROR_OUT_OF_MEMORY.
fn upload(x: &GraphExec) -> Res {
    let nodes = x.nodes.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let mut ops = Vec::new();
    flat(&nodes, &mut ops);
    for (dev, (peak, _)) in graph_memory(&ops) {
        mem::graph_reserve(dev, peak)?;
    }
    Ok(())
}

fn graph_upload(exec: CUgraphExec, h: CUstream, pt: bool) -> Res {
    let x = execs().get(exec as usize)?;
    exec::stream(h, pt)?;
    upload(&x)
}

/// A launch: "If any allocations created by hGraphExec remain unfreed (from a previous launch)
/// and hGraphExec was not instantiated with CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH,
/// the launch will fail with CUDA_ERROR_INVALID_VALUE" (cuGraphLaunch); with the flag, the
/// launch frees them first. Then the graph's memory is mapped (`upload`); a device that cannot
/// give it fails the launch with CUDA_ERROR_OUT_OF_MEMORY, nothing run. Then the nodes run in
/// dependency order on the stream: kernels take the device's timeline, copies and memsets move
/// the bytes, host nodes run at their place, event nodes record / wait, child graphs inline,
/// allocations become live and frees free them.
/// Launched into a capturing stream, the graph becomes a child graph node of the capture.
fn graph_launch(exec: CUgraphExec, h: CUstream, pt: bool) -> Res {
    let x = execs().get(exec as usize)?;
    let s = exec::stream(h, pt)?;
    let nodes = x.nodes.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let mut ops = Vec::new();
    flat(&nodes, &mut ops);
    let allocs: Vec<&Arc<NodeAlloc>> = ops
        .iter()
        .filter_map(|op| match op {
            Kind::Alloc(a) => Some(a),
            _ => None,
        })
        .collect();
    if capturing(&s) {
        // A graph with memory nodes cannot be a child graph (CUDA_CHILD_GRAPH_NODE_PARAMS:
        // "Graphs containing memory allocation or memory free nodes must set the ownership to
        // be moved to the parent", which a launch cannot).
        if !allocs.is_empty() {
            return Err(err::STREAM_CAPTURE_UNSUPPORTED);
        }
        let child = graph_of(&nodes);
        return capture_push(&s, Kind::Child(child)).unwrap_or(Ok(()));
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
    let ch = match s.ctx_handle() {
        0 => ctx::current()?.0,
        c => c,
    };
    for op in &ops {
        match op {
            Kind::Kernel(k) => s.run(Node { ns: k.ns })?,
            Kind::Memcpy(c) => run_copy(c)?,
            Kind::Memset(m) => run_memset(m)?,
            Kind::Host(p) => run_host(&s, p),
            Kind::EventRecord(e) => exec::event_record_at(*e, s.done_at().max(now_ns()))?,
            Kind::EventWait(e) => {
                s.tail.fetch_max(exec::event_time(*e)?, AcqRel);
            }
            Kind::Alloc(a) => mem::graph_alloc_map(&a.0, ch)?,
            Kind::Free(addr) => mem::graph_alloc_free(*addr)?,
            Kind::Empty | Kind::Child(_) | Kind::Inline(_) => {}
        }
    }
    for (dev, (_, transient)) in graph_memory(&ops) {
        mem::graph_running(dev, s.done_at(), transient);
    }
    Ok(())
}

/// Compares the graph `new` with an executable's nodes `old` as cuGraphExecUpdate does: the
/// same node count, each pair of the same type with the same dependencies (in edge order);
/// memcpy nodes may not change memory types, 2D memsets only address and value. On a mismatch,
/// the result code and the node of `new` (and the mismatched dependency) to report.
fn update_check(
    base: usize,
    old: &[Option<NodeRec>],
    new: &[Option<NodeRec>],
) -> Result<(), (i32, usize, usize)> {
    if old.len() != new.len() {
        return Err((UPDATE_TOPOLOGY_CHANGED, 0, 0));
    }
    for (i, (o, n)) in old.iter().zip(new).enumerate() {
        let h = node_handle(base, i);
        let (o, n) = match (o, n) {
            (Some(o), Some(n)) => (o, n),
            (None, None) => continue,
            _ => return Err((UPDATE_TOPOLOGY_CHANGED, 0, 0)),
        };
        if o.deps.len() != n.deps.len() {
            return Err((UPDATE_TOPOLOGY_CHANGED, h, 0));
        }
        if let Some((_, &d)) = o.deps.iter().zip(&n.deps).find(|(a, b)| a != b) {
            return Err((UPDATE_TOPOLOGY_CHANGED, h, node_handle(base, d)));
        }
        if o.kind.ty() != n.kind.ty() {
            return Err((UPDATE_NODE_TYPE_CHANGED, h, 0));
        }
        match (&o.kind, &n.kind) {
            (Kind::Memcpy(a), Kind::Memcpy(b))
                if a.src_type != b.src_type || a.dst_type != b.dst_type =>
            {
                return Err((UPDATE_PARAMETERS_CHANGED, h, 0));
            }
            (Kind::Memset(a), Kind::Memset(b))
                if a.height > 1
                    && (a.pitch, a.elem, a.width, a.height)
                        != (b.pitch, b.elem, b.width, b.height) =>
            {
                return Err((UPDATE_PARAMETERS_CHANGED, h, 0));
            }
            // Memory nodes keep their addresses: an executable's allocation cannot move.
            (Kind::Alloc(a), Kind::Alloc(b)) if a.0.addr != b.0.addr => {
                return Err((UPDATE_PARAMETERS_CHANGED, h, 0));
            }
            (Kind::Free(a), Kind::Free(b)) if a != b => {
                return Err((UPDATE_PARAMETERS_CHANGED, h, 0));
            }
            (Kind::Inline(a), Kind::Inline(b)) if update_check(base, a, b).is_err() => {
                return Err((UPDATE_PARAMETERS_CHANGED, h, 0));
            }
            _ => {}
        }
    }
    Ok(())
}

fn exec_update(exec: CUgraphExec, graph: CUgraph) -> Result<(), (CUresult, i32, usize, usize)> {
    let fail = |e: CUresult| (e, 1, 0, 0);
    drv().map_err(fail)?;
    let x = execs().get(exec as usize).map_err(fail)?;
    let g = graphs().get(graph as usize).map_err(fail)?;
    let new = snapshot(graph as usize).map_err(fail)?;
    let mut old = x.nodes.lock().unwrap_or_else(|e| e.into_inner());
    update_check(g.base, &old, &new).map_err(|(r, n, f)| (GRAPH_EXEC_UPDATE_FAILURE, r, n, f))?;
    for (o, n) in old.iter_mut().zip(new) {
        if let (Some(o), Some(n)) = (o.as_mut(), n) {
            o.kind = n.kind;
        }
    }
    Ok(())
}

/// The executable's copy of the node `h` names (a node of the graph it was instantiated from).
fn exec_node<R>(
    exec: CUgraphExec,
    h: CUgraphNode,
    f: impl FnOnce(&mut NodeRec) -> Result<R, CUresult>,
) -> Result<R, CUresult> {
    drv()?;
    let x = execs().get(exec as usize)?;
    let (base, i) = split(h)?;
    if base != x.base {
        return Err(err::INVALID_VALUE);
    }
    let mut nodes = x.nodes.lock().unwrap_or_else(|e| e.into_inner());
    let n = nodes
        .get_mut(i)
        .and_then(|n| n.as_mut())
        .ok_or(err::INVALID_VALUE)?;
    f(n)
}

/// Sets an executable node's parameters: the node must be of the same type ("hNode - ... node
/// from the graph from which graphExec was instantiated"; another type is CUDA_ERROR_INVALID_VALUE).
fn exec_set(exec: CUgraphExec, h: CUgraphNode, kind: Kind) -> Res {
    exec_node(exec, h, |n| {
        if n.kind.ty() != kind.ty() {
            return Err(err::INVALID_VALUE);
        }
        match (&n.kind, &kind) {
            (Kind::Memcpy(a), Kind::Memcpy(b))
                if a.src_type != b.src_type || a.dst_type != b.dst_type =>
            {
                return Err(err::INVALID_VALUE);
            }
            (Kind::Inline(a), Kind::Inline(b)) if update_check(0, a, b).is_err() => {
                // cuGraphExecChildGraphNodeSetParams: "The topology of childGraph, as well as
                // the node insertion order, must match that of the graph contained in hNode".
                return Err(err::INVALID_VALUE);
            }
            _ => {}
        }
        n.kind = kind;
        Ok(())
    })
}

// ---- user objects ---------------------------------------------------------------------------------

struct UserObject {
    ptr: usize,
    destroy: HostFn,
    refs: Mutex<u32>,
}

fn user_objects() -> &'static Registry<UserObject> {
    static R: OnceLock<Registry<UserObject>> = OnceLock::new();
    R.get_or_init(Registry::new)
}

fn user_object_retain(o: usize, n: u32) -> Res {
    let u = user_objects().get(o)?;
    let mut r = u.refs.lock().unwrap_or_else(|e| e.into_inner());
    *r = r.checked_add(n).ok_or(err::INVALID_VALUE)?;
    Ok(())
}

/// Drops `n` references; at the last, the object goes and its destructor runs. "the destroy
/// callback ... may be called from a driver thread" and must not call CUDA
/// (cuUserObjectCreate, CU_USER_OBJECT_NO_DESTRUCTOR_SYNC): it runs on a thread of its own.
fn user_object_release(o: usize, n: u32) -> Res {
    let u = user_objects().get(o)?;
    let last = {
        let mut r = u.refs.lock().unwrap_or_else(|e| e.into_inner());
        if n > *r {
            return Err(err::INVALID_VALUE);
        }
        *r -= n;
        *r == 0
    };
    if last {
        let _ = user_objects().remove(o);
        if let Some(f) = u.destroy {
            let p = u.ptr;
            std::thread::spawn(move || f(p as *mut c_void));
        }
    }
    Ok(())
}

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
    let Ok(c) = ctx::get(ch as CUcontext) else {
        return Ok(());
    };
    if !std::ptr::eq(s, &*c.legacy) {
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
fn capture_push(s: &Stream, kind: Kind) -> Option<Res> {
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

/// A 1D async copy on a capturing stream: a memcpy node of `n` bytes (`src_type`/`dst_type`:
/// CU_MEMORYTYPE_HOST, _DEVICE or _UNIFIED).
pub(crate) fn capture_copy(
    s: &Stream,
    dst: u64,
    dst_type: c_uint,
    src: u64,
    src_type: c_uint,
    n: usize,
) -> Option<Res> {
    if !capturing(s) {
        return not_captured(s);
    }
    let host = |t: c_uint, a: u64| {
        if t == CU_MEMORYTYPE_HOST {
            a as usize
        } else {
            0
        }
    };
    let dev = |t: c_uint, a: u64| if t == CU_MEMORYTYPE_HOST { 0 } else { a };
    let c = Memcpy3D {
        src_x: 0,
        src_y: 0,
        src_z: 0,
        src_lod: 0,
        src_type,
        src_host: host(src_type, src),
        src_dev: dev(src_type, src),
        src_array: 0,
        reserved0: 0,
        src_pitch: 0,
        src_height: 0,
        dst_x: 0,
        dst_y: 0,
        dst_z: 0,
        dst_lod: 0,
        dst_type,
        dst_host: host(dst_type, dst),
        dst_dev: dev(dst_type, dst),
        dst_array: 0,
        reserved1: 0,
        dst_pitch: 0,
        dst_height: 0,
        width: n,
        height: 1,
        depth: 1,
    };
    capture_push(s, Kind::Memcpy(c))
}

/// A 1D async memset on a capturing stream: a memset node.
pub(crate) fn capture_memset(
    s: &Stream,
    dst: u64,
    value: u32,
    elem: usize,
    count: usize,
) -> Option<Res> {
    if !capturing(s) {
        return not_captured(s);
    }
    let m = MemsetParams {
        dst,
        pitch: 0,
        value,
        elem: elem as c_uint,
        width: count,
        height: 1,
    };
    if let Err(e) = check_memset(&m) {
        return Some(Err(e));
    }
    capture_push(s, Kind::Memset(m))
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
    let s = exec::stream(h, pt)?;
    // cuStreamBeginCapture: "Capture may not be initiated if stream is CU_STREAM_LEGACY".
    if Arc::ptr_eq(&s, &ctx::current()?.1.legacy) {
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

fn check_default_edges(edges: *const u64, n: usize) -> Res {
    if !edges.is_null() {
        for i in 0..n {
            if read(edges.wrapping_add(i))? != 0 {
                return Err(err::INVALID_VALUE);
            }
        }
    }
    Ok(())
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
    let s = exec::stream(h, pt)?;
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
    let s = exec::stream(h, pt)?;
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
    let s = exec::stream(h, pt)?;
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
    let s = exec::stream(h, pt)?;
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

// ---- edges ----------------------------------------------------------------------------------------

/// Reads `n` (from, to) pairs of nodes of `g` as indices.
fn edge_pairs(
    g: &Graph,
    from: *const CUgraphNode,
    to: *const CUgraphNode,
    n: usize,
) -> Result<Vec<(usize, usize)>, CUresult> {
    let f = dep_indices_any(g, from, n)?;
    let t = dep_indices_any(g, to, n)?;
    Ok(f.into_iter().zip(t).collect())
}

/// Like `dep_indices`, repeats allowed (an edge list names a node once per edge).
fn dep_indices_any(g: &Graph, p: *const CUgraphNode, n: usize) -> Result<Vec<usize>, CUresult> {
    if n > 0 && p.is_null() {
        return Err(err::INVALID_VALUE);
    }
    let st = g.lock();
    (0..n)
        .map(|k| {
            let (base, i) = split(read(p.wrapping_add(k))?)?;
            if base != g.base || !matches!(st.nodes.get(i), Some(Some(_))) {
                return Err(err::INVALID_VALUE);
            }
            Ok(i)
        })
        .collect()
}

/// cuGraphAddDependencies: "If numDependencies is 0, elements in from and to will be ignored.
/// Specifying an existing dependency will return an error" (CUDA_ERROR_INVALID_VALUE); so does
/// a node depending on itself.
fn add_deps(
    graph: CUgraph,
    from: *const CUgraphNode,
    to: *const CUgraphNode,
    edges: *const u64,
    n: usize,
) -> Res {
    drv()?;
    let g = graphs().get(graph as usize)?;
    check_default_edges(edges, n)?;
    let pairs = edge_pairs(&g, from, to, n)?;
    let mut st = g.lock();
    for (k, &(f, t)) in pairs.iter().enumerate() {
        let n = st.nodes[t].as_ref().expect("checked");
        if f == t || n.deps.contains(&f) || pairs[..k].contains(&(f, t)) {
            return Err(err::INVALID_VALUE);
        }
    }
    for (f, t) in pairs {
        st.nodes[t].as_mut().expect("checked").deps.push(f);
    }
    Ok(())
}

/// cuGraphRemoveDependencies: "Specifying a non-existing dependency will return an error".
fn remove_deps(
    graph: CUgraph,
    from: *const CUgraphNode,
    to: *const CUgraphNode,
    edges: *const u64,
    n: usize,
) -> Res {
    drv()?;
    let g = graphs().get(graph as usize)?;
    check_default_edges(edges, n)?;
    let pairs = edge_pairs(&g, from, to, n)?;
    let mut st = g.lock();
    if pairs
        .iter()
        .any(|&(f, t)| !st.nodes[t].as_ref().expect("checked").deps.contains(&f))
    {
        return Err(err::INVALID_VALUE);
    }
    for (f, t) in pairs {
        st.nodes[t]
            .as_mut()
            .expect("checked")
            .deps
            .retain(|&d| d != f);
    }
    Ok(())
}

/// Writes a list the way the graph queries do: with a NULL array, the count; otherwise up to
/// `*count` entries, and `*count` set to how many were written (the real number when it is
/// smaller). Edge data, where asked for, is all zero (default edges).
fn write_list(items: &[usize], out: *mut CUgraphNode, edges: *mut u64, count: *mut usize) -> Res {
    if out.is_null() {
        if !edges.is_null() {
            return Err(err::INVALID_VALUE);
        }
        return write(count, items.len());
    }
    let want = read(count as *const usize)?;
    for (i, &h) in items.iter().take(want).enumerate() {
        write(out.wrapping_add(i), h as CUgraphNode)?;
        if !edges.is_null() {
            write(edges.wrapping_add(i), 0u64)?;
        }
    }
    write(count, want.min(items.len()))
}

fn node_deps(h: CUgraphNode, out: *mut CUgraphNode, edges: *mut u64, count: *mut usize) -> Res {
    drv()?;
    let (g, i) = locate(h)?;
    let items: Vec<usize> = g.lock().nodes[i]
        .as_ref()
        .expect("located")
        .deps
        .iter()
        .map(|&d| node_handle(g.base, d))
        .collect();
    write_list(&items, out, edges, count)
}

fn node_dependents(
    h: CUgraphNode,
    out: *mut CUgraphNode,
    edges: *mut u64,
    count: *mut usize,
) -> Res {
    drv()?;
    let (g, i) = locate(h)?;
    let items: Vec<usize> = g
        .lock()
        .nodes
        .iter()
        .enumerate()
        .filter(|(_, n)| n.as_ref().is_some_and(|n| n.deps.contains(&i)))
        .map(|(j, _)| node_handle(g.base, j))
        .collect();
    write_list(&items, out, edges, count)
}

/// cuGraphGetEdges: the edges as two parallel arrays; with `from` and `to` NULL, the count.
fn get_edges(
    graph: CUgraph,
    from: *mut CUgraphNode,
    to: *mut CUgraphNode,
    edges: *mut u64,
    count: *mut usize,
) -> Res {
    drv()?;
    let g = graphs().get(graph as usize)?;
    let list: Vec<(usize, usize)> = g
        .lock()
        .nodes
        .iter()
        .enumerate()
        .filter_map(|(t, n)| n.as_ref().map(|n| (t, n)))
        .flat_map(|(t, n)| n.deps.iter().map(move |&f| (f, t)))
        .collect();
    if from.is_null() != to.is_null() {
        return Err(err::INVALID_VALUE);
    }
    if from.is_null() {
        if !edges.is_null() {
            return Err(err::INVALID_VALUE);
        }
        return write(count, list.len());
    }
    let want = read(count as *const usize)?;
    for (i, &(f, t)) in list.iter().take(want).enumerate() {
        write(from.wrapping_add(i), node_handle(g.base, f) as CUgraphNode)?;
        write(to.wrapping_add(i), node_handle(g.base, t) as CUgraphNode)?;
        if !edges.is_null() {
            write(edges.wrapping_add(i), 0u64)?;
        }
    }
    write(count, want.min(list.len()))
}

/// cuGraphDestroyNode: the node goes with its edges (in and out).
fn destroy_node(h: CUgraphNode) -> Res {
    drv()?;
    let (g, i) = locate(h)?;
    let old = {
        let mut st = g.lock();
        let old = st.nodes[i].take();
        for n in st.nodes.iter_mut().flatten() {
            n.deps.retain(|&d| d != i);
        }
        old
    };
    if let Some(NodeRec {
        kind: Kind::Child(c),
        ..
    }) = old
    {
        destroy_graph(c);
    }
    Ok(())
}

/// cuGraphDebugDotPrint: a DOT description of the graph, one vertex per node (its type and
/// handle), one arc per edge. "CUDA_ERROR_OPERATING_SYSTEM" where the file cannot be written.
fn dot_print(graph: CUgraph, path: *const c_char) -> Res {
    drv()?;
    let g = graphs().get(graph as usize)?;
    let path = cstr(path)?;
    let names = [
        "KERNEL",
        "MEMCPY",
        "MEMSET",
        "HOST",
        "GRAPH",
        "EMPTY",
        "WAIT_EVENT",
        "EVENT_RECORD",
        "",
        "",
        "MEM_ALLOC",
        "MEM_FREE",
    ];
    let mut s = format!("digraph dot {{\n  subgraph cluster_{graph:p} {{\n    label=\"graph\"\n");
    let st = g.lock();
    for (i, n) in st.nodes.iter().enumerate() {
        if let Some(n) = n {
            let h = node_handle(g.base, i);
            let ty = names.get(n.kind.ty() as usize).copied().unwrap_or("");
            s += &format!("    \"n{h:x}\" [label=\"{ty}\\nnode {i}\"];\n");
        }
    }
    for (t, n) in st.nodes.iter().enumerate() {
        if let Some(n) = n {
            for &f in &n.deps {
                s += &format!(
                    "    \"n{:x}\" -> \"n{:x}\";\n",
                    node_handle(g.base, f),
                    node_handle(g.base, t)
                );
            }
        }
    }
    s += "  }\n}\n";
    std::fs::write(path, s).map_err(|_| OPERATING_SYSTEM)
}

fn get_nodes(graph: CUgraph, out: *mut CUgraphNode, count: *mut usize, roots: bool) -> Res {
    drv()?;
    let g = graphs().get(graph as usize)?;
    let items: Vec<usize> = g
        .lock()
        .nodes
        .iter()
        .enumerate()
        .filter(|(_, n)| n.as_ref().is_some_and(|n| !roots || n.deps.is_empty()))
        .map(|(i, _)| node_handle(g.base, i))
        .collect();
    write_list(&items, out, std::ptr::null_mut(), count)
}

fn read_memset(p: *const MemsetParams) -> Result<MemsetParams, CUresult> {
    let m = read(p)?;
    check_memset(&m)?;
    Ok(m)
}

fn read_copy(p: *const Memcpy3D) -> Result<Memcpy3D, CUresult> {
    let c = read(p)?;
    check_copy(&c)?;
    Ok(c)
}

fn event_of(e: CUevent) -> Result<usize, CUresult> {
    exec::event_exists(e as usize)?;
    Ok(e as usize)
}

/// The `CUDA_KERNEL_NODE_PARAMS` of a kernel node (v1, or v2 with `kern` and `ctx`).
fn kernel_get(h: CUgraphNode, p: *mut c_void, v2: bool) -> Res {
    drv()?;
    let Kind::Kernel(k) = node_rec(h)?.kind else {
        return Err(err::INVALID_VALUE);
    };
    let kp = kernel_params(&k);
    if v2 {
        write(p as *mut KernelParamsV2, kp)
    } else {
        write(p as *mut CUDA_KERNEL_NODE_PARAMS, kp.v1)
    }
}

fn kernel_read(p: *const c_void, v2: bool) -> Result<KernelNode, CUresult> {
    if v2 {
        let k: KernelParamsV2 = read(p as *const KernelParamsV2)?;
        kernel_node(&k.v1, k.kern)
    } else {
        kernel_node(
            &read(p as *const CUDA_KERNEL_NODE_PARAMS)?,
            std::ptr::null_mut(),
        )
    }
}

// ---- after CUDA 13.0 ------------------------------------------------------------------------------
// cuGraphNodeGetContainingGraph (CUDA 13.1, `PFN_..._v13010`), cuGraphNodeGetParams (13.2,
// `_v13020`), cuGraphAddNode_v3 and cuGraphNodeSetParams_v2 (13.4, `_v13040`: the same
// signatures and struct as the 12.x forms) are modelled here but not exported while the
// simulator reports a CUDA 13.0 driver (`driver_version` 13000, as R580 drivers do): such a
// driver has none of them. Exporting them is one line each in the `export!` block below,
// with their `cuGetProcAddress` entries, once the reported version covers them.

/// cuGraphNodeGetParams: the node's parameters as a `CUgraphNodeParams`.
#[allow(dead_code)]
fn node_get_params(node: CUgraphNode, p: *mut NodeParams) -> Res {
    drv()?;
    write(p, params_of_kind(&node_rec(node)?.kind)?)
}

/// cuGraphNodeGetContainingGraph: the graph a node belongs to.
#[allow(dead_code)]
fn containing_graph(node: CUgraphNode, out: *mut CUgraph) -> Res {
    drv()?;
    let (g, _) = locate(node)?;
    let h = graph_bases()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&g.base)
        .copied();
    write(out, h.ok_or(err::INVALID_VALUE)? as CUgraph)
}

/// The type a `CUgraphNodeParams` names, checked against the node's: "The node type specified
/// by nodeParams->type must match the type of hNode" (CUDA_ERROR_INVALID_VALUE); "Modifying
/// parameters is not supported for node types CU_GRAPH_NODE_TYPE_MEM_ALLOC and
/// CU_GRAPH_NODE_TYPE_MEM_FREE" (cuGraphNodeSetParams; "API unsupported" in an executable,
/// cuGraphExecNodeSetParams): CUDA_ERROR_NOT_SUPPORTED.
fn settable_type(node: CUgraphNode, p: *const NodeParams) -> Result<i32, CUresult> {
    let want = node_rec(node)?.kind.ty();
    let ty = read(p)?.ty;
    if ty != want {
        return Err(err::INVALID_VALUE);
    }
    if matches!(ty, T_MEM_ALLOC | T_MEM_FREE) {
        return Err(err::NOT_SUPPORTED);
    }
    Ok(ty)
}

fn node_set_params(node: CUgraphNode, p: *mut NodeParams) -> Res {
    drv()?;
    settable_type(node, p)?;
    let (g, _) = locate(node)?;
    let k = kind_of_params(&g, p)?;
    set_kind(node, k)
}

export! {
    fn cuGraphCreate(g: *mut CUgraph, flags: c_uint) {
        drv()?;
        if g.is_null() || flags != 0 {
            return Err(err::INVALID_VALUE);
        }
        write(g, new_graph().0 as CUgraph)
    }
    /// The graph goes, with the child graphs its nodes own; its allocation nodes' addresses go
    /// when its executables are gone too.
    fn cuGraphDestroy(g: CUgraph) {
        drv()?;
        graphs().get(g as usize)?;
        destroy_graph(g as usize);
        Ok(())
    }
    fn cuGraphClone(out: *mut CUgraph, g: CUgraph) {
        drv()?;
        if out.is_null() {
            return Err(err::INVALID_VALUE);
        }
        write(out, clone_graph(g as usize)? as CUgraph)
    }
    /// "This function returns the node in hClonedGraph corresponding to hOriginalNode in the
    /// original graph"; CUDA_ERROR_INVALID_VALUE where hClonedGraph is no clone of its graph.
    fn cuGraphNodeFindInClone(out: *mut CUgraphNode, orig: CUgraphNode, cloned: CUgraph) {
        drv()?;
        let (base, i) = split(orig)?;
        let c = graphs().get(cloned as usize)?;
        let st = c.lock();
        if st.clone_of != Some(base) || !matches!(st.nodes.get(i), Some(Some(_))) {
            return Err(err::INVALID_VALUE);
        }
        write(out, node_handle(c.base, i) as CUgraphNode)
    }
    fn cuGraphDestroyNode(node: CUgraphNode) { destroy_node(node) }
    fn cuGraphNodeGetType(node: CUgraphNode, ty: *mut i32) {
        drv()?;
        write(ty, node_rec(node)?.kind.ty())
    }
    fn cuGraphGetNodes(g: CUgraph, nodes: *mut CUgraphNode, count: *mut usize) { get_nodes(g, nodes, count, false) }
    fn cuGraphGetRootNodes(g: CUgraph, nodes: *mut CUgraphNode, count: *mut usize) { get_nodes(g, nodes, count, true) }
    fn cuGraphGetEdges(g: CUgraph, from: *mut CUgraphNode, to: *mut CUgraphNode, count: *mut usize) {
        get_edges(g, from, to, std::ptr::null_mut(), count)
    }
    fn cuGraphGetEdges_v2(g: CUgraph, from: *mut CUgraphNode, to: *mut CUgraphNode, edges: *mut u64, count: *mut usize) {
        get_edges(g, from, to, edges, count)
    }
    fn cuGraphNodeGetDependencies(node: CUgraphNode, deps: *mut CUgraphNode, count: *mut usize) {
        node_deps(node, deps, std::ptr::null_mut(), count)
    }
    fn cuGraphNodeGetDependencies_v2(node: CUgraphNode, deps: *mut CUgraphNode, edges: *mut u64, count: *mut usize) {
        node_deps(node, deps, edges, count)
    }
    fn cuGraphNodeGetDependentNodes(node: CUgraphNode, out: *mut CUgraphNode, count: *mut usize) {
        node_dependents(node, out, std::ptr::null_mut(), count)
    }
    fn cuGraphNodeGetDependentNodes_v2(node: CUgraphNode, out: *mut CUgraphNode, edges: *mut u64, count: *mut usize) {
        node_dependents(node, out, edges, count)
    }
    fn cuGraphAddDependencies(g: CUgraph, from: *const CUgraphNode, to: *const CUgraphNode, n: usize) {
        add_deps(g, from, to, std::ptr::null(), n)
    }
    fn cuGraphAddDependencies_v2(g: CUgraph, from: *const CUgraphNode, to: *const CUgraphNode, edges: *const u64, n: usize) {
        add_deps(g, from, to, edges, n)
    }
    fn cuGraphRemoveDependencies(g: CUgraph, from: *const CUgraphNode, to: *const CUgraphNode, n: usize) {
        remove_deps(g, from, to, std::ptr::null(), n)
    }
    fn cuGraphRemoveDependencies_v2(g: CUgraph, from: *const CUgraphNode, to: *const CUgraphNode, edges: *const u64, n: usize) {
        remove_deps(g, from, to, edges, n)
    }
    fn cuGraphDebugDotPrint(g: CUgraph, path: *const c_char, _flags: c_uint) { dot_print(g, path) }

    fn cuGraphAddKernelNode(node: *mut CUgraphNode, g: CUgraph, deps: *const CUgraphNode, ndeps: usize, p: *const c_void) {
        add_node(node, g, deps, ndeps, |_| Ok(Kind::Kernel(kernel_read(p, false)?)))
    }
    fn cuGraphAddKernelNode_v2(node: *mut CUgraphNode, g: CUgraph, deps: *const CUgraphNode, ndeps: usize, p: *const c_void) {
        add_node(node, g, deps, ndeps, |_| Ok(Kind::Kernel(kernel_read(p, true)?)))
    }
    fn cuGraphKernelNodeGetParams(node: CUgraphNode, p: *mut c_void) { kernel_get(node, p, false) }
    fn cuGraphKernelNodeGetParams_v2(node: CUgraphNode, p: *mut c_void) { kernel_get(node, p, true) }
    fn cuGraphKernelNodeSetParams(node: CUgraphNode, p: *const c_void) {
        drv()?;
        set_kind(node, Kind::Kernel(kernel_read(p, false)?))
    }
    fn cuGraphKernelNodeSetParams_v2(node: CUgraphNode, p: *const c_void) {
        drv()?;
        set_kind(node, Kind::Kernel(kernel_read(p, true)?))
    }
    fn cuGraphAddMemcpyNode(node: *mut CUgraphNode, g: CUgraph, deps: *const CUgraphNode, ndeps: usize, p: *const Memcpy3D, _ctx: CUcontext) {
        add_node(node, g, deps, ndeps, |_| Ok(Kind::Memcpy(read_copy(p)?)))
    }
    fn cuGraphMemcpyNodeGetParams(node: CUgraphNode, p: *mut Memcpy3D) {
        drv()?;
        let Kind::Memcpy(c) = node_rec(node)?.kind else { return Err(err::INVALID_VALUE) };
        write(p, c)
    }
    fn cuGraphMemcpyNodeSetParams(node: CUgraphNode, p: *const Memcpy3D) {
        drv()?;
        set_kind(node, Kind::Memcpy(read_copy(p)?))
    }
    fn cuGraphAddMemsetNode(node: *mut CUgraphNode, g: CUgraph, deps: *const CUgraphNode, ndeps: usize, p: *const MemsetParams, _ctx: CUcontext) {
        add_node(node, g, deps, ndeps, |_| Ok(Kind::Memset(read_memset(p)?)))
    }
    fn cuGraphMemsetNodeGetParams(node: CUgraphNode, p: *mut MemsetParams) {
        drv()?;
        let Kind::Memset(m) = node_rec(node)?.kind else { return Err(err::INVALID_VALUE) };
        write(p, m)
    }
    fn cuGraphMemsetNodeSetParams(node: CUgraphNode, p: *const MemsetParams) {
        drv()?;
        set_kind(node, Kind::Memset(read_memset(p)?))
    }
    fn cuGraphAddHostNode(node: *mut CUgraphNode, g: CUgraph, deps: *const CUgraphNode, ndeps: usize, p: *const HostParams) {
        add_node(node, g, deps, ndeps, |_| host_node(read(p)?))
    }
    fn cuGraphHostNodeGetParams(node: CUgraphNode, p: *mut HostParams) {
        drv()?;
        let Kind::Host(h) = node_rec(node)?.kind else { return Err(err::INVALID_VALUE) };
        write(p, h)
    }
    fn cuGraphHostNodeSetParams(node: CUgraphNode, p: *const HostParams) {
        drv()?;
        set_kind(node, host_node(read(p)?)?)
    }
    /// "Creates a new node which executes an embedded graph ... The node executes an embedded
    /// child graph. The child graph is cloned in this call."
    fn cuGraphAddChildGraphNode(node: *mut CUgraphNode, g: CUgraph, deps: *const CUgraphNode, ndeps: usize, child: CUgraph) {
        add_node(node, g, deps, ndeps, |_| Ok(Kind::Child(clone_graph(child as usize)?)))
    }
    /// "Gets a handle to the embedded graph in a child graph node. This call does not clone
    /// the graph. Changes to the graph will be reflected in the node".
    fn cuGraphChildGraphNodeGetGraph(node: CUgraphNode, out: *mut CUgraph) {
        drv()?;
        let Kind::Child(c) = node_rec(node)?.kind else { return Err(err::INVALID_VALUE) };
        write(out, c as CUgraph)
    }
    fn cuGraphAddEmptyNode(node: *mut CUgraphNode, g: CUgraph, deps: *const CUgraphNode, ndeps: usize) {
        add_node(node, g, deps, ndeps, |_| Ok(Kind::Empty))
    }
    fn cuGraphAddEventRecordNode(node: *mut CUgraphNode, g: CUgraph, deps: *const CUgraphNode, ndeps: usize, e: CUevent) {
        add_node(node, g, deps, ndeps, |_| Ok(Kind::EventRecord(event_of(e)?)))
    }
    fn cuGraphEventRecordNodeGetEvent(node: CUgraphNode, out: *mut CUevent) {
        drv()?;
        let Kind::EventRecord(e) = node_rec(node)?.kind else { return Err(err::INVALID_VALUE) };
        write(out, e as CUevent)
    }
    fn cuGraphEventRecordNodeSetEvent(node: CUgraphNode, e: CUevent) {
        drv()?;
        set_kind(node, Kind::EventRecord(event_of(e)?))
    }
    fn cuGraphAddEventWaitNode(node: *mut CUgraphNode, g: CUgraph, deps: *const CUgraphNode, ndeps: usize, e: CUevent) {
        add_node(node, g, deps, ndeps, |_| Ok(Kind::EventWait(event_of(e)?)))
    }
    fn cuGraphEventWaitNodeGetEvent(node: CUgraphNode, out: *mut CUevent) {
        drv()?;
        let Kind::EventWait(e) = node_rec(node)?.kind else { return Err(err::INVALID_VALUE) };
        write(out, e as CUevent)
    }
    fn cuGraphEventWaitNodeSetEvent(node: CUgraphNode, e: CUevent) {
        drv()?;
        set_kind(node, Kind::EventWait(event_of(e)?))
    }
    /// A memory-allocation node: an address now, memory only when the graph runs (see
    /// `alloc_node`).
    fn cuGraphAddMemAllocNode(node: *mut CUgraphNode, g: CUgraph, deps: *const CUgraphNode, ndeps: usize, p: *mut CUDA_MEM_ALLOC_NODE_PARAMS) {
        add_node(node, g, deps, ndeps, |_| alloc_node(p))
    }
    fn cuGraphAddMemFreeNode(node: *mut CUgraphNode, g: CUgraph, deps: *const CUgraphNode, ndeps: usize, dptr: CUdeviceptr) {
        add_node(node, g, deps, ndeps, |gr| free_node(gr, dptr as u64))
    }
    fn cuGraphMemAllocNodeGetParams(node: CUgraphNode, out: *mut CUDA_MEM_ALLOC_NODE_PARAMS) {
        drv()?;
        let Kind::Alloc(a) = node_rec(node)?.kind else { return Err(err::INVALID_VALUE) };
        write(out, alloc_params(&a.0))
    }
    fn cuGraphMemFreeNodeGetParams(node: CUgraphNode, dptr: *mut CUdeviceptr) {
        drv()?;
        let Kind::Free(addr) = node_rec(node)?.kind else { return Err(err::INVALID_VALUE) };
        write(dptr, addr as CUdeviceptr)
    }
    /// The generic node API (CUDA 12.2): the CUDA 12.2 form without edge data, and _v2 with it.
    fn cuGraphAddNode(node: *mut CUgraphNode, g: CUgraph, deps: *const CUgraphNode, ndeps: usize, p: *mut NodeParams) {
        add_node(node, g, deps, ndeps, |gr| kind_of_params(gr, p))
    }
    fn cuGraphAddNode_v2(node: *mut CUgraphNode, g: CUgraph, deps: *const CUgraphNode, edges: *const u64, ndeps: usize, p: *mut NodeParams) {
        check_default_edges(edges, ndeps)?;
        add_node(node, g, deps, ndeps, |gr| kind_of_params(gr, p))
    }
    fn cuGraphNodeSetParams(node: CUgraphNode, p: *mut NodeParams) { node_set_params(node, p) }

    fn cuGraphExecNodeSetParams(exec: CUgraphExec, node: CUgraphNode, p: *mut NodeParams) {
        drv()?;
        let k = if settable_type(node, p)? == T_GRAPH {
            // The executable takes the child's nodes as they are now (no clone is kept).
            let (child, _own): (usize, i32) = union_of(&read(p as *const NodeParams)?);
            Kind::Inline(Arc::new(snapshot(child)?))
        } else {
            let (g, _) = locate(node)?;
            kind_of_params(&g, p)?
        };
        exec_set(exec, node, k)
    }

    fn cuGraphInstantiate(exec: *mut CUgraphExec, g: CUgraph, _err_node: *mut CUgraphNode, _log: *mut c_char, _log_size: usize) {
        instantiate_flags(exec, g, 0).map(|_| ())
    }
    fn cuGraphInstantiate_v2(exec: *mut CUgraphExec, g: CUgraph, _err_node: *mut CUgraphNode, _log: *mut c_char, _log_size: usize) {
        instantiate_flags(exec, g, 0).map(|_| ())
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
    fn cuGraphExecGetFlags(exec: CUgraphExec, flags: *mut u64) {
        drv()?;
        write(flags, execs().get(exec as usize)?.flags)
    }
    fn cuGraphLaunch(exec: CUgraphExec, s: CUstream) { graph_launch(exec, s, false) }
    fn cuGraphLaunch_ptsz(exec: CUgraphExec, s: CUstream) { graph_launch(exec, s, true) }
    fn cuGraphUpload(exec: CUgraphExec, s: CUstream) { graph_upload(exec, s, false) }
    fn cuGraphUpload_ptsz(exec: CUgraphExec, s: CUstream) { graph_upload(exec, s, true) }
    fn cuGraphExecDestroy(exec: CUgraphExec) {
        drv()?;
        execs().remove(exec as usize).map(|_| ())
    }
    /// CUDA 12.0's form: the result in a `CUgraphExecUpdateResultInfo`.
    fn cuGraphExecUpdate_v2(exec: CUgraphExec, g: CUgraph, info: *mut UpdateResultInfo) {
        if info.is_null() {
            return Err(err::INVALID_VALUE);
        }
        let (r, res, node, from) = match exec_update(exec, g) {
            Ok(()) => (Ok(()), UPDATE_SUCCESS, 0, 0),
            Err((e, res, node, from)) => (Err(e), res, node, from),
        };
        write(info, UpdateResultInfo { result: res, error_node: node as CUgraphNode, error_from: from as CUgraphNode })?;
        r
    }
    /// CUDA 10.2's form: the error node and the result through two pointers.
    fn cuGraphExecUpdate(exec: CUgraphExec, g: CUgraph, err_node: *mut CUgraphNode, result: *mut i32) {
        if err_node.is_null() || result.is_null() {
            return Err(err::INVALID_VALUE);
        }
        let (r, res, node) = match exec_update(exec, g) {
            Ok(()) => (Ok(()), UPDATE_SUCCESS, 0),
            Err((e, res, node, _)) => (Err(e), res, node),
        };
        write(err_node, node as CUgraphNode)?;
        write(result, res)?;
        r
    }
    fn cuGraphExecKernelNodeSetParams(exec: CUgraphExec, node: CUgraphNode, p: *const c_void) {
        drv()?;
        exec_set(exec, node, Kind::Kernel(kernel_read(p, false)?))
    }
    fn cuGraphExecKernelNodeSetParams_v2(exec: CUgraphExec, node: CUgraphNode, p: *const c_void) {
        drv()?;
        exec_set(exec, node, Kind::Kernel(kernel_read(p, true)?))
    }
    fn cuGraphExecMemcpyNodeSetParams(exec: CUgraphExec, node: CUgraphNode, p: *const Memcpy3D, _ctx: CUcontext) {
        drv()?;
        exec_set(exec, node, Kind::Memcpy(read_copy(p)?))
    }
    fn cuGraphExecMemsetNodeSetParams(exec: CUgraphExec, node: CUgraphNode, p: *const MemsetParams, _ctx: CUcontext) {
        drv()?;
        exec_set(exec, node, Kind::Memset(read_memset(p)?))
    }
    fn cuGraphExecHostNodeSetParams(exec: CUgraphExec, node: CUgraphNode, p: *const HostParams) {
        drv()?;
        exec_set(exec, node, host_node(read(p)?)?)
    }
    fn cuGraphExecChildGraphNodeSetParams(exec: CUgraphExec, node: CUgraphNode, child: CUgraph) {
        drv()?;
        exec_set(exec, node, Kind::Inline(Arc::new(snapshot(child as usize)?)))
    }
    fn cuGraphExecEventRecordNodeSetEvent(exec: CUgraphExec, node: CUgraphNode, e: CUevent) {
        drv()?;
        exec_set(exec, node, Kind::EventRecord(event_of(e)?))
    }
    fn cuGraphExecEventWaitNodeSetEvent(exec: CUgraphExec, node: CUgraphNode, e: CUevent) {
        drv()?;
        exec_set(exec, node, Kind::EventWait(event_of(e)?))
    }
    /// "The following node types are currently supported: Kernel, Memset, Memcpy" (and batch
    /// and fabric copies, which the simulator does not make); others: CUDA_ERROR_INVALID_VALUE.
    fn cuGraphNodeSetEnabled(exec: CUgraphExec, node: CUgraphNode, on: c_uint) {
        exec_node(exec, node, |n| {
            if !matches!(n.kind.ty(), T_KERNEL | T_MEMCPY | T_MEMSET) {
                return Err(err::INVALID_VALUE);
            }
            n.enabled = on != 0;
            Ok(())
        })
    }
    fn cuGraphNodeGetEnabled(exec: CUgraphExec, node: CUgraphNode, on: *mut c_uint) {
        let v = exec_node(exec, node, |n| {
            if !matches!(n.kind.ty(), T_KERNEL | T_MEMCPY | T_MEMSET) {
                return Err(err::INVALID_VALUE);
            }
            Ok(c_uint::from(n.enabled))
        })?;
        write(on, v)
    }

    fn cuUserObjectCreate(out: *mut *mut c_void, ptr: *mut c_void, destroy: HostFn, refs: c_uint, flags: c_uint) {
        drv()?;
        if out.is_null() || destroy.is_none() || refs == 0 || flags != USER_OBJECT_NO_DESTRUCTOR_SYNC {
            return Err(err::INVALID_VALUE);
        }
        let (h, _) = user_objects().insert(UserObject { ptr: ptr as usize, destroy, refs: Mutex::new(refs) });
        write(out, h as *mut c_void)
    }
    fn cuUserObjectRetain(o: *mut c_void, n: c_uint) {
        drv()?;
        if n == 0 {
            return Err(err::INVALID_VALUE);
        }
        user_object_retain(o as usize, n)
    }
    fn cuUserObjectRelease(o: *mut c_void, n: c_uint) {
        drv()?;
        if n == 0 {
            return Err(err::INVALID_VALUE);
        }
        user_object_release(o as usize, n)
    }
    /// "Retain a reference to a user object from a graph": new references, or with
    /// CU_GRAPH_USER_OBJECT_MOVE the caller's own moved to the graph.
    fn cuGraphRetainUserObject(g: CUgraph, o: *mut c_void, n: c_uint, flags: c_uint) {
        drv()?;
        let gr = graphs().get(g as usize)?;
        user_objects().get(o as usize)?;
        if n == 0 || flags & !GRAPH_USER_OBJECT_MOVE != 0 {
            return Err(err::INVALID_VALUE);
        }
        if flags & GRAPH_USER_OBJECT_MOVE == 0 {
            user_object_retain(o as usize, n)?;
        }
        *gr.lock().uobjs.entry(o as usize).or_default() += n;
        Ok(())
    }
    /// "Release user object references from a graph": no more than the graph holds.
    fn cuGraphReleaseUserObject(g: CUgraph, o: *mut c_void, n: c_uint) {
        drv()?;
        let gr = graphs().get(g as usize)?;
        if n == 0 {
            return Err(err::INVALID_VALUE);
        }
        {
            let mut st = gr.lock();
            let held = st.uobjs.get_mut(&(o as usize)).ok_or(err::INVALID_VALUE)?;
            if *held < n {
                return Err(err::INVALID_VALUE);
            }
            *held -= n;
            if *held == 0 {
                st.uobjs.remove(&(o as usize));
            }
        }
        user_object_release(o as usize, n)
    }

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
