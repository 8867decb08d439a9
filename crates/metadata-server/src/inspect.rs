//! `sanfs-mds volume inspect DEVICE... [--map OFFSET] [--lv NAME]`: say what is on each
//! device (a sanfs label, an LVM2 PV with its volume group's logical volumes and segments,
//! another file system's signature, or nothing recognised), and with `--map` where a volume
//! byte offset lands: device index, device UUID, path and physical offset.
//!
//! The volume for `--map` is rebuilt from what the devices hold, exactly as an agent would:
//! from the sanfs labels of one file system (every device index present), or from the VG
//! metadata on the PVs for one LV. Nothing is written.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use sanfs_blockmap::label::{self, DeviceLabel, LabelLayout, Signature};
use sanfs_blockmap::lvm::VgMetadata;
use sanfs_blockmap::volume::{DeviceId, LvmPvId, Volume, VolumeDevice};
use uuid::Uuid;

use crate::device::Lun;
use crate::format::{LvmPv, read_lvm_pv};

/// Block size used to rebuild an LVM volume for `--map` (the mapping does not depend on it).
const LVM_MAP_BLOCK_SIZE: u32 = 512;

/// [`inspect_with`] without `--lv`.
pub fn inspect(devices: &[PathBuf], map: Option<u64>, out: &mut impl Write) -> anyhow::Result<()> {
    inspect_with(devices, map, None, out)
}

/// What was found on one device.
enum Found {
    Sanfs(DeviceLabel),
    Lvm(Box<LvmPv>),
    Other(Vec<Signature>),
}

/// Prints what is on each device; with `map`, where that volume byte offset lands (the LV
/// named `lv`, or the only LV, for LVM).
pub fn inspect_with(
    devices: &[PathBuf],
    map: Option<u64>,
    lv: Option<&str>,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    if devices.is_empty() {
        bail!("no devices to inspect");
    }
    let mut found = Vec::with_capacity(devices.len());
    for path in devices {
        let lun = Lun::open(path, false)?;
        let head = lun.read_prefix(label::PROBE_SIZE)?;
        let signatures = label::probe(&head);
        writeln!(out, "{}: {} bytes", path.display(), lun.size_bytes())?;
        let item = if let Some(Signature::Sanfs(l)) =
            signatures.iter().find(|s| matches!(s, Signature::Sanfs(_)))
        {
            print_label(l, out)?;
            Found::Sanfs(l.clone())
        } else if signatures.contains(&Signature::LvmPv) {
            match read_lvm_pv(&lun) {
                Ok(pv) => {
                    print_pv(&pv, out)?;
                    Found::Lvm(Box::new(pv))
                }
                Err(e) => {
                    writeln!(out, "  LVM2 PV label, unreadable: {e:#}")?;
                    Found::Other(signatures)
                }
            }
        } else {
            Found::Other(signatures)
        };
        if let Found::Other(signatures) = &item {
            if signatures.is_empty() {
                writeln!(out, "  nothing recognised")?;
            }
            for s in signatures {
                writeln!(out, "  {s}")?;
            }
        }
        found.push((path.clone(), item));
    }

    let pvs: Vec<(PathBuf, LvmPv)> = found
        .iter()
        .filter_map(|(p, f)| match f {
            Found::Lvm(pv) => Some((p.clone(), (**pv).clone())),
            _ => None,
        })
        .collect();
    let vgs = newest_vgs(&pvs);
    let pv_paths: BTreeMap<LvmPvId, &Path> = pvs
        .iter()
        .map(|(p, pv)| (pv.label.pv_id, p.as_path()))
        .collect();
    for meta in vgs.values() {
        print_vg(meta, &pv_paths, out)?;
    }

    let Some(offset) = map else {
        return Ok(());
    };
    let labels: Vec<(&Path, &DeviceLabel)> = found
        .iter()
        .filter_map(|(p, f)| match f {
            Found::Sanfs(l) => Some((p.as_path(), l)),
            _ => None,
        })
        .collect();
    let (volume, paths, what) = if !labels.is_empty() {
        let (volume, paths) = volume_from_labels(&labels)?;
        let fs = labels[0].1.fs_uuid;
        (volume, paths, format!("fs {fs}"))
    } else if !vgs.is_empty() {
        if vgs.len() > 1 {
            let names: Vec<&String> = vgs.keys().collect();
            bail!("the devices hold more than one volume group: {names:?}");
        }
        let Some(meta) = vgs.values().next() else {
            bail!("no volume group");
        };
        let lv_name = match lv {
            Some(lv) => lv.to_owned(),
            None => {
                let visible: Vec<&str> = meta
                    .lvs
                    .iter()
                    .filter(|l| l.visible())
                    .map(|l| l.name.as_str())
                    .collect();
                match visible.as_slice() {
                    [one] => (*one).to_owned(),
                    [] => bail!("volume group {} has no logical volumes", meta.name),
                    many => bail!(
                        "volume group {} has several logical volumes ({}); choose one with --lv",
                        meta.name,
                        many.join(", ")
                    ),
                }
            }
        };
        let volume = meta
            .lv_volume(&lv_name, LVM_MAP_BLOCK_SIZE)
            .with_context(|| format!("logical volume {}/{lv_name}", meta.name))?;
        let paths = volume
            .devices()
            .iter()
            .map(|d| match d.uuid {
                DeviceId::LvmPv(id) => pv_paths.get(&id).map(|p| p.to_path_buf()),
                DeviceId::Sanfs(_) => None,
            })
            .collect();
        (volume, paths, format!("LV {}/{lv_name}", meta.name))
    } else {
        bail!("--map: no sanfs label or LVM2 PV on the devices, so there is no volume to map");
    };
    print_map(&volume, &paths, &what, offset, out)
}

fn print_label(l: &DeviceLabel, out: &mut impl Write) -> std::io::Result<()> {
    writeln!(out, "  sanfs label")?;
    writeln!(out, "    fs uuid:      {}", l.fs_uuid)?;
    writeln!(out, "    device uuid:  {}", l.device_uuid)?;
    writeln!(
        out,
        "    device:       {} of {}",
        l.device_index, l.device_count
    )?;
    writeln!(out, "    device size:  {}", l.device_size)?;
    writeln!(out, "    data offset:  {}", l.data_offset)?;
    writeln!(out, "    block size:   {}", l.block_size)?;
    match l.layout {
        LabelLayout::Linear => writeln!(out, "    layout:       linear")?,
        LabelLayout::Striped { stripe_unit } => {
            writeln!(out, "    layout:       striped, stripe unit {stripe_unit}")?
        }
    }
    writeln!(out, "    formatted at: {} (unix seconds)", l.formatted_at)
}

fn print_pv(pv: &LvmPv, out: &mut impl Write) -> std::io::Result<()> {
    let l = &pv.label;
    writeln!(out, "  LVM2 physical volume")?;
    writeln!(out, "    pv uuid:      {}", l.pv_id)?;
    writeln!(out, "    device size:  {}", l.device_size_bytes)?;
    if let Some(area) = l.data_areas.first() {
        writeln!(out, "    pe_start:     {}", area.offset)?;
    }
    writeln!(out, "    metadata areas: {}", l.metadata_areas.len())?;
    if let Some(meta) = &pv.metadata {
        writeln!(
            out,
            "    vg:           {} (seqno {})",
            meta.name, meta.seqno
        )?;
        writeln!(out, "    extent size:  {}", meta.extent_size_bytes())?;
        if let Some(p) = meta.pv_by_id(&l.pv_id) {
            writeln!(out, "    pv name:      {} ({} extents)", p.name, p.pe_count)?;
        }
    }
    for problem in &pv.metadata_problems {
        writeln!(out, "    {problem}")?;
    }
    Ok(())
}

/// The newest metadata of each VG found on the PVs, by VG name.
fn newest_vgs(pvs: &[(PathBuf, LvmPv)]) -> BTreeMap<String, VgMetadata> {
    let mut vgs: BTreeMap<String, VgMetadata> = BTreeMap::new();
    for (_, pv) in pvs {
        if let Some(meta) = &pv.metadata {
            let newer = vgs.get(&meta.name).is_none_or(|m| meta.seqno > m.seqno);
            if newer {
                vgs.insert(meta.name.clone(), meta.clone());
            }
        }
    }
    vgs
}

/// The VG and its LVs' segments, like `lvs --segments -o+seg_pe_ranges` (sizes in bytes).
fn print_vg(
    meta: &VgMetadata,
    pv_paths: &BTreeMap<LvmPvId, &Path>,
    out: &mut impl Write,
) -> std::io::Result<()> {
    let extent = meta.extent_size_bytes();
    writeln!(
        out,
        "volume group {} (seqno {}, extent size {extent}, {} PVs, {} LVs)",
        meta.name,
        meta.seqno,
        meta.pvs.len(),
        meta.lvs.len()
    )?;
    for pv in &meta.pvs {
        let path = pv_paths
            .get(&pv.id)
            .map(|p| p.display().to_string())
            .or_else(|| {
                pv.device_hint
                    .as_ref()
                    .map(|h| format!("{h} (not inspected)"))
            })
            .unwrap_or_else(|| "(not inspected)".into());
        writeln!(
            out,
            "  {} {} {path} pe_start {} pe_count {}",
            pv.name,
            pv.id,
            pv.pe_start_sectors * 512,
            pv.pe_count
        )?;
    }
    writeln!(
        out,
        "  {:<16} {:>14} {:>14} {:<8} {:>4} {:>10}  pe_ranges",
        "lv", "start", "size", "type", "#str", "stripe"
    )?;
    for lv in &meta.lvs {
        for seg in &lv.segments {
            let ranges: Vec<String> = seg
                .stripes
                .iter()
                .map(|(area, first)| {
                    let per = seg.extent_count / (seg.stripes.len() as u64).max(1);
                    let name = meta
                        .pv(area)
                        .and_then(|p| pv_paths.get(&p.id))
                        .map_or_else(|| area.clone(), |p| p.display().to_string());
                    format!("{name}:{first}-{}", (first + per).saturating_sub(1))
                })
                .collect();
            writeln!(
                out,
                "  {:<16} {:>14} {:>14} {:<8} {:>4} {:>10}  {}",
                lv.name,
                seg.start_extent * extent,
                seg.extent_count * extent,
                seg.segtype,
                seg.stripes.len(),
                seg.stripe_size_sectors * 512,
                ranges.join(" ")
            )?;
        }
    }
    Ok(())
}

/// Rebuilds the volume of one file system from its labels; `paths[i]` is device `i`'s path.
pub fn volume_from_labels(
    labels: &[(&Path, &DeviceLabel)],
) -> anyhow::Result<(Volume, Vec<Option<PathBuf>>)> {
    let Some((first_path, first)) = labels.first() else {
        bail!("no sanfs labels");
    };
    let fs: Vec<Uuid> = {
        let mut v: Vec<Uuid> = labels.iter().map(|(_, l)| l.fs_uuid).collect();
        v.sort();
        v.dedup();
        v
    };
    if fs.len() > 1 {
        bail!(
            "the devices belong to {} file systems ({}); inspect one at a time for --map",
            fs.len(),
            fs.iter()
                .map(Uuid::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    let count = first.device_count as usize;
    let mut by_index: Vec<Option<(&Path, &DeviceLabel)>> = vec![None; count];
    for &(path, l) in labels {
        let same_geometry = l.device_count == first.device_count
            && l.block_size == first.block_size
            && l.data_offset == first.data_offset
            && l.layout == first.layout;
        if !same_geometry {
            bail!(
                "{} and {} disagree about the volume geometry",
                first_path.display(),
                path.display()
            );
        }
        let slot = by_index
            .get_mut(l.device_index as usize)
            .context("device index out of range")?;
        if let Some((other, _)) = slot {
            bail!(
                "{} and {} both claim device index {}",
                other.display(),
                path.display(),
                l.device_index
            );
        }
        *slot = Some((path, l));
    }
    let missing: Vec<String> = by_index
        .iter()
        .enumerate()
        .filter(|(_, s)| s.is_none())
        .map(|(i, _)| i.to_string())
        .collect();
    if !missing.is_empty() {
        bail!(
            "fs {}: device(s) {} of {count} missing; name every device of the file system",
            first.fs_uuid,
            missing.join(", ")
        );
    }
    let present: Vec<(&Path, &DeviceLabel)> = by_index.into_iter().flatten().collect();
    let devices: Vec<VolumeDevice> = present
        .iter()
        .map(|(_, l)| VolumeDevice {
            uuid: DeviceId::Sanfs(l.device_uuid),
            size_bytes: l.device_size,
        })
        .collect();
    let volume = match first.layout {
        LabelLayout::Linear => Volume::linear(first.block_size, devices, first.data_offset),
        LabelLayout::Striped { stripe_unit } => {
            Volume::striped(first.block_size, devices, first.data_offset, stripe_unit)
        }
    }
    .with_context(|| format!("fs {}: rebuild the volume from its labels", first.fs_uuid))?;
    let paths = present.iter().map(|(p, _)| Some(p.to_path_buf())).collect();
    Ok((volume, paths))
}

fn print_map(
    volume: &Volume,
    paths: &[Option<PathBuf>],
    what: &str,
    offset: u64,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    let size = volume.size_bytes();
    let Some(seg) = volume.segment_at(offset) else {
        bail!("offset {offset} lies outside the volume of {what} ({size} bytes)");
    };
    // The run from `offset` to the end of its stripe unit (or segment, when linear).
    let rel = offset - seg.vol_start;
    let len = if seg.legs.len() > 1 {
        seg.stripe_unit - rel % seg.stripe_unit
    } else {
        seg.vol_end() - offset
    };
    let runs = volume.map(offset, len)?;
    let Some(run) = runs.first() else {
        bail!("offset {offset} maps to nothing");
    };
    let dev = volume
        .devices()
        .get(run.device.as_usize())
        .context("mapped to a device the volume does not have")?;
    let path = paths
        .get(run.device.as_usize())
        .cloned()
        .flatten()
        .map_or_else(|| "(not inspected)".to_owned(), |p| p.display().to_string());
    writeln!(
        out,
        "map {what}, {size} bytes: volume offset {offset} -> device {} {} {path} phys {} \
         ({} contiguous bytes)",
        run.device.0, dev.uuid, run.phys_off, run.len
    )?;
    writeln!(
        out,
        "  segment {}..{}: {} leg(s), stripe unit {}",
        seg.vol_start,
        seg.vol_end(),
        seg.legs.len(),
        seg.stripe_unit
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{LayoutKindConfig, VolumeConfig};
    use crate::format::format_volume;

    fn formatted(
        dir: &Path,
        layout: LayoutKindConfig,
        n: usize,
    ) -> (Vec<PathBuf>, crate::format::Formatted) {
        let paths: Vec<PathBuf> = (0..n)
            .map(|i| {
                let p = dir.join(format!("lun{i}"));
                std::fs::File::create(&p)
                    .unwrap()
                    .set_len((4 + i as u64) << 20)
                    .unwrap();
                p
            })
            .collect();
        let cfg = VolumeConfig {
            layout,
            block_size: 4096,
            stripe_unit: 64 << 10,
            data_offset: 1 << 20,
            devices: paths.clone(),
            lvm_vg: None,
            lvm_lv: None,
        };
        let f = format_volume(&cfg, false, 1_790_000_000).unwrap();
        (paths, f)
    }

    fn run(devices: &[PathBuf], map: Option<u64>) -> anyhow::Result<String> {
        let mut out = Vec::new();
        inspect(devices, map, &mut out)?;
        Ok(String::from_utf8(out).unwrap())
    }

    #[test]
    fn inspect_prints_labels_and_maps_like_the_volume() {
        let dir = tempfile::tempdir().unwrap();
        for layout in [LayoutKindConfig::Striped, LayoutKindConfig::Linear] {
            let sub = dir.path().join(layout.to_string());
            std::fs::create_dir(&sub).unwrap();
            let (paths, f) = formatted(&sub, layout, 3);
            let text = run(&paths, None).unwrap();
            assert!(
                text.contains(&format!("fs uuid:      {}", f.fs_uuid)),
                "{text}"
            );
            assert!(text.contains("device:       2 of 3"), "{text}");
            assert!(text.contains("formatted at: 1790000000"), "{text}");
            for dev in f.volume.devices() {
                assert!(text.contains(&dev.uuid.to_string()), "{text}");
            }
            // Devices in any order; the map follows the labels' indices.
            let shuffled = vec![paths[2].clone(), paths[0].clone(), paths[1].clone()];
            for offset in [0, 4095, 65536, 65536 * 3 + 17, f.volume.size_bytes() - 1] {
                let text = run(&shuffled, Some(offset)).unwrap();
                let run0 = f.volume.map(offset, 1).unwrap()[0];
                let expect = format!(
                    "volume offset {offset} -> device {} {} {} phys {} ",
                    run0.device.0,
                    f.volume.devices()[run0.device.as_usize()].uuid,
                    paths[run0.device.as_usize()].display(),
                    run0.phys_off
                );
                assert!(text.contains(&expect), "{layout}: {expect}\n{text}");
            }
            let err = format!(
                "{:#}",
                run(&paths, Some(f.volume.size_bytes())).unwrap_err()
            );
            assert!(err.contains("outside the volume"), "{err}");
            let err = format!("{:#}", run(&paths[..2], Some(0)).unwrap_err());
            assert!(err.contains("device(s) 2 of 3 missing"), "{err}");
        }
    }

    #[test]
    fn inspect_reports_foreign_signatures_and_blank_devices() {
        let dir = tempfile::tempdir().unwrap();
        let blank = dir.path().join("blank");
        std::fs::write(&blank, vec![0u8; 1 << 20]).unwrap();
        let xfs = dir.path().join("xfs");
        let mut bytes = vec![0u8; 1 << 20];
        bytes[..4].copy_from_slice(b"XFSB");
        std::fs::write(&xfs, bytes).unwrap();
        let short = dir.path().join("short");
        std::fs::write(&short, b"XFS").unwrap();
        let text = run(&[blank.clone(), xfs.clone(), short.clone()], None).unwrap();
        assert!(
            text.contains("blank: 1048576 bytes\n  nothing recognised"),
            "{text}"
        );
        assert!(
            text.contains("xfs: 1048576 bytes\n  XFS file system"),
            "{text}"
        );
        assert!(
            text.contains("short: 3 bytes\n  nothing recognised"),
            "{text}"
        );
        let err = format!("{:#}", run(&[blank], Some(0)).unwrap_err());
        assert!(err.contains("no volume to map"), "{err}");
    }

    #[test]
    fn labels_of_two_file_systems_do_not_make_one_volume() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a"), dir.path().join("b"));
        std::fs::create_dir(&a).unwrap();
        std::fs::create_dir(&b).unwrap();
        let (pa, _) = formatted(&a, LayoutKindConfig::Linear, 1);
        let (pb, _) = formatted(&b, LayoutKindConfig::Linear, 1);
        let err = format!(
            "{:#}",
            run(&[pa[0].clone(), pb[0].clone()], Some(0)).unwrap_err()
        );
        assert!(err.contains("belong to 2 file systems"), "{err}");
    }
}
