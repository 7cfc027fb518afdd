//! cuGetProcAddress (CUDA 11.3, 4 arguments) and cuGetProcAddress_v2 (12.0, adds symbolStatus).
//!
//! The real driver answers first: it alone decides which ABI version a base name, cudaVersion
//! and flags select (`cuMemAlloc`@2000 is the 32-bit v1, the per-thread flag gives `_ptsz`...).
//! We then swap the pointer it returned for our wrapper of exactly that symbol, found by the
//! real address (and, failing that, by the exported name at that address). Its own status and
//! result pass through untouched. "cuGetProcAddress" itself resolves to our wrapper like any
//! other entry, so a program that fetches it this way stays intercepted.

use super::{all_hooks, Lib};
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::OnceLock;

/// Real address -> our wrapper, for every wrapped driver entry point the real library has.
fn by_real_address() -> &'static HashMap<usize, usize> {
    static MAP: OnceLock<HashMap<usize, usize>> = OnceLock::new();
    MAP.get_or_init(|| {
        all_hooks()
            .filter(|h| h.lib == Lib::Cuda)
            .filter_map(|h| Some((nonzero(h.real.get())?, h.wrapper)))
            .collect()
    })
}

fn nonzero(a: usize) -> Option<usize> {
    (a != 0).then_some(a)
}

/// Our wrapper for a pointer the real cuGetProcAddress returned, if we wrap that entry point.
fn wrapper_for(p: *mut c_void) -> Option<usize> {
    if let Some(&w) = by_real_address().get(&(p as usize)) {
        return Some(w);
    }
    let mut info = libc::Dl_info {
        dli_fname: std::ptr::null(),
        dli_fbase: std::ptr::null_mut(),
        dli_sname: std::ptr::null(),
        dli_saddr: std::ptr::null_mut(),
    };
    // SAFETY: dladdr reads the address only and fills our Dl_info.
    if unsafe { libc::dladdr(p, &mut info) } == 0 || info.dli_sname.is_null() || info.dli_saddr != p
    {
        return None;
    }
    // SAFETY: dli_sname is a NUL-terminated string owned by the loader.
    let name = unsafe { CStr::from_ptr(info.dli_sname) }.to_str().ok()?;
    super::wrapper_named(Lib::Cuda, name)
}

fn substitute(result: u32, pfn: *mut *mut c_void) -> u32 {
    if result == 0 && !pfn.is_null() {
        // SAFETY: the real driver just wrote a pointer through pfn, so it is valid for a read/write.
        unsafe {
            if let Some(w) = wrapper_for(*pfn) {
                *pfn = w as *mut c_void;
            }
        }
    }
    result
}

pub fn get_proc_address(
    real: impl Fn(*const c_char, *mut *mut c_void, c_int, u64) -> u32,
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    flags: u64,
) -> u32 {
    substitute(real(symbol, pfn, version, flags), pfn)
}

pub fn get_proc_address_v2(
    real: impl Fn(*const c_char, *mut *mut c_void, c_int, u64, *mut c_int) -> u32,
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    flags: u64,
    status: *mut c_int,
) -> u32 {
    substitute(real(symbol, pfn, version, flags, status), pfn)
}
