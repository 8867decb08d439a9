//! File space: the blocks a regular file holds. Allocating Unwritten blocks for holes,
//! saving a file's extent map, punching and zeroing ranges, trimming what a writer left
//! past the end of file, and [`release`], the one way blocks go back to free space (freed,
//! counted, and uncharged from the file's quota).
//!
//! These are store jobs over the committer's [`Ctx`], below the namespace and the data path
//! and above quotas; they follow the store's rule (check first, then change). Permission
//! checks are the caller's.

use sanfs_blockmap::codec;
use sanfs_blockmap::extent::{Extent, ExtentMap, ExtentState, Piece};
use sanfs_proto::types::{Attr, FsError, InodeId, MAX_FILE_SIZE};

use crate::quota;
use crate::store::records::InodeRec;
use crate::store::{Ctx, OpError, WriteTables};

/// Most extents one allocation may be split into.
const MAX_ALLOC_EXTENTS: usize = 64;

fn err<T>(e: FsError) -> Result<T, OpError> {
    Err(OpError::Fs(e))
}

/// Returns the volume blocks of `extents` (a file's, unmapped by the caller) to free space and
/// uncharges them from quota `project`; answers how many blocks were freed.
pub fn release(ctx: &mut Ctx<'_>, project: u64, extents: &[Extent]) -> Result<u64, OpError> {
    let mut freed = 0u64;
    for e in extents {
        ctx.free_blocks(e.vol_block, e.len_blocks)?;
        freed += e.len_blocks;
    }
    quota::apply(ctx, project, -i64::try_from(freed).unwrap_or(i64::MAX), 0)?;
    Ok(freed)
}

pub fn save_extents(t: &mut WriteTables<'_>, ino: InodeId, map: &ExtentMap) -> Result<(), OpError> {
    if map.is_empty() {
        t.extents.remove(ino.0)?;
    } else {
        t.extents
            .insert(ino.0, codec::encode_extents(&map.to_vec()).as_slice())?;
    }
    Ok(())
}

/// Allocates Unwritten extents for every hole in file blocks `[first, last)` of `ino`, saves
/// the extent map and `rec.blocks` (the caller writes `rec`), and returns the new map. The
/// caller has checked the file's type and the caller's right to write. Nothing changes if
/// the space is not there (ENOSPC). With `mark_unzeroed` the new blocks are noted as not
/// zeroed on the LUNs yet (a client will be granted them: the server zeroes them first, see
/// `DataPath::zero_fresh`); without, the caller writes every new block whole itself (the
/// proxied path).
pub fn allocate_blocks(
    ctx: &mut Ctx<'_>,
    ino: InodeId,
    rec: &mut InodeRec,
    first: u64,
    last: u64,
    mark_unzeroed: bool,
) -> Result<ExtentMap, OpError> {
    let mut map = ctx.t.extent_map(ino)?;
    if last <= first {
        return Ok(map);
    }
    let holes: Vec<(u64, u64)> = map
        .lookup(first, last - first)
        .into_iter()
        .filter_map(|p| match p {
            Piece::Hole {
                file_block,
                len_blocks,
            } => Some((file_block, len_blocks)),
            _ => None,
        })
        .collect();
    if holes.is_empty() {
        return Ok(map);
    }
    let wanted: u64 = holes.iter().map(|(_, l)| l).sum();
    quota::check(ctx, rec.project, wanted, 0)?;
    if wanted > ctx.st.alloc.free_blocks() {
        return err(FsError::NoSpace);
    }
    // From here on the change happens; an allocator refusal part way (fragmentation) is
    // reported as ENOSPC after undoing what this call took.
    let mut taken: Vec<(u64, u64)> = Vec::new();
    let mut hint = map
        .iter()
        .rev()
        .find(|e| e.file_block < first)
        .and_then(|e| e.checked_vol_end());
    let mut new_extents = Vec::new();
    for (file_block, len_blocks) in holes {
        match ctx.st.alloc.allocate(len_blocks, hint, MAX_ALLOC_EXTENTS) {
            Ok(a) => {
                let mut fb = file_block;
                for (vb, l) in &a.extents {
                    new_extents.push(Extent {
                        file_block: fb,
                        vol_block: *vb,
                        len_blocks: *l,
                        state: ExtentState::Unwritten,
                    });
                    taken.push((*vb, *l));
                    fb += l;
                }
                hint = a.extents.last().map(|(vb, l)| vb + l);
                ctx.apply_free_delta(&a.delta)?;
            }
            Err(_) => {
                for (vb, l) in taken {
                    ctx.free_blocks(vb, l)?;
                }
                return err(FsError::NoSpace);
            }
        }
    }
    for e in new_extents {
        if mark_unzeroed {
            ctx.mark_unzeroed(e.vol_block, e.len_blocks)?;
        }
        map.insert(e)
            .map_err(|e| OpError::Store(format!("inserting an allocated extent: {e}")))?;
    }
    rec.blocks = map.mapped_blocks();
    save_extents(&mut ctx.t, ino, &map)?;
    quota::apply(
        ctx,
        rec.project,
        i64::try_from(wanted).unwrap_or(i64::MAX),
        0,
    )?;
    Ok(map)
}

/// Unmaps file blocks `[first, end)` of a regular file (fallocate PUNCH_HOLE; the caller has
/// zeroed the partial blocks at the range's edges and holds an exclusive lock over it): their
/// volume blocks are freed and the quota given back; the size stays. Returns the new attributes.
pub fn punch_blocks(
    ctx: &mut Ctx<'_>,
    ino: InodeId,
    first: u64,
    end: u64,
) -> Result<Attr, OpError> {
    let mut rec = ctx.t.inode(ino)?;
    rec.regular()?;
    if first < end {
        let mut map = ctx.t.extent_map(ino)?;
        let gone = map.punch(first, end - first);
        if release(ctx, rec.project, &gone)? > 0 {
            rec.blocks = map.mapped_blocks();
            save_extents(&mut ctx.t, ino, &map)?;
        }
    }
    rec.mtime = ctx.now;
    rec.ctime = ctx.now;
    ctx.t.put_inode(ino, &rec)?;
    Ok(rec.attr(ino, ctx.block_size))
}

/// fallocate ZERO_RANGE over bytes `[offset, end)` of a regular file, as XFS does it: every
/// hole in the blocks the range touches gets Unwritten blocks (so later writes there cannot
/// fail for space), and the Written blocks wholly inside it become Unwritten, keeping their
/// volume blocks. The caller has zeroed the partial edge blocks and holds an exclusive lock.
/// Unless `keep_size`, the file grows to `end`. Nothing changes on ENOSPC or EDQUOT.
pub fn zero_range(
    ctx: &mut Ctx<'_>,
    ino: InodeId,
    offset: u64,
    end: u64,
    keep_size: bool,
) -> Result<Attr, OpError> {
    let mut rec = ctx.t.inode(ino)?;
    rec.regular()?;
    if offset >= end {
        return err(FsError::Invalid("zero-length range".into()));
    }
    if end > MAX_FILE_SIZE {
        return err(FsError::FileTooBig);
    }
    let bs = u64::from(ctx.block_size);
    // The only step that can fail comes first, and changes nothing when it does.
    let mut map = allocate_blocks(ctx, ino, &mut rec, offset / bs, end.div_ceil(bs), true)?;
    let (first_full, end_full) = (offset.div_ceil(bs), end / bs);
    if first_full < end_full {
        // The Written blocks turned Unwritten keep the file's old bytes on the LUNs: zeroed
        // like fresh blocks before a client is granted them.
        let converted: Vec<(u64, u64)> = map
            .lookup(first_full, end_full - first_full)
            .into_iter()
            .filter_map(|p| match p {
                Piece::Mapped(e) if e.state == ExtentState::Written => {
                    Some((e.vol_block, e.len_blocks))
                }
                _ => None,
            })
            .collect();
        if map.convert_to_unwritten(first_full, end_full - first_full) > 0 {
            save_extents(&mut ctx.t, ino, &map)?;
            for (vb, l) in converted {
                ctx.mark_unzeroed(vb, l)?;
            }
        }
    }
    if !keep_size && end > rec.size {
        rec.size = end;
    }
    rec.mtime = ctx.now;
    rec.ctime = ctx.now;
    ctx.t.put_inode(ino, &rec)?;
    Ok(rec.attr(ino, ctx.block_size))
}

/// Frees the Unwritten blocks of file blocks `[first, last)` that lie wholly past the end of
/// file: what a write grant allocated but never completed (its session expired), so that an
/// abandoned write does not keep space past EOF. Written blocks and blocks inside the file
/// are left alone (inside the file, Unwritten blocks read as zeros, as they must).
pub fn trim_unwritten_past_eof(
    ctx: &mut Ctx<'_>,
    ino: InodeId,
    first: u64,
    last: u64,
) -> Result<u64, OpError> {
    let Some(mut rec) = ctx.t.try_inode(ino)? else {
        return Ok(0); // the file is gone: its blocks went with it
    };
    let bs = u64::from(ctx.block_size);
    let first = first.max(rec.size.div_ceil(bs));
    if last <= first {
        return Ok(0);
    }
    let mut map = ctx.t.extent_map(ino)?;
    let unwritten: Vec<(u64, u64)> = map
        .lookup(first, last - first)
        .into_iter()
        .filter_map(|p| match p {
            Piece::Mapped(e) if e.state == ExtentState::Unwritten => {
                Some((e.file_block, e.len_blocks))
            }
            _ => None,
        })
        .collect();
    let gone: Vec<Extent> = unwritten
        .into_iter()
        .flat_map(|(fb, len)| map.punch(fb, len))
        .collect();
    let freed = release(ctx, rec.project, &gone)?;
    if freed > 0 {
        rec.blocks = map.mapped_blocks();
        save_extents(&mut ctx.t, ino, &map)?;
        ctx.t.put_inode(ino, &rec)?;
    }
    Ok(freed)
}
