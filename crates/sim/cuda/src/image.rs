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
//! Any other image (a fat binary, or the placeholder bytes the simulator's own tests load) is
//! [`Image::Opaque`]: the simulator cannot see inside it, so any kernel name resolves and there
//! are no globals, as before.

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
    Opaque,
}

impl Image {
    /// Whether `name` is a kernel of this image (any name is, in an opaque one).
    pub fn has_kernel(&self, name: &str) -> bool {
        match self {
            Image::Known(s) => s.kernels.contains(name),
            Image::Opaque => true,
        }
    }
    pub fn global(&self, name: &str) -> Option<u64> {
        match self {
            Image::Known(s) => s.globals.get(name).copied(),
            Image::Opaque => None,
        }
    }
    pub fn globals(&self) -> Vec<(String, u64)> {
        match self {
            Image::Known(s) => s.globals.iter().map(|(k, v)| (k.clone(), *v)).collect(),
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
    if magic.len() == 4 && magic.iter().all(|b| b.is_ascii()) {
        // SAFETY: ASCII text: by the API contract a PTX image is a NUL-terminated string.
        let text = unsafe { CStr::from_ptr(p as *const c_char) };
        return from_ptx(&text.to_string_lossy());
    }
    Image::Opaque
}

/// Reads an image file (cuModuleLoad, cuLibraryLoadFromFile).
pub(crate) fn from_file(path: &str) -> Image {
    match std::fs::read(path) {
        Ok(b) if b.starts_with(b"\x7fELF") => from_elf(&b),
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
    fn text_that_is_not_ptx_is_opaque() {
        assert_eq!(from_ptx("image"), Image::Opaque);
    }
}
