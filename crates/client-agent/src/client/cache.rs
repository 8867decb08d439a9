//! Cached grants (layouts): the read grants and write layouts this agent keeps under its
//! session lease.
//!
//! A cacheable grant is entered here as soon as it arrives, *before* its I/O, with one
//! user in flight: a `Recall` for it may then arrive at any time (the server may need the range
//! for a writer), and it must wait for that I/O. A later read inside a cached read grant's
//! range (or a write inside a cached write layout, [`LockMode::Exclusive`]) takes it ([`GrantCache::take`]: one more user in flight) and gives it back with
//! [`GrantCache::release`]. A recalled grant is never handed out again; once its last user is
//! done it leaves the table, and whoever waits for it ([`GrantCache::wait_idle`]) may then
//! acknowledge the recall or return the grant.
//!
//! Recalls of grants this table does not know (the recall overtook the Map reply, or the grant
//! was evicted) are remembered for a while as tombstones, so that a grant whose recall came
//! first is never used.
//!
//! The table is bounded: inserting past `max_grants` evicts the least recently used idle
//! grants, which the caller returns to the server.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

use sanfs_proto::model::{Grant, LockMode};
use sanfs_proto::types::{ByteRange, GrantId, InodeId};
use tokio::sync::Notify;

/// How many recalled-but-unknown grant ids are remembered.
const MAX_TOMBSTONES: usize = 4096;

struct Entry {
    grant: Arc<Grant>,
    /// The session generation the grant belongs to.
    generation: u64,
    in_flight: usize,
    recalled: bool,
    /// Whether the grant is kept after its first I/O (false: completed by its first user).
    cached: bool,
    last_use: u64,
}

impl Entry {
    /// Whether it may be handed out for an I/O of `mode` on `inode` under `generation`:
    /// kept after its first I/O and not recalled.
    fn lendable(&self, inode: InodeId, generation: u64, mode: LockMode) -> bool {
        self.cached
            && !self.recalled
            && self.generation == generation
            && self.grant.mode == mode
            && self.grant.inode == inode
    }

    /// Hands it out: one more user in flight, last used at `tick`.
    fn lend(&mut self, tick: u64) -> Arc<Grant> {
        self.in_flight += 1;
        self.last_use = tick;
        Arc::clone(&self.grant)
    }
}

#[derive(Default)]
struct Table {
    entries: HashMap<GrantId, Entry>,
    tombstones: HashSet<GrantId>,
    tombstone_order: VecDeque<GrantId>,
    tick: u64,
}

/// The agent's cached read grants.
pub(crate) struct GrantCache {
    table: Mutex<Table>,
    idle: Notify,
    /// Someone waits for grants to be idle (or for a file's completions): the senders of
    /// batched write completions stop lingering ([`GrantCache::hurried`]).
    hurry: Notify,
    max_grants: usize,
}

/// What a grant's first user does with it once its I/O is done.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum AfterIo {
    /// Keep it cached; nothing to send.
    Keep,
    /// It was recalled meanwhile: the recall's acknowledgement covers it; nothing to send.
    Recalled,
    /// Not kept (the caller did not ask to): it left the table; return it to the server.
    Return,
}

impl GrantCache {
    pub(crate) fn new(max_grants: usize) -> GrantCache {
        GrantCache {
            table: Mutex::new(Table::default()),
            idle: Notify::new(),
            hurry: Notify::new(),
            max_grants: max_grants.max(1),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Table> {
        // A panic while holding the lock leaves plain bookkeeping; keep going with it.
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Enters a freshly received cacheable grant, with its first user in flight. Returns
    /// false if its recall already arrived (the grant must not be used).
    pub(crate) fn enter(&self, grant: Arc<Grant>, generation: u64) -> bool {
        let mut t = self.lock();
        if t.tombstones.remove(&grant.grant_id) {
            return false;
        }
        t.tick += 1;
        let last_use = t.tick;
        // A write layout serves the writer's next writes at once (their device I/O may
        // overlap this one's completion); a read grant only once its first read is done.
        let cached = grant.mode == LockMode::Exclusive;
        t.entries.insert(
            grant.grant_id,
            Entry {
                grant,
                generation,
                in_flight: 1,
                recalled: false,
                cached,
                last_use,
            },
        );
        true
    }

    /// A cached, unrecalled grant of `mode` and `generation` on `inode` that covers `range`
    /// (a read grant: whose file size covers it too), with one more user in flight.
    pub(crate) fn take(
        &self,
        inode: InodeId,
        range: ByteRange,
        generation: u64,
        mode: LockMode,
    ) -> Option<Arc<Grant>> {
        let mut t = self.lock();
        t.tick += 1;
        let tick = t.tick;
        let e = t.entries.values_mut().find(|e| {
            e.lendable(inode, generation, mode)
                && e.grant.range.offset() <= range.offset()
                && range.end() <= e.grant.range.end()
                && (mode == LockMode::Exclusive || range.end() <= e.grant.file_size)
        })?;
        Some(e.lend(tick))
    }

    /// For a block-aligned read of `range`: the cached, unrecalled read grant of
    /// `generation` on `inode` that holds the read's first block and reaches furthest into
    /// it, and the part of `range` it serves (from `range`'s start, whole blocks of `block`
    /// bytes that lie wholly inside the file size the grant knows). A sequential reader's
    /// read that a grant covers only in part reads that part under it and asks for the rest
    /// (the end of file among it: the server knows the size now) instead of asking for all
    /// of it again.
    pub(crate) fn take_read_start(
        &self,
        inode: InodeId,
        range: ByteRange,
        generation: u64,
        block: u64,
    ) -> Option<(Arc<Grant>, ByteRange)> {
        let mut t = self.lock();
        t.tick += 1;
        let tick = t.tick;
        let pos = range.offset();
        let block = block.max(1);
        let usable_end = |g: &Grant| {
            g.range
                .end()
                .min(g.file_size / block * block)
                .min(range.end())
        };
        let e = t
            .entries
            .values_mut()
            .filter(|e| {
                e.lendable(inode, generation, LockMode::Shared)
                    && e.grant.range.offset() <= pos
                    && pos < usable_end(&e.grant)
            })
            .max_by_key(|e| usable_end(&e.grant))?;
        let part = ByteRange::new(pos, usable_end(&e.grant) - pos).ok()?;
        Some((e.lend(tick), part))
    }

    /// Whether any grant of this agent on `inode` (cached or in use, of `mode` only, if
    /// given) overlaps `range`.
    pub(crate) fn overlaps(
        &self,
        inode: InodeId,
        range: ByteRange,
        mode: Option<LockMode>,
    ) -> bool {
        self.lock().entries.values().any(|e| {
            e.grant.inode == inode
                && mode.is_none_or(|m| e.grant.mode == m)
                && e.grant.range.offset() < range.end()
                && range.offset() < e.grant.range.end()
        })
    }

    /// Whether a cached, unrecalled write layout of `generation` on `inode` covers `range`
    /// (a write there would find it with [`GrantCache::take`]).
    pub(crate) fn covers_write(&self, inode: InodeId, range: ByteRange, generation: u64) -> bool {
        self.lock().entries.values().any(|e| {
            e.cached
                && !e.recalled
                && e.generation == generation
                && e.grant.mode == LockMode::Exclusive
                && e.grant.inode == inode
                && e.grant.range.offset() <= range.offset()
                && range.end() <= e.grant.range.end()
        })
    }

    /// The end of one user's I/O on a grant. With `keep`, the grant's first user asks to keep
    /// it cached. Returns what became of it, and the grants evicted to make room (to return).
    pub(crate) fn release(&self, id: GrantId, keep: bool) -> (AfterIo, Vec<GrantId>) {
        let mut t = self.lock();
        let mut evicted = Vec::new();
        let outcome = match t.entries.get_mut(&id) {
            None => AfterIo::Recalled,
            Some(e) => {
                e.in_flight = e.in_flight.saturating_sub(1);
                if keep {
                    e.cached = true;
                }
                if e.recalled {
                    if e.in_flight == 0 {
                        t.entries.remove(&id);
                    }
                    AfterIo::Recalled
                } else if !e.cached {
                    if e.in_flight == 0 {
                        t.entries.remove(&id);
                    }
                    AfterIo::Return
                } else {
                    AfterIo::Keep
                }
            }
        };
        if outcome == AfterIo::Keep && keep {
            // Idle cached grants that the newly kept one covers are of no more use.
            let (inode, range, generation, mode) = match t.entries.get(&id) {
                Some(e) => (e.grant.inode, e.grant.range, e.generation, e.grant.mode),
                None => return (outcome, evicted),
            };
            let covered: Vec<GrantId> = t
                .entries
                .iter()
                .filter(|(g, e)| {
                    **g != id
                        && e.cached
                        && !e.recalled
                        && e.in_flight == 0
                        && e.generation == generation
                        && e.grant.mode == mode
                        && e.grant.inode == inode
                        && range.offset() <= e.grant.range.offset()
                        && e.grant.range.end() <= range.end()
                })
                .map(|(g, _)| *g)
                .collect();
            for g in covered {
                t.entries.remove(&g);
                evicted.push(g);
            }
        }
        if outcome == AfterIo::Keep {
            while t.entries.len() > self.max_grants {
                let victim = t
                    .entries
                    .iter()
                    .filter(|(g, e)| e.in_flight == 0 && !e.recalled && **g != id)
                    .min_by_key(|(_, e)| e.last_use)
                    .map(|(g, _)| *g);
                match victim {
                    Some(g) => {
                        t.entries.remove(&g);
                        evicted.push(g);
                    }
                    None => break,
                }
            }
        }
        drop(t);
        self.idle.notify_waiters();
        (outcome, evicted)
    }

    /// Marks `ids` recalled (unknown ones become tombstones); none of them is handed out again.
    pub(crate) fn recall(&self, ids: &[GrantId]) {
        let mut t = self.lock();
        for id in ids {
            match t.entries.get_mut(id) {
                Some(e) => {
                    e.recalled = true;
                    if e.in_flight == 0 {
                        t.entries.remove(id);
                    }
                }
                None => {
                    if t.tombstones.insert(*id) {
                        t.tombstone_order.push_back(*id);
                    }
                    while t.tombstone_order.len() > MAX_TOMBSTONES {
                        if let Some(old) = t.tombstone_order.pop_front() {
                            t.tombstones.remove(&old);
                        }
                    }
                }
            }
        }
        drop(t);
        self.idle.notify_waiters();
    }

    /// Marks every cached grant of `inode` that overlaps `range` (of `mode` only, if given)
    /// recalled and returns their ids: this agent's own layouts that would block what it
    /// asks for next (a writer's read grants, a reader's write layouts, everything before a
    /// truncate), to be given back first.
    pub(crate) fn take_overlapping(
        &self,
        inode: InodeId,
        range: ByteRange,
        mode: Option<LockMode>,
    ) -> Vec<GrantId> {
        let mut t = self.lock();
        let ids: Vec<GrantId> = t
            .entries
            .iter()
            .filter(|(_, e)| {
                e.grant.inode == inode
                    && e.grant.range.overlaps(&range)
                    && mode.is_none_or(|m| e.grant.mode == m)
            })
            .map(|(g, _)| *g)
            .collect();
        for id in &ids {
            if let Some(e) = t.entries.get_mut(id) {
                e.recalled = true;
                if e.in_flight == 0 {
                    t.entries.remove(id);
                }
            }
        }
        ids
    }

    /// Tells the senders of batched write completions that someone waits for them.
    pub(crate) fn hurry(&self) {
        self.hurry.notify_waiters();
    }

    /// Resolves at the next [`GrantCache::hurry`] (or [`GrantCache::wait_idle`]).
    pub(crate) fn hurried(&self) -> tokio::sync::futures::Notified<'_> {
        self.hurry.notified()
    }

    /// Waits until none of `ids` has I/O in flight (they have left the table).
    pub(crate) async fn wait_idle(&self, ids: &[GrantId]) {
        self.hurry();
        loop {
            let notified = self.idle.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let t = self.lock();
                if ids.iter().all(|id| !t.entries.contains_key(id)) {
                    return;
                }
            }
            notified.await;
        }
    }

    /// Drops every grant (the session is lost): nothing is handed out again; returns how many
    /// still have I/O in flight.
    pub(crate) fn clear(&self) -> Vec<GrantId> {
        let mut t = self.lock();
        t.entries.retain(|_, e| {
            e.recalled = true;
            e.in_flight > 0
        });
        t.tombstones.clear();
        t.tombstone_order.clear();
        t.entries.keys().copied().collect()
    }

    /// Ids of the grants currently kept (cached and not recalled).
    pub(crate) fn cached_ids(&self) -> Vec<GrantId> {
        let t = self.lock();
        t.entries
            .iter()
            .filter(|(_, e)| e.cached && !e.recalled)
            .map(|(g, _)| *g)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sanfs_proto::types::SessionEpoch;
    use std::time::Duration;

    fn grant(id: u64, offset: u64, len: u64) -> Arc<Grant> {
        Arc::new(Grant {
            grant_id: GrantId(id),
            epoch: SessionEpoch(1),
            inode: InodeId(2),
            range: ByteRange::new(offset, len).unwrap(),
            mode: LockMode::Shared,
            device_ios: Vec::new(),
            zero_fill: Vec::new(),
            file_size: 1 << 30,
            cacheable: true,
        })
    }

    const S: LockMode = LockMode::Shared;

    fn r(offset: u64, len: u64) -> ByteRange {
        ByteRange::new(offset, len).unwrap()
    }

    #[test]
    fn a_read_a_kept_grant_covers_in_part_takes_that_part_from_its_start() {
        let c = GrantCache::new(8);
        assert!(c.enter(grant(1, 0, 8 << 20), 1));
        assert_eq!(c.release(GrantId(1), true).0, AfterIo::Keep);
        let mut short = grant(2, 4 << 20, 8 << 20);
        Arc::get_mut(&mut short).unwrap().file_size = 10 << 20;
        assert!(c.enter(short, 1));
        assert_eq!(c.release(GrantId(2), true).0, AfterIo::Keep);
        // [6, 14) MiB: the second grant reaches further, but only to the file size it knows.
        let (g, part) = c
            .take_read_start(InodeId(2), r(6 << 20, 8 << 20), 1, 4096)
            .unwrap();
        assert_eq!((g.grant_id, part), (GrantId(2), r(6 << 20, 4 << 20)));
        assert_eq!(c.release(GrantId(2), true).0, AfterIo::Keep);
        // A file size inside a block: the blocks before it only (found by fsx: the part up
        // to an unaligned size left the rest of the read at an unaligned offset, EINVAL).
        let mut odd = grant(4, 32 << 20, 1 << 20);
        Arc::get_mut(&mut odd).unwrap().file_size = (32 << 20) + 3 * 4096 + 100;
        assert!(c.enter(odd, 1));
        assert_eq!(c.release(GrantId(4), true).0, AfterIo::Keep);
        let (_, part) = c
            .take_read_start(InodeId(2), r(32 << 20, 128 << 10), 1, 4096)
            .unwrap();
        assert_eq!(part, r(32 << 20, 3 * 4096));
        assert_eq!(c.release(GrantId(4), true).0, AfterIo::Keep);
        assert!(
            c.take_read_start(InodeId(2), r((32 << 20) + 3 * 4096, 4096), 1, 4096)
                .is_none(),
            "the block the end of file lies in: asked for"
        );
        // Inside the first one: all of it.
        let (g, part) = c
            .take_read_start(InodeId(2), r(4096, 8192), 1, 4096)
            .unwrap();
        assert_eq!((g.grant_id, part), (GrantId(1), r(4096, 8192)));
        assert_eq!(c.release(GrantId(1), true).0, AfterIo::Keep);
        // Not from a start no grant holds, nor past the file size, nor of another inode,
        // another generation, or a write layout.
        assert!(
            c.take_read_start(InodeId(2), r(12 << 20, 4096), 1, 4096)
                .is_none()
        );
        assert!(
            c.take_read_start(InodeId(2), r(10 << 20, 4096), 1, 4096)
                .is_none()
        );
        assert!(c.take_read_start(InodeId(3), r(0, 4096), 1, 4096).is_none());
        assert!(c.take_read_start(InodeId(2), r(0, 4096), 2, 4096).is_none());
        let mut layout = grant(3, 16 << 20, 1 << 20);
        Arc::get_mut(&mut layout).unwrap().mode = LockMode::Exclusive;
        assert!(c.enter(layout, 1));
        assert!(
            c.take_read_start(InodeId(2), r(16 << 20, 4096), 1, 4096)
                .is_none()
        );
        // A recalled grant is never handed out again.
        assert_eq!(c.take_overlapping(InodeId(2), r(0, 4096), None).len(), 1);
        assert!(c.take_read_start(InodeId(2), r(0, 4096), 1, 4096).is_none());
    }

    #[test]
    fn a_kept_grant_serves_reads_inside_it_only() {
        let c = GrantCache::new(8);
        assert!(c.enter(grant(1, 0, 4096 * 4), 1));
        // Not handed out before its first I/O is done and it is kept.
        assert!(c.take(InodeId(2), r(0, 4096), 1, S).is_none());
        assert_eq!(c.release(GrantId(1), true), (AfterIo::Keep, vec![]));
        assert!(c.take(InodeId(2), r(4096, 8192), 1, S).is_some());
        assert_eq!(c.release(GrantId(1), true).0, AfterIo::Keep);
        assert!(
            c.take(InodeId(2), r(4096, 4096 * 4), 1, S).is_none(),
            "past its end"
        );
        assert!(
            c.take(InodeId(3), r(0, 4096), 1, S).is_none(),
            "another inode"
        );
        assert!(
            c.take(InodeId(2), r(0, 4096), 2, S).is_none(),
            "another session"
        );
        assert_eq!(c.cached_ids(), vec![GrantId(1)]);
    }

    #[tokio::test]
    async fn a_recall_waits_for_io_in_flight_and_stops_new_use() {
        let c = Arc::new(GrantCache::new(8));
        assert!(c.enter(grant(1, 0, 4096), 1));
        c.release(GrantId(1), true);
        let _g = c.take(InodeId(2), r(0, 4096), 1, S).unwrap();
        c.recall(&[GrantId(1)]);
        assert!(c.take(InodeId(2), r(0, 4096), 1, S).is_none());
        let waiter = {
            let c = Arc::clone(&c);
            tokio::spawn(async move { c.wait_idle(&[GrantId(1)]).await })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiter.is_finished(), "the read is still in flight");
        assert_eq!(c.release(GrantId(1), true).0, AfterIo::Recalled);
        tokio::time::timeout(Duration::from_secs(1), waiter)
            .await
            .unwrap()
            .unwrap();
    }

    #[test]
    fn a_recall_that_overtakes_its_grant_makes_the_grant_unusable() {
        let c = GrantCache::new(8);
        c.recall(&[GrantId(7)]);
        assert!(!c.enter(grant(7, 0, 4096), 1));
        assert!(c.enter(grant(8, 0, 4096), 1));
    }

    #[test]
    fn the_least_recently_used_idle_grants_are_evicted() {
        let c = GrantCache::new(2);
        for id in 1..=3 {
            assert!(c.enter(grant(id, id * 4096, 4096), 1));
            let (after, evicted) = c.release(GrantId(id), true);
            assert_eq!(after, AfterIo::Keep);
            if id == 3 {
                assert_eq!(evicted, vec![GrantId(1)]);
            }
        }
        let mut ids = c.cached_ids();
        ids.sort();
        assert_eq!(ids, vec![GrantId(2), GrantId(3)]);
        // A grant not kept (its I/O failed) is returned.
        assert!(c.enter(grant(9, 0, 4096), 1));
        assert_eq!(c.release(GrantId(9), false).0, AfterIo::Return);
        // A kept grant replaces the idle ones it covers.
        assert!(c.enter(grant(10, 0, 4096 * 3), 1));
        let (_, evicted) = c.release(GrantId(10), true);
        assert_eq!(evicted, vec![GrantId(2)]);
        // The writer's own overlapping grants leave the cache.
        assert_eq!(
            c.take_overlapping(InodeId(2), r(8192, 1), None),
            vec![GrantId(10)]
        );
        assert_eq!(c.cached_ids(), vec![GrantId(3)]);
    }

    #[test]
    fn write_layouts_serve_writes_only_and_past_the_file_size() {
        let c = GrantCache::new(8);
        let layout = Arc::new(Grant {
            mode: LockMode::Exclusive,
            file_size: 0,
            ..(*grant(1, 0, 4096 * 16)).clone()
        });
        assert!(c.enter(layout, 1));
        assert_eq!(c.release(GrantId(1), true).0, AfterIo::Keep);
        assert!(
            c.take(InodeId(2), r(0, 4096), 1, S).is_none(),
            "not for reads"
        );
        let g = c.take(InodeId(2), r(4096, 8192), 1, LockMode::Exclusive);
        assert!(g.is_some(), "a write inside it, past the file size");
        c.release(GrantId(1), true);
        assert!(c.enter(grant(2, 0, 4096), 1));
        c.release(GrantId(2), true);
        // A reader gives back the write layout only; a writer the read grant only.
        assert_eq!(
            c.take_overlapping(InodeId(2), r(0, 1), Some(LockMode::Exclusive)),
            vec![GrantId(1)]
        );
        assert_eq!(c.cached_ids(), vec![GrantId(2)]);
    }
}
