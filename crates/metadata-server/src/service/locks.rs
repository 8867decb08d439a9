//! The Locks service: cluster-wide POSIX advisory locks over [`crate::advisory`].
//!
//! A request names an open handle of its session on the inode; its owner is the session and
//! the agent's lock owner.

use std::sync::Arc;
use std::time::Duration;

use sanfs_proto::model::{FileLock, GetLockReply, LockRequest, LockType};
use sanfs_proto::pb;
use sanfs_proto::pb::locks_server::Locks;
use sanfs_proto::types::FsError;
use tonic::{Request, Response, Status};

use super::identity::caller;
use super::{Server, accept, fs_status, note, rpc};
use crate::advisory::{Owner, SetLock};

/// The Locks service over the shared server.
#[derive(Debug, Clone)]
pub struct LocksService {
    server: Arc<Server>,
}

impl LocksService {
    pub fn new(server: Arc<Server>) -> LocksService {
        LocksService { server }
    }
}

fn owner(req: &LockRequest) -> Owner {
    Owner {
        session: req.handle.session.0,
        owner: req.owner,
    }
}

#[tonic::async_trait]
impl Locks for LocksService {
    async fn get_lock(
        &self,
        request: Request<pb::LockRequest>,
    ) -> Result<Response<pb::GetLockReply>, Status> {
        rpc("GetLock", async {
            let who = caller(&request)?;
            let req: LockRequest = accept(request)?;
            note(Some(req.handle.session.0), Some(req.inode.0));
            self.server
                .check_handle(&who, &req.handle, req.inode, false)?;
            let LockType::Lock(kind) = req.lock.typ else {
                return Err(fs_status(&FsError::Invalid(
                    "GetLock asks about a read or write lock".into(),
                )));
            };
            let conflict = self
                .server
                .advisory
                .test(req.inode.0, owner(&req), kind, req.lock.start, req.lock.end)
                .map(|r| FileLock {
                    typ: LockType::Lock(r.kind),
                    start: r.start,
                    end: r.end,
                    pid: r.pid,
                });
            Ok(GetLockReply { conflict }.into())
        })
        .await
    }

    async fn set_lock(
        &self,
        request: Request<pb::LockRequest>,
    ) -> Result<Response<pb::SetLockReply>, Status> {
        rpc("SetLock", async {
            let who = caller(&request)?;
            let req: LockRequest = accept(request)?;
            note(Some(req.handle.session.0), Some(req.inode.0));
            let kind = match req.lock.typ {
                LockType::Lock(k) => Some(k),
                LockType::Unlock => None,
            };
            // No open-mode check: the kernel refuses an F_WRLCK on a descriptor not open for
            // writing itself, and flock's LOCK_EX (which arrives as a write lock) needs none.
            self.server
                .check_handle(&who, &req.handle, req.inode, false)?;
            if kind.is_some() {
                self.server
                    .mark_locks_in_use()
                    .await
                    .map_err(|e| fs_status(&e))?;
            }
            let set = SetLock {
                owner: owner(&req),
                kind,
                start: req.lock.start,
                end: req.lock.end,
                pid: req.lock.pid,
                wait: Duration::from_millis(u64::from(req.wait_ms)),
                reclaim: req.reclaim,
            };
            self.server
                .advisory
                .set(req.inode.0, set)
                .await
                .map_err(|e| fs_status(&e))?;
            // The session may have ended while the lock was awaited: its locks went with it,
            // and this one must not outlive it.
            if let Err(e) = self.server.check_session(&who, req.handle.session) {
                self.server.advisory.release_owner(req.inode.0, set.owner);
                return Err(e);
            }
            Ok(pb::SetLockReply {})
        })
        .await
    }
}
