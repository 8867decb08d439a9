//! Figure 10: several processes reading different files of one file system at once, 2 MiB
//! reads on a volume striped over 4 LUNs (64 KiB stripe unit). The figure is the sum of the
//! processes' throughputs for 1 to 8 processes; the paper's point is that it stays flat from
//! 2 processes on (its spread was within 2.6%).
//!
//! The processes read through the FUSE mount (one agent for all of them, as on one node) when
//! there is one, else each is an agent of its own (the library). On the mount they open
//! their files with `O_DIRECT`: every read goes to the LUNs (a buffered file opened for
//! reading only would be re-read from the kernel's page cache).

use anyhow::Context;
use sanfs_testcluster::Throttle;

use crate::cluster::BenchCluster;
use crate::cpu::CpuMeter;
use crate::env::{Env, MountPoint};
use crate::fig6::{client_with_threshold, lib_file};
use crate::io::Sample;
use crate::util::MIB;
use crate::worker::{lib_args, run_together};

#[derive(Debug, Clone, serde::Serialize)]
pub struct ProcRow {
    pub processes: usize,
    pub aggregate_mb_s: f64,
    pub per_process_mb_s: Vec<f64>,
    /// CPU seconds per GiB read, over the reader processes, the agent and the server.
    #[serde(default)]
    pub cpu_s_per_gib: Option<f64>,
}

/// Figure 10's results.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Fig10 {
    pub io_size: u64,
    /// `mount` or `library`.
    pub via: String,
    pub rows: Vec<ProcRow>,
    /// (max - min) / mean of the aggregates from 2 processes on.
    pub spread_2_up: Option<f64>,
    /// The cap of every LUN in the capped pass, bytes/s (`None`: it did not run).
    #[serde(default)]
    pub cap_bps: Option<u64>,
    /// The same processes with every LUN capped (the paper's setting: the LUNs the limit).
    #[serde(default)]
    pub capped_rows: Vec<ProcRow>,
    /// [`Fig10::spread_2_up`] of the capped pass.
    #[serde(default)]
    pub capped_spread_2_up: Option<f64>,
    pub skipped: Vec<String>,
}

pub async fn run_fig10(
    env: &Env,
    cluster: &BenchCluster,
    mount: Option<&MountPoint>,
) -> anyhow::Result<Fig10> {
    let io_size = 2 * MIB;
    let counts: Vec<usize> = env.pick((1..=8).collect(), vec![1, 2, 4, 8], vec![1, 2]);
    let max = counts.iter().copied().max().unwrap_or(1);
    let secs = env.pick(3.0, 1.0, 0.3);
    let len = env.pick(64 * MIB, 32 * MIB, 8 * MIB);
    let mut fig = Fig10 {
        io_size,
        via: if mount.is_some() { "mount" } else { "library" }.into(),
        ..Fig10::default()
    };
    let client = client_with_threshold(cluster, "bench-fig10", None).await?;
    let bar = env.bar(max as u64 + 2 * counts.len() as u64, "fig10");
    bar.set_message("writing the files");
    for i in 0..max {
        lib_file(&client, &format!("fig10-{i}"), len, true).await?;
        bar.inc(1);
    }
    let args = |p: usize| -> Vec<Vec<String>> {
        (0..p)
            .map(|i| {
                let name = format!("fig10-{i}");
                match mount {
                    Some(m) => vec![
                        "--path".into(),
                        m.path().join(&name).to_string_lossy().into_owned(),
                        "--len".into(),
                        len.to_string(),
                        "--size".into(),
                        io_size.to_string(),
                        "--secs".into(),
                        secs.to_string(),
                    ],
                    None => lib_args(cluster, &name, len, io_size, secs),
                }
            })
            .collect()
    };
    // The readers are children of this process, counted once reaped; the agent (the mount's,
    // or none: each library reader is its own) and the server by their pids.
    let meter = || {
        let pids = cluster
            .server_pid()
            .into_iter()
            .chain(mount.and_then(|m| m.agent_pid()));
        CpuMeter::start(pids).with_children()
    };
    for &p in &counts {
        bar.set_message(format!("{p} processes"));
        let m = meter();
        let (agg, samples) = run_together(args(p), |_| Ok(()))?;
        fig.rows.push(row(p, agg, &samples, m));
        bar.inc(1);
    }
    fig.spread_2_up = spread(&fig.rows);
    // The paper's setting: the LUNs are the limit. Every LUN capped with the blkio throttle
    // (as figure 7), the I/O issuers in its cgroup: the mount's agent, or each library reader.
    match capped_unavailable(cluster, mount) {
        Some(why) => fig.skipped.push(format!("LUN-capped pass: {why}")),
        None => {
            let cap_bps = CAP_BPS;
            fig.cap_bps = Some(cap_bps);
            let devices: Vec<_> = cluster
                .lun_paths
                .iter()
                .map(|p| (p.as_path(), cap_bps, cap_bps))
                .collect();
            for &p in &counts {
                bar.set_message(format!("{p} processes, LUNs capped"));
                let throttle = Throttle::create("f10", &devices).context("blkio throttle")?;
                if let Some(agent) = mount.and_then(|m| m.agent_pid()) {
                    throttle.add_pid(agent)?;
                }
                let m = meter();
                let (agg, samples) = run_together(args(p), |pid| {
                    if mount.is_some() {
                        Ok(())
                    } else {
                        throttle.add_pid(pid)
                    }
                })?;
                drop(throttle);
                fig.capped_rows.push(row(p, agg, &samples, m));
                bar.inc(1);
            }
            fig.capped_spread_2_up = spread(&fig.capped_rows);
        }
    }
    bar.finish_and_clear();
    Ok(fig)
}

/// The cap of every LUN in the capped pass, bytes/s (figure 7's).
const CAP_BPS: u64 = 80_000_000;

/// Why the LUN-capped pass cannot run here (`None`: it can).
fn capped_unavailable(cluster: &BenchCluster, mount: Option<&MountPoint>) -> Option<String> {
    if let Some(why) = crate::fig7::throttle_unavailable() {
        return Some(why);
    }
    if cluster.lun_paths.is_empty() {
        return Some("the LUNs are not known (an existing cluster)".into());
    }
    if mount.is_some_and(|m| m.agent_pid().is_none()) {
        return Some("the mount's agent is not this bench's own".into());
    }
    None
}

fn row(processes: usize, agg: f64, samples: &[Sample], meter: CpuMeter) -> ProcRow {
    let used = meter.finish(samples.iter().map(|s| s.bytes).sum());
    ProcRow {
        processes,
        aggregate_mb_s: agg,
        per_process_mb_s: samples.iter().map(|s| s.mb_s).collect(),
        cpu_s_per_gib: used.cpu_s_per_gib,
    }
}

/// (max - min) / mean of the aggregates from 2 processes on.
fn spread(rows: &[ProcRow]) -> Option<f64> {
    let from2: Vec<f64> = rows
        .iter()
        .filter(|r| r.processes >= 2)
        .map(|r| r.aggregate_mb_s)
        .collect();
    if from2.len() < 2 {
        return None;
    }
    let mean = from2.iter().sum::<f64>() / from2.len() as f64;
    let (lo, hi) = from2
        .iter()
        .fold((f64::MAX, f64::MIN), |(a, b), &x| (a.min(x), b.max(x)));
    Some((hi - lo) / mean.max(1e-9))
}

fn write_rows(f: &mut std::fmt::Formatter<'_>, rows: &[ProcRow]) -> std::fmt::Result {
    writeln!(
        f,
        "{:>9} {:>15} {:>10} {:>20}",
        "processes", "aggregate MB/s", "CPU s/GiB", "per process MB/s"
    )?;
    for r in rows {
        let per: Vec<String> = r
            .per_process_mb_s
            .iter()
            .map(|m| format!("{m:.0}"))
            .collect();
        writeln!(
            f,
            "{:>9} {:>15.1} {:>10} {:>20}",
            r.processes,
            r.aggregate_mb_s,
            r.cpu_s_per_gib
                .map_or("-".to_owned(), |c| format!("{c:.2}")),
            per.join(" ")
        )?;
    }
    Ok(())
}

impl std::fmt::Display for Fig10 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "Figure 10: processes reading different files at once, {} MiB reads, 4 LUNs striped, via the {}",
            self.io_size / MIB,
            self.via
        )?;
        write_rows(f, &self.rows)?;
        if let Some(s) = self.spread_2_up {
            writeln!(
                f,
                "spread of the aggregate, 2 processes and up: {:.1}%",
                s * 100.0
            )?;
        }
        if let Some(cap) = self.cap_bps {
            writeln!(
                f,
                "The same with every LUN capped at {} MB/s (blkio; the paper's setting: the LUNs are the limit)",
                cap / 1_000_000
            )?;
            write_rows(f, &self.capped_rows)?;
            if let Some(s) = self.capped_spread_2_up {
                writeln!(
                    f,
                    "spread of the aggregate, LUNs capped, 2 processes and up: {:.1}%",
                    s * 100.0
                )?;
            }
        }
        for s in &self.skipped {
            writeln!(f, "skipped: {s}")?;
        }
        Ok(())
    }
}
