//! `sanfs_client`: the library the FUSE mount, the bench and the tests use to reach a sanfs
//! file system: a session at the metadata server, the namespace calls, and the data path
//! (direct through this node's LUNs, or proxied through the server).
//!
//! [`Client::connect`] opens a session (`OpenSession`), reads the volume (`Admin.GetVolume`),
//! finds this node's LUNs ([`crate::discovery`]; a LUN it cannot see is not fatal: I/O on it
//! goes proxied), starts the I/O [`Engine`], and starts the *session task*, which attaches the
//! session stream, heartbeats every `lease_ttl_ms / 3`, answers recalls of cached read grants,
//! and keeps the lease as the protocol's agent rule says: valid until the **send** time of the
//! last acknowledged heartbeat plus the TTL (for the first, the send time of `OpenSession`).
//!
//! **Self-fencing.** Every direct-path call checks the lease right before it submits device
//! I/O. When the lease lapses (no acknowledgement in time), the session task fences: it marks
//! the session lost (every later data call fails with `StaleSession`, ESTALE, before any
//! device I/O), drops every cached read grant, waits for device I/O in flight, and opens a new
//! session. It does the same when the server ends the session (`SessionEnded` other than
//! `REPLACED`), when a call answers `StaleSession`, or when attaching fails with it (a
//! restarted server). When only the stream breaks while the lease is still valid, it attaches
//! again to the same session.
//! A server that evicts the session (`SessionEnded {EVICTED}`: a grant of this node was
//! waited for past the server's hold limit, or an administrator's call) is handled the same
//! way; a write whose device I/O was done but whose completion the server then refuses
//! returns EIO (never ESTALE, which an [`OpenFile`] would retry under the new session).
//!
//! **A restart is a pause.** Every call goes through one helper (`rpc`): a transport failure
//! or a `StaleSession` answer makes the call wait for a live session and send again (as long
//! as [`ClientConfig::retry`] allows: `hard`, forever; `soft`, then EIO).
//!
//! **Handles across sessions.** Open handles belong to a session. A [`FileHandle`] of a session
//! that has been replaced is refused locally with [`FsError::Stale`] (ESTALE), once the new
//! session is open (a call waits for it first). An [`OpenFile`] (from [`Client::open_file`])
//! then re-opens itself under the new session (inode numbers are stable) and redoes the whole
//! call; the FUSE mount keeps one per open file.
//!
//! **LUN health.** A failed device write poisons the device in the engine (fail stop): its I/O
//! goes through the server from then on. The *health task* (`health`) probes a poisoned LUN
//! again after [`ClientConfig::device_retry`] (doubling while it keeps failing, up to 64
//! times that): it looks the LUN up again by its label identity among the globs, opens it
//! afresh with `O_DIRECT`, swaps the new handle into the engine and lifts the poison. Nothing
//! the failed write touched is trusted meanwhile: that grant was completed with the error, so
//! the server keeps its blocks Unwritten.
//!
//! **Unsynced writes across a server restart.** Write completions the server acknowledged
//! lazily are recorded (`unsynced`) until the server reports them durable; after a new server
//! epoch the session task replays them before the new session goes live, and a file whose
//! replay was refused answers EIO at its next fsync or close.
//!
//! Submodules: `namespace` (the POSIX metadata calls), `quota` (directory quotas), `data` (the
//! routing rule and both paths), `file` (open files that survive a session change), `cache`
//! (cached read grants), `subplan` (cutting a cached grant's plan), `session` (the session
//! task), `rpc` (the call helper: retries and waiting for the server), `health` (re-probing
//! poisoned LUNs), `rescan` (the volume read again, missing LUNs looked for: a growth, a LUN
//! that appears later), `locks` (cluster-wide fcntl/flock locks), `servers` (several server
//! addresses: the list's parser, and the connector to whichever answers),
//! `status` (what `sanfs-agent status` and `bmap` show, and the counters behind the agent's
//! metrics).

mod cache;
mod creates;
mod data;
mod file;
mod health;
pub mod leases;
mod locks;
mod namespace;
mod quota;
mod releases;
mod rescan;
mod rpc;
mod seek;
mod servers;
mod session;
mod status;
mod subplan;
mod unsynced;
mod writeback;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use sanfs_blockmap::volume::{DeviceIndex, Volume};
use sanfs_proto::model::{
    MAX_MESSAGE_SIZE, OpenSessionReply, OpenSessionRequest, PROTOCOL_VERSION, ServerInfo,
    VolumeInfo,
};
use sanfs_proto::pb;
use sanfs_proto::pb::admin_client::AdminClient;
use sanfs_proto::pb::data_client::DataClient;
use sanfs_proto::pb::namespace_client::NamespaceClient;
use sanfs_proto::pb::session_client::SessionClient;
use sanfs_proto::status::fs_error_from_status;
use sanfs_proto::types::{FsError, InodeId, OpenHandle, SessionEpoch, SessionId};
use tokio::sync::{Notify, mpsc, watch};
use tokio::task::JoinHandle;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

use crate::discovery::{DiscoveryConfig, discover};
use crate::engine::{Engine, EngineConfig};
use cache::GrantCache;

pub use data::{LayoutPin, WriteOutcome};
pub(crate) use file::retrying;
pub use file::{MAX_REOPENS, OpenFile, is_stale};
pub use locks::LockWait;
pub use namespace::Created;
pub use rpc::{COMPLAIN_EVERY, DEFAULT_SOFT_TIMEOUT, RetryPolicy};
pub use seek::SeekWhat;
pub use servers::{CONNECT_TIMEOUT, ServerAddr, join_servers, parse_servers};
pub use status::{
    AgentStatus, BmapEntry, BmapReply, ByteCounts, DeviceHealth, DeviceStatus, GrantCounts,
};
pub use writeback::{WriteBackConfig, WriteBackStats};

/// Mutual TLS towards the server: PEM files.
#[derive(Debug, Clone)]
pub struct TlsConfig {
    /// The CA that signed the server's certificate.
    pub ca: PathBuf,
    /// This agent's certificate chain and key.
    pub cert: PathBuf,
    pub key: PathBuf,
    /// The name to check the server's certificate against (default: the host of `server`).
    pub domain: Option<String>,
}

/// Faults a test can inject (never set in production).
#[derive(Debug, Clone, Default)]
pub struct FaultInjection {
    /// Open these LUNs read-only instead of read-write: device writes on them fail (EBADF)
    /// as a failing LUN would, while reads work.
    pub read_only_devices: Vec<DeviceIndex>,
    /// Attach each session's stream this much later (a loaded server or network): what the
    /// agent does before its first attach.
    pub attach_delay: Option<Duration>,
}

/// How to connect.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// `host:port` of the metadata server, several of them (`a:7410,b:7410`: whichever
    /// answers, see `servers`), or `unix:/path` for its local unix socket.
    pub server: String,
    /// Mutual TLS; `None`: plaintext (the server accepts it on loopback only, unless insecure).
    pub tls: Option<TlsConfig>,
    /// Where to look for the volume's LUNs.
    pub discovery: DiscoveryConfig,
    pub engine: EngineConfig,
    /// Shown by the server in `ServerStatus` and its logs.
    pub client_name: String,
    /// Most read grants kept cached at once (least recently used ones are returned).
    pub max_cached_grants: usize,
    /// How long a LUN poisoned by a failed write waits before it is probed again (doubling
    /// while probes fail, up to 64 times this).
    pub device_retry: Duration,
    /// This client's direct-I/O threshold instead of the server's (`Some(u64::MAX)`: every
    /// I/O proxied; `Some(0)`: every block-aligned I/O direct). For benchmarks and tuning.
    pub direct_io_threshold: Option<u64>,
    /// Method A of the paper (section 4.3), for the benchmark of control messages: one grant,
    /// so one MapRead/MapWrite and one Complete, per stripe unit of the file instead of one
    /// per I/O. Never faster; off in production.
    pub grant_per_stripe_unit: bool,
    /// A direct read shorter than this asks for a read grant of this many bytes from its
    /// offset (up to the end of file): a layout that the following reads of a sequential
    /// reader find cached, one round trip for many reads (as pNFS layouts). 0: only the
    /// bytes read. Grants are kept only while cacheable; a writer recalls them.
    pub read_layout_bytes: u64,
    /// A sequential writer's direct write asks for a write layout of this many bytes from
    /// its offset: an exclusive grant kept cached, inside which the following writes need one
    /// round trip (a partial completion) instead of two (as pNFS write layouts). Recalled when
    /// another node reads, writes or truncates there. 0: one grant per write.
    pub write_layout_bytes: u64,
    /// Small buffered writes held back under write delegations (the mount's write-back
    /// cache, see `writeback`); `total_bytes` 0 turns it off.
    pub writeback: WriteBackConfig,
    /// Every namespace change durable when it returns (mount option `dirsync`): changes are
    /// sent without the session header, so the server commits each durably before it
    /// answers. Off: answered at once, kept until durable and replayed after a server
    /// restart (docs/protocol.md, "Namespace changes before they are durable").
    pub dirsync: bool,
    /// Creates in a directory this node made answered at once, under the directory's create
    /// delegation, and sent behind the answer (mount option `async_creates=on|off`; docs/
    /// protocol.md "Creates answered by the agent"). Not with `dirsync`.
    pub async_creates: bool,
    /// Accept a server whose epoch is lower than the highest this agent has seen (a store
    /// restored from an older copy, deliberately). Off: such a server is refused (see
    /// [`Client::status`], `epoch_refused`) and calls fail with EIO until the right server is
    /// back. Mount option `accept_epoch_regression`.
    pub accept_epoch_regression: bool,
    /// How long calls wait for an unreachable or restarting server (`hard`: as long as it
    /// takes; `soft`: then EIO).
    pub retry: RetryPolicy,
    /// Refuse to connect when none of the volume's LUNs is found on this node (every byte
    /// would go through the server). Off in the library (the CSI driver does no data I/O);
    /// `sanfs-agent mount` turns it on unless `-o allow_proxied_only`.
    pub require_luns: bool,
    /// How often the volume is read again and LUNs missing on this node are looked for
    /// (`rescan`); also at once when a grant names a LUN this agent does not know (the volume
    /// grew). Zero: only then.
    pub rescan_interval: Duration,
    pub faults: FaultInjection,
}

/// Default [`ClientConfig::rescan_interval`]: 30 s.
pub const DEFAULT_RESCAN_INTERVAL: Duration = Duration::from_secs(30);

/// Device slots the I/O engine keeps beyond the volume's LUNs at connect, for LUNs a growth
/// adds; LUNs past them go proxied on this node until it connects again.
pub const SPARE_DEVICE_SLOTS: usize = 32;

/// Default [`ClientConfig::write_layout_bytes`]: 8 MiB.
pub const DEFAULT_WRITE_LAYOUT_BYTES: u64 = 8 << 20;

/// Default [`ClientConfig::read_layout_bytes`]: 8 MiB.
pub const DEFAULT_READ_LAYOUT_BYTES: u64 = 8 << 20;

impl ClientConfig {
    /// Defaults for everything but the server address and the LUN globs.
    pub fn new(server: impl Into<String>, globs: Vec<String>) -> ClientConfig {
        ClientConfig {
            server: server.into(),
            tls: None,
            discovery: DiscoveryConfig { globs },
            engine: EngineConfig::default(),
            client_name: "sanfs-agent".to_owned(),
            max_cached_grants: 256,
            device_retry: Duration::from_secs(5),
            direct_io_threshold: None,
            grant_per_stripe_unit: false,
            read_layout_bytes: DEFAULT_READ_LAYOUT_BYTES,
            write_layout_bytes: DEFAULT_WRITE_LAYOUT_BYTES,
            writeback: WriteBackConfig::default(),
            dirsync: false,
            async_creates: true,
            accept_epoch_regression: false,
            retry: RetryPolicy::Hard,
            require_luns: false,
            rescan_interval: DEFAULT_RESCAN_INTERVAL,
            faults: FaultInjection::default(),
        }
    }
}

/// An open file: the handle the server gave, and the session it belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FileHandle {
    pub session: SessionId,
    pub handle: OpenHandle,
}

/// Counters of what the client did (for tests and metrics).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ClientStats {
    /// Batches of device I/O submitted to the engine.
    pub device_submits: u64,
    /// Grants asked for (MapRead + MapWrite).
    pub map_reads: u64,
    pub map_writes: u64,
    /// Reads served from a cached read grant without asking the server.
    pub cached_reads: u64,
    /// Writes done inside a cached write layout (no MapWrite).
    pub layout_writes: u64,
    /// Write layouts asked for ahead of a sequential writer (`Inner::layout_ahead`).
    pub layouts_ahead: u64,
    /// `Complete` calls sent (a batch of write-behind completions is one).
    pub completions: u64,
    /// Proxied Read / Write calls.
    pub proxied_reads: u64,
    pub proxied_writes: u64,
    /// Sessions opened (1 after connect).
    pub sessions: u64,
    /// Recalls answered.
    pub recalls: u64,
    /// Times the lease lapsed or the session was lost.
    pub fences: u64,
    /// Bytes moved on the direct path (to or from this node's LUNs, holes included), and
    /// through the server, by operation.
    pub direct_read_bytes: u64,
    pub direct_write_bytes: u64,
    pub proxied_read_bytes: u64,
    pub proxied_write_bytes: u64,
    /// Poisoned LUNs brought back by the health task.
    pub device_recoveries: u64,
    /// Advisory locks that could not be reclaimed after a new session.
    pub locks_lost: u64,
    /// Lazily committed write completions kept until the server makes them durable (now).
    pub unsynced_writes: u64,
    /// Files whose replay after a server restart was refused and not reported yet (now).
    pub writes_lost: u64,
    /// Namespace changes answered before they were durable, kept until they are (now).
    pub unsynced_changes: u64,
    /// Namespace changes sent again to a restarted server, and those it refused (lost).
    pub changes_replayed: u64,
    pub changes_lost: u64,
    /// Opens for reading answered by the agent (`OpenFile::deferred`), and those of them
    /// made at the server later (a read the kernel's pages did not answer, a recall, ...).
    pub opens_here: u64,
    pub opens_made_later: u64,
}

#[derive(Default)]
struct Counters {
    device_submits: AtomicU64,
    map_reads: AtomicU64,
    map_writes: AtomicU64,
    cached_reads: AtomicU64,
    layout_writes: AtomicU64,
    layouts_ahead: AtomicU64,
    completions: AtomicU64,
    proxied_reads: AtomicU64,
    proxied_writes: AtomicU64,
    sessions: AtomicU64,
    recalls: AtomicU64,
    fences: AtomicU64,
    direct_read_bytes: AtomicU64,
    direct_write_bytes: AtomicU64,
    proxied_read_bytes: AtomicU64,
    proxied_write_bytes: AtomicU64,
    device_recoveries: AtomicU64,
    locks_lost: AtomicU64,
    changes_replayed: AtomicU64,
    changes_lost: AtomicU64,
    opens_here: AtomicU64,
    opens_made_later: AtomicU64,
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

fn add(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

/// The current session as the data path sees it.
#[derive(Debug, Clone)]
pub(crate) struct SessionView {
    pub(crate) session: SessionId,
    pub(crate) epoch: SessionEpoch,
    /// Bumped for every new session; cached grants and in-flight calls carry it.
    pub(crate) generation: u64,
    pub(crate) server: ServerInfo,
}

struct LeaseState {
    view: SessionView,
    lease_ttl_ms: u64,
    /// The lease holds until then (agent rule).
    deadline: Instant,
    /// False once fenced, until a new session is open.
    live: bool,
    /// The highest server epoch this agent has seen (since it started: nothing is kept on
    /// disk). Epochs only go forward: a server with a lower one runs on a store restored from
    /// an older copy.
    highest_epoch: u64,
    /// The metadata store's restore count under which this agent mounted (ServerInfo.restores):
    /// a server reporting another one serves a namespace put back from a backup.
    restores: u64,
    /// Why the last server reached was refused (its epoch went backwards, its store was
    /// restored under this mount, or it serves another file system); `None` otherwise.
    epoch_refused: Option<String>,
}

pub(crate) struct Inner {
    config: ClientConfig,
    channel: Channel,
    /// The volume as last read (`GetVolume`); replaced whole when it grows (`rescan`).
    volume: std::sync::RwLock<Arc<Volume>>,
    fs_uuid: uuid::Uuid,
    /// One slot per device index (those of the volume at connect, and spare ones): whether
    /// this node has the LUN is [`Engine::has_device`].
    engine: Engine,
    /// Wakes the rescan task (a grant named a LUN this agent does not know).
    rescan_kick: Notify,
    /// One rescan at a time.
    rescanning: tokio::sync::Mutex<()>,
    /// Per device slot: the path this node opened it by (`None`: missing here).
    device_paths: Mutex<Vec<Option<PathBuf>>>,
    /// Per device index: the health task's view of a poisoned LUN.
    health: Mutex<Vec<health::Probe>>,
    /// Wakes the health task (a device write failed).
    health_kick: Notify,
    state: Mutex<LeaseState>,
    /// Signals a new session (its generation).
    generation_tx: watch::Sender<u64>,
    /// The session whose stream is attached now (`None` between attachments): recalls reach
    /// this agent, so the server gives it delegations.
    attached_tx: watch::Sender<Option<SessionId>>,
    cache: Arc<GrantCache>,
    /// This agent's open handles and their inodes: the server drops a session's grants on
    /// an inode (without a recall) when the session closes its last handle there, so the
    /// cached read grants of that inode must leave the cache before that release.
    open_handles: Mutex<HashMap<(SessionId, OpenHandle), InodeId>>,
    /// The open files to open again in a reclaim window ([`Client::track_open_file`]).
    pub(crate) open_files: Mutex<Vec<std::sync::Weak<file::OpenFile>>>,
    counters: Counters,
    /// Device I/O batches in flight, and a wake-up when one ends.
    device_in_flight: AtomicU64,
    device_idle: Notify,
    /// Sessions a call found stale (`StaleSession`): the session task replaces them.
    lost_tx: mpsc::UnboundedSender<SessionId>,
    /// Test hook: while set, the session task sends no heartbeats and opens no session.
    heartbeats_paused: AtomicBool,
    /// Test hook: while set, completions wait before they are sent (a node whose I/O hangs
    /// after the devices took it: its grants stay out).
    completions_paused: AtomicBool,
    /// The advisory locks this agent's owners hold (reclaimed after a new session).
    locks_held: locks::LockMirror,
    /// Where each file's last direct write ended (sequential writers get write layouts).
    write_ends: Mutex<HashMap<InodeId, u64>>,
    /// The files whose next write layout is being asked for ahead of their writer
    /// (`Inner::layout_ahead`): the range asked for, and `true` once the answer is in.
    layouts_ahead: Mutex<HashMap<InodeId, (sanfs_proto::types::ByteRange, watch::Receiver<bool>)>>,
    /// Per file: write completions in flight behind their writes, and the first error of one
    /// that failed (reported by the file's next write, fsync or close).
    behind: Mutex<HashMap<InodeId, Behind>>,
    /// Wakes those waiting for a file's completions in flight.
    behind_idle: Notify,
    /// Write-behind completions queued per write layout, one round trip per batch.
    completion_batches: Mutex<data::batch::Batcher>,
    /// Whether calls are waiting for the server (see `rpc`).
    outage: rpc::Outage,
    /// Reply-cache ids of non-idempotent calls (see `rpc`).
    requests: rpc::RequestIds,
    /// Lazily committed write completions not durable yet, and files whose writes were lost.
    unsynced: Mutex<unsynced::Unsynced>,
    /// Creates answered here before the server answered them ([`creates`]).
    pub(crate) creates: creates::AsyncCreates,
    /// Writes held back under write delegations (see `writeback`).
    writeback: writeback::WriteBack,
    /// Attributes and names cached under leases (see `leases`).
    leases: leases::LeaseCache,
    /// Handles closed here, to release with a later call (see `releases`).
    releases: Mutex<releases::Releases>,
}

/// A connected agent. Dropping it stops its session task (the session then expires at the
/// server); [`Client::close`] ends it cleanly.
pub struct Client {
    inner: Arc<Inner>,
    task: Option<JoinHandle<()>>,
    health_task: Option<JoinHandle<()>>,
    /// Writes back held-back bytes that are old or of an earlier session.
    writeback_task: Option<JoinHandle<()>>,
    /// Reads the volume again and looks for missing LUNs (see `rescan`).
    rescan_task: Option<JoinHandle<()>>,
}

/// Why connecting failed.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("bad server address {0:?}: {1}")]
    Address(String, String),
    #[error("TLS setup: {0}")]
    Tls(String),
    #[error("cannot reach the server: {0}")]
    Transport(String),
    #[error("server refused: {0}")]
    Server(#[from] FsError),
    #[error("cannot start the I/O engine: {0}")]
    Engine(std::io::Error),
    #[error(
        "none of the volume's {count} LUNs was found under devices={globs}: every byte would go \
         through the server; check the globs and that this node sees the LUNs, or mount with \
         -o allow_proxied_only to accept that"
    )]
    NoLuns { count: usize, globs: String },
    /// The import rule refuses the volume's LVM2 logical volume (exported VG, read-only LV,
    /// the LV on a `MISSING` PV), in the words of the server's `format`.
    #[error("{0}")]
    LvmRefused(String),
}

/// The import rule's checks of the volume's LVM2 logical volume `vg/lv` on the PVs this node
/// found (`paths`), the same as the server's at start: a refusal refuses the mount, warnings
/// are logged; where nothing can be checked here (no PV found) the mount goes on proxied.
fn check_lvm_at_mount(paths: &[PathBuf], vg: &str, lv: &str) -> Result<(), ConnectError> {
    match sanfs_lun::lvm::check_lv_at(paths, vg, lv) {
        Err(why) => {
            tracing::warn!("logical volume {vg}/{lv}: the LVM2 state was not checked: {why}");
            Ok(())
        }
        Ok(verdict) => sanfs_lun::lvm::enforce(vg, lv, &verdict, "refusing to mount")
            .map_err(ConnectError::LvmRefused),
    }
}

fn malformed(what: &str, e: impl std::fmt::Display) -> FsError {
    FsError::Io(format!("malformed {what} from the server: {e}"))
}

async fn make_channel(config: &ClientConfig) -> Result<Channel, ConnectError> {
    connect_channel(&config.server, config.tls.as_ref()).await
}

/// A gRPC channel to the server at `server` (`host:port`, or `unix:/path` for its local unix
/// socket), over mutual TLS when `tls` is given: how the agent connects, and `sanfs-admin`.
/// With several addresses (`a:7410,b:7410`, see [`parse_servers`]) the channel connects, and
/// reconnects, to whichever of them answers (`servers`).
pub async fn connect_channel(
    server: &str,
    tls: Option<&TlsConfig>,
) -> Result<Channel, ConnectError> {
    // `unix:/path`: the server's local unix socket (same host; the server knows this agent
    // by its uid). The URI is a placeholder that the connector ignores.
    if let Some(path) = server.strip_prefix("unix:") {
        if path.contains(',') {
            return Err(ConnectError::Address(
                server.to_owned(),
                "a unix: socket is a single server, never part of a list".to_owned(),
            ));
        }
        if tls.is_some() {
            return Err(ConnectError::Tls(
                "TLS options do not apply to a unix socket server".to_owned(),
            ));
        }
        let path = PathBuf::from(path);
        return Endpoint::from_static("http://[::1]:7410")
            .connect_timeout(Duration::from_secs(5))
            .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
                let path = path.clone();
                async move {
                    // Registered for reading only (sanfs_proto::local_socket).
                    let stream = sanfs_proto::local_socket::LocalStream::connect(path).await?;
                    Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(stream))
                }
            }))
            .await
            .map_err(|e| ConnectError::Transport(format!("{server}: {}", with_causes(&e))));
    }
    let mut addrs =
        parse_servers(server).map_err(|why| ConnectError::Address(server.to_owned(), why))?;
    if addrs.len() > 1 {
        return servers::connect_any(addrs, tls).await;
    }
    // One address: tonic's own connector and TLS, as always.
    let server = addrs.pop().map(|a| a.to_string()).unwrap_or_default();
    let server = server.as_str();
    let scheme = if tls.is_some() { "https" } else { "http" };
    let url = format!("{scheme}://{server}");
    let mut endpoint = Endpoint::from_shared(url)
        .map_err(|e| ConnectError::Address(server.to_owned(), e.to_string()))?
        .connect_timeout(Duration::from_secs(5))
        .tcp_nodelay(true);
    if let Some(tls) = tls {
        let read = |p: &PathBuf| {
            std::fs::read(p).map_err(|e| ConnectError::Tls(format!("{}: {e}", p.display())))
        };
        let mut t = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(read(&tls.ca)?))
            .identity(Identity::from_pem(read(&tls.cert)?, read(&tls.key)?));
        let domain = tls.domain.clone().or_else(|| {
            server
                .rsplit_once(':')
                .map(|(h, _)| h.trim_matches(['[', ']']).to_owned())
        });
        if let Some(d) = domain {
            t = t.domain_name(d);
        }
        endpoint = endpoint
            .tls_config(t)
            .map_err(|e| ConnectError::Tls(e.to_string()))?;
    }
    endpoint
        .connect()
        .await
        .map_err(|e| ConnectError::Transport(with_causes(&e)))
}

/// An error and its causes (`transport error: connection refused (os error 111)`): tonic's
/// own message alone hides why.
fn with_causes(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let s_text = s.to_string();
        if !text.ends_with(&s_text) {
            text.push_str(": ");
            text.push_str(&s_text);
        }
        source = s.source();
    }
    text
}

/// Opens a session; returns the reply and when the request was sent (the first lease starts
/// then).
async fn open_session(
    channel: &Channel,
    client_name: &str,
) -> Result<(OpenSessionReply, Instant), FsError> {
    let req = OpenSessionRequest {
        protocol_version: PROTOCOL_VERSION,
        client_name: client_name.to_owned(),
        host: hostname(),
        agent_version: env!("CARGO_PKG_VERSION").to_owned(),
    };
    let sent = Instant::now();
    let reply = SessionClient::new(channel.clone())
        .open_session(pb::OpenSessionRequest::from(req))
        .await
        .map_err(|s| fs_error_from_status(&s))?
        .into_inner();
    let reply = OpenSessionReply::try_from(reply).map_err(|e| malformed("OpenSession reply", e))?;
    Ok((reply, sent))
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().chars().take(255).collect())
        .unwrap_or_default()
}

impl Client {
    /// Connects: opens a session, reads the volume, finds the LUNs, starts the engine and
    /// the session task. Missing LUNs are not fatal (warned; their I/O goes proxied).
    pub async fn connect(config: ClientConfig) -> Result<Client, ConnectError> {
        let channel = make_channel(&config).await?;
        let (opened, sent) = open_session(&channel, &config.client_name).await?;
        let reply = AdminClient::new(channel.clone())
            .get_volume(pb::GetVolumeRequest {})
            .await
            .map_err(|s| ConnectError::Server(fs_error_from_status(&s)))?
            .into_inner();
        let info = VolumeInfo::try_from(reply)
            .map_err(|e| ConnectError::Server(malformed("GetVolume reply", e)))?;
        if info.fs_uuid != opened.server.fs_uuid {
            return Err(ConnectError::Server(FsError::Io(
                "GetVolume and OpenSession name different file systems".to_owned(),
            )));
        }
        let found = discover(&info.volume, &config.discovery);
        let device_count = info.volume.devices().len();
        if let sanfs_blockmap::volume::LayoutKind::Lvm { vg_name, lv_name } = info.volume.kind() {
            let paths: Vec<PathBuf> = found.found.iter().map(|d| d.path.clone()).collect();
            check_lvm_at_mount(&paths, vg_name, lv_name)?;
        }
        for (index, id) in &found.missing {
            tracing::warn!(device = %index, ?id, "LUN not found on this node: its I/O goes proxied");
        }
        if found.found.is_empty() && device_count > 0 {
            let globs = config.discovery.globs.join(":");
            if config.require_luns {
                return Err(ConnectError::NoLuns {
                    count: device_count,
                    globs,
                });
            }
            tracing::warn!(
                luns = device_count,
                globs,
                "none of the volume's LUNs was found on this node: every byte goes through the server"
            );
        }
        let slots = device_count.saturating_add(SPARE_DEVICE_SLOTS);
        let mut device_paths: Vec<Option<PathBuf>> = vec![None; slots];
        let mut files: Vec<Option<std::fs::File>> = (0..slots).map(|_| None).collect();
        for d in found.found {
            let i = d.index.as_usize();
            if i >= device_count {
                continue;
            }
            device_paths[i] = Some(d.path.clone());
            let file = if config.faults.read_only_devices.contains(&d.index) {
                sanfs_lun::open_buffered(&d.path, sanfs_lun::Access::Read)
                    .map_err(ConnectError::Engine)?
            } else {
                d.file
            };
            files[i] = Some(file);
        }
        let engine = Engine::new(&config.engine, files).map_err(ConnectError::Engine)?;
        let generation = 1;
        let (generation_tx, _) = watch::channel(generation);
        let (lost_tx, lost_rx) = mpsc::unbounded_channel();
        let state = LeaseState {
            view: SessionView {
                session: opened.session,
                epoch: opened.epoch,
                generation,
                server: opened.server.clone(),
            },
            lease_ttl_ms: opened.lease_ttl_ms,
            deadline: sent + Duration::from_millis(opened.lease_ttl_ms),
            live: true,
            highest_epoch: opened.epoch.0,
            restores: opened.server.restores,
            epoch_refused: None,
        };
        let max_cached = config.max_cached_grants;
        let writeback_config = config.writeback;
        let inner = Arc::new(Inner {
            config,
            channel,
            volume: std::sync::RwLock::new(Arc::new(info.volume)),
            fs_uuid: info.fs_uuid,
            engine,
            rescan_kick: Notify::new(),
            rescanning: tokio::sync::Mutex::new(()),
            device_paths: Mutex::new(device_paths),
            health: Mutex::new(vec![health::Probe::default(); slots]),
            health_kick: Notify::new(),
            state: Mutex::new(state),
            generation_tx,
            attached_tx: watch::channel(None).0,
            cache: Arc::new(GrantCache::new(max_cached)),
            counters: Counters::default(),
            device_in_flight: AtomicU64::new(0),
            device_idle: Notify::new(),
            lost_tx,
            heartbeats_paused: AtomicBool::new(false),
            completions_paused: AtomicBool::new(false),
            locks_held: locks::LockMirror::default(),
            write_ends: Mutex::new(HashMap::new()),
            layouts_ahead: Mutex::new(HashMap::new()),
            behind: Mutex::new(HashMap::new()),
            behind_idle: Notify::new(),
            completion_batches: Mutex::new(data::batch::Batcher::default()),
            outage: rpc::Outage::default(),
            requests: rpc::RequestIds::new(),
            unsynced: Mutex::new(unsynced::Unsynced::default()),
            creates: creates::AsyncCreates::default(),
            writeback: writeback::WriteBack::new(writeback_config),
            leases: leases::LeaseCache::default(),
            open_handles: Mutex::new(HashMap::new()),
            open_files: Mutex::new(Vec::new()),
            releases: Mutex::new(releases::Releases::default()),
        });
        bump(&inner.counters.sessions);
        tracing::info!(session = %opened.session, epoch = %opened.epoch, engine = inner.engine.name(), "session opened");
        let task = tokio::spawn(session::run(Arc::clone(&inner), lost_rx));
        let health_task = tokio::spawn(health::run(Arc::clone(&inner)));
        let writeback_task = tokio::spawn(writeback::run(Arc::clone(&inner)));
        let rescan_task = tokio::spawn(rescan::run(Arc::clone(&inner)));
        inner.stream_attached(opened.session).await;
        Ok(Client {
            inner,
            task: Some(task),
            health_task: Some(health_task),
            writeback_task: Some(writeback_task),
            rescan_task: Some(rescan_task),
        })
    }

    /// A handle on `inner` for work the agent's own tasks do through the public calls (a
    /// recall's write-back); it owns no task.
    pub(crate) fn borrowed(inner: Arc<Inner>) -> Client {
        Client {
            inner,
            task: None,
            health_task: None,
            writeback_task: None,
            rescan_task: None,
        }
    }

    /// The file system's UUID.
    pub fn fs_uuid(&self) -> uuid::Uuid {
        self.inner.fs_uuid
    }

    /// The volume this client plans I/O on, as last read from the server.
    pub fn volume(&self) -> Arc<Volume> {
        self.inner.volume()
    }

    /// Reads the volume again now (taking a grown one) and looks for the LUNs missing on
    /// this node; answers the device indexes opened by this pass. What the rescan task does
    /// every [`ClientConfig::rescan_interval`].
    pub async fn rescan(&self) -> Result<Vec<DeviceIndex>, FsError> {
        rescan::pass(&self.inner).await
    }

    /// What the server told this session (block size, thresholds, limits).
    pub fn server_info(&self) -> ServerInfo {
        self.inner.lock_state().view.server.clone()
    }

    /// The current session, and whether its lease is valid now.
    pub fn session(&self) -> (SessionId, bool) {
        let s = self.inner.lock_state();
        (s.view.session, s.live && Instant::now() < s.deadline)
    }

    /// Waits until a session other than `old` is open and its lease valid, at most `timeout`.
    pub async fn wait_for_new_session(
        &self,
        old: SessionId,
        timeout: Duration,
    ) -> Result<SessionId, FsError> {
        let mut rx = self.inner.generation_tx.subscribe();
        let wait = async {
            loop {
                let (s, valid) = self.session();
                if s != old && valid {
                    return s;
                }
                if rx.changed().await.is_err() {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        };
        tokio::time::timeout(timeout, wait)
            .await
            .map_err(|_| FsError::StaleSession)
    }

    /// Counters of what this client did so far.
    pub fn stats(&self) -> ClientStats {
        let c = &self.inner.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let (unsynced_writes, writes_lost, unsynced_changes) = {
            let u = self.inner.lock_unsynced();
            let (w, l) = u.counts();
            (w, l, u.change_count())
        };
        ClientStats {
            device_submits: get(&c.device_submits),
            map_reads: get(&c.map_reads),
            map_writes: get(&c.map_writes),
            cached_reads: get(&c.cached_reads),
            layout_writes: get(&c.layout_writes),
            layouts_ahead: get(&c.layouts_ahead),
            completions: get(&c.completions),
            proxied_reads: get(&c.proxied_reads),
            proxied_writes: get(&c.proxied_writes),
            sessions: get(&c.sessions),
            recalls: get(&c.recalls),
            fences: get(&c.fences),
            direct_read_bytes: get(&c.direct_read_bytes),
            direct_write_bytes: get(&c.direct_write_bytes),
            proxied_read_bytes: get(&c.proxied_read_bytes),
            proxied_write_bytes: get(&c.proxied_write_bytes),
            device_recoveries: get(&c.device_recoveries),
            locks_lost: get(&c.locks_lost),
            unsynced_writes,
            writes_lost,
            unsynced_changes,
            changes_replayed: get(&c.changes_replayed),
            changes_lost: get(&c.changes_lost),
            opens_here: get(&c.opens_here),
            opens_made_later: get(&c.opens_made_later),
        }
    }

    /// Test hook: stop (true) or resume (false) heartbeats and session re-establishment, so
    /// that a test can let the lease lapse.
    pub fn pause_heartbeats(&self, paused: bool) {
        self.inner.heartbeats_paused.store(paused, Ordering::SeqCst);
    }

    /// Test hook: hold (true) or let go (false) every completion (`Complete`) before it is
    /// sent, as a node whose I/O hangs would: its write grants stay out while its session
    /// stays alive, until the server evicts it.
    pub fn pause_completions(&self, paused: bool) {
        self.inner
            .completions_paused
            .store(paused, Ordering::SeqCst);
    }

    /// Returns the cached read grants and ends the session at the server.
    pub async fn close(mut self) -> Result<(), FsError> {
        for t in [self.writeback_task.take(), self.rescan_task.take()]
            .into_iter()
            .flatten()
        {
            t.abort();
            let _ = t.await;
        }
        if let Some(t) = self.health_task.take() {
            t.abort();
            let _ = t.await;
        }
        if let Some(t) = self.task.take() {
            t.abort();
            let _ = t.await;
        }
        self.end_session().await
    }

    /// Returns the cached grants and ends the session at the server, while other holders of
    /// this client may still run ([`Client::close`] when this is the last one): what they
    /// send afterwards fails as a call of an ended session. Without it the server keeps the
    /// session, its leases and grants until its lease runs out, and another node's change
    /// that must recall one of them waits that long.
    pub async fn end_session(&self) -> Result<(), FsError> {
        let view = self.inner.lock_state().view.clone();
        let cached = self.inner.cache.cached_ids();
        let busy = self.inner.cache.clear();
        self.inner.cache.wait_idle(&busy).await;
        if !cached.is_empty() {
            let _ = self.inner.return_grants(&view, cached).await;
        }
        SessionClient::new(self.inner.channel.clone())
            .close_session(pb::CloseSessionRequest::from(
                sanfs_proto::model::SessionRef {
                    session: view.session,
                    epoch: view.epoch,
                },
            ))
            .await
            .map_err(|s| fs_error_from_status(&s))?;
        Ok(())
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        for t in [
            self.task.take(),
            self.health_task.take(),
            self.writeback_task.take(),
            self.rescan_task.take(),
        ]
        .into_iter()
        .flatten()
        {
            t.abort();
        }
    }
}

/// A file's write completions in flight (see [`Inner::settle`]).
#[derive(Debug, Default)]
struct Behind {
    in_flight: u64,
    error: Option<FsError>,
}

impl Inner {
    fn lock_behind(&self) -> MutexGuard<'_, HashMap<InodeId, Behind>> {
        self.behind.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A write completion of `ino` goes on behind its write.
    pub(crate) fn begin_pending(&self, ino: InodeId) {
        self.lock_behind().entry(ino).or_default().in_flight += 1;
    }

    /// A write completion of `ino` was answered (`error`: it failed).
    pub(crate) fn end_pending(&self, ino: InodeId, error: Option<FsError>) {
        {
            let mut all = self.lock_behind();
            if let Some(b) = all.get_mut(&ino) {
                b.in_flight = b.in_flight.saturating_sub(1);
                if let Some(e) = error {
                    tracing::error!(inode = %ino, error = %e, "a write's completion failed: the file's next write, fsync or close reports it");
                    b.error.get_or_insert(e);
                }
                if b.in_flight == 0 && b.error.is_none() {
                    all.remove(&ino);
                }
            }
        }
        self.behind_idle.notify_waiters();
    }

    /// Whether write completions of `ino` are in flight: what the server says of its size
    /// and mtime may not show this agent's own writes yet.
    pub(crate) fn completing(&self, ino: InodeId) -> bool {
        self.lock_behind()
            .get(&ino)
            .is_some_and(|b| b.in_flight > 0)
    }

    /// Waits until no write completion of `ino` is in flight: what this agent reads, stats,
    /// truncates or syncs next sees its own writes completed.
    pub(crate) async fn settle(&self, ino: InodeId) {
        // Batched completions waiting for company go now.
        self.cache.hurry();
        loop {
            let idle = self.behind_idle.notified();
            tokio::pin!(idle);
            idle.as_mut().enable();
            if self
                .lock_behind()
                .get(&ino)
                .is_none_or(|b| b.in_flight == 0)
            {
                return;
            }
            idle.await;
        }
    }

    /// The error of a failed write completion of `ino`, once (then forgotten).
    /// A write lost in a server restart or with a fenced session (see `unsynced`) is such an
    /// error too.
    pub(crate) fn take_write_error(&self, ino: InodeId) -> Result<(), FsError> {
        {
            let mut all = self.lock_behind();
            if let Some(b) = all.get_mut(&ino) {
                let e = b.error.take();
                if b.in_flight == 0 {
                    all.remove(&ino);
                }
                if let Some(e) = e {
                    return Err(e);
                }
            }
        }
        self.take_lost_write(ino)
    }

    /// Whether `ino` has write completions in flight or a failed one to report, or writes
    /// not durable yet, or a lost one to report: what close(2) must wait for.
    pub(crate) fn has_behind(&self, ino: InodeId) -> bool {
        self.lock_behind().contains_key(&ino) || self.lock_unsynced().pending(ino)
    }

    pub(crate) fn lock_unsynced(&self) -> MutexGuard<'_, unsynced::Unsynced> {
        self.unsynced.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A lost write of `ino` (its replay after a server restart was refused), once.
    pub(crate) fn take_lost_write(&self, ino: InodeId) -> Result<(), FsError> {
        if self.lock_unsynced().take_lost(ino) {
            tracing::error!(inode = %ino, "reporting a write lost in a server restart (EIO)");
            return Err(FsError::Io(format!(
                "a write to inode {ino} was lost: its completion was refused (a fenced session, or a replay the restarted server refused)"
            )));
        }
        Ok(())
    }
}

impl Inner {
    fn lock_state(&self) -> MutexGuard<'_, LeaseState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// When the session's lease ends (agent rule), or now when it is not live.
    fn lease_deadline(&self) -> Instant {
        let s = self.lock_state();
        if s.live { s.deadline } else { Instant::now() }
    }

    fn lock_health(&self) -> MutexGuard<'_, Vec<health::Probe>> {
        self.health.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn lock_device_paths(&self) -> MutexGuard<'_, Vec<Option<PathBuf>>> {
        self.device_paths.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The volume as last read.
    pub(crate) fn volume(&self) -> Arc<Volume> {
        self.volume
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The session a call on `fh` runs under: ESTALE if `fh` is of another session, or the
    /// session is lost (lease lapsed, being replaced).
    pub(crate) fn view_for(&self, fh: Option<&FileHandle>) -> Result<SessionView, FsError> {
        let s = self.lock_state();
        if let Some(why) = &s.epoch_refused {
            return Err(FsError::Io(why.clone()));
        }
        if let Some(fh) = fh
            && fh.session != s.view.session
        {
            return Err(FsError::Stale);
        }
        if !s.live || Instant::now() >= s.deadline {
            return Err(FsError::StaleSession);
        }
        Ok(s.view.clone())
    }

    /// Epochs only go forward: admits a new session's server `epoch`, or refuses it (error
    /// log, [`Client::status`], calls fail with EIO) when it is lower than the highest seen,
    /// unless [`ClientConfig::accept_epoch_regression`] is set.
    ///
    /// A server whose store was restored from a backup since this agent mounted (its
    /// `restores` count differs) is refused the same way, whatever its epoch: this agent's
    /// open files, caches and held-back writes belong to the namespace before the restore.
    pub(crate) fn admit_epoch(&self, epoch: SessionEpoch, restores: u64) -> Result<(), String> {
        let mut s = self.lock_state();
        if restores != s.restores {
            if self.config.accept_epoch_regression {
                tracing::warn!(
                    restores,
                    before = s.restores,
                    "the server's metadata store was restored from a backup under this mount: \
                     accepted, as accept_epoch_regression asks"
                );
                s.restores = restores;
            } else {
                let why = format!(
                    "the server's metadata store was restored from a backup since this mount \
                     (restore count {restores}, mounted under {}): refused, since this mount's \
                     open files and caches belong to the namespace before it; unmount and mount \
                     again",
                    s.restores
                );
                s.epoch_refused = Some(why.clone());
                return Err(why);
            }
        }
        if epoch.0 < s.highest_epoch {
            if self.config.accept_epoch_regression {
                tracing::warn!(
                    epoch = epoch.0,
                    highest = s.highest_epoch,
                    "server epoch went backwards (a restored store): accepted, as \
                     accept_epoch_regression asks"
                );
            } else {
                let why = format!(
                    "metadata server epoch went backwards ({} after {}): its store was \
                     restored from an older copy; refused (no calls until the server with \
                     the newer store is back, or remount with accept_epoch_regression after a \
                     deliberate restore)",
                    epoch.0, s.highest_epoch
                );
                s.epoch_refused = Some(why.clone());
                return Err(why);
            }
        }
        s.highest_epoch = epoch.0;
        s.epoch_refused = None;
        Ok(())
    }

    /// A new session's server must serve this mount's file system: with several server
    /// addresses, whichever answers may be another file system's server (a configuration
    /// mistake). Refused like a server on an older store ([`Inner::admit_epoch`]: error log,
    /// [`Client::status`], calls fail with EIO) instead of writing into the other file system.
    pub(crate) fn admit_fs(&self, fs_uuid: uuid::Uuid) -> Result<(), String> {
        if fs_uuid == self.fs_uuid {
            return Ok(());
        }
        let why = format!(
            "the metadata server reached serves another file system ({fs_uuid}; this mount's \
             is {}): refused (no calls until a server of this file system answers)",
            self.fs_uuid
        );
        self.lock_state().epoch_refused = Some(why.clone());
        Err(why)
    }

    /// Whether the lease of session generation `generation` is valid at this instant.
    pub(crate) fn lease_valid(&self, generation: u64) -> bool {
        let s = self.lock_state();
        s.live && s.view.generation == generation && Instant::now() < s.deadline
    }

    /// The gate of every device I/O: checks the lease right before the submission and
    /// counts the batch in flight. The returned guard ends the count.
    pub(crate) fn begin_device_io(&self, generation: u64) -> Result<DeviceIoGuard<'_>, FsError> {
        // Count first, then check: the fence waits for the count after marking the session
        // lost, so either it sees this batch or this batch sees the lost session.
        self.device_in_flight.fetch_add(1, Ordering::SeqCst);
        let guard = DeviceIoGuard { inner: self };
        if !self.lease_valid(generation) {
            return Err(FsError::StaleSession);
        }
        bump(&self.counters.device_submits);
        Ok(guard)
    }

    /// Whether device `d` can take I/O from this node (found, and not poisoned by a failed
    /// write).
    pub(crate) fn device_usable(&self, d: DeviceIndex) -> bool {
        self.engine.has_device(d) && !self.engine.is_poisoned(d)
    }

    pub(crate) fn ns(&self) -> NamespaceClient<Channel> {
        NamespaceClient::new(self.channel.clone())
    }

    pub(crate) fn data(&self) -> DataClient<Channel> {
        DataClient::new(self.channel.clone())
            .max_decoding_message_size(MAX_MESSAGE_SIZE)
            .max_encoding_message_size(MAX_MESSAGE_SIZE)
    }
}

/// One device I/O batch in flight (see [`Inner::begin_device_io`]).
pub(crate) struct DeviceIoGuard<'a> {
    inner: &'a Inner,
}

impl Drop for DeviceIoGuard<'_> {
    fn drop(&mut self) {
        self.inner.device_in_flight.fetch_sub(1, Ordering::SeqCst);
        self.inner.device_idle.notify_waiters();
    }
}
