//! A unix stream socket for gRPC between an agent and a server on the same host that wakes
//! its reactor only for what it waits for.
//!
//! A tokio `UnixStream` is registered with epoll for reading *and* writing, edge-triggered.
//! On a unix stream socket the kernel signals "writable" to the writer every time the peer
//! reads (`unix_write_space`, unlike TCP, which signals it only after the sender ran out of
//! room). So every request the server reads wakes the agent's reactor, and every answer the
//! agent reads wakes the server's, for nothing: one wake-up of a sleeping thread per message,
//! a context switch and, across CPUs, an interrupt (docs/performance.md "Stop 39": the
//! server's context switches per `unlink` went from 2.0-2.8 to 1.0-2.0 without them).
//!
//! [`LocalStream`] registers the socket for reading only and writes without asking: a
//! write that the socket's buffer takes (nearly every one: a unix socket buffers hundreds of
//! KiB) costs one system call and no registration. Only a write
//! that finds the buffer full registers a second descriptor of the same socket for
//! writability, waits on it, and drops it once a write gets through again.

use std::io::{self, IoSlice, Read, Write};
use std::os::unix::net::UnixStream as StdUnixStream;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncWrite, Interest, ReadBuf};
use tonic::transport::server::{Connected, UdsConnectInfo};

/// A connected unix stream socket, registered for reading only (see the module doc).
#[derive(Debug)]
pub struct LocalStream {
    read: AsyncFd<StdUnixStream>,
    /// A second descriptor of the socket, registered for writability while a write waits for
    /// room (`None` otherwise).
    write: Option<AsyncFd<StdUnixStream>>,
    /// The peer's address and credentials, read when the socket was taken over (what a
    /// server's handlers see of the caller: SO_PEERCRED).
    peer: UdsConnectInfo,
}

impl LocalStream {
    /// Takes over a connected tokio socket (inside a tokio runtime), with its peer's
    /// credentials.
    pub fn from_tokio(stream: tokio::net::UnixStream) -> io::Result<LocalStream> {
        let peer = stream.connect_info();
        let stream = stream.into_std()?;
        stream.set_nonblocking(true)?;
        Ok(LocalStream {
            read: register(stream, Interest::READABLE)?,
            write: None,
            peer,
        })
    }

    /// Connects to the socket at `path`.
    pub async fn connect(path: impl AsRef<std::path::Path>) -> io::Result<LocalStream> {
        LocalStream::from_tokio(tokio::net::UnixStream::connect(path).await?)
    }

    /// Runs `op` (a write) until it does not find the socket full; while it does, waits for
    /// room on the writability registration, made for that and dropped after.
    fn poll_write_with<T>(
        &mut self,
        cx: &mut Context<'_>,
        mut op: impl FnMut(&StdUnixStream) -> io::Result<T>,
    ) -> Poll<io::Result<T>> {
        loop {
            match op(self.read.get_ref()) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                r => {
                    self.write = None;
                    return Poll::Ready(r);
                }
            }
            if self.write.is_none() {
                let fd = self.read.get_ref().try_clone()?;
                self.write = Some(register(fd, Interest::WRITABLE)?);
            }
            let Some(write) = self.write.as_mut() else {
                continue;
            };
            // Readiness is edge-triggered: a write that fails after the last edge clears it,
            // so the next poll waits for the next edge rather than spinning.
            let mut guard = ready!(write.poll_write_ready(cx))?;
            let r = op(guard.get_inner());
            match r {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => guard.clear_ready(),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                r => {
                    drop(guard);
                    self.write = None;
                    return Poll::Ready(r);
                }
            }
        }
    }
}

/// Registers `socket` with the current runtime's reactor for `interest` only.
#[allow(
    unsafe_code,
    reason = "tokio's registration for one interest only is an unsafe fn (I/O safety)"
)]
fn register(socket: StdUnixStream, interest: Interest) -> io::Result<AsyncFd<StdUnixStream>> {
    // SAFETY: the `AsyncFd` owns the socket: its descriptor stays open, and is the one
    // `as_raw_fd` returns, until the `AsyncFd` is dropped (which deregisters it first).
    Ok(unsafe { AsyncFd::register_with_interest(socket, interest) }?)
}

impl Connected for LocalStream {
    type ConnectInfo = UdsConnectInfo;

    fn connect_info(&self) -> UdsConnectInfo {
        self.peer.clone()
    }
}

impl AsyncRead for LocalStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if buf.remaining() == 0 {
            return Poll::Ready(Ok(()));
        }
        loop {
            let mut guard = ready!(this.read.poll_read_ready(cx))?;
            let unfilled = buf.initialize_unfilled();
            match guard.try_io(|fd| {
                let mut s = fd.get_ref();
                s.read(unfilled)
            }) {
                Ok(Ok(n)) => {
                    buf.advance(n);
                    return Poll::Ready(Ok(()));
                }
                Ok(Err(e)) if e.kind() == io::ErrorKind::Interrupted => {}
                Ok(Err(e)) => return Poll::Ready(Err(e)),
                // Would block: the readiness was cleared; wait for the next edge.
                Err(_would_block) => {}
            }
        }
    }
}

impl AsyncWrite for LocalStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.get_mut().poll_write_with(cx, |mut s| s.write(buf))
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.get_mut()
            .poll_write_with(cx, |mut s| s.write_vectored(bufs))
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        // Nothing is buffered here.
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(self.read.get_ref().shutdown(std::net::Shutdown::Write))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn messages_cross_both_ways_and_a_full_socket_waits_for_room() {
        let (a, b) = tokio::net::UnixStream::pair().unwrap();
        let mut a = LocalStream::from_tokio(a).unwrap();
        let mut b = LocalStream::from_tokio(b).unwrap();
        a.write_all(b"ping").await.unwrap();
        let mut got = [0u8; 4];
        b.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"ping");

        // Far more than a socket buffer holds: the writer must wait for the reader, on the
        // writability registration, and every byte must arrive in order.
        let big: Vec<u8> = (0..8 << 20).map(|i: u32| (i % 251) as u8).collect();
        let sent = big.clone();
        let writer = tokio::spawn(async move {
            a.write_all(&sent).await.unwrap();
            a.shutdown().await.unwrap();
            a
        });
        let mut back = Vec::new();
        b.read_to_end(&mut back).await.unwrap();
        assert!(back == big, "the bytes arrived changed or out of order");
        let a = writer.await.unwrap();
        assert!(
            a.write.is_none(),
            "the writability registration outlived the wait"
        );
    }

    #[tokio::test]
    async fn a_closed_peer_reads_as_the_end_and_fails_writes() {
        let (a, b) = tokio::net::UnixStream::pair().unwrap();
        let mut a = LocalStream::from_tokio(a).unwrap();
        drop(b);
        let mut buf = [0u8; 8];
        assert_eq!(a.read(&mut buf).await.unwrap(), 0);
        assert!(a.write_all(&[1u8; 1 << 20]).await.is_err());
    }
}
