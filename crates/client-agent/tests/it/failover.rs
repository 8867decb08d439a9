//! Clients follow the leader (issue 21): a mount source of several server addresses
//! (`127.0.0.1:DEAD,127.0.0.1:A,127.0.0.1:B:/`), mounted through the real mount helper
//! `mount.sanfs`. The first address refuses (nothing listens there, as on a standby): the mount
//! works through A. A writer appends fsync'd records while the server is killed with SIGKILL and
//! started again on B with the same store (a takeover as an agent sees it): the writer finishes
//! without an error, every fsync'd record is there byte-exact (read back through a fresh
//! mount), and `sanfs-admin --server A,B status` answers from the new server. The same over
//! mutual TLS, each server's certificate naming only its own address (127.0.0.1 and 127.0.0.2):
//! each name is verified. And a server of another file system answering on B after the kill is
//! refused: calls fail with EIO, nothing is written there. Root only (FUSE).

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sanfs_testcluster::ChildGuard;

use crate::mount_sanfs::run_timeout;
use crate::quickstart::mds_binary;
use crate::san::{can_mount, is_mounted};

const MIB: u64 = 1 << 20;
/// One record of the writer: unaligned, so each has a direct middle and proxied edges.
const RECORD: u64 = 100_000;

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn q(p: &Path) -> String {
    format!("{:?}", p.display().to_string())
}

/// A test PKI: a CA, one server certificate per address naming only that address, and a client
/// certificate `admin-node` (an administrator in the servers' configuration) for the agent and
/// `sanfs-admin`.
struct Pki {
    ca: PathBuf,
    /// Per server address: certificate and key.
    servers: Vec<(PathBuf, PathBuf)>,
    client_cert: PathBuf,
    client_key: PathBuf,
}

fn pki(dir: &Path, server_ips: &[&str]) -> Pki {
    use rcgen::{
        BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer,
        KeyPair, KeyUsagePurpose,
    };
    let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    p.distinguished_name
        .push(DnType::CommonName, "sanfs h19 test CA");
    p.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let ca_key = KeyPair::generate().unwrap();
    let ca_pem = p.self_signed(&ca_key).unwrap().pem();
    let issuer = Issuer::new(p, ca_key);
    let write = |name: &str, text: &str| {
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        path
    };
    let leaf = |name: &str, client: bool, file: &str| {
        let mut p = CertificateParams::new(vec![name.to_owned()]).unwrap();
        p.distinguished_name.push(DnType::CommonName, name);
        p.extended_key_usages = vec![if client {
            ExtendedKeyUsagePurpose::ClientAuth
        } else {
            ExtendedKeyUsagePurpose::ServerAuth
        }];
        let key = KeyPair::generate().unwrap();
        let cert = p.signed_by(&key, &issuer).unwrap();
        (
            write(&format!("{file}.pem"), &cert.pem()),
            write(&format!("{file}.key"), &key.serialize_pem()),
        )
    };
    let servers = server_ips
        .iter()
        .enumerate()
        .map(|(i, ip)| leaf(ip, false, &format!("server{i}")))
        .collect();
    let (client_cert, client_key) = leaf("admin-node", true, "client");
    Pki {
        ca: write("ca.pem", &ca_pem),
        servers,
        client_cert,
        client_key,
    }
}

/// One server address of the list: where it listens and its configuration (`None`: nothing
/// ever listens there).
struct Addr {
    ip: &'static str,
    port: u16,
}

impl Addr {
    fn new(ip: &'static str) -> Addr {
        Addr {
            ip,
            port: free_port(),
        }
    }

    fn text(&self) -> String {
        format!("{}:{}", self.ip, self.port)
    }
}

/// Two server addresses A and B serving one store (one at a time), a dead address, optionally a
/// second file system's store, and a mount made through `mount.sanfs`.
struct Setup {
    dir: tempfile::TempDir,
    dead: Addr,
    a: Addr,
    b: Addr,
    pki: Option<Pki>,
    /// The servers' configurations: this file system on A, on B; another one on B.
    config_a: PathBuf,
    config_b: PathBuf,
    config_other: PathBuf,
    server: Option<ChildGuard>,
    /// The daemonised agent of the mount (`mount.sanfs` returns once it is mounted).
    agent_pid: Option<u32>,
    mount: PathBuf,
}

impl Setup {
    fn new(tls: bool) -> Setup {
        let dir = tempfile::Builder::new()
            .prefix("sanfs-h19-failover-")
            .tempdir()
            .unwrap();
        let dead = Addr::new("127.0.0.1");
        let a = Addr::new("127.0.0.1");
        // With TLS, B has its own address so that its certificate can name only it.
        let b = Addr::new(if tls { "127.0.0.2" } else { "127.0.0.1" });
        let pki = tls.then(|| pki(dir.path(), &[a.ip, b.ip]));
        let store = |name: &str, luns: &str, listen: &Addr, server: usize| {
            let paths: Vec<PathBuf> = (0..2)
                .map(|i| dir.path().join(format!("{luns}{i}")))
                .collect();
            for l in &paths {
                if !l.exists() {
                    File::create(l).unwrap().set_len(64 * MIB).unwrap();
                }
            }
            let devices: Vec<String> = paths.iter().map(|l| q(l)).collect();
            let security = match &pki {
                Some(p) => format!(
                    "[tls]\ncert = {}\nkey = {}\nca = {}\n\
                     [[clients]]\nname = \"admin-node\"\nadmin = true\n",
                    q(&p.servers[server].0),
                    q(&p.servers[server].1),
                    q(&p.ca)
                ),
                None => String::new(),
            };
            let insecure = if pki.is_some() {
                ""
            } else {
                "insecure = true\n"
            };
            let path = dir.path().join(format!("{name}.toml"));
            std::fs::write(
                &path,
                format!(
                    "[server]\nlisten = \"{}\"\n{insecure}lease_ttl_ms = 3000\n{security}\
                     [metadata]\npath = {}\n\
                     [volume]\nlayout = \"striped\"\nstripe_unit = \"64KiB\"\ndevices = [{}]\n",
                    listen.text(),
                    q(&dir.path().join(format!("{luns}-meta.redb"))),
                    devices.join(", ")
                ),
            )
            .unwrap();
            path
        };
        let config_a = store("mds-a", "lun", &a, 0);
        let config_b = store("mds-b", "lun", &b, 1);
        // Another file system: its own LUNs (not matched by the mount's `lun*` glob) and store.
        let config_other = store("mds-other", "other", &b, 1);
        for config in [&config_a, &config_other] {
            let out = Command::new(mds_binary())
                .args(["format", "--config", config.to_str().unwrap()])
                .output()
                .unwrap();
            assert!(out.status.success(), "format {}: {out:?}", config.display());
        }
        let mount = dir.path().join("mnt");
        std::fs::create_dir(&mount).unwrap();
        let mut s = Setup {
            dir,
            dead,
            a,
            b,
            pki,
            config_a,
            config_b,
            config_other,
            server: None,
            agent_pid: None,
            mount,
        };
        let first = s.prepare_server(&s.config_a.clone());
        s.start_prepared(first, true);
        s
    }

    /// A shell that execs the server with `config` once told to: forked now, while a server
    /// is up (see restart.rs, `prepare_server`: a fork while the server is down would, at the
    /// child's exec, close this process's files on the mount, waiting for the server).
    fn prepare_server(&self, config: &Path) -> ChildGuard {
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join("mds.log"))
            .unwrap();
        let mut cmd = Command::new("sh");
        cmd.arg("-c")
            .arg("echo ready && read _go && exec \"$0\" serve --config \"$1\" > /dev/null")
            .arg(mds_binary())
            .arg(config)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(log);
        let mut child = ChildGuard::spawn(&mut cmd).unwrap();
        let out = child.child_mut().stdout.take().unwrap();
        let mut line = String::new();
        std::io::BufRead::read_line(&mut std::io::BufReader::new(out), &mut line).unwrap();
        assert_eq!(line, "ready\n", "the shell that starts sanfs-mds");
        child
    }

    /// Lets a prepared shell exec the server and waits until it listens on A (`on_a`) or B.
    fn start_prepared(&mut self, mut child: ChildGuard, on_a: bool) {
        let mut go = child.child_mut().stdin.take().unwrap();
        go.write_all(b"go\n").unwrap();
        drop(go);
        let addr = if on_a { &self.a } else { &self.b };
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect((addr.ip, addr.port)).is_err() {
            if let Some(st) = child.try_wait().unwrap() {
                panic!("sanfs-mds exited: {st}; log:\n{}", self.log("mds.log"));
            }
            assert!(Instant::now() < deadline, "sanfs-mds did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
        self.server = Some(child);
    }

    fn kill_server(&mut self) {
        self.server.take().unwrap().kill9().unwrap();
    }

    /// The mount source: the dead address, A and B.
    fn source(&self) -> String {
        format!("{},{},{}:/", self.dead.text(), self.a.text(), self.b.text())
    }

    fn tls_options(&self) -> String {
        match &self.pki {
            Some(p) => format!(
                ",tls_ca={},tls_cert={},tls_key={}",
                p.ca.display(),
                p.client_cert.display(),
                p.client_key.display()
            ),
            None => String::new(),
        }
    }

    /// `mount.sanfs SOURCE MOUNT -o ...` as mount(8) runs it; returns once mounted.
    fn mount_helper(&mut self, source: &str, log: &str) {
        let helper = self.dir.path().join("mount.sanfs");
        if !helper.exists() {
            std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_sanfs-agent"), &helper).unwrap();
        }
        let opts = format!(
            "devices={},client_name=h19-failover,log={}{}",
            self.dir.path().join("lun*").display(),
            self.dir.path().join(log).display(),
            self.tls_options()
        );
        let out = run_timeout(
            Command::new(&helper)
                .arg(source)
                .arg(&self.mount)
                .args(["-o", &opts])
                .env("SANFS_RUN_DIR", self.dir.path().join("run"))
                .env("RUST_LOG", "info"),
            120,
        );
        assert!(
            out.status.success() && is_mounted(&self.mount),
            "mount.sanfs {source}: {out:?}; agent log:\n{}",
            self.log(log)
        );
        let status = Command::new(env!("CARGO_BIN_EXE_sanfs-agent"))
            .args(["status", "--json"])
            .arg(&self.mount)
            .env("SANFS_RUN_DIR", self.dir.path().join("run"))
            .output()
            .unwrap();
        let j: serde_json::Value = serde_json::from_slice(&status.stdout)
            .unwrap_or_else(|e| panic!("status --json ({e}): {status:?}"));
        self.agent_pid = Some(j["pid"].as_u64().unwrap() as u32);
    }

    /// `sanfs-agent status` (text) of every mount of this setup's run directory (without a
    /// mount point: a `stat` of a refused mount's root answers EIO).
    fn agent_status(&self) -> String {
        let out = Command::new(env!("CARGO_BIN_EXE_sanfs-agent"))
            .arg("status")
            .env("SANFS_RUN_DIR", self.dir.path().join("run"))
            .output()
            .unwrap();
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    }

    /// Unmounts and waits for the agent to exit (SIGKILL after 20 s).
    fn unmount(&mut self) {
        if is_mounted(&self.mount)
            && rustix::mount::unmount(&self.mount, rustix::mount::UnmountFlags::empty()).is_err()
        {
            let _ = rustix::mount::unmount(&self.mount, rustix::mount::UnmountFlags::DETACH);
        }
        if let Some(pid) = self.agent_pid.take() {
            let deadline = Instant::now() + Duration::from_secs(20);
            while alive(pid) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(50));
            }
            if alive(pid)
                && let Some(p) = rustix::process::Pid::from_raw(pid as i32)
            {
                let _ = rustix::process::kill_process(p, rustix::process::Signal::KILL);
            }
        }
    }

    /// `sanfs-admin --server LIST ARGS` (over TLS with the administrator's certificate when the
    /// setup has TLS), with `--tls-domain` if given.
    fn admin(&self, servers: &str, domain: Option<&str>, args: &[&str]) -> Output {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_sanfs-admin"));
        cmd.args(["--server", servers]);
        if let Some(p) = &self.pki {
            cmd.arg("--tls-ca")
                .arg(&p.ca)
                .arg("--tls-cert")
                .arg(&p.client_cert)
                .arg("--tls-key")
                .arg(&p.client_key);
        }
        if let Some(d) = domain {
            cmd.args(["--tls-domain", d]);
        }
        run_timeout(cmd.args(args), 60)
    }

    fn log(&self, name: &str) -> String {
        std::fs::read_to_string(self.dir.path().join(name)).unwrap_or_default()
    }
}

impl Drop for Setup {
    fn drop(&mut self) {
        self.unmount();
        if let Some(mut s) = self.server.take() {
            let _ = s.terminate(Duration::from_secs(5));
        }
    }
}

/// Whether process `pid` runs (a zombie does not).
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state != "Z" && state != "X")
    })
}

/// Record `i`'s bytes.
fn record(i: u64) -> Vec<u8> {
    let mut x = (i + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..RECORD)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// What the writer did: the records whose fsync succeeded, and every error.
#[derive(Default)]
struct Written {
    synced: Vec<u64>,
    errors: Vec<String>,
}

/// Writes record after record into `path`, each followed by an fsync, until `stop`.
fn writer(path: PathBuf, stop: Arc<AtomicBool>, written: Arc<Mutex<Written>>) {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)
        .unwrap();
    let mut i = 0;
    while !stop.load(Ordering::SeqCst) {
        let done = file
            .write_all_at(&record(i), i * RECORD)
            .and_then(|()| file.sync_all());
        let mut w = written.lock().unwrap();
        match done {
            Ok(()) => w.synced.push(i),
            Err(e) => w.errors.push(format!("record {i}: {e}")),
        }
        drop(w);
        i += 1;
    }
    if let Err(e) = file.sync_all() {
        written
            .lock()
            .unwrap()
            .errors
            .push(format!("last fsync: {e}"));
    }
}

/// Waits (at most 90 s) until the writer has `n` fsync'd records.
fn wait_records(s: &Setup, written: &Mutex<Written>, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(90);
    while written.lock().unwrap().synced.len() < n {
        assert!(
            Instant::now() < deadline,
            "the writer got stuck at {} records; agent log:\n{}",
            written.lock().unwrap().synced.len(),
            s.log("agent.log")
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The failover scenario (see the module doc), in plaintext or over mutual TLS.
fn failover(tls: bool, per_phase: usize) {
    let mut s = Setup::new(tls);
    let source = s.source();
    s.mount_helper(&source, "agent.log");
    // The dead address refused; A answers.
    std::fs::write(s.mount.join("hello"), b"through A").unwrap();
    assert_eq!(std::fs::read(s.mount.join("hello")).unwrap(), b"through A");
    let a = s.a.text();
    let b = s.b.text();
    assert!(
        s.log("agent.log")
            .contains(&format!("connected to the server at {a}")),
        "{}",
        s.log("agent.log")
    );

    let stop = Arc::new(AtomicBool::new(false));
    let written: Arc<Mutex<Written>> = Arc::default();
    let thread = {
        let (path, stop, written) = (s.mount.join("records"), stop.clone(), written.clone());
        std::thread::spawn(move || writer(path, stop, written))
    };
    wait_records(&s, &written, per_phase);
    // The takeover: the server on A dies, one on B with the same store starts.
    let on_b = s.prepare_server(&s.config_b.clone());
    s.kill_server();
    let killed_at = written.lock().unwrap().synced.len();
    std::thread::sleep(Duration::from_secs(1));
    s.start_prepared(on_b, false);
    wait_records(&s, &written, killed_at + per_phase);
    stop.store(true, Ordering::SeqCst);
    thread.join().unwrap();
    let written = std::mem::take(&mut *written.lock().unwrap());
    eprintln!(
        "failover: {} records fsync'd, {killed_at} of them before the kill",
        written.synced.len()
    );
    let log = s.log("agent.log");
    assert!(
        written.errors.is_empty(),
        "writer errors {:?}; agent log:\n{log}",
        written.errors
    );
    assert!(
        log.contains(&format!("server at {b} answers (was {a})")),
        "the agent says where it switched to:\n{log}"
    );

    // sanfs-admin with the list answers from the new server (its second start: epoch 2).
    let list = format!("{a},{b}");
    let out = s.admin(&list, None, &["status", "--json"]);
    assert!(out.status.success(), "sanfs-admin --server {list}: {out:?}");
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(j["epoch"], 2, "{j}");
    if tls {
        // Each address's certificate names only that address: checked against another name,
        // the connection fails, and the error says so for each address.
        let out = s.admin(
            &format!("{},{b}", s.dead.text()),
            Some("127.0.0.3"),
            &["status"],
        );
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "a wrong name was accepted: {out:?}");
        assert!(
            err.contains(&s.dead.text()) && err.contains(&b) && err.contains("certificate"),
            "{err}"
        );
    }

    // Every fsync'd record is there, byte-exact, through a fresh mount (no cache of the old
    // one); A is dead, so the new mount, too, finds the server on B.
    s.unmount();
    s.mount_helper(&format!("{a},{b}:/"), "agent2.log");
    let back = std::fs::read(s.mount.join("records")).unwrap();
    for i in &written.synced {
        let at = (i * RECORD) as usize;
        assert!(
            back.get(at..at + RECORD as usize) == Some(record(*i).as_slice()),
            "record {i} differs after the takeover ({} bytes in the file)",
            back.len()
        );
    }
    assert_eq!(std::fs::read(s.mount.join("hello")).unwrap(), b"through A");
}

#[test]
fn a_mount_of_several_servers_follows_the_one_that_answers() {
    if !can_mount("the failover test") {
        return;
    }
    failover(false, 20);
}

#[test]
fn failover_over_mutual_tls_checks_each_servers_own_name() {
    if !can_mount("the TLS failover test") {
        return;
    }
    failover(true, 8);
}

#[test]
fn a_server_of_another_file_system_is_refused() {
    if !can_mount("the other file system test") {
        return;
    }
    let mut s = Setup::new(false);
    let source = s.source();
    s.mount_helper(&source, "agent.log");
    std::fs::write(s.mount.join("before"), b"kept").unwrap();
    let kept = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(s.mount.join("kept-open"))
        .unwrap();
    kept.write_all_at(b"synced", 0).unwrap();
    kept.sync_all().unwrap();

    // After the kill, B answers, but for another file system.
    let other = s.prepare_server(&s.config_other.clone());
    s.kill_server();
    s.start_prepared(other, false);
    let t0 = Instant::now();
    let e = kept
        .write_all_at(b"after the switch", 0)
        .and_then(|()| kept.sync_all())
        .unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(60), "{:?}", t0.elapsed());
    let e = File::create(s.mount.join("after")).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e}");
    let log = s.log("agent.log");
    assert!(log.contains("serves another file system"), "{log}");
    let status = s.agent_status();
    assert!(
        status.contains("REFUSED") && status.contains("another file system"),
        "{status}"
    );
    // Still refused a while later (it asks again every 2 s).
    std::thread::sleep(Duration::from_millis(2500));
    assert_eq!(
        File::create(s.mount.join("after"))
            .unwrap_err()
            .raw_os_error(),
        Some(libc::EIO)
    );
    drop(kept);

    // Nothing of this mount's reached the other file system: its root is as formatted.
    let b = s.b.text();
    let globs = vec![s.dir.path().join("other*").display().to_string()];
    let names = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(async move {
            let c = sanfs_client_agent::client::Client::connect(
                sanfs_client_agent::client::ClientConfig::new(b, globs),
            )
            .await
            .unwrap();
            let r = c
                .readdir(
                    &sanfs_proto::types::Credentials::root(),
                    sanfs_proto::types::ROOT_INODE,
                    0,
                    100,
                    false,
                )
                .await
                .unwrap();
            c.close().await.unwrap();
            r.entries
                .into_iter()
                .map(|e| String::from_utf8_lossy(e.name.as_bytes()).into_owned())
                .collect::<Vec<_>>()
        });
    assert!(names.is_empty(), "the other file system got {names:?}");
}
