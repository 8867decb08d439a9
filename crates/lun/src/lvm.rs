//! Reading an LVM2 physical volume from its device: the PV label, then every metadata area
//! (header, committed text, checksum, parse), and applying the import rule's checks of the VG
//! and LV state to what was read ([`check_lv`]). `sanfs-mds format`, `volume inspect` and
//! `grow`, the server at start and the agent at mount all read PVs here, so that they decide
//! on the same bytes with the same words. Parsing stays in blockmap (pure); this is the I/O
//! around it.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use sanfs_blockmap::import::{ImportVerdict, PvReading, check_lv_import};
use sanfs_blockmap::lvm::{
    self, DiskArea, LABEL_SCAN_BYTES, LvmError, MDA_HEADER_SIZE, PvLabel, VgMetadata,
};

use crate::open::{Access, open_direct};
use crate::probe::read_direct;

/// One LVM2 PV as read from its device.
#[derive(Debug, Clone)]
pub struct LvmPv {
    pub label: PvLabel,
    /// The newest VG metadata found in the PV's metadata areas (none with `metadatacopies 0`).
    pub metadata: Option<VgMetadata>,
    /// Why a metadata area could not be read, one line per area.
    pub metadata_problems: Vec<String>,
    /// The VG name and seqno of each metadata area that read and parsed.
    pub good_copies: Vec<(String, u64)>,
}

impl LvmPv {
    /// What the import rule ([`check_lv_import`]) takes.
    pub fn reading(&self, path: &Path) -> PvReading {
        PvReading {
            name: path.display().to_string(),
            pv_id: self.label.pv_id,
            good_copies: self.good_copies.clone(),
            bad_copies: self.metadata_problems.clone(),
        }
    }
}

/// Reads an LVM2 PV through `read_at(offset, len)` on a device of `size_bytes`: its label,
/// then every metadata area. Fails only when there is no valid PV label (`InvalidData`) or
/// its first bytes cannot be read; unreadable metadata areas are listed in
/// `metadata_problems`.
pub fn read_pv(
    size_bytes: u64,
    read_at: &dyn Fn(u64, usize) -> io::Result<Vec<u8>>,
) -> io::Result<LvmPv> {
    let head_len =
        usize::try_from(size_bytes).map_or(LABEL_SCAN_BYTES, |s| s.min(LABEL_SCAN_BYTES));
    let head = read_at(0, head_len)?;
    let label = lvm::parse_pv_label(&head).map_err(|e| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("no valid LVM2 PV label: {e}"),
        )
    })?;
    let mut metadata: Option<VgMetadata> = None;
    let mut metadata_problems = Vec::new();
    let mut good_copies = Vec::new();
    for area in &label.metadata_areas {
        match read_metadata_area(size_bytes, read_at, *area) {
            Ok(meta) => {
                good_copies.push((meta.name.clone(), meta.seqno));
                if metadata.as_ref().is_none_or(|m| meta.seqno > m.seqno) {
                    metadata = Some(meta);
                }
            }
            Err(e) => metadata_problems.push(format!("metadata area at {}: {e}", area.offset)),
        }
    }
    Ok(LvmPv {
        label,
        metadata,
        metadata_problems,
        good_copies,
    })
}

fn read_metadata_area(
    size_bytes: u64,
    read_at: &dyn Fn(u64, usize) -> io::Result<Vec<u8>>,
    area: DiskArea,
) -> Result<VgMetadata, String> {
    let read = |off: u64, len: usize| -> Result<Vec<u8>, String> {
        if off
            .checked_add(len as u64)
            .is_none_or(|end| end > size_bytes)
        {
            return Err(format!(
                "{len} bytes at {off} run past the end of the device ({size_bytes} bytes)"
            ));
        }
        read_at(off, len).map_err(|e| e.to_string())
    };
    let header = lvm::parse_mda_header(&read(area.offset, MDA_HEADER_SIZE)?, area)
        .map_err(|e| e.to_string())?;
    let location = header.metadata_location().map_err(|e| e.to_string())?;
    let mut text = Vec::new();
    for piece in &location.pieces {
        let len = usize::try_from(piece.len).map_err(|e| format!("metadata piece size: {e}"))?;
        if len > lvm::MAX_METADATA_TEXT_BYTES {
            return Err(LvmError::TooLarge {
                len: piece.len,
                max: lvm::MAX_METADATA_TEXT_BYTES as u64,
            }
            .to_string());
        }
        text.extend(read(piece.offset, len)?);
    }
    location.verify_text(&text).map_err(|e| e.to_string())?;
    lvm::parse_vg_metadata(&text).map_err(|e| e.to_string())
}

/// [`read_pv`] of the device or file at `path`, read with `O_DIRECT` where the file system
/// allows it (never this node's page cache, which may hold bytes another node overwrote).
pub fn read_pv_at(path: &Path) -> io::Result<LvmPv> {
    let (file, direct) = open_direct(path, Access::Read)?;
    let geometry = crate::describe(&file)?;
    let align = geometry.logical_block_size;
    let read_at = |off: u64, len: usize| -> io::Result<Vec<u8>> {
        if direct {
            read_direct(&file, off, len, align)
        } else {
            read_buffered(&file, off, len)
        }
    };
    read_pv(geometry.size_bytes, &read_at)
        .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", path.display())))
}

fn read_buffered(file: &File, off: u64, len: usize) -> io::Result<Vec<u8>> {
    let mut buf = vec![0u8; len];
    file.read_exact_at(&mut buf, off)?;
    Ok(buf)
}

/// The import rule's checks of logical volume `vg/lv` against the PVs read (`(path, pv)`,
/// the volume's PVs as this node opened them): the newest metadata of `vg` among them, then
/// [`check_lv_import`] (exported VG, read-only LV, the LV on a `MISSING` PV: refusals; a
/// damaged or stale metadata copy, a `MISSING` PV the LV does not use: warnings). `Err` when
/// no PV holds readable metadata of `vg`.
pub fn check_lv(pvs: &[(PathBuf, LvmPv)], vg: &str, lv: &str) -> Result<ImportVerdict, String> {
    let meta = newest_metadata(pvs, vg)?;
    let readings: Vec<PvReading> = pvs.iter().map(|(path, pv)| pv.reading(path)).collect();
    Ok(check_lv_import(meta, lv, &readings))
}

/// The newest metadata of volume group `vg` (highest seqno) among the PVs read (`(path,
/// pv)`); `Err` naming each PV's metadata problems when none holds a readable copy.
pub fn newest_metadata<'a>(
    pvs: &'a [(PathBuf, LvmPv)],
    vg: &str,
) -> Result<&'a VgMetadata, String> {
    let newest = pvs
        .iter()
        .filter_map(|(_, pv)| pv.metadata.as_ref())
        .filter(|m| m.name == vg)
        .max_by_key(|m| m.seqno);
    newest.ok_or_else(|| {
        let problems: Vec<String> = pvs
            .iter()
            .flat_map(|(p, pv)| {
                pv.metadata_problems
                    .iter()
                    .map(move |m| format!("{}: {m}", p.display()))
            })
            .collect();
        format!(
            "no readable metadata of volume group {vg:?} on any of the PVs opened{}{}",
            if problems.is_empty() { "" } else { ": " },
            problems.join("; ")
        )
    })
}

/// [`check_lv`] of the PVs at `paths` (the volume's PVs as this node opened them), for the
/// server at start and the agent at mount. A PV that cannot be read is a warning of the
/// verdict (its identity was read, so this is rare); `Err` when nothing could be checked
/// (no PV here, or none with readable metadata of `vg`).
pub fn check_lv_at(paths: &[PathBuf], vg: &str, lv: &str) -> Result<ImportVerdict, String> {
    let mut pvs = Vec::with_capacity(paths.len());
    let mut unread = Vec::new();
    for path in paths {
        match read_pv_at(path) {
            Ok(pv) => pvs.push((path.clone(), pv)),
            Err(e) => unread.push(format!("cannot read the LVM2 PV: {e}")),
        }
    }
    if pvs.is_empty() {
        return Err(match unread.is_empty() {
            true => format!("no PV of volume group {vg:?} is open here"),
            false => unread.join("; "),
        });
    }
    let mut verdict = check_lv(&pvs, vg, lv)?;
    verdict.warnings.extend(unread);
    Ok(verdict)
}

/// What a node does with the import rule's verdict on `vg/lv`: logs each warning, and
/// refuses ([`refusal_message`] with `outcome`) when the rule refuses.
pub fn enforce(vg: &str, lv: &str, verdict: &ImportVerdict, outcome: &str) -> Result<(), String> {
    for warning in &verdict.warnings {
        tracing::warn!("{warning}");
    }
    if verdict.is_refused() {
        return Err(refusal_message(vg, lv, verdict, outcome));
    }
    Ok(())
}

/// The refusal of logical volume `vg/lv` by the import rule, in the words `format` uses, with
/// what the caller does about it (`"nothing was written"`, `"refusing to serve"`, `"refusing
/// to mount"`).
pub fn refusal_message(vg: &str, lv: &str, verdict: &ImportVerdict, outcome: &str) -> String {
    format!(
        "logical volume {vg}/{lv} cannot be used; {outcome}: {}",
        verdict.refusals.join("; ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_device_without_a_pv_label_is_invalid_data_and_nothing_is_checked_without_pvs() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("blank");
        std::fs::File::create(&path)
            .unwrap()
            .set_len(1 << 20)
            .unwrap();
        let e = read_pv_at(&path).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{e}");
        assert!(e.to_string().contains("no valid LVM2 PV label"), "{e}");
        let why = check_lv_at(&[], "vg0", "lv0").unwrap_err();
        assert!(why.contains("no PV of volume group \"vg0\""), "{why}");
        let why = check_lv_at(std::slice::from_ref(&path), "vg0", "lv0").unwrap_err();
        assert!(why.contains("cannot read the LVM2 PV"), "{why}");
        assert!(why.contains(&path.display().to_string()), "{why}");
    }
}
