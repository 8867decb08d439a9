//! One batch's bookkeeping, shared by both backends: [`prepare`] checks every op against the
//! buffer and the devices and cuts the valid ones into [`Chunk`]s (at most [`MAX_IOVECS`]
//! pieces each), [`judge`] decides what a kernel answer means for a chunk (done, again after a
//! short transfer or `EINTR`, failed), and [`BatchResults`] collects one result per op.

use sanfs_blockmap::plan::BufRange;
use sanfs_blockmap::volume::DeviceIndex;

use super::{DeviceOp, DeviceState, IoErr, IoErrKind, OpKind};

/// Most iovecs in one vectored I/O (Linux's `IOV_MAX`); longer ops are split.
pub(super) const MAX_IOVECS: usize = 1024;
/// How often `EINTR`/`EAGAIN` is retried before it counts as a failure.
const MAX_RETRIES: u32 = 100;

/// A pointer into a batch's buffer, handed to the kernel.
#[derive(Debug, Clone, Copy)]
pub(super) struct BufPtr(pub(super) *mut u8);

// SAFETY: the pointer is the start of the AlignedBuf owned by the same batch; that buffer is
// neither used nor freed by Rust code until every chunk of the batch has completed (it only
// goes back to the caller, or is dropped, after the last completion), and while chunks are in
// flight the memory is touched only through iovecs covering bounds-checked pieces.
unsafe impl Send for BufPtr {}
// SAFETY: as above; sharing the pointer value between worker threads creates no references.
unsafe impl Sync for BufPtr {}

/// A piece of work for one device: all or part (at most [`MAX_IOVECS`] pieces) of one op.
#[derive(Debug)]
pub(super) struct Chunk {
    pub(super) op: usize,
    pub(super) device: DeviceIndex,
    pub(super) kind: OpKind,
    /// Device byte of the chunk's first piece.
    pub(super) phys_off: u64,
    pub(super) len: u64,
    pub(super) pieces: Vec<BufRange>,
    /// Bytes transferred so far (a short transfer resubmits the rest).
    pub(super) done: u64,
    pub(super) retries: u32,
}

impl Chunk {
    pub(super) fn cur_off(&self) -> u64 {
        self.phys_off + self.done
    }

    /// The iovecs for the bytes not yet transferred.
    pub(super) fn iovecs(&self, base: BufPtr) -> Vec<libc::iovec> {
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
pub(super) struct BatchResults {
    pub(super) ops: Vec<(DeviceIndex, OpKind, u64, u64)>,
    pub(super) results: Vec<Option<Result<(), IoErr>>>,
    pub(super) chunks_left: Vec<u32>,
    pub(super) ops_left: usize,
}

impl BatchResults {
    pub(super) fn err(&self, op: usize, failed_at: u64, error: IoErrKind) -> IoErr {
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
    pub(super) fn chunk_done(&mut self, op: usize, outcome: Result<(), IoErr>) -> bool {
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

    pub(super) fn finish(self) -> Vec<Result<(), IoErr>> {
        self.results
            .into_iter()
            .map(|r| r.unwrap_or(Ok(())))
            .collect()
    }
}

/// Checks every op against the buffer and the devices, and cuts the valid ones into chunks.
/// Ops that fail the checks (or are empty) already have their result.
pub(super) fn prepare(
    ops: &[DeviceOp],
    buf_len: usize,
    state: &DeviceState,
) -> (BatchResults, Vec<Chunk>) {
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
        let check = if !state.is_present(op.device) {
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
pub(super) enum Next {
    Done,
    Again,
    Failed(IoErrKind),
}

pub(super) fn judge(chunk: &mut Chunk, res: i64) -> Next {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn piece(buf_off: u64, len: u64) -> BufRange {
        BufRange { buf_off, len }
    }

    #[test]
    fn chunks_split_at_iov_max_and_resume_after_short_transfers() {
        let state = DeviceState::new(&[None, None]);
        let state = DeviceState {
            present: vec![true.into(), false.into()],
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
}
