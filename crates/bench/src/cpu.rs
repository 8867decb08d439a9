//! CPU per byte (issue 20): [`CpuMeter`] sums the user plus system CPU time a row's
//! processes spend between its start and its end, so that every throughput row reports CPU
//! seconds per GiB moved beside its MB/s: a figure that does not depend on how busy the
//! machine is.
//!
//! A meter counts this process (which does the I/O, runs the library or the raw engine, or
//! the libnfs client), the processes whose ids it is given (the agent, `sanfs-mds`, ganesha,
//! MooseFS' daemons; from `/proc/PID/stat`), and with [`CpuMeter::with_children`] the child
//! processes reaped during the row (fio, the reader processes of figure 10: from
//! `getrusage(RUSAGE_CHILDREN)`, which counts a child once it has been waited for). Kernel
//! threads (the loop devices' workers, a file system's writeback) count for none.
//!
//! [`ThreadMeter`] splits one process's CPU by thread name (the agent's `fuse-session`
//! threads, its tokio workers, its `sanfs-uring` engine thread).

use std::collections::BTreeMap;
use std::time::Duration;

use crate::util::{GIB, pid_cpu, process_cpu};

/// What a row's processes spent.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct CpuUse {
    /// CPU seconds over the row, all its processes.
    pub cpu_s: f64,
    /// Per GiB moved; `None` for a row that moved nothing.
    pub cpu_s_per_gib: Option<f64>,
}

/// CPU seconds per GiB of `bytes`; `None` when nothing moved.
pub fn per_gib(cpu_s: f64, bytes: u64) -> Option<f64> {
    (bytes > 0).then(|| cpu_s / (bytes as f64 / GIB as f64))
}

/// CPU time of the children of this process that have been waited for so far.
pub fn children_cpu() -> Duration {
    crate::util::rusage_cpu(nix::sys::resource::UsageWho::RUSAGE_CHILDREN)
}

/// The CPU of a set of processes from the moment it is started.
#[derive(Debug, Clone)]
pub struct CpuMeter {
    own: Duration,
    children: Option<Duration>,
    /// Each other process and its CPU at the start (a process already gone is left out).
    pids: Vec<(u32, Duration)>,
}

impl CpuMeter {
    /// Starts measuring this process and `pids`.
    pub fn start(pids: impl IntoIterator<Item = u32>) -> CpuMeter {
        let mut pids: Vec<u32> = pids.into_iter().collect();
        pids.sort_unstable();
        pids.dedup();
        CpuMeter {
            pids: pids
                .into_iter()
                .filter_map(|p| Some((p, pid_cpu(p)?)))
                .collect(),
            children: None,
            own: process_cpu(),
        }
    }

    /// Counts the children reaped from now on too (fio, worker processes).
    pub fn with_children(mut self) -> CpuMeter {
        self.children = Some(children_cpu());
        self
    }

    /// CPU seconds spent since the start. A process that exited since counts for nothing
    /// (unless it was a child reaped meanwhile, with [`CpuMeter::with_children`]).
    pub fn cpu_s(&self) -> f64 {
        let own = process_cpu().saturating_sub(self.own);
        let children = self
            .children
            .map_or(Duration::ZERO, |c0| children_cpu().saturating_sub(c0));
        let others: Duration = self
            .pids
            .iter()
            .filter_map(|(p, c0)| Some(pid_cpu(*p)?.saturating_sub(*c0)))
            .sum();
        (own + children + others).as_secs_f64()
    }

    /// What was spent since the start, for a row that moved `bytes`.
    pub fn finish(&self, bytes: u64) -> CpuUse {
        let cpu_s = self.cpu_s();
        CpuUse {
            cpu_s,
            cpu_s_per_gib: per_gib(cpu_s, bytes),
        }
    }
}

/// CPU seconds of one group of threads of a process (same name) over a row.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ThreadCpu {
    /// The threads' name (`comm`, at most 15 bytes: `tokio-runtime-w` for tokio's workers).
    pub name: String,
    pub threads: u32,
    pub cpu_s: f64,
}

/// A thread's name without a numeric suffix (`fuser-1`, `iou-wrk-4242`: the FUSE threads, the
/// kernel's io_uring workers), so that threads of one kind count together.
fn group_name(comm: &str) -> String {
    match comm.rsplit_once('-') {
        Some((head, tail))
            if !head.is_empty() && !tail.is_empty() && tail.bytes().all(|b| b.is_ascii_digit()) =>
        {
            head.to_owned()
        }
        _ => comm.to_owned(),
    }
}

/// Each thread of `pid` now: id -> (name, CPU).
fn threads_of(pid: u32) -> BTreeMap<u32, (String, Duration)> {
    let mut out = BTreeMap::new();
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return out;
    };
    for e in dir.filter_map(Result::ok) {
        let Some(tid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else {
            continue;
        };
        let name = match (stat.find('('), stat.rfind(')')) {
            (Some(a), Some(b)) if a < b => group_name(&stat[a + 1..b]),
            _ => continue,
        };
        if let Some(cpu) = crate::util::stat_cpu(&stat) {
            out.insert(tid, (name, cpu));
        }
    }
    out
}

/// The CPU of one process's threads, by thread name, from the moment it is started.
#[derive(Debug, Clone)]
pub struct ThreadMeter {
    pid: u32,
    start: BTreeMap<u32, (String, Duration)>,
}

impl ThreadMeter {
    pub fn start(pid: u32) -> ThreadMeter {
        ThreadMeter {
            pid,
            start: threads_of(pid),
        }
    }

    /// CPU since the start by thread name, busiest first (threads born since count from
    /// zero; threads that ended count for nothing).
    pub fn finish(&self) -> Vec<ThreadCpu> {
        let mut by_name: BTreeMap<String, (u32, Duration)> = BTreeMap::new();
        for (tid, (name, cpu)) in threads_of(self.pid) {
            let c0 = self
                .start
                .get(&tid)
                .filter(|(n, _)| *n == name)
                .map_or(Duration::ZERO, |(_, c)| *c);
            let e = by_name.entry(name).or_default();
            e.0 += 1;
            e.1 += cpu.saturating_sub(c0);
        }
        let mut v: Vec<ThreadCpu> = by_name
            .into_iter()
            .map(|(name, (threads, cpu))| ThreadCpu {
                name,
                threads,
                cpu_s: cpu.as_secs_f64(),
            })
            .collect();
        v.sort_by(|a, b| b.cpu_s.total_cmp(&a.cpu_s));
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::{Command, Stdio};
    use std::time::Instant;

    fn busy_shell(script: &str) -> std::process::Child {
        Command::new("sh")
            .args(["-c", script])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .unwrap()
    }

    #[test]
    fn counts_a_busy_process_by_its_pid() {
        let mut child = busy_shell("while :; do :; done");
        let own_before = crate::util::process_cpu();
        let meter = CpuMeter::start([child.id()]);
        let started = Instant::now();
        std::thread::sleep(Duration::from_millis(500));
        let wall = started.elapsed().as_secs_f64();
        let used = meter.finish(GIB);
        // The meter counts this process too, where other tests run at the same time.
        let own = (crate::util::process_cpu() - own_before).as_secs_f64();
        child.kill().unwrap();
        child.wait().unwrap();
        // A busy loop on a shared machine: some of the wall time, never more than all of it
        // (plus one clock tick of /proc's resolution).
        assert!(used.cpu_s >= 0.05, "{used:?}");
        assert!(
            used.cpu_s - own <= wall + 0.1,
            "{used:?} ({own} s of it this process's) in {wall} s"
        );
        // One GiB moved: per GiB is the CPU itself.
        assert_eq!(used.cpu_s_per_gib, Some(used.cpu_s));
    }

    #[test]
    fn counts_a_reaped_child_with_children_and_not_without() {
        let with = CpuMeter::start([]).with_children();
        let without = CpuMeter::start([]);
        let mut child = busy_shell("i=0; while [ $i -lt 300000 ]; do i=$((i+1)); done");
        child.wait().unwrap();
        let w = with.cpu_s();
        let wo = without.cpu_s();
        assert!(w >= 0.05, "{w}");
        // This process's own CPU meanwhile (spawn, wait) is tiny next to the child's loop.
        assert!(wo < w, "{wo} vs {w}");
    }

    #[test]
    fn a_row_that_moved_nothing_has_no_per_gib() {
        let m = CpuMeter::start([u32::MAX]);
        let u = m.finish(0);
        assert_eq!(u.cpu_s_per_gib, None);
        assert!(u.cpu_s >= 0.0 && u.cpu_s.is_finite());
        assert_eq!(per_gib(2.0, 0), None);
        assert_eq!(per_gib(2.0, GIB / 2), Some(4.0));
    }

    #[test]
    fn thread_names_group_without_numbers() {
        assert_eq!(group_name("fuser-1"), "fuser");
        assert_eq!(group_name("iou-wrk-4242"), "iou-wrk");
        assert_eq!(group_name("tokio-rt-worker"), "tokio-rt-worker");
        assert_eq!(group_name("-1"), "-1");
        assert_eq!(group_name("sanfs-uring"), "sanfs-uring");
    }

    #[test]
    fn splits_this_process_by_thread_name() {
        let meter = ThreadMeter::start(std::process::id());
        let t = std::thread::Builder::new()
            .name("h24-busy".into())
            .spawn(|| {
                let t = Instant::now();
                let mut x = 1u64;
                while t.elapsed() < Duration::from_millis(300) {
                    x = std::hint::black_box(x.wrapping_mul(7).wrapping_add(3));
                }
                // Still alive when the meter reads it.
                std::thread::sleep(Duration::from_millis(400));
            })
            .unwrap();
        std::thread::sleep(Duration::from_millis(350));
        let by_name = meter.finish();
        t.join().unwrap();
        let busy = by_name.iter().find(|t| t.name == "h24-busy").unwrap();
        assert_eq!(busy.threads, 1);
        assert!(busy.cpu_s >= 0.03, "{by_name:?}");
    }
}
