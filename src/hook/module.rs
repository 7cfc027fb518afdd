//! Module and library loads: the image's variables are charged before the driver loads it and
//! given back at unload or context teardown (the rules in `quota::modules`, the sizes from
//! `cuvisor_image`).
//!
//! A file (cuModuleLoad, cuLibraryLoadFromFile) is read here, bounded and only if it is a
//! regular file, and the driver is given those very bytes (cuModuleLoadData /
//! cuLibraryLoadData): were the driver to open the file by name itself, it could load another
//! file put there after cuvisor sized this one.
//!
//! cuLinkComplete's output is an image in host memory that the program then loads with
//! cuModuleLoadData* (charged there); the link itself takes no device memory, so cuLink* pass
//! through. Every entry point here is also what cuGetProcAddress hands out (`procaddr`
//! substitutes any wrapped address).

use super::device::{current_ordinal, device_count, entry_of, REAL_CTX_GET_CURRENT};
use super::hooks;
use super::{Lib, Real};
use crate::quota::modules::{Gone, Kind, LoadError, Place};
use crate::quota::{Quota, GRANULE};
use crate::Mode;
use cuvisor_cuda_abi::cuda::*;
use std::ffi::{c_char, c_uint, c_void, CStr};
use std::sync::atomic::{AtomicUsize, Ordering::*};

hooks! {
    Cuda cuModuleLoad(module: *mut CUmodule, fname: *const c_char) => module_load_file;
    Cuda cuModuleLoadData(module: *mut CUmodule, image: *const c_void) => module_load_data;
    Cuda cuModuleLoadDataEx(module: *mut CUmodule, image: *const c_void, n: c_uint, opts: *mut c_void, vals: *mut *mut c_void) => module_load_data_ex;
    Cuda cuModuleLoadFatBinary(module: *mut CUmodule, image: *const c_void) => module_load_fat_binary;
    Cuda cuModuleUnload(module: CUmodule) => module_unload;
    Cuda cuLibraryLoadData(library: *mut *mut c_void, code: *const c_void, jit_keys: *mut c_void, jit_vals: *mut *mut c_void, jit_n: c_uint, lib_keys: *mut c_void, lib_vals: *mut *mut c_void, lib_n: c_uint) => library_load_data;
    Cuda cuLibraryLoadFromFile(library: *mut *mut c_void, file: *const c_char, jit_keys: *mut c_void, jit_vals: *mut *mut c_void, jit_n: c_uint, lib_keys: *mut c_void, lib_vals: *mut *mut c_void, lib_n: c_uint) => library_load_file;
    Cuda cuLibraryUnload(library: *mut c_void) => library_unload;
}

const OOM: u32 = err::OUT_OF_MEMORY;

static REAL_PRIMARY_RETAIN: Real = Real::new(Lib::Cuda, c"cuDevicePrimaryCtxRetain");
static REAL_PRIMARY_RELEASE: Real = Real::new(Lib::Cuda, c"cuDevicePrimaryCtxRelease_v2");
static REAL_PRIMARY_GET_STATE: Real = Real::new(Lib::Cuda, c"cuDevicePrimaryCtxGetState");

fn call_real<F: Copy>(r: &Real) -> Option<F> {
    let a = r.get();
    // SAFETY: `r` names a driver export whose C signature is F (each caller states it).
    (a != 0).then(|| unsafe { std::mem::transmute_copy::<usize, F>(&a) })
}

fn read<T: Copy>(p: *const T) -> Option<T> {
    // SAFETY: non-null and, by the driver API contract, valid for a read of T.
    (!p.is_null()).then(|| unsafe { p.read_unaligned() })
}

/// The current context (0: none, or the driver did not say).
fn current_context() -> u64 {
    type Get = unsafe extern "C" fn(*mut CUcontext) -> u32;
    let Some(f) = call_real::<Get>(&REAL_CTX_GET_CURRENT) else {
        return 0;
    };
    let mut c: CUcontext = std::ptr::null_mut();
    // SAFETY: cuCtxGetCurrent(CUcontext*) with a valid out-pointer.
    if unsafe { f(&mut c) } == 0 {
        c as u64
    } else {
        0
    }
}

/// The primary context handle of each device, once seen (the driver keeps one handle per
/// device for the life of the process, retained or not).
static PRIMARY: [AtomicUsize; 64] = [const { AtomicUsize::new(0) }; 64];

/// Whether `ctx` is device `dev`'s primary context: asked once per device, while it is
/// active, by a retain and a release of our own (which leave its count as it was).
fn is_primary(ctx: u64, dev: i32) -> bool {
    let Some(slot) = usize::try_from(dev).ok().and_then(|d| PRIMARY.get(d)) else {
        return false;
    };
    let known = slot.load(Acquire);
    if known != 0 {
        return known as u64 == ctx;
    }
    type State = unsafe extern "C" fn(CUdevice, *mut c_uint, *mut i32) -> u32;
    type Retain = unsafe extern "C" fn(*mut CUcontext, CUdevice) -> u32;
    type Release = unsafe extern "C" fn(CUdevice) -> u32;
    let (Some(state), Some(retain), Some(release)) = (
        call_real::<State>(&REAL_PRIMARY_GET_STATE),
        call_real::<Retain>(&REAL_PRIMARY_RETAIN),
        call_real::<Release>(&REAL_PRIMARY_RELEASE),
    ) else {
        return false;
    };
    let (mut flags, mut active) = (0, 0);
    // SAFETY: cuDevicePrimaryCtxGetState(CUdevice, unsigned*, int*) with valid out-pointers.
    if unsafe { state(dev, &mut flags, &mut active) } != 0 || active == 0 {
        return false; // an inactive primary context cannot be the one a module loads into
    }
    let mut p: CUcontext = std::ptr::null_mut();
    // SAFETY: one more reference to an active primary context, given back at once.
    if unsafe { retain(&mut p, dev) } != 0 {
        return false;
    }
    // SAFETY: the reference just taken.
    unsafe { release(dev) };
    slot.store(p as usize, Release);
    p as u64 == ctx
}

/// What the quota says about loading an image of `bytes` (Err: its reason) at `place`: None
/// to let the driver answer alone (no quota), else the result to return.
fn charged_load(
    call: &str,
    kind: Kind,
    bytes: Result<u64, String>,
    place: impl FnOnce(&Quota) -> Result<Place, i32>,
    image: Option<Box<[u8]>>,
    load: impl FnOnce() -> Result<u64, u32>,
) -> u32 {
    let q = match crate::mode() {
        Mode::PassThrough => return load().err().unwrap_or(0),
        Mode::Broken(_) => {
            crate::log::refused_broken(call);
            return OOM;
        }
        Mode::Enforce(q) => q,
    };
    let bytes = match bytes {
        Ok(b) => b,
        Err(why) => {
            q.log_unsized(
                call,
                &format!("the image's device memory cannot be computed: {why}"),
            );
            return OOM;
        }
    };
    let place = match place(q) {
        Ok(p) => p,
        Err(ord) => {
            q.log_refusal(call, ord, bytes, crate::quota::Refusal::NoEntry);
            return OOM;
        }
    };
    match q.images.load(q, kind, place, bytes, image, load) {
        Ok(_) => 0,
        Err(LoadError::Driver(r)) => r,
        Err(LoadError::Refused(_, why)) => {
            q.log_refusal(call, current_ordinal().unwrap_or(-1), bytes, why);
            OOM
        }
    }
}

/// A module is charged on the current context's device, recorded with that context.
fn module_place(q: &Quota) -> Result<Place, i32> {
    let ord = current_ordinal().unwrap_or(-1);
    let e = entry_of(q, ord).ok_or(ord)?;
    let ctx = current_context();
    Ok(Place {
        entries: vec![e],
        ctx,
        primary_of: (ctx != 0 && is_primary(ctx, ord)).then_some(ord),
    })
}

/// A library is charged once on every device the process can see (see `quota::modules`).
fn library_place(q: &Quota) -> Result<Place, i32> {
    let n = device_count();
    if n <= 0 {
        return Err(-1);
    }
    let entries = (0..n)
        .map(|o| entry_of(q, o).ok_or(o))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Place {
        entries,
        ctx: 0,
        primary_of: None,
    })
}

/// The device memory of the image at `p` (cuModuleLoadData's contract: readable as its own
/// headers say).
fn image_bytes(p: *const c_void) -> Result<u64, String> {
    // SAFETY: the program's image, readable by the driver API's contract.
    unsafe { cuvisor_image::from_ptr(p) }.device_bytes(GRANULE)
}

/// A load whose new handle the driver writes to `out`.
fn load_to<H>(out: *mut *mut H, load: impl FnOnce() -> u32) -> impl FnOnce() -> Result<u64, u32> {
    move || match load() {
        0 => Ok(read(out).map_or(0, |h| h as u64)),
        r => Err(r),
    }
}

fn module_data(
    call: &str,
    module: *mut CUmodule,
    image: *const c_void,
    load: impl FnOnce() -> u32,
) -> u32 {
    charged_module_load(call, module, image, || image_bytes(image), load)
}

/// A module load into the current context of the image at `image`, whose device memory
/// `bytes` computes (Err: why it cannot), the new handle written by `load` to `module`.
/// Also how the runtime's private loads (`cudart_table`) are charged.
pub(super) fn charged_module_load(
    call: &str,
    module: *mut CUmodule,
    image: *const c_void,
    bytes: impl FnOnce() -> Result<u64, String>,
    load: impl FnOnce() -> u32,
) -> u32 {
    if module.is_null() || image.is_null() || matches!(crate::mode(), Mode::PassThrough) {
        return load(); // the driver's own answer (INVALID_VALUE), or no quota
    }
    charged_load(
        call,
        Kind::Module,
        bytes(),
        module_place,
        None,
        load_to(module, load),
    )
}

fn module_load_data(
    real: impl Fn(*mut CUmodule, *const c_void) -> u32,
    module: *mut CUmodule,
    image: *const c_void,
) -> u32 {
    module_data("cuModuleLoadData", module, image, || real(module, image))
}

fn module_load_data_ex(
    real: impl Fn(*mut CUmodule, *const c_void, c_uint, *mut c_void, *mut *mut c_void) -> u32,
    module: *mut CUmodule,
    image: *const c_void,
    n: c_uint,
    opts: *mut c_void,
    vals: *mut *mut c_void,
) -> u32 {
    module_data("cuModuleLoadDataEx", module, image, || {
        real(module, image, n, opts, vals)
    })
}

fn module_load_fat_binary(
    real: impl Fn(*mut CUmodule, *const c_void) -> u32,
    module: *mut CUmodule,
    image: *const c_void,
) -> u32 {
    module_data("cuModuleLoadFatBinary", module, image, || {
        real(module, image)
    })
}

/// Reads an image file: a regular file of at most `cuvisor_image::MAX_IMAGE` bytes, read
/// through the descriptor it was checked on, NUL-terminated (PTX text needs its NUL). Err: the
/// driver's answer for a file it cannot read (CUDA_ERROR_FILE_NOT_FOUND), or OOM with the line
/// to print for one too large to size.
fn read_image_file(path: *const c_char) -> Result<Box<[u8]>, (u32, Option<String>)> {
    use std::io::Read;
    if path.is_null() {
        return Err((err::INVALID_VALUE, None));
    }
    // SAFETY: a NUL-terminated path, by the driver API's contract.
    let path = unsafe { CStr::from_ptr(path) };
    let path = std::path::Path::new(
        <std::ffi::OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(path.to_bytes()),
    );
    let not_found = (err::FILE_NOT_FOUND, None);
    let f = std::fs::File::open(path).map_err(|_| not_found.clone())?;
    let meta = f.metadata().map_err(|_| not_found.clone())?;
    if !meta.is_file() {
        return Err(not_found);
    }
    let max = cuvisor_image::MAX_IMAGE;
    let mut buf = Vec::with_capacity(meta.len().min(max) as usize + 1);
    f.take(max + 1)
        .read_to_end(&mut buf)
        .map_err(|_| (err::FILE_NOT_FOUND, None))?;
    if buf.len() as u64 > max {
        return Err((OOM, Some("the image file is larger than 1 GiB".into())));
    }
    buf.push(0);
    Ok(buf.into_boxed_slice())
}

/// A file-load failure as the wrapper answers it.
fn file_error(call: &str, (r, why): (u32, Option<String>)) -> u32 {
    if let (Some(why), Mode::Enforce(q)) = (why, crate::mode()) {
        q.log_unsized(call, &why);
    }
    r
}

fn module_load_file(
    real: impl Fn(*mut CUmodule, *const c_char) -> u32,
    module: *mut CUmodule,
    fname: *const c_char,
) -> u32 {
    if module.is_null() || matches!(crate::mode(), Mode::PassThrough) {
        return real(module, fname);
    }
    let image = match read_image_file(fname) {
        Ok(b) => b,
        Err(e) => return file_error("cuModuleLoad", e),
    };
    type LoadData = unsafe extern "C" fn(*mut CUmodule, *const c_void) -> u32;
    let Some(load_data) = call_real::<LoadData>(&cuModuleLoadData::REAL) else {
        return err::NOT_SUPPORTED;
    };
    let bytes = cuvisor_image::from_bytes(&image).device_bytes(GRANULE);
    let p = image.as_ptr() as *const c_void;
    charged_load(
        "cuModuleLoad",
        Kind::Module,
        bytes,
        module_place,
        None,
        // SAFETY: cuModuleLoadData(CUmodule*, const void*) with the program's out-pointer and
        // the file's bytes, alive across the call (the driver copies a module's image).
        load_to(module, || unsafe { load_data(module, p) }),
    )
}

fn module_unload(real: impl Fn(CUmodule) -> u32, module: CUmodule) -> u32 {
    match crate::mode() {
        Mode::Enforce(q) => q
            .images
            .unload(q, Kind::Module, module as u64, || real(module)),
        _ => real(module),
    }
}

#[allow(clippy::too_many_arguments)]
fn library_load_data(
    real: impl Fn(
        *mut *mut c_void,
        *const c_void,
        *mut c_void,
        *mut *mut c_void,
        c_uint,
        *mut c_void,
        *mut *mut c_void,
        c_uint,
    ) -> u32,
    library: *mut *mut c_void,
    code: *const c_void,
    jit_keys: *mut c_void,
    jit_vals: *mut *mut c_void,
    jit_n: c_uint,
    lib_keys: *mut c_void,
    lib_vals: *mut *mut c_void,
    lib_n: c_uint,
) -> u32 {
    let load = || {
        real(
            library, code, jit_keys, jit_vals, jit_n, lib_keys, lib_vals, lib_n,
        )
    };
    if library.is_null() || code.is_null() || matches!(crate::mode(), Mode::PassThrough) {
        return load();
    }
    charged_load(
        "cuLibraryLoadData",
        Kind::Library,
        image_bytes(code),
        library_place,
        None,
        load_to(library, load),
    )
}

#[allow(clippy::too_many_arguments)]
fn library_load_file(
    real: impl Fn(
        *mut *mut c_void,
        *const c_char,
        *mut c_void,
        *mut *mut c_void,
        c_uint,
        *mut c_void,
        *mut *mut c_void,
        c_uint,
    ) -> u32,
    library: *mut *mut c_void,
    file: *const c_char,
    jit_keys: *mut c_void,
    jit_vals: *mut *mut c_void,
    jit_n: c_uint,
    lib_keys: *mut c_void,
    lib_vals: *mut *mut c_void,
    lib_n: c_uint,
) -> u32 {
    if library.is_null() || matches!(crate::mode(), Mode::PassThrough) {
        return real(
            library, file, jit_keys, jit_vals, jit_n, lib_keys, lib_vals, lib_n,
        );
    }
    let image = match read_image_file(file) {
        Ok(b) => b,
        Err(e) => return file_error("cuLibraryLoadFromFile", e),
    };
    type LoadData = unsafe extern "C" fn(
        *mut *mut c_void,
        *const c_void,
        *mut c_void,
        *mut *mut c_void,
        c_uint,
        *mut c_void,
        *mut *mut c_void,
        c_uint,
    ) -> u32;
    let Some(load_data) = call_real::<LoadData>(&cuLibraryLoadData::REAL) else {
        return err::NOT_SUPPORTED;
    };
    let bytes = cuvisor_image::from_bytes(&image).device_bytes(GRANULE);
    let p = image.as_ptr() as *const c_void;
    charged_load(
        "cuLibraryLoadFromFile",
        Kind::Library,
        bytes,
        library_place,
        // Kept until cuLibraryUnload: the driver may refer to the bytes while the library
        // lives (CU_LIBRARY_BINARY_IS_PRESERVED says it may).
        Some(image),
        // SAFETY: cuLibraryLoadData with the program's own arguments and the file's bytes,
        // which live in the library's record until it is unloaded.
        load_to(library, || unsafe {
            load_data(
                library, p, jit_keys, jit_vals, jit_n, lib_keys, lib_vals, lib_n,
            )
        }),
    )
}

fn library_unload(real: impl Fn(*mut c_void) -> u32, library: *mut c_void) -> u32 {
    match crate::mode() {
        Mode::Enforce(q) => q
            .images
            .unload(q, Kind::Library, library as u64, || real(library)),
        _ => real(library),
    }
}

/// A context went (cuCtxDestroy, the primary context's last release or reset): the modules
/// loaded in it went with it.
pub(super) fn context_gone(gone: Gone) {
    if let Mode::Enforce(q) = crate::mode() {
        q.images.context_gone(q, gone);
    }
}
