//! Copies and memsets: every `cuMemcpy*` and `cuMemset*` entry point.
//!
//! Each copy is resolved into two checked sides (host memory, device memory of a device, or a
//! CUDA array on a device: the address of its first byte, its row pitch and rows per slice) and
//! an extent, and then goes through [`transfer`], the one function that moves bytes. A checked
//! copy is a [`Work`]: its bytes (moved when its turn comes) and its cost, which
//! `copy_engine` times over the modelled interconnect when it runs: an asynchronous copy starts
//! after its stream's work and moves the stream's and its context's tail to its end (so events,
//! stream and context synchronization see it); a synchronous one follows the legacy stream
//! (after the context's work) and returns when the "API synchronization behavior" page says
//! (`copy_engine::sync_waits`). Bytes move at once when the copy runs; the model charges the
//! time (and a copy from memory that was never written moves no bytes: see [`transfer`]).
//!
//! Validation follows the CUDA 13.5 `cuda.h` reference of each function (quoted where used); a
//! refused copy moves nothing. Device ranges must lie in one live allocation (an interior
//! pointer is fine); host memory is the caller's (the API contract), except that an address in
//! the simulator's device address space that is no live allocation is refused.

use crate::array;
use crate::capture;
use crate::copy_engine::{self, Cost, Part, Place};
use crate::graph::MemsetParams;
use crate::stream::{self, Stream};
use crate::{ctx, export, mem, pointer, read, write, Res};
use cuvisor_cuda_abi::cuda::*;
use cuvisor_sim::state::sleep_until;
use std::ffi::{c_int, c_uint, c_void};
use std::sync::atomic::Ordering::{AcqRel, Acquire};

/// `CU_DEVICE_ATTRIBUTE_MAX_PITCH` of every modelled GPU: 2147483647 bytes (`deviceQuery`'s
/// "Maximum memory pitch: 2147483647 bytes" on Volta, Ampere and Hopper GPUs, CUDA samples).
/// "cuMemcpy2D() returns an error if any pitch is greater than the maximum allowed
/// (CU_DEVICE_ATTRIBUTE_MAX_PITCH)" (cuda.h 13.5).
pub(crate) const MAX_PITCH: u64 = i32::MAX as u64;

/// What one side of a copy is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Host,
    /// Device memory of device `usize`.
    Device(usize),
    /// A CUDA array on device `usize`.
    Array(usize),
}

/// One side of a copy, checked: its first byte, bytes from a row to the next, rows from a
/// slice to the next.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Side {
    pub kind: Kind,
    addr: u64,
    pitch: u64,
    rows: u64,
}

/// Width in bytes, height in rows, depth in slices.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Extent {
    pub width: u64,
    pub height: u64,
    pub depth: u64,
}

impl Extent {
    fn line(n: u64) -> Extent {
        Extent {
            width: n,
            height: 1,
            depth: 1,
        }
    }
    fn empty(&self) -> bool {
        self.width == 0 || self.height == 0 || self.depth == 0
    }
}

/// A checked copy or memset: the bytes it moves once its turn in the stream comes.
pub(crate) type Job = Box<dyn FnOnce() + Send>;

/// A checked copy or memset: what it does when its turn comes, and what that costs in device
/// time (`copy_engine::charge`).
pub(crate) struct Work {
    pub job: Job,
    pub cost: Cost,
}

fn nothing() -> Work {
    Work {
        job: Box::new(|| {}),
        cost: Cost::None,
    }
}

/// Moves the bytes of one checked copy. Every copy of the simulated driver ends here (its time
/// is charged by whoever runs its [`Work`]).
///
/// Bytes cost no wall time the model does not charge, where that can be had exactly: a source
/// in a plain device allocation that was never written reads as zeros (`mem::plain_dirty`), so
/// nothing is read; the destination is made zeros instead, by dropping its whole pages when it
/// is a plain allocation too (`mem::zero_plain`: MADV_DONTNEED, so a multi-GPU job's untouched
/// gradients cost no memcpy and no RAM), by writing zeros otherwise. Zeros in, zeros out.
pub(crate) fn transfer(src: &Side, dst: &Side, e: Extent) {
    if e.empty() {
        return;
    }
    let zeros = matches!(src.kind, Kind::Device(_)) && mem::plain_dirty(src.addr) == Some(false);
    if !zeros && matches!(dst.kind, Kind::Device(_)) {
        // Written now, when its bytes move (a clean allocation given only zeros stays clean, so
        // a job that all-reduces untouched gradients keeps copying nothing). Checked when the
        // copy was planned; a block freed since (a caller's race) is no one's to mark.
        let _ = mem::device_range(dst.addr, 1, true);
    }
    let put = |d: u64, s: u64, n: u64| {
        if !zeros {
            crate::copy_bytes(d, s, n as usize);
        } else if matches!(dst.kind, Kind::Device(_)) && mem::plain_dirty(d).is_some() {
            mem::zero_plain(d, n);
        } else {
            // SAFETY: [d, d + n) is the copy's checked destination (device memory of a live
            // allocation or an array, or host memory the caller passed for n bytes).
            unsafe { std::ptr::write_bytes(d as *mut u8, 0, n as usize) };
        }
    };
    let packed = |s: &Side| s.pitch == e.width && (e.depth == 1 || s.rows == e.height);
    if packed(src) && packed(dst) {
        put(dst.addr, src.addr, e.width * e.height * e.depth);
        return;
    }
    for z in 0..e.depth {
        for y in 0..e.height {
            let s = src.addr + (z * src.rows + y) * src.pitch;
            let d = dst.addr + (z * dst.rows + y) * dst.pitch;
            put(d, s, e.width);
        }
    }
}

/// Where one side of a copy is, for timing.
fn place(s: &Side) -> Place {
    match s.kind {
        Kind::Host => Place::Host {
            pinned: pointer::pinned(s.addr),
        },
        Kind::Device(d) | Kind::Array(d) => Place::Device(d),
    }
}

/// The context whose memory one side is (device memory), or the current one (arrays).
fn owner(s: &Side) -> Option<usize> {
    match s.kind {
        Kind::Device(_) => mem::find(s.addr).map(|f| f.ctx),
        _ => ctx::current().ok().map(|c| c.0),
    }
}

/// One checked copy as `copy_engine` times it. `ctxs`: the (source, destination) contexts the
/// caller named (cuMemcpyPeer, cuMemcpy3DPeer); otherwise those whose memory the sides are.
fn part(s: &Side, d: &Side, e: Extent, ctxs: Option<(usize, usize)>) -> Part {
    let (src, dst) = (place(s), place(d));
    let peer = match (src, dst) {
        (Place::Device(a), Place::Device(b)) if a != b => ctxs
            .or_else(|| Some((owner(s)?, owner(d)?)))
            .is_some_and(|(x, y)| copy_engine::peer_between(x, y)),
        _ => false,
    };
    Part {
        src,
        dst,
        bytes: e.width * e.height * e.depth,
        peer,
    }
}

/// One side of a copy as the caller described it (a `CUDA_MEMCPY2D`/`3D`/`3D_PEER` half, or a
/// plain pointer).
#[derive(Clone, Copy, Debug)]
struct Desc {
    memtype: c_uint,
    host: u64,
    device: u64,
    array: CUarray,
    x: u64,
    y: u64,
    z: u64,
    pitch: u64,
    /// Rows per slice (3D; "may be 0 if Depth==1").
    height: u64,
}

impl Desc {
    fn ptr(memtype: c_uint, addr: u64) -> Desc {
        Desc {
            memtype,
            host: addr,
            device: addr,
            array: std::ptr::null_mut(),
            x: 0,
            y: 0,
            z: 0,
            pitch: 0,
            height: 0,
        }
    }
}

/// The bytes a pitched side spans from its first to its last byte, checked.
fn span(d: &Desc, e: Extent) -> Result<(u64, u64), CUresult> {
    let bad = err::INVALID_VALUE;
    let rows = d.height;
    // "If specified, srcPitch must be greater than or equal to WidthInBytes + srcXInBytes";
    // "If specified, srcHeight must be greater than or equal to Height + srcY" (cuMemcpy3D). A
    // pitch matters once there is a second row, a slice height once there is a second slice.
    let reach = d.x.checked_add(e.width).ok_or(bad)?;
    if (e.height > 1 || e.depth > 1 || d.y > 0 || d.z > 0) && d.pitch < reach {
        return Err(bad);
    }
    if (e.depth > 1 || d.z > 0) && rows < d.y.checked_add(e.height).ok_or(bad)? {
        return Err(bad);
    }
    if d.pitch > MAX_PITCH {
        return Err(bad);
    }
    let first =
        d.z.checked_mul(rows)
            .and_then(|r| r.checked_add(d.y))
            .and_then(|r| r.checked_mul(d.pitch))
            .and_then(|o| o.checked_add(d.x))
            .ok_or(bad)?;
    let last_row = (e.depth - 1)
        .checked_mul(rows)
        .and_then(|r| r.checked_add(e.height - 1))
        .and_then(|r| r.checked_mul(d.pitch))
        .and_then(|o| o.checked_add(e.width))
        .ok_or(bad)?;
    Ok((first, last_row))
}

/// Checks one side of a copy of extent `e` (not empty) and says where its bytes are (a
/// destination's device memory is marked dirty by [`transfer`], when bytes other than zeros
/// reach it).
fn resolve(d: &Desc, e: Extent) -> Result<Side, CUresult> {
    let bad = err::INVALID_VALUE;
    match d.memtype {
        CU_MEMORYTYPE_ARRAY => {
            // An array: "srcHost, srcDevice and srcPitch are ignored" (cuMemcpy2D).
            let a = array::get(d.array).map_err(|_| bad)?;
            let g = a.geometry();
            // "For CUDA arrays, srcXInBytes must be evenly divisible by the array element
            // size" (cuMemcpy2D); whole elements are copied, so the width is too (modelled).
            if !d.x.is_multiple_of(g.elem) || !e.width.is_multiple_of(g.elem) {
                return Err(bad);
            }
            let fits = |o: u64, n: u64, lim: u64| o.checked_add(n).is_some_and(|end| end <= lim);
            if !fits(d.x, e.width, g.row_bytes)
                || !fits(d.y, e.height, g.rows)
                || !fits(d.z, e.depth, g.slices)
            {
                return Err(bad);
            }
            Ok(Side {
                kind: Kind::Array(a.dev),
                addr: a.base() + (d.z * g.rows + d.y) * g.row_bytes + d.x,
                pitch: g.row_bytes,
                rows: g.rows,
            })
        }
        CU_MEMORYTYPE_HOST | CU_MEMORYTYPE_DEVICE | CU_MEMORYTYPE_UNIFIED => {
            let base = if d.memtype == CU_MEMORYTYPE_HOST {
                d.host
            } else {
                d.device
            };
            if base == 0 {
                return Err(bad);
            }
            let (first, len) = span(d, e)?;
            let start = base.checked_add(first).ok_or(bad)?;
            let kind = match mem::device_range(start, len, false) {
                Ok(dev) => Kind::Device(dev),
                // Device memory must be a live allocation; host memory is the caller's, but not
                // an address of the device address space that nothing holds (freed, or past an
                // allocation's end).
                Err(_) if d.memtype == CU_MEMORYTYPE_DEVICE || mem::in_any_arena(start) => {
                    return Err(bad)
                }
                Err(_) => Kind::Host,
            };
            Ok(Side {
                kind,
                addr: start,
                pitch: if e.height > 1 || e.depth > 1 {
                    d.pitch
                } else {
                    e.width
                },
                rows: if e.depth > 1 { d.height } else { e.height },
            })
        }
        _ => Err(bad),
    }
}

/// Checks both sides of a copy: the bytes it moves, once run. Nothing moves unless both are
/// valid.
fn plan(src: &Desc, dst: &Desc, e: Extent) -> Result<Work, CUresult> {
    if e.empty() {
        // Still a bad memory type or a null host pointer is refused by the real driver's
        // parameter checks; an empty copy of valid sides does nothing.
        for d in [src, dst] {
            if !matches!(
                d.memtype,
                CU_MEMORYTYPE_HOST
                    | CU_MEMORYTYPE_DEVICE
                    | CU_MEMORYTYPE_ARRAY
                    | CU_MEMORYTYPE_UNIFIED
            ) {
                return Err(err::INVALID_VALUE);
            }
        }
        return Ok(nothing());
    }
    let s = resolve(src, e)?;
    let d = resolve(dst, e)?;
    Ok(moves(vec![(s, d, e)]))
}

/// Checked copies: their bytes, moved in order when the job runs, and their cost.
fn moves(plan: Vec<(Side, Side, Extent)>) -> Work {
    moves_between(plan, None)
}

/// As [`moves`], between the memory of the (source, destination) contexts `ctxs`.
fn moves_between(plan: Vec<(Side, Side, Extent)>, ctxs: Option<(usize, usize)>) -> Work {
    let parts = plan.iter().map(|(s, d, e)| part(s, d, *e, ctxs)).collect();
    Work {
        job: Box::new(move || {
            for (s, d, e) in plan {
                transfer(&s, &d, e);
            }
        }),
        cost: Cost::Copies(parts),
    }
}

/// Runs checked work synchronously, as the legacy stream of the current context does: after
/// the context's work, its end becoming the legacy stream's and the context's; the host waits
/// for it where the "API synchronization behavior" page says (`copy_engine::sync_waits`).
fn run_sync(check: impl FnOnce() -> Result<Work, CUresult>) -> Res {
    run_sync_after(&[], check)
}

/// `run_sync`, also after all the work of the contexts `also` (cuMemcpyPeer's source and
/// destination: cuda_runtime_api.h 13.5, cudaMemcpyPeer: "this function is serialized with
/// respect all pending and future asynchronous work in to the current device, srcDevice, and
/// dstDevice").
fn run_sync_after(also: &[&ctx::Context], check: impl FnOnce() -> Result<Work, CUresult>) -> Res {
    let (ch, c) = ctx::current()?;
    stream::wait_queued(&c);
    for o in also {
        stream::wait_queued(o);
    }
    let w = check()?;
    let legacy = stream::legacy_stream(ch, &c);
    // The legacy stream's place: after its own and the blocking streams' work, not after the
    // context's non-blocking streams ("should perform no implicit synchronization with stream
    // 0", cuda.h, CU_STREAM_NON_BLOCKING).
    let not_before = also
        .iter()
        .map(|o| o.work_tail.load(Acquire))
        .fold(stream::start_after(&legacy), u64::max);
    let end = copy_engine::charge(&w.cost, c.dev, not_before);
    (w.job)();
    legacy.tail.fetch_max(end, AcqRel);
    c.work_tail.fetch_max(end, AcqRel);
    if matches!(w.cost, Cost::None) || copy_engine::sync_waits(&w.cost) {
        sleep_until(end);
    }
    Ok(())
}

/// Runs checked work in stream `s`'s order, now (the caller holds its turn): timed after the
/// stream's work on the stream's device, its end the stream's and the context's tail.
pub(crate) fn run_on(s: &Stream, w: Work) {
    let end = copy_engine::charge(&w.cost, s.dev, stream::start_after(s));
    (w.job)();
    s.tail.fetch_max(end, AcqRel);
    s.ctx_tail.fetch_max(end, AcqRel);
    if copy_engine::async_waits(&w.cost) {
        sleep_until(end);
    }
}

/// Resolves the stream, validates the operation (`check`, which returns the work), and runs
/// the work in stream order, timed (`run_on`). For the asynchronous copies and memsets.
pub(crate) fn ordered(
    h: CUstream,
    pt: bool,
    check: impl FnOnce() -> Result<Work, CUresult>,
) -> Res {
    let s = stream::stream(h, pt)?;
    let w = check()?;
    s.submit(move |s| run_on(s, w));
    Ok(())
}

/// How a copy entry point orders itself: synchronous (waits for the context's work), or on a
/// stream (checked; `true`: per-thread default stream for a NULL handle).
#[derive(Clone, Copy)]
enum On {
    Sync,
    Stream(CUstream, bool),
}

/// What an async copy or memset becomes on a capturing stream.
enum Captured {
    /// A memcpy node.
    Copy(CUDA_MEMCPY3D),
    /// A memset node.
    Set(MemsetParams),
    /// Nothing the graphs model (peer and batched copies, 1D array copies): refused.
    Unsupported,
}

/// On a capturing stream the copy is recorded as a node instead of run: the capture's answer
/// (None: not captured, run it).
fn captured(on: On, node: impl FnOnce() -> Captured) -> Option<Res> {
    let On::Stream(h, pt) = on else {
        return None;
    };
    let s = match stream::stream(h, pt) {
        Ok(s) => s,
        Err(e) => return Some(Err(e)),
    };
    match node() {
        Captured::Copy(c) => capture::capture_copy(&s, &c),
        Captured::Set(m) => capture::capture_memset(&s, m),
        Captured::Unsupported => capture::capture_unsupported(&s),
    }
}

/// A copy as the `CUDA_MEMCPY3D` a memcpy node holds (the inverse of `split3d`).
fn as_3d(src: &Desc, dst: &Desc, e: Extent) -> CUDA_MEMCPY3D {
    CUDA_MEMCPY3D {
        srcXInBytes: src.x as usize,
        srcY: src.y as usize,
        srcZ: src.z as usize,
        srcLOD: 0,
        srcMemoryType: src.memtype,
        srcHost: src.host as *const c_void,
        srcDevice: src.device,
        srcArray: src.array,
        reserved0: std::ptr::null_mut(),
        srcPitch: src.pitch as usize,
        srcHeight: src.height as usize,
        dstXInBytes: dst.x as usize,
        dstY: dst.y as usize,
        dstZ: dst.z as usize,
        dstLOD: 0,
        dstMemoryType: dst.memtype,
        dstHost: dst.host as *mut c_void,
        dstDevice: dst.device,
        dstArray: dst.array,
        reserved1: std::ptr::null_mut(),
        dstPitch: dst.pitch as usize,
        dstHeight: dst.height as usize,
        WidthInBytes: e.width as usize,
        Height: e.height as usize,
        Depth: e.depth as usize,
    }
}

/// Checks a copy and runs it where `on` says: after the context's queued work, or in its
/// stream's order.
fn run(on: On, check: impl FnOnce() -> Result<Work, CUresult>) -> Res {
    match on {
        On::Sync => run_sync(check),
        On::Stream(s, pt) => ordered(s, pt, check),
    }
}

// ---- linear copies ------------------------------------------------------------------------------

fn linear(on: On, dst: Desc, src: Desc, n: usize) -> Res {
    let e = Extent::line(n as u64);
    if let Some(r) = captured(on, || Captured::Copy(as_3d(&src, &dst, e))) {
        return r;
    }
    run(on, || plan(&src, &dst, e))
}

fn host_src(p: *const c_void) -> Desc {
    Desc::ptr(CU_MEMORYTYPE_HOST, p as u64)
}
fn host_dst(p: *mut c_void) -> Desc {
    Desc::ptr(CU_MEMORYTYPE_HOST, p as u64)
}
fn dev(p: CUdeviceptr) -> Desc {
    Desc::ptr(CU_MEMORYTYPE_DEVICE, p)
}
fn unified(p: CUdeviceptr) -> Desc {
    Desc::ptr(CU_MEMORYTYPE_UNIFIED, p)
}

/// A 1D copy into or out of an array: "dstOffset ... specify the destination ... offsets in
/// bytes into the CUDA arrays" (cuMemcpyAtoA). The simulator treats the array's bytes as one
/// line in its layout (row after row), so a 2D array's offset runs on into its next rows. The
/// side it answers is already addressed (bounds checked here): the array's memory at the offset.
fn array_line(h: CUarray, offset: usize, n: usize) -> Result<Desc, CUresult> {
    let a = array::get(h).map_err(|_| err::INVALID_VALUE)?;
    let total = a.geometry().bytes().ok_or(err::INVALID_VALUE)?;
    if (offset as u64)
        .checked_add(n as u64)
        .is_none_or(|end| end > total)
    {
        return Err(err::INVALID_VALUE);
    }
    Ok(Desc {
        memtype: ARRAY_LINE,
        host: a.base() + offset as u64,
        device: a.dev as u64,
        array: h,
        ..Desc::ptr(ARRAY_LINE, 0)
    })
}

/// Internal memory type: an array's memory seen as one line (1D array copies).
const ARRAY_LINE: c_uint = 0x100;

fn line_side(d: &Desc, n: u64) -> Result<Side, CUresult> {
    if d.memtype == ARRAY_LINE {
        return Ok(Side {
            kind: Kind::Array(d.device as usize),
            addr: d.host,
            pitch: n,
            rows: 1,
        });
    }
    resolve(d, Extent::line(n))
}

/// 1D copies where one side or both are arrays.
fn array_copy(on: On, dst: Result<Desc, CUresult>, src: Result<Desc, CUresult>, n: usize) -> Res {
    if let Some(r) = captured(on, || Captured::Unsupported) {
        return r;
    }
    run(on, || array_plan(dst?, src?, n))
}

fn array_plan(dst: Desc, src: Desc, n: usize) -> Result<Work, CUresult> {
    if n == 0 {
        return Ok(nothing());
    }
    // AtoA: "the elements must be the same size; and count must be evenly divisible by that
    // size" (cuMemcpyAtoA).
    if src.memtype == ARRAY_LINE && dst.memtype == ARRAY_LINE {
        let es = array::get(src.array).map(|a| a.geometry().elem);
        let ed = array::get(dst.array).map(|a| a.geometry().elem);
        match (es, ed) {
            (Ok(a), Ok(b)) if a == b && (n as u64).is_multiple_of(a) => {}
            _ => return Err(err::INVALID_VALUE),
        }
    }
    let s = line_side(&src, n as u64)?;
    let d = line_side(&dst, n as u64)?;
    Ok(moves(vec![(s, d, Extent::line(n as u64))]))
}

// ---- 2D and 3D copies ---------------------------------------------------------------------------

fn split2d(c: &CUDA_MEMCPY2D) -> (Desc, Desc, Extent) {
    let src = Desc {
        memtype: c.srcMemoryType,
        host: c.srcHost as u64,
        device: c.srcDevice,
        array: c.srcArray,
        x: c.srcXInBytes as u64,
        y: c.srcY as u64,
        z: 0,
        pitch: c.srcPitch as u64,
        height: 0,
    };
    let dst = Desc {
        memtype: c.dstMemoryType,
        host: c.dstHost as u64,
        device: c.dstDevice,
        array: c.dstArray,
        x: c.dstXInBytes as u64,
        y: c.dstY as u64,
        z: 0,
        pitch: c.dstPitch as u64,
        height: 0,
    };
    let e = Extent {
        width: c.WidthInBytes as u64,
        height: c.Height as u64,
        depth: 1,
    };
    (src, dst, e)
}

fn copy2d(on: On, p: *const CUDA_MEMCPY2D) -> Res {
    copy2d_of(on, read(p)?)
}

fn copy2d_of(on: On, c: CUDA_MEMCPY2D) -> Res {
    if let Some(r) = captured(on, || {
        let (src, dst, e) = split2d(&c);
        Captured::Copy(as_3d(&src, &dst, e))
    }) {
        return r;
    }
    run(on, || {
        let (src, dst, e) = split2d(&c);
        plan(&src, &dst, e)
    })
}

/// The fields CUDA_MEMCPY3D and CUDA_MEMCPY3D_PEER share, and what differs (reserved pointers
/// or contexts).
struct Copy3D {
    src: Desc,
    dst: Desc,
    e: Extent,
    lods: (usize, usize),
}

fn split3d(c: &CUDA_MEMCPY3D) -> Copy3D {
    Copy3D {
        src: Desc {
            memtype: c.srcMemoryType,
            host: c.srcHost as u64,
            device: c.srcDevice,
            array: c.srcArray,
            x: c.srcXInBytes as u64,
            y: c.srcY as u64,
            z: c.srcZ as u64,
            pitch: c.srcPitch as u64,
            height: c.srcHeight as u64,
        },
        dst: Desc {
            memtype: c.dstMemoryType,
            host: c.dstHost as u64,
            device: c.dstDevice,
            array: c.dstArray,
            x: c.dstXInBytes as u64,
            y: c.dstY as u64,
            z: c.dstZ as u64,
            pitch: c.dstPitch as u64,
            height: c.dstHeight as u64,
        },
        e: Extent {
            width: c.WidthInBytes as u64,
            height: c.Height as u64,
            depth: c.Depth as u64,
        },
        lods: (c.srcLOD, c.dstLOD),
    }
}

fn copy3d(on: On, p: *const CUDA_MEMCPY3D) -> Res {
    copy3d_of(on, read(p)?)
}

fn copy3d_of(on: On, c: CUDA_MEMCPY3D) -> Res {
    if let Some(r) = captured(on, || Captured::Copy(c)) {
        return r;
    }
    run(on, || plan3d_struct(&c))
}

/// A `CUDA_MEMCPY3D` checked and done on stream `s`, whose turn it is: what a graph's memcpy
/// node, which holds one, does when it runs (timed as the stream's copies are).
pub(crate) fn copy3d_now(c: &CUDA_MEMCPY3D, s: &Stream) -> Res {
    run_on(s, plan3d_struct(c)?);
    Ok(())
}

fn plan3d_struct(c: &CUDA_MEMCPY3D) -> Result<Work, CUresult> {
    // "The srcLOD and dstLOD members of the CUDA_MEMCPY3D structure must be set to 0";
    // reserved0 and reserved1 "Must be NULL" (cuda.h 13.5).
    if c.srcLOD != 0 || c.dstLOD != 0 || !c.reserved0.is_null() || !c.reserved1.is_null() {
        return Err(err::INVALID_VALUE);
    }
    let k = split3d(c);
    plan(&k.src, &k.dst, k.e)
}

/// cuMemcpy3DPeer: a 3D copy whose non-array sides name their context ("srcContext - Source
/// context (ignored with srcMemoryType is CU_MEMORYTYPE_ARRAY)"): a context that is not one is
/// CUDA_ERROR_INVALID_CONTEXT, device memory of another device than its context's
/// CUDA_ERROR_INVALID_VALUE.
fn copy3d_peer(on: On, p: *const CUDA_MEMCPY3D_PEER) -> Res {
    let c: CUDA_MEMCPY3D_PEER = read(p)?;
    if let Some(r) = captured(on, || Captured::Unsupported) {
        return r;
    }
    match on {
        On::Sync => {
            // Serialized with all work of both contexts, as cuMemcpyPeer (see run_sync_after);
            // a side that names no context (an array's) adds nothing.
            let ctxs: Vec<_> = [c.srcContext, c.dstContext]
                .into_iter()
                .filter_map(|h| ctx::get(h).ok())
                .collect();
            let refs: Vec<&ctx::Context> = ctxs.iter().map(|x| &**x).collect();
            run_sync_after(&refs, || plan3d_peer(&c))
        }
        On::Stream(..) => run(on, || plan3d_peer(&c)),
    }
}

fn plan3d_peer(c: &CUDA_MEMCPY3D_PEER) -> Result<Work, CUresult> {
    let plain = CUDA_MEMCPY3D {
        srcXInBytes: c.srcXInBytes,
        srcY: c.srcY,
        srcZ: c.srcZ,
        srcLOD: c.srcLOD,
        srcMemoryType: c.srcMemoryType,
        srcHost: c.srcHost,
        srcDevice: c.srcDevice,
        srcArray: c.srcArray,
        reserved0: std::ptr::null_mut(),
        srcPitch: c.srcPitch,
        srcHeight: c.srcHeight,
        dstXInBytes: c.dstXInBytes,
        dstY: c.dstY,
        dstZ: c.dstZ,
        dstLOD: c.dstLOD,
        dstMemoryType: c.dstMemoryType,
        dstHost: c.dstHost,
        dstDevice: c.dstDevice,
        dstArray: c.dstArray,
        reserved1: std::ptr::null_mut(),
        dstPitch: c.dstPitch,
        dstHeight: c.dstHeight,
        WidthInBytes: c.WidthInBytes,
        Height: c.Height,
        Depth: c.Depth,
    };
    let k = split3d(&plain);
    if k.lods != (0, 0) {
        return Err(err::INVALID_VALUE);
    }
    let want = |memtype: c_uint, h: CUcontext| -> Result<Option<usize>, CUresult> {
        if memtype == CU_MEMORYTYPE_ARRAY {
            return Ok(None);
        }
        let c = ctx::get(h)?;
        Ok(Some(c.dev))
    };
    let sdev = want(c.srcMemoryType, c.srcContext)?;
    let ddev = want(c.dstMemoryType, c.dstContext)?;
    if k.e.empty() {
        return plan(&k.src, &k.dst, k.e);
    }
    let s = resolve(&k.src, k.e)?;
    let d = resolve(&k.dst, k.e)?;
    for (side, want) in [(&s, sdev), (&d, ddev)] {
        if let (Kind::Device(dev), Some(w)) = (side.kind, want) {
            if dev != w {
                return Err(err::INVALID_VALUE);
            }
        }
    }
    Ok(moves_between(
        vec![(s, d, k.e)],
        Some((c.srcContext as usize, c.dstContext as usize)),
    ))
}

/// cuMemcpyPeer: "Copies from device memory in one context to device memory in another
/// context": each pointer must be device memory of its context's device.
fn peer(
    on: On,
    dst: CUdeviceptr,
    dctx: CUcontext,
    src: CUdeviceptr,
    sctx: CUcontext,
    n: usize,
) -> Res {
    if let Some(r) = captured(on, || Captured::Unsupported) {
        return r;
    }
    let check = || {
        let (dc, sc) = (ctx::get(dctx)?, ctx::get(sctx)?);
        if n == 0 {
            return Ok(nothing());
        }
        let e = Extent::line(n as u64);
        let s = resolve(&dev(src), e)?;
        let d = resolve(&dev(dst), e)?;
        if s.kind != Kind::Device(sc.dev) || d.kind != Kind::Device(dc.dev) {
            return Err(err::INVALID_VALUE);
        }
        Ok(moves_between(
            vec![(s, d, e)],
            Some((sctx as usize, dctx as usize)),
        ))
    };
    match on {
        On::Sync => {
            let (dc, sc) = (ctx::get(dctx)?, ctx::get(sctx)?);
            run_sync_after(&[&sc, &dc], check)
        }
        On::Stream(..) => run(on, check),
    }
}

// ---- batches (CUDA 12.8) ------------------------------------------------------------------------

/// The stream of a batch (`stream::not_legacy`); a batch would be a node kind the graphs do not
/// model, so it is refused under capture.
fn batch_stream(s: CUstream, pt: bool) -> Res {
    stream::not_legacy(s, pt)?;
    match captured(On::Stream(s, pt), || Captured::Unsupported) {
        Some(Err(e)) => Err(e),
        _ => Ok(()),
    }
}

fn valid_order(o: c_int) -> bool {
    matches!(
        o,
        CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
            | CU_MEMCPY_SRC_ACCESS_ORDER_DURING_API_CALL
            | CU_MEMCPY_SRC_ACCESS_ORDER_ANY
    )
}

/// Reads `n` values of a C array (NULL with n > 0: INVALID_VALUE).
fn slice<'a, T>(p: *const T, n: usize) -> Result<&'a [T], CUresult> {
    if n == 0 {
        return Ok(&[]);
    }
    if p.is_null() {
        return Err(err::INVALID_VALUE);
    }
    // SAFETY: non-null and, by the API contract, `n` elements long for this call.
    Ok(unsafe { std::slice::from_raw_parts(p, n) })
}

/// Where a batch failed: the index of the copy at fault, or SIZE_MAX when the error is not one
/// copy's ("failIdx - Pointer to a location to return the index of the copy where a failure was
/// encountered. The value will be SIZE_MAX if the error doesn't pertain to any specific copy",
/// cuMemcpyBatchAsync, CUDA 12.8 reference).
fn report(fail: *mut usize, r: Result<(), (Option<usize>, CUresult)>) -> Res {
    match r {
        Ok(()) => Ok(()),
        Err((i, e)) => {
            if !fail.is_null() {
                let _ = write(fail, i.unwrap_or(usize::MAX));
            }
            Err(e)
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn batch(
    dsts: *const CUdeviceptr,
    srcs: *const CUdeviceptr,
    sizes: *const usize,
    count: usize,
    attrs: *const CUmemcpyAttributes,
    idxs: *const usize,
    nattrs: usize,
    s: CUstream,
    pt: bool,
) -> Result<(), (Option<usize>, CUresult)> {
    let whole = |e| (None, e);
    batch_stream(s, pt).map_err(whole)?;
    // "All three arrays must be of the same length as specified by count"; "the first entry in
    // attrsIdxs must always be 0. Also, each entry must be greater than the previous entry and
    // the last entry should be less than count. Furthermore, numAttrs must be lesser than or
    // equal to count"; each copy needs "a valid CUmemcpyAttributes ... including the
    // appropriate srcAccessOrder setting, otherwise the API will return
    // CUDA_ERROR_INVALID_VALUE" (cuMemcpyBatchAsync).
    if count == 0 || nattrs == 0 || nattrs > count {
        return Err(whole(err::INVALID_VALUE));
    }
    let (d, sr, sz) = (
        slice(dsts, count).map_err(whole)?,
        slice(srcs, count).map_err(whole)?,
        slice(sizes, count).map_err(whole)?,
    );
    let (at, ix) = (
        slice(attrs, nattrs).map_err(whole)?,
        slice(idxs, nattrs).map_err(whole)?,
    );
    if ix[0] != 0 || ix.windows(2).any(|w| w[1] <= w[0]) || ix[nattrs - 1] >= count {
        return Err(whole(err::INVALID_VALUE));
    }
    if let Some(k) = at.iter().position(|a| !valid_order(a.srcAccessOrder)) {
        return Err((Some(ix[k]), err::INVALID_VALUE));
    }
    // Checked all before any moves (a batch is one operation in its stream).
    let mut plan = Vec::with_capacity(count);
    for i in 0..count {
        let e = Extent::line(sz[i] as u64);
        if e.empty() {
            return Err((Some(i), err::INVALID_VALUE));
        }
        let src = resolve(&unified(sr[i]), e).map_err(|x| (Some(i), x))?;
        let dst = resolve(&unified(d[i]), e).map_err(|x| (Some(i), x))?;
        plan.push((src, dst, e));
    }
    ordered(s, pt, || Ok(moves(plan))).map_err(whole)
}

/// One operand of a 3D batch copy, as a [`Desc`]; `elem`: the element size of the copy
/// ("For pointer-to-pointer copies, the element size is considered to be 1. For pointer to CUDA
/// array or vice versa copies, the element size is determined by the CUDA array. For CUDA array
/// to CUDA array copies, the element size of the two CUDA arrays must match", cuMemcpy3DBatchAsync).
fn operand(o: &CUmemcpy3DOperand, e: &CUextent3D, elem: u64) -> Result<Desc, CUresult> {
    let bad = err::INVALID_VALUE;
    match o.type_ {
        CU_MEMCPY_OPERAND_TYPE_POINTER => {
            let (p, row, layer) = o.ptr();
            // "rowLength ... must either be zero or be greater than or equal to the width of the
            // copy"; likewise layerHeight and the height; zero: tightly packed.
            if (row != 0 && row < e.width as u64) || (layer != 0 && layer < e.height as u64) {
                return Err(bad);
            }
            let row = if row == 0 { e.width as u64 } else { row };
            let layer = if layer == 0 { e.height as u64 } else { layer };
            Ok(Desc {
                pitch: row.checked_mul(elem).ok_or(bad)?,
                height: layer,
                ..unified(p)
            })
        }
        CU_MEMCPY_OPERAND_TYPE_ARRAY => {
            let (a, off) = o.array();
            Ok(Desc {
                memtype: CU_MEMORYTYPE_ARRAY,
                host: 0,
                device: 0,
                array: a,
                x: (off.x as u64).checked_mul(elem).ok_or(bad)?,
                y: off.y as u64,
                z: off.z as u64,
                pitch: 0,
                height: 0,
            })
        }
        _ => Err(bad),
    }
}

fn elem_of(o: &CUmemcpy3DOperand) -> Result<Option<u64>, CUresult> {
    if o.type_ != CU_MEMCPY_OPERAND_TYPE_ARRAY {
        return Ok(None);
    }
    let a = array::get(o.array().0).map_err(|_| err::INVALID_VALUE)?;
    Ok(Some(a.geometry().elem))
}

/// One 3D batch operation checked: its two sides and extent in bytes.
fn plan3d(op: &CUDA_MEMCPY3D_BATCH_OP) -> Result<(Side, Side, Extent), CUresult> {
    let bad = err::INVALID_VALUE;
    let x = &op.extent;
    // "The width, height and depth components must not be 0"; "Each memcopy operation in
    // opList must have a valid srcAccessOrder setting" (CUDA_MEMCPY3D_BATCH_OP,
    // cuMemcpy3DBatchAsync).
    if x.width == 0 || x.height == 0 || x.depth == 0 || !valid_order(op.srcAccessOrder) {
        return Err(bad);
    }
    let elem = match (elem_of(&op.src)?, elem_of(&op.dst)?) {
        (Some(a), Some(b)) if a != b => return Err(bad),
        (Some(a), _) | (None, Some(a)) => a,
        (None, None) => 1,
    };
    let e = Extent {
        width: (x.width as u64).checked_mul(elem).ok_or(bad)?,
        height: x.height as u64,
        depth: x.depth as u64,
    };
    let src = resolve(&operand(&op.src, x, elem)?, e)?;
    let dst = resolve(&operand(&op.dst, x, elem)?, e)?;
    Ok((src, dst, e))
}

fn batch3d(
    n: usize,
    ops: *const CUDA_MEMCPY3D_BATCH_OP,
    flags: u64,
    s: CUstream,
    pt: bool,
) -> Result<(), (Option<usize>, CUresult)> {
    let whole = |e| (None, e);
    batch_stream(s, pt).map_err(whole)?;
    // "flags - Flags for future use, must be zero now."
    if flags != 0 || n == 0 {
        return Err(whole(err::INVALID_VALUE));
    }
    let ops = slice(ops, n).map_err(whole)?;
    let mut plan = Vec::with_capacity(n);
    for (i, op) in ops.iter().enumerate() {
        plan.push(plan3d(op).map_err(|e| (Some(i), e))?);
    }
    ordered(s, pt, || Ok(moves(plan))).map_err(whole)
}

// ---- memsets ------------------------------------------------------------------------------------

/// Fills `height` rows of `width` elements of `elem` bytes, `pitch` bytes apart, with `value`.
/// "dstPitch - Pitch of destination device pointer(Unused if Height is 1)" (cuMemsetD2D8); the
/// pointer must be aligned to the element ("The dstDevice pointer and dstPitch offset must be
/// two byte aligned", cuMemsetD2D16; four for D2D32), and the rows device memory.
fn memset2d(
    on: On,
    dst: u64,
    pitch: usize,
    value: u32,
    elem: u64,
    width: usize,
    height: usize,
) -> Res {
    if let Some(r) = captured(on, || {
        Captured::Set(MemsetParams {
            dst,
            pitch: if height > 1 { pitch } else { 0 },
            value,
            elem: elem as c_uint,
            width,
            height,
        })
    }) {
        return r;
    }
    run(on, || fill(dst, pitch, value, elem, width, height))
}

/// A 2D memset checked and done on stream `s`, whose turn it is (see [`memset2d`]): what a
/// graph's memset node, which holds these parameters, does when it runs.
pub(crate) fn fill_now(
    s: &Stream,
    dst: u64,
    pitch: usize,
    value: u32,
    elem: u64,
    width: usize,
    height: usize,
) -> Res {
    run_on(s, fill(dst, pitch, value, elem, width, height)?);
    Ok(())
}

/// Checks a 2D memset: the bytes it writes, once run.
fn fill(
    dst: u64,
    pitch: usize,
    value: u32,
    elem: u64,
    width: usize,
    height: usize,
) -> Result<Work, CUresult> {
    let bad = err::INVALID_VALUE;
    // Elements of 1, 2 or 4 bytes (cuMemsetD2D8/16/32; CUDA_MEMSET_NODE_PARAMS: "Size of each
    // element in bytes. Must be 1, 2, or 4.").
    if !matches!(elem, 1 | 2 | 4) {
        return Err(bad);
    }
    let row = (width as u64).checked_mul(elem).ok_or(bad)?;
    let h = height as u64;
    let pitch = if h > 1 { pitch as u64 } else { row };
    if !dst.is_multiple_of(elem)
        || (h > 1 && (pitch < row || !pitch.is_multiple_of(elem)))
        || pitch > MAX_PITCH
    {
        return Err(bad);
    }
    let len = if row == 0 || h == 0 {
        0 // still a pointer into device memory
    } else {
        (h - 1)
            .checked_mul(pitch)
            .and_then(|x| x.checked_add(row))
            .ok_or(bad)?
    };
    let dev = mem::device_range(dst, len, true)?;
    let job: Job = Box::new(move || {
        let bytes = value.to_le_bytes();
        let pattern = &bytes[..elem as usize];
        for y in 0..if len == 0 { 0 } else { h } {
            // SAFETY: the row lies in [dst, dst + len), checked to be one live allocation when
            // the memset was issued (freeing it before the stream gets here is the program's
            // error, as on the real driver; the simulator's arenas stay mapped).
            let buf = unsafe {
                std::slice::from_raw_parts_mut((dst + y * pitch) as *mut u8, row as usize)
            };
            for chunk in buf.chunks_exact_mut(elem as usize) {
                chunk.copy_from_slice(pattern);
            }
        }
    });
    Ok(Work {
        job,
        cost: Cost::Memset {
            dev,
            bytes: if len == 0 { 0 } else { row * h },
        },
    })
}

fn memset(on: On, dst: u64, value: u32, elem: u64, count: usize) -> Res {
    memset2d(on, dst, 0, value, elem, count, 1)
}

const S: On = On::Sync;
fn st(s: CUstream) -> On {
    On::Stream(s, false)
}
fn pt(s: CUstream) -> On {
    On::Stream(s, true)
}

export! {
    fn cuMemcpyHtoD_v2(dst: CUdeviceptr, src: *const c_void, n: usize) { linear(S, dev(dst), host_src(src), n) }
    fn cuMemcpyHtoD_v2_ptds(dst: CUdeviceptr, src: *const c_void, n: usize) { linear(S, dev(dst), host_src(src), n) }
    fn cuMemcpyHtoD(dst: c_uint, src: *const c_void, n: c_uint) { linear(S, dev(dst as u64), host_src(src), n as usize) }
    fn cuMemcpyDtoH_v2(dst: *mut c_void, src: CUdeviceptr, n: usize) { linear(S, host_dst(dst), dev(src), n) }
    fn cuMemcpyDtoH_v2_ptds(dst: *mut c_void, src: CUdeviceptr, n: usize) { linear(S, host_dst(dst), dev(src), n) }
    fn cuMemcpyDtoH(dst: *mut c_void, src: c_uint, n: c_uint) { linear(S, host_dst(dst), dev(src as u64), n as usize) }
    fn cuMemcpyDtoD_v2(dst: CUdeviceptr, src: CUdeviceptr, n: usize) { linear(S, dev(dst), dev(src), n) }
    fn cuMemcpyDtoD_v2_ptds(dst: CUdeviceptr, src: CUdeviceptr, n: usize) { linear(S, dev(dst), dev(src), n) }
    fn cuMemcpy(dst: CUdeviceptr, src: CUdeviceptr, n: usize) { linear(S, unified(dst), unified(src), n) }
    fn cuMemcpy_ptds(dst: CUdeviceptr, src: CUdeviceptr, n: usize) { linear(S, unified(dst), unified(src), n) }

    fn cuMemcpyHtoDAsync_v2(dst: CUdeviceptr, src: *const c_void, n: usize, s: CUstream) { linear(st(s), dev(dst), host_src(src), n) }
    fn cuMemcpyHtoDAsync_v2_ptsz(dst: CUdeviceptr, src: *const c_void, n: usize, s: CUstream) { linear(pt(s), dev(dst), host_src(src), n) }
    fn cuMemcpyDtoHAsync_v2(dst: *mut c_void, src: CUdeviceptr, n: usize, s: CUstream) { linear(st(s), host_dst(dst), dev(src), n) }
    fn cuMemcpyDtoHAsync_v2_ptsz(dst: *mut c_void, src: CUdeviceptr, n: usize, s: CUstream) { linear(pt(s), host_dst(dst), dev(src), n) }
    fn cuMemcpyDtoDAsync_v2(dst: CUdeviceptr, src: CUdeviceptr, n: usize, s: CUstream) { linear(st(s), dev(dst), dev(src), n) }
    fn cuMemcpyDtoDAsync_v2_ptsz(dst: CUdeviceptr, src: CUdeviceptr, n: usize, s: CUstream) { linear(pt(s), dev(dst), dev(src), n) }
    fn cuMemcpyAsync(dst: CUdeviceptr, src: CUdeviceptr, n: usize, s: CUstream) { linear(st(s), unified(dst), unified(src), n) }
    fn cuMemcpyAsync_ptsz(dst: CUdeviceptr, src: CUdeviceptr, n: usize, s: CUstream) { linear(pt(s), unified(dst), unified(src), n) }

    fn cuMemcpyHtoA_v2(dst: CUarray, off: usize, src: *const c_void, n: usize) { array_copy(S, array_line(dst, off, n), Ok(host_src(src)), n) }
    fn cuMemcpyHtoA_v2_ptds(dst: CUarray, off: usize, src: *const c_void, n: usize) { array_copy(S, array_line(dst, off, n), Ok(host_src(src)), n) }
    fn cuMemcpyAtoH_v2(dst: *mut c_void, src: CUarray, off: usize, n: usize) { array_copy(S, Ok(host_dst(dst)), array_line(src, off, n), n) }
    fn cuMemcpyAtoH_v2_ptds(dst: *mut c_void, src: CUarray, off: usize, n: usize) { array_copy(S, Ok(host_dst(dst)), array_line(src, off, n), n) }
    fn cuMemcpyAtoD_v2(dst: CUdeviceptr, src: CUarray, off: usize, n: usize) { array_copy(S, Ok(dev(dst)), array_line(src, off, n), n) }
    fn cuMemcpyAtoD_v2_ptds(dst: CUdeviceptr, src: CUarray, off: usize, n: usize) { array_copy(S, Ok(dev(dst)), array_line(src, off, n), n) }
    fn cuMemcpyDtoA_v2(dst: CUarray, off: usize, src: CUdeviceptr, n: usize) { array_copy(S, array_line(dst, off, n), Ok(dev(src)), n) }
    fn cuMemcpyDtoA_v2_ptds(dst: CUarray, off: usize, src: CUdeviceptr, n: usize) { array_copy(S, array_line(dst, off, n), Ok(dev(src)), n) }
    fn cuMemcpyAtoA_v2(dst: CUarray, doff: usize, src: CUarray, soff: usize, n: usize) { array_copy(S, array_line(dst, doff, n), array_line(src, soff, n), n) }
    fn cuMemcpyAtoA_v2_ptds(dst: CUarray, doff: usize, src: CUarray, soff: usize, n: usize) { array_copy(S, array_line(dst, doff, n), array_line(src, soff, n), n) }
    fn cuMemcpyHtoAAsync_v2(dst: CUarray, off: usize, src: *const c_void, n: usize, s: CUstream) { array_copy(st(s), array_line(dst, off, n), Ok(host_src(src)), n) }
    fn cuMemcpyHtoAAsync_v2_ptsz(dst: CUarray, off: usize, src: *const c_void, n: usize, s: CUstream) { array_copy(pt(s), array_line(dst, off, n), Ok(host_src(src)), n) }
    fn cuMemcpyAtoHAsync_v2(dst: *mut c_void, src: CUarray, off: usize, n: usize, s: CUstream) { array_copy(st(s), Ok(host_dst(dst)), array_line(src, off, n), n) }
    fn cuMemcpyAtoHAsync_v2_ptsz(dst: *mut c_void, src: CUarray, off: usize, n: usize, s: CUstream) { array_copy(pt(s), Ok(host_dst(dst)), array_line(src, off, n), n) }

    fn cuMemcpy2D_v2(p: *const CUDA_MEMCPY2D) { copy2d(S, p) }
    fn cuMemcpy2D_v2_ptds(p: *const CUDA_MEMCPY2D) { copy2d(S, p) }
    /// cuMemcpy2DUnaligned "does not have this restriction" (pitches not from cuMemAllocPitch
    /// on intra-device copies), which the simulator does not impose on cuMemcpy2D either.
    fn cuMemcpy2DUnaligned_v2(p: *const CUDA_MEMCPY2D) { copy2d(S, p) }
    fn cuMemcpy2DUnaligned_v2_ptds(p: *const CUDA_MEMCPY2D) { copy2d(S, p) }
    fn cuMemcpy2DAsync_v2(p: *const CUDA_MEMCPY2D, s: CUstream) { copy2d(st(s), p) }
    fn cuMemcpy2DAsync_v2_ptsz(p: *const CUDA_MEMCPY2D, s: CUstream) { copy2d(pt(s), p) }
    fn cuMemcpy3D_v2(p: *const CUDA_MEMCPY3D) { copy3d(S, p) }
    fn cuMemcpy3D_v2_ptds(p: *const CUDA_MEMCPY3D) { copy3d(S, p) }
    fn cuMemcpy3DAsync_v2(p: *const CUDA_MEMCPY3D, s: CUstream) { copy3d(st(s), p) }
    fn cuMemcpy3DAsync_v2_ptsz(p: *const CUDA_MEMCPY3D, s: CUstream) { copy3d(pt(s), p) }
    fn cuMemcpy3DPeer(p: *const CUDA_MEMCPY3D_PEER) { copy3d_peer(S, p) }
    fn cuMemcpy3DPeer_ptds(p: *const CUDA_MEMCPY3D_PEER) { copy3d_peer(S, p) }
    fn cuMemcpy3DPeerAsync(p: *const CUDA_MEMCPY3D_PEER, s: CUstream) { copy3d_peer(st(s), p) }
    fn cuMemcpy3DPeerAsync_ptsz(p: *const CUDA_MEMCPY3D_PEER, s: CUstream) { copy3d_peer(pt(s), p) }

    fn cuMemcpyPeer(dst: CUdeviceptr, dctx: CUcontext, src: CUdeviceptr, sctx: CUcontext, n: usize) { peer(S, dst, dctx, src, sctx, n) }
    fn cuMemcpyPeer_ptds(dst: CUdeviceptr, dctx: CUcontext, src: CUdeviceptr, sctx: CUcontext, n: usize) { peer(S, dst, dctx, src, sctx, n) }
    fn cuMemcpyPeerAsync(dst: CUdeviceptr, dctx: CUcontext, src: CUdeviceptr, sctx: CUcontext, n: usize, s: CUstream) { peer(st(s), dst, dctx, src, sctx, n) }
    fn cuMemcpyPeerAsync_ptsz(dst: CUdeviceptr, dctx: CUcontext, src: CUdeviceptr, sctx: CUcontext, n: usize, s: CUstream) { peer(pt(s), dst, dctx, src, sctx, n) }

    /// CUDA 12.8's signature (with `failIdx`); CUDA 13.0's `_v2` drops it.
    fn cuMemcpyBatchAsync(dsts: *const CUdeviceptr, srcs: *const CUdeviceptr, sizes: *const usize, count: usize, attrs: *const CUmemcpyAttributes, idxs: *const usize, nattrs: usize, fail: *mut usize, s: CUstream) {
        report(fail, batch(dsts, srcs, sizes, count, attrs, idxs, nattrs, s, false))
    }
    fn cuMemcpyBatchAsync_ptsz(dsts: *const CUdeviceptr, srcs: *const CUdeviceptr, sizes: *const usize, count: usize, attrs: *const CUmemcpyAttributes, idxs: *const usize, nattrs: usize, fail: *mut usize, s: CUstream) {
        report(fail, batch(dsts, srcs, sizes, count, attrs, idxs, nattrs, s, true))
    }
    fn cuMemcpyBatchAsync_v2(dsts: *const CUdeviceptr, srcs: *const CUdeviceptr, sizes: *const usize, count: usize, attrs: *const CUmemcpyAttributes, idxs: *const usize, nattrs: usize, s: CUstream) {
        report(std::ptr::null_mut(), batch(dsts, srcs, sizes, count, attrs, idxs, nattrs, s, false))
    }
    fn cuMemcpyBatchAsync_v2_ptsz(dsts: *const CUdeviceptr, srcs: *const CUdeviceptr, sizes: *const usize, count: usize, attrs: *const CUmemcpyAttributes, idxs: *const usize, nattrs: usize, s: CUstream) {
        report(std::ptr::null_mut(), batch(dsts, srcs, sizes, count, attrs, idxs, nattrs, s, true))
    }
    fn cuMemcpy3DBatchAsync(n: usize, ops: *const CUDA_MEMCPY3D_BATCH_OP, fail: *mut usize, flags: u64, s: CUstream) { report(fail, batch3d(n, ops, flags, s, false)) }
    fn cuMemcpy3DBatchAsync_ptsz(n: usize, ops: *const CUDA_MEMCPY3D_BATCH_OP, fail: *mut usize, flags: u64, s: CUstream) { report(fail, batch3d(n, ops, flags, s, true)) }
    fn cuMemcpy3DBatchAsync_v2(n: usize, ops: *const CUDA_MEMCPY3D_BATCH_OP, flags: u64, s: CUstream) { report(std::ptr::null_mut(), batch3d(n, ops, flags, s, false)) }
    fn cuMemcpy3DBatchAsync_v2_ptsz(n: usize, ops: *const CUDA_MEMCPY3D_BATCH_OP, flags: u64, s: CUstream) { report(std::ptr::null_mut(), batch3d(n, ops, flags, s, true)) }
    /// CUDA 13.2: one copy of a batch ("refer to CUmemcpyAttributes and it's usage desciption in
    /// cuMemcpyBatchAsync").
    fn cuMemcpyWithAttributesAsync(dst: CUdeviceptr, src: CUdeviceptr, n: usize, attr: *const CUmemcpyAttributes, s: CUstream) {
        let zero = 0usize;
        report(std::ptr::null_mut(), batch(&dst, &src, &n, 1, attr, &zero, 1, s, false))
    }
    fn cuMemcpyWithAttributesAsync_ptsz(dst: CUdeviceptr, src: CUdeviceptr, n: usize, attr: *const CUmemcpyAttributes, s: CUstream) {
        let zero = 0usize;
        report(std::ptr::null_mut(), batch(&dst, &src, &n, 1, attr, &zero, 1, s, true))
    }
    fn cuMemcpy3DWithAttributesAsync(op: *const CUDA_MEMCPY3D_BATCH_OP, flags: u64, s: CUstream) { report(std::ptr::null_mut(), batch3d(1, op, flags, s, false)) }
    fn cuMemcpy3DWithAttributesAsync_ptsz(op: *const CUDA_MEMCPY3D_BATCH_OP, flags: u64, s: CUstream) { report(std::ptr::null_mut(), batch3d(1, op, flags, s, true)) }

    fn cuMemsetD8_v2(dst: CUdeviceptr, v: u8, n: usize) { memset(S, dst, v as u32, 1, n) }
    fn cuMemsetD8_v2_ptds(dst: CUdeviceptr, v: u8, n: usize) { memset(S, dst, v as u32, 1, n) }
    fn cuMemsetD16_v2(dst: CUdeviceptr, v: u16, n: usize) { memset(S, dst, v as u32, 2, n) }
    fn cuMemsetD16_v2_ptds(dst: CUdeviceptr, v: u16, n: usize) { memset(S, dst, v as u32, 2, n) }
    fn cuMemsetD32_v2(dst: CUdeviceptr, v: u32, n: usize) { memset(S, dst, v, 4, n) }
    fn cuMemsetD32_v2_ptds(dst: CUdeviceptr, v: u32, n: usize) { memset(S, dst, v, 4, n) }
    fn cuMemsetD8Async(dst: CUdeviceptr, v: u8, n: usize, s: CUstream) { memset(st(s), dst, v as u32, 1, n) }
    fn cuMemsetD8Async_ptsz(dst: CUdeviceptr, v: u8, n: usize, s: CUstream) { memset(pt(s), dst, v as u32, 1, n) }
    fn cuMemsetD16Async(dst: CUdeviceptr, v: u16, n: usize, s: CUstream) { memset(st(s), dst, v as u32, 2, n) }
    fn cuMemsetD16Async_ptsz(dst: CUdeviceptr, v: u16, n: usize, s: CUstream) { memset(pt(s), dst, v as u32, 2, n) }
    fn cuMemsetD32Async(dst: CUdeviceptr, v: u32, n: usize, s: CUstream) { memset(st(s), dst, v, 4, n) }
    fn cuMemsetD32Async_ptsz(dst: CUdeviceptr, v: u32, n: usize, s: CUstream) { memset(pt(s), dst, v, 4, n) }

    fn cuMemsetD2D8_v2(dst: CUdeviceptr, pitch: usize, v: u8, w: usize, h: usize) { memset2d(S, dst, pitch, v as u32, 1, w, h) }
    fn cuMemsetD2D8_v2_ptds(dst: CUdeviceptr, pitch: usize, v: u8, w: usize, h: usize) { memset2d(S, dst, pitch, v as u32, 1, w, h) }
    fn cuMemsetD2D16_v2(dst: CUdeviceptr, pitch: usize, v: u16, w: usize, h: usize) { memset2d(S, dst, pitch, v as u32, 2, w, h) }
    fn cuMemsetD2D16_v2_ptds(dst: CUdeviceptr, pitch: usize, v: u16, w: usize, h: usize) { memset2d(S, dst, pitch, v as u32, 2, w, h) }
    fn cuMemsetD2D32_v2(dst: CUdeviceptr, pitch: usize, v: u32, w: usize, h: usize) { memset2d(S, dst, pitch, v, 4, w, h) }
    fn cuMemsetD2D32_v2_ptds(dst: CUdeviceptr, pitch: usize, v: u32, w: usize, h: usize) { memset2d(S, dst, pitch, v, 4, w, h) }
    fn cuMemsetD2D8Async(dst: CUdeviceptr, pitch: usize, v: u8, w: usize, h: usize, s: CUstream) { memset2d(st(s), dst, pitch, v as u32, 1, w, h) }
    fn cuMemsetD2D8Async_ptsz(dst: CUdeviceptr, pitch: usize, v: u8, w: usize, h: usize, s: CUstream) { memset2d(pt(s), dst, pitch, v as u32, 1, w, h) }
    fn cuMemsetD2D16Async(dst: CUdeviceptr, pitch: usize, v: u16, w: usize, h: usize, s: CUstream) { memset2d(st(s), dst, pitch, v as u32, 2, w, h) }
    fn cuMemsetD2D16Async_ptsz(dst: CUdeviceptr, pitch: usize, v: u16, w: usize, h: usize, s: CUstream) { memset2d(pt(s), dst, pitch, v as u32, 2, w, h) }
    fn cuMemsetD2D32Async(dst: CUdeviceptr, pitch: usize, v: u32, w: usize, h: usize, s: CUstream) { memset2d(st(s), dst, pitch, v, 4, w, h) }
    fn cuMemsetD2D32Async_ptsz(dst: CUdeviceptr, pitch: usize, v: u32, w: usize, h: usize, s: CUstream) { memset2d(pt(s), dst, pitch, v, 4, w, h) }

    // The CUDA 2.x ABI (32-bit device pointers, offsets and sizes; cuGetProcAddress hands these
    // out below version 3020): the same copies, widened.
    fn cuMemcpyDtoD(dst: c_uint, src: c_uint, n: c_uint) { linear(S, dev(dst as u64), dev(src as u64), n as usize) }
    fn cuMemcpyHtoDAsync(dst: c_uint, src: *const c_void, n: c_uint, s: CUstream) { linear(st(s), dev(dst as u64), host_src(src), n as usize) }
    fn cuMemcpyDtoHAsync(dst: *mut c_void, src: c_uint, n: c_uint, s: CUstream) { linear(st(s), host_dst(dst), dev(src as u64), n as usize) }
    fn cuMemcpyDtoDAsync(dst: c_uint, src: c_uint, n: c_uint, s: CUstream) { linear(st(s), dev(dst as u64), dev(src as u64), n as usize) }
    fn cuMemcpyHtoA(dst: CUarray, off: c_uint, src: *const c_void, n: c_uint) { array_copy(S, array_line(dst, off as usize, n as usize), Ok(host_src(src)), n as usize) }
    fn cuMemcpyAtoH(dst: *mut c_void, src: CUarray, off: c_uint, n: c_uint) { array_copy(S, Ok(host_dst(dst)), array_line(src, off as usize, n as usize), n as usize) }
    fn cuMemcpyAtoD(dst: c_uint, src: CUarray, off: c_uint, n: c_uint) { array_copy(S, Ok(dev(dst as u64)), array_line(src, off as usize, n as usize), n as usize) }
    fn cuMemcpyDtoA(dst: CUarray, off: c_uint, src: c_uint, n: c_uint) { array_copy(S, array_line(dst, off as usize, n as usize), Ok(dev(src as u64)), n as usize) }
    fn cuMemcpyAtoA(dst: CUarray, doff: c_uint, src: CUarray, soff: c_uint, n: c_uint) { array_copy(S, array_line(dst, doff as usize, n as usize), array_line(src, soff as usize, n as usize), n as usize) }
    fn cuMemcpyHtoAAsync(dst: CUarray, off: c_uint, src: *const c_void, n: c_uint, s: CUstream) { array_copy(st(s), array_line(dst, off as usize, n as usize), Ok(host_src(src)), n as usize) }
    fn cuMemcpyAtoHAsync(dst: *mut c_void, src: CUarray, off: c_uint, n: c_uint, s: CUstream) { array_copy(st(s), Ok(host_dst(dst)), array_line(src, off as usize, n as usize), n as usize) }
    fn cuMemcpy2D(p: *const CUDA_MEMCPY2D_v1) { copy2d_of(S, read(p)?.into()) }
    fn cuMemcpy2DUnaligned(p: *const CUDA_MEMCPY2D_v1) { copy2d_of(S, read(p)?.into()) }
    fn cuMemcpy2DAsync(p: *const CUDA_MEMCPY2D_v1, s: CUstream) { copy2d_of(st(s), read(p)?.into()) }
    fn cuMemcpy3D(p: *const CUDA_MEMCPY3D_v1) { copy3d_of(S, read(p)?.into()) }
    fn cuMemcpy3DAsync(p: *const CUDA_MEMCPY3D_v1, s: CUstream) { copy3d_of(st(s), read(p)?.into()) }
    fn cuMemsetD8(dst: c_uint, v: u8, n: c_uint) { memset(S, dst as u64, v as u32, 1, n as usize) }
    fn cuMemsetD16(dst: c_uint, v: u16, n: c_uint) { memset(S, dst as u64, v as u32, 2, n as usize) }
    fn cuMemsetD32(dst: c_uint, v: u32, n: c_uint) { memset(S, dst as u64, v, 4, n as usize) }
    fn cuMemsetD2D8(dst: c_uint, pitch: c_uint, v: u8, w: c_uint, h: c_uint) { memset2d(S, dst as u64, pitch as usize, v as u32, 1, w as usize, h as usize) }
    fn cuMemsetD2D16(dst: c_uint, pitch: c_uint, v: u16, w: c_uint, h: c_uint) { memset2d(S, dst as u64, pitch as usize, v as u32, 2, w as usize, h as usize) }
    fn cuMemsetD2D32(dst: c_uint, pitch: c_uint, v: u32, w: c_uint, h: c_uint) { memset2d(S, dst as u64, pitch as usize, v, 4, w as usize, h as usize) }
}
