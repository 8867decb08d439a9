//! `sanfs-agent quickstart` end to end (root only): up into a temporary state directory on free
//! ports, a file written and read through its mount, `bmap` showing the file on all four LUNs
//! (loop devices), a second `quickstart` refused while one is up, and `--down` leaving nothing
//! it made: no loop device on its files, no mount, no process, no directory. Without root it
//! says what it needs.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::mount::can_mount;
use crate::mount_sanfs::run_timeout;

/// `sanfs-mds` built next to `sanfs-agent` (the workspace's test build makes both).
pub(crate) fn mds_binary() -> PathBuf {
    let agent = Path::new(env!("CARGO_BIN_EXE_sanfs-agent"));
    let mds = agent.with_file_name("sanfs-mds");
    assert!(
        mds.is_file(),
        "{} is missing: cargo build -p sanfs-metadata-server (cargo test --workspace builds it)",
        mds.display()
    );
    mds
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn quickstart(args: &[&str], state: &Path, port: u16, metrics: u16) -> std::process::Output {
    run_timeout(
        Command::new(env!("CARGO_BIN_EXE_sanfs-agent"))
            .arg("quickstart")
            .args(args)
            .arg("--state-dir")
            .arg(state)
            .args(["--port", &port.to_string()])
            .args(["--metrics-port", &metrics.to_string()])
            .args(["--lun-size", "256M"])
            .arg("--mds")
            .arg(mds_binary()),
        120,
    )
}

/// Whether process `pid` started at `start` still runs (zombies count as gone).
fn alive(pid: u64, start: u64) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    let rest = &stat[stat.rfind(')').unwrap() + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    fields[0] != "Z" && fields[19].parse::<u64>().unwrap() == start
}

#[test]
fn quickstart_up_write_bmap_down_leaves_nothing() {
    if !can_mount() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let state_dir = dir.path().join("state");
    let mnt = dir.path().join("mnt");
    let (port, metrics) = (free_port(), free_port());
    let out = quickstart(&[mnt.to_str().unwrap()], &state_dir, port, metrics);
    let said = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "quickstart: {said}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(said.contains("sanfs is up"), "{said}");
    assert!(said.contains("quickstart --down"), "{said}");
    let state: serde_json::Value =
        serde_json::from_slice(&std::fs::read(state_dir.join("state.json")).unwrap()).unwrap();
    let loops: Vec<(String, String)> = state["loop_devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| {
            (
                l["device"].as_str().unwrap().to_owned(),
                l["file"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    assert_eq!(loops.len(), 4, "four loop-device LUNs as root: {state}");
    let procs: Vec<(u64, u64)> = ["server", "agent"]
        .iter()
        .map(|k| {
            (
                state[k]["pid"].as_u64().unwrap(),
                state[k]["start_time"].as_u64().unwrap(),
            )
        })
        .collect();
    assert!(procs.iter().all(|&(p, s)| alive(p, s)));

    // A file through the mount, and its extents on all four LUNs.
    let file = mnt.join("striped");
    let data = crate::support::pattern(8 << 20, 3);
    std::fs::write(&file, &data).unwrap();
    assert_eq!(std::fs::read(&file).unwrap(), data);
    let bmap = run_timeout(
        Command::new(env!("CARGO_BIN_EXE_sanfs-agent"))
            .arg("bmap")
            .arg("--json")
            .arg(&file),
        30,
    );
    assert!(bmap.status.success(), "{bmap:?}");
    let pieces: Vec<serde_json::Value> = serde_json::from_slice(&bmap.stdout).unwrap();
    let mut paths: Vec<&str> = pieces
        .iter()
        .map(|p| p["device_path"].as_str().unwrap())
        .collect();
    paths.sort_unstable();
    paths.dedup();
    let mut want: Vec<&str> = loops.iter().map(|(d, _)| d.as_str()).collect();
    want.sort_unstable();
    assert_eq!(paths, want, "the file's pieces are on all 4 loop devices");
    // Every byte of the file is written; what else is mapped is speculative preallocation
    // past the end, Unwritten (its trim at the last close races with this look).
    let size = data.len() as u64;
    let written: u64 = pieces
        .iter()
        .filter(|p| p["state"] == "written")
        .map(|p| p["len"].as_u64().unwrap())
        .sum();
    assert_eq!(written, size, "{pieces:?}");
    for p in pieces.iter().filter(|p| p["state"] != "written") {
        assert_eq!(p["state"], "unwritten", "{p}");
        assert!(p["file_off"].as_u64().unwrap() >= size, "{p}");
    }

    // A second quickstart while this one is up: refused, nothing changed.
    let again = quickstart(&[mnt.to_str().unwrap()], &state_dir, port, metrics);
    assert!(!again.status.success());
    let err = String::from_utf8_lossy(&again.stderr);
    assert!(err.contains("a quickstart is already up"), "{err}");
    assert_eq!(std::fs::read(&file).unwrap(), data);

    // --down with another mount point is refused; with its own it removes everything.
    let wrong = quickstart(&["--down", "/nonexistent"], &state_dir, port, metrics);
    assert!(!wrong.status.success());
    let down = quickstart(
        &["--down", mnt.to_str().unwrap()],
        &state_dir,
        port,
        metrics,
    );
    assert!(
        down.status.success(),
        "--down: {}\n{}",
        String::from_utf8_lossy(&down.stdout),
        String::from_utf8_lossy(&down.stderr)
    );
    assert!(!state_dir.exists(), "the state directory is gone");
    assert!(!mnt.exists(), "the mount point it made is gone");
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(!mountinfo.contains(mnt.to_str().unwrap()), "not mounted");
    for (dev, file) in &loops {
        let name = Path::new(dev).file_name().unwrap().to_str().unwrap();
        let backing = std::fs::read_to_string(format!("/sys/block/{name}/loop/backing_file"))
            .unwrap_or_default();
        assert_ne!(
            backing.trim_end(),
            file,
            "{dev} still attached to its LUN file"
        );
    }
    for (pid, start) in procs {
        assert!(!alive(pid, start), "process {pid} still runs");
    }
    // Nothing left to take down.
    let twice = quickstart(
        &["--down", mnt.to_str().unwrap()],
        &state_dir,
        port,
        metrics,
    );
    assert!(!twice.status.success());
    assert!(String::from_utf8_lossy(&twice.stderr).contains("no quickstart state"));
}

#[test]
fn quickstart_without_root_says_what_it_needs() {
    // Root and setpriv(1): it runs the quickstart as an unprivileged user.
    if sanfs_testcluster::skip_unless(
        "quickstart_without_root_says_what_it_needs",
        &[sanfs_testcluster::Need::Tool("setpriv")],
    ) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let out = run_timeout(
        Command::new("setpriv")
            .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
            .arg(env!("CARGO_BIN_EXE_sanfs-agent"))
            .arg("quickstart")
            .arg(dir.path().join("mnt"))
            .arg("--state-dir")
            .arg(dir.path().join("state")),
        30,
    );
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("quickstart needs root") && err.contains("losetup") && err.contains("FUSE"),
        "{err}"
    );
    assert!(!dir.path().join("state").exists(), "nothing made");
}
