//! Event sets: XID critical errors from the shared XID ring (fault injection raises them).
//!
//! As documented, a registration records only events that occur after it, and a wait returns at
//! once when an event is pending, else sleeps until one arrives or the timeout passes
//! (NVML_ERROR_TIMEOUT). Events of the other supported types never occur on the simulator.

use crate::device::{dev, handle};
use crate::{export, sim, write, Res};
use cuvisor_cuda_abi::nvml::*;
use std::collections::HashMap;
use std::ffi::{c_uint, c_ulonglong};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

/// What every simulated device claims to support. Only XIDs ever fire; the others are what a real
/// datacenter GPU lists, so clients that register them (nvml-wrapper's own tests do) succeed.
const SUPPORTED: u64 = event::XID_CRITICAL_ERROR
    | event::SINGLE_BIT_ECC_ERROR
    | event::DOUBLE_BIT_ECC_ERROR
    | event::PSTATE
    | event::CLOCK;

/// How often a waiting call looks at the XID ring.
const POLL: Duration = Duration::from_millis(1);

struct Registration {
    device: usize,
    types: u64,
    /// The device's XID sequence number last delivered (or current at registration).
    seen: u64,
}

#[derive(Default)]
struct EventSet {
    regs: Mutex<Vec<Registration>>,
}

impl EventSet {
    fn regs(&self) -> MutexGuard<'_, Vec<Registration>> {
        self.regs.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Live event sets by handle (the address of the set's `Arc`): a stale or forged handle is
/// NVML_ERROR_INVALID_ARGUMENT instead of a dereference.
fn sets() -> MutexGuard<'static, HashMap<usize, Arc<EventSet>>> {
    static SETS: OnceLock<Mutex<HashMap<usize, Arc<EventSet>>>> = OnceLock::new();
    SETS.get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

fn get(set: nvmlEventSet_t) -> Result<Arc<EventSet>, nvmlReturn_t> {
    sets()
        .get(&(set as usize))
        .cloned()
        .ok_or(ret::ERROR_INVALID_ARGUMENT)
}

/// nvmlShutdown's last call frees every event set, as the real library's teardown does.
pub(crate) fn free_all() {
    sets().clear();
}

export! {
    fn nvmlEventSetCreate(set: *mut nvmlEventSet_t) {
        sim()?;
        if set.is_null() {
            return Err(ret::ERROR_INVALID_ARGUMENT);
        }
        let s = Arc::new(EventSet::default());
        let h = Arc::as_ptr(&s) as usize;
        sets().insert(h, s);
        write(set, h as nvmlEventSet_t)
    }

    /// Documented errors: NVML_ERROR_INVALID_ARGUMENT for bits that are no event type or a bad
    /// set; NVML_ERROR_NOT_SUPPORTED when some requested type is unsupported (then none is
    /// registered and the set stays usable).
    fn nvmlDeviceRegisterEvents(device: nvmlDevice_t, types: c_ulonglong, set: nvmlEventSet_t) {
        let (sim, d) = dev(device)?;
        let s = get(set)?;
        if types & !event::ALL != 0 {
            return Err(ret::ERROR_INVALID_ARGUMENT);
        }
        if types & !SUPPORTED != 0 {
            return Err(ret::ERROR_NOT_SUPPORTED);
        }
        let seq = sim
            .shared
            .device(d)
            .xid_seq
            .load(std::sync::atomic::Ordering::Acquire);
        let mut regs = s.regs();
        match regs.iter_mut().find(|r| r.device == d) {
            Some(r) => r.types |= types,
            None => regs.push(Registration { device: d, types, seen: seq }),
        }
        Ok(())
    }

    fn nvmlDeviceGetSupportedEventTypes(device: nvmlDevice_t, types: *mut c_ulonglong) {
        dev(device)?;
        write(types, SUPPORTED)
    }

    fn nvmlEventSetWait_v2(set: nvmlEventSet_t, data: *mut nvmlEventData_t, timeout_ms: c_uint) {
        if data.is_null() {
            sim()?;
            return Err(ret::ERROR_INVALID_ARGUMENT);
        }
        let (device, xid) = wait(set, timeout_ms)?;
        write(data, nvmlEventData_t {
            device: handle(device),
            eventType: event::XID_CRITICAL_ERROR,
            eventData: xid,
            gpuInstanceId: NVML_INVALID_INSTANCE_ID,
            computeInstanceId: NVML_INVALID_INSTANCE_ID,
        })
    }

    /// The unversioned (pre-MIG) wait: a record without the instance ids.
    fn nvmlEventSetWait(set: nvmlEventSet_t, data: *mut nvmlEventData_v1_t, timeout_ms: c_uint) {
        if data.is_null() {
            sim()?;
            return Err(ret::ERROR_INVALID_ARGUMENT);
        }
        let (device, xid) = wait(set, timeout_ms)?;
        write(data, nvmlEventData_v1_t {
            device: handle(device),
            eventType: event::XID_CRITICAL_ERROR,
            eventData: xid,
        })
    }

    fn nvmlEventSetFree(set: nvmlEventSet_t) {
        sim()?;
        sets().remove(&(set as usize)).map(|_| ()).ok_or(ret::ERROR_INVALID_ARGUMENT)
    }
}

/// The oldest pending XID of the set's devices, waiting up to `timeout_ms` for one.
fn wait(set: nvmlEventSet_t, timeout_ms: c_uint) -> Result<(usize, u64), nvmlReturn_t> {
    let sim = sim()?;
    let s = get(set)?;
    let deadline = Instant::now() + Duration::from_millis(timeout_ms as u64);
    loop {
        if let Some(ev) = take_next(sim, &s) {
            return Ok(ev);
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(ret::ERROR_TIMEOUT);
        }
        std::thread::sleep(POLL.min(deadline - now));
        // A shutdown while waiting ends the wait like the real library's teardown would.
        sim_still_up()?;
    }
}

fn sim_still_up() -> Res {
    sim().map(|_| ())
}

fn take_next(sim: &cuvisor_sim::Sim, s: &EventSet) -> Option<(usize, u64)> {
    let mut regs = s.regs();
    // (time, registration index, seq, xid) of the oldest pending event.
    let mut best: Option<(u64, usize, u64, u64)> = None;
    for (i, r) in regs.iter().enumerate() {
        if r.types & event::XID_CRITICAL_ERROR == 0 {
            continue;
        }
        if let Some(&(seq, xid, t)) = sim.shared.xids_after(r.device, r.seen).first() {
            match best {
                Some(b) if b.0 <= t => {}
                _ => best = Some((t, i, seq, xid)),
            }
        }
    }
    let (_, i, seq, xid) = best?;
    let r = regs.get_mut(i)?;
    r.seen = seq;
    Some((r.device, xid))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn supported_types_are_event_types() {
        assert_eq!(SUPPORTED & !event::ALL, 0);
        assert_ne!(SUPPORTED & event::XID_CRITICAL_ERROR, 0);
    }
}
