//! The C boundary, one copy for libcuvisor and both simulated libraries: the panic guard every
//! exported function runs behind, the `export!` macro that declares one, and the checked reads and
//! writes of the pointers C hands in.
//!
//! What the boundary answers by itself (a NULL pointer, a panic) depends on the API, and the API is
//! chosen by a type parameter: [`Cuda`] answers `CUDA_ERROR_INVALID_VALUE` / `CUDA_ERROR_UNKNOWN`,
//! [`Nvml`] `NVML_ERROR_INVALID_ARGUMENT` / `NVML_ERROR_UNKNOWN`. Both APIs' status codes are a C
//! `unsigned int`, so the codes travel as `u32`.
//!
//! The pointer helpers are `unsafe fn`s: their callers, the exported functions, vouch for the
//! contract they rely on, which is the APIs' own: every pointer argument is either NULL or
//! valid for the access the function documents. NULL is checked (both drivers answer it with their
//! invalid-argument code); the rest cannot be checked from here and is taken on trust, as the real
//! libraries do.

use std::ffi::{c_char, CStr};
use std::panic::AssertUnwindSafe;

/// The codes the boundary itself answers with, per API.
pub trait Api {
    const SUCCESS: u32;
    /// A NULL (or unreadable string) argument.
    const BAD_ARGUMENT: u32;
    /// A panic inside the library: a bug, reported as the API's "unknown error".
    const INTERNAL: u32;
}

/// The CUDA driver API (`CUresult`).
pub enum Cuda {}
/// NVML (`nvmlReturn_t`).
pub enum Nvml {}

impl Api for Cuda {
    const SUCCESS: u32 = crate::cuda::err::SUCCESS;
    const BAD_ARGUMENT: u32 = crate::cuda::err::INVALID_VALUE;
    const INTERNAL: u32 = crate::cuda::err::UNKNOWN;
}

impl Api for Nvml {
    const SUCCESS: u32 = crate::nvml::ret::SUCCESS;
    const BAD_ARGUMENT: u32 = crate::nvml::ret::ERROR_INVALID_ARGUMENT;
    const INTERNAL: u32 = crate::nvml::ret::ERROR_UNKNOWN;
}

/// Runs `f`; a panic answers what `on_panic` makes (where a library may also report it) instead
/// of an unwind into C (which would abort the program, or worse).
pub fn catch<R>(f: impl FnOnce() -> R, on_panic: impl FnOnce() -> R) -> R {
    std::panic::catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|_| on_panic())
}

/// The body of an exported function: `Ok` is the API's success, `Err(code)` that code, a panic
/// its internal error.
pub fn guard<A: Api>(f: impl FnOnce() -> Result<(), u32>) -> u32 {
    catch(|| f().err().unwrap_or(A::SUCCESS), || A::INTERNAL)
}

/// Defines exported entry points of API `$api` ([`Cuda`] or [`Nvml`]). Each body returns
/// `Result<(), u32>` and runs behind [`guard`].
#[macro_export]
macro_rules! export {
    ($api:ty; $( $(#[$m:meta])* fn $name:ident ( $($a:ident : $t:ty),* $(,)? ) $body:block )*) => {$(
        $(#[$m])*
        #[no_mangle]
        pub extern "C" fn $name($($a: $t),*) -> u32 {
            $crate::ffi::guard::<$api>(move || $body)
        }
    )*};
}

/// `*p = v`; the API's invalid-argument code when `p` is NULL.
///
/// # Safety
/// `p` is NULL or valid for one write of `T` (the API's contract for the argument).
pub unsafe fn write<A: Api, T>(p: *mut T, v: T) -> Result<(), u32> {
    if p.is_null() {
        return Err(A::BAD_ARGUMENT);
    }
    // SAFETY: non-null, and by the caller's contract valid for one write of T (unaligned
    // tolerated).
    unsafe { p.write_unaligned(v) };
    Ok(())
}

/// `*p`; the API's invalid-argument code when `p` is NULL.
///
/// # Safety
/// `p` is NULL or valid for one read of `T`.
pub unsafe fn read<A: Api, T: Copy>(p: *const T) -> Result<T, u32> {
    if p.is_null() {
        return Err(A::BAD_ARGUMENT);
    }
    // SAFETY: non-null, and by the API contract valid for one read of T.
    Ok(unsafe { p.read_unaligned() })
}

/// Writes `items` to a caller array that the caller has checked holds at least `items.len()`
/// elements (against the count the API passes with it).
///
/// # Safety
/// `p` is NULL or valid for `items.len()` writes of `T`.
pub unsafe fn write_array<A: Api, T: Copy>(p: *mut T, items: &[T]) -> Result<(), u32> {
    if items.is_empty() {
        return Ok(());
    }
    if p.is_null() {
        return Err(A::BAD_ARGUMENT);
    }
    for (i, v) in items.iter().enumerate() {
        // SAFETY: non-null, and the caller checked that the array holds items.len() elements.
        unsafe { p.add(i).write_unaligned(*v) };
    }
    Ok(())
}

/// A NUL-terminated UTF-8 argument; the invalid-argument code when NULL or not UTF-8.
///
/// # Safety
/// `p` is NULL or a NUL-terminated string alive for `'a`.
pub unsafe fn cstr<'a, A: Api>(p: *const c_char) -> Result<&'a str, u32> {
    if p.is_null() {
        return Err(A::BAD_ARGUMENT);
    }
    // SAFETY: non-null and, by the API contract, a NUL-terminated string alive for this call.
    unsafe { CStr::from_ptr(p) }
        .to_str()
        .map_err(|_| A::BAD_ARGUMENT)
}

/// Copies `s` into a caller buffer of `len` bytes, truncated to `len - 1` bytes and NUL-terminated
/// (the CUDA driver's string queries truncate); the invalid-argument code for NULL or `len == 0`.
///
/// # Safety
/// `dst` is NULL or valid for `len` bytes of writes.
pub unsafe fn write_cstr_truncated<A: Api>(
    dst: *mut c_char,
    len: usize,
    s: &str,
) -> Result<(), u32> {
    if dst.is_null() || len == 0 {
        return Err(A::BAD_ARGUMENT);
    }
    let n = s.len().min(len - 1);
    // SAFETY: dst is non-null and, by the API contract, `len` bytes long; we write n + 1 <= len.
    unsafe {
        std::ptr::copy_nonoverlapping(s.as_ptr(), dst as *mut u8, n);
        *dst.add(n) = 0;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn null_pointers_answer_each_apis_invalid_argument_code() {
        let null: *mut u32 = std::ptr::null_mut();
        // SAFETY: NULL pointers, which the helpers check before any access.
        unsafe {
            assert_eq!(
                write::<Cuda, _>(null, 1),
                Err(1),
                "CUDA_ERROR_INVALID_VALUE"
            );
            assert_eq!(
                write::<Nvml, _>(null, 1),
                Err(2),
                "NVML_ERROR_INVALID_ARGUMENT"
            );
            assert_eq!(read::<Cuda, u32>(null), Err(1));
            assert_eq!(cstr::<Nvml>(std::ptr::null()), Err(2));
        }
    }

    #[test]
    fn a_panic_is_the_apis_unknown_error_and_success_is_zero() {
        assert_eq!(guard::<Cuda>(|| panic!("bug")), 999, "CUDA_ERROR_UNKNOWN");
        assert_eq!(guard::<Nvml>(|| panic!("bug")), 999, "NVML_ERROR_UNKNOWN");
        assert_eq!(guard::<Cuda>(|| Ok(())), 0);
        assert_eq!(guard::<Cuda>(|| Err(201)), 201);
    }

    #[test]
    fn strings_are_truncated_with_their_nul() {
        let mut buf = [0x7f as c_char; 4];
        let mut arr = [0u16; 3];
        // SAFETY: buffers of the lengths passed.
        unsafe {
            write_cstr_truncated::<Cuda>(buf.as_mut_ptr(), buf.len(), "abcdef").unwrap();
            assert_eq!(
                write_cstr_truncated::<Cuda>(buf.as_mut_ptr(), 0, "x"),
                Err(1)
            );
            write_array::<Nvml, _>(arr.as_mut_ptr(), &[1, 2]).unwrap();
        }
        assert_eq!(buf.map(|c| c as u8), *b"abc\0");
        assert_eq!(arr, [1, 2, 0]);
    }
}
