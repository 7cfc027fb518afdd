//! CUDA graph memory: instantiation learns each executable's allocation nodes, a launch or an
//! upload is charged what it can make the device's graph memory pool take, and
//! cuDeviceGraphMemTrim settles the charge down. The rules are in `quota::graph`; this room asks
//! the driver (a graph's nodes, a pool's reservation) and forwards. cuGraphLaunch itself stays in
//! `launch.rs` (compute), which calls [`with_memory`] around the real launch.

use super::{hooks, Lib, Real};
use crate::quota::graph::{bounds, Bounds, GraphDriver};
use crate::quota::{Quota, Refusal};
use crate::Mode;
use cuvisor_cuda_abi::cuda::*;
use std::ffi::{c_char, c_int, c_void};

hooks! {
    Cuda cuGraphInstantiate(exec: *mut CUgraphExec, graph: CUgraph, err_node: *mut CUgraphNode, log: *mut c_char, size: usize) => instantiate_v1;
    Cuda cuGraphInstantiate_v2(exec: *mut CUgraphExec, graph: CUgraph, err_node: *mut CUgraphNode, log: *mut c_char, size: usize) => instantiate_v1;
    Cuda cuGraphInstantiateWithFlags(exec: *mut CUgraphExec, graph: CUgraph, flags: u64) => instantiate_with_flags;
    Cuda cuGraphInstantiateWithParams(exec: *mut CUgraphExec, graph: CUgraph, params: *mut c_void) => instantiate_with_params;
    Cuda cuGraphInstantiateWithParams_ptsz(exec: *mut CUgraphExec, graph: CUgraph, params: *mut c_void) => instantiate_with_params;
    Cuda cuGraphUpload(exec: CUgraphExec, stream: CUstream) => upload;
    Cuda cuGraphUpload_ptsz(exec: CUgraphExec, stream: CUstream) => upload;
    Cuda cuGraphExecDestroy(exec: CUgraphExec) => exec_destroy;
    Cuda cuDeviceGraphMemTrim(dev: CUdevice) => trim;
}

const SUCCESS: u32 = err::SUCCESS;
const OOM: u32 = err::OUT_OF_MEMORY;

static REAL_GET_NODES: Real = Real::new(Lib::Cuda, c"cuGraphGetNodes");
static REAL_NODE_TYPE: Real = Real::new(Lib::Cuda, c"cuGraphNodeGetType");
static REAL_ALLOC_PARAMS: Real = Real::new(Lib::Cuda, c"cuGraphMemAllocNodeGetParams");
static REAL_GET_ATTRIBUTE: Real = Real::new(Lib::Cuda, c"cuDeviceGetGraphMemAttribute");
static REAL_DEVICE_GET_UUID: Real = Real::new(Lib::Cuda, c"cuDeviceGetUuid");

fn call_real<F: Copy>(r: &Real) -> Option<F> {
    let a = r.get();
    // SAFETY: `r` names a driver export whose C signature is F (each caller below states it).
    (a != 0).then(|| unsafe { std::mem::transmute_copy::<usize, F>(&a) })
}

/// The driver's answers about graph memory, from the real entry points.
struct Driver;

impl GraphDriver for Driver {
    fn reserved(&self, ordinal: i32) -> Option<u64> {
        type Get = unsafe extern "C" fn(CUdevice, c_int, *mut c_void) -> u32;
        let f = call_real::<Get>(&REAL_GET_ATTRIBUTE)?;
        let mut v = 0u64;
        // SAFETY: cuDeviceGetGraphMemAttribute(dev, RESERVED_MEM_CURRENT, cuuint64_t*) with our
        // own out-value.
        let r = unsafe {
            f(
                ordinal,
                CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT,
                &mut v as *mut u64 as *mut c_void,
            )
        };
        (r == SUCCESS).then_some(v)
    }
    fn trim(&self, ordinal: i32) {
        type Trim = unsafe extern "C" fn(CUdevice) -> u32;
        if let Some(f) = call_real::<Trim>(&cuDeviceGraphMemTrim::REAL) {
            // SAFETY: cuDeviceGraphMemTrim of a device the program has used.
            unsafe { f(ordinal) };
        }
    }
}

/// The allocation nodes of `graph` as (ordinal, bytesize), from the driver; None when it does
/// not answer (an invalid graph, or a driver without these entry points).
fn allocation_nodes(graph: CUgraph) -> Option<Vec<(i32, u64)>> {
    type GetNodes = unsafe extern "C" fn(CUgraph, *mut CUgraphNode, *mut usize) -> u32;
    type NodeType = unsafe extern "C" fn(CUgraphNode, *mut c_int) -> u32;
    type Params = unsafe extern "C" fn(CUgraphNode, *mut CUDA_MEM_ALLOC_NODE_PARAMS) -> u32;
    let get = call_real::<GetNodes>(&REAL_GET_NODES)?;
    let ty = call_real::<NodeType>(&REAL_NODE_TYPE)?;
    let mut n = 0usize;
    // SAFETY: cuGraphGetNodes(graph, NULL, size_t*) asks for the count only.
    if unsafe { get(graph, std::ptr::null_mut(), &mut n) } != SUCCESS {
        return None;
    }
    let mut nodes: Vec<CUgraphNode> = vec![std::ptr::null_mut(); n];
    // SAFETY: an array of `n` nodes, `n` in the count.
    if n > 0 && unsafe { get(graph, nodes.as_mut_ptr(), &mut n) } != SUCCESS {
        return None;
    }
    let mut out = Vec::new();
    for &node in nodes.iter().take(n) {
        let mut t: c_int = -1;
        // SAFETY: cuGraphNodeGetType(node, CUgraphNodeType*) of a node the driver listed.
        if unsafe { ty(node, &mut t) } != SUCCESS {
            return None;
        }
        if t != CU_GRAPH_NODE_TYPE_MEM_ALLOC {
            continue;
        }
        let params = call_real::<Params>(&REAL_ALLOC_PARAMS)?;
        // SAFETY: all-zero is a valid CUDA_MEM_ALLOC_NODE_PARAMS (null pointers, zero counts).
        let mut p: CUDA_MEM_ALLOC_NODE_PARAMS = unsafe { std::mem::zeroed() };
        // SAFETY: cuGraphMemAllocNodeGetParams(node, params*) of an allocation node, our own
        // out-struct.
        if unsafe { params(node, &mut p) } != SUCCESS {
            return None;
        }
        out.push((p.poolProps.location.id, p.bytesize as u64));
    }
    Some(out)
}

fn entry_of(q: &Quota, ordinal: i32) -> Option<usize> {
    q.entry(ordinal, || {
        let f =
            call_real::<unsafe extern "C" fn(*mut CUuuid, CUdevice) -> u32>(&REAL_DEVICE_GET_UUID)?;
        let mut u = CUuuid::default();
        // SAFETY: cuDeviceGetUuid(CUuuid*, CUdevice) with a valid out-pointer.
        (unsafe { f(&mut u, ordinal) } == SUCCESS).then_some(u.bytes)
    })
}

/// Runs `go` (a launch or an upload of an executable with bounds `b`) charged by the rules.
fn charged(q: &Quota, call: &str, b: &Bounds, go: impl FnOnce() -> u32) -> u32 {
    let mut need = Vec::with_capacity(b.len());
    for &(ord, bytes) in b {
        let Some(e) = entry_of(q, ord) else {
            q.log_refusal(call, ord, bytes, Refusal::NoEntry);
            return OOM;
        };
        need.push((ord, e, bytes));
    }
    let t = match q.graph_begin(&need, &Driver) {
        Ok(t) => t,
        Err((ord, bytes, why)) => {
            q.log_refusal(call, ord, bytes, why);
            return OOM;
        }
    };
    let r = go();
    if r != SUCCESS {
        q.graph_abort(t, &Driver);
        return r;
    }
    if let Err(why) = q.graph_end(t, &Driver) {
        // Taken by the driver already (it reserves in larger steps than cuvisor's bound): it
        // stays charged, above the quota, and later allocations are refused until it is back.
        let ord = b.first().map_or(-1, |&(o, _)| o);
        q.log_refusal(call, ord, 0, why);
    }
    r
}

/// cuGraphLaunch (from `launch.rs`): an executable with allocation nodes is charged what its
/// launch can make the graph memory pools take; a launch the quota cannot cover is refused with
/// CUDA_ERROR_OUT_OF_MEMORY, the driver's error for graph memory it cannot allocate. Others pass
/// with one atomic load.
#[inline]
pub(super) fn with_memory(exec: CUgraphExec, go: impl FnOnce() -> u32) -> u32 {
    let Mode::Enforce(q) = crate::mode() else {
        return go();
    };
    match q.graph.bounds_of(exec as u64) {
        None => go(),
        Some(b) => charged(q, "cuGraphLaunch", &b, go),
    }
}

fn upload(real: impl Fn(CUgraphExec, CUstream) -> u32, exec: CUgraphExec, s: CUstream) -> u32 {
    let Mode::Enforce(q) = crate::mode() else {
        return real(exec, s);
    };
    match q.graph.bounds_of(exec as u64) {
        None => real(exec, s),
        Some(b) => charged(q, "cuGraphUpload", &b, || real(exec, s)),
    }
}

/// Every instantiation: the graph's allocation nodes are read before the driver instantiates
/// (their sizes are the graph's), and recorded for the executable it makes. `upload`: the call
/// also uploads (CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD), and is charged as an upload. A graph whose
/// nodes cannot be read is refused if it instantiates (fail closed).
fn instantiate(
    call: &str,
    exec: *mut CUgraphExec,
    graph: CUgraph,
    upload: bool,
    go: impl Fn() -> u32,
) -> u32 {
    let q = match crate::mode() {
        Mode::PassThrough => return go(),
        Mode::Broken(_) => {
            return match allocation_nodes(graph) {
                Some(n) if n.is_empty() => go(),
                _ => {
                    crate::log::refused_broken(call);
                    OOM
                }
            }
        }
        Mode::Enforce(q) => q,
    };
    let Some(nodes) = allocation_nodes(graph) else {
        let r = go();
        if r != SUCCESS {
            return r;
        }
        crate::log::error(&format!(
            "{call} refused: the graph's allocation nodes cannot be read, so its memory cannot be charged"
        ));
        destroy_real(exec);
        return OOM;
    };
    let b = bounds(nodes);
    let r = if upload && !b.is_empty() {
        charged(q, call, &b, &go)
    } else {
        go()
    };
    if r == SUCCESS && !exec.is_null() {
        // SAFETY: the driver wrote the new executable to the caller's `exec`.
        let x = unsafe { exec.read_unaligned() };
        q.graph.instantiated(x as u64, b);
    }
    r
}

fn destroy_real(exec: *mut CUgraphExec) {
    if exec.is_null() {
        return;
    }
    // SAFETY: the driver wrote the new executable to the caller's `exec`.
    let x = unsafe { exec.read_unaligned() };
    if let Some(f) =
        call_real::<unsafe extern "C" fn(CUgraphExec) -> u32>(&cuGraphExecDestroy::REAL)
    {
        // SAFETY: cuGraphExecDestroy of the executable just made, which the program never saw.
        unsafe { f(x) };
    }
}

fn instantiate_v1(
    real: impl Fn(*mut CUgraphExec, CUgraph, *mut CUgraphNode, *mut c_char, usize) -> u32,
    exec: *mut CUgraphExec,
    graph: CUgraph,
    err_node: *mut CUgraphNode,
    log: *mut c_char,
    size: usize,
) -> u32 {
    instantiate("cuGraphInstantiate", exec, graph, false, || {
        real(exec, graph, err_node, log, size)
    })
}

fn instantiate_with_flags(
    real: impl Fn(*mut CUgraphExec, CUgraph, u64) -> u32,
    exec: *mut CUgraphExec,
    graph: CUgraph,
    flags: u64,
) -> u32 {
    instantiate("cuGraphInstantiateWithFlags", exec, graph, false, || {
        real(exec, graph, flags)
    })
}

/// `CUDA_GRAPH_INSTANTIATE_PARAMS` starts with its `flags` (cuuint64_t).
fn instantiate_with_params(
    real: impl Fn(*mut CUgraphExec, CUgraph, *mut c_void) -> u32,
    exec: *mut CUgraphExec,
    graph: CUgraph,
    params: *mut c_void,
) -> u32 {
    let flags = if params.is_null() {
        0
    } else {
        // SAFETY: non-null and, by the driver API contract, a CUDA_GRAPH_INSTANTIATE_PARAMS,
        // whose first field is the flags.
        unsafe { (params as *const u64).read_unaligned() }
    };
    let upload = flags & CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD != 0;
    instantiate("cuGraphInstantiateWithParams", exec, graph, upload, || {
        real(exec, graph, params)
    })
}

fn exec_destroy(real: impl Fn(CUgraphExec) -> u32, exec: CUgraphExec) -> u32 {
    let r = real(exec);
    if r == SUCCESS {
        if let Mode::Enforce(q) = crate::mode() {
            q.graph.destroyed(exec as u64);
        }
    }
    r
}

fn trim(real: impl Fn(CUdevice) -> u32, dev: CUdevice) -> u32 {
    let r = real(dev);
    if r == SUCCESS {
        if let Mode::Enforce(q) = crate::mode() {
            q.graph_settle(Some(dev), &Driver);
        }
    }
    r
}

/// After a context's teardown: each device's graph memory charge follows its reservation.
pub(super) fn settle_all() {
    if let Mode::Enforce(q) = crate::mode() {
        q.graph_settle(None, &Driver);
    }
}
