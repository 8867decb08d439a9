//! The validated domain model of every `sanfs.v1` request and reply, and its conversions.
//!
//! Each RPC has a domain type here. The receiving side converts the generated protobuf type
//! ([`crate::pb`]) with `TryFrom`, which rejects missing fields, zero ids, bad names,
//! overflowing ranges, bad timestamps, unknown enum values and oversized payloads with a
//! [`ProtocolError`] naming the field; the sending side converts with `From`. So the server
//! implements `TryFrom<pb::XRequest> for XRequest` + `From<XReply> for pb::XReply`, and the
//! agent uses the other two directions; both are here so that a round trip is testable.
//!
//! Checks that need server state (does the inode exist, is the range block aligned, does
//! the grant belong to this session) are the server's; checks that need the volume (does a
//! device index exist) are the agent's, at planning time. Everything that can be checked on
//! the message alone is checked here, once.
//!
//! - `common`: credentials, timestamps, attributes, setattr changes, device ids.
//! - [`session`]: OpenSession, CloseSession and the session stream events.
//! - [`namespace`]: the POSIX metadata operations.
//! - [`data`]: map requests, grants (I/O plans), completions, the proxied path, extents.
//! - [`admin`]: the volume layout, server status, directory quotas.
//! - [`locks`]: cluster-wide POSIX advisory record locks.

pub mod admin;
mod common;
pub mod data;
pub mod locks;
pub mod namespace;
pub mod session;

pub use admin::*;
pub use data::*;
pub use locks::*;
pub use namespace::*;
pub use session::*;

use crate::types::{
    ByteRange, FileName, GrantId, InodeId, OpenHandle, ProtocolError, SessionEpoch, SessionId,
};

/// The protocol version of `sanfs.v1` (sent in `OpenSessionRequest.protocol_version`).
pub const PROTOCOL_VERSION: u32 = 1;

/// Hard cap on the inline payload of a proxied Read or Write: 8 MiB. A server may configure
/// a lower `max_inline_bytes`; no message above this is ever accepted.
pub const MAX_INLINE_DATA: usize = 8 << 20;

/// The gRPC message size both ends must allow (tonic's default is 4 MiB): the largest
/// inline payload plus room for the rest of the message.
pub const MAX_MESSAGE_SIZE: usize = MAX_INLINE_DATA + (1 << 20);

/// Most supplementary groups in [`crate::types::Credentials`] (Linux NGROUPS_MAX).
pub const MAX_GROUPS: usize = 65536;

/// Most entries one ReadDir reply carries.
pub const MAX_READDIR_ENTRIES: u32 = 4096;

/// Most devices (LUNs) in a volume.
pub const MAX_VOLUME_DEVICES: usize = 4096;

/// Most segments in a volume.
pub const MAX_VOLUME_SEGMENTS: usize = 65536;

/// Most legs (stripe width) of one segment.
pub const MAX_SEGMENT_LEGS: usize = 4096;

/// Most grant ids named in one recall, acknowledgement or return.
pub const MAX_GRANTS_PER_MESSAGE: usize = 65536;

/// Longest free-text string (client name, host, versions, LVM names), bytes.
pub const MAX_TEXT_LEN: usize = 255;

/// Readdir cookies below this value are reserved: 0 starts a listing, 1 and 2 are the
/// agent's `.` and `..`.
pub const FIRST_DIR_COOKIE: u64 = 3;

/// Adds the field a nested error was found in.
pub(crate) trait At<T> {
    fn at(self, field: &'static str) -> Result<T, ProtocolError>;
}

impl<T> At<T> for Result<T, ProtocolError> {
    fn at(self, field: &'static str) -> Result<T, ProtocolError> {
        self.map_err(|e| e.in_field(field))
    }
}

pub(crate) fn invalid(field: &'static str, reason: impl Into<String>) -> ProtocolError {
    ProtocolError::InvalidField {
        field,
        reason: reason.into(),
    }
}

/// A message-typed field that must be present.
pub(crate) fn required<T>(value: Option<T>, field: &'static str) -> Result<T, ProtocolError> {
    value.ok_or(ProtocolError::MissingField(field))
}

/// A required message field, converted.
pub(crate) fn required_msg<P, D>(value: Option<P>, field: &'static str) -> Result<D, ProtocolError>
where
    D: TryFrom<P, Error = ProtocolError>,
{
    D::try_from(required(value, field)?).at(field)
}

pub(crate) fn inode(raw: u64, field: &'static str) -> Result<InodeId, ProtocolError> {
    if raw == 0 {
        return Err(invalid(field, "inode 0 does not exist"));
    }
    Ok(InodeId(raw))
}

pub(crate) fn session_id(raw: u64) -> Result<SessionId, ProtocolError> {
    if raw == 0 {
        return Err(ProtocolError::MissingField("session"));
    }
    Ok(SessionId(raw))
}

pub(crate) fn epoch(raw: u64) -> Result<SessionEpoch, ProtocolError> {
    if raw == 0 {
        return Err(ProtocolError::MissingField("epoch"));
    }
    Ok(SessionEpoch(raw))
}

pub(crate) fn grant_id(raw: u64, field: &'static str) -> Result<GrantId, ProtocolError> {
    if raw == 0 {
        return Err(invalid(field, "grant id 0 is never issued"));
    }
    Ok(GrantId(raw))
}

pub(crate) fn handle(raw: u64) -> Result<OpenHandle, ProtocolError> {
    if raw == 0 {
        return Err(ProtocolError::MissingField("handle"));
    }
    Ok(OpenHandle(raw))
}

/// A non-empty list of grant ids, none 0, at most [`MAX_GRANTS_PER_MESSAGE`].
pub(crate) fn grant_ids(raw: Vec<u64>, field: &'static str) -> Result<Vec<GrantId>, ProtocolError> {
    if raw.is_empty() {
        return Err(invalid(field, "names no grant"));
    }
    if raw.len() > MAX_GRANTS_PER_MESSAGE {
        return Err(invalid(
            field,
            format!(
                "names {} grants (at most {MAX_GRANTS_PER_MESSAGE})",
                raw.len()
            ),
        ));
    }
    raw.into_iter().map(|g| grant_id(g, field)).collect()
}

pub(crate) fn file_name(bytes: Vec<u8>, field: &'static str) -> Result<FileName, ProtocolError> {
    FileName::new(bytes).at(field)
}

pub(crate) fn byte_range(
    offset: u64,
    len: u64,
    field: &'static str,
) -> Result<ByteRange, ProtocolError> {
    ByteRange::new(offset, len).at(field)
}

/// A byte range that must not be empty.
pub(crate) fn nonempty_range(
    offset: u64,
    len: u64,
    field: &'static str,
) -> Result<ByteRange, ProtocolError> {
    if len == 0 {
        return Err(invalid(field, "length is 0"));
    }
    byte_range(offset, len, field)
}

/// A free-text string of at most [`MAX_TEXT_LEN`] bytes (optionally required non-empty).
pub(crate) fn text(
    value: String,
    field: &'static str,
    nonempty: bool,
) -> Result<String, ProtocolError> {
    if nonempty && value.is_empty() {
        return Err(ProtocolError::MissingField(field));
    }
    if value.len() > MAX_TEXT_LEN {
        return Err(invalid(
            field,
            format!("is {} bytes long (at most {MAX_TEXT_LEN})", value.len()),
        ));
    }
    Ok(value)
}

/// A byte payload of at most `max` bytes.
pub(crate) fn payload(
    value: Vec<u8>,
    field: &'static str,
    max: usize,
) -> Result<Vec<u8>, ProtocolError> {
    if value.len() > max {
        return Err(invalid(
            field,
            format!("is {} bytes long (at most {max})", value.len()),
        ));
    }
    Ok(value)
}

/// A permission-bits field: at most `0o7777`.
pub(crate) fn perm(raw: u32, field: &'static str) -> Result<u32, ProtocolError> {
    if raw > 0o7777 {
        return Err(invalid(field, format!("{raw:#o} has bits above 0o7777")));
    }
    Ok(raw)
}

/// A protobuf enum field: known and not the 0 (`*_UNSPECIFIED`) value.
pub(crate) fn enum_field<E>(raw: i32, field: &'static str) -> Result<E, ProtocolError>
where
    E: TryFrom<i32>,
{
    if raw == 0 {
        return Err(ProtocolError::MissingField(field));
    }
    E::try_from(raw).map_err(|_| invalid(field, format!("unknown value {raw}")))
}

/// Converts every element, naming the list field in the error.
pub(crate) fn list<P, D>(raw: Vec<P>, field: &'static str) -> Result<Vec<D>, ProtocolError>
where
    D: TryFrom<P, Error = ProtocolError>,
{
    raw.into_iter().map(|p| D::try_from(p).at(field)).collect()
}

/// Converts every element to its wire form.
pub(crate) fn to_pb<D, P: From<D>>(values: Vec<D>) -> Vec<P> {
    values.into_iter().map(P::from).collect()
}
