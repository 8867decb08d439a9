//! Growing the volume while it is mounted (`Admin.GrowVolume`, `sanfs-admin grow`).
//!
//! Two ways, both ending in one durable transaction ([`Store::grow`]) that appends to the
//! volume's address space, so that every block already allocated keeps its place:
//!
//! - **LUNs added** (linear and striped volumes): the new LUNs are checked as `format` checks
//!   them (nothing of value on them unless forced, big enough, the block size a multiple of
//!   their logical block size, never a LUN of this file system), labelled with this file
//!   system's UUID and the next device indexes, and laid out as one new segment at the end:
//!   linear over one LUN, or striped over all of them.
//! - **An extended LVM2 logical volume** (`lvextend`): the VG metadata is read again from the
//!   PVs (the server's data LUNs and any paths given), the LV's layout rebuilt, and accepted
//!   if the old layout is a prefix of it ([`Volume::check_grows`]).
//!
//! Labels are written before the store commits: a growth that fails after that leaves
//! labelled LUNs outside the volume, which a retry with `force` takes. The new volume is in
//! the store, the allocator and statfs at once; the proxied path opens the new LUNs among
//! the given paths; agents learn of it from `GetVolume` (see `docs/protocol.md`).

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, bail};
use sanfs_blockmap::label::{self, DeviceLabel, LabelLayout, Signature};
use sanfs_blockmap::volume::{DeviceId, Volume, VolumeDevice};
use sanfs_proto::model::{GrowLayout, GrowVolumeRequest};
use sanfs_proto::types::FsError;
use uuid::Uuid;

use crate::datadev::DataDevices;
use crate::device::Lun;
use crate::format::{read_lvm_pv, vg_metadata};
use crate::store::Store;

/// One growth at a time (each plans from the volume as it is).
static GROWING: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// What a growth did.
#[derive(Debug, Clone)]
pub struct Grown {
    pub old_size_bytes: u64,
    pub volume: Arc<Volume>,
    pub added_blocks: u64,
}

/// Grows the volume of `store` as `req` says; `devices` are the server's data LUNs (the
/// proxied path), which take up the new ones. `now_unix_secs` goes into new labels.
pub async fn grow(
    store: &Store,
    devices: &Arc<DataDevices>,
    req: GrowVolumeRequest,
    now_unix_secs: i64,
) -> Result<Grown, FsError> {
    let _one = GROWING.lock().await;
    let old = store.volume();
    let fs_uuid = store.superblock().fs_uuid;
    let lvm = store.superblock().lvm.clone();
    let given: Vec<PathBuf> = req.device_paths.iter().map(PathBuf::from).collect();
    let mut paths = given.clone();
    let planned = {
        let old = old.clone();
        let paths = paths.clone();
        let known: Vec<PathBuf> = (0..old.devices().len())
            .filter_map(|i| {
                devices.path_of(sanfs_blockmap::volume::DeviceIndex(
                    u32::try_from(i).unwrap_or(u32::MAX),
                ))
            })
            .collect();
        let layout = req.layout;
        let force = req.force;
        tokio::task::spawn_blocking(move || match (layout, lvm) {
            (GrowLayout::Lvm, Some((vg, lv))) => {
                let mut all = known;
                all.extend(paths);
                plan_lvm(&old, &vg, &lv, &all).map(|v| (v, all))
            }
            (GrowLayout::Lvm, None) => {
                bail!("this volume was not imported from LVM2: add LUNs (linear or striped)")
            }
            (_, Some((vg, lv))) => bail!(
                "this volume is the LVM2 logical volume {vg}/{lv}: extend it with lvextend, \
                 then grow with layout lvm"
            ),
            (GrowLayout::Linear, None) => {
                label_new_luns(&old, fs_uuid, &paths, None, force, now_unix_secs)
                    .map(|v| (v, paths))
            }
            (GrowLayout::Striped { stripe_unit }, None) => label_new_luns(
                &old,
                fs_uuid,
                &paths,
                Some(stripe_unit),
                force,
                now_unix_secs,
            )
            .map(|v| (v, paths)),
        })
        .await
        .map_err(|e| FsError::Io(format!("the growth task failed: {e}")))?
    };
    let (grown, all_paths) = planned.map_err(|e| FsError::Invalid(format!("{e:#}")))?;
    paths = all_paths;
    let old_size_bytes = old.size_bytes();
    // The paths given join the store's grown-devices record: a restarted server opens them.
    let added_blocks = store.grow(old, grown, &given).await?;
    let volume = store.volume();
    {
        // Opening is blocking work; a LUN the server cannot open is warned about, not fatal
        // (its proxied I/O fails with EIO, as for a LUN missing at start).
        let (volume, devices) = (volume.clone(), devices.clone());
        tokio::task::spawn_blocking(move || devices.add(&volume, &paths))
            .await
            .map_err(|e| FsError::Io(format!("the LUN-opening task failed: {e}")))?;
    }
    tracing::info!(
        old_size_bytes,
        size_bytes = volume.size_bytes(),
        devices = volume.devices().len(),
        added_blocks,
        "volume grown"
    );
    Ok(Grown {
        old_size_bytes,
        volume,
        added_blocks,
    })
}

/// Checks and labels the LUNs at `paths` as devices `old.devices().len()..` of file system
/// `fs_uuid`, and returns the volume grown by them (linear over one LUN, or striped in units
/// of `stripe_unit`). Nothing is written unless every check passes.
fn label_new_luns(
    old: &Volume,
    fs_uuid: Uuid,
    paths: &[PathBuf],
    stripe_unit: Option<u64>,
    force: bool,
    now_unix_secs: i64,
) -> anyhow::Result<Volume> {
    let block_size = old.block_size();
    // Labelled volumes start every leg at the same data offset (`format`'s).
    let data_offset = old
        .segments()
        .first()
        .and_then(|s| s.legs.first())
        .map(|l| l.phys_start)
        .context("the volume has no segments")?;
    let mut luns: Vec<Lun> = Vec::with_capacity(paths.len());
    let mut found = Vec::new();
    for path in paths {
        let lun = Lun::open(path, true)?;
        if let Some(other) = luns.iter().find(|l| l.identity() == lun.identity()) {
            bail!(
                "{} and {} are the same device",
                other.path().display(),
                path.display()
            );
        }
        let head = lun.read_prefix(label::PROBE_SIZE)?;
        if let Ok(l) = DeviceLabel::decode(&head)
            && l.fs_uuid == fs_uuid
        {
            bail!(
                "{} is already LUN d{} of this file system; nothing was written",
                path.display(),
                l.device_index
            );
        }
        let signatures = label::probe(&head);
        if !signatures.is_empty() {
            let what: Vec<String> = signatures.iter().map(Signature::to_string).collect();
            found.push(format!("{} holds {}", path.display(), what.join(", ")));
        }
        let lbs = lun.logical_block_size();
        if !u64::from(block_size).is_multiple_of(u64::from(lbs)) {
            bail!(
                "{}: block size {block_size} is not a multiple of the device's logical block \
                 size {lbs}",
                path.display()
            );
        }
        luns.push(lun);
    }
    if !found.is_empty() {
        if !force {
            bail!(
                "refusing to grow: {}; nothing was written (force overwrites)",
                found.join("; ")
            );
        }
        for f in &found {
            tracing::warn!("grow --force: overwriting: {f}");
        }
    }
    let device_uuids: Vec<Uuid> = luns.iter().map(|_| Uuid::new_v4()).collect();
    let new_devices: Vec<VolumeDevice> = luns
        .iter()
        .zip(&device_uuids)
        .map(|(lun, &uuid)| VolumeDevice {
            uuid: DeviceId::Sanfs(uuid),
            size_bytes: lun.size_bytes(),
        })
        .collect();
    let grown = old
        .with_segment_appended(new_devices, data_offset, stripe_unit)
        .context("the grown volume")?;
    grown.check_grows(old)?;
    let first = u32::try_from(old.devices().len()).context("too many devices")?;
    let device_count = u32::try_from(grown.devices().len()).context("too many devices")?;
    let layout = match stripe_unit {
        Some(stripe_unit) => LabelLayout::Striped { stripe_unit },
        None => LabelLayout::Linear,
    };
    let labels: Vec<DeviceLabel> = luns
        .iter()
        .zip(device_uuids)
        .zip(first..)
        .map(|((lun, device_uuid), device_index)| DeviceLabel {
            fs_uuid,
            device_uuid,
            device_index,
            device_count,
            device_size: lun.size_bytes(),
            data_offset,
            block_size,
            layout,
            formatted_at: now_unix_secs,
        })
        .collect();
    for (lun, label) in luns.iter().zip(&labels) {
        lun.write_at(0, &label.encode())?;
    }
    for (lun, label) in luns.iter().zip(&labels) {
        lun.sync()?;
        let back = lun.read_at(0, label::LABEL_SIZE)?;
        if DeviceLabel::decode(&back).ok().as_ref() != Some(label) {
            bail!(
                "{}: the label read back differs from the one written",
                lun.path().display()
            );
        }
        tracing::info!(device = %lun.path().display(), device_uuid = %label.device_uuid,
            index = label.device_index, "labelled for the growth");
    }
    Ok(grown)
}

/// Reads the VG metadata again from `paths` and rebuilds LV `vg/lv`; it must grow `old`.
fn plan_lvm(old: &Volume, vg: &str, lv: &str, paths: &[PathBuf]) -> anyhow::Result<Volume> {
    let mut pvs = Vec::with_capacity(paths.len());
    let mut luns = Vec::with_capacity(paths.len());
    for path in paths {
        let lun = Lun::open(path, false)?;
        if luns.iter().any(|l: &Lun| l.identity() == lun.identity()) {
            continue;
        }
        pvs.push((path.clone(), read_lvm_pv(&lun)?));
        luns.push(lun);
    }
    let meta = vg_metadata(&pvs, vg)?;
    let grown = meta
        .lv_volume(lv, old.block_size())
        .with_context(|| format!("logical volume {vg}/{lv}"))?;
    for dev in grown.devices() {
        let DeviceId::LvmPv(id) = dev.uuid else {
            bail!("volume device {} is not an LVM2 PV", dev.uuid);
        };
        let Some(i) = pvs.iter().position(|(_, pv)| pv.label.pv_id == id) else {
            bail!(
                "logical volume {vg}/{lv} now uses PV {id}, which is not among the server's \
                 data LUNs nor the paths given"
            );
        };
        if luns[i].size_bytes() < dev.size_bytes {
            bail!(
                "{} (PV {id}) is {} bytes, smaller than the {} bytes the VG metadata records",
                pvs[i].0.display(),
                luns[i].size_bytes(),
                dev.size_bytes
            );
        }
    }
    grown.check_grows(old).with_context(|| {
        format!(
            "logical volume {vg}/{lv} (VG seqno {}) does not extend the imported layout",
            meta.seqno
        )
    })?;
    Ok(grown)
}
