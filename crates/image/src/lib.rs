//! What a CUDA module image defines: its kernels and its variables, and so how much device
//! memory loading it takes. Read by the simulated driver (to load an image as the real driver
//! does: a kernel or global the image does not define is CUDA_ERROR_NOT_FOUND, and a global is
//! device memory of the size the image gives it) and by libcuvisor (to charge that memory to the
//! quota BEFORE the real driver takes it). One reader for both, so that what is charged is what
//! the image says, not what either side happens to assume.
//!
//! The forms a program hands cuModuleLoadData*, cuModuleLoadFatBinary and cuLibraryLoadData:
//!
//! - A cubin is an ELF file. Its kernels are the `.text.<name>` sections, and its `__device__`
//!   and `__constant__` variables are the symbols in the `.nv.global` (zero-initialised),
//!   `.nv.global.init` (initialised) and `.nv.constant<N>` sections: that is how Gdev's cubin
//!   loader reads them (shinpei0208/gdev, `cuda/driver/gdev_cuda.c`, `load_cubin`), and what
//!   NVRTC 12.9's cubins hold (measured with `readelf -sS`: kernels are FUNC symbols with
//!   `st_other` 0x10 and a `.text.<name>` section; variables are OBJECT symbols with their size
//!   in `st_size`, in the sections above; `extern` ones are undefined, section index 0). The
//!   driver allocates those sections, so their sizes bound the memory even where no symbol
//!   names it ([`Symbols::sections`]).
//! - PTX is NUL-terminated text. Kernels are declared with the `.entry` directive; module-scope
//!   variables live in the `.global` and `.const` state spaces, declared as
//!   `[.visible|.weak|.common] .global|.const [.align n] [.vN] .type name[d0][d1]... [= init];`,
//!   `.extern` ones being declarations only (PTX ISA, "State Spaces, Types, and Variables" and
//!   "Directives", <https://docs.nvidia.com/cuda/parallel-thread-execution/>). Integer
//!   constants are decimal, hexadecimal (`0x`), octal (leading `0`) or binary (`0b`), with an
//!   optional `U` suffix (PTX ISA, "Integer Constants").
//! - A fat binary (what nvcc links into a program and libcudart hands the driver, directly or
//!   through its `__fatBinC_Wrapper_t`, magic 0x466243b1, whose third field points at the fat
//!   binary) is a 16-byte header (magic 0xBA55ED50, u16 version, u16 header size, u64 size of
//!   the entries) and entries, each a header (u16 kind: 1 PTX, 2 ELF, 0x10 ELF as well, 0x100
//!   several images compressed together, see `concat_parts`; u32
//!   header size; u32 payload size padded to 8 bytes; u32 payload size at 0x10; u64 flags at
//!   0x28; u64 uncompressed size at 0x38) and its payload. A payload is compressed when its
//!   flags say so: 0x2000 is an LZ4 block (no frame), which is how the CUDA 12 libraries ship
//!   most of their cubins (measured on libcublasLt 12.8: 5246 of 6175 ELF entries compressed;
//!   decompressed, each is a cubin of exactly the size the header says); 0x8000 is a Zstandard
//!   frame, which is how the CUDA 13 libraries ship theirs (GrigoryEvko/nvopen-tools,
//!   `fatbin/FORMAT_SPECIFICATION.md`, from cuobjdump 11.x–13.x: "ELF entries: always ZSTD
//!   compressed", "Compression flag: bit 15 of flags", libcublasLt.so.13's 5,424 ELF entries;
//!   and nvcc's `--compress-mode=size`, CUDA 12.4+, needs driver 550.54.14 or later: RAPIDS'
//!   `rapids_cuda_enable_fatbin_compression`). This layout is the one ZLUDA's fat binary reader
//!   describes (vosen/ZLUDA, the `zluda_dark_api` crate's fatbin module) and cuobjdump shows.
//!   The driver loads ONE entry of it, the one that suits the GPU (a cubin of its
//!   architecture, or PTX it compiles), so the memory a load takes is at most that of the
//!   largest entry; the variables of all entries together ([`Image::Fat`], per name the largest)
//!   bound it too. Its kernels are not enumerated (the entry the driver picks depends on the
//!   GPU), so any kernel name resolves.
//!
//! Any other bytes are [`Image::Opaque`]: not an image the real driver loads (it answers
//! CUDA_ERROR_INVALID_IMAGE or _INVALID_PTX, and takes no memory). The simulator, which has no
//! ISA to check, loads them anyway (its own tests load placeholder bytes), with no variables.
//!
//! An image in one of the forms above whose memory cannot be computed here — a compression this
//! reader cannot undo, a size that overflows, an array whose extent is not a constant it can
//! read, a structure it cannot walk — is [`Image::Unsized`], with the reason: libcuvisor refuses
//! to load it (it cannot charge what it cannot size), and the simulator loads it without
//! variables.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::{c_char, c_void, CStr};

/// What a cubin or PTX image defines.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Symbols {
    pub kernels: BTreeSet<String>,
    /// Name → size in bytes.
    pub globals: BTreeMap<String, u64>,
    /// The sizes of the sections that hold variables (`.nv.global*`, `.nv.constant<N>`),
    /// together: what the driver allocates for them, whether or not a symbol names the bytes.
    pub sections: u64,
    /// The sizes of its code sections (`.text.<kernel or function>`) together: what loading the
    /// cubin puts in device memory besides its variables. 0 for PTX (its code is what the
    /// driver compiles it to, which is not known here).
    pub code: u64,
}

/// The variables of a fat binary's entries.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Fat {
    /// Name → size in bytes, the largest any entry gives it.
    pub globals: BTreeMap<String, u64>,
    /// The largest [`Symbols::sections`] of any of its cubins.
    pub sections: u64,
    /// The largest [`Symbols::code`] of any of its cubins (the driver loads one of them).
    pub code: u64,
}

#[derive(Debug, PartialEq, Eq)]
pub enum Image {
    Known(Symbols),
    /// A fat binary: the globals its entries define; any kernel name resolves.
    Fat(Fat),
    /// Not an image the real driver loads.
    Opaque,
    /// An image whose device memory cannot be computed here, and why.
    Unsized(String),
}

impl Image {
    /// Whether `name` is a kernel of this image (any name is, where the kernels are not known).
    pub fn has_kernel(&self, name: &str) -> bool {
        match self {
            Image::Known(s) => s.kernels.contains(name),
            Image::Fat(_) | Image::Opaque | Image::Unsized(_) => true,
        }
    }
    pub fn global(&self, name: &str) -> Option<u64> {
        match self {
            Image::Known(s) => s.globals.get(name).copied(),
            Image::Fat(f) => f.globals.get(name).copied(),
            Image::Opaque | Image::Unsized(_) => None,
        }
    }
    pub fn globals(&self) -> Vec<(String, u64)> {
        let g = match self {
            Image::Known(s) => &s.globals,
            Image::Fat(f) => &f.globals,
            Image::Opaque | Image::Unsized(_) => return Vec::new(),
        };
        g.iter().map(|(k, v)| (k.clone(), *v)).collect()
    }

    /// The size of the code loading this image puts in device memory (see [`Symbols::code`]); 0
    /// where it is not known.
    pub fn code_bytes(&self) -> u64 {
        match self {
            Image::Known(s) => s.code,
            Image::Fat(f) => f.code,
            Image::Opaque | Image::Unsized(_) => 0,
        }
    }

    /// The device memory loading this image takes at most, with every variable rounded up to
    /// whole `unit`s (the smallest piece a driver allocation takes): the larger of its variables
    /// and its variable sections. 0 for an image the driver does not load; Err (the reason) for
    /// one whose memory cannot be computed.
    pub fn device_bytes(&self, unit: u64) -> Result<u64, String> {
        let (globals, sections) = match self {
            Image::Known(s) => (&s.globals, s.sections),
            Image::Fat(f) => (&f.globals, f.sections),
            Image::Opaque => return Ok(0),
            Image::Unsized(why) => return Err(why.clone()),
        };
        let up = |n: u64| n.checked_next_multiple_of(unit.max(1));
        let overflow = || "its variables' sizes overflow".to_string();
        let mut vars = 0u64;
        for &size in globals.values() {
            vars = up(size)
                .and_then(|s| vars.checked_add(s))
                .ok_or_else(overflow)?;
        }
        Ok(vars.max(up(sections).ok_or_else(overflow)?))
    }
}

/// No image is larger than this (a cubin of a big library is tens of MB).
pub const MAX_IMAGE: u64 = 1 << 30;

pub(crate) const FATBIN_WRAPPER_MAGIC: u32 = 0x4662_43b1;
pub(crate) const FATBIN_MAGIC: u32 = 0xBA55_ED50;
pub(crate) const FATBIN_LZ4: u64 = 0x2000;
pub(crate) const FATBIN_ZSTD: u64 = 0x8000;
/// A concatenated entry: several images compressed together ([`concat_parts`]).
pub(crate) const FATBIN_CONCAT: u16 = 0x100;
pub(crate) const ZSTD_MAGIC: [u8; 4] = [0x28, 0xb5, 0x2f, 0xfd];

fn cannot_size(why: &str) -> Image {
    Image::Unsized(why.to_string())
}

/// Reads the image at `p` as cuModuleLoadData gets it: a pointer and no length. An ELF's
/// length follows from its headers, a fat binary's from its header; PTX ends at its NUL.
///
/// # Safety
/// `p` is NULL or points at an image as the driver API takes one (cuModuleLoadData's
/// contract): readable for as long as its own headers (or its NUL) say.
pub unsafe fn from_ptr(p: *const c_void) -> Image {
    if p.is_null() {
        return Image::Opaque;
    }
    // The first bytes, stopping at a NUL: every image form is at least 4 bytes long (an ELF or
    // fat binary magic, or PTX text), and a shorter placeholder (the simulator's tests load C
    // strings) ends in its NUL.
    let mut magic = Vec::with_capacity(4);
    for i in 0..4 {
        // SAFETY: by the API contract the image is readable from `p`, and the bytes read stop
        // at its end (4 bytes, or a NUL before them).
        let b = unsafe { *(p as *const u8).add(i) };
        if b == 0 {
            break;
        }
        magic.push(b);
    }
    if magic == b"\x7fELF" {
        // SAFETY: an ELF image by its magic (the caller's contract covers its headers).
        return match unsafe { elf_len(p) } {
            // SAFETY: the ELF's headers say it spans `len` bytes from `p`, and by the API
            // contract the whole image is readable there.
            Ok(len) => from_elf(unsafe { std::slice::from_raw_parts(p as *const u8, len) }),
            Err(why) => Image::Unsized(why),
        };
    }
    if magic == FATBIN_WRAPPER_MAGIC.to_le_bytes() {
        // SAFETY: a __fatBinC_Wrapper_t { int magic, version; const u64 *data; void *filename }:
        // by the API contract its 24 bytes are readable; `data` is the fat binary.
        let data = unsafe { *((p as *const u8).add(8) as *const *const c_void) };
        if data.is_null() {
            return cannot_size("a fat binary wrapper without its fat binary");
        }
        // SAFETY: the wrapper's fat binary, readable by the same contract.
        return unsafe { from_fatbin_ptr(data) };
    }
    if magic == FATBIN_MAGIC.to_le_bytes() {
        // SAFETY: a fat binary by its magic.
        return unsafe { from_fatbin_ptr(p) };
    }
    if magic.len() == 4 && magic.iter().all(|b| b.is_ascii()) {
        // SAFETY: ASCII text: by the API contract a PTX image is a NUL-terminated string.
        let text = unsafe { CStr::from_ptr(p as *const c_char) };
        return from_ptx(&text.to_string_lossy());
    }
    Image::Opaque
}

/// An image held in memory with its length (a file's contents, cuModuleLoad and
/// cuLibraryLoadFromFile; a fat binary entry's payload).
pub fn from_bytes(b: &[u8]) -> Image {
    if b.starts_with(b"\x7fELF") {
        from_elf(b)
    } else if b.starts_with(&FATBIN_MAGIC.to_le_bytes()) {
        from_fatbin(b)
    } else if b.is_ascii() {
        // PTX ends at its NUL, if the bytes hold one.
        let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
        from_ptx(&String::from_utf8_lossy(&b[..end]))
    } else {
        Image::Opaque
    }
}

/// A fat binary in memory: its header says how long it is.
///
/// # Safety
/// `p` points at a fat binary readable for as long as its header says.
unsafe fn from_fatbin_ptr(p: *const c_void) -> Image {
    // SAFETY: the fat binary's 16-byte header is readable by the API contract, and then the
    // `size` bytes of entries it announces after its `header_size`.
    let head = unsafe { std::slice::from_raw_parts(p as *const u8, 16) };
    let (Some(magic), Some(hs), Some(size)) = (u32_at(head, 0), u16_at(head, 6), u64_at(head, 8))
    else {
        return cannot_size("a fat binary header it cannot read");
    };
    if magic != FATBIN_MAGIC {
        return cannot_size("a fat binary wrapper whose fat binary has another magic");
    }
    let total = (hs as u64).checked_add(size).filter(|&t| t <= MAX_IMAGE);
    let Some(total) = total.filter(|_| hs >= 16) else {
        return cannot_size("a fat binary whose header gives a size it cannot take");
    };
    // SAFETY: as above: header and entries, `total` bytes from `p`.
    from_fatbin(unsafe { std::slice::from_raw_parts(p as *const u8, total as usize) })
}

/// The variables of every entry of a fat binary (see the module doc).
fn from_fatbin(b: &[u8]) -> Image {
    let mut fat = Fat::default();
    let (Some(hs), Some(size)) = (u16_at(b, 6), u64_at(b, 8)) else {
        return cannot_size("a fat binary header it cannot read");
    };
    let end = (hs as u64)
        .checked_add(size)
        .filter(|&e| hs >= 16 && e <= b.len() as u64);
    let Some(end) = end else {
        return cannot_size("a fat binary shorter than its header says");
    };
    let end = end as usize;
    let mut at = hs as usize;
    // Entries follow each other to the end; a 64-byte entry header at least (cuobjdump walks
    // them so, and stops at a header of size 0).
    while at + 64 <= end {
        let (Some(kind), Some(ehs), Some(padded), Some(len), Some(flags)) = (
            u16_at(b, at),
            u32_at(b, at + 4),
            u32_at(b, at + 8),
            u32_at(b, at + 0x10),
            u64_at(b, at + 0x28),
        ) else {
            return cannot_size("a fat binary entry it cannot read");
        };
        if ehs == 0 {
            break;
        }
        let start = at + ehs as usize;
        let Some(next) = start.checked_add(padded as usize).filter(|&n| n <= end) else {
            return cannot_size("a fat binary entry beyond its end");
        };
        if ehs < 64 {
            return cannot_size("a fat binary entry header shorter than 64 bytes");
        }
        let payload = &b[start..next];
        // The payload proper (its size before padding), where the header gives one: nvcc
        // 13.5 writes 0 there for an uncompressed cubin (measured: `.nv_fatbin` of a program it
        // built, kind 2, flags 0x11, 0 at 0x10), whose ELF headers then bound it.
        let payload = match len {
            0 => payload,
            n => payload.get(..n as usize).unwrap_or(payload),
        };
        if matches!(kind, 1 | 2 | 0x10 | FATBIN_CONCAT) {
            let plain = if flags & (FATBIN_LZ4 | FATBIN_ZSTD) != 0 {
                let Some(n) = u64_at(b, at + 0x38).filter(|&n| n <= MAX_IMAGE) else {
                    return cannot_size("a compressed fat binary entry of a size it cannot take");
                };
                let out = if payload.starts_with(&ZSTD_MAGIC) {
                    zstd_frame(payload, n as usize)
                } else if flags & FATBIN_LZ4 != 0 {
                    lz4_block(payload, n as usize)
                } else {
                    None
                };
                match out {
                    Some(v) => v,
                    None => {
                        return cannot_size("a compressed fat binary entry it cannot decompress")
                    }
                }
            } else {
                payload.to_vec()
            };
            if kind == FATBIN_CONCAT {
                let Some(parts) = concat_parts(&b[at..start], &plain) else {
                    return cannot_size("a concatenated fat binary entry it cannot walk");
                };
                for (kind, part) in parts {
                    if let Err(why) = add_entry(&mut fat, kind, part) {
                        return Image::Unsized(why);
                    }
                }
            } else if let Err(why) = add_entry(&mut fat, kind, &plain) {
                return Image::Unsized(why);
            }
        }
        at = next;
    }
    Image::Fat(fat)
}

/// One entry's plain bytes (a cubin or PTX, as `kind` says) into the fat binary's variables.
fn add_entry(fat: &mut Fat, kind: u16, plain: &[u8]) -> Result<(), String> {
    let elf = kind != 1;
    if elf && !plain.starts_with(b"\x7fELF") || !elf && !plain.is_ascii() {
        // Not what its kind says: stored in a way this reader does not know.
        return Err("a fat binary entry stored in a way it does not know".into());
    }
    match from_bytes(plain) {
        Image::Known(s) => {
            for (name, size) in s.globals {
                let e = fat.globals.entry(name).or_insert(0);
                *e = (*e).max(size);
            }
            fat.sections = fat.sections.max(s.sections);
            fat.code = fat.code.max(s.code);
            Ok(())
        }
        Image::Unsized(why) => Err(why),
        // An entry the driver cannot load either (or empty padding): it loads another.
        Image::Fat(_) | Image::Opaque => Ok(()),
    }
}

/// The parts of a concatenated entry (kind 0x100, what `nvcc --concat` writes, CUDA 13: "Enable
/// concatenated fatbin entries for improved compression of multi-architecture builds", nvcc
/// 13.5 --help). Its payload, once decompressed as its flags say, is its parts' images one
/// after the other; its header (`head`, 200 bytes for two parts) goes on after the usual 64
/// bytes with a u32 count of parts and a u32 length of the table that follows (8 + 64 per
/// part), then one 64-byte header per part: u16 kind (2 a cubin, 1 PTX), u32 offset of the part
/// in the payload at 4, u64 its size at 8, u32 its architecture at 0x1c, u64 flags at 0x28
/// (measured: `nvcc -fatbin --concat` 13.5 for sm_80 and sm_90 wrote one such entry, flags
/// 0x8011, 10640 bytes uncompressed = its two cubins of 5216 and 5424 bytes at offsets 0 and
/// 5216, count 2, table length 136). None where the table does not fit the header or a part
/// lies outside the payload.
fn concat_parts<'a>(head: &[u8], plain: &'a [u8]) -> Option<Vec<(u16, &'a [u8])>> {
    let count = u32_at(head, 0x40)? as usize;
    let table = u32_at(head, 0x44)? as usize;
    if table != count.checked_mul(64)?.checked_add(8)? || 0x40 + table > head.len() {
        return None;
    }
    (0..count)
        .map(|i| {
            let h = 0x48 + i * 64;
            let kind = u16_at(head, h)?;
            let off = u32_at(head, h + 4)? as usize;
            let len = usize::try_from(u64_at(head, h + 8)?).ok()?;
            Some((kind, plain.get(off..off.checked_add(len)?)?))
        })
        .collect()
}

/// Decompresses one Zstandard frame into exactly `size` bytes. None if it is malformed or of
/// another size.
pub(crate) fn zstd_frame(src: &[u8], size: usize) -> Option<Vec<u8>> {
    let mut out = vec![0u8; size];
    let mut d = ruzstd::decoding::FrameDecoder::new();
    // `decode_all` refuses output beyond `out` (TargetTooSmall) instead of growing it.
    let n = d.decode_all(src, &mut out).ok()?;
    (n == size).then_some(out)
}

/// Decompresses one LZ4 block (no frame) into exactly `size` bytes, with lz4_flex (safe code
/// only, input checked). None if it is malformed or of another size.
pub(crate) fn lz4_block(src: &[u8], size: usize) -> Option<Vec<u8>> {
    let mut out = vec![0u8; size];
    let n = lz4_flex::block::decompress_into(src, &mut out).ok()?;
    (n == size).then_some(out)
}

pub(crate) fn u16_at(b: &[u8], off: usize) -> Option<u16> {
    Some(u16::from_le_bytes(
        b.get(off..off.checked_add(2)?)?.try_into().ok()?,
    ))
}
pub(crate) fn u32_at(b: &[u8], off: usize) -> Option<u32> {
    Some(u32::from_le_bytes(
        b.get(off..off.checked_add(4)?)?.try_into().ok()?,
    ))
}
pub(crate) fn u64_at(b: &[u8], off: usize) -> Option<u64> {
    Some(u64::from_le_bytes(
        b.get(off..off.checked_add(8)?)?.try_into().ok()?,
    ))
}

/// The extent of an ELF64 (little-endian) image from its headers: the end of its last section,
/// section header table or program header table.
///
/// # Safety
/// `p` points at an ELF image readable for as long as its headers say.
pub(crate) unsafe fn elf_len(p: *const c_void) -> Result<usize, String> {
    let bad = |why: &str| format!("an ELF image {why}");
    // SAFETY: an ELF64 header is 64 bytes, and the magic said this is an ELF image.
    let head = unsafe { std::slice::from_raw_parts(p as *const u8, 64) };
    if head[4] != 2 || head[5] != 1 {
        return Err(bad("that is not 64-bit little-endian"));
    }
    let field = |v: Option<u64>| v.ok_or_else(|| bad("whose header it cannot read"));
    let phoff = field(u64_at(head, 32))?;
    let shoff = field(u64_at(head, 40))?;
    let phentsize = field(u16_at(head, 54).map(u64::from))?;
    let phnum = field(u16_at(head, 56).map(u64::from))?;
    let shentsize = field(u16_at(head, 58).map(u64::from))?;
    let shnum = field(u16_at(head, 60).map(u64::from))?;
    if shentsize != 64 || shoff > MAX_IMAGE || phoff > MAX_IMAGE {
        return Err(bad("whose section table it cannot read"));
    }
    let mut end = (shoff + shnum * 64).max(phoff + phnum * phentsize).max(64);
    // SAFETY: the section header table lies within the image (its header says where).
    let shdrs = unsafe {
        std::slice::from_raw_parts((p as *const u8).add(shoff as usize), shnum as usize * 64)
    };
    for s in shdrs.chunks_exact(64) {
        const SHT_NOBITS: u32 = 8;
        if u32_at(s, 4) == Some(SHT_NOBITS) {
            continue;
        }
        let (off, size) = (field(u64_at(s, 24))?, field(u64_at(s, 32))?);
        end = end.max(
            off.checked_add(size)
                .ok_or_else(|| bad("whose section sizes overflow"))?,
        );
    }
    if end > MAX_IMAGE {
        return Err(bad("larger than 1 GiB"));
    }
    Ok(end as usize)
}

/// Kernels and variables of a cubin (see the module doc).
fn from_elf(b: &[u8]) -> Image {
    match elf_symbols(b) {
        Ok(s) => Image::Known(s),
        Err(why) => Image::Unsized(format!("an ELF image {why}")),
    }
}

fn elf_symbols(b: &[u8]) -> Result<Symbols, &'static str> {
    const UNREADABLE: &str = "whose sections it cannot read";
    if b.get(..4) != Some(b"\x7fELF") || b.get(4) != Some(&2) || b.get(5) != Some(&1) {
        return Err("that is not 64-bit little-endian");
    }
    let shoff = u64_at(b, 40).ok_or(UNREADABLE)? as usize;
    let shnum = u16_at(b, 60).ok_or(UNREADABLE)? as usize;
    let shstrndx = u16_at(b, 62).ok_or(UNREADABLE)? as usize;
    let sh = |i: usize| -> Result<&[u8], &'static str> {
        let at = i.checked_mul(64).and_then(|o| o.checked_add(shoff));
        let at = at.ok_or(UNREADABLE)?;
        b.get(at..at.checked_add(64).ok_or(UNREADABLE)?)
            .ok_or(UNREADABLE)
    };
    let section_data = |s: &[u8]| -> Result<&[u8], &'static str> {
        let off = u64_at(s, 24).ok_or(UNREADABLE)? as usize;
        let size = u64_at(s, 32).ok_or(UNREADABLE)? as usize;
        b.get(off..off.checked_add(size).ok_or(UNREADABLE)?)
            .ok_or(UNREADABLE)
    };
    let name_in = |strtab: &[u8], at: usize| -> Option<String> {
        let rest = strtab.get(at..)?;
        let end = rest.iter().position(|&c| c == 0)?;
        Some(String::from_utf8_lossy(&rest[..end]).into_owned())
    };
    let shstr = section_data(sh(shstrndx)?)?;
    let mut names = Vec::with_capacity(shnum);
    for i in 0..shnum {
        let at = u32_at(sh(i)?, 0).ok_or(UNREADABLE)? as usize;
        names.push(name_in(shstr, at).unwrap_or_default());
    }
    let mut out = Symbols::default();
    let mut text_sections = BTreeSet::new();
    for n in &names {
        if let Some(k) = n.strip_prefix(".text.") {
            text_sections.insert(k.to_string());
        }
    }
    let is_variable_section = |i: usize| {
        names.get(i).is_some_and(|n| {
            n == ".nv.global"
                || n == ".nv.global.init"
                || n.strip_prefix(".nv.constant").is_some_and(|rest| {
                    !rest.is_empty() && rest.bytes().all(|c| c.is_ascii_digit())
                })
        })
    };
    const SHT_SYMTAB: u32 = 2;
    const STT_OBJECT: u8 = 1;
    const STT_FUNC: u8 = 2;
    /// `st_other` of a kernel's symbol (a device function's lacks it).
    const STO_CUDA_ENTRY: u8 = 0x10;
    for (i, name) in names.iter().enumerate() {
        let s = sh(i)?;
        if name.starts_with(".text.") {
            let size = u64_at(s, 32).ok_or(UNREADABLE)?;
            out.code = out
                .code
                .checked_add(size)
                .ok_or("whose code sections' sizes overflow")?;
        }
        if is_variable_section(i) {
            let size = u64_at(s, 32).ok_or(UNREADABLE)?;
            out.sections = out
                .sections
                .checked_add(size)
                .ok_or("whose variable sections' sizes overflow")?;
        }
        if u32_at(s, 4) != Some(SHT_SYMTAB) {
            continue;
        }
        let syms = section_data(s)?;
        let strtab = section_data(sh(u32_at(s, 40).ok_or(UNREADABLE)? as usize)?)?;
        for sym in syms.chunks_exact(24) {
            let (info, other) = (sym[4], sym[5]);
            let shndx = u16_at(sym, 6).ok_or(UNREADABLE)? as usize;
            let size = u64_at(sym, 16).ok_or(UNREADABLE)?;
            if info & 0xf == STT_FUNC && other & STO_CUDA_ENTRY != 0 && shndx != 0 {
                if let Some(name) = name_in(strtab, u32_at(sym, 0).ok_or(UNREADABLE)? as usize) {
                    out.kernels.insert(name);
                }
                continue;
            }
            if info & 0xf != STT_OBJECT || shndx == 0 || size == 0 || !is_variable_section(shndx) {
                continue;
            }
            if let Some(name) = name_in(strtab, u32_at(sym, 0).ok_or(UNREADABLE)? as usize) {
                out.globals.insert(name, size);
            }
        }
    }
    if out.kernels.is_empty() {
        // No entry marks in the symbols: each `.text.<name>` section is a kernel, as Gdev reads it.
        out.kernels = text_sections;
    }
    Ok(out)
}

/// PTX text without its comments (`// ...` to the end of the line, `/* ... */`), which may
/// hold braces and semicolons that are not the module's. One pass over the text: the CUDA 13
/// libraries' PTX entries run to megabytes with a comment on most lines (cuBLASLt 13's), which
/// searching the rest of the text for each kind of comment at every comment made quadratic
/// (minutes of a first PyTorch 2.15 matmul under libcuvisor).
fn strip_ptx_comments(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find('/') {
        out.push_str(&rest[..at]);
        let tail = &rest[at..];
        if tail.starts_with("//") {
            // To the end of the line; the newline stays.
            match tail.find('\n') {
                Some(n) => rest = &tail[n..],
                None => return out,
            }
        } else if let Some(body) = tail.strip_prefix("/*") {
            out.push(' ');
            match body.find("*/") {
                Some(n) => rest = &body[n + 2..],
                None => return out,
            }
        } else {
            out.push('/');
            rest = &tail[1..];
        }
    }
    out.push_str(rest);
    out
}

/// Kernels and module-scope `.global` / `.const` variables of PTX text (see the module doc).
fn from_ptx(text: &str) -> Image {
    if !text.contains(".version") || !text.contains(".target") {
        return Image::Opaque;
    }
    let mut out = Symbols::default();
    // Statements end in ';' at module scope; a kernel's or function's body is a block in braces;
    // an initializer's braces (after '=') belong to its statement. Comments go first.
    let text = strip_ptx_comments(text);
    let (mut depth, mut init_depth) = (0usize, 0usize);
    let mut stmt = String::new();
    for c in text.chars() {
        if depth > 0 {
            match c {
                '{' => depth += 1,
                '}' => depth -= 1,
                _ => {}
            }
            continue;
        }
        match c {
            '{' if init_depth > 0 || stmt.contains('=') => {
                init_depth += 1;
                stmt.push(c);
            }
            '}' if init_depth > 0 => {
                init_depth -= 1;
                stmt.push(c);
            }
            '{' | ';' if init_depth == 0 => {
                if let Err(why) = ptx_statement(&stmt, &mut out) {
                    return Image::Unsized(why);
                }
                stmt.clear();
                if c == '{' {
                    depth = 1;
                }
            }
            _ => stmt.push(c),
        }
    }
    Image::Known(out)
}

/// One module-scope statement (or a block's header): a kernel, a variable, or neither.
fn ptx_statement(stmt: &str, out: &mut Symbols) -> Result<(), String> {
    let toks: Vec<&str> = stmt
        .split(|c: char| c.is_whitespace() || c == '(')
        .filter(|t| !t.is_empty())
        .collect();
    if let Some(i) = toks.iter().position(|t| *t == ".entry") {
        if let Some(name) = toks.get(i + 1) {
            out.kernels.insert(name.to_string());
        }
        return Ok(());
    }
    if toks.contains(&".extern") || toks.contains(&".func") {
        return Ok(());
    }
    let Some(i) = toks.iter().position(|t| *t == ".global" || *t == ".const") else {
        return Ok(());
    };
    match ptx_variable(&toks[i + 1..], stmt) {
        Some((name, size)) => {
            out.globals.insert(name, size);
            Ok(())
        }
        None => {
            let what = toks.get(i + 1..).unwrap_or_default().join(" ");
            Err(format!(
                "PTX whose variable `{}` it cannot size",
                what.chars().take(60).collect::<String>()
            ))
        }
    }
}

/// A PTX integer constant (decimal, `0x` hexadecimal, `0b` binary, leading-`0` octal, optional
/// `U` suffix).
fn ptx_int(s: &str) -> Option<u64> {
    let s = s.trim();
    let s = s.strip_suffix(['U', 'u']).unwrap_or(s);
    if let Some(h) = s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        u64::from_str_radix(h, 16).ok()
    } else if let Some(b) = s.strip_prefix("0b").or_else(|| s.strip_prefix("0B")) {
        u64::from_str_radix(b, 2).ok()
    } else if s.len() > 1 && s.starts_with('0') {
        u64::from_str_radix(&s[1..], 8).ok()
    } else {
        s.parse().ok()
    }
}

/// `[.align n] [.vN] .type name[d0]...[= ...]`: the name and its size in bytes. An empty first
/// dimension (`name[] = {...}`) takes the number of elements of the initializer.
fn ptx_variable(toks: &[&str], stmt: &str) -> Option<(String, u64)> {
    let mut it = toks.iter().peekable();
    let mut vector = 1u64;
    let mut elem = None;
    while let Some(t) = it.peek() {
        if !t.starts_with('.') {
            break;
        }
        let t = it.next()?;
        match *t {
            ".align" => {
                it.next();
            }
            ".visible" | ".weak" | ".common" => {}
            ".v2" => vector = 2,
            ".v4" => vector = 4,
            ".v8" => vector = 8,
            ".pred" => elem = Some(1),
            ".f16x2" | ".bf16x2" => elem = Some(4),
            // Opaque handles (texture, sampler and surface references): 64-bit.
            ".texref" | ".samplerref" | ".surfref" => elem = Some(8),
            _ => {
                let bits: String = t.chars().filter(|c| c.is_ascii_digit()).collect();
                if let Ok(b) = bits.parse::<u64>() {
                    elem = Some((b / 8).max(1));
                }
            }
        }
    }
    let decl = it.next()?;
    let name_end = decl.find(['[', '=']).unwrap_or(decl.len());
    let name = &decl[..name_end];
    if name.is_empty() {
        return None;
    }
    let mut count = 1u64;
    let dims_src: String = std::iter::once(&decl[name_end..])
        .chain(it.copied())
        .take_while(|s| !s.starts_with('='))
        .collect();
    let dims_src = dims_src.split('=').next().unwrap_or("");
    for d in dims_src.split('[').skip(1) {
        let d = d.split(']').next()?.trim();
        let n = if d.is_empty() {
            initializer_len(stmt)?
        } else {
            ptx_int(d)?
        };
        count = count.checked_mul(n)?;
    }
    Some((
        name.to_string(),
        elem?.checked_mul(vector)?.checked_mul(count)?,
    ))
}

/// The number of top-level elements of `= { a, b, ... }` in a declaration.
fn initializer_len(stmt: &str) -> Option<u64> {
    let init = stmt.split_once('=')?.1;
    let body = init.trim().strip_prefix('{')?;
    let body = body.rsplit_once('}')?.0;
    if body.trim().is_empty() {
        return None;
    }
    let (mut depth, mut n) = (0i32, 1u64);
    for c in body.chars() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => n += 1,
            _ => {}
        }
    }
    Some(n)
}

pub mod make;
pub mod resources;

#[cfg(test)]
mod tests;
