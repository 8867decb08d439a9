//! Cluster-wide POSIX advisory locks: the server's side of `fcntl(F_SETLK/F_SETLKW/F_GETLK)`
//! and of `flock`, which agents send as whole-file record locks (as NFS does).
//!
//! One [`FileLocks`] table (blockmap's POSIX rules) per inode, in memory: an owner is an agent
//! session and the agent's lock owner, so every node sees every other node's locks. Locks are
//! not durable: they go with their session (lease expiry, close, or the session's last handle
//! on the inode), and a restarted server starts empty with a **grace period** (lease TTL plus a
//! margin) in which only reclaims are granted, so that agents re-establish what they held before
//! anyone else can take it. A waiter (F_SETLKW) waits on a per-inode change counter, in bounded
//! slices the agent repeats.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use sanfs_blockmap::advisory::{FileLocks, LockKind, LockRecord};
use sanfs_proto::types::FsError;
use tokio::sync::watch;
use tokio::time::Instant;

/// Who holds a lock, cluster-wide.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Owner {
    pub session: u64,
    pub owner: u64,
}

#[derive(Debug)]
struct FileEntry {
    locks: FileLocks<Owner>,
    /// Bumped on every change that can let a waiter through.
    changed: watch::Sender<u64>,
}

impl FileEntry {
    fn new() -> FileEntry {
        FileEntry {
            locks: FileLocks::new(),
            changed: watch::Sender::new(0),
        }
    }

    fn bump(&self) {
        self.changed.send_modify(|v| *v = v.wrapping_add(1));
    }
}

/// Every inode's advisory locks.
#[derive(Debug)]
pub struct AdvisoryLocks {
    files: Mutex<HashMap<u64, FileEntry>>,
    grace_until: Instant,
}

/// What a SetLock asks for.
#[derive(Debug, Clone, Copy)]
pub struct SetLock {
    pub owner: Owner,
    /// `None` unlocks.
    pub kind: Option<LockKind>,
    pub start: u64,
    pub end: u64,
    pub pid: u32,
    pub wait: Duration,
    pub reclaim: bool,
}

impl AdvisoryLocks {
    /// A table whose grace period lasts `grace` from now.
    pub fn new(grace: Duration) -> AdvisoryLocks {
        AdvisoryLocks {
            files: Mutex::new(HashMap::new()),
            grace_until: Instant::now() + grace,
        }
    }

    fn files(&self) -> MutexGuard<'_, HashMap<u64, FileEntry>> {
        self.files.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether new (non-reclaim) locks still wait for reclaims.
    pub fn in_grace(&self) -> bool {
        Instant::now() < self.grace_until
    }

    /// F_GETLK: the lock that keeps `owner` from locking `[start, end]` as `kind`, if any.
    pub fn test(
        &self,
        ino: u64,
        owner: Owner,
        kind: LockKind,
        start: u64,
        end: u64,
    ) -> Option<LockRecord<Owner>> {
        self.files()
            .get(&ino)
            .and_then(|f| f.locks.conflict(&owner, kind, start, end).cloned())
    }

    /// F_SETLK, or one bounded wait of F_SETLKW (`req.wait`): places the lock, or unlocks.
    /// A conflict still there when the wait ends is `WouldBlock`. During the grace period a
    /// new lock waits for the period's end (reclaims go ahead).
    pub async fn set(&self, ino: u64, req: SetLock) -> Result<(), FsError> {
        let deadline = Instant::now() + req.wait;
        loop {
            let (mut changed, in_grace) = {
                let mut files = self.files();
                let Some(kind) = req.kind else {
                    if let Some(f) = files.get_mut(&ino) {
                        f.locks
                            .unlock(&req.owner, req.start, req.end)
                            .map_err(|e| FsError::Invalid(e.to_string()))?;
                        f.bump();
                        if f.locks.is_empty() && f.changed.receiver_count() == 0 {
                            files.remove(&ino);
                        }
                    }
                    return Ok(());
                };
                let f = files.entry(ino).or_insert_with(FileEntry::new);
                let in_grace = !req.reclaim && self.in_grace();
                if !in_grace {
                    match f
                        .locks
                        .try_lock(req.owner, kind, req.start, req.end, req.pid)
                        .map_err(|e| FsError::Invalid(e.to_string()))?
                    {
                        Ok(()) => return Ok(()),
                        Err(_) if Instant::now() >= deadline => {
                            if f.locks.is_empty() && f.changed.receiver_count() == 0 {
                                files.remove(&ino);
                            }
                            return Err(FsError::WouldBlock);
                        }
                        Err(_) => {}
                    }
                }
                (f.changed.subscribe(), in_grace)
            };
            // In grace every new lock waits for its end, whatever it asked to wait.
            let until = if in_grace { self.grace_until } else { deadline };
            if tokio::time::timeout_at(until, changed.changed())
                .await
                .is_err()
                && !in_grace
            {
                // Timed out: one last try above answers WouldBlock or takes the lock.
                continue;
            }
        }
    }

    /// Drops `owner`'s locks on `ino` (a close by that owner, or flock's release).
    pub fn release_owner(&self, ino: u64, owner: Owner) {
        self.remove(|i, o| i == ino && *o == owner);
    }

    /// Drops every lock of `session` on `ino` (its last handle there closed).
    pub fn release_session_inode(&self, session: u64, ino: u64) {
        self.remove(|i, o| i == ino && o.session == session);
    }

    /// Drops every lock of `session` (it ended or expired).
    pub fn release_session(&self, session: u64) {
        self.remove(|_, o| o.session == session);
    }

    fn remove(&self, mut which: impl FnMut(u64, &Owner) -> bool) {
        let mut files = self.files();
        files.retain(|&ino, f| {
            if f.locks.remove_owners(|o| which(ino, o)) > 0 {
                f.bump();
            }
            !(f.locks.is_empty() && f.changed.receiver_count() == 0)
        });
    }

    /// Locks held now (for status and metrics).
    pub fn held(&self) -> usize {
        self.files().values().map(|f| f.locks.iter().count()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: Owner = Owner {
        session: 1,
        owner: 7,
    };
    const B: Owner = Owner {
        session: 2,
        owner: 7,
    };

    fn lock(owner: Owner, kind: LockKind, wait_ms: u64) -> SetLock {
        SetLock {
            owner,
            kind: Some(kind),
            start: 0,
            end: u64::MAX,
            pid: 42,
            wait: Duration::from_millis(wait_ms),
            reclaim: false,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiter_gets_the_lock_when_the_holder_lets_go() {
        let locks = std::sync::Arc::new(AdvisoryLocks::new(Duration::ZERO));
        locks.set(1, lock(A, LockKind::Write, 0)).await.unwrap();
        // Same owner number, other session: another node's process.
        assert_eq!(
            locks.set(1, lock(B, LockKind::Read, 0)).await,
            Err(FsError::WouldBlock)
        );
        assert_eq!(
            locks.test(1, B, LockKind::Read, 5, 5).map(|r| r.pid),
            Some(42)
        );
        let waiter = {
            let locks = locks.clone();
            tokio::spawn(async move { locks.set(1, lock(B, LockKind::Read, 10_000)).await })
        };
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!waiter.is_finished());
        locks.release_session(1);
        waiter.await.unwrap().unwrap();
        assert_eq!(locks.held(), 1);
        // A bounded wait that nobody ends answers WouldBlock.
        assert_eq!(
            locks.set(1, lock(A, LockKind::Write, 500)).await,
            Err(FsError::WouldBlock)
        );
        locks.release_owner(1, B);
        assert_eq!(locks.held(), 0);
        assert!(
            locks.files().is_empty(),
            "no table left for a lock-free inode"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn in_grace_only_reclaims_go_ahead() {
        let locks = AdvisoryLocks::new(Duration::from_secs(3));
        let start = Instant::now();
        locks
            .set(
                1,
                SetLock {
                    reclaim: true,
                    ..lock(A, LockKind::Write, 0)
                },
            )
            .await
            .unwrap();
        assert!(Instant::now() - start < Duration::from_millis(10));
        // A new lock, even a non-blocking one, waits for the grace period to end, then sees
        // the reclaimed lock.
        assert_eq!(
            locks.set(1, lock(B, LockKind::Write, 0)).await,
            Err(FsError::WouldBlock)
        );
        assert!(Instant::now() - start >= Duration::from_secs(3));
        locks.set(2, lock(B, LockKind::Write, 0)).await.unwrap();
    }
}
