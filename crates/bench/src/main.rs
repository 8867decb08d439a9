//! The `sanfs-bench` command line.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use sanfs_bench::cluster::ServerMode;
use sanfs_bench::env::{Counts, Env, Existing, Length};
use sanfs_bench::exercise::{ExerciseParams, NetMode, mounts_arg, random_seed};
use sanfs_bench::metadata::{MetadataParams, run};
use sanfs_bench::suite::{ALL, Part};
use sanfs_bench::worker::{WorkerArgs, worker_main};

#[derive(Debug, Parser)]
#[command(
    name = "sanfs-bench",
    version,
    about = "sanfs benchmarks: the paper's experiments (section 5, figures 6 to 10) on your hardware"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// Options every figure takes.
#[derive(Debug, Clone, Args)]
struct Common {
    /// A short run (the paper's parts at most 3 minutes; everyday and metadata-mount about
    /// 2 minutes each).
    #[arg(long, conflicts_with = "smoke")]
    quick: bool,
    /// Every code path once with tiny sizes (a test of the bench, not a measurement).
    #[arg(long)]
    smoke: bool,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Write PNG plots of the figures into this directory.
    #[arg(long)]
    plots: Option<PathBuf>,
    /// Where LUN files, metadata stores and mount points go (not tmpfs: O_DIRECT).
    #[arg(long, default_value = "/var/tmp")]
    dir: PathBuf,
    /// How the bench's own metadata server runs.
    #[arg(long, value_enum, default_value_t = ServerMode::Auto)]
    server_mode: ServerMode,
    /// Measure an existing sanfs at this server address instead of building one.
    #[arg(long, requires = "devices")]
    server: Option<SocketAddr>,
    /// With --server: its Prometheus metrics address (figure 8 counts messages there).
    #[arg(long, requires = "server")]
    metrics: Option<SocketAddr>,
    /// With --server: where this node finds the LUNs (globs, comma-separated).
    #[arg(long, value_delimiter = ',')]
    devices: Vec<String>,
    /// With --server: where the file system is mounted (for the mount rows).
    #[arg(long, requires = "server")]
    mount: Option<PathBuf>,
    /// I/O sizes for figure 6, the crossover and the latency rows instead of the defaults
    /// (comma-separated: 64K,1M,8M).
    #[arg(long, value_delimiter = ',', value_parser = sanfs_bench::util::parse_size)]
    sizes: Vec<u64>,
    /// No progress bars.
    #[arg(long)]
    no_progress: bool,
    /// Everyday part: bytes of its sequential, random and bonnie files (default 256M; quick
    /// 64M).
    #[arg(long, value_parser = sanfs_bench::util::parse_size)]
    everyday_file_size: Option<u64>,
    /// Everyday part: files of the small-file tree (default 10000; quick 1000).
    #[arg(long)]
    tree_files: Option<u64>,
    /// Everyday part: directories of the small-file tree (default 100; quick 10).
    #[arg(long)]
    tree_dirs: Option<u64>,
    /// Everyday part: files of the source tree for tar x, ls -lR, grep -r, cp -r, rm -rf
    /// (default 1500; quick 500).
    #[arg(long)]
    src_files: Option<u64>,
    /// Metadata-mount part: files per configuration (default 10000; quick 2000).
    #[arg(long)]
    md_files: Option<u64>,
    /// Metadata-mount part: processes of the concurrent configurations (default 8).
    #[arg(long)]
    md_processes: Option<u64>,
    /// Figure 6: measure it this many times and report each cell's median, with the spread
    /// of its ratio to raw (issue 20 asks for 5).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=50))]
    fig6_runs: u32,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Everything: latency, figures 6 to 10, metadata and the crossover, everyday I/O and
    /// metadata through the mount, and the failover rows (two HA servers on etcd), in one run.
    Run(Common),
    /// Figure 6: throughput vs I/O size (raw, fio, direct, mount, proxied, NFS).
    Fig6(Common),
    /// Figure 7: striping over 1, 2, 3, 4 and 8 capped LUNs.
    Fig7(Common),
    /// Figures 8 and 9: control messages and agent CPU time, methods A and B.
    Fig8(Common),
    /// Figure 10: 1 to 8 processes reading different files.
    Fig10(Common),
    /// Metadata operations per second (bonnie++ -n style) and with 16 gRPC callers.
    Metadata(Common),
    /// Everyday I/O through the mount (sequential, random, bonnie-style, small-file trees,
    /// tar x, ls -lR, grep -r, cp -r, rm -rf) on sanfs, ext4 and MooseFS.
    Everyday(Common),
    /// Metadata operations through the mount from 1 and 8 processes on sanfs, ext4 and
    /// MooseFS.
    MetadataMount(Common),
    /// The I/O size from which the direct path beats the proxied path, and advice.
    Threshold(Common),
    /// Round trips of single grants and proxied reads/writes by size.
    Latency(Common),
    /// The older metadata benchmark alone: concurrent gRPC callers.
    MetadataGrpc {
        /// Concurrent callers.
        #[arg(long, default_value_t = 16)]
        callers: usize,
        /// Files per caller.
        #[arg(long, default_value_t = 500)]
        files: usize,
        /// Directory for the metadata store file (default: a temporary directory).
        #[arg(long)]
        dir: Option<PathBuf>,
        /// Also write the result as JSON to this file.
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// The model-based random-operation exerciser: random operations on a few files through
    /// two mounts of one file system, every read and stat checked against a model; exits
    /// non-zero on the first mismatch (with the seed, the op log tail and the byte range).
    Exercise(ExerciseArgs),
    /// Kills the metadata server with SIGKILL and starts it again, round after round, while
    /// writers on a mount keep their files open; checks after each restart that every
    /// acknowledged write is there and counts the errors applications saw (all must be 0).
    ServerKill(ServerKillArgs),
    /// Two high-availability sanfs-mds on a one-member etcd: kills the leader (or, with
    /// --stop term, stops it: a rolling restart) round after round while writers on a mount
    /// given both addresses keep their files open; reports the pause from the stop to the first
    /// completed I/O (median, min, max) and checks, as server-kill does, that nothing was lost.
    Failover(FailoverArgs),
    /// (internal) a process of the metadata-mount part.
    #[command(name = "__md-worker", hide = true)]
    MdWorker(sanfs_bench::mdmount::MdWorkerArgs),
    /// (internal) a reader process of figures 7 and 10.
    #[command(name = "__worker", hide = true)]
    Worker(WorkerArgs),
}

#[derive(Debug, Args)]
struct ExerciseArgs {
    /// The seed of the random stream (default: random; always printed).
    #[arg(long)]
    seed: Option<u64>,
    /// How many operations.
    #[arg(long, default_value_t = 20_000)]
    ops: u64,
    /// How many file names the operations use.
    #[arg(long, default_value_t = 6)]
    files: usize,
    /// The largest a file grows (writes, truncates and fallocates stay below it).
    #[arg(long, default_value = "6M", value_parser = sanfs_bench::util::parse_size)]
    max_size: u64,
    /// Two mount points of one existing sanfs, mounted with attr_ttl=0,entry_ttl=0 (default:
    /// build a cluster and mount it twice, strict).
    #[arg(long, num_args = 2, value_names = ["A", "B"])]
    mounts: Vec<PathBuf>,
    /// Where the agents run: a network namespace each (auto: when root), or loopback.
    #[arg(long, value_enum, default_value_t = NetMode::Auto)]
    net: NetMode,
    /// Where the cluster's LUN files and mount points go (not tmpfs: O_DIRECT).
    #[arg(long, default_value = "/var/tmp")]
    dir: PathBuf,
    /// How many of the last operations a mismatch report shows.
    #[arg(long, default_value_t = 30)]
    tail: usize,
    /// No progress lines.
    #[arg(long)]
    no_progress: bool,
}

#[derive(Debug, Args)]
struct ServerKillArgs {
    /// The seed of the random stream (default: random; always printed).
    #[arg(long)]
    seed: Option<u64>,
    /// Kill-and-restart rounds.
    #[arg(long, default_value_t = 50)]
    rounds: u64,
    /// Writer threads, each with its own file (even: buffered, odd: O_DIRECT).
    #[arg(long, default_value_t = 4)]
    writers: usize,
    /// Writes stay below this offset.
    #[arg(long, default_value = "8M", value_parser = sanfs_bench::util::parse_size)]
    max_size: u64,
    /// Where the LUN files, the store and the mount point go (not tmpfs: O_DIRECT).
    #[arg(long, default_value = "/var/tmp")]
    dir: PathBuf,
    /// Longest a check waits for the writers before the run fails as hung, in seconds.
    #[arg(long, default_value_t = 180)]
    check_timeout: u64,
    /// Stop the server with SIGTERM (a clean restart) instead of SIGKILL.
    #[arg(long)]
    term: bool,
    /// Also write the outcome as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// No progress lines.
    #[arg(long)]
    no_progress: bool,
}

#[derive(Debug, Args)]
struct FailoverArgs {
    /// The seed of the random stream (default: random; always printed).
    #[arg(long)]
    seed: Option<u64>,
    /// Leader stops (the report's figure is the median of them).
    #[arg(long, default_value_t = 10)]
    rounds: u64,
    /// kill: SIGKILL (takeover after the etcd lease); term: SIGTERM (the leader resigns).
    #[arg(long, value_enum, default_value_t = sanfs_bench::failover::StopHow::Kill)]
    stop: sanfs_bench::failover::StopHow,
    /// Writer threads, each with its own file (even: buffered, odd: O_DIRECT).
    #[arg(long, default_value_t = 4)]
    writers: usize,
    /// Writes stay below this offset.
    #[arg(long, default_value = "8M", value_parser = sanfs_bench::util::parse_size)]
    max_size: u64,
    /// Where the LUN files, etcd's data and the mount point go (not tmpfs: O_DIRECT).
    #[arg(long, default_value = "/var/tmp")]
    dir: PathBuf,
    /// Longest a check or a takeover waits before the run fails as hung, in seconds.
    #[arg(long, default_value_t = 180)]
    check_timeout: u64,
    /// Also run the model-based exerciser on two more mounts through every takeover, at most
    /// this many operations (it stops when the rounds are done; 0: not at all).
    #[arg(long, default_value_t = 0)]
    exercise_ops: u64,
    /// Also write the outcome as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// No progress lines.
    #[arg(long)]
    no_progress: bool,
}

async fn failover_main(a: FailoverArgs) -> anyhow::Result<bool> {
    use sanfs_bench::failover::{FailoverParams, run};
    let seed = match a.seed {
        Some(s) => s,
        None => random_seed()?,
    };
    println!(
        "failover: seed {seed}, {} rounds ({:?}), {} writers",
        a.rounds, a.stop, a.writers
    );
    let out = run(&FailoverParams {
        seed,
        rounds: a.rounds,
        stop: a.stop,
        writers: a.writers.max(1),
        max_file_size: a.max_size,
        dir: a.dir,
        check_timeout: Duration::from_secs(a.check_timeout),
        progress: !a.no_progress,
        exercise_ops: a.exercise_ops,
    })
    .await?;
    println!("{out}");
    let errors: Vec<String> = out
        .io
        .errors
        .iter()
        .map(|(k, v)| format!("{k} {v}"))
        .collect();
    if !errors.is_empty() {
        println!("failover: errors: {}", errors.join(", "));
    }
    for l in &out.io.lost {
        println!("failover: lost: {l}");
    }
    if let Some(logs) = &out.logs {
        println!("failover: the logs are kept in {}", logs.display());
    }
    println!(
        "failover: seed {seed}: {} rounds in {:.0} s: {}",
        out.io.rounds,
        out.io.elapsed_s,
        if out.clean() {
            "no error, nothing lost"
        } else {
            "FAILED"
        }
    );
    if let Some(path) = &a.json {
        std::fs::write(path, serde_json::to_vec_pretty(&out)?)?;
    }
    Ok(out.clean())
}

async fn server_kill_main(a: ServerKillArgs) -> anyhow::Result<bool> {
    use sanfs_bench::serverkill::{ServerKillParams, median, run};
    let seed = match a.seed {
        Some(s) => s,
        None => random_seed()?,
    };
    println!(
        "server-kill: seed {seed}, {} rounds, {} writers",
        a.rounds, a.writers
    );
    let out = run(&ServerKillParams {
        seed,
        rounds: a.rounds,
        writers: a.writers.max(1),
        max_file_size: a.max_size,
        dir: a.dir,
        check_timeout: Duration::from_secs(a.check_timeout),
        term: a.term,
        progress: !a.no_progress,
    })
    .await?;
    let errors: Vec<String> = out.errors.iter().map(|(k, v)| format!("{k} {v}")).collect();
    println!(
        "server-kill: seed {seed}: {} rounds in {:.0} s; {} writes ({} MiB), {} fsyncs, {} closes; \
         EIO {}, ESTALE {}, other errors [{}], short writes {}, lost {}; pause after a kill: median {} ms, max {} ms",
        out.rounds,
        out.elapsed_s,
        out.writes,
        out.bytes_written >> 20,
        out.fsyncs,
        out.closes,
        out.errno_count("EIO"),
        out.errno_count("ESTALE"),
        errors.join(", "),
        out.short_writes,
        out.lost.len(),
        median(&out.pauses_ms),
        out.pauses_ms.iter().max().copied().unwrap_or(0),
    );
    for l in &out.lost {
        println!("server-kill: lost: {l}");
    }
    if let Some(path) = &a.json {
        std::fs::write(path, serde_json::to_vec_pretty(&out)?)?;
    }
    Ok(out.clean())
}

fn exercise_main(a: ExerciseArgs) -> anyhow::Result<bool> {
    let seed = match a.seed {
        Some(s) => s,
        None => random_seed()?,
    };
    let params = ExerciseParams {
        seed,
        ops: a.ops,
        files: a.files,
        max_file_size: a.max_size,
        mounts: mounts_arg(&a.mounts)?,
        net: a.net,
        dir: a.dir,
        tail: a.tail,
        progress: !a.no_progress,
        stop: None,
    };
    println!(
        "exercise: seed {seed}, {} ops, {} files up to {} bytes",
        a.ops, a.files, a.max_size
    );
    let out = sanfs_bench::exercise::run(&params)?;
    let counts: Vec<String> = out
        .counts
        .iter()
        .map(|(k, v)| {
            let ms = out.times.get(k).map_or(0.0, |t| t.as_secs_f64() * 1e3);
            format!("{k} {v} ({:.2} ms each)", ms / (*v).max(1) as f64)
        })
        .collect();
    println!(
        "exercise: seed {seed}: {} ops in {:.1} s ({}), {} MiB written, {} MiB read; {}",
        out.ops_done,
        out.elapsed.as_secs_f64(),
        if out.isolated {
            "agents in network namespaces"
        } else {
            "loopback"
        },
        out.bytes_written >> 20,
        out.bytes_read >> 20,
        counts.join(", ")
    );
    match out.mismatch {
        None => {
            println!("exercise: seed {seed}: 0 mismatches");
            Ok(true)
        }
        Some(m) => {
            println!("{m}");
            Ok(false)
        }
    }
}

fn env_of(c: &Common) -> anyhow::Result<Env> {
    let existing = c.server.map(|server| Existing {
        server,
        metrics: c.metrics,
        globs: c.devices.clone(),
        mount: c.mount.clone(),
    });
    std::fs::create_dir_all(&c.dir)
        .with_context(|| format!("make the work directory --dir {}", c.dir.display()))?;
    Ok(Env {
        length: if c.smoke {
            Length::Smoke
        } else if c.quick {
            Length::Quick
        } else {
            Length::Full
        },
        work: std::fs::canonicalize(&c.dir)
            .with_context(|| format!("the work directory --dir {}", c.dir.display()))?,
        server_mode: c.server_mode,
        existing,
        sizes: (!c.sizes.is_empty()).then(|| c.sizes.clone()),
        counts: Counts {
            everyday_file_len: c.everyday_file_size,
            tree_files: c.tree_files,
            tree_dirs: c.tree_dirs,
            src_files: c.src_files,
            md_files: c.md_files,
            md_processes: c.md_processes,
        },
        progress: !c.no_progress && std::io::IsTerminal::is_terminal(&std::io::stderr()),
        fig6_runs: c.fig6_runs,
    })
}

async fn figures(c: Common, parts: &[Part]) -> anyhow::Result<bool> {
    let env = env_of(&c)?;
    let command = std::env::args().collect::<Vec<_>>().join(" ");
    let report = sanfs_bench::suite::run(&env, parts, command).await;
    println!("{report}");
    if let Some(path) = &c.json {
        std::fs::write(path, serde_json::to_vec_pretty(&report)?)?;
        eprintln!("JSON: {}", path.display());
    }
    if let Some(dir) = &c.plots {
        for p in report.plots(dir)? {
            eprintln!("plot: {}", p.display());
        }
    }
    Ok(report.errors.is_empty())
}

/// The logs of what runs inside the bench (the exerciser's and the gRPC parts' metadata
/// servers, the client library): warnings and errors on stderr, or what `RUST_LOG` says.
fn init_logging() {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .init();
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("sanfs-bench: start the runtime: {e}");
            return ExitCode::from(2);
        }
    };
    let result = runtime.block_on(async {
        match cli.command {
            Command::Run(c) => figures(c, &ALL).await,
            Command::Fig6(c) => figures(c, &[Part::Fig6]).await,
            Command::Fig7(c) => figures(c, &[Part::Fig7]).await,
            Command::Fig8(c) => figures(c, &[Part::Fig8]).await,
            Command::Fig10(c) => figures(c, &[Part::Fig10]).await,
            Command::Metadata(c) => figures(c, &[Part::Metadata]).await,
            Command::Threshold(c) => figures(c, &[Part::Threshold]).await,
            Command::Latency(c) => figures(c, &[Part::Latency]).await,
            Command::Everyday(c) => figures(c, &[Part::Everyday]).await,
            Command::MetadataMount(c) => figures(c, &[Part::MetadataMount]).await,
            Command::MetadataGrpc {
                callers,
                files,
                dir,
                json,
            } => {
                let report = run(&MetadataParams {
                    callers,
                    files,
                    dir,
                })
                .await?;
                println!("{report}");
                if let Some(path) = json {
                    std::fs::write(&path, serde_json::to_vec_pretty(&report)?)?;
                }
                Ok(true)
            }
            Command::Worker(a) => worker_main(a).await.map(|()| true),
            Command::MdWorker(a) => sanfs_bench::mdmount::md_worker_main(a).map(|()| true),
            // Synchronous file system calls on the mounts; the in-process server has a
            // runtime of its own.
            Command::Exercise(a) => exercise_main(a),
            Command::ServerKill(a) => server_kill_main(a).await,
            Command::Failover(a) => failover_main(a).await,
        }
    });
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("sanfs-bench: {e:#}");
            ExitCode::FAILURE
        }
    }
}
