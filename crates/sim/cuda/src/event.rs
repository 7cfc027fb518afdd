//! Events: the event objects (creation, destruction, timing) and events shared between
//! processes (IPC event handles); the registry graphs and executable graphs look events up in.
//! Records in stream order, queries, synchronization and waits of one stream on another, where
//! stream capture takes part, are `event_order`.
//!
//! An event is the time at which the work its last record captured ends (CLOCK_MONOTONIC ns):
//! 0 before any record, [`EVENT_PENDING`] while that work sits behind host work whose end is not
//! known yet (see `stream`). An exported or opened IPC event keeps that time in the state shared
//! between processes (`cuvisor_sim::state::SharedEvent`), so a record in one process is what
//! the others query, synchronize on and wait for: CLOCK_MONOTONIC is one clock for the machine.

use crate::stream::wait_for;
use crate::{ctx, drv, export, write, Registry, Res};
use cuvisor_cuda_abi::cuda::*;
use cuvisor_sim::state::{now_ns, EVENT_PENDING};
use std::ffi::c_uint;
use std::sync::atomic::{AtomicU64, Ordering::*};
use std::sync::{Arc, OnceLock};

/// `CUevent_flags` (cuda.h): DEFAULT 0, BLOCKING_SYNC 1, DISABLE_TIMING 2, INTERPROCESS 4; no
/// other bit is defined.
const CU_EVENT_INTERPROCESS: u32 = 0x4;
const EVENT_FLAGS: u32 = 0x1 | CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS;

pub(crate) struct Event {
    flags: u32,
    /// The context the event was created in (cuEventRecord: "hEvent and hStream must be from
    /// the same context otherwise CUDA_ERROR_INVALID_HANDLE is returned", cuda.h).
    pub(crate) ctx: usize,
    time: AtomicU64,
    /// The shared entry (index, generation) of an exported or opened IPC event, and whether
    /// this process exported it (the exporter's cuEventDestroy frees the entry).
    ipc: OnceLock<(usize, u64, bool)>,
}

impl Event {
    fn cell(&self) -> &AtomicU64 {
        if let Some(&(i, generation, _)) = self.ipc.get() {
            if let Ok(d) = drv() {
                if let Some(e) = d.sim.shared.event(i, generation) {
                    return &e.time;
                }
            }
            // The exporter destroyed it: "Performing operations on the imported event after
            // the exported event has been freed with cuEventDestroy will result in undefined
            // behavior" (cuIpcOpenEventHandle, cuda.h); here it goes on as a local event.
        }
        &self.time
    }
    pub(crate) fn time(&self) -> u64 {
        self.cell().load(Acquire)
    }
    pub(crate) fn set(&self, t: u64) {
        self.cell().store(t, Release)
    }
    fn timing(&self) -> bool {
        self.flags & CU_EVENT_DISABLE_TIMING == 0
    }
}

fn events() -> &'static Registry<Event> {
    static R: OnceLock<Registry<Event>> = OnceLock::new();
    R.get_or_init(Registry::new)
}

/// The event behind a handle, after the driver is initialised.
/// For graph event nodes: the event `ev` exists (CUDA_ERROR_INVALID_HANDLE otherwise).
pub(crate) fn event_exists(ev: usize) -> Res {
    event(ev as CUevent).map(|_| ())
}

/// For graph event-wait nodes: when the work `ev` captured ends (waiting for a record still
/// queued behind host work to get its time).
pub(crate) fn event_time(ev: usize) -> Result<u64, CUresult> {
    let e = event(ev as CUevent)?;
    wait_for(|| e.time() != EVENT_PENDING);
    Ok(e.time())
}

/// For graph event-record nodes: the event now stands for work ending at `t`.
pub(crate) fn event_record_at(ev: usize, t: u64) -> Res {
    event(ev as CUevent)?.set(t);
    Ok(())
}

pub(crate) fn event(h: CUevent) -> Result<Arc<Event>, CUresult> {
    drv()?;
    events().get(h as usize)
}

/// cuEventCreate: `flags` from `CUevent_flags`, else CUDA_ERROR_INVALID_VALUE;
/// "CU_EVENT_INTERPROCESS must be specified along with CU_EVENT_DISABLE_TIMING" (cuda.h), else
/// CUDA_ERROR_INVALID_VALUE.
fn create(out: *mut CUevent, flags: c_uint) -> Res {
    let (ch, _) = ctx::current()?;
    if flags & !EVENT_FLAGS != 0 || out.is_null() {
        return Err(err::INVALID_VALUE);
    }
    if flags & CU_EVENT_INTERPROCESS != 0 && flags & CU_EVENT_DISABLE_TIMING == 0 {
        return Err(err::INVALID_VALUE);
    }
    let (h, _) = events().insert(Event {
        flags,
        ctx: ch,
        time: AtomicU64::new(0),
        ipc: OnceLock::new(),
    });
    write(out, h as CUevent)
}

/// cuEventElapsedTime (cuda.h): "If cuEventRecord() has not been called on either event then
/// CUDA_ERROR_INVALID_HANDLE is returned. If cuEventRecord() has been called on both events
/// but one or both of them has not yet been completed ..., CUDA_ERROR_NOT_READY is returned.
/// If either event was created with the CU_EVENT_DISABLE_TIMING flag, then this function will
/// return CUDA_ERROR_INVALID_HANDLE."
fn elapsed(ms: *mut f32, start: CUevent, end: CUevent) -> Res {
    let a = event(start)?;
    let b = event(end)?;
    if ms.is_null() {
        return Err(err::INVALID_VALUE);
    }
    if !a.timing() || !b.timing() {
        return Err(err::INVALID_HANDLE);
    }
    let (ta, tb) = (a.time(), b.time());
    if ta == 0 || tb == 0 {
        return Err(err::INVALID_HANDLE);
    }
    let now = now_ns();
    if ta == EVENT_PENDING || tb == EVENT_PENDING || now < ta || now < tb {
        return Err(err::NOT_READY);
    }
    write(ms, (tb as f64 - ta as f64) as f32 / 1e6)
}

fn destroy(ev: CUevent) -> Res {
    drv()?;
    let e = events().remove(ev as usize)?;
    if let Some(&(i, generation, true)) = e.ipc.get() {
        drv()?.sim.shared.event_close(i, generation);
    }
    Ok(())
}

// ---- IPC ----------------------------------------------------------------------------------------

/// First word of a simulated `CUipcEventHandle` ("CUVSEVT1").
const IPC_EVENT_MAGIC: u64 = 0x3154_5645_5356_5543;

/// `CUipcEventHandle`: 64 opaque bytes (`CU_IPC_HANDLE_SIZE`), passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct IpcEventHandle {
    reserved: [u8; 64],
}

fn word(h: &IpcEventHandle, i: usize) -> u64 {
    u64::from_le_bytes(h.reserved[i * 8..i * 8 + 8].try_into().unwrap_or_default())
}

/// cuIpcGetEventHandle: the event "must have been created with the CU_EVENT_INTERPROCESS and
/// CU_EVENT_DISABLE_TIMING flags set" (cuda.h, which lists CUDA_ERROR_INVALID_HANDLE and
/// CUDA_ERROR_INVALID_VALUE without saying which answers what). An event without the flag is
/// CUDA_ERROR_INVALID_HANDLE ("invalid resource handle") here, as HIP's conformance test expects
/// of both HIP and CUDA (ROCm/hip#2882, "Event created with no flags"). The event moves into
/// the shared state at its first export, with the time it already has; later exports hand out
/// the same handle. The handle: magic, process token, entry, generation, device.
fn ipc_get(out: *mut IpcEventHandle, ev: CUevent) -> Res {
    let e = event(ev)?;
    if out.is_null() {
        return Err(err::INVALID_VALUE);
    }
    if e.flags & CU_EVENT_INTERPROCESS == 0 {
        return Err(err::INVALID_HANDLE);
    }
    let d = drv()?;
    let (i, generation, _) = match e.ipc.get() {
        Some(x) => *x,
        None => {
            let (i, generation) = d.sim.shared.event_open(d.slot).ok_or(err::OUT_OF_MEMORY)?;
            let t = e.time.load(Acquire);
            if let Some(s) = d.sim.shared.event(i, generation) {
                s.time.store(t, Release);
            }
            if e.ipc.set((i, generation, true)).is_err() {
                // Another thread exported it first: give this entry back, use that one.
                d.sim.shared.event_close(i, generation);
            }
            *e.ipc.get().ok_or(err::UNKNOWN)?
        }
    };
    let dev = ctx::current().map(|(_, c)| c.dev).unwrap_or(0) as u64;
    let mut h = IpcEventHandle { reserved: [0; 64] };
    let words = [
        IPC_EVENT_MAGIC,
        crate::ipc::process_token(),
        i as u64,
        generation,
        dev,
    ];
    for (k, v) in words.iter().enumerate() {
        h.reserved[k * 8..k * 8 + 8].copy_from_slice(&v.to_le_bytes());
    }
    write(out, h)
}

/// cuIpcOpenEventHandle: "returns a CUevent that behaves like a locally created event with the
/// CU_EVENT_DISABLE_TIMING flag specified" (cuda.h). A handle that is not one, or names an
/// entry that is gone, is CUDA_ERROR_INVALID_VALUE; opening a handle in the process that made it
/// is CUDA_ERROR_INVALID_CONTEXT, what CUDA answers (error 201 from cudaIpcOpenEventHandle in
/// ROCm/hip#1984's CI run on CUDA 10; HIP's test expects the same, ROCm/hip#2882).
fn ipc_open(out: *mut CUevent, h: IpcEventHandle) -> Res {
    let (ch, _) = ctx::current()?;
    if out.is_null() || word(&h, 0) != IPC_EVENT_MAGIC {
        return Err(err::INVALID_VALUE);
    }
    if word(&h, 1) == crate::ipc::process_token() {
        return Err(err::INVALID_CONTEXT);
    }
    let (i, generation) = (word(&h, 2) as usize, word(&h, 3));
    drv()?
        .sim
        .shared
        .event(i, generation)
        .ok_or(err::INVALID_VALUE)?;
    let ipc = OnceLock::new();
    let _ = ipc.set((i, generation, false));
    let (eh, _) = events().insert(Event {
        flags: CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS,
        ctx: ch,
        time: AtomicU64::new(0),
        ipc,
    });
    write(out, eh as CUevent)
}

export! {
    fn cuEventCreate(out: *mut CUevent, flags: c_uint) { create(out, flags) }
    fn cuEventElapsedTime(ms: *mut f32, start: CUevent, end: CUevent) { elapsed(ms, start, end) }
    fn cuEventElapsedTime_v2(ms: *mut f32, start: CUevent, end: CUevent) { elapsed(ms, start, end) }
    /// "An event may be destroyed before it is complete ... the call does not block on
    /// completion of the event" (cuda.h).
    fn cuEventDestroy_v2(e: CUevent) { destroy(e) }
    fn cuIpcGetEventHandle(out: *mut IpcEventHandle, e: CUevent) { ipc_get(out, e) }
    fn cuIpcOpenEventHandle(out: *mut CUevent, h: IpcEventHandle) { ipc_open(out, h) }
}
