//! Device memory that no cuMemAlloc shows: a module's (and a library's) variables, which the
//! driver allocates when it loads the image, and CUDA arrays of every format, including those
//! whose size takes more than an element count to compute. Each test is an attack that got
//! memory past the quota before (issue 15), run as a real process under LD_PRELOAD on the
//! simulator (a child re-run of this binary, with cudarc's raw driver bindings).
mod common;

use common::*;
use cu::CUresult::{self as R, *};
use cudarc::driver::sys as cu;
use std::ptr::null_mut;

fn ok(r: R) {
    assert_eq!(r, CUDA_SUCCESS);
}

/// Test `name` of this binary, re-run in a child on the simulator under cuvisor with `limit`.
fn child(name: &str, ledger: &std::path::Path, limit: &str) -> Ran {
    let mut cmd = Child::new(name).command();
    cuvisor_env(&mut cmd, ledger, Some(limit));
    Ran(cmd.output().expect("spawn child test")).success()
}

// SAFETY (for every `unsafe` block below): the driver API's contract, with valid out-pointers,
// descriptors and images, and handles the driver returned.

fn setup() -> cu::CUcontext {
    let mut ctx = null_mut();
    // SAFETY: see above.
    unsafe {
        ok(cu::cuInit(0));
        ok(cu::cuDevicePrimaryCtxRetain(&mut ctx, 0));
        ok(cu::cuCtxSetCurrent(ctx));
    }
    ctx
}

fn free_mem() -> u64 {
    let (mut free, mut total) = (0, 0);
    // SAFETY: see above.
    unsafe { ok(cu::cuMemGetInfo_v2(&mut free, &mut total)) };
    free as u64
}

fn desc3d(w: usize, h: usize, d: usize, format: cu::CUarray_format) -> cu::CUDA_ARRAY3D_DESCRIPTOR {
    cu::CUDA_ARRAY3D_DESCRIPTOR {
        Width: w,
        Height: h,
        Depth: d,
        Format: format,
        NumChannels: 1,
        Flags: 0,
    }
}

// ---- arrays -------------------------------------------------------------------------------------

/// A 1D mipmapped float array of two levels whose bytes (4w + 2w) come to 2^64 + 4 GiB + 4:
/// wrapped, 4 GiB (what the simulator took before its arithmetic was checked); checked, more
/// than 64 bits can hold, which the library could not size and passed to the driver.
fn wrapping_width() -> usize {
    let w = ((1u128 << 64) + (1u128 << 32) + 4) / 6;
    assert_eq!(w * 6, (1u128 << 64) + (1u128 << 32) + 4);
    w as usize
}

fn mipmapped_overflow() {
    setup();
    let before = free_mem();
    let desc = desc3d(
        wrapping_width(),
        0,
        0,
        cu::CUarray_format::CU_AD_FORMAT_FLOAT,
    );
    for _ in 0..3 {
        let mut m = null_mut();
        // SAFETY: see above.
        let r = unsafe { cu::cuMipmappedArrayCreate(&mut m, &desc, 2) };
        assert_eq!(
            r, CUDA_ERROR_INVALID_VALUE,
            "a size beyond 64 bits is refused"
        );
    }
    assert_eq!(free_mem(), before, "nothing taken");
    println!("child: mipmapped overflow refused");
}

#[test]
fn a_mipmapped_array_whose_size_overflows_is_refused() {
    if is_child() {
        return mipmapped_overflow();
    }
    let ledger = ledger_dir("mip-overflow");
    let out = child(
        "a_mipmapped_array_whose_size_overflows_is_refused",
        &ledger,
        "1Gi",
    );
    assert!(out.stdout().contains("child: mipmapped overflow refused"));
    assert!(
        out.stderr()
            .lines()
            .any(|l| l.starts_with("cuvisor: cuMipmappedArrayCreate refused")),
        "one line naming the call: {}",
        out.stderr()
    );
}

/// Block-compressed and video formats, which the library did not know and passed through
/// uncharged: each is charged what its texel blocks take (and given back at destroy).
fn block_compressed() {
    setup();
    use cu::CUarray_format::*;
    let base = free_mem();
    for (format, w, h, bytes) in [
        (CU_AD_FORMAT_BC1_UNORM, 1024, 1024, 256 * 256 * 8),
        (CU_AD_FORMAT_BC7_UNORM, 1024, 1024, 256 * 256 * 16),
        (CU_AD_FORMAT_BC4_SNORM, 1021, 1021, 256 * 256 * 8),
        (CU_AD_FORMAT_NV12, 1920, 1080, 1920 * 1080 * 3 / 2),
        (CU_AD_FORMAT_P010, 1920, 1080, 1920 * 1080 * 3),
        (CU_AD_FORMAT_Y444_PLANAR10, 1024, 512, 1024 * 512 * 6),
    ] {
        let desc = cu::CUDA_ARRAY_DESCRIPTOR {
            Width: w,
            Height: h,
            Format: format,
            NumChannels: 1,
        };
        let mut a = null_mut();
        // SAFETY: see above.
        unsafe { ok(cu::cuArrayCreate_v2(&mut a, &desc)) };
        let charged = base - free_mem();
        assert_eq!(charged, (bytes as u64).next_multiple_of(512), "{format:?}");
        // SAFETY: see above.
        unsafe { ok(cu::cuArrayDestroy(a)) };
        assert_eq!(free_mem(), base, "{format:?}: given back");
    }
    // A 512 MiB BC7 array (one byte a texel) and a 640 MiB one do not fit a 1 GiB quota.
    let desc = desc3d(32768, 16384, 0, CU_AD_FORMAT_BC7_UNORM);
    let (mut a, mut b) = (null_mut(), null_mut());
    // SAFETY: see above.
    unsafe {
        ok(cu::cuArray3DCreate_v2(&mut a, &desc));
        assert_eq!(base - free_mem(), 512 << 20);
        let desc = desc3d(32768, 20480, 0, CU_AD_FORMAT_BC7_UNORM);
        assert_eq!(
            cu::cuArray3DCreate_v2(&mut b, &desc),
            CUDA_ERROR_OUT_OF_MEMORY
        );
        ok(cu::cuArrayDestroy(a));
    }
    assert_eq!(free_mem(), base);
    println!("child: block-compressed arrays charged");
}

#[test]
fn block_compressed_arrays_are_charged() {
    if is_child() {
        return block_compressed();
    }
    let ledger = ledger_dir("bc-arrays");
    let out = child("block_compressed_arrays_are_charged", &ledger, "1Gi");
    assert!(out
        .stdout()
        .contains("child: block-compressed arrays charged"));
}

// ---- modules and libraries ------------------------------------------------------------------------

/// PTX with one `.global` of `bytes` bytes (NUL-terminated).
fn ptx_with_global(bytes: u64) -> Vec<u8> {
    format!(
        ".version 8.8\n.target sm_90\n.address_size 64\n\
         .visible .global .align 4 .b8 big[{bytes}];\n\
         .visible .entry sim_busy(\n.param .u64 p\n)\n{{\nret;\n}}\n\0"
    )
    .into_bytes()
}

fn load_data(image: &[u8]) -> Result<cu::CUmodule, R> {
    let mut m = null_mut();
    // SAFETY: see above.
    match unsafe { cu::cuModuleLoadData(&mut m, image.as_ptr() as *const _) } {
        CUDA_SUCCESS => Ok(m),
        e => Err(e),
    }
}

fn seven_modules() {
    setup();
    let base = free_mem();
    assert_eq!(base, GIB);
    let big = ptx_with_global(2 * GIB);
    for _ in 0..7 {
        assert_eq!(load_data(&big).err(), Some(CUDA_ERROR_OUT_OF_MEMORY));
    }
    assert_eq!(free_mem(), base, "nothing taken, nothing shown taken");
    // What fits is charged, and given back exactly at unload.
    let m = load_data(&ptx_with_global(256 * MIB)).unwrap();
    assert_eq!(base - free_mem(), 256 * MIB);
    let (mut p, mut n) = (0, 0);
    // SAFETY: see above.
    unsafe { ok(cu::cuModuleGetGlobal_v2(&mut p, &mut n, m, c"big".as_ptr())) };
    assert_eq!(n as u64, 256 * MIB);
    let more: Vec<_> = (0..3)
        .map(|_| load_data(&ptx_with_global(256 * MIB)))
        .collect();
    assert_eq!(more.iter().filter(|r| r.is_ok()).count(), 3);
    assert_eq!(free_mem(), 0);
    assert_eq!(
        load_data(&ptx_with_global(1)).err(),
        Some(CUDA_ERROR_OUT_OF_MEMORY)
    );
    let mut q = 0;
    // SAFETY: see above.
    unsafe {
        assert_eq!(
            cu::cuMemAlloc_v2(&mut q, 512 << 20),
            CUDA_ERROR_OUT_OF_MEMORY
        );
        ok(cu::cuModuleUnload(m));
        for r in more {
            ok(cu::cuModuleUnload(r.unwrap()));
        }
    }
    assert_eq!(free_mem(), base, "unload gives back exactly");
    println!("child: modules held to the quota");
}

#[test]
fn seven_ptx_modules_with_2_gib_globals_are_held_to_a_1_gib_quota() {
    if is_child() {
        return seven_modules();
    }
    let ledger = ledger_dir("modules-seven");
    let out = child(
        "seven_ptx_modules_with_2_gib_globals_are_held_to_a_1_gib_quota",
        &ledger,
        "1Gi",
    );
    assert!(out.stdout().contains("child: modules held to the quota"));
    assert!(
        out.stderr()
            .lines()
            .any(|l| l.starts_with("cuvisor: cuModuleLoadData of 2.00 GiB on GPU 0 refused")),
        "{}",
        out.stderr()
    );
    assert_eq!(ledger_used(&ledger), vec![0]);
}

fn library_load(image: &[u8]) -> Result<cu::CUlibrary, R> {
    let mut l = null_mut();
    // SAFETY: see above.
    let r = unsafe {
        cu::cuLibraryLoadData(
            &mut l,
            image.as_ptr() as *const _,
            null_mut(),
            null_mut(),
            0,
            null_mut(),
            null_mut(),
            0,
        )
    };
    if r == CUDA_SUCCESS {
        Ok(l)
    } else {
        Err(r)
    }
}

fn libraries() {
    setup();
    let base = free_mem();
    for _ in 0..3 {
        assert_eq!(
            library_load(&ptx_with_global(2 * GIB)).err(),
            Some(CUDA_ERROR_OUT_OF_MEMORY)
        );
    }
    let l = library_load(&ptx_with_global(512 * MIB)).unwrap();
    assert_eq!(base - free_mem(), 512 * MIB, "charged at load");
    let (mut p, mut n) = (0, 0);
    // SAFETY: see above.
    unsafe { ok(cu::cuLibraryGetGlobal(&mut p, &mut n, l, c"big".as_ptr())) };
    assert_eq!(n as u64, 512 * MIB);
    assert_eq!(
        base - free_mem(),
        512 * MIB,
        "taken in this context: no more"
    );
    assert_eq!(
        library_load(&ptx_with_global(768 * MIB)).err(),
        Some(CUDA_ERROR_OUT_OF_MEMORY)
    );
    // SAFETY: see above.
    unsafe { ok(cu::cuLibraryUnload(l)) };
    assert_eq!(free_mem(), base, "given back at unload");
    println!("child: libraries charged");
}

#[test]
fn library_load_data_globals_are_charged() {
    if is_child() {
        return libraries();
    }
    let ledger = ledger_dir("libraries");
    let out = child("library_load_data_globals_are_charged", &ledger, "1Gi");
    assert!(out.stdout().contains("child: libraries charged"));
}

fn teardown() {
    let primary = setup();
    let base = free_mem();
    let img = ptx_with_global(256 * MIB);
    // SAFETY: see above.
    unsafe {
        // A created context: destroyed with a module still loaded in it.
        let mut c = null_mut();
        ok(cu::cuCtxCreate_v2(&mut c, 0, 0));
        load_data(&img).unwrap();
        assert_eq!(base - free_mem(), 256 * MIB);
        ok(cu::cuCtxDestroy_v2(c));
        ok(cu::cuCtxSetCurrent(primary));
        assert_eq!(free_mem(), base, "cuCtxDestroy gives back its modules");
        // The primary context, reset (as cudaDeviceReset does).
        load_data(&img).unwrap();
        assert_eq!(base - free_mem(), 256 * MIB);
        ok(cu::cuDevicePrimaryCtxReset_v2(0));
        assert_eq!(free_mem(), base, "a primary reset gives back its modules");
        // The primary context's last release.
        let mut p = null_mut();
        ok(cu::cuDevicePrimaryCtxRetain(&mut p, 0));
        ok(cu::cuCtxSetCurrent(p));
        load_data(&img).unwrap();
        assert_eq!(base - free_mem(), 256 * MIB);
        ok(cu::cuDevicePrimaryCtxRelease_v2(0));
        ok(cu::cuDevicePrimaryCtxRelease_v2(0));
        ok(cu::cuDevicePrimaryCtxRetain(&mut p, 0));
        ok(cu::cuCtxSetCurrent(p));
        assert_eq!(free_mem(), base, "the last release gives back its modules");
    }
    println!("child: teardown gave back");
}

#[test]
fn context_teardown_gives_back_its_modules() {
    if is_child() {
        return teardown();
    }
    let ledger = ledger_dir("modules-teardown");
    let out = child("context_teardown_gives_back_its_modules", &ledger, "1Gi");
    assert!(out.stdout().contains("child: teardown gave back"));
}

/// Cubins in fat binaries (Zstandard as CUDA 13's libraries store them, LZ4 as CUDA 12's) and
/// image files are sized too; an entry stored some way the library cannot undo is refused with
/// one line, never loaded uncharged.
fn fat_and_files() {
    use cuvisor_image::make::{cubin, fat_entry, fatbin, Packing};
    setup();
    let base = free_mem();
    let two_gib = cubin(&["k"], &[("g", 2 * GIB)], &[]);
    let quarter = cubin(&["k"], &[("g", 256 * MIB)], &[]);
    let mut m = null_mut();
    // SAFETY: see above.
    unsafe {
        // First: refusal lines are printed at most once a second.
        let odd = fatbin(&[fat_entry(2, &quarter, Packing::Unknown)]);
        let r = cu::cuModuleLoadData(&mut m, odd.as_ptr() as *const _);
        assert_eq!(r, CUDA_ERROR_OUT_OF_MEMORY, "cannot be sized: refused");
        for packing in [Packing::Zstd, Packing::Lz4] {
            let fat = fatbin(&[fat_entry(2, &two_gib, packing)]);
            let r = cu::cuModuleLoadFatBinary(&mut m, fat.as_ptr() as *const _);
            assert_eq!(r, CUDA_ERROR_OUT_OF_MEMORY, "{packing:?}");
        }
        let fat = fatbin(&[fat_entry(2, &quarter, Packing::Zstd)]);
        ok(cu::cuModuleLoadFatBinary(&mut m, fat.as_ptr() as *const _));
        assert_eq!(base - free_mem(), 256 * MIB);
        ok(cu::cuModuleUnload(m));
        let path = std::env::temp_dir().join(format!("cuvisor-cubin-{}", std::process::id()));
        std::fs::write(&path, &two_gib).unwrap();
        let cpath = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
        assert_eq!(
            cu::cuModuleLoad(&mut m, cpath.as_ptr()),
            CUDA_ERROR_OUT_OF_MEMORY
        );
        let mut l = null_mut();
        let r = cu::cuLibraryLoadFromFile(
            &mut l,
            cpath.as_ptr(),
            null_mut(),
            null_mut(),
            0,
            null_mut(),
            null_mut(),
            0,
        );
        assert_eq!(r, CUDA_ERROR_OUT_OF_MEMORY);
        std::fs::write(&path, &quarter).unwrap();
        ok(cu::cuModuleLoad(&mut m, cpath.as_ptr()));
        assert_eq!(base - free_mem(), 256 * MIB);
        ok(cu::cuModuleUnload(m));
        assert_eq!(
            cu::cuModuleLoad(&mut m, c"/nonexistent/cubin".as_ptr()),
            CUDA_ERROR_FILE_NOT_FOUND
        );
        let _ = std::fs::remove_file(&path);
    }
    assert_eq!(free_mem(), base);
    println!("child: fat binaries and files charged");
}

#[test]
fn fat_binaries_and_image_files_are_charged() {
    if is_child() {
        return fat_and_files();
    }
    let ledger = ledger_dir("modules-fat");
    let out = child("fat_binaries_and_image_files_are_charged", &ledger, "1Gi");
    assert!(out
        .stdout()
        .contains("child: fat binaries and files charged"));
    assert!(
        out.stderr()
            .lines()
            .any(|l| l.starts_with("cuvisor: cuModuleLoadData refused")
                && l.contains("cannot be computed")),
        "{}",
        out.stderr()
    );
}

// ---- the runtime's private loads ------------------------------------------------------------------

/// A fat binary of one PTX entry with a `.global` of `bytes` bytes, as nvcc links one into a
/// program and libcudart hands it to the driver.
fn fatbin_with_global(bytes: u64) -> Vec<u8> {
    use cuvisor_image::make::{fat_entry, fatbin, Packing};
    let ptx = ptx_with_global(bytes);
    fatbin(&[fat_entry(1, &ptx[..ptx.len() - 1], Packing::Plain)])
}

/// libcudart loads a program's fat binaries through the driver's private CUDART_INTERFACE
/// table (cuGetExportTable), not cuModuleLoadData: a program that calls those slots itself, as
/// libcudart does, loaded 2 GiB `.global`s seven times under a 1 GiB quota (the simulator
/// models the table as the real driver answers it). tests/c/cudart_table.c checks each step.
#[test]
fn fat_binaries_loaded_through_the_runtimes_private_table_are_held_to_the_quota() {
    let exe = compile_c("cudart_table", &["-ldl"]);
    let dir = ledger_dir("cudart-table");
    let files = dir.join("images");
    std::fs::create_dir_all(&files).unwrap();
    let (big, small) = (files.join("big.fatbin"), files.join("small.fatbin"));
    std::fs::write(&big, fatbin_with_global(2 * GIB)).unwrap();
    std::fs::write(&small, fatbin_with_global(256 * MIB)).unwrap();
    let ledger = dir.join("ledger");
    let mut cmd = std::process::Command::new(&exe);
    cmd.arg(&big).arg(&small);
    sim_env(&mut cmd, "single", &state_file("cudart-table"));
    cuvisor_env(&mut cmd, &ledger, Some("1Gi"));
    let out = Ran(cmd.output().expect("run cudart_table"));
    assert!(
        out.stdout().contains("cudart_table: ok"),
        "stdout: {}\nstderr: {}",
        out.stdout(),
        out.stderr()
    );
    assert!(
        out.stderr().lines().any(|l| l.starts_with(
            "cuvisor: the runtime's module load (CUDART_INTERFACE slot 1) of 2.00 GiB on GPU 0 refused"
        )),
        "one line naming the load: {}",
        out.stderr()
    );
    assert_eq!(ledger_used(&ledger), vec![0]);
}
