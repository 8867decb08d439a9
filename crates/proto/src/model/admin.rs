//! The Admin service: the volume layout agents plan their I/O with (converted to and from
//! [`sanfs_blockmap::volume::Volume`], validated by `Volume::from_segments`), the server's
//! status, and directory quotas.

use sanfs_blockmap::volume::{DeviceIndex, LayoutKind, Segment, StripeLeg, Volume, VolumeDevice};
use uuid::Uuid;

use super::common::{cred, uuid};
use super::{
    At, MAX_SEGMENT_LEGS, MAX_VOLUME_DEVICES, MAX_VOLUME_SEGMENTS, epoch, inode, invalid, list,
    required, required_msg, session_id, text, to_pb,
};
use crate::pb;
use crate::types::{Credentials, InodeId, ProtocolError, SessionEpoch, SessionId, Timestamp};

impl TryFrom<pb::VolumeDevice> for VolumeDevice {
    type Error = ProtocolError;

    fn try_from(p: pb::VolumeDevice) -> Result<Self, ProtocolError> {
        Ok(VolumeDevice {
            uuid: required_msg(p.id, "id")?,
            size_bytes: p.size_bytes,
        })
    }
}

impl From<VolumeDevice> for pb::VolumeDevice {
    fn from(d: VolumeDevice) -> Self {
        pb::VolumeDevice {
            id: Some(d.uuid.into()),
            size_bytes: d.size_bytes,
        }
    }
}

impl TryFrom<pb::Segment> for Segment {
    type Error = ProtocolError;

    fn try_from(p: pb::Segment) -> Result<Self, ProtocolError> {
        if p.legs.is_empty() || p.legs.len() > MAX_SEGMENT_LEGS {
            return Err(invalid(
                "legs",
                format!("{} legs (1 to {MAX_SEGMENT_LEGS})", p.legs.len()),
            ));
        }
        // Volume::from_segments multiplies the stripe unit by the width and adds the length
        // to the start: refuse values where that overflows before handing them over.
        if p.stripe_unit.checked_mul(p.legs.len() as u64).is_none() {
            return Err(invalid("stripe_unit", "stripe_unit x width overflows"));
        }
        if p.vol_start.checked_add(p.len).is_none() {
            return Err(invalid("len", "vol_start + len overflows"));
        }
        Ok(Segment {
            vol_start: p.vol_start,
            len: p.len,
            stripe_unit: p.stripe_unit,
            legs: p
                .legs
                .into_iter()
                .map(|l| StripeLeg {
                    device: DeviceIndex(l.device),
                    phys_start: l.phys_start,
                })
                .collect(),
        })
    }
}

impl From<Segment> for pb::Segment {
    fn from(s: Segment) -> Self {
        pb::Segment {
            vol_start: s.vol_start,
            len: s.len,
            stripe_unit: s.stripe_unit,
            legs: s
                .legs
                .into_iter()
                .map(|l| pb::StripeLeg {
                    device: l.device.0,
                    phys_start: l.phys_start,
                })
                .collect(),
        }
    }
}

impl TryFrom<pb::Volume> for Volume {
    type Error = ProtocolError;

    fn try_from(p: pb::Volume) -> Result<Self, ProtocolError> {
        if p.devices.len() > MAX_VOLUME_DEVICES {
            return Err(invalid(
                "devices",
                format!("{} devices (at most {MAX_VOLUME_DEVICES})", p.devices.len()),
            ));
        }
        if p.segments.len() > MAX_VOLUME_SEGMENTS {
            return Err(invalid(
                "segments",
                format!(
                    "{} segments (at most {MAX_VOLUME_SEGMENTS})",
                    p.segments.len()
                ),
            ));
        }
        let kind = match required(p.layout, "layout")? {
            pb::volume::Layout::Linear(_) => LayoutKind::Linear,
            pb::volume::Layout::Striped(s) => LayoutKind::Striped {
                stripe_unit: s.stripe_unit,
                width: s.width,
            },
            pb::volume::Layout::Lvm(l) => LayoutKind::Lvm {
                vg_name: text(l.vg_name, "vg_name", true).at("lvm")?,
                lv_name: text(l.lv_name, "lv_name", true).at("lvm")?,
            },
        };
        let devices = list(p.devices, "devices")?;
        let segments = list(p.segments, "segments")?;
        Volume::from_segments(p.block_size, devices, segments, kind)
            .map_err(|e| invalid("volume", e.to_string()))
    }
}

impl From<&Volume> for pb::Volume {
    fn from(v: &Volume) -> Self {
        let layout = match v.kind() {
            LayoutKind::Linear => pb::volume::Layout::Linear(pb::LinearLayout {}),
            LayoutKind::Striped { stripe_unit, width } => {
                pb::volume::Layout::Striped(pb::StripedLayout {
                    stripe_unit: *stripe_unit,
                    width: *width,
                })
            }
            LayoutKind::Lvm { vg_name, lv_name } => pb::volume::Layout::Lvm(pb::LvmLayout {
                vg_name: vg_name.clone(),
                lv_name: lv_name.clone(),
            }),
        };
        pb::Volume {
            block_size: v.block_size(),
            devices: to_pb(v.devices().to_vec()),
            segments: to_pb(v.segments().to_vec()),
            layout: Some(layout),
        }
    }
}

impl From<Volume> for pb::Volume {
    fn from(v: Volume) -> Self {
        pb::Volume::from(&v)
    }
}

/// The reply to GetVolume.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeInfo {
    pub fs_uuid: Uuid,
    pub volume: Volume,
}

impl TryFrom<pb::GetVolumeReply> for VolumeInfo {
    type Error = ProtocolError;

    fn try_from(p: pb::GetVolumeReply) -> Result<Self, ProtocolError> {
        Ok(VolumeInfo {
            fs_uuid: uuid(&p.fs_uuid, "fs_uuid")?,
            volume: required_msg(p.volume, "volume")?,
        })
    }
}

impl From<VolumeInfo> for pb::GetVolumeReply {
    fn from(v: VolumeInfo) -> Self {
        pb::GetVolumeReply {
            fs_uuid: v.fs_uuid.as_bytes().to_vec(),
            volume: Some(v.volume.into()),
        }
    }
}

/// One session in the server's status.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionSummary {
    pub session: SessionId,
    pub client_name: String,
    pub host: String,
    pub grants: u32,
    pub open_handles: u32,
    pub lease_remaining_ms: u64,
    /// The node identity that owns the session.
    pub identity: String,
    /// What the session did since it opened (or since this server started).
    pub activity: Activity,
}

/// Counters of one session's work, or of the whole server's; they only grow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Activity {
    /// Requests naming the session, answered (namespace calls name none).
    pub rpcs: u64,
    /// Of them answered with an error (at most `rpcs`).
    pub rpc_errors: u64,
    /// Time spent answering them, microseconds.
    pub rpc_micros: u64,
    pub read_grants: u64,
    pub write_grants: u64,
    /// Bytes the grants covered (the direct path).
    pub granted_read_bytes: u64,
    pub granted_write_bytes: u64,
    /// Bytes moved through the server (the proxied path).
    pub proxied_read_bytes: u64,
    pub proxied_write_bytes: u64,
}

impl TryFrom<pb::Activity> for Activity {
    type Error = ProtocolError;

    fn try_from(p: pb::Activity) -> Result<Self, ProtocolError> {
        if p.rpc_errors > p.rpcs {
            return Err(invalid(
                "rpc_errors",
                format!("{} errors in {} requests", p.rpc_errors, p.rpcs),
            ));
        }
        Ok(Activity {
            rpcs: p.rpcs,
            rpc_errors: p.rpc_errors,
            rpc_micros: p.rpc_micros,
            read_grants: p.read_grants,
            write_grants: p.write_grants,
            granted_read_bytes: p.granted_read_bytes,
            granted_write_bytes: p.granted_write_bytes,
            proxied_read_bytes: p.proxied_read_bytes,
            proxied_write_bytes: p.proxied_write_bytes,
        })
    }
}

impl From<Activity> for pb::Activity {
    fn from(a: Activity) -> Self {
        pb::Activity {
            rpcs: a.rpcs,
            rpc_errors: a.rpc_errors,
            rpc_micros: a.rpc_micros,
            read_grants: a.read_grants,
            write_grants: a.write_grants,
            granted_read_bytes: a.granted_read_bytes,
            granted_write_bytes: a.granted_write_bytes,
            proxied_read_bytes: a.proxied_read_bytes,
            proxied_write_bytes: a.proxied_write_bytes,
        }
    }
}

/// Longest RPC name in a [`RpcTally`].
pub const MAX_RPC_NAME_LEN: usize = 64;
/// Most RPC tallies one ServerStatus reply carries.
pub const MAX_STATUS_RPCS: usize = 256;

/// One RPC's counters since the server process started.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RpcTally {
    /// The RPC's name (1 to [`MAX_RPC_NAME_LEN`] bytes).
    pub rpc: String,
    pub count: u64,
    /// At most `count`.
    pub errors: u64,
    /// Time spent answering, microseconds.
    pub micros: u64,
}

impl TryFrom<pb::RpcTally> for RpcTally {
    type Error = ProtocolError;

    fn try_from(p: pb::RpcTally) -> Result<Self, ProtocolError> {
        if p.rpc.is_empty() || p.rpc.len() > MAX_RPC_NAME_LEN {
            return Err(invalid(
                "rpc",
                format!("is {} bytes long (1 to {MAX_RPC_NAME_LEN})", p.rpc.len()),
            ));
        }
        if p.errors > p.count {
            return Err(invalid(
                "errors",
                format!("{} errors in {} requests", p.errors, p.count),
            ));
        }
        Ok(RpcTally {
            rpc: p.rpc,
            count: p.count,
            errors: p.errors,
            micros: p.micros,
        })
    }
}

impl From<RpcTally> for pb::RpcTally {
    fn from(t: RpcTally) -> Self {
        pb::RpcTally {
            rpc: t.rpc,
            count: t.count,
            errors: t.errors,
            micros: t.micros,
        }
    }
}

impl TryFrom<pb::SessionSummary> for SessionSummary {
    type Error = ProtocolError;

    fn try_from(p: pb::SessionSummary) -> Result<Self, ProtocolError> {
        Ok(SessionSummary {
            session: session_id(p.session)?,
            client_name: text(p.client_name, "client_name", false)?,
            host: text(p.host, "host", false)?,
            grants: p.grants,
            open_handles: p.open_handles,
            lease_remaining_ms: p.lease_remaining_ms,
            identity: text(p.identity, "identity", false)?,
            activity: required_msg(p.activity, "activity")?,
        })
    }
}

impl From<SessionSummary> for pb::SessionSummary {
    fn from(s: SessionSummary) -> Self {
        pb::SessionSummary {
            session: s.session.0,
            client_name: s.client_name,
            host: s.host,
            grants: s.grants,
            open_handles: s.open_handles,
            lease_remaining_ms: s.lease_remaining_ms,
            identity: s.identity,
            activity: Some(s.activity.into()),
        }
    }
}

/// Metadata commit counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CommitStats {
    /// Transactions made durable.
    pub transactions: u64,
    /// Durable commits (group commit: one may carry many transactions).
    pub commits: u64,
    /// Transactions waiting for a commit.
    pub pending: u64,
}

impl From<pb::CommitStats> for CommitStats {
    fn from(p: pb::CommitStats) -> Self {
        CommitStats {
            transactions: p.transactions,
            commits: p.commits,
            pending: p.pending,
        }
    }
}

impl From<CommitStats> for pb::CommitStats {
    fn from(c: CommitStats) -> Self {
        pb::CommitStats {
            transactions: c.transactions,
            commits: c.commits,
            pending: c.pending,
        }
    }
}

/// Most sessions one ServerStatus reply lists (the reply stays far below the message limit).
pub const MAX_STATUS_SESSIONS: usize = 1000;

/// The reply to ServerStatus.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerStatus {
    pub epoch: SessionEpoch,
    pub fs_uuid: Uuid,
    pub server_version: String,
    pub uptime_ms: u64,
    /// At most [`MAX_STATUS_SESSIONS`] of the live sessions, by id.
    pub sessions: Vec<SessionSummary>,
    /// Live sessions in all: at least `sessions.len()`.
    pub sessions_total: u64,
    pub read_grants: u64,
    pub write_grants: u64,
    pub commits: CommitStats,
    /// Every RPC answered since the process started, by name (at most [`MAX_STATUS_RPCS`]).
    pub rpcs: Vec<RpcTally>,
    /// The server's totals since it started.
    pub activity: Activity,
}

impl TryFrom<pb::ServerStatusReply> for ServerStatus {
    type Error = ProtocolError;

    fn try_from(p: pb::ServerStatusReply) -> Result<Self, ProtocolError> {
        if p.sessions.len() > MAX_STATUS_SESSIONS {
            return Err(invalid(
                "sessions",
                format!("more than {MAX_STATUS_SESSIONS} sessions listed"),
            ));
        }
        if p.sessions_total < p.sessions.len() as u64 {
            return Err(invalid(
                "sessions_total",
                format!(
                    "{} is less than the {} sessions listed",
                    p.sessions_total,
                    p.sessions.len()
                ),
            ));
        }
        if p.rpcs.len() > MAX_STATUS_RPCS {
            return Err(invalid(
                "rpcs",
                format!("more than {MAX_STATUS_RPCS} RPCs listed"),
            ));
        }
        Ok(ServerStatus {
            epoch: epoch(p.epoch)?,
            fs_uuid: uuid(&p.fs_uuid, "fs_uuid")?,
            server_version: text(p.server_version, "server_version", false)?,
            uptime_ms: p.uptime_ms,
            sessions: list(p.sessions, "sessions")?,
            sessions_total: p.sessions_total,
            read_grants: p.read_grants,
            write_grants: p.write_grants,
            commits: required(p.commits, "commits")?.into(),
            rpcs: list(p.rpcs, "rpcs")?,
            activity: required_msg(p.activity, "activity")?,
        })
    }
}

impl From<ServerStatus> for pb::ServerStatusReply {
    fn from(s: ServerStatus) -> Self {
        pb::ServerStatusReply {
            epoch: s.epoch.0,
            fs_uuid: s.fs_uuid.as_bytes().to_vec(),
            server_version: s.server_version,
            uptime_ms: s.uptime_ms,
            sessions: to_pb(s.sessions),
            sessions_total: s.sessions_total,
            read_grants: s.read_grants,
            write_grants: s.write_grants,
            commits: Some(s.commits.into()),
            rpcs: to_pb(s.rpcs),
            activity: Some(s.activity.into()),
        }
    }
}

/// A directory quota's limits; `None` is no limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct QuotaLimits {
    pub capacity_bytes: Option<u64>,
    pub inodes: Option<u64>,
}

impl From<pb::QuotaLimits> for QuotaLimits {
    fn from(p: pb::QuotaLimits) -> Self {
        QuotaLimits {
            capacity_bytes: p.capacity_bytes,
            inodes: p.inodes,
        }
    }
}

impl From<QuotaLimits> for pb::QuotaLimits {
    fn from(q: QuotaLimits) -> Self {
        pb::QuotaLimits {
            capacity_bytes: q.capacity_bytes,
            inodes: q.inodes,
        }
    }
}

/// A directory quota and its usage.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuotaInfo {
    pub inode: InodeId,
    pub limits: QuotaLimits,
    pub used_bytes: u64,
    pub used_inodes: u64,
}

impl TryFrom<pb::QuotaInfo> for QuotaInfo {
    type Error = ProtocolError;

    fn try_from(p: pb::QuotaInfo) -> Result<Self, ProtocolError> {
        Ok(QuotaInfo {
            inode: inode(p.inode, "inode")?,
            limits: required(p.limits, "limits")?.into(),
            used_bytes: p.used_bytes,
            used_inodes: p.used_inodes,
        })
    }
}

impl From<QuotaInfo> for pb::QuotaInfo {
    fn from(q: QuotaInfo) -> Self {
        pb::QuotaInfo {
            inode: q.inode.0,
            limits: Some(q.limits.into()),
            used_bytes: q.used_bytes,
            used_inodes: q.used_inodes,
        }
    }
}

macro_rules! quota_reply {
    ($($pb:ident),*) => {$(
        impl TryFrom<pb::$pb> for QuotaInfo {
            type Error = ProtocolError;

            fn try_from(p: pb::$pb) -> Result<Self, ProtocolError> {
                required_msg(p.quota, "quota")
            }
        }

        impl From<QuotaInfo> for pb::$pb {
            fn from(q: QuotaInfo) -> Self {
                pb::$pb { quota: Some(q.into()) }
            }
        }
    )*};
}
quota_reply!(SetQuotaReply, GetQuotaReply);

/// Most quotas one ListQuotas reply lists.
pub const MAX_LISTED_QUOTAS: usize = 10_000;

/// The reply to ListQuotas: every directory quota (at most [`MAX_LISTED_QUOTAS`]), by
/// directory inode.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct QuotaList {
    pub quotas: Vec<QuotaInfo>,
    /// Quotas in all: at least `quotas.len()`.
    pub quotas_total: u64,
}

impl TryFrom<pb::ListQuotasReply> for QuotaList {
    type Error = ProtocolError;

    fn try_from(p: pb::ListQuotasReply) -> Result<Self, ProtocolError> {
        if p.quotas.len() > MAX_LISTED_QUOTAS {
            return Err(invalid(
                "quotas",
                format!("more than {MAX_LISTED_QUOTAS} quotas listed"),
            ));
        }
        if p.quotas_total < p.quotas.len() as u64 {
            return Err(invalid(
                "quotas_total",
                format!(
                    "{} is less than the {} quotas listed",
                    p.quotas_total,
                    p.quotas.len()
                ),
            ));
        }
        Ok(QuotaList {
            quotas: list(p.quotas, "quotas")?,
            quotas_total: p.quotas_total,
        })
    }
}

impl From<QuotaList> for pb::ListQuotasReply {
    fn from(l: QuotaList) -> Self {
        pb::ListQuotasReply {
            quotas: to_pb(l.quotas),
            quotas_total: l.quotas_total,
        }
    }
}

/// SetQuota on a directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SetQuotaRequest {
    pub cred: Credentials,
    pub inode: InodeId,
    pub limits: QuotaLimits,
}

impl TryFrom<pb::SetQuotaRequest> for SetQuotaRequest {
    type Error = ProtocolError;

    fn try_from(p: pb::SetQuotaRequest) -> Result<Self, ProtocolError> {
        Ok(SetQuotaRequest {
            cred: cred(p.cred)?,
            inode: inode(p.inode, "inode")?,
            limits: required(p.limits, "limits")?.into(),
        })
    }
}

impl From<SetQuotaRequest> for pb::SetQuotaRequest {
    fn from(r: SetQuotaRequest) -> Self {
        pb::SetQuotaRequest {
            cred: Some(r.cred.into()),
            inode: r.inode.0,
            limits: Some(r.limits.into()),
        }
    }
}

/// EvictSession: an administrator fences a session (docs/protocol.md "Eviction").
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EvictSessionRequest {
    pub session: SessionId,
    /// Free text for the log and the evicted agent (at most [`super::MAX_TEXT_LEN`] bytes).
    pub reason: String,
}

impl TryFrom<pb::EvictSessionRequest> for EvictSessionRequest {
    type Error = ProtocolError;

    fn try_from(p: pb::EvictSessionRequest) -> Result<Self, ProtocolError> {
        Ok(EvictSessionRequest {
            session: session_id(p.session)?,
            reason: text(p.reason, "reason", false)?,
        })
    }
}

impl From<EvictSessionRequest> for pb::EvictSessionRequest {
    fn from(r: EvictSessionRequest) -> Self {
        pb::EvictSessionRequest {
            session: r.session.0,
            reason: r.reason,
        }
    }
}

/// EvictSession's answer: when the evicted session's grants go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EvictSessionReply {
    pub lease_remaining_ms: u64,
}

impl TryFrom<pb::EvictSessionReply> for EvictSessionReply {
    type Error = ProtocolError;

    fn try_from(p: pb::EvictSessionReply) -> Result<Self, ProtocolError> {
        Ok(EvictSessionReply {
            lease_remaining_ms: p.lease_remaining_ms,
        })
    }
}

impl From<EvictSessionReply> for pb::EvictSessionReply {
    fn from(r: EvictSessionReply) -> Self {
        pb::EvictSessionReply {
            lease_remaining_ms: r.lease_remaining_ms,
        }
    }
}

/// Most LUNs one GrowVolume adds.
pub const MAX_GROW_DEVICES: usize = 64;

/// Longest device path GrowVolume accepts (PATH_MAX).
pub const MAX_DEVICE_PATH_LEN: usize = 4096;

/// How GrowVolume lays out what it adds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GrowLayout {
    /// One LUN as a linear segment.
    Linear,
    /// The LUNs as one segment striped in units of `stripe_unit` bytes.
    Striped { stripe_unit: u64 },
    /// The imported LVM2 logical volume read again (after lvextend).
    Lvm,
}

/// GrowVolume: an administrator grows the volume while it is mounted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GrowVolumeRequest {
    /// Paths on the server's host: absolute, without NUL, at most [`MAX_GROW_DEVICES`].
    pub device_paths: Vec<String>,
    pub layout: GrowLayout,
    pub force: bool,
}

impl TryFrom<pb::GrowVolumeRequest> for GrowVolumeRequest {
    type Error = ProtocolError;

    fn try_from(p: pb::GrowVolumeRequest) -> Result<Self, ProtocolError> {
        if p.device_paths.len() > MAX_GROW_DEVICES {
            return Err(invalid(
                "device_paths",
                format!(
                    "names {} LUNs (at most {MAX_GROW_DEVICES})",
                    p.device_paths.len()
                ),
            ));
        }
        for path in &p.device_paths {
            if !path.starts_with('/') || path.contains('\0') || path.len() > MAX_DEVICE_PATH_LEN {
                return Err(invalid(
                    "device_paths",
                    format!(
                        "{path:?} is not an absolute path of at most {MAX_DEVICE_PATH_LEN} bytes"
                    ),
                ));
            }
        }
        let raw: pb::GrowLayout = super::enum_field(p.layout, "layout")?;
        let layout = match raw {
            pb::GrowLayout::Unspecified => return Err(ProtocolError::MissingField("layout")),
            pb::GrowLayout::Linear => GrowLayout::Linear,
            pb::GrowLayout::Striped => {
                if p.stripe_unit == 0 || !p.stripe_unit.is_multiple_of(512) {
                    return Err(invalid(
                        "stripe_unit",
                        format!("{} is not a positive multiple of 512", p.stripe_unit),
                    ));
                }
                GrowLayout::Striped {
                    stripe_unit: p.stripe_unit,
                }
            }
            pb::GrowLayout::Lvm => GrowLayout::Lvm,
        };
        if !matches!(layout, GrowLayout::Striped { .. }) && p.stripe_unit != 0 {
            return Err(invalid("stripe_unit", "only for a striped growth"));
        }
        match layout {
            GrowLayout::Linear if p.device_paths.len() != 1 => Err(invalid(
                "device_paths",
                format!(
                    "a linear growth adds exactly one LUN, not {}",
                    p.device_paths.len()
                ),
            )),
            GrowLayout::Striped { .. } if p.device_paths.is_empty() => {
                Err(ProtocolError::MissingField("device_paths"))
            }
            _ => Ok(GrowVolumeRequest {
                device_paths: p.device_paths,
                layout,
                force: p.force,
            }),
        }
    }
}

impl From<GrowVolumeRequest> for pb::GrowVolumeRequest {
    fn from(r: GrowVolumeRequest) -> Self {
        let (layout, stripe_unit) = match r.layout {
            GrowLayout::Linear => (pb::GrowLayout::Linear, 0),
            GrowLayout::Striped { stripe_unit } => (pb::GrowLayout::Striped, stripe_unit),
            GrowLayout::Lvm => (pb::GrowLayout::Lvm, 0),
        };
        pb::GrowVolumeRequest {
            device_paths: r.device_paths,
            layout: layout as i32,
            stripe_unit,
            force: r.force,
        }
    }
}

/// GrowVolume's answer: the grown volume and the size before.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GrowVolumeReply {
    pub volume: VolumeInfo,
    pub old_size_bytes: u64,
}

impl TryFrom<pb::GrowVolumeReply> for GrowVolumeReply {
    type Error = ProtocolError;

    fn try_from(p: pb::GrowVolumeReply) -> Result<Self, ProtocolError> {
        let volume: VolumeInfo = required_msg(p.volume, "volume")?;
        if p.old_size_bytes >= volume.volume.size_bytes() {
            return Err(invalid(
                "old_size_bytes",
                format!(
                    "{} is not below the grown volume's {}",
                    p.old_size_bytes,
                    volume.volume.size_bytes()
                ),
            ));
        }
        Ok(GrowVolumeReply {
            volume,
            old_size_bytes: p.old_size_bytes,
        })
    }
}

impl From<GrowVolumeReply> for pb::GrowVolumeReply {
    fn from(r: GrowVolumeReply) -> Self {
        pb::GrowVolumeReply {
            volume: Some(r.volume.into()),
            old_size_bytes: r.old_size_bytes,
        }
    }
}

/// Longest backup path BackupStore accepts (PATH_MAX).
pub const MAX_BACKUP_PATH_LEN: usize = 4096;

/// BackupStore: an administrator has the server write a consistent copy of its metadata
/// store to a new file on the server's host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackupStoreRequest {
    /// Absolute, without NUL, at most [`MAX_BACKUP_PATH_LEN`] bytes, not ending in `/`.
    pub path: String,
    pub force: bool,
}

impl TryFrom<pb::BackupStoreRequest> for BackupStoreRequest {
    type Error = ProtocolError;

    fn try_from(p: pb::BackupStoreRequest) -> Result<Self, ProtocolError> {
        if p.path.is_empty() {
            return Err(ProtocolError::MissingField("path"));
        }
        if !p.path.starts_with('/')
            || p.path.ends_with('/')
            || p.path.contains('\0')
            || p.path.len() > MAX_BACKUP_PATH_LEN
        {
            return Err(invalid(
                "path",
                format!(
                    "{:?} is not an absolute file path of at most {MAX_BACKUP_PATH_LEN} bytes",
                    p.path
                ),
            ));
        }
        Ok(BackupStoreRequest {
            path: p.path,
            force: p.force,
        })
    }
}

impl From<BackupStoreRequest> for pb::BackupStoreRequest {
    fn from(r: BackupStoreRequest) -> Self {
        pb::BackupStoreRequest {
            path: r.path,
            force: r.force,
        }
    }
}

/// BackupStore's answer: what the backup holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackupStoreReply {
    pub fs_uuid: Uuid,
    /// The server epoch (start count) the snapshot was taken in (non-zero).
    pub epoch: SessionEpoch,
    /// The last commit in the snapshot.
    pub commit_seq: u64,
    pub taken_at: Timestamp,
    pub inodes: u64,
    pub size_bytes: u64,
}

impl TryFrom<pb::BackupStoreReply> for BackupStoreReply {
    type Error = ProtocolError;

    fn try_from(p: pb::BackupStoreReply) -> Result<Self, ProtocolError> {
        if p.inodes == 0 {
            return Err(invalid("inodes", "a store holds at least the root"));
        }
        if p.size_bytes == 0 {
            return Err(invalid("size_bytes", "a backup file is never empty"));
        }
        Ok(BackupStoreReply {
            fs_uuid: uuid(&p.fs_uuid, "fs_uuid")?,
            epoch: epoch(p.epoch)?,
            commit_seq: p.commit_seq,
            taken_at: required_msg(p.taken_at, "taken_at")?,
            inodes: p.inodes,
            size_bytes: p.size_bytes,
        })
    }
}

impl From<BackupStoreReply> for pb::BackupStoreReply {
    fn from(r: BackupStoreReply) -> Self {
        pb::BackupStoreReply {
            fs_uuid: r.fs_uuid.as_bytes().to_vec(),
            epoch: r.epoch.0,
            commit_seq: r.commit_seq,
            taken_at: Some(r.taken_at.into()),
            inodes: r.inodes,
            size_bytes: r.size_bytes,
        }
    }
}
