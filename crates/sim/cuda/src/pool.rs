//! Stream-ordered memory pools: the default and created pools of each device, their
//! attributes, access, and sharing between processes.
//!
//! A pool reserves device memory in 2 MiB steps, keeps freed memory reserved and gives the excess
//! over its release threshold back at synchronization points (stream, event and context
//! synchronization, and a context's teardown, which waits for its work) or cuMemPoolTrimTo, as
//! the real driver does. A pool destroyed with allocations still outstanding keeps its memory
//! until the last of them is freed (see cuMemPoolDestroy).

use crate::mem::{self, charge, free, location_device, uncharge, Alloc, Kind, GRANULARITY};
use crate::stream;
use crate::{ctx, drv, export, export_record, read, write, Registry, Res};
use cuvisor_cuda_abi::cuda::*;
use cuvisor_sim::arena::{round_up, Arena, ALIGN};
use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicBool, Ordering::*};
use std::sync::{Arc, Mutex, OnceLock};

// ---- stream-ordered pools -----------------------------------------------------------------------

/// CUmemPool_attribute values CUDA 12 added after the eight cuda-abi names (cuda.h 13.5, enum
/// CUmemPool_attribute, in order after CU_MEMPOOL_ATTR_USED_MEM_HIGH = 8).
const ATTR_ALLOCATION_TYPE: c_int = 9;
const ATTR_EXPORT_HANDLE_TYPES: c_int = 10;
const ATTR_LOCATION_ID: c_int = 11;
const ATTR_LOCATION_TYPE: c_int = 12;
const ATTR_MAX_POOL_SIZE: c_int = 13;
const ATTR_HW_DECOMPRESS_ENABLED: c_int = 14;
const ATTR_LOCALITY_DOMAIN_ID: c_int = 15;
/// cuda.h 13.5: `#define CU_MEM_POOL_CREATE_USAGE_HW_DECOMPRESS 0x2` (CUmemPoolProps::usage).
const USAGE_HW_DECOMPRESS: u16 = 0x2;
/// CUmemAccess_flags (cuda.h 13.5): PROT_NONE 0, PROT_READ 1, PROT_READWRITE 3.
const PROT_READ: c_int = 1;

pub(crate) struct Pool {
    dev: usize,
    is_default: bool,
    /// cuMemPoolDestroy was called while allocations were outstanding: the handle is invalid
    /// to the program, but the pool (and what it reserves) lives until the last one is freed.
    destroyed: AtomicBool,
    st: Mutex<PoolState>,
    /// CUmemPoolProps::handleTypes (CU_MEMPOOL_ATTR_EXPORT_HANDLE_TYPES; NONE when imported).
    handle_types: c_int,
    /// CUmemPoolProps::maxSize, 0 = no limit but the device.
    max_size: u64,
    usage: u16,
    /// Where an IPC-capable pool's memory lives: a file both the exporting process and every
    /// importing process map, so that an imported pointer reads the exporter's bytes.
    region: Option<Region>,
    /// Imported from another process: it makes no allocations, it maps the exporter's.
    imported: bool,
    /// Access of devices other than the pool's own (cuMemPoolSetAccess), by device ordinal.
    access: Mutex<HashMap<usize, c_int>>,
}

/// The shared memory of an IPC-capable or imported pool.
struct Region {
    /// Over a memfd sized to the pool's reach, with the export record after it (`export_record`);
    /// each allocation holds it too (see `mem::alloc_in`), so it outlives the pool until the
    /// last of them is freed.
    arena: Arc<Arena>,
    /// Once exported (or, in an importer, from the start): the shared-state entry that carries
    /// the pool's reservation instead of this process (see `mem::open_share`).
    share: Mutex<Option<(usize, u64)>>,
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
    fn new(dev: usize, is_default: bool) -> Pool {
        Pool {
            dev,
            is_default,
            destroyed: AtomicBool::new(false),
            st: Mutex::new(PoolState {
                // The three reuse policies are "default enabled" (cuda.h 13.5, CUmemPool_attribute).
                reuse: [1; 3],
                ..PoolState::default()
            }),
            handle_types: 0,
            max_size: 0,
            usage: 0,
            region: None,
            imported: false,
            access: Mutex::new(HashMap::new()),
        }
    }
    fn shared_entry(&self) -> Option<(usize, u64)> {
        let r = self.region.as_ref()?;
        *r.share.lock().unwrap_or_else(|e| e.into_inner())
    }
    fn take(&self, bytes: u64) -> Res {
        let mut s = self.st.lock().unwrap_or_else(|e| e.into_inner());
        let spare = s.reserved - s.used;
        if spare < bytes {
            let grow = round_up(bytes - spare, GRANULARITY);
            if self.max_size > 0 && s.reserved + grow > self.max_size {
                return Err(err::OUT_OF_MEMORY);
            }
            match self.shared_entry() {
                // Shared: the entry carries the reservation, whichever process grows it.
                Some((i, _)) => {
                    let d = drv()?;
                    let cap = d.sim.model.devices[self.dev].memory;
                    if !d.sim.shared.share_charge(i, grow, cap) {
                        return Err(err::OUT_OF_MEMORY);
                    }
                }
                None => charge(self.dev, grow)?,
            }
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
            match self.shared_entry() {
                Some((i, _)) => {
                    if let Ok(d) = drv() {
                        d.sim.shared.share_uncharge(i, excess);
                    }
                }
                None => uncharge(self.dev, excess),
            }
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
///
/// A pool that was shared (exported, or imported) lets go of its shared-state entry instead:
/// its reservation stays counted until the last process holding the pool lets go, since the
/// memory is reachable from every process that imported the pool (erring toward counting).
fn finish_destroyed(h: usize, p: &Pool) {
    if p.destroyed.load(Acquire) && p.st.lock().unwrap_or_else(|e| e.into_inner()).used == 0 {
        match p.shared_entry() {
            Some((i, _)) => mem::unref_share(i),
            None => p.trim(0),
        }
        let _ = pools().remove(h);
    }
}

/// An allocation of pool `h` of `bytes` was freed (its `on_release`).
fn released(h: usize, bytes: u64) {
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
        let (h, _) = pools().insert(Pool::new(dev, true));
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
    let stream = stream::stream(s, pt)?;
    let pool = live_pool(pool_h)?;
    // "Imported memory pools do not support creating new allocations. As such imported memory
    // pools may not be used in cuDeviceSetMemPool or cuMemAllocFromPoolAsync calls."
    // (cuda.h 13.5, cuMemPoolImportFromShareableHandle.)
    if pool.imported {
        return Err(err::INVALID_VALUE);
    }
    // "During stream capture, this function results in the creation of an allocation node. In
    // this case, the allocation is owned by the graph instead of the memory pool. The memory
    // pool's properties are used to set the node's creation parameters" (cuMemAllocAsync and
    // cuMemAllocFromPoolAsync, CUDA driver API reference): the pool grows by nothing, and the
    // graph's memory is taken from the device's graph memory pool when the graph runs.
    if let Some(r) = crate::capture::capture_alloc(&stream, pool.dev, size as u64) {
        return write(dptr, r?);
    }
    let rounded = round_up(size as u64, ALIGN);
    pool.take(rounded)?;
    let ch = ctx::current()?.0;
    let own = pool.region.as_ref().map(|r| r.arena.clone());
    let on_release: mem::OnRelease = Box::new(move |_| released(pool_h, rounded));
    match mem::alloc_in(
        pool.dev,
        ch,
        rounded,
        Kind::Pool(pool_h),
        Some(0),
        own,
        Some(on_release),
    ) {
        Ok(a) => write(dptr, a),
        Err(e) => {
            pool.give_back(rounded);
            let _ = stream;
            Err(e)
        }
    }
}

fn alloc_async(dptr: *mut CUdeviceptr, size: usize, s: CUstream, pt: bool) -> Res {
    let stream = stream::stream(s, pt)?;
    alloc_from_pool(dptr, size, current_pool(stream.dev), s, pt)
}

fn free_async(dptr: CUdeviceptr, s: CUstream, pt: bool) -> Res {
    let stream = stream::stream(s, pt)?;
    // "During stream capture, this function results in the creation of a free node"
    // (cuMemFreeAsync, CUDA driver API reference): nothing is freed now.
    if let Some(r) = crate::capture::capture_free(&stream, dptr) {
        return r;
    }
    free(dptr, |_| true)
}

/// `CUmemPoolPtrExportData` (cuda.h 13.5): 64 opaque bytes.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CUmemPoolPtrExportData {
    pub reserved: [u8; 64],
}
/// CUmemAllocationType (cuda.h 13.5): INVALID 0, PINNED 1, MANAGED 2.
const CU_MEM_ALLOCATION_TYPE_MANAGED: c_int = 2;

/// The device a location-form pool call names (device location, pinned memory).
fn pinned_device(location: *mut CUmemLocation, kind: c_int) -> Result<usize, CUresult> {
    drv()?;
    let loc: CUmemLocation = read(location as *const CUmemLocation)?;
    // DEVICE, HOST, HOST_NUMA, HOST_NUMA_CURRENT; NONE only for a managed pool.
    let known = matches!(loc.type_, CU_MEM_LOCATION_TYPE_DEVICE | 2..=4);
    if !(known || (loc.type_ == 0 && kind == CU_MEM_ALLOCATION_TYPE_MANAGED)) {
        return Err(err::INVALID_VALUE);
    }
    if kind != CU_MEM_ALLOCATION_TYPE_PINNED && kind != CU_MEM_ALLOCATION_TYPE_MANAGED {
        return Err(err::INVALID_VALUE);
    }
    match (location_device(loc)?, kind) {
        (Some(dev), CU_MEM_ALLOCATION_TYPE_PINNED) => Ok(dev),
        _ => Err(err::NOT_SUPPORTED),
    }
}

/// First word of the data cuMemPoolExportPointer makes.
const POOL_PTR_MAGIC: u64 = 0x4356_5053_5054_0001;
/// A memfd for an IPC-capable pool that can reach `reach` bytes (sparse: it costs what is
/// written), mapped as the pool's arena; its export record goes after `reach`.
fn new_region(reach: u64) -> Result<Region, CUresult> {
    // SAFETY: memfd_create with a static NUL-terminated name; we own the returned fd.
    let fd = unsafe { libc::memfd_create(c"cuvisor-sim-pool".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(err::OUT_OF_MEMORY);
    }
    // SAFETY: sizing our own new memfd.
    if unsafe {
        libc::ftruncate(
            fd,
            (reach + export_record::RECORD_LEN as u64) as libc::off_t,
        )
    } != 0
    {
        // SAFETY: closing our own fd.
        unsafe { libc::close(fd) };
        return Err(err::OUT_OF_MEMORY);
    }
    // The arena owns the descriptor from here on, failing or not.
    let arena = Arena::over_file(fd, reach).ok_or(err::OUT_OF_MEMORY)?;
    Ok(Region {
        arena: Arc::new(arena),
        share: Mutex::new(None),
    })
}

/// Writes the record an importer reads: device, reach, shared entry and its generation.
fn write_record(r: &Region, dev: usize, i: usize, generation: u64) -> Res {
    let reach = r.arena.size();
    let fields = [dev as i64, reach as i64, i as i64, generation as i64];
    export_record::write(r.arena.fd(), reach, "cuvisor-sim-pool", fields)
}

/// (device, reach, entry, generation) from an exported pool's descriptor.
fn read_record(fd: c_int) -> Result<(usize, u64, usize, u64), CUresult> {
    let ([dev, reach, i, generation], at) = export_record::read(fd, "cuvisor-sim-pool")?;
    if dev < 0 || reach as u64 != at || i < 0 {
        return Err(err::INVALID_VALUE);
    }
    Ok((dev as usize, at, i as usize, generation as u64))
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
        if p.imported {
            return Err(err::INVALID_VALUE); // see alloc_from_pool
        }
        if p.dev != i {
            return Err(err::INVALID_DEVICE);
        }
        default_pool(i);
        device_pools()[i].lock().unwrap_or_else(|e| e.into_inner()).1 = pool as usize;
        Ok(())
    }
    /// CUDA 13.0's location forms: a device location with CU_MEM_ALLOCATION_TYPE_PINNED is the
    /// device's default (current) pool, as cuDeviceGetDefaultMemPool (cuDeviceGetMemPool)
    /// answers; host locations and managed pools are not modelled (NOT_SUPPORTED, one of the
    /// documented answers); any other location type: INVALID_VALUE ("In all other cases, the
    /// call returns ::CUDA_ERROR_INVALID_VALUE", cuda.h 13.5).
    fn cuMemGetDefaultMemPool(pool: *mut CUmemoryPool, location: *mut CUmemLocation, kind: c_int) {
        let dev = pinned_device(location, kind)?;
        write(pool, default_pool(dev) as CUmemoryPool)
    }
    fn cuMemGetMemPool(pool: *mut CUmemoryPool, location: *mut CUmemLocation, kind: c_int) {
        let dev = pinned_device(location, kind)?;
        write(pool, current_pool(dev) as CUmemoryPool)
    }
    /// "The location and allocation type specified must match those of the pool otherwise
    /// ::CUDA_ERROR_INVALID_VALUE is returned" (cuda.h 13.5); otherwise as cuDeviceSetMemPool.
    fn cuMemSetMemPool(location: *mut CUmemLocation, kind: c_int, pool: CUmemoryPool) {
        let dev = pinned_device(location, kind)?;
        let p = live_pool(pool as usize)?;
        if p.imported || p.dev != dev {
            return Err(err::INVALID_VALUE);
        }
        default_pool(dev);
        device_pools()[dev].lock().unwrap_or_else(|e| e.into_inner()).1 = pool as usize;
        Ok(())
    }
    /// Device pools of pinned memory. handleTypes: NONE, or POSIX_FILE_DESCRIPTOR (an
    /// IPC-capable pool, whose memory is a file that importers map); Win32 handles and fabric
    /// handles (which need an IMEX channel) are not available on this machine. Host-located
    /// pools "are not IPC capable and ::CUmemPoolProps::handleTypes must be 0, any other values
    /// will result in ::CUDA_ERROR_INVALID_VALUE"; managed pools need `handleTypes` NONE and
    /// `maxSize` 0 (cuda.h 13.5, cuMemPoolCreate). Host and managed pools are not modelled.
    fn cuMemPoolCreate(pool: *mut CUmemoryPool, props: *const CUmemPoolProps) {
        drv()?;
        let p: CUmemPoolProps = read(props)?;
        if pool.is_null() {
            return Err(err::INVALID_VALUE);
        }
        let host = matches!(p.location.type_, 2..=4);
        if host && p.handleTypes != 0 {
            return Err(err::INVALID_VALUE);
        }
        if p.allocType == CU_MEM_ALLOCATION_TYPE_MANAGED && (p.handleTypes != 0 || p.maxSize != 0) {
            return Err(err::INVALID_VALUE);
        }
        if p.allocType != CU_MEM_ALLOCATION_TYPE_PINNED && p.allocType != CU_MEM_ALLOCATION_TYPE_MANAGED {
            return Err(err::INVALID_VALUE);
        }
        if p.handleTypes & !CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR != 0 {
            return Err(err::NOT_SUPPORTED);
        }
        let dev = location_device(p.location)?.ok_or(err::NOT_SUPPORTED)?;
        if p.allocType != CU_MEM_ALLOCATION_TYPE_PINNED {
            return Err(err::NOT_SUPPORTED);
        }
        let mut pl = Pool::new(dev, false);
        pl.handle_types = p.handleTypes;
        pl.max_size = if p.maxSize == 0 { 0 } else { round_up(p.maxSize as u64, GRANULARITY) };
        pl.usage = p.usage;
        if p.handleTypes & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR != 0 {
            let reach = if pl.max_size > 0 { pl.max_size } else { drv()?.sim.model.devices[dev].memory };
            pl.region = Some(new_region(reach)?);
        }
        let (h, _) = pools().insert(pl);
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
            ATTR_ALLOCATION_TYPE => write(value as *mut c_int, CU_MEM_ALLOCATION_TYPE_PINNED),
            // "For imported pools this value is always CU_MEM_HANDLE_TYPE_NONE as an imported
            // pool cannot be re-exported" (cuda.h 13.5).
            ATTR_EXPORT_HANDLE_TYPES => write(value as *mut c_int, p.handle_types),
            ATTR_LOCATION_ID => write(value as *mut c_int, p.dev as c_int),
            ATTR_LOCATION_TYPE => write(value as *mut c_int, CU_MEM_LOCATION_TYPE_DEVICE),
            // "A value of 0 indicates no maximum size. [...] IPC imported pools this value will
            // be system dependent": the importer reports the exporter's reach.
            ATTR_MAX_POOL_SIZE => v64(if p.imported { p.region.as_ref().map_or(0, |r| r.arena.size()) } else { p.max_size }),
            ATTR_HW_DECOMPRESS_ENABLED => write(value as *mut c_int, (p.usage & USAGE_HW_DECOMPRESS != 0) as c_int),
            // "-1 indicates that the mempool is not localized" (every modelled GPU has one domain).
            ATTR_LOCALITY_DOMAIN_ID => write(value as *mut c_int, -1),
            _ => Err(err::INVALID_VALUE),
        }
    }
    /// The high watermarks can only be reset (to the current value) by setting them to 0; the
    /// attributes CUDA 12 added describe the pool and are read-only (INVALID_VALUE).
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
    /// "By default, the pool's memory will be accessible from the device it is allocated on"
    /// (cuMemPoolCreate); the owner's access cannot be taken away. Other devices: PROT_NONE,
    /// PROT_READ or PROT_READWRITE, each a device location; anything else INVALID_VALUE.
    /// The descriptors are checked before any takes effect.
    fn cuMemPoolSetAccess(pool: CUmemoryPool, map: *const CUmemAccessDesc, count: usize) {
        drv()?;
        let p = live_pool(pool as usize)?;
        if count > 0 && map.is_null() {
            return Err(err::INVALID_VALUE);
        }
        let mut set = Vec::with_capacity(count);
        for i in 0..count {
            let d: CUmemAccessDesc = read(map.wrapping_add(i))?;
            let dev = location_device(d.location)?.ok_or(err::INVALID_VALUE)?;
            if !matches!(d.flags, CU_MEM_ACCESS_FLAGS_PROT_NONE | PROT_READ | CU_MEM_ACCESS_FLAGS_PROT_READWRITE) {
                return Err(err::INVALID_VALUE);
            }
            if dev == p.dev && d.flags != CU_MEM_ACCESS_FLAGS_PROT_READWRITE {
                return Err(err::INVALID_VALUE);
            }
            set.push((dev, d.flags));
        }
        let mut a = p.access.lock().unwrap_or_else(|e| e.into_inner());
        for (dev, flags) in set {
            if dev != p.dev {
                a.insert(dev, flags);
            }
        }
        Ok(())
    }
    fn cuMemPoolGetAccess(flags: *mut c_int, pool: CUmemoryPool, location: *mut CUmemLocation) {
        drv()?;
        let p = live_pool(pool as usize)?;
        let loc: CUmemLocation = read(location as *const CUmemLocation)?;
        let dev = location_device(loc)?.ok_or(err::INVALID_VALUE)?;
        let f = if dev == p.dev {
            CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        } else {
            p.access.lock().unwrap_or_else(|e| e.into_inner()).get(&dev).copied().unwrap_or(CU_MEM_ACCESS_FLAGS_PROT_NONE)
        };
        write(flags, f)
    }
    /// "Given an IPC capable mempool, create an OS handle to share the pool with another
    /// process" (cuda.h 13.5): a duplicate of the pool's memfd, which SCM_RIGHTS or
    /// pidfd_getfd carry to another process. A pool made without that handle type (or
    /// imported: "an imported pool cannot be re-exported"), another handle type or non-zero
    /// flags ("must be 0"): INVALID_VALUE. The first export makes the pool's reservation shared:
    /// it leaves this process for a shared-state entry that every importer holds too.
    fn cuMemPoolExportToShareableHandle(out: *mut c_void, pool: CUmemoryPool, kind: c_int, flags: u64) {
        drv()?;
        let p = live_pool(pool as usize)?;
        if out.is_null() || flags != 0 || kind != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR || p.handle_types & kind == 0 {
            return Err(err::INVALID_VALUE);
        }
        let r = p.region.as_ref().ok_or(err::INVALID_VALUE)?;
        {
            let st = p.st.lock().unwrap_or_else(|e| e.into_inner());
            let mut share = r.share.lock().unwrap_or_else(|e| e.into_inner());
            if share.is_none() {
                let (i, generation) = mem::open_share(p.dev, st.reserved)?;
                *share = Some((i, generation));
                write_record(r, p.dev, i, generation)?;
            }
        }
        // SAFETY: duplicating the pool's own open memfd; the caller owns the new descriptor.
        let fd = unsafe { libc::fcntl(r.arena.fd(), libc::F_DUPFD_CLOEXEC, 0) };
        if fd < 0 {
            return Err(err::OUT_OF_MEMORY);
        }
        write(out as *mut c_int, fd)
    }
    /// The pool another process exported, from its descriptor (`handle` holds the int, as the
    /// runtime passes it: `(void *)(uintptr_t)fd`). The descriptor stays the caller's. Another
    /// handle type, flags, or a descriptor that is not an exported pool: INVALID_VALUE; a pool
    /// whose every holder has let go: INVALID_VALUE.
    fn cuMemPoolImportFromShareableHandle(pool_out: *mut CUmemoryPool, handle: *mut c_void, kind: c_int, flags: u64) {
        drv()?;
        if pool_out.is_null() || flags != 0 || kind != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR {
            return Err(err::INVALID_VALUE);
        }
        let fd = handle as usize as c_int;
        let (dev, reach, i, generation) = read_record(fd)?;
        if dev >= drv()?.sim.model.devices.len() {
            return Err(err::INVALID_VALUE);
        }
        mem::ref_share(i, generation)?;
        // SAFETY: duplicating the caller's descriptor; the pool owns the copy.
        let own = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
        // The arena owns the duplicate, failing or not.
        let arena = (own >= 0).then(|| Arena::over_file(own, reach)).flatten();
        let Some(arena) = arena else {
            mem::unref_share(i);
            return Err(err::OUT_OF_MEMORY);
        };
        let mut pl = Pool::new(dev, false);
        pl.imported = true;
        pl.region = Some(Region { arena: Arc::new(arena), share: Mutex::new(Some((i, generation))) });
        let (h, _) = pools().insert(pl);
        write(pool_out, h as CUmemoryPool)
    }
    /// "Constructs shareData_out for sharing a specific allocation from an already shared memory
    /// pool": the allocation's offset and size in the pool's file, and the pool's shared entry.
    /// A pointer that is not the start of a live allocation of an exported pool: INVALID_VALUE.
    fn cuMemPoolExportPointer(out: *mut CUmemPoolPtrExportData, ptr: CUdeviceptr) {
        drv()?;
        if out.is_null() {
            return Err(err::INVALID_VALUE);
        }
        let (h, size) = {
            let t = mem::table().read().unwrap_or_else(|e| e.into_inner());
            match t.get(&ptr) {
                Some(r) => match r.kind {
                    Kind::Pool(h) => (h, r.size),
                    _ => return Err(err::INVALID_VALUE),
                },
                None => return Err(err::INVALID_VALUE),
            }
        };
        let p = pools().get(h)?;
        let r = p.region.as_ref().ok_or(err::INVALID_VALUE)?;
        let (i, generation) = p.shared_entry().ok_or(err::INVALID_VALUE)?;
        let words = [POOL_PTR_MAGIC, i as u64, generation, ptr - r.arena.base(), size];
        let mut d = CUmemPoolPtrExportData { reserved: [0; 64] };
        for (k, v) in words.iter().enumerate() {
            d.reserved[k * 8..k * 8 + 8].copy_from_slice(&v.to_le_bytes());
        }
        write(out, d)
    }
    /// The exporter's allocation at the same offset of the imported pool's mapping: the same
    /// bytes, charged nothing new. Freed with cuMemFree or cuMemFreeAsync ("The pointer may be
    /// freed with cuMemFree or cuMemFreeAsync", cuda.h 13.5). Data of another pool, or of an
    /// allocation already imported here: INVALID_VALUE.
    fn cuMemPoolImportPointer(ptr_out: *mut CUdeviceptr, pool: CUmemoryPool, data: *mut CUmemPoolPtrExportData) {
        drv()?;
        let d: CUmemPoolPtrExportData = read(data as *const CUmemPoolPtrExportData)?;
        if ptr_out.is_null() {
            return Err(err::INVALID_VALUE);
        }
        let word = |k: usize| u64::from_le_bytes(d.reserved[k * 8..k * 8 + 8].try_into().unwrap_or_default());
        let p = live_pool(pool as usize)?;
        let r = p.region.as_ref().filter(|_| p.imported).ok_or(err::INVALID_VALUE)?;
        if word(0) != POOL_PTR_MAGIC || p.shared_entry() != Some((word(1) as usize, word(2))) {
            return Err(err::INVALID_VALUE);
        }
        let (offset, size) = (word(3), word(4));
        if size == 0 || offset.checked_add(size).is_none_or(|end| end > r.arena.size()) {
            return Err(err::INVALID_VALUE);
        }
        let addr = r.arena.base() + offset;
        let ch = ctx::current().map(|c| c.0).unwrap_or(0);
        let mut t = mem::table().write().unwrap_or_else(|e| e.into_inner());
        if t.contains_key(&addr) {
            return Err(err::INVALID_VALUE);
        }
        t.insert(addr, Alloc { size, charged: 0, share: None, dev: p.dev, ctx: ch, kind: Kind::PoolImport(pool as usize), id: mem::next_buffer_id(), dirty: AtomicBool::new(false) });
        let h = pool as usize;
        mem::set_on_release(addr, Box::new(move |_| released(h, size)));
        p.st.lock().unwrap_or_else(|e| e.into_inner()).used += size;
        write(ptr_out, addr)
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
