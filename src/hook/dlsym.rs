//! The dynamic loader's lookup functions, interposed: `dlsym`, `dlvsym` (and glibc's old
//! private `__libc_dlsym`/`__libc_dlvsym` names), `dlopen` and `dlmopen`.
//!
//! Lookups (`dlsym`, `dlvsym`):
//! - A lookup on a CUDA driver's or NVML's handle of a name we wrap gets our wrapper — any
//!   loaded instance of either library, recognised by its DT_SONAME (a copy of libcuda.so.1
//!   at another path is a second instance, with a handle of its own). Other names on a second
//!   instance's handle are answered from the first (one driver state per process: the wrappers
//!   call the first).
//! - Whatever the handle, an answer that is a wrapped entry point of a driver instance becomes
//!   our wrapper (RTLD_NEXT from an object loaded before libcuda, RTLD_DEFAULT, a handle of
//!   something that depends on libcuda), and an answer that is glibc's own `dlsym`, `dlvsym`,
//!   `dlopen` or `dlmopen` becomes ours: `dlvsym(RTLD_DEFAULT, "dlsym", "GLIBC_2.34")` and
//!   `dlsym(dlopen("libc.so.6"), "dlsym")` no longer hand out a lookup that sees past the
//!   wrappers (issue 15: 4 GiB under a 1 GiB quota that way).
//! - `RTLD_NEXT` keeps meaning "after the caller": we search the objects loaded after the
//!   caller's, as glibc would, instead of letting the real lookup see cuvisor as the caller.
//! - Everything else goes to the real lookup with the caller's own handle, untouched: no
//!   guessing by name prefix, so a library that defines cu* names of its own (cuDNN, cuBLAS) is
//!   never hijacked.
//!
//! Loading (`dlopen`, `dlmopen`): see [`load_flags`].
//!
//! The real functions are found in libc's own dynamic symbol table, read in memory (`elf`):
//! not through `dlsym`/`dlvsym`, which are ours once exported (libcuvisor's own references to
//! them bind to its own exports, preloaded first), so nothing here can recurse.

use super::{elf, Lib};
use std::ffi::{c_char, c_int, c_long, c_void, CStr};
use std::sync::atomic::{AtomicUsize, Ordering::*};
use std::sync::OnceLock;

type DlsymFn = unsafe extern "C" fn(*mut c_void, *const c_char) -> *mut c_void;
type DlvsymFn = unsafe extern "C" fn(*mut c_void, *const c_char, *const c_char) -> *mut c_void;

/// glibc's own loader functions, found once.
struct Glibc {
    dlsym: usize,
    dlvsym: usize,
    dlopen: usize,
    dlmopen: usize,
}

fn glibc() -> &'static Glibc {
    static G: OnceLock<Glibc> = OnceLock::new();
    G.get_or_init(|| {
        // glibc >= 2.34 defines them in libc.so.6; older ones in libdl.so.2.
        let find = |name: &CStr| {
            elf::function_in(c"libc.so.6", name)
                .or_else(|| elf::function_in(c"libdl.so.2", name))
                .unwrap_or(0)
        };
        let g = Glibc {
            dlsym: find(c"dlsym"),
            dlvsym: find(c"dlvsym"),
            dlopen: find(c"dlopen"),
            dlmopen: find(c"dlmopen"),
        };
        REAL_DLOPEN.store(g.dlopen, Release);
        REAL_DLMOPEN.store(g.dlmopen, Release);
        g
    })
}

/// The real dlsym (NULL if glibc has none we can find, which cannot happen on glibc).
pub fn real_dlsym(handle: *mut c_void, name: *const c_char) -> *mut c_void {
    match glibc().dlsym {
        0 => std::ptr::null_mut(),
        // SAFETY: glibc's dlsym, whose signature DlsymFn is, with the caller's arguments.
        f => unsafe { std::mem::transmute::<usize, DlsymFn>(f)(handle, name) },
    }
}

fn real_dlvsym(handle: *mut c_void, name: *const c_char, version: *const c_char) -> *mut c_void {
    match glibc().dlvsym {
        0 => std::ptr::null_mut(),
        // SAFETY: glibc's dlvsym, whose signature DlvsymFn is, with the caller's arguments.
        f => unsafe { std::mem::transmute::<usize, DlvsymFn>(f)(handle, name, version) },
    }
}

/// Which driver library a loaded object is, by its DT_SONAME (any instance, any path).
///
/// # Safety
/// `map` is a live entry of the loader's list.
unsafe fn driver_of(map: *const elf::LinkMap) -> Option<Lib> {
    // SAFETY: by the caller's contract.
    let soname = unsafe { elf::soname_of(map) }?;
    Lib::by_soname(soname.to_str().ok()?)
}

/// Our wrapper for `name` if `p` is a driver instance's definition of a name we wrap; ours for
/// glibc's own loader functions; a second driver instance's other names answered from the
/// first; anything else as it is.
fn vetted(p: *mut c_void, name: &CStr) -> *mut c_void {
    if p.is_null() {
        return p;
    }
    let g = glibc();
    let own: [(usize, usize); 4] = [
        (g.dlsym, dlsym as *const () as usize),
        (g.dlvsym, dlvsym as *const () as usize),
        (g.dlopen, dlopen as *const () as usize),
        (g.dlmopen, dlmopen as *const () as usize),
    ];
    if let Some(&(_, ours)) = own
        .iter()
        .find(|(real, _)| *real != 0 && *real == p as usize)
    {
        return ours as *mut c_void;
    }
    let map = elf::object_of(p);
    if map.is_null() {
        return p;
    }
    // SAFETY: dladdr1 gave the link map of a loaded object.
    let Some(lib) = (unsafe { driver_of(map) }) else {
        return p;
    };
    answer_for(lib, map as *mut c_void, name)
        .or_else(|| {
            exported_name_at(p)
                .and_then(|n| super::wrapper_named(lib, n))
                .map(|w| w as *mut c_void)
        })
        .unwrap_or(p)
}

/// The name the object exports at exactly `p` (dladdr), for an answer found under another
/// name (an alias of a wrapped entry point).
fn exported_name_at(p: *mut c_void) -> Option<&'static str> {
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
    // SAFETY: dli_sname is a NUL-terminated string in the object's string table, which lives as
    // long as the object (a driver, which is not unloaded under a program that uses it).
    unsafe { CStr::from_ptr(info.dli_sname) }.to_str().ok()
}

/// The answer for `name` on an instance `handle` of driver library `lib`: the wrapper of a
/// wrapped name; for a second instance, the first instance's definition of any other name.
fn answer_for(lib: Lib, handle: *mut c_void, name: &CStr) -> Option<*mut c_void> {
    if let Some(w) = name
        .to_str()
        .ok()
        .and_then(|n| super::wrapper_named(lib, n))
    {
        return Some(w as *mut c_void);
    }
    let first = lib.handle();
    if first.is_null() || first == handle {
        return None;
    }
    let p = real_dlsym(first, name.as_ptr());
    (!p.is_null()).then_some(p)
}

/// The driver library `handle` is an instance of, if it is one (checked to be a loaded object
/// before it is read as one).
fn driver_handle(handle: *mut c_void) -> Option<Lib> {
    if handle.is_null() || handle == libc::RTLD_NEXT || handle == libc::RTLD_DEFAULT {
        return None;
    }
    for lib in [Lib::Cuda, Lib::Nvml] {
        if lib.owns(handle) {
            return Some(lib);
        }
    }
    if !elf::is_loaded_object(handle) {
        return None;
    }
    // SAFETY: `handle` is a live entry of the loader's list (just checked).
    unsafe { driver_of(handle as *const elf::LinkMap) }
}

/// One lookup, as `dlsym` (`version` None) or `dlvsym` would do it, for `caller`.
fn lookup(
    handle: *mut c_void,
    name: *const c_char,
    version: Option<*const c_char>,
    caller: *const c_void,
) -> *mut c_void {
    let real = |h: *mut c_void| match version {
        None => real_dlsym(h, name),
        Some(v) => real_dlvsym(h, name, v),
    };
    if name.is_null() {
        return real(handle);
    }
    // SAFETY: non-null, NUL-terminated by dlsym's contract.
    let n = unsafe { CStr::from_ptr(name) };
    if handle == libc::RTLD_NEXT {
        return vetted(next_after(caller, &real), n);
    }
    if let Some(lib) = driver_handle(handle) {
        if let Some(p) = answer_for(lib, handle, n) {
            return p;
        }
    }
    vetted(real(handle), n)
}

/// RTLD_NEXT as the caller meant it: the first object after the caller's, in load order, that
/// defines `name` itself (`real` looks it up on one object's handle).
fn next_after(caller: *const c_void, real: &dyn Fn(*mut c_void) -> *mut c_void) -> *mut c_void {
    let mut map = elf::object_of(caller);
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
        let p = real(h);
        // SAFETY: dropping the reference RTLD_NOLOAD took; the object stays loaded.
        unsafe { libc::dlclose(h) };
        if !p.is_null() && elf::object_of(p) == map {
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
    super::guard(std::ptr::null_mut(), || lookup(handle, name, None, caller))
}

/// The exported `dlvsym`: as `dlsym`, an entry stub appends the caller's return address (a
/// fourth argument). Unversioned, for callers of either glibc version.
#[cfg(target_arch = "x86_64")]
// SAFETY: as for dlsym: only the fourth argument register is written before the tail jump.
#[unsafe(naked)]
#[no_mangle]
pub extern "C" fn dlvsym(
    handle: *mut c_void,
    name: *const c_char,
    version: *const c_char,
) -> *mut c_void {
    std::arch::naked_asm!("mov rcx, [rsp]", "jmp {}", sym dlvsym_with_caller)
}

#[cfg(target_arch = "aarch64")]
// SAFETY: as for x86_64: only the fourth argument register is written before the tail branch.
#[unsafe(naked)]
#[no_mangle]
pub extern "C" fn dlvsym(
    handle: *mut c_void,
    name: *const c_char,
    version: *const c_char,
) -> *mut c_void {
    std::arch::naked_asm!("mov x3, x30", "b {}", sym dlvsym_with_caller)
}

extern "C" fn dlvsym_with_caller(
    handle: *mut c_void,
    name: *const c_char,
    version: *const c_char,
    caller: *const c_void,
) -> *mut c_void {
    super::guard(std::ptr::null_mut(), || {
        lookup(handle, name, Some(version), caller)
    })
}

/// glibc's private lookup before 2.34 (exported as GLIBC_PRIVATE from libc.so.6 then; gone
/// since): answered as `dlsym`, so an old glibc's private entry does not see past the wrappers.
#[no_mangle]
pub extern "C" fn __libc_dlsym(handle: *mut c_void, name: *const c_char) -> *mut c_void {
    super::guard(std::ptr::null_mut(), || {
        lookup(handle, name, None, std::ptr::null())
    })
}

/// As [`__libc_dlsym`], for glibc's private versioned lookup before 2.34.
#[no_mangle]
pub extern "C" fn __libc_dlvsym(
    handle: *mut c_void,
    name: *const c_char,
    version: *const c_char,
) -> *mut c_void {
    super::guard(std::ptr::null_mut(), || {
        lookup(handle, name, Some(version), std::ptr::null())
    })
}

// ---- loading ------------------------------------------------------------------------------------

/// glibc's dlopen and dlmopen, for the stubs' tail jumps (set by `glibc()`, which `load_flags`
/// calls first; 0 if glibc had none: the stub returns NULL).
static REAL_DLOPEN: AtomicUsize = AtomicUsize::new(0);
static REAL_DLMOPEN: AtomicUsize = AtomicUsize::new(0);

/// The flags `dlopen`/`dlmopen` go on with, or -1 to refuse (return NULL).
///
/// - `RTLD_DEEPBIND` puts an object's own dependencies ahead of the global scope for its symbol
///   references (dlopen(3): "Place the lookup scope of the symbols in this shared object ahead
///   of the global scope. This means that a self-contained object will use its own symbols in
///   preference to global symbols with the same name contained in objects that have already
///   been loaded."): a library that needs libcuda, loaded so, binds its cu* calls to libcuda's
///   own definitions ahead of the preloaded wrappers. When the object (not loaded yet) brings a
///   CUDA driver or NVML in among its dependencies (or one cuvisor cannot find to tell), the
///   flag is dropped, with one line on stderr: the object loads into the global scope's order,
///   wrappers first. Any other DEEPBIND load is left as asked (its isolation is what the
///   program wanted, and it cannot reach the driver).
/// - `dlmopen` into a namespace other than the main one loads objects with no cuvisor in front of
///   them (LD_PRELOAD applies to the main namespace only): refused, with one line, when the
///   object brings in a driver. Into the main namespace it is `dlopen`.
///
/// In pass-through mode (no limits configured) nothing is changed.
fn load_flags(
    lmid: Option<c_long>,
    file: *const c_char,
    flags: c_int,
    caller: *const c_void,
) -> c_long {
    let _ = glibc();
    let keep = flags as c_long;
    if file.is_null() || matches!(crate::mode_if_decided(), Some(crate::Mode::PassThrough)) {
        return keep;
    }
    let other_namespace = lmid.is_some_and(|l| l != 0); // LM_ID_BASE
    if flags & libc::RTLD_DEEPBIND == 0 && !other_namespace {
        return keep;
    }
    // SAFETY: non-null, NUL-terminated by dlopen's contract.
    let name = unsafe { CStr::from_ptr(file) }
        .to_string_lossy()
        .into_owned();
    if !other_namespace {
        // Already loaded: its references were bound when it was; DEEPBIND changes nothing.
        // SAFETY: RTLD_NOLOAD never loads; the reference it takes is dropped right away.
        let h = unsafe { libc::dlopen(file, libc::RTLD_LAZY | libc::RTLD_NOLOAD) };
        if !h.is_null() {
            // SAFETY: dropping the reference just taken.
            unsafe { libc::dlclose(h) };
            return keep;
        }
    }
    // Where the loader looks for a bare name on this caller's behalf: the calling object's
    // DT_RUNPATH (or DT_RPATH), then LD_LIBRARY_PATH (and the cache and default directories,
    // which `elf` adds).
    let map = elf::object_of(caller);
    let mut search: Vec<String> = Vec::new();
    if !map.is_null() {
        // SAFETY: dladdr1 gave the link map of the calling object; l_name is its path.
        let path = unsafe { (*map).l_name };
        if !path.is_null() {
            // SAFETY: the loader's NUL-terminated path of a loaded object.
            let path = unsafe { CStr::from_ptr(path) }
                .to_string_lossy()
                .into_owned();
            let own = if path.is_empty() {
                std::fs::read_link("/proc/self/exe").ok()
            } else {
                Some(std::path::PathBuf::from(path))
            };
            if let Some(n) = own.as_deref().and_then(elf::needs_of) {
                search.extend(n.paths);
            }
        }
    }
    search.extend(
        crate::environment("LD_LIBRARY_PATH")
            .map(|v| {
                v.to_string_lossy()
                    .split([':', ';'])
                    .filter(|d| !d.is_empty())
                    .map(String::from)
                    .collect::<Vec<_>>()
            })
            .unwrap_or_default(),
    );
    let Some(why) = elf::driver_in_closure(
        &name,
        |n| Lib::by_soname(n).is_some() || Lib::by_file_name(n).is_some(),
        &search,
    ) else {
        return keep;
    };
    if other_namespace {
        crate::log::error(&format!(
            "dlmopen of {name} into a new namespace refused ({why}): a driver there runs without cuvisor"
        ));
        return -1;
    }
    crate::log::error(&format!(
        "dlopen of {name}: RTLD_DEEPBIND dropped ({why}): deep binding would call the driver past cuvisor"
    ));
    (flags & !libc::RTLD_DEEPBIND) as c_long
}

extern "C" fn dlopen_flags(file: *const c_char, flags: c_int, caller: *const c_void) -> c_long {
    super::guard(flags as c_long, || load_flags(None, file, flags, caller))
}

extern "C" fn dlmopen_flags(
    lmid: c_long,
    file: *const c_char,
    flags: c_int,
    caller: *const c_void,
) -> c_long {
    super::guard(-1, || load_flags(Some(lmid), file, flags, caller))
}

/// The exported `dlopen`: decides the flags, then tail-jumps to glibc's with the caller's own
/// return address in place (glibc finds the calling object from it, for its DT_RUNPATH, $ORIGIN
/// and namespace: a call from cuvisor instead would load as cuvisor's).
#[cfg(target_arch = "x86_64")]
// SAFETY: the stub saves the two argument registers around a call to a C-ABI function (the
// stack 16-byte aligned at the call), restores them with the new flags, and tail-jumps to
// glibc's dlopen with the caller's return address on top of the stack as at entry; with no
// real dlopen it returns NULL itself (a local label: no branch to another section).
#[unsafe(naked)]
#[no_mangle]
pub extern "C" fn dlopen(file: *const c_char, flags: c_int) -> *mut c_void {
    std::arch::naked_asm!(
        "push rdi",
        "push rsi",
        "sub rsp, 8",
        "mov rdx, [rsp + 24]", // the caller's return address
        "call {decide}",
        "add rsp, 8",
        "pop rsi",
        "pop rdi",
        "mov esi, eax",
        "mov rax, qword ptr [rip + {real}]",
        "test rax, rax",
        "jz 2f",
        "jmp rax",
        "2:",
        "ret", // rax is 0: NULL
        decide = sym dlopen_flags,
        real = sym REAL_DLOPEN,
    )
}

#[cfg(target_arch = "aarch64")]
// SAFETY: as for x86_64: the argument registers and the link register are saved on a 16-byte
// aligned frame around the call, restored, and the branch to glibc's dlopen leaves x30 the
// caller's return address.
#[unsafe(naked)]
#[no_mangle]
pub extern "C" fn dlopen(file: *const c_char, flags: c_int) -> *mut c_void {
    std::arch::naked_asm!(
        "stp x29, x30, [sp, -32]!",
        "stp x0, x1, [sp, 16]",
        "mov x2, x30", // the caller's return address
        "bl {decide}",
        "mov x1, x0",
        "ldr x0, [sp, 16]",
        "ldp x29, x30, [sp], 32",
        "adrp x16, {real}",
        "ldr x16, [x16, :lo12:{real}]",
        "cbz x16, 2f",
        "br x16",
        "2:",
        "mov x0, xzr",
        "ret",
        decide = sym dlopen_flags,
        real = sym REAL_DLOPEN,
    )
}

/// The exported `dlmopen`: as `dlopen`; flags of -1 return NULL there and then (refused).
#[cfg(target_arch = "x86_64")]
// SAFETY: as for dlopen, with three argument registers saved (rdi, rsi, rdx: 3 pushes and the
// return address keep the stack 16-byte aligned at the call).
#[unsafe(naked)]
#[no_mangle]
pub extern "C" fn dlmopen(lmid: c_long, file: *const c_char, flags: c_int) -> *mut c_void {
    std::arch::naked_asm!(
        "push rdi",
        "push rsi",
        "push rdx",
        "mov rcx, [rsp + 24]", // the caller's return address
        "call {decide}",
        "pop rdx",
        "pop rsi",
        "pop rdi",
        "test rax, rax",
        "js 2f",
        "mov edx, eax",
        "mov rax, qword ptr [rip + {real}]",
        "test rax, rax",
        "jz 2f",
        "jmp rax",
        "2:",
        "xor eax, eax",
        "ret",
        decide = sym dlmopen_flags,
        real = sym REAL_DLMOPEN,
    )
}

#[cfg(target_arch = "aarch64")]
// SAFETY: as for the aarch64 dlopen, with x2 saved as well.
#[unsafe(naked)]
#[no_mangle]
pub extern "C" fn dlmopen(lmid: c_long, file: *const c_char, flags: c_int) -> *mut c_void {
    std::arch::naked_asm!(
        "stp x29, x30, [sp, -48]!",
        "stp x0, x1, [sp, 16]",
        "str x2, [sp, 32]",
        "mov x3, x30", // the caller's return address
        "bl {decide}",
        "mov x2, x0",
        "ldp x0, x1, [sp, 16]",
        "ldp x29, x30, [sp], 48",
        "tbnz x2, 63, 2f",
        "adrp x16, {real}",
        "ldr x16, [x16, :lo12:{real}]",
        "cbz x16, 2f",
        "br x16",
        "2:",
        "mov x0, xzr",
        "ret",
        decide = sym dlmopen_flags,
        real = sym REAL_DLMOPEN,
    )
}
