//! `sanfs-agent`: mounts a sanfs file system with FUSE (`mount`) and unmounts it (`umount`).
//!
//! `sanfs-agent mount SERVER:PORT[:/SUBDIR] MOUNTPOINT [-o OPTIONS] [--foreground]` connects
//! a [`Client`] (a session at the server, this node's LUNs found by label), then serves the
//! [`SanFs`] file system at MOUNTPOINT until the file system is unmounted (`umount`,
//! `sanfs-agent umount`) or the agent gets SIGTERM / SIGINT (it then unmounts, lazily if the
//! mount is busy). Without `--foreground` it starts itself in the foreground as a child in a
//! process group of its own and returns once the mount is there. Logs go to stderr
//! (`RUST_LOG`, default `info`).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::{Parser, Subcommand};
use fuser::{Config, MountOption, SessionACL};
use sanfs_client_agent::client::{Client, ClientConfig, TlsConfig};
use sanfs_client_agent::discovery::DEFAULT_GLOBS;
use sanfs_client_agent::engine::EngineKind;
use sanfs_client_agent::fuse::{FsOptions, SanFs};
use sanfs_proto::types::{Credentials, FileType, ROOT_INODE};

#[derive(Parser)]
#[command(
    name = "sanfs-agent",
    version,
    about = "sanfs client agent: FUSE mount"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Mount SERVER:PORT[:/SUBDIR] at MOUNTPOINT.
    Mount {
        /// `host:port` of the metadata server, optionally `:/sub/dir` to mount a directory.
        source: String,
        mountpoint: PathBuf,
        /// Comma-separated options: attr_ttl=1s, entry_ttl=1s, allow_other, ro, rw,
        /// engine=uring|sync|auto, devices=GLOB,GLOB (LUN discovery), tls_ca=, tls_cert=,
        /// tls_key=, tls_domain=, client_name=; mount(8)'s generic ones are ignored.
        #[arg(short = 'o', value_name = "OPTIONS")]
        options: Vec<String>,
        /// Stay in the foreground (otherwise return once mounted, the agent running on).
        #[arg(short = 'f', long)]
        foreground: bool,
    },
    /// Unmount MOUNTPOINT (the agent serving it then exits).
    Umount {
        mountpoint: PathBuf,
        /// Detach now even if busy (MNT_DETACH).
        #[arg(short = 'l', long)]
        lazy: bool,
    },
}

/// The parsed `-o` options.
#[derive(Debug)]
struct MountOpts {
    attr_ttl: Duration,
    entry_ttl: Duration,
    allow_other: bool,
    read_only: bool,
    engine: EngineKind,
    devices: Vec<String>,
    tls_ca: Option<PathBuf>,
    tls_cert: Option<PathBuf>,
    tls_key: Option<PathBuf>,
    tls_domain: Option<String>,
    client_name: String,
}

/// `1s`, `500ms`, `0`, `2` (seconds).
fn parse_duration(s: &str) -> anyhow::Result<Duration> {
    let (num, unit) = match s.find(|c: char| !c.is_ascii_digit() && c != '.') {
        Some(i) => s.split_at(i),
        None => (s, "s"),
    };
    let v: f64 = num.parse().with_context(|| format!("bad duration {s:?}"))?;
    let secs = match unit {
        "s" => v,
        "ms" => v / 1000.0,
        "m" => v * 60.0,
        _ => bail!("bad duration unit in {s:?} (s, ms or m)"),
    };
    Duration::try_from_secs_f64(secs).with_context(|| format!("bad duration {s:?}"))
}

fn parse_options(raw: &[String]) -> anyhow::Result<MountOpts> {
    let mut o = MountOpts {
        attr_ttl: Duration::from_secs(1),
        entry_ttl: Duration::from_secs(1),
        allow_other: false,
        read_only: false,
        engine: EngineKind::Auto,
        devices: Vec::new(),
        tls_ca: None,
        tls_cert: None,
        tls_key: None,
        tls_domain: None,
        client_name: "sanfs-agent".to_owned(),
    };
    let mut last_was_devices = false;
    for item in raw
        .iter()
        .flat_map(|r| r.split(','))
        .filter(|i| !i.is_empty())
    {
        let (key, value) = match item.split_once('=') {
            Some((k, v)) => (k, Some(v)),
            None => (item, None),
        };
        // `devices=GLOB,GLOB`: a bare path after it continues the list.
        if value.is_none() && key.contains('/') && last_was_devices {
            o.devices
                .extend(key.split(':').filter(|g| !g.is_empty()).map(str::to_owned));
            continue;
        }
        last_was_devices = false;
        match key {
            "attr_ttl" => o.attr_ttl = parse_duration(need(key, value)?)?,
            "entry_ttl" => o.entry_ttl = parse_duration(need(key, value)?)?,
            "allow_other" => o.allow_other = true,
            "ro" => o.read_only = true,
            "rw" => o.read_only = false,
            "engine" => {
                o.engine = match need(key, value)? {
                    "uring" => EngineKind::Uring,
                    "sync" => EngineKind::Sync,
                    "auto" => EngineKind::Auto,
                    v => bail!("engine={v}: uring, sync or auto"),
                }
            }
            "devices" => {
                o.devices.extend(
                    need(key, value)?
                        .split(':')
                        .filter(|g| !g.is_empty())
                        .map(str::to_owned),
                );
                last_was_devices = true;
            }
            "tls_ca" => o.tls_ca = Some(need(key, value)?.into()),
            "tls_cert" => o.tls_cert = Some(need(key, value)?.into()),
            "tls_key" => o.tls_key = Some(need(key, value)?.into()),
            "tls_domain" => o.tls_domain = Some(need(key, value)?.to_owned()),
            "client_name" => o.client_name = need(key, value)?.to_owned(),
            // mount(8) and fstab options that mean nothing to the agent.
            "defaults" | "auto" | "noauto" | "nofail" | "_netdev" | "user" | "nouser" | "users"
            | "dev" | "nodev" | "suid" | "nosuid" | "exec" | "noexec" | "atime" | "noatime"
            | "relatime" => {}
            k if k.starts_with("x-") || k.starts_with("comment=") => {}
            k => bail!("unknown mount option {k:?}"),
        }
    }
    Ok(o)
}

fn need<'a>(key: &str, value: Option<&'a str>) -> anyhow::Result<&'a str> {
    value.with_context(|| format!("option {key} needs a value"))
}

/// `host:port[:/subdir]` split into the server address and the sub-directory (`/` if none).
fn parse_source(source: &str) -> anyhow::Result<(String, String)> {
    let (server, subdir) = match source.find(":/") {
        Some(i) => (&source[..i], &source[i + 1..]),
        None => (source, "/"),
    };
    if server
        .rsplit_once(':')
        .is_none_or(|(h, p)| h.is_empty() || p.parse::<u16>().is_err())
    {
        bail!("source {source:?} is not SERVER:PORT[:/SUBDIR]");
    }
    Ok((server.to_owned(), subdir.to_owned()))
}

fn is_mounted(mountpoint: &Path) -> bool {
    let want = mountpoint.to_string_lossy();
    std::fs::read_to_string("/proc/self/mounts").is_ok_and(|m| {
        m.lines()
            .any(|l| l.split_whitespace().nth(1) == Some(want.as_ref()))
    })
}

fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let cli = Cli::parse();
    let r = match cli.command {
        Command::Mount {
            source,
            mountpoint,
            options,
            foreground,
        } => mount(&source, &mountpoint, &options, foreground),
        Command::Umount { mountpoint, lazy } => umount(&mountpoint, lazy),
    };
    match r {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn umount(mountpoint: &Path, lazy: bool) -> anyhow::Result<()> {
    let flags = if lazy {
        rustix::mount::UnmountFlags::DETACH
    } else {
        rustix::mount::UnmountFlags::empty()
    };
    rustix::mount::unmount(mountpoint, flags)
        .with_context(|| format!("unmount {}", mountpoint.display()))
}

fn mount(
    source: &str,
    mountpoint: &Path,
    raw_options: &[String],
    foreground: bool,
) -> anyhow::Result<()> {
    let (server, subdir) = parse_source(source)?;
    let opts = parse_options(raw_options)?;
    let mountpoint = std::fs::canonicalize(mountpoint)
        .with_context(|| format!("mount point {}", mountpoint.display()))?;
    if !foreground {
        return mount_in_background(source, &mountpoint, raw_options);
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .context("start the tokio runtime")?;
    let mut config = ClientConfig::new(
        server.clone(),
        if opts.devices.is_empty() {
            DEFAULT_GLOBS.iter().map(|g| (*g).to_owned()).collect()
        } else {
            opts.devices.clone()
        },
    );
    config.client_name = opts.client_name.clone();
    config.engine.kind = opts.engine;
    config.tls = match (&opts.tls_ca, &opts.tls_cert, &opts.tls_key) {
        (None, None, None) => None,
        (Some(ca), Some(cert), Some(key)) => Some(TlsConfig {
            ca: ca.clone(),
            cert: cert.clone(),
            key: key.clone(),
            domain: opts.tls_domain.clone(),
        }),
        _ => bail!("tls_ca, tls_cert and tls_key go together"),
    };
    let client = runtime
        .block_on(Client::connect(config))
        .with_context(|| format!("connect to {server}"))?;
    let client = Arc::new(client);
    let root = runtime.block_on(async {
        let mut ino = ROOT_INODE;
        for part in subdir.split('/').filter(|p| !p.is_empty()) {
            let a = client
                .lookup(&Credentials::root(), ino, part)
                .await
                .with_context(|| format!("look up {subdir} on the server"))?;
            if a.kind != FileType::Directory {
                bail!("{subdir} is not a directory");
            }
            ino = a.ino;
        }
        Ok(ino)
    })?;
    let fs = SanFs::new(
        Arc::clone(&client),
        FsOptions {
            attr_ttl: opts.attr_ttl,
            entry_ttl: opts.entry_ttl,
            root,
        },
        runtime.handle().clone(),
    );
    let mut fuse_config = Config::default();
    fuse_config.mount_options = vec![
        MountOption::FSName(format!("{server}:{subdir}")),
        MountOption::Subtype("sanfs".to_owned()),
        if opts.read_only {
            MountOption::RO
        } else {
            MountOption::RW
        },
    ];
    if opts.allow_other {
        fuse_config.acl = SessionACL::All;
    }
    fuse_config.n_threads = Some(2);
    fuse_config.clone_fd = true;
    let mut session = fuser::Session::new(fs, &mountpoint, &fuse_config)
        .with_context(|| format!("mount at {}", mountpoint.display()))?;
    let mut unmounter = session.unmount_callable();
    tracing::info!(source, mountpoint = %mountpoint.display(), "mounted");
    let (done_tx, done_rx) = tokio::sync::oneshot::channel();
    let serve = std::thread::Builder::new()
        .name("fuse-session".to_owned())
        .spawn(move || {
            let r = session.run();
            let _ = done_tx.send(());
            r
        })
        .context("start the FUSE session thread")?;
    let signalled = runtime.block_on(async {
        use tokio::signal::unix::{SignalKind, signal};
        let mut term = signal(SignalKind::terminate())?;
        let mut int = signal(SignalKind::interrupt())?;
        tokio::select! {
            _ = done_rx => Ok::<_, std::io::Error>(false),
            _ = term.recv() => Ok(true),
            _ = int.recv() => Ok(true),
        }
    })?;
    if signalled {
        tracing::info!(mountpoint = %mountpoint.display(), "signalled: unmounting");
        if let Err(e) = unmounter.unmount() {
            tracing::warn!(error = %e, "unmount failed; detaching lazily");
            umount(&mountpoint, true)?;
        }
        // Wait a little for the session to end; a lazily detached, busy mount may not.
        let deadline = Instant::now() + Duration::from_secs(5);
        while !serve.is_finished() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    if serve.is_finished() {
        match serve.join() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(error = %e, "FUSE session ended with an error"),
            Err(_) => tracing::error!("FUSE session thread panicked"),
        }
    }
    tracing::info!(mountpoint = %mountpoint.display(), "unmounted");
    // The file system's tasks may still hold the client for a moment.
    let close = runtime.block_on(async {
        let deadline = Instant::now() + Duration::from_secs(2);
        let mut client = client;
        loop {
            match Arc::try_unwrap(client) {
                Ok(c) => return tokio::time::timeout(Duration::from_secs(5), c.close()).await,
                Err(c) if Instant::now() < deadline => {
                    client = c;
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err(_) => return Ok(Ok(())),
            }
        }
    });
    match close {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::warn!(error = %e, "closing the session failed"),
        Err(_) => tracing::warn!("closing the session timed out"),
    }
    runtime.shutdown_timeout(Duration::from_secs(1));
    Ok(())
}

/// Starts `sanfs-agent mount --foreground` as a child in its own process group and waits
/// until the mount appears (or the child fails).
fn mount_in_background(
    source: &str,
    mountpoint: &Path,
    raw_options: &[String],
) -> anyhow::Result<()> {
    use std::os::unix::process::CommandExt;
    let exe = std::env::current_exe().context("find this executable")?;
    let mut cmd = std::process::Command::new(exe);
    cmd.arg("mount")
        .arg(source)
        .arg(mountpoint)
        .arg("--foreground");
    for o in raw_options {
        cmd.arg("-o").arg(o);
    }
    cmd.stdin(std::process::Stdio::null()).process_group(0);
    let mut child = cmd.spawn().context("start the agent")?;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if is_mounted(mountpoint) {
            tracing::info!(pid = child.id(), "agent running");
            return Ok(());
        }
        if let Some(status) = child.try_wait()? {
            bail!("the agent exited before mounting: {status}");
        }
        if Instant::now() >= deadline {
            bail!(
                "the mount did not appear within 60 s (agent pid {})",
                child.id()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]

    use super::*;

    #[test]
    fn options_parse() {
        let o = parse_options(&[
            "attr_ttl=0,entry_ttl=250ms,allow_other".to_owned(),
            "ro,engine=sync,devices=/dev/loop*,/srv/luns/*:/x/y,_netdev,x-systemd.automount"
                .to_owned(),
        ])
        .unwrap();
        assert_eq!(o.attr_ttl, Duration::ZERO);
        assert_eq!(o.entry_ttl, Duration::from_millis(250));
        assert!(o.allow_other && o.read_only);
        assert_eq!(o.engine, EngineKind::Sync);
        assert_eq!(o.devices, ["/dev/loop*", "/srv/luns/*", "/x/y"]);
        let d = parse_options(&[]).unwrap();
        assert_eq!(d.attr_ttl, Duration::from_secs(1));
        assert!(d.devices.is_empty() && !d.read_only);
        assert!(parse_options(&["bogus".to_owned()]).is_err());
        assert!(parse_options(&["attr_ttl=fast".to_owned()]).is_err());
        assert!(parse_options(&["engine=spdk".to_owned()]).is_err());
    }

    #[test]
    fn source_parse() {
        let s = |x: &str| parse_source(x).unwrap();
        assert_eq!(s("mds:7000"), ("mds:7000".to_owned(), "/".to_owned()));
        assert_eq!(
            s("10.0.0.1:7000:/a/b"),
            ("10.0.0.1:7000".to_owned(), "/a/b".to_owned())
        );
        assert!(parse_source("mds").is_err());
        assert!(parse_source("mds:port:/x").is_err());
    }
}
