//! Criterion benchmarks of the pure core: extent lookup in a 1M-extent map, planning a 4 MiB
//! I/O over 4 stripes (method B and method A), and allocator throughput.
//!
//! Run: `cargo bench -p sanfs-bench --bench blockmap`. Figures go in docs/performance.md.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use sanfs_blockmap::alloc::Allocator;
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

/// Xorshift64: picks which extent to free without another dependency.
struct XorShift(u64);

impl XorShift {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as usize
    }
}

/// A 1 TiB volume of 4 KiB blocks striped over 4 LUNs (4 allocation groups, 64 KiB stripe
/// unit), half filled with 256-block extents allocated with a hint, as files grow.
fn half_full_allocator() -> (Allocator, Vec<(u64, u64)>) {
    let volume = Volume::striped(4096, devices(4, 256 * GIB), MIB, 64 * KIB).expect("volume");
    let groups = volume.allocation_groups();
    assert_eq!(groups.len(), 4);
    let mut a = Allocator::new(&groups, 64 * KIB / 4096).expect("allocator");
    let mut owned = Vec::new();
    let mut hint = None;
    while a.used_blocks() < a.capacity_blocks() / 2 {
        let got = a.allocate(256, hint, 1).expect("space");
        let (start, len) = got.extents[0];
        owned.push((start, len));
        // A new "file" every 64 extents, continuing the last one otherwise.
        hint = (owned.len() % 64 != 0).then_some(start + len);
    }
    (a, owned)
}

/// Random frees and hinted 256-block reallocations on a half-full 1 TiB volume. Frees and
/// allocations are timed apart, in batches, so each benchmark reports one operation.
fn allocator(c: &mut Criterion) {
    let (mut a, mut owned) = half_full_allocator();
    let mut rng = XorShift(0x9E37_79B9_7F4A_7C15);
    let mut g = c.benchmark_group("alloc");
    g.throughput(Throughput::Elements(1));
    // Each batch frees `n` random extents, then allocates `n` with the hint of a random
    // survivor's end; `timed` picks which half the clock sees.
    let mut run = |iters: u64, time_frees: bool| {
        let mut total = Duration::ZERO;
        let mut done = 0u64;
        while done < iters {
            let n = (iters - done).min(1024) as usize;
            let t = Instant::now();
            for _ in 0..n {
                let (start, len) = owned.swap_remove(rng.below(owned.len()));
                black_box(a.free(start, len).expect("in use"));
            }
            if time_frees {
                total += t.elapsed();
            }
            let t = Instant::now();
            for _ in 0..n {
                let (start, len) = owned[rng.below(owned.len())];
                let got = a.allocate(256, Some(start + len), 4).expect("space");
                owned.extend_from_slice(&got.extents);
            }
            if !time_frees {
                total += t.elapsed();
            }
            done += n as u64;
        }
        total
    };
    g.bench_function("allocate_256_hinted_1TiB_half_full", |b| {
        b.iter_custom(|iters| run(iters, false))
    });
    g.bench_function("free_256_1TiB_half_full", |b| {
        b.iter_custom(|iters| run(iters, true))
    });
    g.finish();
}

criterion_group!(benches, extent_lookup, planner, allocator);
criterion_main!(benches);
