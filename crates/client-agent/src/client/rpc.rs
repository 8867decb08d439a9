//! The one way the client calls the server: send, map the status, convert the reply to its
//! domain type (a reply that does not convert is a clear `EIO`, "malformed ... from the
//! server"), and ride out a server restart.
//!
//! **What is retried.** A failure is *retryable* when it says nothing about the request
//! itself: the transport failed (the server is down or restarting: a connection refused or
//! reset, `UNAVAILABLE`, a call cancelled by the disconnect; any status without the sanfs
//! error metadata, which only the server's handlers set), or the server answered
//! `StaleSession` (it restarted, or the lease lapsed). The call then waits for a live session
//! (the session task opens a new one; a `StaleSession` answer tells it to) and sends again,
//! rebuilt for the session it now runs under ([`Pin`]). Every other error is the answer.
//!
//! **How long.** As NFS: a `hard` mount ([`RetryPolicy::Hard`], the default) waits as long as
//! it takes; a `soft` one ([`RetryPolicy::Soft`]) gives up after its timeout with `EIO`.
//! While the server does not answer, the agent logs "server not responding, still trying"
//! every [`COMPLAIN_EVERY`], and "server OK" once a call gets through again.
//!
//! **Calls bound to a session.** A call on a [`FileHandle`] ([`Pin::Handle`]) cannot move to
//! a new session: once one is open it answers `Stale` (ESTALE) at once, without sending, and
//! the caller's [`super::OpenFile`] opens the file again under the new session and redoes the
//! whole operation. A call on a grant ([`Pin::Session`]: complete, return) answers
//! `StaleSession` as soon as its session is lost, without waiting for the next one (the fence
//! that replaces the session waits for the grants in use): the I/O it belongs to is redone
//! from the start under a new grant, never finished under the old one.

use std::collections::BTreeSet;
use std::fmt::Display;
use std::future::Future;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use sanfs_proto::headers::{self, CommitNote};
use sanfs_proto::model::{ChangedDirs, RequestId};
use sanfs_proto::pb;
use sanfs_proto::status::{fs_error_from_status, is_server_error};
use sanfs_proto::types::{FsError, SessionId};
use tonic::{Code, Response, Status};

use super::{FileHandle, Inner, SessionView, malformed};

/// How long calls wait for an unreachable or restarting server (the `hard` and `soft` mount
/// options).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetryPolicy {
    /// Wait as long as it takes (the default).
    Hard,
    /// Give up after this long without a server: `EIO`.
    Soft(Duration),
}

/// `soft` without `retrans_timeout=`: 5 minutes.
pub const DEFAULT_SOFT_TIMEOUT: Duration = Duration::from_secs(300);

/// How often a server that does not answer is logged while calls wait for it.
pub const COMPLAIN_EVERY: Duration = Duration::from_secs(30);

/// The session a call runs under.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Pin<'a> {
    /// Any: the request is rebuilt for the current session on every try (namespace calls,
    /// and opens, which name the session they open under).
    Any,
    /// The session of this handle: `Stale` once a new session is open.
    Handle(&'a FileHandle),
    /// This session (a grant's): `StaleSession` once a new one is open.
    Session(SessionId),
}

/// What a failed call means.
#[derive(Debug, PartialEq)]
pub(crate) enum Failure {
    /// The answer.
    Final(FsError),
    /// The server was not reached, or went away during the call.
    Transport(FsError),
    /// The server does not know the session.
    Session,
}

/// Sorts a failed call's status (see the module doc).
pub(crate) fn classify(status: &Status) -> Failure {
    let e = fs_error_from_status(status);
    if is_server_error(status) {
        // Hook: a "grace" answer of a restarted server (reclaims first) is retryable too,
        // as a transport failure (wait and send again), once the protocol has one.
        return match e {
            FsError::StaleSession => Failure::Session,
            e => Failure::Final(e),
        };
    }
    match status.code() {
        Code::Unavailable
        | Code::Cancelled
        | Code::Unknown
        | Code::Internal
        | Code::DeadlineExceeded => Failure::Transport(e),
        _ => Failure::Final(e),
    }
}

/// Whether the server is being waited for, and since when (shared by all calls, for the
/// "not responding" and "OK" log lines).
#[derive(Debug, Default)]
pub(crate) struct Outage {
    state: Mutex<Option<OutageState>>,
}

#[derive(Debug, Clone, Copy)]
struct OutageState {
    since: Instant,
    complained: Instant,
}

impl Outage {
    /// A call could not reach the server.
    fn note_down(&self, server: &str, why: &FsError) {
        let now = Instant::now();
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        match s.as_mut() {
            None => {
                tracing::warn!(%server, error = %why, "server not responding, still trying");
                *s = Some(OutageState {
                    since: now,
                    complained: now,
                });
            }
            Some(o) if now.duration_since(o.complained) >= COMPLAIN_EVERY => {
                tracing::warn!(%server, error = %why, down_for_s = now.duration_since(o.since).as_secs(), "server not responding, still trying");
                o.complained = now;
            }
            Some(_) => {}
        }
    }

    /// A call got an answer.
    fn note_up(&self, server: &str) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(o) = s.take() {
            tracing::info!(%server, down_for_ms = o.since.elapsed().as_millis() as u64, "server OK");
        }
    }
}

/// The reply-cache ids of this agent's non-idempotent calls (see the server's reply cache
/// in docs/protocol.md): a random instance id chosen at start and kept across sessions, and
/// an increasing seq per call; the calls still in progress say which seqs may still be sent
/// again.
#[derive(Debug)]
pub(crate) struct RequestIds {
    client: u64,
    next: AtomicU64,
    pending: Mutex<BTreeSet<u64>>,
}

impl RequestIds {
    pub(crate) fn new() -> RequestIds {
        RequestIds {
            // Random, never 0.
            client: uuid::Uuid::new_v4().as_u64_pair().0 | 1,
            next: AtomicU64::new(1),
            pending: Mutex::new(BTreeSet::new()),
        }
    }

    /// A new id, pending (may be sent again) until the returned guard is dropped.
    pub(crate) fn begin(&self) -> PendingRequest<'_> {
        let seq = self.next.fetch_add(1, Ordering::Relaxed);
        let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        pending.insert(seq);
        let lowest = pending.first().copied().unwrap_or(seq);
        PendingRequest {
            ids: self,
            id: RequestId {
                client: self.client,
                seq,
                lowest_pending: lowest,
            },
        }
    }
}

/// One non-idempotent call's id while it may still be sent (see [`RequestIds`]).
pub(crate) struct PendingRequest<'a> {
    ids: &'a RequestIds,
    id: RequestId,
}

impl PendingRequest<'_> {
    /// The id, for the request's `request_id` field.
    pub(crate) fn wire(&self) -> Option<pb::RequestId> {
        Some(self.id.into())
    }
}

impl Drop for PendingRequest<'_> {
    fn drop(&mut self) {
        self.ids
            .pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&self.id.seq);
    }
}

/// One call's patience: when it gives up (soft mounts), and the pause between tries.
struct Patience {
    give_up: Option<Instant>,
    pause: Duration,
}

impl Patience {
    fn new(policy: RetryPolicy) -> Patience {
        Patience {
            give_up: match policy {
                RetryPolicy::Hard => None,
                RetryPolicy::Soft(t) => Instant::now().checked_add(t),
            },
            pause: Duration::from_millis(20),
        }
    }

    fn timed_out(&self, what: &str) -> FsError {
        FsError::Io(format!(
            "{what}: server not responding (soft mount: timed out)"
        ))
    }

    /// Sleeps before the next try (growing to 1 s), or gives up.
    async fn pause(&mut self, what: &str) -> Result<(), FsError> {
        let mut sleep = self.pause;
        if let Some(at) = self.give_up {
            let left = at.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(self.timed_out(what));
            }
            sleep = sleep.min(left);
        }
        tokio::time::sleep(sleep).await;
        self.pause = (self.pause * 2).min(Duration::from_secs(1));
        Ok(())
    }

    fn left(&self) -> Option<Duration> {
        self.give_up
            .map(|at| at.saturating_duration_since(Instant::now()))
    }
}

impl Inner {
    /// Sends one request and converts its reply to `T` (see the module doc): `send` builds
    /// and sends the request for the session view it is given, and runs again on every
    /// retry. `what` names the reply in errors ("Lookup reply").
    pub(crate) async fn call<R, T, F, Fut>(
        &self,
        what: &'static str,
        pin: Pin<'_>,
        send: F,
    ) -> Result<T, FsError>
    where
        F: FnMut(&SessionView) -> Fut,
        Fut: Future<Output = Result<Response<R>, Status>>,
        T: TryFrom<R>,
        T::Error: Display,
    {
        self.call_barred(what, pin, true, send).await
    }

    /// [`Inner::call`], held by the barrier of creates answered here (`barred`) or not (a
    /// call they do not need to precede: reserving inode numbers, sending them).
    pub(crate) async fn call_barred<R, T, F, Fut>(
        &self,
        what: &'static str,
        pin: Pin<'_>,
        barred: bool,
        send: F,
    ) -> Result<T, FsError>
    where
        F: FnMut(&SessionView) -> Fut,
        Fut: Future<Output = Result<Response<R>, Status>>,
        T: TryFrom<R>,
        T::Error: Display,
    {
        self.call_with(what, pin, barred, send, |reply, _| {
            T::try_from(reply.into_inner()).map_err(|e| malformed(what, e))
        })
        .await
    }

    /// [`Inner::call`] for a namespace change: also answers the session view it was sent
    /// under and the reply's `sanfs-commit` note (none from a server that answers every
    /// change durably).
    pub(crate) async fn call_noted<R, T, F, Fut>(
        &self,
        what: &'static str,
        send: F,
    ) -> Result<(T, SessionView, Option<CommitNote>, Option<ChangedDirs>), FsError>
    where
        F: FnMut(&SessionView) -> Fut,
        Fut: Future<Output = Result<Response<R>, Status>>,
        T: TryFrom<R>,
        T::Error: Display,
    {
        self.call_with(what, Pin::Any, true, send, |reply, view| {
            self.noted_reply(what, reply, view)
        })
        .await
    }

    /// A change's reply: its value, the view it was sent under, its `sanfs-commit` note and
    /// the directories it changed; this node's own attribute leases it altered go.
    fn noted_reply<R, T>(
        &self,
        what: &'static str,
        reply: Response<R>,
        view: &SessionView,
    ) -> Result<(T, SessionView, Option<CommitNote>, Option<ChangedDirs>), FsError>
    where
        T: TryFrom<R>,
        T::Error: Display,
    {
        let note = headers::commit(reply.metadata()).map_err(|e| malformed(what, e))?;
        // This node's own attribute leases the change altered: not recalled by the server,
        // dropped here before the change is answered.
        let forget = headers::forget(reply.metadata()).map_err(|e| malformed(what, e))?;
        if !forget.is_empty() {
            self.leases.forget(&forget, &[]);
        }
        let dirs = headers::dirs(reply.metadata()).map_err(|e| malformed(what, e))?;
        let value = T::try_from(reply.into_inner()).map_err(|e| malformed(what, e))?;
        Ok((value, view.clone(), note, dirs))
    }

    /// The one retry loop of [`Inner::call`] and [`Inner::call_noted`]: `convert` turns the
    /// reply (and the view it was sent under) into the answer. A `barred` call is sent only
    /// once every create this agent answered itself is answered by the server (see
    /// [`super::creates`]): it must find the server as the applications saw it.
    async fn call_with<R, T, F, Fut>(
        &self,
        what: &'static str,
        pin: Pin<'_>,
        barred: bool,
        mut send: F,
        mut convert: impl FnMut(Response<R>, &SessionView) -> Result<T, FsError>,
    ) -> Result<T, FsError>
    where
        F: FnMut(&SessionView) -> Fut,
        Fut: Future<Output = Result<Response<R>, Status>>,
    {
        let mut patience = Patience::new(self.config.retry);
        loop {
            // A grant's call never waits for a new session: the fence that replaces the
            // session waits for the grants in use, and their I/O is redone under a new one.
            if let Pin::Session(s) = pin
                && !self.view_for(None).is_ok_and(|v| v.session == s)
            {
                return Err(FsError::StaleSession);
            }
            let view = self.wait_live(&mut patience, what).await?;
            if barred {
                self.creates.drain().await;
            }
            match pin {
                Pin::Any => {}
                Pin::Handle(fh) if fh.session != view.session => return Err(FsError::Stale),
                Pin::Session(s) if s != view.session => return Err(FsError::StaleSession),
                Pin::Handle(_) | Pin::Session(_) => {}
            }
            let status = match send(&view).await {
                Ok(reply) => {
                    self.outage.note_up(&self.config.server);
                    return convert(reply, &view);
                }
                Err(status) => status,
            };
            match classify(&status) {
                Failure::Final(e) => {
                    self.outage.note_up(&self.config.server);
                    return Err(e);
                }
                Failure::Session => {
                    self.outage.note_up(&self.config.server);
                    // The session task replaces it; the next try waits for that.
                    let _ = self.lost_tx.send(view.session);
                    if let Pin::Session(_) = pin {
                        return Err(FsError::StaleSession);
                    }
                    self.wait_generation_after(view.generation, &mut patience, what)
                        .await?;
                }
                Failure::Transport(e) => {
                    self.outage.note_down(&self.config.server, &e);
                    tracing::debug!(%what, error = %e, "call failed on the transport: retrying");
                    patience.pause(what).await?;
                }
            }
        }
    }

    /// The current session once it is live (waiting as a call waits).
    pub(crate) async fn live_view(&self) -> Result<SessionView, FsError> {
        let mut patience = Patience::new(self.config.retry);
        self.wait_live(&mut patience, "a live session").await
    }

    /// [`Inner::call`] for replies that carry nothing (`()`).
    pub(crate) async fn call_unit<R, F, Fut>(
        &self,
        what: &'static str,
        pin: Pin<'_>,
        mut send: F,
    ) -> Result<(), FsError>
    where
        F: FnMut(&SessionView) -> Fut,
        Fut: Future<Output = Result<Response<R>, Status>>,
    {
        self.call(what, pin, |v| {
            let sent = send(v);
            async move { sent.await.map(|r| r.map(drop)) }
        })
        .await
    }

    /// The current session once its lease is valid, waiting while a new one is being opened
    /// (as long as the mount's patience lasts).
    async fn wait_live(&self, patience: &mut Patience, what: &str) -> Result<SessionView, FsError> {
        let mut rx = self.generation_tx.subscribe();
        loop {
            match self.view_for(None) {
                Ok(v) => return Ok(v),
                // A server refused because its epoch went backwards: no waiting helps.
                Err(e @ FsError::Io(_)) => return Err(e),
                Err(_) => {}
            }
            let mut slice = Duration::from_millis(50);
            if let Some(left) = patience.left() {
                if left.is_zero() {
                    return Err(patience.timed_out(what));
                }
                slice = slice.min(left);
            }
            // Re-check at least every 50 ms: a lapse is noticed by the deadline alone.
            let _ = tokio::time::timeout(slice, rx.changed()).await;
        }
    }

    /// After `view`'s session was answered as stale: tells the session task (which replaces
    /// it) and waits, as a call waits, for the next live session. Its epoch says what
    /// happened: a new one, the server restarted; the same one, it lived and fenced or
    /// evicted the session. (The current view alone cannot say: a call may meet the new
    /// server before the session task does.)
    pub(crate) async fn next_session_after(
        &self,
        view: &SessionView,
        what: &str,
    ) -> Result<SessionView, FsError> {
        let _ = self.lost_tx.send(view.session);
        let mut patience = Patience::new(self.config.retry);
        self.wait_generation_after(view.generation, &mut patience, what)
            .await?;
        self.wait_live(&mut patience, what).await
    }

    /// Waits until a session newer than generation `old` is live.
    async fn wait_generation_after(
        &self,
        old: u64,
        patience: &mut Patience,
        what: &str,
    ) -> Result<(), FsError> {
        loop {
            let view = self.wait_live(patience, what).await?;
            if view.generation != old {
                return Ok(());
            }
            patience.pause(what).await?;
        }
    }

    /// The current session once live (as [`Inner::call`] waits for it), for what checks the
    /// session before it calls: `Stale` when `fh` is of an older session.
    pub(crate) async fn live_view_for(
        &self,
        fh: Option<&FileHandle>,
        what: &str,
    ) -> Result<SessionView, FsError> {
        let mut patience = Patience::new(self.config.retry);
        let view = self.wait_live(&mut patience, what).await?;
        match fh {
            Some(fh) if fh.session != view.session => Err(FsError::Stale),
            _ => Ok(view),
        }
    }
}

/// The request `req` with the `sanfs-session` header of `view`: changes under a session
/// may be answered before they are durable, and reads see this session's own such changes
/// without waiting (docs/protocol.md, "Namespace changes before they are durable").
pub(super) fn with_session<T>(req: T, view: &SessionView) -> tonic::Request<T> {
    let mut r = tonic::Request::new(req);
    headers::set_session(r.metadata_mut(), view.session);
    r
}

#[cfg(test)]
mod tests {
    use super::*;
    use sanfs_proto::status::status_from_fs_error;

    #[test]
    fn what_is_retried() {
        let transport = |c: Code| classify(&Status::new(c, "transport error"));
        assert!(matches!(
            transport(Code::Unavailable),
            Failure::Transport(_)
        ));
        assert!(matches!(transport(Code::Cancelled), Failure::Transport(_)));
        assert!(matches!(transport(Code::Unknown), Failure::Transport(_)));
        // A gRPC code without the server's metadata that is about the request is not.
        assert!(matches!(
            transport(Code::PermissionDenied),
            Failure::Final(FsError::Access)
        ));
        assert_eq!(
            classify(&status_from_fs_error(&FsError::StaleSession)),
            Failure::Session
        );
        // Answers of the server are final, EIO included.
        for e in [
            FsError::NotFound,
            FsError::Stale,
            FsError::Exists,
            FsError::Io("disk".to_owned()),
        ] {
            assert_eq!(classify(&status_from_fs_error(&e)), Failure::Final(e));
        }
    }

    #[test]
    fn request_ids_say_what_may_come_again() {
        let ids = RequestIds::new();
        let a = ids.begin();
        let b = ids.begin();
        assert_eq!(a.id.client, b.id.client);
        assert_ne!(a.id.client, 0);
        assert!(b.id.seq > a.id.seq);
        assert_eq!(b.id.lowest_pending, a.id.seq, "a is still pending");
        drop(a);
        let c = ids.begin();
        assert_eq!(c.id.lowest_pending, b.id.seq);
        drop(b);
        drop(c);
        let d = ids.begin();
        assert_eq!(d.id.lowest_pending, d.id.seq);
        assert!(RequestId::try_from(d.wire().unwrap()).is_ok());
        assert_ne!(
            RequestIds::new().client,
            ids.client,
            "random per agent instance"
        );
    }

    #[tokio::test]
    async fn soft_patience_ends() {
        let mut p = Patience::new(RetryPolicy::Soft(Duration::from_millis(60)));
        let mut tries = 0;
        let e = loop {
            match p.pause("Lookup reply").await {
                Ok(()) => tries += 1,
                Err(e) => break e,
            }
        };
        assert!(tries >= 2, "{tries}");
        assert_eq!(e.errno(), 5, "{e}");
        assert!(e.to_string().contains("not responding"), "{e}");
        let mut h = Patience::new(RetryPolicy::Hard);
        assert!(h.left().is_none());
        assert!(h.pause("x").await.is_ok());
    }
}
