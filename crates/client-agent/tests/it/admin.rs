//! `sanfs-admin` against real processes (issue 22): a `sanfs-mds` process with mutual TLS on
//! TCP and a unix socket, a `sanfs-agent` FUSE mount of it, and the `sanfs-admin` binary run
//! as an administrator would (root on the unix socket, or the `admin-node` certificate that
//! mds.toml marks `admin = true`). Checked: `status` and `clients` (text and `--json`) show
//! the server, the volume's capacity and the mount's session; a node certificate that is not
//! an admin is refused with the server's reason; `quota set` on a directory makes a write
//! through the mount beyond it fail with EDQUOT, and `quota get|list` show it; `evict` of the
//! mount's session makes its agent open a new session, through which the mount keeps working.
//! Root only (FUSE).

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use sanfs_testcluster::ChildGuard;
use serde_json::Value;

use crate::cluster::{Pki, pki};
use crate::quickstart::mds_binary;
use crate::san::{can_mount, is_mounted};

const MIB: u64 = 1 << 20;

/// A server with TLS and a unix socket, and one mount of it over the unix socket.
struct Setup {
    dir: tempfile::TempDir,
    pki: Pki,
    port: u16,
    sock: PathBuf,
    mount: PathBuf,
    server: Option<ChildGuard>,
    agent: Option<ChildGuard>,
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl Setup {
    fn new() -> Setup {
        let dir = tempfile::Builder::new()
            .prefix("sanfs-h10-admin-")
            .tempdir()
            .unwrap();
        let pki = pki(dir.path());
        let port = free_port();
        let luns: Vec<PathBuf> = (0..4).map(|i| dir.path().join(format!("lun{i}"))).collect();
        for l in &luns {
            File::create(l).unwrap().set_len(64 * MIB).unwrap();
        }
        let devices: Vec<String> = luns
            .iter()
            .map(|l| format!("{:?}", l.display().to_string()))
            .collect();
        let sock = dir.path().join("mds.sock");
        let config = dir.path().join("mds.toml");
        let q = |p: &Path| format!("{:?}", p.display().to_string());
        std::fs::write(
            &config,
            format!(
                "[server]\nlisten = \"127.0.0.1:{port}\"\nlisten_unix = {}\nlease_ttl_ms = 2000\n\
                 [tls]\ncert = {}\nkey = {}\nca = {}\n\
                 [[clients]]\nname = \"admin-node\"\nadmin = true\n\
                 [metadata]\npath = {}\n\
                 [volume]\nlayout = \"striped\"\nstripe_unit = \"64KiB\"\ndevices = [{}]\n",
                q(&sock),
                q(&pki.server.cert),
                q(&pki.server.key),
                q(&pki.server.ca),
                q(&dir.path().join("meta.redb")),
                devices.join(", ")
            ),
        )
        .unwrap();
        let out = Command::new(mds_binary())
            .args(["format", "--config", config.to_str().unwrap()])
            .output()
            .unwrap();
        assert!(out.status.success(), "format: {out:?}");
        let mut cmd = Command::new(mds_binary());
        cmd.args(["serve", "--config", config.to_str().unwrap()])
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(File::create(dir.path().join("mds.log")).unwrap());
        let mut server = ChildGuard::spawn(&mut cmd).unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::os::unix::net::UnixStream::connect(&sock).is_err() {
            if let Some(st) = server.try_wait().unwrap() {
                panic!(
                    "sanfs-mds exited: {st}; log:\n{}",
                    std::fs::read_to_string(dir.path().join("mds.log")).unwrap_or_default()
                );
            }
            assert!(Instant::now() < deadline, "sanfs-mds did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
        let mount = dir.path().join("mnt");
        std::fs::create_dir(&mount).unwrap();
        let mut s = Setup {
            pki,
            port,
            sock,
            mount,
            server: Some(server),
            agent: None,
            dir,
        };
        s.mount_agent();
        s
    }

    fn mount_agent(&mut self) {
        let run_dir = self.dir.path().join("run");
        std::fs::create_dir_all(&run_dir).unwrap();
        let opts = format!(
            "devices={},client_name=h10-admin-mount",
            self.dir.path().join("lun*").display()
        );
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_sanfs-agent"));
        cmd.arg("mount")
            .arg(format!("unix:{}", self.sock.display()))
            .arg(&self.mount)
            .args(["-o", &opts, "--foreground"])
            .env("SANFS_RUN_DIR", &run_dir)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stderr(File::create(self.dir.path().join("agent.log")).unwrap());
        let mut child = ChildGuard::spawn(&mut cmd).unwrap();
        let deadline = Instant::now() + Duration::from_secs(60);
        while !is_mounted(&self.mount) {
            if let Some(st) = child.try_wait().unwrap() {
                panic!("sanfs-agent exited: {st}; log:\n{}", self.log("agent.log"));
            }
            assert!(Instant::now() < deadline, "the mount did not appear");
            std::thread::sleep(Duration::from_millis(20));
        }
        self.agent = Some(child);
    }

    fn log(&self, name: &str) -> String {
        std::fs::read_to_string(self.dir.path().join(name)).unwrap_or_default()
    }

    /// `sanfs-admin --server unix:SOCK ARGS` (root on the unix socket: an administrator).
    fn admin(&self, args: &[&str]) -> Output {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_sanfs-admin"));
        cmd.arg("--server")
            .arg(format!("unix:{}", self.sock.display()))
            .args(args);
        run(cmd)
    }

    /// `sanfs-admin` over mutual TLS with a certificate and key.
    fn admin_tls(&self, cert: &Path, key: &Path, args: &[&str]) -> Output {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_sanfs-admin"));
        cmd.args(["--server", &format!("127.0.0.1:{}", self.port)])
            .arg("--tls-ca")
            .arg(&self.pki.ca)
            .arg("--tls-cert")
            .arg(cert)
            .arg("--tls-key")
            .arg(key)
            .args(["--tls-domain", "localhost"])
            .args(args);
        run(cmd)
    }

    /// The JSON answer of a command that must succeed.
    fn json(&self, args: &[&str]) -> Value {
        let mut all = args.to_vec();
        all.push("--json");
        let out = self.admin(&all);
        ok(&out, args);
        serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("{args:?}: not JSON ({e}): {}", text(&out.stdout)))
    }
}

impl Drop for Setup {
    fn drop(&mut self) {
        if is_mounted(&self.mount) {
            let _ = rustix::mount::unmount(&self.mount, rustix::mount::UnmountFlags::empty());
        }
        if let Some(mut a) = self.agent.take()
            && !matches!(a.wait_timeout(Duration::from_secs(10)), Ok(Some(_)))
        {
            let _ = a.kill9();
        }
        if is_mounted(&self.mount) {
            let _ = rustix::mount::unmount(&self.mount, rustix::mount::UnmountFlags::DETACH);
        }
        if let Some(mut s) = self.server.take() {
            let _ = s.terminate(Duration::from_secs(5));
        }
    }
}

fn run(mut cmd: Command) -> Output {
    let mut child = ChildGuard::spawn(cmd.stdout(Stdio::piped()).stderr(Stdio::piped())).unwrap();
    let st = child
        .wait_timeout(Duration::from_secs(30))
        .unwrap()
        .expect("sanfs-admin answers within 30 s");
    let c = child.child_mut();
    let mut stdout = Vec::new();
    let mut stderr = Vec::new();
    std::io::Read::read_to_end(c.stdout.as_mut().unwrap(), &mut stdout).unwrap();
    std::io::Read::read_to_end(c.stderr.as_mut().unwrap(), &mut stderr).unwrap();
    Output {
        status: st,
        stdout,
        stderr,
    }
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn ok(out: &Output, what: &[&str]) {
    assert!(
        out.status.success(),
        "sanfs-admin {what:?}: {}\nstdout: {}\nstderr: {}",
        out.status,
        text(&out.stdout),
        text(&out.stderr)
    );
}

fn failed(out: &Output, what: &str) -> String {
    assert_eq!(
        out.status.code(),
        Some(1),
        "{what} fails with exit status 1: stdout {} stderr {}",
        text(&out.stdout),
        text(&out.stderr)
    );
    text(&out.stderr)
}

/// A session id of `clients --json`: a decimal string (64-bit ids would lose digits in readers
/// that keep JSON numbers as doubles, jq 1.6 among them).
fn session_id(c: &Value) -> u64 {
    c["session"]
        .as_str()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("session id not a decimal string: {c}"))
}

/// The sessions `clients --json` lists for our mount's client name.
fn mount_sessions(s: &Setup) -> Vec<Value> {
    s.json(&["clients"])["sessions"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["client_name"] == "h10-admin-mount")
        .cloned()
        .collect()
}

/// An unmount ends the agent's session at the server (`CloseSession`), its leases and grants
/// with it. (The control socket's server held the client, the agent exited without ending
/// the session, and another node's change that had to recall one of its leases waited for
/// the lease's term: 5-10 s for the first `touch` in the root after a remount.)
#[test]
fn an_unmount_ends_the_session_at_the_server() {
    if !can_mount("admin::an_unmount_ends_the_session_at_the_server") {
        return;
    }
    let mut s = Setup::new();
    // Leases on the root's entries and a file's attributes, a grant or delegation on it.
    std::fs::write(s.mount.join("f"), b"leased").unwrap();
    assert_eq!(std::fs::read(s.mount.join("f")).unwrap(), b"leased");
    let sessions = mount_sessions(&s);
    assert_eq!(sessions.len(), 1, "{sessions:?}");
    let id = session_id(&sessions[0]);
    let out = run({
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_sanfs-agent"));
        cmd.arg("umount").arg(&s.mount);
        cmd
    });
    ok(&out, &["umount"]);
    let mut agent = s.agent.take().unwrap();
    let st = agent.wait_timeout(Duration::from_secs(20)).unwrap();
    assert!(st.is_some_and(|st| st.success()), "agent exit: {st:?}");
    // At once, not when the lease (2 s here) runs out.
    let left = mount_sessions(&s);
    assert!(left.is_empty(), "sessions after the unmount: {left:?}");
    let log = s.log("mds.log");
    assert!(
        log.contains(&format!("session closed session={id}")),
        "the server logs the session's end; log:\n{log}"
    );
    assert!(
        !log.contains(&format!("session lease expired session={id}")),
        "{log}"
    );
    let agent_log = s.log("agent.log");
    assert!(
        !agent_log.contains("tasks still hold the client"),
        "nothing holds the client after the unmount; agent log:\n{agent_log}"
    );
}

#[test]
fn status_clients_and_refusal_of_a_node_that_is_not_an_admin() {
    if !can_mount("admin::status_clients_and_refusal_of_a_node_that_is_not_an_admin") {
        return;
    }
    let s = Setup::new();
    // Something on the volume, so that used space is not zero.
    std::fs::write(s.mount.join("f"), vec![7u8; MIB as usize]).unwrap();

    let st = s.json(&["status"]);
    assert!(st["epoch"].as_u64().unwrap() >= 1, "{st}");
    assert_eq!(st["volume"]["luns"], 4, "{st}");
    assert_eq!(st["volume"]["layout"], "striped", "{st}");
    let size = st["volume"]["size_bytes"].as_u64().unwrap();
    let free = st["volume"]["free_bytes"].as_u64().unwrap();
    // Four 64 MiB LUNs less their labels and data offsets.
    assert!(size > 200 * MIB && size <= 256 * MIB, "{st}");
    assert!(
        free < size && size - free >= MIB,
        "1 MiB written is used: {st}"
    );
    assert_eq!(st["sessions"], 1, "{st}");
    let plain = s.admin(&["status"]);
    ok(&plain, &["status"]);
    let t = text(&plain.stdout);
    assert!(
        t.contains("capacity") && t.contains(&format!("({size} bytes)")),
        "{t}"
    );

    let clients = mount_sessions(&s);
    assert_eq!(clients.len(), 1, "{clients:?}");
    let c = &clients[0];
    assert_eq!(c["identity"], "unix:uid=0", "{c}");
    assert!(session_id(c) >= 1, "{c}");
    let lease = c["lease_remaining_ms"].as_u64().unwrap();
    assert!(lease > 0 && lease <= 2000 + 5000, "{c}");
    let plain = s.admin(&["clients"]);
    ok(&plain, &["clients"]);
    let t = text(&plain.stdout);
    assert!(
        t.contains("h10-admin-mount") && t.contains("unix:uid=0"),
        "{t}"
    );

    // The admin certificate over mutual TLS is an administrator too.
    let out = s.admin_tls(&s.pki.admin_cert, &s.pki.admin_key, &["status", "--json"]);
    ok(&out, &["status over TLS"]);
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["fs_uuid"], st["fs_uuid"]);

    // A node's certificate is not: every admin command is refused with the server's reason.
    for args in [
        &["status"][..],
        &["clients"],
        &["quota", "list"],
        &["evict", "1"],
        &["grow", "--layout", "linear", "/dev/null"],
    ] {
        let out = s.admin_tls(&s.pki.agent_cert, &s.pki.agent_key, args);
        let err = failed(&out, &format!("{args:?} as agent-a"));
        assert!(
            err.contains("needs an admin identity") && err.contains("agent-a"),
            "{args:?}: {err}"
        );
    }
    // BackupStore too: refused before anything is written.
    let refused_backup = s.dir.path().join("refused-backup.redb");
    let out = s.admin_tls(
        &s.pki.agent_cert,
        &s.pki.agent_key,
        &["backup", refused_backup.to_str().unwrap()],
    );
    let err = failed(&out, "backup as agent-a");
    assert!(
        err.contains("BackupStore needs an admin identity") && err.contains("agent-a"),
        "{err}"
    );
    assert!(!refused_backup.exists());
    // An unknown session is named as such.
    let err = failed(
        &s.admin(&["evict", "999999"]),
        "evict of an unknown session",
    );
    assert!(err.contains("no live session 999999"), "{err}");
}

#[test]
fn quota_set_is_enforced_on_a_mount_and_eviction_reopens_its_session() {
    if !can_mount("admin::quota_set_is_enforced_on_a_mount_and_eviction_reopens_its_session") {
        return;
    }
    let s = Setup::new();
    std::fs::create_dir(s.mount.join("q")).unwrap();
    std::fs::create_dir(s.mount.join("plain")).unwrap();

    let set = s.json(&["quota", "set", "/q", "--bytes", "1M", "--inodes", "100"]);
    assert_eq!(set["capacity_bytes"], MIB, "{set}");
    assert_eq!(set["inodes"], 100, "{set}");
    let inode = set["inode"].as_u64().unwrap();
    let got = s.json(&["quota", "get", "/q"]);
    assert_eq!(got["inode"], inode, "{got}");
    assert_eq!(got["used_bytes"], 0, "{got}");
    let none = s.json(&["quota", "get", "/plain"]);
    assert_eq!(none["quota"], Value::Null, "{none}");
    let err = failed(
        &s.admin(&["quota", "get", "/nope"]),
        "quota get of a missing path",
    );
    assert!(err.contains("\"nope\""), "{err}");
    let err = failed(
        &s.admin(&["quota", "set", "/q", "--bytes", "1Q"]),
        "a bad size",
    );
    assert!(err.contains("size"), "{err}");

    // Within the quota: fine. Beyond it: EDQUOT, from the write or at the latest fsync.
    std::fs::write(s.mount.join("q/small"), vec![1u8; 256 * 1024]).unwrap();
    let r = (|| -> std::io::Result<()> {
        let mut f = File::create(s.mount.join("q/big"))?;
        for _ in 0..4 {
            f.write_all(&vec![2u8; 256 * 1024])?;
        }
        f.sync_all()
    })();
    let e = r.expect_err("1.25 MiB in a 1 MiB quota");
    assert_eq!(e.raw_os_error(), Some(libc::EDQUOT), "{e}");
    let got = s.json(&["quota", "get", "/q"]);
    let used = got["used_bytes"].as_u64().unwrap();
    assert!((256 * 1024..=MIB).contains(&used), "{got}");
    // Outside the quota the same write succeeds.
    std::fs::write(s.mount.join("plain/big"), vec![3u8; 2 * MIB as usize]).unwrap();

    let list = s.json(&["quota", "list"]);
    assert_eq!(list["quotas_total"], 1, "{list}");
    assert_eq!(list["quotas"][0]["inode"], inode, "{list}");
    let plain = s.admin(&["quota", "list"]);
    ok(&plain, &["quota", "list"]);
    assert!(
        text(&plain.stdout).contains("1.0 MiB"),
        "{}",
        text(&plain.stdout)
    );

    // Evict the mount's session: its agent is told, opens a new session, and the mount works.
    let before = mount_sessions(&s);
    assert_eq!(before.len(), 1, "{before:?}");
    let old = session_id(&before[0]);
    let out = s.admin(&["evict", &old.to_string(), "--reason", "h10 admin test"]);
    ok(&out, &["evict"]);
    assert!(text(&out.stdout).contains(&format!("session {old} evicted")));
    let deadline = Instant::now() + Duration::from_secs(20);
    let new = loop {
        let now = mount_sessions(&s);
        if let Some(n) = now.iter().map(session_id).find(|&id| id != old) {
            break n;
        }
        assert!(
            Instant::now() < deadline,
            "the evicted agent opened no new session: {now:?}; agent log:\n{}",
            s.log("agent.log")
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    // (Session ids are random, not ordered: only that it is another one counts.)
    assert_ne!(new, old);
    let data = vec![9u8; 3 * 65536 + 17];
    std::fs::write(s.mount.join("plain/after"), &data).unwrap();
    assert_eq!(std::fs::read(s.mount.join("plain/after")).unwrap(), data);
    // The old session is gone once its lease ran out; the new one stays.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let ids: Vec<u64> = mount_sessions(&s).iter().map(session_id).collect();
        if ids == [new] {
            break;
        }
        assert!(Instant::now() < deadline, "sessions {ids:?}, want [{new}]");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        s.log("mds.log").contains("evicted"),
        "the server logs the eviction"
    );
}

/// Issue 22 item 1: `sanfs-admin top` against a real server while the mount writes large
/// files (direct path) and small ones (proxied path): `--json --count N` prints N objects,
/// one a line, whose rates show the mount's session at work (RPCs with a latency, direct and
/// proxied bytes written) and the RPCs it made; the text form, on a pipe, is plain (no
/// terminal escapes) and names the client; a bad interval is refused.
#[test]
fn top_shows_rates_per_client_while_a_mount_writes() {
    if !can_mount("admin::top_shows_rates_per_client_while_a_mount_writes") {
        return;
    }
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    let s = Setup::new();
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let stop = stop.clone();
        let dir = s.mount.join("top");
        std::fs::create_dir(&dir).unwrap();
        std::thread::spawn(move || {
            let big = vec![5u8; 2 * MIB as usize];
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                std::fs::write(dir.join(format!("big{}", i % 8)), &big).unwrap();
                std::fs::write(dir.join(format!("small{}", i % 8)), [6u8; 1000]).unwrap();
                i += 1;
            }
            i
        })
    };
    let out = s.admin(&["top", "--json", "--count", "3", "--interval", "0.5"]);
    ok(&out, &["top", "--json"]);
    let refreshes: Vec<Value> = text(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    assert_eq!(refreshes.len(), 3, "{}", text(&out.stdout));
    let rate = |v: &Value, k: &str| v[k].as_f64().unwrap_or(0.0);
    let mut seen = (false, false, false);
    for r in &refreshes {
        let ms = r["interval_ms"].as_u64().unwrap();
        assert!((400..=5000).contains(&ms), "{r}");
        let mine: Vec<&Value> = r["clients"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|c| c["client_name"] == "h10-admin-mount")
            .collect();
        assert_eq!(mine.len(), 1, "{r}");
        let c = mine[0];
        if rate(c, "rpcs_per_sec") > 0.0 && c["mean_latency_us"].as_u64().unwrap() > 0 {
            seen.0 = true;
        }
        if rate(c, "direct_write_bytes_per_sec") > 0.0 && rate(c, "write_grants_per_sec") > 0.0 {
            seen.1 = true;
        }
        if rate(c, "proxied_write_bytes_per_sec") > 0.0 {
            seen.2 = true;
        }
        // The server's totals cover the session's figures.
        assert!(
            rate(&r["server"], "rpcs_per_sec") >= rate(c, "rpcs_per_sec"),
            "{r}"
        );
    }
    assert_eq!(
        seen,
        (true, true, true),
        "RPCs, direct writes and proxied writes of the mount: {refreshes:?}"
    );
    let rpcs: Vec<&str> = refreshes
        .iter()
        .flat_map(|r| r["rpcs"].as_array().unwrap())
        .filter_map(|t| t["rpc"].as_str())
        .collect();
    for want in ["MapWrite", "Write"] {
        assert!(rpcs.contains(&want), "{want} in {rpcs:?}");
    }
    // Creates the agent answered itself go in batches (docs/protocol.md "Creates answered
    // by the agent").
    assert!(
        rpcs.contains(&"Create") || rpcs.contains(&"CreateBatch"),
        "creates in {rpcs:?}"
    );

    let out = s.admin(&["top", "--count", "2", "--interval", "0.3"]);
    ok(&out, &["top"]);
    let t = text(&out.stdout);
    eprintln!("top says:\n{t}");
    assert!(!t.contains('\x1b'), "escapes on a pipe: {t:?}");
    assert_eq!(t.matches("RPC/s").count(), 2, "two refreshes: {t}");
    assert!(
        t.contains("SESSION") && t.contains("h10-admin-mount"),
        "{t}"
    );
    stop.store(true, Ordering::Relaxed);
    assert!(writer.join().unwrap() > 0);

    let err = failed(
        &s.admin(&["top", "--interval", "0"]),
        "top with a zero interval",
    );
    assert!(err.contains("--interval"), "{err}");
}
