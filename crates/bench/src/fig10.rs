//! Figure 10: several processes reading different files of one file system at once, 2 MiB
//! reads on a volume striped over 4 LUNs (64 KiB stripe unit). The figure is the sum of the
//! processes' throughputs for 1 to 8 processes; the paper's point is that it stays flat from
//! 2 processes on (its spread was within 2.6%).
//!
//! The processes read through the FUSE mount (one agent for all of them, as on one node) when
//! there is one, else each is an agent of its own (the library).

use crate::cluster::BenchCluster;
use crate::cpu::CpuMeter;
use crate::env::{Env, MountPoint};
use crate::fig6::{client_with_threshold, lib_file};
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
    let bar = env.bar(max as u64 + counts.len() as u64, "fig10");
    bar.set_message("writing the files");
    for i in 0..max {
        lib_file(&client, &format!("fig10-{i}"), len, true).await?;
        bar.inc(1);
    }
    for &p in &counts {
        bar.set_message(format!("{p} processes"));
        let args: Vec<Vec<String>> = (0..p)
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
            .collect();
        // The readers are children of this process, counted once reaped; the agent (the
        // mount's, or none: each library reader is its own) and the server by their pids.
        let pids = cluster
            .server_pid()
            .into_iter()
            .chain(mount.and_then(|m| m.agent_pid()));
        let meter = CpuMeter::start(pids).with_children();
        let (agg, samples) = run_together(args, |_| Ok(()))?;
        let used = meter.finish(samples.iter().map(|s| s.bytes).sum());
        fig.rows.push(ProcRow {
            processes: p,
            aggregate_mb_s: agg,
            per_process_mb_s: samples.iter().map(|s| s.mb_s).collect(),
            cpu_s_per_gib: used.cpu_s_per_gib,
        });
        bar.inc(1);
    }
    bar.finish_and_clear();
    let from2: Vec<f64> = fig
        .rows
        .iter()
        .filter(|r| r.processes >= 2)
        .map(|r| r.aggregate_mb_s)
        .collect();
    if from2.len() >= 2 {
        let mean = from2.iter().sum::<f64>() / from2.len() as f64;
        let (lo, hi) = from2
            .iter()
            .fold((f64::MAX, f64::MIN), |(a, b), &x| (a.min(x), b.max(x)));
        fig.spread_2_up = Some((hi - lo) / mean.max(1e-9));
    }
    Ok(fig)
}

impl std::fmt::Display for Fig10 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "Figure 10: processes reading different files at once, {} MiB reads, 4 LUNs striped, via the {}",
            self.io_size / MIB,
            self.via
        )?;
        writeln!(
            f,
            "{:>9} {:>15} {:>10} {:>20}",
            "processes", "aggregate MB/s", "CPU s/GiB", "per process MB/s"
        )?;
        for r in &self.rows {
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
        if let Some(s) = self.spread_2_up {
            writeln!(
                f,
                "spread of the aggregate, 2 processes and up: {:.1}%",
                s * 100.0
            )?;
        }
        for s in &self.skipped {
            writeln!(f, "skipped: {s}")?;
        }
        Ok(())
    }
}
