//! `sanfs-mds serve`: opens the store, binds, and serves the four `sanfs.v1` services (with
//! mutual TLS when configured) until told to stop or until the store fails.
//!
//! Plaintext is allowed on a loopback address only, unless the operator says `insecure`:
//! agents send credentials the server trusts, so only authenticated agents may talk to it.
//! A poisoned store (a failed commit or storage error) stops the server with an error
//! (fail-stop); a restart re-reads the durable state.

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, bail};
use sanfs_proto::model::{MAX_MESSAGE_SIZE, ServerEvent, SessionEndReason};
use sanfs_proto::pb::admin_server::AdminServer;
use sanfs_proto::pb::data_server::DataServer;
use sanfs_proto::pb::locks_server::LocksServer;
use sanfs_proto::pb::namespace_server::NamespaceServer;
use sanfs_proto::pb::session_server::SessionServer;
use tokio::net::TcpListener;
use tonic::transport::{Certificate, Identity, ServerTlsConfig};

use crate::clock::Clock;
use crate::datadev::DataDevices;
use crate::service::admin::AdminService;
use crate::service::data::DataService;
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
    /// Allow plaintext on a non-loopback address.
    pub insecure: bool,
    /// Mutual TLS: the server's certificate and key, and the CA that signs agents'
    /// certificates.
    pub tls: Option<TlsPaths>,
    /// I/O shorter than this many bytes goes the proxied path (told to agents).
    pub direct_threshold: u64,
    /// Lease length handed to agents, milliseconds.
    pub lease_ttl_ms: u64,
    /// Most transactions in one group commit.
    pub batch_max: usize,
    /// Where the metadata store lives.
    pub backend: store::Backend,
    /// Paths to try for the volume's LUNs (the proxied path): each is taken by the identity
    /// its label carries, never by its position.
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
    let params = ServiceParams {
        direct_threshold: opts.direct_threshold,
        lease_ttl_ms: opts.lease_ttl_ms,
        reclaim_grace_ms: crate::service::default_reclaim_grace_ms(opts.lease_ttl_ms),
    };
    let data_paths = opts.data_devices.clone();
    let volume = store.volume().clone();
    let devices = tokio::task::spawn_blocking(move || DataDevices::open(&volume, &data_paths))
        .await
        .context("the LUN-opening task failed")?;
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

    let mut builder = tonic::transport::Server::builder();
    if let Some(tls) = tls {
        builder = builder.tls_config(tls).context("configure mutual TLS")?;
    }
    let router = builder
        .add_service(
            SessionServer::new(SessionService::new(server.clone()))
                .max_decoding_message_size(MAX_MESSAGE_SIZE)
                .max_encoding_message_size(MAX_MESSAGE_SIZE),
        )
        .add_service(
            NamespaceServer::new(NamespaceService::new(server.clone()))
                .max_decoding_message_size(MAX_MESSAGE_SIZE)
                .max_encoding_message_size(MAX_MESSAGE_SIZE),
        )
        .add_service(
            DataServer::new(DataService::new(server.clone()))
                .max_decoding_message_size(MAX_MESSAGE_SIZE)
                .max_encoding_message_size(MAX_MESSAGE_SIZE),
        )
        .add_service(
            AdminServer::new(AdminService::new(server.clone()))
                .max_decoding_message_size(MAX_MESSAGE_SIZE)
                .max_encoding_message_size(MAX_MESSAGE_SIZE),
        )
        .add_service(LocksServer::new(LocksService::new(server.clone())));

    let expiry = spawn_expiry(server.clone());
    tracing::info!(
        %addr,
        tls = opts.tls.is_some(),
        epoch = server.epoch().0,
        "sanfs-mds serving"
    );
    ready(addr);

    let (fired_tx, fired_rx) = tokio::sync::oneshot::channel::<()>();
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
        let _ = fired_tx.send(());
    };
    // TCP_NODELAY on every accepted connection. tonic's builder sets it only for listeners
    // it binds itself; without it a reply whose last HTTP/2 frame (the trailers, a window
    // update) goes out in a write of its own waits, under Nagle's algorithm, for the ACK of
    // the previous segment, which the agent delays by up to 40 ms: every small proxied read
    // took ~48 ms on loopback (`sanfs-bench latency`).
    let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
    let serving = router.serve_with_incoming_shutdown(incoming, signal);
    let served = tokio::select! {
        r = serving => r.context("serve gRPC"),
        () = async {
            let _ = fired_rx.await;
            tokio::time::sleep(STOP_GRACE).await;
        } => {
            tracing::warn!("requests still in flight after the stop grace: dropping them");
            Ok(())
        }
    };

    expiry.abort();
    if let Some(t) = metrics_task {
        t.abort();
    }
    let poisoned = server.store().poisoned();
    if !poisoned {
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

impl Server {
    /// Ends every attached session stream with `event` (the sessions themselves stay).
    pub(crate) fn end_streams(&self, event: ServerEvent) {
        let mut s = self.sessions();
        for state in s.by_id.values_mut() {
            if let Some((_, tx, _)) = state.stream.take() {
                let _ = tx.try_send(Ok(event.clone().into()));
            }
        }
    }
}
