//! A test cluster in one process: `sanfs-mds` served on 127.0.0.1 over four file-backed LUNs
//! (striped, 64 KiB stripe unit, 4 KiB blocks), and [`Client`]s connected to it as nodes.

use std::net::SocketAddr;
use std::path::PathBuf;

use sanfs_client_agent::client::{Client, ClientConfig, FaultInjection, FileHandle};
use sanfs_client_agent::engine::{EngineConfig, EngineKind};
use sanfs_mds::clock::Clock;
use sanfs_mds::serve::{ServeOptions, TlsPaths};
use sanfs_mds::store::Backend;
use sanfs_proto::model::OpenFlags;
use sanfs_proto::types::{Credentials, InodeId, ROOT_INODE};
use sanfs_testcluster::mds;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

pub const MIB: u64 = 1 << 20;
pub const LUNS: usize = 4;
pub const LUN_SIZE: u64 = 64 * MIB;

pub struct Cluster {
    pub addr: SocketAddr,
    /// The server's unix socket, when [`start_unix`] made the cluster: clients connect there.
    pub unix: Option<PathBuf>,
    pub luns: Vec<PathBuf>,
    opts: ServeOptions,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<anyhow::Result<()>>>,
    _dir: tempfile::TempDir,
}

/// Starts a server with lease TTL `lease_ttl_ms`.
pub async fn start(lease_ttl_ms: u64) -> Cluster {
    start_with(lease_ttl_ms, None).await
}

/// Starts a server with lease TTL `lease_ttl_ms`, speaking mutual TLS with `tls`.
pub async fn start_with(lease_ttl_ms: u64, tls: Option<TlsPaths>) -> Cluster {
    // Logs with RUST_LOG=... (once per process).
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    let dir = tempfile::tempdir().unwrap();
    let (luns, opts) = prepare(
        dir.path(),
        "127.0.0.1:0".parse().unwrap(),
        lease_ttl_ms,
        tls,
    );
    let mut cluster = Cluster {
        addr: opts.listen,
        unix: None,
        luns,
        opts,
        stop: None,
        task: None,
        _dir: dir,
    };
    cluster.run().await;
    cluster
}

/// Starts a server that refuses plaintext TCP and serves its unix socket, to which the
/// cluster's clients connect (`unix:/path`): known by their uid, as same-host agents are.
pub async fn start_unix(lease_ttl_ms: u64) -> Cluster {
    let dir = tempfile::tempdir().unwrap();
    let (luns, mut opts) = prepare(
        dir.path(),
        "127.0.0.1:0".parse().unwrap(),
        lease_ttl_ms,
        None,
    );
    let sock = dir.path().join("mds.sock");
    opts.insecure = false;
    opts.listen_unix = Some(sock.clone());
    let mut cluster = Cluster {
        addr: opts.listen,
        unix: Some(sock),
        luns,
        opts,
        stop: None,
        task: None,
        _dir: dir,
    };
    cluster.run().await;
    cluster
}

/// Makes [`LUNS`] file LUNs in `dir`, formats them as a striped volume, creates the metadata
/// store, and returns the LUNs and the options to serve it on `listen` (plaintext on a
/// non-loopback address is allowed: such addresses exist only in a test's own namespaces).
pub fn prepare(
    dir: &std::path::Path,
    listen: SocketAddr,
    lease_ttl_ms: u64,
    tls: Option<TlsPaths>,
) -> (Vec<PathBuf>, ServeOptions) {
    let luns = mds::file_luns(dir, LUNS, LUN_SIZE).unwrap();
    let backend = Backend::File(dir.join("mds.redb"));
    mds::format(
        &mds::striped(&luns, 4096, 64 * 1024),
        &backend,
        &Clock::System,
    )
    .unwrap();
    let mut opts = mds::serve_options(listen, backend, luns.clone());
    // The test PKI's one client certificate (`agent-a`, see [`pki`]) also runs the CSI
    // controller, whose SetQuota is an admin call.
    opts.access = sanfs_mds::service::identity::AccessConfig {
        clients: vec![(
            "agent-a".to_owned(),
            sanfs_mds::service::identity::ClientPolicy::TRUSTED,
        )],
        ..Default::default()
    };
    opts.tls = tls;
    opts.lease_ttl_ms = lease_ttl_ms;
    (luns, opts)
}

/// A server on a thread of its own inside a network namespace (a test cluster's server node),
/// on a current-thread runtime. Stopped cleanly on drop.
pub struct NetServer {
    pub addr: SocketAddr,
    pub luns: Vec<PathBuf>,
    /// Stopped (and its thread joined) on drop, before the directory goes.
    _server: mds::ServeThread,
    _dir: tempfile::TempDir,
}

impl NetServer {
    /// Serves on `ip` (an address of `ns`), any port.
    pub fn start_in(
        ns: &sanfs_testcluster::Netns,
        ip: std::net::IpAddr,
        lease_ttl_ms: u64,
    ) -> NetServer {
        let dir = tempfile::tempdir().unwrap();
        let (luns, opts) = prepare(dir.path(), SocketAddr::new(ip, 0), lease_ttl_ms, None);
        let server = mds::ServeThread::start(Some(ns), "mds", 0, opts, Clock::System).unwrap();
        NetServer {
            addr: server.addr,
            luns,
            _server: server,
            _dir: dir,
        }
    }
}

impl Cluster {
    /// Starts `serve` with the cluster's options; remembers the bound address so that a
    /// restart listens on the same one.
    async fn run(&mut self) {
        // After a stop, the previous instance's last tasks may hold the store for a moment.
        for attempt in 0.. {
            let mut serving = mds::spawn_serve(
                &tokio::runtime::Handle::current(),
                self.opts.clone(),
                Clock::System,
            );
            match serving.listening().await {
                Ok(a) => {
                    self.addr = a;
                    self.opts.listen = a;
                    let (stop, task) = serving.into_parts();
                    self.stop = stop;
                    self.task = Some(task);
                    return;
                }
                Err(_) if attempt < 50 => {
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                }
                Err(e) => panic!("serve did not start: {e:#}"),
            }
        }
    }

    /// Stops the server cleanly and starts it again on the same address and store (a new
    /// epoch: every session of the old one is gone).
    pub async fn restart(&mut self) {
        self.shutdown().await;
        self.run().await;
    }

    /// Stops the server cleanly, runs `between` on the metadata store's file (to copy or
    /// restore it), and starts the server again on the same address.
    pub async fn restart_with(&mut self, between: impl FnOnce(&std::path::Path)) {
        self.shutdown().await;
        let Backend::File(path) = &self.opts.backend else {
            panic!("the test cluster keeps its store in a file");
        };
        between(path);
        self.run().await;
    }

    async fn shutdown(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.task.take() {
            let r = tokio::time::timeout(std::time::Duration::from_secs(20), t)
                .await
                .expect("serve stops within the grace");
            r.unwrap().unwrap();
        }
    }

    pub fn config(&self, name: &str) -> ClientConfig {
        let globs = self
            .luns
            .iter()
            .map(|p| p.to_string_lossy().into_owned())
            .collect();
        let server = match &self.unix {
            Some(sock) => format!("unix:{}", sock.display()),
            None => self.addr.to_string(),
        };
        let mut c = ClientConfig::new(server, globs);
        c.client_name = name.to_owned();
        c.engine = EngineConfig {
            kind: EngineKind::Auto,
            queue_depth_per_device: 8,
        };
        c
    }

    pub async fn client(&self, name: &str) -> Client {
        Client::connect(self.config(name)).await.unwrap()
    }

    pub async fn client_with_faults(&self, name: &str, faults: FaultInjection) -> Client {
        let mut c = self.config(name);
        c.faults = faults;
        Client::connect(c).await.unwrap()
    }

    /// Stops the server and checks that it stopped cleanly.
    pub async fn stop(mut self) {
        self.shutdown().await;
    }
}

pub fn root() -> Credentials {
    Credentials::root()
}

pub fn rw() -> OpenFlags {
    OpenFlags {
        read: true,
        write: true,
        append: false,
        truncate: false,
    }
}

/// Creates `name` in the root directory through `c`; returns its inode and handle.
pub async fn create(c: &Client, name: &str) -> (InodeId, FileHandle) {
    let r = c
        .create(&root(), ROOT_INODE, name, 0o644, false, rw())
        .await
        .unwrap();
    (r.attr.ino, r.handle)
}

/// Opens `ino` through `c`.
pub async fn open(c: &Client, ino: InodeId) -> FileHandle {
    c.open(&root(), ino, rw()).await.unwrap().0
}

/// Deterministic pseudo-random numbers (splitmix64) for seeded tests.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    pub fn bytes(&mut self, len: usize) -> Vec<u8> {
        let mut v = Vec::with_capacity(len + 8);
        while v.len() < len {
            v.extend_from_slice(&self.next().to_le_bytes());
        }
        v.truncate(len);
        v
    }
}

/// A byte model of one file.
#[derive(Default)]
pub struct Model(pub Vec<u8>);

impl Model {
    pub fn write(&mut self, offset: u64, data: &[u8]) {
        let end = offset as usize + data.len();
        if self.0.len() < end {
            self.0.resize(end, 0);
        }
        self.0[offset as usize..end].copy_from_slice(data);
    }

    pub fn truncate(&mut self, size: u64) {
        self.0.resize(size as usize, 0);
    }

    /// What a read of `len` bytes at `offset` returns.
    pub fn read(&self, offset: u64, len: u64) -> &[u8] {
        let start = (offset as usize).min(self.0.len());
        let end = (offset.saturating_add(len) as usize).min(self.0.len());
        &self.0[start..end]
    }
}

/// Asserts equality of two byte strings, naming the first difference (not dumping them).
#[track_caller]
pub fn assert_bytes(got: &[u8], want: &[u8], what: &str) {
    if got != want {
        let first = got.iter().zip(want).position(|(a, b)| a != b);
        panic!(
            "{what}: got {} bytes, want {}; first difference at {first:?}",
            got.len(),
            want.len()
        );
    }
}

/// A test PKI: a CA, and the server's, one agent's (`agent-a`) and an administrator's
/// (`admin-node`) certificates signed by it, as PEM files in `dir`.
pub struct Pki {
    pub server: TlsPaths,
    pub ca: PathBuf,
    pub agent_cert: PathBuf,
    pub agent_key: PathBuf,
    pub admin_cert: PathBuf,
    pub admin_key: PathBuf,
}

pub fn pki(dir: &std::path::Path) -> Pki {
    use rcgen::{
        BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer,
        KeyPair, KeyUsagePurpose,
    };
    let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    p.distinguished_name
        .push(DnType::CommonName, "sanfs test CA");
    p.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let ca_key = KeyPair::generate().unwrap();
    let ca_pem = p.self_signed(&ca_key).unwrap().pem();
    let issuer = Issuer::new(p, ca_key);
    let leaf = |names: &[&str], client: bool| {
        let mut p =
            CertificateParams::new(names.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>())
                .unwrap();
        p.distinguished_name.push(DnType::CommonName, names[0]);
        p.extended_key_usages = vec![if client {
            ExtendedKeyUsagePurpose::ClientAuth
        } else {
            ExtendedKeyUsagePurpose::ServerAuth
        }];
        let key = KeyPair::generate().unwrap();
        let cert = p.signed_by(&key, &issuer).unwrap();
        (cert.pem(), key.serialize_pem())
    };
    let write = |name: &str, text: &str| {
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        path
    };
    let (server_cert, server_key) = leaf(&["localhost", "127.0.0.1"], false);
    let (agent_cert, agent_key) = leaf(&["agent-a"], true);
    let (admin_cert, admin_key) = leaf(&["admin-node"], true);
    let ca = write("ca.pem", &ca_pem);
    Pki {
        server: TlsPaths {
            cert: write("server.pem", &server_cert),
            key: write("server.key", &server_key),
            ca: ca.clone(),
        },
        ca,
        agent_cert: write("agent.pem", &agent_cert),
        agent_key: write("agent.key", &agent_key),
        admin_cert: write("admin.pem", &admin_cert),
        admin_key: write("admin.key", &admin_key),
    }
}

/// A new file in the root created for writing (with its write delegation), as an open file.
pub async fn create_for_writing(
    c: &Client,
    name: &str,
) -> (
    sanfs_proto::types::InodeId,
    std::sync::Arc<sanfs_client_agent::client::OpenFile>,
) {
    let r = c
        .create(
            &root(),
            sanfs_proto::types::ROOT_INODE,
            name,
            0o644,
            true,
            rw(),
        )
        .await
        .unwrap();
    let f = sanfs_client_agent::client::OpenFile::new(r.attr.ino, rw(), r.handle, &root());
    (r.attr.ino, std::sync::Arc::new(f))
}
