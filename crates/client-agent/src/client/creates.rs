//! Creates answered by the agent (docs/protocol.md "Creates answered by the agent"): the
//! bookkeeping, no I/O.
//!
//! In a directory whose *create delegation* this node holds (given with the `Mkdir` that made
//! it), the create of a new name is answered at once: the file gets an inode number from the
//! session's reservation ([`Pool`]), and its `Create` is sent behind the answer. Until every
//! such create is answered by the server, no other call of this agent is sent ([`AsyncCreates::
//! drain`], the barrier of `Inner::call_with`): everything this node asks afterwards, about the
//! new file or anything else, finds the server as the application saw it. A recall of the
//! delegation is acknowledged only once the directory's creates are answered.
//!
//! The files made that way stay this node's own while the delegation lasts (no other node
//! can look into the directory without recalling it): their unlink there, and their rename
//! within it, are answered here too ([`AsyncCreates::begin_change`]) and sent behind the
//! answer in the same queue, in order, under the same barrier.
//!
//! Every transition is a method here and is unit tested below.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

use sanfs_proto::model::ReserveInodesReply;
use sanfs_proto::pb;
use sanfs_proto::types::{InodeId, SessionId};

use super::SessionView;

/// Reserve more numbers when fewer than this many are left.
pub(crate) const REFILL_BELOW: u64 = 256;
/// How many numbers one `ReserveInodes` asks for.
pub(crate) const RESERVE: u32 = 1024;
/// The most creates answered and not answered by the server at once: past it a create
/// waits for the server as before (a bound on what a crash of this node takes back, and on
/// how long the barrier holds other calls).
pub(crate) const MAX_UNANSWERED: usize = 512;
/// The most files kept as this node's own ([`AsyncCreates::begin_change`]): past it a file
/// made here is not, and its unlink or rename goes to the server (a bound on memory, for a
/// node that makes millions of files under one delegation).
pub(crate) const MAX_OWN: usize = 1 << 16;

/// Inode numbers reserved to one session, handed out in order.
#[derive(Debug, Default)]
struct Pool {
    session: Option<SessionId>,
    /// `(next, end, generation of next)` per reservation.
    blocks: Vec<(u64, u64, u64)>,
    refilling: bool,
}

impl Pool {
    fn left(&self) -> u64 {
        self.blocks.iter().map(|(next, end, _)| end - next).sum()
    }
}

#[derive(Debug, Default)]
struct State {
    pool: Pool,
    /// Directories this node holds the create delegation of, and under which session.
    dirs: HashMap<InodeId, SessionId>,
    /// Files whose create was answered here and not by the server yet.
    unanswered: HashSet<InodeId>,
    /// Unlinks and renames answered here and not by the server yet.
    changes: usize,
    /// Files made here under a delegation this node still holds, by directory: no other
    /// node has seen them (their unlink there may be answered here). A link or a move to
    /// another directory takes a file out.
    own: HashMap<InodeId, InodeId>,
    /// Creates answered here, and the ones the server refused (lost); the same of unlinks
    /// and of renames.
    made: u64,
    lost: u64,
    unlinked: u64,
    unlinks_lost: u64,
    renamed: u64,
    renames_lost: u64,
    attrs_changed: u64,
    attrs_lost: u64,
    /// Answered here and not sent yet, in the order answered; and whether a sender runs.
    queue: Vec<Answered>,
    sending: bool,
}

impl State {
    /// Changes answered here and not by the server yet.
    fn unanswered_now(&self) -> usize {
        self.unanswered.len() + self.changes
    }
}

/// A create answered here, to send.
#[derive(Debug, Clone)]
pub(crate) struct Queued {
    pub req: pb::CreateRequest,
    pub view: SessionView,
    pub ino: InodeId,
}

/// An unlink or a rename answered here, to send.
#[derive(Debug, Clone)]
pub(crate) struct QueuedChange {
    pub change: HereChange,
    pub view: SessionView,
    /// The file it unlinks or moves.
    pub ino: InodeId,
}

/// The request of a [`QueuedChange`].
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum HereChange {
    Unlink(pb::UnlinkRequest),
    Rename(pb::RenameRequest),
    /// Of the mode, owners or times of a directory this node made (its create delegation).
    SetAttr(pb::SetAttrRequest),
}

/// Which kind of [`HereChange`] (its counters).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ChangeKind {
    Unlink,
    Rename,
    Attr,
}

impl HereChange {
    /// Its record for a replay.
    pub fn record(&self) -> super::unsynced::NsChange {
        match self {
            HereChange::Unlink(r) => super::unsynced::NsChange::Unlink(r.clone()),
            HereChange::Rename(r) => super::unsynced::NsChange::Rename(r.clone()),
            HereChange::SetAttr(r) => super::unsynced::NsChange::SetAttr(r.clone()),
        }
    }

    pub fn kind(&self) -> ChangeKind {
        match self {
            HereChange::Unlink(_) => ChangeKind::Unlink,
            HereChange::Rename(_) => ChangeKind::Rename,
            HereChange::SetAttr(_) => ChangeKind::Attr,
        }
    }

    /// The inodes whose attributes it changes outright: the directories of an unlink or a
    /// rename (their mtime and ctime), or the inode of an attribute change. A `ChangeBatch`
    /// holds no attribute change beside another change of its inode (their order would
    /// not be kept).
    pub fn inodes(&self) -> Vec<u64> {
        let mut v: Vec<u64> = self.names().into_iter().map(|(d, _)| d).collect();
        v.dedup();
        v
    }

    /// Its item of a `ChangeBatch`, with its reply-cache id.
    pub fn wire(&self, id: Option<pb::RequestId>) -> pb::BatchedChange {
        use pb::batched_change::Change;
        pb::BatchedChange {
            change: Some(match self {
                HereChange::Unlink(r) => Change::Unlink(pb::UnlinkRequest {
                    request_id: id,
                    ..r.clone()
                }),
                HereChange::Rename(r) => Change::Rename(pb::RenameRequest {
                    request_id: id,
                    ..r.clone()
                }),
                // Idempotent: no reply-cache id.
                HereChange::SetAttr(r) => Change::SetAttr(r.clone()),
            }),
        }
    }

    /// The names it changes, as (directory, name); an attribute change names its inode
    /// with the empty name (which no entry has), as `BatchedChange::entries` does.
    pub fn names(&self) -> Vec<(u64, &[u8])> {
        match self {
            HereChange::Unlink(r) => vec![(r.parent, r.name.as_slice())],
            HereChange::Rename(r) => vec![
                (r.old_parent, r.old_name.as_slice()),
                (r.new_parent, r.new_name.as_slice()),
            ],
            HereChange::SetAttr(r) => vec![(r.inode, &[][..])],
        }
    }
}

/// A change answered here, to send.
#[derive(Debug, Clone)]
pub(crate) enum Answered {
    Create(Queued),
    Change(QueuedChange),
}

impl Answered {
    fn session(&self) -> SessionId {
        match self {
            Answered::Create(q) => q.view.session,
            Answered::Change(q) => q.view.session,
        }
    }
}

/// Changes to send together ([`AsyncCreates::next_batch`]), all of one session, in the
/// order answered: creates (one `CreateBatch`), or unlinks and renames of names that differ
/// (sent side by side: their order does not matter).
#[derive(Debug)]
pub(crate) enum Batch {
    Creates(Vec<Queued>),
    Changes(Vec<QueuedChange>),
}

/// The creates this node answers itself.
#[derive(Debug, Default)]
pub(crate) struct AsyncCreates {
    state: Mutex<State>,
    drained: tokio::sync::Notify,
    /// Woken when an answer makes room below [`MAX_UNANSWERED`].
    room: tokio::sync::Notify,
    /// How many changes are unanswered (`State::unanswered_now`): every call of the agent
    /// passes the barrier, most with none, and then takes no lock.
    pending: std::sync::atomic::AtomicUsize,
}

impl AsyncCreates {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// This node holds the create delegation of `dir` under `session`.
    pub fn add_dir(&self, dir: InodeId, session: SessionId) {
        self.lock().dirs.insert(dir, session);
    }

    /// The delegation of `dir` was recalled (or its directory is gone): no more creates
    /// are answered there.
    pub fn drop_dir(&self, dir: InodeId) {
        let mut s = self.lock();
        s.dirs.remove(&dir);
        s.own.retain(|_, d| *d != dir);
    }

    /// `ino` is no longer only this node's (a link to it was made, or it moved).
    pub fn not_own(&self, ino: InodeId) {
        self.lock().own.remove(&ino);
    }

    /// What moved out of `dir` is not known: none of its files is this node's only any more.
    pub fn none_own_in(&self, dir: InodeId) {
        self.lock().own.retain(|_, d| *d != dir);
    }

    /// Whether creates in `dir` may be answered here under `session`.
    pub fn delegated(&self, dir: InodeId, session: SessionId) -> bool {
        self.lock().dirs.get(&dir) == Some(&session)
    }

    /// Every delegation goes (a session ended, a stream broke: a recall may have been
    /// missed), and so do the numbers of another session than `session`.
    pub fn forget(&self, session: Option<SessionId>) {
        let mut s = self.lock();
        s.dirs.clear();
        s.own.clear();
        if s.pool.session != session {
            s.pool = Pool::default();
        }
    }

    /// Numbers reserved to `session` arrived.
    pub fn add_numbers(&self, session: SessionId, r: &ReserveInodesReply) {
        let mut s = self.lock();
        s.pool.refilling = false;
        if s.pool.session != Some(session) {
            s.pool = Pool {
                session: Some(session),
                ..Pool::default()
            };
        }
        let first = r.first.0;
        s.pool
            .blocks
            .push((first, first + u64::from(r.count), r.first_generation));
    }

    /// A reservation could not be made (it is asked again later).
    pub fn refill_failed(&self) {
        self.lock().pool.refilling = false;
    }

    /// Whether `session`'s numbers run low and nobody asks for more yet; if so the caller
    /// asks (this notes it).
    pub fn should_refill(&self, session: SessionId) -> bool {
        let mut s = self.lock();
        let low = s.pool.session != Some(session) || s.pool.left() < REFILL_BELOW;
        if low && !s.pool.refilling {
            s.pool.refilling = true;
            return true;
        }
        false
    }

    /// Begins a create answered here in a delegated directory under `session`: its inode
    /// number and generation, or `None` (no number left, too many unanswered, or the
    /// delegation is gone): then it goes to the server as before.
    pub fn begin(&self, dir: InodeId, session: SessionId) -> Option<(InodeId, u64)> {
        let mut s = self.lock();
        if s.dirs.get(&dir) != Some(&session)
            || s.pool.session != Some(session)
            || s.unanswered_now() >= MAX_UNANSWERED
        {
            return None;
        }
        let block = s.pool.blocks.iter_mut().find(|(next, end, _)| next < end)?;
        let (ino, generation) = (InodeId(block.0), block.2);
        block.0 += 1;
        block.2 += 1;
        s.pool.blocks.retain(|(next, end, _)| next < end);
        s.unanswered.insert(ino);
        if s.own.len() < MAX_OWN {
            s.own.insert(ino, dir);
        }
        self.publish(&s);
        s.made += 1;
        Some((ino, generation))
    }

    /// Begins an unlink (`unlink`) or a rename within `dir` answered here of `ino`, named
    /// in `dir`: only a file made here under the delegation of `dir` that `session` holds,
    /// while there is room. Answers whether it may be answered here (else it goes to the
    /// server as before).
    pub fn begin_change(
        &self,
        dir: InodeId,
        session: SessionId,
        ino: InodeId,
        unlink: bool,
    ) -> bool {
        let mut s = self.lock();
        if s.dirs.get(&dir) != Some(&session)
            || s.own.get(&ino) != Some(&dir)
            || s.unanswered_now() >= MAX_UNANSWERED
        {
            return false;
        }
        s.changes += 1;
        if unlink {
            s.own.remove(&ino);
            s.unlinked += 1;
        } else {
            s.renamed += 1;
        }
        self.publish(&s);
        true
    }

    /// Begins a change of the attributes of `dir` answered here: only of a directory whose
    /// create delegation `session` holds, while there is room.
    pub fn begin_attr_change(&self, dir: InodeId, session: SessionId) -> bool {
        let mut s = self.lock();
        if s.dirs.get(&dir) != Some(&session) || s.unanswered_now() >= MAX_UNANSWERED {
            return false;
        }
        s.changes += 1;
        s.attrs_changed += 1;
        self.publish(&s);
        true
    }

    fn publish(&self, s: &State) {
        self.pending
            .store(s.unanswered_now(), std::sync::atomic::Ordering::SeqCst);
    }

    /// Whether the create of `ino` answered here is not answered by the server yet (a
    /// handle it opened is not known there).
    pub fn unanswered(&self, ino: InodeId) -> bool {
        self.lock().unanswered.contains(&ino)
    }

    /// The server answered `ino`'s create (`lost`: refused it), or it went to a replay.
    pub fn answered(&self, ino: InodeId, lost: bool) {
        self.settle(|s| {
            s.unanswered.remove(&ino);
            if lost {
                s.lost += 1;
            }
        });
    }

    /// The server answered an unlink (`unlink`) or a rename answered here (`lost`: refused
    /// it), or it went to a replay.
    pub fn change_answered(&self, kind: ChangeKind, lost: bool) {
        self.settle(|s| {
            s.changes = s.changes.saturating_sub(1);
            match (lost, kind) {
                (false, _) => {}
                (true, ChangeKind::Unlink) => s.unlinks_lost += 1,
                (true, ChangeKind::Rename) => s.renames_lost += 1,
                (true, ChangeKind::Attr) => s.attrs_lost += 1,
            }
        });
    }

    fn settle(&self, f: impl FnOnce(&mut State)) {
        let left = {
            let mut s = self.lock();
            f(&mut s);
            self.publish(&s);
            s.unanswered_now()
        };
        if left == 0 {
            self.drained.notify_waiters();
        }
        if left < MAX_UNANSWERED {
            self.room.notify_waiters();
        }
    }

    /// Waits while [`MAX_UNANSWERED`] creates answered here are unanswered by the server
    /// (a create then waits for room, not for all of them as a call to the server would).
    pub async fn wait_room(&self) {
        loop {
            let room = self.room.notified();
            tokio::pin!(room);
            room.as_mut().enable();
            if self.lock().unanswered_now() < MAX_UNANSWERED {
                return;
            }
            room.await;
        }
    }

    /// Queues `q` to be sent; answers whether a sender must be started (none runs).
    pub fn enqueue(&self, q: Answered) -> bool {
        let mut s = self.lock();
        s.queue.push(q);
        !std::mem::replace(&mut s.sending, true)
    }

    /// The next changes to send together: the first one queued and those after it of the
    /// same session and kind ([`Batch`]), up to `max`, in the order answered; unlinks and
    /// renames only while no two change one name (a create, an unlink and a rename of one
    /// name go in the order the application made them). `None` (and the sender stops):
    /// nothing is queued.
    pub fn next_batch(&self, max: usize) -> Option<Batch> {
        let mut s = self.lock();
        let Some(first) = s.queue.first() else {
            s.sending = false;
            return None;
        };
        let (session, creates) = (first.session(), matches!(first, Answered::Create(_)));
        let n = {
            let mut names: HashSet<(u64, &[u8])> = HashSet::new();
            let (mut attr_inodes, mut changed_inodes) = (HashSet::new(), HashSet::new());
            s.queue
                .iter()
                .take(max)
                .take_while(|q| {
                    q.session() == session
                        && match q {
                            Answered::Create(_) => creates,
                            Answered::Change(c) => {
                                let mine = c.change.names();
                                let inodes = c.change.inodes();
                                let attr = c.change.kind() == ChangeKind::Attr;
                                // No two change one name; an attribute change goes with no
                                // other change of its inode (nor one after it with it).
                                let apart = !creates
                                    && mine.iter().all(|n| !names.contains(n))
                                    && inodes.iter().all(|i| {
                                        !(attr_inodes.contains(i)
                                            || attr && changed_inodes.contains(i))
                                    });
                                names.extend(mine);
                                changed_inodes.extend(inodes.iter().copied());
                                if attr {
                                    attr_inodes.extend(inodes);
                                }
                                apart
                            }
                        }
                })
                .count()
        };
        let taken = s.queue.drain(..n);
        Some(if creates {
            Batch::Creates(
                taken
                    .filter_map(|q| match q {
                        Answered::Create(q) => Some(q),
                        Answered::Change(_) => None,
                    })
                    .collect(),
            )
        } else {
            Batch::Changes(
                taken
                    .filter_map(|q| match q {
                        Answered::Change(q) => Some(q),
                        Answered::Create(_) => None,
                    })
                    .collect(),
            )
        })
    }

    /// Waits until every create answered here is answered by the server.
    pub async fn drain(&self) {
        if self.pending.load(std::sync::atomic::Ordering::SeqCst) == 0 {
            return;
        }
        loop {
            let drained = self.drained.notified();
            tokio::pin!(drained);
            drained.as_mut().enable();
            if self.lock().unanswered_now() == 0 {
                return;
            }
            drained.await;
        }
    }

    /// Creates, unlinks and renames answered here, those the server refused, and those not
    /// answered by it yet.
    pub fn counts(&self) -> super::status::CreateCounts {
        let s = self.lock();
        super::status::CreateCounts {
            here: s.made,
            lost: s.lost,
            unanswered_now: s.unanswered.len() as u64,
            unlinks_here: s.unlinked,
            unlinks_lost: s.unlinks_lost,
            renames_here: s.renamed,
            renames_lost: s.renames_lost,
            attrs_here: s.attrs_changed,
            attrs_lost: s.attrs_lost,
            changes_unanswered_now: s.changes as u64,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn numbers(first: u64, count: u32, generation: u64) -> ReserveInodesReply {
        ReserveInodesReply {
            first: InodeId(first),
            count,
            first_generation: generation,
        }
    }

    #[test]
    fn a_create_is_answered_here_only_in_a_delegated_directory_with_numbers_of_its_session() {
        let c = AsyncCreates::default();
        let (s1, s2, d) = (SessionId(1), SessionId(2), InodeId(9));
        assert!(c.should_refill(s1));
        assert!(!c.should_refill(s1), "asked once");
        assert_eq!(c.begin(d, s1), None, "no delegation, no numbers");
        c.add_dir(d, s1);
        assert_eq!(c.begin(d, s1), None, "no numbers");
        c.add_numbers(s1, &numbers(100, 2, 50));
        c.add_numbers(s1, &numbers(200, 1, 70));
        assert_eq!(c.begin(d, s2), None, "another session");
        assert_eq!(c.begin(InodeId(8), s1), None, "another directory");
        assert_eq!(c.begin(d, s1), Some((InodeId(100), 50)));
        assert_eq!(c.begin(d, s1), Some((InodeId(101), 51)));
        assert_eq!(c.begin(d, s1), Some((InodeId(200), 70)));
        assert_eq!(c.begin(d, s1), None, "used up");
        assert!(c.should_refill(s1));
        c.drop_dir(d);
        c.add_numbers(s1, &numbers(300, 5, 0));
        assert_eq!(c.begin(d, s1), None, "recalled");
        c.add_dir(d, s1);
        c.forget(Some(s2));
        c.add_dir(d, s2);
        assert_eq!(c.begin(d, s2), None, "the numbers were the old session's");
        assert_eq!((c.counts().here, c.counts().unanswered_now), (3, 3));
    }

    #[tokio::test]
    async fn the_barrier_holds_until_every_create_is_answered() {
        let c = std::sync::Arc::new(AsyncCreates::default());
        let s = SessionId(1);
        c.add_dir(InodeId(9), s);
        c.add_numbers(s, &numbers(10, 4, 0));
        let (a, _) = c.begin(InodeId(9), s).unwrap();
        let (b, _) = c.begin(InodeId(9), s).unwrap();
        assert_eq!(c.counts().unanswered_now, 2);
        let waiter = tokio::spawn({
            let c = c.clone();
            async move { c.drain().await }
        });
        tokio::task::yield_now().await;
        c.answered(a, false);
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished(), "b is not answered yet");
        assert_eq!(c.counts().unanswered_now, 1);
        c.answered(b, true);
        tokio::time::timeout(std::time::Duration::from_secs(5), waiter)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            (c.counts().here, c.counts().lost, c.counts().unanswered_now),
            (2, 1, 0)
        );
        // Bounded.
        c.add_numbers(s, &numbers(1000, 1000, 0));
        let mut n = 0;
        while c.begin(InodeId(9), s).is_some() {
            n += 1;
        }
        assert_eq!(n, MAX_UNANSWERED);
        // At most MAX_OWN files are kept as this node's own.
        let c = AsyncCreates::default();
        c.add_dir(InodeId(9), s);
        c.add_numbers(s, &numbers(1 << 20, u32::try_from(MAX_OWN).unwrap() + 1, 0));
        for i in 0..=MAX_OWN as u64 {
            let (ino, _) = c.begin(InodeId(9), s).unwrap();
            c.answered(ino, false);
            assert_eq!(ino, InodeId((1 << 20) + i));
        }
        let last = InodeId((1 << 20) + MAX_OWN as u64);
        assert!(!c.begin_change(InodeId(9), s, last, true), "past the bound");
        assert!(c.begin_change(InodeId(9), s, InodeId(1 << 20), true));
    }

    fn view(session: u64) -> SessionView {
        SessionView {
            session: SessionId(session),
            epoch: sanfs_proto::types::SessionEpoch(1),
            generation: 1,
            server: sanfs_proto::model::ServerInfo {
                fs_uuid: uuid::Uuid::from_u128(1),
                block_size: 4096,
                direct_io_threshold: 65536,
                max_grant_bytes: 1 << 20,
                max_inline_bytes: 65536,
                server_version: String::new(),
                restores: 0,
                multi_part_complete: true,
                write_sets_attr: true,
                releases_with_changes: true,
            },
        }
    }

    fn unlink(ino: InodeId, session: u64, name: &str) -> Answered {
        Answered::Change(QueuedChange {
            change: HereChange::Unlink(pb::UnlinkRequest {
                parent: 9,
                name: name.into(),
                ..Default::default()
            }),
            view: view(session),
            ino,
        })
    }

    fn rename(ino: InodeId, session: u64, from: &str, to: &str) -> Answered {
        Answered::Change(QueuedChange {
            change: HereChange::Rename(pb::RenameRequest {
                old_parent: 9,
                old_name: from.into(),
                new_parent: 9,
                new_name: to.into(),
                ..Default::default()
            }),
            view: view(session),
            ino,
        })
    }

    fn create(ino: InodeId, session: u64) -> Answered {
        Answered::Create(Queued {
            req: pb::CreateRequest::default(),
            view: view(session),
            ino,
        })
    }

    #[tokio::test]
    async fn an_unlink_is_answered_here_only_of_a_file_made_here_that_stayed_unseen() {
        let c = std::sync::Arc::new(AsyncCreates::default());
        let (s, d, e) = (SessionId(1), InodeId(9), InodeId(10));
        c.add_dir(d, s);
        c.add_dir(e, s);
        c.add_numbers(s, &numbers(10, 8, 0));
        let (a, _) = c.begin(d, s).unwrap();
        let (b, _) = c.begin(d, s).unwrap();
        let (x, _) = c.begin(e, s).unwrap();
        assert!(!c.begin_change(e, s, a, true), "named in another directory");
        assert!(!c.begin_change(d, SessionId(2), a, true), "another session");
        assert!(!c.begin_change(d, s, InodeId(99), true), "not made here");
        assert!(c.begin_change(d, s, a, true));
        assert!(!c.begin_change(d, s, a, true), "once");
        c.not_own(b);
        assert!(!c.begin_change(d, s, b, true), "linked or moved");
        c.none_own_in(e);
        assert!(
            !c.begin_change(e, s, x, true),
            "what left its directory is not known"
        );
        let (y, _) = c.begin(d, s).unwrap();
        c.drop_dir(d);
        assert!(
            !c.begin_change(d, s, y, true),
            "the delegation was recalled"
        );
        // A rename keeps the file this node's own (within its directory); an unlink ends it.
        let (x2, _) = c.begin(e, s).unwrap();
        assert!(c.begin_change(e, s, x2, false));
        assert!(c.begin_change(e, s, x2, true));
        assert!(!c.begin_change(e, s, x2, false), "gone");
        let n = c.counts();
        assert_eq!(
            (n.unlinks_here, n.renames_here, n.changes_unanswered_now),
            (2, 1, 3)
        );

        // The barrier holds for the unlink too.
        for ino in [a, b, x, y, x2] {
            c.answered(ino, false);
        }
        let waiter = tokio::spawn({
            let c = c.clone();
            async move { c.drain().await }
        });
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished(), "the unlink is not answered yet");
        c.change_answered(ChangeKind::Rename, false);
        c.change_answered(ChangeKind::Unlink, false);
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished(), "one unlink is not answered yet");
        c.change_answered(ChangeKind::Unlink, true);
        tokio::time::timeout(std::time::Duration::from_secs(5), waiter)
            .await
            .unwrap()
            .unwrap();
        let n = c.counts();
        assert_eq!(
            (n.unlinks_lost, n.renames_lost, n.changes_unanswered_now),
            (1, 0, 0)
        );
    }

    #[test]
    fn batches_keep_the_order_answered_one_kind_and_session_at_a_time() {
        let c = AsyncCreates::default();
        let ino = InodeId;
        let queued = [
            create(ino(1), 1),
            create(ino(2), 1),
            unlink(ino(1), 1, "a"),
            rename(ino(2), 1, "b", "c"),
            rename(ino(8), 1, "d", "a"),
            unlink(ino(2), 1, "c"),
            create(ino(3), 1),
            create(ino(4), 2),
            create(ino(5), 2),
            create(ino(6), 2),
        ];
        let mut start = false;
        for q in queued {
            start |= c.enqueue(q);
        }
        assert!(start, "the first one starts a sender");
        let inos = |b: Option<Batch>| match b {
            Some(Batch::Creates(v)) => ("creates", v.iter().map(|q| q.ino.0).collect::<Vec<_>>()),
            Some(Batch::Changes(v)) => ("changes", v.iter().map(|q| q.ino.0).collect()),
            None => ("none", Vec::new()),
        };
        assert_eq!(inos(c.next_batch(8)), ("creates", vec![1, 2]));
        // "a" unlinked, then made again by a rename: not side by side; "c" likewise.
        assert_eq!(inos(c.next_batch(8)), ("changes", vec![1, 2]));
        assert_eq!(inos(c.next_batch(8)), ("changes", vec![8, 2]));
        assert_eq!(inos(c.next_batch(8)), ("creates", vec![3]));
        assert_eq!(inos(c.next_batch(2)), ("creates", vec![4, 5]));
        assert_eq!(inos(c.next_batch(2)), ("creates", vec![6]));
        assert_eq!(inos(c.next_batch(2)), ("none", vec![]));
        assert!(
            c.enqueue(create(ino(7), 2)),
            "the sender stopped: a new one starts"
        );
    }

    fn set_attr(dir: u64, session: u64) -> Answered {
        Answered::Change(QueuedChange {
            change: HereChange::SetAttr(pb::SetAttrRequest {
                inode: dir,
                ..Default::default()
            }),
            view: view(session),
            ino: InodeId(dir),
        })
    }

    #[test]
    fn a_directorys_attribute_change_goes_with_no_other_change_there() {
        let c = AsyncCreates::default();
        let (s, d) = (SessionId(1), InodeId(9));
        assert!(!c.begin_attr_change(d, s), "not a delegated directory");
        c.add_dir(d, s);
        assert!(!c.begin_attr_change(d, SessionId(2)), "another session's");
        assert!(c.begin_attr_change(d, s));
        assert_eq!(c.counts().attrs_here, 1);
        c.change_answered(ChangeKind::Attr, true);
        assert_eq!(
            (c.counts().attrs_lost, c.counts().changes_unanswered_now),
            (1, 0)
        );
        let ino = InodeId;
        // Unlinks in directory 9 around its attribute changes, and one of directory 10.
        for q in [
            unlink(ino(1), 1, "a"),
            set_attr(9, 1),
            set_attr(10, 1),
            set_attr(9, 1),
            unlink(ino(2), 1, "b"),
        ] {
            c.enqueue(q);
        }
        let inos = |b: Option<Batch>| match b {
            Some(Batch::Changes(v)) => v.iter().map(|q| q.ino.0).collect::<Vec<_>>(),
            _ => Vec::new(),
        };
        assert_eq!(inos(c.next_batch(8)), vec![1], "not beside the unlink in 9");
        assert_eq!(
            inos(c.next_batch(8)),
            vec![9, 10],
            "10 beside it, not 9 again"
        );
        assert_eq!(
            inos(c.next_batch(8)),
            vec![9],
            "nor the unlink in 9 after it"
        );
        assert_eq!(inos(c.next_batch(8)), vec![2]);
    }
}
