//! Randomized hostile clients against the real metadata server: seeded random calls of every
//! service (Namespace, Data, Session and its stream, Locks, Admin) from nodes that mix
//! well-formed requests on real inodes, handles, sessions and grants with boundary and
//! garbage values in every field (inode 0, 1 and u64::MAX, names with '/', NUL, "." or 256
//! bytes, ranges that overflow, grants never issued, sessions of another node, closed ones,
//! request ids reused across different requests, missing credentials, garbage headers).
//!
//! The contract checked: every call is answered within [`CALL_LIMIT`] (a hang names the
//! call); no panic in the server (a panic hook records the server runtime's panics, and the
//! real binary's log must have no `panicked`); the server keeps serving a well-behaved node
//! ([`probe`] after every failure and every 64 calls); at the end `fsck` is clean and the
//! well-behaved node's files, in a directory the hostile nodes may not write, read back
//! exactly.
//!
//! - `hostile_calls_in_process`: a TLS server with three identities (`good-node` sets up and
//!   checks, `bad-node` is the hostile plain node with several sessions, `admin-node` makes
//!   the admin calls a plain node may not), on its own runtime.
//! - `hostile_calls_on_the_real_binary`: the real `sanfs-mds` process (plaintext, every
//!   caller one identity) for fewer calls: it must still run and its log have no `panicked`.
//!
//! `SANFS_FUZZ_CALLS` sets the number of calls of the in-process run (the real binary gets a
//! quarter), `SANFS_FUZZ_SEED` the seed (printed; replays a run's choices: answers that
//! depend on timing, such as lease expiry, waits and the bursts' races, can differ between
//! two runs, and the run may part ways after the first of them).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, Once};
use std::time::{Duration, Instant};

use sanfs_mds::service::identity::{AccessConfig, ClientPolicy};
use sanfs_mds::store::Backend;
use sanfs_proto::pb;
use sanfs_proto::pb::locks_client::LocksClient;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};
use tonic::{Code, Request, Status};

use crate::harness::{Ca, Clients, ca, leaf, write_server_tls};

/// Longest any one call may take. Calls that wait legitimately (a write grant waiting for a
/// silent holder's eviction, a bounded lock wait) end within a few lease periods.
const CALL_LIMIT: Duration = Duration::from_secs(30);
/// Short leases so that silent holders lose their grants within seconds.
const LEASE_TTL_MS: u64 = 1500;
const ROOT: u64 = 1;
const MAX_INLINE: usize = 8 << 20;

// ------------------------------------------------------------------------------------------
// Randomness

/// SplitMix64: small, seedable, good enough to pick cases.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next() % n }
    }
    /// True with probability `num / den`.
    fn chance(&mut self, num: u64, den: u64) -> bool {
        self.below(den) < num
    }
    fn pick<T: Clone>(&mut self, items: &[T]) -> Option<T> {
        if items.is_empty() {
            None
        } else {
            Some(items[self.below(items.len() as u64) as usize].clone())
        }
    }
    fn bytes(&mut self, len: usize) -> Vec<u8> {
        (0..len).map(|_| self.next() as u8).collect()
    }
}

/// Values at the edges of what a u64 field may carry.
const EDGES: [u64; 18] = [
    0,
    1,
    2,
    3,
    511,
    4095,
    4096,
    4097,
    65536,
    1 << 20,
    (1 << 32) - 1,
    1 << 32,
    i64::MAX as u64,
    (i64::MAX as u64) + 1,
    u64::MAX - 4096,
    u64::MAX - 4095,
    u64::MAX - 1,
    u64::MAX,
];

// ------------------------------------------------------------------------------------------
// What the fuzzer knows of the server

#[derive(Clone, Copy, Debug)]
struct Sess {
    id: u64,
    epoch: u64,
}

#[derive(Clone, Copy, Debug)]
struct Handle {
    session: u64,
    handle: u64,
    ino: u64,
}

#[derive(Clone, Copy, Debug)]
struct GrantRec {
    session: u64,
    epoch: u64,
    id: u64,
    offset: u64,
    length: u64,
}

/// The hostile nodes' view: what they made and saw, to aim requests at real things.
struct World {
    rng: Rng,
    /// The hostile node's connections (several, to mix sessions over channels).
    bad: Vec<Clients>,
    bad_locks: Vec<LocksClient<Channel>>,
    bad_channels: Vec<Channel>,
    /// The server's TCP address, for bytes that are not HTTP/2 at all.
    addr: SocketAddr,
    /// An admin identity's connection (the in-process server only).
    admin: Option<Clients>,
    /// The well-behaved node's connection (for probes).
    good: Clients,
    /// The hostile node's live sessions, with their keep-alive tasks.
    sessions: Vec<(Sess, tokio::task::JoinHandle<()>)>,
    /// Sessions closed or given up, and sessions of the well-behaved node.
    dead_sessions: Vec<Sess>,
    foreign_sessions: Vec<Sess>,
    epoch: u64,
    files: Vec<u64>,
    dirs: Vec<u64>,
    others: Vec<u64>,
    /// The well-behaved node's directory and files: never touched with root's credentials.
    protected: Vec<u64>,
    names: Vec<Vec<u8>>,
    /// Names seen in directories: (parent, name), for calls on entries that exist.
    entries: Vec<(u64, Vec<u8>)>,
    handles: Vec<Handle>,
    old_handles: Vec<Handle>,
    /// Inode numbers ReserveInodes answered (some used, some not, some another session's).
    reserved: Vec<u64>,
    grants: Vec<GrantRec>,
    old_grants: Vec<GrantRec>,
    request_ids: Vec<pb::RequestId>,
    next_name: u64,
    block_size: u64,
    /// Where backups and volume growth may point (a directory of the test's own).
    scratch: PathBuf,
    /// The well-behaved node's session ids must not be evicted by the admin identity.
    allow_evict_foreign: bool,
    /// The slowest calls: (time, rpc, reply code, request).
    slowest: Vec<(Duration, String)>,
    /// Time spent per rpc.
    time_by_rpc: BTreeMap<&'static str, Duration>,
    /// (rpc, code) -> count.
    tally: BTreeMap<(&'static str, i32), u64>,
    findings: Vec<String>,
}

/// What a call's reply means to the run.
enum Seen {
    Fine,
    /// A code that a handled error never maps to: the connection died, the handler panicked.
    Suspicious(String),
}

fn judge(rpc: &'static str, status: &Status) -> Seen {
    match status.code() {
        Code::Unknown | Code::Internal | Code::DataLoss | Code::Unavailable => {
            Seen::Suspicious(format!("{rpc}: {:?}: {}", status.code(), status.message()))
        }
        _ => Seen::Fine,
    }
}

impl World {
    fn bad(&mut self) -> &mut Clients {
        let i = self.rng.below(self.bad.len() as u64) as usize;
        &mut self.bad[i]
    }

    fn u64_edge(&mut self) -> u64 {
        if self.rng.chance(1, 4) {
            self.rng.next()
        } else {
            EDGES[self.rng.below(EDGES.len() as u64) as usize]
        }
    }

    /// An inode: mostly a real one, of any type.
    fn ino(&mut self, wild: bool) -> u64 {
        if wild && self.rng.chance(1, 2) {
            return match self.rng.below(3) {
                0 => self.u64_edge(),
                1 => self.rng.below(300),
                _ => ROOT,
            };
        }
        let pools = [
            &self.files,
            &self.dirs,
            &self.others,
            &self.protected,
            &self.files,
        ];
        let pool = pools[self.rng.below(pools.len() as u64) as usize].clone();
        self.rng.pick(&pool).unwrap_or(ROOT)
    }

    fn file(&mut self, wild: bool) -> u64 {
        if wild || self.files.is_empty() {
            self.ino(true)
        } else {
            let f = self.files.clone();
            self.rng.pick(&f).unwrap_or(ROOT)
        }
    }

    fn dir(&mut self, wild: bool) -> u64 {
        if wild {
            self.ino(true)
        } else {
            let d = self.dirs.clone();
            self.rng.pick(&d).unwrap_or(ROOT)
        }
    }

    /// A name: an existing one, a fresh one, or one no directory may hold.
    fn name(&mut self, wild: bool) -> Vec<u8> {
        if wild && self.rng.chance(1, 2) {
            return match self.rng.below(12) {
                0 => Vec::new(),
                1 => b".".to_vec(),
                2 => b"..".to_vec(),
                3 => b"a/b".to_vec(),
                4 => b"/".to_vec(),
                5 => b"nul\0x".to_vec(),
                6 => vec![b'x'; 256],
                7 => vec![b'y'; 255],
                8 => vec![0xff, 0xfe, b'z'],
                9 => vec![b'w'; 4096 + self.rng.below(70000) as usize],
                10 => {
                    let n = 1 + self.rng.below(300) as usize;
                    self.rng.bytes(n)
                }
                _ => b"\0".to_vec(),
            };
        }
        if self.rng.chance(1, 2) && !self.names.is_empty() {
            let n = self.names.clone();
            return self.rng.pick(&n).unwrap_or_default();
        }
        self.next_name += 1;
        let name = format!("n{}", self.next_name).into_bytes();
        if self.names.len() < 64 {
            self.names.push(name.clone());
        } else {
            let i = self.rng.below(64) as usize;
            self.names[i] = name.clone();
        }
        name
    }

    /// A directory and a name in it: mostly an entry seen there.
    fn entry(&mut self, wild: bool) -> (u64, Vec<u8>) {
        if self.rng.chance(2, 3) {
            let e = self.entries.clone();
            if let Some((parent, name)) = self.rng.pick(&e) {
                return (
                    if wild && self.rng.chance(1, 3) {
                        self.dir(true)
                    } else {
                        parent
                    },
                    if wild && self.rng.chance(1, 3) {
                        self.name(true)
                    } else {
                        name
                    },
                );
            }
        }
        (self.dir(wild), self.name(wild))
    }

    fn saw_entry(&mut self, parent: u64, name: &[u8]) {
        if self.entries.iter().any(|(p, n)| *p == parent && n == name) {
            return;
        }
        if self.entries.len() >= 128 {
            let i = self.rng.below(128) as usize;
            self.entries.swap_remove(i);
        }
        self.entries.push((parent, name.to_vec()));
    }

    /// Credentials: root only where no protected inode is named.
    fn cred(&mut self, wild: bool, inodes: &[u64]) -> Option<pb::Credentials> {
        let protected = inodes.iter().any(|i| self.protected.contains(i));
        let uid = match self.rng.below(6) {
            0 | 1 if !protected => 0,
            0..=2 => 1000,
            3 => 65534,
            4 => self.rng.next() as u32,
            _ => u32::MAX,
        };
        let uid = if protected && uid == 0 { 1000 } else { uid };
        if wild {
            match self.rng.below(8) {
                0 => return None,
                1 => {
                    return Some(pb::Credentials {
                        uid,
                        gid: 0,
                        groups: (0..65537).collect(),
                    });
                }
                2 => {
                    return Some(pb::Credentials {
                        uid,
                        gid: u32::MAX,
                        groups: vec![0, 0, u32::MAX, 1000],
                    });
                }
                _ => {}
            }
        }
        Some(pb::Credentials {
            uid,
            gid: uid,
            groups: if self.rng.chance(1, 3) {
                vec![1000, 0]
            } else {
                vec![]
            },
        })
    }

    /// A session that is not one of the hostile node's live ones.
    fn other_session(&mut self) -> Sess {
        let pool = if self.rng.chance(1, 2) {
            self.foreign_sessions.clone()
        } else {
            self.dead_sessions.clone()
        };
        self.rng.pick(&pool).unwrap_or(Sess {
            id: self.rng.next(),
            epoch: self.epoch,
        })
    }

    fn any_session(&mut self, wild: bool) -> Sess {
        let live: Vec<Sess> = self.sessions.iter().map(|(s, _)| *s).collect();
        if (!wild || self.rng.chance(1, 2))
            && let Some(s) = self.rng.pick(&live)
        {
            return s;
        }
        match self.rng.below(4) {
            0 => {
                let f = self.foreign_sessions.clone();
                self.rng.pick(&f)
            }
            1 => {
                let d = self.dead_sessions.clone();
                self.rng.pick(&d)
            }
            _ => None,
        }
        .unwrap_or_else(|| Sess {
            id: self.u64_edge(),
            epoch: self.epoch,
        })
    }

    fn epoch(&mut self, real: u64, wild: bool) -> u64 {
        if wild && self.rng.chance(1, 2) {
            match self.rng.below(3) {
                0 => real.wrapping_add(1),
                1 => real.wrapping_sub(1),
                _ => self.u64_edge(),
            }
        } else {
            real
        }
    }

    /// A handle with its session and inode.
    fn handle(&mut self, wild: bool) -> Handle {
        if !wild || self.rng.chance(2, 3) {
            let h = self.handles.clone();
            if let Some(h) = self.rng.pick(&h) {
                return h;
            }
        }
        let old = self.old_handles.clone();
        if self.rng.chance(1, 2)
            && let Some(h) = self.rng.pick(&old)
        {
            return h;
        }
        let s = self.any_session(true);
        Handle {
            session: s.id,
            handle: self.u64_edge(),
            ino: self.ino(true),
        }
    }

    /// A handle, then each of its fields perhaps swapped for another.
    fn handle_mixed(&mut self, wild: bool) -> Handle {
        let mut h = self.handle(wild);
        if wild {
            if self.rng.chance(1, 4) {
                h.session = self.any_session(true).id;
            }
            if self.rng.chance(1, 4) {
                h.ino = self.ino(true);
            }
            if self.rng.chance(1, 6) {
                h.handle = self.u64_edge();
            }
        }
        h
    }

    fn grant(&mut self, wild: bool) -> GrantRec {
        if !wild || self.rng.chance(1, 2) {
            let g = self.grants.clone();
            if let Some(g) = self.rng.pick(&g) {
                return g;
            }
        }
        let old = self.old_grants.clone();
        if self.rng.chance(1, 2)
            && let Some(g) = self.rng.pick(&old)
        {
            return g;
        }
        let s = self.any_session(true);
        GrantRec {
            session: s.id,
            epoch: s.epoch,
            id: self.u64_edge(),
            offset: 0,
            length: 4096,
        }
    }

    /// A file offset: block aligned and small, unaligned, or at the edge.
    fn off(&mut self, wild: bool) -> u64 {
        let bs = self.block_size;
        if wild && self.rng.chance(1, 2) {
            match self.rng.below(3) {
                0 => self.u64_edge(),
                1 => self.rng.below(1 << 20),
                _ => (u64::MAX / bs - self.rng.below(4)) * bs,
            }
        } else {
            self.rng.below(48) * bs
        }
    }

    fn len(&mut self, wild: bool) -> u64 {
        let bs = self.block_size;
        if wild && self.rng.chance(1, 2) {
            match self.rng.below(4) {
                0 => self.u64_edge(),
                1 => 1 + self.rng.below(3 * bs),
                2 => MAX_INLINE as u64 + self.rng.below(2),
                _ => 0,
            }
        } else {
            (1 + self.rng.below(32)) * bs
        }
    }

    fn payload(&mut self, wild: bool) -> Vec<u8> {
        if wild && self.rng.chance(1, 3) {
            match self.rng.below(20) {
                0 => vec![0xa5; MAX_INLINE + 1],
                1..=5 => Vec::new(),
                _ => {
                    let n = self.rng.below(1 << 20) as usize;
                    self.rng.bytes(n)
                }
            }
        } else {
            let n = 1 + self.rng.below(20_000) as usize;
            self.rng.bytes(n)
        }
    }

    fn perm(&mut self, wild: bool) -> u32 {
        if wild && self.rng.chance(1, 2) {
            match self.rng.below(4) {
                0 => u32::MAX,
                1 => 0o170_777,
                2 => self.rng.next() as u32,
                _ => 0o7777,
            }
        } else {
            [0o644, 0o755, 0o600, 0o666, 0o777, 0o4755, 0o2755, 0o1777][self.rng.below(8) as usize]
        }
    }

    fn enum_value(&mut self, wild: bool, valid: u64) -> i32 {
        if wild && self.rng.chance(1, 3) {
            match self.rng.below(4) {
                0 => 0,
                1 => -1,
                2 => i32::MAX,
                _ => valid as i32 + 1,
            }
        } else {
            1 + self.rng.below(valid) as i32
        }
    }

    fn request_id(&mut self, wild: bool) -> Option<pb::RequestId> {
        match self.rng.below(6) {
            0 | 1 => None,
            2 if !self.request_ids.is_empty() => {
                // A request id reused for a different request.
                let r = self.request_ids.clone();
                self.rng.pick(&r)
            }
            3 if wild => Some(pb::RequestId {
                client: self.u64_edge(),
                seq: self.u64_edge(),
                lowest_pending: self.u64_edge(),
            }),
            _ => {
                let seq = self.request_ids.len() as u64 + 1;
                let r = pb::RequestId {
                    client: 0xbad,
                    seq,
                    lowest_pending: 1,
                };
                if self.request_ids.len() < 256 {
                    self.request_ids.push(r);
                }
                Some(r)
            }
        }
    }

    fn flags(&mut self, wild: bool) -> Option<pb::OpenFlags> {
        if wild && self.rng.chance(1, 5) {
            return None;
        }
        let bits = if wild {
            self.rng.below(16)
        } else {
            [1, 2, 3][self.rng.below(3) as usize]
        };
        Some(pb::OpenFlags {
            read: bits & 1 != 0,
            write: bits & 2 != 0,
            append: bits & 4 != 0,
            truncate: bits & 8 != 0,
        })
    }

    /// Namespace requests sometimes carry a session header: a real one, another node's, or
    /// garbage; and sometimes a replay tag.
    fn headers<T>(&mut self, wild: bool, msg: T) -> Request<T> {
        let mut r = Request::new(msg);
        if self.rng.chance(1, 3) {
            let s = self.any_session(wild);
            let v = if wild && self.rng.chance(1, 3) {
                ["", "x", "-1", "18446744073709551616", " 1", "0"][self.rng.below(6) as usize]
                    .to_owned()
            } else {
                s.id.to_string()
            };
            if let Ok(v) = v.parse() {
                r.metadata_mut().insert(sanfs_proto::headers::SESSION, v);
            }
        }
        if wild && self.rng.chance(1, 8) {
            let s = self.any_session(true);
            let v = match self.rng.below(4) {
                0 => format!(
                    "prev={};epoch={};seq={}",
                    s.id,
                    self.epoch.wrapping_sub(1),
                    self.u64_edge()
                ),
                1 => format!(
                    "prev={};epoch={};seq={};ino={};gen={}",
                    s.id,
                    self.u64_edge(),
                    self.u64_edge(),
                    self.u64_edge(),
                    self.u64_edge()
                ),
                2 => "prev=;epoch=;seq=".to_owned(),
                _ => format!("seq={};prev=0", self.u64_edge()),
            };
            if let Ok(v) = v.parse() {
                r.metadata_mut().insert(sanfs_proto::headers::REPLAY, v);
            }
        }
        if wild && self.rng.chance(1, 8) {
            // Handles to release with the call: its own, another node's, made up, too many,
            // or a header that is not one.
            let h = self.handle_mixed(true);
            let v = match self.rng.below(4) {
                0 => format!("{}:{}", h.session, h.handle),
                1 => format!("{}:{},{}", h.session, h.handle, self.u64_edge()),
                2 => format!(
                    "{}:{}",
                    h.session,
                    (1..=70)
                        .map(|i: u64| i.to_string())
                        .collect::<Vec<_>>()
                        .join(",")
                ),
                _ => ["", ":", "1:", "x:1", "1:1,,2", "0:5"][self.rng.below(6) as usize].to_owned(),
            };
            if let Ok(v) = v.parse() {
                r.metadata_mut().insert(sanfs_proto::headers::RELEASE, v);
            }
        }
        if wild && self.rng.chance(1, 10) {
            // Headers twice, very long, or a deadline that is not one.
            let m = r.metadata_mut();
            let long = "9".repeat(8000);
            for (k, v) in [
                (sanfs_proto::headers::SESSION, "1"),
                (sanfs_proto::headers::SESSION, "2"),
                (sanfs_proto::headers::REPLAY, long.as_str()),
                (
                    "grpc-timeout",
                    ["0n", "99999999H", "x", "-1S"][self.rng.below(4) as usize],
                ),
            ] {
                if self.rng.chance(1, 2)
                    && let Ok(v) = v.parse()
                {
                    m.append(k, v);
                }
            }
        }
        r
    }

    fn timed<T>(&mut self, rpc: &'static str, took: Duration, r: &Result<T, Status>, shown: &str) {
        *self.time_by_rpc.entry(rpc).or_default() += took;
        if took < Duration::from_millis(500) {
            return;
        }
        let answer = match r {
            Ok(_) => "Ok".to_owned(),
            Err(s) => format!("{:?} {:?}", s.code(), s.message()),
        };
        let mut shown = shown.to_owned();
        shown.truncate(300);
        self.slowest
            .push((took, format!("{rpc} -> {answer}: {shown}")));
        self.slowest.sort_by_key(|s| std::cmp::Reverse(s.0));
        self.slowest.truncate(8);
    }

    fn note<T>(&mut self, rpc: &'static str, r: &Result<T, Status>, what: &dyn std::fmt::Debug) {
        let code = match r {
            Ok(_) => Code::Ok,
            Err(s) => s.code(),
        };
        *self.tally.entry((rpc, code as i32)).or_default() += 1;
        if let Err(s) = r
            && let Seen::Suspicious(m) = judge(rpc, s)
        {
            let mut req = format!("{what:?}");
            req.truncate(800);
            self.findings.push(format!("{m}\n    request: {req}"));
        }
    }
}

/// Runs `fut` within [`CALL_LIMIT`]; a hang fails the test naming the call.
async fn bounded<T>(rpc: &str, what: &dyn std::fmt::Debug, fut: impl Future<Output = T>) -> T {
    match tokio::time::timeout(CALL_LIMIT, fut).await {
        Ok(r) => r,
        Err(_) => {
            let mut req = format!("{what:?}");
            req.truncate(800);
            panic!("hang: {rpc} not answered within {CALL_LIMIT:?}: {req}")
        }
    }
}

macro_rules! call {
    ($w:expr, $rpc:literal, $client:expr, $method:ident, $req:expr) => {{
        let req = $req;
        let shown = format!("{req:?}");
        let started = Instant::now();
        let r = bounded($rpc, &shown, $client.$method(req)).await;
        $w.timed($rpc, started.elapsed(), &r, &shown);
        let r = r.map(|r| r.into_inner());
        $w.note($rpc, &r, &shown);
        r
    }};
}

// ------------------------------------------------------------------------------------------
// Sessions kept alive the way an agent keeps them

fn attach_msg(s: Sess) -> pb::SessionStreamRequest {
    pb::SessionStreamRequest {
        event: Some(pb::session_stream_request::Event::Attach(pb::Attach {
            session: s.id,
            epoch: s.epoch,
        })),
    }
}

fn heartbeat_msg(seq: u64) -> pb::SessionStreamRequest {
    pb::SessionStreamRequest {
        event: Some(pb::session_stream_request::Event::Heartbeat(
            pb::Heartbeat { seq, renew: None },
        )),
    }
}

/// A session stream that heartbeats every third of the lease and acknowledges every recall,
/// as a well-behaved agent does; ends with the stream.
fn keep_alive(c: &Clients, s: Sess) -> tokio::task::JoinHandle<()> {
    let mut sc = c.session.clone();
    tokio::spawn(async move {
        let (tx, rx) = mpsc::channel(64);
        if tx.send(attach_msg(s)).await.is_err() {
            return;
        }
        let Ok(resp) = sc.session_stream(ReceiverStream::new(rx)).await else {
            return;
        };
        let mut inbound = resp.into_inner();
        let mut tick = tokio::time::interval(Duration::from_millis(LEASE_TTL_MS / 3));
        let mut seq = 0;
        loop {
            tokio::select! {
                _ = tick.tick() => {
                    seq += 1;
                    if tx.send(heartbeat_msg(seq)).await.is_err() {
                        return;
                    }
                }
                m = inbound.message() => {
                    let event = match m {
                        Ok(Some(m)) => m.event,
                        _ => return,
                    };
                    let reply = match event {
                        Some(pb::session_stream_reply::Event::Recall(r)) => {
                            pb::session_stream_request::Event::RecallAck(pb::RecallAck {
                                grant_ids: r.grant_ids,
                            })
                        }
                        Some(pb::session_stream_reply::Event::LeaseRecall(r)) => {
                            pb::session_stream_request::Event::LeaseRecallAck(
                                pb::LeaseRecallAck { id: r.id },
                            )
                        }
                        Some(pb::session_stream_reply::Event::Ended(_)) => return,
                        _ => continue,
                    };
                    let msg = pb::SessionStreamRequest { event: Some(reply) };
                    if tx.send(msg).await.is_err() {
                        return;
                    }
                }
            }
        }
    })
}

async fn open_session(c: &mut Clients, name: &str) -> Result<Sess, Status> {
    let r = c
        .session
        .open_session(pb::OpenSessionRequest {
            protocol_version: 1,
            client_name: name.into(),
            host: "fuzz".into(),
            agent_version: "0".into(),
        })
        .await?
        .into_inner();
    Ok(Sess {
        id: r.session,
        epoch: r.epoch,
    })
}

// ------------------------------------------------------------------------------------------
// Panics of the server

static SERVER_PANICS: Mutex<Vec<String>> = Mutex::new(Vec::new());
static HOOK: Once = Once::new();
/// The name of the in-process server's runtime threads.
const SERVER_THREADS: &str = "fuzz-mds";

/// Records every panic on the server's runtime threads, or anywhere in the server's or the
/// protocol crate's code, before the default hook prints it.
fn watch_panics() {
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let thread = std::thread::current().name().unwrap_or("").to_owned();
            let file = info
                .location()
                .map(|l| l.file().to_owned())
                .unwrap_or_default();
            let ours = [
                "metadata-server/src",
                "proto/src",
                "blockmap/src",
                "lun/src",
            ]
            .iter()
            .any(|p| file.contains(p));
            if thread.starts_with(SERVER_THREADS) || ours {
                SERVER_PANICS
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(format!("thread {thread}: {info}"));
            }
            previous(info);
        }));
    });
}

fn server_panics() -> Vec<String> {
    SERVER_PANICS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone()
}

// ------------------------------------------------------------------------------------------
// The well-behaved node

/// A file of the well-behaved node and the bytes it wrote.
struct Kept {
    ino: u64,
    bytes: Vec<u8>,
}

/// Makes the namespace: `keep/` (root's, 0755) with files the hostile node may read but not
/// change, and `play/` (0777) with files, a directory, a symlink and a fifo for it to use.
/// Data goes through the proxied Write path so that the files have extents.
/// What [`set_up`] made.
struct Made {
    kept: Vec<Kept>,
    files: Vec<u64>,
    dirs: Vec<u64>,
    others: Vec<u64>,
    protected: Vec<u64>,
}

async fn set_up(good: &mut Clients, s: Sess, rng: &mut Rng) -> Made {
    let cred = crate::harness::root();
    let mkdir = |parent: u64, name: &str, perm: u32| pb::MkdirRequest {
        cred: cred.clone(),
        parent,
        name: name.into(),
        perm,
        delegate: false,
        request_id: None,
    };
    let keep = good
        .ns
        .mkdir(mkdir(ROOT, "keep", 0o755))
        .await
        .unwrap()
        .into_inner()
        .attr
        .unwrap()
        .ino;
    let play = good
        .ns
        .mkdir(mkdir(ROOT, "play", 0o777))
        .await
        .unwrap()
        .into_inner()
        .attr
        .unwrap()
        .ino;
    let sub = good
        .ns
        .mkdir(mkdir(play, "sub", 0o777))
        .await
        .unwrap()
        .into_inner()
        .attr
        .unwrap()
        .ino;
    let mut kept = Vec::new();
    let mut files = Vec::new();
    let mut others = Vec::new();
    for (parent, i, len) in [
        (keep, 0, 5000u64),
        (keep, 1, 200_000),
        (keep, 2, 70_000),
        (play, 3, 100_000),
        (play, 4, 4096),
        (sub, 5, 300_000),
    ] {
        let c = good
            .ns
            .create(pb::CreateRequest {
                delegate: false,
                inode: 0,
                time: None,
                cred: cred.clone(),
                session: s.id,
                parent,
                name: format!("f{i}").into(),
                perm: if parent == keep { 0o644 } else { 0o666 },
                exclusive: true,
                flags: crate::harness::rw(),
                request_id: None,
            })
            .await
            .unwrap()
            .into_inner();
        let ino = c.attr.unwrap().ino;
        let bytes = rng.bytes(len as usize);
        // In pieces, some unaligned, the last one sync.
        let mut off = 0usize;
        while off < bytes.len() {
            let n = (bytes.len() - off).min(1 + rng.below(90_000) as usize);
            good.data
                .write(pb::WriteRequest {
                    cred: cred.clone(),
                    session: s.id,
                    handle: c.handle,
                    inode: ino,
                    offset: off as u64,
                    data: bytes[off..off + n].to_vec(),
                    sync: off + n == bytes.len(),
                    append: false,
                    request_id: None,
                    then_set_attr: None,
                })
                .await
                .unwrap();
            off += n;
        }
        good.ns
            .release(pb::ReleaseRequest {
                session: s.id,
                handle: c.handle,
            })
            .await
            .unwrap();
        if parent == keep {
            kept.push(Kept { ino, bytes });
        } else {
            files.push(ino);
        }
    }
    let link = good
        .ns
        .symlink(pb::SymlinkRequest {
            cred: cred.clone(),
            parent: play,
            name: "ln".into(),
            target: "f3".into(),
            request_id: None,
        })
        .await
        .unwrap()
        .into_inner();
    others.push(link.attr.unwrap().ino);
    let fifo = good
        .ns
        .mknod(pb::MknodRequest {
            cred: cred.clone(),
            parent: play,
            name: "fifo".into(),
            kind: pb::FileType::Fifo as i32,
            perm: 0o666,
            rdev: 0,
            request_id: None,
        })
        .await
        .unwrap()
        .into_inner();
    others.push(fifo.attr.unwrap().ino);
    let mut protected: Vec<u64> = kept.iter().map(|k| k.ino).collect();
    protected.push(keep);
    Made {
        kept,
        files,
        dirs: vec![ROOT, play, sub],
        others,
        protected,
    }
}

/// The well-behaved node's files read back exactly (through a new session: the old one may
/// have been evicted or replaced by a hostile stream).
async fn check_kept(good: &mut Clients, kept: &[Kept]) {
    let s = open_session(good, "check").await.unwrap();
    for k in kept {
        let o = good
            .ns
            .open(pb::OpenRequest {
                cred: crate::harness::root(),
                session: s.id,
                inode: k.ino,
                flags: Some(pb::OpenFlags {
                    read: true,
                    write: false,
                    append: false,
                    truncate: false,
                }),
                read_small: 0,
            })
            .await
            .unwrap()
            .into_inner();
        let attr = o.attr.unwrap();
        assert_eq!(
            attr.size,
            k.bytes.len() as u64,
            "size of kept inode {}",
            k.ino
        );
        assert_eq!(
            (attr.uid, attr.perm & 0o7777),
            (0, 0o644),
            "kept inode {}",
            k.ino
        );
        let mut got = Vec::new();
        while got.len() < k.bytes.len() {
            let r = good
                .data
                .read(pb::ReadRequest {
                    cred: crate::harness::root(),
                    session: s.id,
                    handle: o.handle,
                    inode: k.ino,
                    offset: got.len() as u64,
                    length: (k.bytes.len() - got.len()).min(1 << 20) as u64,
                })
                .await
                .unwrap()
                .into_inner();
            assert!(!r.data.is_empty(), "short read of kept inode {}", k.ino);
            got.extend_from_slice(&r.data);
        }
        assert!(got == k.bytes, "kept inode {} changed", k.ino);
    }
}

/// The server still serves a well-behaved request.
async fn probe(good: &mut Clients) -> Result<(), String> {
    let r = tokio::time::timeout(
        Duration::from_secs(10),
        good.ns.get_attr(pb::GetAttrRequest {
            cred: crate::harness::root(),
            inode: ROOT,
            session: None,
        }),
    )
    .await;
    match r {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e)) => Err(format!("probe GetAttr(root): {e:?}")),
        Err(_) => Err("probe GetAttr(root) hung".to_owned()),
    }
}

// ------------------------------------------------------------------------------------------
// One random call

impl World {
    /// Keeps two or more hostile sessions alive (hostile streams replace their keep-alives,
    /// evictions end them): opens new ones as needed.
    async fn top_up_sessions(&mut self) {
        let mut i = 0;
        while i < self.sessions.len() {
            if self.sessions[i].1.is_finished() {
                let (s, _) = self.sessions.swap_remove(i);
                self.dead_sessions.push(s);
            } else {
                i += 1;
            }
        }
        while self.sessions.len() < 3 {
            let c = self.bad();
            let Ok(s) = open_session(c, "bad").await else {
                break;
            };
            let task = keep_alive(c, s);
            self.epoch = s.epoch;
            self.sessions.push((s, task));
        }
        if self.dead_sessions.len() > 64 {
            self.dead_sessions.drain(..32);
        }
        if self.old_handles.len() > 256 {
            self.old_handles.drain(..128);
        }
        if self.old_grants.len() > 256 {
            self.old_grants.drain(..128);
        }
        let live: Vec<u64> = self.sessions.iter().map(|(s, _)| s.id).collect();
        let (keep, gone): (Vec<Handle>, Vec<Handle>) = self
            .handles
            .drain(..)
            .partition(|h| live.contains(&h.session));
        self.handles = keep;
        self.old_handles.extend(gone);
        let (keep, gone): (Vec<GrantRec>, Vec<GrantRec>) = self
            .grants
            .drain(..)
            .partition(|g| live.contains(&g.session));
        self.grants = keep;
        self.old_grants.extend(gone);
    }

    /// After a server restart: every session, handle and grant of the hostile node belongs
    /// to the last epoch now (kept, to be used again), and the connections are new.
    fn reconnect(&mut self, good: Clients, bad_channels: Vec<Channel>) {
        for (s, t) in self.sessions.drain(..) {
            t.abort();
            self.dead_sessions.push(s);
        }
        self.foreign_sessions
            .extend(self.dead_sessions.iter().copied());
        self.old_handles.append(&mut self.handles);
        self.old_grants.append(&mut self.grants);
        self.good = good;
        self.bad = bad_channels.iter().cloned().map(Clients::new).collect();
        self.bad_locks = bad_channels.iter().cloned().map(LocksClient::new).collect();
        self.bad_channels = bad_channels;
    }

    async fn one_call(&mut self) {
        let wild = self.rng.chance(1, 2);
        let w = self;
        match w.rng.below(51) {
            0 => {
                let req = pb::OpenSessionRequest {
                    protocol_version: if wild { w.u64_edge() as u32 } else { 1 },
                    client_name: if wild {
                        ["", "x", &"n".repeat(300), "nul\0"][w.rng.below(4) as usize].to_owned()
                    } else {
                        "bad".to_owned()
                    },
                    host: if wild { "h".repeat(256) } else { "h".into() },
                    agent_version: "0".into(),
                };
                let c = w.bad();
                if let Ok(r) = call!(w, "OpenSession", c.session, open_session, req) {
                    // Sessions without a stream: they expire within a lease.
                    w.dead_sessions.push(Sess {
                        id: r.session,
                        epoch: r.epoch,
                    });
                }
            }
            1 => {
                let s = if w.rng.chance(1, 4) {
                    w.any_session(wild)
                } else {
                    w.other_session()
                };
                let req = pb::CloseSessionRequest {
                    session: s.id,
                    epoch: w.epoch(s.epoch, wild),
                };
                call!(w, "CloseSession", w.bad[0].session, close_session, req).ok();
            }
            2 => w.stream_call(wild).await,
            3 => {
                let (parent, name) = w.entry(wild);
                let req = pb::LookupRequest {
                    cred: w.cred(wild, &[parent]),
                    parent,
                    name,
                    session: w.rng.chance(1, 2).then(|| w.any_session(wild).id),
                };
                let req = w.headers(wild, req);
                let c = w.bad();
                if let Ok(r) = call!(w, "Lookup", c.ns, lookup, req)
                    && let Some(a) = r.attr
                {
                    w.learn(a);
                }
            }
            4 => {
                let inode = w.ino(wild);
                let req = pb::GetAttrRequest {
                    cred: w.cred(wild, &[inode]),
                    inode,
                    session: w.rng.chance(1, 2).then(|| w.any_session(wild).id),
                };
                let req = w.headers(wild, req);
                let c = w.bad();
                call!(w, "GetAttr", c.ns, get_attr, req).ok();
            }
            5 => {
                let h = w.handle_mixed(wild);
                let inode = if w.rng.chance(1, 2) {
                    h.ino
                } else {
                    w.ino(wild)
                };
                let time = |w: &mut World| -> Option<pb::TimeSet> {
                    match w.rng.below(5) {
                        0 => None,
                        1 => Some(pb::TimeSet {
                            value: Some(pb::time_set::Value::Now(w.rng.chance(3, 4))),
                        }),
                        2 => Some(pb::TimeSet { value: None }),
                        _ => Some(pb::TimeSet {
                            value: Some(pb::time_set::Value::At(pb::Timestamp {
                                sec: w.u64_edge() as i64,
                                nsec: if w.rng.chance(1, 2) {
                                    w.u64_edge() as u32
                                } else {
                                    999_999_999
                                },
                            })),
                        }),
                    }
                };
                let changes = pb::SetAttrChanges {
                    perm: w.rng.chance(1, 3).then(|| w.perm(wild)),
                    uid: w.rng.chance(1, 5).then(|| w.u64_edge() as u32),
                    gid: w.rng.chance(1, 5).then(|| w.u64_edge() as u32),
                    size: w.rng.chance(1, 3).then(|| {
                        if wild {
                            w.u64_edge()
                        } else {
                            w.rng.below(1 << 20)
                        }
                    }),
                    atime: time(w),
                    mtime: time(w),
                    ctime: w.rng.chance(1, 8).then(|| pb::Timestamp {
                        sec: w.u64_edge() as i64,
                        nsec: w.u64_edge() as u32,
                    }),
                };
                let with_handle = w.rng.chance(1, 3);
                let req = pb::SetAttrRequest {
                    cred: w.cred(wild, &[inode, h.ino]),
                    inode,
                    changes: (!wild || w.rng.chance(7, 8)).then_some(changes),
                    handle: with_handle.then_some(h.handle),
                    session: (with_handle || (wild && w.rng.chance(1, 3))).then_some(h.session),
                };
                let req = w.headers(wild, req);
                let c = w.bad();
                call!(w, "SetAttr", c.ns, set_attr, req).ok();
            }
            6 => {
                let (parent, name) = if w.rng.chance(1, 3) {
                    w.entry(wild)
                } else {
                    (w.dir(wild), w.name(wild))
                };
                let s = w.any_session(wild);
                let req = pb::CreateRequest {
                    cred: w.cred(wild, &[parent]),
                    session: s.id,
                    parent,
                    name: name.clone(),
                    perm: w.perm(wild),
                    exclusive: w.rng.chance(1, 2),
                    flags: w.flags(wild),
                    delegate: w.rng.chance(1, 4),
                    // Now and then a number ReserveInodes answered (maybe used already, or
                    // another session's), or any number at all.
                    inode: match w.rng.below(6) {
                        0 if !w.reserved.is_empty() => {
                            let i = w.rng.below(w.reserved.len() as u64) as usize;
                            w.reserved[i]
                        }
                        1 if wild => w.u64_edge(),
                        _ => 0,
                    },
                    // Now and then the agent's time: any seconds, nanoseconds maybe past 10^9.
                    time: w.rng.chance(1, 3).then(|| pb::Timestamp {
                        sec: w.u64_edge() as i64,
                        nsec: if wild {
                            w.u64_edge() as u32
                        } else {
                            w.rng.below(1_000_000_000) as u32
                        },
                    }),
                    request_id: w.request_id(wild),
                };
                let req = w.headers(wild, req);
                let c = w.bad();
                if let Ok(r) = call!(w, "Create", c.ns, create, req) {
                    w.saw_entry(parent, &name);
                    if let Some(a) = r.attr {
                        w.learn(a);
                        w.handles.push(Handle {
                            session: s.id,
                            handle: r.handle,
                            ino: a.ino,
                        });
                    }
                    if r.delegation != 0 {
                        w.grants.push(GrantRec {
                            session: s.id,
                            epoch: s.epoch,
                            id: r.delegation,
                            offset: 0,
                            length: 0,
                        });
                    }
                }
            }
            7 => {
                let parent = w.dir(wild);
                let name = w.name(wild);
                let req = pb::MkdirRequest {
                    cred: w.cred(wild, &[parent]),
                    parent,
                    name: name.clone(),
                    perm: w.perm(wild),
                    delegate: w.rng.chance(1, 3),
                    request_id: w.request_id(wild),
                };
                let req = w.headers(wild, req);
                let c = w.bad();
                if let Ok(r) = call!(w, "Mkdir", c.ns, mkdir, req) {
                    w.saw_entry(parent, &name);
                    if let Some(a) = r.attr {
                        w.learn(a);
                    }
                }
            }
            8 => {
                let parent = w.dir(wild);
                let kind = w.enum_value(wild, 7);
                let name = w.name(wild);
                let req = pb::MknodRequest {
                    cred: w.cred(wild, &[parent]),
                    parent,
                    name: name.clone(),
                    kind,
                    perm: w.perm(wild),
                    rdev: if wild { w.u64_edge() } else { 0 },
                    request_id: w.request_id(wild),
                };
                let req = w.headers(wild, req);
                let c = w.bad();
                if let Ok(r) = call!(w, "Mknod", c.ns, mknod, req) {
                    w.saw_entry(parent, &name);
                    if let Some(a) = r.attr {
                        w.learn(a);
                    }
                }
            }
            9 => {
                let (parent, name) = w.entry(wild);
                let req = pb::UnlinkRequest {
                    cred: w.cred(wild, &[parent]),
                    parent,
                    name,
                    request_id: w.request_id(wild),
                };
                let req = w.headers(wild, req);
                let c = w.bad();
                call!(w, "Unlink", c.ns, unlink, req).ok();
            }
            10 => {
                let (parent, name) = w.entry(wild);
                let req = pb::RmdirRequest {
                    cred: w.cred(wild, &[parent]),
                    parent,
                    name,
                    request_id: w.request_id(wild),
                };
                let req = w.headers(wild, req);
                let c = w.bad();
                call!(w, "Rmdir", c.ns, rmdir, req).ok();
            }
            11 => {
                let (a, old_name) = w.entry(wild);
                let (b, new_name) = if w.rng.chance(1, 2) {
                    w.entry(wild)
                } else {
                    (w.dir(wild), w.name(wild))
                };
                let mode = w.enum_value(wild, 3);
                let req = pb::RenameRequest {
                    cred: w.cred(wild, &[a, b]),
                    old_parent: a,
                    old_name,
                    new_parent: b,
                    new_name: new_name.clone(),
                    mode,
                    request_id: w.request_id(wild),
                };
                let req = w.headers(wild, req);
                let c = w.bad();
                if call!(w, "Rename", c.ns, rename, req).is_ok() {
                    w.saw_entry(b, &new_name);
                }
            }
            12 => {
                let (inode, parent) = (w.ino(wild), w.dir(wild));
                let name = w.name(wild);
                let req = pb::LinkRequest {
                    cred: w.cred(wild, &[inode, parent]),
                    inode,
                    new_parent: parent,
                    new_name: name.clone(),
                    request_id: w.request_id(wild),
                };
                let req = w.headers(wild, req);
                let c = w.bad();
                if call!(w, "Link", c.ns, link, req).is_ok() {
                    w.saw_entry(parent, &name);
                }
            }
            13 => {
                let parent = w.dir(wild);
                let target = if wild {
                    match w.rng.below(4) {
                        0 => Vec::new(),
                        1 => vec![b'/'; 4097],
                        2 => b"a\0b".to_vec(),
                        _ => w.name(true),
                    }
                } else {
                    b"../f3".to_vec()
                };
                let name = w.name(wild);
                let req = pb::SymlinkRequest {
                    cred: w.cred(wild, &[parent]),
                    parent,
                    name: name.clone(),
                    target,
                    request_id: w.request_id(wild),
                };
                let req = w.headers(wild, req);
                let c = w.bad();
                if let Ok(r) = call!(w, "Symlink", c.ns, symlink, req) {
                    w.saw_entry(parent, &name);
                    if let Some(a) = r.attr {
                        w.learn(a);
                    }
                }
            }
            14 => {
                let inode = w.ino(wild);
                let req = pb::ReadlinkRequest {
                    cred: w.cred(wild, &[inode]),
                    inode,
                };
                let c = w.bad();
                call!(w, "Readlink", c.ns, readlink, req).ok();
            }
            15 => {
                let inode = w.dir(wild);
                let req = pb::ReadDirRequest {
                    cred: w.cred(wild, &[inode]),
                    inode,
                    cookie: if wild { w.u64_edge() } else { 0 },
                    max_entries: if wild {
                        w.u64_edge() as u32
                    } else {
                        1 + w.rng.below(100) as u32
                    },
                    plus: w.rng.chance(1, 2),
                    session: w.rng.chance(1, 2).then(|| w.any_session(wild).id),
                };
                let req = w.headers(wild, req);
                let c = w.bad();
                if let Ok(r) = call!(w, "ReadDir", c.ns, read_dir, req) {
                    for e in r.entries {
                        w.saw_entry(inode, &e.name);
                        if let Some(a) = e.attr {
                            w.learn(a);
                        }
                    }
                }
            }
            16 => {
                let inode = w.ino(wild);
                let req = pb::StatFsRequest {
                    cred: w.cred(wild, &[inode]),
                    inode,
                };
                let c = w.bad();
                call!(w, "StatFs", c.ns, stat_fs, req).ok();
            }
            17..=20 => {
                let inode = w.ino(wild);
                let name = if wild && w.rng.chance(1, 2) {
                    w.name(true)
                } else {
                    [
                        "user.a",
                        "user.b",
                        "trusted.t",
                        "security.capability",
                        "system.posix_acl_access",
                        "bogus.x",
                        "user.",
                    ][w.rng.below(7) as usize]
                        .into()
                };
                let cred = w.cred(wild, &[inode]);
                match w.rng.below(4) {
                    0 => {
                        let req = pb::GetXattrRequest { cred, inode, name };
                        let c = w.bad();
                        call!(w, "GetXattr", c.ns, get_xattr, req).ok();
                    }
                    1 => {
                        let value = if wild && w.rng.chance(1, 4) {
                            vec![7; 65537]
                        } else {
                            let n = w.rng.below(300) as usize;
                            w.rng.bytes(n)
                        };
                        let req = pb::SetXattrRequest {
                            cred,
                            inode,
                            name,
                            value,
                            mode: w.enum_value(wild, 3),
                        };
                        let req = w.headers(wild, req);
                        let c = w.bad();
                        call!(w, "SetXattr", c.ns, set_xattr, req).ok();
                    }
                    2 => {
                        let req = pb::ListXattrRequest { cred, inode };
                        let c = w.bad();
                        call!(w, "ListXattr", c.ns, list_xattr, req).ok();
                    }
                    _ => {
                        let req = pb::RemoveXattrRequest { cred, inode, name };
                        let req = w.headers(wild, req);
                        let c = w.bad();
                        call!(w, "RemoveXattr", c.ns, remove_xattr, req).ok();
                    }
                }
            }
            21 | 22 => {
                let inode = w.file(wild);
                let s = w.any_session(wild);
                let req = pb::OpenRequest {
                    cred: w.cred(wild, &[inode]),
                    session: s.id,
                    inode,
                    flags: w.flags(wild),
                    read_small: if w.rng.chance(1, 2) { w.u64_edge() } else { 0 },
                };
                let c = w.bad();
                if let Ok(r) = call!(w, "Open", c.ns, open, req) {
                    w.handles.push(Handle {
                        session: s.id,
                        handle: r.handle,
                        ino: inode,
                    });
                }
            }
            23 => {
                let h = w.handle_mixed(wild);
                let req = pb::ReleaseRequest {
                    session: h.session,
                    handle: h.handle,
                };
                let c = w.bad();
                if call!(w, "Release", c.ns, release, req).is_ok() {
                    w.handles.retain(|x| x.handle != h.handle);
                    w.old_handles.push(h);
                }
            }
            24 => {
                let inode = w.ino(wild);
                let req = pb::AccessRequest {
                    cred: w.cred(wild, &[inode]),
                    inode,
                    mask: if wild {
                        w.u64_edge() as u32
                    } else {
                        w.rng.below(8) as u32
                    },
                };
                let c = w.bad();
                call!(w, "Access", c.ns, access, req).ok();
            }
            25..=28 => w.map_call(wild).await,
            29 | 30 => w.complete_call(wild).await,
            31 => {
                let mut ids = Vec::new();
                let n = match (wild, w.rng.below(10)) {
                    (true, 0) => 70_000,
                    (true, _) => w.rng.below(5),
                    (false, _) => 1,
                };
                let g = w.grant(wild);
                for _ in 0..n.max(u64::from(!wild)) {
                    ids.push(if w.rng.chance(3, 4) {
                        g.id
                    } else {
                        w.grant(true).id
                    });
                }
                let req = pb::ReturnGrantRequest {
                    session: g.session,
                    epoch: w.epoch(g.epoch, wild),
                    grant_ids: ids.clone(),
                };
                let c = w.bad();
                if call!(w, "ReturnGrant", c.data, return_grant, req).is_ok() {
                    w.grants.retain(|x| !ids.contains(&x.id));
                }
            }
            32 | 33 => {
                let h = w.handle_mixed(wild);
                let req = pb::ReadRequest {
                    cred: w.cred(wild, &[h.ino]),
                    session: h.session,
                    handle: h.handle,
                    inode: h.ino,
                    offset: w.off(wild),
                    length: w.len(wild),
                };
                let c = w.bad();
                call!(w, "Read", c.data, read, req).ok();
            }
            34 | 35 => {
                let h = w.handle_mixed(wild);
                let append = w.rng.chance(1, 5);
                let req = pb::WriteRequest {
                    cred: w.cred(wild, &[h.ino]),
                    session: h.session,
                    handle: h.handle,
                    inode: h.ino,
                    offset: if append && !wild { 0 } else { w.off(wild) },
                    data: w.payload(wild),
                    sync: w.rng.chance(1, 4),
                    append,
                    request_id: if append { w.request_id(wild) } else { None },
                    then_set_attr: w.rng.chance(1, 6).then(|| pb::SetAttrChanges {
                        perm: Some(w.perm(wild)),
                        uid: w.rng.chance(1, 3).then(|| w.u64_edge() as u32),
                        gid: None,
                        size: wild.then(|| w.u64_edge()),
                        atime: None,
                        mtime: Some(pb::TimeSet {
                            value: Some(pb::time_set::Value::Now(true)),
                        }),
                        ctime: None,
                    }),
                };
                let c = w.bad();
                call!(w, "Write", c.data, write, req).ok();
            }
            36 => {
                let h = w.handle_mixed(wild);
                let req = pb::FsyncRequest {
                    cred: w.cred(wild, &[h.ino]),
                    session: h.session,
                    handle: h.handle,
                    inode: h.ino,
                    data_only: w.rng.chance(1, 2),
                };
                let c = w.bad();
                call!(w, "Fsync", c.data, fsync, req).ok();
            }
            37 => {
                let h = w.handle_mixed(wild);
                let req = pb::FallocateRequest {
                    cred: w.cred(wild, &[h.ino]),
                    session: h.session,
                    handle: h.handle,
                    inode: h.ino,
                    offset: w.off(wild),
                    length: w.len(wild),
                    mode: w.enum_value(wild, 5),
                };
                let c = w.bad();
                call!(w, "Fallocate", c.data, fallocate, req).ok();
            }
            38 => {
                let inode = w.ino(wild);
                let req = pb::GetExtentsRequest {
                    cred: w.cred(wild, &[inode]),
                    inode,
                    offset: w.off(wild),
                    length: w.len(wild),
                };
                let c = w.bad();
                call!(w, "GetExtents", c.data, get_extents, req).ok();
            }
            39 => {
                let s = w.any_session(wild);
                let prev = w.any_session(true);
                let n = w.rng.below(if wild { 4 } else { 2 });
                let mut records = Vec::new();
                for _ in 0..n {
                    let runs = (0..w.rng.below(3))
                        .map(|_| pb::ReplayRun {
                            file_off: w.off(wild),
                            device: w.u64_edge() as u32 % 6,
                            phys_off: w.u64_edge(),
                            len: w.len(wild),
                        })
                        .collect();
                    records.push(pb::ReplayRecord {
                        inode: w.file(wild),
                        epoch: w.epoch(w.epoch.wrapping_sub(1), wild),
                        commit_seq: w.u64_edge(),
                        offset: w.off(wild),
                        length: w.len(wild),
                        runs,
                    });
                }
                let req = pb::ReplayWritesRequest {
                    session: s.id,
                    epoch: w.epoch(s.epoch, wild),
                    previous_session: prev.id,
                    records,
                    reclaim_complete: w.rng.chance(1, 2),
                };
                let c = w.bad();
                call!(w, "ReplayWrites", c.data, replay_writes, req).ok();
            }
            40 => {
                let h = w.handle_mixed(wild);
                let s = w
                    .sessions
                    .iter()
                    .find(|(s, _)| s.id == h.session)
                    .map(|x| x.0);
                let epoch = s.map_or(w.epoch, |s| s.epoch);
                let req = pb::DelegateRequest {
                    session: h.session,
                    handle: h.handle,
                    inode: h.ino,
                    epoch: w.epoch(epoch, wild),
                    write: w.rng.chance(1, 2),
                    // Now and then a reclaim naming some session as the previous one (the
                    // window is over: refused, nothing given).
                    reclaim_of: if w.rng.chance(1, 6) {
                        w.any_session(true).id
                    } else {
                        0
                    },
                };
                let c = w.bad();
                if let Ok(r) = call!(w, "Delegate", c.data, delegate, req)
                    && r.delegation != 0
                {
                    w.grants.push(GrantRec {
                        session: h.session,
                        epoch,
                        id: r.delegation,
                        offset: 0,
                        length: 0,
                    });
                }
            }
            41 | 42 => w.lock_call(wild).await,
            43 => w.raw_call().await,
            44 => w.raw_socket().await,
            45 | 46 => w.burst().await,
            47 => {
                let s = w.any_session(wild);
                let count = if wild {
                    w.u64_edge() as u32
                } else {
                    1 + w.rng.below(8) as u32
                };
                let req = pb::ReserveInodesRequest {
                    session: s.id,
                    count,
                };
                let req = w.headers(wild, req);
                let c = w.bad();
                if let Ok(r) = call!(w, "ReserveInodes", c.ns, reserve_inodes, req) {
                    let n = u64::from(r.count.min(8));
                    w.reserved.extend((0..n).map(|i| r.first_inode + i));
                }
            }
            48 => {
                // Unlinks, renames and attribute changes side by side, now and then naming
                // one entry or inode twice, an attribute change with a size or a handle, or
                // none at all (refused whole).
                use pb::batched_change::Change;
                let n = w.rng.below(if wild { 6 } else { 4 });
                let mut changes = Vec::new();
                for _ in 0..n {
                    let (a, name) = w.entry(wild);
                    let change = if w.rng.chance(1, 4) {
                        let inode = if w.rng.chance(1, 2) { a } else { w.dir(wild) };
                        let changes = pb::SetAttrChanges {
                            perm: w.rng.chance(2, 3).then(|| w.perm(wild)),
                            uid: (wild && w.rng.chance(1, 5)).then(|| w.u64_edge() as u32),
                            size: (wild && w.rng.chance(1, 6)).then(|| w.rng.below(1 << 20)),
                            mtime: w.rng.chance(1, 2).then(|| pb::TimeSet {
                                value: Some(pb::time_set::Value::At(pb::Timestamp {
                                    sec: w.u64_edge() as i64,
                                    nsec: w.rng.below(1_000_000_000) as u32,
                                })),
                            }),
                            ctime: w.rng.chance(1, 2).then(|| pb::Timestamp {
                                sec: w.u64_edge() as i64,
                                nsec: w.u64_edge() as u32,
                            }),
                            ..Default::default()
                        };
                        Change::SetAttr(pb::SetAttrRequest {
                            cred: w.cred(wild, &[inode]),
                            inode,
                            changes: (!wild || w.rng.chance(7, 8)).then_some(changes),
                            handle: None,
                            session: None,
                        })
                    } else if w.rng.chance(1, 2) {
                        Change::Unlink(pb::UnlinkRequest {
                            cred: w.cred(wild, &[a]),
                            parent: a,
                            name,
                            request_id: w.request_id(wild),
                        })
                    } else {
                        let (b, new_name) = (w.dir(wild), w.name(wild));
                        Change::Rename(pb::RenameRequest {
                            cred: w.cred(wild, &[a, b]),
                            old_parent: a,
                            old_name: name,
                            new_parent: b,
                            new_name,
                            mode: w.enum_value(wild, 3),
                            request_id: w.request_id(wild),
                        })
                    };
                    let empty = wild && w.rng.chance(1, 8);
                    changes.push(pb::BatchedChange {
                        change: (!empty).then_some(change),
                    });
                }
                let req = w.headers(wild, pb::ChangeBatchRequest { changes });
                let c = w.bad();
                call!(w, "ChangeBatch", c.ns, change_batch, req).ok();
            }
            _ => w.admin_call(wild).await,
        }
    }

    /// An attribute seen in a reply: its inode joins the pools.
    fn learn(&mut self, a: pb::Attr) {
        let pool = match pb::FileType::try_from(a.kind) {
            Ok(pb::FileType::Regular) => &mut self.files,
            Ok(pb::FileType::Directory) => &mut self.dirs,
            _ => &mut self.others,
        };
        if !pool.contains(&a.ino) && !self.protected.contains(&a.ino) {
            if pool.len() >= 64 {
                pool.remove(8);
            }
            pool.push(a.ino);
        }
    }

    async fn map_call(&mut self, wild: bool) {
        let w = self;
        let h = w.handle_mixed(wild);
        let s = w
            .sessions
            .iter()
            .find(|(s, _)| s.id == h.session)
            .map(|x| x.0);
        let epoch = s.map_or(w.epoch, |s| s.epoch);
        let write = w.rng.chance(1, 2);
        let layout = write && w.rng.chance(1, 3);
        let req = pb::MapRequest {
            cred: w.cred(wild, &[h.ino]),
            session: h.session,
            epoch: w.epoch(epoch, wild),
            handle: h.handle,
            inode: h.ino,
            offset: w.off(wild),
            length: w.len(wild),
            sync: w.rng.chance(1, 4),
            layout,
            ahead: layout && w.rng.chance(1, 3),
        };
        let c = w.bad();
        let r = if write {
            call!(w, "MapWrite", c.data, map_write, req)
        } else {
            call!(w, "MapRead", c.data, map_read, req)
        };
        let Ok(g) = r else { return };
        let rec = GrantRec {
            session: h.session,
            epoch,
            id: g.grant_id,
            offset: g.offset,
            length: g.length,
        };
        // Mostly complete at once, as an agent does; sometimes keep the grant out.
        if !wild && w.rng.chance(3, 4) {
            let req = pb::CompleteRequest {
                session: rec.session,
                epoch: rec.epoch,
                grant_id: rec.id,
                status: pb::IoStatus::Ok as i32,
                errors: vec![],
                bytes_done: if layout { 0 } else { rec.length },
                sync: false,
                keep: false,
                offset: 0,
                more: vec![],
            };
            let c = w.bad();
            if call!(w, "Complete", c.data, complete, req).is_ok() {
                w.old_grants.push(rec);
                return;
            }
        }
        w.grants.push(rec);
    }

    async fn complete_call(&mut self, wild: bool) {
        let w = self;
        let g = w.grant(wild);
        let keep = w.rng.chance(1, 3);
        let device_error = wild && w.rng.chance(1, 4);
        let errors = if device_error || wild && w.rng.chance(1, 6) {
            (0..w.rng.below(3))
                .map(|_| pb::ExtentError {
                    device: w.u64_edge() as u32,
                    phys_off: w.u64_edge(),
                    len: w.u64_edge(),
                    errno: w.u64_edge() as i32,
                })
                .collect()
        } else {
            vec![]
        };
        let in_grant = |w: &mut World| -> (u64, u64) {
            let blocks = (g.length / w.block_size).max(1);
            let a = w.rng.below(blocks);
            let b = a + 1 + w.rng.below(blocks - a);
            (g.offset + a * w.block_size, (b - a) * w.block_size)
        };
        let (offset, bytes_done) = if wild {
            // Parts the grant did not cover, overflowing ranges.
            match w.rng.below(3) {
                0 => (w.off(true), w.len(true)),
                1 => (g.offset.wrapping_add(g.length), w.block_size),
                _ => (w.u64_edge(), w.u64_edge()),
            }
        } else if keep {
            in_grant(w)
        } else {
            (0, g.length)
        };
        let more = if keep && w.rng.chance(1, 3) {
            (0..w.rng.below(if wild { 300 } else { 4 }))
                .map(|_| {
                    let (offset, length) = if wild && w.rng.chance(1, 2) {
                        (w.off(true), w.len(true))
                    } else {
                        in_grant(w)
                    };
                    pb::CompletedPart { offset, length }
                })
                .collect()
        } else {
            vec![]
        };
        let req = pb::CompleteRequest {
            session: g.session,
            epoch: w.epoch(g.epoch, wild),
            grant_id: g.id,
            status: if device_error {
                pb::IoStatus::DeviceError as i32
            } else {
                w.enum_value(wild, 1)
            },
            errors,
            bytes_done,
            sync: w.rng.chance(1, 4),
            keep,
            offset: if keep || wild { offset } else { 0 },
            more,
        };
        let c = w.bad();
        if call!(w, "Complete", c.data, complete, req).is_ok() && !keep {
            w.grants.retain(|x| x.id != g.id);
            w.old_grants.push(g);
        }
    }

    async fn lock_call(&mut self, wild: bool) {
        let w = self;
        let h = w.handle_mixed(wild);
        let start = if wild { w.u64_edge() } else { w.rng.below(100) };
        let end = if wild {
            w.u64_edge()
        } else if w.rng.chance(1, 4) {
            u64::MAX
        } else {
            start + w.rng.below(100)
        };
        let req = pb::LockRequest {
            cred: w.cred(wild, &[h.ino]),
            session: h.session,
            handle: h.handle,
            inode: h.ino,
            owner: if wild {
                w.u64_edge()
            } else {
                1 + w.rng.below(4)
            },
            lock: (!wild || w.rng.chance(4, 5)).then(|| pb::FileLock {
                r#type: w.enum_value(wild, 3),
                start,
                end,
                pid: w.rng.next() as u32,
            }),
            wait_ms: match w.rng.below(6) {
                0 if wild => u32::MAX,
                1 if wild => 60_001,
                2 => w.rng.below(300) as u32,
                _ => 0,
            },
            reclaim: wild && w.rng.chance(1, 4),
        };
        let i = w.rng.below(w.bad_locks.len() as u64) as usize;
        let mut c = w.bad_locks[i].clone();
        if w.rng.chance(1, 2) {
            call!(w, "GetLock", c, get_lock, req).ok();
        } else {
            call!(w, "SetLock", c, set_lock, req).ok();
        }
    }

    async fn admin_call(&mut self, wild: bool) {
        let w = self;
        // Plain-node admin calls go through the hostile node; allowed ones (only on the
        // in-process server) through the admin identity.
        let as_admin = w.admin.is_some() && w.rng.chance(1, 2);
        let mut c = if as_admin {
            w.admin.as_ref().map(|a| a.admin.clone())
        } else {
            None
        }
        .unwrap_or_else(|| w.bad[0].admin.clone());
        match w.rng.below(8) {
            0 => {
                call!(w, "GetVolume", c, get_volume, pb::GetVolumeRequest {}).ok();
            }
            1 => {
                call!(
                    w,
                    "ServerStatus",
                    c,
                    server_status,
                    pb::ServerStatusRequest {}
                )
                .ok();
            }
            2 => {
                let inode = w.dir(wild);
                let limits = pb::QuotaLimits {
                    capacity_bytes: w.rng.chance(1, 2).then(|| w.u64_edge()),
                    inodes: w.rng.chance(1, 2).then(|| w.u64_edge()),
                };
                let req = pb::SetQuotaRequest {
                    cred: w.cred(wild, &[inode]),
                    inode,
                    limits: (!wild || w.rng.chance(3, 4)).then_some(limits),
                };
                call!(w, "SetQuota", c, set_quota, req).ok();
            }
            3 => {
                let inode = w.ino(wild);
                let req = pb::GetQuotaRequest {
                    cred: w.cred(wild, &[inode]),
                    inode,
                };
                call!(w, "GetQuota", c, get_quota, req).ok();
            }
            4 => {
                call!(w, "ListQuotas", c, list_quotas, pb::ListQuotasRequest {}).ok();
            }
            5 => {
                // Only the hostile node's own sessions (or garbage) are evicted: an admin may
                // evict the well-behaved node, which is not what this test is about.
                let s = if w.allow_evict_foreign || !as_admin {
                    w.any_session(wild)
                } else {
                    let live: Vec<Sess> = w.sessions.iter().map(|x| x.0).collect();
                    w.rng.pick(&live).unwrap_or(Sess { id: 0, epoch: 0 })
                };
                let s = if w.foreign_sessions.iter().any(|f| f.id == s.id) && as_admin {
                    Sess { id: 0, epoch: 0 }
                } else {
                    s
                };
                let req = pb::EvictSessionRequest {
                    session: if wild && w.rng.chance(1, 3) {
                        w.u64_edge()
                    } else {
                        s.id
                    },
                    reason: if wild { "r".repeat(300) } else { "fuzz".into() },
                };
                call!(w, "EvictSession", c, evict_session, req).ok();
            }
            6 => {
                // Never a path that exists outside the test's own directory: an admin's
                // growth labels the devices it is given.
                let paths = match w.rng.below(5) {
                    0 => vec![],
                    1 => vec!["relative/lun".to_owned()],
                    2 => vec![format!("{}/nul\0x", w.scratch.display())],
                    3 => vec![format!("{}/missing", w.scratch.display()); 65],
                    _ => vec![format!("{}/{}", w.scratch.display(), "p".repeat(5000))],
                };
                let req = pb::GrowVolumeRequest {
                    device_paths: paths,
                    layout: w.enum_value(wild, 3),
                    stripe_unit: w.u64_edge(),
                    force: w.rng.chance(1, 2),
                };
                call!(w, "GrowVolume", c, grow_volume, req).ok();
            }
            _ => {
                let path = match w.rng.below(6) {
                    0 => String::new(),
                    1 => "relative.redb".to_owned(),
                    2 => format!("{}/no/such/dir/b.redb", w.scratch.display()),
                    3 => format!("{}/nul\0b.redb", w.scratch.display()),
                    4 => format!("{}/{}", w.scratch.display(), "q".repeat(5000)),
                    _ => format!("{}/backup.redb", w.scratch.display()),
                };
                let req = pb::BackupStoreRequest {
                    path,
                    force: w.rng.chance(1, 2),
                };
                call!(w, "BackupStore", c, backup_store, req).ok();
            }
        }
    }

    /// A session stream with hostile events: no attach first, another node's session, a
    /// closed one, acknowledgements of grants never recalled, huge renew lists.
    async fn stream_call(&mut self, wild: bool) {
        let w = self;
        let s = if w.rng.chance(1, 4) {
            w.any_session(true)
        } else {
            w.other_session()
        };
        let mut msgs = Vec::new();
        if !wild || w.rng.chance(3, 4) {
            msgs.push(pb::SessionStreamRequest {
                event: Some(pb::session_stream_request::Event::Attach(pb::Attach {
                    session: s.id,
                    epoch: w.epoch(s.epoch, wild),
                })),
            });
        }
        for _ in 0..w.rng.below(5) {
            let event = match w.rng.below(7) {
                0 => pb::session_stream_request::Event::Heartbeat(pb::Heartbeat {
                    seq: w.u64_edge(),
                    renew: w.rng.chance(1, 2).then(|| pb::LeaseRenew {
                        attrs: (0..if w.rng.chance(1, 4) { 70_000 } else { 3 })
                            .map(|_| w.ino(true))
                            .collect(),
                        entries: (0..w.rng.below(4)).map(|_| w.ino(true)).collect(),
                    }),
                }),
                1 => pb::session_stream_request::Event::RecallAck(pb::RecallAck {
                    grant_ids: (0..w.rng.below(4)).map(|_| w.grant(true).id).collect(),
                }),
                2 => pb::session_stream_request::Event::GrantReturn(pb::GrantReturn {
                    grant_ids: (0..w.rng.below(4)).map(|_| w.grant(true).id).collect(),
                }),
                3 => pb::session_stream_request::Event::LeaseRecallAck(pb::LeaseRecallAck {
                    id: w.u64_edge(),
                }),
                4 => pb::session_stream_request::Event::Attach(pb::Attach {
                    session: w.any_session(true).id,
                    epoch: w.u64_edge(),
                }),
                _ => {
                    msgs.push(pb::SessionStreamRequest { event: None });
                    continue;
                }
            };
            msgs.push(pb::SessionStreamRequest { event: Some(event) });
        }
        let shown = format!("stream of {} messages on session {}", msgs.len(), s.id);
        let started = Instant::now();
        let mut sc = w.bad().session.clone();
        let r = bounded("SessionStream", &shown, async move {
            let (tx, rx) = mpsc::channel(16);
            for m in msgs {
                let _ = tx.send(m).await;
            }
            let resp = sc.session_stream(ReceiverStream::new(rx)).await?;
            let mut inbound = resp.into_inner();
            // Read what comes for a moment, then hang up (or close our side first).
            let until = Instant::now() + Duration::from_millis(50);
            loop {
                match tokio::time::timeout_at(until.into(), inbound.message()).await {
                    Ok(Ok(Some(_))) => continue,
                    Ok(Ok(None)) | Err(_) => return Ok(()),
                    Ok(Err(e)) => return Err(e),
                }
            }
        })
        .await;
        w.timed("SessionStream", started.elapsed(), &r, &shown);
        w.note("SessionStream", &r, &shown);
    }
}

// ------------------------------------------------------------------------------------------
// Races: several calls at once on the same grant, handle, names or session

type Pending = tokio::task::JoinHandle<(&'static str, String, Result<(), Status>)>;

/// Starts `fut` as its own task; its result is noted when the burst ends.
fn race<T: Send + 'static>(
    rpc: &'static str,
    shown: String,
    fut: impl Future<Output = Result<tonic::Response<T>, Status>> + Send + 'static,
) -> Pending {
    tokio::spawn(async move {
        match tokio::time::timeout(CALL_LIMIT, fut).await {
            Ok(r) => (rpc, shown, r.map(|_| ())),
            Err(_) => {
                let mut shown = shown;
                shown.truncate(800);
                panic!("hang: {rpc} of a burst not answered within {CALL_LIMIT:?}: {shown}")
            }
        }
    })
}

impl World {
    fn complete_req(&mut self, g: GrantRec, keep: bool) -> pb::CompleteRequest {
        pb::CompleteRequest {
            session: g.session,
            epoch: g.epoch,
            grant_id: g.id,
            status: pb::IoStatus::Ok as i32,
            errors: vec![],
            bytes_done: if keep {
                self.block_size.min(g.length)
            } else {
                g.length
            },
            sync: self.rng.chance(1, 2),
            keep,
            offset: if keep { g.offset } else { 0 },
            more: vec![],
        }
    }

    async fn burst(&mut self) {
        let started = Instant::now();
        let w = self;
        let mut pending: Vec<Pending> = Vec::new();
        let i = w.rng.below(w.bad.len() as u64) as usize;
        let (data, ns, session) = (
            w.bad[i].data.clone(),
            w.bad[i].ns.clone(),
            w.bad[i].session.clone(),
        );
        let root = crate::harness::root;
        match w.rng.below(4) {
            0 => {
                // One grant completed, completed in part, returned and closed over at once.
                let g = w.grant(false);
                for keep in [false, true, false] {
                    let req = w.complete_req(g, keep);
                    let mut c = data.clone();
                    pending.push(race("Complete", format!("{req:?}"), async move {
                        c.complete(req).await
                    }));
                }
                let req = pb::ReturnGrantRequest {
                    session: g.session,
                    epoch: g.epoch,
                    grant_ids: vec![g.id],
                };
                let mut c = data.clone();
                pending.push(race("ReturnGrant", format!("{req:?}"), async move {
                    c.return_grant(req).await
                }));
                w.grants.retain(|x| x.id != g.id);
                w.old_grants.push(g);
            }
            1 => {
                // One handle written, truncated, punched, mapped and released at once.
                let h = w.handle(false);
                let cred = if w.protected.contains(&h.ino) {
                    w.cred(false, &[h.ino])
                } else {
                    root()
                };
                let write = pb::WriteRequest {
                    cred: cred.clone(),
                    session: h.session,
                    handle: h.handle,
                    inode: h.ino,
                    offset: w.off(false),
                    data: w.payload(false),
                    sync: false,
                    append: false,
                    request_id: None,
                    then_set_attr: None,
                };
                let mut c = data.clone();
                pending.push(race("Write", format!("write on {h:?}"), async move {
                    c.write(write).await
                }));
                let trunc = pb::SetAttrRequest {
                    cred: cred.clone(),
                    inode: h.ino,
                    changes: Some(pb::SetAttrChanges {
                        size: Some(w.rng.below(100_000)),
                        ..Default::default()
                    }),
                    handle: Some(h.handle),
                    session: Some(h.session),
                };
                let mut c = ns.clone();
                pending.push(race("SetAttr", format!("{trunc:?}"), async move {
                    c.set_attr(trunc).await
                }));
                let punch = pb::FallocateRequest {
                    cred: cred.clone(),
                    session: h.session,
                    handle: h.handle,
                    inode: h.ino,
                    offset: 0,
                    length: 8 * w.block_size,
                    mode: w.enum_value(false, 5),
                };
                let mut c = data.clone();
                pending.push(race("Fallocate", format!("{punch:?}"), async move {
                    c.fallocate(punch).await
                }));
                let epoch = w.epoch;
                let map = pb::MapRequest {
                    cred,
                    session: h.session,
                    epoch,
                    handle: h.handle,
                    inode: h.ino,
                    offset: 0,
                    length: 16 * w.block_size,
                    sync: false,
                    layout: w.rng.chance(1, 2),
                    ahead: false,
                };
                let mut c = data.clone();
                pending.push(race("MapWrite", format!("{map:?}"), async move {
                    c.map_write(map).await
                }));
                let rel = pb::ReleaseRequest {
                    session: h.session,
                    handle: h.handle,
                };
                let mut c = ns.clone();
                pending.push(race("Release", format!("{rel:?}"), async move {
                    c.release(rel).await
                }));
                w.handles.retain(|x| x.handle != h.handle);
                w.old_handles.push(h);
            }
            2 => {
                // Two directories moved into each other at once (a cycle if the check and
                // the change are not one step), and one name made twice under one request id.
                let parent = w.dir(false);
                let a = format!("ra{}", w.rng.next()).into_bytes();
                let b = format!("rb{}", w.rng.next()).into_bytes();
                let cred = if w.protected.contains(&parent) {
                    w.cred(false, &[parent])
                } else {
                    root()
                };
                let mut made = Vec::new();
                for name in [&a, &b] {
                    let r = w.bad[i]
                        .ns
                        .mkdir(pb::MkdirRequest {
                            cred: cred.clone(),
                            parent,
                            name: name.clone(),
                            perm: 0o777,
                            delegate: false,
                            request_id: None,
                        })
                        .await;
                    if let Ok(r) = r
                        && let Some(at) = r.into_inner().attr
                    {
                        made.push(at.ino);
                        w.learn(at);
                    }
                }
                if let [da, db] = made[..] {
                    for (from, to, name) in [(parent, db, &a), (parent, da, &b)] {
                        let req = pb::RenameRequest {
                            cred: cred.clone(),
                            old_parent: from,
                            old_name: name.clone(),
                            new_parent: to,
                            new_name: b"in".to_vec(),
                            mode: pb::RenameMode::Replace as i32,
                            request_id: None,
                        };
                        let mut c = ns.clone();
                        pending.push(race("Rename", format!("{req:?}"), async move {
                            c.rename(req).await
                        }));
                    }
                }
                let rid = Some(pb::RequestId {
                    client: 0xbad,
                    seq: 1_000_000 + w.rng.below(1000),
                    lowest_pending: 1,
                });
                for kind in [0, 1, 0] {
                    let name = b"twice".to_vec();
                    let mut c = ns.clone();
                    let cred = cred.clone();
                    if kind == 0 {
                        let req = pb::MkdirRequest {
                            cred,
                            parent,
                            name,
                            perm: 0o755,
                            delegate: false,
                            request_id: rid,
                        };
                        pending.push(race("Mkdir", format!("{req:?}"), async move {
                            c.mkdir(req).await
                        }));
                    } else {
                        let req = pb::UnlinkRequest {
                            cred,
                            parent,
                            name,
                            request_id: rid,
                        };
                        pending.push(race("Unlink", format!("{req:?}"), async move {
                            c.unlink(req).await
                        }));
                    }
                }
            }
            _ => {
                // A session closed while it opens, maps and attaches.
                let (s, _) = match w.sessions.first() {
                    Some(x) => (x.0, ()),
                    None => return,
                };
                let inode = w.file(false);
                let cred = w.cred(false, &[inode]);
                let open = pb::OpenRequest {
                    cred,
                    session: s.id,
                    inode,
                    flags: crate::harness::rw(),
                    read_small: 1 << 20,
                };
                let mut c = ns.clone();
                pending.push(race("Open", format!("{open:?}"), async move {
                    c.open(open).await
                }));
                let h = w.handle(false);
                let map = pb::MapRequest {
                    cred: root(),
                    session: s.id,
                    epoch: s.epoch,
                    handle: h.handle,
                    inode: h.ino,
                    offset: 0,
                    length: 4 * w.block_size,
                    sync: false,
                    layout: true,
                    ahead: false,
                };
                let mut c = data.clone();
                pending.push(race("MapWrite", format!("{map:?}"), async move {
                    c.map_write(map).await
                }));
                let close = pb::CloseSessionRequest {
                    session: s.id,
                    epoch: s.epoch,
                };
                let mut c = session.clone();
                pending.push(race("CloseSession", format!("{close:?}"), async move {
                    c.close_session(close).await
                }));
                let mut c = session.clone();
                pending.push(race("SessionStream", format!("attach {s:?}"), async move {
                    let (tx, rx) = mpsc::channel(4);
                    let _ = tx.send(attach_msg(s)).await;
                    drop(tx);
                    c.session_stream(ReceiverStream::new(rx)).await
                }));
            }
        }
        for p in pending {
            let (rpc, shown, r) = p.await.expect("a call of a burst answered in time");
            w.note(rpc, &r, &shown);
        }
        w.timed("burst", started.elapsed(), &Ok::<(), Status>(()), "a burst");
    }
}

// ------------------------------------------------------------------------------------------
// Damaged messages: bytes that are not the request the method takes

/// Every unary method of the five services.
const METHODS: [&str; 45] = [
    "/sanfs.v1.Session/OpenSession",
    "/sanfs.v1.Session/CloseSession",
    "/sanfs.v1.Namespace/Lookup",
    "/sanfs.v1.Namespace/GetAttr",
    "/sanfs.v1.Namespace/SetAttr",
    "/sanfs.v1.Namespace/Create",
    "/sanfs.v1.Namespace/Mkdir",
    "/sanfs.v1.Namespace/Mknod",
    "/sanfs.v1.Namespace/Unlink",
    "/sanfs.v1.Namespace/Rmdir",
    "/sanfs.v1.Namespace/Rename",
    "/sanfs.v1.Namespace/Link",
    "/sanfs.v1.Namespace/Symlink",
    "/sanfs.v1.Namespace/Readlink",
    "/sanfs.v1.Namespace/ReadDir",
    "/sanfs.v1.Namespace/StatFs",
    "/sanfs.v1.Namespace/GetXattr",
    "/sanfs.v1.Namespace/SetXattr",
    "/sanfs.v1.Namespace/ListXattr",
    "/sanfs.v1.Namespace/RemoveXattr",
    "/sanfs.v1.Namespace/Open",
    "/sanfs.v1.Namespace/Release",
    "/sanfs.v1.Namespace/Access",
    "/sanfs.v1.Data/MapRead",
    "/sanfs.v1.Data/MapWrite",
    "/sanfs.v1.Data/Complete",
    "/sanfs.v1.Data/ReturnGrant",
    "/sanfs.v1.Data/Read",
    "/sanfs.v1.Data/Write",
    "/sanfs.v1.Data/Fsync",
    "/sanfs.v1.Data/Fallocate",
    "/sanfs.v1.Data/GetExtents",
    "/sanfs.v1.Data/ReplayWrites",
    "/sanfs.v1.Data/Delegate",
    "/sanfs.v1.Admin/GetVolume",
    "/sanfs.v1.Admin/ServerStatus",
    "/sanfs.v1.Admin/SetQuota",
    "/sanfs.v1.Admin/GetQuota",
    "/sanfs.v1.Admin/ListQuotas",
    "/sanfs.v1.Admin/EvictSession",
    "/sanfs.v1.Admin/GrowVolume",
    "/sanfs.v1.Admin/BackupStore",
    "/sanfs.v1.Locks/GetLock",
    "/sanfs.v1.Locks/SetLock",
    "/sanfs.v1.Namespace/NoSuchMethod",
];

/// A codec that sends bytes as they are and takes the reply's bytes as they are.
#[derive(Clone, Copy, Default)]
struct RawCodec;

impl tonic::codec::Codec for RawCodec {
    type Encode = Vec<u8>;
    type Decode = Vec<u8>;
    type Encoder = RawCodec;
    type Decoder = RawCodec;
    fn encoder(&mut self) -> RawCodec {
        RawCodec
    }
    fn decoder(&mut self) -> RawCodec {
        RawCodec
    }
}

impl tonic::codec::Encoder for RawCodec {
    type Item = Vec<u8>;
    type Error = Status;
    fn encode(
        &mut self,
        item: Vec<u8>,
        dst: &mut tonic::codec::EncodeBuf<'_>,
    ) -> Result<(), Status> {
        use prost::bytes::BufMut;
        dst.put_slice(&item);
        Ok(())
    }
}

impl tonic::codec::Decoder for RawCodec {
    type Item = Vec<u8>;
    type Error = Status;
    fn decode(&mut self, src: &mut tonic::codec::DecodeBuf<'_>) -> Result<Option<Vec<u8>>, Status> {
        use prost::bytes::Buf;
        let n = src.remaining();
        Ok(Some(src.copy_to_bytes(n).to_vec()))
    }
}

impl World {
    /// A message of real values, encoded, for another method, cut short, or with flipped
    /// bits; or bytes that no message is; or nothing (every field at its default).
    fn raw_bytes(&mut self) -> Vec<u8> {
        use prost::Message;
        let h = self.handle(false);
        let g = self.grant(false);
        let real = match self.rng.below(6) {
            0 => pb::LookupRequest {
                cred: self.cred(false, &[]),
                parent: self.dir(false),
                name: self.name(false),
                session: Some(h.session),
            }
            .encode_to_vec(),
            1 => pb::MapRequest {
                cred: self.cred(false, &[]),
                session: h.session,
                epoch: self.epoch,
                handle: h.handle,
                inode: h.ino,
                offset: 0,
                length: 4096,
                sync: false,
                layout: true,
                ahead: false,
            }
            .encode_to_vec(),
            2 => pb::CompleteRequest {
                session: g.session,
                epoch: g.epoch,
                grant_id: g.id,
                status: 1,
                errors: vec![],
                bytes_done: g.length,
                sync: false,
                keep: true,
                offset: g.offset,
                more: vec![pb::CompletedPart {
                    offset: g.offset,
                    length: g.length,
                }],
            }
            .encode_to_vec(),
            3 => pb::WriteRequest {
                cred: self.cred(false, &[h.ino]),
                session: h.session,
                handle: h.handle,
                inode: h.ino,
                offset: 0,
                data: self.rng.bytes(100),
                sync: false,
                append: false,
                request_id: None,
                then_set_attr: None,
            }
            .encode_to_vec(),
            4 => pb::LockRequest {
                cred: self.cred(false, &[]),
                session: h.session,
                handle: h.handle,
                inode: h.ino,
                owner: 1,
                lock: Some(pb::FileLock {
                    r#type: 2,
                    start: 0,
                    end: u64::MAX,
                    pid: 1,
                }),
                wait_ms: 0,
                reclaim: false,
            }
            .encode_to_vec(),
            _ => pb::SetAttrRequest {
                cred: self.cred(false, &[]),
                inode: h.ino,
                changes: Some(pb::SetAttrChanges {
                    size: Some(0),
                    ..Default::default()
                }),
                handle: Some(h.handle),
                session: Some(h.session),
            }
            .encode_to_vec(),
        };
        match self.rng.below(8) {
            0 => Vec::new(),
            1 => real,
            2 => {
                let n = self.rng.below(real.len() as u64) as usize;
                real[..n].to_vec()
            }
            3 => {
                let mut b = real;
                for _ in 0..1 + self.rng.below(4) {
                    if !b.is_empty() {
                        let i = self.rng.below(b.len() as u64) as usize;
                        b[i] ^= 1 << self.rng.below(8);
                    }
                }
                b
            }
            4 => {
                let n = self.rng.below(200) as usize;
                self.rng.bytes(n)
            }
            5 => vec![
                0x08, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01,
            ],
            6 => vec![0x0a, 0xff, 0xff, 0xff, 0xff, 0x0f, 0x00],
            _ => {
                // Unknown fields, repeated fields and a group wire type after a real message.
                let mut b = real;
                b.extend_from_slice(&[0xf8, 0xff, 0x03, 0x01, 0x0b, 0x0c, 0x12, 0x00]);
                b
            }
        }
    }

    /// A TCP connection that sends bytes no client sends: garbage, an HTTP/2 preface followed
    /// by damaged frames, or a request cut off mid-frame; then hangs up.
    async fn raw_socket(&mut self) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
        let mut bytes = Vec::new();
        match self.rng.below(4) {
            0 => {
                let n = self.rng.below(4096) as usize;
                bytes = self.rng.bytes(n);
            }
            1 => {
                bytes.extend_from_slice(PREFACE);
                // An empty SETTINGS frame, then random frames (9-byte headers with random
                // lengths, types, flags and stream ids).
                bytes.extend_from_slice(&[0, 0, 0, 4, 0, 0, 0, 0, 0]);
                for _ in 0..self.rng.below(6) {
                    let len = self.rng.below(64) as usize;
                    let header = self.rng.bytes(9);
                    bytes.extend_from_slice(&[0, 0, len as u8]);
                    bytes.extend_from_slice(&header[3..]);
                    let body = self.rng.bytes(len);
                    bytes.extend_from_slice(&body);
                }
            }
            2 => {
                bytes.extend_from_slice(PREFACE);
                bytes.extend_from_slice(&[0, 0, 0, 4, 0, 0, 0, 0, 0]);
                // A HEADERS frame that says 16 MiB and stops.
                bytes.extend_from_slice(&[0xff, 0xff, 0xff, 1, 4, 0, 0, 0, 1, 0x82]);
            }
            _ => {
                bytes.extend_from_slice(b"POST /sanfs.v1.Namespace/Lookup HTTP/1.1\r\n");
                bytes.extend_from_slice(b"content-type: application/grpc\r\n");
                bytes.extend_from_slice(b"content-length: 99999999999999999999\r\n\r\n");
            }
        }
        let shown = format!(
            "{} raw bytes {:02x?}",
            bytes.len(),
            &bytes[..bytes.len().min(48)]
        );
        let addr = self.addr;
        let started = Instant::now();
        bounded("socket", &shown, async move {
            let Ok(mut sock) = tokio::net::TcpStream::connect(addr).await else {
                panic!("the server's port refuses connections");
            };
            let _ = sock.write_all(&bytes).await;
            let mut buf = [0u8; 4096];
            // Whatever the server says (or nothing) for a moment, then hang up.
            let _ = tokio::time::timeout(Duration::from_millis(20), sock.read(&mut buf)).await;
        })
        .await;
        self.timed("socket", started.elapsed(), &Ok::<(), Status>(()), &shown);
    }

    async fn raw_call(&mut self) {
        let method = METHODS[self.rng.below(METHODS.len() as u64) as usize];
        let bytes = self.raw_bytes();
        let shown = format!(
            "{method} with {} bytes {:02x?}",
            bytes.len(),
            &bytes[..bytes.len().min(64)]
        );
        let ch = self.bad_channels[0].clone();
        let started = Instant::now();
        let r = bounded("raw", &shown, async move {
            let mut grpc = tonic::client::Grpc::new(ch);
            grpc.ready()
                .await
                .map_err(|e| Status::unavailable(format!("not ready: {e}")))?;
            let path = tonic::codegen::http::uri::PathAndQuery::from_static(method);
            grpc.unary(Request::new(bytes), path, RawCodec).await
        })
        .await;
        // tonic answers a message that does not decode with INTERNAL (gRPC's rule): that is
        // a clear refusal of this request, not a fault.
        let decode_error = matches!(&r, Err(s) if s.code() == Code::Internal
            && s.message().contains("decode"));
        let tally = if decode_error { Ok(()) } else { r.map(|_| ()) };
        self.timed("raw", started.elapsed(), &tally, &shown);
        self.note("raw", &tally, &shown);
    }
}

// ------------------------------------------------------------------------------------------
// Runs

fn seed() -> u64 {
    match std::env::var("SANFS_FUZZ_SEED") {
        Ok(s) => s.parse().expect("SANFS_FUZZ_SEED is a u64"),
        Err(_) => {
            let t = std::time::SystemTime::UNIX_EPOCH
                .elapsed()
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(1);
            t ^ u64::from(std::process::id()) << 32
        }
    }
}

fn calls() -> u64 {
    std::env::var("SANFS_FUZZ_CALLS")
        .ok()
        .map(|s| s.parse().expect("SANFS_FUZZ_CALLS is a number"))
        .unwrap_or(1000)
}

/// The fuzz loop over `world`; returns the findings.
async fn run(world: &mut World, n: u64, seed: u64, panics: &dyn Fn() -> Vec<String>) {
    let started = Instant::now();
    for i in 0..n {
        if i % 16 == 0 {
            world.top_up_sessions().await;
        }
        let before = world.findings.len();
        world.one_call().await;
        let failed = world.findings.len() > before;
        if (failed || i % 64 == 0)
            && let Err(e) = probe(&mut world.good).await
        {
            panic!(
                "seed {seed}, call {i}: the server stopped serving: {e}\nfindings:\n{}",
                world.findings.join("\n")
            );
        }
        let p = panics();
        assert!(
            p.is_empty(),
            "seed {seed}, call {i}: the server panicked:\n{}\nfindings:\n{}",
            p.join("\n"),
            world.findings.join("\n")
        );
    }
    let mut lines = String::new();
    for ((rpc, code), count) in &world.tally {
        lines.push_str(&format!("  {rpc:>13} {:?}: {count}\n", Code::from(*code)));
    }
    let mut by_rpc: Vec<(Duration, &str)> =
        world.time_by_rpc.iter().map(|(r, t)| (*t, *r)).collect();
    by_rpc.sort_by(|a, b| b.cmp(a));
    let spent: Vec<String> = by_rpc
        .iter()
        .take(6)
        .map(|(t, r)| format!("{r} {t:.1?}"))
        .collect();
    lines.push_str(&format!("  most time: {}\n", spent.join(", ")));
    for (took, what) in &world.slowest {
        lines.push_str(&format!("  slow: {took:.1?} {what}\n"));
    }
    eprintln!(
        "fuzz_calls: seed {seed}: {n} calls in {:.1?}, replies:\n{lines}",
        started.elapsed()
    );
    assert!(
        world.findings.is_empty(),
        "seed {seed}: replies that only a broken connection or a server fault gives:\n{}",
        world.findings.join("\n")
    );
}

/// A client presenting a certificate for `name` signed by `ca`.
async fn tls_clients(addr: SocketAddr, ca: &Ca, name: &str) -> Clients {
    Clients::new(tls_channel(addr, ca, name).await)
}

async fn tls_channel(addr: SocketAddr, ca: &Ca, name: &str) -> Channel {
    let (cert, key) = leaf(ca, &[name], true);
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(&ca.pem))
        .domain_name("localhost")
        .identity(Identity::from_pem(cert, key));
    Channel::from_shared(format!("https://127.0.0.1:{}", addr.port()))
        .unwrap()
        .tls_config(tls)
        .unwrap()
        .connect()
        .await
        .unwrap()
}

fn new_world(seed: u64, addr: SocketAddr, good: Clients, bad_channels: Vec<Channel>) -> World {
    World {
        rng: Rng(seed),
        bad: bad_channels.iter().cloned().map(Clients::new).collect(),
        bad_locks: bad_channels.iter().cloned().map(LocksClient::new).collect(),
        bad_channels,
        addr,
        admin: None,
        good,
        sessions: Vec::new(),
        dead_sessions: Vec::new(),
        foreign_sessions: Vec::new(),
        epoch: 1,
        files: Vec::new(),
        dirs: vec![ROOT],
        others: Vec::new(),
        protected: Vec::new(),
        names: Vec::new(),
        entries: Vec::new(),
        handles: Vec::new(),
        old_handles: Vec::new(),
        reserved: Vec::new(),
        grants: Vec::new(),
        old_grants: Vec::new(),
        request_ids: Vec::new(),
        next_name: 0,
        block_size: 4096,
        scratch: PathBuf::new(),
        allow_evict_foreign: false,
        tally: BTreeMap::new(),
        slowest: Vec::new(),
        time_by_rpc: BTreeMap::new(),
        findings: Vec::new(),
    }
}

/// The namespace made by the well-behaved node, its session, and its files' expected bytes.
async fn prepare(world: &mut World, rng_seed: u64) -> Vec<Kept> {
    let s = open_session(&mut world.good, "good").await.unwrap();
    let _alive = keep_alive(&world.good, s);
    world.epoch = s.epoch;
    world.foreign_sessions.push(s);
    let mut rng = Rng(rng_seed ^ 0x5eed);
    let made = set_up(&mut world.good, s, &mut rng).await;
    world.files = made.files;
    world.dirs = made.dirs;
    world.others = made.others;
    world.protected = made.protected;
    let kept = made.kept;
    world.names = [
        "f0", "f1", "f3", "f4", "f5", "sub", "keep", "play", "ln", "fifo",
    ]
    .iter()
    .map(|n| n.as_bytes().to_vec())
    .collect();
    let (play, sub) = (world.dirs[1], world.dirs[2]);
    let keep = world.protected[world.protected.len() - 1];
    for (parent, name) in [
        (ROOT, "keep"),
        (ROOT, "play"),
        (keep, "f0"),
        (keep, "f1"),
        (keep, "f2"),
        (play, "f3"),
        (play, "f4"),
        (play, "sub"),
        (play, "ln"),
        (play, "fifo"),
        (sub, "f5"),
    ] {
        world.saw_entry(parent, name.as_bytes());
    }
    world.top_up_sessions().await;
    kept
}

#[test]
fn hostile_calls_in_process() {
    watch_panics();
    let seed = seed();
    let n = calls();
    eprintln!("fuzz_calls (in process): SANFS_FUZZ_SEED={seed} SANFS_FUZZ_CALLS={n}");
    let server_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name(SERVER_THREADS)
        .enable_all()
        .build()
        .unwrap();
    let our_ca = ca("sanfs fuzz CA");
    let tls_dir = tempfile::tempdir().unwrap();
    let paths = write_server_tls(tls_dir.path(), &our_ca);
    let srv = server_rt.block_on(crate::harness::start_with_luns_and(
        LEASE_TTL_MS,
        move |o| {
            o.insecure = false;
            o.tls = Some(paths);
            o.access = AccessConfig {
                clients: vec![(
                    "admin-node".to_owned(),
                    ClientPolicy {
                        admin: true,
                        ..ClientPolicy::NODE
                    },
                )],
                ..AccessConfig::default()
            };
        },
    ));
    let addr = srv.addr;
    let scratch = tempfile::tempdir().unwrap();
    let client_rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let kept = client_rt.block_on(async {
        let good = tls_clients(addr, &our_ca, "good-node").await;
        let mut bad = Vec::new();
        for _ in 0..2 {
            bad.push(tls_channel(addr, &our_ca, "bad-node").await);
        }
        let mut world = new_world(seed, addr, good, bad);
        world.admin = Some(tls_clients(addr, &our_ca, "admin-node").await);
        world.scratch = scratch.path().to_owned();
        let kept = prepare(&mut world, seed).await;
        run(&mut world, n, seed, &server_panics).await;
        check_kept(&mut world.good, &kept).await;
        for (_, t) in world.sessions.drain(..) {
            t.abort();
        }
        kept.len()
    });
    drop(client_rt);
    let dir = server_rt.block_on(srv.stop_keeping_files());
    let report = sanfs_mds::fsck::check(&Backend::File(dir.path().join("mds.redb"))).unwrap();
    assert!(
        report.is_clean(),
        "seed {seed}: fsck after the run:\n{report}"
    );
    assert!(server_panics().is_empty(), "{:?}", server_panics());
    eprintln!("fuzz_calls (in process): seed {seed}: fsck clean, {kept} kept files intact");
}

/// The real binary: plaintext, so every caller is one identity (and an admin); fewer calls.
#[test]
fn hostile_calls_on_the_real_binary() {
    let given = seed();
    let seed = given ^ 0xb1;
    let n = (calls() / 4).max(50);
    eprintln!("fuzz_calls (real binary): SANFS_FUZZ_SEED={given} SANFS_FUZZ_CALLS={n}");
    let dir = tempfile::tempdir().unwrap();
    let port = crate::crash_real::free_port();
    let config = real_setup(dir.path(), port);
    let log = dir.path().join("mds.log");
    let mut server = crate::crash_real::Server::start(&config, &log);
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let no_panics = |log: &Path| -> Vec<String> {
        std::fs::read_to_string(log)
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains("panicked"))
            .map(str::to_owned)
            .collect()
    };
    rt.block_on(async {
        let ch = crate::crash_real::connect(addr, &mut server).await;
        let good = Clients::new(ch);
        let mut bad = Vec::new();
        for _ in 0..2 {
            bad.push(crate::crash_real::connect(addr, &mut server).await);
        }
        let mut world = new_world(seed, addr, good, bad);
        world.scratch = dir.path().join("scratch");
        std::fs::create_dir(&world.scratch).unwrap();
        let kept = prepare(&mut world, seed).await;
        let log2 = log.clone();
        run(&mut world, n / 2, given, &|| no_panics(&log2)).await;
        // kill -9 and a restart in the middle: the second half meets a server in its reclaim
        // window, with every session, handle and grant of the first half stale.
        assert_eq!(
            server.exited_within(Duration::ZERO),
            None,
            "the server still runs"
        );
        server.kill();
        server = crate::crash_real::Server::start(&config, &log);
        let good = Clients::new(crate::crash_real::connect(addr, &mut server).await);
        let mut bad = Vec::new();
        for _ in 0..2 {
            bad.push(crate::crash_real::connect(addr, &mut server).await);
        }
        world.reconnect(good, bad);
        run(&mut world, n - n / 2, given, &|| no_panics(&log2)).await;
        check_kept(&mut world.good, &kept).await;
        for (_, t) in world.sessions.drain(..) {
            t.abort();
        }
    });
    drop(rt);
    assert_eq!(
        server.exited_within(Duration::ZERO),
        None,
        "the server process is still running"
    );
    let panics = no_panics(&log);
    assert!(
        panics.is_empty(),
        "seed {seed}: the server's log: {panics:?}"
    );
    server.kill();
    let (code, out) = crate::crash_real::fsck(&config);
    assert_eq!(code, 0, "seed {seed}: fsck after the run:\n{out}");
}

/// Like `crash_real::setup`, with short leases so that silent holders lose grants quickly.
fn real_setup(dir: &Path, port: u16) -> PathBuf {
    let luns: Vec<PathBuf> = (0..4).map(|i| dir.join(format!("lun{i}"))).collect();
    for l in &luns {
        std::fs::File::create(l).unwrap().set_len(32 << 20).unwrap();
    }
    let devices: Vec<String> = luns
        .iter()
        .map(|l| format!("{:?}", l.display().to_string()))
        .collect();
    let config = dir.join("mds.toml");
    std::fs::write(
        &config,
        format!(
            "[server]\nlisten = \"127.0.0.1:{port}\"\ninsecure = true\nlease_ttl_ms = {LEASE_TTL_MS}\n\
             [metadata]\npath = {:?}\n\
             [volume]\nlayout = \"striped\"\nstripe_unit = \"64KiB\"\ndevices = [{}]\n",
            dir.join("meta.redb").display().to_string(),
            devices.join(", ")
        ),
    )
    .unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_sanfs-mds"))
        .args(["format", "--config", config.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(out.status.success(), "format: {out:?}");
    config
}
