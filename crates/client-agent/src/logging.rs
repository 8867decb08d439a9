//! Where `sanfs-agent` logs: levelled `tracing` lines to stderr (in the foreground), to a file
//! (`-o log=FILE`), or to the local syslog socket `/dev/log` (`-o log=syslog`; journald reads
//! it where systemd runs), one RFC 3164 datagram per line (written by the `syslog` crate),
//! facility `daemon`, ident `sanfs-agent`, the level as its syslog severity.
//!
//! A daemonised agent (a plain `mount`, `mount -t sanfs`, fstab) has no terminal: without
//! `log=` it logs to syslog when `/dev/log` is there, else to
//! `/var/log/sanfs/agent-<mount point>.log` ([`default_daemon_target`]).

use std::io::Write;
use std::os::unix::fs::FileTypeExt;
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
        LogTarget::Syslog => builder
            .with_ansi(false)
            .without_time()
            .with_writer(Syslog::connect(Path::new(SYSLOG_SOCKET))?)
            .init(),
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

/// The ident of the agent's syslog lines.
const SYSLOG_IDENT: &str = "sanfs-agent";

type SyslogLogger = syslog::Logger<syslog::LoggerBackend, syslog::Formatter3164>;

/// A writer per log line that sends it to syslog, its severity from the event's level.
struct Syslog {
    logger: Arc<Mutex<SyslogLogger>>,
}

/// One syslog line being formatted; sent when dropped.
struct SyslogLine {
    logger: Arc<Mutex<SyslogLogger>>,
    severity: syslog::Severity,
    buf: Vec<u8>,
}

impl Syslog {
    /// Connects to the syslog socket at `path` (a datagram socket, or a stream one).
    fn connect(path: &Path) -> anyhow::Result<Syslog> {
        let formatter = syslog::Formatter3164 {
            facility: syslog::Facility::LOG_DAEMON,
            hostname: None,
            process: SYSLOG_IDENT.to_owned(),
            pid: std::process::id(),
        };
        let logger = syslog::unix_custom(formatter, path)
            .map_err(|e| anyhow::anyhow!("{e}"))
            .with_context(|| format!("connect to {}", path.display()))?;
        Ok(Syslog {
            logger: Arc::new(Mutex::new(logger)),
        })
    }

    fn line(&self, severity: syslog::Severity) -> SyslogLine {
        SyslogLine {
            logger: Arc::clone(&self.logger),
            severity,
            buf: Vec::with_capacity(256),
        }
    }
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
        use syslog::LogFormat;
        let line = String::from_utf8_lossy(&self.buf);
        let line = line.trim_end();
        if line.is_empty() {
            return;
        }
        // A lost log line (or a poisoned lock: a thread died logging) must not stop the agent.
        let mut logger = self.logger.lock().unwrap_or_else(|p| p.into_inner());
        let logger = &mut *logger;
        let _ = logger
            .formatter
            .format(&mut logger.backend, self.severity, line);
    }
}

/// The syslog severity of a level: error 3, warning 4, info 6, debug and trace 7.
fn syslog_severity(level: &tracing::Level) -> syslog::Severity {
    match *level {
        tracing::Level::ERROR => syslog::Severity::LOG_ERR,
        tracing::Level::WARN => syslog::Severity::LOG_WARNING,
        tracing::Level::INFO => syslog::Severity::LOG_INFO,
        _ => syslog::Severity::LOG_DEBUG,
    }
}

impl<'a> MakeWriter<'a> for Syslog {
    type Writer = SyslogLine;
    fn make_writer(&'a self) -> SyslogLine {
        self.line(syslog::Severity::LOG_INFO)
    }
    fn make_writer_for(&'a self, meta: &tracing::Metadata<'_>) -> SyslogLine {
        self.line(syslog_severity(meta.level()))
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

    /// Events through the same subscriber set-up as `log=syslog`, to a datagram socket standing
    /// in for `/dev/log`: one datagram per event, `<facility daemon * 8 + severity>`, the
    /// ident and pid, no colour codes, one line.
    #[test]
    fn syslog_lines_carry_the_level_and_the_ident() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("h18-log.sock");
        let server = std::os::unix::net::UnixDatagram::bind(&path).unwrap();
        server
            .set_read_timeout(Some(std::time::Duration::from_secs(10)))
            .unwrap();
        let subscriber = tracing_subscriber::fmt()
            .with_env_filter(filter(Some("debug")))
            .with_ansi(false)
            .without_time()
            .with_writer(Syslog::connect(&path).unwrap())
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            tracing::error!(lun = "wwn-1", "lun gone");
            tracing::warn!("lun missing");
            tracing::info!("mounted");
            tracing::debug!("lease renewed");
            tracing::trace!("filtered out");
        });
        let pid = std::process::id();
        let mut got = Vec::new();
        for _ in 0..4 {
            let mut buf = [0u8; 1024];
            let n = server.recv(&mut buf).unwrap();
            got.push(String::from_utf8(buf[..n].to_vec()).unwrap());
        }
        for (line, (pri, text)) in
            got.iter()
                .zip([(27, "ERROR"), (28, "WARN"), (30, "INFO"), (31, "DEBUG")])
        {
            assert!(line.starts_with(&format!("<{pri}>")), "{line}");
            assert!(line.contains(&format!(" sanfs-agent[{pid}]: ")), "{line}");
            assert!(line.contains(text), "{line}");
            assert!(!line.contains('\x1b') && !line.contains('\n'), "{line:?}");
        }
        assert!(got[0].ends_with("lun gone lun=\"wwn-1\""), "{}", got[0]);
        server.set_nonblocking(true).unwrap();
        assert!(
            server.recv(&mut [0u8; 64]).is_err(),
            "the trace event is filtered"
        );
    }

    #[test]
    fn a_missing_syslog_socket_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let err = Syslog::connect(&dir.path().join("absent")).err().unwrap();
        assert!(format!("{err:#}").contains("absent"), "{err:#}");
    }
}
