//! Opening a file that someone else may have put in place: only a regular file is opened, and
//! nothing on the way can block. The path is looked at first (so a device is never opened),
//! then opened with O_NONBLOCK (a FIFO swapped in since cannot hang the open) and looked at
//! again on the descriptor, which is what is read from.

use cuvisor_sim::model::file_kind;
use std::fs::{File, OpenOptions};
use std::io::ErrorKind;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::Path;

/// Why a file was not opened.
#[derive(Debug)]
pub enum NotOpened {
    /// Nothing is there.
    Missing,
    /// Something is there that is not to be read, or cannot be: the reason, for a message
    /// ("is a FIFO, not a regular file", "Permission denied (os error 13)").
    Refused(String),
}

/// Whether a symbolic link in the last component of the path is followed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Links {
    Follow,
    Refuse,
}

/// `path` opened read-only, if it is a regular file (see the module's doc).
pub fn open_regular(path: &Path, links: Links) -> Result<File, NotOpened> {
    let io = |e: std::io::Error| match e.kind() {
        ErrorKind::NotFound => NotOpened::Missing,
        _ => NotOpened::Refused(e.to_string()),
    };
    let kind = |t: std::fs::FileType| {
        NotOpened::Refused(format!("is {}, not a regular file", file_kind(t)))
    };
    let seen = match links {
        Links::Follow => std::fs::metadata(path),
        Links::Refuse => std::fs::symlink_metadata(path),
    }
    .map_err(io)?;
    if !seen.is_file() {
        return Err(kind(seen.file_type()));
    }
    let mut flags = libc::O_NONBLOCK | libc::O_NOCTTY;
    if links == Links::Refuse {
        flags |= libc::O_NOFOLLOW;
    }
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(flags)
        .open(path)
        .map_err(|e| match e.raw_os_error() {
            // O_NOFOLLOW met a link put there since it was looked at.
            Some(libc::ELOOP) => {
                NotOpened::Refused("is a symbolic link, not a regular file".into())
            }
            _ => io(e),
        })?;
    let opened = file.metadata().map_err(io)?;
    if !opened.is_file() {
        return Err(kind(opened.file_type()));
    }
    Ok(file)
}

/// Reads up to `buf.len()` bytes from the start of `file`; fewer only at its end.
pub use cuvisor_shm::mapped::read_head;

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(r: Result<File, NotOpened>) -> String {
        match r {
            Err(NotOpened::Refused(why)) => why,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn only_regular_files_are_opened_and_links_only_when_asked() {
        let dir = std::env::temp_dir().join(format!("cuvisor-files-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("f");
        std::fs::write(&file, b"0123456789").unwrap();
        let link = dir.join("l");
        std::os::unix::fs::symlink(&file, &link).unwrap();
        let f = open_regular(&file, Links::Refuse).unwrap();
        let mut head = [0u8; 4];
        assert_eq!(read_head(&f, &mut head).unwrap(), 4);
        assert_eq!(&head, b"0123");
        let mut all = [0u8; 32];
        assert_eq!(read_head(&f, &mut all).unwrap(), 10);
        assert!(open_regular(&link, Links::Follow).is_ok());
        assert_eq!(
            refused(open_regular(&link, Links::Refuse)),
            "is a symbolic link, not a regular file"
        );
        assert_eq!(
            refused(open_regular(&dir, Links::Follow)),
            "is a directory, not a regular file"
        );
        assert_eq!(
            refused(open_regular(Path::new("/dev/null"), Links::Follow)),
            "is a character device, not a regular file"
        );
        assert!(matches!(
            open_regular(&dir.join("none"), Links::Follow),
            Err(NotOpened::Missing)
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
