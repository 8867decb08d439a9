//! The gRPC services of `sanfs.v1` over one shared [`Server`]: the wire boundary.
//!
//! Every handler does the same three things: convert the generated request
//! (`sanfs_proto::pb`) into its validated domain type (`sanfs_proto::model`), call the store
//! and the namespace, and convert the domain reply back. Protocol errors become statuses with
//! `status_from_protocol_error`, file-system errors with `status_from_fs_error`: nothing else
//! maps errors to statuses. Each request runs in a `tracing` span named `rpc` with the RPC
//! name, its session and inode, and is counted and timed in [`crate::metrics`].
//!
//! - [`namespace`]: the POSIX metadata operations (reads on a snapshot, changes in a group
//!   commit), open handles.
//! - [`session`]: sessions, leases, the session stream, and lease expiry.
//! - [`data`]: grants (the direct path's control info 1 to 4), the proxied path, fallocate,
//!   extents, fsync.
//! - [`admin`]: the volume layout, the server status, directory quotas.
//! - [`locks`]: cluster-wide POSIX advisory locks (fcntl and flock).
//! - [`identity`]: who is calling, from the transport, and what that identity may do.
//!
//! Sessions belong to the identity that opened them: every call naming a session (and so
//! its handles and grants, which are checked against their session) goes through
//! [`Server::check_session`] with the caller, and a session of another identity is refused.

pub mod admin;
pub mod data;
pub mod identity;
mod leases;
pub mod locks;
pub mod namespace;
pub mod session;

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use sanfs_proto::headers::{CommitNote, ReplayTag};
use sanfs_proto::model::{MAX_INLINE_DATA, ServerEvent, ServerInfo};
use sanfs_proto::pb;
use sanfs_proto::status::{status_from_fs_error, status_from_protocol_error};
use sanfs_proto::types::{FsError, InodeId, ProtocolError, SessionEpoch, SessionId, Timestamp};
use tokio::sync::mpsc;
use tonic::{Response, Status};
use tracing::Instrument;

use std::time::Duration;

use crate::clock::Clock;
use crate::datadev::DataDevices;
use crate::grants::Grants;
use crate::proxy::DataPath;
use crate::store::{Ctx, Luns, OpError, ReadTables, Store};
use identity::NodeIdentity;

/// The server's software version, reported in `ServerInfo` and `ServerStatus`.
pub const SERVER_VERSION: &str = env!("CARGO_PKG_VERSION");

/// Largest range one grant covers (a multiple of every block size up to 64 KiB).
pub const MAX_GRANT_BYTES: u64 = crate::data::MAX_GRANT_BYTES;

/// What the services need to know that the store does not.
#[derive(Debug, Clone, Copy)]
pub struct ServiceParams {
    /// I/O shorter than this goes the proxied path (reported to agents).
    pub direct_threshold: u64,
    /// Lease length handed to agents, milliseconds.
    pub lease_ttl_ms: u64,
    /// How long a grant may block others before its session is evicted, milliseconds.
    pub grant_hold_limit_ms: u64,
    /// Live sessions one identity may hold at once.
    pub max_sessions_per_identity: usize,
    /// The longest reclaim window after a start, milliseconds ([`crate::reclaim`]).
    pub reclaim_grace_ms: u64,
    /// How often journaled data is settled, milliseconds ([`DataPath::settle`]).
    pub settle_ms: u64,
}

/// The default reclaim window bound: two leases (agents notice a restart within a third of
/// one, at their next heartbeat).
pub fn default_reclaim_grace_ms(lease_ttl_ms: u64) -> u64 {
    lease_ttl_ms.saturating_mul(2)
}

/// One registered agent.
#[derive(Debug)]
pub(crate) struct SessionState {
    /// The name of the identity that opened the session: the only one that may use it.
    pub owner: String,
    pub client_name: String,
    pub host: String,
    /// When the lease runs out on the server's clock (ns since the epoch), grace included.
    pub deadline_ns: i64,
    /// The attached session stream, if any: its number, where its replies go, and what
    /// keeps its task reading (dropping it ends the stream's task).
    pub stream: Option<(u64, StreamTx, tokio::sync::oneshot::Sender<()>)>,
    /// Evicted: its heartbeats are not acknowledged any more (its deadline stays), it cannot
    /// attach again, and its calls are refused; it ends when its lease runs out.
    pub evicted: bool,
    /// Whether the store's `sessions` table has it (from its first lazy completion on: the
    /// next start's reclaim window waits for it, see `crate::reclaim`).
    pub recorded: bool,
}

/// One reply on a session stream.
pub(crate) type StreamItem = Result<pb::SessionStreamReply, Status>;
pub(crate) type StreamTx = mpsc::Sender<StreamItem>;

#[derive(Debug, Default)]
pub(crate) struct Sessions {
    pub next_stream: u64,
    /// The server is stopping: its streams were ended, and no stream attaches any more (one
    /// attached now would outlive the stop and keep a lease alive at a server that is gone).
    pub stopping: bool,
    pub by_id: HashMap<u64, SessionState>,
}

/// State shared by the five services.
#[derive(Debug)]
pub struct Server {
    pub(crate) store: Arc<Store>,
    /// Grants, range locks and the proxied path.
    pub(crate) grants: Arc<Grants>,
    pub(crate) clock: Clock,
    pub(crate) params: ServiceParams,
    pub(crate) epoch: SessionEpoch,
    pub(crate) started: Timestamp,
    pub(crate) sessions: Mutex<Sessions>,
    /// Changes submitted to the committer and not answered yet.
    pub(crate) pending_writes: AtomicU64,
    /// Advisory locks (fcntl, flock), in memory, per session.
    pub(crate) advisory: crate::advisory::AdvisoryLocks,
    /// Whether the store says agents may hold advisory locks (see `Store::set_locks_in_use`).
    pub(crate) locks_marked: std::sync::atomic::AtomicBool,
    /// The reclaim window of this epoch.
    pub(crate) reclaim: Arc<crate::reclaim::Reclaim>,
    /// Per-session and per-RPC counters (ServerStatus, `sanfs-admin top`).
    pub(crate) activity: Arc<crate::activity::Activity>,
    /// Attribute and entry leases ([`crate::leases`]).
    pub(crate) leases: crate::leases::Leases,
    /// Inode numbers set aside for sessions' agents ([`crate::reserved`]).
    pub(crate) reserved: Arc<crate::reserved::Reserved>,
}

impl Server {
    /// Takes the store over. The epoch is the store's boot epoch (a durable counter bumped
    /// at every start).
    pub async fn start(
        store: Store,
        params: ServiceParams,
        devices: DataDevices,
    ) -> Result<Arc<Server>, FsError> {
        let epoch = store.boot_epoch();
        // Agents of the previous run reclaim their locks before new ones are granted: they
        // notice the restart within a heartbeat (a third of a lease). No grace when the last
        // run stopped cleanly with no lock held.
        let locks_in_use = store.locks_in_use_at_start();
        let lock_grace = if locks_in_use {
            Duration::from_millis(params.lease_ttl_ms).saturating_add(Duration::from_secs(1))
        } else {
            Duration::ZERO
        };
        let store = Arc::new(store);
        // A request waits for a conflicting lock longer than a holder may make it wait
        // (the hold limit, then eviction and the rest of the holder's lease), so that a
        // holder that ignores a recall or never completes has lost its grant by the time the
        // wait gives up.
        let lock_timeout = Duration::from_millis(
            params
                .grant_hold_limit_ms
                .saturating_add(params.lease_ttl_ms)
                .saturating_add(expiry_grace_ms(params.lease_ttl_ms))
                .saturating_add(1000),
        )
        .max(Duration::from_millis(params.lease_ttl_ms.saturating_mul(2)))
        .max(Duration::from_secs(5));
        let dp = Arc::new(DataPath::new(
            store.clone(),
            Arc::new(devices),
            lock_timeout,
        ));
        // Small writes the last run acknowledged with the journal, maybe never flushed to
        // their LUNs, are written there again before anything is served.
        dp.write_journaled_data().await?;
        dp.settle_in_background(Duration::from_millis(params.settle_ms.max(1)));
        // Blocks handed out Unwritten by the last run and not zeroed before it stopped are
        // zeroed before anything is granted (docs/security.md).
        match dp.zero_fresh().await {
            Ok(0) => {}
            Ok(bytes) => tracing::info!(bytes, "zeroed fresh blocks left by the last run"),
            Err(e) => {
                tracing::warn!(error = %e, "fresh blocks left by the last run not zeroed yet")
            }
        }
        let grants = Arc::new(Grants::new(dp));
        // Proxied writes recall cached read grants in their way, as write grants do.
        let weak = Arc::downgrade(&grants);
        grants
            .data_path()
            .set_recaller(Box::new(move |blockers: Vec<u64>| {
                if let Some(g) = weak.upgrade() {
                    g.recall_blockers(blockers);
                }
            }));
        // The sessions the last run recorded may hold lazy completions to replay: the
        // window waits for them (see `crate::reclaim`).
        let previous: Vec<u64> = store
            .recorded_sessions()?
            .into_iter()
            .map(|(id, _)| id)
            .collect();
        let reclaim = Arc::new(crate::reclaim::Reclaim::new(previous.clone()));
        if reclaim.is_replaying() {
            tracing::info!(
                sessions = previous.len(),
                bound_ms = params.reclaim_grace_ms,
                "reclaim window open: new work waits until agents replay their lazy completions"
            );
        }
        tokio::spawn(end_reclaim(
            store.clone(),
            reclaim.clone(),
            previous,
            Duration::from_millis(params.reclaim_grace_ms),
        ));
        let clock = store.clock().clone();
        let started = clock.now();
        Ok(Arc::new(Server {
            store,
            grants,
            clock,
            params,
            epoch: SessionEpoch(epoch),
            started,
            sessions: Mutex::new(Sessions::default()),
            pending_writes: AtomicU64::new(0),
            advisory: crate::advisory::AdvisoryLocks::new(lock_grace),
            locks_marked: std::sync::atomic::AtomicBool::new(locks_in_use),
            reclaim,
            activity: Arc::default(),
            leases: crate::leases::Leases::new(Duration::from_millis(params.lease_ttl_ms)),
            reserved: Arc::default(),
        }))
    }

    /// Before a lazy completion of `session` is answered: the store records the session
    /// (durably, once per session; that commit makes the completion durable too), so that
    /// after a restart the reclaim window waits for its agent's replay.
    pub(crate) async fn record_session(&self, session: u64) -> Result<(), Status> {
        let recorded = self
            .sessions()
            .by_id
            .get(&session)
            .is_none_or(|s| s.recorded);
        if recorded {
            return Ok(());
        }
        let epoch = self.epoch.0;
        self.write(move |ctx| {
            ctx.sessions.insert(session, epoch)?;
            Ok(())
        })
        .await?;
        if let Some(s) = self.sessions().by_id.get_mut(&session) {
            s.recorded = true;
        }
        Ok(())
    }

    /// Waits while the reclaim window is open (new work must not run before replays).
    pub(crate) async fn wait_reclaim(&self) {
        if self.reclaim.is_open() {
            self.reclaim.closed().await;
        }
    }

    /// Whether the reclaim window of this epoch is still open.
    pub fn reclaiming(&self) -> bool {
        self.reclaim.is_open()
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    pub fn grants(&self) -> &Arc<Grants> {
        &self.grants
    }

    pub fn epoch(&self) -> SessionEpoch {
        self.epoch
    }

    pub(crate) fn sessions(&self) -> MutexGuard<'_, Sessions> {
        self.sessions.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The number of live sessions.
    pub fn session_count(&self) -> usize {
        self.sessions().by_id.len()
    }

    /// Now on the server's clock, nanoseconds since the epoch.
    pub(crate) fn now_ns(&self) -> i64 {
        let t = self.clock.now();
        t.sec
            .saturating_mul(1_000_000_000)
            .saturating_add(i64::from(t.nsec))
    }

    /// How long after its last heartbeat a session expires: the TTL plus a grace for clock
    /// rate drift (a tenth of the TTL, between 250 and 900 ms), see docs/protocol.md. With
    /// the 50 ms expiry scan, a silent session loses its grants within TTL + 1 s.
    pub(crate) fn expiry_after_ns(&self) -> i64 {
        let ttl = self.params.lease_ttl_ms;
        let grace = expiry_grace_ms(ttl);
        i64::try_from(ttl.saturating_add(grace).saturating_mul(1_000_000)).unwrap_or(i64::MAX)
    }

    pub(crate) fn server_info(&self) -> ServerInfo {
        ServerInfo {
            fs_uuid: self.store.superblock().fs_uuid,
            block_size: self.store.block_size(),
            direct_io_threshold: self.params.direct_threshold,
            max_grant_bytes: MAX_GRANT_BYTES,
            max_inline_bytes: u32::try_from(MAX_INLINE_DATA).unwrap_or(u32::MAX),
            server_version: SERVER_VERSION.to_owned(),
            restores: self.store.restores(),
            multi_part_complete: true,
            write_sets_attr: true,
            releases_with_changes: true,
        }
    }

    /// A read on a snapshot.
    pub(crate) fn read<R>(
        &self,
        f: impl FnOnce(&ReadTables) -> Result<R, OpError>,
    ) -> Result<R, Status> {
        self.store.read(f).map_err(|e| fs_status(&e))
    }

    /// Runs `commit`, a change waiting for its commit, counted in `pending_writes` (the
    /// status's pending commits) while it waits, also when its caller gives up on it.
    async fn pending<T>(&self, commit: impl std::future::Future<Output = T>) -> T {
        struct Waiting<'a>(&'a AtomicU64);
        impl Drop for Waiting<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::Relaxed);
            }
        }
        self.pending_writes.fetch_add(1, Ordering::Relaxed);
        let _waiting = Waiting(&self.pending_writes);
        commit.await
    }

    /// A change in the next durable group commit.
    pub(crate) async fn write<R: Send + 'static>(
        &self,
        f: impl for<'t> FnOnce(&mut Ctx<'t>) -> Result<R, OpError> + Send + 'static,
    ) -> Result<R, Status> {
        self.pending(self.store.write(f))
            .await
            .map_err(|e| fs_status(&e))
    }

    /// A change in the next durable group commit, made durable only after the data LUNs are
    /// flushed (`Store::write_data`).
    pub(crate) async fn write_data<R: Send + 'static>(
        &self,
        f: impl for<'t> FnOnce(&mut Ctx<'t>) -> Result<R, OpError> + Send + 'static,
    ) -> Result<R, Status> {
        self.pending(self.store.write_data(true, Luns::All, f))
            .await
            .map(|(r, _)| r)
            .map_err(|e| fs_status(&e))
    }

    /// The session a Namespace request is made under: its `sanfs-session` header
    /// (`sanfs_proto::headers`), which must name a live session of the caller's identity.
    /// None: a request without one (a tool, an older agent): its changes are durable when
    /// answered and its reads wait for other sessions' changes to be durable.
    pub(crate) fn session_of<T>(
        &self,
        who: &NodeIdentity,
        request: &tonic::Request<T>,
    ) -> Result<Option<SessionId>, Status> {
        let session = sanfs_proto::headers::session(request.metadata())
            .map_err(|e| status_from_protocol_error(&e))?;
        if let Some(s) = session {
            self.check_session(who, s)?;
        }
        Ok(session)
    }

    /// Before a read of session `me` is answered: if another session's changes are committed
    /// and not durable, they are made durable first, so that no session ever sees a change a
    /// crash could still take back (docs/protocol.md, "Namespace changes before they are
    /// durable"). Called *after* the read (`Store::foreign_undurable`).
    pub(crate) async fn barrier(&self, me: Option<SessionId>) -> Result<(), Status> {
        if self.store.foreign_undurable(me.map_or(0, |s| s.0)) {
            metrics::counter!("sanfs_namespace_barrier_syncs_total").increment(1);
            self.store.sync().await.map_err(|e| fs_status(&e))?;
        }
        Ok(())
    }

    /// A namespace change of `session`: answered before it is durable (a lazy commit owned by
    /// the session, whose agent keeps a record of it until it is: `store::committer::Job`),
    /// or, without a session, in the next durable commit. Answers the change and its
    /// `sanfs-commit` note.
    pub(crate) async fn change<R: Send + 'static>(
        &self,
        session: Option<SessionId>,
        f: impl for<'t> FnOnce(&mut Ctx<'t>) -> Result<R, OpError> + Send + 'static,
    ) -> Result<(R, CommitNote), Status> {
        let Some(session) = session else {
            let r = self.write(f).await?;
            return Ok((r, self.commit_note(0)));
        };
        // Recorded first (durably, once per session): after a restart the reclaim window
        // waits for this agent's replay.
        self.record_session(session.0).await?;
        let (r, seq) = self
            .pending(self.store.write_owned(session.0, f))
            .await
            .map_err(|e| fs_status(&e))?;
        Ok((r, self.commit_note(seq)))
    }

    /// The `sanfs-commit` note of a change in commit `seq` (0 once durable).
    pub(crate) fn commit_note(&self, seq: u64) -> CommitNote {
        let durable_seq = self.store.durable_seq();
        CommitNote {
            seq: if seq <= durable_seq { 0 } else { seq },
            durable_seq,
        }
    }

    /// A namespace change sent again by the agent of `tag.previous` to this restarted
    /// server, under its new `session`, in the reclaim window: durable already if its commit
    /// survived, otherwise applied again (`reclaim::replay_change`) lazily; the window's end
    /// (`reclaim_complete`) makes every replay durable.
    pub(crate) async fn replay_change(
        &self,
        session: Option<SessionId>,
        tag: ReplayTag,
        change: crate::reclaim::NsChange,
    ) -> Result<CommitNote, Status> {
        let Some(session) = session else {
            return Err(status_from_protocol_error(&ProtocolError::MissingField(
                "sanfs-session (a replay is made under the new session)",
            )));
        };
        if !self.reclaim.authorize(tag.previous.0) {
            tracing::warn!(
                session = session.0,
                previous = tag.previous.0,
                "replay of a namespace change refused: that session has nothing to reclaim now"
            );
            return Err(fs_status(&FsError::Invalid(format!(
                "replay refused: session {} has nothing to reclaim now (not recorded, done, or the reclaim window is over)",
                tag.previous.0
            ))));
        }
        if crate::reclaim::change_survived(self.store.survived(), tag.epoch.0, tag.commit_seq) {
            metrics::counter!("sanfs_namespace_replays_total", "outcome" => "durable").increment(1);
            return Ok(self.commit_note(0));
        }
        self.record_session(session.0).await?;
        let inode = tag.inode;
        let what = format!("{change:?}");
        let done = self
            .store
            .write_owned(session.0, move |ctx| {
                crate::reclaim::replay_change(ctx, &change, inode)
            })
            .await;
        match done {
            Ok((outcome, seq)) => {
                let label = if outcome == sanfs_proto::model::ReplayOutcome::Durable {
                    "durable"
                } else {
                    "replayed"
                };
                metrics::counter!("sanfs_namespace_replays_total", "outcome" => label).increment(1);
                tracing::debug!(session = session.0, ?outcome, "replayed a namespace change");
                Ok(self.commit_note(seq))
            }
            Err(e) => {
                metrics::counter!("sanfs_namespace_replays_total", "outcome" => "refused")
                    .increment(1);
                tracing::error!(session = session.0, previous = tag.previous.0, error = %e, change = %what, "replay of a namespace change refused: that change is lost");
                Err(fs_status(&e))
            }
        }
    }

    /// The one ownership check: fails with `StaleSession` unless `session` is live (and not
    /// evicted), and with
    /// `PERMISSION_DENIED` unless `caller` is the identity that opened it.
    pub(crate) fn check_session(
        &self,
        caller: &NodeIdentity,
        session: SessionId,
    ) -> Result<(), Status> {
        match self.sessions().by_id.get(&session.0) {
            None => Err(fs_status(&FsError::StaleSession)),
            Some(s) if s.evicted => Err(fs_status(&FsError::StaleSession)),
            Some(s) if s.owner == caller.name => Ok(()),
            Some(_) => {
                tracing::warn!(
                    session = session.0,
                    caller = %caller.name,
                    "refused a call on a session of another identity"
                );
                metrics::counter!("sanfs_foreign_session_refused_total").increment(1);
                Err(identity::refused(format!(
                    "session {} belongs to another identity than {:?}",
                    session.0, caller.name
                )))
            }
        }
    }

    /// Releases the handles a call's `sanfs-release` header names
    /// (`ServerInfo.releases_with_changes`, docs/protocol.md "Handles released with a later
    /// call"), before the call itself. The header's session must be the caller's (else the
    /// call is refused and nothing is released); a replaced session's handles are gone
    /// already, and a handle not open under the session (released before: a retried call's
    /// header) is skipped, as a stale `Release` is.
    pub(crate) async fn release_attached<T>(
        &self,
        who: &NodeIdentity,
        request: &tonic::Request<T>,
    ) -> Result<(), Status> {
        let Some((session, handles)) = sanfs_proto::headers::release(request.metadata())
            .map_err(|e| sanfs_proto::status::status_from_protocol_error(&e))?
        else {
            return Ok(());
        };
        match self.check_session(who, session) {
            Ok(()) => {}
            Err(e) if sanfs_proto::status::fs_error_from_status(&e) == FsError::StaleSession => {
                return Ok(());
            }
            Err(e) => return Err(e),
        }
        for handle in handles {
            let open_here = self
                .store
                .handles()
                .by_handle
                .get(&handle)
                .is_some_and(|f| f.session == session.0);
            if open_here {
                self.release_handle(handle).await?;
                metrics::counter!(crate::metrics::RELEASED_WITH_CALLS).increment(1);
            }
        }
        Ok(())
    }

    /// Forgets one open handle; if it was its inode's last, an unlinked inode is destroyed.
    pub(crate) async fn release_handle(&self, handle: u64) -> Result<(), Status> {
        let released = self.store.handles().release(handle);
        if let Some((file, _)) = released {
            // Grants live under open handles: a session that closed its last handle on an
            // inode keeps no grant on it (so freed blocks are never under a cached layout).
            let still_open = self.store.handles().open_by(file.session, file.ino);
            if !still_open {
                self.grants.drop_for_inode(file.session, file.ino).await;
                self.advisory.release_session_inode(file.session, file.ino);
            }
        }
        if let Some((file, _)) = released
            && !self.store.handles().is_open(file.ino)
        {
            self.grants.trim_prealloc(file.ino).await;
        }
        if let Some((file, true)) = released {
            let ino = file.ino;
            // Only an orphan (no link left) is destroyed at its last close: a file with a
            // name costs no commit here. (An unlink after this read finds no handle and
            // destroys the inode itself.)
            let bs = self.store.block_size();
            let orphan = self
                .store
                .read(|t| crate::ns::Reader::getattr(t, bs, InodeId(ino)))
                .is_ok_and(|a| a.nlink == 0);
            if orphan {
                self.write(move |ctx| crate::ns::release_orphan(ctx, InodeId(ino)))
                    .await?;
            }
        }
        Ok(())
    }

    /// Releases every open handle of a session (closed or expired).
    pub(crate) async fn release_session_handles(&self, session: u64) {
        let handles: Vec<u64> = self
            .store
            .handles()
            .by_handle
            .iter()
            .filter(|(_, f)| f.session == session)
            .map(|(h, _)| *h)
            .collect();
        for h in handles {
            if let Err(e) = self.release_handle(h).await {
                tracing::warn!(session, handle = h, error = %e.message(), "releasing a handle of an ended session");
            }
        }
    }

    /// Before the first advisory lock of a run is granted: durably notes that agents may hold
    /// locks, so that a restart after a crash gives them a grace period to reclaim them.
    pub(crate) async fn mark_locks_in_use(&self) -> Result<(), FsError> {
        if !self.locks_marked.load(Ordering::Acquire) {
            self.store.set_locks_in_use(true).await?;
            self.locks_marked.store(true, Ordering::Release);
        }
        Ok(())
    }

    /// At a clean stop: with no advisory lock held, the next start needs no grace period.
    /// Settles the journaled data at a clean stop: the journal is left empty (the next start
    /// writes nothing again, an older server can open the store).
    pub(crate) async fn settle_data(&self) {
        if let Err(e) = self.grants.data_path().settle().await {
            tracing::warn!(error = %e, "settling journaled data at the stop failed: the next start writes it again");
        }
    }

    pub(crate) async fn unmark_locks_if_none(&self) {
        if self.locks_marked.load(Ordering::Acquire)
            && self.advisory.held() == 0
            && self.store.set_locks_in_use(false).await.is_ok()
        {
            self.locks_marked.store(false, Ordering::Release);
        }
    }

    /// Ends a session: removes it, tells its stream why, releases its handles.
    pub(crate) async fn end_session(&self, session: u64, reason: Option<ServerEvent>) -> bool {
        let (state, stopping) = {
            let mut s = self.sessions();
            (s.by_id.remove(&session), s.stopping)
        };
        let Some(state) = state else {
            return false;
        };
        // A stopping server (a clean stop, a rolling restart: agents older than stop 36
        // close their sessions as they fence; an agent unmounted meanwhile closes its own)
        // leaves a session that holds files unlinked while open to the next server: its
        // record stays, so the next reclaim window waits for its agent, and its handles are
        // not released, so the files live until that agent opens them again
        // (`crate::recovery`). Releasing them here destroyed such a file under its holder.
        let handing_over = stopping && self.holds_orphan(session);
        if handing_over {
            tracing::info!(
                session,
                "the server stops: a session holding files unlinked while open is left to the next server"
            );
        }
        // Its agent has nothing to reclaim from this session any more (lazily: a crash
        // before the next durable commit only makes the next start wait for it in vain).
        if state.recorded
            && !handing_over
            && let Err(e) = self
                .store
                .write_lazy(move |ctx| {
                    ctx.sessions.remove(session)?;
                    Ok(())
                })
                .await
        {
            tracing::warn!(session, error = %e, "forgetting an ended session");
        }
        if let (Some(event), Some((_, tx, _))) = (reason, state.stream) {
            let _ = tx.try_send(Ok(event.into()));
        }
        self.grants.expire_session(session).await;
        self.leases.expire_session(session);
        self.reserved.forget_session(session);
        self.advisory.release_session(session);
        if !handing_over {
            self.release_session_handles(session).await;
        }
        self.activity.forget_session(session);
        true
    }

    /// Whether `session` holds a handle on a file unlinked while open (an orphan).
    fn holds_orphan(&self, session: u64) -> bool {
        let inos: Vec<u64> = self
            .store
            .handles()
            .by_handle
            .values()
            .filter(|f| f.session == session)
            .map(|f| f.ino)
            .collect();
        if inos.is_empty() {
            return false;
        }
        self.store
            .snapshot(|r| {
                let orphans = r.open_table(crate::store::ORPHANS)?;
                for ino in inos {
                    if orphans.get(ino)?.is_some() {
                        return Ok(true);
                    }
                }
                Ok(false)
            })
            // Unknown: kept, as an orphan's holder would be.
            .unwrap_or(true)
    }
}

/// The grace after a lease's TTL before the server ends the session (clock-rate drift): a
/// tenth of the TTL, between 250 and 900 ms.
fn expiry_grace_ms(lease_ttl_ms: u64) -> u64 {
    (lease_ttl_ms / 10).clamp(250, 900)
}

/// Closes the reclaim window once every recorded session has completed its reclaim or
/// `bound` has passed, forgets the recorded sessions of the earlier run, and then runs the
/// recovery that frees space (which must not run before replays).
async fn end_reclaim(
    store: Arc<Store>,
    reclaim: Arc<crate::reclaim::Reclaim>,
    previous: Vec<u64>,
    bound: Duration,
) {
    if reclaim.is_replaying() {
        tokio::select! {
            () = reclaim.replays_done() => {}
            () = tokio::time::sleep(bound) => {}
        }
        let left = reclaim.close();
        if left.is_empty() {
            tracing::info!("reclaim window closed: every agent replayed");
        } else {
            tracing::warn!(sessions = ?left, "reclaim window closed by its bound: agents of these sessions did not come back (their lazy completions, if any, are lost)");
        }
        let forget = store
            .write(move |ctx| {
                for id in previous {
                    ctx.sessions.remove(id)?;
                }
                Ok(())
            })
            .await;
        if let Err(e) = forget {
            tracing::error!(error = %e, "forgetting the last run's sessions");
        }
    }
    let s = store.clone();
    match tokio::task::spawn_blocking(move || crate::recovery::recover_after_restart(&s)).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::error!(error = %e, "recovery after the reclaim window failed"),
        Err(e) => tracing::error!(error = %e, "the recovery task failed"),
    }
    // Only now may new work go ahead: the recovery trims and reaps what the last run left,
    // and must not meet what this run does (`crate::reclaim`).
    reclaim.release();
}

/// The status of a file-system error (the one mapping, in `sanfs_proto::status`).
pub(crate) fn fs_status(e: &FsError) -> Status {
    status_from_fs_error(e)
}

/// Converts a wire request that carries user credentials into its domain type (or answers
/// `INVALID_ARGUMENT`), the credentials adjusted to what the caller's identity allows (root
/// squashing).
pub(crate) fn accept<P, D>(request: tonic::Request<P>) -> Result<D, Status>
where
    D: TryFrom<P, Error = ProtocolError> + identity::WithCred,
{
    let who = identity::caller(&request)?;
    let mut req: D = convert(request.into_inner())?;
    who.policy.squash(req.cred_mut());
    Ok(req)
}

/// Converts a wire request into its domain type, or answers `INVALID_ARGUMENT`.
pub(crate) fn convert<P, D>(p: P) -> Result<D, Status>
where
    D: TryFrom<P, Error = ProtocolError>,
{
    D::try_from(p).map_err(|e| status_from_protocol_error(&e))
}

/// Runs one request in its span, counts and times it.
pub(crate) async fn rpc<T>(
    name: &'static str,
    fut: impl Future<Output = Result<T, Status>>,
) -> Result<Response<T>, Status> {
    let span = tracing::debug_span!(
        "rpc",
        rpc = name,
        session = tracing::field::Empty,
        inode = tracing::field::Empty
    );
    let started = std::time::Instant::now();
    let r = crate::activity::charged(name, fut.instrument(span), || started.elapsed()).await;
    let code = match &r {
        Ok(_) => tonic::Code::Ok,
        Err(s) => s.code(),
    };
    crate::metrics::record_rpc(name, code, started.elapsed());
    r.map(Response::new)
}

/// What the reply of a change says beside its message: its `sanfs-commit` note, and the
/// changer's own attribute leases it altered (`sanfs-forget`).
#[derive(Debug)]
pub(crate) struct Noted {
    pub commit: CommitNote,
    pub forget: Vec<InodeId>,
    pub dirs: Option<sanfs_proto::model::ChangedDirs>,
}

impl From<CommitNote> for Noted {
    fn from(commit: CommitNote) -> Noted {
        Noted {
            commit,
            forget: Vec::new(),
            dirs: None,
        }
    }
}

/// [`rpc`] for a change whose reply carries its `sanfs-commit` note (and `sanfs-forget`).
pub(crate) async fn rpc_noted<T, N: Into<Noted>>(
    name: &'static str,
    fut: impl Future<Output = Result<(T, N), Status>>,
) -> Result<Response<T>, Status> {
    let (reply, noted) = rpc(name, fut).await?.into_inner();
    let noted: Noted = noted.into();
    let mut response = Response::new(reply);
    sanfs_proto::headers::set_commit(response.metadata_mut(), noted.commit);
    sanfs_proto::headers::set_forget(response.metadata_mut(), &noted.forget);
    if let Some(dirs) = noted.dirs {
        sanfs_proto::headers::set_dirs(response.metadata_mut(), dirs);
    }
    Ok(response)
}

/// Records the request's session and inode on the current `rpc` span.
pub(crate) fn note(session: Option<u64>, inode: Option<u64>) {
    let span = tracing::Span::current();
    if let Some(s) = session {
        span.record("session", s);
        crate::activity::note_session(s);
    }
    if let Some(i) = inode {
        span.record("inode", i);
    }
}

/// What `/metrics` publishes of this server's own counters.
impl crate::metrics::Counters for Server {
    fn figures(&self) -> crate::metrics::Figures {
        let g = &self.grants.stats;
        let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let stats = self.store.stats();
        let usage = self.store.usage();
        let block = u64::from(self.store.block_size());
        let total_blocks = load(&usage.total_blocks);
        crate::metrics::Figures {
            read_grants: load(&g.read_grants),
            write_grants: load(&g.write_grants),
            granted_read_bytes: load(&g.granted_read_bytes),
            granted_write_bytes: load(&g.granted_write_bytes),
            recalls: load(&g.recalls),
            lock_waits: load(&g.lock_waits),
            expired_grants: load(&g.expired_grants),
            evictions: load(&g.evictions),
            zeroed_bytes: load(&self.grants.data_path().zeroed_bytes),
            proxied_read_bytes: load(&g.proxied_read_bytes),
            proxied_write_bytes: load(&g.proxied_write_bytes),
            grants_live: self.grants.live(),
            commits: load(&stats.commits),
            commit_ops: load(&stats.ops),
            sessions: self.session_count(),
            capacity_bytes: total_blocks.saturating_mul(block),
            free_bytes: load(&usage.free_blocks)
                .min(total_blocks)
                .saturating_mul(block),
            inodes: load(&usage.inodes),
            leases: crate::metrics::LeaseFigures {
                attr_granted: load(&self.leases.stats.attr_granted),
                entry_granted: load(&self.leases.stats.entry_granted),
                refused: load(&self.leases.stats.refused),
                recalls: load(&self.leases.stats.recalls),
                recall_timeouts: load(&self.leases.stats.recall_timeouts),
                renewed: load(&self.leases.stats.renewed),
                renew_lost: load(&self.leases.stats.renew_lost),
                live: self.leases.live(),
                creates_granted: load(&self.leases.stats.creates_granted),
                creates_recalled: load(&self.leases.stats.creates_recalled),
            },
        }
    }
}
