//! [`BlockDeviceBackend`]: the metadata store on a block device of its own (a small LUN, the
//! metadata LUN), which every metadata server candidate of a high-availability pair sees.
//!
//! Layout (docs/on-disk-format.md, "The metadata LUN"): a 4 KiB header block, then the redb
//! file's bytes. The header (little-endian): magic `SANFSMD1`, version (2), the store's
//! logical length, the **fencing epoch** of the last leader that claimed the device (0: never
//! claimed by an HA leader), crc32c of the preceding bytes. Version 1 headers (no epoch) are
//! read as epoch 0 and rewritten as version 2 at the next length change.
//!
//! Every byte goes to the device with `O_DIRECT` where the device allows it (a file on tmpfs
//! does not: then buffered), through aligned bounce buffers: so that what a standby reads at
//! takeover is what is on the device, and a deposed leader's host holds no dirty pages of the
//! metadata LUN that its kernel could write back later, after a new leader wrote.
//!
//! With a [`Fence`] (an HA leader), every write, length change and sync is refused once the
//! fence is lost or past its deadline, and the header's epoch is re-read from the device at the
//! first write after each sync (the start of a commit) and before each sync: if another leader
//! has claimed the device since, the fence is lost and the write refused (`crate::ha`).

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use redb::StorageBackend;
use sanfs_lun::AlignedBuf;

use super::fence::{Fence, fenced};

/// Bytes at the start of a block device that hold the backend's header.
pub const DEVICE_HEADER_SIZE: u64 = 4096;
const DEVICE_MAGIC: [u8; 8] = *b"SANFSMD1";
const DEVICE_VERSION: u32 = 2;
/// The unit of every device transfer (aligned for `O_DIRECT` on every device).
const BLOCK: u64 = 4096;
const HEADER_V1_LEN: usize = 24;
const HEADER_V2_LEN: usize = 32;

fn io_err(msg: impl Into<String>) -> std::io::Error {
    std::io::Error::other(msg.into())
}

/// What the header block says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceHeader {
    /// The store's logical length in bytes.
    pub len: u64,
    /// The fencing epoch of the last HA leader that claimed the device; 0: none.
    pub epoch: u64,
}

fn encode_header(h: DeviceHeader) -> [u8; HEADER_V2_LEN] {
    let mut b = [0u8; HEADER_V2_LEN];
    b[..8].copy_from_slice(&DEVICE_MAGIC);
    b[8..12].copy_from_slice(&DEVICE_VERSION.to_le_bytes());
    b[12..20].copy_from_slice(&h.len.to_le_bytes());
    b[20..28].copy_from_slice(&h.epoch.to_le_bytes());
    let crc = crc32c::crc32c(&b[..28]);
    b[28..32].copy_from_slice(&crc.to_le_bytes());
    b
}

fn le_u64(b: &[u8]) -> u64 {
    let mut x = [0u8; 8];
    x.copy_from_slice(&b[..8]);
    u64::from_le_bytes(x)
}

fn le_u32(b: &[u8]) -> u32 {
    let mut x = [0u8; 4];
    x.copy_from_slice(&b[..4]);
    u32::from_le_bytes(x)
}

/// Decodes the first bytes of the header block (at least [`HEADER_V2_LEN`]).
fn decode_header(b: &[u8]) -> std::io::Result<DeviceHeader> {
    if b.len() < HEADER_V2_LEN || b[..8] != DEVICE_MAGIC {
        return Err(io_err("not a sanfs metadata device (bad magic)"));
    }
    let (crc_at, epoch) = match le_u32(&b[8..12]) {
        1 => (HEADER_V1_LEN - 4, None),
        2 => (HEADER_V2_LEN - 4, Some(le_u64(&b[20..28]))),
        v => return Err(io_err(format!("metadata device header version {v}"))),
    };
    if le_u32(&b[crc_at..]) != crc32c::crc32c(&b[..crc_at]) {
        return Err(io_err("metadata device header checksum mismatch"));
    }
    Ok(DeviceHeader {
        len: le_u64(&b[12..20]),
        epoch: epoch.unwrap_or(0),
    })
}

/// Opens a metadata device for reading (and writing), with `O_DIRECT` where allowed; returns
/// the file and its usable capacity (rounded down to whole 4 KiB blocks).
pub fn open_device(path: &std::path::Path, write: bool) -> std::io::Result<(File, u64)> {
    let access = if write {
        sanfs_lun::Access::ReadWrite
    } else {
        sanfs_lun::Access::Read
    };
    let (file, _direct) = sanfs_lun::open_direct(path, access)?;
    let capacity = {
        use std::io::Seek;
        let mut f = &file;
        f.seek(std::io::SeekFrom::End(0))?
    };
    Ok((file, capacity / BLOCK * BLOCK))
}

/// Whether a device already holds a sanfs metadata store (its header's magic).
pub fn is_metadata_device(path: &std::path::Path) -> std::io::Result<bool> {
    let file = File::open(path)?;
    let mut magic = [0u8; 8];
    match file.read_exact_at(&mut magic, 0) {
        Ok(()) => Ok(magic == DEVICE_MAGIC),
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Ok(false),
        Err(e) => Err(e),
    }
}

/// The header of the metadata device at `path`, read from the device itself.
pub fn read_device_header(path: &std::path::Path) -> std::io::Result<DeviceHeader> {
    let (file, _) = open_device(path, false)?;
    read_header_block(&file)
}

fn read_header_block(file: &File) -> std::io::Result<DeviceHeader> {
    let mut buf = AlignedBuf::zeroed(BLOCK as usize);
    file.read_exact_at(buf.as_mut_slice(), 0)?;
    decode_header(buf.as_slice())
}

/// The metadata store on a block device (see the module doc).
#[derive(Debug)]
pub struct BlockDeviceBackend {
    file: File,
    capacity: u64,
    /// The header as this server last wrote or read it. Writes hold the lock, so that a
    /// read-modify-write of a partial block never races another write.
    header: Mutex<DeviceHeader>,
    fence: Option<Arc<Fence>>,
    /// Re-read the header's epoch before the next write (set by each sync).
    verify_epoch: AtomicBool,
}

impl BlockDeviceBackend {
    /// Opens a device that [`BlockDeviceBackend::initialise`] prepared.
    pub fn open(file: File, capacity: u64) -> std::io::Result<BlockDeviceBackend> {
        let header = read_header_block(&file)?;
        if header.len > capacity.saturating_sub(DEVICE_HEADER_SIZE) {
            return Err(io_err(format!(
                "metadata header says {} bytes, device holds {capacity}",
                header.len
            )));
        }
        Ok(BlockDeviceBackend {
            file,
            capacity,
            header: Mutex::new(header),
            fence: None,
            verify_epoch: AtomicBool::new(false),
        })
    }

    /// Opens a device for an HA leader: claims it by writing `fence`'s epoch into the header
    /// (durably) before anything else, refusing if the header already holds an epoch as new as
    /// ours (a newer leader has the device: we are deposed).
    pub fn open_fenced(
        file: File,
        capacity: u64,
        fence: Arc<Fence>,
    ) -> std::io::Result<BlockDeviceBackend> {
        let mut b = BlockDeviceBackend::open(file, capacity)?;
        fence.check()?;
        if fence.epoch() == 0 {
            return Err(io_err(
                "a fence without an epoch cannot claim the metadata device",
            ));
        }
        let on_device = b.lock_header().epoch;
        if on_device >= fence.epoch() {
            fence.lose(format!(
                "the metadata device was claimed by epoch {on_device}, not older than ours"
            ));
            return Err(fenced(format!(
                "the metadata device holds fencing epoch {on_device}, not older than this server's {}: another leader has it",
                fence.epoch()
            )));
        }
        let claimed = DeviceHeader {
            len: b.lock_header().len,
            epoch: fence.epoch(),
        };
        b.write_header(claimed)?;
        b.file.sync_data()?;
        *b.lock_header() = claimed;
        b.fence = Some(fence);
        tracing::info!(
            epoch = claimed.epoch,
            previous = on_device,
            "metadata device claimed"
        );
        Ok(b)
    }

    /// Writes an empty header (length 0, epoch 0) to a device, making it an empty store.
    pub fn initialise(file: File, capacity: u64) -> std::io::Result<BlockDeviceBackend> {
        if capacity < DEVICE_HEADER_SIZE + (1 << 20) {
            return Err(io_err(format!(
                "a metadata device needs at least 1 MiB beyond its header; this one has {capacity} bytes"
            )));
        }
        let header = DeviceHeader { len: 0, epoch: 0 };
        let b = BlockDeviceBackend {
            file,
            capacity,
            header: Mutex::new(header),
            fence: None,
            verify_epoch: AtomicBool::new(false),
        };
        b.write_header(header)?;
        b.file.sync_data()?;
        Ok(b)
    }

    fn lock_header(&self) -> MutexGuard<'_, DeviceHeader> {
        // A poisoned mutex only means another thread panicked holding it; the value is intact.
        self.header.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn write_header(&self, h: DeviceHeader) -> std::io::Result<()> {
        let mut buf = AlignedBuf::zeroed(BLOCK as usize);
        buf.as_mut_slice()[..HEADER_V2_LEN].copy_from_slice(&encode_header(h));
        self.check_deadline()?;
        self.file.write_all_at(buf.as_slice(), 0)
    }

    /// Before a mutating call: at the start of a commit the epoch on the device, then the
    /// fence's deadline.
    fn guard(&self) -> std::io::Result<()> {
        let Some(fence) = &self.fence else {
            return Ok(());
        };
        if self.verify_epoch.swap(false, Ordering::SeqCst) {
            self.verify_claim(fence)?;
        }
        fence.check()
    }

    /// The fence's deadline, checked again immediately before each device write: a process
    /// paused (SIGSTOP, a frozen VM) is stopped when a blocking call returns, so a check made
    /// before the read of a partial block or of the header, and not repeated after it, would
    /// let the write that follows go out long after the deadline.
    fn check_deadline(&self) -> std::io::Result<()> {
        match &self.fence {
            Some(fence) => fence.check(),
            None => Ok(()),
        }
    }

    fn verify_claim(&self, fence: &Fence) -> std::io::Result<()> {
        let on_device = read_header_block(&self.file)?.epoch;
        if on_device != fence.epoch() {
            fence.lose(format!(
                "the metadata device now holds fencing epoch {on_device}"
            ));
            return fence.check();
        }
        Ok(())
    }

    /// Reads `out.len()` bytes at device position `pos` through an aligned bounce buffer.
    fn read_at(&self, pos: u64, out: &mut [u8]) -> std::io::Result<()> {
        let (start, end) = covering(pos, out.len())?;
        let mut buf = AlignedBuf::zeroed(usize::try_from(end - start).map_err(io_err_fit)?);
        self.file.read_exact_at(buf.as_mut_slice(), start)?;
        let skip = (pos - start) as usize;
        out.copy_from_slice(&buf.as_slice()[skip..skip + out.len()]);
        Ok(())
    }

    /// Writes `data` at device position `pos`: whole aligned blocks, the partial ones at the
    /// edges read first. Called with the header lock held (one writer at a time).
    fn write_at(&self, pos: u64, data: &[u8]) -> std::io::Result<()> {
        let (start, end) = covering(pos, data.len())?;
        let mut buf = AlignedBuf::zeroed(usize::try_from(end - start).map_err(io_err_fit)?);
        let total = buf.len();
        let block = BLOCK as usize;
        if pos != start {
            self.file
                .read_exact_at(&mut buf.as_mut_slice()[..block], start)?;
        }
        if pos + data.len() as u64 != end && (total > block || pos == start) {
            self.file
                .read_exact_at(&mut buf.as_mut_slice()[total - block..], end - BLOCK)?;
        }
        let skip = (pos - start) as usize;
        buf.as_mut_slice()[skip..skip + data.len()].copy_from_slice(data);
        self.check_deadline()?;
        self.file.write_all_at(buf.as_slice(), start)
    }
}

/// The aligned block range `[start, end)` that covers `len` bytes at `pos`.
fn covering(pos: u64, len: usize) -> std::io::Result<(u64, u64)> {
    let last = pos
        .checked_add(len as u64)
        .ok_or_else(|| io_err("device position overflow"))?;
    Ok((pos / BLOCK * BLOCK, last.div_ceil(BLOCK) * BLOCK))
}

fn io_err_fit(_: std::num::TryFromIntError) -> std::io::Error {
    io_err("transfer does not fit in memory")
}

impl StorageBackend for BlockDeviceBackend {
    fn len(&self) -> Result<u64, std::io::Error> {
        Ok(self.lock_header().len)
    }

    fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), std::io::Error> {
        let end = offset.checked_add(out.len() as u64);
        if end.is_none_or(|e| e > self.lock_header().len) {
            return Err(io_err(format!(
                "read past the end of the store at {offset}"
            )));
        }
        self.read_at(DEVICE_HEADER_SIZE + offset, out)
    }

    fn set_len(&self, len: u64) -> Result<(), std::io::Error> {
        if len > self.capacity - DEVICE_HEADER_SIZE {
            return Err(std::io::Error::new(
                std::io::ErrorKind::StorageFull,
                format!(
                    "metadata device full: {len} bytes wanted, {} available",
                    self.capacity - DEVICE_HEADER_SIZE
                ),
            ));
        }
        self.guard()?;
        let mut cur = self.lock_header();
        if len > cur.len {
            // New positions must read as zeros.
            let zeros = vec![0u8; 1 << 20];
            let mut off = cur.len;
            while off < len {
                let n = (len - off).min(zeros.len() as u64);
                self.write_at(DEVICE_HEADER_SIZE + off, &zeros[..n as usize])?;
                off += n;
            }
        }
        let next = DeviceHeader {
            len,
            epoch: cur.epoch,
        };
        self.write_header(next)?;
        *cur = next;
        Ok(())
    }

    fn sync_data(&self) -> Result<(), std::io::Error> {
        if let Some(fence) = &self.fence {
            fence.check()?;
            self.verify_claim(fence)?;
        }
        self.file.sync_data()?;
        self.verify_epoch.store(true, Ordering::SeqCst);
        Ok(())
    }

    fn write(&self, offset: u64, data: &[u8]) -> Result<(), std::io::Error> {
        self.guard()?;
        let cur = self.lock_header();
        let end = offset.checked_add(data.len() as u64);
        if end.is_none_or(|e| e > cur.len) {
            return Err(io_err(format!(
                "write past the end of the store at {offset}"
            )));
        }
        self.write_at(DEVICE_HEADER_SIZE + offset, data)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    fn device(len: u64) -> File {
        let f = tempfile::tempfile().unwrap();
        f.set_len(len).unwrap();
        f
    }

    #[test]
    fn block_device_backend_keeps_its_length_in_the_header() {
        let f = device(4 << 20);
        let b = BlockDeviceBackend::initialise(f.try_clone().unwrap(), 4 << 20).unwrap();
        b.set_len(10).unwrap();
        b.write(2, b"hello").unwrap();
        b.sync_data().unwrap();
        let b2 = BlockDeviceBackend::open(f.try_clone().unwrap(), 4 << 20).unwrap();
        assert_eq!(b2.len().unwrap(), 10);
        let mut out = [0u8; 5];
        b2.read(2, &mut out).unwrap();
        assert_eq!(&out, b"hello");
        assert!(b2.set_len(8 << 20).is_err());
        f.write_all_at(b"junk", 0).unwrap();
        assert!(BlockDeviceBackend::open(f, 4 << 20).is_err());
    }

    #[test]
    fn unaligned_writes_keep_the_bytes_around_them() {
        let f = device(4 << 20);
        let b = BlockDeviceBackend::initialise(f.try_clone().unwrap(), 4 << 20).unwrap();
        b.set_len(3 * BLOCK).unwrap();
        let base: Vec<u8> = (0..3 * BLOCK).map(|i| (i % 251) as u8).collect();
        b.write(0, &base).unwrap();
        // Inside one block, across a boundary, and ending at a boundary.
        for (at, len) in [
            (10u64, 5usize),
            (BLOCK - 3, 9),
            (BLOCK + 1, BLOCK as usize - 1),
        ] {
            b.write(at, &vec![0xEE; len]).unwrap();
        }
        let mut want = base.clone();
        for (at, len) in [
            (10usize, 5usize),
            (BLOCK as usize - 3, 9),
            (BLOCK as usize + 1, BLOCK as usize - 1),
        ] {
            want[at..at + len].fill(0xEE);
        }
        let mut got = vec![0u8; want.len()];
        b.read(0, &mut got).unwrap();
        assert_eq!(got, want);
        let mut mid = [0u8; 7];
        b.read(BLOCK - 2, &mut mid).unwrap();
        assert_eq!(&mid[..], &want[BLOCK as usize - 2..BLOCK as usize + 5]);
    }

    #[test]
    fn version_1_headers_read_as_epoch_0() {
        let f = device(4 << 20);
        let mut v1 = [0u8; HEADER_V1_LEN];
        v1[..8].copy_from_slice(&DEVICE_MAGIC);
        v1[8..12].copy_from_slice(&1u32.to_le_bytes());
        v1[12..20].copy_from_slice(&4096u64.to_le_bytes());
        let crc = crc32c::crc32c(&v1[..20]);
        v1[20..24].copy_from_slice(&crc.to_le_bytes());
        f.write_all_at(&v1, 0).unwrap();
        let b = BlockDeviceBackend::open(f.try_clone().unwrap(), 4 << 20).unwrap();
        assert_eq!(
            *b.lock_header(),
            DeviceHeader {
                len: 4096,
                epoch: 0
            }
        );
        b.set_len(8192).unwrap();
        assert_eq!(
            read_header_block(&f).unwrap(),
            DeviceHeader {
                len: 8192,
                epoch: 0
            }
        );
    }

    fn fence(epoch: u64) -> Arc<Fence> {
        Arc::new(Fence::new(epoch, Instant::now() + Duration::from_secs(60)))
    }

    #[test]
    fn a_newer_leader_fences_the_older_one_at_its_next_commit() {
        let f = device(4 << 20);
        BlockDeviceBackend::initialise(f.try_clone().unwrap(), 4 << 20).unwrap();
        let old =
            BlockDeviceBackend::open_fenced(f.try_clone().unwrap(), 4 << 20, fence(5)).unwrap();
        old.set_len(BLOCK).unwrap();
        old.write(0, b"old").unwrap();
        old.sync_data().unwrap();
        // A newer leader claims the device.
        let new =
            BlockDeviceBackend::open_fenced(f.try_clone().unwrap(), 4 << 20, fence(9)).unwrap();
        assert_eq!(read_header_block(&f).unwrap().epoch, 9);
        // The old one's next commit is refused at its first write, and it stays refused.
        let e = old.write(0, b"OLD").unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::PermissionDenied, "{e}");
        assert!(old.sync_data().is_err() && old.set_len(2 * BLOCK).is_err());
        let mut got = [0u8; 3];
        new.read(0, &mut got).unwrap();
        assert_eq!(&got, b"old");
        // An older epoch can never claim it again.
        assert!(
            BlockDeviceBackend::open_fenced(f.try_clone().unwrap(), 4 << 20, fence(7)).is_err()
        );
        assert!(BlockDeviceBackend::open_fenced(f, 4 << 20, fence(9)).is_err());
    }

    #[test]
    fn a_leader_past_its_deadline_writes_nothing() {
        let f = device(4 << 20);
        BlockDeviceBackend::initialise(f.try_clone().unwrap(), 4 << 20).unwrap();
        let short = Arc::new(Fence::new(4, Instant::now() + Duration::from_millis(200)));
        let b = BlockDeviceBackend::open_fenced(f.try_clone().unwrap(), 4 << 20, short).unwrap();
        b.set_len(BLOCK).unwrap();
        b.write(0, b"before").unwrap();
        std::thread::sleep(Duration::from_millis(300));
        assert!(b.write(0, b"after!").is_err());
        assert!(b.set_len(2 * BLOCK).is_err() && b.sync_data().is_err());
        let mut got = [0u8; 6];
        b.read(0, &mut got).unwrap();
        assert_eq!(&got, b"before");
    }
}
