//! Where the metadata store's bytes live: redb's `StorageBackend` seam.
//!
//! - a file on local disk: redb's own file backend (the embedded default);
//! - [`super::device::BlockDeviceBackend`]: a block device of its own (the metadata LUN, which
//!   every metadata server candidate of an HA pair sees);
//! - redb's in-memory backend, for tests;
//! - [`SimDisk`]: a crash-simulating, fault-injecting backend for the crash tests. It keeps a
//!   *live* image (what reads see) and a *durable* image (what survives a crash). Writes go to
//!   the live image and are remembered as pending; `sync_data` makes them durable. It can crash
//!   after the Nth write, set_len or sync: from then on every call fails, and the durable image
//!   is the last synced one plus a random subset of the pending writes, the last of which may
//!   be torn at a sector boundary (a disk may persist unsynced writes in any order). It can
//!   also fail a sync, which must stop the server (fail-stop).

use std::sync::{Arc, Mutex, MutexGuard};

use redb::StorageBackend;

fn io_err(msg: impl Into<String>) -> std::io::Error {
    std::io::Error::other(msg.into())
}

/// When a [`SimDisk`] fails.
#[derive(Debug, Clone, Copy, Default)]
pub struct FaultPlan {
    /// Crash at the Nth mutating call (write, set_len or sync_data; counted from 1): that
    /// call and every later one fail.
    pub crash_at_op: Option<u64>,
    /// At the crash, keep a random subset of the unsynced writes, the last kept one torn.
    pub torn_writes: bool,
    /// Fail the Nth sync_data (counted from 1) without crashing.
    pub fail_sync: Option<u64>,
    /// Seed for the random subset.
    pub seed: u64,
}

#[derive(Debug)]
enum Pending {
    Write { offset: u64, data: Vec<u8> },
    SetLen(u64),
}

#[derive(Debug)]
struct SimState {
    live: Vec<u8>,
    durable: Vec<u8>,
    pending: Vec<Pending>,
    ops: u64,
    syncs: u64,
    plan: FaultPlan,
    crashed: bool,
    rng: u64,
}

/// xorshift64*: the next number of the stream whose state is `state` (deterministic from a
/// seed; the crash tests' randomness).
pub(crate) fn xorshift(state: &mut u64) -> u64 {
    let mut x = (*state).max(1);
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *state = x;
    x.wrapping_mul(0x2545_f491_4f6c_dd1d)
}

impl SimState {
    fn next_random(&mut self) -> u64 {
        xorshift(&mut self.rng)
    }

    fn crash(&mut self) {
        self.crashed = true;
        let pending = std::mem::take(&mut self.pending);
        if !self.plan.torn_writes {
            return;
        }
        let n = pending.len();
        for (i, op) in pending.into_iter().enumerate() {
            if self.next_random().is_multiple_of(2) {
                continue;
            }
            match op {
                Pending::SetLen(len) => resize(&mut self.durable, len),
                Pending::Write { offset, data } => {
                    let keep = if i + 1 == n && data.len() > 512 {
                        // The last write tears at a sector boundary.
                        let sectors = data.len().div_ceil(512) as u64;
                        ((self.next_random() % sectors) as usize * 512).min(data.len())
                    } else {
                        data.len()
                    };
                    apply_write(&mut self.durable, offset, &data[..keep]);
                }
            }
        }
    }

    /// Counts a mutating call; true if the disk has crashed (now or before).
    fn tick(&mut self) -> bool {
        if self.crashed {
            return true;
        }
        self.ops += 1;
        if self.plan.crash_at_op == Some(self.ops) {
            self.crash();
            return true;
        }
        false
    }
}

fn resize(image: &mut Vec<u8>, len: u64) {
    image.resize(usize::try_from(len).unwrap_or(usize::MAX), 0);
}

fn apply_write(image: &mut Vec<u8>, offset: u64, data: &[u8]) {
    let start = usize::try_from(offset).unwrap_or(usize::MAX);
    let end = start.saturating_add(data.len());
    if image.len() < end {
        image.resize(end, 0);
    }
    image[start..end].copy_from_slice(data);
}

/// The crash-simulating backend (see the module docs). Clones share one disk, so a test keeps
/// a clone to read the durable image after the store that owned the disk is gone.
#[derive(Debug, Clone)]
pub struct SimDisk {
    state: Arc<Mutex<SimState>>,
}

impl SimDisk {
    pub fn new(plan: FaultPlan) -> SimDisk {
        SimDisk::from_image(Vec::new(), plan)
    }

    /// A disk whose live and durable contents are `image` (a restart after a crash).
    pub fn from_image(image: Vec<u8>, plan: FaultPlan) -> SimDisk {
        SimDisk {
            state: Arc::new(Mutex::new(SimState {
                live: image.clone(),
                durable: image,
                pending: Vec::new(),
                ops: 0,
                syncs: 0,
                rng: plan.seed ^ 0x9e37_79b9_7f4a_7c15,
                plan,
                crashed: false,
            })),
        }
    }

    fn lock(&self) -> MutexGuard<'_, SimState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// What survives: the durable image (after a crash, including the kept unsynced writes).
    pub fn durable_image(&self) -> Vec<u8> {
        self.lock().durable.clone()
    }

    /// What a kill of the process that wrote the disk leaves: every write that returned (the
    /// kernel holds them), synced or not.
    pub fn live_image(&self) -> Vec<u8> {
        self.lock().live.clone()
    }

    /// Mutating calls so far (to choose crash points).
    pub fn ops(&self) -> u64 {
        self.lock().ops
    }

    /// sync_data calls so far (to choose which sync fails).
    pub fn syncs(&self) -> u64 {
        self.lock().syncs
    }

    pub fn has_crashed(&self) -> bool {
        self.lock().crashed
    }

    /// Crashes the disk now (as a power cut between two calls).
    pub fn crash_now(&self) {
        let mut s = self.lock();
        if !s.crashed {
            s.crash();
        }
    }
}

fn crashed() -> std::io::Error {
    io_err("simulated crash: the disk is gone")
}

impl StorageBackend for SimDisk {
    fn len(&self) -> Result<u64, std::io::Error> {
        let s = self.lock();
        if s.crashed {
            return Err(crashed());
        }
        Ok(s.live.len() as u64)
    }

    fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), std::io::Error> {
        let s = self.lock();
        if s.crashed {
            return Err(crashed());
        }
        let start = usize::try_from(offset).map_err(|_| io_err("offset"))?;
        let src = start
            .checked_add(out.len())
            .and_then(|end| s.live.get(start..end))
            .ok_or_else(|| io_err(format!("read past the end at {offset}")))?;
        out.copy_from_slice(src);
        Ok(())
    }

    fn set_len(&self, len: u64) -> Result<(), std::io::Error> {
        let mut s = self.lock();
        if s.tick() {
            return Err(crashed());
        }
        resize(&mut s.live, len);
        s.pending.push(Pending::SetLen(len));
        Ok(())
    }

    fn sync_data(&self) -> Result<(), std::io::Error> {
        let mut s = self.lock();
        if s.tick() {
            return Err(crashed());
        }
        s.syncs += 1;
        if s.plan.fail_sync == Some(s.syncs) {
            // The data may or may not have reached the disk: keep it pending, report failure.
            return Err(io_err("simulated sync failure"));
        }
        let pending = std::mem::take(&mut s.pending);
        for op in pending {
            match op {
                Pending::SetLen(len) => resize(&mut s.durable, len),
                Pending::Write { offset, data } => apply_write(&mut s.durable, offset, &data),
            }
        }
        Ok(())
    }

    fn write(&self, offset: u64, data: &[u8]) -> Result<(), std::io::Error> {
        let mut s = self.lock();
        if s.tick() {
            return Err(crashed());
        }
        let end = offset.checked_add(data.len() as u64);
        if end.is_none_or(|e| e > s.live.len() as u64) {
            return Err(io_err(format!("write past the end at {offset}")));
        }
        apply_write(&mut s.live, offset, data);
        s.pending.push(Pending::Write {
            offset,
            data: data.to_vec(),
        });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unsynced_writes_vanish_at_a_crash() {
        let disk = SimDisk::new(FaultPlan::default());
        disk.set_len(8).unwrap();
        disk.write(0, b"abcdefgh").unwrap();
        disk.sync_data().unwrap();
        disk.write(0, b"XXXX").unwrap();
        disk.crash_now();
        assert_eq!(disk.durable_image(), b"abcdefgh");
        assert!(disk.read(0, &mut [0u8; 1]).is_err());
    }

    #[test]
    fn crash_at_op_fails_that_call_and_later_ones() {
        let disk = SimDisk::new(FaultPlan {
            crash_at_op: Some(3),
            ..FaultPlan::default()
        });
        disk.set_len(4).unwrap();
        disk.write(0, b"1234").unwrap();
        assert!(disk.sync_data().is_err());
        assert!(disk.write(0, b"5").is_err());
        assert_eq!(disk.durable_image(), b"");
    }
}
