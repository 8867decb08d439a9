//! LUNs for a test SAN: files, attached as loop devices with direct I/O when this process may.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};

use crate::{is_root, run};

/// What the LUNs are made of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LunKind {
    /// Loop devices when root and /dev/loop-control exist, plain files otherwise.
    Auto,
    /// Loop devices (`losetup --direct-io=on`); an error without root.
    Loop,
    /// Plain files (the same on-disk format; O_DIRECT on the host file system).
    File,
}

/// N LUNs of one size. Loop devices are detached and the backing files removed, by their exact
/// names, on drop.
#[derive(Debug)]
pub struct Luns {
    files: Vec<PathBuf>,
    loops: Vec<PathBuf>,
}

impl Luns {
    /// Creates `count` sparse files of `size` bytes in `dir` (`lun0`, `lun1`, ...) and, per
    /// `kind`, attaches each as a loop device with direct I/O.
    pub fn create(dir: &Path, count: usize, size: u64, kind: LunKind) -> anyhow::Result<Luns> {
        Self::create_with_sector_size(dir, count, size, kind, None)
    }

    /// As [`Luns::create`], with loop devices of `sector_size` logical blocks (512 or 4096;
    /// O_DIRECT offsets must then be multiples of it).
    pub fn create_with_sector_size(
        dir: &Path,
        count: usize,
        size: u64,
        kind: LunKind,
        sector_size: Option<u32>,
    ) -> anyhow::Result<Luns> {
        let loop_ok = is_root() && Path::new("/dev/loop-control").exists();
        let use_loop = match kind {
            LunKind::Auto => loop_ok,
            LunKind::Loop if !loop_ok => bail!("loop-device LUNs need root and /dev/loop-control"),
            LunKind::Loop => true,
            LunKind::File => false,
        };
        // The guard exists before the first file, so whatever is made is also undone.
        let mut luns = Luns {
            files: Vec::new(),
            loops: Vec::new(),
        };
        for i in 0..count {
            let file = dir.join(format!("lun{i}"));
            std::fs::File::create_new(&file)
                .and_then(|f| f.set_len(size))
                .with_context(|| format!("create LUN file {}", file.display()))?;
            luns.files.push(file.clone());
            if use_loop {
                let mut cmd = Command::new("losetup");
                cmd.args(["-f", "--show", "--direct-io=on"]);
                if let Some(s) = sector_size {
                    cmd.arg("--sector-size").arg(s.to_string());
                }
                let name = run(cmd.arg(&file))?.trim().to_owned();
                if !name.starts_with("/dev/loop") {
                    bail!("losetup answered {name:?} for {}", file.display());
                }
                luns.loops.push(PathBuf::from(name));
            }
        }
        Ok(luns)
    }

    /// What the nodes open: the loop devices, or the files when there are none.
    pub fn paths(&self) -> &[PathBuf] {
        if self.loops.is_empty() {
            &self.files
        } else {
            &self.loops
        }
    }

    /// The files behind the LUNs.
    pub fn backing_files(&self) -> &[PathBuf] {
        &self.files
    }

    /// Whether the LUNs are loop devices.
    pub fn is_loop(&self) -> bool {
        !self.loops.is_empty()
    }
}

/// The file a loop device is backed by now, if it is attached.
fn loop_backing_file(dev: &Path) -> Option<PathBuf> {
    let name = dev.file_name()?.to_str()?;
    let text = std::fs::read_to_string(format!("/sys/block/{name}/loop/backing_file")).ok()?;
    Some(PathBuf::from(text.trim()))
}

impl Drop for Luns {
    fn drop(&mut self) {
        for (dev, file) in self.loops.iter().zip(&self.files).rev() {
            if let Err(e) = run(Command::new("losetup").arg("-d").arg(dev)) {
                eprintln!("testcluster: could not detach {}: {e}", dev.display());
                continue;
            }
            // While something else (udev's probe, blkid) still holds the device open, the
            // kernel only marks it for autoclear; wait, bounded, until it lets go of our file.
            for _ in 0..250 {
                if loop_backing_file(dev).as_deref() != Some(file.as_path()) {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
        }
        for file in &self.files {
            let _ = std::fs::remove_file(file);
        }
    }
}
