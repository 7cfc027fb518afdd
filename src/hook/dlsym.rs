//! The `dlsym` override.
//!
//! - A lookup on libcuda's or libnvidia-ml's handle of a name we wrap gets our wrapper.
//! - `RTLD_NEXT` keeps meaning "after the caller": we search the objects loaded after the
//!   caller's, as glibc would, instead of letting the real dlsym see cuvisor as the caller.
//! - Everything else goes to the real dlsym with the caller's own handle, untouched: no guessing
//!   by name prefix, so a library that defines cu* names of its own (cuDNN, cuBLAS) is never
//!   hijacked.
//!
//! The real dlsym is found with `dlvsym`, which we do not override, so there is no recursion.

use super::Lib;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::OnceLock;

type DlsymFn = unsafe extern "C" fn(*mut c_void, *const c_char) -> *mut c_void;

/// glibc's `struct link_map` (the public prefix of it, from <link.h>).
#[repr(C)]
struct LinkMap {
    l_addr: usize,
    l_name: *const c_char,
    l_ld: *mut c_void,
    l_next: *mut LinkMap,
    l_prev: *mut LinkMap,
}

extern "C" {
    fn dladdr1(
        addr: *const c_void,
        info: *mut libc::Dl_info,
        extra: *mut *mut c_void,
        flags: c_int,
    ) -> c_int;
}
const RTLD_DL_LINKMAP: c_int = 2;

fn real() -> Option<DlsymFn> {
    static REAL: OnceLock<Option<DlsymFn>> = OnceLock::new();
    *REAL.get_or_init(|| {
        for version in [c"GLIBC_2.34", c"GLIBC_2.2.5"] {
            // SAFETY: dlvsym with RTLD_NEXT from this library finds libc's dlsym of that version.
            let p = unsafe { libc::dlvsym(libc::RTLD_NEXT, c"dlsym".as_ptr(), version.as_ptr()) };
            if !p.is_null() {
                // SAFETY: it is dlsym, whose signature DlsymFn is.
                return Some(unsafe { std::mem::transmute::<*mut c_void, DlsymFn>(p) });
            }
        }
        None
    })
}

/// The real dlsym (NULL if glibc has none we can find, which cannot happen on glibc).
pub fn real_dlsym(handle: *mut c_void, name: *const c_char) -> *mut c_void {
    match real() {
        // SAFETY: forwarding a lookup to the real dlsym with the caller's arguments.
        Some(f) => unsafe { f(handle, name) },
        None => std::ptr::null_mut(),
    }
}

fn empty_info() -> libc::Dl_info {
    libc::Dl_info {
        dli_fname: std::ptr::null(),
        dli_fbase: std::ptr::null_mut(),
        dli_sname: std::ptr::null(),
        dli_saddr: std::ptr::null_mut(),
    }
}

/// The link map of the object containing `addr`.
fn object_of(addr: *const c_void) -> *mut LinkMap {
    let mut info = empty_info();
    let mut map: *mut c_void = std::ptr::null_mut();
    // SAFETY: dladdr1 only reads `addr` as an address and fills our two out-parameters.
    if unsafe { dladdr1(addr, &mut info, &mut map, RTLD_DL_LINKMAP) } == 0 {
        return std::ptr::null_mut();
    }
    map as *mut LinkMap
}

/// RTLD_NEXT as the caller meant it: the first object after the caller's, in load order, that
/// defines `name` itself.
fn next_after(caller: *const c_void, name: *const c_char) -> *mut c_void {
    let mut map = object_of(caller);
    while !map.is_null() {
        // SAFETY: `map` is a live entry of the loader's list of loaded objects.
        map = unsafe { (*map).l_next };
        if map.is_null() {
            break;
        }
        // SAFETY: as above; l_name is the loader's NUL-terminated path of the object.
        let file = unsafe { (*map).l_name };
        let h = if file.is_null() {
            std::ptr::null_mut()
        } else {
            // SAFETY: RTLD_NOLOAD only returns a handle for an object already loaded (the vDSO
            // and other pseudo-objects have none, and are skipped).
            unsafe { libc::dlopen(file, libc::RTLD_LAZY | libc::RTLD_NOLOAD) }
        };
        if h.is_null() {
            continue;
        }
        let p = real_dlsym(h, name);
        // SAFETY: dropping the reference RTLD_NOLOAD took; the object stays loaded.
        unsafe { libc::dlclose(h) };
        if !p.is_null() && object_of(p) == map {
            return p;
        }
    }
    std::ptr::null_mut()
}

/// The exported `dlsym`: an entry stub that appends its caller's return address (which
/// RTLD_NEXT depends on and Rust cannot read otherwise) as a third argument and jumps on.
///
/// Unversioned, so the dynamic linker binds it for callers linked against either of glibc's
/// versions (dlsym@GLIBC_2.2.5 before glibc 2.34, dlsym@GLIBC_2.34 after): an unversioned
/// definition satisfies a versioned reference. Tests link programs to both.
#[cfg(target_arch = "x86_64")]
// SAFETY: the stub touches no stack and no callee-saved register; it fills the third argument
// register and tail-jumps to a function with the matching C signature.
#[unsafe(naked)]
#[no_mangle]
pub extern "C" fn dlsym(handle: *mut c_void, name: *const c_char) -> *mut c_void {
    // At entry [rsp] is the return address; handle and name stay in rdi and rsi.
    std::arch::naked_asm!("mov rdx, [rsp]", "jmp {}", sym dlsym_with_caller)
}

#[cfg(target_arch = "aarch64")]
// SAFETY: as for x86_64: only the third argument register is written before the tail branch.
#[unsafe(naked)]
#[no_mangle]
pub extern "C" fn dlsym(handle: *mut c_void, name: *const c_char) -> *mut c_void {
    // At entry x30 (the link register) is the return address; handle and name stay in x0, x1.
    std::arch::naked_asm!("mov x2, x30", "b {}", sym dlsym_with_caller)
}

extern "C" fn dlsym_with_caller(
    handle: *mut c_void,
    name: *const c_char,
    caller: *const c_void,
) -> *mut c_void {
    super::guard(std::ptr::null_mut(), || {
        if name.is_null() {
            return real_dlsym(handle, name);
        }
        if handle == libc::RTLD_NEXT {
            return next_after(caller, name);
        }
        for lib in [Lib::Cuda, Lib::Nvml] {
            if lib.owns(handle) {
                // SAFETY: non-null, NUL-terminated by dlsym's contract.
                let n = unsafe { CStr::from_ptr(name) };
                if let Some(w) = n.to_str().ok().and_then(|n| super::wrapper_named(lib, n)) {
                    return w as *mut c_void;
                }
            }
        }
        real_dlsym(handle, name)
    })
}
