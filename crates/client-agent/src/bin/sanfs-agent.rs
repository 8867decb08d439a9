//! `sanfs-agent`: mounts a sanfs file system with FUSE (`mount`) and unmounts it (`umount`);
//! shows a mount's agent (`status`) and a file's layout on the LUNs (`bmap`).
//!
//! `sanfs-agent mount SERVER:PORT[:/SUBDIR] MOUNTPOINT [-o OPTIONS] [--foreground]` connects
//! a [`Client`] (a session at the server, this node's LUNs found by label), then serves the
//! [`SanFs`] file system at MOUNTPOINT until the file system is unmounted (`umount`,
//! `sanfs-agent umount`) or the agent gets SIGTERM / SIGINT (it then unmounts, lazily if the
//! mount is busy). Without `--foreground` it starts itself in the foreground as a child in a
//! process group of its own and returns once the mount is there. Logs go to stderr
//! (`RUST_LOG`, default `info`).
//!
//! A mounted agent answers `status` and `bmap` on its control socket ([`control`]), found
//! from any path on the mount by the mount's device number, and serves Prometheus metrics
//! with `-o metrics=ADDR`.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::{Parser, Subcommand};
use fuser::{Config, MountOption, SessionACL};
use sanfs_client_agent::client::{
    AgentStatus, BmapReply, Client, ClientConfig, DeviceHealth, TlsConfig,
};
use sanfs_client_agent::control::{self, ControlContext, MountStatus, Request};
use sanfs_client_agent::discovery::DEFAULT_GLOBS;
use sanfs_client_agent::engine::EngineKind;
use sanfs_client_agent::fuse::{FsOptions, SanFs};
use sanfs_proto::types::{Credentials, FileType, ROOT_INODE};

#[derive(Parser)]
#[command(
    name = "sanfs-agent",
    version,
    about = "sanfs client agent: FUSE mount, status, bmap"
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
        /// tls_key=, tls_domain=, client_name=, metrics=ADDR:PORT (Prometheus),
        /// device_retry=5s (probe a LUN poisoned by a failed write again after this);
        /// mount(8)'s generic ones are ignored.
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
    /// Show where a file's bytes live: one line per device piece (file range, LUN, this
    /// node's path to it, device offset, length, state), in bytes.
    Bmap {
        /// A file on a sanfs mount.
        path: PathBuf,
        /// Print a JSON array of {file_off, len, device_uuid, device_path, phys_off, state}.
        #[arg(long)]
        json: bool,
    },
    /// Show a mount's agent (all sanfs mounts without MOUNTPOINT): session, lease, LUNs
    /// found and missing, bytes direct and proxied, grants and recalls.
    Status {
        mountpoint: Option<PathBuf>,
        /// Print JSON (an object for MOUNTPOINT, else an array).
        #[arg(long)]
        json: bool,
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
    metrics: Option<std::net::SocketAddr>,
    device_retry: Duration,
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
        metrics: None,
        device_retry: Duration::from_secs(5),
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
            "metrics" => {
                let v = need(key, value)?;
                o.metrics = Some(
                    v.parse()
                        .with_context(|| format!("metrics={v}: not ADDRESS:PORT"))?,
                );
            }
            "device_retry" => o.device_retry = parse_duration(need(key, value)?)?,
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
        Command::Bmap { path, json } => bmap(&path, json),
        Command::Status { mountpoint, json } => status(mountpoint.as_deref(), json),
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
    // Before the client: the engine's latency histograms register with the recorder.
    let metrics_listener = match opts.metrics {
        Some(addr) => {
            sanfs_client_agent::metrics::install();
            Some(
                runtime
                    .block_on(tokio::net::TcpListener::bind(addr))
                    .with_context(|| format!("bind the metrics listener {addr}"))?,
            )
        }
        None => None,
    };
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
    config.device_retry = opts.device_retry;
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
    if let Some(l) = metrics_listener {
        tracing::info!(addr = ?l.local_addr().ok(), "metrics listening");
        runtime.spawn(sanfs_client_agent::metrics::serve(l, Arc::clone(&client)));
    }
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
    // The handlers are in place before the mount appears: whoever sees the mount may send
    // SIGTERM at once, and it must unmount, not kill the agent.
    let (mut term, mut int) = {
        use tokio::signal::unix::{SignalKind, signal};
        let _rt = runtime.enter();
        (
            signal(SignalKind::terminate()).context("install the SIGTERM handler")?,
            signal(SignalKind::interrupt()).context("install the SIGINT handler")?,
        )
    };
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
    let control_socket = start_control(
        &runtime,
        ControlContext {
            client: Arc::clone(&client),
            mount_point: mountpoint.clone(),
            source: source.to_owned(),
            root,
        },
    );
    let signalled = runtime.block_on(async {
        tokio::select! {
            _ = done_rx => false,
            _ = term.recv() => true,
            _ = int.recv() => true,
        }
    });
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
    if let Some(path) = control_socket {
        let _ = std::fs::remove_file(path);
    }
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

/// Binds this mount's control socket (named by the mount's device number, read from
/// mountinfo, so that no request to the mount itself is needed) and serves it. A failure is
/// logged, not fatal: the mount works without `status` and `bmap`.
fn start_control(runtime: &tokio::runtime::Runtime, ctx: ControlContext) -> Option<PathBuf> {
    let found =
        control::fuse_mounts().map(|m| m.into_iter().rfind(|e| e.mount_point == ctx.mount_point));
    let entry = match found {
        Ok(Some(e)) => e,
        Ok(None) => {
            tracing::warn!(mountpoint = %ctx.mount_point.display(), "mount not in mountinfo: no control socket");
            return None;
        }
        Err(e) => {
            tracing::warn!(error = %e, "no control socket");
            return None;
        }
    };
    let dir = control::run_dir();
    let _guard = runtime.enter();
    match control::bind(&dir, entry.major, entry.minor) {
        Ok((listener, path)) => {
            tracing::info!(socket = %path.display(), "control socket listening");
            runtime.spawn(control::serve(listener, Arc::new(ctx)));
            Some(path)
        }
        Err(e) => {
            tracing::warn!(error = %format!("{e:#}"), "no control socket");
            None
        }
    }
}

fn bmap(path: &Path, json: bool) -> anyhow::Result<()> {
    let (entry, meta) = control::mount_of(path)?;
    if !meta.is_file() {
        bail!("{} is not a regular file", path.display());
    }
    let socket = control::socket_path(&control::run_dir(), entry.major, entry.minor);
    let reply = control::ask(&socket, &Request::Bmap { ino: meta.ino() })?
        .bmap
        .context("the agent's answer has no layout")?;
    if json {
        println!("{}", serde_json::to_string_pretty(&reply.entries)?);
    } else {
        print!("{}", format_bmap(path, &reply));
    }
    Ok(())
}

/// xfs_bmap -v's shape, in bytes: one line per device piece, holes in between.
fn format_bmap(path: &Path, reply: &BmapReply) -> String {
    use std::fmt::Write as _;
    let mut out = format!(
        "{}: {} bytes, block size {}\n{:>4}  {:<27} {:>12}  {:<36}  {:<20} {:<27} STATE\n",
        path.display(),
        reply.file_size,
        reply.block_size,
        "EXT",
        "FILE-OFFSET",
        "LENGTH",
        "DEVICE",
        "PATH",
        "PHYS-OFFSET"
    );
    let range = |a: u64, len: u64| format!("[{a}..{}]", a + len - 1);
    let mut n = 0usize;
    let hole = |out: &mut String, n: &mut usize, from: u64, to: u64| {
        if to > from {
            let _ = writeln!(
                out,
                "{n:>3}:  {:<27} {:>12}  hole",
                range(from, to - from),
                to - from
            );
            *n += 1;
        }
    };
    let mut pos = 0u64;
    for e in &reply.entries {
        hole(&mut out, &mut n, pos, e.file_off);
        let _ = writeln!(
            out,
            "{n:>3}:  {:<27} {:>12}  {:<36}  {:<20} {:<27} {}",
            range(e.file_off, e.len),
            e.len,
            e.device_uuid,
            e.device_path.as_deref().unwrap_or("(missing here)"),
            range(e.phys_off, e.len),
            e.state
        );
        n += 1;
        pos = e.file_off + e.len;
    }
    hole(&mut out, &mut n, pos, reply.file_size);
    out
}

fn status(mountpoint: Option<&Path>, json: bool) -> anyhow::Result<()> {
    let ask = |e: &control::MountEntry| -> anyhow::Result<MountStatus> {
        let socket = control::socket_path(&control::run_dir(), e.major, e.minor);
        control::ask(&socket, &Request::Status)?
            .status
            .context("the agent's answer has no status")
    };
    if let Some(mp) = mountpoint {
        let (entry, _) = control::mount_of(mp)?;
        let st = ask(&entry)?;
        if json {
            println!("{}", serde_json::to_string_pretty(&st)?);
        } else {
            print!("{}", format_status(&st));
        }
        return Ok(());
    }
    let mut all = Vec::new();
    let mut failed = 0;
    for entry in control::sanfs_mounts()? {
        match ask(&entry) {
            Ok(st) => all.push(st),
            Err(e) => {
                failed += 1;
                eprintln!("{}: {e:#}", entry.mount_point.display());
            }
        }
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&all)?);
    } else if all.is_empty() && failed == 0 {
        println!("no sanfs mounts");
    } else {
        for st in &all {
            print!("{}", format_status(st));
        }
    }
    if failed > 0 {
        bail!("{failed} mount(s) did not answer");
    }
    Ok(())
}

fn format_status(m: &MountStatus) -> String {
    use std::fmt::Write as _;
    let a: &AgentStatus = &m.agent;
    let mib = |b: u64| format!("{:.1} MiB", b as f64 / 1_048_576.0);
    let mut out = format!("{} ({}, agent pid {})\n", m.mount_point, m.source, m.pid);
    let _ = writeln!(out, "  server     {} (file system {})", a.server, a.fs_uuid);
    let lease = if a.lease_valid {
        format!(
            "valid, {:.1} s of {:.1} s left",
            a.lease_remaining_ms as f64 / 1000.0,
            a.lease_ttl_ms as f64 / 1000.0
        )
    } else {
        "LAPSED (no device I/O until a new session)".to_owned()
    };
    let _ = writeln!(
        out,
        "  session    {} epoch {}: lease {lease}; {} session(s) opened, {} lost",
        a.session, a.epoch, a.sessions_opened, a.fences
    );
    let found = a
        .devices
        .iter()
        .filter(|d| d.state != DeviceHealth::Missing)
        .count();
    let _ = writeln!(
        out,
        "  LUNs       {found} of {} found, {} missing; engine {}; {} recovered after a failed write",
        a.devices.len(),
        a.missing().count(),
        a.engine,
        a.device_recoveries
    );
    for d in &a.devices {
        let state = match d.state {
            DeviceHealth::Ok => "ok",
            DeviceHealth::Missing => "MISSING (its I/O goes through the server)",
            DeviceHealth::Poisoned => "POISONED by a failed write (proxied until a probe succeeds)",
        };
        let _ = writeln!(
            out,
            "    {:>3} {} {:<20} {state}; reads {} ({}), writes {} ({}), errors {}",
            d.index,
            d.uuid,
            d.path.as_deref().unwrap_or("-"),
            d.read_ops,
            mib(d.read_bytes),
            d.write_ops,
            mib(d.write_bytes),
            d.errors
        );
    }
    let b = &a.bytes;
    let _ = writeln!(
        out,
        "  bytes      direct read {} write {}; proxied read {} write {}",
        b.direct_read, b.direct_write, b.proxied_read, b.proxied_write
    );
    let g = &a.grants;
    let _ = writeln!(
        out,
        "  grants     read {} write {}; reads from cached grants {}, writes in cached layouts {} ({} cached now); recalls {}",
        g.read, g.write, g.cached_reads, g.layout_writes, g.cached_now, g.recalls
    );
    out
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
        let m = parse_options(&["metrics=10.0.0.2:9420,device_retry=250ms".to_owned()]).unwrap();
        assert_eq!(m.metrics, Some("10.0.0.2:9420".parse().unwrap()));
        assert_eq!(m.device_retry, Duration::from_millis(250));
        assert!(parse_options(&["metrics=nowhere".to_owned()]).is_err());
    }

    #[test]
    fn bmap_text_shows_pieces_and_holes() {
        use sanfs_client_agent::client::BmapEntry;
        let reply = BmapReply {
            file_size: 3 * 4096,
            block_size: 4096,
            entries: vec![BmapEntry {
                file_off: 4096,
                len: 4096,
                device_uuid: "u".to_owned(),
                device_path: None,
                phys_off: 1 << 20,
                state: "unwritten".to_owned(),
            }],
        };
        let text = format_bmap(Path::new("/m/f"), &reply);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 5, "{text}");
        assert!(lines[2].contains("[0..4095]") && lines[2].ends_with("hole"));
        assert!(lines[3].contains("[4096..8191]") && lines[3].contains("(missing here)"));
        assert!(lines[3].contains("[1048576..1052671]") && lines[3].ends_with("unwritten"));
        assert!(lines[4].contains("[8192..12287]") && lines[4].ends_with("hole"));
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
