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
//!
//! This file holds those rules and the helpers every change shares; the operations are in
//! `lookup.rs` (reads), `create.rs` (mkdir, mknod, symlink, create, link, open), `remove.rs`
//! (unlink, rmdir, orphans), `rename.rs` and `attr.rs` (setattr, truncate, xattrs, fallocate).

use std::collections::HashMap;

use redb::ReadableTable;
use sanfs_blockmap::extent::Extent;
use sanfs_proto::model::{
    CreateReply, CreateRequest, DirEntry, EntryRequest, FIRST_DIR_COOKIE, LinkRequest,
    MkdirRequest, MknodRequest, OpenFlags, OpenReply, OpenRequest, ReadDirReply, ReadDirRequest,
    RenameRequest, SetAttrRequest, SetXattrRequest, SymlinkRequest, XattrRequest,
};
use sanfs_proto::types::{
    Attr, Credentials, FileName, FileType, FsError, InodeId, MAX_FILE_SIZE, RenameMode, S_ISVTX,
    TimeSet, Timestamp, XattrMode,
};

use crate::space;
use crate::store::records::{InodeRec, kind_code};
use crate::store::{Ctx, OpError, ROOT, ReaderInodes, Tables, WriteTables};

mod attr;
mod create;
mod lookup;
mod remove;
mod rename;

pub use attr::{
    XATTR_NAMES_MAX_PER_INODE, XATTR_VALUES_MAX_PER_INODE, allocate_range, kill_capability,
    removexattr, setattr, setattr_allowed, setxattr, truncate,
};
pub use create::{create, link, mkdir, mknod, open, open_check_only, symlink};
pub use lookup::Reader;
use remove::dispose;
pub use remove::{destroy_inode, release_orphan, unlink};
pub use rename::rename;

/// Most hard links to one inode.
pub const LINK_MAX: u32 = 65000;

const MAY_READ: u32 = 4;
const MAY_WRITE: u32 = 2;
const MAY_EXEC: u32 = 1;
use sanfs_proto::types::S_ISGID;

fn err<T>(e: FsError) -> Result<T, OpError> {
    Err(OpError::Fs(e))
}

/// Whether `cred` may access `rec` for `mask` (a combination of read 4, write 2, exec 1).
pub fn permits(cred: &Credentials, rec: &InodeRec, mask: u32) -> bool {
    sanfs_proto::types::mode_permits(cred, (rec.uid, rec.gid, rec.perm), rec.is_dir(), mask)
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
    dir: InodeId,
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
    recs: HashMap<InodeId, InodeRec>,
    order: Vec<InodeId>,
    dead: Vec<InodeId>,
}

impl Working {
    fn new() -> Working {
        Working {
            recs: HashMap::new(),
            order: Vec::new(),
            dead: Vec::new(),
        }
    }

    fn load(&mut self, t: &WriteTables<'_>, ino: InodeId) -> Result<&mut InodeRec, OpError> {
        if let std::collections::hash_map::Entry::Vacant(slot) = self.recs.entry(ino) {
            slot.insert(t.inode(ino)?);
            self.order.push(ino);
        }
        self.recs
            .get_mut(&ino)
            .ok_or_else(|| OpError::Store("working set lost an inode".into()))
    }

    fn get(&mut self, ino: InodeId) -> Result<&mut InodeRec, OpError> {
        self.recs
            .get_mut(&ino)
            .ok_or_else(|| OpError::Store(format!("inode {ino} not loaded")))
    }

    /// Writes every live inode; returns the ones whose last link went.
    fn flush(self, t: &mut WriteTables<'_>) -> Result<Vec<InodeId>, OpError> {
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
    dir: InodeId,
    dir_rec: &mut InodeRec,
    name: &[u8],
    child: InodeId,
    kind: FileType,
) -> Result<(), OpError> {
    let cookie = dir_rec.next_cookie.max(FIRST_DIR_COOKIE);
    dir_rec.next_cookie = cookie + 1;
    dir_rec.size += 1;
    t.dirents
        .insert((dir.0, name), (child.0, cookie, kind_code(kind)))?;
    t.cookies.insert((dir.0, cookie), name)?;
    Ok(())
}

fn remove_entry(
    t: &mut WriteTables<'_>,
    dir: InodeId,
    dir_rec: &mut InodeRec,
    name: &[u8],
) -> Result<(), OpError> {
    let old = t.dirents.remove((dir.0, name))?.map(|v| v.value());
    if let Some((_, cookie, _)) = old {
        t.cookies.remove((dir.0, cookie))?;
    }
    dir_rec.size = dir_rec.size.saturating_sub(1);
    Ok(())
}
