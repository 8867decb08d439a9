//! Metadata operations per second through a mount (issue 19), in one run on sanfs (the
//! bench's own cluster and FUSE mount), ext4 on an equal loop device and MooseFS 3.0
//! ([`crate::peers`]).
//!
//! Three configurations of N files in all: one process in one directory; P processes each
//! in a directory of its own (N/P files each); P processes all in one directory. Each
//! process is a `sanfs-bench __md-worker` of its own (started before the clock, then told
//! each phase on its stdin), so the figures are what separate applications see. The
//! phases, timed from the parent's word to the last process's answer:
//!
//! - `create`: `open(O_CREAT|O_EXCL)` and `close`;
//! - `stat cold`: `lstat` after the kernel's dentry and inode caches were dropped
//!   (`/proc/sys/vm/drop_caches` = 2, root only; machine-wide, as no per-mount knob exists);
//! - `stat warm`: `lstat` again at once; `stat after 12 s`: again after 12 s, past the
//!   sanfs lease term (the bench cluster's `lease_ttl_ms`, 10 s: leases in use are renewed by
//!   the agent's heartbeats, the kernel's copies ran out) and any fixed TTL of the peers;
//! - `readdir+lstat`: `ls -l`-like, every entry of the process's directory listed and
//!   `lstat`ed (in the shared directory each process lists all N entries);
//! - `rename` (to a new name in the same directory) and `unlink`.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

use crate::env::Env;
use crate::peers::{Ext4, FsTarget, MooseFs};

/// How long `stat after 12 s` waits: past the bench cluster's 10 s lease term.
const STAT_LATER: Duration = Duration::from_millis(12_100);

/// The phases, in order.
pub const PHASES: [&str; 7] = [
    "create",
    "stat cold",
    "stat warm",
    "stat after 12 s",
    "readdir+lstat",
    "rename",
    "unlink",
];

/// What a worker is given.
#[derive(Debug, Clone, clap::Args)]
pub struct MdWorkerArgs {
    /// The directory its files live in (made by the parent).
    #[arg(long)]
    pub dir: PathBuf,
    /// Its files' name prefix (unique among the processes sharing a directory).
    #[arg(long)]
    pub prefix: String,
    /// How many files.
    #[arg(long)]
    pub files: u64,
}

fn phase(a: &MdWorkerArgs, op: &str, renamed: &mut bool) -> anyhow::Result<u64> {
    let name = |i: u64, r: bool| {
        a.dir
            .join(format!("{}{i:06}{}", a.prefix, if r { ".r" } else { "" }))
    };
    match op {
        "create" => {
            for i in 0..a.files {
                std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .open(name(i, false))
                    .with_context(|| format!("create {}", name(i, false).display()))?;
            }
            Ok(a.files)
        }
        "stat" => {
            for i in 0..a.files {
                std::fs::symlink_metadata(name(i, *renamed))
                    .with_context(|| format!("stat {}", name(i, *renamed).display()))?;
            }
            Ok(a.files)
        }
        "readdir" => {
            let mut n = 0;
            for e in std::fs::read_dir(&a.dir)? {
                std::fs::symlink_metadata(e?.path())?;
                n += 1;
            }
            Ok(n)
        }
        "rename" => {
            for i in 0..a.files {
                std::fs::rename(name(i, false), name(i, true))
                    .with_context(|| format!("rename {}", name(i, false).display()))?;
            }
            *renamed = true;
            Ok(a.files)
        }
        "unlink" => {
            for i in 0..a.files {
                std::fs::remove_file(name(i, *renamed))
                    .with_context(|| format!("unlink {}", name(i, *renamed).display()))?;
            }
            Ok(a.files)
        }
        _ => bail!("unknown phase {op:?}"),
    }
}

/// The worker's main: one phase per line on stdin, `ok OPS` or `err WHY` per phase on
/// stdout, until stdin ends.
pub fn md_worker_main(a: MdWorkerArgs) -> anyhow::Result<()> {
    let stdin = BufReader::new(std::io::stdin());
    let mut out = std::io::stdout();
    let mut renamed = false;
    writeln!(out, "ready")?;
    out.flush()?;
    for line in stdin.lines() {
        let line = line?;
        match phase(&a, line.trim(), &mut renamed) {
            Ok(n) => writeln!(out, "ok {n}")?,
            Err(e) => writeln!(out, "err {}", format!("{e:#}").replace('\n', " "))?,
        }
        out.flush()?;
    }
    Ok(())
}

struct Worker {
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: BufReader<ChildStdout>,
}

impl Worker {
    fn start(dir: &Path, prefix: &str, files: u64) -> anyhow::Result<Worker> {
        let me = std::env::current_exe().context("the bench's own path")?;
        let mut child = Command::new(me)
            .arg("__md-worker")
            .arg("--dir")
            .arg(dir)
            .args(["--prefix", prefix, "--files", &files.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .context("start a metadata worker")?;
        let stdin = child.stdin.take().context("worker stdin")?;
        let stdout = BufReader::new(child.stdout.take().context("worker stdout")?);
        let mut w = Worker {
            child,
            stdin: Some(stdin),
            stdout,
        };
        let l = w.answer()?;
        if l != "ready" {
            bail!("the worker said {l:?}");
        }
        Ok(w)
    }

    fn answer(&mut self) -> anyhow::Result<String> {
        let mut l = String::new();
        self.stdout.read_line(&mut l)?;
        if l.is_empty() {
            bail!("the worker exited");
        }
        Ok(l.trim().to_owned())
    }

    fn send(&mut self, op: &str) -> anyhow::Result<()> {
        let stdin = self.stdin.as_mut().context("worker stdin closed")?;
        writeln!(stdin, "{op}")?;
        stdin.flush()?;
        Ok(())
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.stdin.take();
        // It exits when its stdin closes; a hung one is killed.
        for _ in 0..100 {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One phase's rate in one configuration on one file system.
#[derive(Debug, Clone, serde::Serialize)]
pub struct MdMountCell {
    pub target: String,
    /// `1 process`, `8 processes, own dirs`, `8 processes, one dir`.
    pub config: String,
    pub op: String,
    pub ops: u64,
    pub secs: f64,
    pub ops_per_s: f64,
}

/// The mount-metadata figure.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct MdMount {
    pub files: u64,
    pub processes: u64,
    pub targets: Vec<String>,
    pub cells: Vec<MdMountCell>,
    /// Whether `stat cold` ran with the kernel's caches dropped (root).
    pub cold_dropped: bool,
    pub skipped: Vec<String>,
}

impl MdMount {
    pub fn get(&self, target: &str, config: &str, op: &str) -> Option<&MdMountCell> {
        self.cells
            .iter()
            .find(|c| c.target == target && c.config == config && c.op == op)
    }

    pub fn configs(&self) -> Vec<String> {
        let mut v: Vec<String> = Vec::new();
        for c in &self.cells {
            if !v.contains(&c.config) {
                v.push(c.config.clone());
            }
        }
        v
    }
}

fn drop_dentries() -> bool {
    sanfs_testcluster::is_root() && std::fs::write("/proc/sys/vm/drop_caches", "2").is_ok()
}

/// Every configuration and phase on one file system.
fn on_target(t: &FsTarget, files: u64, procs: u64) -> anyhow::Result<(Vec<MdMountCell>, bool)> {
    let base = t.dir.join(format!("mdmount-{}", std::process::id()));
    std::fs::create_dir(&base).with_context(|| format!("mkdir {}", base.display()))?;
    let procs = procs.max(1);
    let per = (files / procs).max(1);
    let configs = [
        ("1 process".to_owned(), 1, false, files),
        (format!("{procs} processes, own dirs"), procs, false, per),
        (format!("{procs} processes, one dir"), procs, true, per),
    ];
    let mut cells = Vec::new();
    let mut dropped = true;
    for (ci, (config, n, shared, each)) in configs.into_iter().enumerate() {
        let cdir = base.join(format!("c{ci}"));
        std::fs::create_dir(&cdir)?;
        let mut workers = Vec::new();
        for w in 0..n {
            let dir = if shared {
                cdir.clone()
            } else {
                let d = cdir.join(format!("p{w}"));
                std::fs::create_dir(&d)?;
                d
            };
            workers.push(Worker::start(&dir, &format!("w{w}-"), each)?);
        }
        for op in PHASES {
            let wire = match op {
                "stat cold" => {
                    dropped &= drop_dentries();
                    "stat"
                }
                "stat warm" => "stat",
                "stat after 12 s" => {
                    std::thread::sleep(STAT_LATER);
                    "stat"
                }
                "readdir+lstat" => "readdir",
                other => other,
            };
            let started = Instant::now();
            for w in &mut workers {
                w.send(wire)?;
            }
            let mut ops = 0;
            for w in &mut workers {
                let a = w.answer()?;
                match a.strip_prefix("ok ") {
                    Some(n) => ops += n.parse::<u64>().context("worker answer")?,
                    None => bail!("{op} on {} ({config}): {a}", t.name),
                }
            }
            let secs = started.elapsed().as_secs_f64().max(1e-9);
            cells.push(MdMountCell {
                target: t.name.clone(),
                config: config.clone(),
                op: op.into(),
                ops,
                secs,
                ops_per_s: ops as f64 / secs,
            });
        }
        drop(workers);
    }
    std::fs::remove_dir_all(&base)?;
    Ok((cells, dropped))
}

async fn measure(t: FsTarget, files: u64, procs: u64, fig: &mut MdMount) -> anyhow::Result<()> {
    let (cells, dropped) = tokio::task::spawn_blocking(move || on_target(&t, files, procs))
        .await
        .context("metadata thread")??;
    if let Some(c) = cells.first() {
        fig.targets.push(c.target.clone());
    }
    fig.cold_dropped &= dropped;
    fig.cells.extend(cells);
    Ok(())
}

/// The sanfs mount and its peers, one after the other.
pub async fn run_md_mount(env: &Env) -> anyhow::Result<MdMount> {
    let files = env.counts.md_files.unwrap_or(env.pick(10_000, 2_000, 40));
    let procs = env.counts.md_processes.unwrap_or(8).max(1);
    let mut fig = MdMount {
        files,
        processes: procs,
        cold_dropped: true,
        ..MdMount::default()
    };
    // Room for the files' metadata and the peers' journals; the data is empty.
    let lun_size = env.pick(1 << 30, 512 << 20, 256 << 20);
    let bar = env.bar(3, "md-mount");
    bar.set_message("sanfs");
    let cluster = env.cluster("mdm", 1, None, lun_size).await?;
    match env.mount(&cluster, "mdm") {
        Ok(m) => {
            let t = crate::everyday::sanfs_target(&m, &cluster);
            measure(t, files, procs, &mut fig).await?;
        }
        Err(why) => fig.skipped.push(format!("sanfs: {why}")),
    }
    drop(cluster);
    bar.inc(1);
    bar.set_message("ext4");
    match Ext4::start(&env.work, "mdm", lun_size) {
        Ok(fs) => measure(fs.target(), files, procs, &mut fig).await?,
        Err(e) => fig.skipped.push(format!("ext4: {e:#}")),
    }
    bar.inc(1);
    bar.set_message("moosefs");
    match MooseFs::start(&env.work, "mdm", lun_size) {
        Ok(fs) => measure(fs.target(), files, procs, &mut fig).await?,
        Err(e) => fig.skipped.push(format!("moosefs: {e:#}")),
    }
    bar.inc(1);
    bar.finish_and_clear();
    Ok(fig)
}

impl std::fmt::Display for MdMount {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "Metadata through the mount: ops/s, {} files per configuration{}; ratios sanfs/peer",
            self.files,
            if self.cold_dropped {
                ""
            } else {
                " (stat cold NOT cold: no root to drop the kernel's caches)"
            }
        )?;
        write!(f, "{:<26} {:<15}", "configuration", "op")?;
        for t in &self.targets {
            write!(f, " {t:>10}")?;
        }
        for t in self.targets.iter().skip(1) {
            write!(f, " {:>10}", format!("sanfs/{t}"))?;
        }
        writeln!(f)?;
        for config in self.configs() {
            for op in PHASES {
                write!(f, "{config:<26} {op:<15}")?;
                for t in &self.targets {
                    match self.get(t, &config, op) {
                        Some(c) => write!(f, " {:>10.0}", c.ops_per_s)?,
                        None => write!(f, " {:>10}", "-")?,
                    }
                }
                let sanfs = self.get("sanfs", &config, op);
                for t in self.targets.iter().skip(1) {
                    match (sanfs, self.get(t, &config, op)) {
                        (Some(a), Some(b)) => write!(
                            f,
                            " {:>10}",
                            crate::everyday::ratio(a.ops_per_s, b.ops_per_s)
                        )?,
                        _ => write!(f, " {:>10}", "-")?,
                    }
                }
                writeln!(f)?;
            }
        }
        for s in &self.skipped {
            writeln!(f, "skipped: {s}")?;
        }
        Ok(())
    }
}
