//! Sequential I/O of one size against one target, timed: the measuring loop every
//! throughput figure uses.
//!
//! A target is a file of `len` bytes reached one way: raw `O_DIRECT` on the LUN blocks that
//! hold a sanfs file (the agent's own io_uring engine, no server: the limit), the sanfs
//! library (direct or proxied path), a path on a mounted file system (the FUSE mount, a
//! local file system), or an NFS file (libnfs). Every run reads or writes `size` bytes at a
//! time from offset 0 onwards, wrapping at the end of the file, one I/O at a time (queue
//! depth 1, as an application's `read`/`write` loop), until its [`Budget`] is spent.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, bail};
use sanfs_blockmap::extent::ExtentMap;
use sanfs_blockmap::plan::{IoPlan, PlanMethod, PlanOp, plan};
use sanfs_blockmap::volume::Volume;
use sanfs_client_agent::buf::AlignedBuf;
use sanfs_client_agent::client::{Client, FileHandle};
use sanfs_client_agent::engine::{Engine, execute_read, execute_write};
use sanfs_proto::types::{Credentials, InodeId};

use crate::util::{Budget, mb_per_s, pattern};

/// Read or write.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Op {
    Read,
    Write,
}

impl Op {
    pub fn name(self) -> &'static str {
        match self {
            Op::Read => "read",
            Op::Write => "write",
        }
    }
}

/// What one timed run did.
#[derive(Debug, Clone, Copy, Default, serde::Serialize, serde::Deserialize)]
pub struct Sample {
    pub ops: u64,
    pub bytes: u64,
    pub secs: f64,
    pub mb_s: f64,
}

impl Sample {
    pub fn new(ops: u64, bytes: u64, secs: f64) -> Sample {
        Sample {
            ops,
            bytes,
            secs,
            mb_s: mb_per_s(bytes, secs),
        }
    }
}

/// Raw `O_DIRECT` on the blocks of one sanfs file, with the agent's engine.
pub struct RawFile {
    pub engine: Arc<Engine>,
    pub volume: Volume,
    pub extents: ExtentMap,
    pub len: u64,
}

/// A sanfs file through the library.
pub struct LibFile {
    pub client: Arc<Client>,
    pub fh: FileHandle,
    pub ino: InodeId,
    pub len: u64,
}

/// How a run reaches its file.
pub enum Target {
    Raw(Arc<RawFile>),
    Lib(Arc<LibFile>),
    /// A file on a mounted file system (the FUSE mount, a local one); `len` bytes.
    Path(Arc<File>, u64),
}

impl Target {
    /// Bytes of the file the runs cycle through.
    pub fn file_len(&self) -> u64 {
        match self {
            Target::Raw(r) => r.len,
            Target::Lib(l) => l.len,
            Target::Path(_, len) => *len,
        }
    }
}

/// Offsets `0, size, 2 size, ...` below `len - size + 1`, wrapping.
fn offsets(len: u64, size: u64) -> anyhow::Result<u64> {
    if size == 0 || size > len {
        bail!("I/O size {size} does not fit a file of {len} bytes");
    }
    Ok(len / size)
}

/// Runs `op` of `size` bytes against `target` until `budget` is spent.
pub async fn run(target: &Target, op: Op, size: u64, budget: Budget) -> anyhow::Result<Sample> {
    let slots = offsets(target.file_len(), size)?;
    match target {
        Target::Raw(raw) => run_raw(raw, op, size, slots, budget).await,
        Target::Lib(lib) => run_lib(lib, op, size, slots, budget).await,
        Target::Path(file, _) => {
            let file = Arc::clone(file);
            tokio::task::spawn_blocking(move || run_path(&file, op, size, slots, budget))
                .await
                .context("I/O thread")?
        }
    }
}

async fn run_raw(
    raw: &RawFile,
    op: Op,
    size: u64,
    slots: u64,
    budget: Budget,
) -> anyhow::Result<Sample> {
    let kind = match op {
        Op::Read => PlanOp::Read,
        Op::Write => PlanOp::Write,
    };
    // Plans first, so that the timed loop is the device I/O alone.
    let cap = slots.min(budget.max_ops).min(1 << 16);
    let plans: Vec<IoPlan> = (0..cap)
        .map(|i| {
            plan(
                kind,
                i * size,
                size,
                &raw.extents,
                &raw.volume,
                PlanMethod::Coalesced,
            )
        })
        .collect::<Result<_, _>>()
        .context("plan raw I/O")?;
    let mut buf = AlignedBuf::from_slice(&pattern(size as usize, size));
    let started = Instant::now();
    let mut ops = 0u64;
    while !budget.done(ops, started) {
        let p = &plans[(ops % cap) as usize];
        buf = match op {
            Op::Read => execute_read(&raw.engine, p, buf).await,
            Op::Write => execute_write(&raw.engine, p, buf).await,
        }
        .map_err(|e| anyhow::anyhow!("raw {}: {e}", op.name()))?;
        ops += 1;
    }
    let secs = started.elapsed().as_secs_f64();
    Ok(Sample::new(ops, ops * size, secs))
}

async fn run_lib(
    lib: &LibFile,
    op: Op,
    size: u64,
    slots: u64,
    budget: Budget,
) -> anyhow::Result<Sample> {
    let cred = Credentials::root();
    // The library's aligned calls: the device I/O lands in (or leaves from) this buffer
    // itself, as raw I/O does; smaller or unaligned I/O takes their copying fallback.
    let mut buf = AlignedBuf::from_slice(&pattern(size as usize, size ^ 0x5a));
    let started = Instant::now();
    let mut ops = 0u64;
    while !budget.done(ops, started) {
        let off = (ops % slots) * size;
        match op {
            Op::Read => {
                let (b, n) = lib
                    .client
                    .read_aligned(&cred, &lib.fh, lib.ino, off, buf)
                    .await
                    .with_context(|| format!("read {size} at {off}"))?;
                if n != b.len() {
                    bail!("short read: {n} of {size} bytes at {off}");
                }
                buf = b;
            }
            Op::Write => {
                let (b, _) = lib
                    .client
                    .write_aligned(&cred, &lib.fh, lib.ino, off, buf)
                    .await
                    .with_context(|| format!("write {size} at {off}"))?;
                buf = b;
            }
        }
        ops += 1;
    }
    let secs = started.elapsed().as_secs_f64();
    Ok(Sample::new(ops, ops * size, secs))
}

fn run_path(file: &File, op: Op, size: u64, slots: u64, budget: Budget) -> anyhow::Result<Sample> {
    // Aligned, so that a file opened with O_DIRECT works too.
    let mut buf = AlignedBuf::from_slice(&pattern(size as usize, size ^ 0xa5));
    let started = Instant::now();
    let mut ops = 0u64;
    while !budget.done(ops, started) {
        let off = (ops % slots) * size;
        match op {
            Op::Read => file.read_exact_at(buf.as_mut_slice(), off),
            Op::Write => file.write_all_at(buf.as_slice(), off),
        }
        .with_context(|| format!("{} {size} at {off}", op.name()))?;
        ops += 1;
    }
    let secs = started.elapsed().as_secs_f64();
    Ok(Sample::new(ops, ops * size, secs))
}

/// Fills `[0, len)` of a library file with data, `chunk` bytes at a time (direct path), and
/// makes it durable: the files the figures read are written first.
pub async fn fill(lib: &LibFile, chunk: u64) -> anyhow::Result<()> {
    let cred = Credentials::root();
    let data = pattern(chunk as usize, 7);
    let mut off = 0;
    while off < lib.len {
        let n = chunk.min(lib.len - off) as usize;
        lib.client
            .write_at(&cred, &lib.fh, lib.ino, off, &data[..n])
            .await
            .with_context(|| format!("fill at {off}"))?;
        off += n as u64;
    }
    lib.client
        .fsync(&cred, &lib.fh, lib.ino, false)
        .await
        .context("fsync the filled file")?;
    Ok(())
}
