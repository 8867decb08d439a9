//! Grants with byte-range locks, recall and session expiry (issue 4's acceptance at the
//! library level; the same through gRPC and real processes lives with the service tests).

use std::sync::Arc;
use std::time::{Duration, Instant};

use sanfs_mds::grants::{GrantError, Grants};
use sanfs_mds::proxy::DataPath;
use sanfs_mds::store::{Backend, Store};
use sanfs_proto::types::{InodeId, SessionEpoch, SessionId};
use tokio::sync::mpsc;

use crate::coherence::{cluster, create, device_read, device_write};

const KIB: u64 = 1024;
const MIB: u64 = 1024 * KIB;

fn grants(dp: DataPath) -> Arc<Grants> {
    Arc::new(Grants::new(Arc::new(dp)))
}

/// Session 2's plain write grant on `ino`'s first 64 KiB, asked for in a task of its own (it
/// waits while another session's grant is in the way).
fn spawn_write(
    g: &Arc<Grants>,
    epoch: u64,
    ino: u64,
) -> tokio::task::JoinHandle<Result<(u64, sanfs_mds::data::Mapped), sanfs_proto::types::FsError>> {
    let g = Arc::clone(g);
    tokio::spawn(async move {
        g.map_write(
            SessionId(2),
            SessionEpoch(epoch),
            InodeId(ino),
            0,
            64 * KIB,
            true,
            false,
        )
        .await
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disjoint_writers_overlap_and_overlapping_writers_serialize() {
    let c = cluster();
    let ino = create(&c.dp, "shared");
    let epoch = c.dp.store.boot_epoch();
    let g = grants(c.dp);
    // Session 1 holds [0, 1M) while session 2 is granted [1M, 2M): both out at once.
    let (a, ma) = g
        .map_write(
            SessionId(1),
            SessionEpoch(epoch),
            InodeId(ino),
            0,
            MIB,
            true,
            false,
        )
        .await
        .unwrap();
    let t0 = Instant::now();
    let (b, mb) = g
        .map_write(
            SessionId(2),
            SessionEpoch(epoch),
            InodeId(ino),
            MIB,
            MIB,
            true,
            false,
        )
        .await
        .unwrap();
    eprintln!("disjoint grant while another is out: {:?}", t0.elapsed());
    assert_eq!(g.live(), 2, "two write grants on one file at the same time");
    device_write(&c.luns, &ma.plan, &vec![1u8; MIB as usize]);
    device_write(&c.luns, &mb.plan, &vec![2u8; MIB as usize]);
    // An overlapping write waits for both.
    let g2 = g.clone();
    let waiter = tokio::spawn(async move {
        let t = Instant::now();
        let r = g2
            .map_write(
                SessionId(3),
                SessionEpoch(epoch),
                InodeId(ino),
                512 * KIB,
                MIB,
                true,
                false,
            )
            .await;
        (r, t.elapsed())
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!waiter.is_finished(), "an overlapping write must wait");
    g.complete(1, epoch, a, MIB, false).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!waiter.is_finished(), "still overlaps grant b");
    let attr = g.complete(2, epoch, b, MIB, false).await.unwrap();
    assert_eq!(attr.size, 2 * MIB);
    let (r, waited) = waiter.await.unwrap();
    let (cid, mc) = r.unwrap();
    assert!(waited >= Duration::from_millis(300), "waited {waited:?}");
    device_write(&c.luns, &mc.plan, &vec![3u8; MIB as usize]);
    g.complete(3, epoch, cid, MIB, false).await.unwrap();
    // Never interleaved inside one write: the middle MiB is all 3s, the edges 1s and 2s.
    let (rid, mr) = g
        .map_read(
            SessionId(9),
            SessionEpoch(epoch),
            InodeId(ino),
            0,
            2 * MIB,
            false,
        )
        .await
        .unwrap();
    let mut buf = vec![0u8; mr.len as usize];
    device_read(&c.luns, &mr.plan, &mut buf);
    g.complete(9, epoch, rid, 0, false).await.unwrap();
    assert!(buf[..512 * KIB as usize].iter().all(|b| *b == 1));
    assert!(
        buf[512 * KIB as usize..1536 * KIB as usize]
            .iter()
            .all(|b| *b == 3)
    );
    assert!(buf[1536 * KIB as usize..].iter().all(|b| *b == 2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_session_loses_its_grants_and_its_range_reads_as_zeros() {
    let c = cluster();
    let ino = create(&c.dp, "f");
    let epoch = c.dp.store.boot_epoch();
    let g = grants(c.dp);
    let dp = g.data_path().clone();
    // Some data first, then a write grant that never completes over part of it and past EOF.
    dp.write(
        ino,
        sanfs_mds::proxy::Position::At(0),
        vec![7u8; 256 * KIB as usize],
        true,
        0,
        None,
    )
    .await
    .unwrap();
    let (id, m) = g
        .map_write(
            SessionId(5),
            SessionEpoch(epoch),
            InodeId(ino),
            256 * KIB,
            512 * KIB,
            false,
            false,
        )
        .await
        .unwrap();
    device_write(&c.luns, &m.plan, &vec![9u8; 512 * KIB as usize]);
    let used_before = dp
        .store
        .usage()
        .free_blocks
        .load(std::sync::atomic::Ordering::Relaxed);
    g.expire_session(5).await;
    assert_eq!(g.live(), 0);
    assert!(dp.locks.held(ino).is_empty(), "locks released");
    // A Complete after expiry is refused.
    assert!(matches!(
        g.complete(5, epoch, id, 512 * KIB, false).await,
        Err(GrantError::Unknown(_))
    ));
    // Past EOF, the abandoned blocks were trimmed.
    let free_after = dp
        .store
        .usage()
        .free_blocks
        .load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(
        free_after - used_before,
        128,
        "512 KiB of 4 KiB blocks freed"
    );
    // The file is still 256 KiB of 7s: the uncompleted write is invisible on both paths.
    let (data, eof) = dp.read(ino, 0, MIB, 0).await.unwrap();
    assert_eq!(data.len(), 256 * KIB as usize);
    assert!(eof && data.iter().all(|b| *b == 7));
    // Extending the file over the abandoned range reads zeros there, not the 9s on the LUN.
    dp.write(
        ino,
        sanfs_mds::proxy::Position::At(MIB - 1),
        vec![1],
        true,
        0,
        None,
    )
    .await
    .unwrap();
    let (data, _) = dp.read(ino, 256 * KIB, 768 * KIB, 0).await.unwrap();
    assert_eq!(data.len(), 768 * KIB as usize);
    assert!(
        data[..data.len() - 1].iter().all(|b| *b == 0),
        "uncompleted range reads as zeros"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cached_read_grant_is_recalled_before_a_conflicting_write() {
    let c = cluster();
    let ino = create(&c.dp, "r");
    let epoch = c.dp.store.boot_epoch();
    let g = grants(c.dp);
    let (tx, mut recalls) = mpsc::unbounded_channel();
    g.attach(1, tx);
    let (rid, _) = g
        .map_read(
            SessionId(1),
            SessionEpoch(epoch),
            InodeId(ino),
            0,
            MIB,
            true,
        )
        .await
        .unwrap();
    let writer = spawn_write(&g, epoch, ino);
    let recall = tokio::time::timeout(Duration::from_secs(5), recalls.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(recall.grant_ids, vec![rid]);
    assert!(
        !writer.is_finished(),
        "the write waits for the recalled grant"
    );
    g.return_grants(1, epoch, &[rid]).await.unwrap();
    let (wid, _) = writer.await.unwrap().unwrap();
    g.complete(2, epoch, wid, 64 * KIB, false).await.unwrap();
    assert!(g.stats.recalls.load(std::sync::atomic::Ordering::Relaxed) >= 1);
}

/// A recall sent while its holder has no session stream (a write delegation reclaimed in
/// the reclaim window, whose agent attaches only after its reclaim is complete; or a stream
/// that broke) is sent again when the stream attaches, for what others still wait on:
/// otherwise the waiter waits for the holder's lease to run out, and a `stat` for the lock
/// timeout, then reads attributes without the holder's held-back writes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recall_sent_before_the_holders_stream_attaches_reaches_it_at_the_attach() {
    let c = cluster();
    let ino = create(&c.dp, "d");
    let epoch = c.dp.store.boot_epoch();
    let g = grants(c.dp);
    let delegation = g.delegate(1, epoch, ino, true).expect("a delegation");
    // Another session's write and a stat both wait for it; session 1 cannot hear them yet.
    let writer = spawn_write(&g, epoch, ino);
    let g3 = g.clone();
    let stat = tokio::spawn(async move { g3.settle_attr(ino, 2).await });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!writer.is_finished() && !stat.is_finished(), "both wait");
    let (tx, mut recalls) = mpsc::unbounded_channel();
    g.attach(1, tx);
    let recall = tokio::time::timeout(Duration::from_secs(5), recalls.recv())
        .await
        .expect("the recall is sent at the attach")
        .unwrap();
    assert_eq!(recall.grant_ids, vec![delegation]);
    assert!(recall.delegation);
    // Once per attach: a stream that replaces a live one gets nothing again.
    let (tx2, mut again) = mpsc::unbounded_channel();
    g.attach(1, tx2);
    assert!(again.try_recv().is_err(), "no recall at a replacing attach");
    g.return_grants(1, epoch, &[delegation]).await.unwrap();
    let (wid, _) = tokio::time::timeout(Duration::from_secs(5), writer)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    tokio::time::timeout(Duration::from_secs(5), stat)
        .await
        .unwrap()
        .unwrap();
    g.complete(2, epoch, wid, 64 * KIB, false).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_ignores_a_recall_loses_the_grant_at_lease_expiry() {
    let c = cluster();
    let ino = create(&c.dp, "r");
    let epoch = c.dp.store.boot_epoch();
    let g = grants(c.dp);
    let (tx, mut recalls) = mpsc::unbounded_channel();
    g.attach(1, tx);
    g.map_read(
        SessionId(1),
        SessionEpoch(epoch),
        InodeId(ino),
        0,
        MIB,
        true,
    )
    .await
    .unwrap();
    let writer = spawn_write(&g, epoch, ino);
    recalls.recv().await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!writer.is_finished());
    // The lease ran out (the session layer calls this when it notices).
    g.expire_session(1).await;
    let (wid, _) = writer.await.unwrap().unwrap();
    g.complete(2, epoch, wid, 64 * KIB, false).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_completions_get_clear_errors_and_change_nothing() {
    let c = cluster();
    let ino = create(&c.dp, "b");
    let epoch = c.dp.store.boot_epoch();
    let g = grants(c.dp);
    let (id, _) = g
        .map_write(
            SessionId(1),
            SessionEpoch(epoch),
            InodeId(ino),
            0,
            64 * KIB,
            true,
            false,
        )
        .await
        .unwrap();
    assert_eq!(
        g.complete(1, epoch, 999_999, 0, false).await,
        Err(GrantError::Unknown(999_999))
    );
    assert_eq!(
        g.complete(2, epoch, id, 0, false).await,
        Err(GrantError::Foreign(id))
    );
    assert!(matches!(
        g.complete(1, epoch + 1, id, 0, false).await,
        Err(GrantError::StaleEpoch { .. })
    ));
    assert!(matches!(
        g.complete(1, epoch, id, 64 * KIB + 1, false).await,
        Err(GrantError::TooMuchDone { .. })
    ));
    assert_eq!(g.live(), 1, "refused completions leave the grant in place");
    let attr = g.complete(1, epoch, id, 64 * KIB, false).await.unwrap();
    assert_eq!(attr.size, 64 * KIB);
    assert_eq!(
        g.complete(1, epoch, id, 64 * KIB, false).await,
        Err(GrantError::Unknown(id)),
        "twice"
    );
    // Unaligned, empty and overflowing ranges.
    assert!(
        g.map_write(
            SessionId(1),
            SessionEpoch(epoch),
            InodeId(ino),
            100,
            4096,
            true,
            false
        )
        .await
        .is_err()
    );
    assert!(
        g.map_write(
            SessionId(1),
            SessionEpoch(epoch),
            InodeId(ino),
            0,
            0,
            true,
            false
        )
        .await
        .is_err()
    );
    assert!(
        g.map_write(
            SessionId(1),
            SessionEpoch(epoch),
            InodeId(ino),
            u64::MAX - 4095,
            4096,
            true,
            false
        )
        .await
        .is_err()
    );
    assert!(
        g.map_read(
            SessionId(1),
            SessionEpoch(epoch),
            InodeId(ino),
            u64::MAX,
            2,
            false
        )
        .await
        .is_err()
    );
    assert_eq!(g.live(), 0);
}

/// Restart with write grants out: the blocks stay allocated to the file, the new start has a
/// new epoch (old grants are unknown), and fsck is clean.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_with_grants_out_keeps_their_blocks_and_forgets_the_grants() {
    let c = cluster();
    let ino = create(&c.dp, "g");
    let epoch = c.dp.store.boot_epoch();
    let meta = c.dir.path().join("meta.redb");
    let g = grants(c.dp);
    let (_id, m) = g
        .map_write(
            SessionId(1),
            SessionEpoch(epoch),
            InodeId(ino),
            0,
            4 * MIB,
            true,
            false,
        )
        .await
        .unwrap();
    assert_eq!(m.plan.device_bytes(), 4 * MIB);
    let store = g.data_path().store.clone();
    store.close();
    drop(g);
    drop(store);
    let rep = sanfs_mds::fsck::check(&Backend::File(meta.clone())).unwrap();
    assert!(rep.is_clean(), "{rep}");
    assert_eq!(
        rep.used_blocks, 2048,
        "the grant's 1024 blocks and the 4 MiB allocated ahead of this sequential writer"
    );
    let store = Store::open(&Backend::File(meta), sanfs_mds::clock::Clock::System, 16).unwrap();
    assert!(store.boot_epoch() > epoch);
    let ext = store
        .read(|t| {
            use sanfs_mds::ns::Reader;
            t.extent_list(InodeId(ino))
        })
        .unwrap();
    assert!(
        ext.iter()
            .all(|e| e.state == sanfs_blockmap::extent::ExtentState::Unwritten)
    );
    // The start trimmed the preallocation past end of file; the grant's blocks stay.
    assert_eq!(ext.iter().map(|e| e.len_blocks).sum::<u64>(), 1024);
}

/// A streaming writer pays one commit for its first grant; the next grants fall inside the
/// blocks allocated ahead and need none. Closing the file trims what lies past its end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streaming_writer_runs_on_preallocation_that_is_trimmed_at_close() {
    let c = cluster();
    let ino = create(&c.dp, "stream");
    let epoch = c.dp.store.boot_epoch();
    let g = grants(c.dp);
    let store = g.data_path().store.clone();
    let commits = || {
        store
            .stats()
            .commits
            .load(std::sync::atomic::Ordering::Relaxed)
    };
    let mut map_commits = 0;
    for i in 0..8 {
        let before = commits();
        let (id, m) = g
            .map_write(
                SessionId(1),
                SessionEpoch(epoch),
                InodeId(ino),
                i * MIB,
                MIB,
                true,
                false,
            )
            .await
            .unwrap();
        map_commits += commits() - before;
        device_write(&c.luns, &m.plan, &vec![i as u8; MIB as usize]);
        g.complete(1, epoch, id, MIB, false).await.unwrap();
    }
    eprintln!("8 sequential 1 MiB grants needed {map_commits} allocation commits");
    // At most two allocations, each a commit and the commit that forgets its blocks'
    // zeroing note once they are zeroed (docs/security.md).
    assert!(
        map_commits <= 4,
        "grants inside the preallocation need no commit: {map_commits}"
    );
    let free = || {
        store
            .usage()
            .free_blocks
            .load(std::sync::atomic::Ordering::Relaxed)
    };
    let before_trim = free();
    g.trim_prealloc(ino).await;
    let trimmed = free() - before_trim;
    assert!(
        trimmed > 0,
        "what was allocated past the end is freed at close"
    );
    let ext = store
        .read(|t| {
            use sanfs_mds::ns::Reader;
            t.extent_list(InodeId(ino))
        })
        .unwrap();
    let mapped: u64 = ext.iter().map(|e| e.len_blocks).sum();
    assert_eq!(
        mapped * 4096,
        8 * MIB,
        "exactly the file's 8 MiB stay allocated"
    );
    assert!(
        ext.iter()
            .all(|e| e.state == sanfs_blockmap::extent::ExtentState::Written)
    );
}

/// A Complete without sync is committed lazily: durable with the next durable commit
/// (fsync); a crash before that loses the conversion whole and the blocks read as zeros.
#[test]
fn a_lazy_completion_is_durable_only_after_a_sync() {
    use sanfs_mds::clock::Clock;
    use sanfs_mds::store::backend::{FaultPlan, SimDisk};
    let rt = tokio::runtime::Runtime::new().unwrap();
    for synced in [false, true] {
        let disk = SimDisk::new(FaultPlan::default());
        let backend = Backend::Sim(disk.clone());
        sanfs_testcluster::mds::create_store(&backend, &crate::support::fs_info(), &Clock::System)
            .unwrap();
        let store = Store::open(&backend, Clock::System, 16).unwrap();
        let vol = store.volume().clone();
        let f = crate::coherence::create_in(&store, "lazy");
        rt.block_on(async {
            let v = vol.clone();
            store
                .write(move |ctx| sanfs_mds::data::map_write(ctx, &v, InodeId(f), 0, 64 * KIB))
                .await
                .unwrap();
            store
                .write_data(false, sanfs_mds::store::Luns::All, move |ctx| {
                    sanfs_mds::data::complete_write(ctx, InodeId(f), 0, 64 * KIB, true)
                })
                .await
                .unwrap();
            if synced {
                store.sync().await.unwrap();
            }
        });
        disk.crash_now();
        drop(store);
        let disk = SimDisk::from_image(disk.durable_image(), FaultPlan::default());
        let store = Store::open(&Backend::Sim(disk), Clock::System, 16).unwrap();
        let attr = store
            .read(|t| {
                use sanfs_mds::ns::Reader;
                t.getattr(4096, InodeId(f))
            })
            .unwrap();
        let ext = store
            .read(|t| {
                use sanfs_mds::ns::Reader;
                t.extent_list(InodeId(f))
            })
            .unwrap();
        let written = ext
            .iter()
            .any(|e| e.state == sanfs_blockmap::extent::ExtentState::Written);
        if synced {
            assert_eq!(attr.size, 64 * KIB, "synced: the write survives");
            assert!(written);
        } else {
            assert_eq!(attr.size, 0, "not synced: the conversion is lost whole");
            assert!(!written, "the blocks stay Unwritten (read as zeros)");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_layout_completes_part_by_part_keeps_its_lock_and_frees_its_tail_when_returned() {
    let c = cluster();
    let ino = create(&c.dp, "layout");
    let epoch = c.dp.store.boot_epoch();
    let g = grants(c.dp);
    let (tx, mut recalls) = mpsc::unbounded_channel();
    g.attach(1, tx);
    let (id, m) = g
        .map_write(
            SessionId(1),
            SessionEpoch(epoch),
            InodeId(ino),
            0,
            4 * MIB,
            true,
            true,
        )
        .await
        .unwrap();
    assert_eq!(m.len, 4 * MIB);
    // Two writes inside it, each completed on its own: size and state follow, grant stays.
    let plan = &m.plan;
    device_write(&c.luns, plan, &vec![7u8; (4 * MIB) as usize]);
    let a = g
        .complete_part(1, epoch, id, 0, 64 * KIB, false)
        .await
        .unwrap();
    assert_eq!(a.size, 64 * KIB);
    let a = g
        .complete_part(1, epoch, id, 64 * KIB, 64 * KIB, false)
        .await
        .unwrap();
    assert_eq!(a.size, 128 * KIB);
    assert_eq!(g.live(), 1, "the layout stays after partial completions");
    // Bad parts: outside the grant, another session, not a layout. Nothing changes.
    assert!(
        g.complete_part(1, epoch, id, 4 * MIB, 4096, false)
            .await
            .is_err()
    );
    assert!(
        g.complete_part(1, epoch, id, 4 * MIB - 4096, 8192, false)
            .await
            .is_err()
    );
    assert_eq!(
        g.complete_part(2, epoch, id, 0, 4096, false).await,
        Err(GrantError::Foreign(id))
    );
    let (plain, _) = g
        .map_write(
            SessionId(1),
            SessionEpoch(epoch),
            InodeId(ino),
            8 * MIB,
            64 * KIB,
            true,
            false,
        )
        .await
        .unwrap();
    assert!(
        g.complete_part(1, epoch, plain, 8 * MIB, 4096, false)
            .await
            .is_err()
    );
    g.complete(1, epoch, plain, 0, false).await.unwrap();
    // Another session's read of the range recalls the layout and waits for its return.
    let g2 = g.clone();
    let reader = tokio::spawn(async move {
        g2.map_read(
            SessionId(2),
            SessionEpoch(epoch),
            InodeId(ino),
            0,
            MIB,
            false,
        )
        .await
    });
    let recall = tokio::time::timeout(Duration::from_secs(5), recalls.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(recall.grant_ids, vec![id]);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!reader.is_finished(), "the reader waits for the layout");
    let before = c_free(&g);
    g.return_grants(1, epoch, &[id]).await.unwrap();
    let (rid, mr) = tokio::time::timeout(Duration::from_secs(5), reader)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    // The reader sees the completed 128 KiB, and the file ends there.
    assert_eq!(mr.file_size, 128 * KIB);
    let mut buf = vec![0u8; mr.len as usize];
    device_read(&c.luns, &mr.plan, &mut buf);
    assert!(buf[..(128 * KIB) as usize].iter().all(|b| *b == 7));
    g.complete(2, epoch, rid, 0, false).await.unwrap();
    // The layout's never-completed blocks past EOF went back to the free space.
    assert!(
        c_free(&g) >= before + (4 * MIB - 128 * KIB) / 4096,
        "freed {} blocks",
        c_free(&g) - before
    );
}

/// The Written blocks of `ino`, as sorted (first file block, block count) runs.
fn written_blocks(store: &Store, ino: u64) -> Vec<(u64, u64)> {
    let ext = store
        .read(|t| {
            use sanfs_mds::ns::Reader;
            t.extent_list(InodeId(ino))
        })
        .unwrap();
    let mut runs: Vec<(u64, u64)> = ext
        .iter()
        .filter(|e| e.state == sanfs_blockmap::extent::ExtentState::Written)
        .map(|e| (e.file_block, e.len_blocks))
        .collect();
    runs.sort_unstable();
    runs
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scattered_parts_of_a_write_layout_complete_in_one_call_or_not_at_all() {
    let c = cluster();
    let ino = create(&c.dp, "scattered");
    let epoch = c.dp.store.boot_epoch();
    let store = Arc::clone(&c.dp.store);
    let g = grants(c.dp);
    let (tx, _recalls) = mpsc::unbounded_channel();
    g.attach(1, tx);
    let (id, m) = g
        .map_write(
            SessionId(1),
            SessionEpoch(epoch),
            InodeId(ino),
            0,
            4 * MIB,
            true,
            true,
        )
        .await
        .unwrap();
    device_write(&c.luns, &m.plan, &vec![9u8; (4 * MIB) as usize]);
    // A part past the layout's end, after two good ones: refused whole, nothing converted.
    let bad = [(MIB, 4096), (2 * MIB, 4096), (4 * MIB - 4096, 8192)];
    assert!(
        g.complete_parts_numbered(1, epoch, id, &bad, false)
            .await
            .is_err()
    );
    assert_eq!(written_blocks(&store, ino), vec![]);
    let attr = store
        .read(|t| {
            use sanfs_mds::ns::Reader;
            t.getattr(4096, InodeId(ino))
        })
        .unwrap();
    assert_eq!(attr.size, 0, "a refused completion changes nothing");
    // Three scattered parts, out of order, in one call: exactly their blocks become Written
    // (the rest stays Unwritten: zeros), and the size is the farthest part's end.
    let parts = [(3 * MIB, 8192), (MIB, 4096), (2 * MIB + 4096, 4096)];
    let (attr, _) = g
        .complete_parts_numbered(1, epoch, id, &parts, false)
        .await
        .unwrap();
    assert_eq!(attr.size, 3 * MIB + 8192);
    let bs = 4096;
    assert_eq!(
        written_blocks(&store, ino),
        vec![(MIB / bs, 1), ((2 * MIB + 4096) / bs, 1), (3 * MIB / bs, 2)]
    );
    assert_eq!(g.live(), 1, "the layout stays");
}

fn c_free(g: &Grants) -> u64 {
    g.data_path()
        .store
        .usage()
        .free_blocks
        .load(std::sync::atomic::Ordering::Relaxed)
}

/// A proxied write allocates lazily but completes durably (every one: O_SYNC asks for no
/// more), after its data is flushed: an acknowledged write survives a crash of the metadata
/// disk right after it, with exactly its two blocks Written.
#[test]
fn an_acknowledged_proxied_write_survives_a_crash() {
    use sanfs_mds::clock::Clock;
    use sanfs_mds::datadev::DataDevices;
    use sanfs_mds::store::backend::{FaultPlan, SimDisk};
    use sanfs_testcluster::mds;
    let rt = tokio::runtime::Runtime::new().unwrap();
    {
        let dir = tempfile::tempdir().unwrap();
        let luns = mds::file_luns(dir.path(), 4, 16 * MIB).unwrap();
        let disk = SimDisk::new(FaultPlan::default());
        let backend = Backend::Sim(disk.clone());
        mds::format(
            &mds::striped(&luns, 4096, 64 * KIB),
            &backend,
            &Clock::System,
        )
        .unwrap();
        let store = Arc::new(Store::open(&backend, Clock::System, 16).unwrap());
        let devices = Arc::new(DataDevices::open(&store.volume(), &luns));
        let dp = DataPath::new(store.clone(), devices, Duration::from_secs(10));
        let ino = crate::coherence::create_in(&store, "proxied");
        rt.block_on(async {
            let (off, attr) = dp
                .write(
                    ino,
                    sanfs_mds::proxy::Position::At(0),
                    vec![5u8; 8 * KIB as usize],
                    true,
                    0,
                    None,
                )
                .await
                .unwrap();
            assert_eq!((off, attr.size), (0, 8 * KIB), "acknowledged");
        });
        // The data path flushed its LUNs before the completion's commit (tests/it/dataflush.rs
        // has the order and what a lost cache would do).
        let flushes = store
            .stats()
            .data_flushes
            .load(std::sync::atomic::Ordering::Relaxed);
        assert_eq!(flushes, 1, "one LUN flush for the write");
        disk.crash_now();
        drop(dp);
        drop(store);
        let disk = SimDisk::from_image(disk.durable_image(), FaultPlan::default());
        let store = Store::open(&Backend::Sim(disk), Clock::System, 16).unwrap();
        let (attr, ext) = store
            .read(|t| {
                use sanfs_mds::ns::Reader;
                Ok((t.getattr(4096, InodeId(ino))?, t.extent_list(InodeId(ino))?))
            })
            .unwrap();
        assert_eq!(attr.size, 8 * KIB, "the write survives");
        let written: u64 = ext
            .iter()
            .filter(|e| e.state == sanfs_blockmap::extent::ExtentState::Written)
            .map(|e| e.len_blocks)
            .sum();
        assert_eq!(written, 2, "the two blocks are Written: {ext:?}");
    }
}

/// Issue 20: a write layout asked ahead of a sequential writer is speculative: where the
/// blocks it would allocate are more than an eighth of the free space it is refused with
/// `NoSpace` and allocates nothing (a real write elsewhere must not fail for the space a
/// guess took); the same layout asked by a write itself is granted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_layout_asked_ahead_never_takes_more_than_an_eighth_of_the_free_space() {
    let c = cluster();
    let ino = InodeId(create(&c.dp, "ahead"));
    let store = c.dp.store.clone();
    let epoch = SessionEpoch(store.boot_epoch());
    let g = grants(c.dp);
    let free = || {
        store
            .usage()
            .free_blocks
            .load(std::sync::atomic::Ordering::Relaxed)
    };
    let before = free();
    // A 256 MiB volume: an eighth of its free space is under 32 MiB, so a 64 MiB ask gets
    // its first part, no longer than that, and allocates no more.
    let (id, m) = g
        .map_layout_ahead(SessionId(1), epoch, ino, (0, 64 * MIB), false)
        .await
        .unwrap();
    let bs = u64::from(store.block_size());
    assert_eq!(m.offset, 0);
    assert!(
        m.len > 0 && m.len <= before / 8 * bs && m.len < 32 * MIB,
        "a guess of 64 MiB on a volume with {before} blocks free got {} bytes",
        m.len
    );
    let taken = before - free();
    assert!(
        taken > 0 && taken <= before / 8,
        "the cut ask took {taken} of {before} free blocks"
    );
    g.return_grants(1, epoch.0, &[id]).await.unwrap();
    let (id, m) = g
        .map_layout_ahead(SessionId(1), epoch, ino, (32 * MIB, 8 * MIB), false)
        .await
        .unwrap();
    assert_eq!(
        (m.offset, m.len),
        (32 * MIB, 8 * MIB),
        "a short guess is granted whole"
    );
    g.return_grants(1, epoch.0, &[id]).await.unwrap();
    let (id, m) = g
        .map_write(SessionId(1), epoch, ino, 40 * MIB, 64 * MIB, false, true)
        .await
        .expect("a layout asked by a write is not speculative");
    assert_eq!(m.len, 64 * MIB, "a layout asked by a write is not cut");
    g.complete(1, epoch.0, id, 64 * MIB, false).await.unwrap();
    // A guess over blocks the file holds already allocates nothing: not cut.
    let eighth = free() / 8 * bs;
    assert!(eighth < 64 * MIB, "{eighth}");
    let (id, m) = g
        .map_layout_ahead(SessionId(1), epoch, ino, (40 * MIB, 64 * MIB), false)
        .await
        .unwrap();
    assert_eq!(m.len, 64 * MIB, "a rewrite asked ahead is cut");
    g.return_grants(1, epoch.0, &[id]).await.unwrap();
    // Across the end of the file's blocks (its 104 MiB and what was preallocated past
    // them): granted, not refused for the whole range's length; it allocates at most an
    // eighth of the free space.
    let held = store
        .read(|t| sanfs_mds::data::allocated_end(t, ino))
        .unwrap()
        * bs;
    let at = held - 8 * MIB;
    let before = free();
    let (id, m) = g
        .map_layout_ahead(SessionId(1), epoch, ino, (at, 64 * MIB), false)
        .await
        .expect("a guess across the end of the file's blocks");
    let taken = before - free();
    assert!(
        m.len > 8 * MIB && taken > 0 && taken <= before / 8,
        "{} bytes granted, {taken} of {before} free blocks taken",
        m.len
    );
    g.return_grants(1, epoch.0, &[id]).await.unwrap();
}
