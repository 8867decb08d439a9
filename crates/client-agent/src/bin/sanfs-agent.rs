//! `sanfs-agent`: mounts a sanfs file system with FUSE (`mount`) and unmounts it (`umount`);
//! shows a mount's agent (`status`) and a file's layout on the LUNs (`bmap`); brings a whole
//! one-machine sanfs up and down (`quickstart`). Started as `mount.sanfs` (a symlink in
//! /sbin), it is mount(8)'s helper for `mount -t sanfs` and fstab ([`mount_helper`]).
//!
//! `sanfs-agent mount SERVER:PORT[:/SUBDIR] MOUNTPOINT [-o OPTIONS] [--foreground]` (or
//! several servers, `SERVER,SERVER:PORT[:/SUBDIR]`, of which it talks to whichever answers;
//! or `unix:/SOCKET[:/SUBDIR]`, the server's unix socket on the same host) connects
//! a [`Client`] (a session at the server, this node's LUNs found by label), then serves the
//! [`SanFs`] file system at MOUNTPOINT until the file system is unmounted (`umount`,
//! `sanfs-agent umount`) or the agent gets SIGTERM / SIGINT (it then unmounts, lazily if the
//! mount is busy). Without `--foreground` it starts itself in the foreground as a child in a
//! process group of its own and returns once the mount is there. Logs go to stderr in the
//! foreground, else to `-o log=FILE|syslog` or the default of [`logging`] (`RUST_LOG` or
//! `-o log_level=`, default `info`).
//!
//! A mounted agent answers `status` and `bmap` on its control socket ([`control`]), found
//! from any path on the mount by the mount's device number, and serves Prometheus metrics
//! with `-o metrics=ADDR`.
//!
//! [`mount_helper`]: sanfs_client_agent::mount_helper
//! [`logging`]: sanfs_client_agent::logging

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
use sanfs_client_agent::fuse::{FsOptions, SanFs, kernel_mount};
use sanfs_client_agent::mount_options::{LogTarget, default_threads, parse_options, parse_source};
use sanfs_client_agent::{logging, mount_helper, quickstart};
use sanfs_proto::types::{Credentials, FileType, ROOT_INODE};

#[derive(Parser)]
#[command(
    name = "sanfs-agent",
    version,
    about = "sanfs client agent: FUSE mount, status, bmap, quickstart"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Mount SERVER:PORT[:/SUBDIR] (several servers: SERVER,SERVER:PORT[:/SUBDIR]; or
    /// unix:/SOCKET[:/SUBDIR]) at MOUNTPOINT.
    Mount {
        /// `host:port` of the metadata server; several (`mds1,mds2:7410`: an entry without a
        /// port takes the next one's; `a:7410,b:7411`), of which the agent talks to whichever
        /// answers (the leader); or `unix:/path` of its unix socket on this host; optionally
        /// `:/sub/dir` to mount a directory.
        source: String,
        mountpoint: PathBuf,
        /// Comma-separated options: attr_ttl=1s, entry_ttl=1s, allow_other, ro, rw,
        /// threshold=SIZE (direct-I/O threshold: 64k, 1M, 65536), engine=uring|sync|auto,
        /// devices=GLOB,GLOB (LUN discovery; no LUN found refuses the mount unless
        /// allow_proxied_only), tls_ca=, tls_cert=, tls_key=, tls_domain=,
        /// client_name=, metrics=ADDR:PORT (Prometheus), device_retry=5s (probe a LUN
        /// poisoned by a failed write again after this), rescan=30s (read the volume again
        /// and look for missing LUNs this often), log=FILE|syslog|stderr,
        /// log_level=LEVEL, writeback=SIZE (write-back cache of small buffered writes; 0:
        /// off), writeback_file=SIZE, writeback_age=DURATION, read_cache=SIZE (0: off),
        /// page_cache=on|off (files opened for reading only in the kernel's page cache);
        /// mount(8)'s generic ones (_netdev, defaults, x-*, ...) are ignored.
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
    /// As root: make 4 file-backed LUNs (loop devices), format a striped volume, start
    /// sanfs-mds and an agent, and mount at MOUNTPOINT; `--down` undoes exactly that.
    Quickstart {
        mountpoint: PathBuf,
        /// Unmount, stop and remove what the quickstart in --state-dir made.
        #[arg(long)]
        down: bool,
        /// Holds the LUN files, metadata store, logs and the state file.
        #[arg(
            long,
            env = "SANFS_QUICKSTART_DIR",
            default_value = "/var/tmp/sanfs-quickstart"
        )]
        state_dir: PathBuf,
        /// The server's port on 127.0.0.1.
        #[arg(long, env = "SANFS_QUICKSTART_PORT", default_value_t = 7410)]
        port: u16,
        /// The server's Prometheus port on 127.0.0.1.
        #[arg(long, env = "SANFS_QUICKSTART_METRICS_PORT", default_value_t = 9410)]
        metrics_port: u16,
        /// Size of each LUN file (sparse): 1G, 512M, ...
        #[arg(long, env = "SANFS_QUICKSTART_LUN_SIZE", default_value = "1G")]
        lun_size: String,
        /// The sanfs-mds binary (default: next to this one, else on PATH).
        #[arg(long, env = "SANFS_MDS")]
        mds: Option<PathBuf>,
    },
}

fn main() -> std::process::ExitCode {
    let mut args = std::env::args();
    let argv0 = args.next().unwrap_or_default();
    if mount_helper::is_helper_name(&argv0) {
        let rest: Vec<String> = args.collect();
        return std::process::ExitCode::from(mount_helper::helper_main(&rest));
    }
    let cli = Cli::parse();
    // A foreground mount logs where its options say; everything else to stderr.
    let (target, level) = match &cli.command {
        Command::Mount {
            options,
            foreground: true,
            ..
        } => parse_options(options)
            .map(|o| (o.log.unwrap_or(LogTarget::Stderr), o.log_level))
            .unwrap_or((LogTarget::Stderr, None)),
        _ => (LogTarget::Stderr, None),
    };
    if let Err(e) = logging::init(&target, level.as_deref()) {
        // Nothing was installed: fall back to stderr and say why.
        let _ = logging::init(&LogTarget::Stderr, level.as_deref());
        tracing::warn!("{e:#}: logging to stderr instead");
    }
    let foreground_mount = matches!(
        cli.command,
        Command::Mount {
            foreground: true,
            ..
        }
    );
    let r = match cli.command {
        Command::Mount {
            source,
            mountpoint,
            options,
            foreground,
        } => mount(&source, &mountpoint, &options, foreground),
        Command::Umount { mountpoint, lazy } => umount_and_wait(&mountpoint, lazy),
        Command::Bmap { path, json } => bmap(&path, json),
        Command::Status { mountpoint, json } => status(mountpoint.as_deref(), json),
        Command::Quickstart {
            mountpoint,
            down,
            state_dir,
            port,
            metrics_port,
            lun_size,
            mds,
        } => {
            if down {
                quickstart::down(&mountpoint, &state_dir)
            } else {
                sanfs_client_agent::mount_options::parse_size(&lun_size)
                    .context("--lun-size")
                    .and_then(|lun_size| {
                        quickstart::up(&quickstart::Options {
                            mountpoint,
                            state_dir,
                            port,
                            metrics_port,
                            lun_size,
                            mds,
                        })
                    })
            }
        }
    };
    match r {
        Ok(()) => std::process::ExitCode::SUCCESS,
        // The agent's own failure goes to its log; a command's to the person who ran it.
        Err(e) if foreground_mount => {
            tracing::error!("{e:#}");
            std::process::ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("sanfs-agent: {e:#}");
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
    rustix::mount::unmount(mountpoint, flags).map_err(|e| {
        // umount(2) says EINVAL for a path that is not a mount point: say that.
        let why = match e {
            rustix::io::Errno::INVAL => " (it is not a mount point)",
            rustix::io::Errno::NOENT => " (no such directory)",
            rustix::io::Errno::BUSY => " (busy: files are open there; -l detaches it lazily)",
            _ => "",
        };
        anyhow::Error::new(e).context(format!("unmount {}{why}", mountpoint.display()))
    })
}

/// `sanfs-agent umount`: unmounts and then waits (at most 10 s) for the mount's agent to
/// exit, so that whatever it held (its metrics port) is free when this returns: an immediate
/// mount again with the same `metrics=` succeeds. A lazy unmount does not wait (a busy mount
/// keeps its agent).
fn umount_and_wait(mountpoint: &Path, lazy: bool) -> anyhow::Result<()> {
    let agent = std::fs::canonicalize(mountpoint).ok().and_then(|mp| {
        let e = control::fuse_mounts()
            .ok()?
            .into_iter()
            .find(|m| m.mount_point == mp)?;
        let socket = control::socket_path(&control::run_dir(), e.major, e.minor);
        Some(control::ask(&socket, &Request::Status).ok()?.status?.pid)
    });
    umount(mountpoint, lazy)?;
    if let Some(pid) = agent.filter(|_| !lazy) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while process_lives(pid) {
            if Instant::now() >= deadline {
                tracing::warn!(pid, "unmounted; the agent has not exited after 10 s");
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    Ok(())
}

/// Whether process `pid` still runs (a zombie has exited: it holds nothing any more).
fn process_lives(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        // The state follows the command name in parentheses, which may itself hold spaces.
        s.rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state != "Z" && state != "X")
    })
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
    if opts.remount {
        bail!("remount: use mount -o remount (mount.sanfs) on a live mount");
    }
    if !foreground {
        let log = opts
            .log
            .clone()
            .unwrap_or_else(|| logging::default_daemon_target(&mountpoint));
        let exe = std::env::current_exe().context("find this executable")?;
        let pid = mount_helper::spawn_agent(&exe, source, &mountpoint, raw_options, &log)?;
        eprintln!(
            "sanfs-agent: {source} mounted at {} (agent pid {pid}, log {})",
            mountpoint.display(),
            mount_helper::describe_log(&log)
        );
        return Ok(());
    }

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(opts.threads.unwrap_or_else(default_threads))
        .enable_all()
        .build()
        .context("start the tokio runtime")?;
    // Before the client: the engine's latency histograms register with the recorder. Always:
    // the control socket serves the metrics too (`sanfs-csi --metrics` gathers them there).
    sanfs_client_agent::metrics::install();
    let metrics_listener = match opts.metrics {
        Some(addr) => Some(
            runtime
                .block_on(tokio::net::TcpListener::bind(addr))
                .with_context(|| format!("bind the metrics listener {addr}"))?,
        ),
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
    config.rescan_interval = opts.rescan_interval;
    config.direct_io_threshold = opts.direct_io_threshold;
    config.writeback = opts.writeback;
    config.dirsync = opts.dirsync;
    config.async_creates = opts.async_creates;
    config.accept_epoch_regression = opts.accept_epoch_regression;
    config.retry = opts.retry;
    config.require_luns = !opts.allow_proxied_only;
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
    let metrics_server = metrics_listener.map(|l| {
        tracing::info!(addr = ?l.local_addr().ok(), "metrics listening");
        runtime.spawn(sanfs_client_agent::metrics::serve(l, Arc::clone(&client)))
    });
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
            page_cache: opts.page_cache,
            write_behind: opts.write_behind,
        },
        runtime.handle().clone(),
    );
    let page_cache = fs.page_cache_slot();
    let mut fuse_config = Config::default();
    fuse_config.mount_options = vec![
        MountOption::FSName(format!("{server}:{subdir}")),
        MountOption::Subtype("sanfs".to_owned()),
        if opts.read_only {
            MountOption::RO
        } else {
            MountOption::RW
        },
        // The kernel checks every access against the attributes it holds (refreshed when
        // their TTL has passed), as for a local file system: also through cached dentries,
        // where no lookup reaches the agent, and for FIFOs, sockets and device nodes, whose
        // opens never do (docs/posix.md, "Permissions").
        MountOption::DefaultPermissions,
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
    // Our own mount call: the mount's type is `fuse.sanfs` (see `kernel_mount`).
    let dev = kernel_mount(
        &mountpoint,
        &format!("{server}:{subdir}"),
        opts.read_only,
        opts.allow_other,
    )
    .with_context(|| format!("mount at {}", mountpoint.display()))?;
    // Names under leases may be kept by the kernel where a recall can make it forget them
    // without a lock (see `client::leases`).
    match dev.try_clone() {
        Ok(epoch) => match sanfs_client_agent::fuse::bump_name_epoch(&epoch) {
            Ok(()) => client
                .leases()
                .set_kernel_names_invalidator(Box::new(move || {
                    if let Err(e) = sanfs_client_agent::fuse::bump_name_epoch(&epoch) {
                        tracing::warn!(error = %e, "FUSE_NOTIFY_INC_EPOCH");
                    }
                })),
            Err(e) => tracing::info!(
                error = %e,
                "the kernel cannot forget names without a lock (FUSE_NOTIFY_INC_EPOCH): \
                 every path walk asks the agent"
            ),
        },
        Err(e) => tracing::warn!(error = %e, "dup /dev/fuse"),
    }
    let acl = fuse_config.acl;
    let session = match fuser::Session::from_fd(fs, dev, acl, fuse_config) {
        Ok(s) => s,
        Err(e) => {
            let _ = umount(&mountpoint, true);
            return Err(e).with_context(|| format!("start FUSE at {}", mountpoint.display()));
        }
    };
    // The kernel's cached attributes (a lease recall) and pages (`fuse::pages`) of an inode
    // are invalidated through the session's notifier, never from a FUSE thread. `offset`
    // -1: the attributes only; `len` 0: to the end of the file.
    let notifier = session.notifier();
    let inval = Arc::new(
        move |ino: sanfs_proto::types::InodeId, offset: i64, len: i64| {
            let fuse = fuser::INodeNo(sanfs_client_agent::fuse::sanfs_ino(root, ino.0).0);
            if let Err(e) = notifier.inval_inode(fuse, offset, len) {
                // Not known to the kernel (forgotten): nothing cached there.
                tracing::trace!(ino = ino.0, offset, error = %e, "inval_inode");
            }
        },
    );
    let pages = Arc::clone(&inval);
    page_cache.install(Box::new(move |ino, offset: u64, len: u64| {
        pages(
            ino,
            i64::try_from(offset).unwrap_or(i64::MAX),
            i64::try_from(len).unwrap_or(0),
        );
    }));
    client
        .leases()
        .set_kernel_invalidator(Box::new(move |ino| inval(ino, -1, 0)));
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
    // Under systemd (Type=notify): started means mounted.
    if let Err(e) = sd_notify::notify(
        false,
        &[
            sd_notify::NotifyState::Ready,
            sd_notify::NotifyState::Status("mounted"),
        ],
    ) {
        tracing::warn!(error = %e, "could not tell systemd that the mount is ready");
    }
    let signalled = runtime.block_on(async {
        tokio::select! {
            _ = done_rx => false,
            _ = term.recv() => true,
            _ = int.recv() => true,
        }
    });
    let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Stopping]);
    if signalled {
        tracing::info!(mountpoint = %mountpoint.display(), "signalled: unmounting");
        if let Err(e) = umount(&mountpoint, false) {
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
    // The control socket's and the metrics' servers hold the client: stopped first.
    let control_server = control_socket.map(|(path, server)| {
        let _ = std::fs::remove_file(path);
        server
    });
    for server in control_server.into_iter().chain(metrics_server) {
        server.abort();
        let _ = runtime.block_on(server);
    }
    // The file system's tasks may still hold the client for a moment; the session is ended
    // in any case (else it, its leases and grants stay at the server until its lease runs
    // out, and another node's change that recalls one of them waits that long).
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
                Err(c) => {
                    tracing::warn!("tasks still hold the client: ending its session under them");
                    return tokio::time::timeout(Duration::from_secs(5), c.end_session()).await;
                }
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

/// The agent's async workers: one per core, from 2 to 4. More workers than cores only add
/// wake-ups and switches to each request's path (a lone process's creates and unlinks went
/// 15-25% faster with 2 workers than with 4 on a 2-core machine); more than 4 do not help
/// the FUSE threads and the I/O engine, which have threads of their own.
/// Binds this mount's control socket (named by the mount's device number, read from
/// mountinfo, so that no request to the mount itself is needed) and serves it. A failure is
/// logged, not fatal: the mount works without `status` and `bmap`.
fn start_control(
    runtime: &tokio::runtime::Runtime,
    ctx: ControlContext,
) -> Option<(PathBuf, tokio::task::JoinHandle<()>)> {
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
    widen_read_ahead(entry.major, entry.minor);
    let dir = control::run_dir();
    let _guard = runtime.enter();
    match control::bind(&dir, entry.major, entry.minor) {
        Ok((listener, path)) => {
            tracing::info!(socket = %path.display(), "control socket listening");
            let server = runtime.spawn(control::serve(listener, Arc::new(ctx)));
            Some((path, server))
        }
        Err(e) => {
            tracing::warn!(error = %format!("{e:#}"), "no control socket");
            None
        }
    }
}

/// The kernel reads ahead of a file in the page cache by the mount's `read_ahead_kb`, 128 KiB
/// by default (FUSE takes the smaller of it and the 1 MiB the agent allows): 1 MiB makes a
/// sequential reader's requests as large as FUSE carries (a quarter of the requests for the
/// same bytes). Needs root; otherwise the default stays.
fn widen_read_ahead(major: u32, minor: u32) {
    let knob = format!("/sys/class/bdi/{major}:{minor}/read_ahead_kb");
    let kib = sanfs_client_agent::fuse::MAX_IO_BYTES / 1024;
    if let Err(e) = std::fs::write(&knob, kib.to_string()) {
        tracing::info!(knob, error = %e, "read-ahead of cached files stays the kernel's default");
    }
}

/// Writes a command's output; a reader that went away (`| head`) is not an error.
fn out(text: &str) -> anyhow::Result<()> {
    use std::io::Write as _;
    match std::io::stdout().lock().write_all(text.as_bytes()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        r => r.context("write to stdout"),
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
        out(&format!(
            "{}\n",
            serde_json::to_string_pretty(&reply.entries)?
        ))?;
    } else {
        out(&format_bmap(path, &reply))?;
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
        // A mount point is found in the mount table without a stat of it, which would wait
        // for the server when it does not answer (the time `status` is most wanted).
        let listed = std::path::absolute(mp).ok().and_then(|abs| {
            control::sanfs_mounts()
                .ok()?
                .into_iter()
                .find(|e| e.mount_point == abs)
        });
        let entry = match listed {
            Some(e) => e,
            None => control::mount_of(mp)?.0,
        };
        let st = ask(&entry)?;
        if json {
            out(&format!("{}\n", serde_json::to_string_pretty(&st)?))?;
        } else {
            out(&format_status(&st))?;
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
        out(&format!("{}\n", serde_json::to_string_pretty(&all)?))?;
    } else if all.is_empty() && failed == 0 {
        out("no sanfs mounts\n")?;
    } else {
        for st in &all {
            out(&format_status(st))?;
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
    if let Some(why) = &a.epoch_refused {
        let _ = writeln!(out, "  EPOCH      REFUSED: {why}");
    }
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
    if found == 0 && !a.devices.is_empty() {
        let _ = writeln!(
            out,
            "  WARN       none of the volume's LUNs is found on this node: every byte goes \
             through the server (mounted with allow_proxied_only)"
        );
    }
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
        "  grants     read {} write {}; reads from cached grants {}, writes in cached layouts {}, layouts asked ahead {} ({} cached now); recalls {}",
        g.read, g.write, g.cached_reads, g.layout_writes, g.layouts_ahead, g.cached_now, g.recalls
    );
    let l = &a.leases;
    let _ = writeln!(
        out,
        "  leases     stat hits {} misses {}; lookup hits {} misses {}; xattr hits {} misses {}; access hits {} misses {}; small files opened with their bytes {} (kept with what this node wrote {}), reads from them {}; opens answered here {} (made at the server later {}); listings from the cache {} (not {}); recalls {}; renewed {} (lost {}); cached now {} attributes, {} names",
        l.attr_hits,
        l.attr_misses,
        l.entry_hits,
        l.entry_misses,
        l.xattr_hits,
        l.xattr_misses,
        l.access_hits,
        l.access_misses,
        l.small_file_opens,
        l.small_files_written,
        l.small_file_reads,
        a.opens_here,
        a.opens_made_later,
        l.listing_hits,
        l.listing_misses,
        l.recalls,
        l.renewed,
        l.renew_lost,
        l.attrs_now,
        l.names_now
    );
    let c = &a.creates;
    let _ = writeln!(
        out,
        "  creates    answered here {} (refused by the server after: {}), not answered by the server yet {}; unlinks answered here {} (refused after: {}), renames {} ({}), directory attribute changes {} ({}), not answered yet {}",
        c.here,
        c.lost,
        c.unanswered_now,
        c.unlinks_here,
        c.unlinks_lost,
        c.renames_here,
        c.renames_lost,
        c.attrs_here,
        c.attrs_lost,
        c.changes_unanswered_now
    );
    let w = &a.write_back;
    let _ = writeln!(
        out,
        "  write-back held now {} bytes; writes held {}, attribute changes held {} (sent in {}, with the bytes {}), write-backs {} ({} bytes), recalls that wrote back {}; delegations {} (refused {}, reclaimed after a restart {})",
        w.dirty_bytes,
        w.held_writes,
        w.held_attrs,
        w.attr_flushes,
        w.attrs_with_bytes,
        w.flushes,
        w.flushed_bytes,
        w.recalls_flushed,
        w.delegations,
        w.refusals,
        w.reclaimed
    );
    let _ = writeln!(
        out,
        "  read cache {} bytes; hits {}, misses {}, read-aheads {}",
        w.cached_bytes, w.cache_hits, w.cache_misses, w.read_aheads
    );
    let busy: Vec<_> = a.stages.iter().filter(|s| s.calls > 0).collect();
    if !busy.is_empty() {
        let _ = writeln!(
            out,
            "  stages     (calls, MiB, wall ms, thread CPU ms; see docs/performance.md)"
        );
        for s in busy {
            let _ = writeln!(
                out,
                "    {:<17} {:>10} {:>10.1} {:>10.1} {:>10.1}",
                s.stage,
                s.calls,
                s.bytes as f64 / 1_048_576.0,
                s.wall_ns as f64 / 1e6,
                s.cpu_ns as f64 / 1e6
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]

    use super::*;

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
}
