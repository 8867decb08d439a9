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

use std::fs::{File, OpenOptions};
use std::io::{Seek, SeekFrom};
use std::os::unix::fs::{FileExt, FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::{Context, bail};

/// What identifies the object behind a path, so that two paths to one device are caught.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum LunIdentity {
    /// A block device, by device number (`st_rdev`).
    BlockDevice { rdev: u64 },
    /// A regular file, by file system and inode.
    File { dev: u64, ino: u64 },
}

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
        let mut options = OpenOptions::new();
        options.read(true).write(writable);
        if is_block && writable {
            options.custom_flags(oflag(rustix::fs::OFlags::EXCL));
        }
        let mut file = options.open(path).with_context(|| {
            format!(
                "open {}{}",
                path.display(),
                if writable { " for writing" } else { "" }
            )
        })?;
        let (identity, direct, size_bytes, logical_block_size) = if is_block {
            let direct = OpenOptions::new()
                .read(true)
                .custom_flags(oflag(rustix::fs::OFlags::DIRECT))
                .open(path)
                .with_context(|| format!("open {} with O_DIRECT", path.display()))?;
            let size = file
                .seek(SeekFrom::End(0))
                .with_context(|| format!("find the size of {}", path.display()))?;
            let lbs = block_device_logical_block_size(&file, meta.rdev());
            (
                LunIdentity::BlockDevice { rdev: meta.rdev() },
                Some(direct),
                size,
                lbs,
            )
        } else {
            (
                LunIdentity::File {
                    dev: meta.dev(),
                    ino: meta.ino(),
                },
                None,
                meta.len(),
                dio_alignment(&file).unwrap_or(512),
            )
        };
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
            Some(direct) => read_direct(direct, off, len, self.logical_block_size),
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

fn oflag(flag: rustix::fs::OFlags) -> i32 {
    // O_DIRECT and O_EXCL fit comfortably in an int; the cast only changes the type.
    flag.bits() as i32
}

/// Reads `len` bytes at `off` through an `O_DIRECT` descriptor: the aligned span around the
/// range into an aligned buffer, then the wanted bytes out of it.
fn read_direct(file: &File, off: u64, len: usize, align: u32) -> std::io::Result<Vec<u8>> {
    let align64 = u64::from(align);
    let start = off - off % align64;
    let end = (off + len as u64).div_ceil(align64) * align64;
    let span = usize::try_from(end - start).map_err(std::io::Error::other)?;
    let align = align as usize;
    let mut raw = vec![0u8; span + align];
    let shift = raw.as_ptr().align_offset(align);
    let buf = raw
        .get_mut(shift..shift + span)
        .ok_or_else(|| std::io::Error::other("cannot align the read buffer"))?;
    file.read_exact_at(buf, start)?;
    let from = (off - start) as usize;
    Ok(buf[from..from + len].to_vec())
}

/// A block device's logical block size from sysfs (`queue/logical_block_size`, on the
/// parent disk for a partition), then `statx`'s direct-I/O alignment, then 512. rustix 1.x
/// has no `BLKSSZGET` wrapper, and sysfs needs no `unsafe` ioctl.
fn block_device_logical_block_size(file: &File, rdev: u64) -> u32 {
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
fn dio_alignment(file: &File) -> Option<u32> {
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

    #[test]
    fn direct_reads_pick_the_bytes_out_of_an_aligned_span() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("lun");
        let data: Vec<u8> = (0..8192u32).map(|i| (i % 251) as u8).collect();
        std::fs::write(&path, &data).unwrap();
        // A regular file without O_DIRECT exercises the span arithmetic alone.
        let file = File::open(&path).unwrap();
        for (off, len) in [(0, 1), (511, 2), (1000, 3000), (4096, 4096), (8191, 1)] {
            let got = read_direct(&file, off, len, 512).unwrap();
            assert_eq!(got, &data[off as usize..off as usize + len], "{off}+{len}");
        }
    }
}
