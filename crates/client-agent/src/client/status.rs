//! What an agent reports about itself (`sanfs-agent status`, its metrics) and about a file's
//! layout (`sanfs-agent bmap`).
//!
//! [`Client::status`] gathers the session and lease, every LUN of the volume with this
//! node's path to it and its state (found, missing on this node, or poisoned by a failed
//! write), the bytes moved on the direct and the proxied path, and the grant and recall
//! counts. [`Client::bmap`] asks the server for a file's extents (`GetExtents`) and names each
//! device piece by the LUN's identity and this node's path to it. Both are plain serde
//! values: the control socket carries them as JSON.

use std::time::Instant;

use sanfs_blockmap::volume::DeviceIndex;
use sanfs_proto::model::{ExtentState, GetExtentsRequest};
use sanfs_proto::types::{ByteRange, Credentials, FsError, InodeId, MAX_FILE_SIZE};
use serde::{Deserialize, Serialize};

use super::{Client, malformed, rescan};
use crate::engine::EngineStats;

/// A LUN as this node sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceHealth {
    /// Found and usable: direct I/O goes to it.
    Ok,
    /// Not found on this node: its I/O goes through the server.
    Missing,
    /// A write on it failed: its I/O goes through the server until a probe brings it back.
    Poisoned,
}

/// One LUN of the volume in [`AgentStatus`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceStatus {
    pub index: u32,
    /// The identity in its label (a UUID, or `lvm:` and the PV UUID).
    pub uuid: String,
    /// This node's path to it; `None` when missing here.
    pub path: Option<String>,
    pub state: DeviceHealth,
    pub read_ops: u64,
    pub write_ops: u64,
    pub read_bytes: u64,
    pub write_bytes: u64,
    pub errors: u64,
}

/// Bytes moved, by path and operation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ByteCounts {
    pub direct_read: u64,
    pub direct_write: u64,
    pub proxied_read: u64,
    pub proxied_write: u64,
}

/// Grants asked for, reads served from cached grants, recalls answered.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GrantCounts {
    pub read: u64,
    pub write: u64,
    pub cached_reads: u64,
    /// Writes done inside a cached write layout (no MapWrite).
    #[serde(default)]
    pub layout_writes: u64,
    /// Write layouts asked for ahead of a sequential writer.
    #[serde(default)]
    pub layouts_ahead: u64,
    pub cached_now: u64,
    pub recalls: u64,
}

/// Attributes and names answered from the lease cache (`hit`, no RPC) or asked of the server
/// (`miss`), lease recalls answered, and what is cached now.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseCounts {
    pub attr_hits: u64,
    pub attr_misses: u64,
    pub entry_hits: u64,
    pub entry_misses: u64,
    /// Extended attribute reads answered under attribute leases, and asked of the server.
    #[serde(default)]
    pub xattr_hits: u64,
    #[serde(default)]
    pub xattr_misses: u64,
    /// Permission checks (directory opens) answered under attribute leases, and asked of
    /// the server.
    #[serde(default)]
    pub access_hits: u64,
    #[serde(default)]
    pub access_misses: u64,
    /// Opens of small files that came with the file's bytes, and reads those answered.
    #[serde(default)]
    pub small_file_opens: u64,
    #[serde(default)]
    pub small_file_reads: u64,
    /// Small files kept with the bytes this agent wrote to them whole.
    #[serde(default)]
    pub small_files_written: u64,
    pub recalls: u64,
    /// Directory listings answered from a listing kept under the entry lease, and not.
    #[serde(default)]
    pub listing_hits: u64,
    #[serde(default)]
    pub listing_misses: u64,
    /// Leases renewed by heartbeats, and those asked for that the server no longer held.
    #[serde(default)]
    pub renewed: u64,
    #[serde(default)]
    pub renew_lost: u64,
    pub attrs_now: u64,
    pub names_now: u64,
    /// The kernel keeps names under their leases (it can forget them without a lock); then
    /// most lookups never reach the agent.
    #[serde(default)]
    pub kernel_names: bool,
}

/// Everything `sanfs-agent status` shows about one agent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentStatus {
    /// `host:port` of the metadata server.
    pub server: String,
    pub client_name: String,
    pub fs_uuid: String,
    pub session: u64,
    pub epoch: u64,
    /// The highest server epoch seen since the agent started.
    #[serde(default)]
    pub highest_epoch: u64,
    /// Set while the server is refused: its epoch went backwards (a restored store), its store
    /// was restored under this mount, or it serves another file system.
    #[serde(default)]
    pub epoch_refused: Option<String>,
    /// Whether the lease is valid now, and for how much longer without another heartbeat
    /// acknowledgement.
    pub lease_valid: bool,
    pub lease_remaining_ms: u64,
    pub lease_ttl_ms: u64,
    /// Sessions opened (1 after connect), and times the session was lost (fenced).
    pub sessions_opened: u64,
    pub fences: u64,
    /// Opens for reading answered by the agent, and those made at the server later.
    #[serde(default)]
    pub opens_here: u64,
    #[serde(default)]
    pub opens_made_later: u64,
    /// `uring` or `sync`.
    pub engine: String,
    pub devices: Vec<DeviceStatus>,
    pub bytes: ByteCounts,
    pub grants: GrantCounts,
    pub device_recoveries: u64,
    /// The write-back cache of small buffered writes.
    #[serde(default)]
    pub write_back: super::WriteBackStats,
    /// Where the data path spent its time and CPU so far, stage by stage
    /// ([`crate::stages`]).
    #[serde(default)]
    pub stages: Vec<crate::stages::StageStat>,
    /// Attributes and names cached under leases.
    #[serde(default)]
    pub leases: LeaseCounts,
    /// Creates answered here before the server answered them.
    #[serde(default)]
    pub creates: CreateCounts,
}

/// Creates this agent answered itself (docs/protocol.md "Creates answered by the agent"):
/// all of them, those the server then refused (lost), and those it has not answered yet;
/// the same of unlinks and renames.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CreateCounts {
    pub here: u64,
    pub lost: u64,
    pub unanswered_now: u64,
    #[serde(default)]
    pub unlinks_here: u64,
    #[serde(default)]
    pub unlinks_lost: u64,
    #[serde(default)]
    pub renames_here: u64,
    #[serde(default)]
    pub renames_lost: u64,
    /// Changes of a directory's mode, owners or times.
    #[serde(default)]
    pub attrs_here: u64,
    #[serde(default)]
    pub attrs_lost: u64,
    /// Unlinks, renames and attribute changes.
    #[serde(default)]
    pub changes_unanswered_now: u64,
}

impl AgentStatus {
    /// The LUNs this node does not have.
    pub fn missing(&self) -> impl Iterator<Item = &DeviceStatus> {
        self.devices
            .iter()
            .filter(|d| d.state == DeviceHealth::Missing)
    }
}

/// One device piece of a file's layout, in bytes (the `--json` form of `sanfs-agent bmap`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BmapEntry {
    /// File bytes `[file_off, file_off + len)` ...
    pub file_off: u64,
    pub len: u64,
    /// ... live on this LUN ...
    pub device_uuid: String,
    /// ... which this node reaches by this path (`None`: missing on this node) ...
    pub device_path: Option<String>,
    /// ... at these device bytes.
    pub phys_off: u64,
    /// `written`, or `unwritten` (allocated, reads as zeros).
    pub state: String,
}

/// A file's layout.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BmapReply {
    pub file_size: u64,
    pub block_size: u32,
    /// In file order; holes are the gaps.
    pub entries: Vec<BmapEntry>,
}

fn state_name(s: ExtentState) -> &'static str {
    match s {
        ExtentState::Written => "written",
        ExtentState::Unwritten => "unwritten",
    }
}

impl Client {
    /// What the I/O engine did so far (per device ops and bytes, requests in flight).
    pub fn engine_stats(&self) -> EngineStats {
        self.inner.engine.stats()
    }

    /// Starts measuring the engine's most requests in flight at once afresh.
    pub fn reset_max_in_flight(&self) {
        self.inner.engine.reset_max_in_flight();
    }

    /// Each LUN's state on this node.
    pub fn device_health(&self, d: DeviceIndex) -> DeviceHealth {
        if !self.inner.engine.has_device(d) {
            DeviceHealth::Missing
        } else if self.inner.engine.is_poisoned(d) {
            DeviceHealth::Poisoned
        } else {
            DeviceHealth::Ok
        }
    }

    /// The agent's state: session, lease, LUNs, bytes, grants.
    pub fn status(&self) -> AgentStatus {
        let (view, ttl, remaining, valid, highest_epoch, epoch_refused) = {
            let s = self.inner.lock_state();
            let remaining = s.deadline.saturating_duration_since(Instant::now());
            (
                s.view.clone(),
                s.lease_ttl_ms,
                remaining,
                s.live && !remaining.is_zero(),
                s.highest_epoch,
                s.epoch_refused.clone(),
            )
        };
        let stats = self.stats();
        let engine = self.engine_stats();
        let paths = self.inner.lock_device_paths().clone();
        let volume = self.inner.volume();
        let devices = volume
            .devices()
            .iter()
            .enumerate()
            .map(|(i, dev)| {
                let index = DeviceIndex(i as u32);
                let io = engine.devices.get(i).copied().unwrap_or_default();
                DeviceStatus {
                    index: index.0,
                    uuid: dev.uuid.to_string(),
                    path: paths
                        .get(i)
                        .cloned()
                        .flatten()
                        .map(|p| p.to_string_lossy().into_owned()),
                    state: self.device_health(index),
                    read_ops: io.read_ops,
                    write_ops: io.write_ops,
                    read_bytes: io.read_bytes,
                    write_bytes: io.write_bytes,
                    errors: io.errors,
                }
            })
            .collect();
        AgentStatus {
            server: self.inner.config.server.clone(),
            client_name: self.inner.config.client_name.clone(),
            fs_uuid: self.inner.fs_uuid.to_string(),
            session: view.session.0,
            epoch: view.epoch.0,
            highest_epoch,
            epoch_refused,
            lease_valid: valid,
            lease_remaining_ms: if valid {
                u64::try_from(remaining.as_millis()).unwrap_or(u64::MAX)
            } else {
                0
            },
            lease_ttl_ms: ttl,
            sessions_opened: stats.sessions,
            fences: stats.fences,
            opens_here: stats.opens_here,
            opens_made_later: stats.opens_made_later,
            engine: self.inner.engine.name().to_owned(),
            devices,
            bytes: ByteCounts {
                direct_read: stats.direct_read_bytes,
                direct_write: stats.direct_write_bytes,
                proxied_read: stats.proxied_read_bytes,
                proxied_write: stats.proxied_write_bytes,
            },
            grants: GrantCounts {
                read: stats.map_reads,
                write: stats.map_writes,
                cached_reads: stats.cached_reads,
                layout_writes: stats.layout_writes,
                layouts_ahead: stats.layouts_ahead,
                cached_now: self.inner.cache.cached_ids().len() as u64,
                recalls: stats.recalls,
            },
            device_recoveries: stats.device_recoveries,
            write_back: self.write_back_stats(),
            stages: crate::stages::snapshot(),
            leases: self.lease_counts(),
            creates: self.inner.creates.counts(),
        }
    }

    /// A file's layout, one entry per device piece (pieces of one extent that follow each
    /// other on one LUN are merged), with this node's path to each LUN.
    pub async fn bmap(&self, cred: &Credentials, ino: InodeId) -> Result<BmapReply, FsError> {
        let req = GetExtentsRequest {
            cred: cred.clone(),
            inode: ino,
            range: ByteRange::new(0, MAX_FILE_SIZE)?,
        };
        let reply = self.inner.get_extents(req).await?;
        let mut volume = self.inner.volume();
        let known = volume.devices().len();
        if reply
            .extents
            .iter()
            .flat_map(|e| &e.pieces)
            .any(|p| p.device.as_usize() >= known)
        {
            // The file uses LUNs this agent does not know yet: the volume grew.
            rescan::pass(&self.inner).await?;
            volume = self.inner.volume();
        }
        let devices = volume.devices();
        let paths = self.inner.lock_device_paths().clone();
        let mut entries: Vec<BmapEntry> = Vec::new();
        for extent in &reply.extents {
            let mut file_off = extent.file_range.offset();
            let state = state_name(extent.state);
            for piece in &extent.pieces {
                let i = piece.device.as_usize();
                let device_uuid = devices
                    .get(i)
                    .map(|d| d.uuid.to_string())
                    .ok_or_else(|| malformed("GetExtents reply", "no such device"))?;
                let device_path = paths
                    .get(i)
                    .cloned()
                    .flatten()
                    .map(|p| p.to_string_lossy().into_owned());
                let merged = entries.last_mut().is_some_and(|last| {
                    let follows = last.device_uuid == device_uuid
                        && last.state == state
                        && last.file_off + last.len == file_off
                        && last.phys_off + last.len == piece.phys_off;
                    if follows {
                        last.len += piece.len;
                    }
                    follows
                });
                if !merged {
                    entries.push(BmapEntry {
                        file_off,
                        len: piece.len,
                        device_uuid,
                        device_path,
                        phys_off: piece.phys_off,
                        state: state.to_owned(),
                    });
                }
                file_off += piece.len;
            }
        }
        Ok(BmapReply {
            file_size: reply.file_size,
            block_size: reply.block_size,
            entries,
        })
    }
}
