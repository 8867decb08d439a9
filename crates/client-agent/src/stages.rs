//! Where the data path spends its time and CPU, stage by stage (issue 20): cheap process-wide
//! counters (atomics, no allocation per request) that `sanfs-agent status`, the agent's
//! metrics and `sanfs-bench` read.
//!
//! Every [`Stage`] counts its calls, the bytes they moved (where a stage moves data), the
//! wall time spent in it, and for the stages that run on one thread without awaiting (copies,
//! planning, submission, the FUSE answer) the thread CPU time spent in it
//! (`CLOCK_THREAD_CPUTIME_ID`). The stages that await the server or a device count wall time
//! alone: their CPU is spent elsewhere (tokio's and the engine's threads, the server).
//!
//! | stage | clock | what |
//! |---|---|---|
//! | `fuse-read`, `fuse-write` | wall | a FUSE read / write request from its arrival to its answer |
//! | `write-behind` | wall | a write answered before its device I/O: from the answer to the end of its I/O and completion's queueing |
//! | `fuse-credentials` | wall, CPU | the caller's supplementary groups (`/proc/PID/status`) |
//! | `fuse-reply` | wall, CPU | writing the answer to `/dev/fuse` (the kernel's copy of read data included) |
//! | `copy` | wall, CPU | user-space copies and zero fills of file data between the caller's buffer and the aligned device buffer |
//! | `plan` | wall, CPU | cutting a grant's plan to the I/O and making its device ops |
//! | `map-read`, `map-write`, `complete` | wall | the grant round trips (MapRead, MapWrite, Complete) |
//! | `proxied` | wall | proxied Read / Write round trips |
//! | `submit` | wall, CPU | handing a batch of device I/O to the engine (the caller's side) |
//! | `device-wait` | wall | from a batch's submission to its completion |
//! | `engine` | CPU | the io_uring engine thread (calls: its wake-ups) |
//!
//! The counters are process-wide: one agent per process; a program that runs the library
//! (the bench) sees its own I/O in them.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use serde::{Deserialize, Serialize};

/// A stage of the data path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    FuseRead,
    FuseWrite,
    WriteBehind,
    FuseCredentials,
    FuseReply,
    Copy,
    Plan,
    MapRead,
    MapWrite,
    Complete,
    Proxied,
    Submit,
    DeviceWait,
    Engine,
}

impl Stage {
    /// Every stage, in the order a FUSE request meets them.
    pub const ALL: [Stage; 14] = [
        Stage::FuseRead,
        Stage::FuseWrite,
        Stage::WriteBehind,
        Stage::FuseCredentials,
        Stage::FuseReply,
        Stage::Copy,
        Stage::Plan,
        Stage::MapRead,
        Stage::MapWrite,
        Stage::Complete,
        Stage::Proxied,
        Stage::Submit,
        Stage::DeviceWait,
        Stage::Engine,
    ];

    /// The stage's name in the status, the metrics and the bench.
    pub fn name(self) -> &'static str {
        match self {
            Stage::FuseRead => "fuse-read",
            Stage::FuseWrite => "fuse-write",
            Stage::WriteBehind => "write-behind",
            Stage::FuseCredentials => "fuse-credentials",
            Stage::FuseReply => "fuse-reply",
            Stage::Copy => "copy",
            Stage::Plan => "plan",
            Stage::MapRead => "map-read",
            Stage::MapWrite => "map-write",
            Stage::Complete => "complete",
            Stage::Proxied => "proxied",
            Stage::Submit => "submit",
            Stage::DeviceWait => "device-wait",
            Stage::Engine => "engine",
        }
    }

    fn counter(self) -> &'static Counter {
        &COUNTERS[self as usize]
    }
}

struct Counter {
    calls: AtomicU64,
    bytes: AtomicU64,
    wall_ns: AtomicU64,
    cpu_ns: AtomicU64,
}

#[allow(
    clippy::declare_interior_mutable_const,
    reason = "only the array initialiser below uses it"
)]
const ZERO: Counter = Counter {
    calls: AtomicU64::new(0),
    bytes: AtomicU64::new(0),
    wall_ns: AtomicU64::new(0),
    cpu_ns: AtomicU64::new(0),
};

static COUNTERS: [Counter; Stage::ALL.len()] = [ZERO; Stage::ALL.len()];

/// CPU time this thread has used, in nanoseconds (0 if the clock cannot be read).
pub fn thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec for the duration of the call.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return 0;
    }
    (ts.tv_sec.max(0) as u64)
        .saturating_mul(1_000_000_000)
        .saturating_add(ts.tv_nsec.max(0) as u64)
}

fn nanos(since: Instant) -> u64 {
    u64::try_from(since.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

/// Adds one call of `stage` that moved `bytes`, took `wall_ns` and used `cpu_ns` of CPU.
pub fn record(stage: Stage, bytes: u64, wall_ns: u64, cpu_ns: u64) {
    let c = stage.counter();
    c.calls.fetch_add(1, Ordering::Relaxed);
    c.bytes.fetch_add(bytes, Ordering::Relaxed);
    c.wall_ns.fetch_add(wall_ns, Ordering::Relaxed);
    c.cpu_ns.fetch_add(cpu_ns, Ordering::Relaxed);
}

/// A measurement of one call of a stage, recorded when dropped (or by [`Span::bytes`]).
pub struct Span {
    stage: Stage,
    bytes: u64,
    started: Instant,
    /// Thread CPU at the start, for stages that never await.
    cpu0: Option<u64>,
}

impl Span {
    /// Wall time and thread CPU of a section that runs on one thread without awaiting.
    pub fn cpu(stage: Stage) -> Span {
        Span {
            stage,
            bytes: 0,
            started: Instant::now(),
            cpu0: Some(thread_cpu_ns()),
        }
    }

    /// Wall time alone (a section that awaits, or runs on several threads).
    pub fn wall(stage: Stage) -> Span {
        Span {
            stage,
            bytes: 0,
            started: Instant::now(),
            cpu0: None,
        }
    }

    /// Wall time since `started` (when the request arrived before the span could start).
    pub fn wall_since(stage: Stage, started: Instant) -> Span {
        Span {
            stage,
            bytes: 0,
            started,
            cpu0: None,
        }
    }

    /// Sets the bytes this call moved.
    pub fn set_bytes(&mut self, bytes: u64) {
        self.bytes = bytes;
    }
}

impl Drop for Span {
    fn drop(&mut self) {
        let cpu = self.cpu0.map_or(0, |c0| thread_cpu_ns().saturating_sub(c0));
        record(self.stage, self.bytes, nanos(self.started), cpu);
    }
}

/// The io_uring engine thread's CPU, counted as [`Stage::Engine`]: one call per wake-up.
pub struct ThreadCpu {
    last: u64,
}

impl ThreadCpu {
    /// Starts counting the calling thread.
    pub fn start() -> ThreadCpu {
        ThreadCpu {
            last: thread_cpu_ns(),
        }
    }

    /// Counts the CPU the thread used since the last call as one call of `stage`.
    pub fn tick(&mut self, stage: Stage) {
        let now = thread_cpu_ns();
        record(stage, 0, 0, now.saturating_sub(self.last));
        self.last = now.max(self.last);
    }
}

/// One stage's totals since the process started.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageStat {
    pub stage: String,
    pub calls: u64,
    pub bytes: u64,
    pub wall_ns: u64,
    /// Thread CPU, for the stages that measure it (0 for the others).
    pub cpu_ns: u64,
}

impl StageStat {
    /// What happened between `earlier` and `self` (a later reading of the same stage).
    pub fn since(&self, earlier: &StageStat) -> StageStat {
        StageStat {
            stage: self.stage.clone(),
            calls: self.calls.saturating_sub(earlier.calls),
            bytes: self.bytes.saturating_sub(earlier.bytes),
            wall_ns: self.wall_ns.saturating_sub(earlier.wall_ns),
            cpu_ns: self.cpu_ns.saturating_sub(earlier.cpu_ns),
        }
    }
}

/// Every stage's totals now, in [`Stage::ALL`] order.
pub fn snapshot() -> Vec<StageStat> {
    Stage::ALL
        .iter()
        .map(|&s| {
            let c = s.counter();
            StageStat {
                stage: s.name().to_owned(),
                calls: c.calls.load(Ordering::Relaxed),
                bytes: c.bytes.load(Ordering::Relaxed),
                wall_ns: c.wall_ns.load(Ordering::Relaxed),
                cpu_ns: c.cpu_ns.load(Ordering::Relaxed),
            }
        })
        .collect()
}

/// `later - earlier`, stage by stage (stages missing from `earlier` count from zero).
pub fn delta(later: &[StageStat], earlier: &[StageStat]) -> Vec<StageStat> {
    later
        .iter()
        .map(|l| match earlier.iter().find(|e| e.stage == l.stage) {
            Some(e) => l.since(e),
            None => l.clone(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_distinct_and_in_order() {
        let names: Vec<&str> = Stage::ALL.iter().map(|s| s.name()).collect();
        let mut sorted = names.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), names.len());
        for (i, s) in Stage::ALL.iter().enumerate() {
            assert_eq!(*s as usize, i);
        }
    }

    #[test]
    fn a_cpu_span_counts_a_busy_section() {
        let before = snapshot();
        {
            let mut s = Span::cpu(Stage::Plan);
            s.set_bytes(7);
            let t = Instant::now();
            let mut x = 1u64;
            while t.elapsed().as_millis() < 30 {
                x = std::hint::black_box(x.wrapping_mul(3).wrapping_add(1));
            }
        }
        let d = delta(&snapshot(), &before);
        let plan = d.iter().find(|s| s.stage == "plan").unwrap();
        // Other tests may count plans at the same time: at least ours.
        assert!(plan.calls >= 1 && plan.bytes >= 7, "{plan:?}");
        assert!(plan.wall_ns >= 30_000_000, "{plan:?}");
        // Busy on its own thread: most of the wall time is CPU (wide bounds: a shared box).
        assert!(plan.cpu_ns >= 5_000_000, "{plan:?}");
    }

    #[test]
    fn a_wall_span_counts_no_cpu_and_delta_subtracts() {
        let a = StageStat {
            stage: "x".into(),
            calls: 5,
            bytes: 10,
            wall_ns: 100,
            cpu_ns: 3,
        };
        let b = StageStat {
            stage: "x".into(),
            calls: 2,
            bytes: 4,
            wall_ns: 40,
            cpu_ns: 1,
        };
        assert_eq!(
            delta(std::slice::from_ref(&a), std::slice::from_ref(&b)),
            vec![StageStat {
                stage: "x".into(),
                calls: 3,
                bytes: 6,
                wall_ns: 60,
                cpu_ns: 2,
            }]
        );
        // A counter that went backwards (another process's reading) never underflows.
        assert_eq!(b.since(&a).calls, 0);
        let before = snapshot();
        drop(Span::wall(Stage::DeviceWait));
        let d = delta(&snapshot(), &before);
        let w = d.iter().find(|s| s.stage == "device-wait").unwrap();
        assert!(w.calls >= 1);
    }
}
