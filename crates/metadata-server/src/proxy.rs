//! The proxied path: reads and writes whose data goes through the server (below the
//! direct-I/O threshold, and the unaligned edges of larger I/O), done under the same
//! byte-range locks as grants so that proxied and direct I/O stay coherent.
//!
//! A proxied write locks the block-aligned span around its bytes exclusively, allocates what
//! is missing (Unwritten, durably), reads the partial head and tail blocks (read-modify-write;
//! bytes past the old end of file count as zeros), writes whole blocks with `O_DIRECT`,
//! flushes the devices when asked to be synchronous, and completes like a grant: the span
//! becomes Written, the size grows to the end of the application's bytes.
//!
//! **EOF zeroing**: before anything extends a file whose old end lies inside a block, the
//! bytes of that block past the old end are zeroed on the device (XFS's `xfs_zero_eof`): a
//! truncate down leaves them as they were, and an extension must not expose them.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use sanfs_blockmap::plan::IoPlan;
use sanfs_blockmap::volume::DeviceIndex;
use sanfs_proto::model::{RequestId, SetAttrRequest, WriteReply};
use sanfs_proto::pb;
use sanfs_proto::types::{Attr, ByteRange, FileType, FsError, InodeId};

use crate::data::{self, Mapped};
use crate::datadev::DataDevices;
use crate::locks::{LockMode, RangeLocks, Span};
use crate::smallfiles::{SMALL_FILE_MAX, SmallFiles};
use crate::store::journal::DataJournal;
use crate::store::{Luns, OpError, Store};
use crate::{ns, replies};

/// Where a proxied write goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Position {
    At(u64),
    /// At the end of file, atomically with respect to other appends. With the request's
    /// reply-cache id, an append that is retried after its first try was written is answered
    /// from that try and not written again (a second copy of the record would be wrong).
    Append(Option<AppendOnce>),
}

/// A proxied append's reply-cache id and the session it came under.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AppendOnce {
    pub id: RequestId,
    pub session: u64,
}

/// The data side of the server: the store, the range locks, the server's LUN handles.
pub struct DataPath {
    pub store: Arc<Store>,
    pub locks: RangeLocks,
    pub devices: Arc<DataDevices>,
    pub lock_timeout: Duration,
    next_lock: AtomicU64,
    /// One zeroing pass at a time ([`DataPath::zero_fresh`]).
    zeroing: tokio::sync::Mutex<()>,
    /// Bytes zeroed on the LUNs before they were handed out, by this server instance.
    pub zeroed_bytes: AtomicU64,
    /// Recalls the cached read grants among the locks a proxied request waits for (set by
    /// the grant table, which owns the recall channels).
    recaller: std::sync::OnceLock<Recaller>,
    /// Whole small files the proxied path wrote or read (forgotten as an exclusive lock on
    /// one is granted).
    pub small: Arc<SmallFiles>,
    /// Where small proxied writes are journaled instead of flushed (a store with a journal).
    journal: Option<DataJournal>,
    /// One settling at a time ([`DataPath::settle`]).
    settling: tokio::sync::Mutex<()>,
    /// Held shared by each journaled write from its staging until its LUN write ended, and
    /// exclusively by a settling: a settling's point never passes a staged write that is not
    /// on its LUN yet.
    journaling: tokio::sync::RwLock<()>,
}

/// Proxied writes of at most this many bytes (whole blocks) are journaled with their commit
/// instead of flushing the LUNs before it (`journal::DataJournal`).
pub const JOURNALED_WRITE_MAX: u64 = 256 << 10;
/// At most this many bytes of journaled data wait to be settled; past it a write settles
/// first.
const JOURNALED_UNSETTLED_MAX: u64 = 4 << 20;
/// Settlings of journaled data (metrics).
pub const DATA_SETTLES: &str = "sanfs_journal_data_settles_total";
/// Proxied writes journaled (metrics).
pub const DATA_JOURNALED: &str = "sanfs_journal_data_writes_total";

/// What [`DataPath::set_recaller`] takes: called with the ids of the locks in the way.
pub type Recaller = Box<dyn Fn(Vec<u64>) + Send + Sync>;

impl std::fmt::Debug for DataPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DataPath")
            .field("devices", &self.devices)
            .finish_non_exhaustive()
    }
}

/// A held range lock, released when dropped.
pub struct Held {
    locks: RangeLocks,
    ino: u64,
    id: u64,
}

impl Held {
    /// Wraps a lock already taken with `id`.
    pub fn new(locks: RangeLocks, ino: u64, id: u64) -> Held {
        Held { locks, ino, id }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.locks.release(self.ino, self.id);
    }
}

fn join_error(e: tokio::task::JoinError) -> FsError {
    FsError::Io(format!("device I/O task failed: {e}"))
}

impl DataPath {
    pub fn new(store: Arc<Store>, devices: Arc<DataDevices>, lock_timeout: Duration) -> DataPath {
        let locks = RangeLocks::new();
        let small = Arc::new(SmallFiles::default());
        let forget = Arc::clone(&small);
        locks.set_on_exclusive(Box::new(move |ino| forget.forget(ino)));
        // Written data is flushed before the commit that makes it readable is durable
        // (`Store::write_data`): the store's committer flushes these LUNs.
        let flushed = Arc::clone(&devices);
        store.set_data_flush(Box::new(move |luns| {
            match luns {
                Luns::All => flushed.flush_all(),
                Luns::Listed(l) => {
                    let l: Vec<DeviceIndex> = l.iter().map(|d| DeviceIndex(*d)).collect();
                    flushed.flush(&l)
                }
            }
            .map_err(|e| e.to_string())
        }));
        let journal = store.data_journal();
        DataPath {
            journal,
            settling: tokio::sync::Mutex::new(()),
            journaling: tokio::sync::RwLock::new(()),
            store,
            locks,
            small,
            devices,
            lock_timeout,
            next_lock: AtomicU64::new(1),
            zeroing: tokio::sync::Mutex::new(()),
            zeroed_bytes: AtomicU64::new(0),
            recaller: std::sync::OnceLock::new(),
        }
    }

    /// Zeroes on the LUNs every block run the store notes as handed out Unwritten and not
    /// zeroed yet (`UNZEROED`), flushes them, and durably forgets the runs. Called after
    /// every change that notes some (a write grant's allocation, fallocate) before its
    /// blocks can be granted, and at start; so a client that completes a write it never did
    /// exposes zeros, never a deleted file's bytes. Passes run one at a time and each takes
    /// every run noted so far, so a run is zeroed before the grant that noted it leaves and
    /// never after (when a client may have written it). Blocks on a LUN this server does not
    /// have cannot be zeroed: they are forgotten with a warning. Returns the bytes zeroed.
    pub async fn zero_fresh(&self) -> Result<u64, FsError> {
        let _pass = self.zeroing.lock().await;
        let runs = self.store.unzeroed_runs()?;
        if runs.is_empty() {
            return Ok(0);
        }
        // Zeros are not journaled: what the journal holds for these blocks is settled first.
        self.settle().await?;
        let devices = self.devices.clone();
        let volume = self.store.volume().clone();
        let todo = runs.clone();
        let (zeroed, missing) =
            tokio::task::spawn_blocking(move || devices.zero_runs(&volume, &todo))
                .await
                .map_err(join_error)??;
        if missing > 0 {
            tracing::warn!(
                bytes = missing,
                "fresh blocks on a LUN this server does not have were not zeroed"
            );
        }
        self.store.clear_unzeroed(runs).await?;
        self.zeroed_bytes.fetch_add(zeroed, Ordering::Relaxed);
        Ok(zeroed)
    }

    /// Settles the server's journaled writes (`journal::DataJournal`): flushes the LUNs and
    /// tells the journal that every operation written before is on them, so that a replay
    /// never writes it again. Called before anyone writes the LUNs other than by a
    /// journaled write (a client under a write grant, the server's own other writes), and
    /// in the background ([`DataPath::settle_in_background`]). Nothing to do: no I/O.
    pub async fn settle(&self) -> Result<(), FsError> {
        let Some(journal) = &self.journal else {
            return Ok(());
        };
        if self.store.poisoned() {
            // A journaled write may have failed on its LUN: nothing may write the LUNs now.
            return Err(FsError::Io("the metadata store failed (fail-stop)".into()));
        }
        if journal.settle_point().is_none() {
            return Ok(());
        }
        let _one = self.settling.lock().await;
        // No journaled write between its staging and the end of its LUN write now.
        let _quiet = self.journaling.write().await;
        // Captured before the flush: every operation up to it was written before.
        let Some(point) = journal.settle_point() else {
            return Ok(());
        };
        let devices = self.devices.clone();
        let journal = journal.clone();
        tokio::task::spawn_blocking(move || {
            devices.flush_all()?;
            journal
                .settle(point)
                .map_err(|e| FsError::Io(format!("settling journaled data: {e}")))
        })
        .await
        .map_err(join_error)??;
        metrics::counter!(DATA_SETTLES).increment(1);
        Ok(())
    }

    /// Writes onto the LUNs the data the journal replayed at the store's opening (writes
    /// acknowledged before a crash, maybe not flushed then), then settles it. Called once,
    /// before anything is served. When a LUN does not take its data (missing on this server,
    /// or refusing the write) the start fails, the data kept in the journal for the next
    /// one: served without it, clients with that LUN would read the bytes from before the
    /// acknowledged write, and a later replay could put it over what they wrote since
    /// (docs/operations.md "When things fail").
    pub async fn write_journaled_data(&self) -> Result<(), FsError> {
        let Some(journal) = self.journal.clone() else {
            return Ok(());
        };
        let ops = journal.unwritten();
        if ops.is_empty() {
            return Ok(());
        }
        let devices = self.devices.clone();
        let j = journal.clone();
        let (written, failed) = tokio::task::spawn_blocking(move || {
            let mut written = 0u64;
            let mut failed: std::collections::BTreeMap<u32, (u64, String)> = Default::default();
            for op in ops {
                match devices.write_raw(DeviceIndex(op.lun), op.offset, &op.data) {
                    Ok(()) => {
                        j.written(op.id);
                        written += op.data.len() as u64;
                    }
                    Err(e) => {
                        let f = failed.entry(op.lun).or_insert((0, e.to_string()));
                        f.0 += op.data.len() as u64;
                    }
                }
            }
            (written, failed)
        })
        .await
        .map_err(join_error)?;
        tracing::info!(bytes = written, "journaled data written to the LUNs");
        if !failed.is_empty() {
            let luns: Vec<String> = failed
                .iter()
                .map(|(lun, (bytes, why))| format!("LUN {lun} ({bytes} bytes: {why})"))
                .collect();
            return Err(FsError::Io(format!(
                "acknowledged writes kept in the metadata journal could not be written to {}; \
                 not serving until they are (clients would read older bytes there): make the \
                 LUN available to this server and start it again",
                luns.join(", ")
            )));
        }
        self.settle().await
    }

    /// Settles journaled data every `every` while the store is open (bounds what a replay
    /// rewrites, and what the journal holds).
    pub fn settle_in_background(self: &Arc<Self>, every: Duration) {
        if self.journal.is_none() {
            return;
        }
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                let Some(dp) = weak.upgrade() else { return };
                if dp.store.poisoned() {
                    return;
                }
                if let Err(e) = dp.settle().await {
                    tracing::warn!(error = %e, "settling journaled data failed");
                }
            }
        });
    }

    /// Lets proxied requests recall cached read grants in their way (as a write grant
    /// does). Only the first call takes effect.
    pub fn set_recaller(&self, recaller: Recaller) {
        let _ = self.recaller.set(recaller);
    }

    /// A fresh id for a lock or grant (one id space for both).
    pub fn next_id(&self) -> u64 {
        self.next_lock.fetch_add(1, Ordering::Relaxed)
    }

    /// Takes a range lock for the proxied path (not recallable: it lasts one request).
    /// Cached read grants in the way are recalled first.
    ///
    /// `owner`: the session the request is for (0: the server's own); that session's
    /// delegation on the file does not block it.
    pub async fn lock(
        &self,
        ino: u64,
        span: Span,
        mode: LockMode,
        owner: u64,
    ) -> Result<Held, FsError> {
        let id = self.next_id();
        self.locks
            .acquire_as(
                ino,
                id,
                span,
                mode,
                crate::locks::Owner::session(owner),
                self.lock_timeout,
                |blockers| {
                    if let Some(recall) = self.recaller.get() {
                        recall(blockers);
                    }
                },
            )
            .await
            .map_err(|_| FsError::LockTimeout)?;
        Ok(Held {
            locks: self.locks.clone(),
            ino,
            id,
        })
    }

    fn block_size(&self) -> u64 {
        u64::from(self.store.block_size())
    }

    async fn read_plan(&self, plan: IoPlan) -> Result<Vec<u8>, FsError> {
        if plan.device_ios.is_empty() {
            // Holes and Unwritten extents only: zeros, no device I/O, no thread hop.
            let mut buf = vec![0u8; usize::try_from(plan.len).map_err(|_| FsError::Range)?];
            self.devices.read_plan(&plan, &mut buf)?;
            return Ok(buf);
        }
        let devices = self.devices.clone();
        tokio::task::spawn_blocking(move || {
            let mut buf = vec![0u8; usize::try_from(plan.len).map_err(|_| FsError::Range)?];
            devices.read_plan(&plan, &mut buf)?;
            Ok(buf)
        })
        .await
        .map_err(join_error)?
    }

    /// Writes `buf` by `plan` (flushing the LUNs written if `sync`); answers the LUNs written.
    async fn write_plan(
        &self,
        plan: IoPlan,
        buf: Vec<u8>,
        sync: bool,
    ) -> Result<Vec<DeviceIndex>, FsError> {
        // Not journaled: what the journal holds is settled first (it may be for these
        // blocks, and a replay must not write it over these bytes).
        self.settle().await?;
        let devices = self.devices.clone();
        tokio::task::spawn_blocking(move || {
            let touched = devices.write_plan(&plan, &buf)?;
            if sync {
                devices.flush(&touched)?;
            }
            Ok(touched)
        })
        .await
        .map_err(join_error)?
    }

    /// The current contents of the aligned block range `[off, off + len)` as the file reads
    /// it (Written extents from the LUNs, zeros elsewhere), with bytes at or past `size`
    /// zeroed.
    async fn current_blocks(
        &self,
        ino: u64,
        off: u64,
        len: u64,
        size: u64,
    ) -> Result<Vec<u8>, FsError> {
        if off >= size {
            // Wholly past the end of file: zeros, whatever the blocks hold.
            return Ok(vec![0u8; usize::try_from(len).map_err(|_| FsError::Range)?]);
        }
        let bs = self.store.block_size();
        let vol = self.store.volume_cell();
        // Planned as if the file were as long as the span; bytes past `size` are zeroed below.
        let mapped = self
            .store
            .read(|t| data::map_read_unclipped(t, &vol.get(), bs, InodeId(ino), off, len))?;
        let mut buf = self.read_plan(mapped.plan).await?;
        if size < off + len {
            let from = usize::try_from(size.saturating_sub(off)).map_err(|_| FsError::Range)?;
            buf[from..].fill(0);
        }
        Ok(buf)
    }

    /// Zeroes the bytes of the block holding `old_size` that lie past it, if that block is
    /// Written and `old_size` is not block aligned. Call under an exclusive lock covering
    /// that block, before an extension.
    pub async fn zero_eof_tail(&self, ino: u64, old_size: u64) -> Result<(), FsError> {
        let bs = self.block_size();
        if old_size.is_multiple_of(bs) {
            return Ok(());
        }
        self.zero_in_block(ino, old_size, bs - old_size % bs).await
    }

    /// Zeroes `len` bytes from `off`, which lie inside one block, if that block is Written
    /// (a hole or an Unwritten block reads as zeros already); a block that already holds
    /// zeros there is not rewritten. Call under an exclusive lock covering that block.
    pub async fn zero_in_block(&self, ino: u64, off: u64, len: u64) -> Result<(), FsError> {
        let bs = self.block_size();
        let block = off / bs * bs;
        if len == 0 || off - block + len > bs {
            return Err(FsError::Invalid(format!(
                "zeroing {len} bytes at {off} crosses a block edge"
            )));
        }
        let bsz = self.store.block_size();
        let vol = self.store.volume_cell();
        let mapped = self
            .store
            .read(|t| data::map_read_unclipped(t, &vol.get(), bsz, InodeId(ino), block, bs))?;
        if mapped.plan.device_ios.is_empty() {
            return Ok(());
        }
        let mut buf = self.read_plan(mapped.plan.clone()).await?;
        let from = usize::try_from(off - block).map_err(|_| FsError::Range)?;
        let to = from + usize::try_from(len).map_err(|_| FsError::Range)?;
        if buf[from..to].iter().all(|b| *b == 0) {
            return Ok(());
        }
        buf[from..to].fill(0);
        // Written extents plan the same for reads and writes.
        self.write_plan(mapped.plan, buf, true).await.map(|_| ())
    }

    /// A proxied read: at most `len` bytes from `off`, fewer at end of file.
    pub async fn read(
        &self,
        ino: u64,
        off: u64,
        len: u64,
        owner: u64,
    ) -> Result<(Vec<u8>, bool), FsError> {
        let bs = self.block_size();
        let end = off.checked_add(len).ok_or(FsError::Range)?;
        let a = off / bs * bs;
        let b = end.div_ceil(bs) * bs;
        if len == 0 {
            let size = self.store.read(|t| t.getattr_size(ino))?;
            return Ok((Vec::new(), off >= size));
        }
        let _held = self
            .lock(ino, Span::new(a, b - a), LockMode::Shared, owner)
            .await?;
        let bsz = self.store.block_size();
        // A small file kept whole in memory answers without a device read.
        // (The attributes are read only for a file kept: no store read for every other
        // proxied read.)
        if self.small.holds(ino)
            && let Some(attr) = self.small_file_attr(ino)
            && let Some(data) = self.small.read(&attr, off, len)
        {
            let eof = off.saturating_add(data.len() as u64) >= attr.size;
            return Ok((data, eof));
        }
        let vol = self.store.volume_cell();
        let Mapped {
            plan,
            file_size,
            len: span,
            ..
        } = self
            .store
            .read(|t| data::map_read(t, &vol.get(), bsz, InodeId(ino), a, b - a))?;
        if span == 0 || off >= file_size {
            return Ok((Vec::new(), true));
        }
        let buf = self.read_plan(plan).await?;
        let stop = end.min(file_size);
        let from = usize::try_from(off - a).map_err(|_| FsError::Range)?;
        let to = usize::try_from(stop - a).map_err(|_| FsError::Range)?;
        // The whole of a small file, read under a shared lock of all of it (no writer
        // there): kept, with the attributes it has now.
        if off == 0
            && stop >= file_size
            && file_size <= SMALL_FILE_MAX
            && let Some(attr) = self.small_file_attr(ino)
            && attr.size == file_size
        {
            self.small.put(&attr, buf[..to].to_vec());
        }
        Ok((buf[from..to].to_vec(), stop >= file_size))
    }

    /// The attributes of `ino` when it is a small regular file (at most [`SMALL_FILE_MAX`]
    /// bytes, not empty): the key of [`SmallFiles`].
    fn small_file_attr(&self, ino: u64) -> Option<Attr> {
        let bs = self.store.block_size();
        self.store
            .read(|t| {
                use crate::store::ReaderInodes;
                Ok(t.inode_rec(InodeId(ino))?.attr(InodeId(ino), bs))
            })
            .ok()
            .filter(|a| a.size > 0 && a.size <= SMALL_FILE_MAX && a.kind == FileType::Regular)
    }

    /// A proxied write of `bytes` at `pos`. Returns the offset written and the new attributes,
    /// once the data is flushed and its completion durable (an O_SYNC write needs no more).
    /// `then`: attribute changes of the file applied right after the write, in its durable
    /// transaction (checked first: a change refused refuses the write, nothing changed).
    pub async fn write(
        &self,
        ino: u64,
        pos: Position,
        bytes: Vec<u8>,
        writer_is_root: bool,
        owner: u64,
        then: Option<SetAttrRequest>,
    ) -> Result<(u64, Attr), FsError> {
        if let Some(t) = &then {
            // Refused before anything is written (and again in the transaction below).
            self.store.read(|r| {
                use crate::store::ReaderInodes;
                ns::setattr_allowed(t, &r.inode_rec(InodeId(ino))?, || false)
            })?;
        }
        let bs = self.block_size();
        let len = bytes.len() as u64;
        if len == 0 {
            return Err(FsError::Invalid("an empty write".into()));
        }
        // Appends lock the whole file so that the end of file cannot move under them.
        let mut once = None;
        let (off, held) = match pos {
            Position::At(off) => {
                let end = off.checked_add(len).ok_or(FsError::FileTooBig)?;
                let a = off / bs * bs;
                let b = end.div_ceil(bs) * bs;
                let size = self.store.read(|t| t.getattr_size(ino))?;
                // Cover the old EOF block too when this write extends the file past it.
                let lo = if off > size && !size.is_multiple_of(bs) {
                    (size / bs * bs).min(a)
                } else {
                    a
                };
                let held = self
                    .lock(ino, Span::new(lo, b - lo), LockMode::Exclusive, owner)
                    .await?;
                (off, held)
            }
            Position::Append(id) => {
                let held = self
                    .lock(ino, Span::new(0, u64::MAX), LockMode::Exclusive, owner)
                    .await?;
                // Under the whole-file lock a first try still running has finished: its
                // reply, if it was written, is in the cache now.
                if let Some(id) = id {
                    let stored = self
                        .store
                        .write_lazy(move |ctx| replies::lookup::<pb::WriteReply>(ctx, id.id))
                        .await?;
                    if let Some(stored) = stored {
                        let reply = WriteReply::try_from(stored.reply)
                            .map_err(|e| FsError::Io(format!("a stored append reply: {e}")))?;
                        return Ok((reply.written.offset(), reply.attr));
                    }
                    once = Some(id);
                }
                (self.store.read(|t| t.getattr_size(ino))?, held)
            }
        };
        let end = off.checked_add(len).ok_or(FsError::FileTooBig)?;
        let a = off / bs * bs;
        let b = end.div_ceil(bs) * bs;
        let size = self.store.read(|t| t.getattr_size(ino))?;
        if off > size {
            self.zero_eof_tail(ino, size).await?;
        }
        // Head and tail blocks that the application's bytes cover only in part.
        let mut buf = vec![0u8; usize::try_from(b - a).map_err(|_| FsError::Range)?];
        if off != a {
            let head = self.current_blocks(ino, a, bs, size).await?;
            buf[..head.len()].copy_from_slice(&head);
        }
        if end != b && (b - bs > a || off == a) {
            let tail = self.current_blocks(ino, b - bs, bs, size).await?;
            let at = usize::try_from(b - bs - a).map_err(|_| FsError::Range)?;
            buf[at..].copy_from_slice(&tail);
        }
        let from = usize::try_from(off - a).map_err(|_| FsError::Range)?;
        buf[from..from + bytes.len()].copy_from_slice(&bytes);
        drop(bytes);
        // A write of a whole small file (from its start to at least its old end): kept once
        // written, under this write's exclusive lock.
        let whole = (off == 0 && end >= size && end <= SMALL_FILE_MAX)
            .then(|| usize::try_from(end).ok())
            .flatten()
            .map(|n| buf[..n].to_vec());
        let job = WriteJob {
            ino,
            a,
            b,
            off,
            len,
            end,
            writer_is_root,
            then,
            once,
        };
        // A small write is journaled with its commit: one transaction and one sync (the
        // journal's), its LUN write beside that commit, under its range lock.
        let unjournaled = match &self.journal {
            Some(j) if b - a <= JOURNALED_WRITE_MAX => {
                self.write_journaled(j, job, buf, held).await?
            }
            _ => Err((job, buf, held)),
        };
        let attr = match unjournaled {
            Ok(attr) => attr,
            Err((job, buf, held)) => {
                let attr = self.write_flushed(job, buf).await;
                drop(held);
                attr?
            }
        };
        if let Some(whole) = whole
            && whole.len() as u64 == attr.size
        {
            self.small.put(&attr, whole);
        }
        Ok((off, attr))
    }

    /// A proxied write of at most [`JOURNALED_WRITE_MAX`] on a store with a journal, in one
    /// durable commit: its allocation, its bytes staged in the journal (they go into that
    /// commit's record: durable with it) and its completion. The LUN write starts in the
    /// transaction, once the completion is made, and runs beside the commit's record and
    /// sync; the write is answered once both are done. Until then it holds its exclusive
    /// range lock `held` (nobody reads the blocks there before they are written) and
    /// `DataPath::journaling` (no settling passes the bytes before they are on their LUN).
    /// `Ok(Err(..))`: the journal was full (others filled it meanwhile): nothing staged, the
    /// blocks are allocated (Unwritten), and the caller writes them as any write.
    async fn write_journaled(
        &self,
        j: &DataJournal,
        job: WriteJob,
        buf: Vec<u8>,
        held: Held,
    ) -> Result<Result<Attr, (WriteJob, Vec<u8>, Held)>, FsError> {
        let (ino, a, b) = (job.ino, job.a, job.b);
        if j.unsettled_bytes() + (b - a) > JOURNALED_UNSETTLED_MAX {
            self.settle().await?;
        }
        // Blocks a fallocate noted for zeroing are zeroed before the server writes into
        // them, never after (this write allocates none that need it: `map_write` notes none).
        self.zero_fresh().await?;
        let quiet = self.journaling.read().await;
        let vol = self.store.volume_cell();
        let devices = self.devices.clone();
        let journal = j.clone();
        let rt = tokio::runtime::Handle::current();
        let (outcome, _) = self
            .store
            .write_data(true, Luns::listed(Vec::new()), move |ctx| {
                job.check_then(ctx)?;
                let mapped = map_whole(ctx, &vol.get(), job.ino, a, b)?;
                let ops = devices.plan_ops(&mapped.plan, &buf).map_err(OpError::Fs)?;
                let staged = journal
                    .stage(ops.clone(), JOURNALED_UNSETTLED_MAX)
                    .map_err(|e| OpError::Fs(FsError::Io(format!("journaling a write: {e}"))))?;
                let Some(ids) = staged else {
                    return Ok(Journaling::Full(job, buf));
                };
                let attr = match job.complete_data(ctx) {
                    Ok(attr) => attr,
                    Err(e) => {
                        // Refused before it changed anything: its bytes must never reach
                        // the LUN by a replay.
                        journal.unstage(&ids);
                        return Err(e);
                    }
                };
                // The completion is in: the bytes go to the LUN whatever follows. The LUN
                // write starts now, beside the rest of the commit (its record and sync):
                // nobody reads the blocks before it is done (the range lock).
                let io = rt.spawn_blocking(move || devices.write_ops(&ops));
                // An attribute change sent with the bytes that is refused now leaves the
                // bytes written (as an unjournaled write's would be) and answers its error.
                let attr = match job.finish(ctx, attr) {
                    Ok(attr) => Ok(attr),
                    Err(OpError::Fs(e)) => Err(e),
                    Err(store) => return Err(store),
                };
                Ok(Journaling::Staged(attr, io, ids))
            })
            .await?;
        let (attr, io, ids) = match outcome {
            Journaling::Full(job, buf) => {
                drop(quiet);
                return Ok(Err((job, buf, held)));
            }
            Journaling::Staged(attr, io, ids) => (attr, io, ids),
        };
        metrics::counter!(DATA_JOURNALED).increment(1);
        let written = io.await.map_err(join_error).and_then(|r| r);
        if let Err(e) = written {
            // The commit is durable: the journal keeps the bytes for the next start to write,
            // and this server stops (fail-stop) still holding the range, so that nobody reads
            // the blocks' old contents meanwhile.
            j.not_written(&ids);
            self.store.fail(format!(
                "inode {ino}: a journaled write failed on its LUN after its commit: {e}"
            ));
            std::mem::forget(held);
            drop(quiet);
            return Err(e);
        }
        drop(quiet);
        drop(held);
        attr.map(Ok)
    }

    /// A proxied write that is not journaled: its blocks allocated (lazily: the server
    /// writes them itself, so no other party depends on the allocation, and a crash before
    /// the next durable commit frees them again with nothing pointing at them), written
    /// and then completed by a durable commit that flushes their LUNs first.
    async fn write_flushed(&self, job: WriteJob, buf: Vec<u8>) -> Result<Attr, FsError> {
        let (ino, a, b) = (job.ino, job.a, job.b);
        let vol = self.store.volume_cell();
        let mapped = self
            .store
            .write_lazy(move |ctx| map_whole(ctx, &vol.get(), ino, a, b))
            .await?;
        self.zero_fresh().await?;
        // Not flushed here: the commit below flushes the LUNs first.
        let touched = self.write_plan(mapped.plan, buf, false).await?;
        let touched = Luns::listed(touched.iter().map(|d| d.0).collect());
        // One durable commit per proxied write: the completion (Unwritten -> Written, the new
        // size) is acknowledged only once durable, and it makes the lazy allocation above
        // durable with it. Two syncs per small write (allocation, then completion) made
        // bonnie++'s 8 KiB writes run at tens of writes a second. The data LUNs are flushed
        // before that commit (shared by every write of its group): a LUN that loses its
        // volatile cache at a power cut cannot leave the blocks Written over old bytes.
        let (attr, _) = self
            .store
            .write_data(true, touched, move |ctx| {
                job.check_then(ctx)?;
                let attr = job.complete_data(ctx)?;
                job.finish(ctx, attr)
            })
            .await?;
        Ok(attr)
    }
}

/// What a proxied write's commit needs to know of it.
struct WriteJob {
    ino: u64,
    /// Its whole blocks `[a, b)`.
    a: u64,
    b: u64,
    /// The application's bytes: `[off, end)`, `len` of them.
    off: u64,
    len: u64,
    end: u64,
    writer_is_root: bool,
    /// An attribute change sent with the bytes.
    then: Option<SetAttrRequest>,
    /// An append's request id: its reply is kept with the completion.
    once: Option<AppendOnce>,
}

/// Allocates and plans a proxied write's whole blocks `[a, b)` of `ino`: all of them in one
/// grant, or a clear error.
fn map_whole(
    ctx: &mut crate::store::Ctx<'_>,
    volume: &sanfs_blockmap::volume::Volume,
    ino: u64,
    a: u64,
    b: u64,
) -> Result<Mapped, OpError> {
    let mapped = data::map_write(ctx, volume, InodeId(ino), a, b - a)?;
    if mapped.len != b - a {
        return Err(OpError::Fs(FsError::Invalid(format!(
            "a proxied write of {} bytes is longer than one grant",
            b - a
        ))));
    }
    Ok(mapped)
}

impl WriteJob {
    /// Refuses, before the transaction changes anything, an attribute change sent with the
    /// bytes that its caller may not make.
    fn check_then(&self, ctx: &mut crate::store::Ctx<'_>) -> Result<(), OpError> {
        match &self.then {
            Some(t) => ns::setattr_allowed(t, &ctx.t.inode(InodeId(self.ino))?, || false),
            None => Ok(()),
        }
    }

    /// The completion (Unwritten -> Written, the new size and times); answers the
    /// attributes after. Refused (`OpError::Fs`) only before it changes anything.
    fn complete_data(&self, ctx: &mut crate::store::Ctx<'_>) -> Result<Attr, OpError> {
        let (ino, a, b) = (self.ino, self.a, self.b);
        data::complete_write_to(ctx, InodeId(ino), a, b - a, self.end, self.writer_is_root)
    }

    /// After [`WriteJob::complete_data`]: the attribute change sent with the bytes and an
    /// append's stored reply; answers the attributes after.
    fn finish(&self, ctx: &mut crate::store::Ctx<'_>, attr: Attr) -> Result<Attr, OpError> {
        let attr = match &self.then {
            Some(t) => ns::setattr(ctx, t)?,
            None => attr,
        };
        if let Some(once) = self.once {
            // Durable with the completion, or lost with it.
            let written = ByteRange::new(self.off, self.len)
                .map_err(|e| OpError::Fs(FsError::Invalid(e.to_string())))?;
            let reply = pb::WriteReply::from(WriteReply {
                written,
                attr: attr.clone(),
                lease_ms: 0,
            });
            replies::remember(ctx, once.id, once.session, &reply)?;
        }
        Ok(attr)
    }
}

/// A journaled write's commit: staged (with its attributes after, its LUN write under way
/// and its staged ids), or not (the journal was full) with what the caller needs to write
/// it as any write.
enum Journaling {
    Staged(
        Result<Attr, FsError>,
        tokio::task::JoinHandle<Result<(), FsError>>,
        Vec<u64>,
    ),
    Full(WriteJob, Vec<u8>),
}

/// Size lookups on a snapshot.
pub trait SizeOf {
    fn getattr_size(&self, ino: u64) -> Result<u64, crate::store::OpError>;
}

impl<T: crate::store::ReaderInodes> SizeOf for T {
    fn getattr_size(&self, ino: u64) -> Result<u64, crate::store::OpError> {
        let rec = self.inode_rec(InodeId(ino))?;
        rec.regular()?;
        Ok(rec.size)
    }
}
