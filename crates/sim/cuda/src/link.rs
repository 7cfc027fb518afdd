//! JIT linking (cuLinkCreate / cuLinkAddData / cuLinkAddFile / cuLinkComplete / cuLinkDestroy,
//! cuda.h 13.5 "Module Management"): a link of cubins, PTX and fat binaries yields a cubin the
//! simulator loads like any other. The simulator compiles nothing: the linked image defines the
//! union of the kernels and variables its inputs define (what the image reader sees of each: a
//! cubin's or PTX's symbols, a fat binary's cubin for the context's device and its variables),
//! laid out by `cuvisor_image::make::cubin`; the inputs' register and shared-memory figures are
//! not carried over (the linked kernels get the occupancy defaults). Host objects and libraries
//! (CU_JIT_INPUT_OBJECT / LIBRARY) and LTO-IR are accepted and contribute nothing the reader can
//! see.

use crate::{cstr, ctx, drv, export, read, write, Registry, Res};
use cuvisor_cuda_abi::cuda::{err, CUresult};
use cuvisor_image::{self as image, Image};
use std::collections::{BTreeMap, BTreeSet};
use std::ffi::{c_char, c_uint, c_void};
use std::sync::{Mutex, OnceLock};

/// CUDA_ERROR_INVALID_PTX (cuda.h 13.5).
const INVALID_PTX: CUresult = 218;

// `CUjitInputType` (cuda.h 13.5).
const INPUT_CUBIN: c_uint = 0;
const INPUT_PTX: c_uint = 1;
const INPUT_FATBINARY: c_uint = 2;
const NUM_INPUT_TYPES: c_uint = 6;

// `CUjit_option` (cuda.h 13.5) values the linker treats specially.
const JIT_WALL_TIME: c_uint = 2;
const JIT_INFO_LOG_BUFFER: c_uint = 3;
const JIT_INFO_LOG_BUFFER_SIZE_BYTES: c_uint = 4;
const JIT_ERROR_LOG_BUFFER: c_uint = 5;
const JIT_ERROR_LOG_BUFFER_SIZE_BYTES: c_uint = 6;
const JIT_TARGET_FROM_CUCONTEXT: c_uint = 8;
const JIT_TARGET: c_uint = 9;

/// A fat binary's magic (`__cudaFatMAGIC2`, the first u32 of a fatbin, little-endian).
const FATBIN_MAGIC: u32 = 0xba55_ed50;

struct Link {
    /// The device whose cubin a fat binary contributes (the creating context's).
    sm: u32,
    /// cuLinkCreate's options, written back at cuLinkComplete ("optionValues must remain valid
    /// for the life of the CUlinkState if output options are used").
    options: Vec<(c_uint, *mut *mut c_void)>,
    st: Mutex<LinkState>,
}

// SAFETY: the option value pointers are the caller's, which the API makes valid for the life
// of the link state; they are written only from cuLinkComplete, under the state's lock.
unsafe impl Send for Link {}
// SAFETY: as above.
unsafe impl Sync for Link {}

#[derive(Default)]
struct LinkState {
    kernels: BTreeSet<String>,
    globals: BTreeMap<String, u64>,
    /// The last cuLinkComplete's image, owned by the state until it is destroyed.
    out: Vec<u8>,
}

fn links() -> &'static Registry<Link> {
    static R: OnceLock<Registry<Link>> = OnceLock::new();
    R.get_or_init(Registry::new)
}

/// `n` options and values, either array missing while `n` > 0 is INVALID_VALUE.
fn options(
    n: c_uint,
    keys: *const c_uint,
    values: *mut *mut c_void,
) -> Result<Vec<(c_uint, *mut *mut c_void)>, CUresult> {
    if n == 0 {
        return Ok(Vec::new());
    }
    if keys.is_null() || values.is_null() {
        return Err(err::INVALID_VALUE);
    }
    (0..n as usize)
        .map(|i| Ok((read(keys.wrapping_add(i))?, values.wrapping_add(i))))
        .collect()
}

fn create(n: c_uint, keys: *const c_uint, values: *mut *mut c_void, out: *mut *mut c_void) -> Res {
    let (_, c) = ctx::current()?;
    if out.is_null() {
        return Err(err::INVALID_VALUE);
    }
    let options = options(n, keys, values)?;
    let cc = drv()?.sim.model.devices[c.dev].cc;
    let (h, _) = links().insert(Link {
        sm: cc.0 * 10 + cc.1,
        options,
        st: Mutex::new(LinkState::default()),
    });
    write(out, h as *mut c_void)
}

/// One input: checked against its declared type (a cubin is an ELF image, a fat binary starts
/// with its magic: CUDA_ERROR_INVALID_IMAGE otherwise; PTX that does not read as PTX is
/// CUDA_ERROR_INVALID_PTX), then what it defines joins the link.
fn add(
    h: *mut c_void,
    ty: c_uint,
    bytes: &[u8],
    n: c_uint,
    keys: *const c_uint,
    values: *mut *mut c_void,
) -> Res {
    let l = links().get(h as usize)?;
    if ty >= NUM_INPUT_TYPES {
        return Err(err::INVALID_VALUE);
    }
    // "does not accept any of CU_JIT_WALL_TIME, CU_JIT_INFO_LOG_BUFFER, CU_JIT_ERROR_LOG_BUFFER,
    // CU_JIT_TARGET_FROM_CUCONTEXT, or CU_JIT_TARGET" (cuLinkAddData, cuda.h).
    for (k, _) in options(n, keys, values)? {
        if matches!(
            k,
            JIT_WALL_TIME
                | JIT_INFO_LOG_BUFFER
                | JIT_ERROR_LOG_BUFFER
                | JIT_TARGET_FROM_CUCONTEXT
                | JIT_TARGET
        ) {
            return Err(err::INVALID_VALUE);
        }
    }
    let img = match ty {
        INPUT_CUBIN if !bytes.starts_with(b"\x7fELF") => return Err(err::INVALID_IMAGE),
        INPUT_FATBINARY
            if bytes
                .get(..4)
                .map(|m| u32::from_le_bytes([m[0], m[1], m[2], m[3]]))
                != Some(FATBIN_MAGIC) =>
        {
            return Err(err::INVALID_IMAGE)
        }
        INPUT_CUBIN | INPUT_PTX | INPUT_FATBINARY => image::from_bytes(bytes),
        // Host objects, libraries, LTO-IR: nothing the reader can see.
        _ => Image::Opaque,
    };
    if ty == INPUT_PTX && !matches!(img, Image::Known(_)) {
        return Err(INVALID_PTX);
    }
    let mut st = l.st.lock().unwrap_or_else(|e| e.into_inner());
    match &img {
        Image::Known(s) => {
            st.kernels.extend(s.kernels.iter().cloned());
            st.globals
                .extend(s.globals.iter().map(|(k, v)| (k.clone(), *v)));
        }
        Image::Fat(f) => {
            st.globals
                .extend(f.globals.iter().map(|(k, v)| (k.clone(), *v)));
            st.kernels
                .extend(image::resources::for_arch(bytes, l.sm).into_keys());
        }
        Image::Opaque | Image::Unsized(_) => {}
    }
    Ok(())
}

/// The bytes of an input handed in memory: `size` of them (PTX "must be NULL-terminated"; its
/// NUL and anything after it are not PTX).
fn data_bytes<'a>(data: *const c_void, size: usize, ty: c_uint) -> Result<&'a [u8], CUresult> {
    if data.is_null() || size == 0 {
        return Err(err::INVALID_VALUE);
    }
    // SAFETY: the caller passes `size` readable bytes at `data` (the API contract).
    let b = unsafe { std::slice::from_raw_parts(data as *const u8, size) };
    Ok(if ty == INPUT_PTX {
        &b[..b.iter().position(|&c| c == 0).unwrap_or(b.len())]
    } else {
        b
    })
}

/// Writes the outputs cuLinkCreate's options ask for: no time spent (nothing is compiled),
/// empty logs.
fn write_outputs(l: &Link) -> Res {
    let value = |k: c_uint| l.options.iter().find(|(key, _)| *key == k).map(|(_, v)| *v);
    for (k, slot) in &l.options {
        match *k {
            // "Overwrites the option value with the total wall clock time, in milliseconds"
            // (a float in the pointer-sized slot).
            JIT_WALL_TIME => write(*slot as *mut f32, 0.0)?,
            JIT_INFO_LOG_BUFFER | JIT_ERROR_LOG_BUFFER => {
                let size_key = if *k == JIT_INFO_LOG_BUFFER {
                    JIT_INFO_LOG_BUFFER_SIZE_BYTES
                } else {
                    JIT_ERROR_LOG_BUFFER_SIZE_BYTES
                };
                let buf = read(*slot)? as *mut c_char;
                let size = value(size_key)
                    .map(|v| read(v).map(|p| p as usize))
                    .transpose()?
                    .unwrap_or(0);
                if !buf.is_null() && size > 0 {
                    write(buf, 0)?;
                }
                // OUT: the amount of the buffer filled.
                if let Some(v) = value(size_key) {
                    write(v, std::ptr::null_mut())?;
                }
            }
            _ => {}
        }
    }
    Ok(())
}

export! {
    fn cuLinkCreate_v2(n: c_uint, keys: *const c_uint, values: *mut *mut c_void, out: *mut *mut c_void) { create(n, keys, values, out) }
    /// The CUDA 5.5 entry point (cudaTypedefs.h PFN_cuLinkCreate_v5050): the same call.
    fn cuLinkCreate(n: c_uint, keys: *const c_uint, values: *mut *mut c_void, out: *mut *mut c_void) { create(n, keys, values, out) }
    fn cuLinkAddData_v2(h: *mut c_void, ty: c_uint, data: *mut c_void, size: usize, _name: *const c_char, n: c_uint, keys: *const c_uint, values: *mut *mut c_void) {
        drv()?;
        add(h, ty, data_bytes(data, size, ty)?, n, keys, values)
    }
    fn cuLinkAddData(h: *mut c_void, ty: c_uint, data: *mut c_void, size: usize, _name: *const c_char, n: c_uint, keys: *const c_uint, values: *mut *mut c_void) {
        drv()?;
        add(h, ty, data_bytes(data, size, ty)?, n, keys, values)
    }
    /// "equivalent to invoking cuLinkAddData on the contents of the file"; a file that cannot
    /// be read is CUDA_ERROR_FILE_NOT_FOUND.
    fn cuLinkAddFile_v2(h: *mut c_void, ty: c_uint, path: *const c_char, n: c_uint, keys: *const c_uint, values: *mut *mut c_void) {
        drv()?;
        links().get(h as usize)?;
        let b = std::fs::read(cstr(path)?).map_err(|_| err::FILE_NOT_FOUND)?;
        add(h, ty, data_bytes(b.as_ptr() as *const c_void, b.len(), ty)?, n, keys, values)
    }
    fn cuLinkAddFile(h: *mut c_void, ty: c_uint, path: *const c_char, n: c_uint, keys: *const c_uint, values: *mut *mut c_void) {
        drv()?;
        links().get(h as usize)?;
        let b = std::fs::read(cstr(path)?).map_err(|_| err::FILE_NOT_FOUND)?;
        add(h, ty, data_bytes(b.as_ptr() as *const c_void, b.len(), ty)?, n, keys, values)
    }
    /// The linked cubin, owned by the state ("it should be loaded before state is destroyed");
    /// `size` is optional.
    fn cuLinkComplete(h: *mut c_void, cubin: *mut *mut c_void, size: *mut usize) {
        drv()?;
        let l = links().get(h as usize)?;
        if cubin.is_null() {
            return Err(err::INVALID_VALUE);
        }
        let mut st = l.st.lock().unwrap_or_else(|e| e.into_inner());
        let kernels: Vec<&str> = st.kernels.iter().map(String::as_str).collect();
        let globals: Vec<(&str, u64)> = st.globals.iter().map(|(k, v)| (k.as_str(), *v)).collect();
        let out = image::make::cubin(&kernels, &globals, &[]);
        st.out = out;
        write_outputs(&l)?;
        write(cubin, st.out.as_ptr() as *mut c_void)?;
        if !size.is_null() {
            write(size, st.out.len())?;
        }
        Ok(())
    }
    fn cuLinkDestroy(h: *mut c_void) {
        drv()?;
        links().remove(h as usize)?;
        Ok(())
    }
}
