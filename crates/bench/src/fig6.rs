//! Figure 6: throughput against I/O size, 4 KiB to 8 MiB, reading and writing, one I/O at a
//! time, on a volume of one LUN.
//!
//! Rows, each measured at every size in turn (so that every ratio compares runs made
//! minutes, not hours, apart):
//! - `raw`: the agent's io_uring engine with `O_DIRECT` on the very LUN blocks that hold the
//!   `direct` row's file, no server at all: the limit. Cross-checked with fio on the same
//!   blocks when fio is installed (`fio` row).
//! - `direct`: the sanfs library, every block-aligned I/O on the direct path (the client's
//!   threshold set to 0): grant, device I/O, completion.
//! - `mount`: a file on the FUSE mount (`sanfs-agent mount`), with the server's default
//!   threshold (64 KiB: smaller I/O goes proxied), as an application sees sanfs.
//! - `proxied`: the library with every I/O forced through the server (threshold infinite).
//! - `nfs`: nfs-ganesha exporting ext4 on an equal LUN, through libnfs (see [`crate::nfs`]).
//!
//! Each row has its own file; the ratio column is the row's MB/s over `raw`'s at that size.
//!
//! Every row also reports the CPU seconds per GiB it moved ([`crate::cpu::CpuMeter`]),
//! summed over the processes involved: this process (which runs the raw engine, the library
//! and the libnfs client, and makes the mount's system calls) and, by row, fio; `sanfs-mds`
//! (direct, mount, proxied); the agent (mount); ganesha (nfs). The mount row also records
//! the agent's per-stage counters over the row (`sanfs-agent status`, through its control
//! socket) and its CPU by thread; the raw, direct and proxied rows this process's own stage
//! counters: the breakdown of where each path spends its time.

use std::process::Command;
use std::sync::Arc;

use anyhow::Context;
use sanfs_blockmap::plan::{PlanMethod, PlanOp, plan};
use sanfs_client_agent::client::Client;
use sanfs_proto::model::OpenFlags;
use sanfs_proto::types::{Credentials, ROOT_INODE};

use sanfs_client_agent::stages::{self, StageStat};

use crate::cluster::BenchCluster;
use crate::cpu::{CpuMeter, ThreadCpu, ThreadMeter};
use crate::env::{Env, raw_engine};
use crate::io::{LibFile, Op, RawFile, Target, fill, run};
use crate::nfs::NfsBench;
use crate::util::{Budget, KIB, MIB, pow2_sizes, size_label, which};

/// The rows of figure 6, in table order.
pub const PATHS: [&str; 6] = ["raw", "fio", "direct", "mount", "proxied", "nfs"];

/// One measured cell.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Cell {
    pub path: &'static str,
    pub op: Op,
    pub size: u64,
    pub mb_s: f64,
    /// MB/s over the `raw` row's at the same size and op (over several runs: the median).
    pub ratio: Option<f64>,
    /// Over several runs ([`median_of`]): the lowest and highest ratio.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ratio_spread: Option<(f64, f64)>,
    pub ops: u64,
    /// Bytes the row moved.
    #[serde(default)]
    pub bytes: u64,
    /// CPU seconds over the row, summed over the processes involved (see the module
    /// documentation), and per GiB moved.
    #[serde(default)]
    pub cpu_s: Option<f64>,
    #[serde(default)]
    pub cpu_s_per_gib: Option<f64>,
    /// The data path's stages during the row (`sanfs_client_agent::stages`): the agent's for
    /// the mount row, this process's for the raw, direct and proxied rows.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stages: Vec<StageStat>,
    /// The agent's CPU by thread over the mount row.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub agent_threads: Vec<ThreadCpu>,
}

/// Figure 6's results.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Fig6 {
    pub file_len: u64,
    pub sizes: Vec<u64>,
    pub cells: Vec<Cell>,
    /// Whether the LUN was a loop device (false: a plain file).
    pub loop_lun: bool,
    /// NFS rsize / wsize libnfs negotiated with ganesha.
    pub nfs_rw_max: Option<(u64, u64)>,
    /// Rows not measured, and why.
    pub skipped: Vec<String>,
    /// How many runs the cells are the median of.
    pub runs: u32,
}

/// Figure 6 measured several times, as one: each cell is the run whose MB/s is the median
/// (its stages and CPU by thread with it), its MB/s, ratio and CPU per GiB the medians over
/// the runs, and [`Cell::ratio_spread`] the lowest and highest ratio. The cells, and the
/// rows skipped, are the first run's.
pub fn median_of(runs: &[Fig6]) -> Option<Fig6> {
    let first = runs.first()?;
    let median = |mut v: Vec<f64>| -> Option<f64> {
        v.sort_by(f64::total_cmp);
        v.get(v.len().saturating_sub(1) / 2).copied()
    };
    let mut out = Fig6 {
        cells: Vec::new(),
        runs: u32::try_from(runs.len()).unwrap_or(u32::MAX),
        ..first.clone()
    };
    for c in &first.cells {
        let mut same: Vec<&Cell> = runs
            .iter()
            .filter_map(|f| f.get(c.path, c.op, c.size))
            .collect();
        same.sort_by(|a, b| a.mb_s.total_cmp(&b.mb_s));
        let Some(mid) = same.get(same.len().saturating_sub(1) / 2) else {
            continue;
        };
        let ratios: Vec<f64> = same.iter().filter_map(|c| c.ratio).collect();
        let cpus: Vec<f64> = same.iter().filter_map(|c| c.cpu_s_per_gib).collect();
        let spread = ratios
            .iter()
            .copied()
            .fold(None, |acc: Option<(f64, f64)>, r| {
                Some(acc.map_or((r, r), |(lo, hi)| (lo.min(r), hi.max(r))))
            });
        out.cells.push(Cell {
            mb_s: mid.mb_s,
            ratio: median(ratios),
            ratio_spread: spread,
            cpu_s_per_gib: median(cpus),
            ..(*mid).clone()
        });
    }
    Some(out)
}

impl Fig6 {
    pub fn get(&self, path: &str, op: Op, size: u64) -> Option<&Cell> {
        self.cells
            .iter()
            .find(|c| c.path == path && c.op == op && c.size == size)
    }
}

/// Which rows to measure.
#[derive(Debug, Clone, Copy)]
pub struct Rows {
    pub raw: bool,
    pub mount: bool,
    pub nfs: bool,
}

/// Creates (or opens) `name` in the root directory through `client`, `len` bytes of data.
pub async fn lib_file(
    client: &Arc<Client>,
    name: &str,
    len: u64,
    prefill: bool,
) -> anyhow::Result<LibFile> {
    let flags = OpenFlags {
        read: true,
        write: true,
        append: false,
        truncate: false,
    };
    let c = client
        .create(&Credentials::root(), ROOT_INODE, name, 0o644, false, flags)
        .await
        .with_context(|| format!("create {name}"))?;
    let f = LibFile {
        client: Arc::clone(client),
        fh: c.handle,
        ino: c.attr.ino,
        len,
    };
    if prefill && c.attr.size < len {
        fill(&f, 8 * MIB).await?;
    }
    Ok(f)
}

/// A library client of `cluster` with its own threshold.
pub async fn client_with_threshold(
    cluster: &BenchCluster,
    name: &str,
    threshold: Option<u64>,
) -> anyhow::Result<Arc<Client>> {
    let mut cfg = cluster.client_config(name);
    cfg.direct_io_threshold = threshold;
    Ok(Arc::new(BenchCluster::connect(cfg).await?))
}

/// The fio cross-check of the raw row: the same blocks, queue depth 1, `O_DIRECT`.
struct Fio {
    device: String,
    offset: u64,
    len: u64,
}

impl Fio {
    fn run(&self, op: Op, size: u64, budget: Budget) -> anyhow::Result<crate::io::Sample> {
        let runtime_ms = ((budget.secs * 1000.0) as u64).max(20);
        let engines = ["io_uring", "psync"];
        let mut last = None;
        for engine in engines {
            let out = Command::new("fio")
                .arg("--name=sanfs-bench")
                .arg(format!("--filename={}", self.device))
                .arg("--direct=1")
                .arg(format!("--rw={}", op.name()))
                .arg(format!("--bs={size}"))
                .arg(format!("--ioengine={engine}"))
                .arg("--iodepth=1")
                .arg(format!("--offset={}", self.offset))
                .arg(format!("--size={}", self.len))
                .arg("--time_based")
                .arg(format!("--runtime={runtime_ms}ms"))
                .arg("--output-format=json")
                .output()
                .context("run fio")?;
            if !out.status.success() {
                last = Some(String::from_utf8_lossy(&out.stderr).into_owned());
                continue;
            }
            let v: serde_json::Value = serde_json::from_slice(&out.stdout).context("fio's JSON")?;
            let job = &v["jobs"][0][op.name()];
            let bw = job["bw_bytes"]
                .as_f64()
                .context("fio's JSON has no bw_bytes")?;
            let ops = job["total_ios"].as_u64().unwrap_or(0);
            let bytes = job["io_bytes"].as_u64().unwrap_or(0);
            let secs = job["runtime"].as_f64().map_or(budget.secs, |ms| ms / 1e3);
            return Ok(crate::io::Sample {
                ops,
                bytes,
                secs,
                mb_s: bw / 1e6,
            });
        }
        anyhow::bail!("fio failed: {}", last.unwrap_or_default().trim())
    }
}

/// Runs figure 6 at `sizes` with the rows `rows` asks for.
pub async fn run_fig6(env: &Env, sizes: &[u64], rows: Rows) -> anyhow::Result<Fig6> {
    let len = env.file_len();
    let mut fig = Fig6 {
        file_len: len,
        sizes: sizes.to_vec(),
        runs: 1,
        ..Fig6::default()
    };
    let cluster = env.cluster("f6", 1, None, 4 * len + 64 * MIB).await?;
    fig.loop_lun = cluster.loop_luns;
    let direct = client_with_threshold(&cluster, "bench-direct", Some(0)).await?;
    let proxied = client_with_threshold(&cluster, "bench-proxied", Some(u64::MAX)).await?;
    let bar = env.bar(3, "fig6 setup");
    bar.set_message("writing the files");
    let direct_file = lib_file(&direct, "fig6-direct", len, true).await?;
    bar.inc(1);
    let proxied_file = lib_file(&proxied, "fig6-proxied", len, true).await?;
    bar.inc(1);
    // Raw: the direct file's own blocks.
    let raw = if rows.raw {
        let volume = direct.volume().as_ref().clone();
        let extents = cluster.extents(&direct, direct_file.ino).await?;
        let engine = raw_engine(&volume, &cluster.globs)?;
        Some(Arc::new(RawFile {
            engine,
            volume,
            extents,
            len,
        }))
    } else {
        fig.skipped.push("raw: not asked for".into());
        None
    };
    let fio = match (&raw, which("fio")) {
        (None, _) => None,
        (Some(_), None) => {
            fig.skipped
                .push("fio: not installed (apt-get install fio)".into());
            None
        }
        (Some(r), Some(_)) => {
            let p = plan(
                PlanOp::Read,
                0,
                len,
                &r.extents,
                &r.volume,
                PlanMethod::Coalesced,
            )?;
            match p.device_ios.as_slice() {
                [io] if io.len == len => Some(Fio {
                    device: cluster
                        .lun_paths
                        .get(io.device.as_usize())
                        .map(|p| p.to_string_lossy().into_owned())
                        .unwrap_or_default(),
                    offset: io.phys_off,
                    len,
                }),
                _ => {
                    fig.skipped
                        .push("fio: the file is not one contiguous run on one LUN".into());
                    None
                }
            }
            .filter(|f| !f.device.is_empty())
        }
    };
    let mount = if rows.mount {
        match env.mount(&cluster, "f6") {
            Ok(m) => Some(m),
            Err(why) => {
                fig.skipped.push(format!("mount: {why}"));
                None
            }
        }
    } else {
        None
    };
    let mount_file = match &mount {
        Some(m) => {
            bar.set_message("writing the mount's file");
            let path = m.path().join("fig6-mount");
            let f = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(&path)
                .with_context(|| format!("open {}", path.display()))?;
            let f = Arc::new(f);
            let t = Target::Path(Arc::clone(&f), len);
            // Written once, so that reads read data.
            run(
                &t,
                Op::Write,
                8 * MIB,
                Budget::new(0.0, len / (8 * MIB), len / (8 * MIB)),
            )
            .await?;
            f.sync_all()?;
            Some(t)
        }
        None => None,
    };
    bar.inc(1);
    bar.finish_and_clear();
    let nfs = if rows.nfs {
        match NfsBench::start(&env.work, 4 * len + 64 * MIB, len) {
            Ok(n) => {
                fig.nfs_rw_max = Some((n.readmax, n.writemax));
                Some(n)
            }
            Err(e) => {
                fig.skipped.push(format!("nfs: {e:#}"));
                None
            }
        }
    } else {
        None
    };
    let raw_t = raw.map(Target::Raw);
    let direct_t = Target::Lib(Arc::new(direct_file));
    let proxied_t = Target::Lib(Arc::new(proxied_file));
    let budget = env.cell_budget();
    let cells_per_size = 2 * PATHS.len() as u64;
    let bar = env.bar(sizes.len() as u64 * cells_per_size, "fig6");
    for &size in sizes {
        for op in [Op::Read, Op::Write] {
            let mut raw_mb = None;
            for path in PATHS {
                bar.set_message(format!("{path} {} {}", op.name(), size_label(size)));
                // The processes of this row besides this one.
                let mut pids: Vec<u32> = Vec::new();
                if matches!(path, "direct" | "mount" | "proxied") {
                    pids.extend(cluster.server_pid());
                }
                if path == "mount" {
                    pids.extend(mount.as_ref().and_then(|m| m.agent_pid()));
                }
                if path == "nfs" {
                    pids.extend(nfs.as_ref().map_or(Vec::new(), |n| n.pids()));
                }
                let agent = mount
                    .as_ref()
                    .filter(|_| path == "mount")
                    .and_then(|m| m.agent_pid());
                let threads = agent.map(ThreadMeter::start);
                let stages0 = match path {
                    "mount" => mount.as_ref().and_then(|m| m.agent_stages()),
                    "raw" | "direct" | "proxied" => Some(stages::snapshot()),
                    _ => None,
                };
                let meter = CpuMeter::start(pids).with_children();
                let measured = match path {
                    "raw" => match &raw_t {
                        Some(t) => Some(run(t, op, size, budget).await?),
                        None => None,
                    },
                    "fio" => match &fio {
                        Some(f) => match f.run(op, size, budget) {
                            Ok(s) => Some(s),
                            Err(e) => {
                                fig.skipped.push(format!("fio {} {size}: {e:#}", op.name()));
                                None
                            }
                        },
                        None => None,
                    },
                    "direct" => Some(run(&direct_t, op, size, budget).await?),
                    "mount" => match &mount_file {
                        Some(t) => Some(run(t, op, size, budget).await?),
                        None => None,
                    },
                    "proxied" => Some(run(&proxied_t, op, size, budget).await?),
                    _ => match &nfs {
                        Some(n) => Some(n.run(op, size, budget)?),
                        None => None,
                    },
                };
                let Some(s) = measured else {
                    bar.inc(1);
                    continue;
                };
                let used = meter.finish(s.bytes);
                let stages = match (path, stages0) {
                    ("mount", Some(before)) => mount
                        .as_ref()
                        .and_then(|m| m.agent_stages())
                        .map(|after| stages::delta(&after, &before)),
                    (_, Some(before)) => Some(stages::delta(&stages::snapshot(), &before)),
                    _ => None,
                }
                .map(|v| v.into_iter().filter(|s| s.calls > 0).collect())
                .unwrap_or_default();
                bar.inc(1);
                if path == "raw" {
                    raw_mb = Some(s.mb_s);
                }
                fig.cells.push(Cell {
                    path,
                    op,
                    size,
                    mb_s: s.mb_s,
                    ratio: raw_mb.map(|r| s.mb_s / r.max(1e-9)),
                    ratio_spread: None,
                    ops: s.ops,
                    bytes: s.bytes,
                    cpu_s: Some(used.cpu_s),
                    cpu_s_per_gib: used.cpu_s_per_gib,
                    stages,
                    agent_threads: threads.map(|t| t.finish()).unwrap_or_default(),
                });
            }
        }
    }
    bar.finish_and_clear();
    drop(nfs);
    drop(mount_file);
    drop(mount);
    Ok(fig)
}

impl Fig6 {
    /// The sizes whose stage breakdown the table shows: 128 KiB and 1 MiB (else the largest).
    fn breakdown_sizes(&self) -> Vec<u64> {
        let v: Vec<u64> = [128 * KIB, MIB]
            .into_iter()
            .filter(|s| self.sizes.contains(s))
            .collect();
        if v.is_empty() {
            self.sizes.iter().copied().max().into_iter().collect()
        } else {
            v
        }
    }

    /// Where the mount row's time and CPU went, per FUSE request, and the agent's CPU by
    /// thread (the whole of every row is in the JSON).
    fn fmt_breakdown(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for size in self.breakdown_sizes() {
            for op in [Op::Read, Op::Write] {
                let Some(c) = self.get("mount", op, size).filter(|c| !c.stages.is_empty()) else {
                    continue;
                };
                let fuse = if op == Op::Read {
                    "fuse-read"
                } else {
                    "fuse-write"
                };
                let requests = c
                    .stages
                    .iter()
                    .find(|s| s.stage == fuse)
                    .map_or(0, |s| s.calls)
                    .max(1);
                writeln!(
                    f,
                    "mount {} {}: {} FUSE requests for {} I/Os; per request:",
                    op.name(),
                    size_label(size),
                    requests,
                    c.ops
                )?;
                writeln!(
                    f,
                    "  {:<17} {:>9} {:>9} {:>9}",
                    "stage", "calls", "wall us", "CPU us"
                )?;
                let per = |x: u64| x as f64 / requests as f64;
                for s in &c.stages {
                    writeln!(
                        f,
                        "  {:<17} {:>9.2} {:>9.1} {:>9}",
                        s.stage,
                        per(s.calls),
                        per(s.wall_ns) / 1e3,
                        if s.cpu_ns > 0 {
                            format!("{:.1}", per(s.cpu_ns) / 1e3)
                        } else {
                            "-".into()
                        }
                    )?;
                }
                if !c.agent_threads.is_empty() && c.bytes > 0 {
                    let gib = c.bytes as f64 / crate::util::GIB as f64;
                    let threads: Vec<String> = c
                        .agent_threads
                        .iter()
                        .filter(|t| t.cpu_s > 0.0)
                        .map(|t| format!("{} {:.2}", t.name, t.cpu_s / gib))
                        .collect();
                    writeln!(f, "  agent CPU s/GiB by thread: {}", threads.join(", "))?;
                }
            }
        }
        Ok(())
    }
}

/// The default sizes: 4 KiB to 8 MiB.
pub fn default_sizes(env: &Env) -> Vec<u64> {
    env.sizes_or(env.pick(
        pow2_sizes(4 * KIB, 8 * MIB),
        pow2_sizes(4 * KIB, 8 * MIB),
        vec![4 * KIB, 64 * KIB, MIB],
    ))
}

impl std::fmt::Display for Fig6 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "Figure 6: throughput vs I/O size, queue depth 1, one LUN ({}), files of {} MiB",
            if self.loop_lun {
                "loop device, direct I/O"
            } else {
                "plain file"
            },
            self.file_len / MIB
        )?;
        for op in [Op::Read, Op::Write] {
            write!(f, "{:<6} {:<5}", op.name(), "size")?;
            let present: Vec<&str> = PATHS
                .iter()
                .copied()
                .filter(|p| self.cells.iter().any(|c| c.path == *p))
                .collect();
            for p in &present {
                if *p == "raw" {
                    write!(f, " {:>9}", "raw MB/s")?;
                } else {
                    write!(f, " {:>9} {:>6}", format!("{p} MB/s"), "ratio")?;
                }
            }
            writeln!(f)?;
            for &size in &self.sizes {
                write!(f, "{:<6} {:<5}", "", size_label(size))?;
                for p in &present {
                    match self.get(p, op, size) {
                        Some(c) if *p == "raw" => write!(f, " {:>9.1}", c.mb_s)?,
                        Some(c) => write!(
                            f,
                            " {:>9.1} {:>6}",
                            c.mb_s,
                            c.ratio
                                .map_or("-".to_owned(), |r| format!("{:.0}%", r * 100.0))
                        )?,
                        None if *p == "raw" => write!(f, " {:>9}", "-")?,
                        None => write!(f, " {:>9} {:>6}", "-", "")?,
                    }
                }
                writeln!(f)?;
            }
            // CPU seconds per GiB moved, every process of the row.
            write!(f, "{:<6} {:<5}", op.name(), "size")?;
            for p in &present {
                write!(f, " {:>9}", format!("{p} s/G"))?;
            }
            writeln!(f, "  (CPU seconds per GiB)")?;
            for &size in &self.sizes {
                write!(f, "{:<6} {:<5}", "", size_label(size))?;
                for p in &present {
                    match self.get(p, op, size).and_then(|c| c.cpu_s_per_gib) {
                        Some(cpu) => write!(f, " {cpu:>9.2}")?,
                        None => write!(f, " {:>9}", "-")?,
                    }
                }
                writeln!(f)?;
            }
        }
        self.fmt_spread(f)?;
        self.fmt_breakdown(f)?;
        if let Some((r, w)) = self.nfs_rw_max {
            writeln!(
                f,
                "nfs: ganesha (VFS) on ext4 over an equal LUN, libnfs NFSv3 rsize {} wsize {}",
                size_label(r),
                size_label(w)
            )?;
        }
        for s in &self.skipped {
            writeln!(f, "skipped: {s}")?;
        }
        Ok(())
    }
}

impl Fig6 {
    /// Over several runs: each row's ratio to raw as lowest, median and highest.
    fn fmt_spread(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.runs < 2 {
            return Ok(());
        }
        writeln!(
            f,
            "ratio to raw over {} runs (lowest-median-highest); MB/s and CPU above are medians",
            self.runs
        )?;
        for op in [Op::Read, Op::Write] {
            for &size in &self.sizes {
                write!(f, "{:<6} {:<5}", op.name(), size_label(size))?;
                for p in PATHS.iter().filter(|p| **p != "raw") {
                    if let Some(c) = self.get(p, op, size)
                        && let (Some(r), Some((lo, hi))) = (c.ratio, c.ratio_spread)
                    {
                        write!(
                            f,
                            "  {p} {:.0}-{:.0}-{:.0}%",
                            lo * 100.0,
                            r * 100.0,
                            hi * 100.0
                        )?;
                    }
                }
                writeln!(f)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cell(path: &'static str, mb_s: f64, ratio: f64, cpu: f64) -> Cell {
        Cell {
            path,
            op: Op::Write,
            size: MIB,
            mb_s,
            ratio: Some(ratio),
            ratio_spread: None,
            ops: 1,
            bytes: MIB,
            cpu_s: Some(cpu),
            cpu_s_per_gib: Some(cpu),
            stages: Vec::new(),
            agent_threads: Vec::new(),
        }
    }

    fn run(mount: (f64, f64, f64)) -> Fig6 {
        Fig6 {
            sizes: vec![MIB],
            cells: vec![
                cell("raw", 1000.0, 1.0, 0.1),
                cell("mount", mount.0, mount.1, mount.2),
            ],
            runs: 1,
            ..Fig6::default()
        }
    }

    #[test]
    fn several_runs_give_each_cells_median_and_the_spread_of_its_ratio() {
        let runs = [
            run((900.0, 0.9, 0.5)),
            run((600.0, 0.6, 0.7)),
            run((800.0, 0.95, 0.4)),
            run((700.0, 0.7, 0.6)),
            run((1000.0, 0.8, 0.3)),
        ];
        let m = median_of(&runs).unwrap();
        assert_eq!(m.runs, 5);
        let c = m.get("mount", Op::Write, MIB).unwrap();
        assert_eq!(c.mb_s, 800.0);
        assert_eq!(c.ratio, Some(0.8));
        assert_eq!(c.ratio_spread, Some((0.6, 0.95)));
        assert_eq!(c.cpu_s_per_gib, Some(0.5));
        assert!(m.to_string().contains("mount 60-80-95%"), "{m}");
        assert_eq!(
            m.get("raw", Op::Write, MIB).unwrap().ratio_spread,
            Some((1.0, 1.0))
        );
        assert!(median_of(&[]).is_none());
    }
}
