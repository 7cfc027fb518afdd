//! IPC memory handles (cuIpcGetMemHandle / cuIpcOpenMemHandle / cuIpcCloseMemHandle).
//!
//! A handle names the allocation's shared-state entry (its first export moves the charge there,
//! see `mem::open_share`), so an opened handle charges nothing new and keeps the memory counted
//! while it is open anywhere.
//!
//! The bytes are shared too when the allocation is a whole number of host pages (every
//! cuMemAlloc of 4 KiB multiples, which the allocator places on a page; 2 MiB and larger on
//! 2 MiB): at the first export the allocation moves onto a file beside the state file
//! (`Shared::share_file`, removed when the entry is freed), and every opened handle maps that
//! file, so importer and exporter read and write the same memory. Smaller or odd-sized
//! allocations are opened as memory of the importer's own (not modelled: their bytes).

use crate::mem::{
    alloc_on, arena_of, free, open_share, ref_share, set_on_release, table, unref_share, Kind, PAGE,
};
use crate::{ctx, drv, export, write, Res};
use cuvisor_cuda_abi::cuda::*;
use cuvisor_sim::state::now_ns;
use std::collections::{HashMap, HashSet};
use std::ffi::{c_int, c_uint, c_void};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Mutex, OnceLock};

const IPC_MAGIC: u64 = 0x4356_4950_4331_0001;
/// cuda.h 13.5: CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 0x1 (CUipcMem_flags).
const CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS: c_uint = 1;

/// Names this process in IPC handles, machine-wide: pids repeat across pid namespaces (two
/// containers' processes are often both pid 1), so a handle carries this instead.
pub(crate) fn process_token() -> u64 {
    static T: OnceLock<u64> = OnceLock::new();
    *T.get_or_init(|| {
        let mut v = 0u64;
        // SAFETY: getrandom writes at most 8 bytes into `v`, which we own.
        let n = unsafe { libc::getrandom(&mut v as *mut u64 as *mut c_void, 8, 0) };
        if n == 8 && v != 0 {
            v
        } else {
            (std::process::id() as u64) << 32 | now_ns() & 0xffff_ffff
        }
    })
}

/// Addresses of this process whose allocation is mapped onto an entry's file (exported or
/// opened), and that must get their anonymous memory back when freed.
fn file_mapped() -> &'static Mutex<HashSet<u64>> {
    static F: OnceLock<Mutex<HashSet<u64>>> = OnceLock::new();
    F.get_or_init(|| Mutex::new(HashSet::new()))
}

/// Maps `size` bytes of `fd` at `addr` (page-aligned, inside one of our arenas), shared.
fn map_shared(addr: u64, size: u64, fd: c_int) -> bool {
    arena_of(addr).is_some_and(|a| a.map_file_over(addr, size, fd, 0))
}

/// Puts an exported allocation's bytes into the file of entry (i, generation) and maps it
/// there instead. False (nothing changed) where that cannot be done.
fn share_bytes(addr: u64, size: u64, dirty: bool, i: usize, generation: u64) -> bool {
    let Ok(d) = drv() else { return false };
    if !addr.is_multiple_of(PAGE) || !size.is_multiple_of(PAGE) {
        return false;
    }
    let Ok(file) = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(d.sim.shared.share_file(i, generation))
    else {
        return false;
    };
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::io::AsRawFd;
    // Every uid shares the simulated GPU (as the state file does).
    let _ = file.set_permissions(std::fs::Permissions::from_mode(0o666));
    let fd = file.as_raw_fd();
    // SAFETY: sizing our own new file; copying a live allocation of ours into it.
    let ok = unsafe {
        libc::ftruncate(fd, size as libc::off_t) == 0
            && (!dirty
                || libc::pwrite(fd, addr as *const c_void, size as usize, 0) == size as isize)
    };
    if !(ok && map_shared(addr, size, fd)) {
        let _ = std::fs::remove_file(d.sim.shared.share_file(i, generation));
        return false;
    }
    file_mapped()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(addr);
    set_on_release(addr, Box::new(move |a| unmap_bytes(a, size)));
    true
}

/// An allocation mapping an entry's file is being freed (its `on_release`): the range gets the
/// arena's anonymous memory back before the address is handed out again.
fn unmap_bytes(addr: u64, size: u64) {
    if !file_mapped()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .remove(&addr)
    {
        return;
    }
    if let Some(a) = arena_of(addr) {
        a.unmap_file(addr, size);
    }
}

/// Opened IPC handles of this process: (entry, generation, context) -> (pointer, references).
type Opened = HashMap<(usize, u64, usize), (u64, u32)>;

fn ipc_opened() -> &'static Mutex<Opened> {
    static O: OnceLock<Mutex<Opened>> = OnceLock::new();
    O.get_or_init(|| Mutex::new(HashMap::new()))
}

/// cuIpcOpenMemHandle: "If the memory handle has already been opened by the current context,
/// the reference count on the handle is incremented by 1 and the existing device pointer is
/// returned." The opened memory is the exporter's allocation and charges nothing new; it lives
/// while it is open here, even after the exporter freed it (documented as undefined behaviour:
/// "Calling cuMemFree on an exported memory region before calling cuIpcCloseMemHandle in the
/// importing context will result in undefined behavior") or exited (undocumented; on NVIDIA
/// the memory is reported released at the importer's cuIpcCloseMemHandle, ROCm/hip#3580).
fn ipc_open(pdptr: *mut CUdeviceptr, handle: CUipcMemHandle, flags: c_uint) -> Res {
    let (ch, _) = ctx::current()?;
    if flags & !CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS != 0 {
        return Err(err::INVALID_VALUE);
    }
    let word = |i: usize| {
        u64::from_le_bytes(
            handle.reserved[i * 8..i * 8 + 8]
                .try_into()
                .unwrap_or_default(),
        )
    };
    if word(0) != IPC_MAGIC || pdptr.is_null() {
        return Err(err::INVALID_VALUE);
    }
    if word(1) == process_token() {
        // A process cannot open its own IPC handle: the real driver answers "invalid device
        // context" (CUDA_ERROR_INVALID_CONTEXT), as UCX's same-process test saw
        // (openucx/ucx#11603: "cuIpcOpenMemHandle() failed: invalid device context").
        return Err(err::INVALID_CONTEXT);
    }
    let dev = word(2) as usize;
    if dev >= drv()?.sim.model.devices.len() {
        return Err(err::INVALID_VALUE);
    }
    let (i, generation) = (word(5) as usize, word(6));
    let mut opened = ipc_opened().lock().unwrap_or_else(|e| e.into_inner());
    if let Some((a, n)) = opened.get_mut(&(i, generation, ch)) {
        *n += 1;
        return write(pdptr, *a);
    }
    ref_share(i, generation)?; // the allocation is gone (freed, and nobody else holds it)
    let a = match alloc_on(dev, ch, word(3), Kind::Ipc, Some(0)) {
        Ok(a) => a,
        Err(e) => {
            unref_share(i);
            return Err(e);
        }
    };
    if word(7) == 1 {
        // The exporter's bytes: its allocation lives in the entry's file.
        let path = drv()?.sim.shared.share_file(i, generation);
        let mapped = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .is_ok_and(|f| {
                use std::os::unix::io::AsRawFd;
                map_shared(a, word(3), f.as_raw_fd())
            });
        if mapped {
            file_mapped()
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(a);
            let size = word(3);
            set_on_release(a, Box::new(move |x| unmap_bytes(x, size)));
        }
    }
    if let Some(r) = table()
        .write()
        .unwrap_or_else(|e| e.into_inner())
        .get_mut(&a)
    {
        r.share = Some((i, generation));
    }
    opened.insert((i, generation, ch), (a, 1));
    write(pdptr, a)
}

/// cuIpcCloseMemHandle: "Decrements the reference count of the memory returned by
/// cuIpcOpenMemHandle by 1. When the reference count reaches 0, this API unmaps the memory."
fn ipc_close(dptr: CUdeviceptr) -> Res {
    drv()?;
    let mut opened = ipc_opened().lock().unwrap_or_else(|e| e.into_inner());
    let Some((k, (_, n))) = opened.iter_mut().find(|(_, (a, _))| *a == dptr) else {
        return Err(err::INVALID_VALUE);
    };
    *n -= 1;
    if *n > 0 {
        return Ok(());
    }
    let k = *k;
    opened.remove(&k);
    drop(opened);
    free(dptr, |k| k == Kind::Ipc)
}

export! {
    /// The first export makes the allocation shared: its charge leaves this process for an
    /// entry that the allocation and every opened handle to it hold (see `ipc_open`).
    fn cuIpcGetMemHandle(handle: *mut CUipcMemHandle, dptr: CUdeviceptr) {
        drv()?;
        let mut t = table().write().unwrap_or_else(|e| e.into_inner());
        let r = t.get_mut(&dptr).filter(|r| matches!(r.kind, Kind::Device | Kind::V1)).ok_or(err::INVALID_VALUE)?;
        let (i, generation) = match r.share {
            Some(s) => s,
            None => {
                let s = open_share(r.dev, r.charged)?;
                r.charged = 0;
                r.share = Some(s);
                share_bytes(dptr, r.size, r.dirty.load(Relaxed), s.0, s.1);
                s
            }
        };
        let by_file = file_mapped().lock().unwrap_or_else(|e| e.into_inner()).contains(&dptr) as u64;
        let mut h = CUipcMemHandle { reserved: [0; 64] };
        let words = [IPC_MAGIC, process_token(), r.dev as u64, r.size, dptr, i as u64, generation, by_file];
        for (k, v) in words.iter().enumerate() {
            h.reserved[k * 8..k * 8 + 8].copy_from_slice(&v.to_le_bytes());
        }
        write(handle, h)
    }
    /// Flags: "Must be specified as ::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS" (cuda.h 13.5; 0 is
    /// accepted too, as libcudart's cudaIpcOpenMemHandle passes its caller's flags on and
    /// programs pass 0 on one GPU); any other bit: INVALID_VALUE. Peer access needs nothing
    /// here (every simulated device reaches every other's memory).
    fn cuIpcOpenMemHandle_v2(pdptr: *mut CUdeviceptr, handle: CUipcMemHandle, flags: c_uint) { ipc_open(pdptr, handle, flags) }
    fn cuIpcOpenMemHandle(pdptr: *mut CUdeviceptr, handle: CUipcMemHandle, flags: c_uint) { ipc_open(pdptr, handle, flags) }
    fn cuIpcCloseMemHandle(dptr: CUdeviceptr) { ipc_close(dptr) }
}
