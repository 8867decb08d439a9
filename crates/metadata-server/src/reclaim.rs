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
use sanfs_proto::model::{ReplayOutcome, ReplayRecord};
use sanfs_proto::types::{FileType, InodeId};
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
