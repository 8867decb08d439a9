//! The Namespace service: POSIX metadata operations.
//!
//! Lookups, attributes, directory listings, symlink targets, xattrs, access checks and statfs
//! are answered from a snapshot (`Store::read`), after any other session's changes that are
//! not durable yet are made durable ([`Server::barrier`]); every change is one job in a group
//! commit: under a session (`sanfs-session`) answered before it is durable, its agent keeping
//! it for a replay ([`Server::change`], docs/protocol.md "Namespace changes before they are
//! durable"), without one once durable. Opening without truncation checks permissions on a snapshot and
//! registers the handle in memory; with truncation it is a write job. Releasing the last
//! handle of an unlinked inode destroys it.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use sanfs_proto::model::{
    AccessRequest, BatchedChange, ChangeBatchRequest, ChangeResult, CreateBatchRequest,
    CreateRequest, EntryRequest, GetAttrRequest, HandleRef, InodeRequest, Leased, LeasedLookup,
    LeasedReadDir, LinkRequest, MAX_INLINE_DATA, MkdirRequest, MknodRequest, OpenReply,
    OpenRequest, RenameRequest, RequestId, ReserveInodesReply, ReserveInodesRequest,
    SetAttrRequest, SetXattrRequest, StatFs, SymlinkRequest, XattrNames, XattrRequest, XattrValue,
    request_id,
};
use sanfs_proto::pb;
use sanfs_proto::pb::namespace_server::Namespace;
use sanfs_proto::types::{
    Attr, FileName, FileType, FsError, InodeId, NAME_MAX, OpenHandle, SessionId, SymlinkTarget,
    XattrName,
};
use tonic::{Request, Response, Status};

use super::identity::{NodeIdentity, caller};
use super::{Noted, Server, accept, convert, fs_status, note, rpc, rpc_noted};
use crate::leases::Covered::{self, Attr as A, Entries as E};
use crate::leases::LeaseChange;
use crate::metrics::OPEN_SMALL_FILES;
use crate::ns::{self, Reader};
use crate::reclaim::NsChange;
use crate::replies::{self, Once, Stored};
use crate::store::{Ctx, OpError};
use sanfs_proto::headers::ReplayTag;

/// The Namespace service over the shared server.
#[derive(Debug, Clone)]
pub struct NamespaceService {
    server: Arc<Server>,
}

impl NamespaceService {
    pub fn new(server: Arc<Server>) -> NamespaceService {
        NamespaceService { server }
    }
}

/// Accepts a non-idempotent request (caller's identity, squashing, conversion) and takes out
/// its reply-cache id.
fn accept_once<P, D>(mut request: tonic::Request<P>) -> Result<(D, Option<RequestId>), Status>
where
    P: WithRequestId,
    D: TryFrom<P, Error = sanfs_proto::types::ProtocolError> + super::identity::WithCred,
{
    let id = request_id(request.get_mut().take_request_id()).map_err(Status::from)?;
    Ok((accept(request)?, id))
}

/// A change's headers: the session it is made under and, for a change an agent sends again
/// to a restarted server, its replay tag (`sanfs_proto::headers`). The handles its
/// `sanfs-release` header names are released first ([`Server::release_attached`]).
async fn change_headers<T>(
    server: &Server,
    request: &Request<T>,
) -> Result<(Option<SessionId>, Option<ReplayTag>), Status> {
    let who = caller(request)?;
    let session = server.session_of(&who, request)?;
    let replay = sanfs_proto::headers::replay(request.metadata())
        .map_err(|e| sanfs_proto::status::status_from_protocol_error(&e))?;
    server.release_attached(&who, request).await?;
    Ok((session, replay))
}

/// A non-idempotent namespace change through the reply cache (`$body` over `$ctx` and the
/// request `$req`): answered before it is durable under a session ([`Server::change`]),
/// or applied again when it is a replay ([`Server::replay_change`]).
macro_rules! change_once {
    ($self:ident, $request:ident, $name:literal, $req_ty:ty, $variant:ident,
     |$req:ident| $inode:expr, leases: $leases:expr, |$ctx:ident| $body:expr) => {
        rpc_noted($name, async {
            let (session, replay) = change_headers(&$self.server, &$request).await?;
            let ($req, id): ($req_ty, _) = accept_once($request)?;
            let asks_creates = AsksCreates::asks_creates(&$req);
            if let Some(tag) = replay {
                let commit = $self
                    .server
                    .replay_change(session, tag, NsChange::$variant($req))
                    .await?;
                return Ok((Default::default(), Noted::from(commit)));
            }
            $self.server.wait_reclaim().await;
            note(session.map(|s| s.0), Some($inode));
            let changes: Vec<(u64, Covered)> = $leases;
            let leases = $self
                .server
                .recall_leases(&changes, session.map(|s| s.0))
                .await;
            let (reply, commit) = $self
                .server
                .change(session, move |$ctx| {
                    replies::run_once($ctx, id, 0, |$ctx| $body)
                })
                .await?;
            let mut reply = reply.into_reply();
            let made = MadeDir::made_dir(&reply);
            let (noted, since) = $self
                .server
                .change_noted(session, commit, leases, &changes, made);
            // A directory made with its create delegation asked for (only under a session:
            // its agent must hear the recall).
            if asks_creates && let (Some(s), Some(dir)) = (session, made) {
                let ms = $self.server.grant_creates(s.0, dir, since);
                MadeDir::give_creates(&mut reply, ms);
            }
            Ok((reply, noted))
        })
        .await
    };
}

/// A change's reply notes: its commit, and the changer's own attribute leases it altered.
fn noted(commit: sanfs_proto::headers::CommitNote, leases: &LeaseChange<'_>) -> Noted {
    Noted {
        commit,
        forget: leases.own().to_vec(),
        dirs: None,
    }
}

/// The directory a change's reply says it made (Mkdir), if any.
trait MadeDir {
    fn made_dir(&self) -> Option<u64> {
        None
    }

    /// Says the term of the create delegation given on the directory made.
    fn give_creates(&mut self, _ms: u64) {}
}

impl MadeDir for pb::MkdirReply {
    fn made_dir(&self) -> Option<u64> {
        self.attr.as_ref().map(|a| a.ino)
    }

    fn give_creates(&mut self, ms: u64) {
        self.creates_ms = ms;
    }
}

/// Whether a change asks for the create delegation on the directory it makes (Mkdir).
trait AsksCreates {
    fn asks_creates(&self) -> bool {
        false
    }
}

impl AsksCreates for MkdirRequest {
    fn asks_creates(&self) -> bool {
        self.delegate
    }
}

impl AsksCreates for MknodRequest {}
impl AsksCreates for EntryRequest {}
impl AsksCreates for RenameRequest {}
impl AsksCreates for LinkRequest {}
impl AsksCreates for SymlinkRequest {}

impl MadeDir for pb::MknodReply {}
impl MadeDir for pb::UnlinkReply {}
impl MadeDir for pb::RmdirReply {}
impl MadeDir for pb::RenameReply {}
impl MadeDir for pb::LinkReply {}
impl MadeDir for pb::SymlinkReply {}

/// How many times a size change takes its lock again when other truncates keep shrinking
/// the file below the span it locked ([`Server::size_change_guard`]).
const SIZE_GUARD_TRIES: usize = 16;

impl Server {
    /// The reply notes of a change made under `session` to `changes` (its lease change
    /// ends here): its commit, the changer's own attribute leases it altered, and the
    /// directories whose names it changed as they are now, with attribute leases on them for
    /// the changer (so that its agent needs no GetAttr of them); a directory it `made` comes
    /// too, with an entry lease as well (it is empty: its maker knows every name in it).
    /// Also answers the mark as of the change's end, for other leases given with the reply.
    fn change_noted(
        &self,
        session: Option<SessionId>,
        commit: sanfs_proto::headers::CommitNote,
        leases: LeaseChange<'_>,
        changes: &[(u64, Covered)],
        made: Option<u64>,
    ) -> (Noted, u64) {
        let forget = leases.own().to_vec();
        let since = leases.end();
        let dirs = session.and_then(|s| self.changed_dirs(s, changes, made, since));
        (
            Noted {
                commit,
                forget,
                dirs,
            },
            since,
        )
    }

    fn changed_dirs(
        &self,
        session: SessionId,
        changes: &[(u64, Covered)],
        made: Option<u64>,
        since: u64,
    ) -> Option<sanfs_proto::model::ChangedDirs> {
        let mut inos: Vec<u64> = Vec::new();
        for (ino, covered) in changes {
            if *covered == E && !inos.contains(ino) {
                inos.push(*ino);
            }
        }
        inos.extend(made);
        let bs = self.store.block_size();
        let attrs: Vec<Attr> = inos
            .iter()
            .take(sanfs_proto::model::MAX_CHANGED_DIRS)
            .filter_map(|ino| self.read(|t| t.getattr(bs, InodeId(*ino))).ok())
            .filter(|a| a.kind == FileType::Directory)
            .collect();
        if attrs.is_empty() {
            return None;
        }
        let mut what: Vec<(u64, Covered)> = attrs.iter().map(|a| (a.ino.0, A)).collect();
        what.extend(
            made.filter(|m| attrs.iter().any(|a| a.ino.0 == *m))
                .map(|m| (m, E)),
        );
        let lease_ms = self.grant_leases(Some(session.0), &what, since);
        Some(sanfs_proto::model::ChangedDirs { attrs, lease_ms })
    }
}

/// The wire requests that carry a `request_id`.
trait WithRequestId {
    fn take_request_id(&mut self) -> Option<pb::RequestId>;
}

macro_rules! with_request_id {
    ($($pb:ident),*) => {$(
        impl WithRequestId for pb::$pb {
            fn take_request_id(&mut self) -> Option<pb::RequestId> {
                self.request_id.take()
            }
        }
    )*};
}
with_request_id!(
    CreateRequest,
    MkdirRequest,
    MknodRequest,
    SymlinkRequest,
    LinkRequest,
    RenameRequest,
    UnlinkRequest,
    RmdirRequest
);

/// A create that ran before (its reply was lost): the stored reply, with a handle of the
/// session asking now. The stored handle is reused while it is still open under that
/// session; otherwise (a new session: the server restarted, or the agent's lease lapsed) the
/// file the first try created or opened is opened again, never truncated again.
fn create_replayed(
    ctx: &mut Ctx<'_>,
    req: &CreateRequest,
    stored: Stored<pb::CreateReply>,
) -> Result<pb::CreateReply, OpError> {
    let mut reply = stored.reply;
    let ino = reply.attr.as_ref().map(|a| a.ino).unwrap_or(0);
    let mut handles = ctx.st.handles.lock().unwrap_or_else(|p| p.into_inner());
    let still_open = handles
        .by_handle
        .get(&reply.handle)
        .is_some_and(|f| f.session == req.session.0 && f.ino == ino);
    if !still_open {
        drop(handles);
        // The inode must still exist (another node may have removed it since).
        ctx.t.inode(InodeId(ino))?;
        handles = ctx.st.handles.lock().unwrap_or_else(|p| p.into_inner());
        reply.handle = handles.open(ino, req.session.0, req.flags.write);
    }
    Ok(reply)
}

/// A stored value that no longer passes the wire's own checks: corrupt metadata.
fn corrupt(what: &str, e: impl std::fmt::Display) -> Status {
    fs_status(&FsError::Io(format!("corrupt metadata: {what}: {e}")))
}

impl Server {
    async fn open_handle(&self, who: &NodeIdentity, req: OpenRequest) -> Result<OpenReply, Status> {
        self.check_session(who, req.session)?;
        // A directory opened to be listed: the files created there come first.
        self.settle_creates(&[req.inode.0], Some(req.session.0))
            .await;
        let reply = if req.flags.truncate {
            let _guard = self
                .size_change_guard(req.inode.0, 0, req.session.0)
                .await?;
            let _leases = self
                .recall_leases(&[(req.inode.0, A)], Some(req.session.0))
                .await;
            let r = req.clone();
            self.write(move |ctx| ns::open(ctx, &r)).await?
        } else {
            let bs = self.store.block_size();
            let attr = self.read(|t| ns::open_check_only(t, bs, &req))?;
            let handle = self
                .store
                .handles()
                .open(req.inode.0, req.session.0, req.flags.write);
            // An unlink may have destroyed the inode between the check and the handle:
            // look again now that the handle keeps it alive.
            if let Err(e) = self.read(|t| t.inode(req.inode)) {
                self.release_handle(handle).await?;
                return Err(e);
            }
            self.barrier(Some(req.session)).await?;
            if attr.nlink == 0 {
                // An orphan held open by one more session: recorded, as `ns::remove::dispose`
                // records the sessions that held it when it became one.
                self.record_session(req.session.0).await?;
            }
            // A small file's bytes come with an attribute lease (as a GetAttr's answer),
            // under which the agent keeps them.
            let since = self.leases.mark();
            let (attr, data, lease_ms) = match self.small_file(&req, &attr).await {
                Some((attr, data)) => {
                    let lease_ms =
                        self.grant_leases(Some(req.session.0), &[(req.inode.0, A)], since);
                    (attr, Some(data), lease_ms)
                }
                None => (attr, None, 0),
            };
            OpenReply {
                handle: OpenHandle(handle),
                attr,
                data,
                lease_ms,
            }
        };
        self.keep_if_session_lives(req.session.0, reply.handle.0)
            .await?;
        Ok(reply)
    }

    /// The whole of a small file for an open that asked for it (`OpenRequest::read_small`),
    /// with its attributes as they are after the read, or `None` (not asked, not a small
    /// regular file, the reclaim window open, a failed read, or a change of size meanwhile:
    /// the agent then reads as usual). Read as a proxied `Read` is: under a shared lock of
    /// the range, which recalls other nodes' write layouts there first.
    async fn small_file(&self, req: &OpenRequest, attr: &Attr) -> Option<(Attr, Vec<u8>)> {
        let limit = req
            .read_small
            .min(self.params.direct_threshold)
            .min(MAX_INLINE_DATA as u64);
        if !req.flags.read
            || attr.kind != FileType::Regular
            || attr.size == 0
            || attr.size > limit
            || self.reclaiming()
        {
            return None;
        }
        let ino = req.inode.0;
        let read = self
            .grants
            .data_path()
            .read(ino, 0, attr.size, req.session.0)
            .await;
        let data = match read {
            Ok((data, true)) => data,
            Ok((_, false)) => return None,
            Err(e) => {
                tracing::debug!(ino, error = %e, "no small file's bytes with its open");
                return None;
            }
        };
        let bs = self.store.block_size();
        let now = self.read(|t| t.getattr(bs, req.inode)).ok()?;
        if now.size != data.len() as u64 {
            return None;
        }
        let n = data.len() as u64;
        self.grants
            .stats
            .proxied_read_bytes
            .fetch_add(n, Ordering::Relaxed);
        crate::activity::add_proxied(false, n);
        metrics::counter!(OPEN_SMALL_FILES).increment(1);
        Some((now, data))
    }

    /// Before a file's size changes: an exclusive lock from the lower of the old and new
    /// ends to infinity (recalling cached read grants there, waiting for write grants), and
    /// for an extension the old end-of-file block's tail zeroed on the LUN. `None` for
    /// inodes that are not regular files (the change itself then answers the error).
    pub(crate) async fn size_change_guard(
        &self,
        ino: u64,
        new_size: u64,
        session: u64,
    ) -> Result<Option<crate::proxy::Held>, Status> {
        use crate::proxy::SizeOf;
        let Ok(mut old) = self.store.read(|t| t.getattr_size(ino)) else {
            return Ok(None);
        };
        let bs = u64::from(self.store.block_size());
        for _ in 0..SIZE_GUARD_TRIES {
            let from = old.min(new_size) / bs * bs;
            let held = self
                .grants
                .exclusive(ino, crate::locks::Span::new(from, u64::MAX - from), session)
                .await
                .map_err(|e| fs_status(&e))?;
            // The holders the lock recalled completed their writes first: the size may
            // have moved meanwhile. The tail zeroed is the one past the end as it is now
            // (zeroing past the size read before would wipe bytes written during the
            // recall: the exerciser caught it).
            let Ok(now) = self.store.read(|t| t.getattr_size(ino)) else {
                return Ok(None);
            };
            if now.min(new_size) / bs * bs < from {
                // It shrank below the locked span: again, with the span from there.
                drop(held);
                old = now;
                continue;
            }
            if new_size > now {
                self.grants
                    .data_path()
                    .zero_eof_tail(ino, now)
                    .await
                    .map_err(|e| fs_status(&e))?;
            }
            return Ok(Some(held));
        }
        Err(fs_status(&FsError::Io(format!(
            "inode {ino}: its size kept changing under other nodes' truncates"
        ))))
    }

    /// The session a Lookup or ReadDir asks leases for: only a live one of the caller's.
    fn lease_session(&self, who: &NodeIdentity, session: Option<SessionId>) -> Option<u64> {
        session
            .filter(|s| self.check_session(who, *s).is_ok())
            .map(|s| s.0)
    }

    /// What removing or replacing the names `entries` changes: each directory's names and
    /// attributes, and the attributes of the inodes the names lead to now.
    fn entry_changes(&self, entries: &[(InodeId, &FileName)]) -> Vec<(u64, Covered)> {
        let mut changes = Vec::new();
        for (parent, name) in entries {
            changes.push((parent.0, E));
            changes.push((parent.0, A));
            if let Ok(Some((child, _, _))) = self.store.read(|t| t.dirent(*parent, name.as_bytes()))
            {
                changes.push((child.0, A));
            }
        }
        changes
    }

    /// A change of mode, owners or times (`SetAttr` without a size) under `session`, after
    /// the headers: checked first (a change the caller may not make is refused before
    /// anything waits for it: no other node's lease is recalled, nor its writes settled, for
    /// nothing; found by fuzz_calls, where refused chmods waited seconds for recalls; the
    /// change checks again), then answered before it is durable. The attributes, the
    /// commit, and the lease change to end.
    async fn set_attr_unsized(
        &self,
        session: Option<SessionId>,
        req: SetAttrRequest,
        by_write_handle: bool,
    ) -> Result<(Attr, sanfs_proto::headers::CommitNote, LeaseChange<'_>), Status> {
        self.setattr_allowed(&req, by_write_handle)?;
        // Writes of other nodes that returned before this change (held back, or completed
        // behind them) are in first: none sets the mtime after it.
        self.grants
            .settle_others(req.inode.0, session.map_or(0, |s| s.0))
            .await;
        let leases = self
            .recall_leases(&[(req.inode.0, A)], session.map(|s| s.0))
            .await;
        let (attr, commit) = self
            .change(session, move |ctx| ns::setattr(ctx, &req))
            .await?;
        Ok((attr, commit, leases))
    }

    /// Whether the caller of `req` may make it (`by_write_handle`: its handle is open for
    /// writing), as the inode is now.
    fn setattr_allowed(&self, req: &SetAttrRequest, by_write_handle: bool) -> Result<(), Status> {
        self.read(|t| {
            use crate::store::ReaderInodes;
            ns::setattr_allowed(req, &t.inode_rec(req.inode)?, || by_write_handle)
        })
    }

    /// One change of a `ChangeBatch`, run as its own `Unlink`, `Rename` or `SetAttr` call
    /// would run it after the headers (the same checks, reply cache and recalls): its
    /// commit note.
    async fn change_batched(
        &self,
        session: Option<SessionId>,
        change: BatchedChange,
        id: Option<RequestId>,
    ) -> Result<sanfs_proto::headers::CommitNote, Status> {
        self.wait_reclaim().await;
        // The agent keeps what it counted of the directories, and the attributes it
        // answered with: no reply notes but the commit.
        let (commit, leases) = match change {
            BatchedChange::Unlink(r) => {
                let leases = self
                    .entry_change_leases(session, &[(r.parent, &r.name)])
                    .await;
                let (_, commit) = self
                    .change(session, move |ctx| {
                        replies::run_once(ctx, id, 0, |ctx| {
                            ns::unlink(ctx, &r, false).map(|_| pb::UnlinkReply {})
                        })
                    })
                    .await?;
                (commit, leases)
            }
            BatchedChange::Rename(r) => {
                let leases = self
                    .entry_change_leases(
                        session,
                        &[(r.old_parent, &r.old_name), (r.new_parent, &r.new_name)],
                    )
                    .await;
                let (_, commit) = self
                    .change(session, move |ctx| {
                        replies::run_once(ctx, id, 0, |ctx| {
                            ns::rename(ctx, &r).map(|_| pb::RenameReply {})
                        })
                    })
                    .await?;
                (commit, leases)
            }
            BatchedChange::SetAttr(r) => {
                note(session.map(|s| s.0), Some(r.inode.0));
                let (_, commit, leases) = self.set_attr_unsized(session, r, false).await?;
                (commit, leases)
            }
        };
        leases.end();
        Ok(commit)
    }

    /// Before a change of the entries `entries` under `session`: the leases it changes,
    /// recalled from every other holder.
    async fn entry_change_leases(
        &self,
        session: Option<SessionId>,
        entries: &[(InodeId, &FileName)],
    ) -> LeaseChange<'_> {
        note(session.map(|s| s.0), entries.first().map(|(dir, _)| dir.0));
        let changes = self.entry_changes(entries);
        self.recall_leases(&changes, session.map(|s| s.0)).await
    }

    /// A handle registered for a session that ended meanwhile is released at once.
    async fn keep_if_session_lives(&self, session: u64, handle: u64) -> Result<(), Status> {
        if self.sessions().by_id.contains_key(&session) {
            return Ok(());
        }
        self.release_handle(handle).await?;
        Err(fs_status(&FsError::StaleSession))
    }

    /// One create (not a replay) of the caller `who`, under the header's session: the body
    /// of `Create`, and of each create of a `CreateBatch`.
    async fn create_one(
        &self,
        who: &NodeIdentity,
        header_session: Option<SessionId>,
        req: CreateRequest,
        id: Option<RequestId>,
    ) -> Result<(pb::CreateReply, Noted), Status> {
        self.wait_reclaim().await;
        note(Some(req.session.0), Some(req.parent.0));
        let session = req.session;
        self.check_session(who, session)?;
        let truncating = req.flags.truncate && !req.exclusive;
        // Answered before durable when made under its session's header (an agent that
        // keeps it for a replay), unless it truncates an existing file: a size change is
        // durable when answered, as in SetAttr. A lazy try that finds the name taken
        // changes nothing and comes back here as a durable one.
        let mut lazy = header_session == Some(session);
        let (mut reply, commit, since) = loop {
            // Truncating an existing file changes what grants describe.
            let existing = if truncating {
                let (parent, name) = (req.parent.0, req.name.clone());
                self.store
                    .read(|t| t.dirent(InodeId(parent), name.as_bytes()))
                    .ok()
                    .flatten()
                    .map(|(child, _, _)| child)
            } else {
                None
            };
            lazy &= existing.is_none();
            let _guard = match existing {
                Some(child) => self.size_change_guard(child.0, 0, session.0).await?,
                None => None,
            };
            let mut changes = vec![(req.parent.0, E), (req.parent.0, A)];
            changes.extend(existing.map(|c| (c.0, A)));
            let leases = self.recall_leases(&changes, Some(session.0)).await;
            let r = req.clone();
            let check_free = lazy && truncating;
            let reserved = self.reserved.clone();
            let (reply, commit) = self
                .change(lazy.then_some(session), move |ctx| {
                    if check_free && ctx.t.dirent(r.parent, r.name.as_bytes())?.is_some() {
                        return Ok(None);
                    }
                    let once = replies::run_once(ctx, id, session.0, |ctx| {
                        // A number the agent reserved: the file gets it (once), with its
                        // generation.
                        if let Some(ino) = r.inode {
                            let generation = reserved.take(session.0, ino)?;
                            ctx.forced_inode = Some((ino.0, generation));
                        }
                        ns::create(ctx, &r).map(pb::CreateReply::from)
                    })?;
                    match once {
                        Once::Fresh(reply) => Ok(Some(reply)),
                        Once::Replayed(stored) => create_replayed(ctx, &r, stored).map(Some),
                    }
                })
                .await?;
            match reply {
                Some(reply) => {
                    let (noted, since) =
                        self.change_noted(lazy.then_some(session), commit, leases, &changes, None);
                    break (reply, noted, since);
                }
                None => lazy = false,
            }
        };
        self.keep_if_session_lives(session.0, reply.handle).await?;
        // The new file's attributes and the parent's names, leased to the creator (an
        // agent that names its session: it caches them).
        if header_session == Some(session)
            && let Some(ino) = reply.attr.as_ref().map(|a| a.ino)
        {
            // A create its agent answered already (under the directory's delegation, whose
            // entry lease it holds): the file's attributes only. Its neighbours in a batch
            // change the directory at the same time, which would refuse a lease on its
            // names given as of this one's end, and with it the file's.
            let what: &[(u64, Covered)] = if req.inode.is_some() {
                &[(ino, A)]
            } else {
                &[(req.parent.0, E), (ino, A)]
            };
            reply.lease_ms = self.grant_leases(Some(session.0), what, since);
        }
        // The new file's write delegation, asked for with it (saves the Delegate call of
        // its first buffered write). Not for a file that was there already.
        if req.delegate
            && reply.created
            && req.flags.write
            && let Some(ino) = reply.attr.as_ref().map(|a| a.ino)
        {
            reply.delegation = self
                .delegate_to(session.0, self.epoch.0, ino, true)
                .await
                .unwrap_or(0);
        }
        Ok((reply, commit))
    }

    fn statfs(&self, req: &InodeRequest) -> Result<StatFs, Status> {
        let bs = self.store.block_size();
        self.read(|t| t.inode(req.inode))?;
        let usage = self.store.usage();
        let load = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
        let total_blocks = load(&usage.total_blocks);
        let free_blocks = load(&usage.free_blocks).min(total_blocks);
        let inodes = load(&usage.inodes);
        // Inodes are not preallocated (they live in the metadata store): report as many
        // free as there are free blocks, so that `df -i` shows a full volume as full.
        let free_inodes = free_blocks;
        let mut st = StatFs {
            block_size: bs,
            total_blocks,
            free_blocks,
            avail_blocks: free_blocks,
            total_inodes: inodes.saturating_add(free_inodes),
            free_inodes,
            name_max: u32::try_from(NAME_MAX).unwrap_or(255),
        };
        // Inside a directory quota, df shows the quota (what a CSI volume's user expects).
        if let Some((_, q)) =
            crate::quota::quota_of(&self.store, req.inode.0).map_err(|e| fs_status(&e))?
        {
            if let Some(limit) = q.limit_bytes {
                let total = limit / u64::from(bs);
                let free = total.saturating_sub(q.used_blocks).min(free_blocks);
                st.total_blocks = total;
                st.free_blocks = free;
                st.avail_blocks = free;
            }
            if let Some(limit) = q.limit_inodes {
                st.total_inodes = limit;
                st.free_inodes = limit.saturating_sub(q.used_inodes);
            }
        }
        Ok(st)
    }
}

#[tonic::async_trait]
impl Namespace for NamespaceService {
    async fn lookup(
        &self,
        request: Request<pb::LookupRequest>,
    ) -> Result<Response<pb::LookupReply>, Status> {
        rpc("Lookup", async {
            let (session, _) = change_headers(&self.server, &request).await?;
            let who = caller(&request)?;
            let leased: LeasedLookup = accept(request)?;
            let lease_session = self.server.lease_session(&who, leased.session);
            let req = leased.entry;
            self.server.wait_reclaim().await;
            note(session.map(|s| s.0), Some(req.parent.0));
            let bs = self.server.store.block_size();
            // Files another node created in the directory and told its applications about
            // come first; so do those in a directory found (its attributes count them).
            let reader = session.map(|s| s.0).or(lease_session);
            self.server.settle_creates(&[req.parent.0], reader).await;
            let since = self.server.leases.mark();
            let mut attr = self.server.read(|t| t.lookup(bs, &req))?;
            if attr.kind == FileType::Directory
                && self.server.settle_creates(&[attr.ino.0], reader).await
            {
                attr = self.server.read(|t| t.lookup(bs, &req))?;
            }
            // The caller's own changes need not be durable for it to see them (its agent
            // keeps them until they are): only other sessions' are synced first.
            self.server
                .barrier(session.or(lease_session.map(SessionId)))
                .await?;
            // A size another node holds writes back for: those writes first (the lookup's
            // caller is not known, so its own delegation is recalled too).
            if attr.kind == FileType::Regular && self.server.grants.any_write_delegation() {
                self.server.grants.settle_delegations(attr.ino.0).await;
                attr = self.server.read(|t| t.lookup(bs, &req))?;
            }
            let lease_ms = self.server.grant_leases(
                lease_session,
                &[(req.parent.0, E), (attr.ino.0, A)],
                since,
            );
            Ok(Leased {
                value: attr,
                lease_ms,
            }
            .into())
        })
        .await
    }

    async fn get_attr(
        &self,
        request: Request<pb::GetAttrRequest>,
    ) -> Result<Response<pb::GetAttrReply>, Status> {
        rpc("GetAttr", async {
            let who = caller(&request)?;
            let (header_session, _) = change_headers(&self.server, &request).await?;
            let req: GetAttrRequest = accept(request)?;
            let session = header_session.or(req
                .session
                .filter(|s| self.server.check_session(&who, *s).is_ok()));
            self.server.wait_reclaim().await;
            note(req.session.map(|s| s.0), Some(req.inode.0));
            // The caller's own delegation is not recalled: only for a session of the
            // caller's (a session that is not is no error, only no exception).
            let own = req
                .session
                .filter(|s| self.server.check_session(&who, *s).is_ok())
                .map_or(0, |s| s.0);
            // Writes inside write layouts are completed behind them: the size and mtime
            // include every write that returned anywhere once those completions are in (and
            // another session's write delegation is recalled: its agent writes back first).
            self.server.grants.settle_attr(req.inode.0, own).await;
            self.server
                .settle_creates(&[req.inode.0], session.map(|s| s.0))
                .await;
            let req = InodeRequest {
                cred: req.cred,
                inode: req.inode,
            };
            let bs = self.server.store.block_size();
            let since = self.server.leases.mark();
            let attr = self.server.read(|t| t.getattr(bs, req.inode))?;
            self.server.barrier(session).await?;
            let lease_ms =
                self.server
                    .grant_leases((own != 0).then_some(own), &[(req.inode.0, A)], since);
            Ok(Leased {
                value: attr,
                lease_ms,
            }
            .into())
        })
        .await
    }

    async fn set_attr(
        &self,
        request: Request<pb::SetAttrRequest>,
    ) -> Result<Response<pb::SetAttrReply>, Status> {
        rpc_noted("SetAttr", async {
            let (session, replay) = change_headers(&self.server, &request).await?;
            let req: SetAttrRequest = accept(request)?;
            if let Some(tag) = replay {
                let commit = self
                    .server
                    .replay_change(session, tag, NsChange::SetAttr(req))
                    .await?;
                return Ok((Default::default(), Noted::from(commit)));
            }
            self.server.wait_reclaim().await;
            note(req.handle.map(|h| h.session.0), Some(req.inode.0));
            // A change the caller may not make is refused before anything waits for it: no
            // other node's lease is recalled, nor its writes settled, for nothing (found by
            // fuzz_calls: refused chmods waited seconds for recalls). The change checks again.
            let by_write_handle = req
                .handle
                .is_some_and(|h| self.server.store.handles().writes(h.handle.0, req.inode.0));
            let Some(size) = req.changes.size else {
                let ino = req.inode.0;
                let (attr, commit, leases) = self
                    .server
                    .set_attr_unsized(session, req, by_write_handle)
                    .await?;
                // The attributes as changed, leased to the changer (an agent that keeps its
                // changes names its session): its next stat or lookup of them asks nothing.
                let mut forget = leases.own().to_vec();
                let since = leases.end();
                let (attr, lease_ms) =
                    self.server
                        .lease_changed_attr(session.map(|s| s.0), InodeId(ino), since, attr);
                if lease_ms > 0 {
                    // The lease it held there is replaced by this one, not to be dropped.
                    forget.retain(|i| i.0 != ino);
                }
                let reply = pb::SetAttrReply::from(Leased {
                    value: attr,
                    lease_ms,
                });
                let noted = Noted {
                    commit,
                    forget,
                    dirs: None,
                };
                return Ok((reply, noted));
            };
            self.server.setattr_allowed(&req, by_write_handle)?;
            // A size change is durable when answered: it changes what grants describe, and
            // data replays must never meet a truncate of their own session's still to come.
            let handle_session = req.handle.map_or(0, |h| h.session.0);
            let _guard = self
                .server
                .size_change_guard(req.inode.0, size, handle_session)
                .await?;
            let leases = self
                .server
                .recall_leases(&[(req.inode.0, A)], session.map(|s| s.0))
                .await;
            let attr: Attr = self.server.write(move |ctx| ns::setattr(ctx, &req)).await?;
            Ok((attr.into(), noted(self.server.commit_note(0), &leases)))
        })
        .await
    }

    async fn create(
        &self,
        request: Request<pb::CreateRequest>,
    ) -> Result<Response<pb::CreateReply>, Status> {
        rpc_noted("Create", async {
            let who = caller(&request)?;
            let (header_session, replay) = change_headers(&self.server, &request).await?;
            let (mut req, id): (CreateRequest, _) = accept_once(request)?;
            if let Some(tag) = replay {
                // Made under the new session (the one in the request is the last epoch's).
                if let Some(s) = header_session {
                    req.session = s;
                }
                let commit = self
                    .server
                    .replay_change(header_session, tag, NsChange::Create(req))
                    .await?;
                return Ok((Default::default(), Noted::from(commit)));
            }
            self.server.create_one(&who, header_session, req, id).await
        })
        .await
    }

    async fn create_batch(
        &self,
        request: Request<pb::CreateBatchRequest>,
    ) -> Result<Response<pb::CreateBatchReply>, Status> {
        rpc("CreateBatch", async {
            let who = caller(&request)?;
            let (header_session, replay) = change_headers(&self.server, &request).await?;
            if replay.is_some() {
                return Err(fs_status(&FsError::Invalid(
                    "a replay is sent as single Create calls".into(),
                )));
            }
            let batch: CreateBatchRequest = convert(request.into_inner())?;
            note(header_session.map(|s| s.0), None);
            // All at once: their jobs reach the committer together, one commit for the lot.
            let results =
                futures_util::future::join_all(batch.creates.into_iter().map(|(mut req, id)| {
                    who.policy.squash(&mut req.cred);
                    self.server.create_one(&who, header_session, req, id)
                }))
                .await;
            let results = results
                .into_iter()
                .map(|r| match r {
                    Ok((reply, noted)) => pb::CreateResult {
                        reply: Some(reply),
                        commit_seq: noted.commit.seq,
                        durable_seq: noted.commit.durable_seq,
                        errno: 0,
                        error: String::new(),
                    },
                    Err(status) => {
                        let e = sanfs_proto::status::fs_error_from_status(&status);
                        pb::CreateResult {
                            reply: None,
                            commit_seq: 0,
                            durable_seq: 0,
                            errno: u32::try_from(e.errno()).unwrap_or(5).max(1),
                            error: status.message().to_owned(),
                        }
                    }
                })
                .collect();
            Ok(pb::CreateBatchReply { results })
        })
        .await
    }

    async fn change_batch(
        &self,
        request: Request<pb::ChangeBatchRequest>,
    ) -> Result<Response<pb::ChangeBatchReply>, Status> {
        rpc("ChangeBatch", async {
            let who = caller(&request)?;
            let (session, replay) = change_headers(&self.server, &request).await?;
            if replay.is_some() {
                return Err(fs_status(&FsError::Invalid(
                    "a replay is sent as single Unlink, Rename and SetAttr calls".into(),
                )));
            }
            let batch: ChangeBatchRequest = convert(request.into_inner())?;
            note(session.map(|s| s.0), None);
            // Side by side: their jobs reach the committer together (one commit for the lot);
            // no two name one entry, so their order does not matter.
            let results =
                futures_util::future::join_all(batch.changes.into_iter().map(|(mut c, id)| {
                    match &mut c {
                        BatchedChange::Unlink(r) => who.policy.squash(&mut r.cred),
                        BatchedChange::Rename(r) => who.policy.squash(&mut r.cred),
                        BatchedChange::SetAttr(r) => who.policy.squash(&mut r.cred),
                    }
                    self.server.change_batched(session, c, id)
                }))
                .await;
            let results = results
                .into_iter()
                .map(|r| {
                    pb::ChangeResult::from(match r {
                        Ok(commit) => ChangeResult::Done {
                            commit_seq: commit.seq,
                            durable_seq: commit.durable_seq,
                        },
                        Err(status) => {
                            let e = sanfs_proto::status::fs_error_from_status(&status);
                            ChangeResult::Refused {
                                errno: u32::try_from(e.errno()).unwrap_or(5).max(1),
                                error: status.message().to_owned(),
                            }
                        }
                    })
                })
                .collect();
            Ok(pb::ChangeBatchReply { results })
        })
        .await
    }

    async fn mkdir(
        &self,
        request: Request<pb::MkdirRequest>,
    ) -> Result<Response<pb::MkdirReply>, Status> {
        change_once!(
            self,
            request,
            "Mkdir",
            MkdirRequest,
            Mkdir,
            |req| req.parent.0,
            leases: vec![(req.parent.0, E), (req.parent.0, A)],
            |ctx| { ns::mkdir(ctx, &req).map(pb::MkdirReply::from) }
        )
    }

    async fn mknod(
        &self,
        request: Request<pb::MknodRequest>,
    ) -> Result<Response<pb::MknodReply>, Status> {
        change_once!(
            self,
            request,
            "Mknod",
            MknodRequest,
            Mknod,
            |req| req.parent.0,
            leases: vec![(req.parent.0, E), (req.parent.0, A)],
            |ctx| { ns::mknod(ctx, &req).map(pb::MknodReply::from) }
        )
    }

    async fn unlink(
        &self,
        request: Request<pb::UnlinkRequest>,
    ) -> Result<Response<pb::UnlinkReply>, Status> {
        change_once!(
            self,
            request,
            "Unlink",
            EntryRequest,
            Unlink,
            |req| req.parent.0,
            leases: self.server.entry_changes(&[(req.parent, &req.name)]),
            |ctx| { ns::unlink(ctx, &req, false).map(|_| pb::UnlinkReply {}) }
        )
    }

    async fn rmdir(
        &self,
        request: Request<pb::RmdirRequest>,
    ) -> Result<Response<pb::RmdirReply>, Status> {
        change_once!(
            self,
            request,
            "Rmdir",
            EntryRequest,
            Rmdir,
            |req| req.parent.0,
            leases: self.server.entry_changes(&[(req.parent, &req.name)]),
            |ctx| { ns::unlink(ctx, &req, true).map(|_| pb::RmdirReply {}) }
        )
    }

    async fn rename(
        &self,
        request: Request<pb::RenameRequest>,
    ) -> Result<Response<pb::RenameReply>, Status> {
        change_once!(
            self,
            request,
            "Rename",
            RenameRequest,
            Rename,
            |req| req.old_parent.0,
            leases: self.server.entry_changes(&[(req.old_parent, &req.old_name), (req.new_parent, &req.new_name)]),
            |ctx| { ns::rename(ctx, &req).map(|_| pb::RenameReply {}) }
        )
    }

    async fn link(
        &self,
        request: Request<pb::LinkRequest>,
    ) -> Result<Response<pb::LinkReply>, Status> {
        change_once!(
            self,
            request,
            "Link",
            LinkRequest,
            Link,
            |req| req.inode.0,
            leases: vec![(req.new_parent.0, E), (req.new_parent.0, A), (req.inode.0, A)],
            |ctx| { ns::link(ctx, &req).map(pb::LinkReply::from) }
        )
    }

    async fn symlink(
        &self,
        request: Request<pb::SymlinkRequest>,
    ) -> Result<Response<pb::SymlinkReply>, Status> {
        change_once!(
            self,
            request,
            "Symlink",
            SymlinkRequest,
            Symlink,
            |req| req.parent.0,
            leases: vec![(req.parent.0, E), (req.parent.0, A)],
            |ctx| { ns::symlink(ctx, &req).map(pb::SymlinkReply::from) }
        )
    }

    async fn readlink(
        &self,
        request: Request<pb::ReadlinkRequest>,
    ) -> Result<Response<pb::ReadlinkReply>, Status> {
        rpc("Readlink", async {
            let (session, _) = change_headers(&self.server, &request).await?;
            let req: InodeRequest = accept(request)?;
            self.server.wait_reclaim().await;
            note(None, Some(req.inode.0));
            let bytes = self.server.read(|t| t.readlink(req.inode))?;
            self.server.barrier(session).await?;
            let target = SymlinkTarget::new(bytes).map_err(|e| corrupt("symlink target", e))?;
            Ok(target.into())
        })
        .await
    }

    async fn read_dir(
        &self,
        request: Request<pb::ReadDirRequest>,
    ) -> Result<Response<pb::ReadDirReply>, Status> {
        rpc("ReadDir", async {
            let (session, _) = change_headers(&self.server, &request).await?;
            let who = caller(&request)?;
            let leased: LeasedReadDir = accept(request)?;
            let lease_session = self.server.lease_session(&who, leased.session);
            let req = leased.request;
            self.server.wait_reclaim().await;
            note(None, Some(req.inode.0));
            let bs = self.server.store.block_size();
            let reader = session.map(|s| s.0).or(lease_session);
            self.server.settle_creates(&[req.inode.0], reader).await;
            let since = self.server.leases.mark();
            let mut reply = self.server.read(|t| t.readdir(bs, &req))?;
            // The attributes of directories listed count files created there too.
            let dirs: Vec<u64> = reply
                .entries
                .iter()
                .filter_map(|e| e.attr.as_ref())
                .filter(|a| a.kind == FileType::Directory)
                .map(|a| a.ino.0)
                .collect();
            if !dirs.is_empty() && self.server.settle_creates(&dirs, reader).await {
                reply = self.server.read(|t| t.readdir(bs, &req))?;
            }
            // As for Lookup: only other sessions' changes are synced first.
            self.server
                .barrier(session.or(lease_session.map(SessionId)))
                .await?;
            // Attributes of files another node holds writes back for: those writes first.
            if self.server.grants.any_write_delegation() {
                let mut settled = false;
                for e in &reply.entries {
                    if let Some(a) = e.attr.as_ref().filter(|a| a.kind == FileType::Regular) {
                        self.server.grants.settle_delegations(a.ino.0).await;
                        settled = true;
                    }
                }
                if settled {
                    reply = self.server.read(|t| t.readdir(bs, &req))?;
                }
            }
            let mut covered = vec![(req.inode.0, E)];
            covered.extend(
                reply
                    .entries
                    .iter()
                    .filter(|e| e.attr.is_some())
                    .map(|e| (e.inode.0, A)),
            );
            let lease_ms = self.server.grant_leases(lease_session, &covered, since);
            Ok(Leased {
                value: reply,
                lease_ms,
            }
            .into())
        })
        .await
    }

    async fn stat_fs(
        &self,
        request: Request<pb::StatFsRequest>,
    ) -> Result<Response<pb::StatFsReply>, Status> {
        rpc("StatFs", async {
            let (session, _) = change_headers(&self.server, &request).await?;
            let req: InodeRequest = accept(request)?;
            self.server.wait_reclaim().await;
            note(None, Some(req.inode.0));
            let st = self.server.statfs(&req)?;
            self.server.barrier(session).await?;
            Ok(st.into())
        })
        .await
    }

    async fn get_xattr(
        &self,
        request: Request<pb::GetXattrRequest>,
    ) -> Result<Response<pb::GetXattrReply>, Status> {
        rpc("GetXattr", async {
            let (session, _) = change_headers(&self.server, &request).await?;
            let req: XattrRequest = accept(request)?;
            self.server.wait_reclaim().await;
            note(None, Some(req.inode.0));
            self.server
                .settle_creates(&[req.inode.0], session.map(|s| s.0))
                .await;
            let value = self.server.read(|t| t.getxattr(&req))?;
            self.server.barrier(session).await?;
            Ok(XattrValue(value).into())
        })
        .await
    }

    async fn set_xattr(
        &self,
        request: Request<pb::SetXattrRequest>,
    ) -> Result<Response<pb::SetXattrReply>, Status> {
        rpc_noted("SetXattr", async {
            let (session, replay) = change_headers(&self.server, &request).await?;
            let req: SetXattrRequest = accept(request)?;
            if let Some(tag) = replay {
                let commit = self
                    .server
                    .replay_change(session, tag, NsChange::SetXattr(req))
                    .await?;
                return Ok((Default::default(), Noted::from(commit)));
            }
            self.server.wait_reclaim().await;
            note(session.map(|s| s.0), Some(req.inode.0));
            let leases = self
                .server
                .recall_leases(&[(req.inode.0, A)], session.map(|s| s.0))
                .await;
            let ((), commit) = self
                .server
                .change(session, move |ctx| ns::setxattr(ctx, &req))
                .await?;
            Ok((pb::SetXattrReply {}, noted(commit, &leases)))
        })
        .await
    }

    async fn list_xattr(
        &self,
        request: Request<pb::ListXattrRequest>,
    ) -> Result<Response<pb::ListXattrReply>, Status> {
        rpc("ListXattr", async {
            let (session, _) = change_headers(&self.server, &request).await?;
            let req: InodeRequest = accept(request)?;
            self.server.wait_reclaim().await;
            note(None, Some(req.inode.0));
            self.server
                .settle_creates(&[req.inode.0], session.map(|s| s.0))
                .await;
            let names = self.server.read(|t| t.listxattr(&req.cred, req.inode))?;
            self.server.barrier(session).await?;
            let names = names
                .into_iter()
                .map(XattrName::new)
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| corrupt("xattr name", e))?;
            Ok(XattrNames(names).into())
        })
        .await
    }

    async fn remove_xattr(
        &self,
        request: Request<pb::RemoveXattrRequest>,
    ) -> Result<Response<pb::RemoveXattrReply>, Status> {
        rpc_noted("RemoveXattr", async {
            let (session, replay) = change_headers(&self.server, &request).await?;
            let req: XattrRequest = accept(request)?;
            if let Some(tag) = replay {
                let commit = self
                    .server
                    .replay_change(session, tag, NsChange::RemoveXattr(req))
                    .await?;
                return Ok((Default::default(), Noted::from(commit)));
            }
            self.server.wait_reclaim().await;
            note(session.map(|s| s.0), Some(req.inode.0));
            let leases = self
                .server
                .recall_leases(&[(req.inode.0, A)], session.map(|s| s.0))
                .await;
            let ((), commit) = self
                .server
                .change(session, move |ctx| ns::removexattr(ctx, &req))
                .await?;
            Ok((pb::RemoveXattrReply {}, noted(commit, &leases)))
        })
        .await
    }

    async fn open(
        &self,
        request: Request<pb::OpenRequest>,
    ) -> Result<Response<pb::OpenReply>, Status> {
        rpc("Open", async {
            let who = caller(&request)?;
            let req: OpenRequest = accept(request)?;
            // An open that changes nothing goes ahead in the reclaim window: agents open their
            // files again there, before the recovery reaps the orphans nobody holds.
            if req.flags.truncate {
                self.server.wait_reclaim().await;
            }
            note(Some(req.session.0), Some(req.inode.0));
            Ok(self.server.open_handle(&who, req).await?.into())
        })
        .await
    }

    async fn release(
        &self,
        request: Request<pb::ReleaseRequest>,
    ) -> Result<Response<pb::ReleaseReply>, Status> {
        rpc("Release", async {
            let who = caller(&request)?;
            // More of the session's handles, closed together (an agent's batch).
            self.server.release_attached(&who, &request).await?;
            let req: HandleRef = convert(request.into_inner())?;
            note(Some(req.session.0), None);
            self.server.check_session(&who, req.session)?;
            let owned = self
                .server
                .store
                .handles()
                .by_handle
                .get(&req.handle.0)
                .map(|f| (f.session, f.ino));
            match owned {
                Some((session, ino)) if session == req.session.0 => {
                    note(None, Some(ino));
                    self.server.release_handle(req.handle.0).await?;
                    Ok(pb::ReleaseReply {})
                }
                // Not open, or another session's: a stale handle.
                _ => Err(fs_status(&FsError::Stale)),
            }
        })
        .await
    }

    async fn reserve_inodes(
        &self,
        request: Request<pb::ReserveInodesRequest>,
    ) -> Result<Response<pb::ReserveInodesReply>, Status> {
        rpc("ReserveInodes", async {
            let who = caller(&request)?;
            let req: ReserveInodesRequest = convert(request.into_inner())?;
            self.server.wait_reclaim().await;
            note(Some(req.session.0), None);
            let session = req.session.0;
            self.server.check_session(&who, req.session)?;
            if !self.server.reserved.has_room(session) {
                return Err(fs_status(&FsError::Invalid(format!(
                    "this session holds {} reservations with numbers left already",
                    crate::reserved::MAX_BLOCKS_PER_SESSION
                ))));
            }
            // Durable before the numbers are handed out: an agent answers creates with them.
            let count = req.count;
            let (first, first_generation) = self
                .server
                .write(move |ctx| ctx.reserve_inode_numbers(count))
                .await?;
            let reply = ReserveInodesReply {
                first: InodeId(first),
                count,
                first_generation,
            };
            self.server.reserved.add(session, reply);
            // The session may have ended meanwhile: then its numbers go with it.
            if self.server.check_session(&who, req.session).is_err() {
                self.server.reserved.forget_session(session);
            }
            metrics::counter!("sanfs_reserved_inodes_total").increment(u64::from(count));
            Ok(pb::ReserveInodesReply::from(reply))
        })
        .await
    }

    async fn access(
        &self,
        request: Request<pb::AccessRequest>,
    ) -> Result<Response<pb::AccessReply>, Status> {
        rpc("Access", async {
            let (session, _) = change_headers(&self.server, &request).await?;
            let req: AccessRequest = accept(request)?;
            self.server.wait_reclaim().await;
            note(None, Some(req.inode.0));
            self.server
                .settle_creates(&[req.inode.0], session.map(|s| s.0))
                .await;
            self.server
                .read(|t| t.access(&req.cred, req.inode, req.mask))?;
            self.server.barrier(session).await?;
            Ok(pb::AccessReply {})
        })
        .await
    }
}
