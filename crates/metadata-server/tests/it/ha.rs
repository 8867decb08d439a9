//! High availability with real etcd (`crate::ha` of the server): two `sanfs-mds` candidates,
//! real processes of the built binary, on one metadata LUN and two data LUNs (loop devices),
//! elected by a real etcd cluster (`sanfs_testcluster::EtcdCluster`). A client of the test
//! creates files through whichever server answers, as an agent does, and records every
//! acknowledged create; at the end each one must be there, and `fsck` of the stopped store
//! must be clean.
//!
//! - takeover after `kill -9` of the leader, `SANFS_HA_ROUNDS` times (default 3; the full
//!   acceptance is 20), with the time from the kill to the first answered call printed;
//! - fencing: a leader paused (SIGSTOP) past its lease writes nothing to the metadata LUN
//!   once it runs again, and starts over as a standby (same pid);
//! - a 3-member etcd: one member lost changes nothing, two (quorum lost) stop the leader's
//!   writes within its lease, and a leader serves again once they are back;
//! - a rolling restart (SIGTERM, resign) shows the client only retryable transport errors;
//!   then `serve` without `[ha]` is refused on the claimed LUN.
//!
//! They need root, loop devices and etcd (Debian's `etcd-server`); elsewhere they say why they
//! were skipped (and fail under `SANFS_REQUIRE_ROOT=1`). Every wait is bounded and generous
//! (liveness only): nothing here asserts a performance goal. The tests run one at a time (they
//! kill and pause processes, and measure what that does).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rustix::process::Signal;
use sanfs_proto::pb;
use sanfs_testcluster::{ChildGuard, EtcdCluster, LunKind, Luns, Need, skip_unless};
use tonic::transport::Channel;

use crate::harness::{Clients, root, rw};

const MIB: u64 = 1 << 20;
const ROOT: u64 = 1;
/// The bound of every wait for something that must happen (liveness, not speed).
const LIVENESS: Duration = Duration::from_secs(30);
/// How long one call of the client may take before it counts as hanging.
const CALL: Duration = Duration::from_secs(3);

/// One HA test at a time (see the module doc).
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_sanfs-mds")
}

fn free_addr() -> SocketAddr {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap()
}

fn skip(test: &str) -> bool {
    skip_unless(test, &[Need::LoopDevices, Need::Tool("etcd")])
}

// --- the pair of candidates ----------------------------------------------------------------

/// Two candidates' configs, processes and logs, on the LUNs they share.
struct Pair {
    servers: [Option<ChildGuard>; 2],
    configs: [PathBuf; 2],
    addrs: [SocketAddr; 2],
    logs: [PathBuf; 2],
    meta: PathBuf,
    _meta_lun: Luns,
    _data_luns: Luns,
}

impl Pair {
    /// Makes the LUNs (loop devices), writes both configs (etcd at `etcd`, a TTL of `ttl_s`)
    /// and formats the file system.
    fn new(dir: &Path, etcd: &[String], ttl_s: u32) -> Pair {
        let (meta_dir, data_dir) = (dir.join("meta"), dir.join("data"));
        std::fs::create_dir_all(&meta_dir).unwrap();
        std::fs::create_dir_all(&data_dir).unwrap();
        let meta_lun = Luns::create(&meta_dir, 1, 32 * MIB, LunKind::Loop).unwrap();
        let data_luns = Luns::create(&data_dir, 2, 64 * MIB, LunKind::Loop).unwrap();
        let meta = meta_lun.paths()[0].clone();
        let quote = |items: Vec<String>| {
            items
                .iter()
                .map(|s| format!("{s:?}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let devices = quote(
            data_luns
                .paths()
                .iter()
                .map(|p| p.display().to_string())
                .collect(),
        );
        let election = format!(
            "sanfs-test/{}-{}",
            std::process::id(),
            dir.file_name().unwrap().to_string_lossy()
        );
        let addrs = [free_addr(), free_addr()];
        let configs = [0, 1].map(|i| {
            let path = dir.join(format!("mds{i}.toml"));
            std::fs::write(
                &path,
                format!(
                    "[server]\nlisten = \"{}\"\ninsecure = true\nlease_ttl_ms = 600000\n\
                     [metadata]\npath = {:?}\nkind = \"block\"\n\
                     [volume]\nlayout = \"striped\"\nstripe_unit = \"64KiB\"\ndevices = [{devices}]\n\
                     [ha]\netcd = [{}]\nelection = {election:?}\nlease_ttl_s = {ttl_s}\n",
                    addrs[i],
                    meta.display().to_string(),
                    quote(etcd.to_vec()),
                ),
            )
            .unwrap();
            path
        });
        let out = Command::new(bin())
            .args(["format", "--config", configs[0].to_str().unwrap()])
            .env("RUST_LOG", "warn")
            .output()
            .unwrap();
        assert!(out.status.success(), "format: {out:?}");
        Pair {
            servers: [None, None],
            logs: [0, 1].map(|i| dir.join(format!("mds{i}.log"))),
            configs,
            addrs,
            meta,
            _meta_lun: meta_lun,
            _data_luns: data_luns,
        }
    }

    /// Starts candidate `i` (its log appended to `mdsI.log`).
    fn start(&mut self, i: usize) {
        assert!(self.servers[i].is_none(), "candidate {i} runs");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.logs[i])
            .unwrap();
        let child = ChildGuard::spawn(
            Command::new(bin())
                .args(["serve", "--config", self.configs[i].to_str().unwrap()])
                .env("RUST_LOG", "info")
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(log),
        )
        .unwrap();
        self.servers[i] = Some(child);
    }

    fn server(&mut self, i: usize) -> &mut ChildGuard {
        self.servers[i].as_mut().expect("the candidate runs")
    }

    fn kill9(&mut self, i: usize) {
        self.server(i).kill9().unwrap();
        self.servers[i] = None;
    }

    /// SIGTERM; asserts a clean exit (status 0) within the bound.
    fn terminate(&mut self, i: usize) {
        let status = self.server(i).terminate(LIVENESS).unwrap();
        assert!(
            status.success(),
            "candidate {i} did not stop cleanly ({status}):\n{}",
            self.log(i)
        );
        self.servers[i] = None;
    }

    fn signal(&mut self, i: usize, signal: Signal) {
        self.server(i).signal(signal).unwrap();
    }

    /// SIGSTOP, then waits until every thread of candidate `i` has stopped: `kill` returns
    /// once the signal is queued, and a thread in the middle of a write finishes it first.
    async fn pause(&mut self, i: usize) {
        self.signal(i, Signal::STOP);
        let pid = self.server(i).pid();
        let took = wait_until("the paused candidate's threads stop", || async {
            all_threads_stopped(pid)
        })
        .await;
        eprintln!("candidate {i} paused: all its threads stopped after {took:?}");
    }

    /// Asserts that candidate `i` still runs.
    fn assert_alive(&mut self, i: usize) {
        let exited = self.server(i).try_wait().unwrap();
        assert!(
            exited.is_none(),
            "candidate {i} exited ({exited:?}):\n{}",
            self.log(i)
        );
    }

    fn log(&self, i: usize) -> String {
        std::fs::read_to_string(&self.logs[i]).unwrap_or_default()
    }

    fn addr(&self, i: usize) -> String {
        self.addrs[i].to_string()
    }

    /// Which candidate `status` names as leader.
    fn index_of(&self, leader: &str) -> usize {
        (0..2)
            .find(|&i| self.addr(i) == leader)
            .unwrap_or_else(|| panic!("status names {leader}, neither candidate"))
    }

    async fn status(&self) -> Option<Status> {
        status(&self.configs[0]).await
    }

    /// Waits until `status` names candidate `leader` as leader and `standby` (if any) among
    /// the standbys; returns how long that took.
    async fn wait_status(&self, leader: usize, standby: Option<usize>) -> Duration {
        let (want_leader, want_standby) = (self.addr(leader), standby.map(|s| self.addr(s)));
        let mut last = None;
        let started = Instant::now();
        loop {
            let s = self.status().await;
            if let Some(s) = &s
                && s.leader.as_deref() == Some(want_leader.as_str())
                && want_standby.as_ref().is_none_or(|w| s.standbys.contains(w))
            {
                return started.elapsed();
            }
            last = s.or(last);
            assert!(
                started.elapsed() < LIVENESS,
                "status does not show leader {want_leader}, standby {want_standby:?} after \
                 {LIVENESS:?}; last: {last:?}\n--- log 0\n{}\n--- log 1\n{}",
                self.log(0),
                self.log(1)
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Stops both (the standby first, so that the leader's stop hands over to nobody) and
    /// checks the store with `fsck`.
    async fn stop_and_fsck(&mut self) {
        let leader = self
            .status()
            .await
            .and_then(|s| s.leader)
            .map(|l| self.index_of(&l));
        for i in [0, 1] {
            if Some(i) != leader && self.servers[i].is_some() {
                self.terminate(i);
            }
        }
        if let Some(l) = leader
            && self.servers[l].is_some()
        {
            self.terminate(l);
        }
        let out = Command::new(bin())
            .args(["fsck", "--config", self.configs[0].to_str().unwrap()])
            .env("RUST_LOG", "warn")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "fsck after a clean stop: {out:?}\n{}",
            String::from_utf8_lossy(&out.stdout)
        );
        eprintln!(
            "fsck: {}",
            String::from_utf8_lossy(&out.stdout)
                .lines()
                .last()
                .unwrap_or("")
        );
    }
}

/// What `sanfs-mds status --json` says.
#[derive(Debug, Clone)]
struct Status {
    leader: Option<String>,
    epoch: Option<u64>,
    standbys: Vec<String>,
    device_epoch: Option<u64>,
}

/// `sanfs-mds status --json`; `None` if it fails (etcd unreachable).
async fn status(config: &Path) -> Option<Status> {
    let out = tokio::time::timeout(
        Duration::from_secs(10),
        tokio::process::Command::new(bin())
            .args(["status", "--json", "--config", config.to_str().unwrap()])
            .env("RUST_LOG", "error")
            .kill_on_drop(true)
            .output(),
    )
    .await
    .ok()?
    .unwrap();
    if !out.status.success() {
        return None;
    }
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    Some(Status {
        leader: v["leader"].as_str().map(str::to_owned),
        epoch: v["epoch"].as_u64(),
        standbys: v["standbys"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s.as_str().unwrap().to_owned())
            .collect(),
        device_epoch: v["device_epoch"].as_u64(),
    })
}

/// Waits until `cond` holds, at most [`LIVENESS`]; returns how long it took.
async fn wait_until<F, Fut>(what: &str, mut cond: F) -> Duration
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let started = Instant::now();
    while !cond().await {
        assert!(
            started.elapsed() < LIVENESS,
            "{what}: not after {LIVENESS:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    started.elapsed()
}

/// Whether every thread of `pid` is stopped (state `T` in /proc/PID/task/TID/stat).
fn all_threads_stopped(pid: u32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    tasks.filter_map(Result::ok).all(|t| {
        std::fs::read_to_string(t.path().join("stat")).is_ok_and(|stat| {
            // The state follows the command name in parentheses.
            stat.rsplit(')')
                .next()
                .is_some_and(|rest| rest.trim_start().starts_with('T'))
        })
    })
}

/// The whole metadata LUN, read with `O_DIRECT` (what is on the device, no cache).
fn read_lun(path: &Path) -> Vec<u8> {
    let f = sanfs_lun::open_direct_strict(path, sanfs_lun::Access::Read).unwrap();
    let len = std::fs::read_to_string(format!(
        "/sys/class/block/{}/size",
        path.file_name().unwrap().to_str().unwrap()
    ))
    .unwrap()
    .trim()
    .parse::<u64>()
    .unwrap()
        * 512;
    sanfs_lun::read_direct(&f, 0, len as usize, 4096).unwrap()
}

/// The 4 KiB blocks where `a` and `b` differ.
fn differing_blocks(a: &[u8], b: &[u8]) -> Vec<usize> {
    a.chunks(4096)
        .zip(b.chunks(4096))
        .enumerate()
        .filter(|(_, (x, y))| x != y)
        .map(|(i, _)| i)
        .collect()
}

fn median(v: &[Duration]) -> Duration {
    let mut v = v.to_vec();
    v.sort();
    v.get(v.len() / 2).copied().unwrap_or_default()
}

// --- the client ----------------------------------------------------------------------------

/// How a call of the client failed.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Failure {
    /// The server is not there: connection refused or reset, `UNAVAILABLE`: retry elsewhere.
    Transport(String),
    /// No answer within [`CALL`].
    Timeout(&'static str),
    /// Any other error.
    Other(String),
}

#[derive(Debug, Default)]
struct ClientLog {
    /// Names whose create was acknowledged.
    acked: Vec<String>,
    /// When each acknowledged call was answered.
    oks: Vec<Instant>,
    /// Every failed call, when it failed.
    failures: Vec<(Instant, Failure)>,
}

impl ClientLog {
    fn first_ok_after(&self, t: Instant) -> Option<Instant> {
        let i = self.oks.partition_point(|&o| o <= t);
        self.oks.get(i).copied()
    }
}

/// A client that creates files in the root directory through whichever of `addrs` answers,
/// as an agent does: on a failure it drops its connection and tries every address again,
/// opening a new session where it connects. Every create has a name of its own (a create in
/// flight at a failure may or may not have happened: it is not recorded).
struct Client {
    log: Arc<Mutex<ClientLog>>,
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

/// `UNAVAILABLE`, or a status the client made from a failed connection (a request that met
/// the server's graceful stop, its GOAWAY, comes back as `CANCELLED` with hyper's "connection
/// closed" as its source: it was not processed), is a transport failure; anything else the
/// server answered is not.
fn failure(status: &tonic::Status) -> Failure {
    let from_transport = std::error::Error::source(status)
        .is_some_and(|s| s.downcast_ref::<tonic::transport::Error>().is_some());
    if status.code() == tonic::Code::Unavailable || from_transport {
        Failure::Transport(status.to_string())
    } else {
        Failure::Other(status.to_string())
    }
}

/// A connection and a new session on the server at `addr`.
async fn connect(addr: SocketAddr) -> Result<(Clients, u64), Failure> {
    let ch = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_timeout(Duration::from_secs(1));
    let ch = match tokio::time::timeout(CALL, ch.connect()).await {
        Err(_) => return Err(Failure::Timeout("connect")),
        Ok(Err(e)) => return Err(Failure::Transport(format!("connect: {e}"))),
        Ok(Ok(ch)) => ch,
    };
    let mut c = Clients::new(ch);
    let opened = c.session.open_session(pb::OpenSessionRequest {
        protocol_version: 1,
        client_name: "ha-test".into(),
        host: "localhost".into(),
        agent_version: "0".into(),
    });
    match tokio::time::timeout(CALL, opened).await {
        Err(_) => Err(Failure::Timeout("open session")),
        Ok(Err(s)) => Err(failure(&s)),
        Ok(Ok(r)) => Ok((c, r.into_inner().session)),
    }
}

async fn create(c: &mut Clients, session: u64, name: &str) -> Result<(), Failure> {
    let created = c.ns.create(pb::CreateRequest {
        delegate: false,
        inode: 0,
        time: None,
        cred: root(),
        session,
        parent: ROOT,
        name: name.as_bytes().to_vec(),
        perm: 0o644,
        exclusive: true,
        flags: rw(),
        request_id: None,
    });
    let handle = match tokio::time::timeout(CALL, created).await {
        Err(_) => return Err(Failure::Timeout("create")),
        Ok(Err(s)) => return Err(failure(&s)),
        Ok(Ok(r)) => r.into_inner().handle,
    };
    // The handle is let go of at once (the create is acknowledged either way).
    let released = c.ns.release(pb::ReleaseRequest { session, handle });
    match tokio::time::timeout(CALL, released).await {
        Err(_) => Err(Failure::Timeout("release")),
        Ok(Err(s)) => Err(failure(&s)),
        Ok(Ok(_)) => Ok(()),
    }
}

impl Client {
    fn start(addrs: [SocketAddr; 2], prefix: &str) -> Client {
        let log = Arc::new(Mutex::new(ClientLog::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let task = tokio::spawn(Self::run(
            addrs,
            prefix.to_owned(),
            log.clone(),
            stop.clone(),
        ));
        Client { log, stop, task }
    }

    async fn run(
        addrs: [SocketAddr; 2],
        prefix: String,
        log: Arc<Mutex<ClientLog>>,
        stop: Arc<AtomicBool>,
    ) {
        let mut conn: Option<(Clients, u64)> = None;
        let mut n = 0u64;
        while !stop.load(Ordering::SeqCst) {
            let Some((c, session)) = conn.as_mut() else {
                for addr in addrs {
                    match connect(addr).await {
                        Ok(c) => {
                            conn = Some(c);
                            break;
                        }
                        // A standby does not listen: refused connections are the normal case.
                        Err(Failure::Transport(_)) => {}
                        Err(f) => log.lock().unwrap().failures.push((Instant::now(), f)),
                    }
                }
                if conn.is_none() {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                continue;
            };
            let name = format!("{prefix}-{n}");
            n += 1;
            let done = create(c, *session, &name).await;
            {
                let mut l = log.lock().unwrap();
                match done {
                    Ok(()) => {
                        l.acked.push(name);
                        l.oks.push(Instant::now());
                    }
                    Err(f) => {
                        l.failures.push((Instant::now(), f));
                        conn = None;
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    fn first_ok_after(&self, t: Instant) -> Option<Instant> {
        self.log.lock().unwrap().first_ok_after(t)
    }

    /// Waits until a create acknowledged after `t`; returns when it was answered.
    async fn wait_ok_after(&self, t: Instant, what: &str) -> Instant {
        wait_until(what, || async { self.first_ok_after(t).is_some() }).await;
        self.first_ok_after(t).unwrap()
    }

    /// Stops the client; returns what it saw.
    async fn stop(self) -> ClientLog {
        self.stop.store(true, Ordering::SeqCst);
        tokio::time::timeout(LIVENESS, self.task)
            .await
            .expect("the client stops")
            .unwrap();
        Arc::try_unwrap(self.log).unwrap().into_inner().unwrap()
    }
}

/// Looks up every acknowledged name through the server at `addr`.
async fn assert_all_present(addr: SocketAddr, acked: &[String]) {
    let (mut c, _) = connect(addr).await.unwrap();
    for name in acked {
        let found =
            c.ns.lookup(pb::LookupRequest {
                session: None,
                cred: root(),
                parent: ROOT,
                name: name.as_bytes().to_vec(),
            })
            .await;
        assert!(
            found.is_ok(),
            "{name}: the create was acknowledged, the file is gone: {found:?}"
        );
    }
    eprintln!("all {} acknowledged creates are there", acked.len());
}

/// Which candidate serves now (status names it and it answers a call).
async fn serving(pair: &Pair) -> usize {
    let started = Instant::now();
    loop {
        if let Some(l) = pair.status().await.and_then(|s| s.leader) {
            let i = pair.index_of(&l);
            if connect(pair.addrs[i]).await.is_ok() {
                return i;
            }
        }
        assert!(
            started.elapsed() < LIVENESS,
            "no leader serves after {LIVENESS:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

// --- the tests -------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn takeover_after_kill_9_of_the_leader_loses_no_acknowledged_create() {
    if skip("the HA kill -9 takeover test") {
        return;
    }
    let _serial = SERIAL.lock().await;
    let rounds: usize = std::env::var("SANFS_HA_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3);
    let dir = tempfile::tempdir().unwrap();
    let etcd = EtcdCluster::start(&dir.path().join("etcd"), 1).unwrap();
    let mut pair = Pair::new(dir.path(), &etcd.endpoints(), 2);
    pair.start(0);
    pair.wait_status(0, None).await;
    pair.start(1);
    pair.wait_status(0, Some(1)).await;
    let client = Client::start(pair.addrs, "k9");
    let mut takeovers = Vec::new();
    let mut last_epoch = 0;
    for round in 0..rounds {
        let before = Instant::now();
        client
            .wait_ok_after(before, "a create answered before the kill")
            .await;
        // Creates (commits) under way when the leader dies.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let s = pair.status().await.unwrap();
        let leader = pair.index_of(s.leader.as_deref().unwrap());
        let standby = 1 - leader;
        assert_eq!(s.standbys, vec![pair.addr(standby)], "round {round}: {s:?}");
        let epoch = s.epoch.unwrap();
        assert!(epoch > last_epoch, "round {round}: epochs grow: {s:?}");
        assert_eq!(s.device_epoch, Some(epoch), "round {round}: {s:?}");
        last_epoch = epoch;

        let killed = Instant::now();
        pair.kill9(leader);
        let answered = client
            .wait_ok_after(killed, "a create answered after the kill")
            .await;
        let took = answered - killed;
        eprintln!("round {round}: kill -9 of the leader -> first answered call: {took:?}");
        takeovers.push(took);
        pair.wait_status(standby, None).await;
        pair.start(leader);
        let joined = pair.wait_status(standby, Some(leader)).await;
        eprintln!("round {round}: the killed one is a standby again after {joined:?}");
    }
    let seen = client.stop().await;
    eprintln!(
        "kill -9 takeover: {rounds} rounds, median {:?}, each {takeovers:?}; {} creates \
         acknowledged, {} failed calls",
        median(&takeovers),
        seen.acked.len(),
        seen.failures.len()
    );
    let leader = serving(&pair).await;
    assert_all_present(pair.addrs[leader], &seen.acked).await;
    pair.stop_and_fsck().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_paused_past_its_lease_writes_nothing_when_it_runs_again() {
    if skip("the HA SIGSTOP fencing test") {
        return;
    }
    let _serial = SERIAL.lock().await;
    // Where the pause lands in a commit is chance: more rounds look at more places.
    let rounds: usize = std::env::var("SANFS_HA_PAUSE_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1);
    // A TTL long enough that the paused B still holds the election while A wakes up and is
    // watched (B's lease has at least 2/3 of it left when B is paused).
    let ttl = 6;
    let dir = tempfile::tempdir().unwrap();
    let etcd = EtcdCluster::start(&dir.path().join("etcd"), 1).unwrap();
    let mut pair = Pair::new(dir.path(), &etcd.endpoints(), ttl);
    pair.start(0);
    pair.wait_status(0, None).await;
    pair.start(1);
    pair.wait_status(0, Some(1)).await;
    let client = Client::start(pair.addrs, "stop");
    for round in 0..rounds {
        let a = serving(&pair).await;
        let b = 1 - a;
        pair.wait_status(a, Some(b)).await;
        eprintln!("round {round}: A is candidate {a}, B is candidate {b}");
        pause_round(&mut pair, &client, a, &format!("{PENDING}-{round}")).await;
    }
    let seen = client.stop().await;
    eprintln!(
        "{rounds} rounds: {} creates acknowledged, {} failed calls",
        seen.acked.len(),
        seen.failures.len()
    );
    let leader = serving(&pair).await;
    assert_all_present(pair.addrs[leader], &seen.acked).await;
    let (mut c, _) = connect(pair.addrs[leader]).await.unwrap();
    for round in 0..rounds {
        let found =
            c.ns.lookup(pb::LookupRequest {
                session: None,
                cred: root(),
                parent: ROOT,
                name: format!("{PENDING}-{round}").into_bytes(),
            })
            .await;
        assert_eq!(
            found.map(|_| ()).map_err(|s| s.code()),
            Err(tonic::Code::NotFound),
            "round {round}: the create the deposed leader found when it ran again"
        );
    }
    pair.stop_and_fsck().await;
}

/// The name of the create sent to the paused leader (with the round's number).
const PENDING: &str = "sent-to-the-paused-leader";

/// One round of the fencing test: leader `a` is paused, the other (B) takes over and is
/// paused too, A runs again: the metadata LUN must not change while A notices and starts over
/// as a standby. Then B runs again and some leader serves.
async fn pause_round(pair: &mut Pair, client: &Client, a: usize, pending_name: &str) {
    let b = 1 - a;
    let a_pid = pair.server(a).pid();
    client
        .wait_ok_after(Instant::now(), "creates through A")
        .await;
    // Creates (commits) under way when A is paused.
    tokio::time::sleep(Duration::from_millis(500)).await;

    // A create sent to A while it is paused waits in its socket: A finds it when it runs
    // again, past its deadline, and must not commit it.
    let (mut to_a, a_session) = connect(pair.addrs[a]).await.unwrap();
    let stopped_a = Instant::now();
    pair.pause(a).await;
    let name = pending_name.as_bytes().to_vec();
    let pending = tokio::spawn(async move {
        let sent = to_a.ns.create(pb::CreateRequest {
            delegate: false,
            inode: 0,
            time: None,
            cred: root(),
            session: a_session,
            parent: ROOT,
            name,
            perm: 0o644,
            exclusive: true,
            flags: rw(),
            request_id: None,
        });
        tokio::time::timeout(4 * LIVENESS, sent).await
    });
    let b_leads = pair.wait_status(b, None).await;
    let b_serves = client.wait_ok_after(stopped_a, "creates through B").await;
    eprintln!(
        "A paused: B leads after {b_leads:?}, serves a create {:?} after the pause",
        b_serves - stopped_a
    );
    pair.pause(b).await;
    let frozen = read_lun(&pair.meta);
    let b_epoch = pair.status().await.unwrap().epoch.unwrap();

    let resumed = Instant::now();
    let lost_line = "starting over as a standby";
    let starts_before = pair.log(a).matches(lost_line).count();
    pair.signal(a, Signal::CONT);
    // A notices that its lease is gone, starts over (the same process executed again) and
    // campaigns: "candidate" is logged once more.
    let took = wait_until("A starts over as a candidate", || async {
        let log = pair.log(a);
        log.match_indices(lost_line)
            .nth(starts_before)
            .is_some_and(|(at, _)| log[at..].contains("candidate: campaigning"))
    })
    .await;
    eprintln!("A resumed: started over as a standby after {took:?}");
    let answer = tokio::time::timeout(LIVENESS, pending)
        .await
        .expect("A answers (or drops) the create it found")
        .unwrap()
        .expect("A answers (or drops) the create it found");
    assert!(
        answer.is_err(),
        "A, deposed, acknowledged a create: {answer:?}"
    );
    eprintln!("the create waiting for A failed: {}", answer.unwrap_err());
    tokio::time::sleep(Duration::from_secs(1)).await;
    let after = read_lun(&pair.meta);
    let watched = resumed.elapsed();
    let s = pair.status().await.unwrap();
    assert_eq!(
        (s.leader.as_deref(), s.epoch),
        (Some(pair.addr(b).as_str()), Some(b_epoch)),
        "B (paused) must still hold the election for the comparison to mean anything: {s:?}"
    );
    let diff = differing_blocks(&frozen, &after);
    assert!(
        diff.is_empty(),
        "the deposed leader A wrote to the metadata LUN after it resumed (4 KiB blocks {:?}); \
         log of A:\n{}",
        &diff[..diff.len().min(20)],
        pair.log(a)
    );
    eprintln!(
        "the metadata LUN ({} MiB) is byte-identical {watched:?} after A resumed",
        frozen.len() as u64 / MIB
    );
    pair.assert_alive(a);
    assert_eq!(
        pair.server(a).pid(),
        a_pid,
        "A starts over in the same process"
    );
    assert!(
        s.standbys.contains(&pair.addr(a)),
        "A campaigns again: {s:?}"
    );

    let resumed_b = Instant::now();
    pair.signal(b, Signal::CONT);
    let answered = client
        .wait_ok_after(resumed_b, "a leader serves again")
        .await;
    eprintln!(
        "B resumed: a create answered {:?} later",
        answered - resumed_b
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_three_member_etcd_loses_one_member_without_a_pause_and_quorum_stops_writes() {
    if skip("the HA 3-member etcd test") {
        return;
    }
    let _serial = SERIAL.lock().await;
    // Longer than etcd's own election of a new raft leader (about 1 s with its defaults), which
    // a lost member may make it hold.
    let ttl: u32 = 5;
    let dir = tempfile::tempdir().unwrap();
    let mut etcd = EtcdCluster::start(&dir.path().join("etcd"), 3).unwrap();
    let mut pair = Pair::new(dir.path(), &etcd.endpoints(), ttl);
    pair.start(0);
    pair.wait_status(0, None).await;
    pair.start(1);
    pair.wait_status(0, Some(1)).await;
    let client = Client::start(pair.addrs, "q");
    client
        .wait_ok_after(Instant::now(), "creates through the leader")
        .await;
    let before = pair.status().await.unwrap();

    let one_lost = Instant::now();
    etcd.stop_member(0).unwrap();
    // A few lease renewals later: the same leader, every call answered.
    tokio::time::sleep(Duration::from_secs(u64::from(ttl) * 2)).await;
    let s = wait_for_status(&pair).await;
    assert_eq!(
        (s.leader.clone(), s.epoch),
        (before.leader.clone(), before.epoch),
        "one etcd member lost changed the leader"
    );
    {
        let l = client.log.lock().unwrap();
        let failed: Vec<_> = l.failures.iter().filter(|(t, _)| *t > one_lost).collect();
        assert!(
            failed.is_empty(),
            "calls failed after one etcd member was lost: {failed:?}"
        );
        let served = l.oks.iter().filter(|&&t| t > one_lost).count();
        assert!(served > 0, "no create answered after one member was lost");
        eprintln!("one etcd member lost: {served} creates answered, none failed, same leader");
    }

    let quorum_lost = Instant::now();
    etcd.stop_member(1).unwrap();
    let leader = pair.index_of(before.leader.as_deref().unwrap());
    let addr = pair.addrs[leader];
    let stopped = wait_until("the leader stops serving without etcd", || async {
        matches!(
            connect(addr).await,
            Err(Failure::Transport(_) | Failure::Timeout(_))
        )
    })
    .await;
    eprintln!("quorum lost: the leader stopped serving after {stopped:?}");
    // Nothing is acknowledged past the lease: the fence's deadline is the last answered
    // renewal plus the TTL (less a margin); one second more for a reply in flight.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let last_ok = client.log.lock().unwrap().oks.last().copied();
    if let Some(last) = last_ok {
        assert!(
            last < quorum_lost + Duration::from_secs(u64::from(ttl) + 1),
            "a create was acknowledged {:?} after quorum was lost (the lease is {ttl} s)",
            last - quorum_lost
        );
    }
    for i in 0..2 {
        assert!(
            connect(pair.addrs[i]).await.is_err(),
            "candidate {i} serves without etcd"
        );
    }

    let back = Instant::now();
    etcd.start_member(0).unwrap();
    etcd.start_member(1).unwrap();
    for i in 0..3 {
        etcd.wait_healthy(i, LIVENESS).unwrap();
    }
    let answered = client.wait_ok_after(back, "a leader serves again").await;
    eprintln!(
        "etcd members back: a create answered after {:?}",
        answered - back
    );
    let seen = client.stop().await;
    eprintln!(
        "{} creates acknowledged, {} failed calls",
        seen.acked.len(),
        seen.failures.len()
    );
    let leader = serving(&pair).await;
    assert_all_present(pair.addrs[leader], &seen.acked).await;
    pair.assert_alive(0);
    pair.assert_alive(1);
    pair.stop_and_fsck().await;
}

/// `status`, retried while etcd does not answer it (bounded).
async fn wait_for_status(pair: &Pair) -> Status {
    let started = Instant::now();
    loop {
        if let Some(s) = pair.status().await {
            return s;
        }
        assert!(
            started.elapsed() < LIVENESS,
            "sanfs-mds status does not answer after {LIVENESS:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_restart_shows_clients_only_retryable_errors() {
    if skip("the HA rolling restart test") {
        return;
    }
    let _serial = SERIAL.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let etcd = EtcdCluster::start(&dir.path().join("etcd"), 1).unwrap();
    let mut pair = Pair::new(dir.path(), &etcd.endpoints(), 2);
    pair.start(0);
    pair.wait_status(0, None).await;
    pair.start(1);
    pair.wait_status(0, Some(1)).await;
    let client = Client::start(pair.addrs, "roll");
    client
        .wait_ok_after(Instant::now(), "creates through the first")
        .await;

    for (from, to) in [(0, 1), (1, 0)] {
        // Creates under way when the signal comes.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let t = Instant::now();
        pair.terminate(from);
        let exited = Instant::now();
        let stopped = exited - t;
        // A clean stop resigned: etcd no longer names it (a kill would leave its key until
        // the lease ran out).
        let s = wait_for_status(&pair).await;
        assert_ne!(
            s.leader.as_deref(),
            Some(pair.addr(from).as_str()),
            "{from} stopped cleanly but still leads in etcd: it did not resign ({s:?})"
        );
        let leads = pair.wait_status(to, None).await;
        let answered = client
            .wait_ok_after(exited, "a create through the new leader")
            .await;
        eprintln!(
            "SIGTERM of {from}: it stopped in {stopped:?}, status named {to} leader {leads:?} \
             later, a create was answered {:?} after the signal",
            answered - t
        );
        pair.start(from);
        pair.wait_status(to, Some(from)).await;
    }
    let seen = client.stop().await;
    let bad: Vec<_> = seen
        .failures
        .iter()
        .filter(|(_, f)| !matches!(f, Failure::Transport(_)))
        .collect();
    assert!(
        bad.is_empty(),
        "a rolling restart showed the client errors that are not retryable: {bad:?}"
    );
    eprintln!(
        "rolling restart: {} creates acknowledged, {} retryable failures ({:?})",
        seen.acked.len(),
        seen.failures.len(),
        seen.failures.iter().map(|(_, f)| f).collect::<Vec<_>>()
    );
    let leader = serving(&pair).await;
    assert_all_present(pair.addrs[leader], &seen.acked).await;
    pair.stop_and_fsck().await;

    // The LUN an HA leader claimed is not served without [ha].
    let config = std::fs::read_to_string(&pair.configs[0]).unwrap();
    let plain = dir.path().join("plain.toml");
    std::fs::write(&plain, &config[..config.find("[ha]").unwrap()]).unwrap();
    let out = Command::new(bin())
        .args(["serve", "--config", plain.to_str().unwrap()])
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(
        stderr.contains("served by high-availability leaders") && stderr.contains("[ha]"),
        "{stderr}"
    );
    drop(etcd);
}

#[test]
fn the_ha_flag_takes_etcd_urls_only() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("mds.toml");
    std::fs::write(
        &config,
        "[metadata]\npath = \"/nonexistent/sanfs-h20-meta\"\nkind = \"block\"\n\
         [volume]\nlayout = \"linear\"\ndevices = [\"/nonexistent/sanfs-h20-lun\"]\n",
    )
    .unwrap();
    for (flag, expect) in [
        ("consul=http://127.0.0.1:1", "--ha takes etcd=URL"),
        ("etcd=127.0.0.1:2379", "not an http:// or https:// URL"),
        ("etcd=https://127.0.0.1:2379", "add [ha.tls]"),
    ] {
        let out = Command::new(bin())
            .args(["serve", "--config", config.to_str().unwrap(), "--ha", flag])
            .env("RUST_LOG", "warn")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{flag}: {stderr}");
        assert!(stderr.contains(expect), "{flag}: {stderr}");
    }
    // A store in a file cannot be shared: --ha on one is refused.
    let file = dir.path().join("file.toml");
    std::fs::write(
        &file,
        "[metadata]\npath = \"/nonexistent/sanfs-h20-meta.redb\"\n\
         [volume]\nlayout = \"linear\"\ndevices = [\"/nonexistent/sanfs-h20-lun\"]\n",
    )
    .unwrap();
    let out = Command::new(bin())
        .args(["serve", "--config", file.to_str().unwrap()])
        .args(["--ha", "etcd=http://127.0.0.1:1"])
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("needs metadata.kind = \"block\""),
        "{stderr}"
    );
}
