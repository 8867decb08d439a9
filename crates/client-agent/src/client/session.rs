//! The session task: the session stream (attach, heartbeats, recalls), the lease, fencing and
//! re-establishment.
//!
//! One task per [`super::Client`]. It attaches the stream, sends `Heartbeat {seq}` every
//! `lease_ttl_ms / 3` remembering each one's send time, and on `HeartbeatAck {seq}` moves the
//! lease deadline to that send time plus the TTL (never backwards). A `Recall` marks the
//! grants recalled in the cache at once (no new I/O starts on them), and a helper task sends
//! `RecallAck` once their I/O in flight is done.
//!
//! A new session's server must serve the mount's file system ([`super::Inner::admit_fs`]: with
//! several server addresses another file system's server may answer), and must not have a
//! lower epoch than the highest seen, nor another restore count than the mount's
//! ([`super::Inner::admit_epoch`]): a server on a store restored from an older copy, or of
//! another file system, is refused and asked again every 2 s, while calls fail with EIO.
//!
//! Outcomes of one attachment: the stream broke (or was replaced) while the lease is valid:
//! attach again to the same session; anything else (the lease deadline passed, the server
//! ended the session, a call or the attach answered `StaleSession`): fence and open a new
//! session, retrying with backoff while the server is unreachable.
//!
//! **Reclaim.** A new session of a new server epoch (the server restarted) is made current
//! only after the agent has replayed its records of lazily committed write completions
//! (`ReplayWrites`, see `unsynced`) and told the server its reclaim is complete, so no call of
//! the new session runs before the replay. Each `HeartbeatAck` carries the server's durable
//! commit number: records up to it are forgotten.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use sanfs_proto::headers::{self, ReplayTag};
use sanfs_proto::model::{
    ClientEvent, DelegateReply, DelegateRequest, LeaseRenew, MAX_REPLAY_RECORDS, OpenReply,
    OpenRequest, OpenSessionReply, ReplayOutcome, ReplayWritesReply, ReplayWritesRequest,
    ServerEvent, SessionEndReason, SessionRef,
};
use sanfs_proto::pb;
use sanfs_proto::pb::session_client::SessionClient;
use sanfs_proto::status::{fs_error_from_status, is_server_error};
use sanfs_proto::types::{FsError, GrantId, InodeId, SessionId};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

/// A heartbeat in flight: its seq, send time, and the leases it asked to renew with the
/// lease cache's mark taken then ([`super::leases::LeaseCache::renewal`]).
type SentHeartbeat = (u64, Instant, Option<(u64, LeaseRenew)>);

use super::{Inner, SessionView, bump, malformed, open_session, unsynced};

/// How one attachment of the stream ended.
enum Outcome {
    /// The stream is gone but the session may live: attach again.
    StreamBroke(String),
    /// The session is lost: fence, then open a new one.
    Lost(String),
    /// The server is stopping (a restart, a failover): fence and open a new session at the
    /// next server, but leave the session recorded there, since the next server's reclaim
    /// window is for it: this agent's replays of what the old server answered before it was
    /// durable go in under it.
    ServerStopping(String),
}

pub(super) async fn run(inner: Arc<Inner>, mut lost_rx: mpsc::UnboundedReceiver<SessionId>) {
    let mut seq = 0u64;
    let mut session = inner.lock_state().view.session;
    loop {
        let view = inner.lock_state().view.clone();
        if view.session != session {
            session = view.session;
            seq = 0;
        }
        let outcome = attach_and_serve(&inner, &view, &mut seq, &mut lost_rx).await;
        inner.attached_tx.send_replace(None);
        // Recalls cannot reach this agent until a stream is attached again (and a server
        // that went away forgot its leases): what it cached under them goes now, and so do
        // its create delegations.
        inner.leases.clear();
        inner.creates.forget(Some(view.session));
        match outcome {
            Outcome::StreamBroke(why) if inner.lease_valid(view.generation) => {
                tracing::warn!(session = %view.session, %why, "session stream broke: attaching again");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            lost => {
                let (why, close) = match lost {
                    Outcome::ServerStopping(why) => (why, false),
                    Outcome::StreamBroke(why) | Outcome::Lost(why) => (why, true),
                };
                fence(&inner, &view, &why, close).await;
                reopen(&inner).await;
                // Concurrently with attaching the new session's stream: reclaims wait for
                // nothing but the server's answers.
                tokio::spawn(super::locks::reclaim(inner.clone()));
            }
        }
    }
}

impl Inner {
    /// Waits (up to the lease term) until `session`'s stream is attached: what a mount
    /// waits for before it answers anything, so that its first files get their delegations
    /// (the server gives none to a session that cannot hear their recall). Past the term
    /// the agent goes on without them; they come once the stream is attached.
    pub(super) async fn stream_attached(&self, session: SessionId) {
        let ttl = Duration::from_millis(self.lock_state().lease_ttl_ms);
        let mut rx = self.attached_tx.subscribe();
        let attached = tokio::time::timeout(ttl, rx.wait_for(|s| *s == Some(session))).await;
        if attached.is_err() {
            tracing::warn!(%session, "the session stream is not attached yet: going on without delegations until it is");
        }
    }
}

async fn attach_and_serve(
    inner: &Arc<Inner>,
    view: &SessionView,
    seq: &mut u64,
    lost_rx: &mut mpsc::UnboundedReceiver<SessionId>,
) -> Outcome {
    if let Some(delay) = inner.config.faults.attach_delay {
        tokio::time::sleep(delay).await;
    }
    let (tx, rx) = mpsc::channel::<pb::SessionStreamRequest>(64);
    let attach = ClientEvent::Attach(SessionRef {
        session: view.session,
        epoch: view.epoch,
    });
    if tx.send(attach.into()).await.is_err() {
        return Outcome::StreamBroke("stream closed".to_owned());
    }
    // Attaching is bounded by the lease: a server that takes the stream but never answers
    // (one that is going down as the stream arrives) must not keep the lease unwatched.
    let lease_end = tokio::time::Instant::from_std(inner.lock_state().deadline);
    let attached = tokio::time::timeout_at(
        lease_end,
        SessionClient::new(inner.channel.clone()).session_stream(ReceiverStream::new(rx)),
    )
    .await;
    let Ok(attached) = attached else {
        return Outcome::Lost("lease lapsed while attaching the session stream".to_owned());
    };
    let mut stream = match attached {
        Ok(r) => r.into_inner(),
        Err(status) => {
            let e = fs_error_from_status(&status);
            return if e == FsError::StaleSession || is_server_error(&status) {
                Outcome::Lost(format!("attach refused: {e}"))
            } else {
                Outcome::StreamBroke(format!("attach failed: {e}"))
            };
        }
    };
    // Lease recalls sent while no stream was attached were lost: what this agent cached
    // under leases goes (the kernel's attributes included).
    inner.leases.clear();
    inner.creates.forget(Some(view.session));
    inner.attached_tx.send_replace(Some(view.session));
    let ttl_ms = inner.lock_state().lease_ttl_ms;
    let mut ticker = tokio::time::interval(Duration::from_millis((ttl_ms / 3).max(1)));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    // Each heartbeat's seq, send time, and the leases it asked to renew with their mark.
    let mut sent: VecDeque<SentHeartbeat> = VecDeque::new();
    loop {
        let deadline = tokio::time::Instant::from_std(inner.lock_state().deadline);
        tokio::select! {
            _ = ticker.tick() => {
                if inner.heartbeats_paused.load(Ordering::SeqCst) {
                    continue;
                }
                *seq += 1;
                // The leases cached here that would run out before the heartbeat after
                // next: renewed with this one while the server still holds them.
                let ttl_ms = inner.lock_state().lease_ttl_ms;
                let renewal = inner.leases.renewal(Duration::from_millis(ttl_ms * 2 / 3));
                let renew = renewal.as_ref().map(|(_, r)| r.clone());
                sent.push_back((*seq, Instant::now(), renewal));
                while sent.len() > 64 {
                    sent.pop_front();
                }
                // Never block the loop on a server that does not read: the lease deadline
                // must stay watched. A full queue skips this heartbeat.
                match tx.try_send(ClientEvent::Heartbeat { seq: *seq, renew }.into()) {
                    Ok(()) | Err(mpsc::error::TrySendError::Full(_)) => {}
                    Err(mpsc::error::TrySendError::Closed(_)) => {
                        return Outcome::StreamBroke("stream closed".to_owned());
                    }
                }
            }
            m = stream.message() => match m {
                Ok(Some(reply)) => match ServerEvent::try_from(reply) {
                    Ok(ServerEvent::HeartbeatAck { seq: acked, lease_ttl_ms, durable_seq, renewed }) => {
                        inner.lock_unsynced().durable(view.epoch, durable_seq);
                        if let Some((_, at, renewal)) = sent.iter().find(|(s, _, _)| *s == acked) {
                            let deadline = {
                                let mut s = inner.lock_state();
                                if s.live && s.view.generation == view.generation {
                                    let until = *at + Duration::from_millis(lease_ttl_ms);
                                    if until > s.deadline {
                                        s.deadline = until;
                                    }
                                    s.lease_ttl_ms = lease_ttl_ms;
                                    Some(s.deadline)
                                } else {
                                    None
                                }
                            };
                            if let (Some(deadline), Some((mark, asked)), Some(renewed)) =
                                (deadline, renewal, renewed.as_ref())
                            {
                                inner.leases.renewed(*mark, *at, asked, renewed, deadline);
                            }
                        }
                        while sent.front().is_some_and(|(s, _, _)| *s <= acked) {
                            sent.pop_front();
                        }
                    }
                    Ok(ServerEvent::Recall(recall)) if recall.delegation => {
                        // A delegation: what this node held back is written first.
                        bump(&inner.counters.recalls);
                        tracing::debug!(inode = %recall.inode, "delegation recall");
                        let tx = tx.clone();
                        let inner = Arc::clone(inner);
                        tokio::spawn(async move {
                            inner.recall_delegation(recall.inode, &recall.grant_ids).await;
                            let ids = recall.grant_ids;
                            let sent = tx.send(ClientEvent::RecallAck { grant_ids: ids }.into()).await;
                            tracing::debug!(ok = sent.is_ok(), "delegation recall acknowledged");
                        });
                    }
                    Ok(ServerEvent::Recall(recall)) => {
                        bump(&inner.counters.recalls);
                        tracing::debug!(inode = %recall.inode, grants = recall.grant_ids.len(), reason = ?recall.reason, "recall");
                        inner.cache.recall(&recall.grant_ids);
                        let tx = tx.clone();
                        let ids = recall.grant_ids;
                        let waiter = Arc::clone(&inner.cache);
                        tokio::spawn(async move {
                            waiter.wait_idle(&ids).await;
                            let sent = tx.send(ClientEvent::RecallAck { grant_ids: ids }.into()).await;
                            tracing::debug!(ok = sent.is_ok(), "recall acknowledged");
                        });
                    }
                    Ok(ServerEvent::LeaseRecall(recall)) => {
                        tracing::debug!(inode = %recall.inode, id = recall.id, attr = recall.attr, entries = recall.entries, creates = recall.creates, "lease recall");
                        let tx = tx.clone();
                        let inner = Arc::clone(inner);
                        tokio::spawn(async move {
                            // A directory's create delegation: no more creates answered
                            // there, and those answered reach the server first.
                            if recall.creates {
                                inner.creates.drop_dir(recall.inode);
                                inner.creates.drain().await;
                                // And the bytes of those files held back under a write
                                // delegation their create did not get.
                                super::Client::borrowed(Arc::clone(&inner))
                                    .write_back_undelegated()
                                    .await;
                            }
                            // The kernel is told on a thread of its own (a write to /dev/fuse).
                            let dropped = tokio::task::spawn_blocking({
                                let inner = Arc::clone(&inner);
                                move || inner.leases.recall(recall.inode, recall.attr, recall.entries)
                            })
                            .await;
                            // Opens answered here of the file are made first: the change
                            // behind the recall may be its unlink.
                            if recall.attr {
                                super::Client::borrowed(Arc::clone(&inner))
                                    .open_deferred(recall.inode)
                                    .await;
                            }
                            if dropped.is_ok() {
                                let sent = tx.send(ClientEvent::LeaseRecallAck { id: recall.id }.into()).await;
                                tracing::debug!(ok = sent.is_ok(), "lease recall acknowledged");
                            }
                        });
                    }
                    Ok(ServerEvent::Ended { reason, message }) => {
                        return match reason {
                            SessionEndReason::Replaced => Outcome::StreamBroke(format!("stream replaced: {message}")),
                            SessionEndReason::Shutdown => Outcome::ServerStopping(format!("the server is stopping: {message}")),
                            other => Outcome::Lost(format!("server ended the session ({other:?}): {message}")),
                        };
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "malformed session stream message ignored");
                    }
                },
                Ok(None) => return Outcome::StreamBroke("stream ended".to_owned()),
                Err(status) => {
                    let e = fs_error_from_status(&status);
                    return if e == FsError::StaleSession {
                        Outcome::Lost(format!("stream: {e}"))
                    } else {
                        Outcome::StreamBroke(format!("stream: {e}"))
                    };
                }
            },
            _ = tokio::time::sleep_until(deadline) => {
                if !inner.lease_valid(view.generation) {
                    return Outcome::Lost("lease lapsed".to_owned());
                }
            }
            lost = lost_rx.recv() => {
                if lost == Some(view.session) {
                    return Outcome::Lost("the server answered StaleSession".to_owned());
                }
            }
        }
    }
}

/// Stops direct I/O of `view`'s session: marks it lost, drops every cached grant, and waits
/// for device I/O in flight; then, with `close`, ends the session at the server. Never when
/// the server is stopping: a session it ends is no longer recorded for the next server's
/// reclaim window, which then refuses this agent's replays (what the stopping server had
/// made durable would be reported lost, a write's file answering EIO at its next fsync).
async fn fence(inner: &Inner, view: &SessionView, why: &str, close: bool) {
    {
        let mut s = inner.lock_state();
        if s.view.generation == view.generation {
            s.live = false;
        }
    }
    bump(&inner.counters.fences);
    tracing::warn!(session = %view.session, %why, "session lost: fenced (no device I/O until a new session)");
    let busy = inner.cache.clear();
    inner.leases.clear();
    inner.creates.forget(None);
    loop {
        let idle = inner.device_idle.notified();
        tokio::pin!(idle);
        idle.as_mut().enable();
        if inner.device_in_flight.load(Ordering::SeqCst) == 0 {
            break;
        }
        idle.await;
    }
    inner.cache.wait_idle(&busy).await;
    if !close {
        return;
    }
    // Best effort: let the server release the old session's locks and handles now rather
    // than at expiry.
    let mut client = SessionClient::new(inner.channel.clone());
    let close = client.close_session(pb::CloseSessionRequest::from(SessionRef {
        session: view.session,
        epoch: view.epoch,
    }));
    let _ = tokio::time::timeout(Duration::from_secs(1), close).await;
}

/// Replays to the new server epoch of `reply` every record of an earlier epoch, in the order
/// the old server committed them: lazy write completions (in batches) and namespace changes
/// answered before they were durable (one by one, each through its own call with the
/// `sanfs-replay` header). Then the open files are opened again (a file must exist again
/// before it can be), the write delegations of files with writes held back are reclaimed,
/// and a last, empty batch says the reclaim is complete. A record the server answered is
/// forgotten; a refused write marks its file's write lost; a refused namespace change is
/// lost (logged). `previous` is this agent's last session, of the old epoch. Answers the
/// delegations reclaimed (taken in once the new session is current).
async fn replay(
    inner: &Inner,
    reply: &OpenSessionReply,
    previous: SessionId,
) -> Result<Vec<(InodeId, GrantId)>, FsError> {
    let records = inner.lock_unsynced().to_replay_all(reply.epoch);
    if !records.is_empty() {
        tracing::info!(
            records = records.len(),
            epoch = %reply.epoch,
            "the server restarted: replaying lazily committed write completions and namespace changes"
        );
    }
    let mut writes: Vec<(InodeId, unsynced::WriteRecord)> = Vec::new();
    for record in records {
        match record {
            unsynced::Replay::Write(ino, r) => {
                writes.push((ino, r));
                if writes.len() == MAX_REPLAY_RECORDS {
                    replay_writes(inner, reply, previous, &std::mem::take(&mut writes), false)
                        .await?;
                }
            }
            unsynced::Replay::Change(change) => {
                if !writes.is_empty() {
                    replay_writes(inner, reply, previous, &std::mem::take(&mut writes), false)
                        .await?;
                }
                replay_change(inner, reply, &change).await?;
            }
        }
    }
    if !writes.is_empty() {
        replay_writes(inner, reply, previous, &writes, false).await?;
    }
    reopen_files(inner, reply).await;
    let reclaimed = reclaim_delegations(inner, reply, previous).await?;
    replay_writes(inner, reply, previous, &[], true).await?;
    Ok(reclaimed)
}

/// Reclaims, in the reclaim window of `reply`'s server, the write delegation of every file
/// this agent holds writes or attribute changes back for ([`super::writeback::WriteBack::to_reclaim`]),
/// through a handle opened again under the new session for writing. Without it another
/// node's first `stat` or read after the window would be answered from what the LUNs and
/// the server have, before this agent wrote back what its applications were answered for.
/// A refusal (the window closed meanwhile) leaves the file to be written back as soon as
/// the session is current; a transport failure is the replay's (the session task tries
/// again with a new session).
async fn reclaim_delegations(
    inner: &Inner,
    reply: &OpenSessionReply,
    previous: SessionId,
) -> Result<Vec<(InodeId, GrantId)>, FsError> {
    let wanted = inner.writeback.to_reclaim();
    if wanted.is_empty() {
        return Ok(Vec::new());
    }
    let writable: Vec<(InodeId, super::FileHandle)> = super::file::open_files(inner)
        .iter()
        .filter(|f| f.flags().write)
        .map(|f| (f.ino(), f.current()))
        .filter(|(_, h)| h.session == reply.session)
        .collect();
    let mut reclaimed = Vec::new();
    for ino in wanted {
        let Some((_, handle)) = writable.iter().find(|(i, _)| *i == ino) else {
            tracing::warn!(%ino, "writes held back but no handle opened again for writing: the delegation is not reclaimed");
            continue;
        };
        let req = pb::DelegateRequest::from(DelegateRequest {
            handle: super::data::handle_ref(handle),
            inode: ino,
            epoch: reply.epoch,
            write: true,
            reclaim_of: Some(previous),
        });
        let answer = inner
            .data()
            .delegate(req)
            .await
            .map_err(|s| fs_error_from_status(&s))?
            .into_inner();
        match DelegateReply::try_from(answer) {
            Ok(DelegateReply {
                delegation: Some(id),
            }) => reclaimed.push((ino, id)),
            Ok(_) => {
                tracing::warn!(%ino, "the restarted server refused the reclaim of a write delegation: what is held back is written back at once");
            }
            Err(e) => return Err(malformed("Delegate reply", e)),
        }
    }
    if !reclaimed.is_empty() {
        tracing::info!(files = reclaimed.len(), session = %reply.session, "write delegations reclaimed (writes held back under them)");
    }
    Ok(reclaimed)
}

/// One `ReplayWrites` call of [`replay`].
async fn replay_writes(
    inner: &Inner,
    reply: &OpenSessionReply,
    previous: SessionId,
    batch: &[(InodeId, unsynced::WriteRecord)],
    reclaim_complete: bool,
) -> Result<(), FsError> {
    let req = ReplayWritesRequest {
        session: reply.session,
        epoch: reply.epoch,
        previous_session: previous,
        records: batch.iter().map(|(ino, r)| r.to_replay(*ino)).collect(),
        reclaim_complete,
    };
    let answer = inner
        .data()
        .replay_writes(pb::ReplayWritesRequest::from(req))
        .await
        .map_err(|s| fs_error_from_status(&s))?
        .into_inner();
    let answer =
        ReplayWritesReply::try_from(answer).map_err(|e| malformed("ReplayWrites reply", e))?;
    if answer.outcomes.len() != batch.len() {
        return Err(malformed(
            "ReplayWrites reply",
            format!(
                "{} outcomes for {} records",
                answer.outcomes.len(),
                batch.len()
            ),
        ));
    }
    let mut unsynced = inner.lock_unsynced();
    for ((ino, record), outcome) in batch.iter().zip(answer.outcomes) {
        if outcome == ReplayOutcome::Refused {
            tracing::error!(
                inode = %ino,
                offset = record.range.offset(),
                len = record.range.len(),
                "the restarted server refused the replay of a write: it is lost (the file's next fsync or close answers EIO)"
            );
        }
        unsynced.replayed(*ino, record, outcome);
    }
    Ok(())
}

/// Sends one namespace change of an earlier epoch again, under the new session of `reply`.
/// A transport failure is this replay's failure (the session task tries again with a new
/// session); the server's refusal means the change is lost: logged, counted, forgotten.
async fn replay_change(
    inner: &Inner,
    reply: &OpenSessionReply,
    record: &unsynced::NsRecord,
) -> Result<(), FsError> {
    use unsynced::NsChange as C;
    let tag = ReplayTag {
        previous: record.session,
        epoch: record.epoch,
        commit_seq: record.commit_seq,
        inode: record.inode,
    };
    fn tagged<T>(req: T, session: SessionId, tag: &ReplayTag) -> tonic::Request<T> {
        let mut r = tonic::Request::new(req);
        headers::set_session(r.metadata_mut(), session);
        headers::set_replay(r.metadata_mut(), tag);
        r
    }
    let s = reply.session;
    let mut ns = inner.ns();
    let sent = match record.change.clone() {
        C::Create(r) => ns.create(tagged(r, s, &tag)).await.map(drop),
        C::Mkdir(r) => ns.mkdir(tagged(r, s, &tag)).await.map(drop),
        C::Mknod(r) => ns.mknod(tagged(r, s, &tag)).await.map(drop),
        C::Symlink(r) => ns.symlink(tagged(r, s, &tag)).await.map(drop),
        C::Link(r) => ns.link(tagged(r, s, &tag)).await.map(drop),
        C::Unlink(r) => ns.unlink(tagged(r, s, &tag)).await.map(drop),
        C::Rmdir(r) => ns.rmdir(tagged(r, s, &tag)).await.map(drop),
        C::Rename(r) => ns.rename(tagged(r, s, &tag)).await.map(drop),
        C::SetAttr(r) => ns.set_attr(tagged(r, s, &tag)).await.map(drop),
        C::SetXattr(r) => ns.set_xattr(tagged(r, s, &tag)).await.map(drop),
        C::RemoveXattr(r) => ns.remove_xattr(tagged(r, s, &tag)).await.map(drop),
    };
    match sent {
        Ok(()) => {
            bump(&inner.counters.changes_replayed);
        }
        Err(status) if !is_server_error(&status) => return Err(fs_error_from_status(&status)),
        Err(status) => {
            bump(&inner.counters.changes_lost);
            tracing::error!(
                change = ?record.change,
                epoch = %record.epoch,
                commit = record.commit_seq,
                error = %fs_error_from_status(&status),
                "the restarted server refused the replay of a namespace change: it is lost"
            );
        }
    }
    inner.lock_unsynced().change_replayed(record);
    Ok(())
}

/// Opens every open file of this agent again under the new session `reply`, in the reclaim
/// window (before the agent says its reclaim is complete): the server reaps a file unlinked
/// while open after the window unless one of its holders opened it again (docs/protocol.md,
/// "Reclaim"). A file that cannot be opened again keeps its stale handle: its next call
/// re-opens it the usual way and answers what that gives.
async fn reopen_files(inner: &Inner, reply: &OpenSessionReply) {
    let mut reopened = 0usize;
    for file in super::file::open_files(inner) {
        let stale = file.current();
        // (A deferred open is made here too, as a file opened at the server would be; one
        // closed before it was made is not.)
        if stale.session == reply.session || file.is_deferred() && !file.deferred_open() {
            continue;
        }
        let req = pb::OpenRequest::from(OpenRequest {
            cred: file.cred().clone(),
            session: reply.session,
            inode: file.ino(),
            flags: file.flags(),
            read_small: 0,
        });
        let answer = tokio::time::timeout(Duration::from_secs(10), inner.ns().open(req)).await;
        let opened = match answer {
            Ok(Ok(r)) => {
                OpenReply::try_from(r.into_inner()).map_err(|e| malformed("Open reply", e))
            }
            Ok(Err(s)) => Err(fs_error_from_status(&s)),
            Err(_) => Err(FsError::Io("Open timed out after 10 s".to_owned())),
        };
        match opened {
            Ok(r) => {
                let handle = super::FileHandle {
                    session: reply.session,
                    handle: r.handle,
                };
                inner.note_open(&handle, file.ino());
                if file.replace_handle(stale, handle) {
                    reopened += 1;
                }
            }
            Err(e) => {
                tracing::warn!(ino = %file.ino(), error = %e, "could not open a file again under the new session");
            }
        }
    }
    if reopened > 0 {
        tracing::info!(files = reopened, session = %reply.session, "open files opened again under the new session");
    }
}

/// How often the agent tries to open a session while the server is away: every
/// [`REOPEN_RETRY`] for [`REOPEN_QUICK`] (a restart: found within that much of its listening
/// again, since a restart is a pause and this is part of it), then backing off to
/// [`REOPEN_BACKOFF_MAX`] (a server down for longer).
const REOPEN_RETRY: Duration = Duration::from_millis(50);
const REOPEN_QUICK: Duration = Duration::from_secs(3);
const REOPEN_BACKOFF_MAX: Duration = Duration::from_millis(500);

/// The wait before the next try to open a session, `since` the first one.
fn reopen_wait(since: Instant, backoff: &mut Duration) -> Duration {
    if since.elapsed() < REOPEN_QUICK {
        return REOPEN_RETRY;
    }
    *backoff = (*backoff * 2).clamp(REOPEN_RETRY, REOPEN_BACKOFF_MAX);
    *backoff
}

/// Opens a new session (retrying, see [`reopen_wait`]) and makes it current.
async fn reopen(inner: &Inner) {
    let since = Instant::now();
    let mut backoff = REOPEN_RETRY;
    loop {
        while inner.heartbeats_paused.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // Bounded: a request sent to a server that is going away may never be answered.
        let opened = tokio::time::timeout(
            Duration::from_secs(10),
            open_session(&inner.channel, &inner.config.client_name),
        )
        .await
        .unwrap_or_else(|_| Err(FsError::Io("OpenSession timed out after 10 s".to_owned())));
        match opened {
            Ok((reply, sent)) => {
                let admitted = inner
                    .admit_fs(reply.server.fs_uuid)
                    .and_then(|()| inner.admit_epoch(reply.epoch, reply.server.restores));
                if let Err(why) = admitted {
                    tracing::error!(session = %reply.session, epoch = %reply.epoch, %why, "server refused");
                    // Leave nothing behind at that server; ask again later (the right one may
                    // be back, or the agent is remounted with accept_epoch_regression).
                    let mut client = SessionClient::new(inner.channel.clone());
                    let close = client.close_session(pb::CloseSessionRequest::from(SessionRef {
                        session: reply.session,
                        epoch: reply.epoch,
                    }));
                    let _ = tokio::time::timeout(Duration::from_secs(1), close).await;
                    tokio::time::sleep(Duration::from_secs(2)).await;
                    continue;
                }
                let old = inner.lock_state().view.clone();
                if reply.epoch == old.epoch {
                    // The server lived: completions lost with the old session were refused.
                    inner.lock_unsynced().unanswered_lost();
                }
                let reclaimed = if reply.epoch == old.epoch {
                    Vec::new()
                } else {
                    match replay(inner, &reply, old.session).await {
                        Ok(reclaimed) => reclaimed,
                        Err(e) => {
                            // Records not answered stay: the next session replays them.
                            tracing::warn!(error = %e, "replay to the restarted server failed: opening a session again");
                            tokio::time::sleep(reopen_wait(since, &mut backoff)).await;
                            continue;
                        }
                    }
                };
                let generation = {
                    let mut s = inner.lock_state();
                    let generation = s.view.generation + 1;
                    s.view = SessionView {
                        session: reply.session,
                        epoch: reply.epoch,
                        generation,
                        server: reply.server,
                    };
                    s.lease_ttl_ms = reply.lease_ttl_ms;
                    s.deadline = sent + Duration::from_millis(reply.lease_ttl_ms);
                    s.live = true;
                    generation
                };
                // Before the stream attaches: a recall of a reclaimed delegation comes on it.
                inner.writeback.adopt_reclaimed(&reclaimed, generation);
                inner.leases.clear();
                bump(&inner.counters.sessions);
                tracing::info!(session = %reply.session, epoch = %reply.epoch, "new session opened");
                inner.generation_tx.send_replace(generation);
                return;
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot open a new session yet");
                tokio::time::sleep(reopen_wait(since, &mut backoff)).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_restarted_server_is_looked_for_every_50_ms_then_backed_off_to_500() {
        let mut backoff = REOPEN_RETRY;
        let now = Instant::now();
        assert_eq!(reopen_wait(now, &mut backoff), REOPEN_RETRY);
        assert_eq!(reopen_wait(now, &mut backoff), REOPEN_RETRY);
        let long_ago = now.checked_sub(REOPEN_QUICK * 2).unwrap();
        let waits: Vec<u128> = (0..6)
            .map(|_| reopen_wait(long_ago, &mut backoff).as_millis())
            .collect();
        assert_eq!(waits, [100, 200, 400, 500, 500, 500]);
    }
}
