//! The rescan task: the volume read again, and LUNs missing on this node looked for.
//!
//! Two things change under a mounted agent: the volume grows (`Admin.GrowVolume`: LUNs added,
//! or an LVM2 logical volume extended), and a LUN that was not visible at connect appears (an
//! iSCSI session that came up late, a path fixed). Every [`super::ClientConfig::rescan_interval`],
//! and at once when a grant names a LUN this agent does not know (the server uses a grown
//! volume's new space at once), one *pass* runs:
//!
//! 1. `GetVolume`: a volume that grew ([`Volume::check_grows`]: every block keeps its place)
//!    replaces this agent's; one that changed any other way is refused with a warning (this
//!    agent keeps planning with the one it has; the server sends plans it can check).
//! 2. The devices of the volume this node has no handle on are looked for among the globs
//!    (by label identity, as at connect), opened with `O_DIRECT` and given to the engine in
//!    their slot; from then on their I/O goes direct. Devices beyond the engine's slots
//!    ([`super::SPARE_DEVICE_SLOTS`] past the volume at connect) stay proxied.
//!
//! Until a pass has found a LUN, grants that touch it go through the server (the proxied
//! path), exactly as for a LUN missing at connect. Passes are bounded: one at a time, and a
//! kick within [`MIN_GAP`] of the last pass waits for the rest of it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use sanfs_blockmap::volume::{DeviceIndex, Volume};
use sanfs_proto::model::VolumeInfo;
use sanfs_proto::pb;
use sanfs_proto::pb::admin_client::AdminClient;
use sanfs_proto::status::fs_error_from_status;
use sanfs_proto::types::FsError;

use super::{Inner, malformed};
use crate::discovery::discover_among;

/// The shortest time between two passes started by kicks.
pub(crate) const MIN_GAP: Duration = Duration::from_secs(1);

pub(super) async fn run(inner: Arc<Inner>) {
    let period = inner.config.rescan_interval;
    let mut last = Instant::now();
    loop {
        if period.is_zero() {
            inner.rescan_kick.notified().await;
        } else {
            let _ = tokio::time::timeout(period, inner.rescan_kick.notified()).await;
        }
        let since = last.elapsed();
        if since < MIN_GAP {
            tokio::time::sleep(MIN_GAP - since).await;
        }
        last = Instant::now();
        if let Err(e) = pass(&inner).await {
            tracing::warn!(error = %e, "rescan: cannot read the volume");
        }
    }
}

/// One pass (see the module doc): answers the devices opened.
pub(crate) async fn pass(inner: &Arc<Inner>) -> Result<Vec<DeviceIndex>, FsError> {
    let _one = inner.rescanning.lock().await;
    refresh_volume(inner).await?;
    let volume = inner.volume();
    let slots = inner.engine.slots();
    let wanted: Vec<DeviceIndex> = (0..volume.devices().len().min(slots))
        .map(|i| DeviceIndex(u32::try_from(i).unwrap_or(u32::MAX)))
        .filter(|d| !inner.engine.has_device(*d))
        .collect();
    if volume.devices().len() > slots {
        tracing::warn!(
            devices = volume.devices().len(),
            slots,
            "the volume has more LUNs than this agent's engine has slots: the rest go proxied \
             until the agent connects again"
        );
    }
    if wanted.is_empty() {
        return Ok(Vec::new());
    }
    let (vol, discovery, look_for) = (volume.clone(), inner.config.discovery.clone(), wanted);
    let found = tokio::task::spawn_blocking(move || discover_among(&vol, &discovery, &look_for))
        .await
        .map_err(|e| FsError::Io(format!("rescan task failed: {e}")))?;
    let mut opened = Vec::new();
    for dev in found.found {
        let (d, path) = (dev.index, dev.path.clone());
        match inner.engine.replace_device(d, dev.file).await {
            Ok(()) => {
                if let Some(slot) = inner.lock_device_paths().get_mut(d.as_usize()) {
                    *slot = Some(path.clone());
                }
                tracing::warn!(device = %d, path = %path.display(), "LUN found by a rescan: its I/O goes direct from now on");
                opened.push(d);
            }
            Err(e) => {
                tracing::warn!(device = %d, path = %path.display(), error = %e, "rescan: the engine refused the LUN")
            }
        }
    }
    Ok(opened)
}

/// Reads the volume from the server and takes it if it grew.
async fn refresh_volume(inner: &Inner) -> Result<(), FsError> {
    let reply = AdminClient::new(inner.channel.clone())
        .get_volume(pb::GetVolumeRequest {})
        .await
        .map_err(|s| fs_error_from_status(&s))?
        .into_inner();
    let info = VolumeInfo::try_from(reply).map_err(|e| malformed("GetVolume reply", e))?;
    if info.fs_uuid != inner.fs_uuid {
        return Err(FsError::Io(format!(
            "the server now serves file system {}, not {}",
            info.fs_uuid, inner.fs_uuid
        )));
    }
    let current = inner.volume();
    if info.volume == *current {
        return Ok(());
    }
    match info.volume.check_grows(&current) {
        Ok(()) => {
            tracing::warn!(
                old_size_bytes = current.size_bytes(),
                size_bytes = info.volume.size_bytes(),
                devices = info.volume.devices().len(),
                "the volume grew"
            );
            let grown: Arc<Volume> = Arc::new(info.volume);
            *inner.volume.write().unwrap_or_else(|e| e.into_inner()) = grown;
            Ok(())
        }
        Err(e) => {
            tracing::warn!(error = %e, "the server's volume changed in a way this agent cannot follow: kept the old one");
            Ok(())
        }
    }
}
