//! Replays of lazy completions after a crash, at the store level (`sanfs_mds::reclaim`): a
//! crash-simulating disk keeps only what was durable; the lost completion is replayed when
//! the file still maps the blocks the agent wrote, refused when it does not (freed, or other
//! blocks), and answered DURABLE when it had survived. And the committer
//! makes lazy work durable on its own within its bound.

use std::time::{Duration, Instant};

use sanfs_blockmap::plan::phys_runs;
use sanfs_mds::clock::Clock;
use sanfs_mds::data::{Mapped, complete_write, map_write};
use sanfs_mds::ns::Reader;
use sanfs_mds::reclaim::replay_write;
use sanfs_mds::space::trim_unwritten_past_eof;
use sanfs_mds::store::ReaderInodes;
use sanfs_mds::store::backend::{FaultPlan, SimDisk};
use sanfs_mds::store::{Backend, LAZY_SYNC_AFTER, Store};
use sanfs_proto::model::{ReplayOutcome, ReplayRecord, ReplayRun};
use sanfs_proto::types::{ByteRange, InodeId, SessionEpoch};

const KIB: u64 = 1024;

/// The agent's record of a completion of `[offset, offset + len)` written by `mapped`'s plan.
fn record(ino: u64, epoch: u64, seq: u64, mapped: &Mapped) -> ReplayRecord {
    ReplayRecord {
        inode: InodeId(ino),
        epoch: SessionEpoch(epoch),
        commit_seq: seq,
        range: ByteRange::new(mapped.offset, mapped.len).unwrap(),
        runs: phys_runs(&mapped.plan.device_ios)
            .into_iter()
            .map(|r| ReplayRun {
                file_off: mapped.offset + r.buf_off,
                device: r.device,
                phys_off: r.phys_off,
                len: r.len,
            })
            .collect(),
    }
}

fn size(store: &Store, ino: u64) -> u64 {
    store.read(|t| t.getattr(4096, InodeId(ino))).unwrap().size
}

async fn replay(store: &Store, r: ReplayRecord) -> ReplayOutcome {
    let (volume, survived) = (store.volume().clone(), store.survived());
    store
        .write(move |ctx| replay_write(ctx, &volume, survived, &r))
        .await
        .unwrap()
        .0
}

#[test]
fn a_lost_lazy_completion_is_replayed_only_onto_the_blocks_it_wrote() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let disk = SimDisk::new(FaultPlan::default());
    let backend = Backend::Sim(disk.clone());
    sanfs_testcluster::mds::create_store(&backend, &crate::support::fs_info(), &Clock::System)
        .unwrap();
    let store = Store::open(&backend, Clock::System, 16).unwrap();
    let epoch = store.boot_epoch();
    let vol = store.volume().clone();
    let (f, g) = (
        crate::coherence::create_in(&store, "kept"),
        crate::coherence::create_in(&store, "moved"),
    );
    let (mf, mg, seq_f, seq_g, durable) = rt.block_on(async {
        let v = vol.clone();
        let mf = store
            .write(move |ctx| map_write(ctx, &v, InodeId(f), 0, 128 * KIB))
            .await
            .unwrap();
        let v = vol.clone();
        let mg = store
            .write(move |ctx| map_write(ctx, &v, InodeId(g), 0, 64 * KIB))
            .await
            .unwrap();
        let durable = store.durable_seq();
        let (_, seq_f) = store
            .write_lazy_numbered(move |ctx| complete_write(ctx, InodeId(f), 0, 128 * KIB, false))
            .await
            .unwrap();
        let (_, seq_g) = store
            .write_lazy_numbered(move |ctx| complete_write(ctx, InodeId(g), 0, 64 * KIB, false))
            .await
            .unwrap();
        (mf, mg, seq_f, seq_g, durable)
    });
    assert!(
        seq_f > durable && seq_g > seq_f,
        "lazy commits are numbered after the durable ones"
    );
    assert_eq!(size(&store, f), 128 * KIB);
    disk.crash_now();
    drop(store);

    let disk = SimDisk::from_image(disk.durable_image(), FaultPlan::default());
    let store = Store::open_deferring_recovery(&Backend::Sim(disk), Clock::System, 16).unwrap();
    assert_eq!(
        store.survived(),
        (epoch, durable),
        "the last durable commit survived"
    );
    assert_eq!(
        size(&store, f),
        0,
        "the lazy completion was lost with the server"
    );
    rt.block_on(async {
        // A record that had survived is answered DURABLE and changes nothing.
        let old = record(f, epoch, durable, &mf);
        assert_eq!(replay(&store, old).await, ReplayOutcome::Durable);
        assert_eq!(size(&store, f), 0);
        // Other LUN bytes than the file maps there: refused.
        let mut wrong = record(f, epoch, seq_f, &mf);
        wrong.runs[0].phys_off += 4096;
        assert_eq!(replay(&store, wrong).await, ReplayOutcome::Refused);
        // A record of an epoch that is not the last run's is checked, not trusted.
        let mut other_epoch = record(f, epoch + 5, 1, &mf);
        other_epoch.runs[0].device = sanfs_blockmap::volume::DeviceIndex(3);
        assert_eq!(replay(&store, other_epoch).await, ReplayOutcome::Refused);
        // The right blocks: replayed, the size is back, the range Written.
        assert_eq!(
            replay(&store, record(f, epoch, seq_f, &mf)).await,
            ReplayOutcome::Replayed
        );
        assert_eq!(size(&store, f), 128 * KIB);
        let written = store
            .read(|t| t.extent_map_of(InodeId(f)))
            .unwrap()
            .iter()
            .all(|e| e.state == sanfs_blockmap::extent::ExtentState::Written);
        assert!(written, "the replayed range is Written");
        // g's blocks were freed (the recovery after the window trims Unwritten blocks past
        // the end of file; they may go to another file next): g's record is refused.
        store
            .write(move |ctx| trim_unwritten_past_eof(ctx, InodeId(g), 0, 16))
            .await
            .unwrap();
        assert_eq!(
            replay(&store, record(g, epoch, seq_g, &mg)).await,
            ReplayOutcome::Refused
        );
        assert_eq!(size(&store, g), 0);
        // A file that is gone: refused.
        let mut gone = record(f, epoch, seq_f, &mf);
        gone.inode = InodeId(999_999);
        assert_eq!(replay(&store, gone).await, ReplayOutcome::Refused);
    });
}

#[test]
fn lazy_work_becomes_durable_on_its_own_within_the_bound() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let disk = SimDisk::new(FaultPlan::default());
    let backend = Backend::Sim(disk.clone());
    sanfs_testcluster::mds::create_store(&backend, &crate::support::fs_info(), &Clock::System)
        .unwrap();
    let store = Store::open(&backend, Clock::System, 16).unwrap();
    let vol = store.volume().clone();
    let f = crate::coherence::create_in(&store, "timer");
    rt.block_on(async {
        let v = vol.clone();
        store
            .write(move |ctx| map_write(ctx, &v, InodeId(f), 0, 64 * KIB))
            .await
            .unwrap();
        let (_, seq) = store
            .write_lazy_numbered(move |ctx| complete_write(ctx, InodeId(f), 0, 64 * KIB, false))
            .await
            .unwrap();
        assert!(store.durable_seq() < seq);
        let t = Instant::now();
        while store.durable_seq() < seq {
            assert!(
                t.elapsed() < LAZY_SYNC_AFTER + Duration::from_secs(5),
                "lazy work not durable after {:?}",
                t.elapsed()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    });
    // And it really is: it survives a crash.
    disk.crash_now();
    drop(store);
    let disk = SimDisk::from_image(disk.durable_image(), FaultPlan::default());
    let store = Store::open(&Backend::Sim(disk), Clock::System, 16).unwrap();
    assert_eq!(size(&store, f), 64 * KIB);
}
