//! The server's own handles on the data LUNs, for the proxied path (the paper's NFS-style
//! fallback): the only place where the metadata server touches file data.
//!
//! At start the server opens the configured device paths ([`crate::config::device_paths`]: `volume.devices`
//! with globs expanded, and the paths growths were given, kept in the store), reads each
//! one's identity (the sanfs label's device UUID, or the LVM2 PV UUID) and files it under the
//! volume's device index; paths differ between nodes, identities do not. A LUN that is missing or has the
//! wrong identity is not fatal: proxied I/O that needs it fails with EIO and the server says
//! which device is missing.
//!
//! I/O is `O_DIRECT` with buffers aligned to 4096 bytes (no page cache, so the server and
//! every agent see the same bytes on the LUN). Where `O_DIRECT` is refused (a file-backed LUN
//! on tmpfs), the LUN is used buffered and written through with `fdatasync`. The opens, the
//! identity probe and the aligned buffers are sanfs-lun's, the same as the agent's.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use std::sync::Arc;

use anyhow::Context;
use sanfs_blockmap::import::assign_devices;
use sanfs_blockmap::plan::{DeviceIo, IoPlan};
use sanfs_blockmap::volume::{DeviceId, DeviceIndex, Volume};
use sanfs_lun::{Access, AlignedBuf};
use sanfs_proto::types::FsError;

struct DataLun {
    path: PathBuf,
    file: File,
}

/// The data LUNs of the volume, by device index.
pub struct DataDevices {
    /// Grows with the volume ([`DataDevices::add`]); a LUN once filed stays.
    table: std::sync::RwLock<LunTable>,
    /// An HA leader's fence: checked before every write to a data LUN (proxied writes,
    /// zeroing), as the metadata LUN checks it, so that a deposed leader that wakes up writes
    /// no block a new leader may have given to another file.
    fence: std::sync::OnceLock<Arc<crate::store::fence::Fence>>,
}

#[derive(Default)]
struct LunTable {
    luns: Vec<Option<Arc<DataLun>>>,
    ids: Vec<DeviceId>,
    /// Why a device was refused by the import rule (its identity on several devices).
    refused: Vec<Option<String>>,
}

impl std::fmt::Debug for DataDevices {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DataDevices")
            .field("present", &self.present())
            .field("missing", &self.missing())
            .finish()
    }
}

/// What makes two paths one device: the device number of a block device, the file of a
/// file-backed LUN (as the agent's discovery).
fn device_key(path: &Path) -> Option<(bool, u64, u64)> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let meta = std::fs::metadata(path).ok()?;
    if meta.file_type().is_block_device() {
        Some((true, meta.rdev(), 0))
    } else {
        Some((false, meta.dev(), meta.ino()))
    }
}

/// The identity a device carries: its sanfs label, else its LVM2 PV label.
fn identity(path: &Path) -> anyhow::Result<DeviceId> {
    sanfs_lun::probe_identity(path)
        .with_context(|| format!("read the first bytes of {}", path.display()))?
        .with_context(|| format!("{}: neither a sanfs label nor an LVM2 PV", path.display()))
}

impl DataDevices {
    /// Opens every path and files it under the volume device whose identity it carries.
    pub fn open(volume: &Volume, paths: &[PathBuf]) -> DataDevices {
        let devices = DataDevices {
            table: std::sync::RwLock::new(LunTable::default()),
            fence: std::sync::OnceLock::new(),
        };
        devices.add(volume, paths);
        for m in devices.missing() {
            tracing::warn!(device = %m, "data LUN missing on this server: proxied I/O on it fails with EIO");
        }
        devices
    }

    /// Writes from now on are checked against `fence` (an HA leader's; set once).
    pub fn set_fence(&self, fence: Arc<crate::store::fence::Fence>) {
        let _ = self.fence.set(fence);
    }

    /// Ok unless this server is a fenced HA leader.
    fn may_write(&self) -> Result<(), FsError> {
        match self.fence.get() {
            Some(f) => f.check().map_err(|e| FsError::Io(e.to_string())),
            None => Ok(()),
        }
    }

    fn table(&self) -> std::sync::RwLockReadGuard<'_, LunTable> {
        self.table.read().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes up `volume` (the same volume or a grown one: devices are only ever appended) and
    /// opens those of `paths` that carry the identity of a volume device not open yet.
    pub fn add(&self, volume: &Volume, paths: &[PathBuf]) {
        let ids: Vec<DeviceId> = volume.devices().iter().map(|d| d.uuid).collect();
        // One candidate per device: a second path to a device already seen is skipped.
        let mut seen = std::collections::HashSet::new();
        let mut candidates: Vec<(String, DeviceId)> = Vec::new();
        let mut candidate_paths: Vec<&PathBuf> = Vec::new();
        for path in paths {
            if let Some(key) = device_key(path)
                && !seen.insert(key)
            {
                continue;
            }
            match identity(path) {
                Ok(id) => {
                    candidates.push((path.display().to_string(), id));
                    candidate_paths.push(path);
                }
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %format!("{e:#}"), "not a LUN of this volume");
                }
            }
        }
        // The import rule, the same as the agent's: an identity on two devices is refused.
        let assignment = assign_devices(&ids, &candidates);
        for &pos in &assignment.foreign {
            tracing::warn!(path = %candidate_paths[pos].display(), device = %candidates[pos].1, "a LUN of another file system");
        }
        let mut refusals: Vec<(usize, String)> = Vec::new();
        for dup in &assignment.duplicates {
            tracing::error!("{dup}");
            if let Some(index) = dup.index {
                refusals.push((index.as_usize(), dup.to_string()));
            }
        }
        let mut opened: Vec<(usize, DataLun)> = Vec::new();
        {
            let t = self.table();
            for (i, pos) in assignment.by_index.iter().enumerate() {
                let Some(pos) = *pos else { continue };
                if t.luns.get(i).is_some_and(Option::is_some) {
                    continue;
                }
                let (path, id) = (candidate_paths[pos], candidates[pos].1);
                match sanfs_lun::open_direct(path, Access::ReadWrite) {
                    Ok((file, _)) => {
                        tracing::info!(path = %path.display(), device = %id, index = i, "data LUN opened");
                        opened.push((
                            i,
                            DataLun {
                                path: path.clone(),
                                file,
                            },
                        ));
                    }
                    Err(e) => {
                        tracing::warn!(path = %path.display(), error = %e, "cannot open a data LUN")
                    }
                }
            }
        }
        let mut t = self.table.write().unwrap_or_else(|p| p.into_inner());
        if t.ids.len() <= ids.len() && ids.starts_with(&t.ids) {
            t.luns.resize_with(ids.len(), || None);
            t.refused.resize_with(ids.len(), || None);
            t.ids = ids;
        }
        for (i, why) in refusals {
            if let Some(slot) = t.refused.get_mut(i) {
                *slot = Some(why);
            }
        }
        for (i, lun) in opened {
            if let Some(slot) = t.luns.get_mut(i) {
                slot.get_or_insert(Arc::new(lun));
            }
        }
    }

    /// The paths this server opened the volume's devices by, in device order.
    pub fn opened_paths(&self) -> Vec<PathBuf> {
        self.table()
            .luns
            .iter()
            .flatten()
            .map(|l| l.path.clone())
            .collect()
    }

    /// The path this server opened device `d` by.
    pub fn path_of(&self, d: DeviceIndex) -> Option<PathBuf> {
        self.table()
            .luns
            .get(d.as_usize())
            .and_then(Option::as_ref)
            .map(|l| l.path.clone())
    }

    pub fn present(&self) -> usize {
        self.table().luns.iter().filter(|l| l.is_some()).count()
    }

    /// The identities of the volume's devices this server could not open.
    pub fn missing(&self) -> Vec<DeviceId> {
        let t = self.table();
        t.luns
            .iter()
            .zip(&t.ids)
            .filter(|(l, _)| l.is_none())
            .map(|(_, id)| *id)
            .collect()
    }

    fn lun(&self, d: DeviceIndex) -> Result<Arc<DataLun>, FsError> {
        let t = self.table();
        t.luns
            .get(d.as_usize())
            .and_then(Option::as_ref)
            .cloned()
            .ok_or_else(|| {
                let id = t
                    .ids
                    .get(d.as_usize())
                    .map(ToString::to_string)
                    .unwrap_or_default();
                match t.refused.get(d.as_usize()).and_then(Option::as_ref) {
                    Some(why) => FsError::Io(format!("data LUN {} refused: {why}", d.0)),
                    None => FsError::Io(format!(
                        "data LUN {} ({id}) is not available on the server",
                        d.0
                    )),
                }
            })
    }

    /// Executes a read plan into `buf` (`plan.len` bytes): device reads scattered to their
    /// buffer pieces, zero fill for holes and Unwritten extents.
    pub fn read_plan(&self, plan: &IoPlan, buf: &mut [u8]) -> Result<(), FsError> {
        for z in &plan.zero_fill {
            let s = range(z.buf_off, z.len, buf.len())?;
            buf[s].fill(0);
        }
        for io in &plan.device_ios {
            let lun = self.lun(io.device)?;
            let mut tmp = AlignedBuf::zeroed(to_usize(io.len)?);
            lun.file
                .read_exact_at(tmp.as_mut_slice(), io.phys_off)
                .map_err(|e| {
                    FsError::Io(format!(
                        "read {} at {}: {e}",
                        lun.path.display(),
                        io.phys_off
                    ))
                })?;
            let mut at = 0usize;
            for piece in &io.iov {
                let n = to_usize(piece.len)?;
                let s = range(piece.buf_off, piece.len, buf.len())?;
                buf[s].copy_from_slice(&tmp.as_slice()[at..at + n]);
                at += n;
            }
        }
        Ok(())
    }

    /// Executes a write plan from `buf` (`plan.len` bytes): each device I/O gathers its
    /// buffer pieces. Returns the devices written (to flush for a synchronous write).
    pub fn write_plan(&self, plan: &IoPlan, buf: &[u8]) -> Result<Vec<DeviceIndex>, FsError> {
        let mut touched = Vec::new();
        for io in &plan.device_ios {
            self.lun(io.device)?;
            let mut tmp = AlignedBuf::zeroed(to_usize(io.len)?);
            gather(io, buf, tmp.as_mut_slice())?;
            self.write_aligned(io.device, io.phys_off, &tmp)?;
            if !touched.contains(&io.device) {
                touched.push(io.device);
            }
        }
        Ok(touched)
    }

    /// The device writes of `plan` (LUN, offset, bytes: its pieces of `buf` gathered), none
    /// done: for [`DataDevices::write_ops`]. Fails, as the write would, for a LUN this server
    /// does not have.
    pub fn plan_ops(&self, plan: &IoPlan, buf: &[u8]) -> Result<Vec<(u32, u64, Vec<u8>)>, FsError> {
        plan.device_ios
            .iter()
            .map(|io| {
                self.lun(io.device)?;
                let mut bytes = vec![0u8; to_usize(io.len)?];
                gather(io, buf, &mut bytes)?;
                Ok((io.device.0, io.phys_off, bytes))
            })
            .collect()
    }

    /// Writes each of `ops` (from [`DataDevices::plan_ops`]), not flushed.
    pub fn write_ops(&self, ops: &[(u32, u64, Vec<u8>)]) -> Result<(), FsError> {
        for (lun, offset, bytes) in ops {
            self.write_raw(DeviceIndex(*lun), *offset, bytes)?;
        }
        Ok(())
    }

    /// Writes `bytes` at `offset` of LUN `device` (a whole number of blocks, as every plan's
    /// device I/O), not flushed.
    pub fn write_raw(&self, device: DeviceIndex, offset: u64, bytes: &[u8]) -> Result<(), FsError> {
        let mut tmp = AlignedBuf::zeroed(bytes.len());
        tmp.as_mut_slice().copy_from_slice(bytes);
        self.write_aligned(device, offset, &tmp)
    }

    /// Writes the aligned `tmp` at `offset` of LUN `device`, if this server may write.
    fn write_aligned(
        &self,
        device: DeviceIndex,
        offset: u64,
        tmp: &AlignedBuf,
    ) -> Result<(), FsError> {
        let lun = self.lun(device)?;
        self.may_write()?;
        lun.file
            .write_all_at(tmp.as_slice(), offset)
            .map_err(|e| FsError::Io(format!("write {} at {offset}: {e}", lun.path.display())))
    }

    /// Flushes the devices' write caches (fdatasync on the device: a cache flush), all at
    /// once (one thread per device past the first), so that a flush costs one device's flush
    /// time, not the sum.
    pub fn flush(&self, devices: &[DeviceIndex]) -> Result<(), FsError> {
        let luns = devices
            .iter()
            .map(|d| self.lun(*d))
            .collect::<Result<Vec<_>, _>>()?;
        let flush_one = |lun: &DataLun| {
            lun.file
                .sync_data()
                .map_err(|e| FsError::Io(format!("flush {}: {e}", lun.path.display())))
        };
        let Some((first, rest)) = luns.split_first() else {
            return Ok(());
        };
        std::thread::scope(|scope| {
            let others: Vec<_> = rest
                .iter()
                .map(|lun| scope.spawn(|| flush_one(lun)))
                .collect();
            let mut result = flush_one(first);
            for o in others {
                let r = o
                    .join()
                    .unwrap_or_else(|_| Err(FsError::Io("a LUN flush thread panicked".into())));
                result = result.and(r);
            }
            result
        })
    }

    /// Zeroes volume blocks `runs` (`(start block, length)`) on the LUNs and flushes the LUNs
    /// written: `fallocate(FALLOC_FL_ZERO_RANGE)` (a block device turns it into WRITE ZEROES
    /// or WRITE SAME, a file-backed LUN into unwritten extents), else writes of zeros.
    /// Returns the bytes zeroed and the bytes that lie on LUNs this server does not have.
    pub fn zero_runs(&self, volume: &Volume, runs: &[(u64, u64)]) -> Result<(u64, u64), FsError> {
        let bs = u64::from(volume.block_size());
        let bytes = runs
            .iter()
            .map(
                |&(start, len)| match (start.checked_mul(bs), len.checked_mul(bs)) {
                    (Some(o), Some(b)) => Ok((o, b)),
                    _ => Err(FsError::Range),
                },
            )
            .collect::<Result<Vec<_>, _>>()?;
        // One call per contiguous stretch of a LUN, not per stripe unit: a striped run of
        // 64 MiB is four zeroing calls on four LUNs, not a thousand (each a round trip
        // through the block layer).
        let ranges = volume
            .device_ranges(bytes)
            .map_err(|e| FsError::Io(format!("zeroing volume blocks {runs:?}: {e}")))?;
        let (mut zeroed, mut missing) = (0u64, 0u64);
        let mut touched = Vec::new();
        for r in ranges {
            let Ok(lun) = self.lun(r.device) else {
                missing += r.len;
                continue;
            };
            zero_lun(&lun, r.phys_off, r.len, &|| self.may_write())?;
            zeroed += r.len;
            if !touched.contains(&r.device) {
                touched.push(r.device);
            }
        }
        self.flush(&touched)?;
        Ok((zeroed, missing))
    }

    /// Flushes every open LUN.
    pub fn flush_all(&self) -> Result<(), FsError> {
        let t = self.table();
        let all: Vec<DeviceIndex> = (0..t.luns.len())
            .filter(|i| t.luns[*i].is_some())
            .map(|i| DeviceIndex(u32::try_from(i).unwrap_or(u32::MAX)))
            .collect();
        drop(t);
        self.flush(&all)
    }
}

/// Most bytes of zeros written at once where the LUN cannot zero a range itself.
const ZERO_CHUNK: u64 = 1 << 20;

/// Zeroes `[off, off + len)` of one LUN.
fn zero_lun(
    lun: &DataLun,
    off: u64,
    len: u64,
    may_write: &dyn Fn() -> Result<(), FsError>,
) -> Result<(), FsError> {
    may_write()?;
    let flags = rustix::fs::FallocateFlags::ZERO_RANGE | rustix::fs::FallocateFlags::KEEP_SIZE;
    match rustix::fs::fallocate(&lun.file, flags, off, len) {
        Ok(()) => return Ok(()),
        Err(e) if e == rustix::io::Errno::OPNOTSUPP || e == rustix::io::Errno::INVAL => {}
        Err(e) => {
            return Err(FsError::Io(format!(
                "zero {} at {off}+{len}: {e}",
                lun.path.display()
            )));
        }
    }
    let zeros = AlignedBuf::zeroed(to_usize(len.min(ZERO_CHUNK))?);
    let mut at = 0u64;
    while at < len {
        let n = (len - at).min(ZERO_CHUNK);
        may_write()?;
        lun.file
            .write_all_at(&zeros.as_slice()[..to_usize(n)?], off + at)
            .map_err(|e| {
                FsError::Io(format!("zero {} at {}: {e}", lun.path.display(), off + at))
            })?;
        at += n;
    }
    Ok(())
}

/// Gathers the pieces of `buf` that device I/O `io` writes into `out` (`io.len` bytes).
fn gather(io: &DeviceIo, buf: &[u8], out: &mut [u8]) -> Result<(), FsError> {
    let mut at = 0usize;
    for piece in &io.iov {
        let n = to_usize(piece.len)?;
        let s = range(piece.buf_off, piece.len, buf.len())?;
        out.get_mut(at..at + n)
            .ok_or_else(|| FsError::Io("a device I/O longer than its pieces".into()))?
            .copy_from_slice(&buf[s]);
        at += n;
    }
    Ok(())
}

fn to_usize(v: u64) -> Result<usize, FsError> {
    usize::try_from(v).map_err(|_| FsError::Invalid(format!("{v} bytes do not fit in memory")))
}

fn range(off: u64, len: u64, buf_len: usize) -> Result<std::ops::Range<usize>, FsError> {
    let start = to_usize(off)?;
    let end = start
        .checked_add(to_usize(len)?)
        .filter(|e| *e <= buf_len)
        .ok_or_else(|| {
            FsError::Io(format!(
                "plan piece {off}+{len} outside a {buf_len}-byte buffer"
            ))
        })?;
    Ok(start..end)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{LayoutKindConfig, VolumeConfig};

    /// A cloned LUN (one label on two devices) is refused by the import rule, whichever path
    /// is listed first, as the agent's discovery refuses it: the device is missing, and
    /// proxied I/O on it says why.
    #[test]
    fn an_identity_on_two_devices_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let luns: Vec<PathBuf> = (0..2)
            .map(|i| {
                let p = dir.path().join(format!("lun{i}"));
                std::fs::File::create(&p).unwrap().set_len(4 << 20).unwrap();
                p
            })
            .collect();
        let cfg = VolumeConfig {
            layout: LayoutKindConfig::Linear,
            block_size: 4096,
            stripe_unit: 64 << 10,
            data_offset: 1 << 20,
            devices: luns.clone(),
            lvm_vg: None,
            lvm_lv: None,
        };
        let f = crate::format::format_volume(&cfg, false, 1_790_000_000).unwrap();
        let clone = dir.path().join("clone-of-1");
        std::fs::copy(&luns[1], &clone).unwrap();
        let id1 = f.volume.devices()[1].uuid;
        for paths in [
            vec![luns[0].clone(), luns[1].clone(), clone.clone()],
            vec![clone.clone(), luns[0].clone(), luns[1].clone()],
        ] {
            let devices = DataDevices::open(&f.volume, &paths);
            assert_eq!(devices.present(), 1);
            assert_eq!(devices.missing(), vec![id1]);
            let err = devices.lun(DeviceIndex(1)).err().unwrap().to_string();
            assert!(err.contains("refused"), "{err}");
            assert!(err.contains("is on 2 devices"), "{err}");
        }
        // The same path twice is one device, not a clone.
        let devices = DataDevices::open(
            &f.volume,
            &[luns[0].clone(), luns[1].clone(), luns[1].clone()],
        );
        assert_eq!(devices.present(), 2);
    }
}
