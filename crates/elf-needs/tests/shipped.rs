//! What cuvisor ships (target/shipped/, built by scripts/build-shipped.sh) holds to the glibc
//! floor: nothing newer than GLIBC_2.17 and no library beyond glibc's own, so it loads in every
//! tenant image CUDA supports (docs/glibc.md). Under CI=true a missing target/shipped/ fails;
//! elsewhere the tests say SKIPPED.

use cuvisor_elf_needs::{parse, GlibcVersion};
use std::io::Write as _;
use std::path::{Path, PathBuf};

/// The oldest glibc of the tenant images (CentOS 7's), the floor HAMi documents too.
const FLOOR: GlibcVersion = GlibcVersion::new(2, 17);

/// glibc's own libraries, which every glibc image has; anything else (libstdc++, libssl, ...)
/// is not in every image.
const GLIBC_LIBRARIES: &[&str] = &[
    "libc.so.6",
    "libdl.so.2",
    "libpthread.so.0",
    "libm.so.6",
    "librt.so.1",
    "libgcc_s.so.1",
    "ld-linux-x86-64.so.2",
    "ld-linux-aarch64.so.1",
];

/// As cuvisor-testkit's `in_ci`: CI set to anything but "", "0" or "false".
fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "0" && v != "false")
}

/// To stderr itself, past the test harness's capture: the report shows in every run.
fn say(line: &str) {
    let _ = writeln!(std::io::stderr(), "{line}");
}

fn shipped(test: &str) -> Option<PathBuf> {
    // The repository's target/, wherever CARGO_TARGET_DIR points: the script writes there.
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/shipped");
    if dir.is_dir() {
        return Some(dir);
    }
    let why = format!(
        "{} does not exist: run scripts/build-shipped.sh first",
        dir.display()
    );
    if in_ci() {
        panic!("{test}: {why}. CI is set, so this fails instead of skipping");
    }
    say(&format!(
        "\n*** SKIPPED {test}: {why} (with CI set this fails) ***\n"
    ));
    None
}

/// The file's needs, one line for the report; Err with every need beyond the floor.
fn check(path: &Path) -> Result<String, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let d = parse(&bytes).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut wrong = Vec::new();
    for n in d.glibc_needs_newer_than(FLOOR) {
        wrong.push(format!(
            "{} {} (newer than GLIBC_{FLOOR})",
            n.file, n.version
        ));
    }
    for lib in &d.needed {
        if !GLIBC_LIBRARIES.contains(&lib.as_str()) {
            wrong.push(format!("{lib} (not one of glibc's own libraries)"));
        }
    }
    let newest = match d.newest_glibc_needed() {
        Some((v, n)) => format!("newest GLIBC_{v} ({})", n.file),
        None => "no glibc version".into(),
    };
    let summary = format!("{}: needs {}; {newest}", path.display(), d.needed.join(" "));
    if wrong.is_empty() {
        Ok(summary)
    } else {
        Err(format!(
            "{summary}\n  beyond the floor: {}",
            wrong.join(", ")
        ))
    }
}

fn check_shipped(test: &str, name: &str) {
    let Some(dir) = shipped(test) else { return };
    match check(&dir.join(name)) {
        Ok(summary) => say(&summary),
        Err(why) => panic!("{why}"),
    }
}

#[test]
fn shipped_libcuvisor_needs_nothing_newer_than_glibc_2_17() {
    check_shipped(
        "shipped_libcuvisor_needs_nothing_newer_than_glibc_2_17",
        "libcuvisor.so",
    );
}

#[test]
fn shipped_device_plugin_needs_nothing_newer_than_glibc_2_17() {
    check_shipped(
        "shipped_device_plugin_needs_nothing_newer_than_glibc_2_17",
        "cuvisor-device-plugin",
    );
}

#[test]
fn shipped_cuvisor_needs_nothing_newer_than_glibc_2_17() {
    check_shipped(
        "shipped_cuvisor_needs_nothing_newer_than_glibc_2_17",
        "cuvisor",
    );
}
