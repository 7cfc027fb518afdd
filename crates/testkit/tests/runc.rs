//! The container harness on its own (no GPU, no plugin): a container's pid namespace, user,
//! read-only host tree, read-only and read-write mounts (also where the host lacks the mount
//! point, which must then stay missing on the host), a device node, exit codes and kill.

use cuvisor_testkit::container::{self, Container, Spec};
use std::path::PathBuf;
use std::time::Duration;

fn scratch(tag: &str) -> PathBuf {
    cuvisor_testkit::fresh_dir(&format!("runc-{tag}"))
}

#[test]
fn a_shell_in_a_container_sees_what_the_spec_says() {
    if !container::usable("a_shell_in_a_container_sees_what_the_spec_says") {
        return;
    }
    let s = scratch("shell");
    std::fs::write(s.join("ro.txt"), "read-only\n").unwrap();
    std::fs::create_dir(s.join("rw")).unwrap();
    std::fs::set_permissions(
        s.join("rw"),
        std::os::unix::fs::PermissionsExt::from_mode(0o1777),
    )
    .unwrap();
    container::fake_char_device(&s.join("fake0")).unwrap();
    // A mount point the host lacks, inside the read-only host tree.
    let missing = PathBuf::from(format!(
        "/etc/cuvisor-harness-{}/ro.txt",
        std::process::id()
    ));
    assert!(!missing.exists());
    let script = format!(
        "echo pid $$ ppid $PPID uid $(id -u) gid $(id -g) host $(hostname); \
         cat {m}; cat /srv-test/ro.txt; echo x > /srv-test/rw/out && echo wrote rw; \
         (echo x > /srv-test/ro.txt) 2>/dev/null || echo ro refused; \
         (: > /usr/cuvisor-probe) 2>/dev/null || echo host tree refused; \
         test -c /dev/nvidia9 && echo device ok; echo $FOO; exit 7",
        m = missing.display()
    );
    let spec = Spec::new(["/bin/sh", "-c", &script])
        .user(1000, 1000)
        .env("FOO", "bar")
        .mount("/srv-test/ro.txt", s.join("ro.txt"), true)
        .mount("/srv-test/rw", s.join("rw"), false)
        .mount(&missing, s.join("ro.txt"), true)
        .device("/dev/nvidia9", s.join("fake0"), "rw");
    let out = container::run(&spec, Duration::from_secs(60)).unwrap();
    assert_eq!(out.code(), Some(7), "{out}");
    let lines: Vec<&str> = out.stdout.lines().collect();
    assert_eq!(
        lines,
        [
            "pid 1 ppid 0 uid 1000 gid 1000 host cuvisor-tenant",
            "read-only",
            "read-only",
            "wrote rw",
            "ro refused",
            "host tree refused",
            "device ok",
            "bar",
        ],
        "{out}"
    );
    assert_eq!(std::fs::read_to_string(s.join("rw/out")).unwrap(), "x\n");
    assert!(
        !missing.parent().unwrap().exists(),
        "the mount point was made on the host"
    );
    std::fs::remove_dir_all(&s).unwrap();
}

#[test]
fn a_killed_container_ends_with_sigkill() {
    if !container::usable("a_killed_container_ends_with_sigkill") {
        return;
    }
    let mut c = Container::start(&Spec::new(["/bin/sh", "-c", "echo up; exec sleep 600"])).unwrap();
    c.wait_for("up\n", Duration::from_secs(30)).unwrap();
    c.kill().unwrap();
    let out = c.wait(Duration::from_secs(30)).unwrap();
    assert_eq!(out.code(), Some(128 + 9), "{out}");
}
