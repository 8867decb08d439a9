//! Cluster-wide POSIX advisory locks (fcntl, and flock as whole-file record locks): the
//! agent's side of the Locks service.
//!
//! The server holds the cluster's locks; the agent keeps a mirror of what its own owners hold
//! (the same POSIX rules, [`FileLocks`]) so that after a new session (a server restart, or a
//! lapsed lease) it can **reclaim** them: it opens each locked file again under the new
//! session and re-places every lock with `reclaim`, which the server grants during its grace
//! period before any new lock. A lock that cannot be reclaimed (another node took it while
//! this one was away) is lost: logged at ERROR and counted.
//!
//! F_SETLKW waits in slices of [`WAIT_SLICE_MS`] at the server; between slices the caller's
//! `interrupted` check runs (the FUSE layer looks for a signal pending on the waiting
//! process), so a wait can end with EINTR as it would on a local file system.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};

use sanfs_blockmap::advisory::{FileLocks, LockRecord};
use sanfs_proto::model::{FileLock, GetLockReply, HandleRef, LockRequest, LockType, OpenFlags};
use sanfs_proto::pb;
use sanfs_proto::pb::locks_client::LocksClient;
use sanfs_proto::types::{Credentials, FsError, InodeId};

use super::rpc::Pin;
use super::{Client, FileHandle, Inner};

/// How long one SetLock of an F_SETLKW waits at the server before the agent checks for a
/// signal and asks again.
pub const WAIT_SLICE_MS: u32 = 1000;

/// Whether a lock request waits for conflicting locks to go.
#[derive(Clone, Copy)]
pub enum LockWait<'a> {
    /// F_SETLK: a conflict is EAGAIN at once.
    No,
    /// F_SETLKW: waits until the lock is placed, or until the check says the waiting process
    /// was interrupted (EINTR).
    Until(&'a (dyn Fn() -> bool + Sync)),
}

/// What this agent holds on one inode.
#[derive(Debug, Default)]
struct Held {
    locks: FileLocks<u64>,
    /// The credentials of the last lock (a reclaim opens the file again with them).
    cred: Option<Credentials>,
    /// A handle opened by a reclaim, kept while locks are held (the server drops a
    /// session's locks on an inode when its last handle there closes).
    reclaim_handle: Option<FileHandle>,
}

/// The agent's mirror of its own locks, by inode.
#[derive(Debug, Default)]
pub(crate) struct LockMirror {
    files: Mutex<HashMap<InodeId, Held>>,
}

impl LockMirror {
    fn files(&self) -> MutexGuard<'_, HashMap<InodeId, Held>> {
        self.files.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records a change the server accepted; returns a reclaim handle that is no longer
    /// needed (the inode holds no lock of this agent any more).
    fn record(
        &self,
        cred: &Credentials,
        ino: InodeId,
        owner: u64,
        lock: &FileLock,
    ) -> Option<FileHandle> {
        let mut files = self.files();
        let held = files.entry(ino).or_default();
        match lock.typ {
            LockType::Lock(kind) => {
                held.cred = Some(cred.clone());
                // The server granted it, so nothing of this agent conflicts in a way that
                // matters; the mirror only tracks coverage per owner.
                let _ = held
                    .locks
                    .try_lock(owner, kind, lock.start, lock.end, lock.pid);
            }
            LockType::Unlock => {
                let _ = held.locks.unlock(&owner, lock.start, lock.end);
            }
        }
        Self::forget_if_empty(&mut files, ino)
    }

    fn drop_owner(&self, ino: InodeId, owner: u64) -> Option<FileHandle> {
        let mut files = self.files();
        if let Some(h) = files.get_mut(&ino) {
            h.locks.remove_owners(|o| *o == owner);
        }
        Self::forget_if_empty(&mut files, ino)
    }

    fn forget_if_empty(files: &mut HashMap<InodeId, Held>, ino: InodeId) -> Option<FileHandle> {
        if files.get(&ino).is_some_and(|h| h.locks.is_empty()) {
            return files.remove(&ino).and_then(|h| h.reclaim_handle);
        }
        None
    }

    /// Locks held now (for status and metrics).
    pub(crate) fn count(&self) -> usize {
        self.files().values().map(|h| h.locks.iter().count()).sum()
    }
}

fn request(
    cred: &Credentials,
    fh: &FileHandle,
    ino: InodeId,
    owner: u64,
    lock: FileLock,
    wait_ms: u32,
    reclaim: bool,
) -> pb::LockRequest {
    pb::LockRequest::from(LockRequest {
        cred: cred.clone(),
        handle: HandleRef {
            session: fh.session,
            handle: fh.handle,
        },
        inode: ino,
        owner,
        lock,
        wait_ms,
        reclaim,
    })
}

impl Inner {
    fn locks(&self) -> LocksClient<tonic::transport::Channel> {
        LocksClient::new(self.channel.clone())
    }

    async fn set_lock(&self, req: pb::LockRequest, fh: &FileHandle) -> Result<(), FsError> {
        self.call_unit("SetLock reply", Pin::Handle(fh), |_| {
            let mut locks = self.locks();
            let req = req.clone();
            async move { locks.set_lock(req).await }
        })
        .await
    }

    /// Closes a reclaim handle that no lock needs any more.
    async fn close_reclaim_handle(&self, fh: Option<FileHandle>) {
        if let Some(fh) = fh {
            self.before_release(&fh).await;
            let _ = self.release_handle(&fh).await;
        }
    }
}

impl Client {
    /// F_GETLK: the lock that keeps `owner` from placing `lock`, if any.
    pub async fn getlk(
        &self,
        cred: &Credentials,
        fh: &FileHandle,
        ino: InodeId,
        owner: u64,
        lock: FileLock,
    ) -> Result<Option<FileLock>, FsError> {
        let inner = &*self.inner;
        let req = request(cred, fh, ino, owner, lock, 0, false);
        let reply: GetLockReply = inner
            .call("GetLock reply", Pin::Handle(fh), |_| {
                let mut locks = inner.locks();
                let req = req.clone();
                async move { locks.get_lock(req).await }
            })
            .await?;
        Ok(reply.conflict)
    }

    /// F_SETLK ([`LockWait::No`]: EAGAIN on a conflict) or F_SETLKW ([`LockWait::Until`]:
    /// until placed, or EINTR once the check says so); also unlocks (`LockType::Unlock`).
    pub async fn setlk(
        &self,
        cred: &Credentials,
        fh: &FileHandle,
        ino: InodeId,
        owner: u64,
        lock: FileLock,
        wait: LockWait<'_>,
    ) -> Result<(), FsError> {
        let inner = &*self.inner;
        let (wait_ms, interrupted) = match wait {
            LockWait::Until(check) if matches!(lock.typ, LockType::Lock(_)) => {
                (WAIT_SLICE_MS, check)
            }
            _ => (0, &(|| false) as &(dyn Fn() -> bool + Sync)),
        };
        loop {
            let req = request(cred, fh, ino, owner, lock, wait_ms, false);
            match inner.set_lock(req, fh).await {
                Ok(()) => break,
                Err(FsError::WouldBlock) if wait_ms > 0 => {
                    if interrupted() {
                        return Err(FsError::Interrupted);
                    }
                }
                Err(e) => return Err(e),
            }
        }
        let unused = inner.locks_held.record(cred, ino, owner, &lock);
        inner.close_reclaim_handle(unused).await;
        Ok(())
    }

    /// Drops every lock of `owner` on `ino` (a close by that owner: POSIX drops a process's
    /// locks on a file when it closes any descriptor of it; flock's locks go with the last
    /// descriptor of their open file).
    pub async fn release_lock_owner(
        &self,
        cred: &Credentials,
        fh: &FileHandle,
        ino: InodeId,
        owner: u64,
    ) -> Result<(), FsError> {
        let inner = &*self.inner;
        let unused = inner.locks_held.drop_owner(ino, owner);
        let whole = FileLock {
            typ: LockType::Unlock,
            start: 0,
            end: u64::MAX,
            pid: 0,
        };
        let r = match inner.view_for(Some(fh)) {
            Ok(_) => {
                inner
                    .set_lock(request(cred, fh, ino, owner, whole, 0, false), fh)
                    .await
            }
            // The session that held them is gone, and its locks with it.
            Err(_) => Ok(()),
        };
        inner.close_reclaim_handle(unused).await;
        r
    }

    /// Advisory locks this agent holds now.
    pub fn locks_held(&self) -> usize {
        self.inner.locks_held.count()
    }
}

const READ_ONLY: OpenFlags = OpenFlags {
    read: true,
    write: false,
    append: false,
    truncate: false,
};
const WRITE_ONLY: OpenFlags = OpenFlags {
    read: false,
    write: true,
    append: false,
    truncate: false,
};

/// Opens `ino` under the current session (for a reclaim).
async fn open_again(
    inner: &Inner,
    cred: &Credentials,
    ino: InodeId,
    flags: OpenFlags,
) -> Result<FileHandle, FsError> {
    inner
        .open_handle(cred, ino, flags, 0)
        .await
        .map(|(fh, _)| fh)
}

/// After a new session: re-places every lock the mirror holds (see the module doc).
pub(super) async fn reclaim(inner: Arc<Inner>) {
    type Wanted = Vec<(InodeId, Credentials, Vec<LockRecord<u64>>)>;
    let wanted: Wanted = inner
        .locks_held
        .files()
        .iter_mut()
        .filter_map(|(ino, h)| {
            // The old reclaim handle died with the old session.
            h.reclaim_handle = None;
            let cred = h.cred.clone()?;
            let locks = h.locks.iter().copied().collect();
            Some((*ino, cred, locks))
        })
        .collect();
    if wanted.is_empty() {
        return;
    }
    let (mut kept, mut lost) = (0u64, 0u64);
    for (ino, cred, locks) in wanted {
        // Any open mode will do for the server; a file its owner may only write is opened so.
        let mut opened = open_again(&inner, &cred, ino, READ_ONLY).await;
        if opened == Err(FsError::Access) {
            opened = open_again(&inner, &cred, ino, WRITE_ONLY).await;
        }
        let fh = match opened {
            Ok(fh) => fh,
            Err(e) => {
                tracing::error!(%ino, error = %e, locks = locks.len(), "advisory locks lost: cannot open the file again");
                lost += locks.len() as u64;
                inner.locks_held.files().remove(&ino);
                continue;
            }
        };
        for LockRecord {
            owner,
            kind,
            start,
            end,
            pid,
        } in locks
        {
            let lock = FileLock {
                typ: LockType::Lock(kind),
                start,
                end,
                pid,
            };
            match inner
                .set_lock(request(&cred, &fh, ino, owner, lock, 0, true), &fh)
                .await
            {
                Ok(()) => kept += 1,
                Err(e) => {
                    tracing::error!(%ino, owner, start, end, error = %e, "advisory lock lost: another node holds it now");
                    lost += 1;
                    let mut files = inner.locks_held.files();
                    if let Some(h) = files.get_mut(&ino) {
                        let _ = h.locks.unlock(&owner, start, end);
                    }
                }
            }
        }
        let unused = {
            let mut files = inner.locks_held.files();
            match files.get_mut(&ino) {
                Some(h) if !h.locks.is_empty() => {
                    h.reclaim_handle = Some(fh);
                    None
                }
                _ => {
                    files.remove(&ino);
                    Some(fh)
                }
            }
        };
        inner.close_reclaim_handle(unused).await;
    }
    inner.counters.locks_lost.fetch_add(lost, Ordering::Relaxed);
    tracing::info!(kept, lost, "advisory locks reclaimed after a new session");
}
