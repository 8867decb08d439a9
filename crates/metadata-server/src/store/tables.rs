//! The store's tables: their definitions and counter keys, and the typed views
//! ([`Tables`]) that reads and jobs work on.

use super::*;

pub const SUPER: TableDefinition<'_, &str, &[u8]> = TableDefinition::new("super");
pub const COUNTERS: TableDefinition<'_, &str, u64> = TableDefinition::new("counters");
pub const INODES: TableDefinition<'_, u64, &[u8]> = TableDefinition::new("inodes");
/// (directory, name) -> (child inode, readdir cookie, file type code).
pub const DIRENTS: TableDefinition<'_, (u64, &[u8]), (u64, u64, u8)> =
    TableDefinition::new("dirents");
/// (directory, cookie) -> name: readdir order, stable under inserts and removals.
pub const COOKIES: TableDefinition<'_, (u64, u64), &[u8]> = TableDefinition::new("cookies");
/// inode -> the file's extent list (`codec::encode_extents`).
pub const EXTENTS: TableDefinition<'_, u64, &[u8]> = TableDefinition::new("extents");
/// Free space by start block: start -> length in blocks (mirrors the allocator).
pub const FREE: TableDefinition<'_, u64, u64> = TableDefinition::new("free");
/// (inode, name) -> value.
pub const XATTRS: TableDefinition<'_, (u64, &[u8]), &[u8]> = TableDefinition::new("xattrs");
/// Inodes with no links left that were still open: reaped at last close or next start.
pub const ORPHANS: TableDefinition<'_, u64, ()> = TableDefinition::new("orphans");
/// Speculative preallocation: inode -> file blocks `[first, end)` allocated ahead of a
/// sequential writer; trimmed (past end of file) at the file's last close or the next start.
pub const PREALLOC: TableDefinition<'_, u64, (u64, u64)> = TableDefinition::new("prealloc");
/// Volume blocks that became Unwritten for a client (allocated for a write grant or by
/// fallocate, or converted by ZERO_RANGE) and are not zeroed on the LUNs yet: start block ->
/// length in blocks. Written in the transaction that hands the blocks out; the server zeroes
/// them before any grant of them leaves, and at the next start (`DataPath::zero_fresh`).
pub const UNZEROED: TableDefinition<'_, u64, u64> = TableDefinition::new("unzeroed");
/// Directory quotas: directory inode -> (byte limit, inode limit, blocks used, inodes used);
/// `u64::MAX` is "no limit" (see `quota.rs`).
pub const QUOTAS: TableDefinition<'_, u64, (u64, u64, u64, u64)> = TableDefinition::new("quotas");
/// The reply cache of non-idempotent requests: (agent instance, request seq) -> the encoded
/// reply (see `replies.rs`), written in the transaction of the change it answers.
pub const REPLIES: TableDefinition<'_, (u64, u64), &[u8]> = TableDefinition::new("replies");
/// Sessions that may hold lazily committed completions: session id -> the epoch it was opened
/// in. Inserted durably at a session's first lazy completion, removed (lazily) when the
/// session ends; after a restart the sessions found here are the ones the reclaim window
/// waits for.
pub const SESSIONS: TableDefinition<'_, u64, u64> = TableDefinition::new("sessions");

pub(super) const KEY_SUPER: &str = "super";
pub(super) const KEY_VOLUME: &str = "volume";
/// The paths of LUNs added by growths (`GrownDevices`, `SGD1`); absent: none.
pub(super) const KEY_GROWN_DEVICES: &str = "grown_devices";
pub(super) const KEY_NEXT_INODE: &str = "next_inode";
pub(super) const KEY_GENERATION: &str = "generation";
pub(super) const KEY_BOOT_EPOCH: &str = "boot_epoch";
/// How many times the store was restored from a backup (`sanfs-mds restore`); absent: 0.
pub(super) const KEY_RESTORES: &str = "restores";
/// 1 while agents may hold advisory locks (set durably before the first lock of a run is
/// granted, cleared by a clean stop with none held): a start that finds it set gives agents a
/// grace period to reclaim their locks.
pub(super) const KEY_LOCKS_IN_USE: &str = "advisory_locks_in_use";
/// The number and epoch of the last commit, written by every commit: after a restart they
/// name the last commit that survived (commits survive as a prefix: a durable commit makes
/// every earlier one durable).
pub(super) const KEY_LAST_COMMIT: &str = "last_commit_seq";
pub(super) const KEY_LAST_COMMIT_EPOCH: &str = "last_commit_epoch";

/// The root directory's inode number.
pub const ROOT: u64 = 1;

/// The tables an operation works on. Read-only in [`Store::read`], writable in [`Ctx`].
pub struct Tables<I, D, C, E, X> {
    pub inodes: I,
    pub dirents: D,
    pub cookies: C,
    pub extents: E,
    pub xattrs: X,
}

pub type ReadTables = Tables<
    ReadOnlyTable<u64, &'static [u8]>,
    ReadOnlyTable<(u64, &'static [u8]), (u64, u64, u8)>,
    ReadOnlyTable<(u64, u64), &'static [u8]>,
    ReadOnlyTable<u64, &'static [u8]>,
    ReadOnlyTable<(u64, &'static [u8]), &'static [u8]>,
>;

pub type WriteTables<'t> = Tables<
    Table<'t, u64, &'static [u8]>,
    Table<'t, (u64, &'static [u8]), (u64, u64, u8)>,
    Table<'t, (u64, u64), &'static [u8]>,
    Table<'t, u64, &'static [u8]>,
    Table<'t, (u64, &'static [u8]), &'static [u8]>,
>;

impl<I, D, C, E, X> Tables<I, D, C, E, X>
where
    I: ReadableTable<u64, &'static [u8]>,
    D: ReadableTable<(u64, &'static [u8]), (u64, u64, u8)>,
    C: ReadableTable<(u64, u64), &'static [u8]>,
    E: ReadableTable<u64, &'static [u8]>,
    X: ReadableTable<(u64, &'static [u8]), &'static [u8]>,
{
    /// The attributes of `ino` as read now, with whether it has no extended attribute (what
    /// an attribute lease on them covers too: `SetXattr` and `RemoveXattr` recall it).
    pub fn read_attr(
        &self,
        ino: InodeId,
        block_size: u32,
    ) -> Result<sanfs_proto::types::Attr, OpError> {
        let mut attr = self.inode(ino)?.attr(ino, block_size);
        attr.no_xattrs = match self.xattrs.range((ino.0, &[][..])..)?.next() {
            None => true,
            Some(item) => item?.0.value().0 != ino.0,
        };
        Ok(attr)
    }

    /// The inode, or ENOENT.
    pub fn inode(&self, ino: InodeId) -> Result<InodeRec, OpError> {
        self.try_inode(ino)?.ok_or(OpError::Fs(FsError::NotFound))
    }

    pub fn try_inode(&self, ino: InodeId) -> Result<Option<InodeRec>, OpError> {
        match self.inodes.get(ino.0)? {
            None => Ok(None),
            Some(v) => InodeRec::decode(v.value())
                .map(Some)
                .map_err(|e| corrupt(format_args!("inode {}", ino.0), e)),
        }
    }

    /// The entry `name` of directory `dir`: (child, cookie, type).
    pub fn dirent(
        &self,
        dir: InodeId,
        name: &[u8],
    ) -> Result<Option<(InodeId, u64, FileType)>, OpError> {
        match self.dirents.get((dir.0, name))? {
            None => Ok(None),
            Some(v) => {
                let (child, cookie, code) = v.value();
                let kind = records::kind_from_code(code)
                    .map_err(|e| corrupt(format_args!("entry in directory {}", dir.0), e))?;
                Ok(Some((InodeId(child), cookie, kind)))
            }
        }
    }

    /// The file's extents (empty if it has none).
    pub fn extents(&self, ino: InodeId) -> Result<Vec<sanfs_blockmap::extent::Extent>, OpError> {
        match self.extents.get(ino.0)? {
            None => Ok(Vec::new()),
            Some(v) => codec::decode_extents(v.value())
                .map_err(|e| corrupt(format_args!("extents of inode {}", ino.0), e)),
        }
    }

    /// The file's extents as a map (checked canonical form).
    pub fn extent_map(&self, ino: InodeId) -> Result<sanfs_blockmap::extent::ExtentMap, OpError> {
        sanfs_blockmap::extent::ExtentMap::from_extents(self.extents(ino)?)
            .map_err(|e| corrupt(format_args!("extents of inode {}", ino.0), e))
    }

    pub fn xattr(&self, ino: InodeId, name: &[u8]) -> Result<Option<Vec<u8>>, OpError> {
        Ok(self.xattrs.get((ino.0, name))?.map(|v| v.value().to_vec()))
    }
}

/// Raw inode and extent access on any view of the tables, for read-side helpers that take a
/// snapshot or a write context alike.
pub trait ReaderInodes {
    fn inode_rec(&self, ino: InodeId) -> Result<InodeRec, OpError>;
    fn extent_map_of(&self, ino: InodeId) -> Result<sanfs_blockmap::extent::ExtentMap, OpError>;
}

impl<I, D, C, E, X> ReaderInodes for Tables<I, D, C, E, X>
where
    I: ReadableTable<u64, &'static [u8]>,
    D: ReadableTable<(u64, &'static [u8]), (u64, u64, u8)>,
    C: ReadableTable<(u64, u64), &'static [u8]>,
    E: ReadableTable<u64, &'static [u8]>,
    X: ReadableTable<(u64, &'static [u8]), &'static [u8]>,
{
    fn inode_rec(&self, ino: InodeId) -> Result<InodeRec, OpError> {
        self.inode(ino)
    }

    fn extent_map_of(&self, ino: InodeId) -> Result<sanfs_blockmap::extent::ExtentMap, OpError> {
        self.extent_map(ino)
    }
}

impl WriteTables<'_> {
    pub fn put_inode(&mut self, ino: InodeId, rec: &InodeRec) -> Result<(), OpError> {
        self.inodes.insert(ino.0, rec.encode().as_slice())?;
        Ok(())
    }
}

/// The namespace tables of a read transaction.
pub fn read_tables(r: &redb::ReadTransaction) -> Result<ReadTables, OpError> {
    Ok(Tables {
        inodes: r.open_table(INODES)?,
        dirents: r.open_table(DIRENTS)?,
        cookies: r.open_table(COOKIES)?,
        extents: r.open_table(EXTENTS)?,
        xattrs: r.open_table(XATTRS)?,
    })
}

/// Table `def` in a read transaction, or `None` in a store that never had it.
pub fn open_if_exists<K: redb::Key + 'static, V: redb::Value + 'static>(
    r: &redb::ReadTransaction,
    def: TableDefinition<'_, K, V>,
) -> Result<Option<ReadOnlyTable<K, V>>, OpError> {
    match r.open_table(def) {
        Ok(t) => Ok(Some(t)),
        Err(redb::TableError::TableDoesNotExist(_)) => Ok(None),
        Err(e) => Err(e.into()),
    }
}
