//! The whole run's result: every figure measured, the machine, the goals checked against the
//! numbers, the tables on stdout, JSON and the PNG plots.

use std::path::Path;

use anyhow::Context;

use crate::env::Length;
use crate::fig6::Fig6;
use crate::fig7::Fig7;
use crate::fig8::Fig8;
use crate::fig10::Fig10;
use crate::io::Op;
use crate::latency::LatencyReport;
use crate::mdfig::MdFig;
use crate::plot::{Chart, Series, XAxis, draw};
use crate::threshold::Threshold;
use crate::util::{KIB, MIB, size_label};

/// Where the run happened.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Machine {
    pub hostname: String,
    pub kernel: String,
    pub cpus: usize,
    pub cpu_model: String,
    pub mem_gib: f64,
    /// How the server ran: `process` or `in-process` (or `existing`).
    pub server: String,
}

impl Machine {
    pub fn probe() -> Machine {
        let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
        let cpuinfo = read("/proc/cpuinfo");
        let meminfo = read("/proc/meminfo");
        Machine {
            hostname: read("/proc/sys/kernel/hostname").trim().to_owned(),
            kernel: read("/proc/sys/kernel/osrelease").trim().to_owned(),
            cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
            cpu_model: cpuinfo
                .lines()
                .find_map(|l| l.strip_prefix("model name"))
                .map(|l| l.trim_start_matches([' ', '\t', ':']).to_owned())
                .unwrap_or_default(),
            mem_gib: meminfo
                .lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))
                .and_then(|l| l.trim().trim_end_matches(" kB").trim().parse::<f64>().ok())
                .map_or(0.0, |kb| kb / 1024.0 / 1024.0),
            server: String::new(),
        }
    }
}

/// One goal of issue 7, checked.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Goal {
    pub what: String,
    pub goal: String,
    pub measured: String,
    pub met: bool,
}

/// Everything one run measured.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Report {
    pub command: String,
    pub length: Option<Length>,
    pub machine: Machine,
    pub seconds: f64,
    pub latency: Option<LatencyReport>,
    pub fig6: Option<Fig6>,
    pub threshold: Option<Threshold>,
    pub fig7: Option<Fig7>,
    pub fig8: Option<Fig8>,
    pub fig10: Option<Fig10>,
    pub metadata: Option<MdFig>,
    pub everyday: Option<crate::everyday::Everyday>,
    pub metadata_mount: Option<crate::mdmount::MdMount>,
    /// Failover of two HA servers: the kill -9 row, then the SIGTERM (rolling restart) row.
    pub failover: Vec<crate::failover::FailoverOutcome>,
    /// Why the failover rows were not measured (no root, no etcd, ...).
    pub failover_skipped: Option<String>,
    pub goals: Vec<Goal>,
    /// Parts that failed, with their errors (the rest of the run went on).
    pub errors: Vec<String>,
}

fn pct(x: f64) -> String {
    format!("{:.1}%", x * 100.0)
}

impl Report {
    /// Checks the goals against what was measured.
    pub fn check_goals(&mut self) {
        let mut goals = Vec::new();
        if let Some(f) = &self.fig6 {
            for (size, goal) in [
                (64 * KIB, 0.90),
                (128 * KIB, 0.95),
                (MIB, 0.97),
                (8 * MIB, 0.97),
            ] {
                for op in [Op::Read, Op::Write] {
                    if let Some(r) = f.get("direct", op, size).and_then(|c| c.ratio) {
                        goals.push(Goal {
                            what: format!("direct / raw, {} {}", op.name(), size_label(size)),
                            goal: format!(">= {:.0}%", goal * 100.0),
                            measured: pct(r),
                            met: r >= goal,
                        });
                    }
                }
            }
            // Issue 20: through the mount at >= 90% of raw O_DIRECT for 1 MiB and 8 MiB, >= 80%
            // for 128 KiB (over several runs, the median: `--fig6-runs 5`).
            for (size, goal) in [(128 * KIB, 0.80), (MIB, 0.90), (8 * MIB, 0.90)] {
                for op in [Op::Read, Op::Write] {
                    if let Some(c) = f.get("mount", op, size)
                        && let Some(r) = c.ratio
                    {
                        let spread = c.ratio_spread.map_or(String::new(), |(lo, hi)| {
                            format!(" ({} runs: {}-{})", f.runs, pct(lo), pct(hi))
                        });
                        goals.push(Goal {
                            what: format!("mount / raw, {} {}", op.name(), size_label(size)),
                            goal: format!(">= {:.0}%", goal * 100.0),
                            measured: format!("{}{spread}", pct(r)),
                            met: r >= goal,
                        });
                    }
                }
            }
            // Issue 20: the mount's CPU per GiB at most twice the raw engine's.
            for size in [MIB, 8 * MIB] {
                for op in [Op::Read, Op::Write] {
                    let cpu = |p: &str| f.get(p, op, size).and_then(|c| c.cpu_s_per_gib);
                    if let (Some(m), Some(r)) = (cpu("mount"), cpu("raw")) {
                        let x = m / r.max(1e-9);
                        goals.push(Goal {
                            what: format!(
                                "mount CPU / raw CPU per GiB, {} {}",
                                op.name(),
                                size_label(size)
                            ),
                            goal: "<= 2x".into(),
                            measured: format!("{x:.1}x ({m:.2} vs {r:.2} s/GiB)"),
                            met: x <= 2.0,
                        });
                    }
                }
            }
            let large = f.sizes.iter().copied().filter(|s| *s >= MIB).max();
            if let Some(size) = large {
                for op in [Op::Read, Op::Write] {
                    let Some(d) = f.get("direct", op, size) else {
                        continue;
                    };
                    for other in ["proxied", "nfs"] {
                        if let Some(o) = f.get(other, op, size) {
                            goals.push(Goal {
                                what: format!(
                                    "{other} below direct, {} {}",
                                    op.name(),
                                    size_label(size)
                                ),
                                goal: "< direct".into(),
                                measured: format!(
                                    "{:.0} vs {:.0} MB/s ({} of direct, {} of raw)",
                                    o.mb_s,
                                    d.mb_s,
                                    pct(o.mb_s / d.mb_s.max(1e-9)),
                                    o.ratio.map_or("-".into(), pct)
                                ),
                                met: o.mb_s < d.mb_s,
                            });
                        }
                    }
                }
            }
        }
        if let Some(f) = &self.fig7
            && let Some(r) = f.rows.iter().find(|r| r.luns == 4)
        {
            goals.push(Goal {
                what: "striping, 4 LUNs vs 4 x 1 LUN".into(),
                goal: ">= 95%".into(),
                measured: pct(r.ratio),
                met: r.ratio >= 0.95,
            });
        }
        if let Some(f) = &self.fig8 {
            for op in [Op::Read, Op::Write] {
                let pick = |m: &str| -> Vec<f64> {
                    f.rows
                        .iter()
                        .filter(|r| r.method == m && r.op == op)
                        .map(|r| r.rpcs_per_io)
                        .collect()
                };
                let (a, b) = (pick("A"), pick("B"));
                if let (Some(a0), Some(a1), Some(b0), Some(b1)) =
                    (a.first(), a.last(), b.first(), b.last())
                {
                    goals.push(Goal {
                        what: format!("method B flat, method A growing ({})", op.name()),
                        goal: "B last/first <= 1.5, A last/first >= 4".into(),
                        measured: format!(
                            "A {a0:.1} -> {a1:.1} RPC/IO, B {b0:.1} -> {b1:.1} RPC/IO"
                        ),
                        met: b1 / b0.max(1e-9) <= 1.5 && a1 / a0.max(1e-9) >= 4.0,
                    });
                }
            }
        }
        // The paper's figure is LUN-bound: its goal is checked on the pass with every LUN
        // capped where it ran; the uncapped pass (bound by this machine's CPUs) is reported.
        if let Some(f) = &self.fig10 {
            if let Some(s) = f.capped_spread_2_up {
                goals.push(Goal {
                    what: "process spread, 2..8 processes, LUNs capped".into(),
                    goal: "<= 3%".into(),
                    measured: pct(s),
                    met: s <= 0.03,
                });
            }
            if let Some(s) = f.spread_2_up {
                let capped = f.capped_spread_2_up.is_some();
                goals.push(Goal {
                    what: "process spread, 2..8 processes, LUNs uncapped".into(),
                    goal: if capped { "reported" } else { "<= 3%" }.into(),
                    measured: pct(s),
                    met: capped || s <= 0.03,
                });
            }
        }
        if let Some(t) = &self.threshold {
            goals.push(Goal {
                what: "crossover (direct faster than proxied from)".into(),
                goal: "measured".into(),
                measured: t
                    .crossovers
                    .iter()
                    .map(|c| {
                        format!(
                            "{} {}",
                            c.op.name(),
                            c.size.map_or("never".into(), size_label)
                        )
                    })
                    .collect::<Vec<_>>()
                    .join(", "),
                met: t.recommended.is_some(),
            });
        }
        self.goals = goals;
    }

    /// Writes the PNG plots into `dir`; returns the files written.
    pub fn plots(&self, dir: &Path) -> anyhow::Result<Vec<std::path::PathBuf>> {
        std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
        let mut charts: Vec<(&str, Chart)> = Vec::new();
        if let Some(f) = &self.fig6 {
            for op in [Op::Read, Op::Write] {
                let mut series = Vec::new();
                for path in crate::fig6::PATHS {
                    let pts: Vec<(f64, f64)> = f
                        .cells
                        .iter()
                        .filter(|c| c.path == path && c.op == op)
                        .map(|c| (c.size as f64, c.mb_s))
                        .collect();
                    if pts.is_empty() {
                        continue;
                    }
                    let name = match path {
                        "raw" => "raw O_DIRECT (limit)",
                        "fio" => "fio (check)",
                        "direct" => "sanfs direct (library)",
                        "mount" => "sanfs FUSE mount",
                        "proxied" => "sanfs proxied",
                        _ => "NFS (ganesha + libnfs)",
                    };
                    let s = Series::new(name, pts);
                    series.push(if matches!(path, "raw" | "fio" | "nfs") {
                        s.dashed()
                    } else {
                        s
                    });
                }
                // CPU seconds per GiB, every row that has them.
                let cpu_series: Vec<Series> = crate::fig6::PATHS
                    .iter()
                    .filter_map(|path| {
                        let pts: Vec<(f64, f64)> = f
                            .cells
                            .iter()
                            .filter(|c| c.path == *path && c.op == op)
                            .filter_map(|c| Some((c.size as f64, c.cpu_s_per_gib?)))
                            .collect();
                        (!pts.is_empty()).then(|| {
                            let s = Series::new(*path, pts);
                            if matches!(*path, "raw" | "fio" | "nfs") {
                                s.dashed()
                            } else {
                                s
                            }
                        })
                    })
                    .collect();
                if !cpu_series.is_empty() {
                    charts.push((
                        if op == Op::Read {
                            "fig6-cpu-read.png"
                        } else {
                            "fig6-cpu-write.png"
                        },
                        Chart {
                            title: format!("Figure 6: CPU per GiB, {}", op.name()),
                            x_label: "I/O size".into(),
                            y_label: "CPU s per GiB".into(),
                            x_axis: XAxis::Log2Bytes,
                            series: cpu_series,
                        },
                    ));
                }
                charts.push((
                    if op == Op::Read {
                        "fig6-read.png"
                    } else {
                        "fig6-write.png"
                    },
                    Chart {
                        title: format!("Figure 6: {} throughput vs I/O size", op.name()),
                        x_label: "I/O size".into(),
                        y_label: "MB/s".into(),
                        x_axis: XAxis::Log2Bytes,
                        series,
                    },
                ));
            }
        }
        if let Some(f) = &self.fig7
            && !f.rows.is_empty()
        {
            let pts = |g: fn(&crate::fig7::StripeRow) -> f64| -> Vec<(f64, f64)> {
                f.rows.iter().map(|r| (r.luns as f64, g(r))).collect()
            };
            charts.push((
                "fig7.png",
                Chart {
                    title: "Figure 7: striping, 2 MiB reads, capped LUNs".into(),
                    x_label: "LUNs".into(),
                    y_label: "MB/s".into(),
                    x_axis: XAxis::Linear,
                    series: vec![
                        Series::new("sanfs (measured)", pts(|r| r.mb_s)),
                        Series::new("theory (N x 1 LUN)", pts(|r| r.theory_mb_s)).dashed(),
                        Series::new("raw O_DIRECT", pts(|r| r.raw_mb_s)).dashed(),
                    ],
                },
            ));
        }
        if let Some(f) = &self.fig8
            && !f.rows.is_empty()
        {
            for (file, title, y, get) in [
                (
                    "fig8.png",
                    "Figure 8: control messages per I/O (4 stripes)",
                    "RPCs per I/O",
                    (|r: &crate::fig8::MethodRow| r.rpcs_per_io)
                        as fn(&crate::fig8::MethodRow) -> f64,
                ),
                (
                    "fig9.png",
                    "Figure 9: agent CPU time per GiB (4 stripes)",
                    "CPU ms per GiB",
                    |r: &crate::fig8::MethodRow| r.cpu_ms_per_gib,
                ),
            ] {
                let mut series = Vec::new();
                for m in ["A", "B"] {
                    for op in [Op::Read, Op::Write] {
                        let pts = f
                            .rows
                            .iter()
                            .filter(|r| r.method == m && r.op == op)
                            .map(|r| (r.size as f64, get(r)))
                            .collect();
                        let s = Series::new(format!("method {m}, {}", op.name()), pts);
                        series.push(if m == "A" { s.dashed() } else { s });
                    }
                }
                charts.push((
                    file,
                    Chart {
                        title: title.into(),
                        x_label: "I/O size".into(),
                        y_label: y.into(),
                        x_axis: XAxis::Log2Bytes,
                        series,
                    },
                ));
            }
        }
        if let Some(f) = &self.fig10
            && !f.rows.is_empty()
        {
            charts.push((
                "fig10.png",
                Chart {
                    title: format!("Figure 10: aggregate read throughput ({})", f.via),
                    x_label: "processes".into(),
                    y_label: "MB/s".into(),
                    x_axis: XAxis::Linear,
                    series: vec![Series::new(
                        "sum over processes",
                        f.rows
                            .iter()
                            .map(|r| (r.processes as f64, r.aggregate_mb_s))
                            .collect(),
                    )],
                },
            ));
        }
        if let Some(l) = &self.latency
            && !l.rows.is_empty()
        {
            let mut series = Vec::new();
            for what in ["grant-read", "grant-write", "proxied-read", "proxied-write"] {
                let pts = l
                    .rows
                    .iter()
                    .filter(|r| r.what == what)
                    .map(|r| (r.size as f64, r.median_us / 1000.0))
                    .collect();
                series.push(Series::new(what, pts));
            }
            charts.push((
                "latency.png",
                Chart {
                    title: "Control-message round trips (median)".into(),
                    x_label: "size".into(),
                    y_label: "ms".into(),
                    x_axis: XAxis::Log2Bytes,
                    series,
                },
            ));
        }
        if let Some(e) = &self.everyday
            && let Some(p) = &e.params
        {
            let mut series = Vec::new();
            for t in &e.targets {
                for op in ["seq write", "seq read", "read-only read"] {
                    let pts: Vec<(f64, f64)> = p
                        .seq_sizes
                        .iter()
                        .filter_map(|&size| {
                            let c = e.get(&format!("{op} {}", size_label(size)), t)?;
                            Some((size as f64, c.mb_s?))
                        })
                        .collect();
                    if !pts.is_empty() {
                        let s = Series::new(format!("{t} {op}"), pts);
                        series.push(if t == "sanfs" { s } else { s.dashed() });
                    }
                }
            }
            if !series.is_empty() {
                charts.push((
                    "everyday-seq.png",
                    Chart {
                        title: "Everyday: buffered sequential I/O".into(),
                        x_label: "I/O size".into(),
                        y_label: "MB/s".into(),
                        x_axis: XAxis::Log2Bytes,
                        series,
                    },
                ));
            }
        }
        if let Some(m) = &self.metadata_mount {
            let own = format!("{} processes, own dirs", m.processes);
            let mut series = Vec::new();
            for t in &m.targets {
                for op in ["create", "stat warm", "unlink"] {
                    let pts: Vec<(f64, f64)> =
                        [("1 process", 1.0), (own.as_str(), m.processes as f64)]
                            .iter()
                            .filter_map(|(config, x)| Some((*x, m.get(t, config, op)?.ops_per_s)))
                            .collect();
                    if !pts.is_empty() {
                        let s = Series::new(format!("{t} {op}"), pts);
                        series.push(if t == "sanfs" { s } else { s.dashed() });
                    }
                }
            }
            if !series.is_empty() {
                charts.push((
                    "metadata-mount.png",
                    Chart {
                        title: "Metadata through the mount (own directories)".into(),
                        x_label: "processes".into(),
                        y_label: "ops/s".into(),
                        x_axis: XAxis::Linear,
                        series,
                    },
                ));
            }
        }
        let mut written = Vec::new();
        for (file, chart) in charts {
            let p = dir.join(file);
            draw(&chart, &p)?;
            written.push(p);
        }
        Ok(written)
    }
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let m = &self.machine;
        writeln!(
            f,
            "sanfs-bench: {} | {} CPUs ({}), {:.1} GiB, kernel {}, server {}",
            self.command, m.cpus, m.cpu_model, m.mem_gib, m.kernel, m.server
        )?;
        writeln!(f)?;
        if let Some(x) = &self.latency {
            writeln!(f, "{x}")?;
        }
        if let Some(x) = &self.fig6 {
            writeln!(f, "{x}")?;
        }
        if let Some(x) = &self.threshold {
            writeln!(f, "{x}")?;
        }
        if let Some(x) = &self.fig7 {
            writeln!(f, "{x}")?;
        }
        if let Some(x) = &self.fig8 {
            writeln!(f, "{x}")?;
        }
        if let Some(x) = &self.fig10 {
            writeln!(f, "{x}")?;
        }
        if let Some(x) = &self.metadata {
            writeln!(f, "{x}")?;
        }
        if let Some(x) = &self.everyday {
            writeln!(f, "{x}")?;
        }
        if let Some(x) = &self.metadata_mount {
            writeln!(f, "{x}")?;
        }
        for x in &self.failover {
            writeln!(f, "{x}\n")?;
        }
        if let Some(why) = &self.failover_skipped {
            writeln!(f, "Failover: skipped: {why}\n")?;
        }
        if !self.goals.is_empty() {
            writeln!(f, "Goals (issues 7 and 20)")?;
            for g in &self.goals {
                writeln!(
                    f,
                    "  [{}] {:<44} goal {:<12} measured {}",
                    if g.met { "met " } else { "MISS" },
                    g.what,
                    g.goal,
                    g.measured
                )?;
            }
        }
        for e in &self.errors {
            writeln!(f, "error: {e}")?;
        }
        write!(f, "total time: {:.0} s", self.seconds)
    }
}
