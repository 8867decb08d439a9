//! Criterion benchmarks of the agent's I/O engines: the io_uring engine against the
//! synchronous one, reading 1 MiB and 64 KiB from each of 4 file-backed LUNs per batch
//! (O_DIRECT, one grant's I/O on all four at once), with 1 and with 8 batches in flight.
//!
//! Run: `cargo bench -p sanfs-bench --bench engine`. The LUN files live in a temporary
//! directory (on the local disk, not tmpfs, so that O_DIRECT applies).

use std::fs::File;
use std::os::unix::fs::FileExt;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use sanfs_blockmap::plan::BufRange;
use sanfs_blockmap::volume::DeviceIndex;
use sanfs_client_agent::buf::AlignedBuf;
use sanfs_client_agent::engine::{DeviceOp, Engine, EngineConfig, EngineKind, OpKind};

const MIB: u64 = 1 << 20;
const LUNS: usize = 4;
const LUN_SIZE: u64 = 64 * MIB;

fn make_luns(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let chunk: Vec<u8> = (0..MIB as usize).map(|i| (i % 251) as u8).collect();
    (0..LUNS)
        .map(|i| {
            let path = dir.join(format!("lun{i}"));
            let f = File::create(&path).expect("create LUN file");
            for off in (0..LUN_SIZE).step_by(MIB as usize) {
                f.write_all_at(&chunk, off).expect("fill LUN file");
            }
            f.sync_all().expect("sync LUN file");
            path
        })
        .collect()
}

fn open(paths: &[std::path::PathBuf]) -> Vec<Option<File>> {
    paths
        .iter()
        .map(|p| {
            Some(
                sanfs_lun::open_direct_strict(p, sanfs_lun::Access::ReadWrite)
                    .expect("open LUN file O_DIRECT"),
            )
        })
        .collect()
}

/// One batch: `size` bytes from each LUN at `off`, into one buffer of `LUNS * size`.
fn batch(size: u64, off: u64) -> Vec<DeviceOp> {
    (0..LUNS as u64)
        .map(|d| DeviceOp {
            device: DeviceIndex(d as u32),
            phys_off: off,
            kind: OpKind::Read,
            iov: vec![BufRange {
                buf_off: d * size,
                len: size,
            }],
        })
        .collect()
}

fn engines(c: &mut Criterion) {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("temp dir");
    let paths = make_luns(dir.path());
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("runtime");
    let mut group = c.benchmark_group("engine_read_4_luns");
    group.sample_size(20);
    for kind in [EngineKind::Uring, EngineKind::Sync] {
        let engine = Engine::new(
            &EngineConfig {
                kind,
                queue_depth_per_device: 16,
            },
            open(&paths),
        )
        .expect("engine");
        for size in [MIB, 64 * 1024] {
            for depth in [1usize, 8] {
                let mut bufs: Vec<Option<AlignedBuf>> = (0..depth)
                    .map(|_| Some(AlignedBuf::zeroed(LUNS * size as usize)))
                    .collect();
                let mut next_off = 0u64;
                group.throughput(Throughput::Bytes(LUNS as u64 * size * depth as u64));
                let id = BenchmarkId::new(
                    format!("{}/{}KiB", engine.name(), size / 1024),
                    format!("qd{depth}"),
                );
                group.bench_function(id, |b| {
                    b.iter(|| {
                        let pending: Vec<_> = bufs
                            .iter_mut()
                            .map(|slot| {
                                let buf = slot.take().expect("buffer is back");
                                let f = engine.submit(buf, batch(size, next_off));
                                next_off = (next_off + size) % LUN_SIZE;
                                f
                            })
                            .collect();
                        rt.block_on(async {
                            for (slot, f) in bufs.iter_mut().zip(pending) {
                                let done = f.await.expect("engine running");
                                assert!(done.results.iter().all(Result::is_ok));
                                *slot = Some(done.buf);
                            }
                        });
                    })
                });
            }
        }
    }
    group.finish();
}

criterion_group!(benches, engines);
criterion_main!(benches);
