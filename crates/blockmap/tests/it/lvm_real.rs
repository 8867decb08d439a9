//! LVM2 import checked against the real lvm2 tools.
//!
//! The test makes sparse files, attaches them as loop devices, and lets `pvcreate`, `vgcreate`,
//! `lvcreate` and `lvextend` write real LVM2 labels and metadata (with activation off, so no
//! device-mapper is needed). It then reads the raw devices itself, parses them with
//! `sanfs_blockmap::lvm`, builds each LV's volume and compares the mapping with what `lvs`
//! and `pvs` report, offset by offset, computing the expected physical location with the
//! kernel's striped-target formula written out here independently.
//!
//! The lvm2 commands see only the loop devices this test made (a `devices/filter` that
//! accepts nothing else), never touch `/etc/lvm` (no backups, archives, devices file or
//! hints), and everything is removed by a drop guard, also when an assertion fails.
//!
//! Needs root, lvm2 and loop devices; without them it says it was skipped and passes, or fails
//! under `SANFS_REQUIRE_ROOT=1` (CI: `sanfs_testcluster::skip_unless`). Set `SANFS_LVM_IT_SEED` to replay the random offsets of an earlier run.

use std::collections::BTreeMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::process::Command;

use sanfs_blockmap::lvm::{
    LABEL_SCAN_BYTES, MDA_HEADER_SIZE, PV_EXT_USED, PvLabel, VgMetadata, lv_map, parse_mda_header,
    parse_pv_label, parse_vg_metadata,
};
use sanfs_blockmap::volume::{LvmPvId, Volume};
use sanfs_testcluster::{Need, skip_unless};

const KIB: u64 = 1024;
const MIB: u64 = 1024 * KIB;
const BLOCK_SIZE: u32 = 4096;

/// A scratch directory with loop devices and volume groups, all removed on drop.
struct Lab {
    dir: PathBuf,
    loops: Vec<String>,
    vgs: Vec<String>,
}

impl Lab {
    fn new() -> Lab {
        let dir = std::env::temp_dir().join(format!("sanfs-lvm-it-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        Lab {
            dir,
            loops: Vec::new(),
            vgs: Vec::new(),
        }
    }

    /// A sparse file of `size` bytes attached as a loop device; returns the device path.
    fn add_loop(&mut self, size: u64) -> String {
        let file = self.dir.join(format!("lun{}.img", self.loops.len()));
        File::create(&file).unwrap().set_len(size).unwrap();
        let out = Command::new("losetup")
            .args(["-f", "--show"])
            .arg(&file)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "losetup failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let dev = String::from_utf8(out.stdout).unwrap().trim().to_owned();
        assert!(dev.starts_with("/dev/loop"), "losetup printed {dev:?}");
        self.loops.push(dev.clone());
        dev
    }

    /// `--config` for every lvm2 command: only our loop devices, no device-mapper, no udev,
    /// nothing written under /etc/lvm or /run/lvm.
    fn config(&self) -> String {
        let accept: Vec<String> = self.loops.iter().map(|d| format!("\"a|^{d}$|\"")).collect();
        format!(
            "devices {{ filter = [ {}, \"r|.*|\" ] scan_lvs = 0 obtain_device_list_from_udev = 0 \
             use_devicesfile = 0 hints = \"none\" }} global {{ activation = 0 }} \
             backup {{ backup = 0 archive = 0 }}",
            accept.join(", ")
        )
    }

    fn try_lvm(&self, command: &str, args: &[&str]) -> Result<String, String> {
        let out = Command::new("lvm")
            .arg(command)
            .arg("--config")
            .arg(self.config())
            .args(args)
            .env("LVM_SUPPRESS_FD_WARNINGS", "1")
            .output()
            .map_err(|e| format!("lvm {command}: {e}"))?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        } else {
            Err(format!(
                "lvm {command} {args:?} failed ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            ))
        }
    }

    fn lvm(&self, command: &str, args: &[&str]) -> String {
        self.try_lvm(command, args)
            .unwrap_or_else(|e| panic!("{e}"))
    }

    fn vgcreate(&mut self, name: &str, extra: &[&str], pvs: &[&str]) {
        let mut args = extra.to_vec();
        args.push(name);
        args.extend_from_slice(pvs);
        self.lvm("vgcreate", &args);
        self.vgs.push(name.to_owned());
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        let mut problems = Vec::new();
        for vg in self.vgs.clone() {
            if let Err(e) = self.try_lvm("vgremove", &["-f", &vg]) {
                problems.push(e);
            }
        }
        if !self.loops.is_empty() {
            let mut args = vec!["-ff", "-y"];
            args.extend(self.loops.iter().map(String::as_str));
            // Fails for devices that never became PVs; that is fine.
            let _ = self.try_lvm("pvremove", &args);
        }
        for dev in &self.loops {
            match Command::new("losetup").arg("-d").arg(dev).output() {
                Ok(o) if o.status.success() => {}
                Ok(o) => problems.push(format!(
                    "losetup -d {dev}: {}",
                    String::from_utf8_lossy(&o.stderr)
                )),
                Err(e) => problems.push(format!("losetup -d {dev}: {e}")),
            }
        }
        if let Err(e) = std::fs::remove_dir_all(&self.dir) {
            problems.push(format!("remove {}: {e}", self.dir.display()));
        }
        for p in problems {
            eprintln!("lvm_real cleanup: {p}");
        }
    }
}

fn read_at(dev: &str, offset: u64, len: u64) -> Vec<u8> {
    let mut buf = vec![0u8; usize::try_from(len).unwrap()];
    File::open(dev)
        .unwrap()
        .read_exact_at(&mut buf, offset)
        .unwrap();
    buf
}

/// One PV as this test read it off the raw device.
struct PvImage {
    label: PvLabel,
    /// The VG metadata from each of its metadata areas.
    metadata: Vec<VgMetadata>,
    /// Whether the committed text wrapped around the end of a metadata area.
    wrapped: bool,
}

fn read_pv(dev: &str) -> PvImage {
    let label = parse_pv_label(&read_at(dev, 0, LABEL_SCAN_BYTES as u64))
        .unwrap_or_else(|e| panic!("{dev}: {e}"));
    let mut metadata = Vec::new();
    let mut wrapped = false;
    for area in &label.metadata_areas {
        let header = parse_mda_header(&read_at(dev, area.offset, MDA_HEADER_SIZE as u64), *area)
            .unwrap_or_else(|e| panic!("{dev}: {e}"));
        let location = header
            .metadata_location()
            .unwrap_or_else(|e| panic!("{dev}: {e}"));
        wrapped |= location.pieces.len() > 1;
        let mut text = Vec::new();
        for piece in &location.pieces {
            text.extend(read_at(dev, piece.offset, piece.len));
        }
        location
            .verify_text(&text)
            .unwrap_or_else(|e| panic!("{dev}: {e}"));
        metadata.push(parse_vg_metadata(&text).unwrap_or_else(|e| panic!("{dev}: {e}")));
    }
    PvImage {
        label,
        metadata,
        wrapped,
    }
}

/// What `pvs` says about one PV.
#[derive(Debug)]
struct PvReport {
    uuid: LvmPvId,
    pe_start: u64,
    dev_size: u64,
    pe_count: u64,
}

fn report_pvs(lab: &Lab, devs: &[&str]) -> BTreeMap<String, PvReport> {
    let mut args = vec![
        "--noheadings",
        "--units",
        "b",
        "--nosuffix",
        "--separator",
        "|",
        "-o",
        "pv_name,pv_uuid,pe_start,dev_size,pv_pe_count",
    ];
    args.extend_from_slice(devs);
    lab.lvm("pvs", &args)
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|line| {
            let f: Vec<&str> = line.trim().split('|').collect();
            assert_eq!(f.len(), 5, "pvs line {line:?}");
            (
                f[0].to_owned(),
                PvReport {
                    uuid: LvmPvId::parse(f[1]).unwrap(),
                    pe_start: f[2].parse().unwrap(),
                    dev_size: f[3].parse().unwrap(),
                    pe_count: f[4].parse().unwrap(),
                },
            )
        })
        .collect()
}

/// One LV segment as `lvs --segments` reports it, in bytes.
#[derive(Debug)]
struct SegReport {
    start: u64,
    size: u64,
    stripes: u64,
    stripe_size: u64,
    /// (PV device path, first PE, last PE) per stripe.
    ranges: Vec<(String, u64, u64)>,
}

fn report_segments(lab: &Lab, vg: &str) -> BTreeMap<String, Vec<SegReport>> {
    let out = lab.lvm(
        "lvs",
        &[
            "--segments",
            "--noheadings",
            "--units",
            "b",
            "--nosuffix",
            "--separator",
            "|",
            "-o",
            "lv_name,seg_start,seg_size,stripes,stripe_size,seg_pe_ranges",
            vg,
        ],
    );
    let mut lvs: BTreeMap<String, Vec<SegReport>> = BTreeMap::new();
    for line in out.lines().filter(|l| !l.trim().is_empty()) {
        let f: Vec<&str> = line.trim().split('|').collect();
        assert_eq!(f.len(), 6, "lvs line {line:?}");
        let ranges = f[5]
            .split_whitespace()
            .map(|r| {
                let (dev, pes) = r.rsplit_once(':').unwrap();
                let (first, last) = pes.split_once('-').unwrap();
                (
                    dev.to_owned(),
                    first.parse().unwrap(),
                    last.parse().unwrap(),
                )
            })
            .collect();
        lvs.entry(f[0].to_owned()).or_default().push(SegReport {
            start: f[1].parse().unwrap(),
            size: f[2].parse().unwrap(),
            stripes: f[3].parse().unwrap(),
            stripe_size: f[4].parse().unwrap(),
            ranges,
        });
    }
    for segs in lvs.values_mut() {
        segs.sort_by_key(|s| s.start);
    }
    lvs
}

/// A tiny deterministic generator for sample offsets (xorshift64*).
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % n.max(1)
    }
}

/// One stripe of a reported segment: its PV, the byte offset of its first PE and its length.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Leg {
    pv: LvmPvId,
    start: u64,
    len: u64,
}

/// A reported segment with its stripes resolved to PV UUIDs and byte offsets.
struct ModelSeg<'a> {
    report: &'a SegReport,
    legs: Vec<Leg>,
}

/// Where the kernel's striped target puts LV byte `x`, from the tools' report alone. Returns
/// `None` for bytes in a partial last row, which the kernel target cannot map.
fn expected_location(segs: &[ModelSeg<'_>], x: u64) -> Option<(LvmPvId, u64)> {
    let seg = segs
        .iter()
        .find(|s| s.report.start <= x && x < s.report.start + s.report.size)
        .unwrap();
    let (rel, n, unit) = (
        x - seg.report.start,
        seg.report.stripes,
        seg.report.stripe_size,
    );
    if n == 1 {
        return Some((seg.legs[0].pv, seg.legs[0].start + rel));
    }
    let chunk = rel / unit;
    let leg = seg.legs[(chunk % n) as usize];
    let off = (chunk / n) * unit + rel % unit;
    (off < leg.len).then_some((leg.pv, leg.start + off))
}

/// Checks one LV's volume against the tools' report.
fn check_lv(
    vg_meta: &VgMetadata,
    lv: &str,
    report: &[SegReport],
    pvs: &BTreeMap<String, PvReport>,
    extent: u64,
    rng: &mut Rng,
) {
    let volume: Volume = vg_meta
        .lv_volume(lv, BLOCK_SIZE)
        .unwrap_or_else(|e| panic!("{lv}: {e}"));
    let size: u64 = report.iter().map(|s| s.size).sum();
    assert_eq!(volume.size_bytes(), size, "{lv}: size");

    // The metadata's segments agree with the report.
    let meta = vg_meta.lv(lv).unwrap();
    assert_eq!(meta.segments.len(), report.len(), "{lv}: segment count");
    for (m, r) in meta.segments.iter().zip(report) {
        assert_eq!(m.start_extent * extent, r.start, "{lv}: segment start");
        assert_eq!(m.extent_count * extent, r.size, "{lv}: segment size");
        assert_eq!(m.stripes.len() as u64, r.stripes, "{lv}: stripes");
        assert_eq!(
            m.stripe_size_sectors * 512,
            r.stripe_size,
            "{lv}: stripe size"
        );
    }

    // Legs from the report alone: PV UUID from pvs, byte offset from pe_start + PE * extent.
    let segs: Vec<ModelSeg<'_>> = report
        .iter()
        .map(|s| {
            assert_eq!(s.ranges.len() as u64, s.stripes, "{lv}: ranges per stripe");
            let legs = s
                .ranges
                .iter()
                .map(|(dev, first, last)| {
                    let pv = &pvs[dev];
                    assert!(*last < pv.pe_count, "{lv}: PE range past {dev}");
                    let len = (last - first + 1) * extent;
                    assert_eq!(len * s.stripes, s.size, "{lv}: stripe length");
                    Leg {
                        pv: pv.uuid,
                        start: pv.pe_start + first * extent,
                        len,
                    }
                })
                .collect();
            ModelSeg { report: s, legs }
        })
        .collect();

    // Offsets: every segment's edges, the first stripe-unit edges, and random ones.
    let mut offsets = Vec::new();
    for s in segs.iter().map(|s| s.report) {
        let unit = s.stripe_size.max(BLOCK_SIZE.into());
        for k in 0..=2 * s.stripes {
            let edge = s.start + k * unit;
            if edge < s.start + s.size {
                offsets.extend([edge, edge + 1, edge + unit - 1]);
            }
        }
        offsets.extend([s.start + s.size - 1, s.start + s.size / 2]);
    }
    offsets.extend((0..300).map(|_| rng.below(size)));
    let mut tail_bytes = 0;
    for &x in offsets.iter().filter(|&&x| x < size) {
        let runs = lv_map(&volume, x, 1).unwrap();
        assert_eq!(runs.len(), 1);
        let got = (runs[0].pv, runs[0].phys_off);
        match expected_location(&segs, x) {
            Some(expect) => assert_eq!(got, expect, "{lv}: LV byte {x}"),
            None => tail_bytes += 1,
        }
    }

    // Random ranges: runs are contiguous in LV order and each run's first and last byte lie
    // where the single-byte mapping puts them.
    for _ in 0..50 {
        let off = rng.below(size);
        let len = 1 + rng.below((size - off).min(8 * MIB));
        let runs = lv_map(&volume, off, len).unwrap();
        let mut at = off;
        for r in &runs {
            assert_eq!(r.vol_off, at, "{lv}: runs out of order");
            for (x, phys) in [
                (r.vol_off, r.phys_off),
                (r.vol_off + r.len - 1, r.phys_off + r.len - 1),
            ] {
                if let Some(expect) = expected_location(&segs, x) {
                    assert_eq!((r.pv, phys), expect, "{lv}: LV byte {x} in {off}+{len}");
                }
            }
            at += r.len;
        }
        assert_eq!(at, off + len, "{lv}: runs do not add up");
    }

    // The whole LV covers exactly its reported physical extents, each byte once.
    let mut runs: Vec<Leg> = lv_map(&volume, 0, size)
        .unwrap()
        .iter()
        .map(|r| Leg {
            pv: r.pv,
            start: r.phys_off,
            len: r.len,
        })
        .collect();
    runs.sort_unstable();
    let mut expected: Vec<Leg> = segs.iter().flat_map(|s| s.legs.iter().copied()).collect();
    expected.sort_unstable();
    let coalesce = |v: &[Leg]| {
        let mut out: Vec<Leg> = Vec::new();
        for &leg in v {
            match out.last_mut() {
                Some(last) if last.pv == leg.pv && last.start + last.len == leg.start => {
                    last.len += leg.len;
                }
                Some(last) => {
                    assert!(
                        last.pv != leg.pv || last.start + last.len <= leg.start,
                        "{lv}: overlap on {}",
                        leg.pv
                    );
                    out.push(leg);
                }
                None => out.push(leg),
            }
        }
        out
    };
    assert_eq!(
        coalesce(&runs),
        coalesce(&expected),
        "{lv}: physical coverage"
    );
    eprintln!(
        "lvm_real: {lv}: {} segment(s), {size} bytes, {} offsets checked ({tail_bytes} in a partial row)",
        report.len(),
        offsets.len()
    );
}

/// Reads every PV of a VG, checks labels against `pvs` and that all metadata copies and the
/// `vgcfgbackup` file agree; returns the metadata.
fn read_vg(lab: &Lab, vg: &str, devs: &[&str], pvs: &BTreeMap<String, PvReport>) -> VgMetadata {
    let mut copies = Vec::new();
    for dev in devs {
        let image = read_pv(dev);
        let report = &pvs[*dev];
        assert_eq!(image.label.pv_id, report.uuid, "{dev}: PV UUID");
        assert_eq!(
            image.label.device_size_bytes, report.dev_size,
            "{dev}: size"
        );
        assert_eq!(
            image.label.data_areas[0].offset, report.pe_start,
            "{dev}: pe_start"
        );
        let ext = image.label.extension.as_ref().unwrap();
        assert_eq!(ext.version, 2, "{dev}: extension version");
        assert_ne!(ext.flags & PV_EXT_USED, 0, "{dev}: PV_EXT_USED");
        assert!(!image.metadata.is_empty(), "{dev}: no metadata area");
        copies.extend(image.metadata);
    }
    let first = copies[0].clone();
    for c in &copies {
        assert_eq!(c, &first, "{vg}: metadata copies differ");
    }
    let backup = lab.dir.join(format!("{vg}.vgcfg"));
    lab.lvm("vgcfgbackup", &["-f", backup.to_str().unwrap(), vg]);
    let from_backup = parse_vg_metadata(&std::fs::read(&backup).unwrap()).unwrap();
    assert_eq!(
        from_backup, first,
        "{vg}: vgcfgbackup differs from the metadata area"
    );
    assert_eq!(first.name, vg);
    for (dev, report) in pvs {
        if devs.contains(&dev.as_str()) {
            let pv = first.pv_by_id(&report.uuid).unwrap();
            assert_eq!(pv.pe_start_sectors * 512, report.pe_start);
            assert_eq!(pv.pe_count, report.pe_count);
            assert_eq!(pv.dev_size_sectors.map(|s| s * 512), Some(report.dev_size));
        }
    }
    first
}

#[test]
fn lvm_import_matches_the_lvm2_tools() {
    if skip_unless(
        "lvm_import_matches_the_lvm2_tools",
        &[Need::Tool("lvm"), Need::LoopDevices],
    ) {
        return;
    }
    let seed = std::env::var("SANFS_LVM_IT_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| 0x9e37_79b9_7f4a_7c15 ^ u64::from(std::process::id()));
    eprintln!("lvm_real: seed {seed} (set SANFS_LVM_IT_SEED to replay)");
    let mut rng = Rng(seed | 1);

    let mut lab = Lab::new();
    let pid = std::process::id();

    // VG 1: four PVs with default 4 MiB extents; the last PV has a small metadata area and a
    // 64 KiB pe_start, so its metadata ring wraps after a few dozen updates.
    let devs: Vec<String> = (0..4).map(|_| lab.add_loop(96 * MIB)).collect();
    let devs: Vec<&str> = devs.iter().map(String::as_str).collect();
    lab.lvm("pvcreate", &["-y", devs[0], devs[1], devs[2]]);
    lab.lvm(
        "pvcreate",
        &[
            "-y",
            "--metadatasize",
            "32k",
            "--dataalignment",
            "64k",
            devs[3],
        ],
    );
    let vg1 = format!("sanfs_it_{pid}_1");
    lab.vgcreate(&vg1, &[], &devs);
    let lvcreate = |name: &str, args: &[&str]| {
        let mut all = vec!["-an", "-Zn", "-y", "-n", name];
        all.extend_from_slice(args);
        all.push(&vg1);
        lab.lvm("lvcreate", &all);
    };
    lvcreate("lin", &["-i1", "-l3"]);
    lvcreate("s2", &["-i2", "-I4k", "-l4"]);
    lvcreate("s3", &["-i3", "-I64k", "-l6"]);
    lvcreate("s4", &["-i4", "-I1m", "-l8"]);
    lvcreate("two", &["-i2", "-I128k", "-l4"]);
    lab.lvm(
        "lvextend",
        &["-i3", "-I256k", "-l+6", &format!("{vg1}/two")],
    );

    // Update the metadata until the small ring on the last PV holds a wrapped copy.
    let mut updates = 0;
    while !read_pv(devs[3]).wrapped {
        updates += 1;
        assert!(
            updates <= 200,
            "metadata never wrapped in {updates} updates"
        );
        lab.lvm("vgchange", &["--addtag", &format!("t{updates}"), &vg1]);
    }
    eprintln!("lvm_real: metadata wrapped after {updates} updates");

    let pvs = report_pvs(&lab, &devs);
    let meta = read_vg(&lab, &vg1, &devs, &pvs);
    assert_eq!(meta.extent_size_bytes(), 4 * MIB);
    assert_eq!(meta.status.len(), 3);
    let report = report_segments(&lab, &vg1);
    assert_eq!(report.len(), 5);
    assert_eq!(report["two"].len(), 2, "lvextend with another stripe count");
    for (lv, segs) in &report {
        check_lv(&meta, lv, segs, &pvs, meta.extent_size_bytes(), &mut rng);
    }

    // VG 2: 384 KiB extents (not a power of two) with 256 KiB stripes: each stripe of a
    // 6-extent, 2-stripe LV holds 4.5 stripe units.
    let odd: Vec<String> = (0..2).map(|_| lab.add_loop(32 * MIB)).collect();
    let odd: Vec<&str> = odd.iter().map(String::as_str).collect();
    lab.lvm("pvcreate", &["-y", odd[0], odd[1]]);
    let vg2 = format!("sanfs_it_{pid}_2");
    lab.vgcreate(&vg2, &["-s", "384k"], &odd);
    lab.lvm(
        "lvcreate",
        &[
            "-an", "-Zn", "-y", "-n", "odd", "-i2", "-I256k", "-l6", &vg2,
        ],
    );
    let pvs = report_pvs(&lab, &odd);
    let meta = read_vg(&lab, &vg2, &odd, &pvs);
    assert_eq!(meta.extent_size_bytes(), 384 * KIB);
    let report = report_segments(&lab, &vg2);
    let segs = &report["odd"];
    assert_eq!((segs[0].stripes, segs[0].stripe_size), (2, 256 * KIB));
    check_lv(&meta, "odd", segs, &pvs, meta.extent_size_bytes(), &mut rng);
    let volume = meta.lv_volume("odd", BLOCK_SIZE).unwrap();
    assert_eq!(
        volume.segments().len(),
        2,
        "whole rows, then the partial row"
    );
}
