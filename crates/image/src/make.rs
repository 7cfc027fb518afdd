//! Images made to order, for the tests of every package that loads them: a minimal cubin laid
//! out as NVRTC's are, and fat binaries of entries (plain, LZ4- or Zstandard-compressed).

/// A minimal ELF64 cubin, laid out as NVRTC's are: a `.text.<kernel>` section and an entry
/// FUNC symbol (`st_other` 0x10) per kernel, `__device__` variables as OBJECT symbols in
/// `.nv.global` (NOBITS) and `__constant__` ones in `.nv.constant3`.
pub fn cubin(kernels: &[&str], globals: &[(&str, u64)], constants: &[(&str, u64)]) -> Vec<u8> {
    // Sections: 0 NULL, 1 .shstrtab, 2 .strtab, 3 .symtab, 4 .nv.global, 5 .nv.constant3,
    // then one .text.<k> each.
    let mut shstr = vec![0u8];
    let add_name = |v: &mut Vec<u8>, s: &str| {
        let at = v.len() as u32;
        v.extend_from_slice(s.as_bytes());
        v.push(0);
        at
    };
    let mut names = vec![0u32];
    for n in [
        ".shstrtab",
        ".strtab",
        ".symtab",
        ".nv.global",
        ".nv.constant3",
    ] {
        names.push(add_name(&mut shstr, n));
    }
    for k in kernels {
        names.push(add_name(&mut shstr, &format!(".text.{k}")));
    }
    let mut strtab = vec![0u8];
    let mut symtab = vec![0u8; 24]; // the null symbol
    let mut sym = |strtab: &mut Vec<u8>, name: &str, info: u8, other: u8, shndx: u16, size: u64| {
        let at = add_name(strtab, name);
        symtab.extend_from_slice(&at.to_le_bytes());
        symtab.push(info);
        symtab.push(other);
        symtab.extend_from_slice(&shndx.to_le_bytes());
        symtab.extend_from_slice(&0u64.to_le_bytes());
        symtab.extend_from_slice(&size.to_le_bytes());
    };
    const LOCAL_OBJECT: u8 = 1;
    const GLOBAL_FUNC: u8 = (1 << 4) | 2;
    for (n, size) in globals {
        sym(&mut strtab, n, LOCAL_OBJECT, 0, 4, *size);
    }
    for (n, size) in constants {
        sym(&mut strtab, n, LOCAL_OBJECT, 0, 5, *size);
    }
    // An extern variable: undefined (section 0), so not the module's.
    sym(&mut strtab, "elsewhere", LOCAL_OBJECT, 0, 0, 4);
    for (i, k) in kernels.iter().enumerate() {
        sym(&mut strtab, k, GLOBAL_FUNC, 0x10, 6 + i as u16, 128);
    }
    let global_size = globals.iter().fold(0u64, |a, g| a.saturating_add(g.1));
    let const_size: u64 = constants.iter().map(|c| c.1).sum();
    let text = vec![0u8; 128];

    // Contents after the 64-byte header, then the section headers.
    let mut body = Vec::new();
    let place = |body: &mut Vec<u8>, data: &[u8]| {
        let off = 64 + body.len() as u64;
        body.extend_from_slice(data);
        off
    };
    let shstr_off = place(&mut body, &shstr);
    let str_off = place(&mut body, &strtab);
    let sym_off = place(&mut body, &symtab);
    let const_off = place(&mut body, &vec![0u8; const_size as usize]);
    let text_offs: Vec<u64> = kernels.iter().map(|_| place(&mut body, &text)).collect();
    let shoff = 64 + body.len() as u64;
    let shnum = 6 + kernels.len() as u16;

    let mut out = Vec::new();
    out.extend_from_slice(b"\x7fELF\x02\x01\x01\x33\x07");
    out.resize(16, 0);
    out.extend_from_slice(&2u16.to_le_bytes()); // ET_EXEC
    out.extend_from_slice(&190u16.to_le_bytes()); // EM_CUDA
    out.extend_from_slice(&0x81u32.to_le_bytes());
    out.extend_from_slice(&0u64.to_le_bytes()); // entry
    out.extend_from_slice(&0u64.to_le_bytes()); // phoff
    out.extend_from_slice(&shoff.to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes()); // flags
    for v in [64u16, 56, 0, 64, shnum, 1] {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out.extend_from_slice(&body);
    let mut sh = |name: u32, ty: u32, off: u64, size: u64, link: u32, entsize: u64| {
        out.extend_from_slice(&name.to_le_bytes());
        out.extend_from_slice(&ty.to_le_bytes());
        out.extend_from_slice(&0u64.to_le_bytes()); // flags
        out.extend_from_slice(&0u64.to_le_bytes()); // addr
        out.extend_from_slice(&off.to_le_bytes());
        out.extend_from_slice(&size.to_le_bytes());
        out.extend_from_slice(&link.to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes()); // info
        out.extend_from_slice(&4u64.to_le_bytes()); // align
        out.extend_from_slice(&entsize.to_le_bytes());
    };
    sh(0, 0, 0, 0, 0, 0);
    sh(names[1], 3, shstr_off, shstr.len() as u64, 0, 0);
    sh(names[2], 3, str_off, strtab.len() as u64, 0, 0);
    sh(names[3], 2, sym_off, symtab.len() as u64, 2, 24);
    // NOBITS: its size is the variables', and no bytes of the file are its.
    sh(names[4], 8, shoff, global_size, 0, 0);
    sh(names[5], 1, const_off, const_size, 0, 0);
    for (i, off) in text_offs.iter().enumerate() {
        sh(names[6 + i], 1, *off, 128, 3, 0);
    }
    out
}

/// How a fat binary entry's payload is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Packing {
    Plain,
    /// One LZ4 block of literals only (valid LZ4; what matters here is the header's flag).
    Lz4,
    /// One Zstandard frame.
    Zstd,
    /// Stored some way this reader does not know (here: every byte inverted, flag 0x4000).
    Unknown,
}

/// A fat binary entry: `kind` 1 (PTX) or 2 (ELF), its payload as `packing` stores it.
pub fn fat_entry(kind: u16, payload: &[u8], packing: Packing) -> Vec<u8> {
    let (flags, data): (u64, Vec<u8>) = match packing {
        Packing::Plain => (0, payload.to_vec()),
        Packing::Lz4 => (0x2000, lz4_literals(payload)),
        Packing::Zstd => (
            0x8000,
            ruzstd::encoding::compress_to_vec(payload, ruzstd::encoding::CompressionLevel::Fastest),
        ),
        Packing::Unknown => (0x4000, payload.iter().map(|b| !b).collect()),
    };
    let padded = data.len().next_multiple_of(8);
    let mut e = vec![0u8; 0x40];
    e[0..2].copy_from_slice(&kind.to_le_bytes());
    e[4..8].copy_from_slice(&0x40u32.to_le_bytes());
    e[8..12].copy_from_slice(&(padded as u32).to_le_bytes());
    e[0x10..0x14].copy_from_slice(&(data.len() as u32).to_le_bytes());
    e[0x28..0x30].copy_from_slice(&flags.to_le_bytes());
    e[0x38..0x40].copy_from_slice(&(payload.len() as u64).to_le_bytes());
    e.extend_from_slice(&data);
    e.resize(0x40 + padded, 0);
    e
}

/// A fat binary of these entries.
pub fn fatbin(entries: &[Vec<u8>]) -> Vec<u8> {
    let body: Vec<u8> = entries.concat();
    let mut fat = 0xBA55_ED50u32.to_le_bytes().to_vec();
    fat.extend_from_slice(&1u16.to_le_bytes());
    fat.extend_from_slice(&16u16.to_le_bytes());
    fat.extend_from_slice(&(body.len() as u64).to_le_bytes());
    fat.extend(body);
    fat
}

/// `data` as one LZ4 block of literals only (a sequence with no match).
fn lz4_literals(data: &[u8]) -> Vec<u8> {
    let n = data.len();
    let mut out = Vec::with_capacity(n + n / 255 + 2);
    if n < 15 {
        out.push((n as u8) << 4);
    } else {
        out.push(0xf0);
        let mut rest = n - 15;
        while rest >= 255 {
            out.push(255);
            rest -= 255;
        }
        out.push(rest as u8);
    }
    out.extend_from_slice(data);
    out
}
