//! Figures 8 and 9: control messages per I/O and the agent's CPU time per GiB, for the
//! paper's method A (one grant, so one MapRead/MapWrite and one Complete, per stripe unit)
//! and method B (one grant per I/O, physically contiguous runs merged), reading and writing
//! 256 KiB to 4 MiB on a volume striped over 4 LUNs with a 64 KiB stripe unit.
//!
//! Both methods run through the real client library (`grant_per_stripe_unit` makes it do
//! method A) with the grant cache limited to one grant and no read layouts ahead, so that
//! every I/O pays its control messages as the paper's did. Messages are counted at the server (its
//! `sanfs_rpc_requests_total` counters: MapRead, MapWrite, Complete, ReturnGrant, Read,
//! Write); CPU time is this process's (user + system, getrusage), which is the agent's when
//! the server runs as its own process.

use std::sync::Arc;

use anyhow::Context;

use crate::cluster::BenchCluster;
use crate::env::Env;
use crate::fig6::lib_file;
use crate::io::{Op, Target, run};
use crate::util::{Budget, GIB, KIB, MIB, pow2_sizes, process_cpu, size_label};

/// The data-path RPCs counted as control messages.
const DATA_RPCS: [&str; 6] = [
    "MapRead",
    "MapWrite",
    "Complete",
    "ReturnGrant",
    "Read",
    "Write",
];

/// One method, op and size.
#[derive(Debug, Clone, serde::Serialize)]
pub struct MethodRow {
    /// `A` or `B`.
    pub method: &'static str,
    pub op: Op,
    pub size: u64,
    pub ios: u64,
    pub rpcs_per_io: f64,
    /// Agent CPU milliseconds per GiB moved.
    pub cpu_ms_per_gib: f64,
    /// CPU seconds per GiB of this process and the server together ([`crate::cpu`]).
    #[serde(default)]
    pub cpu_s_per_gib: Option<f64>,
    pub mb_s: f64,
}

/// Figures 8 and 9's results.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Fig8 {
    pub luns: usize,
    pub stripe_unit: u64,
    pub rows: Vec<MethodRow>,
    /// The CPU time includes the server's (it ran in this process).
    pub cpu_includes_server: bool,
    pub skipped: Vec<String>,
}

impl Fig8 {
    pub fn get(&self, method: &str, op: Op, size: u64) -> Option<&MethodRow> {
        self.rows
            .iter()
            .find(|r| r.method == method && r.op == op && r.size == size)
    }
}

fn data_rpcs(cluster: &BenchCluster) -> anyhow::Result<f64> {
    let m = cluster.rpc_counts()?;
    Ok(DATA_RPCS
        .iter()
        .map(|r| m.get(*r).copied().unwrap_or(0.0))
        .sum())
}

/// Runs figures 8 and 9 on `cluster` (striped over 4 LUNs, 64 KiB stripe unit).
pub async fn run_fig8(env: &Env, cluster: &BenchCluster) -> anyhow::Result<Fig8> {
    let sizes = env.pick(
        pow2_sizes(256 * KIB, 4 * MIB),
        pow2_sizes(256 * KIB, 4 * MIB),
        vec![256 * KIB, MIB],
    );
    let ios: u64 = env.pick(200, 40, 4);
    let mut fig = Fig8 {
        luns: 4,
        stripe_unit: 64 * KIB,
        cpu_includes_server: cluster.in_process,
        ..Fig8::default()
    };
    if cluster.metrics_addr.is_none() {
        fig.skipped
            .push("no metrics endpoint to count messages at (give --metrics)".into());
        return Ok(fig);
    }
    let len = 64 * MIB;
    let mut files = Vec::new();
    for (method, per_su) in [("A", true), ("B", false)] {
        let mut cfg = cluster.client_config(&format!("bench-method-{method}"));
        cfg.grant_per_stripe_unit = per_su;
        cfg.max_cached_grants = 1;
        // Grants of exactly the bytes read: no layouts ahead (that would hide method B's
        // messages behind the cache).
        cfg.read_layout_bytes = 0;
        let client = Arc::new(BenchCluster::connect(cfg).await?);
        let f = lib_file(&client, &format!("fig8-{method}"), len, true).await?;
        files.push((method, Target::Lib(Arc::new(f))));
    }
    let bar = env.bar(sizes.len() as u64 * 4, "fig8/9");
    for &size in &sizes {
        for op in [Op::Read, Op::Write] {
            for (method, target) in &files {
                bar.set_message(format!(
                    "method {method} {} {}",
                    op.name(),
                    size_label(size)
                ));
                let budget = Budget::new(0.0, ios, ios);
                let rpcs0 = data_rpcs(cluster)?;
                let cpu0 = process_cpu();
                let meter = crate::cpu::CpuMeter::start(cluster.server_pid());
                let s = run(target, op, size, budget)
                    .await
                    .with_context(|| format!("method {method}"))?;
                let cpu = process_cpu().saturating_sub(cpu0);
                let used = meter.finish(s.bytes);
                // Returns of the last cached grant may still be on their way: settle.
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                let rpcs = data_rpcs(cluster)? - rpcs0;
                fig.rows.push(MethodRow {
                    method,
                    op,
                    size,
                    ios: s.ops,
                    rpcs_per_io: rpcs / s.ops.max(1) as f64,
                    cpu_ms_per_gib: cpu.as_secs_f64() * 1e3 / (s.bytes as f64 / GIB as f64),
                    cpu_s_per_gib: used.cpu_s_per_gib,
                    mb_s: s.mb_s,
                });
                bar.inc(1);
            }
        }
    }
    bar.finish_and_clear();
    Ok(fig)
}

impl std::fmt::Display for Fig8 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "Figures 8 and 9: control messages (RPCs) per I/O and agent CPU per GiB, {} LUNs striped, {} KiB stripe unit{}",
            self.luns,
            self.stripe_unit / KIB,
            if self.cpu_includes_server {
                " (CPU includes the in-process server)"
            } else {
                ""
            }
        )?;
        for op in [Op::Read, Op::Write] {
            writeln!(
                f,
                "{:<6} {:<5} {:>10} {:>10} {:>12} {:>12} {:>9} {:>9}",
                op.name(),
                "size",
                "A RPC/IO",
                "B RPC/IO",
                "A CPU ms/GiB",
                "B CPU ms/GiB",
                "A MB/s",
                "B MB/s"
            )?;
            let mut sizes: Vec<u64> = self.rows.iter().map(|r| r.size).collect();
            sizes.dedup();
            for size in sizes {
                let (Some(a), Some(b)) = (self.get("A", op, size), self.get("B", op, size)) else {
                    continue;
                };
                writeln!(
                    f,
                    "{:<6} {:<5} {:>10.1} {:>10.1} {:>12.0} {:>12.0} {:>9.1} {:>9.1}",
                    "",
                    size_label(size),
                    a.rpcs_per_io,
                    b.rpcs_per_io,
                    a.cpu_ms_per_gib,
                    b.cpu_ms_per_gib,
                    a.mb_s,
                    b.mb_s
                )?;
            }
        }
        for s in &self.skipped {
            writeln!(f, "skipped: {s}")?;
        }
        Ok(())
    }
}
