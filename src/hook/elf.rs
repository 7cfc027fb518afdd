//! Just enough ELF to tell, without asking the dynamic loader's symbol lookup (which cuvisor
//! interposes), what an object is and what it needs:
//!
//! - in memory, for objects already loaded: the loader's list of link maps, an object's
//!   `DT_SONAME`, and a symbol of its dynamic symbol table (how the real `dlsym`, `dlvsym`,
//!   `dlopen` and `dlmopen` are found: through libc's own table, never through a lookup
//!   function that could be our own export);
//! - in files, for objects about to be loaded: `DT_NEEDED`, `DT_SONAME`, `DT_RUNPATH`/`DT_RPATH`,
//!   and where the loader would find a needed name (the directories of ld.so(8), and
//!   /etc/ld.so.cache), so that `dlopen` can see whether a CUDA driver is among what an object
//!   brings in before anything of it runs.
//!
//! 64-bit little-endian ELF only (x86_64 and aarch64, the architectures cuvisor builds for).

use std::ffi::{c_char, c_int, c_void, CStr};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

const DT_NULL: i64 = 0;
const DT_NEEDED: i64 = 1;
const DT_HASH: i64 = 4;
const DT_STRTAB: i64 = 5;
const DT_SYMTAB: i64 = 6;
const DT_SONAME: i64 = 14;
const DT_RPATH: i64 = 15;
const DT_RUNPATH: i64 = 29;
const DT_GNU_HASH: i64 = 0x6fff_fef5;
/// Bounds on what is read: entries of a dynamic section, objects in a closure.
const MAX_DYN: usize = 4096;
const MAX_OBJECTS: usize = 512;

/// glibc's `struct link_map` (the public prefix of it, from <link.h>). A dlopen handle is one.
#[repr(C)]
pub struct LinkMap {
    pub l_addr: usize,
    pub l_name: *const c_char,
    pub l_ld: *const Dyn,
    pub l_next: *mut LinkMap,
    pub l_prev: *mut LinkMap,
}

#[repr(C)]
pub struct Dyn {
    tag: i64,
    val: u64,
}

#[repr(C)]
struct Sym {
    name: u32,
    info: u8,
    other: u8,
    shndx: u16,
    value: u64,
    size: u64,
}

extern "C" {
    fn dladdr1(
        addr: *const c_void,
        info: *mut libc::Dl_info,
        extra: *mut *mut c_void,
        flags: c_int,
    ) -> c_int;
}
const RTLD_DL_LINKMAP: c_int = 2;

/// The link map of the object containing `addr` (null if none).
pub fn object_of(addr: *const c_void) -> *mut LinkMap {
    let mut info = libc::Dl_info {
        dli_fname: std::ptr::null(),
        dli_fbase: std::ptr::null_mut(),
        dli_sname: std::ptr::null(),
        dli_saddr: std::ptr::null_mut(),
    };
    let mut map: *mut c_void = std::ptr::null_mut();
    // SAFETY: dladdr1 only reads `addr` as an address and fills our two out-parameters.
    if unsafe { dladdr1(addr, &mut info, &mut map, RTLD_DL_LINKMAP) } == 0 {
        return std::ptr::null_mut();
    }
    map as *mut LinkMap
}

/// The objects of the main namespace, in load order (from libcuvisor's own link map, which is
/// in that list: back to its head, then forward).
pub fn maps() -> impl Iterator<Item = *mut LinkMap> {
    let mut head = object_of(maps as *const c_void);
    // SAFETY: entries of the loader's list of loaded objects, whose l_prev/l_next links stay
    // valid while we read them (an object unloaded meanwhile is the program's race).
    unsafe {
        while !head.is_null() && !(*head).l_prev.is_null() {
            head = (*head).l_prev;
        }
    }
    std::iter::successors((!head.is_null()).then_some(head), |&m| {
        // SAFETY: as above.
        let n = unsafe { (*m).l_next };
        (!n.is_null()).then_some(n)
    })
}

/// Whether `handle` is one of the loaded objects of the main namespace (checked before any
/// handle a program passes is read as a link map).
pub fn is_loaded_object(handle: *mut c_void) -> bool {
    !handle.is_null() && maps().any(|m| m as *mut c_void == handle)
}

/// A loaded object's dynamic section, read in place.
struct Loaded {
    base: usize,
    dynamic: *const Dyn,
}

impl Loaded {
    /// # Safety
    /// `map` is a live entry of the loader's list.
    unsafe fn of(map: *const LinkMap) -> Option<Loaded> {
        // SAFETY: by the caller's contract.
        let (base, dynamic) = unsafe { ((*map).l_addr, (*map).l_ld) };
        (!dynamic.is_null()).then_some(Loaded { base, dynamic })
    }
    fn entries(&self) -> impl Iterator<Item = (i64, u64)> + '_ {
        (0..MAX_DYN)
            // SAFETY: the loader's dynamic section, terminated by DT_NULL, which ends the walk.
            .map(|i| unsafe { self.dynamic.add(i).read() })
            .take_while(|d| d.tag != DT_NULL)
            .map(|d| (d.tag, d.val))
    }
    fn entry(&self, tag: i64) -> Option<u64> {
        self.entries().find(|&(t, _)| t == tag).map(|(_, v)| v)
    }
    /// An address entry: glibc relocates most objects' dynamic sections in place, not those it
    /// maps read-only (the vDSO): an address below the base is still an offset.
    fn addr(&self, tag: i64) -> Option<usize> {
        let v = self.entry(tag)? as usize;
        Some(if v < self.base { self.base + v } else { v })
    }
    fn string(&self, offset: u64) -> Option<&CStr> {
        let strtab = self.addr(DT_STRTAB)?;
        // SAFETY: an offset into the object's dynamic string table, NUL-terminated strings.
        Some(unsafe { CStr::from_ptr((strtab + offset as usize) as *const c_char) })
    }
    fn soname(&self) -> Option<&CStr> {
        self.string(self.entry(DT_SONAME)?)
    }
    /// The number of dynamic symbols (DT_HASH's chain count, or the end of DT_GNU_HASH's last
    /// chain).
    fn symbol_count(&self) -> Option<usize> {
        if let Some(h) = self.addr(DT_HASH) {
            // SAFETY: DT_HASH: nbucket, nchain (u32 each), ...
            return Some(unsafe { (h as *const u32).add(1).read() } as usize);
        }
        let h = self.addr(DT_GNU_HASH)? as *const u32;
        // SAFETY: DT_GNU_HASH: nbuckets, symoffset, bloom_size, bloom_shift, bloom (u64 words),
        // buckets (u32), chains (u32, the last of each chain with bit 0 set).
        unsafe {
            let (nbuckets, symoffset, bloom) = (h.read(), h.add(1).read(), h.add(2).read());
            let buckets = h.add(4 + 2 * bloom as usize);
            let chains = buckets.add(nbuckets as usize);
            let last = (0..nbuckets as usize)
                .map(|i| buckets.add(i).read())
                .max()
                .unwrap_or(0);
            if last < symoffset {
                return Some(symoffset as usize);
            }
            let mut i = last;
            while chains.add((i - symoffset) as usize).read() & 1 == 0 {
                i += 1;
            }
            Some(i as usize + 1)
        }
    }
    /// The address of defined function `name` (any version).
    fn symbol(&self, name: &CStr) -> Option<usize> {
        let symtab = self.addr(DT_SYMTAB)? as *const Sym;
        (0..self.symbol_count()?).find_map(|i| {
            // SAFETY: an entry of the object's dynamic symbol table, of `symbol_count` entries.
            let s = unsafe { symtab.add(i).read() };
            (s.shndx != 0 && s.info & 0xf == 2 && self.string(s.name as u64)? == name)
                .then_some(self.base + s.value as usize)
        })
    }
}

/// The DT_SONAME of loaded object `map`.
///
/// # Safety
/// `map` is a live entry of the loader's list (see [`is_loaded_object`]).
pub unsafe fn soname_of(map: *const LinkMap) -> Option<&'static CStr> {
    // SAFETY: by the caller's contract.
    let l = unsafe { Loaded::of(map) }?;
    l.soname().map(|s| {
        // SAFETY: the string is in the object's mapped string table, which lives as long as
        // the object stays loaded (the program unloading a driver it uses is its own race).
        unsafe { &*(s as *const CStr) }
    })
}

/// The address of function `name` as defined by the loaded object whose DT_SONAME is `soname`.
pub fn function_in(soname: &CStr, name: &CStr) -> Option<usize> {
    maps().find_map(|m| {
        // SAFETY: `m` comes from the loader's list.
        let l = unsafe { Loaded::of(m) }?;
        (l.soname()? == soname).then(|| l.symbol(name)).flatten()
    })
}

// ---- files -------------------------------------------------------------------------------------

/// What an ELF file's dynamic section says about loading it.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Needs {
    pub soname: Option<String>,
    pub needed: Vec<String>,
    /// DT_RUNPATH, or DT_RPATH when there is no DT_RUNPATH (as the loader uses them).
    pub paths: Vec<String>,
}

fn u16_at(b: &[u8], o: usize) -> Option<u16> {
    Some(u16::from_le_bytes(b.get(o..o + 2)?.try_into().ok()?))
}
fn u32_at(b: &[u8], o: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(o..o + 4)?.try_into().ok()?))
}
fn u64_at(b: &[u8], o: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(o..o + 8)?.try_into().ok()?))
}

fn read_at(f: &std::fs::File, offset: u64, len: usize) -> Option<Vec<u8>> {
    let mut b = vec![0; len];
    let n = f.read_at(&mut b, offset).ok()?;
    b.truncate(n);
    Some(b)
}

/// Reads the dynamic section of the ELF file at `path`. None if it is not a 64-bit
/// little-endian ELF object with one.
pub fn needs_of(path: &Path) -> Option<Needs> {
    let f = std::fs::File::open(path).ok()?;
    if !f.metadata().ok()?.is_file() {
        return None;
    }
    let h = read_at(&f, 0, 64)?;
    if h.get(0..6)? != b"\x7fELF\x02\x01" {
        return None;
    }
    let (phoff, phentsize, phnum) = (u64_at(&h, 0x20)?, u16_at(&h, 0x36)?, u16_at(&h, 0x38)?);
    let ph = read_at(&f, phoff, phentsize as usize * phnum as usize)?;
    let (mut loads, mut dynamic) = (Vec::new(), None);
    for i in 0..phnum as usize {
        let p = i * phentsize as usize;
        let (kind, offset, vaddr, filesz) = (
            u32_at(&ph, p)?,
            u64_at(&ph, p + 8)?,
            u64_at(&ph, p + 16)?,
            u64_at(&ph, p + 32)?,
        );
        match kind {
            1 => loads.push((vaddr, offset, filesz)),
            2 => dynamic = Some((offset, filesz.min(16 * MAX_DYN as u64))),
            _ => {}
        }
    }
    let (offset, size) = dynamic?;
    let d = read_at(&f, offset, size as usize)?;
    let entries: Vec<(i64, u64)> = d
        .chunks_exact(16)
        .map(|c| (u64_at(c, 0).unwrap_or(0) as i64, u64_at(c, 8).unwrap_or(0)))
        .take_while(|&(t, _)| t != DT_NULL)
        .collect();
    let strtab = entries.iter().find(|e| e.0 == DT_STRTAB)?.1;
    let (base, file_base, _) = *loads
        .iter()
        .find(|&&(v, _, sz)| strtab >= v && strtab < v + sz)?;
    let strtab_offset = strtab - base + file_base;
    let string = |o: u64| -> Option<String> {
        let b = read_at(&f, strtab_offset + o, 4096)?;
        let end = b.iter().position(|&c| c == 0)?;
        Some(String::from_utf8_lossy(&b[..end]).into_owned())
    };
    let mut n = Needs::default();
    let (mut runpath, mut rpath) = (None, None);
    for &(tag, val) in &entries {
        match tag {
            DT_NEEDED => n.needed.extend(string(val)),
            DT_SONAME => n.soname = string(val),
            DT_RUNPATH => runpath = string(val),
            DT_RPATH => rpath = string(val),
            _ => {}
        }
    }
    let origin = path.parent().map(|p| p.to_string_lossy().into_owned());
    n.paths = runpath
        .or(rpath)
        .map(|p| {
            p.split(':')
                .filter(|d| !d.is_empty())
                .map(|d| {
                    let o = origin.as_deref().unwrap_or(".");
                    d.replace("${ORIGIN}", o).replace("$ORIGIN", o)
                })
                .collect()
        })
        .unwrap_or_default();
    Some(n)
}

/// The path /etc/ld.so.cache gives for `name` (the "glibc-ld.so.cache1.1" format).
fn from_cache(cache: &[u8], name: &str) -> Option<PathBuf> {
    const MAGIC: &[u8] = b"glibc-ld.so.cache1.1";
    let start = cache.windows(MAGIC.len()).position(|w| w == MAGIC)?;
    let c = &cache[start..];
    let count = u32_at(c, 20)? as usize;
    let string = |o: usize| -> Option<&str> {
        let b = c.get(o..)?;
        std::str::from_utf8(&b[..b.iter().position(|&x| x == 0)?]).ok()
    };
    (0..count.min(1 << 20)).find_map(|i| {
        let e = 48 + i * 24;
        let (key, value) = (u32_at(c, e + 4)? as usize, u32_at(c, e + 8)? as usize);
        (string(key)? == name)
            .then(|| string(value).map(PathBuf::from))
            .flatten()
    })
}

/// Where the loader would find a needed `name` (ld.so(8): a name with a slash is a path;
/// otherwise DT_RPATH/DT_RUNPATH of the one needing it, LD_LIBRARY_PATH, /etc/ld.so.cache, the
/// default directories). Approximate in order, which does not matter for what it is used for:
/// the first existing candidate.
fn locate(
    name: &str,
    paths: &[String],
    ld_library_path: &[String],
    cache: &[u8],
) -> Option<PathBuf> {
    if name.contains('/') {
        return Some(PathBuf::from(name));
    }
    let dirs = paths.iter().chain(ld_library_path).map(PathBuf::from);
    let defaults = [
        "/lib/x86_64-linux-gnu",
        "/usr/lib/x86_64-linux-gnu",
        "/lib/aarch64-linux-gnu",
        "/usr/lib/aarch64-linux-gnu",
        "/lib64",
        "/usr/lib64",
        "/lib",
        "/usr/lib",
    ];
    dirs.map(|d| d.join(name))
        .find(|p| p.is_file())
        .or_else(|| from_cache(cache, name).filter(|p| p.is_file()))
        .or_else(|| {
            defaults
                .iter()
                .map(|d| Path::new(d).join(name))
                .find(|p| p.is_file())
        })
}

/// What loading `file` would bring in, as far as the files tell: Some(why) when a CUDA driver or
/// NVML library (by file name or DT_SONAME) is among it and its dependencies, found
/// breadth-first; None if there is none. A dependency that cannot be found or read counts as
/// one (the safe side: the caller then loads it the way that keeps the wrappers first).
pub fn driver_in_closure(
    file: &str,
    is_driver: impl Fn(&str) -> bool,
    ld_library_path: &[String],
) -> Option<String> {
    let cache = std::fs::read("/etc/ld.so.cache").unwrap_or_default();
    let mut queue = std::collections::VecDeque::from([(file.to_string(), Vec::<String>::new())]);
    let mut seen = std::collections::HashSet::new();
    while let Some((name, paths)) = queue.pop_front() {
        if !seen.insert(name.clone()) {
            continue;
        }
        if seen.len() > MAX_OBJECTS {
            return Some(format!("more than {MAX_OBJECTS} objects to read"));
        }
        let base = name.rsplit('/').next().unwrap_or(&name);
        if is_driver(base) {
            return Some(format!("it brings in {name}"));
        }
        let Some(path) = locate(&name, &paths, ld_library_path, &cache) else {
            return Some(format!("{name} was not found, to tell what it brings in"));
        };
        let Some(n) = needs_of(&path) else {
            return Some(format!(
                "{} could not be read, to tell what it brings in",
                path.display()
            ));
        };
        if n.soname.as_deref().is_some_and(&is_driver) {
            return Some(format!(
                "it brings in {} (DT_SONAME {})",
                path.display(),
                n.soname.unwrap_or_default()
            ));
        }
        for dep in n.needed {
            queue.push_back((dep, n.paths.clone()));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn libc_is_found_in_memory_with_its_dynamic_loader_functions() {
        let dlsym = function_in(c"libc.so.6", c"dlsym").expect("glibc >= 2.34 defines dlsym");
        // SAFETY: a plain lookup through the address just found (glibc's dlsym).
        let f: extern "C" fn(*mut c_void, *const c_char) -> *mut c_void =
            unsafe { std::mem::transmute(dlsym) };
        let puts = f(libc::RTLD_DEFAULT, c"puts".as_ptr());
        assert_eq!(puts as usize, function_in(c"libc.so.6", c"puts").unwrap());
        assert!(maps().count() > 2);
        assert!(is_loaded_object(maps().next().unwrap() as *mut c_void));
        assert!(!is_loaded_object(0x1234 as *mut c_void));
    }

    #[test]
    fn a_files_needs_are_read_and_a_driver_in_the_closure_is_found() {
        let libc = locate(
            "libc.so.6",
            &[],
            &[],
            &std::fs::read("/etc/ld.so.cache").unwrap_or_default(),
        )
        .expect("libc.so.6 somewhere");
        let n = needs_of(&libc).unwrap();
        assert_eq!(n.soname.as_deref(), Some("libc.so.6"));
        let libm = locate("libm.so.6", &[], &[], &[]).unwrap();
        assert!(needs_of(&libm)
            .unwrap()
            .needed
            .iter()
            .any(|d| d == "libc.so.6"));
        let is = |n: &str| n.starts_with("libc.so");
        assert!(driver_in_closure(libm.to_str().unwrap(), is, &[]).is_some());
        assert_eq!(
            driver_in_closure(libm.to_str().unwrap(), |_| false, &[]),
            None
        );
        assert!(needs_of(Path::new("/etc/hostname")).is_none());
    }
}
