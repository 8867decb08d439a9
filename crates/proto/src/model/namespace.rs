//! The Namespace service: lookups, attributes, creating and removing names, directories,
//! symlinks, extended attributes, open handles and permission checks.
//!
//! Several RPCs share one domain shape (`EntryRequest` for Lookup, Unlink and Rmdir;
//! `InodeRequest` for GetAttr, Readlink, StatFs, ListXattr and GetQuota; a bare
//! [`Attr`] for the replies that only carry attributes); the conversions exist for each of
//! their wire messages.

use super::common::{attr, cred, file_type, rename_mode, xattr_mode};
use super::{
    At, FIRST_DIR_COOKIE, MAX_INLINE_DATA, MAX_READDIR_ENTRIES, file_name, handle, inode, invalid,
    list, payload, perm, required_msg, session_id, to_pb,
};
use crate::pb;
use crate::types::{
    Attr, Credentials, FileName, FileType, GrantId, InodeId, NAME_MAX, OpenHandle, ProtocolError,
    RenameMode, SessionId, SetAttr, SymlinkTarget, Timestamp, XATTR_SIZE_MAX, XattrMode, XattrName,
};

/// A request naming one directory entry: Lookup, Unlink, Rmdir.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EntryRequest {
    pub cred: Credentials,
    pub parent: InodeId,
    pub name: FileName,
}

pub type LookupRequest = EntryRequest;
pub type UnlinkRequest = EntryRequest;
pub type RmdirRequest = EntryRequest;

macro_rules! entry_request {
    ($($pb:ident),*) => {$(
        impl TryFrom<pb::$pb> for EntryRequest {
            type Error = ProtocolError;

            fn try_from(p: pb::$pb) -> Result<Self, ProtocolError> {
                Ok(EntryRequest {
                    cred: cred(p.cred)?,
                    parent: inode(p.parent, "parent")?,
                    name: file_name(p.name, "name")?,
                })
            }
        }

        // Lookup has no `request_id`; Unlink and Rmdir leave theirs unset (the agent sets it).
        #[allow(clippy::needless_update, reason = "one macro for messages with and without request_id")]
        impl From<EntryRequest> for pb::$pb {
            fn from(r: EntryRequest) -> Self {
                pb::$pb {
                    cred: Some(r.cred.into()),
                    parent: r.parent.0,
                    name: r.name.into_bytes(),
                    ..Default::default()
                }
            }
        }
    )*};
}
entry_request!(LookupRequest, UnlinkRequest, RmdirRequest);

/// A request about one inode: GetAttr, Readlink, StatFs, ListXattr, GetQuota.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InodeRequest {
    pub cred: Credentials,
    pub inode: InodeId,
}

/// GetAttr: an [`InodeRequest`] and, optionally, the caller's session (whose own write
/// delegation on the inode is then not recalled).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GetAttrRequest {
    pub cred: Credentials,
    pub inode: InodeId,
    pub session: Option<SessionId>,
}

impl TryFrom<pb::GetAttrRequest> for GetAttrRequest {
    type Error = ProtocolError;

    fn try_from(p: pb::GetAttrRequest) -> Result<Self, ProtocolError> {
        Ok(GetAttrRequest {
            cred: cred(p.cred)?,
            inode: inode(p.inode, "inode")?,
            session: p.session.map(session_id).transpose()?,
        })
    }
}

impl From<GetAttrRequest> for pb::GetAttrRequest {
    fn from(r: GetAttrRequest) -> Self {
        pb::GetAttrRequest {
            cred: Some(r.cred.into()),
            inode: r.inode.0,
            session: r.session.map(|s| s.0),
        }
    }
}

pub type ReadlinkRequest = InodeRequest;
pub type StatFsRequest = InodeRequest;
pub type ListXattrRequest = InodeRequest;
pub type GetQuotaRequest = InodeRequest;

macro_rules! inode_request {
    ($($pb:ident),*) => {$(
        impl TryFrom<pb::$pb> for InodeRequest {
            type Error = ProtocolError;

            fn try_from(p: pb::$pb) -> Result<Self, ProtocolError> {
                Ok(InodeRequest {
                    cred: cred(p.cred)?,
                    inode: inode(p.inode, "inode")?,
                })
            }
        }

        impl From<InodeRequest> for pb::$pb {
            fn from(r: InodeRequest) -> Self {
                pb::$pb {
                    cred: Some(r.cred.into()),
                    inode: r.inode.0,
                }
            }
        }
    )*};
}
inode_request!(
    ReadlinkRequest,
    StatFsRequest,
    ListXattrRequest,
    GetQuotaRequest
);

macro_rules! attr_reply {
    ($($pb:ident),*) => {$(
        impl TryFrom<pb::$pb> for Attr {
            type Error = ProtocolError;

            fn try_from(p: pb::$pb) -> Result<Self, ProtocolError> {
                attr(p.attr)
            }
        }

        // Lookup, GetAttr and SetAttr replies also carry a lease term (0 here: see [`Leased`]).
        #[allow(clippy::needless_update, reason = "one macro for replies with and without lease_ms")]
        impl From<Attr> for pb::$pb {
            fn from(a: Attr) -> Self {
                pb::$pb { attr: Some(a.into()), ..Default::default() }
            }
        }
    )*};
}
attr_reply!(
    LookupReply,
    GetAttrReply,
    SetAttrReply,
    MkdirReply,
    MknodReply,
    LinkReply,
    SymlinkReply,
    FallocateReply
);

/// An open handle and the session that owns it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HandleRef {
    pub session: SessionId,
    pub handle: OpenHandle,
}

/// Release closes an open handle.
pub type ReleaseRequest = HandleRef;

impl TryFrom<pb::ReleaseRequest> for HandleRef {
    type Error = ProtocolError;

    fn try_from(p: pb::ReleaseRequest) -> Result<Self, ProtocolError> {
        Ok(HandleRef {
            session: session_id(p.session)?,
            handle: handle(p.handle)?,
        })
    }
}

impl From<HandleRef> for pb::ReleaseRequest {
    fn from(r: HandleRef) -> Self {
        pb::ReleaseRequest {
            session: r.session.0,
            handle: r.handle.0,
        }
    }
}

/// SetAttr (and truncate, which is a SetAttr of the size).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SetAttrRequest {
    pub cred: Credentials,
    pub inode: InodeId,
    pub changes: SetAttr,
    /// The open handle of an ftruncate: permission is checked against its open mode.
    pub handle: Option<HandleRef>,
}

impl TryFrom<pb::SetAttrRequest> for SetAttrRequest {
    type Error = ProtocolError;

    fn try_from(p: pb::SetAttrRequest) -> Result<Self, ProtocolError> {
        let handle = match (p.handle, p.session) {
            (None, None) => None,
            (Some(h), Some(s)) => Some(HandleRef {
                session: session_id(s)?,
                handle: handle(h)?,
            }),
            (Some(_), None) => return Err(ProtocolError::MissingField("session")),
            (None, Some(_)) => return Err(invalid("session", "is set without a handle")),
        };
        Ok(SetAttrRequest {
            cred: cred(p.cred)?,
            inode: inode(p.inode, "inode")?,
            changes: required_msg(p.changes, "changes")?,
            handle,
        })
    }
}

impl From<SetAttrRequest> for pb::SetAttrRequest {
    fn from(r: SetAttrRequest) -> Self {
        pb::SetAttrRequest {
            cred: Some(r.cred.into()),
            inode: r.inode.0,
            changes: Some(r.changes.into()),
            handle: r.handle.map(|h| h.handle.0),
            session: r.handle.map(|h| h.session.0),
        }
    }
}

/// How a file is opened. At least one of `read` and `write`; `append` and `truncate` need
/// `write`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpenFlags {
    pub read: bool,
    pub write: bool,
    pub append: bool,
    pub truncate: bool,
}

impl TryFrom<pb::OpenFlags> for OpenFlags {
    type Error = ProtocolError;

    fn try_from(p: pb::OpenFlags) -> Result<Self, ProtocolError> {
        if !p.read && !p.write {
            return Err(invalid("flags", "neither read nor write"));
        }
        if (p.append || p.truncate) && !p.write {
            return Err(invalid("flags", "append or truncate without write"));
        }
        Ok(OpenFlags {
            read: p.read,
            write: p.write,
            append: p.append,
            truncate: p.truncate,
        })
    }
}

impl From<OpenFlags> for pb::OpenFlags {
    fn from(f: OpenFlags) -> Self {
        pb::OpenFlags {
            read: f.read,
            write: f.write,
            append: f.append,
            truncate: f.truncate,
        }
    }
}

/// Create: create (or open) a regular file and open it for `session`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CreateRequest {
    pub cred: Credentials,
    pub session: SessionId,
    pub parent: InodeId,
    pub name: FileName,
    /// Final permission bits: the agent applied the umask.
    pub perm: u32,
    pub exclusive: bool,
    pub flags: OpenFlags,
    /// Ask for the new file's write delegation with the reply.
    pub delegate: bool,
    /// The inode number the agent gave the file from its session's reservation
    /// ([`ReserveInodesReply`]); `None`: the server picks one.
    pub inode: Option<InodeId>,
    /// With `inode` only: when the agent answered the create (the times its application
    /// saw); `None`: the server's clock.
    pub time: Option<Timestamp>,
}

/// The handle a file created with an agent-chosen inode number is opened under
/// ([`CreateRequest::inode`]): the number with the top bit set (the server's own handles
/// count up from 1 and never reach it).
pub fn reserved_create_handle(ino: InodeId) -> OpenHandle {
    OpenHandle(ino.0 | RESERVED_HANDLE_BIT)
}

/// The bit that marks [`reserved_create_handle`]s.
pub const RESERVED_HANDLE_BIT: u64 = 1 << 63;

/// The inode a [`reserved_create_handle`] was opened for; `None` for the server's own
/// handle numbers.
pub fn reserved_create_inode(handle: u64) -> Option<InodeId> {
    (handle & RESERVED_HANDLE_BIT != 0).then_some(InodeId(handle & !RESERVED_HANDLE_BIT))
}

impl TryFrom<pb::CreateRequest> for CreateRequest {
    type Error = ProtocolError;

    fn try_from(p: pb::CreateRequest) -> Result<Self, ProtocolError> {
        Ok(CreateRequest {
            cred: cred(p.cred)?,
            session: session_id(p.session)?,
            parent: inode(p.parent, "parent")?,
            name: file_name(p.name, "name")?,
            perm: perm(p.perm, "perm")?,
            exclusive: p.exclusive,
            flags: required_msg(p.flags, "flags")?,
            delegate: p.delegate,
            inode: match p.inode {
                0 => None,
                n if !p.exclusive => {
                    return Err(invalid(
                        "inode",
                        format!("{n}: a create with a reserved number must be exclusive"),
                    ));
                }
                n if n & RESERVED_HANDLE_BIT != 0 => {
                    return Err(invalid("inode", format!("{n} has the top bit set")));
                }
                n => Some(InodeId(n)),
            },
            time: match p.time {
                Some(_) if p.inode == 0 => {
                    return Err(invalid(
                        "time",
                        "only a create with a reserved number gives its time",
                    ));
                }
                t => t.map(Timestamp::try_from).transpose()?,
            },
        })
    }
}

impl From<CreateRequest> for pb::CreateRequest {
    fn from(r: CreateRequest) -> Self {
        pb::CreateRequest {
            cred: Some(r.cred.into()),
            session: r.session.0,
            parent: r.parent.0,
            name: r.name.into_bytes(),
            perm: r.perm,
            exclusive: r.exclusive,
            flags: Some(r.flags.into()),
            delegate: r.delegate,
            inode: r.inode.map_or(0, |i| i.0),
            time: r.time.map(Into::into),
            request_id: None,
        }
    }
}

/// The reply to Create.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CreateReply {
    pub attr: Attr,
    pub handle: OpenHandle,
    /// False when an existing file was opened (no `exclusive`).
    pub created: bool,
    /// The term of the leases given with the reply (the file's attributes, the parent's
    /// names), 0 for none.
    pub lease_ms: u64,
    /// The new file's write delegation (asked for with `CreateRequest::delegate`).
    pub delegation: Option<GrantId>,
}

impl TryFrom<pb::CreateReply> for CreateReply {
    type Error = ProtocolError;

    fn try_from(p: pb::CreateReply) -> Result<Self, ProtocolError> {
        let attr = attr(p.attr)?;
        if attr.kind != FileType::Regular {
            return Err(invalid("attr", "Create returned a non-regular file"));
        }
        Ok(CreateReply {
            attr,
            handle: handle(p.handle)?,
            created: p.created,
            lease_ms: lease_ms(p.lease_ms)?,
            delegation: (p.delegation != 0).then_some(GrantId(p.delegation)),
        })
    }
}

impl From<CreateReply> for pb::CreateReply {
    fn from(r: CreateReply) -> Self {
        pb::CreateReply {
            attr: Some(r.attr.into()),
            handle: r.handle.0,
            created: r.created,
            lease_ms: r.lease_ms,
            delegation: r.delegation.map_or(0, |g| g.0),
        }
    }
}

/// Mkdir.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MkdirRequest {
    pub cred: Credentials,
    pub parent: InodeId,
    pub name: FileName,
    /// Final permission bits: the agent applied the umask.
    pub perm: u32,
    /// Ask for the new directory's create delegation (docs/protocol.md "Creates answered by
    /// the agent").
    pub delegate: bool,
}

impl TryFrom<pb::MkdirRequest> for MkdirRequest {
    type Error = ProtocolError;

    fn try_from(p: pb::MkdirRequest) -> Result<Self, ProtocolError> {
        Ok(MkdirRequest {
            cred: cred(p.cred)?,
            parent: inode(p.parent, "parent")?,
            name: file_name(p.name, "name")?,
            perm: perm(p.perm, "perm")?,
            delegate: p.delegate,
        })
    }
}

impl From<MkdirRequest> for pb::MkdirRequest {
    fn from(r: MkdirRequest) -> Self {
        pb::MkdirRequest {
            cred: Some(r.cred.into()),
            parent: r.parent.0,
            name: r.name.into_bytes(),
            perm: r.perm,
            delegate: r.delegate,
            request_id: None,
        }
    }
}

/// Mknod: a regular file, FIFO, socket or device node (not a directory or symlink).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MknodRequest {
    pub cred: Credentials,
    pub parent: InodeId,
    pub name: FileName,
    pub kind: FileType,
    /// Final permission bits: the agent applied the umask.
    pub perm: u32,
    /// Device number; 0 unless `kind` is a character or block device.
    pub rdev: u64,
}

impl TryFrom<pb::MknodRequest> for MknodRequest {
    type Error = ProtocolError;

    fn try_from(p: pb::MknodRequest) -> Result<Self, ProtocolError> {
        let kind = file_type(p.kind, "kind")?;
        match kind {
            FileType::Directory | FileType::Symlink => {
                return Err(invalid("kind", "mknod cannot make a directory or symlink"));
            }
            FileType::CharDevice | FileType::BlockDevice => {}
            FileType::Regular | FileType::Fifo | FileType::Socket => {
                if p.rdev != 0 {
                    return Err(invalid("rdev", "is set for a node that is not a device"));
                }
            }
        }
        Ok(MknodRequest {
            cred: cred(p.cred)?,
            parent: inode(p.parent, "parent")?,
            name: file_name(p.name, "name")?,
            kind,
            perm: perm(p.perm, "perm")?,
            rdev: p.rdev,
        })
    }
}

impl From<MknodRequest> for pb::MknodRequest {
    fn from(r: MknodRequest) -> Self {
        pb::MknodRequest {
            cred: Some(r.cred.into()),
            parent: r.parent.0,
            name: r.name.into_bytes(),
            kind: pb::FileType::from(r.kind).into(),
            perm: r.perm,
            rdev: r.rdev,
            request_id: None,
        }
    }
}

/// Rename (renameat2).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RenameRequest {
    pub cred: Credentials,
    pub old_parent: InodeId,
    pub old_name: FileName,
    pub new_parent: InodeId,
    pub new_name: FileName,
    pub mode: RenameMode,
}

impl TryFrom<pb::RenameRequest> for RenameRequest {
    type Error = ProtocolError;

    fn try_from(p: pb::RenameRequest) -> Result<Self, ProtocolError> {
        Ok(RenameRequest {
            cred: cred(p.cred)?,
            old_parent: inode(p.old_parent, "old_parent")?,
            old_name: file_name(p.old_name, "old_name")?,
            new_parent: inode(p.new_parent, "new_parent")?,
            new_name: file_name(p.new_name, "new_name")?,
            mode: rename_mode(p.mode)?,
        })
    }
}

impl From<RenameRequest> for pb::RenameRequest {
    fn from(r: RenameRequest) -> Self {
        pb::RenameRequest {
            cred: Some(r.cred.into()),
            old_parent: r.old_parent.0,
            old_name: r.old_name.into_bytes(),
            new_parent: r.new_parent.0,
            new_name: r.new_name.into_bytes(),
            mode: pb::RenameMode::from(r.mode).into(),
            request_id: None,
        }
    }
}

/// Link: a new name for an existing inode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinkRequest {
    pub cred: Credentials,
    pub inode: InodeId,
    pub new_parent: InodeId,
    pub new_name: FileName,
}

impl TryFrom<pb::LinkRequest> for LinkRequest {
    type Error = ProtocolError;

    fn try_from(p: pb::LinkRequest) -> Result<Self, ProtocolError> {
        Ok(LinkRequest {
            cred: cred(p.cred)?,
            inode: inode(p.inode, "inode")?,
            new_parent: inode(p.new_parent, "new_parent")?,
            new_name: file_name(p.new_name, "new_name")?,
        })
    }
}

impl From<LinkRequest> for pb::LinkRequest {
    fn from(r: LinkRequest) -> Self {
        pb::LinkRequest {
            cred: Some(r.cred.into()),
            inode: r.inode.0,
            new_parent: r.new_parent.0,
            new_name: r.new_name.into_bytes(),
            request_id: None,
        }
    }
}

/// Symlink.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SymlinkRequest {
    pub cred: Credentials,
    pub parent: InodeId,
    pub name: FileName,
    pub target: SymlinkTarget,
}

impl TryFrom<pb::SymlinkRequest> for SymlinkRequest {
    type Error = ProtocolError;

    fn try_from(p: pb::SymlinkRequest) -> Result<Self, ProtocolError> {
        Ok(SymlinkRequest {
            cred: cred(p.cred)?,
            parent: inode(p.parent, "parent")?,
            name: file_name(p.name, "name")?,
            target: SymlinkTarget::new(p.target).at("target")?,
        })
    }
}

impl From<SymlinkRequest> for pb::SymlinkRequest {
    fn from(r: SymlinkRequest) -> Self {
        pb::SymlinkRequest {
            cred: Some(r.cred.into()),
            parent: r.parent.0,
            name: r.name.into_bytes(),
            target: r.target.into_bytes(),
            request_id: None,
        }
    }
}

impl TryFrom<pb::ReadlinkReply> for SymlinkTarget {
    type Error = ProtocolError;

    fn try_from(p: pb::ReadlinkReply) -> Result<Self, ProtocolError> {
        SymlinkTarget::new(p.target).at("target")
    }
}

impl From<SymlinkTarget> for pb::ReadlinkReply {
    fn from(t: SymlinkTarget) -> Self {
        pb::ReadlinkReply {
            target: t.into_bytes(),
        }
    }
}

/// The longest lease term a reply may carry, milliseconds (one hour).
pub const MAX_LEASE_MS: u64 = 3_600_000;

pub(super) fn lease_ms(ms: u64) -> Result<u64, ProtocolError> {
    if ms > MAX_LEASE_MS {
        return Err(invalid(
            "lease_ms",
            format!("{ms} is more than {MAX_LEASE_MS}"),
        ));
    }
    Ok(ms)
}

/// The directories a namespace change altered (at most [`MAX_CHANGED_DIRS`]), as they are
/// after it, and the term of the changer's attribute leases on them (0: none).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChangedDirs {
    pub attrs: Vec<Attr>,
    pub lease_ms: u64,
}

/// Directories one change alters at most (a rename: two parents).
pub const MAX_CHANGED_DIRS: usize = 2;

impl TryFrom<pb::ChangedDirs> for ChangedDirs {
    type Error = ProtocolError;

    fn try_from(p: pb::ChangedDirs) -> Result<Self, ProtocolError> {
        if p.attrs.len() > MAX_CHANGED_DIRS {
            return Err(invalid(
                "attrs",
                format!("{} directories, at most {MAX_CHANGED_DIRS}", p.attrs.len()),
            ));
        }
        let attrs = p
            .attrs
            .into_iter()
            .map(|a| attr(Some(a)))
            .collect::<Result<Vec<_>, _>>()?;
        if attrs.iter().any(|a| a.kind != FileType::Directory) {
            return Err(invalid("attrs", "not a directory"));
        }
        Ok(ChangedDirs {
            attrs,
            lease_ms: lease_ms(p.lease_ms)?,
        })
    }
}

impl From<ChangedDirs> for pb::ChangedDirs {
    fn from(c: ChangedDirs) -> Self {
        pb::ChangedDirs {
            attrs: c.attrs.into_iter().map(Into::into).collect(),
            lease_ms: c.lease_ms,
        }
    }
}

/// A reply and the term of the leases it hands out (Lookup, GetAttr, ReadDir): milliseconds
/// from when the request was sent, at most [`MAX_LEASE_MS`]; 0: no lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Leased<T> {
    pub value: T,
    pub lease_ms: u64,
}

macro_rules! leased_attr_reply {
    ($($pb:ident),*) => {$(
        impl TryFrom<pb::$pb> for Leased<Attr> {
            type Error = ProtocolError;

            fn try_from(p: pb::$pb) -> Result<Self, ProtocolError> {
                Ok(Leased {
                    value: attr(p.attr)?,
                    lease_ms: lease_ms(p.lease_ms)?,
                })
            }
        }

        impl From<Leased<Attr>> for pb::$pb {
            fn from(l: Leased<Attr>) -> Self {
                pb::$pb {
                    attr: Some(l.value.into()),
                    lease_ms: l.lease_ms,
                }
            }
        }
    )*};
}
leased_attr_reply!(LookupReply, GetAttrReply, SetAttrReply);

impl TryFrom<pb::ReadDirReply> for Leased<ReadDirReply> {
    type Error = ProtocolError;

    fn try_from(p: pb::ReadDirReply) -> Result<Self, ProtocolError> {
        let lease = lease_ms(p.lease_ms)?;
        Ok(Leased {
            value: ReadDirReply::try_from(p)?,
            lease_ms: lease,
        })
    }
}

impl From<Leased<ReadDirReply>> for pb::ReadDirReply {
    fn from(l: Leased<ReadDirReply>) -> Self {
        pb::ReadDirReply {
            lease_ms: l.lease_ms,
            ..l.value.into()
        }
    }
}

/// Lookup asking for leases: the entry and the caller's session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeasedLookup {
    pub entry: EntryRequest,
    pub session: Option<SessionId>,
}

impl TryFrom<pb::LookupRequest> for LeasedLookup {
    type Error = ProtocolError;

    fn try_from(p: pb::LookupRequest) -> Result<Self, ProtocolError> {
        let session = p.session.map(session_id).transpose()?;
        Ok(LeasedLookup {
            entry: EntryRequest::try_from(p)?,
            session,
        })
    }
}

impl From<LeasedLookup> for pb::LookupRequest {
    fn from(l: LeasedLookup) -> Self {
        pb::LookupRequest {
            session: l.session.map(|s| s.0),
            ..l.entry.into()
        }
    }
}

/// ReadDir asking for leases: the request and the caller's session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeasedReadDir {
    pub request: ReadDirRequest,
    pub session: Option<SessionId>,
}

impl TryFrom<pb::ReadDirRequest> for LeasedReadDir {
    type Error = ProtocolError;

    fn try_from(p: pb::ReadDirRequest) -> Result<Self, ProtocolError> {
        let session = p.session.map(session_id).transpose()?;
        Ok(LeasedReadDir {
            request: ReadDirRequest::try_from(p)?,
            session,
        })
    }
}

impl From<LeasedReadDir> for pb::ReadDirRequest {
    fn from(l: LeasedReadDir) -> Self {
        pb::ReadDirRequest {
            session: l.session.map(|s| s.0),
            ..l.request.into()
        }
    }
}

/// ReadDir: one page of a directory listing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadDirRequest {
    pub cred: Credentials,
    pub inode: InodeId,
    /// 0 to start, else the cookie of the last entry seen.
    pub cookie: u64,
    /// 1 to [`MAX_READDIR_ENTRIES`].
    pub max_entries: u32,
    /// readdirplus: return attributes too.
    pub plus: bool,
}

impl TryFrom<pb::ReadDirRequest> for ReadDirRequest {
    type Error = ProtocolError;

    fn try_from(p: pb::ReadDirRequest) -> Result<Self, ProtocolError> {
        if p.max_entries == 0 || p.max_entries > MAX_READDIR_ENTRIES {
            return Err(invalid(
                "max_entries",
                format!("{} is not 1 to {MAX_READDIR_ENTRIES}", p.max_entries),
            ));
        }
        if p.cookie != 0 && p.cookie < FIRST_DIR_COOKIE {
            return Err(invalid(
                "cookie",
                format!("{} is reserved for the agent's . and ..", p.cookie),
            ));
        }
        Ok(ReadDirRequest {
            cred: cred(p.cred)?,
            inode: inode(p.inode, "inode")?,
            cookie: p.cookie,
            max_entries: p.max_entries,
            plus: p.plus,
        })
    }
}

impl From<ReadDirRequest> for pb::ReadDirRequest {
    fn from(r: ReadDirRequest) -> Self {
        pb::ReadDirRequest {
            cred: Some(r.cred.into()),
            inode: r.inode.0,
            cookie: r.cookie,
            max_entries: r.max_entries,
            plus: r.plus,
            session: None,
        }
    }
}

/// One directory entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirEntry {
    pub name: FileName,
    pub inode: InodeId,
    pub kind: FileType,
    /// At least [`FIRST_DIR_COOKIE`].
    pub cookie: u64,
    /// Present for readdirplus; then its `ino` and `kind` match the entry's.
    pub attr: Option<Attr>,
}

impl TryFrom<pb::DirEntry> for DirEntry {
    type Error = ProtocolError;

    fn try_from(p: pb::DirEntry) -> Result<Self, ProtocolError> {
        if p.cookie < FIRST_DIR_COOKIE {
            return Err(invalid(
                "cookie",
                format!("{} is below {FIRST_DIR_COOKIE}", p.cookie),
            ));
        }
        let inode = inode(p.inode, "inode")?;
        let kind = file_type(p.kind, "kind")?;
        let attr = p.attr.map(Attr::try_from).transpose().at("attr")?;
        if let Some(a) = &attr
            && (a.ino != inode || a.kind != kind)
        {
            return Err(invalid(
                "attr",
                "names another inode or type than the entry",
            ));
        }
        Ok(DirEntry {
            name: file_name(p.name, "name")?,
            inode,
            kind,
            cookie: p.cookie,
            attr,
        })
    }
}

impl From<DirEntry> for pb::DirEntry {
    fn from(e: DirEntry) -> Self {
        pb::DirEntry {
            name: e.name.into_bytes(),
            inode: e.inode.0,
            kind: pb::FileType::from(e.kind).into(),
            cookie: e.cookie,
            attr: e.attr.map(Into::into),
        }
    }
}

/// One page of a listing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadDirReply {
    /// At most [`MAX_READDIR_ENTRIES`].
    pub entries: Vec<DirEntry>,
    pub eof: bool,
    /// The directory's parent (the root is its own), for `..`.
    pub parent: InodeId,
}

impl TryFrom<pb::ReadDirReply> for ReadDirReply {
    type Error = ProtocolError;

    fn try_from(p: pb::ReadDirReply) -> Result<Self, ProtocolError> {
        if p.entries.len() > MAX_READDIR_ENTRIES as usize {
            return Err(invalid(
                "entries",
                format!(
                    "{} entries (at most {MAX_READDIR_ENTRIES})",
                    p.entries.len()
                ),
            ));
        }
        Ok(ReadDirReply {
            entries: list(p.entries, "entries")?,
            eof: p.eof,
            parent: inode(p.parent, "parent")?,
        })
    }
}

impl From<ReadDirReply> for pb::ReadDirReply {
    fn from(r: ReadDirReply) -> Self {
        pb::ReadDirReply {
            entries: to_pb(r.entries),
            eof: r.eof,
            parent: r.parent.0,
            lease_ms: 0,
        }
    }
}

/// StatFs reply: counts in blocks of `block_size` bytes and in inodes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StatFs {
    pub block_size: u32,
    pub total_blocks: u64,
    /// At most `total_blocks`.
    pub free_blocks: u64,
    /// At most `free_blocks`.
    pub avail_blocks: u64,
    pub total_inodes: u64,
    /// At most `total_inodes`.
    pub free_inodes: u64,
    pub name_max: u32,
}

impl TryFrom<pb::StatFsReply> for StatFs {
    type Error = ProtocolError;

    fn try_from(p: pb::StatFsReply) -> Result<Self, ProtocolError> {
        let block_size = super::session::block_size(p.block_size, "block_size")?;
        if p.free_blocks > p.total_blocks {
            return Err(invalid("free_blocks", "exceeds total_blocks"));
        }
        if p.avail_blocks > p.free_blocks {
            return Err(invalid("avail_blocks", "exceeds free_blocks"));
        }
        if p.free_inodes > p.total_inodes {
            return Err(invalid("free_inodes", "exceeds total_inodes"));
        }
        if p.name_max == 0 || p.name_max as usize > NAME_MAX {
            return Err(invalid(
                "name_max",
                format!("{} is not 1 to {NAME_MAX}", p.name_max),
            ));
        }
        Ok(StatFs {
            block_size,
            total_blocks: p.total_blocks,
            free_blocks: p.free_blocks,
            avail_blocks: p.avail_blocks,
            total_inodes: p.total_inodes,
            free_inodes: p.free_inodes,
            name_max: p.name_max,
        })
    }
}

impl From<StatFs> for pb::StatFsReply {
    fn from(s: StatFs) -> Self {
        pb::StatFsReply {
            block_size: s.block_size,
            total_blocks: s.total_blocks,
            free_blocks: s.free_blocks,
            avail_blocks: s.avail_blocks,
            total_inodes: s.total_inodes,
            free_inodes: s.free_inodes,
            name_max: s.name_max,
        }
    }
}

/// A request naming one extended attribute: GetXattr, RemoveXattr.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct XattrRequest {
    pub cred: Credentials,
    pub inode: InodeId,
    pub name: XattrName,
}

pub type GetXattrRequest = XattrRequest;
pub type RemoveXattrRequest = XattrRequest;

macro_rules! xattr_request {
    ($($pb:ident),*) => {$(
        impl TryFrom<pb::$pb> for XattrRequest {
            type Error = ProtocolError;

            fn try_from(p: pb::$pb) -> Result<Self, ProtocolError> {
                Ok(XattrRequest {
                    cred: cred(p.cred)?,
                    inode: inode(p.inode, "inode")?,
                    name: XattrName::new(p.name).at("name")?,
                })
            }
        }

        impl From<XattrRequest> for pb::$pb {
            fn from(r: XattrRequest) -> Self {
                pb::$pb {
                    cred: Some(r.cred.into()),
                    inode: r.inode.0,
                    name: r.name.into_bytes(),
                }
            }
        }
    )*};
}
xattr_request!(GetXattrRequest, RemoveXattrRequest);

/// The value of one extended attribute: at most [`XATTR_SIZE_MAX`] bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct XattrValue(pub Vec<u8>);

impl TryFrom<pb::GetXattrReply> for XattrValue {
    type Error = ProtocolError;

    fn try_from(p: pb::GetXattrReply) -> Result<Self, ProtocolError> {
        Ok(XattrValue(payload(p.value, "value", XATTR_SIZE_MAX)?))
    }
}

impl From<XattrValue> for pb::GetXattrReply {
    fn from(v: XattrValue) -> Self {
        pb::GetXattrReply { value: v.0 }
    }
}

/// SetXattr.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SetXattrRequest {
    pub cred: Credentials,
    pub inode: InodeId,
    pub name: XattrName,
    /// At most [`XATTR_SIZE_MAX`] bytes.
    pub value: Vec<u8>,
    pub mode: XattrMode,
}

impl TryFrom<pb::SetXattrRequest> for SetXattrRequest {
    type Error = ProtocolError;

    fn try_from(p: pb::SetXattrRequest) -> Result<Self, ProtocolError> {
        Ok(SetXattrRequest {
            cred: cred(p.cred)?,
            inode: inode(p.inode, "inode")?,
            name: XattrName::new(p.name).at("name")?,
            value: payload(p.value, "value", XATTR_SIZE_MAX)?,
            mode: xattr_mode(p.mode)?,
        })
    }
}

impl From<SetXattrRequest> for pb::SetXattrRequest {
    fn from(r: SetXattrRequest) -> Self {
        pb::SetXattrRequest {
            cred: Some(r.cred.into()),
            inode: r.inode.0,
            name: r.name.into_bytes(),
            value: r.value,
            mode: pb::XattrMode::from(r.mode).into(),
        }
    }
}

/// The names of a file's extended attributes; together (with one NUL after each) at most
/// [`XATTR_SIZE_MAX`] bytes, as listxattr(2) can return.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct XattrNames(pub Vec<XattrName>);

impl TryFrom<pb::ListXattrReply> for XattrNames {
    type Error = ProtocolError;

    fn try_from(p: pb::ListXattrReply) -> Result<Self, ProtocolError> {
        let total = p.names.iter().fold(0usize, |sum, n| {
            sum.saturating_add(n.len()).saturating_add(1)
        });
        if total > XATTR_SIZE_MAX {
            return Err(invalid(
                "names",
                format!("list is {total} bytes (at most {XATTR_SIZE_MAX})"),
            ));
        }
        let names = p
            .names
            .into_iter()
            .map(|n| XattrName::new(n).at("names"))
            .collect::<Result<_, _>>()?;
        Ok(XattrNames(names))
    }
}

impl From<XattrNames> for pb::ListXattrReply {
    fn from(n: XattrNames) -> Self {
        pb::ListXattrReply {
            names: n.0.into_iter().map(XattrName::into_bytes).collect(),
        }
    }
}

/// Open.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpenRequest {
    pub cred: Credentials,
    pub session: SessionId,
    pub inode: InodeId,
    pub flags: OpenFlags,
    /// Asks for the whole file with the reply when it is a regular file of at most this
    /// many bytes opened for reading without truncation (0: never; the server may give less
    /// often: never past its `direct_io_threshold` or [`MAX_INLINE_DATA`]).
    pub read_small: u64,
}

impl TryFrom<pb::OpenRequest> for OpenRequest {
    type Error = ProtocolError;

    fn try_from(p: pb::OpenRequest) -> Result<Self, ProtocolError> {
        Ok(OpenRequest {
            cred: cred(p.cred)?,
            session: session_id(p.session)?,
            inode: inode(p.inode, "inode")?,
            flags: required_msg(p.flags, "flags")?,
            read_small: p.read_small,
        })
    }
}

impl From<OpenRequest> for pb::OpenRequest {
    fn from(r: OpenRequest) -> Self {
        pb::OpenRequest {
            cred: Some(r.cred.into()),
            session: r.session.0,
            inode: r.inode.0,
            flags: Some(r.flags.into()),
            read_small: r.read_small,
        }
    }
}

/// The reply to Open.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpenReply {
    pub handle: OpenHandle,
    pub attr: Attr,
    /// The whole file (its length is `attr.size`), when asked with
    /// [`OpenRequest::read_small`] and given.
    pub data: Option<Vec<u8>>,
    /// Milliseconds of an attribute lease on the file given with `data` (0: none).
    pub lease_ms: u64,
}

impl TryFrom<pb::OpenReply> for OpenReply {
    type Error = ProtocolError;

    fn try_from(p: pb::OpenReply) -> Result<Self, ProtocolError> {
        let attr = attr(p.attr)?;
        if let Some(data) = &p.data {
            if attr.kind != FileType::Regular {
                return Err(invalid("data", "the bytes of a file that is not regular"));
            }
            if data.len() > MAX_INLINE_DATA || data.len() as u64 != attr.size {
                return Err(invalid(
                    "data",
                    "not the whole file: its length is not the size",
                ));
            }
        }
        Ok(OpenReply {
            handle: handle(p.handle)?,
            attr,
            data: p.data,
            lease_ms: p.lease_ms,
        })
    }
}

impl From<OpenReply> for pb::OpenReply {
    fn from(r: OpenReply) -> Self {
        pb::OpenReply {
            handle: r.handle.0,
            attr: Some(r.attr.into()),
            data: r.data,
            lease_ms: r.lease_ms,
        }
    }
}

/// access(2) mask bits.
pub const ACCESS_R: u32 = 4;
pub const ACCESS_W: u32 = 2;
pub const ACCESS_X: u32 = 1;

/// Access: a permission check without opening.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AccessRequest {
    pub cred: Credentials,
    pub inode: InodeId,
    /// [`ACCESS_R`] | [`ACCESS_W`] | [`ACCESS_X`], or 0 for existence only.
    pub mask: u32,
}

impl TryFrom<pb::AccessRequest> for AccessRequest {
    type Error = ProtocolError;

    fn try_from(p: pb::AccessRequest) -> Result<Self, ProtocolError> {
        if p.mask > (ACCESS_R | ACCESS_W | ACCESS_X) {
            return Err(invalid("mask", format!("{:#o} has bits above 0o7", p.mask)));
        }
        Ok(AccessRequest {
            cred: cred(p.cred)?,
            inode: inode(p.inode, "inode")?,
            mask: p.mask,
        })
    }
}

impl From<AccessRequest> for pb::AccessRequest {
    fn from(r: AccessRequest) -> Self {
        pb::AccessRequest {
            cred: Some(r.cred.into()),
            inode: r.inode.0,
            mask: r.mask,
        }
    }
}

/// The most creates one [`CreateBatchRequest`] carries.
pub const MAX_CREATE_BATCH: usize = 256;

/// CreateBatch: creates the agent answered already, each with its reserved inode number.
#[derive(Debug, Clone, PartialEq)]
pub struct CreateBatchRequest {
    /// With their reply-cache ids.
    pub creates: Vec<(CreateRequest, Option<RequestId>)>,
}

impl TryFrom<pb::CreateBatchRequest> for CreateBatchRequest {
    type Error = ProtocolError;

    fn try_from(p: pb::CreateBatchRequest) -> Result<Self, ProtocolError> {
        if p.creates.is_empty() || p.creates.len() > MAX_CREATE_BATCH {
            return Err(invalid(
                "creates",
                format!("{} creates, not 1 to {MAX_CREATE_BATCH}", p.creates.len()),
            ));
        }
        let creates = p
            .creates
            .into_iter()
            .map(|mut c| {
                let id = request_id(c.request_id.take())?;
                let r = CreateRequest::try_from(c)?;
                if r.inode.is_none() {
                    return Err(invalid("creates.inode", "a batched create names its inode"));
                }
                Ok((r, id))
            })
            .collect::<Result<Vec<_>, ProtocolError>>()?;
        Ok(CreateBatchRequest { creates })
    }
}

impl From<CreateBatchRequest> for pb::CreateBatchRequest {
    fn from(r: CreateBatchRequest) -> Self {
        pb::CreateBatchRequest {
            creates: r
                .creates
                .into_iter()
                .map(|(c, id)| {
                    let mut p = pb::CreateRequest::from(c);
                    p.request_id = id.map(Into::into);
                    p
                })
                .collect(),
        }
    }
}

/// One change of a [`ChangeBatchRequest`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BatchedChange {
    Unlink(EntryRequest),
    Rename(RenameRequest),
    /// Mode, owners or times: no size, no handle.
    SetAttr(SetAttrRequest),
}

impl BatchedChange {
    /// The entries (directory, name) it changes; an attribute change names its inode with
    /// the empty name (which no entry has).
    pub fn entries(&self) -> Vec<(InodeId, &[u8])> {
        match self {
            BatchedChange::Unlink(r) => vec![(r.parent, r.name.as_bytes())],
            BatchedChange::Rename(r) => vec![
                (r.old_parent, r.old_name.as_bytes()),
                (r.new_parent, r.new_name.as_bytes()),
            ],
            BatchedChange::SetAttr(r) => vec![(r.inode, &[][..])],
        }
    }

    /// The inodes whose attributes it changes outright: an attribute change's, and the
    /// directories an unlink or rename changes (their mtime and ctime).
    pub fn inodes(&self) -> Vec<InodeId> {
        let mut v: Vec<InodeId> = self.entries().into_iter().map(|(d, _)| d).collect();
        v.dedup();
        v
    }
}

/// ChangeBatch: unlinks and renames the agent answered already, run side by side.
#[derive(Debug, Clone, PartialEq)]
pub struct ChangeBatchRequest {
    /// With their reply-cache ids; no two name the same entry.
    pub changes: Vec<(BatchedChange, Option<RequestId>)>,
}

impl TryFrom<pb::ChangeBatchRequest> for ChangeBatchRequest {
    type Error = ProtocolError;

    fn try_from(p: pb::ChangeBatchRequest) -> Result<Self, ProtocolError> {
        if p.changes.is_empty() || p.changes.len() > MAX_CREATE_BATCH {
            return Err(invalid(
                "changes",
                format!("{} changes, not 1 to {MAX_CREATE_BATCH}", p.changes.len()),
            ));
        }
        let changes = p
            .changes
            .into_iter()
            .map(|c| match c.change {
                Some(pb::batched_change::Change::Unlink(mut u)) => {
                    let id = request_id(u.request_id.take())?;
                    Ok((BatchedChange::Unlink(EntryRequest::try_from(u)?), id))
                }
                Some(pb::batched_change::Change::Rename(mut r)) => {
                    let id = request_id(r.request_id.take())?;
                    Ok((BatchedChange::Rename(RenameRequest::try_from(r)?), id))
                }
                Some(pb::batched_change::Change::SetAttr(a)) => {
                    let a = SetAttrRequest::try_from(a)?;
                    if a.changes.size.is_some() || a.handle.is_some() {
                        return Err(invalid(
                            "changes.set_attr",
                            "a batched attribute change has no size and no handle",
                        ));
                    }
                    Ok((BatchedChange::SetAttr(a), None))
                }
                None => Err(ProtocolError::MissingField("changes.change")),
            })
            .collect::<Result<Vec<_>, ProtocolError>>()?;
        let mut seen = std::collections::HashSet::new();
        for (change, _) in &changes {
            for (dir, name) in change.entries() {
                if !seen.insert((dir, name)) {
                    return Err(invalid(
                        "changes",
                        format!(
                            "two changes of entry {:?} in {dir}",
                            String::from_utf8_lossy(name)
                        ),
                    ));
                }
            }
        }
        // An attribute change goes with no other change of its inode (their order would not
        // be kept: an unlink's or rename's new mtime against the one set).
        let set: std::collections::HashSet<InodeId> = changes
            .iter()
            .filter_map(|(c, _)| match c {
                BatchedChange::SetAttr(a) => Some(a.inode),
                _ => None,
            })
            .collect();
        for (change, _) in &changes {
            if !matches!(change, BatchedChange::SetAttr(_))
                && let Some(ino) = change.inodes().into_iter().find(|i| set.contains(i))
            {
                return Err(invalid(
                    "changes",
                    format!("an attribute change of {ino} with another change there"),
                ));
            }
        }
        Ok(ChangeBatchRequest { changes })
    }
}

impl From<ChangeBatchRequest> for pb::ChangeBatchRequest {
    fn from(r: ChangeBatchRequest) -> Self {
        let wire = |id: Option<RequestId>| id.map(Into::into);
        pb::ChangeBatchRequest {
            changes: r
                .changes
                .into_iter()
                .map(|(c, id)| pb::BatchedChange {
                    change: Some(match c {
                        BatchedChange::Unlink(u) => {
                            let mut p = pb::UnlinkRequest::from(u);
                            p.request_id = wire(id);
                            pb::batched_change::Change::Unlink(p)
                        }
                        BatchedChange::Rename(r) => {
                            let mut p = pb::RenameRequest::from(r);
                            p.request_id = wire(id);
                            pb::batched_change::Change::Rename(p)
                        }
                        BatchedChange::SetAttr(a) => {
                            pb::batched_change::Change::SetAttr(pb::SetAttrRequest::from(a))
                        }
                    }),
                })
                .collect(),
        }
    }
}

/// One change of a [`ChangeBatchRequest`] as answered: done (with its commit note), or
/// refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChangeResult {
    Done { commit_seq: u64, durable_seq: u64 },
    Refused { errno: u32, error: String },
}

impl From<pb::ChangeResult> for ChangeResult {
    fn from(p: pb::ChangeResult) -> Self {
        match p.errno {
            0 => ChangeResult::Done {
                commit_seq: p.commit_seq,
                durable_seq: p.durable_seq,
            },
            errno => ChangeResult::Refused {
                errno,
                error: p.error,
            },
        }
    }
}

impl From<ChangeResult> for pb::ChangeResult {
    fn from(r: ChangeResult) -> Self {
        match r {
            ChangeResult::Done {
                commit_seq,
                durable_seq,
            } => pb::ChangeResult {
                commit_seq,
                durable_seq,
                errno: 0,
                error: String::new(),
            },
            ChangeResult::Refused { errno, error } => pb::ChangeResult {
                commit_seq: 0,
                durable_seq: 0,
                errno,
                error,
            },
        }
    }
}

/// The answers of a [`ChangeBatchRequest`], in its order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChangeBatchReply {
    pub results: Vec<ChangeResult>,
}

impl TryFrom<pb::ChangeBatchReply> for ChangeBatchReply {
    type Error = ProtocolError;

    fn try_from(p: pb::ChangeBatchReply) -> Result<Self, ProtocolError> {
        if p.results.len() > MAX_CREATE_BATCH {
            return Err(invalid("results", format!("{} results", p.results.len())));
        }
        Ok(ChangeBatchReply {
            results: p.results.into_iter().map(ChangeResult::from).collect(),
        })
    }
}

impl From<ChangeBatchReply> for pb::ChangeBatchReply {
    fn from(r: ChangeBatchReply) -> Self {
        pb::ChangeBatchReply {
            results: r.results.into_iter().map(Into::into).collect(),
        }
    }
}

/// One create of a [`CreateBatchRequest`] as answered: made (with its commit note), or
/// refused.
#[derive(Debug, Clone, PartialEq)]
pub enum CreateResult {
    Made {
        reply: CreateReply,
        commit_seq: u64,
        durable_seq: u64,
    },
    Refused {
        errno: u32,
        error: String,
    },
}

impl TryFrom<pb::CreateResult> for CreateResult {
    type Error = ProtocolError;

    fn try_from(p: pb::CreateResult) -> Result<Self, ProtocolError> {
        match (p.reply, p.errno) {
            (Some(reply), 0) => Ok(CreateResult::Made {
                reply: CreateReply::try_from(reply)?,
                commit_seq: p.commit_seq,
                durable_seq: p.durable_seq,
            }),
            (None, errno) if errno != 0 => Ok(CreateResult::Refused {
                errno,
                error: p.error,
            }),
            _ => Err(invalid(
                "errno",
                "a create result is either a reply or an error number",
            )),
        }
    }
}

impl From<CreateResult> for pb::CreateResult {
    fn from(r: CreateResult) -> Self {
        match r {
            CreateResult::Made {
                reply,
                commit_seq,
                durable_seq,
            } => pb::CreateResult {
                reply: Some(reply.into()),
                commit_seq,
                durable_seq,
                errno: 0,
                error: String::new(),
            },
            CreateResult::Refused { errno, error } => pb::CreateResult {
                reply: None,
                commit_seq: 0,
                durable_seq: 0,
                errno,
                error,
            },
        }
    }
}

/// The answers of a [`CreateBatchRequest`], in its order.
#[derive(Debug, Clone, PartialEq)]
pub struct CreateBatchReply {
    pub results: Vec<CreateResult>,
}

impl TryFrom<pb::CreateBatchReply> for CreateBatchReply {
    type Error = ProtocolError;

    fn try_from(p: pb::CreateBatchReply) -> Result<Self, ProtocolError> {
        if p.results.len() > MAX_CREATE_BATCH {
            return Err(invalid("results", format!("{} results", p.results.len())));
        }
        Ok(CreateBatchReply {
            results: p
                .results
                .into_iter()
                .map(CreateResult::try_from)
                .collect::<Result<_, _>>()?,
        })
    }
}

impl From<CreateBatchReply> for pb::CreateBatchReply {
    fn from(r: CreateBatchReply) -> Self {
        pb::CreateBatchReply {
            results: r.results.into_iter().map(Into::into).collect(),
        }
    }
}

/// The most inode numbers one [`ReserveInodesRequest`] asks for.
pub const MAX_RESERVED_INODES: u32 = 4096;

/// ReserveInodes: numbers for files the session's agent creates before the server answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReserveInodesRequest {
    pub session: SessionId,
    /// 1 to [`MAX_RESERVED_INODES`].
    pub count: u32,
}

impl TryFrom<pb::ReserveInodesRequest> for ReserveInodesRequest {
    type Error = ProtocolError;

    fn try_from(p: pb::ReserveInodesRequest) -> Result<Self, ProtocolError> {
        if p.count == 0 || p.count > MAX_RESERVED_INODES {
            return Err(invalid(
                "count",
                format!("{} is not 1 to {MAX_RESERVED_INODES}", p.count),
            ));
        }
        Ok(ReserveInodesRequest {
            session: session_id(p.session)?,
            count: p.count,
        })
    }
}

impl From<ReserveInodesRequest> for pb::ReserveInodesRequest {
    fn from(r: ReserveInodesRequest) -> Self {
        pb::ReserveInodesRequest {
            session: r.session.0,
            count: r.count,
        }
    }
}

/// The numbers reserved: inode `first + i` has generation `first_generation + i`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReserveInodesReply {
    pub first: InodeId,
    pub count: u32,
    pub first_generation: u64,
}

impl ReserveInodesReply {
    /// The generation of reserved inode `ino` (`None`: not one of these).
    pub fn generation_of(&self, ino: InodeId) -> Option<u64> {
        let i = ino.0.checked_sub(self.first.0)?;
        (i < u64::from(self.count)).then(|| self.first_generation + i)
    }
}

impl TryFrom<pb::ReserveInodesReply> for ReserveInodesReply {
    type Error = ProtocolError;

    fn try_from(p: pb::ReserveInodesReply) -> Result<Self, ProtocolError> {
        let first = inode(p.first_inode, "first_inode")?;
        let last = p
            .first_inode
            .checked_add(u64::from(p.count))
            .filter(|end| p.count > 0 && *end <= RESERVED_HANDLE_BIT);
        let gens = p.first_generation.checked_add(u64::from(p.count));
        if last.is_none() || gens.is_none() {
            return Err(invalid(
                "count",
                format!(
                    "{} inodes from {} (generation {}) overflow",
                    p.count, p.first_inode, p.first_generation
                ),
            ));
        }
        Ok(ReserveInodesReply {
            first,
            count: p.count,
            first_generation: p.first_generation,
        })
    }
}

impl From<ReserveInodesReply> for pb::ReserveInodesReply {
    fn from(r: ReserveInodesReply) -> Self {
        pb::ReserveInodesReply {
            first_inode: r.first.0,
            count: r.count,
            first_generation: r.first_generation,
        }
    }
}

/// A non-idempotent request's identity in the server's reply cache (the `request_id` of
/// Create, Mkdir, Mknod, Symlink, Link, Rename, Unlink and Rmdir).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RequestId {
    /// The agent instance (not 0).
    pub client: u64,
    /// This request (not 0).
    pub seq: u64,
    /// The lowest seq the client may still send again (at most `seq`).
    pub lowest_pending: u64,
}

impl TryFrom<pb::RequestId> for RequestId {
    type Error = ProtocolError;

    fn try_from(p: pb::RequestId) -> Result<Self, ProtocolError> {
        if p.client == 0 {
            return Err(invalid("client", "client 0 is not an agent instance"));
        }
        if p.seq == 0 {
            return Err(invalid("seq", "request 0 does not exist"));
        }
        if p.lowest_pending > p.seq {
            return Err(invalid(
                "lowest_pending",
                format!(
                    "{} is past the request itself ({})",
                    p.lowest_pending, p.seq
                ),
            ));
        }
        Ok(RequestId {
            client: p.client,
            seq: p.seq,
            lowest_pending: p.lowest_pending,
        })
    }
}

impl From<RequestId> for pb::RequestId {
    fn from(r: RequestId) -> Self {
        pb::RequestId {
            client: r.client,
            seq: r.seq,
            lowest_pending: r.lowest_pending,
        }
    }
}

/// The optional `request_id` field of a request, validated.
pub fn request_id(p: Option<pb::RequestId>) -> Result<Option<RequestId>, ProtocolError> {
    p.map(RequestId::try_from).transpose().at("request_id")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reserved_create_handle_names_its_inode_and_the_servers_own_none() {
        let ino = InodeId(12345);
        assert_eq!(
            reserved_create_inode(reserved_create_handle(ino).0),
            Some(ino)
        );
        assert_eq!(reserved_create_inode(7), None);
    }

    #[test]
    fn a_change_batch_holds_an_attribute_change_apart_from_every_other_change_of_its_inode() {
        use pb::batched_change::Change;
        let cred = || Some(pb::Credentials::from(Credentials::root()));
        let attr = |ino: u64, size: Option<u64>, handle: Option<u64>| pb::BatchedChange {
            change: Some(Change::SetAttr(pb::SetAttrRequest {
                cred: cred(),
                inode: ino,
                changes: Some(pb::SetAttrChanges {
                    perm: Some(0o750),
                    size,
                    ..Default::default()
                }),
                handle,
                session: handle.map(|_| 3),
            })),
        };
        let unlink = |dir: u64, name: &str| pb::BatchedChange {
            change: Some(Change::Unlink(pb::UnlinkRequest {
                cred: cred(),
                parent: dir,
                name: name.as_bytes().to_vec(),
                ..Default::default()
            })),
        };
        let batch = |changes: Vec<pb::BatchedChange>| {
            ChangeBatchRequest::try_from(pb::ChangeBatchRequest { changes })
        };
        let ok = batch(vec![
            attr(5, None, None),
            attr(6, None, None),
            unlink(7, "a"),
        ])
        .unwrap();
        assert!(
            matches!(&ok.changes[0], (BatchedChange::SetAttr(a), None) if a.inode == InodeId(5))
        );
        // Round trip.
        assert_eq!(
            ChangeBatchRequest::try_from(pb::ChangeBatchRequest::from(ok.clone())).unwrap(),
            ok
        );
        for (why, changes) in [
            ("a size", vec![attr(5, Some(0), None)]),
            ("a handle", vec![attr(5, None, Some(9))]),
            (
                "one inode twice",
                vec![attr(5, None, None), attr(5, None, None)],
            ),
            (
                "an unlink in it after",
                vec![attr(5, None, None), unlink(5, "a")],
            ),
            (
                "an unlink in it before",
                vec![unlink(5, "a"), attr(5, None, None)],
            ),
        ] {
            assert!(batch(changes).is_err(), "{why}");
        }
    }
}
