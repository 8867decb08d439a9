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
        "Everyday I/O through the mount",
        "Metadata through the mount",
        "Failover",
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
    check_cpu_per_byte(&v, &stdout, &plots);
    check_mount_parts(&v, &plots);
    check_failover(&v);
}

/// Issue 20: every figure 6 row that moved bytes has its CPU seconds per GiB (in the JSON,
/// the table and a plot), the latency rows their CPU per round trip, figure 10 its CPU per
/// GiB, and the mount rows (as root) the agent's stage counters and threads.
fn check_cpu_per_byte(v: &serde_json::Value, stdout: &str, plots: &std::path::Path) {
    assert!(stdout.contains("(CPU seconds per GiB)"), "{stdout}");
    let cells = v["fig6"]["cells"].as_array().expect("fig6 cells");
    for c in cells {
        if c["bytes"].as_u64() > Some(0) {
            let cpu = c["cpu_s_per_gib"].as_f64().unwrap_or_else(|| panic!("{c}"));
            assert!(cpu.is_finite() && cpu >= 0.0, "{c}");
        }
    }
    // The bench itself does the raw and library rows' work: never free.
    assert!(
        cells
            .iter()
            .filter(|c| c["path"] == "raw")
            .all(|c| c["cpu_s"].as_f64() > Some(0.0)),
        "{cells:?}"
    );
    for c in cells.iter().filter(|c| c["path"] == "mount") {
        let stages = c["stages"].as_array().unwrap_or_else(|| panic!("{c}"));
        let fuse = if c["op"] == "read" {
            "fuse-read"
        } else {
            "fuse-write"
        };
        assert!(
            stages
                .iter()
                .any(|s| s["stage"] == fuse && s["calls"].as_u64() > Some(0)),
            "{c}"
        );
        assert!(
            c["agent_threads"].as_array().is_some_and(|t| !t.is_empty()),
            "{c}"
        );
    }
    let png = std::fs::read(plots.join("fig6-cpu-read.png")).expect("the CPU plot");
    assert_eq!(&png[1..4], b"PNG");
    for r in v["latency"]["rows"].as_array().expect("latency rows") {
        assert!(r["cpu_us_per_op"].as_f64().is_some(), "{r}");
    }
    for r in v["fig10"]["rows"].as_array().expect("fig10 rows") {
        assert!(r["cpu_s_per_gib"].as_f64().is_some(), "{r}");
    }
    // The floor of a round trip, once.
    let floor = v["latency"]["rows"]
        .as_array()
        .expect("latency rows")
        .iter()
        .filter(|r| r["what"] == "getattr")
        .count();
    assert_eq!(floor, 1, "{}", v["latency"]);
    // Figure 10 in the paper's setting (every LUN capped) wherever blkio throttles exist.
    if sanfs_testcluster::is_root()
        && std::path::Path::new("/sys/fs/cgroup/blkio/blkio.throttle.read_bps_device").exists()
    {
        let capped = v["fig10"]["capped_rows"].as_array().expect("capped rows");
        assert!(!capped.is_empty(), "{}", v["fig10"]);
        assert!(stdout.contains("every LUN capped"), "{stdout}");
    }
    assert!(
        stdout.contains("CPU us/op") && stdout.contains("CPU s/GiB"),
        "{stdout}"
    );
}

/// The failover rows (as root, with etcd): one kill -9 round and one SIGTERM round, each
/// pause measured and nothing seen by the applications.
fn check_failover(v: &serde_json::Value) {
    if let Some(why) = sanfs_bench::failover::unavailable() {
        assert!(!sanfs_testcluster::required(), "failover: {why}");
        assert!(
            v["failover_skipped"].is_string(),
            "{}",
            v["failover_skipped"]
        );
        return;
    }
    let rows = v["failover"].as_array().expect("failover rows");
    let stops: Vec<&str> = rows.iter().filter_map(|r| r["stop"].as_str()).collect();
    assert_eq!(stops, ["kill", "term"]);
    for r in rows {
        let pauses = r["io_pauses_ms"].as_array().expect("pauses");
        assert_eq!(pauses.len(), 1, "{r}");
        assert!(pauses[0].as_u64() > Some(0), "{r}");
        assert!(r["io"]["writes"].as_u64() > Some(0), "{r}");
        assert_eq!(r["io"]["errors"], serde_json::json!({}), "{r}");
        assert_eq!(r["io"]["lost"], serde_json::json!([]), "{r}");
    }
}

/// The everyday and metadata-mount parts measured sanfs and its peers (as root; MooseFS
/// where it is installed, which `SANFS_REQUIRE_ROOT=1` demands), every row sane.
fn check_mount_parts(v: &serde_json::Value, plots: &std::path::Path) {
    if !sanfs_testcluster::is_root() {
        return;
    }
    let mut want = vec!["sanfs", "ext4"];
    if sanfs_bench::peers::MooseFs::unavailable().is_none() {
        want.push("moosefs");
    }
    for part in ["everyday", "metadata_mount"] {
        let targets: Vec<&str> = v[part]["targets"]
            .as_array()
            .unwrap_or_else(|| panic!("no {part} in the JSON"))
            .iter()
            .filter_map(|t| t.as_str())
            .collect();
        assert_eq!(targets, want, "{part}: {}", v[part]);
    }
    let cells = v["everyday"]["cells"].as_array().expect("everyday cells");
    for t in &want {
        let of_t: Vec<_> = cells.iter().filter(|c| c["target"] == *t).collect();
        // 4 sizes x 3 (write, read, read-only read), 2 random, 3 bonnie, 2 tree, 5
        // everyday-table rows.
        assert_eq!(of_t.len(), 24, "{t}: {of_t:?}");
        for c in of_t {
            if let Some(mb) = c["mb_s"].as_f64() {
                assert!(mb > 0.0 && c["bytes"].as_u64() > Some(0), "{c}");
                assert!(c["cpu_s_per_gib"].as_f64().is_some(), "{c}");
            } else {
                assert!(c["secs"].as_f64() > Some(0.0), "{c}");
            }
        }
    }
    let files = v["metadata_mount"]["files"].as_u64().expect("files");
    let cells = v["metadata_mount"]["cells"]
        .as_array()
        .expect("metadata_mount cells");
    for t in &want {
        // 3 configurations x 7 phases.
        assert_eq!(cells.iter().filter(|c| c["target"] == *t).count(), 21);
        for op in ["create", "stat cold", "rename", "unlink"] {
            let c = cells
                .iter()
                .find(|c| c["target"] == *t && c["config"] == "1 process" && c["op"] == op)
                .expect("a one-process cell");
            assert_eq!(c["ops"].as_u64(), Some(files), "{c}");
        }
    }
    for png in ["everyday-seq.png", "metadata-mount.png"] {
        let bytes = std::fs::read(plots.join(png)).expect("the plot");
        assert_eq!(&bytes[1..4], b"PNG");
    }
}

/// The metadata-mount part's worker process on a plain directory: every phase answers with
/// its count and leaves the directory as it says.
#[test]
fn md_worker_runs_each_phase_it_is_told() {
    use std::io::{BufRead, BufReader, Write};
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_sanfs-bench"))
        .arg("__md-worker")
        .arg("--dir")
        .arg(dir.path())
        .args(["--prefix", "w3-", "--files", "25"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut answer = || {
        let mut l = String::new();
        out.read_line(&mut l).unwrap();
        l.trim().to_owned()
    };
    assert_eq!(answer(), "ready");
    let names = || {
        let mut v: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    };
    writeln!(stdin, "create").unwrap();
    assert_eq!(answer(), "ok 25");
    // A second create finds the names taken: an error, reported, not a crash.
    writeln!(stdin, "create").unwrap();
    assert!(answer().starts_with("err create "));
    for (phase, want) in [
        ("stat", "ok 25"),
        ("readdir", "ok 25"),
        ("rename", "ok 25"),
        ("stat", "ok 25"),
    ] {
        writeln!(stdin, "{phase}").unwrap();
        assert_eq!(answer(), want, "{phase}");
    }
    let n = names();
    assert_eq!(n.len(), 25);
    assert_eq!(n[0], "w3-000000.r");
    writeln!(stdin, "no-such-phase").unwrap();
    assert!(answer().starts_with("err unknown phase"));
    writeln!(stdin, "unlink").unwrap();
    assert_eq!(answer(), "ok 25");
    assert!(names().is_empty());
    drop(stdin);
    assert!(child.wait().unwrap().success());
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
