//! The fence of a leading metadata server (high availability, `crate::ha`): its **fencing
//! epoch** (the create revision of its etcd election key) and its **deadline** (the end of
//! its etcd lease as this process can prove it: the send time of the last keep-alive that
//! etcd answered, plus the lease's TTL, less a margin).
//!
//! The metadata device refuses every write, length change and sync of a server whose fence
//! is lost or past its deadline, and, at the start of every commit and at every sync,
//! re-reads the device header (bypassing any cache) and refuses if another server's epoch is
//! there ([`super::device::BlockDeviceBackend`]). So a deposed leader, even one that was
//! paused (SIGSTOP, a VM freeze) across its lease and wakes up in the middle of a commit,
//! makes no further write: the deadline check catches it before its next write, the header
//! check catches a new leader that has claimed the device. docs/operations.md, "High
//! availability", says what remains (the time between a check and the write it guards).

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

/// See the module doc. Shared by the lease keeper (which extends or loses it) and the
/// metadata device (which checks it).
#[derive(Debug)]
pub struct Fence {
    /// 0 until the election is won (a fence without an epoch claims nothing).
    epoch: AtomicU64,
    deadline: Mutex<Instant>,
    lost: AtomicBool,
    why: Mutex<Option<String>>,
}

impl Fence {
    /// A fence for `epoch` (0: not known yet, see [`Fence::set_epoch`]), valid until
    /// `deadline`.
    pub fn new(epoch: u64, deadline: Instant) -> Fence {
        Fence {
            epoch: AtomicU64::new(epoch),
            deadline: Mutex::new(deadline),
            lost: AtomicBool::new(false),
            why: Mutex::new(None),
        }
    }

    /// This leader's fencing epoch.
    pub fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::SeqCst)
    }

    /// Sets the epoch once the election is won (only a fence that has none takes one).
    pub fn set_epoch(&self, epoch: u64) {
        let _ = self
            .epoch
            .compare_exchange(0, epoch, Ordering::SeqCst, Ordering::SeqCst);
    }

    /// Moves the deadline to `until` if that is later (a keep-alive was answered).
    pub fn extend(&self, until: Instant) {
        let mut d = self.deadline.lock().unwrap_or_else(|p| p.into_inner());
        if until > *d {
            *d = until;
        }
    }

    /// The current deadline.
    pub fn deadline(&self) -> Instant {
        *self.deadline.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Gives up leadership for good: every later check fails with `why`.
    pub fn lose(&self, why: impl Into<String>) {
        let mut w = self.why.lock().unwrap_or_else(|p| p.into_inner());
        if w.is_none() {
            *w = Some(why.into());
        }
        self.lost.store(true, Ordering::SeqCst);
    }

    /// Whether the fence has been lost (by [`Fence::lose`] or a check past the deadline).
    pub fn is_lost(&self) -> bool {
        self.lost.load(Ordering::SeqCst)
    }

    /// Ok while this server may still write: not lost and before the deadline. A check past
    /// the deadline loses the fence.
    pub fn check(&self) -> std::io::Result<()> {
        if !self.is_lost() && Instant::now() >= self.deadline() {
            self.lose("the etcd lease ran out (no keep-alive answered in time)");
        }
        if self.is_lost() {
            let w = self.why.lock().unwrap_or_else(|p| p.into_inner());
            return Err(fenced(format!(
                "fenced: this server (epoch {}) is no longer the leader: {}",
                self.epoch(),
                w.as_deref().unwrap_or("leadership lost")
            )));
        }
        Ok(())
    }
}

/// The error of a fenced write: `PermissionDenied`, so that it reads as what it is.
pub fn fenced(msg: String) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::PermissionDenied, msg)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_fence_holds_until_its_deadline_and_is_lost_for_good_after_it() {
        let f = Fence::new(7, Instant::now() + Duration::from_secs(60));
        assert!(f.check().is_ok());
        f.extend(Instant::now()); // earlier: ignored
        assert!(f.check().is_ok());
        let past = Fence::new(7, Instant::now());
        let e = past.check().unwrap_err();
        assert!(e.to_string().contains("epoch 7"), "{e}");
        past.extend(Instant::now() + Duration::from_secs(60));
        assert!(past.check().is_err(), "a lost fence is never valid again");
    }

    #[test]
    fn lose_keeps_the_first_reason() {
        let f = Fence::new(3, Instant::now() + Duration::from_secs(60));
        f.lose("first");
        f.lose("second");
        let e = f.check().unwrap_err().to_string();
        assert!(e.contains("first") && !e.contains("second"), "{e}");
    }
}
