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
//! can look into the directory without recalling it): their unlink there is answered here
//! too ([`AsyncCreates::begin_unlink`]) and sent behind the answer in the same queue, in
//! order, under the same barrier.
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
    /// Unlinks answered here and not by the server yet.
    unlinks: usize,
    /// Files made here under a delegation this node still holds, by directory: no other
    /// node has seen them (their unlink there may be answered here). A link or a move to
    /// another directory takes a file out.
    own: HashMap<InodeId, InodeId>,
    /// Creates answered here, and the ones the server refused (lost); the same of unlinks.
    made: u64,
    lost: u64,
    unlinked: u64,
    unlinks_lost: u64,
    /// Answered here and not sent yet, in the order answered; and whether a sender runs.
    queue: Vec<Answered>,
    sending: bool,
}

impl State {
    /// Changes answered here and not by the server yet.
    fn unanswered_now(&self) -> usize {
        self.unanswered.len() + self.unlinks
    }
}

/// A create answered here, to send.
#[derive(Debug, Clone)]
pub(crate) struct Queued {
    pub req: pb::CreateRequest,
    pub view: SessionView,
    pub ino: InodeId,
}

/// An unlink answered here, to send.
#[derive(Debug, Clone)]
pub(crate) struct QueuedUnlink {
    pub req: pb::UnlinkRequest,
    pub view: SessionView,
    /// The file it unlinks.
    pub ino: InodeId,
}

/// A change answered here, to send.
#[derive(Debug, Clone)]
pub(crate) enum Answered {
    Create(Queued),
    Unlink(QueuedUnlink),
}

impl Answered {
    fn session(&self) -> SessionId {
        match self {
            Answered::Create(q) => q.view.session,
            Answered::Unlink(q) => q.view.session,
        }
    }
}

/// Changes to send together ([`AsyncCreates::next_batch`]): all of one kind and session,
/// in the order answered.
#[derive(Debug)]
pub(crate) enum Batch {
    Creates(Vec<Queued>),
    Unlinks(Vec<QueuedUnlink>),
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
        s.own.insert(ino, dir);
        self.publish(&s);
        s.made += 1;
        Some((ino, generation))
    }

    /// Begins an unlink answered here of `ino`, named in `dir`: only a file made here under
    /// the delegation of `dir` that `session` holds, while there is room. Answers whether
    /// it may be answered here (else it goes to the server as before).
    pub fn begin_unlink(&self, dir: InodeId, session: SessionId, ino: InodeId) -> bool {
        let mut s = self.lock();
        if s.dirs.get(&dir) != Some(&session)
            || s.own.get(&ino) != Some(&dir)
            || s.unanswered_now() >= MAX_UNANSWERED
        {
            return false;
        }
        s.own.remove(&ino);
        s.unlinks += 1;
        s.unlinked += 1;
        self.publish(&s);
        true
    }

    fn publish(&self, s: &State) {
        self.pending
            .store(s.unanswered_now(), std::sync::atomic::Ordering::SeqCst);
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

    /// The server answered an unlink answered here (`lost`: refused it), or it went to a
    /// replay.
    pub fn unlink_answered(&self, lost: bool) {
        self.settle(|s| {
            s.unlinks = s.unlinks.saturating_sub(1);
            if lost {
                s.unlinks_lost += 1;
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
    /// same kind and session, up to `max`, in the order answered (a create and an unlink of
    /// one name go in the order the application made them). `None` (and the sender stops):
    /// nothing is queued.
    pub fn next_batch(&self, max: usize) -> Option<Batch> {
        let mut s = self.lock();
        let Some(first) = s.queue.first() else {
            s.sending = false;
            return None;
        };
        let (session, creates) = (first.session(), matches!(first, Answered::Create(_)));
        let n = s
            .queue
            .iter()
            .take(max)
            .take_while(|q| q.session() == session && matches!(q, Answered::Create(_)) == creates)
            .count();
        let taken = s.queue.drain(..n);
        Some(if creates {
            Batch::Creates(
                taken
                    .filter_map(|q| match q {
                        Answered::Create(q) => Some(q),
                        Answered::Unlink(_) => None,
                    })
                    .collect(),
            )
        } else {
            Batch::Unlinks(
                taken
                    .filter_map(|q| match q {
                        Answered::Unlink(q) => Some(q),
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

    /// Creates answered here, those the server refused, and those not answered by it yet;
    /// the same of unlinks.
    pub fn counts(&self) -> ([u64; 3], [u64; 3]) {
        let s = self.lock();
        (
            [s.made, s.lost, s.unanswered.len() as u64],
            [s.unlinked, s.unlinks_lost, s.unlinks as u64],
        )
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
        assert_eq!(c.counts().0, [3, 0, 3]);
    }

    #[tokio::test]
    async fn the_barrier_holds_until_every_create_is_answered() {
        let c = std::sync::Arc::new(AsyncCreates::default());
        let s = SessionId(1);
        c.add_dir(InodeId(9), s);
        c.add_numbers(s, &numbers(10, 4, 0));
        let (a, _) = c.begin(InodeId(9), s).unwrap();
        let (b, _) = c.begin(InodeId(9), s).unwrap();
        assert_eq!(c.counts().0[2], 2);
        let waiter = tokio::spawn({
            let c = c.clone();
            async move { c.drain().await }
        });
        tokio::task::yield_now().await;
        c.answered(a, false);
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished(), "b is not answered yet");
        assert_eq!(c.counts().0[2], 1);
        c.answered(b, true);
        tokio::time::timeout(std::time::Duration::from_secs(5), waiter)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(c.counts().0, [2, 1, 0]);
        // Bounded.
        c.add_numbers(s, &numbers(1000, 1000, 0));
        let mut n = 0;
        while c.begin(InodeId(9), s).is_some() {
            n += 1;
        }
        assert_eq!(n, MAX_UNANSWERED);
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

    fn unlink(ino: InodeId, session: u64) -> Answered {
        Answered::Unlink(QueuedUnlink {
            req: pb::UnlinkRequest::default(),
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
        assert!(!c.begin_unlink(e, s, a), "named in another directory");
        assert!(!c.begin_unlink(d, SessionId(2), a), "another session");
        assert!(!c.begin_unlink(d, s, InodeId(99)), "not made here");
        assert!(c.begin_unlink(d, s, a));
        assert!(!c.begin_unlink(d, s, a), "once");
        c.not_own(b);
        assert!(!c.begin_unlink(d, s, b), "linked or moved");
        c.none_own_in(e);
        assert!(
            !c.begin_unlink(e, s, x),
            "what left its directory is not known"
        );
        let (y, _) = c.begin(d, s).unwrap();
        c.drop_dir(d);
        assert!(!c.begin_unlink(d, s, y), "the delegation was recalled");
        assert_eq!(c.counts().1, [1, 0, 1]);

        // The barrier holds for the unlink too.
        for ino in [a, b, x, y] {
            c.answered(ino, false);
        }
        let waiter = tokio::spawn({
            let c = c.clone();
            async move { c.drain().await }
        });
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished(), "the unlink is not answered yet");
        c.unlink_answered(true);
        tokio::time::timeout(std::time::Duration::from_secs(5), waiter)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(c.counts().1, [1, 1, 0]);
    }

    #[test]
    fn batches_keep_the_order_answered_one_kind_and_session_at_a_time() {
        let c = AsyncCreates::default();
        let ino = InodeId;
        let queued = [
            create(ino(1), 1),
            create(ino(2), 1),
            unlink(ino(1), 1),
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
            Some(Batch::Unlinks(v)) => ("unlinks", v.iter().map(|q| q.ino.0).collect()),
            None => ("none", Vec::new()),
        };
        assert_eq!(inos(c.next_batch(8)), ("creates", vec![1, 2]));
        assert_eq!(inos(c.next_batch(8)), ("unlinks", vec![1]));
        assert_eq!(inos(c.next_batch(8)), ("creates", vec![3]));
        assert_eq!(inos(c.next_batch(2)), ("creates", vec![4, 5]));
        assert_eq!(inos(c.next_batch(2)), ("creates", vec![6]));
        assert_eq!(inos(c.next_batch(2)), ("none", vec![]));
        assert!(
            c.enqueue(create(ino(7), 2)),
            "the sender stopped: a new one starts"
        );
    }
}
