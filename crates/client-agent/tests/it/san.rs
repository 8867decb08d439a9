//! The multi-node test cluster of the acceptance tests (issue 5, deliverable 7), built on
//! `sanfs-testcluster`: LUNs that are loop devices with direct I/O (plain files without root),
//! the metadata server in-process on a runtime whose threads live in the server's network
//! namespace, and nodes in namespaces of their own joined by veth: either in-process
//! [`Client`]s on a runtime whose threads live in the node's namespace ([`Node`]), or real
//! `sanfs-agent mount` processes started in the node's namespace ([`Agent`]). Without root
//! everything is on 127.0.0.1 (and FUSE-based parts are skipped by their tests).
//!
//! Everything is torn down by guards, also when a test fails: nodes close their sessions and
//! stop their runtimes, agents are unmounted and killed by pid, the server is stopped, then
//! the LUNs are detached and the namespaces deleted (field order of [`San`]).
//!
//! Tests here are plain `#[test]`s: they block on the nodes' and the server's runtimes, which
//! run the work on their own (namespaced) threads.

use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sanfs_client_agent::buf::AlignedBuf;
use sanfs_client_agent::client::{Client, ClientConfig};
use sanfs_client_agent::engine::{EngineConfig, EngineKind};
use sanfs_mds::clock::Clock;
use sanfs_mds::store::Backend;
use sanfs_testcluster::{ChildGuard, LunKind, Luns, Network, mds};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::runtime::Runtime;

pub const MIB: u64 = 1 << 20;
pub const BLOCK: u64 = 4096;
pub const STRIPE_UNIT: u64 = 64 * 1024;
/// The server's direct-I/O threshold in these clusters.
pub const THRESHOLD: u64 = 64 * 1024;
const METRICS_PORT: u16 = 9410;
const AGENT_METRICS_PORT: u16 = 9420;

/// How a cluster is made.
#[derive(Debug, Clone)]
pub struct SanOptions {
    pub nodes: usize,
    pub luns: usize,
    pub lun_size: u64,
    pub lease_ttl_ms: u64,
}

impl Default for SanOptions {
    fn default() -> SanOptions {
        SanOptions {
            nodes: 2,
            luns: 4,
            lun_size: 128 * MIB,
            lease_ttl_ms: 10_000,
        }
    }
}

/// A runtime whose threads all live in one network namespace.
fn runtime_in(ns: &sanfs_testcluster::Netns, name: &str, workers: usize) -> Runtime {
    ns.run_thread(name, move || {
        Ok(tokio::runtime::Builder::new_multi_thread()
            .worker_threads(workers)
            .enable_all()
            .build()?)
    })
    .unwrap()
    .join()
    .unwrap()
    .unwrap()
}

/// Runs `f` on `rt`'s threads and waits for it.
fn run_on<F>(rt: &Runtime, f: F) -> F::Output
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    rt.block_on(rt.spawn(f)).expect("task panicked")
}

pub struct San {
    server_rt: Option<Runtime>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    server_task: Option<tokio::task::JoinHandle<anyhow::Result<()>>>,
    pub addr: SocketAddr,
    pub metrics_addr: SocketAddr,
    /// Where agents put their control sockets (`SANFS_RUN_DIR`).
    pub run_dir: PathBuf,
    pub luns: Luns,
    pub net: Network,
    _store_dir: tempfile::TempDir,
    _dir: tempfile::TempDir,
}

fn free_port(ip: IpAddr) -> u16 {
    std::net::TcpListener::bind((ip, 0))
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl San {
    pub fn start(opts: SanOptions) -> San {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_test_writer()
            .try_init();
        let dir = tempfile::tempdir().unwrap();
        let net = Network::create(opts.nodes).unwrap();
        let luns = Luns::create(dir.path(), opts.luns, opts.lun_size, LunKind::Auto).unwrap();
        // The metadata store on tmpfs where there is one: every metadata commit is a
        // durable sync, and on this machine's disk one costs ~6 ms, which would make the
        // acceptance tests measure the disk rather than the data path they are about.
        let store_dir = tempfile::Builder::new()
            .prefix("sanfs-mds-")
            .tempdir_in("/dev/shm")
            .unwrap_or_else(|_| tempfile::tempdir().unwrap());
        let backend = Backend::File(store_dir.path().join("mds.redb"));
        let volume = mds::striped(luns.paths(), BLOCK as u32, STRIPE_UNIT);
        mds::format(&volume, &backend, &Clock::System).unwrap();
        let ip = net.server_ip();
        let metrics_port = if net.is_isolated() {
            METRICS_PORT
        } else {
            free_port(ip)
        };
        let metrics_addr = SocketAddr::new(ip, metrics_port);
        // Plaintext on the test's own private bridge.
        let mut serve_opts =
            mds::serve_options(SocketAddr::new(ip, 0), backend, luns.paths().to_vec());
        serve_opts.metrics_addr = Some(metrics_addr);
        serve_opts.direct_threshold = THRESHOLD;
        serve_opts.lease_ttl_ms = opts.lease_ttl_ms;
        let rt = runtime_in(net.server(), "mds", 2);
        let mut serving = mds::spawn_serve(rt.handle(), serve_opts, Clock::System);
        let addr = rt
            .block_on(async {
                tokio::time::timeout(Duration::from_secs(60), serving.listening()).await
            })
            .expect("the server listens within 60 s")
            .expect("the server did not start");
        let (stop_tx, task) = serving.into_parts();
        let run_dir = dir.path().join("run");
        std::fs::create_dir(&run_dir).unwrap();
        eprintln!(
            "san: {} nodes ({}), {} LUNs of {} MiB ({}), server {addr}",
            opts.nodes,
            if net.is_isolated() {
                "network namespaces"
            } else {
                "loopback"
            },
            opts.luns,
            opts.lun_size / MIB,
            if luns.is_loop() {
                "loop devices"
            } else {
                "plain files"
            },
        );
        San {
            server_rt: Some(rt),
            stop: stop_tx,
            server_task: Some(task),
            addr,
            metrics_addr,
            run_dir,
            luns,
            net,
            _store_dir: store_dir,
            _dir: dir,
        }
    }

    /// The LUN paths as discovery globs.
    pub fn globs(&self) -> Vec<String> {
        self.luns
            .paths()
            .iter()
            .map(|p| p.to_string_lossy().into_owned())
            .collect()
    }

    pub fn client_config(&self, name: &str) -> ClientConfig {
        let mut c = ClientConfig::new(self.addr.to_string(), self.globs());
        c.client_name = name.to_owned();
        c.engine = EngineConfig {
            kind: EngineKind::Auto,
            queue_depth_per_device: 8,
        };
        c
    }

    /// An in-process client in node `i`'s namespace.
    pub fn node(&self, i: usize, name: &str) -> Node {
        self.node_with(i, self.client_config(name))
    }

    pub fn node_with(&self, i: usize, config: ClientConfig) -> Node {
        let rt = runtime_in(self.net.node(i), &format!("node{i}"), 2);
        let client = run_on(&rt, async move { Client::connect(config).await })
            .unwrap_or_else(|e| panic!("node {i} cannot connect: {e}"));
        Node {
            client: Some(Arc::new(client)),
            rt: Some(rt),
        }
    }

    /// The server's metrics text (scraped from inside its namespace). The figures the server
    /// counts itself are this server's alone, also with other tests' servers in the process.
    pub fn server_metrics(&self) -> String {
        let addr = self.metrics_addr;
        run_on(self.server_rt.as_ref().unwrap(), http_get(addr))
    }

    /// A real `sanfs-agent mount` in node `i`'s namespace, finding its LUNs by `globs`, with
    /// metrics on the node's address; waits until the mount and its control socket are there.
    /// `None` (after saying why) without root or /dev/fuse.
    pub fn mount_agent(&self, i: usize, name: &str, globs: &[String], extra: &str) -> Agent {
        let dir = tempfile::tempdir().unwrap();
        let mount = dir.path().join("mnt");
        std::fs::create_dir(&mount).unwrap();
        let metrics = SocketAddr::new(self.net.node_ip(i), {
            if self.net.is_isolated() {
                AGENT_METRICS_PORT
            } else {
                free_port(self.net.node_ip(i))
            }
        });
        let mut opts = format!(
            "devices={},client_name={name},metrics={metrics}",
            globs.join(":")
        );
        if !extra.is_empty() {
            opts = format!("{opts},{extra}");
        }
        let mut cmd = self.net.node(i).command(env!("CARGO_BIN_EXE_sanfs-agent"));
        cmd.arg("mount")
            .arg(self.addr.to_string())
            .arg(&mount)
            .arg("-o")
            .arg(&opts)
            .arg("--foreground")
            .env("SANFS_RUN_DIR", &self.run_dir)
            .env(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".to_owned()),
            )
            .stdin(Stdio::null())
            .stderr(std::fs::File::create(dir.path().join("agent.log")).unwrap());
        let child = ChildGuard::spawn(&mut cmd).unwrap();
        let rt = runtime_in(self.net.node(i), &format!("agent{i}"), 1);
        let mut agent = Agent {
            mount,
            metrics,
            child,
            rt: Some(rt),
            run_dir: self.run_dir.clone(),
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        while !(is_mounted(&agent.mount) && agent.control_socket().is_some_and(|s| s.exists())) {
            if let Some(st) = agent.child.try_wait().unwrap() {
                panic!("sanfs-agent exited before mounting: {st}");
            }
            assert!(
                Instant::now() < deadline,
                "mount (mounted: {}) or control socket ({:?}) did not appear in 60 s; agent log:\n{}",
                is_mounted(&agent.mount),
                agent.control_socket(),
                agent.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        agent
    }

    /// Runs the `sanfs-agent` command line (bmap, status) here, with this cluster's control
    /// directory.
    pub fn cli(&self, args: &[&str]) -> Output {
        Command::new(env!("CARGO_BIN_EXE_sanfs-agent"))
            .args(args)
            .env("SANFS_RUN_DIR", &self.run_dir)
            .env("RUST_LOG", "warn")
            .output()
            .unwrap()
    }
}

impl Drop for San {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let (Some(rt), Some(task)) = (self.server_rt.as_ref(), self.server_task.take()) {
            let stopped =
                rt.block_on(async { tokio::time::timeout(Duration::from_secs(20), task).await });
            if !std::thread::panicking() {
                match stopped {
                    Ok(Ok(Ok(()))) => {}
                    other => panic!("the server did not stop cleanly: {other:?}"),
                }
            }
        }
        if let Some(rt) = self.server_rt.take() {
            rt.shutdown_timeout(Duration::from_secs(2));
        }
    }
}

/// An in-process client whose runtime's threads live in its node's network namespace.
pub struct Node {
    client: Option<Arc<Client>>,
    rt: Option<Runtime>,
}

impl Node {
    pub fn client(&self) -> Arc<Client> {
        Arc::clone(self.client.as_ref().unwrap())
    }

    /// Runs `f(client)` on the node's threads and waits for it.
    pub fn run<T, Fut>(&self, f: impl FnOnce(Arc<Client>) -> Fut) -> T
    where
        Fut: Future<Output = T> + Send + 'static,
        T: Send + 'static,
    {
        run_on(self.rt.as_ref().unwrap(), f(self.client()))
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        if let (Some(rt), Some(client)) = (self.rt.as_ref(), self.client.take()) {
            rt.block_on(async move {
                if let Ok(c) = Arc::try_unwrap(client) {
                    let _ = tokio::time::timeout(Duration::from_secs(5), c.close()).await;
                }
            });
        }
        if let Some(rt) = self.rt.take() {
            rt.shutdown_timeout(Duration::from_secs(2));
        }
    }
}

/// A real `sanfs-agent mount` process; dropping it unmounts (lazily if need be) and kills it.
pub struct Agent {
    pub mount: PathBuf,
    pub metrics: SocketAddr,
    pub child: ChildGuard,
    /// For scraping its metrics from inside its node's namespace.
    rt: Option<Runtime>,
    run_dir: PathBuf,
    _dir: tempfile::TempDir,
}

impl Agent {
    pub fn p(&self, rel: &str) -> PathBuf {
        self.mount.join(rel)
    }

    /// What the agent logged so far (stderr).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self._dir.path().join("agent.log")).unwrap_or_default()
    }

    /// The control socket of this mount, once the mount is in mountinfo.
    pub fn control_socket(&self) -> Option<PathBuf> {
        let mounts = sanfs_client_agent::control::fuse_mounts().ok()?;
        let m = mounts.iter().rev().find(|m| m.mount_point == self.mount)?;
        Some(sanfs_client_agent::control::socket_path(
            &self.run_dir,
            m.major,
            m.minor,
        ))
    }

    /// Its Prometheus text.
    pub fn metrics_text(&self) -> String {
        run_on(self.rt.as_ref().unwrap(), http_get(self.metrics))
    }

    /// `kill -9`, then detach the dead mount.
    pub fn kill9(&mut self) {
        self.child.kill9().unwrap();
        if is_mounted(&self.mount) {
            let _ = rustix::mount::unmount(&self.mount, rustix::mount::UnmountFlags::DETACH);
        }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        if is_mounted(&self.mount) {
            let _ = rustix::mount::unmount(&self.mount, rustix::mount::UnmountFlags::empty());
        }
        if !matches!(
            self.child.wait_timeout(Duration::from_secs(10)),
            Ok(Some(_))
        ) {
            let _ = self.child.kill9();
        }
        if is_mounted(&self.mount) {
            let _ = rustix::mount::unmount(&self.mount, rustix::mount::UnmountFlags::DETACH);
        }
        if let Some(rt) = self.rt.take() {
            rt.shutdown_timeout(Duration::from_secs(1));
        }
    }
}

pub fn is_mounted(path: &Path) -> bool {
    sanfs_client_agent::control::fuse_mounts()
        .is_ok_and(|m| m.iter().any(|m| m.mount_point == path))
}

/// Whether FUSE mounts can be made here (says why not; fails under `SANFS_REQUIRE_ROOT=1`).
pub fn can_mount(test: &str) -> bool {
    !sanfs_testcluster::skip_unless(test, &[sanfs_testcluster::Need::Fuse])
}

/// `GET /metrics` at `addr`; the body.
pub async fn http_get(addr: SocketAddr) -> String {
    let mut s = tokio::time::timeout(
        Duration::from_secs(10),
        tokio::net::TcpStream::connect(addr),
    )
    .await
    .expect("connect to the metrics endpoint in time")
    .expect("connect to the metrics endpoint");
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut out = String::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_string(&mut out))
        .await
        .expect("metrics answered in time")
        .unwrap();
    let (head, body) = out.split_once("\r\n\r\n").expect("an HTTP answer");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    body.to_owned()
}

/// The value of `name{labels}` in a Prometheus text (0 if absent, as a counter never touched).
pub fn metric(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.rsplit_once(' '))
        .find(|(key, _)| {
            let (n, rest) = key.split_once('{').unwrap_or((key, ""));
            n == name
                && labels
                    .iter()
                    .all(|(k, v)| rest.contains(&format!("{k}=\"{v}\"")))
        })
        .map_or(0.0, |(_, v)| v.parse().unwrap())
}

/// `len` bytes of a LUN at `off`, read raw (O_DIRECT where the LUN takes it).
pub fn read_raw(path: &Path, off: u64, len: u64) -> Vec<u8> {
    let aligned = off.is_multiple_of(BLOCK) && len.is_multiple_of(BLOCK);
    match sanfs_lun::open_direct(path, sanfs_lun::Access::Read) {
        Ok((f, true)) if aligned => {
            let mut buf = AlignedBuf::zeroed(len as usize);
            f.read_exact_at(buf.as_mut_slice(), off).unwrap();
            buf.as_slice().to_vec()
        }
        _ => {
            let mut v = vec![0u8; len as usize];
            std::fs::File::open(path)
                .unwrap()
                .read_exact_at(&mut v, off)
                .unwrap();
            v
        }
    }
}

/// Deterministic pseudo-random numbers (splitmix64) for seeded tests.
pub use crate::cluster::Rng;

/// A seed from `SANFS_SEED`, else a fresh one; printed so that a failure can be replayed.
pub fn seed(test: &str) -> u64 {
    let seed = std::env::var("SANFS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            use std::hash::{BuildHasher, RandomState};
            RandomState::new().hash_one(test)
        });
    eprintln!("{test}: seed {seed} (replay with SANFS_SEED={seed})");
    seed
}

/// A size between 1 byte and `max`, log-uniform (as many 1-2 byte I/Os as 4-8 MiB ones).
pub fn log_size(rng: &mut Rng, max: u64) -> u64 {
    let bits = 64 - max.leading_zeros() as u64;
    let k = rng.below(bits);
    let lo = 1u64 << k;
    (lo + rng.below(lo)).min(max)
}

/// Random bytes for writes, cheap in a debug build: windows at random offsets of one random
/// pool (two writes of the same range get different bytes with overwhelming likelihood).
pub struct Pool(Vec<u8>);

impl Pool {
    pub fn new(rng: &mut Rng, len: usize) -> Pool {
        Pool(rng.bytes(len))
    }

    /// `len` bytes (at most the pool's size).
    pub fn take(&self, rng: &mut Rng, len: usize) -> Vec<u8> {
        let start = rng.below((self.0.len() - len) as u64 + 1) as usize;
        self.0[start..start + len].to_vec()
    }
}
