//! `sanfs-mds volume inspect DEVICE... [--map OFFSET] [--lv NAME]`: say what is on each
//! device (a sanfs label, an LVM2 PV with its volume group's logical volumes and segments,
//! another file system's signature, or nothing recognised), and with `--map` where a volume
//! byte offset lands: device index, device UUID, path and physical offset.
//!
//! The volume for `--map` is rebuilt from what the devices hold, exactly as an agent would:
//! from the sanfs labels of one file system (every device index present), or from the VG
//! metadata on the PVs for one LV. Nothing is written. Which device is which, and whether an
//! LV may be used, is blockmap's import rule ([`sanfs_blockmap::import`]): its refusals and
//! warnings are printed (`refused: ...`, `warning: ...`), and `--map` refuses an identity
//! found on two devices. [`inspect_json`] is `--json`: the same as one JSON object.

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
use sanfs_blockmap::import::{PvReading, assign_devices, check_lv_import};

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
    /// Signatures found; for an LVM2 label whose PV could not be read, why.
    Other(Vec<Signature>, Option<String>),
}

/// One inspected device.
struct Inspected {
    path: PathBuf,
    size_bytes: u64,
    found: Found,
}

/// Everything `volume inspect` found, before it is printed (as text or JSON).
struct Inspection {
    devices: Vec<Inspected>,
    /// The newest metadata of each VG found on the PVs, by VG name.
    vgs: BTreeMap<String, VgMetadata>,
    /// The PVs' paths by PV UUID (PVs whose UUID is on several devices are left out).
    pv_paths: BTreeMap<LvmPvId, PathBuf>,
    /// The import rule's refusals and warnings, per VG and LV, without repeats.
    refusals: Vec<String>,
    warnings: Vec<String>,
}

fn gather(devices: &[PathBuf]) -> anyhow::Result<Inspection> {
    if devices.is_empty() {
        bail!("no devices to inspect");
    }
    let mut inspected = Vec::with_capacity(devices.len());
    for path in devices {
        let lun = Lun::open(path, false)?;
        let head = lun.read_prefix(label::PROBE_SIZE)?;
        let signatures = label::probe(&head);
        let found = if let Some(Signature::Sanfs(l)) =
            signatures.iter().find(|s| matches!(s, Signature::Sanfs(_)))
        {
            Found::Sanfs(l.clone())
        } else if signatures.contains(&Signature::LvmPv) {
            match read_lvm_pv(&lun) {
                Ok(pv) => Found::Lvm(Box::new(pv)),
                Err(e) => Found::Other(signatures, Some(format!("{e:#}"))),
            }
        } else {
            Found::Other(signatures, None)
        };
        inspected.push(Inspected {
            path: path.clone(),
            size_bytes: lun.size_bytes(),
            found,
        });
    }
    let pvs: Vec<(PathBuf, LvmPv)> = inspected
        .iter()
        .filter_map(|d| match &d.found {
            Found::Lvm(pv) => Some((d.path.clone(), (**pv).clone())),
            _ => None,
        })
        .collect();
    let vgs = newest_vgs(&pvs);
    // The import rule decides which device a PV UUID is: one on two devices is none of them.
    let candidates: Vec<(String, DeviceId)> = pvs
        .iter()
        .map(|(p, pv)| (p.display().to_string(), DeviceId::LvmPv(pv.label.pv_id)))
        .collect();
    let assignment = assign_devices(&[], &candidates);
    let duplicated: Vec<DeviceId> = assignment.duplicates.iter().map(|d| d.id).collect();
    let pv_paths: BTreeMap<LvmPvId, PathBuf> = pvs
        .iter()
        .filter(|(_, pv)| !duplicated.contains(&DeviceId::LvmPv(pv.label.pv_id)))
        .map(|(p, pv)| (pv.label.pv_id, p.clone()))
        .collect();
    let mut refusals = Vec::new();
    let mut warnings = Vec::new();
    let note = |list: &mut Vec<String>, m: String| {
        if !list.contains(&m) {
            list.push(m);
        }
    };
    // Every identity found on two devices, sanfs labels (a cloned LUN) included.
    let identities: Vec<(String, DeviceId)> = inspected
        .iter()
        .filter_map(|d| match &d.found {
            Found::Sanfs(l) => Some((d.path.display().to_string(), DeviceId::Sanfs(l.device_uuid))),
            Found::Lvm(pv) => Some((
                d.path.display().to_string(),
                DeviceId::LvmPv(pv.label.pv_id),
            )),
            Found::Other(..) => None,
        })
        .collect();
    for dup in assign_devices(&[], &identities).duplicates {
        note(&mut refusals, dup.to_string());
    }
    for meta in vgs.values() {
        let readings: Vec<PvReading> = pvs
            .iter()
            .filter(|(_, pv)| meta.pv_by_id(&pv.label.pv_id).is_some())
            .map(|(p, pv)| pv.reading(p))
            .collect();
        for lv in meta.lvs.iter().filter(|l| l.visible()) {
            let verdict = check_lv_import(meta, &lv.name, &readings);
            for r in verdict.refusals {
                note(&mut refusals, r);
            }
            for w in verdict.warnings {
                note(&mut warnings, w);
            }
        }
    }
    Ok(Inspection {
        devices: inspected,
        vgs,
        pv_paths,
        refusals,
        warnings,
    })
}

/// Prints what is on each device; with `map`, where that volume byte offset lands (the LV
/// named `lv`, or the only LV, for LVM).
pub fn inspect_with(
    devices: &[PathBuf],
    map: Option<u64>,
    lv: Option<&str>,
    out: &mut impl Write,
) -> anyhow::Result<()> {
    let inspection = gather(devices)?;
    for d in &inspection.devices {
        writeln!(out, "{}: {} bytes", d.path.display(), d.size_bytes)?;
        match &d.found {
            Found::Sanfs(l) => print_label(l, out)?,
            Found::Lvm(pv) => print_pv(pv, out)?,
            Found::Other(signatures, unreadable) => {
                if let Some(e) = unreadable {
                    writeln!(out, "  LVM2 PV label, unreadable: {e}")?;
                }
                if signatures.is_empty() {
                    writeln!(out, "  nothing recognised")?;
                }
                for s in signatures {
                    writeln!(out, "  {s}")?;
                }
            }
        }
    }
    let pv_paths: BTreeMap<LvmPvId, &Path> = inspection
        .pv_paths
        .iter()
        .map(|(id, p)| (*id, p.as_path()))
        .collect();
    for meta in inspection.vgs.values() {
        print_vg(meta, &pv_paths, out)?;
    }
    for r in &inspection.refusals {
        writeln!(out, "refused: {r}")?;
    }
    for w in &inspection.warnings {
        writeln!(out, "warning: {w}")?;
    }
    let Some(offset) = map else {
        return Ok(());
    };
    let hit = map_offset(&inspection, lv, offset)?;
    writeln!(
        out,
        "map {}, {} bytes: volume offset {offset} -> device {} {} {} phys {} \
         ({} contiguous bytes)",
        hit.what, hit.volume_size, hit.device_index, hit.device_id, hit.path, hit.phys_off, hit.len
    )?;
    writeln!(
        out,
        "  segment {}..{}: {} leg(s), stripe unit {}",
        hit.segment_start, hit.segment_end, hit.legs, hit.stripe_unit
    )?;
    Ok(())
}

/// `volume inspect --json`: what [`inspect_with`] prints, as one JSON object: `devices` (each
/// with `path`, `size_bytes` and `sanfs_label`, `lvm_pv` or `signatures`), `volume_groups`,
/// `refusals`, `warnings`, and with `map` a `map` object.
pub fn inspect_json(
    devices: &[PathBuf],
    map: Option<u64>,
    lv: Option<&str>,
) -> anyhow::Result<serde_json::Value> {
    use serde_json::json;
    let inspection = gather(devices)?;
    let devices: Vec<serde_json::Value> = inspection
        .devices
        .iter()
        .map(|d| {
            let mut v = json!({
                "path": d.path.display().to_string(),
                "size_bytes": d.size_bytes,
            });
            match &d.found {
                Found::Sanfs(l) => {
                    v["sanfs_label"] = json!({
                        "fs_uuid": l.fs_uuid.to_string(),
                        "device_uuid": l.device_uuid.to_string(),
                        "device_index": l.device_index,
                        "device_count": l.device_count,
                        "device_size": l.device_size,
                        "data_offset": l.data_offset,
                        "block_size": l.block_size,
                        "layout": match l.layout {
                            LabelLayout::Linear => json!({"kind": "linear"}),
                            LabelLayout::Striped { stripe_unit } =>
                                json!({"kind": "striped", "stripe_unit": stripe_unit}),
                        },
                        "formatted_at": l.formatted_at,
                    });
                }
                Found::Lvm(pv) => {
                    v["lvm_pv"] = json!({
                        "pv_uuid": pv.label.pv_id.to_string(),
                        "device_size": pv.label.device_size_bytes,
                        "pe_start": pv.label.data_areas.first().map(|a| a.offset),
                        "metadata_areas": pv.label.metadata_areas.len(),
                        "vg": pv.metadata.as_ref().map(|m| m.name.clone()),
                        "seqno": pv.metadata.as_ref().map(|m| m.seqno),
                        "metadata_problems": pv.metadata_problems,
                    });
                }
                Found::Other(signatures, unreadable) => {
                    v["signatures"] = json!(
                        signatures
                            .iter()
                            .map(ToString::to_string)
                            .collect::<Vec<_>>()
                    );
                    if let Some(e) = unreadable {
                        v["lvm_pv_unreadable"] = json!(e);
                    }
                }
            }
            v
        })
        .collect();
    let vgs: Vec<serde_json::Value> = inspection
        .vgs
        .values()
        .map(|meta| {
            json!({
                "name": meta.name,
                "seqno": meta.seqno,
                "extent_size": meta.extent_size_bytes(),
                "status": meta.status,
                "pvs": meta.pvs.iter().map(|pv| json!({
                    "name": pv.name,
                    "pv_uuid": pv.id.to_string(),
                    "path": inspection.pv_paths.get(&pv.id).map(|p| p.display().to_string()),
                    "pe_start": pv.pe_start_sectors * 512,
                    "pe_count": pv.pe_count,
                    "flags": pv.flags,
                })).collect::<Vec<_>>(),
                "lvs": meta.lvs.iter().map(|lv| json!({
                    "name": lv.name,
                    "status": lv.status,
                    "segments": lv.segments.iter().map(|seg| json!({
                        "start": seg.start_extent * meta.extent_size_bytes(),
                        "size": seg.extent_count * meta.extent_size_bytes(),
                        "type": seg.segtype,
                        "stripe_size": seg.stripe_size_sectors * 512,
                        "stripes": seg.stripes.iter().map(|(pv, pe)| json!({"pv": pv, "first_pe": pe})).collect::<Vec<_>>(),
                    })).collect::<Vec<_>>(),
                })).collect::<Vec<_>>(),
            })
        })
        .collect();
    let mut out = json!({
        "devices": devices,
        "volume_groups": vgs,
        "refusals": inspection.refusals,
        "warnings": inspection.warnings,
    });
    if let Some(offset) = map {
        let hit = map_offset(&inspection, lv, offset)?;
        out["map"] = json!({
            "volume": hit.what,
            "volume_size": hit.volume_size,
            "offset": offset,
            "device_index": hit.device_index,
            "device_id": hit.device_id,
            "path": hit.path,
            "phys_off": hit.phys_off,
            "contiguous_bytes": hit.len,
            "segment_start": hit.segment_start,
            "segment_end": hit.segment_end,
            "legs": hit.legs,
            "stripe_unit": hit.stripe_unit,
        });
    }
    Ok(out)
}

/// Where a volume byte offset lands.
struct MapHit {
    what: String,
    volume_size: u64,
    device_index: u32,
    device_id: String,
    path: String,
    phys_off: u64,
    len: u64,
    segment_start: u64,
    segment_end: u64,
    legs: usize,
    stripe_unit: u64,
}

/// Rebuilds the volume (from the sanfs labels, or the LV `lv` of the one VG) and maps
/// `offset` in it.
fn map_offset(inspection: &Inspection, lv: Option<&str>, offset: u64) -> anyhow::Result<MapHit> {
    let labels: Vec<(&Path, &DeviceLabel)> = inspection
        .devices
        .iter()
        .filter_map(|d| match &d.found {
            Found::Sanfs(l) => Some((d.path.as_path(), l)),
            _ => None,
        })
        .collect();
    let vgs = &inspection.vgs;
    let has_pvs = inspection
        .devices
        .iter()
        .any(|d| matches!(d.found, Found::Lvm(_)));
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
        // A PV of the LV that is on several devices: which one holds the bytes is unknown.
        let pvs: Vec<(String, DeviceId)> = inspection
            .devices
            .iter()
            .filter_map(|d| match &d.found {
                Found::Lvm(pv) => Some((
                    d.path.display().to_string(),
                    DeviceId::LvmPv(pv.label.pv_id),
                )),
                _ => None,
            })
            .collect();
        let ids: Vec<DeviceId> = volume.devices().iter().map(|d| d.uuid).collect();
        if let Some(dup) = assign_devices(&ids, &pvs)
            .duplicates
            .into_iter()
            .find(|d| d.index.is_some())
        {
            bail!("--map on logical volume {}/{lv_name}: {dup}", meta.name);
        }
        let paths = volume
            .devices()
            .iter()
            .map(|d| match d.uuid {
                DeviceId::LvmPv(id) => inspection.pv_paths.get(&id).cloned(),
                DeviceId::Sanfs(_) => None,
            })
            .collect();
        (volume, paths, format!("LV {}/{lv_name}", meta.name))
    } else if has_pvs {
        let problems: Vec<String> = inspection
            .devices
            .iter()
            .filter_map(|d| match &d.found {
                Found::Lvm(pv) => Some(
                    pv.metadata_problems
                        .iter()
                        .map(|m| format!("{}: {m}", d.path.display()))
                        .collect::<Vec<_>>(),
                ),
                _ => None,
            })
            .flatten()
            .collect();
        bail!(
            "--map: the devices are LVM2 PVs, but none holds readable volume group metadata \
             (PVs created with --metadatacopies 0 need a PV with metadata named too){}{}",
            if problems.is_empty() { "" } else { ": " },
            problems.join("; ")
        );
    } else {
        bail!("--map: no sanfs label or LVM2 PV on the devices, so there is no volume to map");
    };
    map_hit(&volume, &paths, &what, offset)
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
    // The import rule: one device UUID on two devices (a cloned LUN) is refused as such.
    let candidates: Vec<(String, DeviceId)> = labels
        .iter()
        .map(|(p, l)| (p.display().to_string(), DeviceId::Sanfs(l.device_uuid)))
        .collect();
    if let Some(dup) = assign_devices(&[], &candidates).duplicates.first() {
        bail!("fs {}: {dup}", first.fs_uuid);
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

fn map_hit(
    volume: &Volume,
    paths: &[Option<PathBuf>],
    what: &str,
    offset: u64,
) -> anyhow::Result<MapHit> {
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
    Ok(MapHit {
        what: what.to_owned(),
        volume_size: size,
        device_index: run.device.0,
        device_id: dev.uuid.to_string(),
        path,
        phys_off: run.phys_off,
        len: run.len,
        segment_start: seg.vol_start,
        segment_end: seg.vol_end(),
        legs: seg.legs.len(),
        stripe_unit: seg.stripe_unit,
    })
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
