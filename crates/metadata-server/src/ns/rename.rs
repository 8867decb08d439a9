//! rename in all its modes (replace, no-replace, exchange).

use super::*;

/// Whether `ancestor` is `ino` or one of its ancestors (walking `..` up to the root).
fn is_ancestor(t: &WriteTables<'_>, ancestor: InodeId, mut ino: InodeId) -> Result<bool, OpError> {
    for _ in 0..100_000 {
        if ino == ancestor {
            return Ok(true);
        }
        if ino == InodeId(ROOT) {
            return Ok(false);
        }
        ino = InodeId(t.inode(ino)?.parent);
    }
    Err(crate::store::corrupt(
        "directory tree",
        "a parent chain does not reach the root",
    ))
}

pub fn rename(ctx: &mut Ctx<'_>, r: &RenameRequest) -> Result<(), OpError> {
    let (op, on, np, nn) = (
        r.old_parent,
        r.old_name.as_bytes(),
        r.new_parent,
        r.new_name.as_bytes(),
    );
    let cred = &r.cred;
    let mut w = Working::new();
    let odir = w.load(&ctx.t, op)?.clone();
    let ndir = w.load(&ctx.t, np)?.clone();
    for d in [&odir, &ndir] {
        if !d.is_dir() {
            return err(FsError::NotDir);
        }
        check(cred, d, MAY_EXEC)?;
    }
    let (src, _, skind) = ctx
        .t
        .dirent(op, on)?
        .ok_or(OpError::Fs(FsError::NotFound))?;
    let dst = ctx.t.dirent(np, nn)?;
    for d in [&odir, &ndir] {
        check(cred, d, MAY_WRITE | MAY_EXEC)?;
    }
    let srec = w.load(&ctx.t, src)?.clone();
    if !sticky_allows(cred, &odir, &srec) {
        return err(FsError::Perm);
    }
    // Across directory quotas a rename is a move between file systems: EXDEV (mv copies).
    if op != np
        && crate::quota::child_project(ctx, op.0, &odir)?
            != crate::quota::child_project(ctx, np.0, &ndir)?
    {
        return err(FsError::CrossDevice);
    }
    let src_is_dir = skind == FileType::Directory;
    if src_is_dir && is_ancestor(&ctx.t, src, np)? {
        return err(FsError::Invalid(
            "cannot move a directory into itself".into(),
        ));
    }
    let now = ctx.now;
    match (r.mode, dst) {
        (RenameMode::NoReplace, Some(_)) => err(FsError::Exists),
        (RenameMode::Exchange, None) => err(FsError::NotFound),
        (RenameMode::Exchange, Some((dino, _, dkind))) => {
            let drec = w.load(&ctx.t, dino)?.clone();
            if !sticky_allows(cred, &ndir, &drec) {
                return err(FsError::Perm);
            }
            let dst_is_dir = dkind == FileType::Directory;
            if dst_is_dir && is_ancestor(&ctx.t, dino, op)? {
                return err(FsError::Invalid(
                    "cannot move a directory into itself".into(),
                ));
            }
            if op != np {
                for (is_dir, rec) in [(src_is_dir, &srec), (dst_is_dir, &drec)] {
                    if is_dir && !permits(cred, rec, MAY_WRITE) {
                        return err(FsError::Access);
                    }
                }
            }
            if src == dino {
                return Ok(());
            }
            // Swap the children of the two entries in place (cookies stay).
            let (_, ocookie, _) = ctx
                .t
                .dirent(op, on)?
                .ok_or(OpError::Fs(FsError::NotFound))?;
            let (_, ncookie, _) = ctx
                .t
                .dirent(np, nn)?
                .ok_or(OpError::Fs(FsError::NotFound))?;
            ctx.t
                .dirents
                .insert((op.0, on), (dino.0, ocookie, kind_code(dkind)))?;
            ctx.t
                .dirents
                .insert((np.0, nn), (src.0, ncookie, kind_code(skind)))?;
            if op != np {
                if src_is_dir {
                    w.get(src)?.parent = np.0;
                    w.get(op)?.nlink -= 1;
                    w.get(np)?.nlink += 1;
                }
                if dst_is_dir {
                    w.get(dino)?.parent = op.0;
                    w.get(np)?.nlink -= 1;
                    w.get(op)?.nlink += 1;
                }
            }
            w.get(src)?.ctime = now;
            w.get(dino)?.ctime = now;
            touch_dir(w.get(op)?, now);
            touch_dir(w.get(np)?, now);
            w.flush(&mut ctx.t)?;
            Ok(())
        }
        (_, dst) => {
            if dst.is_some_and(|(dino, _, _)| dino == src) {
                // Two names of one inode (or the same name): POSIX says do nothing.
                return Ok(());
            }
            if src_is_dir && op != np && !permits(cred, &srec, MAY_WRITE) {
                return err(FsError::Access);
            }
            if let Some((dino, _, dkind)) = dst {
                let drec = w.load(&ctx.t, dino)?.clone();
                // As in unlink: the sticky rule before the target's type and emptiness.
                if !sticky_allows(cred, &ndir, &drec) {
                    return err(FsError::Perm);
                }
                match (src_is_dir, dkind == FileType::Directory) {
                    (true, false) => return err(FsError::NotDir),
                    (false, true) => return err(FsError::IsDir),
                    (true, true) if drec.size != 0 => return err(FsError::NotEmpty),
                    _ => {}
                }
                if dkind == FileType::Directory && is_ancestor(&ctx.t, dino, op)? {
                    return err(FsError::NotEmpty);
                }
            } else if src_is_dir && op != np && ndir.nlink >= LINK_MAX {
                return err(FsError::TooManyLinks);
            }
            // All checks done: change.
            if let Some((dino, _, dkind)) = dst {
                let mut nd = w.get(np)?.clone();
                remove_entry(&mut ctx.t, np, &mut nd, nn)?;
                if dkind == FileType::Directory {
                    nd.nlink -= 1;
                }
                *w.get(np)? = nd;
                let d = w.get(dino)?;
                d.ctime = now;
                d.nlink = if dkind == FileType::Directory {
                    0
                } else {
                    d.nlink.saturating_sub(1)
                };
            }
            let mut od = w.get(op)?.clone();
            remove_entry(&mut ctx.t, op, &mut od, on)?;
            if src_is_dir && op != np {
                od.nlink -= 1;
            }
            touch_dir(&mut od, now);
            *w.get(op)? = od;
            let mut nd = w.get(np)?.clone();
            add_entry(&mut ctx.t, np, &mut nd, nn, src, skind)?;
            if src_is_dir && op != np {
                nd.nlink += 1;
            }
            touch_dir(&mut nd, now);
            *w.get(np)? = nd;
            let s = w.get(src)?;
            s.ctime = now;
            if src_is_dir {
                s.parent = np.0;
            }
            let unlinked = w.flush(&mut ctx.t)?;
            dispose(ctx, unlinked)
        }
    }
}
