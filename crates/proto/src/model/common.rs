//! Conversions of the messages shared by all services: credentials, timestamps, file types,
//! attributes, setattr changes, rename and xattr modes, and device ids.

use sanfs_blockmap::volume::{DeviceId, LvmPvId};
use uuid::Uuid;

use super::{At, MAX_GROUPS, enum_field, inode, invalid, perm, required, required_msg};
use crate::pb;
use crate::types::{
    Attr, Credentials, FileType, MAX_FILE_SIZE, ProtocolError, RenameMode, SetAttr, TimeSet,
    Timestamp, XattrMode,
};

impl TryFrom<pb::Credentials> for Credentials {
    type Error = ProtocolError;

    fn try_from(p: pb::Credentials) -> Result<Credentials, ProtocolError> {
        if p.groups.len() > MAX_GROUPS {
            return Err(invalid(
                "groups",
                format!(
                    "{} supplementary groups (at most {MAX_GROUPS})",
                    p.groups.len()
                ),
            ));
        }
        Ok(Credentials {
            uid: p.uid,
            gid: p.gid,
            groups: p.groups,
        })
    }
}

impl From<Credentials> for pb::Credentials {
    fn from(c: Credentials) -> pb::Credentials {
        pb::Credentials {
            uid: c.uid,
            gid: c.gid,
            groups: c.groups,
        }
    }
}

/// The `cred` field every user-acting request carries.
pub(crate) fn cred(p: Option<pb::Credentials>) -> Result<Credentials, ProtocolError> {
    required_msg(p, "cred")
}

impl TryFrom<pb::Timestamp> for Timestamp {
    type Error = ProtocolError;

    fn try_from(p: pb::Timestamp) -> Result<Timestamp, ProtocolError> {
        Timestamp::new(p.sec, p.nsec)
    }
}

impl From<Timestamp> for pb::Timestamp {
    fn from(t: Timestamp) -> pb::Timestamp {
        pb::Timestamp {
            sec: t.sec,
            nsec: t.nsec,
        }
    }
}

/// A `FileType` enum field.
pub(crate) fn file_type(raw: i32, field: &'static str) -> Result<FileType, ProtocolError> {
    Ok(match enum_field::<pb::FileType>(raw, field)? {
        pb::FileType::Unspecified => return Err(ProtocolError::MissingField(field)),
        pb::FileType::Regular => FileType::Regular,
        pb::FileType::Directory => FileType::Directory,
        pb::FileType::Symlink => FileType::Symlink,
        pb::FileType::Fifo => FileType::Fifo,
        pb::FileType::Socket => FileType::Socket,
        pb::FileType::CharDevice => FileType::CharDevice,
        pb::FileType::BlockDevice => FileType::BlockDevice,
    })
}

impl From<FileType> for pb::FileType {
    fn from(t: FileType) -> pb::FileType {
        match t {
            FileType::Regular => pb::FileType::Regular,
            FileType::Directory => pb::FileType::Directory,
            FileType::Symlink => pb::FileType::Symlink,
            FileType::Fifo => pb::FileType::Fifo,
            FileType::Socket => pb::FileType::Socket,
            FileType::CharDevice => pb::FileType::CharDevice,
            FileType::BlockDevice => pb::FileType::BlockDevice,
        }
    }
}

impl TryFrom<pb::Attr> for Attr {
    type Error = ProtocolError;

    fn try_from(p: pb::Attr) -> Result<Attr, ProtocolError> {
        if p.size > MAX_FILE_SIZE {
            return Err(invalid(
                "size",
                format!("{} passes the largest file size", p.size),
            ));
        }
        Ok(Attr {
            ino: inode(p.ino, "ino")?,
            kind: file_type(p.kind, "kind")?,
            perm: perm(p.perm, "perm")?,
            nlink: p.nlink,
            uid: p.uid,
            gid: p.gid,
            size: p.size,
            allocated: p.allocated,
            atime: required_msg(p.atime, "atime")?,
            mtime: required_msg(p.mtime, "mtime")?,
            ctime: required_msg(p.ctime, "ctime")?,
            btime: required_msg(p.btime, "btime")?,
            rdev: p.rdev,
            generation: p.generation,
            no_xattrs: p.no_xattrs,
        })
    }
}

impl From<Attr> for pb::Attr {
    fn from(a: Attr) -> pb::Attr {
        pb::Attr {
            ino: a.ino.0,
            kind: pb::FileType::from(a.kind).into(),
            perm: a.perm,
            nlink: a.nlink,
            uid: a.uid,
            gid: a.gid,
            size: a.size,
            allocated: a.allocated,
            atime: Some(a.atime.into()),
            mtime: Some(a.mtime.into()),
            ctime: Some(a.ctime.into()),
            btime: Some(a.btime.into()),
            rdev: a.rdev,
            generation: a.generation,
            no_xattrs: a.no_xattrs,
        }
    }
}

/// The `attr` field of a reply.
pub(crate) fn attr(p: Option<pb::Attr>) -> Result<Attr, ProtocolError> {
    required_msg(p, "attr")
}

impl TryFrom<pb::TimeSet> for TimeSet {
    type Error = ProtocolError;

    fn try_from(p: pb::TimeSet) -> Result<TimeSet, ProtocolError> {
        match required(p.value, "value")? {
            pb::time_set::Value::Now(true) => Ok(TimeSet::Now),
            pb::time_set::Value::Now(false) => Err(invalid("now", "is set but false")),
            pb::time_set::Value::At(t) => Ok(TimeSet::At(Timestamp::try_from(t).at("at")?)),
        }
    }
}

impl From<TimeSet> for pb::TimeSet {
    fn from(t: TimeSet) -> pb::TimeSet {
        pb::TimeSet {
            value: Some(match t {
                TimeSet::Now => pb::time_set::Value::Now(true),
                TimeSet::At(at) => pb::time_set::Value::At(at.into()),
            }),
        }
    }
}

impl TryFrom<pb::SetAttrChanges> for SetAttr {
    type Error = ProtocolError;

    fn try_from(p: pb::SetAttrChanges) -> Result<SetAttr, ProtocolError> {
        if let Some(size) = p.size
            && size > MAX_FILE_SIZE
        {
            return Err(ProtocolError::RangeOverflow {
                offset: size,
                len: 0,
            }
            .in_field("size"));
        }
        Ok(SetAttr {
            perm: p.perm.map(|m| perm(m, "perm")).transpose()?,
            uid: p.uid,
            gid: p.gid,
            size: p.size,
            atime: p.atime.map(TimeSet::try_from).transpose().at("atime")?,
            mtime: p.mtime.map(TimeSet::try_from).transpose().at("mtime")?,
            ctime: p.ctime.map(Timestamp::try_from).transpose().at("ctime")?,
        })
    }
}

impl From<SetAttr> for pb::SetAttrChanges {
    fn from(s: SetAttr) -> pb::SetAttrChanges {
        pb::SetAttrChanges {
            perm: s.perm,
            uid: s.uid,
            gid: s.gid,
            size: s.size,
            atime: s.atime.map(Into::into),
            mtime: s.mtime.map(Into::into),
            ctime: s.ctime.map(Into::into),
        }
    }
}

pub(crate) fn rename_mode(raw: i32) -> Result<RenameMode, ProtocolError> {
    Ok(match enum_field::<pb::RenameMode>(raw, "mode")? {
        pb::RenameMode::Unspecified => return Err(ProtocolError::MissingField("mode")),
        pb::RenameMode::Replace => RenameMode::Replace,
        pb::RenameMode::Noreplace => RenameMode::NoReplace,
        pb::RenameMode::Exchange => RenameMode::Exchange,
    })
}

impl From<RenameMode> for pb::RenameMode {
    fn from(m: RenameMode) -> pb::RenameMode {
        match m {
            RenameMode::Replace => pb::RenameMode::Replace,
            RenameMode::NoReplace => pb::RenameMode::Noreplace,
            RenameMode::Exchange => pb::RenameMode::Exchange,
        }
    }
}

pub(crate) fn xattr_mode(raw: i32) -> Result<XattrMode, ProtocolError> {
    Ok(match enum_field::<pb::XattrMode>(raw, "mode")? {
        pb::XattrMode::Unspecified => return Err(ProtocolError::MissingField("mode")),
        pb::XattrMode::Either => XattrMode::Either,
        pb::XattrMode::Create => XattrMode::Create,
        pb::XattrMode::Replace => XattrMode::Replace,
    })
}

impl From<XattrMode> for pb::XattrMode {
    fn from(m: XattrMode) -> pb::XattrMode {
        match m {
            XattrMode::Either => pb::XattrMode::Either,
            XattrMode::Create => pb::XattrMode::Create,
            XattrMode::Replace => pb::XattrMode::Replace,
        }
    }
}

/// A 16-byte UUID field; the nil UUID is refused.
pub(crate) fn uuid(bytes: &[u8], field: &'static str) -> Result<Uuid, ProtocolError> {
    let u = Uuid::from_slice(bytes)
        .map_err(|_| invalid(field, format!("is {} bytes, not 16", bytes.len())))?;
    if u.is_nil() {
        return Err(ProtocolError::MissingField(field));
    }
    Ok(u)
}

impl TryFrom<pb::DeviceId> for DeviceId {
    type Error = ProtocolError;

    fn try_from(p: pb::DeviceId) -> Result<DeviceId, ProtocolError> {
        match required(p.id, "id")? {
            pb::device_id::Id::SanfsUuid(bytes) => Ok(DeviceId::Sanfs(uuid(&bytes, "sanfs_uuid")?)),
            pb::device_id::Id::LvmPvId(text) => LvmPvId::parse(&text)
                .map(DeviceId::LvmPv)
                .ok_or_else(|| invalid("lvm_pv_id", "is not 32 characters [0-9A-Za-z]")),
        }
    }
}

impl From<DeviceId> for pb::DeviceId {
    fn from(d: DeviceId) -> pb::DeviceId {
        pb::DeviceId {
            id: Some(match d {
                DeviceId::Sanfs(u) => pb::device_id::Id::SanfsUuid(u.as_bytes().to_vec()),
                DeviceId::LvmPv(p) => pb::device_id::Id::LvmPvId(p.to_string()),
            }),
        }
    }
}
