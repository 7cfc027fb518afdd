//! Fat binaries as nvcc 13.5 (from NVIDIA's wheels, as tests/cudart_nvcc.rs installs it) writes
//! them with each of its compression modes (`--compress-mode=none|speed|balance|size|default`,
//! with and without `-Xfatbin -compress-all`, and `--concat` entries for two architectures):
//! `cudart/fatbin_vars.cu` built into each, the entries checked to be stored as the mode says
//! (so that every storage the reader knows is exercised: plain, LZ4, Zstandard, concatenated),
//! then read by cuvisor-image and loaded on the simulator, whose variables must be there with
//! their sizes, and which takes device memory for its variables and its code while the module
//! is loaded.
//!
//! Where the wheels cannot be installed the test prints a loud SKIPPED line, or fails when `CI`
//! is set; a failing nvcc always fails it.
mod common;

use cu::CUresult::{self as R, *};
use cudarc::driver::sys as cu;
use cuvisor_image::Image;
use cuvisor_sim::arena::ALIGN;
use std::ffi::{c_void, CString};
use std::path::{Path, PathBuf};
use std::ptr::null_mut;

/// (file tag, nvcc arguments, how its entries must be stored).
const BUILDS: &[(&str, &[&str], Stored)] = &[
    (
        "none",
        &["-arch=sm_80", "--compress-mode=none"],
        Stored::Plain,
    ),
    // speed: LZ4 (flag 0x2000) on the PTX; the small cubin is left plain.
    (
        "speed",
        &["-arch=sm_80", "--compress-mode=speed"],
        Stored::Lz4,
    ),
    (
        "speed-all",
        &[
            "-arch=sm_80",
            "--compress-mode=speed",
            "-Xfatbin",
            "-compress-all",
        ],
        Stored::Lz4Cubin,
    ),
    // balance and default: Zstandard (0x8000) on the PTX.
    (
        "balance",
        &["-arch=sm_80", "--compress-mode=balance"],
        Stored::Zstd,
    ),
    (
        "balance-all",
        &[
            "-arch=sm_80",
            "--compress-mode=balance",
            "-Xfatbin",
            "-compress-all",
        ],
        Stored::ZstdCubin,
    ),
    (
        "default",
        &["-arch=sm_80", "--compress-mode=default"],
        Stored::Zstd,
    ),
    (
        "size",
        &["-arch=sm_80", "--compress-mode=size"],
        Stored::ZstdCubin,
    ),
    (
        "concat",
        &[
            "-gencode",
            "arch=compute_80,code=sm_80",
            "-gencode",
            "arch=compute_90,code=sm_90",
            "--concat",
            "--compress-mode=size",
        ],
        Stored::Concat,
    ),
];

#[derive(Clone, Copy, Debug, PartialEq)]
enum Stored {
    /// No entry compressed.
    Plain,
    /// An entry LZ4-compressed; the cubin plain.
    Lz4,
    /// The cubin LZ4-compressed.
    Lz4Cubin,
    /// An entry Zstandard-compressed; the cubin plain.
    Zstd,
    /// The cubin Zstandard-compressed.
    ZstdCubin,
    /// A concatenated entry (kind 0x100).
    Concat,
}

/// (kind, flags) of each entry of a fat binary (header: magic, u16 version, u16 header size, u64
/// size; entries: u16 kind, u32 header size at 4, u32 padded size at 8, u64 flags at 0x28).
fn entries(b: &[u8]) -> Vec<(u16, u64)> {
    let u16_at = |o: usize| u16::from_le_bytes(b[o..o + 2].try_into().unwrap());
    let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap());
    let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap());
    assert_eq!(u32_at(0), 0xBA55_ED50, "a fat binary");
    let end = u16_at(6) as usize + u64_at(8) as usize;
    let mut at = u16_at(6) as usize;
    let mut out = Vec::new();
    while at + 64 <= end && u32_at(at + 4) != 0 {
        out.push((u16_at(at), u64_at(at + 0x28)));
        at += u32_at(at + 4) as usize + u32_at(at + 8) as usize;
    }
    out
}

fn stored(e: &[(u16, u64)]) -> Stored {
    let cubin = e.iter().find(|(k, _)| *k == 2).map(|(_, f)| *f);
    let any = |flag: u64| e.iter().any(|(_, f)| f & flag != 0);
    if e.iter().any(|(k, _)| *k == 0x100) {
        Stored::Concat
    } else if cubin.is_some_and(|f| f & 0x2000 != 0) {
        Stored::Lz4Cubin
    } else if cubin.is_some_and(|f| f & 0x8000 != 0) {
        Stored::ZstdCubin
    } else if any(0x2000) {
        Stored::Lz4
    } else if any(0x8000) {
        Stored::Zstd
    } else {
        Stored::Plain
    }
}

/// Builds every fat binary of [`BUILDS`] into a fresh directory. None after SKIPPED.
fn build() -> Option<PathBuf> {
    let cu13 = cuvisor_testkit::wheels::nvcc_13_5("fatbin_compression")?;
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/cudart/fatbin_vars.cu");
    let dir =
        cuvisor_testkit::profile_dir_of_test().join(format!("fatbins-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (tag, args, _) in BUILDS {
        let out = dir.join(format!("{tag}.fatbin"));
        let args: Vec<&str> = std::iter::once("-fatbin")
            .chain(args.iter().copied())
            .collect();
        cuvisor_testkit::wheels::nvcc(&cu13, &args, &src, &out);
    }
    Some(dir)
}

fn ok(r: R) {
    assert_eq!(r, CUDA_SUCCESS);
}

fn free_mem() -> usize {
    let (mut free, mut total) = (0, 0);
    // SAFETY: valid out-pointers, a current context.
    unsafe { ok(cu::cuMemGetInfo_v2(&mut free, &mut total)) };
    free
}

#[test]
fn every_compression_of_nvcc_13_5_fat_binaries_is_read_and_loaded() {
    if common::is_child() {
        let dir = PathBuf::from(std::env::var("FATBINS").unwrap());
        let mut ctx = null_mut();
        // SAFETY: the driver API's contract: valid out-pointers and handles.
        unsafe {
            ok(cu::cuInit(0));
            ok(cu::cuDevicePrimaryCtxRetain(&mut ctx, 0));
            ok(cu::cuCtxSetCurrent(ctx));
        }
        for (tag, _, _) in BUILDS {
            let bytes = std::fs::read(dir.join(format!("{tag}.fatbin"))).unwrap();
            let before = free_mem();
            let mut m = null_mut();
            // SAFETY: a complete fat binary, alive across the call.
            unsafe {
                ok(cu::cuModuleLoadData(
                    &mut m,
                    bytes.as_ptr() as *const c_void,
                ))
            };
            for (name, size) in [("table_a", 4000), ("table_c", 1200)] {
                let (mut p, mut n) = (0, 0);
                let c = CString::new(name).unwrap();
                // SAFETY: valid out-pointers, a loaded module, a NUL-terminated name.
                let r = unsafe { cu::cuModuleGetGlobal_v2(&mut p, &mut n, m, c.as_ptr()) };
                assert_eq!((r, n), (CUDA_SUCCESS, size), "{tag}: {name}");
                assert_ne!(p, 0, "{tag}: {name}");
            }
            let c = CString::new("not_there").unwrap();
            let (mut p, mut n) = (0, 0);
            // SAFETY: as above.
            let r = unsafe { cu::cuModuleGetGlobal_v2(&mut p, &mut n, m, c.as_ptr()) };
            assert_eq!(
                r, CUDA_ERROR_NOT_FOUND,
                "{tag}: a variable it does not define"
            );
            // Its variables and its code (the cubin's `.text.*` sections, the largest cubin's
            // where there are two), each a whole number of the simulator's 512-byte units.
            let code = cuvisor_image::from_bytes(&bytes).code_bytes();
            assert!(code > 0, "{tag}: a cubin has code");
            let up = |n: u64| n.div_ceil(ALIGN) * ALIGN;
            let want = up(4000) + up(1200) + up(code);
            assert_eq!(
                (before - free_mem()) as u64,
                want,
                "{tag}: what loading takes"
            );
            // SAFETY: the module loaded above.
            unsafe { ok(cu::cuModuleUnload(m)) };
            assert_eq!(free_mem(), before, "{tag}: unloading gives it all back");
        }
        return;
    }
    let Some(dir) = build() else { return };
    for (tag, _, want) in BUILDS {
        let bytes = std::fs::read(dir.join(format!("{tag}.fatbin"))).unwrap();
        let e = entries(&bytes);
        assert_eq!(stored(&e), *want, "{tag}: entries (kind, flags) {e:x?}");
        match cuvisor_image::from_bytes(&bytes) {
            Image::Fat(f) => {
                assert_eq!(f.globals.get("table_a"), Some(&4000), "{tag}: {f:?}");
                assert_eq!(f.globals.get("table_c"), Some(&1200), "{tag}: {f:?}");
            }
            other => panic!("{tag}: read as {other:?}"),
        }
    }
    common::Child::new("every_compression_of_nvcc_13_5_fat_binaries_is_read_and_loaded")
        .env("FATBINS", dir.to_str().unwrap())
        .run()
        .success();
    let _ = std::fs::remove_dir_all(&dir);
}
