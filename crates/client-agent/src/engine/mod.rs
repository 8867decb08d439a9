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
//! [`execute_read`] and [`execute_write`] run an [`IoPlan`](sanfs_blockmap::plan::IoPlan) against one buffer of the planned
//! range: zero fill for holes, and each device I/O's `iov` pieces used as its iovecs.
//!
//! The module's files follow those seams: this file holds the types the callers see, the
//! per-device state and the [`Engine`] enum; `batch` checks a batch's ops and cuts them into
//! chunks (shared by both backends); `uring` and `sync` are the two backends; `plan` runs an
//! [`IoPlan`](sanfs_blockmap::plan::IoPlan) through an engine.

use std::fs::File;
use std::future::Future;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

use sanfs_blockmap::plan::{BufRange, DeviceIo};
use sanfs_blockmap::volume::DeviceIndex;

use crate::buf::AlignedBuf;

mod batch;
mod plan;
mod sync;
#[cfg(test)]
mod tests;
mod uring;

pub use plan::{PlanIoError, execute_read, execute_write};
pub use sync::SyncEngine;
pub use uring::UringEngine;

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
    /// Per slot: whether it has a handle (set for good by [`Engine::replace_device`]).
    present: Vec<AtomicBool>,
    poisoned: Vec<AtomicBool>,
    counters: Vec<DeviceCounters>,
    /// Made at a slot's first request, so that spare slots show no series.
    latency: Vec<std::sync::OnceLock<DeviceLatency>>,
    in_flight: AtomicU64,
    max_in_flight: AtomicU64,
}

impl DeviceState {
    fn new(files: &[Option<File>]) -> DeviceState {
        DeviceState {
            present: files.iter().map(|f| AtomicBool::new(f.is_some())).collect(),
            poisoned: files.iter().map(|_| AtomicBool::new(false)).collect(),
            counters: files.iter().map(|_| DeviceCounters::default()).collect(),
            latency: files.iter().map(|_| std::sync::OnceLock::new()).collect(),
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
            let l = l.get_or_init(|| DeviceLatency::new(d.as_usize()));
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

    fn is_present(&self, d: DeviceIndex) -> bool {
        self.present
            .get(d.as_usize())
            .is_some_and(|p| p.load(Ordering::Acquire))
    }

    fn set_present(&self, d: DeviceIndex) {
        if let Some(p) = self.present.get(d.as_usize()) {
            p.store(true, Ordering::Release);
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
        use crate::stages::{Span, Stage};
        let bytes: u64 = ops.iter().map(DeviceOp::len).sum();
        let started = Instant::now();
        let rx = {
            let mut span = Span::cpu(Stage::Submit);
            span.set_bytes(bytes);
            match self {
                Engine::Uring(e) => e.submit(buf, ops),
                Engine::Sync(e) => e.submit(buf, ops),
            }
        };
        async move {
            let mut wait = Span::wall_since(Stage::DeviceWait, started);
            wait.set_bytes(bytes);
            rx.await.map_err(|_| EngineStopped)
        }
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
    /// flight on the old handle finish on it. A slot that had no handle yet (a LUN found by a
    /// later rescan, or added by a growth of the volume) takes one the same way; a device
    /// beyond [`Engine::slots`] cannot.
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

    /// Device slots: the devices given at start, present or not (and any spare ones).
    pub fn slots(&self) -> usize {
        self.state().present.len()
    }

    /// Whether `device` has a handle.
    pub fn has_device(&self, device: DeviceIndex) -> bool {
        self.state().is_present(device)
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
