//! Finding this node's LUNs of a volume: by identity, never by path.
//!
//! [`discover`] expands the configured globs (`*` and `?` in the last path component; a path
//! without wildcards is taken as is, so file-backed LUNs can be listed by name), and reads the
//! identity of every block device or regular file found ([`sanfs_lun::probe_identity`]: its
//! first bytes, read with `O_DIRECT`, hold a sanfs device label or an LVM2 PV label). The
//! opens, sizes and logical block sizes come from sanfs-lun too. A device whose identity is
//! one of the volume's is checked (size at least what the volume records, logical block size
//! dividing the volume's block size) and opened once, read-write with `O_DIRECT`, however many
//! paths lead to it (`/dev/disk/by-id` symlinks; deduplicated by `st_rdev`, or by
//! `(st_dev, st_ino)` for files). Two different devices that carry one identity (a cloned
//! LUN, or one LUN under two names) are refused by the import rule
//! ([`sanfs_blockmap::import::assign_devices`], the same as the server's): neither is opened,
//! both are listed in `rejected`, and the device counts as missing. A LUN this node cannot see is not fatal: the result lists
//! the devices found by index, and the missing ones (each with a `warn!`), so that I/O on
//! them fails per device while the rest of the volume works.

use std::collections::HashSet;
use std::fs::File;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use sanfs_blockmap::import::assign_devices;
use sanfs_blockmap::volume::{DeviceId, DeviceIndex, Volume};
use sanfs_lun::Access;

/// Where the agent looks for LUNs unless configured otherwise.
pub const DEFAULT_GLOBS: &[&str] = &[
    "/dev/disk/by-id/*",
    "/dev/sd*",
    "/dev/nvme*n*",
    "/dev/vd*",
    "/dev/loop*",
];

/// Discovery settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiscoveryConfig {
    /// Paths or globs (`*`, `?` in the last component) to scan, in order.
    pub globs: Vec<String>,
}

impl Default for DiscoveryConfig {
    fn default() -> DiscoveryConfig {
        DiscoveryConfig {
            globs: DEFAULT_GLOBS.iter().map(|g| (*g).to_owned()).collect(),
        }
    }
}

/// One LUN of the volume, found and opened.
#[derive(Debug)]
pub struct FoundDevice {
    pub index: DeviceIndex,
    pub id: DeviceId,
    /// The first path that led to it.
    pub path: PathBuf,
    /// Opened read-write, with `O_DIRECT` unless `direct` is false.
    pub file: File,
    pub size_bytes: u64,
    /// Offsets and lengths of direct I/O must be multiples of this.
    pub logical_block_size: u32,
    pub is_block_device: bool,
    /// False only where the file system refused `O_DIRECT` (a file-backed LUN on tmpfs).
    pub direct: bool,
}

/// What [`discover`] found.
#[derive(Debug, Default)]
pub struct Discovery {
    /// The volume's devices found on this node, by index.
    pub found: Vec<FoundDevice>,
    /// The volume's devices not found (or not usable) on this node.
    pub missing: Vec<(DeviceIndex, DeviceId)>,
    /// Labelled devices that belong to something else.
    pub foreign: Vec<(PathBuf, DeviceId)>,
    /// Devices of the volume that were found but could not be used, and why.
    pub rejected: Vec<(PathBuf, String)>,
}

impl Discovery {
    pub fn device(&self, index: DeviceIndex) -> Option<&FoundDevice> {
        self.found.iter().find(|d| d.index == index)
    }

    /// The open handles by device index, `None` where missing: what [`crate::engine::Engine::new`]
    /// takes. `device_count` is the volume's number of devices.
    pub fn into_files(self, device_count: usize) -> Vec<Option<File>> {
        let mut files: Vec<Option<File>> = (0..device_count).map(|_| None).collect();
        for d in self.found {
            if let Some(slot) = files.get_mut(d.index.as_usize()) {
                *slot = Some(d.file);
            }
        }
        files
    }
}

// The glob expansion is sanfs-lun's, shared with the server's `volume.devices`.
pub use sanfs_lun::glob::{expand_globs, wildcard_match};

// Where the agent's tests have always found it.
pub use sanfs_lun::probe_identity;

/// Opens a device of the volume and checks it against what the volume needs.
fn open_lun(
    path: &Path,
    index: DeviceIndex,
    id: DeviceId,
    volume: &Volume,
) -> Result<FoundDevice, String> {
    let (file, direct) =
        sanfs_lun::open_direct(path, Access::ReadWrite).map_err(|e| format!("open: {e}"))?;
    let geometry = sanfs_lun::describe(&file).map_err(|e| e.to_string())?;
    let is_block_device = geometry.identity.is_block_device();
    let (size_bytes, logical_block_size) = (geometry.size_bytes, geometry.logical_block_size);
    let need = volume
        .devices()
        .get(index.as_usize())
        .map_or(0, |d| d.size_bytes);
    if size_bytes < need {
        return Err(format!(
            "{size_bytes} bytes, but the volume needs {need} on this device"
        ));
    }
    if !volume.block_size().is_multiple_of(logical_block_size) {
        return Err(format!(
            "logical block size {logical_block_size} does not divide the volume's block size {}",
            volume.block_size()
        ));
    }
    if !direct {
        tracing::warn!(path = %path.display(), "O_DIRECT refused: LUN used buffered");
    }
    Ok(FoundDevice {
        index,
        id,
        path: path.to_path_buf(),
        file,
        size_bytes,
        logical_block_size,
        is_block_device,
        direct,
    })
}

/// Finds and opens this node's devices of `volume` among the configured globs.
pub fn discover(volume: &Volume, config: &DiscoveryConfig) -> Discovery {
    scan(volume, config, &|_| true, true)
}

/// [`discover`] for the devices in `wanted` only (a rescan for LUNs missing so far, or added
/// by a growth of the volume); the ones still missing are not warned about again.
pub fn discover_among(
    volume: &Volume,
    config: &DiscoveryConfig,
    wanted: &[DeviceIndex],
) -> Discovery {
    scan(volume, config, &|i| wanted.contains(&i), false)
}

/// Finds and opens one device of `volume` again (the health check of a LUN poisoned by a
/// failed write): the same identity search as [`discover`], for `index` only.
pub fn find_device(
    volume: &Volume,
    config: &DiscoveryConfig,
    index: DeviceIndex,
) -> Result<FoundDevice, String> {
    let mut result = scan(volume, config, &|i| i == index, true);
    if let Some(pos) = result.found.iter().position(|d| d.index == index) {
        return Ok(result.found.swap_remove(pos));
    }
    Err(match result.rejected.first() {
        Some((path, why)) => format!("{}: {why}", path.display()),
        None => "no device with its identity among the configured globs".to_owned(),
    })
}

fn scan(
    volume: &Volume,
    config: &DiscoveryConfig,
    only: &dyn Fn(DeviceIndex) -> bool,
    warn_missing: bool,
) -> Discovery {
    let mut result = Discovery::default();
    let mut seen: HashSet<(bool, u64, u64)> = HashSet::new();
    let mut candidates: Vec<(String, DeviceId)> = Vec::new();
    let mut candidate_paths: Vec<PathBuf> = Vec::new();
    for path in expand_globs(&config.globs) {
        let Ok(meta) = std::fs::metadata(&path) else {
            continue;
        };
        let key = if meta.file_type().is_block_device() {
            (true, meta.rdev(), 0)
        } else if meta.is_file() {
            (false, meta.dev(), meta.ino())
        } else {
            continue;
        };
        if !seen.insert(key) {
            continue; // another path to a device already looked at
        }
        match probe_identity(&path) {
            Ok(Some(id)) => {
                candidates.push((path.display().to_string(), id));
                candidate_paths.push(path);
            }
            Ok(None) => {}
            Err(e) => {
                tracing::debug!(path = %path.display(), error = %e, "cannot probe");
            }
        }
    }
    // The import rule, the same as the server's: an identity on two devices is refused.
    let ids: Vec<DeviceId> = volume.devices().iter().map(|d| d.uuid).collect();
    let assignment = assign_devices(&ids, &candidates);
    for &pos in &assignment.foreign {
        let (path, id) = (&candidate_paths[pos], candidates[pos].1);
        tracing::debug!(path = %path.display(), device = %id, "a LUN of something else");
        result.foreign.push((path.clone(), id));
    }
    for dup in &assignment.duplicates {
        let Some(index) = dup.index else { continue };
        if !only(index) {
            continue;
        }
        tracing::error!("{dup}");
        for (pos, (_, id)) in candidates.iter().enumerate() {
            if *id == dup.id {
                result
                    .rejected
                    .push((candidate_paths[pos].clone(), dup.to_string()));
            }
        }
    }
    for (i, pos) in assignment.by_index.iter().enumerate() {
        let Some(pos) = *pos else { continue };
        let index = DeviceIndex(i as u32);
        if !only(index) {
            continue;
        }
        let (path, id) = (candidate_paths[pos].clone(), candidates[pos].1);
        match open_lun(&path, index, id, volume) {
            Ok(found) => {
                tracing::info!(path = %path.display(), device = %id, index = index.0,
                    size = found.size_bytes, lbs = found.logical_block_size, "LUN opened");
                result.found.push(found);
            }
            Err(reason) => {
                tracing::warn!(path = %path.display(), device = %id, %reason, "LUN not usable");
                result.rejected.push((path, reason));
            }
        }
    }
    result.found.sort_by_key(|d| d.index);
    for (i, dev) in volume.devices().iter().enumerate() {
        let index = DeviceIndex(i as u32);
        if only(index) && result.device(index).is_none() {
            if warn_missing {
                tracing::warn!(device = %dev.uuid, index = i, "LUN not found on this node");
            }
            result.missing.push((index, dev.uuid));
        }
    }
    result
}
