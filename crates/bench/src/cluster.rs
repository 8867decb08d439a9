//! The bench's own test cluster, or an existing one.
//!
//! [`BenchCluster::start`] builds a whole sanfs on this machine: LUNs (loop devices with
//! direct I/O as root, plain files otherwise; `sanfs-testcluster`), a volume formatted on
//! them, and the metadata server, either as a real `sanfs-mds` process (found beside the
//! bench binary or on `PATH`) or, when there is none, in-process on a runtime of its own.
//! [`BenchCluster::existing`] uses a server that already runs. Either way the bench connects
//! [`Client`]s to it (the library, in this process), mounts it with `sanfs-agent mount`
//! ([`Mount`]), reads the server's Prometheus metrics, and asks it for a file's extents (so
//! that raw I/O can hit exactly the blocks of a file).

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use sanfs_blockmap::extent::{Extent, ExtentMap, ExtentState};
use sanfs_blockmap::volume::Volume;
use sanfs_client_agent::client::{Client, ClientConfig};
use sanfs_mds::clock::Clock;
use sanfs_mds::config::{LayoutKindConfig, VolumeConfig};
use sanfs_mds::store::Backend;
use sanfs_proto::pb;
use sanfs_proto::pb::data_client::DataClient;
use sanfs_proto::types::InodeId;
use sanfs_testcluster::{ChildGuard, LunKind, Luns, mds};

use crate::util::{MIB, free_port, sibling_binary};

/// How the metadata server runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum ServerMode {
    /// A `sanfs-mds` process when the binary is found, in-process otherwise.
    #[default]
    Auto,
    /// A `sanfs-mds` process (an error if the binary is not found).
    Process,
    /// In this process, on a runtime of its own.
    InProcess,
}

/// What cluster to build.
#[derive(Debug, Clone)]
pub struct ClusterSpec {
    /// Names the LUN files and the cgroups (short).
    pub tag: String,
    pub luns: usize,
    pub lun_size: u64,
    /// Striped with this stripe unit; `None`: linear.
    pub stripe_unit: Option<u64>,
    /// The server's direct-I/O threshold.
    pub direct_threshold: u64,
    pub server: ServerMode,
    pub lun_kind: LunKind,
}

enum ServerHandle {
    /// A `sanfs-mds serve` process and how to start it again (same command line, same log).
    Process {
        process: ServerProcess,
        command: ServeCommand,
        launcher: Launcher,
    },
    InProcess {
        server: Option<mds::ServeThread>,
    },
    External,
}

/// A running sanfs: the server, and (when the bench built it) its LUNs and store.
pub struct BenchCluster {
    pub addr: SocketAddr,
    pub metrics_addr: Option<SocketAddr>,
    /// LUN paths or globs the clients look at.
    pub globs: Vec<String>,
    /// The LUN paths (empty for an existing cluster).
    pub lun_paths: Vec<PathBuf>,
    /// Whether the LUNs are loop devices (false: files, or unknown for an existing cluster).
    pub loop_luns: bool,
    /// Whether the server shares this process (its CPU time counts as ours).
    pub in_process: bool,
    // Dropped in this order: the server before the LUNs.
    server: ServerHandle,
    _luns: Option<Luns>,
    _dir: Option<tempfile::TempDir>,
}

impl std::fmt::Debug for BenchCluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BenchCluster")
            .field("addr", &self.addr)
            .field("luns", &self.lun_paths)
            .field("in_process", &self.in_process)
            .finish()
    }
}

fn toml_str(p: &Path) -> String {
    format!("{:?}", p.to_string_lossy())
}

impl BenchCluster {
    /// Builds LUNs in a fresh directory under `work`, formats them and starts the server.
    pub async fn start(spec: &ClusterSpec, work: &Path) -> anyhow::Result<BenchCluster> {
        let dir = tempfile::Builder::new()
            .prefix(&format!("sanfs-bench-{}-", spec.tag))
            .tempdir_in(work)
            .with_context(|| format!("make a directory in {}", work.display()))?;
        let luns = Luns::create(dir.path(), spec.luns, spec.lun_size, spec.lun_kind)?;
        let paths = luns.paths().to_vec();
        let addr = free_port()?;
        let metrics = free_port()?;
        let store = dir.path().join("mds.redb");
        let mds = match spec.server {
            ServerMode::InProcess => None,
            ServerMode::Auto => sibling_binary("sanfs-mds"),
            ServerMode::Process => Some(sibling_binary("sanfs-mds").context(
                "sanfs-mds not found beside sanfs-bench or on PATH (build it: cargo build --release -p sanfs-metadata-server)",
            )?),
        };
        let server = match &mds {
            Some(bin) => start_process(bin, spec, dir.path(), &paths, &store, addr, metrics)?,
            None => start_in_process(spec, &paths, &store, addr, metrics).await?,
        };
        let cluster = BenchCluster {
            addr,
            metrics_addr: Some(metrics),
            globs: paths
                .iter()
                .map(|p| p.to_string_lossy().into_owned())
                .collect(),
            lun_paths: paths,
            loop_luns: luns.is_loop(),
            in_process: mds.is_none(),
            server,
            _luns: Some(luns),
            _dir: Some(dir),
        };
        wait_for_tcp(addr, Duration::from_secs(20))?;
        Ok(cluster)
    }

    /// A server that already runs at `addr`, whose LUNs this node finds with `globs`.
    pub fn existing(
        addr: SocketAddr,
        metrics_addr: Option<SocketAddr>,
        globs: Vec<String>,
    ) -> BenchCluster {
        BenchCluster {
            addr,
            metrics_addr,
            globs,
            lun_paths: Vec::new(),
            loop_luns: false,
            in_process: false,
            server: ServerHandle::External,
            _luns: None,
            _dir: None,
        }
    }

    /// The `sanfs-mds` process id, when the bench started it as a process (for its CPU time).
    pub fn server_pid(&self) -> Option<u32> {
        match &self.server {
            ServerHandle::Process { process, .. } => Some(match process {
                ServerProcess::Child(c) => c.pid(),
                ServerProcess::Launched(pid) => *pid,
            }),
            _ => None,
        }
    }

    /// `kill -9` of the server process (only for a server the bench started as a process).
    pub fn kill_server(&mut self) -> anyhow::Result<()> {
        match &mut self.server {
            ServerHandle::Process { process, .. } => process.kill9(),
            _ => bail!("only a sanfs-mds process started by the bench can be killed"),
        }
    }

    /// SIGTERM to the server process and wait for its clean stop (10 s, then SIGKILL).
    pub fn terminate_server(&mut self) -> anyhow::Result<()> {
        match &mut self.server {
            ServerHandle::Process { process, .. } => {
                process.terminate();
                Ok(())
            }
            _ => bail!("only a sanfs-mds process started by the bench can be stopped"),
        }
    }

    /// Starts the server process again with the same command line (after [`Self::kill_server`])
    /// and waits until its port accepts connections.
    pub fn restart_server(&mut self) -> anyhow::Result<()> {
        match &mut self.server {
            ServerHandle::Process {
                process,
                command,
                launcher,
            } => {
                if process.running()? {
                    bail!("the server still runs: kill it first");
                }
                *process = ServerProcess::Launched(launcher.launch(command)?);
                if let Err(e) = wait_for_tcp(self.addr, Duration::from_secs(60)) {
                    let exited = if process.running()? {
                        ""
                    } else {
                        "; the server exited"
                    };
                    let log = std::fs::read_to_string(&command.log).unwrap_or_default();
                    let tail: Vec<&str> = log.lines().rev().take(20).collect();
                    let tail: Vec<&str> = tail.into_iter().rev().collect();
                    bail!("{e}{exited}; the server's log ends:\n{}", tail.join("\n"));
                }
                Ok(())
            }
            _ => bail!("only a sanfs-mds process started by the bench can be restarted"),
        }
    }

    /// The library configuration of a node of this cluster.
    pub fn client_config(&self, name: &str) -> ClientConfig {
        let mut c = ClientConfig::new(self.addr.to_string(), self.globs.clone());
        c.client_name = name.to_owned();
        c
    }

    /// Connects a client with `config`.
    pub async fn connect(config: ClientConfig) -> anyhow::Result<Client> {
        Client::connect(config)
            .await
            .context("connect the sanfs client")
    }

    /// The server's counters (`name{labels}` -> value) from its Prometheus endpoint.
    pub fn metrics(&self) -> anyhow::Result<HashMap<String, f64>> {
        let addr = self
            .metrics_addr
            .context("no metrics address (give --metrics for an existing server)")?;
        scrape(addr)
    }

    /// Requests answered by the server for `rpc` (all codes) so far.
    pub fn rpc_count(&self, rpc: &str) -> anyhow::Result<f64> {
        let m = self.metrics()?;
        let tag = format!("rpc=\"{rpc}\"");
        Ok(m.iter()
            .filter(|(k, _)| k.starts_with("sanfs_rpc_requests_total{") && k.contains(&tag))
            .map(|(_, v)| *v)
            .sum())
    }

    /// Every request the server answered so far, by rpc.
    pub fn rpc_counts(&self) -> anyhow::Result<HashMap<String, f64>> {
        let m = self.metrics()?;
        let mut out: HashMap<String, f64> = HashMap::new();
        for (k, v) in m {
            if let Some(rest) = k.strip_prefix("sanfs_rpc_requests_total{")
                && let Some(i) = rest.find("rpc=\"")
            {
                let name = &rest[i + 5..];
                let name = &name[..name.find('"').unwrap_or(name.len())];
                *out.entry(name.to_owned()).or_default() += v;
            }
        }
        Ok(out)
    }

    /// The volume and a file's extents, as the server has them: what raw I/O on the same
    /// blocks needs.
    pub async fn extents(&self, client: &Client, ino: InodeId) -> anyhow::Result<ExtentMap> {
        let ch = tonic::transport::Endpoint::from_shared(format!("http://{}", self.addr))?
            .connect()
            .await
            .context("connect for GetExtents")?;
        let reply = DataClient::new(ch)
            .get_extents(pb::GetExtentsRequest {
                cred: Some(pb::Credentials {
                    uid: 0,
                    gid: 0,
                    groups: vec![],
                }),
                inode: ino.0,
                offset: 0,
                length: u64::MAX / 2,
            })
            .await
            .context("GetExtents")?
            .into_inner();
        let bs = u64::from(reply.block_size.max(1));
        let volume = client.volume();
        let volume: &Volume = &volume;
        if u64::from(volume.block_size()) != bs {
            bail!("GetExtents block size {bs} is not the volume's");
        }
        let extents = reply
            .extents
            .iter()
            .map(|e| Extent {
                file_block: e.file_off / bs,
                vol_block: e.vol_off / bs,
                len_blocks: e.len / bs,
                state: if e.state == pb::ExtentState::Unwritten as i32 {
                    ExtentState::Unwritten
                } else {
                    ExtentState::Written
                },
            })
            .collect();
        ExtentMap::from_extents(extents).map_err(|e| anyhow::anyhow!("extents of {ino}: {e}"))
    }
}

impl Drop for BenchCluster {
    fn drop(&mut self) {
        match &mut self.server {
            ServerHandle::Process { process, .. } => process.terminate(),
            ServerHandle::InProcess { server } => {
                if let Some(s) = server.take() {
                    let _ = s.stop();
                }
            }
            ServerHandle::External => {}
        }
    }
}

fn volume_config(spec: &ClusterSpec, paths: &[PathBuf]) -> VolumeConfig {
    VolumeConfig {
        layout: if spec.stripe_unit.is_some() {
            LayoutKindConfig::Striped
        } else {
            LayoutKindConfig::Linear
        },
        block_size: 4096,
        stripe_unit: spec.stripe_unit.unwrap_or(64 * 1024),
        data_offset: MIB,
        devices: paths.to_vec(),
        lvm_vg: None,
        lvm_lv: None,
    }
}

fn start_process(
    bin: &Path,
    spec: &ClusterSpec,
    dir: &Path,
    paths: &[PathBuf],
    store: &Path,
    addr: SocketAddr,
    metrics: SocketAddr,
) -> anyhow::Result<ServerHandle> {
    let v = volume_config(spec, paths);
    let devices: Vec<String> = paths.iter().map(|p| toml_str(p)).collect();
    let layout = if spec.stripe_unit.is_some() {
        "striped"
    } else {
        "linear"
    };
    let config = format!(
        "[server]\nlisten = \"{addr}\"\ninsecure = true\nmetrics_addr = \"{metrics}\"\ndirect_threshold = {}\n\
         lease_ttl_ms = 10000\n\n[metadata]\npath = {}\n\n[volume]\nlayout = \"{layout}\"\n\
         block_size = {}\nstripe_unit = {}\ndata_offset = {}\ndevices = [{}]\n",
        spec.direct_threshold,
        toml_str(store),
        v.block_size,
        v.stripe_unit,
        v.data_offset,
        devices.join(", ")
    );
    let config_path = dir.join("mds.toml");
    std::fs::write(&config_path, config).context("write mds.toml")?;
    let out = Command::new(bin)
        .args(["format", "--force", "--config"])
        .arg(&config_path)
        .env("RUST_LOG", "warn")
        .output()
        .with_context(|| format!("run {} format", bin.display()))?;
    if !out.status.success() {
        bail!(
            "sanfs-mds format failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let command = ServeCommand {
        bin: bin.to_path_buf(),
        config: config_path,
        log: dir.join("mds.log"),
    };
    // Started now, before any mount of this cluster exists (see `Launcher`).
    let launcher = Launcher::start(dir)?;
    let child = command.spawn()?;
    Ok(ServerHandle::Process {
        process: ServerProcess::Child(child),
        command,
        launcher,
    })
}

/// The server process: the first one is the bench's child; one started again after a kill is
/// the [`Launcher`]'s.
pub(crate) enum ServerProcess {
    Child(ChildGuard),
    Launched(u32),
}

impl ServerProcess {
    pub(crate) fn running(&mut self) -> anyhow::Result<bool> {
        Ok(match self {
            ServerProcess::Child(c) => c.try_wait()?.is_none(),
            ServerProcess::Launched(pid) => pid_alive(*pid),
        })
    }

    /// SIGKILL, then wait (at most 10 s) until it is gone.
    pub(crate) fn kill9(&mut self) -> anyhow::Result<()> {
        match self {
            ServerProcess::Child(c) => c.kill9().map(drop),
            ServerProcess::Launched(pid) => {
                signal_pid(*pid, rustix::process::Signal::KILL)?;
                wait_gone(*pid, Duration::from_secs(10))
            }
        }
    }

    /// SIGTERM, 10 s to stop, then SIGKILL.
    pub(crate) fn terminate(&mut self) {
        match self {
            ServerProcess::Child(c) => {
                let _ = c.terminate(Duration::from_secs(10));
            }
            ServerProcess::Launched(pid) => {
                let _ = signal_pid(*pid, rustix::process::Signal::TERM);
                if wait_gone(*pid, Duration::from_secs(10)).is_err() {
                    let _ = signal_pid(*pid, rustix::process::Signal::KILL);
                    let _ = wait_gone(*pid, Duration::from_secs(10));
                }
            }
        }
    }
}

fn signal_pid(pid: u32, signal: rustix::process::Signal) -> anyhow::Result<()> {
    let p = i32::try_from(pid)
        .ok()
        .and_then(rustix::process::Pid::from_raw)
        .context("server pid")?;
    if !pid_alive(pid) {
        return Ok(());
    }
    rustix::process::kill_process(p, signal).with_context(|| format!("signal {signal:?} to {pid}"))
}

/// Whether `pid` runs (a zombie, dead but not reaped, does not).
pub(crate) fn pid_alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|st| {
        st.rfind(')')
            .and_then(|i| st.get(i + 2..i + 3))
            .is_some_and(|state| state != "Z" && state != "X")
    })
}

fn wait_gone(pid: u32, timeout: Duration) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    while pid_alive(pid) {
        if Instant::now() >= deadline {
            bail!(
                "process {pid} still runs {} s after a signal",
                timeout.as_secs()
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(())
}

/// Starts `sanfs-mds serve` again after a kill, from a shell started with the cluster, before
/// any file on a mount of it was open. A process that forks while it holds files of a FUSE
/// mount makes its child close them at exec, and FUSE sends a FLUSH for each: the agent answers
/// a flush of a file with writes not yet durable only once the server made them durable, and
/// that server is the process being started (a deadlock of the harness, never of a deployment,
/// where the server holds no files of a mount).
pub(crate) struct Launcher {
    shell: ChildGuard,
    pidfile: PathBuf,
}

impl Launcher {
    pub(crate) fn start(dir: &Path) -> anyhow::Result<Launcher> {
        let pidfile = dir.join("launcher.pid");
        let shell = ChildGuard::spawn(
            Command::new("sh")
                .arg("-c")
                .arg(
                    "while IFS= read -r line; do eval \"$line\" & echo $! > \"$0.new\"; \
                     mv \"$0.new\" \"$0\"; done",
                )
                .arg(&pidfile)
                .stdin(Stdio::piped())
                .stdout(Stdio::null())
                .stderr(Stdio::null()),
        )?;
        Ok(Launcher { shell, pidfile })
    }

    /// Starts `command` (its log appended to), returns its pid.
    pub(crate) fn launch(&mut self, command: &ServeCommand) -> anyhow::Result<u32> {
        let quote = |p: &Path| -> anyhow::Result<String> {
            let s = p.to_str().context("a non-UTF-8 path")?;
            if s.contains('\'') {
                bail!("a path with a single quote: {s}");
            }
            Ok(format!("'{s}'"))
        };
        let level = std::env::var("SANFS_BENCH_MDS_LOG").unwrap_or_else(|_| "warn".to_owned());
        if !level
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "_=,:".contains(c))
        {
            bail!("SANFS_BENCH_MDS_LOG {level:?}: only a log filter");
        }
        let line = format!(
            "RUST_LOG={level} exec {} serve --config {} </dev/null >/dev/null 2>>{}\n",
            quote(&command.bin)?,
            quote(&command.config)?,
            quote(&command.log)?
        );
        let _ = std::fs::remove_file(&self.pidfile);
        let stdin = self
            .shell
            .child_mut()
            .stdin
            .as_mut()
            .context("the launcher's stdin")?;
        stdin
            .write_all(line.as_bytes())
            .context("tell the launcher")?;
        stdin.flush().context("tell the launcher")?;
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(text) = std::fs::read_to_string(&self.pidfile)
                && let Ok(pid) = text.trim().parse::<u32>()
            {
                return Ok(pid);
            }
            if Instant::now() >= deadline {
                bail!("the launcher did not start the server in 10 s");
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

/// The command line of a `sanfs-mds serve` process the bench started.
pub(crate) struct ServeCommand {
    pub(crate) bin: PathBuf,
    pub(crate) config: PathBuf,
    pub(crate) log: PathBuf,
}

impl ServeCommand {
    pub(crate) fn spawn(&self) -> anyhow::Result<ChildGuard> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .with_context(|| format!("open {}", self.log.display()))?;
        ChildGuard::spawn(
            Command::new(&self.bin)
                .args(["serve", "--config"])
                .arg(&self.config)
                .env(
                    "RUST_LOG",
                    std::env::var("SANFS_BENCH_MDS_LOG").unwrap_or_else(|_| "warn".to_owned()),
                )
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(log),
        )
    }
}

/// Formats `volume`'s LUNs and creates a metadata store for it at `store` (what
/// `sanfs-mds format` does), for a server run in this process.
pub(crate) fn format_into_store(volume: &VolumeConfig, store: &Path) -> anyhow::Result<()> {
    mds::format(volume, &Backend::File(store.to_path_buf()), &Clock::System)?;
    Ok(())
}

async fn start_in_process(
    spec: &ClusterSpec,
    paths: &[PathBuf],
    store: &Path,
    addr: SocketAddr,
    metrics: SocketAddr,
) -> anyhow::Result<ServerHandle> {
    format_into_store(&volume_config(spec, paths), store)?;
    let mut opts = mds::serve_options(addr, Backend::File(store.to_path_buf()), paths.to_vec());
    opts.metrics_addr = Some(metrics);
    opts.direct_threshold = spec.direct_threshold;
    opts.batch_max = 256;
    let server = mds::ServeThread::start(None, "bench-mds", 2, opts, Clock::System)?;
    Ok(ServerHandle::InProcess {
        server: Some(server),
    })
}

/// Waits until something accepts at `addr`.
pub fn wait_for_tcp(addr: SocketAddr, timeout: Duration) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        match TcpStream::connect_timeout(&addr, Duration::from_millis(200)) {
            Ok(_) => return Ok(()),
            Err(e) if Instant::now() >= deadline => {
                bail!("nothing accepts at {addr} after {timeout:?}: {e}")
            }
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

/// `GET /metrics`, parsed into `name{labels}` -> value.
pub fn scrape(addr: SocketAddr) -> anyhow::Result<HashMap<String, f64>> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2))
        .with_context(|| format!("connect to the metrics endpoint {addr}"))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n")?;
    let mut body = String::new();
    s.read_to_string(&mut body).context("read the metrics")?;
    let mut out = HashMap::new();
    for line in body.lines() {
        if line.starts_with('#') || line.is_empty() {
            continue;
        }
        if let Some((k, v)) = line.rsplit_once(' ')
            && let Ok(v) = v.parse::<f64>()
        {
            out.insert(k.to_owned(), v);
        }
    }
    Ok(out)
}

/// A FUSE mount served by a `sanfs-agent mount --foreground` child; unmounted and the agent
/// stopped on drop.
pub struct Mount {
    pub path: PathBuf,
    child: ChildGuard,
}

impl Mount {
    /// Mounts `cluster` at `path` (which must exist).
    pub fn start(cluster: &BenchCluster, path: &Path) -> anyhow::Result<Mount> {
        Mount::start_source(&cluster.addr.to_string(), &cluster.globs, path, "")
    }

    /// Mounts `source` (`host:port`, or several servers: `a:p,b:q`) at `path` (which must
    /// exist); this node finds the LUNs at `globs`.
    /// `extra`: more `-o` options (`attr_ttl=0,entry_ttl=0`), or "".
    pub fn start_source(
        source: &str,
        globs: &[String],
        path: &Path,
        extra: &str,
    ) -> anyhow::Result<Mount> {
        let agent = sibling_binary("sanfs-agent").context(
            "sanfs-agent not found beside sanfs-bench or on PATH (build it: cargo build --release -p sanfs-client-agent)",
        )?;
        let path = std::fs::canonicalize(path)
            .with_context(|| format!("mount point {}", path.display()))?;
        let log = std::fs::File::create(path.with_extension("agent.log"))
            .context("create the agent log")?;
        let child = ChildGuard::spawn(
            Command::new(&agent)
                .arg("mount")
                .arg(source)
                .arg(&path)
                .arg("-o")
                .arg(format!(
                    "devices={},client_name=sanfs-bench-mount{}{extra}",
                    globs.join(":"),
                    if extra.is_empty() { "" } else { "," }
                ))
                .arg("--foreground")
                .env(
                    "RUST_LOG",
                    std::env::var("SANFS_BENCH_AGENT_LOG").unwrap_or_else(|_| "warn".to_owned()),
                )
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(log),
        )?;
        let mut m = Mount { path, child };
        let deadline = Instant::now() + Duration::from_secs(20);
        while !is_mounted(&m.path) {
            if let Some(status) = m.child.try_wait()? {
                bail!(
                    "sanfs-agent mount exited with {status}; see {}",
                    m.path.with_extension("agent.log").display()
                );
            }
            if Instant::now() >= deadline {
                bail!("sanfs-agent did not mount {} in 20 s", m.path.display());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(m)
    }

    /// The agent's process id (for its CPU time).
    pub fn agent_pid(&self) -> u32 {
        self.child.pid()
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        if is_mounted(&self.path) {
            let _ = rustix::mount::unmount(&self.path, rustix::mount::UnmountFlags::empty())
                .or_else(|_| {
                    rustix::mount::unmount(&self.path, rustix::mount::UnmountFlags::DETACH)
                });
        }
        let _ = self.child.terminate(Duration::from_secs(10));
        let _ = std::fs::remove_file(self.path.with_extension("agent.log"));
    }
}

/// Whether something is mounted at `path` (from `/proc/self/mounts`).
pub fn is_mounted(path: &Path) -> bool {
    let want = path.to_string_lossy();
    std::fs::read_to_string("/proc/self/mounts").is_ok_and(|m| {
        m.lines()
            .any(|l| l.split_whitespace().nth(1) == Some(want.as_ref()))
    })
}
