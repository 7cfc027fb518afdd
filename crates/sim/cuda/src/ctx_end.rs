//! Ending and synchronizing a context: what it asks of every chapter. `ctx` is the registry the
//! chapters build on and knows none of them; the calls here (cuCtxDestroy, the last
//! cuDevicePrimaryCtxRelease, cuDevicePrimaryCtxReset, cuCtxSynchronize) reach across: the
//! runtime's private table drops what it stored in the context (`export_table`), its memory goes
//! (`mem`, and the pools it allocated from trim as at a synchronization point, `pool`), its
//! legacy stream goes (`stream`), and a synchronization is refused while one of its streams
//! captures (`capture`).

use crate::ctx::{self, current, device, given_or_current, primaries, Context};
use crate::{array, capture, drv, export, export_table, mem, pool, stream, Res};
use cuvisor_cuda_abi::cuda::{err, CUcontext, CUdevice};

/// Frees what context `h` on device `dev` owned (its allocations, its arrays); its teardown waits
/// for its work, as a context synchronization does, so the pools it allocated from release what
/// exceeds their threshold.
fn teardown(h: usize, dev: usize) {
    for d in mem::free_context(h, dev) {
        pool::trim_pools_at_sync(d);
    }
    array::free_context(h);
}

/// The context can no longer work: what the chapters hold for it is freed, then its own memory.
fn deactivate(h: usize) -> Res {
    let c = ctx::contexts().get(h)?;
    ctx::stop(h)?;
    teardown(h, c.dev);
    ctx::release_own_memory(h)
}

fn destroy(h: usize) -> Res {
    ctx::contexts().get(h)?;
    // What the runtime stored in the context goes first, while the context still answers.
    export_table::context_gone(h);
    deactivate(h)?;
    stream::forget_context(h);
    ctx::forget(h)
}

/// Waits for all work queued in the context; a synchronization point for its pools.
fn synchronize(c: &Context) {
    stream::sync_device_work(c);
    pool::trim_pools_at_sync(c.dev);
}

fn primary_release(dev: CUdevice) -> Res {
    let (i, _) = device(dev)?;
    let h = {
        let mut p = primaries()[i].lock().unwrap_or_else(|e| e.into_inner());
        match p.refs {
            0 => return Err(err::INVALID_CONTEXT),
            1 => p.handle,
            _ => {
                p.refs -= 1;
                return Ok(());
            }
        }
    };
    // The last reference: what the runtime stored in the context goes first, outside the lock
    // (its destructors may call the driver back), while the context still answers.
    export_table::context_gone(h);
    let mut p = primaries()[i].lock().unwrap_or_else(|e| e.into_inner());
    p.refs = p.refs.saturating_sub(1);
    if p.refs == 0 {
        deactivate(h)?;
    }
    Ok(())
}

/// Frees every allocation of the primary context and drops what the runtime stored in it (its
/// destructors run, as a reset tears down the context's state); the context itself stays
/// retained.
fn primary_reset(dev: CUdevice) -> Res {
    let (i, _) = device(dev)?;
    let h = {
        let p = primaries()[i].lock().unwrap_or_else(|e| e.into_inner());
        (p.refs > 0).then_some(p.handle)
    };
    if let Some(h) = h {
        export_table::context_gone(h);
        teardown(h, i);
    }
    Ok(())
}

export! {
    fn cuDevicePrimaryCtxRelease(dev: CUdevice) { primary_release(dev) }
    fn cuDevicePrimaryCtxRelease_v2(dev: CUdevice) { primary_release(dev) }
    fn cuDevicePrimaryCtxReset(dev: CUdevice) { primary_reset(dev) }
    fn cuDevicePrimaryCtxReset_v2(dev: CUdevice) { primary_reset(dev) }

    /// A primary context cannot be destroyed (CUDA_ERROR_INVALID_CONTEXT): it is released.
    fn cuCtxDestroy_v2(ctx: CUcontext) {
        drv()?;
        if ctx.is_null() {
            return Err(err::INVALID_VALUE);
        }
        let c = ctx::get(ctx)?;
        if ctx::is_primary(ctx as usize, c.dev) {
            return Err(err::INVALID_CONTEXT);
        }
        destroy(ctx as usize)
    }

    fn cuCtxSynchronize() {
        let (h, c) = current()?;
        capture::refuse_ctx_sync(h)?;
        synchronize(&c);
        Ok(())
    }

    /// CUDA 13.0: waits for the work of `ctx`, NULL meaning the current context.
    fn cuCtxSynchronize_v2(ctx: CUcontext) {
        let (h, c) = given_or_current(ctx)?;
        capture::refuse_ctx_sync(h)?;
        synchronize(&c);
        Ok(())
    }
}
