//! Refused TLS handshakes, logged. tonic performs the TLS handshake itself and drops a
//! connection whose handshake fails with a DEBUG line only, and without the peer's address;
//! so every accepted TCP connection is wrapped in a [`Watched`] stream that knows its peer and
//! whether tonic began serving it (tonic asks a connection for its [`Connected::connect_info`]
//! only once the handshake has succeeded). A connection dropped before that (no client
//! certificate, one from another CA, a plaintext client, a port probe, a client gone
//! mid-handshake) is logged at WARN with the peer's address by a [`RefusalLog`]: at most
//! [`WARN_BURST`] lines per [`WARN_WINDOW`], the rest counted and reported in one line when
//! the next window starts, so a flood of bad handshakes cannot flood the log. Every refusal
//! also counts in the `sanfs_tls_handshakes_refused_total` metric.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tonic::transport::server::{Connected, TcpConnectInfo};

/// Most refusals logged one by one per [`WARN_WINDOW`].
pub const WARN_BURST: u32 = 10;
/// The rate-limiting window of refusal warnings.
pub const WARN_WINDOW: Duration = Duration::from_secs(60);

/// Logs refused handshakes, rate-limited (see the module's documentation).
#[derive(Debug)]
pub struct RefusalLog {
    window: Mutex<Window>,
}

#[derive(Debug)]
struct Window {
    start: Instant,
    logged: u32,
    suppressed: u64,
}

/// What [`RefusalLog::note`] did with one refusal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Noted {
    /// Logged on its own line; `earlier_suppressed` refusals of the window before were
    /// reported first.
    Logged { earlier_suppressed: u64 },
    /// Counted only (the window's burst is used up).
    Suppressed,
}

impl RefusalLog {
    pub fn new(now: Instant) -> RefusalLog {
        RefusalLog {
            window: Mutex::new(Window {
                start: now,
                logged: 0,
                suppressed: 0,
            }),
        }
    }

    /// Logs (or counts) one refused handshake from `peer` at `now`.
    pub fn note(&self, peer: Option<SocketAddr>, now: Instant) -> Noted {
        metrics::counter!("sanfs_tls_handshakes_refused_total").increment(1);
        let mut w = self.window.lock().unwrap_or_else(|p| p.into_inner());
        let mut earlier_suppressed = 0;
        if now.saturating_duration_since(w.start) >= WARN_WINDOW {
            earlier_suppressed = w.suppressed;
            if earlier_suppressed > 0 {
                tracing::warn!(
                    refused = earlier_suppressed,
                    window_s = WARN_WINDOW.as_secs(),
                    "more TLS handshakes were refused than were logged one by one"
                );
            }
            *w = Window {
                start: now,
                logged: 0,
                suppressed: 0,
            };
        }
        if w.logged >= WARN_BURST {
            w.suppressed += 1;
            return Noted::Suppressed;
        }
        w.logged += 1;
        match peer {
            Some(peer) => tracing::warn!(
                %peer,
                "TLS handshake refused: connection closed before any request (no client \
                 certificate or one this server's CA did not sign, plaintext, or a probe)"
            ),
            None => tracing::warn!(
                "TLS handshake refused: connection closed before any request (peer address \
                 unknown)"
            ),
        }
        Noted::Logged { earlier_suppressed }
    }
}

/// An accepted TCP connection that reports itself to `log` when dropped before tonic served
/// it ([`Connected::connect_info`] never called: its TLS handshake did not complete).
#[derive(Debug)]
pub struct Watched {
    io: TcpStream,
    peer: Option<SocketAddr>,
    served: AtomicBool,
    /// `None`: a plaintext listener, nothing to report.
    log: Option<Arc<RefusalLog>>,
}

impl Watched {
    pub fn new(io: TcpStream, log: Option<Arc<RefusalLog>>) -> Watched {
        Watched {
            peer: io.peer_addr().ok(),
            io,
            served: AtomicBool::new(false),
            log,
        }
    }
}

impl Drop for Watched {
    fn drop(&mut self) {
        if let Some(log) = &self.log
            && !self.served.load(Ordering::Relaxed)
        {
            log.note(self.peer, Instant::now());
        }
    }
}

impl Connected for Watched {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        self.served.store(true, Ordering::Relaxed);
        self.io.connect_info()
    }
}

impl AsyncRead for Watched {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl AsyncWrite for Watched {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_are_logged_in_bursts_and_the_rest_reported_per_window() {
        let t0 = Instant::now();
        let log = RefusalLog::new(t0);
        let peer: Option<SocketAddr> = "192.0.2.7:40000".parse().ok();
        for i in 0..WARN_BURST {
            let at = t0 + Duration::from_millis(u64::from(i));
            assert_eq!(
                log.note(peer, at),
                Noted::Logged {
                    earlier_suppressed: 0
                }
            );
        }
        for _ in 0..25 {
            assert_eq!(
                log.note(peer, t0 + Duration::from_secs(1)),
                Noted::Suppressed
            );
        }
        // The next window reports the 25 first, then logs again.
        let next = t0 + WARN_WINDOW;
        assert_eq!(
            log.note(None, next),
            Noted::Logged {
                earlier_suppressed: 25
            }
        );
        assert_eq!(
            log.note(peer, next),
            Noted::Logged {
                earlier_suppressed: 0
            }
        );
    }
}
