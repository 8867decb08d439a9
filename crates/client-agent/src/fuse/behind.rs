//! Writes answered before their device I/O (write-behind; issue 20, docs/posix.md "Caching
//! and coherence").
//!
//! A plain buffered write (no `O_SYNC`, `O_DSYNC`, `O_DIRECT` or `O_APPEND`) that falls inside
//! a write layout this node holds is answered as soon as its bytes are in the agent's own
//! buffer; its device I/O and completion go on in the write's task. The layout has its
//! blocks allocated already, so the write cannot fail later for want of space or quota; a
//! device error is the error of the file's next write, fsync or close, as a failed
//! writeback is in a local file system. So a sequential writer's next `write(2)` overlaps the
//! device I/O of the one before, instead of waiting for it.
//!
//! What keeps this exact, here and on other nodes:
//! - The write counts as a completion in flight of its file from before its answer
//!   (`Client::begin_write_behind`): this node's stat, fsync, truncate, fallocate, seek and
//!   close wait for it ([`crate::client::Client::flush_writes`]), and its layout is in use
//!   until its completion, so another node's read or write there (a recall) waits for it too.
//! - This node's reads of the file wait for the writes in flight on it ([`WritesBehind::
//!   wait_idle`]), also those the read cache or a small file's bytes could answer; a write
//!   waits for those it overlaps ([`WritesBehind::wait_clear`]), so that two device writes of
//!   the same bytes never race (the later one lands last).
//! - Bytes in flight are bounded ([`WritesBehind::new`]); past the bound a write waits for its
//!   device I/O as before.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use sanfs_proto::types::InodeId;
use tokio::sync::Notify;

/// One write in flight: its id and the byte range `[start, end)`.
#[derive(Debug, Clone, Copy)]
struct InFlight {
    id: u64,
    start: u64,
    end: u64,
}

#[derive(Debug, Default)]
struct Table {
    bytes: u64,
    next_id: u64,
    files: HashMap<InodeId, Vec<InFlight>>,
}

/// The writes answered before their device I/O, by file.
#[derive(Debug)]
pub(super) struct WritesBehind {
    /// The most bytes in flight at once (0: no write is answered early).
    max_bytes: u64,
    table: Mutex<Table>,
    /// A write in flight ended.
    ended: Notify,
}

/// A write admitted behind: in flight until dropped.
#[derive(Debug)]
pub(super) struct Ticket {
    owner: Arc<WritesBehind>,
    ino: InodeId,
    id: u64,
    len: u64,
}

impl WritesBehind {
    /// At most `max_bytes` in flight (the agent's write buffers hold them); 0 turns it off.
    pub(super) fn new(max_bytes: u64) -> Arc<WritesBehind> {
        Arc::new(WritesBehind {
            max_bytes,
            table: Mutex::new(Table::default()),
            ended: Notify::new(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether a write of `ino` overlapping `[start, end)` is in flight.
    pub(super) fn overlaps(&self, ino: InodeId, start: u64, end: u64) -> bool {
        self.lock()
            .files
            .get(&ino)
            .is_some_and(|w| w.iter().any(|f| f.start < end && start < f.end))
    }

    /// Whether any write of `ino` is in flight.
    pub(super) fn busy(&self, ino: InodeId) -> bool {
        self.lock().files.contains_key(&ino)
    }

    /// Bytes in flight now.
    #[cfg(test)]
    fn bytes(&self) -> u64 {
        self.lock().bytes
    }

    /// Admits a write of `len` bytes at `start` of `ino`, if it is on, there is room, and no
    /// write in flight overlaps it (wait with [`WritesBehind::wait_clear`] first).
    pub(super) fn admit(self: &Arc<Self>, ino: InodeId, start: u64, len: u64) -> Option<Ticket> {
        let end = start.checked_add(len)?;
        let mut t = self.lock();
        if len == 0 || t.bytes.saturating_add(len) > self.max_bytes {
            return None;
        }
        if t.files
            .get(&ino)
            .is_some_and(|w| w.iter().any(|f| f.start < end && start < f.end))
        {
            return None;
        }
        let id = t.next_id;
        t.files
            .entry(ino)
            .or_default()
            .push(InFlight { id, start, end });
        t.next_id += 1;
        t.bytes += len;
        Some(Ticket {
            owner: Arc::clone(self),
            ino,
            id,
            len,
        })
    }

    /// Waits until no write of `ino` overlapping `[start, end)` is in flight.
    pub(super) async fn wait_clear(&self, ino: InodeId, start: u64, end: u64) {
        loop {
            let ended = self.ended.notified();
            tokio::pin!(ended);
            ended.as_mut().enable();
            if !self.overlaps(ino, start, end) {
                return;
            }
            ended.await;
        }
    }

    /// Waits until no write of `ino` is in flight.
    pub(super) async fn wait_idle(&self, ino: InodeId) {
        self.wait_clear(ino, 0, u64::MAX).await;
    }

    fn end(&self, ino: InodeId, id: u64, len: u64) {
        {
            let mut t = self.lock();
            if let Some(w) = t.files.get_mut(&ino) {
                w.retain(|f| f.id != id);
                if w.is_empty() {
                    t.files.remove(&ino);
                }
            }
            t.bytes = t.bytes.saturating_sub(len);
        }
        self.ended.notify_waiters();
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.owner.end(self.ino, self.id, self.len);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn admission_is_bounded_and_never_overlaps() {
        let wb = WritesBehind::new(3 << 20);
        let ino = InodeId(7);
        let a = wb.admit(ino, 0, 1 << 20).unwrap();
        let b = wb.admit(ino, 1 << 20, 1 << 20).unwrap();
        // Overlapping a write in flight: not admitted.
        assert!(wb.admit(ino, (1 << 20) - 1, 2).is_none());
        assert!(wb.overlaps(ino, 0, 1) && !wb.overlaps(ino, 2 << 20, 3 << 20));
        // Another file may take the same offsets; the bound counts every file.
        let c = wb.admit(InodeId(8), 0, 1 << 20).unwrap();
        assert!(wb.admit(InodeId(9), 0, 1).is_none(), "over the bound");
        assert_eq!(wb.bytes(), 3 << 20);
        drop(a);
        assert!(wb.busy(ino) && !wb.overlaps(ino, 0, 1 << 20));
        drop(b);
        assert!(!wb.busy(ino));
        drop(c);
        assert_eq!(wb.bytes(), 0);
        assert!(WritesBehind::new(0).admit(ino, 0, 1).is_none(), "off");
        assert!(wb.admit(ino, u64::MAX, 2).is_none(), "past the last byte");
        assert!(wb.admit(ino, 0, 0).is_none(), "empty");
    }

    #[tokio::test]
    async fn waiters_wake_when_what_they_overlap_ends() {
        let wb = WritesBehind::new(8 << 20);
        let ino = InodeId(3);
        let t = wb.admit(ino, 4096, 4096).unwrap();
        // Not overlapping: no wait.
        tokio::time::timeout(Duration::from_secs(5), wb.wait_clear(ino, 0, 4096))
            .await
            .expect("a range the write does not touch");
        let w = Arc::clone(&wb);
        let waiter = tokio::spawn(async move {
            w.wait_clear(ino, 0, 8192).await;
            w.wait_idle(ino).await;
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!waiter.is_finished(), "waits while the write is in flight");
        drop(t);
        tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .expect("woken when the write ended")
            .unwrap();
    }
}
