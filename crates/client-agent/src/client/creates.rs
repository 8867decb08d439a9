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
    /// Creates answered here, and the ones the server refused (lost), for status.
    made: u64,
    lost: u64,
    /// Answered here and not sent yet, in the order answered; and whether a sender runs.
    queue: Vec<Queued>,
    sending: bool,
}

/// A create answered here, to send.
#[derive(Debug, Clone)]
pub(crate) struct Queued {
    pub req: pb::CreateRequest,
    pub view: SessionView,
    pub ino: InodeId,
}

/// The creates this node answers itself.
#[derive(Debug, Default)]
pub(crate) struct AsyncCreates {
    state: Mutex<State>,
    drained: tokio::sync::Notify,
    /// Woken when an answer makes room below [`MAX_UNANSWERED`].
    room: tokio::sync::Notify,
    /// How many creates are unanswered (`State::unanswered`'s length): every call of the
    /// agent passes the barrier, most with none, and then takes no lock.
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
        self.lock().dirs.remove(&dir);
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
            || s.unanswered.len() >= MAX_UNANSWERED
        {
            return None;
        }
        let block = s.pool.blocks.iter_mut().find(|(next, end, _)| next < end)?;
        let (ino, generation) = (InodeId(block.0), block.2);
        block.0 += 1;
        block.2 += 1;
        s.pool.blocks.retain(|(next, end, _)| next < end);
        s.unanswered.insert(ino);
        self.pending
            .store(s.unanswered.len(), std::sync::atomic::Ordering::SeqCst);
        s.made += 1;
        Some((ino, generation))
    }

    /// The server answered `ino`'s create (`lost`: refused it), or it went to a replay.
    pub fn answered(&self, ino: InodeId, lost: bool) {
        let left = {
            let mut s = self.lock();
            s.unanswered.remove(&ino);
            if lost {
                s.lost += 1;
            }
            self.pending
                .store(s.unanswered.len(), std::sync::atomic::Ordering::SeqCst);
            s.unanswered.len()
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
            if self.lock().unanswered.len() < MAX_UNANSWERED {
                return;
            }
            room.await;
        }
    }

    /// Queues `q` to be sent; answers whether a sender must be started (none runs).
    pub fn enqueue(&self, q: Queued) -> bool {
        let mut s = self.lock();
        s.queue.push(q);
        !std::mem::replace(&mut s.sending, true)
    }

    /// The next creates to send together: up to `max` of the first one's session, in the
    /// order answered. Empty (and the sender stops): nothing is queued.
    pub fn next_batch(&self, max: usize) -> Vec<Queued> {
        let mut s = self.lock();
        let Some(first) = s.queue.first().map(|q| q.view.session) else {
            s.sending = false;
            return Vec::new();
        };
        let mut batch = Vec::new();
        let mut rest = Vec::new();
        for q in s.queue.drain(..) {
            if q.view.session == first && batch.len() < max {
                batch.push(q);
            } else {
                rest.push(q);
            }
        }
        s.queue = rest;
        batch
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
            if self.lock().unanswered.is_empty() {
                return;
            }
            drained.await;
        }
    }

    /// Creates answered here, those the server refused, and those not answered by it yet.
    pub fn counts(&self) -> (u64, u64, u64) {
        let s = self.lock();
        (s.made, s.lost, s.unanswered.len() as u64)
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
        assert_eq!(c.counts(), (3, 0, 3));
    }

    #[tokio::test]
    async fn the_barrier_holds_until_every_create_is_answered() {
        let c = std::sync::Arc::new(AsyncCreates::default());
        let s = SessionId(1);
        c.add_dir(InodeId(9), s);
        c.add_numbers(s, &numbers(10, 4, 0));
        let (a, _) = c.begin(InodeId(9), s).unwrap();
        let (b, _) = c.begin(InodeId(9), s).unwrap();
        assert_eq!(c.counts().2, 2);
        let waiter = tokio::spawn({
            let c = c.clone();
            async move { c.drain().await }
        });
        tokio::task::yield_now().await;
        c.answered(a, false);
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished(), "b is not answered yet");
        assert_eq!(c.counts().2, 1);
        c.answered(b, true);
        tokio::time::timeout(std::time::Duration::from_secs(5), waiter)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(c.counts(), (2, 1, 0));
        // Bounded.
        c.add_numbers(s, &numbers(1000, 1000, 0));
        let mut n = 0;
        while c.begin(InodeId(9), s).is_some() {
            n += 1;
        }
        assert_eq!(n, MAX_UNANSWERED);
    }
}
