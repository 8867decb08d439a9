//! The durable metadata store: redb tables, and the committer that batches concurrent
//! operations into one durable commit (group commit).
//!
//! Every change goes through [`Store::write`]: a job (a closure over [`Ctx`]) is queued to the
//! committer thread, which runs all the jobs that are waiting in one redb write transaction
//! and commits it with `Durability::Immediate`; only then does any job's caller get its answer.
//! So an operation is acknowledged only once durable, and concurrent operations share one
//! sync. A job must check everything that can fail *before* it changes anything: a job that
//! answers with an error leaves no trace, which is what makes one transaction per batch safe.
//!
//! Reads ([`Store::read`]) run on the caller's thread in a redb read transaction (MVCC): they
//! never wait for the committer and always see every acknowledged change.
//!
//! A failed commit or a storage error poisons the store (fail-stop, as redb itself does):
//! every later operation answers EIO and [`Store::poisoned`] tells the server to stop.
//! Restarting re-reads the durable state.

pub mod backend;
pub mod records;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, mpsc};

use redb::{
    Database, ReadOnlyTable, ReadableDatabase, ReadableTable, ReadableTableMetadata, Table,
    TableDefinition, WriteTransaction,
};
use sanfs_blockmap::alloc::Allocator;
use sanfs_blockmap::codec;
use sanfs_blockmap::volume::Volume;
use sanfs_proto::types::{FileType, FsError, Timestamp};
use uuid::Uuid;

use crate::clock::Clock;
use backend::{BlockDeviceBackend, SimDisk};
use records::{InodeRec, STORE_FORMAT_VERSION, Superblock};

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

const KEY_SUPER: &str = "super";
const KEY_VOLUME: &str = "volume";
const KEY_NEXT_INODE: &str = "next_inode";
const KEY_GENERATION: &str = "generation";
const KEY_BOOT_EPOCH: &str = "boot_epoch";
/// 1 while agents may hold advisory locks (set durably before the first lock of a run is
/// granted, cleared by a clean stop with none held): a start that finds it set gives agents a
/// grace period to reclaim their locks.
const KEY_LOCKS_IN_USE: &str = "advisory_locks_in_use";
/// The number and epoch of the last commit, written by every commit: after a restart they
/// name the last commit that survived (commits survive as a prefix: a durable commit makes
/// every earlier one durable).
const KEY_LAST_COMMIT: &str = "last_commit_seq";
const KEY_LAST_COMMIT_EPOCH: &str = "last_commit_epoch";

/// Lazily committed work older than this is made durable by the committer on its own (as
/// ext4's commit interval), so that agents' records of lazy completions stay few.
pub const LAZY_SYNC_AFTER: std::time::Duration = std::time::Duration::from_secs(1);

/// The root directory's inode number.
pub const ROOT: u64 = 1;

/// Why a job failed: a file-system answer for the caller, or a storage failure that poisons
/// the store.
#[derive(Debug)]
pub enum OpError {
    Fs(FsError),
    Store(String),
}

impl From<FsError> for OpError {
    fn from(e: FsError) -> OpError {
        OpError::Fs(e)
    }
}

macro_rules! store_errors {
    ($($t:ty),*) => {$(
        impl From<$t> for OpError {
            fn from(e: $t) -> OpError {
                OpError::Store(e.to_string())
            }
        }
    )*};
}
store_errors!(
    redb::StorageError,
    redb::TableError,
    redb::TransactionError,
    redb::CommitError,
    redb::DatabaseError
);

/// A record that does not decode: the operation fails with EIO, the store stays up.
pub fn corrupt(what: impl std::fmt::Display, e: impl std::fmt::Display) -> OpError {
    OpError::Fs(FsError::Io(format!("corrupt metadata: {what}: {e}")))
}

/// Errors of opening or creating a store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("metadata store: {0}")]
    Redb(String),
    #[error("metadata store is corrupt: {0}")]
    Corrupt(String),
    #[error("metadata store at {0} already exists (use --force to replace it)")]
    Exists(PathBuf),
    #[error("metadata store I/O: {0}")]
    Io(#[from] std::io::Error),
    /// The storage library failed (panicked) on the store's bytes: the image is damaged.
    #[error("metadata store damaged: {0}")]
    Damaged(String),
    /// The store was not shut down cleanly and a read-only open cannot read it as it is.
    #[error(
        "metadata store needs repair (it was not shut down cleanly); nothing was changed: \
         run `sanfs-mds fsck --repair` (or start the server, which repairs it on open)"
    )]
    NeedsRepair,
    /// Another process (a running server) holds the store's lock.
    #[error(
        "metadata store is in use (another process, such as a running sanfs-mds serve, holds \
         its lock): stop that server first"
    )]
    InUse,
}

impl StoreError {
    /// From an error of opening the database (read-only or not).
    fn from_open(e: redb::DatabaseError) -> StoreError {
        match e {
            redb::DatabaseError::DatabaseAlreadyOpen => StoreError::InUse,
            redb::DatabaseError::RepairAborted => StoreError::NeedsRepair,
            redb::DatabaseError::Storage(e) => StoreError::from(e),
            other => StoreError::Redb(other.to_string()),
        }
    }
}

/// Runs `f` (an open, a repair, a full read of the store) so that a panic of the storage
/// library on damaged bytes becomes [`StoreError::Damaged`] instead of taking the process
/// down. redb 4 panics on some torn images (assertions and slice bounds in its page and
/// B-tree code, see docs/operations.md, "Damaged stores"); a failure of ours would be a bug,
/// but it is caught the same way. The panic message is printed by the panic hook (no abort:
/// the profile unwinds) and carried in the error.
pub fn guard_damage<T>(
    what: &str,
    f: impl FnOnce() -> Result<T, StoreError>,
) -> Result<T, StoreError> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(payload) => {
            let msg = payload
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".to_owned());
            Err(StoreError::Damaged(format!(
                "{what}: the storage library failed on the store's bytes ({msg})"
            )))
        }
    }
}

impl From<OpError> for StoreError {
    fn from(e: OpError) -> StoreError {
        match e {
            OpError::Fs(e) => StoreError::Corrupt(e.to_string()),
            OpError::Store(s) => StoreError::Redb(s),
        }
    }
}

macro_rules! store_open_errors {
    ($($t:ty),*) => {$(
        impl From<$t> for StoreError {
            fn from(e: $t) -> StoreError {
                StoreError::Redb(e.to_string())
            }
        }
    )*};
}
store_open_errors!(redb::TableError, redb::TransactionError, redb::CommitError);

impl From<redb::StorageError> for StoreError {
    fn from(e: redb::StorageError) -> StoreError {
        match e {
            redb::StorageError::Corrupted(why) => StoreError::Damaged(why),
            other => StoreError::Redb(other.to_string()),
        }
    }
}

impl From<redb::DatabaseError> for StoreError {
    fn from(e: redb::DatabaseError) -> StoreError {
        StoreError::from_open(e)
    }
}

/// Where the store lives.
#[derive(Debug, Clone)]
pub enum Backend {
    /// A file on local disk (the default).
    File(PathBuf),
    /// A block device of its own.
    Device(PathBuf),
    /// The crash-simulating disk (crash tests).
    Sim(SimDisk),
}

/// What `format` decided, for [`Store::create`].
#[derive(Debug, Clone)]
pub struct FsInfo {
    pub fs_uuid: Uuid,
    pub volume: Volume,
    pub lvm: Option<(String, String)>,
}

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
    /// The inode, or ENOENT.
    pub fn inode(&self, ino: u64) -> Result<InodeRec, OpError> {
        self.try_inode(ino)?.ok_or(OpError::Fs(FsError::NotFound))
    }

    pub fn try_inode(&self, ino: u64) -> Result<Option<InodeRec>, OpError> {
        match self.inodes.get(ino)? {
            None => Ok(None),
            Some(v) => InodeRec::decode(v.value())
                .map(Some)
                .map_err(|e| corrupt(format_args!("inode {ino}"), e)),
        }
    }

    /// The entry `name` of directory `dir`: (child, cookie, type).
    pub fn dirent(&self, dir: u64, name: &[u8]) -> Result<Option<(u64, u64, FileType)>, OpError> {
        match self.dirents.get((dir, name))? {
            None => Ok(None),
            Some(v) => {
                let (child, cookie, code) = v.value();
                let kind = records::kind_from_code(code)
                    .map_err(|e| corrupt(format_args!("entry in directory {dir}"), e))?;
                Ok(Some((child, cookie, kind)))
            }
        }
    }

    /// The file's extents (empty if it has none).
    pub fn extents(&self, ino: u64) -> Result<Vec<sanfs_blockmap::extent::Extent>, OpError> {
        match self.extents.get(ino)? {
            None => Ok(Vec::new()),
            Some(v) => codec::decode_extents(v.value())
                .map_err(|e| corrupt(format_args!("extents of inode {ino}"), e)),
        }
    }

    /// The file's extents as a map (checked canonical form).
    pub fn extent_map(&self, ino: u64) -> Result<sanfs_blockmap::extent::ExtentMap, OpError> {
        sanfs_blockmap::extent::ExtentMap::from_extents(self.extents(ino)?)
            .map_err(|e| corrupt(format_args!("extents of inode {ino}"), e))
    }

    pub fn xattr(&self, ino: u64, name: &[u8]) -> Result<Option<Vec<u8>>, OpError> {
        Ok(self.xattrs.get((ino, name))?.map(|v| v.value().to_vec()))
    }
}

impl WriteTables<'_> {
    pub fn put_inode(&mut self, ino: u64, rec: &InodeRec) -> Result<(), OpError> {
        self.inodes.insert(ino, rec.encode().as_slice())?;
        Ok(())
    }
}

/// What the committer keeps in memory next to the tables (rebuilt from them at start).
pub struct State {
    pub alloc: Allocator,
    pub next_inode: u64,
    pub generation: u64,
    /// Open handles (not durable: they die with their sessions and with the server).
    pub handles: Arc<Mutex<Handles>>,
    /// Blocks free and inodes in use, published after each commit for statfs.
    pub usage: Arc<Usage>,
}

/// Open file handles: which inode each names, and how many are open per inode (an inode
/// with no links left lives on as an orphan until its last handle is released).
#[derive(Debug, Default)]
pub struct Handles {
    pub next: u64,
    pub by_handle: HashMap<u64, OpenFile>,
    pub open_count: HashMap<u64, u32>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpenFile {
    pub ino: u64,
    pub session: u64,
    pub write: bool,
}

impl Handles {
    pub fn open(&mut self, ino: u64, session: u64, write: bool) -> u64 {
        self.next += 1;
        let h = self.next;
        self.by_handle.insert(
            h,
            OpenFile {
                ino,
                session,
                write,
            },
        );
        *self.open_count.entry(ino).or_insert(0) += 1;
        h
    }

    /// Forgets a handle; returns its file and whether that was the inode's last handle.
    pub fn release(&mut self, handle: u64) -> Option<(OpenFile, bool)> {
        let f = self.by_handle.remove(&handle)?;
        let last = match self.open_count.get_mut(&f.ino) {
            Some(n) if *n > 1 => {
                *n -= 1;
                false
            }
            _ => {
                self.open_count.remove(&f.ino);
                true
            }
        };
        Some((f, last))
    }

    pub fn is_open(&self, ino: u64) -> bool {
        self.open_count.contains_key(&ino)
    }
}

/// Space and inode usage for statfs, published by the committer after every commit.
#[derive(Debug, Default)]
pub struct Usage {
    pub free_blocks: AtomicU64,
    pub total_blocks: AtomicU64,
    pub inodes: AtomicU64,
}

/// One batch's view of the store, handed to each job in turn.
pub struct Ctx<'t> {
    pub t: WriteTables<'t>,
    pub free: Table<'t, u64, u64>,
    pub counters: Table<'t, &'static str, u64>,
    pub orphans: Table<'t, u64, ()>,
    pub prealloc: Table<'t, u64, (u64, u64)>,
    pub quotas: Table<'t, u64, (u64, u64, u64, u64)>,
    pub unzeroed: Table<'t, u64, u64>,
    pub replies: Table<'t, (u64, u64), &'static [u8]>,
    pub sessions: Table<'t, u64, u64>,
    pub st: &'t mut State,
    pub now: Timestamp,
    pub block_size: u32,
}

/// A job's answer, called with its commit's number once that commit is done (or failed).
type Reply = Box<dyn FnOnce(Result<u64, String>) + Send>;
type Run = Box<dyn for<'t> FnOnce(&mut Ctx<'t>) -> (Reply, bool) + Send>;

/// A queued change. A `lazy` one may be committed without a sync: it becomes durable with the
/// next durable commit (any non-lazy job, or [`Store::sync`]), and a crash before that loses
/// it whole (never half of it).
struct Job {
    run: Run,
    lazy: bool,
}

/// Counters of the committer, for metrics and the bench.
#[derive(Debug, Default)]
pub struct CommitStats {
    pub commits: AtomicU64,
    pub ops: AtomicU64,
    pub failed_ops: AtomicU64,
}

struct Shared {
    /// The number of the last commit of this run (commits are numbered from 1 at every start).
    commit_seq: AtomicU64,
    /// Every commit of this run up to this number is durable.
    durable_seq: AtomicU64,
    poisoned: AtomicBool,
    reason: Mutex<Option<String>>,
    poison_notify: tokio::sync::Notify,
    stats: CommitStats,
}

impl Shared {
    fn poison(&self, why: String) {
        tracing::error!(reason = %why, "metadata store failed: stopping (fail-stop)");
        let mut r = self.reason.lock().unwrap_or_else(|p| p.into_inner());
        if r.is_none() {
            *r = Some(why);
        }
        self.poisoned.store(true, Ordering::SeqCst);
        self.poison_notify.notify_waiters();
    }

    fn poison_error(&self) -> FsError {
        let r = self.reason.lock().unwrap_or_else(|p| p.into_inner());
        FsError::Io(format!(
            "metadata store failed and must be restarted: {}",
            r.as_deref().unwrap_or("unknown")
        ))
    }
}

/// The metadata store.
pub struct Store {
    /// The database; `None` once closed (its file lock is released then).
    db: std::sync::RwLock<Option<Arc<Database>>>,
    sb: Superblock,
    volume: Arc<Volume>,
    jobs: Mutex<Option<mpsc::Sender<Job>>>,
    committer: Mutex<Option<std::thread::JoinHandle<()>>>,
    shared: Arc<Shared>,
    clock: Clock,
    handles: Arc<Mutex<Handles>>,
    usage: Arc<Usage>,
    boot_epoch: u64,
    locks_in_use_at_start: bool,
    /// The (epoch, number) of the last commit that survived the last stop.
    survived: (u64, u64),
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("fs_uuid", &self.sb.fs_uuid)
            .finish()
    }
}

/// How an existing store is opened read-write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verify {
    /// Trust a cleanly closed store as it is (redb's plain open; recovery only after a crash).
    Trust,
    /// Verify the checksum of every page of the committed trees and rebuild the allocator
    /// state at every open (redb's integrity check on open): a store altered outside redb (a
    /// torn image, a bad restore) is refused as corrupt instead of trusted, where a plain open
    /// may panic or serve garbage. The server's open does this.
    Pages,
}

fn builder(verify: Verify) -> redb::Builder {
    let mut b = Database::builder();
    b.set_check_integrity_on_open(verify == Verify::Pages);
    b.set_repair_callback(move |session| {
        if verify == Verify::Pages {
            tracing::debug!(
                progress = session.progress(),
                "metadata store: verifying page checksums"
            );
        } else {
            tracing::warn!(
                progress = session.progress(),
                "metadata store: repairing after an unclean shutdown"
            );
        }
    });
    b
}

pub(crate) fn open_db(
    backend: &Backend,
    create: bool,
    force: bool,
    verify: Verify,
) -> Result<Database, StoreError> {
    let b = builder(verify);
    Ok(match backend {
        Backend::File(path) => {
            if create && path.exists() && std::fs::metadata(path)?.len() > 0 {
                if !force {
                    return Err(StoreError::Exists(path.clone()));
                }
                std::fs::remove_file(path)?;
            }
            if create {
                b.create(path)?
            } else {
                if !path.exists() {
                    return Err(no_store(path));
                }
                b.open(path)?
            }
        }
        Backend::Device(path) => {
            let (file, capacity) = open_device(path, true)?;
            if create {
                b.create_with_backend(BlockDeviceBackend::initialise(file, capacity)?)?
            } else {
                b.create_with_backend(BlockDeviceBackend::open(file, capacity)?)?
            }
        }
        Backend::Sim(disk) => b.create_with_backend(disk.clone())?,
    })
}

/// Opens an existing store without changing a byte of it (fsck): a store that needs redb's
/// repair answers [`StoreError::NeedsRepair`], one held by a running server
/// [`StoreError::InUse`]. Run inside [`guard_damage`].
pub(crate) fn open_db_read_only(backend: &Backend) -> Result<redb::ReadOnlyDatabase, StoreError> {
    let b = builder(Verify::Trust);
    match backend {
        Backend::File(path) => {
            if !path.exists() {
                return Err(no_store(path));
            }
            Ok(b.open_read_only(path)?)
        }
        Backend::Device(path) => {
            let (file, capacity) = open_device(path, false)?;
            Ok(b.open_read_only_with_backend(BlockDeviceBackend::open(file, capacity)?)?)
        }
        Backend::Sim(disk) => Ok(b.open_read_only_with_backend(disk.clone())?),
    }
}

/// The store's bytes, read without changing them (to repair a copy in memory: `--dry-run`).
pub(crate) fn read_image(backend: &Backend) -> Result<Vec<u8>, StoreError> {
    use redb::StorageBackend;
    let read_all = |b: &dyn StorageBackend| -> Result<Vec<u8>, StoreError> {
        let len = usize::try_from(b.len()?)
            .map_err(|_| StoreError::Damaged("the store's length does not fit in memory".into()))?;
        let mut buf = vec![0u8; len];
        b.read(0, &mut buf)?;
        Ok(buf)
    };
    match backend {
        Backend::File(path) => {
            if !path.exists() {
                return Err(no_store(path));
            }
            Ok(std::fs::read(path)?)
        }
        Backend::Device(path) => {
            let (file, capacity) = open_device(path, false)?;
            read_all(&BlockDeviceBackend::open(file, capacity)?)
        }
        Backend::Sim(disk) => read_all(disk),
    }
}

fn no_store(path: &std::path::Path) -> StoreError {
    StoreError::Io(std::io::Error::new(
        std::io::ErrorKind::NotFound,
        format!(
            "no metadata store at {} (run sanfs-mds format)",
            path.display()
        ),
    ))
}

fn open_device(path: &std::path::Path, write: bool) -> Result<(std::fs::File, u64), StoreError> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(write)
        .open(path)?;
    let capacity = {
        use std::io::Seek;
        let mut f = &file;
        f.seek(std::io::SeekFrom::End(0))?
    };
    Ok((file, capacity))
}

impl Store {
    /// Initialises a new store: the super record, the volume, all space free, and the root
    /// directory (mode 0755, owned by root). Refuses an existing file store unless `force`.
    pub fn create(
        backend: &Backend,
        info: &FsInfo,
        force: bool,
        clock: &Clock,
    ) -> Result<(), StoreError> {
        let db = open_db(backend, true, force, Verify::Trust)?;
        let now = clock.now();
        let volume = &info.volume;
        let block_size = volume.block_size();
        let stripe_unit_blocks = volume
            .stripe_geometry_at(0)
            .map(|(su, width)| {
                if width > 1 {
                    su / u64::from(block_size)
                } else {
                    0
                }
            })
            .unwrap_or(0);
        let sb = Superblock {
            format_version: STORE_FORMAT_VERSION,
            fs_uuid: info.fs_uuid,
            block_size,
            stripe_unit_blocks,
            created: now,
            lvm: info.lvm.clone(),
        };
        let alloc = Allocator::new(&volume.allocation_groups(), stripe_unit_blocks)
            .map_err(|e| StoreError::Corrupt(format!("volume allocation groups: {e}")))?;
        let mut txn = db.begin_write()?;
        txn.set_quick_repair(true);
        {
            let mut sup = txn.open_table(SUPER)?;
            sup.insert(KEY_SUPER, sb.encode().as_slice())?;
            sup.insert(KEY_VOLUME, codec::encode_volume(volume).as_slice())?;
            let mut counters = txn.open_table(COUNTERS)?;
            counters.insert(KEY_NEXT_INODE, ROOT + 1)?;
            counters.insert(KEY_GENERATION, 1)?;
            let mut free = txn.open_table(FREE)?;
            for (start, len) in alloc.free_extents() {
                free.insert(start, len)?;
            }
            let root = InodeRec {
                kind: FileType::Directory,
                perm: 0o755,
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
                generation: 1,
                parent: ROOT,
                next_cookie: sanfs_proto::model::FIRST_DIR_COOKIE,
                target: Vec::new(),
                project: 0,
            };
            txn.open_table(INODES)?
                .insert(ROOT, root.encode().as_slice())?;
            // Create the remaining tables so that readers always find them.
            txn.open_table(DIRENTS)?;
            txn.open_table(COOKIES)?;
            txn.open_table(EXTENTS)?;
            txn.open_table(XATTRS)?;
            txn.open_table(ORPHANS)?;
            txn.open_table(PREALLOC)?;
            txn.open_table(QUOTAS)?;
            txn.open_table(REPLIES)?;
            txn.open_table(SESSIONS)?;
        }
        txn.commit()?;
        Ok(())
    }

    /// Opens an existing store and starts its committer. Orphans left by a crash are reaped
    /// and preallocations trimmed ([`Store::recover_after_restart`]). A store not shut down
    /// cleanly is repaired by redb on the way; a damaged one on which the storage library
    /// fails is refused with [`StoreError::Damaged`], never a panic.
    pub fn open(backend: &Backend, clock: Clock, batch_max: usize) -> Result<Store, StoreError> {
        let store = Store::open_deferring_recovery(backend, clock, batch_max)?;
        store.recover_after_restart()?;
        Ok(store)
    }

    /// [`Store::open`] without the recovery that frees space: the server runs
    /// [`Store::recover_after_restart`] once the reclaim window is over, because agents
    /// replay completions into blocks that it would free (Unwritten blocks past a size that
    /// went back with a lost lazy commit).
    pub fn open_deferring_recovery(
        backend: &Backend,
        clock: Clock,
        batch_max: usize,
    ) -> Result<Store, StoreError> {
        guard_damage("open the metadata store", || {
            Store::open_unguarded(backend, clock, batch_max)
        })
    }

    fn open_unguarded(
        backend: &Backend,
        clock: Clock,
        batch_max: usize,
    ) -> Result<Store, StoreError> {
        let db = open_db(backend, false, false, Verify::Pages)?;
        let (sb, volume, state) = load(&db)?;
        let boot_epoch = bump_boot_epoch(&db)?;
        let (locks_in_use_at_start, survived) = {
            let r = db.begin_read()?;
            let counters = r.open_table(COUNTERS)?;
            let get = |k: &str| -> Result<u64, StoreError> {
                Ok(counters.get(k)?.map_or(0, |v| v.value()))
            };
            (
                get(KEY_LOCKS_IN_USE)? != 0,
                (get(KEY_LAST_COMMIT_EPOCH)?, get(KEY_LAST_COMMIT)?),
            )
        };
        let handles = state.handles.clone();
        let usage = state.usage.clone();
        let shared = Arc::new(Shared {
            commit_seq: AtomicU64::new(0),
            durable_seq: AtomicU64::new(0),
            poisoned: AtomicBool::new(false),
            reason: Mutex::new(None),
            poison_notify: tokio::sync::Notify::new(),
            stats: CommitStats::default(),
        });
        let db = Arc::new(db);
        let (tx, rx) = mpsc::channel::<Job>();
        let committer = {
            let db = db.clone();
            let shared = shared.clone();
            let clock = clock.clone();
            let block_size = sb.block_size;
            std::thread::Builder::new()
                .name("sanfs-committer".into())
                .spawn(move || {
                    committer_loop(
                        &db,
                        &rx,
                        state,
                        &shared,
                        &clock,
                        block_size,
                        batch_max.max(1),
                        boot_epoch,
                    )
                })?
        };
        let store = Store {
            db: std::sync::RwLock::new(Some(db)),
            sb,
            volume: Arc::new(volume),
            jobs: Mutex::new(Some(tx)),
            committer: Mutex::new(Some(committer)),
            shared,
            clock,
            handles,
            usage,
            boot_epoch,
            locks_in_use_at_start,
            survived,
        };
        Ok(store)
    }

    /// The recovery of a start that frees space: inodes unlinked while open are reaped, and
    /// preallocations trimmed past their files' ends (no handle survives a restart).
    /// Idempotent. Blocking.
    pub fn recover_after_restart(&self) -> Result<(), StoreError> {
        self.reap_orphans()?;
        self.trim_preallocations()
    }

    /// The (epoch, number) of the last commit of an earlier run that survived the last stop:
    /// a commit `(e, n)` of epoch `e == survived.0` with `n <= survived.1` is durable.
    pub fn survived(&self) -> (u64, u64) {
        self.survived
    }

    /// Every commit of this run up to this number is durable.
    pub fn durable_seq(&self) -> u64 {
        self.shared.durable_seq.load(Ordering::SeqCst)
    }

    /// The sessions found in the store (id, epoch opened), for the reclaim window.
    pub fn recorded_sessions(&self) -> Result<Vec<(u64, u64)>, FsError> {
        let run = || -> Result<Vec<(u64, u64)>, OpError> {
            let r = self.database()?.begin_read()?;
            let t = match r.open_table(SESSIONS) {
                Ok(t) => t,
                Err(redb::TableError::TableDoesNotExist(_)) => return Ok(Vec::new()),
                Err(e) => return Err(e.into()),
            };
            let mut all = Vec::new();
            for item in t.iter()? {
                let (k, v) = item?;
                all.push((k.value(), v.value()));
            }
            Ok(all)
        };
        run().map_err(|e| match e {
            OpError::Fs(e) => e,
            OpError::Store(why) => FsError::Io(format!("metadata store: {why}")),
        })
    }

    fn reap_orphans(&self) -> Result<(), StoreError> {
        let orphans: Vec<u64> = {
            let r = self.database()?.begin_read()?;
            let t = r.open_table(ORPHANS)?;
            t.iter()?
                .map(|e| e.map(|(k, _)| k.value()))
                .collect::<Result<_, _>>()?
        };
        for ino in orphans {
            tracing::info!(
                ino,
                "reaping an inode unlinked while open before the last stop"
            );
            self.write_blocking(move |ctx| crate::ns::destroy_inode(ctx, ino))
                .map_err(|e| StoreError::Corrupt(e.to_string()))?;
        }
        Ok(())
    }

    /// This start's epoch: one more than the last start's, durably. Grants and sessions carry
    /// it, so that nothing issued before a restart is honoured after it.
    pub fn boot_epoch(&self) -> u64 {
        self.boot_epoch
    }

    /// Whether the last run may have ended with advisory locks held (then agents reclaim them
    /// in a grace period).
    pub fn locks_in_use_at_start(&self) -> bool {
        self.locks_in_use_at_start
    }

    /// Durably records whether agents may hold advisory locks (see `KEY_LOCKS_IN_USE`).
    pub async fn set_locks_in_use(&self, in_use: bool) -> Result<(), FsError> {
        self.write(move |ctx| {
            ctx.counters.insert(KEY_LOCKS_IN_USE, u64::from(in_use))?;
            Ok(())
        })
        .await
    }

    /// No handle survives a restart: every speculative preallocation left by the last run is
    /// trimmed past its file's end.
    fn trim_preallocations(&self) -> Result<(), StoreError> {
        let freed = self
            .write_blocking(|ctx| {
                let mut all = Vec::new();
                for item in ctx.prealloc.iter()? {
                    let (k, v) = item?;
                    all.push((k.value(), v.value()));
                }
                let mut freed = 0;
                for (ino, (first, end)) in all {
                    ctx.prealloc.remove(ino)?;
                    freed += crate::data::trim_unwritten_past_eof(ctx, ino, first, end)?;
                }
                Ok(freed)
            })
            .map_err(|e| StoreError::Corrupt(e.to_string()))?;
        if freed > 0 {
            tracing::info!(blocks = freed, "trimmed preallocation left by the last run");
        }
        Ok(())
    }

    /// The quota an inode is charged to, with its limits and usage (for statfs inside it and
    /// GetQuota): `(quota directory, row)`; a quota directory is its own quota.
    pub fn quota_of(&self, ino: u64) -> Result<Option<(u64, crate::quota::QuotaRow)>, FsError> {
        self.read(|t| {
            let rec = t.inode(ino)?;
            let r = self.database()?.begin_read()?;
            let quotas = match r.open_table(QUOTAS) {
                Ok(q) => q,
                Err(redb::TableError::TableDoesNotExist(_)) => return Ok(None),
                Err(e) => return Err(e.into()),
            };
            for project in [ino, rec.project] {
                if project == 0 {
                    continue;
                }
                if let Some(v) = quotas.get(project)? {
                    return Ok(Some((
                        project,
                        crate::quota::QuotaRow::from_tuple(v.value()),
                    )));
                }
            }
            Ok(None)
        })
    }

    /// Every directory quota (`(directory, row)`, by directory inode): for ListQuotas.
    pub fn quotas(&self) -> Result<Vec<(u64, crate::quota::QuotaRow)>, FsError> {
        self.read(|_| {
            let r = self.database()?.begin_read()?;
            let quotas = match r.open_table(QUOTAS) {
                Ok(q) => q,
                Err(redb::TableError::TableDoesNotExist(_)) => return Ok(Vec::new()),
                Err(e) => return Err(e.into()),
            };
            let mut all = Vec::new();
            for entry in quotas.iter()? {
                let (k, v) = entry?;
                all.push((k.value(), crate::quota::QuotaRow::from_tuple(v.value())));
            }
            Ok(all)
        })
    }

    pub fn superblock(&self) -> &Superblock {
        &self.sb
    }

    pub fn volume(&self) -> &Arc<Volume> {
        &self.volume
    }

    pub fn block_size(&self) -> u32 {
        self.sb.block_size
    }

    pub fn clock(&self) -> &Clock {
        &self.clock
    }

    pub fn handles(&self) -> std::sync::MutexGuard<'_, Handles> {
        self.handles.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn usage(&self) -> &Usage {
        &self.usage
    }

    pub fn stats(&self) -> &CommitStats {
        &self.shared.stats
    }

    /// Whether the store has failed and the server must stop.
    pub fn poisoned(&self) -> bool {
        self.shared.poisoned.load(Ordering::SeqCst)
    }

    /// Resolves once the store is poisoned.
    pub async fn wait_poisoned(&self) {
        loop {
            let notified = self.shared.poison_notify.notified();
            if self.poisoned() {
                return;
            }
            notified.await;
        }
    }

    fn submit<R: Send + 'static>(
        &self,
        lazy: bool,
        f: impl for<'t> FnOnce(&mut Ctx<'t>) -> Result<R, OpError> + Send + 'static,
        done: impl FnOnce(Result<(R, u64), FsError>) + Send + 'static,
    ) {
        if self.poisoned() {
            done(Err(self.shared.poison_error()));
            return;
        }
        let shared = self.shared.clone();
        let run: Run = Box::new(move |ctx: &mut Ctx<'_>| match f(ctx) {
            Ok(r) => (
                Box::new(move |commit: Result<u64, String>| match commit {
                    Ok(seq) => done(Ok((r, seq))),
                    Err(why) => done(Err(FsError::Io(format!("metadata commit failed: {why}")))),
                }) as Reply,
                true,
            ),
            Err(OpError::Fs(e)) => (Box::new(move |_| done(Err(e))) as Reply, true),
            Err(OpError::Store(why)) => {
                shared.poison(why.clone());
                (
                    Box::new(move |_| done(Err(FsError::Io(format!("metadata store: {why}")))))
                        as Reply,
                    false,
                )
            }
        });
        let job = Job { run, lazy };
        let sent = self
            .jobs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .map(|tx| tx.send(job));
        match sent {
            Some(Ok(())) => {}
            // The committer is gone (store closed or poisoned): the job was dropped with its
            // reply, whose sender then reports the failure to the caller.
            Some(Err(mpsc::SendError(job))) => drop(job),
            None => {}
        }
    }

    /// Runs `f` in the next group commit and answers once that commit is durable.
    pub async fn write<R: Send + 'static>(
        &self,
        f: impl for<'t> FnOnce(&mut Ctx<'t>) -> Result<R, OpError> + Send + 'static,
    ) -> Result<R, FsError> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.submit(false, f, move |r| {
            let _ = tx.send(r.map(|(r, _)| r));
        });
        rx.await.unwrap_or_else(|_| Err(self.shared.poison_error()))
    }

    /// Runs `f` in the next group commit and answers once that commit is done, durable or
    /// not: a lazy change becomes durable with the next durable commit ([`Store::sync`], or
    /// any [`Store::write`]); after a crash before that, it is as if it never happened. For
    /// what the protocol allows to be lost until fsync (an Unwritten -> Written conversion).
    pub async fn write_lazy<R: Send + 'static>(
        &self,
        f: impl for<'t> FnOnce(&mut Ctx<'t>) -> Result<R, OpError> + Send + 'static,
    ) -> Result<R, FsError> {
        Ok(self.write_lazy_numbered(f).await?.0)
    }

    /// [`Store::write_lazy`] that also answers the number of the commit that holds the change:
    /// it is durable once [`Store::durable_seq`] reaches that number (at the latest
    /// [`LAZY_SYNC_AFTER`] later), and lost if the server stops before.
    pub async fn write_lazy_numbered<R: Send + 'static>(
        &self,
        f: impl for<'t> FnOnce(&mut Ctx<'t>) -> Result<R, OpError> + Send + 'static,
    ) -> Result<(R, u64), FsError> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.submit(true, f, move |r| {
            let _ = tx.send(r);
        });
        rx.await.unwrap_or_else(|_| Err(self.shared.poison_error()))
    }

    /// Makes every change committed so far durable (fsync).
    pub async fn sync(&self) -> Result<(), FsError> {
        self.write(|_| Ok(())).await
    }

    /// [`Store::write`] for callers outside an async runtime (startup, tools, tests).
    pub fn write_blocking<R: Send + 'static>(
        &self,
        f: impl for<'t> FnOnce(&mut Ctx<'t>) -> Result<R, OpError> + Send + 'static,
    ) -> Result<R, FsError> {
        let (tx, rx) = mpsc::sync_channel(1);
        self.submit(false, f, move |r| {
            let _ = tx.send(r.map(|(r, _)| r));
        });
        rx.recv()
            .unwrap_or_else(|_| Err(self.shared.poison_error()))
    }

    /// Runs `f` on a consistent snapshot of every acknowledged change.
    pub fn read<R>(&self, f: impl FnOnce(&ReadTables) -> Result<R, OpError>) -> Result<R, FsError> {
        if self.poisoned() {
            return Err(self.shared.poison_error());
        }
        let run = || -> Result<R, OpError> {
            let r = self.database()?.begin_read()?;
            let t = Tables {
                inodes: r.open_table(INODES)?,
                dirents: r.open_table(DIRENTS)?,
                cookies: r.open_table(COOKIES)?,
                extents: r.open_table(EXTENTS)?,
                xattrs: r.open_table(XATTRS)?,
            };
            f(&t)
        };
        match run() {
            Ok(v) => Ok(v),
            Err(OpError::Fs(e)) => Err(e),
            Err(OpError::Store(why)) => {
                self.shared.poison(why.clone());
                Err(FsError::Io(format!("metadata store: {why}")))
            }
        }
    }

    /// The runs of [`UNZEROED`] as `(start block, length)`, on a snapshot (none in a store
    /// that never had one).
    pub fn unzeroed_runs(&self) -> Result<Vec<(u64, u64)>, FsError> {
        if self.poisoned() {
            return Err(self.shared.poison_error());
        }
        let run = || -> Result<Vec<(u64, u64)>, OpError> {
            let r = self.database()?.begin_read()?;
            let table = match r.open_table(UNZEROED) {
                Ok(t) => t,
                Err(redb::TableError::TableDoesNotExist(_)) => return Ok(Vec::new()),
                Err(e) => return Err(e.into()),
            };
            let mut runs = Vec::new();
            for item in table.iter()? {
                let (k, v) = item?;
                runs.push((k.value(), v.value()));
            }
            Ok(runs)
        };
        match run() {
            Ok(v) => Ok(v),
            Err(OpError::Fs(e)) => Err(e),
            Err(OpError::Store(why)) => {
                self.shared.poison(why.clone());
                Err(FsError::Io(format!("metadata store: {why}")))
            }
        }
    }

    /// Forgets the [`UNZEROED`] runs in `runs` that are still as they were (zeroed now),
    /// durably; a run that grew meanwhile stays for the next pass.
    pub async fn clear_unzeroed(&self, runs: Vec<(u64, u64)>) -> Result<(), FsError> {
        self.write(move |ctx| {
            for (start, len) in runs {
                if ctx.unzeroed.get(start)?.map(|v| v.value()) == Some(len) {
                    ctx.unzeroed.remove(start)?;
                }
            }
            Ok(())
        })
        .await
    }

    /// Stops the committer after the jobs already queued and closes the database (a clean
    /// shutdown: its file lock is released, so `fsck` or a new server can open it at once).
    /// Later calls answer as a failed store would.
    pub fn close(&self) {
        self.jobs.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(h) = self
            .committer
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            let _ = h.join();
        }
        self.db.write().unwrap_or_else(|p| p.into_inner()).take();
        let mut r = self.shared.reason.lock().unwrap_or_else(|p| p.into_inner());
        if r.is_none() {
            *r = Some("the store is closed".into());
        }
    }

    fn database(&self) -> Result<Arc<Database>, OpError> {
        self.db
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .ok_or_else(|| OpError::Fs(self.shared.poison_error()))
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        self.close();
    }
}

fn bump_boot_epoch(db: &Database) -> Result<u64, StoreError> {
    let txn = db.begin_write()?;
    let epoch = {
        let mut counters = txn.open_table(COUNTERS)?;
        let epoch = counters
            .get(KEY_BOOT_EPOCH)?
            .map(|v| v.value())
            .unwrap_or(0)
            + 1;
        counters.insert(KEY_BOOT_EPOCH, epoch)?;
        epoch
    };
    txn.commit()?;
    Ok(epoch)
}

fn load(db: &Database) -> Result<(Superblock, Volume, State), StoreError> {
    let r = db.begin_read()?;
    let sup = r.open_table(SUPER)?;
    let sb_bytes = sup
        .get(KEY_SUPER)?
        .ok_or_else(|| StoreError::Corrupt("no super record".into()))?;
    let sb = Superblock::decode(sb_bytes.value())
        .map_err(|e| StoreError::Corrupt(format!("super record: {e}")))?;
    let vol_bytes = sup
        .get(KEY_VOLUME)?
        .ok_or_else(|| StoreError::Corrupt("no volume record".into()))?;
    let volume = codec::decode_volume(vol_bytes.value())
        .map_err(|e| StoreError::Corrupt(format!("volume record: {e}")))?;
    let counters = r.open_table(COUNTERS)?;
    let counter = |k: &str| -> Result<u64, StoreError> {
        Ok(counters
            .get(k)?
            .ok_or_else(|| StoreError::Corrupt(format!("no counter {k}")))?
            .value())
    };
    let next_inode = counter(KEY_NEXT_INODE)?;
    let generation = counter(KEY_GENERATION)?;
    let free = r.open_table(FREE)?;
    let mut extents = Vec::with_capacity(usize::try_from(free.len()?).unwrap_or(0));
    for e in free.iter()? {
        let (k, v) = e?;
        extents.push((k.value(), v.value()));
    }
    let alloc = Allocator::from_free(&volume.allocation_groups(), sb.stripe_unit_blocks, extents)
        .map_err(|e| StoreError::Corrupt(format!("free-space table: {e}")))?;
    let usage = Usage::default();
    usage
        .free_blocks
        .store(alloc.free_blocks(), Ordering::Relaxed);
    usage
        .total_blocks
        .store(alloc.capacity_blocks(), Ordering::Relaxed);
    usage
        .inodes
        .store(r.open_table(INODES)?.len()?, Ordering::Relaxed);
    Ok((
        sb,
        volume,
        State {
            alloc,
            next_inode,
            generation,
            handles: Arc::new(Mutex::new(Handles::default())),
            usage: Arc::new(usage),
        },
    ))
}

impl Ctx<'_> {
    /// A fresh inode number and generation, persisted in this transaction.
    pub fn new_inode_number(&mut self) -> Result<(u64, u64), OpError> {
        let ino = self.st.next_inode;
        let next = ino.checked_add(1).ok_or(OpError::Fs(FsError::NoSpace))?;
        self.st.next_inode = next;
        self.st.generation += 1;
        self.counters.insert(KEY_NEXT_INODE, next)?;
        self.counters.insert(KEY_GENERATION, self.st.generation)?;
        self.st.usage.inodes.fetch_add(1, Ordering::Relaxed);
        Ok((ino, self.st.generation))
    }

    /// Applies an allocator delta to the free-space table (same transaction).
    pub fn apply_free_delta(
        &mut self,
        delta: &sanfs_blockmap::alloc::FreeSpaceDelta,
    ) -> Result<(), OpError> {
        for (start, _) in &delta.removed {
            self.free.remove(*start)?;
        }
        for (start, len) in &delta.added {
            self.free.insert(*start, *len)?;
        }
        Ok(())
    }

    /// Notes volume blocks `[start, start + len)` as handed out Unwritten and not zeroed on the
    /// LUNs yet (see [`UNZEROED`]).
    pub fn mark_unzeroed(&mut self, start: u64, len: u64) -> Result<(), OpError> {
        let len = match self.unzeroed.get(start)? {
            Some(old) => old.value().max(len),
            None => len,
        };
        self.unzeroed.insert(start, len)?;
        Ok(())
    }

    /// Returns blocks to free space. A block that is free already means the metadata is
    /// inconsistent: that is a storage error (fail-stop), not a caller's mistake.
    pub fn free_blocks(&mut self, start: u64, len: u64) -> Result<(), OpError> {
        let delta = self
            .st
            .alloc
            .free(start, len)
            .map_err(|e| OpError::Store(format!("freeing blocks {start}+{len}: {e}")))?;
        self.apply_free_delta(&delta)
    }
}

#[allow(
    clippy::too_many_arguments,
    reason = "the committer thread's whole context, passed once"
)]
fn committer_loop(
    db: &Database,
    rx: &mpsc::Receiver<Job>,
    mut state: State,
    shared: &Shared,
    clock: &Clock,
    block_size: u32,
    batch_max: usize,
    epoch: u64,
) {
    let mut seq = 0u64;
    // When the oldest commit that is not durable yet was made.
    let mut lazy_since: Option<std::time::Instant> = None;
    loop {
        let received = match lazy_since {
            None => rx.recv().map_err(|_| mpsc::RecvTimeoutError::Disconnected),
            Some(t) => rx.recv_timeout(
                (t + LAZY_SYNC_AFTER).saturating_duration_since(std::time::Instant::now()),
            ),
        };
        let first = match received {
            Ok(job) => job,
            // Lazy work waited long enough: an empty durable commit makes it durable.
            Err(mpsc::RecvTimeoutError::Timeout) => Job {
                run: Box::new(|_: &mut Ctx<'_>| (Box::new(|_| {}) as Reply, true)),
                lazy: false,
            },
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        };
        let mut batch = vec![first];
        while batch.len() < batch_max {
            match rx.try_recv() {
                Ok(job) => batch.push(job),
                Err(_) => break,
            }
        }
        let n = batch.len() as u64;
        if shared.poisoned.load(Ordering::SeqCst) {
            let why = shared.poison_error().to_string();
            for job in batch {
                drop(job); // its reply channel closes: the caller gets the poison error
            }
            tracing::debug!(%why, "dropped jobs after poison");
            continue;
        }
        let durable = batch.iter().any(|j| !j.lazy);
        seq += 1;
        let result = run_batch(db, batch, &mut state, clock, block_size, (epoch, seq));
        state
            .usage
            .free_blocks
            .store(state.alloc.free_blocks(), Ordering::Relaxed);
        match result {
            Ok(replies) => {
                shared.stats.commits.fetch_add(1, Ordering::Relaxed);
                shared.stats.ops.fetch_add(n, Ordering::Relaxed);
                shared.commit_seq.store(seq, Ordering::SeqCst);
                if durable {
                    shared.durable_seq.store(seq, Ordering::SeqCst);
                    lazy_since = None;
                } else {
                    lazy_since.get_or_insert_with(std::time::Instant::now);
                }
                for r in replies {
                    r(Ok(seq));
                }
            }
            Err((why, replies)) => {
                shared.stats.failed_ops.fetch_add(n, Ordering::Relaxed);
                shared.poison(why.clone());
                for r in replies {
                    r(Err(why.clone()));
                }
            }
        }
    }
}

type BatchResult = Result<Vec<Reply>, (String, Vec<Reply>)>;

fn run_batch(
    db: &Database,
    batch: Vec<Job>,
    state: &mut State,
    clock: &Clock,
    block_size: u32,
    (epoch, seq): (u64, u64),
) -> BatchResult {
    let mut replies = Vec::with_capacity(batch.len());
    let durable = batch.iter().any(|j| !j.lazy);
    let txn = match begin(db, durable) {
        Ok(t) => t,
        Err(e) => {
            // Nothing ran: answer every job with the failure.
            let why = e;
            for job in batch {
                drop(job);
            }
            return Err((why, replies));
        }
    };
    let mut ok = true;
    {
        let mut ctx = match open_ctx(&txn, state, clock.now(), block_size) {
            Ok(c) => c,
            Err(e) => return Err((e, replies)),
        };
        for job in batch {
            if !ok {
                drop(job);
                continue;
            }
            // A panicking job is a bug; it must not take the committer thread (and with it
            // every later write) down silently: the batch fails and the store stops.
            let run = job.run;
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run(&mut ctx))) {
                Ok((reply, fine)) => {
                    replies.push(reply);
                    ok = fine;
                }
                Err(_) => {
                    tracing::error!("a metadata job panicked: failing its batch");
                    ok = false;
                }
            }
        }
        if ok {
            // Numbered in the commit itself: after a crash, these name the last survivor.
            ok = ctx.counters.insert(KEY_LAST_COMMIT, seq).is_ok()
                && ctx.counters.insert(KEY_LAST_COMMIT_EPOCH, epoch).is_ok();
        }
    }
    if !ok {
        let _ = txn.abort();
        return Err(("a storage error inside the transaction".into(), replies));
    }
    match txn.commit() {
        Ok(()) => Ok(replies),
        Err(e) => Err((format!("commit: {e}"), replies)),
    }
}

fn begin(db: &Database, durable: bool) -> Result<WriteTransaction, String> {
    let mut txn = db.begin_write().map_err(|e| e.to_string())?;
    txn.set_quick_repair(true);
    if !durable {
        txn.set_durability(redb::Durability::None)
            .map_err(|e| e.to_string())?;
    }
    Ok(txn)
}

fn open_ctx<'t>(
    txn: &'t WriteTransaction,
    st: &'t mut State,
    now: Timestamp,
    block_size: u32,
) -> Result<Ctx<'t>, String> {
    let e = |e: redb::TableError| e.to_string();
    Ok(Ctx {
        t: Tables {
            inodes: txn.open_table(INODES).map_err(e)?,
            dirents: txn.open_table(DIRENTS).map_err(e)?,
            cookies: txn.open_table(COOKIES).map_err(e)?,
            extents: txn.open_table(EXTENTS).map_err(e)?,
            xattrs: txn.open_table(XATTRS).map_err(e)?,
        },
        free: txn.open_table(FREE).map_err(e)?,
        counters: txn.open_table(COUNTERS).map_err(e)?,
        orphans: txn.open_table(ORPHANS).map_err(e)?,
        prealloc: txn.open_table(PREALLOC).map_err(e)?,
        quotas: txn.open_table(QUOTAS).map_err(e)?,
        unzeroed: txn.open_table(UNZEROED).map_err(e)?,
        replies: txn.open_table(REPLIES).map_err(e)?,
        sessions: txn.open_table(SESSIONS).map_err(e)?,
        st,
        now,
        block_size,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_inside_the_guard_is_a_damaged_store_error() {
        let r: Result<(), StoreError> = guard_damage("open the metadata store", || {
            let bytes: &[u8] = &[1, 2];
            // A slice index past the end, as redb's B-tree code does on a torn page.
            let end = bytes.len() + usize::from(bytes[0]);
            drop(bytes[..end].to_vec());
            Ok(())
        });
        let e = r.unwrap_err();
        assert!(matches!(e, StoreError::Damaged(_)), "{e}");
        assert!(
            e.to_string()
                .starts_with("metadata store damaged: open the metadata store")
        );
        assert!(e.to_string().contains("range end index 3"), "{e}");
        assert!(guard_damage("x", || Ok::<_, StoreError>(7)).unwrap() == 7);
        assert!(matches!(
            guard_damage("x", || Err::<(), _>(StoreError::InUse)),
            Err(StoreError::InUse)
        ));
    }
}
