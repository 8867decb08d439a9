//! The agent's deployment examples, checked with the agent's real parsers: the fstab lines
//! (`deploy/examples/fstab`), the environment file of `sanfs-agent@.service`
//! (`deploy/examples/agent.env`) and the `.mount` unit (`deploy/examples/mnt-sanfs.mount`).
//! Unknown keys and unknown mount options fail. The agent unit must not put the service in a
//! mount namespace of its own (its FUSE mount would be invisible to the host) and must allow
//! /dev/fuse and the LUNs; with systemd-analyze present, the agent's units pass
//! `systemd-analyze verify` with the real `sanfs-agent` binary.

use std::path::PathBuf;
use std::process::Command;

use sanfs_client_agent::mount_options::{parse_options, parse_source};

fn deploy(rel: &str) -> String {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../deploy")
        .join(rel);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// The `[Section] Key=Value` pairs of a unit file, in order.
fn unit_keys(text: &str) -> Vec<(String, String, String)> {
    let mut section = String::new();
    let mut out = Vec::new();
    for line in text.lines().map(str::trim) {
        if line.is_empty() || line.starts_with('#') || line.starts_with(';') {
            continue;
        }
        if let Some(s) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            section = s.to_owned();
            continue;
        }
        let (k, v) = line.split_once('=').expect("Key=Value");
        out.push((section.clone(), k.trim().to_owned(), v.trim().to_owned()));
    }
    out
}

#[test]
fn fstab_example_lines_parse_with_the_real_option_parser() {
    let text = deploy("examples/fstab");
    let mut lines = 0;
    for line in text.lines().map(str::trim) {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let f: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(f.len(), 6, "six fields: {line}");
        assert_eq!(f[2], "sanfs", "{line}");
        parse_source(f[0]).unwrap_or_else(|e| panic!("{line}: {e:#}"));
        assert!(f[1].starts_with('/'), "{line}");
        let opts = parse_options(&[f[3].to_owned()]).unwrap_or_else(|e| panic!("{line}: {e:#}"));
        assert!(
            f[3].split(',').any(|o| o == "_netdev"),
            "a network file system's line has _netdev: {line}"
        );
        let _ = opts;
        lines += 1;
    }
    assert!(lines >= 2, "the example has lines");
    // The parser is strict: the same line with a typo fails.
    assert!(parse_options(&["_netdev,attr_tll=1s".to_owned()]).is_err());
}

#[test]
fn agent_env_example_parses_and_has_no_unknown_keys() {
    let text = deploy("examples/agent.env");
    let mut server = None;
    let mut options = None;
    for line in text.lines().map(str::trim) {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (k, v) = line.split_once('=').expect("KEY=VALUE");
        match k {
            "SANFS_SERVER" => server = Some(v.to_owned()),
            "SANFS_OPTIONS" => options = Some(v.to_owned()),
            "RUST_LOG" => assert!(!v.is_empty()),
            k => panic!("unknown key {k} in agent.env (SANFS_SERVER, SANFS_OPTIONS, RUST_LOG)"),
        }
    }
    let server = server.expect("SANFS_SERVER is required");
    parse_source(&server).unwrap();
    parse_options(&[options.unwrap_or_default()]).unwrap();
    // What the unit runs with it.
    let unit = deploy("systemd/sanfs-agent@.service");
    assert!(unit.contains("EnvironmentFile=/etc/sanfs/agent.env"));
    assert!(unit.contains("mount ${SANFS_SERVER} %f --foreground -o ${SANFS_OPTIONS}"));
    // The unit's default SANFS_OPTIONS parses too.
    for (_, k, v) in unit_keys(&unit) {
        if k == "Environment"
            && let Some(o) = v.strip_prefix("SANFS_OPTIONS=")
        {
            parse_options(&[o.to_owned()]).unwrap();
        }
    }
}

#[test]
fn mount_unit_example_parses_with_the_real_option_parser() {
    let keys = unit_keys(&deploy("examples/mnt-sanfs.mount"));
    let get = |k: &str| {
        keys.iter()
            .find(|(s, key, _)| s == "Mount" && key == k)
            .map(|(_, _, v)| v.clone())
            .unwrap_or_else(|| panic!("[Mount] {k}= missing"))
    };
    parse_source(&get("What")).unwrap();
    assert_eq!(get("Type"), "sanfs");
    assert_eq!(
        get("Where"),
        "/mnt/sanfs",
        "the unit's name is its escaped mount point"
    );
    parse_options(&[get("Options")]).unwrap();
    let known = [
        "What",
        "Where",
        "Type",
        "Options",
        "TimeoutSec",
        "Description",
        "Documentation",
        "Wants",
        "After",
        "Before",
        "Requires",
        "WantedBy",
        "RequiredBy",
    ];
    for (_, k, _) in &keys {
        assert!(known.contains(&k.as_str()), "unexpected key {k}");
    }
}

#[test]
fn agent_unit_keeps_the_host_mount_namespace_and_allows_fuse_and_luns() {
    let keys = unit_keys(&deploy("systemd/sanfs-agent@.service"));
    // Each of these gives the service a mount namespace of its own.
    let namespacing = [
        "PrivateTmp",
        "PrivateDevices",
        "PrivateMounts",
        "ProtectSystem",
        "ProtectHome",
        "ProtectKernelTunables",
        "ProtectKernelModules",
        "ProtectKernelLogs",
        "ProtectControlGroups",
        "ProtectProc",
        "ProcSubset",
        "ReadOnlyPaths",
        "ReadWritePaths",
        "InaccessiblePaths",
        "TemporaryFileSystem",
        "BindPaths",
        "BindReadOnlyPaths",
        "MountFlags",
        "RootDirectory",
        "RootImage",
        "PrivateNetwork",
        "NetworkNamespacePath",
    ];
    for (_, k, v) in &keys {
        assert!(
            !namespacing.contains(&k.as_str()) || v == "no" || v == "false",
            "{k}={v} would hide the agent's mount from the host"
        );
    }
    let allowed: Vec<&str> = keys
        .iter()
        .filter(|(_, k, _)| k == "DeviceAllow")
        .map(|(_, _, v)| v.as_str())
        .collect();
    for want in [
        "/dev/fuse rw",
        "block-sd rw",
        "block-nvme rw",
        "block-loop rw",
    ] {
        assert!(allowed.contains(&want), "DeviceAllow={want} missing");
    }
    let caps = keys
        .iter()
        .find(|(_, k, _)| k == "CapabilityBoundingSet")
        .map(|(_, _, v)| v.clone())
        .unwrap();
    assert!(
        caps.split(' ').any(|c| c == "CAP_SYS_ADMIN"),
        "mount(2) needs CAP_SYS_ADMIN"
    );
}

#[test]
fn agent_units_pass_systemd_analyze_verify() {
    if !sanfs_testcluster::has_tool("systemd-analyze")
        && sanfs_testcluster::skip(
            "agent_units_pass_systemd_analyze_verify",
            "needs systemd-analyze (Debian systemd)",
        )
    {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("sanfs-agent@mnt-sanfs.service"),
        deploy("systemd/sanfs-agent@.service").replace(
            "/usr/local/bin/sanfs-agent",
            env!("CARGO_BIN_EXE_sanfs-agent"),
        ),
    )
    .unwrap();
    std::fs::write(
        dir.path().join("mnt-sanfs.mount"),
        deploy("examples/mnt-sanfs.mount"),
    )
    .unwrap();
    let out = Command::new("systemd-analyze")
        .current_dir(dir.path())
        .env("SYSTEMD_LOG_LEVEL", "notice")
        .args([
            "verify",
            "--man=no",
            "./sanfs-agent@mnt-sanfs.service",
            "./mnt-sanfs.mount",
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
