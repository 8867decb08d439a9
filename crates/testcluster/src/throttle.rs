//! Per-LUN bandwidth caps with the blkio (cgroup v1) throttle, so that loop devices on one
//! disk behave like independent disks for striping figures.
//!
//! The cap applies to I/O issued by the processes (or threads) put into the cgroup, per device.
//! Measured here: a 100 MB/s cap gave ~50 MiB/s with fio on a loop device, so calibrate against
//! one capped LUN rather than trusting the number.

use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};

use crate::unique_name;

const BLKIO_ROOT: &str = "/sys/fs/cgroup/blkio";

/// One blkio cgroup, removed on drop (its remaining tasks moved back to the root cgroup first).
#[derive(Debug)]
pub struct Throttle {
    dir: PathBuf,
}

/// `MAJ:MIN` of a block device.
fn dev_numbers(device: &Path) -> anyhow::Result<String> {
    let meta = std::fs::metadata(device).with_context(|| format!("stat {}", device.display()))?;
    if !meta.file_type().is_block_device() {
        bail!(
            "{} is not a block device: blkio throttles need loop devices",
            device.display()
        );
    }
    let rdev = meta.rdev();
    let major = ((rdev >> 8) & 0xfff) | ((rdev >> 32) & !0xfff);
    let minor = (rdev & 0xff) | ((rdev >> 12) & !0xff);
    Ok(format!("{major}:{minor}"))
}

impl Throttle {
    /// Creates the cgroup and caps each `(device, read bytes/s, write bytes/s)`; 0 is no cap.
    pub fn create(tag: &str, limits: &[(&Path, u64, u64)]) -> anyhow::Result<Throttle> {
        let root = Path::new(BLKIO_ROOT);
        if !root.join("blkio.throttle.read_bps_device").exists() {
            bail!("no cgroup v1 blkio throttle at {BLKIO_ROOT}");
        }
        let dir = root.join(unique_name(tag));
        std::fs::create_dir(&dir).with_context(|| format!("create cgroup {}", dir.display()))?;
        let throttle = Throttle { dir };
        for (device, read_bps, write_bps) in limits {
            let dev = dev_numbers(device)?;
            for (file, bps) in [
                ("blkio.throttle.read_bps_device", read_bps),
                ("blkio.throttle.write_bps_device", write_bps),
            ] {
                if *bps > 0 {
                    throttle.write(file, &format!("{dev} {bps}"))?;
                }
            }
        }
        Ok(throttle)
    }

    fn write(&self, file: &str, value: &str) -> anyhow::Result<()> {
        let path = self.dir.join(file);
        std::fs::write(&path, value)
            .with_context(|| format!("write {value:?} to {}", path.display()))
    }

    /// Puts a whole process (all its threads) under the caps.
    pub fn add_pid(&self, pid: u32) -> anyhow::Result<()> {
        self.write("cgroup.procs", &pid.to_string())
    }

    /// Puts one thread (by its kernel thread id) under the caps.
    pub fn add_thread(&self, tid: u32) -> anyhow::Result<()> {
        self.write("tasks", &tid.to_string())
    }

    /// The cgroup's directory.
    pub fn path(&self) -> &Path {
        &self.dir
    }
}

impl Drop for Throttle {
    fn drop(&mut self) {
        // A cgroup with tasks cannot be removed: hand back what is still in it (threads, since
        // `tasks` lists each of them).
        if let Ok(tasks) = std::fs::read_to_string(self.dir.join("tasks")) {
            for tid in tasks.split_whitespace() {
                let _ = std::fs::write(Path::new(BLKIO_ROOT).join("tasks"), tid);
            }
        }
        if let Err(e) = std::fs::remove_dir(&self.dir) {
            eprintln!(
                "testcluster: could not remove cgroup {}: {e}",
                self.dir.display()
            );
        }
    }
}
