//! The failover harness (`sanfs-bench failover`): what an application on a mount sees while
//! the leader of two high-availability `sanfs-mds` candidates is killed, round after round
//! (docs/operations.md, "High availability on etcd").
//!
//! It builds an HA cluster on this machine ([`HaCluster`]): a one-member etcd, a metadata LUN
//! (`metadata.kind = "block"`) and four striped data LUNs, two `sanfs-mds serve` candidates
//! with `[ha]` (`lease_ttl_s = 2`) of which only the leader listens; and one `sanfs-agent
//! mount` given both addresses (`127.0.0.1:A,127.0.0.1:B`). The writers of the server-kill
//! harness ([`crate::serverkill`]) keep their files open, and a probe creates, writes (4 KiB),
//! fsyncs and closes a new file again and again: every step of it needs the metadata server.
//!
//! Each round finds the leader (`sanfs-mds status --json`), kills it with SIGKILL (or, for the
//! rolling restart, stops it with SIGTERM: it resigns), starts it again at once (it becomes
//! the standby) and measures from the signal to: the other candidate accepting connections
//! (the takeover), the first write of a writer completing, and the first probe started after
//! the signal completing (the figure of the report: kill to the first completed I/O that
//! needed the new leader). Then every writer fsyncs and reads its file back, as in
//! server-kill: errors, short writes and bytes missing must all be 0.

use std::net::SocketAddr;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use sanfs_testcluster::{ChildGuard, LunKind, Luns};

use crate::cluster::{Launcher, Mount, ServeCommand, ServerProcess, wait_for_tcp};
use crate::serverkill::{ServerKillOutcome, Writers, median};
use crate::util::{MIB, free_port, sibling_binary};

/// How the leader is stopped each round.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum StopHow {
    /// SIGKILL: the standby takes over once the leader's etcd lease ran out.
    #[default]
    Kill,
    /// SIGTERM (a rolling restart): the leader resigns and the standby takes over at once.
    Term,
}

/// What to run.
#[derive(Debug, Clone)]
pub struct FailoverParams {
    pub seed: u64,
    /// Leader stops.
    pub rounds: u64,
    pub stop: StopHow,
    /// Writer threads (each its own file; even ones buffered, odd ones `O_DIRECT`).
    pub writers: usize,
    /// Writes stay below this offset.
    pub max_file_size: u64,
    /// Where the LUN files, etcd's data and the mount point go (not tmpfs: O_DIRECT).
    pub dir: PathBuf,
    /// Longest a check (or a takeover) may take before the run fails as hung.
    pub check_timeout: Duration,
    pub progress: bool,
    /// Also run the model-based exerciser (`sanfs-bench exercise`) on two more mounts (strict
    /// TTLs) for the whole run, at most this many operations (0: not at all).
    pub exercise_ops: u64,
}

/// What was measured, and what the applications saw.
#[derive(Debug, Default, Clone, serde::Serialize)]
pub struct FailoverOutcome {
    pub stop: StopHow,
    /// Per round: from the signal to the first probe (create, write, fsync, close of a new
    /// file) started after it completing, in ms.
    pub io_pauses_ms: Vec<u64>,
    /// Per round: from the signal to the other candidate accepting connections, in ms.
    pub takeovers_ms: Vec<u64>,
    /// The writers and the probe: writes, errors by call and errno, short writes, bytes lost;
    /// its `pauses_ms` are from the signal to the first write of a writer completing.
    pub io: ServerKillOutcome,
    /// Probes completed.
    pub probes: u64,
    /// Where the servers', etcd's and the agent's logs were kept (a run that was not clean).
    pub logs: Option<PathBuf>,
    /// Operations the exerciser ran across the takeovers (0: it did not run).
    pub exercise_ops: u64,
    /// The exerciser's first mismatch, if any (the run is then not clean).
    pub exercise_mismatch: Option<String>,
    /// `sanfs-mds fsck` of the metadata LUN after the run (both servers stopped), when it was
    /// not clean: its report (the run is then not clean).
    pub fsck_problems: Option<String>,
    /// With the exerciser: a backup taken in the middle of the run (`sanfs-admin backup`)
    /// was checked (`fsck --backup`), restored and served after the run; when that failed,
    /// why (the run is then not clean).
    pub backup_problem: Option<String>,
    /// Whether that backup was taken.
    pub backup_checked: bool,
}

impl FailoverOutcome {
    /// Whether the run kept the contract: no error, no short write, nothing lost.
    pub fn clean(&self) -> bool {
        self.io.clean()
            && self.exercise_mismatch.is_none()
            && self.fsck_problems.is_none()
            && self.backup_problem.is_none()
    }

    /// The report's row: median, min and max of the I/O pauses (ms).
    pub fn summary(&self) -> (u64, u64, u64) {
        let v = &self.io_pauses_ms;
        (
            median(v),
            v.iter().min().copied().unwrap_or(0),
            v.iter().max().copied().unwrap_or(0),
        )
    }
}

impl std::fmt::Display for FailoverOutcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (med, min, max) = self.summary();
        let what = match self.stop {
            StopHow::Kill => "kill -9 of the leader",
            StopHow::Term => "SIGTERM of the leader (rolling restart)",
        };
        writeln!(
            f,
            "Failover: {what}, {} rounds, two sanfs-mds on etcd (lease_ttl_s = 2)",
            self.io_pauses_ms.len()
        )?;
        writeln!(
            f,
            "  stop -> first completed I/O (new file: create, write, fsync): median {med} ms, min {min} ms, max {max} ms"
        )?;
        writeln!(
            f,
            "  stop -> standby accepting: median {} ms; stop -> first write of a writer: median {} ms",
            median(&self.takeovers_ms),
            median(&self.io.pauses_ms)
        )?;
        let errors: u64 = self.io.errors.values().sum();
        write!(
            f,
            "  {} writes ({} MiB), {} probes; errors {errors}, short writes {}, bytes lost at checks {}",
            self.io.writes,
            self.io.bytes_written >> 20,
            self.probes,
            self.io.short_writes,
            self.io.lost.len()
        )?;
        match &self.fsck_problems {
            None => write!(
                f,
                "\n  sanfs-mds fsck of the metadata LUN after the run: clean"
            )?,
            Some(r) => write!(
                f,
                "\n  sanfs-mds fsck of the metadata LUN after the run: NOT CLEAN\n{r}"
            )?,
        }
        match (&self.backup_problem, self.backup_checked) {
            (Some(why), _) => write!(f, "\n  backup taken mid-run: FAILED: {why}")?,
            (None, true) => write!(
                f,
                "\n  backup taken mid-run under the exerciser: fsck --backup clean, restored, served, fsck clean"
            )?,
            (None, false) => {}
        }
        if self.exercise_ops > 0 || self.exercise_mismatch.is_some() {
            write!(
                f,
                "\n  exerciser on two more mounts across the takeovers: {} operations, {}",
                self.exercise_ops,
                match &self.exercise_mismatch {
                    None => "0 mismatches".to_owned(),
                    Some(m) => format!("MISMATCH:\n{m}"),
                }
            )?;
        }
        Ok(())
    }
}

/// One `sanfs-mds` candidate.
struct Candidate {
    addr: SocketAddr,
    command: ServeCommand,
    process: ServerProcess,
    launcher: Launcher,
}

/// Two HA candidates on one metadata LUN, their etcd, and the LUNs.
pub struct HaCluster {
    /// The data LUNs (what the agent opens).
    pub globs: Vec<String>,
    mds: PathBuf,
    etcd_log: PathBuf,
    // Dropped in this order: the servers, etcd, then the LUNs.
    candidates: Vec<Candidate>,
    _etcd: ChildGuard,
    _meta: Luns,
    _data: Luns,
    _dir: tempfile::TempDir,
}

impl Drop for HaCluster {
    fn drop(&mut self) {
        for c in &mut self.candidates {
            c.process.terminate();
        }
    }
}

fn toml_str(p: &Path) -> String {
    format!("{:?}", p.to_string_lossy())
}

impl HaCluster {
    /// `sanfs-admin backup` through both addresses (whichever leads answers) into `to`.
    fn backup(&self, to: &Path) -> anyhow::Result<()> {
        let admin = sibling_binary("sanfs-admin")
            .context("sanfs-admin not found beside sanfs-bench or on PATH")?;
        let servers: Vec<String> = self.candidates.iter().map(|c| c.addr.to_string()).collect();
        let out = Command::new(admin)
            .arg("--server")
            .arg(servers.join(","))
            .arg("backup")
            .arg(to)
            .output()
            .context("run sanfs-admin backup")?;
        if !out.status.success() {
            bail!(
                "sanfs-admin backup failed: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(())
    }

    /// With both candidates stopped: `sanfs-mds fsck --backup` of `backup`, then `sanfs-mds
    /// restore` of it onto the metadata LUN, then one candidate started on it until it serves
    /// (and stopped again). `Err` says which step failed and why.
    fn check_and_restore(&mut self, backup: &Path) -> anyhow::Result<()> {
        let run = |args: &[&std::ffi::OsStr]| -> anyhow::Result<()> {
            let out = Command::new(&self.mds).args(args).output()?;
            if !out.status.success() {
                bail!(
                    "sanfs-mds {:?}: {}{}",
                    args,
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            Ok(())
        };
        let config = self.candidates[0].command.config.clone();
        run(&["fsck".as_ref(), "--backup".as_ref(), backup.as_os_str()])?;
        run(&[
            "restore".as_ref(),
            "--config".as_ref(),
            config.as_os_str(),
            backup.as_os_str(),
            "--force".as_ref(),
        ])?;
        let c = &mut self.candidates[0];
        c.process = ServerProcess::Launched(c.launcher.launch(&c.command)?);
        let served = wait_for_tcp(c.addr, Duration::from_secs(60));
        c.process.terminate();
        served.context("no candidate served the restored store")?;
        run(&["fsck".as_ref(), "--config".as_ref(), config.as_os_str()])
    }

    /// Stops both candidates (SIGTERM: the leader resigns, the other leads and then stops
    /// too) and runs `sanfs-mds fsck` on the metadata LUN: whether it is clean, and its report.
    fn stop_and_fsck(&mut self) -> anyhow::Result<(bool, String)> {
        for c in &mut self.candidates {
            c.process.terminate();
        }
        let out = Command::new(&self.mds)
            .arg("fsck")
            .arg("--config")
            .arg(&self.candidates[0].command.config)
            .output()
            .context("run sanfs-mds fsck")?;
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        Ok((out.status.success(), text))
    }

    /// Builds the LUNs and etcd in a fresh directory under `work`, formats the file system
    /// and starts two candidates; the first one leads.
    pub fn start(work: &Path) -> anyhow::Result<HaCluster> {
        let mds = sibling_binary("sanfs-mds").context(
            "sanfs-mds not found beside sanfs-bench or on PATH (build it: cargo build -p sanfs-metadata-server)",
        )?;
        let etcd_bin = find_on_path("etcd")
            .context("etcd not found on PATH (Debian: apt install etcd-server)")?;
        let dir = tempfile::Builder::new()
            .prefix("sanfs-bench-failover-")
            .tempdir_in(work)
            .with_context(|| format!("make a directory in {}", work.display()))?;
        for sub in ["data", "meta", "etcd", "a", "b"] {
            std::fs::create_dir(dir.path().join(sub))?;
        }
        let data = Luns::create(&dir.path().join("data"), 4, 256 * MIB, LunKind::Auto)?;
        let meta = Luns::create(&dir.path().join("meta"), 1, 256 * MIB, LunKind::Auto)?;
        let etcd = start_etcd(&etcd_bin, &dir.path().join("etcd"))?;
        let etcd_url = etcd.0;
        let etcd = etcd.1;

        let devices: Vec<String> = data.paths().iter().map(|p| toml_str(p)).collect();
        let mut candidates = Vec::new();
        for name in ["a", "b"] {
            let sub = dir.path().join(name);
            let addr = free_port()?;
            let metrics = free_port()?;
            let config = format!(
                "[server]\nlisten = \"{addr}\"\ninsecure = true\nmetrics_addr = \"{metrics}\"\n\
                 direct_threshold = {}\nlease_ttl_ms = 10000\n\n\
                 [metadata]\npath = {}\nkind = \"block\"\n\n\
                 [volume]\nlayout = \"striped\"\nblock_size = 4096\nstripe_unit = {}\ndata_offset = {}\ndevices = [{}]\n\n\
                 [ha]\netcd = [\"{etcd_url}\"]\nelection = \"sanfs-bench\"\nadvertise = \"{addr}\"\nlease_ttl_s = 2\n",
                64 << 10,
                toml_str(&meta.paths()[0]),
                64 << 10,
                MIB,
                devices.join(", ")
            );
            let config_path = sub.join("mds.toml");
            std::fs::write(&config_path, config).context("write mds.toml")?;
            if name == "a" {
                let out = Command::new(&mds)
                    .args(["format", "--force", "--config"])
                    .arg(&config_path)
                    .env("RUST_LOG", "warn")
                    .output()
                    .with_context(|| format!("run {} format", mds.display()))?;
                if !out.status.success() {
                    bail!(
                        "sanfs-mds format failed: {}",
                        String::from_utf8_lossy(&out.stderr).trim()
                    );
                }
            }
            let command = ServeCommand {
                bin: mds.clone(),
                config: config_path,
                log: sub.join("mds.log"),
            };
            // Started now, before any mount of this cluster exists (see `Launcher`).
            let launcher = Launcher::start(&sub)?;
            let process = ServerProcess::Child(command.spawn()?);
            candidates.push(Candidate {
                addr,
                command,
                process,
                launcher,
            });
            if name == "a" {
                // The first one leads (the second queues behind it in the election).
                wait_for_tcp(addr, Duration::from_secs(60))
                    .with_context(|| format!("the first candidate; see {}", sub.display()))?;
            }
        }
        Ok(HaCluster {
            globs: data
                .paths()
                .iter()
                .map(|p| p.to_string_lossy().into_owned())
                .collect(),
            mds,
            etcd_log: dir.path().join("etcd").join("etcd.log"),
            candidates,
            _etcd: etcd,
            _meta: meta,
            _data: data,
            _dir: dir,
        })
    }

    /// What an agent mounts: every candidate's address.
    pub fn source(&self) -> String {
        let addrs: Vec<String> = self.candidates.iter().map(|c| c.addr.to_string()).collect();
        addrs.join(",")
    }

    /// The leading candidate's index, as `sanfs-mds status --json` tells (waits at most
    /// `timeout` for there to be one).
    fn leader(&self, timeout: Duration) -> anyhow::Result<usize> {
        let deadline = Instant::now() + timeout;
        loop {
            let out = Command::new(&self.mds)
                .args(["status", "--json", "--config"])
                .arg(&self.candidates[0].command.config)
                .env("RUST_LOG", "error")
                .stdin(Stdio::null())
                .output()
                .context("run sanfs-mds status")?;
            let leader = if out.status.success() {
                serde_json::from_slice::<serde_json::Value>(&out.stdout)
                    .ok()
                    .and_then(|v| v.get("leader")?.as_str().map(str::to_owned))
            } else {
                None
            };
            if let Some(l) = leader
                && let Some(i) = self.candidates.iter().position(|c| c.addr.to_string() == l)
            {
                return Ok(i);
            }
            if Instant::now() >= deadline {
                bail!(
                    "no leader in etcd after {} s (sanfs-mds status: {})",
                    timeout.as_secs(),
                    String::from_utf8_lossy(&out.stderr).trim()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Stops candidate `i` (SIGKILL, or SIGTERM and its clean exit) and starts it again.
    fn stop_and_restart(&mut self, i: usize, how: StopHow) -> anyhow::Result<()> {
        let c = &mut self.candidates[i];
        match how {
            StopHow::Kill => c.process.kill9()?,
            StopHow::Term => c.process.terminate(),
        }
        if c.process.running()? {
            bail!("the stopped candidate {} still runs", c.addr);
        }
        c.process = ServerProcess::Launched(c.launcher.launch(&c.command)?);
        Ok(())
    }
}

/// Why this machine cannot run the harness (root for loop devices and FUSE, etcd, the
/// sanfs-mds and sanfs-agent binaries), if it cannot.
pub fn unavailable() -> Option<String> {
    if !sanfs_testcluster::is_root() {
        return Some("needs root (loop-device LUNs, FUSE)".into());
    }
    if find_on_path("etcd").is_none() {
        return Some("etcd not found on PATH (Debian: apt install etcd-server)".into());
    }
    for bin in ["sanfs-mds", "sanfs-agent"] {
        if sibling_binary(bin).is_none() {
            return Some(format!("{bin} not found beside sanfs-bench or on PATH"));
        }
    }
    None
}

/// The first `name` in `PATH`.
fn find_on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// A one-member etcd on loopback with its data in `dir`; its client URL.
fn start_etcd(bin: &Path, dir: &Path) -> anyhow::Result<(String, ChildGuard)> {
    let client = free_port()?;
    let peer = free_port()?;
    let log = std::fs::File::create(dir.join("etcd.log")).context("create etcd.log")?;
    let child = ChildGuard::spawn(
        Command::new(bin)
            .arg("--name=bench")
            .arg(format!("--data-dir={}", dir.join("data").display()))
            .arg(format!("--listen-client-urls=http://{client}"))
            .arg(format!("--advertise-client-urls=http://{client}"))
            .arg(format!("--listen-peer-urls=http://{peer}"))
            .arg(format!("--initial-advertise-peer-urls=http://{peer}"))
            .arg(format!("--initial-cluster=bench=http://{peer}"))
            .arg("--initial-cluster-state=new")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log),
    )?;
    if let Err(e) = wait_for_tcp(client, Duration::from_secs(20)) {
        let log = std::fs::read_to_string(dir.join("etcd.log")).unwrap_or_default();
        let tail: Vec<&str> = log.lines().rev().take(10).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        bail!(
            "etcd did not start: {e}; its log ends:\n{}",
            tail.join("\n")
        );
    }
    Ok((format!("http://{client}"), child))
}

/// The probe: new files, each created, written, fsynced and closed; what completed when.
struct Probe {
    stop: Arc<AtomicBool>,
    /// (started, completed) of each probe since the last `take`.
    done: Arc<Mutex<Vec<(Instant, Instant)>>>,
    count: Arc<Mutex<u64>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Probe {
    fn start(dir: PathBuf, crew: Arc<Writers>) -> anyhow::Result<Probe> {
        std::fs::create_dir(&dir).with_context(|| format!("create {}", dir.display()))?;
        let stop = Arc::new(AtomicBool::new(false));
        let done = Arc::new(Mutex::new(Vec::new()));
        let count = Arc::new(Mutex::new(0u64));
        let (s, d, n) = (Arc::clone(&stop), Arc::clone(&done), Arc::clone(&count));
        let thread = std::thread::spawn(move || {
            let block = vec![0x5au8; 4096];
            let mut i = 0u64;
            while !s.load(Ordering::SeqCst) {
                i += 1;
                let path = dir.join(format!("p{i}"));
                let started = Instant::now();
                let r = (|| -> Result<(), (&'static str, std::io::Error)> {
                    use std::io::Write;
                    let mut f = std::fs::OpenOptions::new()
                        .write(true)
                        .create_new(true)
                        .mode(0o644)
                        .open(&path)
                        .map_err(|e| ("probe-create", e))?;
                    f.write_all(&block).map_err(|e| ("probe-write", e))?;
                    f.sync_all().map_err(|e| ("probe-fsync", e))?;
                    Ok(())
                })();
                match r {
                    Ok(()) => {
                        d.lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .push((started, Instant::now()));
                        *n.lock().unwrap_or_else(|p| p.into_inner()) += 1;
                    }
                    Err((call, e)) => crew.error(call, &e),
                }
                if i > 1
                    && let Err(e) = std::fs::remove_file(dir.join(format!("p{}", i - 1)))
                    && e.kind() != std::io::ErrorKind::NotFound
                {
                    crew.error("probe-unlink", &e);
                }
                std::thread::sleep(Duration::from_millis(2));
            }
        });
        Ok(Probe {
            stop,
            done,
            count,
            thread: Some(thread),
        })
    }

    /// Forgets what completed so far.
    fn clear(&self) {
        self.done.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }

    /// When the first probe started at or after `since` completed, if one has.
    fn first_after(&self, since: Instant) -> Option<Instant> {
        self.done
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .find(|(s, _)| *s >= since)
            .map(|&(_, e)| e)
    }

    fn finish(mut self) -> u64 {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        *self.count.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Copies the logs of a run that was not clean (which go with its directories) into a new
/// directory under `p.dir`; returns it.
fn keep_logs(p: &FailoverParams, cluster: &HaCluster, mount: &Mount) -> anyhow::Result<PathBuf> {
    let dir = p.dir.join(format!(
        "sanfs-failover-logs-{}-{}",
        p.seed,
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
    let mut logs = vec![
        (
            "agent.log".to_owned(),
            mount.path.with_extension("agent.log"),
        ),
        ("etcd.log".to_owned(), cluster.etcd_log.clone()),
    ];
    for (i, c) in cluster.candidates.iter().enumerate() {
        logs.push((
            format!("mds{i}-{}.log", c.addr.port()),
            c.command.log.clone(),
        ));
    }
    // The exerciser's two agents, when it ran.
    if let Some(parent) = mount.path.parent() {
        for name in ["ex-a", "ex-b"] {
            let log = parent.join(name).with_extension("agent.log");
            if log.exists() {
                logs.push((format!("{name}.agent.log"), log));
            }
        }
    }
    for (name, from) in logs {
        std::fs::copy(&from, dir.join(&name))
            .with_context(|| format!("copy {}", from.display()))?;
    }
    Ok(dir)
}

/// A small seeded random stream (the rounds' waits).
fn next_rand(state: &mut u64, below: u64) -> u64 {
    let mut x = (*state).max(1);
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *state = x;
    x.wrapping_mul(0x2545_f491_4f6c_dd1d) % below.max(1)
}

/// Runs the harness; an `Err` is a failure of the harness itself (set-up, a hung mount, no
/// takeover).
/// The exerciser on two mounts of its own (both addresses, strict TTLs), in a thread, until
/// [`Exerciser::finish`].
struct Exerciser {
    stop: Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<anyhow::Result<crate::exercise::Outcome>>>,
    /// Kept until the run's logs are (their agents' logs go with them).
    _mounts: [Mount; 2],
}

impl Exerciser {
    fn start(
        p: &FailoverParams,
        cluster: &HaCluster,
        dir: &Path,
    ) -> anyhow::Result<Option<Exerciser>> {
        if p.exercise_ops == 0 {
            return Ok(None);
        }
        let mut mounts = Vec::new();
        for name in ["ex-a", "ex-b"] {
            let path = dir.join(name);
            std::fs::create_dir(&path)?;
            mounts.push(Mount::start_source(
                &cluster.source(),
                &cluster.globs,
                &path,
                "attr_ttl=0,entry_ttl=0",
            )?);
        }
        let [a, b]: [Mount; 2] = mounts
            .try_into()
            .map_err(|_| anyhow::anyhow!("two mounts"))?;
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let params = crate::exercise::ExerciseParams {
            seed: p.seed,
            ops: p.exercise_ops,
            files: 6,
            max_file_size: 6 * MIB,
            mounts: Some([a.path.clone(), b.path.clone()]),
            net: crate::exercise::NetMode::Loopback,
            dir: dir.to_path_buf(),
            tail: 30,
            progress: false,
            stop: Some(Arc::clone(&stop)),
        };
        let thread = std::thread::spawn(move || crate::exercise::run(&params));
        Ok(Some(Exerciser {
            stop,
            thread: Some(thread),
            _mounts: [a, b],
        }))
    }

    /// Stops it (at its next operation boundary) and returns what it saw.
    fn finish(&mut self) -> anyhow::Result<crate::exercise::Outcome> {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        self.thread
            .take()
            .ok_or_else(|| anyhow::anyhow!("the exerciser was finished already"))?
            .join()
            .map_err(|_| anyhow::anyhow!("the exerciser thread panicked"))?
    }
}

pub async fn run(p: &FailoverParams) -> anyhow::Result<FailoverOutcome> {
    let started = Instant::now();
    std::fs::create_dir_all(&p.dir).with_context(|| format!("create {}", p.dir.display()))?;
    let mut cluster = HaCluster::start(&p.dir)?;
    let mnt_dir = tempfile::Builder::new()
        .prefix("sanfs-failover-")
        .tempdir_in(&p.dir)?;
    let mnt = mnt_dir.path().join("mnt");
    std::fs::create_dir(&mnt)?;
    let mount = Mount::start_source(&cluster.source(), &cluster.globs, &mnt, "")?;
    let crew = Arc::new(Writers::start(
        &mount.path,
        p.seed,
        p.writers,
        p.max_file_size,
    )?);
    let probe = Probe::start(mount.path.join("probe"), Arc::clone(&crew))?;
    let mut exerciser = Exerciser::start(p, &cluster, mnt_dir.path())?;

    let mut out = FailoverOutcome {
        stop: p.stop,
        ..FailoverOutcome::default()
    };
    let mut writer_pauses = Vec::new();
    let mut backup_at: Option<PathBuf> = None;
    let mut rng = p.seed;
    for round in 1..=p.rounds {
        crew.set_round(round);
        tokio::time::sleep(Duration::from_millis(300 + next_rand(&mut rng, 1200))).await;
        let leader = cluster.leader(p.check_timeout)?;
        let standby = cluster.candidates[1 - leader].addr;
        probe.clear();
        let stopped = Instant::now();
        cluster.stop_and_restart(leader, p.stop)?;
        let before = crew.writes_done();
        wait_for_tcp(standby, p.check_timeout)
            .with_context(|| format!("round {round}: the standby {standby} never took over"))?;
        let takeover = stopped.elapsed();
        crew.wait_write_after(before, p.check_timeout).await;
        let write_pause = stopped.elapsed();
        let deadline = Instant::now() + p.check_timeout;
        let io_done = loop {
            if let Some(t) = probe.first_after(stopped) {
                break t;
            }
            if Instant::now() >= deadline {
                bail!(
                    "round {round}: no probe completed {} s after the stop: the mount hangs",
                    p.check_timeout.as_secs()
                );
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        };
        let io_pause = io_done.duration_since(stopped);
        out.takeovers_ms.push(takeover.as_millis() as u64);
        out.io_pauses_ms.push(io_pause.as_millis() as u64);
        writer_pauses.push(write_pause.as_millis() as u64);
        // Let them run a little on the new leader, then check everything.
        tokio::time::sleep(Duration::from_millis(next_rand(&mut rng, 500))).await;
        crew.check(round == p.rounds, p.check_timeout).await?;
        if exerciser.is_some() && round == p.rounds.div_ceil(2) && backup_at.is_none() {
            let to = mnt_dir.path().join("mid-run.backup");
            match cluster.backup(&to) {
                Ok(()) => backup_at = Some(to),
                Err(e) => out.backup_problem = Some(format!("{e:#}")),
            }
        }
        if p.progress {
            eprintln!(
                "failover: round {round}/{}: stop -> I/O {} ms, standby accepting {} ms, first write {} ms; {}",
                p.rounds,
                io_pause.as_millis(),
                takeover.as_millis(),
                write_pause.as_millis(),
                crew.outcome().tally()
            );
        }
    }
    if p.rounds == 0 {
        crew.check(true, p.check_timeout).await?;
    }
    if let Some(ex) = exerciser.as_mut() {
        let ran = ex.finish()?;
        out.exercise_ops = ran.ops_done;
        out.exercise_mismatch = ran.mismatch;
        if p.progress {
            eprintln!(
                "failover: exerciser: {} operations, {}",
                ran.ops_done,
                if out.exercise_mismatch.is_some() {
                    "MISMATCH"
                } else {
                    "0 mismatches"
                }
            );
        }
    }
    out.probes = probe.finish();
    let crew =
        Arc::try_unwrap(crew).map_err(|_| anyhow::anyhow!("the probe still holds the writers"))?;
    out.io = crew.finish();
    out.io.rounds = p.rounds;
    out.io.pauses_ms = writer_pauses;
    let (fsck_clean, fsck_report) = cluster.stop_and_fsck()?;
    if !fsck_clean {
        out.fsck_problems = Some(fsck_report);
    }
    if let Some(backup) = &backup_at {
        out.backup_checked = true;
        if let Err(e) = cluster.check_and_restore(backup) {
            out.backup_problem = Some(format!("{e:#}"));
        }
    }
    if !out.clean() {
        out.logs = Some(keep_logs(p, &cluster, &mount)?);
    }
    drop(exerciser);
    drop(mount);
    drop(cluster);
    out.io.elapsed_s = started.elapsed().as_secs_f64();
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_row_is_the_median_min_and_max_of_the_io_pauses() {
        let out = FailoverOutcome {
            io_pauses_ms: vec![2400, 2100, 3900, 2200, 2300],
            ..FailoverOutcome::default()
        };
        assert_eq!(out.summary(), (2300, 2100, 3900));
        let text = out.to_string();
        assert!(
            text.contains("median 2300 ms, min 2100 ms, max 3900 ms"),
            "{text}"
        );
        assert!(out.clean());
        assert_eq!(FailoverOutcome::default().summary(), (0, 0, 0));
    }

    #[test]
    fn the_random_waits_stay_below_their_bound_and_follow_the_seed() {
        let (mut a, mut b) = (42u64, 42u64);
        for _ in 0..1000 {
            let x = next_rand(&mut a, 1200);
            assert!(x < 1200);
            assert_eq!(x, next_rand(&mut b, 1200));
        }
    }
}
