//! The data operations of the direct path, as store jobs: what the server does at control
//! info 1 -> 2 (map a range: allocate what is missing, durably, and plan the device I/O) and
//! at control info 3 -> 4 (complete: convert exactly the written prefix to Written, extend the
//! size, set the times).
//!
//! Locks, grant ids and sessions are the grant layer's; these functions only change the
//! tables, and follow the store's rule (check first, then change).

use redb::ReadableTable;
use sanfs_blockmap::plan::{IoPlan, PlanMethod, PlanOp, plan};
use sanfs_blockmap::volume::Volume;
use sanfs_proto::types::{Attr, FileType, FsError, InodeId, MAX_FILE_SIZE};

use crate::space::{allocate_blocks, save_extents};
use crate::store::{Ctx, OpError, ReaderInodes};

/// Most bytes one grant covers; a longer request is granted a prefix and the client asks
/// again for the rest (docs/protocol.md, "A write grant covers a prefix").
pub const MAX_GRANT_BYTES: u64 = 64 << 20;

fn err<T>(e: FsError) -> Result<T, OpError> {
    Err(OpError::Fs(e))
}

/// What a map answers: the planned I/O of the granted range and the file's size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mapped {
    /// The granted range (a prefix of the requested one, possibly clipped).
    pub offset: u64,
    pub len: u64,
    pub plan: IoPlan,
    pub file_size: u64,
}

fn aligned(offset: u64, len: u64, block_size: u32) -> Result<(), OpError> {
    let bs = u64::from(block_size);
    if !offset.is_multiple_of(bs) || !len.is_multiple_of(bs) || len == 0 {
        return err(FsError::Invalid(format!(
            "a direct-path range must be non-empty and aligned to the {bs}-byte block: {offset}+{len}"
        )));
    }
    Ok(())
}

fn plan_error(e: sanfs_blockmap::plan::PlanError) -> OpError {
    // The server's own extents failed to plan: the metadata is inconsistent.
    crate::store::corrupt("extent map", e)
}

/// Control info 1 -> 2 for a write: allocates every block of `[offset, offset + len)` that
/// has none as Unwritten (in this job's transaction, so durably before the grant leaves) and
/// plans the write. The range must be block aligned; a range longer than
/// [`MAX_GRANT_BYTES`] is granted its first [`MAX_GRANT_BYTES`].
pub fn map_write(
    ctx: &mut Ctx<'_>,
    volume: &Volume,
    ino: InodeId,
    offset: u64,
    len: u64,
) -> Result<Mapped, OpError> {
    map_write_blocks(ctx, volume, ino, offset, len, 0, false).map(|(m, _)| m)
}

/// How far ahead a sequential writer's allocation reaches (XFS-style speculative
/// preallocation): as much as the file already holds, at least 4 MiB, at most 64 MiB, never
/// more than an eighth of the free space.
pub fn speculative_blocks(file_end_block: u64, block_size: u32, free_blocks: u64) -> u64 {
    let bs = u64::from(block_size);
    let min = (4 << 20) / bs;
    let max = (64 << 20) / bs;
    file_end_block.clamp(min, max).min(free_blocks / 8)
}

/// [`map_write`] that, for a sequential writer (the range starts at or past the end of the
/// file's allocation), also allocates `ahead_blocks` past the range: later grants of a
/// streaming writer then find their blocks allocated and need no commit. Returns the mapping
/// and the blocks allocated ahead as `(first, end)` (empty when none).
/// The blocks it allocates are noted as not zeroed yet: the grant layer has them zeroed on the
/// LUNs before the grant leaves (`DataPath::zero_fresh` in the `proxy` module).
pub fn map_write_ahead(
    ctx: &mut Ctx<'_>,
    volume: &Volume,
    ino: InodeId,
    offset: u64,
    len: u64,
    ahead_blocks: u64,
) -> Result<(Mapped, (u64, u64)), OpError> {
    map_write_blocks(ctx, volume, ino, offset, len, ahead_blocks, true)
}

/// [`map_write_ahead`]; `mark_unzeroed` as for [`allocate_blocks`] (false for the proxied
/// path, which writes the new blocks whole itself).
fn map_write_blocks(
    ctx: &mut Ctx<'_>,
    volume: &Volume,
    ino: InodeId,
    offset: u64,
    len: u64,
    ahead_blocks: u64,
    mark_unzeroed: bool,
) -> Result<(Mapped, (u64, u64)), OpError> {
    aligned(offset, len, ctx.block_size)?;
    let len = len.min(MAX_GRANT_BYTES);
    let end = offset
        .checked_add(len)
        .filter(|e| *e <= MAX_FILE_SIZE)
        .ok_or(OpError::Fs(FsError::FileTooBig))?;
    let mut rec = ctx.t.inode(ino)?;
    rec.regular()?;
    if rec.nlink == 0 && ctx.orphans.get(ino.0)?.is_none() {
        return err(FsError::Stale);
    }
    let bs = u64::from(ctx.block_size);
    let blocks_before = rec.blocks;
    let sequential = {
        let map = ctx.t.extent_map(ino)?;
        offset / bs >= map.end_block()
    };
    // Never ahead past the largest file size: no extent may lie there.
    let ahead = if sequential {
        ahead_blocks.min(MAX_FILE_SIZE.div_ceil(bs).saturating_sub(end / bs))
    } else {
        0
    };
    let alloc_end = (end / bs).saturating_add(ahead);
    let map = match allocate_blocks(ctx, ino, &mut rec, offset / bs, alloc_end, mark_unzeroed) {
        Ok(m) => m,
        // Not enough room (or quota) to allocate ahead: the range itself is what matters.
        Err(OpError::Fs(FsError::NoSpace | FsError::QuotaExceeded)) if ahead > 0 => {
            return map_write_blocks(ctx, volume, ino, offset, len, 0, mark_unzeroed);
        }
        Err(e) => return Err(e),
    };
    if rec.blocks != blocks_before {
        rec.ctime = ctx.now;
        ctx.t.put_inode(ino, &rec)?;
    }
    let plan = plan(
        PlanOp::Write,
        offset,
        len,
        &map,
        volume,
        PlanMethod::Coalesced,
    )
    .map_err(plan_error)?;
    let ahead_range = if ahead > 0 {
        (end / bs, alloc_end)
    } else {
        (0, 0)
    };
    if ahead > 0 {
        // Recorded durably with the allocation, so that a crash cannot leak it.
        let merged = match ctx.prealloc.get(ino.0)?.map(|v| v.value()) {
            Some((first, last)) => (first.min(ahead_range.0), last.max(ahead_range.1)),
            None => ahead_range,
        };
        ctx.prealloc.insert(ino.0, merged)?;
    }
    Ok((
        Mapped {
            offset,
            len,
            plan,
            file_size: rec.size,
        },
        ahead_range,
    ))
}

/// Where `ino`'s allocation ends (its last extent's end, in blocks; 0 for none).
pub fn allocated_end<T: ReaderInodes>(t: &T, ino: InodeId) -> Result<u64, OpError> {
    Ok(t.extent_map_of(ino)?.end_block())
}

/// A write grant's plan on a snapshot when every block of the range is allocated already
/// (a streaming writer inside its preallocation, or an overwrite): no transaction at all.
/// `None` when something must be allocated first.
pub fn plan_allocated_write<T: ReaderInodes>(
    t: &T,
    volume: &Volume,
    block_size: u32,
    ino: InodeId,
    offset: u64,
    len: u64,
) -> Result<Option<Mapped>, OpError> {
    aligned(offset, len, block_size)?;
    let len = len.min(MAX_GRANT_BYTES);
    let rec = t.inode_rec(ino)?;
    if rec.kind != FileType::Regular || rec.nlink == 0 {
        return Ok(None);
    }
    let map = t.extent_map_of(ino)?;
    let bs = u64::from(block_size);
    let holes = map
        .lookup(offset / bs, len / bs)
        .iter()
        .any(|p| matches!(p, sanfs_blockmap::extent::Piece::Hole { .. }));
    if holes {
        return Ok(None);
    }
    let plan = plan(
        PlanOp::Write,
        offset,
        len,
        &map,
        volume,
        PlanMethod::Coalesced,
    )
    .map_err(plan_error)?;
    Ok(Some(Mapped {
        offset,
        len,
        plan,
        file_size: rec.size,
    }))
}

/// Control info 1 -> 2 for a read, on a snapshot: the requested range clipped to the end of
/// file (rounded up to a block) and to [`MAX_GRANT_BYTES`]; Written extents become device
/// reads, holes and Unwritten extents zero fill. A range wholly past end of file gets an empty
/// plan.
pub fn map_read<T: ReaderInodes>(
    t: &T,
    volume: &Volume,
    block_size: u32,
    ino: InodeId,
    offset: u64,
    len: u64,
) -> Result<Mapped, OpError> {
    map_read_clipped(t, volume, block_size, ino, offset, len, true)
}

/// [`map_read`] without clipping at end of file: for the server's own read-modify-write of
/// blocks that straddle or lie past it.
pub fn map_read_unclipped<T: ReaderInodes>(
    t: &T,
    volume: &Volume,
    block_size: u32,
    ino: InodeId,
    offset: u64,
    len: u64,
) -> Result<Mapped, OpError> {
    map_read_clipped(t, volume, block_size, ino, offset, len, false)
}

fn map_read_clipped<T: ReaderInodes>(
    t: &T,
    volume: &Volume,
    block_size: u32,
    ino: InodeId,
    offset: u64,
    len: u64,
    clip: bool,
) -> Result<Mapped, OpError> {
    aligned(offset, len, block_size)?;
    let rec = t.inode_rec(ino)?;
    rec.regular()?;
    let bs = u64::from(block_size);
    let eof = rec.size.div_ceil(bs) * bs;
    let len = if clip {
        len.min(MAX_GRANT_BYTES).min(eof.saturating_sub(offset))
    } else {
        len.min(MAX_GRANT_BYTES)
    };
    if len == 0 {
        return Ok(Mapped {
            offset,
            len: 0,
            plan: IoPlan::default(),
            file_size: rec.size,
        });
    }
    let map = t.extent_map_of(ino)?;
    let plan = plan(
        PlanOp::Read,
        offset,
        len,
        &map,
        volume,
        PlanMethod::Coalesced,
    )
    .map_err(plan_error)?;
    Ok(Mapped {
        offset,
        len,
        plan,
        file_size: rec.size,
    })
}

/// Control info 3 -> 4 for a write: converts the whole blocks of the completed prefix
/// `[offset, offset + bytes_done)` from Unwritten to Written, extends the size to the end of
/// that prefix, sets mtime and ctime, and clears setuid/setgid when the writer is not root
/// (as a write(2) does). With `bytes_done == 0` (the device I/O failed at once) nothing
/// changes: the blocks stay Unwritten and read as zeros.
pub fn complete_write(
    ctx: &mut Ctx<'_>,
    ino: InodeId,
    offset: u64,
    bytes_done: u64,
    writer_is_root: bool,
) -> Result<Attr, OpError> {
    let end = offset.saturating_add(bytes_done);
    complete_write_to(ctx, ino, offset, bytes_done, end, writer_is_root)
}

/// [`complete_write`] for a write whose file data ends at `data_end`, which may lie inside
/// the last completed block (a proxied write of whole blocks read-modify-written around
/// unaligned application data): the size grows to at most `data_end`.
pub fn complete_write_to(
    ctx: &mut Ctx<'_>,
    ino: InodeId,
    offset: u64,
    bytes_done: u64,
    data_end: u64,
    writer_is_root: bool,
) -> Result<Attr, OpError> {
    let mut rec = ctx.t.inode(ino)?;
    if bytes_done == 0 {
        return Ok(rec.attr(ino, ctx.block_size));
    }
    let bs = u64::from(ctx.block_size);
    let end = offset
        .checked_add(bytes_done)
        .filter(|e| *e <= MAX_FILE_SIZE)
        .ok_or(OpError::Fs(FsError::FileTooBig))?;
    let mut map = ctx.t.extent_map(ino)?;
    // Only whole blocks were written with certainty; a torn last block stays Unwritten.
    let first = offset / bs;
    let whole = end / bs;
    if whole > first {
        if !ctx.data {
            return Err(OpError::Fs(FsError::Io(format!(
                "inode {}: a completion outside the store's data commits was refused (its \
                 data would not be flushed before it is durable)",
                ino.0
            ))));
        }
        map.convert_to_written(first, whole - first);
        save_extents(&mut ctx.t, ino, &map)?;
    }
    let done_end = (whole * bs).min(data_end);
    if done_end > rec.size {
        rec.size = done_end;
    }
    rec.mtime = ctx.now;
    rec.ctime = ctx.now;
    if !writer_is_root {
        rec.perm = sanfs_proto::types::cleared_setid(rec.perm);
    }
    // As the kernel does at every write (the mount leaves it to the server:
    // FUSE_HANDLE_KILLPRIV_V2).
    crate::ns::kill_capability(ctx, ino)?;
    ctx.t.put_inode(ino, &rec)?;
    Ok(rec.attr(ino, ctx.block_size))
}
