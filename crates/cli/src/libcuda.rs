//! The CUDA driver as the simulator workloads (`sim load`, `sim job`) load it: by name, with
//! dlopen and dlsym, as an application does, so that under `cuvisor run` libcuvisor.so wraps
//! the entry points it wraps; and driver results as one line naming the call and the error.

use crate::{Failure, Result};
use cuvisor_cuda_abi::cuda::{err, CUresult};
use std::ffi::{c_void, CStr};

/// The CUresult's name (`CUDA_ERROR_OUT_OF_MEMORY`), or its number.
pub(crate) fn error_name(r: CUresult) -> String {
    err::TABLE
        .iter()
        .find(|(v, _, _)| *v == r)
        .map_or_else(|| format!("CUresult {r}"), |(_, name, _)| name.to_string())
}

/// `Ok` for CUDA_SUCCESS, else "`who`: CALL: NAME".
pub(crate) fn check(r: CUresult, who: &str, call: &str) -> Result<()> {
    if r == err::SUCCESS {
        Ok(())
    } else {
        Err(Failure::Runtime(format!(
            "{who}: {call}: {}",
            error_name(r)
        )))
    }
}

/// The last dlerror(), or "" when there is none.
fn dlerror() -> String {
    // SAFETY: dlerror returns NULL or a NUL-terminated string that stays valid until the next
    // dl* call on this thread; it is copied at once.
    let e = unsafe { libc::dlerror() };
    if e.is_null() {
        String::new()
    } else {
        // SAFETY: non-null: a NUL-terminated string (see above).
        unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned()
    }
}

/// dlopen("libcuda.so.1"); the failure says `needs` (what the workload needs) and `how` (how to
/// run it).
pub(crate) fn open(needs: &str, how: &str) -> Result<Library> {
    // SAFETY: dlopen with a NUL-terminated name; loading libcuda runs its constructors, which
    // is what any CUDA application does.
    let handle = unsafe { libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW) };
    if handle.is_null() {
        return Err(Failure::Runtime(format!(
            "{needs}, and libcuda.so.1 cannot be loaded ({}); {how}",
            dlerror()
        )));
    }
    Ok(Library {
        handle,
        needs: needs.to_string(),
        how: how.to_string(),
    })
}

/// A loaded libcuda.so.1 (never closed: the process uses it until it exits).
pub(crate) struct Library {
    handle: *mut c_void,
    needs: String,
    how: String,
}

impl Library {
    /// The entry point `name`; one that is missing means this libcuda.so.1 is not the
    /// simulator's. Callers transmute it to the entry point's type (see `sym!`).
    pub(crate) fn lookup(&self, name: &CStr) -> Result<*mut c_void> {
        // SAFETY: a live handle from dlopen and a NUL-terminated name. Under libcuvisor.so this
        // is its dlsym, which hands out its wrapper for the names it wraps.
        let p = unsafe { libc::dlsym(self.handle, name.as_ptr()) };
        if p.is_null() {
            Err(Failure::Runtime(format!(
                "{}, and this libcuda.so.1 is not the simulator (it has no {}); {}",
                self.needs,
                name.to_string_lossy(),
                self.how
            )))
        } else {
            Ok(p)
        }
    }
}

/// The C signatures (cuda.h) of the entry points the workloads call, for `sym!`.
pub(crate) mod types {
    use cuvisor_cuda_abi::cuda::{
        CUcontext, CUdevice, CUdeviceptr, CUevent, CUfunction, CUmodule, CUresult, CUstream,
    };
    use std::ffi::{c_char, c_int, c_uint, c_void};

    pub(crate) type Init = unsafe extern "C" fn(c_uint) -> CUresult;
    pub(crate) type DeviceGetCount = unsafe extern "C" fn(*mut c_int) -> CUresult;
    pub(crate) type DeviceCanAccessPeer =
        unsafe extern "C" fn(*mut c_int, CUdevice, CUdevice) -> CUresult;
    pub(crate) type PrimaryCtxRetain = unsafe extern "C" fn(*mut CUcontext, CUdevice) -> CUresult;
    pub(crate) type CtxSetCurrent = unsafe extern "C" fn(CUcontext) -> CUresult;
    pub(crate) type CtxEnablePeerAccess = unsafe extern "C" fn(CUcontext, c_uint) -> CUresult;
    pub(crate) type MemAlloc = unsafe extern "C" fn(*mut CUdeviceptr, usize) -> CUresult;
    pub(crate) type ModuleLoadData = unsafe extern "C" fn(*mut CUmodule, *const c_void) -> CUresult;
    pub(crate) type ModuleGetFunction =
        unsafe extern "C" fn(*mut CUfunction, CUmodule, *const c_char) -> CUresult;
    pub(crate) type StreamCreate = unsafe extern "C" fn(*mut CUstream, c_uint) -> CUresult;
    pub(crate) type StreamSynchronize = unsafe extern "C" fn(CUstream) -> CUresult;
    pub(crate) type StreamWaitEvent = unsafe extern "C" fn(CUstream, CUevent, c_uint) -> CUresult;
    pub(crate) type LaunchKernel = unsafe extern "C" fn(
        CUfunction,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        CUstream,
        *mut *mut c_void,
        *mut *mut c_void,
    ) -> CUresult;
    pub(crate) type EventCreate = unsafe extern "C" fn(*mut CUevent, c_uint) -> CUresult;
    pub(crate) type EventRecord = unsafe extern "C" fn(CUevent, CUstream) -> CUresult;
    pub(crate) type EventQuery = unsafe extern "C" fn(CUevent) -> CUresult;
    pub(crate) type EventSynchronize = unsafe extern "C" fn(CUevent) -> CUresult;
    pub(crate) type EventElapsedTime = unsafe extern "C" fn(*mut f32, CUevent, CUevent) -> CUresult;
    pub(crate) type MemcpyPeerAsync = unsafe extern "C" fn(
        CUdeviceptr,
        CUcontext,
        CUdeviceptr,
        CUcontext,
        usize,
        CUstream,
    ) -> CUresult;
}

/// `sym!(lib, c"cuInit", Init)`: the entry point, as its function-pointer type.
macro_rules! sym {
    ($lib:expr, $name:expr, $ty:ty) => {{
        let p = $lib.lookup($name)?;
        // SAFETY: `p` is the driver's entry point of that name, whose C signature (in cuda.h)
        // is the one `$ty` spells out.
        unsafe { std::mem::transmute::<*mut std::ffi::c_void, $ty>(p) }
    }};
}
pub(crate) use sym;
