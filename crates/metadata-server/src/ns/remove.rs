//! Removing entries (unlink, rmdir) and inodes: an inode whose last link goes is destroyed,
//! or kept as an orphan while it is open and destroyed at its last close.

use super::*;

/// Frees everything an inode owns and deletes it (its last link and last handle are gone).
pub fn destroy_inode(ctx: &mut Ctx<'_>, ino: InodeId) -> Result<(), OpError> {
    let project = ctx.t.try_inode(ino)?.map(|r| r.project).unwrap_or(0);
    let extents = ctx.t.extents(ino)?;
    space::release(ctx, project, &extents)?;
    crate::quota::apply(ctx, project, 0, -1)?;
    // A quota directory going away takes its quota with it.
    ctx.quotas.remove(ino.0)?;
    ctx.t.extents.remove(ino.0)?;
    let mut names: Vec<Vec<u8>> = Vec::new();
    for item in ctx.t.xattrs.range((ino.0, &[][..])..)? {
        let (k, _) = item?;
        let (owner, name) = k.value();
        if owner != ino.0 {
            break;
        }
        names.push(name.to_vec());
    }
    for n in names {
        ctx.t.xattrs.remove((ino.0, n.as_slice()))?;
    }
    ctx.t.inodes.remove(ino.0)?;
    ctx.orphans.remove(ino.0)?;
    ctx.prealloc.remove(ino.0)?;
    ctx.st
        .usage
        .inodes
        .fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    Ok(())
}

/// Inodes whose last link went in this change: destroyed now, or kept as orphans while open.
/// The sessions holding an orphan open are recorded (the `sessions` table, in this same
/// transaction): after a restart the reclaim window waits for their agents, which open the
/// file again under their new sessions before the recovery reaps orphans nobody holds
/// (`crate::reclaim`).
pub(super) fn dispose(ctx: &mut Ctx<'_>, unlinked: Vec<InodeId>) -> Result<(), OpError> {
    for ino in unlinked {
        let holders = ctx
            .st
            .handles
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .sessions_of(ino.0);
        if holders.is_empty() && !ctx.replaying {
            destroy_inode(ctx, ino)?;
        } else {
            ctx.orphans.insert(ino.0, ())?;
            let epoch = ctx.boot_epoch()?;
            for session in holders {
                ctx.sessions.insert(session, epoch)?;
            }
        }
    }
    Ok(())
}

/// Last close of a handle: an orphan whose last handle this was is destroyed.
pub fn release_orphan(ctx: &mut Ctx<'_>, ino: InodeId) -> Result<(), OpError> {
    let orphan = ctx.orphans.get(ino.0)?.is_some();
    let open = ctx
        .st
        .handles
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .is_open(ino.0);
    if orphan && !open {
        destroy_inode(ctx, ino)?;
    }
    Ok(())
}

pub fn unlink(ctx: &mut Ctx<'_>, r: &EntryRequest, want_dir: bool) -> Result<(), OpError> {
    let parent = r.parent;
    let mut w = Working::new();
    let dir = w.load(&ctx.t, parent)?.clone();
    if !dir.is_dir() {
        return err(FsError::NotDir);
    }
    check(&r.cred, &dir, MAY_EXEC)?;
    let (child, _, kind) = ctx
        .t
        .dirent(parent, r.name.as_bytes())?
        .ok_or(OpError::Fs(FsError::NotFound))?;
    check(&r.cred, &dir, MAY_WRITE | MAY_EXEC)?;
    let victim = w.load(&ctx.t, child)?.clone();
    // Linux's order (may_delete): the sticky rule, then the victim's type, then emptiness.
    if !sticky_allows(&r.cred, &dir, &victim) {
        return err(FsError::Perm);
    }
    match (want_dir, kind == FileType::Directory) {
        (true, false) => return err(FsError::NotDir),
        (false, true) => return err(FsError::IsDir),
        _ => {}
    }
    if want_dir && victim.size != 0 {
        return err(FsError::NotEmpty);
    }
    let now = ctx.now;
    {
        let d = w.get(parent)?;
        let mut d2 = d.clone();
        remove_entry(&mut ctx.t, parent, &mut d2, r.name.as_bytes())?;
        touch_dir(&mut d2, now);
        if want_dir {
            d2.nlink -= 1;
        }
        *d = d2;
    }
    let v = w.get(child)?;
    v.ctime = now;
    if want_dir {
        v.nlink = 0;
    } else {
        v.nlink = v.nlink.saturating_sub(1);
    }
    let unlinked = w.flush(&mut ctx.t)?;
    dispose(ctx, unlinked)
}
