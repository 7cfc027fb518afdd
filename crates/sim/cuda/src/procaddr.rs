//! cuGetProcAddress (CUDA 11.3, 4 arguments) and cuGetProcAddress_v2 (CUDA 12.0, adds
//! `symbolStatus`). The version table and the documented semantics, with sources, are in
//! `proc_table.rs`; this module turns a table answer into an address.
//!
//! The address of a symbol is what `dlsym` on this very library returns, so a program gets the
//! same function whichever way it resolves it. A table entry the simulator does not implement
//! resolves to a function that answers CUDA_ERROR_NOT_SUPPORTED.

use crate::proc_table::{lookup, Lookup, CU_GET_PROC_ADDRESS_VALID_FLAGS};
use crate::{cstr, export, write, Res};
use cuvisor_cuda_abi::cuda::{err, CUresult};
use std::ffi::{c_int, c_void, CString};
use std::sync::OnceLock;

extern "C" fn unimplemented_entry_point() -> CUresult {
    err::NOT_SUPPORTED
}

/// This library's own dlopen handle, found through the address of one of its functions: a
/// private one, because an exported function's address can be interposed (with libcuvisor
/// preloaded, `cuGetProcAddress_v2` here would be the wrapper's address, in another library).
fn own_handle() -> usize {
    static H: OnceLock<usize> = OnceLock::new();
    *H.get_or_init(|| {
        let mut info = empty_dl_info();
        let me = unimplemented_entry_point as *const c_void;
        // SAFETY: dladdr only reads the address and fills `info`, which we own.
        if unsafe { libc::dladdr(me, &mut info) } == 0 || info.dli_fname.is_null() {
            return 0;
        }
        // SAFETY: dli_fname is a NUL-terminated path owned by the loader; RTLD_NOLOAD only looks
        // up the already loaded object (this one) and takes a reference we keep for good.
        unsafe { libc::dlopen(info.dli_fname, libc::RTLD_NOW | libc::RTLD_NOLOAD) as usize }
    })
}

fn empty_dl_info() -> libc::Dl_info {
    libc::Dl_info {
        dli_fname: std::ptr::null(),
        dli_fbase: std::ptr::null_mut(),
        dli_sname: std::ptr::null(),
        dli_saddr: std::ptr::null_mut(),
    }
}

fn address_of(symbol: &str) -> *mut c_void {
    let handle = own_handle();
    let name = match CString::new(symbol) {
        Ok(n) => n,
        Err(_) => return std::ptr::null_mut(),
    };
    let p = if handle == 0 {
        std::ptr::null_mut()
    } else {
        // SAFETY: handle is a live dlopen handle of this library and name is NUL-terminated.
        unsafe { libc::dlsym(handle as *mut c_void, name.as_ptr()) }
    };
    if p.is_null() {
        unimplemented_entry_point as *mut c_void
    } else {
        p
    }
}

fn get_proc_address(
    symbol: *const libc::c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    flags: u64,
    status: *mut c_int,
) -> Res {
    if pfn.is_null() || symbol.is_null() || flags & !CU_GET_PROC_ADDRESS_VALID_FLAGS != 0 {
        return Err(err::INVALID_VALUE);
    }
    let driver = cuvisor_sim::Sim::global()
        .map(|s| s.model.driver_version)
        .unwrap_or(cuvisor_sim::model::DEFAULT_DRIVER_VERSION);
    if version > driver {
        write(pfn, std::ptr::null_mut())?;
        return Err(err::INVALID_VALUE);
    }
    let name = cstr(symbol).unwrap_or("");
    let answer = lookup(name, version, flags);
    if !status.is_null() {
        write(status, answer.status() as c_int)?;
    }
    match answer {
        Lookup::Found(sym) => write(pfn, address_of(sym)),
        Lookup::SymbolNotFound | Lookup::VersionNotSufficient => {
            write(pfn, std::ptr::null_mut())?;
            Err(err::NOT_FOUND)
        }
    }
}

export! {
    fn cuGetProcAddress(symbol: *const libc::c_char, pfn: *mut *mut c_void, version: c_int, flags: u64) {
        get_proc_address(symbol, pfn, version, flags, std::ptr::null_mut())
    }
    fn cuGetProcAddress_v2(symbol: *const libc::c_char, pfn: *mut *mut c_void, version: c_int, flags: u64, status: *mut c_int) {
        get_proc_address(symbol, pfn, version, flags, status)
    }
}
