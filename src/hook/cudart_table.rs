//! The runtime's private module loads: `cuGetExportTable` for the CUDART_INTERFACE table.
//!
//! NVIDIA's libcudart does not load a program's fat binaries (those `__cudaRegisterFatBinary`
//! registered: every nvcc-built program's kernels, `__device__` and `__constant__` variables)
//! through cuModuleLoadData but through functions of a private table the driver hands out for
//! the UUID `6bd5fb6c-5bf4-e74a-8987-d93912fd9df9` (bytes in this order in memory): slot 1
//! takes `(CUmodule*, __fatBinC_Wrapper_t*)`, slot 6 the same and three more arguments, slot 8
//! `(fat binary header*, CUmodule*, ...)`. Sources: vosen/ZLUDA, `dark_api/src/lib.rs`
//! (CUDART_INTERFACE: `get_module_from_cubin` = 1, `_ext1` = 6, `_ext2` = 8) and its tracer
//! `zluda_dump`, which hooks these three slots exactly so (`CUDART_INTERFACE_GUID` bytes
//! `6b d5 fb 6c 5b f4 e7 4a 89 87 d9 39 12 fd 9d f9`; a wrapper is `{u32 magic 0x466243b1,
//! u32 version, const FatbinHeader *data, void *filename_or_fatbins}`); Wine's
//! `dlls/nvcuda/internal.c` relays the same table. The driver allocates the image's variables
//! in those loads, so without this an nvcc-built program's 2 GiB `__device__` array was memory
//! no quota saw.
//!
//! So slots 1, 6 and 8 of the driver's own table are replaced, once, by functions that size the
//! image (`cuvisor_image`, as the public loads do), charge it, call the driver's slot, and
//! record the module so that cuModuleUnload (which libcudart reaches through cuGetProcAddress,
//! so our wrapper) and context teardown give it back. Every other slot, and every other table,
//! is the driver's, untouched.
//!
//! In place, not a copy: libcudart checks the driver with INTEGRITY_CHECK, an HMAC whose inputs
//! include the address of the CUDART_INTERFACE table (ZLUDA's record of its inputs, modelled by
//! the simulator's `export_table.rs`); a copy at another address made libcudart 13.5 fail every
//! call with cudaErrorSoftwareValidityNotEstablished on the simulator. The table is static data
//! of libcuda (the same address every call), so it is patched once, its pages made writable for
//! the three stores (aligned word stores, atomic) and given back their protection. A program
//! that reaches the driver's table some other way meets the same slots.
//!
//! The table's first word is its size in bytes (ZLUDA `SIZE_OF`; Wine `cuda_table.size`;
//! `zluda_dump` reads it so below 0x10000). A driver whose table does not read so, or is too
//! short to hold slot 8, or whose table cannot be patched, has a layout or memory nobody has
//! recorded: which of its slots load modules is unknown. Passing it through would let every
//! runtime program load images no quota sees (the hole this closes), silently; refusing it
//! makes libcudart fail its initialisation, loudly, with our line naming why (the operator can
//! run that driver without a quota, or update cuvisor). The quota is the point of cuvisor, so
//! such a table is refused (CUDA_ERROR_NOT_SUPPORTED, `*table` NULL, one line): it fails closed.

use super::module::charged_module_load;
use super::{guard, hooks};
use crate::quota::GRANULE;
use crate::Mode;
use cuvisor_cuda_abi::cuda::*;
use std::ffi::c_void;
use std::sync::OnceLock;

hooks! {
    Cuda cuGetExportTable(table: *mut *const c_void, id: *const [u8; 16]) => get_export_table;
}

/// `6bd5fb6c-5bf4-e74a-8987-d93912fd9df9`, as the bytes lie in memory (see the module doc).
pub const CUDART_INTERFACE: [u8; 16] = [
    0x6b, 0xd5, 0xfb, 0x6c, 0x5b, 0xf4, 0xe7, 0x4a, 0x89, 0x87, 0xd9, 0x39, 0x12, 0xfd, 0x9d, 0xf9,
];

/// The slots that load a module: from a wrapper, from a wrapper (extended), from a fat binary.
const WRAPPER: usize = 1;
const WRAPPER_EXT: usize = 6;
const DATA_EXT: usize = 8;

/// `__fatBinC_Wrapper_t`'s magic, and a fat binary's.
const WRAPPER_MAGIC: u32 = 0x4662_43b1;
const FATBIN_MAGIC: u32 = 0xBA55_ED50;

/// A size word at or beyond this is no size (zluda_dump's bound); CUDART_INTERFACE has 13
/// slots in CUDA 13.1 (104 bytes).
const MAX_TABLE_BYTES: usize = 0x10000;

/// How many slots a CUDART_INTERFACE table whose first word is `size` has, or why cuvisor
/// will not answer a copy of it (see the module doc).
pub fn slots_of(size: usize) -> Result<usize, String> {
    let word = std::mem::size_of::<usize>();
    if !size.is_multiple_of(word) || size >= MAX_TABLE_BYTES {
        return Err(format!(
            "its first word ({size:#x}) is not a table size this library knows"
        ));
    }
    let n = size / word;
    if n <= DATA_EXT {
        return Err(format!(
            "it has {n} slots, too few to hold the module loads (slots 1, 6, 8) cuvisor charges"
        ));
    }
    Ok(n)
}

/// The driver's table, patched, and its own loaders our slots call.
struct Patched {
    table: usize,
    /// The driver's slots 1, 6 and 8.
    real: [usize; 3],
}

static PATCHED: OnceLock<Result<Patched, String>> = OnceLock::new();

/// Our functions for slots 1, 6 and 8.
fn ours() -> [usize; 3] {
    [
        from_wrapper as *const () as usize,
        from_wrapper_ext as *const () as usize,
        from_data_ext as *const () as usize,
    ]
}

/// The protection (PROT_*) of the mapping holding `addr`, from /proc/self/maps.
fn protection_of(addr: usize) -> Option<i32> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines().find_map(|l| {
        let (range, rest) = l.split_once(' ')?;
        let (a, b) = range.split_once('-')?;
        let (a, b) = (
            usize::from_str_radix(a, 16).ok()?,
            usize::from_str_radix(b, 16).ok()?,
        );
        if !(a..b).contains(&addr) {
            return None;
        }
        let p = rest.as_bytes();
        let bit = |i: usize, c: u8, v: i32| if p.get(i) == Some(&c) { v } else { 0 };
        Some(
            bit(0, b'r', libc::PROT_READ)
                | bit(1, b'w', libc::PROT_WRITE)
                | bit(2, b'x', libc::PROT_EXEC),
        )
    })
}

/// Stores `value` in the word at `slot`, making its page writable for the store if it is not
/// and giving it back its protection after.
fn store(slot: *mut usize, value: usize) -> Result<(), String> {
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as usize;
    let prot = protection_of(slot as usize).ok_or("its memory is not mapped")?;
    let start = slot as usize & !(page.max(1) - 1);
    let writable = prot & libc::PROT_WRITE != 0;
    let open = || {
        // SAFETY: the page of the driver's table, given write access on top of what it has.
        unsafe { libc::mprotect(start as *mut c_void, page, prot | libc::PROT_WRITE) }
    };
    if !writable && open() != 0 {
        return Err("its page cannot be made writable".into());
    }
    // SAFETY: an aligned word of the driver's table, now writable; stored atomically, since
    // another thread may be reading the table.
    unsafe { std::sync::atomic::AtomicUsize::from_ptr(slot) }
        .store(value, std::sync::atomic::Ordering::SeqCst);
    // SAFETY: the same page, given back the protection it had.
    if !writable && unsafe { libc::mprotect(start as *mut c_void, page, prot) } != 0 {
        return Err("its page's protection cannot be restored".into());
    }
    Ok(())
}

/// Replaces slots 1, 6 and 8 of the driver's table at `table` by ours (a NULL slot stays NULL:
/// the driver has no such loader, so there is nothing to charge). Returns the driver's.
fn patch(table: *mut usize) -> Result<Patched, String> {
    if !(table as usize).is_multiple_of(std::mem::align_of::<usize>()) {
        return Err("it is not word-aligned".into());
    }
    // SAFETY: the driver's table: an array of pointer-sized words, the first its size.
    let size = unsafe { table.read() };
    slots_of(size)?;
    let slots = [WRAPPER, WRAPPER_EXT, DATA_EXT];
    // SAFETY: the table holds at least DATA_EXT + 1 words, by its own first word.
    let real = slots.map(|i| unsafe { table.add(i).read() });
    for ((i, f), r) in slots.into_iter().zip(ours()).zip(real) {
        if r != 0 {
            // SAFETY: as above: slot `i` is inside the table.
            store(unsafe { table.add(i) }, f)?;
        }
    }
    Ok(Patched {
        table: table as usize,
        real,
    })
}

pub fn get_export_table(
    real: impl Fn(*mut *const c_void, *const [u8; 16]) -> u32,
    table: *mut *const c_void,
    id: *const [u8; 16],
) -> u32 {
    let r = real(table, id);
    if r != 0 || table.is_null() || id.is_null() || matches!(crate::mode(), Mode::PassThrough) {
        return r;
    }
    // SAFETY: a 16-byte UUID, by the driver API's contract (the driver has just read it).
    if unsafe { id.read_unaligned() } != CUDART_INTERFACE {
        return r;
    }
    // SAFETY: the driver has just written the table's address there.
    let driver = unsafe { table.read() } as *const usize;
    if driver.is_null() {
        return r;
    }
    // Patched at the first answer; the driver's table is static, so every later answer is
    // the same table (another one would be a driver cuvisor does not know: refused).
    match PATCHED.get_or_init(|| patch(driver as *mut usize)) {
        Ok(p) if p.table == driver as usize => r,
        Ok(_) => {
            crate::log::error(
                "cuGetExportTable refused: the driver answered another CUDART_INTERFACE table \
                 than before; the runtime's module loads would escape the quota",
            );
            // SAFETY: the program's out-pointer, just written by the driver.
            unsafe { table.write(std::ptr::null()) };
            err::NOT_SUPPORTED
        }
        Err(why) => {
            crate::log::error(&format!(
                "cuGetExportTable refused: the driver's CUDART_INTERFACE table cannot be \
                 charged ({why}); the runtime's module loads would escape the quota"
            ));
            // SAFETY: as above.
            unsafe { table.write(std::ptr::null()) };
            err::NOT_SUPPORTED
        }
    }
}

/// The driver's slot `i` (0: slot 1, 1: slot 6, 2: slot 8), or 0.
fn real_slot(i: usize) -> usize {
    match PATCHED.get() {
        Some(Ok(p)) => p.real[i],
        _ => 0,
    }
}

/// The first word at `p` (readable: every image form is at least 4 bytes).
fn magic(p: *const c_void) -> u32 {
    // SAFETY: the runtime's wrapper or fat binary, readable by the slot's contract.
    unsafe { (p as *const u32).read_unaligned() }
}

/// The device memory of the image a wrapper points at; Err if it is no wrapper or its fat
/// binary cannot be sized (NULL data, another magic, beyond 1 GiB: `cuvisor_image`).
fn wrapper_bytes(wrapper: *const c_void) -> Result<u64, String> {
    let m = magic(wrapper);
    if m != WRAPPER_MAGIC {
        return Err(format!("not a fat binary wrapper (magic {m:#x})"));
    }
    // SAFETY: a wrapper by its magic; its data pointer and the fat binary behind it are
    // readable by the same contract (checked NULL and magic inside).
    unsafe { cuvisor_image::from_ptr(wrapper) }.device_bytes(GRANULE)
}

fn fatbin_bytes(data: *const c_void) -> Result<u64, String> {
    let m = magic(data);
    if m != FATBIN_MAGIC {
        return Err(format!("not a fat binary (magic {m:#x})"));
    }
    // SAFETY: a fat binary by its magic; `cuvisor_image` reads it as its header bounds it.
    unsafe { cuvisor_image::from_ptr(data) }.device_bytes(GRANULE)
}

const PANIC: u32 = 999;

fn driver<F: std::marker::Copy>(i: usize) -> Option<F> {
    let a = real_slot(i);
    // SAFETY: the driver's own slot `i`, whose C signature is F (each caller states it).
    (a != 0).then(|| unsafe { std::mem::transmute_copy::<usize, F>(&a) })
}

/// Slot 1: a module from a `__fatBinC_Wrapper_t`.
extern "C" fn from_wrapper(module: *mut CUmodule, wrapper: *const c_void) -> u32 {
    type F = unsafe extern "C" fn(*mut CUmodule, *const c_void) -> u32;
    guard(PANIC, || {
        let Some(f) = driver::<F>(0) else {
            return err::NOT_SUPPORTED;
        };
        charged_module_load(
            "the runtime's module load (CUDART_INTERFACE slot 1)",
            module,
            wrapper,
            || wrapper_bytes(wrapper),
            // SAFETY: the driver's slot 1 with the runtime's own arguments.
            || unsafe { f(module, wrapper) },
        )
    })
}

/// Slot 6: as slot 1, with three more arguments passed on as they came.
extern "C" fn from_wrapper_ext(
    module: *mut CUmodule,
    wrapper: *const c_void,
    a3: *mut c_void,
    a4: *mut c_void,
    a5: u32,
) -> u32 {
    type F =
        unsafe extern "C" fn(*mut CUmodule, *const c_void, *mut c_void, *mut c_void, u32) -> u32;
    guard(PANIC, || {
        let Some(f) = driver::<F>(1) else {
            return err::NOT_SUPPORTED;
        };
        charged_module_load(
            "the runtime's module load (CUDART_INTERFACE slot 6)",
            module,
            wrapper,
            || wrapper_bytes(wrapper),
            // SAFETY: the driver's slot 6 with the runtime's own arguments.
            || unsafe { f(module, wrapper, a3, a4, a5) },
        )
    })
}

/// Slot 8: a module from a fat binary (its header first, then the out-parameter).
extern "C" fn from_data_ext(
    data: *const c_void,
    module: *mut CUmodule,
    a3: *mut c_void,
    a4: *mut c_void,
    a5: u32,
) -> u32 {
    type F =
        unsafe extern "C" fn(*const c_void, *mut CUmodule, *mut c_void, *mut c_void, u32) -> u32;
    guard(PANIC, || {
        let Some(f) = driver::<F>(2) else {
            return err::NOT_SUPPORTED;
        };
        charged_module_load(
            "the runtime's module load (CUDART_INTERFACE slot 8)",
            module,
            data,
            || fatbin_bytes(data),
            // SAFETY: the driver's slot 8 with the runtime's own arguments.
            || unsafe { f(data, module, a3, a4, a5) },
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_table_too_short_for_slot_8_or_with_no_size_word_is_refused() {
        assert_eq!(slots_of(13 * 8), Ok(13), "CUDA 13.1's CUDART_INTERFACE");
        assert_eq!(
            slots_of(10 * 8),
            Ok(10),
            "the 10 slots ZLUDA first recorded"
        );
        assert_eq!(slots_of(9 * 8), Ok(9), "just slot 8");
        assert!(slots_of(8 * 8).is_err(), "no slot 8");
        assert!(slots_of(0).is_err());
        assert!(slots_of(13 * 8 + 1).is_err(), "not whole words");
        assert!(slots_of(0x10000).is_err(), "no size: a function address");
        assert!(slots_of(0x7f12_3456_7890).is_err());
    }

    #[test]
    fn the_patch_replaces_slots_1_6_and_8_only_and_keeps_null_slots_null() {
        let mut t: Box<[usize; 13]> = Box::new(std::array::from_fn(|i| 0x1000 + i));
        t[0] = 13 * 8;
        t[6] = 0;
        let p = patch(t.as_mut_ptr()).unwrap();
        assert_eq!(p.real, [0x1001, 0, 0x1008]);
        let [w, _, d] = ours();
        for (i, &v) in t.iter().enumerate() {
            match i {
                1 => assert_eq!(v, w),
                8 => assert_eq!(v, d),
                6 => assert_eq!(v, 0),
                0 => assert_eq!(v, 13 * 8),
                _ => assert_eq!(v, 0x1000 + i),
            }
        }
        let mut short: Box<[usize; 13]> = Box::new(std::array::from_fn(|i| 0x1000 + i));
        short[0] = 8 * 8;
        assert!(patch(short.as_mut_ptr()).is_err());
        assert_eq!(short[1], 0x1001, "a refused table is left as it was");
    }

    /// The real driver's table may lie in read-only memory (RELRO): its page is made writable
    /// for the stores and given back its protection.
    #[test]
    fn a_table_in_read_only_memory_is_patched_and_stays_read_only() {
        // SAFETY: a fresh anonymous page of our own.
        let page = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(page, libc::MAP_FAILED);
        let t = page as *mut usize;
        // SAFETY: our page, 4096 bytes; then read-only.
        unsafe {
            for i in 0..13 {
                t.add(i).write(0x2000 + i);
            }
            t.write(13 * 8);
            assert_eq!(libc::mprotect(page, 4096, libc::PROT_READ), 0);
        }
        let p = patch(t).unwrap();
        assert_eq!(p.real, [0x2001, 0x2006, 0x2008]);
        // SAFETY: our page, still readable.
        assert_eq!(unsafe { t.add(6).read() }, ours()[1]);
        assert_eq!(protection_of(page as usize), Some(libc::PROT_READ));
        // SAFETY: our page.
        unsafe { libc::munmap(page, 4096) };
    }
}
