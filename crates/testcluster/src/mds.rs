//! A sanfs file system for tests and the bench, made the way an operator makes one, in one
//! place: LUN files ([`file_luns`]), formatted as a volume with the metadata store created for
//! it ([`format`]: what `sanfs-mds format` does), the options of a plaintext test server
//! ([`serve_options`]), and `serve` started on a runtime ([`spawn_serve`]) or on a thread of
//! its own, in a node's network namespace if asked ([`ServeThread`]).
//!
//! Only with the `mds` feature (it links the metadata server). Everything here calls the
//! server's public API; errors carry context, and the tests unwrap them.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

use anyhow::{Context, bail};
use sanfs_mds::clock::Clock;
use sanfs_mds::config::{LayoutKindConfig, VolumeConfig};
use sanfs_mds::serve::{ServeOptions, serve};
use sanfs_mds::store::{Backend, FsInfo, Store};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::Netns;

const MIB: u64 = 1 << 20;

/// How long [`ServeThread::start`] waits for the server to listen.
const START_TIMEOUT: Duration = Duration::from_secs(60);

/// `count` sparse files of `size` bytes, `dir/lun0`, `dir/lun1`, ...: file LUNs.
pub fn file_luns(dir: &Path, count: usize, size: u64) -> anyhow::Result<Vec<PathBuf>> {
    (0..count)
        .map(|i| {
            let path = dir.join(format!("lun{i}"));
            std::fs::File::create(&path)
                .and_then(|f| f.set_len(size))
                .with_context(|| format!("make the LUN file {}", path.display()))?;
            Ok(path)
        })
        .collect()
}

/// The volume section of a server config for `luns` striped with `stripe_unit`, blocks of
/// `block_size`, data from 1 MiB (the defaults of `sanfs-mds format`).
pub fn striped(luns: &[PathBuf], block_size: u32, stripe_unit: u64) -> VolumeConfig {
    VolumeConfig {
        layout: LayoutKindConfig::Striped,
        block_size,
        stripe_unit,
        data_offset: MIB,
        devices: luns.to_vec(),
        lvm_vg: None,
        lvm_lv: None,
    }
}

/// What `sanfs-mds format --force` does: labels the LUNs of `volume` and creates the metadata
/// store for them on `backend` (replacing a store there). Returns what the store was made from.
pub fn format(volume: &VolumeConfig, backend: &Backend, clock: &Clock) -> anyhow::Result<FsInfo> {
    let formatted = sanfs_mds::format::format_volume(volume, true, 0).context("format the LUNs")?;
    let info = FsInfo {
        fs_uuid: formatted.fs_uuid,
        volume: formatted.volume,
        lvm: None,
    };
    Store::create(backend, &info, true, clock).context("create the metadata store")?;
    Ok(info)
}

/// A new metadata store for `info` on `backend`, replacing one there (no LUNs are written: for
/// tests of the store itself, whose volume need not exist, and the metadata benchmark).
pub fn create_store(backend: &Backend, info: &FsInfo, clock: &Clock) -> anyhow::Result<()> {
    Store::create(backend, info, true, clock).context("create the metadata store")
}

/// The options of a test server: `backend` served on `listen` over plaintext TCP (said
/// explicitly, docs/security.md: only the test's own clients reach it), every identity's
/// default access, no metrics or unix socket, a 64 KiB direct threshold, 10 s leases,
/// batches of 64, the LUNs at `data_devices` for the proxied path. Tests change fields.
pub fn serve_options(
    listen: SocketAddr,
    backend: Backend,
    data_devices: Vec<PathBuf>,
) -> ServeOptions {
    ServeOptions {
        listen,
        metrics_addr: None,
        listen_unix: None,
        insecure: true,
        access: sanfs_mds::service::identity::AccessConfig::default(),
        tls: None,
        direct_threshold: 64 * 1024,
        lease_ttl_ms: 10_000,
        grant_hold_limit_ms: None,
        batch_max: 64,
        settle_ms: 1000,
        backend,
        data_devices,
    }
}

/// `serve` spawned as a task: where it listens once it does, how to stop it, and its task.
pub struct Serving {
    ready: Option<oneshot::Receiver<SocketAddr>>,
    stop: Option<oneshot::Sender<()>>,
    /// The server's task; its result is `serve`'s.
    pub task: JoinHandle<anyhow::Result<()>>,
}

/// Spawns `serve(opts)` on the runtime of `rt`; it runs until [`Serving::stop`] (or until the
/// [`Serving`] is dropped).
pub fn spawn_serve(rt: &tokio::runtime::Handle, opts: ServeOptions, clock: Clock) -> Serving {
    let (ready_tx, ready_rx) = oneshot::channel();
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    let task = rt.spawn(serve(
        opts,
        clock,
        move |addr| {
            let _ = ready_tx.send(addr);
        },
        async move {
            let _ = stop_rx.await;
        },
    ));
    Serving {
        ready: Some(ready_rx),
        stop: Some(stop_tx),
        task,
    }
}

impl Serving {
    /// Where the server listens, once it does; an error (with `serve`'s own) if it ended
    /// without listening.
    pub async fn listening(&mut self) -> anyhow::Result<SocketAddr> {
        let Some(ready) = self.ready.take() else {
            bail!("listening() was asked already");
        };
        match ready.await {
            Ok(addr) => Ok(addr),
            Err(_) => match (&mut self.task).await {
                Ok(Ok(())) => bail!("serve ended before it listened"),
                Ok(Err(e)) => Err(e.context("serve did not start")),
                Err(e) => bail!("serve did not start: {e}"),
            },
        }
    }

    /// Tells the server to stop (returns at once; [`Serving::stop`] also waits).
    pub fn signal_stop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }

    /// Stops the server and waits for it; `serve`'s result.
    pub async fn stop(mut self) -> anyhow::Result<()> {
        self.signal_stop();
        (&mut self.task).await.context("the server's task")?
    }

    /// The stop signal and the task, for callers that stop and wait in their own way.
    pub fn into_parts(mut self) -> (Option<oneshot::Sender<()>>, JoinHandle<anyhow::Result<()>>) {
        (self.stop.take(), self.task)
    }
}

/// `serve` on a thread of its own (inside a node's network namespace when given one), on a
/// runtime of its own; started when it listens, stopped (and its thread joined) on
/// [`ServeThread::stop`] or drop.
pub struct ServeThread {
    /// Where it listens.
    pub addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<anyhow::Result<()>>>,
}

impl ServeThread {
    /// Starts `serve(opts)` on a thread named `name`, in `ns` when given, on a runtime with
    /// `workers` threads (0: a current-thread runtime); returns when it listens.
    pub fn start(
        ns: Option<&Netns>,
        name: &str,
        workers: usize,
        opts: ServeOptions,
        clock: Clock,
    ) -> anyhow::Result<ServeThread> {
        let (ready_tx, ready_rx) = mpsc::channel::<SocketAddr>();
        let (stop_tx, stop_rx) = oneshot::channel::<()>();
        let thread_name = name.to_owned();
        let run = move || -> anyhow::Result<()> {
            // A multi-thread runtime's workers start from this thread: they share its namespace.
            let rt = if workers == 0 {
                tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()?
            } else {
                tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(workers)
                    .thread_name(thread_name)
                    .enable_all()
                    .build()?
            };
            rt.block_on(serve(
                opts,
                clock,
                move |addr| {
                    let _ = ready_tx.send(addr);
                },
                async move {
                    let _ = stop_rx.await;
                },
            ))
        };
        let thread = match ns {
            Some(ns) => ns.run_thread(name, run)?,
            None => std::thread::Builder::new()
                .name(name.to_owned())
                .spawn(run)
                .context("start the server thread")?,
        };
        let mut server = ServeThread {
            addr: SocketAddr::from(([0, 0, 0, 0], 0)),
            stop: Some(stop_tx),
            thread: Some(thread),
        };
        match ready_rx.recv_timeout(START_TIMEOUT) {
            Ok(addr) => {
                server.addr = addr;
                Ok(server)
            }
            Err(_) => {
                let result = server.stop_and_join();
                bail!("the in-process server did not start within {START_TIMEOUT:?}: {result:?}")
            }
        }
    }

    /// Stops the server and joins its thread; `serve`'s result.
    pub fn stop(mut self) -> anyhow::Result<()> {
        self.stop_and_join()
    }

    fn stop_and_join(&mut self) -> anyhow::Result<()> {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        match self.thread.take().map(|t| t.join()) {
            None => Ok(()),
            Some(Ok(result)) => result,
            Some(Err(_)) => bail!("the server thread panicked"),
        }
    }
}

impl Drop for ServeThread {
    fn drop(&mut self) {
        if let Err(e) = self.stop_and_join() {
            eprintln!("the in-process server ended with an error: {e:#}");
        }
    }
}
