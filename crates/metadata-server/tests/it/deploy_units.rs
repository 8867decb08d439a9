//! The systemd units in deploy/systemd (and the example units in deploy/examples), checked with `systemd-analyze verify` (skipped, and
//! said so, where systemd's tools are missing; a failure under `SANFS_REQUIRE_ROOT=1`). Any diagnostic fails the test: systemd only
//! warns about unknown keys, and a unit whose hardening line is misspelt silently loses it.

use std::path::PathBuf;
use std::process::Command;

fn deploy() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../deploy/systemd")
}

#[test]
fn systemd_units_verify_without_a_diagnostic() {
    if !sanfs_testcluster::has_tool("systemd-analyze")
        && sanfs_testcluster::skip(
            "systemd_units_verify_without_a_diagnostic",
            "needs systemd-analyze (Debian systemd)",
        )
    {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let read = |name: &str| std::fs::read_to_string(deploy().join(name)).unwrap();
    // The binaries the units start must exist for verify: the real server, and a stand-in
    // for the agent (another crate's binary).
    std::fs::write(
        dir.path().join("sanfs-mds.service"),
        read("sanfs-mds.service")
            .replace("/usr/local/bin/sanfs-mds", env!("CARGO_BIN_EXE_sanfs-mds")),
    )
    .unwrap();
    std::fs::write(
        dir.path().join("sanfs-agent@mnt-sanfs.service"),
        read("sanfs-agent@.service").replace("/usr/local/bin/sanfs-agent", "/bin/true"),
    )
    .unwrap();
    std::fs::write(
        dir.path().join("mnt-sanfs.mount"),
        std::fs::read_to_string(deploy().join("../examples/mnt-sanfs.mount")).unwrap(),
    )
    .unwrap();
    for unit in ["sanfs-mds-backup.service", "sanfs-mds-backup.timer"] {
        std::fs::write(
            dir.path().join(unit),
            std::fs::read_to_string(deploy().join("../examples").join(unit))
                .unwrap()
                .replace("/usr/local/bin/sanfs-admin", "/bin/true"),
        )
        .unwrap();
    }
    let out = Command::new("systemd-analyze")
        .current_dir(dir.path())
        .env("SYSTEMD_LOG_LEVEL", "notice")
        .args([
            "verify",
            "--man=no",
            "./sanfs-mds.service",
            "./sanfs-agent@mnt-sanfs.service",
            "./mnt-sanfs.mount",
            "./sanfs-mds-backup.service",
            "./sanfs-mds-backup.timer",
        ])
        .output()
        .unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && said.trim().is_empty(),
        "systemd-analyze verify:\n{said}"
    );
}
