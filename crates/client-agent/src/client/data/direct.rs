//! The direct path's device I/O: a grant's plan run in place on this node's LUNs, direct
//! reads (with cached read grants) and direct writes (one grant at a time, or inside a cached
//! write layout).

use super::*;

impl Inner {
    /// Runs `plan` in place on `dest`'s bytes from `base` on: the device I/O reads into (or
    /// writes from) `dest` itself, no copy. The lease is checked right before submission.
    /// Returns the failed device I/Os (none: success). `dest` keeps its length; only if the
    /// engine has stopped is it lost (left empty) with the error.
    pub(super) async fn plan_in_place(
        &self,
        view: &SessionView,
        plan: &IoPlan,
        write: bool,
        dest: &mut AlignedBuf,
        base: usize,
    ) -> Result<Vec<IoErr>, FsError> {
        let too_small = || FsError::Io("direct I/O buffer too small for its plan".to_owned());
        if base.saturating_add(usize_of(plan.len)) > dest.len() {
            return Err(too_small());
        }
        let shift = base as u64;
        if !write {
            for z in &plan.zero_fill {
                let from = base + usize_of(z.buf_off);
                dest.as_mut_slice()
                    .get_mut(from..from.saturating_add(usize_of(z.len)))
                    .ok_or_else(too_small)?
                    .fill(0);
            }
        }
        let ops = plan
            .device_ios
            .iter()
            .map(|io| {
                let mut op = if write {
                    DeviceOp::write(io)
                } else {
                    DeviceOp::read(io)
                };
                for piece in &mut op.iov {
                    piece.buf_off += shift;
                }
                op
            })
            .collect();
        let guard = self.begin_device_io(view.generation)?;
        let buf = std::mem::replace(dest, AlignedBuf::zeroed(0));
        let done = self.engine.submit(buf, ops).await;
        drop(guard);
        let done = done.map_err(|e| FsError::Io(format!("direct I/O: {e}")))?;
        *dest = done.buf;
        Ok(done.results.into_iter().filter_map(Result::err).collect())
    }

    /// Reads the block-aligned `[offset, offset + len)` directly into `dest` from byte
    /// `base` on, where `len` is what `dest` holds past `base`; returns the bytes read
    /// (fewer only at end of file).
    #[allow(clippy::too_many_arguments, reason = "one call site per public read")]
    pub(super) async fn direct_read(
        self: &Arc<Self>,
        view: &SessionView,
        cred: &Credentials,
        fh: &FileHandle,
        ino: InodeId,
        offset: u64,
        dest: &mut AlignedBuf,
        base: usize,
    ) -> Result<usize, FsError> {
        let total = dest.len().saturating_sub(base);
        let end = offset + total as u64;
        let mut pos = offset;
        while pos < end {
            let want = self.grant_range(pos, end)?;
            let at = usize_of(pos - offset);
            // A cached layout first: all of the read, or its first part (the rest asked for
            // in the next round).
            if let Some((grant, want)) = self.cache.take_read_start(
                ino,
                want,
                view.generation,
                u64::from(view.server.block_size),
            ) {
                let start = pos - grant.range.offset();
                let plan = sub_plan(
                    &grant.device_ios,
                    &grant.zero_fill,
                    start,
                    start + want.len(),
                );
                let usable = plan
                    .device_ios
                    .iter()
                    .all(|io| self.device_usable(io.device));
                let result = if usable {
                    bump(&self.counters.cached_reads);
                    match self
                        .plan_in_place(view, &plan, false, dest, base + at)
                        .await
                    {
                        Ok(errs) if errs.is_empty() => Ok(()),
                        Ok(errs) => Err(read_failed(&errs)),
                        Err(e) => Err(e),
                    }
                } else {
                    Err(FsError::Io("device unusable".to_owned()))
                };
                let (after, evicted) = self.cache.release(grant.grant_id, true);
                debug_assert_ne!(after, AfterIo::Return);
                self.return_in_background(view, evicted);
                match result {
                    Ok(()) => {
                        add(&self.counters.direct_read_bytes, want.len());
                        pos = want.end();
                        continue;
                    }
                    Err(FsError::StaleSession) => return Err(FsError::StaleSession),
                    // A device went bad since the layout was cached: the server's way.
                    Err(_) => {
                        let rest = dest_slice(dest, base + at, total - at)?;
                        let n = self.proxied_read(view, cred, fh, ino, pos, rest).await?;
                        return Ok(at + n);
                    }
                }
            }
            if !self.lease_valid(view.generation) {
                return Err(FsError::StaleSession);
            }
            // Ask for a layout ahead of this read (read_layout_bytes), so that the reads
            // that follow find it cached instead of asking again.
            let ask = self.layout_range(want)?;
            let grant = Arc::new(
                self.map(view, cred, fh, ino, ask, LockMode::Shared, GrantKind::Plain)
                    .await?,
            );
            if grant.range.is_empty() {
                return Ok(at);
            }
            if !self.lease_valid(view.generation) {
                // Fenced while the grant was on its way: it died with the session.
                return Err(FsError::StaleSession);
            }
            let usable = self.check_grant(view, &grant, ino, ask, LockMode::Shared);
            let cached = grant.cacheable;
            if cached && !self.cache.enter(Arc::clone(&grant), view.generation) {
                // Its recall overtook it: it is no longer ours to use; ask again.
                continue;
            }
            let glen = grant.range.len();
            // The part of the grant this read needs.
            let need_end = grant.range.end().min(want.end());
            let need = need_end - pos;
            let visible = grant.file_size.min(need_end).saturating_sub(pos);
            let result = match usable {
                Err(e) => Err(e),
                Ok(false) => Err(FsError::NotSupported),
                Ok(true) => {
                    let plan = if need == glen {
                        IoPlan {
                            len: glen,
                            device_ios: grant.device_ios.clone(),
                            zero_fill: grant.zero_fill.clone(),
                        }
                    } else {
                        sub_plan(&grant.device_ios, &grant.zero_fill, 0, need)
                    };
                    match self
                        .plan_in_place(view, &plan, false, dest, base + at)
                        .await
                    {
                        Ok(errs) if errs.is_empty() => {
                            add(
                                &self.counters.direct_read_bytes,
                                visible.min((total - at) as u64),
                            );
                            Ok(())
                        }
                        Ok(errs) => Err(read_failed(&errs)),
                        Err(e) => Err(e),
                    }
                }
            };
            // End the grant: keep it cached, or complete it.
            if cached {
                let (after, evicted) = self.cache.release(grant.grant_id, result.is_ok());
                self.return_in_background(view, evicted);
                if after == AfterIo::Return {
                    self.return_in_background(view, vec![grant.grant_id]);
                }
            } else if !matches!(result, Err(FsError::StaleSession)) {
                let done = if result.is_ok() { glen } else { 0 };
                self.complete(view, &grant, IoOutcome::Ok, done).await?;
            }
            match result {
                Ok(()) => {}
                Err(FsError::StaleSession) => return Err(FsError::StaleSession),
                Err(e) => {
                    // A LUN this node lacks (NotSupported), or a failed device read: this
                    // grant's range goes through the server, which has its own LUN handles.
                    if e != FsError::NotSupported {
                        tracing::warn!(inode = %ino, error = %e, "direct read failed: reading through the server");
                    }
                    let n = usize_of(visible).min(total - at);
                    let piece = dest_slice(dest, base + at, n)?;
                    let got = self.proxied_read(view, cred, fh, ino, pos, piece).await?;
                    if got < n {
                        return Ok(at + got);
                    }
                }
            }
            if grant.file_size < need_end || visible < need {
                return Ok(at + usize_of(visible).min(total - at));
            }
            pos = need_end;
        }
        Ok(total)
    }

    /// Writes the block-aligned `[offset, offset + data.len())` directly, the devices
    /// writing from `data` itself: inside a cached write layout (one round trip per write, a
    /// partial completion), else under a new grant: a write layout when this is a
    /// sequential writer's next write (layouts on), else a grant of the write's own range.
    pub(super) async fn direct_write(
        self: &Arc<Self>,
        view: &SessionView,
        cred: &Credentials,
        fh: &FileHandle,
        ino: InodeId,
        offset: u64,
        data: &mut AlignedBuf,
    ) -> Result<Option<Attr>, FsError> {
        let end = offset + data.len() as u64;
        let mut pos = offset;
        let mut attr = None;
        let layouts = self.write_layouts_on();
        while pos < end {
            // No grant is even asked for (nor a cached one used) under a lapsed lease.
            if !self.lease_valid(view.generation) {
                return Err(FsError::StaleSession);
            }
            let want = self.grant_range(pos, end)?;
            let at = usize_of(pos - offset);
            if layouts
                && let Some(layout) =
                    self.cache
                        .take(ino, want, view.generation, LockMode::Exclusive)
            {
                bump(&self.counters.layout_writes);
                let r = self.write_in_layout(view, &layout, want, data, at).await;
                attr = self
                    .end_layout_write(view, cred, fh, layout, want, r, data, at)
                    .await?
                    .or(attr);
                pos = want.end();
                continue;
            }
            // The layout asked ahead of this writer is on its way: wait for it, then look
            // again (once: the ask is over then).
            if layouts && self.wait_layout_ahead(ino, want).await {
                continue;
            }
            let sequential =
                layouts && self.is_sequential(ino, pos, u64::from(view.server.block_size));
            let ask = if sequential {
                self.write_layout_range(view, want)?
            } else {
                want
            };
            // The other pieces of this request wait for this ask rather than ask their own.
            let asking = sequential.then(|| self.asking_layout(ino, ask)).flatten();
            if sequential {
                // This agent's own older layout there, or its read layout of a file read
                // before it is written, would block the new one (the server would recall it
                // from this very node first).
                self.give_back_own(view, ino, ask, None).await;
            }
            let (grant, ask) = match self
                .map(
                    view,
                    cred,
                    fh,
                    ino,
                    ask,
                    LockMode::Exclusive,
                    if sequential {
                        GrantKind::Layout
                    } else {
                        GrantKind::Plain
                    },
                )
                .await
            {
                // No room (or quota) for a layout ahead: the write's own range is what counts.
                Err(FsError::NoSpace | FsError::QuotaExceeded) if ask.len() > want.len() => (
                    self.map(
                        view,
                        cred,
                        fh,
                        ino,
                        want,
                        LockMode::Exclusive,
                        GrantKind::Plain,
                    )
                    .await?,
                    want,
                ),
                r => (r?, ask),
            };
            let usable = self.check_grant(view, &grant, ino, ask, LockMode::Exclusive);
            // The part of the grant this write covers.
            let part = ByteRange::new(pos, grant.range.end().min(end) - pos)?;
            if grant.cacheable {
                let layout = Arc::new(grant);
                let entered = self.cache.enter(Arc::clone(&layout), view.generation);
                // In the cache (or refused): the pieces that waited look there now.
                drop(asking);
                if !entered {
                    continue; // its recall overtook it: no longer ours; ask again
                }
                let r = match usable {
                    Err(e) => Err(e),
                    Ok(false) => Err(FsError::NotSupported),
                    Ok(true) => self.write_in_layout(view, &layout, part, data, at).await,
                };
                attr = self
                    .end_layout_write(view, cred, fh, layout, part, r, data, at)
                    .await?
                    .or(attr);
                pos = part.end();
                continue;
            }
            let usable = match usable {
                Ok(u) => u,
                Err(e) => {
                    let _ = self.complete(view, &grant, IoOutcome::Ok, 0).await;
                    return Err(e);
                }
            };
            if !usable {
                self.complete(view, &grant, IoOutcome::Ok, 0).await?;
                attr = self
                    .proxied_write(
                        view,
                        cred,
                        fh,
                        ino,
                        pos,
                        piece_of(data, at, part.len())?,
                        None,
                    )
                    .await?
                    .or(attr);
                pos = part.end();
                continue;
            }
            let plan = if part.len() == grant.range.len() {
                IoPlan {
                    len: part.len(),
                    device_ios: grant.device_ios.clone(),
                    zero_fill: Vec::new(),
                }
            } else {
                sub_plan(&grant.device_ios, &[], 0, part.len())
            };
            let errs = match self.plan_in_place(view, &plan, true, data, at).await {
                Ok(errs) => errs,
                Err(e) => {
                    // Fenced between the grant and the I/O (nothing was written), or the
                    // engine stopped (its outcome unknown: nothing counts as written).
                    let _ = self.complete(view, &grant, IoOutcome::Ok, 0).await;
                    return Err(e);
                }
            };
            if errs.is_empty() {
                // A grant longer than the write (a layout the server would not keep) is
                // completed for the written prefix; the server frees the rest past EOF.
                attr = Some(
                    match self.complete(view, &grant, IoOutcome::Ok, part.len()).await {
                        Ok(a) => a,
                        Err(e) if crate::client::is_stale(&e) => {
                            return Err(self.completion_lost(view, e).await);
                        }
                        Err(e) => return Err(e),
                    },
                );
                add(&self.counters.direct_write_bytes, part.len());
            } else {
                let (bytes_done, outcome, e) = self.write_failed(ino, &grant, &plan, &errs);
                let _ = self.complete(view, &grant, outcome, bytes_done).await;
                return Err(e);
            }
            self.note_write_end(ino, part.end());
            pos = part.end();
        }
        Ok(attr)
    }
}

/// `data[at..at + len]`, or an error if the grant reached past the write.
pub(super) fn piece_of(data: &AlignedBuf, at: usize, len: u64) -> Result<&[u8], FsError> {
    data.as_slice()
        .get(at..at + usize_of(len))
        .ok_or_else(|| FsError::Io("grant past the write".to_owned()))
}

/// The error of a direct read whose device I/O failed.
pub(super) fn read_failed(errs: &[IoErr]) -> FsError {
    let first = errs.first().map(ToString::to_string).unwrap_or_default();
    FsError::Io(format!("direct read: {first}"))
}

/// `len` bytes of `dest` from `from`, or an error if it holds fewer (an engine that stopped
/// leaves it empty).
pub(super) fn dest_slice(
    dest: &mut AlignedBuf,
    from: usize,
    len: usize,
) -> Result<&mut [u8], FsError> {
    dest.as_mut_slice()
        .get_mut(from..from.saturating_add(len))
        .ok_or_else(|| FsError::Io("the I/O engine has stopped".to_owned()))
}
