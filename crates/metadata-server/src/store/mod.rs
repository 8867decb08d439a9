//! The durable metadata store: redb tables, and the committer that batches concurrent
//! operations into one durable commit (group commit).
//!
//! Every change goes through [`Store::write`]: a job (a closure over [`Ctx`]) is queued to the
//! committer thread, which runs all the jobs that are waiting in one redb write transaction
//! and commits it with `Durability::Immediate`; only then does any job's caller get its answer.
//! So an operation is acknowledged only once durable, and concurrent operations share one
//! sync. (A lazy job, [`Store::write_lazy`], is answered once committed, without the sync;
//! when nobody else is committing, the caller's own thread commits it: `committer.rs`.)
//! A job must check everything that can fail *before* it changes anything: a job that
//! answers with an error leaves no trace, which is what makes one transaction per batch safe.
//!
//! Reads ([`Store::read`]) run on the caller's thread in a redb read transaction (MVCC): they
//! never wait for the committer and always see every acknowledged change.
//!
//! A failed commit or a storage error poisons the store (fail-stop, as redb itself does):
//! every later operation answers EIO and [`Store::poisoned`] tells the server to stop.
//! Restarting re-reads the durable state.
//!
//! `store/` is the bottom layer of the server: it imports no other server module but the
//! clock and the handle table. The files: `tables.rs` (table definitions and typed views),
//! `committer.rs` (the committer thread and [`Ctx`]), `db.rs` (opening a backend, loading),
//! `error.rs`, `records.rs` (record encodings), `backend.rs` (storage backends), `backup.rs`
//! (table-by-table copies: online backup, restore); this file is
//! the [`Store`] itself.

pub mod backend;
pub mod backup;
mod committer;
mod db;
pub mod device;
mod error;
pub mod fence;
pub mod journal;
pub mod records;
mod tables;

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
use sanfs_proto::types::{FileType, FsError, InodeId, Timestamp};
use uuid::Uuid;

use crate::clock::Clock;
use crate::handles::Handles;
use backend::SimDisk;
use device::BlockDeviceBackend;
use records::{GrownDevices, InodeRec, STORE_FORMAT_VERSION, Superblock};

pub use committer::{
    COMMIT_OPS, COMMIT_SECONDS, CommitStats, Ctx, DATA_FLUSHES, DataFlush, LAZY_SYNC_AFTER, Luns,
    State, Usage,
};
use committer::{Engine, Job, Queue, Reply, Run, Shared, committer_loop};
pub(crate) use db::{Verify, open_db, open_db_journaled, open_db_read_only, read_image};
use db::{bump_boot_epoch, load, load_grown_devices};
pub use error::{OpError, StoreError, corrupt, guard_damage};
pub use tables::*;

/// Where the store lives.
#[derive(Debug, Clone)]
pub enum Backend {
    /// A file on local disk (the default).
    File(PathBuf),
    /// A block device of its own.
    Device(PathBuf),
    /// A block device of its own, opened by a high-availability leader: claimed with the
    /// fence's epoch, every write checked against it (`store::device`, `crate::ha`).
    FencedDevice(PathBuf, Arc<fence::Fence>),
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

/// See [`Store::volume_cell`].
#[derive(Clone)]
pub struct VolumeCell(Arc<std::sync::RwLock<Arc<Volume>>>);

impl VolumeCell {
    /// The volume now.
    pub fn get(&self) -> Arc<Volume> {
        self.0.read().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

/// The metadata store.
pub struct Store {
    /// The database; `None` once closed (its file lock is released then).
    db: std::sync::RwLock<Option<Arc<Database>>>,
    sb: Superblock,
    /// The volume: replaced whole by [`Store::grow`], never changed in place.
    volume: Arc<std::sync::RwLock<Arc<Volume>>>,
    /// The paths of the LUNs growths added (the `"grown_devices"` record), replaced with the
    /// volume by [`Store::grow`].
    grown_devices: Arc<std::sync::RwLock<GrownDevices>>,
    committer: Mutex<Option<std::thread::JoinHandle<()>>>,
    shared: Arc<Shared>,
    clock: Clock,
    handles: Arc<Mutex<Handles>>,
    usage: Arc<Usage>,
    boot_epoch: u64,
    locks_in_use_at_start: bool,
    /// The (epoch, number) of the last commit that survived the last stop.
    survived: (u64, u64),
    /// Restores of this store from a backup (`sanfs-mds restore`).
    restores: u64,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("fs_uuid", &self.sb.fs_uuid)
            .finish()
    }
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

    /// Opens an existing store and starts its committer, without the recovery that frees
    /// space: that is namespace work, done by the `recovery` module (`Store::open` opens and
    /// recovers; the server runs the recovery once the reclaim window is over, because agents
    /// replay completions into blocks that it would free: Unwritten blocks past a size that
    /// went back with a lost lazy commit). A store not shut down cleanly is repaired by redb
    /// on the way; a damaged one on which the storage library fails is refused with
    /// [`StoreError::Damaged`], never a panic.
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
        let (db, journal) = open_db_journaled(backend, false, false, Verify::Pages)?;
        let (sb, volume, state) = load(&db)?;
        let grown_devices = load_grown_devices(&db)?;
        let boot_epoch = bump_boot_epoch(&db)?;
        let (locks_in_use_at_start, survived, restores) = {
            let r = db.begin_read()?;
            let counters = r.open_table(COUNTERS)?;
            let get = |k: &str| -> Result<u64, StoreError> {
                Ok(counters.get(k)?.map_or(0, |v| v.value()))
            };
            (
                get(KEY_LOCKS_IN_USE)? != 0,
                (get(KEY_LAST_COMMIT_EPOCH)?, get(KEY_LAST_COMMIT)?),
                get(KEY_RESTORES)?,
            )
        };
        let handles = state.handles.clone();
        let usage = state.usage.clone();
        let shared = Arc::new(Shared {
            commit_seq: AtomicU64::new(0),
            durable_seq: AtomicU64::new(0),
            undurable_owner: AtomicU64::new(0),
            undurable_owner_seq: AtomicU64::new(0),
            poisoned: AtomicBool::new(false),
            reason: Mutex::new(None),
            poison_notify: tokio::sync::Notify::new(),
            stats: CommitStats::default(),
            data_flush: std::sync::OnceLock::new(),
            journal,
            queue: Mutex::new(Queue::default()),
            ready: std::sync::Condvar::new(),
            engine: Mutex::new(None),
            lazy_since: Mutex::new(None),
        });
        let db = Arc::new(db);
        *shared.lock_engine() = Some(Engine {
            db: db.clone(),
            state,
            clock: clock.clone(),
            block_size: sb.block_size,
            batch_max: batch_max.max(1),
            epoch: boot_epoch,
            seq: 0,
            unflushed: None,
        });
        let committer = {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name("sanfs-committer".into())
                .spawn(move || committer_loop(&shared))?
        };
        let store = Store {
            db: std::sync::RwLock::new(Some(db)),
            sb,
            volume: Arc::new(std::sync::RwLock::new(Arc::new(volume))),
            grown_devices: Arc::new(std::sync::RwLock::new(grown_devices)),
            committer: Mutex::new(Some(committer)),
            shared,
            clock,
            handles,
            usage,
            boot_epoch,
            locks_in_use_at_start,
            survived,
            restores,
        };
        Ok(store)
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

    /// This start's epoch: one more than the last start's, durably. Grants and sessions carry
    /// it, so that nothing issued before a restart is honoured after it.
    pub fn boot_epoch(&self) -> u64 {
        self.boot_epoch
    }

    /// How many times this store was restored from a backup (0: never). Agents see it in
    /// `ServerInfo.restores` and refuse a server whose value changed under a mount.
    pub fn restores(&self) -> u64 {
        self.restores
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

    pub fn superblock(&self) -> &Superblock {
        &self.sb
    }

    /// The volume as of now (a growth replaces it: callers keep the snapshot they planned
    /// with, which stays true for every block it maps).
    pub fn volume(&self) -> Arc<Volume> {
        self.volume
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// A handle that reads the volume when asked: inside a store job (the committer runs jobs
    /// one after another, so it sees the volume that goes with the allocator the job uses) or
    /// inside a [`Store::read`] closure (after its snapshot began: a block of a grown volume
    /// in the snapshot means the growth is in [`Store::volume`] already).
    pub fn volume_cell(&self) -> VolumeCell {
        VolumeCell(self.volume.clone())
    }

    /// Grows the volume to `grown` in one durable transaction: the volume record, the free
    /// space of the new blocks (in the allocator at once, and in [`FREE`]), and the capacity
    /// statfs reports. `old` is the volume the caller planned the growth from; if the volume
    /// changed meanwhile (another growth), nothing changes and the answer is EINVAL.
    /// `grown` must pass [`Volume::check_grows`] against it. `device_paths` (the paths the
    /// growth was given, on this server's host) join the grown-devices record in the same
    /// transaction, so that a restarted server opens them ([`Store::grown_device_paths`]).
    /// Answers the blocks added.
    pub async fn grow(
        &self,
        old: Arc<Volume>,
        grown: Volume,
        device_paths: &[PathBuf],
    ) -> Result<u64, FsError> {
        grown
            .check_grows(&old)
            .map_err(|e| FsError::Invalid(e.to_string()))?;
        let shared = self.volume.clone();
        let shared_paths = self.grown_devices.clone();
        let mut recorded = self.grown_device_record();
        recorded.extend(device_paths);
        let stripe_unit_blocks = self.sb.stripe_unit_blocks;
        self.write(move |ctx| {
            {
                let current = shared.read().unwrap_or_else(|p| p.into_inner());
                if **current != *old {
                    return Err(OpError::Fs(FsError::Invalid(
                        "the volume changed while this growth was prepared: try again".into(),
                    )));
                }
            }
            let (old_blocks, new_blocks) = (old.size_blocks(), grown.size_blocks());
            let added = new_blocks - old_blocks;
            let mut free: Vec<(u64, u64)> = ctx.st.alloc.free_extents().collect();
            free.push((old_blocks, added));
            let alloc = Allocator::from_free(&grown.allocation_groups(), stripe_unit_blocks, free)
                .map_err(|e| {
                    OpError::Fs(FsError::Invalid(format!(
                        "the grown volume's free space: {e}"
                    )))
                })?;
            // Checked; from here on the change happens.
            let stale: Vec<u64> = ctx.st.alloc.free_extents().map(|(s, _)| s).collect();
            for start in stale {
                ctx.free.remove(start)?;
            }
            for (start, len) in alloc.free_extents() {
                ctx.free.insert(start, len)?;
            }
            ctx.sup
                .insert(KEY_VOLUME, codec::encode_volume(&grown).as_slice())?;
            ctx.sup
                .insert(KEY_GROWN_DEVICES, recorded.encode().as_slice())?;
            ctx.st
                .usage
                .total_blocks
                .store(alloc.capacity_blocks(), Ordering::Relaxed);
            ctx.st.alloc = alloc;
            *shared.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(grown);
            *shared_paths.write().unwrap_or_else(|p| p.into_inner()) = recorded;
            Ok(added)
        })
        .await
    }

    /// The server-host paths of the LUNs added by growths, in the order added (opened at
    /// start besides `volume.devices`).
    pub fn grown_device_paths(&self) -> Vec<PathBuf> {
        self.grown_device_record().paths
    }

    fn grown_device_record(&self) -> GrownDevices {
        self.grown_devices
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
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

    /// Fails the store (fail-stop, as a failed commit does): the server stops with `why`,
    /// and a restart re-reads the durable state.
    pub fn fail(&self, why: String) {
        self.shared.poison(why);
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

    /// The journal of the server's own data writes (`journal::DataJournal`): `None` for a
    /// store without a journal (on a metadata LUN), whose writes flush the LUNs instead.
    pub fn data_journal(&self) -> Option<journal::DataJournal> {
        self.shared
            .journal
            .as_ref()
            .map(journal::SyncHolder::data_journal)
    }

    /// Sets how the data LUNs are flushed before a durable commit that makes written data
    /// readable ([`Store::write_data`]); only the first call takes effect (answers whether
    /// this one did).
    pub fn set_data_flush(&self, flush: DataFlush) -> bool {
        self.shared.data_flush.set(flush).is_ok()
    }

    fn submit<R: Send + 'static>(
        &self,
        (lazy, owner, flush): (bool, u64, Option<Luns>),
        f: impl for<'t> FnOnce(&mut Ctx<'t>) -> Result<R, OpError> + Send + 'static,
        done: impl FnOnce(Result<(R, u64), FsError>) + Send + 'static,
    ) {
        if self.poisoned() {
            done(Err(self.shared.poison_error()));
            return;
        }
        let shared = self.shared.clone();
        let run: Run = Box::new(move |ctx: Result<&mut Ctx<'_>, &str>| {
            let ctx = match ctx {
                Ok(ctx) => ctx,
                Err(why) => {
                    let e = FsError::Io(format!(
                        "flushing the data LUNs before the metadata commit failed: {why}"
                    ));
                    return (Box::new(move |_| done(Err(e))) as Reply, true);
                }
            };
            match f(ctx) {
                Ok(r) => (
                    Box::new(move |commit: Result<u64, String>| match commit {
                        Ok(seq) => done(Ok((r, seq))),
                        Err(why) => {
                            done(Err(FsError::Io(format!("metadata commit failed: {why}"))))
                        }
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
            }
        });
        let job = Job {
            run,
            lazy,
            owner,
            flush,
        };
        {
            let mut q = self.shared.lock_queue();
            if q.closed {
                // The store is closed: the job goes with its reply, whose sender then
                // reports the failure to the caller.
                drop(q);
                drop(job);
                return;
            }
            q.jobs.push_back(job);
            if !lazy {
                self.shared.ready.notify_one();
            }
        }
        if lazy {
            // Committed here and now if nobody else is committing (committer.rs).
            self.shared.commit_lazy_here();
        }
    }

    /// Runs `f` in the next group commit and answers once that commit is durable.
    pub async fn write<R: Send + 'static>(
        &self,
        f: impl for<'t> FnOnce(&mut Ctx<'t>) -> Result<R, OpError> + Send + 'static,
    ) -> Result<R, FsError> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.submit((false, 0, None), f, move |r| {
            let _ = tx.send(r.map(|(r, _)| r));
        });
        rx.await.unwrap_or_else(|_| Err(self.shared.poison_error()))
    }

    /// A change that makes data written to `luns` readable (Unwritten -> Written), or that
    /// must not be durable before data written there so far: those LUNs are flushed before
    /// the commit that makes it durable (`committer::Job::flush`). `durable`: answered once
    /// durable (as [`Store::write`]; the number answered is then 0), else once committed (as
    /// [`Store::write_lazy_numbered`], with the number of its commit).
    pub async fn write_data<R: Send + 'static>(
        &self,
        durable: bool,
        luns: Luns,
        f: impl for<'t> FnOnce(&mut Ctx<'t>) -> Result<R, OpError> + Send + 'static,
    ) -> Result<(R, u64), FsError> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.submit((!durable, 0, Some(luns)), f, move |r| {
            let _ = tx.send(r.map(|(r, seq)| (r, if durable { 0 } else { seq })));
        });
        rx.await.unwrap_or_else(|_| Err(self.shared.poison_error()))
    }

    /// Makes every change committed so far durable, after flushing the data LUNs (fsync of
    /// a file: its data, then the metadata that makes it readable).
    pub async fn sync_data(&self) -> Result<(), FsError> {
        self.write_data(true, Luns::All, |_| Ok(()))
            .await
            .map(|_| ())
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
        self.submit((true, 0, None), f, move |r| {
            let _ = tx.send(r);
        });
        rx.await.unwrap_or_else(|_| Err(self.shared.poison_error()))
    }

    /// [`Store::write_lazy_numbered`] for a namespace change of session `owner`, whose agent
    /// keeps a record of it until it is durable and replays it after a restart: committed
    /// lazily only while the changes not durable yet are all that session's (see
    /// `committer::Job`); answers the change and the number of its commit.
    pub async fn write_owned<R: Send + 'static>(
        &self,
        owner: u64,
        f: impl for<'t> FnOnce(&mut Ctx<'t>) -> Result<R, OpError> + Send + 'static,
    ) -> Result<(R, u64), FsError> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.submit((true, owner, None), f, move |r| {
            let _ = tx.send(r);
        });
        rx.await.unwrap_or_else(|_| Err(self.shared.poison_error()))
    }

    /// Whether changes of a session other than `me` (0: no session) are committed and not
    /// durable: what `me` reads must then wait for a [`Store::sync`], so that no session ever
    /// sees a change that a crash could still take back (its agent may die with the server).
    /// Check it *after* reading: the owner is set before its commit becomes visible.
    pub fn foreign_undurable(&self, me: u64) -> bool {
        let owner = self.shared.undurable_owner.load(Ordering::SeqCst);
        owner != 0
            && owner != me
            && self.shared.undurable_owner_seq.load(Ordering::SeqCst)
                > self.shared.durable_seq.load(Ordering::SeqCst)
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
        self.submit((false, 0, None), f, move |r| {
            let _ = tx.send(r.map(|(r, _)| r));
        });
        rx.recv()
            .unwrap_or_else(|_| Err(self.shared.poison_error()))
    }

    /// Runs `f` on a read transaction over every acknowledged change, for the tables that
    /// [`Store::read`] does not open (a table that may not exist yet must be opened with
    /// [`open_if_exists`]).
    pub fn snapshot<R>(
        &self,
        f: impl FnOnce(&redb::ReadTransaction) -> Result<R, OpError>,
    ) -> Result<R, FsError> {
        if self.poisoned() {
            return Err(self.shared.poison_error());
        }
        let run = || -> Result<R, OpError> { f(&self.database()?.begin_read()?) };
        match run() {
            Ok(v) => Ok(v),
            Err(OpError::Fs(e)) => Err(e),
            Err(OpError::Store(why)) => {
                self.shared.poison(why.clone());
                Err(FsError::Io(format!("metadata store: {why}")))
            }
        }
    }

    /// Runs `f` on a consistent snapshot of every acknowledged change.
    pub fn read<R>(&self, f: impl FnOnce(&ReadTables) -> Result<R, OpError>) -> Result<R, FsError> {
        if self.poisoned() {
            return Err(self.shared.poison_error());
        }
        let run = || -> Result<R, OpError> {
            let r = self.database()?.begin_read()?;
            f(&read_tables(&r)?)
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
        self.shared.lock_queue().closed = true;
        self.shared.ready.notify_all();
        if let Some(h) = self
            .committer
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            let _ = h.join();
        }
        // The write side goes (with its handle on the database), then the database.
        self.shared.lock_engine().take();
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
