//! Attribute and entry leases through two real mounts (issue 19): every change made through
//! one mount (chmod, truncate, a write that grows the file, rename, unlink and create again,
//! create of a name the other node just found absent) is seen by the very next stat or lookup
//! through the other, which held the file's attributes and the directory's names under leases
//! before the change; and stats with no change in between are answered under the leases
//! without asking the server, also after the old fixed 1 s TTL would have run out.
//! `SANFS_LEASE_CHANGES` sets the number of changes (1,000 by default: the acceptance figure).

use std::os::unix::fs::{FileExt, MetadataExt, PermissionsExt};
use std::time::Duration;

use crate::cluster;
use crate::mount::{
    Mount, agent_status, as_uid_1000, can_mount, errno_of, test_seed, timed, xorshift,
};

fn counter(status: &serde_json::Value, name: &str) -> u64 {
    status["agent"]["leases"][name].as_u64().unwrap()
}

/// A server with lease term `ttl_ms`, two mounts of it (`{tag}-a`, `{tag}-b`), and a
/// directory `d` of `files` one-byte files named by `name`, made through the first.
async fn two_mounts_with_files(
    ttl_ms: u64,
    tag: &str,
    files: u32,
    name: fn(u32) -> String,
) -> (cluster::Cluster, Mount, Mount) {
    let srv = cluster::start(ttl_ms).await;
    let a = Mount::start(&srv, &format!("{tag}-a"), "").await;
    let b = Mount::start(&srv, &format!("{tag}-b"), "").await;
    std::fs::create_dir(a.p("d")).unwrap();
    for i in 0..files {
        std::fs::write(a.p(&format!("d/{}", name(i))), b"x").unwrap();
    }
    (srv, a, b)
}

/// No stat or lookup between the two statuses asked the server.
fn no_misses(before: &serde_json::Value, after: &serde_json::Value, what: &str) {
    for miss in ["attr_misses", "entry_misses"] {
        assert_eq!(
            counter(after, miss),
            counter(before, miss),
            "{miss}: {what} asked the server: {before} then {after}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changes_through_one_mount_are_seen_at_once_through_the_other() {
    if !can_mount() {
        return;
    }
    let changes: u64 = std::env::var("SANFS_LEASE_CHANGES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1_000);
    let srv = cluster::start(10_000).await;
    let a = Mount::start(&srv, "lease-a", "").await;
    let b = Mount::start(&srv, "lease-b", "").await;
    let (ra, rb) = (a.path.clone(), b.path.clone());
    let seed = test_seed("leases");
    let stale = timed("changes through a, stats through b", 900, move || {
        std::fs::create_dir(ra.join("d")).unwrap();
        for i in 0..8 {
            std::fs::write(ra.join(format!("d/f{i}")), b"x").unwrap();
        }
        let mut stale: Vec<String> = Vec::new();
        let mut note = |what: String| {
            if stale.len() < 20 {
                eprintln!("stale: {what}");
            }
            stale.push(what);
        };
        let mut x = seed | 1;
        for n in 0..changes {
            let i = xorshift(&mut x) % 8;
            let (fa, fb) = (ra.join(format!("d/f{i}")), rb.join(format!("d/f{i}")));
            // b holds the file's attributes and the directory's names now.
            let before = std::fs::metadata(&fb).unwrap();
            match n % 5 {
                0 => {
                    let mode = 0o400 | (xorshift(&mut x) % 0o400) as u32;
                    std::fs::set_permissions(&fa, std::fs::Permissions::from_mode(mode)).unwrap();
                    let seen = std::fs::metadata(&fb).unwrap().mode() & 0o7777;
                    if seen != mode {
                        note(format!("{n}: chmod {mode:o}, b sees {seen:o}"));
                    }
                }
                1 => {
                    let size = xorshift(&mut x) % 200_000;
                    let f = std::fs::OpenOptions::new().write(true).open(&fa).unwrap();
                    f.set_len(size).unwrap();
                    drop(f);
                    let seen = std::fs::metadata(&fb).unwrap().len();
                    if seen != size {
                        note(format!("{n}: truncate to {size}, b sees {seen}"));
                    }
                }
                2 => {
                    let f = std::fs::OpenOptions::new().write(true).open(&fa).unwrap();
                    let end = f.metadata().unwrap().len();
                    let grow = 1 + xorshift(&mut x) % 70_000;
                    f.write_all_at(&vec![7u8; grow as usize], end).unwrap();
                    drop(f);
                    let seen = std::fs::metadata(&fb).unwrap().len();
                    if seen != end + grow {
                        note(format!("{n}: write to {}, b sees {seen}", end + grow));
                    }
                }
                3 => {
                    let (ra2, rb2) = (ra.join(format!("d/r{i}")), rb.join(format!("d/r{i}")));
                    std::fs::rename(&fa, &ra2).unwrap();
                    match std::fs::metadata(&rb2) {
                        Ok(m) if m.ino() == before.ino() => {}
                        other => note(format!("{n}: rename, b sees the new name as {other:?}")),
                    }
                    if std::fs::metadata(&fb).is_ok() {
                        note(format!("{n}: rename, b still sees the old name"));
                    }
                    std::fs::rename(&ra2, &fa).unwrap();
                    if std::fs::metadata(&fb).map(|m| m.ino()).ok() != Some(before.ino()) {
                        note(format!("{n}: rename back, b does not see the name"));
                    }
                }
                _ => {
                    std::fs::remove_file(&fa).unwrap();
                    if std::fs::metadata(&fb).is_ok() {
                        note(format!("{n}: unlink, b still sees the name"));
                    }
                    std::fs::write(&fa, b"again").unwrap();
                    let ino = std::fs::metadata(&fa).unwrap().ino();
                    let seen = std::fs::metadata(&fb).map(|m| (m.ino(), m.len())).ok();
                    if seen != Some((ino, 5)) {
                        note(format!("{n}: create again as {ino}, b sees {seen:?}"));
                    }
                }
            }
            // A name b found absent (a negative entry under its lease), then created by a.
            if n % 10 == 0 {
                let name = format!("d/n{n}");
                if errno_of(std::fs::metadata(rb.join(&name))) != libc::ENOENT {
                    note(format!("{n}: {name} exists before it was created"));
                }
                std::fs::write(ra.join(&name), b"new").unwrap();
                if std::fs::metadata(rb.join(&name)).map(|m| m.len()).ok() != Some(3) {
                    note(format!("{n}: b does not see {name} created by a"));
                }
            }
        }
        stale
    })
    .await;
    assert!(
        stale.is_empty(),
        "{} of {changes} changes stale through the other mount: {:?}",
        stale.len(),
        &stale[..stale.len().min(10)]
    );
    let st = agent_status(&b.path);
    assert!(
        counter(&st, "recalls") > 0,
        "b answered no lease recall: {st}"
    );

    // No change: stats through b are answered under its leases, also past the old 1 s TTL.
    let pb = b.p("d/f0");
    let p2 = pb.clone();
    timed("warm stat", 60, move || std::fs::metadata(&p2).unwrap()).await;
    tokio::time::sleep(Duration::from_millis(2_100)).await;
    let before = agent_status(&b.path);
    let p2 = pb.clone();
    timed("stats after 2 s", 60, move || {
        for _ in 0..100 {
            std::fs::metadata(&p2).unwrap();
        }
    })
    .await;
    let after = agent_status(&b.path);
    no_misses(&before, &after, "a stat after 2 s");
    // Answered by the kernel (names under leases) or by the agent's cache.
    if !after["agent"]["leases"]["kernel_names"].as_bool().unwrap() {
        assert!(counter(&after, "entry_hits") >= counter(&before, "entry_hits") + 100);
    }
    drop(a);
    drop(b);
    srv.stop().await;
}

/// Leases in use outlive their term: the heartbeats renew them, so stats and lookups through
/// a mount that held them are answered without asking the server long after a fixed TTL
/// would have run out, and a renewed lease is recalled like a fresh one: a chmod, a create of
/// a name found absent, and an unlink through another mount are seen by the next stat.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_in_use_are_renewed_past_their_term_and_still_recalled() {
    if !can_mount() {
        return;
    }
    const TTL_MS: u64 = 1_500;
    let (srv, a, b) = two_mounts_with_files(TTL_MS, "renew", 20, |i| format!("f{i}")).await;
    let stat_all = |root: std::path::PathBuf| {
        move || {
            let mut sizes = Vec::new();
            for i in 0..20 {
                sizes.push(
                    std::fs::metadata(root.join(format!("d/f{i}")))
                        .unwrap()
                        .len(),
                );
            }
            assert_eq!(
                errno_of(std::fs::metadata(root.join("d/absent"))),
                libc::ENOENT
            );
            sizes
        }
    };
    timed("first stats through b", 60, stat_all(b.path.clone())).await;
    let before = agent_status(&b.path);
    // Three terms and more, idle.
    tokio::time::sleep(Duration::from_millis(TTL_MS * 3 + 500)).await;
    timed(
        "stats through b after three terms",
        60,
        stat_all(b.path.clone()),
    )
    .await;
    let after = agent_status(&b.path);
    no_misses(&before, &after, "a stat after three lease terms");
    assert!(
        counter(&after, "renewed") > counter(&before, "renewed"),
        "no lease was renewed: {after}"
    );
    // Renewed leases are recalled by changes through the other mount.
    std::fs::set_permissions(a.p("d/f3"), std::fs::Permissions::from_mode(0o600)).unwrap();
    assert_eq!(
        std::fs::metadata(b.p("d/f3")).unwrap().mode() & 0o7777,
        0o600,
        "b missed a chmod after its lease was renewed"
    );
    std::fs::write(a.p("d/absent"), b"now").unwrap();
    assert_eq!(
        std::fs::metadata(b.p("d/absent")).map(|m| m.len()).ok(),
        Some(3),
        "b missed a create of a name it held absent under a renewed lease"
    );
    std::fs::remove_file(a.p("d/f4")).unwrap();
    assert_eq!(
        errno_of(std::fs::metadata(b.p("d/f4"))),
        libc::ENOENT,
        "b still sees a name unlinked after its lease was renewed"
    );
    let end = agent_status(&b.path);
    assert!(
        counter(&end, "recalls") > counter(&after, "recalls"),
        "{end}"
    );
    drop(a);
    drop(b);
    srv.stop().await;
}

/// A directory's listing is kept under its entry lease: listing it again asks the server
/// nothing, and every change of the directory through either mount (a create, an unlink, a
/// rename, a chmod of an entry) is in the very next listing through the other and this one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listing_is_kept_under_the_lease_and_exact_after_any_change() {
    if !can_mount() {
        return;
    }
    let (srv, a, b) = two_mounts_with_files(10_000, "list", 300, |i| format!("f{i:03}")).await;
    // What `ls -l` sees: every name with its mode.
    let list = |root: std::path::PathBuf| {
        let mut v: Vec<(String, u32)> = std::fs::read_dir(root.join("d"))
            .unwrap()
            .map(|e| {
                let e = e.unwrap();
                let mode = e.metadata().unwrap().mode() & 0o7777;
                (e.file_name().into_string().unwrap(), mode)
            })
            .collect();
        v.sort();
        v
    };
    let mut want: Vec<(String, u32)> = (0..300).map(|i| (format!("f{i:03}"), 0o644)).collect();
    for m in [&b, &a] {
        assert_eq!(list(m.path.clone()), want);
        let before = agent_status(&m.path);
        assert_eq!(list(m.path.clone()), want);
        let after = agent_status(&m.path);
        assert!(
            counter(&after, "listing_hits") > counter(&before, "listing_hits"),
            "listed again from the server: {before} then {after}"
        );
    }
    let mut stale = Vec::new();
    for n in 0..20u32 {
        let (changer, other) = if n % 2 == 0 { (&a, &b) } else { (&b, &a) };
        // Both hold the listing before the change.
        let _ = list(changer.path.clone());
        let _ = list(other.path.clone());
        let i = (n * 7) % 300;
        let name = format!("f{i:03}");
        match n % 4 {
            0 => {
                std::fs::write(changer.p(&format!("d/new{n}")), b"y").unwrap();
                want.push((format!("new{n}"), 0o644));
            }
            1 => {
                std::fs::remove_file(changer.p(&format!("d/{name}"))).unwrap();
                want.retain(|(w, _)| *w != name);
            }
            2 => {
                if let Some(e) = want.iter_mut().find(|(w, _)| *w == name) {
                    std::fs::rename(
                        changer.p(&format!("d/{name}")),
                        changer.p(&format!("d/r{n}")),
                    )
                    .unwrap();
                    e.0 = format!("r{n}");
                }
            }
            _ => {
                if let Some(e) = want.iter_mut().find(|(w, _)| *w == name) {
                    std::fs::set_permissions(
                        changer.p(&format!("d/{name}")),
                        std::fs::Permissions::from_mode(0o600),
                    )
                    .unwrap();
                    e.1 = 0o600;
                }
            }
        }
        want.sort();
        for (who, m) in [("changer", changer), ("other", other)] {
            let seen = list(m.path.clone());
            if seen != want {
                stale.push(format!(
                    "{n}: the {who} lists {} entries, {} expected",
                    seen.len(),
                    want.len()
                ));
            }
        }
    }
    assert!(stale.is_empty(), "{stale:?}");
    drop(a);
    drop(b);
    srv.stop().await;
}

/// A node's own writes and its own stats: a file open on one mount grows by writes whose
/// completions go behind them (batched), and the very next stat by path through the same
/// mount shows every one, also when another mount changed the directory (the stat looks the
/// name up again) or wrote inside the file just before (which recalls the first node's
/// layouts). The node holds the file's attributes under a lease
/// taken before each write (its own changes are never recalled from it), so that lease must
/// not answer while the write's completion is on its way (the exerciser's seed 190 caught
/// it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn own_writes_are_seen_by_the_next_stat_of_the_same_mount() {
    if !can_mount() {
        return;
    }
    let srv = cluster::start(10_000).await;
    let a = Mount::start(&srv, "lease-own-a", "").await;
    let b = Mount::start(&srv, "lease-own-b", "").await;
    let (pa, pb) = (a.p("grow"), b.p("grow"));
    let stale = timed("writes and stats through one mount", 600, move || {
        let f = std::fs::File::create(&pa).unwrap();
        // Space past the end already: the growing writes go into layouts this node holds.
        // SAFETY: a plain syscall on an open descriptor; no memory is passed.
        let r = unsafe {
            libc::fallocate(
                std::os::fd::AsRawFd::as_raw_fd(&f),
                libc::FALLOC_FL_KEEP_SIZE,
                0,
                64 << 20,
            )
        };
        assert_eq!(r, 0, "fallocate: {}", std::io::Error::last_os_error());
        let mut stale = Vec::new();
        let mut end = 0u64;
        for n in 0..200u64 {
            // Under the lease: a stat, then a write that grows the file, then a stat.
            let before = std::fs::metadata(&pa).unwrap().len();
            if before != end {
                stale.push(format!("{n}: before the write, {before} not {end}"));
            }
            // Another node changes the directory (the kernel here looks every name up
            // again) and, every other time, writes inside the file.
            std::fs::write(pb.with_file_name(format!("x{n}")), b"x").unwrap();
            if n % 2 == 1 {
                let g = std::fs::OpenOptions::new().write(true).open(&pb).unwrap();
                g.write_all_at(&[9u8; 4_096], end / 2).unwrap();
            }
            // Long enough to go through (not held back under a delegation).
            let len = (128 << 10) + (n % 3) * 65_536;
            f.write_all_at(&vec![n as u8; len as usize], end).unwrap();
            end += len;
            let seen = if n % 3 == 2 {
                // A listing with attributes (readdirplus) instead of a lookup.
                let dir = pa.parent().unwrap();
                let listed = std::fs::read_dir(dir)
                    .unwrap()
                    .map(|e| e.unwrap())
                    .find(|e| e.file_name() == "grow")
                    .unwrap();
                listed.metadata().unwrap().len()
            } else {
                std::fs::metadata(&pa).unwrap().len()
            };
            if seen != end {
                stale.push(format!("{n}: wrote to {end}, the next stat saw {seen}"));
            }
        }
        stale
    })
    .await;
    assert!(
        stale.is_empty(),
        "{} stale stats: {:?}",
        stale.len(),
        &stale[..stale.len().min(10)]
    );
    drop(a);
    drop(b);
    srv.stop().await;
}

fn cpath(p: &std::path::Path) -> std::ffi::CString {
    std::ffi::CString::new(std::os::unix::ffi::OsStrExt::as_bytes(p.as_os_str())).unwrap()
}

/// getxattr(2): the value, or the errno.
fn get(p: &std::path::Path, name: &str) -> Result<Vec<u8>, i32> {
    let (path, name) = (cpath(p), std::ffi::CString::new(name).unwrap());
    let mut buf = vec![0u8; 4096];
    // SAFETY: both strings are NUL-terminated and outlive the call; the buffer is writable
    // for its length.
    let n = unsafe {
        libc::getxattr(
            path.as_ptr(),
            name.as_ptr(),
            buf.as_mut_ptr().cast(),
            buf.len(),
        )
    };
    if n < 0 {
        return Err(std::io::Error::last_os_error().raw_os_error().unwrap_or(0));
    }
    buf.truncate(n as usize);
    Ok(buf)
}

fn xset(p: &std::path::Path, name: &str, value: &[u8]) {
    let (path, name) = (cpath(p), std::ffi::CString::new(name).unwrap());
    // SAFETY: both strings are NUL-terminated and outlive the call; the value is readable
    // for its length.
    let r = unsafe {
        libc::setxattr(
            path.as_ptr(),
            name.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            0,
        )
    };
    assert_eq!(r, 0, "setxattr: {}", std::io::Error::last_os_error());
}

fn xremove(p: &std::path::Path, name: &str) {
    let (path, name) = (cpath(p), std::ffi::CString::new(name).unwrap());
    // SAFETY: both strings are NUL-terminated and outlive the call.
    let r = unsafe { libc::removexattr(path.as_ptr(), name.as_ptr()) };
    assert_eq!(r, 0, "removexattr: {}", std::io::Error::last_os_error());
}

/// Extended attributes under the attribute lease: `ls -l` asks every file for an ACL, which
/// the agent answers from its cache while it holds the file's attributes (here: a name that
/// is not there, asked twice, the second time without the server); and a `setxattr` or
/// `removexattr` through either mount is seen by the very next `getxattr` through both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn extended_attributes_are_cached_under_the_lease_and_exact_across_mounts() {
    if !can_mount() {
        return;
    }
    let srv = cluster::start(10_000).await;
    let a = Mount::start(&srv, "xattr-a", "").await;
    let b = Mount::start(&srv, "xattr-b", "").await;
    let (pa, pb) = (a.p("f"), b.p("f"));
    std::fs::write(&pa, b"x").unwrap();
    // The node that made the file knows it has none, without asking (what the kernel asks
    // at every chown and `ls -l` of a new file), even after writing and changing it.
    std::fs::write(&pa, b"xy").unwrap();
    std::fs::set_permissions(&pa, std::fs::Permissions::from_mode(0o640)).unwrap();
    let made = agent_status(&a.path);
    assert_eq!(get(&pa, "security.capability"), Err(libc::ENODATA));
    assert_eq!(get(&pa, "user.none"), Err(libc::ENODATA));
    let made_after = agent_status(&a.path);
    assert_eq!(
        counter(&made_after, "xattr_misses"),
        counter(&made, "xattr_misses"),
        "the maker asked the server: {made} then {made_after}"
    );
    // Another node learns "none" with the attributes (`Attr.no_xattrs` under the lease): what
    // `ls -l` asks of every entry is answered there without a call, for files and
    // directories it did not make.
    std::fs::create_dir(a.p("sub")).unwrap();
    std::fs::metadata(&pb).unwrap();
    std::fs::metadata(b.p("sub")).unwrap();
    let before = agent_status(&b.path);
    assert_eq!(get(&pb, "user.none"), Err(libc::ENODATA));
    assert_eq!(get(&pb, "user.none"), Err(libc::ENODATA));
    assert_eq!(get(&pb, "security.selinux"), Err(libc::ENODATA));
    assert_eq!(get(&b.p("sub"), "security.selinux"), Err(libc::ENODATA));
    let after = agent_status(&b.path);
    assert_eq!(
        counter(&after, "xattr_misses"),
        counter(&before, "xattr_misses"),
        "the other node asked the server: {before} then {after}"
    );
    assert!(counter(&after, "xattr_hits") >= counter(&before, "xattr_hits") + 4);
    let mut stale = Vec::new();
    for n in 0..50u32 {
        let (writer, reader) = if n % 2 == 0 { (&pa, &pb) } else { (&pb, &pa) };
        // Both hold the answer before the change.
        let _ = get(reader, "user.v");
        let _ = get(writer, "user.v");
        let value = format!("v{n}").into_bytes();
        if n % 5 == 4 {
            xremove(writer, "user.v");
            for (who, p) in [("writer", writer), ("reader", reader)] {
                if get(p, "user.v") != Err(libc::ENODATA) {
                    stale.push(format!("{n}: removed, the {who} still sees it"));
                }
            }
        } else {
            xset(writer, "user.v", &value);
            for (who, p) in [("writer", writer), ("reader", reader)] {
                let seen = get(p, "user.v");
                if seen.as_deref() != Ok(value.as_slice()) {
                    stale.push(format!("{n}: set, the {who} sees {seen:?}"));
                }
            }
        }
    }
    assert!(stale.is_empty(), "{stale:?}");
    drop(a);
    drop(b);
    srv.stop().await;
}

/// Opening a directory is answered under its attribute lease (no `Access` round trip), and
/// exactly: a chmod through the other mount decides the very next open by another user.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opening_a_directory_is_checked_under_the_lease_and_exact_across_mounts() {
    if !can_mount() {
        return;
    }
    let srv = cluster::start(10_000).await;
    let a = Mount::start(&srv, "opendir-a", "allow_other").await;
    let b = Mount::start(&srv, "opendir-b", "allow_other").await;
    // uid 1000 must reach the mount points: the temp dirs above them are 0700.
    for m in [&a, &b] {
        std::fs::set_permissions(
            m.path.parent().unwrap(),
            std::fs::Permissions::from_mode(0o755),
        )
        .unwrap();
    }
    let (da, db, mb) = (a.p("d"), b.p("d"), b.path.clone());
    timed("directory opens under leases", 300, move || {
        std::fs::create_dir(&da).unwrap();
        std::fs::write(da.join("f"), b"x").unwrap();
        std::fs::metadata(&db).unwrap();
        let before = agent_status(&mb);
        for _ in 0..20 {
            // An open of the directory alone (no listing, which uses the cache too).
            drop(std::fs::File::open(&db).unwrap());
        }
        let after = agent_status(&mb);
        assert!(
            counter(&after, "access_hits") >= counter(&before, "access_hits") + 20
                && counter(&after, "access_misses") == counter(&before, "access_misses"),
            "each open was answered under the lease: {before} then {after}"
        );
        let mut wrong = Vec::new();
        for n in 0..20u32 {
            let open = n % 2 == 1;
            let mode = if open { 0o755 } else { 0o700 };
            std::fs::set_permissions(&da, std::fs::Permissions::from_mode(mode)).unwrap();
            let (st, out) = as_uid_1000(&["ls", db.to_str().unwrap()]);
            if st.success() != open || (open && out != b"f\n") {
                wrong.push(format!("{n}: mode {mode:o}, uid 1000's ls: {st} {out:?}"));
            }
        }
        assert!(wrong.is_empty(), "{wrong:?}");
    })
    .await;
    drop(a);
    drop(b);
    srv.stop().await;
}

/// A node's own attribute changes and writes keep the attributes they left under the lease
/// that comes with their reply: the next stat through the same mount asks nothing (it was a
/// `GetAttr` each: a `chmod` loop of a directory cost a `Lookup` and a `SetAttr` a call), and
/// stays exact: another node's change is seen at once, and of two changes of this node's
/// racing on one inode the cache never keeps the older.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn own_changes_keep_their_attributes_under_the_lease_and_stay_exact() {
    if !can_mount() {
        return;
    }
    let srv = cluster::start(10_000).await;
    let a = Mount::start(&srv, "lease-kept-a", "").await;
    let b = Mount::start(&srv, "lease-kept-b", "").await;
    let (ra, rb) = (a.path.clone(), b.path.clone());
    let misses = timed("own changes, then stats", 300, move || {
        let (fa, fb, da) = (ra.join("f"), rb.join("f"), ra.join("d"));
        std::fs::create_dir(&da).unwrap();
        std::fs::write(&fa, b"first").unwrap();
        let status = |p: &std::path::Path| counter(&agent_status(p), "attr_misses");
        let mut asked = Vec::new();
        for n in 0..50u32 {
            let mode = 0o600 | (n % 8) << 3;
            // (The first look-up of the name after b's changes below asks the server.)
            std::fs::set_permissions(&fa, std::fs::Permissions::from_mode(mode)).unwrap();
            std::fs::set_permissions(&da, std::fs::Permissions::from_mode(0o700 | mode)).unwrap();
            let before = status(&ra);
            let m = std::fs::metadata(&fa).unwrap();
            let d = std::fs::metadata(&da).unwrap();
            assert_eq!(
                (m.mode() & 0o7777, d.mode() & 0o7777),
                (mode, 0o700 | mode),
                "{n}"
            );
            if status(&ra) != before {
                asked.push(format!("{n}: stat after chmod"));
            }
            // Grown by a write sent at close (a small file's bytes go through the server).
            let len = 5 + u64::from(n) * 100;
            std::fs::write(&fa, vec![b'x'; len as usize]).unwrap();
            let before = status(&ra);
            assert_eq!(std::fs::metadata(&fa).unwrap().len(), len, "{n}");
            if status(&ra) != before {
                asked.push(format!("{n}: stat after write"));
            }
            // Another node's changes are seen at once here.
            let other = 0o640 | (n % 4);
            std::fs::set_permissions(&fb, std::fs::Permissions::from_mode(other)).unwrap();
            std::fs::OpenOptions::new()
                .append(true)
                .open(&fb)
                .unwrap()
                .write_all_at(b"more", len)
                .unwrap();
            let m = std::fs::metadata(&fa).unwrap();
            assert_eq!(
                (m.mode() & 0o7777, m.len()),
                (other, len + 4),
                "{n}: b's changes"
            );
        }
        asked
    })
    .await;
    assert!(
        misses.is_empty(),
        "a stat after this node's own change asked the server: {misses:?}"
    );

    // Two processes of one node change one file's mode at once: the last word is the
    // server's, here as through the other mount.
    let (ra, rb) = (a.path.clone(), b.path.clone());
    let seed = test_seed("racing-chmods");
    timed("racing chmods", 300, move || {
        let (fa, fb) = (ra.join("f"), rb.join("f"));
        for round in 0..20u64 {
            let workers: Vec<_> = (0..2u64)
                .map(|w| {
                    let fa = fa.clone();
                    std::thread::spawn(move || {
                        let mut x = (seed ^ (round << 8) ^ w) | 1;
                        for _ in 0..20 {
                            let mode = 0o600 | (xorshift(&mut x) % 0o100) as u32;
                            std::fs::set_permissions(&fa, std::fs::Permissions::from_mode(mode))
                                .unwrap();
                        }
                    })
                })
                .collect();
            for w in workers {
                w.join().unwrap();
            }
            let here = std::fs::metadata(&fa).unwrap().mode();
            let there = std::fs::metadata(&fb).unwrap().mode();
            assert_eq!(
                here, there,
                "round {round}: the mode here is not the server's"
            );
        }
    })
    .await;
    drop(a);
    drop(b);
    srv.stop().await;
}

/// Names read through an open directory handle by `readdir(3)` until it returns nothing.
fn read_to_end(dir: *mut libc::DIR) -> Vec<String> {
    let mut names = Vec::new();
    for _ in 0..10_000 {
        // SAFETY: `dir` is an open directory stream of the caller's; errno is not consulted.
        let e = unsafe { libc::readdir(dir) };
        if e.is_null() {
            return names;
        }
        // SAFETY: readdir returned a valid entry whose d_name is NUL-terminated; it is read
        // before the next call on the stream.
        let name = unsafe { std::ffi::CStr::from_ptr((*e).d_name.as_ptr()) };
        names.push(name.to_string_lossy().into_owned());
    }
    panic!("a listing without an end");
}

/// A listing that reached its end through a directory handle stays ended for that handle (the
/// kernel asks once more from the end, at every `getdents` after it, and the agent answers
/// "nothing more" without a `ReadDir`: one round trip less per directory that `ls`, `find`,
/// `grep -r` or `rm -rf` reads); a name another node made since shows after `rewinddir`, as
/// POSIX requires (before it, POSIX leaves it open).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listing_read_to_its_end_stays_ended_until_rewinddir() {
    if !can_mount() {
        return;
    }
    let srv = cluster::start(10_000).await;
    let a = Mount::start(&srv, "listing-end-a", "").await;
    let b = Mount::start(&srv, "listing-end-b", "").await;
    let (da, db) = (a.p("ls"), b.p("ls"));
    timed("listings", 120, move || {
        std::fs::create_dir(&da).unwrap();
        for i in 0..3 {
            std::fs::write(da.join(format!("f{i}")), b"x").unwrap();
        }
        let c = cpath(&da);
        // SAFETY: a NUL-terminated path; the stream is closed below.
        let dir = unsafe { libc::opendir(c.as_ptr()) };
        assert!(!dir.is_null(), "{}", std::io::Error::last_os_error());
        let mut first = read_to_end(dir);
        first.sort();
        assert_eq!(first, [".", "..", "f0", "f1", "f2"]);
        std::fs::write(db.join("late"), b"y").unwrap();
        for _ in 0..3 {
            assert_eq!(read_to_end(dir), Vec::<String>::new(), "past the end");
        }
        // SAFETY: `dir` is open.
        unsafe { libc::rewinddir(dir) };
        let again = read_to_end(dir);
        assert!(
            again.iter().any(|n| n == "late"),
            "after rewinddir: {again:?}"
        );
        assert_eq!(again.len(), 6, "{again:?}");
        // SAFETY: `dir` is open and not used after.
        assert_eq!(unsafe { libc::closedir(dir) }, 0);
        // Another handle lists everything too.
        assert_eq!(std::fs::read_dir(&da).unwrap().count(), 4);
    })
    .await;
    drop(a);
    drop(b);
    srv.stop().await;
}

/// Opens for reading of a file this node holds the attributes of, whose pages the kernel
/// kept, are answered by the agent, and made at the server only when needed: a file held
/// open that way lives on through another node's unlink (the recall of the attribute lease
/// makes the open first), through this node's own unlink and rename over it, and reads
/// past what the kernel's pages hold after each; one closed before anything needed it cost
/// the server nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opens_answered_here_keep_the_file_alive_through_any_unlink() {
    if !can_mount() {
        return;
    }
    let srv = cluster::start(10_000).await;
    let a = Mount::start(&srv, "open-here-a", "").await;
    let b = Mount::start(&srv, "open-here-b", "").await;
    let status = {
        let path = a.path.clone();
        move || {
            let s = agent_status(&path);
            (
                s["agent"]["opens_here"].as_u64().unwrap(),
                s["agent"]["opens_made_later"].as_u64().unwrap(),
            )
        }
    };
    let (ra, rb) = (a.path.clone(), b.path.clone());
    timed("opens answered here, then unlinks", 300, move || {
        std::fs::create_dir(ra.join("d")).unwrap();
        // Larger than a small file (its bytes do not come with an open), and a small one.
        let datas: Vec<Vec<u8>> = (0..4u8)
            .map(|i| {
                let len = if i == 3 {
                    3_000
                } else {
                    300_000 + 4_096 * usize::from(i)
                };
                (0..len).map(|k| (k % 251) as u8 ^ i).collect()
            })
            .collect();
        for (i, data) in datas.iter().enumerate() {
            std::fs::write(ra.join(format!("d/f{i}")), data).unwrap();
            // Read once: the kernel keeps its pages, as of these attributes.
            assert_eq!(&std::fs::read(ra.join(format!("d/f{i}"))).unwrap(), data);
        }
        // A small file written whole here is kept with its bytes: its first open for
        // reading is answered here, its reads too; another node's write is seen after.
        let small: Vec<u8> = (0..5_000u32).map(|k| (k % 241) as u8).collect();
        std::fs::write(ra.join("d/s"), &small).unwrap();
        let (h, l) = status();
        assert_eq!(std::fs::read(ra.join("d/s")).unwrap(), small);
        assert_eq!(
            status(),
            (h + 1, l),
            "the first open of a file written here"
        );
        std::fs::write(rb.join("d/s"), b"from b").unwrap();
        assert_eq!(std::fs::read(ra.join("d/s")).unwrap(), b"from b");
        let (here0, later0) = status();
        // Read from the pages and closed: nothing at the server.
        assert_eq!(&std::fs::read(ra.join("d/f0")).unwrap(), &datas[0]);
        assert_eq!(status(), (here0 + 1, later0), "an open answered here");
        let open = |i: usize| std::fs::File::open(ra.join(format!("d/f{i}"))).unwrap();
        let dropped_and_read = |f: &std::fs::File, data: &[u8], what: &str| {
            // The kernel's pages go: the reads come to the agent, through the handle.
            crate::support::drop_pages(f);
            let mut got = vec![0u8; data.len()];
            f.read_exact_at(&mut got, 0)
                .unwrap_or_else(|e| panic!("{what}: read after the unlink: {e}"));
            assert!(got == data, "{what}: other bytes after the unlink");
        };
        // Another node unlinks it: the recall makes the open first.
        let f1 = open(1);
        assert_eq!(status().0, here0 + 2);
        std::fs::remove_file(rb.join("d/f1")).unwrap();
        dropped_and_read(&f1, &datas[1], "another node's unlink");
        // This node unlinks it, and renames another file over it.
        let f2 = open(2);
        std::fs::remove_file(ra.join("d/f2")).unwrap();
        dropped_and_read(&f2, &datas[2], "this node's unlink");
        let f3 = open(3);
        std::fs::write(ra.join("d/new"), b"over").unwrap();
        std::fs::rename(ra.join("d/new"), ra.join("d/f3")).unwrap();
        dropped_and_read(&f3, &datas[3], "a rename over it");
        let (here, later) = status();
        assert_eq!(
            (here, later),
            (here0 + 4, later0 + 3),
            "answered here, made later"
        );
        drop((f1, f2, f3));
        assert_eq!(std::fs::read(rb.join("d/f3")).unwrap(), b"over");
    })
    .await;
    drop(a);
    drop(b);
    srv.stop().await;
}
