//! `sanfs-mds fsck` through the real binary: it never changes the store it checks, says why it
//! cannot check one (needs repair: exit 3; in use by a server: exit 4), and `--repair`
//! (with `--dry-run`: on a copy in memory) repairs what it safely can.

use std::path::{Path, PathBuf};

use redb::{Database, ReadableTable};
use sanfs_mds::clock::Clock;
use sanfs_mds::store::{Backend, COUNTERS, FREE, Store};

use crate::common::{Run, mds, write_config};
use crate::crash::{EPOCH_SEC, Rng, apply, dump, generate, tick};
use crate::support::fs_info;

/// A store with a few dozen operations done, in `dir/meta.redb`, and its config. The store
/// is returned open.
fn store_in(dir: &Path) -> (Store, PathBuf, PathBuf) {
    let config = write_config(
        dir,
        "layout = \"linear\"\ndevices = [\"/nonexistent/sanfs-h1-lun\"]",
    );
    let meta = dir.join("meta.redb");
    let clock = Clock::manual(EPOCH_SEC);
    let backend = Backend::File(meta.clone());
    sanfs_testcluster::mds::create_store(&backend, &fs_info(), &clock).unwrap();
    let store = Store::open(&backend, clock.clone(), 64).unwrap();
    let mut rng = Rng::new(0x5a4e_f5c4_0000_00f1);
    let mut state = dump(&store);
    for _ in 0..40 {
        let op = generate(&mut rng, &state);
        tick(&clock);
        let _ = apply(&store, &op);
        state = dump(&store);
    }
    (store, meta, config)
}

fn fsck(config: &Path, extra: &[&str]) -> Run {
    let mut args = vec!["fsck"];
    args.extend_from_slice(extra);
    args.extend_from_slice(&["--config", config.to_str().unwrap()]);
    mds(args)
}

#[test]
fn fsck_leaves_a_cleanly_stopped_store_byte_for_byte_unchanged() {
    let dir = tempfile::tempdir().unwrap();
    let (store, meta, config) = store_in(dir.path());
    drop(store);
    let before = std::fs::read(&meta).unwrap();
    for _ in 0..2 {
        let run = fsck(&config, &[]);
        assert_eq!(run.code, Some(0), "{run:?}");
        assert!(run.stdout.contains("clean"), "{run:?}");
        assert!(
            std::fs::read(&meta).unwrap() == before,
            "fsck changed the store's bytes"
        );
    }
    // --repair with nothing to repair writes nothing either.
    let run = fsck(&config, &["--repair"]);
    assert_eq!(run.code, Some(0), "{run:?}");
    assert!(run.stdout.contains("nothing to repair"), "{run:?}");
    assert!(std::fs::read(&meta).unwrap() == before);
}

#[test]
fn an_unclean_store_needs_repair_and_only_repair_changes_it() {
    let dir = tempfile::tempdir().unwrap();
    let (store, meta, config) = store_in(dir.path());
    // A copy of the open store, as after a crash of the server.
    let crashed = std::fs::read(&meta).unwrap();
    drop(store);
    std::fs::write(&meta, &crashed).unwrap();

    let run = fsck(&config, &[]);
    assert_eq!(run.code, Some(3), "{run:?}");
    assert!(run.stderr.contains("needs repair"), "{run:?}");
    assert!(run.stderr.contains("fsck --repair"), "{run:?}");
    assert!(
        std::fs::read(&meta).unwrap() == crashed,
        "fsck changed the store"
    );

    let run = fsck(&config, &["--repair", "--dry-run"]);
    assert_eq!(run.code, Some(0), "{run:?}");
    assert!(
        run.stdout
            .contains("would repair: the store was not shut down cleanly"),
        "{run:?}"
    );
    assert!(run.stdout.contains("nothing was changed"), "{run:?}");
    assert!(
        std::fs::read(&meta).unwrap() == crashed,
        "--dry-run changed the store"
    );

    let run = fsck(&config, &["--repair"]);
    assert_eq!(run.code, Some(0), "{run:?}");
    assert!(
        run.stdout
            .contains("repaired: the store was not shut down cleanly")
    );
    let run = fsck(&config, &[]);
    assert_eq!(run.code, Some(0), "{run:?}");
}

#[test]
fn fsck_of_a_store_a_server_holds_says_it_is_in_use() {
    let dir = tempfile::tempdir().unwrap();
    let (store, meta, config) = store_in(dir.path());
    for extra in [&[][..], &["--repair"][..], &["--repair", "--dry-run"][..]] {
        let run = fsck(&config, extra);
        assert_eq!(run.code, Some(4), "{extra:?}: {run:?}");
        assert!(run.stderr.contains("in use"), "{run:?}");
        assert!(run.stderr.contains("stop that server"), "{run:?}");
    }
    drop(store);
    assert_eq!(fsck(&config, &[]).code, Some(0));
    let _ = meta;
}

#[test]
fn repair_returns_leaked_blocks_and_moves_the_next_inode_number() {
    let dir = tempfile::tempdir().unwrap();
    let (store, meta, config) = store_in(dir.path());
    drop(store);
    let clean = fsck(&config, &[]);
    assert_eq!(clean.code, Some(0), "{clean:?}");
    // Damage that loses nothing: one free run forgotten (leaked), the next inode number
    // moved back to 2 (below inodes that exist).
    {
        let db = Database::open(&meta).unwrap();
        let txn = db.begin_write().unwrap();
        {
            let mut free = txn.open_table(FREE).unwrap();
            let first = free.iter().unwrap().next().unwrap().unwrap().0.value();
            free.remove(first).unwrap();
            let mut counters = txn.open_table(COUNTERS).unwrap();
            counters.insert("next_inode", 2).unwrap();
        }
        txn.commit().unwrap();
    }
    let damaged = std::fs::read(&meta).unwrap();
    let run = fsck(&config, &[]);
    assert_eq!(run.code, Some(1), "{run:?}");
    assert!(run.stdout.contains("(leaked)"), "{run:?}");
    assert!(run.stdout.contains("is not below the next inode number 2"));

    let run = fsck(&config, &["--repair", "--dry-run"]);
    assert_eq!(run.code, Some(0), "{run:?}");
    assert!(
        run.stdout
            .contains("would repair: return leaked volume blocks"),
        "{run:?}"
    );
    assert!(
        run.stdout
            .contains("would repair: set the next inode number from 2 to"),
        "{run:?}"
    );
    assert!(std::fs::read(&meta).unwrap() == damaged, "--dry-run wrote");

    let run = fsck(&config, &["--repair"]);
    assert_eq!(run.code, Some(0), "{run:?}");
    let after = fsck(&config, &[]);
    assert_eq!(after.code, Some(0), "{after:?}");
    // The same summary line as before the damage: the same blocks free, the same inodes.
    assert_eq!(
        after.stdout.lines().last(),
        clean.stdout.lines().last(),
        "{after:?}"
    );
}
