//! End to end: real processes run under LD_PRELOAD=libcuvisor.so on the simulated GPU, and what
//! they see (quota, memory info, which function a lookup returns, what is printed) is checked from
//! outside — from the process's own output, the simulator, or the container ledger.
//!
//! C clients live in tests/c/; Rust clients are tests of this binary re-run in a child process
//! (the `child` pattern of tests/common), using cudarc's raw driver bindings.
mod common;

use common::*;
use cu::CUresult::{self as R, *};
use cudarc::driver::sys as cu;
use std::ffi::c_void;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::ptr::null_mut;

// ---- running things -----------------------------------------------------------------------------

/// A command for `exe` on preset `single` with its own simulator state, under cuvisor.
fn under_cuvisor(exe: &Path, tag: &str, ledger: &Path, limit: Option<&str>) -> Command {
    under_cuvisor_on(exe, "single", tag, ledger, limit)
}

/// As [`under_cuvisor`], on the simulated machine `model` (a preset or a machine file).
fn under_cuvisor_on(
    exe: &Path,
    model: &str,
    tag: &str,
    ledger: &Path,
    limit: Option<&str>,
) -> Command {
    let mut cmd = Command::new(exe);
    sim_env(&mut cmd, model, &state_file(tag));
    cuvisor_env(&mut cmd, ledger, limit);
    cmd
}

/// Test `name` of this binary, re-run in a child on the simulator under cuvisor.
fn child(name: &str, ledger: &Path, limit: Option<&str>) -> Command {
    let mut cmd = Child::new(name).command();
    cuvisor_env(&mut cmd, ledger, limit);
    cmd
}

struct Out {
    stdout: String,
    stderr: String,
    ok: bool,
    status: std::process::ExitStatus,
}

fn run(cmd: &mut Command) -> Out {
    let o: Output = cmd.output().expect("spawn");
    Out {
        stdout: String::from_utf8_lossy(&o.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
        ok: o.status.success(),
        status: o.status,
    }
}

impl Out {
    /// Asserts a clean exit, showing everything the process printed if not.
    fn success(self) -> Out {
        assert!(self.ok, "{self}");
        self
    }
    /// Asserts a child test passed (its own assertions ran and held).
    fn passed(self) -> Out {
        assert!(self.ok && self.stdout.contains("1 passed"), "{self}");
        self
    }
    /// The lines cuvisor printed (everything on stderr starting "cuvisor: ").
    fn cuvisor_lines(&self) -> Vec<&str> {
        self.stderr
            .lines()
            .filter(|l| l.starts_with("cuvisor: "))
            .collect()
    }
    /// The number after `key ` on the first line starting with `prefix` (in a child test,
    /// after libtest's "test NAME ... ").
    fn number(&self, prefix: &str, key: &str) -> u64 {
        let line = self
            .stdout
            .lines()
            .map(|l| l.split_once(" ... ").map_or(l, |(_, rest)| rest))
            .find(|l| l.starts_with(prefix))
            .unwrap_or_else(|| panic!("no line {prefix:?}\n{self}"));
        field(line, key).unwrap_or_else(|| panic!("no {key:?} in {line:?}"))
    }
}

impl std::fmt::Display for Out {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "status {:?}\n--- stdout\n{}\n--- stderr\n{}",
            self.status, self.stdout, self.stderr
        )
    }
}

/// The number after the word `key` in `line` ("total 1073741824 stopped 2" -> total = 1073741824).
fn field(line: &str, key: &str) -> Option<u64> {
    let mut words = line.split_whitespace();
    words.find(|w| *w == key)?;
    words.next()?.parse().ok()
}

const MIB64: u64 = 64 * MIB;

// ---- 1. four client styles, one quota ------------------------------------------------------------

#[test]
fn four_client_styles_hit_the_quota_at_the_same_point() {
    let sim = sim_dir();
    let linked = compile_c_variant(
        "quota_clients",
        "-linked",
        &["-DLINKED", "-L", sim.to_str().unwrap(), "-lcuda"],
    );
    let loaded = compile_c_variant("quota_clients", "-dl", &["-ldl"]);
    let quota = GIB;
    let expected = quota / MIB64 * MIB64;
    let mut totals = Vec::new();
    for (exe, mode) in [
        (&linked, "link"),
        (&loaded, "dlsym"),
        (&loaded, "gpa"),
        (&loaded, "gpa_pt"),
    ] {
        let ledger = ledger_dir(&format!("styles-{mode}"));
        let out = run(
            under_cuvisor(exe, &format!("styles-{mode}"), &ledger, Some("1Gi")).args([mode, "64"]),
        )
        .success();
        assert!(out.stdout.contains("sync after-free OK"), "{mode}: {out}");
        // Whichever way it was reached, the allocation entry point was cuvisor's wrapper.
        let how = match mode {
            "link" => "linked cuMemAlloc_v2",
            "dlsym" => "dlsym cuMemAlloc_v2",
            "gpa" => "cuMemAlloc@12000/0",
            _ => "cuMemAlloc@12000/2",
        };
        let want = format!("resolved {how} -> cuMemAlloc_v2 in libcuvisor");
        assert!(out.stdout.contains(&want), "{mode}: {want:?}\n{out}");
        let total = out.number("sync total", "total");
        assert_eq!(
            total, expected,
            "{mode}: the quota binds at floor(quota / 64 MiB) chunks\n{out}"
        );
        assert_eq!(
            out.number("start free", "total"),
            quota,
            "{mode}: cuMemGetInfo shows the quota"
        );
        if mode.starts_with("gpa") {
            // cuMemAllocAsync (and its _ptsz form with the per-thread flag) stop at the same point.
            assert_eq!(
                out.number("async total", "total"),
                expected,
                "{mode}: stream-ordered\n{out}"
            );
            assert!(out.stdout.contains("async after-free OK"), "{mode}: {out}");
        }
        assert!(
            out.cuvisor_lines().iter().all(|l| l.contains("refused")),
            "{mode}: only refusals on stderr\n{out}"
        );
        assert_eq!(
            ledger_used(&ledger),
            vec![0],
            "{mode}: everything given back"
        );
        totals.push((mode, total));
    }
    assert!(totals.iter().all(|(_, t)| *t == expected), "{totals:?}");
}

#[test]
fn cu_get_proc_address_returns_our_export_of_exactly_the_versioned_symbol() {
    // The pointers' identities (dladdr: library and exported name) are checked inside the
    // client; here: every expectation was reached, for both flag values.
    let loaded = compile_c_variant("quota_clients", "-dl2", &["-ldl"]);
    for mode in ["gpa", "gpa_pt"] {
        let ledger = ledger_dir(&format!("gpa-ids-{mode}"));
        let out = run(
            under_cuvisor(&loaded, &format!("gpa-ids-{mode}"), &ledger, Some("1Gi"))
                .args([mode, "256"]),
        )
        .success();
        let flags = if mode == "gpa" { 0 } else { 2 };
        for want in [
            format!("cuMemAlloc@12000/{flags} -> cuMemAlloc_v2 in libcuvisor"),
            "cuMemAlloc@2000/0 -> cuMemAlloc in libcuvisor".to_string(),
            format!("cuGetProcAddress@12000/{flags} -> cuGetProcAddress_v2 in libcuvisor"),
            format!("cuInit@12000/{flags} -> cuInit in libcuda.so"),
            format!(
                "cuMemAllocAsync@12000/{flags} -> {} in libcuvisor",
                if flags == 2 {
                    "cuMemAllocAsync_ptsz"
                } else {
                    "cuMemAllocAsync"
                }
            ),
        ] {
            assert!(
                out.stdout.contains(&format!("resolved {want}")),
                "{mode}: missing {want:?}\n{out}"
            );
        }
    }
}

// ---- 2. memory info agrees everywhere ------------------------------------------------------------

/// Runs tests/c/meminfo.c with `ops` under `limit`; returns the parsed reports.
fn meminfo_reports(model: &str, tag: &str, limit: &str, ops: &[&str]) -> Vec<Report> {
    let exe = compile_c_variant("meminfo", tag, &["-ldl"]);
    let ledger = ledger_dir(tag);
    let out = run(under_cuvisor_on(&exe, model, tag, &ledger, Some(limit)).args(ops)).success();
    let reports: Vec<Report> = out
        .stdout
        .lines()
        .filter(|l| l.starts_with("report"))
        .map(Report::parse)
        .collect();
    assert_eq!(reports.len(), ops.len() + 1, "{out}");
    reports
}

#[derive(Debug)]
struct Report {
    mine: u64,
    cu_free: u64,
    cu_total: u64,
    dev_total: u64,
    nvml_total: u64,
    nvml_free: u64,
    nvml_used: u64,
    nvml2_total: u64,
    nvml2_free: u64,
    nvml2_used: u64,
}

impl Report {
    fn parse(l: &str) -> Report {
        let f = |k: &str| field(l, k).unwrap_or_else(|| panic!("no {k} in {l:?}"));
        Report {
            mine: f("mine"),
            cu_free: f("cu_free"),
            cu_total: f("cu_total"),
            dev_total: f("dev_total"),
            nvml_total: f("nvml_total"),
            nvml_free: f("nvml_free"),
            nvml_used: f("nvml_used"),
            nvml2_total: f("nvml2_total"),
            nvml2_free: f("nvml2_free"),
            nvml2_used: f("nvml2_used"),
        }
    }
    fn check(&self, total: u64) {
        let r = self;
        assert_eq!(
            [r.cu_total, r.dev_total, r.nvml_total, r.nvml2_total],
            [total; 4],
            "totals: {r:?}"
        );
        let free = total - r.mine;
        assert_eq!(
            [r.cu_free, r.nvml_free, r.nvml2_free],
            [free; 3],
            "free = total - used: {r:?}"
        );
        assert_eq!([r.nvml_used, r.nvml2_used], [r.mine; 2], "used: {r:?}");
    }
}

#[test]
fn mem_get_info_total_mem_and_nvml_agree_at_every_step() {
    let ops = ["+1024", "+2048", "+512", "-1", "+1536", "-0", "-2", "-3"];
    let reports = meminfo_reports("single", "meminfo-6g", "6Gi", &ops);
    for r in &reports {
        r.check(6 * GIB);
    }
    let mine: Vec<u64> = reports.iter().map(|r| r.mine / MIB).collect();
    assert_eq!(
        mine,
        [0, 1024, 3072, 3584, 1536, 3072, 2048, 1536, 0],
        "the steps happened"
    );
}

#[test]
fn a_quota_above_the_device_shows_the_physical_memory() {
    // The physical numbers show through here, and libcuvisor does not count the context's own
    // memory yet: on a GPU whose contexts take none (see common::single_without_context_memory).
    let model = common::single_without_context_memory();
    let reports = meminfo_reports(&model, "meminfo-32g", "32Gi", &["+4096", "+8192", "-0"]);
    for r in &reports {
        r.check(16 * GIB);
    }
    assert_eq!(reports[2].mine, 12 * GIB);
}

// ---- 3. dlsym bound to either glibc version ------------------------------------------------------

/// The version of `dlsym` an executable's dynamic symbol table binds.
fn dlsym_binding(exe: &Path) -> String {
    let o = Command::new("readelf")
        .args(["--dyn-syms", "-W"])
        .arg(exe)
        .output()
        .expect("readelf");
    let text = String::from_utf8_lossy(&o.stdout).into_owned();
    text.lines()
        .flat_map(|l| l.split_whitespace())
        .find(|w| w.starts_with("dlsym@"))
        .unwrap_or_else(|| panic!("{} imports no versioned dlsym:\n{text}", exe.display()))
        .to_string()
}

#[test]
fn the_dlsym_override_catches_callers_of_both_glibc_versions() {
    let new = compile_c_variant("dlsym_versions", "-new", &["-ldl"]);
    let old = compile_c_variant("dlsym_versions", "-old", &["-DCOMPAT", "-ldl"]);
    assert_eq!(dlsym_binding(&new), "dlsym@GLIBC_2.34");
    // The first version of dlsym glibc has on the architecture (what old binaries bind).
    let first = if cfg!(target_arch = "aarch64") {
        "dlsym@GLIBC_2.17"
    } else {
        "dlsym@GLIBC_2.2.5"
    };
    assert_eq!(dlsym_binding(&old), first);
    for (exe, which) in [(&new, "new"), (&old, "old")] {
        let ledger = ledger_dir(&format!("dlsym-{which}"));
        let out = run(&mut under_cuvisor(
            exe,
            &format!("dlsym-{which}"),
            &ledger,
            Some("1Gi"),
        ))
        .success();
        assert!(
            out.stdout.contains("cuMemAlloc_v2 is libcuvisor's"),
            "{which}: {out}"
        );
        assert_eq!(
            out.number("total", "total"),
            GIB,
            "{which}: the quota holds through it\n{out}"
        );
    }
}

// ---- 4. RTLD_NEXT ------------------------------------------------------------------------------

#[test]
fn rtld_next_keeps_meaning_after_the_caller() {
    let sim = sim_dir();
    let shim = compile_c_shared("shim", &["-ldl"]);
    let exe = compile_c(
        "rtld_next",
        &["-L", sim.to_str().unwrap(), "-lcuda", "-ldl"],
    );
    let lib = libcuvisor();
    let (lib, shim_s) = (lib.to_str().unwrap(), shim.to_str().unwrap());
    let shim_name = shim.file_name().unwrap().to_str().unwrap();
    for (order, preload, shim_next, main_next) in [
        // The shim after cuvisor: its RTLD_NEXT finds the driver, whose wrapped entry point is
        // answered with cuvisor's wrapper (an object loaded after cuvisor and before libcuda
        // must not reach the driver past it: issue 15); the program's first is cuvisor.
        (
            "after",
            format!("{lib} {shim_s}"),
            "libcuvisor.so",
            "libcuvisor.so",
        ),
        // The shim first: its RTLD_NEXT is cuvisor's wrapper; the program's first is the shim.
        (
            "before",
            format!("{shim_s} {lib}"),
            "libcuvisor.so",
            shim_name,
        ),
    ] {
        let ledger = ledger_dir(&format!("next-{order}"));
        let mut cmd = under_cuvisor(&exe, &format!("next-{order}"), &ledger, Some("1Gi"));
        cmd.env("LD_PRELOAD", &preload).env("SHIM", &shim);
        let out = run(&mut cmd).success();
        let line = |prefix: &str| -> String {
            out.stdout
                .lines()
                .find(|l| l.starts_with(prefix))
                .unwrap_or_else(|| panic!("{order}: no {prefix:?}\n{out}"))
                .to_string()
        };
        let l = line("shim-next ");
        assert!(
            l.ends_with(&format!("{shim_next} cuMemAlloc_v2")),
            "{order}: {l}\n{out}"
        );
        let l = line("main-next-alloc ");
        assert!(
            l.ends_with(&format!("{main_next} cuMemAlloc_v2")),
            "{order}: {l}\n{out}"
        );
        let l = line("main-next-puts ");
        assert!(
            l.contains("libc.so") && l.ends_with(" puts"),
            "{order}: {l}\n{out}"
        );
        // Through the shim's forward: charged, once, either way.
        let charged = out.number("shim-alloc", "charged");
        assert_eq!(charged, MIB, "{order}\n{out}");
    }
}

// ---- 5. a library with cu* names of its own ---------------------------------------------------------

#[test]
fn a_library_defining_cu_names_is_not_hijacked() {
    let fake = compile_c_shared("cudnn_fake", &[]);
    let exe = compile_c("fake_lib", &["-ldl"]);
    let ledger = ledger_dir("fake");
    let mut cmd = under_cuvisor(&exe, "fake", &ledger, Some("1Gi"));
    cmd.env("FAKE", &fake);
    let out = run(&mut cmd).success();
    assert!(
        out.stdout.contains("fake cuMemAlloc_v2 returned 12345"),
        "{out}"
    );
    assert!(out.stdout.contains("cudnnCreate returned 0"), "{out}");
    assert!(
        out.stdout.contains("libcuda cuMemAlloc_v2 is libcuvisor's"),
        "{out}"
    );
    assert!(out.stderr.is_empty(), "{out}");
}

// ---- 6. programs that never touch CUDA ----------------------------------------------------------

#[test]
fn programs_that_never_touch_cuda_run_unchanged() {
    let ledger = ledger_dir("inert");
    let plain = |prog: &str, args: &[&str]| {
        let mut cmd = Command::new(prog);
        cmd.args(args);
        cuvisor_env(&mut cmd, &ledger, Some("1Gi"));
        run(&mut cmd)
    };
    let out = plain("/bin/true", &[]);
    assert!(out.ok && out.stderr.is_empty(), "/bin/true: {out}");
    let out = plain("sh", &["-c", "echo hi"]);
    assert!(
        out.ok && out.stdout == "hi\n" && out.stderr.is_empty(),
        "sh: {out}"
    );
    let out = plain("sh", &["-c", "exit 3"]);
    assert_eq!(
        out.status.code(),
        Some(3),
        "exit statuses pass through: {out}"
    );
    if Command::new("python3")
        .arg("-c")
        .arg("pass")
        .output()
        .is_ok_and(|o| o.status.success())
    {
        let out = plain("python3", &["-c", "pass"]);
        assert!(out.ok && out.stderr.is_empty(), "python3: {out}");
        let out = plain(
            "python3",
            &["-c", "import ctypes, sys; print(sys.version_info[0])"],
        );
        assert!(
            out.ok && out.stdout == "3\n" && out.stderr.is_empty(),
            "python3: {out}"
        );
    } else {
        println!("skipped python3 -c pass: no working python3 on PATH");
    }
}

// ---- 7. fail closed; inert when unconfigured -----------------------------------------------------

/// Child body: every allocation path is refused; memory info shows nothing free.
fn everything_refused() {
    setup();
    let start = std::time::Instant::now();
    // SAFETY (all calls in this body): the driver API's contract, with valid out-pointers.
    // SAFETY: a test's own FFI call: valid pointers to locals, handles the driver returned.
    unsafe {
        for size in [1usize, 512, 1 << 20, 1 << 30] {
            for _ in 0..50 {
                let mut p = 0;
                assert_eq!(cu::cuMemAlloc_v2(&mut p, size), CUDA_ERROR_OUT_OF_MEMORY);
                assert_eq!(p, 0);
            }
        }
        let mut p = 0;
        assert_eq!(
            cu::cuMemAllocManaged(&mut p, 1 << 20, 1),
            CUDA_ERROR_OUT_OF_MEMORY
        );
        assert_eq!(
            cu::cuMemAllocAsync(&mut p, 1 << 20, null_mut()),
            CUDA_ERROR_OUT_OF_MEMORY
        );
        let mut pitch = 0;
        assert_eq!(
            cu::cuMemAllocPitch_v2(&mut p, &mut pitch, 1024, 16, 4),
            CUDA_ERROR_OUT_OF_MEMORY
        );
        let mut prop: cu::CUmemAllocationProp = std::mem::zeroed();
        prop.type_ = cu::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location.type_ = cu::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        let mut h = 0;
        assert_eq!(
            cu::cuMemCreate(&mut h, 2 << 20, &prop, 0),
            CUDA_ERROR_OUT_OF_MEMORY
        );
        let desc = cu::CUDA_ARRAY_DESCRIPTOR {
            Width: 64,
            Height: 64,
            Format: cu::CUarray_format::CU_AD_FORMAT_FLOAT,
            NumChannels: 1,
        };
        let mut a = null_mut();
        assert_eq!(
            cu::cuArrayCreate_v2(&mut a, &desc),
            CUDA_ERROR_OUT_OF_MEMORY
        );
        let (mut free, mut total) = (0, 0);
        ok(cu::cuMemGetInfo_v2(&mut free, &mut total));
        assert_eq!(free, 0, "nothing is free when misconfigured");
    }
    println!(
        "child refused everything in {} ms",
        start.elapsed().as_millis()
    );
}

/// A misconfiguration is said on the refusal line itself (one line per refused allocation, at
/// most once a second), which names what is wrong: nothing else is printed, at load or later.
fn assert_fails_closed(out: &Out, bad: &str) {
    let lines = out.cuvisor_lines();
    let refusals = lines
        .iter()
        .filter(|l| l.starts_with("cuvisor: cuMemAlloc") && l.contains(" refused"))
        .count();
    assert!(refusals >= 1, "refusals are said\n{out}");
    assert!(
        lines
            .iter()
            .all(|l| l.contains("cuvisor is misconfigured") && l.contains(bad)),
        "each line is a refusal naming {bad:?}\n{out}"
    );
    let ms = out.number("child refused everything", "in");
    // Said at most once per wall-clock second: the calls span at most ms / 1000 + 1 boundaries.
    assert!(
        refusals as u64 <= 2 + ms / 1000,
        "refusals are rate-limited\n{out}"
    );
    assert_eq!(lines.len(), refusals, "nothing else\n{out}");
    assert!(
        !out.stderr.lines().any(|l| !l.starts_with("cuvisor: ")),
        "stderr is cuvisor's only\n{out}"
    );
}

#[test]
fn a_malformed_limit_refuses_every_allocation() {
    if is_child() {
        return everything_refused();
    }
    let ledger = ledger_dir("bad-env");
    let out = run(&mut child(
        "a_malformed_limit_refuses_every_allocation",
        &ledger,
        Some("4GB"),
    ))
    .passed();
    assert!(out.stdout.contains("child refused everything"), "{out}");
    assert_fails_closed(&out, "4GB");
}

#[test]
fn a_limits_file_with_an_unknown_key_refuses_every_allocation() {
    if is_child() {
        return everything_refused();
    }
    let ledger = ledger_dir("bad-file");
    let file = ledger.join("limits");
    std::fs::write(
        &file,
        format!(
            "version = 1\nstate_dir = {}\nmemroy = 6Gi\n",
            ledger.display()
        ),
    )
    .unwrap();
    let mut cmd = child(
        "a_limits_file_with_an_unknown_key_refuses_every_allocation",
        &ledger,
        None,
    );
    cmd.env("CUVISOR_CONFIG", &file);
    let out = run(&mut cmd).passed();
    assert!(out.stdout.contains("child refused everything"), "{out}");
    assert_fails_closed(&out, "memroy");
}

fn whole_device() {
    setup();
    let (free0, total) = mem_info();
    // The simulator's own numbers: the GPU less what this process's context takes.
    let ctx = cuvisor_sim::model::preset("single").unwrap().devices[0].context_memory as usize;
    assert!(ctx > 0, "the preset's contexts take memory");
    assert_eq!(
        (free0, total),
        (16 * GIB as usize - ctx, 16 * GIB as usize),
        "physical numbers"
    );
    let mut ptrs = Vec::new();
    // SAFETY: the driver API's contract, with valid out-pointers.
    unsafe {
        loop {
            let mut p = 0;
            match cu::cuMemAlloc_v2(&mut p, GIB as usize) {
                CUDA_SUCCESS => ptrs.push(p),
                r => {
                    assert_eq!(r, CUDA_ERROR_OUT_OF_MEMORY);
                    break;
                }
            }
        }
        // As many 1 GiB allocations as fit beside the context, and the rest left free.
        let n = (16 * GIB as usize - ctx) / GIB as usize;
        assert_eq!(ptrs.len(), n, "the whole 16 GiB device, less the context");
        assert_eq!(
            mem_info(),
            (
                16 * GIB as usize - ctx - n * GIB as usize,
                16 * GIB as usize
            )
        );
        for p in ptrs {
            ok(cu::cuMemFree_v2(p));
        }
    }
    assert_eq!(mem_info(), (free0, total));
    println!("child filled the device");
}

#[test]
fn no_limit_configured_is_pure_pass_through() {
    if is_child() {
        return whole_device();
    }
    let ledger = ledger_dir("passthrough");
    let out = run(&mut child(
        "no_limit_configured_is_pure_pass_through",
        &ledger,
        None,
    ))
    .passed();
    assert!(out.stdout.contains("child filled the device"), "{out}");
    assert!(out.stderr.is_empty(), "{out}");
    assert!(
        std::fs::read_dir(&ledger).unwrap().next().is_none(),
        "no ledger is even made"
    );
}

// ---- 8. the refusal message ----------------------------------------------------------------------

fn refusals_in_a_loop() {
    setup();
    // SAFETY: the driver API's contract, with valid out-pointers.
    unsafe {
        let mut held = 0;
        ok(cu::cuMemAlloc_v2(&mut held, 5 * GIB as usize));
        let start = std::time::Instant::now();
        for _ in 0..1000 {
            let mut p = 0;
            assert_eq!(
                cu::cuMemAlloc_v2(&mut p, 2 * GIB as usize),
                CUDA_ERROR_OUT_OF_MEMORY
            );
        }
        eprintln!("burst of 1000 took {} ms", start.elapsed().as_millis());
        std::thread::sleep(std::time::Duration::from_millis(1100));
        let mut p = 0;
        assert_eq!(
            cu::cuMemAlloc_v2(&mut p, 2 * GIB as usize),
            CUDA_ERROR_OUT_OF_MEMORY
        );
        ok(cu::cuMemFree_v2(held));
    }
}

#[test]
fn a_refusal_is_one_line_naming_request_quota_and_use_at_most_once_a_second() {
    if is_child() {
        return refusals_in_a_loop();
    }
    let ledger = ledger_dir("refusal");
    let out = run(&mut child(
        "a_refusal_is_one_line_naming_request_quota_and_use_at_most_once_a_second",
        &ledger,
        Some("6Gi"),
    ))
    .passed();
    let (burst, after) = out
        .stderr
        .split_once("burst of 1000 took ")
        .unwrap_or_else(|| panic!("{out}"));
    let burst_ms: u64 = after.split_whitespace().next().unwrap().parse().unwrap();
    let refusals = |text: &str| -> Vec<String> {
        text.lines()
            .filter(|l| l.starts_with("cuvisor: "))
            .map(str::to_string)
            .collect()
    };
    let first = refusals(burst);
    assert!(!first.is_empty(), "a refusal is said\n{out}");
    assert!(
        first.len() as u64 <= 1 + burst_ms / 1000,
        "at most one line a second\n{out}"
    );
    assert_eq!(
        first[0],
        "cuvisor: cuMemAlloc_v2 of 2.00 GiB on GPU 0 refused: 5.00 GiB of the 6.00 GiB quota in use, 1.00 GiB left"
    );
    let later = refusals(after.split_once('\n').map_or("", |x| x.1));
    assert_eq!(
        later.len(),
        1,
        "a second later the next refusal is said again\n{out}"
    );
    assert!(
        later[0].contains("2.00 GiB") && later[0].contains("6.00 GiB quota"),
        "{}",
        later[0]
    );
}

// ---- 9. every allocation path, charged and given back exactly ---------------------------------

fn ok(r: R) {
    assert_eq!(r, CUDA_SUCCESS);
}

fn setup() -> cu::CUcontext {
    let mut ctx = null_mut();
    // SAFETY: the driver API's contract, with valid out-pointers.
    unsafe {
        ok(cu::cuInit(0));
        ok(cu::cuDevicePrimaryCtxRetain(&mut ctx, 0));
        ok(cu::cuCtxSetCurrent(ctx));
    }
    ctx
}

fn mem_info() -> (usize, usize) {
    let (mut free, mut total) = (0, 0);
    // SAFETY: valid out-pointers.
    unsafe { ok(cu::cuMemGetInfo_v2(&mut free, &mut total)) };
    (free, total)
}

fn free_mem() -> u64 {
    mem_info().0 as u64
}

/// An export of libcuda.so.1 (through dlsym on its handle: cuvisor's wrapper where it has one)
/// that cudarc's bindings do not declare (the `_ptsz` forms).
fn raw<T: Copy>(name: &std::ffi::CStr) -> T {
    export(c"libcuda.so.1", name)
}

/// `name` of library `lib` (loaded if need be), as the function-pointer type `T` the caller
/// names for it.
fn export<T: Copy>(lib: &std::ffi::CStr, name: &std::ffi::CStr) -> T {
    assert_eq!(std::mem::size_of::<T>(), std::mem::size_of::<*mut c_void>());
    // SAFETY: dlopen/dlsym with NUL-terminated names; the symbol is reinterpreted as the
    // pointer-sized function-pointer type T whose C signature the caller states.
    unsafe {
        let h = libc::dlopen(lib.as_ptr(), libc::RTLD_NOW);
        assert!(!h.is_null(), "{lib:?} not found");
        let p = libc::dlsym(h, name.as_ptr());
        assert!(!p.is_null(), "{name:?} not exported");
        std::mem::transmute_copy(&p)
    }
}

/// Runs `alloc` (which returns a release closure), checks free went down by exactly `bytes`,
/// releases, checks free is back.
fn charged_exactly(what: &str, bytes: u64, alloc: impl FnOnce() -> Box<dyn FnOnce()>) {
    let before = free_mem();
    let release = alloc();
    assert_eq!(before - free_mem(), bytes, "{what}: charged");
    release();
    assert_eq!(free_mem(), before, "{what}: given back");
}

fn allocation_paths() {
    setup();
    let base = free_mem();
    assert_eq!(base, GIB, "the 1 GiB quota");
    // SAFETY (all calls in this body): the driver API's contract: valid out-pointers and
    // descriptors, handles the driver returned.
    // SAFETY: a test's own FFI call: valid pointers to locals, handles the driver returned.
    unsafe {
        charged_exactly("cuMemAlloc_v2", 64 * MIB, || {
            let mut p = 0;
            ok(cu::cuMemAlloc_v2(&mut p, 64 << 20));
            Box::new(move || ok(cu::cuMemFree_v2(p)))
        });
        charged_exactly("cuMemAllocManaged", 64 * MIB, || {
            let mut p = 0;
            ok(cu::cuMemAllocManaged(&mut p, 64 << 20, 1));
            Box::new(move || ok(cu::cuMemFree_v2(p)))
        });
        // Pitched: the real pitch (1000 bytes padded to 1024) x height.
        let mut pitch = 0;
        charged_exactly("cuMemAllocPitch_v2", 1024 * 100, || {
            let mut p = 0;
            ok(cu::cuMemAllocPitch_v2(&mut p, &mut pitch, 1000, 100, 4));
            Box::new(move || ok(cu::cuMemFree_v2(p)))
        });
        assert_eq!(pitch, 1024);
        charged_exactly("cuArrayCreate_v2", 16 * MIB, || {
            let desc = cu::CUDA_ARRAY_DESCRIPTOR {
                Width: 1024,
                Height: 1024,
                Format: cu::CUarray_format::CU_AD_FORMAT_FLOAT,
                NumChannels: 4,
            };
            let mut a = null_mut();
            ok(cu::cuArrayCreate_v2(&mut a, &desc));
            Box::new(move || ok(cu::cuArrayDestroy(a)))
        });
        charged_exactly("cuArray3DCreate_v2", 2 * MIB, || {
            let desc = cu::CUDA_ARRAY3D_DESCRIPTOR {
                Width: 256,
                Height: 256,
                Depth: 16,
                Format: cu::CUarray_format::CU_AD_FORMAT_UNSIGNED_INT8,
                NumChannels: 2,
                Flags: 0,
            };
            let mut a = null_mut();
            ok(cu::cuArray3DCreate_v2(&mut a, &desc));
            Box::new(move || ok(cu::cuArrayDestroy(a)))
        });
        charged_exactly(
            "cuMipmappedArrayCreate",
            1024 * 1024 + 512 * 512 + 256 * 256,
            || {
                let desc = cu::CUDA_ARRAY3D_DESCRIPTOR {
                    Width: 1024,
                    Height: 1024,
                    Depth: 0,
                    Format: cu::CUarray_format::CU_AD_FORMAT_UNSIGNED_INT8,
                    NumChannels: 1,
                    Flags: 0,
                };
                let mut m = null_mut();
                ok(cu::cuMipmappedArrayCreate(&mut m, &desc, 3));
                Box::new(move || ok(cu::cuMipmappedArrayDestroy(m)))
            },
        );

        // VMM: physical memory on the device is charged at cuMemCreate, mapping adds nothing,
        // cuMemRelease (after the unmap) gives it back; host-located memory is not device memory.
        let mut prop: cu::CUmemAllocationProp = std::mem::zeroed();
        prop.type_ = cu::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location.type_ = cu::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = 0;
        charged_exactly("cuMemCreate (device)", 64 * MIB, || {
            let mut h = 0;
            ok(cu::cuMemCreate(&mut h, 64 << 20, &prop, 0));
            let charged = base - free_mem();
            let mut va = 0;
            ok(cu::cuMemAddressReserve(&mut va, 64 << 20, 0, 0, 0));
            ok(cu::cuMemMap(va, 64 << 20, 0, h, 0));
            let access = cu::CUmemAccessDesc {
                location: prop.location,
                flags: cu::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            };
            ok(cu::cuMemSetAccess(va, 64 << 20, &access, 1));
            assert_eq!(base - free_mem(), charged, "mapping is not new memory");
            Box::new(move || {
                ok(cu::cuMemUnmap(va, 64 << 20));
                ok(cu::cuMemAddressFree(va, 64 << 20));
                ok(cu::cuMemRelease(h));
            })
        });
        // Released while mapped: the driver keeps the memory until the last unmap, and so does
        // the quota (else create + map + release would go past it).
        charged_exactly("cuMemCreate, map twice, release, unmap", 64 * MIB, || {
            let mut h = 0;
            ok(cu::cuMemCreate(&mut h, 64 << 20, &prop, 0));
            let mut va = 0;
            ok(cu::cuMemAddressReserve(&mut va, 128 << 20, 0, 0, 0));
            ok(cu::cuMemMap(va, 64 << 20, 0, h, 0));
            ok(cu::cuMemMap(va + (64 << 20), 64 << 20, 0, h, 0));
            ok(cu::cuMemRelease(h));
            assert_eq!(
                base - free_mem(),
                64 * MIB,
                "released but mapped: still charged"
            );
            Box::new(move || {
                ok(cu::cuMemUnmap(va, 64 << 20));
                assert_eq!(
                    base - free_mem(),
                    64 * MIB,
                    "one mapping left: still charged"
                );
                ok(cu::cuMemUnmap(va + (64 << 20), 64 << 20));
                ok(cu::cuMemAddressFree(va, 128 << 20));
            })
        });
        let mut va = 0;
        ok(cu::cuMemAddressReserve(&mut va, 32 << 26, 0, 0, 0));
        let mut mapped = 0u64;
        loop {
            let mut h = 0;
            match cu::cuMemCreate(&mut h, 64 << 20, &prop, 0) {
                CUDA_SUCCESS => {}
                r => {
                    assert_eq!(r, CUDA_ERROR_OUT_OF_MEMORY);
                    break;
                }
            }
            ok(cu::cuMemMap(va + mapped * (64 << 20), 64 << 20, 0, h, 0));
            ok(cu::cuMemRelease(h));
            mapped += 1;
            assert!(mapped <= 16, "create + map + release went past the quota");
        }
        assert_eq!(mapped, 16, "1 GiB of 64 MiB handles, mapped and released");
        // One unmap of all those adjacent mappings gives every handle back.
        ok(cu::cuMemUnmap(va, (mapped << 26) as usize));
        ok(cu::cuMemAddressFree(va, 32 << 26));
        assert_eq!(free_mem(), base, "the unmap gave every handle back");
        let mut host = prop;
        host.location.type_ = cu::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST;
        charged_exactly("cuMemCreate (host)", 0, || {
            let mut h = 0;
            ok(cu::cuMemCreate(&mut h, 64 << 20, &host, 0));
            Box::new(move || ok(cu::cuMemRelease(h)))
        });
        let mut h = 0;
        assert_eq!(
            cu::cuMemCreate(&mut h, 2 << 30, &prop, 0),
            CUDA_ERROR_OUT_OF_MEMORY,
            "over the quota"
        );
        assert_eq!(free_mem(), base, "a refused cuMemCreate holds nothing");

        // Stream-ordered: charged what the pool reserves for it (2 MiB granules), kept charged
        // while the pool keeps the freed memory, given back at the synchronization point where
        // the pool lets it go (release threshold 0).
        charged_exactly("cuMemAllocAsync", 64 * MIB, || {
            let mut p = 0;
            ok(cu::cuMemAllocAsync(&mut p, 64 << 20, null_mut()));
            Box::new(move || {
                ok(cu::cuMemFreeAsync(p, null_mut()));
                assert_eq!(
                    base - free_mem(),
                    64 * MIB,
                    "the pool keeps it until a sync"
                );
                ok(cu::cuStreamSynchronize(null_mut()));
            })
        });
        charged_exactly("cuMemAllocAsync (3 MiB: two granules)", 4 * MIB, || {
            let mut p = 0;
            ok(cu::cuMemAllocAsync(&mut p, 3 << 20, null_mut()));
            Box::new(move || {
                ok(cu::cuMemFreeAsync(p, null_mut()));
                ok(cu::cuCtxSynchronize());
            })
        });
        type AllocAsync = unsafe extern "C" fn(*mut u64, usize, cu::CUstream) -> R;
        type FreeAsync = unsafe extern "C" fn(u64, cu::CUstream) -> R;
        type Sync = unsafe extern "C" fn(cu::CUstream) -> R;
        let alloc_ptsz: AllocAsync = raw(c"cuMemAllocAsync_ptsz");
        let free_ptsz: FreeAsync = raw(c"cuMemFreeAsync_ptsz");
        let sync_ptsz: Sync = raw(c"cuStreamSynchronize_ptsz");
        charged_exactly("cuMemAllocAsync_ptsz", 64 * MIB, || {
            let mut p = 0;
            ok(alloc_ptsz(&mut p, 64 << 20, null_mut()));
            Box::new(move || {
                ok(free_ptsz(p, null_mut()));
                ok(sync_ptsz(null_mut()));
            })
        });
        let pool = create_pool();
        charged_exactly("cuMemAllocFromPoolAsync", 64 * MIB, || {
            let mut p = 0;
            ok(cu::cuMemAllocFromPoolAsync(
                &mut p,
                64 << 20,
                pool,
                null_mut(),
            ));
            Box::new(move || {
                ok(cu::cuMemFreeAsync(p, null_mut()));
                ok(cu::cuStreamSynchronize(null_mut()));
            })
        });
        type FromPool = unsafe extern "C" fn(*mut u64, usize, cu::CUmemoryPool, cu::CUstream) -> R;
        let from_pool_ptsz: FromPool = raw(c"cuMemAllocFromPoolAsync_ptsz");
        charged_exactly("cuMemAllocFromPoolAsync_ptsz", 64 * MIB, || {
            let mut p = 0;
            ok(from_pool_ptsz(&mut p, 64 << 20, pool, null_mut()));
            Box::new(move || {
                ok(free_ptsz(p, null_mut()));
                ok(sync_ptsz(null_mut()));
            })
        });
        // A plain free of a pool pointer gives nothing back by itself either.
        charged_exactly("cuMemAllocFromPoolAsync, cuMemFree_v2", 64 * MIB, || {
            let mut p = 0;
            ok(cu::cuMemAllocFromPoolAsync(
                &mut p,
                64 << 20,
                pool,
                null_mut(),
            ));
            Box::new(move || {
                ok(cu::cuMemFree_v2(p));
                assert_eq!(
                    base - free_mem(),
                    64 * MIB,
                    "the pool keeps it until a sync"
                );
                let mut ev = null_mut();
                ok(cu::cuEventCreate(&mut ev, 0));
                ok(cu::cuEventRecord(ev, null_mut()));
                ok(cu::cuEventSynchronize(ev));
                ok(cu::cuEventDestroy_v2(ev));
            })
        });
        let mut p = 0;
        assert_eq!(
            cu::cuMemAllocFromPoolAsync(&mut p, 2 << 30, pool, null_mut()),
            CUDA_ERROR_OUT_OF_MEMORY
        );
        assert_eq!(
            cu::cuMemAllocAsync(&mut p, 2 << 30, null_mut()),
            CUDA_ERROR_OUT_OF_MEMORY
        );
        ok(cu::cuStreamSynchronize(null_mut()));
        ok(cu::cuMemPoolDestroy(pool));
    }
    assert_eq!(free_mem(), base);
    let dir = PathBuf::from(std::env::var_os("CUVISOR_STATE_DIR").unwrap());
    assert_eq!(ledger_used(&dir), vec![0], "the ledger agrees");
    // A shareable-handle import is the exporter's memory, not new memory; exported memory
    // stays charged until the process exits (an imported copy, maybe in another process, keeps
    // it alive after every release this process can see).
    // SAFETY: a test's own FFI call: valid pointers to locals, handles the driver returned.
    unsafe {
        let mut shared: cu::CUmemAllocationProp = std::mem::zeroed();
        shared.type_ = cu::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        shared.location.type_ = cu::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        shared.requestedHandleTypes =
            cu::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        let mut h = 0;
        ok(cu::cuMemCreate(&mut h, 32 << 20, &shared, 0));
        let mut fd: i32 = -1;
        ok(cu::cuMemExportToShareableHandle(
            &mut fd as *mut i32 as *mut c_void,
            h,
            cu::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            0,
        ));
        let mut imported = 0;
        ok(cu::cuMemImportFromShareableHandle(
            &mut imported,
            fd as usize as *mut c_void,
            cu::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        ));
        assert_eq!(base - free_mem(), 32 * MIB, "the import adds nothing");
        ok(cu::cuMemRelease(imported));
        ok(cu::cuMemRelease(h));
        libc::close(fd);
        assert_eq!(
            base - free_mem(),
            32 * MIB,
            "exported: charged until the process exits"
        );
    }
    // A retained handle keeps the memory alive after the first release and the unmap, and
    // can map it again: charged until the process exits too.
    // SAFETY: as above.
    unsafe {
        let mut prop: cu::CUmemAllocationProp = std::mem::zeroed();
        prop.type_ = cu::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location.type_ = cu::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        let (size, mut h, mut va, mut again) = (16usize << 20, 0, 0, 0);
        ok(cu::cuMemCreate(&mut h, size, &prop, 0));
        ok(cu::cuMemAddressReserve(&mut va, size, 0, 0, 0));
        ok(cu::cuMemMap(va, size, 0, h, 0));
        ok(cu::cuMemRetainAllocationHandle(
            &mut again,
            (va + 4096) as *mut c_void,
        ));
        assert_eq!(again, h, "the same handle value");
        ok(cu::cuMemRelease(h));
        ok(cu::cuMemUnmap(va, size));
        assert_eq!(
            base - free_mem(),
            48 * MIB,
            "alive through the retained handle"
        );
        ok(cu::cuMemMap(va, size, 0, again, 0));
        ok(cu::cuMemUnmap(va, size));
        ok(cu::cuMemRelease(again));
        ok(cu::cuMemAddressFree(va, size));
        assert_eq!(
            base - free_mem(),
            48 * MIB,
            "retained: charged until the process exits"
        );
    }
    assert_eq!(ledger_used(&dir), vec![48 * MIB]);
    println!("child checked every path");
}

#[test]
fn every_allocation_path_is_charged_and_given_back_exactly() {
    if is_child() {
        return allocation_paths();
    }
    let ledger = ledger_dir("paths");
    let out = run(&mut child(
        "every_allocation_path_is_charged_and_given_back_exactly",
        &ledger,
        Some("1Gi"),
    ))
    .passed();
    assert!(out.stdout.contains("child checked every path"), "{out}");
    assert_eq!(ledger_used(&ledger), vec![0], "all given back at exit");
}

/// Child body for the IPC test: the exporter allocates and prints its handle, then waits on
/// stdin; the importer opens it and checks its container's free memory did not change.
fn ipc_side() {
    use std::io::BufRead;
    setup();
    // SAFETY (all calls in this body): the driver API's contract, with valid out-pointers.
    // SAFETY: a test's own FFI call: valid pointers to locals, handles the driver returned.
    unsafe {
        if std::env::var("ROLE").as_deref() == Ok("exporter") {
            let mut p = 0;
            ok(cu::cuMemAlloc_v2(&mut p, 256 << 20));
            assert_eq!(free_mem(), GIB - 256 * MIB);
            let mut handle: cu::CUipcMemHandle = std::mem::zeroed();
            ok(cu::cuIpcGetMemHandle(&mut handle, p));
            let hex: String = handle
                .reserved
                .iter()
                .map(|b| format!("{:02x}", *b as u8))
                .collect();
            println!("handle {hex}");
            let mut line = String::new();
            std::io::stdin().lock().read_line(&mut line).unwrap();
            ok(cu::cuMemFree_v2(p));
        } else {
            let hex = std::env::var("HANDLE").unwrap();
            let mut handle: cu::CUipcMemHandle = std::mem::zeroed();
            for (i, b) in handle.reserved.iter_mut().enumerate() {
                *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap() as _;
            }
            let before = free_mem();
            assert_eq!(before, GIB);
            let mut opened = 0;
            ok(cu::cuIpcOpenMemHandle_v2(&mut opened, handle, 1));
            assert_eq!(
                free_mem(),
                before,
                "opening another process's memory takes none of the quota"
            );
            let dir = PathBuf::from(std::env::var_os("CUVISOR_STATE_DIR").unwrap());
            assert_eq!(
                ledger_used(&dir),
                vec![0],
                "the importer's ledger holds nothing"
            );
            ok(cu::cuIpcCloseMemHandle(opened));
            assert_eq!(free_mem(), before);
            // Nor does closing it give back anything, or free the exporter's memory.
            let mut p = 0;
            ok(cu::cuMemAlloc_v2(&mut p, GIB as usize));
            ok(cu::cuMemFree_v2(p));
        }
    }
}

#[test]
fn ipc_imported_memory_is_not_charged_to_the_importer() {
    if is_child() {
        return ipc_side();
    }
    use std::io::{BufRead, BufReader, Write};
    let state = state_file("ipc");
    let (exp_ledger, imp_ledger) = (ledger_dir("ipc-exporter"), ledger_dir("ipc-importer"));
    let mut cmd = Child::new("ipc_imported_memory_is_not_charged_to_the_importer")
        .state(&state)
        .env("ROLE", "exporter")
        .command();
    cuvisor_env(&mut cmd, &exp_ledger, Some("1Gi"));
    let mut exporter = cmd
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(exporter.stdout.take().unwrap());
    let mut line = String::new();
    while !line.contains("handle ") {
        line.clear();
        assert!(
            out.read_line(&mut line).unwrap() > 0,
            "the exporter ended early"
        );
    }
    let hex = line.trim().rsplit("handle ").next().unwrap().to_string();
    let mut cmd = Child::new("ipc_imported_memory_is_not_charged_to_the_importer")
        .state(&state)
        .env("ROLE", "importer")
        .env("HANDLE", &hex)
        .command();
    cuvisor_env(&mut cmd, &imp_ledger, Some("1Gi"));
    let imported = run(&mut cmd);
    writeln!(exporter.stdin.as_mut().unwrap()).unwrap();
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut out, &mut rest).unwrap();
    assert!(exporter.wait().unwrap().success(), "exporter: {rest}");
    assert!(rest.contains("1 passed"), "exporter: {rest}");
    imported.passed();
    assert_eq!(ledger_used(&exp_ledger), vec![0]);
}

// ---- 10. context reserve -------------------------------------------------------------------------

fn context_reserve() {
    let dir = PathBuf::from(std::env::var_os("CUVISOR_STATE_DIR").unwrap());
    // SAFETY (all calls in this body): the driver API's contract, with valid out-pointers and
    // contexts the driver returned.
    // SAFETY: a test's own FFI call: valid pointers to locals, handles the driver returned.
    unsafe {
        ok(cu::cuInit(0));
        let mut c1 = null_mut();
        ok(cu::cuCtxCreate_v2(&mut c1, 0, 0));
        assert_eq!(free_mem(), 768 * MIB, "a context takes its reserve");
        let mut c2 = null_mut();
        ok(cu::cuCtxCreate_v2(&mut c2, 0, 0));
        assert_eq!(free_mem(), 512 * MIB, "each context");
        ok(cu::cuCtxDestroy_v2(c2));
        ok(cu::cuCtxSetCurrent(c1));
        assert_eq!(free_mem(), 768 * MIB, "cuCtxDestroy_v2 gives it back");

        let mut p1 = null_mut();
        ok(cu::cuDevicePrimaryCtxRetain(&mut p1, 0));
        assert_eq!(
            free_mem(),
            512 * MIB,
            "the primary context takes one reserve"
        );
        let mut p2 = null_mut();
        ok(cu::cuDevicePrimaryCtxRetain(&mut p2, 0));
        assert_eq!(p1, p2);
        assert_eq!(
            free_mem(),
            512 * MIB,
            "once per process, however often it is retained"
        );
        ok(cu::cuDevicePrimaryCtxRelease_v2(0));
        assert_eq!(free_mem(), 512 * MIB, "still retained once");
        ok(cu::cuDevicePrimaryCtxRelease_v2(0));
        assert_eq!(free_mem(), 768 * MIB, "the last release gives it back");
        // The reserve is quota like any other: 768 MiB left, a 1 GiB allocation does not fit.
        let mut p = 0;
        assert_eq!(
            cu::cuMemAlloc_v2(&mut p, GIB as usize),
            CUDA_ERROR_OUT_OF_MEMORY
        );
        assert_eq!(ledger_used(&dir), vec![256 * MIB]);
        ok(cu::cuCtxDestroy_v2(c1));
        assert_eq!(ledger_used(&dir), vec![0], "every reserve given back");
    }
    // Eight threads taking the first primary reference at once: charged exactly once.
    let go = std::sync::Arc::new(std::sync::Barrier::new(8));
    let threads: Vec<_> = (0..8)
        .map(|_| {
            let go = go.clone();
            std::thread::spawn(move || {
                go.wait();
                let mut c = null_mut();
                // SAFETY: as above.
                unsafe { ok(cu::cuDevicePrimaryCtxRetain(&mut c, 0)) };
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(
        ledger_used(&dir),
        vec![256 * MIB],
        "one reserve for racing first retains"
    );
    for _ in 0..8 {
        // SAFETY: as above.
        unsafe { ok(cu::cuDevicePrimaryCtxRelease_v2(0)) };
    }
    assert_eq!(ledger_used(&dir), vec![0], "given back at the last release");
    println!("child checked the reserve");
}

#[test]
fn each_context_is_charged_its_reserve_and_gives_it_back() {
    if is_child() {
        return context_reserve();
    }
    let ledger = ledger_dir("reserve");
    let mut cmd = child(
        "each_context_is_charged_its_reserve_and_gives_it_back",
        &ledger,
        Some("1Gi"),
    );
    cmd.env("CUVISOR_CONTEXT_RESERVE", "256Mi");
    let out = run(&mut cmd).passed();
    assert!(out.stdout.contains("child checked the reserve"), "{out}");
}

// ---- per-device limits on a multi-GPU machine ----------------------------------------------------

fn per_device() {
    // SAFETY (all calls in this body): the driver API's contract, with valid out-pointers and
    // handles the driver returned.
    // SAFETY: a test's own FFI call: valid pointers to locals, handles the driver returned.
    unsafe {
        ok(cu::cuInit(0));
        let nvml = NvmlMemory::open();
        for (dev, quota) in [(0, 6 * GIB), (1, 2 * GIB), (2, 0)] {
            let mut ctx = null_mut();
            ok(cu::cuDevicePrimaryCtxRetain(&mut ctx, dev));
            ok(cu::cuCtxSetCurrent(ctx));
            let mut total = 0;
            ok(cu::cuDeviceTotalMem_v2(&mut total, dev));
            assert_eq!(total as u64, quota, "GPU {dev}: cuDeviceTotalMem_v2");
            assert_eq!(
                mem_info(),
                (quota as usize, quota as usize),
                "GPU {dev}: cuMemGetInfo_v2"
            );
            assert_eq!(
                nvml.info(dev as u32),
                (quota, quota),
                "GPU {dev}: NVML (total, free)"
            );
            let mut p = 0;
            if quota > 0 {
                ok(cu::cuMemAlloc_v2(&mut p, quota as usize));
                assert_eq!(mem_info().0, 0, "GPU {dev}: full");
                assert_eq!(nvml.info(dev as u32), (quota, 0), "GPU {dev}: NVML agrees");
            }
            assert_eq!(
                cu::cuMemAlloc_v2(&mut p, 1 << 20),
                CUDA_ERROR_OUT_OF_MEMORY,
                "GPU {dev}: over its own quota"
            );
        }
        // Physical memory created for another device than the current one is charged to that one.
        let mut prop: cu::CUmemAllocationProp = std::mem::zeroed();
        prop.type_ = cu::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location.type_ = cu::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = 0;
        let mut h = 0;
        assert_eq!(
            cu::cuMemCreate(&mut h, 2 << 20, &prop, 0),
            CUDA_ERROR_OUT_OF_MEMORY,
            "GPU 0 is full, whatever is current"
        );
    }
    println!("child checked the devices");
}

/// NVML's memory info through dlsym on libnvidia-ml's handle (cuvisor's wrapper).
struct NvmlMemory {
    by_index: unsafe extern "C" fn(u32, *mut *mut c_void) -> u32,
    info: unsafe extern "C" fn(*mut c_void, *mut [u64; 3]) -> u32,
}

impl NvmlMemory {
    fn open() -> NvmlMemory {
        let lib = c"libnvidia-ml.so.1";
        let init: unsafe extern "C" fn() -> u32 = export(lib, c"nvmlInit_v2");
        // SAFETY: nvmlInit_v2 takes no arguments.
        assert_eq!(unsafe { init() }, 0);
        NvmlMemory {
            by_index: export(lib, c"nvmlDeviceGetHandleByIndex_v2"),
            info: export(lib, c"nvmlDeviceGetMemoryInfo"),
        }
    }
    /// (total, free) of NVML device `i`.
    fn info(&self, i: u32) -> (u64, u64) {
        let mut dev = null_mut();
        let mut m = [0u64; 3];
        // SAFETY: valid out-pointers for the functions' documented signatures.
        unsafe {
            assert_eq!((self.by_index)(i, &mut dev), 0);
            assert_eq!((self.info)(dev, &mut m), 0);
        }
        (m[0], m[1])
    }
}

#[test]
fn per_device_limits_hold_on_a_multi_gpu_machine() {
    if is_child() {
        return per_device();
    }
    let ledger = ledger_dir("per-device");
    let mut cmd = Child::new("per_device_limits_hold_on_a_multi_gpu_machine")
        .preset("dgx1-v100")
        .command();
    cuvisor_env(&mut cmd, &ledger, Some("0=6Gi,1=2Gi"));
    let out = run(&mut cmd).passed();
    assert!(out.stdout.contains("child checked the devices"), "{out}");
}

// ---- context teardown frees what was allocated in the context ------------------------------------

fn teardown() {
    let dir = PathBuf::from(std::env::var_os("CUVISOR_STATE_DIR").unwrap());
    let used = || ledger_used(&dir)[0];
    // SAFETY (all calls in this body): the driver API's contract, with valid out-pointers and
    // contexts the driver returned.
    // SAFETY: a test's own FFI call: valid pointers to locals, handles the driver returned.
    unsafe {
        ok(cu::cuInit(0));
        let mut keep = null_mut();
        ok(cu::cuCtxCreate_v2(&mut keep, 0, 0));
        let mut kept = 0;
        ok(cu::cuMemAlloc_v2(&mut kept, 64 << 20));

        let mut c = null_mut();
        ok(cu::cuCtxCreate_v2(&mut c, 0, 0));
        let mut p = 0;
        ok(cu::cuMemAlloc_v2(&mut p, 256 << 20));
        ok(cu::cuMemAllocManaged(&mut p, 32 << 20, 1));
        ok(cu::cuMemAllocAsync(&mut p, 16 << 20, null_mut()));
        assert_eq!(used(), (64 + 256 + 32 + 16) * MIB);
        ok(cu::cuCtxDestroy_v2(c));
        assert_eq!(
            used(),
            64 * MIB,
            "cuCtxDestroy_v2 freed what was allocated in it; the other context's stays"
        );

        let mut primary = null_mut();
        ok(cu::cuDevicePrimaryCtxRetain(&mut primary, 0));
        ok(cu::cuCtxSetCurrent(primary));
        ok(cu::cuMemAlloc_v2(&mut p, 128 << 20));
        assert_eq!(used(), 192 * MIB);
        ok(cu::cuDevicePrimaryCtxRelease_v2(0));
        assert_eq!(
            used(),
            64 * MIB,
            "the last primary release destroyed it, and what was in it"
        );

        ok(cu::cuDevicePrimaryCtxRetain(&mut primary, 0));
        ok(cu::cuDevicePrimaryCtxRetain(&mut primary, 0));
        ok(cu::cuCtxSetCurrent(primary));
        ok(cu::cuMemAlloc_v2(&mut p, 128 << 20));
        ok(cu::cuDevicePrimaryCtxRelease_v2(0));
        assert_eq!(used(), 192 * MIB, "still retained: nothing freed");
        type Reset = unsafe extern "C" fn(cu::CUdevice) -> R;
        let reset: Reset = raw(c"cuDevicePrimaryCtxReset_v2");
        ok(reset(0));
        assert_eq!(
            used(),
            64 * MIB,
            "cuDevicePrimaryCtxReset (cudaDeviceReset) freed it all"
        );

        // The quota is whole again: all of it but the kept 64 MiB can be allocated.
        ok(cu::cuCtxSetCurrent(keep));
        ok(cu::cuMemAlloc_v2(&mut p, (GIB - 64 * MIB) as usize));
        ok(cu::cuMemFree_v2(p));
        ok(cu::cuMemFree_v2(kept));
        assert_eq!(used(), 0);
        ok(cu::cuCtxDestroy_v2(keep));
    }
    println!("child checked the teardowns");
}

#[test]
fn tearing_down_a_context_gives_back_what_was_allocated_in_it() {
    if is_child() {
        return teardown();
    }
    let ledger = ledger_dir("teardown");
    let out = run(&mut child(
        "tearing_down_a_context_gives_back_what_was_allocated_in_it",
        &ledger,
        Some("1Gi"),
    ))
    .passed();
    assert!(out.stdout.contains("child checked the teardowns"), "{out}");
}

// ---- stream-ordered pools and exported memory: what is physically held -------------------------
//
// The attacks below held more device memory than the quota while the ledger showed less: pools
// reserve memory in 2 MiB granules and keep what is freed until a synchronization point (or for
// good, under a high release threshold); exported VMM memory lives on after the exporter's
// release. Each test watches the simulator's own count of memory in use, which is the truth the
// quota must hold to.

/// What the simulator counts as in use on GPU 0, less what was in use when this was made (the
/// child is the only user of its simulator state).
struct Physical {
    sim: cuvisor_sim::state::Shared,
    base: u64,
    dev: usize,
}

impl Physical {
    fn new() -> Physical {
        Physical::on("single", 0)
    }
    /// GPU `dev` of machine `preset`.
    fn on(preset: &str, dev: usize) -> Physical {
        let model = cuvisor_sim::model::preset(preset).unwrap();
        let state = std::env::var_os("CUVISOR_SIM_STATE").unwrap();
        let sim = cuvisor_sim::state::Shared::attach_at(&model, Path::new(&state)).unwrap();
        let base = sim
            .device(dev)
            .mem_used
            .load(std::sync::atomic::Ordering::SeqCst);
        Physical { sim, base, dev }
    }
    fn held(&self) -> u64 {
        self.sim
            .device(self.dev)
            .mem_used
            .load(std::sync::atomic::Ordering::SeqCst)
            .saturating_sub(self.base)
    }
    /// Asserts what is physically held is within `quota`.
    fn within(&self, quota: u64, what: &str) {
        let h = self.held();
        assert!(
            h <= quota,
            "{what}: {} MiB physically held under a {} MiB quota",
            h / MIB,
            quota / MIB
        );
    }
}

fn ledger_of_child() -> Vec<u64> {
    ledger_used(&PathBuf::from(
        std::env::var_os("CUVISOR_STATE_DIR").unwrap(),
    ))
}

/// A pool of device 0's memory, created by the program.
fn create_pool() -> cu::CUmemoryPool {
    // SAFETY: the driver API's contract: zeroed props with the required fields set, a valid
    // out-pointer.
    unsafe {
        let mut props: cu::CUmemPoolProps = std::mem::zeroed();
        props.allocType = cu::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        props.location.type_ = cu::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        props.location.id = 0;
        let mut pool = null_mut();
        ok(cu::cuMemPoolCreate(&mut pool, &props));
        pool
    }
}

fn pool_attr(pool: cu::CUmemoryPool, a: cu::CUmemPool_attribute) -> u64 {
    let mut v = 0u64;
    // SAFETY: a pool the driver returned; a u64 out-value, as these attributes take.
    unsafe {
        ok(cu::cuMemPoolGetAttribute(
            pool,
            a,
            &mut v as *mut u64 as *mut c_void,
        ))
    };
    v
}

fn set_threshold(pool: cu::CUmemoryPool, bytes: u64) {
    let mut v = bytes;
    // SAFETY: a pool the driver returned; the threshold is a u64 in-value.
    unsafe {
        ok(cu::cuMemPoolSetAttribute(
            pool,
            cu::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            &mut v as *mut u64 as *mut c_void,
        ))
    };
}

fn four_thousand_pools() {
    setup();
    let phys = Physical::new();
    let mut held = Vec::new();
    let mut pools = Vec::new();
    for i in 0..4000 {
        let pool = create_pool();
        pools.push(pool);
        let mut p = 0;
        // SAFETY: a pool the driver returned, a valid out-pointer.
        match unsafe { cu::cuMemAllocFromPoolAsync(&mut p, 512, pool, null_mut()) } {
            CUDA_SUCCESS => held.push(p),
            CUDA_ERROR_OUT_OF_MEMORY => {}
            r => panic!("pool {i}: {r:?}"),
        }
        phys.within(GIB, &format!("after pool {i}"));
    }
    assert_eq!(
        held.len(),
        512,
        "each pool reserves a 2 MiB granule: 512 of them fill 1 GiB"
    );
    for p in held {
        // SAFETY: pointers the driver returned, freed once.
        unsafe { ok(cu::cuMemFreeAsync(p, null_mut())) };
    }
    for pool in pools {
        // SAFETY: pools the driver returned, destroyed once.
        unsafe { ok(cu::cuMemPoolDestroy(pool)) };
    }
    assert_eq!(phys.held(), 0);
    assert_eq!(ledger_of_child(), vec![0], "all given back");
    println!("child checked 4000 pools");
}

#[test]
fn four_thousand_pools_of_one_small_allocation_each_are_charged_their_reserve() {
    if is_child() {
        return four_thousand_pools();
    }
    let ledger = ledger_dir("pools-4000");
    let out = run(&mut child(
        "four_thousand_pools_of_one_small_allocation_each_are_charged_their_reserve",
        &ledger,
        Some("1Gi"),
    ))
    .passed();
    assert!(out.stdout.contains("child checked 4000 pools"), "{out}");
    assert!(
        out.cuvisor_lines().iter().all(|l| l.contains("refused")),
        "only refusal lines\n{out}"
    );
    assert_eq!(ledger_used(&ledger), vec![0]);
}

fn huge_threshold() {
    setup();
    let phys = Physical::new();
    let mut pool = null_mut();
    // SAFETY: (all calls in this body) the driver API's contract, with valid out-pointers and
    // handles the driver returned.
    unsafe {
        ok(cu::cuDeviceGetMemPool(&mut pool, 0));
        set_threshold(pool, 1 << 50);
        let mut p = 0;
        ok(cu::cuMemAllocAsync(
            &mut p,
            (768 * MIB) as usize,
            null_mut(),
        ));
        ok(cu::cuMemFreeAsync(p, null_mut()));
        ok(cu::cuStreamSynchronize(null_mut()));
        use cu::CUmemPool_attribute::*;
        assert_eq!(
            pool_attr(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT),
            768 * MIB,
            "under its threshold the pool keeps what was freed, past the sync"
        );
        assert_eq!(phys.held(), 768 * MIB);
        assert_eq!(
            free_mem(),
            GIB - 768 * MIB,
            "what the pool keeps reserved is charged"
        );
        // Memory the pool keeps cannot be had twice: a plain allocation of the same size only
        // fits once the pool has let its reserve go (cuvisor trims it, the quota being full).
        ok(cu::cuMemAlloc_v2(&mut p, (768 * MIB) as usize));
        phys.within(GIB, "a plain allocation beside the kept reserve");
        assert_eq!(pool_attr(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT), 0);
        ok(cu::cuMemFree_v2(p));
        // From the pool again, then a stream-ordered free: still charged after the sync.
        ok(cu::cuMemAllocAsync(
            &mut p,
            (512 * MIB) as usize,
            null_mut(),
        ));
        ok(cu::cuMemFreeAsync(p, null_mut()));
        ok(cu::cuCtxSynchronize());
        assert_eq!(free_mem(), GIB - 512 * MIB);
        let (mut q, other) = (0, create_pool());
        assert_eq!(
            cu::cuMemAllocFromPoolAsync(&mut q, (768 * MIB) as usize, other, null_mut()),
            CUDA_SUCCESS,
            "another pool's allocation fits once the kept reserve is trimmed"
        );
        phys.within(GIB, "a second pool beside the kept reserve");
        ok(cu::cuMemFreeAsync(q, null_mut()));
        ok(cu::cuMemPoolDestroy(other));
        set_threshold(pool, 0);
        ok(cu::cuStreamSynchronize(null_mut()));
    }
    assert_eq!(phys.held(), 0);
    assert_eq!(free_mem(), GIB);
    println!("child checked the threshold");
}

#[test]
fn a_huge_release_threshold_keeps_freed_pool_memory_charged() {
    if is_child() {
        return huge_threshold();
    }
    let ledger = ledger_dir("pools-threshold");
    let out = run(&mut child(
        "a_huge_release_threshold_keeps_freed_pool_memory_charged",
        &ledger,
        Some("1Gi"),
    ))
    .passed();
    assert!(out.stdout.contains("child checked the threshold"), "{out}");
    assert_eq!(ledger_used(&ledger), vec![0]);
}

fn no_sync() {
    setup();
    let phys = Physical::new();
    let chunk = (900 * MIB) as usize;
    // SAFETY: (all calls in this body) the driver API's contract, with valid out-pointers and
    // handles the driver returned.
    unsafe {
        let mut pools = Vec::new();
        for i in 0..4 {
            let pool = create_pool();
            pools.push(pool);
            let mut p = 0;
            ok(cu::cuMemAllocFromPoolAsync(&mut p, chunk, pool, null_mut()));
            phys.within(GIB, &format!("pool {i} allocated"));
            ok(cu::cuMemFreeAsync(p, null_mut()));
            phys.within(GIB, &format!("pool {i} freed, no sync"));
        }
        let mut p = 0;
        ok(cu::cuMemAllocAsync(&mut p, chunk, null_mut()));
        phys.within(GIB, "the default pool");
        ok(cu::cuMemFreeAsync(p, null_mut()));
        ok(cu::cuMemAlloc_v2(&mut p, chunk));
        phys.within(GIB, "a plain allocation");
        ok(cu::cuMemFree_v2(p));
        ok(cu::cuStreamSynchronize(null_mut()));
        for pool in pools {
            ok(cu::cuMemPoolDestroy(pool));
        }
    }
    assert_eq!(phys.held(), 0);
    assert_eq!(ledger_of_child(), vec![0]);
    println!("child checked alloc and free without a sync");
}

#[test]
fn async_alloc_and_free_without_a_sync_never_hold_more_than_the_quota() {
    if is_child() {
        return no_sync();
    }
    let ledger = ledger_dir("pools-nosync");
    let out = run(&mut child(
        "async_alloc_and_free_without_a_sync_never_hold_more_than_the_quota",
        &ledger,
        Some("1Gi"),
    ))
    .passed();
    assert!(
        out.stdout
            .contains("child checked alloc and free without a sync"),
        "{out}"
    );
    assert_eq!(ledger_used(&ledger), vec![0]);
}

fn destroyed_with_live_allocation() {
    setup();
    let phys = Physical::new();
    // SAFETY: (all calls in this body) the driver API's contract, with valid out-pointers and
    // handles the driver returned.
    unsafe {
        let pool = create_pool();
        let mut p = 0;
        ok(cu::cuMemAllocFromPoolAsync(
            &mut p,
            (768 * MIB) as usize,
            pool,
            null_mut(),
        ));
        // The driver returns at once; the memory lives until the allocation is freed.
        ok(cu::cuMemPoolDestroy(pool));
        assert_eq!(phys.held(), 768 * MIB);
        let mut q = 0;
        assert_eq!(
            cu::cuMemAlloc_v2(&mut q, (768 * MIB) as usize),
            CUDA_ERROR_OUT_OF_MEMORY,
            "a destroyed pool's live allocation is still charged"
        );
        phys.within(GIB, "after the destroy");
        ok(cu::cuMemFreeAsync(p, null_mut()));
        ok(cu::cuStreamSynchronize(null_mut()));
        assert_eq!(phys.held(), 0);
        ok(cu::cuMemAlloc_v2(&mut q, (768 * MIB) as usize));
        ok(cu::cuMemFree_v2(q));
    }
    assert_eq!(ledger_of_child(), vec![0]);
    println!("child checked the destroyed pool");
}

#[test]
fn destroying_a_pool_with_a_live_allocation_keeps_its_memory_charged() {
    if is_child() {
        return destroyed_with_live_allocation();
    }
    let ledger = ledger_dir("pools-destroy");
    let out = run(&mut child(
        "destroying_a_pool_with_a_live_allocation_keeps_its_memory_charged",
        &ledger,
        Some("1Gi"),
    ))
    .passed();
    assert!(
        out.stdout.contains("child checked the destroyed pool"),
        "{out}"
    );
}

fn export_release() {
    setup();
    let phys = Physical::new();
    // SAFETY: (all calls in this body) the driver API's contract, with valid out-pointers,
    // descriptors, and handles the driver returned.
    unsafe {
        let mut prop: cu::CUmemAllocationProp = std::mem::zeroed();
        prop.type_ = cu::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location.type_ = cu::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        prop.requestedHandleTypes =
            cu::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        let fd_type = cu::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        let mut imports = Vec::new();
        let mut fds = Vec::new();
        for i in 0..4 {
            let mut h = 0;
            match cu::cuMemCreate(&mut h, (512 * MIB) as usize, &prop, 0) {
                CUDA_SUCCESS => {}
                CUDA_ERROR_OUT_OF_MEMORY => break,
                r => panic!("create {i}: {r:?}"),
            }
            let mut fd: i32 = -1;
            ok(cu::cuMemExportToShareableHandle(
                &mut fd as *mut i32 as *mut c_void,
                h,
                fd_type,
                0,
            ));
            // The importer could be another process (another container); here it is this one.
            let mut imported = 0;
            ok(cu::cuMemImportFromShareableHandle(
                &mut imported,
                fd as usize as *mut c_void,
                fd_type,
            ));
            ok(cu::cuMemRelease(h));
            imports.push(imported);
            fds.push(fd);
            phys.within(GIB, &format!("export {i}, exporter released"));
        }
        assert_eq!(
            imports.len(),
            2,
            "released but still imported: the memory is alive, and so is its charge"
        );
        for h in imports {
            ok(cu::cuMemRelease(h));
        }
        for fd in fds {
            libc::close(fd);
        }
    }
    assert_eq!(
        phys.held(),
        0,
        "the last handle released, the memory is gone"
    );
    // The process cannot know when every imported copy is gone: exported memory stays charged
    // until it exits (README, "What is counted").
    assert_eq!(ledger_of_child(), vec![GIB]);
    println!("child checked export and release");
}

#[test]
fn export_then_release_keeps_the_exported_memory_charged() {
    if is_child() {
        return export_release();
    }
    let ledger = ledger_dir("vmm-export");
    let out = run(&mut child(
        "export_then_release_keeps_the_exported_memory_charged",
        &ledger,
        Some("1Gi"),
    ))
    .passed();
    assert!(
        out.stdout.contains("child checked export and release"),
        "{out}"
    );
    assert_eq!(ledger_used(&ledger), vec![0], "given back when it exited");
}

/// Child body: two threads make random pool calls (create, allocate from a pool or the
/// default one, free stream-ordered or plain, trim, set the threshold, destroy, synchronize)
/// under a 256 MiB quota while a third watches the simulator's count of memory in use.
fn random_pool_calls() {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
    use std::sync::{Arc, RwLock};
    const QUOTA: u64 = 256 * MIB;
    let ctx = setup();
    let phys = Arc::new(Physical::new());
    let stop = Arc::new(AtomicBool::new(false));
    let peak = Arc::new(AtomicU64::new(0));
    let watcher = {
        let (phys, stop, peak) = (phys.clone(), stop.clone(), peak.clone());
        std::thread::spawn(move || {
            while !stop.load(SeqCst) {
                peak.fetch_max(phys.held(), SeqCst);
            }
        })
    };
    // Pools shared by both threads (as handles: usize); destroying one takes the write lock so
    // that no allocation from it is in flight (the program's duty, not cuvisor's).
    let pools: Arc<RwLock<Vec<usize>>> = Arc::new(RwLock::new(Vec::new()));
    let counts = Arc::new([AtomicU64::new(0), AtomicU64::new(0)]);
    let workers: Vec<_> = (0..2u64)
        .map(|t| {
            let (pools, counts, ctx) = (pools.clone(), counts.clone(), ctx as usize);
            std::thread::spawn(move || {
                // SAFETY: (all calls in this closure) the driver API's contract, with valid
                // out-pointers and handles the driver returned.
                unsafe {
                    ok(cu::cuCtxSetCurrent(ctx as cu::CUcontext));
                    let mut rng =
                        0x9E37_79B9_7F4A_7C15u64 ^ (t + 1).wrapping_mul(0xD1B5_4A32_D192_ED03);
                    let mut next = move |n: u64| {
                        rng ^= rng << 13;
                        rng ^= rng >> 7;
                        rng ^= rng << 17;
                        rng % n
                    };
                    let mut mine: Vec<u64> = Vec::new();
                    let pick = |v: &Vec<usize>, i: u64| v[(i % v.len() as u64) as usize];
                    for _ in 0..600 {
                        let size = match next(4) {
                            0 => 1 + next(4096),
                            1 => 1 + next(3 * MIB),
                            _ => 1 + next(40 * MIB),
                        } as usize;
                        match next(20) {
                            0..=1 => {
                                let mut v = pools.write().unwrap();
                                if v.len() < 6 {
                                    v.push(create_pool() as usize);
                                }
                            }
                            2..=7 => {
                                let v = pools.read().unwrap();
                                if v.is_empty() {
                                    continue;
                                }
                                let pool = pick(&v, next(1000)) as cu::CUmemoryPool;
                                let mut p = 0;
                                match cu::cuMemAllocFromPoolAsync(&mut p, size, pool, null_mut()) {
                                    CUDA_SUCCESS => mine.push(p),
                                    CUDA_ERROR_OUT_OF_MEMORY => {
                                        counts[1].fetch_add(1, SeqCst);
                                        continue;
                                    }
                                    r => panic!("alloc from pool: {r:?}"),
                                }
                                counts[0].fetch_add(1, SeqCst);
                            }
                            8..=10 => {
                                let mut p = 0;
                                match cu::cuMemAllocAsync(&mut p, size, null_mut()) {
                                    CUDA_SUCCESS => mine.push(p),
                                    CUDA_ERROR_OUT_OF_MEMORY => {
                                        counts[1].fetch_add(1, SeqCst);
                                        continue;
                                    }
                                    r => panic!("alloc async: {r:?}"),
                                }
                                counts[0].fetch_add(1, SeqCst);
                            }
                            11..=14 if !mine.is_empty() => {
                                let p = mine.swap_remove(next(mine.len() as u64) as usize);
                                if next(3) == 0 {
                                    ok(cu::cuMemFree_v2(p));
                                } else {
                                    ok(cu::cuMemFreeAsync(p, null_mut()));
                                }
                            }
                            15 => {
                                let v = pools.read().unwrap();
                                if !v.is_empty() {
                                    let pool = pick(&v, next(1000)) as cu::CUmemoryPool;
                                    ok(cu::cuMemPoolTrimTo(pool, next(64 * MIB) as usize));
                                }
                            }
                            16 => {
                                let v = pools.read().unwrap();
                                let mut pool = null_mut();
                                ok(cu::cuDeviceGetMemPool(&mut pool, 0));
                                if !v.is_empty() && next(2) == 0 {
                                    pool = pick(&v, next(1000)) as cu::CUmemoryPool;
                                }
                                let t = [0, 8 * MIB, 1 << 50][next(3) as usize];
                                set_threshold(pool, t);
                            }
                            17 => {
                                let mut v = pools.write().unwrap();
                                if !v.is_empty() {
                                    let i = next(v.len() as u64) as usize;
                                    // Live allocations from it may remain: they keep its memory.
                                    ok(cu::cuMemPoolDestroy(v.swap_remove(i) as cu::CUmemoryPool));
                                }
                            }
                            _ => match next(3) {
                                0 => ok(cu::cuStreamSynchronize(null_mut())),
                                1 => ok(cu::cuCtxSynchronize()),
                                _ => {
                                    let mut ev = null_mut();
                                    ok(cu::cuEventCreate(&mut ev, 0));
                                    ok(cu::cuEventRecord(ev, null_mut()));
                                    ok(cu::cuEventSynchronize(ev));
                                    ok(cu::cuEventDestroy_v2(ev));
                                }
                            },
                        }
                    }
                    for p in mine {
                        ok(cu::cuMemFreeAsync(p, null_mut()));
                    }
                }
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    // SAFETY: the driver API's contract, with pools the driver returned.
    unsafe {
        ok(cu::cuStreamSynchronize(null_mut()));
        for pool in pools.write().unwrap().drain(..) {
            ok(cu::cuMemPoolTrimTo(pool as cu::CUmemoryPool, 0));
            ok(cu::cuMemPoolDestroy(pool as cu::CUmemoryPool));
        }
        let mut pool = null_mut();
        ok(cu::cuDeviceGetMemPool(&mut pool, 0));
        ok(cu::cuMemPoolTrimTo(pool, 0));
    }
    stop.store(true, SeqCst);
    watcher.join().unwrap();
    let (fitted, refused) = (counts[0].load(SeqCst), counts[1].load(SeqCst));
    println!(
        "allocations fitted {fitted} refused {refused}, peak {} MiB",
        peak.load(SeqCst) / MIB
    );
    assert!(
        peak.load(SeqCst) <= QUOTA,
        "{} MiB physically held at the peak under a {} MiB quota",
        peak.load(SeqCst) / MIB,
        QUOTA / MIB
    );
    assert!(
        fitted > 0 && refused > 0,
        "the load must both fit and overflow the quota"
    );
    assert_eq!(phys.held(), 0, "everything freed and trimmed");
    // A free gives nothing back by itself; a memory query settles the pools.
    std::thread::sleep(std::time::Duration::from_millis(150));
    assert_eq!(free_mem(), QUOTA);
    assert_eq!(
        ledger_of_child(),
        vec![0],
        "the ledger is back to exactly 0"
    );
    println!("child checked random pool calls");
}

#[test]
fn random_pool_calls_on_two_threads_never_hold_more_than_the_quota() {
    if is_child() {
        return random_pool_calls();
    }
    let ledger = ledger_dir("pools-random");
    let out = run(&mut child(
        "random_pool_calls_on_two_threads_never_hold_more_than_the_quota",
        &ledger,
        Some("256Mi"),
    ))
    .passed();
    assert!(
        out.stdout.contains("child checked random pool calls"),
        "{out}"
    );
    let summary = out
        .stdout
        .lines()
        .find(|l| l.contains("allocations fitted"));
    println!("{}", summary.unwrap_or_default());
    assert_eq!(ledger_used(&ledger), vec![0]);
}

fn other_device_stream() {
    // SAFETY: (all calls in this body) the driver API's contract, with valid out-pointers and
    // handles the driver returned.
    unsafe {
        ok(cu::cuInit(0));
        let (mut c0, mut c1) = (null_mut(), null_mut());
        ok(cu::cuDevicePrimaryCtxRetain(&mut c0, 0));
        ok(cu::cuDevicePrimaryCtxRetain(&mut c1, 1));
        ok(cu::cuCtxSetCurrent(c0));
        let mut s0 = null_mut();
        ok(cu::cuStreamCreate(&mut s0, 0));
        let phys = std::sync::Arc::new(Physical::on("dgx1-v100", 0));
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let watcher = {
            let (phys, stop) = (phys.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut peak = 0;
                while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                    peak = peak.max(phys.held());
                }
                peak
            })
        };
        // GPU 1 current, a stream of GPU 0: the memory comes from GPU 0's pool.
        ok(cu::cuCtxSetCurrent(c1));
        let mut p = 0;
        ok(cu::cuMemAllocAsync(&mut p, (768 * MIB) as usize, s0));
        assert_eq!(phys.held(), 768 * MIB);
        assert_eq!(free_mem(), GIB, "GPU 1's quota is untouched");
        ok(cu::cuCtxSetCurrent(c0));
        assert_eq!(free_mem(), GIB - 768 * MIB, "GPU 0's quota is charged");
        ok(cu::cuCtxSetCurrent(c1));
        let mut q = 0;
        assert_eq!(
            cu::cuMemAllocAsync(&mut q, (768 * MIB) as usize, s0),
            CUDA_ERROR_OUT_OF_MEMORY,
            "GPU 0's quota is full, whatever is current"
        );
        stop.store(true, std::sync::atomic::Ordering::SeqCst);
        let peak = watcher.join().unwrap();
        assert!(peak <= GIB, "{} MiB held on GPU 0 at the peak", peak / MIB);
        ok(cu::cuMemFreeAsync(p, s0));
        ok(cu::cuStreamSynchronize(s0));
        ok(cu::cuCtxSetCurrent(c0));
        assert_eq!(free_mem(), GIB);
        ok(cu::cuStreamDestroy_v2(s0));
    }
    println!("child checked the other device's stream");
}

#[test]
fn an_async_allocation_on_another_devices_stream_is_charged_to_that_device() {
    if is_child() {
        return other_device_stream();
    }
    let ledger = ledger_dir("pools-other-device");
    let mut cmd =
        Child::new("an_async_allocation_on_another_devices_stream_is_charged_to_that_device")
            .preset("dgx1-v100")
            .command();
    cuvisor_env(&mut cmd, &ledger, Some("0=1Gi,1=1Gi"));
    let out = run(&mut cmd).passed();
    assert!(
        out.stdout
            .contains("child checked the other device's stream"),
        "{out}"
    );
}

// ---- every versioned form of a wrapped entry point -----------------------------------------------

/// Versioned forms of wrapped base names that libcuvisor deliberately leaves to the driver, each
/// with the reason: none of them takes device memory a wrapper would have to charge.
const DELIBERATELY_UNWRAPPED: &[(&str, &str)] = &[(
    "cuCtxDestroy",
    "the CUDA 2.x/3.x form (cuGetProcAddress below 4000): a context it destroys keeps its \
     reserve charged until the process exits, an over-count, never an escape",
)];

/// A child of `every_versioned_form_of_a_wrapped_entry_point_is_wrapped_or_deliberately_not`:
/// asks cuGetProcAddress_v2 (through libcuvisor) for every base name in CUVISOR_TEST_BASES at
/// every CUDA version from 2000 to 13050 and every flag, and prints where each answer lies.
fn gpa_sweep() {
    type Gpa = unsafe extern "C" fn(*const i8, *mut *mut c_void, i32, u64, *mut i32) -> R;
    let gpa: Gpa = global_sym(c"cuGetProcAddress_v2");
    let bases = std::env::var("CUVISOR_TEST_BASES").unwrap();
    let mut out = String::new();
    for base in bases.split(',') {
        let name = std::ffi::CString::new(base).unwrap();
        for version in (2000..=13050).step_by(10) {
            for flags in [0u64, 1, 2] {
                let (mut p, mut status) = (null_mut(), 0);
                // SAFETY: cuGetProcAddress_v2 with a NUL-terminated name and valid out-pointers.
                if unsafe { gpa(name.as_ptr(), &mut p, version, flags, &mut status) }
                    != CUDA_SUCCESS
                    || p.is_null()
                {
                    continue;
                }
                let mut info: libc::Dl_info = libc_dl_info();
                // SAFETY: dladdr only reads the address and fills `info`, which we own.
                let exact = unsafe { libc::dladdr(p, &mut info) } != 0
                    && !info.dli_sname.is_null()
                    && info.dli_saddr == p;
                let (lib, sym) = if exact {
                    // SAFETY: the loader's NUL-terminated strings, alive while the objects are.
                    unsafe {
                        (
                            std::ffi::CStr::from_ptr(info.dli_fname).to_string_lossy(),
                            std::ffi::CStr::from_ptr(info.dli_sname).to_string_lossy(),
                        )
                    }
                } else {
                    ("?".into(), "?".into())
                };
                let lib = if lib.contains("libcuvisor") {
                    "libcuvisor"
                } else if lib.contains("libcuda") {
                    "libcuda"
                } else {
                    &lib
                };
                out += &format!("gpa {base} {version} {flags} {lib} {sym}\n");
            }
        }
    }
    print!("{out}");
}

fn libc_dl_info() -> libc::Dl_info {
    libc::Dl_info {
        dli_fname: std::ptr::null(),
        dli_fbase: null_mut(),
        dli_sname: std::ptr::null(),
        dli_saddr: null_mut(),
    }
}

/// The entry points libcuvisor.so exports (`nm -D --defined-only`): its wrappers.
fn wrapped_names() -> std::collections::BTreeSet<String> {
    let out = Command::new("nm")
        .args(["-D", "--defined-only"])
        .arg(libcuvisor())
        .output()
        .expect("nm (binutils) lists libcuvisor.so's exports");
    assert!(
        out.status.success(),
        "nm: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().nth(2))
        .filter(|n| n.starts_with("cu"))
        .map(String::from)
        .collect()
}

/// `cuMemAlloc_v2` -> `cuMemAlloc`, `cuLaunchKernel_ptsz` -> `cuLaunchKernel`.
fn base_name(n: &str) -> &str {
    let n = n
        .strip_suffix("_ptsz")
        .or(n.strip_suffix("_ptds"))
        .unwrap_or(n);
    match n.rsplit_once("_v") {
        Some((b, v)) if !v.is_empty() && v.chars().all(|c| c.is_ascii_digit()) => b,
        _ => n,
    }
}

/// The real driver hands out old ABI versions by `cudaVersion` (cuMemAlloc@2000 is the 32-bit
/// v1, cuArrayCreate@2000 takes 32-bit extents): a program that asks for one must still reach a
/// wrapper, or its memory goes uncharged. For every base name libcuvisor wraps, at every CUDA
/// version and flag, the answer lies in libcuvisor, or is listed in DELIBERATELY_UNWRAPPED with
/// its reason. (cuArrayCreate, cuArray3DCreate and cuCtxCreate at 2000 were not wrapped.)
#[test]
fn every_versioned_form_of_a_wrapped_entry_point_is_wrapped_or_deliberately_not() {
    if is_child() {
        return gpa_sweep();
    }
    let wrapped = wrapped_names();
    let bases: std::collections::BTreeSet<&str> = wrapped.iter().map(|n| base_name(n)).collect();
    let bases: Vec<&str> = bases.into_iter().collect();
    let ledger = ledger_dir("gpa-sweep");
    let out = run(child(
        "every_versioned_form_of_a_wrapped_entry_point_is_wrapped_or_deliberately_not",
        &ledger,
        Some("1Gi"),
    )
    .env("CUVISOR_TEST_BASES", bases.join(",")))
    .success();
    let mut answers = 0;
    let mut unwrapped = std::collections::BTreeSet::new();
    let mut stubs = std::collections::BTreeSet::new();
    for l in out.stdout.lines().filter(|l| l.starts_with("gpa ")) {
        let f: Vec<&str> = l.split(' ').collect();
        let (base, version, lib, sym) = (f[1], f[2], f[4], f[5]);
        answers += 1;
        match lib {
            "libcuvisor" => {}
            "libcuda" if wrapped.contains(sym) => {
                panic!("{base}@{version}: the driver's own {sym}, though libcuvisor wraps it: {l}")
            }
            "libcuda" if DELIBERATELY_UNWRAPPED.iter().any(|(n, _)| *n == sym) => {}
            "libcuda" => {
                unwrapped.insert(format!("{sym} (from {base}@{version})"));
            }
            _ => {
                stubs.insert(base.to_string());
            }
        }
    }
    assert!(
        answers > 10_000,
        "{answers} answers: the sweep did not run\n{out}"
    );
    assert!(
        unwrapped.is_empty(),
        "versioned forms of wrapped entry points that reach the driver unwrapped: {unwrapped:?}"
    );
    println!(
        "{answers} lookups of {} wrapped base names, all wrapped; not implemented by the \
         simulator (its NOT_SUPPORTED stub): {stubs:?}",
        bases.len()
    );
}

// ---- 10. ways past the wrappers through the dynamic loader (issue 15) -------------------------

/// tests/c/driver_bypass.c in `mode`, under a 1 GiB quota, with a copy of libcuda.so.1 at
/// another path ($COPY) and the RTLD_DEEPBIND libraries ($DEEP, $DEEP_PLAIN) at hand.
fn bypass(mode: &str) -> Out {
    let sim = sim_dir();
    // Per mode: tests run in parallel, and must not rewrite a file another is running.
    let tmp = std::env::temp_dir();
    // "deepbind-plain-runpath": the plain library by its bare name, found through the
    // program's DT_RUNPATH (the caller's, which glibc searches for dlopen).
    let (c_mode, runpath) = match mode {
        "deepbind-plain-runpath" => ("deepbind-plain", true),
        m => (m, false),
    };
    let rpath = format!("-Wl,-rpath,{},--enable-new-dtags", tmp.display());
    let mut flags = vec!["-ldl", "-Wl,--export-dynamic"];
    if runpath {
        flags.push(&rpath);
    }
    let exe = compile_c_variant("driver_bypass", &format!("-{mode}"), &flags);
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/c/deepbind_lib.c");
    let shared = |name: &str, extra: &[&str]| {
        let out = std::env::temp_dir().join(format!("lib{name}-{mode}-{}.so", std::process::id()));
        let status = Command::new("cc")
            .args(["-O1", "-Wall", "-Werror", "-shared", "-fPIC", "-o"])
            .arg(&out)
            .arg(&src)
            .args(extra)
            .status()
            .expect("cc");
        assert!(status.success());
        out
    };
    let deep = shared("deep", &["-L", sim.to_str().unwrap(), "-lcuda"]);
    let plain = shared("deepplain", &["-DPLAIN"]);
    let copy_dir =
        std::env::temp_dir().join(format!("cuvisor-e2e-copy-{mode}-{}", std::process::id()));
    std::fs::create_dir_all(&copy_dir).unwrap();
    let copy = copy_dir.join("libcuda.so.1");
    std::fs::copy(sim.join("libcuda.so.1"), &copy).unwrap();
    let tag = format!("bypass-{mode}");
    let ledger = ledger_dir(&tag);
    let mut cmd = under_cuvisor(&exe, &tag, &ledger, Some("1Gi"));
    let plain = if runpath {
        PathBuf::from(plain.file_name().unwrap())
    } else {
        plain
    };
    cmd.arg(c_mode)
        .env("COPY", &copy)
        .env("DEEP", &deep)
        .env("DEEP_PLAIN", &plain);
    let out = run(&mut cmd).success();
    if out.stdout.contains("total ") {
        assert_eq!(
            ledger_used(&ledger),
            vec![0],
            "{mode}: all given back\n{out}"
        );
    }
    out
}

/// The allocation entry point the mode resolved is cuvisor's wrapper, and the quota binds.
fn held_to_the_quota(mode: &str, out: &Out) {
    assert!(out.stdout.contains("which libcuvisor.so"), "{mode}: {out}");
    assert_eq!(
        out.number("total", "total"),
        GIB,
        "{mode}: 1 GiB quota\n{out}"
    );
}

#[test]
fn glibcs_own_dlsym_taken_with_dlvsym_or_from_libcs_handle_does_not_see_past_the_wrappers() {
    for mode in ["dlvsym-2.34", "dlvsym-2.2.5", "libc-dlsym", "libc-dlvsym"] {
        let out = bypass(mode);
        assert!(
            out.stdout.contains("dlsym-from libcuvisor.so"),
            "{mode}: the lookup handed out is cuvisor's\n{out}"
        );
        if mode == "libc-dlvsym" {
            assert!(out.stdout.contains("dlvsym-from libcuvisor.so"), "{out}");
        }
        held_to_the_quota(mode, &out);
    }
}

#[test]
fn dlvsym_of_a_wrapped_name_on_the_drivers_handle_is_the_wrapper() {
    held_to_the_quota("dlvsym-driver", &bypass("dlvsym-driver"));
}

#[test]
fn dlopen_of_libcuda_by_its_full_path_is_the_same_handle_and_stays_wrapped() {
    let out = bypass("full-path");
    assert!(out.stdout.contains("same-handle yes"), "{out}");
    held_to_the_quota("full-path", &out);
}

#[test]
fn a_copy_of_libcuda_at_another_path_answers_with_the_wrappers_and_the_first_driver() {
    let out = bypass("copy");
    assert!(
        out.stdout.contains("same-handle no"),
        "a second instance\n{out}"
    );
    assert!(out.stdout.contains("copy-dlvsym libcuvisor.so"), "{out}");
    assert!(out.stdout.contains("copy-cuInit primary"), "{out}");
    held_to_the_quota("copy", &out);
}

#[test]
fn rtld_deepbind_of_a_library_that_links_libcuda_binds_it_to_the_wrappers() {
    let out = bypass("deepbind");
    held_to_the_quota("deepbind", &out);
    let notes = out.cuvisor_lines();
    assert!(
        notes.iter().any(|l| l.contains("RTLD_DEEPBIND dropped")),
        "one line says so\n{out}"
    );
    // A library that does not bring the driver in keeps its deep binding, silently.
    // Also when the program names it bare and the loader finds it through the program's
    // DT_RUNPATH (which cuvisor reads from the calling object).
    for mode in ["deepbind-plain", "deepbind-plain-runpath"] {
        let out = bypass(mode);
        assert!(out.stdout.contains("deep-bound yes"), "{mode}: {out}");
        assert!(out.cuvisor_lines().is_empty(), "{mode}: {out}");
    }
}

#[test]
fn dlmopen_of_libcuda_into_a_new_namespace_is_refused() {
    let out = bypass("dlmopen");
    assert!(out.stdout.contains("dlmopen refused"), "{out}");
    assert!(
        out.cuvisor_lines()
            .iter()
            .any(|l| l.contains("dlmopen of libcuda.so.1")),
        "{out}"
    );
}

// ---- 11. fork and vfork after allocating (issue 15) --------------------------------------------

/// tests/c/fork_after_alloc.c: the parent holds 512 MiB of a 1 GiB quota and makes a child by
/// `mode`; after the child is gone the parent's charges are exactly what they were, a free gives
/// back exactly its size, the rest of the quota can be filled, and everything comes back.
fn parent_charges_exact_after(mode: &str) {
    let sim = sim_dir();
    let exe = compile_c_variant(
        "fork_after_alloc",
        &format!("-{mode}"),
        &["-L", sim.to_str().unwrap(), "-lcuda", "-lpthread"],
    );
    let tag = format!("fork-{mode}");
    let ledger = ledger_dir(&tag);
    let out = run(under_cuvisor(&exe, &tag, &ledger, Some("1Gi")).arg(mode)).success();
    let half = GIB / 2;
    assert_eq!(out.number("before", "before"), half, "{mode}\n{out}");
    assert_eq!(
        out.number("free", "free"),
        half,
        "{mode}: the child took nothing back\n{out}"
    );
    assert_eq!(
        out.number("after-free", "after-free"),
        half + 256 * MIB,
        "{mode}: a free gives back its size\n{out}"
    );
    assert_eq!(
        out.number("refill", "refill"),
        GIB - 256 * MIB,
        "{mode}\n{out}"
    );
    assert_eq!(out.number("end", "end"), GIB, "{mode}\n{out}");
    assert_eq!(
        ledger_used(&ledger),
        vec![0],
        "{mode}: all given back at exit\n{out}"
    );
}

#[test]
fn a_forked_child_that_exits_leaves_the_parents_charges_exact() {
    parent_charges_exact_after("fork-exit");
    parent_charges_exact_after("fork-_exit");
}

#[test]
fn a_vforked_child_that_calls_exit_leaves_the_parents_charges_exact() {
    parent_charges_exact_after("vfork-exit");
}

#[test]
fn a_forked_child_that_execs_leaves_the_parents_charges_exact() {
    parent_charges_exact_after("fork-exec");
}

// ---- CUDA graph memory: charged when the driver takes it (at launch), not at capture ----------

/// A graph memory attribute of device 0, straight from the driver.
fn graph_reserved() -> u64 {
    let mut v = 0u64;
    // SAFETY: cuDeviceGetGraphMemAttribute with a valid out-value.
    unsafe {
        ok(cu::cuDeviceGetGraphMemAttribute(
            0,
            cu::CUgraphMem_attribute::CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT,
            &mut v as *mut u64 as *mut c_void,
        ))
    };
    v
}

/// A graph of one memory-allocation node of `bytes` on device 0, instantiated; (exec, address).
fn graph_with_alloc_node(bytes: u64, free_inside: bool) -> (cu::CUgraphExec, cu::CUdeviceptr) {
    // SAFETY: the driver API's contract: zeroed params (null pointers, zero counts) filled in,
    // valid out-pointers.
    unsafe {
        let mut g = null_mut();
        ok(cu::cuGraphCreate(&mut g, 0));
        let mut p: cu::CUDA_MEM_ALLOC_NODE_PARAMS = std::mem::zeroed();
        p.poolProps.allocType = cu::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        p.poolProps.location.type_ = cu::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        p.bytesize = bytes as usize;
        let mut node = null_mut();
        ok(cu::cuGraphAddMemAllocNode(
            &mut node,
            g,
            null_mut(),
            0,
            &mut p,
        ));
        if free_inside {
            let mut f = null_mut();
            ok(cu::cuGraphAddMemFreeNode(&mut f, g, &node, 1, p.dptr));
        }
        let mut exec = null_mut();
        ok(cu::cuGraphInstantiateWithFlags(&mut exec, g, 0));
        (exec, p.dptr)
    }
}

fn graph_alloc_nodes_at_launch() {
    setup();
    assert_eq!(free_mem(), GIB, "the 1 GiB quota");
    // SAFETY: the driver API's contract, with valid out-pointers and handles it returned.
    unsafe {
        let mut s = null_mut();
        ok(cu::cuStreamCreate(&mut s, 0));
        let (big, _) = graph_with_alloc_node(3 * GIB, false);
        assert_eq!(free_mem(), GIB, "nothing taken before the graph runs");
        assert_eq!(cu::cuGraphUpload(big, s), CUDA_ERROR_OUT_OF_MEMORY);
        assert_eq!(cu::cuGraphLaunch(big, s), CUDA_ERROR_OUT_OF_MEMORY);
        assert_eq!(graph_reserved(), 0, "the driver never took it");
        let (small, dptr) = graph_with_alloc_node(512 * MIB, false);
        ok(cu::cuGraphLaunch(small, s));
        assert_eq!(graph_reserved(), 512 * MIB);
        assert_eq!(
            free_mem(),
            512 * MIB,
            "the graph's memory is the container's"
        );
        let mut p = 0;
        assert_eq!(
            cu::cuMemAlloc_v2(&mut p, 600 << 20),
            CUDA_ERROR_OUT_OF_MEMORY,
            "no room left beside the graph's memory"
        );
        ok(cu::cuMemFree_v2(dptr));
        ok(cu::cuGraphExecDestroy(small));
        ok(cu::cuGraphExecDestroy(big));
    }
    println!("graph held to the quota");
}

#[test]
fn a_graph_with_mem_alloc_nodes_is_held_to_the_quota_at_launch() {
    if is_child() {
        return graph_alloc_nodes_at_launch();
    }
    let ledger = ledger_dir("graph-nodes");
    let out = run(&mut child(
        "a_graph_with_mem_alloc_nodes_is_held_to_the_quota_at_launch",
        &ledger,
        Some("1Gi"),
    ))
    .passed();
    assert!(out.stdout.contains("graph held to the quota"), "{out}");
    let refusals: Vec<&str> = out
        .stderr
        .lines()
        .filter(|l| l.starts_with("cuvisor: ") && l.contains("refused"))
        .collect();
    assert!(
        refusals
            .iter()
            .any(|l| l.contains("cuGraphUpload") || l.contains("cuGraphLaunch")),
        "one line names the refused graph call: {out}"
    );
}

fn captured_allocations() {
    setup();
    // SAFETY: the driver API's contract, with valid out-pointers and handles it returned.
    unsafe {
        let mut held = 0;
        ok(cu::cuMemAlloc_v2(&mut held, 900 << 20));
        let mut s = null_mut();
        ok(cu::cuStreamCreate(&mut s, 0));
        ok(cu::cuStreamBeginCapture_v2(
            s,
            cu::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL,
        ));
        let (mut a, mut b) = (0, 0);
        // Beside 900 MiB held: capture takes nothing, so it is not refused.
        ok(cu::cuMemAllocAsync(&mut a, 600 << 20, s));
        ok(cu::cuMemAllocAsync(&mut b, 600 << 20, s));
        let mut g = null_mut();
        ok(cu::cuStreamEndCapture(s, &mut g));
        assert_eq!(free_mem(), 124 * MIB, "capture charged nothing");
        let mut exec = null_mut();
        ok(cu::cuGraphInstantiateWithFlags(&mut exec, g, 0));
        assert_eq!(
            cu::cuGraphLaunch(exec, s),
            CUDA_ERROR_OUT_OF_MEMORY,
            "1200 MiB of captured allocations do not fit a 1 GiB quota"
        );
        assert_eq!(graph_reserved(), 0);
        assert_eq!(free_mem(), 124 * MIB, "the refused launch left no charge");
        ok(cu::cuMemFree_v2(held));
        assert_eq!(
            cu::cuGraphLaunch(exec, s),
            CUDA_ERROR_OUT_OF_MEMORY,
            "nor without anything else held"
        );

        // A captured allocation the graph frees itself: charged once, when the graph runs.
        ok(cu::cuStreamBeginCapture_v2(
            s,
            cu::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL,
        ));
        let mut c = 0;
        ok(cu::cuMemAllocAsync(&mut c, 600 << 20, s));
        ok(cu::cuMemFreeAsync(c, s));
        let mut g2 = null_mut();
        ok(cu::cuStreamEndCapture(s, &mut g2));
        assert_eq!(free_mem(), GIB);
        let mut exec2 = null_mut();
        ok(cu::cuGraphInstantiateWithFlags(&mut exec2, g2, 0));
        for _ in 0..3 {
            ok(cu::cuGraphLaunch(exec2, s));
        }
        ok(cu::cuStreamSynchronize(s));
        assert_eq!(
            free_mem(),
            424 * MIB,
            "the graph memory pool keeps it, charged"
        );
        let mut p = 0;
        assert_eq!(
            cu::cuMemAlloc_v2(&mut p, 500 << 20),
            CUDA_ERROR_OUT_OF_MEMORY
        );
    }
    println!("captured allocations charged at launch");
}

#[test]
fn allocations_captured_into_a_graph_are_charged_when_the_graph_runs() {
    if is_child() {
        return captured_allocations();
    }
    let ledger = ledger_dir("graph-capture");
    let out = run(&mut child(
        "allocations_captured_into_a_graph_are_charged_when_the_graph_runs",
        &ledger,
        Some("1Gi"),
    ))
    .passed();
    assert!(
        out.stdout
            .contains("captured allocations charged at launch"),
        "{out}"
    );
}

fn graph_trim() {
    let ctx = setup();
    // SAFETY: the driver API's contract, with valid out-pointers and handles it returned.
    unsafe {
        let mut s = null_mut();
        ok(cu::cuStreamCreate(&mut s, 0));
        let (a, _) = graph_with_alloc_node(600 * MIB, true);
        ok(cu::cuGraphLaunch(a, s));
        ok(cu::cuStreamSynchronize(s));
        assert_eq!(free_mem(), 424 * MIB, "kept by the graph memory pool");
        ok(cu::cuDeviceGraphMemTrim(0));
        assert_eq!(graph_reserved(), 0);
        assert_eq!(free_mem(), GIB, "trimmed: the charge comes back");
        let mut p = 0;
        ok(cu::cuMemAlloc_v2(&mut p, 600 << 20));
        ok(cu::cuMemFree_v2(p));

        // Under pressure, a launch first trims what the pool keeps for nobody.
        ok(cu::cuGraphLaunch(a, s));
        ok(cu::cuStreamSynchronize(s));
        let (b, _) = graph_with_alloc_node(800 * MIB, true);
        ok(cu::cuGraphLaunch(b, s));
        ok(cu::cuStreamSynchronize(s));
        assert_eq!(
            free_mem(),
            224 * MIB,
            "800 MiB reserved, the 600 MiB trimmed"
        );

        // A context's teardown takes the pool with it, and the charge follows.
        let (c, _) = graph_with_alloc_node(100 * MIB, false);
        ok(cu::cuGraphLaunch(c, s));
        ok(cu::cuDevicePrimaryCtxReset_v2(0));
        let _ = ctx;
    }
    setup();
    assert_eq!(free_mem(), GIB, "nothing left charged after the teardown");
    println!("graph memory given back");
}

#[test]
fn device_graph_mem_trim_gives_the_charge_back() {
    if is_child() {
        return graph_trim();
    }
    let ledger = ledger_dir("graph-trim");
    let out = run(&mut child(
        "device_graph_mem_trim_gives_the_charge_back",
        &ledger,
        Some("1Gi"),
    ))
    .passed();
    assert!(out.stdout.contains("graph memory given back"), "{out}");
}
