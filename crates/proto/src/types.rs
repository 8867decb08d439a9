//! Validated domain types shared by the metadata server, the client agent and the wire layer.
//!
//! A value of one of these types has passed its checks: a [`FileName`] is 1 to 255 bytes with
//! no `/` or NUL, a [`ByteRange`] never overflows and never reaches past [`MAX_FILE_SIZE`]. Code
//! behind the gRPC boundary takes these types and never re-validates.

use std::fmt;

/// Largest file size sanfs supports (as XFS: 2^63 - 1 bytes).
pub const MAX_FILE_SIZE: u64 = i64::MAX as u64;

/// Longest file name in bytes.
pub const NAME_MAX: usize = 255;

/// Longest symlink target in bytes (as Linux PATH_MAX).
pub const SYMLINK_MAX: usize = 4096;

/// Longest extended attribute name in bytes (as Linux XATTR_NAME_MAX).
pub const XATTR_NAME_MAX: usize = 255;

/// Largest extended attribute value in bytes (as Linux XATTR_SIZE_MAX).
pub const XATTR_SIZE_MAX: usize = 65536;

/// Inode number of the root directory.
pub const ROOT_INODE: InodeId = InodeId(1);

macro_rules! id_newtype {
    ($(#[$doc:meta])* $name:ident, $prefix:literal) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub struct $name(pub u64);

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!($prefix, "{}"), self.0)
            }
        }
    };
}

id_newtype!(
    /// An inode number. Never 0; 1 is the root directory.
    InodeId,
    "ino:"
);
id_newtype!(
    /// A client session at the metadata server.
    SessionId,
    "session:"
);
id_newtype!(
    /// The server's epoch: bumped at every server start, so grants from before a restart are
    /// recognisably stale.
    SessionEpoch,
    "epoch:"
);
id_newtype!(
    /// A grant: the server's permission to do one direct I/O.
    GrantId,
    "grant:"
);

id_newtype!(
    /// An open file at the server (from `Open` or `Create`), owned by one session. Never 0.
    OpenHandle,
    "handle:"
);

/// Why a value from the wire or the command line was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtocolError {
    #[error("missing field `{0}`")]
    MissingField(&'static str),
    #[error("field `{field}`: {reason}")]
    InvalidField { field: &'static str, reason: String },
    #[error("name is empty")]
    EmptyName,
    #[error("name is {0} bytes long (at most {NAME_MAX})")]
    NameTooLong(usize),
    #[error("symlink target is {0} bytes long (at most {SYMLINK_MAX})")]
    SymlinkTargetTooLong(usize),
    #[error("name contains '/' or NUL")]
    NameHasSlashOrNul,
    #[error("name is '.' or '..'")]
    NameIsDot,
    #[error("range {offset}+{len} overflows or passes the largest file size")]
    RangeOverflow { offset: u64, len: u64 },
    /// `error` was found inside field `field` (of a message, or an element of a list).
    #[error("in `{field}`: {error}")]
    InField {
        field: &'static str,
        error: Box<ProtocolError>,
    },
}

impl ProtocolError {
    /// Wraps this error as found inside `field`.
    pub fn in_field(self, field: &'static str) -> ProtocolError {
        ProtocolError::InField {
            field,
            error: Box::new(self),
        }
    }

    /// The innermost error, below all [`ProtocolError::InField`] wrappers.
    pub fn root(&self) -> &ProtocolError {
        let mut e = self;
        while let ProtocolError::InField { error, .. } = e {
            e = error;
        }
        e
    }

    /// The dotted path of the field the error is in (`"changes.atime.nsec"`), if known.
    pub fn field_path(&self) -> Option<String> {
        let mut parts = Vec::new();
        let mut e = self;
        loop {
            match e {
                ProtocolError::InField { field, error } => {
                    parts.push(*field);
                    e = error;
                }
                ProtocolError::MissingField(field) | ProtocolError::InvalidField { field, .. } => {
                    parts.push(*field);
                    break;
                }
                _ => break,
            }
        }
        (!parts.is_empty()).then(|| parts.join("."))
    }
}

impl InodeId {
    /// Checks that an inode number from the wire is not 0.
    pub fn new(raw: u64) -> Result<InodeId, ProtocolError> {
        if raw == 0 {
            return Err(ProtocolError::InvalidField {
                field: "inode",
                reason: "is 0".into(),
            });
        }
        Ok(InodeId(raw))
    }
}

/// One directory entry name: 1 to [`NAME_MAX`] bytes, no `/`, no NUL, not `.` or `..`.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FileName(Vec<u8>);

impl FileName {
    pub fn new(bytes: impl Into<Vec<u8>>) -> Result<FileName, ProtocolError> {
        let bytes = bytes.into();
        if bytes.is_empty() {
            return Err(ProtocolError::EmptyName);
        }
        if bytes.len() > NAME_MAX {
            return Err(ProtocolError::NameTooLong(bytes.len()));
        }
        if bytes.iter().any(|&b| b == b'/' || b == 0) {
            return Err(ProtocolError::NameHasSlashOrNul);
        }
        if bytes == b"." || bytes == b".." {
            return Err(ProtocolError::NameIsDot);
        }
        Ok(FileName(bytes))
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    pub fn into_bytes(self) -> Vec<u8> {
        self.0
    }
}

impl fmt::Debug for FileName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", String::from_utf8_lossy(&self.0))
    }
}

impl fmt::Display for FileName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&String::from_utf8_lossy(&self.0))
    }
}

/// An extended attribute name: 1 to [`XATTR_NAME_MAX`] bytes, no NUL (with its namespace
/// prefix such as `user.`; which namespaces are allowed is the server's policy).
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct XattrName(Vec<u8>);

impl XattrName {
    pub fn new(bytes: impl Into<Vec<u8>>) -> Result<XattrName, ProtocolError> {
        let bytes = bytes.into();
        if bytes.is_empty() {
            return Err(ProtocolError::EmptyName);
        }
        if bytes.len() > XATTR_NAME_MAX {
            return Err(ProtocolError::NameTooLong(bytes.len()));
        }
        if bytes.contains(&0) {
            return Err(ProtocolError::NameHasSlashOrNul);
        }
        Ok(XattrName(bytes))
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    pub fn into_bytes(self) -> Vec<u8> {
        self.0
    }
}

impl fmt::Debug for XattrName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", String::from_utf8_lossy(&self.0))
    }
}

/// A symbolic link's target: 1 to [`SYMLINK_MAX`] bytes, no NUL. Any other bytes, `/`
/// included, are allowed: the target is stored, never resolved by the server.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct SymlinkTarget(Vec<u8>);

impl SymlinkTarget {
    pub fn new(bytes: impl Into<Vec<u8>>) -> Result<SymlinkTarget, ProtocolError> {
        let bytes = bytes.into();
        if bytes.is_empty() {
            return Err(ProtocolError::InvalidField {
                field: "target",
                reason: "is empty".into(),
            });
        }
        if bytes.len() > SYMLINK_MAX {
            return Err(ProtocolError::SymlinkTargetTooLong(bytes.len()));
        }
        if bytes.contains(&0) {
            return Err(ProtocolError::InvalidField {
                field: "target",
                reason: "contains NUL".into(),
            });
        }
        Ok(SymlinkTarget(bytes))
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    pub fn into_bytes(self) -> Vec<u8> {
        self.0
    }
}

impl fmt::Debug for SymlinkTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", String::from_utf8_lossy(&self.0))
    }
}

/// Who is asking: carried in every request, checked by the server (POSIX permissions).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Credentials {
    pub uid: u32,
    pub gid: u32,
    /// Supplementary groups (the primary `gid` need not be repeated).
    pub groups: Vec<u32>,
}

impl Credentials {
    pub fn root() -> Credentials {
        Credentials {
            uid: 0,
            gid: 0,
            groups: Vec::new(),
        }
    }

    pub fn is_root(&self) -> bool {
        self.uid == 0
    }

    /// Whether the caller is in group `gid` (primary or supplementary).
    pub fn in_group(&self, gid: u32) -> bool {
        self.gid == gid || self.groups.contains(&gid)
    }
}

/// The kind of an inode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FileType {
    Regular,
    Directory,
    Symlink,
    Fifo,
    Socket,
    CharDevice,
    BlockDevice,
}

impl FileType {
    /// The `S_IFMT` bits of this type.
    pub fn mode_bits(self) -> u32 {
        match self {
            FileType::Regular => 0o100000,
            FileType::Directory => 0o040000,
            FileType::Symlink => 0o120000,
            FileType::Fifo => 0o010000,
            FileType::Socket => 0o140000,
            FileType::CharDevice => 0o020000,
            FileType::BlockDevice => 0o060000,
        }
    }
}

/// A point in time: seconds and nanoseconds since the Unix epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Timestamp {
    pub sec: i64,
    pub nsec: u32,
}

impl Timestamp {
    pub fn new(sec: i64, nsec: u32) -> Result<Timestamp, ProtocolError> {
        if nsec >= 1_000_000_000 {
            return Err(ProtocolError::InvalidField {
                field: "nsec",
                reason: format!("{nsec} is not below 10^9"),
            });
        }
        Ok(Timestamp { sec, nsec })
    }
}

/// What a setattr does to a timestamp.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TimeSet {
    /// The server's current time (utimensat UTIME_NOW).
    Now,
    At(Timestamp),
}

/// An inode's attributes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attr {
    pub ino: InodeId,
    pub kind: FileType,
    /// Permission bits including setuid, setgid and sticky (`0o7777`).
    pub perm: u32,
    pub nlink: u32,
    pub uid: u32,
    pub gid: u32,
    /// File size in bytes (for a symlink, the target's length; for a directory, the number
    /// of entries).
    pub size: u64,
    /// Bytes of volume space allocated to the file (`st_blocks * 512`).
    pub allocated: u64,
    pub atime: Timestamp,
    pub mtime: Timestamp,
    pub ctime: Timestamp,
    pub btime: Timestamp,
    /// Device number for character and block devices.
    pub rdev: u64,
    /// Bumped when the inode number is reused.
    pub generation: u64,
    /// The inode had no extended attribute when these attributes were read (`false`: it has
    /// some, or whoever made this does not say). Under an attribute lease the agent answers
    /// "no such attribute" from it.
    pub no_xattrs: bool,
}

/// The set-user-ID bit of a mode.
pub const S_ISUID: u32 = 0o4000;
/// The set-group-ID bit of a mode.
pub const S_ISGID: u32 = 0o2000;
/// The sticky bit of a mode: in a directory, only the owner of a file, of the directory, or
/// root removes or renames the file.
pub const S_ISVTX: u32 = 0o1000;

/// Mode `perm` without what a `chown`, or a truncate or write by a caller without
/// CAP_FSETID, clears: setuid, and setgid where the group may execute (otherwise setgid marks
/// mandatory locking, not privilege). The one rule of the server's changes and of the
/// agent's held-back attribute changes.
pub fn cleared_setid(perm: u32) -> u32 {
    let mut p = perm & !S_ISUID;
    if p & 0o010 != 0 {
        p &= !S_ISGID;
    }
    p
}

/// Whether `cred` may access a file with permission bits `perm`, owned by `uid`:`gid`, for
/// `mask` (read 4, write 2, search/execute 1): the owner's, the group's or the others' bits;
/// root passes all but execute of a non-directory without any execute bit. The one rule of
/// the server's checks and of the agent's answers under an attribute lease.
pub fn mode_permits(
    cred: &Credentials,
    (uid, gid, perm): (u32, u32, u32),
    is_dir: bool,
    mask: u32,
) -> bool {
    if cred.is_root() {
        return mask & 1 == 0 || is_dir || perm & 0o111 != 0;
    }
    let bits = if cred.uid == uid {
        perm >> 6
    } else if cred.in_group(gid) {
        perm >> 3
    } else {
        perm
    } & 7;
    bits & mask == mask
}

impl Attr {
    /// Whether `cred` may access this file for `mask` ([`mode_permits`]).
    pub fn permits(&self, cred: &Credentials, mask: u32) -> bool {
        mode_permits(
            cred,
            (self.uid, self.gid, self.perm),
            self.kind == FileType::Directory,
            mask,
        )
    }

    /// `st_mode`: type bits and permission bits.
    pub fn mode(&self) -> u32 {
        self.kind.mode_bits() | self.perm
    }
}

/// The changes of one setattr; `None` leaves a field as it is.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SetAttr {
    pub perm: Option<u32>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    /// Truncate (down or up) to this size.
    pub size: Option<u64>,
    pub atime: Option<TimeSet>,
    pub mtime: Option<TimeSet>,
    /// Explicit ctime (only for restoring metadata; normally the server sets ctime itself).
    pub ctime: Option<Timestamp>,
}

/// A byte range of a file whose end neither overflows nor passes [`MAX_FILE_SIZE`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ByteRange {
    offset: u64,
    len: u64,
}

impl ByteRange {
    pub fn new(offset: u64, len: u64) -> Result<ByteRange, ProtocolError> {
        match offset.checked_add(len) {
            Some(end) if end <= MAX_FILE_SIZE => Ok(ByteRange { offset, len }),
            _ => Err(ProtocolError::RangeOverflow { offset, len }),
        }
    }

    pub fn offset(&self) -> u64 {
        self.offset
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// One past the last byte.
    pub fn end(&self) -> u64 {
        self.offset + self.len
    }

    /// Whether the two ranges share at least one byte.
    pub fn overlaps(&self, other: &ByteRange) -> bool {
        self.offset < other.end() && other.offset < self.end()
    }
}

/// How a rename treats an existing target (renameat2 flags).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RenameMode {
    /// Replace the target if it exists (plain rename).
    #[default]
    Replace,
    /// Fail with `EEXIST` if the target exists (RENAME_NOREPLACE).
    NoReplace,
    /// Swap source and target, both must exist (RENAME_EXCHANGE).
    Exchange,
}

/// How a setxattr treats an existing attribute.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum XattrMode {
    #[default]
    Either,
    /// XATTR_CREATE: fail with `EEXIST` if it exists.
    Create,
    /// XATTR_REPLACE: fail with `ENODATA` if it does not.
    Replace,
}

/// A file-system error, shaped after the errno a POSIX caller expects. The server maps it to
/// a gRPC status carrying the errno; the agent maps it back to the errno FUSE returns.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FsError {
    #[error("no such file or directory")]
    NotFound,
    #[error("file exists")]
    Exists,
    #[error("not a directory")]
    NotDir,
    #[error("is a directory")]
    IsDir,
    #[error("directory not empty")]
    NotEmpty,
    #[error("permission denied")]
    Access,
    #[error("operation not permitted")]
    Perm,
    #[error("file name too long")]
    NameTooLong,
    #[error("invalid argument: {0}")]
    Invalid(String),
    #[error("no space left on the volume")]
    NoSpace,
    #[error("disk quota exceeded")]
    QuotaExceeded,
    #[error("too many links")]
    TooManyLinks,
    #[error("file too large")]
    FileTooBig,
    #[error("no such attribute")]
    NoAttr,
    #[error("result does not fit the caller's buffer")]
    Range,
    #[error("not a symbolic link")]
    NotSymlink,
    #[error("stale handle")]
    Stale,
    #[error("session expired or from an older server epoch")]
    StaleSession,
    #[error("timed out waiting for a lock")]
    LockTimeout,
    #[error("I/O error: {0}")]
    Io(String),
    #[error("operation not supported")]
    NotSupported,
    /// A rename or link across directory quotas (as across file systems: `mv` copies).
    #[error("cross-device link (across directory quotas)")]
    CrossDevice,
    /// An advisory lock conflicts with one another owner holds (F_SETLK's EAGAIN).
    #[error("resource temporarily unavailable (a conflicting lock is held)")]
    WouldBlock,
    /// A wait (F_SETLKW) ended because the waiting process got a signal.
    #[error("interrupted")]
    Interrupted,
}

impl FsError {
    /// The Linux errno for this error.
    pub fn errno(&self) -> i32 {
        match self {
            FsError::NotFound => 2,        // ENOENT
            FsError::Exists => 17,         // EEXIST
            FsError::NotDir => 20,         // ENOTDIR
            FsError::IsDir => 21,          // EISDIR
            FsError::NotEmpty => 39,       // ENOTEMPTY
            FsError::Access => 13,         // EACCES
            FsError::Perm => 1,            // EPERM
            FsError::NameTooLong => 36,    // ENAMETOOLONG
            FsError::Invalid(_) => 22,     // EINVAL
            FsError::NoSpace => 28,        // ENOSPC
            FsError::QuotaExceeded => 122, // EDQUOT
            FsError::TooManyLinks => 31,   // EMLINK
            FsError::FileTooBig => 27,     // EFBIG
            FsError::NoAttr => 61,         // ENODATA
            FsError::Range => 34,          // ERANGE
            FsError::NotSymlink => 22,     // EINVAL (readlink of a non-symlink)
            FsError::Stale => 116,         // ESTALE
            FsError::StaleSession => 116,  // ESTALE
            FsError::LockTimeout => 11,    // EAGAIN
            FsError::Io(_) => 5,           // EIO
            FsError::NotSupported => 95,   // EOPNOTSUPP
            FsError::CrossDevice => 18,    // EXDEV
            FsError::WouldBlock => 11,     // EAGAIN
            FsError::Interrupted => 4,     // EINTR
        }
    }
}

impl From<ProtocolError> for FsError {
    fn from(e: ProtocolError) -> FsError {
        match e.root() {
            ProtocolError::NameTooLong(_) | ProtocolError::SymlinkTargetTooLong(_) => {
                FsError::NameTooLong
            }
            ProtocolError::RangeOverflow { .. } => FsError::FileTooBig,
            _ => FsError::Invalid(e.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_checked() {
        assert!(FileName::new("a").is_ok());
        assert!(FileName::new(vec![b'x'; 255]).is_ok());
        assert_eq!(
            FileName::new(vec![b'x'; 256]),
            Err(ProtocolError::NameTooLong(256))
        );
        assert_eq!(FileName::new(""), Err(ProtocolError::EmptyName));
        assert_eq!(FileName::new("a/b"), Err(ProtocolError::NameHasSlashOrNul));
        assert_eq!(
            FileName::new(b"a\0".to_vec()),
            Err(ProtocolError::NameHasSlashOrNul)
        );
        assert_eq!(FileName::new(".."), Err(ProtocolError::NameIsDot));
    }

    #[test]
    fn xattr_names_and_symlink_targets_are_checked() {
        assert!(XattrName::new("user.a").is_ok());
        assert!(XattrName::new(vec![b'x'; 255]).is_ok());
        assert_eq!(
            XattrName::new(vec![b'x'; 256]),
            Err(ProtocolError::NameTooLong(256))
        );
        assert_eq!(XattrName::new(""), Err(ProtocolError::EmptyName));
        assert_eq!(
            XattrName::new(b"a\0".to_vec()),
            Err(ProtocolError::NameHasSlashOrNul)
        );
        assert!(XattrName::new("a/b").is_ok());
        assert!(SymlinkTarget::new("../a/b").is_ok());
        assert!(SymlinkTarget::new(vec![b'x'; 4096]).is_ok());
        let too_long = SymlinkTarget::new(vec![b'x'; 4097]).unwrap_err();
        assert_eq!(too_long, ProtocolError::SymlinkTargetTooLong(4097));
        // The message names the limit of targets (4096), not that of names (255).
        assert_eq!(
            too_long.to_string(),
            "symlink target is 4097 bytes long (at most 4096)"
        );
        assert_eq!(FsError::from(too_long), FsError::NameTooLong);
        assert!(SymlinkTarget::new("").is_err());
        assert!(SymlinkTarget::new(b"a\0b".to_vec()).is_err());
    }

    #[test]
    fn field_paths_and_root_causes() {
        let e = ProtocolError::InvalidField {
            field: "nsec",
            reason: "too big".into(),
        }
        .in_field("atime")
        .in_field("changes");
        assert_eq!(e.field_path().as_deref(), Some("changes.atime.nsec"));
        assert_eq!(
            e.to_string(),
            "in `changes`: in `atime`: field `nsec`: too big"
        );
        let e = ProtocolError::NameTooLong(300).in_field("name");
        assert_eq!(e.field_path().as_deref(), Some("name"));
        assert_eq!(e.root(), &ProtocolError::NameTooLong(300));
        assert_eq!(FsError::from(e), FsError::NameTooLong);
        let e = ProtocolError::RangeOverflow { offset: 1, len: 2 }.in_field("range");
        assert_eq!(FsError::from(e), FsError::FileTooBig);
        assert_eq!(ProtocolError::EmptyName.field_path(), None);
        assert_eq!(
            FsError::from(ProtocolError::EmptyName.in_field("name")),
            FsError::Invalid("in `name`: name is empty".into())
        );
    }

    #[test]
    fn ranges_never_overflow() {
        assert!(ByteRange::new(0, MAX_FILE_SIZE).is_ok());
        assert!(ByteRange::new(1, MAX_FILE_SIZE).is_err());
        assert!(ByteRange::new(u64::MAX, 2).is_err());
        let a = ByteRange::new(10, 10).unwrap();
        assert!(a.overlaps(&ByteRange::new(19, 5).unwrap()));
        assert!(!a.overlaps(&ByteRange::new(20, 5).unwrap()));
    }
}
