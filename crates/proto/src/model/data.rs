//! The Data service: map requests and grants (control info 1 and 2), completions (control
//! info 3 and 4), grant returns, the proxied path (Read / Write), Fsync, Fallocate and
//! GetExtents.
//!
//! A [`Grant`] carries the I/O plan: per-device I/Os ([`DeviceIo`]) with the buffer pieces
//! ([`BufRange`]) they gather from or scatter to, and the pieces to fill with zeros. Its
//! conversion checks that the plan is whole: every byte of the granted range is covered by
//! exactly one buffer piece, every device I/O is 512-byte aligned and its pieces add up to
//! its length. So an agent never issues a device I/O from a plan that leaves part of the
//! caller's buffer undefined. (These mirror the naming of `sanfs_blockmap::plan`; once
//! that module lands they should become the same types.)

use sanfs_blockmap::volume::DeviceIndex;

use super::common::{attr, cred};
use super::namespace::{HandleRef, lease_ms};
use super::{
    MAX_INLINE_DATA, byte_range, enum_field, epoch, grant_id, grant_ids, handle, inode, invalid,
    list, nonempty_range, payload, session_id, to_pb,
};
use crate::pb;
use crate::types::{
    Attr, ByteRange, Credentials, GrantId, InodeId, MAX_FILE_SIZE, ProtocolError, SessionEpoch,
    SessionId, SetAttr,
};

/// Device I/O on the direct path is aligned to at least this many bytes (the smallest
/// logical block size of any LUN).
pub const SECTOR_SIZE: u64 = 512;

/// MapRead / MapWrite (control info 1).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MapRequest {
    pub cred: Credentials,
    /// The open handle (and its session) the I/O is done under.
    pub handle: HandleRef,
    pub epoch: SessionEpoch,
    pub inode: InodeId,
    /// Not empty. The server checks that it is block aligned.
    pub range: ByteRange,
    /// O_SYNC / O_DSYNC write.
    pub sync: bool,
    /// MapWrite: keep the grant as a write layout (completed part by part, returned later).
    pub layout: bool,
    /// A layout asked ahead of a sequential writer (speculative: refused where it would take
    /// more than an eighth of the free space). Only with `layout`.
    pub ahead: bool,
}

impl TryFrom<pb::MapRequest> for MapRequest {
    type Error = ProtocolError;

    fn try_from(p: pb::MapRequest) -> Result<Self, ProtocolError> {
        Ok(MapRequest {
            cred: cred(p.cred)?,
            handle: handle_ref(p.session, p.handle)?,
            epoch: epoch(p.epoch)?,
            inode: inode(p.inode, "inode")?,
            range: nonempty_range(p.offset, p.length, "range")?,
            sync: p.sync,
            layout: p.layout,
            ahead: if p.ahead && !p.layout {
                return Err(ProtocolError::InvalidField {
                    field: "ahead",
                    reason: "only a layout is asked ahead".to_owned(),
                });
            } else {
                p.ahead
            },
        })
    }
}

impl From<MapRequest> for pb::MapRequest {
    fn from(r: MapRequest) -> Self {
        pb::MapRequest {
            cred: Some(r.cred.into()),
            session: r.handle.session.0,
            epoch: r.epoch.0,
            handle: r.handle.handle.0,
            inode: r.inode.0,
            offset: r.range.offset(),
            length: r.range.len(),
            sync: r.sync,
            layout: r.layout,
            ahead: r.ahead,
        }
    }
}

/// The range lock a grant holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LockMode {
    /// A read grant.
    Shared,
    /// A write grant.
    Exclusive,
}

pub use sanfs_blockmap::plan::BufRange;

impl From<pb::BufRange> for BufRange {
    fn from(p: pb::BufRange) -> Self {
        BufRange {
            buf_off: p.buf_off,
            len: p.len,
        }
    }
}

impl From<BufRange> for pb::BufRange {
    fn from(b: BufRange) -> Self {
        pb::BufRange {
            buf_off: b.buf_off,
            len: b.len,
        }
    }
}

pub use sanfs_blockmap::plan::DeviceIo;

impl TryFrom<pb::DeviceIo> for DeviceIo {
    type Error = ProtocolError;

    fn try_from(p: pb::DeviceIo) -> Result<Self, ProtocolError> {
        if p.len == 0 {
            return Err(invalid("len", "is 0"));
        }
        if !p.phys_off.is_multiple_of(SECTOR_SIZE) || !p.len.is_multiple_of(SECTOR_SIZE) {
            return Err(invalid(
                "phys_off",
                format!("{}+{} is not {SECTOR_SIZE}-byte aligned", p.phys_off, p.len),
            ));
        }
        if p.phys_off.checked_add(p.len).is_none() {
            return Err(invalid("phys_off", "phys_off + len overflows"));
        }
        let mut sum = 0u64;
        for piece in &p.iov {
            if piece.len == 0 {
                return Err(invalid("iov", "has an empty piece"));
            }
            sum = sum
                .checked_add(piece.len)
                .ok_or_else(|| invalid("iov", "lengths overflow"))?;
        }
        if sum != p.len {
            return Err(invalid(
                "iov",
                format!("pieces add up to {sum} bytes, the I/O is {}", p.len),
            ));
        }
        Ok(DeviceIo {
            device: DeviceIndex(p.device),
            phys_off: p.phys_off,
            len: p.len,
            iov: p.iov.into_iter().map(BufRange::from).collect(),
        })
    }
}

impl From<DeviceIo> for pb::DeviceIo {
    fn from(d: DeviceIo) -> Self {
        pb::DeviceIo {
            device: d.device.0,
            phys_off: d.phys_off,
            len: d.len,
            iov: to_pb(d.iov),
        }
    }
}

/// A grant (control info 2): permission to do I/O on `range` of `inode` directly on the
/// LUNs, with the plan to do it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    pub grant_id: GrantId,
    pub epoch: SessionEpoch,
    pub inode: InodeId,
    /// A prefix of the requested range; empty for a read at or past the end of file.
    pub range: ByteRange,
    pub mode: LockMode,
    pub device_ios: Vec<DeviceIo>,
    /// Buffer pieces to fill with zeros (holes, Unwritten extents). Read grants only.
    pub zero_fill: Vec<BufRange>,
    /// The file size when the grant was made.
    pub file_size: u64,
    /// The agent may keep the grant as a cached layout until it is recalled or returned: a
    /// read grant, or a write grant asked for as a write layout (`MapRequest::layout`).
    pub cacheable: bool,
}

impl Grant {
    /// Checks the plan's invariants: a write grant is not empty and has no zero fill; the buffer pieces of all device I/Os and of `zero_fill` are non-empty and
    /// cover `[0, range.len())` exactly once. (Per-I/O alignment and iov sums are checked
    /// when each [`DeviceIo`] is converted.)
    pub fn check(&self) -> Result<(), ProtocolError> {
        if self.file_size > MAX_FILE_SIZE {
            return Err(invalid("file_size", "passes the largest file size"));
        }
        if self.mode == LockMode::Exclusive {
            if self.range.is_empty() {
                return Err(invalid("length", "a write grant is empty"));
            }
            if !self.zero_fill.is_empty() {
                return Err(invalid("zero_fill", "set on a write grant"));
            }
        }
        let mut pieces: Vec<BufRange> = self
            .device_ios
            .iter()
            .flat_map(|io| io.iov.iter().copied())
            .chain(self.zero_fill.iter().copied())
            .collect();
        pieces.sort_unstable();
        let mut covered = 0u64;
        for piece in pieces {
            if piece.len == 0 {
                return Err(invalid("zero_fill", "has an empty piece"));
            }
            if piece.buf_off != covered {
                let what = if piece.buf_off < covered {
                    "overlap"
                } else {
                    "leave a gap"
                };
                return Err(invalid(
                    "device_ios",
                    format!(
                        "buffer pieces {what} at byte {}",
                        piece.buf_off.min(covered)
                    ),
                ));
            }
            covered = piece
                .buf_off
                .checked_add(piece.len)
                .ok_or_else(|| invalid("device_ios", "buffer piece overflows"))?;
        }
        if covered != self.range.len() {
            return Err(invalid(
                "device_ios",
                format!(
                    "buffer pieces cover {covered} bytes of a {}-byte grant",
                    self.range.len()
                ),
            ));
        }
        Ok(())
    }
}

impl TryFrom<pb::Grant> for Grant {
    type Error = ProtocolError;

    fn try_from(p: pb::Grant) -> Result<Self, ProtocolError> {
        let mode = match enum_field::<pb::LockMode>(p.mode, "mode")? {
            pb::LockMode::Unspecified => return Err(ProtocolError::MissingField("mode")),
            pb::LockMode::Shared => LockMode::Shared,
            pb::LockMode::Exclusive => LockMode::Exclusive,
        };
        let grant = Grant {
            grant_id: grant_id(p.grant_id, "grant_id")?,
            epoch: epoch(p.epoch)?,
            inode: inode(p.inode, "inode")?,
            range: byte_range(p.offset, p.length, "range")?,
            mode,
            device_ios: list(p.device_ios, "device_ios")?,
            zero_fill: p.zero_fill.into_iter().map(BufRange::from).collect(),
            file_size: p.file_size,
            cacheable: p.cacheable,
        };
        grant.check()?;
        Ok(grant)
    }
}

impl From<Grant> for pb::Grant {
    fn from(g: Grant) -> Self {
        let mode = match g.mode {
            LockMode::Shared => pb::LockMode::Shared,
            LockMode::Exclusive => pb::LockMode::Exclusive,
        };
        pb::Grant {
            grant_id: g.grant_id.0,
            epoch: g.epoch.0,
            inode: g.inode.0,
            offset: g.range.offset(),
            length: g.range.len(),
            mode: mode.into(),
            device_ios: to_pb(g.device_ios),
            zero_fill: to_pb(g.zero_fill),
            file_size: g.file_size,
            cacheable: g.cacheable,
        }
    }
}

/// The failure of one device I/O of a grant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExtentError {
    pub device: DeviceIndex,
    pub phys_off: u64,
    pub len: u64,
    /// Linux errno, 1 to 4095.
    pub errno: i32,
}

impl TryFrom<pb::ExtentError> for ExtentError {
    type Error = ProtocolError;

    fn try_from(p: pb::ExtentError) -> Result<Self, ProtocolError> {
        if !(1..=4095).contains(&p.errno) {
            return Err(invalid("errno", format!("{} is not 1 to 4095", p.errno)));
        }
        if p.phys_off.checked_add(p.len).is_none() {
            return Err(invalid("phys_off", "phys_off + len overflows"));
        }
        Ok(ExtentError {
            device: DeviceIndex(p.device),
            phys_off: p.phys_off,
            len: p.len,
            errno: p.errno,
        })
    }
}

impl From<ExtentError> for pb::ExtentError {
    fn from(e: ExtentError) -> Self {
        pb::ExtentError {
            device: e.device.0,
            phys_off: e.phys_off,
            len: e.len,
            errno: e.errno,
        }
    }
}

/// How the device I/O of a grant went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IoOutcome {
    Ok,
    /// At least one device I/O failed; never empty.
    DeviceErrors(Vec<ExtentError>),
}

/// Complete (control info 3).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompleteRequest {
    pub session: SessionId,
    pub epoch: SessionEpoch,
    pub grant_id: GrantId,
    pub outcome: IoOutcome,
    /// The prefix of the granted range transferred completely (the server checks it is at
    /// most the grant's length).
    pub bytes_done: u64,
    pub sync: bool,
    /// A write layout's partial completion: `Some(offset)` completes
    /// `[offset, offset + bytes_done)` and keeps the grant; `None` completes the grant's prefix
    /// of `bytes_done` bytes and ends it.
    pub keep_at: Option<u64>,
    /// With `keep_at`: further parts of the layout completed in the same transaction (each
    /// non-empty; at most [`MAX_COMPLETE_PARTS`] parts in all). Empty without `keep_at`.
    pub more: Vec<ByteRange>,
}

/// The most parts one `Complete` of a write layout carries (`keep_at` and `more` together).
pub const MAX_COMPLETE_PARTS: usize = 1024;

impl TryFrom<pb::CompleteRequest> for CompleteRequest {
    type Error = ProtocolError;

    fn try_from(p: pb::CompleteRequest) -> Result<Self, ProtocolError> {
        let outcome = match enum_field::<pb::IoStatus>(p.status, "status")? {
            pb::IoStatus::Unspecified => return Err(ProtocolError::MissingField("status")),
            pb::IoStatus::Ok => {
                if !p.errors.is_empty() {
                    return Err(invalid("errors", "set with status OK"));
                }
                IoOutcome::Ok
            }
            pb::IoStatus::DeviceError => {
                if p.errors.is_empty() {
                    return Err(ProtocolError::MissingField("errors"));
                }
                IoOutcome::DeviceErrors(list(p.errors, "errors")?)
            }
        };
        if p.bytes_done > MAX_FILE_SIZE {
            return Err(invalid("bytes_done", "passes the largest file size"));
        }
        let keep_at = if p.keep {
            if p.offset
                .checked_add(p.bytes_done)
                .is_none_or(|e| e > MAX_FILE_SIZE)
            {
                return Err(invalid(
                    "offset",
                    "offset + bytes_done passes the largest file size",
                ));
            }
            Some(p.offset)
        } else if p.offset != 0 {
            return Err(invalid("offset", "set without keep"));
        } else {
            None
        };
        if keep_at.is_none() && !p.more.is_empty() {
            return Err(invalid("more", "set without keep"));
        }
        if p.more.len() >= MAX_COMPLETE_PARTS {
            return Err(invalid(
                "more",
                format!("{} parts: at most {}", p.more.len(), MAX_COMPLETE_PARTS - 1),
            ));
        }
        let more = p
            .more
            .into_iter()
            .map(|part| match ByteRange::new(part.offset, part.length) {
                Ok(r) if !r.is_empty() => Ok(r),
                Ok(_) => Err(invalid("more", "a part of length 0")),
                Err(e) => Err(invalid("more", e.to_string())),
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(CompleteRequest {
            session: session_id(p.session)?,
            epoch: epoch(p.epoch)?,
            grant_id: grant_id(p.grant_id, "grant_id")?,
            outcome,
            bytes_done: p.bytes_done,
            sync: p.sync,
            keep_at,
            more,
        })
    }
}

impl From<CompleteRequest> for pb::CompleteRequest {
    fn from(r: CompleteRequest) -> Self {
        let (status, errors) = match r.outcome {
            IoOutcome::Ok => (pb::IoStatus::Ok, Vec::new()),
            IoOutcome::DeviceErrors(e) => (pb::IoStatus::DeviceError, to_pb(e)),
        };
        pb::CompleteRequest {
            session: r.session.0,
            epoch: r.epoch.0,
            grant_id: r.grant_id.0,
            status: status.into(),
            errors,
            bytes_done: r.bytes_done,
            sync: r.sync,
            keep: r.keep_at.is_some(),
            offset: r.keep_at.unwrap_or(0),
            more: r
                .more
                .iter()
                .map(|p| pb::CompletedPart {
                    offset: p.offset(),
                    length: p.len(),
                })
                .collect(),
        }
    }
}

/// Control info 4: the inode's attributes after a completion, and whether the agent must keep
/// a record of it (docs/protocol.md, "Durability of completions").
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompleteReply {
    pub attr: Attr,
    /// The number of the lazy commit that holds this completion in this server epoch; 0:
    /// durable already (nothing to keep).
    pub commit_seq: u64,
    /// Every commit of this server epoch up to this number is durable.
    pub durable_seq: u64,
}

impl TryFrom<pb::CompleteReply> for CompleteReply {
    type Error = ProtocolError;

    fn try_from(p: pb::CompleteReply) -> Result<Self, ProtocolError> {
        Ok(CompleteReply {
            attr: attr(p.attr)?,
            commit_seq: p.commit_seq,
            durable_seq: p.durable_seq,
        })
    }
}

impl From<CompleteReply> for pb::CompleteReply {
    fn from(r: CompleteReply) -> Self {
        pb::CompleteReply {
            attr: Some(r.attr.into()),
            commit_seq: r.commit_seq,
            durable_seq: r.durable_seq,
        }
    }
}

/// Most records in one ReplayWrites request.
pub const MAX_REPLAY_RECORDS: usize = 1024;

/// Most runs in one replay record (a grant's plan has at most one per device piece).
pub const MAX_REPLAY_RUNS: usize = 65536;

/// One piece of a replayed write: file bytes `[file_off, file_off + len)` on LUN `device` at
/// byte `phys_off`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ReplayRun {
    pub file_off: u64,
    pub device: DeviceIndex,
    pub phys_off: u64,
    /// Positive.
    pub len: u64,
}

impl TryFrom<pb::ReplayRun> for ReplayRun {
    type Error = ProtocolError;

    fn try_from(p: pb::ReplayRun) -> Result<Self, ProtocolError> {
        nonempty_range(p.file_off, p.len, "file_off")?;
        if p.phys_off.checked_add(p.len).is_none() {
            return Err(invalid("phys_off", "phys_off + len passes 2^64"));
        }
        Ok(ReplayRun {
            file_off: p.file_off,
            device: DeviceIndex(p.device),
            phys_off: p.phys_off,
            len: p.len,
        })
    }
}

impl From<ReplayRun> for pb::ReplayRun {
    fn from(r: ReplayRun) -> Self {
        pb::ReplayRun {
            file_off: r.file_off,
            device: r.device.0,
            phys_off: r.phys_off,
            len: r.len,
        }
    }
}

/// One lazily committed write completion of an earlier server epoch, as the agent kept it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplayRecord {
    pub inode: InodeId,
    /// The epoch whose Complete answered it, and its commit number there (> 0).
    pub epoch: SessionEpoch,
    pub commit_seq: u64,
    /// Not empty; every run lies inside it (the server checks the exact cover).
    pub range: ByteRange,
    /// Not empty.
    pub runs: Vec<ReplayRun>,
}

impl TryFrom<pb::ReplayRecord> for ReplayRecord {
    type Error = ProtocolError;

    fn try_from(p: pb::ReplayRecord) -> Result<Self, ProtocolError> {
        if p.commit_seq == 0 {
            return Err(ProtocolError::MissingField("commit_seq"));
        }
        let range = nonempty_range(p.offset, p.length, "offset")?;
        if p.runs.is_empty() {
            return Err(ProtocolError::MissingField("runs"));
        }
        if p.runs.len() > MAX_REPLAY_RUNS {
            return Err(invalid(
                "runs",
                format!("{} runs (at most {MAX_REPLAY_RUNS})", p.runs.len()),
            ));
        }
        let runs: Vec<ReplayRun> = list(p.runs, "runs")?;
        if runs
            .iter()
            .any(|r| r.file_off < range.offset() || r.file_off + r.len > range.end())
        {
            return Err(invalid("runs", "a run lies outside the record's range"));
        }
        Ok(ReplayRecord {
            inode: inode(p.inode, "inode")?,
            epoch: epoch(p.epoch)?,
            commit_seq: p.commit_seq,
            range,
            runs,
        })
    }
}

impl From<ReplayRecord> for pb::ReplayRecord {
    fn from(r: ReplayRecord) -> Self {
        pb::ReplayRecord {
            inode: r.inode.0,
            epoch: r.epoch.0,
            commit_seq: r.commit_seq,
            offset: r.range.offset(),
            length: r.range.len(),
            runs: to_pb(r.runs),
        }
    }
}

/// ReplayWrites: an agent's reclaim of lazy completions after a server restart.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplayWritesRequest {
    pub session: SessionId,
    pub epoch: SessionEpoch,
    /// The agent's last session of the previous server run.
    pub previous_session: SessionId,
    /// At most [`MAX_REPLAY_RECORDS`].
    pub records: Vec<ReplayRecord>,
    pub reclaim_complete: bool,
}

impl TryFrom<pb::ReplayWritesRequest> for ReplayWritesRequest {
    type Error = ProtocolError;

    fn try_from(p: pb::ReplayWritesRequest) -> Result<Self, ProtocolError> {
        if p.records.len() > MAX_REPLAY_RECORDS {
            return Err(invalid(
                "records",
                format!("{} records (at most {MAX_REPLAY_RECORDS})", p.records.len()),
            ));
        }
        if p.previous_session == 0 {
            return Err(ProtocolError::MissingField("previous_session"));
        }
        Ok(ReplayWritesRequest {
            session: session_id(p.session)?,
            epoch: epoch(p.epoch)?,
            previous_session: SessionId(p.previous_session),
            records: list(p.records, "records")?,
            reclaim_complete: p.reclaim_complete,
        })
    }
}

impl From<ReplayWritesRequest> for pb::ReplayWritesRequest {
    fn from(r: ReplayWritesRequest) -> Self {
        pb::ReplayWritesRequest {
            session: r.session.0,
            epoch: r.epoch.0,
            previous_session: r.previous_session.0,
            records: to_pb(r.records),
            reclaim_complete: r.reclaim_complete,
        }
    }
}

/// What became of one replayed record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplayOutcome {
    /// Written again, durably.
    Replayed,
    /// It had survived the restart.
    Durable,
    /// Lost: the file no longer maps those blocks there, or the reclaim window is over.
    Refused,
}

/// The answer to ReplayWrites: one outcome per record, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplayWritesReply {
    pub outcomes: Vec<ReplayOutcome>,
}

impl TryFrom<pb::ReplayWritesReply> for ReplayWritesReply {
    type Error = ProtocolError;

    fn try_from(p: pb::ReplayWritesReply) -> Result<Self, ProtocolError> {
        let outcomes = p
            .outcomes
            .into_iter()
            .map(
                |raw| match enum_field::<pb::ReplayOutcome>(raw, "outcomes")? {
                    pb::ReplayOutcome::Unspecified => Err(ProtocolError::MissingField("outcomes")),
                    pb::ReplayOutcome::Replayed => Ok(ReplayOutcome::Replayed),
                    pb::ReplayOutcome::Durable => Ok(ReplayOutcome::Durable),
                    pb::ReplayOutcome::Refused => Ok(ReplayOutcome::Refused),
                },
            )
            .collect::<Result<_, _>>()?;
        Ok(ReplayWritesReply { outcomes })
    }
}

impl From<ReplayWritesReply> for pb::ReplayWritesReply {
    fn from(r: ReplayWritesReply) -> Self {
        pb::ReplayWritesReply {
            outcomes: r
                .outcomes
                .into_iter()
                .map(|o| {
                    match o {
                        ReplayOutcome::Replayed => pb::ReplayOutcome::Replayed,
                        ReplayOutcome::Durable => pb::ReplayOutcome::Durable,
                        ReplayOutcome::Refused => pb::ReplayOutcome::Refused,
                    }
                    .into()
                })
                .collect(),
        }
    }
}

/// ReturnGrant: cached read grants given back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReturnGrantRequest {
    pub session: SessionId,
    pub epoch: SessionEpoch,
    /// At least one.
    pub grant_ids: Vec<GrantId>,
}

impl TryFrom<pb::ReturnGrantRequest> for ReturnGrantRequest {
    type Error = ProtocolError;

    fn try_from(p: pb::ReturnGrantRequest) -> Result<Self, ProtocolError> {
        Ok(ReturnGrantRequest {
            session: session_id(p.session)?,
            epoch: epoch(p.epoch)?,
            grant_ids: grant_ids(p.grant_ids, "grant_ids")?,
        })
    }
}

impl From<ReturnGrantRequest> for pb::ReturnGrantRequest {
    fn from(r: ReturnGrantRequest) -> Self {
        pb::ReturnGrantRequest {
            session: r.session.0,
            epoch: r.epoch.0,
            grant_ids: r.grant_ids.into_iter().map(|g| g.0).collect(),
        }
    }
}

/// The handle fields (`session`, `handle`) of a Data request.
pub(crate) fn handle_ref(session: u64, raw_handle: u64) -> Result<HandleRef, ProtocolError> {
    Ok(HandleRef {
        session: session_id(session)?,
        handle: handle(raw_handle)?,
    })
}

/// A range of at most [`MAX_INLINE_DATA`] bytes, not empty.
fn inline_range(offset: u64, len: u64) -> Result<ByteRange, ProtocolError> {
    if len > MAX_INLINE_DATA as u64 {
        return Err(invalid(
            "length",
            format!("{len} bytes is more than {MAX_INLINE_DATA} inline"),
        ));
    }
    nonempty_range(offset, len, "range")
}

/// Read on the proxied path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadRequest {
    pub cred: Credentials,
    pub handle: HandleRef,
    pub inode: InodeId,
    /// 1 to [`MAX_INLINE_DATA`] bytes.
    pub range: ByteRange,
}

impl TryFrom<pb::ReadRequest> for ReadRequest {
    type Error = ProtocolError;

    fn try_from(p: pb::ReadRequest) -> Result<Self, ProtocolError> {
        Ok(ReadRequest {
            cred: cred(p.cred)?,
            handle: handle_ref(p.session, p.handle)?,
            inode: inode(p.inode, "inode")?,
            range: inline_range(p.offset, p.length)?,
        })
    }
}

impl From<ReadRequest> for pb::ReadRequest {
    fn from(r: ReadRequest) -> Self {
        pb::ReadRequest {
            cred: Some(r.cred.into()),
            session: r.handle.session.0,
            handle: r.handle.handle.0,
            inode: r.inode.0,
            offset: r.range.offset(),
            length: r.range.len(),
        }
    }
}

/// The reply to a proxied Read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadReply {
    /// At most [`MAX_INLINE_DATA`] bytes; short only at the end of file.
    pub data: Vec<u8>,
    pub eof: bool,
}

impl TryFrom<pb::ReadReply> for ReadReply {
    type Error = ProtocolError;

    fn try_from(p: pb::ReadReply) -> Result<Self, ProtocolError> {
        Ok(ReadReply {
            data: payload(p.data, "data", MAX_INLINE_DATA)?,
            eof: p.eof,
        })
    }
}

impl From<ReadReply> for pb::ReadReply {
    fn from(r: ReadReply) -> Self {
        pb::ReadReply {
            data: r.data,
            eof: r.eof,
        }
    }
}

/// Where a proxied write goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WritePosition {
    At(u64),
    /// At the end of file, atomically (O_APPEND).
    Append,
}

/// Write on the proxied path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WriteRequest {
    pub cred: Credentials,
    pub handle: HandleRef,
    pub inode: InodeId,
    pub position: WritePosition,
    /// 1 to [`MAX_INLINE_DATA`] bytes; with `At(offset)`, `offset + len` is a valid range.
    pub data: Vec<u8>,
    pub sync: bool,
    /// Attribute changes applied right after the write, in its transaction (never with
    /// `Append`; no size, no ctime): `ServerInfo::write_sets_attr`.
    pub then: Option<SetAttr>,
}

impl TryFrom<pb::WriteRequest> for WriteRequest {
    type Error = ProtocolError;

    fn try_from(p: pb::WriteRequest) -> Result<Self, ProtocolError> {
        let data = payload(p.data, "data", MAX_INLINE_DATA)?;
        if data.is_empty() {
            return Err(invalid("data", "is empty"));
        }
        let position = if p.append {
            if p.offset != 0 {
                return Err(invalid("offset", "is set on an append"));
            }
            WritePosition::Append
        } else {
            byte_range(p.offset, data.len() as u64, "range")?;
            WritePosition::At(p.offset)
        };
        let then = p.then_set_attr.map(SetAttr::try_from).transpose()?;
        if let Some(t) = &then {
            if position == WritePosition::Append {
                return Err(invalid("then_set_attr", "is set on an append"));
            }
            if t.size.is_some() || t.ctime.is_some() {
                return Err(invalid("then_set_attr", "sets a size or a ctime"));
            }
        }
        Ok(WriteRequest {
            cred: cred(p.cred)?,
            handle: handle_ref(p.session, p.handle)?,
            inode: inode(p.inode, "inode")?,
            position,
            data,
            sync: p.sync,
            then,
        })
    }
}

impl From<WriteRequest> for pb::WriteRequest {
    fn from(r: WriteRequest) -> Self {
        let (offset, append) = match r.position {
            WritePosition::At(offset) => (offset, false),
            WritePosition::Append => (0, true),
        };
        pb::WriteRequest {
            cred: Some(r.cred.into()),
            session: r.handle.session.0,
            handle: r.handle.handle.0,
            inode: r.inode.0,
            offset,
            data: r.data,
            sync: r.sync,
            append,
            request_id: None,
            then_set_attr: r.then.map(Into::into),
        }
    }
}

/// The reply to a proxied Write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WriteReply {
    /// Where the bytes went; at most [`MAX_INLINE_DATA`] long.
    pub written: ByteRange,
    pub attr: Attr,
    /// Milliseconds of an attribute lease on the file given to the writer's session with
    /// the reply (0: none).
    pub lease_ms: u64,
}

impl TryFrom<pb::WriteReply> for WriteReply {
    type Error = ProtocolError;

    fn try_from(p: pb::WriteReply) -> Result<Self, ProtocolError> {
        if p.bytes_written > MAX_INLINE_DATA as u64 {
            return Err(invalid(
                "bytes_written",
                format!("{} is more than {MAX_INLINE_DATA}", p.bytes_written),
            ));
        }
        Ok(WriteReply {
            written: byte_range(p.offset, p.bytes_written, "written")?,
            attr: attr(p.attr)?,
            lease_ms: lease_ms(p.lease_ms)?,
        })
    }
}

impl From<WriteReply> for pb::WriteReply {
    fn from(r: WriteReply) -> Self {
        pb::WriteReply {
            offset: r.written.offset(),
            bytes_written: r.written.len(),
            attr: Some(r.attr.into()),
            lease_ms: r.lease_ms,
        }
    }
}

/// Delegate: whole-file caching rights on an open file (docs/protocol.md "Delegations").
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DelegateRequest {
    pub handle: HandleRef,
    pub inode: InodeId,
    pub epoch: SessionEpoch,
    /// Exclusive (write-back) rather than shared (read cache).
    pub write: bool,
    /// A reclaim after a restart: the agent's session of the last run that held the file's
    /// write delegation (only for a write delegation).
    pub reclaim_of: Option<SessionId>,
}

impl TryFrom<pb::DelegateRequest> for DelegateRequest {
    type Error = ProtocolError;

    fn try_from(p: pb::DelegateRequest) -> Result<Self, ProtocolError> {
        let reclaim_of = (p.reclaim_of != 0).then_some(SessionId(p.reclaim_of));
        if reclaim_of.is_some() && !p.write {
            return Err(ProtocolError::InvalidField {
                field: "reclaim_of",
                reason:
                    "only a write delegation is reclaimed (a read cache is dropped at a restart)"
                        .to_owned(),
            });
        }
        Ok(DelegateRequest {
            handle: handle_ref(p.session, p.handle)?,
            inode: inode(p.inode, "inode")?,
            epoch: epoch(p.epoch)?,
            write: p.write,
            reclaim_of,
        })
    }
}

impl From<DelegateRequest> for pb::DelegateRequest {
    fn from(r: DelegateRequest) -> Self {
        pb::DelegateRequest {
            session: r.handle.session.0,
            handle: r.handle.handle.0,
            inode: r.inode.0,
            epoch: r.epoch.0,
            write: r.write,
            reclaim_of: r.reclaim_of.map_or(0, |s| s.0),
        }
    }
}

/// The answer to Delegate: the delegation, or `None` when refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DelegateReply {
    pub delegation: Option<GrantId>,
}

impl TryFrom<pb::DelegateReply> for DelegateReply {
    type Error = ProtocolError;

    /// Every value is valid: 0 is a refusal.
    fn try_from(p: pb::DelegateReply) -> Result<Self, ProtocolError> {
        Ok(DelegateReply {
            delegation: (p.delegation != 0).then_some(GrantId(p.delegation)),
        })
    }
}

impl From<DelegateReply> for pb::DelegateReply {
    fn from(r: DelegateReply) -> Self {
        pb::DelegateReply {
            delegation: r.delegation.map_or(0, |g| g.0),
        }
    }
}

/// Fsync / fdatasync.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FsyncRequest {
    pub cred: Credentials,
    pub handle: HandleRef,
    pub inode: InodeId,
    pub data_only: bool,
}

impl TryFrom<pb::FsyncRequest> for FsyncRequest {
    type Error = ProtocolError;

    fn try_from(p: pb::FsyncRequest) -> Result<Self, ProtocolError> {
        Ok(FsyncRequest {
            cred: cred(p.cred)?,
            handle: handle_ref(p.session, p.handle)?,
            inode: inode(p.inode, "inode")?,
            data_only: p.data_only,
        })
    }
}

impl From<FsyncRequest> for pb::FsyncRequest {
    fn from(r: FsyncRequest) -> Self {
        pb::FsyncRequest {
            cred: Some(r.cred.into()),
            session: r.handle.session.0,
            handle: r.handle.handle.0,
            inode: r.inode.0,
            data_only: r.data_only,
        }
    }
}

/// What a fallocate does (the Linux mode flag combinations sanfs supports).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FallocateMode {
    /// Mode 0: allocate Unwritten blocks and extend the size.
    Allocate,
    /// FALLOC_FL_KEEP_SIZE.
    AllocateKeepSize,
    /// FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE.
    PunchHole,
    /// FALLOC_FL_ZERO_RANGE.
    ZeroRange,
    /// FALLOC_FL_ZERO_RANGE | FALLOC_FL_KEEP_SIZE.
    ZeroRangeKeepSize,
}

impl FallocateMode {
    /// The Linux `mode` argument of fallocate(2) for this mode.
    pub fn linux_flags(self) -> i32 {
        const KEEP_SIZE: i32 = 0x01;
        const PUNCH_HOLE: i32 = 0x02;
        const ZERO_RANGE: i32 = 0x10;
        match self {
            FallocateMode::Allocate => 0,
            FallocateMode::AllocateKeepSize => KEEP_SIZE,
            FallocateMode::PunchHole => PUNCH_HOLE | KEEP_SIZE,
            FallocateMode::ZeroRange => ZERO_RANGE,
            FallocateMode::ZeroRangeKeepSize => ZERO_RANGE | KEEP_SIZE,
        }
    }

    /// The mode for a Linux `mode` argument, if sanfs supports that combination.
    pub fn from_linux_flags(flags: i32) -> Option<FallocateMode> {
        [
            FallocateMode::Allocate,
            FallocateMode::AllocateKeepSize,
            FallocateMode::PunchHole,
            FallocateMode::ZeroRange,
            FallocateMode::ZeroRangeKeepSize,
        ]
        .into_iter()
        .find(|m| m.linux_flags() == flags)
    }
}

/// Fallocate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FallocateRequest {
    pub cred: Credentials,
    pub handle: HandleRef,
    pub inode: InodeId,
    /// Not empty.
    pub range: ByteRange,
    pub mode: FallocateMode,
}

impl TryFrom<pb::FallocateRequest> for FallocateRequest {
    type Error = ProtocolError;

    fn try_from(p: pb::FallocateRequest) -> Result<Self, ProtocolError> {
        let mode = match enum_field::<pb::FallocateMode>(p.mode, "mode")? {
            pb::FallocateMode::Unspecified => return Err(ProtocolError::MissingField("mode")),
            pb::FallocateMode::Allocate => FallocateMode::Allocate,
            pb::FallocateMode::AllocateKeepSize => FallocateMode::AllocateKeepSize,
            pb::FallocateMode::PunchHole => FallocateMode::PunchHole,
            pb::FallocateMode::ZeroRange => FallocateMode::ZeroRange,
            pb::FallocateMode::ZeroRangeKeepSize => FallocateMode::ZeroRangeKeepSize,
        };
        Ok(FallocateRequest {
            cred: cred(p.cred)?,
            handle: handle_ref(p.session, p.handle)?,
            inode: inode(p.inode, "inode")?,
            range: nonempty_range(p.offset, p.length, "range")?,
            mode,
        })
    }
}

impl From<FallocateRequest> for pb::FallocateRequest {
    fn from(r: FallocateRequest) -> Self {
        let mode = match r.mode {
            FallocateMode::Allocate => pb::FallocateMode::Allocate,
            FallocateMode::AllocateKeepSize => pb::FallocateMode::AllocateKeepSize,
            FallocateMode::PunchHole => pb::FallocateMode::PunchHole,
            FallocateMode::ZeroRange => pb::FallocateMode::ZeroRange,
            FallocateMode::ZeroRangeKeepSize => pb::FallocateMode::ZeroRangeKeepSize,
        };
        pb::FallocateRequest {
            cred: Some(r.cred.into()),
            session: r.handle.session.0,
            handle: r.handle.handle.0,
            inode: r.inode.0,
            offset: r.range.offset(),
            length: r.range.len(),
            mode: mode.into(),
        }
    }
}

/// GetExtents: the extent records of a range (`sanfs-agent bmap`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GetExtentsRequest {
    pub cred: Credentials,
    pub inode: InodeId,
    /// Not empty.
    pub range: ByteRange,
}

impl TryFrom<pb::GetExtentsRequest> for GetExtentsRequest {
    type Error = ProtocolError;

    fn try_from(p: pb::GetExtentsRequest) -> Result<Self, ProtocolError> {
        Ok(GetExtentsRequest {
            cred: cred(p.cred)?,
            inode: inode(p.inode, "inode")?,
            range: nonempty_range(p.offset, p.length, "range")?,
        })
    }
}

impl From<GetExtentsRequest> for pb::GetExtentsRequest {
    fn from(r: GetExtentsRequest) -> Self {
        pb::GetExtentsRequest {
            cred: Some(r.cred.into()),
            inode: r.inode.0,
            offset: r.range.offset(),
            length: r.range.len(),
        }
    }
}

pub use sanfs_blockmap::extent::ExtentState;

/// A contiguous piece of an extent on one LUN.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PhysPiece {
    pub device: DeviceIndex,
    pub phys_off: u64,
    pub len: u64,
}

/// One extent record with its physical mapping.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExtentMapping {
    /// Not empty.
    pub file_range: ByteRange,
    pub vol_off: u64,
    pub state: ExtentState,
    /// In volume order; their lengths add up to `file_range.len()`.
    pub pieces: Vec<PhysPiece>,
}

impl TryFrom<pb::ExtentMapping> for ExtentMapping {
    type Error = ProtocolError;

    fn try_from(p: pb::ExtentMapping) -> Result<Self, ProtocolError> {
        let file_range = nonempty_range(p.file_off, p.len, "file_range")?;
        if p.vol_off.checked_add(p.len).is_none() {
            return Err(invalid("vol_off", "vol_off + len overflows"));
        }
        let state = match enum_field::<pb::ExtentState>(p.state, "state")? {
            pb::ExtentState::Unspecified => return Err(ProtocolError::MissingField("state")),
            pb::ExtentState::Written => ExtentState::Written,
            pb::ExtentState::Unwritten => ExtentState::Unwritten,
        };
        let mut sum = 0u64;
        let mut pieces = Vec::with_capacity(p.pieces.len());
        for piece in p.pieces {
            if piece.len == 0 || piece.phys_off.checked_add(piece.len).is_none() {
                return Err(invalid("pieces", "a piece is empty or overflows"));
            }
            sum = sum
                .checked_add(piece.len)
                .ok_or_else(|| invalid("pieces", "lengths overflow"))?;
            pieces.push(PhysPiece {
                device: DeviceIndex(piece.device),
                phys_off: piece.phys_off,
                len: piece.len,
            });
        }
        if sum != p.len {
            return Err(invalid(
                "pieces",
                format!("pieces add up to {sum} bytes, the extent is {}", p.len),
            ));
        }
        Ok(ExtentMapping {
            file_range,
            vol_off: p.vol_off,
            state,
            pieces,
        })
    }
}

impl From<ExtentMapping> for pb::ExtentMapping {
    fn from(e: ExtentMapping) -> Self {
        let state = match e.state {
            ExtentState::Written => pb::ExtentState::Written,
            ExtentState::Unwritten => pb::ExtentState::Unwritten,
        };
        pb::ExtentMapping {
            file_off: e.file_range.offset(),
            len: e.file_range.len(),
            vol_off: e.vol_off,
            state: state.into(),
            pieces: e
                .pieces
                .into_iter()
                .map(|p| pb::PhysPiece {
                    device: p.device.0,
                    phys_off: p.phys_off,
                    len: p.len,
                })
                .collect(),
        }
    }
}

/// The reply to GetExtents.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GetExtentsReply {
    /// In file order, not overlapping.
    pub extents: Vec<ExtentMapping>,
    pub file_size: u64,
    pub block_size: u32,
}

impl TryFrom<pb::GetExtentsReply> for GetExtentsReply {
    type Error = ProtocolError;

    fn try_from(p: pb::GetExtentsReply) -> Result<Self, ProtocolError> {
        let extents: Vec<ExtentMapping> = list(p.extents, "extents")?;
        for pair in extents.windows(2) {
            if let [a, b] = pair
                && b.file_range.offset() < a.file_range.end()
            {
                return Err(invalid(
                    "extents",
                    format!(
                        "extent at {} overlaps or precedes the one before it",
                        b.file_range.offset()
                    ),
                ));
            }
        }
        if p.file_size > MAX_FILE_SIZE {
            return Err(invalid("file_size", "passes the largest file size"));
        }
        Ok(GetExtentsReply {
            extents,
            file_size: p.file_size,
            block_size: super::session::block_size(p.block_size, "block_size")?,
        })
    }
}

impl From<GetExtentsReply> for pb::GetExtentsReply {
    fn from(r: GetExtentsReply) -> Self {
        pb::GetExtentsReply {
            extents: to_pb(r.extents),
            file_size: r.file_size,
            block_size: r.block_size,
        }
    }
}
