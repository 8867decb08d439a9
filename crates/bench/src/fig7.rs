//! Figure 7: striping. Reads of 2 MiB on volumes striped over N = 1, 2, 3, 4 and 8 LUNs with
//! a 64 KiB stripe unit, every LUN capped to the same bandwidth with the blkio throttle so
//! that the loop devices behave like independent disks.
//!
//! As in the paper, the theory for N LUNs is N times what sanfs reads from one capped LUN
//! (calibration: the cap the throttle enforces is not the number written into it). The reader
//! is a worker process put into the throttle's cgroup before it opens anything; the `raw`
//! column is the same worker with raw `O_DIRECT` on the file's blocks (the capped hardware).

use anyhow::Context;
use sanfs_testcluster::Throttle;

use crate::env::Env;
use crate::fig6::{client_with_threshold, lib_file};
use crate::util::MIB;
use crate::worker::{lib_args, run_together};

/// One stripe count.
#[derive(Debug, Clone, serde::Serialize)]
pub struct StripeRow {
    pub luns: usize,
    pub mb_s: f64,
    pub raw_mb_s: f64,
    /// `luns` x the one-LUN sanfs figure.
    pub theory_mb_s: f64,
    pub ratio: f64,
    /// CPU seconds per GiB of the sanfs reader (with the server) and of the raw reader.
    #[serde(default)]
    pub cpu_s_per_gib: Option<f64>,
    #[serde(default)]
    pub raw_cpu_s_per_gib: Option<f64>,
}

/// Figure 7's results.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Fig7 {
    pub io_size: u64,
    pub stripe_unit: u64,
    /// The cap written into blkio for every LUN, bytes/s.
    pub cap_bps: u64,
    pub rows: Vec<StripeRow>,
    pub skipped: Vec<String>,
}

/// Why figure 7 cannot run here, if it cannot.
pub fn unavailable(env: &Env) -> Option<String> {
    if env.existing.is_some() {
        return Some(
            "builds volumes of 1 to 8 LUNs of its own (not with an existing cluster)".into(),
        );
    }
    throttle_unavailable()
}

/// Why per-LUN caps with the blkio throttle cannot be set here, if they cannot (figures 7
/// and 10).
pub fn throttle_unavailable() -> Option<String> {
    if !sanfs_testcluster::is_root() {
        return Some("needs root (loop devices and blkio throttles)".into());
    }
    if !std::path::Path::new("/sys/fs/cgroup/blkio/blkio.throttle.read_bps_device").exists() {
        return Some("no cgroup v1 blkio throttle on this machine".into());
    }
    None
}

pub async fn run_fig7(env: &Env) -> anyhow::Result<Fig7> {
    let io_size = 2 * MIB;
    let stripe_unit = 64 * 1024;
    let cap_bps: u64 = env.pick(80_000_000, 80_000_000, 40_000_000);
    let counts: Vec<usize> = env.pick(vec![1, 2, 3, 4, 8], vec![1, 2, 4, 8], vec![1, 2]);
    let secs = env.pick(3.0, 1.0, 0.3);
    let mut fig = Fig7 {
        io_size,
        stripe_unit,
        cap_bps,
        ..Fig7::default()
    };
    if let Some(why) = unavailable(env) {
        fig.skipped.push(why);
        return Ok(fig);
    }
    let bar = env.bar(counts.len() as u64 * 2, "fig7");
    let mut one = None;
    for &n in &counts {
        bar.set_message(format!("{n} LUNs"));
        // Enough file for the reader to stream a while without wrapping too often.
        let len = (n as u64 * 64 * MIB).min(512 * MIB);
        let su = if n == 1 { None } else { Some(stripe_unit) };
        let cluster = env
            .cluster(&format!("f7n{n}"), n, su, len / n as u64 + 128 * MIB)
            .await?;
        let client = client_with_threshold(&cluster, "bench-fig7", None).await?;
        lib_file(&client, "fig7", len, true).await?;
        let devices: Vec<_> = cluster
            .lun_paths
            .iter()
            .map(|p| (p.as_path(), cap_bps, cap_bps))
            .collect();
        let mut measured = [0.0f64; 2];
        let mut cpu = [None; 2];
        for (k, raw) in [false, true].into_iter().enumerate() {
            let throttle =
                Throttle::create(&format!("f7n{n}"), &devices).context("blkio throttle")?;
            let mut args = lib_args(&cluster, "fig7", len, io_size, secs);
            if raw {
                args.push("--raw".into());
            }
            let meter =
                crate::cpu::CpuMeter::start(cluster.server_pid().filter(|_| !raw)).with_children();
            let (mb, samples) = run_together(vec![args], |pid| throttle.add_pid(pid))?;
            cpu[k] = meter
                .finish(samples.iter().map(|s| s.bytes).sum())
                .cpu_s_per_gib;
            drop(throttle);
            measured[k] = if samples.is_empty() { 0.0 } else { mb };
            bar.inc(1);
        }
        let base = *one.get_or_insert(measured[0]);
        let theory = base * n as f64;
        fig.rows.push(StripeRow {
            luns: n,
            mb_s: measured[0],
            raw_mb_s: measured[1],
            theory_mb_s: theory,
            ratio: measured[0] / theory.max(1e-9),
            cpu_s_per_gib: cpu[0],
            raw_cpu_s_per_gib: cpu[1],
        });
        drop(client);
    }
    bar.finish_and_clear();
    Ok(fig)
}

impl std::fmt::Display for Fig7 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "Figure 7: striping, {} KiB stripe unit, {} MiB reads, every LUN capped at {} MB/s (blkio)",
            self.stripe_unit / 1024,
            self.io_size / MIB,
            self.cap_bps / 1_000_000
        )?;
        writeln!(
            f,
            "{:>5} {:>10} {:>12} {:>10} {:>7} {:>10} {:>10}",
            "LUNs", "sanfs MB/s", "theory MB/s", "raw MB/s", "ratio", "sanfs s/G", "raw s/G"
        )?;
        let cpu = |c: Option<f64>| c.map_or("-".to_owned(), |c| format!("{c:.2}"));
        for r in &self.rows {
            writeln!(
                f,
                "{:>5} {:>10.1} {:>12.1} {:>10.1} {:>6.0}% {:>10} {:>10}",
                r.luns,
                r.mb_s,
                r.theory_mb_s,
                r.raw_mb_s,
                r.ratio * 100.0,
                cpu(r.cpu_s_per_gib),
                cpu(r.raw_cpu_s_per_gib)
            )?;
        }
        for s in &self.skipped {
            writeln!(f, "skipped: {s}")?;
        }
        Ok(())
    }
}
