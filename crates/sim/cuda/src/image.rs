//! What a module image defines: its kernels and its globals, read from the two forms a program
//! compiles to at run time (NVRTC, nvcc -cubin / -ptx) and loads with cuModuleLoadData*, so that
//! cuModuleGetFunction and cuModuleGetGlobal answer as the real driver does for that image: a
//! kernel or global the image does not define is CUDA_ERROR_NOT_FOUND, and a global is device
//! memory of the size the image gives it.
//!
//! - A cubin is an ELF file. Its kernels are the `.text.<name>` sections, and its `__device__`
//!   and `__constant__` variables are the symbols in the `.nv.global` (zero-initialised),
//!   `.nv.global.init` (initialised) and `.nv.constant<N>` sections: that is how Gdev's cubin
//!   loader reads them (shinpei0208/gdev, `cuda/driver/gdev_cuda.c`, `load_cubin`), and what
//!   NVRTC 12.9's cubins hold (measured with `readelf -sS`: kernels are FUNC symbols with
//!   `st_other` 0x10 and a `.text.<name>` section; variables are OBJECT symbols with their size
//!   in `st_size`, in the sections above; `extern` ones are undefined, section index 0).
//! - PTX is NUL-terminated text. Kernels are declared with the `.entry` directive; module-scope
//!   variables live in the `.global` and `.const` state spaces, declared as
//!   `[.visible|.weak|.common] .global|.const [.align n] [.vN] .type name[d0][d1]... [= init];`,
//!   `.extern` ones being declarations only (PTX ISA, "State Spaces, Types, and Variables" and
//!   "Directives", <https://docs.nvidia.com/cuda/parallel-thread-execution/>).
//!
//! - A fat binary (what nvcc links into a program and libcudart hands the driver, directly or
//!   through its `__fatBinC_Wrapper_t`, magic 0x466243b1, whose third field points at the fat
//!   binary) is a 16-byte header (magic 0xBA55ED50, u16 version, u16 header size, u64 size of
//!   the entries) and entries, each a header (u16 kind: 1 PTX, 2 ELF; u32 header size; u64
//!   payload size; u64 flags at 0x28, 0x2000 meaning compressed; u64 uncompressed size at
//!   0x38) and its payload. A compressed payload is an LZ4 block (no frame), which is how the
//!   CUDA 12 libraries ship most of their cubins (measured on libcublasLt 12.8: 5246 of 6175 ELF
//!   entries compressed; decompressed, each is a cubin of exactly the size the header says).
//!   This layout is the one ZLUDA's fat binary reader describes (vosen/ZLUDA, the `zluda_dark_api`
//!   crate's fatbin module) and cuobjdump shows. The globals of its cubins are the module's
//!   globals ([`Image::Fat`]); its kernels are not enumerated (the entry the driver would pick
//!   depends on the GPU), so any kernel name resolves, as before.
//!
//! Any other image (the placeholder bytes the simulator's own tests load) is [`Image::Opaque`]:
//! the simulator cannot see inside it, so any kernel name resolves and there are no globals.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::{c_char, c_void, CStr};

/// What an image defines.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Symbols {
    pub kernels: BTreeSet<String>,
    /// Name → size in bytes.
    pub globals: BTreeMap<String, u64>,
}

#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Image {
    Known(Symbols),
    /// A fat binary: the globals its cubins define (name → size); any kernel name resolves.
    Fat(BTreeMap<String, u64>),
    Opaque,
}

impl Image {
    /// Whether `name` is a kernel of this image (any name is, in an opaque one).
    pub fn has_kernel(&self, name: &str) -> bool {
        match self {
            Image::Known(s) => s.kernels.contains(name),
            Image::Fat(_) | Image::Opaque => true,
        }
    }
    pub fn global(&self, name: &str) -> Option<u64> {
        match self {
            Image::Known(s) => s.globals.get(name).copied(),
            Image::Fat(g) => g.get(name).copied(),
            Image::Opaque => None,
        }
    }
    pub fn globals(&self) -> Vec<(String, u64)> {
        match self {
            Image::Known(s) => s.globals.iter().map(|(k, v)| (k.clone(), *v)).collect(),
            Image::Fat(g) => g.iter().map(|(k, v)| (k.clone(), *v)).collect(),
            Image::Opaque => Vec::new(),
        }
    }
}

/// No image is larger than this (a cubin of a big library is tens of MB).
const MAX_IMAGE: u64 = 1 << 30;

/// Reads the image at `p` as cuModuleLoadData gets it: a pointer and no length. An ELF's
/// length follows from its headers; PTX ends at its NUL.
pub(crate) fn from_ptr(p: *const c_void) -> Image {
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
        return match elf_len(p) {
            // SAFETY: the ELF's headers say it spans `len` bytes from `p`, and by the API
            // contract the whole image is readable there.
            Some(len) => from_elf(unsafe { std::slice::from_raw_parts(p as *const u8, len) }),
            None => Image::Opaque,
        };
    }
    if magic == FATBIN_WRAPPER_MAGIC.to_le_bytes() {
        // SAFETY: a __fatBinC_Wrapper_t { int magic, version; const u64 *data; void *filename }:
        // by the API contract its 24 bytes are readable; `data` is the fat binary.
        let data = unsafe { *((p as *const u8).add(8) as *const *const c_void) };
        return from_fatbin_ptr(data);
    }
    if magic == FATBIN_MAGIC.to_le_bytes() {
        return from_fatbin_ptr(p);
    }
    if magic.len() == 4 && magic.iter().all(|b| b.is_ascii()) {
        // SAFETY: ASCII text: by the API contract a PTX image is a NUL-terminated string.
        let text = unsafe { CStr::from_ptr(p as *const c_char) };
        return from_ptx(&text.to_string_lossy());
    }
    Image::Opaque
}

const FATBIN_WRAPPER_MAGIC: u32 = 0x4662_43b1;
const FATBIN_MAGIC: u32 = 0xBA55_ED50;
const FATBIN_COMPRESSED: u64 = 0x2000;

/// A fat binary in memory: its header says how long it is.
fn from_fatbin_ptr(p: *const c_void) -> Image {
    if p.is_null() {
        return Image::Opaque;
    }
    // SAFETY: the fat binary's 16-byte header is readable by the API contract, and then the
    // `size` bytes of entries it announces after its `header_size`.
    let head = unsafe { std::slice::from_raw_parts(p as *const u8, 16) };
    let (Some(magic), Some(hs), Some(size)) = (u32_at(head, 0), u16_at(head, 6), u64_at(head, 8))
    else {
        return Image::Opaque;
    };
    let total = hs as u64 + size;
    if magic != FATBIN_MAGIC || hs < 16 || total > MAX_IMAGE {
        return Image::Opaque;
    }
    // SAFETY: as above: header and entries, `total` bytes from `p`.
    from_fatbin(unsafe { std::slice::from_raw_parts(p as *const u8, total as usize) })
}

/// The globals of every cubin of a fat binary (see the module doc).
fn from_fatbin(b: &[u8]) -> Image {
    let mut globals = BTreeMap::new();
    let Some(hs) = u16_at(b, 6) else {
        return Image::Opaque;
    };
    let mut at = hs as usize;
    while at + 16 <= b.len() {
        let (Some(kind), Some(ehs), Some(psz)) =
            (u16_at(b, at), u32_at(b, at + 4), u64_at(b, at + 8))
        else {
            break;
        };
        let start = at + ehs as usize;
        let Some(end) = start
            .checked_add(psz as usize)
            .filter(|&e| e <= b.len() && ehs >= 16)
        else {
            break;
        };
        let payload = &b[start..end];
        if kind == 2 {
            let flags = u64_at(b, at + 0x28).filter(|_| ehs >= 0x30).unwrap_or(0);
            let cubin = if flags & FATBIN_COMPRESSED != 0 {
                u64_at(b, at + 0x38)
                    .filter(|&n| ehs >= 0x40 && n <= MAX_IMAGE)
                    .and_then(|n| lz4_block(payload, n as usize))
            } else {
                Some(payload.to_vec())
            };
            if let Some(s) = cubin.as_deref().and_then(elf_symbols) {
                globals.extend(s.globals);
            }
        }
        at = end;
    }
    Image::Fat(globals)
}

/// Decompresses one LZ4 block (the LZ4 block format: sequences of a token, literals, a 2-byte
/// little-endian match offset and a match length, lengths of 15 continued by 255-bytes), into
/// exactly `size` bytes. None if it is malformed.
fn lz4_block(src: &[u8], size: usize) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(size);
    let mut i = 0;
    let more = |i: &mut usize, mut n: usize| -> Option<usize> {
        loop {
            let b = *src.get(*i)?;
            *i += 1;
            n += b as usize;
            if b != 255 {
                return Some(n);
            }
        }
    };
    while i < src.len() {
        let token = src[i];
        i += 1;
        let mut lit = (token >> 4) as usize;
        if lit == 15 {
            lit = more(&mut i, lit)?;
        }
        out.extend_from_slice(src.get(i..i.checked_add(lit)?)?);
        i += lit;
        if i >= src.len() || out.len() >= size {
            break; // the last sequence has literals only
        }
        let offset = u16_at(src, i)? as usize;
        i += 2;
        let mut len = (token & 15) as usize;
        if len == 15 {
            len = more(&mut i, len)?;
        }
        len += 4;
        if offset == 0 || offset > out.len() || out.len() + len > size {
            return None;
        }
        let from = out.len() - offset;
        for k in 0..len {
            out.push(out[from + k]); // may overlap what it writes
        }
    }
    (out.len() == size).then_some(out)
}

/// Reads an image file (cuModuleLoad, cuLibraryLoadFromFile).
pub(crate) fn from_file(path: &str) -> Image {
    match std::fs::read(path) {
        Ok(b) if b.starts_with(b"\x7fELF") => from_elf(&b),
        Ok(b) if b.starts_with(&FATBIN_MAGIC.to_le_bytes()) => from_fatbin(&b),
        Ok(b) if b.is_ascii() => from_ptx(&String::from_utf8_lossy(&b)),
        _ => Image::Opaque,
    }
}

fn u16_at(b: &[u8], off: usize) -> Option<u16> {
    Some(u16::from_le_bytes(b.get(off..off + 2)?.try_into().ok()?))
}
fn u32_at(b: &[u8], off: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(off..off + 4)?.try_into().ok()?))
}
fn u64_at(b: &[u8], off: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(off..off + 8)?.try_into().ok()?))
}

/// The extent of an ELF64 (little-endian) image from its headers: the end of its last section,
/// section header table or program header table. None if it is not one the simulator reads.
fn elf_len(p: *const c_void) -> Option<usize> {
    // SAFETY: an ELF64 header is 64 bytes, and the magic said this is an ELF image.
    let head = unsafe { std::slice::from_raw_parts(p as *const u8, 64) };
    if head[4] != 2 || head[5] != 1 {
        return None; // not ELFCLASS64 / ELFDATA2LSB
    }
    let phoff = u64_at(head, 32)?;
    let shoff = u64_at(head, 40)?;
    let (phentsize, phnum) = (u16_at(head, 54)? as u64, u16_at(head, 56)? as u64);
    let (shentsize, shnum) = (u16_at(head, 58)? as u64, u16_at(head, 60)? as u64);
    if shentsize != 64 || shoff > MAX_IMAGE || phoff > MAX_IMAGE {
        return None;
    }
    let mut end = (shoff + shnum * 64).max(phoff + phnum * phentsize).max(64);
    // SAFETY: the section header table lies within the image (its header says where).
    let shdrs = unsafe {
        std::slice::from_raw_parts((p as *const u8).add(shoff as usize), shnum as usize * 64)
    };
    for s in shdrs.chunks_exact(64) {
        const SHT_NOBITS: u32 = 8;
        if u32_at(s, 4)? == SHT_NOBITS {
            continue;
        }
        let (off, size) = (u64_at(s, 24)?, u64_at(s, 32)?);
        end = end.max(off.checked_add(size)?);
    }
    (end <= MAX_IMAGE).then_some(end as usize)
}

/// Kernels and variables of a cubin (see the module doc).
fn from_elf(b: &[u8]) -> Image {
    elf_symbols(b).map_or(Image::Opaque, Image::Known)
}

fn elf_symbols(b: &[u8]) -> Option<Symbols> {
    if b.get(..4)? != b"\x7fELF" || b[4] != 2 || b[5] != 1 {
        return None;
    }
    let shoff = u64_at(b, 40)? as usize;
    let shnum = u16_at(b, 60)? as usize;
    let shstrndx = u16_at(b, 62)? as usize;
    let sh = |i: usize| b.get(shoff + i * 64..shoff + i * 64 + 64);
    let section_data = |s: &[u8]| -> Option<&[u8]> {
        let (off, size) = (u64_at(s, 24)? as usize, u64_at(s, 32)? as usize);
        b.get(off..off.checked_add(size)?)
    };
    let name_in = |strtab: &[u8], at: usize| -> Option<String> {
        let rest = strtab.get(at..)?;
        let end = rest.iter().position(|&c| c == 0)?;
        Some(String::from_utf8_lossy(&rest[..end]).into_owned())
    };
    let shstr = section_data(sh(shstrndx)?)?;
    let names: Vec<String> = (0..shnum)
        .map(|i| {
            sh(i)
                .and_then(|s| name_in(shstr, u32_at(s, 0)? as usize))
                .unwrap_or_default()
        })
        .collect();
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
    for i in 0..shnum {
        let s = sh(i)?;
        if u32_at(s, 4)? != SHT_SYMTAB {
            continue;
        }
        let syms = section_data(s)?;
        let strtab = section_data(sh(u32_at(s, 40)? as usize)?)?;
        for sym in syms.chunks_exact(24) {
            let (info, other, shndx) = (sym[4], sym[5], u16_at(sym, 6)? as usize);
            let size = u64_at(sym, 16)?;
            if info & 0xf == STT_FUNC && other & STO_CUDA_ENTRY != 0 && shndx != 0 {
                if let Some(name) = name_in(strtab, u32_at(sym, 0)? as usize) {
                    out.kernels.insert(name);
                }
                continue;
            }
            if info & 0xf != STT_OBJECT || shndx == 0 || size == 0 || !is_variable_section(shndx) {
                continue;
            }
            if let Some(name) = name_in(strtab, u32_at(sym, 0)? as usize) {
                out.globals.insert(name, size);
            }
        }
    }
    if out.kernels.is_empty() {
        // No entry marks in the symbols: each `.text.<name>` section is a kernel, as Gdev reads it.
        out.kernels = text_sections;
    }
    Some(out)
}

/// Kernels and module-scope `.global` / `.const` variables of PTX text (see the module doc).
fn from_ptx(text: &str) -> Image {
    if !text.contains(".version") || !text.contains(".target") {
        return Image::Opaque;
    }
    let mut out = Symbols::default();
    // Statements end in ';', and a kernel's header in '(' or '{'; comments go first.
    let text: String = text
        .lines()
        .map(|l| l.split("//").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n");
    let mut depth = 0usize;
    for stmt in text.split_inclusive([';', '{', '}']) {
        let at_module_scope = depth == 0;
        if stmt.ends_with('{') {
            depth += 1;
        } else if stmt.ends_with('}') {
            depth = depth.saturating_sub(1);
        }
        if !at_module_scope {
            continue;
        }
        let toks: Vec<&str> = stmt
            .split(|c: char| c.is_whitespace() || c == '(' || c == ';' || c == '{')
            .filter(|t| !t.is_empty())
            .collect();
        if let Some(i) = toks.iter().position(|t| *t == ".entry") {
            if let Some(name) = toks.get(i + 1) {
                out.kernels.insert(name.to_string());
            }
            continue;
        }
        if toks.contains(&".extern") {
            continue;
        }
        let Some(i) = toks.iter().position(|t| *t == ".global" || *t == ".const") else {
            continue;
        };
        if let Some((name, size)) = ptx_variable(&toks[i + 1..]) {
            out.globals.insert(name, size);
        }
    }
    Image::Known(out)
}

/// `[.align n] [.vN] .type name[d0]...[= ...]`: the name and its size in bytes.
fn ptx_variable(toks: &[&str]) -> Option<(String, u64)> {
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
            ".v2" => vector = 2,
            ".v4" => vector = 4,
            ".v8" => vector = 8,
            ".pred" => elem = Some(1),
            ".f16x2" | ".bf16x2" => elem = Some(4),
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
    for d in dims_src.split('[').skip(1) {
        let n = d.split(']').next()?.trim().parse::<u64>().ok()?;
        count = count.checked_mul(n)?;
    }
    Some((name.to_string(), elem? * vector * count))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ptx_entries_and_variables() {
        let ptx = r#"
//
// Generated by NVIDIA NVVM Compiler
.version 8.8
.target sm_90
.address_size 64

	// .globl	sim_busy
.global .align 4 .b8 g[256];
.global .align 4 .u32 gi = 5;
.const .align 4 .b8 c[16];
.extern .global .align 4 .u32 elsewhere;
.visible .global .align 8 .v2 .f32 pair[3][2];
.visible .entry sim_busy(
	.param .u64 sim_busy_param_0
)
{
	.reg .b64 	%rd<2>;
	ld.global.f32 	%f1, [g];
	ret;
}
.weak .entry _Z2tkIfEvPT_(
	.param .u64 p
)
{
	ret;
}
"#;
        let Image::Known(s) = from_ptx(ptx) else {
            panic!("not read")
        };
        assert_eq!(
            s.kernels.iter().collect::<Vec<_>>(),
            ["_Z2tkIfEvPT_", "sim_busy"]
        );
        assert_eq!(s.globals.get("g"), Some(&256));
        assert_eq!(s.globals.get("gi"), Some(&4));
        assert_eq!(s.globals.get("c"), Some(&16));
        assert_eq!(s.globals.get("pair"), Some(&48));
        assert_eq!(s.globals.get("elsewhere"), None);
        assert_eq!(s.globals.len(), 4);
    }

    #[test]
    fn lz4_blocks_decompress_literals_and_overlapping_matches() {
        // 'a', then a match of 9 at offset 1 (overlapping), then the last sequence: 'b'.
        let block = [0x15, b'a', 0x01, 0x00, 0x10, b'b'];
        assert_eq!(lz4_block(&block, 11).as_deref(), Some(&b"aaaaaaaaaab"[..]));
        assert_eq!(lz4_block(&block, 12), None, "not the size the header says");
        assert_eq!(
            lz4_block(&[0x15, b'a', 0x02, 0x00], 10),
            None,
            "an offset before the start"
        );
    }

    /// A fat binary's header and entries: an ELF entry whose cubin does not parse, a PTX entry
    /// and a compressed entry are walked without globals, and a bad magic is opaque.
    #[test]
    fn fat_binaries_are_walked_entry_by_entry() {
        let entry = |kind: u16, flags: u64, payload: &[u8], unpacked: u64| {
            let mut e = vec![0u8; 0x40];
            e[0..2].copy_from_slice(&kind.to_le_bytes());
            e[4..8].copy_from_slice(&0x40u32.to_le_bytes());
            e[8..16].copy_from_slice(&(payload.len() as u64).to_le_bytes());
            e[0x28..0x30].copy_from_slice(&flags.to_le_bytes());
            e[0x38..0x40].copy_from_slice(&unpacked.to_le_bytes());
            e.extend_from_slice(payload);
            e
        };
        let mut body = entry(2, 0, b"\x7fELF-not-really", 0);
        body.extend(entry(1, 0, b".version 8.0\0", 0));
        body.extend(entry(2, FATBIN_COMPRESSED, &[0x10, b'x'], 1));
        let mut fat = FATBIN_MAGIC.to_le_bytes().to_vec();
        fat.extend_from_slice(&1u16.to_le_bytes());
        fat.extend_from_slice(&16u16.to_le_bytes());
        fat.extend_from_slice(&(body.len() as u64).to_le_bytes());
        fat.extend(body);
        assert_eq!(from_fatbin(&fat), Image::Fat(BTreeMap::new()));
        assert_eq!(
            from_fatbin_ptr(fat.as_ptr() as *const c_void),
            Image::Fat(BTreeMap::new())
        );
        assert!(Image::Fat(BTreeMap::new()).has_kernel("any"));
        fat[0] ^= 1;
        assert_eq!(
            from_fatbin_ptr(fat.as_ptr() as *const c_void),
            Image::Opaque
        );
    }

    #[test]
    fn text_that_is_not_ptx_is_opaque() {
        assert_eq!(from_ptx("image"), Image::Opaque);
    }
}
