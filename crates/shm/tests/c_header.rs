//! Keeps `include/cuvisor.h` and the Rust ledger layout (`crates/shm/src/ledger.rs`) in step.
//!
//! The header is parsed for its structs (every field, in order, with its C type) and its
//! `#define`s; from that a C probe is generated and compiled with the system `cc`, which prints
//! `sizeof`/`offsetof` of every struct and field and the value of every constant. Those are
//! compared with the Rust side: an explicit field list per struct below (each entry is checked
//! against the Rust field's type at compile time, and the list must tile the struct's
//! `size_of` exactly, so a field added on either side fails), and every `pub const` of
//! ledger.rs. Then a ledger written by Rust is read back by C programs (the probe, and the example
//! in the header's comment) using nothing but the header.

use cuvisor_shm::coordinator::{self, Board, BoardHeader, Entry, State};
use cuvisor_shm::ledger::{self, DeviceEntry, Header, Layout, Ledger, ProcEntry, ShareEntry};
use std::collections::{BTreeMap, BTreeSet};
use std::mem::{offset_of, size_of};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicI64, AtomicU32, AtomicU64, Ordering::Relaxed};

fn header_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../include")
}

/// A directory of this test's own under cargo's per-target temp dir.
fn work_dir(tag: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("c_header-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Field {
    name: String,
    /// Normalised C declaration type, array dimensions appended: `uint64_t[CUVISOR_MAX_DEVICES]`.
    c_type: String,
    offset: usize,
    size: usize,
}

#[derive(Debug)]
struct Struct {
    name: String,
    size: usize,
    fields: Vec<Field>,
}

// ---------------------------------------------------------------------------------------------
// The Rust side.

/// One Rust struct as C sees it. Each field is written `name: RustType => "c type"`; the closure
/// makes the compiler check that the field exists with exactly that Rust type, so renaming,
/// removing or retyping a field breaks this test, and adding one breaks the tiling check.
macro_rules! rust_struct {
    ($s:ty => $c:literal { $($f:ident: $t:ty => $ct:literal),* $(,)? }) => {
        Struct {
            name: $c.to_string(),
            size: size_of::<$s>(),
            fields: vec![$({
                let _field_has_this_type: fn(&$s) -> &$t = |s| &s.$f;
                Field {
                    name: stringify!($f).to_string(),
                    c_type: $ct.to_string(),
                    offset: offset_of!($s, $f),
                    size: size_of::<$t>(),
                }
            }),*],
        }
    };
}

fn rust_structs() -> Vec<Struct> {
    const D: usize = ledger::MAX_DEVICES;
    const P: usize = ledger::MAX_PROCS;
    const S: usize = ledger::MAX_SHARES;
    vec![
        rust_struct!(Header => "cuvisor_ledger_header" {
            magic: AtomicU64 => "uint64_t",
            version: u32 => "uint32_t",
            size: u32 => "uint32_t",
            max_devices: u32 => "uint32_t",
            max_procs: u32 => "uint32_t",
            container_id: u64 => "uint64_t",
        }),
        rust_struct!(DeviceEntry => "cuvisor_device_entry" {
            state: AtomicU32 => "uint32_t",
            _pad: u32 => "uint32_t",
            uuid_words: [AtomicU64; 2] => "uint64_t[2]",
            limit: AtomicU64 => "uint64_t",
            used: AtomicU64 => "uint64_t",
            peak: AtomicU64 => "uint64_t",
            denied: AtomicU64 => "uint64_t",
            gpu_ns: AtomicU64 => "uint64_t",
            throttled_ns: AtomicU64 => "uint64_t",
            launches: AtomicU64 => "uint64_t",
        }),
        rust_struct!(ProcEntry => "cuvisor_proc_entry" {
            pid: AtomicU32 => "uint32_t",
            _pad: u32 => "uint32_t",
            start_time: AtomicU64 => "uint64_t",
            pid_ns: AtomicU64 => "uint64_t",
            charged: [AtomicU64; D] => "uint64_t[CUVISOR_MAX_DEVICES]",
        }),
        rust_struct!(ShareEntry => "cuvisor_share_entry" {
            state: AtomicU32 => "uint32_t",
            device: AtomicU32 => "uint32_t",
            key: AtomicU64 => "uint64_t",
            bytes: AtomicU64 => "uint64_t",
            _reserved: u64 => "uint64_t",
        }),
        rust_struct!(Layout => "cuvisor_ledger" {
            header: Header => "cuvisor_ledger_header",
            devices: [DeviceEntry; D] => "cuvisor_device_entry[CUVISOR_MAX_DEVICES]",
            procs: [ProcEntry; P] => "cuvisor_proc_entry[CUVISOR_MAX_PROCS]",
            shares: [ShareEntry; S] => "cuvisor_share_entry[CUVISOR_MAX_SHARES]",
        }),
        rust_struct!(BoardHeader => "cuvisor_board_header" {
            magic: u64 => "uint64_t",
            version: u32 => "uint32_t",
            size: u32 => "uint32_t",
            max_slots: u32 => "uint32_t",
            managed: u32 => "uint32_t",
            uuid: [u8; 16] => "uint8_t[16]",
            _reserved: [u64; 3] => "uint64_t[3]",
        }),
        rust_struct!(Entry => "cuvisor_board_entry" {
            container: u64 => "uint64_t",
            policy: u32 => "uint32_t",
            index: u32 => "uint32_t",
            param: u64 => "uint64_t",
            check: u64 => "uint64_t",
        }),
        rust_struct!(Board => "cuvisor_board" {
            header: BoardHeader => "cuvisor_board_header",
            entries: [Entry; coordinator::MAX_SLOTS] => "cuvisor_board_entry[CUVISOR_MAX_SLOTS]",
        }),
        rust_struct!(State => "cuvisor_coord_state" {
            magic: AtomicU64 => "uint64_t",
            version: u32 => "uint32_t",
            size: u32 => "uint32_t",
            index: u32 => "uint32_t",
            _pad: u32 => "uint32_t",
            container: AtomicU64 => "uint64_t",
            grant_ppm: AtomicU64 => "uint64_t",
            tokens: AtomicI64 => "int64_t",
            refill_at: AtomicU64 => "uint64_t",
            last_active: AtomicU64 => "uint64_t",
            throttled_at: AtomicU64 => "uint64_t",
            consumed_ns: AtomicU64 => "uint64_t",
            throttled_ns: AtomicU64 => "uint64_t",
            queued_until: AtomicU64 => "uint64_t",
            _reserved: [u64; 6] => "uint64_t[6]",
        }),
    ]
}

/// Every `pub const` of ledger.rs: Rust name -> (C name, value as the probe prints it).
fn rust_defines() -> BTreeMap<&'static str, (&'static str, String)> {
    BTreeMap::from([
        ("MAGIC", ("CUVISOR_LEDGER_MAGIC", ledger::MAGIC.to_string())),
        (
            "VERSION",
            ("CUVISOR_LEDGER_VERSION", ledger::VERSION.to_string()),
        ),
        (
            "MAX_DEVICES",
            ("CUVISOR_MAX_DEVICES", ledger::MAX_DEVICES.to_string()),
        ),
        (
            "MAX_PROCS",
            ("CUVISOR_MAX_PROCS", ledger::MAX_PROCS.to_string()),
        ),
        (
            "MAX_SHARES",
            ("CUVISOR_MAX_SHARES", ledger::MAX_SHARES.to_string()),
        ),
        (
            "SHARE_FREE",
            ("CUVISOR_SHARE_FREE", ledger::SHARE_FREE.to_string()),
        ),
        (
            "SHARE_CLAIMING",
            ("CUVISOR_SHARE_CLAIMING", ledger::SHARE_CLAIMING.to_string()),
        ),
        (
            "SHARE_LIVE",
            ("CUVISOR_SHARE_LIVE", ledger::SHARE_LIVE.to_string()),
        ),
        (
            "SHARE_RECLAIMING",
            (
                "CUVISOR_SHARE_RECLAIMING",
                ledger::SHARE_RECLAIMING.to_string(),
            ),
        ),
        (
            "SHARE_ANY_KEY",
            ("CUVISOR_SHARE_ANY_KEY", ledger::SHARE_ANY_KEY.to_string()),
        ),
        (
            "FILE_NAME",
            ("CUVISOR_LEDGER_FILE", ledger::FILE_NAME.to_string()),
        ),
        (
            "DEV_EMPTY",
            ("CUVISOR_DEV_EMPTY", ledger::DEV_EMPTY.to_string()),
        ),
        (
            "DEV_CLAIMING",
            ("CUVISOR_DEV_CLAIMING", ledger::DEV_CLAIMING.to_string()),
        ),
        (
            "DEV_READY",
            ("CUVISOR_DEV_READY", ledger::DEV_READY.to_string()),
        ),
        (
            "PID_RECLAIMING",
            ("CUVISOR_PID_RECLAIMING", ledger::PID_RECLAIMING.to_string()),
        ),
        (
            "BYTES_MASK",
            ("CUVISOR_BYTES_MASK", ledger::BYTES_MASK.to_string()),
        ),
        (
            "BOARD_MAGIC",
            ("CUVISOR_BOARD_MAGIC", coordinator::BOARD_MAGIC.to_string()),
        ),
        (
            "STATE_MAGIC",
            ("CUVISOR_STATE_MAGIC", coordinator::STATE_MAGIC.to_string()),
        ),
        (
            "COORD_VERSION",
            (
                "CUVISOR_COORD_VERSION",
                coordinator::COORD_VERSION.to_string(),
            ),
        ),
        (
            "BOARD",
            ("CUVISOR_COORD_BOARD", coordinator::BOARD.to_string()),
        ),
        (
            "MAX_SLOTS",
            ("CUVISOR_MAX_SLOTS", coordinator::MAX_SLOTS.to_string()),
        ),
        (
            "POLICY_LIMIT",
            (
                "CUVISOR_POLICY_LIMIT",
                coordinator::POLICY_LIMIT.to_string(),
            ),
        ),
        (
            "POLICY_SHARE",
            (
                "CUVISOR_POLICY_SHARE",
                coordinator::POLICY_SHARE.to_string(),
            ),
        ),
        (
            "MAX_WEIGHT",
            ("CUVISOR_MAX_WEIGHT", coordinator::MAX_WEIGHT.to_string()),
        ),
        (
            "STALE_NS",
            ("CUVISOR_STALE_NS", coordinator::STALE_NS.to_string()),
        ),
    ])
}

/// The names of the `pub const`s declared in ledger.rs and coordinator.rs, read from their source.
fn rust_const_names() -> BTreeSet<String> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let src = std::fs::read_to_string(dir.join("ledger.rs")).unwrap()
        + &std::fs::read_to_string(dir.join("coordinator.rs")).unwrap();
    src.lines()
        .filter_map(|l| l.trim_start().strip_prefix("pub const "))
        .map(|rest| {
            rest.split(|c: char| c == ':' || c.is_whitespace())
                .next()
                .unwrap()
                .to_string()
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// The C side: the header's text, then what the compiler makes of it.

/// The header without comments (string literals kept intact).
fn strip_comments(src: &str) -> String {
    let (mut out, mut chars) = (String::new(), src.chars().peekable());
    while let Some(c) = chars.next() {
        match (c, chars.peek()) {
            ('/', Some('*')) => {
                chars.next();
                let mut prev = ' ';
                for c in chars.by_ref() {
                    if prev == '*' && c == '/' {
                        break;
                    }
                    // Keep line structure so that `#define` lines stay lines.
                    if c == '\n' {
                        out.push('\n');
                    }
                    prev = c;
                }
                out.push(' ');
            }
            ('/', Some('/')) => {
                for c in chars.by_ref() {
                    if c == '\n' {
                        out.push('\n');
                        break;
                    }
                }
            }
            ('"', _) => {
                out.push(c);
                while let Some(c) = chars.next() {
                    out.push(c);
                    if c == '\\' {
                        out.extend(chars.next());
                    } else if c == '"' {
                        break;
                    }
                }
            }
            _ => out.push(c),
        }
    }
    out
}

struct ParsedHeader {
    /// Struct name -> fields (name, normalised C type) in declaration order.
    structs: Vec<(String, Vec<(String, String)>)>,
    /// Object-like `#define`s with a value: name -> value text.
    defines: BTreeMap<String, String>,
}

fn ident(s: &str) -> (&str, &str) {
    let s = s.trim_start();
    let end = s
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .unwrap_or(s.len());
    (&s[..end], &s[end..])
}

/// Reads the header's structs (`typedef struct NAME { TYPE FIELD[DIM]; ... } NAME;`, one field
/// per declaration) and constants. Anything in another form fails loudly rather than being
/// skipped, so that nothing in the header escapes the comparison.
fn parse_header(src: &str) -> ParsedHeader {
    let text = strip_comments(src);
    let mut defines = BTreeMap::new();
    for line in text.lines() {
        let Some(rest) = line.trim().strip_prefix("#define") else {
            continue;
        };
        let (name, after) = ident(rest);
        let value = after.trim();
        if value.is_empty() || after.starts_with('(') {
            continue; // the include guard, or a function-like macro
        }
        defines.insert(name.to_string(), value.to_string());
    }

    let mut structs = Vec::new();
    let mut rest = text.as_str();
    while let Some(at) = rest.find("typedef struct") {
        let (tag, after) = ident(&rest[at + "typedef struct".len()..]);
        let after = after
            .trim_start()
            .strip_prefix('{')
            .unwrap_or_else(|| panic!("struct {tag}: expected '{{'"));
        let close = after.find('}').unwrap();
        let body = &after[..close];
        assert!(
            !body.contains('{'),
            "struct {tag}: nested braces are not supported here"
        );
        let (alias, tail) = ident(&after[close + 1..]);
        assert_eq!(
            alias, tag,
            "typedef struct {tag} {{..}} {alias}: the typedef must repeat the tag"
        );
        assert!(tail.trim_start().starts_with(';'));
        let mut fields = Vec::new();
        for decl in body
            .split(';')
            .map(|d| d.split_whitespace().collect::<Vec<_>>().join(" "))
        {
            if decl.is_empty() {
                continue;
            }
            assert!(
                !decl.contains([',', '*', '(', ':']),
                "struct {tag}: `{decl}`: write one plain field per declaration"
            );
            let (decl_part, dims) = match decl.find('[') {
                Some(i) => (&decl[..i], decl[i..].replace(' ', "")),
                None => (decl.as_str(), String::new()),
            };
            let (ty, name) = decl_part
                .trim()
                .rsplit_once(' ')
                .unwrap_or_else(|| panic!("struct {tag}: `{decl}`"));
            fields.push((name.to_string(), format!("{ty}{dims}")));
        }
        structs.push((tag.to_string(), fields));
        rest = &after[close..];
    }
    let struct_words = text
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| *w == "struct")
        .count();
    assert_eq!(
        struct_words,
        structs.len(),
        "every struct in the header must be `typedef struct NAME {{ .. }} NAME;`"
    );
    ParsedHeader { structs, defines }
}

/// The reading half of the probe: maps a ledger using only the header and prints what it holds.
const PROBE_READER: &str = r#"
static int read_ledger(const char *dir) {
    char path[4096];
    struct stat st;
    snprintf(path, sizeof path, "%s/%s", dir, CUVISOR_LEDGER_FILE);
    int fd = open(path, O_RDONLY);
    if (fd < 0) { perror(path); return 2; }
    if (fstat(fd, &st) != 0 || st.st_size < (off_t)sizeof(cuvisor_ledger)) {
        fprintf(stderr, "%s: shorter than a ledger\n", path);
        return 2;
    }
    const cuvisor_ledger *l = mmap(NULL, sizeof *l, PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    if (l == MAP_FAILED) { perror("mmap"); return 2; }
    const cuvisor_ledger_header *h = &l->header;
    uint64_t magic = __atomic_load_n(&h->magic, __ATOMIC_ACQUIRE);
    if (magic != CUVISOR_LEDGER_MAGIC || h->version != CUVISOR_LEDGER_VERSION || h->size != sizeof *l
        || h->max_devices != CUVISOR_MAX_DEVICES || h->max_procs != CUVISOR_MAX_PROCS) {
        fprintf(stderr, "%s: not a ledger of this version\n", path);
        return 3;
    }
    printf("header %llu %u %u %u %u\n", (unsigned long long)magic, (unsigned)h->version,
           (unsigned)h->size, (unsigned)h->max_devices, (unsigned)h->max_procs);
    for (int i = 0; i < CUVISOR_MAX_DEVICES; i++) {
        const cuvisor_device_entry *d = &l->devices[i];
        if (__atomic_load_n(&d->state, __ATOMIC_ACQUIRE) != CUVISOR_DEV_READY) continue;
        printf("device %d ", i);
        for (int b = 0; b < 16; b++) {
            uint64_t w = __atomic_load_n(&d->uuid_words[b / 8], __ATOMIC_ACQUIRE);
            printf("%02x", (unsigned)(unsigned char)(w >> (56 - 8 * (b % 8))));
        }
        printf(" %llu %llu %llu %llu\n",
               (unsigned long long)__atomic_load_n(&d->limit, __ATOMIC_ACQUIRE),
               (unsigned long long)(__atomic_load_n(&d->used, __ATOMIC_ACQUIRE) & CUVISOR_BYTES_MASK),
               (unsigned long long)__atomic_load_n(&d->peak, __ATOMIC_ACQUIRE),
               (unsigned long long)__atomic_load_n(&d->denied, __ATOMIC_ACQUIRE));
    }
    for (int p = 0; p < CUVISOR_MAX_PROCS; p++) {
        const cuvisor_proc_entry *s = &l->procs[p];
        uint32_t pid = __atomic_load_n(&s->pid, __ATOMIC_ACQUIRE);
        if (pid == 0 || pid == CUVISOR_PID_RECLAIMING) continue;
        printf("proc %d %u %llu", p, (unsigned)pid,
               (unsigned long long)__atomic_load_n(&s->start_time, __ATOMIC_ACQUIRE));
        for (int i = 0; i < CUVISOR_MAX_DEVICES; i++) {
            uint64_t c = __atomic_load_n(&s->charged[i], __ATOMIC_ACQUIRE) & CUVISOR_BYTES_MASK;
            if (c) printf(" %d:%llu", i, (unsigned long long)c);
        }
        printf("\n");
    }
    munmap((void *)l, sizeof *l);
    return 0;
}
"#;

/// The probe's C source: without arguments it prints the layout and constants, with a state
/// directory it prints the ledger found there.
fn probe_source(h: &ParsedHeader) -> String {
    let mut c = String::from(
        "#include <stddef.h>\n#include <stdio.h>\n#include <fcntl.h>\n#include <sys/mman.h>\n\
         #include <sys/stat.h>\n#include <unistd.h>\n#include \"cuvisor.h\"\n",
    );
    c += PROBE_READER;
    c += "\nstatic void print_layout(void) {\n";
    for (s, fields) in &h.structs {
        c += &format!("    printf(\"struct {s} %zu\\n\", sizeof({s}));\n");
        for (f, _) in fields {
            c += &format!(
                "    printf(\"field {s} {f} %zu %zu\\n\", offsetof({s}, {f}), sizeof((({s} *)0)->{f}));\n"
            );
        }
    }
    for (name, value) in &h.defines {
        if value.starts_with('"') {
            c += &format!("    printf(\"define {name} %s\\n\", {name});\n");
        } else {
            c += &format!("    printf(\"define {name} %llu\\n\", (unsigned long long)({name}));\n");
        }
    }
    c += "}\n\nint main(int argc, char **argv) {\n    if (argc > 1) return read_ledger(argv[1]);\n    \
          print_layout();\n    return 0;\n}\n";
    c
}

/// Compiles `source` (a C file including "cuvisor.h") with the system compiler, strictly.
fn compile_c(dir: &Path, name: &str, source: &str) -> PathBuf {
    let src = dir.join(format!("{name}.c"));
    let exe = dir.join(name);
    std::fs::write(&src, source).unwrap();
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let out = Command::new(&cc)
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-pedantic", "-I"])
        .arg(header_dir())
        .arg("-o")
        .arg(&exe)
        .arg(&src)
        .output()
        .unwrap_or_else(|e| panic!("running `{cc}` (a C compiler is needed for this test): {e}"));
    assert!(
        out.status.success(),
        "{cc} failed on {}:\n{}",
        src.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    exe
}

fn run(exe: &Path, args: &[&Path]) -> String {
    let out = Command::new(exe).args(args).output().unwrap();
    assert!(
        out.status.success(),
        "{} exited with {}:\n{}",
        exe.display(),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn read_header() -> ParsedHeader {
    parse_header(&std::fs::read_to_string(header_dir().join("cuvisor.h")).unwrap())
}

/// What the compiled probe reports: the structs (sizes, offsets, with the parsed C types) and
/// the constants.
fn c_layout(h: &ParsedHeader, probe_out: &str) -> (Vec<Struct>, BTreeMap<String, String>) {
    let mut structs: Vec<Struct> = Vec::new();
    let mut defines = BTreeMap::new();
    for line in probe_out.lines() {
        let w: Vec<&str> = line.split(' ').collect();
        match w[..] {
            ["struct", name, size] => structs.push(Struct {
                name: name.into(),
                size: size.parse().unwrap(),
                fields: vec![],
            }),
            ["field", s, f, offset, size] => {
                let (_, decl) = h.structs.iter().find(|(n, _)| n == s).unwrap();
                let (_, c_type) = decl.iter().find(|(n, _)| n == f).unwrap();
                let st = structs.iter_mut().find(|x| x.name == s).unwrap();
                st.fields.push(Field {
                    name: f.into(),
                    c_type: c_type.clone(),
                    offset: offset.parse().unwrap(),
                    size: size.parse().unwrap(),
                });
            }
            ["define", name, ref value @ ..] => {
                defines.insert(name.to_string(), value.join(" "));
            }
            _ => panic!("unexpected probe output: {line}"),
        }
    }
    (structs, defines)
}

/// One struct, one line per field, for readable diffs.
fn describe(s: &Struct) -> String {
    let mut d = format!("{} ({} bytes)\n", s.name, s.size);
    for f in &s.fields {
        d += &format!(
            "    {} {}: offset {}, {} bytes\n",
            f.c_type, f.name, f.offset, f.size
        );
    }
    d
}

/// The fields, in order, cover the struct exactly: no gap, no overlap, nothing after the last.
/// A field missing from a list leaves a hole; implicit padding would too (the layout has none:
/// padding is explicit, `_pad`).
fn assert_tiles(side: &str, s: &Struct) {
    let mut at = 0;
    for f in &s.fields {
        assert_eq!(f.offset, at, "{side} {}: field `{}` is not where the previous one ends; a field is missing from the list, or there is implicit padding:\n{}", s.name, f.name, describe(s));
        at += f.size;
    }
    assert_eq!(at, s.size, "{side} {}: the fields end at {at}, the struct at {}; a field is missing from the list:\n{}", s.name, s.size, describe(s));
}

// ---------------------------------------------------------------------------------------------

#[test]
fn header_layout_and_constants_match_the_rust_definitions() {
    let dir = work_dir("layout");
    let h = read_header();
    let probe = compile_c(&dir, "probe", &probe_source(&h));
    let (c_structs, c_defines) = c_layout(&h, &run(&probe, &[]));
    let rust = rust_structs();

    for s in &rust {
        assert_tiles("Rust", s);
    }
    for s in &c_structs {
        assert_tiles("C", s);
    }
    let names = |v: &[Struct]| v.iter().map(|s| s.name.clone()).collect::<BTreeSet<_>>();
    assert_eq!(
        names(&c_structs),
        names(&rust),
        "structs in include/cuvisor.h vs. the Rust ledger"
    );
    for r in &rust {
        let c = c_structs.iter().find(|c| c.name == r.name).unwrap();
        assert_eq!(
            describe(c),
            describe(r),
            "include/cuvisor.h (left) vs. ledger.rs (right)"
        );
    }

    let rust_defines = rust_defines();
    assert_eq!(
        rust_const_names(),
        rust_defines.keys().map(|k| k.to_string()).collect::<BTreeSet<_>>(),
        "every `pub const` of ledger.rs needs its #define in include/cuvisor.h (and a line in rust_defines())"
    );
    let expected: BTreeMap<String, String> = rust_defines
        .into_values()
        .map(|(c, v)| (c.to_string(), v))
        .collect();
    assert_eq!(
        c_defines, expected,
        "#defines of include/cuvisor.h (left) vs. ledger.rs constants (right)"
    );

    let _ = std::fs::remove_dir_all(&dir);
}

/// GPU UUIDs whose bytes all differ, so that a reader that swaps bytes or words is caught.
const UUID_A: [u8; 16] = [
    0x01, 0x23, 0x45, 0x67, 0x89, 0xab, 0xcd, 0xef, 0xfe, 0xdc, 0xba, 0x98, 0x76, 0x54, 0x32, 0x10,
];
const UUID_B: [u8; 16] = [
    0xa0, 0xa1, 0xa2, 0xa3, 0xa4, 0xa5, 0xa6, 0xa7, 0xb0, 0xb1, 0xb2, 0xb3, 0xb4, 0xb5, 0xb6, 0xb7,
];
const GIB: u64 = 1 << 30;
/// Above i32::MAX and u32-sized values past 2^31: a reader with the wrong types prints garbage.
const PID_0: u32 = 3_000_000_123;
const PID_1: u32 = 4_242;
const START_0: u64 = 0x1_2345_6789;
const START_1: u64 = 77;

struct Written {
    dir: PathBuf,
    a: usize,
    b: usize,
    p0: usize,
    p1: usize,
    _ledger: Ledger,
}

/// A ledger with two devices and two processes, every counter distinct and some past 32 bits.
fn write_ledger(tag: &str) -> Written {
    let dir = work_dir(tag).join("state");
    let l = Ledger::open_dir(&dir).unwrap();
    let a = l.device_for(UUID_A, 40 * GIB).unwrap();
    let b = l.device_for(UUID_B, GIB).unwrap();
    let p0 = l.claim_proc(PID_0, START_0).unwrap();
    let p1 = l.claim_proc(PID_1, START_1).unwrap();
    l.try_charge(a, p0, 3 * GIB + 12_345).unwrap();
    l.try_charge(a, p1, 1_000).unwrap();
    l.try_charge(b, p1, 777).unwrap();
    assert!(l.try_charge(b, p1, 2 * GIB).is_err());
    l.note_denied(b);
    l.uncharge(a, p0, 12_345);
    // What the C side must see, as Rust sees it.
    assert_eq!(l.device(a).used_bytes(), 3 * GIB + 1_000);
    assert_eq!(l.device(a).peak.load(Relaxed), 3 * GIB + 13_345);
    assert_eq!(l.device(b).used_bytes(), 777);
    Written {
        dir,
        a,
        b,
        p0,
        p1,
        _ledger: l,
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[test]
fn a_c_program_reads_a_ledger_written_by_rust() {
    let w = write_ledger("read");
    let h = read_header();
    let probe = compile_c(w.dir.parent().unwrap(), "probe", &probe_source(&h));
    let got = run(&probe, &[&w.dir]);

    let (a, b, p0, p1) = (w.a, w.b, w.p0, w.p1);
    let mut devices = [
        (
            a,
            format!(
                "device {a} {} {} {} {} 0",
                hex(&UUID_A),
                40 * GIB,
                3 * GIB + 1_000,
                3 * GIB + 13_345
            ),
        ),
        (b, format!("device {b} {} {} 777 777 1", hex(&UUID_B), GIB)),
    ];
    devices.sort();
    let mut procs = [
        (p0, format!("proc {p0} {PID_0} {START_0} {a}:{}", 3 * GIB)),
        (
            p1,
            format!(
                "proc {p1} {PID_1} {START_1} {}",
                if a < b {
                    format!("{a}:1000 {b}:777")
                } else {
                    format!("{b}:777 {a}:1000")
                }
            ),
        ),
    ];
    procs.sort();
    let mut expected = vec![format!(
        "header {} {} {} {} {}",
        ledger::MAGIC,
        ledger::VERSION,
        size_of::<Layout>(),
        ledger::MAX_DEVICES,
        ledger::MAX_PROCS
    )];
    expected.extend(devices.into_iter().map(|(_, l)| l));
    expected.extend(procs.into_iter().map(|(_, l)| l));
    assert_eq!(
        got.lines().collect::<Vec<_>>(),
        expected,
        "what C read (left) vs. what Rust wrote (right)"
    );

    let _ = std::fs::remove_dir_all(w.dir.parent().unwrap());
}

/// The example in the header's comment compiles and does what it says.
#[test]
fn the_header_example_reads_a_ledger_written_by_rust() {
    let src = std::fs::read_to_string(header_dir().join("cuvisor.h")).unwrap();
    let example: String = src
        .lines()
        .skip_while(|l| !l.contains("@code"))
        .skip(1)
        .take_while(|l| !l.contains("@endcode"))
        .map(|l| {
            let l = l
                .trim_start()
                .strip_prefix('*')
                .unwrap_or_else(|| panic!("example line `{l}`: expected ` * `"));
            format!("{}\n", l.strip_prefix(' ').unwrap_or(l))
        })
        .collect();
    assert!(
        example.contains("int main"),
        "no @code ... @endcode example in include/cuvisor.h"
    );

    let w = write_ledger("example");
    let exe = compile_c(w.dir.parent().unwrap(), "example", &example);
    let got = run(&exe, &[&w.dir]);
    let gpu = |u: &[u8; 16]| {
        let h = hex(u);
        format!(
            "GPU-{}-{}-{}-{}-{}",
            &h[..8],
            &h[8..12],
            &h[12..16],
            &h[16..20],
            &h[20..]
        )
    };
    let mut expected = [
        (
            w.a,
            format!(
                "{} limit {} used {}",
                gpu(&UUID_A),
                40 * GIB,
                3 * GIB + 1_000
            ),
        ),
        (w.b, format!("{} limit {} used 777", gpu(&UUID_B), GIB)),
    ];
    expected.sort();
    assert_eq!(
        got.lines().collect::<Vec<_>>(),
        expected.iter().map(|(_, l)| l.as_str()).collect::<Vec<_>>()
    );

    let _ = std::fs::remove_dir_all(w.dir.parent().unwrap());
}

/// The header is also valid C++ (extern "C", no C-only constructs), where a C++ compiler exists.
#[test]
fn the_header_compiles_as_cpp() {
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    if Command::new(&cxx).arg("--version").output().is_err() {
        eprintln!("no C++ compiler (`{cxx}`): skipping the C++ check of include/cuvisor.h");
        return;
    }
    let dir = work_dir("cpp");
    let src = dir.join("use.cc");
    std::fs::write(
        &src,
        "#include <cstddef>\n#include \"cuvisor.h\"\n\
         static_assert(sizeof(cuvisor_ledger) == offsetof(cuvisor_ledger, shares) + sizeof(cuvisor_share_entry) * CUVISOR_MAX_SHARES, \"layout\");\n\
         extern \"C\" int cuvisor_header_cpp_check(const cuvisor_ledger *l) {\n\
             return __atomic_load_n(&l->header.magic, __ATOMIC_ACQUIRE) == CUVISOR_LEDGER_MAGIC;\n\
         }\n",
    )
    .unwrap();
    let out = Command::new(&cxx)
        .args([
            "-std=c++11",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-pedantic",
            "-fsyntax-only",
            "-I",
        ])
        .arg(header_dir())
        .arg(&src)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{cxx} failed on include/cuvisor.h:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let _ = std::fs::remove_dir_all(&dir);
}
