//! Online backup of the metadata store (`Store::backup`, behind `Admin.BackupStore`) and
//! `sanfs-mds restore` / `fsck --backup` through the real binary: a backup taken while
//! commits go on is a consistent store that fsck calls clean; one taken at rest holds exactly
//! the store's namespace; a path that exists, a relative one, one in no directory and a full
//! file system are refused with their errno and leave no file behind; restore refuses a store
//! that is not a backup and installs a backup where no store is, and over one, at the backup's start count (one past
//! the old store's where it would reuse it).
//! The end-to-end run under a writer on a mount is in the agent's tests (`backup.rs`).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use sanfs_mds::clock::Clock;
use sanfs_mds::store::{Backend, Store};
use sanfs_proto::types::{FsError, Timestamp};

use crate::common::{MIB, lun_files, mds, toml_paths, write_config};
use crate::crash::{EPOCH_SEC, Rng, apply, dump, generate, tick};

const TAKEN_AT: Timestamp = Timestamp {
    sec: EPOCH_SEC + 5,
    nsec: 0,
};

/// A formatted file system (two LUN files, labels and store made by `sanfs-mds format`) in
/// `dir`, its store open, with `ops` operations done: (store, clock, config, store path).
fn formatted(dir: &Path, ops: usize) -> (Arc<Store>, Clock, PathBuf, PathBuf) {
    let luns = lun_files(dir, &[16 * MIB, 16 * MIB]);
    let config = write_config(
        dir,
        &format!(
            "layout = \"striped\"\nstripe_unit = 65536\ndevices = {}",
            toml_paths(&luns)
        ),
    );
    let run = mds(["format", "--config", config.to_str().unwrap()]);
    assert!(run.success(), "{run:?}");
    let meta = dir.join("meta.redb");
    let clock = Clock::manual(EPOCH_SEC);
    let store = Arc::new(Store::open(&Backend::File(meta.clone()), clock.clone(), 64).unwrap());
    let mut rng = Rng::new(0xbac0_0000_0000_0015);
    let mut state = dump(&store);
    for _ in 0..ops {
        let op = generate(&mut rng, &state);
        tick(&clock);
        let _ = apply(&store, &op);
        state = dump(&store);
    }
    (store, clock, config, meta)
}

fn names_in(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

#[test]
fn a_backup_at_rest_holds_the_namespace_and_backups_under_commits_are_clean() {
    let dir = tempfile::tempdir().unwrap();
    let (store, clock, _config, _meta) = formatted(dir.path(), 60);
    let out = dir.path().join("backups");
    std::fs::create_dir(&out).unwrap();

    // At rest: the backup opened as a store holds the same namespace.
    let at_rest = out.join("at-rest.redb");
    let info = store.backup(&at_rest, false, TAKEN_AT, "test").unwrap();
    assert_eq!(info.record.fs_uuid, store.superblock().fs_uuid);
    assert_eq!(info.record.taken_at, TAKEN_AT);
    assert_eq!(info.record.boot_epoch, store.boot_epoch());
    assert_eq!(info.size_bytes, std::fs::metadata(&at_rest).unwrap().len());
    let copy = dir.path().join("opened.redb");
    std::fs::copy(&at_rest, &copy).unwrap();
    let opened = Store::open(&Backend::File(copy), clock.clone(), 64).unwrap();
    assert_eq!(dump(&opened), dump(&store));
    drop(opened);

    // Under commits: a thread changes the namespace all along while backups are taken; each
    // is one consistent snapshot (fsck clean: link counts, free + used = capacity, ...).
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (store, clock, stop) = (store.clone(), clock.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut rng = Rng::new(0xbac0_0000_0000_0016);
            let mut state = dump(&store);
            let mut n = 0u64;
            while !stop.load(Ordering::SeqCst) {
                let op = generate(&mut rng, &state);
                tick(&clock);
                let _ = apply(&store, &op);
                state = dump(&store);
                n += 1;
            }
            n
        })
    };
    let mut seqs = Vec::new();
    for i in 0..6 {
        let path = out.join(format!("busy-{i}.redb"));
        let info = store.backup(&path, false, TAKEN_AT, "test").unwrap();
        seqs.push(info.record.commit_seq);
        let run = mds(["fsck", "--backup", path.to_str().unwrap()]);
        assert_eq!(run.code, Some(0), "backup {i}: {run:?}");
        assert!(run.stdout.contains("backup of fs"), "{run:?}");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    stop.store(true, Ordering::SeqCst);
    let ops = writer.join().unwrap();
    assert!(ops > 0, "the writer made no change during the backups");
    assert!(seqs.windows(2).all(|w| w[0] <= w[1]), "{seqs:?}");
    // Nothing but the backups in their directory.
    let mut want: Vec<String> = (0..6).map(|i| format!("busy-{i}.redb")).collect();
    want.push("at-rest.redb".into());
    want.sort();
    assert_eq!(names_in(&out), want);
    // JSON: the record and the report.
    let run = mds(["fsck", "--backup", at_rest.to_str().unwrap(), "--json"]);
    assert_eq!(run.code, Some(0), "{run:?}");
    let v: serde_json::Value = serde_json::from_str(&run.stdout).unwrap();
    assert_eq!(
        v["backup"]["fs_uuid"],
        store.superblock().fs_uuid.to_string()
    );
    assert!(v["report"]["problems"].as_array().unwrap().is_empty());
}

#[test]
fn a_backup_path_that_cannot_be_used_is_refused_with_its_errno_and_nothing_is_left() {
    let dir = tempfile::tempdir().unwrap();
    let (store, _clock, _config, _meta) = formatted(dir.path(), 10);
    let out = dir.path().join("backups");
    std::fs::create_dir(&out).unwrap();
    let path = out.join("b.redb");
    store.backup(&path, false, TAKEN_AT, "test").unwrap();
    let first = std::fs::read(&path).unwrap();

    assert_eq!(
        store.backup(&path, false, TAKEN_AT, "test").unwrap_err(),
        FsError::Exists
    );
    assert!(std::fs::read(&path).unwrap() == first);
    assert!(matches!(
        store.backup(Path::new("relative.redb"), false, TAKEN_AT, "test"),
        Err(FsError::Invalid(_))
    ));
    assert_eq!(
        store
            .backup(
                &out.join("no-such-dir").join("b.redb"),
                false,
                TAKEN_AT,
                "test"
            )
            .unwrap_err(),
        FsError::NotFound
    );
    assert_eq!(
        store.backup(&out, true, TAKEN_AT, "test").unwrap_err(),
        FsError::IsDir
    );
    assert_eq!(names_in(&out), ["b.redb"]);
    // --force replaces it, whole.
    let later = Timestamp {
        sec: TAKEN_AT.sec + 60,
        nsec: 0,
    };
    let info = store.backup(&path, true, later, "test").unwrap();
    assert_eq!(info.record.taken_at, later);
    let run = mds(["fsck", "--backup", path.to_str().unwrap()]);
    assert_eq!(run.code, Some(0), "{run:?}");
    assert_eq!(names_in(&out), ["b.redb"]);

    // A full file system: ENOSPC, and no file left (root: a tmpfs of 8 KiB).
    if sanfs_testcluster::skip_unless_root("backup ENOSPC on a small tmpfs") {
        return;
    }
    let small = dir.path().join("small-h15");
    std::fs::create_dir(&small).unwrap();
    let st = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=8k", "sanfs-h15-tmpfs"])
        .arg(&small)
        .status()
        .unwrap();
    assert!(st.success(), "mount tmpfs");
    let r = store.backup(&small.join("b.redb"), false, TAKEN_AT, "test");
    let left = names_in(&small);
    let _ = std::process::Command::new("umount").arg(&small).status();
    assert_eq!(r.unwrap_err(), FsError::NoSpace);
    assert!(left.is_empty(), "{left:?}");
}

#[test]
fn restore_refuses_a_store_that_is_no_backup_and_installs_a_backup_at_its_own_epoch() {
    let dir = tempfile::tempdir().unwrap();
    let (store, clock, config, meta) = formatted(dir.path(), 30);
    let backup = dir.path().join("b.redb");
    let backup_epoch = store
        .backup(&backup, false, TAKEN_AT, "test")
        .unwrap()
        .record
        .boot_epoch;
    let want = dump(&store);
    drop(store);
    // Two more starts: the old store's start count moves past the backup's.
    for _ in 0..2 {
        drop(Store::open(&Backend::File(meta.clone()), clock.clone(), 64).unwrap());
    }
    let old_epoch = {
        let s = Store::open(&Backend::File(meta.clone()), clock.clone(), 64).unwrap();
        s.boot_epoch()
    };

    // A copy of a live store is no backup.
    let plain = dir.path().join("plain.redb");
    std::fs::copy(&meta, &plain).unwrap();
    let run = mds([
        "restore",
        "--config",
        config.to_str().unwrap(),
        plain.to_str().unwrap(),
        "--force",
    ]);
    assert_eq!(run.code, Some(2), "{run:?}");
    assert!(run.stderr.contains("not a backup"), "{run:?}");
    let run = mds(["fsck", "--backup", plain.to_str().unwrap()]);
    assert!(run.stdout.contains("no backup record"), "{run:?}");

    // Over the store (of the same fs), with --force: the restored server starts at the
    // backup's epoch + 1, lower than the old store's (running agents refuse it).
    let run = mds([
        "restore",
        "--config",
        config.to_str().unwrap(),
        backup.to_str().unwrap(),
        "--force",
    ]);
    assert_eq!(run.code, Some(0), "{run:?}");
    let restored = Store::open(&Backend::File(meta.clone()), clock.clone(), 64).unwrap();
    assert!(old_epoch > backup_epoch + 1, "{old_epoch} {backup_epoch}");
    assert_eq!(restored.boot_epoch(), backup_epoch + 1);
    assert_eq!(dump(&restored), want);
    drop(restored);

    // Where no store is: installed without --force.
    std::fs::remove_file(&meta).unwrap();
    let run = mds([
        "restore",
        "--config",
        config.to_str().unwrap(),
        backup.to_str().unwrap(),
    ]);
    assert_eq!(run.code, Some(0), "{run:?}");
    let run = mds(["fsck", "--config", config.to_str().unwrap()]);
    assert_eq!(run.code, Some(0), "{run:?}");
    let restored = Store::open(&Backend::File(meta.clone()), clock.clone(), 64).unwrap();
    assert_eq!(dump(&restored), want);
    assert_eq!(restored.boot_epoch(), backup_epoch + 1);
    drop(restored);

    // One start since the backup (the store's epoch is the backup's + 1): the restored start
    // would reuse that epoch, so it goes one past it.
    let run = mds([
        "restore",
        "--config",
        config.to_str().unwrap(),
        backup.to_str().unwrap(),
        "--force",
    ]);
    assert_eq!(run.code, Some(0), "{run:?}");
    let restored = Store::open(&Backend::File(meta), clock, 64).unwrap();
    assert_eq!(restored.boot_epoch(), backup_epoch + 2);
}

#[test]
fn a_backup_restores_onto_a_store_on_a_metadata_lun() {
    // A file stands in for the metadata LUN (the block backend works on either).
    let dir = tempfile::tempdir().unwrap();
    let luns = lun_files(dir.path(), &[16 * MIB]);
    let meta = dir.path().join("metadata-lun-h15");
    std::fs::File::create(&meta)
        .unwrap()
        .set_len(32 * MIB)
        .unwrap();
    let config = dir.path().join("mds.toml");
    std::fs::write(
        &config,
        format!(
            "[metadata]\npath = \"{}\"\nkind = \"block\"\n\n[volume]\nlayout = \"linear\"\ndevices = {}\n",
            meta.display(),
            toml_paths(&luns)
        ),
    )
    .unwrap();
    let run = mds(["format", "--config", config.to_str().unwrap()]);
    assert!(run.success(), "{run:?}");
    let clock = Clock::manual(EPOCH_SEC);
    let backend = Backend::Device(meta.clone());
    let store = Store::open(&backend, clock.clone(), 64).unwrap();
    let mut rng = Rng::new(0xbac0_0000_0000_0017);
    let mut state = dump(&store);
    for _ in 0..40 {
        let op = generate(&mut rng, &state);
        tick(&clock);
        let _ = apply(&store, &op);
        state = dump(&store);
    }
    let backup = dir.path().join("b.redb");
    store.backup(&backup, false, TAKEN_AT, "test").unwrap();
    let want = dump(&store);
    // Changes after the backup: gone after the restore.
    for _ in 0..20 {
        let op = generate(&mut rng, &state);
        tick(&clock);
        let _ = apply(&store, &op);
        state = dump(&store);
    }
    assert_ne!(state, want, "no change after the backup");
    drop(store);

    let run = mds([
        "restore",
        "--config",
        config.to_str().unwrap(),
        backup.to_str().unwrap(),
    ]);
    assert_eq!(run.code, Some(2), "{run:?}");
    assert!(run.stderr.contains("--force"), "{run:?}");
    let run = mds([
        "restore",
        "--config",
        config.to_str().unwrap(),
        backup.to_str().unwrap(),
        "--force",
    ]);
    assert_eq!(run.code, Some(0), "{run:?}");
    let run = mds(["fsck", "--config", config.to_str().unwrap()]);
    assert_eq!(run.code, Some(0), "{run:?}");
    let restored = Store::open(&backend, clock, 64).unwrap();
    assert_eq!(dump(&restored), want);
}

#[test]
fn restore_names_the_luns_added_after_the_backup() {
    let dir = tempfile::tempdir().unwrap();
    let (store, _clock, config, _meta) = formatted(dir.path(), 10);
    let backup = dir.path().join("b.redb");
    store.backup(&backup, false, TAKEN_AT, "test").unwrap();
    // A growth after the backup: one more LUN, labelled for this file system.
    let added = dir.path().join("added-lun-h15");
    std::fs::File::create(&added)
        .unwrap()
        .set_len(16 * MIB)
        .unwrap();
    let luns: Vec<PathBuf> = (0..2).map(|i| dir.path().join(format!("lun{i}"))).collect();
    let devices = Arc::new(sanfs_mds::datadev::DataDevices::open(
        &store.volume(),
        &luns,
    ));
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(sanfs_mds::grow::grow(
        &store,
        &devices,
        sanfs_proto::model::GrowVolumeRequest {
            device_paths: vec![added.to_string_lossy().into_owned()],
            layout: sanfs_proto::model::GrowLayout::Linear,
            force: false,
        },
        EPOCH_SEC,
    ))
    .unwrap();
    drop(store);
    let mut all = luns.clone();
    all.push(added.clone());
    let config_text = std::fs::read_to_string(&config)
        .unwrap()
        .replace(&toml_paths(&luns), &toml_paths(&all));
    std::fs::write(&config, config_text).unwrap();

    let run = mds([
        "restore",
        "--config",
        config.to_str().unwrap(),
        backup.to_str().unwrap(),
        "--force",
    ]);
    assert_eq!(run.code, Some(0), "{run:?}");
    assert!(
        run.stdout.contains(&format!(
            "warning: {} is labelled for this file system but is not in the backup's volume",
            added.display()
        )),
        "{run:?}"
    );
    assert!(run.stdout.contains("LUN labels checked: 3"), "{run:?}");
    // The original LUNs are not named.
    assert_eq!(run.stdout.matches("warning:").count(), 1, "{run:?}");
}
