//! The bench's smoke test: `sanfs-bench run --smoke` through the real binary (every figure
//! once with tiny sizes; the root-only parts say they are skipped without root), checked
//! for its tables, its JSON and its plots. Timings are not asserted (speed goals live in the
//! bench's own output).

use std::process::Command;

#[test]
fn run_smoke_writes_tables_json_and_plots() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let json = dir.path().join("bench.json");
    let plots = dir.path().join("plots");
    let out = Command::new(env!("CARGO_BIN_EXE_sanfs-bench"))
        .args([
            "run",
            "--smoke",
            "--no-progress",
            "--server-mode",
            "in-process",
            "--dir",
        ])
        .arg(dir.path())
        .arg("--json")
        .arg(&json)
        .arg("--plots")
        .arg(&plots)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    for table in [
        "Control-message round trips",
        "Figure 6",
        "Figure 7",
        "Figures 8 and 9",
        "Figure 10",
        "Metadata",
        "Crossover",
    ] {
        assert!(stdout.contains(table), "no {table} table in:\n{stdout}");
    }
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert!(v["fig6"]["cells"].as_array().is_some_and(|c| !c.is_empty()));
    assert!(v["fig8"]["rows"].as_array().is_some_and(|c| !c.is_empty()));
    // Method A asks for more grants than method B at every size.
    let rows = v["fig8"]["rows"].as_array().unwrap();
    for r in rows.iter().filter(|r| r["method"] == "A") {
        let b = rows
            .iter()
            .find(|b| b["method"] == "B" && b["op"] == r["op"] && b["size"] == r["size"])
            .unwrap();
        assert!(
            r["rpcs_per_io"].as_f64().unwrap() > b["rpcs_per_io"].as_f64().unwrap(),
            "{r} vs {b}"
        );
    }
    let png = std::fs::read(plots.join("fig6-read.png")).unwrap();
    assert_eq!(&png[1..4], b"PNG");
}

/// The exerciser's smoke test: `sanfs-bench exercise` through the real binary, its own
/// cluster mounted twice (root: two agents in two network namespaces), a pinned seed, 900
/// operations checked against the model (seed 3 reaches, at op 836, the extending fallocate
/// over stale bytes past the end of file that the exerciser found). Without root (no FUSE mount) it checks
/// only that bad arguments are refused.
#[test]
fn exercise_smoke_runs_a_pinned_seed_through_two_mounts() {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let bin = env!("CARGO_BIN_EXE_sanfs-bench");
    // Bad input: a clear error, nothing mounted.
    let out = Command::new(bin)
        .args(["exercise", "--mounts", "/nonexistent-a", "/nonexistent-b"])
        .output()
        .unwrap();
    assert!(!out.status.success(), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("is not a directory"));
    if sanfs_testcluster::skip_unless(
        "the exerciser on two mounts",
        &[sanfs_testcluster::Need::Fuse],
    ) {
        return;
    }
    let out = Command::new(bin)
        .args([
            "exercise",
            "--seed",
            "3",
            "--ops",
            "900",
            "--no-progress",
            "--dir",
        ])
        .arg(dir.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(stdout.contains("seed 3: 900 ops in"), "{stdout}");
    assert!(stdout.contains("seed 3: 0 mismatches"), "{stdout}");
    // Every kind of operation ran.
    for kind in [
        "open",
        "close",
        "write",
        "read",
        "truncate",
        "fallocate",
        "rename",
        "unlink",
        "fsync",
        "stat",
        "fstat",
    ] {
        assert!(
            stdout.contains(&format!("{kind} ")),
            "no {kind} in {stdout}"
        );
    }
    // Nothing is left mounted under the run's directory.
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap();
    assert!(
        !mounts.contains(&*dir.path().to_string_lossy()),
        "left mounted:\n{mounts}"
    );
}

/// `exercise --mounts A B` on plain directories refuses to run: its verdict would be about
/// another file system.
#[test]
fn exercise_refuses_mounts_that_are_not_sanfs() {
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let out = Command::new(env!("CARGO_BIN_EXE_sanfs-bench"))
        .args(["exercise", "--ops", "10", "--mounts"])
        .arg(a.path())
        .arg(b.path())
        .output()
        .unwrap();
    assert!(!out.status.success(), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("not on a sanfs"), "{err}");
}
