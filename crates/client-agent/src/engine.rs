//! The agent's device I/O engine: moves a grant's data between aligned buffers and the LUNs.
//!
//! [`Engine`] is a closed enum (not a trait object): [`UringEngine`] runs one `io_uring` on a
//! dedicated thread, with the LUNs' descriptors registered as fixed files, a queue depth per
//! device, and vectored reads and writes whose iovecs point straight into the caller's aligned
//! buffer (no copy); [`SyncEngine`] does the same with `preadv`/`pwritev` on one thread per
//! device, for kernels without `io_uring`. Both take a whole batch of [`DeviceOp`]s, one
//! grant's I/O on all its devices, in one [`Engine::submit`] call and issue every device's
//! I/O before any completion is awaited (paper section 4.3: never wait for one device before
//! issuing to the next). The returned future resolves when the whole batch is done, with the
//! buffer and one result per op.
//!
//! Each op's result is its own: a short transfer is resubmitted for the remainder, `EINTR` and
//! `EAGAIN` are retried, and anything else (an errno, or end of device before the op's last
//! byte) fails that op alone, with the errno. Nothing is reported as done that was not.
//!
//! Fail stop (style section 6): after a failed write or flush on a device, the device is
//! poisoned: later ops on it fail with [`IoErrKind::Poisoned`] without touching it until the
//! caller, having re-established what is durable, calls [`Engine::clear_poison`].
//!
//! [`execute_read`] and [`execute_write`] run an [`IoPlan`] against one buffer of the planned
//! range: zero fill for holes, and each device I/O's `iov` pieces used as its iovecs.

use std::collections::VecDeque;
use std::fs::File;
use std::future::Future;
use std::io::{self, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::thread::JoinHandle;
use std::time::Instant;

use sanfs_blockmap::plan::{BufRange, DeviceIo, IoPlan};
use sanfs_blockmap::volume::DeviceIndex;
use tokio::sync::oneshot;

use crate::buf::AlignedBuf;

/// Most iovecs in one vectored I/O (Linux's `IOV_MAX`); longer ops are split.
const MAX_IOVECS: usize = 1024;
/// How often `EINTR`/`EAGAIN` is retried before it counts as a failure.
const MAX_RETRIES: u32 = 100;
/// Largest single-buffer `IORING_OP_READ`/`WRITE` (its length is a `u32`).
const MAX_PLAIN_RW: u64 = 1 << 30;

/// What an op does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OpKind {
    /// Device bytes into the buffer pieces.
    Read,
    /// Buffer pieces onto the device.
    Write,
    /// Flush the device's write cache (`fdatasync`); takes no buffer pieces.
    Flush,
}

/// One I/O on one device: `kind` at `phys_off`, scattered to (read) or gathered from (write)
/// the pieces `iov` of the submitted buffer, in order. The same shape as a plan's
/// [`DeviceIo`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceOp {
    pub device: DeviceIndex,
    pub phys_off: u64,
    pub kind: OpKind,
    pub iov: Vec<BufRange>,
}

impl DeviceOp {
    /// A read of a plan's device I/O.
    pub fn read(io: &DeviceIo) -> DeviceOp {
        DeviceOp {
            device: io.device,
            phys_off: io.phys_off,
            kind: OpKind::Read,
            iov: io.iov.clone(),
        }
    }

    /// A write of a plan's device I/O.
    pub fn write(io: &DeviceIo) -> DeviceOp {
        DeviceOp {
            kind: OpKind::Write,
            ..DeviceOp::read(io)
        }
    }

    /// A cache flush of `device`.
    pub fn flush(device: DeviceIndex) -> DeviceOp {
        DeviceOp {
            device,
            phys_off: 0,
            kind: OpKind::Flush,
            iov: Vec::new(),
        }
    }

    /// Bytes the op moves.
    pub fn len(&self) -> u64 {
        self.iov.iter().map(|p| p.len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Why one device I/O failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoErrKind {
    /// The kernel's answer, as an errno.
    Os(i32),
    /// The device ended before the op's last byte (a read or write of 0 bytes).
    UnexpectedEof,
    /// The engine has no handle on this device (missing on this node, or out of range).
    NoDevice,
    /// A buffer piece lies outside the submitted buffer, or the device range overflows.
    BadRange,
    /// An earlier write or flush on this device failed; nothing more is issued to it.
    Poisoned,
}

impl std::fmt::Display for IoErrKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            IoErrKind::Os(errno) => write!(f, "{}", io::Error::from_raw_os_error(*errno)),
            IoErrKind::UnexpectedEof => f.write_str("unexpected end of device"),
            IoErrKind::NoDevice => f.write_str("device not available on this node"),
            IoErrKind::BadRange => f.write_str("buffer piece or device range out of bounds"),
            IoErrKind::Poisoned => f.write_str("device poisoned by an earlier failed write"),
        }
    }
}

/// The failure of one [`DeviceOp`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{kind:?} of {len} bytes at {device} byte {phys_off} failed at byte {failed_at}: {error}")]
pub struct IoErr {
    pub device: DeviceIndex,
    pub kind: OpKind,
    /// The op's start and length.
    pub phys_off: u64,
    pub len: u64,
    /// The device byte where the failing transfer started.
    pub failed_at: u64,
    pub error: IoErrKind,
}

impl IoErr {
    /// The error as an errno (`EIO` for a short device, `ENODEV`, `EINVAL`).
    pub fn errno(&self) -> i32 {
        match self.error {
            IoErrKind::Os(errno) => errno,
            IoErrKind::UnexpectedEof | IoErrKind::Poisoned => libc::EIO,
            IoErrKind::NoDevice => libc::ENODEV,
            IoErrKind::BadRange => libc::EINVAL,
        }
    }
}

/// A finished batch: the buffer back, and one result per submitted op, in order.
#[derive(Debug)]
pub struct Completed {
    pub buf: AlignedBuf,
    pub results: Vec<Result<(), IoErr>>,
}

/// The engine's thread is gone (it panicked or was shut down): the batch's outcome is unknown.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the I/O engine has stopped")]
pub struct EngineStopped;

/// Which engine to build.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EngineKind {
    /// `io_uring`; fails where the kernel refuses it.
    Uring,
    /// `preadv`/`pwritev` on one thread per device.
    Sync,
    /// `io_uring` where the kernel has it, else the synchronous engine.
    #[default]
    Auto,
}

/// Engine settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineConfig {
    pub kind: EngineKind,
    /// Most I/Os in flight on one device at a time (uring engine).
    pub queue_depth_per_device: u32,
}

impl Default for EngineConfig {
    fn default() -> EngineConfig {
        EngineConfig {
            kind: EngineKind::Auto,
            queue_depth_per_device: 32,
        }
    }
}

/// Counters of one device's I/O (see [`EngineStats`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeviceIoStats {
    /// Ops ([`DeviceOp`]s) accepted for the device, by kind.
    pub read_ops: u64,
    pub write_ops: u64,
    pub flush_ops: u64,
    /// Bytes those ops moved (counted when the op was accepted).
    pub read_bytes: u64,
    pub write_bytes: u64,
    /// Requests handed to the kernel (SQEs, or syscalls): one per op unless an op is longer
    /// than `IOV_MAX` pieces or a short transfer or `EINTR` resubmits its remainder.
    pub submissions: u64,
    /// Ops that failed.
    pub errors: u64,
}

/// What an engine did so far: per device, and how many requests were in the kernel at once.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// By device index.
    pub devices: Vec<DeviceIoStats>,
    /// Requests in the kernel now.
    pub in_flight: u64,
    /// The most requests that were in the kernel at the same time (since the engine started
    /// or [`Engine::reset_max_in_flight`]).
    pub max_in_flight: u64,
}

#[derive(Default)]
struct DeviceCounters {
    read_ops: AtomicU64,
    write_ops: AtomicU64,
    flush_ops: AtomicU64,
    read_bytes: AtomicU64,
    write_bytes: AtomicU64,
    submissions: AtomicU64,
    errors: AtomicU64,
}

/// Latency histograms of one device's requests, by kind (`sanfs_agent_device_io_seconds`).
struct DeviceLatency {
    read: metrics::Histogram,
    write: metrics::Histogram,
    flush: metrics::Histogram,
}

impl DeviceLatency {
    fn new(device: usize) -> DeviceLatency {
        let h = |op: &'static str| metrics::histogram!(DEVICE_IO_SECONDS, "device" => device.to_string(), "op" => op);
        DeviceLatency {
            read: h("read"),
            write: h("write"),
            flush: h("flush"),
        }
    }
}

/// The name of the device latency histogram (seconds per request, by `device` index and
/// `op`), recorded into the process's `metrics` recorder.
pub const DEVICE_IO_SECONDS: &str = "sanfs_agent_device_io_seconds";

/// What every engine knows about its devices.
struct DeviceState {
    present: Vec<bool>,
    poisoned: Vec<AtomicBool>,
    counters: Vec<DeviceCounters>,
    latency: Vec<DeviceLatency>,
    in_flight: AtomicU64,
    max_in_flight: AtomicU64,
}

impl DeviceState {
    fn new(files: &[Option<File>]) -> DeviceState {
        DeviceState {
            present: files.iter().map(Option::is_some).collect(),
            poisoned: files.iter().map(|_| AtomicBool::new(false)).collect(),
            counters: files.iter().map(|_| DeviceCounters::default()).collect(),
            latency: (0..files.len()).map(DeviceLatency::new).collect(),
            in_flight: AtomicU64::new(0),
            max_in_flight: AtomicU64::new(0),
        }
    }

    /// Counts an op accepted for its device.
    fn count_op(&self, op: &DeviceOp) {
        let Some(c) = self.counters.get(op.device.as_usize()) else {
            return;
        };
        let len = op.len();
        match op.kind {
            OpKind::Read => {
                c.read_ops.fetch_add(1, Ordering::Relaxed);
                c.read_bytes.fetch_add(len, Ordering::Relaxed);
            }
            OpKind::Write => {
                c.write_ops.fetch_add(1, Ordering::Relaxed);
                c.write_bytes.fetch_add(len, Ordering::Relaxed);
            }
            OpKind::Flush => {
                c.flush_ops.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// A request goes to the kernel now; returns its start time.
    fn begin_request(&self, d: DeviceIndex) -> Instant {
        if let Some(c) = self.counters.get(d.as_usize()) {
            c.submissions.fetch_add(1, Ordering::Relaxed);
        }
        let now = self.in_flight.fetch_add(1, Ordering::AcqRel) + 1;
        self.max_in_flight.fetch_max(now, Ordering::AcqRel);
        Instant::now()
    }

    /// The kernel answered a request started at `started`.
    fn end_request(&self, d: DeviceIndex, kind: OpKind, started: Instant) {
        self.in_flight.fetch_sub(1, Ordering::AcqRel);
        if let Some(l) = self.latency.get(d.as_usize()) {
            let h = match kind {
                OpKind::Read => &l.read,
                OpKind::Write => &l.write,
                OpKind::Flush => &l.flush,
            };
            h.record(started.elapsed().as_secs_f64());
        }
    }

    fn count_error(&self, d: DeviceIndex) {
        if let Some(c) = self.counters.get(d.as_usize()) {
            c.errors.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn stats(&self) -> EngineStats {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        EngineStats {
            devices: self
                .counters
                .iter()
                .map(|c| DeviceIoStats {
                    read_ops: get(&c.read_ops),
                    write_ops: get(&c.write_ops),
                    flush_ops: get(&c.flush_ops),
                    read_bytes: get(&c.read_bytes),
                    write_bytes: get(&c.write_bytes),
                    submissions: get(&c.submissions),
                    errors: get(&c.errors),
                })
                .collect(),
            in_flight: get(&self.in_flight),
            max_in_flight: get(&self.max_in_flight),
        }
    }

    fn is_poisoned(&self, d: DeviceIndex) -> bool {
        self.poisoned
            .get(d.as_usize())
            .is_some_and(|p| p.load(Ordering::Acquire))
    }

    fn poison(&self, d: DeviceIndex) {
        if let Some(p) = self.poisoned.get(d.as_usize())
            && !p.swap(true, Ordering::AcqRel)
        {
            tracing::error!(device = %d, "device write failed: device poisoned until recovery");
        }
    }

    fn clear_poison(&self, d: DeviceIndex) {
        if let Some(p) = self.poisoned.get(d.as_usize()) {
            p.store(false, Ordering::Release);
        }
    }
}

/// The I/O engine: `io_uring` or synchronous, chosen by configuration.
pub enum Engine {
    Uring(UringEngine),
    Sync(SyncEngine),
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Engine::{}", self.name())
    }
}

impl Engine {
    /// Builds the configured engine over `devices`, indexed by [`DeviceIndex`] (`None` for a
    /// LUN this node does not have; ops on it fail with [`IoErrKind::NoDevice`]).
    pub fn new(config: &EngineConfig, devices: Vec<Option<File>>) -> io::Result<Engine> {
        match config.kind {
            EngineKind::Uring => Ok(Engine::Uring(UringEngine::new(
                devices,
                config.queue_depth_per_device,
            )?)),
            EngineKind::Sync => Ok(Engine::Sync(SyncEngine::new(devices)?)),
            EngineKind::Auto => {
                // Probe with an empty ring first so that the handles are not lost on failure.
                match io_uring::IoUring::new(8) {
                    Ok(_) => Ok(Engine::Uring(UringEngine::new(
                        devices,
                        config.queue_depth_per_device,
                    )?)),
                    Err(e) => {
                        tracing::warn!(error = %e, "io_uring unavailable: using the synchronous I/O engine");
                        Ok(Engine::Sync(SyncEngine::new(devices)?))
                    }
                }
            }
        }
    }

    /// `"uring"` or `"sync"`.
    pub fn name(&self) -> &'static str {
        match self {
            Engine::Uring(_) => "uring",
            Engine::Sync(_) => "sync",
        }
    }

    /// Issues every op now (before returning) and resolves when all have completed.
    /// Buffer pieces are relative to `buf`'s start; the buffer comes back in [`Completed`].
    pub fn submit(
        &self,
        buf: AlignedBuf,
        ops: Vec<DeviceOp>,
    ) -> impl Future<Output = Result<Completed, EngineStopped>> + Send + 'static + use<> {
        let rx = match self {
            Engine::Uring(e) => e.submit(buf, ops),
            Engine::Sync(e) => e.submit(buf, ops),
        };
        async move { rx.await.map_err(|_| EngineStopped) }
    }

    /// Whether an earlier failed write or flush poisoned `device`.
    pub fn is_poisoned(&self, device: DeviceIndex) -> bool {
        self.state().is_poisoned(device)
    }

    /// Lets I/O reach `device` again, once the caller has recovered from a failed write.
    pub fn clear_poison(&self, device: DeviceIndex) {
        self.state().clear_poison(device)
    }

    /// Uses `file` (a fresh handle on the same LUN) for `device` from now on. Requests in
    /// flight on the old handle finish on it. Only a device that had a handle at start can be
    /// replaced.
    pub fn replace_device(
        &self,
        device: DeviceIndex,
        file: File,
    ) -> impl Future<Output = io::Result<()>> + Send + 'static + use<> {
        let rx = match self {
            Engine::Uring(e) => e.replace(device, file),
            Engine::Sync(e) => e.replace(device, file),
        };
        async move {
            rx.await
                .unwrap_or_else(|_| Err(io::Error::other(EngineStopped)))
        }
    }

    /// What the engine did so far.
    pub fn stats(&self) -> EngineStats {
        self.state().stats()
    }

    /// Starts measuring [`EngineStats::max_in_flight`] afresh from the requests in flight now.
    pub fn reset_max_in_flight(&self) {
        let s = self.state();
        s.max_in_flight
            .store(s.in_flight.load(Ordering::Acquire), Ordering::Release);
    }

    fn state(&self) -> &DeviceState {
        match self {
            Engine::Uring(e) => &e.state,
            Engine::Sync(e) => &e.state,
        }
    }
}

/// A pointer into a batch's buffer, handed to the kernel.
#[derive(Debug, Clone, Copy)]
struct BufPtr(*mut u8);

// SAFETY: the pointer is the start of the AlignedBuf owned by the same batch; that buffer is
// neither used nor freed by Rust code until every chunk of the batch has completed (it only
// goes back to the caller, or is dropped, after the last completion), and while chunks are in
// flight the memory is touched only through iovecs covering bounds-checked pieces.
unsafe impl Send for BufPtr {}
// SAFETY: as above; sharing the pointer value between worker threads creates no references.
unsafe impl Sync for BufPtr {}

/// A piece of work for one device: all or part (at most [`MAX_IOVECS`] pieces) of one op.
#[derive(Debug)]
struct Chunk {
    op: usize,
    device: DeviceIndex,
    kind: OpKind,
    /// Device byte of the chunk's first piece.
    phys_off: u64,
    len: u64,
    pieces: Vec<BufRange>,
    /// Bytes transferred so far (a short transfer resubmits the rest).
    done: u64,
    retries: u32,
}

impl Chunk {
    fn cur_off(&self) -> u64 {
        self.phys_off + self.done
    }

    /// The iovecs for the bytes not yet transferred.
    fn iovecs(&self, base: BufPtr) -> Vec<libc::iovec> {
        let mut skip = self.done;
        let mut out = Vec::with_capacity(self.pieces.len());
        for p in &self.pieces {
            if skip >= p.len {
                skip -= p.len;
                continue;
            }
            // Pieces were bounds-checked against the buffer in `prepare`, so these fit usize.
            let off = (p.buf_off + skip) as usize;
            out.push(libc::iovec {
                iov_base: base.0.wrapping_add(off).cast(),
                iov_len: (p.len - skip) as usize,
            });
            skip = 0;
        }
        out
    }
}

/// Per-op results of one batch, filled as chunks complete.
#[derive(Debug)]
struct BatchResults {
    ops: Vec<(DeviceIndex, OpKind, u64, u64)>,
    results: Vec<Option<Result<(), IoErr>>>,
    chunks_left: Vec<u32>,
    ops_left: usize,
}

impl BatchResults {
    fn err(&self, op: usize, failed_at: u64, error: IoErrKind) -> IoErr {
        let (device, kind, phys_off, len) = self.ops[op];
        IoErr {
            device,
            kind,
            phys_off,
            len,
            failed_at,
            error,
        }
    }

    /// Records a chunk's outcome; returns whether the whole batch is now done.
    fn chunk_done(&mut self, op: usize, outcome: Result<(), IoErr>) -> bool {
        if let Err(e) = outcome
            && !matches!(self.results[op], Some(Err(_)))
        {
            self.results[op] = Some(Err(e));
        }
        self.chunks_left[op] -= 1;
        if self.chunks_left[op] == 0 {
            if self.results[op].is_none() {
                self.results[op] = Some(Ok(()));
            }
            self.ops_left -= 1;
        }
        self.ops_left == 0
    }

    fn finish(self) -> Vec<Result<(), IoErr>> {
        self.results
            .into_iter()
            .map(|r| r.unwrap_or(Ok(())))
            .collect()
    }
}

/// Checks every op against the buffer and the devices, and cuts the valid ones into chunks.
/// Ops that fail the checks (or are empty) already have their result.
fn prepare(ops: &[DeviceOp], buf_len: usize, state: &DeviceState) -> (BatchResults, Vec<Chunk>) {
    let mut agg = BatchResults {
        ops: ops
            .iter()
            .map(|o| (o.device, o.kind, o.phys_off, o.len()))
            .collect(),
        results: vec![None; ops.len()],
        chunks_left: vec![0; ops.len()],
        ops_left: 0,
    };
    let mut chunks = Vec::with_capacity(ops.len());
    for (i, op) in ops.iter().enumerate() {
        let len = op.len();
        let in_buf = op.iov.iter().all(|p| {
            p.buf_off
                .checked_add(p.len)
                .is_some_and(|end| end <= buf_len as u64)
        });
        let in_dev = op
            .phys_off
            .checked_add(len)
            .is_some_and(|end| end <= i64::MAX as u64);
        let check = if !state
            .present
            .get(op.device.as_usize())
            .copied()
            .unwrap_or(false)
        {
            Err(IoErrKind::NoDevice)
        } else if !in_buf || !in_dev || (op.kind == OpKind::Flush && len != 0) {
            Err(IoErrKind::BadRange)
        } else if state.is_poisoned(op.device) {
            Err(IoErrKind::Poisoned)
        } else {
            Ok(())
        };
        if let Err(kind) = check {
            state.count_error(op.device);
            agg.results[i] = Some(Err(agg.err(i, op.phys_off, kind)));
            continue;
        }
        state.count_op(op);
        if len == 0 && op.kind != OpKind::Flush {
            agg.results[i] = Some(Ok(()));
            continue;
        }
        let pieces: Vec<BufRange> = op.iov.iter().copied().filter(|p| p.len > 0).collect();
        let mut phys_off = op.phys_off;
        let groups: Vec<&[BufRange]> = if pieces.is_empty() {
            vec![&[]]
        } else {
            pieces.chunks(MAX_IOVECS).collect()
        };
        for group in groups {
            let len: u64 = group.iter().map(|p| p.len).sum();
            chunks.push(Chunk {
                op: i,
                device: op.device,
                kind: op.kind,
                phys_off,
                len,
                pieces: group.to_vec(),
                done: 0,
                retries: 0,
            });
            phys_off += len;
            agg.chunks_left[i] += 1;
        }
        agg.ops_left += 1;
    }
    (agg, chunks)
}

/// What to do with a chunk after the kernel answered `res` (bytes, or a negative errno).
enum Next {
    Done,
    Again,
    Failed(IoErrKind),
}

fn judge(chunk: &mut Chunk, res: i64) -> Next {
    if res < 0 {
        let errno = i32::try_from(-res).unwrap_or(libc::EIO);
        if (errno == libc::EINTR || errno == libc::EAGAIN) && chunk.retries < MAX_RETRIES {
            chunk.retries += 1;
            return Next::Again;
        }
        return Next::Failed(IoErrKind::Os(errno));
    }
    if chunk.kind == OpKind::Flush {
        return Next::Done;
    }
    let n = res as u64;
    if n == 0 {
        return Next::Failed(IoErrKind::UnexpectedEof);
    }
    chunk.done = (chunk.done + n).min(chunk.len);
    chunk.retries = 0;
    if chunk.done < chunk.len {
        Next::Again
    } else {
        Next::Done
    }
}

// ---------------------------------------------------------------------------------------------
// io_uring engine

const WAKE_USER_DATA: u64 = u64::MAX;

enum UringMsg {
    Batch {
        buf: AlignedBuf,
        base: BufPtr,
        agg: BatchResults,
        chunks: Vec<Chunk>,
        tx: oneshot::Sender<Completed>,
    },
    /// Swap a device's registered file for a fresh handle.
    Replace {
        device: usize,
        file: File,
        tx: oneshot::Sender<io::Result<()>>,
    },
    Shutdown,
}

/// The `io_uring` engine: one ring on a dedicated thread, the LUNs registered as fixed files.
pub struct UringEngine {
    tx: mpsc::Sender<UringMsg>,
    wake: Arc<File>,
    thread: Option<JoinHandle<()>>,
    state: Arc<DeviceState>,
}

impl std::fmt::Debug for UringEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UringEngine")
            .field("devices", &self.state.present.len())
            .finish()
    }
}

fn eventfd() -> io::Result<File> {
    // SAFETY: eventfd takes no pointers; it returns a new descriptor or -1.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh descriptor that nothing else owns.
    Ok(File::from(unsafe { OwnedFd::from_raw_fd(fd) }))
}

impl UringEngine {
    /// Starts the engine thread with a ring sized for `queue_depth_per_device` I/Os in flight
    /// on every device.
    pub fn new(devices: Vec<Option<File>>, queue_depth_per_device: u32) -> io::Result<UringEngine> {
        let state = Arc::new(DeviceState::new(&devices));
        let wake = Arc::new(eventfd()?);
        let qd = queue_depth_per_device.max(1);
        let entries = (u64::from(qd) * devices.len() as u64 + 1)
            .next_power_of_two()
            .clamp(8, 4096) as u32;
        let (tx, rx) = mpsc::channel();
        let (ready_tx, ready_rx) = mpsc::sync_channel(1);
        let thread_state = Arc::clone(&state);
        let thread_wake = Arc::clone(&wake);
        let thread = std::thread::Builder::new()
            .name("sanfs-uring".into())
            .spawn(move || {
                let ring = match io_uring::IoUring::new(entries) {
                    Ok(ring) => ring,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                let mut fixed: Vec<Option<u32>> = Vec::with_capacity(devices.len());
                let mut fds: Vec<RawFd> = Vec::new();
                for dev in &devices {
                    fixed.push(dev.as_ref().map(|f| {
                        fds.push(f.as_raw_fd());
                        (fds.len() - 1) as u32
                    }));
                }
                if !fds.is_empty()
                    && let Err(e) = ring.submitter().register_files(&fds)
                {
                    let _ = ready_tx.send(Err(e));
                    return;
                }
                let _ = ready_tx.send(Ok(()));
                let mut worker = UringWorker {
                    ring,
                    fixed,
                    qd,
                    cap: entries - 1,
                    state: thread_state,
                    wake: thread_wake,
                    queues: (0..devices.len()).map(|_| VecDeque::new()).collect(),
                    in_dev: vec![0; devices.len()],
                    in_flight: Vec::new(),
                    free_slots: Vec::new(),
                    total: 0,
                    batches: Vec::new(),
                    free_batches: Vec::new(),
                    files: devices,
                };
                worker.run(&rx);
            })?;
        match ready_rx.recv() {
            Ok(Ok(())) => Ok(UringEngine {
                tx,
                wake,
                thread: Some(thread),
                state,
            }),
            Ok(Err(e)) => {
                let _ = thread.join();
                Err(e)
            }
            Err(_) => {
                let _ = thread.join();
                Err(io::Error::other(
                    "io_uring engine thread died while starting",
                ))
            }
        }
    }

    fn poke(&self) {
        if let Err(e) = (&*self.wake).write_all(&1u64.to_ne_bytes()) {
            tracing::error!(error = %e, "cannot wake the io_uring engine thread");
        }
    }

    fn submit(&self, mut buf: AlignedBuf, ops: Vec<DeviceOp>) -> oneshot::Receiver<Completed> {
        let (tx, rx) = oneshot::channel();
        let (agg, chunks) = prepare(&ops, buf.len(), &self.state);
        if chunks.is_empty() {
            let _ = tx.send(Completed {
                buf,
                results: agg.finish(),
            });
            return rx;
        }
        let base = BufPtr(buf.as_mut_ptr());
        let msg = UringMsg::Batch {
            buf,
            base,
            agg,
            chunks,
            tx,
        };
        // A send error means the thread is gone: the receiver then reports EngineStopped.
        if self.tx.send(msg).is_ok() {
            self.poke();
        }
        rx
    }
}

impl UringEngine {
    fn replace(&self, device: DeviceIndex, file: File) -> oneshot::Receiver<io::Result<()>> {
        let (tx, rx) = oneshot::channel();
        let msg = UringMsg::Replace {
            device: device.as_usize(),
            file,
            tx,
        };
        if self.tx.send(msg).is_ok() {
            self.poke();
        }
        rx
    }
}

impl Drop for UringEngine {
    fn drop(&mut self) {
        if self.tx.send(UringMsg::Shutdown).is_ok() {
            self.poke();
        }
        if let Some(thread) = self.thread.take()
            && thread.join().is_err()
        {
            tracing::error!("the io_uring engine thread panicked");
        }
    }
}

struct UringBatch {
    buf: AlignedBuf,
    base: BufPtr,
    agg: BatchResults,
    tx: oneshot::Sender<Completed>,
}

struct InFlight {
    batch: usize,
    chunk: Chunk,
    started: Instant,
    /// Referenced by the submitted SQE until its completion arrives.
    _iovecs: Vec<libc::iovec>,
}

struct UringWorker {
    ring: io_uring::IoUring,
    fixed: Vec<Option<u32>>,
    qd: u32,
    cap: u32,
    state: Arc<DeviceState>,
    wake: Arc<File>,
    queues: Vec<VecDeque<(usize, Chunk)>>,
    in_dev: Vec<u32>,
    in_flight: Vec<Option<InFlight>>,
    free_slots: Vec<usize>,
    total: u32,
    batches: Vec<Option<UringBatch>>,
    free_batches: Vec<usize>,
    /// The registered files' owners (a replaced one is dropped here; requests in flight on
    /// it keep the kernel's own reference).
    files: Vec<Option<File>>,
}

impl UringWorker {
    fn run(&mut self, rx: &mpsc::Receiver<UringMsg>) {
        let mut wake_buf = Box::new([0u8; 8]);
        let mut wake_armed = false;
        let mut shutdown = false;
        loop {
            if !wake_armed && !shutdown {
                let entry = io_uring::opcode::Read::new(
                    io_uring::types::Fd(self.wake.as_raw_fd()),
                    wake_buf.as_mut_ptr(),
                    8,
                )
                .build()
                .user_data(WAKE_USER_DATA);
                // SAFETY: `wake_buf` lives until this function returns, and the function
                // returns only after the wake read's completion has been reaped
                // (`wake_armed` false). The SQ has room: at most `cap` = entries - 1 chunk
                // SQEs are ever outstanding.
                if unsafe { self.ring.submission().push(&entry) }.is_ok() {
                    wake_armed = true;
                }
            }
            loop {
                match rx.try_recv() {
                    Ok(UringMsg::Batch {
                        buf,
                        base,
                        agg,
                        chunks,
                        tx,
                    }) => self.admit(buf, base, agg, chunks, tx),
                    Ok(UringMsg::Replace { device, file, tx }) => {
                        let _ = tx.send(self.replace(device, file));
                    }
                    Ok(UringMsg::Shutdown) | Err(mpsc::TryRecvError::Disconnected) => {
                        shutdown = true;
                        break;
                    }
                    Err(mpsc::TryRecvError::Empty) => break,
                }
            }
            self.issue();
            if shutdown && self.total == 0 && self.queues.iter().all(VecDeque::is_empty) {
                if !wake_armed {
                    return;
                }
                // Complete our own wake read so that its buffer is free before returning.
                let _ = (&*self.wake).write_all(&1u64.to_ne_bytes());
            }
            match self.ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e)
                    if matches!(
                        e.raw_os_error(),
                        Some(libc::EINTR | libc::EBUSY | libc::EAGAIN)
                    ) => {}
                Err(e) => {
                    tracing::error!(error = %e, "io_uring_enter failed; retrying");
                    std::thread::yield_now();
                }
            }
            let cqes: Vec<(u64, i32)> = self
                .ring
                .completion()
                .map(|c| (c.user_data(), c.result()))
                .collect();
            for (user_data, res) in cqes {
                if user_data == WAKE_USER_DATA {
                    wake_armed = false;
                } else {
                    self.complete(user_data as usize, i64::from(res));
                }
            }
        }
    }

    fn admit(
        &mut self,
        buf: AlignedBuf,
        base: BufPtr,
        agg: BatchResults,
        chunks: Vec<Chunk>,
        tx: oneshot::Sender<Completed>,
    ) {
        let slot = UringBatch { buf, base, agg, tx };
        let key = match self.free_batches.pop() {
            Some(k) => {
                self.batches[k] = Some(slot);
                k
            }
            None => {
                self.batches.push(Some(slot));
                self.batches.len() - 1
            }
        };
        for chunk in chunks {
            self.queues[chunk.device.as_usize()].push_back((key, chunk));
        }
    }

    /// Registers `file` in `device`'s fixed-file slot instead of its current handle.
    fn replace(&mut self, device: usize, file: File) -> io::Result<()> {
        let Some(Some(slot)) = self.fixed.get(device).copied() else {
            return Err(io::Error::other(
                "the device had no handle when the engine started",
            ));
        };
        self.ring
            .submitter()
            .register_files_update(slot, &[file.as_raw_fd()])?;
        self.files[device] = Some(file);
        Ok(())
    }

    /// Moves queued chunks into the submission queue, per-device queue depth permitting.
    fn issue(&mut self) {
        for d in 0..self.queues.len() {
            while self.in_dev[d] < self.qd && self.total < self.cap {
                let Some((batch, chunk)) = self.queues[d].pop_front() else {
                    break;
                };
                if self.state.is_poisoned(chunk.device) {
                    let at = chunk.cur_off();
                    self.finish_chunk(batch, chunk, Err(IoErrKind::Poisoned), at);
                    continue;
                }
                self.push(d, batch, chunk);
            }
        }
    }

    fn push(&mut self, d: usize, batch: usize, chunk: Chunk) {
        let Some(Some(fixed)) = self.fixed.get(d).copied() else {
            let at = chunk.cur_off();
            self.finish_chunk(batch, chunk, Err(IoErrKind::NoDevice), at);
            return;
        };
        let Some(base) = self.batches[batch].as_ref().map(|b| b.base) else {
            return;
        };
        let fd = io_uring::types::Fixed(fixed);
        let iovecs = chunk.iovecs(base);
        let off = chunk.cur_off();
        let plain = iovecs.len() == 1 && chunk.len - chunk.done <= MAX_PLAIN_RW;
        let entry = match chunk.kind {
            OpKind::Read if plain => {
                io_uring::opcode::Read::new(fd, iovecs[0].iov_base.cast(), iovecs[0].iov_len as u32)
                    .offset(off)
                    .build()
            }
            OpKind::Write if plain => io_uring::opcode::Write::new(
                fd,
                iovecs[0].iov_base.cast::<u8>().cast_const(),
                iovecs[0].iov_len as u32,
            )
            .offset(off)
            .build(),
            OpKind::Read => io_uring::opcode::Readv::new(fd, iovecs.as_ptr(), iovecs.len() as u32)
                .offset(off)
                .build(),
            OpKind::Write => {
                io_uring::opcode::Writev::new(fd, iovecs.as_ptr(), iovecs.len() as u32)
                    .offset(off)
                    .build()
            }
            OpKind::Flush => io_uring::opcode::Fsync::new(fd)
                .flags(io_uring::types::FsyncFlags::DATASYNC)
                .build(),
        };
        let slot = self.free_slots.pop().unwrap_or_else(|| {
            self.in_flight.push(None);
            self.in_flight.len() - 1
        });
        let entry = entry.user_data(slot as u64);
        // SAFETY: the SQE points at (a) the iovec array, moved into `in_flight[slot]` below
        // (moving a Vec does not move its heap array) and kept there until this SQE's
        // completion is reaped, and (b) bytes of the batch's buffer inside bounds-checked
        // pieces; the buffer stays owned by `batches[batch]` until every chunk of the batch
        // has completed. The SQ has room: `total < cap` = entries - 1 and the wake read takes
        // at most one more.
        match unsafe { self.ring.submission().push(&entry) } {
            Ok(()) => {
                let started = self.state.begin_request(chunk.device);
                self.in_flight[slot] = Some(InFlight {
                    batch,
                    chunk,
                    started,
                    _iovecs: iovecs,
                });
                self.in_dev[d] += 1;
                self.total += 1;
            }
            Err(_) => {
                self.free_slots.push(slot);
                self.queues[d].push_front((batch, chunk));
            }
        }
    }

    fn complete(&mut self, slot: usize, res: i64) {
        let Some(InFlight {
            batch,
            mut chunk,
            started,
            ..
        }) = self.in_flight.get_mut(slot).and_then(Option::take)
        else {
            tracing::error!(slot, "io_uring completion for an unknown slot");
            return;
        };
        self.state.end_request(chunk.device, chunk.kind, started);
        self.free_slots.push(slot);
        let d = chunk.device.as_usize();
        self.in_dev[d] -= 1;
        self.total -= 1;
        let at = chunk.cur_off();
        match judge(&mut chunk, res) {
            Next::Done => self.finish_chunk(batch, chunk, Ok(()), at),
            Next::Again => self.queues[d].push_front((batch, chunk)),
            Next::Failed(kind) => self.finish_chunk(batch, chunk, Err(kind), at),
        }
    }

    fn finish_chunk(
        &mut self,
        batch: usize,
        chunk: Chunk,
        outcome: Result<(), IoErrKind>,
        at: u64,
    ) {
        if outcome.is_err() {
            self.state.count_error(chunk.device);
            if chunk.kind != OpKind::Read {
                self.state.poison(chunk.device);
            }
        }
        let Some(b) = self.batches.get_mut(batch).and_then(Option::as_mut) else {
            return;
        };
        let outcome = outcome.map_err(|kind| b.agg.err(chunk.op, at, kind));
        if b.agg.chunk_done(chunk.op, outcome)
            && let Some(b) = self.batches[batch].take()
        {
            self.free_batches.push(batch);
            // The caller may have stopped waiting; the buffer is then freed here.
            let _ = b.tx.send(Completed {
                buf: b.buf,
                results: b.agg.finish(),
            });
        }
    }
}

// ---------------------------------------------------------------------------------------------
// synchronous engine

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
    workers: Vec<Option<mpsc::Sender<SyncJob>>>,
    threads: Vec<JoinHandle<()>>,
    state: Arc<DeviceState>,
}

impl std::fmt::Debug for SyncEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SyncEngine")
            .field("devices", &self.state.present.len())
            .finish()
    }
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
            let (tx, rx) = mpsc::channel::<SyncJob>();
            let state = Arc::clone(&state);
            threads.push(
                std::thread::Builder::new()
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
                    })?,
            );
            workers.push(Some(tx));
        }
        Ok(SyncEngine {
            workers,
            threads,
            state,
        })
    }

    fn submit(&self, mut buf: AlignedBuf, ops: Vec<DeviceOp>) -> oneshot::Receiver<Completed> {
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
            let sent = match self.workers.get(chunk.device.as_usize()) {
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
    fn replace(&self, device: DeviceIndex, file: File) -> oneshot::Receiver<io::Result<()>> {
        let (tx, rx) = oneshot::channel();
        match self.workers.get(device.as_usize()) {
            Some(Some(w)) => {
                // A send error drops `tx`: the caller sees the engine stopped.
                let _ = w.send(SyncJob::Replace(file, tx));
            }
            _ => {
                let _ = tx.send(Err(io::Error::other(
                    "the device had no handle when the engine started",
                )));
            }
        }
        rx
    }
}

impl Drop for SyncEngine {
    fn drop(&mut self) {
        self.workers.clear();
        for t in self.threads.drain(..) {
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

// ---------------------------------------------------------------------------------------------
// plans

/// Why a plan could not be executed.
#[derive(Debug, thiserror::Error)]
pub enum PlanIoError {
    #[error("buffer of {have} bytes cannot hold the planned {need} bytes")]
    BufferTooSmall { need: u64, have: usize },
    #[error("{} of the plan's device I/Os failed; first: {}", .0.len(), .0[0])]
    Device(Vec<IoErr>),
    #[error(transparent)]
    Stopped(#[from] EngineStopped),
}

impl PlanIoError {
    /// The error as an errno for the file system caller.
    pub fn errno(&self) -> i32 {
        match self {
            PlanIoError::BufferTooSmall { .. } => libc::EINVAL,
            PlanIoError::Device(errs) => errs.first().map_or(libc::EIO, IoErr::errno),
            PlanIoError::Stopped(_) => libc::EIO,
        }
    }
}

fn fit(buf: &mut AlignedBuf, plan: &IoPlan) -> Result<(), PlanIoError> {
    let need = plan.len;
    match usize::try_from(need) {
        Ok(n) if buf.set_len(n) => Ok(()),
        _ => Err(PlanIoError::BufferTooSmall {
            need,
            have: buf.capacity(),
        }),
    }
}

async fn run_plan(
    engine: &Engine,
    buf: AlignedBuf,
    ops: Vec<DeviceOp>,
) -> Result<AlignedBuf, PlanIoError> {
    let done = engine.submit(buf, ops).await?;
    let failures: Vec<IoErr> = done.results.into_iter().filter_map(Result::err).collect();
    if failures.is_empty() {
        Ok(done.buf)
    } else {
        Err(PlanIoError::Device(failures))
    }
}

/// Reads `plan` into `buf` (its length set to `plan.len`, within its capacity): holes and
/// unwritten extents are zeroed, every device I/O reads straight into its buffer pieces, all
/// devices at once. Returns the filled buffer, or every failed device I/O.
pub async fn execute_read(
    engine: &Engine,
    plan: &IoPlan,
    mut buf: AlignedBuf,
) -> Result<AlignedBuf, PlanIoError> {
    fit(&mut buf, plan)?;
    for z in &plan.zero_fill {
        let start = usize::try_from(z.buf_off).unwrap_or(usize::MAX);
        let end = start.saturating_add(usize::try_from(z.len).unwrap_or(usize::MAX));
        match buf.get_mut(start..end) {
            Some(s) => s.fill(0),
            None => {
                return Err(PlanIoError::BufferTooSmall {
                    need: z.buf_off.saturating_add(z.len),
                    have: buf.len(),
                });
            }
        }
    }
    let ops = plan.device_ios.iter().map(DeviceOp::read).collect();
    run_plan(engine, buf, ops).await
}

/// Writes `buf`'s first `plan.len` bytes as `plan` says, all devices at once, each device I/O
/// gathering its buffer pieces. Returns the buffer, or every failed device I/O.
pub async fn execute_write(
    engine: &Engine,
    plan: &IoPlan,
    mut buf: AlignedBuf,
) -> Result<AlignedBuf, PlanIoError> {
    fit(&mut buf, plan)?;
    let ops = plan.device_ios.iter().map(DeviceOp::write).collect();
    run_plan(engine, buf, ops).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::FileExt;

    fn files(n: usize, len: u64) -> (tempfile::TempDir, Vec<File>) {
        let dir = tempfile::tempdir().unwrap();
        let files = (0..n)
            .map(|i| {
                let f = std::fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create(true)
                    .truncate(true)
                    .open(dir.path().join(format!("lun{i}")))
                    .unwrap();
                f.set_len(len).unwrap();
                f
            })
            .collect();
        (dir, files)
    }

    fn dup(files: &[File]) -> Vec<Option<File>> {
        files.iter().map(|f| Some(f.try_clone().unwrap())).collect()
    }

    fn engines(files: &[File]) -> Vec<Engine> {
        let mut out = vec![
            Engine::new(
                &EngineConfig {
                    kind: EngineKind::Sync,
                    queue_depth_per_device: 4,
                },
                dup(files),
            )
            .unwrap(),
        ];
        match Engine::new(
            &EngineConfig {
                kind: EngineKind::Uring,
                queue_depth_per_device: 2,
            },
            dup(files),
        ) {
            Ok(e) => out.push(e),
            Err(e) => {
                let thread = std::thread::current();
                let test = thread.name().unwrap_or("an engine test");
                sanfs_testcluster::skip(&format!("{test}, uring engine"), &format!("{e}"));
            }
        }
        out
    }

    fn piece(buf_off: u64, len: u64) -> BufRange {
        BufRange { buf_off, len }
    }

    #[test]
    fn chunks_split_at_iov_max_and_resume_after_short_transfers() {
        let state = DeviceState::new(&[None, None]);
        let state = DeviceState {
            present: vec![true, false],
            ..state
        };
        let iov: Vec<BufRange> = (0..2500).map(|i| piece(i * 8, 4)).collect();
        let ops = vec![
            DeviceOp {
                device: DeviceIndex(0),
                phys_off: 4096,
                kind: OpKind::Read,
                iov,
            },
            DeviceOp {
                device: DeviceIndex(1),
                phys_off: 0,
                kind: OpKind::Read,
                iov: vec![piece(0, 4)],
            },
            DeviceOp {
                device: DeviceIndex(0),
                phys_off: 0,
                kind: OpKind::Write,
                iov: vec![piece(30_000, 4096)],
            },
        ];
        let (agg, mut chunks) = prepare(&ops, 20_000, &state);
        assert_eq!(chunks.len(), 3);
        assert_eq!(chunks[1].phys_off, 4096 + 1024 * 4);
        assert_eq!(chunks[2].len, (2500 - 2048) * 4);
        assert_eq!(
            agg.results[1].as_ref().unwrap().as_ref().unwrap_err().error,
            IoErrKind::NoDevice
        );
        assert_eq!(
            agg.results[2].as_ref().unwrap().as_ref().unwrap_err().error,
            IoErrKind::BadRange
        );
        let c = &mut chunks[0];
        assert!(matches!(judge(c, 6), Next::Again));
        let iov = c.iovecs(BufPtr(std::ptr::null_mut()));
        assert_eq!(iov.len(), 1023);
        assert_eq!((iov[0].iov_base as usize, iov[0].iov_len), (10, 2));
        assert!(matches!(judge(c, -i64::from(libc::EINTR)), Next::Again));
        assert!(matches!(
            judge(c, 0),
            Next::Failed(IoErrKind::UnexpectedEof)
        ));
        assert!(matches!(
            judge(c, -i64::from(libc::EIO)),
            Next::Failed(IoErrKind::Os(libc::EIO))
        ));
    }

    #[tokio::test]
    async fn both_engines_scatter_and_gather_across_devices() {
        let (_dir, files) = files(3, 1 << 20);
        for engine in engines(&files) {
            let mut buf = AlignedBuf::zeroed(6 * 4096);
            for (i, b) in buf.iter_mut().enumerate() {
                *b = (i / 4096) as u8 + 1;
            }
            // Pages 0 and 3 to d0 (one gathered write), 1 to d1, 2 to d2, 4..6 to d0 later.
            let ops = vec![
                DeviceOp {
                    device: DeviceIndex(0),
                    phys_off: 8192,
                    kind: OpKind::Write,
                    iov: vec![piece(0, 4096), piece(3 * 4096, 4096)],
                },
                DeviceOp {
                    device: DeviceIndex(1),
                    phys_off: 4096,
                    kind: OpKind::Write,
                    iov: vec![piece(4096, 4096)],
                },
                DeviceOp {
                    device: DeviceIndex(2),
                    phys_off: 0,
                    kind: OpKind::Write,
                    iov: vec![piece(2 * 4096, 4096)],
                },
                DeviceOp {
                    device: DeviceIndex(0),
                    phys_off: 65536,
                    kind: OpKind::Write,
                    iov: vec![piece(4 * 4096, 2 * 4096)],
                },
                DeviceOp::flush(DeviceIndex(1)),
            ];
            let done = engine.submit(buf, ops.clone()).await.unwrap();
            assert!(
                done.results.iter().all(Result::is_ok),
                "{}: {:?}",
                engine.name(),
                done.results
            );
            let mut page = vec![0u8; 4096];
            files[0].read_exact_at(&mut page, 8192 + 4096).unwrap();
            assert!(page.iter().all(|&b| b == 4));
            files[2].read_exact_at(&mut page, 0).unwrap();
            assert!(page.iter().all(|&b| b == 3));

            let reads: Vec<DeviceOp> = ops
                .into_iter()
                .map(|o| DeviceOp {
                    kind: if o.kind == OpKind::Write {
                        OpKind::Read
                    } else {
                        o.kind
                    },
                    ..o
                })
                .collect();
            let back = engine
                .submit(AlignedBuf::zeroed(6 * 4096), reads)
                .await
                .unwrap();
            assert!(back.results.iter().all(Result::is_ok));
            assert_eq!(
                back.buf.as_slice(),
                done.buf.as_slice(),
                "{}",
                engine.name()
            );
        }
    }

    #[tokio::test]
    async fn errors_are_per_op_and_failed_writes_poison_the_device() {
        let (_dir, files) = files(2, 8192);
        for engine in engines(&files) {
            let ops = vec![
                DeviceOp {
                    device: DeviceIndex(0),
                    phys_off: 0,
                    kind: OpKind::Read,
                    iov: vec![piece(0, 4096)],
                },
                DeviceOp {
                    device: DeviceIndex(1),
                    phys_off: 4096,
                    kind: OpKind::Read,
                    iov: vec![piece(4096, 8192)],
                },
                DeviceOp {
                    device: DeviceIndex(7),
                    phys_off: 0,
                    kind: OpKind::Read,
                    iov: vec![piece(0, 4096)],
                },
            ];
            let done = engine
                .submit(AlignedBuf::zeroed(3 * 4096), ops)
                .await
                .unwrap();
            assert!(done.results[0].is_ok());
            let e = done.results[1].as_ref().unwrap_err();
            assert_eq!(
                (e.error, e.failed_at, e.errno()),
                (IoErrKind::UnexpectedEof, 8192, libc::EIO)
            );
            assert_eq!(
                done.results[2].as_ref().unwrap_err().error,
                IoErrKind::NoDevice
            );

            // Poisoned by hand here; a real failed write is in the next test.
            assert!(!engine.is_poisoned(DeviceIndex(0)));
            engine.state().poison(DeviceIndex(0));
            let done = engine
                .submit(
                    AlignedBuf::zeroed(4096),
                    vec![DeviceOp {
                        device: DeviceIndex(0),
                        phys_off: 0,
                        kind: OpKind::Read,
                        iov: vec![piece(0, 4096)],
                    }],
                )
                .await
                .unwrap();
            assert_eq!(
                done.results[0].as_ref().unwrap_err().error,
                IoErrKind::Poisoned
            );
            engine.clear_poison(DeviceIndex(0));
            assert!(!engine.is_poisoned(DeviceIndex(0)));
        }
    }

    #[tokio::test]
    async fn a_failed_write_poisons_its_device_only() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ro");
        std::fs::write(&path, vec![0u8; 8192]).unwrap();
        let (_d2, ok) = files(1, 8192);
        let devs = || {
            vec![
                Some(File::open(&path).unwrap()), // read-only: writes fail with EBADF
                Some(ok[0].try_clone().unwrap()),
            ]
        };
        let mut all = vec![
            Engine::new(
                &EngineConfig {
                    kind: EngineKind::Sync,
                    queue_depth_per_device: 1,
                },
                devs(),
            )
            .unwrap(),
        ];
        if let Ok(e) = Engine::new(&EngineConfig::default(), devs()) {
            all.push(e);
        }
        for engine in all {
            let w = |d| DeviceOp {
                device: DeviceIndex(d),
                phys_off: 0,
                kind: OpKind::Write,
                iov: vec![piece(0, 4096)],
            };
            let done = engine
                .submit(AlignedBuf::zeroed(4096), vec![w(0), w(1)])
                .await
                .unwrap();
            assert_eq!(
                done.results[0].as_ref().unwrap_err().errno(),
                libc::EBADF,
                "{}",
                engine.name()
            );
            assert!(done.results[1].is_ok());
            assert!(engine.is_poisoned(DeviceIndex(0)));
            assert!(!engine.is_poisoned(DeviceIndex(1)));
        }
    }

    #[tokio::test]
    async fn stats_count_ops_requests_and_overlap_and_a_replaced_handle_is_used() {
        let (_dir2, fresh) = files(1, 1 << 20);
        let (_dir, files) = files(4, 1 << 20);
        for engine in engines(&files) {
            let read = |d| DeviceOp {
                device: DeviceIndex(d),
                phys_off: 4096,
                kind: OpKind::Read,
                iov: vec![piece(u64::from(d) * 8192, 8192)],
            };
            engine.reset_max_in_flight();
            let done = engine
                .submit(AlignedBuf::zeroed(4 * 8192), (0..4).map(read).collect())
                .await
                .unwrap();
            assert!(done.results.iter().all(Result::is_ok));
            let st = engine.stats();
            for d in &st.devices {
                assert_eq!((d.read_ops, d.read_bytes, d.submissions), (1, 8192, 1));
                assert_eq!((d.write_ops, d.errors), (0, 0));
            }
            assert_eq!(st.in_flight, 0);
            assert!(st.max_in_flight >= 1 && st.max_in_flight <= 4, "{st:?}");
            if engine.name() == "uring" {
                // One ring: the batch's four requests enter the kernel together.
                assert_eq!(st.max_in_flight, 4, "{st:?}");
            }
            // Device 2 now writes to another file.
            engine
                .replace_device(DeviceIndex(2), fresh[0].try_clone().unwrap())
                .await
                .unwrap();
            let mut buf = AlignedBuf::zeroed(4096);
            buf.as_mut_slice().fill(0xee);
            let w = DeviceOp {
                device: DeviceIndex(2),
                phys_off: 0,
                kind: OpKind::Write,
                iov: vec![piece(0, 4096)],
            };
            let done = engine.submit(buf, vec![w]).await.unwrap();
            assert!(done.results[0].is_ok());
            let mut got = [0u8; 4096];
            fresh[0].read_exact_at(&mut got, 0).unwrap();
            assert_eq!(got, [0xee; 4096], "{}", engine.name());
            files[2].read_exact_at(&mut got, 0).unwrap();
            assert_eq!(got, [0; 4096], "the old handle is no longer written");
            fresh[0].write_all_at(&[0; 4096], 0).unwrap();
            assert_eq!(engine.stats().devices[2].write_ops, 1);
        }
    }

    #[tokio::test]
    async fn empty_batches_and_dropped_futures_are_harmless() {
        let (_dir, files) = files(1, 1 << 20);
        for engine in engines(&files) {
            let done = engine
                .submit(AlignedBuf::zeroed(0), Vec::new())
                .await
                .unwrap();
            assert!(done.results.is_empty());
            for _ in 0..20 {
                drop(engine.submit(
                    AlignedBuf::zeroed(65536),
                    vec![DeviceOp {
                        device: DeviceIndex(0),
                        phys_off: 0,
                        kind: OpKind::Read,
                        iov: vec![piece(0, 65536)],
                    }],
                ));
            }
            drop(engine); // joins after the abandoned I/O completes
        }
    }
}
