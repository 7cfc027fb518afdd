//! Stream-ordered memory pools: the default and created pools of each device, their
//! attributes, access, and sharing between processes.
//!
//! A pool reserves device memory in 2 MiB steps, keeps freed memory reserved and gives the excess
//! over its release threshold back at synchronization points (stream, event and context
//! synchronization, and a context's teardown, which waits for its work) or cuMemPoolTrimTo, as
//! the real driver does. A pool destroyed with allocations still outstanding keeps its memory
//! until the last of them is freed (see cuMemPoolDestroy).

use crate::mem::{alloc_on, charge, free, location_device, uncharge, Kind, GRANULARITY};
use crate::{ctx, drv, exec, export, read, write, Registry, Res};
use cuvisor_cuda_abi::cuda::*;
use cuvisor_sim::arena::{round_up, ALIGN};
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicBool, Ordering::*};
use std::sync::{Arc, Mutex, OnceLock};

// ---- stream-ordered pools -----------------------------------------------------------------------

pub(crate) struct Pool {
    dev: usize,
    is_default: bool,
    /// cuMemPoolDestroy was called while allocations were outstanding: the handle is invalid
    /// to the program, but the pool (and what it reserves) lives until the last one is freed.
    destroyed: AtomicBool,
    st: Mutex<PoolState>,
}

#[derive(Default)]
struct PoolState {
    reserved: u64,
    used: u64,
    reserved_high: u64,
    used_high: u64,
    threshold: u64,
    reuse: [c_int; 3],
}

impl Pool {
    fn take(&self, bytes: u64) -> Res {
        let mut s = self.st.lock().unwrap_or_else(|e| e.into_inner());
        let spare = s.reserved - s.used;
        if spare < bytes {
            let grow = round_up(bytes - spare, GRANULARITY);
            charge(self.dev, grow)?;
            s.reserved += grow;
            s.reserved_high = s.reserved_high.max(s.reserved);
        }
        s.used += bytes;
        s.used_high = s.used_high.max(s.used);
        Ok(())
    }
    fn give_back(&self, bytes: u64) {
        let mut s = self.st.lock().unwrap_or_else(|e| e.into_inner());
        s.used = s.used.saturating_sub(bytes);
    }
    /// Returns reserved memory above max(used, keep) to the device.
    fn trim(&self, keep: u64) {
        let mut s = self.st.lock().unwrap_or_else(|e| e.into_inner());
        // Capped before rounding: a release threshold of UINT64_MAX ("never release", which
        // PyTorch's cudaMallocAsync backend sets) would overflow the rounding.
        let floor = round_up(s.used.max(keep).min(s.reserved), GRANULARITY).min(s.reserved);
        let excess = s.reserved - floor;
        if excess > 0 {
            s.reserved -= excess;
            uncharge(self.dev, excess);
        }
    }
}

fn pools() -> &'static Registry<Pool> {
    static R: OnceLock<Registry<Pool>> = OnceLock::new();
    R.get_or_init(Registry::new)
}

/// A pool the program may still use (not destroyed).
fn live_pool(h: usize) -> Result<Arc<Pool>, CUresult> {
    pools()
        .get(h)
        .ok()
        .filter(|p| !p.destroyed.load(Acquire))
        .ok_or(err::INVALID_VALUE)
}

/// A destroyed pool whose last outstanding allocation was just freed: its memory goes now.
fn finish_destroyed(h: usize, p: &Pool) {
    if p.destroyed.load(Acquire) && p.st.lock().unwrap_or_else(|e| e.into_inner()).used == 0 {
        p.trim(0);
        let _ = pools().remove(h);
    }
}

/// An allocation of pool `h` of `bytes` was freed (the memory module's release).
pub(crate) fn released(h: usize, bytes: u64) {
    if let Ok(pool) = pools().get(h) {
        pool.give_back(bytes);
        finish_destroyed(h, &pool);
    }
}

/// At a synchronization point that names no device (an event's), every device's pools trim.
pub(crate) fn trim_all_pools_at_sync() {
    if let Ok(d) = drv() {
        for dev in 0..d.sim.model.devices.len() {
            trim_pools_at_sync(dev);
        }
    }
}

/// (default pool, current pool) handles per device.
fn device_pools() -> &'static Vec<Mutex<(usize, usize)>> {
    static P: OnceLock<Vec<Mutex<(usize, usize)>>> = OnceLock::new();
    P.get_or_init(|| {
        (0..cuvisor_sim::model::MAX_DEVICES)
            .map(|_| Mutex::new((0, 0)))
            .collect()
    })
}

fn default_pool(dev: usize) -> usize {
    let mut p = device_pools()[dev]
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if p.0 == 0 {
        let (h, _) = pools().insert(Pool {
            dev,
            is_default: true,
            destroyed: AtomicBool::new(false),
            st: Mutex::new(PoolState::default()),
        });
        *p = (h, h);
    }
    p.0
}

fn current_pool(dev: usize) -> usize {
    default_pool(dev);
    device_pools()[dev]
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .1
}

/// At a synchronization point, pools on `dev` release what exceeds their threshold.
pub(crate) fn trim_pools_at_sync(dev: usize) {
    let list: Vec<Arc<Pool>> = {
        let mut v = Vec::new();
        pools().retain(|_, p| {
            if p.dev == dev && !p.destroyed.load(Acquire) {
                v.push(p.clone());
            }
            true
        });
        v
    };
    for p in list {
        let keep = p.st.lock().unwrap_or_else(|e| e.into_inner()).threshold;
        p.trim(keep);
    }
}

fn alloc_from_pool(
    dptr: *mut CUdeviceptr,
    size: usize,
    pool_h: usize,
    s: CUstream,
    pt: bool,
) -> Res {
    if dptr.is_null() || size == 0 {
        return Err(err::INVALID_VALUE);
    }
    let stream = exec::stream(s, pt)?;
    let pool = live_pool(pool_h)?;
    // "During stream capture, this function results in the creation of an allocation node. In
    // this case, the allocation is owned by the graph instead of the memory pool. The memory
    // pool's properties are used to set the node's creation parameters" (cuMemAllocAsync and
    // cuMemAllocFromPoolAsync, CUDA driver API reference): the pool grows by nothing, and the
    // graph's memory is taken from the device's graph memory pool when the graph runs.
    if let Some(r) = exec::capture_alloc(&stream, pool.dev, size as u64) {
        return write(dptr, r?);
    }
    let rounded = round_up(size as u64, ALIGN);
    pool.take(rounded)?;
    let ch = ctx::current()?.0;
    match alloc_on(pool.dev, ch, rounded, Kind::Pool(pool_h), Some(0)) {
        Ok(a) => write(dptr, a),
        Err(e) => {
            pool.give_back(rounded);
            let _ = stream;
            Err(e)
        }
    }
}

fn alloc_async(dptr: *mut CUdeviceptr, size: usize, s: CUstream, pt: bool) -> Res {
    let stream = exec::stream(s, pt)?;
    alloc_from_pool(dptr, size, current_pool(stream.dev), s, pt)
}

fn free_async(dptr: CUdeviceptr, s: CUstream, pt: bool) -> Res {
    let stream = exec::stream(s, pt)?;
    // "During stream capture, this function results in the creation of a free node"
    // (cuMemFreeAsync, CUDA driver API reference): nothing is freed now.
    if let Some(r) = exec::capture_free(&stream, dptr) {
        return r;
    }
    free(dptr, |_| true)
}

export! {
    fn cuDeviceGetDefaultMemPool(pool: *mut CUmemoryPool, dev: CUdevice) {
        let (i, _) = ctx::device(dev)?;
        write(pool, default_pool(i) as CUmemoryPool)
    }
    fn cuDeviceGetMemPool(pool: *mut CUmemoryPool, dev: CUdevice) {
        let (i, _) = ctx::device(dev)?;
        write(pool, current_pool(i) as CUmemoryPool)
    }
    fn cuDeviceSetMemPool(dev: CUdevice, pool: CUmemoryPool) {
        let (i, _) = ctx::device(dev)?;
        let p = live_pool(pool as usize)?;
        if p.dev != i {
            return Err(err::INVALID_DEVICE);
        }
        default_pool(i);
        device_pools()[i].lock().unwrap_or_else(|e| e.into_inner()).1 = pool as usize;
        Ok(())
    }
    fn cuMemPoolCreate(pool: *mut CUmemoryPool, props: *const CUmemPoolProps) {
        drv()?;
        let p: CUmemPoolProps = read(props)?;
        if p.allocType != CU_MEM_ALLOCATION_TYPE_PINNED || pool.is_null() {
            return Err(err::INVALID_VALUE);
        }
        let dev = location_device(p.location)?.ok_or(err::NOT_SUPPORTED)?;
        let (h, _) = pools().insert(Pool { dev, is_default: false, destroyed: AtomicBool::new(false), st: Mutex::new(PoolState::default()) });
        write(pool, h as CUmemoryPool)
    }
    /// The default pool cannot be destroyed. A pool with outstanding allocations is destroyed
    /// at once for the program, but its memory lives until the last of them is freed, as the
    /// driver API documents for cuMemPoolDestroy: "If any pointers obtained from this pool
    /// haven't been freed or the pool has free operations that haven't completed when
    /// cuMemPoolDestroy is invoked, the function will return immediately and the resources
    /// associated with the pool will be released automatically once there are no more
    /// outstanding allocations." (CUDA Driver API, Memory Pools; also
    /// https://nvidia.github.io/cuda-python/ cuda.bindings.driver.cuMemPoolDestroy).
    fn cuMemPoolDestroy(pool: CUmemoryPool) {
        drv()?;
        let p = live_pool(pool as usize)?;
        if p.is_default {
            return Err(err::INVALID_VALUE);
        }
        {
            let mut dp = device_pools()[p.dev].lock().unwrap_or_else(|e| e.into_inner());
            if dp.1 == pool as usize {
                dp.1 = dp.0;
            }
        }
        p.destroyed.store(true, Release);
        finish_destroyed(pool as usize, &p);
        Ok(())
    }
    fn cuMemPoolTrimTo(pool: CUmemoryPool, keep: usize) {
        drv()?;
        live_pool(pool as usize)?.trim(keep as u64);
        Ok(())
    }
    fn cuMemPoolGetAttribute(pool: CUmemoryPool, attribute: c_int, value: *mut c_void) {
        drv()?;
        let p = live_pool(pool as usize)?;
        let s = p.st.lock().unwrap_or_else(|e| e.into_inner());
        let v64 = |v: u64| write(value as *mut u64, v);
        match attribute {
            CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES..=CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES => {
                write(value as *mut c_int, s.reuse[(attribute - 1) as usize])
            }
            CU_MEMPOOL_ATTR_RELEASE_THRESHOLD => v64(s.threshold),
            CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT => v64(s.reserved),
            CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH => v64(s.reserved_high),
            CU_MEMPOOL_ATTR_USED_MEM_CURRENT => v64(s.used),
            CU_MEMPOOL_ATTR_USED_MEM_HIGH => v64(s.used_high),
            _ => Err(err::INVALID_VALUE),
        }
    }
    /// The high watermarks can only be reset (to the current value) by setting them to 0.
    fn cuMemPoolSetAttribute(pool: CUmemoryPool, attribute: c_int, value: *mut c_void) {
        drv()?;
        let p = live_pool(pool as usize)?;
        let mut s = p.st.lock().unwrap_or_else(|e| e.into_inner());
        match attribute {
            CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES..=CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES => {
                s.reuse[(attribute - 1) as usize] = read(value as *const c_int)?;
            }
            CU_MEMPOOL_ATTR_RELEASE_THRESHOLD => s.threshold = read(value as *const u64)?,
            CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH | CU_MEMPOOL_ATTR_USED_MEM_HIGH => {
                if read(value as *const u64)? != 0 {
                    return Err(err::INVALID_VALUE);
                }
                if attribute == CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH {
                    s.reserved_high = s.reserved;
                } else {
                    s.used_high = s.used;
                }
            }
            _ => return Err(err::INVALID_VALUE),
        }
        Ok(())
    }
    fn cuMemAllocAsync(dptr: *mut CUdeviceptr, size: usize, s: CUstream) { alloc_async(dptr, size, s, false) }
    fn cuMemAllocAsync_ptsz(dptr: *mut CUdeviceptr, size: usize, s: CUstream) { alloc_async(dptr, size, s, true) }
    fn cuMemAllocFromPoolAsync(dptr: *mut CUdeviceptr, size: usize, pool: CUmemoryPool, s: CUstream) {
        alloc_from_pool(dptr, size, pool as usize, s, false)
    }
    fn cuMemAllocFromPoolAsync_ptsz(dptr: *mut CUdeviceptr, size: usize, pool: CUmemoryPool, s: CUstream) {
        alloc_from_pool(dptr, size, pool as usize, s, true)
    }
    fn cuMemFreeAsync(dptr: CUdeviceptr, s: CUstream) { free_async(dptr, s, false) }
    fn cuMemFreeAsync_ptsz(dptr: CUdeviceptr, s: CUstream) { free_async(dptr, s, true) }
}
