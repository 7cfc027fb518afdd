//! Virtual memory management: physical handles (cuMemCreate), address reservations, mappings,
//! access, and handles shared with other processes as POSIX file descriptors.
//!
//! cuMemCreate charges the physical handle; mapping charges nothing more; the memory goes back
//! when the handle is released and no longer mapped.

use crate::mem::{
    charge, contiguous_range, location_device, open_share, ref_share, table, uncharge, unref_share,
    va_arena, Alloc, Kind, GRANULARITY,
};
use crate::{ctx, drv, export, read, write, Registry};
use cuvisor_cuda_abi::cuda::*;
use std::collections::BTreeMap;
use std::ffi::{c_int, c_void};
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
    /// The exported file (a memfd naming the entry) that exports hand out duplicates of.
    export_fd: Mutex<c_int>,
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

const RECORD_LEN: usize = 96;

/// A memfd naming shared entry (i, generation) of `size` bytes on `dev`: what an exported
/// descriptor carries to whoever imports it (SCM_RIGHTS, pidfd_getfd).
fn export_file(
    dev: Option<usize>,
    size: u64,
    i: usize,
    generation: u64,
) -> Result<c_int, CUresult> {
    let record = format!(
        "cuvisor-sim-vmm {} {size} {i} {generation}\n",
        dev.map(|d| d as i64).unwrap_or(-1)
    );
    if record.len() > RECORD_LEN {
        return Err(err::UNKNOWN);
    }
    // SAFETY: memfd_create with a static NUL-terminated name; we own the returned fd.
    let fd = unsafe { libc::memfd_create(c"cuvisor-sim-vmm".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(err::UNKNOWN);
    }
    // SAFETY: fd is ours; record is a live buffer of the given length.
    if unsafe { libc::pwrite(fd, record.as_ptr() as *const c_void, record.len(), 0) }
        != record.len() as isize
    {
        // SAFETY: closing our own fd.
        unsafe { libc::close(fd) };
        return Err(err::UNKNOWN);
    }
    Ok(fd)
}

fn reservations() -> &'static Mutex<BTreeMap<u64, u64>> {
    static R: OnceLock<Mutex<BTreeMap<u64, u64>>> = OnceLock::new();
    R.get_or_init(|| Mutex::new(BTreeMap::new()))
}

export! {
    fn cuMemGetAllocationGranularity(g: *mut usize, prop: *const CUmemAllocationProp, _option: c_int) {
        drv()?;
        let p: CUmemAllocationProp = read(prop)?;
        location_device(p.location)?;
        write(g, GRANULARITY as usize)
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
        let (h, _) = phys().insert(Phys { charged_dev: dev, dev, size: size as u64, st: Mutex::new((1, 0)), share: Mutex::new(None), export_fd: Mutex::new(-1) });
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
        p.st.lock().unwrap_or_else(|e| e.into_inner()).1 += 1;
        let ch = ctx::current().map(|c| c.0).unwrap_or(0);
        t.insert(ptr, Alloc { size: size as u64, charged: 0, share: None, dev: p.dev.unwrap_or(0), ctx: ch, kind: Kind::Mapped(handle as usize), dirty: AtomicBool::new(false) });
        Ok(())
    }
    fn cuMemUnmap(ptr: CUdeviceptr, size: usize) {
        drv()?;
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
            if rec.dirty.load(Relaxed) {
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
    fn cuMemSetAccess(ptr: CUdeviceptr, size: usize, desc: *const CUmemAccessDesc, count: usize) {
        drv()?;
        if count == 0 {
            return Err(err::INVALID_VALUE);
        }
        for i in 0..count {
            let d: CUmemAccessDesc = read(desc.wrapping_add(i))?;
            location_device(d.location)?;
        }
        contiguous_range(ptr, size as u64)
    }
    fn cuMemExportToShareableHandle(out: *mut c_void, handle: CUmemGenericAllocationHandle, kind: c_int, _flags: u64) {
        drv()?;
        let p = phys().get(handle as usize)?;
        if kind != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR {
            return Err(err::NOT_SUPPORTED);
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
            *own = export_file(p.dev, p.size, i, generation)?;
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
        let mut buf = [0u8; RECORD_LEN];
        // SAFETY: reading at most buf.len() bytes into our own buffer from the caller's fd.
        let n = unsafe { libc::pread(fd, buf.as_mut_ptr() as *mut c_void, buf.len(), 0) };
        let text = std::str::from_utf8(&buf[..n.max(0) as usize]).map_err(|_| err::INVALID_VALUE)?;
        let line = text.split('\n').next().unwrap_or("");
        let mut parts = line.split(' ');
        if parts.next() != Some("cuvisor-sim-vmm") {
            return Err(err::INVALID_VALUE);
        }
        let mut num = || parts.next().and_then(|x| x.parse::<i64>().ok()).ok_or(err::INVALID_VALUE);
        let (dev, size, i, generation) = (num()?, num()?, num()?, num()?);
        // Imported memory is the exporter's: nothing new is charged, but this process holds it
        // (every handle to it gone: so is the memory, and the import fails).
        ref_share(i as usize, generation as u64)?;
        let (h, _) = phys().insert(Phys {
            charged_dev: None,
            dev: usize::try_from(dev).ok(),
            size: size as u64,
            st: Mutex::new((1, 0)),
            share: Mutex::new(Some((i as usize, generation as u64))),
            export_fd: Mutex::new(-1),
        });
        write(handle, h as u64)
    }
}
