//! The record an exported memory descriptor carries (VMM handles, `vmm.rs`; pools, `pool.rs`):
//! after the memory's bytes, one line `TAG f0 f1 f2 f3\n`, NUL-padded to [`RECORD_LEN`], that a
//! process receiving the descriptor (SCM_RIGHTS, pidfd_getfd) reads to find the device, the
//! size and the shared-state entry (index, generation) behind it. The record starts where the
//! memory ends, so its offset is the memory's size: a reader checks the two agree.

use crate::Res;
use cuvisor_cuda_abi::cuda::{err, CUresult};
use std::ffi::{c_int, c_void};

pub(crate) const RECORD_LEN: usize = 96;

/// Writes the record at offset `at` (the memory's size) of `fd`, the descriptor's own file.
pub(crate) fn write(fd: c_int, at: u64, tag: &str, fields: [i64; 4]) -> Res {
    let [a, b, c, d] = fields;
    let mut rec = format!("{tag} {a} {b} {c} {d}\n").into_bytes();
    if rec.len() > RECORD_LEN {
        return Err(err::UNKNOWN);
    }
    rec.resize(RECORD_LEN, 0);
    // SAFETY: writing our own buffer of RECORD_LEN bytes to a file this process created.
    let n = unsafe {
        libc::pwrite(
            fd,
            rec.as_ptr() as *const c_void,
            RECORD_LEN,
            at as libc::off_t,
        )
    };
    if n != RECORD_LEN as isize {
        return Err(err::OUT_OF_MEMORY);
    }
    Ok(())
}

/// The record at the end of `fd` (a descriptor the program handed in): its fields and where it
/// starts. CUDA_ERROR_INVALID_VALUE for anything that is not a record of `tag`.
pub(crate) fn read(fd: c_int, tag: &str) -> Result<([i64; 4], u64), CUresult> {
    // SAFETY: a zeroed stat is a valid value to fill.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat of the caller's descriptor into our own buffer.
    if fd < 0 || unsafe { libc::fstat(fd, &mut st) } != 0 || (st.st_size as u64) < RECORD_LEN as u64
    {
        return Err(err::INVALID_VALUE);
    }
    let at = st.st_size as u64 - RECORD_LEN as u64;
    let mut buf = [0u8; RECORD_LEN];
    // SAFETY: reading at most RECORD_LEN bytes into our own buffer from the caller's fd.
    let n = unsafe {
        libc::pread(
            fd,
            buf.as_mut_ptr() as *mut c_void,
            RECORD_LEN,
            at as libc::off_t,
        )
    };
    let text = std::str::from_utf8(&buf[..n.max(0) as usize]).map_err(|_| err::INVALID_VALUE)?;
    let mut parts = text.split('\n').next().unwrap_or("").split(' ');
    if parts.next() != Some(tag) {
        return Err(err::INVALID_VALUE);
    }
    let mut fields = [0i64; 4];
    for f in &mut fields {
        *f = parts
            .next()
            .and_then(|x| x.parse::<i64>().ok())
            .ok_or(err::INVALID_VALUE)?;
    }
    Ok((fields, at))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn memfd(len: u64) -> c_int {
        // SAFETY: a new anonymous file of ours, with a static NUL-terminated name.
        let fd = unsafe { libc::memfd_create(c"export-record-test".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: sizing our own new file.
        assert_eq!(unsafe { libc::ftruncate(fd, len as libc::off_t) }, 0);
        fd
    }

    #[test]
    fn a_record_reads_back_after_the_memory_and_nothing_else_does() {
        let fd = memfd(4096 + RECORD_LEN as u64);
        write(fd, 4096, "cuvisor-sim-vmm", [-1, 4096, 7, 3]).unwrap();
        assert_eq!(read(fd, "cuvisor-sim-vmm"), Ok(([-1, 4096, 7, 3], 4096)));
        // Another kind of record, or a file too short to hold one, is not one.
        assert_eq!(read(fd, "cuvisor-sim-pool"), Err(err::INVALID_VALUE));
        let short = memfd(10);
        assert_eq!(read(short, "cuvisor-sim-vmm"), Err(err::INVALID_VALUE));
        assert_eq!(read(-1, "cuvisor-sim-vmm"), Err(err::INVALID_VALUE));
        // SAFETY: closing our own descriptors.
        unsafe {
            libc::close(fd);
            libc::close(short);
        }
    }
}
