//! Error log management (CUDA 12.9, `\defgroup CUDA_LOGS`): the real driver keeps a buffer of up
//! to 25600 bytes of error and warning messages and hands them to registered callbacks, to
//! iterators and to dumps. The simulated driver records no messages (its errors are the codes it
//! returns), so the buffer stays empty: callbacks are registered and unregistered but never
//! called, the iterator stays at 0, and dumps write nothing. What the calls check is what cuda.h
//! 13.5 documents for them (quoted at each).

use crate::{cstr, drv, export, read, write, Res};
use cuvisor_cuda_abi::cuda::err;
use std::collections::HashSet;
use std::ffi::{c_char, c_uint, c_void};
use std::sync::{Mutex, OnceLock};

/// `CUlogsCallback`: (data, CUlogLevel, message, length).
type Callback = Option<extern "C" fn(*mut c_void, i32, *mut c_char, usize)>;

/// The registered callbacks, by the handle given out (a fresh non-zero number each).
fn callbacks() -> &'static Mutex<(usize, HashSet<usize>)> {
    static C: OnceLock<Mutex<(usize, HashSet<usize>)>> = OnceLock::new();
    C.get_or_init(|| Mutex::new((0, HashSet::new())))
}

/// "flags - Reserved for future use, must be 0".
fn no_flags(flags: c_uint) -> Res {
    if flags == 0 {
        Ok(())
    } else {
        Err(err::INVALID_VALUE)
    }
}

export! {
    /// "callback_out - Optional location to store the callback handle"; a NULL function is
    /// CUDA_ERROR_INVALID_VALUE.
    fn cuLogsRegisterCallback(f: Callback, _data: *mut c_void, out: *mut usize) {
        drv()?;
        f.ok_or(err::INVALID_VALUE)?;
        let h = {
            let mut c = callbacks().lock().unwrap_or_else(|e| e.into_inner());
            c.0 += 1;
            let h = c.0;
            c.1.insert(h);
            h
        };
        if !out.is_null() {
            write(out, h)?;
        }
        Ok(())
    }

    /// A handle that is not a registered callback is CUDA_ERROR_INVALID_VALUE.
    fn cuLogsUnregisterCallback(h: usize) {
        drv()?;
        let mut c = callbacks().lock().unwrap_or_else(|e| e.into_inner());
        if c.1.remove(&h) { Ok(()) } else { Err(err::INVALID_VALUE) }
    }

    /// "Sets log iterator to point to the end of log buffer, where the next message would be
    /// written": 0, the buffer being empty.
    fn cuLogsCurrent(out: *mut c_uint, flags: c_uint) {
        drv()?;
        no_flags(flags)?;
        write(out, 0)
    }

    /// "If there are no messages to dump, *size will be set to 0 and the function will return
    /// CUDA_SUCCESS"; "The driver will always null terminate the buffer". `iterator` is optional
    /// ("NULL value dumps all logs").
    fn cuLogsDumpToMemory(iterator: *mut c_uint, buffer: *mut c_char, size: *mut usize, flags: c_uint) {
        drv()?;
        no_flags(flags)?;
        let room = read(size as *const usize)?;
        if buffer.is_null() || room == 0 {
            return Err(err::INVALID_VALUE);
        }
        if !iterator.is_null() {
            read(iterator as *const c_uint)?;
        }
        write(buffer, 0)?;
        write(size, 0)
    }

    /// "Dump accumulated driver logs into a file": none; the path must be given.
    fn cuLogsDumpToFile(iterator: *mut c_uint, path: *const c_char, flags: c_uint) {
        drv()?;
        no_flags(flags)?;
        cstr(path)?;
        if !iterator.is_null() {
            read(iterator as *const c_uint)?;
        }
        Ok(())
    }
}
