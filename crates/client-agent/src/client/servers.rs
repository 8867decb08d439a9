//! Several metadata server addresses (`mds1,mds2:7410`, `a:7410,b:7411`): the one parser of
//! such a list, and the connector that gives the agent one gRPC channel to whichever of them
//! answers.
//!
//! Only the leader among several `sanfs-mds` candidates listens (docs/protocol.md, "Finding
//! the leader"): a connect to a standby is refused at once. So the connector, on every
//! (re)connect of the channel, tries the addresses in turn, starting with the one that worked
//! last, each with a short connect timeout ([`CONNECT_TIMEOUT`]), and hands tonic the first
//! stream that connects (after its TLS handshake, when the mount uses TLS). Because tonic's
//! channel reconnects by itself through the connector, a takeover looks to everything above
//! (sessions, reclaim, retries) exactly like a server restart.
//!
//! With TLS the handshake is done here, per address: the agent's client certificate, ALPN
//! `h2`, and the server's certificate checked against the CA for `tls_domain=` if given,
//! else for that address's own host (a name or an IP address).
//!
//! A leader that dies without closing its connections (its host is gone) is noticed by HTTP/2
//! keepalive pings ([`KEEPALIVE_INTERVAL`], [`KEEPALIVE_TIMEOUT`]): the channel drops the
//! connection and reconnects through the connector. An address whose last connection never
//! got a byte from the server (a hung process whose port still accepts) is tried after the
//! others the next time, not first.

use std::fmt;
use std::io;
use std::net::Ipv6Addr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tonic::transport::{Channel, Endpoint};

use super::{ConnectError, TlsConfig, with_causes};

/// How long one address of a list may take to accept a TCP connection before the next is
/// tried (a standby refuses at once; this bounds a host that is down).
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);

/// How long one address's TLS handshake may take.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// How often the channel pings the server it is connected to (also while idle)...
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(2);

/// ...and how long it waits for the answer before it drops the connection and reconnects.
pub const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(3);

/// One metadata server address of a list: a host (a name, an IPv4 address, or an IPv6
/// address without its brackets) and a port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerAddr {
    pub host: String,
    pub port: u16,
}

impl fmt::Display for ServerAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

/// Parses a server list `HOST[:PORT],HOST[:PORT],...:PORT` (one entry: `HOST:PORT`). An entry
/// without a port takes the port of the next entry that has one (`mds1,mds2:7410`: both on
/// 7410), so the last needs one. IPv6 addresses go in brackets (`[fd00::1]:7410`). Errors (the
/// reason; the caller says what it parsed): an empty entry, a bad host or port, an address
/// given twice, a `unix:` socket (a unix socket names the one server on this host: never in a
/// list).
pub fn parse_servers(list: &str) -> Result<Vec<ServerAddr>, String> {
    let mut parsed: Vec<(String, Option<u16>)> = Vec::new();
    for entry in list.split(',') {
        parsed.push(parse_entry(entry)?);
    }
    let mut next_port = None;
    let mut out = Vec::with_capacity(parsed.len());
    for (host, port) in parsed.into_iter().rev() {
        let port = match port.or(next_port) {
            Some(p) => p,
            None => {
                return Err(format!(
                    "{host} has no port (HOST:PORT; in a list, an entry without a port takes \
                     the port of the next one that has one)"
                ));
            }
        };
        next_port = Some(port);
        out.push(ServerAddr { host, port });
    }
    out.reverse();
    for (i, a) in out.iter().enumerate() {
        if out[..i]
            .iter()
            .any(|b| b.port == a.port && b.host.eq_ignore_ascii_case(&a.host))
        {
            return Err(format!("the list names {a} twice"));
        }
    }
    Ok(out)
}

/// The list in its one string form (`a:7410,b:7410`): what [`parse_servers`] reads back.
pub fn join_servers(addrs: &[ServerAddr]) -> String {
    addrs
        .iter()
        .map(ServerAddr::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// One entry: its host and, if it has one, its port.
fn parse_entry(entry: &str) -> Result<(String, Option<u16>), String> {
    if entry.is_empty() {
        return Err("an empty entry (two commas, or one at an end)".to_owned());
    }
    if entry.starts_with("unix:") {
        return Err(format!(
            "{entry:?}: a unix: socket is a single server, never part of a list"
        ));
    }
    let (host, port) = if let Some(rest) = entry.strip_prefix('[') {
        let Some((inside, after)) = rest.split_once(']') else {
            return Err(format!("{entry:?}: no ] after an IPv6 address"));
        };
        if inside.parse::<Ipv6Addr>().is_err() {
            return Err(format!("{entry:?}: {inside:?} is not an IPv6 address"));
        }
        let port = match after {
            "" => None,
            p => Some(
                p.strip_prefix(':')
                    .ok_or_else(|| format!("{entry:?}: not [IPV6]:PORT"))?,
            ),
        };
        (inside, port)
    } else {
        match entry.split_once(':') {
            Some((_, p)) if p.contains(':') => {
                return Err(format!(
                    "{entry:?}: an IPv6 address goes in brackets ([fd00::1]:7410)"
                ));
            }
            Some((h, p)) => (h, Some(p)),
            None => (entry, None),
        }
    };
    if host.is_empty() {
        return Err(format!("{entry:?}: no host"));
    }
    if !entry.starts_with('[')
        && !host
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_'))
    {
        return Err(format!("{entry:?}: {host:?} is not a host name or address"));
    }
    let port = match port {
        None => None,
        Some(p) => match p.parse::<u16>() {
            Ok(n) if n > 0 => Some(n),
            _ => return Err(format!("{entry:?}: bad port {p:?} (1 to 65535)")),
        },
    };
    Ok((host.to_owned(), port))
}

/// A channel to whichever of `addrs` (two or more) answers, re-chosen on every reconnect (see
/// the module doc). Fails, listing each address and why, when none answers now.
pub(super) async fn connect_any(
    addrs: Vec<ServerAddr>,
    tls: Option<&TlsConfig>,
) -> Result<Channel, ConnectError> {
    let tls = match tls {
        Some(t) => Some(Arc::new(TlsSetup::load(t)?)),
        None => None,
    };
    let first = addrs
        .first()
        .ok_or_else(|| ConnectError::Address(String::new(), "no server address".to_owned()))?;
    // The URI only names the peer in requests (`:authority`); the connector picks the address.
    let url = format!("http://{first}");
    let endpoint = Endpoint::from_shared(url)
        .map_err(|e| ConnectError::Address(first.to_string(), e.to_string()))?
        .http2_keep_alive_interval(KEEPALIVE_INTERVAL)
        .keep_alive_timeout(KEEPALIVE_TIMEOUT)
        .keep_alive_while_idle(true);
    let failover = Failover::new(addrs, tls);
    endpoint
        .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
            let failover = failover.clone();
            async move { failover.connect().await.map(hyper_util::rt::TokioIo::new) }
        }))
        .await
        .map_err(|e| ConnectError::Transport(with_causes(&e)))
}

/// [`Failover::last`] before the first connection.
const NONE_YET: usize = usize::MAX;

/// The connector's state, shared by its clones (one per connect).
#[derive(Clone)]
struct Failover {
    addrs: Arc<[ServerAddr]>,
    tls: Option<Arc<TlsSetup>>,
    /// The index of the address connected to last.
    last: Arc<AtomicUsize>,
    /// Whether the server of the last connection has sent a byte on it.
    last_answered: Arc<std::sync::Mutex<Arc<AtomicBool>>>,
}

impl Failover {
    fn new(addrs: Vec<ServerAddr>, tls: Option<Arc<TlsSetup>>) -> Failover {
        Failover {
            addrs: addrs.into(),
            tls,
            last: Arc::new(AtomicUsize::new(NONE_YET)),
            last_answered: Arc::default(),
        }
    }

    /// The first address that connects, from the one connected to last on (from the one after
    /// it when that connection never got a byte from the server).
    async fn connect(&self) -> io::Result<Stream> {
        let n = self.addrs.len();
        let last = self.last.load(Ordering::Relaxed);
        let answered = self
            .last_answered
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .load(Ordering::Relaxed);
        let start = match last {
            l if l >= n => 0,
            l if answered => l,
            l => {
                tracing::debug!(
                    server = %self.addrs[l],
                    "the last connection got no answer: trying the other addresses first"
                );
                (l + 1) % n
            }
        };
        let mut failures = Vec::with_capacity(n);
        for k in 0..n {
            let i = (start + k) % n;
            let addr = &self.addrs[i];
            match self.connect_one(addr).await {
                Ok(stream) => {
                    *self.last_answered.lock().unwrap_or_else(|e| e.into_inner()) =
                        Arc::clone(&stream.answered);
                    let before = self.last.swap(i, Ordering::Relaxed);
                    if before == NONE_YET {
                        tracing::info!(server = %addr, "connected to the server at {addr}");
                    } else if before != i {
                        let was = self.addrs.get(before).map(ToString::to_string);
                        tracing::info!(
                            server = %addr,
                            "server at {addr} answers (was {})",
                            was.unwrap_or_default()
                        );
                    }
                    return Ok(stream);
                }
                Err(e) => {
                    tracing::debug!(server = %addr, error = %e, "server address does not answer");
                    failures.push(format!("{addr}: {e}"));
                }
            }
        }
        Err(io::Error::new(
            io::ErrorKind::ConnectionRefused,
            format!("no server of the list answers ({})", failures.join("; ")),
        ))
    }

    /// A TCP connection to `addr` (within [`CONNECT_TIMEOUT`]), over TLS when configured.
    async fn connect_one(&self, addr: &ServerAddr) -> io::Result<Stream> {
        let tcp = tokio::time::timeout(
            CONNECT_TIMEOUT,
            TcpStream::connect((addr.host.as_str(), addr.port)),
        )
        .await
        .map_err(|_| {
            io::Error::new(
                io::ErrorKind::TimedOut,
                format!("no connection within {} ms", CONNECT_TIMEOUT.as_millis()),
            )
        })??;
        tcp.set_nodelay(true)?;
        let Some(tls) = &self.tls else {
            return Ok(Stream::new(Io::Plain(tcp)));
        };
        let name = tls.domain.as_deref().unwrap_or(&addr.host).to_owned();
        let server_name = ServerName::try_from(name.clone()).map_err(|e| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{name:?} is not a TLS server name: {e}"),
            )
        })?;
        let handshake = tls.connector.connect(server_name, tcp);
        let stream = tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake)
            .await
            .map_err(|_| {
                io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("no TLS handshake within {} s", HANDSHAKE_TIMEOUT.as_secs()),
                )
            })?
            .map_err(|e| io::Error::new(e.kind(), format!("TLS (as {name}): {e}")))?;
        if stream.get_ref().1.alpn_protocol() != Some(b"h2") {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "TLS: the server did not agree to HTTP/2 (ALPN h2)",
            ));
        }
        Ok(Stream::new(Io::Tls(Box::new(stream))))
    }
}

/// The mount's TLS client side, read once: the CA, this agent's certificate and key.
struct TlsSetup {
    connector: TlsConnector,
    /// `tls_domain=`: the name every server's certificate is checked against instead of the
    /// address's host.
    domain: Option<String>,
}

impl TlsSetup {
    fn load(t: &TlsConfig) -> Result<TlsSetup, ConnectError> {
        let read = |p: &std::path::PathBuf| {
            std::fs::read(p).map_err(|e| ConnectError::Tls(format!("{}: {e}", p.display())))
        };
        let bad = |p: &std::path::PathBuf, e: &dyn fmt::Display| {
            ConnectError::Tls(format!("{}: {e}", p.display()))
        };
        let mut roots = rustls::RootCertStore::empty();
        for cert in CertificateDer::pem_slice_iter(&read(&t.ca)?) {
            let cert = cert.map_err(|e| bad(&t.ca, &e))?;
            roots.add(cert).map_err(|e| bad(&t.ca, &e))?;
        }
        if roots.is_empty() {
            return Err(bad(&t.ca, &"no certificate in it"));
        }
        let chain = CertificateDer::pem_slice_iter(&read(&t.cert)?)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| bad(&t.cert, &e))?;
        if chain.is_empty() {
            return Err(bad(&t.cert, &"no certificate in it"));
        }
        let key = PrivateKeyDer::from_pem_slice(&read(&t.key)?).map_err(|e| bad(&t.key, &e))?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| ConnectError::Tls(e.to_string()))?
            .with_root_certificates(roots)
            .with_client_auth_cert(chain, key)
            .map_err(|e| ConnectError::Tls(format!("{}: {e}", t.key.display())))?;
        config.alpn_protocols = vec![b"h2".to_vec()];
        Ok(TlsSetup {
            connector: TlsConnector::from(Arc::new(config)),
            domain: t.domain.clone(),
        })
    }
}

/// A connection to one server: plain TCP or TLS over it, and whether the server has sent a
/// byte on it.
struct Stream {
    io: Io,
    answered: Arc<AtomicBool>,
}

enum Io {
    Plain(TcpStream),
    Tls(Box<tokio_rustls::client::TlsStream<TcpStream>>),
}

impl Stream {
    fn new(io: Io) -> Stream {
        Stream {
            io,
            answered: Arc::default(),
        }
    }
}

impl AsyncRead for Stream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let polled = match &mut this.io {
            Io::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        };
        if matches!(polled, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            this.answered.store(true, Ordering::Relaxed);
        }
        polled
    }
}

impl AsyncWrite for Stream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match &mut self.get_mut().io {
            Io::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match &mut self.get_mut().io {
            Io::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match &self.io {
            Io::Plain(s) => s.is_write_vectored(),
            Io::Tls(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match &mut self.get_mut().io {
            Io::Plain(s) => Pin::new(s).poll_flush(cx),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match &mut self.get_mut().io {
            Io::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]

    use super::*;

    fn list(s: &str) -> String {
        join_servers(&parse_servers(s).unwrap())
    }

    fn err(s: &str) -> String {
        parse_servers(s).unwrap_err()
    }

    #[test]
    fn every_form_of_a_server_list() {
        assert_eq!(list("mds:7410"), "mds:7410");
        assert_eq!(list("10.0.0.1:7410"), "10.0.0.1:7410");
        assert_eq!(list("[::1]:7410"), "[::1]:7410");
        assert_eq!(list("mds1,mds2:7410"), "mds1:7410,mds2:7410");
        assert_eq!(list("a:7410,b:7411"), "a:7410,b:7411");
        assert_eq!(list("a,b:7410,c,d:7411"), "a:7410,b:7410,c:7411,d:7411");
        assert_eq!(
            list("[fd00::1],[fd00::2]:7410"),
            "[fd00::1]:7410,[fd00::2]:7410"
        );
        assert_eq!(
            list("mds-1.example.org,10.0.0.2:7410"),
            "mds-1.example.org:7410,10.0.0.2:7410"
        );
        let a = parse_servers("[fd00::1]:7410").unwrap();
        assert_eq!(
            a,
            [ServerAddr {
                host: "fd00::1".to_owned(),
                port: 7410
            }]
        );
        // The string form reads back the same.
        let back = list("a,b:1,[::1]:2");
        assert_eq!(list(&back), back);
    }

    #[test]
    fn every_rejection_of_a_server_list() {
        for (bad, says) in [
            ("", "empty entry"),
            ("a:7410,", "empty entry"),
            (",a:7410", "empty entry"),
            ("a,,b:7410", "empty entry"),
            ("mds", "has no port"),
            ("a:7410,b", "has no port"),
            ("a:port", "bad port"),
            ("a:0", "bad port"),
            ("a:70000", "bad port"),
            ("a:", "bad port"),
            (":7410", "no host"),
            ("a:7410,a:7410", "names a:7410 twice"),
            ("a,A:7410", "names A:7410 twice"),
            ("unix:/run/s.sock,a:7410", "unix: socket is a single server"),
            ("a:7410,unix:/run/s.sock", "unix: socket is a single server"),
            ("::1:7410", "IPv6 address goes in brackets"),
            ("[::1", "no ]"),
            ("[mds]:7410", "not an IPv6 address"),
            ("[::1]7410", "not [IPV6]:PORT"),
            ("a b:7410", "not a host name"),
            ("a/b:7410", "not a host name"),
        ] {
            let e = err(bad);
            assert!(e.contains(says), "{bad:?}: {e}");
        }
        // Two entries on the same host but other ports are two servers.
        assert_eq!(list("a:1,a:2"), "a:1,a:2");
    }

    fn addr(l: &tokio::net::TcpListener) -> ServerAddr {
        let a = l.local_addr().unwrap();
        ServerAddr {
            host: a.ip().to_string(),
            port: a.port(),
        }
    }

    /// The port of a listener that was closed: connects are refused.
    async fn dead_addr() -> ServerAddr {
        addr(&tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap())
    }

    async fn accepts(l: &tokio::net::TcpListener) -> Option<TcpStream> {
        tokio::time::timeout(Duration::from_secs(5), l.accept())
            .await
            .ok()
            .map(|r| r.unwrap().0)
    }

    #[tokio::test]
    async fn the_connector_tries_each_address_and_keeps_to_the_one_that_answers() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let good = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let dead = dead_addr().await;
        let f = Failover::new(vec![dead.clone(), addr(&silent), addr(&good)], None);
        // The dead address refuses; the silent one takes the connection (its port accepts).
        let first = f.connect().await.unwrap();
        let _held = accepts(&silent).await.unwrap();
        assert_eq!(f.last.load(Ordering::Relaxed), 1);
        drop(first);
        // It never answered: the next connect tries the others first, and the good one
        // answers.
        let mut second = f.connect().await.unwrap();
        let mut peer = accepts(&good).await.unwrap();
        assert_eq!(f.last.load(Ordering::Relaxed), 2);
        peer.write_all(b"x").await.unwrap();
        let mut byte = [0u8; 1];
        second.read_exact(&mut byte).await.unwrap();
        drop(second);
        // It answered: the next connect starts with it again.
        let _third = f.connect().await.unwrap();
        assert!(accepts(&good).await.is_some());
        assert_eq!(f.last.load(Ordering::Relaxed), 2);

        // None answers: the error names each address and why.
        let other_dead = dead_addr().await;
        let f = Failover::new(vec![dead.clone(), other_dead.clone()], None);
        let e = f.connect().await.err().unwrap().to_string();
        assert!(
            e.contains("no server of the list answers")
                && e.contains(&format!("{dead}: "))
                && e.contains(&format!("{other_dead}: ")),
            "{e}"
        );
    }
}
