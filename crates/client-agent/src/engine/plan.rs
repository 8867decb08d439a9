//! Running an [`IoPlan`] through an engine: [`execute_read`] and [`execute_write`] use one
//! buffer of the planned range, zero fill for holes, and each device I/O's `iov` pieces as its
//! iovecs.

use sanfs_blockmap::plan::IoPlan;

use super::{DeviceOp, Engine, EngineStopped, IoErr};
use crate::buf::AlignedBuf;

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
