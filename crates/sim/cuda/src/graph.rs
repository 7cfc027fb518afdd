//! CUDA graphs and their nodes: graphs built by hand (every node kind a program makes: kernel,
//! memcpy, memset, host, child graph, empty, event record / wait, memory allocation / free, and
//! the generic `CUgraphNodeParams` API), per-node parameters, edges, clones, DOT output and user
//! objects. Executables are `graph_exec`'s, stream capture `capture`'s; both build on this.
//!
//! Facts come from CUDA 13.5's `cuda.h` (the doc comment of each function, cited by name) and
//! the CUDA Programming Guide, "CUDA Graphs".

use crate::exec::{self, Dims};
use crate::{cstr, ctx, drv, export, mem, read, write, Registry, Res};
use cuvisor_cuda_abi::cuda::*;
use std::collections::{BTreeSet, HashMap};
use std::ffi::{c_char, c_uint, c_void};
use std::sync::atomic::{AtomicUsize, Ordering::*};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};

// ---- values from cuda.h (CUDA 13.5) the ABI crate does not carry ---------------------------------

/// `CUDA_ERROR_OPERATING_SYSTEM`.
const OPERATING_SYSTEM: CUresult = 304;

/// `CUgraphNodeType`.
pub(crate) const T_KERNEL: i32 = 0;
pub(crate) const T_MEMCPY: i32 = 1;
pub(crate) const T_MEMSET: i32 = 2;
const T_HOST: i32 = 3;
pub(crate) const T_GRAPH: i32 = 4;
const T_EMPTY: i32 = 5;
const T_WAIT_EVENT: i32 = 6;
const T_EVENT_RECORD: i32 = 7;
const T_MEM_ALLOC: i32 = 10;
const T_MEM_FREE: i32 = 11;

/// `CUmemorytype`: HOST 1, DEVICE 2, ARRAY 3, UNIFIED 4.
const MEMTYPE_ARRAY: c_uint = 3;
const MEMTYPE_UNIFIED: c_uint = 4;

/// `CUuserObject_flags`: CU_USER_OBJECT_NO_DESTRUCTOR_SYNC, "Currently it is required to pass"
/// (cuUserObjectCreate). `CUuserObjectRetain_flags`: CU_GRAPH_USER_OBJECT_MOVE.
const USER_OBJECT_NO_DESTRUCTOR_SYNC: c_uint = 1;
const GRAPH_USER_OBJECT_MOVE: c_uint = 1;

/// `CUhostFn`.
pub(crate) type HostFn = Option<extern "C" fn(*mut c_void)>;

// ---- parameter structs (cuda.h layouts) -----------------------------------------------------------

/// `CUDA_MEMCPY3D` (v2).
#[repr(C)]
#[derive(Clone, Copy, PartialEq, Debug)]
pub struct Memcpy3D {
    pub(crate) src_x: usize,
    pub(crate) src_y: usize,
    pub(crate) src_z: usize,
    pub(crate) src_lod: usize,
    pub(crate) src_type: c_uint,
    pub(crate) src_host: usize,
    pub(crate) src_dev: u64,
    pub(crate) src_array: usize,
    pub(crate) reserved0: usize,
    pub(crate) src_pitch: usize,
    pub(crate) src_height: usize,
    pub(crate) dst_x: usize,
    pub(crate) dst_y: usize,
    pub(crate) dst_z: usize,
    pub(crate) dst_lod: usize,
    pub(crate) dst_type: c_uint,
    pub(crate) dst_host: usize,
    pub(crate) dst_dev: u64,
    pub(crate) dst_array: usize,
    pub(crate) reserved1: usize,
    pub(crate) dst_pitch: usize,
    pub(crate) dst_height: usize,
    pub(crate) width: usize,
    pub(crate) height: usize,
    pub(crate) depth: usize,
}

/// `CUDA_MEMCPY_NODE_PARAMS` (in `CUgraphNodeParams`).
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct MemcpyNodeParams {
    pub(crate) flags: i32,
    pub(crate) reserved: i32,
    pub(crate) ctx: usize,
    pub(crate) copy: Memcpy3D,
}

/// `CUDA_MEMSET_NODE_PARAMS` (v1; v2 appends the context).
#[repr(C)]
#[derive(Clone, Copy, PartialEq, Debug)]
pub struct MemsetParams {
    pub dst: u64,
    pub pitch: usize,
    pub value: c_uint,
    pub elem: c_uint,
    pub width: usize,
    pub height: usize,
}

/// `CUDA_HOST_NODE_PARAMS` (v1; v2 appends sync mode and context).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct HostParams {
    pub(crate) f: HostFn,
    pub(crate) data: usize,
}

/// `CUDA_KERNEL_NODE_PARAMS_v2` (= v3): v1, then `kern` and `ctx`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct KernelParamsV2 {
    pub(crate) v1: CUDA_KERNEL_NODE_PARAMS,
    pub(crate) kern: *mut c_void,
    pub(crate) ctx: *mut c_void,
}

/// `CUgraphNodeParams` (CUDA 12.2): type, 3 reserved ints, a 232-byte union, a reserved i64.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct NodeParams {
    pub(crate) ty: i32,
    pub(crate) reserved0: [i32; 3],
    pub(crate) u: [u64; 29],
    pub(crate) reserved2: i64,
}

// ---- nodes and graphs -----------------------------------------------------------------------------

/// A kernel node. The driver copies the parameters when the node is made ("Kernel parameters
/// ... are copied", cuGraphAddKernelNode); the simulator knows one parameter, a `sim_busy*`
/// kernel's run time, and keeps its copy so that cuGraphKernelNodeGetParams can point at it.
#[derive(Clone)]
pub(crate) struct KernelNode {
    pub(crate) func: usize,
    pub(crate) kern: usize,
    pub(crate) grid: [c_uint; 3],
    pub(crate) block: [c_uint; 3],
    pub(crate) smem: c_uint,
    pub(crate) ns: u64,
    pub(crate) arg: Option<Arc<KArg>>,
}

/// The copied first parameter of a `sim_busy*` kernel, and the one-entry `kernelParams` array
/// that points at it.
pub(crate) struct KArg {
    /// Kept alive for `ptrs`, which points at it.
    pub(crate) _val: Box<u64>,
    pub(crate) ptrs: Box<[usize; 1]>,
}

impl KArg {
    pub(crate) fn new(v: u64) -> Arc<KArg> {
        let val = Box::new(v);
        let ptrs = Box::new([&*val as *const u64 as usize]);
        Arc::new(KArg { _val: val, ptrs })
    }
}

/// A memory-allocation node's allocation, shared by its graph and the graph's executables: its
/// address is given back when all are gone (and the allocation is not live).
pub(crate) struct NodeAlloc(pub(crate) Arc<mem::GraphAlloc>);

impl Drop for NodeAlloc {
    fn drop(&mut self) {
        mem::graph_alloc_orphan(&self.0);
    }
}

#[derive(Clone)]
pub(crate) enum Kind {
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
    pub(crate) fn ty(&self) -> i32 {
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
pub(crate) struct NodeRec {
    pub(crate) kind: Kind,
    pub(crate) deps: Vec<usize>,
    pub(crate) enabled: bool,
}

pub(crate) struct Graph {
    /// Node handles are `base + index + 1` (see `node_handle`).
    pub(crate) base: usize,
    pub(crate) st: Mutex<GState>,
}

#[derive(Default)]
pub(crate) struct GState {
    /// Indexed by node; `None` where a node was destroyed (indices stay stable).
    pub(crate) nodes: Vec<Option<NodeRec>>,
    /// User objects this graph holds references to, and how many.
    pub(crate) uobjs: HashMap<usize, u32>,
    /// The graph this one was cloned from (its base): nodes keep their index in a clone.
    pub(crate) clone_of: Option<usize>,
    /// The executable of a graph with memory nodes ("there can be at most one executable graph
    /// in existence for that graph at a time", cuGraphInstantiate).
    pub(crate) mem_exec: Option<Weak<()>>,
}

impl Graph {
    pub(crate) fn lock(&self) -> MutexGuard<'_, GState> {
        self.st.lock().unwrap_or_else(|e| e.into_inner())
    }
    pub(crate) fn push(&self, kind: Kind, deps: Vec<usize>) -> usize {
        let mut st = self.lock();
        st.nodes.push(Some(NodeRec {
            kind,
            deps,
            enabled: true,
        }));
        st.nodes.len() - 1
    }
}

/// Node handles: each graph gets a range of 2^32 values of its own, far above any address a
/// registry handle (a heap pointer) can have, so that a node names its graph.
const NODE_RANGE: usize = 1 << 32;
const NODE_BASE: usize = 1 << 56;

pub(crate) fn node_handle(base: usize, index: usize) -> usize {
    base + index + 1
}

pub(crate) fn graphs() -> &'static Registry<Graph> {
    static R: OnceLock<Registry<Graph>> = OnceLock::new();
    R.get_or_init(Registry::new)
}
/// graph base -> graph handle.
fn graph_bases() -> &'static Mutex<HashMap<usize, usize>> {
    static M: OnceLock<Mutex<HashMap<usize, usize>>> = OnceLock::new();
    M.get_or_init(|| Mutex::new(HashMap::new()))
}

pub(crate) fn new_graph() -> (usize, Arc<Graph>) {
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
pub(crate) fn locate(h: CUgraphNode) -> Result<(Arc<Graph>, usize), CUresult> {
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
pub(crate) fn split(h: CUgraphNode) -> Result<(usize, usize), CUresult> {
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
pub(crate) fn dep_indices(
    g: &Graph,
    deps: *const CUgraphNode,
    n: usize,
) -> Result<Vec<usize>, CUresult> {
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
pub(crate) fn destroy_graph(h: usize) {
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
pub(crate) fn snapshot(h: usize) -> Result<Vec<Option<NodeRec>>, CUresult> {
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
pub(crate) fn graph_of(nodes: &[Option<NodeRec>]) -> usize {
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
pub(crate) fn topo(nodes: &[Option<NodeRec>]) -> Option<Vec<usize>> {
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
pub(crate) fn flat<'a>(nodes: &'a [Option<NodeRec>], out: &mut Vec<&'a Kind>) {
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

/// Checks a copy node's description as the driver does before it runs: memory types host,
/// device, array, unified; reserved fields NULL; pitches at least the width where more than one
/// row is copied, heights at least the copied height where more than one slice is (cuMemcpy3D:
/// CUDA_ERROR_INVALID_VALUE). The copy chapter checks the rest (and the memory) when it runs.
pub(crate) fn check_copy(c: &Memcpy3D) -> Res {
    for t in [c.src_type, c.dst_type] {
        match t {
            CU_MEMORYTYPE_HOST | CU_MEMORYTYPE_DEVICE | MEMTYPE_ARRAY | MEMTYPE_UNIFIED => {}
            _ => return Err(err::INVALID_VALUE),
        }
    }
    if c.reserved0 != 0 || c.reserved1 != 0 {
        return Err(err::INVALID_VALUE);
    }
    let rows = c.height > 1 || c.depth > 1;
    let linear = |t: c_uint| t != MEMTYPE_ARRAY;
    if rows
        && ((linear(c.src_type) && c.src_pitch < c.width)
            || (linear(c.dst_type) && c.dst_pitch < c.width))
    {
        return Err(err::INVALID_VALUE);
    }
    if c.depth > 1
        && ((linear(c.src_type) && c.src_height < c.height)
            || (linear(c.dst_type) && c.dst_height < c.height))
    {
        return Err(err::INVALID_VALUE);
    }
    Ok(())
}

/// A copy node's `CUDA_MEMCPY3D` (the same layout, named as the ABI names it).
pub(crate) fn memcpy3d_abi(c: &Memcpy3D) -> CUDA_MEMCPY3D {
    CUDA_MEMCPY3D {
        srcXInBytes: c.src_x,
        srcY: c.src_y,
        srcZ: c.src_z,
        srcLOD: c.src_lod,
        srcMemoryType: c.src_type,
        srcHost: c.src_host as *const c_void,
        srcDevice: c.src_dev,
        srcArray: c.src_array as CUarray,
        reserved0: c.reserved0 as *mut c_void,
        srcPitch: c.src_pitch,
        srcHeight: c.src_height,
        dstXInBytes: c.dst_x,
        dstY: c.dst_y,
        dstZ: c.dst_z,
        dstLOD: c.dst_lod,
        dstMemoryType: c.dst_type,
        dstHost: c.dst_host as *mut c_void,
        dstDevice: c.dst_dev,
        dstArray: c.dst_array as CUarray,
        reserved1: c.reserved1 as *mut c_void,
        dstPitch: c.dst_pitch,
        dstHeight: c.dst_height,
        WidthInBytes: c.width,
        Height: c.height,
        Depth: c.depth,
    }
}

/// The node as the copy chapter's description (the inverse of [`memcpy3d_abi`]).
pub(crate) fn memcpy3d_node(c: &CUDA_MEMCPY3D) -> Memcpy3D {
    Memcpy3D {
        src_x: c.srcXInBytes,
        src_y: c.srcY,
        src_z: c.srcZ,
        src_lod: c.srcLOD,
        src_type: c.srcMemoryType,
        src_host: c.srcHost as usize,
        src_dev: c.srcDevice,
        src_array: c.srcArray as usize,
        reserved0: c.reserved0 as usize,
        src_pitch: c.srcPitch,
        src_height: c.srcHeight,
        dst_x: c.dstXInBytes,
        dst_y: c.dstY,
        dst_z: c.dstZ,
        dst_lod: c.dstLOD,
        dst_type: c.dstMemoryType,
        dst_host: c.dstHost as usize,
        dst_dev: c.dstDevice,
        dst_array: c.dstArray as usize,
        reserved1: c.reserved1 as usize,
        dst_pitch: c.dstPitch,
        dst_height: c.dstHeight,
        width: c.WidthInBytes,
        height: c.Height,
        depth: c.Depth,
    }
}

/// "elementSize: Size of each element in bytes. Must be 1, 2, or 4"; "pitch: Pitch of destination
/// device pointer. Unused if height is 1" (CUDA_MEMSET_NODE_PARAMS).
pub(crate) fn check_memset(m: &MemsetParams) -> Res {
    if !matches!(m.elem, 1 | 2 | 4) || m.width == 0 || m.height == 0 {
        return Err(err::INVALID_VALUE);
    }
    if m.height > 1 && m.pitch < m.width * m.elem as usize {
        return Err(err::INVALID_VALUE);
    }
    Ok(())
}

pub(crate) fn host_node(p: HostParams) -> Result<Kind, CUresult> {
    if p.f.is_none() {
        return Err(err::INVALID_VALUE);
    }
    Ok(Kind::Host(p))
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
pub(crate) fn free_node(g: &Graph, addr: u64) -> Result<Kind, CUresult> {
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
pub(crate) fn union_of<T: Copy>(p: &NodeParams) -> T {
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
pub(crate) fn kind_of_params(g: &Graph, p: *mut NodeParams) -> Result<Kind, CUresult> {
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
            crate::event::event_exists(e)?;
            Ok(Kind::EventWait(e))
        }
        T_EVENT_RECORD => {
            let e: usize = union_of(&np);
            crate::event::event_exists(e)?;
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

pub(crate) fn user_object_retain(o: usize, n: u32) -> Res {
    let u = user_objects().get(o)?;
    let mut r = u.refs.lock().unwrap_or_else(|e| e.into_inner());
    *r = r.checked_add(n).ok_or(err::INVALID_VALUE)?;
    Ok(())
}

/// Drops `n` references; at the last, the object goes and its destructor runs. "the destroy
/// callback ... may be called from a driver thread" and must not call CUDA
/// (cuUserObjectCreate, CU_USER_OBJECT_NO_DESTRUCTOR_SYNC): it runs on a thread of its own.
pub(crate) fn user_object_release(o: usize, n: u32) -> Res {
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

pub(crate) fn check_default_edges(edges: *const u64, n: usize) -> Res {
    if !edges.is_null() {
        for i in 0..n {
            if read(edges.wrapping_add(i))? != 0 {
                return Err(err::INVALID_VALUE);
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

pub(crate) fn read_memset(p: *const MemsetParams) -> Result<MemsetParams, CUresult> {
    let m = read(p)?;
    check_memset(&m)?;
    Ok(m)
}

pub(crate) fn read_copy(p: *const Memcpy3D) -> Result<Memcpy3D, CUresult> {
    let c = read(p)?;
    check_copy(&c)?;
    Ok(c)
}

pub(crate) fn event_of(e: CUevent) -> Result<usize, CUresult> {
    crate::event::event_exists(e as usize)?;
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

pub(crate) fn kernel_read(p: *const c_void, v2: bool) -> Result<KernelNode, CUresult> {
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
// signatures and struct as the 12.x forms). Exported like every function of cuda.h 13.5;
// cuGetProcAddress resolves them only for a machine whose `driver_version` covers them (the
// default, 13000, as R580 drivers report, does not).

/// cuGraphNodeGetParams: the node's parameters as a `CUgraphNodeParams`.
fn node_get_params(node: CUgraphNode, p: *mut NodeParams) -> Res {
    drv()?;
    write(p, params_of_kind(&node_rec(node)?.kind)?)
}

/// cuGraphNodeGetContainingGraph: the graph a node belongs to.
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
pub(crate) fn settable_type(node: CUgraphNode, p: *const NodeParams) -> Result<i32, CUresult> {
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
    fn cuGraphNodeSetParams_v2(node: CUgraphNode, p: *mut NodeParams) { node_set_params(node, p) }
    fn cuGraphAddNode_v3(node: *mut CUgraphNode, g: CUgraph, deps: *const CUgraphNode, edges: *const u64, ndeps: usize, p: *mut NodeParams) {
        check_default_edges(edges, ndeps)?;
        add_node(node, g, deps, ndeps, |gr| kind_of_params(gr, p))
    }
    fn cuGraphNodeGetParams(node: CUgraphNode, p: *mut NodeParams) { node_get_params(node, p) }
    fn cuGraphNodeGetContainingGraph(node: CUgraphNode, out: *mut CUgraph) { containing_graph(node, out) }

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
}
