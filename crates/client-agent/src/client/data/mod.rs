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

pub(super) mod batch;
mod direct;
pub(crate) mod grants;
mod layouts;
mod proxied;

use std::sync::Arc;

use sanfs_blockmap::plan::IoPlan;
use sanfs_proto::model::{
    CompleteReply, CompleteRequest, ExtentError, FallocateMode, FallocateRequest, FsyncRequest,
    Grant, HandleRef, IoOutcome, LockMode, MAX_COMPLETE_PARTS, MAX_GRANTS_PER_MESSAGE, MapRequest,
    ReadReply, ReadRequest, ReturnGrantRequest, WritePosition, WriteReply, WriteRequest,
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
use crate::stages::{Span, Stage};
use direct::piece_of;
use grants::GrantKind;

/// How [`Client::write_through`] writes.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Through<'a> {
    /// Attribute changes the server applies right after the write's last byte, in the same
    /// call, where that call is a proxied write to a server that takes them
    /// (`ServerInfo::write_sets_attr`).
    pub then: Option<&'a SetAttr>,
    /// Through the server, whatever the length (else: direct from the threshold on, or
    /// inside a cached write layout).
    pub proxied: bool,
}

/// The bytes of a write: borrowed, or an aligned buffer the devices can write from.
enum WriteData<'a> {
    Slice(&'a [u8]),
    Aligned(&'a mut AlignedBuf),
}

impl WriteData<'_> {
    fn as_slice(&self) -> &[u8] {
        match self {
            WriteData::Slice(s) => s,
            WriteData::Aligned(b) => b.as_slice(),
        }
    }
}

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

pub(crate) fn handle_ref(fh: &FileHandle) -> HandleRef {
    HandleRef {
        session: fh.session,
        handle: fh.handle,
    }
}

/// Runs its closure when dropped (when a write has landed, however it ends).
struct Landed<F: FnMut()>(F);

impl<F: FnMut()> Drop for Landed<F> {
    fn drop(&mut self) {
        (self.0)();
    }
}

/// A write layout held in use ([`Client::pin_write_layout`]).
#[derive(Debug)]
#[must_use = "unpin it with Client::unpin_write_layout"]
pub struct LayoutPin {
    layout: Arc<Grant>,
    generation: u64,
    /// The bytes of the write it is held for.
    part: ByteRange,
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
        // What this node held back is read from the LUNs once written.
        self.write_back_barrier(ino).await;
        // Under the file's attribute lease its size is exact: a read at or past it is
        // answered here, and one across it asks only up to it (a small file's read goes the
        // proxied way, one round trip, not a grant for the whole request).
        let (buf, len) = match self.leased_size(ino) {
            Some(size) if offset >= size => return Ok(0),
            Some(size) if size - offset < len => {
                let n = size - offset;
                (&mut buf[..usize_of(n)], n)
            }
            _ => (buf, len),
        };
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
        let mut abuf = {
            let _copy = Span::cpu(Stage::Copy);
            AlignedBuf::zeroed(mid.len())
        };
        let n = inner
            .direct_read(&view, cred, fh, ino, head_end, &mut abuf, 0)
            .await?;
        {
            let mut copy = Span::cpu(Stage::Copy);
            copy.set_bytes(n as u64);
            mid[..n].copy_from_slice(&abuf.as_slice()[..n]);
        }
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
    /// the failed range stay Unwritten (they read as zeros, never as stale data). Bytes of
    /// the file held back on this node are written first (in order).
    pub async fn write_at(
        &self,
        cred: &Credentials,
        fh: &FileHandle,
        ino: InodeId,
        offset: u64,
        data: &[u8],
    ) -> Result<WriteOutcome, FsError> {
        self.write_back_barrier(ino).await;
        self.write_through(cred, fh, ino, offset, data, Through::default())
            .await
            .map(|(outcome, _)| outcome)
    }

    /// [`Client::write_at`] of the bytes of an aligned buffer: when the whole write goes the
    /// direct path the devices write from `buf` itself (no copy into a bounce buffer). `buf`
    /// keeps its bytes, except if the engine stopped under the write (an error).
    pub async fn write_at_buf(
        &self,
        cred: &Credentials,
        fh: &FileHandle,
        ino: InodeId,
        offset: u64,
        buf: &mut AlignedBuf,
    ) -> Result<WriteOutcome, FsError> {
        self.write_back_barrier(ino).await;
        self.write_through_buf(cred, fh, ino, offset, buf).await
    }

    /// [`Client::write_at_buf`] without writing held-back bytes first.
    pub(crate) async fn write_through_buf(
        &self,
        cred: &Credentials,
        fh: &FileHandle,
        ino: InodeId,
        offset: u64,
        buf: &mut AlignedBuf,
    ) -> Result<WriteOutcome, FsError> {
        self.write_data(
            cred,
            fh,
            ino,
            offset,
            WriteData::Aligned(buf),
            Through::default(),
        )
        .await
        .map(|(outcome, _)| outcome)
    }

    /// [`Client::write_at`] without writing held-back bytes first (what write-back itself
    /// uses), as `how` says. Also answers whether `how.then` was applied: if not, the
    /// caller sends those changes.
    pub(crate) async fn write_through(
        &self,
        cred: &Credentials,
        fh: &FileHandle,
        ino: InodeId,
        offset: u64,
        data: &[u8],
        how: Through<'_>,
    ) -> Result<(WriteOutcome, bool), FsError> {
        self.write_data(cred, fh, ino, offset, WriteData::Slice(data), how)
            .await
    }

    async fn write_data(
        &self,
        cred: &Credentials,
        fh: &FileHandle,
        ino: InodeId,
        offset: u64,
        bytes: WriteData<'_>,
        how: Through<'_>,
    ) -> Result<(WriteOutcome, bool), FsError> {
        let len = bytes.as_slice().len() as u64;
        let range = ByteRange::new(offset, len)?;
        if len == 0 {
            let outcome = WriteOutcome {
                written: 0,
                attr: None,
            };
            return Ok((outcome, false));
        }
        // What this node's read cache holds there is stale from now on (also if the write
        // fails part way); and again when the write has landed, however it ends: a read of
        // the LUNs that began meanwhile may have read the older bytes, and must not keep them.
        self.inner.writeback.wrote(ino, offset, len);
        let _landed = Landed(|| self.inner.writeback.wrote(ino, offset, len));
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
        // Whole blocks go direct from the threshold on, and inside a cached write layout
        // whatever their size (the layout's own round trips are paid already).
        let pieces = if how.proxied {
            None
        } else {
            split(offset, len, block, inner.threshold(&view)).or_else(|| {
                split(offset, len, block, block).filter(|&(h, m)| {
                    inner.write_layouts_on()
                        && ByteRange::new(h, m - h)
                            .is_ok_and(|mid| inner.cache.covers_write(ino, mid, view.generation))
                })
            })
        };
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
        let whole_direct = pieces.is_some_and(|(h, m)| h == offset && m == offset + len);
        // The attribute changes ride on the last proxied call, when the write ends with one.
        let then = how.then.filter(|_| view.server.write_sets_attr);
        let mut applied = false;
        match (pieces, bytes) {
            (None, bytes) => {
                attr = inner
                    .proxied_write(&view, cred, fh, ino, offset, bytes.as_slice(), then)
                    .await?;
                applied = then.is_some();
            }
            (Some((head_end, _)), WriteData::Aligned(abuf)) if whole_direct => {
                attr = inner
                    .direct_write(&view, cred, fh, ino, head_end, abuf)
                    .await?;
            }
            (Some((head_end, mid_end)), bytes) => {
                let data = bytes.as_slice();
                let h = usize_of(head_end - offset);
                let m = usize_of(mid_end - offset);
                if h > 0 {
                    attr = inner
                        .proxied_write(&view, cred, fh, ino, offset, &data[..h], None)
                        .await?;
                }
                let mut abuf = {
                    let mut copy = Span::cpu(Stage::Copy);
                    copy.set_bytes((m - h) as u64);
                    AlignedBuf::from_slice(&data[h..m])
                };
                attr = inner
                    .direct_write(&view, cred, fh, ino, head_end, &mut abuf)
                    .await?
                    .or(attr);
                if m < data.len() {
                    attr = inner
                        .proxied_write(&view, cred, fh, ino, mid_end, &data[m..], then)
                        .await?
                        .or(attr);
                    applied = then.is_some();
                }
            }
        }
        Ok((WriteOutcome { written: len, attr }, applied))
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
        self.write_back_barrier(ino).await;
        self.inner.writeback.drop_cache(ino);
        let inner = &self.inner;
        let view = inner.live_view_for(Some(fh), "Write").await?;
        inner.take_write_error(ino)?;
        // This node's own writes land first (the end of file must include them), and its own
        // grants and layouts on the file would block the server's whole-file lock.
        inner.settle(ino).await;
        let whole = ByteRange::new(0, sanfs_proto::types::MAX_FILE_SIZE)?;
        inner.give_back_own(&view, ino, whole, None).await;
        let reply = inner
            .proxied_write_one(
                cred,
                fh,
                ino,
                WritePosition::Append,
                data,
                pending.wire(),
                None,
            )
            .await?;
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
        buf: AlignedBuf,
    ) -> Result<(AlignedBuf, usize), FsError> {
        // What this node held back (an O_DIRECT reader beside a buffered writer) is read from
        // the LUNs once written.
        self.write_back_barrier(ino).await;
        self.read_aligned_as_is(cred, fh, ino, offset, buf).await
    }

    /// [`Client::read_aligned`] of what the LUNs hold, without writing held-back bytes
    /// first (a read-ahead, which puts them into what it read). A read the proxied way (a
    /// short one at the end of file) still writes them first (`read_into`).
    pub(crate) async fn read_aligned_as_is(
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
        // What the read can return under the file's attribute lease (its exact size): a
        // small file is read the proxied way (see `read_into`).
        let want = match self.leased_size(ino) {
            Some(size) => len.min(round_up(size.saturating_sub(offset), block)),
            None => len,
        };
        match split(offset, want, block, inner.threshold(&view)) {
            Some((h, m)) if want > 0 && h == offset && m == offset + want => {
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
                    .read_into(
                        cred,
                        fh,
                        ino,
                        offset,
                        &mut buf.as_mut_slice()[..usize_of(want)],
                    )
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

    /// A write layout this node holds (and has not seen recalled) over `len` bytes at
    /// `offset` of `ino`, held in use for a write of those bytes: a recall of it waits until
    /// the write is done with it. Give it to [`Client::write_pinned`], or back with
    /// [`Client::unpin_write_layout`]. A write there needs no grant round trip, and its
    /// blocks are allocated (it cannot fail for want of space or quota). The write's end
    /// counts for the sequential-writer detection from now on. `None`: no such layout.
    pub fn pin_write_layout(&self, ino: InodeId, offset: u64, len: u64) -> Option<LayoutPin> {
        let generation = self.inner.lock_state().view.generation;
        let range = ByteRange::new(offset, len).ok()?;
        let layout = self
            .inner
            .cache
            .take(ino, range, generation, LockMode::Exclusive)?;
        self.inner.note_write_end(ino, range.end());
        Some(LayoutPin {
            layout,
            generation,
            part: range,
        })
    }

    /// Gives a [`Client::pin_write_layout`] back unused (a recall waiting for it goes on).
    pub fn unpin_write_layout(&self, pin: LayoutPin) {
        let (after, mut evicted) = self.inner.cache.release(pin.layout.grant_id, false);
        if after == AfterIo::Return {
            evicted.push(pin.layout.grant_id);
        }
        if !evicted.is_empty() {
            let view = self.inner.lock_state().view.clone();
            self.inner.return_in_background(&view, evicted);
        }
    }

    /// Writes `buf` (whole blocks), the bytes `pin` was taken for, inside the layout it
    /// holds, also after a recall of it arrived: the recall's acknowledgement waits for this
    /// write (the layout is the writer's until then, and asking for another grant there
    /// would wait for that very acknowledgement). The pin's use of the layout becomes the
    /// write's; its completion goes on behind it, as any write's inside a layout.
    /// `StaleSession`: the layout's session is gone (nothing was written; write the usual
    /// way under the new one).
    pub async fn write_pinned(
        &self,
        cred: &Credentials,
        fh: &FileHandle,
        buf: &mut AlignedBuf,
        pin: LayoutPin,
    ) -> Result<WriteOutcome, FsError> {
        let inner = &self.inner;
        let (ino, part) = (pin.layout.inode, pin.part);
        let view = inner.lock_state().view.clone();
        let refused = if buf.len() as u64 != part.len() {
            Some(FsError::Invalid(format!(
                "a write of {} bytes with a layout pinned for {}",
                buf.len(),
                part.len()
            )))
        } else if view.generation != pin.generation || !inner.lease_valid(view.generation) {
            Some(FsError::StaleSession)
        } else {
            // An earlier write's failed completion is this write's error (as writeback).
            inner.take_write_error(ino).err()
        };
        if let Some(e) = refused {
            self.unpin_write_layout(pin);
            return Err(e);
        }
        // The read cache's bytes there are stale now, and again once the write landed.
        let (offset, len) = (part.offset(), part.len());
        inner.writeback.wrote(ino, offset, len);
        let _landed = Landed(|| inner.writeback.wrote(ino, offset, len));
        bump(&inner.counters.layout_writes);
        let layout = pin.layout;
        let r = inner.write_in_layout(&view, &layout, part, buf, 0).await;
        let attr = inner
            .end_layout_write(&view, cred, fh, layout, part, r, buf, 0)
            .await?;
        Ok(WriteOutcome { written: len, attr })
    }

    /// A write of `ino` answered before its device I/O (the mount's write-behind) is in
    /// flight: until [`Client::end_write_behind`], this node's stat, fsync, truncate and
    /// close of the file wait for it, as for a completion in flight.
    pub fn begin_write_behind(&self, ino: InodeId) {
        self.inner.begin_pending(ino);
    }

    /// The end of a write begun with [`Client::begin_write_behind`]; its error (if it failed)
    /// is the error of the file's next write, fsync or close.
    pub fn end_write_behind(&self, ino: InodeId, error: Option<FsError>) {
        self.inner.end_pending(ino, error);
    }

    /// Makes the file's completed writes (and, unless `data_only`, its metadata) durable.
    pub async fn fsync(
        &self,
        cred: &Credentials,
        fh: &FileHandle,
        ino: InodeId,
        data_only: bool,
    ) -> Result<(), FsError> {
        // Held-back bytes first; a failed write-back is this fsync's error.
        self.write_back_barrier(ino).await;
        let inner = &*self.inner;
        let view = inner.live_view_for(Some(fh), "Fsync reply").await?;
        // Writes completed behind first; one that failed is this fsync's error, and so is a
        // write lost in a server restart.
        inner.settle(ino).await;
        inner.take_write_error(ino)?;
        // What this fsync makes durable: every completion answered before it is sent.
        let (upto, changes_upto) = {
            let u = inner.lock_unsynced();
            (u.newest(ino, view.epoch), u.newest_change(view.epoch))
        };
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
        // The server's Fsync makes every commit durable: namespace changes too.
        let mut unsynced = inner.lock_unsynced();
        if let Some(upto) = upto {
            unsynced.synced(ino, view.epoch, upto);
        }
        if let Some(upto) = changes_upto {
            unsynced.changes_synced(view.epoch, upto);
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
        self.before_truncate(ino).await?;
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
        self.before_truncate(ino).await?;
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
    pub(in crate::client) fn threshold(&self, view: &SessionView) -> u64 {
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
                *self.volume().kind()
            && stripe_unit > 0
        {
            stop = stop.min((pos / stripe_unit + 1).saturating_mul(stripe_unit));
        }
        Ok(ByteRange::new(pos, stop - pos)?)
    }

    /// The range a read grant is asked for: `want`, extended to `read_layout_bytes` when
    /// it is shorter, and a long read (a read-ahead of several MiB) to twice its length (at
    /// most [`READ_LAYOUT_MAX`]), so that the next one of a sequential reader finds its
    /// layout cached. Never with method A, whose point is one grant per stripe unit.
    fn layout_range(&self, want: ByteRange) -> Result<ByteRange, FsError> {
        let ahead = self.config.read_layout_bytes;
        if self.config.grant_per_stripe_unit || ahead == 0 {
            return Ok(want);
        }
        let len = ahead
            .max(want.len().saturating_mul(2).min(READ_LAYOUT_MAX))
            .min(MAX_FILE_SIZE.saturating_sub(want.offset()));
        Ok(ByteRange::new(want.offset(), len.max(want.len()))?)
    }
}

/// The longest read layout asked for ahead of a read ([`Inner::layout_range`]).
const READ_LAYOUT_MAX: u64 = 64 << 20;

/// The longest write layout asked for ahead of a sequential writer
/// ([`Inner::next_write_layout`]): the server's longest grant.
const WRITE_LAYOUT_MAX: u64 = 64 << 20;

/// How many files' last write ends are remembered (sequential-writer detection).
const MAX_TRACKED_WRITERS: usize = 4096;
