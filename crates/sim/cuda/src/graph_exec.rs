//! Executable graphs: instantiation (every form), launch in dependency order on a stream,
//! upload, whole-graph update, per-node parameters and enable/disable in an executable.
//! Facts from CUDA 13.5's `cuda.h` doc comments, cited at each.

use crate::capture::{capture_push, capturing};
use crate::graph::*;
use crate::launch::Node;
use crate::stream::{self, Stream};
use crate::{copy, event};
use crate::{ctx, drv, export, mem, read, write, Registry, Res};
use cuvisor_cuda_abi::cuda::*;
use cuvisor_sim::state::{now_ns, sleep_until};
use std::collections::HashMap;
use std::ffi::{c_char, c_uint, c_void};
use std::sync::atomic::Ordering::*;
use std::sync::{Arc, Mutex, OnceLock};

/// `CUresult`: "the graph update was not performed because it included changes which violated
/// constraints specific to instantiated graph update" (910).
const GRAPH_EXEC_UPDATE_FAILURE: CUresult = 910;

/// `CUgraphExecUpdateResult`.
const UPDATE_SUCCESS: i32 = 0;
const UPDATE_TOPOLOGY_CHANGED: i32 = 2;
const UPDATE_NODE_TYPE_CHANGED: i32 = 3;
const UPDATE_PARAMETERS_CHANGED: i32 = 5;

/// `CUgraphInstantiate_flags`: AUTO_FREE_ON_LAUNCH 1, UPLOAD 2, DEVICE_LAUNCH 4,
/// USE_NODE_PRIORITY 8.
const INSTANTIATE_FLAGS: u64 = 1 | 2 | 4 | 8;
const INSTANTIATE_FLAG_DEVICE_LAUNCH: u64 = 4;

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

pub(crate) struct GraphExec {
    /// The base of the graph it was instantiated from: its node handles name this one's nodes.
    base: usize,
    nodes: Mutex<Vec<Option<NodeRec>>>,
    /// CUgraphInstantiate_flags.
    flags: u64,
    /// User-object references the executable holds (those of its graph at instantiation).
    uobjs: Vec<(usize, u32)>,
    /// Alive as long as the executable: its graph keeps a weak reference when it has memory
    /// nodes (one executable at a time).
    token: Arc<()>,
}

impl Drop for GraphExec {
    fn drop(&mut self) {
        for &(o, n) in &self.uobjs {
            let _ = user_object_release(o, n);
        }
    }
}

fn execs() -> &'static Registry<GraphExec> {
    static R: OnceLock<Registry<GraphExec>> = OnceLock::new();
    R.get_or_init(Registry::new)
}

// ---- instantiate, update, launch ------------------------------------------------------------------

/// A host function at its place in the stream: it runs once the work before it has ended, and
/// what follows it in the launch waits for it to return (CUDA Programming Guide, "Host
/// Functions"). The simulator runs it in the launching thread after waiting for the stream.
/// Merge point: where the stream chapter runs host functions on a driver thread, host nodes
/// should go there (one call per node).
fn run_host(s: &Stream, p: &HostParams) {
    sleep_until(s.done_at());
    if let Some(f) = p.f {
        crate::call_host(|| f(p.data as *mut c_void));
    }
}

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
        token: Arc::new(()),
    });
    if let Err(e) = write(exec, x as CUgraphExec) {
        let _ = execs().remove(x);
        return Err(e);
    }
    if has_mem {
        g.lock().mem_exec = Some(Arc::downgrade(&xa.token));
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
        stream::stream(params.upload_stream, pt)?;
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
    stream::stream(h, pt)?;
    upload(&x)
}

/// Runs a copy node: the copy chapter's 3D copy, checked against the allocations and arrays
/// when it runs.
fn run_copy(c: &Memcpy3D, s: &Stream) -> Res {
    check_copy(c)?;
    copy::copy3d_now(&memcpy3d_abi(c), s)
}

/// Runs a memset node: the copy chapter's fill, checked when it runs.
fn run_memset(m: &MemsetParams, s: &Stream) -> Res {
    check_memset(m)?;
    copy::fill_now(s, m.dst, m.pitch, m.value, m.elem as u64, m.width, m.height)
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
    let s = stream::stream(h, pt)?;
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
    // The nodes run here, in the launching thread, in dependency order: first whatever host work
    // is queued on the stream before the launch must be done (see `stream`).
    stream::wait_for(|| !s.busy());
    let ch = match s.ctx_handle() {
        0 => ctx::current()?.0,
        c => c,
    };
    for op in &ops {
        match op {
            Kind::Kernel(k) => s.run(Node { ns: k.ns })?,
            Kind::Memcpy(c) => run_copy(c, &s)?,
            Kind::Memset(m) => run_memset(m, &s)?,
            Kind::Host(p) => run_host(&s, p),
            Kind::EventRecord(e) => event::event_record_at(*e, s.done_at().max(now_ns()))?,
            Kind::EventWait(e) => {
                s.tail.fetch_max(event::event_time(*e)?, AcqRel);
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

export! {
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
}
