//! Epochs only go forward: an agent refuses a server whose epoch is lower than the highest it
//! has seen (its metadata store was restored from an older copy), unless it was told to
//! accept that (`accept_epoch_regression`, after a deliberate restore).

use std::time::{Duration, Instant};

use sanfs_client_agent::client::Client;
use sanfs_proto::types::{FsError, ROOT_INODE};

use crate::cluster::{self, root};

/// Waits until `c`'s status says the server is refused.
async fn until_refused(c: &Client) -> String {
    let t0 = Instant::now();
    loop {
        if let Some(why) = c.status().epoch_refused {
            return why;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "the agent did not refuse the restored server: {:?}",
            c.status()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_on_an_older_store_is_refused_unless_the_agent_accepts_it() {
    let mut srv = cluster::start(2_000).await;
    // The store after the first run (its boot epoch is 1), kept as a "backup".
    let mut backup = Vec::new();
    srv.restart_with(|p| backup = std::fs::read(p).unwrap())
        .await;
    srv.restart().await;
    let strict = srv.client("strict").await;
    let mut cfg = srv.config("accepting");
    cfg.accept_epoch_regression = true;
    let accepting = Client::connect(cfg).await.unwrap();
    let seen = strict.status().epoch;
    assert_eq!(seen, 3, "three starts, three epochs");
    assert_eq!(strict.status().highest_epoch, 3);
    let (old_accepting, _) = accepting.session();

    // Restore the backup: the next start's epoch is 2, below the 3 both agents have seen.
    let mut newer = Vec::new();
    srv.restart_with(|p| {
        newer = std::fs::read(p).unwrap();
        std::fs::write(p, &backup).unwrap();
    })
    .await;

    let why = until_refused(&strict).await;
    assert!(why.contains("epoch went backwards (2 after 3)"), "{why}");
    let st = strict.status();
    assert!(!st.lease_valid, "no lease from a refused server: {st:?}");
    assert_eq!((st.epoch, st.highest_epoch), (3, 3), "{st:?}");
    // Calls fail with a clear error instead of going on against the older store.
    match strict.getattr(&root(), ROOT_INODE).await {
        Err(FsError::Io(msg)) => assert!(msg.contains("epoch went backwards"), "{msg}"),
        other => panic!("getattr on a refused server: {other:?}"),
    }
    // Still refused later (it keeps asking, and keeps refusing).
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    assert!(strict.status().epoch_refused.is_some());

    // The agent told to accept a regression goes on, in the restored server's epoch.
    let new = accepting
        .wait_for_new_session(old_accepting, Duration::from_secs(20))
        .await
        .unwrap();
    assert_ne!(new, old_accepting);
    let st = accepting.status();
    assert_eq!((st.epoch, st.highest_epoch, st.epoch_refused), (2, 2, None));
    accepting.getattr(&root(), ROOT_INODE).await.unwrap();
    accepting.close().await.unwrap();

    // The server with the newer store back (its epoch goes on from 3): accepted again.
    srv.restart_with(|p| std::fs::write(p, &newer).unwrap())
        .await;
    let t0 = Instant::now();
    // Bounded generously: an `OpenSession` sent while the refused server went away may wait
    // its 10 s timeout, then the channel's reconnection and the 2 s pause between asks; on a
    // loaded run 20 s was seen to run out once.
    while strict.status().epoch != 4 {
        assert!(
            t0.elapsed() < Duration::from_secs(45),
            "the agent did not take the newer server back: {:?}",
            strict.status()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let st = strict.status();
    assert_eq!((st.highest_epoch, st.epoch_refused), (4, None));
    strict.getattr(&root(), ROOT_INODE).await.unwrap();
    strict.close().await.unwrap();
    srv.stop().await;
}
