//! `sanfs-mds serve`: opens the store, binds, and serves the five `sanfs.v1` services (with
//! mutual TLS when configured) until told to stop or until the store fails.
//!
//! Agents send credentials the server trusts, so only authenticated agents may talk to it
//! (docs/security.md): over TCP with mutual TLS, or over the local unix socket
//! (`listen_unix`, SO_PEERCRED); plaintext TCP only when the operator says `insecure`, which
//! is logged loudly. Every service sits behind the [`Authenticator`], which names the caller
//! of each request from its connection.
//! A poisoned store (a failed commit or storage error) stops the server with an error
//! (fail-stop); a restart re-reads the durable state.

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, bail};
use sanfs_proto::local_socket::LocalStream;
use sanfs_proto::model::{MAX_MESSAGE_SIZE, ServerEvent, SessionEndReason};
use sanfs_proto::pb::admin_server::AdminServer;
use sanfs_proto::pb::data_server::DataServer;
use sanfs_proto::pb::locks_server::LocksServer;
use sanfs_proto::pb::namespace_server::NamespaceServer;
use sanfs_proto::pb::session_server::SessionServer;
use tokio::net::{TcpListener, UnixListener};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::server::Router;
use tonic::transport::{Certificate, Identity, ServerTlsConfig};

use crate::activity::Charged;
use crate::clock::Clock;
use crate::datadev::DataDevices;
use crate::ha::gate::FenceGate;
use crate::service::admin::AdminService;
use crate::service::data::DataService;
use crate::service::identity::{AccessConfig, Authenticator};
use crate::service::locks::LocksService;
use crate::service::namespace::NamespaceService;
use crate::service::session::{SessionService, spawn_expiry};
use crate::service::{Server, ServiceParams};
use crate::store::{self, Store};

/// How long a graceful stop waits for requests in flight before it drops them.
const STOP_GRACE: Duration = Duration::from_secs(5);

/// What `serve` needs; the command line maps `mds.toml` onto it.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    /// Where the gRPC services listen (port 0: any free port, reported through `ready`).
    pub listen: SocketAddr,
    /// Where `GET /metrics` is answered (Prometheus text format); none: no metrics listener.
    pub metrics_addr: Option<SocketAddr>,
    /// Also listen on this unix socket (same-host agents, identified by SO_PEERCRED); made
    /// with mode 0600, a stale socket file at the path replaced.
    pub listen_unix: Option<PathBuf>,
    /// Accept plaintext TCP (unauthenticated, trusted with everything).
    pub insecure: bool,
    /// Who may connect and what each identity may do.
    pub access: AccessConfig,
    /// Mutual TLS: the server's certificate and key, and the CA that signs agents'
    /// certificates.
    pub tls: Option<TlsPaths>,
    /// I/O shorter than this many bytes goes the proxied path (told to agents).
    pub direct_threshold: u64,
    /// Lease length handed to agents, milliseconds.
    pub lease_ttl_ms: u64,
    /// How long a grant may block others before its session is evicted; `None`: two lease
    /// periods.
    pub grant_hold_limit_ms: Option<u64>,
    /// Most transactions in one group commit.
    pub batch_max: usize,
    /// How often journaled data is settled, milliseconds (`server.settle_ms`).
    pub settle_ms: u64,
    /// Where the metadata store lives.
    pub backend: store::Backend,
    /// Paths to try for the volume's LUNs (the proxied path): each is taken by the identity
    /// its label carries, never by its position. A glob in the last component is expanded
    /// at start; the paths growths added (kept in the store) are tried as well.
    pub data_devices: Vec<PathBuf>,
}

/// PEM files for mutual TLS.
#[derive(Debug, Clone)]
pub struct TlsPaths {
    /// The server's certificate chain.
    pub cert: PathBuf,
    /// The server's private key.
    pub key: PathBuf,
    /// The CA whose certificates agents must present.
    pub ca: PathBuf,
}

/// Refuses plaintext on an address other machines can reach, unless `insecure`.
pub fn check_plaintext(opts: &ServeOptions) -> anyhow::Result<()> {
    if opts.tls.is_none() && !opts.insecure && !opts.listen.ip().is_loopback() {
        bail!(
            "refusing to serve plaintext gRPC on {} (not a loopback address): configure TLS \
             (cert, key and client CA) or set insecure = true to accept unauthenticated agents",
            opts.listen
        );
    }
    Ok(())
}

/// Reads the TLS files into tonic's mutual-TLS configuration.
pub fn load_tls(paths: &TlsPaths) -> anyhow::Result<ServerTlsConfig> {
    let read = |p: &PathBuf, what: &str| {
        std::fs::read(p).with_context(|| format!("read the TLS {what} {}", p.display()))
    };
    let cert = read(&paths.cert, "certificate")?;
    let key = read(&paths.key, "key")?;
    let ca = read(&paths.ca, "client CA")?;
    Ok(ServerTlsConfig::new()
        .identity(Identity::from_pem(cert, key))
        .client_ca_root(Certificate::from_pem(ca)))
}

/// The import rule's checks of an imported LVM2 logical volume, on the PVs the server opened
/// (`paths`): an exported VG, a read-only LV or the LV on a `MISSING` PV refuse to serve (the
/// words of `format` and `volume inspect`); a damaged or stale metadata copy is a warning.
/// Where nothing can be checked (no PV open here) that is a warning: agents check at mount.
pub fn check_lvm_at_start(paths: &[PathBuf], vg: &str, lv: &str) -> anyhow::Result<()> {
    match sanfs_lun::lvm::check_lv_at(paths, vg, lv) {
        Err(why) => {
            tracing::warn!(
                "logical volume {vg}/{lv}: the LVM2 state was not checked at start: {why}"
            );
            Ok(())
        }
        Ok(verdict) => sanfs_lun::lvm::enforce(vg, lv, &verdict, "refusing to serve")
            .map_err(anyhow::Error::msg),
    }
}

/// Serves until `shutdown` resolves (a clean stop: `Ok`) or the store fails (`Err`).
/// `ready` is called with the bound address once the listener is bound.
pub async fn serve(
    opts: ServeOptions,
    clock: Clock,
    ready: impl FnOnce(SocketAddr),
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    check_plaintext(&opts)?;
    let tls = opts.tls.as_ref().map(load_tls).transpose()?;
    crate::metrics::install();

    // Opening reads and checks the store: blocking work, off the async threads.
    let (backend, batch_max) = (opts.backend.clone(), opts.batch_max);
    // The recovery that frees space waits for the reclaim window (`crate::reclaim`).
    let store = tokio::task::spawn_blocking(move || {
        Store::open_deferring_recovery(&backend, clock, batch_max)
    })
    .await
    .context("the store-opening task failed")?
    .with_context(|| format!("open the metadata store {:?}", opts.backend))?;
    let swept = store
        .write(crate::replies::sweep)
        .await
        .context("forget old entries of the reply cache")?;
    if swept > 0 {
        tracing::info!(entries = swept, "reply cache: old entries forgotten");
    }
    let params = ServiceParams {
        direct_threshold: opts.direct_threshold,
        lease_ttl_ms: opts.lease_ttl_ms,
        grant_hold_limit_ms: opts
            .grant_hold_limit_ms
            .unwrap_or(opts.lease_ttl_ms.saturating_mul(2)),
        max_sessions_per_identity: opts.access.max_sessions_per_identity,
        reclaim_grace_ms: crate::service::default_reclaim_grace_ms(opts.lease_ttl_ms),
        settle_ms: opts.settle_ms,
    };
    // `volume.devices` (globs expanded) and the LUNs growths added, by label identity.
    let data_paths = crate::config::device_paths(&opts.data_devices, &store.grown_device_paths());
    let volume = store.volume().clone();
    let devices = tokio::task::spawn_blocking(move || DataDevices::open(&volume, &data_paths))
        .await
        .context("the LUN-opening task failed")?;
    if let store::Backend::FencedDevice(_, fence) = &opts.backend {
        devices.set_fence(fence.clone());
    }
    if let Some((vg, lv)) = store.superblock().lvm.clone() {
        let paths = devices.opened_paths();
        tokio::task::spawn_blocking(move || check_lvm_at_start(&paths, &vg, &lv))
            .await
            .context("the LVM-checking task failed")??;
    }
    let server = Server::start(store, params, devices)
        .await
        .context("start a new server epoch")?;

    let listener = TcpListener::bind(opts.listen)
        .await
        .with_context(|| format!("bind {}", opts.listen))?;
    let addr = listener.local_addr().context("the bound address")?;
    let metrics_task = match opts.metrics_addr {
        Some(m) => {
            let l = TcpListener::bind(m)
                .await
                .with_context(|| format!("bind the metrics listener {m}"))?;
            tracing::info!(addr = %l.local_addr().unwrap_or(m), "metrics listening");
            Some(tokio::spawn(crate::metrics::serve_metrics(
                l,
                server.clone(),
            )))
        }
        None => None,
    };

    let access = std::sync::Arc::new(opts.access.clone());
    let unix = match &opts.listen_unix {
        Some(path) => Some((bind_unix(path)?, path.clone())),
        None => None,
    };
    let mut builder = tonic::transport::Server::builder();
    let tcp_tls = tls.is_some();
    if let Some(tls) = tls {
        builder = builder.tls_config(tls).context("configure mutual TLS")?;
    }
    // An HA leader answers nothing once its fence is lost (`ha::gate`).
    let fence = match &opts.backend {
        store::Backend::FencedDevice(_, f) => Some(f.clone()),
        _ => None,
    };
    let router = add_services(
        builder,
        &server,
        Authenticator::new(access.clone(), tcp_tls, opts.insecure),
        fence.clone(),
    );
    if opts.insecure && !tcp_tls {
        tracing::warn!(
            %addr,
            "INSECURE: server.insecure = true: plaintext TCP is accepted without authentication; \
             any process that reaches this address may act as any user, root included"
        );
    } else if !tcp_tls {
        tracing::warn!(
            %addr,
            "no [tls] and insecure is false: every call on the TCP listener is refused; agents \
             connect over the unix socket (server.listen_unix)"
        );
    }

    let expiry = spawn_expiry(server.clone());
    tracing::info!(
        %addr,
        unix = ?opts.listen_unix,
        tls = opts.tls.is_some(),
        epoch = server.epoch().0,
        "sanfs-mds serving"
    );
    ready(addr);

    let (fired_tx, fired_rx) = tokio::sync::oneshot::channel::<()>();
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stopping = server.clone();
    let signal = async move {
        tokio::select! {
            () = shutdown => {}
            () = stopping.store().wait_poisoned() => {}
        }
        // Session streams never end by themselves: end them so the graceful stop can finish.
        stopping.end_streams(ServerEvent::Ended {
            reason: SessionEndReason::Shutdown,
            message: "the server is shutting down".to_owned(),
        });
        let _ = stop_tx.send(true);
        let _ = fired_tx.send(());
    };
    // TCP_NODELAY on every accepted connection. tonic's builder sets it only for listeners
    // it binds itself; without it a reply whose last HTTP/2 frame (the trailers, a window
    // update) goes out in a write of its own waits, under Nagle's algorithm, for the ACK of
    // the previous segment, which the agent delays by up to 40 ms: every small proxied read
    // took ~48 ms on loopback (`sanfs-bench latency`).
    let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
    // Each connection watched, so that a refused TLS handshake is logged with its peer.
    let refusals = opts
        .tls
        .is_some()
        .then(|| std::sync::Arc::new(crate::handshake::RefusalLog::new(std::time::Instant::now())));
    let incoming = tokio_stream::StreamExt::map(incoming, move |conn| {
        conn.map(|io| crate::handshake::Watched::new(io, refusals.clone()))
    });
    let tcp_serving = router.serve_with_incoming_shutdown(incoming, signal);
    let unix_serving = async {
        let Some((listener, _)) = unix else {
            return Ok(());
        };
        let mut stop = stop_rx;
        let router = add_services(
            tonic::transport::Server::builder(),
            &server,
            Authenticator::new(access, false, false),
            fence,
        );
        router
            .serve_with_incoming_shutdown(
                // Registered for reading only: no wake-up each time an agent reads an answer
                // (sanfs_proto::local_socket).
                tokio_stream::StreamExt::map(
                    tokio_stream::wrappers::UnixListenerStream::new(listener),
                    |conn| conn.and_then(LocalStream::from_tokio),
                ),
                async move {
                    let _ = stop.wait_for(|s| *s).await;
                },
            )
            .await
    };
    // Either listener failing ends the serving (the other with it).
    let serving = async {
        tokio::try_join!(async { tcp_serving.await.context("serve gRPC") }, async {
            unix_serving.await.context("serve gRPC on the unix socket")
        },)
        .map(|_| ())
    };
    let served = tokio::select! {
        r = serving => r,
        () = async {
            let _ = fired_rx.await;
            tokio::time::sleep(STOP_GRACE).await;
        } => {
            tracing::warn!("requests still in flight after the stop grace: dropping them");
            Ok(())
        }
    };

    expiry.abort();
    if let Some(path) = &opts.listen_unix {
        let _ = std::fs::remove_file(path);
    }
    if let Some(t) = metrics_task {
        t.abort();
    }
    let poisoned = server.store().poisoned();
    if !poisoned {
        server.settle_data().await;
        server.unmark_locks_if_none().await;
    }
    server.store().close();
    served?;
    if poisoned {
        bail!("the metadata store failed (fail-stop): restart the server to recover");
    }
    tracing::info!("sanfs-mds stopped");
    Ok(())
}

/// Serves as one candidate of a high-availability pair (`crate::ha`): campaigns in etcd (a
/// standby until elected), then serves the store on the metadata LUN under the fence of its
/// leadership until `shutdown` (then resigns, so a standby takes over at once) or until the
/// leadership is lost (then starts this process over as a candidate: it does not return).
/// `on_standby` and `ready` report the two steps (systemd status, logs).
pub async fn serve_ha(
    mut opts: ServeOptions,
    ha: crate::ha::HaOptions,
    clock: Clock,
    on_standby: impl FnOnce(),
    ready: impl FnOnce(SocketAddr, u64),
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    let path = match &opts.backend {
        store::Backend::Device(p) => p.clone(),
        other => bail!(
            "[ha] needs the store on a metadata LUN (metadata.kind = \"block\"), not {other:?}"
        ),
    };
    check_plaintext(&opts)?;
    crate::metrics::install();
    tokio::pin!(shutdown);
    let leadership = tokio::select! {
        l = crate::ha::campaign(&ha, on_standby) => match l {
            Ok(l) => l,
            Err(crate::ha::CampaignError::LeaseLost) => {
                tracing::warn!("the etcd lease ran out while a standby: starting over");
                return Err(crate::ha::start_over());
            }
            Err(e) => return Err(e.into()),
        },
        () = &mut shutdown => {
            tracing::info!("stopped while a standby");
            return Ok(());
        }
    };
    let epoch = leadership.epoch();
    let won_at = leadership.won_at;
    opts.backend = store::Backend::FencedDevice(path, leadership.fence());
    let serving_ready = move |addr: SocketAddr| {
        metrics::gauge!(crate::ha::HA_LEADER).set(1.0);
        metrics::gauge!(crate::ha::HA_EPOCH).set(epoch as f64);
        let took = won_at.elapsed();
        metrics::gauge!(crate::ha::HA_TAKEOVER_SECONDS).set(took.as_secs_f64());
        tracing::info!(
            fencing_epoch = epoch,
            takeover_ms = took.as_millis() as u64,
            "leader: serving"
        );
        ready(addr, epoch);
    };
    let served = tokio::select! {
        r = serve(opts, clock, serving_ready, shutdown) => Some(r),
        () = leadership.lost() => None,
    };
    match served {
        Some(Ok(())) => {
            leadership.resign().await;
            Ok(())
        }
        Some(Err(e)) if !leadership.fence().is_lost() => {
            leadership.resign().await;
            Err(e)
        }
        Some(Err(e)) => {
            tracing::error!(error = %format!("{e:#}"), fencing_epoch = epoch, "leadership lost while serving: starting over as a standby");
            Err(crate::ha::start_over())
        }
        None => {
            tracing::error!(
                fencing_epoch = epoch,
                "leadership lost: starting over as a standby"
            );
            Err(crate::ha::start_over())
        }
    }
}

/// Refuses to serve, without `[ha]`, a metadata LUN that an HA leader has claimed: a server
/// outside the election would not be fenced.
pub fn refuse_claimed_device(backend: &store::Backend) -> anyhow::Result<()> {
    if let store::Backend::Device(path) = backend {
        let header = store::device::read_device_header(path)
            .with_context(|| format!("read the metadata device {}", path.display()))?;
        if header.epoch > 0 {
            bail!(
                "the metadata device {} is served by high-availability leaders (fencing epoch {}): \
                 configure [ha] in mds.toml like the other servers (docs/operations.md, \"High availability\")",
                path.display(),
                header.epoch
            );
        }
    }
    Ok(())
}

/// Binds the unix socket at `path` with mode 0600 (a stale socket left by a killed server is
/// replaced; any other file there is an error).
fn bind_unix(path: &std::path::Path) -> anyhow::Result<UnixListener> {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if !meta.file_type().is_socket() {
            bail!(
                "server.listen_unix {} exists and is not a socket",
                path.display()
            );
        }
        std::fs::remove_file(path)
            .with_context(|| format!("remove the stale socket {}", path.display()))?;
    }
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("create the socket directory {}", dir.display()))?;
    }
    let listener = UnixListener::bind(path)
        .with_context(|| format!("bind the unix socket {}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
        .with_context(|| format!("chmod 0600 {}", path.display()))?;
    Ok(listener)
}

/// The five services, each behind the authenticator, the fence of an HA leader
/// ([`FenceGate`]) and charged to the server's [`crate::activity::Activity`], on `builder`.
fn add_services(
    mut builder: tonic::transport::Server,
    server: &std::sync::Arc<Server>,
    auth: Authenticator,
    fence: Option<std::sync::Arc<crate::store::fence::Fence>>,
) -> Router {
    let g = Guards {
        server,
        auth: &auth,
        fence: &fence,
    };
    builder
        .add_service(
            g.wrap(
                SessionServer::new(SessionService::new(server.clone()))
                    .max_decoding_message_size(MAX_MESSAGE_SIZE)
                    .max_encoding_message_size(MAX_MESSAGE_SIZE),
            ),
        )
        .add_service(
            g.wrap(
                NamespaceServer::new(NamespaceService::new(server.clone()))
                    .max_decoding_message_size(MAX_MESSAGE_SIZE)
                    .max_encoding_message_size(MAX_MESSAGE_SIZE),
            ),
        )
        .add_service(
            g.wrap(
                DataServer::new(DataService::new(server.clone()))
                    .max_decoding_message_size(MAX_MESSAGE_SIZE)
                    .max_encoding_message_size(MAX_MESSAGE_SIZE),
            ),
        )
        .add_service(
            g.wrap(
                AdminServer::new(AdminService::new(server.clone()))
                    .max_decoding_message_size(MAX_MESSAGE_SIZE)
                    .max_encoding_message_size(MAX_MESSAGE_SIZE),
            ),
        )
        .add_service(g.wrap(LocksServer::new(LocksService::new(server.clone()))))
}

/// What every service is wrapped in (see [`add_services`]).
struct Guards<'a> {
    server: &'a std::sync::Arc<Server>,
    auth: &'a Authenticator,
    fence: &'a Option<std::sync::Arc<crate::store::fence::Fence>>,
}

impl Guards<'_> {
    fn wrap<S>(&self, svc: S) -> Charged<InterceptedService<FenceGate<S>, Authenticator>> {
        Charged::new(
            InterceptedService::new(FenceGate::new(svc, self.fence.clone()), self.auth.clone()),
            self.server.activity.clone(),
        )
    }
}

impl Server {
    /// Ends every attached session stream with `event` (the sessions themselves stay).
    pub(crate) fn end_streams(&self, event: ServerEvent) {
        let mut s = self.sessions();
        s.stopping = true;
        for state in s.by_id.values_mut() {
            if let Some((_, tx, _)) = state.stream.take() {
                let _ = tx.try_send(Ok(event.clone().into()));
            }
        }
    }
}
