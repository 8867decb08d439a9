//! Writes inside cached write layouts: the write's device I/O, its completion behind the
//! caller (write-behind), the end of a layout's use, and what a failed or lost completion
//! becomes.

use super::*;

impl Inner {
    /// Ends one write inside `layout` whose device I/O gave `r`: completed behind the caller
    /// on success; the layout given back on failure, and the part written through the server
    /// when a LUN of it is not usable here (`NotSupported`). Notes where the write ended (the
    /// next one is sequential from there).
    #[allow(
        clippy::too_many_arguments,
        reason = "the write's context; two call sites in direct_write"
    )]
    pub(super) async fn end_layout_write(
        self: &Arc<Self>,
        view: &SessionView,
        cred: &Credentials,
        fh: &FileHandle,
        layout: Arc<Grant>,
        part: ByteRange,
        r: Result<(), FsError>,
        data: &AlignedBuf,
        at: usize,
    ) -> Result<Option<Attr>, FsError> {
        let ino = layout.inode;
        let attr = match r {
            Ok(()) => {
                self.layout_ahead(view, cred, fh, &layout, part.end());
                self.complete_behind(view, layout, ino, part);
                None
            }
            Err(e) => {
                self.end_layout_use(view, &layout, false).await;
                if e != FsError::NotSupported {
                    return Err(e);
                }
                let piece = piece_of(data, at, part.len())?;
                self.proxied_write(view, cred, fh, ino, part.offset(), piece, None)
                    .await?
            }
        };
        self.note_write_end(ino, part.end());
        Ok(attr)
    }

    /// Writes `part` (inside `layout`) from `data[at..]` to the devices; on success the
    /// caller completes it ([`Inner::complete_behind`]), a device error is completed here. `NotSupported`: a LUN of the part is not
    /// usable from this node (nothing was written).
    pub(super) async fn write_in_layout(
        &self,
        view: &SessionView,
        layout: &Grant,
        part: ByteRange,
        data: &mut AlignedBuf,
        at: usize,
    ) -> Result<(), FsError> {
        let start = part.offset() - layout.range.offset();
        let plan = sub_plan(&layout.device_ios, &[], start, start + part.len());
        if !plan
            .device_ios
            .iter()
            .all(|io| self.device_usable(io.device))
        {
            return Err(FsError::NotSupported);
        }
        let errs = self.plan_in_place(view, &plan, true, data, at).await?;
        if errs.is_empty() {
            return Ok(());
        }
        let (bytes_done, outcome, e) = self.write_failed(layout.inode, layout, &plan, &errs);
        let _ = self
            .complete_at(view, layout, outcome, bytes_done, Some(part.offset()))
            .await;
        Err(e)
    }

    /// Completes a write inside a layout behind the caller (write-behind completion): the
    /// caller's write returns once its device I/O is done, and `Complete{keep}` goes on in
    /// the background. The layout stays in use until that completion is answered, so a
    /// recall (another node's read or write there) is acknowledged only after it: other
    /// nodes see every written byte. This agent's own reads, stats, truncates and fsyncs of
    /// the file wait for its completions first ([`Inner::settle`]); a failed completion is
    /// the error of the file's next write, fsync or close, as a failed writeback is.
    ///
    /// Batched (see `batch`): the layout's one sender completes every queued part in one
    /// round trip (contiguous parts as one range), after waiting up to `batch::LINGER` for
    /// more and for the one in flight to be answered.
    pub(super) fn complete_behind(
        self: &Arc<Self>,
        view: &SessionView,
        layout: Arc<Grant>,
        ino: InodeId,
        part: ByteRange,
    ) {
        self.begin_pending(ino);
        let key = (view.generation, layout.grant_id);
        let (started, full) = {
            let mut batches = self.lock_batches();
            (batches.push(key, part), batches.full(key))
        };
        if !started {
            if full {
                self.cache.hurry();
            }
            return; // the layout's sender takes it with its next batch
        }
        let inner = Arc::clone(self);
        let view = view.clone();
        tokio::spawn(async move {
            loop {
                // A moment for more parts to join, unless the batch is full or someone
                // waits (a recall, an fsync, this file's read, stat or close).
                let hurried = inner.cache.hurried();
                tokio::pin!(hurried);
                hurried.as_mut().enable();
                if !inner.lock_batches().full(key) {
                    tokio::select! {
                        () = tokio::time::sleep(batch::LINGER) => {}
                        () = hurried => {}
                    }
                }
                let next = inner.lock_batches().next(key);
                let Some(batch) = next else {
                    break;
                };
                inner.complete_batch(&view, &layout, ino, batch).await;
            }
        });
    }

    /// Completes one batch of a layout's parts, and answers every part: its use of the
    /// layout ends (the layout is given back after a failure), and its completion is no
    /// longer pending (with its call's error, if any). Runs of contiguous parts go as one
    /// range each, all in one `Complete{keep}` where the server completes several parts in
    /// one call (`ServerInfo.multi_part_complete`), else one call per run. Never waits for
    /// the layout to be idle: later parts still queued hold it in use until this sender
    /// completes them.
    async fn complete_batch(
        self: &Arc<Self>,
        view: &SessionView,
        layout: &Arc<Grant>,
        ino: InodeId,
        batch: batch::Batch,
    ) {
        let runs = batch.runs();
        let calls: Vec<&[batch::Run]> = if view.server.multi_part_complete {
            runs.chunks(MAX_COMPLETE_PARTS).collect()
        } else {
            runs.chunks(1).collect()
        };
        let mut given_back = false;
        for call in calls {
            let ranges: Vec<ByteRange> = call.iter().map(|r| r.range).collect();
            let r = self.complete_parts(view, layout, &ranges).await;
            let ok = r.is_ok();
            let parts = || call.iter().flat_map(|run| &run.parts);
            if ok {
                add(
                    &self.counters.direct_write_bytes,
                    parts().map(ByteRange::len).sum(),
                );
            }
            let error = match r {
                Ok(_) => None,
                // The session was lost with the completion in flight: its data is on the
                // LUNs, and whether the server applied it is unknown. Kept as records (one
                // per run: every part of it): a restarted server gets them replayed, a
                // living one (fenced or evicted session) makes them a lost write (EIO at the
                // file's next write, fsync or close). Recorded before the layout's uses end:
                // a fence waits for them, and the new session's replay must find them.
                Err(e) if crate::client::is_stale(&e) => {
                    for range in &ranges {
                        if let Some(record) =
                            self.write_record(view, layout, range.offset(), range.len(), UNANSWERED)
                        {
                            self.lock_unsynced().record(ino, record);
                        }
                    }
                    None
                }
                Err(e) => Some(refused_write(e)),
            };
            let mut evicted = Vec::new();
            let mut return_it = false;
            for _ in parts() {
                let (after, ev) = self.cache.release(layout.grant_id, ok);
                evicted.extend(ev);
                return_it |= after == AfterIo::Return;
            }
            self.return_in_background(view, evicted);
            if return_it {
                self.return_in_background(view, vec![layout.grant_id]);
            } else if !ok && !given_back {
                // Not handed out again from now on; returned once its last user is done.
                given_back = true;
                let own = self
                    .cache
                    .take_overlapping(ino, layout.range, Some(LockMode::Exclusive));
                if !own.is_empty() {
                    let inner = Arc::clone(self);
                    let view = view.clone();
                    tokio::spawn(async move {
                        inner.cache.wait_idle(&own).await;
                        inner.return_grants(&view, own).await;
                    });
                }
            }
            for _ in parts() {
                self.end_pending(ino, error.clone());
            }
        }
    }

    fn lock_batches(&self) -> std::sync::MutexGuard<'_, batch::Batcher> {
        self.completion_batches
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// The end of one write's use of a cached write layout: kept after a success, given back
    /// (once idle) after a failure, so that the next write starts afresh.
    pub(super) async fn end_layout_use(&self, view: &SessionView, layout: &Grant, ok: bool) {
        let (after, evicted) = self.cache.release(layout.grant_id, ok);
        if !evicted.is_empty() {
            self.return_grants(view, evicted).await;
        }
        if after == AfterIo::Return {
            self.return_grants(view, vec![layout.grant_id]).await;
        } else if !ok {
            self.give_back_own(view, layout.inode, layout.range, Some(LockMode::Exclusive))
                .await;
        }
    }

    /// What a failed direct write reports: the prefix of the plan before the first buffer
    /// byte of any failed device I/O (written completely), the outcome for Complete, and the
    /// caller's error (EIO).
    pub(super) fn write_failed(
        &self,
        ino: InodeId,
        grant: &Grant,
        plan: &IoPlan,
        errs: &[IoErr],
    ) -> (u64, IoOutcome, FsError) {
        let bytes_done = errs
            .iter()
            .flat_map(|e| {
                plan.device_ios
                    .iter()
                    .filter(move |io| io.device == e.device && io.phys_off == e.phys_off)
                    .flat_map(|io| io.iov.iter().map(|p| p.buf_off))
            })
            .min()
            .unwrap_or(0);
        let first = errs.first().map(ToString::to_string).unwrap_or_default();
        let extents = errs
            .iter()
            .map(|e| ExtentError {
                device: e.device,
                phys_off: e.phys_off,
                len: e.len,
                errno: e.errno().clamp(1, 4095),
            })
            .collect();
        tracing::error!(inode = %ino, grant = %grant.grant_id, bytes_done, error = %first, "direct write failed");
        // The engine poisoned the device: let the health task schedule its probe.
        self.health_kick.notify_one();
        (
            bytes_done,
            IoOutcome::DeviceErrors(extents),
            FsError::Io(format!("device write failed: {first}")),
        )
    }

    /// Before a write-back of several whole-block extents of `ino` inside `span`: one write
    /// layout over the span, cached, so that each extent goes direct inside it and their
    /// completions go in batches (else each small extent is a proxied write of its own).
    /// Best effort: without it (layouts off, no room, a LUN not usable here, a recall) the
    /// writes go their usual way.
    pub(crate) async fn layout_for_write_back(
        self: &Arc<Self>,
        cred: &Credentials,
        fh: &FileHandle,
        ino: InodeId,
        span: ByteRange,
    ) {
        if !self.write_layouts_on() || span.is_empty() {
            return;
        }
        let Ok(view) = self.live_view_for(Some(fh), "Map").await else {
            return;
        };
        if self.cache.covers_write(ino, span, view.generation) {
            return;
        }
        // This agent's own older layouts there would block the new one.
        self.give_back_own(&view, ino, span, Some(LockMode::Exclusive))
            .await;
        let grant = match self
            .map(
                &view,
                cred,
                fh,
                ino,
                span,
                LockMode::Exclusive,
                GrantKind::Layout,
            )
            .await
        {
            Ok(g) => g,
            Err(e) => {
                tracing::debug!(%ino, error = %e, "no write layout for a write-back: extent by extent");
                return;
            }
        };
        let usable = self.check_grant(&view, &grant, ino, span, LockMode::Exclusive);
        if !grant.cacheable || !matches!(usable, Ok(true)) {
            let _ = self.complete(&view, &grant, IoOutcome::Ok, 0).await;
            return;
        }
        let id = grant.grant_id;
        if !self.cache.enter(Arc::new(grant), view.generation) {
            return; // recalled already: the recall's acknowledgement covers it
        }
        // Entered with one user (this call): none uses it yet; it stays cached for the
        // extents' writes.
        self.keep_cached(&view, id);
    }

    /// A sequential writer's write ended at `end`, past the middle of its write layout
    /// `layout`: the next layout (from the end of this one, [`Inner::next_write_layout`]) is
    /// asked for in the background, so that its writes there find it held, and may be
    /// answered before their device I/O, instead of each new layout's first write waiting for
    /// a `MapWrite` and its own device I/O. One at a time per file; not where this agent
    /// holds a write grant already (its read grants there are given back first). A write
    /// that gets there first waits for it ([`Inner::wait_layout_ahead`]) rather than asking
    /// for the same range.
    ///
    /// The layout is asked under `fh` and the server drops it, without a recall, when the
    /// session's last handle on the file goes: so it is entered into the cache only while
    /// `fh` is open, under the lock [`Inner::before_release`] takes to forget `fh` before it
    /// gives the file's cached grants back. Either that release finds the layout cached and
    /// gives it back, or the layout finds `fh` gone and is completed unused.
    pub(super) fn layout_ahead(
        self: &Arc<Self>,
        view: &SessionView,
        cred: &Credentials,
        fh: &FileHandle,
        layout: &Grant,
        end: u64,
    ) {
        let (start, len) = (layout.range.offset(), layout.range.len());
        // Past the middle: a file that ends in its first layout asks for no second one.
        if !self.write_layouts_on()
            || len < self.config.write_layout_bytes
            || end <= start + len / 2
            || end > layout.range.end()
        {
            return;
        }
        let block = u64::from(view.server.block_size).max(1);
        let Some(next) = self.next_write_layout(layout.range, block) else {
            return;
        };
        let ino = layout.inode;
        // Not over a write grant of this agent (another writer's here, or this one's
        // already); its read grants there are given back first (`ask_layout_ahead`).
        if self.cache.overlaps(ino, next, Some(LockMode::Exclusive)) {
            return;
        }
        let Some(asking) = self.asking_layout(ino, next) else {
            return;
        };
        bump(&self.counters.layouts_ahead);
        let inner = Arc::clone(self);
        let (view, cred, fh) = (view.clone(), cred.clone(), *fh);
        tokio::spawn(async move {
            inner.ask_layout_ahead(&view, &cred, &fh, ino, next).await;
            drop(asking);
        });
    }

    /// Waits for the layout asked ahead on `ino` when it covers `want` (see
    /// [`Inner::layout_ahead`]); answers whether it waited (the cache may hold it now).
    pub(super) async fn wait_layout_ahead(&self, ino: InodeId, want: ByteRange) -> bool {
        let mut rx = {
            let ahead = self.layouts_ahead.lock().unwrap_or_else(|e| e.into_inner());
            match ahead.get(&ino) {
                Some((range, rx))
                    if range.offset() <= want.offset() && want.end() <= range.end() =>
                {
                    rx.clone()
                }
                _ => return false,
            }
        };
        // The sender goes when the ask ends, answered or not.
        let _ = rx.wait_for(|done| *done).await;
        true
    }

    async fn ask_layout_ahead(
        self: &Arc<Self>,
        view: &SessionView,
        cred: &Credentials,
        fh: &FileHandle,
        ino: InodeId,
        next: ByteRange,
    ) {
        if !self.handle_open(fh) {
            return;
        }
        // This agent's read grants there (a file read before it is written) would block
        // it: the server would recall them from this very node first.
        self.give_back_own(view, ino, next, Some(LockMode::Shared))
            .await;
        let grant = match self
            .map(
                view,
                cred,
                fh,
                ino,
                next,
                LockMode::Exclusive,
                GrantKind::Ahead,
            )
            .await
        {
            Ok(g) => g,
            Err(e) => {
                // No room, a quota, a contended file, a closed handle: the writer asks
                // itself when it gets there.
                tracing::debug!(%ino, error = %e, "no write layout ahead");
                return;
            }
        };
        let usable = self.check_grant(view, &grant, ino, next, LockMode::Exclusive);
        let id = grant.grant_id;
        let grant = Arc::new(grant);
        let entered = if grant.cacheable && matches!(usable, Ok(true)) {
            self.enter_while_open(fh, Arc::clone(&grant), view.generation)
        } else {
            None
        };
        match entered {
            // Entered with one user (this call): none uses it yet; it stays cached.
            Some(true) => self.keep_cached(view, id),
            // Recalled already: the recall's acknowledgement covers it.
            Some(false) => {}
            // Not cacheable, not usable here, or its handle closed meanwhile: unused.
            None => {
                let _ = self.complete(view, &grant, IoOutcome::Ok, 0).await;
            }
        }
    }

    /// Ends the use of grant `id` by the call that entered it, keeping it cached; gives back
    /// what the cache evicted for it (and the grant itself if the cache did not keep it).
    fn keep_cached(self: &Arc<Self>, view: &SessionView, id: GrantId) {
        let (after, evicted) = self.cache.release(id, true);
        self.return_in_background(view, evicted);
        if after == AfterIo::Return {
            self.return_in_background(view, vec![id]);
        }
    }

    /// Whether writes ask for write layouts (not with method A, whose point is one grant per
    /// stripe unit).
    pub(crate) fn write_layouts_on(&self) -> bool {
        self.config.write_layout_bytes > 0 && !self.config.grant_per_stripe_unit
    }

    /// The write layout asked for a sequential writer's next write `want`: from its offset,
    /// `write_layout_bytes` (whole blocks) or `want` if longer.
    pub(super) fn write_layout_range(
        &self,
        view: &SessionView,
        want: ByteRange,
    ) -> Result<ByteRange, FsError> {
        let block = u64::from(view.server.block_size).max(1);
        let room = MAX_FILE_SIZE.saturating_sub(want.offset());
        let len = round_down(self.config.write_layout_bytes.min(room), block).max(want.len());
        Ok(ByteRange::new(want.offset(), len)?)
    }

    /// The layout asked ahead of a sequential writer whose layout is `layout`: from its end,
    /// twice as long, up to [`WRITE_LAYOUT_MAX`] (never shorter than `write_layout_bytes`),
    /// so that a long stream costs a `MapWrite` (and its commit and zeroing at the server)
    /// per 64 MiB, not per 8 MiB, while a file that ends early took no more than twice what
    /// it wrote. The server cuts what it would allocate to an eighth of its free space.
    fn next_write_layout(&self, layout: ByteRange, block: u64) -> Option<ByteRange> {
        let len = layout
            .len()
            .saturating_mul(2)
            .min(WRITE_LAYOUT_MAX)
            .max(self.config.write_layout_bytes)
            .min(MAX_FILE_SIZE.saturating_sub(layout.end()));
        ByteRange::new(layout.end(), round_down(len, block)).ok()
    }

    /// Whether a write at `pos` continues this agent's last direct write to `ino` (or starts
    /// the file): a sequential writer, worth a layout ahead. A gap of at most one block
    /// still continues it: the partial blocks a long write's edges leave held back
    /// (`Client::write_buffered_buf`) come between its direct writes.
    pub(super) fn is_sequential(&self, ino: InodeId, pos: u64, block: u64) -> bool {
        pos == 0
            || self
                .lock_write_ends()
                .get(&ino)
                .is_some_and(|e| *e <= pos && pos - *e <= block)
    }

    /// Notes where a write of `ino` ended (the next one from there is sequential). An end
    /// a little below the one noted (at most [`PIECES_BEHIND`]) is a piece of the same
    /// request that finished late (the kernel sends the pieces of one large `O_DIRECT` write
    /// at once): the request's end stays noted.
    pub(super) fn note_write_end(&self, ino: InodeId, end: u64) {
        let mut ends = self.lock_write_ends();
        if ends.len() >= MAX_TRACKED_WRITERS && !ends.contains_key(&ino) {
            ends.clear();
        }
        let noted = ends.entry(ino).or_insert(end);
        if end >= *noted || *noted - end > PIECES_BEHIND {
            *noted = end;
        }
    }

    /// Registers `ask`, a write layout being asked for (ahead of a sequential writer, or by
    /// the writer itself), as the file's layout ask in flight when no other is: a write
    /// there (the writer's next one, or another piece of the same request, which the kernel
    /// sends at once) waits for it ([`Inner::wait_layout_ahead`]) instead of asking a grant
    /// of its own. Ends when the returned guard is dropped.
    pub(super) fn asking_layout(
        self: &Arc<Self>,
        ino: InodeId,
        ask: ByteRange,
    ) -> Option<AskInFlight> {
        let (tx, rx) = tokio::sync::watch::channel(false);
        let mut ahead = self.layouts_ahead.lock().unwrap_or_else(|e| e.into_inner());
        if ahead.contains_key(&ino) {
            return None;
        }
        ahead.insert(ino, (ask, rx));
        Some(AskInFlight {
            inner: Arc::clone(self),
            ino,
            done: tx,
        })
    }

    pub(super) fn lock_write_ends(
        &self,
    ) -> std::sync::MutexGuard<'_, std::collections::HashMap<InodeId, u64>> {
        self.write_ends.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A write's completion lost with its session `view` (the write has not returned yet):
    /// after a server restart (a new epoch) the write is redone whole under the new session
    /// (`StaleSession`: the open file re-opens and retries; the same bytes land on the same
    /// or new blocks, and the old grant's Unwritten blocks never become visible); with the
    /// server alive (the session fenced or evicted) the completion was refused: EIO.
    pub(super) async fn completion_lost(&self, view: &SessionView, e: FsError) -> FsError {
        // Not the current view: the completion may have met the restarted server before the
        // session task did, and the current view is then still the old epoch's.
        match self.next_session_after(view, "Write").await {
            Ok(now) if now.epoch != view.epoch => FsError::StaleSession,
            _ => refused_write(e),
        }
    }
}

/// The error of a write whose device I/O is done but whose completion the server refused
/// because the grant's session was fenced or evicted (ESTALE): the data is not in the file,
/// and writing it again under a new session could overwrite what other nodes wrote since.
/// The application sees EIO, as for a failed writeback, never ESTALE (on which an
/// [`crate::client::OpenFile`] would retry the write).
pub(super) fn refused_write(e: FsError) -> FsError {
    if crate::client::is_stale(&e) {
        FsError::Io(format!(
            "the write's completion was refused ({e}): its session was fenced or evicted, \
             the data is not in the file"
        ))
    } else {
        e
    }
}

/// How far below the noted end a write may end and still be a late piece of the request that
/// reached it ([`Inner::note_write_end`]): the pieces of one request in flight at once.
const PIECES_BEHIND: u64 = 16 << 20;

/// A write layout ask registered as the file's ask in flight ([`Inner::asking_layout`]);
/// dropping it ends the registration and wakes the waiters.
pub(super) struct AskInFlight {
    inner: Arc<Inner>,
    ino: InodeId,
    done: tokio::sync::watch::Sender<bool>,
}

impl Drop for AskInFlight {
    fn drop(&mut self) {
        self.inner
            .layouts_ahead
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&self.ino);
        let _ = self.done.send(true);
    }
}
