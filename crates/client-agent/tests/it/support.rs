//! Fixtures: file-backed LUNs with sanfs labels, loop devices that detach on drop, volumes.

use std::path::{Path, PathBuf};
use std::process::Command;

use sanfs_blockmap::label::{DEFAULT_DATA_OFFSET, DeviceLabel, LabelLayout};
use sanfs_blockmap::volume::{DeviceId, Volume, VolumeDevice};
use sanfs_client_agent::engine::{Engine, EngineConfig, EngineKind};
use uuid::Uuid;

pub const BLOCK: u32 = 4096;
pub const STRIPE_UNIT: u64 = 64 * 1024;

pub fn device_uuid(i: usize) -> Uuid {
    Uuid::from_u128(0x5a4f_0000_0000_0000_0000_0000_0000_0000 + i as u128 + 1)
}

pub fn label(fs: u128, i: usize, count: usize, size: u64) -> DeviceLabel {
    DeviceLabel {
        fs_uuid: Uuid::from_u128(fs),
        device_uuid: device_uuid(i),
        device_index: i as u32,
        device_count: count as u32,
        device_size: size,
        data_offset: DEFAULT_DATA_OFFSET,
        block_size: BLOCK,
        layout: LabelLayout::Striped {
            stripe_unit: STRIPE_UNIT,
        },
        formatted_at: 0,
    }
}

/// `count` files of `size` bytes in `dir`, each with device `i`'s label at offset 0.
pub fn labelled_files(dir: &Path, count: usize, size: u64) -> Vec<PathBuf> {
    (0..count)
        .map(|i| {
            let path = dir.join(format!("lun{i}"));
            let mut bytes = label(1, i, count, size).encode();
            bytes.resize(4096, 0);
            std::fs::write(&path, &bytes).unwrap();
            std::fs::File::options()
                .write(true)
                .open(&path)
                .unwrap()
                .set_len(size)
                .unwrap();
            path
        })
        .collect()
}

/// A volume striped over devices 0..count (ids [`device_uuid`]) of `size` bytes each.
pub fn striped_volume(count: usize, size: u64) -> Volume {
    let devices = (0..count)
        .map(|i| VolumeDevice {
            uuid: DeviceId::Sanfs(device_uuid(i)),
            size_bytes: size,
        })
        .collect();
    Volume::striped(BLOCK, devices, DEFAULT_DATA_OFFSET, STRIPE_UNIT).unwrap()
}

pub fn engine(kind: EngineKind, files: Vec<Option<std::fs::File>>) -> Engine {
    Engine::new(
        &EngineConfig {
            kind,
            queue_depth_per_device: 8,
        },
        files,
    )
    .unwrap()
}

/// A loop device over a file, with direct I/O, detached (by its exact name) on drop.
pub struct LoopDev {
    pub path: PathBuf,
}

impl LoopDev {
    pub fn attach(file: &Path) -> LoopDev {
        let out = Command::new("losetup")
            .args(["-f", "--show", "--direct-io=on"])
            .arg(file)
            .output()
            .expect("run losetup");
        assert!(
            out.status.success(),
            "losetup: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let name = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        // The guard exists before anything else can fail, so the device is always detached.
        let dev = LoopDev {
            path: PathBuf::from(&name),
        };
        assert!(name.starts_with("/dev/loop"), "losetup said {name:?}");
        dev
    }
}

impl Drop for LoopDev {
    fn drop(&mut self) {
        let ok = Command::new("losetup")
            .arg("-d")
            .arg(&self.path)
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            eprintln!("warning: could not detach {}", self.path.display());
        }
    }
}

/// Deterministic test bytes.
pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| ((i as u64).wrapping_mul(2_654_435_761) >> 7) as u8 ^ seed)
        .collect()
}

/// Drops the kernel's cached pages of `file` (`posix_fadvise(DONTNEED)`): its next reads
/// reach the file system.
pub fn drop_pages(file: &std::fs::File) {
    rustix::fs::fadvise(file, 0, None, rustix::fs::Advice::DontNeed).expect("fadvise");
}
