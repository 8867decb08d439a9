//! Real crashes: the real `sanfs-mds` binary is killed with SIGKILL during a mixed workload
//! from gRPC clients, again and again. After each kill, `sanfs-mds fsck` must find the store
//! clean; after each restart every acknowledged operation must be there (created files with
//! the bytes acknowledged for them, unlinked names gone), and a Complete for a write grant
//! that was out when the server died must be refused.
//!
//! `SANFS_KILL_CYCLES` (default 50) sets the number of kills, `SANFS_KILL_SEED` the seed.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sanfs_proto::pb;
use tonic::transport::Channel;

use crate::harness::{Clients, root, rw};

const MIB: u64 = 1 << 20;
const ROOT: u64 = 1;

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_sanfs-mds")
}

/// The server process; killed (SIGKILL) when dropped.
pub(crate) struct Server {
    child: Child,
}

impl Server {
    pub(crate) fn start(config: &Path, log: &Path) -> Server {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .unwrap();
        let child = Command::new(bin())
            .args(["serve", "--config", config.to_str().unwrap()])
            .env(
                "RUST_LOG",
                std::env::var("SANFS_TEST_MDS_LOG").unwrap_or_else(|_| "warn".to_owned()),
            )
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        Server { child }
    }

    pub(crate) fn kill(&mut self) {
        let _ = self.child.kill(); // SIGKILL
        let _ = self.child.wait();
    }

    /// How the server exited on its own within `timeout` (`None`: still running).
    pub(crate) fn exited_within(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill();
    }
}

pub(crate) fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

pub(crate) async fn connect(addr: SocketAddr, server: &mut Server) -> Channel {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Ok(Some(status)) = server.child.try_wait() {
            panic!("the server exited: {status}");
        }
        if let Ok(ch) = Channel::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect()
            .await
        {
            return ch;
        }
        assert!(Instant::now() < deadline, "the server did not start");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

pub(crate) fn setup(dir: &Path, port: u16) -> PathBuf {
    let luns: Vec<PathBuf> = (0..4).map(|i| dir.join(format!("lun{i}"))).collect();
    for l in &luns {
        std::fs::File::create(l).unwrap().set_len(32 * MIB).unwrap();
    }
    let devices: Vec<String> = luns
        .iter()
        .map(|l| format!("{:?}", l.display().to_string()))
        .collect();
    let config = dir.join("mds.toml");
    std::fs::write(
        &config,
        format!(
            "[server]\nlisten = \"127.0.0.1:{port}\"\ninsecure = true\nlease_ttl_ms = 600000\n\
             [metadata]\npath = {:?}\n\
             [volume]\nlayout = \"striped\"\nstripe_unit = \"64KiB\"\ndevices = [{}]\n",
            dir.join("meta.redb").display().to_string(),
            devices.join(", ")
        ),
    )
    .unwrap();
    let out = Command::new(bin())
        .args(["format", "--config", config.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(out.status.success(), "format: {out:?}");
    config
}

pub(crate) fn fsck(config: &Path) -> (i32, String) {
    let out = Command::new(bin())
        // After a kill -9 the store needs redb's recovery, which plain fsck (read-only) does
        // not do: a dry-run repair recovers a copy in memory and checks that.
        .args([
            "fsck",
            "--repair",
            "--dry-run",
            "--config",
            config.to_str().unwrap(),
        ])
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

/// What the acknowledged operations say must be true.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Expect {
    /// Created; the last acknowledged write left these bytes.
    Present(Vec<u8>),
    Absent,
    /// An operation on it was in flight at the kill: either outcome is fine.
    Uncertain,
}

type Model = Arc<Mutex<HashMap<String, Expect>>>;

pub(crate) struct Rng(pub(crate) u64);
impl Rng {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// One client's loop: create, write, sometimes unlink; each step marks its file uncertain
/// before it is sent and records the outcome only once acknowledged.
async fn worker(mut c: Clients, session: u64, model: Model, prefix: String, seed: u64) {
    let mut rng = Rng(seed | 1);
    for i in 0.. {
        let name = format!("{prefix}_{i}");
        model
            .lock()
            .unwrap()
            .insert(name.clone(), Expect::Uncertain);
        let Ok(r) =
            c.ns.create(pb::CreateRequest {
                delegate: false,
                inode: 0,
                time: None,
                cred: root(),
                session,
                parent: ROOT,
                name: name.clone().into(),
                perm: 0o644,
                exclusive: true,
                flags: rw(),
                request_id: None,
            })
            .await
        else {
            return;
        };
        let r = r.into_inner();
        let ino = r.attr.unwrap().ino;
        model
            .lock()
            .unwrap()
            .insert(name.clone(), Expect::Present(Vec::new()));
        let len = 1 + (rng.next() % 20_000) as usize;
        let data: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
        model
            .lock()
            .unwrap()
            .insert(name.clone(), Expect::Uncertain);
        if c.data
            .write(pb::WriteRequest {
                cred: root(),
                session,
                handle: r.handle,
                inode: ino,
                offset: 0,
                data: data.clone(),
                sync: false,
                append: false,
                request_id: None,
                then_set_attr: None,
            })
            .await
            .is_err()
        {
            return;
        }
        model
            .lock()
            .unwrap()
            .insert(name.clone(), Expect::Present(data));
        if rng.next().is_multiple_of(3) {
            model
                .lock()
                .unwrap()
                .insert(name.clone(), Expect::Uncertain);
            if c.ns
                .unlink(pb::UnlinkRequest {
                    cred: root(),
                    parent: ROOT,
                    name: name.clone().into(),
                    request_id: None,
                })
                .await
                .is_err()
            {
                return;
            }
            model.lock().unwrap().insert(name.clone(), Expect::Absent);
        }
    }
}

pub(crate) async fn check(c: &mut Clients, session: u64, name: &str, expect: &Expect) {
    let found =
        c.ns.lookup(pb::LookupRequest {
            session: None,
            cred: root(),
            parent: ROOT,
            name: name.into(),
        })
        .await;
    match expect {
        Expect::Uncertain => {}
        Expect::Absent => assert!(found.is_err(), "{name} was unlinked but is back"),
        Expect::Present(bytes) => {
            let attr = found
                .unwrap_or_else(|e| panic!("{name} was created but is gone: {e:?}"))
                .into_inner()
                .attr
                .unwrap();
            assert_eq!(attr.size, bytes.len() as u64, "{name}: size");
            if bytes.is_empty() {
                return;
            }
            let h =
                c.ns.open(pb::OpenRequest {
                    cred: root(),
                    session,
                    inode: attr.ino,
                    flags: rw(),
                    read_small: 0,
                })
                .await
                .unwrap()
                .into_inner()
                .handle;
            let got = c
                .data
                .read(pb::ReadRequest {
                    cred: root(),
                    session,
                    handle: h,
                    inode: attr.ino,
                    offset: 0,
                    length: bytes.len() as u64,
                })
                .await
                .unwrap()
                .into_inner()
                .data;
            assert!(
                got == *bytes,
                "{name}: the acknowledged bytes are not what reads back"
            );
            c.ns.release(pb::ReleaseRequest { session, handle: h })
                .await
                .unwrap();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_during_a_mixed_workload_loses_nothing_acknowledged() {
    let cycles: u64 = std::env::var("SANFS_KILL_CYCLES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(50);
    let seed: u64 = std::env::var("SANFS_KILL_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| 0x51_0ca1 ^ u64::from(std::process::id()));
    eprintln!("kill -9 test: {cycles} cycles, seed {seed} (SANFS_KILL_SEED to replay)");
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let config = setup(dir.path(), port);
    let log = dir.path().join("mds.log");
    let model: Model = Arc::new(Mutex::new(HashMap::new()));
    let mut rng = Rng(seed | 1);
    let mut old_grant: Option<(u64, u64, u64)> = None;
    let mut previous_session: Option<u64> = None;
    let mut checked = 0usize;
    let started = Instant::now();
    for cycle in 0..cycles {
        let mut server = Server::start(&config, &log);
        let ch = connect(addr, &mut server).await;
        let mut c = Clients::new(ch.clone());
        let (session, epoch) = c.open_session().await;
        // As an agent: the last run's session has nothing to replay (its orphans are
        // reaped by the recovery after the window).
        if let Some(previous) = previous_session.replace(session) {
            c.reclaim_complete(session, epoch, previous).await;
        }
        // A write grant from before the kill is unknown to the new server.
        if let Some((s, e, g)) = old_grant.take() {
            assert!(e < epoch, "a restart must start a new epoch");
            let r = c
                .data
                .complete(pb::CompleteRequest {
                    session: s,
                    epoch: e,
                    grant_id: g,
                    status: pb::IoStatus::Ok as i32,
                    errors: vec![],
                    bytes_done: 65536,
                    sync: false,
                    ..Default::default()
                })
                .await;
            assert!(r.is_err(), "a Complete from the old epoch was accepted");
        }
        // Every acknowledged operation is there: all of the last cycles' names, a sample of
        // older ones.
        let snapshot: Vec<(String, Expect)> = model
            .lock()
            .unwrap()
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let recent = format!("c{}_", cycle.saturating_sub(1));
        for (name, expect) in &snapshot {
            if name.starts_with(&recent) || rng.next().is_multiple_of(16) {
                check(&mut c, session, name, expect).await;
                checked += 1;
            }
        }
        // A write grant left out when the server dies.
        let g =
            c.ns.create(pb::CreateRequest {
                delegate: false,
                inode: 0,
                time: None,
                cred: root(),
                session,
                parent: ROOT,
                name: format!("grant_{cycle}").into(),
                perm: 0o644,
                exclusive: true,
                flags: rw(),
                request_id: None,
            })
            .await
            .unwrap()
            .into_inner();
        let grant = c
            .data
            .map_write(pb::MapRequest {
                cred: root(),
                session,
                epoch,
                handle: g.handle,
                inode: g.attr.unwrap().ino,
                offset: 0,
                length: 256 * 1024,
                sync: false,
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        old_grant = Some((session, epoch, grant.grant_id));
        // The workload, then the kill at a random moment.
        let mut tasks = Vec::new();
        for t in 0..3 {
            let c = Clients::new(ch.clone());
            tasks.push(tokio::spawn(worker(
                c,
                session,
                model.clone(),
                format!("c{cycle}_{t}"),
                rng.next(),
            )));
        }
        tokio::time::sleep(Duration::from_millis(20 + rng.next() % 200)).await;
        server.kill();
        for t in tasks {
            let _ = tokio::time::timeout(Duration::from_secs(10), t).await;
        }
        let (code, out) = fsck(&config);
        assert_eq!(code, 0, "cycle {cycle}: fsck after kill -9:\n{out}");
        assert!(
            !out.contains("would repair: return") && !out.contains("would repair: set"),
            "cycle {cycle}: fsck after kill -9 finds more than redb's recovery to do:\n{out}"
        );
    }
    let acked = model
        .lock()
        .unwrap()
        .values()
        .filter(|e| !matches!(e, Expect::Uncertain))
        .count();
    eprintln!(
        "kill -9 test: {cycles} kills, {acked} acknowledged files tracked, {checked} checks, fsck clean every time, {:?}",
        started.elapsed()
    );
}
