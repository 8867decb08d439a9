//! The data path: the routing rule, the direct path (grants and device I/O) and the proxied
//! path (Read / Write through the server), plus fsync, truncate and fallocate.
//!
//! **Routing.** An I/O shorter than the server's `direct_io_threshold` goes proxied. A longer
//! one is split at the volume's block size: the unaligned head and tail go proxied, the aligned
//! middle direct, if the middle is itself at least the threshold (else everything goes
//! proxied). Proxied calls are chunked to `max_inline_bytes`.
//!
//! **Direct path.** `MapRead` / `MapWrite` return a grant that may cover only a prefix of the
//! range asked for: the call loops for the rest. Each grant's plan is checked against the
//! volume (device index, bounds) before anything is issued; if it touches a LUN this node does
//! not have (or one poisoned by a failed write) that grant's range goes proxied instead. The
//! lease is checked right before the device I/O is submitted ([`Inner::begin_device_io`]). A
//! write whose device I/O failed is completed with `DEVICE_ERROR`, the failed device I/Os, and
//! `bytes_done` = the prefix of the grant whose every byte was written, so the server converts
//! only that prefix and leaves the rest Unwritten (reading as zeros); the caller gets EIO.
//!
//! **Cached read grants.** A cacheable read grant is kept after its I/O instead of being
//! completed, and later reads inside it (and inside the file size it was granted with) are
//! served from it without a round trip while the lease is valid and it was not recalled. A
//! writer first gives back its own cached grants overlapping the range it writes (truncates,
//! fallocates), so that its write grant never waits for a recall of its own layouts.

use std::sync::Arc;

use sanfs_blockmap::plan::IoPlan;
use sanfs_proto::model::{
    CompleteReply, CompleteRequest, ExtentError, FallocateMode, FallocateRequest, FsyncRequest,
    Grant, HandleRef, IoOutcome, LockMode, MAX_GRANTS_PER_MESSAGE, MapRequest, ReadReply,
    ReadRequest, ReturnGrantRequest, WritePosition, WriteReply, WriteRequest,
};
use sanfs_proto::pb;
use sanfs_proto::types::{
    Attr, ByteRange, Credentials, FsError, GrantId, InodeId, MAX_FILE_SIZE, SetAttr,
};

use super::cache::AfterIo;
use super::rpc::{PendingRequest, Pin};
use super::subplan::sub_plan;
use super::unsynced::UNANSWERED;
use super::{Client, FileHandle, Inner, SessionView, add, bump, unsynced};
use crate::buf::AlignedBuf;
use crate::engine::{DeviceOp, IoErr};

/// What a write did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WriteOutcome {
    /// Bytes written (all of them: a write either completes or fails).
    pub written: u64,
    /// The file's attributes after the last piece, as the server reported them.
    pub attr: Option<Attr>,
}

fn round_up(x: u64, to: u64) -> u64 {
    x.div_ceil(to).saturating_mul(to)
}

fn round_down(x: u64, to: u64) -> u64 {
    x - x % to
}

fn usize_of(x: u64) -> usize {
    usize::try_from(x).unwrap_or(usize::MAX)
}

/// How an I/O of `[offset, offset + len)` is split: (proxied head end, direct middle end);
/// `None`: all proxied.
fn split(offset: u64, len: u64, block: u64, threshold: u64) -> Option<(u64, u64)> {
    let end = offset + len;
    if len < threshold {
        return None;
    }
    let head_end = round_up(offset, block).min(end);
    let mid_end = round_down(end, block).max(head_end);
    if mid_end - head_end < threshold.max(1) {
        return None;
    }
    Some((head_end, mid_end))
}

fn handle_ref(fh: &FileHandle) -> HandleRef {
    HandleRef {
        session: fh.session,
        handle: fh.handle,
    }
}

impl Client {
    /// Reads up to `len` bytes at `offset`; fewer only at end of file.
    pub async fn read_at(
        &self,
        cred: &Credentials,
        fh: &FileHandle,
        ino: InodeId,
        offset: u64,
        len: u64,
    ) -> Result<Vec<u8>, FsError> {
        ByteRange::new(offset, len)?;
        let mut out = vec![0u8; usize_of(len)];
        let n = self.read_into(cred, fh, ino, offset, &mut out).await?;
        out.truncate(n);
        Ok(out)
    }

    /// Reads into `buf` from `offset`; returns the bytes read (fewer than `buf.len()` only at
    /// end of file).
    pub async fn read_into(
        &self,
        cred: &Credentials,
        fh: &FileHandle,
        ino: InodeId,
        offset: u64,
        buf: &mut [u8],
    ) -> Result<usize, FsError> {
        let len = buf.len() as u64;
        ByteRange::new(offset, len)?;
        if len == 0 {
            return Ok(0);
        }
        let inner = &self.inner;
        let view = inner.live_view_for(Some(fh), "Read").await?;
        // This agent's own write layouts there would block the read: give them back (after
        // their completions in flight, which may move the end of file).
        inner.settle(ino).await;
        let range = ByteRange::new(offset, len)?;
        inner
            .give_back_own(&view, ino, range, Some(LockMode::Exclusive))
            .await;
        let block = u64::from(view.server.block_size);
        let Some((head_end, mid_end)) = split(offset, len, block, inner.threshold(&view)) else {
            return inner.proxied_read(&view, cred, fh, ino, offset, buf).await;
        };
        let end = offset + len;
        let mut done = 0usize;
        let (head, rest) = buf.split_at_mut(usize_of(head_end - offset));
        if !head.is_empty() {
            let n = inner
                .proxied_read(&view, cred, fh, ino, offset, head)
                .await?;
            done += n;
            if n < head.len() {
                return Ok(done);
            }
        }
        let (mid, tail) = rest.split_at_mut(usize_of(mid_end - head_end));
        // The device I/O lands in an aligned buffer; one copy to the caller's.
        let mut abuf = AlignedBuf::zeroed(mid.len());
        let n = inner
            .direct_read(&view, cred, fh, ino, head_end, &mut abuf, 0)
            .await?;
        mid[..n].copy_from_slice(&abuf.as_slice()[..n]);
        done += n;
        if n < mid.len() {
            return Ok(done);
        }
        if end > mid_end {
            done += inner
                .proxied_read(&view, cred, fh, ino, mid_end, tail)
                .await?;
        }
        Ok(done)
    }

    /// Writes `data` at `offset`. On a device error the caller gets EIO and the blocks of
    /// the failed range stay Unwritten (they read as zeros, never as stale data).
    pub async fn write_at(
        &self,
        cred: &Credentials,
        fh: &FileHandle,
        ino: InodeId,
        offset: u64,
        data: &[u8],
    ) -> Result<WriteOutcome, FsError> {
        let len = data.len() as u64;
        let range = ByteRange::new(offset, len)?;
        if len == 0 {
            return Ok(WriteOutcome {
                written: 0,
                attr: None,
            });
        }
        let inner = &self.inner;
        let view = inner.live_view_for(Some(fh), "Write").await?;
        // A write that completed behind an earlier one failed: say so now (as writeback).
        inner.take_write_error(ino)?;
        // Own read grants there would block the write; so would own write layouts where the
        // server writes (the proxied pieces): give them back.
        inner
            .give_back_own(&view, ino, range, Some(LockMode::Shared))
            .await;
        let block = u64::from(view.server.block_size);
        let mut attr = None;
        let pieces = split(offset, len, block, inner.threshold(&view));
        let proxied: [Option<ByteRange>; 2] = match pieces {
            None => [Some(range), None],
            Some((h, m)) => [
                ByteRange::new(offset, h - offset)
                    .ok()
                    .filter(|r| !r.is_empty()),
                ByteRange::new(m, offset + len - m)
                    .ok()
                    .filter(|r| !r.is_empty()),
            ],
        };
        for r in proxied.into_iter().flatten() {
            inner
                .give_back_own(&view, ino, r, Some(LockMode::Exclusive))
                .await;
        }
        match pieces {
            None => {
                attr = inner
                    .proxied_write(&view, cred, fh, ino, offset, data)
                    .await?;
            }
            Some((head_end, mid_end)) => {
                let h = usize_of(head_end - offset);
                let m = usize_of(mid_end - offset);
                if h > 0 {
                    attr = inner
                        .proxied_write(&view, cred, fh, ino, offset, &data[..h])
                        .await?;
                }
                let mut abuf = AlignedBuf::from_slice(&data[h..m]);
                attr = inner
                    .direct_write(&view, cred, fh, ino, head_end, &mut abuf)
                    .await?
                    .or(attr);
                if m < data.len() {
                    attr = inner
                        .proxied_write(&view, cred, fh, ino, mid_end, &data[m..])
                        .await?
                        .or(attr);
                }
            }
        }
        Ok(WriteOutcome { written: len, attr })
    }

    /// Appends `data` at the end of the file (O_APPEND), atomically with respect to every
    /// other write of every node: one proxied write at the server's end of file (FUSE hands
    /// at most [`MAX_INLINE_DATA`](sanfs_proto::model::MAX_INLINE_DATA) bytes per write, so it
    /// is never split), named in the server's reply cache so that a retry after a lost reply
    /// does not append the record twice. Returns where the bytes went.
    pub async fn append(
        &self,
        cred: &Credentials,
        fh: &FileHandle,
        ino: InodeId,
        data: &[u8],
    ) -> Result<(u64, WriteOutcome), FsError> {
        let pending = self.inner.requests.begin();
        self.append_as(cred, fh, ino, data, &pending).await
    }

    /// [`Client::append`] under the reply-cache id `pending`, which every try of this one
    /// append (also under a new handle after a session change) must carry.
    pub(crate) async fn append_as(
        &self,
        cred: &Credentials,
        fh: &FileHandle,
        ino: InodeId,
        data: &[u8],
        pending: &PendingRequest<'_>,
    ) -> Result<(u64, WriteOutcome), FsError> {
        if data.is_empty() {
            let size = self.getattr(cred, ino).await?.size;
            return Ok((
                size,
                WriteOutcome {
                    written: 0,
                    attr: None,
                },
            ));
        }
        let inner = &self.inner;
        let view = inner.live_view_for(Some(fh), "Write").await?;
        inner.take_write_error(ino)?;
        // This node's own writes land first (the end of file must include them), and its own
        // grants and layouts on the file would block the server's whole-file lock.
        inner.settle(ino).await;
        let whole = ByteRange::new(0, sanfs_proto::types::MAX_FILE_SIZE)?;
        inner.give_back_own(&view, ino, whole, None).await;
        let mut req = pb::WriteRequest::from(WriteRequest {
            cred: cred.clone(),
            handle: handle_ref(fh),
            inode: ino,
            position: WritePosition::Append,
            data: data.to_vec(),
            sync: false,
        });
        req.request_id = pending.wire();
        bump(&self.inner.counters.proxied_writes);
        let reply: WriteReply = inner
            .call("Write reply", Pin::Handle(fh), |_| {
                let mut client = inner.data();
                let req = req.clone();
                async move { client.write(req).await }
            })
            .await?;
        if reply.written.len() != data.len() as u64 {
            return Err(FsError::Io(format!(
                "an append of {} bytes wrote {}",
                data.len(),
                reply.written.len()
            )));
        }
        add(&self.inner.counters.proxied_write_bytes, data.len() as u64);
        Ok((
            reply.written.offset(),
            WriteOutcome {
                written: data.len() as u64,
                attr: Some(reply.attr),
            },
        ))
    }

    /// Reads `buf.len()` bytes at `offset` into `buf`; returns it and the bytes read (fewer
    /// only at end of file). When the whole range goes the direct path (block aligned, at
    /// least the threshold) the device I/O lands in `buf` itself: no copy at all. Otherwise
    /// this is [`Client::read_into`].
    pub async fn read_aligned(
        &self,
        cred: &Credentials,
        fh: &FileHandle,
        ino: InodeId,
        offset: u64,
        mut buf: AlignedBuf,
    ) -> Result<(AlignedBuf, usize), FsError> {
        let len = buf.len() as u64;
        ByteRange::new(offset, len)?;
        let inner = &self.inner;
        let view = inner.live_view_for(Some(fh), "Read").await?;
        let block = u64::from(view.server.block_size);
        match split(offset, len, block, inner.threshold(&view)) {
            Some((h, m)) if len > 0 && h == offset && m == offset + len => {
                let range = ByteRange::new(offset, len)?;
                inner.settle(ino).await;
                inner
                    .give_back_own(&view, ino, range, Some(LockMode::Exclusive))
                    .await;
                let n = inner
                    .direct_read(&view, cred, fh, ino, offset, &mut buf, 0)
                    .await?;
                Ok((buf, n))
            }
            _ => {
                let n = self
                    .read_into(cred, fh, ino, offset, buf.as_mut_slice())
                    .await?;
                Ok((buf, n))
            }
        }
    }

    /// Writes `buf` at `offset`; returns it. When the whole range goes the direct path the
    /// devices write from `buf` itself (no copy); otherwise this is [`Client::write_at`].
    pub async fn write_aligned(
        &self,
        cred: &Credentials,
        fh: &FileHandle,
        ino: InodeId,
        offset: u64,
        mut buf: AlignedBuf,
    ) -> Result<(AlignedBuf, WriteOutcome), FsError> {
        let len = buf.len() as u64;
        let range = ByteRange::new(offset, len)?;
        let inner = &self.inner;
        let view = inner.live_view_for(Some(fh), "Write").await?;
        let block = u64::from(view.server.block_size);
        match split(offset, len, block, inner.threshold(&view)) {
            Some((h, m)) if len > 0 && h == offset && m == offset + len => {
                inner.take_write_error(ino)?;
                inner
                    .give_back_own(&view, ino, range, Some(LockMode::Shared))
                    .await;
                let attr = inner
                    .direct_write(&view, cred, fh, ino, offset, &mut buf)
                    .await?;
                Ok((buf, WriteOutcome { written: len, attr }))
            }
            _ => {
                let out = self.write_at(cred, fh, ino, offset, buf.as_slice()).await?;
                Ok((buf, out))
            }
        }
    }

    /// Waits for `ino`'s write completions in flight (writes inside a write layout return
    /// before their completion is answered); a completion that failed is the error here,
    /// once. What close(2) reports ([`Client::has_writes_behind`] says whether to ask).
    pub async fn flush_writes(&self, ino: InodeId) -> Result<(), FsError> {
        self.inner.settle(ino).await;
        self.inner.take_write_error(ino)
    }

    /// Whether `ino` has lazily completed writes the server has not made durable yet: close
    /// makes them durable ([`Client::fsync`]) before it answers.
    pub fn has_unsynced_writes(&self, ino: InodeId) -> bool {
        self.inner.lock_unsynced().has(ino)
    }

    /// Whether `ino` has write completions in flight, or a failed one not reported yet.
    pub fn has_writes_behind(&self, ino: InodeId) -> bool {
        self.inner.has_behind(ino)
    }

    /// Makes the file's completed writes (and, unless `data_only`, its metadata) durable.
    pub async fn fsync(
        &self,
        cred: &Credentials,
        fh: &FileHandle,
        ino: InodeId,
        data_only: bool,
    ) -> Result<(), FsError> {
        let inner = &*self.inner;
        let view = inner.live_view_for(Some(fh), "Fsync reply").await?;
        // Writes completed behind first; one that failed is this fsync's error, and so is a
        // write lost in a server restart.
        inner.settle(ino).await;
        inner.take_write_error(ino)?;
        // What this fsync makes durable: every completion answered before it is sent.
        let upto = inner.lock_unsynced().newest(ino, view.epoch);
        let req = FsyncRequest {
            cred: cred.clone(),
            handle: handle_ref(fh),
            inode: ino,
            data_only,
        };
        let req = pb::FsyncRequest::from(req);
        inner
            .call_unit("Fsync reply", Pin::Handle(fh), |_| {
                let mut data = inner.data();
                let req = req.clone();
                async move { data.fsync(req).await }
            })
            .await?;
        // A write lost in a server restart while this fsync waited for the new session is its
        // error too (never a 0 for data that is gone).
        inner.take_lost_write(ino)?;
        if let Some(upto) = upto {
            inner.lock_unsynced().synced(ino, view.epoch, upto);
        }
        Ok(())
    }

    /// Sets the file size (SetAttr with a size; under `fh` for ftruncate).
    pub async fn truncate(
        &self,
        cred: &Credentials,
        fh: Option<&FileHandle>,
        ino: InodeId,
        size: u64,
    ) -> Result<Attr, FsError> {
        let view = self.inner.live_view_for(fh, "SetAttr").await?;
        self.inner.settle(ino).await;
        let tail = ByteRange::new(size, MAX_FILE_SIZE.saturating_sub(size))?;
        self.inner.give_back_own(&view, ino, tail, None).await;
        let changes = SetAttr {
            size: Some(size),
            ..SetAttr::default()
        };
        self.setattr(cred, ino, changes, fh).await
    }

    /// Allocates (or punches, zeroes) `[offset, offset + len)` as `mode` says.
    pub async fn fallocate(
        &self,
        cred: &Credentials,
        fh: &FileHandle,
        ino: InodeId,
        offset: u64,
        len: u64,
        mode: FallocateMode,
    ) -> Result<Attr, FsError> {
        let range = ByteRange::new(offset, len)?;
        if len == 0 {
            return Err(FsError::Invalid("fallocate of 0 bytes".to_owned()));
        }
        let inner = &*self.inner;
        let view = inner.live_view_for(Some(fh), "Fallocate").await?;
        inner.settle(ino).await;
        inner.give_back_own(&view, ino, range, None).await;
        let req = FallocateRequest {
            cred: cred.clone(),
            handle: handle_ref(fh),
            inode: ino,
            range,
            mode,
        };
        let req = pb::FallocateRequest::from(req);
        inner
            .call("Fallocate reply", Pin::Handle(fh), |_| {
                let mut data = inner.data();
                let req = req.clone();
                async move { data.fallocate(req).await }
            })
            .await
    }
}

impl Inner {
    /// The direct-I/O threshold: this client's override, else the server's.
    fn threshold(&self, view: &SessionView) -> u64 {
        self.config
            .direct_io_threshold
            .unwrap_or(view.server.direct_io_threshold)
    }

    /// The range to ask one grant for, from `pos` to at most `end`: all of it, or with
    /// `grant_per_stripe_unit` (method A) only up to the next stripe-unit boundary.
    fn grant_range(&self, pos: u64, end: u64) -> Result<ByteRange, FsError> {
        let mut stop = end;
        if self.config.grant_per_stripe_unit
            && let sanfs_blockmap::volume::LayoutKind::Striped { stripe_unit, .. } =
                self.volume.kind()
            && *stripe_unit > 0
        {
            stop = stop.min((pos / stripe_unit + 1).saturating_mul(*stripe_unit));
        }
        Ok(ByteRange::new(pos, stop - pos)?)
    }

    /// The range a read grant is asked for: `want`, extended to `read_layout_bytes` when
    /// it is shorter (never with method A, whose point is one grant per stripe unit).
    fn layout_range(&self, want: ByteRange) -> Result<ByteRange, FsError> {
        let ahead = self.config.read_layout_bytes;
        if self.config.grant_per_stripe_unit || want.len() >= ahead {
            return Ok(want);
        }
        let len = ahead.min(MAX_FILE_SIZE.saturating_sub(want.offset()));
        Ok(ByteRange::new(want.offset(), len.max(want.len()))?)
    }

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

    /// Right before `fh` is released: forgets it and, when it is this session's last handle
    /// on its inode, gives back that inode's cached grants, read grants and write layouts
    /// (waiting for their I/O and write completions in flight). The server drops a session's grants on an inode without a recall when the
    /// session's last handle there goes, so a layout kept past that point would never be
    /// recalled before another node's write, truncate or punch, and would serve stale data.
    pub(crate) async fn before_release(&self, fh: &FileHandle) {
        let last = {
            let mut open = self.open_handles.lock().unwrap_or_else(|e| e.into_inner());
            open.remove(&(fh.session, fh.handle)).filter(|ino| {
                !open
                    .iter()
                    .any(|((session, _), i)| *session == fh.session && i == ino)
            })
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

    fn return_in_background(self: &Arc<Self>, view: &SessionView, ids: Vec<GrantId>) {
        if ids.is_empty() {
            return;
        }
        let inner = Arc::clone(self);
        let view = view.clone();
        tokio::spawn(async move { inner.return_grants(&view, ids).await });
    }

    async fn proxied_read(
        &self,
        view: &SessionView,
        cred: &Credentials,
        fh: &FileHandle,
        ino: InodeId,
        offset: u64,
        buf: &mut [u8],
    ) -> Result<usize, FsError> {
        let chunk = view.server.max_inline_bytes.max(1) as usize;
        let mut done = 0usize;
        while done < buf.len() {
            let want = (buf.len() - done).min(chunk);
            let req = ReadRequest {
                cred: cred.clone(),
                handle: handle_ref(fh),
                inode: ino,
                range: ByteRange::new(offset + done as u64, want as u64)?,
            };
            bump(&self.counters.proxied_reads);
            let req = pb::ReadRequest::from(req);
            let reply: ReadReply = self
                .call("Read reply", Pin::Handle(fh), |_| {
                    let mut data = self.data();
                    let req = req.clone();
                    async move { data.read(req).await }
                })
                .await?;
            let n = reply.data.len().min(want);
            buf[done..done + n].copy_from_slice(&reply.data[..n]);
            add(&self.counters.proxied_read_bytes, n as u64);
            done += n;
            if n < want {
                break;
            }
        }
        Ok(done)
    }

    async fn proxied_write(
        &self,
        view: &SessionView,
        cred: &Credentials,
        fh: &FileHandle,
        ino: InodeId,
        offset: u64,
        data: &[u8],
    ) -> Result<Option<Attr>, FsError> {
        let chunk = view.server.max_inline_bytes.max(1) as usize;
        let mut attr = None;
        let mut done = 0usize;
        while done < data.len() {
            let piece = &data[done..(done + chunk).min(data.len())];
            let req = WriteRequest {
                cred: cred.clone(),
                handle: handle_ref(fh),
                inode: ino,
                position: WritePosition::At(offset + done as u64),
                data: piece.to_vec(),
                sync: false,
            };
            bump(&self.counters.proxied_writes);
            let req = pb::WriteRequest::from(req);
            let reply: WriteReply = self
                .call("Write reply", Pin::Handle(fh), |_| {
                    let mut data = self.data();
                    let req = req.clone();
                    async move { data.write(req).await }
                })
                .await?;
            if reply.written.len() != piece.len() as u64 {
                return Err(FsError::Io(format!(
                    "proxied write of {} bytes wrote {}",
                    piece.len(),
                    reply.written.len()
                )));
            }
            attr = Some(reply.attr);
            add(&self.counters.proxied_write_bytes, piece.len() as u64);
            done += piece.len();
        }
        Ok(attr)
    }

    /// Checks a grant against the request and the volume. Returns whether every device of its
    /// plan is usable from this node.
    fn check_grant(
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
        let devices = self.volume.devices();
        let mut usable = true;
        for io in &grant.device_ios {
            let Some(dev) = devices.get(io.device.as_usize()) else {
                return bad(format!("no device {}", io.device));
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
    async fn map(
        &self,
        view: &SessionView,
        cred: &Credentials,
        fh: &FileHandle,
        ino: InodeId,
        range: ByteRange,
        mode: LockMode,
        layout: bool,
    ) -> Result<Grant, FsError> {
        let req = pb::MapRequest::from(MapRequest {
            cred: cred.clone(),
            handle: handle_ref(fh),
            epoch: view.epoch,
            inode: ino,
            range,
            sync: false,
            layout,
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

    async fn complete(
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
    async fn complete_at(
        &self,
        view: &SessionView,
        grant: &Grant,
        outcome: IoOutcome,
        bytes_done: u64,
        keep_at: Option<u64>,
    ) -> Result<Attr, FsError> {
        while self
            .completions_paused
            .load(std::sync::atomic::Ordering::SeqCst)
        {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        let req = CompleteRequest {
            session: view.session,
            epoch: view.epoch,
            grant_id: grant.grant_id,
            outcome,
            bytes_done,
            sync: false,
            keep_at,
        };
        let req = pb::CompleteRequest::from(req);
        let reply: CompleteReply = self
            .call("Complete reply", Pin::Session(view.session), |_| {
                let mut data = self.data();
                let req = req.clone();
                async move { data.complete(req).await }
            })
            .await?;
        self.note_completion(view, grant, bytes_done, keep_at, &reply);
        Ok(reply.attr)
    }

    /// Keeps a record of a lazily committed write completion until it is durable (see
    /// `unsynced`), and forgets the records the reply says are durable now.
    fn note_completion(
        &self,
        view: &SessionView,
        grant: &Grant,
        bytes_done: u64,
        keep_at: Option<u64>,
        reply: &CompleteReply,
    ) {
        let at = keep_at.unwrap_or(grant.range.offset());
        let record = (reply.commit_seq > 0 && bytes_done > 0)
            .then(|| self.write_record(view, grant, at, bytes_done, reply.commit_seq))
            .flatten();
        let mut unsynced = self.lock_unsynced();
        if let Some(record) = record {
            unsynced.record(grant.inode, record);
        }
        unsynced.durable(view.epoch, reply.durable_seq);
    }

    /// The record of a write of `len` bytes at `at` inside the exclusive grant `grant`: the
    /// file range and the LUN bytes its plan wrote (`None` for a shared grant or a range the
    /// server could not have completed).
    fn write_record(
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

    /// Runs `plan` in place on `dest`'s bytes from `base` on: the device I/O reads into (or
    /// writes from) `dest` itself, no copy. The lease is checked right before submission.
    /// Returns the failed device I/Os (none: success). `dest` keeps its length; only if the
    /// engine has stopped is it lost (left empty) with the error.
    async fn plan_in_place(
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
    async fn direct_read(
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
            // A cached layout first.
            if let Some(grant) = self
                .cache
                .take(ino, want, view.generation, LockMode::Shared)
            {
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
                self.map(view, cred, fh, ino, ask, LockMode::Shared, false)
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
    async fn direct_write(
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
            let sequential = layouts && self.is_sequential(ino, pos);
            let ask = if sequential {
                self.write_layout_range(view, want)?
            } else {
                want
            };
            if sequential {
                // This agent's own older layout there would block the new one.
                self.give_back_own(view, ino, ask, Some(LockMode::Exclusive))
                    .await;
            }
            let (grant, ask) = match self
                .map(view, cred, fh, ino, ask, LockMode::Exclusive, sequential)
                .await
            {
                // No room (or quota) for a layout ahead: the write's own range is what counts.
                Err(FsError::NoSpace | FsError::QuotaExceeded) if ask.len() > want.len() => (
                    self.map(view, cred, fh, ino, want, LockMode::Exclusive, false)
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
                if !self.cache.enter(Arc::clone(&layout), view.generation) {
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
                    .proxied_write(view, cred, fh, ino, pos, piece_of(data, at, part.len())?)
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
                        Err(e) if super::is_stale(&e) => {
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

    /// Ends one write inside `layout` whose device I/O gave `r`: completed behind the caller
    /// on success; the layout given back on failure, and the part written through the server
    /// when a LUN of it is not usable here (`NotSupported`). Notes where the write ended (the
    /// next one is sequential from there).
    #[allow(
        clippy::too_many_arguments,
        reason = "the write's context; two call sites in direct_write"
    )]
    async fn end_layout_write(
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
                self.complete_behind(view, layout, ino, part);
                None
            }
            Err(e) => {
                self.end_layout_use(view, &layout, false).await;
                if e != FsError::NotSupported {
                    return Err(e);
                }
                let piece = piece_of(data, at, part.len())?;
                self.proxied_write(view, cred, fh, ino, part.offset(), piece)
                    .await?
            }
        };
        self.note_write_end(ino, part.end());
        Ok(attr)
    }

    /// Writes `part` (inside `layout`) from `data[at..]` to the devices; on success the
    /// caller completes it ([`Inner::complete_behind`]), a device error is completed here. `NotSupported`: a LUN of the part is not
    /// usable from this node (nothing was written).
    async fn write_in_layout(
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
    fn complete_behind(
        self: &Arc<Self>,
        view: &SessionView,
        layout: Arc<Grant>,
        ino: InodeId,
        part: ByteRange,
    ) {
        self.begin_pending(ino);
        let inner = Arc::clone(self);
        let view = view.clone();
        tokio::spawn(async move {
            let r = inner
                .complete_at(
                    &view,
                    &layout,
                    IoOutcome::Ok,
                    part.len(),
                    Some(part.offset()),
                )
                .await;
            if r.is_ok() {
                add(&inner.counters.direct_write_bytes, part.len());
            }
            inner.end_layout_use(&view, &layout, r.is_ok()).await;
            match r {
                // The session was lost with the completion in flight: its data is on the
                // LUNs, and whether the server applied it is unknown. Kept as a record: a
                // restarted server gets it replayed, a living one (fenced or evicted session)
                // makes it a lost write (EIO at the file's next write, fsync or close).
                Err(e) if super::is_stale(&e) => {
                    if let Some(record) =
                        inner.write_record(&view, &layout, part.offset(), part.len(), UNANSWERED)
                    {
                        inner.lock_unsynced().record(ino, record);
                    }
                    inner.end_pending(ino, None);
                }
                r => inner.end_pending(ino, r.err().map(refused_write)),
            }
        });
    }

    /// The end of one write's use of a cached write layout: kept after a success, given back
    /// (once idle) after a failure, so that the next write starts afresh.
    async fn end_layout_use(&self, view: &SessionView, layout: &Grant, ok: bool) {
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
    fn write_failed(
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

    /// Whether writes ask for write layouts (not with method A, whose point is one grant per
    /// stripe unit).
    fn write_layouts_on(&self) -> bool {
        self.config.write_layout_bytes > 0 && !self.config.grant_per_stripe_unit
    }

    /// The write layout asked for a sequential writer's next write `want`: from its offset,
    /// `write_layout_bytes` (whole blocks) or `want` if longer.
    fn write_layout_range(
        &self,
        view: &SessionView,
        want: ByteRange,
    ) -> Result<ByteRange, FsError> {
        let block = u64::from(view.server.block_size).max(1);
        let room = MAX_FILE_SIZE.saturating_sub(want.offset());
        let len = round_down(self.config.write_layout_bytes.min(room), block).max(want.len());
        Ok(ByteRange::new(want.offset(), len)?)
    }

    /// Whether a write at `pos` continues this agent's last direct write to `ino` (or starts
    /// the file): a sequential writer, worth a layout ahead.
    fn is_sequential(&self, ino: InodeId, pos: u64) -> bool {
        pos == 0 || self.lock_write_ends().get(&ino).is_some_and(|e| *e == pos)
    }

    fn note_write_end(&self, ino: InodeId, end: u64) {
        let mut ends = self.lock_write_ends();
        if ends.len() >= MAX_TRACKED_WRITERS && !ends.contains_key(&ino) {
            ends.clear();
        }
        ends.insert(ino, end);
    }

    fn lock_write_ends(
        &self,
    ) -> std::sync::MutexGuard<'_, std::collections::HashMap<InodeId, u64>> {
        self.write_ends.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// How many files' last write ends are remembered (sequential-writer detection).
const MAX_TRACKED_WRITERS: usize = 4096;

/// `data[at..at + len]`, or an error if the grant reached past the write.
fn piece_of(data: &AlignedBuf, at: usize, len: u64) -> Result<&[u8], FsError> {
    data.as_slice()
        .get(at..at + usize_of(len))
        .ok_or_else(|| FsError::Io("grant past the write".to_owned()))
}

/// The error of a direct read whose device I/O failed.
fn read_failed(errs: &[IoErr]) -> FsError {
    let first = errs.first().map(ToString::to_string).unwrap_or_default();
    FsError::Io(format!("direct read: {first}"))
}

/// `len` bytes of `dest` from `from`, or an error if it holds fewer (an engine that stopped
/// leaves it empty).
fn dest_slice(dest: &mut AlignedBuf, from: usize, len: usize) -> Result<&mut [u8], FsError> {
    dest.as_mut_slice()
        .get_mut(from..from.saturating_add(len))
        .ok_or_else(|| FsError::Io("the I/O engine has stopped".to_owned()))
}

/// The error of a write whose device I/O is done but whose completion the server refused
/// because the grant's session was fenced or evicted (ESTALE): the data is not in the file,
/// and writing it again under a new session could overwrite what other nodes wrote since.
/// The application sees EIO, as for a failed writeback, never ESTALE (on which an
/// [`super::OpenFile`] would retry the write).
impl Inner {
    /// A write's completion lost with its session `view` (the write has not returned yet):
    /// after a server restart (a new epoch) the write is redone whole under the new session
    /// (`StaleSession`: the open file re-opens and retries; the same bytes land on the same
    /// or new blocks, and the old grant's Unwritten blocks never become visible); with the
    /// server alive (the session fenced or evicted) the completion was refused: EIO.
    async fn completion_lost(&self, view: &SessionView, e: FsError) -> FsError {
        // Not the current view: the completion may have met the restarted server before the
        // session task did, and the current view is then still the old epoch's.
        match self.next_session_after(view, "Write").await {
            Ok(now) if now.epoch != view.epoch => FsError::StaleSession,
            _ => refused_write(e),
        }
    }
}

fn refused_write(e: FsError) -> FsError {
    if super::is_stale(&e) {
        FsError::Io(format!(
            "the write's completion was refused ({e}): its session was fenced or evicted, \
             the data is not in the file"
        ))
    } else {
        e
    }
}
