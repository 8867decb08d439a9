//! The recovery of a start that frees space, run after the store is open: inodes unlinked
//! while open are reaped unless an agent opened them again in the reclaim window (a handle
//! of the last run does not survive; its agent reopens the file), and speculative preallocations are
//! trimmed past their files' ends. It is namespace and file-space work over the store, so it
//! lives above them; `store/` only opens the tables.
//!
//! The server opens with [`Store::open_deferring_recovery`] and runs
//! [`recover_after_restart`] once the reclaim window is over (agents replay completions into
//! blocks that it would free); tools and tests open and recover at once with [`Store::open`].

use redb::ReadableTable;
use sanfs_proto::types::InodeId;

use crate::clock::Clock;
use crate::store::{Backend, ORPHANS, Store, StoreError};

impl Store {
    /// Opens an existing store, starts its committer, and recovers it
    /// ([`recover_after_restart`]): orphans left by a crash are reaped and preallocations
    /// trimmed. A store not shut down cleanly is repaired by redb on the way; a damaged one
    /// on which the storage library fails is refused with [`StoreError::Damaged`], never a
    /// panic.
    pub fn open(backend: &Backend, clock: Clock, batch_max: usize) -> Result<Store, StoreError> {
        let store = Store::open_deferring_recovery(backend, clock, batch_max)?;
        recover_after_restart(&store)?;
        Ok(store)
    }

    /// [`recover_after_restart`] of this store.
    pub fn recover_after_restart(&self) -> Result<(), StoreError> {
        recover_after_restart(self)
    }
}

/// The recovery of a start that frees space: inodes unlinked while open are reaped, and
/// preallocations trimmed past their files' ends (no handle survives a restart).
/// Idempotent. Blocking.
pub fn recover_after_restart(store: &Store) -> Result<(), StoreError> {
    reap_orphans(store)?;
    trim_preallocations(store)
}

fn reap_orphans(store: &Store) -> Result<(), StoreError> {
    let orphans: Vec<u64> = store
        .snapshot(|r| {
            let t = r.open_table(ORPHANS)?;
            let mut all = Vec::new();
            for item in t.iter()? {
                all.push(item?.0.value());
            }
            Ok(all)
        })
        .map_err(|e| StoreError::Corrupt(e.to_string()))?;
    for ino in orphans {
        // An agent that held it open has opened it again in the reclaim window: it lives on
        // until that handle's release.
        if store.handles().is_open(ino) {
            tracing::info!(ino, "an inode unlinked while open is open again: kept");
            continue;
        }
        tracing::info!(
            ino,
            "reaping an inode unlinked while open before the last stop"
        );
        store
            .write_blocking(move |ctx| crate::ns::release_orphan(ctx, InodeId(ino)))
            .map_err(|e| StoreError::Corrupt(e.to_string()))?;
    }
    Ok(())
}

/// No handle survives a restart: every speculative preallocation left by the last run is
/// trimmed past its file's end.
fn trim_preallocations(store: &Store) -> Result<(), StoreError> {
    let freed = store
        .write_blocking(|ctx| {
            let mut all = Vec::new();
            for item in ctx.prealloc.iter()? {
                let (k, v) = item?;
                all.push((k.value(), v.value()));
            }
            let mut freed = 0;
            for (ino, (first, end)) in all {
                ctx.prealloc.remove(ino)?;
                freed += crate::space::trim_unwritten_past_eof(ctx, InodeId(ino), first, end)?;
            }
            Ok(freed)
        })
        .map_err(|e| StoreError::Corrupt(e.to_string()))?;
    if freed > 0 {
        tracing::info!(blocks = freed, "trimmed preallocation left by the last run");
    }
    Ok(())
}
