//! File data in the kernel's page cache (issue 18; docs/posix.md "Caching and coherence").
//!
//! A file opened **for reading only**, without `O_DIRECT`, or for plain buffered reading and
//! writing (`page_cached_open`), is opened in the kernel's cached mode: its reads are served
//! from the page cache, and the kernel reads ahead of them in requests of up to 1 MiB, which
//! the agent answers as any buffered read (from its read cache under a delegation, or from
//! the LUNs); its writes go through the pages to the agent at once (write-through), and the
//! pages keep them. Every other open keeps `FOPEN_DIRECT_IO` (a plain `O_DIRECT` one goes
//! through the kernel's direct-I/O path instead, which bypasses the pages too).
//!
//! **Why the cached pages are never stale.** The mount asks for `FUSE_AUTO_INVAL_DATA`: before
//! every `read(2)` on a cached file the kernel makes sure its attributes are valid (a
//! `GETATTR` when they are not) and drops the file's pages when a new size or mtime
//! arrives. The kernel holds attributes as valid only under this node's attribute lease on
//! the inode (`client::leases`: TTL at most to the lease's end, and a recall invalidates the
//! kernel's attributes before it is acknowledged), and the server recalls the lease before
//! any other session changes the file's data: a write grant or layout, a proxied write, a
//! write delegation, a truncate or fallocate (`recall_attr_leases`). So a `read(2)` that
//! starts after another node's change was answered asks for the attributes again, and
//! the change's new mtime or size drops the pages. Two gaps are closed here:
//!
//! - **A change that leaves size and mtime as they were** (data rewritten in place, then
//!   the old mtime set back with `utimensat`, as `cp -p` or `rsync` may do): its ctime moved.
//!   [`KernelPages`] keeps the size, mtime and ctime the kernel was last given by a
//!   `GETATTR` or an open; a `GETATTR` answer whose ctime moved while size and mtime did not
//!   drops the pages first ([`KernelPages::invalidate`]), and any other answer that carries
//!   such attributes gives them with TTL 0, so that the next `read(2)` asks.
//! - **This node's own writes**, which the kernel does not see in the pages of a cached
//!   handle (they go through other handles in direct mode) and which may be held back with
//!   the mtime unchanged: a write, an append or a fallocate of a file the kernel may hold
//!   pages of drops the range before it is answered. A write through a cached handle is the
//!   exception: the kernel's pages hold its bytes, locked until it is answered (dropping
//!   them would wait for that very answer).
//!
//! Invalidations never run on a FUSE thread (the kernel waits there for pages that reads in
//! flight hold locked, and those reads need FUSE threads and tasks to be answered), and never
//! inside a recall (a read in flight may wait for the server, which waits for the recall).
//! Without the kernel's `FUSE_AUTO_INVAL_DATA` or a way to invalidate (a mount made without
//! the agent's session), every open keeps `FOPEN_DIRECT_IO`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::SystemTime;

use fuser::FileAttr;
use sanfs_proto::types::InodeId;

/// Drops the kernel's cached pages of an inode: `(inode, offset, length)`, length 0 to the
/// end of the file. Blocking; never called on a FUSE thread.
pub type PageInvalidator = Box<dyn Fn(InodeId, u64, u64) + Send + Sync>;

/// Inodes remembered at most; past it, the ones not open are forgotten (their next open
/// drops whatever the kernel kept).
const MAX_KNOWN: usize = 65_536;

/// What the kernel was last told of a file's data: size, mtime and ctime.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Seen {
    size: u64,
    mtime: SystemTime,
    ctime: SystemTime,
}

impl Seen {
    pub(super) fn of(a: &FileAttr) -> Seen {
        Seen {
            size: a.size,
            mtime: a.mtime,
            ctime: a.ctime,
        }
    }

    /// Changed in a way the kernel does not see by itself: ctime moved, size and mtime not.
    fn unseen_change(&self, now: &Seen) -> bool {
        self.ctime != now.ctime && self.size == now.size && self.mtime == now.mtime
    }
}

#[derive(Debug)]
struct Known {
    seen: Seen,
    /// Handles open in cached mode.
    opens: u32,
}

/// The files whose data the kernel may cache, and how to drop it.
#[derive(Default)]
pub(super) struct KernelPages {
    known: Mutex<HashMap<InodeId, Known>>,
    invalidate: OnceLock<PageInvalidator>,
    /// The kernel drops a file's pages when its size or mtime changes.
    auto_inval: AtomicBool,
    /// Switched off by the mount (`page_cache=off`).
    off: AtomicBool,
}

impl KernelPages {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<InodeId, Known>> {
        self.known.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn set_invalidator(&self, f: PageInvalidator) -> bool {
        self.invalidate.set(f).is_ok()
    }

    pub(super) fn set_auto_inval(&self, on: bool) {
        self.auto_inval.store(on, Ordering::Relaxed);
    }

    pub(super) fn switch_off(&self) {
        self.off.store(true, Ordering::Relaxed);
    }

    /// Whether opens may use the page cache at all.
    pub(super) fn usable(&self) -> bool {
        !self.off.load(Ordering::Relaxed)
            && self.auto_inval.load(Ordering::Relaxed)
            && self.invalidate.get().is_some()
    }

    /// A cached open of `ino` whose attributes are `now`: whether the kernel may keep what
    /// it cached (`FOPEN_KEEP_CACHE`): only when nothing changed since it was last told.
    /// Otherwise the kernel drops the file's pages as it opens it.
    pub(super) fn open(&self, ino: InodeId, now: Seen) -> bool {
        let mut known = self.lock();
        if let Some(k) = known.get_mut(&ino) {
            let keep = k.seen == now;
            k.seen = now;
            k.opens += 1;
            return keep;
        }
        if known.len() >= MAX_KNOWN {
            known.retain(|_, k| k.opens > 0);
        }
        known.insert(
            ino,
            Known {
                seen: now,
                opens: 1,
            },
        );
        false
    }

    /// Whether a cached open of `ino` with attributes `now` would keep the kernel's pages
    /// ([`KernelPages::open`], without noting the open).
    pub(super) fn would_keep(&self, ino: InodeId, now: Seen) -> bool {
        self.lock().get(&ino).is_some_and(|k| k.seen == now)
    }

    /// A cached handle of `ino` was released (what the kernel holds stays known).
    pub(super) fn release(&self, ino: InodeId) {
        if let Some(k) = self.lock().get_mut(&ino) {
            k.opens = k.opens.saturating_sub(1);
        }
    }

    /// Whether the kernel may hold pages of `ino` (this node's own changes must drop them).
    pub(super) fn holds(&self, ino: InodeId) -> bool {
        self.lock().contains_key(&ino)
    }

    /// Whether attributes `now` of `ino` carry a change the kernel would not see by itself
    /// (its pages must go before it is given them as valid).
    pub(super) fn stale(&self, ino: InodeId, now: &Seen) -> bool {
        self.lock()
            .get(&ino)
            .is_some_and(|k| k.seen.unseen_change(now))
    }

    /// Whether attributes `now` of `ino` carry a size or mtime the kernel was not given by a
    /// `GETATTR` or an open (where it may hold pages of the file).
    pub(super) fn data_moved(&self, ino: InodeId, now: &Seen) -> bool {
        self.lock()
            .get(&ino)
            .is_some_and(|k| k.seen.size != now.size || k.seen.mtime != now.mtime)
    }

    /// The kernel is given `now` of `ino` by a `GETATTR` (after [`KernelPages::invalidate`]
    /// where [`KernelPages::stale`] said so).
    pub(super) fn seen(&self, ino: InodeId, now: Seen) {
        if let Some(k) = self.lock().get_mut(&ino) {
            k.seen = now;
        }
    }

    /// Drops the kernel's pages of `ino` in `[offset, offset + len)` (len 0: to the end).
    /// Blocking: waits for reads in flight on those pages.
    pub(super) fn invalidate(&self, ino: InodeId, offset: u64, len: u64) {
        if let Some(f) = self.invalidate.get() {
            metrics::counter!(PAGE_INVALIDATIONS).increment(1);
            f(ino, offset, len);
        }
    }
}

/// Counter: the kernel's cached pages of a file dropped by the agent (its own writes, a
/// change the kernel would not have seen).
pub const PAGE_INVALIDATIONS: &str = "sanfs_agent_page_invalidations_total";

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn seen(size: u64, mtime: u64, ctime: u64) -> Seen {
        let t = |s| SystemTime::UNIX_EPOCH + Duration::from_secs(s);
        Seen {
            size,
            mtime: t(mtime),
            ctime: t(ctime),
        }
    }

    #[test]
    fn a_reopen_keeps_the_pages_only_when_nothing_changed() {
        let p = KernelPages::default();
        let ino = InodeId(7);
        assert!(!p.open(ino, seen(10, 1, 1)), "first open: nothing to keep");
        p.release(ino);
        assert!(p.holds(ino), "the pages outlive the handle");
        assert!(p.open(ino, seen(10, 1, 1)));
        assert!(!p.open(ino, seen(10, 2, 2)), "a new mtime: dropped at open");
        assert!(
            !p.open(ino, seen(10, 2, 3)),
            "a new ctime alone: dropped too"
        );
        assert!(p.open(ino, seen(10, 2, 3)));
    }

    #[test]
    fn only_a_ctime_that_moved_alone_is_a_change_the_kernel_does_not_see() {
        let p = KernelPages::default();
        let ino = InodeId(8);
        assert!(!p.stale(ino, &seen(10, 1, 2)), "unknown: nothing cached");
        p.open(ino, seen(10, 1, 1));
        assert!(!p.stale(ino, &seen(10, 1, 1)));
        assert!(!p.stale(ino, &seen(11, 1, 2)), "size: the kernel drops");
        assert!(!p.stale(ino, &seen(10, 2, 2)), "mtime: the kernel drops");
        assert!(
            p.stale(ino, &seen(10, 1, 2)),
            "rewritten, then the mtime set back"
        );
        p.seen(ino, seen(10, 1, 2));
        assert!(!p.stale(ino, &seen(10, 1, 2)));
    }

    #[test]
    fn without_auto_invalidation_or_an_invalidator_nothing_is_cached() {
        let p = KernelPages::default();
        assert!(!p.usable());
        p.set_auto_inval(true);
        assert!(!p.usable(), "no way to drop pages yet");
        assert!(p.set_invalidator(Box::new(|_, _, _| {})));
        assert!(p.usable());
        p.switch_off();
        assert!(!p.usable());
    }
}
