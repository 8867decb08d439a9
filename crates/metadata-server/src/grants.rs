//! Grants: the server's permission to a client to read or write one byte range directly
//! (paper section 4.1; docs/protocol.md "The grant life cycle").
//!
//! A grant holds a byte-range lock on its inode (shared for reads, exclusive for writes) from
//! the moment it is issued until it is completed, returned, or its session expires. Its id is
//! its lock's id. A write grant's missing blocks are allocated Unwritten in a committed
//! transaction before the grant is returned; its completion converts exactly the completed
//! prefix to Written.
//!
//! Read grants may be **cacheable**: the client keeps them as a layout and reads from it
//! without asking again. So may write grants asked for as **write layouts**: the client writes
//! inside one as often as it likes, completing each write with a partial completion
//! ([`Grants::complete_part`]: that part becomes Written, the grant and its exclusive lock
//! stay), and returns it when done or recalled. Before a conflicting write lock is granted, the holders of the
//! blocking cached grants are sent a recall on their session stream; a client that ignores
//! it loses the grant when its lease runs out ([`Grants::expire_session`]), and the write
//! then proceeds. The lock wait is bounded (longer than a lease), so nothing waits forever.
//!
//! Checks on completion: the grant exists, belongs to the caller's session, carries the
//! current epoch (a grant from before a restart does not exist any more), is completed once,
//! its session is not fenced, and `bytes_done` is at most its length. Each failure is a clear
//! error that changes nothing.
//!
//! **Eviction.** A grant that others wait for (a conflicting request queued behind its lock,
//! or a `GetAttr` waiting for a write grant to end) longer than the hold limit marks its session
//! for eviction ([`Grants::stuck_holders`]; the service layer evicts). An evicted session is
//! *fenced* here ([`Grants::fence_session`]): its completions are refused from then on, so its
//! Unwritten blocks stay Unwritten; its grants and locks stay until its lease runs out
//! ([`Grants::expire_session`]), because until then its agent may still have device I/O in
//! flight.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use sanfs_proto::types::{Attr, FsError};
use tokio::sync::mpsc;

use crate::data::{self, Mapped};
use crate::locks::{LockMode, Owner, Span};
use crate::proxy::{DataPath, SizeOf};
use crate::store::Luns;
use sanfs_proto::types::{InodeId, SessionEpoch, SessionId};

/// How many times a write grant takes its lock again when other nodes' truncates keep
/// moving the end of file below the span it locked ([`Grants::map_write`]).
const MAP_WRITE_TRIES: usize = 16;

/// What a recall asks a session to give back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recall {
    pub grant_ids: Vec<u64>,
    pub ino: u64,
    pub offset: u64,
    pub len: u64,
    /// The grants are delegations (the agent writes back and drops its cache of the file).
    pub delegation: bool,
}

#[derive(Debug, Clone)]
struct GrantState {
    session: u64,
    epoch: u64,
    ino: u64,
    offset: u64,
    len: u64,
    mode: LockMode,
    cacheable: bool,
    writer_is_root: bool,
    /// A delegation: whole-file caching rights with no blocks mapped ([`Grants::delegate`]).
    delegation: bool,
    /// A write layout is filed before its lock is taken (so that a reader queued behind it
    /// can recall it) and is ready once mapped. A return that comes before (the agent
    /// acknowledged the recall of a grant it had not received yet) is noted here and carried
    /// out by `map_write`.
    pending: Option<bool>,
}

impl GrantState {
    /// Checks that grant `id` (this) is the caller's: its session and its epoch.
    fn owned_by(&self, id: u64, session: u64, epoch: u64) -> Result<(), GrantError> {
        if self.session != session {
            return Err(GrantError::Foreign(id));
        }
        if self.epoch != epoch {
            return Err(GrantError::StaleEpoch {
                grant: id,
                has: self.epoch,
                caller: epoch,
            });
        }
        Ok(())
    }
}

/// Why a grant operation was refused (mapped to statuses by the service layer).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GrantError {
    #[error("grant {0} does not exist (completed, returned, expired, or from before a restart)")]
    Unknown(u64),
    #[error("grant {0} belongs to another session")]
    Foreign(u64),
    #[error("grant {grant} is of epoch {has}, the caller's is {caller}")]
    StaleEpoch { grant: u64, has: u64, caller: u64 },
    #[error("grant {grant} belongs to session {session}, which was evicted")]
    Fenced { grant: u64, session: u64 },
    #[error("{done} bytes done, but grant {grant} covers {len}")]
    TooMuchDone { grant: u64, done: u64, len: u64 },
    #[error(transparent)]
    Fs(#[from] FsError),
}

impl GrantError {
    /// The file-system error a caller sees.
    pub fn to_fs(&self) -> FsError {
        match self {
            GrantError::Unknown(_) | GrantError::Foreign(_) => FsError::Stale,
            GrantError::StaleEpoch { .. } | GrantError::Fenced { .. } => FsError::StaleSession,
            GrantError::TooMuchDone { .. } => FsError::Invalid(self.to_string()),
            GrantError::Fs(e) => e.clone(),
        }
    }
}

/// Counters for metrics.
#[derive(Debug, Default)]
pub struct GrantStats {
    pub read_grants: std::sync::atomic::AtomicU64,
    pub write_grants: std::sync::atomic::AtomicU64,
    pub recalls: std::sync::atomic::AtomicU64,
    /// Delegations given (see [`Grants::delegate`]).
    pub delegations: std::sync::atomic::AtomicU64,
    pub lock_waits: std::sync::atomic::AtomicU64,
    pub granted_read_bytes: std::sync::atomic::AtomicU64,
    pub granted_write_bytes: std::sync::atomic::AtomicU64,
    pub expired_grants: std::sync::atomic::AtomicU64,
    /// Sessions evicted (by the hold limit or an administrator).
    pub evictions: std::sync::atomic::AtomicU64,
    /// Bytes moved through the server (the proxied path), by this server instance.
    pub proxied_read_bytes: std::sync::atomic::AtomicU64,
    pub proxied_write_bytes: std::sync::atomic::AtomicU64,
}

/// Which write grants of an inode [`Grants::settle`] ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Settle {
    /// Every write grant and delegation but the caller's own delegation (`GetAttr`).
    Attr,
    /// Write delegations only (`Lookup`, `ReadDir`: the caller is not known).
    Delegations,
    /// Every other session's (a change of the mode, owners or times).
    Others,
}

/// The live grants of the server.
pub struct Grants {
    dp: Arc<DataPath>,
    table: Mutex<GrantTable>,
    /// Notified whenever grants leave `table` ([`TableGuard`]) and when a grant's range lock
    /// is released ([`Grants::release_lock`]): what [`Grants::settle_attr`] waits on.
    grant_ended: tokio::sync::Notify,
    recall_channels: Mutex<HashMap<u64, mpsc::UnboundedSender<Recall>>>,
    /// Inodes with speculative preallocation made this run (the durable record, in the
    /// store's `prealloc` table, says which blocks), trimmed when the file's last handle
    /// closes; the next start trims whatever a crash left.
    prealloc: Mutex<HashMap<u64, (u64, u64)>>,
    /// Grants others wait for, and since when (see [`Grants::stuck_holders`]).
    waited_on: Mutex<HashMap<u64, tokio::time::Instant>>,
    /// Write grants a `GetAttr` waits for to end ([`Grants::settle_attr`]), with how many wait.
    attr_waits: Mutex<HashMap<u64, usize>>,
    /// Evicted sessions whose lease has not run out yet: their completions are refused.
    fenced: Mutex<HashSet<u64>>,
    pub stats: GrantStats,
}

impl std::fmt::Debug for Grants {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grants")
            .field("live", &self.lock_table().len())
            .finish()
    }
}

fn add(c: &std::sync::atomic::AtomicU64, n: u64) {
    c.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
}

impl Grants {
    pub fn new(dp: Arc<DataPath>) -> Grants {
        Grants {
            dp,
            table: Mutex::new(GrantTable::default()),
            grant_ended: tokio::sync::Notify::new(),
            recall_channels: Mutex::new(HashMap::new()),
            prealloc: Mutex::new(HashMap::new()),
            waited_on: Mutex::new(HashMap::new()),
            attr_waits: Mutex::new(HashMap::new()),
            fenced: Mutex::new(HashSet::new()),
            stats: GrantStats::default(),
        }
    }

    /// Recalls the cacheable grants among `blockers` (the proxied path's hook, see
    /// [`DataPath::set_recaller`]).
    pub fn recall_blockers(&self, blockers: Vec<u64>) {
        self.recall(blockers);
    }

    pub fn data_path(&self) -> &Arc<DataPath> {
        &self.dp
    }

    fn lock_table(&self) -> TableGuard<'_> {
        let table = self.table.lock().unwrap_or_else(|p| p.into_inner());
        TableGuard {
            live_before: table.len(),
            table,
            ended: &self.grant_ended,
        }
    }

    /// Releases grant `id`'s range lock on `ino` and wakes those waiting for grants to end.
    fn release_lock(&self, ino: u64, id: u64) {
        self.dp.locks.release(ino, id);
        self.grant_ended.notify_waiters();
    }

    fn prealloc(&self) -> MutexGuard<'_, HashMap<u64, (u64, u64)>> {
        self.prealloc.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn fenced(&self) -> MutexGuard<'_, HashSet<u64>> {
        self.fenced.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn attr_waits(&self) -> MutexGuard<'_, HashMap<u64, usize>> {
        self.attr_waits.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Refuses `session`'s completions from now on (it is being evicted), and sends it no
    /// more recalls. Its grants stay (their locks held) until [`Grants::expire_session`].
    pub fn fence_session(&self, session: u64) {
        self.fenced().insert(session);
        self.detach(session);
        add(&self.stats.evictions, 1);
    }

    /// Whether `session` is fenced (evicted, its lease not run out yet).
    pub fn is_fenced(&self, session: u64) -> bool {
        self.fenced().contains(&session)
    }

    /// The grants that others have waited for at least `limit` (a conflicting request
    /// queued behind the grant's lock, or a `GetAttr` waiting for a write grant to end), as
    /// `(session, grant, inode)`, of sessions not fenced yet. Called periodically: each call
    /// notes which grants are waited on now and since when (a grant nobody waits for any
    /// more starts afresh), so the wait is measured to within the calling period.
    pub fn stuck_holders(&self, limit: Duration) -> Vec<(u64, u64, u64)> {
        let now = tokio::time::Instant::now();
        let mut blockers: HashSet<u64> = self.dp.locks.holders_waited_on().into_iter().collect();
        blockers.extend(self.attr_waits().keys().copied());
        let table = self.lock_table();
        let fenced = self.fenced();
        let mut waited_on = self.waited_on.lock().unwrap_or_else(|p| p.into_inner());
        // Only grants count (not the server's own locks of the proxied path or a truncate),
        // and only ready ones (a write layout still waiting for its own lock holds nothing).
        let is_holder = |id: &u64| table.get(id).is_some_and(|g| g.pending.is_none());
        waited_on.retain(|id, _| blockers.contains(id) && is_holder(id));
        for id in blockers.into_iter().filter(is_holder) {
            waited_on.entry(id).or_insert(now);
        }
        waited_on
            .iter()
            .filter(|(_, since)| now.duration_since(**since) >= limit)
            .filter_map(|(id, _)| {
                let g = table.get(id)?;
                (!fenced.contains(&g.session)).then_some((g.session, *id, g.ino))
            })
            .collect()
    }

    /// The file's last handle closed: what was allocated ahead of its writers and lies past
    /// its end is freed, under an exclusive lock past the end of file (so no grant that may
    /// use those blocks is out).
    pub async fn trim_prealloc(&self, ino: u64) {
        // The in-memory map says which inodes have preallocation this run (the start trimmed
        // every earlier one); the durable record says how much.
        if self.prealloc().remove(&ino).is_none() {
            return;
        }
        let store = self.dp.store.clone();
        let bs = u64::from(store.block_size());
        let size = match store.read(|t| t.getattr_size(ino)) {
            Ok(s) => s,
            Err(_) => return, // gone: its blocks went with it
        };
        let from = size / bs * bs;
        let held = match self
            .exclusive(ino, Span::new(from, u64::MAX - from), 0)
            .await
        {
            Ok(h) => h,
            Err(e) => {
                tracing::warn!(ino, error = %e, "preallocation not trimmed");
                return;
            }
        };
        let trimmed = store
            .write(move |ctx| {
                let Some((first, end)) = ctx.prealloc.remove(ino)?.map(|v| v.value()) else {
                    return Ok(0);
                };
                crate::space::trim_unwritten_past_eof(ctx, InodeId(ino), first, end)
            })
            .await;
        match trimmed {
            Ok(freed) if freed > 0 => {
                tracing::debug!(ino, freed, "speculative preallocation trimmed")
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(ino, error = %e, "preallocation not trimmed"),
        }
        drop(held);
    }

    /// Live grants per session: `session -> (read grants, write grants)` (for ServerStatus).
    pub fn per_session(&self) -> HashMap<u64, (u32, u32)> {
        let mut by_session: HashMap<u64, (u32, u32)> = HashMap::new();
        // A write layout still waiting for its lock holds nothing yet.
        for g in self.lock_table().values().filter(|g| g.pending.is_none()) {
            let e = by_session.entry(g.session).or_default();
            if g.mode == LockMode::Shared {
                e.0 = e.0.saturating_add(1);
            } else {
                e.1 = e.1.saturating_add(1);
            }
        }
        by_session
    }

    fn channels(&self) -> MutexGuard<'_, HashMap<u64, mpsc::UnboundedSender<Recall>>> {
        self.recall_channels
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// Where recalls for `session` go (its session stream). Replaces an earlier channel.
    /// A session that had none (its first stream: after a delegation reclaimed in the
    /// reclaim window, before its agent attaches; or a stream that broke and attaches again)
    /// did not hear the recalls sent meanwhile: those of its grants that others still wait
    /// for are recalled again now.
    pub fn attach(&self, session: u64, tx: mpsc::UnboundedSender<Recall>) {
        if self.channels().insert(session, tx).is_some() {
            return;
        }
        let waited: HashSet<u64> = self
            .dp
            .locks
            .holders_waited_on()
            .into_iter()
            .chain(self.attr_waits().keys().copied())
            .collect();
        let unheard: Vec<u64> = self
            .lock_table()
            .iter()
            .filter(|(id, g)| g.session == session && waited.contains(id))
            .map(|(id, _)| *id)
            .collect();
        if !unheard.is_empty() {
            tracing::debug!(
                session,
                grants = unheard.len(),
                "recalls sent again at the attach"
            );
            self.recall(unheard);
        }
    }

    pub fn detach(&self, session: u64) {
        self.channels().remove(&session);
    }

    /// Why a grant of `session` vanished from the table while its lock was awaited: the
    /// session ended (`StaleSession`: its agent starts a new one), or it closed its last
    /// handle on the file ([`Grants::drop_for_inode`]), which ends only that file's grants
    /// (`Stale`, as for the closed handle: a session that lives must not be told it ended).
    fn vanished(&self, session: u64) -> FsError {
        if self.channels().contains_key(&session) {
            FsError::Stale
        } else {
            FsError::StaleSession
        }
    }

    /// Live grants (for status and tests).
    pub fn live(&self) -> usize {
        self.lock_table().len()
    }

    /// The grant ids a session holds.
    pub fn of_session(&self, session: u64) -> Vec<u64> {
        self.lock_table()
            .iter()
            .filter(|(_, g)| g.session == session)
            .map(|(id, _)| *id)
            .collect()
    }

    /// Sends recalls for the cacheable grants among `blockers`.
    fn recall(&self, blockers: Vec<u64>) {
        let mut by_session: HashMap<u64, Vec<(u64, GrantState)>> = HashMap::new();
        {
            let table = self.lock_table();
            for id in blockers {
                if let Some(g) = table.get(&id).filter(|g| g.cacheable) {
                    by_session
                        .entry(g.session)
                        .or_default()
                        .push((id, g.clone()));
                }
            }
        }
        let channels = self.channels();
        for (session, grants) in by_session {
            let Some(tx) = channels.get(&session) else {
                continue; // no stream: sent again at its attach, or the lease decides
            };
            for (id, g) in grants {
                add(&self.stats.recalls, 1);
                tracing::debug!(
                    session,
                    grant = id,
                    ino = g.ino,
                    mode = ?g.mode,
                    "recalling a cached grant"
                );
                let _ = tx.send(Recall {
                    grant_ids: vec![id],
                    ino: g.ino,
                    offset: g.offset,
                    len: g.len,
                    delegation: g.delegation,
                });
            }
        }
    }

    async fn take_lock(
        &self,
        id: u64,
        ino: u64,
        span: Span,
        mode: LockMode,
        session: u64,
    ) -> Result<(), FsError> {
        let waited = self
            .dp
            .locks
            .acquire_as(
                ino,
                id,
                span,
                mode,
                Owner::session(session),
                self.dp.lock_timeout,
                |blockers| self.recall(blockers),
            )
            .await
            .map_err(|_| FsError::LockTimeout)?;
        if waited {
            add(&self.stats.lock_waits, 1);
        }
        Ok(())
    }

    /// Control info 1 -> 2 for a write. `offset`/`len` must be block aligned. A `layout`
    /// grant is cacheable: completed part by part ([`Grants::complete_part`]) and kept until
    /// it is returned or recalled.
    #[allow(
        clippy::too_many_arguments,
        reason = "the grant's identity and its request"
    )]
    pub async fn map_write(
        &self,
        session: SessionId,
        epoch: SessionEpoch,
        ino: InodeId,
        offset: u64,
        len: u64,
        writer_is_root: bool,
        layout: bool,
    ) -> Result<(u64, Mapped), FsError> {
        self.map_write_as(
            session,
            epoch,
            ino,
            (offset, len),
            writer_is_root,
            layout,
            false,
        )
        .await
    }

    /// [`Grants::map_write`] of a write layout asked ahead of a sequential writer
    /// (`MapRequest.ahead`): speculative, so granted at most an eighth of the free space past
    /// the file's allocated blocks (the bound of speculative preallocation,
    /// `data::speculative_blocks`; the grant is the range's first part), and refused with
    /// `NoSpace`, nothing allocated, where that is less than a block or the blocks it must
    /// allocate are more than that when it allocates: a real write elsewhere never fails for
    /// want of the space a guess took.
    pub async fn map_layout_ahead(
        &self,
        session: SessionId,
        epoch: SessionEpoch,
        ino: InodeId,
        (offset, len): (u64, u64),
        writer_is_root: bool,
    ) -> Result<(u64, Mapped), FsError> {
        self.map_write_as(
            session,
            epoch,
            ino,
            (offset, len),
            writer_is_root,
            true,
            true,
        )
        .await
    }

    #[allow(
        clippy::too_many_arguments,
        reason = "the grant's identity and its request"
    )]
    async fn map_write_as(
        &self,
        session: SessionId,
        epoch: SessionEpoch,
        ino: InodeId,
        (offset, len): (u64, u64),
        writer_is_root: bool,
        layout: bool,
        ahead: bool,
    ) -> Result<(u64, Mapped), FsError> {
        let store = &self.dp.store;
        let bs = u64::from(store.block_size());
        if len == 0 || !offset.is_multiple_of(bs) || !len.is_multiple_of(bs) {
            return Err(FsError::Invalid(format!(
                "a write grant's range must be non-empty and {bs}-byte aligned: {offset}+{len}"
            )));
        }
        // The file's size, and for a guess where its allocation ends (bytes), in one snapshot.
        let (mut size, allocated) = store.read(|t| {
            let allocated = if ahead {
                data::allocated_end(t, ino)?.saturating_mul(bs)
            } else {
                0
            };
            Ok((t.getattr_size(ino.0)?, allocated))
        })?;
        let mut len = len.min(data::MAX_GRANT_BYTES);
        if ahead {
            // A guess never allocates more than an eighth of the free space: a long one past
            // the file's blocks (a streaming writer's layouts grow) is cut to that, a block
            // at least; a rewrite of allocated blocks is not.
            let eighth = store
                .usage()
                .free_blocks
                .load(std::sync::atomic::Ordering::Relaxed)
                / 8;
            let room = allocated
                .saturating_sub(offset)
                .saturating_add(eighth.saturating_mul(bs));
            if room == 0 {
                return Err(FsError::NoSpace);
            }
            len = len.min(room);
        }
        let end = offset.checked_add(len).ok_or(FsError::FileTooBig)?;
        let mut tries = 0;
        let (id, state) = loop {
            // An extension past a mid-block end of file also locks (and zeroes) that block's
            // tail.
            let lo = if offset > size && !size.is_multiple_of(bs) {
                size / bs * bs
            } else {
                offset
            };
            let id = self.dp.next_id();
            let state = GrantState {
                session: session.0,
                epoch: epoch.0,
                ino: ino.0,
                offset,
                len: 0,
                mode: LockMode::Exclusive,
                cacheable: layout,
                writer_is_root,
                delegation: false,
                pending: layout.then_some(false),
            };
            if layout {
                self.lock_table().insert(id, state.clone());
            }
            if let Err(e) = self
                .take_lock(
                    id,
                    ino.0,
                    Span::new(lo, end - lo),
                    LockMode::Exclusive,
                    session.0,
                )
                .await
            {
                self.lock_table().remove(&id);
                return Err(e);
            }
            if layout && !self.lock_table().contains_key(&id) {
                // The session ended, or closed the file, while the lock was awaited.
                self.release_lock(ino.0, id);
                return Err(self.vanished(session.0));
            }
            // The holders the lock waited for completed their writes first: the end of file
            // may have moved. The tail zeroed below is the one past the end as it is now
            // (past the size read before, it would wipe bytes written meanwhile).
            let now = match store.read(|t| t.getattr_size(ino.0)) {
                Ok(n) => n,
                Err(e) => {
                    self.lock_table().remove(&id);
                    self.release_lock(ino.0, id);
                    return Err(e);
                }
            };
            let tail_locked = offset <= now || now.is_multiple_of(bs) || now / bs * bs >= lo;
            if tail_locked {
                size = now;
                break (id, state);
            }
            // It shrank (a truncate) below the locked span: again, from its new end.
            self.lock_table().remove(&id);
            self.release_lock(ino.0, id);
            tries += 1;
            if tries >= MAP_WRITE_TRIES {
                return Err(FsError::Io(format!(
                    "inode {}: its end of file kept moving under other nodes' truncates",
                    ino.0
                )));
            }
            size = now;
        };
        let result = async {
            // The grant reaches past the end of file: the bytes of its last block past the
            // end are zeroed now, whether or not the first write under the grant starts
            // there (a layout is written piecemeal: a write past the end inside it later
            // asks nothing, and would expose them). The lock covers that block: `offset`
            // is block aligned, so either it starts at or before that block, or past the
            // end, where `lo` was moved down to the block.
            if end > size {
                self.dp.zero_eof_tail(ino.0, size).await?;
            }
            let vol = store.volume_cell();
            // Inside blocks allocated already (preallocation, overwrites): no commit at all.
            let bsz = store.block_size();
            if let Some(m) =
                store.read(|t| data::plan_allocated_write(t, &vol.get(), bsz, ino, offset, len))?
            {
                // Blocks allocated by a fallocate that has not zeroed them yet are zeroed
                // first (a pass with nothing noted is one snapshot read).
                self.dp.zero_fresh().await?;
                // The server's journaled writes are settled before a client may write blocks
                // itself (under the lock: none of this range is journaled after it), so that
                // a replay of the journal never puts older bytes over the client's.
                self.dp.settle().await?;
                return Ok(m);
            }
            let free = store
                .usage()
                .free_blocks
                .load(std::sync::atomic::Ordering::Relaxed);
            // What a guess allocates: its blocks past the file's allocation (holes aside).
            if ahead && end.saturating_sub(offset.max(allocated)).div_ceil(bs) > free / 8 {
                return Err(FsError::NoSpace);
            }
            // A layout asked ahead is the guess itself: no preallocation past it.
            let ahead = if ahead {
                0
            } else {
                data::speculative_blocks(end.div_ceil(bs), bsz, free)
            };
            let (m, ahead_range) = store
                .write(move |ctx| data::map_write_ahead(ctx, &vol.get(), ino, offset, len, ahead))
                .await?;
            // The fresh blocks hold whatever they held before (a deleted file's bytes): zeroed
            // on the LUNs before the grant leaves, so a completion without the device I/O
            // exposes zeros.
            self.dp.zero_fresh().await?;
            // As above; here after the allocation, so that journaled writes of these blocks'
            // last owner are settled too.
            self.dp.settle().await?;
            if ahead_range.1 > ahead_range.0 {
                let mut pre = self.prealloc();
                let e = pre.entry(ino.0).or_insert(ahead_range);
                e.0 = e.0.min(ahead_range.0);
                e.1 = e.1.max(ahead_range.1);
            }
            Ok(m)
        }
        .await;
        if layout {
            return self.register_layout(id, state, result).await;
        }
        self.register(id, state, result)
    }

    /// Control info 1 -> 2 for a read. Cacheable read grants stay until returned or recalled.
    pub async fn map_read(
        &self,
        session: SessionId,
        epoch: SessionEpoch,
        ino: InodeId,
        offset: u64,
        len: u64,
        cacheable: bool,
    ) -> Result<(u64, Mapped), FsError> {
        let store = &self.dp.store;
        let bs = store.block_size();
        let end = offset.checked_add(len).ok_or(FsError::Range)?;
        let id = self.dp.next_id();
        // The grant is in the table before its lock is taken: a writer that queues behind
        // the lock while the plan is being built must find it there to recall it (else it
        // would wait for a cached grant nobody recalls until its lock timeout).
        self.lock_table().insert(
            id,
            GrantState {
                session: session.0,
                epoch: epoch.0,
                ino: ino.0,
                offset,
                len,
                mode: LockMode::Shared,
                cacheable,
                writer_is_root: false,
                delegation: false,
                pending: Some(false),
            },
        );
        if let Err(e) = self
            .take_lock(
                id,
                ino.0,
                Span::new(offset, end - offset),
                LockMode::Shared,
                session.0,
            )
            .await
        {
            self.lock_table().remove(&id);
            return Err(e);
        }
        let vol = store.volume_cell();
        let mapped = store.read(|t| data::map_read(t, &vol.get(), bs, ino, offset, len));
        let filed = {
            let mut table = self.lock_table();
            match (table.get_mut(&id), &mapped) {
                // The session ended, or closed the file, while the lock was awaited.
                (None, _) => Err(self.vanished(session.0)),
                (Some(g), Ok(m)) if g.pending == Some(false) => {
                    g.len = m.len;
                    g.pending = None;
                    Ok(true)
                }
                // Mapping failed, or the agent acknowledged a recall of the grant before it
                // had it (it does not use such a grant): it ends here.
                (Some(_), _) => {
                    table.remove(&id);
                    Ok(false)
                }
            }
        };
        match filed {
            Ok(true) => {
                let m = mapped?;
                add(&self.stats.read_grants, 1);
                add(&self.stats.granted_read_bytes, m.len);
                crate::activity::add_grant(false, m.len);
                Ok((id, m))
            }
            Ok(false) => {
                self.release_lock(ino.0, id);
                mapped.map(|m| (id, m))
            }
            Err(e) => {
                self.release_lock(ino.0, id);
                mapped?;
                Err(e)
            }
        }
    }

    /// Files a write grant whose lock `id` is held, once its range is mapped; on an error
    /// the lock goes and nothing is filed. (Read grants are filed before their lock is taken,
    /// see `map_read`.)
    fn register(
        &self,
        id: u64,
        mut state: GrantState,
        mapped: Result<Mapped, FsError>,
    ) -> Result<(u64, Mapped), FsError> {
        let mapped = match mapped {
            Ok(m) => m,
            Err(e) => {
                self.release_lock(state.ino, id);
                return Err(e);
            }
        };
        state.len = mapped.len;
        let (count, bytes) = match state.mode {
            LockMode::Shared => (&self.stats.read_grants, &self.stats.granted_read_bytes),
            LockMode::Exclusive => (&self.stats.write_grants, &self.stats.granted_write_bytes),
        };
        add(count, 1);
        add(bytes, mapped.len);
        crate::activity::add_grant(state.mode == LockMode::Exclusive, mapped.len);
        self.lock_table().insert(id, state);
        Ok((id, mapped))
    }

    /// Files a write layout once mapped (it is in the table since before its lock): ready
    /// from now on, unless its session ended meanwhile (an error) or the agent already gave
    /// it back (then it ends here, and the reply is harmless: the agent does not use a grant
    /// whose recall it acknowledged).
    async fn register_layout(
        &self,
        id: u64,
        state: GrantState,
        mapped: Result<Mapped, FsError>,
    ) -> Result<(u64, Mapped), FsError> {
        let ino = state.ino;
        let returned = {
            let mut table = self.lock_table();
            match (table.get_mut(&id), &mapped) {
                (None, _) => None,
                (Some(g), Ok(m)) if g.pending == Some(false) => {
                    g.len = m.len;
                    g.pending = None;
                    Some(false)
                }
                (Some(_), _) => table.remove(&id).map(|_| true),
            }
        };
        match returned {
            None => {
                self.release_lock(ino, id);
                mapped?;
                Err(self.vanished(state.session))
            }
            Some(false) => {
                let m = mapped?;
                add(&self.stats.write_grants, 1);
                add(&self.stats.granted_write_bytes, m.len);
                crate::activity::add_grant(true, m.len);
                Ok((id, m))
            }
            Some(true) => {
                let len = mapped.as_ref().map_or(0, |m| m.len);
                self.end_grant(id, &GrantState { len, ..state }).await;
                self.release_lock(ino, id);
                mapped.map(|m| (id, m))
            }
        }
    }

    fn take_grant(
        &self,
        session: u64,
        epoch: u64,
        id: u64,
        done: Option<u64>,
    ) -> Result<GrantState, GrantError> {
        let mut table = self.lock_table();
        let g = table.get(&id).ok_or(GrantError::Unknown(id))?;
        g.owned_by(id, session, epoch)?;
        if self.is_fenced(session) {
            return Err(GrantError::Fenced { grant: id, session });
        }
        if g.delegation {
            return Err(GrantError::Fs(FsError::Invalid(format!(
                "{id} is a delegation: return it, it is not completed"
            ))));
        }
        if let Some(done) = done
            && done > g.len
        {
            return Err(GrantError::TooMuchDone {
                grant: id,
                done,
                len: g.len,
            });
        }
        table.remove(&id).ok_or(GrantError::Unknown(id))
    }

    /// Control info 3 -> 4. For a write, converts `[offset, offset + bytes_done)` to Written
    /// (nothing with `bytes_done == 0`), and with `sync` flushes the devices the grant wrote
    /// and makes the metadata durable before answering. Releases the lock in every case once
    /// the grant is taken.
    pub async fn complete(
        &self,
        session: u64,
        epoch: u64,
        id: u64,
        bytes_done: u64,
        sync: bool,
    ) -> Result<Attr, GrantError> {
        Ok(self
            .complete_numbered(session, epoch, id, bytes_done, sync)
            .await?
            .0)
    }

    /// [`Grants::complete`], answering also the number of the lazy commit that holds the
    /// conversion (0: durable already), for the agent's record of it.
    pub async fn complete_numbered(
        &self,
        session: u64,
        epoch: u64,
        id: u64,
        bytes_done: u64,
        sync: bool,
    ) -> Result<(Attr, u64), GrantError> {
        let g = self.take_grant(session, epoch, id, Some(bytes_done))?;
        let store = self.dp.store.clone();
        let result = async {
            if g.mode == LockMode::Shared {
                return Ok((
                    store.read(|t| {
                        let ino = InodeId(g.ino);
                        Ok(t.inode(ino)?.attr(ino, store.block_size()))
                    })?,
                    0,
                ));
            }
            let (ino, off, root) = (g.ino, g.offset, g.writer_is_root);
            // The conversion may be lazy (docs/protocol.md): durable now only when asked,
            // otherwise with the next durable commit or fsync, after the data LUNs are
            // flushed (`Store::write_data`). A crash before that leaves the blocks Unwritten:
            // they read as zeros, never as stale data.
            let job = move |ctx: &mut crate::store::Ctx<'_>| {
                data::complete_write(ctx, InodeId(ino), off, bytes_done, root)
            };
            let (attr, mut seq) = if bytes_done == 0 {
                (store.write(job).await?, 0)
            } else {
                // The LUNs the agent wrote are not named: all are flushed.
                store.write_data(sync, Luns::All, job).await?
            };
            if bytes_done < g.len {
                // A short write: what the device never wrote past end of file goes back.
                let bs = u64::from(store.block_size());
                let (first, last) = ((off + bytes_done) / bs, (off + g.len) / bs);
                store
                    .write(move |ctx| {
                        crate::space::trim_unwritten_past_eof(ctx, InodeId(ino), first, last)
                    })
                    .await?;
                seq = 0; // that durable commit made the conversion durable too
            }
            Ok::<(Attr, u64), FsError>((attr, seq))
        }
        .await;
        self.release_lock(g.ino, id);
        result.map_err(GrantError::Fs)
    }

    /// A write layout's partial completion (control info 3 -> 4 for one write inside it):
    /// converts `[at, at + bytes_done)` to Written and extends the size as [`Grants::complete`]
    /// does, but the grant and its lock stay. The range must lie inside the grant, which must
    /// be a write layout of the caller's session and epoch.
    #[allow(
        clippy::too_many_arguments,
        reason = "the grant's identity and the completed part"
    )]
    pub async fn complete_part(
        &self,
        session: u64,
        epoch: u64,
        id: u64,
        at: u64,
        bytes_done: u64,
        sync: bool,
    ) -> Result<Attr, GrantError> {
        Ok(self
            .complete_parts_numbered(session, epoch, id, &[(at, bytes_done)], sync)
            .await?
            .0)
    }

    /// [`Grants::complete_part`] of several parts `(offset, length)` of one write layout in
    /// one transaction, answering also the number of the lazy commit that holds the
    /// conversion (0: durable already). Every part must lie inside the grant (checked before
    /// anything changes); the attributes answered are the file's after the last part.
    pub async fn complete_parts_numbered(
        &self,
        session: u64,
        epoch: u64,
        id: u64,
        parts: &[(u64, u64)],
        sync: bool,
    ) -> Result<(Attr, u64), GrantError> {
        let g = {
            let table = self.lock_table();
            let g = table.get(&id).ok_or(GrantError::Unknown(id))?;
            g.owned_by(id, session, epoch)?;
            if self.is_fenced(session) {
                return Err(GrantError::Fenced { grant: id, session });
            }
            if g.mode != LockMode::Exclusive || !g.cacheable || g.delegation {
                return Err(GrantError::Fs(FsError::Invalid(format!(
                    "grant {id} is not a write layout: complete it without keep"
                ))));
            }
            for &(at, len) in parts {
                let inside =
                    at >= g.offset && at.checked_add(len).is_some_and(|e| e <= g.offset + g.len);
                if !inside {
                    return Err(GrantError::Fs(FsError::Invalid(format!(
                        "{at}+{len} is not inside write layout {id} ({}+{})",
                        g.offset, g.len
                    ))));
                }
            }
            g.clone()
        };
        let store = self.dp.store.clone();
        let written = parts.iter().any(|&(_, len)| len > 0);
        let (ino, root) = (g.ino, g.writer_is_root);
        let parts = parts.to_vec();
        let job = move |ctx: &mut crate::store::Ctx<'_>| {
            let mut attr = None;
            for &(at, len) in &parts {
                attr = Some(data::complete_write(ctx, InodeId(ino), at, len, root)?);
            }
            match attr {
                Some(a) => Ok(a),
                None => Ok(ctx
                    .t
                    .inode(InodeId(ino))?
                    .attr(InodeId(ino), ctx.block_size)),
            }
        };
        let done = if written {
            store.write_data(sync, Luns::All, job).await?
        } else {
            (store.write(job).await?, 0)
        };
        Ok(done)
    }

    /// Gives back cached grants, read grants and write layouts (or abandons any grant without
    /// completing it). A write layout's blocks that were never completed and lie past the end
    /// of file are freed.
    pub async fn return_grants(
        &self,
        session: u64,
        epoch: u64,
        ids: &[u64],
    ) -> Result<(), GrantError> {
        // Check all first: a bad id changes nothing.
        {
            let table = self.lock_table();
            for id in ids {
                let g = table.get(id).ok_or(GrantError::Unknown(*id))?;
                g.owned_by(*id, session, epoch)?;
            }
        }
        let gone: Vec<(u64, GrantState)> = {
            let mut table = self.lock_table();
            let mut gone = Vec::new();
            for id in ids {
                match table.get_mut(id) {
                    // Not mapped yet: `map_write` ends it once it is.
                    Some(g) if g.pending.is_some() => g.pending = Some(true),
                    Some(_) => gone.extend(table.remove(id).map(|g| (*id, g))),
                    None => {}
                }
            }
            gone
        };
        for (id, g) in gone {
            self.end_grant(id, &g).await;
            self.release_lock(g.ino, id);
        }
        Ok(())
    }

    /// What ending a grant without completing it leaves behind: for a write grant, its
    /// Unwritten blocks past the end of file are freed (inside the file they read as zeros).
    async fn end_grant(&self, id: u64, g: &GrantState) {
        if g.mode != LockMode::Exclusive || g.delegation {
            return;
        }
        let bs = u64::from(self.dp.store.block_size());
        let (ino, first, last) = (g.ino, g.offset / bs, (g.offset + g.len) / bs);
        if let Err(e) = self
            .dp
            .store
            .write(move |ctx| crate::space::trim_unwritten_past_eof(ctx, InodeId(ino), first, last))
            .await
        {
            tracing::warn!(session = g.session, grant = id, error = %e, "trimming an ended write grant");
        }
    }

    /// A session ended or its lease ran out: its grants are dropped and their locks
    /// released; blocks of its uncompleted write grants stay Unwritten (they read as zeros),
    /// and those past end of file are freed.
    pub async fn expire_session(&self, session: u64) {
        self.detach(session);
        self.drop_where(|g| g.session == session, true).await;
        self.fenced().remove(&session);
    }

    /// The session closed its last handle on `ino`: its grants there go (grants live under
    /// open handles, so an inode whose blocks are freed has no cached layout anywhere).
    pub async fn drop_for_inode(&self, session: u64, ino: u64) {
        let gone = {
            let mut table = self.lock_table();
            let ids: Vec<u64> = table
                .on_inode(ino)
                .filter(|(_, g)| g.session == session)
                .map(|(id, _)| id)
                .collect();
            table.take(ids)
        };
        self.dropped(gone, false).await;
    }

    /// Drops the grants `pred` picks: logged at `info` when their session `ended`, at `debug`
    /// for a file's last close (one line per small file would flood the log).
    async fn drop_where(&self, pred: impl Fn(&GrantState) -> bool, ended: bool) {
        let gone = {
            let mut table = self.lock_table();
            let ids: Vec<u64> = table
                .iter()
                .filter(|(_, g)| pred(g))
                .map(|(id, _)| *id)
                .collect();
            table.take(ids)
        };
        self.dropped(gone, ended).await;
    }

    /// Ends the grants [`Grants::drop_where`] or [`Grants::drop_for_inode`] took out of the
    /// table.
    async fn dropped(&self, gone: Vec<(u64, GrantState)>, ended: bool) {
        for (id, g) in gone {
            add(&self.stats.expired_grants, 1);
            self.end_grant(id, &g).await;
            self.release_lock(g.ino, id);
            if ended {
                tracing::info!(
                    session = g.session,
                    grant = id,
                    ino = g.ino,
                    "grant dropped: its session ended"
                );
            } else {
                tracing::debug!(
                    session = g.session,
                    grant = id,
                    ino = g.ino,
                    "grant dropped: the file's last handle closed"
                );
            }
        }
    }

    /// Before attributes are read (`GetAttr`): the write grants on `ino` at this moment end
    /// first (out of the table, their completion's store job done and their lock released),
    /// write layouts recalled. An agent answers a layout's recall only once the
    /// completions of its writes there are in (it completes writes behind them), so the
    /// size and mtime read next include every write that returned on any node. Bounded by
    /// the lock timeout (then the attributes are read as they are).
    pub async fn settle_attr(&self, ino: u64, caller: u64) {
        self.settle(ino, caller, Settle::Attr).await;
    }

    /// Before a change of the mode, owners or times of `ino` by session `caller`: the other
    /// sessions' write grants, layouts and delegations end first, as for
    /// [`Grants::settle_attr`], so that no write that returned before the change (held back,
    /// or completed behind it) sets the mtime after it. The caller's own are left alone
    /// (its agent settles its own writes before it sends the change).
    pub async fn settle_others(&self, ino: u64, caller: u64) {
        self.settle(ino, caller, Settle::Others).await;
    }

    /// Before attributes are answered by a Lookup or a ReadDir with attributes (whose caller
    /// the server does not know): the write delegations on `ino` are recalled first, as for
    /// [`Grants::settle_attr`], so that the size includes what their holders held back.
    /// Write layouts are left alone (their writes are completed behind them within moments).
    pub async fn settle_delegations(&self, ino: u64) {
        self.settle(ino, 0, Settle::Delegations).await;
    }

    async fn settle(&self, ino: u64, caller: u64, which: Settle) {
        let ids: Vec<u64> = self
            .lock_table()
            .on_inode(ino)
            .filter(|(_, g)| g.mode == LockMode::Exclusive)
            .filter(|(_, g)| g.delegation || which != Settle::Delegations)
            // The caller's own write delegation: its agent answers for its cached data.
            .filter(|(_, g)| !(g.delegation && g.session == caller))
            .filter(|(_, g)| !(which == Settle::Others && g.session == caller))
            .map(|(id, _)| id)
            .collect();
        if ids.is_empty() {
            return;
        }
        self.recall(ids.clone());
        // Waited on: bounded by the hold limit as a queued lock request is.
        let _waiting = AttrWait::new(self, &ids);
        let deadline = tokio::time::Instant::now() + self.dp.lock_timeout;
        loop {
            // Registered before the check, so that a grant ending between the check and the
            // wait still wakes this one.
            let ended = self.grant_ended.notified();
            tokio::pin!(ended);
            ended.as_mut().enable();
            // Ended: out of the table and its lock released, which a completion does after its
            // store job, so the attributes read next include it.
            let held: Vec<u64> = self.dp.locks.held(ino).iter().map(|h| h.0).collect();
            if !ids
                .iter()
                .any(|id| held.contains(id) || self.lock_table().contains_key(id))
            {
                return;
            }
            if tokio::time::timeout_at(deadline, ended).await.is_err() {
                break;
            }
        }
        tracing::warn!(
            ino,
            "write grants outlived an attribute call's wait for them"
        );
    }

    /// Whether a session other than `session` holds a write grant, write layout or write
    /// delegation on `ino` (its writes change the size until completed or written back).
    pub fn writer_other_than(&self, ino: u64, session: u64) -> bool {
        self.lock_table()
            .on_inode(ino)
            .any(|(_, g)| g.mode == LockMode::Exclusive && g.session != session)
    }

    /// Whether any write delegation is held (a quick test before [`Grants::settle_delegations`]
    /// over many inodes).
    pub fn any_write_delegation(&self) -> bool {
        self.lock_table()
            .values()
            .any(|g| g.delegation && g.mode == LockMode::Exclusive)
    }

    /// Offers `session` a **delegation** on `ino`: whole-file caching rights, shared (read:
    /// the agent may keep the file's data in its cache) or exclusive (write: it may also hold
    /// writes back and answer for the size). Held as a lock on the whole file that conflicts
    /// with every other session's grants, proxied I/O and size changes (which recall it, as
    /// they recall cached grants) but never with the holder's own. Refused (`None`) when
    /// anything of another session holds or waits for a conflicting lock there: a delegation
    /// is for a file nobody else is using. Lives like a cached grant: returned, recalled,
    /// dropped with the session or its last handle on the file.
    pub fn delegate(&self, session: u64, epoch: u64, ino: u64, write: bool) -> Option<u64> {
        let id = self.dp.next_id();
        let mode = if write {
            LockMode::Exclusive
        } else {
            LockMode::Shared
        };
        // Filed before the lock is taken, so that a request blocked by it finds it to recall.
        self.lock_table().insert(
            id,
            GrantState {
                session,
                epoch,
                ino,
                offset: 0,
                len: sanfs_proto::types::MAX_FILE_SIZE,
                mode,
                cacheable: true,
                writer_is_root: false,
                delegation: true,
                pending: None,
            },
        );
        if self.dp.locks.try_delegate(ino, id, mode, session) {
            add(&self.stats.delegations, 1);
            return Some(id);
        }
        self.lock_table().remove(&id);
        None
    }

    /// Takes an exclusive lock for a change that alters what grants describe (truncate,
    /// fallocate) on behalf of `session` (0: the server's own), recalling cached grants and
    /// other sessions' delegations in the way. Released when dropped.
    pub async fn exclusive(
        &self,
        ino: u64,
        span: Span,
        session: u64,
    ) -> Result<crate::proxy::Held, FsError> {
        let id = self.dp.next_id();
        self.take_lock(id, ino, span, LockMode::Exclusive, session)
            .await?;
        Ok(crate::proxy::Held::new(self.dp.locks.clone(), ino, id))
    }
}

/// The locked grant table. Dropped after grants left it (the table is smaller than when it was
/// locked; no caller both removes and inserts under one lock), it wakes those waiting for
/// grants to end ([`Grants::settle_attr`]).
struct TableGuard<'a> {
    table: MutexGuard<'a, GrantTable>,
    live_before: usize,
    ended: &'a tokio::sync::Notify,
}

impl std::ops::Deref for TableGuard<'_> {
    type Target = GrantTable;

    fn deref(&self) -> &Self::Target {
        &self.table
    }
}

impl std::ops::DerefMut for TableGuard<'_> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.table
    }
}

impl Drop for TableGuard<'_> {
    fn drop(&mut self) {
        if self.table.len() < self.live_before {
            self.ended.notify_waiters();
        }
    }
}

/// The live grants by id, and the ids on each inode: the questions asked per call (the
/// grants on one file, whether another session writes it) are answered from the grants on
/// that file, never by a walk over all of them (one write delegation per file being
/// written, thousands at once under a `tar x` on several nodes).
#[derive(Default)]
struct GrantTable {
    by_id: HashMap<u64, GrantState>,
    by_ino: HashMap<u64, Vec<u64>>,
}

impl GrantTable {
    fn len(&self) -> usize {
        self.by_id.len()
    }

    fn get(&self, id: &u64) -> Option<&GrantState> {
        self.by_id.get(id)
    }

    /// A grant to change (never its inode: the index is by it).
    fn get_mut(&mut self, id: &u64) -> Option<&mut GrantState> {
        self.by_id.get_mut(id)
    }

    fn contains_key(&self, id: &u64) -> bool {
        self.by_id.contains_key(id)
    }

    fn insert(&mut self, id: u64, g: GrantState) {
        let ino = g.ino;
        if let Some(old) = self.by_id.insert(id, g) {
            self.unindex(id, old.ino);
        }
        self.by_ino.entry(ino).or_default().push(id);
    }

    fn remove(&mut self, id: &u64) -> Option<GrantState> {
        let g = self.by_id.remove(id)?;
        self.unindex(*id, g.ino);
        Some(g)
    }

    /// Takes the grants `ids` out (those still in).
    fn take(&mut self, ids: Vec<u64>) -> Vec<(u64, GrantState)> {
        ids.into_iter()
            .filter_map(|id| self.remove(&id).map(|g| (id, g)))
            .collect()
    }

    fn unindex(&mut self, id: u64, ino: u64) {
        if let Some(ids) = self.by_ino.get_mut(&ino) {
            ids.retain(|i| *i != id);
            if ids.is_empty() {
                self.by_ino.remove(&ino);
            }
        }
    }

    fn iter(&self) -> impl Iterator<Item = (&u64, &GrantState)> {
        self.by_id.iter()
    }

    fn values(&self) -> impl Iterator<Item = &GrantState> {
        self.by_id.values()
    }

    /// The grants on `ino`.
    fn on_inode(&self, ino: u64) -> impl Iterator<Item = (u64, &GrantState)> {
        self.by_ino
            .get(&ino)
            .into_iter()
            .flatten()
            .filter_map(|id| self.by_id.get(id).map(|g| (*id, g)))
    }
}

/// A `GetAttr` waiting for write grants to end, noted in [`Grants::attr_waits`] while it
/// lives (so that the hold limit applies to them).
struct AttrWait<'a> {
    grants: &'a Grants,
    ids: Vec<u64>,
}

impl<'a> AttrWait<'a> {
    fn new(grants: &'a Grants, ids: &[u64]) -> AttrWait<'a> {
        let mut w = grants.attr_waits();
        for id in ids {
            *w.entry(*id).or_insert(0) += 1;
        }
        AttrWait {
            grants,
            ids: ids.to_vec(),
        }
    }
}

impl Drop for AttrWait<'_> {
    fn drop(&mut self) {
        let mut w = self.grants.attr_waits();
        for id in &self.ids {
            if let Some(n) = w.get_mut(id) {
                *n -= 1;
                if *n == 0 {
                    w.remove(id);
                }
            }
        }
    }
}

#[cfg(test)]
mod table_tests {
    use super::*;

    fn grant(session: u64, ino: u64, mode: LockMode) -> GrantState {
        GrantState {
            session,
            epoch: 1,
            ino,
            offset: 0,
            len: 4096,
            mode,
            cacheable: true,
            writer_is_root: false,
            delegation: false,
            pending: None,
        }
    }

    #[test]
    fn the_grants_of_an_inode_are_found_by_it_and_leave_with_their_grant() {
        let mut t = GrantTable::default();
        t.insert(1, grant(10, 5, LockMode::Exclusive));
        t.insert(2, grant(11, 5, LockMode::Shared));
        t.insert(3, grant(10, 6, LockMode::Shared));
        let on5: Vec<u64> = t.on_inode(5).map(|(id, _)| id).collect();
        assert_eq!(on5, vec![1, 2]);
        // The same id again, on another inode: indexed there only.
        t.insert(2, grant(11, 6, LockMode::Shared));
        assert_eq!(t.on_inode(5).map(|(id, _)| id).collect::<Vec<_>>(), vec![1]);
        assert_eq!(t.on_inode(6).count(), 2);
        assert_eq!(t.remove(&1).map(|g| g.ino), Some(5));
        assert_eq!(t.remove(&1).map(|g| g.ino), None);
        assert_eq!(t.on_inode(5).count(), 0);
        assert!(
            !t.by_ino.contains_key(&5),
            "an inode without grants leaves the index"
        );
        assert_eq!(t.len(), 2);
        assert!(t.contains_key(&2) && t.get(&3).is_some_and(|g| g.session == 10));
    }
}
