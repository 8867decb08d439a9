//! Where `sanfs-agent` logs: levelled `tracing` lines to stderr (in the foreground), to a file
//! (`-o log=FILE`), or to the local syslog socket `/dev/log` (`-o log=syslog`; journald reads
//! it where systemd runs), one datagram per line with the level as its syslog severity.
//!
//! A daemonised agent (a plain `mount`, `mount -t sanfs`, fstab) has no terminal: without
//! `log=` it logs to syslog when `/dev/log` is there, else to
//! `/var/log/sanfs/agent-<mount point>.log` ([`default_daemon_target`]).

use std::io::Write;
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use anyhow::Context;
use tracing_subscriber::fmt::MakeWriter;

use crate::mount_options::LogTarget;

/// The syslog socket.
pub const SYSLOG_SOCKET: &str = "/dev/log";
/// Where a daemonised agent logs when there is no syslog socket.
pub const DEFAULT_LOG_DIR: &str = "/var/log/sanfs";

/// The filter: `level` if given, else `RUST_LOG`, else `info`.
fn filter(level: Option<&str>) -> tracing_subscriber::EnvFilter {
    match level {
        Some(l) => tracing_subscriber::EnvFilter::new(l),
        None => tracing_subscriber::EnvFilter::try_from_default_env()
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
    }
}

/// Installs the process's log subscriber. Fails (nothing installed) when the file cannot be
/// opened or there is no syslog socket.
pub fn init(target: &LogTarget, level: Option<&str>) -> anyhow::Result<()> {
    let builder = tracing_subscriber::fmt().with_env_filter(filter(level));
    match target {
        // Colours only for a terminal: a journal or `kubectl logs` would show the codes.
        LogTarget::Stderr => builder
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .with_writer(std::io::stderr)
            .init(),
        LogTarget::File(path) => {
            let file = open_log_file(path)?;
            builder
                .with_ansi(false)
                .with_writer(Mutex::new(file))
                .init();
        }
        LogTarget::Syslog => {
            let sock = UnixDatagram::unbound().context("make a syslog socket")?;
            sock.connect(SYSLOG_SOCKET)
                .with_context(|| format!("connect to {SYSLOG_SOCKET}"))?;
            builder
                .with_ansi(false)
                .without_time()
                .with_writer(Syslog {
                    sock: Arc::new(sock),
                    ident: "sanfs-agent",
                })
                .init();
        }
    }
    Ok(())
}

/// Opens (appending, `0640`) a log file, making its directory.
pub fn open_log_file(path: &Path) -> anyhow::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("make the log directory {}", dir.display()))?;
    }
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o640)
        .open(path)
        .with_context(|| format!("open the log file {}", path.display()))
}

/// Where a daemonised agent of `mountpoint` logs without `log=`: syslog when its socket
/// exists, else a file named after the mount point in [`DEFAULT_LOG_DIR`].
pub fn default_daemon_target(mountpoint: &Path) -> LogTarget {
    let syslog = std::fs::metadata(SYSLOG_SOCKET).is_ok_and(|m| m.file_type().is_socket());
    if syslog {
        LogTarget::Syslog
    } else {
        LogTarget::File(default_log_file(mountpoint))
    }
}

/// `/var/log/sanfs/agent-mnt-sanfs.log` for `/mnt/sanfs` (the path's `/` become `-`).
pub fn default_log_file(mountpoint: &Path) -> PathBuf {
    let name: String = mountpoint
        .to_string_lossy()
        .trim_matches('/')
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '.' || c == '_' {
                c
            } else {
                '-'
            }
        })
        .collect();
    let name = if name.is_empty() {
        "root".to_owned()
    } else {
        name
    };
    Path::new(DEFAULT_LOG_DIR).join(format!("agent-{name}.log"))
}

/// A writer per log line that sends it to syslog, its severity from the event's level.
struct Syslog {
    sock: Arc<UnixDatagram>,
    ident: &'static str,
}

/// One syslog line being formatted; sent when dropped.
struct SyslogLine {
    sock: Arc<UnixDatagram>,
    pri: u8,
    ident: &'static str,
    buf: Vec<u8>,
}

impl Write for SyslogLine {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.buf.extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for SyslogLine {
    fn drop(&mut self) {
        let line = String::from_utf8_lossy(&self.buf);
        let line = line.trim_end();
        if line.is_empty() {
            return;
        }
        let msg = format!(
            "<{}>{}[{}]: {line}",
            self.pri,
            self.ident,
            std::process::id()
        );
        // A lost log line must not stop the agent.
        let _ = self.sock.send(msg.as_bytes());
    }
}

/// Facility daemon (3) times 8 plus the severity.
fn syslog_pri(level: &tracing::Level) -> u8 {
    let severity = match *level {
        tracing::Level::ERROR => 3,
        tracing::Level::WARN => 4,
        tracing::Level::INFO => 6,
        _ => 7,
    };
    3 * 8 + severity
}

impl<'a> MakeWriter<'a> for Syslog {
    type Writer = SyslogLine;
    fn make_writer(&'a self) -> SyslogLine {
        self.line(6 + 3 * 8)
    }
    fn make_writer_for(&'a self, meta: &tracing::Metadata<'_>) -> SyslogLine {
        self.line(syslog_pri(meta.level()))
    }
}

impl Syslog {
    fn line(&self, pri: u8) -> SyslogLine {
        SyslogLine {
            sock: Arc::clone(&self.sock),
            pri,
            ident: self.ident,
            buf: Vec::with_capacity(256),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]

    use super::*;

    #[test]
    fn default_file_is_named_after_the_mount_point() {
        assert_eq!(
            default_log_file(Path::new("/mnt/sanfs")),
            Path::new("/var/log/sanfs/agent-mnt-sanfs.log")
        );
        assert_eq!(
            default_log_file(Path::new("/")),
            Path::new("/var/log/sanfs/agent-root.log")
        );
    }

    #[test]
    fn syslog_lines_carry_the_level() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("log.sock");
        let server = UnixDatagram::bind(&path).unwrap();
        let sock = UnixDatagram::unbound().unwrap();
        sock.connect(&path).unwrap();
        let s = Syslog {
            sock: Arc::new(sock),
            ident: "sanfs-agent",
        };
        let mut w = s.line(syslog_pri(&tracing::Level::WARN));
        w.write_all(b"WARN lun missing\n").unwrap();
        drop(w);
        let mut buf = [0u8; 256];
        let n = server.recv(&mut buf).unwrap();
        let got = String::from_utf8_lossy(&buf[..n]);
        assert!(got.starts_with("<28>sanfs-agent["), "{got}");
        assert!(got.ends_with("]: WARN lun missing"), "{got}");
    }
}
