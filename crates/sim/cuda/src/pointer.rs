//! Page-locked host memory and what a pointer is (cuda.h 13.5, "Memory Management" host
//! functions and "Unified Addressing"): cuMemAllocHost / cuMemHostAlloc / cuMemFreeHost,
//! cuMemHostRegister / cuMemHostUnregister, cuMemHostGetFlags, cuMemHostGetDevicePointer,
//! cuMemGetAddressRange, cuPointerGetAttribute(s) and cuPointerSetAttribute.
//!
//! Device allocations are the memory chapter's (`mem::find` tells what holds an address); host
//! memory the driver page-locked (allocated or registered) is tracked here with its flags and the
//! context it was made in. The simulated GPUs use unified addressing and answer 1 for
//! CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM, so a page-locked host range's
//! device address is its host address ("If all devices visible to the application have a
//! non-zero value for the device attribute, the device pointer returned by
//! cuMemHostGetDevicePointer() will match the original pointer", cuda.h).

use crate::mem::{self, Class};
use crate::{ctx, device, drv, export, read, write, Res};
use cuvisor_cuda_abi::cuda::*;
use std::collections::{BTreeMap, HashSet};
use std::ffi::{c_int, c_uint, c_void};
use std::sync::{Mutex, OnceLock};

// `cudaError_enum` (cuda.h 13.5).
const HOST_MEMORY_ALREADY_REGISTERED: CUresult = 712;
const HOST_MEMORY_NOT_REGISTERED: CUresult = 713;

/// CU_MEMHOSTALLOC_PORTABLE | DEVICEMAP | WRITECOMBINED (cuda.h).
const MEMHOSTALLOC_FLAGS: c_uint = 0x7;
/// CU_MEMHOSTREGISTER_PORTABLE | DEVICEMAP | IOMEMORY | READ_ONLY (cuda.h).
const MEMHOSTREGISTER_FLAGS: c_uint = 0xf;
const MEMHOSTREGISTER_READ_ONLY: c_uint = 0x8;
/// CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED.
const ATTR_READ_ONLY_HOST_REGISTER_SUPPORTED: i32 = 113;

// `CUpointer_attribute` (cuda.h 13.5), those the ABI crate does not name.
const HOST_POINTER: c_int = 4;
const P2P_TOKENS: c_int = 5;
const SYNC_MEMOPS: c_int = 6;
const BUFFER_ID: c_int = 7;
const IS_LEGACY_CUDA_IPC_CAPABLE: c_int = 10;
const MAPPED: c_int = 13;
const ALLOWED_HANDLE_TYPES: c_int = 14;
const IS_GPU_DIRECT_RDMA_CAPABLE: c_int = 15;
const ACCESS_FLAGS: c_int = 16;
const MAPPING_SIZE: c_int = 18;
const MAPPING_BASE_ADDR: c_int = 19;
const MEMORY_BLOCK_ID: c_int = 20;
const IS_HW_DECOMPRESS_CAPABLE: c_int = 21;
const LOCALITY_DOMAIN_ORDINAL: c_int = 22;

/// `CUmemAccess_flags`: CU_MEM_ACCESS_FLAGS_PROT_NONE 0, _READWRITE 3.
const PROT_READWRITE: c_uint = 3;

/// A page-locked host range.
struct Host {
    size: usize,
    flags: c_uint,
    /// cuMemHostRegister'ed (the program's memory) rather than allocated by the driver.
    registered: bool,
    ctx: usize,
    dev: usize,
    id: u64,
}

fn hosts() -> &'static Mutex<BTreeMap<usize, Host>> {
    static H: OnceLock<Mutex<BTreeMap<usize, Host>>> = OnceLock::new();
    H.get_or_init(|| Mutex::new(BTreeMap::new()))
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The page-locked range holding `p`: its base and what it is.
fn host_at(p: usize) -> Option<(usize, usize, c_uint, bool, usize, usize, u64)> {
    let h = lock(hosts());
    let (b, r) = h.range(..=p).next_back()?;
    (p < b.saturating_add(r.size.max(1))).then_some((
        *b,
        r.size,
        r.flags,
        r.registered,
        r.ctx,
        r.dev,
        r.id,
    ))
}

/// Whether host address `p` is page-locked: memory of cuMemAllocHost / cuMemHostAlloc, or
/// registered with cuMemHostRegister (what copies time as pinned: `copy_engine`).
pub(crate) fn pinned(p: u64) -> bool {
    host_at(p as usize).is_some()
}

/// Allocations whose SYNC_MEMOPS is set, by buffer id (ids are never reused).
fn sync_memops() -> &'static Mutex<HashSet<u64>> {
    static S: OnceLock<Mutex<HashSet<u64>>> = OnceLock::new();
    S.get_or_init(|| Mutex::new(HashSet::new()))
}

/// cuMemAllocHost / cuMemHostAlloc: page-locked memory of the current context; flags other than
/// CU_MEMHOSTALLOC_* are CUDA_ERROR_INVALID_VALUE.
fn host_alloc(pp: *mut *mut c_void, size: usize, flags: c_uint) -> Res {
    let (ch, c) = ctx::current()?;
    if pp.is_null() || flags & !MEMHOSTALLOC_FLAGS != 0 {
        return Err(err::INVALID_VALUE);
    }
    // SAFETY: plain malloc of the requested size; ownership is tracked in `hosts`.
    let p = unsafe { libc::malloc(size.max(1)) };
    if p.is_null() {
        return Err(err::OUT_OF_MEMORY);
    }
    lock(hosts()).insert(
        p as usize,
        Host {
            size,
            flags,
            registered: false,
            ctx: ch,
            dev: c.dev,
            id: mem::next_buffer_id(),
        },
    );
    write(pp, p)
}

fn free_host(p: *mut c_void) -> Res {
    drv()?;
    let mut h = lock(hosts());
    match h.get(&(p as usize)) {
        Some(r) if !r.registered => {}
        _ => return Err(err::INVALID_VALUE),
    }
    h.remove(&(p as usize));
    // SAFETY: p came from malloc in host_alloc and was still tracked.
    unsafe { libc::free(p) };
    Ok(())
}

/// cuMemHostRegister (cuda.h): NULL or an empty range is INVALID_VALUE, unknown flags too;
/// READ_ONLY on a device without CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED is
/// NOT_SUPPORTED; a range overlapping page-locked memory is HOST_MEMORY_ALREADY_REGISTERED.
fn register(p: *mut c_void, size: usize, flags: c_uint) -> Res {
    let (ch, c) = ctx::current()?;
    if p.is_null() || size == 0 || flags & !MEMHOSTREGISTER_FLAGS != 0 {
        return Err(err::INVALID_VALUE);
    }
    if flags & MEMHOSTREGISTER_READ_ONLY != 0
        && device::attribute(
            &drv()?.sim.model,
            c.dev,
            ATTR_READ_ONLY_HOST_REGISTER_SUPPORTED,
        )
        .unwrap_or(0)
            == 0
    {
        return Err(err::NOT_SUPPORTED);
    }
    let (start, end) = (p as usize, (p as usize).saturating_add(size));
    let mut h = lock(hosts());
    let overlaps = h
        .range(..end)
        .next_back()
        .is_some_and(|(b, r)| b.saturating_add(r.size.max(1)) > start);
    if overlaps {
        return Err(HOST_MEMORY_ALREADY_REGISTERED);
    }
    h.insert(
        start,
        Host {
            size,
            flags,
            registered: true,
            ctx: ch,
            dev: c.dev,
            id: mem::next_buffer_id(),
        },
    );
    Ok(())
}

/// cuMemHostUnregister: `p` must be the base of a registered range, else
/// CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED (cuda.h).
fn unregister(p: *mut c_void) -> Res {
    ctx::current()?;
    if p.is_null() {
        return Err(err::INVALID_VALUE);
    }
    let mut h = lock(hosts());
    match h.get(&(p as usize)) {
        Some(r) if r.registered => {
            h.remove(&(p as usize));
            Ok(())
        }
        _ => Err(HOST_MEMORY_NOT_REGISTERED),
    }
}

/// What holds an address: a device allocation or page-locked host memory.
enum Held {
    Dev(mem::Found),
    Host {
        base: usize,
        size: usize,
        ctx: usize,
        dev: usize,
        id: u64,
    },
}

fn held(ptr: CUdeviceptr) -> Option<Held> {
    if let Some(f) = mem::find(ptr) {
        return Some(Held::Dev(f));
    }
    let (base, size, _, _, ctx, dev, id) = host_at(ptr as usize)?;
    Some(Held::Host {
        base,
        size,
        ctx,
        dev,
        id,
    })
}

/// The value one attribute has for the memory at `ptr`, written at `data`.
fn attribute(data: *mut c_void, attr: c_int, ptr: CUdeviceptr) -> Res {
    drv()?;
    if !(1..=LOCALITY_DOMAIN_ORDINAL).contains(&attr) {
        return Err(err::INVALID_VALUE);
    }
    // "If there is no current CUcontext then CUDA_ERROR_INVALID_CONTEXT is returned"
    // (DEVICE_POINTER); ACCESS_FLAGS is relative to the current context's device.
    let current = ctx::current();
    if matches!(attr, CU_POINTER_ATTRIBUTE_DEVICE_POINTER | ACCESS_FLAGS) {
        current.clone()?;
    }
    let h = held(ptr).ok_or(err::INVALID_VALUE)?;
    let (base, size, ctx_h, dev, id) = match &h {
        Held::Dev(f) => (f.base, f.size, f.ctx, f.dev, f.id),
        Held::Host {
            base,
            size,
            ctx,
            dev,
            id,
        } => (*base as u64, *size as u64, *ctx, *dev, *id),
    };
    let class = match &h {
        Held::Dev(f) => Some(f.class),
        Held::Host { .. } => None,
    };
    let w_u32 = |v: c_uint| write(data as *mut c_uint, v);
    let w_u64 = |v: u64| write(data as *mut u64, v);
    match attr {
        CU_POINTER_ATTRIBUTE_CONTEXT => write(data as *mut CUcontext, ctx_h as CUcontext),
        CU_POINTER_ATTRIBUTE_MEMORY_TYPE => w_u32(match class {
            None => CU_MEMORYTYPE_HOST,
            Some(_) => CU_MEMORYTYPE_DEVICE,
        }),
        // Unified addressing: the same address on the device (see the module comment).
        CU_POINTER_ATTRIBUTE_DEVICE_POINTER => w_u64(ptr),
        // "If there exists no host pointer value through which the host program may directly
        // access ptr then CUDA_ERROR_INVALID_VALUE is returned": device memory has none; managed
        // and page-locked host memory are the same address.
        HOST_POINTER => match class {
            None | Some(Class::Managed) => write(data as *mut *mut c_void, ptr as *mut c_void),
            Some(_) => Err(err::INVALID_VALUE),
        },
        // "ptr must be a pointer to memory obtained from :cuMemAlloc()"; the query sets
        // SYNC_MEMOPS. The tokens: the simulator's own (buffer id, process id).
        P2P_TOKENS => match class {
            Some(Class::Device) => {
                lock(sync_memops()).insert(id);
                write(data as *mut [u64; 2], [id, std::process::id() as u64])
            }
            _ => Err(err::INVALID_VALUE),
        },
        SYNC_MEMOPS => write(
            data as *mut c_int,
            lock(sync_memops()).contains(&id) as c_int,
        ),
        BUFFER_ID => w_u64(id),
        CU_POINTER_ATTRIBUTE_IS_MANAGED => {
            write(data as *mut c_int, (class == Some(Class::Managed)) as c_int)
        }
        CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL => write(data as *mut c_int, dev as c_int),
        // cudaIpcGetMemHandle takes cuMemAlloc'ed memory only.
        IS_LEGACY_CUDA_IPC_CAPABLE => {
            write(data as *mut c_int, (class == Some(Class::Device)) as c_int)
        }
        CU_POINTER_ATTRIBUTE_RANGE_START_ADDR => w_u64(base),
        CU_POINTER_ATTRIBUTE_RANGE_SIZE => write(data as *mut usize, size as usize),
        MAPPED => write(data as *mut c_int, 1),
        // Only VMM allocations can be exported (cuMemExportToShareableHandle); what handle types
        // a physical allocation allows is the VMM chapter's, which does not keep it: 0 here.
        ALLOWED_HANDLE_TYPES => w_u64(0),
        // GPUDirect RDMA works on device memory of GPUs with CU_DEVICE_ATTRIBUTE_
        // GPU_DIRECT_RDMA_SUPPORTED (every simulated GPU); not on managed or host memory.
        IS_GPU_DIRECT_RDMA_CAPABLE => write(
            data as *mut c_int,
            matches!(
                class,
                Some(Class::Device | Class::Pool(_) | Class::Mapped(_))
            ) as c_int,
        ),
        // The current context's device's access: read-write to its own memory, to host and
        // managed memory, and to a peer's where that context enabled access; none otherwise.
        ACCESS_FLAGS => {
            let (_, c) = current?;
            let own = class.is_none() || class == Some(Class::Managed) || c.dev == dev;
            let peer = ctx::get(ctx_h as CUcontext).is_ok_and(|p| crate::peer::enabled(c.id, p.id));
            w_u32(if own || peer { PROT_READWRITE } else { 0 })
        }
        CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE => write(
            data as *mut CUmemoryPool,
            match class {
                Some(Class::Pool(p)) => p as CUmemoryPool,
                _ => std::ptr::null_mut(),
            },
        ),
        MAPPING_SIZE => write(data as *mut usize, size as usize),
        MAPPING_BASE_ADDR => w_u64(base),
        MEMORY_BLOCK_ID => w_u64(id),
        // Hardware decompression (Blackwell) needs an allocation made for it; none is here.
        IS_HW_DECOMPRESS_CAPABLE => write(data as *mut c_int, 0),
        // "-1 if the allocation is not localized to a locality domain" (CUDA 13.x; UNVERIFIED
        // what else a real driver answers on the GPUs simulated).
        LOCALITY_DOMAIN_ORDINAL => write(data as *mut c_int, -1),
        _ => Err(err::INVALID_VALUE),
    }
}

/// Bytes the default value of an attribute takes (cuPointerGetAttributes writes "default NULL
/// values" for a pointer it does not know).
fn default_size(attr: c_int) -> usize {
    match attr {
        CU_POINTER_ATTRIBUTE_CONTEXT
        | CU_POINTER_ATTRIBUTE_DEVICE_POINTER
        | HOST_POINTER
        | BUFFER_ID
        | CU_POINTER_ATTRIBUTE_RANGE_START_ADDR
        | CU_POINTER_ATTRIBUTE_RANGE_SIZE
        | ALLOWED_HANDLE_TYPES
        | CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE
        | MAPPING_SIZE
        | MAPPING_BASE_ADDR
        | MEMORY_BLOCK_ID => 8,
        P2P_TOKENS => 16,
        _ => 4,
    }
}

/// cuPointerSetAttribute: only CU_POINTER_ATTRIBUTE_SYNC_MEMOPS can be set ("value will be
/// considered as a pointer to an unsigned integer"), on memory a CUDA allocation API made;
/// anything else is CUDA_ERROR_INVALID_VALUE.
fn set_attribute(value: *const c_void, attr: c_int, ptr: CUdeviceptr) -> Res {
    drv()?;
    if attr != SYNC_MEMOPS {
        return Err(err::INVALID_VALUE);
    }
    let v = read(value as *const c_uint)?;
    let id = match held(ptr).ok_or(err::INVALID_VALUE)? {
        Held::Dev(f) => f.id,
        Held::Host { id, .. } => id,
    };
    let mut s = lock(sync_memops());
    if v != 0 {
        s.insert(id);
    } else {
        s.remove(&id);
    }
    Ok(())
}

export! {
    fn cuMemAllocHost_v2(pp: *mut *mut c_void, size: usize) { host_alloc(pp, size, 0) }
    fn cuMemHostAlloc(pp: *mut *mut c_void, size: usize, flags: c_uint) { host_alloc(pp, size, flags) }
    /// Memory cuMemAllocHost / cuMemHostAlloc did not return is CUDA_ERROR_INVALID_VALUE.
    fn cuMemFreeHost(p: *mut c_void) { free_host(p) }
    fn cuMemHostRegister_v2(p: *mut c_void, size: usize, flags: c_uint) { register(p, size, flags) }
    /// The CUDA 4.0 entry point (cudaTypedefs.h PFN_cuMemHostRegister_v4000): the same call.
    fn cuMemHostRegister(p: *mut c_void, size: usize, flags: c_uint) { register(p, size, flags) }
    fn cuMemHostUnregister(p: *mut c_void) { unregister(p) }

    /// "Passes back the flags pFlags that were specified when allocating the pinned host buffer
    /// p allocated by cuMemHostAlloc" (cuda.h); memory it did not allocate (registered memory
    /// included) is CUDA_ERROR_INVALID_VALUE. cuMemAllocHost's memory answers 0, the flags it
    /// was made with (UNVERIFIED whether a real driver adds the bits unified addressing implies).
    fn cuMemHostGetFlags(pflags: *mut c_uint, p: *mut c_void) {
        ctx::current()?;
        match host_at(p as usize) {
            Some((_, _, flags, false, ..)) => write(pflags, flags),
            _ => Err(err::INVALID_VALUE),
        }
    }

    /// Flags "must be set to 0"; `p` must be page-locked memory (allocated or registered), whose
    /// device address is its own (see the module comment); anything else is INVALID_VALUE.
    fn cuMemHostGetDevicePointer_v2(dptr: *mut CUdeviceptr, p: *mut c_void, flags: c_uint) {
        ctx::current()?;
        if flags != 0 || dptr.is_null() || host_at(p as usize).is_none() {
            return Err(err::INVALID_VALUE);
        }
        write(dptr, p as CUdeviceptr)
    }

    /// The device allocation holding `dptr`: base and size, each optional ("If one of them is
    /// NULL, it is ignored"); CUDA_ERROR_NOT_FOUND where no allocation holds it (cuda.h).
    fn cuMemGetAddressRange_v2(base: *mut CUdeviceptr, size: *mut usize, dptr: CUdeviceptr) {
        drv()?;
        let f = mem::find(dptr).ok_or(err::NOT_FOUND)?;
        if !base.is_null() {
            write(base, f.base)?;
        }
        if !size.is_null() {
            write(size, f.size as usize)?;
        }
        Ok(())
    }

    fn cuPointerGetAttribute(data: *mut c_void, attribute_: c_int, ptr: CUdeviceptr) {
        if data.is_null() {
            drv()?;
            return Err(err::INVALID_VALUE);
        }
        attribute(data, attribute_, ptr)
    }

    /// Each attribute as cuPointerGetAttribute answers it. "Unlike cuPointerGetAttribute, this
    /// function will not return an error when the ptr encountered is not a valid CUDA pointer.
    /// Instead, the attributes are assigned default NULL values and CUDA_SUCCESS is returned"
    /// (cuda.h): so are the ones a known pointer has no value for (HOST_POINTER of device memory).
    fn cuPointerGetAttributes(n: c_uint, attributes: *const c_int, data: *mut *mut c_void, ptr: CUdeviceptr) {
        drv()?;
        if n > 0 && (attributes.is_null() || data.is_null()) {
            return Err(err::INVALID_VALUE);
        }
        for i in 0..n as usize {
            let a = read(attributes.wrapping_add(i))?;
            let d = read(data.wrapping_add(i) as *const *mut c_void)?;
            if !(1..=LOCALITY_DOMAIN_ORDINAL).contains(&a) || d.is_null() {
                return Err(err::INVALID_VALUE);
            }
            if attribute(d, a, ptr).is_err() {
                // SAFETY: `d` is the caller's output for attribute `a`, of the attribute's size.
                unsafe { std::ptr::write_bytes(d as *mut u8, 0, default_size(a)) };
            }
        }
        Ok(())
    }

    fn cuPointerSetAttribute(value: *const c_void, attribute_: c_int, ptr: CUdeviceptr) {
        set_attribute(value, attribute_, ptr)
    }
}
