//! `sanfs-csi`: the CSI driver that gives Kubernetes (or any CSI container orchestrator)
//! ReadWriteMany volumes on a sanfs file system. A volume is a directory `ROOT/ID` with a
//! directory quota (bytes, optionally inodes) as its capacity.
//!
//! One binary serves CSI v1 over a unix socket, in one of three modes: `controller` (Identity
//! and Controller: create, delete, list, expand, validate volumes, report capacity; runs once
//! per cluster with the csi-provisioner and csi-resizer sidecars), `node` (Identity and Node:
//! stage, publish, stats; one per node, beside the kubelet) or `both`.
//!
//! - [`volume`]: names to ids, capacities, parameters, capabilities (pure).
//! - [`mounts`]: the node's mount table, bind mounts, unmounts.
//! - [`identity`], [`controller`], [`node`]: the three gRPC services.
//! - [`metrics`]: the node's one metrics endpoint, the driver's and its agents' metrics.
//!
//! Both modes hold one [`Client`] session at the metadata server (without LUNs: the driver
//! itself moves no file data) for namespace and quota calls; it is connected in the background
//! at start and re-tried until it works, and Probe reports ready only once it is there.
//!
//! **Staging.** NodeStageVolume runs one `sanfs-agent mount SERVER:/ROOT/ID STAGING_PATH`
//! per volume per node: the agent's FUSE mount has the volume's directory as its root, so
//! `df` inside shows the quota and a pod cannot reach past its volume. NodePublishVolume
//! bind-mounts the staging path at the pod's target path (read-only when asked), so all pods
//! of a node share the volume's one agent, session and LUN handles. The agents are separate
//! processes in process groups of their own: they outlive a restart of the driver process
//! (outside a container), and an unmount ends them.

pub mod controller;
pub mod identity;
pub mod metrics;
pub mod mounts;
pub mod node;
pub mod volume;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use sanfs_proto::csi::pb;
use sanfs_proto::types::{
    Credentials, FileName, FileType, FsError, InodeId, ProtocolError, ROOT_INODE,
};
use tonic::{Code, Status};

use crate::client::{Client, ClientConfig, TlsConfig};
use crate::engine::EngineKind;

/// The driver's default name: the convention `<driver>.csi.<vendor domain>`, under the
/// project's domain.
pub const DEFAULT_DRIVER_NAME: &str = "sanfs.csi.example.invalid";

/// Which services this process serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Controller,
    Node,
    Both,
}

impl Mode {
    pub fn controller(self) -> bool {
        matches!(self, Mode::Controller | Mode::Both)
    }

    pub fn node(self) -> bool {
        matches!(self, Mode::Node | Mode::Both)
    }
}

/// How the driver runs.
#[derive(Debug, Clone)]
pub struct Config {
    pub driver_name: String,
    pub mode: Mode,
    /// This node's id (NodeGetInfo).
    pub node_id: String,
    /// `host:port` of the metadata server.
    pub server: String,
    /// Mutual TLS towards the server (also handed to the agents).
    pub tls: Option<TlsConfig>,
    /// The directory of the file system the volumes live in (absolute, e.g. `/csi`).
    pub root: String,
    /// LUN globs for the agents (`devices=`); empty: the agent's defaults.
    pub devices: Vec<String>,
    /// The `sanfs-agent` executable.
    pub agent_path: PathBuf,
    /// More `-o` options for the agents (e.g. `attr_ttl=1s,engine=uring`).
    pub agent_options: Vec<String>,
    /// Capacity of a volume whose request names none.
    pub default_capacity: u64,
    /// How long a stage waits for the agent's mount to appear.
    pub mount_timeout: Duration,
}

/// Everything the services share.
pub struct Driver {
    pub config: Config,
    /// The root directory split into names (empty for `/`).
    root_names: Vec<FileName>,
    link: OnceLock<Arc<Client>>,
    locks: KeyedLocks,
}

/// Why a CSI call failed; each maps to the gRPC code the specification asks for, in one place
/// ([`From<CsiError> for Status`]).
#[derive(Debug, thiserror::Error)]
pub enum CsiError {
    #[error("{0}")]
    Invalid(#[from] ProtocolError),
    /// A field sanfs does not support (block access, a parameter, a snapshot source).
    #[error("{0}")]
    Unsupported(String),
    #[error("volume {0:?} does not exist")]
    NoVolume(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    AlreadyExists(String),
    #[error("{0}")]
    FailedPrecondition(String),
    #[error("{0}")]
    OutOfRange(String),
    #[error("{0}")]
    Aborted(String),
    #[error("not connected to the metadata server (yet)")]
    NotConnected,
    #[error("metadata server: {0}")]
    Fs(#[from] FsError),
    #[error("{0}")]
    Internal(String),
}

impl From<CsiError> for Status {
    fn from(e: CsiError) -> Status {
        let code = match &e {
            CsiError::Invalid(_) | CsiError::Unsupported(_) => Code::InvalidArgument,
            CsiError::NoVolume(_) | CsiError::NotFound(_) => Code::NotFound,
            CsiError::AlreadyExists(_) => Code::AlreadyExists,
            CsiError::FailedPrecondition(_) => Code::FailedPrecondition,
            CsiError::OutOfRange(_) => Code::OutOfRange,
            CsiError::Aborted(_) => Code::Aborted,
            CsiError::NotConnected | CsiError::Fs(FsError::StaleSession) => Code::Unavailable,
            CsiError::Fs(FsError::LockTimeout) => Code::Aborted,
            CsiError::Fs(FsError::NoSpace) => Code::ResourceExhausted,
            // Anything else the server answers is unexpected here (the driver asks only
            // what it checked): never let it read as "volume not found" to the CO.
            CsiError::Fs(_) | CsiError::Internal(_) => Code::Internal,
        };
        Status::new(code, e.to_string())
    }
}

pub(crate) fn io_error(what: &str, e: impl std::fmt::Display) -> CsiError {
    CsiError::Internal(format!("{what}: {e}"))
}

/// Converts a request, answering `INVALID_ARGUMENT` for a bad one.
pub(crate) fn convert<P, D>(p: P) -> Result<D, Status>
where
    D: TryFrom<P, Error = ProtocolError>,
{
    D::try_from(p).map_err(|e| sanfs_proto::csi::invalid_argument(&e))
}

/// Serializes calls on the same volume (the CO may repeat a call while the first still runs).
#[derive(Default)]
struct KeyedLocks {
    held: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

impl KeyedLocks {
    async fn lock(&self, key: &str) -> KeyGuard<'_> {
        let m = {
            let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
            Arc::clone(held.entry(key.to_owned()).or_default())
        };
        let guard = Arc::clone(&m).lock_owned().await;
        KeyGuard {
            locks: self,
            key: key.to_owned(),
            _guard: Some(guard),
        }
    }
}

struct KeyGuard<'a> {
    locks: &'a KeyedLocks,
    key: String,
    _guard: Option<tokio::sync::OwnedMutexGuard<()>>,
}

impl Drop for KeyGuard<'_> {
    fn drop(&mut self) {
        self._guard = None;
        let mut held = self.locks.held.lock().unwrap_or_else(|e| e.into_inner());
        // Forget the key when nobody else waits for it (the map holds one reference).
        if held
            .get(&self.key)
            .is_some_and(|m| Arc::strong_count(m) == 1)
        {
            held.remove(&self.key);
        }
    }
}

/// The names of an absolute path inside the file system (`/a/b` -> `a`, `b`).
pub fn split_root(root: &str) -> Result<Vec<FileName>, String> {
    if !root.starts_with('/') {
        return Err(format!("root {root:?} is not an absolute path"));
    }
    root.split('/')
        .filter(|p| !p.is_empty())
        .map(|p| FileName::new(p.as_bytes().to_vec()).map_err(|e| format!("root {root:?}: {e}")))
        .collect()
}

impl Driver {
    pub fn new(config: Config) -> Result<Arc<Driver>, String> {
        let root_names = split_root(&config.root)?;
        sanfs_proto::csi::NodeInfo::new(config.node_id.clone(), 0)
            .map_err(|e| format!("node id: {e}"))?;
        Ok(Arc::new(Driver {
            config,
            root_names,
            link: OnceLock::new(),
            locks: KeyedLocks::default(),
        }))
    }

    /// Connects to the server in the background, retrying (1 s, doubling to 30 s) until it
    /// works. Returns at once.
    pub fn connect_in_background(self: &Arc<Self>) {
        let driver = Arc::clone(self);
        tokio::spawn(async move {
            let mut delay = Duration::from_secs(1);
            loop {
                let mut cc = ClientConfig::new(driver.config.server.clone(), Vec::new());
                cc.tls = driver.config.tls.clone();
                cc.client_name = format!("sanfs-csi:{}", driver.config.node_id)
                    .chars()
                    .take(200)
                    .collect();
                // The driver does no data I/O: no LUNs, the synchronous engine.
                cc.engine.kind = EngineKind::Sync;
                match Client::connect(cc).await {
                    Ok(c) => {
                        tracing::info!(server = %driver.config.server, "connected to the metadata server");
                        let _ = driver.link.set(Arc::new(c));
                        return;
                    }
                    Err(e) => {
                        tracing::warn!(server = %driver.config.server, error = %e, retry_in = ?delay, "cannot connect to the metadata server");
                        tokio::time::sleep(delay).await;
                        delay = (delay * 2).min(Duration::from_secs(30));
                    }
                }
            }
        });
    }

    /// The session at the server, once connected.
    pub fn client(&self) -> Result<&Client, CsiError> {
        self.link
            .get()
            .map(|c| c.as_ref())
            .ok_or(CsiError::NotConnected)
    }

    /// The volumes' root directory, created (0755, root-owned) when `create` and missing.
    /// `None` when it does not exist and `create` is false.
    pub(crate) async fn root_dir(&self, create: bool) -> Result<Option<InodeId>, CsiError> {
        let client = self.client()?;
        let cred = Credentials::root();
        let mut ino = ROOT_INODE;
        for name in &self.root_names {
            let attr = match client.lookup(&cred, ino, name.as_bytes()).await {
                Ok(a) => a,
                Err(FsError::NotFound) if create => {
                    match client.mkdir(&cred, ino, name.as_bytes(), 0o755).await {
                        Ok(a) => a,
                        // Made meanwhile by another caller.
                        Err(FsError::Exists) => client.lookup(&cred, ino, name.as_bytes()).await?,
                        Err(e) => return Err(e.into()),
                    }
                }
                Err(FsError::NotFound) => return Ok(None),
                Err(e) => return Err(e.into()),
            };
            if attr.kind != FileType::Directory {
                return Err(CsiError::Internal(format!(
                    "the volume root {} is not a directory",
                    self.config.root
                )));
            }
            ino = attr.ino;
        }
        Ok(Some(ino))
    }

    /// The volume `id` as it is on the server: its directory's inode and its quota's capacity
    /// (bytes) and inode limit. `None` when there is no such volume (no directory of that name,
    /// or one without a quota: not a volume).
    pub(crate) async fn find_volume(&self, id: &str) -> Result<Option<VolumeOnServer>, CsiError> {
        let Some(dir) = volume::directory_of(id) else {
            return Ok(None);
        };
        let Some(root) = self.root_dir(false).await? else {
            return Ok(None);
        };
        let client = self.client()?;
        let cred = Credentials::root();
        let attr = match client.lookup(&cred, root, dir.as_bytes()).await {
            Ok(a) => a,
            Err(FsError::NotFound) => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        if attr.kind != FileType::Directory {
            return Ok(None);
        }
        let Some(q) = client.get_quota(&cred, attr.ino).await? else {
            return Ok(None);
        };
        Ok(Some(VolumeOnServer {
            root,
            name: dir,
            ino: attr.ino,
            capacity: q.limits.capacity_bytes.unwrap_or(0),
            inode_limit: q.limits.inodes,
            used_bytes: q.used_bytes,
            used_inodes: q.used_inodes,
        }))
    }

    /// The mount source the agent shows for volume `id` (`SERVER:/ROOT/ID`).
    pub(crate) fn mount_source(&self, id: &str) -> String {
        format!("{}:{}", self.config.server, self.volume_path_in_fs(id))
    }

    /// The volume's path inside the file system (`/ROOT/ID`).
    pub(crate) fn volume_path_in_fs(&self, id: &str) -> String {
        let mut p = String::new();
        for n in &self.root_names {
            p.push('/');
            p.push_str(&n.to_string());
        }
        p.push('/');
        p.push_str(id);
        p
    }

    /// Whether a mount-table entry is the sanfs mount of volume `id` (by the end of its
    /// source, `:/ROOT/ID`, so a server named differently still matches).
    pub(crate) fn is_volume_mount(&self, m: &mounts::MountEntry, id: &str) -> bool {
        mounts::is_fuse_type(&m.fs_type)
            && m.source
                .ends_with(&format!(":{}", self.volume_path_in_fs(id)))
    }
}

/// A volume as found on the server.
#[derive(Debug, Clone)]
pub(crate) struct VolumeOnServer {
    pub(crate) root: InodeId,
    pub(crate) name: FileName,
    pub(crate) ino: InodeId,
    pub(crate) capacity: u64,
    pub(crate) inode_limit: Option<u64>,
    pub(crate) used_bytes: u64,
    pub(crate) used_inodes: u64,
}

/// Serves the services of `driver`'s mode on the unix socket `socket` until `shutdown`
/// completes. A stale socket file at that path is replaced.
pub async fn serve(
    driver: Arc<Driver>,
    socket: PathBuf,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    use anyhow::Context;
    use std::os::unix::fs::FileTypeExt;
    if let Ok(meta) = std::fs::symlink_metadata(&socket) {
        if !meta.file_type().is_socket() {
            anyhow::bail!("{} exists and is not a socket", socket.display());
        }
        std::fs::remove_file(&socket)
            .with_context(|| format!("remove the stale socket {}", socket.display()))?;
    }
    if let Some(parent) = socket.parent() {
        std::fs::create_dir_all(parent).with_context(|| format!("create {}", parent.display()))?;
    }
    let listener = tokio::net::UnixListener::bind(&socket)
        .with_context(|| format!("listen on {}", socket.display()))?;
    let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener);
    let mode = driver.config.mode;
    let mut router =
        tonic::transport::Server::builder().add_service(pb::identity_server::IdentityServer::new(
            identity::IdentityService::new(Arc::clone(&driver)),
        ));
    if mode.controller() {
        router = router.add_service(pb::controller_server::ControllerServer::new(
            controller::ControllerService::new(Arc::clone(&driver)),
        ));
    }
    if mode.node() {
        router = router.add_service(pb::node_server::NodeServer::new(node::NodeService::new(
            Arc::clone(&driver),
        )));
    }
    tracing::info!(socket = %socket.display(), ?mode, name = %driver.config.driver_name, "serving CSI");
    router
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await
        .context("serve CSI")?;
    let _ = std::fs::remove_file(&socket);
    Ok(())
}
