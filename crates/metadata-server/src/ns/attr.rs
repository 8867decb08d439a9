//! Attributes: setattr (with truncate), extended attributes, and fallocate's allocation.

use super::*;

/// Cuts or extends a regular file to `size` bytes: blocks wholly past the new end are freed,
/// and mtime/ctime are set. The caller writes `rec`.
///
/// A cut to a size that is not block aligned leaves the old bytes in the tail of the last
/// block; whatever later extends the file zeroes them on the device first, under its range
/// lock (`DataPath::zero_eof_tail`, XFS's `xfs_zero_eof`), so they are never read back.
pub fn truncate(
    ctx: &mut Ctx<'_>,
    ino: InodeId,
    rec: &mut InodeRec,
    size: u64,
) -> Result<(), OpError> {
    if size > MAX_FILE_SIZE {
        return err(FsError::FileTooBig);
    }
    let bs = u64::from(ctx.block_size);
    if size < rec.size {
        let first_gone = size.div_ceil(bs);
        let mut map = ctx.t.extent_map(ino)?;
        let gone = map.truncate(first_gone);
        space::release(ctx, rec.project, &gone)?;
        rec.blocks = map.mapped_blocks();
        space::save_extents(&mut ctx.t, ino, &map)?;
    }
    rec.size = size;
    rec.mtime = ctx.now;
    rec.ctime = ctx.now;
    Ok(())
}

/// What a chown, or a truncate or write by a caller without CAP_FSETID, does to a file
/// ([`sanfs_proto::types::cleared_setid`]).
fn kill_suid_sgid(rec: &mut InodeRec) {
    rec.perm = sanfs_proto::types::cleared_setid(rec.perm);
}

/// Removes the file capabilities (`security.capability`) of `ino`, as the kernel does at a
/// chown, a truncate or a write of a file (by anyone: a changed binary keeps no capability).
/// A read first: it runs at every write completion, and almost no file has one.
pub fn kill_capability(ctx: &mut Ctx<'_>, ino: InodeId) -> Result<(), OpError> {
    let key = (ino.0, b"security.capability".as_slice());
    if ctx.t.xattrs.get(key)?.is_some() {
        ctx.t.xattrs.remove(key)?;
    }
    Ok(())
}

/// Whether `r`'s changes are allowed on the inode whose record is `rec` (what [`setattr`]
/// checks before it changes anything; a proxied write with attribute changes checks them
/// before it writes). `by_write_handle`: whether `r.handle` is an open write handle of the
/// inode (asked only for a size change).
pub fn setattr_allowed(
    r: &SetAttrRequest,
    rec: &InodeRec,
    by_write_handle: impl FnOnce() -> bool,
) -> Result<(), OpError> {
    let cred = &r.cred;
    let c = &r.changes;
    if c.perm.is_some() && !is_owner(cred, rec) {
        return err(FsError::Perm);
    }
    if let Some(uid) = c.uid {
        if uid != rec.uid && !cred.is_root() {
            return err(FsError::Perm);
        }
        if !is_owner(cred, rec) {
            return err(FsError::Perm);
        }
    }
    if c.gid.is_some_and(|gid| {
        !cred.is_root() && (cred.uid != rec.uid || (gid != rec.gid && !cred.in_group(gid)))
    }) {
        return err(FsError::Perm);
    }
    if let Some(size) = c.size {
        match rec.kind {
            FileType::Regular => {}
            FileType::Directory => return err(FsError::IsDir),
            _ => {
                return err(FsError::Invalid(
                    "only regular files have a size to set".into(),
                ));
            }
        }
        if size > MAX_FILE_SIZE {
            return err(FsError::FileTooBig);
        }
        if !by_write_handle() {
            check(cred, rec, MAY_WRITE)?;
        }
    }
    for t in [c.atime, c.mtime].into_iter().flatten() {
        match t {
            TimeSet::At(_) if !is_owner(cred, rec) => return err(FsError::Perm),
            TimeSet::Now if !is_owner(cred, rec) && !permits(cred, rec, MAY_WRITE) => {
                return err(FsError::Access);
            }
            _ => {}
        }
    }
    if c.ctime.is_some() && !is_owner(cred, rec) {
        return err(FsError::Perm);
    }
    Ok(())
}

pub fn setattr(ctx: &mut Ctx<'_>, r: &SetAttrRequest) -> Result<Attr, OpError> {
    let ino = r.inode;
    let cred = &r.cred;
    let c = &r.changes;
    let mut rec = ctx.t.inode(ino)?;
    let now = ctx.now;
    setattr_allowed(r, &rec, || {
        r.handle.as_ref().is_some_and(|h| {
            ctx.st
                .handles
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .writes(h.handle.0, ino.0)
        })
    })?;
    // --- changes ---
    let changed = *c != sanfs_proto::types::SetAttr::default();
    if let Some(perm) = c.perm {
        let mut perm = perm & 0o7777;
        if !cred.is_root() && !cred.in_group(rec.gid) && c.gid.is_none() {
            perm &= !S_ISGID;
        }
        rec.perm = perm;
    }
    if c.uid.is_some() || c.gid.is_some() {
        if let Some(uid) = c.uid {
            rec.uid = uid;
        }
        if let Some(gid) = c.gid {
            rec.gid = gid;
        }
        if !rec.is_dir() {
            kill_suid_sgid(&mut rec);
            kill_capability(ctx, ino)?;
        }
    }
    if let Some(size) = c.size {
        truncate(ctx, ino, &mut rec, size)?;
        // As the kernel does for a truncate (the mount leaves it to the file system,
        // `FUSE_HANDLE_KILLPRIV_V2`): setuid/setgid go unless the caller is root (CAP_FSETID),
        // file capabilities go in any case.
        if !cred.is_root() {
            kill_suid_sgid(&mut rec);
        }
        kill_capability(ctx, ino)?;
    }
    let at = |t: TimeSet| match t {
        TimeSet::Now => now,
        TimeSet::At(ts) => ts,
    };
    if let Some(t) = c.atime {
        rec.atime = at(t);
    }
    if let Some(t) = c.mtime {
        rec.mtime = at(t);
    }
    if changed {
        rec.ctime = c.ctime.unwrap_or(now);
        ctx.t.put_inode(ino, &rec)?;
    }
    Ok(rec.attr(ino, ctx.block_size))
}

/// Most bytes of extended attribute names one inode holds, counting a NUL after each (Linux
/// `XATTR_LIST_MAX`): the list of any inode's names always fits in a listxattr reply.
pub const XATTR_NAMES_MAX_PER_INODE: usize = 65536;

/// Most bytes of extended attribute values one inode holds, all its attributes together (one
/// value of the largest size, `XATTR_SIZE_MAX`, or many smaller ones).
pub const XATTR_VALUES_MAX_PER_INODE: usize = 65536;

/// Sets an extended attribute. ENOSPC, with nothing changed, when the inode's names or values
/// would pass [`XATTR_NAMES_MAX_PER_INODE`] or [`XATTR_VALUES_MAX_PER_INODE`] (a replaced
/// value counts with its new size only).
pub fn setxattr(ctx: &mut Ctx<'_>, r: &SetXattrRequest) -> Result<(), OpError> {
    let ino = r.inode;
    let mut rec = ctx.t.inode(ino)?;
    xattr_access(&r.cred, &rec, r.name.as_bytes(), true)?;
    let (mut exists, mut names_len, mut values_len) = (false, 0usize, 0usize);
    for item in ctx.t.xattrs.range((ino.0, &[][..])..)? {
        let (k, v) = item?;
        let (owner, name) = k.value();
        if owner != ino.0 {
            break;
        }
        if name == r.name.as_bytes() {
            exists = true;
            continue;
        }
        names_len = names_len.saturating_add(name.len() + 1);
        values_len = values_len.saturating_add(v.value().len());
    }
    match (r.mode, exists) {
        (XattrMode::Create, true) => return err(FsError::Exists),
        (XattrMode::Replace, false) => return err(FsError::NoAttr),
        _ => {}
    }
    if names_len.saturating_add(r.name.as_bytes().len() + 1) > XATTR_NAMES_MAX_PER_INODE
        || values_len.saturating_add(r.value.len()) > XATTR_VALUES_MAX_PER_INODE
    {
        return err(FsError::NoSpace);
    }
    ctx.t
        .xattrs
        .insert((ino.0, r.name.as_bytes()), r.value.as_slice())?;
    rec.ctime = ctx.now;
    ctx.t.put_inode(ino, &rec)
}

pub fn removexattr(ctx: &mut Ctx<'_>, r: &XattrRequest) -> Result<(), OpError> {
    let ino = r.inode;
    let mut rec = ctx.t.inode(ino)?;
    xattr_access(&r.cred, &rec, r.name.as_bytes(), true)?;
    if ctx.t.xattrs.remove((ino.0, r.name.as_bytes()))?.is_none() {
        return err(FsError::NoAttr);
    }
    rec.ctime = ctx.now;
    ctx.t.put_inode(ino, &rec)
}

/// Allocates Unwritten extents for every hole in `[offset, offset + len)` of a regular file
/// (fallocate mode 0). With `keep_size` false the file grows to cover the range. Returns the
/// new attributes.
pub fn allocate_range(
    ctx: &mut Ctx<'_>,
    cred: &Credentials,
    ino: InodeId,
    offset: u64,
    len: u64,
    keep_size: bool,
) -> Result<Attr, OpError> {
    let mut rec = ctx.t.inode(ino)?;
    rec.regular()?;
    check(cred, &rec, MAY_WRITE)?;
    let end = offset
        .checked_add(len)
        .filter(|e| *e <= MAX_FILE_SIZE)
        .ok_or(OpError::Fs(FsError::FileTooBig))?;
    if len == 0 {
        return err(FsError::Invalid("zero-length allocation".into()));
    }
    let bs = u64::from(ctx.block_size);
    let map = space::allocate_blocks(ctx, ino, &mut rec, offset / bs, end.div_ceil(bs), true)?;
    drop(map);
    if !keep_size && end > rec.size {
        rec.size = end;
        rec.mtime = ctx.now;
    }
    rec.ctime = ctx.now;
    ctx.t.put_inode(ino, &rec)?;
    Ok(rec.attr(ino, ctx.block_size))
}
