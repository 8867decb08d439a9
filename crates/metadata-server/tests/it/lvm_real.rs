//! `sanfs-mds format` and `volume inspect --map` on an LVM2 logical volume made by the real
//! lvm2 tools on loop devices (with activation off, so no device-mapper is needed), and the
//! server's import-rule check at start (`serve::check_lvm_at_start`) on the same states.
//!
//! Checks that format writes nothing to the PVs (the label and metadata area bytes are
//! identical afterwards, and `pvs` still lists the PVs in their VG) and that every `--map`
//! answer agrees with `lvs --segments -o+seg_pe_ranges`, computed with the kernel's striped
//! target formula written out here. The lvm2 commands see only this test's loop devices and
//! write nothing under /etc/lvm; a drop guard removes the VG and the loop devices by exact
//! name, also when an assertion fails. Without root, lvm2 or loop devices the test says
//! why it was skipped and passes, or fails under `SANFS_REQUIRE_ROOT=1` (the same gate as
//! blockmap's `lvm_real`: `sanfs_testcluster::skip_unless`).

use std::collections::BTreeMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use sanfs_blockmap::lvm::{
    INITIAL_CRC, LABEL_SCAN_BYTES, MDA_HEADER_SIZE, calc_crc, parse_mda_header, parse_pv_label,
};
use sanfs_mds::device::Lun;
use sanfs_testcluster::{Need, skip_unless};

use crate::common::{MIB, mds, parse_map_line, toml_paths, write_config};

/// Loop devices and a volume group, removed on drop.
struct Lab {
    dir: tempfile::TempDir,
    loops: Vec<String>,
    vgs: Vec<String>,
}

impl Lab {
    fn new() -> Lab {
        Lab {
            dir: tempfile::tempdir().unwrap(),
            loops: Vec::new(),
            vgs: Vec::new(),
        }
    }

    fn add_loop(&mut self, size: u64) -> String {
        let file = self.dir.path().join(format!("pv{}.img", self.loops.len()));
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

    /// A loop device over a copy of loop device `of`'s file: a cloned LUN.
    fn add_loop_copy(&mut self, of: usize) -> String {
        let from = self.dir.path().join(format!("pv{of}.img"));
        let file = self.dir.path().join(format!("pv{}.img", self.loops.len()));
        std::fs::copy(&from, &file).unwrap();
        let out = Command::new("losetup")
            .args(["-f", "--show"])
            .arg(&file)
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        let dev = String::from_utf8(out.stdout).unwrap().trim().to_owned();
        assert!(dev.starts_with("/dev/loop"), "losetup printed {dev:?}");
        self.loops.push(dev.clone());
        dev
    }

    /// Detaches one of our loop devices now.
    fn remove_loop(&mut self, dev: &str) {
        let out = Command::new("losetup").arg("-d").arg(dev).output().unwrap();
        assert!(out.status.success(), "{out:?}");
        self.loops.retain(|d| d != dev);
    }

    /// Only our loop devices, no device-mapper, no udev, nothing under /etc/lvm or /run/lvm.
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
        for p in problems {
            eprintln!("lvm_real cleanup: {p}");
        }
    }
}

/// `pvs`: device path -> (PV UUID, VG name, pe_start bytes).
fn report_pvs(lab: &Lab) -> BTreeMap<String, (String, String, u64)> {
    let mut args = vec![
        "--noheadings",
        "--units",
        "b",
        "--nosuffix",
        "--separator",
        "|",
        "-o",
        "pv_name,pv_uuid,vg_name,pe_start",
    ];
    args.extend(lab.loops.iter().map(String::as_str));
    lab.lvm("pvs", &args)
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|line| {
            let f: Vec<&str> = line.trim().split('|').collect();
            assert_eq!(f.len(), 4, "pvs line {line:?}");
            (
                f[0].to_owned(),
                (f[1].to_owned(), f[2].to_owned(), f[3].parse().unwrap()),
            )
        })
        .collect()
}

/// One segment of `lvs --segments -o+seg_pe_ranges`, in bytes.
#[derive(Debug)]
struct SegReport {
    start: u64,
    size: u64,
    stripes: u64,
    stripe_size: u64,
    /// (PV device path, first PE) per stripe.
    ranges: Vec<(String, u64)>,
}

fn report_segments(lab: &Lab, lv: &str) -> Vec<SegReport> {
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
            "seg_start,seg_size,stripes,stripe_size,seg_pe_ranges",
            lv,
        ],
    );
    let mut segs: Vec<SegReport> = out
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|line| {
            let f: Vec<&str> = line.trim().split('|').collect();
            assert_eq!(f.len(), 5, "lvs line {line:?}");
            SegReport {
                start: f[0].parse().unwrap(),
                size: f[1].parse().unwrap(),
                stripes: f[2].parse().unwrap(),
                stripe_size: f[3].parse().unwrap(),
                ranges: f[4]
                    .split_whitespace()
                    .map(|r| {
                        let (dev, pes) = r.rsplit_once(':').unwrap();
                        let first = pes.split_once('-').unwrap().0;
                        (dev.to_owned(), first.parse().unwrap())
                    })
                    .collect(),
            }
        })
        .collect();
    segs.sort_by_key(|s| s.start);
    segs
}

/// Where the kernel's striped target puts LV byte `x`: (PV path, physical byte).
fn expected_location(
    segs: &[SegReport],
    pvs: &BTreeMap<String, (String, String, u64)>,
    extent: u64,
    x: u64,
) -> (String, u64) {
    let seg = segs
        .iter()
        .find(|s| s.start <= x && x < s.start + s.size)
        .unwrap();
    let rel = x - seg.start;
    let (stripe, off) = if seg.stripes == 1 {
        (0, rel)
    } else {
        let chunk = rel / seg.stripe_size;
        (
            (chunk % seg.stripes) as usize,
            (chunk / seg.stripes) * seg.stripe_size + rel % seg.stripe_size,
        )
    };
    let (dev, first_pe) = &seg.ranges[stripe];
    (dev.clone(), pvs[dev].2 + first_pe * extent + off)
}

/// The bytes before the first PE of each PV: LVM's label and metadata area.
fn pv_headers(devs: &[String], pvs: &BTreeMap<String, (String, String, u64)>) -> Vec<Vec<u8>> {
    devs.iter()
        .map(|d| {
            let lun = Lun::open(Path::new(d), false).unwrap();
            lun.read_at(0, usize::try_from(pvs[d].2).unwrap()).unwrap()
        })
        .collect()
}

#[test]
fn format_and_map_an_lvm_lv_made_by_lvm2() {
    if skip_unless(
        "format_and_map_an_lvm_lv_made_by_lvm2",
        &[Need::Tool("lvm"), Need::LoopDevices],
    ) {
        return;
    }
    let mut lab = Lab::new();
    let devs: Vec<String> = (0..2).map(|_| lab.add_loop(64 * MIB)).collect();
    let dev_refs: Vec<&str> = devs.iter().map(String::as_str).collect();
    let mut args = vec!["-y"];
    args.extend(&dev_refs);
    lab.lvm("pvcreate", &args);
    let vg = format!("sanfs_mds_it_{}", std::process::id());
    let mut args = vec![vg.as_str()];
    args.extend(&dev_refs);
    lab.lvm("vgcreate", &args);
    lab.vgs.push(vg.clone());
    lab.lvm(
        "lvcreate",
        &["-an", "-Zn", "-y", "-n", "data", "-i2", "-I64k", "-l8", &vg],
    );
    // A second, linear segment on one PV, and a second LV.
    lab.lvm("lvextend", &["-i1", "-l+3", &format!("{vg}/data")]);
    lab.lvm("lvcreate", &["-an", "-Zn", "-y", "-n", "other", "-l1", &vg]);
    // An LV whose segment type sanfs cannot import.
    lab.lvm(
        "lvcreate",
        &[
            "-an", "-Zn", "-y", "-n", "virt", "--type", "zero", "-L4m", &vg,
        ],
    );

    let pvs = report_pvs(&lab);
    let extent: u64 = lab
        .lvm(
            "vgs",
            &[
                "--noheadings",
                "--units",
                "b",
                "--nosuffix",
                "-o",
                "vg_extent_size",
                &vg,
            ],
        )
        .trim()
        .parse()
        .unwrap();
    let segs = report_segments(&lab, &format!("{vg}/data"));
    assert_eq!(segs.len(), 2, "{segs:?}");
    assert_eq!((segs[0].stripes, segs[0].stripe_size), (2, 64 * 1024));
    let headers = pv_headers(&devs, &pvs);

    let dir = tempfile::tempdir().unwrap();
    let dev_paths: Vec<PathBuf> = devs.iter().map(PathBuf::from).collect();
    let config = write_config(
        dir.path(),
        &format!(
            "layout = \"lvm\"\nlvm_vg = \"{vg}\"\nlvm_lv = \"data\"\ndevices = {}",
            toml_paths(&dev_paths)
        ),
    );
    let run = mds(["format", "--config", config.to_str().unwrap()]);
    assert!(run.success(), "{run:?}");
    assert!(
        run.stdout
            .contains(&format!("layout: lvm, logical volume {vg}/data")),
        "{run:?}"
    );
    let lv_size: u64 = segs.iter().map(|s| s.size).sum();
    assert!(
        run.stdout.contains(&format!("total: {lv_size} bytes")),
        "{run:?}"
    );
    for (dev, (uuid, _, _)) in &pvs {
        assert!(run.stdout.contains(&format!("{uuid} {dev} ")), "{run:?}");
    }

    // Nothing written to the PVs: same bytes, and LVM still sees them in the VG.
    assert_eq!(pv_headers(&devs, &pvs), headers, "format wrote to a PV");
    for h in &headers {
        assert_eq!(&h[512..520], b"LABELONE");
    }
    let after = report_pvs(&lab);
    assert_eq!(after.len(), 2);
    for (dev, (_, pv_vg, _)) in &after {
        assert_eq!(pv_vg, &vg, "{dev}");
    }

    // Inspect: the PVs, the VG and its segments; --map needs --lv with two LVs.
    let mut inspect = vec!["volume".to_owned(), "inspect".to_owned()];
    inspect.extend(devs.iter().cloned());
    let run = mds(&inspect);
    assert!(run.success(), "{run:?}");
    for (dev, (uuid, _, pe_start)) in &pvs {
        let block = format!(
            "{dev}: {} bytes\n  LVM2 physical volume\n    pv uuid:      {uuid}\n",
            64 * MIB
        );
        assert!(run.stdout.contains(&block), "{block}\n{run:?}");
        assert!(
            run.stdout
                .contains(&format!("    pe_start:     {pe_start}\n")),
            "{run:?}"
        );
    }
    assert!(
        run.stdout.contains(&format!("volume group {vg} ")),
        "{run:?}"
    );
    let mut args = inspect.clone();
    args.extend(["--map".to_owned(), "0".to_owned()]);
    let run = mds(&args);
    assert_eq!(run.code, Some(2), "{run:?}");
    assert!(run.stderr.contains("choose one with --lv"), "{run:?}");

    let mut offsets = vec![lv_size - 1, lv_size / 2 + 777];
    for s in &segs {
        let unit = s.stripe_size.max(4096);
        for k in 0..5 {
            let edge = s.start + k * unit;
            if edge < s.start + s.size {
                offsets.extend([edge, edge + 1, edge + unit - 1]);
            }
        }
        offsets.push(s.start + s.size - 1);
    }
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for _ in 0..10 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        offsets.push(x % lv_size);
    }
    for offset in offsets {
        let mut args = inspect.clone();
        args.extend([
            "--lv".to_owned(),
            "data".to_owned(),
            "--map".to_owned(),
            offset.to_string(),
        ]);
        let run = mds(&args);
        assert!(run.success(), "{run:?}");
        let (_, uuid, path, phys) = parse_map_line(&run.stdout);
        let (dev, expect_phys) = expected_location(&segs, &pvs, extent, offset);
        assert_eq!(
            (path.as_str(), phys),
            (dev.as_str(), expect_phys),
            "{offset}"
        );
        assert_eq!(uuid, format!("lvm:{}", pvs[&dev].0), "{offset}");
    }

    // Refusals: a PV left out, and the wrong VG name.
    let one = write_config(
        dir.path(),
        &format!(
            "layout = \"lvm\"\nlvm_vg = \"{vg}\"\nlvm_lv = \"data\"\ndevices = [\"{}\"]",
            devs[0]
        ),
    );
    let run = mds(["format", "--config", one.to_str().unwrap()]);
    assert_eq!(run.code, Some(2), "{run:?}");
    assert!(
        run.stderr.contains("which is not in volume.devices"),
        "{run:?}"
    );
    let wrong = write_config(
        dir.path(),
        &format!(
            "layout = \"lvm\"\nlvm_vg = \"nosuchvg\"\nlvm_lv = \"data\"\ndevices = {}",
            toml_paths(&dev_paths)
        ),
    );
    let run = mds(["format", "--config", wrong.to_str().unwrap()]);
    assert_eq!(run.code, Some(2), "{run:?}");
    assert!(
        run.stderr.contains(&format!(
            "is a PV of volume group \"{vg}\", not \"nosuchvg\""
        )),
        "{run:?}"
    );
    let zero = write_config(
        dir.path(),
        &format!(
            "layout = \"lvm\"\nlvm_vg = \"{vg}\"\nlvm_lv = \"virt\"\ndevices = {}",
            toml_paths(&dev_paths)
        ),
    );
    let run = mds(["format", "--config", zero.to_str().unwrap()]);
    assert_eq!(run.code, Some(2), "{run:?}");
    assert!(
        run.stderr.contains(&format!("logical volume {vg}/virt: "))
            && run
                .stderr
                .contains("segment type \"zero\" is not supported"),
        "{run:?}"
    );
    assert_eq!(pv_headers(&devs, &pvs), headers, "a refused format wrote");
}

#[test]
fn format_labels_loop_devices() {
    if skip_unless("format_labels_loop_devices", &[Need::LoopDevices]) {
        return;
    }
    let mut lab = Lab::new();
    let devs: Vec<PathBuf> = (0..2)
        .map(|_| PathBuf::from(lab.add_loop(16 * MIB)))
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(
        dir.path(),
        &format!("layout = \"striped\"\ndevices = {}", toml_paths(&devs)),
    );
    let run = mds(["format", "--config", config.to_str().unwrap()]);
    assert!(run.success(), "{run:?}");
    let mut fs = Vec::new();
    for (i, dev) in devs.iter().enumerate() {
        let lun = Lun::open(dev, false).unwrap();
        assert!(lun.is_block_device());
        assert!(lun.logical_block_size() >= 512);
        assert_eq!(lun.size_bytes(), 16 * MIB);
        let bytes = lun.read_at(0, sanfs_blockmap::label::LABEL_SIZE).unwrap();
        let label = sanfs_blockmap::label::DeviceLabel::decode(&bytes).unwrap();
        assert_eq!(label.device_index, i as u32);
        assert_eq!(label.device_size, 16 * MIB);
        fs.push(label.fs_uuid);
    }
    assert_eq!(fs[0], fs[1]);
    let run = mds(["format", "--config", config.to_str().unwrap()]);
    assert_eq!(run.code, Some(2), "{run:?}");
    assert!(run.stderr.contains("holds sanfs label"), "{run:?}");
    let mut args = vec!["volume".to_owned(), "inspect".to_owned()];
    args.extend(devs.iter().map(|d| d.display().to_string()));
    args.extend(["--map".to_owned(), "65536".to_owned()]);
    let run = mds(&args);
    assert!(run.success(), "{run:?}");
    let (index, _, path, phys) = parse_map_line(&run.stdout);
    assert_eq!(
        (index, path.as_str(), phys),
        (1, devs[1].to_str().unwrap(), MIB)
    );
}

/// The import rule on real lvm2 metadata: a read-only LV, an exported VG and a cloned PV are
/// refused by `format` (nothing written) and reported by `volume inspect`; a damaged metadata
/// copy beside a good one is a warning in both. The same rule refuses a clone in the server
/// and the agent (their tests use cloned file LUNs).
#[test]
fn lvm_import_refusals_made_by_lvm2() {
    if skip_unless(
        "lvm_import_refusals_made_by_lvm2",
        &[Need::Tool("lvm"), Need::LoopDevices],
    ) {
        return;
    }
    let mut lab = Lab::new();
    let devs: Vec<String> = (0..2).map(|_| lab.add_loop(32 * MIB)).collect();
    let mut args = vec!["-y", "--pvmetadatacopies", "2"];
    args.extend(devs.iter().map(String::as_str));
    lab.lvm("pvcreate", &args);
    let vg = format!("sanfs_h11_it_{}", std::process::id());
    let mut args = vec![vg.as_str()];
    args.extend(devs.iter().map(String::as_str));
    lab.lvm("vgcreate", &args);
    lab.vgs.push(vg.clone());
    lab.lvm(
        "lvcreate",
        &["-an", "-Zn", "-y", "-n", "data", "-i2", "-I64k", "-l4", &vg],
    );
    lab.lvm(
        "lvcreate",
        &["-an", "-Zn", "-y", "-n", "ro", "-l2", &vg, &devs[0]],
    );
    lab.lvm("lvchange", &["-pr", &format!("{vg}/ro")]);
    lab.lvm(
        "lvcreate",
        &["-an", "-Zn", "-y", "-n", "one", "-l1", &vg, &devs[0]],
    );

    let format = |lv: &str, devices: &[&str]| {
        let dir = tempfile::tempdir().unwrap();
        let config = write_config(
            dir.path(),
            &format!(
                "layout = \"lvm\"\nlvm_vg = \"{vg}\"\nlvm_lv = \"{lv}\"\ndevices = {}",
                toml_paths(devices)
            ),
        );
        let run = mds(["format", "--config", config.to_str().unwrap()]);
        let wrote = dir.path().join("meta.redb").exists();
        (run, wrote)
    };
    let inspect = |devices: &[&str], extra: &[&str]| {
        let mut args = vec!["volume", "inspect"];
        args.extend_from_slice(devices);
        args.extend_from_slice(extra);
        mds(args)
    };
    let both: Vec<&str> = devs.iter().map(String::as_str).collect();
    // The server's check at start on the PVs it opened: the same rule and words.
    let paths: Vec<PathBuf> = devs.iter().map(PathBuf::from).collect();
    let at_start = |lv: &str| {
        let warnings = sanfs_lun::lvm::check_lv_at(&paths, &vg, lv)
            .map(|v| v.warnings)
            .unwrap_or_default();
        let started =
            sanfs_mds::serve::check_lvm_at_start(&paths, &vg, lv).map_err(|e| format!("{e:#}"));
        (started, warnings)
    };
    let (run, wrote) = format("data", &both);
    assert!(run.success() && wrote, "{run:?}");
    assert_eq!(at_start("data"), (Ok(()), Vec::new()));
    let run = inspect(&both, &[]);
    assert!(run.success(), "{run:?}");
    assert!(!run.stdout.contains("warning:"), "{run:?}");

    // A read-only LV.
    let (run, wrote) = format("ro", &both);
    assert_eq!(run.code, Some(2), "{run:?}");
    assert!(
        run.stderr.contains(&format!("{vg}/ro is read-only")),
        "{run:?}"
    );
    assert!(
        run.stderr.contains("nothing was written") && !wrote,
        "{run:?}"
    );
    let run = inspect(&both, &[]);
    assert!(
        run.stdout
            .contains(&format!("refused: logical volume {vg}/ro is read-only")),
        "{run:?}"
    );
    let (started, _) = at_start("ro");
    let refused = started.unwrap_err();
    assert!(
        refused.contains(&format!(
            "logical volume {vg}/ro cannot be used; refusing to serve: logical volume {vg}/ro is read-only"
        )),
        "{refused}"
    );

    // A cloned PV (a copy of the second LUN on a third device), wherever it is listed.
    let clone = lab.add_loop_copy(1);
    for devices in [
        vec![both[0], both[1], clone.as_str()],
        vec![clone.as_str(), both[0], both[1]],
    ] {
        let (run, wrote) = format("data", &devices);
        assert_eq!(run.code, Some(2), "{run:?}");
        assert!(run.stderr.contains("is on 2 devices"), "{run:?}");
        assert!(run.stderr.contains("cloned LUN") && !wrote, "{run:?}");
        let run = inspect(&devices, &["--map", "0", "--lv", "data"]);
        assert_eq!(run.code, Some(2), "{run:?}");
        assert!(run.stderr.contains("is on 2 devices"), "{run:?}");
        assert!(run.stdout.contains("refused: LVM2 PV"), "{run:?}");
    }
    lab.remove_loop(&clone);

    // A damaged metadata copy (the second area of the first PV) beside a good one.
    {
        let lun = Lun::open(Path::new(&devs[0]), false).unwrap();
        let label = parse_pv_label(&lun.read_prefix(LABEL_SCAN_BYTES).unwrap()).unwrap();
        assert_eq!(label.metadata_areas.len(), 2, "{label:?}");
        let at = label.metadata_areas[1].offset + 100;
        let dev = std::fs::OpenOptions::new()
            .write(true)
            .open(&devs[0])
            .unwrap();
        dev.write_all_at(&[0xa5; 8], at).unwrap();
        dev.sync_all().unwrap();
    }
    let (run, wrote) = format("data", &both);
    assert!(run.success() && wrote, "{run:?}");
    assert!(run.stderr.contains("is damaged and was skipped"), "{run:?}");
    let (started, warnings) = at_start("data");
    assert_eq!(started, Ok(()), "a damaged copy beside a good one serves");
    assert!(
        warnings
            .iter()
            .any(|w| w.contains("is damaged and was skipped")),
        "{warnings:?}"
    );
    assert!(
        run.stderr.contains("another copy on this PV was read"),
        "{run:?}"
    );
    let run = inspect(&both, &["--json"]);
    assert!(run.success(), "{run:?}");
    let report: serde_json::Value = serde_json::from_str(&run.stdout).unwrap();
    let warnings = report["warnings"].as_array().unwrap();
    assert!(
        warnings.iter().any(|w| w
            .as_str()
            .unwrap()
            .contains(&format!("{}: a metadata copy", devs[0]))),
        "{report}"
    );
    assert_eq!(
        report["devices"][0]["lvm_pv"]["vg"],
        vg.as_str(),
        "{report}"
    );

    // An exported VG.
    lab.lvm("vgexport", &[&vg]);
    let (run, wrote) = format("data", &both);
    assert_eq!(run.code, Some(2), "{run:?}");
    assert!(
        run.stderr
            .contains(&format!("volume group {vg} is exported"))
            && !wrote,
        "{run:?}"
    );
    lab.lvm("vgimport", &[&vg]);

    // The second PV flagged MISSING, as lvm2 writes it when it changes a VG while a PV is
    // away (lvm2 refuses to do that here, so the newest metadata is written as it would).
    rewrite_metadata(&devs[0], |text| {
        let at = text.find("pv1 {").expect("pv1 in the metadata");
        let (head, tail) = text.split_at(at);
        format!(
            "{head}{}",
            tail.replacen("flags = []", "flags = [\"MISSING\"]", 1)
        )
    });
    let (run, wrote) = format("data", &both);
    assert_eq!(run.code, Some(2), "{run:?}");
    assert!(run.stderr.contains("flagged MISSING"), "{run:?}");
    let refused = at_start("data").0.unwrap_err();
    assert!(
        refused.contains("refusing to serve") && refused.contains("flagged MISSING"),
        "{refused}"
    );
    let (started, warnings) = at_start("one");
    assert_eq!(started, Ok(()), "a MISSING PV the LV does not use");
    assert!(
        warnings.iter().any(|w| w.contains("flagged MISSING")),
        "{warnings:?}"
    );
    assert!(
        run.stderr.contains("logical volume data lies on it") && !wrote,
        "{run:?}"
    );
    let (run, wrote) = format("one", &both);
    assert!(
        run.success() && wrote,
        "a MISSING PV that the LV does not use: {run:?}"
    );
    assert!(run.stderr.contains("flagged MISSING"), "{run:?}");
    assert!(
        run.stderr.contains("logical volume one does not use it"),
        "{run:?}"
    );
    let run = inspect(&both, &[]);
    assert!(
        run.stdout.contains("refused: PV pv1") && run.stdout.contains("warning: PV pv1"),
        "{run:?}"
    );
    // A PV without metadata areas: --map says that, not that there is no PV.
    let bare = lab.add_loop(8 * MIB);
    lab.lvm("pvcreate", &["-y", "--metadatacopies", "0", &bare]);
    let run = inspect(&[bare.as_str()], &["--map", "0"]);
    assert_eq!(run.code, Some(2), "{run:?}");
    assert!(
        run.stderr
            .contains("the devices are LVM2 PVs, but none holds readable volume group metadata"),
        "{run:?}"
    );

    // Back as lvm2 would have it, so that the drop guard's vgremove runs cleanly.
    let _ = lab.try_lvm("vgextend", &["--restoremissing", &vg, &devs[1]]);
}

/// Rewrites the committed metadata text in the first metadata area of `dev` as lvm2 does:
/// `edit` applied and the seqno raised by one, the text at the same place in the ring buffer,
/// its size and checksum in `raw_locn[0]`, and the header's checksum.
fn rewrite_metadata(dev: &str, edit: impl Fn(&str) -> String) {
    let lun = Lun::open(Path::new(dev), false).unwrap();
    let label = parse_pv_label(&lun.read_prefix(LABEL_SCAN_BYTES).unwrap()).unwrap();
    let area = label.metadata_areas[0];
    let mut header = lun.read_at(area.offset, MDA_HEADER_SIZE).unwrap();
    let location = parse_mda_header(&header, area)
        .unwrap()
        .metadata_location()
        .unwrap();
    assert_eq!(location.pieces.len(), 1, "a text that wraps: {location:?}");
    let piece = location.pieces[0];
    let old = lun.read_at(piece.offset, piece.len as usize).unwrap();
    let old_text = String::from_utf8(old.strip_suffix(b"\0").unwrap_or(&old).to_vec()).unwrap();
    let seqno_line = old_text
        .lines()
        .find(|l| l.trim_start().starts_with("seqno = "))
        .unwrap()
        .to_owned();
    let seqno: u64 = seqno_line
        .trim()
        .trim_start_matches("seqno = ")
        .parse()
        .unwrap();
    let text = edit(&old_text).replacen(&seqno_line, &format!("seqno = {}", seqno + 1), 1);
    assert_ne!(text, old_text);
    let mut bytes = text.into_bytes();
    bytes.push(0);
    // raw_locn[0] at byte 40 of the header: offset u64, size u64, checksum u32, flags u32.
    header[48..56].copy_from_slice(&(bytes.len() as u64).to_le_bytes());
    header[56..60].copy_from_slice(&calc_crc(INITIAL_CRC, &bytes).to_le_bytes());
    let crc = calc_crc(INITIAL_CRC, &header[4..MDA_HEADER_SIZE]);
    header[0..4].copy_from_slice(&crc.to_le_bytes());
    let file = std::fs::OpenOptions::new().write(true).open(dev).unwrap();
    file.write_all_at(&bytes, piece.offset).unwrap();
    file.write_all_at(&header[..MDA_HEADER_SIZE], area.offset)
        .unwrap();
    file.sync_all().unwrap();
}
