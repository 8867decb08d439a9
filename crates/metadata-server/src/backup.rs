//! `sanfs-mds restore`: a backup (written online by `Admin.BackupStore`, see
//! `store::backup`) checked and installed into the configured metadata store, with the server
//! stopped.
//!
//! The backup is read into memory once and everything works on that copy: fsck (which also
//! verifies every page checksum) must call it clean; it must carry a backup record of the same
//! file system as its superblock; the labels on the configured LUNs must name that file
//! system (an LVM2 volume has none: there the existing store is the only witness); an existing
//! store is replaced only with `force`, and never one of another file system or one a running
//! server holds. The store is then written from the backup's tables (a file store beside the
//! old one and renamed over it; a store on a metadata LUN in place). The start count stays the
//! backup's, so the restored server's epoch is lower than the one agents saw if the server
//! started again since the backup (running agents refuse it: docs/operations.md), except
//! where that would reuse the old store's own epoch (it goes one past it then). fsck of the
//! installed store closes the restore.

use std::path::{Path, PathBuf};

use redb::ReadableDatabase;
use sanfs_blockmap::label::{DeviceLabel, LABEL_SIZE};
use sanfs_blockmap::volume::DeviceId;
use uuid::Uuid;

use crate::fsck::{self, Report};
use crate::store::backend::{FaultPlan, SimDisk};
use crate::store::backup::{
    backup_record, boot_epoch_of, install, restores_of, superblock, volume_of,
};
use crate::store::records::BackupRecord;
use crate::store::{Backend, StoreError, Verify, guard_damage, open_db, open_db_read_only};

/// Why a restore did not happen (nothing was changed) or failed.
#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    /// A running server holds the store.
    #[error("{0}")]
    InUse(StoreError),
    /// The backup, the LUNs or the existing store say no: nothing was written.
    #[error("{0}; nothing was written")]
    Refused(String),
    /// Writing the store failed part way: the store must be restored again.
    #[error("installing the backup failed: {0}; run the restore again")]
    Install(String),
}

/// What a restore did.
#[derive(Debug, Clone)]
pub struct Restored {
    pub record: BackupRecord,
    /// The backup's fsck report (clean).
    pub backup_report: Report,
    /// The installed store's fsck report (clean).
    pub report: Report,
    /// The start count written (the server's next start is one more).
    pub boot_epoch: u64,
    /// The store's restore count now (`ServerInfo.restores`).
    pub restores: u64,
    /// Whether a store was replaced (and if so, whether it could be read).
    pub replaced: Option<bool>,
    /// LUNs whose label names the backup's file system.
    pub labels_matched: usize,
    /// LUNs labelled for the file system that the backup's volume does not hold (added by a
    /// growth after the backup): their data is not reachable from the restored store.
    pub not_in_volume: Vec<PathBuf>,
}

/// What fsck found in a backup file, with its record.
pub fn check_backup(path: &Path) -> Result<(Report, Option<BackupRecord>), StoreError> {
    let backend = Backend::File(path.to_owned());
    let report = fsck::check(&backend)?;
    let record = guard_damage("read the backup record", || {
        let db = open_db_read_only(&backend)?;
        let r = db.begin_read()?;
        backup_record(&r)
    })?;
    Ok((report, record))
}

fn refused(what: impl std::fmt::Display) -> RestoreError {
    RestoreError::Refused(what.to_string())
}

/// The labels on `devices` that name a file system: (device, fs UUID, device UUID).
fn labels(devices: &[PathBuf]) -> Result<Vec<(PathBuf, Uuid, Uuid)>, RestoreError> {
    let mut found = Vec::new();
    for path in devices {
        let lun = crate::device::Lun::open(path, false)
            .map_err(|e| refused(format!("cannot read the LUN {}: {e:#}", path.display())))?;
        let bytes = lun
            .read_prefix(LABEL_SIZE)
            .map_err(|e| refused(format!("cannot read the LUN {}: {e:#}", path.display())))?;
        if let Ok(label) = DeviceLabel::decode(&bytes) {
            found.push((path.clone(), label.fs_uuid, label.device_uuid));
        }
    }
    Ok(found)
}

/// Checks the backup at `path` and installs it into `target`; `devices` are the volume's
/// LUNs from the configuration. See the module's doc.
pub fn restore(
    path: &Path,
    target: &Backend,
    devices: &[PathBuf],
    force: bool,
) -> Result<Restored, RestoreError> {
    let image = std::fs::read(path)
        .map_err(|e| refused(format!("cannot read the backup {}: {e}", path.display())))?;
    let copy = SimDisk::from_image(image, FaultPlan::default());
    let backup = Backend::Sim(copy);
    let backup_report = fsck::check(&backup)
        .map_err(|e| refused(format!("the backup {} cannot be used: {e}", path.display())))?;
    if !backup_report.is_clean() {
        return Err(refused(format!(
            "the backup {} is not clean ({} problems, the first: {})",
            path.display(),
            backup_report.problems.len(),
            backup_report.problems.first().map_or("", String::as_str)
        )));
    }
    let db = guard_damage("open the backup", || {
        open_db(&backup, false, false, Verify::Pages)
    })
    .map_err(|e| refused(format!("the backup {} cannot be used: {e}", path.display())))?;
    let read = || -> Result<_, StoreError> {
        let r = db.begin_read()?;
        let record = backup_record(&r)?;
        let sb = superblock(&r)?;
        let epoch = boot_epoch_of(&r)?;
        let restores = restores_of(&r)?;
        let volume = volume_of(&r)?;
        Ok((r, record, sb, (epoch, restores), volume))
    };
    let (r, record, sb, (backup_epoch, backup_restores), volume) =
        guard_damage("read the backup", read).map_err(|e| refused(e.to_string()))?;
    let Some(record) = record else {
        return Err(refused(format!(
            "{} is a metadata store, not a backup (it has no backup record): make backups \
             with `sanfs-admin backup`",
            path.display()
        )));
    };
    if record.fs_uuid != sb.fs_uuid {
        return Err(refused(format!(
            "the backup's record names file system {} but its store is of {}",
            record.fs_uuid, sb.fs_uuid
        )));
    }

    // The LUNs: their labels must name the backup's file system.
    let found = labels(devices)?;
    if let Some((dev, other, _)) = found.iter().find(|(_, fs, _)| *fs != sb.fs_uuid) {
        return Err(refused(format!(
            "the backup is of file system {}, but {} is labelled for file system {other}: \
             a backup of another file system",
            sb.fs_uuid,
            dev.display()
        )));
    }
    if found.is_empty() && sb.lvm.is_none() {
        return Err(refused(format!(
            "no LUN of volume.devices carries a sanfs label: cannot tell that they hold file \
             system {}",
            sb.fs_uuid
        )));
    }

    let not_in_volume: Vec<PathBuf> = found
        .iter()
        .filter(|(_, _, dev)| {
            !volume
                .devices()
                .iter()
                .any(|d| d.uuid == DeviceId::Sanfs(*dev))
        })
        .map(|(p, _, _)| p.clone())
        .collect();

    // The store there now.
    let exists = match target {
        Backend::File(p) => std::fs::metadata(p).map(|m| m.len() > 0).unwrap_or(false),
        Backend::Device(p) | Backend::FencedDevice(p, _) => {
            crate::store::device::is_metadata_device(p).map_err(|e| {
                refused(format!(
                    "cannot read the metadata device {}: {e}",
                    p.display()
                ))
            })?
        }
        Backend::Sim(_) => true,
    };
    let mut old_epoch = 0;
    let mut old_restores = 0;
    let replaced = if exists {
        let old = guard_damage("read the existing store", || {
            let db = open_db_read_only(target)?;
            let r = db.begin_read()?;
            Ok((superblock(&r)?, boot_epoch_of(&r)?, restores_of(&r)?))
        });
        let readable = match old {
            Err(e @ StoreError::InUse) => return Err(RestoreError::InUse(e)),
            Ok((old_sb, epoch, restores)) => {
                if old_sb.fs_uuid != sb.fs_uuid {
                    return Err(refused(format!(
                        "the metadata store there is of file system {}, the backup of {}: a \
                         backup of another file system",
                        old_sb.fs_uuid, sb.fs_uuid
                    )));
                }
                old_epoch = epoch;
                old_restores = restores;
                true
            }
            Err(e) => {
                tracing::warn!(error = %e, "the existing metadata store cannot be read");
                false
            }
        };
        if !force {
            return Err(refused(
                "a metadata store exists there (use --force to replace it with the backup)",
            ));
        }
        Some(readable)
    } else {
        None
    };

    // The restored server starts at the backup's epoch + 1: lower than the epoch agents saw
    // if the old server started since the backup, so that agents still running refuse it
    // (docs/operations.md). If that start would reuse the old store's own epoch (one
    // restart since the backup), it goes one past it instead: a start never takes the epoch
    // of the run whose sessions and grants agents may still hold.
    let backup_epoch = backup_epoch.max(record.boot_epoch);
    let boot_epoch = if old_epoch != 0 && backup_epoch + 1 == old_epoch {
        old_epoch
    } else {
        backup_epoch
    };
    // Every restore counts: agents compare the count the server reports (ServerInfo.restores)
    // with the one they mounted under, and refuse a server whose namespace was put back under
    // them (their handles and caches are of the namespace before), whatever the epochs.
    let restores = old_restores.max(backup_restores) + 1;
    install(&r, target, boot_epoch, restores).map_err(|e| RestoreError::Install(e.to_string()))?;
    drop(r);
    drop(db);
    let report = fsck::check(target)
        .map_err(|e| RestoreError::Install(format!("fsck of the restored store: {e}")))?;
    if !report.is_clean() {
        return Err(RestoreError::Install(format!(
            "fsck of the restored store found {} problems",
            report.problems.len()
        )));
    }
    Ok(Restored {
        record,
        backup_report,
        report,
        boot_epoch,
        restores,
        replaced,
        labels_matched: found.len(),
        not_in_volume,
    })
}
