//! The reclaim window after a restart, and the replay of lazy completions.
//!
//! A write's Complete without `sync` is committed lazily (docs/protocol.md, "Durability of
//! completions"): the server answers before the conversion Unwritten -> Written and the new
//! size are durable, with the number of the commit that holds them (`commit_seq`). The agent
//! keeps a record of each such completion until the server reports that commit durable. If the
//! server stops first, the change is lost with it, but the data is on the LUNs and the agent
//! still has its record: it replays it to the next server epoch ([`replay_write`]).
//!
//! Replays must run before anything else changes the file system, so every start opens a
//! *reclaim window* ([`Reclaim`]) for the sessions the store recorded (the `sessions` table:
//! a session is written there durably at its first lazy completion, before that completion is
//! answered, and removed when it ends; sessions that never completed lazily are not waited
//! for). While it is open
//! the server answers only session calls, replays, completions, fsync and lock reclaims; new
//! grants, proxied I/O and every namespace call wait (server side) until it closes. Replays
//! end when every recorded session's agent has said `reclaim_complete`, or after the bound
//! (`ServiceParams::reclaim_grace_ms`), whichever comes first. Then the recovery that frees
//! space (orphans, preallocations past end of file) runs, since before the replays end it
//! could free blocks a replay needs, and only then does new work go ahead
//! ([`Reclaim::release`]): the recovery must not see what the new run did (it would trim a
//! preallocation just made for a write in flight, or reap a file unlinked while open now).
//! So every start has the gate, also without a recorded session (then it is only the
//! recovery's time).
//!
//! A replay is accepted only from a new session that names, as its previous session, one of
//! the recorded sessions that has not completed its reclaim, while the window is open
//! ([`Reclaim::authorize`]: the one place that decides who may replay; with transport identities
//! it will also compare the identity that opened the recorded session).

use std::collections::HashSet;
use std::sync::Mutex;

use sanfs_blockmap::plan::{PhysRun, PlanMethod, PlanOp, merge_runs, phys_runs, plan};
use sanfs_blockmap::volume::Volume;
use sanfs_proto::model::{
    CreateRequest, EntryRequest, LinkRequest, MkdirRequest, MknodRequest, RenameRequest,
    ReplayOutcome, ReplayRecord, SetAttrRequest, SetXattrRequest, SymlinkRequest, XattrRequest,
};
use sanfs_proto::types::{FileType, FsError, InodeId};
use tokio::sync::watch;

use crate::store::{Ctx, OpError};

/// The reclaim window of one server epoch: replays first, then the recovery, then new work.
#[derive(Debug)]
pub struct Reclaim {
    /// Recorded sessions of earlier runs whose agents have not completed their reclaim.
    waiting: Mutex<HashSet<u64>>,
    /// True while replays are accepted.
    replaying: watch::Sender<bool>,
    /// True until [`Reclaim::release`]: new work waits.
    open: watch::Sender<bool>,
}

impl Reclaim {
    /// A window for the sessions `previous` (none: no replays, only the gate until the
    /// recovery has run).
    pub fn new(previous: impl IntoIterator<Item = u64>) -> Reclaim {
        let waiting: HashSet<u64> = previous.into_iter().collect();
        let (replaying, _) = watch::channel(!waiting.is_empty());
        let (open, _) = watch::channel(true);
        Reclaim {
            waiting: Mutex::new(waiting),
            replaying,
            open,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashSet<u64>> {
        self.waiting.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether new work still waits (replays or the recovery after them are not done).
    pub fn is_open(&self) -> bool {
        *self.open.borrow()
    }

    /// Whether replays are still accepted.
    pub fn is_replaying(&self) -> bool {
        *self.replaying.borrow()
    }

    /// Resolves once new work may go ahead ([`Reclaim::release`]).
    pub async fn closed(&self) {
        let mut rx = self.open.subscribe();
        // An error means the sender is gone: nothing will ever open it again.
        let _ = rx.wait_for(|open| !*open).await;
    }

    /// Resolves once replays are over (every recorded agent done, or [`Reclaim::close`]).
    pub async fn replays_done(&self) {
        let mut rx = self.replaying.subscribe();
        let _ = rx.wait_for(|r| !*r).await;
    }

    /// Whether a replay naming `previous_session` is accepted now: replays are on and that
    /// recorded session has not completed its reclaim.
    pub fn authorize(&self, previous_session: u64) -> bool {
        self.is_replaying() && self.lock().contains(&previous_session)
    }

    /// The agent of `previous_session` has replayed everything. Ends the replays when it was
    /// the last one; answers whether it did.
    pub fn complete(&self, previous_session: u64) -> bool {
        let mut waiting = self.lock();
        if waiting.remove(&previous_session) && waiting.is_empty() {
            drop(waiting);
            self.close();
            return true;
        }
        false
    }

    /// Ends the replays (the bound ran out, or every agent is done). Returns the recorded
    /// sessions that never completed their reclaim. New work still waits for
    /// [`Reclaim::release`].
    pub fn close(&self) -> Vec<u64> {
        let left: Vec<u64> = self.lock().drain().collect();
        self.replaying.send_replace(false);
        left
    }

    /// The recovery has run: new work goes ahead.
    pub fn release(&self) {
        self.close();
        self.open.send_replace(false);
    }
}

/// Whether `record`'s commit is durable already: of the last run (`survived_commit.0`) and
/// numbered at most its last commit that survived the stop ([`crate::store::Store::survived`]).
pub fn survived(survived_commit: (u64, u64), record: &ReplayRecord) -> bool {
    record.epoch.0 == survived_commit.0 && record.commit_seq <= survived_commit.1
}

/// Replays one record in a store job: see [`ReplayOutcome`]. `survived` is the store's last
/// commit that survived the restart ([`crate::store::Store::survived`]): a record of that epoch
/// numbered at most that is durable already. Otherwise the record is replayed only if the file
/// still maps exactly the LUN bytes the agent wrote at those file offsets (Unwritten or
/// Written): the range becomes Written, the size grows to cover it, mtime and ctime are now.
/// Anything else (the file is gone or no longer regular, the range is a hole, other blocks are
/// there now) refuses it, with the reason.
pub fn replay_write(
    ctx: &mut Ctx<'_>,
    volume: &Volume,
    survived_commit: (u64, u64),
    record: &ReplayRecord,
) -> Result<(ReplayOutcome, Option<String>), OpError> {
    if survived(survived_commit, record) {
        return Ok((ReplayOutcome::Durable, None));
    }
    let refused = |why: String| Ok((ReplayOutcome::Refused, Some(why)));
    let ino = record.inode.0;
    let Some(rec) = ctx.t.try_inode(InodeId(ino))? else {
        return refused("the file is gone".into());
    };
    if rec.kind != FileType::Regular {
        return refused("not a regular file".into());
    }
    let (offset, len) = (record.range.offset(), record.range.len());
    let bs = u64::from(ctx.block_size);
    if !offset.is_multiple_of(bs) || !len.is_multiple_of(bs) {
        return refused(format!("{offset}+{len} is not block aligned"));
    }
    let map = ctx.t.extent_map(InodeId(ino))?;
    let now = match plan(
        PlanOp::Write,
        offset,
        len,
        &map,
        volume,
        PlanMethod::Coalesced,
    ) {
        Ok(p) => phys_runs(&p.device_ios),
        Err(e) => return refused(format!("the range no longer maps: {e}")),
    };
    let wrote = merge_runs(
        record
            .runs
            .iter()
            .map(|r| PhysRun {
                buf_off: r.file_off - offset,
                device: r.device,
                phys_off: r.phys_off,
                len: r.len,
            })
            .collect(),
    );
    if now != wrote {
        return refused("the file maps other blocks there now".into());
    }
    // As a completion by a non-root writer: set-id bits go, as the lost commit did.
    crate::data::complete_write(ctx, InodeId(ino), offset, len, false)?;
    Ok((ReplayOutcome::Replayed, None))
}

/// A namespace change an agent sends again to a restarted server (docs/protocol.md,
/// "Namespace changes before they are durable"): the request as it was first sent.
#[derive(Debug, Clone)]
pub enum NsChange {
    Create(CreateRequest),
    Mkdir(MkdirRequest),
    Mknod(MknodRequest),
    Symlink(SymlinkRequest),
    Link(LinkRequest),
    Unlink(EntryRequest),
    Rmdir(EntryRequest),
    Rename(RenameRequest),
    SetAttr(SetAttrRequest),
    SetXattr(SetXattrRequest),
    RemoveXattr(XattrRequest),
}

/// Whether a replayed change's commit `(epoch, commit_seq)` survived the restart.
pub fn change_survived(survived_commit: (u64, u64), epoch: u64, commit_seq: u64) -> bool {
    epoch == survived_commit.0 && commit_seq <= survived_commit.1
}

/// Applies a replayed namespace change in a store job, on the durable state it was first
/// made on (the changes a crash loses are one session's, replayed in their order: see
/// `store::committer::Job`). A change found already applied (a replay of an earlier
/// restart that became durable) answers [`ReplayOutcome::Durable`]: a create whose name
/// names the inode it made, a removal or rename whose name is gone, a link whose name is
/// there. A create gets the inode number and generation it was answered (`inode`); the
/// handle a replayed create opens is closed again at once (the agent opens its files again
/// itself). An error is the replay's answer: the change is lost.
pub fn replay_change(
    ctx: &mut Ctx<'_>,
    change: &NsChange,
    inode: Option<(InodeId, u64)>,
) -> Result<ReplayOutcome, OpError> {
    use crate::ns;
    ctx.replaying = true;
    let named = |ctx: &Ctx<'_>, parent: InodeId, name: &[u8]| -> Result<Option<InodeId>, OpError> {
        Ok(ctx.t.dirent(parent, name)?.map(|(child, _, _)| child))
    };
    let gone = |now: Option<InodeId>| match (now, inode) {
        (None, _) => true,
        (Some(child), Some((ino, _))) => child != ino,
        (Some(_), None) => false,
    };
    // A create: already there (the name names its inode), or made now with its number.
    let make = |ctx: &mut Ctx<'_>,
                parent: InodeId,
                name: &[u8],
                run: &dyn Fn(&mut Ctx<'_>) -> Result<(), OpError>|
     -> Result<ReplayOutcome, OpError> {
        let Some((ino, generation)) = inode else {
            return Err(OpError::Fs(FsError::Invalid(
                "a replayed create must give the inode it made".into(),
            )));
        };
        match named(ctx, parent, name)? {
            Some(child) if child == ino => Ok(ReplayOutcome::Durable),
            Some(_) => Err(OpError::Fs(FsError::Exists)),
            None => {
                ctx.forced_inode = Some((ino.0, generation));
                run(ctx)?;
                Ok(ReplayOutcome::Replayed)
            }
        }
    };
    match change {
        NsChange::Create(r) => make(ctx, r.parent, r.name.as_bytes(), &|ctx| {
            let reply = ns::create(ctx, r)?;
            ctx.st
                .handles
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .release(reply.handle.0);
            Ok(())
        }),
        NsChange::Mkdir(r) => make(ctx, r.parent, r.name.as_bytes(), &|ctx| {
            ns::mkdir(ctx, r).map(drop)
        }),
        NsChange::Mknod(r) => make(ctx, r.parent, r.name.as_bytes(), &|ctx| {
            ns::mknod(ctx, r).map(drop)
        }),
        NsChange::Symlink(r) => make(ctx, r.parent, r.name.as_bytes(), &|ctx| {
            ns::symlink(ctx, r).map(drop)
        }),
        NsChange::Link(r) => {
            if named(ctx, r.new_parent, r.new_name.as_bytes())? == Some(r.inode) {
                return Ok(ReplayOutcome::Durable);
            }
            ns::link(ctx, r)?;
            Ok(ReplayOutcome::Replayed)
        }
        // Gone already: the name is absent, or (when the agent says which inode it changed:
        // a change it answered itself, never answered by the old server) names another inode,
        // made after the change.
        NsChange::Unlink(r) | NsChange::Rmdir(r) => {
            if gone(named(ctx, r.parent, r.name.as_bytes())?) {
                return Ok(ReplayOutcome::Durable);
            }
            ns::unlink(ctx, r, matches!(change, NsChange::Rmdir(_)))?;
            Ok(ReplayOutcome::Replayed)
        }
        NsChange::Rename(r) => {
            if gone(named(ctx, r.old_parent, r.old_name.as_bytes())?) {
                return Ok(ReplayOutcome::Durable);
            }
            ns::rename(ctx, r)?;
            Ok(ReplayOutcome::Replayed)
        }
        NsChange::SetAttr(r) => {
            ns::setattr(ctx, r)?;
            Ok(ReplayOutcome::Replayed)
        }
        NsChange::SetXattr(r) => {
            ns::setxattr(ctx, r)?;
            Ok(ReplayOutcome::Replayed)
        }
        NsChange::RemoveXattr(r) => match ns::removexattr(ctx, r) {
            Err(OpError::Fs(FsError::NoAttr)) => Ok(ReplayOutcome::Durable),
            other => other.map(|()| ReplayOutcome::Replayed),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_window_closes_when_the_last_recorded_session_completes() {
        let r = Reclaim::new([7, 9]);
        assert!(r.is_open());
        assert!(r.authorize(7) && r.authorize(9));
        assert!(!r.authorize(8), "a session that was not recorded");
        assert!(!r.complete(7));
        assert!(!r.authorize(7), "a completed reclaim cannot replay again");
        assert!(r.is_open());
        assert!(r.complete(9));
        assert!(!r.is_replaying() && !r.authorize(9));
        r.replays_done().await;
        assert!(
            r.is_open(),
            "new work waits for the recovery after the replays"
        );
        r.release();
        assert!(!r.is_open());
        r.closed().await;
    }

    #[tokio::test]
    async fn without_recorded_sessions_only_the_recovery_gates_and_the_bound_ends_replays() {
        let none = Reclaim::new([]);
        assert!(!none.is_replaying() && none.is_open());
        none.replays_done().await;
        none.release();
        none.closed().await;
        let r = Reclaim::new([1, 2]);
        assert!(!r.complete(3) && r.is_open() && r.is_replaying());
        let mut left = r.close();
        left.sort_unstable();
        assert_eq!(left, vec![1, 2]);
        assert!(!r.authorize(1) && r.is_open());
        r.release();
        assert!(!r.is_open());
    }
}
