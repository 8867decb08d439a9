//! The request and reply headers (gRPC metadata) of namespace changes acknowledged before
//! they are durable (docs/protocol.md, "Namespace changes before they are durable"), read
//! into domain types here, at the boundary, like every message.
//!
//! - `sanfs-session: <session>` on a Namespace request: the session it is made under (the
//!   server checks that the session belongs to the caller's transport identity). A change
//!   made under a session may be answered before it is durable; a read under a session sees
//!   that session's own changes without waiting for them to be durable.
//! - `sanfs-commit: seq=<n>;durable=<d>` on the reply of a change: the number of the commit
//!   that holds it (0: durable already) and how far this epoch's commits are durable.
//! - `sanfs-replay: prev=<session>;epoch=<e>;seq=<n>[;ino=<i>;gen=<g>]` on a change the agent
//!   sends again to a restarted server: made under session `prev` of epoch `e` in its commit
//!   `n`; a create gives the inode number and generation it was answered.
//! - `sanfs-forget: <ino>[,<ino>...]` on the reply of a change made under a session: inodes
//!   whose attributes the change altered and on which that session holds an attribute lease
//!   (the server recalls every other holder's lease, never the changer's own: its agent drops
//!   what it cached of them when the reply arrives). At most [`MAX_FORGET`] inodes.
//! - `sanfs-dirs-bin: <ChangedDirs, protobuf>` on the reply of a change made under a session:
//!   the directories it altered as they are after it, and the changer's attribute leases on
//!   them ([`crate::model::ChangedDirs`]), so that its agent needs no `GetAttr` of them.

use tonic::metadata::{MetadataMap, MetadataValue};

use crate::types::{InodeId, ProtocolError, SessionEpoch, SessionId};

/// The header that names the request's session.
pub const SESSION: &str = "sanfs-session";
/// The header of a change's commit number on its reply.
pub const COMMIT: &str = "sanfs-commit";
/// The header that marks a replayed change.
pub const REPLAY: &str = "sanfs-replay";
/// The header of the inodes whose cached attributes the changer must drop.
pub const FORGET: &str = "sanfs-forget";
/// Inodes one `sanfs-forget` names at most (a change alters the attributes of a few).
pub const MAX_FORGET: usize = 16;
/// The header of the directories a change altered (binary: its name ends in `-bin`).
pub const DIRS: &str = "sanfs-dirs-bin";
/// The request header of open handles its session closes, released by the server with the
/// call (`ServerInfo.releases_with_changes`): `session:handle,handle,...`.
pub const RELEASE: &str = "sanfs-release";
/// Handles one `sanfs-release` names at most.
pub const MAX_RELEASE: usize = 64;

/// What `sanfs-commit` says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CommitNote {
    /// The commit that holds the change (0: durable already).
    pub seq: u64,
    /// Every commit of the server's epoch up to this one is durable.
    pub durable_seq: u64,
}

/// What `sanfs-replay` says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplayTag {
    /// The session the change was made under (of the last epoch).
    pub previous: SessionId,
    /// The server epoch that answered it.
    pub epoch: SessionEpoch,
    /// The number of the commit that held it in that epoch.
    pub commit_seq: u64,
    /// For a create: the inode number and generation it was answered; for an unlink or a
    /// rename: the inode it changed (the replay finds it done when the name names another).
    pub inode: Option<(InodeId, u64)>,
}

fn invalid(field: &'static str, reason: impl Into<String>) -> ProtocolError {
    ProtocolError::InvalidField {
        field,
        reason: reason.into(),
    }
}

fn text<'m>(m: &'m MetadataMap, name: &'static str) -> Result<Option<&'m str>, ProtocolError> {
    match m.get(name) {
        None => Ok(None),
        Some(v) => v.to_str().map(Some).map_err(|_| invalid(name, "not ASCII")),
    }
}

/// `k=v;k=v` into its values, every key known and given once.
fn fields<const N: usize>(
    name: &'static str,
    s: &str,
    keys: [&str; N],
) -> Result<[Option<u64>; N], ProtocolError> {
    let mut out = [None; N];
    for part in s.split(';') {
        let (k, v) = part
            .split_once('=')
            .ok_or_else(|| invalid(name, format!("{part:?} is not key=value")))?;
        let i = keys
            .iter()
            .position(|key| *key == k)
            .ok_or_else(|| invalid(name, format!("unknown key {k:?}")))?;
        if out[i].is_some() {
            return Err(invalid(name, format!("{k:?} given twice")));
        }
        out[i] = Some(
            v.parse::<u64>()
                .map_err(|_| invalid(name, format!("{k}={v:?} is not a number")))?,
        );
    }
    Ok(out)
}

fn put(m: &mut MetadataMap, name: &'static str, value: String) {
    // Digits, '=' and ';' only: always a valid header value.
    if let Ok(v) = MetadataValue::try_from(value) {
        m.insert(name, v);
    }
}

/// The request's `sanfs-session`, if any (never 0).
pub fn session(m: &MetadataMap) -> Result<Option<SessionId>, ProtocolError> {
    let Some(s) = text(m, SESSION)? else {
        return Ok(None);
    };
    match s.parse::<u64>() {
        Ok(0) => Err(invalid(SESSION, "session 0")),
        Ok(n) => Ok(Some(SessionId(n))),
        Err(_) => Err(invalid(SESSION, format!("{s:?} is not a number"))),
    }
}

/// Sets `sanfs-session`.
pub fn set_session(m: &mut MetadataMap, session: SessionId) {
    put(m, SESSION, session.0.to_string());
}

/// The reply's `sanfs-commit`, if any.
pub fn commit(m: &MetadataMap) -> Result<Option<CommitNote>, ProtocolError> {
    let Some(s) = text(m, COMMIT)? else {
        return Ok(None);
    };
    match fields(COMMIT, s, ["seq", "durable"])? {
        [Some(seq), Some(durable_seq)] => Ok(Some(CommitNote { seq, durable_seq })),
        _ => Err(invalid(COMMIT, "needs seq and durable")),
    }
}

/// Sets `sanfs-commit`.
pub fn set_commit(m: &mut MetadataMap, note: CommitNote) {
    put(
        m,
        COMMIT,
        format!("seq={};durable={}", note.seq, note.durable_seq),
    );
}

/// The reply's `sanfs-forget` (empty without one).
pub fn forget(m: &MetadataMap) -> Result<Vec<InodeId>, ProtocolError> {
    let Some(s) = text(m, FORGET)? else {
        return Ok(Vec::new());
    };
    let mut out = Vec::new();
    for part in s.split(',') {
        if out.len() == MAX_FORGET {
            return Err(invalid(FORGET, format!("more than {MAX_FORGET} inodes")));
        }
        match part.parse::<u64>() {
            Ok(n) if n != 0 => out.push(InodeId(n)),
            _ => return Err(invalid(FORGET, format!("{part:?} is not an inode number"))),
        }
    }
    Ok(out)
}

/// Sets `sanfs-forget` (nothing when `inodes` is empty; only the first [`MAX_FORGET`]).
pub fn set_forget(m: &mut MetadataMap, inodes: &[InodeId]) {
    if inodes.is_empty() {
        return;
    }
    let list: Vec<String> = inodes
        .iter()
        .take(MAX_FORGET)
        .map(|i| i.0.to_string())
        .collect();
    put(m, FORGET, list.join(","));
}

/// Handles a request's `sanfs-release` names, with their session (`None` without one).
pub fn release(m: &MetadataMap) -> Result<Option<(SessionId, Vec<u64>)>, ProtocolError> {
    let Some(s) = text(m, RELEASE)? else {
        return Ok(None);
    };
    let Some((session, list)) = s.split_once(':') else {
        return Err(invalid(RELEASE, "no session"));
    };
    let session = match session.parse::<u64>() {
        Ok(n) if n != 0 => SessionId(n),
        _ => return Err(invalid(RELEASE, format!("{session:?} is not a session"))),
    };
    let mut handles = Vec::new();
    for part in list.split(',') {
        if handles.len() == MAX_RELEASE {
            return Err(invalid(RELEASE, format!("more than {MAX_RELEASE} handles")));
        }
        match part.parse::<u64>() {
            Ok(n) if n != 0 => handles.push(n),
            _ => return Err(invalid(RELEASE, format!("{part:?} is not a handle"))),
        }
    }
    Ok(Some((session, handles)))
}

/// Sets `sanfs-release` (nothing when `handles` is empty; only the first [`MAX_RELEASE`]).
pub fn set_release(m: &mut MetadataMap, session: SessionId, handles: &[u64]) {
    if handles.is_empty() {
        return;
    }
    let list: Vec<String> = handles
        .iter()
        .take(MAX_RELEASE)
        .map(|h| h.to_string())
        .collect();
    put(m, RELEASE, format!("{}:{}", session.0, list.join(",")));
}

/// The reply's `sanfs-dirs-bin`, if any.
pub fn dirs(m: &MetadataMap) -> Result<Option<crate::model::ChangedDirs>, ProtocolError> {
    let Some(v) = m.get_bin(DIRS) else {
        return Ok(None);
    };
    let bytes = v.to_bytes().map_err(|_| invalid(DIRS, "not base64"))?;
    let p = <crate::pb::ChangedDirs as prost::Message>::decode(bytes.as_ref())
        .map_err(|e| invalid(DIRS, format!("not a ChangedDirs: {e}")))?;
    crate::model::ChangedDirs::try_from(p).map(Some)
}

/// Sets `sanfs-dirs-bin`.
pub fn set_dirs(m: &mut MetadataMap, dirs: crate::model::ChangedDirs) {
    let bytes = prost::Message::encode_to_vec(&crate::pb::ChangedDirs::from(dirs));
    m.insert_bin(DIRS, tonic::metadata::MetadataValue::from_bytes(&bytes));
}

/// The request's `sanfs-replay`, if any.
pub fn replay(m: &MetadataMap) -> Result<Option<ReplayTag>, ProtocolError> {
    let Some(s) = text(m, REPLAY)? else {
        return Ok(None);
    };
    let [prev, epoch, seq, ino, generation] =
        fields(REPLAY, s, ["prev", "epoch", "seq", "ino", "gen"])?;
    let (Some(prev), Some(epoch), Some(seq)) = (prev, epoch, seq) else {
        return Err(invalid(REPLAY, "needs prev, epoch and seq"));
    };
    if prev == 0 || seq == 0 {
        return Err(invalid(REPLAY, "session or commit 0"));
    }
    let inode = match (ino, generation) {
        (None, None) => None,
        (Some(i), Some(g)) => Some((InodeId::new(i).map_err(|e| e.in_field(REPLAY))?, g)),
        _ => return Err(invalid(REPLAY, "ino and gen go together")),
    };
    Ok(Some(ReplayTag {
        previous: SessionId(prev),
        epoch: SessionEpoch(epoch),
        commit_seq: seq,
        inode,
    }))
}

/// Sets `sanfs-replay`.
pub fn set_replay(m: &mut MetadataMap, tag: &ReplayTag) {
    let mut s = format!(
        "prev={};epoch={};seq={}",
        tag.previous.0, tag.epoch.0, tag.commit_seq
    );
    if let Some((ino, generation)) = tag.inode {
        s.push_str(&format!(";ino={};gen={generation}", ino.0));
    }
    put(m, REPLAY, s);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip() {
        let mut m = MetadataMap::new();
        assert_eq!(session(&m).unwrap(), None);
        set_session(&mut m, SessionId(42));
        assert_eq!(session(&m).unwrap(), Some(SessionId(42)));
        let note = CommitNote {
            seq: 7,
            durable_seq: 5,
        };
        set_commit(&mut m, note);
        assert_eq!(commit(&m).unwrap(), Some(note));
        for inode in [None, Some((InodeId(9), 3))] {
            let tag = ReplayTag {
                previous: SessionId(4),
                epoch: SessionEpoch(2),
                commit_seq: 11,
                inode,
            };
            set_replay(&mut m, &tag);
            assert_eq!(replay(&m).unwrap(), Some(tag));
        }
        assert_eq!(forget(&m).unwrap(), vec![]);
        set_forget(&mut m, &[]);
        assert_eq!(m.get(FORGET), None);
        set_forget(&mut m, &[InodeId(3), InodeId(77)]);
        assert_eq!(forget(&m).unwrap(), vec![InodeId(3), InodeId(77)]);
        let many: Vec<InodeId> = (1..40).map(InodeId).collect();
        set_forget(&mut m, &many);
        assert_eq!(forget(&m).unwrap(), many[..MAX_FORGET].to_vec());
        assert_eq!(release(&m).unwrap(), None);
        set_release(&mut m, SessionId(5), &[]);
        assert_eq!(m.get(RELEASE), None);
        set_release(&mut m, SessionId(5), &[8, 13]);
        assert_eq!(release(&m).unwrap(), Some((SessionId(5), vec![8, 13])));
        let many: Vec<u64> = (1..100).collect();
        set_release(&mut m, SessionId(6), &many);
        assert_eq!(
            release(&m).unwrap(),
            Some((SessionId(6), many[..MAX_RELEASE].to_vec()))
        );
        for bad in ["", "5", "0:1", "x:1", "5:", "5:0", "5:1,,2", "5:-1"] {
            m.insert(RELEASE, bad.parse().unwrap());
            assert!(release(&m).is_err(), "{bad:?} was taken");
        }
        m.remove(RELEASE);
        assert_eq!(dirs(&m).unwrap(), None);
        let changed = crate::model::ChangedDirs {
            attrs: vec![dir_attr(1), dir_attr(7)],
            lease_ms: 10_000,
        };
        set_dirs(&mut m, changed.clone());
        assert_eq!(dirs(&m).unwrap(), Some(changed));
    }

    fn dir_attr(ino: u64) -> crate::types::Attr {
        let t = crate::types::Timestamp { sec: 1, nsec: 2 };
        crate::types::Attr {
            ino: InodeId(ino),
            kind: crate::types::FileType::Directory,
            perm: 0o755,
            nlink: 2,
            uid: 0,
            gid: 0,
            size: 0,
            allocated: 0,
            atime: t,
            mtime: t,
            ctime: t,
            btime: t,
            rdev: 0,
            generation: 1,
            no_xattrs: false,
        }
    }

    #[test]
    fn bad_dirs_headers_are_refused() {
        let mut m = MetadataMap::new();
        m.insert_bin(
            DIRS,
            tonic::metadata::MetadataValue::from_bytes(b"\xff\x01junk"),
        );
        assert!(dirs(&m).is_err());
        // Three directories, or a file among them.
        let mut file = dir_attr(3);
        file.kind = crate::types::FileType::Regular;
        for attrs in [
            vec![dir_attr(1), dir_attr(2), dir_attr(3)],
            vec![dir_attr(1), file],
        ] {
            let p = crate::pb::ChangedDirs {
                attrs: attrs.into_iter().map(Into::into).collect(),
                lease_ms: 1,
            };
            let mut m = MetadataMap::new();
            m.insert_bin(
                DIRS,
                tonic::metadata::MetadataValue::from_bytes(&prost::Message::encode_to_vec(&p)),
            );
            assert!(dirs(&m).is_err());
        }
    }

    #[test]
    fn bad_headers_are_refused() {
        for (name, value) in [
            (SESSION, "0"),
            (SESSION, "x"),
            (COMMIT, "seq=1"),
            (COMMIT, "seq=1;durable=2;seq=3"),
            (COMMIT, "seq=1;dur=2"),
            (REPLAY, "prev=1;epoch=2"),
            (REPLAY, "prev=0;epoch=2;seq=1"),
            (REPLAY, "prev=1;epoch=2;seq=1;ino=5"),
            (REPLAY, "prev=1;epoch=2;seq=1;ino=0;gen=1"),
            (REPLAY, "prev=1;epoch=2;seq=-1"),
            (FORGET, ""),
            (FORGET, "0"),
            (FORGET, "1,,2"),
            (FORGET, "1;2"),
            (FORGET, "1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17"),
        ] {
            let mut m = MetadataMap::new();
            m.insert(name, value.parse().unwrap());
            let r = match name {
                SESSION => session(&m).map(drop),
                COMMIT => commit(&m).map(drop),
                FORGET => forget(&m).map(drop),
                _ => replay(&m).map(drop),
            };
            assert!(r.is_err(), "{name}: {value} accepted");
        }
    }
}
