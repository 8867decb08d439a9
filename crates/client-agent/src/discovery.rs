//! Finding this node's LUNs of a volume: by identity, never by path.
//!
//! [`discover`] expands the configured globs (`*` and `?` in the last path component; a path
//! without wildcards is taken as is, so file-backed LUNs can be listed by name), reads the
//! first [`PROBE_SIZE`] bytes of every block device or regular file found with `O_DIRECT`, and
//! recognises a sanfs [`DeviceLabel`] or an LVM2 PV label in them. A device whose identity is
//! one of the volume's is checked (size at least what the volume records, logical block size
//! dividing the volume's block size) and opened once, read-write with `O_DIRECT`, however many
//! paths lead to it (`/dev/disk/by-id` symlinks; deduplicated by `st_rdev`, or by
//! `(st_dev, st_ino)` for files). A LUN this node cannot see is not fatal: the result lists
//! the devices found by index, and the missing ones (each with a `warn!`), so that I/O on
//! them fails per device while the rest of the volume works.

use std::collections::HashSet;
use std::fs::{File, OpenOptions};
use std::io::{self, Seek, SeekFrom};
use std::os::unix::fs::{FileExt, FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use sanfs_blockmap::label::{DeviceLabel, PROBE_SIZE};
use sanfs_blockmap::lvm::{LABEL_SCAN_BYTES, parse_pv_label};
use sanfs_blockmap::volume::{DeviceId, DeviceIndex, Volume};

use crate::buf::AlignedBuf;

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

/// Whether `name` matches `pattern`, where `*` matches any run of characters and `?` one.
pub fn wildcard_match(pattern: &str, name: &str) -> bool {
    let (p, n): (Vec<char>, Vec<char>) = (pattern.chars().collect(), name.chars().collect());
    let (mut pi, mut ni) = (0usize, 0usize);
    let mut star: Option<(usize, usize)> = None;
    while ni < n.len() {
        match p.get(pi) {
            Some('*') => {
                star = Some((pi, ni));
                pi += 1;
            }
            Some(&c) if c == '?' || c == n[ni] => {
                pi += 1;
                ni += 1;
            }
            _ => match star {
                Some((sp, sn)) => {
                    pi = sp + 1;
                    ni = sn + 1;
                    star = Some((sp, sn + 1));
                }
                None => return false,
            },
        }
    }
    p[pi..].iter().all(|&c| c == '*')
}

/// The paths the globs name, in glob order, each glob's matches sorted. Wildcards are honoured
/// in the last component only; a path without wildcards is returned if it exists.
pub fn expand_globs(globs: &[String]) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for glob in globs {
        let path = Path::new(glob);
        let Some(last) = path.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        if !last.contains(['*', '?']) {
            if path.exists() {
                out.push(path.to_path_buf());
            }
            continue;
        }
        let dir = path.parent().filter(|p| !p.as_os_str().is_empty());
        let dir = dir.unwrap_or(Path::new("."));
        let Ok(entries) = std::fs::read_dir(dir) else {
            continue;
        };
        let mut matches: Vec<PathBuf> = entries
            .filter_map(Result::ok)
            .filter(|e| {
                e.file_name()
                    .to_str()
                    .is_some_and(|n| wildcard_match(last, n))
            })
            .map(|e| e.path())
            .collect();
        matches.sort();
        out.extend(matches);
    }
    out
}

fn o_direct() -> i32 {
    // O_DIRECT fits an int; the cast only changes the type.
    rustix::fs::OFlags::DIRECT.bits() as i32
}

/// Opens with `O_DIRECT`, falling back to buffered I/O where the file system refuses it.
fn open_direct(path: &Path, write: bool) -> io::Result<(File, bool)> {
    let mut opts = OpenOptions::new();
    opts.read(true).write(write);
    match opts.clone().custom_flags(o_direct()).open(path) {
        Ok(f) => Ok((f, true)),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok((opts.open(path)?, false)),
        Err(e) => Err(e),
    }
}

/// Reads the first [`PROBE_SIZE`] bytes (fewer if the device is smaller) with `O_DIRECT`.
fn read_head(path: &Path) -> io::Result<Vec<u8>> {
    let (file, _) = open_direct(path, false)?;
    let mut buf = AlignedBuf::zeroed(PROBE_SIZE.max(LABEL_SCAN_BYTES));
    let mut got = 0usize;
    while got < buf.len() {
        match file.read_at(&mut buf[got..], got as u64) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
        // A direct read of a file whose end is not block aligned returns a short, unaligned
        // tail; anything after it would be misaligned, and there is nothing after it anyway.
        if !got.is_multiple_of(512) {
            break;
        }
    }
    Ok(buf[..got].to_vec())
}

/// The identity in a device's first bytes: its sanfs label, else its LVM2 PV label.
pub fn identify(head: &[u8]) -> Option<DeviceId> {
    if let Ok(label) = DeviceLabel::decode(head) {
        return Some(DeviceId::Sanfs(label.device_uuid));
    }
    parse_pv_label(head)
        .ok()
        .map(|pv| DeviceId::LvmPv(pv.pv_id))
}

/// Reads the identity of the device or file at `path` (`None`: no label).
pub fn probe_identity(path: &Path) -> io::Result<Option<DeviceId>> {
    Ok(identify(&read_head(path)?))
}

/// `statx`'s `O_DIRECT` file-offset alignment, when it reports one.
fn dio_alignment(file: &File) -> Option<u32> {
    use rustix::fs::{AtFlags, StatxFlags, statx};
    let x = statx(file, "", AtFlags::EMPTY_PATH, StatxFlags::DIOALIGN).ok()?;
    let align = x.stx_dio_offset_align;
    (x.stx_mask & StatxFlags::DIOALIGN.bits() != 0 && align.is_power_of_two() && align >= 512)
        .then_some(align)
}

/// A block device's logical block size from sysfs (the parent disk's for a partition), else
/// `statx`, else 512.
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

/// Opens a device of the volume and checks it against what the volume needs.
fn open_lun(
    path: &Path,
    index: DeviceIndex,
    id: DeviceId,
    volume: &Volume,
) -> Result<FoundDevice, String> {
    let (mut file, direct) = open_direct(path, true).map_err(|e| format!("open: {e}"))?;
    let meta = file.metadata().map_err(|e| format!("stat: {e}"))?;
    let is_block_device = meta.file_type().is_block_device();
    let size_bytes = if is_block_device {
        file.seek(SeekFrom::End(0))
            .map_err(|e| format!("seek to end: {e}"))?
    } else {
        meta.len()
    };
    let logical_block_size = if is_block_device {
        block_device_logical_block_size(&file, meta.rdev())
    } else {
        dio_alignment(&file).unwrap_or(512)
    };
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
    scan(volume, config, None)
}

/// Finds and opens one device of `volume` again (the health check of a LUN poisoned by a
/// failed write): the same identity search as [`discover`], for `index` only.
pub fn find_device(
    volume: &Volume,
    config: &DiscoveryConfig,
    index: DeviceIndex,
) -> Result<FoundDevice, String> {
    let mut result = scan(volume, config, Some(index));
    if let Some(pos) = result.found.iter().position(|d| d.index == index) {
        return Ok(result.found.swap_remove(pos));
    }
    Err(match result.rejected.first() {
        Some((path, why)) => format!("{}: {why}", path.display()),
        None => "no device with its identity among the configured globs".to_owned(),
    })
}

fn scan(volume: &Volume, config: &DiscoveryConfig, only: Option<DeviceIndex>) -> Discovery {
    let mut result = Discovery::default();
    let mut seen: HashSet<(bool, u64, u64)> = HashSet::new();
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
        let id = match probe_identity(&path) {
            Ok(Some(id)) => id,
            Ok(None) => continue,
            Err(e) => {
                tracing::debug!(path = %path.display(), error = %e, "cannot probe");
                continue;
            }
        };
        let Some(index) = volume.device_index(&id) else {
            tracing::debug!(path = %path.display(), device = %id, "a LUN of something else");
            result.foreign.push((path, id));
            continue;
        };
        if only.is_some_and(|o| o != index) {
            continue;
        }
        if let Some(first) = result.device(index) {
            tracing::warn!(path = %path.display(), first = %first.path.display(), device = %id,
                "a second device carries the identity of one already opened: ignored");
            result
                .rejected
                .push((path, format!("duplicate of {}", first.path.display())));
            continue;
        }
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
        if only.is_none_or(|o| o == index) && result.device(index).is_none() {
            tracing::warn!(device = %dev.uuid, index = i,
                "LUN not found on this node");
            result.missing.push((index, dev.uuid));
        }
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wildcards_match_like_a_shell() {
        for (p, n, want) in [
            ("*", "", true),
            ("*", "sda", true),
            ("sd*", "sda1", true),
            ("sd*", "vda", false),
            ("nvme*n*", "nvme0n1", true),
            ("nvme*n*", "nvme0", false),
            ("loop?", "loop7", true),
            ("loop?", "loop17", false),
            ("a*b*c", "aXXbYYc", true),
            ("a*b*c", "aXXbYY", false),
            ("exact", "exact", true),
            ("exact", "exactly", false),
        ] {
            assert_eq!(wildcard_match(p, n), want, "{p} vs {n}");
        }
    }

    #[test]
    fn globs_expand_in_the_last_component_and_plain_paths_pass_through() {
        let dir = tempfile::tempdir().unwrap();
        for n in ["lun1", "lun0", "other"] {
            std::fs::write(dir.path().join(n), b"x").unwrap();
        }
        let d = dir.path().display();
        let got = expand_globs(&[
            format!("{d}/lun*"),
            format!("{d}/other"),
            format!("{d}/absent"),
            format!("{d}/nomatch*"),
        ]);
        let names: Vec<_> = got
            .iter()
            .map(|p| p.file_name().unwrap().to_str().unwrap().to_owned())
            .collect();
        assert_eq!(names, ["lun0", "lun1", "other"]);
    }

    #[test]
    fn identify_knows_sanfs_labels_and_nothing_else() {
        let label = DeviceLabel {
            fs_uuid: uuid::Uuid::from_u128(1),
            device_uuid: uuid::Uuid::from_u128(2),
            device_index: 0,
            device_count: 1,
            device_size: 1 << 30,
            data_offset: 1 << 20,
            block_size: 4096,
            layout: sanfs_blockmap::label::LabelLayout::Linear,
            formatted_at: 0,
        };
        let mut head = label.encode();
        head.resize(PROBE_SIZE, 0);
        assert_eq!(
            identify(&head),
            Some(DeviceId::Sanfs(uuid::Uuid::from_u128(2)))
        );
        assert_eq!(identify(&vec![0u8; PROBE_SIZE]), None);
        assert_eq!(identify(b"short"), None);
    }
}
