//! Virtual memory management: physical handles (cuMemCreate), address reservations, mappings,
//! access, and handles shared with other processes as POSIX file descriptors.
//!
//! cuMemCreate charges the physical handle; mapping charges nothing more; the memory goes back
//! when the handle is released and no longer mapped.

use crate::mem::{
    charge, contiguous_range, location_device, open_share, ref_share, table, uncharge, unref_share,
    va_arena, Alloc, Kind, GRANULARITY,
};
use crate::{ctx, drv, export, export_record, read, write, Registry, Res};
use cuvisor_cuda_abi::cuda::*;
use std::collections::{BTreeMap, HashMap};
use std::ffi::{c_int, c_uint, c_void};
use std::sync::atomic::{AtomicBool, Ordering::*};
use std::sync::{Mutex, OnceLock};

// ---- VMM ----------------------------------------------------------------------------------------

struct Phys {
    /// The device charged, if the memory is device memory we created (not an import).
    charged_dev: Option<usize>,
    dev: Option<usize>,
    size: u64,
    /// (handles of this process still to be released, mappings): the handle cuMemCreate or an
    /// import gave, and each cuMemRetainAllocationHandle of it.
    st: Mutex<(u32, u32)>,
    /// Once the memory was exported (and for every import of it): its shared-memory entry
    /// (index, generation), which holds the charge instead of this process.
    share: Mutex<Option<(usize, u64)>>,
    /// The handle's file once exported (and for every import): a memfd holding its bytes,
    /// followed by the export record (`export_record`). Every mapping of the handle, in this
    /// process or another, maps it, so all see the same bytes; exports hand out duplicates.
    export_fd: Mutex<c_int>,
    /// The CUmemAllocationProp it was made with (cuMemGetAllocationPropertiesFromHandle), less
    /// the Win32 metadata pointer: (type, requested handle types, location, allocFlags).
    prop: (c_int, c_int, CUmemLocation, [u8; 8]),
}

/// Taken first by whatever changes what a mapping maps (cuMemMap, cuMemUnmap, the first
/// export remapping a handle's mappings onto its file), so that those never interleave.
fn mapping_lock() -> std::sync::MutexGuard<'static, ()> {
    static L: Mutex<()> = Mutex::new(());
    L.lock().unwrap_or_else(|e| e.into_inner())
}

/// Where each mapping of a handle starts in it (cuMemMap's offset), by mapped address.
fn map_offsets() -> &'static Mutex<BTreeMap<u64, u64>> {
    static R: OnceLock<Mutex<BTreeMap<u64, u64>>> = OnceLock::new();
    R.get_or_init(|| Mutex::new(BTreeMap::new()))
}

/// Access granted with cuMemSetAccess, by mapped address: device -> CUmemAccess_flags.
fn access() -> &'static Mutex<BTreeMap<u64, HashMap<usize, c_int>>> {
    static R: OnceLock<Mutex<BTreeMap<u64, HashMap<usize, c_int>>>> = OnceLock::new();
    R.get_or_init(|| Mutex::new(BTreeMap::new()))
}

/// Maps `size` bytes of file `fd` from `offset` at `addr` (inside the VA arena), shared.
fn map_file(addr: u64, size: u64, fd: c_int, offset: u64) -> Res {
    if va_arena()?.map_file_over(addr, size, fd, offset) {
        Ok(())
    } else {
        Err(err::OUT_OF_MEMORY)
    }
}

/// Gives [addr, addr + size) back to the VA arena's anonymous reservation (after an unmap).
fn unmap_file(addr: u64, size: u64) {
    if let Ok(a) = va_arena() {
        a.unmap_file(addr, size);
    }
}

fn phys() -> &'static Registry<Phys> {
    static R: OnceLock<Registry<Phys>> = OnceLock::new();
    R.get_or_init(Registry::new)
}

/// Physical memory is reference counted by its handles and their mappings, as the driver API
/// documents for cuMemRelease: "The memory allocation will be freed when all outstanding
/// mappings to the memory are unmapped and when all outstanding references to the handle
/// (including it's shareable counterparts) are also released. [...] Each time a recipient
/// process imports a shareable handle, it needs to pair it with cuMemRelease for the handle to
/// be freed." (CUDA Driver API, Virtual Memory Management, cuMemRelease; also
/// https://nvidia.github.io/cuda-python/ cuda.bindings.driver.cuMemRelease). A handle of this
/// process goes when it is released and unmapped; shared memory goes when the last process
/// holding it lets go (or dies), whichever process created it.
fn phys_drop_if_unused(h: usize, p: &Phys) {
    let (refs, maps) = *p.st.lock().unwrap_or_else(|e| e.into_inner());
    if !(refs == 0 && maps == 0 && phys().remove(h).is_ok()) {
        return;
    }
    let fd = std::mem::replace(
        &mut *p.export_fd.lock().unwrap_or_else(|e| e.into_inner()),
        -1,
    );
    if fd >= 0 {
        // SAFETY: closing our own copy of the exported file (importers hold their own).
        unsafe { libc::close(fd) };
    }
    match (
        *p.share.lock().unwrap_or_else(|e| e.into_inner()),
        p.charged_dev,
    ) {
        (Some((i, _)), _) => unref_share(i),
        (None, Some(dev)) => uncharge(dev, p.size),
        (None, None) => {}
    }
}

/// A memfd for handle `p` naming shared entry (i, generation): its bytes, then the record an
/// importer reads (SCM_RIGHTS and pidfd_getfd carry it). The bytes this process already wrote
/// through its mappings of the handle move into it, and those mappings now map it.
fn export_file(h: usize, p: &Phys, i: usize, generation: u64) -> Result<c_int, CUresult> {
    // SAFETY: memfd_create with a static NUL-terminated name; we own the returned fd.
    let fd = unsafe { libc::memfd_create(c"cuvisor-sim-vmm".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(err::UNKNOWN);
    }
    let close = |e| {
        // SAFETY: closing our own fd.
        unsafe { libc::close(fd) };
        Err(e)
    };
    let dev = p.dev.map(|d| d as i64).unwrap_or(-1);
    let fields = [dev, p.size as i64, i as i64, generation as i64];
    // SAFETY: sizing our own new memfd.
    let sized = unsafe {
        libc::ftruncate(
            fd,
            (p.size + export_record::RECORD_LEN as u64) as libc::off_t,
        ) == 0
    };
    if !sized || export_record::write(fd, p.size, "cuvisor-sim-vmm", fields).is_err() {
        return close(err::UNKNOWN);
    }
    let mine: Vec<(u64, u64, bool)> = {
        let t = table().read().unwrap_or_else(|e| e.into_inner());
        t.iter()
            .filter(|(_, r)| r.kind == Kind::Mapped(h))
            .map(|(a, r)| (*a, r.size, r.dirty.load(Relaxed)))
            .collect()
    };
    let offsets = map_offsets().lock().unwrap_or_else(|e| e.into_inner());
    for (addr, size, dirty) in mine {
        let off = offsets.get(&addr).copied().unwrap_or(0);
        if dirty {
            // SAFETY: [addr, addr + size) is a live mapping of ours; writing it to our file.
            let n = unsafe {
                libc::pwrite(fd, addr as *const c_void, size as usize, off as libc::off_t)
            };
            if n != size as isize {
                return close(err::UNKNOWN);
            }
        }
        if let Err(e) = map_file(addr, size, fd, off) {
            return close(e);
        }
    }
    Ok(fd)
}

/// (device or -1, size, entry, generation) from an exported handle's descriptor.
fn read_record(fd: c_int) -> Result<(i64, u64, usize, u64), CUresult> {
    let ([dev, size, i, generation], at) = export_record::read(fd, "cuvisor-sim-vmm")?;
    if size as u64 != at || i < 0 {
        return Err(err::INVALID_VALUE);
    }
    Ok((dev, at, i as usize, generation as u64))
}

fn reservations() -> &'static Mutex<BTreeMap<u64, u64>> {
    static R: OnceLock<Mutex<BTreeMap<u64, u64>>> = OnceLock::new();
    R.get_or_init(|| Mutex::new(BTreeMap::new()))
}

export! {
    /// Both options answer 2 MiB, the simulator's VMM granularity (`GRANULARITY`, which
    /// cuMemCreate, cuMemAddressReserve and cuMemMap require; 2 MiB is the large-page size of
    /// device memory, not measured on hardware here). Any other option, or a type other than
    /// pinned: INVALID_VALUE.
    fn cuMemGetAllocationGranularity(g: *mut usize, prop: *const CUmemAllocationProp, option: c_int) {
        drv()?;
        let p: CUmemAllocationProp = read(prop)?;
        if !matches!(option, CU_MEM_ALLOC_GRANULARITY_MINIMUM | CU_MEM_ALLOC_GRANULARITY_RECOMMENDED) || p.type_ != CU_MEM_ALLOCATION_TYPE_PINNED {
            return Err(err::INVALID_VALUE);
        }
        location_device(p.location)?;
        write(g, GRANULARITY as usize)
    }
    /// The properties the handle was made with; an imported handle reports the exporter's
    /// device and the descriptor type it came through.
    fn cuMemGetAllocationPropertiesFromHandle(prop: *mut CUmemAllocationProp, handle: CUmemGenericAllocationHandle) {
        drv()?;
        let p = phys().get(handle as usize).map_err(|_| err::INVALID_VALUE)?;
        let (type_, handle_types, location, flags) = p.prop;
        write(prop, CUmemAllocationProp { type_, requestedHandleTypes: handle_types, location, win32HandleMetaData: std::ptr::null_mut(), allocFlags: flags })
    }
    fn cuMemCreate(handle: *mut CUmemGenericAllocationHandle, size: usize, prop: *const CUmemAllocationProp, flags: u64) {
        drv()?;
        let p: CUmemAllocationProp = read(prop)?;
        if handle.is_null() || flags != 0 || p.type_ != CU_MEM_ALLOCATION_TYPE_PINNED || size == 0 || !(size as u64).is_multiple_of(GRANULARITY) {
            return Err(err::INVALID_VALUE);
        }
        let dev = location_device(p.location)?;
        if let Some(d) = dev {
            charge(d, size as u64)?;
        }
        let (h, _) = phys().insert(Phys { charged_dev: dev, dev, size: size as u64, st: Mutex::new((1, 0)), share: Mutex::new(None), export_fd: Mutex::new(-1), prop: (p.type_, p.requestedHandleTypes, p.location, p.allocFlags) });
        write(handle, h as u64)
    }
    fn cuMemRelease(handle: CUmemGenericAllocationHandle) {
        drv()?;
        let p = phys().get(handle as usize)?;
        {
            let mut st = p.st.lock().unwrap_or_else(|e| e.into_inner());
            if st.0 == 0 {
                return Err(err::INVALID_VALUE);
            }
            st.0 -= 1;
        }
        phys_drop_if_unused(handle as usize, &p);
        Ok(())
    }
    /// The handle of the memory mapped at `addr`, one more reference to release: "The handle is
    /// guaranteed to be the same handle value used when mapping the memory. If the address
    /// requested is not mapped, the function will fail. The returned handle must be released
    /// with corresponding number of calls to cuMemRelease." (CUDA Driver API, Virtual Memory
    /// Management, cuMemRetainAllocationHandle.) The memory then lives until that release too.
    fn cuMemRetainAllocationHandle(handle: *mut CUmemGenericAllocationHandle, addr: *mut c_void) {
        drv()?;
        if handle.is_null() {
            return Err(err::INVALID_VALUE);
        }
        let a = addr as u64;
        let h = {
            let t = table().read().unwrap_or_else(|e| e.into_inner());
            match t.range(..=a).next_back() {
                Some((b, r)) if a < b + r.size => match r.kind {
                    Kind::Mapped(h) => h,
                    _ => return Err(err::INVALID_VALUE),
                },
                _ => return Err(err::INVALID_VALUE),
            }
        };
        let p = phys().get(h).map_err(|_| err::INVALID_VALUE)?;
        p.st.lock().unwrap_or_else(|e| e.into_inner()).0 += 1;
        write(handle, h as u64)
    }
    fn cuMemAddressReserve(ptr: *mut CUdeviceptr, size: usize, _align: usize, _addr: CUdeviceptr, flags: u64) {
        drv()?;
        if ptr.is_null() || flags != 0 || size == 0 || !(size as u64).is_multiple_of(GRANULARITY) {
            return Err(err::INVALID_VALUE);
        }
        let a = va_arena()?.alloc(size as u64).ok_or(err::OUT_OF_MEMORY)?;
        reservations().lock().unwrap_or_else(|e| e.into_inner()).insert(a, size as u64);
        write(ptr, a)
    }
    fn cuMemAddressFree(ptr: CUdeviceptr, size: usize) {
        drv()?;
        let mut r = reservations().lock().unwrap_or_else(|e| e.into_inner());
        if r.get(&ptr) != Some(&(size as u64)) {
            return Err(err::INVALID_VALUE);
        }
        r.remove(&ptr);
        va_arena()?.free(ptr, size as u64, true);
        Ok(())
    }
    fn cuMemMap(ptr: CUdeviceptr, size: usize, offset: usize, handle: CUmemGenericAllocationHandle, flags: u64) {
        drv()?;
        let _order = mapping_lock();
        let p = phys().get(handle as usize).map_err(|_| err::INVALID_VALUE)?;
        if flags != 0 || size == 0 || offset as u64 + size as u64 > p.size || !(size as u64).is_multiple_of(GRANULARITY) {
            return Err(err::INVALID_VALUE);
        }
        let inside = {
            let r = reservations().lock().unwrap_or_else(|e| e.into_inner());
            r.range(..=ptr).next_back().is_some_and(|(b, s)| ptr + size as u64 <= b + s)
        };
        if !inside {
            return Err(err::INVALID_VALUE);
        }
        let mut t = table().write().unwrap_or_else(|e| e.into_inner());
        let overlaps = t.range(..ptr + size as u64).next_back().is_some_and(|(b, r)| b + r.size > ptr);
        if overlaps {
            return Err(err::INVALID_VALUE);
        }
        let fd = *p.export_fd.lock().unwrap_or_else(|e| e.into_inner());
        if fd >= 0 {
            map_file(ptr, size as u64, fd, offset as u64)?;
        }
        map_offsets().lock().unwrap_or_else(|e| e.into_inner()).insert(ptr, offset as u64);
        p.st.lock().unwrap_or_else(|e| e.into_inner()).1 += 1;
        let ch = ctx::current().map(|c| c.0).unwrap_or(0);
        t.insert(ptr, Alloc { size: size as u64, charged: 0, share: None, id: crate::mem::next_buffer_id(), dev: p.dev.unwrap_or(0), ctx: ch, kind: Kind::Mapped(handle as usize), dirty: AtomicBool::new(false) });
        Ok(())
    }
    /// No array of the simulator is sparse (CU_DEVICE_ATTRIBUTE_SPARSE_CUDA_ARRAY_SUPPORTED
    /// reads 0), so there is no tile to map: INVALID_VALUE for any list, as the driver answers
    /// for an array made without CUDA_ARRAY3D_SPARSE; an empty or NULL list too.
    fn cuMemMapArrayAsync(_list: *mut c_void, _count: c_uint, s: CUstream) {
        drv()?;
        crate::stream::stream(s, false)?;
        Err(err::INVALID_VALUE)
    }
    fn cuMemMapArrayAsync_ptsz(_list: *mut c_void, _count: c_uint, s: CUstream) {
        drv()?;
        crate::stream::stream(s, true)?;
        Err(err::INVALID_VALUE)
    }
    fn cuMemUnmap(ptr: CUdeviceptr, size: usize) {
        drv()?;
        let _order = mapping_lock();
        let end = ptr.checked_add(size as u64).ok_or(err::INVALID_VALUE)?;
        let gone: Vec<(u64, Alloc)> = {
            let mut t = table().write().unwrap_or_else(|e| e.into_inner());
            let keys: Vec<u64> = t.range(ptr..end).filter(|(_, r)| matches!(r.kind, Kind::Mapped(_))).map(|(k, _)| *k).collect();
            if keys.is_empty() {
                return Err(err::INVALID_VALUE);
            }
            keys.into_iter().filter_map(|k| t.remove(&k).map(|r| (k, r))).collect()
        };
        for (addr, rec) in gone {
            map_offsets().lock().unwrap_or_else(|e| e.into_inner()).remove(&addr);
            access().lock().unwrap_or_else(|e| e.into_inner()).remove(&addr);
            let shared = match rec.kind {
                Kind::Mapped(h) => phys().get(h).is_ok_and(|p| *p.export_fd.lock().unwrap_or_else(|e| e.into_inner()) >= 0),
                _ => false,
            };
            if shared {
                unmap_file(addr, rec.size);
            } else if rec.dirty.load(Relaxed) {
                // SAFETY: the range is inside our VA arena mapping and no longer mapped for the client.
                unsafe { libc::madvise(addr as *mut c_void, rec.size as usize, libc::MADV_DONTNEED) };
            }
            if let Kind::Mapped(h) = rec.kind {
                if let Ok(p) = phys().get(h) {
                    p.st.lock().unwrap_or_else(|e| e.into_inner()).1 -= 1;
                    phys_drop_if_unused(h, &p);
                }
            }
        }
        Ok(())
    }
    /// Access per device, for every mapping the range covers: PROT_NONE, PROT_READ or
    /// PROT_READWRITE (CUmemAccess_flags); cuMemGetAccess reads it back.
    fn cuMemSetAccess(ptr: CUdeviceptr, size: usize, desc: *const CUmemAccessDesc, count: usize) {
        drv()?;
        if count == 0 {
            return Err(err::INVALID_VALUE);
        }
        let mut set = Vec::with_capacity(count);
        for i in 0..count {
            let d: CUmemAccessDesc = read(desc.wrapping_add(i))?;
            let dev = location_device(d.location)?;
            if !matches!(d.flags, CU_MEM_ACCESS_FLAGS_PROT_NONE | 1 | CU_MEM_ACCESS_FLAGS_PROT_READWRITE) {
                return Err(err::INVALID_VALUE);
            }
            if let Some(dev) = dev {
                set.push((dev, d.flags));
            }
        }
        contiguous_range(ptr, size as u64)?;
        let end = ptr + size as u64;
        let maps: Vec<u64> = {
            let t = table().read().unwrap_or_else(|e| e.into_inner());
            let first = t.range(..=ptr).next_back().map(|(a, _)| *a).unwrap_or(ptr);
            t.range(first..end).filter(|(_, r)| matches!(r.kind, Kind::Mapped(_))).map(|(a, _)| *a).collect()
        };
        let mut acc = access().lock().unwrap_or_else(|e| e.into_inner());
        for a in maps {
            let m = acc.entry(a).or_default();
            for &(dev, flags) in &set {
                m.insert(dev, flags);
            }
        }
        Ok(())
    }
    /// What cuMemSetAccess granted `location` on the mapping holding `ptr` (PROT_NONE until
    /// then); an address that is not mapped: INVALID_VALUE; a location that is no device:
    /// INVALID_VALUE (host access to device memory is not a VMM access right).
    fn cuMemGetAccess(flags: *mut u64, location: *const CUmemLocation, ptr: CUdeviceptr) {
        drv()?;
        let loc: CUmemLocation = read(location)?;
        let dev = location_device(loc)?.ok_or(err::INVALID_VALUE)?;
        let base = {
            let t = table().read().unwrap_or_else(|e| e.into_inner());
            match t.range(..=ptr).next_back() {
                Some((b, r)) if ptr < b + r.size && matches!(r.kind, Kind::Mapped(_)) => *b,
                _ => return Err(err::INVALID_VALUE),
            }
        };
        let f = access().lock().unwrap_or_else(|e| e.into_inner()).get(&base).and_then(|m| m.get(&dev).copied()).unwrap_or(CU_MEM_ACCESS_FLAGS_PROT_NONE);
        write(flags, f as u64)
    }
    /// A dma-buf of device memory needs CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED, which the
    /// simulated GPUs do not report (nothing to hand a dma-buf to): NOT_SUPPORTED, one of the
    /// answers cuda.h 13.5 lists. A handle type other than CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD
    /// (1): INVALID_VALUE.
    fn cuMemGetHandleForAddressRange(handle: *mut c_void, _dptr: CUdeviceptr, _size: usize, kind: c_int, _flags: u64) {
        drv()?;
        if handle.is_null() || kind != 1 {
            return Err(err::INVALID_VALUE);
        }
        Err(err::NOT_SUPPORTED)
    }
    /// A POSIX file descriptor: a memfd holding the handle's bytes, which every mapping of the
    /// handle maps from then on, here and in each importer (so they share bytes, as the real
    /// driver's do). Other handle types (Win32, fabric, which needs an IMEX channel) are not
    /// available here: NOT_SUPPORTED.
    fn cuMemExportToShareableHandle(out: *mut c_void, handle: CUmemGenericAllocationHandle, kind: c_int, _flags: u64) {
        drv()?;
        let _order = mapping_lock();
        let p = phys().get(handle as usize)?;
        if kind != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR {
            return Err(err::NOT_SUPPORTED);
        }
        if out.is_null() {
            return Err(err::INVALID_VALUE);
        }
        // The first export makes the memory shared: its charge leaves this process for an entry
        // that lives while any process holds the memory. Every export of one handle hands out a
        // duplicate of one file naming that entry.
        let mut share = p.share.lock().unwrap_or_else(|e| e.into_inner());
        let (i, generation) = match *share {
            Some(s) => s,
            None => {
                let s = open_share(p.dev.unwrap_or(0), if p.charged_dev.is_some() { p.size } else { 0 })?;
                *share = Some(s);
                s
            }
        };
        let mut own = p.export_fd.lock().unwrap_or_else(|e| e.into_inner());
        if *own < 0 {
            *own = export_file(handle as usize, &p, i, generation)?;
        }
        // SAFETY: duplicating our own open memfd; the caller owns the new descriptor.
        let fd = unsafe { libc::fcntl(*own, libc::F_DUPFD_CLOEXEC, 0) };
        if fd < 0 {
            return Err(err::UNKNOWN);
        }
        write(out as *mut c_int, fd)
    }
    fn cuMemImportFromShareableHandle(handle: *mut CUmemGenericAllocationHandle, os_handle: *mut c_void, kind: c_int) {
        drv()?;
        if kind != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR || handle.is_null() {
            return Err(err::INVALID_VALUE);
        }
        let fd = os_handle as usize as c_int;
        let (dev, size, i, generation) = read_record(fd)?;
        let dev = usize::try_from(dev).ok();
        if dev.is_some_and(|d| d >= drv().map(|x| x.sim.model.devices.len()).unwrap_or(0)) {
            return Err(err::INVALID_VALUE);
        }
        // Imported memory is the exporter's: nothing new is charged, but this process holds it
        // (every handle to it gone: so is the memory, and the import fails).
        ref_share(i, generation)?;
        // SAFETY: duplicating the caller's descriptor: the handle's mappings map our copy.
        let own = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
        if own < 0 {
            unref_share(i);
            return Err(err::OUT_OF_MEMORY);
        }
        let location = CUmemLocation { type_: if dev.is_some() { CU_MEM_LOCATION_TYPE_DEVICE } else { 2 }, id: dev.unwrap_or(0) as c_int };
        let prop = (CU_MEM_ALLOCATION_TYPE_PINNED, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, location, [0; 8]);
        let (h, _) = phys().insert(Phys {
            charged_dev: None,
            dev,
            size,
            st: Mutex::new((1, 0)),
            share: Mutex::new(Some((i, generation))),
            export_fd: Mutex::new(own),
            prop,
        });
        write(handle, h as u64)
    }
}
