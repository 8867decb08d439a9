//! The order of an `O_APPEND | O_DIRECT` handle's appends as the kernel sent them.
//!
//! With `FUSE_ASYNC_DIO` the kernel sends the 1 MiB pieces of one asynchronous (`aio`,
//! `io_uring`) `O_DIRECT` write all at once, and they can reach the agent's tasks in another
//! order. A positioned write does not care; an append does: the agent appends each piece at
//! the server's end of file (atomically with other nodes' appends), so pieces taken out of
//! order would land out of order. The kernel gives each piece the offset it would have at
//! its own end of file (the size it knows, plus the piece's place in the request), so the
//! pieces are put back in that order here: a piece past the end of the last one appended
//! waits, for at most [`GRACE`], for the pieces before it; then the lowest waiting one goes.
//! A synchronous append (one piece at a time) finds its offset at the last one's end and
//! never waits, unless another node's append moved the size the kernel knows (it then waits
//! the grace once).

use std::sync::Mutex;
use std::time::Duration;

/// How long a piece waits for the pieces before it to show up.
pub(super) const GRACE: Duration = Duration::from_millis(5);

/// How often a piece that waits looks again (besides being woken by an append that ended).
const RECHECK: Duration = Duration::from_millis(1);

#[derive(Debug)]
struct Order {
    /// The kernel offset where the last append ended (where the next piece starts).
    next: u64,
    /// Offsets of the pieces waiting for their turn.
    waiting: Vec<u64>,
}

/// The append order of one handle.
#[derive(Debug)]
pub(super) struct AppendOrder {
    order: Mutex<Order>,
    moved: tokio::sync::Notify,
}

impl AppendOrder {
    /// For a handle opened when the file (as the kernel was told) was `size` bytes long.
    pub(super) fn new(size: u64) -> AppendOrder {
        AppendOrder {
            order: Mutex::new(Order {
                next: size,
                waiting: Vec::new(),
            }),
            moved: tokio::sync::Notify::new(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Order> {
        self.order.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether the piece at `offset` (waiting) may go now: it starts at or before the end of
    /// the last append, or the grace is over and no waiting piece is before it. Taken out
    /// of the waiting ones when it may.
    fn may_go(&self, offset: u64, grace_over: bool) -> bool {
        let mut o = self.lock();
        let lowest = o.waiting.iter().min().is_none_or(|m| *m >= offset);
        let go = offset <= o.next || (grace_over && lowest);
        if go && let Some(i) = o.waiting.iter().position(|w| *w == offset) {
            o.waiting.swap_remove(i);
        }
        go
    }

    /// Waits for the turn of the piece at kernel offset `offset`.
    pub(super) async fn turn(&self, offset: u64) {
        self.lock().waiting.push(offset);
        let deadline = tokio::time::Instant::now() + GRACE;
        // Bounded: after the grace the lowest waiting piece goes at its next look, and each
        // one that goes makes room for the next.
        loop {
            let moved = self.moved.notified();
            tokio::pin!(moved);
            moved.as_mut().enable();
            if self.may_go(offset, tokio::time::Instant::now() >= deadline) {
                return;
            }
            let _ = tokio::time::timeout(RECHECK, moved).await;
        }
    }

    /// The piece at `offset` of `len` bytes was appended (or failed: `len` 0 moves nothing
    /// but wakes the others).
    pub(super) fn done(&self, offset: u64, len: u64) {
        {
            let mut o = self.lock();
            let end = offset.saturating_add(len);
            if len > 0 && end > o.next {
                o.next = end;
            }
        }
        self.moved.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    const MIB: u64 = 1 << 20;

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn pieces_that_arrive_out_of_order_go_in_the_kernels_order() {
        let order = Arc::new(AppendOrder::new(10));
        let went = Arc::new(Mutex::new(Vec::new()));
        // Pieces 3, 1, 2 (offsets 10 + k MiB) arrive before piece 0.
        let mut tasks = Vec::new();
        for k in [3u64, 1, 2, 0] {
            let (order, went) = (Arc::clone(&order), Arc::clone(&went));
            tasks.push(tokio::spawn(async move {
                let off = 10 + k * MIB;
                order.turn(off).await;
                went.lock().unwrap().push(k);
                tokio::task::yield_now().await;
                order.done(off, MIB);
            }));
            tokio::task::yield_now().await;
        }
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(*went.lock().unwrap(), vec![0, 1, 2, 3]);
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn an_append_after_the_size_moved_waits_the_grace_once_then_goes() {
        let order = AppendOrder::new(0);
        // At the last end: at once.
        let start = tokio::time::Instant::now();
        order.turn(0).await;
        order.done(0, 100);
        order.turn(100).await;
        order.done(100, 100);
        assert_eq!(start.elapsed(), Duration::ZERO);
        // The kernel's size jumped (another node appended): the grace, then it goes.
        order.turn(5000).await;
        assert!(start.elapsed() >= GRACE && start.elapsed() < GRACE * 2);
        order.done(5000, 100);
        let again = tokio::time::Instant::now();
        order.turn(5100).await;
        assert_eq!(again.elapsed(), Duration::ZERO);
    }

    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn after_the_grace_the_lowest_waiting_piece_goes_first() {
        let order = Arc::new(AppendOrder::new(0));
        let went = Arc::new(Mutex::new(Vec::new()));
        // A new request at a size the handle never saw: pieces 1 and 0 of it.
        let mut tasks = Vec::new();
        for k in [1u64, 0] {
            let (order, went) = (Arc::clone(&order), Arc::clone(&went));
            tasks.push(tokio::spawn(async move {
                let off = 64 * MIB + k * MIB;
                order.turn(off).await;
                went.lock().unwrap().push(k);
                order.done(off, MIB);
            }));
            tokio::task::yield_now().await;
        }
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(*went.lock().unwrap(), vec![0, 1]);
    }
}
