//! The clock seam: the server reads wall-clock time only through [`Clock`], so that tests can
//! drive time by hand (lease expiry, timestamps) and stay deterministic.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};

use sanfs_proto::types::Timestamp;

/// Where the server gets "now" from.
#[derive(Debug, Clone)]
pub enum Clock {
    /// The system's real-time clock.
    System,
    /// A clock that moves only when a test moves it (nanoseconds since the epoch).
    Manual(Arc<AtomicI64>),
}

impl Clock {
    /// A manual clock starting at `sec` seconds since the epoch.
    pub fn manual(sec: i64) -> Clock {
        Clock::Manual(Arc::new(AtomicI64::new(sec.saturating_mul(1_000_000_000))))
    }

    /// Moves a manual clock forward; does nothing to the system clock.
    pub fn advance_ns(&self, ns: i64) {
        if let Clock::Manual(t) = self {
            t.fetch_add(ns, Ordering::SeqCst);
        }
    }

    /// The current time.
    pub fn now(&self) -> Timestamp {
        match self {
            Clock::System => {
                #[allow(clippy::disallowed_methods, reason = "this is the clock seam")]
                let now = std::time::SystemTime::now();
                match now.duration_since(std::time::UNIX_EPOCH) {
                    Ok(d) => Timestamp {
                        sec: i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
                        nsec: d.subsec_nanos(),
                    },
                    // A clock set before 1970: report the epoch rather than a negative time.
                    Err(_) => Timestamp::default(),
                }
            }
            Clock::Manual(t) => {
                let ns = t.load(Ordering::SeqCst);
                Timestamp {
                    sec: ns.div_euclid(1_000_000_000),
                    nsec: u32::try_from(ns.rem_euclid(1_000_000_000)).unwrap_or(0),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manual_clock_moves_only_when_told() {
        let c = Clock::manual(100);
        assert_eq!(c.now(), Timestamp { sec: 100, nsec: 0 });
        c.advance_ns(1_500_000_000);
        assert_eq!(
            c.now(),
            Timestamp {
                sec: 101,
                nsec: 500_000_000
            }
        );
    }

    #[test]
    fn system_clock_is_after_2020() {
        assert!(Clock::System.now().sec > 1_577_836_800);
    }
}
