//! The synchronous backend, for kernels without `io_uring`: `preadv`/`pwritev` on one
//! thread per device, every device's chunks handed to its thread before any is awaited.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex, mpsc};
use std::thread::JoinHandle;

use sanfs_blockmap::volume::DeviceIndex;
use tokio::sync::oneshot;

use super::batch::{BatchResults, BufPtr, Chunk, Next, judge, prepare};
use super::{Completed, DeviceOp, DeviceState, IoErrKind, OpKind};
use crate::buf::AlignedBuf;

struct SyncBatch {
    base: BufPtr,
    inner: Mutex<SyncBatchInner>,
}

struct SyncBatchInner {
    buf: Option<AlignedBuf>,
    agg: BatchResults,
    tx: Option<oneshot::Sender<Completed>>,
}

impl SyncBatch {
    fn chunk_done(&self, op: usize, outcome: Result<(), (IoErrKind, u64)>) {
        let mut inner = match self.inner.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        let outcome = outcome.map_err(|(kind, at)| inner.agg.err(op, at, kind));
        if inner.agg.chunk_done(op, outcome) {
            let agg = std::mem::replace(
                &mut inner.agg,
                BatchResults {
                    ops: Vec::new(),
                    results: Vec::new(),
                    chunks_left: Vec::new(),
                    ops_left: 0,
                },
            );
            if let (Some(buf), Some(tx)) = (inner.buf.take(), inner.tx.take()) {
                let _ = tx.send(Completed {
                    buf,
                    results: agg.finish(),
                });
            }
        }
    }
}

enum SyncJob {
    Io {
        batch: Arc<SyncBatch>,
        chunk: Chunk,
    },
    /// Use this handle for the device from now on.
    Replace(File, oneshot::Sender<io::Result<()>>),
}

/// The synchronous engine: `preadv`/`pwritev` on one thread per device, so devices still work
/// in parallel.
pub struct SyncEngine {
    /// Per device slot: its worker (`None` until the slot has a handle).
    workers: Mutex<Vec<Option<mpsc::Sender<SyncJob>>>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    pub(super) state: Arc<DeviceState>,
}

impl std::fmt::Debug for SyncEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SyncEngine")
            .field("devices", &self.state.present.len())
            .finish()
    }
}

/// Starts the worker of device slot `i` on `file`.
fn spawn_worker(
    i: usize,
    file: File,
    state: Arc<DeviceState>,
) -> io::Result<(mpsc::Sender<SyncJob>, JoinHandle<()>)> {
    let (tx, rx) = mpsc::channel::<SyncJob>();
    let thread = std::thread::Builder::new()
        .name(format!("sanfs-sync-d{i}"))
        .spawn(move || {
            let mut file = file;
            for job in rx {
                let (batch, mut chunk) = match job {
                    SyncJob::Io { batch, chunk } => (batch, chunk),
                    SyncJob::Replace(new, tx) => {
                        file = new;
                        let _ = tx.send(Ok(()));
                        continue;
                    }
                };
                let outcome = run_sync_chunk(&file, batch.base, &mut chunk, &state);
                if outcome.is_err() {
                    state.count_error(chunk.device);
                    if chunk.kind != OpKind::Read {
                        state.poison(chunk.device);
                    }
                }
                batch.chunk_done(chunk.op, outcome);
            }
        })?;
    Ok((tx, thread))
}

impl SyncEngine {
    pub fn new(devices: Vec<Option<File>>) -> io::Result<SyncEngine> {
        let state = Arc::new(DeviceState::new(&devices));
        let mut workers = Vec::with_capacity(devices.len());
        let mut threads = Vec::new();
        for (i, dev) in devices.into_iter().enumerate() {
            let Some(file) = dev else {
                workers.push(None);
                continue;
            };
            let (tx, thread) = spawn_worker(i, file, Arc::clone(&state))?;
            threads.push(thread);
            workers.push(Some(tx));
        }
        Ok(SyncEngine {
            workers: Mutex::new(workers),
            threads: Mutex::new(threads),
            state,
        })
    }

    pub(super) fn submit(
        &self,
        mut buf: AlignedBuf,
        ops: Vec<DeviceOp>,
    ) -> oneshot::Receiver<Completed> {
        let (tx, rx) = oneshot::channel();
        let (agg, chunks) = prepare(&ops, buf.len(), &self.state);
        if chunks.is_empty() {
            let _ = tx.send(Completed {
                buf,
                results: agg.finish(),
            });
            return rx;
        }
        let batch = Arc::new(SyncBatch {
            base: BufPtr(buf.as_mut_ptr()),
            inner: Mutex::new(SyncBatchInner {
                buf: Some(buf),
                agg,
                tx: Some(tx),
            }),
        });
        for chunk in chunks {
            let op = chunk.op;
            let at = chunk.cur_off();
            let sent = match self
                .workers
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get(chunk.device.as_usize())
            {
                Some(Some(w)) => w
                    .send(SyncJob::Io {
                        batch: Arc::clone(&batch),
                        chunk,
                    })
                    .is_ok(),
                _ => false,
            };
            if !sent {
                batch.chunk_done(op, Err((IoErrKind::NoDevice, at)));
            }
        }
        rx
    }
}

impl SyncEngine {
    pub(super) fn replace(
        &self,
        device: DeviceIndex,
        file: File,
    ) -> oneshot::Receiver<io::Result<()>> {
        let (tx, rx) = oneshot::channel();
        let mut workers = self.workers.lock().unwrap_or_else(|p| p.into_inner());
        match workers.get_mut(device.as_usize()) {
            Some(Some(w)) => {
                // A send error drops `tx`: the caller sees the engine stopped.
                let _ = w.send(SyncJob::Replace(file, tx));
            }
            Some(slot) => {
                // A slot without a handle yet: its worker starts now.
                let started = spawn_worker(device.as_usize(), file, Arc::clone(&self.state));
                let _ = tx.send(started.map(|(w, thread)| {
                    *slot = Some(w);
                    self.threads
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .push(thread);
                    self.state.set_present(device);
                }));
            }
            None => {
                let _ = tx.send(Err(io::Error::other(format!(
                    "device {device} is beyond the engine's {} slots",
                    workers.len()
                ))));
            }
        }
        rx
    }
}

impl Drop for SyncEngine {
    fn drop(&mut self) {
        self.workers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
        let threads: Vec<JoinHandle<()>> = self
            .threads
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain(..)
            .collect();
        for t in threads {
            if t.join().is_err() {
                tracing::error!("a synchronous I/O engine thread panicked");
            }
        }
    }
}

/// Runs one chunk to completion (or failure) with `preadv`/`pwritev`/`fdatasync`.
fn run_sync_chunk(
    file: &File,
    base: BufPtr,
    chunk: &mut Chunk,
    state: &DeviceState,
) -> Result<(), (IoErrKind, u64)> {
    if state.is_poisoned(chunk.device) {
        return Err((IoErrKind::Poisoned, chunk.cur_off()));
    }
    loop {
        let at = chunk.cur_off();
        let started = state.begin_request(chunk.device);
        let res = match chunk.kind {
            OpKind::Flush => match file.sync_data() {
                Ok(()) => 0,
                Err(e) => -i64::from(e.raw_os_error().unwrap_or(libc::EIO)),
            },
            OpKind::Read | OpKind::Write => {
                let iov = chunk.iovecs(base);
                let n = if chunk.kind == OpKind::Read {
                    // SAFETY: every iovec covers bytes inside the batch's buffer (pieces were
                    // bounds-checked), which stays alive and untouched by Rust code until this
                    // chunk is reported done; `iov` outlives the call.
                    unsafe {
                        libc::preadv(
                            file.as_raw_fd(),
                            iov.as_ptr(),
                            iov.len() as libc::c_int,
                            at as libc::off_t,
                        )
                    }
                } else {
                    // SAFETY: as for preadv; the kernel only reads the buffer bytes.
                    unsafe {
                        libc::pwritev(
                            file.as_raw_fd(),
                            iov.as_ptr(),
                            iov.len() as libc::c_int,
                            at as libc::off_t,
                        )
                    }
                };
                if n < 0 {
                    -i64::from(
                        io::Error::last_os_error()
                            .raw_os_error()
                            .unwrap_or(libc::EIO),
                    )
                } else {
                    n as i64
                }
            }
        };
        state.end_request(chunk.device, chunk.kind, started);
        match judge(chunk, res) {
            Next::Done => return Ok(()),
            Next::Again => continue,
            Next::Failed(kind) => return Err((kind, at)),
        }
    }
}
