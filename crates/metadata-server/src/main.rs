//! The `sanfs-mds` command line: `format`, `serve`, `status`, `fsck`, `restore`, `volume inspect`.
//!
//! Errors print as `sanfs-mds: <error chain>` on stderr and exit with status 2 (clap's usage
//! errors also exit with 2). Logs go to stderr, filtered by `RUST_LOG` (default `info`).

use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};
use sanfs_blockmap::volume::LayoutKind;
use sanfs_mds::clock::Clock;
use sanfs_mds::config::{MdsConfig, MetadataKind, parse_size};
use sanfs_mds::format::{Formatted, format_volume_checked};
use sanfs_mds::inspect::inspect_with;
use sanfs_mds::serve::{ServeOptions, TlsPaths};
use sanfs_mds::store::{Backend, FsInfo, Store};

#[derive(Debug, Parser)]
#[command(name = "sanfs-mds", version, about = "sanfs metadata server")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Create a file system: label the LUNs (or read the LVM2 LV) and initialise the
    /// metadata store.
    Format {
        #[arg(long)]
        config: PathBuf,
        /// Overwrite devices that already hold a file system, a PV label or a sanfs label.
        #[arg(long)]
        force: bool,
    },
    /// Run the metadata server.
    Serve {
        #[arg(long)]
        config: PathBuf,
        /// Serve Prometheus metrics here (overrides server.metrics_addr).
        #[arg(long)]
        metrics_addr: Option<SocketAddr>,
        /// High availability: `etcd=URL[,URL...]` sets (or overrides) `ha.etcd`, the other
        /// `[ha]` settings keep their values or defaults.
        #[arg(long, value_name = "etcd=URL[,URL...]")]
        ha: Option<String>,
    },
    /// Who leads a high-availability pair and who stands by (asks etcd; needs `[ha]`), and
    /// the fencing epoch on the metadata LUN.
    Status {
        #[arg(long)]
        config: PathBuf,
        /// Print one JSON object on stdout.
        #[arg(long)]
        json: bool,
    },
    /// Check the metadata store against the volume (read-only: it never changes the store).
    Fsck {
        #[arg(long, required_unless_present = "backup")]
        config: Option<PathBuf>,
        /// Check a backup file (written by `sanfs-admin backup`) instead of the configured
        /// store: read-only, and the backup's record (file system, commit, time) is shown.
        #[arg(long, conflicts_with_all = ["config", "repair"])]
        backup: Option<PathBuf>,
        /// Repair: redb's recovery after an unclean shutdown, then leaked blocks back to free
        /// space, link counts, directory sizes and parents, block counts, the next inode
        /// number, quota usage, lost orphans, and inodes in no directory (to /lost+found).
        /// Problems it cannot fix stay listed.
        #[arg(long)]
        repair: bool,
        /// With --repair: list the repairs (made on a copy in memory) without changing the store.
        #[arg(long, requires = "repair")]
        dry_run: bool,
        /// Print the report (or the repair report) as one JSON object on stdout.
        #[arg(long)]
        json: bool,
    },
    /// Install a backup (written by `sanfs-admin backup`) as the metadata store, with the
    /// server stopped: the backup must be clean and of this file system (its LUNs' labels, the
    /// existing store). Changes made after the backup are lost (docs/operations.md).
    Restore {
        #[arg(long)]
        config: PathBuf,
        /// The backup file.
        backup: PathBuf,
        /// Replace the metadata store that exists (of the same file system).
        #[arg(long)]
        force: bool,
    },
    /// Look at volumes and devices.
    Volume {
        #[command(subcommand)]
        command: VolumeCommand,
    },
}

#[derive(Debug, Subcommand)]
enum VolumeCommand {
    /// Show what each device holds; with --map, where a volume byte offset lands.
    Inspect {
        #[arg(required = true)]
        devices: Vec<PathBuf>,
        /// A volume byte offset (a number, or with a binary suffix: 1M, 4GiB).
        #[arg(long, value_parser = parse_size)]
        map: Option<u64>,
        /// For --map on an LVM2 volume group with several LVs: the LV to map.
        #[arg(long)]
        lv: Option<String>,
        /// Print what was found as one JSON object on stdout.
        #[arg(long)]
        json: bool,
    },
}

fn main() -> ExitCode {
    init_logging();
    let cli = Cli::parse();
    match run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("sanfs-mds: {e:#}");
            ExitCode::from(2)
        }
    }
}

fn init_logging() {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
}

fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Format { config, force } => format(&config, force),
        Command::Serve {
            config,
            metrics_addr,
            ha,
        } => serve(&config, metrics_addr, ha.as_deref()),
        Command::Status { config, json } => ha_status(&config, json),
        Command::Fsck {
            config,
            backup: Some(backup),
            json,
            ..
        } => {
            drop(config);
            fsck_backup(&backup, json)
        }
        Command::Fsck {
            config: Some(config),
            repair,
            dry_run,
            json,
            ..
        } => fsck(&config, repair, dry_run, json),
        Command::Fsck { .. } => anyhow::bail!("fsck needs --config or --backup"),
        Command::Restore {
            config,
            backup,
            force,
        } => restore(&config, &backup, force),
        Command::Volume {
            command:
                VolumeCommand::Inspect {
                    devices,
                    map,
                    lv,
                    json,
                },
        } => {
            let mut out = std::io::stdout().lock();
            if json {
                let report = sanfs_mds::inspect::inspect_json(&devices, map, lv.as_deref())?;
                serde_json::to_writer_pretty(&mut out, &report)?;
                writeln!(out)?;
            } else {
                inspect_with(&devices, map, lv.as_deref(), &mut out)?;
            }
            out.flush()?;
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// Runs the server until SIGINT or SIGTERM (exit 0) or a fatal error such as a failed
/// metadata commit (exit 2: fail-stop; restart to recover).
fn serve(
    config_path: &Path,
    metrics_addr: Option<SocketAddr>,
    ha_flag: Option<&str>,
) -> anyhow::Result<ExitCode> {
    let mut config = MdsConfig::load(config_path)?;
    if let Some(flag) = ha_flag {
        apply_ha_flag(&mut config, flag)?;
    }
    let ha = config.ha_options();
    let opts = ServeOptions {
        listen: config.server.listen,
        metrics_addr: metrics_addr.or(config.server.metrics_addr),
        listen_unix: config.server.listen_unix.clone(),
        insecure: config.server.insecure,
        access: config.access(),
        tls: config.tls.as_ref().map(|t| TlsPaths {
            cert: t.cert.clone(),
            key: t.key.clone(),
            ca: t.ca.clone(),
        }),
        direct_threshold: config.server.direct_threshold,
        lease_ttl_ms: config.server.lease_ttl_ms,
        grant_hold_limit_ms: config.server.grant_hold_limit_ms,
        batch_max: config.server.commit_batch_max,
        settle_ms: config.server.settle_ms,
        backend: metadata_backend(&config),
        data_devices: config.volume.devices.clone(),
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(config.server.worker_threads())
        .enable_all()
        .thread_name("sanfs-mds")
        .build()
        .context("start the async runtime")?;
    runtime.block_on(async move {
        let shutdown = async {
            let mut term =
                match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                    Ok(t) => t,
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot watch SIGTERM; stop with SIGINT");
                        let _ = tokio::signal::ctrl_c().await;
                        return;
                    }
                };
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            tracing::info!("stopping");
            let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Stopping]);
        };
        match ha {
            Some(ha) => {
                let on_standby = || notify_systemd("standby: campaigning to lead");
                let ready = |addr: SocketAddr, epoch: u64| {
                    tracing::info!(%addr, fencing_epoch = epoch, "serving");
                    notify_systemd(&format!("leader (epoch {epoch}): serving"));
                };
                let serving = sanfs_mds::serve::serve_ha(
                    opts,
                    ha,
                    Clock::System,
                    on_standby,
                    ready,
                    shutdown,
                );
                serving.await
            }
            None => {
                sanfs_mds::serve::refuse_claimed_device(&opts.backend)?;
                let ready = |addr: SocketAddr| {
                    tracing::info!(%addr, "serving");
                    notify_systemd("serving");
                };
                sanfs_mds::serve::serve(opts, Clock::System, ready, shutdown).await
            }
        }
    })?;
    Ok(ExitCode::SUCCESS)
}

/// `--ha etcd=URL[,URL...]` onto the config (a new `[ha]` with defaults if it has none).
fn apply_ha_flag(config: &mut MdsConfig, flag: &str) -> anyhow::Result<()> {
    let Some(urls) = flag.strip_prefix("etcd=") else {
        anyhow::bail!("--ha takes etcd=URL[,URL...], not {flag:?}");
    };
    let etcd: Vec<String> = urls.split(',').map(str::to_owned).collect();
    match &mut config.ha {
        Some(ha) => ha.etcd = etcd,
        None => {
            let text = format!("etcd = {etcd:?}");
            config.ha = Some(toml::from_str(&text).context("--ha")?);
        }
    }
    config.validate().context("--ha")
}

/// `sanfs-mds status`: the HA pair as etcd and the metadata LUN see it.
fn ha_status(config_path: &Path, json: bool) -> anyhow::Result<ExitCode> {
    let config = MdsConfig::load(config_path)?;
    let Some(ha) = config.ha_options() else {
        anyhow::bail!(
            "{} has no [ha] section: a single server (sanfs-admin status shows its state)",
            config_path.display()
        );
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("start the async runtime")?;
    let mut status = runtime.block_on(sanfs_mds::ha::status(&ha))?;
    status.device_epoch = sanfs_mds::store::device::read_device_header(&config.metadata.path)
        .map(|h| h.epoch)
        .map_err(|e| tracing::warn!(error = %e, "read the metadata device header"))
        .ok();
    let mut out = std::io::stdout().lock();
    if json {
        serde_json::to_writer_pretty(&mut out, &status)?;
        writeln!(out)?;
    } else {
        writeln!(out, "election: {}", status.election)?;
        match (&status.leader, status.epoch) {
            (Some(l), Some(e)) => writeln!(out, "leader:   {l} (epoch {e})")?,
            _ => writeln!(out, "leader:   none")?,
        }
        let standbys = if status.standbys.is_empty() {
            "none".to_owned()
        } else {
            status.standbys.join(", ")
        };
        writeln!(out, "standbys: {standbys}")?;
        match status.device_epoch {
            Some(e) => writeln!(out, "metadata LUN epoch: {e}")?,
            None => writeln!(out, "metadata LUN epoch: unreadable")?,
        }
    }
    out.flush()?;
    Ok(ExitCode::SUCCESS)
}

/// Tells systemd (Type=notify) that the server is ready (a standby is ready too: it waits to
/// lead) and what it is doing, when it runs under systemd.
fn notify_systemd(status: &str) {
    let states = [
        sd_notify::NotifyState::Ready,
        sd_notify::NotifyState::Status(status),
    ];
    if let Err(e) = sd_notify::notify(false, &states) {
        tracing::warn!(error = %e, "could not tell systemd that the server is ready");
    }
}

fn format(config_path: &Path, force: bool) -> anyhow::Result<ExitCode> {
    let config = MdsConfig::load(config_path)?;
    let backend = metadata_backend(&config);
    // The store is checked after the devices and before any label is written, so that a
    // refused format changes nothing.
    let store_check = || -> anyhow::Result<()> {
        if force {
            return Ok(());
        }
        let exists = match &backend {
            Backend::File(path) => path.exists() && std::fs::metadata(path)?.len() > 0,
            Backend::Device(path) | Backend::FencedDevice(path, _) => {
                sanfs_mds::store::device::is_metadata_device(path)
                    .with_context(|| format!("read the metadata device {}", path.display()))?
            }
            Backend::Sim(_) => false,
        };
        if exists {
            anyhow::bail!(
                "metadata store {} already exists; nothing was written (use --force to replace it)",
                config.metadata.path.display()
            );
        }
        Ok(())
    };
    let formatted = format_volume_checked(&config.volume, force, now_unix_secs(), store_check)?;
    let info = FsInfo {
        fs_uuid: formatted.fs_uuid,
        volume: formatted.volume.clone(),
        lvm: formatted.lvm.clone(),
    };
    Store::create(&backend, &info, force, &Clock::System).with_context(|| {
        format!(
            "initialise the metadata store {}",
            config.metadata.path.display()
        )
    })?;
    print_summary(&formatted, &mut std::io::stdout().lock())?;
    println!("metadata store: {}", config.metadata.path.display());
    Ok(ExitCode::SUCCESS)
}

fn metadata_backend(config: &MdsConfig) -> Backend {
    match config.metadata.kind {
        MetadataKind::File => Backend::File(config.metadata.path.clone()),
        MetadataKind::Block => Backend::Device(config.metadata.path.clone()),
    }
}

/// Exit codes of `fsck` (docs/operations.md): 0 clean (after `--repair`: clean now); 1 problems
/// found (listed); 2 could not run, or the store is damaged; 3 the store needs redb's repair
/// (not shut down cleanly; plain fsck only); 4 the store is in use by a running server.
fn fsck(config_path: &Path, repair: bool, dry_run: bool, json: bool) -> anyhow::Result<ExitCode> {
    use sanfs_mds::store::StoreError;
    let config = MdsConfig::load(config_path)?;
    let backend = metadata_backend(&config);
    let print = |text: String, value: anyhow::Result<String>| -> anyhow::Result<()> {
        println!("{}", if json { value? } else { text });
        Ok(())
    };
    let after = if repair {
        let now = sanfs_proto::types::Timestamp::new(now_unix_secs(), 0)
            .context("the time for /lost+found")?;
        match sanfs_mds::fsck::repair(&backend, dry_run, now) {
            Ok(r) => {
                print(
                    r.to_string(),
                    serde_json::to_string_pretty(&r).map_err(Into::into),
                )?;
                Ok(r.after.is_clean())
            }
            Err(e) => Err(e),
        }
    } else {
        match sanfs_mds::fsck::check(&backend) {
            Ok(r) => {
                print(
                    r.to_string(),
                    serde_json::to_string_pretty(&r).map_err(Into::into),
                )?;
                Ok(r.is_clean())
            }
            Err(e) => Err(e),
        }
    };
    let path = config.metadata.path.display();
    match after {
        Ok(true) => Ok(ExitCode::SUCCESS),
        Ok(false) => Ok(ExitCode::from(1)),
        Err(e @ StoreError::NeedsRepair) => {
            eprintln!("sanfs-mds: {path}: {e}");
            Ok(ExitCode::from(3))
        }
        Err(e @ StoreError::InUse) => {
            eprintln!("sanfs-mds: {path}: {e}");
            Ok(ExitCode::from(4))
        }
        Err(e) => Err(anyhow::Error::new(e).context(format!("read the metadata store {path}"))),
    }
}

/// `fsck --backup FILE`: the exit codes of `fsck` (2: not readable as a store).
fn fsck_backup(path: &Path, json: bool) -> anyhow::Result<ExitCode> {
    use sanfs_mds::store::StoreError;
    match sanfs_mds::backup::check_backup(path) {
        Ok((report, record)) => {
            if json {
                let value = serde_json::json!({
                    "backup": record.as_ref().map(|b| serde_json::json!({
                        "fs_uuid": b.fs_uuid.to_string(),
                        "epoch": b.boot_epoch,
                        "commit_epoch": b.commit_epoch,
                        "commit_seq": b.commit_seq,
                        "taken_at": b.taken_at.sec,
                        "server_version": b.server_version,
                    })),
                    "report": report,
                });
                println!("{}", serde_json::to_string_pretty(&value)?);
            } else {
                match &record {
                    Some(b) => println!(
                        "backup of fs {} taken at {} (Unix seconds) in server epoch {}, last commit {}/{}, by sanfs-mds {}",
                        b.fs_uuid,
                        b.taken_at.sec,
                        b.boot_epoch,
                        b.commit_epoch,
                        b.commit_seq,
                        b.server_version
                    ),
                    None => println!(
                        "{}: a metadata store with no backup record (not written by sanfs-admin backup)",
                        path.display()
                    ),
                }
                println!("{report}");
            }
            Ok(if report.is_clean() {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            })
        }
        Err(e @ StoreError::NeedsRepair) => {
            eprintln!("sanfs-mds: {}: {e}", path.display());
            Ok(ExitCode::from(3))
        }
        Err(e @ StoreError::InUse) => {
            eprintln!("sanfs-mds: {}: {e}", path.display());
            Ok(ExitCode::from(4))
        }
        Err(e) => Err(anyhow::Error::new(e).context(format!("read the backup {}", path.display()))),
    }
}

/// `restore`: exit 0 restored, 2 refused or failed (the reason on stderr), 4 the store is in
/// use by a running server.
fn restore(config_path: &Path, backup: &Path, force: bool) -> anyhow::Result<ExitCode> {
    use sanfs_mds::backup::RestoreError;
    let config = MdsConfig::load(config_path)?;
    let backend = metadata_backend(&config);
    let store = config.metadata.path.display();
    match sanfs_mds::backup::restore(backup, &backend, &config.volume.devices, force) {
        Ok(done) => {
            let b = &done.record;
            println!(
                "restored {} into the metadata store {store}: fs {}, taken at {} (Unix seconds), last commit {}/{}, {} inodes",
                backup.display(),
                b.fs_uuid,
                b.taken_at.sec,
                b.commit_epoch,
                b.commit_seq,
                done.report.inodes
            );
            match done.replaced {
                Some(true) => {
                    println!("replaced the store that was there (of the same file system)")
                }
                Some(false) => println!("replaced a store that could not be read"),
                None => {}
            }
            println!(
                "LUN labels checked: {}; next server epoch: {}; restores of this store: {}; fsck of the restored store: clean",
                done.labels_matched,
                done.boot_epoch + 1,
                done.restores
            );
            for lun in &done.not_in_volume {
                println!(
                    "warning: {} is labelled for this file system but is not in the backup's volume (added after the backup): its data is not reachable; see docs/operations.md",
                    lun.display()
                );
            }
            println!(
                "changes made after the backup are gone: files created since do not exist, and blocks allocated since are free again"
            );
            println!(
                "agents still mounted refuse the restored server (its restore count changed under them): unmount and mount them again"
            );
            Ok(ExitCode::SUCCESS)
        }
        Err(e @ RestoreError::InUse(_)) => {
            eprintln!("sanfs-mds: {store}: {e}");
            Ok(ExitCode::from(4))
        }
        Err(e) => {
            eprintln!("sanfs-mds: restore {}: {e}", backup.display());
            Ok(ExitCode::from(2))
        }
    }
}

/// Wall-clock seconds for the labels' `formatted_at`. This is the one place the binary reads
/// the clock; the library takes the time as an argument.
#[allow(
    clippy::disallowed_methods,
    reason = "the CLI entry point is the clock seam"
)]
fn now_unix_secs() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}

fn print_summary(f: &Formatted, out: &mut impl Write) -> std::io::Result<()> {
    writeln!(out, "fs uuid: {}", f.fs_uuid)?;
    match f.volume.kind() {
        LayoutKind::Linear => writeln!(out, "layout: linear")?,
        LayoutKind::Striped { stripe_unit, width } => writeln!(
            out,
            "layout: striped, {width} devices, stripe unit {stripe_unit}"
        )?,
        LayoutKind::Lvm { vg_name, lv_name } => {
            writeln!(out, "layout: lvm, logical volume {vg_name}/{lv_name}")?
        }
    }
    writeln!(out, "block size: {}", f.volume.block_size())?;
    for (i, dev) in f.volume.devices().iter().enumerate() {
        let path = f
            .device_paths
            .get(i)
            .map_or_else(String::new, |p| p.display().to_string());
        writeln!(
            out,
            "device {i}: {} {path} {} bytes",
            dev.uuid, dev.size_bytes
        )?;
    }
    writeln!(
        out,
        "total: {} bytes ({} blocks)",
        f.volume.size_bytes(),
        f.volume.size_blocks()
    )
}
