//! What an open LUN is: its identity (to catch two paths to one device), its size, and its
//! logical block size (the unit of direct-I/O offsets and lengths).

use std::fs::File;
use std::io::{self, Seek, SeekFrom};
use std::os::unix::fs::{FileTypeExt, MetadataExt};

/// What identifies the object behind a path, so that two paths to one device are caught.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum LunIdentity {
    /// A block device, by device number (`st_rdev`).
    BlockDevice { rdev: u64 },
    /// A regular file, by file system and inode.
    File { dev: u64, ino: u64 },
}

impl LunIdentity {
    pub fn is_block_device(&self) -> bool {
        matches!(self, LunIdentity::BlockDevice { .. })
    }
}

/// An open LUN's identity, size and logical block size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    pub identity: LunIdentity,
    /// The device's size, or the file's length now.
    pub size_bytes: u64,
    /// Offsets and lengths of direct I/O must be multiples of this.
    pub logical_block_size: u32,
}

/// Describes an open block device or regular file; anything else is an `InvalidInput` error.
/// A block device's size is found by seeking to its end (the file offset moves; LUN I/O is
/// positioned, so nothing depends on it).
pub fn describe(file: &File) -> io::Result<Geometry> {
    let meta = file
        .metadata()
        .map_err(|e| io::Error::new(e.kind(), format!("stat: {e}")))?;
    let kind = meta.file_type();
    if kind.is_block_device() {
        let size_bytes = (&*file)
            .seek(SeekFrom::End(0))
            .map_err(|e| io::Error::new(e.kind(), format!("seek to end: {e}")))?;
        Ok(Geometry {
            identity: LunIdentity::BlockDevice { rdev: meta.rdev() },
            size_bytes,
            logical_block_size: logical_block_size(file, meta.rdev()),
        })
    } else if kind.is_file() {
        Ok(Geometry {
            identity: LunIdentity::File {
                dev: meta.dev(),
                ino: meta.ino(),
            },
            size_bytes: meta.len(),
            logical_block_size: dio_alignment(file).unwrap_or(512),
        })
    } else {
        Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "neither a block device nor a regular file",
        ))
    }
}

/// A block device's logical block size from sysfs (`queue/logical_block_size`, on the parent
/// disk for a partition), then `statx`'s direct-I/O alignment, then 512. rustix 1.x has no
/// `BLKSSZGET` wrapper, and sysfs needs no `unsafe` ioctl.
pub fn logical_block_size(file: &File, rdev: u64) -> u32 {
    let (major, minor) = (rustix::fs::major(rdev), rustix::fs::minor(rdev));
    let base = format!("/sys/dev/block/{major}:{minor}");
    for candidate in [
        format!("{base}/queue/logical_block_size"),
        format!("{base}/../queue/logical_block_size"),
    ] {
        let size = std::fs::read_to_string(&candidate)
            .ok()
            .and_then(|s| s.trim().parse::<u32>().ok())
            .filter(|s| s.is_power_of_two() && *s >= 512);
        if let Some(size) = size {
            return size;
        }
    }
    dio_alignment(file).unwrap_or(512)
}

/// `statx`'s `O_DIRECT` file-offset alignment (Linux 6.1 and later), when it reports one.
pub fn dio_alignment(file: &File) -> Option<u32> {
    use rustix::fs::{AtFlags, StatxFlags, statx};
    let x = statx(file, "", AtFlags::EMPTY_PATH, StatxFlags::DIOALIGN).ok()?;
    let align = x.stx_dio_offset_align;
    (x.stx_mask & StatxFlags::DIOALIGN.bits() != 0 && align.is_power_of_two() && align >= 512)
        .then_some(align)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_is_described_by_inode_length_and_alignment() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("lun");
        File::create(&path).unwrap().set_len(10_000).unwrap();
        let g = describe(&File::open(&path).unwrap()).unwrap();
        assert_eq!(g.size_bytes, 10_000);
        assert!(!g.identity.is_block_device());
        assert!(g.logical_block_size.is_power_of_two() && g.logical_block_size >= 512);
        let again = describe(&File::open(&path).unwrap()).unwrap();
        assert_eq!(
            again.identity, g.identity,
            "two opens of one file: one identity"
        );
        let other = dir.path().join("other");
        File::create(&other).unwrap();
        assert_ne!(
            describe(&File::open(&other).unwrap()).unwrap().identity,
            g.identity
        );
    }

    #[test]
    fn a_directory_is_not_a_lun() {
        let dir = tempfile::tempdir().unwrap();
        let e = describe(&File::open(dir.path()).unwrap()).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
    }
}
