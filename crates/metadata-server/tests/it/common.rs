//! Helpers shared by the CLI tests: running the binary, making LUN files, writing configs.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use sanfs_blockmap::label::{DeviceLabel, LabelLayout};
use sanfs_blockmap::volume::{DeviceId, Volume, VolumeDevice};

pub const MIB: u64 = 1 << 20;

/// The result of one run of `sanfs-mds`.
pub struct Run {
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

impl Run {
    pub fn success(&self) -> bool {
        self.code == Some(0)
    }
}

impl std::fmt::Debug for Run {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "exit {:?}\n--- stdout\n{}--- stderr\n{}",
            self.code, self.stdout, self.stderr
        )
    }
}

pub fn mds<I, S>(args: I) -> Run
where
    I: IntoIterator<Item = S>,
    S: AsRef<std::ffi::OsStr>,
{
    let out: Output = Command::new(env!("CARGO_BIN_EXE_sanfs-mds"))
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    Run {
        code: out.status.code(),
        stdout: String::from_utf8(out.stdout).unwrap(),
        stderr: String::from_utf8(out.stderr).unwrap(),
    }
}

/// Sparse files of the given sizes in `dir`, named `lun0`, `lun1`, ...
pub fn lun_files(dir: &Path, sizes: &[u64]) -> Vec<PathBuf> {
    sizes
        .iter()
        .enumerate()
        .map(|(i, &size)| {
            let path = dir.join(format!("lun{i}"));
            std::fs::File::create(&path).unwrap().set_len(size).unwrap();
            path
        })
        .collect()
}

/// Writes an `mds.toml` with the given `[volume]` body and returns its path.
pub fn write_config(dir: &Path, volume: &str) -> PathBuf {
    let path = dir.join("mds.toml");
    let text = format!(
        "[metadata]\npath = \"{}\"\n\n[volume]\n{volume}\n",
        dir.join("meta.redb").display()
    );
    std::fs::write(&path, text).unwrap();
    path
}

/// A TOML array of paths.
pub fn toml_paths<P: AsRef<Path>>(paths: &[P]) -> String {
    let quoted: Vec<String> = paths
        .iter()
        .map(|p| format!("\"{}\"", p.as_ref().display()))
        .collect();
    format!("[{}]", quoted.join(", "))
}

pub fn read_label(path: &Path) -> DeviceLabel {
    let bytes = std::fs::read(path).unwrap();
    DeviceLabel::decode(&bytes).unwrap()
}

/// The volume the labels describe, built independently of the binary (devices in index
/// order).
pub fn volume_from_labels(labels: &[DeviceLabel]) -> Volume {
    let mut labels = labels.to_vec();
    labels.sort_by_key(|l| l.device_index);
    let first = labels[0].clone();
    let devices = labels
        .iter()
        .map(|l| VolumeDevice {
            uuid: DeviceId::Sanfs(l.device_uuid),
            size_bytes: l.device_size,
        })
        .collect();
    match first.layout {
        LabelLayout::Linear => Volume::linear(first.block_size, devices, first.data_offset),
        LabelLayout::Striped { stripe_unit } => {
            Volume::striped(first.block_size, devices, first.data_offset, stripe_unit)
        }
    }
    .unwrap()
}

/// The `map` line of `volume inspect --map`: (device index, device uuid, path, phys).
pub fn parse_map_line(stdout: &str) -> (u32, String, String, u64) {
    let line = stdout
        .lines()
        .find(|l| l.starts_with("map "))
        .unwrap_or_else(|| panic!("no map line in {stdout}"));
    let after = line.split(" -> ").nth(1).unwrap();
    let f: Vec<&str> = after.split_whitespace().collect();
    assert_eq!(f[0], "device", "{line}");
    assert_eq!(f[4], "phys", "{line}");
    (
        f[1].parse().unwrap(),
        f[2].to_owned(),
        f[3].to_owned(),
        f[5].parse().unwrap(),
    )
}
