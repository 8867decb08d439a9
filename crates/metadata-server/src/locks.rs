//! Byte-range locks on inodes: what a grant holds while a client does its I/O.
//!
//! Shared (read) and exclusive (write) locks on byte ranges of one inode. Locks on disjoint
//! ranges never wait for each other, so two clients can write different parts of one file at
//! once. Conflicting requests wait **in order**: a request waits for every held lock it
//! conflicts with and for every earlier *waiting* request it conflicts with, so a stream of
//! readers cannot starve a writer. A wait is bounded: after the timeout the request is
//! withdrawn and fails with [`LockError::Timeout`], changing nothing.
//!
//! The manager knows nothing of grants or sessions; the grant layer passes a callback that is
//! told which holders block a request (to recall cached grants), and releases a lock by its
//! id. The callback hears of every holder that blocks the request while it waits, not only
//! of those at its start: an earlier waiter granted meanwhile (a reader queued ahead of this
//! writer, whose grant is then cached) is announced too, once.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::oneshot;

/// A lock's identity (the grant layer uses the grant id).
pub type LockId = u64;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LockMode {
    Shared,
    Exclusive,
}

/// `[start, end)` in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    pub start: u64,
    pub end: u64,
}

impl Span {
    pub fn new(start: u64, len: u64) -> Span {
        Span {
            start,
            end: start.saturating_add(len),
        }
    }

    fn overlaps(&self, other: &Span) -> bool {
        self.start < other.end && other.start < self.end
    }
}

/// Who holds a lock: a session (0: the server itself), and whether the lock is that
/// session's **delegation** (whole-file caching rights, see [`crate::grants`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Owner {
    pub session: u64,
    pub delegation: bool,
}

impl Owner {
    /// A lock of the server's own (it conflicts with every other).
    pub const SERVER: Owner = Owner {
        session: 0,
        delegation: false,
    };

    /// An ordinary lock of `session` (a grant, or a proxied request on its behalf).
    pub fn session(session: u64) -> Owner {
        Owner {
            session,
            delegation: false,
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Lock {
    id: LockId,
    span: Span,
    mode: LockMode,
    owner: Owner,
}

impl Lock {
    /// Overlapping, one of them exclusive, and not a delegation meeting a lock of its own
    /// session (a session's delegation never blocks that session's own I/O).
    fn conflicts(&self, other: &Lock) -> bool {
        self.span.overlaps(&other.span)
            && (self.mode == LockMode::Exclusive || other.mode == LockMode::Exclusive)
            && !(self.owner.session != 0
                && self.owner.session == other.owner.session
                && (self.owner.delegation || other.owner.delegation))
    }
}

/// Whether `waiter` waits (also) for a delegation that `owner` holds: then a request of
/// `owner` goes ahead of it, since that delegation's recall may need this very request (the
/// holder writes its cached data back before it answers).
fn waits_on_delegation_of(held: &[Lock], waiter: &Lock, owner: Owner) -> bool {
    owner.session != 0
        && held
            .iter()
            .any(|h| h.owner.delegation && h.owner.session == owner.session && h.conflicts(waiter))
}

struct Waiter {
    lock: Lock,
    wake: oneshot::Sender<()>,
}

#[derive(Default)]
struct InodeLocks {
    held: Vec<Lock>,
    waiting: VecDeque<Waiter>,
}

impl InodeLocks {
    fn blocked(&self, req: &Lock) -> bool {
        self.held.iter().any(|l| l.conflicts(req))
            || self.waiting.iter().any(|w| {
                w.lock.conflicts(req) && !waits_on_delegation_of(&self.held, &w.lock, req.owner)
            })
    }

    /// Grants, in order, every waiter that no held lock and no earlier waiter blocks.
    /// Returns whether one of them is exclusive.
    fn wake_ready(&mut self) -> bool {
        let mut exclusive = false;
        let mut still = VecDeque::with_capacity(self.waiting.len());
        while let Some(w) = self.waiting.pop_front() {
            let held = &self.held;
            let blocked = held.iter().any(|l| l.conflicts(&w.lock))
                || still.iter().any(|s: &Waiter| {
                    s.lock.conflicts(&w.lock)
                        && !waits_on_delegation_of(held, &s.lock, w.lock.owner)
                });
            if blocked {
                still.push_back(w);
            } else if w.wake.send(()).is_ok() {
                exclusive |= w.lock.mode == LockMode::Exclusive;
                self.held.push(w.lock);
            }
            // A waiter whose receiver is gone timed out or was cancelled: drop it.
        }
        self.waiting = still;
        exclusive
    }
}

/// Why a lock was not taken.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LockError {
    #[error("waited {0:?} for a conflicting byte-range lock")]
    Timeout(Duration),
    #[error("lock id {0} is in use")]
    DuplicateId(LockId),
}

/// Called with an inode as an exclusive lock on it is granted, before its holder can write:
/// what is cached of the file's bytes goes (`crate::smallfiles`).
pub type OnExclusive = Box<dyn Fn(u64) + Send + Sync>;

/// All byte-range locks of the server.
#[derive(Default, Clone)]
pub struct RangeLocks {
    inner: Arc<Mutex<HashMap<u64, InodeLocks>>>,
    on_exclusive: Arc<std::sync::OnceLock<OnExclusive>>,
}

impl std::fmt::Debug for RangeLocks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RangeLocks").finish_non_exhaustive()
    }
}

/// How often a waiting request looks for new holders in its way.
const RECHECK: Duration = Duration::from_millis(50);

impl RangeLocks {
    /// The held locks on `ino` that conflict with `span` in `mode`.
    fn holders_blocking(&self, ino: u64, req: &Lock) -> Vec<LockId> {
        self.lock().get(&ino).map_or_else(Vec::new, |locks| {
            locks
                .held
                .iter()
                .filter(|l| l.conflicts(req))
                .map(|l| l.id)
                .collect()
        })
    }

    pub fn new() -> RangeLocks {
        RangeLocks::default()
    }

    /// Sets what is called as an exclusive lock is granted ([`OnExclusive`]); only the
    /// first call takes effect.
    pub fn set_on_exclusive(&self, f: OnExclusive) -> bool {
        self.on_exclusive.set(f).is_ok()
    }

    /// An exclusive lock on `ino` was just granted (called under the table's lock, so its
    /// holder has not run yet).
    fn granted_exclusive(&self, ino: u64) {
        if let Some(f) = self.on_exclusive.get() {
            f(ino);
        }
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<u64, InodeLocks>> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes a lock, waiting at most `timeout` behind conflicting holders and earlier
    /// conflicting waiters. `on_blocked` is called once, before waiting, with the ids of the
    /// held locks that block the request (for recalls). Returns whether it had to wait.
    pub async fn acquire(
        &self,
        ino: u64,
        id: LockId,
        span: Span,
        mode: LockMode,
        timeout: Duration,
        on_blocked: impl Fn(Vec<LockId>),
    ) -> Result<bool, LockError> {
        self.acquire_as(ino, id, span, mode, Owner::SERVER, timeout, on_blocked)
            .await
    }

    /// Takes a delegation lock of `owner.session` on all of `ino` at once, or nothing: no
    /// waiting, and no recall of anything in its way (a delegation is an offer, refused when
    /// the file is in use elsewhere).
    pub fn try_delegate(&self, ino: u64, id: LockId, mode: LockMode, session: u64) -> bool {
        let mut all = self.lock();
        let locks = all.entry(ino).or_default();
        let lock = Lock {
            id,
            span: Span::new(0, u64::MAX),
            mode,
            owner: Owner {
                session,
                delegation: true,
            },
        };
        let taken = session != 0
            && !locks.held.iter().any(|l| l.id == id)
            && !locks.blocked(&lock)
            && !locks.waiting.iter().any(|w| w.lock.conflicts(&lock));
        if taken {
            if mode == LockMode::Exclusive {
                self.granted_exclusive(ino);
            }
            locks.held.push(lock);
        } else if locks.held.is_empty() && locks.waiting.is_empty() {
            all.remove(&ino);
        }
        taken
    }

    /// [`RangeLocks::acquire`] for `owner`: a session's own delegation does not block it,
    /// and it goes ahead of waiters that wait for that delegation.
    #[allow(
        clippy::too_many_arguments,
        reason = "the lock's identity and its wait"
    )]
    pub async fn acquire_as(
        &self,
        ino: u64,
        id: LockId,
        span: Span,
        mode: LockMode,
        owner: Owner,
        timeout: Duration,
        on_blocked: impl Fn(Vec<LockId>),
    ) -> Result<bool, LockError> {
        let rx = {
            let mut all = self.lock();
            let locks = all.entry(ino).or_default();
            if locks.held.iter().any(|l| l.id == id)
                || locks.waiting.iter().any(|w| w.lock.id == id)
            {
                return Err(LockError::DuplicateId(id));
            }
            let lock = Lock {
                id,
                span,
                mode,
                owner,
            };
            if !locks.blocked(&lock) {
                if mode == LockMode::Exclusive {
                    self.granted_exclusive(ino);
                }
                locks.held.push(lock);
                return Ok(false);
            }
            let blockers = locks
                .held
                .iter()
                .filter(|l| l.conflicts(&lock))
                .map(|l| l.id)
                .collect();
            let (tx, rx) = oneshot::channel();
            locks.waiting.push_back(Waiter { lock, wake: tx });
            drop(all);
            (rx, blockers)
        };
        let (mut rx, mut announced): (_, Vec<LockId>) = rx;
        on_blocked(announced.clone());
        let deadline = tokio::time::Instant::now() + timeout;
        let outcome = loop {
            let step = (deadline - tokio::time::Instant::now().min(deadline)).min(RECHECK);
            match tokio::time::timeout(step, &mut rx).await {
                Ok(r) => break r.is_ok(),
                Err(_) if tokio::time::Instant::now() >= deadline => break false,
                Err(_) => {
                    // Still waiting: announce holders that came since (granted earlier waiters).
                    let probe = Lock {
                        id,
                        span,
                        mode,
                        owner,
                    };
                    let fresh: Vec<LockId> = self
                        .holders_blocking(ino, &probe)
                        .into_iter()
                        .filter(|b| !announced.contains(b))
                        .collect();
                    if !fresh.is_empty() {
                        announced.extend(&fresh);
                        on_blocked(fresh);
                    }
                }
            }
        };
        match outcome {
            true => Ok(true),
            false => {
                // Withdraw, unless the lock was granted just as the wait ended.
                let mut all = self.lock();
                if let Some(locks) = all.get_mut(&ino) {
                    if locks.held.iter().any(|l| l.id == id) {
                        return Ok(true);
                    }
                    locks.waiting.retain(|w| w.lock.id != id);
                    // Our withdrawal may unblock later waiters.
                    if locks.wake_ready() {
                        self.granted_exclusive(ino);
                    }
                    if locks.held.is_empty() && locks.waiting.is_empty() {
                        all.remove(&ino);
                    }
                }
                Err(LockError::Timeout(timeout))
            }
        }
    }

    /// Releases a held lock; returns whether it was held.
    pub fn release(&self, ino: u64, id: LockId) -> bool {
        let mut all = self.lock();
        let Some(locks) = all.get_mut(&ino) else {
            return false;
        };
        let before = locks.held.len();
        locks.held.retain(|l| l.id != id);
        let found = locks.held.len() != before;
        if locks.wake_ready() {
            self.granted_exclusive(ino);
        }
        if locks.held.is_empty() && locks.waiting.is_empty() {
            all.remove(&ino);
        }
        found
    }

    /// The held locks of an inode as (id, start, end, exclusive): for status and tests.
    pub fn held(&self, ino: u64) -> Vec<(LockId, u64, u64, bool)> {
        self.lock()
            .get(&ino)
            .map(|l| {
                l.held
                    .iter()
                    .map(|l| {
                        (
                            l.id,
                            l.span.start,
                            l.span.end,
                            l.mode == LockMode::Exclusive,
                        )
                    })
                    .collect()
            })
            .unwrap_or_default()
    }

    /// How many requests wait, over all inodes.
    pub fn waiting(&self) -> usize {
        self.lock().values().map(|l| l.waiting.len()).sum()
    }

    /// The held locks that some waiting request conflicts with, over all inodes: the
    /// holders others wait for (the grant layer bounds how long, see eviction in
    /// [`crate::grants`]).
    pub fn holders_waited_on(&self) -> Vec<LockId> {
        self.lock()
            .values()
            .filter(|l| !l.waiting.is_empty())
            .flat_map(|l| {
                l.held
                    .iter()
                    .filter(|h| l.waiting.iter().any(|w| h.conflicts(&w.lock)))
            })
            .map(|h| h.id)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: Duration = Duration::from_secs(5);

    #[tokio::test]
    async fn every_exclusive_grant_is_announced_before_its_holder_runs() {
        let l = RangeLocks::new();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let s = Arc::clone(&seen);
        assert!(l.set_on_exclusive(Box::new(move |ino| {
            s.lock().unwrap_or_else(|p| p.into_inner()).push(ino);
        })));
        let got = || seen.lock().unwrap_or_else(|p| p.into_inner()).clone();
        // Shared locks are not announced; an exclusive one taken at once is.
        l.acquire(1, 1, Span::new(0, 10), LockMode::Shared, T, |_| {})
            .await
            .expect("shared");
        assert!(got().is_empty());
        l.acquire(2, 2, Span::new(0, 10), LockMode::Exclusive, T, |_| {})
            .await
            .expect("exclusive");
        assert_eq!(got(), vec![2]);
        // One that waited: announced when granted (at the release in its way), not before.
        let l2 = l.clone();
        let waiter = tokio::spawn(async move {
            l2.acquire(1, 3, Span::new(5, 10), LockMode::Exclusive, T, |_| {})
                .await
        });
        while l.waiting() == 0 {
            tokio::task::yield_now().await;
        }
        assert_eq!(got(), vec![2]);
        assert!(l.release(1, 1));
        assert_eq!(got(), vec![2, 1], "announced as the release granted it");
        waiter.await.expect("join").expect("granted");
        // A write delegation too.
        assert!(l.try_delegate(9, 4, LockMode::Exclusive, 5));
        assert!(l.try_delegate(8, 5, LockMode::Shared, 5));
        assert_eq!(got(), vec![2, 1, 9]);
    }

    #[tokio::test]
    async fn disjoint_ranges_do_not_wait() {
        let l = RangeLocks::new();
        assert!(
            !l.acquire(1, 1, Span::new(0, 100), LockMode::Exclusive, T, |_| {})
                .await
                .unwrap()
        );
        assert!(
            !l.acquire(1, 2, Span::new(100, 100), LockMode::Exclusive, T, |_| {})
                .await
                .unwrap()
        );
        assert!(
            !l.acquire(2, 3, Span::new(0, 100), LockMode::Exclusive, T, |_| {})
                .await
                .unwrap()
        );
        assert!(
            !l.acquire(1, 4, Span::new(300, 1), LockMode::Shared, T, |_| {})
                .await
                .unwrap()
        );
        assert!(
            !l.acquire(1, 5, Span::new(300, 1), LockMode::Shared, T, |_| {})
                .await
                .unwrap()
        );
        assert_eq!(l.held(1).len(), 4);
    }

    #[tokio::test]
    async fn a_waiter_hears_of_an_earlier_waiter_granted_while_it_waits() {
        let l = RangeLocks::new();
        l.acquire(1, 1, Span::new(0, 100), LockMode::Exclusive, T, |_| {})
            .await
            .unwrap();
        let reader = {
            let l = l.clone();
            tokio::spawn(async move {
                l.acquire(1, 2, Span::new(0, 100), LockMode::Shared, T, |_| {})
                    .await
            })
        };
        while l.waiting() == 0 {
            tokio::task::yield_now().await;
        }
        let (btx, brx) = std::sync::mpsc::channel();
        let writer = {
            let l = l.clone();
            tokio::spawn(async move {
                l.acquire(1, 3, Span::new(0, 100), LockMode::Exclusive, T, move |b| {
                    btx.send(b).unwrap();
                })
                .await
            })
        };
        while l.waiting() < 2 {
            tokio::task::yield_now().await;
        }
        assert_eq!(brx.recv().unwrap(), vec![1]);
        assert!(l.release(1, 1));
        assert!(reader.await.unwrap().unwrap());
        // The reader now holds the range: the writer is told, once, to recall it.
        let told = tokio::task::spawn_blocking(move || brx.recv_timeout(Duration::from_secs(5)));
        assert_eq!(told.await.unwrap().unwrap(), vec![2]);
        assert!(l.release(1, 2));
        assert!(writer.await.unwrap().unwrap());
    }

    #[tokio::test]
    async fn a_conflict_waits_until_release_and_is_told_who_blocks() {
        let l = RangeLocks::new();
        l.acquire(1, 1, Span::new(0, 100), LockMode::Shared, T, |_| {})
            .await
            .unwrap();
        let l2 = l.clone();
        let (btx, brx) = std::sync::mpsc::channel();
        let w = tokio::spawn(async move {
            l2.acquire(1, 2, Span::new(50, 100), LockMode::Exclusive, T, move |b| {
                btx.send(b).unwrap();
            })
            .await
        });
        while l.waiting() == 0 {
            tokio::task::yield_now().await;
        }
        assert_eq!(brx.recv().unwrap(), vec![1]);
        assert!(l.release(1, 1));
        assert!(w.await.unwrap().unwrap(), "had to wait");
        assert_eq!(l.held(1), vec![(2, 50, 150, true)]);
    }

    #[tokio::test]
    async fn readers_queue_behind_a_waiting_writer() {
        let l = RangeLocks::new();
        l.acquire(1, 1, Span::new(0, 10), LockMode::Shared, T, |_| {})
            .await
            .unwrap();
        let l2 = l.clone();
        let writer = tokio::spawn(async move {
            l2.acquire(1, 2, Span::new(0, 10), LockMode::Exclusive, T, |_| {})
                .await
        });
        while l.waiting() == 0 {
            tokio::task::yield_now().await;
        }
        // A new reader conflicts with the waiting writer: it must not overtake it.
        let l3 = l.clone();
        let reader = tokio::spawn(async move {
            l3.acquire(1, 3, Span::new(0, 10), LockMode::Shared, T, |_| {})
                .await
        });
        while l.waiting() < 2 {
            tokio::task::yield_now().await;
        }
        l.release(1, 1);
        writer.await.unwrap().unwrap();
        assert_eq!(l.held(1), vec![(2, 0, 10, true)]);
        l.release(1, 2);
        reader.await.unwrap().unwrap();
        assert_eq!(l.held(1), vec![(3, 0, 10, false)]);
    }

    fn own(session: u64) -> Owner {
        Owner::session(session)
    }

    #[tokio::test]
    async fn a_delegation_blocks_other_sessions_but_never_its_own() {
        let l = RangeLocks::new();
        assert!(l.try_delegate(7, 1, LockMode::Exclusive, 10));
        // The holder's own I/O passes, shared or exclusive.
        for (id, mode) in [(2, LockMode::Exclusive), (3, LockMode::Shared)] {
            let waited = l
                .acquire_as(7, id, Span::new(0, 4096), mode, own(10), T, |_| {})
                .await
                .unwrap();
            assert!(!waited);
            assert!(l.release(7, id));
        }
        // Another session's read waits, told of the delegation (to recall it).
        let told = std::sync::Mutex::new(Vec::new());
        let r = l
            .acquire_as(
                7,
                4,
                Span::new(8192, 10),
                LockMode::Shared,
                own(11),
                Duration::from_millis(200),
                |b| told.lock().unwrap().extend(b),
            )
            .await;
        assert_eq!(r, Err(LockError::Timeout(Duration::from_millis(200))));
        assert_eq!(*told.lock().unwrap(), vec![1]);
        // So does the server's own (a truncate), and a second delegation of anyone else.
        assert!(!l.try_delegate(7, 5, LockMode::Shared, 11));
        let server = l
            .acquire(
                7,
                6,
                Span::new(0, 1),
                LockMode::Exclusive,
                Duration::from_millis(50),
                |_| {},
            )
            .await;
        assert!(server.is_err());
        // Read delegations share.
        assert!(l.try_delegate(8, 7, LockMode::Shared, 10));
        assert!(l.try_delegate(8, 8, LockMode::Shared, 11));
        assert!(!l.try_delegate(8, 9, LockMode::Exclusive, 12));
        // Session 0 (the server) never holds one.
        assert!(!l.try_delegate(9, 10, LockMode::Shared, 0));
    }

    /// A request of the holder goes ahead of a waiter that waits for the holder's delegation:
    /// the holder writes its cached data back before it answers the recall, so a strict queue
    /// would wait for itself.
    #[tokio::test]
    async fn the_holder_goes_ahead_of_a_waiter_blocked_by_its_delegation() {
        let l = RangeLocks::new();
        assert!(l.try_delegate(7, 1, LockMode::Exclusive, 10));
        let l2 = l.clone();
        let reader = tokio::spawn(async move {
            l2.acquire_as(
                7,
                2,
                Span::new(0, 4096),
                LockMode::Shared,
                own(11),
                T,
                |_| {},
            )
            .await
        });
        while l.waiting() == 0 {
            tokio::task::yield_now().await;
        }
        // The holder writes back the very range the reader waits for: not queued behind it.
        let waited = l
            .acquire_as(
                7,
                3,
                Span::new(0, 4096),
                LockMode::Exclusive,
                own(10),
                T,
                |_| {},
            )
            .await
            .unwrap();
        assert!(!waited);
        // A third session's request still queues behind the waiting reader.
        let third = l
            .acquire_as(
                7,
                4,
                Span::new(0, 4096),
                LockMode::Exclusive,
                own(12),
                Duration::from_millis(50),
                |_| {},
            )
            .await;
        assert!(third.is_err());
        assert!(l.release(7, 3));
        // The recall is answered: the reader goes.
        assert!(l.release(7, 1));
        assert!(reader.await.unwrap().unwrap());
        assert!(l.release(7, 2));
    }

    #[tokio::test(start_paused = true)]
    async fn a_bounded_wait_fails_and_leaves_nothing_behind() {
        let l = RangeLocks::new();
        l.acquire(1, 1, Span::new(0, 10), LockMode::Exclusive, T, |_| {})
            .await
            .unwrap();
        let err = l
            .acquire(
                1,
                2,
                Span::new(5, 10),
                LockMode::Shared,
                Duration::from_millis(50),
                |_| {},
            )
            .await
            .unwrap_err();
        assert_eq!(err, LockError::Timeout(Duration::from_millis(50)));
        assert_eq!(l.waiting(), 0);
        assert_eq!(l.held(1), vec![(1, 0, 10, true)]);
        assert_eq!(
            l.acquire(1, 1, Span::new(20, 1), LockMode::Shared, T, |_| {})
                .await,
            Err(LockError::DuplicateId(1))
        );
        assert!(l.release(1, 1));
        assert!(!l.release(1, 1));
        assert!(l.held(1).is_empty());
    }

    /// Random lock traffic from several tasks: no two holders ever conflict.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn holders_never_conflict_under_random_traffic() {
        let seed: u64 = std::env::var("SANFS_LOCK_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(0x5eed_1234);
        eprintln!("lock traffic seed {seed} (SANFS_LOCK_SEED to replay)");
        let l = RangeLocks::new();
        let mut tasks = Vec::new();
        for t in 0..8u64 {
            let l = l.clone();
            tasks.push(tokio::spawn(async move {
                let mut x = seed ^ (t + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
                for i in 0..200u64 {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    let start = x % 1000;
                    let len = 1 + (x >> 20) % 100;
                    let mode = if (x >> 40).is_multiple_of(3) {
                        LockMode::Exclusive
                    } else {
                        LockMode::Shared
                    };
                    let id = t * 10_000 + i + 1;
                    l.acquire(
                        7,
                        id,
                        Span::new(start, len),
                        mode,
                        Duration::from_secs(30),
                        |_| {},
                    )
                    .await
                    .unwrap();
                    let held = l.held(7);
                    for (a, b) in held.iter().flat_map(|a| held.iter().map(move |b| (a, b))) {
                        if a.0 != b.0 && a.1 < b.2 && b.1 < a.2 {
                            assert!(!a.3 && !b.3, "conflicting holders {a:?} {b:?}");
                        }
                    }
                    tokio::task::yield_now().await;
                    assert!(l.release(7, id));
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        assert!(l.held(7).is_empty());
        assert_eq!(l.waiting(), 0);
    }

    #[tokio::test]
    async fn the_holders_waited_on_are_those_a_waiter_conflicts_with() {
        let l = RangeLocks::new();
        let ex = LockMode::Exclusive;
        l.acquire(1, 1, Span::new(0, 100), ex, T, |_| {})
            .await
            .unwrap();
        l.acquire(1, 2, Span::new(100, 100), ex, T, |_| {})
            .await
            .unwrap();
        l.acquire(2, 3, Span::new(0, 100), LockMode::Shared, T, |_| {})
            .await
            .unwrap();
        assert!(l.holders_waited_on().is_empty(), "nobody waits yet");
        let l2 = l.clone();
        let waiter =
            tokio::spawn(async move { l2.acquire(1, 4, Span::new(50, 10), ex, T, |_| {}).await });
        while l.waiting() == 0 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        assert_eq!(l.holders_waited_on(), vec![1]);
        assert!(l.release(1, 1));
        waiter.await.unwrap().unwrap();
        assert!(l.holders_waited_on().is_empty());
    }
}
