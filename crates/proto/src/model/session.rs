//! The Session service: OpenSession / CloseSession and the events of the session stream
//! (heartbeats and their acknowledgements, recalls of cached read grants, grant returns).

use uuid::Uuid;

use super::{
    At, MAX_INLINE_DATA, byte_range, enum_field, epoch, grant_ids, inode, invalid, required,
    required_msg, session_id, text,
};
use crate::pb;
use crate::types::{ByteRange, GrantId, InodeId, ProtocolError, SessionEpoch, SessionId};

/// OpenSession: an agent registers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpenSessionRequest {
    /// [`super::PROTOCOL_VERSION`] for this crate; never 0.
    pub protocol_version: u32,
    /// 1 to 255 bytes.
    pub client_name: String,
    pub host: String,
    pub agent_version: String,
}

impl TryFrom<pb::OpenSessionRequest> for OpenSessionRequest {
    type Error = ProtocolError;

    fn try_from(p: pb::OpenSessionRequest) -> Result<Self, ProtocolError> {
        if p.protocol_version == 0 {
            return Err(ProtocolError::MissingField("protocol_version"));
        }
        Ok(OpenSessionRequest {
            protocol_version: p.protocol_version,
            client_name: text(p.client_name, "client_name", true)?,
            host: text(p.host, "host", false)?,
            agent_version: text(p.agent_version, "agent_version", false)?,
        })
    }
}

impl From<OpenSessionRequest> for pb::OpenSessionRequest {
    fn from(r: OpenSessionRequest) -> Self {
        pb::OpenSessionRequest {
            protocol_version: r.protocol_version,
            client_name: r.client_name,
            host: r.host,
            agent_version: r.agent_version,
        }
    }
}

/// What an agent needs to know about the file system to plan its I/O.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerInfo {
    /// Never nil.
    pub fs_uuid: Uuid,
    /// A power of two from 512 to 65536.
    pub block_size: u32,
    /// I/O shorter than this many bytes goes the proxied path.
    pub direct_io_threshold: u64,
    /// Largest range of one grant: a positive multiple of `block_size`.
    pub max_grant_bytes: u64,
    /// Largest proxied payload: 1 to [`MAX_INLINE_DATA`].
    pub max_inline_bytes: u32,
    pub server_version: String,
    /// Restores of the metadata store from a backup (0: never restored).
    pub restores: u64,
    /// The server completes several parts of a write layout in one `Complete`
    /// ([`super::data::CompleteRequest::more`]).
    pub multi_part_complete: bool,
    /// The server applies a proxied write's attribute changes
    /// ([`super::data::WriteRequest::then`]).
    pub write_sets_attr: bool,
    /// The server releases the handles a call's `sanfs-release` header names
    /// ([`crate::headers::RELEASE`]).
    pub releases_with_changes: bool,
}

/// A block size field: a power of two from 512 to 65536 (as the volume's).
pub(crate) fn block_size(raw: u32, field: &'static str) -> Result<u32, ProtocolError> {
    if raw.is_power_of_two() && (512..=65536).contains(&raw) {
        Ok(raw)
    } else {
        Err(invalid(
            field,
            format!("{raw} is not a power of two from 512 to 65536"),
        ))
    }
}

impl TryFrom<pb::ServerInfo> for ServerInfo {
    type Error = ProtocolError;

    fn try_from(p: pb::ServerInfo) -> Result<Self, ProtocolError> {
        let block_size = block_size(p.block_size, "block_size")?;
        if p.max_grant_bytes == 0 || !p.max_grant_bytes.is_multiple_of(u64::from(block_size)) {
            return Err(invalid(
                "max_grant_bytes",
                format!(
                    "{} is not a positive multiple of the block size {block_size}",
                    p.max_grant_bytes
                ),
            ));
        }
        if p.max_inline_bytes == 0 || p.max_inline_bytes as usize > MAX_INLINE_DATA {
            return Err(invalid(
                "max_inline_bytes",
                format!("{} is not 1 to {MAX_INLINE_DATA}", p.max_inline_bytes),
            ));
        }
        Ok(ServerInfo {
            fs_uuid: super::common::uuid(&p.fs_uuid, "fs_uuid")?,
            block_size,
            direct_io_threshold: p.direct_io_threshold,
            max_grant_bytes: p.max_grant_bytes,
            max_inline_bytes: p.max_inline_bytes,
            server_version: text(p.server_version, "server_version", false)?,
            restores: p.restores,
            multi_part_complete: p.multi_part_complete,
            write_sets_attr: p.write_sets_attr,
            releases_with_changes: p.releases_with_changes,
        })
    }
}

impl From<ServerInfo> for pb::ServerInfo {
    fn from(s: ServerInfo) -> Self {
        pb::ServerInfo {
            fs_uuid: s.fs_uuid.as_bytes().to_vec(),
            block_size: s.block_size,
            direct_io_threshold: s.direct_io_threshold,
            max_grant_bytes: s.max_grant_bytes,
            max_inline_bytes: s.max_inline_bytes,
            server_version: s.server_version,
            restores: s.restores,
            multi_part_complete: s.multi_part_complete,
            write_sets_attr: s.write_sets_attr,
            releases_with_changes: s.releases_with_changes,
        }
    }
}

/// The reply to OpenSession.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpenSessionReply {
    pub session: SessionId,
    pub epoch: SessionEpoch,
    /// Positive.
    pub lease_ttl_ms: u64,
    pub server: ServerInfo,
}

impl TryFrom<pb::OpenSessionReply> for OpenSessionReply {
    type Error = ProtocolError;

    fn try_from(p: pb::OpenSessionReply) -> Result<Self, ProtocolError> {
        if p.lease_ttl_ms == 0 {
            return Err(ProtocolError::MissingField("lease_ttl_ms"));
        }
        Ok(OpenSessionReply {
            session: session_id(p.session)?,
            epoch: epoch(p.epoch)?,
            lease_ttl_ms: p.lease_ttl_ms,
            server: required_msg(p.server, "server")?,
        })
    }
}

impl From<OpenSessionReply> for pb::OpenSessionReply {
    fn from(r: OpenSessionReply) -> Self {
        pb::OpenSessionReply {
            session: r.session.0,
            epoch: r.epoch.0,
            lease_ttl_ms: r.lease_ttl_ms,
            server: Some(r.server.into()),
        }
    }
}

/// A session and the server epoch it was opened in (CloseSession; the stream's Attach).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionRef {
    pub session: SessionId,
    pub epoch: SessionEpoch,
}

/// CloseSession.
pub type CloseSessionRequest = SessionRef;

impl TryFrom<pb::CloseSessionRequest> for SessionRef {
    type Error = ProtocolError;

    fn try_from(p: pb::CloseSessionRequest) -> Result<Self, ProtocolError> {
        Ok(SessionRef {
            session: session_id(p.session)?,
            epoch: epoch(p.epoch)?,
        })
    }
}

impl From<SessionRef> for pb::CloseSessionRequest {
    fn from(r: SessionRef) -> Self {
        pb::CloseSessionRequest {
            session: r.session.0,
            epoch: r.epoch.0,
        }
    }
}

impl TryFrom<pb::Attach> for SessionRef {
    type Error = ProtocolError;

    fn try_from(p: pb::Attach) -> Result<Self, ProtocolError> {
        Ok(SessionRef {
            session: session_id(p.session)?,
            epoch: epoch(p.epoch)?,
        })
    }
}

impl From<SessionRef> for pb::Attach {
    fn from(r: SessionRef) -> Self {
        pb::Attach {
            session: r.session.0,
            epoch: r.epoch.0,
        }
    }
}

/// A message from the agent on the session stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClientEvent {
    /// The first message of every stream.
    Attach(SessionRef),
    Heartbeat {
        seq: u64,
        /// Leases the agent asks to keep ([`LeaseRenew`]; `None`: nothing asked).
        renew: Option<LeaseRenew>,
    },
    /// The agent no longer uses these recalled grants: no I/O of theirs is in flight.
    RecallAck { grant_ids: Vec<GrantId> },
    /// The agent gives these cached read grants back.
    GrantReturn { grant_ids: Vec<GrantId> },
    /// The agent dropped what it cached under the leases of LeaseRecall `id`.
    LeaseRecallAck { id: u64 },
}

impl TryFrom<pb::SessionStreamRequest> for ClientEvent {
    type Error = ProtocolError;

    fn try_from(p: pb::SessionStreamRequest) -> Result<Self, ProtocolError> {
        use pb::session_stream_request::Event;
        Ok(match required(p.event, "event")? {
            Event::Attach(a) => ClientEvent::Attach(SessionRef::try_from(a).at("attach")?),
            Event::Heartbeat(h) => ClientEvent::Heartbeat {
                seq: h.seq,
                renew: h
                    .renew
                    .map(LeaseRenew::try_from)
                    .transpose()
                    .at("heartbeat")?,
            },
            Event::RecallAck(a) => ClientEvent::RecallAck {
                grant_ids: grant_ids(a.grant_ids, "grant_ids").at("recall_ack")?,
            },
            Event::GrantReturn(r) => ClientEvent::GrantReturn {
                grant_ids: grant_ids(r.grant_ids, "grant_ids").at("grant_return")?,
            },
            Event::LeaseRecallAck(a) => {
                if a.id == 0 {
                    return Err(ProtocolError::MissingField("id").in_field("lease_recall_ack"));
                }
                ClientEvent::LeaseRecallAck { id: a.id }
            }
        })
    }
}

impl From<ClientEvent> for pb::SessionStreamRequest {
    fn from(e: ClientEvent) -> Self {
        use pb::session_stream_request::Event;
        let ids = |v: Vec<GrantId>| v.into_iter().map(|g| g.0).collect();
        pb::SessionStreamRequest {
            event: Some(match e {
                ClientEvent::Attach(r) => Event::Attach(r.into()),
                ClientEvent::Heartbeat { seq, renew } => Event::Heartbeat(pb::Heartbeat {
                    seq,
                    renew: renew.map(Into::into),
                }),
                ClientEvent::RecallAck { grant_ids } => Event::RecallAck(pb::RecallAck {
                    grant_ids: ids(grant_ids),
                }),
                ClientEvent::GrantReturn { grant_ids } => Event::GrantReturn(pb::GrantReturn {
                    grant_ids: ids(grant_ids),
                }),
                ClientEvent::LeaseRecallAck { id } => {
                    Event::LeaseRecallAck(pb::LeaseRecallAck { id })
                }
            }),
        }
    }
}

/// Why the server recalls cached read grants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecallReason {
    /// Another request (a write grant, a proxied write) needs the range.
    Conflict,
    /// The extents changed under the grant (truncate, punch hole, zero range, unlink).
    LayoutChanged,
    /// The server trims its grant state.
    Resource,
    /// The server is shutting down.
    Shutdown,
}

/// A recall of cached read grants, all on one inode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recall {
    /// At least one.
    pub grant_ids: Vec<GrantId>,
    pub inode: InodeId,
    /// The range the server needs (the grants may cover more).
    pub range: ByteRange,
    pub reason: RecallReason,
    /// The grants are delegations: write back and drop the file's cache before the ack.
    pub delegation: bool,
}

impl TryFrom<pb::Recall> for Recall {
    type Error = ProtocolError;

    fn try_from(p: pb::Recall) -> Result<Self, ProtocolError> {
        let reason = match enum_field::<pb::RecallReason>(p.reason, "reason")? {
            pb::RecallReason::Unspecified => return Err(ProtocolError::MissingField("reason")),
            pb::RecallReason::Conflict => RecallReason::Conflict,
            pb::RecallReason::LayoutChanged => RecallReason::LayoutChanged,
            pb::RecallReason::Resource => RecallReason::Resource,
            pb::RecallReason::Shutdown => RecallReason::Shutdown,
        };
        Ok(Recall {
            grant_ids: grant_ids(p.grant_ids, "grant_ids")?,
            inode: inode(p.inode, "inode")?,
            range: byte_range(p.offset, p.length, "range")?,
            reason,
            delegation: p.delegation,
        })
    }
}

impl From<Recall> for pb::Recall {
    fn from(r: Recall) -> Self {
        let reason = match r.reason {
            RecallReason::Conflict => pb::RecallReason::Conflict,
            RecallReason::LayoutChanged => pb::RecallReason::LayoutChanged,
            RecallReason::Resource => pb::RecallReason::Resource,
            RecallReason::Shutdown => pb::RecallReason::Shutdown,
        };
        pb::Recall {
            grant_ids: r.grant_ids.into_iter().map(|g| g.0).collect(),
            inode: r.inode.0,
            offset: r.range.offset(),
            length: r.range.len(),
            reason: reason.into(),
            delegation: r.delegation,
        }
    }
}

/// A recall of attribute and entry leases on one inode (docs/protocol.md "Leases").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseRecall {
    /// At least 1.
    pub id: u64,
    pub inode: InodeId,
    /// The inode's attributes.
    pub attr: bool,
    /// The names in directory `inode`, negative ones included.
    pub entries: bool,
    /// The create delegation on directory `inode` (docs/protocol.md "Creates answered by
    /// the agent").
    pub creates: bool,
}

impl TryFrom<pb::LeaseRecall> for LeaseRecall {
    type Error = ProtocolError;

    fn try_from(p: pb::LeaseRecall) -> Result<Self, ProtocolError> {
        if p.id == 0 {
            return Err(ProtocolError::MissingField("id"));
        }
        if !p.attr && !p.entries && !p.creates {
            return Err(invalid(
                "attr",
                "neither attr, entries nor creates is recalled",
            ));
        }
        Ok(LeaseRecall {
            id: p.id,
            inode: inode(p.inode, "inode")?,
            attr: p.attr,
            entries: p.entries,
            creates: p.creates,
        })
    }
}

impl From<LeaseRecall> for pb::LeaseRecall {
    fn from(r: LeaseRecall) -> Self {
        pb::LeaseRecall {
            id: r.id,
            inode: r.inode.0,
            attr: r.attr,
            entries: r.entries,
            creates: r.creates,
        }
    }
}

/// The most inodes of each kind one heartbeat asks to renew (a session holds leases on at
/// most 65,536 inodes at the server).
pub const MAX_RENEW: usize = 65_536;

fn inode_list(raw: Vec<u64>, field: &'static str) -> Result<Vec<InodeId>, ProtocolError> {
    if raw.len() > MAX_RENEW {
        return Err(invalid(field, "lists more than 65,536 inodes"));
    }
    raw.into_iter().map(|i| inode(i, field)).collect()
}

/// Attribute and entry leases an agent asks to keep ([`ClientEvent::Heartbeat`]; docs/protocol.md
/// "Attribute and entry leases").
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LeaseRenew {
    /// Inodes whose attribute leases to renew.
    pub attrs: Vec<InodeId>,
    /// Directories whose entry leases to renew.
    pub entries: Vec<InodeId>,
}

impl TryFrom<pb::LeaseRenew> for LeaseRenew {
    type Error = ProtocolError;

    fn try_from(p: pb::LeaseRenew) -> Result<Self, ProtocolError> {
        Ok(LeaseRenew {
            attrs: inode_list(p.attrs, "attrs").at("renew")?,
            entries: inode_list(p.entries, "entries").at("renew")?,
        })
    }
}

impl From<LeaseRenew> for pb::LeaseRenew {
    fn from(r: LeaseRenew) -> Self {
        pb::LeaseRenew {
            attrs: r.attrs.into_iter().map(|i| i.0).collect(),
            entries: r.entries.into_iter().map(|i| i.0).collect(),
        }
    }
}

/// The server's answer to a [`LeaseRenew`]: the renewed leases last until the heartbeat's
/// send time plus `lease_ms`; those listed lost were not renewed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseRenewed {
    /// At least 1.
    pub lease_ms: u64,
    pub lost_attrs: Vec<InodeId>,
    pub lost_entries: Vec<InodeId>,
}

impl TryFrom<pb::LeaseRenewed> for LeaseRenewed {
    type Error = ProtocolError;

    fn try_from(p: pb::LeaseRenewed) -> Result<Self, ProtocolError> {
        if p.lease_ms == 0 {
            return Err(ProtocolError::MissingField("lease_ms").in_field("renewed"));
        }
        Ok(LeaseRenewed {
            lease_ms: p.lease_ms,
            lost_attrs: inode_list(p.lost_attrs, "lost_attrs").at("renewed")?,
            lost_entries: inode_list(p.lost_entries, "lost_entries").at("renewed")?,
        })
    }
}

impl From<LeaseRenewed> for pb::LeaseRenewed {
    fn from(r: LeaseRenewed) -> Self {
        pb::LeaseRenewed {
            lease_ms: r.lease_ms,
            lost_attrs: r.lost_attrs.into_iter().map(|i| i.0).collect(),
            lost_entries: r.lost_entries.into_iter().map(|i| i.0).collect(),
        }
    }
}

/// Why the server ends a session (or its stream).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionEndReason {
    Expired,
    Shutdown,
    Evicted,
    /// Another stream attached to the session; the session itself lives on.
    Replaced,
}

/// A message from the server on the session stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ServerEvent {
    /// The lease lasts until the agent's send time of heartbeat `seq` plus `lease_ttl_ms`.
    HeartbeatAck {
        seq: u64,
        lease_ttl_ms: u64,
        /// Every commit of this server epoch up to this number is durable (0: none reported).
        durable_seq: u64,
        /// The answer to the heartbeat's [`LeaseRenew`] (`None`: nothing renewed).
        renewed: Option<LeaseRenewed>,
    },
    Recall(Recall),
    Ended {
        reason: SessionEndReason,
        message: String,
    },
    LeaseRecall(LeaseRecall),
}

impl TryFrom<pb::SessionStreamReply> for ServerEvent {
    type Error = ProtocolError;

    fn try_from(p: pb::SessionStreamReply) -> Result<Self, ProtocolError> {
        use pb::session_stream_reply::Event;
        Ok(match required(p.event, "event")? {
            Event::HeartbeatAck(a) => {
                if a.lease_ttl_ms == 0 {
                    return Err(
                        ProtocolError::MissingField("lease_ttl_ms").in_field("heartbeat_ack")
                    );
                }
                ServerEvent::HeartbeatAck {
                    seq: a.seq,
                    lease_ttl_ms: a.lease_ttl_ms,
                    durable_seq: a.durable_seq,
                    renewed: a
                        .renewed
                        .map(LeaseRenewed::try_from)
                        .transpose()
                        .at("heartbeat_ack")?,
                }
            }
            Event::Recall(r) => ServerEvent::Recall(Recall::try_from(r).at("recall")?),
            Event::LeaseRecall(r) => {
                ServerEvent::LeaseRecall(LeaseRecall::try_from(r).at("lease_recall")?)
            }
            Event::Ended(e) => {
                let reason =
                    match enum_field::<pb::SessionEndReason>(e.reason, "reason").at("ended")? {
                        pb::SessionEndReason::Unspecified => {
                            return Err(ProtocolError::MissingField("reason").in_field("ended"));
                        }
                        pb::SessionEndReason::Expired => SessionEndReason::Expired,
                        pb::SessionEndReason::Shutdown => SessionEndReason::Shutdown,
                        pb::SessionEndReason::Evicted => SessionEndReason::Evicted,
                        pb::SessionEndReason::Replaced => SessionEndReason::Replaced,
                    };
                if e.message.len() > 4096 {
                    return Err(invalid("message", "is longer than 4096 bytes").in_field("ended"));
                }
                ServerEvent::Ended {
                    reason,
                    message: e.message,
                }
            }
        })
    }
}

impl From<ServerEvent> for pb::SessionStreamReply {
    fn from(e: ServerEvent) -> Self {
        use pb::session_stream_reply::Event;
        pb::SessionStreamReply {
            event: Some(match e {
                ServerEvent::HeartbeatAck {
                    seq,
                    lease_ttl_ms,
                    durable_seq,
                    renewed,
                } => Event::HeartbeatAck(pb::HeartbeatAck {
                    seq,
                    lease_ttl_ms,
                    durable_seq,
                    renewed: renewed.map(Into::into),
                }),
                ServerEvent::Recall(r) => Event::Recall(r.into()),
                ServerEvent::LeaseRecall(r) => Event::LeaseRecall(r.into()),
                ServerEvent::Ended { reason, message } => {
                    let reason = match reason {
                        SessionEndReason::Expired => pb::SessionEndReason::Expired,
                        SessionEndReason::Shutdown => pb::SessionEndReason::Shutdown,
                        SessionEndReason::Evicted => pb::SessionEndReason::Evicted,
                        SessionEndReason::Replaced => pb::SessionEndReason::Replaced,
                    };
                    Event::Ended(pb::SessionEnded {
                        reason: reason.into(),
                        message,
                    })
                }
            }),
        }
    }
}
