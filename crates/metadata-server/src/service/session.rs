//! The Session service: agents register, keep their lease alive over the session stream, and
//! leave; a background task ends sessions whose lease ran out.
//!
//! Sessions live in memory only (they die with the server, whose epoch then changes). A
//! session's lease is renewed by each heartbeat that arrives; it expires `lease_ttl_ms` plus a
//! grace after the last one (docs/protocol.md, "Lease rules"). An ended session (closed or
//! expired) loses its open handles, and unlinked inodes whose last handle that was are
//! destroyed, and its grants are dropped (their locks released). The stream carries recalls
//! of cached read grants to the agent, and the agent's recall acknowledgements and grant
//! returns back. The same background task evicts the sessions of grants that others have
//! waited for past the hold limit ([`Server::evict_session`]).

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use sanfs_proto::model::{
    ClientEvent, LeaseRenewed, OpenSessionReply, OpenSessionRequest, PROTOCOL_VERSION, ServerEvent,
    SessionEndReason, SessionRef,
};
use sanfs_proto::model::{Recall, RecallReason};
use sanfs_proto::pb;
use sanfs_proto::pb::session_server::Session;
use sanfs_proto::status::status_from_protocol_error;
use sanfs_proto::types::{ByteRange, FsError, GrantId, InodeId, ProtocolError, SessionId};
use tokio::sync::{mpsc, oneshot};
use tokio_stream::Stream;
use tonic::{Request, Response, Status, Streaming};

use super::identity::{NodeIdentity, caller};
use super::{Server, SessionState, convert, fs_status, note, rpc};

/// The wire event for a recall of cached read grants (none for a range the wire cannot
/// carry, which a grant never has: its range was validated when it was issued).
fn recall_event(rc: crate::grants::Recall) -> Option<ServerEvent> {
    let range = ByteRange::new(rc.offset, rc.len).ok()?;
    Some(ServerEvent::Recall(Recall {
        grant_ids: rc.grant_ids.into_iter().map(GrantId).collect(),
        inode: InodeId(rc.ino),
        range,
        reason: RecallReason::Conflict,
        delegation: rc.delegation,
    }))
}

/// A new session id: an unguessable token of 64 random bits from the operating system's
/// CSPRNG, never 0 and never one in use (`taken`). Knowing one session's id tells nothing
/// about another's; and ids are checked against their owner anyway.
fn new_session_token(taken: impl Fn(u64) -> bool) -> Result<u64, Status> {
    loop {
        let id = getrandom::u64()
            .map_err(|e| Status::unavailable(format!("no randomness for a session token: {e}")))?;
        if id != 0 && !taken(id) {
            return Ok(id);
        }
    }
}

/// Replies queued per session stream before the sender waits.
const STREAM_QUEUE: usize = 32;

/// The Session service over the shared server.
#[derive(Debug, Clone)]
pub struct SessionService {
    server: Arc<Server>,
}

impl SessionService {
    pub fn new(server: Arc<Server>) -> SessionService {
        SessionService { server }
    }
}

use super::StreamItem;

/// A stream just attached to a session.
struct Attached {
    stream_id: u64,
    /// What the agent receives.
    replies: mpsc::Receiver<StreamItem>,
    /// Where the stream's own task sends (weak: the session holds the strong sender).
    sender: mpsc::WeakSender<StreamItem>,
    /// Resolves when the session lets go of the stream (ended, replaced, shutdown).
    cancel: oneshot::Receiver<()>,
}

type ReplyStream = Pin<Box<dyn Stream<Item = StreamItem> + Send>>;

impl Server {
    fn check_epoch(&self, r: &SessionRef) -> Result<(), Status> {
        if r.epoch == self.epoch {
            Ok(())
        } else {
            Err(fs_status(&FsError::StaleSession))
        }
    }

    fn open_session(
        &self,
        who: &NodeIdentity,
        req: OpenSessionRequest,
    ) -> Result<OpenSessionReply, Status> {
        if req.protocol_version != PROTOCOL_VERSION {
            return Err(status_from_protocol_error(&ProtocolError::InvalidField {
                field: "protocol_version",
                reason: format!(
                    "version {} is not spoken here (this server speaks {PROTOCOL_VERSION})",
                    req.protocol_version
                ),
            }));
        }
        let deadline_ns = self.now_ns().saturating_add(self.expiry_after_ns());
        let id = {
            let mut s = self.sessions();
            // A stopping server opens no session: an agent told of the stop asks the next
            // server, whose reclaim window is for the session it already has (one opened
            // here would leave that one unreclaimed, and the next start waiting for it).
            if s.stopping {
                return Err(Status::unavailable("the server is shutting down"));
            }
            let cap = self.params.max_sessions_per_identity;
            let held = s.by_id.values().filter(|st| st.owner == who.name).count();
            if held >= cap {
                tracing::warn!(identity = %who.name, cap, "refused a session over the identity's cap");
                return Err(Status::resource_exhausted(format!(
                    "{:?} holds {held} sessions, its cap (server.max_sessions_per_identity is {cap}): \
                     close some or let them expire",
                    who.name
                )));
            }
            let id = new_session_token(|id| s.by_id.contains_key(&id))?;
            s.by_id.insert(
                id,
                SessionState {
                    owner: who.name.clone(),
                    client_name: req.client_name.clone(),
                    host: req.host.clone(),
                    deadline_ns,
                    stream: None,
                    evicted: false,
                    recorded: false,
                },
            );
            id
        };
        tracing::info!(
            session = id,
            identity = %who.name,
            client = %req.client_name,
            host = %req.host,
            agent_version = %req.agent_version,
            "session opened"
        );
        Ok(OpenSessionReply {
            session: SessionId(id),
            epoch: self.epoch,
            lease_ttl_ms: self.params.lease_ttl_ms,
            server: self.server_info(),
        })
    }

    /// Attaches a new stream to a session, replacing (and ending) the previous one.
    fn attach(&self, who: &NodeIdentity, r: &SessionRef) -> Result<Attached, Status> {
        self.check_epoch(r)?;
        self.check_session(who, r.session)?;
        let (tx, rx) = mpsc::channel(STREAM_QUEUE);
        let weak = tx.downgrade();
        let mut s = self.sessions();
        if s.stopping {
            return Err(Status::unavailable("the server is shutting down"));
        }
        s.next_stream = s.next_stream.wrapping_add(1);
        let stream_id = s.next_stream;
        let state = s
            .by_id
            .get_mut(&r.session.0)
            .filter(|s| !s.evicted)
            .ok_or_else(|| fs_status(&FsError::StaleSession))?;
        let (cancel_tx, cancel_rx) = oneshot::channel();
        if let Some((_, old, _)) = state.stream.replace((stream_id, tx, cancel_tx)) {
            let _ = old.try_send(Ok(ServerEvent::Ended {
                reason: SessionEndReason::Replaced,
                message: "another session stream attached to this session".to_owned(),
            }
            .into()));
        }
        Ok(Attached {
            stream_id,
            replies: rx,
            sender: weak,
            cancel: cancel_rx,
        })
    }

    /// Serves one attached stream until the agent closes it or the server replaces or ends
    /// it; replies go out through `tx` (weak: the session holds the only strong sender, so
    /// that ending the session closes the stream).
    async fn run_stream(
        self: Arc<Self>,
        session: u64,
        stream_id: u64,
        mut inbound: Streaming<pb::SessionStreamRequest>,
        tx: mpsc::WeakSender<StreamItem>,
        mut cancel: oneshot::Receiver<()>,
    ) {
        // Grants given back are ended by a task of their own, in order: ending a write grant
        // is a commit, which may wait (for the committer, a flush of the LUNs), and the
        // heartbeats behind it on this stream must not (a session would lose its lease for
        // a slow disk).
        let (returns, mut returned) = mpsc::unbounded_channel::<Vec<u64>>();
        let server = Arc::clone(&self);
        tokio::spawn(async move {
            while let Some(ids) = returned.recv().await {
                for id in ids {
                    if let Err(e) = server
                        .grants
                        .return_grants(session, server.epoch.0, &[id])
                        .await
                    {
                        tracing::debug!(session, grant = id, error = %e, "return of a grant");
                    }
                }
            }
        });
        loop {
            let next = tokio::select! {
                m = inbound.message() => m,
                // The session let go of this stream: stop reading so that the call ends.
                _ = &mut cancel => break,
            };
            let msg = match next {
                Ok(Some(m)) => m,
                Ok(None) => break,
                Err(e) => {
                    tracing::debug!(session, error = %e.message(), "session stream broke");
                    break;
                }
            };
            let reply = match ClientEvent::try_from(msg) {
                Err(e) => Err(status_from_protocol_error(&e)),
                Ok(ClientEvent::Attach(_)) => Err(Status::failed_precondition(
                    "attach is only the first message of a session stream",
                )),
                Ok(ClientEvent::Heartbeat { seq, renew }) => {
                    let deadline = self.now_ns().saturating_add(self.expiry_after_ns());
                    {
                        let mut s = self.sessions();
                        match s.by_id.get_mut(&session) {
                            Some(state)
                                if state
                                    .stream
                                    .as_ref()
                                    .is_some_and(|(id, _, _)| *id == stream_id) =>
                            {
                                state.deadline_ns = deadline;
                            }
                            // Ended or replaced: this stream has nothing more to say.
                            _ => break,
                        }
                    }
                    // The leases it still caches, for another term (after the session's
                    // own renewal: a lease never outlasts its session).
                    let renewed = renew.map(|r| {
                        let (lost_attrs, lost_entries) =
                            self.leases.renew(session, &r.attrs, &r.entries);
                        LeaseRenewed {
                            lease_ms: self.leases.term_ms(),
                            lost_attrs,
                            lost_entries,
                        }
                    });
                    Ok(Some(ServerEvent::HeartbeatAck {
                        seq,
                        lease_ttl_ms: self.params.lease_ttl_ms,
                        durable_seq: self.store.durable_seq(),
                        renewed,
                    }))
                }
                Ok(ClientEvent::LeaseRecallAck { id }) => {
                    self.leases.acked(session, id);
                    Ok(None)
                }
                Ok(
                    ClientEvent::RecallAck { grant_ids } | ClientEvent::GrantReturn { grant_ids },
                ) => {
                    // The agent gives the grants back: they may be gone already (expired,
                    // returned twice): that is no reason to end the stream.
                    let _ = returns.send(grant_ids.iter().map(|g| g.0).collect());
                    Ok(None)
                }
            };
            let Some(tx) = tx.upgrade() else { break };
            match reply {
                Ok(Some(event)) => {
                    if tx.send(Ok(event.into())).await.is_err() {
                        break;
                    }
                }
                Ok(None) => {}
                Err(status) => {
                    let _ = tx.send(Err(status)).await;
                    break;
                }
            }
        }
        let mut s = self.sessions();
        if let Some(state) = s.by_id.get_mut(&session)
            && state
                .stream
                .as_ref()
                .is_some_and(|(id, _, _)| *id == stream_id)
        {
            state.stream = None;
        }
    }

    /// Evicts a session (docs/protocol.md "Eviction"): from now on its heartbeats are not
    /// acknowledged (its lease runs out at its present deadline), its stream is told
    /// `SessionEnded {EVICTED}` and closed, it cannot attach again, its calls are refused and
    /// its grants fenced (their completions refused); its grants, locks and handles go when
    /// the lease has run out ([`Server::expire_sessions`]), because until then its agent may
    /// still have device I/O in flight. Returns the milliseconds left on its lease, or `None`
    /// for a session that does not exist. Evicting an evicted session changes nothing.
    pub(crate) fn evict_session(&self, session: u64, why: &str) -> Option<u64> {
        let now = self.now_ns();
        let (stream, remaining_ms) = {
            let mut s = self.sessions();
            let state = s.by_id.get_mut(&session)?;
            let remaining_ms =
                u64::try_from(state.deadline_ns.saturating_sub(now) / 1_000_000).unwrap_or(0);
            if state.evicted {
                return Some(remaining_ms);
            }
            state.evicted = true;
            (state.stream.take(), remaining_ms)
        };
        self.grants.fence_session(session);
        tracing::warn!(
            session,
            reason = %why,
            lease_remaining_ms = remaining_ms,
            "session evicted: its completions are refused, its grants go when its lease runs out"
        );
        // Dropping the stream's sender and its cancel handle closes the stream after this
        // last message.
        if let Some((_, tx, _cancel)) = stream {
            let _ = tx.try_send(Ok(ServerEvent::Ended {
                reason: SessionEndReason::Evicted,
                message: why.to_owned(),
            }
            .into()));
        }
        Some(remaining_ms)
    }

    /// Evicts the sessions of grants that others have waited for longer than the hold
    /// limit (`server.grant_hold_limit_ms`).
    pub fn evict_stuck_holders(&self) {
        let limit = Duration::from_millis(self.params.grant_hold_limit_ms);
        for (session, grant, ino) in self.grants.stuck_holders(limit) {
            let why = format!(
                "grant {grant} on inode {ino} was waited for longer than the hold limit \
                 ({} ms)",
                self.params.grant_hold_limit_ms
            );
            self.evict_session(session, &why);
        }
    }

    /// Ends every session whose lease has run out.
    pub async fn expire_sessions(&self) {
        let now = self.now_ns();
        let expired: Vec<u64> = self
            .sessions()
            .by_id
            .iter()
            .filter(|(_, s)| s.deadline_ns < now)
            .map(|(id, _)| *id)
            .collect();
        for id in expired {
            tracing::info!(session = id, "session lease expired");
            self.end_session(
                id,
                Some(ServerEvent::Ended {
                    reason: SessionEndReason::Expired,
                    message: "the session's lease expired".to_owned(),
                }),
            )
            .await;
        }
    }
}

/// Runs lease expiry and the hold-limit check every `lease_ttl_ms / 4` (between 10 and
/// 50 ms), judged by the server's clock, until the task is aborted.
pub fn spawn_expiry(server: Arc<Server>) -> tokio::task::JoinHandle<()> {
    let period = Duration::from_millis((server.params.lease_ttl_ms / 4).clamp(10, 50));
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            server.evict_stuck_holders();
            server.expire_sessions().await;
        }
    })
}

#[tonic::async_trait]
impl Session for SessionService {
    async fn open_session(
        &self,
        request: Request<pb::OpenSessionRequest>,
    ) -> Result<Response<pb::OpenSessionReply>, Status> {
        rpc("OpenSession", async {
            let who = caller(&request)?;
            let req: OpenSessionRequest = convert(request.into_inner())?;
            let reply = self.server.open_session(&who, req)?;
            note(Some(reply.session.0), None);
            Ok(reply.into())
        })
        .await
    }

    async fn close_session(
        &self,
        request: Request<pb::CloseSessionRequest>,
    ) -> Result<Response<pb::CloseSessionReply>, Status> {
        rpc("CloseSession", async {
            let who = caller(&request)?;
            let req: SessionRef = convert(request.into_inner())?;
            note(Some(req.session.0), None);
            self.server.check_epoch(&req)?;
            self.server.check_session(&who, req.session)?;
            if !self.server.end_session(req.session.0, None).await {
                return Err(fs_status(&FsError::StaleSession));
            }
            tracing::info!(session = req.session.0, "session closed");
            Ok(pb::CloseSessionReply {})
        })
        .await
    }

    type SessionStreamStream = ReplyStream;

    async fn session_stream(
        &self,
        request: Request<Streaming<pb::SessionStreamRequest>>,
    ) -> Result<Response<Self::SessionStreamStream>, Status> {
        rpc("SessionStream", async {
            let who = caller(&request)?;
            let mut inbound = request.into_inner();
            // A stream that never attaches would hold its task (and the caller's h2 stream)
            // for ever: the attach comes within a lease or the stream is refused.
            let attach_limit = Duration::from_millis(self.server.params.lease_ttl_ms);
            let first = tokio::time::timeout(attach_limit, inbound.message())
                .await
                .map_err(|_| {
                    Status::failed_precondition(format!(
                        "no attach within {} ms (a lease) of the session stream's start",
                        attach_limit.as_millis()
                    ))
                })??
                .ok_or_else(|| {
                    Status::failed_precondition("the session stream ended before attach")
                })?;
            let ClientEvent::Attach(r) = convert(first)? else {
                return Err(Status::failed_precondition(
                    "the first message of a session stream must be attach",
                ));
            };
            note(Some(r.session.0), None);
            let a = self.server.attach(&who, &r)?;
            // Recalls of this session's cached read grants go out on this stream.
            let (recall_tx, mut recalls) = mpsc::unbounded_channel();
            self.server.grants.attach(r.session.0, recall_tx);
            let out_tx = a.sender.clone();
            tokio::spawn(async move {
                while let Some(rc) = recalls.recv().await {
                    let Some(tx) = out_tx.upgrade() else { break };
                    let Some(event) = recall_event(rc) else {
                        continue;
                    };
                    if tx.send(Ok(event.into())).await.is_err() {
                        break;
                    }
                }
            });
            tokio::spawn(self.server.clone().run_stream(
                r.session.0,
                a.stream_id,
                inbound,
                a.sender,
                a.cancel,
            ));
            let out: ReplyStream = Box::pin(tokio_stream::wrappers::ReceiverStream::new(a.replies));
            Ok(out)
        })
        .await
    }
}
