//! Naming a process for good: a pid alone can be reused after the process dies, so a slot in a
//! shared table records (pid, start time). The start time is /proc/PID/stat field 22 (clock
//! ticks since boot): a new process with the same pid has a later one.

/// Start time of a live (non-zombie) process, or None if there is none with this pid.
pub fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces and parentheses: fields resume after the last ')'.
    let rest = stat.get(stat.rfind(')')? + 2..)?;
    let mut fields = rest.split(' ');
    let state = fields.next()?; // field 3
    if state == "Z" || state == "X" {
        return None; // a zombie holds no GPU memory any more
    }
    fields.nth(18)?.parse().ok() // field 22
}

/// This process's pid namespace: the inode of /proc/self/ns/pid (0 when it cannot be read).
/// Pids mean something only between processes of one namespace.
pub fn pid_namespace() -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self/ns/pid").map_or(0, |m| m.ino())
}

/// This process's identity.
pub fn me() -> (u32, u64) {
    let pid = std::process::id();
    (pid, start_time(pid).unwrap_or(1))
}

/// Whether (pid, start) still names a live process.
pub fn alive(pid: u32, start: u64) -> bool {
    start_time(pid) == Some(start)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_live_process_is_alive_and_a_finished_one_is_not() {
        let (pid, start) = me();
        assert!(alive(pid, start));
        assert!(
            !alive(pid, start + 1),
            "same pid, other start time: another process"
        );
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let cpid = child.id();
        child.wait().unwrap();
        assert_eq!(start_time(cpid), None);
    }
}
