//! What each kernel of a module image needs to run: registers per thread, static shared memory,
//! local memory (its stack frame), the user constant bank, the block-size bound of
//! `__launch_bounds__`, barriers; what `cuFuncGetAttribute` answers and the occupancy
//! calculation works from. Read from the cubin the driver would load on a GPU of a given
//! architecture.
//!
//! Where a cubin keeps them (measured with nvcc 13.5 `--resource-usage` on cubins it built for
//! sm_75, sm_80 and sm_86: every figure below matched what ptxas printed):
//!
//! - Registers: bits 24..31 of the `sh_info` of the kernel's `.text.<name>` section (its low 24
//!   bits are the kernel's symbol index), and `EIATTR_REGCOUNT` (0x2f) records in `.nv.info`
//!   (value: u32 symbol index, u32 count). The `.nv.info` record wins where both are present.
//! - Static shared memory: the size of the kernel's `.nv.shared.<name>` section (SHT_NOBITS).
//!   On sm_90 cubins that section also spans the 1 KiB the driver reserves per block, laid out
//!   ahead of the kernel's variables: such a cubin has a `.nv.shared.reserved.0` section and a
//!   `__nv_reservedSMEM_offset_0_alias` symbol, and its `.nv.shared.smem` was 13024 bytes where
//!   ptxas reported "12000 bytes smem" (on sm_80: 12000 and 12000). The reserve is taken off,
//!   since `cudaFuncAttributes::sharedSizeBytes` excludes it (`cuda_occupancy.h` adds
//!   `reservedSharedMemPerBlock` to it).
//! - Local memory per thread: `EIATTR_FRAME_SIZE` (0x11) in `.nv.info` (u32 symbol index, u32
//!   bytes): ptxas's "bytes stack frame".
//! - Maximum threads per block: `EIATTR_MAX_THREADS` (0x05) in `.nv.info.<name>` (u32 x, y, z:
//!   `__launch_bounds__(256)` gives 256, 1, 1); without it, the device's 1024.
//! - Barriers: attribute 0x4c in `.nv.info.<name>` (measured: 1 on the kernel ptxas said "used 1
//!   barriers" for, absent on the others).
//! - The user constant bank: the module's `.nv.constant3` (ptxas's "cmem[3]"; `__constant__`
//!   variables), whose size every kernel reports as CONST_SIZE_BYTES (UNVERIFIED against a real
//!   driver: the bank is per module, and the simulator cannot tell which kernels read it).
//! - The architecture: the ELF header's `e_flags`, the SM number in bits 8..15 where
//!   `EI_ABIVERSION` is 8 or more (CUDA 13 cubins: 0x06005004 for sm_80) and in bits 0..7
//!   before (CUDA 12 cubins: 0x500550).
//!
//! `.nv.info` records are (u8 format, u8 attribute, value): format 1 (no value, 2 bytes of
//! padding), 2 (a byte, padded to 4), 3 (a u16), 4 (u16 length, then that many bytes). That is the
//! layout of NVIDIA's `EIFMT_NVAL/BVAL/HVAL/SVAL` as public nvinfo readers describe it
//! (cloudcores/CuAssembler, `CuAsm/CuNVInfo.py`; Gdev's `cuda/driver/gdev_cuda.c` reads
//! `EIATTR_*` from the same sections), and what the cubins above hold.
//!
//! Which cubin of a fat binary: the driver runs the cubin built for the GPU's architecture, else
//! one for an earlier minor version of the same major (binary compatibility, CUDA C++
//! Programming Guide, "Binary Compatibility"), else JIT-compiles PTX. An entry's architecture
//! is the u32 at 0x1c of its header (measured: 75, 80, 86 on nvcc 13.5's `-gencode` entries).
//! Where no cubin suits (PTX only, or an image this reader cannot read), nothing is known and
//! the caller uses defaults.

use crate::{u16_at, u32_at, u64_at};
use std::collections::BTreeMap;
use std::ffi::c_void;

/// What one kernel of a cubin needs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Resources {
    pub regs: u32,
    pub shared: u32,
    pub local: u32,
    pub constant: u32,
    /// x * y * z of `__launch_bounds__`/`.maxntid`, when the kernel has one.
    pub max_threads: Option<u32>,
    pub barriers: u32,
    /// SM architecture of the cubin, 10 * major + minor (80 for sm_80).
    pub arch: u32,
}

const EIATTR_MAX_THREADS: u8 = 0x05;
/// The shared memory the driver reserves per block from sm_80 on
/// (CU_DEVICE_ATTRIBUTE_RESERVED_SHARED_MEMORY_PER_BLOCK).
const RESERVED_SHARED: u32 = 1024;
const EIATTR_FRAME_SIZE: u8 = 0x11;
const EIATTR_REGCOUNT: u8 = 0x2f;
const EIATTR_NUM_BARRIERS: u8 = 0x4c;

/// The records of one `.nv.info*` section: (attribute, value bytes).
fn records(d: &[u8]) -> Vec<(u8, &[u8])> {
    let mut out = Vec::new();
    let mut i = 0;
    while i + 4 <= d.len() {
        let (fmt, attr) = (d[i], d[i + 1]);
        match fmt {
            1 => {
                out.push((attr, &d[i + 2..i + 2]));
                i += 4;
            }
            2 | 3 => {
                out.push((attr, &d[i + 2..i + 4]));
                i += 4;
            }
            4 => {
                let Some(n) = u16_at(d, i + 2).map(usize::from) else {
                    break;
                };
                let Some(v) = d.get(i + 4..i + 4 + n) else {
                    break;
                };
                out.push((attr, v));
                i += 4 + n;
            }
            _ => break,
        }
    }
    out
}

/// The kernels of a cubin and what each needs; None if it is not a cubin this reader can walk.
pub fn of_cubin(b: &[u8]) -> Option<BTreeMap<String, Resources>> {
    if b.get(..4)? != b"\x7fELF" || b.get(4) != Some(&2) || b.get(5) != Some(&1) {
        return None;
    }
    let flags = u32_at(b, 48)?;
    let arch = if *b.get(8)? >= 8 {
        (flags >> 8) & 0xff
    } else {
        flags & 0xff
    };
    let shoff = u64_at(b, 40)? as usize;
    let shnum = u16_at(b, 60)? as usize;
    let shstrndx = u16_at(b, 62)? as usize;
    let sh = |i: usize| {
        b.get(shoff.checked_add(i.checked_mul(64)?)?..)
            .and_then(|s| s.get(..64))
    };
    let data = |s: &[u8]| -> Option<&[u8]> {
        let off = u64_at(s, 24)? as usize;
        b.get(off..off.checked_add(u64_at(s, 32)? as usize)?)
    };
    let shstr = data(sh(shstrndx)?)?;
    let name_at = |t: &[u8], at: usize| -> Option<String> {
        let rest = t.get(at..)?;
        Some(String::from_utf8_lossy(&rest[..rest.iter().position(|&c| c == 0)?]).into_owned())
    };
    let mut names = Vec::with_capacity(shnum);
    for i in 0..shnum {
        names.push(name_at(shstr, u32_at(sh(i)?, 0)? as usize).unwrap_or_default());
    }
    let mut out: BTreeMap<String, Resources> = BTreeMap::new();
    let mut by_symbol: BTreeMap<u32, String> = BTreeMap::new();
    let mut constant = 0u32;
    for (i, n) in names.iter().enumerate() {
        let s = sh(i)?;
        if let Some(k) = n.strip_prefix(".text.") {
            let info = u32_at(s, 44)?;
            by_symbol.insert(info & 0x00ff_ffff, k.to_string());
            out.insert(
                k.to_string(),
                Resources {
                    regs: info >> 24,
                    arch,
                    ..Resources::default()
                },
            );
        }
        if n == ".nv.constant3" {
            constant = u64_at(s, 32)? as u32;
        }
    }
    let reserve_inside = names.iter().any(|n| n.starts_with(".nv.shared.reserved."));
    for (i, n) in names.iter().enumerate() {
        let s = sh(i)?;
        if let Some(k) = n.strip_prefix(".nv.shared.") {
            if let Some(r) = out.get_mut(k) {
                let size = u64_at(s, 32)? as u32;
                r.shared = if reserve_inside {
                    size.saturating_sub(RESERVED_SHARED)
                } else {
                    size
                };
            }
        } else if n == ".nv.info" {
            for (attr, v) in records(data(s)?) {
                let (Some(sym), Some(val)) = (u32_at(v, 0), u32_at(v, 4)) else {
                    continue;
                };
                let Some(r) = by_symbol.get(&sym).and_then(|k| out.get_mut(k)) else {
                    continue;
                };
                match attr {
                    EIATTR_REGCOUNT => r.regs = val,
                    EIATTR_FRAME_SIZE => r.local = val,
                    _ => {}
                }
            }
        } else if let Some(k) = n.strip_prefix(".nv.info.") {
            let Some(r) = out.get_mut(k) else { continue };
            for (attr, v) in records(data(s)?) {
                match attr {
                    EIATTR_MAX_THREADS => {
                        let dims = [u32_at(v, 0), u32_at(v, 4), u32_at(v, 8)];
                        r.max_threads = dims
                            .iter()
                            .try_fold(1u32, |acc, d| d.and_then(|d| acc.checked_mul(d.max(1))));
                    }
                    EIATTR_NUM_BARRIERS => r.barriers = v.first().copied().unwrap_or(0).into(),
                    _ => {}
                }
            }
        }
    }
    for r in out.values_mut() {
        r.constant = constant;
    }
    Some(out)
}

/// Which of `archs` (SM numbers of the cubins on offer) the driver runs on a GPU of SM number
/// `sm`: the same, else the newest of the same major below it.
pub fn pick_arch(archs: impl IntoIterator<Item = u32>, sm: u32) -> Option<u32> {
    archs
        .into_iter()
        .filter(|&a| a / 10 == sm / 10 && a <= sm)
        .max()
}

/// The kernels of the cubin a GPU of SM number `sm` runs from this image (a cubin, a fat binary,
/// or a fat binary wrapper), with what each needs. Empty where no cubin suits or the image
/// cannot be read.
pub fn for_arch(b: &[u8], sm: u32) -> BTreeMap<String, Resources> {
    if b.starts_with(b"\x7fELF") {
        return of_cubin(b)
            .filter(|k| {
                k.values()
                    .next()
                    .is_none_or(|r| pick_arch([r.arch], sm).is_some())
            })
            .unwrap_or_default();
    }
    let mut cubins = Vec::new();
    let (Some(hs), Some(size)) = (u16_at(b, 6), u64_at(b, 8)) else {
        return BTreeMap::new();
    };
    let end = (hs as usize).saturating_add(size as usize).min(b.len());
    let mut at = hs as usize;
    while at + 64 <= end {
        let (Some(kind), Some(ehs), Some(padded), Some(len), Some(arch), Some(flags)) = (
            u16_at(b, at),
            u32_at(b, at + 4),
            u64_at(b, at + 8),
            u32_at(b, at + 0x10),
            u32_at(b, at + 0x1c),
            u64_at(b, at + 0x28),
        ) else {
            break;
        };
        if ehs < 64 {
            break;
        }
        let start = at + ehs as usize;
        let Some(next) = start.checked_add(padded as usize).filter(|&n| n <= end) else {
            break;
        };
        if kind != 1 {
            cubins.push((arch, at, start, next, len, flags));
        }
        at = next;
    }
    let Some(want) = pick_arch(cubins.iter().map(|c| c.0), sm) else {
        return BTreeMap::new();
    };
    let Some(&(_, head, start, next, len, flags)) = cubins.iter().find(|c| c.0 == want) else {
        return BTreeMap::new();
    };
    let payload = &b[start..next];
    let payload = match len {
        0 => payload,
        n => payload.get(..n as usize).unwrap_or(payload),
    };
    let plain = if flags & (crate::FATBIN_LZ4 | crate::FATBIN_ZSTD) != 0 {
        let n = u64_at(b, head + 0x38).unwrap_or(0).min(crate::MAX_IMAGE) as usize;
        if payload.starts_with(&crate::ZSTD_MAGIC) {
            crate::zstd_frame(payload, n)
        } else {
            crate::lz4_block(payload, n)
        }
    } else {
        Some(payload.to_vec())
    };
    plain.and_then(|p| of_cubin(&p)).unwrap_or_default()
}

/// [`for_arch`] of an image as cuModuleLoadData gets it (see [`crate::from_ptr`]).
///
/// # Safety
/// As [`crate::from_ptr`]: `p` is NULL or an image readable for as long as its headers say.
pub unsafe fn for_arch_at(p: *const c_void, sm: u32) -> BTreeMap<String, Resources> {
    if p.is_null() {
        return BTreeMap::new();
    }
    let mut magic = [0u8; 4];
    for (i, m) in magic.iter_mut().enumerate() {
        // SAFETY: every image form is at least 4 bytes long, or a shorter NUL-terminated
        // placeholder: reading byte by byte and stopping at a NUL stays within it.
        *m = unsafe { *(p as *const u8).add(i) };
        if *m == 0 {
            return BTreeMap::new();
        }
    }
    let mut p = p;
    if magic == crate::FATBIN_WRAPPER_MAGIC.to_le_bytes() {
        // SAFETY: a __fatBinC_Wrapper_t: its third field (at 8) points at the fat binary.
        p = unsafe { *((p as *const u8).add(8) as *const *const c_void) };
        if p.is_null() {
            return BTreeMap::new();
        }
        // SAFETY: the fat binary's magic, readable by the same contract.
        magic = unsafe { *(p as *const [u8; 4]) };
    }
    if magic == *b"\x7fELF" {
        // SAFETY: an ELF image by its magic; its headers bound it.
        return match unsafe { crate::elf_len(p) } {
            // SAFETY: the ELF spans `len` bytes from `p`.
            Ok(len) => for_arch(
                unsafe { std::slice::from_raw_parts(p as *const u8, len) },
                sm,
            ),
            Err(_) => BTreeMap::new(),
        };
    }
    if magic == crate::FATBIN_MAGIC.to_le_bytes() {
        // SAFETY: a fat binary's 16-byte header, then the entries it announces.
        let head = unsafe { std::slice::from_raw_parts(p as *const u8, 16) };
        let (Some(hs), Some(size)) = (u16_at(head, 6), u64_at(head, 8)) else {
            return BTreeMap::new();
        };
        let total = (hs as u64).saturating_add(size);
        if hs < 16 || total > crate::MAX_IMAGE {
            return BTreeMap::new();
        }
        // SAFETY: header and entries, `total` bytes from `p`, by the API contract.
        return for_arch(
            unsafe { std::slice::from_raw_parts(p as *const u8, total as usize) },
            sm,
        );
    }
    BTreeMap::new()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nv_info_records_of_each_format() {
        // NVAL, BVAL 1, HVAL 255, SVAL of 8 bytes.
        let d = [
            1u8, 0x35, 0, 0, 2, 0x4c, 1, 0, 3, 0x1b, 255, 0, 4, 0x2f, 8, 0, 1, 0, 0, 0, 40, 0, 0, 0,
        ];
        let r = records(&d);
        assert_eq!(r.len(), 4);
        assert_eq!(r[1], (0x4c, &[1u8, 0][..]));
        assert_eq!(r[2], (0x1b, &[255u8, 0][..]));
        assert_eq!(r[3].0, 0x2f);
        assert_eq!(u32_at(r[3].1, 4), Some(40));
    }

    /// A cubin for SM `sm` (CUDA 13 `e_flags` layout) holding what `of_cubin` reads: per kernel
    /// (name, registers, shared bytes, frame bytes, launch bound), a `.text.<k>` section whose
    /// `sh_info` carries the registers and symbol index 0x10 + i, `.nv.shared.<k>`,
    /// `.nv.info.<k>` with EIATTR_MAX_THREADS, and `.nv.info` with EIATTR_REGCOUNT and
    /// EIATTR_FRAME_SIZE; a 256-byte `.nv.constant3`. Laid out as nvcc 13.5's cubins are.
    fn cubin(sm: u32, kernels: &[(&str, u32, u64, u32, Option<u32>)]) -> Vec<u8> {
        let mut shstr = vec![0u8];
        let mut name = |s: &str| {
            let at = shstr.len() as u32;
            shstr.extend_from_slice(s.as_bytes());
            shstr.push(0);
            at
        };
        // (name offset, type, size, info, data)
        let mut secs: Vec<(u32, u32, u64, u32, Vec<u8>)> = vec![(0, 0, 0, 0, vec![])];
        let shstr_at = name(".shstrtab");
        secs.push((shstr_at, 3, 0, 0, vec![]));
        let sval = |attr: u8, words: &[u32]| {
            let mut v = vec![4u8, attr];
            v.extend_from_slice(&((words.len() * 4) as u16).to_le_bytes());
            for w in words {
                v.extend_from_slice(&w.to_le_bytes());
            }
            v
        };
        let mut info = vec![1u8, 0x35, 0, 0]; // an NVAL record, to be skipped
        for (i, &(k, regs, shared, frame, bound)) in kernels.iter().enumerate() {
            let sym = 0x10 + i as u32;
            // ptxas writes the register count in both places; the record wins, so give the
            // section header a different one to tell which was read.
            secs.push((
                name(&format!(".text.{k}")),
                1,
                128,
                ((regs + 1) << 24) | sym,
                vec![0; 128],
            ));
            secs.push((name(&format!(".nv.shared.{k}")), 8, shared, sym, vec![]));
            let mut kinfo = vec![3u8, 0x19, 8, 0]; // an HVAL record
            if let Some(b) = bound {
                kinfo.extend(sval(EIATTR_MAX_THREADS, &[b, 1, 1]));
            }
            secs.push((name(&format!(".nv.info.{k}")), 0x7000_0000, 0, sym, kinfo));
            info.extend(sval(EIATTR_REGCOUNT, &[sym, regs]));
            info.extend(sval(EIATTR_FRAME_SIZE, &[sym, frame]));
        }
        secs.push((name(".nv.info"), 0x7000_0000, 0, 0, info));
        if sm >= 90 {
            // What nvcc 13.5 adds on sm_90: the driver's reserve inside the shared window.
            secs.push((name(".nv.shared.reserved.0"), 8, 0, 0, vec![]));
        }
        secs.push((name(".nv.constant3"), 1, 256, 0, vec![0; 256]));
        secs[1].4 = shstr.clone();
        let mut b = vec![0u8; 64];
        b[..4].copy_from_slice(b"\x7fELF");
        b[4] = 2;
        b[5] = 1;
        b[8] = 8; // EI_ABIVERSION of CUDA 13 cubins
        b[48..52].copy_from_slice(&(0x0600_0004 | (sm << 8)).to_le_bytes());
        let mut offs = Vec::new();
        for s in &secs {
            offs.push(b.len() as u64);
            b.extend_from_slice(&s.4);
        }
        let shoff = b.len().next_multiple_of(8);
        b.resize(shoff, 0);
        for (s, off) in secs.iter().zip(offs) {
            let mut h = [0u8; 64];
            h[0..4].copy_from_slice(&s.0.to_le_bytes());
            h[4..8].copy_from_slice(&s.1.to_le_bytes());
            h[24..32].copy_from_slice(&off.to_le_bytes());
            let size = if s.4.is_empty() {
                s.2
            } else {
                s.4.len() as u64
            };
            h[32..40].copy_from_slice(&size.to_le_bytes());
            h[44..48].copy_from_slice(&s.3.to_le_bytes());
            b.extend_from_slice(&h);
        }
        b[40..48].copy_from_slice(&(shoff as u64).to_le_bytes());
        b[58..60].copy_from_slice(&64u16.to_le_bytes());
        b[60..62].copy_from_slice(&(secs.len() as u16).to_le_bytes());
        b[62..64].copy_from_slice(&1u16.to_le_bytes());
        b
    }

    #[test]
    fn a_cubin_gives_each_kernels_registers_shared_local_memory_and_launch_bound() {
        let b = cubin(
            80,
            &[
                ("light", 8, 0, 0, None),
                ("smem", 12, 12000, 0, Some(256)),
                ("local", 40, 0, 1024, None),
            ],
        );
        let k = of_cubin(&b).unwrap();
        assert_eq!(k.len(), 3);
        let r = |n: &str| k[n];
        assert_eq!(
            (r("light").regs, r("light").shared, r("light").max_threads),
            (8, 0, None)
        );
        assert_eq!(
            (r("smem").regs, r("smem").shared, r("smem").max_threads),
            (12, 12000, Some(256))
        );
        assert_eq!((r("local").regs, r("local").local), (40, 1024));
        assert!(k.values().all(|r| r.arch == 80 && r.constant == 256));
        assert_eq!(for_arch(&b, 80).len(), 3, "a cubin of the GPU's own SM");
        assert_eq!(
            for_arch(&b, 86).len(),
            3,
            "an older minor of the same major runs"
        );
        assert!(for_arch(&b, 90).is_empty(), "another major does not");
        assert!(of_cubin(b"\x7fELF").is_none());
    }

    #[test]
    fn an_sm_90_kernels_shared_section_holds_the_drivers_reserve_which_is_not_its_own() {
        let k = of_cubin(&cubin(90, &[("smem", 11, 13024, 0, Some(256))])).unwrap();
        assert_eq!(k["smem"].shared, 12000);
        let k = of_cubin(&cubin(80, &[("smem", 12, 12000, 0, Some(256))])).unwrap();
        assert_eq!(k["smem"].shared, 12000);
    }

    #[test]
    fn a_fat_binary_gives_the_cubin_the_driver_would_pick_compressed_or_not() {
        use crate::make::{fat_entry, fatbin, Packing};
        let entry = |sm: u32, regs: u32, packing| {
            let mut e = fat_entry(2, &cubin(sm, &[("k", regs, 0, 0, None)]), packing);
            e[0x1c..0x20].copy_from_slice(&sm.to_le_bytes());
            e
        };
        let fat = fatbin(&[
            entry(75, 75, Packing::Plain),
            entry(80, 80, Packing::Zstd),
            entry(86, 86, Packing::Lz4),
            fat_entry(1, b".version 9.0\n.target sm_90\n\0", Packing::Plain),
        ]);
        for (sm, regs) in [
            (75, Some(75)),
            (80, Some(80)),
            (86, Some(86)),
            (89, Some(86)),
            (90, None),
            (70, None),
        ] {
            assert_eq!(
                for_arch(&fat, sm).get("k").map(|r| r.regs),
                regs,
                "on sm_{sm}"
            );
        }
    }

    #[test]
    fn the_driver_picks_the_same_or_an_older_minor_of_the_same_major() {
        assert_eq!(pick_arch([75, 80, 86], 86), Some(86));
        assert_eq!(pick_arch([75, 80], 86), Some(80));
        assert_eq!(pick_arch([80], 90), None);
        assert_eq!(pick_arch([86], 80), None);
    }
}
