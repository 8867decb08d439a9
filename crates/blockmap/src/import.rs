//! The import rule: which of the devices a node found are the volume's devices, and whether an
//! LVM2 volume group is in a state that lets one of its LVs be used.
//!
//! One rule for every reader of labels: `sanfs-mds format` and `volume inspect`, the server's
//! table of data LUNs and the agent's discovery. The callers read the candidate devices' labels
//! (and, for LVM2, the metadata areas) and report what this module decides; they decide
//! nothing themselves, so that the server and every agent always pick the same LUN, or none.
//!
//! - [`assign_devices`]: a volume device whose identity (sanfs device UUID or LVM2 PV UUID) is
//!   carried by two different devices (a cloned LUN, or one LUN seen under two names, as the
//!   paths of a multipath device are) is refused: neither is used, because nothing in the
//!   labels says which one is the LUN the others write. The caller first drops a second path
//!   to a device it already looked at (same `st_rdev`, or same file), which is no duplicate.
//! - [`check_lv_import`]: an exported VG and a read-only LV are refused; a PV flagged
//!   `MISSING` is refused when the LV lies on it and a warning otherwise; a damaged or stale
//!   metadata copy is a warning while a good copy of the newest metadata was read (the data is
//!   still safe).

use std::collections::BTreeMap;
use std::fmt;

use crate::lvm::{LvmError, VgMetadata};
use crate::volume::{DeviceId, DeviceIndex, LvmPvId};

/// One identity carried by more than one candidate device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DuplicateIdentity {
    pub id: DeviceId,
    /// The volume device with that identity (`None`: not one of the volume's).
    pub index: Option<DeviceIndex>,
    /// The candidates' names (paths), in the order the caller gave them.
    pub devices: Vec<String>,
}

impl fmt::Display for DuplicateIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = match self.id {
            DeviceId::Sanfs(_) => "sanfs device",
            DeviceId::LvmPv(_) => "LVM2 PV",
        };
        write!(
            f,
            "{what} {} is on {} devices ({}): a cloned LUN, or one LUN seen under several names \
             (multipath); none of them is used. Name each LUN once (the multipath device, not \
             its paths), or give a clone an identity of its own (vgimportclone for a PV)",
            self.id,
            self.devices.len(),
            self.devices.join(", ")
        )
    }
}

/// What [`assign_devices`] decided.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Assignment {
    /// For each volume device (by index), the candidate (by position) that is it.
    pub by_index: Vec<Option<usize>>,
    /// Identities carried by more than one candidate: refused (their volume devices stay
    /// unassigned).
    pub duplicates: Vec<DuplicateIdentity>,
    /// Candidates whose identity is not one of the volume's.
    pub foreign: Vec<usize>,
}

impl Assignment {
    /// The refusal of volume device `index`, if its identity was found on several devices.
    pub fn refusal(&self, index: DeviceIndex) -> Option<&DuplicateIdentity> {
        self.duplicates.iter().find(|d| d.index == Some(index))
    }
}

/// Assigns candidate devices (`(name, identity)`, one per device, not per path) to the volume
/// devices whose identities are `volume_ids` (by index). See the module docs.
pub fn assign_devices(volume_ids: &[DeviceId], candidates: &[(String, DeviceId)]) -> Assignment {
    let mut by_id: BTreeMap<DeviceId, Vec<usize>> = BTreeMap::new();
    for (pos, (_, id)) in candidates.iter().enumerate() {
        by_id.entry(*id).or_default().push(pos);
    }
    let index_of = |id: &DeviceId| {
        volume_ids
            .iter()
            .position(|v| v == id)
            .map(|i| DeviceIndex(i as u32))
    };
    let mut out = Assignment {
        by_index: vec![None; volume_ids.len()],
        ..Assignment::default()
    };
    // In the candidates' order, so that reports are stable.
    let mut done = std::collections::BTreeSet::new();
    for (_, id) in candidates {
        if !done.insert(*id) {
            continue;
        }
        let positions = &by_id[id];
        let index = index_of(id);
        if positions.len() > 1 {
            out.duplicates.push(DuplicateIdentity {
                id: *id,
                index,
                devices: positions.iter().map(|&p| candidates[p].0.clone()).collect(),
            });
            continue;
        }
        match index {
            Some(i) => out.by_index[i.as_usize()] = Some(positions[0]),
            None => out.foreign.push(positions[0]),
        }
    }
    out
}

/// What a caller read from one PV it was given: its name (path), its label's PV UUID, and its
/// metadata areas.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PvReading {
    pub name: String,
    pub pv_id: LvmPvId,
    /// The VG name and seqno of each metadata copy that read and parsed.
    pub good_copies: Vec<(String, u64)>,
    /// Why each other metadata copy could not be used.
    pub bad_copies: Vec<String>,
}

/// What [`check_lv_import`] decided: the LV may be used only if `refusals` is empty.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ImportVerdict {
    pub refusals: Vec<String>,
    pub warnings: Vec<String>,
}

impl ImportVerdict {
    pub fn is_refused(&self) -> bool {
        !self.refusals.is_empty()
    }
}

/// Whether LV `lv` of the VG described by `meta` (the newest metadata among `pvs`) may be
/// used, given what was read from the PVs the caller was given. The LV's own structure
/// (segment types, stacking, visibility) is checked by [`VgMetadata::lv_volume`]; this checks
/// the state of the VG and of its PVs. See the module docs.
pub fn check_lv_import(meta: &VgMetadata, lv: &str, pvs: &[PvReading]) -> ImportVerdict {
    let mut v = ImportVerdict::default();
    let candidates: Vec<(String, DeviceId)> = pvs
        .iter()
        .map(|p| (p.name.clone(), DeviceId::LvmPv(p.pv_id)))
        .collect();
    for dup in assign_devices(&[], &candidates).duplicates {
        v.refusals.push(dup.to_string());
    }
    if meta.status.iter().any(|s| s == "EXPORTED") {
        v.refusals.push(
            LvmError::ExportedVg {
                vg: meta.name.clone(),
            }
            .to_string(),
        );
    }
    let lv_meta = meta.lv(lv);
    if let Some(l) = lv_meta
        && !l.writable()
    {
        v.refusals.push(
            LvmError::ReadOnlyLv {
                vg: meta.name.clone(),
                lv: lv.to_owned(),
            }
            .to_string(),
        );
    }
    for pv in &meta.pvs {
        if !pv.flags.iter().any(|f| f == "MISSING") {
            continue;
        }
        let used = lv_meta.is_some_and(|l| {
            l.segments
                .iter()
                .any(|s| s.stripes.iter().any(|(area, _)| *area == pv.name))
        });
        let e = LvmError::MissingPv {
            vg: meta.name.clone(),
            pv: pv.name.clone(),
            id: pv.id,
            lv: lv.to_owned(),
            used,
        };
        if used {
            v.refusals.push(e.to_string());
        } else {
            v.warnings.push(e.to_string());
        }
    }
    for pv in pvs {
        let newest = pv
            .good_copies
            .iter()
            .any(|(vg, seqno)| *vg == meta.name && *seqno == meta.seqno);
        for bad in &pv.bad_copies {
            v.warnings.push(format!(
                "{}: a metadata copy of volume group {} is damaged and was skipped ({bad}); {}; \
                 repair it with `vgck --updatemetadata {}`",
                pv.name,
                meta.name,
                if newest {
                    "another copy on this PV was read"
                } else {
                    "the metadata was read from another PV"
                },
                meta.name
            ));
        }
        for (vg, seqno) in &pv.good_copies {
            if *vg == meta.name && *seqno < meta.seqno {
                v.warnings.push(format!(
                    "{}: a metadata copy of volume group {} is stale (seqno {seqno} < {}); the \
                     newest was used",
                    pv.name, meta.name, meta.seqno
                ));
            }
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lvm::parse_vg_metadata;

    fn sanfs(n: u128) -> DeviceId {
        DeviceId::Sanfs(uuid::Uuid::from_u128(n))
    }

    fn named(list: &[(&str, DeviceId)]) -> Vec<(String, DeviceId)> {
        list.iter().map(|(n, id)| ((*n).to_owned(), *id)).collect()
    }

    #[test]
    fn a_duplicated_identity_assigns_neither_device_wherever_it_comes_first() {
        let volume = [sanfs(1), sanfs(2)];
        for order in [["a", "b"], ["b", "a"]] {
            let c = named(&[
                (order[0], sanfs(1)),
                ("x", sanfs(9)),
                (order[1], sanfs(1)),
                ("d2", sanfs(2)),
            ]);
            let a = assign_devices(&volume, &c);
            assert_eq!(a.by_index, vec![None, Some(3)]);
            assert_eq!(a.foreign, vec![1]);
            assert_eq!(a.duplicates.len(), 1);
            let dup = a.refusal(DeviceIndex(0)).unwrap();
            assert_eq!(dup.devices, vec![order[0].to_owned(), order[1].to_owned()]);
            assert!(dup.to_string().contains("cloned LUN"), "{dup}");
            assert!(a.refusal(DeviceIndex(1)).is_none());
        }
    }

    #[test]
    fn distinct_identities_are_assigned_by_index() {
        let volume = [sanfs(1), sanfs(2), sanfs(3)];
        let a = assign_devices(&volume, &named(&[("c", sanfs(3)), ("a", sanfs(1))]));
        assert_eq!(a.by_index, vec![Some(1), None, Some(0)]);
        assert!(a.duplicates.is_empty() && a.foreign.is_empty());
    }

    const VG: &str = r#"
vg0 {
id = "AAAAAA-AAAA-AAAA-AAAA-AAAA-AAAA-AAAAAA"
seqno = 7
status = ["RESIZEABLE", "READ", "WRITE"]
flags = []
extent_size = 8192
max_lv = 0
max_pv = 0
physical_volumes {
pv0 {
id = "BBBBBB-BBBB-BBBB-BBBB-BBBB-BBBB-BBBBBB"
status = ["ALLOCATABLE"]
flags = []
dev_size = 2097152
pe_start = 2048
pe_count = 255
}
pv1 {
id = "CCCCCC-CCCC-CCCC-CCCC-CCCC-CCCC-CCCCCC"
status = ["ALLOCATABLE"]
flags = []
dev_size = 2097152
pe_start = 2048
pe_count = 255
}
}
logical_volumes {
lv0 {
id = "DDDDDD-DDDD-DDDD-DDDD-DDDD-DDDD-DDDDDD"
status = ["READ", "WRITE", "VISIBLE"]
flags = []
segment_count = 1
segment1 {
start_extent = 0
extent_count = 10
type = "striped"
stripe_count = 1
stripes = ["pv0", 0]
}
}
}
}
contents = "Text Format Volume Group"
version = 1
"#;

    fn meta(edit: impl Fn(String) -> String) -> VgMetadata {
        parse_vg_metadata(edit(VG.to_owned()).as_bytes()).unwrap()
    }

    fn reading(m: &VgMetadata, i: usize, name: &str) -> PvReading {
        PvReading {
            name: name.to_owned(),
            pv_id: m.pvs[i].id,
            good_copies: vec![(m.name.clone(), m.seqno)],
            bad_copies: Vec::new(),
        }
    }

    #[test]
    fn a_sound_vg_passes_without_a_word() {
        let m = meta(|s| s);
        let v = check_lv_import(&m, "lv0", &[reading(&m, 0, "/d0"), reading(&m, 1, "/d1")]);
        assert_eq!(v, ImportVerdict::default());
    }

    #[test]
    fn exported_vgs_read_only_lvs_and_duplicate_pvs_are_refused() {
        let m = meta(|s| {
            s.replace(
                r#""RESIZEABLE", "READ", "WRITE""#,
                r#""RESIZEABLE", "READ", "WRITE", "EXPORTED""#,
            )
        });
        let v = check_lv_import(&m, "lv0", &[reading(&m, 0, "/d0")]);
        assert!(v.refusals[0].contains("exported"), "{v:?}");

        let m = meta(|s| s.replace(r#"["READ", "WRITE", "VISIBLE"]"#, r#"["READ", "VISIBLE"]"#));
        let v = check_lv_import(&m, "lv0", &[reading(&m, 0, "/d0")]);
        assert!(v.refusals[0].contains("read-only"), "{v:?}");

        let m = meta(|s| s);
        let v = check_lv_import(
            &m,
            "lv0",
            &[reading(&m, 0, "/d0"), reading(&m, 0, "/d0-clone")],
        );
        assert_eq!(v.refusals.len(), 1, "{v:?}");
        assert!(v.refusals[0].contains("/d0, /d0-clone"), "{v:?}");
    }

    #[test]
    fn a_missing_pv_is_refused_under_the_lv_and_a_warning_elsewhere() {
        let on = meta(|s| s.replacen("flags = []\ndev_size", "flags = [\"MISSING\"]\ndev_size", 1));
        assert_eq!(on.pvs[0].flags, vec!["MISSING".to_owned()]);
        let v = check_lv_import(&on, "lv0", &[reading(&on, 1, "/d1")]);
        assert!(v.refusals[0].contains("MISSING"), "{v:?}");
        assert!(v.warnings.is_empty());

        let off = meta(|s| {
            let at = s.find("pv1 {").unwrap();
            let (head, tail) = s.split_at(at);
            format!(
                "{head}{}",
                tail.replacen("flags = []", "flags = [\"MISSING\"]", 1)
            )
        });
        assert_eq!(off.pvs[1].flags, vec!["MISSING".to_owned()]);
        let v = check_lv_import(&off, "lv0", &[reading(&off, 0, "/d0")]);
        assert!(v.refusals.is_empty(), "{v:?}");
        assert!(v.warnings[0].contains("MISSING"), "{v:?}");
    }

    #[test]
    fn a_damaged_or_stale_copy_is_a_warning() {
        let m = meta(|s| s);
        let mut r = reading(&m, 0, "/d0");
        r.bad_copies.push("checksum mismatch".into());
        r.good_copies.push(("vg0".into(), 6));
        let v = check_lv_import(&m, "lv0", &[r]);
        assert!(v.refusals.is_empty(), "{v:?}");
        assert_eq!(v.warnings.len(), 2, "{v:?}");
        assert!(v.warnings[0].contains("damaged and was skipped (checksum mismatch)"));
        assert!(v.warnings[0].contains("another copy on this PV was read"));
        assert!(v.warnings[1].contains("stale (seqno 6 < 7)"));
    }
}
