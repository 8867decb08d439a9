//! `sanfs-mds volume inspect` on LUNs the binary formatted: the labels it prints and the
//! `--map` answers, checked against `Volume::map` on a volume rebuilt from the labels here.

use crate::common::{
    MIB, lun_files, mds, parse_map_line, read_label, toml_paths, volume_from_labels, write_config,
};

#[test]
fn inspect_prints_the_labels_and_map_answers() {
    let dir = tempfile::tempdir().unwrap();
    let luns = lun_files(dir.path(), &[12 * MIB, 12 * MIB, 12 * MIB, 12 * MIB]);
    let config = write_config(
        dir.path(),
        &format!(
            "layout = \"striped\"\nstripe_unit = \"128k\"\ndevices = {}",
            toml_paths(&luns)
        ),
    );
    let run = mds(["format", "--config", config.to_str().unwrap()]);
    assert!(run.success(), "{run:?}");
    let labels: Vec<_> = luns.iter().map(|l| read_label(l)).collect();
    let volume = volume_from_labels(&labels);

    let mut args = vec!["volume".to_owned(), "inspect".to_owned()];
    args.extend(luns.iter().map(|l| l.display().to_string()));
    let run = mds(&args);
    assert!(run.success(), "{run:?}");
    for (lun, label) in luns.iter().zip(&labels) {
        let block = format!(
            "{}: {} bytes\n  sanfs label\n    fs uuid:      {}\n    device uuid:  {}\n    \
             device:       {} of 4\n",
            lun.display(),
            12 * MIB,
            label.fs_uuid,
            label.device_uuid,
            label.device_index
        );
        assert!(run.stdout.contains(&block), "{block}\n{run:?}");
    }
    assert!(
        run.stdout
            .contains("    layout:       striped, stripe unit 131072"),
        "{run:?}"
    );

    // --map, devices named in reverse order.
    let size = volume.size_bytes();
    let mut reversed = vec!["volume".to_owned(), "inspect".to_owned()];
    reversed.extend(luns.iter().rev().map(|l| l.display().to_string()));
    for offset in [
        0,
        1,
        131_071,
        131_072,
        4 * 131_072 + 5,
        size / 2 + 12_345,
        size - 1,
    ] {
        let mut args = reversed.clone();
        args.extend(["--map".to_owned(), offset.to_string()]);
        let run = mds(&args);
        assert!(run.success(), "{run:?}");
        let expect = volume.map(offset, 1).unwrap()[0];
        let (index, uuid, path, phys) = parse_map_line(&run.stdout);
        assert_eq!(index, expect.device.0, "{offset}: {run:?}");
        assert_eq!(uuid, labels[index as usize].device_uuid.to_string());
        assert_eq!(path, luns[index as usize].display().to_string());
        assert_eq!(phys, expect.phys_off, "{offset}: {run:?}");
    }
    let mut args = reversed.clone();
    args.extend(["--map".to_owned(), "1M".to_owned()]);
    let run = mds(&args);
    let expect = volume.map(MIB, 1).unwrap()[0];
    assert_eq!(parse_map_line(&run.stdout).3, expect.phys_off, "{run:?}");

    // Out of range, and a device missing.
    let mut args = reversed.clone();
    args.extend(["--map".to_owned(), size.to_string()]);
    let run = mds(&args);
    assert_eq!(run.code, Some(2), "{run:?}");
    assert!(run.stderr.contains("outside the volume"), "{run:?}");
    let run = mds(["volume", "inspect", luns[0].to_str().unwrap(), "--map", "0"]);
    assert_eq!(run.code, Some(2), "{run:?}");
    assert!(
        run.stderr.contains("device(s) 1, 2, 3 of 4 missing"),
        "{run:?}"
    );
    assert_eq!(mds(["volume", "inspect"]).code, Some(2), "no devices");
}

#[test]
fn inspect_json_has_the_labels_and_the_map() {
    let dir = tempfile::tempdir().unwrap();
    let luns = lun_files(dir.path(), &[12 * MIB, 12 * MIB]);
    let config = write_config(
        dir.path(),
        &format!("layout = \"linear\"\ndevices = {}", toml_paths(&luns)),
    );
    let run = mds(["format", "--config", config.to_str().unwrap()]);
    assert!(run.success(), "{run:?}");
    let labels: Vec<_> = luns.iter().map(|l| read_label(l)).collect();
    let volume = volume_from_labels(&labels);

    let offset = volume.size_bytes() - 1;
    let mut args = vec![
        "volume".to_owned(),
        "inspect".to_owned(),
        "--json".to_owned(),
    ];
    args.extend(luns.iter().map(|l| l.display().to_string()));
    args.extend(["--map".to_owned(), offset.to_string()]);
    let run = mds(&args);
    assert!(run.success(), "{run:?}");
    let report: serde_json::Value = serde_json::from_str(&run.stdout).unwrap();
    for (i, label) in labels.iter().enumerate() {
        let l = &report["devices"][i]["sanfs_label"];
        assert_eq!(l["device_uuid"], label.device_uuid.to_string(), "{report}");
        assert_eq!(l["device_index"], label.device_index, "{report}");
        assert_eq!(l["layout"]["kind"], "linear", "{report}");
    }
    let run0 = volume.map(offset, 1).unwrap()[0];
    assert_eq!(report["map"]["device_index"], run0.device.0, "{report}");
    assert_eq!(report["map"]["phys_off"], run0.phys_off, "{report}");
    assert_eq!(
        report["map"]["path"],
        luns[run0.device.as_usize()].display().to_string()
    );
    assert_eq!(report["refusals"], serde_json::json!([]));

    // A cloned LUN: --map refuses it as a clone, naming both devices.
    let clone = dir.path().join("clone");
    std::fs::copy(&luns[1], &clone).unwrap();
    let run = mds([
        "volume".to_owned(),
        "inspect".to_owned(),
        luns[0].display().to_string(),
        luns[1].display().to_string(),
        clone.display().to_string(),
        "--map".to_owned(),
        "0".to_owned(),
    ]);
    assert_eq!(run.code, Some(2), "{run:?}");
    assert!(run.stderr.contains("is on 2 devices"), "{run:?}");
    assert!(run.stderr.contains(&clone.display().to_string()), "{run:?}");
    // Without --map it is listed as refused.
    let run = mds([
        "volume".to_owned(),
        "inspect".to_owned(),
        luns[1].display().to_string(),
        clone.display().to_string(),
    ]);
    assert!(run.success(), "{run:?}");
    assert!(
        run.stdout.contains(&format!(
            "refused: sanfs device {} is on 2 devices",
            labels[1].device_uuid
        )),
        "{run:?}"
    );
}
