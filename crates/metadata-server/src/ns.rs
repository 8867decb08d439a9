//! The namespace: POSIX semantics over the store's tables.
//!
//! Reads (`lookup`, `getattr`, `readdir`, ...) take any [`Tables`] view; changes take the
//! committer's [`Ctx`] and follow the store's one rule: check everything that can fail first,
//! then change. Multi-inode changes (rename, link, unlink) load the inodes they touch into a
//! [`Working`] set, change them there, and write each once at the end, so that aliases (a
//! rename inside one directory, a hard link to itself) can never write a stale copy over a
//! fresh one.
//!
//! Permission rules are Linux's: owner/group/other bits against the caller's uid, gid and
//! supplementary groups; root bypasses read and write checks and needs one execute bit for
//! search on a non-directory; sticky directories let only the owner of the entry, the owner of
//! the directory or root remove or rename it (EPERM otherwise).

use std::collections::HashMap;

use redb::ReadableTable;
use sanfs_blockmap::codec;
use sanfs_blockmap::extent::{Extent, ExtentMap, ExtentState};
use sanfs_proto::model::{
    CreateReply, CreateRequest, DirEntry, EntryRequest, FIRST_DIR_COOKIE, LinkRequest,
    MkdirRequest, MknodRequest, OpenFlags, OpenReply, OpenRequest, ReadDirReply, ReadDirRequest,
    RenameRequest, SetAttrRequest, SetXattrRequest, SymlinkRequest, XattrRequest,
};
use sanfs_proto::types::{
    Attr, Credentials, FileName, FileType, FsError, InodeId, MAX_FILE_SIZE, RenameMode, TimeSet,
    Timestamp, XattrMode,
};

use crate::store::records::{InodeRec, kind_code};
use crate::store::{Ctx, OpError, ROOT, Tables, WriteTables};

/// Most hard links to one inode.
pub const LINK_MAX: u32 = 65000;
/// Most extents one allocation may be split into.
const MAX_ALLOC_EXTENTS: usize = 64;

const MAY_READ: u32 = 4;
const MAY_WRITE: u32 = 2;
const MAY_EXEC: u32 = 1;
const S_ISUID: u32 = 0o4000;
const S_ISGID: u32 = 0o2000;
const S_ISVTX: u32 = 0o1000;

fn err<T>(e: FsError) -> Result<T, OpError> {
    Err(OpError::Fs(e))
}

/// Whether `cred` may access `rec` for `mask` (a combination of read 4, write 2, exec 1).
pub fn permits(cred: &Credentials, rec: &InodeRec, mask: u32) -> bool {
    if cred.is_root() {
        return mask & MAY_EXEC == 0 || rec.is_dir() || rec.perm & 0o111 != 0;
    }
    let bits = if cred.uid == rec.uid {
        rec.perm >> 6
    } else if cred.in_group(rec.gid) {
        rec.perm >> 3
    } else {
        rec.perm
    } & 7;
    bits & mask == mask
}

fn check(cred: &Credentials, rec: &InodeRec, mask: u32) -> Result<(), OpError> {
    if permits(cred, rec, mask) {
        Ok(())
    } else {
        err(FsError::Access)
    }
}

fn is_owner(cred: &Credentials, rec: &InodeRec) -> bool {
    cred.is_root() || cred.uid == rec.uid
}

/// The sticky-directory rule for removing or renaming `victim` out of `dir`.
fn sticky_allows(cred: &Credentials, dir: &InodeRec, victim: &InodeRec) -> bool {
    dir.perm & S_ISVTX == 0 || cred.is_root() || cred.uid == dir.uid || cred.uid == victim.uid
}

/// A directory the caller may search (`x`), or ENOTDIR / EACCES.
fn searchable<I, D, C, E, X>(
    t: &Tables<I, D, C, E, X>,
    cred: &Credentials,
    dir: u64,
) -> Result<InodeRec, OpError>
where
    I: ReadableTable<u64, &'static [u8]>,
    D: ReadableTable<(u64, &'static [u8]), (u64, u64, u8)>,
    C: ReadableTable<(u64, u64), &'static [u8]>,
    E: ReadableTable<u64, &'static [u8]>,
    X: ReadableTable<(u64, &'static [u8]), &'static [u8]>,
{
    let rec = t.inode(dir)?;
    if !rec.is_dir() {
        return err(FsError::NotDir);
    }
    check(cred, &rec, MAY_EXEC)?;
    Ok(rec)
}

impl<I, D, C, E, X> Reader for Tables<I, D, C, E, X>
where
    I: ReadableTable<u64, &'static [u8]>,
    D: ReadableTable<(u64, &'static [u8]), (u64, u64, u8)>,
    C: ReadableTable<(u64, u64), &'static [u8]>,
    E: ReadableTable<u64, &'static [u8]>,
    X: ReadableTable<(u64, &'static [u8]), &'static [u8]>,
{
    fn lookup(&self, block_size: u32, r: &EntryRequest) -> Result<Attr, OpError> {
        searchable(self, &r.cred, r.parent.0)?;
        let (child, _, _) = self
            .dirent(r.parent.0, r.name.as_bytes())?
            .ok_or(OpError::Fs(FsError::NotFound))?;
        Ok(self.inode(child)?.attr(child, block_size))
    }

    fn getattr(&self, block_size: u32, ino: u64) -> Result<Attr, OpError> {
        Ok(self.inode(ino)?.attr(ino, block_size))
    }

    fn readlink(&self, ino: u64) -> Result<Vec<u8>, OpError> {
        let rec = self.inode(ino)?;
        if rec.kind != FileType::Symlink {
            return err(FsError::NotSymlink);
        }
        Ok(rec.target)
    }

    fn readdir(&self, block_size: u32, r: &ReadDirRequest) -> Result<ReadDirReply, OpError> {
        let dir = self.inode(r.inode.0)?;
        if !dir.is_dir() {
            return err(FsError::NotDir);
        }
        check(&r.cred, &dir, MAY_READ)?;
        let from = r.cookie.saturating_add(1).max(FIRST_DIR_COOKIE);
        let max = r
            .max_entries
            .clamp(1, sanfs_proto::model::MAX_READDIR_ENTRIES) as usize;
        let mut entries = Vec::new();
        let mut eof = true;
        for item in self
            .cookies
            .range((r.inode.0, from)..=(r.inode.0, u64::MAX))?
        {
            let (key, name) = item?;
            if entries.len() == max {
                eof = false;
                break;
            }
            let cookie = key.value().1;
            let name = name.value().to_vec();
            let (child, _, kind) = self.dirent(r.inode.0, &name)?.ok_or_else(|| {
                crate::store::corrupt(
                    format_args!("directory {}", r.inode.0),
                    format_args!("cookie {cookie} names a missing entry"),
                )
            })?;
            let attr = if r.plus {
                Some(self.inode(child)?.attr(child, block_size))
            } else {
                None
            };
            let name = FileName::new(name)
                .map_err(|e| crate::store::corrupt(format_args!("directory {}", r.inode.0), e))?;
            entries.push(DirEntry {
                name,
                inode: InodeId(child),
                kind,
                cookie,
                attr,
            });
        }
        Ok(ReadDirReply {
            entries,
            eof,
            parent: InodeId(dir.parent),
        })
    }

    fn getxattr(&self, r: &XattrRequest) -> Result<Vec<u8>, OpError> {
        let rec = self.inode(r.inode.0)?;
        xattr_access(&r.cred, &rec, r.name.as_bytes(), false)?;
        self.xattr(r.inode.0, r.name.as_bytes())?
            .ok_or(OpError::Fs(FsError::NoAttr))
    }

    fn listxattr(&self, cred: &Credentials, ino: u64) -> Result<Vec<Vec<u8>>, OpError> {
        self.inode(ino)?;
        let mut names = Vec::new();
        for item in self.xattrs.range((ino, &[][..])..)? {
            let (k, _) = item?;
            let (owner, name) = k.value();
            if owner != ino {
                break;
            }
            if name.starts_with(b"trusted.") && !cred.is_root() {
                continue;
            }
            names.push(name.to_vec());
        }
        Ok(names)
    }

    fn access(&self, cred: &Credentials, ino: u64, mask: u32) -> Result<(), OpError> {
        let rec = self.inode(ino)?;
        check(cred, &rec, mask & 7)
    }

    fn extent_list(&self, ino: u64) -> Result<Vec<Extent>, OpError> {
        self.inode(ino)?;
        self.extents(ino)
    }
}

/// The read-only operations, on any view of the tables.
pub trait Reader {
    fn lookup(&self, block_size: u32, r: &EntryRequest) -> Result<Attr, OpError>;
    fn getattr(&self, block_size: u32, ino: u64) -> Result<Attr, OpError>;
    fn readlink(&self, ino: u64) -> Result<Vec<u8>, OpError>;
    fn readdir(&self, block_size: u32, r: &ReadDirRequest) -> Result<ReadDirReply, OpError>;
    fn getxattr(&self, r: &XattrRequest) -> Result<Vec<u8>, OpError>;
    fn listxattr(&self, cred: &Credentials, ino: u64) -> Result<Vec<Vec<u8>>, OpError>;
    fn access(&self, cred: &Credentials, ino: u64, mask: u32) -> Result<(), OpError>;
    fn extent_list(&self, ino: u64) -> Result<Vec<Extent>, OpError>;
}

/// Who may read or change an extended attribute: `user.*` follows the file's permission bits
/// (regular files and directories only), `trusted.*` and `security.*` need root for changes,
/// `trusted.*` also for reads (ENODATA to others, as on Linux); `system.*` (ACLs) is not
/// supported.
fn xattr_access(
    cred: &Credentials,
    rec: &InodeRec,
    name: &[u8],
    write: bool,
) -> Result<(), OpError> {
    if name.starts_with(b"user.") {
        if !matches!(rec.kind, FileType::Regular | FileType::Directory) {
            return err(if write {
                FsError::Perm
            } else {
                FsError::NoAttr
            });
        }
        if rec.is_dir() && rec.perm & S_ISVTX != 0 && write && !is_owner(cred, rec) {
            return err(FsError::Perm);
        }
        return check(cred, rec, if write { MAY_WRITE } else { MAY_READ });
    }
    if name.starts_with(b"trusted.") {
        // Hidden from other callers: a read finds nothing (ENODATA), a change is EPERM.
        return if cred.is_root() {
            Ok(())
        } else if write {
            err(FsError::Perm)
        } else {
            err(FsError::NoAttr)
        };
    }
    if name.starts_with(b"security.") {
        return if !write || cred.is_root() {
            Ok(())
        } else {
            err(FsError::Perm)
        };
    }
    err(FsError::NotSupported)
}

/// The inodes a change touches, loaded once, written once.
struct Working {
    recs: HashMap<u64, InodeRec>,
    order: Vec<u64>,
    dead: Vec<u64>,
}

impl Working {
    fn new() -> Working {
        Working {
            recs: HashMap::new(),
            order: Vec::new(),
            dead: Vec::new(),
        }
    }

    fn load(&mut self, t: &WriteTables<'_>, ino: u64) -> Result<&mut InodeRec, OpError> {
        if let std::collections::hash_map::Entry::Vacant(slot) = self.recs.entry(ino) {
            slot.insert(t.inode(ino)?);
            self.order.push(ino);
        }
        self.recs
            .get_mut(&ino)
            .ok_or_else(|| OpError::Store("working set lost an inode".into()))
    }

    fn get(&mut self, ino: u64) -> Result<&mut InodeRec, OpError> {
        self.recs
            .get_mut(&ino)
            .ok_or_else(|| OpError::Store(format!("inode {ino} not loaded")))
    }

    /// Writes every live inode; returns the ones whose last link went.
    fn flush(self, t: &mut WriteTables<'_>) -> Result<Vec<u64>, OpError> {
        let mut unlinked = Vec::new();
        for ino in self.order {
            let rec = &self.recs[&ino];
            if rec.nlink == 0 || self.dead.contains(&ino) {
                unlinked.push(ino);
            }
            t.put_inode(ino, rec)?;
        }
        Ok(unlinked)
    }
}

fn touch_dir(rec: &mut InodeRec, now: Timestamp) {
    rec.mtime = now;
    rec.ctime = now;
}

fn add_entry(
    t: &mut WriteTables<'_>,
    dir: u64,
    dir_rec: &mut InodeRec,
    name: &[u8],
    child: u64,
    kind: FileType,
) -> Result<(), OpError> {
    let cookie = dir_rec.next_cookie.max(FIRST_DIR_COOKIE);
    dir_rec.next_cookie = cookie + 1;
    dir_rec.size += 1;
    t.dirents
        .insert((dir, name), (child, cookie, kind_code(kind)))?;
    t.cookies.insert((dir, cookie), name)?;
    Ok(())
}

fn remove_entry(
    t: &mut WriteTables<'_>,
    dir: u64,
    dir_rec: &mut InodeRec,
    name: &[u8],
) -> Result<(), OpError> {
    let old = t.dirents.remove((dir, name))?.map(|v| v.value());
    if let Some((_, cookie, _)) = old {
        t.cookies.remove((dir, cookie))?;
    }
    dir_rec.size = dir_rec.size.saturating_sub(1);
    Ok(())
}

/// Frees everything an inode owns and deletes it (its last link and last handle are gone).
pub fn destroy_inode(ctx: &mut Ctx<'_>, ino: u64) -> Result<(), OpError> {
    let project = ctx.t.try_inode(ino)?.map(|r| r.project).unwrap_or(0);
    let extents = ctx.t.extents(ino)?;
    let mut blocks = 0u64;
    for e in &extents {
        ctx.free_blocks(e.vol_block, e.len_blocks)?;
        blocks += e.len_blocks;
    }
    crate::quota::apply(ctx, project, -i64::try_from(blocks).unwrap_or(i64::MAX), -1)?;
    // A quota directory going away takes its quota with it.
    ctx.quotas.remove(ino)?;
    ctx.t.extents.remove(ino)?;
    let mut names: Vec<Vec<u8>> = Vec::new();
    for item in ctx.t.xattrs.range((ino, &[][..])..)? {
        let (k, _) = item?;
        let (owner, name) = k.value();
        if owner != ino {
            break;
        }
        names.push(name.to_vec());
    }
    for n in names {
        ctx.t.xattrs.remove((ino, n.as_slice()))?;
    }
    ctx.t.inodes.remove(ino)?;
    ctx.orphans.remove(ino)?;
    ctx.prealloc.remove(ino)?;
    ctx.st
        .usage
        .inodes
        .fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    Ok(())
}

/// Inodes whose last link went in this change: destroyed now, or kept as orphans while open.
fn dispose(ctx: &mut Ctx<'_>, unlinked: Vec<u64>) -> Result<(), OpError> {
    for ino in unlinked {
        let open = ctx
            .st
            .handles
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_open(ino);
        if open {
            ctx.orphans.insert(ino, ())?;
        } else {
            destroy_inode(ctx, ino)?;
        }
    }
    Ok(())
}

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
) -> Result<(u64, InodeRec), OpError> {
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
        ino,
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
    parent: u64,
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
    parent: u64,
    name: &FileName,
    kind: FileType,
    perm: u32,
    fill: impl FnOnce(&mut InodeRec),
) -> Result<(u64, InodeRec), OpError> {
    let mut dir = creatable(&ctx.t, cred, parent, name.as_bytes())?;
    if kind == FileType::Directory && dir.nlink >= LINK_MAX {
        return err(FsError::TooManyLinks);
    }
    let project = crate::quota::child_project(ctx, parent, &dir)?;
    crate::quota::check(ctx, project, 0, 1)?;
    let (ino, mut rec) = new_inode(ctx, cred, &dir, kind, perm)?;
    rec.project = project;
    crate::quota::apply(ctx, project, 0, 1)?;
    fill(&mut rec);
    if kind == FileType::Directory {
        rec.parent = parent;
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
        r.parent.0,
        &r.name,
        FileType::Directory,
        r.perm,
        |_| {},
    )?;
    Ok(rec.attr(ino, ctx.block_size))
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
    let (ino, rec) = make_node(ctx, &r.cred, r.parent.0, &r.name, r.kind, r.perm, |rec| {
        rec.rdev = rdev
    })?;
    Ok(rec.attr(ino, ctx.block_size))
}

pub fn symlink(ctx: &mut Ctx<'_>, r: &SymlinkRequest) -> Result<Attr, OpError> {
    let target = r.target.as_bytes().to_vec();
    let (ino, rec) = make_node(
        ctx,
        &r.cred,
        r.parent.0,
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

pub fn create(ctx: &mut Ctx<'_>, r: &CreateRequest) -> Result<CreateReply, OpError> {
    let existing = {
        let dir = ctx.t.inode(r.parent.0)?;
        if !dir.is_dir() {
            return err(FsError::NotDir);
        }
        check(&r.cred, &dir, MAY_EXEC)?;
        ctx.t.dirent(r.parent.0, r.name.as_bytes())?
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
                r.parent.0,
                &r.name,
                FileType::Regular,
                r.perm,
                |_| {},
            )?;
            (ino, rec, true)
        }
    };
    let handle = ctx
        .st
        .handles
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .open(ino, r.session.0, r.flags.write);
    Ok(CreateReply {
        attr: rec.attr(ino, ctx.block_size),
        handle: sanfs_proto::types::OpenHandle(handle),
        created,
    })
}

/// Open; a write job only when it truncates (otherwise [`open_read`] on a snapshot).
pub fn open(ctx: &mut Ctx<'_>, r: &OpenRequest) -> Result<OpenReply, OpError> {
    let mut rec = ctx.t.inode(r.inode.0)?;
    open_check(&r.cred, &rec, &r.flags)?;
    if r.flags.truncate && rec.kind == FileType::Regular {
        truncate(ctx, r.inode.0, &mut rec, 0)?;
        ctx.t.put_inode(r.inode.0, &rec)?;
    }
    let handle = ctx
        .st
        .handles
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .open(r.inode.0, r.session.0, r.flags.write);
    Ok(OpenReply {
        handle: sanfs_proto::types::OpenHandle(handle),
        attr: rec.attr(r.inode.0, ctx.block_size),
    })
}

/// Checks an open without truncation: the caller then registers the handle.
pub fn open_check_only<R: ReaderInodes>(
    t: &R,
    block_size: u32,
    r: &OpenRequest,
) -> Result<Attr, OpError> {
    let rec = t.inode_rec(r.inode.0)?;
    open_check(&r.cred, &rec, &r.flags)?;
    Ok(rec.attr(r.inode.0, block_size))
}

/// Raw inode access for read-side helpers outside the [`Reader`] trait.
pub trait ReaderInodes {
    fn inode_rec(&self, ino: u64) -> Result<InodeRec, OpError>;
    fn extent_map_of(&self, ino: u64) -> Result<ExtentMap, OpError>;
}

impl<I, D, C, E, X> ReaderInodes for Tables<I, D, C, E, X>
where
    I: ReadableTable<u64, &'static [u8]>,
    D: ReadableTable<(u64, &'static [u8]), (u64, u64, u8)>,
    C: ReadableTable<(u64, u64), &'static [u8]>,
    E: ReadableTable<u64, &'static [u8]>,
    X: ReadableTable<(u64, &'static [u8]), &'static [u8]>,
{
    fn inode_rec(&self, ino: u64) -> Result<InodeRec, OpError> {
        self.inode(ino)
    }

    fn extent_map_of(&self, ino: u64) -> Result<ExtentMap, OpError> {
        self.extent_map(ino)
    }
}

/// Last close of a handle: an orphan whose last handle this was is destroyed.
pub fn release_orphan(ctx: &mut Ctx<'_>, ino: u64) -> Result<(), OpError> {
    let orphan = ctx.orphans.get(ino)?.is_some();
    let open = ctx
        .st
        .handles
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .is_open(ino);
    if orphan && !open {
        destroy_inode(ctx, ino)?;
    }
    Ok(())
}

pub fn link(ctx: &mut Ctx<'_>, r: &LinkRequest) -> Result<Attr, OpError> {
    let src = ctx.t.inode(r.inode.0)?;
    if src.is_dir() {
        return err(FsError::Perm);
    }
    let mut dir = creatable(&ctx.t, &r.cred, r.new_parent.0, r.new_name.as_bytes())?;
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
        r.new_parent.0,
        &mut dir,
        r.new_name.as_bytes(),
        r.inode.0,
        src.kind,
    )?;
    touch_dir(&mut dir, now);
    ctx.t.put_inode(r.new_parent.0, &dir)?;
    // Re-read: the new parent may be... never the source (a directory), so no alias here.
    let mut src = src;
    src.nlink += 1;
    src.ctime = now;
    ctx.t.put_inode(r.inode.0, &src)?;
    Ok(src.attr(r.inode.0, ctx.block_size))
}

pub fn unlink(ctx: &mut Ctx<'_>, r: &EntryRequest, want_dir: bool) -> Result<(), OpError> {
    let parent = r.parent.0;
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

/// Whether `ancestor` is `ino` or one of its ancestors (walking `..` up to the root).
fn is_ancestor(t: &WriteTables<'_>, ancestor: u64, mut ino: u64) -> Result<bool, OpError> {
    for _ in 0..100_000 {
        if ino == ancestor {
            return Ok(true);
        }
        if ino == ROOT {
            return Ok(false);
        }
        ino = t.inode(ino)?.parent;
    }
    Err(crate::store::corrupt(
        "directory tree",
        "a parent chain does not reach the root",
    ))
}

pub fn rename(ctx: &mut Ctx<'_>, r: &RenameRequest) -> Result<(), OpError> {
    let (op, on, np, nn) = (
        r.old_parent.0,
        r.old_name.as_bytes(),
        r.new_parent.0,
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
        && crate::quota::child_project(ctx, op, &odir)?
            != crate::quota::child_project(ctx, np, &ndir)?
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
                .insert((op, on), (dino, ocookie, kind_code(dkind)))?;
            ctx.t
                .dirents
                .insert((np, nn), (src, ncookie, kind_code(skind)))?;
            if op != np {
                if src_is_dir {
                    w.get(src)?.parent = np;
                    w.get(op)?.nlink -= 1;
                    w.get(np)?.nlink += 1;
                }
                if dst_is_dir {
                    w.get(dino)?.parent = op;
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
                s.parent = np;
            }
            let unlinked = w.flush(&mut ctx.t)?;
            dispose(ctx, unlinked)
        }
    }
}

/// Cuts or extends a regular file to `size` bytes: blocks wholly past the new end are freed,
/// and mtime/ctime are set. The caller writes `rec`.
///
/// A cut to a size that is not block aligned leaves the old bytes in the tail of the last
/// block; whatever later extends the file zeroes them on the device first, under its range
/// lock (`DataPath::zero_eof_tail`, XFS's `xfs_zero_eof`), so they are never read back.
pub fn truncate(ctx: &mut Ctx<'_>, ino: u64, rec: &mut InodeRec, size: u64) -> Result<(), OpError> {
    if size > MAX_FILE_SIZE {
        return err(FsError::FileTooBig);
    }
    let bs = u64::from(ctx.block_size);
    if size < rec.size {
        let first_gone = size.div_ceil(bs);
        let mut map = ctx.t.extent_map(ino)?;
        let gone = map.truncate(first_gone);
        let mut freed = 0u64;
        for e in &gone {
            ctx.free_blocks(e.vol_block, e.len_blocks)?;
            freed += e.len_blocks;
        }
        crate::quota::apply(
            ctx,
            rec.project,
            -i64::try_from(freed).unwrap_or(i64::MAX),
            0,
        )?;
        rec.blocks = map.mapped_blocks();
        save_extents(&mut ctx.t, ino, &map)?;
    }
    rec.size = size;
    rec.mtime = ctx.now;
    rec.ctime = ctx.now;
    Ok(())
}

pub fn save_extents(t: &mut WriteTables<'_>, ino: u64, map: &ExtentMap) -> Result<(), OpError> {
    if map.is_empty() {
        t.extents.remove(ino)?;
    } else {
        t.extents
            .insert(ino, codec::encode_extents(&map.to_vec()).as_slice())?;
    }
    Ok(())
}

pub fn setattr(ctx: &mut Ctx<'_>, r: &SetAttrRequest) -> Result<Attr, OpError> {
    let ino = r.inode.0;
    let cred = &r.cred;
    let c = &r.changes;
    let mut rec = ctx.t.inode(ino)?;
    let now = ctx.now;
    // --- checks ---
    if c.perm.is_some() && !is_owner(cred, &rec) {
        return err(FsError::Perm);
    }
    if let Some(uid) = c.uid {
        if uid != rec.uid && !cred.is_root() {
            return err(FsError::Perm);
        }
        if !is_owner(cred, &rec) {
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
        let by_handle = r.handle.as_ref().is_some_and(|h| {
            ctx.st
                .handles
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .by_handle
                .get(&h.handle.0)
                .is_some_and(|f| f.ino == ino && f.write)
        });
        if !by_handle {
            check(cred, &rec, MAY_WRITE)?;
        }
    }
    for t in [c.atime, c.mtime].into_iter().flatten() {
        match t {
            TimeSet::At(_) if !is_owner(cred, &rec) => return err(FsError::Perm),
            TimeSet::Now if !is_owner(cred, &rec) && !permits(cred, &rec, MAY_WRITE) => {
                return err(FsError::Access);
            }
            _ => {}
        }
    }
    if c.ctime.is_some() && !is_owner(cred, &rec) {
        return err(FsError::Perm);
    }
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
            rec.perm &= !S_ISUID;
            if rec.perm & 0o010 != 0 {
                rec.perm &= !S_ISGID;
            }
        }
    }
    if let Some(size) = c.size {
        truncate(ctx, ino, &mut rec, size)?;
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
    let ino = r.inode.0;
    let mut rec = ctx.t.inode(ino)?;
    xattr_access(&r.cred, &rec, r.name.as_bytes(), true)?;
    let (mut exists, mut names_len, mut values_len) = (false, 0usize, 0usize);
    for item in ctx.t.xattrs.range((ino, &[][..])..)? {
        let (k, v) = item?;
        let (owner, name) = k.value();
        if owner != ino {
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
        .insert((ino, r.name.as_bytes()), r.value.as_slice())?;
    rec.ctime = ctx.now;
    ctx.t.put_inode(ino, &rec)
}

pub fn removexattr(ctx: &mut Ctx<'_>, r: &XattrRequest) -> Result<(), OpError> {
    let ino = r.inode.0;
    let mut rec = ctx.t.inode(ino)?;
    xattr_access(&r.cred, &rec, r.name.as_bytes(), true)?;
    if ctx.t.xattrs.remove((ino, r.name.as_bytes()))?.is_none() {
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
    ino: u64,
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
    let map = allocate_blocks(ctx, ino, &mut rec, offset / bs, end.div_ceil(bs), true)?;
    drop(map);
    if !keep_size && end > rec.size {
        rec.size = end;
        rec.mtime = ctx.now;
    }
    rec.ctime = ctx.now;
    ctx.t.put_inode(ino, &rec)?;
    Ok(rec.attr(ino, ctx.block_size))
}

/// Unmaps file blocks `[first, end)` of a regular file (fallocate PUNCH_HOLE; the caller has
/// zeroed the partial blocks at the range's edges and holds an exclusive lock over it): their
/// volume blocks are freed and the quota given back; the size stays. Returns the new attributes.
pub fn punch_blocks(ctx: &mut Ctx<'_>, ino: u64, first: u64, end: u64) -> Result<Attr, OpError> {
    let mut rec = ctx.t.inode(ino)?;
    rec.regular()?;
    if first < end {
        let mut map = ctx.t.extent_map(ino)?;
        let gone = map.punch(first, end - first);
        let mut freed = 0u64;
        for e in &gone {
            ctx.free_blocks(e.vol_block, e.len_blocks)?;
            freed += e.len_blocks;
        }
        if freed > 0 {
            crate::quota::apply(
                ctx,
                rec.project,
                -i64::try_from(freed).unwrap_or(i64::MAX),
                0,
            )?;
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
    ino: u64,
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
                sanfs_blockmap::extent::Piece::Mapped(e) if e.state == ExtentState::Written => {
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

/// Allocates Unwritten extents for every hole in file blocks `[first, last)` of `ino`, saves
/// the extent map and `rec.blocks` (the caller writes `rec`), and returns the new map. The
/// caller has checked the file's type and the caller's right to write. Nothing changes if
/// the space is not there (ENOSPC). With `mark_unzeroed` the new blocks are noted as not
/// zeroed on the LUNs yet (a client will be granted them: the server zeroes them first, see
/// `DataPath::zero_fresh`); without, the caller writes every new block whole itself (the
/// proxied path).
pub fn allocate_blocks(
    ctx: &mut Ctx<'_>,
    ino: u64,
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
            sanfs_blockmap::extent::Piece::Hole {
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
    crate::quota::check(ctx, rec.project, wanted, 0)?;
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
    crate::quota::apply(
        ctx,
        rec.project,
        i64::try_from(wanted).unwrap_or(i64::MAX),
        0,
    )?;
    Ok(map)
}
