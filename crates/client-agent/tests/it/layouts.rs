//! Write layouts (docs/protocol.md "Write layouts"): a sequential writer's direct writes
//! inside one cached exclusive grant need no MapWrite and return once their device I/O is done
//! (the completion goes on behind them); another node that reads, writes, truncates or stats
//! there recalls the layout first and sees every written byte and the size; a layout never outlives the file's last handle; an unused layout's blocks past end
//! of file are freed when it goes back.

use std::time::Duration;

use sanfs_client_agent::client::Client;

use crate::cluster::{self, MIB, Model, Rng, assert_bytes, create, create_for_writing, open, root};

const KIB: u64 = 1024;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sequential_writes_share_one_layout_and_other_nodes_see_every_byte() {
    let srv = cluster::start(10_000).await;
    let a = srv.client("a").await;
    let b = srv.client("b").await;
    let (ino, ha) = create(&a, "seq").await;
    let hb = open(&b, ino).await;
    let mut rng = Rng::new(21);
    let mut model = Model::default();

    // 64 sequential 64 KiB writes = 4 MiB: inside the first 8 MiB layout.
    let before = a.stats();
    for i in 0..64u64 {
        let data = rng.bytes(64 * KIB as usize);
        a.write_at(&root(), &ha, ino, i * 64 * KIB, &data)
            .await
            .unwrap();
        model.write(i * 64 * KIB, &data);
    }
    let s = a.stats();
    assert_eq!(s.map_writes - before.map_writes, 1, "one layout: {s:?}");
    assert_eq!(s.layout_writes - before.layout_writes, 63, "{s:?}");
    assert_eq!(s.proxied_writes, before.proxied_writes, "all direct: {s:?}");
    // Sizes are exact at once on another node: its GetAttr recalls A's layout, which A
    // answers once its writes' completions (sent behind the writes) are in.
    let recalls = a.stats().recalls;
    assert_eq!(b.getattr(&root(), ino).await.unwrap().size, 4 * MIB);
    assert!(
        a.stats().recalls > recalls,
        "A's layout was recalled by a stat"
    );

    // A writes on (a new layout); B reads in the middle of it: recalled, B sees every byte.
    for i in 64..72u64 {
        let data = rng.bytes(64 * KIB as usize);
        a.write_at(&root(), &ha, ino, i * 64 * KIB, &data)
            .await
            .unwrap();
        model.write(i * 64 * KIB, &data);
    }
    let recalls = a.stats().recalls;
    let got = tokio::time::timeout(
        Duration::from_secs(5),
        b.read_at(&root(), &hb, ino, 0, 5 * MIB),
    )
    .await
    .expect("a read recalls the writer's layout, it does not wait for the lease")
    .unwrap();
    assert_bytes(&got, &model.0, "B reads A's layout writes");
    assert!(a.stats().recalls > recalls, "A's layout was recalled");

    // A goes on writing (a new layout), B writes inside it (recalled again), both read alike.
    for i in 72..96u64 {
        let data = rng.bytes(64 * KIB as usize);
        a.write_at(&root(), &ha, ino, i * 64 * KIB, &data)
            .await
            .unwrap();
        model.write(i * 64 * KIB, &data);
    }
    let data = rng.bytes(128 * KIB as usize);
    tokio::time::timeout(
        Duration::from_secs(5),
        b.write_at(&root(), &hb, ino, 5 * MIB, &data),
    )
    .await
    .expect("a write recalls the other node's layout")
    .unwrap();
    model.write(5 * MIB, &data);
    // And a small unaligned (proxied) write by A right after: its own layout goes first.
    let data = rng.bytes(1000);
    a.write_at(&root(), &ha, ino, 5 * MIB + 100, &data)
        .await
        .unwrap();
    model.write(5 * MIB + 100, &data);
    for (c, h, who) in [(&a, &ha, "a"), (&b, &hb, "b")] {
        let got = c.read_at(&root(), h, ino, 0, 8 * MIB).await.unwrap();
        assert_bytes(&got, &model.0, &format!("{who} reads after mixed writes"));
    }

    // Truncate by B while A holds a layout: recalled, the size is B's.
    a.write_at(&root(), &ha, ino, 6 * MIB, &rng.bytes(64 * KIB as usize))
        .await
        .unwrap();
    let data = rng.bytes(64 * KIB as usize);
    a.write_at(&root(), &ha, ino, 6 * MIB + 64 * KIB, &data)
        .await
        .unwrap();
    b.truncate(&root(), Some(&hb), ino, 3 * MIB + 5)
        .await
        .unwrap();
    model.truncate(3 * MIB + 5);
    for (c, h, who) in [(&a, &ha, "a"), (&b, &hb, "b")] {
        assert_eq!(c.getattr(&root(), ino).await.unwrap().size, 3 * MIB + 5);
        let got = c.read_at(&root(), h, ino, 0, 8 * MIB).await.unwrap();
        assert_bytes(&got, &model.0, &format!("{who} reads after truncate"));
    }
    a.close().await.unwrap();
    b.close().await.unwrap();
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_layout_goes_back_with_the_last_handle_and_its_blocks_past_eof_are_freed() {
    let srv = cluster::start(10_000).await;
    let a = srv.client("a").await;
    let (ino, h) = create(&a, "close").await;
    let mut rng = Rng::new(5);
    let data = rng.bytes(128 * KIB as usize);
    a.write_at(&root(), &h, ino, 0, &data).await.unwrap();
    // The layout reaches 8 MiB ahead; closing the file's last handle gives it back.
    a.release(&h).await.unwrap();
    let after_close = free(&a, ino).await;
    // Reopen and write on: a new grant (the old layout is gone here and at the server).
    let h2 = open(&a, ino).await;
    let maps = a.stats().map_writes;
    let data2 = rng.bytes(128 * KIB as usize);
    a.write_at(&root(), &h2, ino, 128 * KIB, &data2)
        .await
        .unwrap();
    assert_eq!(a.stats().map_writes, maps + 1, "a fresh grant after reopen");
    let got = a.read_at(&root(), &h2, ino, 0, MIB).await.unwrap();
    assert_bytes(&got, &[data, data2].concat(), "reopened file");
    a.release(&h2).await.unwrap();
    // Nothing past EOF is kept allocated once the file is closed: a 256 KiB file holds at
    // most its own blocks (and the server's speculative preallocation is trimmed at close).
    let attr = a.getattr(&root(), ino).await.unwrap();
    assert_eq!(attr.size, 256 * KIB);
    assert!(
        attr.allocated <= 256 * KIB,
        "blocks past EOF were freed: {} bytes allocated",
        attr.allocated
    );
    let bs = u64::from(a.statfs(&root(), ino).await.unwrap().block_size);
    assert!(
        free(&a, ino).await + 128 * KIB / bs >= after_close,
        "no space leaked"
    );
    a.close().await.unwrap();
    srv.stop().await;
}

/// Issue 20: write-behind completions of one layout are batched. While a completion of the
/// layout is held (the `pause_completions` hook: one in flight), the writes after it queue,
/// and once it is answered one `Complete` completes all of them (contiguous: one range).
/// (The first batch may take more than the first write: its sender waits a moment for more.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_queued_behind_one_in_flight_go_in_one_round_trip() {
    let srv = cluster::start(10_000).await;
    let a = srv.client("a").await;
    let b = srv.client("b").await;
    let (ino, ha) = create(&a, "batched").await;
    let mut rng = Rng::new(20);
    let mut model = Model::default();
    let before = a.stats();
    a.pause_completions(true);
    for i in 0..16u64 {
        let data = rng.bytes(64 * KIB as usize);
        a.write_at(&root(), &ha, ino, i * 64 * KIB, &data)
            .await
            .expect("a write inside a layout returns before its completion");
        model.write(i * 64 * KIB, &data);
    }
    let s = a.stats();
    assert_eq!(s.map_writes - before.map_writes, 1, "one layout: {s:?}");
    assert_eq!(s.completions, before.completions, "all held: {s:?}");
    a.pause_completions(false);
    a.fsync(&root(), &ha, ino, false).await.unwrap();
    let s = a.stats();
    assert!(
        (1..=2).contains(&(s.completions - before.completions)),
        "the first batch (the first write and those that joined it), then one for all \
         queued behind it: {s:?}"
    );
    // Every byte and the size, on another node.
    let hb = open(&b, ino).await;
    assert_eq!(b.getattr(&root(), ino).await.unwrap().size, MIB);
    let got = b.read_at(&root(), &hb, ino, 0, 2 * MIB).await.unwrap();
    assert_bytes(&got, &model.0, "B reads the batched writes");
    a.close().await.unwrap();
    b.close().await.unwrap();
    srv.stop().await;
}

/// Issue 20: a batch of write-behind completions lost with its session (the server
/// restarted while they were held) becomes records, every part of it, which the agent
/// replays to the restarted server: fsync succeeds and every byte is there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_lost_in_a_server_restart_is_replayed_whole() {
    let mut srv = cluster::start(2_000).await;
    let a = srv.client("a").await;
    let (ino, ha) = create(&a, "batch-replay").await;
    a.fsync(&root(), &ha, ino, false).await.unwrap();
    a.release(&ha).await.unwrap();
    let rw = sanfs_proto::model::OpenFlags {
        read: true,
        write: true,
        append: false,
        truncate: false,
    };
    let f = a.open_file(&root(), ino, rw).await.unwrap();
    let mut rng = Rng::new(25);
    let mut model = Model::default();
    let before = a.stats();
    a.pause_completions(true);
    for i in 0..8u64 {
        let data = rng.bytes(64 * KIB as usize);
        f.write_at(&a, &root(), i * 64 * KIB, &data).await.unwrap();
        model.write(i * 64 * KIB, &data);
    }
    let (old, _) = a.session();
    srv.restart().await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    // The held completions meet the restarted server: refused as stale, kept as records.
    a.pause_completions(false);
    a.wait_for_new_session(old, Duration::from_secs(15))
        .await
        .unwrap();
    let s = a.stats();
    assert!(
        (1..=2).contains(&(s.completions - before.completions)),
        "the first batch and one for all queued behind it: {s:?}"
    );
    f.fsync(&a, &root(), false)
        .await
        .expect("the replayed writes are durable: fsync succeeds");
    assert_eq!(a.getattr(&root(), ino).await.unwrap().size, 512 * KIB);
    let got = f.read_at(&a, &root(), 0, MIB).await.unwrap();
    assert_bytes(&got, &model.0, "every part of the lost batch was replayed");
    f.release(&a).await.unwrap();
    a.close().await.unwrap();
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_seeded_interleaving_of_sequential_writers_and_readers_matches_a_model() {
    let seed = std::env::var("SANFS_LAYOUT_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand_seed);
    println!("write layout interleaving seed {seed} (SANFS_LAYOUT_SEED={seed} to repeat)");
    let srv = cluster::start(10_000).await;
    let a = srv.client("a").await;
    let b = srv.client("b").await;
    let (ino, ha) = create(&a, "mix").await;
    let hb = open(&b, ino).await;
    let mut rng = Rng::new(seed);
    let mut model = Model::default();
    let mut next = [0u64; 2];
    for step in 0..300 {
        let who = rng.below(2) as usize;
        let (c, h) = if who == 0 { (&a, &ha) } else { (&b, &hb) };
        match rng.below(10) {
            // Mostly sequential writes of 64 KiB to 1 MiB from each node's own cursor.
            0..=5 => {
                let len = (1 + rng.below(16)) * 64 * KIB;
                let at = next[who];
                let data = rng.bytes(len as usize);
                c.write_at(&root(), h, ino, at, &data).await.unwrap();
                model.write(at, &data);
                next[who] = if at + len > 16 * MIB {
                    rng.below(64) * 64 * KIB
                } else {
                    at + len
                };
            }
            // An unaligned small write somewhere.
            6 => {
                let at = rng.below(12 * MIB);
                let n = 1 + rng.below(9000) as usize;
                let data = rng.bytes(n);
                c.write_at(&root(), h, ino, at, &data).await.unwrap();
                model.write(at, &data);
            }
            7 => {
                let size = rng.below(14 * MIB);
                c.truncate(&root(), Some(h), ino, size).await.unwrap();
                model.truncate(size);
            }
            _ => {
                let at = rng.below(12 * MIB);
                let len = 1 + rng.below(3 * MIB);
                let got = c.read_at(&root(), h, ino, at, len).await.unwrap();
                assert_bytes(
                    &got,
                    model.read(at, len),
                    &format!("seed {seed} step {step} read"),
                );
                assert_eq!(
                    c.getattr(&root(), ino).await.unwrap().size,
                    model.0.len() as u64,
                    "seed {seed} step {step} size"
                );
            }
        }
    }
    let len = model.0.len() as u64;
    for (c, h) in [(&a, &ha), (&b, &hb)] {
        let got = c.read_at(&root(), h, ino, 0, len + MIB).await.unwrap();
        assert_bytes(&got, &model.0, &format!("seed {seed} final"));
    }
    a.close().await.unwrap();
    b.close().await.unwrap();
    srv.stop().await;
}

/// Issue 18: the write-back of many small scattered blocks (random 4 KiB writes held back
/// under the file's delegation) takes one write layout over them, writes each block
/// directly inside it and completes them in a few calls of many parts (one proxied write
/// per block before); another node then reads every byte and the size.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_back_of_scattered_blocks_goes_direct_under_one_layout() {
    let seed = std::env::var("SANFS_LAYOUT_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand_seed);
    println!("scattered write-back seed {seed} (SANFS_LAYOUT_SEED={seed} to repeat)");
    let srv = cluster::start(10_000).await;
    let a = srv.client("a").await;
    let b = srv.client("b").await;
    let (ino, ha) = create(&a, "scattered").await;
    let mut rng = Rng::new(seed);
    let mut model = Model::default();
    // The file laid out and durable first; its layout goes with its last handle.
    let base = rng.bytes((4 * MIB) as usize);
    a.write_at(&root(), &ha, ino, 0, &base).await.unwrap();
    model.write(0, &base);
    a.fsync(&root(), &ha, ino, false).await.unwrap();
    a.release(&ha).await.unwrap();
    let f = std::sync::Arc::new(a.open_file(&root(), ino, cluster::rw()).await.unwrap());
    let before = a.stats();
    let mut held = 0;
    // Half the file's blocks: gaps wider than a layout spans (64 KiB) are all but absent.
    for _ in 0..512 {
        let at = rng.below(4 * MIB / 4096) * 4096;
        let data = rng.bytes(4096);
        match a.write_back(&root(), &f, at, &data).await.unwrap() {
            Some(_) => held += 1,
            None => {
                f.write_at(&a, &root(), at, &data).await.unwrap();
            }
        }
        model.write(at, &data);
    }
    assert!(held >= 500, "small writes are held back: {held} of 512");
    f.fsync(&a, &root(), false).await.unwrap();
    let s = a.stats();
    assert_eq!(
        s.proxied_writes, before.proxied_writes,
        "no block went through the server: {s:?}"
    );
    assert!(
        s.map_writes - before.map_writes <= 2,
        "one layout for the write-back: {s:?}"
    );
    assert!(
        s.completions - before.completions <= 16,
        "completions of many parts each: {s:?}"
    );
    // Every byte and the size, on another node.
    let hb = open(&b, ino).await;
    assert_eq!(b.getattr(&root(), ino).await.unwrap().size, 4 * MIB);
    let got = b.read_at(&root(), &hb, ino, 0, 8 * MIB).await.unwrap();
    assert_bytes(&got, &model.0, "B reads the written-back blocks");
    f.release(&a).await.unwrap();
    a.close().await.unwrap();
    b.close().await.unwrap();
    srv.stop().await;
}

/// The worst moment for a write-back under one layout: its scattered blocks are on the
/// LUNs, their one many-part completion is held, and the server restarts. The completion is
/// refused as stale and kept as one record per range, which the agent replays to the new
/// server: fsync succeeds (never a false success: every byte is there afterwards).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scattered_write_back_lost_in_a_server_restart_is_replayed_whole() {
    let mut srv = cluster::start(2_000).await;
    let a = srv.client("a").await;
    let (ino, ha) = create(&a, "scattered-replay").await;
    let mut rng = Rng::new(51);
    let mut model = Model::default();
    a.release(&ha).await.unwrap();
    let f = std::sync::Arc::new(a.open_file(&root(), ino, cluster::rw()).await.unwrap());
    // Every other block of an empty file's first MiB: scattered ranges, one window, on
    // blocks the layout hands out Unwritten (a lost conversion would read as zeros).
    for i in 0..128u64 {
        let data = rng.bytes(4096);
        let held = a.write_back(&root(), &f, i * 8192, &data).await.unwrap();
        assert!(held.is_some(), "held back");
        model.write(i * 8192, &data);
    }
    let before = a.stats();
    a.pause_completions(true);
    let cred = root();
    let flush = f.fsync(&a, &cred, false);
    let restart = async {
        // The blocks go to the LUNs under the layout; their completion waits.
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while a.stats().layout_writes - before.layout_writes < 128 {
            assert!(
                std::time::Instant::now() < deadline,
                "the write-back stalled: {:?}",
                a.stats()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let (old, _) = a.session();
        srv.restart().await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        a.pause_completions(false);
        a.wait_for_new_session(old, Duration::from_secs(15))
            .await
            .unwrap();
    };
    let (flushed, ()) = tokio::join!(flush, restart);
    flushed.expect("the replayed write-back is durable: fsync succeeds");
    let after = a.stats();
    assert!(
        after.sessions > before.sessions && after.direct_write_bytes == before.direct_write_bytes,
        "the completion was lost with the old session (its bytes replayed, not completed): \
         {before:?} then {after:?}"
    );
    f.fsync(&a, &root(), false).await.unwrap();
    let got = f.read_at(&a, &root(), 0, 4 * MIB).await.unwrap();
    assert_bytes(&got, &model.0, "every scattered block was replayed");
    f.release(&a).await.unwrap();
    a.close().await.unwrap();
    srv.stop().await;
}

/// A write-back of a few blocks far apart in a sparse file takes no layout over them: a
/// layout allocates the holes it covers, and the file must not grow on the volume by more
/// than what was written to it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_back_of_sparse_blocks_allocates_only_them() {
    let srv = cluster::start(10_000).await;
    let a = srv.client("a").await;
    let (ino, ha) = create(&a, "sparse").await;
    a.release(&ha).await.unwrap();
    let f = std::sync::Arc::new(a.open_file(&root(), ino, cluster::rw()).await.unwrap());
    let before = a.stats();
    for i in 0..8u64 {
        let held = a
            .write_back(&root(), &f, i * 512 * KIB, &[7u8; 4096])
            .await
            .unwrap();
        assert!(held.is_some(), "held back");
    }
    f.fsync(&a, &root(), false).await.unwrap();
    let s = a.stats();
    assert_eq!(s.map_writes, before.map_writes, "no layout: {s:?}");
    let attr = a.getattr(&root(), ino).await.unwrap();
    assert_eq!(attr.size, 7 * 512 * KIB + 4096);
    assert!(
        attr.allocated <= 8 * 64 * KIB,
        "the holes stay holes: {} bytes allocated",
        attr.allocated
    );
    f.release(&a).await.unwrap();
    a.close().await.unwrap();
    srv.stop().await;
}

/// Issue 18: a rewrite in place (read a chunk, change it, write it back, on to the next:
/// bonnie++'s rewrite) reads the node's own held-back writes from its read cache, which they
/// are put into, instead of writing everything held back before every read; every read
/// sees the bytes written before it, and another node reads the result.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rewrite_in_place_reads_its_held_back_writes_from_the_cache() {
    const CHUNK: u64 = 8 * KIB;
    let srv = cluster::start(10_000).await;
    let a = srv.client("a").await;
    let b = srv.client("b").await;
    let (ino, ha) = create(&a, "rewrite").await;
    let mut rng = Rng::new(31);
    let mut model = Model::default();
    let base = rng.bytes(MIB as usize);
    a.write_at(&root(), &ha, ino, 0, &base).await.unwrap();
    model.write(0, &base);
    a.fsync(&root(), &ha, ino, false).await.unwrap();
    a.release(&ha).await.unwrap();
    let f = std::sync::Arc::new(a.open_file(&root(), ino, cluster::rw()).await.unwrap());
    let fh = f.current();
    let before = a.write_back_stats();
    for k in 0..MIB / CHUNK {
        let at = k * CHUNK;
        let mut buf = vec![0u8; CHUNK as usize];
        let n = a
            .read_cached(&root(), &fh, ino, at, &mut buf)
            .await
            .unwrap();
        assert_bytes(
            &buf[..n],
            model.read(at, CHUNK),
            "the chunk before its rewrite",
        );
        buf[0] = buf[0].wrapping_add(1);
        buf[100] ^= 0x5a;
        if a.write_back(&root(), &f, at, &buf).await.unwrap().is_none() {
            f.write_at(&a, &root(), at, &buf).await.unwrap();
        }
        model.write(at, &buf);
        // The rewritten bytes at once, and across the chunk's edge.
        let mut again = vec![0u8; (CHUNK + 512) as usize];
        let from = at + CHUNK / 2;
        let n = a
            .read_cached(&root(), &fh, ino, from, &mut again)
            .await
            .unwrap();
        assert_bytes(
            &again[..n],
            model.read(from, CHUNK + 512),
            "after the rewrite",
        );
    }
    let after = a.write_back_stats();
    assert!(
        after.held_writes - before.held_writes >= 120,
        "the rewrites were held back: {before:?} then {after:?}"
    );
    assert!(
        after.flushes - before.flushes <= 16,
        "write-backs only where reads missed the cache, not before every read: {before:?} \
         then {after:?}"
    );
    f.fsync(&a, &root(), false).await.unwrap();
    let hb = open(&b, ino).await;
    let got = b.read_at(&root(), &hb, ino, 0, 2 * MIB).await.unwrap();
    assert_bytes(&got, &model.0, "B reads the rewritten file");
    f.release(&a).await.unwrap();
    a.close().await.unwrap();
    b.close().await.unwrap();
    srv.stop().await;
}

/// Issue 19 item 3: a file created for writing comes with its write delegation, so its
/// first buffered write is held back at once (no `Delegate` call of its own); an existing
/// file opened by a create gets none; another node's read recalls it and sees the bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_created_for_writing_comes_with_its_write_delegation() {
    use sanfs_proto::types::ROOT_INODE;
    let srv = cluster::start(10_000).await;
    let a = srv.client("a").await;
    let b = srv.client("b").await;
    let before = a.write_back_stats();
    let (ino, f) = create_for_writing(&a, "born").await;
    let made = a.write_back_stats();
    assert_eq!(
        made.delegations,
        before.delegations + 1,
        "the delegation came with the create: {made:?}"
    );
    let held = a.write_back(&root(), &f, 0, b"hello").await.unwrap();
    assert!(held.is_some(), "the first write is held back");
    let wrote = a.write_back_stats();
    assert_eq!(
        wrote.delegations, made.delegations,
        "none asked again: {wrote:?}"
    );
    assert_eq!(wrote.held_writes, made.held_writes + 1);
    // The file exists now: opened by a create, it comes without one.
    let again = a
        .create(&root(), ROOT_INODE, "born", 0o644, false, cluster::rw())
        .await
        .unwrap();
    assert!(!again.created);
    assert_eq!(a.write_back_stats().delegations, wrote.delegations);
    // Another node's read recalls it: the held-back bytes are written first.
    let hb = open(&b, ino).await;
    let got = b.read_at(&root(), &hb, ino, 0, 100).await.unwrap();
    assert_eq!(got, b"hello");
    a.release(&again.handle).await.unwrap();
    f.release(&a).await.unwrap();
    a.close().await.unwrap();
    b.close().await.unwrap();
    srv.stop().await;
}

/// Under a file's attribute lease its size is exact, so a node reads a small file in one
/// proxied round trip (not a grant for the whole request) and answers a read at the end of
/// file without asking; when another node makes the file longer, the lease is recalled
/// first and the next read sees the new bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_of_a_small_file_under_its_lease_stop_at_its_exact_size() {
    let srv = cluster::start(10_000).await;
    let a = srv.client("a").await;
    let b = srv.client("b").await;
    let (ino, ha) = create(&a, "small").await;
    let data = Rng::new(41).bytes(30_000);
    a.write_at(&root(), &ha, ino, 0, &data).await.unwrap();
    a.fsync(&root(), &ha, ino, false).await.unwrap();
    let hb = open(&b, ino).await;
    let (attr, ttl) = b.getattr_leased(&root(), ino).await.unwrap();
    assert_eq!(attr.size, 30_000);
    assert!(ttl.is_some(), "B holds the attribute lease");
    let before = b.stats();
    let got = b.read_at(&root(), &hb, ino, 0, 128 * KIB).await.unwrap();
    assert_bytes(&got, &data, "B reads the small file");
    let after = b.stats();
    assert_eq!(after.map_reads, before.map_reads, "no grant: {after:?}");
    assert_eq!(after.proxied_reads, before.proxied_reads + 1, "{after:?}");
    let tail = b
        .read_at(&root(), &hb, ino, 30_000, 128 * KIB)
        .await
        .unwrap();
    assert!(tail.is_empty());
    assert_eq!(
        b.stats().proxied_reads,
        after.proxied_reads,
        "the end of file, not asked"
    );
    // A makes it longer: B's next read from the old end sees the new bytes.
    let more = Rng::new(42).bytes(5_000);
    a.write_at(&root(), &ha, ino, 30_000, &more).await.unwrap();
    let tail = b
        .read_at(&root(), &hb, ino, 30_000, 128 * KIB)
        .await
        .unwrap();
    assert_bytes(&tail, &more, "B reads A's new bytes past the old end");
    a.release(&ha).await.unwrap();
    b.release(&hb).await.unwrap();
    a.close().await.unwrap();
    b.close().await.unwrap();
    srv.stop().await;
}

/// Issue 18: a long buffered write with partial blocks at its edges writes its whole
/// blocks directly and holds the edges back under the file's write delegation, where they
/// meet their neighbours (the kernel's split of a write from an unaligned buffer: 1 MiB - 16
/// bytes, then 16). No byte goes through the server; another node's read recalls the
/// delegation and sees every byte, the held-back edges included; a write that starts inside
/// a block holds its head back too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_partial_edges_of_long_writes_are_held_back_and_meet_their_neighbours() {
    use sanfs_client_agent::buf::AlignedBuf;
    let srv = cluster::start(10_000).await;
    let a = srv.client("a").await;
    let b = srv.client("b").await;
    let (ino, f) = create_for_writing(&a, "edges").await;
    let mut rng = Rng::new(61);
    let mut model = Model::default();
    let before = a.stats();
    let held_before = a.write_back_stats().held_writes;
    for i in 0..8u64 {
        let data = rng.bytes(MIB as usize);
        let (long, short) = data.split_at((MIB - 16) as usize);
        let mut buf = AlignedBuf::from_slice(long);
        a.write_buffered_buf(&root(), &f, &f.current(), i * MIB, &mut buf)
            .await
            .unwrap();
        assert_eq!(buf.len(), long.len(), "the caller's buffer is whole again");
        let held = a
            .write_back(&root(), &f, i * MIB + MIB - 16, short)
            .await
            .unwrap();
        assert!(held.is_some(), "the short piece is held back");
        model.write(i * MIB, &data);
    }
    let wb = a.write_back_stats();
    assert_eq!(wb.held_writes - held_before, 16, "{wb:?}");
    assert_eq!(
        wb.dirty_bytes,
        8 * 4096,
        "one block per MiB held back: {wb:?}"
    );
    // They go out as whole blocks, directly, inside the writer's layout.
    f.fsync(&a, &root(), false).await.unwrap();
    let s = a.stats();
    assert_eq!(s.proxied_writes, before.proxied_writes, "{s:?}");
    assert!(s.map_writes - before.map_writes <= 2, "{s:?}");
    // A rewrite starting inside a block, in the layout: its head and its tail are held back.
    let data = rng.bytes((MIB + 300) as usize);
    let mut buf = AlignedBuf::from_slice(&data);
    a.write_buffered_buf(&root(), &f, &f.current(), 2 * MIB + 100, &mut buf)
        .await
        .unwrap();
    model.write(2 * MIB + 100, &data);
    let s = a.stats();
    assert_eq!(
        s.proxied_writes, before.proxied_writes,
        "nothing yet: {s:?}"
    );
    let wb = a.write_back_stats();
    assert_eq!(wb.held_writes - held_before, 16 + 1, "{wb:?}");
    assert_eq!(wb.dirty_bytes, (4096 - 100) + 400, "{wb:?}");
    // Away from the layouts (not sequential: a layout of its own middle only; the one asked
    // ahead of the 8 MiB reaches 24 MiB), the edges lie on blocks nothing allocated yet:
    // written through at once, so that running out of space or quota is this write's
    // error, not the close's.
    let data = rng.bytes((MIB + 300) as usize);
    let mut buf = AlignedBuf::from_slice(&data);
    a.write_buffered_buf(&root(), &f, &f.current(), 40 * MIB + 100, &mut buf)
        .await
        .unwrap();
    model.write(40 * MIB + 100, &data);
    let s = a.stats();
    assert_eq!(s.proxied_writes, before.proxied_writes + 2, "{s:?}");
    assert_eq!(a.write_back_stats().held_writes, wb.held_writes);
    // B reads before any fsync: the recall writes the edges first.
    let hb = open(&b, ino).await;
    assert_eq!(b.getattr(&root(), ino).await.unwrap().size, 41 * MIB + 400);
    let got = b.read_at(&root(), &hb, ino, 0, 42 * MIB).await.unwrap();
    assert_bytes(&got, &model.0, "B reads every byte, the edges too");
    // The rewrite's two partial blocks went through the server, nothing else.
    let s = a.stats();
    assert!(s.proxied_writes - before.proxied_writes <= 4, "{s:?}");
    f.release(&a).await.unwrap();
    b.release(&hb).await.unwrap();
    a.close().await.unwrap();
    b.close().await.unwrap();
    srv.stop().await;
}

/// Issue 20: a file read before it is rewritten (a restart file, an in-place edit). The
/// reader's read layouts stay cached; the rewriting writer gives them back itself before it
/// asks for its layouts, so that its layouts are still asked ahead (and grow). Another node
/// then reads every new byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_read_before_it_is_rewritten_keeps_its_write_layouts_asked_ahead() {
    let srv = cluster::start(10_000).await;
    let a = srv.client("a").await;
    let b = srv.client("b").await;
    let (ino, ha) = create(&a, "reread").await;
    let mut rng = Rng::new(23);
    let mut model = Model::default();
    const MIBS: u64 = 32;
    for i in 0..MIBS {
        let data = rng.bytes(MIB as usize);
        a.write_at(&root(), &ha, ino, i * MIB, &data).await.unwrap();
        model.write(i * MIB, &data);
    }
    a.fsync(&root(), &ha, ino, false).await.unwrap();
    for i in 0..MIBS {
        let got = a.read_at(&root(), &ha, ino, i * MIB, MIB).await.unwrap();
        assert_bytes(
            &got,
            &model.0[(i * MIB) as usize..((i + 1) * MIB) as usize],
            "A reads",
        );
    }
    let before = a.stats();
    assert!(
        before.map_reads > 0,
        "the reads asked read layouts: {before:?}"
    );
    for i in 0..MIBS {
        let data = rng.bytes(MIB as usize);
        a.write_at(&root(), &ha, ino, i * MIB, &data).await.unwrap();
        model.write(i * MIB, &data);
    }
    let s = a.stats();
    assert!(
        s.layouts_ahead - before.layouts_ahead >= 2,
        "the rewrite's layouts are asked ahead: {s:?}"
    );
    assert!(s.map_writes - before.map_writes <= 4, "{s:?}");
    let hb = open(&b, ino).await;
    let got = b.read_at(&root(), &hb, ino, 0, MIBS * MIB).await.unwrap();
    assert_bytes(&got, &model.0, "B reads the rewrite");
    a.close().await.unwrap();
    b.close().await.unwrap();
    srv.stop().await;
}

async fn free(c: &Client, ino: sanfs_proto::types::InodeId) -> u64 {
    c.statfs(&root(), ino).await.unwrap().free_blocks
}

fn rand_seed() -> u64 {
    use std::hash::{BuildHasher, RandomState};
    RandomState::new().hash_one(0u8)
}
