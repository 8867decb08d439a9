//! The one place that maps file-system errors to gRPC statuses and back.
//!
//! The server turns an [`FsError`] into a [`Status`] with [`status_from_fs_error`] (or
//! `Status::from`); the gRPC code is chosen so that generic gRPC tooling sees a sensible
//! class of failure, and two ASCII metadata entries carry what the agent needs to give FUSE
//! the exact errno:
//!
//! - `sanfs-errno`: the Linux errno in decimal (`2` for ENOENT);
//! - `sanfs-error`: the error kind (`not_found`, `stale_session`, ...), which tells apart
//!   errors that share an errno (ESTALE: a stale handle or a stale session).
//!
//! The status message carries the human text (and the detail of `Invalid` and `Io`). The
//! agent turns any status back into an [`FsError`] with [`fs_error_from_status`]: by the kind
//! when present, else by the errno, else by the gRPC code (a status that never reached the
//! server, such as a broken connection, becomes `Io`). [`is_server_error`] says whether a
//! status came from the sanfs server at all, so that the agent can tell "the file does not
//! exist" from "the server is unreachable" and reconnect only for the latter.
//!
//! A request the server could not even decode ([`ProtocolError`]) is answered with
//! `INVALID_ARGUMENT`, the field path in `sanfs-field`, and the errno that
//! `FsError::from(ProtocolError)` gives (ENAMETOOLONG for an over-long name, EFBIG for a
//! range past the largest file size, EINVAL otherwise).

use tonic::metadata::{MetadataMap, MetadataValue};
use tonic::{Code, Status};

use crate::types::{FsError, ProtocolError};

/// Metadata key of the Linux errno (decimal).
pub const ERRNO_KEY: &str = "sanfs-errno";
/// Metadata key of the error kind.
pub const ERROR_KIND_KEY: &str = "sanfs-error";
/// Metadata key of the dotted field path of a [`ProtocolError`].
pub const FIELD_KEY: &str = "sanfs-field";

/// The gRPC code of each error.
pub fn code_of(e: &FsError) -> Code {
    match e {
        FsError::NotFound | FsError::NoAttr | FsError::Stale => Code::NotFound,
        FsError::Exists => Code::AlreadyExists,
        FsError::NotDir
        | FsError::IsDir
        | FsError::NotEmpty
        | FsError::NotSymlink
        | FsError::TooManyLinks
        | FsError::StaleSession
        | FsError::CrossDevice
        | FsError::WouldBlock => Code::FailedPrecondition,
        FsError::Access | FsError::Perm => Code::PermissionDenied,
        FsError::NameTooLong | FsError::Invalid(_) => Code::InvalidArgument,
        FsError::NoSpace | FsError::QuotaExceeded => Code::ResourceExhausted,
        FsError::FileTooBig | FsError::Range => Code::OutOfRange,
        FsError::LockTimeout => Code::Aborted,
        FsError::Interrupted => Code::Cancelled,
        FsError::Io(_) => Code::Internal,
        FsError::NotSupported => Code::Unimplemented,
    }
}

/// The `sanfs-error` kind of each error.
pub fn kind_of(e: &FsError) -> &'static str {
    match e {
        FsError::NotFound => "not_found",
        FsError::Exists => "exists",
        FsError::NotDir => "not_dir",
        FsError::IsDir => "is_dir",
        FsError::NotEmpty => "not_empty",
        FsError::Access => "access",
        FsError::Perm => "perm",
        FsError::NameTooLong => "name_too_long",
        FsError::Invalid(_) => "invalid",
        FsError::NoSpace => "no_space",
        FsError::QuotaExceeded => "quota_exceeded",
        FsError::TooManyLinks => "too_many_links",
        FsError::FileTooBig => "file_too_big",
        FsError::NoAttr => "no_attr",
        FsError::Range => "range",
        FsError::NotSymlink => "not_symlink",
        FsError::Stale => "stale",
        FsError::StaleSession => "stale_session",
        FsError::LockTimeout => "lock_timeout",
        FsError::Io(_) => "io",
        FsError::NotSupported => "not_supported",
        FsError::CrossDevice => "cross_device",
        FsError::WouldBlock => "would_block",
        FsError::Interrupted => "interrupted",
    }
}

/// The error of a kind; `message` is the detail of `invalid` and `io`.
fn from_kind(kind: &str, message: &str) -> Option<FsError> {
    Some(match kind {
        "not_found" => FsError::NotFound,
        "exists" => FsError::Exists,
        "not_dir" => FsError::NotDir,
        "is_dir" => FsError::IsDir,
        "not_empty" => FsError::NotEmpty,
        "access" => FsError::Access,
        "perm" => FsError::Perm,
        "name_too_long" => FsError::NameTooLong,
        "invalid" => FsError::Invalid(message.to_owned()),
        "no_space" => FsError::NoSpace,
        "quota_exceeded" => FsError::QuotaExceeded,
        "cross_device" => FsError::CrossDevice,
        "too_many_links" => FsError::TooManyLinks,
        "file_too_big" => FsError::FileTooBig,
        "no_attr" => FsError::NoAttr,
        "range" => FsError::Range,
        "not_symlink" => FsError::NotSymlink,
        "stale" => FsError::Stale,
        "stale_session" => FsError::StaleSession,
        "lock_timeout" => FsError::LockTimeout,
        "io" => FsError::Io(message.to_owned()),
        "not_supported" => FsError::NotSupported,
        "would_block" => FsError::WouldBlock,
        "interrupted" => FsError::Interrupted,
        _ => return None,
    })
}

/// The most likely error for an errno without a kind (a peer that sets only `sanfs-errno`).
fn from_errno(errno: i32, message: &str) -> FsError {
    match errno {
        2 => FsError::NotFound,
        17 => FsError::Exists,
        20 => FsError::NotDir,
        21 => FsError::IsDir,
        39 => FsError::NotEmpty,
        13 => FsError::Access,
        1 => FsError::Perm,
        36 => FsError::NameTooLong,
        22 => FsError::Invalid(message.to_owned()),
        28 => FsError::NoSpace,
        122 => FsError::QuotaExceeded,
        31 => FsError::TooManyLinks,
        27 => FsError::FileTooBig,
        61 => FsError::NoAttr,
        34 => FsError::Range,
        116 => FsError::Stale,
        11 => FsError::LockTimeout,
        95 => FsError::NotSupported,
        18 => FsError::CrossDevice,
        4 => FsError::Interrupted,
        _ => FsError::Io(format!("errno {errno}: {message}")),
    }
}

/// The error for a gRPC code alone (no sanfs metadata: the status came from the transport or
/// from something that is not a sanfs server).
fn from_code(code: Code, message: &str) -> FsError {
    match code {
        Code::NotFound => FsError::NotFound,
        Code::AlreadyExists => FsError::Exists,
        Code::PermissionDenied | Code::Unauthenticated => FsError::Access,
        Code::InvalidArgument | Code::FailedPrecondition => FsError::Invalid(message.to_owned()),
        Code::ResourceExhausted => FsError::NoSpace,
        Code::OutOfRange => FsError::Range,
        Code::Unimplemented => FsError::NotSupported,
        Code::Aborted => FsError::LockTimeout,
        Code::Ok
        | Code::Cancelled
        | Code::Unknown
        | Code::DeadlineExceeded
        | Code::Internal
        | Code::Unavailable
        | Code::DataLoss => FsError::Io(format!("{code:?}: {message}")),
    }
}

fn insert_ascii(md: &mut MetadataMap, key: &'static str, value: &str) {
    // The values written here are ASCII digits, kind names and field paths built from
    // `&'static str` field names; a value that is still not valid metadata is left out
    // rather than failing the reply.
    if let Ok(v) = MetadataValue::try_from(value) {
        md.insert(key, v);
    }
}

/// The status the server answers an [`FsError`] with.
pub fn status_from_fs_error(e: &FsError) -> Status {
    let mut status = Status::new(code_of(e), e.to_string());
    let md = status.metadata_mut();
    insert_ascii(md, ERRNO_KEY, &e.errno().to_string());
    insert_ascii(md, ERROR_KIND_KEY, kind_of(e));
    status
}

/// The status the server answers a request it could not decode with: `INVALID_ARGUMENT`,
/// the message naming the field, `sanfs-field` its path.
pub fn status_from_protocol_error(e: &ProtocolError) -> Status {
    let fs = FsError::from(e.clone());
    let mut status = Status::new(Code::InvalidArgument, e.to_string());
    let md = status.metadata_mut();
    insert_ascii(md, ERRNO_KEY, &fs.errno().to_string());
    insert_ascii(md, ERROR_KIND_KEY, kind_of(&fs));
    if let Some(path) = e.field_path() {
        insert_ascii(md, FIELD_KEY, &path);
    }
    status
}

impl From<FsError> for Status {
    fn from(e: FsError) -> Status {
        status_from_fs_error(&e)
    }
}

impl From<ProtocolError> for Status {
    fn from(e: ProtocolError) -> Status {
        status_from_protocol_error(&e)
    }
}

fn ascii<'a>(md: &'a MetadataMap, key: &str) -> Option<&'a str> {
    md.get(key).and_then(|v| v.to_str().ok())
}

/// Whether the status carries sanfs error metadata, i.e. came from a sanfs server's handler
/// rather than from the transport.
pub fn is_server_error(status: &Status) -> bool {
    status.metadata().contains_key(ERROR_KIND_KEY) || status.metadata().contains_key(ERRNO_KEY)
}

/// The errno the server sent, if it sent one.
pub fn errno_of(status: &Status) -> Option<i32> {
    ascii(status.metadata(), ERRNO_KEY).and_then(|s| s.parse().ok())
}

/// The [`FsError`] a status stands for. Never fails: an unknown kind falls back to the errno,
/// and a status without sanfs metadata to its gRPC code (transport failures become `Io`).
///
/// For `Invalid` and `Io` the detail is the status message. As [`status_from_fs_error`]
/// puts the error's `Display` text there ("invalid argument: DETAIL", "I/O error: DETAIL"),
/// that prefix is removed again so that an error survives the round trip unchanged.
pub fn fs_error_from_status(status: &Status) -> FsError {
    let message = status.message();
    let md = status.metadata();
    if let Some(kind) = ascii(md, ERROR_KIND_KEY) {
        let detail = match kind {
            "invalid" => message.strip_prefix("invalid argument: "),
            "io" => message.strip_prefix("I/O error: "),
            _ => None,
        }
        .unwrap_or(message);
        if let Some(e) = from_kind(kind, detail) {
            return e;
        }
    }
    if let Some(errno) = errno_of(status) {
        return from_errno(errno, message);
    }
    from_code(status.code(), message)
}

/// The field path of a protocol error status (`sanfs-field`), if any.
pub fn field_of(status: &Status) -> Option<&str> {
    ascii(status.metadata(), FIELD_KEY)
}
