//! Handles released with a later call (docs/protocol.md "Handles released with a later
//! call").
//!
//! A close that leaves nothing to send first (no bytes or attribute changes held back, no
//! write completion in flight, no cached grant, no lock) does not cost a `Release` of its
//! own: the handle is queued here, answered at once on FUSE's thread, and released by the
//! server with this agent's next `Create` (its `sanfs-release` header), or by one `Release`
//! that carries the queue after [`RELEASE_LINGER`]. A `tar x` or a loop of creates then makes
//! one call per file where it made two, and a loop of opens and closes one per batch.
//!
//! What waits meanwhile is only what a release ends at the server: the handle stays open
//! there up to [`RELEASE_LINGER`] longer (an unlinked file's blocks are freed that much
//! later; another node's open of the file may recall a delegation this node no longer uses,
//! which it answers at once). Handles of a replaced session are dropped (the server forgot
//! them with the session).

use std::time::Duration;

use sanfs_proto::headers::MAX_RELEASE;
use sanfs_proto::model::HandleRef;
use sanfs_proto::pb;
use sanfs_proto::types::{ByteRange, FsError, MAX_FILE_SIZE, OpenHandle, SessionId};

use super::rpc::Pin;
use super::{Client, FileHandle, Inner, is_stale};

/// How long a queued release waits for a call to ride with before it is sent by itself.
pub const RELEASE_LINGER: Duration = Duration::from_millis(5);

/// Handles closed on this node and not released at the server yet.
#[derive(Debug, Default)]
pub(crate) struct Releases {
    session: Option<SessionId>,
    handles: Vec<u64>,
    /// A flush after [`RELEASE_LINGER`] is on its way.
    armed: bool,
}

impl Releases {
    /// Queues `fh`; whether the caller must arm the flush (see [`Client::release_later`]).
    fn queue(&mut self, fh: &FileHandle) -> bool {
        if self.session != Some(fh.session) {
            // The older session's handles are gone at the server already.
            self.handles.clear();
            self.session = Some(fh.session);
        }
        self.handles.push(fh.handle.0);
        let arm = !self.armed;
        self.armed = true;
        arm
    }

    /// Takes up to [`MAX_RELEASE`] queued handles of `session` that `ready` accepts, in
    /// order; the others stay queued.
    fn take_ready(&mut self, session: SessionId, ready: impl Fn(u64) -> bool) -> Vec<u64> {
        if self.session != Some(session) {
            self.handles.clear();
            return Vec::new();
        }
        let mut taken = Vec::new();
        self.handles.retain(|h| {
            let take = taken.len() < MAX_RELEASE && ready(*h);
            if take {
                taken.push(*h);
            }
            !take
        });
        taken
    }

    /// Takes up to [`MAX_RELEASE`] queued handles of `session` (dropping a replaced
    /// session's).
    fn take(&mut self, session: SessionId) -> Vec<u64> {
        if self.session != Some(session) {
            self.handles.clear();
            return Vec::new();
        }
        let n = self.handles.len().min(MAX_RELEASE);
        self.handles.drain(..n).collect()
    }
}

impl Inner {
    fn lock_releases(&self) -> std::sync::MutexGuard<'_, Releases> {
        self.releases.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Handles to release with a call of `session` (its `sanfs-release` header), when the
    /// server takes them there.
    pub(crate) fn releases_for_call(&self, session: SessionId) -> Vec<u64> {
        if !self.lock_state().view.server.releases_with_changes {
            return Vec::new();
        }
        self.lock_releases().take(session)
    }
}

impl Inner {
    /// Handles to release with a batch of changes answered here (`CreateBatch`,
    /// `ChangeBatch`) of `session`: those the server knows, so not of a create answered
    /// here that the server has not answered yet (which may be in this very batch: the
    /// server releases the header's handles before the call's changes).
    pub(crate) fn releases_for_batch(&self, session: SessionId) -> Vec<u64> {
        if !self.lock_state().view.server.releases_with_changes {
            return Vec::new();
        }
        self.lock_releases().take_ready(
            session,
            |h| match sanfs_proto::model::reserved_create_inode(h) {
                Some(ino) => !self.creates.unanswered(ino),
                None => true,
            },
        )
    }
}

impl Client {
    /// Releases `fh` without waiting, when nothing of its file must reach the server before
    /// the release (see the module doc): the handle is queued and `Some(arm)` answered, where
    /// `arm` asks the caller to run [`Client::flush_releases_later`]; `None` when the caller
    /// must [`Client::release`] it.
    pub fn release_later(&self, fh: &FileHandle) -> Option<bool> {
        let inner = &self.inner;
        if !inner.lock_state().view.server.releases_with_changes {
            return None;
        }
        // As `release` does (`Inner::before_release`), without anything to wait for.
        {
            let mut open = inner.open_handles.lock().unwrap_or_else(|e| e.into_inner());
            let key = (fh.session, fh.handle);
            let ino = *open.get(&key)?;
            let last = !super::data::grants::others_open(&open, fh, ino);
            if last {
                let whole = ByteRange::new(0, MAX_FILE_SIZE).ok()?;
                let in_flight = inner
                    .lock_behind()
                    .get(&ino)
                    .is_some_and(|b| b.in_flight > 0);
                if in_flight
                    || inner.writeback.unsettled(ino)
                    || inner.cache.overlaps(ino, whole, None)
                {
                    return None;
                }
            }
            open.remove(&key);
            if last {
                self.forget_delegation(ino);
            }
        }
        Some(inner.lock_releases().queue(fh))
    }

    /// After [`RELEASE_LINGER`], sends what is still queued (a call that went meanwhile took
    /// the rest).
    pub async fn flush_releases_later(&self) {
        tokio::time::sleep(RELEASE_LINGER).await;
        self.flush_releases().await;
    }

    /// Sends every queued release now: one `Release` per [`MAX_RELEASE`] handles, the first
    /// named by the request and the others by its `sanfs-release` header.
    pub async fn flush_releases(&self) {
        loop {
            let (session, handles) = {
                let mut r = self.inner.lock_releases();
                let Some(session) = r.session else {
                    r.armed = false;
                    return;
                };
                let handles = r.take(session);
                if handles.is_empty() {
                    r.armed = false;
                    return;
                }
                (session, handles)
            };
            if let Err(e) = self.inner.release_many(session, &handles).await
                && !is_stale(&e)
            {
                tracing::warn!(error = %e, handles = handles.len(), "releasing closed handles failed");
            }
        }
    }
}

impl Inner {
    /// One `Release` of `handles` (the first by the request, the rest by its header).
    async fn release_many(&self, session: SessionId, handles: &[u64]) -> Result<(), FsError> {
        let Some((first, rest)) = handles.split_first() else {
            return Ok(());
        };
        let fh = FileHandle {
            session,
            handle: OpenHandle(*first),
        };
        let req = pb::ReleaseRequest::from(HandleRef {
            session,
            handle: fh.handle,
        });
        self.call_unit("Release reply", Pin::Handle(&fh), |_| {
            let mut ns = self.ns();
            let mut req = tonic::Request::new(req);
            sanfs_proto::headers::set_release(req.metadata_mut(), session, rest);
            async move { ns.release(req).await }
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fh(session: u64, handle: u64) -> FileHandle {
        FileHandle {
            session: SessionId(session),
            handle: OpenHandle(handle),
        }
    }

    #[test]
    fn the_queue_arms_once_takes_in_order_and_drops_a_replaced_session() {
        let mut r = Releases::default();
        assert!(r.queue(&fh(1, 10)));
        assert!(!r.queue(&fh(1, 11)));
        assert_eq!(r.take(SessionId(1)), vec![10, 11]);
        assert!(r.take(SessionId(1)).is_empty());
        // A new session's first close forgets the old session's handles.
        r.armed = false;
        assert!(r.queue(&fh(1, 12)));
        assert!(!r.queue(&fh(2, 5)));
        assert_eq!(r.take(SessionId(2)), vec![5]);
        // A call under another session than the queue's takes nothing and clears it.
        assert!(!r.queue(&fh(2, 6)));
        assert!(r.take(SessionId(3)).is_empty());
        assert!(r.handles.is_empty());
        // At most MAX_RELEASE a call.
        for h in 0..(MAX_RELEASE as u64 + 5) {
            r.queue(&fh(4, h + 1));
        }
        assert_eq!(r.take(SessionId(4)).len(), MAX_RELEASE);
        assert_eq!(r.take(SessionId(4)).len(), 5);
    }

    #[test]
    fn a_batch_takes_only_the_handles_the_server_knows_and_leaves_the_others_in_order() {
        let mut r = Releases::default();
        for h in [10, 11, 12, 13] {
            r.queue(&fh(1, h));
        }
        // 11 and 13 stand for creates the server has not answered yet.
        let known = |h: u64| h.is_multiple_of(2);
        assert_eq!(r.take_ready(SessionId(1), known), vec![10, 12]);
        assert_eq!(r.handles, vec![11, 13]);
        assert!(r.take_ready(SessionId(1), known).is_empty());
        assert_eq!(r.take(SessionId(1)), vec![11, 13]);
        // At most MAX_RELEASE, the rest kept.
        for h in 0..(MAX_RELEASE as u64 + 3) {
            r.queue(&fh(1, h * 2));
        }
        assert_eq!(r.take_ready(SessionId(1), known).len(), MAX_RELEASE);
        assert_eq!(r.handles.len(), 3);
        assert!(r.take_ready(SessionId(2), known).is_empty());
        assert!(
            r.handles.is_empty(),
            "another session's call drops the queue"
        );
    }
}
