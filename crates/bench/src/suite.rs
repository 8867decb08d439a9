//! Runs the asked-for figures in one go, each on the cluster it needs, and gathers them into
//! one [`Report`]. A figure that fails is recorded in the report and the run goes on.

use std::time::Instant;

use anyhow::Context as _;

use crate::env::Env;
use crate::fig6::{Rows, default_sizes, run_fig6};
use crate::report::{Machine, Report};
use crate::util::{KIB, MIB, pow2_sizes};

/// A part of the run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    Latency,
    Fig6,
    /// The crossover alone (figure 6's direct and proxied rows only).
    Threshold,
    Fig7,
    Fig8,
    Fig10,
    Metadata,
    /// Everyday I/O through the mount, with ext4 and MooseFS (issue 18).
    Everyday,
    /// Metadata operations through the mount, with ext4 and MooseFS (issue 19).
    MetadataMount,
    /// Two HA servers on etcd: the pause from a stop of the leader to the first completed I/O
    /// (issue 21).
    Failover,
}

/// Everything `sanfs-bench run` measures, in order.
pub const ALL: [Part; 9] = [
    Part::Latency,
    Part::Fig6,
    Part::Fig7,
    Part::Fig8,
    Part::Fig10,
    Part::Metadata,
    Part::Everyday,
    Part::MetadataMount,
    Part::Failover,
];

pub async fn run(env: &Env, parts: &[Part], command: String) -> Report {
    let started = Instant::now();
    let mut report = Report {
        command,
        length: Some(env.length),
        machine: Machine::probe(),
        ..Report::default()
    };
    report.machine.server = if env.existing.is_some() {
        "existing".into()
    } else if env.server_mode == crate::cluster::ServerMode::InProcess
        || crate::util::sibling_binary("sanfs-mds").is_none()
    {
        "in-process".into()
    } else {
        "sanfs-mds process".into()
    };
    for &part in parts {
        let r = match part {
            Part::Latency => latency(env, &mut report).await,
            Part::Fig6 => {
                let rows = Rows {
                    raw: true,
                    mount: true,
                    nfs: true,
                };
                fig6_runs(env, rows).await.map(|f| {
                    report.threshold = Some(crate::threshold::from_fig6(&f));
                    report.fig6 = Some(f);
                })
            }
            Part::Threshold => {
                let rows = Rows {
                    raw: false,
                    mount: false,
                    nfs: false,
                };
                let sizes = env.sizes_or(env.pick(
                    pow2_sizes(4 * KIB, 2 * MIB),
                    pow2_sizes(4 * KIB, MIB),
                    vec![16 * KIB, 256 * KIB],
                ));
                run_fig6(env, &sizes, rows).await.map(|f| {
                    report.threshold = Some(crate::threshold::from_fig6(&f));
                })
            }
            Part::Everyday => crate::everyday::run_everyday(env).await.map(|f| {
                missing_peers("Everyday", &f.skipped, &mut report);
                report.everyday = Some(f);
            }),
            Part::MetadataMount => crate::mdmount::run_md_mount(env).await.map(|f| {
                missing_peers("MetadataMount", &f.skipped, &mut report);
                report.metadata_mount = Some(f);
            }),
            Part::Failover => failover(env, &mut report).await,
            Part::Fig7 => crate::fig7::run_fig7(env)
                .await
                .map(|f| report.fig7 = Some(f)),
            Part::Fig8 | Part::Fig10 | Part::Metadata => {
                // One striped cluster (and mount) for the three, when run together.
                if parts
                    .iter()
                    .position(|p| matches!(p, Part::Fig8 | Part::Fig10 | Part::Metadata))
                    != parts.iter().position(|p| *p == part)
                {
                    continue;
                }
                striped_parts(env, parts, &mut report).await
            }
        };
        if let Err(e) = r {
            report.errors.push(format!("{part:?}: {e:#}"));
        }
    }
    report.check_goals();
    report.seconds = started.elapsed().as_secs_f64();
    report
}

/// Figure 6 `env.fig6_runs` times (each on a cluster of its own), as the median of the runs.
async fn fig6_runs(env: &Env, rows: Rows) -> anyhow::Result<crate::fig6::Fig6> {
    let mut runs = Vec::new();
    for _ in 0..env.fig6_runs.max(1) {
        runs.push(run_fig6(env, &default_sizes(env), rows).await?);
    }
    if runs.len() == 1 {
        return runs.pop().context("no run of figure 6");
    }
    crate::fig6::median_of(&runs).context("no run of figure 6")
}

/// Under `SANFS_REQUIRE_ROOT=1` a file system of a part that could not be set up (a missing
/// package, no root) fails the run, as a root-only test that cannot run does.
fn missing_peers(part: &str, skipped: &[String], report: &mut Report) {
    if sanfs_testcluster::required() {
        for s in skipped {
            report.errors.push(format!(
                "{part}: {s} ({}=1: every part must run whole)",
                sanfs_testcluster::REQUIRE_ENV
            ));
        }
    }
}

/// The failover rows: kill -9 of the leader (10 rounds; quick 5, smoke 1), then SIGTERM, a
/// rolling restart (5; quick 3; smoke 1). Skipped (a failure under
/// `SANFS_REQUIRE_ROOT=1`) without root, etcd or the sanfs-mds and sanfs-agent binaries.
async fn failover(env: &Env, report: &mut Report) -> anyhow::Result<()> {
    use crate::failover::{FailoverParams, StopHow, unavailable};
    if env.existing.is_some() {
        return Ok(());
    }
    if let Some(why) = unavailable() {
        report.failover_skipped = Some(why.clone());
        missing_peers("Failover", &[why], report);
        return Ok(());
    }
    for (stop, rounds) in [
        (StopHow::Kill, env.pick(10, 5, 1)),
        (StopHow::Term, env.pick(5, 3, 1)),
    ] {
        if rounds == 0 {
            continue;
        }
        let out = crate::failover::run(&FailoverParams {
            seed: 0x5a4f_0021 + rounds,
            rounds,
            stop,
            writers: 4,
            max_file_size: 8 * MIB,
            dir: env.work.clone(),
            check_timeout: std::time::Duration::from_secs(180),
            progress: env.progress,
            exercise_ops: 0,
        })
        .await?;
        if !out.clean() {
            report.errors.push(format!(
                "Failover ({stop:?}): the applications saw errors {:?}, short writes {}, lost {:?}",
                out.io.errors, out.io.short_writes, out.io.lost
            ));
        }
        report.failover.push(out);
    }
    Ok(())
}

async fn latency(env: &Env, report: &mut Report) -> anyhow::Result<()> {
    let cluster = env.cluster("lat", 1, None, 256 * MIB).await?;
    let sizes = env.sizes_or(env.pick(
        pow2_sizes(4 * KIB, 8 * MIB),
        pow2_sizes(4 * KIB, 8 * MIB),
        vec![4 * KIB, MIB],
    ));
    let iters = env.pick(200, 50, 5);
    let bar = env.bar(sizes.len() as u64 * 4, "latency");
    let r = crate::latency::run(&cluster, &sizes, iters, &bar).await?;
    bar.finish_and_clear();
    report.latency = Some(r);
    Ok(())
}

async fn striped_parts(env: &Env, parts: &[Part], report: &mut Report) -> anyhow::Result<()> {
    let cluster = env.cluster("str4", 4, Some(64 * KIB), 512 * MIB).await?;
    let needs_mount = parts
        .iter()
        .any(|p| matches!(p, Part::Fig10 | Part::Metadata));
    let (mount, why) = if needs_mount {
        match env.mount(&cluster, "str4") {
            Ok(m) => (Some(m), None),
            Err(why) => (None, Some(why)),
        }
    } else {
        (None, None)
    };
    if parts.contains(&Part::Fig8) {
        match crate::fig8::run_fig8(env, &cluster).await {
            Ok(f) => report.fig8 = Some(f),
            Err(e) => report.errors.push(format!("Fig8: {e:#}")),
        }
    }
    if parts.contains(&Part::Fig10) {
        match crate::fig10::run_fig10(env, &cluster, mount.as_ref()).await {
            Ok(mut f) => {
                if let Some(w) = &why {
                    f.skipped
                        .push(format!("mount: {w} (processes used the library)"));
                }
                report.fig10 = Some(f);
            }
            Err(e) => report.errors.push(format!("Fig10: {e:#}")),
        }
    }
    if parts.contains(&Part::Metadata) {
        match crate::mdfig::run_md(env, &cluster, mount.as_ref()).await {
            Ok(mut f) => {
                if let Some(w) = &why {
                    f.skipped.push(format!("mount: {w}"));
                }
                report.metadata = Some(f);
            }
            Err(e) => report.errors.push(format!("Metadata: {e:#}")),
        }
    }
    drop(mount);
    Ok(())
}
