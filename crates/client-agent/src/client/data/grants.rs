//! Grants on the direct path: asking for them (MapRead / MapWrite), checking them against
//! the volume, completing them (Complete, with the records of lazily committed completions),
//! and giving this agent's own cached grants and layouts back.

use super::*;
use sanfs_proto::types::OpenHandle;

/// What a `MapRead`/`MapWrite` asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum GrantKind {
    /// A grant for one I/O.
    Plain,
    /// A write layout (kept and written inside until returned or recalled).
    Layout,
    /// A write layout asked ahead of a sequential writer (speculative: the server refuses it
    /// where space is short).
    Ahead,
}

impl Inner {
    /// Gives back this agent's cached grants on `ino` that overlap `range` (of `mode` only,
    /// if given), waiting for their I/O in flight, before it does what they would block.
    pub(crate) async fn give_back_own(
        &self,
        view: &SessionView,
        ino: InodeId,
        range: ByteRange,
        mode: Option<LockMode>,
    ) {
        let own = self.cache.take_overlapping(ino, range, mode);
        if own.is_empty() {
            return;
        }
        self.cache.wait_idle(&own).await;
        self.return_grants(view, own).await;
    }

    /// Notes that `fh` is an open handle of `ino` (see `Inner::open_handles`).
    pub(crate) fn note_open(&self, fh: &FileHandle, ino: InodeId) {
        self.open_handles
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert((fh.session, fh.handle), ino);
    }

    /// Whether `fh` is open (noted and not released).
    pub(super) fn handle_open(&self, fh: &FileHandle) -> bool {
        self.open_handles
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains_key(&(fh.session, fh.handle))
    }

    /// Enters `grant`, asked under `fh`, into the cache if `fh` is still open, under the
    /// lock [`Inner::before_release`] forgets `fh` with (see `Inner::layout_ahead`). `None`:
    /// `fh` is gone (not entered); else what [`GrantCache::enter`] answered.
    pub(super) fn enter_while_open(
        &self,
        fh: &FileHandle,
        grant: Arc<Grant>,
        generation: u64,
    ) -> Option<bool> {
        let open = self.open_handles.lock().unwrap_or_else(|e| e.into_inner());
        open.contains_key(&(fh.session, fh.handle))
            .then(|| self.cache.enter(grant, generation))
    }

    /// The inode `fh` is open on, when `fh` is this session's last handle there.
    pub(crate) fn last_handle_of(&self, fh: &FileHandle) -> Option<InodeId> {
        let open = self.open_handles.lock().unwrap_or_else(|e| e.into_inner());
        let ino = *open.get(&(fh.session, fh.handle))?;
        (!others_open(&open, fh, ino)).then_some(ino)
    }

    /// Right before `fh` is released: forgets it and, when it is this session's last handle
    /// on its inode, gives back that inode's cached grants, read grants and write layouts
    /// (waiting for their I/O and write completions in flight). The server drops a session's grants on an inode without a recall when the
    /// session's last handle there goes, so a layout kept past that point would never be
    /// recalled before another node's write, truncate or punch, and would serve stale data.
    pub(crate) async fn before_release(&self, fh: &FileHandle) {
        let last = {
            let mut open = self.open_handles.lock().unwrap_or_else(|e| e.into_inner());
            open.remove(&(fh.session, fh.handle))
                .filter(|ino| !others_open(&open, fh, *ino))
        };
        let Some(ino) = last else {
            return;
        };
        // Its writes' completions first (a failed one stays for this close to report).
        self.settle(ino).await;
        let Ok(whole) = ByteRange::new(0, MAX_FILE_SIZE) else {
            return;
        };
        let own = self.cache.take_overlapping(ino, whole, None);
        if own.is_empty() {
            return;
        }
        self.cache.wait_idle(&own).await;
        if let Ok(view) = self.view_for(Some(fh)) {
            self.return_grants(&view, own).await;
        }
    }

    /// `Data.ReturnGrant` (waits for the server). Failures are only logged: a grant the
    /// server still holds ends with the session at the latest.
    pub(crate) async fn return_grants(&self, view: &SessionView, ids: Vec<GrantId>) {
        for chunk in ids.chunks(MAX_GRANTS_PER_MESSAGE) {
            let req = ReturnGrantRequest {
                session: view.session,
                epoch: view.epoch,
                grant_ids: chunk.to_vec(),
            };
            let req = pb::ReturnGrantRequest::from(req);
            let r = self
                .call_unit("ReturnGrant reply", Pin::Session(view.session), |_| {
                    let mut data = self.data();
                    let req = req.clone();
                    async move { data.return_grant(req).await }
                })
                .await;
            if let Err(e) = r {
                tracing::debug!(error = %e, "returning cached read grants failed");
            }
        }
    }

    pub(super) fn return_in_background(self: &Arc<Self>, view: &SessionView, ids: Vec<GrantId>) {
        if ids.is_empty() {
            return;
        }
        let inner = Arc::clone(self);
        let view = view.clone();
        tokio::spawn(async move { inner.return_grants(&view, ids).await });
    }

    /// Checks a grant against the request and the volume. Returns whether every device of its
    /// plan is usable from this node.
    pub(super) fn check_grant(
        &self,
        view: &SessionView,
        grant: &Grant,
        ino: InodeId,
        asked: ByteRange,
        mode: LockMode,
    ) -> Result<bool, FsError> {
        let bad = |what: String| Err(FsError::Io(format!("bad grant from the server: {what}")));
        if grant.inode != ino || grant.mode != mode || grant.epoch != view.epoch {
            return bad(format!(
                "{} {:?} {} for {ino} {mode:?} {}",
                grant.inode, grant.mode, grant.epoch, view.epoch
            ));
        }
        if grant.range.offset() != asked.offset() || grant.range.len() > asked.len() {
            return bad(format!(
                "range {}+{} for {}+{}",
                grant.range.offset(),
                grant.range.len(),
                asked.offset(),
                asked.len()
            ));
        }
        let volume = self.volume();
        let devices = volume.devices();
        let mut usable = true;
        for io in &grant.device_ios {
            let Some(dev) = devices.get(io.device.as_usize()) else {
                // A LUN this agent does not know yet: the volume grew. This grant goes
                // through the server; the rescan task reads the volume again now.
                tracing::debug!(device = %io.device, "grant names a LUN not in this agent's volume: rescanning");
                self.rescan_kick.notify_one();
                usable = false;
                continue;
            };
            if io
                .phys_off
                .checked_add(io.len)
                .is_none_or(|e| e > dev.size_bytes)
            {
                return bad(format!("I/O past the end of {}", io.device));
            }
            usable &= self.device_usable(io.device);
        }
        Ok(usable)
    }

    #[allow(
        clippy::too_many_arguments,
        reason = "the request's fields; one private call per path"
    )]
    pub(super) async fn map(
        &self,
        view: &SessionView,
        cred: &Credentials,
        fh: &FileHandle,
        ino: InodeId,
        range: ByteRange,
        mode: LockMode,
        kind: GrantKind,
    ) -> Result<Grant, FsError> {
        let req = pb::MapRequest::from(MapRequest {
            cred: cred.clone(),
            handle: handle_ref(fh),
            epoch: view.epoch,
            inode: ino,
            range,
            sync: false,
            layout: kind != GrantKind::Plain,
            ahead: kind == GrantKind::Ahead,
        });
        let _span = crate::stages::Span::wall(match mode {
            LockMode::Shared => crate::stages::Stage::MapRead,
            LockMode::Exclusive => crate::stages::Stage::MapWrite,
        });
        self.call("grant", Pin::Handle(fh), |_| {
            let mut data = self.data();
            let req = req.clone();
            let counter = match mode {
                LockMode::Shared => &self.counters.map_reads,
                LockMode::Exclusive => &self.counters.map_writes,
            };
            bump(counter);
            async move {
                match mode {
                    LockMode::Shared => data.map_read(req).await,
                    LockMode::Exclusive => data.map_write(req).await,
                }
            }
        })
        .await
    }

    pub(super) async fn complete(
        &self,
        view: &SessionView,
        grant: &Grant,
        outcome: IoOutcome,
        bytes_done: u64,
    ) -> Result<Attr, FsError> {
        self.complete_at(view, grant, outcome, bytes_done, None)
            .await
    }

    /// [`Inner::complete`], or with `keep_at` a write layout's partial completion of
    /// `[at, at + bytes_done)` (the layout stays).
    pub(super) async fn complete_at(
        &self,
        view: &SessionView,
        grant: &Grant,
        outcome: IoOutcome,
        bytes_done: u64,
        keep_at: Option<u64>,
    ) -> Result<Attr, FsError> {
        self.complete_req(view, grant, outcome, bytes_done, keep_at, Vec::new())
            .await
    }

    /// A write layout's partial completion of every range of `parts` (at least one) in one
    /// call: the server completes them in one transaction (`CompleteRequest.more`; only
    /// sent to a server that says it can).
    pub(super) async fn complete_parts(
        &self,
        view: &SessionView,
        layout: &Grant,
        parts: &[ByteRange],
    ) -> Result<Attr, FsError> {
        let (first, more) = parts
            .split_first()
            .ok_or_else(|| FsError::Io("a completion of no parts".to_owned()))?;
        self.complete_req(
            view,
            layout,
            IoOutcome::Ok,
            first.len(),
            Some(first.offset()),
            more.to_vec(),
        )
        .await
    }

    async fn complete_req(
        &self,
        view: &SessionView,
        grant: &Grant,
        outcome: IoOutcome,
        bytes_done: u64,
        keep_at: Option<u64>,
        more: Vec<ByteRange>,
    ) -> Result<Attr, FsError> {
        while self
            .completions_paused
            .load(std::sync::atomic::Ordering::SeqCst)
        {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        let parts: Vec<(u64, u64)> =
            std::iter::once((keep_at.unwrap_or(grant.range.offset()), bytes_done))
                .chain(more.iter().map(|p| (p.offset(), p.len())))
                .collect();
        let req = CompleteRequest {
            session: view.session,
            epoch: view.epoch,
            grant_id: grant.grant_id,
            outcome,
            bytes_done,
            sync: false,
            keep_at,
            more,
        };
        let req = pb::CompleteRequest::from(req);
        bump(&self.counters.completions);
        let span = crate::stages::Span::wall(crate::stages::Stage::Complete);
        let reply: CompleteReply = self
            .call("Complete reply", Pin::Session(view.session), |_| {
                let mut data = self.data();
                let req = req.clone();
                async move { data.complete(req).await }
            })
            .await?;
        drop(span);
        // A write's completion moved the size and mtime (also for a write held back earlier
        // and written back now): what the lease cache holds of them goes (the server recalls
        // only the other nodes' leases).
        if grant.mode == LockMode::Exclusive {
            self.leases.forget(&[grant.inode], &[]);
        }
        self.note_completion(view, grant, &parts, &reply);
        Ok(reply.attr)
    }

    /// Keeps a record of each part `(offset, length)` of a lazily committed write
    /// completion until it is durable (see `unsynced`), and forgets the records the reply
    /// says are durable now.
    pub(super) fn note_completion(
        &self,
        view: &SessionView,
        grant: &Grant,
        parts: &[(u64, u64)],
        reply: &CompleteReply,
    ) {
        let records: Vec<_> = parts
            .iter()
            .filter(|&&(_, len)| reply.commit_seq > 0 && len > 0)
            .filter_map(|&(at, len)| self.write_record(view, grant, at, len, reply.commit_seq))
            .collect();
        let mut unsynced = self.lock_unsynced();
        for record in records {
            unsynced.record(grant.inode, record);
        }
        unsynced.durable(view.epoch, reply.durable_seq);
    }

    /// The record of a write of `len` bytes at `at` inside the exclusive grant `grant`: the
    /// file range and the LUN bytes its plan wrote (`None` for a shared grant or a range the
    /// server could not have completed).
    pub(super) fn write_record(
        &self,
        view: &SessionView,
        grant: &Grant,
        at: u64,
        len: u64,
        commit_seq: u64,
    ) -> Option<unsynced::WriteRecord> {
        if grant.mode != LockMode::Exclusive {
            return None;
        }
        let start = at.saturating_sub(grant.range.offset());
        match ByteRange::new(at, len) {
            Ok(range) => {
                let plan = sub_plan(&grant.device_ios, &[], start, start + len);
                Some(unsynced::WriteRecord::new(
                    view.epoch,
                    commit_seq,
                    range,
                    &plan.device_ios,
                ))
            }
            Err(e) => {
                tracing::error!(inode = %grant.inode, error = %e, "cannot record a write completion");
                None
            }
        }
    }
}

/// Whether `fh`'s session has another handle than `fh` open on `ino` (in the table of
/// [`Inner::open_handles`]).
pub(crate) fn others_open(
    open: &std::collections::HashMap<(sanfs_proto::types::SessionId, OpenHandle), InodeId>,
    fh: &FileHandle,
    ino: InodeId,
) -> bool {
    open.iter()
        .any(|(k, i)| *i == ino && k.0 == fh.session && *k != (fh.session, fh.handle))
}
