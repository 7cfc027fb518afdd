//! The simulated NVML, built as `libnvidia-ml.so.1`.
//!
//! Real clients (nvml-wrapper, C programs, nvidia-smi-like tools) run on it unmodified. It answers
//! from the machine model (`CUVISOR_SIM`) and from the state every simulator process shares
//! (`CUVISOR_SIM_STATE`): memory in use and the per-process list come from what the simulated
//! driver charged, utilization from its kernel timeline, XID events and NVLinks that are down from
//! fault injection. NVML itself never takes a process slot: a monitor is not a GPU process.
//!
//! Layout: FFI helpers, init/shutdown and system queries here; `device` handles, identity, memory,
//! processes and utilization; `sensors` temperature, power and compute mode; `topology` PCIe/NUMA
//! placement, NVLinks and peer-to-peer status; `events` event sets;
//! `stubs` the entry points answered with NVML_ERROR_NOT_SUPPORTED.
//!
//! Where NVIDIA's documentation left a behaviour open, the choice and its source are noted at the
//! function.
#![allow(clippy::missing_safety_doc)]

mod device;
mod events;
mod sensors;
mod stubs;
mod topology;

use cuvisor_cuda_abi::ffi::{self, Nvml};
use cuvisor_cuda_abi::nvml::{nvmlReturn_t, ret};
use cuvisor_sim::Sim;
use std::ffi::{c_char, c_int, c_uint, CStr, CString};
use std::sync::{Mutex, OnceLock};

pub(crate) type Res = Result<(), nvmlReturn_t>;

// ---- the C boundary -----------------------------------------------------------------------------
// One copy for libcuvisor and both simulated libraries (`cuvisor_cuda_abi::ffi`); these names fix
// the API to NVML's, whose codes the boundary answers with: NVML_ERROR_INVALID_ARGUMENT for a NULL
// pointer or string (as NVML does), NVML_ERROR_UNKNOWN for a panic (a bug in the simulator, never
// an unwind into C).

/// Defines exported NVML entry points. Each body returns `Res` and runs behind `ffi::guard`.
macro_rules! export {
    ($($t:tt)*) => { cuvisor_cuda_abi::export!(cuvisor_cuda_abi::ffi::Nvml; $($t)*); };
}
pub(crate) use export;

pub(crate) fn write<T>(p: *mut T, v: T) -> Res {
    // SAFETY: the exported functions pass their caller's pointer arguments, which the API
    // contract makes NULL or valid for this access.
    unsafe { ffi::write::<Nvml, T>(p, v) }
}

pub(crate) fn read<T: Copy>(p: *const T) -> Result<T, nvmlReturn_t> {
    // SAFETY: the exported functions pass their caller's pointer arguments, which the API
    // contract makes NULL or valid for this access.
    unsafe { ffi::read::<Nvml, T>(p) }
}

/// Writes `items` to a caller array the caller has sized: at least `items.len()` elements.
pub(crate) fn write_array<T: Copy>(p: *mut T, items: &[T]) -> Res {
    // SAFETY: the exported functions pass their caller's pointer arguments, which the API
    // contract makes NULL or valid for this access.
    unsafe { ffi::write_array::<Nvml, T>(p, items) }
}

pub(crate) fn cstr<'a>(p: *const c_char) -> Result<&'a str, nvmlReturn_t> {
    // SAFETY: the exported functions pass their caller's pointer arguments, which the API
    // contract makes NULL or valid for this access.
    unsafe { ffi::cstr::<Nvml>(p) }
}

/// Copies `s` NUL-terminated into a caller buffer of `len` bytes; NVML_ERROR_INSUFFICIENT_SIZE
/// when it does not fit (NVML's string queries do not truncate).
pub(crate) fn write_str(dst: *mut c_char, len: c_uint, s: &str) -> Res {
    if dst.is_null() {
        return Err(ret::ERROR_INVALID_ARGUMENT);
    }
    if s.len() + 1 > len as usize {
        return Err(ret::ERROR_INSUFFICIENT_SIZE);
    }
    // SAFETY: as above; `len` is the caller's own buffer length.
    unsafe { ffi::write_cstr_truncated::<Nvml>(dst, len as usize, s) }
}

/// Copies at most `len - 1` bytes of `s` and a NUL into a caller buffer of `len` bytes.
pub(crate) fn write_str_truncated(dst: *mut c_char, len: c_uint, s: &str) -> Res {
    // SAFETY: the exported functions pass their caller's pointer arguments, which the API
    // contract makes NULL or valid for this access.
    unsafe { ffi::write_cstr_truncated::<Nvml>(dst, len as usize, s) }
}

/// A fixed C char array holding `s` (truncated to fit with its NUL), for struct fields.
pub(crate) fn c_array<const N: usize>(s: &str) -> [c_char; N] {
    let mut out = [0 as c_char; N];
    for (o, b) in out.iter_mut().zip(s.bytes().take(N.saturating_sub(1))) {
        *o = b as c_char;
    }
    out
}

// ---- library state ------------------------------------------------------------------------------

/// nvmlInit* calls not yet matched by nvmlShutdown: NVML is reference counted.
static REFS: Mutex<u32> = Mutex::new(0);

fn refs() -> std::sync::MutexGuard<'static, u32> {
    REFS.lock().unwrap_or_else(|e| e.into_inner())
}

/// The simulator, or NVML_ERROR_UNINITIALIZED outside an nvmlInit/nvmlShutdown pair.
pub(crate) fn sim() -> Result<&'static Sim, nvmlReturn_t> {
    if *refs() == 0 {
        return Err(ret::ERROR_UNINITIALIZED);
    }
    Sim::global().map_err(|_| ret::ERROR_UNINITIALIZED)
}

fn init() -> Res {
    let mut n = refs();
    Sim::global().map_err(|e| {
        // The closest thing the real library has to "no usable GPU stack": one line, then the code.
        eprintln!("cuvisor-sim (NVML): {e}");
        ret::ERROR_DRIVER_NOT_LOADED
    })?;
    *n = n.saturating_add(1);
    Ok(())
}

export! {
    /// The pre-5.319 entry point; same behaviour as nvmlInit_v2 here (the v1 difference, attaching
    /// every GPU at once, is invisible on the simulator).
    fn nvmlInit() { init() }

    fn nvmlInit_v2() { init() }

    /// NO_GPUS / NO_ATTACH change nothing: the simulated machine always has GPUs and attaching is
    /// free. Unknown bits are ignored, as the docs list no error for them.
    fn nvmlInitWithFlags(_flags: c_uint) { init() }

    /// Reference counted like the real library: only the last call shuts down (event sets are
    /// freed then). NVIDIA's docs say both "no error is reported if nvmlShutdown() is called more
    /// times than nvmlInit()" and "NVML_ERROR_UNINITIALIZED if the library has not been
    /// successfully initialized"; pynvml on real drivers raises Uninitialized for an unmatched
    /// shutdown, so that is what an extra call gets here.
    fn nvmlShutdown() {
        let mut n = refs();
        if *n == 0 {
            return Err(ret::ERROR_UNINITIALIZED);
        }
        *n -= 1;
        if *n == 0 {
            events::free_all();
        }
        Ok(())
    }

    fn nvmlSystemGetDriverVersion(version: *mut c_char, length: c_uint) {
        write_str(version, length, &sim()?.model.driver_release)
    }

    /// NVML's version string is the CUDA major version, then the driver's: "12.570.124.06" on
    /// R570, "13.580.95.05" on R580.
    fn nvmlSystemGetNVMLVersion(version: *mut c_char, length: c_uint) {
        let m = &sim()?.model;
        write_str(version, length, &format!("{}.{}", m.driver_version / 1000, m.driver_release))
    }

    fn nvmlSystemGetCudaDriverVersion(version: *mut c_int) {
        write(version, sim()?.model.driver_version)
    }

    fn nvmlSystemGetCudaDriverVersion_v2(version: *mut c_int) {
        write(version, sim()?.model.driver_version)
    }

    /// The process's command (first word of its command line, like the real NVML), truncated to
    /// the buffer; NVML_ERROR_NOT_FOUND when there is no such process.
    fn nvmlSystemGetProcessName(pid: c_uint, name: *mut c_char, length: c_uint) {
        sim()?;
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).map_err(|_| ret::ERROR_NOT_FOUND)?;
        let first = cmdline.split(|b| *b == 0).next().unwrap_or_default();
        let text = if first.is_empty() {
            std::fs::read_to_string(format!("/proc/{pid}/comm"))
                .map_err(|_| ret::ERROR_NOT_FOUND)?
                .trim_end()
                .to_string()
        } else {
            String::from_utf8_lossy(first).into_owned()
        };
        write_str_truncated(name, length, &text)
    }
}

/// `nvmlErrorString`: a static description of any code (unknown ones read "Unknown Error"); usable
/// before nvmlInit, as with the real library.
#[no_mangle]
pub extern "C" fn nvmlErrorString(result: nvmlReturn_t) -> *const c_char {
    static TABLE: OnceLock<Vec<(nvmlReturn_t, CString)>> = OnceLock::new();
    static FALLBACK: &CStr = c"Unknown Error";
    std::panic::catch_unwind(|| {
        let t = TABLE.get_or_init(|| {
            ret::TABLE
                .iter()
                .filter_map(|(v, s)| CString::new(*s).ok().map(|c| (*v, c)))
                .collect()
        });
        t.iter()
            .find(|(v, _)| *v == result)
            .map_or(FALLBACK.as_ptr(), |(_, s)| s.as_ptr())
    })
    .unwrap_or(FALLBACK.as_ptr())
}
