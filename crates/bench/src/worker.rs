//! Reader processes for figures 7 and 10: `sanfs-bench __worker ...` started by the bench
//! itself, one per process of the figure.
//!
//! A worker does nothing before the parent says `go` on its stdin, so that the parent can
//! first put it into a blkio cgroup (figure 7's bandwidth caps apply to the threads of the
//! processes in the cgroup). It then connects (a library client of its own, i.e. an agent
//! of its own) or opens the file on the mount, says `ready`, waits for `start`, reads for
//! its time, and prints its [`Sample`] as one JSON line.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::Arc;

use anyhow::{Context, bail};
use sanfs_proto::types::{Credentials, ROOT_INODE};

use crate::cluster::BenchCluster;
use crate::env::raw_engine;
use crate::io::{LibFile, Op, RawFile, Sample, Target, run};
use crate::util::Budget;

/// What a worker reads.
#[derive(Debug, Clone, clap::Args)]
pub struct WorkerArgs {
    /// The server (library mode).
    #[arg(long)]
    pub server: Option<std::net::SocketAddr>,
    /// LUN globs, `:`-separated (library mode).
    #[arg(long, default_value = "")]
    pub devices: String,
    /// A file in the root directory of the file system (library mode).
    #[arg(long)]
    pub file: Option<String>,
    /// Raw `O_DIRECT` on the file's blocks instead of the library (library mode).
    #[arg(long)]
    pub raw: bool,
    /// A file on a mount (mount mode).
    #[arg(long)]
    pub path: Option<PathBuf>,
    /// Bytes of the file to cycle through.
    #[arg(long)]
    pub len: u64,
    /// I/O size.
    #[arg(long)]
    pub size: u64,
    /// Seconds to read.
    #[arg(long)]
    pub secs: f64,
}

fn line(stdin: &mut impl BufRead, want: &str) -> anyhow::Result<()> {
    let mut l = String::new();
    stdin.read_line(&mut l)?;
    if l.trim() != want {
        bail!("expected {want:?} from the parent, got {l:?}");
    }
    Ok(())
}

/// The worker's main: see the module documentation.
pub async fn worker_main(a: WorkerArgs) -> anyhow::Result<()> {
    let mut stdin = BufReader::new(std::io::stdin());
    line(&mut stdin, "go")?;
    let target = match (&a.path, &a.server, &a.file) {
        (Some(path), _, _) => {
            // O_DIRECT: the figure is about sharing the LUNs; opened for reading only and
            // buffered, the file would be re-read from the kernel's page cache.
            #[allow(
                clippy::disallowed_methods,
                reason = "a file on the mount, opened as an application opens it: not a LUN"
            )]
            let f = std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_DIRECT)
                .open(path)
                .with_context(|| format!("open {}", path.display()))?;
            Target::Path(Arc::new(f), a.len)
        }
        (None, Some(server), Some(name)) => {
            let globs = a
                .devices
                .split(':')
                .filter(|g| !g.is_empty())
                .map(str::to_owned)
                .collect();
            let cluster = BenchCluster::existing(*server, None, globs);
            let client =
                Arc::new(BenchCluster::connect(cluster.client_config("bench-worker")).await?);
            let attr = client
                .lookup(&Credentials::root(), ROOT_INODE, name)
                .await
                .with_context(|| format!("lookup {name}"))?;
            if a.raw {
                let volume = client.volume().as_ref().clone();
                let extents = cluster.extents(&client, attr.ino).await?;
                let engine = raw_engine(&volume, &cluster.globs)?;
                Target::Raw(Arc::new(RawFile {
                    engine,
                    volume,
                    extents,
                    len: a.len,
                }))
            } else {
                let flags = sanfs_proto::model::OpenFlags {
                    read: true,
                    write: false,
                    append: false,
                    truncate: false,
                };
                let (fh, _) = client
                    .open(&Credentials::root(), attr.ino, flags)
                    .await
                    .with_context(|| format!("open {name}"))?;
                Target::Lib(Arc::new(LibFile {
                    client,
                    fh,
                    ino: attr.ino,
                    len: a.len,
                }))
            }
        }
        _ => bail!("a worker needs --path, or --server and --file"),
    };
    println!("ready");
    std::io::stdout().flush()?;
    line(&mut stdin, "start")?;
    let s = run(&target, Op::Read, a.size, Budget::new(a.secs, 1, u64::MAX)).await?;
    println!("{}", serde_json::to_string(&s)?);
    std::io::stdout().flush()?;
    Ok(())
}

/// A worker process as the parent sees it.
pub struct Worker {
    child: sanfs_testcluster::ChildGuard,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Worker {
    /// Starts `sanfs-bench __worker` with `args`; it waits for [`Worker::go`].
    pub fn spawn(args: &[String]) -> anyhow::Result<Worker> {
        let me = std::env::current_exe().context("the bench's own path")?;
        let mut cmd = Command::new(me);
        cmd.arg("__worker")
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut child = sanfs_testcluster::ChildGuard::spawn(&mut cmd)?;
        let c: &mut Child = child.child_mut();
        let stdin = c.stdin.take().context("worker stdin")?;
        let stdout = BufReader::new(c.stdout.take().context("worker stdout")?);
        Ok(Worker {
            child,
            stdin,
            stdout,
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.pid()
    }

    fn say(&mut self, what: &str) -> anyhow::Result<()> {
        writeln!(self.stdin, "{what}")?;
        self.stdin.flush()?;
        Ok(())
    }

    fn hear(&mut self) -> anyhow::Result<String> {
        let mut l = String::new();
        self.stdout.read_line(&mut l)?;
        if l.is_empty() {
            bail!("the worker (pid {}) exited early", self.pid());
        }
        Ok(l.trim().to_owned())
    }

    /// Lets it connect; returns once it is ready to read.
    pub fn go(&mut self) -> anyhow::Result<()> {
        self.say("go")?;
        match self.hear()?.as_str() {
            "ready" => Ok(()),
            other => bail!("worker said {other:?}"),
        }
    }

    pub fn start(&mut self) -> anyhow::Result<()> {
        self.say("start")
    }

    /// Its result.
    pub fn finish(mut self) -> anyhow::Result<Sample> {
        let l = self.hear()?;
        let s: Sample = serde_json::from_str(&l).with_context(|| format!("worker said {l:?}"))?;
        let _ = self.child.wait_timeout(std::time::Duration::from_secs(10));
        Ok(s)
    }
}

/// Arguments of a library-mode worker on `file` of `cluster`.
pub fn lib_args(cluster: &BenchCluster, file: &str, len: u64, size: u64, secs: f64) -> Vec<String> {
    vec![
        "--server".into(),
        cluster.addr.to_string(),
        "--devices".into(),
        cluster.globs.join(":"),
        "--file".into(),
        file.into(),
        "--len".into(),
        len.to_string(),
        "--size".into(),
        size.to_string(),
        "--secs".into(),
        secs.to_string(),
    ]
}

/// Runs `workers` together: `go` to each (after `before_go` with its pid), `start` to all,
/// then the aggregate: total bytes over the longest run, and each one's sample.
pub fn run_together(
    args: Vec<Vec<String>>,
    mut before_go: impl FnMut(u32) -> anyhow::Result<()>,
) -> anyhow::Result<(f64, Vec<Sample>)> {
    let mut ws = Vec::new();
    for a in &args {
        let mut w = Worker::spawn(a)?;
        before_go(w.pid())?;
        w.go()?;
        ws.push(w);
    }
    for w in &mut ws {
        w.start()?;
    }
    let mut samples = Vec::new();
    for w in ws {
        samples.push(w.finish()?);
    }
    let bytes: u64 = samples.iter().map(|s| s.bytes).sum();
    let secs = samples.iter().map(|s| s.secs).fold(0.0, f64::max);
    Ok((crate::util::mb_per_s(bytes, secs), samples))
}
