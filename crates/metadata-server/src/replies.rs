//! The reply cache of non-idempotent requests (Create, Mkdir, Mknod, Symlink, Link, Rename,
//! Unlink, Rmdir, and proxied appends).
//!
//! An agent retries a call whose reply it never got (the server restarted, the connection
//! broke). For these requests running again is wrong: the first try may have committed, and a
//! second create or unlink would answer EEXIST or ENOENT. A request that carries a
//! [`RequestId`] is therefore run through [`run_once`]: the reply, encoded, is stored under
//! (agent instance, request seq) in the `replies` table **in the same transaction** as the
//! change, so both are durable together or lost together (a crash before the commit loses
//! both, and the retry runs the request afresh). A retry with the same ids gets the stored
//! reply and changes nothing.
//!
//! Bounded two ways: each request carries the lowest seq its agent may still retry, and this
//! agent's entries below it are dropped (at most [`PRUNE_BATCH`] per request); and entries
//! older than [`MAX_AGE_SECS`] are dropped by [`sweep`], which `serve` runs at start.
//!
//! A request id names one request: an entry also records the kind of request it answers
//! ([`Cached::KIND`]), and the same ids sent with another kind of request (a buggy or hostile
//! agent) are refused with EINVAL, never answered with the other request's reply.
//!
//! Stored value: version byte (2), the commit time (unix seconds, i64 LE), the session the
//! request came under (u64 LE), the request kind (u8, [`Cached::KIND`]), then the reply
//! message (protobuf). Version 1 (written before the kind was kept) has no kind byte; such
//! entries are still answered, unchecked, until they age out.

use prost::Message;
use redb::{ReadableTable, ReadableTableMetadata};
use sanfs_proto::model::RequestId;
use sanfs_proto::pb;
use sanfs_proto::types::FsError;

use crate::store::{Ctx, OpError, corrupt};

/// Format version of a stored reply.
const VERSION: u8 = 2;
/// The version before the request kind was stored.
const VERSION_1: u8 = 1;
/// Version, time, session.
const HEADER_1: usize = 1 + 8 + 8;
/// Version, time, session, kind.
const HEADER: usize = HEADER_1 + 1;

/// A reply the cache stores, and the kind of request it answers.
pub trait Cached: Message + Default {
    /// The request kind in a stored entry; never reused for another kind.
    const KIND: u8;
    /// The request's name, for the error that refuses a reused id.
    const REQUEST: &'static str;
}

macro_rules! cached {
    ($($reply:ty => $kind:literal, $name:literal;)*) => {
        $(impl Cached for $reply {
            const KIND: u8 = $kind;
            const REQUEST: &'static str = $name;
        })*

        /// The request name of a stored kind.
        fn request_name(kind: u8) -> &'static str {
            match kind {
                $($kind => $name,)*
                _ => "unknown",
            }
        }
    };
}

cached! {
    pb::CreateReply => 1, "Create";
    pb::MkdirReply => 2, "Mkdir";
    pb::MknodReply => 3, "Mknod";
    pb::SymlinkReply => 4, "Symlink";
    pb::LinkReply => 5, "Link";
    pb::RenameReply => 6, "Rename";
    pb::UnlinkReply => 7, "Unlink";
    pb::RmdirReply => 8, "Rmdir";
    pb::WriteReply => 9, "Write (append)";
}
/// Replies older than this are forgotten (an agent retries within minutes, or never).
pub const MAX_AGE_SECS: i64 = 3600;
/// At most this many of an agent's entries below its lowest pending request are dropped by
/// one request (the rest by the following ones).
pub const PRUNE_BATCH: usize = 64;

/// A stored reply, and the session its request came under.
#[derive(Debug, Clone, PartialEq)]
pub struct Stored<P> {
    pub reply: P,
    pub session: u64,
}

/// What [`run_once`] did.
#[derive(Debug, Clone, PartialEq)]
pub enum Once<P> {
    /// The request ran now.
    Fresh(P),
    /// It had run before: its stored reply.
    Replayed(Stored<P>),
}

impl<P> Once<P> {
    /// The reply, fresh or stored.
    pub fn into_reply(self) -> P {
        match self {
            Once::Fresh(p) => p,
            Once::Replayed(s) => s.reply,
        }
    }
}

/// Runs `op` (a non-idempotent change answering `P`) once per `id`: a request seen before
/// gets its stored reply; a new one runs, and its reply is stored in the same transaction.
/// Without an id, `op` just runs. `session` is the session the request came under.
pub fn run_once<P: Cached>(
    ctx: &mut Ctx<'_>,
    id: Option<RequestId>,
    session: u64,
    op: impl FnOnce(&mut Ctx<'_>) -> Result<P, OpError>,
) -> Result<Once<P>, OpError> {
    let Some(id) = id else {
        return op(ctx).map(Once::Fresh);
    };
    if let Some(stored) = lookup(ctx, id)? {
        return Ok(Once::Replayed(stored));
    }
    let reply = op(ctx)?;
    remember(ctx, id, session, &reply)?;
    Ok(Once::Fresh(reply))
}

/// The stored reply of request `id`, if it ran before (and drops its agent's entries it may
/// no longer retry). For a request that must be looked up before its change can be made
/// (a proxied append writes the LUNs first), followed by [`remember`] in the change's own
/// transaction. Ids that answered another kind of request: [`FsError::Invalid`].
pub fn lookup<P: Cached>(ctx: &mut Ctx<'_>, id: RequestId) -> Result<Option<Stored<P>>, OpError> {
    prune_below(ctx, id)?;
    let hit = ctx
        .replies
        .get((id.client, id.seq))?
        .map(|v| v.value().to_vec());
    hit.map(|bytes| decode(id, &bytes)).transpose()
}

/// Stores `reply` as request `id`'s, in the transaction of the change it answers.
pub fn remember<P: Cached>(
    ctx: &mut Ctx<'_>,
    id: RequestId,
    session: u64,
    reply: &P,
) -> Result<(), OpError> {
    let bytes = encode(ctx.now.sec, session, reply);
    ctx.replies.insert((id.client, id.seq), bytes.as_slice())?;
    Ok(())
}

fn encode<P: Cached>(at: i64, session: u64, reply: &P) -> Vec<u8> {
    let mut v = Vec::with_capacity(HEADER + reply.encoded_len());
    v.push(VERSION);
    v.extend_from_slice(&at.to_le_bytes());
    v.extend_from_slice(&session.to_le_bytes());
    v.push(P::KIND);
    reply.encode(&mut v).unwrap_or_default();
    v
}

/// When a stored reply was stored (unix seconds).
fn stored_at(bytes: &[u8]) -> Result<i64, OpError> {
    match bytes {
        [v, rest @ ..]
            if (*v == VERSION && rest.len() >= HEADER - 1)
                || (*v == VERSION_1 && rest.len() >= HEADER_1 - 1) =>
        {
            let mut at = [0u8; 8];
            at.copy_from_slice(&rest[..8]);
            Ok(i64::from_le_bytes(at))
        }
        [v, ..] => Err(corrupt(
            "stored reply",
            format!("version {v} or {} bytes", bytes.len()),
        )),
        [] => Err(corrupt("stored reply", "empty")),
    }
}

fn decode<P: Cached>(id: RequestId, bytes: &[u8]) -> Result<Stored<P>, OpError> {
    stored_at(bytes)?;
    let mut session = [0u8; 8];
    session.copy_from_slice(&bytes[9..HEADER_1]);
    let message = match bytes[0] {
        VERSION_1 => &bytes[HEADER_1..],
        _ => {
            let kind = bytes[HEADER_1];
            if kind != P::KIND {
                return Err(OpError::Fs(FsError::Invalid(format!(
                    "request id {}/{} named an earlier {} request: not usable for a {}",
                    id.client,
                    id.seq,
                    request_name(kind),
                    P::REQUEST
                ))));
            }
            &bytes[HEADER..]
        }
    };
    let reply = P::decode(message).map_err(|e| corrupt("stored reply", e))?;
    Ok(Stored {
        reply,
        session: u64::from_le_bytes(session),
    })
}

/// Drops (some of) `id.client`'s entries below `id.lowest_pending`.
fn prune_below(ctx: &mut Ctx<'_>, id: RequestId) -> Result<(), OpError> {
    if id.lowest_pending <= 1 {
        return Ok(());
    }
    let old: Vec<(u64, u64)> = ctx
        .replies
        .range((id.client, 0)..(id.client, id.lowest_pending))?
        .take(PRUNE_BATCH)
        .map(|r| r.map(|(k, _)| k.value()))
        .collect::<Result<_, _>>()?;
    for k in old {
        ctx.replies.remove(k)?;
    }
    Ok(())
}

/// Drops every entry older than [`MAX_AGE_SECS`]; returns how many.
pub fn sweep(ctx: &mut Ctx<'_>) -> Result<u64, OpError> {
    let limit = ctx.now.sec.saturating_sub(MAX_AGE_SECS);
    let mut old = Vec::new();
    for r in ctx.replies.iter()? {
        let (k, v) = r?;
        // A damaged entry goes too: it can only be a retry's answer, never data.
        if stored_at(v.value()).is_ok_and(|at| at >= limit) {
            continue;
        }
        old.push(k.value());
    }
    for k in &old {
        ctx.replies.remove(*k)?;
    }
    Ok(old.len() as u64)
}

/// Entries in the cache now (for tests and inspection).
pub fn count(ctx: &Ctx<'_>) -> Result<u64, OpError> {
    Ok(ctx.replies.len()?)
}
