//! The simulated libraries' surface, held to NVIDIA's headers: every function CUDA 13.5's
//! `cuda.h` declares is exported by the simulated libcuda.so.1 under the names the real library
//! exports, resolvable through `cuGetProcAddress_v2` at the versions `cudaTypedefs.h` gives
//! (legacy and per-thread), and either modelled or a stub answering a code its own doc comment
//! lists in `\return`; every function `nvml.h` declares is exported by the simulated
//! libnvidia-ml.so.1, modelled or answering a documented code.
//!
//! The headers come from pinned PyPI wheels in `target/ci-tools/` (`nvidia-cuda-crt` through the
//! nvcc venv of `cudart_nvcc.rs`, `nvidia-nvml-dev`): where they cannot be had the tests print a
//! loud SKIPPED line, or fail when `CI` is set.
//!
//! The same parse generates what must agree with the headers, so nothing drifts:
//! `crates/sim/cuda/src/unsupported.rs` (the stub table), the body of `PROC_TABLE` in
//! `crates/sim/cuda/src/proc_table.rs`, `crates/sim/nvml/src/stubs.rs` and
//! `docs/driver-surface.md`. A stale file fails the test; one command rewrites them all:
//! `CUVISOR_REGENERATE=1 cargo test -p cuvisor-sim --test surface`. What counts as modelled is
//! read from the sources: a `fn cuName(` / `fn nvmlName(` in the crate outside the generated
//! stub file (the `export!` blocks).
//!
//! The C preprocessor (`cc -E`) lists the exported names: `cuda.h` with
//! `__CUDA_API_VERSION_INTERNAL` declares the current ABI of each function, its `_ptds`/`_ptsz`
//! forms and the old ABIs the library keeps for old binaries (what vosen/ZLUDA's
//! `zluda_bindgen` reads for the same purpose); `nvml.h` once as is and once with
//! `NVML_NO_UNVERSIONED_FUNC_DEFS` (its old unversioned names).
//!
//! And a C program built against cuda.h with `-lcuda` (tests/c/surface_link.c) links and runs,
//! calling entry points that used to be missing.
mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::path::{Path, PathBuf};
use std::process::Command;

// ---- where things are ---------------------------------------------------------------------------

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// nvcc 13.5's venv holds cuda.h and cudaTypedefs.h (the `nvidia-cuda-crt` wheel).
/// nvml.h: the newest `nvidia-nvml-dev` on PyPI when this was written (13.4.92; no 13.5 yet).
const NVML_WHEELS: &[(&str, &str)] = &[("nvidia-nvml-dev", "13.4.92")];

fn include_dir(test: &str, venv: &str, wheels: &[(&str, &str)], file: &str) -> Option<PathBuf> {
    use cuvisor_testkit::wheels::{venv as install, Deps};
    let v = install(test, venv, wheels, Deps::None)?;
    let found = std::fs::read_dir(v.join("lib"))
        .expect("venv/lib")
        .flatten()
        .map(|py| py.path().join("site-packages/nvidia/cu13/include"))
        .find(|p| p.join(file).exists());
    Some(found.unwrap_or_else(|| panic!("{file} in {}", v.display())))
}

fn cuda_include(test: &str) -> Option<PathBuf> {
    include_dir(
        test,
        "nvcc-13.5.37",
        cuvisor_testkit::wheels::NVCC_13_5,
        "cuda.h",
    )
}

fn nvml_include(test: &str) -> Option<PathBuf> {
    include_dir(test, "nvidia-nvml-dev-13.4.92", NVML_WHEELS, "nvml.h")
}

fn regenerate() -> bool {
    std::env::var_os("CUVISOR_REGENERATE").is_some()
}

/// A generated file: rewritten under CUVISOR_REGENERATE, else it must be what the headers give.
fn generated(rel: &str, want: &str) {
    let path = repo().join(rel);
    let have = std::fs::read_to_string(&path).unwrap_or_default();
    if have == want {
        return;
    }
    if regenerate() {
        std::fs::write(&path, want).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        eprintln!("regenerated {rel}");
        return;
    }
    let first = have
        .lines()
        .zip(want.lines())
        .position(|(a, b)| a != b)
        .unwrap_or_else(|| have.lines().count().min(want.lines().count()));
    panic!(
        "{rel} is stale (first difference at line {}: have {:?}, want {:?}); regenerate with \
         `CUVISOR_REGENERATE=1 cargo test -p cuvisor-sim --test surface`",
        first + 1,
        have.lines().nth(first),
        want.lines().nth(first)
    );
}

// ---- header parsing -----------------------------------------------------------------------------

/// `cc -E -P` of a header with the given defines.
fn preprocess(header: &Path, defines: &[&str]) -> String {
    let mut cmd = Command::new("cc");
    cmd.args(["-E", "-P", "-x", "c"]);
    for d in defines {
        cmd.arg(format!("-D{d}"));
    }
    let out = cmd.arg(header).output().expect("run cc -E");
    assert!(
        out.status.success(),
        "cc -E {}: {}",
        header.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8")
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// Names of the functions declared `RET name(` (RET: `CUresult`, `nvmlReturn_t`) with a name
/// starting with `prefix`.
fn declared(text: &str, ret: &str, prefix: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = text;
    while let Some(i) = rest.find(ret) {
        let before_ok = i == 0 || !rest[..i].ends_with(is_ident);
        rest = &rest[i + ret.len()..];
        if !before_ok || rest.starts_with(is_ident) {
            continue;
        }
        let t = rest.trim_start();
        let t = t.strip_prefix("DECLDIR").unwrap_or(t).trim_start();
        let t = t.strip_prefix("CUDAAPI").unwrap_or(t).trim_start();
        let name: String = t.chars().take_while(|&c| is_ident(c)).collect();
        if name.starts_with(prefix) && t[name.len()..].trim_start().starts_with('(') {
            out.insert(name);
        }
    }
    out
}

/// A `\defgroup` section of a header, ordered as in the header.
#[derive(Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
struct Chapter {
    pos: usize,
    id: String,
    title: String,
}

/// A chapter's modelled and stubbed symbols.
type Split<'a> = (Vec<&'a String>, Vec<&'a String>);

/// What a doc comment says of one declared function.
#[derive(Clone, Debug)]
struct Doc {
    /// The `\defgroup` the declaration sits in.
    chapter: Chapter,
    /// Codes its `\return` (`@return`) list names, e.g. `CUDA_ERROR_NOT_SUPPORTED`.
    returns: Vec<String>,
}

/// Doc comments followed by a declaration `RET name(`, by the name as written in the header.
fn docs(
    raw: &str,
    ret: &str,
    prefix: &str,
    group_tag: &str,
    code_prefix: &str,
) -> BTreeMap<String, Doc> {
    // The chapter in force at each point: groups nest (nvml.h's CPU and Memory Affinity sits
    // inside Device Queries); `@{` opens the group last defined, `@}` closes the innermost, and
    // a `@defgroup` on a closing line (`@} // @defgroup ...`) is a comment, not a group.
    let mut spans: Vec<(usize, Chapter)> = Vec::new();
    let mut stack: Vec<Chapter> = Vec::new();
    let mut defined: Option<Chapter> = None;
    let mut titles: BTreeMap<String, Chapter> = BTreeMap::new();
    let mut offset = 0;
    for line in raw.split_inclusive('\n') {
        let close = line.contains("@}");
        if let Some(i) = line.find(group_tag).filter(|_| !close) {
            let rest = line[i + group_tag.len()..].trim();
            let (id, title) = rest.split_once(' ').unwrap_or((rest, ""));
            let ch = Chapter {
                pos: offset,
                id: id.to_string(),
                title: title.trim().to_string(),
            };
            titles.entry(ch.id.clone()).or_insert_with(|| ch.clone());
            defined = Some(ch);
        }
        // `@addtogroup X` reopens a group defined before (nvml.h's accounting statistics).
        let add = group_tag.replace("defgroup", "addtogroup");
        if let Some(i) = line.find(&add).filter(|_| !close) {
            let id = line[i + add.len()..]
                .split_whitespace()
                .next()
                .unwrap_or("");
            defined = titles.get(id).cloned();
        }
        if line.contains("@{") {
            stack.push(
                defined
                    .take()
                    .unwrap_or_else(|| stack.last().cloned().unwrap_or_default()),
            );
            spans.push((offset, stack.last().cloned().unwrap_or_default()));
        }
        if close {
            stack.pop();
            let outside = Chapter {
                pos: usize::MAX - 2,
                id: "OUTSIDE".into(),
                title: "Declared outside any group".into(),
            };
            spans.push((offset, stack.last().cloned().unwrap_or(outside)));
        }
        offset += line.len();
    }
    let mut out = BTreeMap::new();
    let mut at = 0;
    while let Some(i) = raw[at..].find("/**") {
        let start = at + i;
        let Some(len) = raw[start..].find("*/") else {
            break;
        };
        let comment = &raw[start..start + len];
        at = start + len + 2;
        let decl_end = raw[at..].find([';', '{']).map_or(raw.len(), |e| at + e);
        let decl = &raw[at..decl_end];
        if decl.trim_start().starts_with("/*") || decl.contains("#define") {
            continue;
        }
        let names = declared(decl, ret, prefix);
        let Some(name) = names.into_iter().next() else {
            continue;
        };
        let chapter = spans
            .iter()
            .rev()
            .find(|g| g.0 < start)
            .map(|g| g.1.clone())
            .unwrap_or_default();
        // The first declaration is the documented one (cuda.h repeats some under
        // __CUDA_API_VERSION_INTERNAL).
        out.entry(name).or_insert(Doc {
            chapter,
            returns: return_list(comment, code_prefix),
        });
    }
    out
}

/// The codes of a doc comment's `\return` / `@return` paragraph.
fn return_list(comment: &str, code_prefix: &str) -> Vec<String> {
    let Some(i) = comment.find("\\return").or_else(|| comment.find("@return")) else {
        return Vec::new();
    };
    let mut codes = Vec::new();
    for (n, line) in comment[i + 7..].lines().enumerate() {
        let l = line.trim().trim_start_matches('*').trim();
        // The list ends at a blank line or the next command (`\\notefnerr`, `\\sa`, `@note`);
        // `\\ref`, `\\a`, `\\p` open items and continuation lines.
        let inline = ["\\ref", "\\a ", "\\p ", "\\e "]
            .iter()
            .any(|c| l.starts_with(c));
        if n > 0 && (l.is_empty() || (l.starts_with('\\') && !inline) || l.starts_with('@')) {
            break;
        }
        for tok in l.split(|c: char| !is_ident(c)) {
            if tok.starts_with(code_prefix)
                && !tok.ends_with('_')
                && !codes.iter().any(|c| c == tok)
            {
                codes.push(tok.to_string());
            }
        }
    }
    codes
}

/// `NAME = value` of an enum's members starting with `prefix` (`CUDA_ERROR_`, `NVML_ERROR_`).
fn enum_values(raw: &str, prefixes: &[&str]) -> BTreeMap<i64, String> {
    let mut out = BTreeMap::new();
    for line in raw.lines() {
        let l = line.trim();
        if !prefixes.iter().any(|p| l.starts_with(p)) {
            continue;
        }
        let Some((name, rest)) = l.split_once('=') else {
            continue;
        };
        let v: String = rest
            .trim()
            .chars()
            .take_while(|c| c.is_ascii_digit())
            .collect();
        if let Ok(v) = v.parse() {
            out.entry(v).or_insert_with(|| name.trim().to_string());
        }
    }
    out
}

/// A symbol less its `_ptds`/`_ptsz` suffix.
fn unthreaded(s: &str) -> &str {
    s.strip_suffix("_ptds")
        .or_else(|| s.strip_suffix("_ptsz"))
        .unwrap_or(s)
}

/// A symbol less its `_vN` and per-thread suffixes.
fn unversioned(s: &str) -> &str {
    let s = unthreaded(s);
    match s.rsplit_once("_v") {
        Some((b, n)) if !n.is_empty() && n.chars().all(|c| c.is_ascii_digit()) => b,
        _ => s,
    }
}

// ---- the CUDA driver's surface ------------------------------------------------------------------

/// One base name `cuGetProcAddress` resolves, as `cudaTypedefs.h` gives it.
#[derive(Clone, Debug, PartialEq)]
struct Proc {
    base: String,
    /// (first cudaVersion, symbol), ascending.
    versions: Vec<(u32, String)>,
    per_thread: Vec<(u32, String)>,
}

/// The resolvable names, from every `PFN_<base>_v<version>[_ptds|_ptsz]` typedef: the k-th
/// version (ascending) of a base is the symbol `base` (k = 1) or `base_vk`, and a per-thread
/// typedef at version v is the legacy symbol current at v plus its suffix. Checked against what
/// the real 13.0 driver's cuGetProcAddress_v2 answered (vosen/ZLUDA,
/// zluda_bindgen/src/process_table.rs): identical for all 477 bases both have.
fn proc_entries(typedefs: &[&str]) -> Vec<Proc> {
    let mut legacy: BTreeMap<String, BTreeSet<u32>> = BTreeMap::new();
    let mut threaded: BTreeMap<String, BTreeMap<u32, &'static str>> = BTreeMap::new();
    for text in typedefs {
        for line in text.lines() {
            let l = line.trim();
            let Some(i) = l.find("(CUDAAPI *PFN_") else {
                continue;
            };
            if !l.starts_with("typedef") {
                continue;
            }
            let name: String = l[i + 14..].chars().take_while(|&c| is_ident(c)).collect();
            let suffix = if name.ends_with("_ptds") {
                Some("_ptds")
            } else if name.ends_with("_ptsz") {
                Some("_ptsz")
            } else {
                None
            };
            let (base, v) = unthreaded(&name)
                .rsplit_once("_v")
                .expect("PFN_<base>_v<version>");
            let v: u32 = v.parse().expect("version");
            match suffix {
                Some(s) => {
                    threaded.entry(base.into()).or_default().insert(v, s);
                }
                None => {
                    legacy.entry(base.into()).or_default().insert(v);
                }
            }
        }
    }
    let mut out = Vec::new();
    for (base, vs) in &legacy {
        let versions: Vec<(u32, String)> = vs
            .iter()
            .enumerate()
            .map(|(k, &v)| {
                (
                    v,
                    if k == 0 {
                        base.clone()
                    } else {
                        format!("{base}_v{}", k + 1)
                    },
                )
            })
            .collect();
        let per_thread = threaded
            .get(base)
            .map(|t| {
                t.iter()
                    .map(|(&v, s)| {
                        let at = versions
                            .iter()
                            .rev()
                            .find(|x| x.0 <= v)
                            .unwrap_or(&versions[0]);
                        (v, format!("{}{s}", at.1))
                    })
                    .collect()
            })
            .unwrap_or_default();
        out.push(Proc {
            base: base.clone(),
            versions,
            per_thread,
        });
    }
    assert!(
        threaded.keys().all(|b| legacy.contains_key(b)),
        "a per-thread typedef without a legacy one"
    );
    out
}

/// Entry points outside cuda.h that the real libcuda.so.1 exports and resolves, kept from
/// before: the profiler's (`cudaProfilerTypedefs.h`; ZLUDA's table has them at 4000).
const EXTRA_HEADERS: &[&str] = &["cudaProfilerTypedefs.h"];

struct Cuda {
    /// Every exported name: cuda.h's declarations under `__CUDA_API_VERSION_INTERNAL`, and the
    /// symbols of [`EXTRA_HEADERS`]' typedefs.
    exports: BTreeSet<String>,
    /// Public declarations (what a program compiled against cuda.h calls).
    public: BTreeSet<String>,
    procs: Vec<Proc>,
    /// Doc of each exported name (the old ABIs and per-thread forms share their function's).
    docs: BTreeMap<String, Doc>,
    /// CUresult value -> name.
    codes: BTreeMap<i64, String>,
}

fn cuda_surface(inc: &Path) -> Cuda {
    let header = inc.join("cuda.h");
    let raw = std::fs::read_to_string(&header).expect("cuda.h");
    let internal = declared(
        &preprocess(&header, &["__CUDA_API_VERSION_INTERNAL"]),
        "CUresult",
        "cu",
    );
    let public = declared(&preprocess(&header, &[]), "CUresult", "cu");
    let mut typedef_texts =
        vec![std::fs::read_to_string(inc.join("cudaTypedefs.h")).expect("cudaTypedefs.h")];
    for h in EXTRA_HEADERS {
        typedef_texts
            .push(std::fs::read_to_string(inc.join(h)).unwrap_or_else(|e| panic!("{h}: {e}")));
    }
    let procs = proc_entries(&typedef_texts.iter().map(String::as_str).collect::<Vec<_>>());
    let mut exports = internal.clone();
    for p in &procs {
        for (_, s) in p.versions.iter().chain(&p.per_thread) {
            if !internal.contains(s) {
                assert!(
                    s.starts_with("cuProfiler"),
                    "{s}: named by cudaTypedefs.h, not declared by cuda.h under __CUDA_API_VERSION_INTERNAL"
                );
                exports.insert(s.clone());
            }
        }
    }
    // Docs by the name written in cuda.h, and by what that name expands to under
    // __CUDA_API_VERSION_INTERNAL (`#define cuMemAlloc cuMemAlloc_v2`).
    let by_source = docs(&raw, "CUresult", "cu", "\\defgroup ", "CUDA_");
    let mut expands: BTreeMap<String, String> = BTreeMap::new();
    for line in raw.lines() {
        let l = line.trim();
        let Some(def) = l.strip_prefix("#define") else {
            continue;
        };
        let mut it = def.split_whitespace();
        let (Some(from), Some(to)) = (it.next(), it.next()) else {
            continue;
        };
        if !from.starts_with("cu") || it.next().is_some() {
            continue;
        }
        let to = if let Some(x) = to.strip_prefix("__CUDA_API_PTDS(") {
            x.trim_end_matches(')').to_string()
        } else if let Some(x) = to.strip_prefix("__CUDA_API_PTSZ(") {
            x.trim_end_matches(')').to_string()
        } else {
            to.to_string()
        };
        if to.starts_with("cu") {
            expands.insert(to, from.to_string());
        }
    }
    let base_of: BTreeMap<&str, &str> = procs
        .iter()
        .flat_map(|p| {
            p.versions
                .iter()
                .chain(&p.per_thread)
                .map(move |(_, s)| (s.as_str(), p.base.as_str()))
        })
        .collect();
    let mut docs = BTreeMap::new();
    for e in &exports {
        let plain = unthreaded(e);
        let doc = by_source
            .get(plain)
            .or_else(|| expands.get(plain).and_then(|s| by_source.get(s)))
            .or_else(|| base_of.get(e.as_str()).and_then(|b| by_source.get(*b)))
            .or_else(|| by_source.get(unversioned(e)));
        match doc {
            Some(d) => {
                docs.insert(e.clone(), d.clone());
            }
            None => {
                // The profiler's (outside cuda.h) and the few cuda.h leaves undocumented
                // (cuGetExportTable).
                let (pos, id, title) = if e.starts_with("cuProfiler") {
                    (
                        usize::MAX - 1,
                        "CUDA_PROFILER",
                        "Profiler Control (cudaProfiler.h)",
                    )
                } else {
                    (usize::MAX, "UNDOCUMENTED", "Declared without a doc comment")
                };
                docs.insert(
                    e.clone(),
                    Doc {
                        chapter: Chapter {
                            pos,
                            id: id.into(),
                            title: title.into(),
                        },
                        returns: Vec::new(),
                    },
                );
            }
        }
    }
    Cuda {
        exports,
        public,
        procs,
        docs,
        codes: enum_values(&raw, &["CUDA_SUCCESS", "CUDA_ERROR_"]),
    }
}

/// The code a stub answers: CUDA_ERROR_NOT_SUPPORTED where its doc lists it; else the listed
/// code that best says "this driver cannot do that": NOT_PERMITTED, then INVALID_VALUE (the
/// arguments are not something this driver accepts), INVALID_HANDLE, INVALID_CONTEXT (the
/// deprecated context queries list nothing else), UNKNOWN. Functions no doc lists codes for
/// (the profiler's, outside cuda.h) answer NOT_SUPPORTED.
fn stub_code(doc: Option<&Doc>) -> (String, bool) {
    const PREFERENCE: &[&str] = &[
        "NOT_SUPPORTED",
        "NOT_PERMITTED",
        "INVALID_VALUE",
        "INVALID_HANDLE",
        "INVALID_CONTEXT",
        "UNKNOWN",
    ];
    let Some(d) = doc.filter(|d| !d.returns.is_empty()) else {
        return ("NOT_SUPPORTED".into(), false);
    };
    for p in PREFERENCE {
        if d.returns.iter().any(|r| r == &format!("CUDA_ERROR_{p}")) {
            return (p.to_string(), true);
        }
    }
    // A list without any of those (cuGraphExecUpdate: SUCCESS, GRAPH_EXEC_UPDATE_FAILURE): its
    // first error.
    match d.returns.iter().find_map(|r| r.strip_prefix("CUDA_ERROR_")) {
        Some(first) => (first.to_string(), true),
        None => ("NOT_SUPPORTED".into(), false),
    }
}

/// `fn <prefix>Name(` in the crate's sources, except the generated stub file: what is modelled.
fn modelled_in(src: &Path, skip: &str, prefix: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for f in std::fs::read_dir(src).expect("src").flatten() {
        let p = f.path();
        if p.extension().is_none_or(|e| e != "rs") || p.file_name().is_some_and(|n| n == skip) {
            continue;
        }
        let text = std::fs::read_to_string(&p).unwrap();
        let pat = format!("fn {prefix}");
        let mut rest = text.as_str();
        while let Some(i) = rest.find(&pat) {
            rest = &rest[i + 3..];
            let name: String = rest.chars().take_while(|&c| is_ident(c)).collect();
            if rest[name.len()..].trim_start().starts_with('(') {
                out.insert(name);
            }
        }
    }
    out
}

fn cuda_unsupported_rs(c: &Cuda, modelled: &BTreeSet<String>) -> String {
    let mut s = String::from(
        "//! Entry points of the real libcuda.so.1 that the simulator does not model. GENERATED by\n\
         //! `crates/sim/tests/surface.rs` from CUDA 13.5's cuda.h, cudaTypedefs.h and\n\
         //! cudaProfilerTypedefs.h: every exported name that no `export!` block of this crate\n\
         //! defines. Do not edit; after modelling a function run\n\
         //! `CUVISOR_REGENERATE=1 cargo test -p cuvisor-sim --test surface`.\n\
         //!\n\
         //! Each answers a code its function's doc comment in cuda.h lists under `\\return`:\n\
         //! CUDA_ERROR_NOT_SUPPORTED where listed; else the listed code that best says \"this driver\n\
         //! cannot do that\" (NOT_PERMITTED, INVALID_VALUE, INVALID_HANDLE, INVALID_CONTEXT, UNKNOWN\n\
         //! in this order; else the first listed error), with the list beside it. The profiler's\n\
         //! entry points (not in cuda.h) answer NOT_SUPPORTED. The C calling\n\
         //! convention lets a no-argument function stand in for any signature: the caller cleans up\n\
         //! its arguments, and nothing here reads them.\n\
         \n\
         use cuvisor_cuda_abi::cuda::CUresult;\n\
         use std::ffi::{c_char, CString};\n\
         use std::sync::OnceLock;\n\
         \n\
         macro_rules! unsupported {\n    \
             ($($name:ident => $code:ident,)*) => {\n        \
                 $(\n            \
                     #[no_mangle]\n            \
                     pub extern \"C\" fn $name() -> CUresult {\n                \
                         code::$code\n            \
                     }\n        \
                 )*\n        \
                 /// Every stub with the code it answers.\n        \
                 pub(crate) static UNSUPPORTED: &[(&str, CUresult)] = &[$((stringify!($name), code::$code)),*];\n    \
             };\n\
         }\n\
         \n\
         /// The stubs as text, `name code` a line: how tests tell stubs from modelled functions\n\
         /// without calling the modelled ones. Not a CUDA entry point.\n\
         #[no_mangle]\n\
         pub extern \"C\" fn cuvisorSimUnsupported() -> *const c_char {\n    \
             static TEXT: OnceLock<CString> = OnceLock::new();\n    \
             TEXT.get_or_init(|| {\n        \
                 let lines: Vec<String> = UNSUPPORTED.iter().map(|(n, c)| format!(\"{n} {c}\")).collect();\n        \
                 CString::new(lines.join(\"\\n\")).unwrap_or_default()\n    \
             })\n    \
             .as_ptr()\n\
         }\n\
         \n",
    );
    let stubs: Vec<(&String, (String, bool))> = c
        .exports
        .iter()
        .filter(|e| !modelled.contains(*e))
        .map(|e| (e, stub_code(c.docs.get(e))))
        .collect();
    let used: BTreeSet<&String> = stubs.iter().map(|(_, (code, _))| code).collect();
    s.push_str("/// The codes the stubs answer (`CUDA_ERROR_<name>`, values from cuda.h's `cudaError_enum`).\nmod code {\n    use cuvisor_cuda_abi::cuda::CUresult;\n");
    for u in used {
        let v = c
            .codes
            .iter()
            .find(|(_, n)| **n == format!("CUDA_ERROR_{u}"))
            .map(|(v, _)| *v)
            .unwrap_or_else(|| panic!("CUDA_ERROR_{u} is not in cudaError_enum"));
        s.push_str(&format!("    pub const {u}: CUresult = {v};\n"));
    }
    s.push_str("}\n\n#[rustfmt::skip]\nunsupported! {\n");
    for (e, (code, documented)) in &stubs {
        let doc = c.docs.get(*e);
        s.push_str(&format!("    {e} => {code},"));
        if *documented && code != "NOT_SUPPORTED" {
            let list: Vec<&str> = doc
                .unwrap()
                .returns
                .iter()
                .map(|r| {
                    r.trim_start_matches("CUDA_ERROR_")
                        .trim_start_matches("CUDA_")
                })
                .collect();
            s.push_str(&format!(" // documented: {}", list.join(" ")));
        }
        s.push('\n');
    }
    s.push_str("}\n");
    s
}

const PROC_BEGIN: &str =
    "    // ---- generated by crates/sim/tests/surface.rs from cudaTypedefs.h: do not edit ----\n";
const PROC_END: &str = "    // ---- end of the generated table ----\n";

fn proc_table_rs(c: &Cuda, current: &str) -> String {
    let (Some(b), Some(e)) = (current.find(PROC_BEGIN), current.find(PROC_END)) else {
        panic!("proc_table.rs: the generated block's markers are missing");
    };
    let list = |v: &[(u32, String)]| -> String {
        let items: Vec<String> = v.iter().map(|(n, s)| format!("({n}, \"{s}\")")).collect();
        format!("&[{}]", items.join(", "))
    };
    let mut s = String::new();
    for p in &c.procs {
        s.push_str(&format!(
            "    ProcEntry {{ base: \"{}\", versions: {}, per_thread: {} }},\n",
            p.base,
            list(&p.versions),
            list(&p.per_thread)
        ));
    }
    format!("{}{PROC_BEGIN}{s}{}", &current[..b], &current[e..])
}

// ---- NVML's surface ------------------------------------------------------------------------------

struct Nvml {
    exports: BTreeSet<String>,
    docs: BTreeMap<String, Doc>,
    codes: BTreeMap<i64, String>,
}

fn nvml_surface(inc: &Path) -> Nvml {
    let header = inc.join("nvml.h");
    let raw = std::fs::read_to_string(&header).expect("nvml.h");
    let mut exports = declared(&preprocess(&header, &[]), "nvmlReturn_t", "nvml");
    exports.extend(declared(
        &preprocess(&header, &["NVML_NO_UNVERSIONED_FUNC_DEFS"]),
        "nvmlReturn_t",
        "nvml",
    ));
    let by_source = docs(&raw, "nvmlReturn_t", "nvml", "@defgroup ", "NVML_");
    let mut expands = BTreeMap::new();
    for line in raw.lines() {
        let mut it = line.split_whitespace();
        if it.next() == Some("#define") {
            if let (Some(from), Some(to), None) = (it.next(), it.next(), it.next()) {
                if from.starts_with("nvml") && to.starts_with("nvml") {
                    expands.insert(to.to_string(), from.to_string());
                }
            }
        }
    }
    let mut docs = BTreeMap::new();
    for e in &exports {
        let doc = by_source
            .get(e)
            .or_else(|| expands.get(e).and_then(|s| by_source.get(s)))
            .or_else(|| by_source.get(unversioned(e)))
            .or_else(|| {
                // An old name (nvmlDeviceGetCount): the doc of the version it became.
                expands
                    .iter()
                    .find(|(to, _)| unversioned(to) == unversioned(e))
                    .and_then(|(to, from)| by_source.get(to).or_else(|| by_source.get(from)))
            });
        let d = doc.cloned().unwrap_or_else(|| Doc {
            chapter: Chapter {
                pos: usize::MAX,
                id: "UNDOCUMENTED".into(),
                title: "Declared without a doc comment".into(),
            },
            returns: Vec::new(),
        });
        docs.insert(e.clone(), d);
    }
    Nvml {
        exports,
        docs,
        codes: enum_values(&raw, &["NVML_SUCCESS", "NVML_ERROR_"]),
    }
}

/// NVML_ERROR_NOT_SUPPORTED where the doc lists it (nearly all do); else, in order, the listed
/// FUNCTION_NOT_FOUND, NO_PERMISSION, UNKNOWN, INVALID_ARGUMENT (never UNINITIALIZED, which
/// would send a caller back to nvmlInit, nor INSUFFICIENT_SIZE, which invites a retry with a
/// larger buffer), else the first listed error. A function without a doc answers NOT_SUPPORTED.
fn nvml_stub_code(doc: Option<&Doc>) -> String {
    const PREFERENCE: &[&str] = &[
        "NOT_SUPPORTED",
        "FUNCTION_NOT_FOUND",
        "NO_PERMISSION",
        "UNKNOWN",
        "INVALID_ARGUMENT",
    ];
    let Some(d) = doc.filter(|d| !d.returns.is_empty()) else {
        return "NOT_SUPPORTED".into();
    };
    PREFERENCE
        .iter()
        .find(|p| d.returns.iter().any(|r| r == &format!("NVML_ERROR_{p}")))
        .map(|p| p.to_string())
        .or_else(|| {
            d.returns
                .iter()
                .find_map(|r| r.strip_prefix("NVML_ERROR_"))
                .map(String::from)
        })
        // A list of NVML_SUCCESS alone documents no failure: the code any client handles.
        .unwrap_or_else(|| "NOT_SUPPORTED".into())
}

fn nvml_stubs_rs(n: &Nvml, modelled: &BTreeSet<String>) -> String {
    let mut s = String::from(
        "//! Entry points of the real NVML that the simulator does not model. GENERATED by\n\
         //! `crates/sim/tests/surface.rs` from nvml.h (nvidia-nvml-dev 13.4.92): every function it\n\
         //! declares, under its versioned and old unversioned names, that no `export!` block of this\n\
         //! crate defines. Do not edit; after modelling a function run\n\
         //! `CUVISOR_REGENERATE=1 cargo test -p cuvisor-sim --test surface`.\n\
         //!\n\
         //! Each answers NVML_ERROR_NOT_SUPPORTED (what a real driver says of a feature the GPU\n\
         //! lacks, which every NVML client handles) where its doc comment's `@return` list has it;\n\
         //! else the listed FUNCTION_NOT_FOUND, NO_PERMISSION, UNKNOWN or INVALID_ARGUMENT, else\n\
         //! the first listed\n\
         //! error. The C calling convention\n\
         //! lets a no-argument function stand in for any signature: the caller cleans up its\n\
         //! arguments, and nothing here reads them.\n\
         \n\
         use cuvisor_cuda_abi::nvml::nvmlReturn_t;\n\
         use std::ffi::{c_char, CString};\n\
         use std::sync::OnceLock;\n\
         \n\
         macro_rules! unsupported {\n    \
             ($($name:ident => $code:ident,)*) => {\n        \
                 $(\n            \
                     #[no_mangle]\n            \
                     pub extern \"C\" fn $name() -> nvmlReturn_t {\n                \
                         code::$code\n            \
                     }\n        \
                 )*\n        \
                 /// Every stub with the code it answers.\n        \
                 pub(crate) static UNSUPPORTED: &[(&str, nvmlReturn_t)] = &[$((stringify!($name), code::$code)),*];\n    \
             };\n\
         }\n\
         \n\
         /// The stubs as text, `name code` a line, for tests. Not an NVML entry point.\n\
         #[no_mangle]\n\
         pub extern \"C\" fn cuvisorSimNvmlUnsupported() -> *const c_char {\n    \
             static TEXT: OnceLock<CString> = OnceLock::new();\n    \
             TEXT.get_or_init(|| {\n        \
                 let lines: Vec<String> = UNSUPPORTED.iter().map(|(n, c)| format!(\"{n} {c}\")).collect();\n        \
                 CString::new(lines.join(\"\\n\")).unwrap_or_default()\n    \
             })\n    \
             .as_ptr()\n\
         }\n\
         \n",
    );
    let stubs: Vec<(&String, String)> = n
        .exports
        .iter()
        .filter(|e| !modelled.contains(*e))
        .map(|e| (e, nvml_stub_code(n.docs.get(e))))
        .collect();
    let used: BTreeSet<&String> = stubs.iter().map(|(_, c)| c).collect();
    s.push_str("/// The codes the stubs answer (`NVML_ERROR_<name>`, values from nvml.h's `nvmlReturn_t`).\nmod code {\n    use cuvisor_cuda_abi::nvml::nvmlReturn_t;\n");
    for u in used {
        let v = n
            .codes
            .iter()
            .find(|(_, name)| **name == format!("NVML_ERROR_{u}"))
            .map(|(v, _)| *v)
            .unwrap_or_else(|| panic!("NVML_ERROR_{u} is not in nvmlReturn_t"));
        s.push_str(&format!("    pub const {u}: nvmlReturn_t = {v};\n"));
    }
    s.push_str("}\n\n#[rustfmt::skip]\nunsupported! {\n");
    for (e, code) in &stubs {
        s.push_str(&format!("    {e} => {code},\n"));
    }
    s.push_str("}\n");
    s
}

// ---- the table ------------------------------------------------------------------------------------

fn surface_md(
    c: &Cuda,
    cuda_modelled: &BTreeSet<String>,
    n: &Nvml,
    nvml_modelled: &BTreeSet<String>,
) -> String {
    let mut s = String::from(
        "# The simulated driver's surface\n\n\
         GENERATED by `crates/sim/tests/surface.rs` from CUDA 13.5's `cuda.h` (PyPI `nvidia-cuda-crt`\n\
         13.5.37) and `nvml.h` (`nvidia-nvml-dev` 13.4.92), and checked by it: the test fails when this\n\
         file is stale. Regenerate with `CUVISOR_REGENERATE=1 cargo test -p cuvisor-sim --test surface`.\n\n\
         Every function the headers declare is exported by the simulated `libcuda.so.1` /\n\
         `libnvidia-ml.so.1` under the names the real libraries export (the current ABI, the old ABIs\n\
         kept for old binaries, the `_ptds`/`_ptsz` per-thread forms), and every driver base name\n\
         resolves through `cuGetProcAddress_v2` at the versions `cudaTypedefs.h` gives. A symbol is\n\
         *modelled* (the simulator implements it: see [simulator.md](simulator.md)) or a *stub* that\n\
         answers, whatever its arguments, the code in the table: one its doc comment lists.\n\
         Chapters are cuda.h's `\\defgroup` sections (nvml.h's for NVML); counts are exported symbols.\n\n\
         Entry points new after CUDA 13.0 resolve only where the machine file reports a newer driver\n\
         (`driver_version = 13050`); the default model reports 13.0, as R580 drivers do, and\n\
         `cuGetProcAddress` answers CUDA_ERROR_INVALID_VALUE above the driver's version.\n\n",
    );
    let mut chapters: BTreeMap<Chapter, Split> = BTreeMap::new();
    for e in &c.exports {
        let ch = c.docs.get(e).map(|d| d.chapter.clone()).unwrap_or_default();
        let slot = chapters.entry(ch).or_default();
        if cuda_modelled.contains(e) {
            slot.0.push(e);
        } else {
            slot.1.push(e);
        }
    }
    let (m, t): (usize, usize) = chapters
        .values()
        .fold((0, 0), |a, v| (a.0 + v.0.len(), a.1 + v.1.len()));
    s.push_str(&format!(
        "## CUDA driver API\n\n{} functions declared in cuda.h; {} exported symbols: {m} modelled, {t} stubs.\n\n\
         | chapter | modelled | stubs |\n|---|---:|---:|\n",
        c.public.len(),
        c.exports.len()
    ));
    for (ch, (md, st)) in &chapters {
        s.push_str(&format!(
            "| {} (`{}`) | {} | {} |\n",
            ch.title,
            ch.id,
            md.len(),
            st.len()
        ));
    }
    for (ch, (md, st)) in &chapters {
        if !s.ends_with("\n\n") {
            s.push('\n');
        }
        s.push_str(&format!("### {} (`{}`)\n\n", ch.title, ch.id));
        if !md.is_empty() {
            let names: Vec<String> = md.iter().map(|x| format!("`{x}`")).collect();
            s.push_str(&format!("Modelled: {}.\n\n", names.join(", ")));
        }
        if !st.is_empty() {
            s.push_str("| stub | answers |\n|---|---|\n");
            for x in st {
                let (code, _) = stub_code(c.docs.get(*x));
                s.push_str(&format!("| `{x}` | CUDA_ERROR_{code} |\n"));
            }
        }
    }
    let mut chapters: BTreeMap<Chapter, (usize, Vec<&String>)> = BTreeMap::new();
    for e in &n.exports {
        let ch = n.docs.get(e).map(|d| d.chapter.clone()).unwrap_or_default();
        let slot = chapters.entry(ch).or_default();
        if nvml_modelled.contains(e) {
            slot.0 += 1;
        } else {
            slot.1.push(e);
        }
    }
    let (m, t): (usize, usize) = chapters
        .values()
        .fold((0, 0), |a, v| (a.0 + v.0, a.1 + v.1.len()));
    s.push_str(&format!(
        "\n## NVML\n\n{} exported symbols: {m} modelled, {t} stubs.\n\n| chapter | modelled | stubs |\n|---|---:|---:|\n",
        n.exports.len()
    ));
    for (ch, (md, st)) in &chapters {
        s.push_str(&format!(
            "| {} (`{}`) | {md} | {} |\n",
            ch.title,
            ch.id,
            st.len()
        ));
    }
    s.push_str("\nStubs answering something other than NVML_ERROR_NOT_SUPPORTED:\n\n");
    let mut any = false;
    for (_, st) in chapters.values() {
        for x in st {
            let code = nvml_stub_code(n.docs.get(*x));
            if code != "NOT_SUPPORTED" {
                any = true;
                s.push_str(&format!("- `{x}`: NVML_ERROR_{code}\n"));
            }
        }
    }
    if !any {
        s.push_str("none.\n");
    }
    s
}

// ---- the checks ---------------------------------------------------------------------------------

struct Surfaces {
    cuda: Cuda,
    cuda_modelled: BTreeSet<String>,
    nvml: Nvml,
    nvml_modelled: BTreeSet<String>,
}

/// Parses both headers, (re)generates or checks the generated files (once per test process),
/// and returns both surfaces; None where a header cannot be had (after a SKIPPED line).
fn surfaces(test: &str) -> Option<&'static Surfaces> {
    static ONCE: std::sync::OnceLock<Option<Surfaces>> = std::sync::OnceLock::new();
    ONCE.get_or_init(|| {
        let cinc = cuda_include(test)?;
        let ninc = nvml_include(test)?;
        let c = cuda_surface(&cinc);
        let n = nvml_surface(&ninc);
        let root = repo();
        let cm = modelled_in(&root.join("crates/sim/cuda/src"), "unsupported.rs", "cu");
        let nm = modelled_in(&root.join("crates/sim/nvml/src"), "stubs.rs", "nvml");
        let cm: BTreeSet<String> = cm.into_iter().filter(|x| c.exports.contains(x)).collect();
        let nm: BTreeSet<String> = nm.into_iter().filter(|x| n.exports.contains(x)).collect();
        generated(
            "crates/sim/cuda/src/unsupported.rs",
            &cuda_unsupported_rs(&c, &cm),
        );
        let pt = std::fs::read_to_string(root.join("crates/sim/cuda/src/proc_table.rs")).unwrap();
        generated("crates/sim/cuda/src/proc_table.rs", &proc_table_rs(&c, &pt));
        generated("crates/sim/nvml/src/stubs.rs", &nvml_stubs_rs(&n, &nm));
        generated("docs/driver-surface.md", &surface_md(&c, &cm, &n, &nm));
        Some(Surfaces {
            cuda: c,
            cuda_modelled: cm,
            nvml: n,
            nvml_modelled: nm,
        })
    })
    .as_ref()
}

/// Opens a built simulated library.
fn open(lib: &Path) -> *mut c_void {
    let p = CString::new(lib.to_str().unwrap()).unwrap();
    // SAFETY: a NUL-terminated path; the library's initialisers run no simulator code.
    let h = unsafe { libc::dlopen(p.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    assert!(!h.is_null(), "dlopen {}", lib.display());
    h
}

fn sym(h: *mut c_void, name: &str) -> *mut c_void {
    let n = CString::new(name).unwrap();
    // SAFETY: a live handle and a NUL-terminated name.
    unsafe { libc::dlsym(h, n.as_ptr()) }
}

/// The `name code` lines an introspection symbol returns.
/// None when the symbol is missing (a problem, reported beside the others).
fn stubs_of(h: *mut c_void, introspect: &str, problems: &mut Vec<String>) -> BTreeMap<String, i64> {
    let f = sym(h, introspect);
    if f.is_null() {
        problems.push(format!("{introspect} is not exported: no stub table"));
        return BTreeMap::new();
    }
    // SAFETY: the library's own introspection function: no arguments, a static C string.
    let text = unsafe {
        let f: extern "C" fn() -> *const c_char = std::mem::transmute(f);
        CStr::from_ptr(f()).to_string_lossy().into_owned()
    };
    text.lines()
        .filter_map(|l| l.split_once(' '))
        .map(|(n, c)| (n.to_string(), c.parse().expect("code")))
        .collect()
}

/// Calls a stub, which reads no arguments.
fn call_stub(p: *mut c_void) -> i64 {
    // SAFETY: a stub of the simulated library: `extern "C" fn() -> int`, reads no arguments.
    let f: extern "C" fn() -> c_int = unsafe { std::mem::transmute(p) };
    i64::from(f())
}

#[test]
fn every_cuda_h_function_is_exported_resolvable_and_modelled_or_documented() {
    let test = "every_cuda_h_function_is_exported_resolvable_and_modelled_or_documented";
    if common::is_child() {
        return cuda_child();
    }
    let Some(all) = surfaces(test) else { return };
    let (c, modelled) = (&all.cuda, &all.cuda_modelled);
    assert!(
        c.public.len() > 450 && c.exports.len() > 650,
        "parsed too little of cuda.h"
    );
    // A driver that reports CUDA 13.5, so that entry points new in 13.1-13.5 resolve too.
    let model = std::env::temp_dir().join(format!("cuvisor-surface-{}.toml", std::process::id()));
    std::fs::write(
        &model,
        "driver_version = 13050\n[[device]]\nmemory = \"16Gi\"\n",
    )
    .unwrap();
    let out = common::Child::new(test)
        .preset(model.to_str().unwrap())
        .env("CUVISOR_SURFACE_MODELLED", &modelled.len().to_string())
        .command()
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&model);
    let so = String::from_utf8_lossy(&out.stdout);
    let se = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && so.contains("SURFACE OK"),
        "{so}\n{se}"
    );
}

fn cuda_child() {
    let inc = cuda_include("cuda child").expect("installed by the parent");
    let c = cuda_surface(&inc);
    let h = open(&common::sim_dir().join("libcuda.so.1"));
    let mut problems = Vec::new();
    // Exported under every real name.
    let missing: Vec<&String> = c.exports.iter().filter(|e| sym(h, e).is_null()).collect();
    if !missing.is_empty() {
        problems.push(format!(
            "{} of {} names not exported, first: {:?}",
            missing.len(),
            c.exports.len(),
            &missing[..missing.len().min(20)]
        ));
    }
    // Stubs answer a documented code; the rest are modelled.
    let stubs = stubs_of(h, "cuvisorSimUnsupported", &mut problems);
    for (name, code) in &stubs {
        let p = sym(h, name);
        let got = if p.is_null() { -1 } else { call_stub(p) };
        if got != *code {
            problems.push(format!("stub {name} answers {got}, its table says {code}"));
        }
        let cname = c.codes.get(code).cloned().unwrap_or_default();
        match c.docs.get(name) {
            Some(d) if d.returns.iter().any(|r| r.starts_with("CUDA_ERROR_")) => {
                if !d.returns.contains(&cname) {
                    problems.push(format!(
                        "stub {name} answers {cname}, not in its \\return list {:?}",
                        d.returns
                    ));
                }
            }
            _ => {
                if !c.exports.contains(name) {
                    problems.push(format!("stub {name} is not an entry point of the headers"));
                }
            }
        }
    }
    let modelled = c.exports.iter().filter(|e| !stubs.contains_key(*e)).count();
    let want: usize = std::env::var("CUVISOR_SURFACE_MODELLED")
        .unwrap()
        .parse()
        .unwrap();
    if modelled != want {
        problems.push(format!(
            "{modelled} exported names are not stubs, the sources define {want}: unsupported.rs is stale"
        ));
    }
    // Resolvable at the versions the headers give: each version answers its symbol, the one
    // before it the previous symbol (or VERSION_NOT_SUFFICIENT below the first), legacy and
    // per-thread.
    type Gpa = extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64, *mut c_int) -> c_int;
    let gpa = sym(h, "cuGetProcAddress_v2");
    assert!(!gpa.is_null(), "cuGetProcAddress_v2 is not exported");
    // SAFETY: cuGetProcAddress_v2 has this signature (cuda.h).
    let gpa: Gpa = unsafe { std::mem::transmute(gpa) };
    let init = sym(h, "cuInit");
    // SAFETY: cuInit(unsigned int) -> CUresult.
    let init: extern "C" fn(u32) -> c_int = unsafe { std::mem::transmute(init) };
    assert_eq!(init(0), 0, "cuInit");
    let mut unresolved = 0;
    for p in &c.procs {
        let base = CString::new(p.base.as_str()).unwrap();
        let lists: [(&[(u32, String)], u64); 3] = [
            (&p.versions, 0),
            (&p.versions, 1),
            (
                if p.per_thread.is_empty() {
                    &p.versions
                } else {
                    &p.per_thread
                },
                2,
            ),
        ];
        for (list, flags) in lists {
            for (k, (v, s)) in list.iter().enumerate() {
                for (at, want) in [
                    (*v as c_int, Some(s)),
                    (*v as c_int - 10, k.checked_sub(1).map(|j| &list[j].1)),
                ] {
                    let (mut pfn, mut status) = (std::ptr::null_mut(), -1);
                    let r = gpa(base.as_ptr(), &mut pfn, at, flags, &mut status);
                    let ok = match want {
                        Some(w) => r == 0 && status == 0 && pfn == sym(h, w) && !pfn.is_null(),
                        None => r == 500 && status == 2 && pfn.is_null(),
                    };
                    if !ok {
                        unresolved += 1;
                        if unresolved <= 40 {
                            problems.push(format!(
                                "cuGetProcAddress_v2({}, {at}, flags {flags}) = {r}, status {status}: want {want:?}",
                                p.base
                            ));
                        }
                    }
                }
            }
        }
    }
    if unresolved > 0 {
        problems.push(format!(
            "{unresolved} cuGetProcAddress_v2 answers wrong in all"
        ));
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    println!(
        "SURFACE OK: {} names exported, {} base names resolved, {modelled} modelled, {} stubs",
        c.exports.len(),
        c.procs.len(),
        stubs.len()
    );
}

#[test]
fn every_nvml_h_function_is_exported_and_modelled_or_documented() {
    let test = "every_nvml_h_function_is_exported_and_modelled_or_documented";
    let Some(all) = surfaces(test) else { return };
    let (n, modelled) = (&all.nvml, &all.nvml_modelled);
    assert!(n.exports.len() > 350, "parsed too little of nvml.h");
    let h = open(&common::sim_dir().join("libnvidia-ml.so.1"));
    let mut problems = Vec::new();
    let missing: Vec<&String> = n.exports.iter().filter(|e| sym(h, e).is_null()).collect();
    if !missing.is_empty() {
        problems.push(format!(
            "{} of {} names not exported, first: {:?}",
            missing.len(),
            n.exports.len(),
            &missing[..missing.len().min(20)]
        ));
    }
    let stubs = stubs_of(h, "cuvisorSimNvmlUnsupported", &mut problems);
    for (name, code) in &stubs {
        let p = sym(h, name);
        let got = if p.is_null() { -1 } else { call_stub(p) };
        if got != *code {
            problems.push(format!("stub {name} answers {got}, its table says {code}"));
        }
        let cname = n.codes.get(code).cloned().unwrap_or_default();
        match n.docs.get(name) {
            Some(d)
                if d.returns.iter().any(|r| r.starts_with("NVML_ERROR_"))
                    && !d.returns.contains(&cname) =>
            {
                problems.push(format!(
                    "stub {name} answers {cname}, not in its @return list {:?}",
                    d.returns
                ));
            }
            _ if !n.exports.contains(name) => {
                problems.push(format!("stub {name} is not in nvml.h"))
            }
            _ => {}
        }
    }
    let not_stubs = n.exports.iter().filter(|e| !stubs.contains_key(*e)).count();
    if not_stubs != modelled.len() {
        problems.push(format!(
            "{not_stubs} exported names are not stubs, the sources define {}: stubs.rs is stale",
            modelled.len()
        ));
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// A C program compiled against CUDA 13.5's cuda.h and linked with `-lcuda` that calls entry
/// points the simulator did not export before (cuOccupancyMaxPotentialBlockSize,
/// cuMemGetAllocationPropertiesFromHandle, ...: such a program did not link): it links, runs,
/// and each call answers its stub's code, or an error where it is modelled (tests/c/surface_link.c).
#[test]
fn a_program_linked_with_lcuda_against_cuda_h_links_and_runs() {
    let test = "a_program_linked_with_lcuda_against_cuda_h_links_and_runs";
    let Some(inc) = cuda_include(test) else {
        return;
    };
    let dir = common::sim_dir();
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/c/surface_link.c");
    let exe = std::env::temp_dir().join(format!("cuvisor-surface-link-{}", std::process::id()));
    let cc = Command::new("cc")
        .args(["-O1", "-Wall", "-Werror", "-I"])
        .arg(&inc)
        .arg("-o")
        .arg(&exe)
        .arg(&src)
        .arg("-L")
        .arg(&dir)
        .arg("-lcuda")
        .output()
        .expect("run cc");
    assert!(
        cc.status.success(),
        "cc {}: {}",
        src.display(),
        String::from_utf8_lossy(&cc.stderr)
    );
    let state = common::state_file("surface-link");
    let mut cmd = Command::new(&exe);
    common::sim_env(&mut cmd, "single", &state);
    let out = cmd.output().unwrap();
    let _ = std::fs::remove_file(&exe);
    let _ = std::fs::remove_file(&state);
    let so = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && so.contains("surface_link: ok"),
        "{so}{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
