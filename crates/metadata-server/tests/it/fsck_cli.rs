//! `sanfs-mds fsck` through the real binary: it never changes the store it checks, says why it
//! cannot check one (needs repair: exit 3; in use by a server: exit 4), and `--repair`
//! (with `--dry-run`: on a copy in memory) repairs what it safely can.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use redb::{Database, ReadableDatabase, ReadableTable};
use sanfs_mds::clock::Clock;
use sanfs_mds::store::records::InodeRec;
use sanfs_mds::store::{Backend, COOKIES, COUNTERS, DIRENTS, FREE, INODES, ROOT, Store};
use sanfs_proto::types::FileType;

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
    // A copy of the open store (its file and its journal), as after a crash of the server.
    let journal = sanfs_mds::store::journal::journal_path(&meta);
    let crashed = std::fs::read(&meta).unwrap();
    let crashed_journal = std::fs::read(&journal).unwrap();
    drop(store);
    std::fs::write(&meta, &crashed).unwrap();
    std::fs::write(&journal, &crashed_journal).unwrap();

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

// --- damage on purpose, repaired by --repair -------------------------------------------------

/// One directory entry as the store keeps it.
#[derive(Debug, Clone)]
struct Entry {
    dir: u64,
    name: Vec<u8>,
    child: u64,
    cookie: u64,
}

fn entries(meta: &Path) -> Vec<Entry> {
    let db = Database::open(meta).unwrap();
    let r = db.begin_read().unwrap();
    let t = r.open_table(DIRENTS).unwrap();
    t.iter()
        .unwrap()
        .map(|item| {
            let (k, v) = item.unwrap();
            let (dir, name) = k.value();
            let (child, cookie, _) = v.value();
            Entry {
                dir,
                name: name.to_vec(),
                child,
                cookie,
            }
        })
        .collect()
}

fn inodes(meta: &Path) -> BTreeMap<u64, InodeRec> {
    let db = Database::open(meta).unwrap();
    let r = db.begin_read().unwrap();
    let t = r.open_table(INODES).unwrap();
    t.iter()
        .unwrap()
        .map(|item| {
            let (k, v) = item.unwrap();
            (k.value(), InodeRec::decode(v.value()).unwrap())
        })
        .collect()
}

/// Changes the store directly, as a bug or a bad restore would.
fn damage(meta: &Path, f: impl FnOnce(&redb::WriteTransaction)) {
    let db = Database::open(meta).unwrap();
    let txn = db.begin_write().unwrap();
    f(&txn);
    txn.commit().unwrap();
}

fn edit_inode(txn: &redb::WriteTransaction, ino: u64, f: impl FnOnce(&mut InodeRec)) {
    let mut t = txn.open_table(INODES).unwrap();
    let mut rec = InodeRec::decode(t.get(ino).unwrap().unwrap().value()).unwrap();
    f(&mut rec);
    t.insert(ino, rec.encode().as_slice()).unwrap();
}

/// Removes an entry (and its readdir cookie), keeping its directory's size right.
fn drop_entry(txn: &redb::WriteTransaction, e: &Entry) {
    txn.open_table(DIRENTS)
        .unwrap()
        .remove((e.dir, e.name.as_slice()))
        .unwrap();
    txn.open_table(COOKIES)
        .unwrap()
        .remove((e.dir, e.cookie))
        .unwrap();
    edit_inode(txn, e.dir, |d| d.size -= 1);
}

fn summary(run: &Run) -> String {
    run.stdout.lines().last().unwrap_or_default().to_owned()
}

/// The problems of a plain fsck, which a dry run must leave as they were.
fn problems(run: &Run) -> Vec<String> {
    run.stdout
        .lines()
        .filter(|l| l.starts_with("problem: "))
        .map(str::to_owned)
        .collect()
}

/// A damaged store: the plain check lists problems (exit 1); a dry run lists the repairs,
/// says the result is clean, and changes no byte; a second check shows the same problems.
fn check_dry_run(config: &Path, meta: &Path, expect: &[&str]) -> Vec<String> {
    let run = fsck(config, &[]);
    assert_eq!(run.code, Some(1), "{run:?}");
    let found = problems(&run);
    let damaged = std::fs::read(meta).unwrap();
    let dry = fsck(config, &["--repair", "--dry-run"]);
    assert_eq!(dry.code, Some(0), "{dry:?}");
    for e in expect {
        assert!(
            dry.stdout.contains(&format!("would repair: {e}")),
            "{e}\n{dry:?}"
        );
    }
    assert!(dry.stdout.contains("nothing was changed"), "{dry:?}");
    assert!(std::fs::read(meta).unwrap() == damaged, "--dry-run wrote");
    let again = fsck(config, &[]);
    assert_eq!(problems(&again), found, "a dry run changed what fsck finds");
    found
}

#[test]
fn repair_sets_counts_sizes_and_parents_from_the_entries_and_extents() {
    let dir = tempfile::tempdir().unwrap();
    let (store, meta, config) = store_in(dir.path());
    drop(store);
    let clean = fsck(&config, &[]);
    assert_eq!(clean.code, Some(0), "{clean:?}");
    let all = inodes(&meta);
    let file = *all
        .iter()
        .find(|(_, r)| r.kind == FileType::Regular && r.nlink > 0)
        .expect("the workload made a regular file")
        .0;
    let subdir = *all
        .iter()
        .find(|(i, r)| **i != ROOT && r.is_dir() && r.nlink >= 2)
        .expect("the workload made a directory")
        .0;
    let (f_nlink, f_blocks) = (all[&file].nlink, all[&file].blocks);
    let (d_nlink, d_size, d_parent) = (all[&subdir].nlink, all[&subdir].size, all[&subdir].parent);
    let root_size = all[&ROOT].size;
    damage(&meta, |txn| {
        edit_inode(txn, file, |r| {
            r.nlink += 3;
            r.blocks += 7;
        });
        edit_inode(txn, subdir, |r| {
            r.nlink += 1;
            r.size += 2;
            r.parent = file;
        });
        edit_inode(txn, ROOT, |r| r.size += 1);
    });
    let found = check_dry_run(
        &config,
        &meta,
        &[
            &format!(
                "set the link count of inode {file} from {} to {f_nlink}",
                f_nlink + 3
            ),
            &format!(
                "set the block count of inode {file} from {} to {f_blocks}",
                f_blocks + 7
            ),
            &format!(
                "set the link count of inode {subdir} from {} to {d_nlink}",
                d_nlink + 1
            ),
            &format!(
                "set the size of directory {subdir} from {} to {d_size}",
                d_size + 2
            ),
            &format!("set the parent of directory {subdir} from {file} to {d_parent}"),
            &format!(
                "set the size of directory {ROOT} from {} to {root_size}",
                root_size + 1
            ),
        ],
    );
    assert!(found.len() >= 6, "{found:?}");

    let run = fsck(&config, &["--repair"]);
    assert_eq!(run.code, Some(0), "{run:?}");
    assert!(
        run.stdout.contains("repaired: set the link count"),
        "{run:?}"
    );
    let after = fsck(&config, &[]);
    assert_eq!(after.code, Some(0), "{after:?}");
    assert_eq!(summary(&after), summary(&clean));
    assert_eq!(inodes(&meta), all, "the repair did not restore the records");
}

#[test]
fn repair_lists_lost_orphans_and_connects_lost_inodes_to_lost_found() {
    let dir = tempfile::tempdir().unwrap();
    let (store, meta, config) = store_in(dir.path());
    drop(store);
    let clean = fsck(&config, &[]);
    assert_eq!(clean.code, Some(0), "{clean:?}");
    let all = inodes(&meta);
    let ents = entries(&meta);
    let named_once = |want_dir: bool| -> Vec<Entry> {
        ents.iter()
            .filter(|e| {
                let r = &all[&e.child];
                r.is_dir() == want_dir
                    && (want_dir || r.nlink == 1)
                    && ents.iter().filter(|o| o.child == e.child).count() == 1
            })
            .cloned()
            .collect()
    };
    let files = named_once(false);
    let dirs = named_once(true);
    assert!(files.len() >= 2 && !dirs.is_empty(), "{files:?} {dirs:?}");
    let (unlinked, lost_file, lost_dir) = (&files[0], &files[1], &dirs[0]);
    damage(&meta, |txn| {
        // Unlinked while open, its orphan record lost.
        drop_entry(txn, unlinked);
        edit_inode(txn, unlinked.child, |r| r.nlink = 0);
        // Entries lost.
        drop_entry(txn, lost_file);
        drop_entry(txn, lost_dir);
        edit_inode(txn, lost_dir.dir, |r| r.nlink -= 1);
    });
    let (u, f, d) = (unlinked.child, lost_file.child, lost_dir.child);
    check_dry_run(
        &config,
        &meta,
        &[
            &format!("list inode {u} (no links, in no directory) as an orphan"),
            &format!("connect inode {f} (in no directory) to /lost+found as #{f}"),
            &format!("connect inode {d} (in no directory) to /lost+found as #{d}"),
        ],
    );
    let run = fsck(&config, &["--repair"]);
    assert_eq!(run.code, Some(0), "{run:?}");
    let after = fsck(&config, &[]);
    assert_eq!(after.code, Some(0), "{after:?}");

    // /lost+found holds the two, under their inode numbers; nothing was freed.
    let ents = entries(&meta);
    let lf = ents
        .iter()
        .find(|e| e.dir == ROOT && e.name == b"lost+found")
        .expect("/lost+found was made")
        .child;
    let mut in_lf: Vec<(Vec<u8>, u64)> = ents
        .iter()
        .filter(|e| e.dir == lf)
        .map(|e| (e.name.clone(), e.child))
        .collect();
    in_lf.sort();
    let mut want = vec![
        (format!("#{f}").into_bytes(), f),
        (format!("#{d}").into_bytes(), d),
    ];
    want.sort();
    assert_eq!(in_lf, want);
    let now = inodes(&meta);
    assert_eq!(now[&lf].perm, 0o700);
    assert_eq!(now[&lf].nlink, 3, "/lost+found holds one directory");
    assert_eq!(now[&d].parent, lf);
    assert_eq!(now[&f].nlink, 1);
    assert_eq!(now[&u].nlink, 0, "the unlinked inode waits as an orphan");

    // The next start reaps the orphan, as an inode unlinked while open.
    let store = Store::open(
        &Backend::File(meta.clone()),
        Clock::manual(EPOCH_SEC + 10),
        64,
    )
    .unwrap();
    drop(store);
    assert!(!inodes(&meta).contains_key(&u), "the orphan was not reaped");
    let run = fsck(&config, &[]);
    assert_eq!(run.code, Some(0), "{run:?}");

    // A second repair of a clean store finds nothing, and an existing /lost+found is used.
    let run = fsck(&config, &["--repair"]);
    assert!(run.stdout.contains("nothing to repair"), "{run:?}");
}

#[test]
fn fsck_and_repair_reports_in_json() {
    let dir = tempfile::tempdir().unwrap();
    let (store, meta, config) = store_in(dir.path());
    drop(store);
    let run = fsck(&config, &["--json"]);
    assert_eq!(run.code, Some(0), "{run:?}");
    let clean: serde_json::Value = serde_json::from_str(&run.stdout).unwrap();
    assert_eq!(clean["problems"], serde_json::json!([]));
    assert!(clean["inodes"].as_u64().unwrap() > 1, "{clean}");

    let file = *inodes(&meta)
        .iter()
        .find(|(_, r)| r.kind == FileType::Regular && r.nlink > 0)
        .unwrap()
        .0;
    damage(&meta, |txn| edit_inode(txn, file, |r| r.nlink += 1));
    let run = fsck(&config, &["--json"]);
    assert_eq!(run.code, Some(1), "{run:?}");
    let report: serde_json::Value = serde_json::from_str(&run.stdout).unwrap();
    assert_eq!(report["problems"].as_array().unwrap().len(), 1, "{report}");
    assert_eq!(report["fixes"][0]["kind"], "link_count", "{report}");
    assert_eq!(report["fixes"][0]["ino"], file, "{report}");

    let run = fsck(&config, &["--repair", "--dry-run", "--json"]);
    assert_eq!(run.code, Some(0), "{run:?}");
    let repair: serde_json::Value = serde_json::from_str(&run.stdout).unwrap();
    assert_eq!(repair["dry_run"], true);
    assert_eq!(repair["fixes"], report["fixes"]);
    assert_eq!(repair["after"]["problems"], serde_json::json!([]));
}
