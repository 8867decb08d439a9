//! Making inodes and entries: mkdir, mknod, symlink, create, link, and open.

use super::*;

/// A new inode's group: the directory's with setgid directories (BSD semantics), else the
/// caller's primary group.
fn new_owner(cred: &Credentials, dir: &InodeRec) -> (u32, u32) {
    let gid = if dir.perm & S_ISGID != 0 {
        dir.gid
    } else {
        cred.gid
    };
    (cred.uid, gid)
}

fn new_inode(
    ctx: &mut Ctx<'_>,
    cred: &Credentials,
    dir: &InodeRec,
    kind: FileType,
    perm: u32,
) -> Result<(InodeId, InodeRec), OpError> {
    let (ino, generation) = ctx.new_inode_number()?;
    let (uid, gid) = new_owner(cred, dir);
    let mut perm = perm & 0o7777;
    if kind == FileType::Directory {
        // mkdir keeps only the rwx and sticky bits asked for (Linux's vfs_mkdir); setgid
        // comes from the parent alone.
        perm &= 0o1777;
        if dir.perm & S_ISGID != 0 {
            perm |= S_ISGID;
        }
    } else if perm & S_ISGID != 0 && !cred.is_root() && !cred.in_group(gid) {
        perm &= !S_ISGID;
    }
    let now = ctx.now;
    Ok((
        InodeId(ino),
        InodeRec {
            kind,
            perm,
            uid,
            gid,
            nlink: if kind == FileType::Directory { 2 } else { 1 },
            size: 0,
            blocks: 0,
            atime: now,
            mtime: now,
            ctime: now,
            btime: now,
            rdev: 0,
            generation,
            parent: 0,
            next_cookie: 0,
            target: Vec::new(),
            project: 0,
        },
    ))
}

/// Checks for adding `name` to directory `parent`: returns the directory.
fn creatable(
    t: &WriteTables<'_>,
    cred: &Credentials,
    parent: InodeId,
    name: &[u8],
) -> Result<InodeRec, OpError> {
    let dir = t.inode(parent)?;
    if !dir.is_dir() {
        return err(FsError::NotDir);
    }
    check(cred, &dir, MAY_EXEC)?;
    if t.dirent(parent, name)?.is_some() {
        return err(FsError::Exists);
    }
    check(cred, &dir, MAY_WRITE | MAY_EXEC)?;
    if dir.nlink == 0 {
        // Removed while someone still had it as their working directory.
        return err(FsError::NotFound);
    }
    Ok(dir)
}

/// Makes a new non-directory or directory entry: the shared tail of mkdir, mknod, symlink
/// and create.
fn make_node(
    ctx: &mut Ctx<'_>,
    cred: &Credentials,
    parent: InodeId,
    name: &FileName,
    kind: FileType,
    perm: u32,
    fill: impl FnOnce(&mut InodeRec),
) -> Result<(InodeId, InodeRec), OpError> {
    let mut dir = creatable(&ctx.t, cred, parent, name.as_bytes())?;
    if kind == FileType::Directory && dir.nlink >= LINK_MAX {
        return err(FsError::TooManyLinks);
    }
    let project = crate::quota::child_project(ctx, parent.0, &dir)?;
    crate::quota::check(ctx, project, 0, 1)?;
    let (ino, mut rec) = new_inode(ctx, cred, &dir, kind, perm)?;
    rec.project = project;
    crate::quota::apply(ctx, project, 0, 1)?;
    fill(&mut rec);
    if kind == FileType::Directory {
        rec.parent = parent.0;
        rec.next_cookie = FIRST_DIR_COOKIE;
        dir.nlink += 1;
    }
    add_entry(&mut ctx.t, parent, &mut dir, name.as_bytes(), ino, kind)?;
    touch_dir(&mut dir, ctx.now);
    ctx.t.put_inode(parent, &dir)?;
    ctx.t.put_inode(ino, &rec)?;
    Ok((ino, rec))
}

pub fn mkdir(ctx: &mut Ctx<'_>, r: &MkdirRequest) -> Result<Attr, OpError> {
    let (ino, rec) = make_node(
        ctx,
        &r.cred,
        r.parent,
        &r.name,
        FileType::Directory,
        r.perm,
        |_| {},
    )?;
    let mut attr = rec.attr(ino, ctx.block_size);
    // A new inode has no extended attribute (only SetXattr adds one): its maker's agent
    // may then answer its `chmod` itself (docs/protocol.md "Unlinks and renames answered
    // by the agent").
    attr.no_xattrs = true;
    Ok(attr)
}

pub fn mknod(ctx: &mut Ctx<'_>, r: &MknodRequest) -> Result<Attr, OpError> {
    match r.kind {
        FileType::Fifo | FileType::Socket | FileType::Regular => {}
        FileType::CharDevice | FileType::BlockDevice => {
            if !r.cred.is_root() {
                return err(FsError::Perm);
            }
        }
        FileType::Directory | FileType::Symlink => {
            return err(FsError::Invalid(
                "mknod makes no directories or symlinks".into(),
            ));
        }
    }
    let rdev = r.rdev;
    let (ino, rec) = make_node(ctx, &r.cred, r.parent, &r.name, r.kind, r.perm, |rec| {
        rec.rdev = rdev
    })?;
    Ok(rec.attr(ino, ctx.block_size))
}

pub fn symlink(ctx: &mut Ctx<'_>, r: &SymlinkRequest) -> Result<Attr, OpError> {
    let target = r.target.as_bytes().to_vec();
    let (ino, rec) = make_node(
        ctx,
        &r.cred,
        r.parent,
        &r.name,
        FileType::Symlink,
        0o777,
        |rec| {
            rec.size = target.len() as u64;
            rec.target = target;
        },
    )?;
    Ok(rec.attr(ino, ctx.block_size))
}

/// Permission to open `rec` with `flags`.
fn open_check(cred: &Credentials, rec: &InodeRec, flags: &OpenFlags) -> Result<(), OpError> {
    if rec.is_dir() && (flags.write || flags.truncate) {
        return err(FsError::IsDir);
    }
    if rec.kind == FileType::Symlink {
        return err(FsError::Invalid("cannot open a symlink".into()));
    }
    let mut mask = 0;
    if flags.read {
        mask |= MAY_READ;
    }
    if flags.write || flags.truncate {
        mask |= MAY_WRITE;
    }
    check(cred, rec, mask)
}

/// How far an agent's time for a create it answered may lie behind the server's clock
/// (its creates may wait that long for a restarted server) and ahead of it (clock skew).
const AGENT_TIME_BEHIND: i64 = 3_600;
const AGENT_TIME_AHEAD: i64 = 1;

/// The time a create its agent answered is made with: the agent's, which its application
/// saw as the file's times, moved into [`AGENT_TIME_BEHIND`] before and [`AGENT_TIME_AHEAD`]
/// after the server's clock.
pub fn agent_time(now: Timestamp, agent: Timestamp) -> Timestamp {
    let bound = |sec: i64| Timestamp {
        sec,
        nsec: now.nsec,
    };
    agent.clamp(
        bound(now.sec.saturating_sub(AGENT_TIME_BEHIND)),
        bound(now.sec.saturating_add(AGENT_TIME_AHEAD)),
    )
}

/// Create: the new file with the agent's time when it gives one ([`agent_time`]), and the
/// parent's change too unless the parent changed later than that (clocks that disagree, or
/// a replay after a restart): its times never go back. The batch's clock otherwise.
pub fn create(ctx: &mut Ctx<'_>, r: &CreateRequest) -> Result<CreateReply, OpError> {
    let Some(t) = r.time else {
        return create_now(ctx, r);
    };
    let now = ctx.now;
    let before = ctx.t.inode(r.parent).ok().map(|dir| (dir.mtime, dir.ctime));
    ctx.now = agent_time(now, t);
    let made = create_now(ctx, r);
    let t = ctx.now;
    ctx.now = now;
    let made = made?;
    if let Some((mtime, ctime)) = before.filter(|(m, c)| *m > t || *c > t) {
        let mut dir = ctx.t.inode(r.parent)?;
        dir.mtime = dir.mtime.max(mtime);
        dir.ctime = dir.ctime.max(ctime);
        ctx.t.put_inode(r.parent, &dir)?;
    }
    Ok(made)
}

fn create_now(ctx: &mut Ctx<'_>, r: &CreateRequest) -> Result<CreateReply, OpError> {
    let existing = {
        let dir = ctx.t.inode(r.parent)?;
        if !dir.is_dir() {
            return err(FsError::NotDir);
        }
        check(&r.cred, &dir, MAY_EXEC)?;
        ctx.t.dirent(r.parent, r.name.as_bytes())?
    };
    let (ino, rec, created) = match existing {
        Some(_) if r.exclusive => return err(FsError::Exists),
        Some((child, _, _)) => {
            let mut rec = ctx.t.inode(child)?;
            open_check(&r.cred, &rec, &r.flags)?;
            if r.flags.truncate && rec.kind == FileType::Regular {
                truncate(ctx, child, &mut rec, 0)?;
                ctx.t.put_inode(child, &rec)?;
            }
            (child, rec, false)
        }
        None => {
            let (ino, rec) = make_node(
                ctx,
                &r.cred,
                r.parent,
                &r.name,
                FileType::Regular,
                r.perm,
                |_| {},
            )?;
            (ino, rec, true)
        }
    };
    let mut handles = ctx.st.handles.lock().unwrap_or_else(|p| p.into_inner());
    let handle = match r.inode {
        // Made with the number its agent reserved: opened under the handle it knows already.
        Some(reserved) => {
            let h = sanfs_proto::model::reserved_create_handle(reserved).0;
            handles.open_as(h, ino.0, r.session.0, r.flags.write);
            h
        }
        None => handles.open(ino.0, r.session.0, r.flags.write),
    };
    drop(handles);
    Ok(CreateReply {
        attr: rec.attr(ino, ctx.block_size),
        handle: sanfs_proto::types::OpenHandle(handle),
        created,
        lease_ms: 0,
        delegation: None,
    })
}

/// Open; a write job only when it truncates (otherwise [`open_check_only`] on a snapshot).
pub fn open(ctx: &mut Ctx<'_>, r: &OpenRequest) -> Result<OpenReply, OpError> {
    let mut rec = ctx.t.inode(r.inode)?;
    open_check(&r.cred, &rec, &r.flags)?;
    if r.flags.truncate && rec.kind == FileType::Regular {
        truncate(ctx, r.inode, &mut rec, 0)?;
        ctx.t.put_inode(r.inode, &rec)?;
    }
    let handle = ctx
        .st
        .handles
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .open(r.inode.0, r.session.0, r.flags.write);
    Ok(OpenReply {
        handle: sanfs_proto::types::OpenHandle(handle),
        attr: rec.attr(r.inode, ctx.block_size),
        data: None,
        lease_ms: 0,
    })
}

/// Checks an open without truncation: the caller then registers the handle.
pub fn open_check_only<R: ReaderInodes>(
    t: &R,
    block_size: u32,
    r: &OpenRequest,
) -> Result<Attr, OpError> {
    let rec = t.inode_rec(r.inode)?;
    open_check(&r.cred, &rec, &r.flags)?;
    Ok(rec.attr(r.inode, block_size))
}

pub fn link(ctx: &mut Ctx<'_>, r: &LinkRequest) -> Result<Attr, OpError> {
    let src = ctx.t.inode(r.inode)?;
    if src.is_dir() {
        return err(FsError::Perm);
    }
    let mut dir = creatable(&ctx.t, &r.cred, r.new_parent, r.new_name.as_bytes())?;
    if crate::quota::child_project(ctx, r.new_parent.0, &dir)? != src.project {
        return err(FsError::CrossDevice);
    }
    if src.nlink >= LINK_MAX {
        return err(FsError::TooManyLinks);
    }
    if src.nlink == 0 {
        return err(FsError::NotFound);
    }
    let now = ctx.now;
    add_entry(
        &mut ctx.t,
        r.new_parent,
        &mut dir,
        r.new_name.as_bytes(),
        r.inode,
        src.kind,
    )?;
    touch_dir(&mut dir, now);
    ctx.t.put_inode(r.new_parent, &dir)?;
    // Re-read: the new parent may be... never the source (a directory), so no alias here.
    let mut src = src;
    src.nlink += 1;
    src.ctime = now;
    ctx.t.put_inode(r.inode, &src)?;
    Ok(src.attr(r.inode, ctx.block_size))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_agents_time_is_kept_within_its_bounds() {
        let now = Timestamp {
            sec: 1_000_000,
            nsec: 500,
        };
        let at = |sec: i64, nsec: u32| Timestamp { sec, nsec };
        assert_eq!(agent_time(now, at(999_990, 7)), at(999_990, 7));
        assert_eq!(agent_time(now, at(1_000_000, 900)), at(1_000_000, 900));
        assert_eq!(agent_time(now, at(996_400, 500)), at(996_400, 500));
        assert_eq!(agent_time(now, at(996_400, 499)), at(996_400, 500));
        assert_eq!(agent_time(now, at(0, 0)), at(996_400, 500));
        assert_eq!(agent_time(now, at(1_000_001, 500)), at(1_000_001, 500));
        assert_eq!(agent_time(now, at(i64::MAX, 0)), at(1_000_001, 500));
        assert_eq!(agent_time(now, at(i64::MIN, 0)), at(996_400, 500));
    }
}
