//! Cluster-wide advisory locks through the client library: two nodes exclude each other,
//! a waiter gets the lock when the holder lets go, a close drops a process's locks, a session
//! that ends takes its locks with it, and after a server restart the holder reclaims its locks
//! before another node can take them.

use std::time::{Duration, Instant};

use sanfs_blockmap::advisory::LockKind;
use sanfs_client_agent::client::LockWait;
use sanfs_proto::model::{FileLock, LockType};
use sanfs_proto::types::FsError;

use crate::cluster::{self, create, open, root};

fn lock(kind: LockKind, start: u64, end: u64, pid: u32) -> FileLock {
    FileLock {
        typ: LockType::Lock(kind),
        start,
        end,
        pid,
    }
}

fn unlock(start: u64, end: u64) -> FileLock {
    FileLock {
        typ: LockType::Unlock,
        start,
        end,
        pid: 0,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn advisory_locks_exclude_across_nodes_and_waiters_get_them_in_turn() {
    let srv = cluster::start(10_000).await;
    let a = srv.client("a").await;
    let b = srv.client("b").await;
    let (ino, ha) = create(&a, "locked").await;
    let hb = open(&b, ino).await;
    let r = root();

    // A write-locks bytes 0..=99 (owner 1, pid 100): B can read-lock elsewhere, not there.
    a.setlk(
        &r,
        &ha,
        ino,
        1,
        lock(LockKind::Write, 0, 99, 100),
        LockWait::No,
    )
    .await
    .unwrap();
    b.setlk(
        &r,
        &hb,
        ino,
        1,
        lock(LockKind::Read, 100, 199, 200),
        LockWait::No,
    )
    .await
    .unwrap();
    let e = b
        .setlk(
            &r,
            &hb,
            ino,
            1,
            lock(LockKind::Read, 50, 60, 200),
            LockWait::No,
        )
        .await
        .unwrap_err();
    assert_eq!(e, FsError::WouldBlock);
    assert_eq!(e.errno(), libc::EAGAIN);
    let c = b
        .getlk(&r, &hb, ino, 1, lock(LockKind::Read, 0, u64::MAX, 200))
        .await
        .unwrap()
        .expect("A's lock conflicts");
    assert_eq!(
        (c.typ, c.start, c.end, c.pid),
        (LockType::Lock(LockKind::Write), 0, 99, 100)
    );
    // A's own view: no conflict with itself; B's read lock conflicts with A writing there.
    assert_eq!(
        a.getlk(&r, &ha, ino, 1, lock(LockKind::Write, 0, 99, 100))
            .await
            .unwrap(),
        None
    );
    assert!(
        a.getlk(&r, &ha, ino, 1, lock(LockKind::Write, 150, 150, 100))
            .await
            .unwrap()
            .is_some()
    );

    // B waits (F_SETLKW); A unlocks part of its range, which is not enough, then closes
    // (drops owner 1's locks): B gets the lock.
    let waiter = {
        let b = std::sync::Arc::new(b);
        let b2 = b.clone();
        let hb2 = hb;
        (
            b,
            tokio::spawn(async move {
                let t = Instant::now();
                b2.setlk(
                    &root(),
                    &hb2,
                    ino,
                    1,
                    lock(LockKind::Write, 0, 99, 200),
                    LockWait::Until(&|| false),
                )
                .await
                .map(|()| t.elapsed())
            }),
        )
    };
    let (b, task) = waiter;
    tokio::time::sleep(Duration::from_millis(300)).await;
    a.setlk(&r, &ha, ino, 1, unlock(0, 49), LockWait::No)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(!task.is_finished(), "B still waits: A holds 50..=99");
    a.release_lock_owner(&r, &ha, ino, 1).await.unwrap();
    let waited = tokio::time::timeout(Duration::from_secs(10), task)
        .await
        .expect("B's wait ends once A let go")
        .unwrap()
        .unwrap();
    eprintln!("B waited {waited:?} for the lock");
    assert!(waited >= Duration::from_millis(1500));
    assert_eq!(
        b.locks_held(),
        2,
        "B: a read lock on 100..=199 and a write lock on 0..=99"
    );

    // A waiting process that gets a signal: EINTR, and it holds nothing.
    let e = a
        .setlk(
            &r,
            &ha,
            ino,
            7,
            lock(LockKind::Read, 0, 0, 100),
            LockWait::Until(&|| true),
        )
        .await
        .unwrap_err();
    assert_eq!(e, FsError::Interrupted);

    // B's session ends: its locks go with it, and A locks the whole file at once.
    let b = std::sync::Arc::into_inner(b).expect("the waiter is done");
    b.close().await.unwrap();
    a.setlk(
        &r,
        &ha,
        ino,
        2,
        lock(LockKind::Write, 0, u64::MAX, 100),
        LockWait::No,
    )
    .await
    .unwrap();
    a.close().await.unwrap();
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_server_restart_the_holder_reclaims_its_locks_first() {
    // The server's lock grace is a lease plus 1 s: the holder must notice the restart, open a
    // new session, replay and reclaim within it, which a 1 s lease left too tight on a loaded
    // 2-core machine.
    let mut srv = cluster::start(3_000).await;
    let a = srv.client("a").await;
    let b = srv.client("b").await;
    let (ino, ha) = create(&a, "reclaimed").await;
    let r = root();
    // The create durable first: this test is about the locks' reclaim, not the create's
    // replay (which, under a loaded run, could miss the reclaim window and fail the test
    // for another reason).
    a.fsync(&r, &ha, ino, false).await.unwrap();
    a.setlk(
        &r,
        &ha,
        ino,
        1,
        lock(LockKind::Write, 0, 4095, 100),
        LockWait::No,
    )
    .await
    .unwrap();
    let (old_b, _) = b.session();
    let (old_a, _) = a.session();
    srv.restart().await;

    // B (new session after the restart) asks at once: it waits for the grace period, then
    // finds A's reclaimed lock.
    b.wait_for_new_session(old_b, Duration::from_secs(10))
        .await
        .unwrap();
    let hb = open(&b, ino).await;
    let t = Instant::now();
    let e = b
        .setlk(
            &r,
            &hb,
            ino,
            1,
            lock(LockKind::Write, 0, 0, 200),
            LockWait::No,
        )
        .await
        .unwrap_err();
    eprintln!(
        "B's F_SETLK answered after {:?} (grace period)",
        t.elapsed()
    );
    assert_eq!(e, FsError::WouldBlock);
    a.wait_for_new_session(old_a, Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(a.locks_held(), 1);
    assert_eq!(a.stats().locks_lost, 0);
    // A still holds it: B gets it only once A's session ends.
    a.close().await.unwrap();
    b.setlk(
        &r,
        &hb,
        ino,
        1,
        lock(LockKind::Write, 0, 0, 200),
        LockWait::Until(&|| false),
    )
    .await
    .unwrap();
    b.close().await.unwrap();
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_server_grants_locks_at_once_and_bad_locks_are_refused() {
    let srv = cluster::start(10_000).await;
    let a = srv.client("a").await;
    let (ino, ha) = create(&a, "fresh").await;
    let r = root();
    let t = Instant::now();
    a.setlk(&r, &ha, ino, 1, lock(LockKind::Read, 0, 0, 1), LockWait::No)
        .await
        .unwrap();
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "no grace period on a fresh file system"
    );
    // Inverted range and owner 0 are refused before anything changes.
    assert!(matches!(
        a.setlk(&r, &ha, ino, 1, lock(LockKind::Read, 9, 8, 1), LockWait::No)
            .await,
        Err(FsError::Invalid(_))
    ));
    assert!(matches!(
        a.setlk(&r, &ha, ino, 0, lock(LockKind::Read, 0, 8, 1), LockWait::No)
            .await,
        Err(FsError::Invalid(_))
    ));
    assert_eq!(a.locks_held(), 1);
    a.close().await.unwrap();
    srv.stop().await;
}
