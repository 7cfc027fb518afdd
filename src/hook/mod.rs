//! Symbol interposition, and nothing else: the table of wrapped entry points, finding the real
//! ones, the `dlsym` override and `cuGetProcAddress`. A wrapper asks `quota` and forwards to the
//! real driver; the rules live in `cuda.rs` and `nvml.rs`.
//!
//! Three ways a program reaches the driver, one set of wrappers:
//! 1. linked against libcuda: our exported symbols come first (LD_PRELOAD / ld.so.preload);
//! 2. `dlsym`/`dlvsym` on libcuda's or libnvidia-ml's handle (any instance of either, by
//!    DT_SONAME): our `dlsym`/`dlvsym` answer with the wrapper; `dlopen` keeps a library that
//!    brings the driver in from binding past the wrappers (RTLD_DEEPBIND, `dlmopen`);
//! 3. `cuGetProcAddress(_v2)`: the real driver picks the entry point (base name + cudaVersion +
//!    flags), and we hand back our wrapper of exactly that symbol.

mod cuda;
mod cudart_table;
mod device;
mod dlsym;
mod elf;
mod graph;
mod launch;
mod module;
mod nvml;
mod procaddr;

use std::ffi::{c_void, CStr};
use std::sync::atomic::{AtomicUsize, Ordering::*};

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Lib {
    Cuda,
    Nvml,
}

impl Lib {
    /// The library whose DT_SONAME is `soname` (any instance of it, at any path).
    pub fn by_soname(soname: &str) -> Option<Lib> {
        [Lib::Cuda, Lib::Nvml]
            .into_iter()
            .find(|l| l.soname().to_bytes() == soname.as_bytes())
    }
    /// The library a file name stands for (libcuda.so, libcuda.so.1, libcuda.so.550.54...).
    pub fn by_file_name(name: &str) -> Option<Lib> {
        [(Lib::Cuda, "libcuda.so"), (Lib::Nvml, "libnvidia-ml.so")]
            .into_iter()
            .find(|(_, stem)| {
                name.strip_prefix(stem)
                    .is_some_and(|rest| rest.is_empty() || rest.starts_with('.'))
            })
            .map(|(l, _)| l)
    }
    fn soname(self) -> &'static CStr {
        match self {
            Lib::Cuda => c"libcuda.so.1",
            Lib::Nvml => c"libnvidia-ml.so.1",
        }
    }
    fn slot(self) -> &'static AtomicUsize {
        static CUDA: AtomicUsize = AtomicUsize::new(0);
        static NVML: AtomicUsize = AtomicUsize::new(0);
        match self {
            Lib::Cuda => &CUDA,
            Lib::Nvml => &NVML,
        }
    }
    /// The real library's handle, loading it if the program has not yet.
    pub fn handle(self) -> *mut c_void {
        let slot = self.slot();
        let h = slot.load(Acquire);
        if h != 0 {
            return h as *mut c_void;
        }
        // SAFETY: dlopen of the driver's own soname; we keep the reference for good.
        let h = unsafe { libc::dlopen(self.soname().as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if !h.is_null() {
            slot.store(h as usize, Release);
        }
        h
    }
    /// Whether `handle` is this library's, as the program got it from dlopen.
    fn owns(self, handle: *mut c_void) -> bool {
        if handle.is_null() {
            return false;
        }
        let known = self.slot().load(Acquire);
        if known != 0 {
            return known == handle as usize;
        }
        // Not loaded by us yet: is the program's handle the driver's? (NOLOAD finds it by soname.)
        // SAFETY: RTLD_NOLOAD never loads anything; it only returns an existing handle.
        let h = unsafe { libc::dlopen(self.soname().as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
        if h.is_null() {
            return false;
        }
        if self
            .slot()
            .compare_exchange(0, h as usize, AcqRel, Acquire)
            .is_err()
        {
            // SAFETY: dropping the extra reference NOLOAD took; the library stays loaded.
            unsafe { libc::dlclose(h) };
        }
        self.slot().load(Acquire) == handle as usize
    }
}

/// The real entry point behind a wrapper, resolved on first use (then one atomic load).
pub struct Real {
    lib: Lib,
    name: &'static CStr,
    addr: AtomicUsize,
}

impl Real {
    pub const fn new(lib: Lib, name: &'static CStr) -> Real {
        Real {
            lib,
            name,
            addr: AtomicUsize::new(0),
        }
    }
    /// The address, or 0 if the real library lacks the symbol.
    pub fn get(&self) -> usize {
        let a = self.addr.load(Acquire);
        if a != 0 {
            return a;
        }
        let h = self.lib.handle();
        if h.is_null() {
            return 0;
        }
        let p = dlsym::real_dlsym(h, self.name.as_ptr()) as usize;
        self.addr.store(p, Release);
        p
    }
}

/// One row of the table: an exported wrapper and the real entry point it stands for.
pub struct Hook {
    pub name: &'static str,
    pub lib: Lib,
    pub wrapper: usize,
    pub real: &'static Real,
}

/// Runs a wrapper body behind the panic boundary all three libraries share
/// (`cuvisor_cuda_abi::ffi::catch`): a bug in cuvisor becomes an error code with one line on
/// stderr, never an unwind into the program.
pub fn guard<R: Copy>(on_panic: R, f: impl FnOnce() -> R) -> R {
    cuvisor_cuda_abi::ffi::catch(f, || {
        crate::log::error("internal error in a wrapped call (refused; please report)");
        on_panic
    })
}

/// The table of wrapped entry points. One line per entry point:
/// `Cuda|Nvml NAME(ARGS) => IMPL;` where IMPL gets the real entry point as a safe closure first.
macro_rules! hooks {
    ($( $lib:ident $name:ident ( $($a:ident : $t:ty),* $(,)? ) => $imp:path; )*) => {
        $(
            /// The real entry point behind the wrapper of the same name.
            #[allow(non_snake_case)]
            pub mod $name {
                pub static REAL: $crate::hook::Real = $crate::hook::Real::new($crate::hook::Lib::$lib, {
                    // SAFETY: a NUL-terminated literal.
                    unsafe { std::ffi::CStr::from_bytes_with_nul_unchecked(concat!(stringify!($name), "\0").as_bytes()) }
                });
            }

            #[no_mangle]
            pub extern "C" fn $name($($a: $t),*) -> u32 {
                let addr = $name::REAL.get();
                if addr == 0 {
                    return hooks!(@missing $lib);
                }
                // SAFETY: `addr` is the real library's export of this very name, whose C signature
                // is the one this wrapper is declared with (the same ABI version, by name).
                let f: unsafe extern "C" fn($($t),*) -> u32 = unsafe { std::mem::transmute(addr) };
                // SAFETY: forwarding the caller's own arguments to the real entry point.
                let real = move |$($a: $t),*| unsafe { f($($a),*) };
                $crate::hook::guard(hooks!(@panic $lib), move || $imp(real, $($a),*))
            }
        )*

        /// Every wrapped entry point.
        pub fn table() -> &'static [$crate::hook::Hook] {
            static TABLE: std::sync::OnceLock<Vec<$crate::hook::Hook>> = std::sync::OnceLock::new();
            TABLE.get_or_init(|| {
                vec![$( $crate::hook::Hook {
                    name: stringify!($name),
                    lib: $crate::hook::Lib::$lib,
                    wrapper: $name as *const () as usize,
                    real: &$name::REAL,
                } ),*]
            })
        }
    };
    // The real library lacks it: CUDA_ERROR_NOT_SUPPORTED / NVML_ERROR_FUNCTION_NOT_FOUND.
    (@missing Cuda) => { cuvisor_cuda_abi::cuda::err::NOT_SUPPORTED };
    (@missing Nvml) => { cuvisor_cuda_abi::nvml::ret::ERROR_FUNCTION_NOT_FOUND };
    // A panic inside cuvisor: CUDA_ERROR_UNKNOWN / NVML_ERROR_UNKNOWN.
    (@panic Cuda) => { <cuvisor_cuda_abi::ffi::Cuda as cuvisor_cuda_abi::ffi::Api>::INTERNAL };
    (@panic Nvml) => { <cuvisor_cuda_abi::ffi::Nvml as cuvisor_cuda_abi::ffi::Api>::INTERNAL };
}
pub(crate) use hooks;

/// Every wrapped entry point, all tables.
pub fn all_hooks() -> impl Iterator<Item = &'static Hook> {
    cuda::table()
        .iter()
        .chain(launch::table())
        .chain(module::table())
        .chain(cudart_table::table())
        .chain(graph::table())
        .chain(nvml::table())
}

/// The wrapper exported for `name` of `lib`, if cuvisor wraps it.
pub fn wrapper_named(lib: Lib, name: &str) -> Option<usize> {
    all_hooks()
        .find(|h| h.lib == lib && h.name == name)
        .map(|h| h.wrapper)
}
