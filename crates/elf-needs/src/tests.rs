use super::*;

/// What a test file holds.
#[derive(Clone, Default)]
struct Spec {
    soname: Option<&'static str>,
    needed: Vec<&'static str>,
    /// (file, versions)
    verneed: Vec<(&'static str, Vec<&'static str>)>,
    /// (name, flags)
    verdef: Vec<(&'static str, u16)>,
}

const BASE: u64 = 0x40_0000;

/// Writes a shared object as a linker lays one out, in the given class and byte order: ELF
/// header, a PT_LOAD of the whole file and a PT_DYNAMIC, the string table, the version needs and
/// definitions, and the dynamic array last.
fn build(wide: bool, little: bool, spec: &Spec) -> Vec<u8> {
    struct W {
        b: Vec<u8>,
        little: bool,
        wide: bool,
    }
    impl W {
        fn u16(&mut self, v: u16) {
            let x = if self.little {
                v.to_le_bytes()
            } else {
                v.to_be_bytes()
            };
            self.b.extend_from_slice(&x);
        }
        fn u32(&mut self, v: u32) {
            let x = if self.little {
                v.to_le_bytes()
            } else {
                v.to_be_bytes()
            };
            self.b.extend_from_slice(&x);
        }
        fn u64(&mut self, v: u64) {
            let x = if self.little {
                v.to_le_bytes()
            } else {
                v.to_be_bytes()
            };
            self.b.extend_from_slice(&x);
        }
        fn word(&mut self, v: u64) {
            if self.wide {
                self.u64(v)
            } else {
                self.u32(v as u32)
            }
        }
        fn align(&mut self, to: usize) {
            while !self.b.len().is_multiple_of(to) {
                self.b.push(0);
            }
        }
    }
    // The string table first, so offsets are known.
    let mut strtab = vec![0u8];
    let mut index = std::collections::HashMap::new();
    let mut intern = |s: &str| -> u32 {
        *index.entry(s.to_string()).or_insert_with(|| {
            let at = strtab.len() as u32;
            strtab.extend_from_slice(s.as_bytes());
            strtab.push(0);
            at
        })
    };
    let soname = spec.soname.map(&mut intern);
    let needed: Vec<u32> = spec.needed.iter().map(|n| intern(n)).collect();
    let verneed: Vec<(u32, Vec<u32>)> = spec
        .verneed
        .iter()
        .map(|(f, vs)| (intern(f), vs.iter().map(|v| intern(v)).collect()))
        .collect();
    let verdef: Vec<(u32, u16)> = spec.verdef.iter().map(|(n, f)| (intern(n), *f)).collect();

    let ehsize = if wide { 64 } else { 52 };
    let phentsize: u16 = if wide { 56 } else { 32 };
    let phoff = ehsize as u64;
    let strtab_off = phoff + 2 * u64::from(phentsize);
    let verneed_off = (strtab_off + strtab.len() as u64).next_multiple_of(8);
    let verneed_len: u64 = verneed
        .iter()
        .map(|(_, vs)| 16 + 16 * vs.len() as u64)
        .sum();
    let verdef_off = verneed_off + verneed_len;
    let verdef_len = 28 * verdef.len() as u64;
    let dyn_off = (verdef_off + verdef_len).next_multiple_of(8);
    let entry = if wide { 16 } else { 8 };
    let mut dyns: Vec<(u64, u64)> = Vec::new();
    for n in &needed {
        dyns.push((DT_NEEDED, u64::from(*n)));
    }
    if let Some(s) = soname {
        dyns.push((DT_SONAME, u64::from(s)));
    }
    dyns.push((DT_STRTAB, BASE + strtab_off));
    dyns.push((DT_STRSZ, strtab.len() as u64));
    if !verneed.is_empty() {
        dyns.push((DT_VERNEED, BASE + verneed_off));
        dyns.push((DT_VERNEEDNUM, verneed.len() as u64));
    }
    if !verdef.is_empty() {
        dyns.push((DT_VERDEF, BASE + verdef_off));
        dyns.push((DT_VERDEFNUM, verdef.len() as u64));
    }
    dyns.push((DT_NULL, 0));
    let dyn_len = entry * dyns.len() as u64;
    let total = dyn_off + dyn_len;

    let mut w = W {
        b: Vec::new(),
        little,
        wide,
    };
    w.b.extend_from_slice(b"\x7fELF");
    w.b.push(if wide { 2 } else { 1 });
    w.b.push(if little { 1 } else { 2 });
    w.b.push(1);
    w.b.resize(16, 0);
    w.u16(3); // ET_DYN
    w.u16(62);
    w.u32(1);
    w.word(0); // e_entry
    w.word(phoff);
    w.word(0); // e_shoff
    w.u32(0); // e_flags
    w.u16(ehsize as u16);
    w.u16(phentsize);
    w.u16(2);
    w.u16(0);
    w.u16(0);
    w.u16(0);
    assert_eq!(w.b.len(), ehsize);
    for (p_type, off, len) in [(PT_LOAD, 0, total), (PT_DYNAMIC, dyn_off, dyn_len)] {
        if wide {
            w.u32(p_type);
            w.u32(4);
            w.u64(off);
            w.u64(BASE + off);
            w.u64(BASE + off);
            w.u64(len);
            w.u64(len);
            w.u64(8);
        } else {
            w.u32(p_type);
            w.u32(off as u32);
            w.u32((BASE + off) as u32);
            w.u32((BASE + off) as u32);
            w.u32(len as u32);
            w.u32(len as u32);
            w.u32(4);
            w.u32(8);
        }
    }
    assert_eq!(w.b.len() as u64, strtab_off);
    w.b.extend_from_slice(&strtab);
    w.align(8);
    assert_eq!(w.b.len() as u64, verneed_off);
    for (i, (file, vs)) in verneed.iter().enumerate() {
        let size = 16 + 16 * vs.len() as u32;
        w.u16(1);
        w.u16(vs.len() as u16);
        w.u32(*file);
        w.u32(16);
        w.u32(if i + 1 < verneed.len() { size } else { 0 });
        for (j, v) in vs.iter().enumerate() {
            w.u32(0); // hash, unchecked here
            w.u16(0);
            w.u16(j as u16 + 2);
            w.u32(*v);
            w.u32(if j + 1 < vs.len() { 16 } else { 0 });
        }
    }
    assert_eq!(w.b.len() as u64, verdef_off);
    for (i, (name, flags)) in verdef.iter().enumerate() {
        w.u16(1);
        w.u16(*flags);
        w.u16(i as u16 + 1);
        w.u16(1);
        w.u32(0);
        w.u32(20);
        w.u32(if i + 1 < verdef.len() { 28 } else { 0 });
        w.u32(*name);
        w.u32(0);
    }
    w.align(8);
    assert_eq!(w.b.len() as u64, dyn_off);
    for (t, v) in dyns {
        w.word(t);
        w.word(v);
    }
    assert_eq!(w.b.len() as u64, total);
    w.b
}

/// Where the dynamic entry with `tag` is in a 64-bit little-endian file from `build`.
fn dyn_entry(f: &[u8], tag: u64) -> usize {
    let ph = 64 + 56; // the second program header: PT_DYNAMIC
    let off = u64::from_le_bytes(f[ph + 8..ph + 16].try_into().unwrap()) as usize;
    (off..f.len())
        .step_by(16)
        .find(|&at| f[at..at + 8] == tag.to_le_bytes())
        .expect("the tag is in the dynamic array")
}

fn cuvisor_like() -> Spec {
    Spec {
        soname: Some("libcuvisor.so"),
        needed: vec!["libc.so.6", "libdl.so.2"],
        verneed: vec![
            (
                "libc.so.6",
                vec!["GLIBC_2.2.5", "GLIBC_2.17", "GLIBC_2.3.4"],
            ),
            ("libdl.so.2", vec!["GLIBC_2.2.5"]),
        ],
        verdef: vec![],
    }
}

fn libc_like() -> Spec {
    Spec {
        soname: Some("libc.so.6"),
        needed: vec!["ld-linux-x86-64.so.2"],
        verneed: vec![("ld-linux-x86-64.so.2", vec!["GLIBC_2.3"])],
        verdef: vec![
            ("libc.so.6", VER_FLG_BASE),
            ("GLIBC_2.2.5", 0),
            ("GLIBC_2.17", 0),
            ("GLIBC_2.28", 0),
            ("GLIBC_PRIVATE", 0),
        ],
    }
}

fn need(file: &str, version: &str) -> VersionNeed {
    VersionNeed {
        file: file.into(),
        version: version.into(),
    }
}

#[test]
fn needs_and_definitions_read_back_in_every_class_and_byte_order() {
    for (wide, little) in [(true, true), (true, false), (false, true), (false, false)] {
        let d = parse(&build(wide, little, &cuvisor_like())).unwrap();
        assert_eq!(d.soname.as_deref(), Some("libcuvisor.so"));
        assert_eq!(d.needed, ["libc.so.6", "libdl.so.2"]);
        assert_eq!(
            d.version_needs,
            [
                need("libc.so.6", "GLIBC_2.2.5"),
                need("libc.so.6", "GLIBC_2.17"),
                need("libc.so.6", "GLIBC_2.3.4"),
                need("libdl.so.2", "GLIBC_2.2.5"),
            ]
        );
        assert!(d.version_defs.is_empty());

        let l = parse(&build(wide, little, &libc_like())).unwrap();
        assert_eq!(
            l.version_defs,
            ["GLIBC_2.2.5", "GLIBC_2.17", "GLIBC_2.28", "GLIBC_PRIVATE"],
            "the base name (VER_FLG_BASE) is the file, not a version"
        );
        assert_eq!(l.newest_glibc_defined(), Some(GlibcVersion::new(2, 28)));
    }
}

#[test]
fn glibc_versions_compare_as_numbers_not_as_text() {
    // "2.3.4" > "2.17" as text; as versions 2.17 is newer.
    let d = parse(&build(true, true, &cuvisor_like())).unwrap();
    let (v, n) = d.newest_glibc_needed().unwrap();
    assert_eq!(v, GlibcVersion::new(2, 17));
    assert_eq!(*n, need("libc.so.6", "GLIBC_2.17"));
    assert!(d
        .glibc_needs_newer_than(GlibcVersion::new(2, 17))
        .is_empty());
    assert_eq!(
        d.glibc_needs_newer_than(GlibcVersion::new(2, 4)),
        [&need("libc.so.6", "GLIBC_2.17")]
    );
    let v = |s| GlibcVersion::parse(s).unwrap();
    assert!(v("2.3.4") < v("2.17") && v("2.17") < v("2.34") && v("2.2.5") < v("2.3"));
    assert_eq!(v("2.3.4").to_string(), "2.3.4");
    assert_eq!(v("2.17").to_string(), "2.17");
    for bad in [
        "",
        "2",
        "2.",
        ".17",
        "2.17.",
        "2.17.1.1",
        "2.x",
        "+2.17",
        "2. 17",
        "99999999999.1",
    ] {
        assert_eq!(GlibcVersion::parse(bad), None, "{bad:?}");
    }
    assert_eq!(GlibcVersion::from_symbol_version("GLIBC_PRIVATE"), None);
    assert_eq!(GlibcVersion::from_symbol_version("GCC_3.0"), None);
    assert_eq!(GlibcVersion::from_symbol_version("GLIBCXX_3.4.29"), None);
    assert_eq!(
        GlibcVersion::from_symbol_version("GLIBC_2.34"),
        Some(GlibcVersion::new(2, 34))
    );
}

#[test]
fn a_file_without_a_dynamic_segment_needs_nothing() {
    let mut f = build(true, true, &cuvisor_like());
    // The second program header's p_type: PT_DYNAMIC -> PT_NOTE.
    f[64 + 56..64 + 56 + 4].copy_from_slice(&4u32.to_le_bytes());
    assert_eq!(parse(&f).unwrap(), Dynamic::default());
}

#[test]
fn not_elf_and_bad_identification_are_errors() {
    assert_eq!(parse(b""), Err(Error::NotElf));
    assert_eq!(parse(b"buildhost\n"), Err(Error::NotElf));
    assert_eq!(parse(b"\x7fELF"), Err(Error::Truncated("ELF header")));
    let mut f = build(true, true, &cuvisor_like());
    f[4] = 3;
    assert_eq!(parse(&f), Err(Error::Malformed("ELF class 3".into())));
}

/// Every prefix of a file is refused: the dynamic array is last, so no prefix holds all of it.
#[test]
fn every_truncation_is_an_error_never_a_panic() {
    for (wide, little) in [(true, true), (false, false)] {
        for spec in [cuvisor_like(), libc_like()] {
            let f = build(wide, little, &spec);
            assert!(parse(&f).is_ok());
            for n in 0..f.len() {
                assert!(parse(&f[..n]).is_err(), "a prefix of {n} bytes parsed");
            }
        }
    }
}

/// Every byte of a file, set to values that break lengths, offsets and counts: the reader
/// answers (Ok or Err) and never panics or loops.
#[test]
fn every_corrupted_byte_is_answered_without_a_panic() {
    for (wide, little) in [(true, true), (true, false), (false, true)] {
        for spec in [cuvisor_like(), libc_like()] {
            let f = build(wide, little, &spec);
            let mut g = f.clone();
            for i in 0..f.len() {
                for v in [0u8, 1, 0x7f, 0x80, 0xff, f[i] ^ 0x10, f[i].wrapping_add(1)] {
                    g[i] = v;
                    let _ = parse(&g);
                }
                g[i] = f[i];
            }
        }
    }
}

/// A small xorshift generator: the same sequence every run, no dependency.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

#[test]
fn random_multi_byte_corruption_is_answered_without_a_panic() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for (wide, little) in [(true, true), (false, true), (true, false)] {
        let f = build(wide, little, &libc_like());
        for _ in 0..20_000 {
            let mut g = f.clone();
            for _ in 0..1 + rng.next() % 6 {
                let i = (rng.next() % g.len() as u64) as usize;
                g[i] = rng.next() as u8;
            }
            let _ = parse(&g);
        }
    }
}

/// Chains only go forward (the next fields are unsigned offsets), but a hostile count can be
/// 2^32 and the steps as short as one byte: the walk ends at an error, at once, not after
/// 2^32 steps.
#[test]
fn a_version_count_of_2_to_the_32_is_refused_at_once() {
    let spec = Spec {
        soname: None,
        needed: vec!["libc.so.6"],
        verneed: vec![("libc.so.6", vec!["GLIBC_2.2.5"])],
        verdef: vec![],
    };
    let mut f = build(true, true, &spec);
    assert_eq!(
        parse(&f).unwrap().version_needs,
        [need("libc.so.6", "GLIBC_2.2.5")]
    );
    let num = dyn_entry(&f, DT_VERNEEDNUM);
    f[num + 8..num + 16].copy_from_slice(&(1u64 << 32).to_le_bytes());
    assert_eq!(
        parse(&f),
        Err(Error::Malformed(
            "DT_VERNEED ends after 1 of 4294967296 files".into()
        ))
    );
    // The Verneed entry: vn_version 1, vn_cnt 1, then vn_file; its vn_next (0) made 1.
    let vn = f
        .windows(4)
        .position(|w| w == [1, 0, 1, 0])
        .expect("the Verneed entry");
    f[vn + 12..vn + 16].copy_from_slice(&1u32.to_le_bytes());
    let started = std::time::Instant::now();
    assert!(parse(&f).is_err());
    assert!(started.elapsed() < std::time::Duration::from_secs(1));
}

#[test]
fn addresses_outside_every_segment_and_bad_string_indexes_are_errors() {
    let f = build(true, true, &cuvisor_like());
    let strtab_entry = dyn_entry(&f, DT_STRTAB);
    let mut g = f.clone();
    g[strtab_entry + 8..strtab_entry + 16].copy_from_slice(&0x10u64.to_le_bytes());
    assert!(
        matches!(parse(&g), Err(Error::Malformed(m)) if m.contains("in no loaded segment")),
        "{:?}",
        parse(&g)
    );
    // DT_NEEDED's index beyond DT_STRSZ.
    let needed_entry = dyn_entry(&f, DT_NEEDED);
    let mut g = f.clone();
    g[needed_entry + 8..needed_entry + 16].copy_from_slice(&0xffffu64.to_le_bytes());
    assert!(
        matches!(parse(&g), Err(Error::Malformed(m)) if m.contains("outside the string table")),
        "{:?}",
        parse(&g)
    );
}

/// The path of this process's libc.so.6, as the loader found it.
fn loaded_libc() -> Option<std::path::PathBuf> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .find(|p| {
            std::path::Path::new(p)
                .file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("libc.so.6") || n == "libc-2.so")
        })
        .map(Into::into)
}

/// On real files: this test program needs libc.so.6's GLIBC_ versions, and the libc it runs
/// with defines every one of them (it runs, so the loader agreed).
#[test]
fn this_program_and_its_libc_agree() {
    let exe = std::fs::read(std::env::current_exe().unwrap()).unwrap();
    let d = parse(&exe).unwrap();
    assert!(d.needed.iter().any(|n| n == "libc.so.6"), "{:?}", d.needed);
    let libc_needs: Vec<&VersionNeed> = d
        .version_needs
        .iter()
        .filter(|n| n.file == "libc.so.6")
        .collect();
    assert!(!libc_needs.is_empty(), "{:?}", d.version_needs);
    let Some(path) = loaded_libc() else {
        panic!("no libc.so.6 in /proc/self/maps");
    };
    let libc = parse(&std::fs::read(&path).unwrap()).unwrap();
    assert_eq!(libc.soname.as_deref(), Some("libc.so.6"));
    for n in libc_needs {
        assert!(
            libc.version_defs.contains(&n.version),
            "{} needs {} which {} does not define",
            std::env::current_exe().unwrap().display(),
            n.version,
            path.display()
        );
    }
    assert!(libc.newest_glibc_defined().unwrap() >= GlibcVersion::new(2, 17));
    // Random corruption of the real libc's first 256 KiB (headers, .dynstr, .gnu.version_d).
    let clean = std::fs::read(&path).unwrap();
    let mut g = clean.clone();
    let span = clean.len().min(256 << 10) as u64;
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    for _ in 0..300 {
        let touched: Vec<usize> = (0..1 + rng.next() % 8)
            .map(|_| (rng.next() % span) as usize)
            .collect();
        for &i in &touched {
            g[i] = rng.next() as u8;
        }
        let _ = parse(&g);
        for &i in &touched {
            g[i] = clean[i];
        }
    }
}

/// A name longer than any library or version name (a hostile string table) is an error, not a
/// copy of however much the file holds.
#[test]
fn a_name_longer_than_path_max_is_refused() {
    let long: &'static str = Box::leak("G".repeat(MAX_NAME + 1).into_boxed_str());
    let spec = Spec {
        soname: None,
        needed: vec!["libc.so.6"],
        verneed: vec![("libc.so.6", vec![long])],
        verdef: vec![],
    };
    let f = build(true, true, &spec);
    match parse(&f) {
        Err(Error::Malformed(m)) => assert!(m.contains("at most 4096"), "{m}"),
        other => panic!("{other:?}"),
    }
}

/// Entries may name one string many times (overlapping chains): what is copied out in all is
/// bounded by the file's size, so a 1 MiB file cannot make gigabytes of names.
#[test]
fn names_read_again_and_again_stop_at_a_budget_of_the_files_size() {
    let mut bytes = vec![b'x'; MAX_NAME];
    bytes.push(0);
    let strings = Strings::new(&bytes, 0, bytes.len() as u64).unwrap();
    let mut reads = 0usize;
    while strings.get(0, "a name").is_ok() {
        reads += 1;
        assert!(reads < 1 << 20, "no budget");
    }
    let budget = bytes.len() * 4 + (1 << 20);
    assert_eq!(reads, budget / MAX_NAME);
}
