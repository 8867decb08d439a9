//! Small helpers shared by the figures: sizes, timing budgets, CPU time, finding the sibling
//! binaries, free ports, and the progress bar.

use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;

pub const KIB: u64 = 1 << 10;
pub const MIB: u64 = 1 << 20;
pub const GIB: u64 = 1 << 30;

/// `4K`, `64K`, `1M`, `8M`: the axis labels of the paper's figures.
pub fn size_label(bytes: u64) -> String {
    if bytes >= MIB && bytes.is_multiple_of(MIB) {
        format!("{}M", bytes / MIB)
    } else if bytes >= KIB && bytes.is_multiple_of(KIB) {
        format!("{}K", bytes / KIB)
    } else {
        format!("{bytes}")
    }
}

/// Parses `4K`, `64KiB`, `1M`, `2T`, `4096` (binary units, as every sanfs surface reads them).
pub fn parse_size(text: &str) -> Result<u64, String> {
    sanfs_proto::units::parse_size(text)
}

/// Powers of two from `lo` to `hi`, inclusive.
pub fn pow2_sizes(lo: u64, hi: u64) -> Vec<u64> {
    let mut v = Vec::new();
    let mut s = lo.max(1);
    while s <= hi {
        v.push(s);
        s *= 2;
    }
    v
}

/// Megabytes (10^6 bytes) per second, the unit of the tables.
pub fn mb_per_s(bytes: u64, secs: f64) -> f64 {
    bytes as f64 / 1e6 / secs.max(1e-9)
}

/// How long one measurement runs: at least `min_ops` operations and at least `secs` seconds,
/// but never more than `max_ops` operations or `4 * secs + 1` seconds, whichever comes first.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Budget {
    pub secs: f64,
    pub min_ops: u64,
    pub max_ops: u64,
}

impl Budget {
    pub fn new(secs: f64, min_ops: u64, max_ops: u64) -> Budget {
        Budget {
            secs,
            min_ops,
            max_ops,
        }
    }

    /// Whether a run that has done `ops` operations since `started` should stop.
    pub fn done(&self, ops: u64, started: Instant) -> bool {
        let t = started.elapsed().as_secs_f64();
        ops >= self.max_ops || (ops >= self.min_ops && t >= self.secs) || t >= self.secs * 4.0 + 1.0
    }
}

/// User plus system CPU time of this whole process so far.
pub fn process_cpu() -> Duration {
    rusage_cpu(nix::sys::resource::UsageWho::RUSAGE_SELF)
}

/// User plus system CPU time of `who` (this process, or its children waited for so far).
pub fn rusage_cpu(who: nix::sys::resource::UsageWho) -> Duration {
    use nix::sys::resource::getrusage;
    match getrusage(who) {
        Ok(u) => {
            let tv = |t: nix::sys::time::TimeVal| {
                Duration::from_secs(t.tv_sec().max(0) as u64)
                    + Duration::from_micros(t.tv_usec().max(0) as u64)
            };
            tv(u.user_time()) + tv(u.system_time())
        }
        Err(_) => Duration::ZERO,
    }
}

/// User plus system CPU time of another process (from `/proc/PID/stat`).
pub fn pid_cpu(pid: u32) -> Option<Duration> {
    stat_cpu(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

/// User plus system CPU time in a `/proc/PID/stat` (or `/proc/PID/task/TID/stat`) line.
pub fn stat_cpu(stat: &str) -> Option<Duration> {
    // Fields after the command name (which may hold spaces) start after the last ')'.
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the whole line: 12 and 13 after the name.
    let ticks: u64 = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
    // /proc reports clock ticks of USER_HZ, which is 100 on every Linux the bench runs on.
    Some(Duration::from_millis(ticks.saturating_mul(10)))
}

/// A program that ships beside this one (`sanfs-mds`, `sanfs-agent`), or on `PATH`.
pub fn sibling_binary(name: &str) -> Option<PathBuf> {
    if let Ok(me) = std::env::current_exe()
        && let Some(dir) = me.parent()
    {
        for d in [Some(dir), dir.parent()] {
            let p = d.map(|d| d.join(name));
            if let Some(p) = p.filter(|p| p.is_file()) {
                return Some(p);
            }
        }
    }
    which(name)
}

/// `name` on `PATH` (or in the sbin directories, which a non-login root shell may lack).
pub fn which(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin", "/usr/bin"].map(PathBuf::from))
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// A TCP port on 127.0.0.1 that nothing listens on right now.
pub fn free_port() -> anyhow::Result<SocketAddr> {
    let l = TcpListener::bind("127.0.0.1:0").context("find a free port")?;
    l.local_addr().context("free port address")
}

/// A progress bar over `len` steps on stderr (hidden when stderr is not a terminal).
pub fn progress(len: u64, what: &str) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::new(len);
    if let Ok(style) = indicatif::ProgressStyle::with_template(
        "{spinner} {prefix:>10} [{bar:30}] {pos}/{len} {msg} ({elapsed})",
    ) {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.set_prefix(what.to_owned());
    bar
}

/// Bytes of `n` 4 KiB-aligned, non-trivial data (so nothing compresses or dedups it).
pub fn pattern(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut v = Vec::with_capacity(n);
    while v.len() < n {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.extend_from_slice(&x.to_le_bytes());
    }
    v.truncate(n);
    v
}

/// Median of a list (0 for an empty list).
pub fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The `p`-th percentile (0..=100) of a list (0 for an empty list).
pub fn percentile(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let i = ((v.len() - 1) as f64 * p / 100.0).round() as usize;
    v[i.min(v.len() - 1)]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(size_label(4096), "4K");
        assert_eq!(size_label(8 * MIB), "8M");
        assert_eq!(parse_size("64K"), Ok(65536));
        assert_eq!(parse_size("2MiB"), Ok(2 * MIB));
        assert!(parse_size("2X").is_err());
        assert_eq!(
            pow2_sizes(4 * KIB, 32 * KIB),
            vec![4096, 8192, 16384, 32768]
        );
    }

    #[test]
    fn budget_stops() {
        let b = Budget::new(0.0, 3, 10);
        let t = Instant::now();
        assert!(!b.done(2, t));
        assert!(b.done(3, t));
        assert!(Budget::new(100.0, 0, 5).done(5, t));
    }

    #[test]
    fn percentiles() {
        let mut v = vec![5.0, 1.0, 3.0, 2.0, 4.0];
        assert_eq!(median(&mut v), 3.0);
        assert_eq!(percentile(&mut v, 100.0), 5.0);
        assert_eq!(percentile(&mut v, 0.0), 1.0);
    }
}
