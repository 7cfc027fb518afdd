//! What a program can ask of loaded modules, libraries, kernels and functions (CUDA 12.x):
//! how many functions / kernels an image holds and which (cuModuleGetFunctionCount,
//! cuModuleEnumerateFunctions, cuLibraryGetKernelCount, cuLibraryEnumerateKernels), their names
//! (cuFuncGetName, cuKernelGetName), a kernel's library, a function's loading state under the
//! loading mode (lazy loading: cuFuncIsLoaded, cuFuncLoad), a kernel's cache
//! preference, and the library symbols the simulated images never have (unified functions,
//! managed variables). Loading is `exec`'s and launching `launch`'s; this reads what `exec` keeps.
//!
//! The kernels of an image are those the simulator can read: a cubin's or PTX's, or a fat
//! binary's cubin for the device (the current context's, else device 0). An image it cannot read
//! counts no kernels (a limitation: its kernels still resolve by name).

use crate::{cstr, ctx, drv, exec, export, write, Res};
use cuvisor_cuda_abi::cuda::{err, CUfunction, CUmodule, CUresult};
use std::collections::{HashMap, HashSet};
use std::ffi::{c_char, c_uint, c_void, CString};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Mutex, OnceLock};

/// `CUmoduleLoadingMode` (cuda.h).
const EAGER_LOADING: c_uint = 1;
const LAZY_LOADING: c_uint = 2;
/// `CUfunctionLoadingState` (cuda.h).
const FUNCTION_UNLOADED: c_uint = 0;
const FUNCTION_LOADED: c_uint = 1;

fn lock<T>(m: &'static Mutex<T>) -> std::sync::MutexGuard<'static, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// "Module loading mode is controlled by CUDA_MODULE_LOADING env variable" (cuda.h); lazy
/// unless it says EAGER: "Lazy Loading is enabled by default" from CUDA 12.2 (CUDA C++
/// Programming Guide, "Lazy Loading").
/// Read once, as the driver reads its environment when it starts. What cuModuleGetLoadingMode
/// answers: libcudart 12.9 and 13.5 ask it at initialisation (an error there fails
/// cudaGetDeviceCount) and, told LAZY, load a program's modules at their first use, so its
/// `__device__` arrays take memory then, not at start, as on a real driver.
fn loading_mode() -> c_uint {
    static MODE: OnceLock<c_uint> = OnceLock::new();
    *MODE.get_or_init(|| match std::env::var("CUDA_MODULE_LOADING") {
        Ok(v) if v.eq_ignore_ascii_case("EAGER") => EAGER_LOADING,
        _ => LAZY_LOADING,
    })
}

/// Functions loaded by cuFuncLoad (in lazy mode; in eager mode every function is).
fn loaded() -> &'static Mutex<HashSet<usize>> {
    static L: OnceLock<Mutex<HashSet<usize>>> = OnceLock::new();
    L.get_or_init(|| Mutex::new(HashSet::new()))
}

/// A launch of `f` (a function or a library kernel) loads its function, as lazy loading does:
/// "CUDA APIs may load the function automatically when called with partially loaded function
/// handle" (cuModuleEnumerateFunctions, cuda.h).
pub(crate) fn launched(f: usize) {
    let f = exec::kernel_function_handle(f).unwrap_or(f);
    lock(loaded()).insert(f);
}

/// The SM number of the device whose cubin counts: the current context's, else device 0.
fn sm() -> Result<u32, CUresult> {
    let d = drv()?;
    let dev = ctx::current().map(|(_, c)| c.dev).unwrap_or(0);
    let cc = d.sim.model.devices[dev].cc;
    Ok(cc.0 * 10 + cc.1)
}

fn kernel_names(module: usize) -> Result<Vec<String>, CUresult> {
    Ok(exec::module_kernels(module, sm()?)?.unwrap_or_default())
}

/// Names handed out as C strings: one per handle, kept while the handle keeps the same name (a
/// handle of an unloaded module may come back for another function).
fn c_name(handle: usize, name: &str) -> *const c_char {
    static NAMES: OnceLock<Mutex<HashMap<usize, CString>>> = OnceLock::new();
    let mut m = lock(NAMES.get_or_init(|| Mutex::new(HashMap::new())));
    let e = m
        .entry(handle)
        .or_insert_with(|| CString::new(name).unwrap_or_default());
    if e.as_bytes() != name.as_bytes() {
        *e = CString::new(name).unwrap_or_default();
    }
    e.as_ptr()
}

/// Writes up to `n` handles `make(name)` for the image's kernels at `out`.
fn enumerate(
    out: *mut usize,
    n: c_uint,
    names: Vec<String>,
    make: impl Fn(&str) -> Result<usize, CUresult>,
) -> Res {
    if out.is_null() && n > 0 {
        return Err(err::INVALID_VALUE);
    }
    for (i, name) in names.iter().take(n as usize).enumerate() {
        write(out.wrapping_add(i), make(name)?)?;
    }
    Ok(())
}

fn func_name(name: *mut *const c_char, f: CUfunction) -> Res {
    if name.is_null() || f.is_null() {
        return Err(err::INVALID_VALUE);
    }
    drv()?;
    // cuda.h documents CUDA_ERROR_INVALID_VALUE as this call's only error.
    let func = exec::function(f).map_err(|_| err::INVALID_VALUE)?;
    write(name, c_name(f as usize, func.name()))
}

export! {
    fn cuModuleGetLoadingMode(mode: *mut c_uint) {
        write(mode, loading_mode())
    }
    fn cuModuleGetFunctionCount(count: *mut c_uint, module: CUmodule) {
        drv()?;
        let names = kernel_names(module as usize)?;
        write(count, names.len() as c_uint)
    }
    /// At most `n` handles, those cuModuleGetFunction gives for the same names.
    fn cuModuleEnumerateFunctions(functions: *mut CUfunction, n: c_uint, module: CUmodule) {
        drv()?;
        let names = kernel_names(module as usize)?;
        enumerate(functions as *mut usize, n, names, |name| exec::module_function_of(module as usize, name))
    }

    fn cuLibraryGetKernelCount(count: *mut c_uint, library: *mut c_void) {
        drv()?;
        let names = kernel_names(exec::library_module(library as usize)?)?;
        write(count, names.len() as c_uint)
    }
    /// At most `n` handles, those cuLibraryGetKernel gives for the same names.
    fn cuLibraryEnumerateKernels(kernels: *mut *mut c_void, n: c_uint, library: *mut c_void) {
        drv()?;
        let names = kernel_names(exec::library_module(library as usize)?)?;
        enumerate(kernels as *mut usize, n, names, |name| exec::library_kernel(library as usize, name))
    }

    /// No simulated image has unified functions, and no simulated GPU has
    /// CU_DEVICE_ATTRIBUTE_UNIFIED_FUNCTION_POINTERS, where "the call may return
    /// CUDA_ERROR_NOT_FOUND" (cuda.h).
    fn cuLibraryGetUnifiedFunction(fptr: *mut *mut c_void, library: *mut c_void, symbol: *const c_char) {
        drv()?;
        exec::library_module(library as usize)?;
        cstr(symbol)?;
        if fptr.is_null() {
            return Err(err::INVALID_VALUE);
        }
        Err(err::NOT_FOUND)
    }
    /// The simulator's image reader does not tell `__managed__` variables from `__device__`
    /// ones, so no name is found (a limitation); "One of the parameters dptr or bytes (not
    /// both) can be NULL".
    fn cuLibraryGetManaged(dptr: *mut u64, bytes: *mut usize, library: *mut c_void, name: *const c_char) {
        drv()?;
        exec::library_module(library as usize)?;
        cstr(name)?;
        if dptr.is_null() && bytes.is_null() {
            return Err(err::INVALID_VALUE);
        }
        Err(err::NOT_FOUND)
    }

    /// "If either **name or hfunc is NULL, CUDA_ERROR_INVALID_VALUE is returned"; the name may
    /// be mangled (it is the image's).
    fn cuFuncGetName(name: *mut *const c_char, f: CUfunction) { func_name(name, f) }
    fn cuKernelGetName(name: *mut *const c_char, kernel: *mut c_void) {
        if name.is_null() || kernel.is_null() {
            return Err(err::INVALID_VALUE);
        }
        drv()?;
        let f = exec::kernel_function_handle(kernel as usize).map_err(|_| err::INVALID_VALUE)?;
        let func = exec::function(f as CUfunction).map_err(|_| err::INVALID_VALUE)?;
        write(name, c_name(kernel as usize, func.name()))
    }
    fn cuKernelGetLibrary(lib: *mut *mut c_void, kernel: *mut c_void) {
        drv()?;
        if lib.is_null() {
            return Err(err::INVALID_VALUE);
        }
        write(lib, exec::kernel_library(kernel as usize)? as *mut c_void)
    }

    /// Loaded: every function in eager mode; in lazy mode, one cuFuncLoad or a launch loaded.
    fn cuFuncIsLoaded(state: *mut c_uint, f: CUfunction) {
        drv()?;
        exec::function(f)?;
        let on = loading_mode() == EAGER_LOADING || lock(loaded()).contains(&(f as usize));
        write(state, if on { FUNCTION_LOADED } else { FUNCTION_UNLOADED })
    }
    fn cuFuncLoad(f: CUfunction) {
        drv()?;
        exec::function(f)?;
        lock(loaded()).insert(f as usize);
        Ok(())
    }

    /// "This is only a preference" (cuda.h), one per function here for every device (the
    /// device is checked); `CUfunc_cache` values 0..=3.
    fn cuKernelSetCacheConfig(kernel: *mut c_void, config: i32, dev: i32) {
        drv()?;
        let f = exec::kernel_function_handle(kernel as usize)?;
        if !(0..=3).contains(&config) {
            return Err(err::INVALID_VALUE);
        }
        crate::device::device(dev)?;
        exec::function(f as CUfunction)?.state.cache_config.store(config, Relaxed);
        Ok(())
    }
}
