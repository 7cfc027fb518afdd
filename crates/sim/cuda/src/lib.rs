//! The simulated CUDA driver, built as `libcuda.so.1`.
//!
//! Real clients (cudarc, C programs, libcudart-style loaders) run on it unmodified. It follows the
//! driver API's signatures, error codes and ordering rules; what it cannot do (run kernels) it
//! models in time: every kernel occupies the device's timeline, shared by all processes, for a
//! duration the caller picks (`sim_busy*` kernels: their first u64 parameter, in ns).
//!
//! Layout: `abi` helpers and the export macro here; `ctx` devices and contexts; `mem` every
//! allocation path, copies and pools; `exec` modules, launches, streams, events and graphs;
//! `procaddr` cuGetProcAddress; `export_table` cuGetExportTable, the private tables NVIDIA's
//! runtime asks for.
#![allow(clippy::missing_safety_doc)]

mod ctx;
mod exec;
mod export_table;

mod mem;
mod proc_table;
mod procaddr;

use cuvisor_cuda_abi::cuda::{err, CUresult};
use cuvisor_sim::Sim;
use std::collections::HashMap;
use std::ffi::{c_char, CStr};
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex, OnceLock};

pub(crate) type Res = Result<(), CUresult>;

/// Panic boundary of every exported function: a bug in the simulator is an error code, never an
/// unwind into C.
pub(crate) fn guard(f: impl FnOnce() -> Res) -> CUresult {
    match std::panic::catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => err::SUCCESS,
        Ok(Err(e)) => e,
        Err(_) => err::UNKNOWN,
    }
}

/// Defines exported driver entry points. Each body returns `Res` and runs behind [`guard`].
macro_rules! export {
    ($( $(#[$m:meta])* fn $name:ident ( $($a:ident : $t:ty),* $(,)? ) $body:block )*) => {$(
        $(#[$m])*
        #[no_mangle]
        pub extern "C" fn $name($($a: $t),*) -> cuvisor_cuda_abi::cuda::CUresult {
            $crate::guard(move || $body)
        }
    )*};
}
pub(crate) use export;

// ---- pointers from C ----------------------------------------------------------------------------
// The driver API's contract is that every pointer argument is either NULL or valid for the access
// the function documents. These helpers check NULL (CUDA_ERROR_INVALID_VALUE, as the driver does)
// and rely on the contract for the rest.

pub(crate) fn write<T>(p: *mut T, v: T) -> Res {
    if p.is_null() {
        return Err(err::INVALID_VALUE);
    }
    // SAFETY: non-null, and by the API contract valid for one write of T (unaligned tolerated).
    unsafe { p.write_unaligned(v) };
    Ok(())
}

pub(crate) fn read<T: Copy>(p: *const T) -> Result<T, CUresult> {
    if p.is_null() {
        return Err(err::INVALID_VALUE);
    }
    // SAFETY: non-null, and by the API contract valid for one read of T.
    Ok(unsafe { p.read_unaligned() })
}

pub(crate) fn cstr<'a>(p: *const c_char) -> Result<&'a str, CUresult> {
    if p.is_null() {
        return Err(err::INVALID_VALUE);
    }
    // SAFETY: non-null and, by the API contract, a NUL-terminated string alive for this call.
    unsafe { CStr::from_ptr(p) }
        .to_str()
        .map_err(|_| err::INVALID_VALUE)
}

/// Copies `s` NUL-terminated into a caller buffer of `len` bytes (truncating like the driver).
pub(crate) fn write_cstr(dst: *mut c_char, len: i32, s: &str) -> Res {
    if dst.is_null() || len <= 0 {
        return Err(err::INVALID_VALUE);
    }
    let n = s.len().min(len as usize - 1);
    // SAFETY: dst is non-null and, by contract, `len` bytes long; we write n + 1 <= len bytes.
    unsafe {
        std::ptr::copy_nonoverlapping(s.as_ptr(), dst as *mut u8, n);
        *dst.add(n) = 0;
    }
    Ok(())
}

/// Raw byte copy between two ranges the caller has validated.
pub(crate) fn copy_bytes(dst: u64, src: u64, n: usize) {
    if n == 0 {
        return;
    }
    // SAFETY: both ranges were checked by the caller: device ranges against the allocation table,
    // host ranges by the API contract. memmove semantics tolerate overlap.
    unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, n) };
}

// ---- handles ------------------------------------------------------------------------------------

/// Live objects of one kind behind opaque handles. A handle is the address of the object's
/// `Arc`, so it is unique while the object lives; lookups of stale or forged handles fail cleanly
/// with CUDA_ERROR_INVALID_HANDLE instead of dereferencing garbage.
pub(crate) struct Registry<T> {
    map: Mutex<HashMap<usize, Arc<T>>>,
}

impl<T> Registry<T> {
    pub fn new() -> Self {
        Registry {
            map: Mutex::new(HashMap::new()),
        }
    }
    pub fn insert(&self, v: T) -> (usize, Arc<T>) {
        let a = Arc::new(v);
        let h = Arc::as_ptr(&a) as usize;
        self.lock().insert(h, a.clone());
        (h, a)
    }
    pub fn get(&self, h: usize) -> Result<Arc<T>, CUresult> {
        self.lock().get(&h).cloned().ok_or(err::INVALID_HANDLE)
    }
    pub fn remove(&self, h: usize) -> Result<Arc<T>, CUresult> {
        self.lock().remove(&h).ok_or(err::INVALID_HANDLE)
    }
    pub fn retain(&self, keep: impl FnMut(&usize, &mut Arc<T>) -> bool) {
        self.lock().retain(keep)
    }
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<usize, Arc<T>>> {
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }
}

// ---- the driver instance ------------------------------------------------------------------------

/// Per-process driver state, made by cuInit.
pub(crate) struct Driver {
    pub sim: &'static Sim,
    /// This process's slot in the shared state (memory and busy time are charged to it).
    pub slot: usize,
}

static DRIVER: OnceLock<Result<Driver, CUresult>> = OnceLock::new();

/// The initialised driver, or CUDA_ERROR_NOT_INITIALIZED before a successful cuInit.
pub(crate) fn drv() -> Result<&'static Driver, CUresult> {
    match DRIVER.get() {
        Some(Ok(d)) => Ok(d),
        _ => Err(err::NOT_INITIALIZED),
    }
}

extern "C" fn release_slot_at_exit() {
    // A panic cannot unwind out of an extern "C" callback (it would abort at exit).
    let _ = std::panic::catch_unwind(release_slot);
}

fn release_slot() {
    if let Some(Ok(d)) = DRIVER.get() {
        // A forked child runs its parent's atexit handlers too: only the owner gives it back.
        if d.sim.shared.procs()[d.slot]
            .pid
            .load(std::sync::atomic::Ordering::Acquire)
            == std::process::id()
        {
            d.sim.shared.release_slot(d.slot);
        }
    }
}

fn init() -> Result<Driver, CUresult> {
    let sim = Sim::global().map_err(|e| {
        eprintln!("cuvisor-sim: {e}");
        err::NO_DEVICE
    })?;
    let slot = sim.shared.claim_slot().ok_or_else(|| {
        eprintln!(
            "cuvisor-sim: all {} process slots of the simulator are in use",
            cuvisor_sim::state::MAX_PROCS
        );
        err::UNKNOWN
    })?;
    // Memory held by processes that died without cleaning up goes back now, as the real driver's
    // would have when they exited.
    sim.shared.reclaim_dead();
    // SAFETY: registering a plain extern "C" function with no captured state.
    unsafe { libc::atexit(release_slot_at_exit) };
    Ok(Driver { sim, slot })
}

export! {
    fn cuInit(flags: u32) {
        if flags != 0 {
            return Err(err::INVALID_VALUE);
        }
        DRIVER.get_or_init(init).as_ref().map(|_| ()).map_err(|e| *e)
    }

    fn cuDriverGetVersion(version: *mut i32) {
        let v = Sim::global()
            .map(|s| s.model.driver_version)
            .unwrap_or(cuvisor_sim::model::DEFAULT_DRIVER_VERSION);
        write(version, v)
    }

    fn cuGetErrorName(e: CUresult, out: *mut *const c_char) {
        let name = err_entry(e)?.1;
        write(out, name.as_ptr())
    }

    fn cuGetErrorString(e: CUresult, out: *mut *const c_char) {
        let text = err_entry(e)?.2;
        write(out, text.as_ptr())
    }
}

/// Name and description of an error code as NUL-terminated strings (made once).
fn err_entry(e: CUresult) -> Result<(CUresult, &'static CStr, &'static CStr), CUresult> {
    static TABLE: OnceLock<Vec<(CUresult, std::ffi::CString, std::ffi::CString)>> = OnceLock::new();
    let t = TABLE.get_or_init(|| {
        err::TABLE
            .iter()
            .map(|(v, n, d)| {
                (
                    *v,
                    std::ffi::CString::new(*n).unwrap(),
                    std::ffi::CString::new(*d).unwrap(),
                )
            })
            .collect()
    });
    t.iter()
        .find(|x| x.0 == e)
        .map(|x| (x.0, x.1.as_c_str(), x.2.as_c_str()))
        .ok_or(err::INVALID_VALUE)
}

/// Entry points of the real driver that the simulator does not model: they exist (so loaders that
/// resolve every symbol up front work) and answer CUDA_ERROR_NOT_SUPPORTED. The C calling
/// convention lets a no-argument function stand in for any signature: the caller cleans up.
macro_rules! not_supported {
    ($($name:ident)*) => {$(
        #[no_mangle]
        pub extern "C" fn $name() -> CUresult {
            err::NOT_SUPPORTED
        }
    )*};
}

not_supported! {
    cuMemcpy2D_v2 cuMemcpy2DAsync_v2 cuMemcpy3D_v2 cuMemcpy3DAsync_v2 cuMemcpy2DUnaligned_v2
    cuMemcpyAtoH_v2 cuMemcpyHtoA_v2 cuMemcpyAtoD_v2 cuMemcpyDtoA_v2 cuMemcpyAtoA_v2
    cuMemcpyPeer cuMemcpyPeerAsync cuMemcpy3DPeer cuMemcpy3DPeerAsync
    cuMemsetD2D8_v2 cuMemsetD2D16_v2 cuMemsetD2D32_v2
    cuTexObjectCreate cuTexObjectDestroy cuSurfObjectCreate cuSurfObjectDestroy
    cuLinkCreate_v2 cuLinkAddData_v2 cuLinkAddFile_v2 cuLinkComplete cuLinkDestroy
    cuImportExternalMemory cuExternalMemoryGetMappedBuffer cuDestroyExternalMemory
    cuImportExternalSemaphore cuSignalExternalSemaphoresAsync cuWaitExternalSemaphoresAsync
    cuDestroyExternalSemaphore cuGraphicsUnregisterResource cuGraphicsMapResources
    cuGraphicsUnmapResources cuProfilerStart cuProfilerStop cuMemPrefetchAsync cuMemAdvise
    cuMemRangeGetAttribute cuCtxGetExecAffinity cuDeviceGetNvSciSyncAttributes cuFlushGPUDirectRDMAWrites
    cuCoredumpGetAttribute cuCoredumpSetAttribute cuGreenCtxCreate cuDeviceGetDevResource
    cuStreamWriteValue32 cuStreamWriteValue32_v2 cuStreamWriteValue32_ptsz cuStreamWriteValue32_v2_ptsz
    cuMulticastCreate cuMulticastAddDevice cuMulticastBindMem
    // PyTorch 2.15 resolves these through cuGetProcAddress when its allocator starts, and its
    // first allocation fails with "named symbol not found" while one is missing (seen on the
    // simulator: cuGetProcAddress_v2 answered CUDA_ERROR_NOT_FOUND for each, then
    // torch.empty(..., device="cuda") raised cudaErrorSymbolNotFound).
    cuMulticastUnbind cuCtxFromGreenCtx cuGreenCtxDestroy cuGreenCtxStreamCreate
    cuDevSmResourceSplitByCount cuDevResourceGenerateDesc cuLogsRegisterCallback cuLogsUnregisterCallback
    // cuBLASLt 12.8 resolves these (among ~80 entry points) with dlsym on libcuda.so.1 when a
    // handle is created, and fails cublasLtCtxInit ("Driver API initialization failed", so
    // cublasCreate answers CUBLAS_STATUS_INTERNAL_ERROR) when one is absent; creating a handle
    // calls none of them. Seen on the simulator with a breakpoint on dlsym during cublasCreate_v2
    // (PyTorch 2.8, nvidia-cublas-cu12 12.8.4.1).
    cuStreamWaitValue32 cuStreamBatchMemOp cuGraphKernelNodeGetParams
    cuGraphExecKernelNodeSetParams
}
