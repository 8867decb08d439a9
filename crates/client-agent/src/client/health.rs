//! The health task: brings back LUNs poisoned by a failed write.
//!
//! The engine poisons a device whose write failed (fail stop, style section 6): nothing more is
//! issued to it and the client sends that device's I/O through the server. This task notices
//! the poison (woken by the failing write, and on its own timer), waits
//! [`super::ClientConfig::device_retry`], then probes: the LUN is looked up again by its label
//! identity among the configured globs (its path may have changed, as after an iSCSI
//! re-login), opened afresh with `O_DIRECT` (the identity read is itself a direct read of the
//! device), and the new handle replaces the old one in the engine before the poison is lifted.
//! A failed probe doubles the wait, up to 64 times the base; a LUN that fails again soon
//! after it came back keeps its longer wait.
//!
//! Nothing needs re-reading on this side: the client caches no data, and the failed write's
//! grant was completed with the device error, so the server kept its blocks Unwritten.

use std::sync::Arc;
use std::time::{Duration, Instant};

use sanfs_blockmap::volume::DeviceIndex;

use super::{Inner, bump};
use crate::discovery::find_device;

/// Most doublings of the probe interval.
const MAX_DOUBLINGS: u32 = 6;

/// The health task's record of one device.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Probe {
    /// When the poisoned device is probed next (`None`: not poisoned, as far as known).
    pub(crate) next: Option<Instant>,
    /// Probes failed (and re-poisonings soon after a recovery) in a row.
    pub(crate) failures: u32,
    /// When the device last came back.
    pub(crate) recovered_at: Option<Instant>,
}

fn backoff(base: Duration, failures: u32) -> Duration {
    base.saturating_mul(1 << failures.min(MAX_DOUBLINGS))
}

pub(super) async fn run(inner: Arc<Inner>) {
    let base = inner.config.device_retry.max(Duration::from_millis(10));
    loop {
        let now = Instant::now();
        let mut due = Vec::new();
        let mut next_wake = now + base;
        {
            let mut health = inner.lock_health();
            for (i, probe) in health.iter_mut().enumerate() {
                let d = DeviceIndex(i as u32);
                if !inner.engine.is_poisoned(d) {
                    probe.next = None;
                    continue;
                }
                let next = match probe.next {
                    Some(t) => t,
                    None => {
                        // Newly poisoned. A device that fails again soon after coming back
                        // keeps its longer interval.
                        let flapping = probe
                            .recovered_at
                            .is_some_and(|r| now.duration_since(r) < backoff(base, MAX_DOUBLINGS));
                        probe.failures = if flapping {
                            probe.failures.saturating_add(1)
                        } else {
                            0
                        };
                        let wait = backoff(base, probe.failures);
                        tracing::warn!(device = %d, retry_in = ?wait,
                            "LUN poisoned by a failed write: its I/O goes through the server until a probe succeeds");
                        let t = now + wait;
                        probe.next = Some(t);
                        t
                    }
                };
                if next <= now {
                    due.push(d);
                } else {
                    next_wake = next_wake.min(next);
                }
            }
        }
        for d in due {
            probe_device(&inner, d, base).await;
        }
        let _ = tokio::time::timeout(
            next_wake.saturating_duration_since(Instant::now()),
            inner.health_kick.notified(),
        )
        .await;
    }
}

/// One probe of poisoned device `d`: find, open, swap in, lift the poison.
async fn probe_device(inner: &Arc<Inner>, d: DeviceIndex, base: Duration) {
    let volume = inner.volume();
    let discovery = inner.config.discovery.clone();
    let found = tokio::task::spawn_blocking(move || find_device(&volume, &discovery, d))
        .await
        .unwrap_or_else(|e| Err(format!("probe task failed: {e}")));
    let result = match found {
        Ok(dev) => {
            let path = dev.path.clone();
            match inner.engine.replace_device(d, dev.file).await {
                Ok(()) => Ok(path),
                Err(e) => Err(format!("the engine refused the new handle: {e}")),
            }
        }
        Err(e) => Err(e),
    };
    let now = Instant::now();
    match result {
        Ok(path) => {
            inner.lock_device_paths()[d.as_usize()] = Some(path.clone());
            inner.engine.clear_poison(d);
            bump(&inner.counters.device_recoveries);
            let mut health = inner.lock_health();
            if let Some(p) = health.get_mut(d.as_usize()) {
                p.next = None;
                p.recovered_at = Some(now);
            }
            tracing::warn!(device = %d, path = %path.display(), "poisoned LUN probed and reopened: direct I/O on it resumes");
        }
        Err(why) => {
            let mut health = inner.lock_health();
            if let Some(p) = health.get_mut(d.as_usize()) {
                p.failures = p.failures.saturating_add(1);
                let wait = backoff(base, p.failures);
                p.next = Some(now + wait);
                tracing::warn!(device = %d, %why, retry_in = ?wait, "poisoned LUN still unusable");
            }
        }
    }
}
