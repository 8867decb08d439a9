//! A LUN (or a plain file standing in for one) opened for the server's own I/O: reading
//! labels and probing for signatures at `format` and `volume inspect`, writing labels.
//!
//! This is not the data path (agents do that with io_uring and O_DIRECT). Reads of a block
//! device go through a second descriptor opened with `O_DIRECT` into a buffer aligned to the
//! device's logical block size, so they always come from the device and never from this
//! node's page cache, which may hold bytes that another node has since overwritten. Writes
//! are plain `pwrite` followed by `fdatasync` in [`Lun::sync`]; the direct read path flushes
//! any dirty cached range before it reads, so a read after a write sees it. Regular files are
//! read and written with plain `pread`/`pwrite` (tmpfs has no `O_DIRECT`).
//!
//! After a failed write or sync the handle is poisoned (style.md section 6): every later
//! write or sync fails, because a failed flush may have lost data that a retry would not
//! notice.
//!
//! The opens, the geometry (size, logical block size, identity) and the direct reads are
//! sanfs-lun's, shared with the agent; this module adds the server's checks and poisoning.

use std::fs::File;
use std::os::unix::fs::{FileExt, FileTypeExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::{Context, bail};
use sanfs_lun::Access;

pub use sanfs_lun::LunIdentity;

/// One opened LUN or file.
#[derive(Debug)]
pub struct Lun {
    path: PathBuf,
    file: File,
    /// Block devices only: the same device opened with `O_DIRECT`, for reads.
    direct: Option<File>,
    identity: LunIdentity,
    size_bytes: u64,
    logical_block_size: u32,
    writable: bool,
    poisoned: AtomicBool,
}

impl Lun {
    /// Opens `path`, a block device or a regular file. A block device opened `writable` is
    /// opened `O_EXCL`, so that the open fails while it is mounted or held on this node (by
    /// device-mapper, say).
    pub fn open(path: &Path, writable: bool) -> anyhow::Result<Lun> {
        let meta = std::fs::metadata(path).with_context(|| format!("stat {}", path.display()))?;
        let kind = meta.file_type();
        let is_block = kind.is_block_device();
        if !is_block && !kind.is_file() {
            bail!(
                "{} is neither a block device nor a regular file",
                path.display()
            );
        }
        let access = if writable {
            Access::ReadWrite
        } else {
            Access::Read
        };
        let opened = if is_block && writable {
            sanfs_lun::open_exclusive(path, access)
        } else {
            sanfs_lun::open_buffered(path, access)
        };
        let file = opened.with_context(|| {
            format!(
                "open {}{}",
                path.display(),
                if writable { " for writing" } else { "" }
            )
        })?;
        let direct = if is_block {
            Some(
                sanfs_lun::open_direct_strict(path, Access::Read)
                    .with_context(|| format!("open {} with O_DIRECT", path.display()))?,
            )
        } else {
            None
        };
        let geometry = sanfs_lun::describe(&file)
            .with_context(|| format!("find the size of {}", path.display()))?;
        let (identity, size_bytes, logical_block_size) = (
            geometry.identity,
            geometry.size_bytes,
            geometry.logical_block_size,
        );
        Ok(Lun {
            path: path.to_owned(),
            file,
            direct,
            identity,
            size_bytes,
            logical_block_size,
            writable,
            poisoned: AtomicBool::new(false),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn identity(&self) -> LunIdentity {
        self.identity
    }

    pub fn is_block_device(&self) -> bool {
        self.direct.is_some()
    }

    /// Size in bytes (of the device, or the file's length when it was opened).
    pub fn size_bytes(&self) -> u64 {
        self.size_bytes
    }

    /// The smallest unit of direct I/O: the block device's logical block size, a file's
    /// `O_DIRECT` offset alignment, or 512 when neither is known.
    pub fn logical_block_size(&self) -> u32 {
        self.logical_block_size
    }

    /// Reads exactly `len` bytes at `off`; reading past the end is an error.
    pub fn read_at(&self, off: u64, len: usize) -> anyhow::Result<Vec<u8>> {
        let end = off.checked_add(len as u64);
        if end.is_none_or(|end| end > self.size_bytes) {
            bail!(
                "read of {len} bytes at {off} runs past the end of {} ({} bytes)",
                self.path.display(),
                self.size_bytes
            );
        }
        let result = match &self.direct {
            Some(direct) => sanfs_lun::read_direct(direct, off, len, self.logical_block_size),
            None => {
                let mut buf = vec![0u8; len];
                self.file.read_exact_at(&mut buf, off).map(|()| buf)
            }
        };
        result.with_context(|| format!("read {len} bytes at {off} from {}", self.path.display()))
    }

    /// Reads the first `len` bytes, or the whole device when it is shorter (for probes).
    pub fn read_prefix(&self, len: usize) -> anyhow::Result<Vec<u8>> {
        let len = usize::try_from(self.size_bytes).map_or(len, |size| size.min(len));
        self.read_at(0, len)
    }

    /// Writes `data` at `off` (not durable until [`Lun::sync`]).
    pub fn write_at(&self, off: u64, data: &[u8]) -> anyhow::Result<()> {
        self.check_writable()?;
        let end = off.checked_add(data.len() as u64);
        if end.is_none_or(|end| end > self.size_bytes) {
            bail!(
                "write of {} bytes at {off} runs past the end of {} ({} bytes)",
                data.len(),
                self.path.display(),
                self.size_bytes
            );
        }
        self.file.write_all_at(data, off).map_err(|e| {
            self.poisoned.store(true, Ordering::Relaxed);
            anyhow::Error::new(e).context(format!(
                "write {} bytes at {off} to {}",
                data.len(),
                self.path.display()
            ))
        })
    }

    /// Makes every write so far durable (`fdatasync`).
    pub fn sync(&self) -> anyhow::Result<()> {
        self.check_writable()?;
        rustix::fs::fdatasync(&self.file).map_err(|e| {
            self.poisoned.store(true, Ordering::Relaxed);
            anyhow::Error::new(std::io::Error::from(e))
                .context(format!("fdatasync {}", self.path.display()))
        })
    }

    fn check_writable(&self) -> anyhow::Result<()> {
        if !self.writable {
            bail!("{} is open read-only", self.path.display());
        }
        if self.poisoned.load(Ordering::Relaxed) {
            bail!(
                "{}: an earlier write or sync failed; reopen the device",
                self.path.display()
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_luns_read_write_and_refuse_past_the_end() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("lun");
        File::create(&path).unwrap().set_len(10_000).unwrap();
        let lun = Lun::open(&path, true).unwrap();
        assert_eq!(lun.size_bytes(), 10_000);
        assert!(!lun.is_block_device());
        assert!(lun.logical_block_size().is_power_of_two());
        lun.write_at(100, b"hello").unwrap();
        lun.sync().unwrap();
        assert_eq!(lun.read_at(99, 7).unwrap(), b"\0hello\0");
        assert!(lun.read_at(9_999, 2).is_err());
        assert!(lun.read_at(u64::MAX, 2).is_err());
        assert!(lun.write_at(9_999, b"ab").is_err());
        assert_eq!(lun.read_prefix(1 << 20).unwrap().len(), 10_000);

        let ro = Lun::open(&path, false).unwrap();
        assert!(ro.write_at(0, b"x").is_err());
        assert_eq!(ro.identity(), lun.identity());
        assert!(Lun::open(dir.path(), false).is_err());
        assert!(Lun::open(&dir.path().join("missing"), false).is_err());
    }
}
