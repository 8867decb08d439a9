//! Discovery against labelled LUNs: files, loop devices reached through symlinks, LVM PVs.

use std::path::PathBuf;
use std::process::Command;

use sanfs_blockmap::label::DEFAULT_DATA_OFFSET;
use sanfs_blockmap::volume::{DeviceId, DeviceIndex, LvmPvId, Volume, VolumeDevice};
use sanfs_client_agent::discovery::{DiscoveryConfig, discover, probe_identity};

use sanfs_testcluster::{Need, skip_unless};

use crate::support::*;

const DEV_SIZE: u64 = 3 << 20;

fn config(globs: &[String]) -> DiscoveryConfig {
    DiscoveryConfig {
        globs: globs.to_vec(),
    }
}

/// Four devices in the volume; this node has three of them (one behind a symlink as well),
/// plus a LUN of another file system and an unlabelled file.
#[test]
fn discovery_finds_labelled_file_luns_ignores_foreign_and_reports_the_missing_one() {
    let dir = tempfile::tempdir().unwrap();
    let paths = labelled_files(dir.path(), 4, DEV_SIZE);
    std::fs::remove_file(&paths[2]).unwrap();
    // Another file system's LUN: a label whose device UUID the volume does not know.
    let other = tempfile::tempdir().unwrap();
    let foreign = labelled_files(other.path(), 6, DEV_SIZE).pop().unwrap();
    std::fs::rename(&foreign, dir.path().join("lunforeign")).unwrap();
    std::fs::write(dir.path().join("lunblank"), vec![0u8; 1 << 20]).unwrap();
    std::os::unix::fs::symlink(&paths[1], dir.path().join("alias-of-1")).unwrap();

    let volume = striped_volume(4, DEV_SIZE);
    let d = dir.path().display();
    let found = discover(
        &volume,
        &config(&[format!("{d}/alias*"), format!("{d}/lun*")]),
    );
    let indexes: Vec<u32> = found.found.iter().map(|f| f.index.0).collect();
    assert_eq!(indexes, [0, 1, 3]);
    assert_eq!(
        found.missing,
        [(DeviceIndex(2), DeviceId::Sanfs(device_uuid(2)))]
    );
    assert_eq!(found.foreign.len(), 1);
    assert_eq!(found.foreign[0].1, DeviceId::Sanfs(device_uuid(5)));
    assert!(found.rejected.is_empty(), "{:?}", found.rejected);
    let d1 = found.device(DeviceIndex(1)).unwrap();
    assert!(
        d1.path.ends_with("alias-of-1"),
        "opened once, through the first path"
    );
    assert_eq!(d1.size_bytes, DEV_SIZE);
    assert!(!d1.is_block_device && d1.direct);
    assert!(d1.logical_block_size.is_power_of_two());
    let files = found.into_files(4);
    assert_eq!(files.iter().filter(|f| f.is_some()).count(), 3);
    assert!(files[2].is_none());
}

#[test]
fn discovery_rejects_a_lun_smaller_than_the_volume_says() {
    let dir = tempfile::tempdir().unwrap();
    let paths = labelled_files(dir.path(), 2, DEV_SIZE);
    std::fs::File::options()
        .write(true)
        .open(&paths[1])
        .unwrap()
        .set_len(DEV_SIZE - 4096)
        .unwrap();
    let volume = striped_volume(2, DEV_SIZE);
    let found = discover(
        &volume,
        &config(&[format!("{}/lun*", dir.path().display())]),
    );
    assert_eq!(found.found.len(), 1);
    assert_eq!(found.missing.len(), 1);
    assert_eq!(found.rejected.len(), 1);
    assert!(
        found.rejected[0].1.contains("needs"),
        "{}",
        found.rejected[0].1
    );
}

/// As root: four labelled loop devices, each also reachable through a symlink (as in
/// /dev/disk/by-id), are found and opened once each.
#[test]
fn discovery_finds_labelled_loop_devices_once_each() {
    if skip_unless(
        "discovery_finds_labelled_loop_devices_once_each",
        &[Need::LoopDevices],
    ) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let files = labelled_files(dir.path(), 4, DEV_SIZE);
    let loops: Vec<LoopDev> = files.iter().map(|f| LoopDev::attach(f)).collect();
    let links = tempfile::tempdir().unwrap();
    for (i, l) in loops.iter().enumerate() {
        std::os::unix::fs::symlink(&l.path, links.path().join(format!("by-id-lun{i}"))).unwrap();
    }
    let mut globs = vec![format!("{}/by-id-*", links.path().display())];
    globs.extend(loops.iter().map(|l| l.path.display().to_string()));
    let volume = striped_volume(4, DEV_SIZE);
    let found = discover(&volume, &config(&globs));
    assert!(found.missing.is_empty(), "{:?}", found.missing);
    assert_eq!(found.found.len(), 4, "each device once");
    for f in &found.found {
        assert!(f.is_block_device && f.direct);
        assert_eq!(f.size_bytes, DEV_SIZE);
        assert_eq!(f.logical_block_size, 512);
        assert!(f.path.starts_with(links.path()));
    }
}

/// As root with lvm2: a PV made by `pvcreate` on a loop device is found by its PV UUID.
#[test]
fn discovery_finds_an_lvm_pv_on_a_loop_device() {
    if skip_unless(
        "discovery_finds_an_lvm_pv_on_a_loop_device",
        &[Need::LoopDevices, Need::Tool("pvcreate")],
    ) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("pv");
    std::fs::File::create(&file)
        .unwrap()
        .set_len(16 << 20)
        .unwrap();
    let dev = LoopDev::attach(&file);
    let lvm_config =
        "devices{use_devicesfile=0 obtain_device_list_from_udev=0} global{activation=0}";
    let pv = Pv::create(&dev.path, lvm_config);
    let out = Command::new("pvs")
        .args(["--config", lvm_config, "--noheadings", "-o", "pv_uuid"])
        .arg(&dev.path)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let pv_id = LvmPvId::parse(text.trim()).unwrap_or_else(|| panic!("pvs said {text:?}"));
    assert_eq!(
        probe_identity(&dev.path).unwrap(),
        Some(DeviceId::LvmPv(pv_id))
    );

    let volume = Volume::linear(
        BLOCK,
        vec![
            VolumeDevice {
                uuid: DeviceId::LvmPv(pv_id),
                size_bytes: 16 << 20,
            },
            VolumeDevice {
                uuid: DeviceId::LvmPv(LvmPvId::parse(&"x".repeat(32)).unwrap()),
                size_bytes: 16 << 20,
            },
        ],
        DEFAULT_DATA_OFFSET,
    )
    .unwrap();
    let found = discover(&volume, &config(&[dev.path.display().to_string()]));
    assert_eq!(found.found.len(), 1);
    assert_eq!(found.found[0].id, DeviceId::LvmPv(pv_id));
    assert_eq!(found.missing.len(), 1);
    assert_eq!(found.missing[0].0, DeviceIndex(1));
    drop(pv);
}

/// A PV label removed again (by its exact device) on drop, before the loop device goes.
struct Pv {
    dev: PathBuf,
    config: &'static str,
}

impl Pv {
    fn create(dev: &std::path::Path, config: &'static str) -> Pv {
        let out = Command::new("pvcreate")
            .args(["--config", config, "-y", "-ff"])
            .arg(dev)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "pvcreate: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Pv {
            dev: dev.to_path_buf(),
            config,
        }
    }
}

impl Drop for Pv {
    fn drop(&mut self) {
        let _ = Command::new("pvremove")
            .args(["--config", self.config, "-y", "-ff"])
            .arg(&self.dev)
            .output();
    }
}

/// The default globs scan this machine's real devices (read-only probes) and find nothing of a
/// volume nobody formatted: every device is reported missing, nothing fails. The volume's
/// identities are fresh: the other tests here (and other processes) label loop devices with
/// the fixed ones of `striped_volume` at the same time.
#[test]
fn the_default_globs_scan_the_machine_and_report_unknown_luns_missing() {
    let devices = (0..2)
        .map(|_| VolumeDevice {
            uuid: DeviceId::Sanfs(uuid::Uuid::new_v4()),
            size_bytes: DEV_SIZE,
        })
        .collect();
    let volume = Volume::striped(BLOCK, devices, DEFAULT_DATA_OFFSET, STRIPE_UNIT).unwrap();
    let found = discover(&volume, &DiscoveryConfig::default());
    assert!(found.found.is_empty());
    assert_eq!(found.missing.len(), 2);
}

/// A cloned LUN (the same label on two devices) is refused by the import rule, whichever path
/// comes first: neither is opened, both are listed with the reason, the device counts as
/// missing; the server's device table decides the same (metadata-server `datadev`).
#[test]
fn discovery_refuses_an_identity_found_on_two_devices() {
    let dir = tempfile::tempdir().unwrap();
    let paths = labelled_files(dir.path(), 2, DEV_SIZE);
    let clone = dir.path().join("clone-of-1");
    std::fs::copy(&paths[1], &clone).unwrap();
    let volume = striped_volume(2, DEV_SIZE);
    let d = dir.path().display();
    for globs in [
        vec![format!("{d}/lun*"), format!("{d}/clone*")],
        vec![format!("{d}/clone*"), format!("{d}/lun*")],
    ] {
        let found = discover(&volume, &config(&globs));
        let indexes: Vec<u32> = found.found.iter().map(|f| f.index.0).collect();
        assert_eq!(indexes, [0], "{globs:?}");
        assert_eq!(
            found.missing,
            [(DeviceIndex(1), DeviceId::Sanfs(device_uuid(1)))]
        );
        let mut rejected: Vec<&PathBuf> = found.rejected.iter().map(|(p, _)| p).collect();
        rejected.sort();
        assert_eq!(rejected, [&clone, &paths[1]], "{:?}", found.rejected);
        for (_, why) in &found.rejected {
            assert!(why.contains("is on 2 devices"), "{why}");
            assert!(why.contains("cloned LUN"), "{why}");
        }
    }
}
