//! The control socket: how `sanfs-agent status` and `sanfs-agent bmap` reach the agent
//! serving a mount.
//!
//! Every mounting agent listens on a Unix socket `RUN_DIR/mount-MAJOR-MINOR.sock`, where
//! `MAJOR:MINOR` is the FUSE mount's device number (what `stat` reports as `st_dev` for every
//! file on the mount, and what `/proc/self/mountinfo` lists), and `RUN_DIR` is `/run/sanfs`
//! (`SANFS_RUN_DIR` overrides it, for both sides). So a command finds the agent from any path
//! on the mount, through bind mounts too, without a registry. The directory is `0700` and the
//! socket `0600`; on top of that the agent answers only peers whose uid (`SO_PEERCRED`) is
//! root or its own, since `bmap` shows where data lives on the raw LUNs. A socket left by a
//! killed agent is replaced by the next agent that gets the same device number, and a command
//! that finds nobody listening says so.
//!
//! The exchange is one JSON line each way: a [`Request`] (`{"op":"status"}`,
//! `{"op":"bmap","ino":N}`, `N` being the FUSE inode number the caller's `stat` saw, or
//! `{"op":"metrics"}`, the agent's Prometheus text, which `sanfs-csi --metrics` gathers from
//! every agent of its node) and a [`Response`].

use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use sanfs_proto::types::{Credentials, InodeId};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
use tokio::net::{UnixListener, UnixStream};

use crate::client::{AgentStatus, BmapReply, Client};
use crate::fuse::sanfs_ino;

/// Where control sockets live unless `SANFS_RUN_DIR` says otherwise.
pub const DEFAULT_RUN_DIR: &str = "/run/sanfs";
/// File-system types a sanfs mount shows in `/proc/self/mountinfo`: `fuse.sanfs` (the
/// agent's own mount call, `fuse::kernel_mount`), or `fuse` (an agent of an earlier version,
/// which mounted through fuser).
pub const FSTYPES: &[&str] = &["fuse", "fuse.sanfs"];
/// Most bytes of a request.
const MAX_REQUEST_BYTES: u64 = 4096;
/// How long a command waits for the agent's answer.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(30);

/// What a command asks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "lowercase")]
pub enum Request {
    Status,
    /// The layout of the file with this FUSE inode number.
    Bmap {
        ino: u64,
    },
    /// The agent's metrics in the Prometheus text format (what `metrics=` would serve).
    Metrics,
}

/// One mount's agent, as `status` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MountStatus {
    pub mount_point: String,
    /// `SERVER:PORT:/SUBDIR`.
    pub source: String,
    pub pid: u32,
    pub agent: AgentStatus,
}

/// The agent's answer: exactly one of the fields is set.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct Response {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<MountStatus>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bmap: Option<BmapReply>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metrics: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// The control directory (`SANFS_RUN_DIR` or [`DEFAULT_RUN_DIR`]).
pub fn run_dir() -> PathBuf {
    std::env::var_os("SANFS_RUN_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(DEFAULT_RUN_DIR))
}

/// The socket of the mount with device number `major:minor`.
pub fn socket_path(dir: &Path, major: u32, minor: u32) -> PathBuf {
    dir.join(format!("mount-{major}-{minor}.sock"))
}

/// One FUSE mount of this mount namespace (a sanfs one if an agent answers on its socket).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountEntry {
    pub mount_point: PathBuf,
    pub source: String,
    pub major: u32,
    pub minor: u32,
}

/// The FUSE mounts in a mountinfo text.
pub fn parse_mountinfo(text: &str) -> Vec<MountEntry> {
    fuse_entries(crate::mountinfo::parse(text))
}

fn fuse_entries(mounts: Vec<crate::mountinfo::Mount>) -> Vec<MountEntry> {
    mounts
        .into_iter()
        .filter(|m| FSTYPES.contains(&m.fs_type.as_str()))
        .map(|m| MountEntry {
            mount_point: m.mount_point,
            source: m.source,
            major: m.major,
            minor: m.minor,
        })
        .collect()
}

/// The FUSE mounts this process sees (sanfs ones among them).
pub fn fuse_mounts() -> anyhow::Result<Vec<MountEntry>> {
    let mounts = crate::mountinfo::read()
        .with_context(|| format!("read {}", crate::mountinfo::MOUNTINFO))?;
    Ok(fuse_entries(mounts))
}

/// The sanfs mounts this process sees: FUSE mounts with a control socket in [`run_dir`].
pub fn sanfs_mounts() -> anyhow::Result<Vec<MountEntry>> {
    let dir = run_dir();
    Ok(fuse_mounts()?
        .into_iter()
        .filter(|m| socket_path(&dir, m.major, m.minor).exists())
        .collect())
}

/// The sanfs mount that `path` lies on, and the FUSE inode number of `path`.
pub fn mount_of(path: &Path) -> anyhow::Result<(MountEntry, std::fs::Metadata)> {
    let meta = std::fs::metadata(path).map_err(|e| {
        // Only ENOTCONN means the agent is gone; a missing file is just missing.
        let why = if e.raw_os_error() == Some(libc::ENOTCONN) {
            " (the agent serving the mount is gone)"
        } else {
            ""
        };
        anyhow::Error::new(e).context(format!("stat {}{why}", path.display()))
    })?;
    let (major, minor) = (rustix::fs::major(meta.dev()), rustix::fs::minor(meta.dev()));
    let entry = fuse_mounts()?
        .into_iter()
        .find(|m| m.major == major && m.minor == minor)
        .with_context(|| format!("{} is not on a sanfs (FUSE) mount", path.display()))?;
    Ok((entry, meta))
}

/// Asks the agent behind `socket` and returns its answer (an error answer as an error).
pub fn ask(socket: &Path, request: &Request) -> anyhow::Result<Response> {
    ask_within(socket, request, ANSWER_TIMEOUT)
}

/// [`ask`], giving up on a silent agent after `timeout`.
pub fn ask_within(socket: &Path, request: &Request, timeout: Duration) -> anyhow::Result<Response> {
    let stream = std::os::unix::net::UnixStream::connect(socket).with_context(|| {
        format!(
            "connect to the agent's control socket {} (is the agent of this mount running?)",
            socket.display()
        )
    })?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    let mut line = serde_json::to_string(request)?;
    line.push('\n');
    (&stream).write_all(line.as_bytes())?;
    let mut answer = String::new();
    BufReader::new(&stream)
        .read_line(&mut answer)
        .context("read the agent's answer")?;
    let response: Response = serde_json::from_str(&answer)
        .with_context(|| format!("malformed answer from the agent: {answer:?}"))?;
    if let Some(e) = response.error {
        bail!("the agent answered: {e}");
    }
    Ok(response)
}

/// What the control server answers about.
pub struct ControlContext {
    pub client: Arc<Client>,
    pub mount_point: PathBuf,
    pub source: String,
    /// The sanfs inode shown as the mount's root.
    pub root: InodeId,
}

/// Binds the control socket of the mount with device number `major:minor` in `dir`
/// (created `0700` if missing), replacing a stale socket; the socket is `0600`.
pub fn bind(dir: &Path, major: u32, minor: u32) -> anyhow::Result<(UnixListener, PathBuf)> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .with_context(|| format!("create {}", dir.display()))?;
    let path = socket_path(dir, major, minor);
    if let Ok(m) = std::fs::symlink_metadata(&path) {
        if !m.file_type().is_socket() {
            bail!("{} exists and is not a socket", path.display());
        }
        // A live agent cannot hold this name: the device number is this mount's own.
        std::fs::remove_file(&path)
            .with_context(|| format!("remove the stale socket {}", path.display()))?;
    }
    let listener = std::os::unix::net::UnixListener::bind(&path)
        .with_context(|| format!("bind {}", path.display()))?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))
        .with_context(|| format!("chmod {}", path.display()))?;
    listener.set_nonblocking(true)?;
    let listener = UnixListener::from_std(listener).context("register the control socket")?;
    Ok((listener, path))
}

/// Answers control requests on `listener` until the task is dropped.
pub async fn serve(listener: UnixListener, ctx: Arc<ControlContext>) {
    let own_uid = rustix::process::geteuid().as_raw();
    loop {
        let stream = match listener.accept().await {
            Ok((s, _)) => s,
            Err(e) => {
                tracing::debug!(error = %e, "control accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let allowed = stream
            .peer_cred()
            .is_ok_and(|c| c.uid() == 0 || c.uid() == own_uid);
        let ctx = Arc::clone(&ctx);
        tokio::spawn(async move {
            let r = tokio::time::timeout(ANSWER_TIMEOUT, answer(stream, &ctx, allowed)).await;
            if !matches!(r, Ok(Ok(()))) {
                tracing::debug!("control request failed or timed out");
            }
        });
    }
}

async fn answer(stream: UnixStream, ctx: &ControlContext, allowed: bool) -> std::io::Result<()> {
    let (read, mut write) = stream.into_split();
    let mut line = String::new();
    tokio::io::BufReader::new(read.take(MAX_REQUEST_BYTES))
        .read_line(&mut line)
        .await?;
    let response = if !allowed {
        Response {
            error: Some("permission denied: root only".to_owned()),
            ..Response::default()
        }
    } else {
        match serde_json::from_str::<Request>(&line) {
            Err(e) => Response {
                error: Some(format!("bad request: {e}")),
                ..Response::default()
            },
            Ok(req) => handle(ctx, req).await,
        }
    };
    let mut text = serde_json::to_string(&response).map_err(std::io::Error::other)?;
    text.push('\n');
    write.write_all(text.as_bytes()).await?;
    write.shutdown().await
}

async fn handle(ctx: &ControlContext, req: Request) -> Response {
    match req {
        Request::Status => Response {
            status: Some(MountStatus {
                mount_point: ctx.mount_point.to_string_lossy().into_owned(),
                source: ctx.source.clone(),
                pid: std::process::id(),
                agent: ctx.client.status(),
            }),
            ..Response::default()
        },
        Request::Metrics => Response {
            metrics: Some(crate::metrics::render(&ctx.client)),
            ..Response::default()
        },
        Request::Bmap { ino } => {
            let ino = sanfs_ino(ctx.root, ino);
            match ctx.client.bmap(&Credentials::root(), ino).await {
                Ok(b) => Response {
                    bmap: Some(b),
                    ..Response::default()
                },
                Err(e) => Response {
                    error: Some(format!("inode {ino}: {e}")),
                    ..Response::default()
                },
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]

    use super::*;

    #[test]
    fn a_missing_path_is_not_blamed_on_a_gone_agent() {
        let dir = tempfile::tempdir().unwrap();
        let e = mount_of(&dir.path().join("nope")).unwrap_err();
        let text = format!("{e:#}");
        assert!(text.contains("No such file"), "{text}");
        assert!(!text.contains("agent"), "{text}");
    }

    #[test]
    fn mountinfo_lists_fuse_mounts_of_our_types() {
        let text = "\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
95 22 0:52 / /mnt/with\\040space rw,nosuid,nodev,relatime shared:50 - fuse 10.0.0.1:7000:/ rw,user_id=0,group_id=0
96 22 0:53 / /mnt/b rw,relatime - fuse.other x rw
97 22 0:54 / /mnt/c rw,relatime - fuse.sanfs h:1:/d rw
";
        let m = parse_mountinfo(text);
        assert_eq!(
            m,
            vec![
                MountEntry {
                    mount_point: PathBuf::from("/mnt/with space"),
                    source: "10.0.0.1:7000:/".to_owned(),
                    major: 0,
                    minor: 52,
                },
                MountEntry {
                    mount_point: PathBuf::from("/mnt/c"),
                    source: "h:1:/d".to_owned(),
                    major: 0,
                    minor: 54,
                }
            ]
        );
        assert_eq!(
            socket_path(Path::new("/run/sanfs"), 0, 52),
            PathBuf::from("/run/sanfs/mount-0-52.sock")
        );
    }

    #[test]
    fn requests_are_one_json_line() {
        assert_eq!(
            serde_json::to_string(&Request::Bmap { ino: 7 }).unwrap(),
            r#"{"op":"bmap","ino":7}"#
        );
        assert_eq!(
            serde_json::from_str::<Request>(r#"{"op":"status"}"#).unwrap(),
            Request::Status
        );
        assert!(serde_json::from_str::<Request>(r#"{"op":"rm"}"#).is_err());
    }
}
