//! The Locks service: cluster-wide POSIX advisory record locks.

use sanfs_blockmap::advisory::LockKind;

use super::common::cred;
use super::data::handle_ref;
use super::{At, HandleRef, enum_field, inode, invalid, required_msg};
use crate::pb;
use crate::types::{Credentials, InodeId, ProtocolError};

/// The longest wait one SetLock may ask for; an F_SETLKW agent asks again.
pub const MAX_LOCK_WAIT_MS: u32 = 60_000;

/// What a lock request wants: a read or write lock, or the range unlocked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LockType {
    Lock(LockKind),
    Unlock,
}

/// A byte range lock `[start, end]` (inclusive; `end == u64::MAX` is to the end of any file).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileLock {
    pub typ: LockType,
    pub start: u64,
    pub end: u64,
    pub pid: u32,
}

/// GetLock and SetLock.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LockRequest {
    pub cred: Credentials,
    pub handle: HandleRef,
    pub inode: InodeId,
    /// Not 0.
    pub owner: u64,
    pub lock: FileLock,
    /// At most [`MAX_LOCK_WAIT_MS`].
    pub wait_ms: u32,
    pub reclaim: bool,
}

/// GetLock's answer: the conflicting lock, if any (never `Unlock`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GetLockReply {
    pub conflict: Option<FileLock>,
}

fn lock_type(raw: i32) -> Result<LockType, ProtocolError> {
    Ok(match enum_field::<pb::LockType>(raw, "type")? {
        pb::LockType::Unspecified => return Err(ProtocolError::MissingField("type")),
        pb::LockType::Read => LockType::Lock(LockKind::Read),
        pb::LockType::Write => LockType::Lock(LockKind::Write),
        pb::LockType::Unlock => LockType::Unlock,
    })
}

impl TryFrom<pb::FileLock> for FileLock {
    type Error = ProtocolError;

    fn try_from(p: pb::FileLock) -> Result<FileLock, ProtocolError> {
        if p.start > p.end {
            return Err(invalid(
                "end",
                format!("range ends ({}) before it starts ({})", p.end, p.start),
            ));
        }
        Ok(FileLock {
            typ: lock_type(p.r#type)?,
            start: p.start,
            end: p.end,
            pid: p.pid,
        })
    }
}

impl From<FileLock> for pb::FileLock {
    fn from(l: FileLock) -> pb::FileLock {
        let typ = match l.typ {
            LockType::Lock(LockKind::Read) => pb::LockType::Read,
            LockType::Lock(LockKind::Write) => pb::LockType::Write,
            LockType::Unlock => pb::LockType::Unlock,
        };
        pb::FileLock {
            r#type: typ as i32,
            start: l.start,
            end: l.end,
            pid: l.pid,
        }
    }
}

impl TryFrom<pb::LockRequest> for LockRequest {
    type Error = ProtocolError;

    fn try_from(p: pb::LockRequest) -> Result<LockRequest, ProtocolError> {
        if p.owner == 0 {
            return Err(ProtocolError::MissingField("owner"));
        }
        if p.wait_ms > MAX_LOCK_WAIT_MS {
            return Err(invalid(
                "wait_ms",
                format!("{} ms (at most {MAX_LOCK_WAIT_MS})", p.wait_ms),
            ));
        }
        Ok(LockRequest {
            cred: cred(p.cred)?,
            handle: handle_ref(p.session, p.handle)?,
            inode: inode(p.inode, "inode")?,
            owner: p.owner,
            lock: required_msg(p.lock, "lock")?,
            wait_ms: p.wait_ms,
            reclaim: p.reclaim,
        })
    }
}

impl From<LockRequest> for pb::LockRequest {
    fn from(r: LockRequest) -> pb::LockRequest {
        pb::LockRequest {
            cred: Some(r.cred.into()),
            session: r.handle.session.0,
            handle: r.handle.handle.0,
            inode: r.inode.0,
            owner: r.owner,
            lock: Some(r.lock.into()),
            wait_ms: r.wait_ms,
            reclaim: r.reclaim,
        }
    }
}

impl TryFrom<pb::GetLockReply> for GetLockReply {
    type Error = ProtocolError;

    fn try_from(p: pb::GetLockReply) -> Result<GetLockReply, ProtocolError> {
        let conflict = p
            .conflict
            .map(|c| FileLock::try_from(c).at("conflict"))
            .transpose()?;
        if conflict.is_some_and(|c| c.typ == LockType::Unlock) {
            return Err(invalid("conflict", "a conflict is a read or write lock"));
        }
        Ok(GetLockReply { conflict })
    }
}

impl From<GetLockReply> for pb::GetLockReply {
    fn from(r: GetLockReply) -> pb::GetLockReply {
        pb::GetLockReply {
            conflict: r.conflict.map(Into::into),
        }
    }
}
