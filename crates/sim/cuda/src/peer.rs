//! Peer context memory access (cuCtxEnablePeerAccess / cuCtxDisablePeerAccess): which contexts
//! the current one has mapped, with the codes cuda.h 13.5 documents. Whether two devices can
//! reach each other at all is the device chapter's (`device::peer_access`, what
//! cuDeviceCanAccessPeer answers).
//!
//! Access is unidirectional and per pair of contexts, by their ids (never reused, unlike
//! handles): a destroyed context's grants go with it, since no live context has its id.

use crate::{ctx, device, drv, export, Res};
use cuvisor_cuda_abi::cuda::{err, CUcontext, CUresult};
use std::collections::HashSet;
use std::ffi::c_uint;
use std::sync::atomic::Ordering::Acquire;
use std::sync::{Arc, Mutex, OnceLock};

// `cudaError_enum` (cuda.h 13.5).
pub(crate) const PEER_ACCESS_UNSUPPORTED: CUresult = 217;
pub(crate) const PEER_ACCESS_ALREADY_ENABLED: CUresult = 704;
pub(crate) const PEER_ACCESS_NOT_ENABLED: CUresult = 705;
pub(crate) const TOO_MANY_PEERS: CUresult = 711;

/// "On non-NVSwitch enabled systems, each device can support a system-wide maximum of eight
/// peer connections" (CUDA C++ Programming Guide, "Peer-to-Peer Memory Access"); counted here
/// per context, as the peer contexts it has mapped (no simulated machine reaches it: the
/// largest has 7 peers per GPU).
const MAX_PEERS: usize = 8;

/// (accessing context id, peer context id).
fn grants() -> &'static Mutex<HashSet<(u64, u64)>> {
    static G: OnceLock<Mutex<HashSet<(u64, u64)>>> = OnceLock::new();
    G.get_or_init(|| Mutex::new(HashSet::new()))
}

/// The peer context: "CUDA_ERROR_INVALID_CONTEXT if ... peerContext is not a valid context"; a
/// primary context that is not retained cannot work, so it is none either.
fn peer(h: CUcontext) -> Result<Arc<ctx::Context>, CUresult> {
    let c = ctx::get(h)?;
    if !c.alive.load(Acquire) {
        return Err(err::INVALID_CONTEXT);
    }
    Ok(c)
}

/// cuCtxEnablePeerAccess, in cuda.h's order of conditions: no current context, an invalid peer
/// or "the current context is peerContext": INVALID_CONTEXT; flags other than 0: INVALID_VALUE;
/// devices cuDeviceCanAccessPeer says cannot (two contexts of one device included, as it answers
/// 0 for a device and itself): PEER_ACCESS_UNSUPPORTED; already enabled:
/// PEER_ACCESS_ALREADY_ENABLED; out of peer slots: TOO_MANY_PEERS.
fn enable(h: CUcontext, flags: c_uint) -> Res {
    let (me, c) = ctx::current()?;
    let p = peer(h)?;
    if me == h as usize {
        return Err(err::INVALID_CONTEXT);
    }
    if flags != 0 {
        return Err(err::INVALID_VALUE);
    }
    if !device::peer_access(&drv()?.sim.fabric, c.dev, p.dev) {
        return Err(PEER_ACCESS_UNSUPPORTED);
    }
    let mut g = grants().lock().unwrap_or_else(|e| e.into_inner());
    if g.contains(&(c.id, p.id)) {
        return Err(PEER_ACCESS_ALREADY_ENABLED);
    }
    if g.iter().filter(|(a, _)| *a == c.id).count() >= MAX_PEERS {
        return Err(TOO_MANY_PEERS);
    }
    g.insert((c.id, p.id));
    Ok(())
}

/// cuCtxDisablePeerAccess: INVALID_CONTEXT without a current context or for an invalid peer;
/// PEER_ACCESS_NOT_ENABLED "if direct peer access has not yet been enabled from peerContext to
/// the current context".
fn disable(h: CUcontext) -> Res {
    let (_, c) = ctx::current()?;
    let p = peer(h)?;
    let mut g = grants().lock().unwrap_or_else(|e| e.into_inner());
    if !g.remove(&(c.id, p.id)) {
        return Err(PEER_ACCESS_NOT_ENABLED);
    }
    Ok(())
}

/// Whether the context of id `from` has enabled access to the context of id `to`.
pub(crate) fn enabled(from: u64, to: u64) -> bool {
    grants()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .contains(&(from, to))
}

export! {
    fn cuCtxEnablePeerAccess(peer: CUcontext, flags: c_uint) { enable(peer, flags) }
    fn cuCtxDisablePeerAccess(peer: CUcontext) { disable(peer) }
}
