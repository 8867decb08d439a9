//! The engines executing real I/O plans over four LUNs: files, and (as root) loop devices.

use std::fs::File;
use std::path::PathBuf;

use sanfs_blockmap::extent::{Extent, ExtentMap, ExtentState};
use sanfs_blockmap::plan::{IoPlan, PlanMethod, PlanOp, plan};
use sanfs_blockmap::volume::{DeviceIndex, Volume};
use sanfs_client_agent::buf::{AlignedBuf, BufferPool};
use sanfs_client_agent::engine::{
    DeviceOp, Engine, EngineKind, IoErrKind, PlanIoError, execute_read, execute_write,
};

use crate::support::*;

const DEV_SIZE: u64 = (1 << 20) + (4 << 20);

/// A file of 1300 blocks: 512 Written blocks, then 788 Unwritten ones, far apart on the volume.
fn extents(state_of_second: ExtentState) -> ExtentMap {
    ExtentMap::from_extents(vec![
        Extent {
            file_block: 0,
            vol_block: 100,
            len_blocks: 512,
            state: ExtentState::Written,
        },
        Extent {
            file_block: 512,
            vol_block: 2000,
            len_blocks: 788,
            state: state_of_second,
        },
    ])
    .unwrap()
}

fn plan_of(op: PlanOp, volume: &Volume, map: &ExtentMap, len: u64) -> IoPlan {
    let p = plan(op, 0, len, map, volume, PlanMethod::Coalesced).unwrap();
    assert!(p.is_aligned(u64::from(BLOCK)));
    p
}

fn open_all(paths: &[PathBuf]) -> Vec<Option<File>> {
    paths
        .iter()
        .map(|p| Some(sanfs_lun::open_direct_strict(p, sanfs_lun::Access::ReadWrite).unwrap()))
        .collect()
}

fn engines(paths: &[PathBuf]) -> Vec<Engine> {
    vec![
        engine(EngineKind::Uring, open_all(paths)),
        engine(EngineKind::Sync, open_all(paths)),
    ]
}

/// Writes the whole file through `writer`, then reads it back through every engine: before
/// conversion the unwritten part reads as zeros, after it the data is all there.
async fn round_trip(paths: &[PathBuf]) {
    let volume = striped_volume(paths.len(), DEV_SIZE);
    let len = 1300 * u64::from(BLOCK);
    let data = pattern(len as usize, 0x3c);
    let all = engines(paths);
    for writer in &all {
        let seed = if writer.name() == "uring" { 1 } else { 2 };
        let data: Vec<u8> = data.iter().map(|b| b ^ seed).collect();
        let wplan = plan_of(
            PlanOp::Write,
            &volume,
            &extents(ExtentState::Unwritten),
            len,
        );
        assert_eq!(
            wplan.by_device().count(),
            4,
            "the write spans all four LUNs"
        );
        let buf = execute_write(writer, &wplan, AlignedBuf::from_slice(&data))
            .await
            .unwrap();
        assert_eq!(buf.as_slice(), &data[..]);
        for reader in &all {
            let before = plan_of(PlanOp::Read, &volume, &extents(ExtentState::Unwritten), len);
            let got = execute_read(
                reader,
                &before,
                AlignedBuf::from_slice(&vec![0xee; len as usize]),
            )
            .await
            .unwrap();
            let split = 512 * BLOCK as usize;
            assert_eq!(
                &got[..split],
                &data[..split],
                "{} -> {}",
                writer.name(),
                reader.name()
            );
            assert!(
                got[split..].iter().all(|&b| b == 0),
                "unwritten reads as zeros"
            );

            let after = plan_of(PlanOp::Read, &volume, &extents(ExtentState::Written), len);
            let got = execute_read(reader, &after, AlignedBuf::zeroed(len as usize))
                .await
                .unwrap();
            assert!(
                got.as_slice() == &data[..],
                "{} -> {}",
                writer.name(),
                reader.name()
            );
        }
    }
}

#[tokio::test]
async fn plan_round_trip_over_four_file_luns_with_both_engines() {
    let dir = tempfile::tempdir().unwrap();
    let paths = labelled_files(dir.path(), 4, DEV_SIZE);
    round_trip(&paths).await;
}

#[tokio::test]
async fn plan_round_trip_over_four_loop_devices_with_both_engines() {
    if sanfs_testcluster::skip_unless(
        "plan_round_trip_over_four_loop_devices_with_both_engines",
        &[sanfs_testcluster::Need::LoopDevices],
    ) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let files = labelled_files(dir.path(), 4, DEV_SIZE);
    let loops: Vec<LoopDev> = files.iter().map(|f| LoopDev::attach(f)).collect();
    let paths: Vec<PathBuf> = loops.iter().map(|l| l.path.clone()).collect();
    round_trip(&paths).await;
}

/// Device 3 is shorter than the volume says: exactly the I/Os that reach past its end fail,
/// with EIO, and the others complete.
#[tokio::test]
async fn a_read_past_the_end_of_a_small_device_fails_that_io_only() {
    let dir = tempfile::tempdir().unwrap();
    let paths = labelled_files(dir.path(), 4, DEV_SIZE);
    let short_end = (1 << 20) + (2 << 20);
    File::options()
        .write(true)
        .open(&paths[3])
        .unwrap()
        .set_len(short_end)
        .unwrap();
    let volume = striped_volume(4, DEV_SIZE);
    let len = 1300 * u64::from(BLOCK);
    let rplan = plan_of(PlanOp::Read, &volume, &extents(ExtentState::Written), len);
    for engine in engines(&paths) {
        let ops: Vec<DeviceOp> = rplan.device_ios.iter().map(DeviceOp::read).collect();
        let done = engine
            .submit(AlignedBuf::zeroed(len as usize), ops)
            .await
            .unwrap();
        let mut failed = 0;
        for (io, result) in rplan.device_ios.iter().zip(&done.results) {
            let past_end = io.device == DeviceIndex(3) && io.phys_off + io.len > short_end;
            match result {
                Ok(()) => assert!(!past_end, "{}: {io:?} succeeded", engine.name()),
                Err(e) => {
                    assert!(past_end, "{}: {io:?} failed: {e}", engine.name());
                    assert_eq!(e.device, DeviceIndex(3));
                    assert_eq!(e.errno(), libc::EIO);
                    assert!(matches!(
                        e.error,
                        IoErrKind::UnexpectedEof | IoErrKind::Os(_)
                    ));
                    failed += 1;
                }
            }
        }
        assert!(failed >= 1);
        let err = execute_read(&engine, &rplan, AlignedBuf::zeroed(len as usize))
            .await
            .unwrap_err();
        assert!(
            matches!(&err, PlanIoError::Device(v) if v.len() == failed),
            "{err}"
        );
    }
}

/// Both engines return byte-identical buffers and identical results for the same batches,
/// including a multi-piece (vectored) read and a failing op.
#[tokio::test]
async fn the_sync_engine_gives_identical_results() {
    let dir = tempfile::tempdir().unwrap();
    let paths = labelled_files(dir.path(), 4, DEV_SIZE);
    let volume = striped_volume(4, DEV_SIZE);
    let len = 1300 * u64::from(BLOCK);
    let [uring, sync]: [Engine; 2] = engines(&paths).try_into().unwrap();
    let wplan = plan_of(PlanOp::Write, &volume, &extents(ExtentState::Written), len);
    execute_write(
        &uring,
        &wplan,
        AlignedBuf::from_slice(&pattern(len as usize, 9)),
    )
    .await
    .unwrap();
    let rplan = plan_of(PlanOp::Read, &volume, &extents(ExtentState::Written), len);
    let mut ops: Vec<DeviceOp> = rplan.device_ios.iter().map(DeviceOp::read).collect();
    assert!(
        ops.iter().any(|o| o.iov.len() > 1),
        "some reads are vectored"
    );
    ops.push(DeviceOp {
        phys_off: DEV_SIZE,
        ..ops[0].clone()
    });
    let a = uring
        .submit(AlignedBuf::zeroed(len as usize), ops.clone())
        .await
        .unwrap();
    let b = sync
        .submit(AlignedBuf::zeroed(len as usize), ops)
        .await
        .unwrap();
    assert_eq!(a.results, b.results);
    assert!(a.results.last().unwrap().is_err());
    assert!(a.buf.as_slice() == b.buf.as_slice());
}

/// Plans run on pooled buffers, which are recycled between grants.
#[tokio::test]
async fn plans_run_on_pooled_buffers() {
    let dir = tempfile::tempdir().unwrap();
    let paths = labelled_files(dir.path(), 4, DEV_SIZE);
    let volume = striped_volume(4, DEV_SIZE);
    let len = 1300 * u64::from(BLOCK);
    let engine = engine(EngineKind::Auto, open_all(&paths));
    let pool = BufferPool::new(len as usize, 2);
    let data = pattern(len as usize, 77);
    let mut wbuf = pool.take().await;
    wbuf[..len as usize].copy_from_slice(&data);
    let wplan = plan_of(PlanOp::Write, &volume, &extents(ExtentState::Written), len);
    drop(execute_write(&engine, &wplan, wbuf).await.unwrap());
    let rplan = plan_of(PlanOp::Read, &volume, &extents(ExtentState::Written), len);
    for _ in 0..3 {
        let got = execute_read(&engine, &rplan, pool.take().await)
            .await
            .unwrap();
        assert!(got.is_pooled() && got.as_slice() == &data[..]);
    }
    assert_eq!(pool.available(), 2);
    let small = AlignedBuf::zeroed(4096);
    assert!(matches!(
        execute_read(&engine, &rplan, small).await,
        Err(PlanIoError::BufferTooSmall { .. })
    ));
}

/// Many tasks on a multi-threaded runtime submit at once, with a queue depth of 2 per device so
/// that most I/O waits in the engine's per-device queues; every byte lands where it should.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_concurrent_batches_from_many_tasks() {
    let dir = tempfile::tempdir().unwrap();
    let paths = labelled_files(dir.path(), 4, DEV_SIZE);
    for kind in [EngineKind::Uring, EngineKind::Sync] {
        let engine = std::sync::Arc::new(
            Engine::new(
                &sanfs_client_agent::engine::EngineConfig {
                    kind,
                    queue_depth_per_device: 2,
                },
                open_all(&paths),
            )
            .unwrap(),
        );
        let page = 4096u64;
        let tasks: Vec<_> = (0..64u64)
            .map(|t| {
                let engine = std::sync::Arc::clone(&engine);
                tokio::spawn(async move {
                    // Task t writes 4 pages (one per device) at device page 256 + t, then reads
                    // them back in reverse device order into a fresh buffer.
                    let data = pattern(4 * page as usize, t as u8);
                    let op = |d: u32, kind| DeviceOp {
                        device: DeviceIndex(d),
                        phys_off: (256 + t) * page,
                        kind,
                        iov: vec![sanfs_blockmap::plan::BufRange {
                            buf_off: u64::from(d) * page,
                            len: page,
                        }],
                    };
                    use sanfs_client_agent::engine::OpKind;
                    let w = (0..4).map(|d| op(d, OpKind::Write)).collect();
                    let done = engine
                        .submit(AlignedBuf::from_slice(&data), w)
                        .await
                        .unwrap();
                    assert!(done.results.iter().all(Result::is_ok));
                    let r = (0..4).rev().map(|d| op(d, OpKind::Read)).collect();
                    let back = engine
                        .submit(AlignedBuf::zeroed(4 * page as usize), r)
                        .await
                        .unwrap();
                    assert!(back.results.iter().all(Result::is_ok));
                    assert!(back.buf.as_slice() == &data[..], "task {t}");
                })
            })
            .collect();
        for t in tasks {
            t.await.unwrap();
        }
    }
}
