//! The library the plugin injects must load in every tenant image: ld.so refuses, and through
//! `/etc/ld.so.preload` skips, a library that needs a symbol version the image's glibc does not
//! define ("version `GLIBC_2.34' not found"), and a skipped library is a tenant with no quota.
//! So at startup the plugin reads `[host] library`'s version needs (DT_VERNEED, through
//! `cuvisor-elf-needs`) and refuses one that needs a glibc newer than `[host] tenant_glibc`,
//! the oldest glibc of the tenant images (default in config.rs: 2.17, CentOS 7's, the floor
//! scripts/build-shipped.sh builds to; docs/glibc.md).
//!
//! A library that is not there is not checked here (an image's `install_from` may put it there
//! later, and a container whose bind mount has no source is not created: that fails closed).
//! One that is there but is no ELF file is refused: ld.so would skip it.

use cuvisor_elf_needs::GlibcVersion;
use std::io::Read as _;
use std::path::Path;

/// The largest library read (libcuvisor.so is about 10 MiB with its debug lines).
const MAX_LIBRARY_BYTES: u64 = 512 << 20;

/// Why `library` cannot be injected into tenants whose glibc is `tenant_glibc`, or Ok.
pub fn check_library(library: &Path, tenant_glibc: GlibcVersion) -> Result<(), String> {
    check("host.library", library, tenant_glibc)
}

/// The same check on `[host] install_from`, before it is copied over `[host] library`: an image
/// whose library tenants could not load must not replace the one on the node that they can
/// (containers kubelet starts again from its checkpointed answers mount whatever is there).
pub fn check_install_source(source: &Path, tenant_glibc: GlibcVersion) -> Result<(), String> {
    check("host.install_from", source, tenant_glibc)
}

fn check(key: &str, library: &Path, tenant_glibc: GlibcVersion) -> Result<(), String> {
    let shown = library.display();
    let file = match std::fs::File::open(library) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(format!("{key} {shown}: cannot read it: {e}")),
    };
    let mut bytes = Vec::new();
    file.take(MAX_LIBRARY_BYTES)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("{key} {shown}: cannot read it: {e}"))?;
    let needs = cuvisor_elf_needs::parse(&bytes).map_err(|e| {
        format!("{key} {shown}: {e}; ld.so would skip it and tenants would have no quota")
    })?;
    match needs.newest_glibc_needed() {
        Some((newest, need)) if newest > tenant_glibc => Err(format!(
            "{key} {shown} needs glibc {newest} ({} of {}), newer than host.tenant_glibc \
             = \"{tenant_glibc}\": tenant images with that glibc could not load it (build it \
             with scripts/build-shipped.sh, or raise host.tenant_glibc)",
            need.version, need.file
        )),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(tag: &str) -> std::path::PathBuf {
        let d =
            std::env::temp_dir().join(format!("cuvisor-tenant-glibc-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    /// This test program: an ELF file that needs the GLIBC_ versions of the machine it was
    /// built on, at least GLIBC_2.2.5 (x86-64's first) or GLIBC_2.17 (AArch64's).
    fn this_program() -> (std::path::PathBuf, GlibcVersion) {
        let exe = std::env::current_exe().unwrap();
        let d = cuvisor_elf_needs::parse(&std::fs::read(&exe).unwrap()).unwrap();
        let (v, _) = d.newest_glibc_needed().expect("a glibc program");
        (exe, v)
    }

    #[test]
    fn a_library_needing_a_newer_glibc_than_the_tenants_is_refused() {
        let (exe, newest) = this_program();
        assert_eq!(check_library(&exe, newest), Ok(()));
        let older = GlibcVersion::new(newest.major, newest.minor - 1);
        let err = check_library(&exe, older).unwrap_err();
        assert!(
            err.starts_with(&format!(
                "host.library {} needs glibc {newest} (GLIBC_{newest} of ",
                exe.display()
            )) && err.contains(&format!("newer than host.tenant_glibc = \"{older}\""))
                && !err.contains('\n'),
            "{err}"
        );
    }

    #[test]
    fn a_library_that_is_not_elf_is_refused_and_a_missing_one_left_to_the_mount() {
        let d = scratch("not-elf");
        let f = d.join("libcuvisor.so");
        std::fs::write(&f, "not a library\n").unwrap();
        let err = check_library(&f, GlibcVersion::new(2, 17)).unwrap_err();
        assert_eq!(
            err,
            format!(
                "host.library {}: not an ELF file; ld.so would skip it and tenants would have no quota",
                f.display()
            )
        );
        assert_eq!(
            check_library(&d.join("absent.so"), GlibcVersion::new(2, 17)),
            Ok(())
        );
        let _ = std::fs::remove_dir_all(&d);
    }
}
