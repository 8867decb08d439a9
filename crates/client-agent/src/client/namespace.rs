//! The namespace calls: thin wrappers that validate their arguments with the protocol's own
//! types (so a 256-byte name never leaves the node), send the request, and convert the reply
//! back to model types. Errors are [`FsError`] (errno via [`FsError::errno`]). Calls that
//! open files (`create`, `open`) run under the current session and return a [`FileHandle`]
//! naming it; see the module docs of [`crate::client`] for what happens to handles when the
//! session is replaced.

use sanfs_proto::model::{
    AccessRequest, ChangeBatchReply, ChangeResult, CreateBatchReply, CreateReply, CreateRequest,
    CreateResult, EntryRequest, GetAttrRequest, HandleRef, InodeRequest, Leased, LinkRequest,
    LockMode, MAX_CREATE_BATCH, MkdirRequest, MknodRequest, OpenFlags, OpenReply, OpenRequest,
    ReadDirReply, ReadDirRequest, RenameRequest, SetAttrRequest, SetXattrRequest, StatFs,
    SymlinkRequest, XattrNames, XattrRequest, XattrValue,
};
use sanfs_proto::pb;
use sanfs_proto::types::{
    Attr, ByteRange, Credentials, FileName, FileType, FsError, InodeId, RenameMode, SetAttr,
    SymlinkTarget, XattrMode, XattrName,
};

use super::creates::{Answered, HereChange, QueuedChange};
use super::leases::{SMALL_FILE_MAX, SmallHint};
use super::rpc::{Pin, with_session};
use super::unsynced::{NsChange, NsRecord};
use super::{Client, FileHandle, Inner, SessionView};
use sanfs_proto::headers::CommitNote;
use std::sync::Arc;

/// What `create` did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Created {
    pub handle: FileHandle,
    pub attr: Attr,
    /// False: the file existed and was opened.
    pub created: bool,
    /// How long the kernel may keep the name and attributes (held under leases given with
    /// the reply); `None` without.
    pub ttl: Option<std::time::Duration>,
}

fn name(bytes: impl AsRef<[u8]>) -> Result<FileName, FsError> {
    Ok(FileName::new(bytes.as_ref().to_vec())?)
}

/// What a create made: the inode and generation its replay must make again.
fn made(attr: &Attr) -> Option<(InodeId, u64)> {
    Some((attr.ino, attr.generation))
}

/// Runs one namespace rpc through [`Inner::call`](super::Inner::call): `$call` on a fresh
/// client with the request (rebuilt for every try, under the current session), the reply
/// converted with `TryFrom` into `$out`; without `$out`, the reply is dropped.
///
/// `change`: a namespace change through the reply cache, kept as an [`NsRecord`] while
/// the server says it is not durable yet (`$inode`: for a create, the inode it made, from
/// the reply `$value`).
macro_rules! rpc {
    (change $self:ident, $call:ident, $req:expr, $variant:ident, $what:literal,
     own($inos:expr, $removed:expr, $added:expr), |$value:ident: $out:ty| $inode:expr) => {{
        rpc!(change $self, $call, $req, $variant, $what, own($inos, $removed, $added),
             |$value: $out| $inode, |own, dirs| own.end(dirs.as_ref(), $self.lease_deadline()))
    }};
    // `$end`: how the lease cache's own change ends (see below).
    (change $self:ident, $call:ident, $req:expr, $variant:ident, $what:literal,
     own($inos:expr, $removed:expr, $added:expr), |$value:ident: $out:ty| $inode:expr,
     |$own:ident, $dirs:ident| $end:expr) => {{
        let pending = $self.inner.requests.begin();
        let mut req = $req;
        req.request_id = pending.wire();
        rpc!(change_as_is $self, $call, req, $variant, $what, own($inos, $removed, $added),
             |$value: $out| $inode, |$own, $dirs| $end)
    }};
    // A change whose request has no reply-cache id (attributes, xattrs).
    (change_as_is $self:ident, $call:ident, $req:expr, $variant:ident, $what:literal,
     own($inos:expr, $removed:expr, $added:expr), |$value:ident: $out:ty| $inode:expr) => {{
        rpc!(change_as_is $self, $call, $req, $variant, $what, own($inos, $removed, $added),
             |$value: $out| $inode, |own, dirs| own.end(dirs.as_ref(), $self.lease_deadline()))
    }};
    // `$end`: how the lease cache's own change ends with the reply's changed directories.
    (change_as_is $self:ident, $call:ident, $req:expr, $variant:ident, $what:literal,
     own($inos:expr, $removed:expr, $added:expr), |$value:ident: $out:ty| $inode:expr,
     |$own:ident, $dirs:ident| $end:expr) => {{
        let req = $req;
        // What the lease cache holds of the names and inodes changed goes, before and after.
        let $own = $self.inner.leases.begin_own($inos, $removed, $added);
        let ($value, view, note, $dirs): ($out, _, _, _) = $self
            .inner
            .call_noted($what, |view| {
                let mut ns = $self.inner.ns();
                let req = $self.inner.change_request(req.clone(), view);
                async move { ns.$call(req).await }
            })
            .await?;
        $end;
        let inode = $inode;
        $self
            .inner
            .note_change(&view, note, NsChange::$variant(req), inode);
        $value
    }};
    ($self:ident, $call:ident, $req:expr, $out:ty, $what:literal) => {{
        let req = $req;
        $self
            .inner
            .call::<_, $out, _, _>($what, Pin::Any, |view| {
                let mut ns = $self.inner.ns();
                let req = with_session(req.clone(), view);
                async move { ns.$call(req).await }
            })
            .await
    }};
    ($self:ident, $call:ident, $req:expr, $what:literal) => {{
        let req = $req;
        $self
            .inner
            .call_unit($what, Pin::Any, |view| {
                let mut ns = $self.inner.ns();
                let req = with_session(req.clone(), view);
                async move { ns.$call(req).await }
            })
            .await
    }};
}

impl Client {
    pub async fn lookup(
        &self,
        cred: &Credentials,
        parent: InodeId,
        entry: impl AsRef<[u8]>,
    ) -> Result<Attr, FsError> {
        let req = pb::LookupRequest::from(EntryRequest {
            cred: cred.clone(),
            parent,
            name: name(entry)?,
        });
        rpc!(self, lookup, req, Attr, "Lookup reply")
    }

    pub async fn getattr(&self, cred: &Credentials, ino: InodeId) -> Result<Attr, FsError> {
        // This agent's writes completed behind them count (size, mtime).
        self.inner.settle(ino).await;
        let view = self.inner.lock_state().view.clone();
        let req = pb::GetAttrRequest::from(GetAttrRequest {
            cred: cred.clone(),
            inode: ino,
            session: self.inner.writeback.holder_session(ino, &view),
        });
        rpc!(self, get_attr, req, Attr, "GetAttr reply")
    }

    /// Makes every namespace change this agent was answered durable (the fsync of a
    /// directory, and `syncfs`): a `GetAttr` of `ino` without a session, which the server
    /// answers only once no change of any session is still not durable
    /// (docs/protocol.md, "Namespace changes before they are durable").
    pub async fn sync_namespace(&self, cred: &Credentials, ino: InodeId) -> Result<(), FsError> {
        let epoch = self.inner.lock_state().view.epoch;
        let Some(upto) = self.inner.lock_unsynced().newest_change(epoch) else {
            return Ok(());
        };
        let req = pb::GetAttrRequest::from(GetAttrRequest {
            cred: cred.clone(),
            inode: ino,
            session: None,
        });
        let _: Attr = self
            .inner
            .call("GetAttr reply", Pin::Any, |_| {
                let mut ns = self.inner.ns();
                let req = req.clone();
                async move { ns.get_attr(req).await }
            })
            .await?;
        self.inner.lock_unsynced().changes_synced(epoch, upto);
        Ok(())
    }

    /// Changes attributes; with `fh`, permission is checked against the handle's open mode
    /// (ftruncate). A size change is better done with [`Client::truncate`], which first
    /// gives back this agent's cached read grants past the new size.
    pub async fn setattr(
        &self,
        cred: &Credentials,
        ino: InodeId,
        changes: SetAttr,
        fh: Option<&FileHandle>,
    ) -> Result<Attr, FsError> {
        // Held back under the file's write delegation, when the server is sure to take it
        // (client::writeback): sent after the bytes held back before it.
        if fh.is_none()
            && let Some(attr) = self.hold_attr_change(cred, ino, &changes)
        {
            return Ok(attr);
        }
        // Of a directory this node made, answered here and sent behind the answer.
        if fh.is_none()
            && let Some(attr) = self.set_attr_here(cred, ino, &changes)
        {
            return Ok(attr);
        }
        // In the application's order: bytes it wrote before this change and this node holds
        // back reach the server first (a write-back after it would undo a `futimens` of the
        // mtime, as `cp -p` does, or clear the setuid bit a `chmod` after the write set).
        self.write_back_barrier(ino).await;
        self.set_attr_now(cred, ino, changes, fh).await
    }

    /// Sends an attribute change (what [`Client::setattr`] does once nothing is held back
    /// before it).
    pub(crate) async fn set_attr_now(
        &self,
        cred: &Credentials,
        ino: InodeId,
        changes: SetAttr,
        fh: Option<&FileHandle>,
    ) -> Result<Attr, FsError> {
        self.inner.settle(ino).await;
        let req = pb::SetAttrRequest::from(SetAttrRequest {
            cred: cred.clone(),
            inode: ino,
            changes,
            handle: fh.map(|f| HandleRef {
                session: f.session,
                handle: f.handle,
            }),
        });
        if let Some(fh) = fh {
            // On a handle (ftruncate): bound to its session, and a size change is durable
            // when answered anyway. What the lease cache holds of the inode goes, before and
            // after, as for any other change of this node's own.
            let own = self.inner.leases.begin_own(&[ino], &[], &[]);
            let r = self
                .inner
                .call("SetAttr reply", Pin::Handle(fh), |view| {
                    let mut ns = self.inner.ns();
                    let req = with_session(req.clone(), view);
                    async move { ns.set_attr(req).await }
                })
                .await;
            own.end(None, self.lease_deadline());
            return r;
        }
        // The reply's lease keeps the attributes as changed (a stat or path walk next asks
        // nothing), unless a recall came meanwhile.
        let leased = rpc!(change_as_is self, set_attr, req, SetAttr, "SetAttr reply",
            own(&[ino], &[], &[]), |l: Leased<Attr>| None,
            |own, dirs| own.end_attr(dirs.as_ref(), (&l.value, l.lease_ms), self.lease_deadline()));
        Ok(leased.value)
    }

    /// Creates (or, without `exclusive`, opens an existing) regular file and opens it under
    /// the current session (waiting briefly if a new session is being opened).
    pub async fn create(
        &self,
        cred: &Credentials,
        parent: InodeId,
        entry: impl AsRef<[u8]>,
        perm: u32,
        exclusive: bool,
        flags: OpenFlags,
    ) -> Result<Created, FsError> {
        let name = name(entry)?;
        // Answered here when it can be; when too many are on their way, once there is room.
        self.inner.creates.wait_room().await;
        if let Some(created) = self.create_here(cred, parent, &name, perm, flags) {
            return Ok(created);
        }
        let mut session = None;
        // The same id on every try: a retry after a lost reply gets the first try's answer.
        let pending = self.inner.requests.begin();
        let mut sent = None;
        // This node's change: what its cache holds of the name and the parent goes (the
        // server recalls only the other nodes' leases); the reply's leases are kept unless a
        // recall came meanwhile.
        let own = self
            .inner
            .leases
            .begin_own(&[], &[], &[(parent, name.as_bytes())]);
        // Handles closed before, released with this call (the same ones on every try).
        let mut releasing: Option<Vec<u64>> = None;
        let (r, view, note, dirs): (CreateReply, _, _, _) = self
            .inner
            .call_noted("Create reply", |view| {
                session = Some(view.session);
                let mut req = pb::CreateRequest::from(CreateRequest {
                    cred: cred.clone(),
                    session: view.session,
                    parent,
                    name: name.clone(),
                    perm,
                    exclusive,
                    flags,
                    delegate: self.delegate_on_create(&flags),
                    inode: None,
                    time: None,
                });
                req.request_id = pending.wire();
                sent = Some(req.clone());
                let mut ns = self.inner.ns();
                let mut req = self.inner.change_request(req, view);
                let handles =
                    releasing.get_or_insert_with(|| self.inner.releases_for_call(view.session));
                sanfs_proto::headers::set_release(req.metadata_mut(), view.session, handles);
                async move { ns.create(req).await }
            })
            .await?;
        if let Some(req) = sent {
            self.inner
                .note_change(&view, note, NsChange::Create(req), made(&r.attr));
        }
        let handle = FileHandle {
            session: session.ok_or_else(|| FsError::Io("Create sent nothing".to_owned()))?,
            handle: r.handle,
        };
        self.inner.note_open(&handle, r.attr.ino);
        if let Some(id) = r.delegation {
            self.adopt_created_delegation(r.attr.ino, id, view.generation);
        }
        let ttl = own.end_made(
            dirs.as_ref(),
            (&r.attr, r.lease_ms),
            r.created,
            self.lease_deadline(),
        );
        Ok(Created {
            handle,
            attr: r.attr,
            created: r.created,
            ttl,
        })
    }

    pub async fn mkdir(
        &self,
        cred: &Credentials,
        parent: InodeId,
        entry: impl AsRef<[u8]>,
        perm: u32,
    ) -> Result<Attr, FsError> {
        let entry = name(entry)?;
        // The new directory's create delegation: creates there answered here.
        let delegate = self.inner.config.async_creates && !self.inner.config.dirsync;
        let mut req = pb::MkdirRequest::from(MkdirRequest {
            cred: cred.clone(),
            parent,
            name: entry.clone(),
            perm,
            delegate,
        });
        let pending = self.inner.requests.begin();
        req.request_id = pending.wire();
        let own = self
            .inner
            .leases
            .begin_own(&[], &[], &[(parent, entry.as_bytes())]);
        let (reply, view, note, dirs): (pb::MkdirReply, _, _, _) = self
            .inner
            .call_noted("Mkdir reply", |view| {
                let mut ns = self.inner.ns();
                let req = self.inner.change_request(req.clone(), view);
                async move { ns.mkdir(req).await }
            })
            .await?;
        let creates_ms = reply.creates_ms;
        let attr = Attr::try_from(reply).map_err(|e| super::malformed("Mkdir reply", e))?;
        own.end_mkdir(dirs.as_ref(), &attr, self.lease_deadline());
        if creates_ms > 0 {
            self.inner.creates.add_dir(attr.ino, view.session);
            self.refill_numbers(view.session);
        }
        self.inner
            .note_change(&view, note, NsChange::Mkdir(req), made(&attr));
        Ok(attr)
    }

    /// A create answered here (docs/protocol.md "Creates answered by the agent"): in a
    /// directory whose create delegation this node holds, of a name known absent there, by
    /// a caller the directory's cached mode lets create (exactly: root, its owner, or no ACL
    /// there; no set-group-ID bit, no set-ID bits asked for, owners the server will not
    /// squash),
    /// with a number reserved to the session. The file's `Create` is sent behind the answer;
    /// every other call of this agent waits for its reply (`Inner::call_with`). `None`: ask
    /// the server as usual.
    fn create_here(
        &self,
        cred: &Credentials,
        parent: InodeId,
        name: &FileName,
        perm: u32,
        flags: OpenFlags,
    ) -> Option<Created> {
        let inner = &self.inner;
        let view = self.delegated_view(parent)?;
        let ttl = inner.leases.negative_ttl(parent, name.as_bytes())?;
        let (dir, dir_ttl) = inner.leases.attr(parent)?;
        let squashed = |id: u32| id == 0;
        let same_owner = dir.uid == cred.uid && dir.gid == cred.gid;
        // The mode bits decide exactly for root and the owner, or without an ACL.
        let exact = cred.uid == 0 || cred.uid == dir.uid || dir.no_xattrs;
        if dir.kind != FileType::Directory
            || !exact
            || dir.perm & sanfs_proto::types::S_ISGID != 0
            || perm & 0o6000 != 0
            || !(same_owner || !(squashed(cred.uid) || squashed(cred.gid)))
            || !dir.permits(cred, 3)
        {
            return None;
        }
        if inner.creates.should_refill(view.session) {
            self.refill_numbers_now(view.session);
        }
        let (ino, generation) = inner.creates.begin(parent, view.session)?;
        let now = super::writeback::wall_clock();
        let attr = Attr {
            ino,
            kind: FileType::Regular,
            perm,
            nlink: 1,
            uid: cred.uid,
            gid: cred.gid,
            size: 0,
            allocated: 0,
            atime: now,
            mtime: now,
            ctime: now,
            btime: now,
            rdev: 0,
            generation,
            no_xattrs: true,
        };
        let req = pb::CreateRequest::from(CreateRequest {
            cred: cred.clone(),
            session: view.session,
            parent,
            name: name.clone(),
            perm,
            exclusive: true,
            delegate: self.delegate_on_create(&flags),
            flags,
            inode: Some(ino),
            time: Some(now),
        });
        // Kept for a replay from now on: a restarted server makes it again with its number.
        inner.lock_unsynced().record_change(NsRecord {
            epoch: view.epoch,
            session: view.session,
            commit_seq: super::unsynced::UNANSWERED,
            change: NsChange::Create(req.clone()),
            inode: Some((ino, generation)),
        });
        let handle = FileHandle {
            session: view.session,
            handle: sanfs_proto::model::reserved_create_handle(ino),
        };
        inner.note_open(&handle, ino);
        // The name and attributes as the server will make them, under the directory's
        // delegation: no other node can see the file before the create is sent. The
        // directory's attributes too, one name more (the server's come with the last reply).
        let mut dir = dir;
        dir.size += 1;
        dir.mtime = now;
        dir.ctime = now;
        let ms = |d: std::time::Duration| u64::try_from(d.as_millis()).unwrap_or(0);
        let changed = sanfs_proto::model::ChangedDirs {
            attrs: vec![dir],
            lease_ms: ms(dir_ttl),
        };
        let own = inner
            .leases
            .begin_own(&[], &[], &[(parent, name.as_bytes())]);
        let ttl = own
            .end_made(
                Some(&changed),
                (&attr, ms(ttl)),
                true,
                self.lease_deadline(),
            )
            .or(Some(std::time::Duration::ZERO));
        // Its writes are held back from now on, under the write delegation the create asks
        // for (the reply names it).
        if req.delegate {
            inner.writeback.expect_created(ino, view.generation);
        }
        let queued = super::creates::Queued { req, view, ino };
        self.send_behind(Answered::Create(queued));
        Some(Created {
            handle,
            attr,
            created: true,
            ttl,
        })
    }

    /// The session under which a change in or of directory `dir` may be answered here:
    /// async creates on, no `dirsync`, and the session holds the directory's create
    /// delegation.
    fn delegated_view(&self, dir: InodeId) -> Option<SessionView> {
        let inner = &self.inner;
        if !inner.config.async_creates || inner.config.dirsync {
            return None;
        }
        let view = inner.view_for(None).ok()?;
        inner.creates.delegated(dir, view.session).then_some(view)
    }

    /// Queues a change answered here to be sent, and starts the sender if none runs.
    fn send_behind(&self, change: Answered) {
        if self.inner.creates.enqueue(change) {
            let inner = Arc::clone(&self.inner);
            tokio::spawn(async move { send_answered(&inner).await });
        }
    }

    /// An unlink or a rename within its directory answered here (docs/protocol.md "Unlinks
    /// and renames answered by the agent"): of a regular file this node made in a directory
    /// whose create delegation it still holds (so no other node has seen it), with one link,
    /// no writes of this node's on their way, by a caller the directory's cached mode lets
    /// change it exactly (as for a create, and the sticky bit's rule); a rename only to a
    /// name known absent there. The call is sent behind the answer, in order with the
    /// creates; every other call of this agent waits for its reply. False: ask the server.
    fn change_here(
        &self,
        cred: &Credentials,
        parent: InodeId,
        name: &FileName,
        change: HereChange,
    ) -> bool {
        let inner = &self.inner;
        let Some(view) = self.delegated_view(parent) else {
            return false;
        };
        let unlink = matches!(change, HereChange::Unlink(_));
        // (An attribute change is `Client::set_attr_here`'s.)
        if matches!(change, HereChange::SetAttr(_)) {
            return false;
        }
        if let HereChange::Rename(r) = &change
            && (r.new_parent != parent.0
                || r.new_name == name.as_bytes()
                || r.mode == pb::RenameMode::Exchange as i32
                || inner.leases.negative_ttl(parent, &r.new_name).is_none())
        {
            return false;
        }
        let Some(Some((file, file_ttl))) = inner.leases.entry(parent, name.as_bytes()) else {
            return false;
        };
        let Some((dir, dir_ttl)) = inner.leases.attr(parent) else {
            return false;
        };
        let exact = cred.uid == 0 || cred.uid == dir.uid || dir.no_xattrs;
        let sticky = dir.perm & sanfs_proto::types::S_ISVTX != 0
            && cred.uid != 0
            && cred.uid != dir.uid
            && cred.uid != file.uid;
        if file.kind != FileType::Regular
            || file.nlink != 1
            || dir.kind != FileType::Directory
            || !exact
            || sticky
            || !dir.permits(cred, 3)
            || self.own_writes_pending(file.ino)
            || !inner
                .creates
                .begin_change(parent, view.session, file.ino, unlink)
        {
            return false;
        }
        // Kept for a replay from now on, in order after the file's create.
        inner.lock_unsynced().record_change(NsRecord {
            epoch: view.epoch,
            session: view.session,
            commit_seq: super::unsynced::UNANSWERED,
            change: change.record(),
            // The file it changes: a replay after a restart finds the change done when the
            // name is gone or names another file (made after it).
            inode: Some((file.ino, file.generation)),
        });
        // The caches as the server will make them: the name goes (known absent now) and the
        // file's attributes with it, or the name moves and the file's ctime is now; the
        // directory keeps its attributes, changed now (one name less after an unlink).
        let now = super::writeback::wall_clock();
        let ms = |d: std::time::Duration| u64::try_from(d.as_millis()).unwrap_or(0);
        let mut dir = dir;
        if unlink {
            dir.size = dir.size.saturating_sub(1);
        }
        dir.mtime = now;
        dir.ctime = now;
        let changed = sanfs_proto::model::ChangedDirs {
            attrs: vec![dir],
            lease_ms: ms(dir_ttl),
        };
        match &change {
            HereChange::Unlink(_) => inner
                .leases
                .begin_own(&[file.ino], &[(parent, name.as_bytes())], &[])
                .end(Some(&changed), self.lease_deadline()),
            HereChange::Rename(r) => {
                inner
                    .leases
                    .begin_own(&[], &[(parent, name.as_bytes())], &[(parent, &r.new_name)])
                    .end_moved(Some(&changed), self.lease_deadline());
                // Its own attributes, as of now (the moved name touched them).
                let mark = inner.leases.mark();
                let mut file = file.clone();
                file.ctime = now;
                let sent = std::time::Instant::now();
                let deadline = self.lease_deadline();
                inner
                    .leases
                    .put_own_attr(&file, ms(file_ttl), sent, deadline, mark);
            }
            HereChange::SetAttr(_) => {}
        }
        self.send_behind(Answered::Change(QueuedChange {
            change,
            view,
            ino: file.ino,
        }));
        true
    }

    /// A change of the mode, owners or times of a directory this node made and holds the
    /// create delegation of (docs/protocol.md "Unlinks and renames answered by the agent"):
    /// no other node can see its attributes before the delegation is recalled, after the
    /// changes answered here are sent. Answered here when the cached attributes say exactly
    /// what the server will make of it (a file's held-back change's rules,
    /// `writeback::answered_change`: the caller owns it by uid, no extended attribute, the
    /// owners stay, no set-ID bit in the way, explicit times), and sent behind the answer
    /// with the time of the answer as its ctime, which the server then keeps. `None`: send
    /// it now.
    fn set_attr_here(&self, cred: &Credentials, ino: InodeId, c: &SetAttr) -> Option<Attr> {
        let inner = &self.inner;
        if *c == SetAttr::default() {
            return None;
        }
        let view = self.delegated_view(ino)?;
        let (cur, ttl) = inner.leases.attr(ino)?;
        if cur.kind != FileType::Directory || !cur.no_xattrs {
            return None;
        }
        let now = super::writeback::wall_clock();
        let next = super::writeback::answered_change(cred, &cur, c, now)?;
        if !inner.creates.begin_attr_change(ino, view.session) {
            return None;
        }
        let req = pb::SetAttrRequest::from(SetAttrRequest {
            cred: cred.clone(),
            inode: ino,
            changes: SetAttr {
                ctime: Some(next.ctime),
                ..c.clone()
            },
            handle: None,
        });
        // Kept for a replay from now on, in order after the directory's creates.
        inner.lock_unsynced().record_change(NsRecord {
            epoch: view.epoch,
            session: view.session,
            commit_seq: super::unsynced::UNANSWERED,
            change: NsChange::SetAttr(req.clone()),
            inode: None,
        });
        // The attributes as the server will make them, under the lease held.
        let ms = u64::try_from(ttl.as_millis()).unwrap_or(0);
        let mark = inner.leases.mark();
        inner.leases.put_own_attr(
            &next,
            ms,
            std::time::Instant::now(),
            self.lease_deadline(),
            mark,
        );
        self.send_behind(Answered::Change(QueuedChange {
            change: HereChange::SetAttr(req),
            view,
            ino,
        }));
        Some(next)
    }

    /// Asks for more inode numbers for creates answered here, in the background.
    fn refill_numbers(&self, session: sanfs_proto::types::SessionId) {
        if self.inner.creates.should_refill(session) {
            self.refill_numbers_now(session);
        }
    }

    fn refill_numbers_now(&self, session: sanfs_proto::types::SessionId) {
        let inner = Arc::clone(&self.inner);
        tokio::spawn(async move {
            let req = pb::ReserveInodesRequest::from(sanfs_proto::model::ReserveInodesRequest {
                session,
                count: super::creates::RESERVE,
            });
            let r: Result<sanfs_proto::model::ReserveInodesReply, FsError> = inner
                .call_barred(
                    "ReserveInodes reply",
                    Pin::Session(session),
                    false,
                    |view| {
                        let mut ns = inner.ns();
                        let req = with_session(req, view);
                        async move { ns.reserve_inodes(req).await }
                    },
                )
                .await;
            match r {
                Ok(numbers) => inner.creates.add_numbers(session, &numbers),
                Err(e) => {
                    tracing::debug!(error = %e, "reserving inode numbers failed");
                    inner.creates.refill_failed();
                }
            }
        });
    }

    pub async fn mknod(
        &self,
        cred: &Credentials,
        parent: InodeId,
        entry: impl AsRef<[u8]>,
        kind: FileType,
        perm: u32,
        rdev: u64,
    ) -> Result<Attr, FsError> {
        let entry = name(entry)?;
        let req = pb::MknodRequest::from(MknodRequest {
            cred: cred.clone(),
            parent,
            name: entry.clone(),
            kind,
            perm,
            rdev,
        });
        let attr = rpc!(change self, mknod, req, Mknod, "Mknod reply",
            own(&[], &[], &[(parent, entry.as_bytes())]), |a: Attr| made(&a));
        Ok(attr)
    }

    pub async fn unlink(
        &self,
        cred: &Credentials,
        parent: InodeId,
        entry: impl AsRef<[u8]>,
    ) -> Result<(), FsError> {
        let entry = name(entry)?;
        // This node's opens of the file answered here are made first: it lives on while open.
        self.open_deferred_named(parent, entry.as_bytes()).await;
        let req = pb::UnlinkRequest::from(EntryRequest {
            cred: cred.clone(),
            parent,
            name: entry.clone(),
        });
        // Answered here when it can be (a file this node made under the directory's
        // delegation); when too many changes are on their way, once there is room.
        self.inner.creates.wait_room().await;
        if self.change_here(cred, parent, &entry, HereChange::Unlink(req.clone())) {
            return Ok(());
        }
        rpc!(change self, unlink, req, Unlink, "Unlink reply",
            own(&[], &[(parent, entry.as_bytes())], &[]), |_r: pb::UnlinkReply| None);
        Ok(())
    }

    pub async fn rmdir(
        &self,
        cred: &Credentials,
        parent: InodeId,
        entry: impl AsRef<[u8]>,
    ) -> Result<(), FsError> {
        let entry = name(entry)?;
        let req = pb::RmdirRequest::from(EntryRequest {
            cred: cred.clone(),
            parent,
            name: entry.clone(),
        });
        rpc!(change self, rmdir, req, Rmdir, "Rmdir reply",
            own(&[], &[(parent, entry.as_bytes())], &[]), |_r: pb::RmdirReply| None);
        Ok(())
    }

    pub async fn rename(
        &self,
        cred: &Credentials,
        old_parent: InodeId,
        old_name: impl AsRef<[u8]>,
        new_parent: InodeId,
        new_name: impl AsRef<[u8]>,
        mode: RenameMode,
    ) -> Result<(), FsError> {
        let (old_name, new_name) = (name(old_name)?, name(new_name)?);
        // The file renamed over, if any, lives on while open here (as in `unlink`).
        if mode != RenameMode::Exchange {
            self.open_deferred_named(new_parent, new_name.as_bytes())
                .await;
        }
        let req = pb::RenameRequest::from(RenameRequest {
            cred: cred.clone(),
            old_parent,
            old_name: old_name.clone(),
            new_parent,
            new_name: new_name.clone(),
            mode,
        });
        let exchange = mode == RenameMode::Exchange;
        // Answered here when it can be (a file this node made, renamed within the directory
        // whose delegation it holds); when too many changes are on their way, once there is
        // room.
        self.inner.creates.wait_room().await;
        if self.change_here(cred, old_parent, &old_name, HereChange::Rename(req.clone())) {
            return Ok(());
        }
        // A file made here that moves to another directory may be seen there: its unlink is
        // no longer answered here (nor any of the old directory's, where it is not known).
        if old_parent != new_parent {
            let mut moved = vec![(old_parent, old_name.as_bytes())];
            if exchange {
                moved.push((new_parent, new_name.as_bytes()));
            }
            for (dir, name) in moved {
                match self.inner.leases.entry(dir, name) {
                    Some(Some((a, _))) => self.inner.creates.not_own(a.ino),
                    Some(None) => {}
                    None => self.inner.creates.none_own_in(dir),
                }
            }
        }
        rpc!(change self, rename, req, Rename, "Rename reply",
        own(&[], &[(old_parent, old_name.as_bytes())], &[(new_parent, new_name.as_bytes())]),
        |_r: pb::RenameReply| None,
        |own, dirs| if exchange {
            own.end(dirs.as_ref(), self.lease_deadline())
        } else {
            own.end_moved(dirs.as_ref(), self.lease_deadline())
        });
        Ok(())
    }

    /// A hard link; returns the inode's attributes (new link count).
    pub async fn link(
        &self,
        cred: &Credentials,
        ino: InodeId,
        new_parent: InodeId,
        new_name: impl AsRef<[u8]>,
    ) -> Result<Attr, FsError> {
        let new_name = name(new_name)?;
        let req = pb::LinkRequest::from(LinkRequest {
            cred: cred.clone(),
            inode: ino,
            new_parent,
            new_name: new_name.clone(),
        });
        // Two names: an unlink of one is no longer answered here.
        self.inner.creates.not_own(ino);
        let attr = rpc!(change self, link, req, Link, "Link reply",
            own(&[ino], &[], &[(new_parent, new_name.as_bytes())]), |_a: Attr| None);
        Ok(attr)
    }

    pub async fn symlink(
        &self,
        cred: &Credentials,
        parent: InodeId,
        entry: impl AsRef<[u8]>,
        target: impl AsRef<[u8]>,
    ) -> Result<Attr, FsError> {
        let entry = name(entry)?;
        let req = pb::SymlinkRequest::from(SymlinkRequest {
            cred: cred.clone(),
            parent,
            name: entry.clone(),
            target: SymlinkTarget::new(target.as_ref().to_vec())?,
        });
        let attr = rpc!(change self, symlink, req, Symlink, "Symlink reply",
            own(&[], &[], &[(parent, entry.as_bytes())]), |a: Attr| made(&a));
        Ok(attr)
    }

    pub async fn readlink(&self, cred: &Credentials, ino: InodeId) -> Result<Vec<u8>, FsError> {
        let req = pb::ReadlinkRequest::from(InodeRequest {
            cred: cred.clone(),
            inode: ino,
        });
        let t: SymlinkTarget = rpc!(self, readlink, req, SymlinkTarget, "Readlink reply")?;
        Ok(t.into_bytes())
    }

    /// One batch of directory entries after `cookie` (0: from the start).
    pub async fn readdir(
        &self,
        cred: &Credentials,
        ino: InodeId,
        cookie: u64,
        max_entries: u32,
        plus: bool,
    ) -> Result<ReadDirReply, FsError> {
        if let Some(r) = self.cached_listing(ino, cookie, max_entries, plus) {
            return Ok(r);
        }
        let req = pb::ReadDirRequest::from(ReadDirRequest {
            cred: cred.clone(),
            inode: ino,
            cookie,
            max_entries: max_entries.clamp(1, sanfs_proto::model::MAX_READDIR_ENTRIES),
            plus,
        });
        rpc!(self, read_dir, req, ReadDirReply, "ReadDir reply")
    }

    pub async fn statfs(&self, cred: &Credentials, ino: InodeId) -> Result<StatFs, FsError> {
        let req = pb::StatFsRequest::from(InodeRequest {
            cred: cred.clone(),
            inode: ino,
        });
        rpc!(self, stat_fs, req, StatFs, "StatFs reply")
    }

    pub async fn getxattr(
        &self,
        cred: &Credentials,
        ino: InodeId,
        xattr: impl AsRef<[u8]>,
    ) -> Result<Vec<u8>, FsError> {
        let name = xattr.as_ref();
        if name == CAPABILITY_XATTR {
            self.writes_reach_server(ino).await;
        }
        if let Some(r) = self.cached_xattr(cred, ino, name) {
            return r;
        }
        let req = pb::GetXattrRequest::from(XattrRequest {
            cred: cred.clone(),
            inode: ino,
            name: XattrName::new(name.to_vec())?,
        });
        let cache = &self.inner.leases;
        let mark = cache.mark();
        let key = super::leases::caller_key(cred);
        match rpc!(self, get_xattr, req, XattrValue, "GetXattr reply") {
            Ok(v) => {
                cache.put_xattr(ino, key, name, Some(&v.0), mark);
                Ok(v.0)
            }
            Err(FsError::NoAttr) => {
                cache.put_xattr(ino, key, name, None, mark);
                Err(FsError::NoAttr)
            }
            Err(e) => Err(e),
        }
    }

    pub async fn setxattr(
        &self,
        cred: &Credentials,
        ino: InodeId,
        xattr: impl AsRef<[u8]>,
        value: &[u8],
        mode: XattrMode,
    ) -> Result<(), FsError> {
        let req = pb::SetXattrRequest::from(SetXattrRequest {
            cred: cred.clone(),
            inode: ino,
            name: XattrName::new(xattr.as_ref().to_vec())?,
            value: value.to_vec(),
            mode,
        });
        // After this node's held-back attribute changes (an ACL and the mode go together).
        self.attrs_barrier(ino).await;
        self.inner.leases.forget_bare(ino);
        rpc!(change_as_is self, set_xattr, req, SetXattr, "SetXattr reply",
            own(&[ino], &[], &[]), |_r: pb::SetXattrReply| None);
        Ok(())
    }

    pub async fn listxattr(
        &self,
        cred: &Credentials,
        ino: InodeId,
    ) -> Result<Vec<Vec<u8>>, FsError> {
        self.writes_reach_server(ino).await;
        let req = pb::ListXattrRequest::from(InodeRequest {
            cred: cred.clone(),
            inode: ino,
        });
        let n: XattrNames = rpc!(self, list_xattr, req, XattrNames, "ListXattr reply")?;
        Ok(n.0.into_iter().map(XattrName::into_bytes).collect())
    }

    /// Before the file capabilities of `ino` are read: the server removes them at every
    /// write (as the kernel does; the mount asks for `FUSE_HANDLE_KILLPRIV_V2`), so this
    /// node's writes of it held back or still completing reach the server first, and what
    /// the cache held of its extended attributes before them goes.
    async fn writes_reach_server(&self, ino: InodeId) {
        let held = self.has_held_back(ino);
        self.write_back_barrier(ino).await;
        self.inner.settle(ino).await;
        if held {
            self.inner.leases.forget(&[ino], &[]);
        }
    }

    pub async fn removexattr(
        &self,
        cred: &Credentials,
        ino: InodeId,
        xattr: impl AsRef<[u8]>,
    ) -> Result<(), FsError> {
        let req = pb::RemoveXattrRequest::from(XattrRequest {
            cred: cred.clone(),
            inode: ino,
            name: XattrName::new(xattr.as_ref().to_vec())?,
        });
        self.attrs_barrier(ino).await;
        self.inner.leases.forget_bare(ino);
        rpc!(change_as_is self, remove_xattr, req, RemoveXattr, "RemoveXattr reply",
            own(&[ino], &[], &[]), |_r: pb::RemoveXattrReply| None);
        Ok(())
    }

    /// Opens an existing file under the current session (waiting briefly if a new session
    /// is being opened).
    pub async fn open(
        &self,
        cred: &Credentials,
        ino: InodeId,
        flags: OpenFlags,
    ) -> Result<(FileHandle, Attr), FsError> {
        let (handle, r) = self.inner.open_handle(cred, ino, flags, 0).await?;
        Ok((handle, r.attr))
    }

    /// [`Client::open`] for a buffered reader: a small file's bytes come with the reply (with
    /// an attribute lease) and answer its reads ([`Client::small_file_read`]) while that lease
    /// holds and nothing touched the file (docs/posix.md "Small files with their open").
    /// Asked for unless the bytes are kept already, the lease held now says the file is not
    /// small, or a write of this node's own waits to reach the LUNs (the server's bytes would
    /// lack it).
    pub async fn open_reading(
        &self,
        cred: &Credentials,
        ino: InodeId,
        flags: OpenFlags,
    ) -> Result<(FileHandle, Attr), FsError> {
        let leases = &self.inner.leases;
        // Marked before anything is looked at: a write of this node's own or a recall from
        // here on makes the reply's bytes unusable; one before it is seen below (a write
        // still on its way to the LUNs, a lease gone).
        let (mark, sent) = (leases.mark(), std::time::Instant::now());
        let hint = leases.small_file(ino);
        let ask = flags.read
            && !flags.truncate
            && hint != SmallHint::NotSmall
            && !leases.holds_content(ino)
            && !self.own_writes_pending(ino);
        if ask
            && matches!(hint, SmallHint::Small(_))
            && let Ok(view) = self.inner.view_for(None)
            && let Ok(range) = ByteRange::new(0, SMALL_FILE_MAX)
        {
            // This node's own cached write layouts there would hold the server's read up
            // until they were recalled: given back first, as before a proxied read.
            self.inner
                .give_back_own(&view, ino, range, Some(LockMode::Exclusive))
                .await;
        }
        let read_small = if ask { SMALL_FILE_MAX } else { 0 };
        let (handle, r) = self.inner.open_handle(cred, ino, flags, read_small).await?;
        if let Some(data) = r.data
            && !self.own_writes_pending(ino)
            && let Some(ttl) =
                leases.put_attr(&r.attr, r.lease_ms, sent, self.lease_deadline(), mark)
        {
            // Kept only under the lease that came with them (the server recalls it before
            // another node changes the file), until its end.
            leases.put_content(ino, data, mark, std::time::Instant::now() + ttl);
        }
        Ok((handle, r.attr))
    }

    /// Whether this node's own writes of `ino` are held back, in flight or completing: the
    /// LUNs and the server's map do not have them yet.
    pub(crate) fn own_writes_pending(&self, ino: InodeId) -> bool {
        self.has_held_back(ino) || self.has_writes_behind(ino) || self.inner.completing(ino)
    }

    /// A read answered from the bytes a small file's open gave ([`Client::open_reading`]),
    /// `None` when there are none that are still good. Never blocks: fit for a FUSE thread.
    pub fn small_file_read(&self, ino: InodeId, offset: u64, len: usize) -> Option<Vec<u8>> {
        // Not over this node's own writes that the server does not have yet.
        if self.own_writes_pending(ino) {
            return None;
        }
        self.inner.leases.content(ino, offset, len)
    }

    /// Closes an open handle. A handle of a replaced session is already gone: ESTALE.
    pub async fn release(&self, fh: &FileHandle) -> Result<(), FsError> {
        // The server drops the session's delegation on the file with its last handle there:
        // what this node held back is written while the handle is still good.
        let last = self.inner.last_handle_of(fh);
        if let Some(ino) = last {
            self.write_back_barrier(ino).await;
        }
        self.inner.before_release(fh).await;
        let released = self.inner.release_handle(fh).await;
        if let Some(ino) = last {
            self.forget_delegation(ino);
        }
        released
    }

    /// POSIX access check: `mask` of R 4, W 2, X 1, or 0 (exists).
    pub async fn access(&self, cred: &Credentials, ino: InodeId, mask: u32) -> Result<(), FsError> {
        if let Some(answer) = self.leased_access(cred, ino, mask) {
            return answer;
        }
        let req = pb::AccessRequest::from(AccessRequest {
            cred: cred.clone(),
            inode: ino,
            mask,
        });
        rpc!(self, access, req, "Access reply")
    }
}

/// Sends the creates this agent answered already (see [`Client::create_here`]), as they
/// queue, in `CreateBatch` calls of up to [`MAX_CREATE_BATCH`]; stops when none is left.
async fn send_answered(inner: &Arc<Inner>) {
    use super::creates::Batch;
    while let Some(batch) = inner.creates.next_batch(MAX_CREATE_BATCH) {
        match batch {
            Batch::Creates(creates) => send_create_batch(inner, creates).await,
            Batch::Changes(changes) => send_change_batch(inner, changes).await,
        }
    }
}

/// Sends one batch of unlinks and renames answered under one session (`ChangeBatch`), and
/// settles each one's record as a create's ([`send_create_batch`]); one the server refuses
/// is lost: logged, counted, and its names asked of the server again.
async fn send_change_batch(inner: &Arc<Inner>, batch: Vec<QueuedChange>) {
    let view = batch[0].view.clone();
    let pending: Vec<_> = batch.iter().map(|_| inner.requests.begin()).collect();
    let mut todo: Vec<(&QueuedChange, pb::BatchedChange)> = batch
        .iter()
        .zip(&pending)
        .map(|(q, p)| (q, q.change.wire(p.wire())))
        .collect();
    let settle = |q: &QueuedChange, seq: Option<u64>, lost: bool| {
        inner
            .lock_unsynced()
            .change_answered(view.epoch, &q.change.record(), seq);
        inner.creates.change_answered(q.change.kind(), lost);
    };
    let lost = |q: &QueuedChange, why: &str| {
        let names = q.change.names();
        tracing::error!(inode = %q.ino, parent = names[0].0, why, "an unlink, rename or attribute change this node had answered is lost");
        let names: Vec<(InodeId, &[u8])> =
            names.into_iter().map(|(d, n)| (InodeId(d), n)).collect();
        inner.leases.forget(&[q.ino], &names);
        settle(q, None, true);
    };
    while !todo.is_empty() {
        let req = pb::ChangeBatchRequest {
            changes: todo.iter().map(|(_, c)| c.clone()).collect(),
        };
        let r: Result<ChangeBatchReply, FsError> = inner
            .call_batch("ChangeBatch reply", &view, &req, |mut ns, req| async move {
                ns.change_batch(req).await
            })
            .await;
        let unsure = sort_results(
            r.map(|reply| reply.results),
            &mut todo,
            |(q, _), result| match result {
                ChangeResult::Done {
                    commit_seq,
                    durable_seq,
                } => {
                    inner.lock_unsynced().durable(view.epoch, durable_seq);
                    settle(q, (commit_seq > durable_seq).then_some(commit_seq), false);
                    false
                }
                ChangeResult::Refused { errno, error } => {
                    unknown_fate(errno) || {
                        lost(q, &error);
                        false
                    }
                }
            },
            |(q, _), why| lost(q, why),
        );
        todo = resend_after(
            inner,
            &view,
            unsure,
            |q| settle(q.0, None, false),
            |q, why| {
                lost(q.0, why);
            },
        )
        .await;
    }
}

/// A refusal of one change of a batch that says nothing of the change: EIO, ESTALE (the
/// server failed or the session went).
fn unknown_fate(errno: u32) -> bool {
    matches!(errno, 5 | 116)
}

/// The answer of a batch call of changes answered here, one result per change of `todo` in
/// its order, each given to `each` (which settles it and answers whether its fate is not
/// known); a reply of another length or a refusal of the whole call loses them all
/// (`lost`), a session that went leaves their fate not known. Answers those whose fate is
/// not known; `todo` is left empty.
fn sort_results<Q, R>(
    r: Result<Vec<R>, FsError>,
    todo: &mut Vec<Q>,
    mut each: impl FnMut(&Q, R) -> bool,
    lost: impl Fn(&Q, &str),
) -> Vec<Q> {
    match r {
        Ok(results) if results.len() == todo.len() => todo
            .drain(..)
            .zip(results)
            .filter_map(|(q, result)| each(&q, result).then_some(q))
            .collect(),
        Ok(results) => {
            let why = format!("{} answers to {} changes", results.len(), todo.len());
            todo.drain(..).for_each(|q| lost(&q, &why));
            Vec::new()
        }
        Err(FsError::StaleSession | FsError::Stale) => std::mem::take(todo),
        Err(e) => {
            let why = e.to_string();
            todo.drain(..).for_each(|q| lost(&q, &why));
            Vec::new()
        }
    }
}

/// After a batch call: the changes whose fate is not known (the session or the server went
/// meanwhile) are sent again under the same session (a stream that broke: answered), are
/// left to the replay of their records under a new epoch (`replayed`: a restarted server got
/// them before its new session went live), or are lost (`lost`: a session lost at a live
/// server). Answers those to send again.
async fn resend_after<Q>(
    inner: &Arc<Inner>,
    view: &SessionView,
    unsure: Vec<Q>,
    replayed: impl Fn(&Q),
    lost: impl Fn(&Q, &str),
) -> Vec<Q> {
    if unsure.is_empty() {
        return unsure;
    }
    match inner.live_view().await {
        Ok(v) if v.session == view.session => unsure,
        Ok(v) if v.epoch != view.epoch => {
            unsure.iter().for_each(replayed);
            Vec::new()
        }
        _ => {
            unsure
                .iter()
                .for_each(|q| lost(q, "its session ended before the server answered"));
            Vec::new()
        }
    }
}

/// Sends one batch of creates answered under one session, and settles each one's record:
/// with the commit that holds it, or gone once durable. A restarted server gets them from
/// the replay of those records instead; a create the server refuses (another node took the
/// name after this node's delegation was passed by) is lost: logged, counted, and the
/// cached file forgotten.
async fn send_create_batch(inner: &Arc<Inner>, batch: Vec<super::creates::Queued>) {
    let view = batch[0].view.clone();
    let pending: Vec<_> = batch.iter().map(|_| inner.requests.begin()).collect();
    let mut todo: Vec<(&super::creates::Queued, pb::CreateRequest)> = batch
        .iter()
        .zip(&pending)
        .map(|(q, p)| {
            let mut r = q.req.clone();
            r.request_id = p.wire();
            (q, r)
        })
        .collect();
    // Files whose bytes were held back under a write delegation the create asked for and
    // did not get: written back once the batch is answered.
    let undelegated = std::sync::atomic::AtomicBool::new(false);
    let client = Client::borrowed(Arc::clone(inner));
    let lost = |q: &super::creates::Queued, why: &str| {
        if q.req.delegate && inner.writeback.created_answered(q.ino, None) {
            undelegated.store(true, std::sync::atomic::Ordering::Relaxed);
        }
        inner
            .lock_unsynced()
            .create_answered(view.epoch, q.ino, None);
        tracing::error!(inode = %q.ino, parent = q.req.parent, why, "a create this node had answered is lost");
        inner
            .leases
            .forget(&[q.ino], &[(InodeId(q.req.parent), q.req.name.as_slice())]);
        inner.creates.answered(q.ino, true);
    };
    while !todo.is_empty() {
        let mark = inner.leases.mark();
        let sent = std::time::Instant::now();
        let req = pb::CreateBatchRequest {
            creates: todo.iter().map(|(_, r)| r.clone()).collect(),
        };
        let r: Result<CreateBatchReply, FsError> = inner
            .call_batch("CreateBatch reply", &view, &req, |mut ns, req| async move {
                ns.create_batch(req).await
            })
            .await;
        let unsure = sort_results(
            r.map(|reply| reply.results),
            &mut todo,
            |(q, _), result| match result {
                CreateResult::Made {
                    reply,
                    commit_seq,
                    durable_seq,
                } => {
                    {
                        let mut unsynced = inner.lock_unsynced();
                        unsynced.durable(view.epoch, durable_seq);
                        let seq = (commit_seq > durable_seq).then_some(commit_seq);
                        unsynced.create_answered(view.epoch, q.ino, seq);
                    }
                    // The server's attributes, under the lease its reply gave (the times
                    // this node showed, its own clock's when it answered).
                    let deadline = inner.lease_deadline();
                    inner
                        .leases
                        .put_own_attr(&reply.attr, reply.lease_ms, sent, deadline, mark);
                    if q.req.delegate && inner.writeback.created_answered(q.ino, reply.delegation) {
                        undelegated.store(true, std::sync::atomic::Ordering::Relaxed);
                    }
                    inner.creates.answered(q.ino, false);
                    false
                }
                CreateResult::Refused { errno, error } => {
                    unknown_fate(errno) || {
                        lost(q, &error);
                        false
                    }
                }
            },
            |(q, _), why| lost(q, why),
        );
        // A session lost at a live server took their numbers with it.
        todo = resend_after(
            inner,
            &view,
            unsure,
            |q| inner.creates.answered(q.0.ino, false),
            |q, why| lost(q.0, why),
        )
        .await;
    }
    if undelegated.into_inner() {
        tokio::spawn(async move { client.write_back_undelegated().await });
    }
}

/// The extended attribute that holds a file's capabilities.
const CAPABILITY_XATTR: &[u8] = b"security.capability";

impl Inner {
    /// A batch call of changes answered here (`CreateBatch`, `ChangeBatch`): under the
    /// session `view` they were answered under, and not held by the barrier (it waits for
    /// them).
    async fn call_batch<P, R, T, Fut>(
        &self,
        what: &'static str,
        view: &SessionView,
        req: &P,
        send: impl Fn(
            sanfs_proto::pb::namespace_client::NamespaceClient<tonic::transport::Channel>,
            tonic::Request<P>,
        ) -> Fut,
    ) -> Result<T, FsError>
    where
        P: Clone,
        Fut: std::future::Future<Output = Result<tonic::Response<R>, tonic::Status>>,
        T: TryFrom<R>,
        T::Error: std::fmt::Display,
    {
        // Handles closed here go with it (released before its changes: an unlink then finds
        // the file closed, not an orphan to destroy at a later release).
        let releasing = self.releases_for_batch(view.session);
        self.call_barred(what, Pin::Session(view.session), false, |v| {
            let mut r = self.change_request(req.clone(), v);
            sanfs_proto::headers::set_release(r.metadata_mut(), view.session, &releasing);
            send(self.ns(), r)
        })
        .await
    }

    /// A namespace change's request under `view`: with the session header (answered before
    /// it is durable), unless the mount asked for `dirsync` (then durable when answered).
    fn change_request<T>(&self, req: T, view: &SessionView) -> tonic::Request<T> {
        if self.config.dirsync {
            tonic::Request::new(req)
        } else {
            with_session(req, view)
        }
    }

    /// A namespace change was answered under `view`: kept as a record while `note` says it
    /// is not durable yet (the server answered before its commit was durable), to replay to
    /// a restarted server.
    pub(crate) fn note_change(
        &self,
        view: &SessionView,
        note: Option<CommitNote>,
        change: NsChange,
        inode: Option<(InodeId, u64)>,
    ) {
        let Some(note) = note else { return };
        let mut unsynced = self.lock_unsynced();
        unsynced.durable(view.epoch, note.durable_seq);
        if note.seq > note.durable_seq {
            unsynced.record_change(NsRecord {
                epoch: view.epoch,
                session: view.session,
                commit_seq: note.seq,
                change,
                inode,
            });
        }
    }

    /// Opens `ino` under the current session (waiting for one while it is being opened);
    /// the handle is noted open (see `Inner::open_handles`).
    pub(crate) async fn open_handle(
        &self,
        cred: &Credentials,
        ino: InodeId,
        flags: OpenFlags,
        read_small: u64,
    ) -> Result<(FileHandle, OpenReply), FsError> {
        let mut session = None;
        let r: OpenReply = self
            .call("Open reply", Pin::Any, |view| {
                session = Some(view.session);
                let req = pb::OpenRequest::from(OpenRequest {
                    cred: cred.clone(),
                    session: view.session,
                    inode: ino,
                    flags,
                    read_small,
                });
                let mut ns = self.ns();
                async move { ns.open(req).await }
            })
            .await?;
        let handle = FileHandle {
            session: session.ok_or_else(|| FsError::Io("Open sent nothing".to_owned()))?,
            handle: r.handle,
        };
        self.note_open(&handle, ino);
        Ok((handle, r))
    }

    /// `Release` of `fh`; ESTALE when its session was replaced (the handle is gone).
    pub(crate) async fn release_handle(&self, fh: &FileHandle) -> Result<(), FsError> {
        let req = pb::ReleaseRequest::from(HandleRef {
            session: fh.session,
            handle: fh.handle,
        });
        self.call_unit("Release reply", Pin::Handle(fh), |_| {
            let mut ns = self.ns();
            async move { ns.release(req).await }
        })
        .await
    }
}
