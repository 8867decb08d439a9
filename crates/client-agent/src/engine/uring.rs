//! The `io_uring` backend: one ring on a dedicated thread, the LUNs' descriptors registered
//! as fixed files, a queue depth per device, and vectored reads and writes whose iovecs point
//! straight into the caller's aligned buffer.

use std::collections::VecDeque;
use std::fs::File;
use std::io::{self, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::{Arc, mpsc};
use std::thread::JoinHandle;
use std::time::Instant;

use sanfs_blockmap::volume::DeviceIndex;
use tokio::sync::oneshot;

use super::batch::{BatchResults, BufPtr, Chunk, Next, judge, prepare};
use super::{Completed, DeviceOp, DeviceState, IoErrKind, OpKind};
use crate::buf::AlignedBuf;

/// Largest single-buffer `IORING_OP_READ`/`WRITE` (its length is a `u32`).
const MAX_PLAIN_RW: u64 = 1 << 30;

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
    pub(super) state: Arc<DeviceState>,
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
                // Slot i is device i; a device without a handle yet is a sparse slot (-1)
                // that `replace` fills.
                let fds: Vec<RawFd> = devices
                    .iter()
                    .map(|d| d.as_ref().map_or(-1, |f| f.as_raw_fd()))
                    .collect();
                if !fds.is_empty()
                    && let Err(e) = ring.submitter().register_files(&fds)
                {
                    let _ = ready_tx.send(Err(e));
                    return;
                }
                let _ = ready_tx.send(Ok(()));
                let mut worker = UringWorker {
                    ring,
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
    pub(super) fn replace(
        &self,
        device: DeviceIndex,
        file: File,
    ) -> oneshot::Receiver<io::Result<()>> {
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
        let mut cpu = crate::stages::ThreadCpu::start();
        loop {
            cpu.tick(crate::stages::Stage::Engine);
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
        let Some(slot) = self.files.get_mut(device) else {
            return Err(io::Error::other(format!(
                "device d{device} is beyond the engine's {} slots",
                self.queues.len()
            )));
        };
        let index = u32::try_from(device).map_err(io::Error::other)?;
        self.ring
            .submitter()
            .register_files_update(index, &[file.as_raw_fd()])?;
        *slot = Some(file);
        self.state.set_present(DeviceIndex(index));
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
        let fixed = match self.files.get(d) {
            Some(Some(_)) => u32::try_from(d).unwrap_or(u32::MAX),
            _ => {
                let at = chunk.cur_off();
                self.finish_chunk(batch, chunk, Err(IoErrKind::NoDevice), at);
                return;
            }
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
