//! The I/O planner: turns a byte range of a file into per-device I/O.
//!
//! [`plan`] looks the range up in the file's [`ExtentMap`], maps every mapped piece through
//! the [`Volume`] to physical runs, and returns an [`IoPlan`]: the device I/Os to issue, each
//! with the scatter-gather list of the caller's buffer it reads into or writes from, and the
//! parts of the buffer a read fills with zeros (holes and unwritten extents).
//!
//! With [`PlanMethod::Coalesced`] ("method B" of the paper, section 4.3 and figure 5), runs
//! that are physically contiguous on one device become one I/O even when they lie far apart
//! in the file: on a striped volume, stripe units k and k + width of a file laid out
//! contiguously sit next to each other on the same leg, so a 4 MiB read over 4 legs is 4
//! device I/Os rather than 64. [`PlanMethod::PerStripeUnit`] ("method A") keeps one I/O per
//! stripe-unit run, for the benchmark that compares the two.

use crate::extent::{Extent, ExtentMap, ExtentState, Piece};
use crate::volume::{DeviceIndex, Volume};

/// The longest byte range one plan may cover (4 GiB). The caller's buffer has to hold the
/// whole range, and the planner's work grows with the number of stripe units in it, so a
/// longer range is a bug or an attack rather than an I/O.
pub const MAX_PLAN_LEN: u64 = 1 << 32;

/// Whether the plan reads into or writes from the caller's buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PlanOp {
    Read,
    Write,
}

/// How physical runs become device I/Os.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PlanMethod {
    /// Method B: physically contiguous runs on one device are merged into one I/O.
    Coalesced,
    /// Method A: one I/O per stripe-unit run, no merging (kept for the benchmark).
    PerStripeUnit,
}

/// A piece of the caller's buffer, relative to the start of the planned range.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BufRange {
    pub buf_off: u64,
    pub len: u64,
}

/// One I/O on one device: `len` bytes at `phys_off`, scattered to (or gathered from) the
/// buffer pieces of `iov` in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceIo {
    pub device: DeviceIndex,
    pub phys_off: u64,
    pub len: u64,
    pub iov: Vec<BufRange>,
}

/// The I/O plan for one byte range of a file.
///
/// Every byte of the range's buffer is covered exactly once, either by a piece of some
/// device I/O's `iov` or (reads only) by a piece of `zero_fill`. `device_ios` are sorted by
/// `(device, phys_off)` and never overlap; with [`PlanMethod::Coalesced`] no two I/Os of one
/// device are contiguous either. `zero_fill` is sorted and merged.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IoPlan {
    /// Length of the planned range in bytes.
    pub len: u64,
    pub device_ios: Vec<DeviceIo>,
    pub zero_fill: Vec<BufRange>,
}

impl IoPlan {
    /// The device I/Os grouped by device, in device order: what a grant sends per device.
    pub fn by_device(&self) -> impl Iterator<Item = (DeviceIndex, &[DeviceIo])> + '_ {
        self.device_ios
            .chunk_by(|a, b| a.device == b.device)
            .filter_map(|ios| ios.first().map(|io| (io.device, ios)))
    }

    /// Total bytes moved to or from devices.
    pub fn device_bytes(&self) -> u64 {
        self.device_ios.iter().map(|io| io.len).sum()
    }

    /// Total bytes a read fills with zeros.
    pub fn zero_fill_bytes(&self) -> u64 {
        self.zero_fill.iter().map(|z| z.len).sum()
    }

    /// Whether every device I/O's offset and length, and every buffer piece's offset and
    /// length, are multiples of `align` (what O_DIRECT needs; the caller then only has to
    /// align the buffer's start).
    pub fn is_aligned(&self, align: u64) -> bool {
        let ok = |v: u64| align != 0 && v.is_multiple_of(align);
        self.device_ios.iter().all(|io| {
            ok(io.phys_off) && ok(io.len) && io.iov.iter().all(|b| ok(b.buf_off) && ok(b.len))
        })
    }
}

/// Where one piece of a planned range lies: buffer bytes `[buf_off, buf_off + len)` at byte
/// `phys_off` of `device`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PhysRun {
    pub buf_off: u64,
    pub device: DeviceIndex,
    pub phys_off: u64,
    pub len: u64,
}

/// The physical runs of `device_ios` in buffer order, merged where they continue each other
/// both in the buffer and on one device: a canonical form of "which device bytes hold which
/// buffer bytes", the same for two plans of one mapping however their I/Os are grouped.
pub fn phys_runs(device_ios: &[DeviceIo]) -> Vec<PhysRun> {
    let mut runs = Vec::new();
    for io in device_ios {
        let mut phys = io.phys_off;
        for piece in &io.iov {
            runs.push(PhysRun {
                buf_off: piece.buf_off,
                device: io.device,
                phys_off: phys,
                len: piece.len,
            });
            phys = phys.saturating_add(piece.len);
        }
    }
    merge_runs(runs)
}

/// `runs` sorted by buffer offset, neighbours that continue each other merged, empty ones
/// dropped (see [`phys_runs`]).
pub fn merge_runs(mut runs: Vec<PhysRun>) -> Vec<PhysRun> {
    runs.retain(|r| r.len > 0);
    runs.sort_unstable();
    let mut merged: Vec<PhysRun> = Vec::with_capacity(runs.len());
    for r in runs {
        if let Some(last) = merged.last_mut()
            && last.device == r.device
            && last.buf_off.checked_add(last.len) == Some(r.buf_off)
            && last.phys_off.checked_add(last.len) == Some(r.phys_off)
        {
            last.len += r.len;
            continue;
        }
        merged.push(r);
    }
    merged
}

/// Why a range could not be planned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error("byte range {offset}+{len} ends past 2^64")]
    RangeOverflow { offset: u64, len: u64 },
    #[error("byte range of {len} bytes is longer than one plan may be ({max})")]
    TooLong { len: u64, max: u64 },
    #[error("cannot write {len} bytes at file offset {file_off}: no blocks are allocated there")]
    Unallocated { file_off: u64, len: u64 },
    #[error("extent {extent} lies outside the volume of {volume_blocks} blocks")]
    ExtentOutsideVolume { extent: Extent, volume_blocks: u64 },
    #[error("device {device} byte {phys_off} is mapped twice in the range")]
    DoubleMapped { device: DeviceIndex, phys_off: u64 },
}

/// One physical run of the range before grouping into device I/Os.
#[derive(Debug, Clone, Copy)]
struct Run {
    device: DeviceIndex,
    phys_off: u64,
    len: u64,
    buf_off: u64,
}

/// Plans `op` on bytes `[offset, offset + len)` of the file whose extents are `extents`, on
/// `volume`. The range need not be block aligned.
///
/// Reads: written extents become device I/O, holes and unwritten extents zero fill. Writes:
/// written and unwritten extents become device I/O, and a hole is an error (the server
/// allocates before it grants).
pub fn plan(
    op: PlanOp,
    offset: u64,
    len: u64,
    extents: &ExtentMap,
    volume: &Volume,
    method: PlanMethod,
) -> Result<IoPlan, PlanError> {
    let end = offset
        .checked_add(len)
        .ok_or(PlanError::RangeOverflow { offset, len })?;
    if len > MAX_PLAN_LEN {
        return Err(PlanError::TooLong {
            len,
            max: MAX_PLAN_LEN,
        });
    }
    let mut plan = IoPlan {
        len,
        ..IoPlan::default()
    };
    if len == 0 {
        return Ok(plan);
    }
    let bs = u64::from(volume.block_size());
    let first_block = offset / bs;
    let end_block = (end - 1) / bs + 1;
    let mut runs: Vec<Run> = Vec::new();
    for piece in extents.lookup(first_block, end_block - first_block) {
        // The piece's bytes inside the range. Its first block starts below `end` and its end
        // block is at most `end_block`, so only the end can exceed 2^64 (and is then clipped).
        let piece_start = piece.file_block() * bs;
        let lo = piece_start.max(offset);
        let hi = (piece.file_block() + piece.len_blocks())
            .saturating_mul(bs)
            .min(end);
        let buf_off = lo - offset;
        let to_device = match (piece, op) {
            (Piece::Hole { .. }, PlanOp::Write) => {
                return Err(PlanError::Unallocated {
                    file_off: lo,
                    len: hi - lo,
                });
            }
            (Piece::Hole { .. }, PlanOp::Read) => None,
            (Piece::Mapped(e), PlanOp::Read) if e.state == ExtentState::Unwritten => None,
            (Piece::Mapped(e), _) => Some(e),
        };
        let Some(extent) = to_device else {
            push_merged(&mut plan.zero_fill, buf_off, hi - lo);
            continue;
        };
        let outside = || PlanError::ExtentOutsideVolume {
            extent,
            volume_blocks: volume.size_blocks(),
        };
        let vol_off = extent
            .vol_block
            .checked_mul(bs)
            .and_then(|v| v.checked_add(lo - piece_start))
            .ok_or_else(outside)?;
        volume
            .map_with(vol_off, hi - lo, |run| {
                runs.push(Run {
                    device: run.device,
                    phys_off: run.phys_off,
                    len: run.len,
                    buf_off: buf_off + (run.vol_off - vol_off),
                });
            })
            .map_err(|_| outside())?;
    }
    plan.device_ios = group_runs(runs, method)?;
    Ok(plan)
}

/// Appends `[buf_off, buf_off + len)` to `ranges`, extending the last range if it ends there.
fn push_merged(ranges: &mut Vec<BufRange>, buf_off: u64, len: u64) {
    match ranges.last_mut() {
        Some(last) if last.buf_off + last.len == buf_off => last.len += len,
        _ => ranges.push(BufRange { buf_off, len }),
    }
}

/// Sorts runs by device and offset and turns them into device I/Os, merging physically
/// contiguous runs with [`PlanMethod::Coalesced`]. Refuses runs that overlap on a device:
/// that means two file blocks of the range share a volume block, a corrupt extent map.
fn group_runs(mut runs: Vec<Run>, method: PlanMethod) -> Result<Vec<DeviceIo>, PlanError> {
    runs.sort_unstable_by_key(|r| (r.device, r.phys_off));
    let mut ios: Vec<DeviceIo> = Vec::new();
    for run in runs {
        if let Some(last) = ios.last_mut()
            && last.device == run.device
        {
            let last_end = last.phys_off + last.len;
            if last_end > run.phys_off {
                return Err(PlanError::DoubleMapped {
                    device: run.device,
                    phys_off: run.phys_off,
                });
            }
            if method == PlanMethod::Coalesced && last_end == run.phys_off {
                last.len += run.len;
                push_merged(&mut last.iov, run.buf_off, run.len);
                continue;
            }
        }
        ios.push(DeviceIo {
            device: run.device,
            phys_off: run.phys_off,
            len: run.len,
            iov: vec![BufRange {
                buf_off: run.buf_off,
                len: run.len,
            }],
        });
    }
    Ok(ios)
}

/// Random volumes for the property tests of this module and of [`crate::codec`].
#[cfg(test)]
pub(crate) mod test_support {
    use uuid::Uuid;

    use crate::volume::{
        DeviceId, DeviceIndex, LayoutKind, LvmPvId, Segment, StripeLeg, Volume, VolumeDevice,
    };

    /// SplitMix64: small, fast and good enough to build test layouts from a seed.
    #[derive(Debug, Clone)]
    pub(crate) struct Rng(u64);

    impl Rng {
        pub(crate) fn new(seed: u64) -> Rng {
            Rng(seed)
        }

        pub(crate) fn next_u64(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        }

        /// Uniform in `[0, n)`; `n` must be positive.
        pub(crate) fn below(&mut self, n: u64) -> u64 {
            self.next_u64() % n
        }

        /// Uniform in `[lo, hi]`.
        pub(crate) fn range(&mut self, lo: u64, hi: u64) -> u64 {
            lo + self.below(hi - lo + 1)
        }

        /// True with probability `num / den`.
        pub(crate) fn chance(&mut self, num: u64, den: u64) -> bool {
            self.below(den) < num
        }

        pub(crate) fn fill(&mut self, buf: &mut [u8]) {
            for chunk in buf.chunks_mut(8) {
                let v = self.next_u64().to_le_bytes();
                chunk.copy_from_slice(&v[..chunk.len()]);
            }
        }

        pub(crate) fn shuffle<T>(&mut self, items: &mut [T]) {
            for i in (1..items.len()).rev() {
                let j = self.below(i as u64 + 1) as usize;
                items.swap(i, j);
            }
        }
    }

    pub(crate) fn device_id(rng: &mut Rng) -> DeviceId {
        if rng.chance(1, 2) {
            DeviceId::Sanfs(Uuid::from_u128(
                u128::from(rng.next_u64()) << 64 | u128::from(rng.next_u64()),
            ))
        } else {
            const ALNUM: &[u8] = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";
            let text: String = (0..32)
                .map(|_| char::from(ALNUM[rng.below(ALNUM.len() as u64) as usize]))
                .collect();
            DeviceId::LvmPv(LvmPvId::parse(&text).expect("32 alphanumerics are a PV id"))
        }
    }

    fn devices(rng: &mut Rng, sizes: &[u64]) -> Vec<VolumeDevice> {
        sizes
            .iter()
            .map(|&size_bytes| VolumeDevice {
                uuid: device_id(rng),
                size_bytes,
            })
            .collect()
    }

    /// A random small volume: `kind` 0 is linear, 1 striped over 2 to 5 legs with a stripe
    /// unit from 4 KiB to 256 KiB, anything else several linear and striped segments built
    /// with [`Volume::from_segments`]. Every device is at most about 1 MiB.
    pub(crate) fn volume(rng: &mut Rng, kind: u8) -> Volume {
        let block_size: u32 = if rng.chance(1, 4) { 512 } else { 4096 };
        let bs = u64::from(block_size);
        let data_offset = [0, 4096, 65536][rng.below(3) as usize];
        match kind {
            0 => {
                let n = rng.range(1, 3);
                let sizes: Vec<u64> = (0..n)
                    .map(|_| data_offset + rng.range(4, 256) * 4096 + rng.below(bs))
                    .collect();
                let devs = devices(rng, &sizes);
                Volume::linear(block_size, devs, data_offset).expect("valid linear volume")
            }
            1 => {
                let width = rng.range(2, 5);
                let stripe_unit = 4096u64 << rng.below(7);
                let rows = rng.range(2, (512 * 1024 / stripe_unit).clamp(2, 8));
                let sizes: Vec<u64> = (0..width)
                    .map(|_| data_offset + rows * stripe_unit + rng.below(2 * stripe_unit))
                    .collect();
                let devs = devices(rng, &sizes);
                Volume::striped(block_size, devs, data_offset, stripe_unit)
                    .expect("valid striped volume")
            }
            _ => {
                let ndev = rng.range(2, 5);
                let mut cursor = vec![data_offset; ndev as usize];
                let mut segments = Vec::new();
                let mut vol_start = 0u64;
                for _ in 0..rng.range(2, 4) {
                    let mut order: Vec<u32> = (0..ndev as u32).collect();
                    rng.shuffle(&mut order);
                    let width = if rng.chance(1, 2) {
                        1
                    } else {
                        rng.range(2, ndev.min(4))
                    };
                    let (stripe_unit, leg_len) = if width == 1 {
                        (bs, rng.range(1, 64) * bs)
                    } else {
                        let su = 4096u64 << rng.below(4);
                        (su, rng.range(1, 4) * su)
                    };
                    let legs: Vec<StripeLeg> = order[..width as usize]
                        .iter()
                        .map(|&d| {
                            let c = &mut cursor[d as usize];
                            *c += 512 * rng.below(9);
                            let leg = StripeLeg {
                                device: DeviceIndex(d),
                                phys_start: *c,
                            };
                            *c += leg_len;
                            leg
                        })
                        .collect();
                    segments.push(Segment {
                        vol_start,
                        len: leg_len * width,
                        stripe_unit,
                        legs,
                    });
                    vol_start += leg_len * width;
                }
                let sizes: Vec<u64> = cursor.iter().map(|c| c + rng.below(4096)).collect();
                let devs = devices(rng, &sizes);
                let kind = if rng.chance(1, 2) {
                    LayoutKind::Lvm {
                        vg_name: format!("vg{}", rng.below(100)),
                        lv_name: format!("lv_{}é", rng.below(100)),
                    }
                } else {
                    LayoutKind::Linear
                };
                Volume::from_segments(block_size, devs, segments, kind)
                    .expect("valid multi-segment volume")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::test_support::{Rng, volume as random_volume};
    use super::*;
    use crate::extent::ExtentState::{Unwritten, Written};
    use crate::volume::{DeviceId, Segment, VolumeDevice};
    use proptest::prelude::*;
    use uuid::Uuid;

    const KIB: u64 = 1024;
    const MIB: u64 = 1024 * KIB;

    fn devs(n: u32, size: u64) -> Vec<VolumeDevice> {
        (0..n)
            .map(|i| VolumeDevice {
                uuid: DeviceId::Sanfs(Uuid::from_u128(u128::from(i) + 1)),
                size_bytes: size,
            })
            .collect()
    }

    fn ext(file_block: u64, len_blocks: u64, vol_block: u64, state: ExtentState) -> Extent {
        Extent {
            file_block,
            vol_block,
            len_blocks,
            state,
        }
    }

    fn size(n: u64) -> String {
        if n > 0 && n.is_multiple_of(KIB) {
            format!("{}K", n / KIB)
        } else {
            n.to_string()
        }
    }

    /// `d0@1024K+256K[0+64K 128K+64K] ... zero[...]`.
    fn show(plan: &IoPlan) -> String {
        let bufs = |v: &[BufRange]| {
            v.iter()
                .map(|b| format!("{}+{}", size(b.buf_off), size(b.len)))
                .collect::<Vec<_>>()
                .join(" ")
        };
        let mut parts: Vec<String> = plan
            .device_ios
            .iter()
            .map(|io| {
                format!(
                    "{}@{}+{}[{}]",
                    io.device,
                    size(io.phys_off),
                    size(io.len),
                    bufs(&io.iov)
                )
            })
            .collect();
        if !plan.zero_fill.is_empty() {
            parts.push(format!("zero[{}]", bufs(&plan.zero_fill)));
        }
        parts.join(" ")
    }

    /// The paper's figure 5: two disks, a file of 8 stripe units laid out contiguously.
    /// Disk 1 holds units 1, 3, 5, 7 back to back, so method B reads them with one command.
    #[test]
    fn figure_5_contiguous_units_on_one_disk_become_one_io() {
        let v = Volume::striped(4096, devs(2, 2 * MIB), MIB, 64 * KIB).unwrap();
        let m = ExtentMap::from_extents(vec![ext(0, 128, 0, Written)]).unwrap();
        let p = plan(PlanOp::Read, 0, 512 * KIB, &m, &v, PlanMethod::Coalesced).unwrap();
        assert_eq!(
            show(&p),
            "d0@1024K+256K[0+64K 128K+64K 256K+64K 384K+64K] \
             d1@1024K+256K[64K+64K 192K+64K 320K+64K 448K+64K]"
        );
        let a = plan(
            PlanOp::Read,
            0,
            512 * KIB,
            &m,
            &v,
            PlanMethod::PerStripeUnit,
        )
        .unwrap();
        assert_eq!(a.device_ios.len(), 8);
        assert_eq!(
            show(&a).split(' ').next(),
            Some("d0@1024K+64K[0+64K]"),
            "{}",
            show(&a)
        );
        let grouped: Vec<(DeviceIndex, usize)> =
            a.by_device().map(|(d, ios)| (d, ios.len())).collect();
        assert_eq!(grouped, vec![(DeviceIndex(0), 4), (DeviceIndex(1), 4)]);
        assert!(p.is_aligned(4096));
    }

    /// Acceptance: 4 MiB over 4 legs with 64 KiB stripe units is 4 I/Os with method B and 64
    /// with method A.
    #[test]
    fn four_mib_over_four_legs_is_four_ios() {
        let v = Volume::striped(4096, devs(4, 4 * MIB), MIB, 64 * KIB).unwrap();
        let m = ExtentMap::from_extents(vec![ext(0, 1024, 0, Written)]).unwrap();
        let p = plan(PlanOp::Read, 0, 4 * MIB, &m, &v, PlanMethod::Coalesced).unwrap();
        assert_eq!(p.device_ios.len(), 4);
        for (i, io) in p.device_ios.iter().enumerate() {
            assert_eq!(
                (io.device, io.phys_off, io.len, io.iov.len()),
                (DeviceIndex(i as u32), MIB, MIB, 16)
            );
            assert_eq!(io.iov[1].buf_off - io.iov[0].buf_off, 256 * KIB);
        }
        let a = plan(PlanOp::Read, 0, 4 * MIB, &m, &v, PlanMethod::PerStripeUnit).unwrap();
        assert_eq!(a.device_ios.len(), 64);
        assert!(a.device_ios.iter().all(|io| io.len == 64 * KIB));
        let w = plan(PlanOp::Write, 0, 4 * MIB, &m, &v, PlanMethod::Coalesced).unwrap();
        assert_eq!(w.device_ios, p.device_ios);
    }

    /// Acceptance: 4 MiB read at an unaligned start across 3 legs, with an unwritten extent
    /// and a hole in it, is byte-exact against the model.
    #[test]
    fn unaligned_four_mib_read_over_three_legs_is_byte_exact() {
        let v = Volume::striped(4096, devs(3, 4 * MIB), 64 * KIB, 64 * KIB).unwrap();
        let map = ExtentMap::from_extents(vec![
            ext(0, 700, 0, Written),
            ext(700, 50, 700, Unwritten),
            ext(760, 300, 760, Written),
        ])
        .unwrap();
        let mut rng = Rng::new(7);
        let fx = Fixture::new(&mut rng, v, map);
        let offset = 3 * 4096 + 123;
        for method in [PlanMethod::Coalesced, PlanMethod::PerStripeUnit] {
            let p = plan(PlanOp::Read, offset, 4 * MIB, &fx.map, &fx.volume, method).unwrap();
            check_structure(&fx, &p, offset, 4 * MIB, method);
            assert_eq!(
                fx.execute_read(&p),
                fx.model_read(offset, 4 * MIB),
                "{method:?}"
            );
        }
    }

    #[test]
    fn holes_and_unwritten_extents() {
        let v = Volume::linear(4096, devs(1, 2 * MIB), MIB).unwrap();
        let m = ExtentMap::from_extents(vec![
            ext(1, 2, 10, Written),
            ext(3, 1, 12, Unwritten),
            ext(6, 1, 20, Written),
        ])
        .unwrap();
        let r = plan(PlanOp::Read, 100, 7 * 4096, &m, &v, PlanMethod::Coalesced).unwrap();
        assert_eq!(
            show(&r),
            "d0@1064K+8K[3996+8K] d0@1104K+4K[24476+4K] \
             zero[0+3996 12188+12K 28572+100]"
        );
        assert_eq!(r.device_bytes() + r.zero_fill_bytes(), r.len);
        assert!(!r.is_aligned(4096));
        // A write over the unwritten extent goes to the device; one over a hole is refused.
        let w = plan(PlanOp::Write, 4096, 12288, &m, &v, PlanMethod::Coalesced).unwrap();
        assert_eq!(show(&w), "d0@1064K+12K[0+12K]");
        assert_eq!(
            plan(
                PlanOp::Write,
                4096 + 5,
                4 * 4096,
                &m,
                &v,
                PlanMethod::Coalesced
            ),
            Err(PlanError::Unallocated {
                file_off: 4 * 4096,
                len: 4096 + 5
            })
        );
        assert_eq!(
            plan(PlanOp::Write, 0, 1, &m, &v, PlanMethod::Coalesced),
            Err(PlanError::Unallocated {
                file_off: 0,
                len: 1
            })
        );
    }

    #[test]
    fn bad_ranges_and_bad_maps_are_errors() {
        let v = Volume::linear(4096, devs(1, 2 * MIB), MIB).unwrap();
        let m = ExtentMap::from_extents(vec![ext(0, 4, 254, Written)]).unwrap();
        let p = |op, off, len, m: &ExtentMap| plan(op, off, len, m, &v, PlanMethod::Coalesced);
        assert_eq!(
            p(PlanOp::Read, u64::MAX, 2, &m),
            Err(PlanError::RangeOverflow {
                offset: u64::MAX,
                len: 2
            })
        );
        assert_eq!(
            p(PlanOp::Read, 0, MAX_PLAN_LEN + 1, &m),
            Err(PlanError::TooLong {
                len: MAX_PLAN_LEN + 1,
                max: MAX_PLAN_LEN
            })
        );
        assert_eq!(p(PlanOp::Read, 5, 0, &m), Ok(IoPlan::default()));
        // A range ending at 2^64 - 1 far past the data is all zeros.
        let far = p(PlanOp::Read, u64::MAX - MIB, MIB, &m).unwrap();
        assert_eq!(show(&far), "zero[0+1024K]");
        // Blocks 256 and 257 lie past the end of the 256-block volume.
        assert_eq!(
            p(PlanOp::Read, 0, 16384, &m),
            Err(PlanError::ExtentOutsideVolume {
                extent: ext(0, 4, 254, Written),
                volume_blocks: 256
            })
        );
        assert!(p(PlanOp::Read, 0, 4096, &m).is_ok());
        let huge = ExtentMap::from_extents(vec![ext(0, 1, u64::MAX / 2, Written)]).unwrap();
        assert!(matches!(
            p(PlanOp::Write, 0, 10, &huge),
            Err(PlanError::ExtentOutsideVolume { .. })
        ));
        // Two file blocks on one volume block: a corrupt map.
        let twice =
            ExtentMap::from_extents(vec![ext(0, 2, 10, Written), ext(5, 2, 11, Written)]).unwrap();
        assert_eq!(
            p(PlanOp::Read, 0, 7 * 4096, &twice),
            Err(PlanError::DoubleMapped {
                device: DeviceIndex(0),
                phys_off: MIB + 11 * 4096
            })
        );
    }

    // ---- Property tests against a brute-force model ----

    /// A volume, a file's extent map on it, and the bytes of every device.
    struct Fixture {
        volume: Volume,
        map: ExtentMap,
        /// Per file block: the volume block and state (from the generator, not the map).
        table: Vec<Option<(u64, ExtentState)>>,
        devices: Vec<Vec<u8>>,
    }

    /// Device and physical offset of volume byte `vol_byte`, computed the slow way.
    fn model_phys(volume: &Volume, vol_byte: u64) -> (usize, u64) {
        for seg in volume.segments() {
            if vol_byte < seg.vol_start || vol_byte >= seg.vol_start + seg.len {
                continue;
            }
            let rel = vol_byte - seg.vol_start;
            let width = seg.legs.len() as u64;
            let (leg, phys_rel) = if width == 1 {
                (seg.legs[0], rel)
            } else {
                let unit = rel / seg.stripe_unit;
                let leg = seg.legs[(unit % width) as usize];
                (
                    leg,
                    (unit / width) * seg.stripe_unit + rel % seg.stripe_unit,
                )
            };
            return (leg.device.as_usize(), leg.phys_start + phys_rel);
        }
        panic!("volume byte {vol_byte} is outside the volume");
    }

    impl Fixture {
        /// Fills the devices with random bytes (unwritten blocks thus hold garbage) and
        /// derives the table from the map.
        fn new(rng: &mut Rng, volume: Volume, map: ExtentMap) -> Fixture {
            let mut table = vec![None; map.end_block() as usize];
            for e in map.iter() {
                for i in 0..e.len_blocks {
                    table[(e.file_block + i) as usize] = Some((e.vol_block + i, e.state));
                }
            }
            Fixture::with_table(rng, volume, map, table)
        }

        fn with_table(
            rng: &mut Rng,
            volume: Volume,
            map: ExtentMap,
            table: Vec<Option<(u64, ExtentState)>>,
        ) -> Fixture {
            let devices = volume
                .devices()
                .iter()
                .map(|d| {
                    let mut bytes = vec![0u8; d.size_bytes as usize];
                    rng.fill(&mut bytes);
                    bytes
                })
                .collect();
            Fixture {
                volume,
                map,
                table,
                devices,
            }
        }

        fn bs(&self) -> u64 {
            u64::from(self.volume.block_size())
        }

        /// Calls `f(buf_pos, device, phys, n)` for every piece of `[offset, offset + len)` that
        /// is mapped (any state), block by block.
        fn for_each_mapped(&self, offset: u64, len: u64, mut f: impl FnMut(u64, usize, u64, u64)) {
            let bs = self.bs();
            let mut pos = offset;
            while pos < offset + len {
                let block = pos / bs;
                let n = ((block + 1) * bs).min(offset + len) - pos;
                if let Some(Some((vol, _))) = self.table.get(block as usize) {
                    let (dev, phys) = model_phys(&self.volume, vol * bs + pos % bs);
                    f(pos - offset, dev, phys, n);
                }
                pos += n;
            }
        }

        /// What a read of the range must return: written blocks from the devices, zeros
        /// elsewhere.
        fn model_read(&self, offset: u64, len: u64) -> Vec<u8> {
            let mut out = vec![0u8; len as usize];
            let bs = self.bs();
            self.for_each_mapped(offset, len, |at, dev, phys, n| {
                let block = (offset + at) / bs;
                if let Some(Some((_, Written))) = self.table.get(block as usize) {
                    out[at as usize..(at + n) as usize]
                        .copy_from_slice(&self.devices[dev][phys as usize..(phys + n) as usize]);
                }
            });
            out
        }

        /// The first hole in the range as `(file_off, len)`, as a write plan must report it.
        fn model_first_hole(&self, offset: u64, len: u64) -> Option<(u64, u64)> {
            let bs = self.bs();
            let unmapped = |pos: u64| !matches!(self.table.get((pos / bs) as usize), Some(Some(_)));
            let end = offset + len;
            let mut pos = offset;
            while pos < end && !unmapped(pos) {
                pos = ((pos / bs + 1) * bs).min(end);
            }
            if pos == end {
                return None;
            }
            let start = pos;
            while pos < end && unmapped(pos) {
                pos = ((pos / bs + 1) * bs).min(end);
            }
            Some((start, pos - start))
        }

        fn execute_read(&self, plan: &IoPlan) -> Vec<u8> {
            let mut buf = vec![0xEEu8; plan.len as usize];
            for io in &plan.device_ios {
                let dev = &self.devices[io.device.as_usize()];
                let mut phys = io.phys_off as usize;
                for b in &io.iov {
                    let (at, n) = (b.buf_off as usize, b.len as usize);
                    buf[at..at + n].copy_from_slice(&dev[phys..phys + n]);
                    phys += n;
                }
            }
            for z in &plan.zero_fill {
                buf[z.buf_off as usize..(z.buf_off + z.len) as usize].fill(0);
            }
            buf
        }

        fn execute_write(&self, plan: &IoPlan, data: &[u8]) -> Vec<Vec<u8>> {
            let mut devices = self.devices.clone();
            for io in &plan.device_ios {
                let dev = &mut devices[io.device.as_usize()];
                let mut phys = io.phys_off as usize;
                for b in &io.iov {
                    let (at, n) = (b.buf_off as usize, b.len as usize);
                    dev[phys..phys + n].copy_from_slice(&data[at..at + n]);
                    phys += n;
                }
            }
            devices
        }

        /// What the devices must hold after writing `data` at `offset`.
        fn model_write(&self, offset: u64, data: &[u8]) -> Vec<Vec<u8>> {
            let mut devices = self.devices.clone();
            self.for_each_mapped(offset, data.len() as u64, |at, dev, phys, n| {
                devices[dev][phys as usize..(phys + n) as usize]
                    .copy_from_slice(&data[at as usize..(at + n) as usize]);
            });
            devices
        }
    }

    /// The plan's shape: exact buffer cover, consistent lengths, sorted disjoint I/Os, and
    /// for each method what it promises.
    fn check_structure(fx: &Fixture, p: &IoPlan, offset: u64, len: u64, method: PlanMethod) {
        assert_eq!(p.len, len);
        let mut pieces: Vec<BufRange> = p.zero_fill.clone();
        for io in &p.device_ios {
            assert!(!io.iov.is_empty() && io.len > 0, "{io:?}");
            assert_eq!(io.iov.iter().map(|b| b.len).sum::<u64>(), io.len, "{io:?}");
            assert!(io.iov.iter().all(|b| b.len > 0));
            let dev = &fx.volume.devices()[io.device.as_usize()];
            assert!(io.phys_off + io.len <= dev.size_bytes);
            pieces.extend(&io.iov);
            match method {
                PlanMethod::Coalesced => {
                    for w in io.iov.windows(2) {
                        assert_ne!(w[0].buf_off + w[0].len, w[1].buf_off, "unmerged {io:?}");
                    }
                }
                PlanMethod::PerStripeUnit => {
                    assert_eq!(io.iov.len(), 1);
                    // The I/O stays inside one stripe unit of a striped segment.
                    let file_byte = offset + io.iov[0].buf_off;
                    let (vol, _) = fx.table[(file_byte / fx.bs()) as usize].unwrap();
                    let vol_byte = vol * fx.bs() + file_byte % fx.bs();
                    let seg: &Segment = fx
                        .volume
                        .segments()
                        .iter()
                        .find(|s| s.vol_start <= vol_byte && vol_byte < s.vol_start + s.len)
                        .unwrap();
                    if seg.legs.len() > 1 {
                        let within = (vol_byte - seg.vol_start) % seg.stripe_unit;
                        assert!(within + io.len <= seg.stripe_unit, "{io:?} crosses a unit");
                    }
                }
            }
        }
        for w in p.zero_fill.windows(2) {
            assert!(w[0].buf_off + w[0].len < w[1].buf_off, "zero fill unmerged");
        }
        pieces.sort_by_key(|b| b.buf_off);
        let mut pos = 0;
        for b in &pieces {
            assert_eq!(
                b.buf_off, pos,
                "buffer not covered exactly once: {pieces:?}"
            );
            pos += b.len;
        }
        assert_eq!(pos, len);
        for w in p.device_ios.windows(2) {
            let (a, b) = (&w[0], &w[1]);
            assert!((a.device, a.phys_off) < (b.device, b.phys_off), "unsorted");
            if a.device == b.device {
                match method {
                    PlanMethod::Coalesced => assert!(a.phys_off + a.len < b.phys_off),
                    PlanMethod::PerStripeUnit => assert!(a.phys_off + a.len <= b.phys_off),
                }
            }
        }
    }

    /// A random file on `volume`: chunks of volume blocks, mostly in order, some skipped, with
    /// holes between them and random states, inserted into the map in random order.
    fn random_file(rng: &mut Rng, volume: Volume) -> Fixture {
        let vol_blocks = volume.size_blocks();
        let max_chunk = [1, 4, 16, 64, vol_blocks][rng.below(5) as usize];
        let mut chunks = Vec::new();
        let mut b = 0;
        while b < vol_blocks {
            let len = rng.range(1, max_chunk.min(vol_blocks - b));
            chunks.push((b, len));
            b += len;
        }
        for i in 0..chunks.len() {
            if rng.chance(1, 4) {
                let j = rng.below(chunks.len() as u64) as usize;
                chunks.swap(i, j);
            }
        }
        let mut table: Vec<Option<(u64, ExtentState)>> = Vec::new();
        let mut extents = Vec::new();
        for (vol_block, len) in chunks {
            if rng.chance(1, 4) {
                continue;
            }
            if rng.chance(1, 5) {
                let hole = rng.range(1, 16);
                table.extend((0..hole).map(|_| None));
            }
            let split = if len > 1 && rng.chance(1, 5) {
                rng.range(1, len - 1)
            } else {
                len
            };
            for (lo, hi) in [(0, split), (split, len)] {
                if lo == hi {
                    continue;
                }
                let state = if rng.chance(7, 10) {
                    Written
                } else {
                    Unwritten
                };
                extents.push(ext(table.len() as u64, hi - lo, vol_block + lo, state));
                table.extend((lo..hi).map(|i| Some((vol_block + i, state))));
            }
        }
        rng.shuffle(&mut extents);
        let mut map = ExtentMap::new();
        for e in extents {
            assert_eq!(map.insert(e), Ok(vec![]));
        }
        Fixture::with_table(rng, volume, map, table)
    }

    /// A byte range: anywhere around the file, or (for writes) inside a mapped run.
    fn random_range(rng: &mut Rng, fx: &Fixture, inside_mapped: bool) -> (u64, u64) {
        let bs = fx.bs();
        let file_bytes = fx.table.len() as u64 * bs;
        let align = |rng: &mut Rng, v: u64| if rng.chance(1, 2) { v - v % bs } else { v };
        if inside_mapped {
            let mapped: Vec<u64> = (0..fx.table.len() as u64)
                .filter(|&b| fx.table[b as usize].is_some())
                .collect();
            if let Some(&first) = mapped.get(rng.below(mapped.len().max(1) as u64) as usize) {
                let mut last = first;
                while fx.table.get(last as usize + 1).is_some_and(Option::is_some) {
                    last += 1;
                }
                let r = first * bs + rng.below(bs);
                let lo = align(rng, r);
                let hi = ((last + 1) * bs - rng.below(bs)).max(lo + 1);
                let off = rng.range(lo, hi - 1);
                let len = rng.range(1, hi - off);
                return (off, len);
            }
        }
        let off = rng.below(file_bytes + 2 * bs);
        let off = align(rng, off);
        let len = rng.below(file_bytes.min(3 * MIB) + bs);
        let len = align(rng, len);
        (off, len)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Reads and writes of random ranges of random files on random volumes match a
        /// byte-level model of the devices.
        #[test]
        fn plans_match_a_byte_level_model(kind in 0u8..3, seed in any::<u64>()) {
            let mut rng = Rng::new(seed);
            let volume = random_volume(&mut rng, kind);
            let fx = random_file(&mut rng, volume);
            prop_assert_eq!(fx.map.check_invariants(), Ok(()));
            for _ in 0..6 {
                let (off, len) = random_range(&mut rng, &fx, false);
                let b = plan(PlanOp::Read, off, len, &fx.map, &fx.volume, PlanMethod::Coalesced)
                    .unwrap();
                let a = plan(PlanOp::Read, off, len, &fx.map, &fx.volume, PlanMethod::PerStripeUnit)
                    .unwrap();
                check_structure(&fx, &b, off, len, PlanMethod::Coalesced);
                check_structure(&fx, &a, off, len, PlanMethod::PerStripeUnit);
                prop_assert!(b.device_ios.len() <= a.device_ios.len());
                prop_assert_eq!(b.device_bytes(), a.device_bytes());
                let expected = fx.model_read(off, len);
                prop_assert!(fx.execute_read(&b) == expected, "coalesced read {}+{}", off, len);
                prop_assert!(fx.execute_read(&a) == expected, "per-unit read {}+{}", off, len);
            }
            for i in 0..4 {
                let (off, len) = random_range(&mut rng, &fx, i % 2 == 0);
                let method = if rng.chance(1, 2) {
                    PlanMethod::Coalesced
                } else {
                    PlanMethod::PerStripeUnit
                };
                let result = plan(PlanOp::Write, off, len, &fx.map, &fx.volume, method);
                match fx.model_first_hole(off, len) {
                    Some((file_off, len)) => {
                        prop_assert_eq!(result, Err(PlanError::Unallocated { file_off, len }));
                    }
                    None => {
                        let p = result.unwrap();
                        check_structure(&fx, &p, off, len, method);
                        prop_assert!(p.zero_fill.is_empty());
                        let mut data = vec![0u8; len as usize];
                        rng.fill(&mut data);
                        prop_assert!(
                            fx.execute_write(&p, &data) == fx.model_write(off, &data),
                            "write {}+{}", off, len
                        );
                    }
                }
            }
        }
    }

    /// The replay check's canonical form: one mapping gives the same runs whatever the I/O
    /// grouping (method A or B), and a sub-range of a grant gives the runs of the range.
    #[test]
    fn phys_runs_are_the_same_for_one_mapping_and_differ_for_another() {
        let v = Volume::striped(4096, devs(2, 4 * MIB), 2 * MIB, 64 * KIB).unwrap();
        let m = ExtentMap::from_extents(vec![ext(0, 64, 0, Unwritten)]).unwrap();
        let b = plan(PlanOp::Write, 0, 256 * KIB, &m, &v, PlanMethod::Coalesced).unwrap();
        let a = plan(
            PlanOp::Write,
            0,
            256 * KIB,
            &m,
            &v,
            PlanMethod::PerStripeUnit,
        )
        .unwrap();
        assert_ne!(a.device_ios.len(), b.device_ios.len());
        let runs = phys_runs(&b.device_ios);
        assert_eq!(runs, phys_runs(&a.device_ios));
        // Stripe units alternate between the legs: four runs of 64 KiB.
        assert_eq!(runs.len(), 4);
        assert_eq!(runs.iter().map(|r| r.len).sum::<u64>(), 256 * KIB);
        // The same file range on other volume blocks is another mapping.
        let moved = ExtentMap::from_extents(vec![ext(0, 64, 128, Unwritten)]).unwrap();
        let c = plan(
            PlanOp::Write,
            0,
            256 * KIB,
            &moved,
            &v,
            PlanMethod::Coalesced,
        )
        .unwrap();
        assert_ne!(phys_runs(&c.device_ios), runs);
        // Pieces given in any order and split anywhere merge back.
        let mut split: Vec<PhysRun> = runs
            .iter()
            .flat_map(|r| {
                let h = r.len / 2;
                [
                    PhysRun { len: h, ..*r },
                    PhysRun {
                        buf_off: r.buf_off + h,
                        phys_off: r.phys_off + h,
                        len: r.len - h,
                        ..*r
                    },
                ]
            })
            .collect();
        split.reverse();
        assert_eq!(merge_runs(split), runs);
    }
}
