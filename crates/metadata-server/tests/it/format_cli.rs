//! `sanfs-mds format` on file-backed LUNs: labels written, refusals that change nothing,
//! `--force`, and the exit statuses of errors.

use std::path::{Path, PathBuf};
use std::process::Command;

use sanfs_blockmap::label::LabelLayout;

use crate::common::{MIB, lun_files, mds, read_label, toml_paths, write_config};

fn striped_config(dir: &Path, devices: &[PathBuf]) -> PathBuf {
    write_config(
        dir,
        &format!(
            "layout = \"striped\"\nstripe_unit = \"64KiB\"\ndevices = {}",
            toml_paths(devices)
        ),
    )
}

fn contents(paths: &[PathBuf]) -> Vec<Vec<u8>> {
    paths.iter().map(|p| std::fs::read(p).unwrap()).collect()
}

#[test]
fn format_labels_four_striped_luns() {
    let dir = tempfile::tempdir().unwrap();
    let luns = lun_files(dir.path(), &[16 * MIB, 16 * MIB, 17 * MIB, 16 * MIB + 4096]);
    let config = striped_config(dir.path(), &luns);
    let run = mds(["format", "--config", config.to_str().unwrap()]);
    assert!(run.success(), "{run:?}");
    let fs_line = run.stdout.lines().next().unwrap();
    let fs_uuid = fs_line.strip_prefix("fs uuid: ").unwrap();
    assert!(
        run.stdout
            .contains("layout: striped, 4 devices, stripe unit 65536"),
        "{run:?}"
    );
    assert!(
        run.stdout
            .contains(&format!("total: {} bytes", 4 * 15 * MIB)),
        "{run:?}"
    );
    let mut device_uuids = Vec::new();
    for (i, lun) in luns.iter().enumerate() {
        let label = read_label(lun);
        assert_eq!(label.fs_uuid.to_string(), fs_uuid);
        assert_eq!(label.device_index, i as u32);
        assert_eq!(label.device_count, 4);
        assert_eq!(label.device_size, std::fs::metadata(lun).unwrap().len());
        assert_eq!(label.data_offset, MIB);
        assert_eq!(label.block_size, 4096);
        assert_eq!(label.layout, LabelLayout::Striped { stripe_unit: 65536 });
        assert!(label.formatted_at > 1_700_000_000, "{}", label.formatted_at);
        assert!(
            run.stdout.contains(&format!(
                "device {i}: {} {}",
                label.device_uuid,
                lun.display()
            )),
            "{run:?}"
        );
        device_uuids.push(label.device_uuid);
    }
    device_uuids.sort();
    device_uuids.dedup();
    assert_eq!(device_uuids.len(), 4, "device UUIDs are distinct");
}

#[test]
fn second_format_without_force_is_refused_and_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let luns = lun_files(dir.path(), &[8 * MIB; 4]);
    let config = striped_config(dir.path(), &luns);
    let first = mds(["format", "--config", config.to_str().unwrap()]);
    assert!(first.success(), "{first:?}");
    let fs_uuid = read_label(&luns[0]).fs_uuid;
    let before = contents(&luns);

    let second = mds(["format", "--config", config.to_str().unwrap()]);
    assert_eq!(second.code, Some(2), "{second:?}");
    assert!(second.stderr.starts_with("sanfs-mds: "), "{second:?}");
    for lun in &luns {
        assert!(
            second.stderr.contains(&format!(
                "{} holds sanfs label (fs {fs_uuid}",
                lun.display()
            )),
            "{second:?}"
        );
    }
    assert!(second.stderr.contains("--force"), "{second:?}");
    assert_eq!(contents(&luns), before, "a refused format wrote");

    let forced = mds(["format", "--force", "--config", config.to_str().unwrap()]);
    assert!(forced.success(), "{forced:?}");
    let new_fs = read_label(&luns[0]).fs_uuid;
    assert_ne!(new_fs, fs_uuid);
    for lun in &luns {
        assert_eq!(read_label(lun).fs_uuid, new_fs);
    }
}

/// One LUN with a foreign file system among blank ones: refused, nothing written; --force
/// formats all.
fn check_foreign_lun_refused(dir: &Path, luns: &[PathBuf], what: &str) {
    let config = striped_config(dir, luns);
    let before = contents(luns);
    let run = mds(["format", "--config", config.to_str().unwrap()]);
    assert_eq!(run.code, Some(2), "{run:?}");
    assert!(
        run.stderr
            .contains(&format!("{} holds {what}", luns[1].display())),
        "{run:?}"
    );
    assert_eq!(contents(luns), before, "a refused format wrote");
    let forced = mds(["format", "--force", "--config", config.to_str().unwrap()]);
    assert!(forced.success(), "{forced:?}");
    for lun in luns {
        read_label(lun);
    }
}

#[test]
fn a_lun_with_an_xfs_signature_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let luns = lun_files(dir.path(), &[8 * MIB; 3]);
    let mut head = vec![0u8; 4096];
    head[..4].copy_from_slice(b"XFSB");
    std::fs::OpenOptions::new()
        .write(true)
        .open(&luns[1])
        .map(|f| std::os::unix::fs::FileExt::write_all_at(&f, &head, 0))
        .unwrap()
        .unwrap();
    check_foreign_lun_refused(dir.path(), &luns, "XFS file system");
}

#[test]
fn a_lun_made_by_mkfs_xfs_is_refused() {
    let have_mkfs = Command::new("mkfs.xfs")
        .arg("-V")
        .output()
        .is_ok_and(|o| o.status.success());
    if !have_mkfs
        && sanfs_testcluster::skip(
            "a_lun_made_by_mkfs_xfs_is_refused",
            "needs mkfs.xfs (Debian xfsprogs)",
        )
    {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // mkfs.xfs wants at least 300 MiB; sparse files cost nothing.
    let luns = lun_files(dir.path(), &[320 * MIB; 2]);
    let out = Command::new("mkfs.xfs")
        .args(["-q", "-f"])
        .arg(&luns[1])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "mkfs.xfs: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    check_foreign_lun_refused(dir.path(), &luns, "XFS file system");
}

#[test]
fn errors_exit_2_with_the_error_chain() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.toml");
    let run = mds(["format", "--config", missing.to_str().unwrap()]);
    assert_eq!(run.code, Some(2), "{run:?}");
    assert!(
        run.stderr.starts_with(&format!(
            "sanfs-mds: read config file {}: ",
            missing.display()
        )),
        "{run:?}"
    );

    let bad = write_config(dir.path(), "layout = \"striped\"\ndevcies = []");
    let run = mds(["format", "--config", bad.to_str().unwrap()]);
    assert_eq!(run.code, Some(2), "{run:?}");
    assert!(run.stderr.contains("unknown field `devcies`"), "{run:?}");

    let luns = lun_files(dir.path(), &[8 * MIB]);
    let absent = dir.path().join("absent");
    let config = striped_config(dir.path(), &[luns[0].clone(), absent.clone()]);
    let run = mds(["format", "--config", config.to_str().unwrap()]);
    assert_eq!(run.code, Some(2), "{run:?}");
    assert!(
        run.stderr.contains(&absent.display().to_string()),
        "{run:?}"
    );
    assert_eq!(std::fs::read(&luns[0]).unwrap(), vec![0u8; 8 << 20]);

    assert_eq!(mds(["format"]).code, Some(2), "missing --config");
    assert_eq!(mds(["frobnicate"]).code, Some(2));
    // fsck of a file system that was never formatted: could not run (2), and says why.
    let run = mds(["fsck", "--config", config.to_str().unwrap()]);
    assert_eq!(run.code, Some(2), "{run:?}");
    assert!(run.stderr.contains("no metadata store"), "{run:?}");
}

/// The metadata store on a device of its own (`kind = "block"`; a plain file stands in for
/// the LUN here): format creates it, fsck reads it, and a second format onto the same
/// metadata device is refused before anything is written, even with fresh data LUNs.
#[test]
fn a_block_metadata_store_is_created_checked_and_not_formatted_twice() {
    let dir = tempfile::tempdir().unwrap();
    let meta = dir.path().join("meta.lun");
    std::fs::File::create(&meta)
        .unwrap()
        .set_len(16 * MIB)
        .unwrap();
    let config_for = |luns: &[PathBuf]| {
        let path = dir.path().join("mds-block.toml");
        std::fs::write(
            &path,
            format!(
                "[metadata]\npath = \"{}\"\nkind = \"block\"\n\n[volume]\nlayout = \"striped\"\nstripe_unit = \"64KiB\"\ndevices = {}\n",
                meta.display(),
                toml_paths(luns)
            ),
        )
        .unwrap();
        path
    };
    let first = lun_files(dir.path(), &[8 * MIB; 2]);
    let config = config_for(&first);
    let run = mds(["format", "--config", config.to_str().unwrap()]);
    assert!(run.success(), "{run:?}");
    let run = mds(["fsck", "--config", config.to_str().unwrap()]);
    assert_eq!(run.code, Some(0), "{run:?}");
    assert!(run.stdout.contains("clean"), "{run:?}");

    let fresh_dir = dir.path().join("fresh");
    std::fs::create_dir(&fresh_dir).unwrap();
    let fresh = lun_files(&fresh_dir, &[8 * MIB; 2]);
    let config = config_for(&fresh);
    let run = mds(["format", "--config", config.to_str().unwrap()]);
    assert_eq!(run.code, Some(2), "{run:?}");
    assert!(run.stderr.contains("already exists"), "{run:?}");
    for lun in &fresh {
        assert_eq!(
            std::fs::read(lun).unwrap(),
            vec![0u8; 8 << 20],
            "a refused format wrote"
        );
    }
}
