//! Opening a LUN: with `O_DIRECT` (so that this node and every other one see the same bytes,
//! never a page-cache copy), falling back where the file system refuses it, buffered, or with
//! `O_EXCL`.
//!
//! All of them go through [`open_with_flags`], the one call of
//! `OpenOptionsExt::custom_flags` that clippy.toml allows in the workspace.

use std::fs::{File, OpenOptions};
use std::io;
use std::path::Path;

use rustix::fs::OFlags;

/// What the opener will do with the LUN.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    Read,
    ReadWrite,
}

/// Opens `path` with `O_DIRECT`, falling back to buffered I/O where the file system refuses
/// `O_DIRECT` (`EINVAL`: a file-backed LUN on tmpfs). Returns the file and whether it is
/// direct.
pub fn open_direct(path: &Path, access: Access) -> io::Result<(File, bool)> {
    match open_with_flags(path, access, OFlags::DIRECT) {
        Ok(f) => Ok((f, true)),
        Err(e) if e.raw_os_error() == Some(rustix::io::Errno::INVAL.raw_os_error()) => {
            Ok((open_with_flags(path, access, OFlags::empty())?, false))
        }
        Err(e) => Err(e),
    }
}

/// Opens `path` with `O_DIRECT` and no fallback: an error where the file system refuses it.
pub fn open_direct_strict(path: &Path, access: Access) -> io::Result<File> {
    open_with_flags(path, access, OFlags::DIRECT)
}

/// Opens `path` buffered (the page cache in between: for label writes that are followed by
/// `fdatasync`, and reads where [`read_direct`](crate::read_direct) is not needed).
pub fn open_buffered(path: &Path, access: Access) -> io::Result<File> {
    open_with_flags(path, access, OFlags::empty())
}

/// Opens `path` buffered, with `O_EXCL`: for a block device the open fails (`EBUSY`) while it
/// is mounted or held on this node (by device-mapper, say). Callers use it for block devices
/// they are about to write; on a regular file `O_EXCL` without `O_CREAT` means nothing.
pub fn open_exclusive(path: &Path, access: Access) -> io::Result<File> {
    open_with_flags(path, access, OFlags::EXCL)
}

/// Opens `path` for `access` with the extra open flags `flags`.
fn open_with_flags(path: &Path, access: Access, flags: OFlags) -> io::Result<File> {
    let mut options = OpenOptions::new();
    options.read(true).write(access == Access::ReadWrite);
    if !flags.is_empty() {
        // O_DIRECT and O_EXCL fit comfortably in an int; the cast only changes the type.
        let bits = flags.bits() as i32;
        #[allow(
            clippy::disallowed_methods,
            reason = "sanfs-lun is where LUNs are opened with custom flags (clippy.toml)"
        )]
        std::os::unix::fs::OpenOptionsExt::custom_flags(&mut options, bits);
    }
    options.open(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn access_decides_whether_writes_are_allowed() {
        use std::os::unix::fs::FileExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("lun");
        File::create(&path).unwrap().set_len(8192).unwrap();
        let (ro, _) = open_direct(&path, Access::Read).unwrap();
        assert!(ro.write_at(&[0u8; 4096], 0).is_err());
        let rw = open_exclusive(&path, Access::ReadWrite).unwrap();
        rw.write_all_at(b"x", 0).unwrap();
        assert!(open_direct(&dir.path().join("missing"), Access::Read).is_err());
    }
}
