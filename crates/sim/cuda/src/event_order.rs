//! Events in stream order: records (cuEventRecord), queries and synchronization, waits of one
//! stream on another (cuStreamWaitEvent) and the context-wide cuCtxRecordEvent / cuCtxWaitEvent,
//! where stream capture takes part (a record or wait on a capturing stream marks or joins a
//! place in the captured graph) and a synchronization trims the pools. The event objects, their
//! times, timing and IPC handles are `event`.

use crate::event::{event, Event};
use crate::stream::{stream, wait_for, Stream};
use crate::{capture, ctx, export, Res};
use cuvisor_cuda_abi::cuda::*;
use cuvisor_sim::state::{now_ns, sleep_until, EVENT_PENDING};
use std::ffi::c_uint;
use std::sync::atomic::{AtomicU64, Ordering::*};
use std::sync::Arc;

/// `CUevent_record_flags`: CU_EVENT_RECORD_EXTERNAL 1, "invalid outside of stream capture".
const CU_EVENT_RECORD_EXTERNAL: c_uint = 0x1;
/// `CUevent_wait_flags`: CU_EVENT_WAIT_EXTERNAL 1 (stream capture only, like the record flag).
const CU_EVENT_WAIT_EXTERNAL: c_uint = 0x1;

/// cuEventRecord: the event captures the stream's work so far. Behind queued host work its
/// time is unknown until the stream gets there; until then it is not complete.
fn record(ev: CUevent, h: CUstream, flags: c_uint, pt: bool) -> Res {
    let e = event(ev)?;
    let s = stream(h, pt)?;
    if flags & !CU_EVENT_RECORD_EXTERNAL != 0 {
        return Err(err::INVALID_VALUE);
    }
    // In a capture the event marks the stream's place in the captured graph: nothing to time.
    if let Some(r) = capture::capture_event_record(&s, ev as usize, flags) {
        return r;
    }
    if flags & CU_EVENT_RECORD_EXTERNAL != 0 {
        return Err(err::INVALID_VALUE); // "This flag is invalid outside of stream capture."
    }
    if e.ctx != s.ctx.load(Relaxed) && s.ctx.load(Relaxed) != 0 {
        return Err(err::INVALID_HANDLE);
    }
    let pending = e.clone();
    s.submit_or(
        move || pending.set(EVENT_PENDING),
        move |s| e.set(s.done_at().max(now_ns())),
    );
    Ok(())
}

/// "Returns CUDA_SUCCESS if all captured work has been completed, or CUDA_ERROR_NOT_READY if
/// any captured work is incomplete"; an event never recorded "represents an empty set of work"
/// and answers CUDA_SUCCESS (cuda.h).
fn query(ev: CUevent) -> Res {
    let e = event(ev)?;
    capture::event_captured(ev as usize)?;
    let t = e.time();
    if t != EVENT_PENDING && now_ns() >= t {
        Ok(())
    } else {
        Err(err::NOT_READY)
    }
}

/// Waits until the captured work is done. CU_EVENT_BLOCKING_SYNC changes how the real driver
/// waits (the thread sleeps rather than spins); the simulator always sleeps.
fn synchronize(ev: CUevent) -> Res {
    let e = event(ev)?;
    capture::event_captured(ev as usize)?;
    wait_for(|| e.time() != EVENT_PENDING);
    sleep_until(e.time());
    // "the allocator will try to release memory back to the OS on the next call to stream,
    // event or context synchronize" (CU_MEMPOOL_ATTR_RELEASE_THRESHOLD).
    crate::pool::trim_all_pools_at_sync();
    Ok(())
}

/// cuStreamWaitEvent (the stream chapter's, here so that streams need not know events): work
/// queued on the stream after this waits for the work the event captured, recorded in any
/// stream, context or (IPC) process. An event whose record is still queued behind host work
/// blocks the stream until its time is known.
fn stream_wait(h: CUstream, ev: CUevent, flags: c_uint, pt: bool) -> Res {
    let s: Arc<Stream> = stream(h, pt)?;
    let e = event(ev)?;
    if flags & !CU_EVENT_WAIT_EXTERNAL != 0 {
        return Err(err::INVALID_VALUE);
    }
    // In a capture, a join or fork of capturing streams (or an event-wait node).
    if let Some(r) = capture::capture_event_wait(&s, ev as usize, flags) {
        return r;
    }
    if flags & CU_EVENT_WAIT_EXTERNAL != 0 {
        return Err(err::INVALID_VALUE); // "This flag is invalid when used outside of capture."
    }
    wait_on(&s, e);
    Ok(())
}

/// cuCtxRecordEvent (CUDA 12.5, cuda.h): "Captures in hEvent all the activities of the context
/// hCtx at the time of this call. hEvent and hCtx must be from the same CUDA context, otherwise
/// CUDA_ERROR_INVALID_HANDLE will be returned"; CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED "if the
/// specified context hCtx has a stream in the capture mode" (the real driver also invalidates
/// those captures; the simulator leaves them alone). The event's time is the latest end of the
/// work queued in each of the context's streams; behind host work it is pending until every
/// stream gets there.
pub(crate) fn ctx_record(ch: usize, ev: CUevent) -> Res {
    let e = event(ev)?;
    if e.ctx != ch {
        return Err(err::INVALID_HANDLE);
    }
    let all = crate::stream::context_streams(ch);
    if all.iter().any(|s| crate::capture::capturing(s)) {
        return Err(err::STREAM_CAPTURE_UNSUPPORTED);
    }
    let tail = ctx::get(ch as CUcontext)?.work_tail.load(Acquire);
    // The latest end seen so far, and how many streams have still to report (plus this call).
    let acc = Arc::new((
        AtomicU64::new(tail),
        std::sync::atomic::AtomicUsize::new(all.len() + 1),
    ));
    let finish = |e: &Event, acc: &(AtomicU64, std::sync::atomic::AtomicUsize)| {
        if acc.1.fetch_sub(1, AcqRel) == 1 {
            e.set(acc.0.load(Acquire).max(now_ns()));
        }
    };
    for s in all {
        let (pending, e, acc) = (e.clone(), e.clone(), acc.clone());
        s.submit_or(
            move || pending.set(EVENT_PENDING),
            move |s| {
                acc.0.fetch_max(s.done_at(), AcqRel);
                finish(&e, &acc);
            },
        );
    }
    finish(&e, &acc);
    Ok(())
}

/// cuCtxWaitEvent (CUDA 12.5, cuda.h): "Makes all future work submitted to context hCtx wait for
/// all work captured in hEvent"; "hEvent may be from a different context or device". Each of
/// the context's streams waits as cuStreamWaitEvent would; a stream made after the call does
/// not (a simplification), nor does one of another process. CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
/// where a stream of the context is capturing.
pub(crate) fn ctx_wait(ch: usize, ev: CUevent) -> Res {
    event(ev)?;
    let all = crate::stream::context_streams(ch);
    if all.iter().any(|s| crate::capture::capturing(s)) {
        return Err(err::STREAM_CAPTURE_UNSUPPORTED);
    }
    for s in all {
        wait_on(&s, event(ev)?);
    }
    Ok(())
}

/// Work queued on `s` after this waits for the work `e` captured.
fn wait_on(s: &Arc<Stream>, e: Arc<Event>) {
    let t = e.time();
    if t != EVENT_PENDING {
        s.submit(move |s| {
            s.tail.fetch_max(t, AcqRel);
        });
    } else {
        s.submit_host(move |s| {
            wait_for(|| e.time() != EVENT_PENDING);
            s.tail.fetch_max(e.time(), AcqRel);
        });
    }
}

export! {
    fn cuEventRecord(e: CUevent, s: CUstream) { record(e, s, 0, false) }
    fn cuEventRecord_ptsz(e: CUevent, s: CUstream) { record(e, s, 0, true) }
    fn cuEventRecordWithFlags(e: CUevent, s: CUstream, flags: c_uint) { record(e, s, flags, false) }
    fn cuEventRecordWithFlags_ptsz(e: CUevent, s: CUstream, flags: c_uint) { record(e, s, flags, true) }
    fn cuEventQuery(e: CUevent) { query(e) }
    fn cuEventSynchronize(e: CUevent) { synchronize(e) }
    fn cuStreamWaitEvent(s: CUstream, e: CUevent, flags: c_uint) { stream_wait(s, e, flags, false) }
    fn cuStreamWaitEvent_ptsz(s: CUstream, e: CUevent, flags: c_uint) { stream_wait(s, e, flags, true) }
}
