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
