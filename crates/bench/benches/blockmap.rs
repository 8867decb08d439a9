//! Criterion benchmarks of the pure core: extent lookup in a 1M-extent map, planning a 4 MiB
//! I/O over 4 stripes (method B and method A), and allocator throughput.
//!
//! Run: `cargo bench -p sanfs-bench --bench blockmap`. Figures go in docs/performance.md.

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use sanfs_blockmap::extent::{Extent, ExtentMap, ExtentState};
use sanfs_blockmap::plan::{PlanMethod, PlanOp, plan};
use sanfs_blockmap::volume::{DeviceId, Volume, VolumeDevice};
use uuid::Uuid;

const KIB: u64 = 1024;
const MIB: u64 = 1024 * KIB;
const GIB: u64 = 1024 * MIB;

fn devices(n: u32, size: u64) -> Vec<VolumeDevice> {
    (0..n)
        .map(|i| VolumeDevice {
            uuid: DeviceId::Sanfs(Uuid::from_u128(u128::from(i) + 1)),
            size_bytes: size,
        })
        .collect()
}

/// A map of `n` one-block extents with a one-block gap between each (nothing merges).
fn fragmented_map(n: u64) -> ExtentMap {
    let extents = (0..n)
        .map(|i| Extent {
            file_block: 2 * i,
            vol_block: 3 * i,
            len_blocks: 1,
            state: if i % 3 == 0 {
                ExtentState::Unwritten
            } else {
                ExtentState::Written
            },
        })
        .collect();
    ExtentMap::from_extents(extents).expect("extents are disjoint")
}

fn extent_lookup(c: &mut Criterion) {
    let map = fragmented_map(1 << 20);
    assert_eq!(map.len(), 1 << 20);
    let mut g = c.benchmark_group("extent");
    let mut probe = 0u64;
    g.bench_function("lookup_1M_extents_8_blocks", |b| {
        b.iter(|| {
            // A pseudo-random walk over the map so the cache does not flatter us.
            probe = (probe + 0x9E37_79B9) % (2 << 20);
            black_box(map.lookup(black_box(probe), 8))
        })
    });
    g.finish();
}

fn planner(c: &mut Criterion) {
    let volume = Volume::striped(4096, devices(4, 4 * GIB), MIB, 64 * KIB).expect("volume");
    // One file laid out contiguously over the stripes: 64 MiB from volume block 0.
    let map = ExtentMap::from_extents(vec![Extent {
        file_block: 0,
        vol_block: 0,
        len_blocks: 64 * MIB / 4096,
        state: ExtentState::Written,
    }])
    .expect("one extent");
    let mut g = c.benchmark_group("plan");
    g.throughput(Throughput::Bytes(4 * MIB));
    for (name, method) in [
        ("4MiB_4stripes_methodB", PlanMethod::Coalesced),
        ("4MiB_4stripes_methodA", PlanMethod::PerStripeUnit),
    ] {
        g.bench_function(name, |b| {
            b.iter(|| {
                plan(
                    PlanOp::Read,
                    black_box(8 * MIB),
                    4 * MIB,
                    &map,
                    &volume,
                    method,
                )
                .expect("plan")
            })
        });
    }
    g.finish();
}

criterion_group!(benches, extent_lookup, planner);
criterion_main!(benches);
