//! From LVM2 metadata to a sanfs [`Volume`]: each `striped` LV segment becomes volume
//! segments whose legs start at `pe_start + first_pe * extent_size` on their PV, and
//! [`lv_map`] maps LV byte ranges to (PV UUID, physical byte) runs.
//!
//! The mapping is the kernel's `striped` target's: in a segment of `n` stripes with stripe
//! size `s`, LV byte `x` (relative to the segment) lies on stripe `(x / s) % n`, at
//! `(x / s / n) * s + x % s` from that stripe's start.
//!
//! lvm2 also lets a stripe hold a number of bytes that is not a multiple of the stripe size:
//! with an extent size that is not a power of two (`vgcreate -s 384k`) and a larger stripe size
//! (`-I 256k`), each stripe of a 6-extent, 2-stripe segment holds 4.5 stripe units. The
//! kernel's target refuses to activate such a segment ("Target length not divisible by chunk
//! size"), so no data was ever written through it; sanfs still uses every byte: the whole
//! rows are mapped exactly as above, and the remaining partial row is striped over the same
//! PVs with a stripe unit equal to the remainder (`1152 KiB = 4 x 256 KiB + 128 KiB` per
//! stripe gives a last row of 2 x 128 KiB). The mapping stays one-to-one onto the LV's
//! physical extents.

use std::collections::BTreeMap;

use super::LvmError;
use super::metadata::{LvMeta, PvMeta, SECTOR_BYTES, VgMetadata};
use crate::volume::{
    DeviceId, DeviceIndex, LayoutKind, LvmPvId, Segment, StripeLeg, Volume, VolumeDevice,
};

/// A run of LV bytes on one PV.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PvRun {
    /// LV byte offset where the run starts.
    pub vol_off: u64,
    pub pv: LvmPvId,
    /// Byte offset on the PV's device.
    pub phys_off: u64,
    pub len: u64,
}

impl VgMetadata {
    /// The volume of LV `lv_name`, over the PVs it uses (in order of first use), identified by
    /// PV UUID and sized by their `dev_size`. Refuses LVs that cannot be written directly:
    /// hidden (LVM-internal) LVs, LVs that other LVs build on (snapshot origins and COW
    /// stores, thin pool data, RAID images, ...), LVs with non-`striped` segments and LVs
    /// stacked on other LVs.
    pub fn lv_volume(&self, lv_name: &str, block_size: u32) -> Result<Volume, LvmError> {
        let lv = self
            .lv(lv_name)
            .ok_or_else(|| LvmError::NoSuchLv(lv_name.to_owned()))?;
        self.check_importable(lv)?;
        let invalid = |reason: String| LvmError::Metadata {
            path: format!("{}/logical_volumes/{}", self.name, lv.name),
            reason,
        };
        let extent_bytes = self.extent_size_bytes();
        let pvs: BTreeMap<&str, &PvMeta> = self.pvs.iter().map(|p| (p.name.as_str(), p)).collect();
        let mut device_index: BTreeMap<LvmPvId, u32> = BTreeMap::new();
        let mut devices: Vec<VolumeDevice> = Vec::new();
        let mut segments = Vec::new();
        for seg in &lv.segments {
            let bytes = |extents: u64| {
                extents.checked_mul(extent_bytes).ok_or_else(|| {
                    invalid(format!(
                        "{}: extent {extents} lies past 2^64 bytes",
                        seg.name
                    ))
                })
            };
            let vol_start = bytes(seg.start_extent)?;
            let len = bytes(seg.extent_count)?;
            let width = seg.stripes.len() as u64;
            // parse_vg_metadata checked that the stripes share the extents evenly.
            let area_extents = seg.extent_count / width.max(1);
            let mut legs = Vec::with_capacity(seg.stripes.len());
            for (stripe, (area, first_pe)) in seg.stripes.iter().enumerate() {
                let Some(&pv) = pvs.get(area.as_str()) else {
                    return Err(LvmError::StackedLv {
                        lv: lv.name.clone(),
                        segment: seg.name.clone(),
                        stripe,
                        on_lv: area.clone(),
                    });
                };
                let end_pe = first_pe.checked_add(area_extents);
                if end_pe.is_none_or(|end| end > pv.pe_count) {
                    return Err(invalid(format!(
                        "{} stripe {stripe}: extents {first_pe}+{area_extents} run past the {} extents of {}",
                        seg.name, pv.pe_count, pv.name
                    )));
                }
                // parse_vg_metadata checked that pe_start + pe_count extents fit in bytes.
                let phys_start =
                    (pv.pe_start_sectors + first_pe * self.extent_size_sectors) * SECTOR_BYTES;
                let index = match device_index.get(&pv.id) {
                    Some(&i) => i,
                    None => {
                        let i = u32::try_from(devices.len())
                            .map_err(|_| invalid("uses more than 2^32 PVs".into()))?;
                        devices.push(VolumeDevice {
                            uuid: DeviceId::LvmPv(pv.id),
                            size_bytes: pv
                                .size_bytes(self.extent_size_sectors)
                                .ok_or_else(|| invalid(format!("{} size overflows", pv.name)))?,
                        });
                        device_index.insert(pv.id, i);
                        i
                    }
                };
                legs.push(StripeLeg {
                    device: DeviceIndex(index),
                    phys_start,
                });
            }
            if legs.len() == 1 {
                segments.push(Segment {
                    vol_start,
                    len,
                    stripe_unit: u64::from(block_size),
                    legs,
                });
                continue;
            }
            // Whole rows of stripe units, then the partial row (see the module doc).
            let stripe_unit = seg.stripe_size_sectors * SECTOR_BYTES;
            let leg_len = len / width;
            let rows = leg_len / stripe_unit;
            let rest = leg_len % stripe_unit;
            if rows > 0 {
                segments.push(Segment {
                    vol_start,
                    len: rows * stripe_unit * width,
                    stripe_unit,
                    legs: legs.clone(),
                });
            }
            if rest > 0 {
                segments.push(Segment {
                    vol_start: vol_start + rows * stripe_unit * width,
                    len: rest * width,
                    stripe_unit: rest,
                    legs: legs
                        .iter()
                        .map(|l| StripeLeg {
                            device: l.device,
                            phys_start: l.phys_start + rows * stripe_unit,
                        })
                        .collect(),
                });
            }
        }
        Volume::from_segments(
            block_size,
            devices,
            segments,
            LayoutKind::Lvm {
                vg_name: self.name.clone(),
                lv_name: lv.name.clone(),
            },
        )
        .map_err(|source| LvmError::Volume {
            lv: lv.name.clone(),
            source,
        })
    }

    /// Why `lv` cannot be written directly, if it cannot.
    fn check_importable(&self, lv: &LvMeta) -> Result<(), LvmError> {
        for user in &self.lvs {
            for seg in &user.segments {
                let uses = seg.uses_lvs.contains(&lv.name)
                    || seg.stripes.iter().any(|(area, _)| *area == lv.name);
                if uses {
                    return Err(LvmError::UsedByOtherLv {
                        lv: lv.name.clone(),
                        user_lv: user.name.clone(),
                        segment: seg.name.clone(),
                        segtype: seg.segtype.clone(),
                    });
                }
            }
        }
        if let Some(seg) = lv.segments.iter().find(|s| !s.is_striped()) {
            return Err(LvmError::UnsupportedSegmentType {
                lv: lv.name.clone(),
                segment: seg.name.clone(),
                segtype: seg.segtype.clone(),
            });
        }
        if !lv.visible() {
            return Err(LvmError::HiddenLv {
                lv: lv.name.clone(),
            });
        }
        Ok(())
    }
}

/// Maps the LV byte range `[offset, offset + len)` of a volume built by
/// [`VgMetadata::lv_volume`] to runs on its PVs, in LV order, merging neighbours that are
/// contiguous on the same PV.
pub fn lv_map(volume: &Volume, offset: u64, len: u64) -> Result<Vec<PvRun>, LvmError> {
    let lv_name = match volume.kind() {
        LayoutKind::Lvm { lv_name, .. } => lv_name.clone(),
        _ => String::new(),
    };
    let mut pv_ids = Vec::with_capacity(volume.devices().len());
    for (i, d) in volume.devices().iter().enumerate() {
        match d.uuid {
            DeviceId::LvmPv(id) => pv_ids.push(id),
            other => {
                return Err(LvmError::NotLvmDevice {
                    index: DeviceIndex(i as u32),
                    device: other,
                });
            }
        }
    }
    let mut runs: Vec<PvRun> = Vec::new();
    volume
        .map_with(offset, len, |run| {
            // map_with only yields devices of the volume.
            let pv = pv_ids[run.device.as_usize()];
            if let Some(last) = runs.last_mut()
                && last.pv == pv
                && last.phys_off + last.len == run.phys_off
            {
                last.len += run.len;
                return;
            }
            runs.push(PvRun {
                vol_off: run.vol_off,
                pv,
                phys_off: run.phys_off,
                len: run.len,
            });
        })
        .map_err(|source| LvmError::Volume {
            lv: lv_name,
            source,
        })?;
    Ok(runs)
}

#[cfg(test)]
mod tests {
    use super::super::metadata::parse_vg_metadata;
    use super::super::metadata::tests::{BACKUP, SAMPLE};
    use super::*;
    use crate::volume::VolumeError;

    const KIB: u64 = 1024;
    const MIB: u64 = 1024 * KIB;

    fn sample() -> VgMetadata {
        parse_vg_metadata(SAMPLE.as_bytes()).unwrap()
    }

    fn pv(vg: &VgMetadata, name: &str) -> LvmPvId {
        vg.pv(name).unwrap().id
    }

    /// The kernel striped target's formula, written independently of Volume: LV byte `x` of
    /// a segment starting at `seg_start` with legs `(pv, phys_start)`.
    fn dm_striped(x: u64, seg_start: u64, stripe: u64, legs: &[(LvmPvId, u64)]) -> (LvmPvId, u64) {
        let rel = x - seg_start;
        if legs.len() == 1 {
            return (legs[0].0, legs[0].1 + rel);
        }
        let chunk = rel / stripe;
        let n = legs.len() as u64;
        let (pv, start) = legs[(chunk % n) as usize];
        (pv, start + (chunk / n) * stripe + rel % stripe)
    }

    #[test]
    fn two_segment_lv_from_vgcfgbackup_maps_like_dm_striped() {
        let vg = parse_vg_metadata(BACKUP).unwrap();
        let v = vg.lv_volume("lv0", 4096).unwrap();
        assert_eq!(v.size_bytes(), 8 * 4 * MIB);
        assert_eq!(
            v.kind(),
            &LayoutKind::Lvm {
                vg_name: "sanfs_x1".into(),
                lv_name: "lv0".into()
            }
        );
        let (p0, p1) = (pv(&vg, "pv0"), pv(&vg, "pv1"));
        assert_eq!(
            v.devices(),
            &[
                VolumeDevice {
                    uuid: DeviceId::LvmPv(p0),
                    size_bytes: 64 * MIB
                },
                VolumeDevice {
                    uuid: DeviceId::LvmPv(p1),
                    size_bytes: 64 * MIB
                }
            ]
        );
        // Segment 1: 24 MiB over pv0:0-2 and pv1:0-2 in 64 KiB units, PEs from 1 MiB on.
        // Segment 2: 8 MiB linear at pv0 extent 3.
        let seg1 = [(p0, MIB), (p1, MIB)];
        let seg2 = [(p0, MIB + 3 * 4 * MIB)];
        for x in (0..v.size_bytes()).step_by(4096 * 7 + 512) {
            let expect = if x < 24 * MIB {
                dm_striped(x, 0, 64 * KIB, &seg1)
            } else {
                dm_striped(x, 24 * MIB, 0, &seg2)
            };
            let runs = lv_map(&v, x, 1).unwrap();
            assert_eq!(runs.len(), 1);
            assert_eq!((runs[0].pv, runs[0].phys_off), expect, "LV byte {x}");
        }
        // A range across the segment boundary: the last 64 KiB unit of segment 1 is on pv1
        // (24 MiB / 64 KiB = 384 units, the last one odd), then segment 2 on pv0.
        let runs = lv_map(&v, 24 * MIB - 64 * KIB, 192 * KIB).unwrap();
        assert_eq!(
            runs,
            vec![
                PvRun {
                    vol_off: 24 * MIB - 64 * KIB,
                    pv: p1,
                    phys_off: MIB + 12 * MIB - 64 * KIB,
                    len: 64 * KIB
                },
                PvRun {
                    vol_off: 24 * MIB,
                    pv: p0,
                    phys_off: MIB + 12 * MIB,
                    len: 128 * KIB
                },
            ]
        );
    }

    #[test]
    fn three_stripes_with_different_pe_starts() {
        let vg = sample();
        let v = vg.lv_volume("data", 4096).unwrap();
        assert_eq!(v.devices().len(), 3);
        let (p0, p1, p2) = (pv(&vg, "pv0"), pv(&vg, "pv1"), pv(&vg, "pv2"));
        // pv2's PEs start at 384 sectors and the stripe starts at its PE 10.
        let legs = [(p0, MIB), (p1, MIB), (p2, 384 * 512 + 40 * MIB)];
        let runs = lv_map(&v, 0, 6 * 64 * KIB).unwrap();
        let got: Vec<(LvmPvId, u64, u64)> =
            runs.iter().map(|r| (r.pv, r.phys_off, r.len)).collect();
        assert_eq!(
            got,
            vec![
                (p0, MIB, 64 * KIB),
                (p1, MIB, 64 * KIB),
                (legs[2].0, legs[2].1, 64 * KIB),
                (p0, MIB + 64 * KIB, 64 * KIB),
                (p1, MIB + 64 * KIB, 64 * KIB),
                (legs[2].0, legs[2].1 + 64 * KIB, 64 * KIB),
            ]
        );
        for x in [0, 1, 64 * KIB - 1, 64 * KIB, 200 * KIB + 17, 120 * MIB - 1] {
            let r = lv_map(&v, x, 1).unwrap();
            assert_eq!((r[0].pv, r[0].phys_off), dm_striped(x, 0, 64 * KIB, &legs));
        }
        // Segment 2 is linear on pv1 from its extent 10, right after the LV's 120 MiB.
        let r = lv_map(&v, 120 * MIB, 20 * MIB).unwrap();
        assert_eq!(
            r,
            vec![PvRun {
                vol_off: 120 * MIB,
                pv: p1,
                phys_off: MIB + 40 * MIB,
                len: 20 * MIB
            }]
        );
        assert!(matches!(
            lv_map(&v, 140 * MIB, 1),
            Err(LvmError::Volume {
                source: VolumeError::OutOfRange { .. },
                ..
            })
        ));
    }

    #[test]
    fn adjacent_linear_segments_merge_into_one_run() {
        // Two linear segments that are contiguous on pv0.
        let text = SAMPLE
            .replacen("stripe_count = 3\nstripe_size = 128", "stripe_count = 1", 1)
            .replacen("\"pv0\", 0,\n\"pv1\", 0,\n\"pv2\", 10", "\"pv0\", 0", 1)
            .replacen("\"pv1\", 10", "\"pv0\", 30", 1);
        let vg = parse_vg_metadata(text.as_bytes()).unwrap();
        let v = vg.lv_volume("data", 4096).unwrap();
        assert_eq!(v.segments().len(), 2);
        let runs = lv_map(&v, 0, v.size_bytes()).unwrap();
        assert_eq!(
            runs,
            vec![PvRun {
                vol_off: 0,
                pv: pv(&vg, "pv0"),
                phys_off: MIB,
                len: 35 * 4 * MIB
            }]
        );
    }

    #[test]
    fn partial_last_row_is_striped_with_the_remainder() {
        // 384 KiB extents (768 sectors), 256 KiB stripes, 6 extents over 2 stripes: each
        // stripe holds 1152 KiB = 4 whole units + 128 KiB, as lvm2 creates it.
        let text = SAMPLE
            .replacen("extent_size = 8192", "extent_size = 768", 1)
            .replacen("extent_count = 30", "extent_count = 6", 1)
            .replacen(
                "stripe_count = 3\nstripe_size = 128",
                "stripe_count = 2\nstripe_size = 512",
                1,
            )
            .replacen(
                "\"pv0\", 0,\n\"pv1\", 0,\n\"pv2\", 10",
                "\"pv0\", 0,\n\"pv1\", 0",
                1,
            )
            .replacen("segment_count = 2", "segment_count = 1", 1);
        let text = {
            // Drop segment2 of "data".
            let start = text.find("segment2 {").unwrap();
            let end = start + text[start..].find("}\n").unwrap() + 2;
            format!("{}{}", &text[..start], &text[end..])
        };
        let vg = parse_vg_metadata(text.as_bytes()).unwrap();
        let v = vg.lv_volume("data", 4096).unwrap();
        assert_eq!(v.size_bytes(), 6 * 384 * KIB);
        let segs: Vec<(u64, u64, u64)> = v
            .segments()
            .iter()
            .map(|s| (s.vol_start / KIB, s.len / KIB, s.stripe_unit / KIB))
            .collect();
        assert_eq!(segs, vec![(0, 2048, 256), (2048, 256, 128)]);
        let (p0, p1) = (pv(&vg, "pv0"), pv(&vg, "pv1"));
        // The whole rows map as dm-striped would.
        let legs = [(p0, MIB), (p1, MIB)];
        for x in (0..2048 * KIB).step_by(61 * KIB as usize) {
            let r = lv_map(&v, x, 1).unwrap();
            assert_eq!((r[0].pv, r[0].phys_off), dm_striped(x, 0, 256 * KIB, &legs));
        }
        // The last row: 128 KiB on each PV, right after its 4 whole units.
        let tail = lv_map(&v, 2048 * KIB, 256 * KIB).unwrap();
        let got: Vec<(LvmPvId, u64, u64)> =
            tail.iter().map(|r| (r.pv, r.phys_off, r.len)).collect();
        assert_eq!(
            got,
            vec![
                (p0, MIB + 1024 * KIB, 128 * KIB),
                (p1, MIB + 1024 * KIB, 128 * KIB)
            ]
        );
        // Every physical byte of the two stripes is used exactly once.
        let mut all: Vec<(LvmPvId, u64, u64)> = lv_map(&v, 0, v.size_bytes())
            .unwrap()
            .iter()
            .map(|r| (r.pv, r.phys_off, r.len))
            .collect();
        all.sort();
        let mut covered = std::collections::BTreeMap::new();
        for (pv, off, len) in all {
            let end = covered.entry(pv).or_insert(MIB);
            assert_eq!(off, *end, "gap or overlap on {pv}");
            *end = off + len;
        }
        assert!(covered.values().all(|&end| end == MIB + 1152 * KIB));
    }

    #[test]
    fn lvs_that_cannot_be_written_directly_are_refused_by_name() {
        let vg = sample();
        assert_eq!(
            vg.lv_volume("nope", 4096),
            Err(LvmError::NoSuchLv("nope".into()))
        );
        assert_eq!(
            vg.lv_volume("snapshot0", 4096),
            Err(LvmError::UnsupportedSegmentType {
                lv: "snapshot0".into(),
                segment: "segment1".into(),
                segtype: "snapshot".into()
            })
        );
        assert_eq!(
            vg.lv_volume("pool", 4096),
            Err(LvmError::UnsupportedSegmentType {
                lv: "pool".into(),
                segment: "segment1".into(),
                segtype: "thin-pool".into()
            })
        );
        for (lv, user) in [
            ("origin", "snapshot0"),
            ("cow", "snapshot0"),
            ("pool_tdata", "pool"),
            ("pool_tmeta", "pool"),
        ] {
            match vg.lv_volume(lv, 4096) {
                Err(LvmError::UsedByOtherLv { user_lv, .. }) => assert_eq!(user_lv, user),
                other => panic!("{lv}: {other:?}"),
            }
        }
        // A hidden LV that nothing uses (like lvm2's pool metadata spare).
        let text = SAMPLE.replacen("metadata = \"pool_tmeta\"\n", "", 1);
        let vg = parse_vg_metadata(text.as_bytes()).unwrap();
        assert_eq!(
            vg.lv_volume("pool_tmeta", 4096),
            Err(LvmError::HiddenLv {
                lv: "pool_tmeta".into()
            })
        );
        // An LV whose stripe lies on another LV, and that other LV.
        let text = SAMPLE.replacen("\"pv1\", 10", "\"cow\", 0", 1);
        let vg = parse_vg_metadata(text.as_bytes()).unwrap();
        assert_eq!(
            vg.lv_volume("data", 4096),
            Err(LvmError::StackedLv {
                lv: "data".into(),
                segment: "segment2".into(),
                stripe: 0,
                on_lv: "cow".into()
            })
        );
    }

    #[test]
    fn layouts_that_do_not_fit_are_refused() {
        // A stripe running past its PV's extents.
        let text = SAMPLE.replacen("\"pv2\", 10", "\"pv2\", 250", 1);
        let vg = parse_vg_metadata(text.as_bytes()).unwrap();
        match vg.lv_volume("data", 4096) {
            Err(LvmError::Metadata { reason, .. }) => {
                assert!(
                    reason.contains("run past the 255 extents of pv2"),
                    "{reason}"
                )
            }
            other => panic!("{other:?}"),
        }
        // Two LV segments on the same physical extents.
        let text = SAMPLE.replacen("\"pv1\", 10", "\"pv1\", 5", 1);
        let vg = parse_vg_metadata(text.as_bytes()).unwrap();
        assert!(matches!(
            vg.lv_volume("data", 4096),
            Err(LvmError::Volume {
                source: VolumeError::BadSegment { .. },
                ..
            })
        ));
        // A stripe size below the block size.
        let vg = sample();
        assert!(matches!(
            vg.lv_volume("data", 65536 * 2),
            Err(LvmError::Volume {
                source: VolumeError::BadBlockSize(_),
                ..
            })
        ));
        let text = SAMPLE.replacen("stripe_size = 128", "stripe_size = 8", 1);
        let vg = parse_vg_metadata(text.as_bytes()).unwrap();
        assert!(matches!(
            vg.lv_volume("data", 8192),
            Err(LvmError::Volume {
                source: VolumeError::BadSegment { .. },
                ..
            })
        ));
        // A PV whose recorded device size cannot hold its extents.
        let text = SAMPLE.replacen(
            "dev_size = 2097152\npe_start = 384",
            "dev_size = 4096\npe_start = 384",
            1,
        );
        let vg = parse_vg_metadata(text.as_bytes()).unwrap();
        assert!(matches!(
            vg.lv_volume("data", 4096),
            Err(LvmError::Volume {
                source: VolumeError::BadSegment { .. },
                ..
            })
        ));
    }

    #[test]
    fn lv_map_refuses_volumes_of_other_devices() {
        let v = Volume::linear(
            4096,
            vec![VolumeDevice {
                uuid: DeviceId::Sanfs(uuid::Uuid::from_u128(1)),
                size_bytes: 4 * MIB,
            }],
            0,
        )
        .unwrap();
        assert!(matches!(
            lv_map(&v, 0, 1),
            Err(LvmError::NotLvmDevice { .. })
        ));
    }
}
