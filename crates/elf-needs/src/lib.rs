//! What an ELF file asks of the dynamic loader, and what a library offers it, read from the
//! file's bytes: the libraries it needs (`DT_NEEDED`), the symbol versions it needs of each
//! (`DT_VERNEED`: `libc.so.6` `GLIBC_2.34`, ...), its own name (`DT_SONAME`) and the versions it
//! defines (`DT_VERDEF`: a glibc's `libc.so.6` defines `GLIBC_2.2.5` ... `GLIBC_2.36`).
//!
//! Why: libcuvisor.so is preloaded into programs of tenant images that bring their own glibc;
//! ld.so refuses (or, through `/etc/ld.so.preload`, skips) a library that needs a symbol version
//! its libc does not define ("version `GLIBC_2.34' not found"). Reading the needs up front lets
//! cuvisor refuse such a library with one clear line, and lets a test hold the shipped library
//! to the glibc 2.17 floor (docs/glibc.md).
//!
//! Read as the loader reads it: through the program headers (`PT_DYNAMIC`, and `PT_LOAD` to turn
//! the dynamic entries' addresses into file offsets), not the section headers, which a loader
//! never looks at and a stripped file may lack. Layouts: the System V gABI, "Dynamic Section",
//! and the LSB's "Symbol Versioning" (`Elfxx_Verneed`/`Vernaux`, `Elfxx_Verdef`/`Verdaux`, the
//! same 16/16/20/8 bytes in both classes). 32- and 64-bit, either byte order.
//!
//! The bytes are untrusted (`--library FILE`, a plugin's configured path): every offset and
//! length is checked, arithmetic is checked, and the version chains are bounded by the file's
//! size, so a truncated, corrupt or hostile file is an [`Error`], never a panic or a loop.
#![forbid(unsafe_code)]

use std::fmt;

/// What the dynamic section says.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Dynamic {
    /// `DT_SONAME`, if any.
    pub soname: Option<String>,
    /// `DT_NEEDED`, in order.
    pub needed: Vec<String>,
    /// `DT_VERNEED`: each (file, version) the file needs, in order.
    pub version_needs: Vec<VersionNeed>,
    /// `DT_VERDEF`: the versions the file defines, its own base name (`VER_FLG_BASE`) left out.
    pub version_defs: Vec<String>,
}

/// One needed version: `version` of the library `file` (as DT_NEEDED names it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VersionNeed {
    pub file: String,
    pub version: String,
}

/// A glibc symbol version, `GLIBC_2.3.4` = 2.3.4; ordered as numbers (2.17 > 2.3.4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct GlibcVersion {
    pub major: u32,
    pub minor: u32,
    pub patch: u32,
}

impl GlibcVersion {
    pub const fn new(major: u32, minor: u32) -> GlibcVersion {
        GlibcVersion {
            major,
            minor,
            patch: 0,
        }
    }

    /// `2.17`, `2.3.4`: what `gnu_get_libc_version()` answers and people write.
    pub fn parse(s: &str) -> Option<GlibcVersion> {
        let mut parts = s.split('.');
        let num = |p: Option<&str>| -> Option<u32> {
            let p = p?;
            if p.is_empty() || p.len() > 9 || !p.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            p.parse().ok()
        };
        let major = num(parts.next())?;
        let minor = num(parts.next())?;
        let patch = match parts.next() {
            None => 0,
            p => num(p)?,
        };
        if parts.next().is_some() {
            return None;
        }
        Some(GlibcVersion {
            major,
            minor,
            patch,
        })
    }

    /// A symbol version name, `GLIBC_2.34`; None for anything else (`GLIBC_PRIVATE`,
    /// `GCC_3.0`, `GLIBCXX_3.4`).
    pub fn from_symbol_version(name: &str) -> Option<GlibcVersion> {
        GlibcVersion::parse(name.strip_prefix("GLIBC_")?)
    }
}

impl fmt::Display for GlibcVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)?;
        if self.patch != 0 {
            write!(f, ".{}", self.patch)?;
        }
        Ok(())
    }
}

impl Dynamic {
    /// The newest `GLIBC_x.y` version the file needs, and the need that asks for it (the first
    /// such, in file order); None when it needs no glibc version.
    pub fn newest_glibc_needed(&self) -> Option<(GlibcVersion, &VersionNeed)> {
        let mut best: Option<(GlibcVersion, &VersionNeed)> = None;
        for n in &self.version_needs {
            if let Some(v) = GlibcVersion::from_symbol_version(&n.version) {
                if best.is_none_or(|(b, _)| v > b) {
                    best = Some((v, n));
                }
            }
        }
        best
    }

    /// The needs newer than `floor`, in file order.
    pub fn glibc_needs_newer_than(&self, floor: GlibcVersion) -> Vec<&VersionNeed> {
        self.version_needs
            .iter()
            .filter(|n| GlibcVersion::from_symbol_version(&n.version).is_some_and(|v| v > floor))
            .collect()
    }

    /// The newest `GLIBC_x.y` version the file defines (for a glibc's libc.so.6: its release,
    /// or the last release that added a symbol).
    pub fn newest_glibc_defined(&self) -> Option<GlibcVersion> {
        self.version_defs
            .iter()
            .filter_map(|d| GlibcVersion::from_symbol_version(d))
            .max()
    }
}

/// Why the bytes could not be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Error {
    /// No `\x7fELF` magic.
    NotElf,
    /// A structure runs past the end of the file (what was being read).
    Truncated(&'static str),
    /// Something no linker writes (what, in words).
    Malformed(String),
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::NotElf => write!(f, "not an ELF file"),
            Error::Truncated(what) => write!(f, "truncated ELF file: its {what} runs past the end"),
            Error::Malformed(what) => write!(f, "malformed ELF file: {what}"),
        }
    }
}

impl std::error::Error for Error {}

const PT_LOAD: u32 = 1;
const PT_DYNAMIC: u32 = 2;
const DT_NULL: u64 = 0;
const DT_NEEDED: u64 = 1;
const DT_STRTAB: u64 = 5;
const DT_STRSZ: u64 = 10;
const DT_SONAME: u64 = 14;
const DT_VERDEF: u64 = 0x6fff_fffc;
const DT_VERDEFNUM: u64 = 0x6fff_fffd;
const DT_VERNEED: u64 = 0x6fff_fffe;
const DT_VERNEEDNUM: u64 = 0x6fff_ffff;
const VER_FLG_BASE: u16 = 1;

/// The file's bytes with its class and byte order; every read is bounds-checked.
struct Reader<'a> {
    b: &'a [u8],
    wide: bool,
    little: bool,
}

impl<'a> Reader<'a> {
    fn bytes<const N: usize>(&self, at: u64, what: &'static str) -> Result<[u8; N], Error> {
        let start = usize::try_from(at).map_err(|_| Error::Truncated(what))?;
        let end = start.checked_add(N).ok_or(Error::Truncated(what))?;
        let s = self.b.get(start..end).ok_or(Error::Truncated(what))?;
        let mut out = [0u8; N];
        out.copy_from_slice(s);
        Ok(out)
    }
    fn u16(&self, at: u64, what: &'static str) -> Result<u16, Error> {
        let b = self.bytes::<2>(at, what)?;
        Ok(if self.little {
            u16::from_le_bytes(b)
        } else {
            u16::from_be_bytes(b)
        })
    }
    fn u32(&self, at: u64, what: &'static str) -> Result<u32, Error> {
        let b = self.bytes::<4>(at, what)?;
        Ok(if self.little {
            u32::from_le_bytes(b)
        } else {
            u32::from_be_bytes(b)
        })
    }
    fn u64(&self, at: u64, what: &'static str) -> Result<u64, Error> {
        let b = self.bytes::<8>(at, what)?;
        Ok(if self.little {
            u64::from_le_bytes(b)
        } else {
            u64::from_be_bytes(b)
        })
    }
    /// An address-sized word (Elf32_Addr/Off/Word or Elf64_Addr/Off/Xword).
    fn word(&self, at: u64, what: &'static str) -> Result<u64, Error> {
        if self.wide {
            self.u64(at, what)
        } else {
            self.u32(at, what).map(u64::from)
        }
    }
}

fn add(a: u64, b: u64, what: &str) -> Result<u64, Error> {
    a.checked_add(b)
        .ok_or_else(|| Error::Malformed(format!("{what} overflows")))
}

struct Segment {
    offset: u64,
    vaddr: u64,
    filesz: u64,
}

/// Reads the dynamic section of an ELF file. A file with no `PT_DYNAMIC` (a static executable)
/// needs nothing: an empty [`Dynamic`].
pub fn parse(bytes: &[u8]) -> Result<Dynamic, Error> {
    if bytes.len() < 4 || bytes[..4] != *b"\x7fELF" {
        return Err(Error::NotElf);
    }
    let ident = |i: usize| bytes.get(i).copied().ok_or(Error::Truncated("ELF header"));
    let wide = match ident(4)? {
        1 => false,
        2 => true,
        c => return Err(Error::Malformed(format!("ELF class {c}"))),
    };
    let little = match ident(5)? {
        1 => true,
        2 => false,
        d => return Err(Error::Malformed(format!("ELF byte order {d}"))),
    };
    let r = Reader {
        b: bytes,
        wide,
        little,
    };
    let (phoff, phentsize, phnum) = if wide {
        (
            r.u64(32, "ELF header")?,
            r.u16(54, "ELF header")?,
            r.u16(56, "ELF header")?,
        )
    } else {
        (
            u64::from(r.u32(28, "ELF header")?),
            r.u16(42, "ELF header")?,
            r.u16(44, "ELF header")?,
        )
    };
    let min_phent = if wide { 56 } else { 32 };
    if phnum == 0xffff {
        // PN_XNUM: the count is in section 0; no shared object has that many segments.
        return Err(Error::Malformed("more than 65534 program headers".into()));
    }
    if phnum > 0 && u64::from(phentsize) < min_phent {
        return Err(Error::Malformed(format!(
            "program header entries of {phentsize} bytes"
        )));
    }

    let mut loads = Vec::new();
    let mut dynamic: Option<(u64, u64)> = None;
    for i in 0..u64::from(phnum) {
        // Saturated: an offset past the end is a truncated table, read as such below.
        let at = phoff.saturating_add(i * u64::from(phentsize));
        let what = "program header table";
        let p_type = r.u32(at, what)?;
        let (offset, vaddr, filesz) = if wide {
            (
                r.u64(at.saturating_add(8), what)?,
                r.u64(at.saturating_add(16), what)?,
                r.u64(at.saturating_add(32), what)?,
            )
        } else {
            (
                u64::from(r.u32(at.saturating_add(4), what)?),
                u64::from(r.u32(at.saturating_add(8), what)?),
                u64::from(r.u32(at.saturating_add(16), what)?),
            )
        };
        match p_type {
            PT_LOAD => loads.push(Segment {
                offset,
                vaddr,
                filesz,
            }),
            PT_DYNAMIC if dynamic.is_none() => dynamic = Some((offset, filesz)),
            _ => {}
        }
    }
    let Some((dyn_off, dyn_size)) = dynamic else {
        return Ok(Dynamic::default());
    };

    // The dynamic array, to DT_NULL or the segment's end.
    let entry = if wide { 16 } else { 8 };
    let mut tags: Vec<(u64, u64)> = Vec::new();
    let mut at = dyn_off;
    let end = add(dyn_off, dyn_size, "the dynamic segment")?;
    while at.checked_add(entry).is_some_and(|e| e <= end) {
        // d_tag is signed, but every tag read here is below 2^31: compared as read.
        let tag = r.word(at, "dynamic section")?;
        let val = r.word(at.saturating_add(entry / 2), "dynamic section")?;
        if tag == DT_NULL {
            break;
        }
        tags.push((tag, val));
        at += entry;
    }
    let one = |t: u64| tags.iter().find(|(tag, _)| *tag == t).map(|(_, v)| *v);

    // Addresses in the dynamic section are virtual; the PT_LOAD that maps one says where in
    // the file it is.
    let to_offset = |addr: u64, what: &'static str| -> Result<u64, Error> {
        for s in &loads {
            if addr >= s.vaddr && addr - s.vaddr < s.filesz {
                return add(s.offset, addr - s.vaddr, what);
            }
        }
        Err(Error::Malformed(format!(
            "the {what} (address {addr:#x}) is in no loaded segment"
        )))
    };

    let names_anything = tags.iter().any(|(t, _)| {
        matches!(
            *t,
            DT_NEEDED | DT_SONAME | DT_VERNEED | DT_VERDEF | DT_VERNEEDNUM | DT_VERDEFNUM
        )
    });
    if !names_anything {
        return Ok(Dynamic::default());
    }
    let strtab = to_offset(
        one(DT_STRTAB).ok_or_else(|| Error::Malformed("names without a DT_STRTAB".into()))?,
        "string table",
    )?;
    let strsz = one(DT_STRSZ).ok_or_else(|| Error::Malformed("no DT_STRSZ".into()))?;
    let strings = Strings::new(bytes, strtab, strsz)?;

    let mut out = Dynamic::default();
    for &(tag, val) in &tags {
        match tag {
            DT_NEEDED => out.needed.push(strings.get(val, "DT_NEEDED")?),
            DT_SONAME if out.soname.is_none() => out.soname = Some(strings.get(val, "DT_SONAME")?),
            _ => {}
        }
    }

    // Each version entry takes at least 8 bytes of the file: more entries than that is a
    // chain that loops, which a hostile file can make; the budget ends it.
    let mut budget = bytes.len() / 8 + 1;
    let mut spend = |what: &str| -> Result<(), Error> {
        budget = budget
            .checked_sub(1)
            .ok_or_else(|| Error::Malformed(format!("a {what} chain longer than the file")))?;
        Ok(())
    };

    if let Some(addr) = one(DT_VERNEED) {
        let count = one(DT_VERNEEDNUM)
            .ok_or_else(|| Error::Malformed("DT_VERNEED without DT_VERNEEDNUM".into()))?;
        let mut at = to_offset(addr, "version needs (DT_VERNEED)")?;
        let what = "version needs (DT_VERNEED)";
        for i in 0..count {
            spend("DT_VERNEED")?;
            let vn_cnt = r.u16(add(at, 2, what)?, what)?;
            let vn_file = r.u32(add(at, 4, what)?, what)?;
            let vn_aux = r.u32(add(at, 8, what)?, what)?;
            let vn_next = r.u32(add(at, 12, what)?, what)?;
            let file = strings.get(u64::from(vn_file), "a version need's file")?;
            let mut aux = add(at, u64::from(vn_aux), what)?;
            for j in 0..vn_cnt {
                spend("DT_VERNEED")?;
                let vna_name = r.u32(add(aux, 8, what)?, what)?;
                let vna_next = r.u32(add(aux, 12, what)?, what)?;
                out.version_needs.push(VersionNeed {
                    file: file.clone(),
                    version: strings.get(u64::from(vna_name), "a needed version's name")?,
                });
                if vna_next == 0 {
                    if j + 1 < vn_cnt {
                        return Err(Error::Malformed(format!(
                            "the needs of {file} end after {} of {vn_cnt} versions",
                            j + 1
                        )));
                    }
                    break;
                }
                aux = add(aux, u64::from(vna_next), what)?;
            }
            if vn_next == 0 {
                if i + 1 < count {
                    return Err(Error::Malformed(format!(
                        "DT_VERNEED ends after {} of {count} files",
                        i + 1
                    )));
                }
                break;
            }
            at = add(at, u64::from(vn_next), what)?;
        }
    }

    if let Some(addr) = one(DT_VERDEF) {
        let count = one(DT_VERDEFNUM)
            .ok_or_else(|| Error::Malformed("DT_VERDEF without DT_VERDEFNUM".into()))?;
        let mut at = to_offset(addr, "version definitions (DT_VERDEF)")?;
        let what = "version definitions (DT_VERDEF)";
        for i in 0..count {
            spend("DT_VERDEF")?;
            let vd_flags = r.u16(add(at, 2, what)?, what)?;
            let vd_cnt = r.u16(add(at, 6, what)?, what)?;
            let vd_aux = r.u32(add(at, 12, what)?, what)?;
            let vd_next = r.u32(add(at, 16, what)?, what)?;
            // The first Verdaux names the version; the others name its parents.
            if vd_cnt > 0 {
                let aux = add(at, u64::from(vd_aux), what)?;
                let name = strings.get(u64::from(r.u32(aux, what)?), "a defined version's name")?;
                if vd_flags & VER_FLG_BASE == 0 {
                    out.version_defs.push(name);
                }
            }
            if vd_next == 0 {
                if i + 1 < count {
                    return Err(Error::Malformed(format!(
                        "DT_VERDEF ends after {} of {count} versions",
                        i + 1
                    )));
                }
                break;
            }
            at = add(at, u64::from(vd_next), what)?;
        }
    }
    Ok(out)
}

/// The dynamic string table: NUL-terminated names at offsets below its size.
///
/// Entries may point at one name many times (a hostile file's chains overlap), so what is
/// copied out is bounded: a name of at most [`MAX_NAME`] bytes (library and version names are
/// short), and in all at most four times the file plus 1 MiB.
struct Strings<'a> {
    table: &'a [u8],
    copied: std::cell::Cell<usize>,
    budget: usize,
}

/// The longest name read (PATH_MAX).
const MAX_NAME: usize = 4096;

impl<'a> Strings<'a> {
    fn new(bytes: &'a [u8], offset: u64, size: u64) -> Result<Strings<'a>, Error> {
        let what = "string table (DT_STRTAB)";
        let start = usize::try_from(offset).map_err(|_| Error::Truncated(what))?;
        let len = usize::try_from(size).map_err(|_| Error::Truncated(what))?;
        let end = start.checked_add(len).ok_or(Error::Truncated(what))?;
        let table = bytes.get(start..end).ok_or(Error::Truncated(what))?;
        Ok(Strings {
            table,
            copied: std::cell::Cell::new(0),
            budget: bytes.len().saturating_mul(4).saturating_add(1 << 20),
        })
    }

    fn get(&self, index: u64, what: &str) -> Result<String, Error> {
        let rest = usize::try_from(index)
            .ok()
            .and_then(|i| self.table.get(i..))
            .ok_or_else(|| {
                Error::Malformed(format!("{what} is outside the string table ({index:#x})"))
            })?;
        let len = rest.iter().position(|&c| c == 0).ok_or_else(|| {
            Error::Malformed(format!("{what} runs past the end of the string table"))
        })?;
        if len > MAX_NAME {
            return Err(Error::Malformed(format!(
                "{what} is {len} bytes long (at most {MAX_NAME})"
            )));
        }
        let copied = self.copied.get() + len;
        if copied > self.budget {
            return Err(Error::Malformed(
                "its names, read through its version chains, add up to more than the file could \
                 hold"
                    .into(),
            ));
        }
        self.copied.set(copied);
        Ok(String::from_utf8_lossy(&rest[..len]).into_owned())
    }
}

#[cfg(test)]
mod tests;
