//! `sanfs-mds fsck`: an offline consistency check of the metadata store.
//!
//! It reads every table once and checks what the rest of the server takes for granted:
//! every record decodes; every directory entry names a live inode of the type it says; link
//! counts and directory sizes match the entries; every directory but the root has exactly one
//! entry naming it, and its `..` is that entry's directory; every inode is reachable from the
//! root or listed as an orphan; readdir cookies and entries agree; extents are canonical, lie
//! inside the volume and inside allocation groups, and no block is owned twice (by two files,
//! or by a file and free space); free + used = capacity; no Written extent lies wholly past
//! end of file; inode numbers are below the next one to hand out.
//!
//! [`check`] never changes anything: it opens the store read-only (redb's `ReadOnlyDatabase`),
//! so a store that was not shut down cleanly, which redb must repair before it can be read, is
//! reported as [`StoreError::NeedsRepair`], and a store held by a running server as
//! [`StoreError::InUse`]. A problem is a line of text naming the record.
//!
//! [`repair`] is the explicit `--repair`: redb's own repair (on a read-write open), then the
//! repairs of ours that cannot lose anything ([`Fix`]), in one transaction: blocks that neither
//! a file nor free space owns go back to free space; link counts, directory sizes, directory
//! parents and block counts are set from the entries and extents; the next inode number moves
//! past the highest inode; quota usage is set to what the inodes hold; an inode with no links
//! in no directory is listed as an orphan (the next start frees it); an inode with links, or a
//! directory, in no directory is connected to `/lost+found` as `#<ino>`, as e2fsck does (made
//! at `now` if missing). With `dry_run` it repairs a copy in memory and changes nothing. A panic of the storage library on damaged bytes is caught
//! ([`crate::store::guard_damage`]) and answered as [`StoreError::Damaged`].

use std::collections::{BTreeMap, HashMap, HashSet};

use redb::{Database, ReadableDatabase, ReadableTable};
use sanfs_blockmap::alloc::Allocator;
use sanfs_blockmap::codec;
use sanfs_blockmap::extent::{ExtentMap, ExtentState};
use sanfs_proto::model::FIRST_DIR_COOKIE;
use sanfs_proto::types::{FileType, MAX_FILE_SIZE, Timestamp};

use crate::store::backend::{FaultPlan, SimDisk};
use crate::store::records::{GrownDevices, InodeRec, Superblock, kind_code, kind_from_code};
use crate::store::{
    Backend, COOKIES, COUNTERS, DIRENTS, EXTENTS, FREE, INODES, ORPHANS, PREALLOC, QUOTAS, ROOT,
    SUPER, StoreError, XATTRS,
};
use crate::store::{Verify, guard_damage, open_db, open_db_read_only, read_image};

/// What fsck found.
#[derive(Debug, Default, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Report {
    pub problems: Vec<String>,
    pub inodes: u64,
    pub directories: u64,
    pub entries: u64,
    pub extents: u64,
    pub used_blocks: u64,
    pub free_blocks: u64,
    pub capacity_blocks: u64,
    pub orphans: u64,
    /// The problems that `--repair` can fix safely (each is also listed in `problems`).
    pub fixes: Vec<Fix>,
}

/// A repair of ours that loses nothing: what `fsck --repair` applies after redb's repair.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Fix {
    /// Volume blocks inside the allocation groups that no file owns and free space does not
    /// list (leaked, e.g. by a grant whose completion never came): back to free space.
    FreeLeaked { start: u64, len_blocks: u64 },
    /// The next inode number to hand out is not past the highest inode.
    NextInode { from: u64, to: u64 },
    /// A directory quota's usage differs from what its inodes hold.
    QuotaUsage { dir: u64, blocks: u64, inodes: u64 },
    /// An inode's link count differs from the entries naming it (a directory's: 2 plus its
    /// subdirectories).
    LinkCount { ino: u64, from: u32, to: u32 },
    /// A directory's size differs from its number of entries.
    DirSize { dir: u64, from: u64, to: u64 },
    /// An inode's block count differs from the blocks its extents map.
    InodeBlocks { ino: u64, from: u64, to: u64 },
    /// A directory's `..` differs from the one directory that names it.
    DirParent { dir: u64, from: u64, to: u64 },
    /// An inode with no links that no entry names and that is not listed as an orphan (its
    /// orphan record was lost): listed as an orphan, so that the next server start frees it
    /// (after the reclaim window, as an inode unlinked while open).
    Orphan { ino: u64 },
    /// An inode with links (or a directory) that no entry names: connected to `/lost+found`
    /// as `#<ino>` (created if missing), with link count 1 (a directory: its `..` set to
    /// `/lost+found`), as e2fsck does. Nothing is freed.
    LostFound { ino: u64 },
}

impl std::fmt::Display for Fix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Fix::FreeLeaked { start, len_blocks } => write!(
                f,
                "return leaked volume blocks {start}..{} to free space",
                start.saturating_add(*len_blocks)
            ),
            Fix::NextInode { from, to } => {
                write!(f, "set the next inode number from {from} to {to}")
            }
            Fix::QuotaUsage {
                dir,
                blocks,
                inodes,
            } => write!(
                f,
                "set the usage of the quota of directory {dir} to {blocks} blocks and {inodes} inodes"
            ),
            Fix::LinkCount { ino, from, to } => {
                write!(f, "set the link count of inode {ino} from {from} to {to}")
            }
            Fix::DirSize { dir, from, to } => {
                write!(f, "set the size of directory {dir} from {from} to {to}")
            }
            Fix::InodeBlocks { ino, from, to } => {
                write!(f, "set the block count of inode {ino} from {from} to {to}")
            }
            Fix::DirParent { dir, from, to } => {
                write!(f, "set the parent of directory {dir} from {from} to {to}")
            }
            Fix::Orphan { ino } => write!(
                f,
                "list inode {ino} (no links, in no directory) as an orphan: the next server start frees it"
            ),
            Fix::LostFound { ino } => {
                write!(
                    f,
                    "connect inode {ino} (in no directory) to /lost+found as #{ino}"
                )
            }
        }
    }
}

impl Report {
    pub fn is_clean(&self) -> bool {
        self.problems.is_empty()
    }

    fn problem(&mut self, p: impl Into<String>) {
        // Enough to act on; a store broken everywhere should not print millions of lines.
        if self.problems.len() < 10_000 {
            self.problems.push(p.into());
        }
    }
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for p in &self.problems {
            writeln!(f, "problem: {p}")?;
        }
        write!(
            f,
            "{} inodes ({} directories, {} orphans), {} entries, {} extents; blocks: {} used + {} free of {}; {}",
            self.inodes,
            self.directories,
            self.orphans,
            self.entries,
            self.extents,
            self.used_blocks,
            self.free_blocks,
            self.capacity_blocks,
            if self.is_clean() {
                "clean".to_string()
            } else {
                format!("{} problems", self.problems.len())
            }
        )
    }
}

/// Checks the store at `backend` without changing it (read-only; see the module docs). The
/// store's bytes are read into memory, where redb verifies every page's checksum before our
/// checks run; the store itself is only read.
pub fn check(backend: &Backend) -> Result<Report, StoreError> {
    guard_damage("check the metadata store", || {
        // In use, needs repair: refused here, before anything is read into memory.
        drop(open_db_read_only(backend)?);
        let copy = Backend::Sim(SimDisk::from_image(
            read_image(backend)?,
            FaultPlan::default(),
        ));
        let mut db = open_db(&copy, false, false, Verify::Trust)?;
        if !db.check_integrity()? {
            return Err(StoreError::Damaged(
                "page checksums do not match (the store was altered outside the storage \
                 library, e.g. torn or partly restored); `sanfs-mds fsck --repair` rolls it back \
                 to its last intact commit"
                    .into(),
            ));
        }
        check_db(&db)
    })
}

/// What [`repair`] did (or, in a dry run, would do).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct RepairReport {
    /// The store had not been shut down cleanly: redb's repair ran (on the copy in a dry run).
    pub redb_repaired: bool,
    /// Our own repairs, applied (or, in a dry run, that would be).
    pub fixes: Vec<Fix>,
    pub dry_run: bool,
    /// The check after the repairs (of the repaired copy in a dry run).
    pub after: Report,
}

impl std::fmt::Display for RepairReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let verb = if self.dry_run {
            "would repair"
        } else {
            "repaired"
        };
        if self.redb_repaired {
            writeln!(
                f,
                "{verb}: the store was not shut down cleanly, or pages failed their checksums (redb recovery)"
            )?;
        }
        for fix in &self.fixes {
            writeln!(f, "{verb}: {fix}")?;
        }
        if !self.redb_repaired && self.fixes.is_empty() {
            writeln!(f, "nothing to repair")?;
        }
        if self.dry_run {
            writeln!(f, "dry run: nothing was changed; after the repair:")?;
        }
        write!(f, "{}", self.after)
    }
}

/// `fsck --repair`: redb's repair (with every page's checksum verified), then our [`Fix`]es;
/// the store is opened read-write only if [`check`] finds something to repair. With `dry_run`, the store's bytes are read into memory and
/// repaired there: nothing is written. Problems that no fix covers stay in `after`. `now`
/// stamps a `/lost+found` that the repair makes, and the inodes it connects there.
pub fn repair(
    backend: &Backend,
    dry_run: bool,
    now: Timestamp,
) -> Result<RepairReport, StoreError> {
    guard_damage("repair the metadata store", || {
        let redb_repaired = match check(backend) {
            Ok(report) => {
                if report.fixes.is_empty() {
                    return Ok(RepairReport {
                        redb_repaired: false,
                        fixes: Vec::new(),
                        dry_run,
                        after: report,
                    });
                }
                false
            }
            Err(StoreError::NeedsRepair | StoreError::Damaged(_)) => true,
            Err(e) => return Err(e),
        };
        let target = if dry_run {
            Backend::Sim(SimDisk::from_image(
                read_image(backend)?,
                FaultPlan::default(),
            ))
        } else {
            backend.clone()
        };
        let db = open_db(&target, false, false, Verify::Pages)?;
        let before = check_db(&db)?;
        apply_fixes(&db, &before.fixes, now)?;
        let after = check_db(&db)?;
        Ok(RepairReport {
            redb_repaired,
            fixes: before.fixes,
            dry_run,
            after,
        })
    })
}

/// Applies `fixes` in one durable transaction.
fn apply_fixes(db: &Database, fixes: &[Fix], now: Timestamp) -> Result<(), StoreError> {
    if fixes.is_empty() {
        return Ok(());
    }
    let txn = db.begin_write()?;
    {
        let leaked: Vec<(u64, u64)> = fixes
            .iter()
            .filter_map(|f| match f {
                Fix::FreeLeaked { start, len_blocks } => Some((*start, *len_blocks)),
                _ => None,
            })
            .collect();
        if !leaked.is_empty() {
            let (sb, volume) = {
                let sup = txn.open_table(SUPER)?;
                let sb = match sup.get("super")? {
                    Some(v) => Superblock::decode(v.value())
                        .map_err(|e| StoreError::Corrupt(format!("super record: {e}")))?,
                    None => return Err(StoreError::Corrupt("no super record".into())),
                };
                let volume = match sup.get("volume")? {
                    Some(v) => codec::decode_volume(v.value())
                        .map_err(|e| StoreError::Corrupt(format!("volume record: {e}")))?,
                    None => return Err(StoreError::Corrupt("no volume record".into())),
                };
                (sb, volume)
            };
            let mut free = txn.open_table(FREE)?;
            let mut runs = Vec::new();
            for item in free.iter()? {
                let (k, v) = item?;
                runs.push((k.value(), v.value()));
            }
            let mut alloc =
                Allocator::from_free(&volume.allocation_groups(), sb.stripe_unit_blocks, runs)
                    .map_err(|e| StoreError::Corrupt(format!("free space: {e}")))?;
            for (start, len) in leaked {
                alloc
                    .free(start, len)
                    .map_err(|e| StoreError::Corrupt(format!("free leaked blocks: {e}")))?;
            }
            free.retain(|_, _| false)?;
            for (start, len) in alloc.free_extents() {
                free.insert(start, len)?;
            }
        }
        let mut counters = txn.open_table(COUNTERS)?;
        let mut quotas = txn.open_table(QUOTAS)?;
        let mut inodes = txn.open_table(INODES)?;
        let mut orphans = txn.open_table(ORPHANS)?;
        // Read, change and write back one inode record.
        let mut update = |ino: u64, change: &dyn Fn(&mut InodeRec)| -> Result<(), StoreError> {
            let rec = inodes.get(ino)?.map(|v| InodeRec::decode(v.value()));
            let Some(rec) = rec else {
                return Err(StoreError::Corrupt(format!("inode {ino} went missing")));
            };
            let mut rec =
                rec.map_err(|e| StoreError::Corrupt(format!("inode {ino} does not decode: {e}")))?;
            change(&mut rec);
            inodes.insert(ino, rec.encode().as_slice())?;
            Ok(())
        };
        for fix in fixes {
            match *fix {
                Fix::FreeLeaked { .. } | Fix::LostFound { .. } => {}
                Fix::NextInode { to, .. } => {
                    counters.insert("next_inode", to)?;
                }
                Fix::LinkCount { ino, to, .. } => update(ino, &|r| r.nlink = to)?,
                Fix::DirSize { dir, to, .. } => update(dir, &|r| r.size = to)?,
                Fix::InodeBlocks { ino, to, .. } => update(ino, &|r| r.blocks = to)?,
                Fix::DirParent { dir, to, .. } => update(dir, &|r| r.parent = to)?,
                Fix::Orphan { ino } => {
                    orphans.insert(ino, ())?;
                }
                Fix::QuotaUsage {
                    dir,
                    blocks,
                    inodes,
                } => {
                    let row = quotas.get(dir)?.map(|v| v.value());
                    if let Some(row) = row {
                        let mut q = crate::quota::QuotaRow::from_tuple(row);
                        q.used_blocks = blocks;
                        q.used_inodes = inodes;
                        quotas.insert(dir, q.to_tuple())?;
                    }
                }
            }
        }
        drop((inodes, orphans, counters));
        let lost: Vec<u64> = fixes
            .iter()
            .filter_map(|f| match f {
                Fix::LostFound { ino } => Some(*ino),
                _ => None,
            })
            .collect();
        if !lost.is_empty() {
            connect_to_lost_found(&txn, &lost, now)?;
        }
    }
    txn.commit()?;
    Ok(())
}

/// The name of the directory in the root that [`Fix::LostFound`] connects inodes to.
pub const LOST_FOUND: &[u8] = b"lost+found";

/// Connects `lost` (inodes no entry names) to `/lost+found` as `#<ino>`, creating it (mode
/// 0700, owned by root, times `now`) if the root has no such entry. Refused when
/// `/lost+found` is not a directory.
fn connect_to_lost_found(
    txn: &redb::WriteTransaction,
    lost: &[u64],
    now: Timestamp,
) -> Result<(), StoreError> {
    let mut inodes = txn.open_table(INODES)?;
    let mut dirents = txn.open_table(DIRENTS)?;
    let mut cookies = txn.open_table(COOKIES)?;
    let mut counters = txn.open_table(COUNTERS)?;
    let read = |inodes: &redb::Table<'_, u64, &[u8]>, ino: u64| -> Result<InodeRec, StoreError> {
        let bytes = inodes.get(ino)?.map(|v| v.value().to_vec());
        let bytes = bytes.ok_or_else(|| StoreError::Corrupt(format!("no inode {ino}")))?;
        InodeRec::decode(&bytes)
            .map_err(|e| StoreError::Corrupt(format!("inode {ino} does not decode: {e}")))
    };
    // Adds the entry `name` -> `child` to `dir` (a directory record, changed in place).
    let add_entry = |dirents: &mut redb::Table<'_, (u64, &[u8]), (u64, u64, u8)>,
                     cookies: &mut redb::Table<'_, (u64, u64), &[u8]>,
                     dir: u64,
                     dir_rec: &mut InodeRec,
                     name: &[u8],
                     child: u64,
                     kind: FileType|
     -> Result<(), StoreError> {
        let cookie = dir_rec.next_cookie.max(FIRST_DIR_COOKIE);
        dir_rec.next_cookie = cookie.saturating_add(1);
        dir_rec.size = dir_rec.size.saturating_add(1);
        if kind == FileType::Directory {
            dir_rec.nlink = dir_rec.nlink.saturating_add(1);
        }
        dirents.insert((dir, name), (child, cookie, kind_code(kind)))?;
        cookies.insert((dir, cookie), name)?;
        Ok(())
    };
    let existing = dirents.get((ROOT, LOST_FOUND))?.map(|v| v.value());
    let (lf, mut lf_rec) = match existing {
        Some((lf, _, _)) => {
            let rec = read(&inodes, lf)?;
            if !rec.is_dir() {
                return Err(StoreError::Corrupt(
                    "/lost+found is not a directory: rename it, then repair again".into(),
                ));
            }
            (lf, rec)
        }
        None => {
            let lf = counters.get("next_inode")?.map(|v| v.value()).unwrap_or(0);
            if lf <= ROOT {
                return Err(StoreError::Corrupt("no next inode number".into()));
            }
            let generation = counters
                .get("generation")?
                .map(|v| v.value())
                .unwrap_or(0)
                .saturating_add(1);
            counters.insert("next_inode", lf.saturating_add(1))?;
            counters.insert("generation", generation)?;
            let rec = InodeRec {
                kind: FileType::Directory,
                perm: 0o700,
                uid: 0,
                gid: 0,
                nlink: 2,
                size: 0,
                blocks: 0,
                atime: now,
                mtime: now,
                ctime: now,
                btime: now,
                rdev: 0,
                generation,
                parent: ROOT,
                next_cookie: FIRST_DIR_COOKIE,
                target: Vec::new(),
                project: 0,
            };
            let mut root = read(&inodes, ROOT)?;
            add_entry(
                &mut dirents,
                &mut cookies,
                ROOT,
                &mut root,
                LOST_FOUND,
                lf,
                FileType::Directory,
            )?;
            root.mtime = now;
            root.ctime = now;
            inodes.insert(ROOT, root.encode().as_slice())?;
            (lf, rec)
        }
    };
    for &ino in lost {
        let mut rec = read(&inodes, ino)?;
        let mut name = format!("#{ino}").into_bytes();
        while dirents.get((lf, name.as_slice()))?.is_some() {
            name.push(b'+');
        }
        add_entry(
            &mut dirents,
            &mut cookies,
            lf,
            &mut lf_rec,
            &name,
            ino,
            rec.kind,
        )?;
        if rec.is_dir() {
            rec.parent = lf;
        } else {
            rec.nlink = 1;
        }
        rec.ctime = now;
        inodes.insert(ino, rec.encode().as_slice())?;
    }
    lf_rec.mtime = now;
    lf_rec.ctime = now;
    inodes.insert(lf, lf_rec.encode().as_slice())?;
    Ok(())
}

/// Checks an open database (read-only or not).
pub fn check_db(db: &impl ReadableDatabase) -> Result<Report, StoreError> {
    let mut rep = Report::default();
    let r = db.begin_read()?;

    let sup = r.open_table(SUPER)?;
    let sb = match sup.get("super")? {
        Some(v) => Superblock::decode(v.value())
            .map_err(|e| StoreError::Corrupt(format!("super record: {e}")))?,
        None => return Err(StoreError::Corrupt("no super record".into())),
    };
    let volume = match sup.get("volume")? {
        Some(v) => codec::decode_volume(v.value())
            .map_err(|e| StoreError::Corrupt(format!("volume record: {e}")))?,
        None => return Err(StoreError::Corrupt("no volume record".into())),
    };
    // The paths growths were given (absent: none): a server refuses to start on a damaged one.
    if let Some(v) = sup.get("grown_devices")?
        && let Err(e) = GrownDevices::decode(v.value())
    {
        rep.problem(format!("the grown-devices record does not decode: {e}"));
    }
    let counters = r.open_table(COUNTERS)?;
    let next_inode = counters.get("next_inode")?.map(|v| v.value()).unwrap_or(0);

    // --- inodes ---
    let mut inodes: HashMap<u64, InodeRec> = HashMap::new();
    for item in r.open_table(INODES)?.iter()? {
        let (k, v) = item?;
        let ino = k.value();
        match InodeRec::decode(v.value()) {
            Ok(rec) => {
                if ino == 0 || ino >= next_inode {
                    rep.problem(format!(
                        "inode {ino} is not below the next inode number {next_inode}"
                    ));
                }
                inodes.insert(ino, rec);
            }
            Err(e) => rep.problem(format!("inode {ino} does not decode: {e}")),
        }
    }
    rep.inodes = inodes.len() as u64;
    if let Some(&max) = inodes.keys().max()
        && max >= next_inode
        && next_inode > 0
    {
        rep.fixes.push(Fix::NextInode {
            from: next_inode,
            to: max.saturating_add(1),
        });
    }
    rep.directories = inodes.values().filter(|r| r.is_dir()).count() as u64;
    match inodes.get(&ROOT) {
        Some(root) if root.is_dir() => {
            if root.parent != ROOT {
                rep.problem(format!("root's parent is {}, not itself", root.parent));
            }
        }
        Some(_) => rep.problem("the root inode is not a directory"),
        None => rep.problem("there is no root inode"),
    }

    // --- directory entries ---
    let mut links: HashMap<u64, u32> = HashMap::new();
    let mut subdirs: HashMap<u64, u32> = HashMap::new();
    let mut entries_in: HashMap<u64, u64> = HashMap::new();
    let mut named_by: HashMap<u64, Vec<u64>> = HashMap::new();
    let mut cookies_of: HashMap<(u64, u64), Vec<u8>> = HashMap::new();
    for item in r.open_table(DIRENTS)?.iter()? {
        let (k, v) = item?;
        let (dir, name) = k.value();
        let (child, cookie, code) = v.value();
        rep.entries += 1;
        let shown = String::from_utf8_lossy(name).into_owned();
        *entries_in.entry(dir).or_default() += 1;
        match inodes.get(&dir) {
            Some(d) if d.is_dir() => {
                if cookie < FIRST_DIR_COOKIE || cookie >= d.next_cookie {
                    rep.problem(format!(
                        "entry {shown:?} in directory {dir} has cookie {cookie} outside {FIRST_DIR_COOKIE}..{}",
                        d.next_cookie
                    ));
                }
            }
            Some(_) => rep.problem(format!(
                "entry {shown:?} is in inode {dir}, not a directory"
            )),
            None => rep.problem(format!("entry {shown:?} is in a missing directory {dir}")),
        }
        if name.is_empty()
            || name.len() > 255
            || name.contains(&b'/')
            || name.contains(&0)
            || name == b"."
            || name == b".."
        {
            rep.problem(format!(
                "entry {shown:?} in directory {dir} has an invalid name"
            ));
        }
        match inodes.get(&child) {
            None => rep.problem(format!(
                "entry {shown:?} in directory {dir} names a missing inode {child}"
            )),
            Some(c) => {
                if kind_from_code(code).ok() != Some(c.kind) {
                    rep.problem(format!(
                        "entry {shown:?} in directory {dir} says type {code}, inode {child} is {:?}",
                        c.kind
                    ));
                }
                *links.entry(child).or_default() += 1;
                if c.is_dir() {
                    *subdirs.entry(dir).or_default() += 1;
                    named_by.entry(child).or_default().push(dir);
                }
            }
        }
        if child == ROOT {
            rep.problem(format!("entry {shown:?} in directory {dir} names the root"));
        }
        if cookies_of.insert((dir, cookie), name.to_vec()).is_some() {
            rep.problem(format!(
                "two entries of directory {dir} share cookie {cookie}"
            ));
        }
    }
    let cookie_table = r.open_table(COOKIES)?;
    let mut cookie_rows = 0u64;
    for item in cookie_table.iter()? {
        let (k, v) = item?;
        let (dir, cookie) = k.value();
        cookie_rows += 1;
        match cookies_of.get(&(dir, cookie)) {
            Some(name) if name.as_slice() == v.value() => {}
            _ => rep.problem(format!(
                "readdir cookie {cookie} of directory {dir} names {:?}, which has no entry with that cookie",
                String::from_utf8_lossy(v.value())
            )),
        }
    }
    if cookie_rows != rep.entries {
        rep.problem(format!(
            "{} directory entries but {cookie_rows} readdir cookies",
            rep.entries
        ));
    }

    // --- orphans ---
    let mut orphans: HashSet<u64> = HashSet::new();
    for item in r.open_table(ORPHANS)?.iter()? {
        let (k, _) = item?;
        let ino = k.value();
        orphans.insert(ino);
        match inodes.get(&ino) {
            Some(rec) if rec.nlink == 0 => {}
            Some(rec) => rep.problem(format!("orphan {ino} still has {} links", rec.nlink)),
            None => rep.problem(format!("orphan {ino} does not exist")),
        }
    }
    rep.orphans = orphans.len() as u64;

    // --- link counts, sizes, tree shape ---
    let mut ids: Vec<u64> = inodes.keys().copied().collect();
    ids.sort_unstable();
    for ino in &ids {
        let rec = &inodes[ino];
        let named = links.get(ino).copied().unwrap_or(0);
        if rec.is_dir() {
            let want = 2 + subdirs.get(ino).copied().unwrap_or(0);
            if *ino != ROOT && !orphans.contains(ino) && rec.nlink != want {
                rep.problem(format!(
                    "directory {ino} has nlink {} but {want} links",
                    rec.nlink
                ));
                rep.fixes.push(Fix::LinkCount {
                    ino: *ino,
                    from: rec.nlink,
                    to: want,
                });
            }
            if *ino == ROOT && rec.nlink != want {
                rep.problem(format!("the root has nlink {} but {want} links", rec.nlink));
                rep.fixes.push(Fix::LinkCount {
                    ino: *ino,
                    from: rec.nlink,
                    to: want,
                });
            }
            let entries = entries_in.get(ino).copied().unwrap_or(0);
            if rec.size != entries {
                rep.problem(format!(
                    "directory {ino} has size {} but {entries} entries",
                    rec.size
                ));
                rep.fixes.push(Fix::DirSize {
                    dir: *ino,
                    from: rec.size,
                    to: entries,
                });
            }
            if *ino != ROOT {
                match named_by.get(ino).map(Vec::as_slice) {
                    Some([parent]) => {
                        if rec.parent != *parent {
                            rep.problem(format!(
                                "directory {ino} says its parent is {}, but it is named in {parent}",
                                rec.parent
                            ));
                            rep.fixes.push(Fix::DirParent {
                                dir: *ino,
                                from: rec.parent,
                                to: *parent,
                            });
                        }
                    }
                    Some(more) => rep.problem(format!(
                        "directory {ino} is named in {} directories",
                        more.len()
                    )),
                    None if orphans.contains(ino) => {}
                    None => {
                        rep.problem(format!("directory {ino} is in no directory (unreachable)"));
                        rep.fixes.push(Fix::LostFound { ino: *ino });
                    }
                }
            }
        } else {
            if rec.nlink != named {
                rep.problem(format!(
                    "inode {ino} has nlink {} but {named} entries name it",
                    rec.nlink
                ));
                if named > 0 {
                    rep.fixes.push(Fix::LinkCount {
                        ino: *ino,
                        from: rec.nlink,
                        to: named,
                    });
                }
            }
            if named == 0 && !orphans.contains(ino) {
                rep.problem(format!("inode {ino} is in no directory and not an orphan"));
                // No links: an unlinked file whose orphan record was lost; links but no
                // entry: a file that lost its entry, kept in /lost+found.
                rep.fixes.push(if rec.nlink == 0 {
                    Fix::Orphan { ino: *ino }
                } else {
                    Fix::LostFound { ino: *ino }
                });
            }
            if rec.kind == FileType::Symlink && rec.size != rec.target.len() as u64 {
                rep.problem(format!(
                    "symlink {ino} has size {} but a target of {} bytes",
                    rec.size,
                    rec.target.len()
                ));
            }
        }
    }
    // Every directory reachable from the root: walk `..` pointers upward (bounded).
    for ino in &ids {
        let rec = &inodes[ino];
        if !rec.is_dir() || orphans.contains(ino) {
            continue;
        }
        let mut cur = *ino;
        let mut steps = 0usize;
        while cur != ROOT && steps <= ids.len() {
            cur = inodes.get(&cur).map(|r| r.parent).unwrap_or(ROOT);
            steps += 1;
        }
        if cur != ROOT || steps > ids.len() {
            rep.problem(format!(
                "directory {ino} does not lead up to the root (a cycle)"
            ));
        }
    }

    // --- space ---
    let bs = u64::from(sb.block_size);
    let size_blocks = volume.size_blocks();
    let groups = volume.allocation_groups();
    let in_group = |start: u64, len: u64| {
        let end = start.saturating_add(len);
        groups
            .iter()
            .any(|(gs, gl)| start >= *gs && end <= gs.saturating_add(*gl))
            || coverage_is_groups(&groups, start, end)
    };
    // No file block lies past the largest file size (speculative preallocation after a write
    // near it once ran past it, and SEEK_DATA, SEEK_HOLE and bmap then failed with EIO).
    let max_end_block = MAX_FILE_SIZE.div_ceil(bs);
    let space_problems_at_start = rep.problems.len();
    let mut owned: BTreeMap<u64, (u64, String)> = BTreeMap::new();
    // Blocks mapped by each inode whose extents are valid; inodes with an extent row that is
    // not are in `bad_extents` (their block counts are left alone).
    let mut mapped: HashMap<u64, u64> = HashMap::new();
    let mut bad_extents: HashSet<u64> = HashSet::new();
    for item in r.open_table(EXTENTS)?.iter()? {
        let (k, v) = item?;
        let ino = k.value();
        bad_extents.insert(ino);
        let extents = match codec::decode_extents(v.value()) {
            Ok(e) => e,
            Err(e) => {
                rep.problem(format!("extents of inode {ino} do not decode: {e}"));
                continue;
            }
        };
        let map = match ExtentMap::from_extents(extents.clone()) {
            Ok(m) => m,
            Err(e) => {
                rep.problem(format!("extents of inode {ino} are not a valid map: {e}"));
                continue;
            }
        };
        if map.to_vec() != extents {
            rep.problem(format!(
                "extents of inode {ino} are not in canonical (merged) form"
            ));
        }
        rep.extents += extents.len() as u64;
        let Some(rec) = inodes.get(&ino) else {
            rep.problem(format!("extents belong to a missing inode {ino}"));
            continue;
        };
        if rec.kind != FileType::Regular {
            rep.problem(format!("inode {ino} has extents but is a {:?}", rec.kind));
        }
        bad_extents.remove(&ino);
        mapped.insert(ino, map.mapped_blocks());
        if rec.blocks != map.mapped_blocks() {
            rep.problem(format!(
                "inode {ino} says {} blocks, its extents map {}",
                rec.blocks,
                map.mapped_blocks()
            ));
            rep.fixes.push(Fix::InodeBlocks {
                ino,
                from: rec.blocks,
                to: map.mapped_blocks(),
            });
        }
        let eof_block = rec.size.div_ceil(bs);
        for e in &extents {
            let end = e.vol_block.saturating_add(e.len_blocks);
            if end > size_blocks || !in_group(e.vol_block, e.len_blocks) {
                rep.problem(format!(
                    "inode {ino}: extent at volume block {}+{} lies outside the volume's allocation groups",
                    e.vol_block, e.len_blocks
                ));
            }
            if e.file_block.saturating_add(e.len_blocks) > max_end_block {
                rep.problem(format!(
                    "inode {ino}: extent at file block {}+{} passes the largest file size ({MAX_FILE_SIZE} bytes)",
                    e.file_block, e.len_blocks
                ));
            }
            if e.state == ExtentState::Written && e.file_block >= eof_block {
                rep.problem(format!(
                    "inode {ino}: written extent at file block {} lies past end of file ({} bytes)",
                    e.file_block, rec.size
                ));
            }
            // Saturating: lengths from a damaged store may be anything.
            rep.used_blocks = rep.used_blocks.saturating_add(e.len_blocks);
            owned.insert(e.vol_block, (e.len_blocks, format!("inode {ino}")));
        }
    }
    for ino in &ids {
        let rec = &inodes[ino];
        if rec.blocks != 0 && !mapped.contains_key(ino) && !bad_extents.contains(ino) {
            rep.problem(format!(
                "inode {ino} says {} blocks but has no extents",
                rec.blocks
            ));
            rep.fixes.push(Fix::InodeBlocks {
                ino: *ino,
                from: rec.blocks,
                to: 0,
            });
        }
    }
    let mut free_list = Vec::new();
    for item in r.open_table(FREE)?.iter()? {
        let (k, v) = item?;
        let (start, len) = (k.value(), v.value());
        rep.free_blocks = rep.free_blocks.saturating_add(len);
        free_list.push((start, len));
        if owned.insert(start, (len, "free space".into())).is_some() {
            rep.problem(format!(
                "volume block {start} starts both free space and an extent"
            ));
        }
    }
    // No block owned twice: sorted by start, each run ends before the next begins.
    let mut prev: Option<(u64, u64, &String)> = None;
    for (start, (len, who)) in &owned {
        if let Some((pstart, pend, pwho)) = prev
            && *start < pend
        {
            rep.problem(format!(
                "volume blocks {start}..{} ({who}) overlap {pstart}..{pend} ({pwho})",
                start.saturating_add(*len)
            ));
        }
        prev = Some((*start, start.saturating_add(*len), who));
    }
    // Two runs with one start keep one entry in `owned`: then the lengths do not add up.
    let space_sound = rep.problems.len() == space_problems_at_start
        && owned
            .values()
            .try_fold(0u64, |sum, (len, _)| sum.checked_add(*len))
            == rep.used_blocks.checked_add(rep.free_blocks);
    match Allocator::from_free(&groups, sb.stripe_unit_blocks, free_list) {
        Ok(a) => {
            rep.capacity_blocks = a.capacity_blocks();
            let accounted = rep.used_blocks.saturating_add(rep.free_blocks);
            if accounted < a.capacity_blocks() && space_sound {
                // Leaked blocks. Only where space is otherwise sound (nothing owned twice,
                // everything inside the groups, the free table valid), so that freeing a gap
                // cannot hand out blocks a file owns.
                for (start, len_blocks) in gaps(&groups, &owned) {
                    rep.problem(format!(
                        "volume blocks {start}..{} are neither free nor owned by a file (leaked)",
                        start.saturating_add(len_blocks)
                    ));
                    rep.fixes.push(Fix::FreeLeaked { start, len_blocks });
                }
            } else if accounted != a.capacity_blocks() {
                rep.problem(format!(
                    "free ({}) + used ({}) = {} blocks, but the volume's allocation groups hold {}",
                    rep.free_blocks,
                    rep.used_blocks,
                    accounted,
                    a.capacity_blocks()
                ));
            }
        }
        Err(e) => rep.problem(format!("the free-space table is not valid: {e}")),
    }

    // --- directory quotas: usage recomputed from the inodes ---
    let mut used: HashMap<u64, (u64, u64)> = HashMap::new();
    for (ino, rec) in &inodes {
        if rec.project != 0 {
            // What the extents map where they are valid (what `--repair` sets the inode's
            // count to), else what the inode says.
            let blocks = match mapped.get(ino) {
                Some(b) => *b,
                None if bad_extents.contains(ino) => rec.blocks,
                None => 0,
            };
            let u = used.entry(rec.project).or_default();
            u.0 = u.0.saturating_add(blocks);
            u.1 += 1;
        }
    }
    let quotas = match r.open_table(QUOTAS) {
        Ok(t) => Some(t),
        Err(redb::TableError::TableDoesNotExist(_)) => None,
        Err(e) => return Err(e.into()),
    };
    let mut quota_dirs = HashSet::new();
    for item in quotas.iter().flat_map(|t| t.iter()).flatten() {
        let (k, v) = item?;
        let dir = k.value();
        let q = crate::quota::QuotaRow::from_tuple(v.value());
        quota_dirs.insert(dir);
        if !inodes.get(&dir).is_some_and(|r| r.is_dir()) {
            rep.problem(format!("quota on {dir}, which is not a directory"));
        }
        let (blocks, count) = used.get(&dir).copied().unwrap_or((0, 0));
        if (q.used_blocks, q.used_inodes) != (blocks, count) {
            rep.problem(format!(
                "quota of directory {dir} says {} blocks and {} inodes used, its inodes hold {blocks} and {count}",
                q.used_blocks, q.used_inodes
            ));
            rep.fixes.push(Fix::QuotaUsage {
                dir,
                blocks,
                inodes: count,
            });
        }
    }
    for project in used.keys() {
        if !quota_dirs.contains(project) {
            rep.problem(format!(
                "inodes are charged to directory {project}, which has no quota"
            ));
        }
    }

    // --- speculative preallocation records ---
    // (A store made before the table existed has none: nothing to check.)
    let prealloc = match r.open_table(PREALLOC) {
        Ok(t) => Some(t),
        Err(redb::TableError::TableDoesNotExist(_)) => None,
        Err(e) => return Err(e.into()),
    };
    for item in prealloc.iter().flat_map(|t| t.iter()).flatten() {
        let (k, v) = item?;
        let (ino, (first, end)) = (k.value(), v.value());
        match inodes.get(&ino) {
            Some(_) if end > max_end_block => rep.problem(format!(
                "preallocation record of inode {ino} ({first}..{end}) passes the largest file size"
            )),
            Some(rec) if rec.kind == FileType::Regular && first <= end => {}
            Some(_) => rep.problem(format!(
                "preallocation record of inode {ino} ({first}..{end}) is not of a regular file"
            )),
            None => rep.problem(format!("preallocation record of a missing inode {ino}")),
        }
    }

    // --- xattrs ---
    for item in r.open_table(XATTRS)?.iter()? {
        let (k, _) = item?;
        let (ino, name) = k.value();
        if !inodes.contains_key(&ino) {
            rep.problem(format!(
                "xattr {:?} belongs to a missing inode {ino}",
                String::from_utf8_lossy(name)
            ));
        }
    }
    Ok(rep)
}

/// The runs inside the allocation groups that `owned` (by start: length, owner; no overlaps)
/// does not cover.
fn gaps(groups: &[(u64, u64)], owned: &BTreeMap<u64, (u64, String)>) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    for &(gs, gl) in groups {
        let ge = gs.saturating_add(gl);
        let mut at = gs;
        // A run that starts before the group may reach into it.
        if let Some((s, (l, _))) = owned.range(..gs).next_back() {
            at = at.max(s.saturating_add(*l));
        }
        for (s, (l, _)) in owned.range(gs..ge) {
            if *s > at {
                out.push((at, s - at));
            }
            at = at.max(s.saturating_add(*l));
        }
        if at < ge {
            out.push((at, ge - at));
        }
    }
    out
}

/// Whether `[start, end)` is covered by consecutive allocation groups.
fn coverage_is_groups(groups: &[(u64, u64)], start: u64, end: u64) -> bool {
    let mut at = start;
    for (gs, gl) in groups {
        let ge = gs.saturating_add(*gl);
        if *gs <= at && at < ge {
            at = ge;
            if at >= end {
                return true;
            }
        }
    }
    false
}
