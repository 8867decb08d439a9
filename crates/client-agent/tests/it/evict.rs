//! Eviction through the client library: node A's direct write reaches the LUNs but its
//! completion hangs (the `pause_completions` hook: a node whose I/O hangs after the devices
//! took it) while its session keeps heartbeating. Node B's stat, read, write and truncate of
//! the range wait for A's grant only until the server evicts A (the hold limit, two lease
//! periods by default, then the rest of A's lease); the range reads as zeros. A drops its
//! state, opens a new session, and its application's write returns EIO, not success and not
//! ESTALE (which an `OpenFile` would retry); new work on A then succeeds.

use std::time::{Duration, Instant};

use sanfs_client_agent::client::Client;
use sanfs_proto::model::{FallocateMode, OpenFlags};
use sanfs_proto::types::FsError;

use crate::cluster::{self, MIB, assert_bytes, create, open, root};

const KIB: u64 = 1024;
const TTL_MS: u64 = 600;
/// The server's default hold limit: two lease periods.
const HOLD_LIMIT_MS: u64 = 2 * TTL_MS;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_whose_completions_hang_is_evicted_and_its_application_sees_eio() {
    let srv = cluster::start(TTL_MS).await;
    // A's direct writes use plain write grants (no write layout), so that the application's
    // write itself waits for its completion.
    let mut config = srv.config("a");
    config.write_layout_bytes = 0;
    let a = Client::connect(config).await.unwrap();
    let b = srv.client("b").await;

    let (ino, ha) = create(&a, "evict").await;
    let first = vec![0x11u8; 256 * KIB as usize];
    a.write_at(&root(), &ha, ino, 0, &first).await.unwrap();
    a.fallocate(&root(), &ha, ino, 0, MIB, FallocateMode::Allocate)
        .await
        .unwrap();
    a.fsync(&root(), &ha, ino, false).await.unwrap();
    a.release(&ha).await.unwrap();
    let flags = OpenFlags {
        read: true,
        write: true,
        append: false,
        truncate: false,
    };
    let file = a.open_file(&root(), ino, flags).await.unwrap();
    let (old_session, _) = a.session();

    // A's write of [256 KiB, 512 KiB) goes to the LUNs; its completion hangs.
    a.pause_completions(true);
    let submits = a.stats().device_submits;
    let a = std::sync::Arc::new(a);
    let writer = {
        let a = a.clone();
        tokio::spawn(async move {
            let data = vec![0xeeu8; 256 * KIB as usize];
            file.write_at(&a, &root(), 256 * KIB, &data).await
        })
    };
    while a.stats().device_submits == submits {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    tokio::time::sleep(Duration::from_millis(50)).await;

    // B's stat and read of the range wait for A's grant until A is evicted.
    let hb = open(&b, ino).await;
    let t0 = Instant::now();
    let attr = b.getattr(&root(), ino).await.expect("B's stat");
    assert_eq!(attr.size, MIB);
    let got = b
        .read_at(&root(), &hb, ino, 0, 512 * KIB)
        .await
        .expect("B's read");
    let waited = t0.elapsed();
    eprintln!(
        "B waited {waited:?} for A's hung grant (hold limit {HOLD_LIMIT_MS} ms, TTL {TTL_MS} ms)"
    );
    assert_bytes(&got[..256 * KIB as usize], &first, "A's completed write");
    assert!(
        got[256 * KIB as usize..].iter().all(|&x| x == 0),
        "A's uncompleted write never appears: the range reads as zeros"
    );
    assert!(
        waited >= Duration::from_millis(HOLD_LIMIT_MS - 100),
        "B waited for the hold limit: {waited:?}"
    );
    assert!(
        waited <= Duration::from_millis(HOLD_LIMIT_MS + TTL_MS + 4000),
        "B's wait is bounded by the hold limit and A's lease: {waited:?}"
    );
    // B's write and truncate of the range succeed.
    let mine = vec![0x44u8; 128 * KIB as usize];
    b.write_at(&root(), &hb, ino, 256 * KIB, &mine)
        .await
        .expect("B's write");
    b.truncate(&root(), Some(&hb), ino, 320 * KIB)
        .await
        .expect("B's truncate");
    let got = b.read_at(&root(), &hb, ino, 0, MIB).await.unwrap();
    assert_eq!(got.len() as u64, 320 * KIB);
    assert_bytes(
        &got[256 * KIB as usize..],
        &mine[..64 * KIB as usize],
        "B's write",
    );

    // A was told, dropped its state and opened a new session.
    let new_session = a
        .wait_for_new_session(old_session, Duration::from_secs(10))
        .await
        .expect("A opens a new session");
    assert_ne!(new_session, old_session);
    assert!(a.stats().fences >= 1, "{:?}", a.stats());
    // Its hung write's completion is refused once it is let go: the application sees EIO.
    a.pause_completions(false);
    let err = tokio::time::timeout(Duration::from_secs(10), writer)
        .await
        .expect("the hung write ends once its completion is let go")
        .unwrap()
        .expect_err("a write whose completion was refused is not a success");
    assert!(matches!(err, FsError::Io(_)), "{err:?}");
    assert_eq!(err.errno(), libc::EIO);
    // Nothing of it reached the file.
    let got = b.read_at(&root(), &hb, ino, 0, MIB).await.unwrap();
    assert_bytes(
        &got[256 * KIB as usize..],
        &mine[..64 * KIB as usize],
        "B's write stays",
    );

    // New work on A succeeds under its new session, and B sees it.
    let (ino2, ha2) = create(&a, "after").await;
    let later = vec![0x55u8; 128 * KIB as usize];
    a.write_at(&root(), &ha2, ino2, 0, &later).await.unwrap();
    let hb2 = open(&b, ino2).await;
    let got = b.read_at(&root(), &hb2, ino2, 0, MIB).await.unwrap();
    assert_bytes(&got, &later, "A's write from its new session");
    srv.stop().await;
}
