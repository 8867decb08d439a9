//! The committer: one thread that runs every queued job of a batch in one write transaction
//! and commits it (group commit), and the [`Ctx`] each job gets.
//!
//! Whoever commits holds the [`Engine`] (the write side: the database, the allocator, the
//! commit numbers): the committer thread, or a submitter of a lazy job that finds nobody
//! committing (`Store::submit`). Such a submitter commits the lazy jobs at the queue's front
//! itself, on its own thread, and hands the rest (durable work, lazy work overdue) to the
//! committer thread: a namespace change answered before it is durable then costs no thread
//! switch to the committer and back (measured on the 2-core VM: ~45 us to wake the committer
//! and ~27 us to wake the handler again, of a create's ~400 us). Jobs commit in the order
//! they were queued whoever commits them.

use super::*;

/// Lazily committed work older than this is made durable by the committer on its own (as
/// ext4's commit interval), so that agents' records of lazy completions stay few.
pub const LAZY_SYNC_AFTER: std::time::Duration = std::time::Duration::from_secs(1);

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
    /// The super record and the volume record (rewritten by a growth).
    pub sup: Table<'t, &'static str, &'static [u8]>,
    pub st: &'t mut State,
    pub now: Timestamp,
    pub block_size: u32,
    /// The inode number and generation the next new inode must have (a replayed create,
    /// `crate::service::replay`): taken by [`Ctx::new_inode_number`], reset per job.
    pub forced_inode: Option<(u64, u64)>,
    /// The job replays a change of the last run (reset per job): an inode whose last link
    /// goes is kept as an orphan even if nobody holds it open now, since its agent opens its
    /// files again only after its replays; the recovery after the reclaim window reaps the
    /// orphans nobody opened again.
    pub replaying: bool,
    /// The job was queued as data work ([`Job::flush`], `Store::write_data`): only such a job
    /// may make written blocks readable (`data::complete_write_to` refuses otherwise), so
    /// that no conversion becomes durable before its data is flushed. Set per job.
    pub data: bool,
}

/// A job's answer, called with its commit's number once that commit is done (or failed).
pub(super) type Reply = Box<dyn FnOnce(Result<u64, String>) + Send>;
/// A job's work: run on the batch's transaction, or told why its batch was refused before
/// anything ran (`Err`: the data LUNs could not be flushed, see [`Job::flush`]).
pub(super) type Run = Box<dyn for<'t> FnOnce(Result<&mut Ctx<'t>, &str>) -> (Reply, bool) + Send>;

/// Flushes the write caches of the data LUNs named (set by the server once its LUNs are open,
/// [`super::Store::set_data_flush`]); an error says why.
pub type DataFlush = Box<dyn Fn(&Luns) -> Result<(), String> + Send + Sync>;

/// The data LUNs a job's data was written to (indexes in the volume's device list).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Luns {
    /// Every LUN (the caller does not know which, or an fsync).
    All,
    /// These (sorted, without repeats).
    Listed(Vec<u32>),
}

impl Luns {
    /// These LUNs (in any order, repeats allowed).
    pub fn listed(mut luns: Vec<u32>) -> Luns {
        luns.sort_unstable();
        luns.dedup();
        Luns::Listed(luns)
    }

    /// The LUNs of both.
    pub fn union(&self, other: &Luns) -> Luns {
        match (self, other) {
            (Luns::Listed(a), Luns::Listed(b)) => Luns::listed([a.as_slice(), b].concat()),
            _ => Luns::All,
        }
    }
}

/// Counter of the data LUN flushes the committer made before durable commits (see
/// [`Job::flush`]).
pub const DATA_FLUSHES: &str = "sanfs_commit_data_flushes_total";

/// A queued change. A `lazy` one may be committed without a sync: it becomes durable with the
/// next durable commit (any non-lazy job, or [`Store::sync`]), and a crash before that loses
/// it whole (never half of it).
///
/// A lazy job with an `owner` (a session: a namespace change its agent keeps a record of
/// until it is durable, docs/protocol.md "Namespace changes before they are durable") is
/// committed lazily only while every change not durable yet is that same session's: a batch
/// with another session's owned change in it, or after one, is made durable. So the changes
/// a crash can lose are always one session's, which its agent replays in order on the
/// durable state they were made on; and other sessions never see them before they are
/// durable ([`Store::foreign_undurable`] tells readers when to sync first). `owner` 0: a
/// lazy change that belongs to nobody (a write completion).
///
/// A `flush` job (with the LUNs its data went to) makes data written there readable (an
/// Unwritten -> Written conversion) or must be durable only after that data (fsync): those
/// LUNs' write caches are flushed before the commit that makes it durable, its own if it is
/// durable, else the next durable one. Data a crash of a LUN's volatile cache loses then reads as zeros (its
/// blocks are still Unwritten), never as the blocks' old bytes.
pub(super) struct Job {
    pub(super) run: Run,
    pub(super) lazy: bool,
    pub(super) owner: u64,
    pub(super) flush: Option<Luns>,
}

/// Whether a batch must be durable: it has a non-lazy job, or owned lazy jobs of more than
/// one session, or of another session than `undurable_owner` (the session whose owned
/// changes are committed but not durable; 0: none).
pub(super) fn batch_durable(batch: &[Job], undurable_owner: u64) -> bool {
    let mut owner = undurable_owner;
    !batch.iter().all(|j| joins_lazily(j, &mut owner))
}

/// Whether `job` may join a lazy commit whose owned changes (and the undurable ones before
/// it) are `owner`'s (0: nobody's yet); updates `owner` when it may.
fn joins_lazily(job: &Job, owner: &mut u64) -> bool {
    if !job.lazy {
        return false;
    }
    if job.owner != 0 {
        if *owner != 0 && *owner != job.owner {
            return false;
        }
        *owner = job.owner;
    }
    true
}

/// The session that owns the lazy changes of `batch` (0: none).
fn batch_owner(batch: &[Job]) -> u64 {
    batch.iter().map(|j| j.owner).find(|o| *o != 0).unwrap_or(0)
}

/// Histogram of the time a durable commit takes (its transactions run, then the fsync), in
/// seconds; the process's `metrics` recorder keeps it (`crate::metrics`).
pub const COMMIT_SECONDS: &str = "sanfs_commit_duration_seconds";
/// Histogram of the transactions each commit carries (group commit).
pub const COMMIT_OPS: &str = "sanfs_commit_ops";

/// Counters of the committer, for metrics and the bench.
#[derive(Debug, Default)]
pub struct CommitStats {
    pub commits: AtomicU64,
    pub ops: AtomicU64,
    pub failed_ops: AtomicU64,
    /// Flushes of the data LUNs before durable commits ([`Job::flush`]).
    pub data_flushes: AtomicU64,
}

pub(super) struct Shared {
    /// Holds the journal's syncs during a durable commit (a file store; see
    /// `journal::SyncHolder`).
    pub(super) journal: Option<super::journal::SyncHolder>,
    /// The number of the last commit of this run (commits are numbered from 1 at every start).
    pub(super) commit_seq: AtomicU64,
    /// Every commit of this run up to this number is durable.
    pub(super) durable_seq: AtomicU64,
    /// The session whose owned lazy changes are committed and not durable yet, and the
    /// number of its last such commit (see [`Job`]); set *before* that commit is visible to
    /// readers, so a reader that sees the change also sees the owner.
    pub(super) undurable_owner: AtomicU64,
    pub(super) undurable_owner_seq: AtomicU64,
    pub(super) poisoned: AtomicBool,
    pub(super) reason: Mutex<Option<String>>,
    pub(super) poison_notify: tokio::sync::Notify,
    pub(super) stats: CommitStats,
    /// How the data LUNs are flushed before a durable commit carrying [`Job::flush`] work
    /// (unset: a store without data LUNs, as in tools and tests).
    pub(super) data_flush: std::sync::OnceLock<DataFlush>,
    /// Jobs waiting for a commit; `ready` wakes the committer thread for them.
    pub(super) queue: Mutex<Queue>,
    pub(super) ready: std::sync::Condvar,
    /// The write side, held by whoever commits (`None` once the store is closed).
    pub(super) engine: Mutex<Option<Engine>>,
    /// When the oldest commit that is not durable yet was made.
    pub(super) lazy_since: Mutex<Option<std::time::Instant>>,
}

/// Jobs waiting for a commit, in the order they were queued.
#[derive(Default)]
pub(super) struct Queue {
    pub(super) jobs: std::collections::VecDeque<Job>,
    /// The store is closing: no job is taken any more.
    pub(super) closed: bool,
}

/// Which jobs a commit takes from the queue ([`Engine::step`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Take {
    /// Every job waiting (up to the batch limit), durable or not: the committer thread.
    All,
    /// Only jobs at the front that make a lazy commit, and none while lazy work is overdue:
    /// a submitter committing on its own thread (it must never wait for a sync).
    LazyOnly,
}

/// The write side of the store: what a commit needs and changes. Held (under
/// [`Shared::engine`]) by whoever commits.
pub(super) struct Engine {
    pub(super) db: Arc<Database>,
    pub(super) state: State,
    pub(super) clock: Clock,
    pub(super) block_size: u32,
    pub(super) batch_max: usize,
    /// This run's epoch (commits are numbered `(epoch, seq)` in the store).
    pub(super) epoch: u64,
    /// The number of the last commit of this run.
    pub(super) seq: u64,
    /// A lazy commit carried `flush` work and no flush has been made since.
    pub(super) unflushed: Option<Luns>,
}

impl Shared {
    pub(super) fn lock_queue(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn lock_engine(&self) -> std::sync::MutexGuard<'_, Option<Engine>> {
        self.engine.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn lazy_since(&self) -> Option<std::time::Instant> {
        *self.lazy_since.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn set_lazy_since(&self, since: Option<std::time::Instant>) {
        *self.lazy_since.lock().unwrap_or_else(|p| p.into_inner()) = since;
    }

    /// Lazy work waited [`LAZY_SYNC_AFTER`] or more.
    fn lazy_overdue(&self) -> bool {
        self.lazy_since()
            .is_some_and(|t| t.elapsed() >= LAZY_SYNC_AFTER)
    }

    /// Wakes the committer thread (under the queue's lock: it cannot miss it between
    /// looking at the queue and waiting).
    fn wake_committer(&self) {
        let _q = self.lock_queue();
        self.ready.notify_one();
    }

    /// Commits the lazy jobs at the queue's front on the caller's thread when nobody else is
    /// committing (see the module's documentation); whatever it leaves (durable work, lazy
    /// work overdue, jobs queued while another holds the engine) goes to the committer
    /// thread, which is woken for it.
    pub(super) fn commit_lazy_here(&self) {
        let leftover = match self.engine.try_lock() {
            Ok(mut guard) => match guard.as_mut() {
                Some(engine) => {
                    let fresh = self.lazy_since().is_none();
                    let left = engine.step(self, Take::LazyOnly);
                    // The committer times the interval sync from the first lazy commit.
                    left || (fresh && self.lazy_since().is_some())
                }
                None => true,
            },
            Err(_) => true,
        };
        if leftover {
            self.wake_committer();
        }
    }

    pub(super) fn poison(&self, why: String) {
        tracing::error!(reason = %why, "metadata store failed: stopping (fail-stop)");
        let mut r = self.reason.lock().unwrap_or_else(|p| p.into_inner());
        if r.is_none() {
            *r = Some(why);
        }
        self.poisoned.store(true, Ordering::SeqCst);
        self.poison_notify.notify_waiters();
    }

    pub(super) fn poison_error(&self) -> FsError {
        let r = self.reason.lock().unwrap_or_else(|p| p.into_inner());
        FsError::Io(format!(
            "metadata store failed and must be restarted: {}",
            r.as_deref().unwrap_or("unknown")
        ))
    }
}

impl Ctx<'_> {
    /// This run's epoch (the durable counter bumped at every start).
    pub fn boot_epoch(&self) -> Result<u64, OpError> {
        Ok(self.counters.get(KEY_BOOT_EPOCH)?.map_or(0, |v| v.value()))
    }

    /// Sets `count` fresh inode numbers and generations aside (`ReserveInodes`; the
    /// counters persisted in this transaction): answers the first of each.
    pub fn reserve_inode_numbers(&mut self, count: u32) -> Result<(u64, u64), OpError> {
        let first = self.st.next_inode;
        let next = first
            .checked_add(u64::from(count))
            .filter(|n| *n < sanfs_proto::model::RESERVED_HANDLE_BIT)
            .ok_or(OpError::Fs(FsError::NoSpace))?;
        let first_generation = self.st.generation + 1;
        let generation = self
            .st
            .generation
            .checked_add(u64::from(count))
            .ok_or(OpError::Fs(FsError::NoSpace))?;
        self.st.next_inode = next;
        self.st.generation = generation;
        self.counters.insert(KEY_NEXT_INODE, next)?;
        self.counters.insert(KEY_GENERATION, generation)?;
        Ok((first, first_generation))
    }

    /// A fresh inode number and generation, persisted in this transaction.
    pub fn new_inode_number(&mut self) -> Result<(u64, u64), OpError> {
        if let Some((ino, generation)) = self.forced_inode.take() {
            // A replayed create: the number its agent was answered, which must be free.
            if ino == 0 || self.t.inodes.get(ino)?.is_some() {
                return Err(OpError::Fs(FsError::Exists));
            }
            let next = ino.checked_add(1).ok_or(OpError::Fs(FsError::NoSpace))?;
            self.st.next_inode = self.st.next_inode.max(next);
            self.st.generation = self.st.generation.max(generation);
            self.counters.insert(KEY_NEXT_INODE, self.st.next_inode)?;
            self.counters.insert(KEY_GENERATION, self.st.generation)?;
            self.st.usage.inodes.fetch_add(1, Ordering::Relaxed);
            return Ok((ino, generation));
        }
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

/// A durable commit of nothing: makes the lazy work before it durable.
fn empty_durable() -> Job {
    Job {
        run: Box::new(|_: Result<&mut Ctx<'_>, &str>| (Box::new(|_| {}) as Reply, true)),
        lazy: false,
        owner: 0,
        flush: None,
    }
}

/// The committer thread: commits what is queued (what a submitter did not commit itself),
/// makes lazy work durable within [`LAZY_SYNC_AFTER`], and at a close makes it durable
/// before it returns (so that nothing an agent was told survives only in its replay
/// records).
pub(super) fn committer_loop(shared: &Shared) {
    enum Wake {
        Jobs,
        Interval,
        Closing,
    }
    loop {
        let wake = {
            let mut q = shared.lock_queue();
            loop {
                if !q.jobs.is_empty() {
                    break Wake::Jobs;
                }
                if q.closed {
                    break Wake::Closing;
                }
                q = match shared.lazy_since() {
                    None => shared.ready.wait(q).unwrap_or_else(|p| p.into_inner()),
                    Some(t) => {
                        let left = (t + LAZY_SYNC_AFTER)
                            .saturating_duration_since(std::time::Instant::now());
                        if left.is_zero() {
                            break Wake::Interval;
                        }
                        shared
                            .ready
                            .wait_timeout(q, left)
                            .unwrap_or_else(|p| p.into_inner())
                            .0
                    }
                };
            }
        };
        let mut guard = shared.lock_engine();
        let Some(engine) = guard.as_mut() else {
            return;
        };
        let poisoned = shared.poisoned.load(Ordering::SeqCst);
        match wake {
            Wake::Jobs => {
                engine.step(shared, Take::All);
            }
            // Lazy work waited long enough: an empty durable commit makes it durable
            // (unless a submitter's commit made it durable meanwhile).
            Wake::Interval => {
                if shared.lazy_overdue() && !poisoned {
                    engine.commit(shared, vec![empty_durable()], true);
                }
            }
            Wake::Closing => {
                if shared.lazy_since().is_some() && !poisoned {
                    engine.commit(shared, vec![empty_durable()], true);
                }
                return;
            }
        }
    }
}

impl Engine {
    /// Takes a batch from the queue's front as `take` says and commits it. Returns whether
    /// jobs are left in the queue. After a poison, every queued job is dropped (its reply
    /// channel closes: its caller gets the poison error).
    pub(super) fn step(&mut self, shared: &Shared, take: Take) -> bool {
        let overdue = shared.lazy_overdue();
        let owner = shared.undurable_owner.load(Ordering::SeqCst);
        let (batch, left) = {
            let mut q = shared.lock_queue();
            if shared.poisoned.load(Ordering::SeqCst) {
                let dropped: Vec<Job> = q.jobs.drain(..).collect();
                drop(q);
                tracing::debug!(jobs = dropped.len(), "dropped jobs after poison");
                return false;
            }
            let mut batch = Vec::new();
            let mut lazy_owner = owner;
            while batch.len() < self.batch_max {
                let joins = match q.jobs.front() {
                    None => false,
                    Some(_) if take == Take::All => true,
                    Some(job) => !overdue && joins_lazily(job, &mut lazy_owner),
                };
                if !joins {
                    break;
                }
                if let Some(job) = q.jobs.pop_front() {
                    batch.push(job);
                }
            }
            (batch, !q.jobs.is_empty())
        };
        if batch.is_empty() {
            return left;
        }
        // Lazy work is made durable within LAZY_SYNC_AFTER also under a steady stream of
        // lazy jobs (the committer's interval fires only when the queue runs dry).
        let durable = take == Take::All && (overdue || batch_durable(&batch, owner));
        self.commit(shared, batch, durable);
        left
    }

    /// Commits `batch` in one transaction, durable or not: flushes the data LUNs its data
    /// (and earlier lazy work's) went to first when durable; answers every job.
    pub(super) fn commit(&mut self, shared: &Shared, batch: Vec<Job>, durable: bool) {
        let n = batch.len() as u64;
        let to_flush = batch
            .iter()
            .filter_map(|j| j.flush.as_ref())
            .fold(self.unflushed.clone(), |acc, l| {
                Some(acc.map_or_else(|| l.clone(), |a| a.union(l)))
            });
        if let (true, Some(luns)) = (durable, &to_flush) {
            // Every job's data was written before it was queued, and every earlier lazy
            // conversion's before its own batch: one flush now covers them all.
            if let Err(why) = flush_data(shared, luns) {
                tracing::error!(reason = %why, jobs = n, "flushing the data LUNs before a durable commit failed: its batch is refused");
                shared.stats.failed_ops.fetch_add(n, Ordering::Relaxed);
                for job in batch {
                    let (reply, _) = (job.run)(Err(&why));
                    reply(Err(why.clone()));
                }
                // The lazy work stays undurable; try again a whole interval later, not at once.
                if shared.lazy_since().is_some() {
                    shared.set_lazy_since(Some(std::time::Instant::now()));
                }
                return;
            }
            self.unflushed = None;
        } else {
            self.unflushed = to_flush;
        }
        self.seq += 1;
        let seq = self.seq;
        if !durable {
            let owner = batch_owner(&batch);
            if owner != 0 {
                shared.undurable_owner_seq.store(seq, Ordering::SeqCst);
                shared.undurable_owner.store(owner, Ordering::SeqCst);
            }
        }
        let started = std::time::Instant::now();
        // One journal sync for the whole commit, before any of it is answered.
        let hold = shared
            .journal
            .as_ref()
            .filter(|_| durable)
            .map(|j| j.hold());
        let mut result = run_batch(
            &self.db,
            batch,
            durable,
            &mut self.state,
            &self.clock,
            self.block_size,
            (self.epoch, seq),
        );
        if let Some(hold) = hold
            && let Err(e) = hold.release()
        {
            result = match result {
                Ok(replies) | Err((_, replies)) => {
                    Err((format!("sync of the metadata journal: {e}"), replies))
                }
            };
        }
        let state = &self.state;
        state
            .usage
            .free_blocks
            .store(state.alloc.free_blocks(), Ordering::Relaxed);
        match result {
            Ok(replies) => {
                shared.stats.commits.fetch_add(1, Ordering::Relaxed);
                shared.stats.ops.fetch_add(n, Ordering::Relaxed);
                metrics::histogram!(COMMIT_OPS).record(n as f64);
                if durable {
                    metrics::histogram!(COMMIT_SECONDS).record(started.elapsed().as_secs_f64());
                }
                shared.commit_seq.store(seq, Ordering::SeqCst);
                if durable {
                    shared.durable_seq.store(seq, Ordering::SeqCst);
                    shared.undurable_owner.store(0, Ordering::SeqCst);
                    shared.set_lazy_since(None);
                } else if shared.lazy_since().is_none() {
                    shared.set_lazy_since(Some(std::time::Instant::now()));
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

/// A data flush that takes this long is logged (the durable commits behind it waited).
const SLOW_DATA_FLUSH: std::time::Duration = std::time::Duration::from_secs(1);

/// Flushes the data LUNs through the server's [`DataFlush`] (none set: nothing to flush).
fn flush_data(shared: &Shared, luns: &Luns) -> Result<(), String> {
    let Some(flush) = shared.data_flush.get() else {
        return Ok(());
    };
    // Data work that wrote no LUN (a journaled write: its bytes are durable in the journal
    // record): nothing to flush, and no flush counted.
    if matches!(luns, Luns::Listed(l) if l.is_empty()) {
        return Ok(());
    }
    let started = std::time::Instant::now();
    flush(luns)?;
    let took = started.elapsed();
    if took >= SLOW_DATA_FLUSH {
        tracing::warn!(
            took_ms = took.as_millis(),
            "a flush of the data LUNs' write caches was slow: every durable commit waited for it"
        );
    }
    shared.stats.data_flushes.fetch_add(1, Ordering::Relaxed);
    metrics::counter!(DATA_FLUSHES).increment(1);
    Ok(())
}

type BatchResult = Result<Vec<Reply>, (String, Vec<Reply>)>;

fn run_batch(
    db: &Database,
    batch: Vec<Job>,
    durable: bool,
    state: &mut State,
    clock: &Clock,
    block_size: u32,
    (epoch, seq): (u64, u64),
) -> BatchResult {
    let mut replies = Vec::with_capacity(batch.len());
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
            ctx.forced_inode = None;
            ctx.replaying = false;
            ctx.data = job.flush.is_some();
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run(Ok(&mut ctx)))) {
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
        sup: txn.open_table(SUPER).map_err(e)?,
        st,
        now,
        block_size,
        forced_inode: None,
        replaying: false,
        data: false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(lazy: bool, owner: u64) -> Job {
        Job {
            run: Box::new(|_: Result<&mut Ctx<'_>, &str>| (Box::new(|_| {}) as Reply, true)),
            lazy,
            owner,
            flush: None,
        }
    }

    #[test]
    fn owned_lazy_changes_of_two_sessions_never_share_an_undurable_state() {
        // One session's changes stay lazy, also after its own earlier ones.
        assert!(!batch_durable(&[job(true, 7), job(true, 7)], 0));
        assert!(!batch_durable(&[job(true, 7)], 7));
        // Unowned lazy work (write completions) does not count.
        assert!(!batch_durable(&[job(true, 0), job(true, 7)], 0));
        assert!(!batch_durable(&[job(true, 0)], 7));
        // Two sessions in one batch, or after another's undurable ones: durable.
        assert!(batch_durable(&[job(true, 7), job(true, 8)], 0));
        assert!(batch_durable(&[job(true, 8)], 7));
        // Any durable job makes the batch durable.
        assert!(batch_durable(&[job(true, 7), job(false, 0)], 0));
        assert_eq!(batch_owner(&[job(true, 0), job(true, 9)]), 9);
        assert_eq!(batch_owner(&[job(true, 0)]), 0);
    }

    #[test]
    fn luns_to_flush_add_up() {
        let (a, b) = (Luns::listed(vec![3, 1, 3]), Luns::listed(vec![2, 1]));
        assert_eq!(a, Luns::Listed(vec![1, 3]));
        assert_eq!(a.union(&b), Luns::Listed(vec![1, 2, 3]));
        assert_eq!(a.union(&Luns::All), Luns::All);
        assert_eq!(Luns::All.union(&b), Luns::All);
    }
}
