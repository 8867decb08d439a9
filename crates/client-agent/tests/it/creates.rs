//! Creates answered by the agent (docs/protocol.md "Creates answered by the agent"), with
//! real processes: one `sanfs-mds serve` and two `sanfs-agent mount`s of it. A node that made
//! a directory answers the creates of new files there itself and sends them behind the
//! answer; the other node's look into the directory recalls the delegation first and sees
//! every file, with the inode numbers the first node's applications were given; a server
//! killed with creates not answered by it yet gets them from the agent's replay; fsck is clean.
//! Needs root and /dev/fuse (skipped otherwise).

use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::mount::{can_mount, timed};
use crate::replay::{Agent, start_mds};

/// The other node looks through the kernel at once: no TTL of the kernel's own.
const LOOKER: &str = "attr_ttl=0,entry_ttl=0";

/// `sanfs-agent status --json` of `mount`: its creates answered here, and not answered by
/// the server yet.
fn creates_here(mount: &Path) -> (u64, u64) {
    let c = creates_status(mount);
    (
        c["here"].as_u64().unwrap_or(0),
        c["unanswered_now"].as_u64().unwrap_or(0),
    )
}

/// Unlinks and renames answered here, and those not answered by the server yet.
fn changes_here(mount: &Path) -> (u64, u64, u64) {
    let c = creates_status(mount);
    let n = |k: &str| c[k].as_u64().unwrap_or(0);
    (
        n("unlinks_here"),
        n("renames_here"),
        n("changes_unanswered_now"),
    )
}

/// Renames every other name of `made` within `dir` (`m-` before it): the names then.
fn rename_half(dir: &Path, made: &BTreeMap<String, u64>) -> BTreeMap<String, u64> {
    let mut now = BTreeMap::new();
    for (i, (name, ino)) in made.iter().enumerate() {
        let name = if i % 2 == 0 {
            let to = format!("m-{name}");
            std::fs::rename(dir.join(name), dir.join(&to)).unwrap();
            to
        } else {
            name.clone()
        };
        now.insert(name, *ino);
    }
    now
}

fn creates_status(mount: &Path) -> serde_json::Value {
    let out = Command::new(env!("CARGO_BIN_EXE_sanfs-agent"))
        .args(["status", "--json"])
        .arg(mount)
        .output()
        .unwrap();
    let j: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("status --json ({e}): {out:?}"));
    j["agent"]["creates"].clone()
}

/// Unlinks every name of `made` but each third, as `rm` does: what is left.
fn unlink_most(dir: &Path, made: &BTreeMap<String, u64>) -> BTreeMap<String, u64> {
    let mut left = BTreeMap::new();
    for (i, (name, ino)) in made.iter().enumerate() {
        if i % 3 == 0 {
            left.insert(name.clone(), *ino);
        } else {
            std::fs::remove_file(dir.join(name)).unwrap();
        }
    }
    left
}

/// A file's times as `stat` shows them: mtime and ctime, seconds and nanoseconds.
type Times = [i64; 4];

fn times(m: &std::fs::Metadata) -> Times {
    [m.mtime(), m.mtime_nsec(), m.ctime(), m.ctime_nsec()]
}

/// Makes `dir` and `n` empty files in it (`open(O_CREAT|O_EXCL)` + `close`, a few with
/// bytes): their inode numbers by name, as the creating node's applications saw them, and
/// the times they saw of the files without bytes.
fn make_files(dir: PathBuf, n: usize) -> (BTreeMap<String, u64>, BTreeMap<String, Times>) {
    std::fs::create_dir(&dir).unwrap();
    let (mut made, mut seen_times) = (BTreeMap::new(), BTreeMap::new());
    for i in 0..n {
        let name = format!("f{i:04}");
        let p = dir.join(&name);
        let f = std::fs::File::create_new(&p).unwrap();
        let m = f.metadata().unwrap();
        if i % 50 == 7 {
            use std::io::Write;
            let mut f = f;
            f.write_all(name.as_bytes()).unwrap();
        } else {
            seen_times.insert(name.clone(), times(&m));
        }
        made.insert(name, m.ino());
    }
    (made, seen_times)
}

/// The `write_back` counter `name` of `mount`'s agent.
fn write_back_count(mount: &Path, name: &str) -> u64 {
    let out = Command::new(env!("CARGO_BIN_EXE_sanfs-agent"))
        .args(["status", "--json"])
        .arg(mount)
        .output()
        .unwrap();
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    j["agent"]["write_back"][name].as_u64().unwrap_or(0)
}

/// Makes `dir` and `n` files in it as `tar x` does: create, write the bytes, set the times
/// (mtime of file `i`: `1_000_000 + i` s), the owners it has and the mode 0640, close.
fn untar_files(dir: PathBuf, n: usize) -> BTreeMap<String, Vec<u8>> {
    use std::io::Write;
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir(&dir).unwrap();
    (0..n)
        .map(|i| {
            let name = format!("t{i:03}");
            let bytes = format!("{name} ").repeat(1 + i * 37 % 400).into_bytes();
            let mut f = std::fs::File::create_new(dir.join(&name)).unwrap();
            f.write_all(&bytes).unwrap();
            let t = std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_000_000 + i as u64);
            f.set_times(std::fs::FileTimes::new().set_modified(t).set_accessed(t))
                .unwrap();
            let m = f.metadata().unwrap();
            std::os::unix::fs::fchown(&f, Some(m.uid()), Some(m.gid())).unwrap();
            f.set_permissions(std::fs::Permissions::from_mode(0o640))
                .unwrap();
            (name, bytes)
        })
        .collect()
}

/// The mode bits, mtime and times of `dir` as this node shows them.
fn dir_attrs(dir: &Path) -> (u32, i64, i64, Times) {
    use std::os::unix::fs::PermissionsExt;
    let m = std::fs::metadata(dir).unwrap();
    (
        m.permissions().mode() & 0o7777,
        m.mtime(),
        m.mtime_nsec(),
        times(&m),
    )
}

/// The names, inode numbers and times in `dir` as this node lists them.
fn listed_with_times(dir: &Path) -> BTreeMap<String, (u64, Times)> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            let m = std::fs::symlink_metadata(e.path()).unwrap();
            (
                e.file_name().to_string_lossy().into_owned(),
                (m.ino(), times(&m)),
            )
        })
        .collect()
}

/// The names and inode numbers in `dir` as this node lists them.
fn listed(dir: &Path) -> BTreeMap<String, u64> {
    listed_with_times(dir)
        .into_iter()
        .map(|(name, (ino, _))| (name, ino))
        .collect()
}

/// The times `seen` lists differ from what the creating node's applications saw.
fn times_changed(
    saw: &BTreeMap<String, Times>,
    seen: &BTreeMap<String, (u64, Times)>,
) -> Vec<String> {
    saw.iter()
        .filter(|(name, t)| seen.get(*name).map(|s| &s.1) != Some(*t))
        .map(|(name, t)| format!("{name}: {t:?} then {:?}", seen.get(name)))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn creates_answered_here_are_seen_by_the_other_node_and_survive_a_server_kill() {
    if !can_mount() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (mut mds, luns) = start_mds(dir.path());
    let a = Agent::mount_as(
        dir.path(),
        "mnt-a",
        "creates-a",
        "async_creates=on",
        &mds,
        &luns,
    )
    .await;
    let b = Agent::mount_as(dir.path(), "mnt-b", "creates-b", LOOKER, &mds, &luns).await;

    // 1. A makes a directory and files in it; B lists it: every file, A's inode numbers.
    let d1 = a.mount.join("d1");
    let (made, saw) = timed("A's creates", 120, move || make_files(d1, 400)).await;
    let (here, _) = creates_here(&a.mount);
    let seen = {
        let d1 = b.mount.join("d1");
        timed("B's listing", 60, move || listed_with_times(&d1)).await
    };
    let inos = seen.iter().map(|(n, (ino, _))| (n.clone(), *ino)).collect();
    assert_eq!(made, inos, "B's listing of A's directory");
    // The server made them with the times A's applications saw, and so does A show them now.
    let changed = times_changed(&saw, &seen);
    assert!(changed.is_empty(), "times B sees: {changed:#?}");
    let again = {
        let d1 = a.mount.join("d1");
        timed("A's listing", 60, move || listed_with_times(&d1)).await
    };
    let changed = times_changed(&saw, &again);
    assert!(
        changed.is_empty(),
        "times A sees after the replies: {changed:#?}"
    );
    // The other way: one of them read through B, with its bytes.
    let p = b.mount.join("d1/f0007");
    assert_eq!(std::fs::read(&p).unwrap(), b"f0007");
    assert!(
        here > 300,
        "most of A's creates are answered by A itself ({here} of 400)"
    );

    // 1b. Files A made, renames within their directory and removes again (as a build or
    // `rm -r` after `tar x`): answered by A too, and B sees exactly what is left.
    let d3 = a.mount.join("d3");
    let (made3, _) = timed("A's creates in d3", 120, move || make_files(d3, 300)).await;
    let left3 = {
        let d3 = a.mount.join("d3");
        timed("A's renames and unlinks", 120, move || {
            unlink_most(&d3, &rename_half(&d3, &made3))
        })
        .await
    };
    let (unlinked, renamed, _) = changes_here(&a.mount);
    let seen3 = {
        let d3 = b.mount.join("d3");
        timed("B's listing of d3", 60, move || listed(&d3)).await
    };
    assert_eq!(seen3, left3, "B's listing after A's renames and unlinks");
    assert!(
        unlinked > 150 && renamed > 100,
        "most of A's unlinks and renames are answered by A itself ({unlinked} of 200, {renamed} of 150)"
    );

    // 2. More creates while the server does not answer at all (stopped): A answers them
    // itself; then the server is killed and started again (A lives): A's replay makes them.
    let d2 = a.mount.join("d2");
    std::fs::create_dir(&d2).unwrap();
    // Made relative to the directory (opened while the server answers): a path walk from
    // the root would ask the server about the root's names, which this node does not hold.
    let at = std::fs::File::open(&d2).unwrap();
    let paused = mds.prepare_restart();
    mds.pause(true);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        use rustix::fs::{Mode, OFlags};
        let made: BTreeMap<String, (u64, Times)> = (0..200)
            .map(|i| {
                let name = format!("g{i:03}");
                #[allow(
                    clippy::disallowed_methods,
                    reason = "a create relative to a directory descriptor, which std cannot do"
                )]
                let fd = rustix::fs::openat(
                    &at,
                    name.as_str(),
                    OFlags::CREATE | OFlags::EXCL | OFlags::WRONLY | OFlags::CLOEXEC,
                    Mode::from_raw_mode(0o644),
                )
                .unwrap();
                let st = rustix::fs::fstat(&fd).unwrap();
                let ns = |n| i64::try_from(n).unwrap();
                let t = [
                    st.st_mtime,
                    ns(st.st_mtime_nsec),
                    st.st_ctime,
                    ns(st.st_ctime_nsec),
                ];
                (name, (st.st_ino, t))
            })
            .collect();
        // And every other one unlinked again, the others renamed, also answered by A alone.
        let mut left = BTreeMap::new();
        for (i, (name, seen)) in made.into_iter().enumerate() {
            if i % 2 == 0 {
                let to = format!("h{i:03}");
                rustix::fs::renameat(&at, name.as_str(), &at, to.as_str()).unwrap();
                left.insert(to, seen);
            } else {
                rustix::fs::unlinkat(&at, name.as_str(), rustix::fs::AtFlags::empty()).unwrap();
            }
        }
        let _ = tx.send(left);
    });
    let made2 = rx.recv_timeout(std::time::Duration::from_secs(30));
    let (_, unanswered) = creates_here(&a.mount);
    let (_, _, changes_unanswered) = changes_here(&a.mount);
    // SIGKILL ends a stopped process too: nothing of what it was sent meanwhile is made.
    mds.stop_and_start(paused, rustix::process::Signal::KILL);
    let made2 = made2.unwrap_or_else(|e| {
        panic!(
            "creates in A's own directory not answered while the server is stopped ({e}); A's log:\n{}",
            a.log_text()
        )
    });
    a.wait_new_session(1).await;
    let seen2 = {
        let d2 = b.mount.join("d2");
        timed("B's listing after the restart", 60, move || {
            listed_with_times(&d2)
        })
        .await
    };
    // Numbers and mtimes (a rename changes the ctime, which the server sets as it makes it).
    let mtimes = |m: &BTreeMap<String, (u64, Times)>| -> BTreeMap<String, (u64, i64, i64)> {
        m.iter()
            .map(|(n, (ino, t))| (n.clone(), (*ino, t[0], t[1])))
            .collect()
    };
    assert_eq!(
        mtimes(&seen2),
        mtimes(&made2),
        "B's listing after the server's kill: A's names, numbers and times"
    );
    let seen1 = {
        let d1 = b.mount.join("d1");
        timed("B's listing of d1 after the restart", 60, move || {
            listed(&d1)
        })
        .await
    };
    assert_eq!(seen1, made);
    assert!(
        !a.log_text().contains("may be lost") && !a.log_text().contains("is lost"),
        "A lost a create:\n{}",
        a.log_text()
    );
    assert!(
        unanswered > 100,
        "creates not answered by the stopped server: {unanswered} of 200"
    );
    assert!(
        changes_unanswered > 100,
        "unlinks and renames not answered by the stopped server: {changes_unanswered} of 200"
    );

    // 3. After the restart, files with bytes, times, owners and a mode, as `tar x` makes
    // them: each create asks for the file's write delegation, so its bytes and attribute
    // changes are held back from the create on and go in one call at its close (no
    // `Delegate`, no `SetAttr` of their own). B sees every byte, mode and mtime.
    let d4 = a.mount.join("d4");
    let with_bytes = write_back_count(&a.mount, "attrs_with_bytes");
    let untarred = timed("A's tar-like files", 120, move || untar_files(d4, 60)).await;
    let with_bytes = write_back_count(&a.mount, "attrs_with_bytes") - with_bytes;
    assert!(
        with_bytes >= 50,
        "the attribute changes of A's new files go with their bytes: {with_bytes} of 60"
    );
    let seen4 = {
        let d4 = b.mount.join("d4");
        timed("B's reads of d4", 60, move || {
            use std::os::unix::fs::PermissionsExt;
            std::fs::read_dir(&d4)
                .unwrap()
                .map(|e| {
                    let p = e.unwrap().path();
                    let m = std::fs::metadata(&p).unwrap();
                    (
                        p.file_name().unwrap().to_string_lossy().into_owned(),
                        (
                            std::fs::read(&p).unwrap(),
                            m.permissions().mode() & 0o7777,
                            m.mtime(),
                        ),
                    )
                })
                .collect::<BTreeMap<_, _>>()
        })
        .await
    };
    let want4: BTreeMap<_, _> = untarred
        .into_iter()
        .enumerate()
        .map(|(i, (name, bytes))| (name, (bytes, 0o640, 1_000_000 + i as i64)))
        .collect();
    assert!(seen4 == want4, "B's view of d4 differs from what A wrote");

    // 4. A directory A made gets its mode and times set, as `tar x` does at its end:
    // answered by A, sent behind; B sees them as A showed them, ctime included.
    let d5 = a.mount.join("d5");
    let attrs_before = creates_status(&a.mount)["attrs_here"].as_u64().unwrap_or(0);
    let shown = {
        let d5 = d5.clone();
        timed("A's directory attributes", 60, move || {
            use std::os::unix::fs::PermissionsExt;
            std::fs::create_dir(&d5).unwrap();
            std::fs::write(d5.join("x"), b"x").unwrap();
            let t = rustix::fs::Timespec {
                tv_sec: 1_234_567,
                tv_nsec: 89,
            };
            rustix::fs::utimensat(
                rustix::fs::CWD,
                &d5,
                &rustix::fs::Timestamps {
                    last_access: t,
                    last_modification: t,
                },
                rustix::fs::AtFlags::empty(),
            )
            .unwrap();
            std::fs::set_permissions(&d5, std::fs::Permissions::from_mode(0o750)).unwrap();
            dir_attrs(&d5)
        })
        .await
    };
    let attrs_here = creates_status(&a.mount)["attrs_here"].as_u64().unwrap_or(0) - attrs_before;
    assert!(
        attrs_here >= 2,
        "A's utimensat and chmod of its own directory answered by A: {attrs_here} of 2"
    );
    let seen5 = {
        let d5 = b.mount.join("d5");
        timed("B's stat of d5", 60, move || dir_attrs(&d5)).await
    };
    assert_eq!(seen5, shown, "d5 as B sees it and as A showed it");
    assert_eq!((shown.0, shown.1, shown.2), (0o750, 1_234_567, 89));

    eprintln!(
        "creates: {here} of 400 answered by the agent; {unanswered} of 200 not answered by the server when it was killed; unlinks and renames: {unlinked} of 200 and {renamed} of 150 answered by the agent, {changes_unanswered} of 200 not answered by the killed server"
    );
    drop(a);
    drop(b);
    mds.stop_and_fsck(dir.path());
}
