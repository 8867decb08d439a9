//! `sanfs-csi`: the sanfs CSI driver (see [`sanfs_client_agent::csi`]).
//!
//! ```text
//! sanfs-csi --endpoint unix:///csi/csi.sock --mode controller|node|both \
//!           --server MDS:PORT[,MDS:PORT...] --root /csi [--node-id NAME] [--devices GLOB,GLOB] \
//!           [--tls-ca CA --tls-cert CERT --tls-key KEY [--tls-domain NAME]] \
//!           [--metrics ADDR]
//! ```
//!
//! `--metrics ADDR` serves `GET /metrics` on ADDR: the driver's own metrics and every agent's
//! of this node, labelled by volume (`sanfs_client_agent::csi::metrics`); and `GET /healthz`,
//! `ok` while the process answers (a liveness probe that a server outage does not fail).
//!
//! Every flag can come from the environment instead (`CSI_ENDPOINT`, `SANFS_CSI_MODE`,
//! `SANFS_SERVER`, `SANFS_CSI_ROOT`, `SANFS_NODE_ID`, `SANFS_DEVICES`, `SANFS_TLS_CA`, ...), as
//! CSI drivers are configured in pod specs. Logs go to stderr (`RUST_LOG`, default `info`).
//! It stops on SIGTERM or SIGINT; volumes staged on the node stay mounted (their agents are
//! processes of their own).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::{Parser, ValueEnum};
use sanfs_client_agent::client::TlsConfig;
use sanfs_client_agent::csi::{Config, DEFAULT_DRIVER_NAME, Driver, Mode, serve};

#[derive(Debug, Clone, Copy, ValueEnum)]
enum ModeArg {
    Controller,
    Node,
    Both,
}

#[derive(Parser, Debug)]
#[command(name = "sanfs-csi", version, about = "sanfs CSI driver (CSI v1)")]
struct Cli {
    /// Where to serve CSI: `unix:///path/to/csi.sock` (or a plain path).
    #[arg(long, env = "CSI_ENDPOINT", default_value = "unix:///csi/csi.sock")]
    endpoint: String,
    /// Which services to serve: the Controller (one per cluster), the Node (one per node),
    /// or both (Identity always).
    #[arg(long, env = "SANFS_CSI_MODE", value_enum, default_value = "both")]
    mode: ModeArg,
    /// This node's id (NodeGetInfo); default: the host name.
    #[arg(long, env = "SANFS_NODE_ID")]
    node_id: Option<String>,
    /// The metadata server, `host:port`; or several (`mds1,mds2:7410`, `a:7410,b:7411`): the
    /// driver and its agents talk to whichever answers (the leader).
    #[arg(long, env = "SANFS_SERVER")]
    server: String,
    /// The directory of the file system that holds the volumes (made if missing).
    #[arg(long, env = "SANFS_CSI_ROOT", default_value = "/csi")]
    root: String,
    /// The driver's name (the CSIDriver object and StorageClass provisioner).
    #[arg(long, env = "SANFS_CSI_DRIVER_NAME", default_value = DEFAULT_DRIVER_NAME)]
    driver_name: String,
    /// LUN globs for the agents, comma- or colon-separated (default: the agent's own).
    #[arg(long, env = "SANFS_DEVICES", default_value = "")]
    devices: String,
    /// Mutual TLS towards the server: the CA, this node's certificate and key.
    #[arg(long, env = "SANFS_TLS_CA", requires_all = ["tls_cert", "tls_key"])]
    tls_ca: Option<PathBuf>,
    #[arg(long, env = "SANFS_TLS_CERT", requires_all = ["tls_ca", "tls_key"])]
    tls_cert: Option<PathBuf>,
    #[arg(long, env = "SANFS_TLS_KEY", requires_all = ["tls_ca", "tls_cert"])]
    tls_key: Option<PathBuf>,
    /// The name the server's certificate is checked against (default: the server's host).
    #[arg(long, env = "SANFS_TLS_DOMAIN")]
    tls_domain: Option<String>,
    /// The `sanfs-agent` executable (default: beside this one, else from PATH).
    #[arg(long, env = "SANFS_AGENT")]
    agent: Option<PathBuf>,
    /// More mount options for the agents, comma-separated (e.g. `attr_ttl=1s,engine=uring`).
    #[arg(long, env = "SANFS_AGENT_OPTIONS", default_value = "")]
    agent_options: String,
    /// Capacity of a volume whose request names none (e.g. `1GiB`).
    #[arg(long, env = "SANFS_CSI_DEFAULT_CAPACITY", default_value = "1GiB")]
    default_capacity: String,
    /// How long staging waits for the agent's mount, in seconds.
    #[arg(long, env = "SANFS_CSI_MOUNT_TIMEOUT", default_value_t = 60)]
    mount_timeout: u64,
    /// Serve `GET /metrics` on this address (e.g. `0.0.0.0:9810`): the driver's metrics and
    /// those of every agent on this node, labelled by volume.
    #[arg(long, env = "SANFS_CSI_METRICS")]
    metrics: Option<std::net::SocketAddr>,
}

/// `unix:///a/b.sock`, `unix:/a/b.sock` or `/a/b.sock`.
fn socket_path(endpoint: &str) -> anyhow::Result<PathBuf> {
    let path = endpoint
        .strip_prefix("unix://")
        .or_else(|| endpoint.strip_prefix("unix:"))
        .unwrap_or(endpoint);
    if !path.starts_with('/') {
        bail!("endpoint {endpoint:?} is not unix:///ABSOLUTE/PATH (only unix sockets are served)");
    }
    Ok(PathBuf::from(path))
}

/// `1073741824`, `64MiB`, `1G`, `10Gi`, `512k` (binary units, as every sanfs surface reads them).
fn parse_size(s: &str) -> anyhow::Result<u64> {
    sanfs_proto::units::parse_size(s).map_err(anyhow::Error::msg)
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_owned())
        .unwrap_or_default()
}

fn config(cli: Cli) -> anyhow::Result<(Config, PathBuf)> {
    let socket = socket_path(&cli.endpoint)?;
    if cli
        .agent_options
        .split(',')
        .any(|o| o.trim().starts_with("metrics="))
    {
        bail!(
            "metrics= in --agent-options would give every volume's agent the same port (the \
             second volume on a node would fail to mount): use --metrics, which serves every \
             agent's metrics, labelled by volume"
        );
    }
    let agent_path = match cli.agent {
        Some(p) => p,
        None => std::env::current_exe()
            .ok()
            .and_then(|e| e.parent().map(|d| d.join("sanfs-agent")))
            .filter(|p| p.exists())
            .unwrap_or_else(|| PathBuf::from("sanfs-agent")),
    };
    let tls = match (cli.tls_ca, cli.tls_cert, cli.tls_key) {
        (Some(ca), Some(cert), Some(key)) => Some(TlsConfig {
            ca,
            cert,
            key,
            domain: cli.tls_domain,
        }),
        _ => None,
    };
    let list = |s: &str| -> Vec<String> {
        s.split([',', ':'])
            .map(str::trim)
            .filter(|g| !g.is_empty())
            .map(str::to_owned)
            .collect()
    };
    let config = Config {
        driver_name: cli.driver_name,
        mode: match cli.mode {
            ModeArg::Controller => Mode::Controller,
            ModeArg::Node => Mode::Node,
            ModeArg::Both => Mode::Both,
        },
        node_id: cli.node_id.unwrap_or_else(hostname),
        server: server_list(&cli.server)?,
        tls,
        root: cli.root,
        devices: list(&cli.devices),
        agent_path,
        agent_options: cli
            .agent_options
            .split(',')
            .map(str::trim)
            .filter(|o| !o.is_empty())
            .map(str::to_owned)
            .collect(),
        default_capacity: parse_size(&cli.default_capacity)?,
        mount_timeout: Duration::from_secs(cli.mount_timeout.max(1)),
    };
    Ok((config, socket))
}

/// `--server`: one `host:port` or a list (`mds1,mds2:7410`), in its one string form (the
/// agents' mount sources are made from it); a bad list stops the driver at start.
fn server_list(server: &str) -> anyhow::Result<String> {
    if server.starts_with("unix:") {
        bail!("--server {server}: a TCP address (HOST:PORT), not a unix socket");
    }
    let servers = sanfs_client_agent::client::parse_servers(server)
        .map_err(|why| anyhow::anyhow!("--server {server}: {why}"))?;
    Ok(sanfs_client_agent::client::join_servers(&servers))
}

fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        // Colours only for a terminal: `kubectl logs` would show the codes.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    match run(Cli::parse()) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    let metrics = cli.metrics;
    let (config, socket) = config(cli)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("start the tokio runtime")?;
    runtime.block_on(async {
        let driver = Driver::new(config).map_err(|e| anyhow::anyhow!(e))?;
        driver.connect_in_background();
        if let Some(addr) = metrics {
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("bind the metrics listener {addr}"))?;
            tracing::info!(addr = ?listener.local_addr().ok(), "metrics listening");
            let d = driver.clone();
            tokio::spawn(sanfs_client_agent::metrics::serve_text(
                listener,
                std::sync::Arc::new(move || sanfs_client_agent::csi::metrics::render(&d)),
            ));
        }
        let shutdown = async {
            use tokio::signal::unix::{SignalKind, signal};
            match (
                signal(SignalKind::terminate()),
                signal(SignalKind::interrupt()),
            ) {
                (Ok(mut term), Ok(mut int)) => {
                    tokio::select! {
                        _ = term.recv() => {}
                        _ = int.recv() => {}
                    }
                }
                _ => std::future::pending::<()>().await,
            }
            tracing::info!("signalled: stopping (staged volumes stay mounted)");
        };
        serve(driver, socket, shutdown).await
    })?;
    runtime.shutdown_timeout(Duration::from_secs(2));
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]

    use super::*;

    #[test]
    fn endpoints_and_sizes_parse() {
        assert_eq!(
            socket_path("unix:///csi/csi.sock").unwrap(),
            PathBuf::from("/csi/csi.sock")
        );
        assert_eq!(
            socket_path("unix:/a.sock").unwrap(),
            PathBuf::from("/a.sock")
        );
        assert_eq!(socket_path("/b.sock").unwrap(), PathBuf::from("/b.sock"));
        assert!(socket_path("tcp://127.0.0.1:10000").is_err());
        assert!(socket_path("unix://relative.sock").is_err());
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("64MiB").unwrap(), 64 << 20);
        assert_eq!(parse_size("1G").unwrap(), 1 << 30);
        assert_eq!(parse_size("10Gi").unwrap(), 10 << 30);
        assert!(parse_size("1Q").is_err());
        assert!(parse_size("99999999999T").is_err());
    }

    #[test]
    fn flags_and_environment_make_a_config() {
        let cli = Cli::try_parse_from([
            "sanfs-csi",
            "--mode",
            "node",
            "--server",
            "10.0.0.1:7410",
            "--node-id",
            "n1",
            "--devices",
            "/dev/sd*,/dev/loop*",
            "--agent",
            "/usr/bin/sanfs-agent",
        ])
        .unwrap();
        let (c, socket) = config(cli).unwrap();
        assert_eq!(socket, PathBuf::from("/csi/csi.sock"));
        assert_eq!(c.mode, Mode::Node);
        assert_eq!(c.root, "/csi");
        assert_eq!(c.devices, ["/dev/sd*", "/dev/loop*"]);
        assert_eq!(c.default_capacity, 1 << 30);
        assert!(c.tls.is_none());
        assert!(
            Cli::try_parse_from(["sanfs-csi", "--server", "s:1", "--tls-ca", "/ca.pem"]).is_err(),
            "TLS files go together"
        );
    }

    #[test]
    fn several_servers_make_one_list() {
        let cfg = |server: &str| {
            config(Cli::try_parse_from(["sanfs-csi", "--server", server]).unwrap())
                .map(|(c, _)| c.server)
        };
        assert_eq!(cfg("10.0.0.1:7410").unwrap(), "10.0.0.1:7410");
        assert_eq!(
            cfg("mds1,mds2:7410").unwrap(),
            "mds1:7410,mds2:7410",
            "an entry without a port takes the next one's"
        );
        assert_eq!(cfg("a:7410,b:7411").unwrap(), "a:7410,b:7411");
        for (bad, says) in [
            ("a:7410,,b:7410", "empty entry"),
            ("a:7410,a:7410", "twice"),
            ("a:7410,b", "no port"),
            ("unix:/run/sanfs/mds.sock", "not a unix socket"),
        ] {
            let e = format!("{:#}", cfg(bad).unwrap_err());
            assert!(e.contains(says), "{bad}: {e}");
        }
    }
}
