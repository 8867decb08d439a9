//! `sanfs-mds format`, the device side: check the configured LUNs, build the volume, and
//! (for linear and striped layouts) write a sanfs label at the start of every LUN.
//!
//! Writing is the last step: every device is opened, probed and sized first, and a format
//! that is refused (a foreign or sanfs signature without `--force`, a duplicate or too small
//! device, a bad geometry) has written nothing. For an LVM2 logical volume nothing is
//! written at all: LVM's PV labels keep naming the devices, the LV's layout is read from the
//! VG metadata on the PVs (with blockmap's parsers, without device-mapper), and sanfs keeps
//! its own identity in the metadata store. The caller then creates the metadata store from
//! the returned [`Formatted`].

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::{Context, bail};
use sanfs_blockmap::import::{PvReading, check_lv_import};
use sanfs_blockmap::label::{self, DeviceLabel, LabelLayout, Signature};
use sanfs_blockmap::lvm::VgMetadata;
use sanfs_blockmap::volume::{DeviceId, Volume, VolumeDevice};
use uuid::Uuid;

use crate::config::{LayoutKindConfig, VolumeConfig};
use crate::device::Lun;

/// A linear LUN must hold at least this many blocks after `data_offset`.
pub const MIN_LINEAR_BLOCKS: u64 = 16;

/// The result of a format: what the metadata store is initialised with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Formatted {
    /// The new file system's identity.
    pub fs_uuid: Uuid,
    /// The volume: devices (by label or PV UUID) and segments.
    pub volume: Volume,
    /// `(vg, lv)` for an imported LVM2 logical volume.
    pub lvm: Option<(String, String)>,
    /// The path of each volume device, in [`Volume::devices`] order (for messages only:
    /// paths differ from node to node).
    pub device_paths: Vec<PathBuf>,
}

/// Checks the configured devices and formats them (see the module doc). `now_unix_secs` is
/// recorded in the labels.
pub fn format_volume(
    cfg: &VolumeConfig,
    force: bool,
    now_unix_secs: i64,
) -> anyhow::Result<Formatted> {
    format_volume_checked(cfg, force, now_unix_secs, || Ok(()))
}

/// [`format_volume`], running `before_write` after every device check has passed and before
/// the first byte is written, so that a caller's own refusal (the metadata store exists)
/// also leaves every device as it was.
pub fn format_volume_checked(
    cfg: &VolumeConfig,
    force: bool,
    now_unix_secs: i64,
    before_write: impl FnOnce() -> anyhow::Result<()>,
) -> anyhow::Result<Formatted> {
    cfg.validate().context("volume configuration")?;
    let expanded;
    let cfg = match cfg.layout {
        LayoutKindConfig::Linear | LayoutKindConfig::Striped => {
            if let Some(glob) = cfg.devices.iter().find(|d| sanfs_lun::glob::is_glob(d)) {
                bail!(
                    "volume.devices {}: a glob does not say the order of the LUNs in a {} \
                     volume; list the LUNs one by one, in volume order, to format (globs are \
                     for serving after that)",
                    glob.display(),
                    cfg.layout
                );
            }
            cfg
        }
        // The PVs are taken by their UUIDs, whatever their order: globs are expanded.
        LayoutKindConfig::Lvm => {
            let devices = crate::config::device_paths(&cfg.devices, &[]);
            if devices.is_empty() {
                bail!("volume.devices matches no device");
            }
            expanded = VolumeConfig {
                devices,
                ..cfg.clone()
            };
            &expanded
        }
    };
    match cfg.layout {
        LayoutKindConfig::Linear | LayoutKindConfig::Striped => {
            format_labelled(cfg, force, now_unix_secs, before_write)
        }
        LayoutKindConfig::Lvm => {
            let formatted = import_lvm(cfg)?;
            before_write()?;
            Ok(formatted)
        }
    }
}

/// Opens every device, refusing the same device under two paths.
fn open_all(cfg: &VolumeConfig, writable: bool) -> anyhow::Result<Vec<Lun>> {
    let mut luns: Vec<Lun> = Vec::with_capacity(cfg.devices.len());
    for path in &cfg.devices {
        let lun = Lun::open(path, writable)?;
        if let Some(other) = luns.iter().find(|l| l.identity() == lun.identity()) {
            bail!(
                "{} and {} are the same device",
                other.path().display(),
                path.display()
            );
        }
        luns.push(lun);
    }
    Ok(luns)
}

fn format_labelled(
    cfg: &VolumeConfig,
    force: bool,
    now_unix_secs: i64,
    before_write: impl FnOnce() -> anyhow::Result<()>,
) -> anyhow::Result<Formatted> {
    let luns = open_all(cfg, true)?;
    let striped = cfg.layout == LayoutKindConfig::Striped;
    let block_size = u64::from(cfg.block_size);

    // 1. Nothing of value on any device (unless forced).
    let mut found = Vec::new();
    for lun in &luns {
        let head = lun.read_prefix(label::PROBE_SIZE)?;
        let signatures = label::probe(&head);
        if !signatures.is_empty() {
            let what: Vec<String> = signatures.iter().map(Signature::to_string).collect();
            found.push(format!(
                "{} holds {}",
                lun.path().display(),
                what.join(", ")
            ));
        }
    }
    if !found.is_empty() {
        if force {
            for f in &found {
                tracing::warn!("--force: overwriting: {f}");
            }
        } else {
            bail!(
                "refusing to format: {}; nothing was written (use --force to overwrite)",
                found.join("; ")
            );
        }
    }

    // 2. Geometry: every device big enough and aligned for direct I/O.
    let min_usable = if striped {
        cfg.stripe_unit
    } else {
        MIN_LINEAR_BLOCKS * block_size
    };
    for lun in &luns {
        let lbs = lun.logical_block_size();
        if !block_size.is_multiple_of(u64::from(lbs)) {
            bail!(
                "{}: block size {block_size} is not a multiple of the device's logical block \
                 size {lbs}",
                lun.path().display()
            );
        }
        let need = cfg.data_offset.saturating_add(min_usable);
        if lun.size_bytes() < need {
            bail!(
                "{} is too small: {} bytes, needs at least {need} (data offset {} + {min_usable})",
                lun.path().display(),
                lun.size_bytes(),
                cfg.data_offset
            );
        }
    }

    // 3. The volume, with a fresh UUID per LUN.
    let fs_uuid = Uuid::new_v4();
    let device_uuids: Vec<Uuid> = luns.iter().map(|_| Uuid::new_v4()).collect();
    let devices: Vec<VolumeDevice> = luns
        .iter()
        .zip(&device_uuids)
        .map(|(lun, &uuid)| VolumeDevice {
            uuid: DeviceId::Sanfs(uuid),
            size_bytes: lun.size_bytes(),
        })
        .collect();
    let (volume, layout) = if striped {
        (
            Volume::striped(cfg.block_size, devices, cfg.data_offset, cfg.stripe_unit),
            LabelLayout::Striped {
                stripe_unit: cfg.stripe_unit,
            },
        )
    } else {
        (
            Volume::linear(cfg.block_size, devices, cfg.data_offset),
            LabelLayout::Linear,
        )
    };
    let volume = volume.context("build the volume")?;
    let device_count = u32::try_from(luns.len()).context("too many devices")?;
    let labels: Vec<DeviceLabel> = luns
        .iter()
        .zip(device_uuids)
        .zip(0u32..)
        .map(|((lun, device_uuid), device_index)| DeviceLabel {
            fs_uuid,
            device_uuid,
            device_index,
            device_count,
            device_size: lun.size_bytes(),
            data_offset: cfg.data_offset,
            block_size: cfg.block_size,
            layout,
            formatted_at: now_unix_secs,
        })
        .collect();

    // 4. Write every label, then make each durable and read it back.
    before_write()?;
    for (lun, label) in luns.iter().zip(&labels) {
        lun.write_at(0, &label.encode())?;
    }
    for (lun, label) in luns.iter().zip(&labels) {
        lun.sync()?;
        let back = lun.read_at(0, label::LABEL_SIZE)?;
        let decoded = DeviceLabel::decode(&back)
            .with_context(|| format!("{}: the label just written", lun.path().display()))?;
        if decoded != *label {
            bail!(
                "{}: the label read back differs from the one written",
                lun.path().display()
            );
        }
        tracing::info!(
            device = %lun.path().display(),
            device_uuid = %label.device_uuid,
            index = label.device_index,
            "labelled"
        );
    }
    Ok(Formatted {
        fs_uuid,
        volume,
        lvm: None,
        device_paths: cfg.devices.clone(),
    })
}

pub use sanfs_lun::lvm::LvmPv;

/// Reads an LVM2 PV ([`sanfs_lun::lvm::read_pv`], the same as the agent's): its label, then
/// every metadata area. Fails only when there is no valid PV label; unreadable metadata areas
/// are listed in `metadata_problems`.
pub fn read_lvm_pv(lun: &Lun) -> anyhow::Result<LvmPv> {
    let read_at = |off: u64, len: usize| {
        lun.read_at(off, len)
            .map_err(|e| std::io::Error::other(format!("{e:#}")))
    };
    sanfs_lun::lvm::read_pv(lun.size_bytes(), &read_at)
        .with_context(|| lun.path().display().to_string())
}

/// Chooses the newest metadata of VG `vg` among the PVs, refusing PVs of other VGs.
pub fn vg_metadata<'a>(pvs: &'a [(PathBuf, LvmPv)], vg: &str) -> anyhow::Result<&'a VgMetadata> {
    for (path, pv) in pvs {
        if let Some(meta) = &pv.metadata
            && meta.name != vg
        {
            bail!(
                "{} is a PV of volume group {:?}, not {vg:?}",
                path.display(),
                meta.name
            );
        }
    }
    sanfs_lun::lvm::newest_metadata(pvs, vg).map_err(|why| anyhow::anyhow!(why))
}

fn import_lvm(cfg: &VolumeConfig) -> anyhow::Result<Formatted> {
    let (Some(vg), Some(lv)) = (&cfg.lvm_vg, &cfg.lvm_lv) else {
        bail!("layout = \"lvm\" needs volume.lvm_vg and volume.lvm_lv");
    };
    let luns = open_all(cfg, false)?;
    let mut pvs = Vec::with_capacity(luns.len());
    for lun in &luns {
        pvs.push((lun.path().to_owned(), read_lvm_pv(lun)?));
    }
    let meta = vg_metadata(&pvs, vg)?;
    for (path, pv) in &pvs {
        if meta.pv_by_id(&pv.label.pv_id).is_none() {
            bail!(
                "{} (PV {}) is not a PV of volume group {vg:?} (seqno {})",
                path.display(),
                pv.label.pv_id,
                meta.seqno
            );
        }
    }
    // The import rule (the same as `volume inspect` reports): refusals stop the format before
    // anything is written; warnings are logged.
    let readings: Vec<PvReading> = pvs.iter().map(|(path, pv)| pv.reading(path)).collect();
    let verdict = check_lv_import(meta, lv, &readings);
    sanfs_lun::lvm::enforce(vg, lv, &verdict, "nothing was written").map_err(anyhow::Error::msg)?;
    let volume = meta
        .lv_volume(lv, cfg.block_size)
        .with_context(|| format!("logical volume {vg}/{lv}"))?;
    let by_id: BTreeMap<_, _> = pvs
        .iter()
        .zip(&luns)
        .map(|((path, pv), lun)| (pv.label.pv_id, (path, lun)))
        .collect();
    let mut device_paths = Vec::with_capacity(volume.devices().len());
    for dev in volume.devices() {
        let DeviceId::LvmPv(id) = dev.uuid else {
            bail!("volume device {} is not an LVM2 PV", dev.uuid);
        };
        let Some((path, lun)) = by_id.get(&id) else {
            let hint = meta
                .pv_by_id(&id)
                .and_then(|p| p.device_hint.clone())
                .unwrap_or_else(|| "unknown".into());
            bail!(
                "logical volume {vg}/{lv} uses PV {id} (last seen as {hint}), which is not in \
                 volume.devices"
            );
        };
        if lun.size_bytes() < dev.size_bytes {
            bail!(
                "{} (PV {id}) is {} bytes, smaller than the {} bytes the VG metadata records",
                path.display(),
                lun.size_bytes(),
                dev.size_bytes
            );
        }
        device_paths.push((*path).clone());
    }
    Ok(Formatted {
        fs_uuid: Uuid::new_v4(),
        volume,
        lvm: Some((vg.clone(), lv.clone())),
        device_paths,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lun_files(dir: &std::path::Path, sizes: &[u64]) -> Vec<PathBuf> {
        sizes
            .iter()
            .enumerate()
            .map(|(i, &size)| {
                let path = dir.join(format!("lun{i}"));
                std::fs::File::create(&path).unwrap().set_len(size).unwrap();
                path
            })
            .collect()
    }

    fn config(layout: LayoutKindConfig, devices: Vec<PathBuf>) -> VolumeConfig {
        VolumeConfig {
            layout,
            block_size: 4096,
            stripe_unit: 64 << 10,
            data_offset: 1 << 20,
            devices,
            lvm_vg: None,
            lvm_lv: None,
        }
    }

    /// A glob does not say the volume order: refused for linear and striped, before anything
    /// is written.
    #[test]
    fn a_glob_is_refused_for_a_labelled_format() {
        let dir = tempfile::tempdir().unwrap();
        let paths = lun_files(dir.path(), &[8 << 20, 8 << 20]);
        for layout in [LayoutKindConfig::Linear, LayoutKindConfig::Striped] {
            let cfg = config(layout, vec![dir.path().join("lun*")]);
            let err = format!("{:#}", format_volume(&cfg, false, 0).unwrap_err());
            assert!(err.contains("a glob does not say the order"), "{err}");
            assert!(err.contains(&format!("{layout} volume")), "{err}");
        }
        for p in &paths {
            assert!(
                std::fs::read(p).unwrap().iter().all(|&b| b == 0),
                "nothing written"
            );
        }
    }

    #[test]
    fn striped_format_labels_every_lun() {
        let dir = tempfile::tempdir().unwrap();
        let paths = lun_files(dir.path(), &[9 << 20, 8 << 20, 8 << 20 | 12345]);
        let cfg = config(LayoutKindConfig::Striped, paths.clone());
        let f = format_volume(&cfg, false, 1_790_000_000).unwrap();
        assert_eq!(f.volume.devices().len(), 3);
        // The smallest LUN sets the leg length: 7 MiB after the data offset.
        assert_eq!(f.volume.size_bytes(), 3 * (7 << 20));
        assert_eq!(f.device_paths, paths);
        for (i, path) in paths.iter().enumerate() {
            let bytes = std::fs::read(path).unwrap();
            let l = DeviceLabel::decode(&bytes).unwrap();
            assert_eq!(l.fs_uuid, f.fs_uuid);
            assert_eq!(l.device_index, i as u32);
            assert_eq!(l.device_count, 3);
            assert_eq!(DeviceId::Sanfs(l.device_uuid), f.volume.devices()[i].uuid);
            assert_eq!(
                l.layout,
                LabelLayout::Striped {
                    stripe_unit: 64 << 10
                }
            );
            assert_eq!(l.formatted_at, 1_790_000_000);
        }
    }

    #[test]
    fn refusals_write_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let paths = lun_files(dir.path(), &[4 << 20, 4 << 20]);
        let cfg = config(LayoutKindConfig::Linear, paths.clone());
        let first = format_volume(&cfg, false, 1).unwrap();
        let before: Vec<Vec<u8>> = paths.iter().map(|p| std::fs::read(p).unwrap()).collect();
        let err = format!("{:#}", format_volume(&cfg, false, 2).unwrap_err());
        assert!(
            err.contains(&format!("sanfs label (fs {}", first.fs_uuid)),
            "{err}"
        );
        assert!(err.contains("nothing was written"), "{err}");
        let after: Vec<Vec<u8>> = paths.iter().map(|p| std::fs::read(p).unwrap()).collect();
        assert_eq!(before, after);
        let second = format_volume(&cfg, true, 2).unwrap();
        assert_ne!(second.fs_uuid, first.fs_uuid);

        // A too-small device is refused before anything is written, even with --force.
        let small = lun_files(&dir.path().join(""), &[4 << 20]);
        let tiny = dir.path().join("tiny");
        std::fs::File::create(&tiny)
            .unwrap()
            .set_len((1 << 20) + 4096)
            .unwrap();
        let cfg = config(
            LayoutKindConfig::Linear,
            vec![small[0].clone(), tiny.clone()],
        );
        let before = std::fs::read(&small[0]).unwrap();
        let err = format!("{:#}", format_volume(&cfg, true, 3).unwrap_err());
        assert!(err.contains("tiny is too small"), "{err}");
        assert_eq!(std::fs::read(&small[0]).unwrap(), before);
    }

    #[test]
    fn the_same_file_under_two_paths_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let paths = lun_files(dir.path(), &[4 << 20]);
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&paths[0], &link).unwrap();
        let cfg = config(LayoutKindConfig::Striped, vec![paths[0].clone(), link]);
        let err = format!("{:#}", format_volume(&cfg, true, 1).unwrap_err());
        assert!(err.contains("are the same device"), "{err}");
    }

    #[test]
    fn lvm_import_refuses_devices_without_a_pv_label() {
        let dir = tempfile::tempdir().unwrap();
        let paths = lun_files(dir.path(), &[4 << 20]);
        let mut cfg = config(LayoutKindConfig::Lvm, paths);
        cfg.lvm_vg = Some("vg".into());
        cfg.lvm_lv = Some("lv".into());
        let err = format!("{:#}", format_volume(&cfg, false, 1).unwrap_err());
        assert!(err.contains("no valid LVM2 PV label"), "{err}");
    }
}
