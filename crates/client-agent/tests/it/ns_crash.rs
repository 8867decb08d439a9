//! Issue 19, the crash acceptance of namespace changes answered before they are durable
//! (docs/posix.md, "Durability of namespace changes"), with real processes: one `sanfs-mds
//! serve` and two `sanfs-agent mount`s of it (two sessions), the helpers of `replay`.
//!
//! - [`namespace_workload_on_two_mounts_survives_server_kills`]: on each mount several worker
//!   threads run a seeded random create / write / rename / unlink / mkdir / rmdir / link /
//!   symlink / chmod workload, each in a directory of its own and in a shared one where they
//!   cross (names moved and linked in and out of it). Every operation the workload was answered
//!   is applied to the worker's model. The server is killed with SIGKILL
//!   `SANFS_NS_KILL_ROUNDS` times (default 3; the acceptance run is 50) at a random moment
//!   under the workload and started again; the workload goes on and must see no error (a
//!   restart is a pause). After every round the tree seen through both mounts must be the
//!   model exactly (names, kinds, modes, link counts, inode numbers, sizes and contents,
//!   symlink targets), and every name a worker saw through the *other* mount right after its
//!   own change (present, with its inode number, or gone) must still be so unless the workload
//!   changed it since. At the end the server is stopped with SIGTERM and `sanfs-mds fsck` must
//!   call its store clean.
//! - [`an_agent_killed_with_unsynced_changes_loses_only_those`]: an agent killed with `kill -9`
//!   while the server lives loses nothing it had sent (the server applied its changes; what
//!   it held back, at most its `writeback_age` old, it loses); an agent killed
//!   within the lazy second together with the server loses at most its changes after its last
//!   fsync, as a suffix of them (what is left is the model after some prefix of its
//!   operations), while the other mount's changes are all there, and fsck is clean.
//!
//! The seed is printed; `SANFS_SEED=S` replays one. The mounts use `attr_ttl=0,entry_ttl=0`:
//! what one mount looks at right after the other changed it must come from the server, not
//! from the kernel's TTL caches (whose staleness is documented, not what this is about).
//! Needs root and /dev/fuse (skipped otherwise).

use std::collections::{BTreeMap, HashMap};
use std::io::ErrorKind;
use std::os::unix::fs::{DirBuilderExt, FileExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::mount::{can_mount, timed};
use crate::replay::{Agent, Mds, close, start_mds};
use crate::san::{self, Rng};

const WORKERS_PER_MOUNT: usize = 3;
const MOUNT_OPTS: &str = "attr_ttl=0,entry_ttl=0";
/// The mount that is killed: what it holds back (bytes, and attribute changes of files it
/// made: a `chmod` right after a close, before the delegation goes) is sent within 1 s.
const DOOMED_OPTS: &str = "attr_ttl=0,entry_ttl=0,writeback_age=1s";
/// How long the doomed mount's held-back changes may wait (its `writeback_age`, and the
/// age flusher's round).
const HELD_BACK_AT_MOST: Duration = Duration::from_millis(2500);
/// The test's directory under each mount's root.
const ROOT: &str = "work";
/// How many files (and symlinks) a worker keeps at most; past it a create becomes an unlink.
const MAX_FILES: usize = 40;
/// The server's lease TTL in `replay::start_mds`.
const TTL_MS: u64 = 2000;

/// One name as a walk of a mount sees it (or as the model expects it).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Seen {
    kind: char,
    /// Permission bits (symlinks: 0, their mode means nothing).
    mode: u32,
    nlink: u64,
    ino: u64,
    /// Files: size in bytes; others 0.
    size: u64,
    /// Files: FNV-1a of the contents; symlinks: of the target; directories 0.
    digest: u64,
}

/// Looks through the other mount that the kernel answered ESTALE first (reported).
static ESTALE_RETRIES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// `lstat` of a name through a mount, again while the kernel answers ESTALE (a bounded
/// number of times). The kernel answers ESTALE when a lookup finds a directory that another
/// node moved while its old entry is still cached here and a rename of this mount holds the
/// locks needed to move that entry (its own retry comes too soon when that rename waits for
/// a restarted server); docs/posix.md, "Directories moved by another node".
fn lstat_past_estale(p: &Path) -> std::io::Result<std::fs::Metadata> {
    let mut tries = 0;
    loop {
        match std::fs::symlink_metadata(p) {
            Err(e) if e.raw_os_error() == Some(libc::ESTALE) && tries < 100 => {
                tries += 1;
                ESTALE_RETRIES.fetch_add(1, Ordering::Relaxed);
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            r => return r,
        }
    }
}

fn digest(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3)
    })
}

/// Every name under `root` (paths relative to it).
fn walk(root: &Path) -> std::io::Result<BTreeMap<String, Seen>> {
    let mut out = BTreeMap::new();
    let mut dirs = vec![root.to_path_buf()];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d)? {
            let p = e?.path();
            let m = std::fs::symlink_metadata(&p)?;
            let rel = p.strip_prefix(root).unwrap().display().to_string();
            let ft = m.file_type();
            let (kind, mode, size, dig) = if ft.is_symlink() {
                let t = std::fs::read_link(&p)?;
                ('l', 0, 0, digest(t.as_os_str().as_encoded_bytes()))
            } else if ft.is_dir() {
                dirs.push(p.clone());
                ('d', m.mode() & 0o7777, 0, 0)
            } else {
                let data = std::fs::read(&p)?;
                ('f', m.mode() & 0o7777, data.len() as u64, digest(&data))
            };
            out.insert(
                rel,
                Seen {
                    kind,
                    mode,
                    nlink: m.nlink(),
                    ino: m.ino(),
                    size,
                    digest: dig,
                },
            );
        }
    }
    Ok(out)
}

/// One inode of a worker's model.
#[derive(Debug, Clone)]
struct Node {
    kind: char,
    mode: u32,
    data: Vec<u8>,
    target: String,
    ino: u64,
}

/// What one worker's names should be: name -> node, nodes by id.
#[derive(Debug, Clone, Default)]
struct Model {
    names: BTreeMap<String, u64>,
    nodes: HashMap<u64, Node>,
    next_node: u64,
}

impl Model {
    fn add(&mut self, name: String, node: Node) -> u64 {
        let id = self.next_node;
        self.next_node += 1;
        self.nodes.insert(id, node);
        self.names.insert(name, id);
        id
    }

    /// Removes a name; its node goes with its last name.
    fn remove(&mut self, name: &str) {
        if let Some(id) = self.names.remove(name)
            && !self.names.values().any(|v| *v == id)
        {
            self.nodes.remove(&id);
        }
    }

    fn kind_of(&self, name: &str) -> char {
        self.nodes[&self.names[name]].kind
    }

    fn of_kind(&self, kinds: &[char]) -> Vec<String> {
        self.names
            .iter()
            .filter(|(_, id)| kinds.contains(&self.nodes[id].kind))
            .map(|(n, _)| n.clone())
            .collect()
    }

    fn children(&self, dir: &str) -> Vec<&String> {
        let prefix = format!("{dir}/");
        self.names
            .keys()
            .filter(|n| n.strip_prefix(&prefix).is_some_and(|r| !r.contains('/')))
            .collect()
    }

    /// Adds this model's names to `out` (directories' link counts are fixed by [`expected`]).
    fn expect_into(&self, out: &mut BTreeMap<String, Seen>) {
        for (name, id) in &self.names {
            let n = &self.nodes[id];
            let links = self.names.values().filter(|v| *v == id).count() as u64;
            let seen = match n.kind {
                'f' => Seen {
                    kind: 'f',
                    mode: n.mode,
                    nlink: links,
                    ino: n.ino,
                    size: n.data.len() as u64,
                    digest: digest(&n.data),
                },
                'l' => Seen {
                    kind: 'l',
                    mode: 0,
                    nlink: 1,
                    ino: n.ino,
                    size: 0,
                    digest: digest(n.target.as_bytes()),
                },
                _ => Seen {
                    kind: 'd',
                    mode: n.mode,
                    nlink: 2,
                    ino: n.ino,
                    size: 0,
                    digest: 0,
                },
            };
            out.insert(name.clone(), seen);
        }
    }
}

/// The directories made before the workload (`shared`, and `p<w>` for each worker).
#[derive(Debug, Clone)]
struct Fixed(Vec<(String, Seen)>);

/// The whole tree the models say: the fixed directories and every model's names, with each
/// directory's link count 2 + its subdirectories.
fn expected<'a>(
    fixed: &Fixed,
    models: impl IntoIterator<Item = &'a Model>,
) -> BTreeMap<String, Seen> {
    let mut out: BTreeMap<String, Seen> = fixed.0.iter().cloned().collect();
    for m in models {
        m.expect_into(&mut out);
    }
    let mut subdirs: HashMap<String, u64> = HashMap::new();
    for (name, s) in &out {
        if s.kind == 'd'
            && let Some((parent, _)) = name.rsplit_once('/')
        {
            *subdirs.entry(parent.to_owned()).or_default() += 1;
        }
    }
    for (name, s) in out.iter_mut() {
        if s.kind == 'd' {
            s.nlink = 2 + subdirs.get(name).copied().unwrap_or(0);
        }
    }
    out
}

/// What differs between `want` and `got` (empty when equal), at most 20 lines.
fn differences(want: &BTreeMap<String, Seen>, got: &BTreeMap<String, Seen>) -> Vec<String> {
    let mut out = Vec::new();
    for (k, w) in want {
        match got.get(k) {
            None => out.push(format!("missing {k}: {w:?}")),
            Some(g) if g != w => out.push(format!("differs {k}: want {w:?}, got {g:?}")),
            Some(_) => {}
        }
    }
    for (k, g) in got {
        if !want.contains_key(k) {
            out.push(format!("extra {k}: {g:?}"));
        }
    }
    let n = out.len();
    out.truncate(20);
    if n > 20 {
        out.push(format!("... {} more", n - 20));
    }
    out
}

/// A name a worker looked at through the other mount right after its own change: there with
/// this inode number (`node` Some), or gone.
#[derive(Debug, Clone)]
struct Observation {
    name: String,
    node: Option<u64>,
    ino: u64,
    op: u64,
}

/// The permission bits a create with `mode` gets under this process's umask.
fn umask() -> u32 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("Umask:")).unwrap();
    u32::from_str_radix(line["Umask:".len()..].trim(), 8).unwrap()
}

/// One worker: its mount, the other mount, its model and what it saw.
struct Worker {
    id: usize,
    mount: PathBuf,
    other: PathBuf,
    rng: Rng,
    model: Model,
    counter: u64,
    umask: u32,
    ops: u64,
    op_counts: BTreeMap<&'static str, u64>,
    /// The last operations, for the failure message.
    history: std::collections::VecDeque<String>,
    observations: Vec<Observation>,
    /// The longest single operation (a restart is a pause).
    longest: Duration,
    /// How often (1 in N) it looks through the other mount after a change.
    observe_one_in: u64,
    /// Only namespace changes, nothing that makes them durable: no writes (a close after a
    /// write sends an fsync), no fsync, no looks through the other mount (another session's
    /// read makes them durable first).
    lazy_only: bool,
    /// Only changes its agent sends to the server at once, under its own session: no chmod
    /// (an attribute change of a file the agent holds may wait in it), no write, fsync or
    /// look through the other mount (a read there is that mount's session's).
    sent_at_once: bool,
}

type OpResult = Result<(), String>;

fn io<T>(what: &str, path: &Path, r: std::io::Result<T>) -> Result<T, String> {
    r.map_err(|e| format!("{what} {}: {e} ({:?})", path.display(), e.kind()))
}

impl Worker {
    fn new(id: usize, mount: &Path, other: &Path, seed: u64) -> Worker {
        Worker {
            id,
            mount: mount.to_owned(),
            other: other.to_owned(),
            rng: Rng::new(seed ^ (id as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15)),
            model: Model::default(),
            counter: 0,
            umask: umask(),
            ops: 0,
            op_counts: BTreeMap::new(),
            history: std::collections::VecDeque::new(),
            observations: Vec::new(),
            longest: Duration::ZERO,
            observe_one_in: 8,
            lazy_only: false,
            sent_at_once: false,
        }
    }

    fn path(&self, rel: &str) -> PathBuf {
        self.mount.join(ROOT).join(rel)
    }

    fn other_path(&self, rel: &str) -> PathBuf {
        self.other.join(ROOT).join(rel)
    }

    fn fresh(&mut self, what: &str) -> String {
        self.counter += 1;
        format!("w{}_{what}{}", self.id, self.counter)
    }

    fn pick(&mut self, v: &[String]) -> Option<String> {
        if v.is_empty() {
            None
        } else {
            Some(v[self.rng.below(v.len() as u64) as usize].clone())
        }
    }

    /// The directories this worker makes names in: its own, the shared one, and every
    /// directory of its model.
    fn dirs(&self) -> Vec<String> {
        let mut v = vec![format!("p{}", self.id), "shared".to_owned()];
        v.extend(self.model.of_kind(&['d']));
        v
    }

    fn log(&mut self, line: String) {
        if self.history.len() == 40 {
            self.history.pop_front();
        }
        self.history.push_back(format!("#{} {line}", self.ops));
    }

    /// Stats `rel` through the other mount (sometimes, or always with `force`): it must be
    /// `node` with its inode number, or gone; recorded for the checks after the restarts.
    fn observe(&mut self, rel: &str, force: bool) -> OpResult {
        if self.lazy_only || (!force && self.rng.below(self.observe_one_in) != 0) {
            return Ok(());
        }
        let node = self.model.names.get(rel).copied();
        let p = self.other_path(rel);
        let got = lstat_past_estale(&p);
        let ino = match (node, got) {
            (Some(id), Ok(m)) if m.ino() == self.model.nodes[&id].ino => m.ino(),
            (None, Err(e)) if e.kind() == ErrorKind::NotFound => 0,
            (node, got) => {
                return Err(format!(
                    "the other mount sees {rel} as {:?}, the model says {:?}",
                    got.map(|m| m.ino()),
                    node.map(|id| &self.model.nodes[&id])
                ));
            }
        };
        self.observations.push(Observation {
            name: rel.to_owned(),
            node,
            ino,
            op: self.ops,
        });
        Ok(())
    }

    /// The inode number of `rel` through this worker's own mount.
    fn ino(&self, rel: &str) -> Result<u64, String> {
        let p = self.path(rel);
        io("stat", &p, std::fs::symlink_metadata(&p)).map(|m| m.ino())
    }

    /// One random operation, applied to the model once answered.
    fn step(&mut self) -> OpResult {
        self.ops += 1;
        let started = Instant::now();
        let files = self.model.of_kind(&['f']);
        let mut choice = self.rng.below(100);
        if self.sent_at_once && matches!(choice, 22..34 | 82..90 | 95..100) {
            choice = 0; // a create instead
        }
        if choice < 22 && files.len() + self.model.of_kind(&['l']).len() >= MAX_FILES {
            choice = 50; // unlink instead
        }
        let r = match choice {
            0..22 => self.create(),
            22..34 if !self.lazy_only && !files.is_empty() => self.write(&files),
            34..50 => self.rename(),
            50..60 => self.unlink(),
            60..68 => self.mkdir(),
            68..74 => self.rmdir(),
            74..82 if !files.is_empty() => self.link(&files),
            82..90 => self.chmod(),
            90..95 => self.symlink(),
            95..97 if !self.lazy_only => self.fsync(),
            97..100 if !self.lazy_only && self.observe_one_in != u64::MAX => self.look(),
            _ => self.create(),
        };
        self.longest = self.longest.max(started.elapsed());
        r
    }

    fn count(&mut self, op: &'static str) {
        *self.op_counts.entry(op).or_default() += 1;
    }

    fn create(&mut self) -> OpResult {
        let dirs = self.dirs();
        let parent = self.pick(&dirs).unwrap();
        let name = format!("{parent}/{}", self.fresh("f"));
        let p = self.path(&name);
        let data = if self.rng.below(2) == 0 {
            let len = 1 + self.rng.below(8192) as usize;
            self.rng.bytes(len)
        } else {
            Vec::new()
        };
        self.log(format!("create {name} with {} bytes", data.len()));
        let f = io(
            "create",
            &p,
            std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o644)
                .open(&p),
        )?;
        if !data.is_empty() {
            io("write", &p, f.write_all_at(&data, 0))?;
        }
        io("close", &p, close(f))?;
        let ino = self.ino(&name)?;
        let mode = 0o644 & !self.umask;
        self.model.add(
            name.clone(),
            Node {
                kind: 'f',
                mode,
                data,
                target: String::new(),
                ino,
            },
        );
        self.count("create");
        self.observe(&name, false)
    }

    fn write(&mut self, files: &[String]) -> OpResult {
        let name = self.pick(files).unwrap();
        let p = self.path(&name);
        let size = self.model.nodes[&self.model.names[&name]].data.len() as u64;
        // Mostly small writes (the proxied path); one in six 64-160 KiB at a 4 KiB-aligned
        // offset (the direct path, with lazy completions).
        let (off, len) = if self.rng.below(6) == 0 {
            (
                self.rng.below(size / 4096 + 2) * 4096,
                (16 + self.rng.below(25)) as usize * 4096,
            )
        } else {
            (
                self.rng.below(size + 4096),
                1 + self.rng.below(16384) as usize,
            )
        };
        let data = self.rng.bytes(len);
        self.log(format!("write {name} {off}+{len}"));
        let f = io(
            "open for write",
            &p,
            std::fs::OpenOptions::new().write(true).open(&p),
        )?;
        io("write", &p, f.write_all_at(&data, off))?;
        io("close", &p, close(f))?;
        let node = self.model.nodes.get_mut(&self.model.names[&name]).unwrap();
        let end = off as usize + len;
        if node.data.len() < end {
            node.data.resize(end, 0);
        }
        node.data[off as usize..end].copy_from_slice(&data);
        self.count("write");
        Ok(())
    }

    fn rename(&mut self) -> OpResult {
        let all: Vec<String> = self.model.names.keys().cloned().collect();
        let Some(src) = self.pick(&all) else {
            return self.create();
        };
        let is_dir = self.model.kind_of(&src) == 'd';
        let inside = |d: &String| *d == src || d.starts_with(&format!("{src}/"));
        let dirs: Vec<String> = self
            .dirs()
            .into_iter()
            .filter(|d| !(is_dir && (inside(d) || d.matches('/').count() >= 2)))
            .collect();
        let parent = self.pick(&dirs).unwrap();
        // A file onto another of the worker's files (replacing it) one time in four.
        let over: Vec<String> = self
            .model
            .of_kind(&['f'])
            .into_iter()
            .filter(|f| self.model.names[f] != self.model.names[&src])
            .collect();
        let dst = if !is_dir && !over.is_empty() && self.rng.below(4) == 0 {
            self.pick(&over).unwrap()
        } else {
            format!("{parent}/{}", self.fresh("r"))
        };
        self.log(format!("rename {src} -> {dst}"));
        let (ps, pd) = (self.path(&src), self.path(&dst));
        io("rename", &ps, std::fs::rename(&ps, &pd))?;
        self.model.remove(&dst);
        let prefix = format!("{src}/");
        let moved: Vec<String> = self
            .model
            .names
            .keys()
            .filter(|n| **n == src || n.starts_with(&prefix))
            .cloned()
            .collect();
        for old in moved {
            let id = self.model.names.remove(&old).unwrap();
            let new = format!("{dst}{}", &old[src.len()..]);
            self.model.names.insert(new, id);
        }
        self.count("rename");
        self.observe(&dst, false)?;
        self.observe(&src, false)
    }

    fn unlink(&mut self) -> OpResult {
        let names = self.model.of_kind(&['f', 'l']);
        let Some(name) = self.pick(&names) else {
            return self.create();
        };
        self.log(format!("unlink {name}"));
        let p = self.path(&name);
        io("unlink", &p, std::fs::remove_file(&p))?;
        self.model.remove(&name);
        self.count("unlink");
        self.observe(&name, false)
    }

    fn mkdir(&mut self) -> OpResult {
        let dirs: Vec<String> = self
            .dirs()
            .into_iter()
            .filter(|d| d.matches('/').count() < 3)
            .collect();
        let parent = self.pick(&dirs).unwrap();
        let name = format!("{parent}/{}", self.fresh("d"));
        self.log(format!("mkdir {name}"));
        let p = self.path(&name);
        io(
            "mkdir",
            &p,
            std::fs::DirBuilder::new().mode(0o755).create(&p),
        )?;
        let ino = self.ino(&name)?;
        self.model.add(
            name.clone(),
            Node {
                kind: 'd',
                mode: 0o755 & !self.umask,
                data: Vec::new(),
                target: String::new(),
                ino,
            },
        );
        self.count("mkdir");
        self.observe(&name, false)
    }

    fn rmdir(&mut self) -> OpResult {
        let empty: Vec<String> = self
            .model
            .of_kind(&['d'])
            .into_iter()
            .filter(|d| self.model.children(d).is_empty())
            .collect();
        let Some(name) = self.pick(&empty) else {
            return self.mkdir();
        };
        self.log(format!("rmdir {name}"));
        let p = self.path(&name);
        io("rmdir", &p, std::fs::remove_dir(&p))?;
        self.model.remove(&name);
        self.count("rmdir");
        self.observe(&name, false)
    }

    fn link(&mut self, files: &[String]) -> OpResult {
        let src = self.pick(files).unwrap();
        let dirs = self.dirs();
        let parent = self.pick(&dirs).unwrap();
        let dst = format!("{parent}/{}", self.fresh("h"));
        self.log(format!("link {src} -> {dst}"));
        let (ps, pd) = (self.path(&src), self.path(&dst));
        io("link", &pd, std::fs::hard_link(&ps, &pd))?;
        let id = self.model.names[&src];
        self.model.names.insert(dst.clone(), id);
        self.count("link");
        self.observe(&dst, false)
    }

    fn chmod(&mut self) -> OpResult {
        let names = self.model.of_kind(&['f', 'd']);
        let Some(name) = self.pick(&names) else {
            return self.create();
        };
        const MODES: [u32; 6] = [0o600, 0o640, 0o644, 0o700, 0o750, 0o755];
        let mode = MODES[self.rng.below(MODES.len() as u64) as usize];
        self.log(format!("chmod {name} {mode:o}"));
        let p = self.path(&name);
        io(
            "chmod",
            &p,
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)),
        )?;
        let id = self.model.names[&name];
        self.model.nodes.get_mut(&id).unwrap().mode = mode;
        self.count("chmod");
        Ok(())
    }

    fn symlink(&mut self) -> OpResult {
        let dirs = self.dirs();
        let parent = self.pick(&dirs).unwrap();
        let name = format!("{parent}/{}", self.fresh("s"));
        let target = format!("../t{}/{}", self.rng.below(1000), self.counter);
        self.log(format!("symlink {name} -> {target}"));
        let p = self.path(&name);
        io("symlink", &p, std::os::unix::fs::symlink(&target, &p))?;
        let ino = self.ino(&name)?;
        self.model.add(
            name.clone(),
            Node {
                kind: 'l',
                mode: 0,
                data: Vec::new(),
                target,
                ino,
            },
        );
        self.count("symlink");
        self.observe(&name, false)
    }

    /// fsync of one of its files or of a directory.
    fn fsync(&mut self) -> OpResult {
        let files = self.model.of_kind(&['f']);
        let name = if !files.is_empty() && self.rng.below(2) == 0 {
            self.pick(&files).unwrap()
        } else {
            let dirs = self.dirs();
            self.pick(&dirs).unwrap()
        };
        self.log(format!("fsync {name}"));
        let p = self.path(&name);
        let f = io("open for fsync", &p, std::fs::File::open(&p))?;
        io("fsync", &p, f.sync_all())?;
        io("close", &p, close(f))?;
        self.count("fsync");
        Ok(())
    }

    /// readdir of one of its directories through the other mount: its own names there must be
    /// the model's.
    fn look(&mut self) -> OpResult {
        let dirs = self.dirs();
        let dir = self.pick(&dirs).unwrap();
        self.log(format!("readdir {dir} through the other mount"));
        let p = self.other_path(&dir);
        let mine = format!("w{}_", self.id);
        let mut got: Vec<String> = Vec::new();
        for e in io("readdir", &p, std::fs::read_dir(&p))? {
            let name = io("readdir", &p, e)?
                .file_name()
                .to_string_lossy()
                .into_owned();
            if name.starts_with(&mine) {
                got.push(format!("{dir}/{name}"));
            }
        }
        got.sort();
        let want: Vec<String> = self.model.children(&dir).into_iter().cloned().collect();
        if got != want {
            return Err(format!(
                "readdir of {dir} through the other mount: {got:?}, the model says {want:?}"
            ));
        }
        for name in want {
            self.observe(&name, true)?;
        }
        self.count("readdir");
        Ok(())
    }

    fn tail(&self) -> String {
        self.history
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>()
            .join("\n  ")
    }
}

/// Makes the fixed directories through `mount` and returns them as the models expect them.
fn make_fixed(mount: &Path, workers: usize) -> Fixed {
    let root = mount.join(ROOT);
    std::fs::create_dir(&root).unwrap();
    let mut names = vec!["shared".to_owned()];
    names.extend((0..workers).map(|w| format!("p{w}")));
    let mut fixed = Vec::new();
    for n in names {
        let p = root.join(&n);
        std::fs::DirBuilder::new().mode(0o755).create(&p).unwrap();
        let m = std::fs::symlink_metadata(&p).unwrap();
        fixed.push((
            n,
            Seen {
                kind: 'd',
                mode: 0o755 & !umask(),
                nlink: 2,
                ino: m.ino(),
                size: 0,
                digest: 0,
            },
        ));
    }
    Fixed(fixed)
}

/// Walks both mounts and checks each against `want`, and every observation (still valid in
/// the model) against what the walks found. `Err` says what differs.
fn check_mounts(
    what: &str,
    mounts: &[PathBuf],
    want: &BTreeMap<String, Seen>,
    workers: &[&Worker],
) -> Result<(), String> {
    for (i, m) in mounts.iter().enumerate() {
        let got = walk(&m.join(ROOT)).map_err(|e| format!("{what}: walk of mount {i}: {e}"))?;
        for w in workers {
            for o in &w.observations {
                let now = w.model.names.get(&o.name).copied();
                if now != o.node {
                    continue; // the workload changed it since
                }
                let found = got.get(&o.name).map(|s| s.ino);
                let seen = o.node.map(|_| o.ino);
                if found != seen {
                    return Err(format!(
                        "{what}: worker {} saw {} through the other mount after its op #{} as {seen:?} (inode number), mount {i} now has {found:?}: a change another node saw disappeared",
                        w.id, o.name, o.op
                    ));
                }
            }
        }
        let diff = differences(want, &got);
        if !diff.is_empty() {
            return Err(format!(
                "{what}: mount {i} differs from what the workload was told ({} names expected, {} found):\n  {}",
                want.len(),
                got.len(),
                diff.join("\n  ")
            ));
        }
    }
    Ok(())
}

/// The number of records the agent said it replayed to restarted servers (its log).
fn replayed_records(log: &str) -> u64 {
    log.lines()
        .filter(|l| l.contains("replaying lazily committed"))
        .filter_map(|l| l.split("records=").nth(1))
        .filter_map(|r| r.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
}

fn logs(agents: &[&Agent], mds: &Mds) -> String {
    let tail = |s: String| {
        let lines: Vec<&str> = s.lines().collect();
        lines[lines.len().saturating_sub(60)..].join("\n")
    };
    let mut out = String::new();
    for (i, a) in agents.iter().enumerate() {
        out += &format!("agent {i} log (last 60 lines):\n{}\n", tail(a.log_text()));
    }
    out + &format!("server log (last 60 lines):\n{}", tail(mds.log_text()))
}

/// Runs `workers` on their threads until `stop`; each comes back with its first error. While
/// `quiet[m]` is set, the workers of mount `m` wait between operations and the other mount's
/// make only namespace changes ([`Worker::lazy_only`]).
fn start_workers(
    workers: Vec<Worker>,
    stop: &Arc<AtomicBool>,
    quiet: &[Arc<AtomicBool>; 2],
) -> Vec<std::thread::JoinHandle<(Worker, Option<String>)>> {
    workers
        .into_iter()
        .map(|mut w| {
            let stop = Arc::clone(stop);
            let m = w.id / WORKERS_PER_MOUNT;
            let (quiet, other_quiet) = (Arc::clone(&quiet[m]), Arc::clone(&quiet[1 - m]));
            std::thread::Builder::new()
                .name(format!("ns-worker{}", w.id))
                .spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        if quiet.load(Ordering::Relaxed) {
                            std::thread::sleep(Duration::from_millis(5));
                            continue;
                        }
                        w.lazy_only = other_quiet.load(Ordering::Relaxed);
                        if let Err(e) = w.step() {
                            return (w, Some(e));
                        }
                    }
                    w.lazy_only = false;
                    (w, None)
                })
                .unwrap()
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn namespace_workload_on_two_mounts_survives_server_kills() {
    if !can_mount() {
        return;
    }
    let rounds: usize = std::env::var("SANFS_NS_KILL_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3);
    let seed = san::seed("ns_crash server kills");
    let mut rng = Rng::new(seed);
    let started = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let (mut mds, luns) = start_mds(dir.path());
    let a = Agent::mount_as(dir.path(), "mnt-a", "h26-ns-a", MOUNT_OPTS, &mds, &luns).await;
    let b = Agent::mount_as(dir.path(), "mnt-b", "h26-ns-b", MOUNT_OPTS, &mds, &luns).await;
    let mounts = vec![a.mount.clone(), b.mount.clone()];
    let n = 2 * WORKERS_PER_MOUNT;
    let m0 = mounts[0].clone();
    let fixed = timed("the fixed directories", 30, move || make_fixed(&m0, n)).await;
    let mut workers: Vec<Worker> = (0..n)
        .map(|w| {
            let (own, other) = if w < WORKERS_PER_MOUNT {
                (&mounts[0], &mounts[1])
            } else {
                (&mounts[1], &mounts[0])
            };
            Worker::new(w, own, other, seed)
        })
        .collect();
    let mut pauses = Vec::new();
    let mut observed = 0;
    let quiet = [
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicBool::new(false)),
    ];
    for round in 1..=rounds {
        let stop = Arc::new(AtomicBool::new(false));
        let running = start_workers(std::mem::take(&mut workers), &stop, &quiet);
        let before_ms = 300 + rng.below(1700);
        // While both mounts change names, each change of one session makes the other's
        // durable first (one owner at a time), and so do writes (their close), fsyncs and
        // looks through the other mount: little is left for a replay. So in every odd round
        // one mount (in turn) goes quiet for the last 100-700 ms before the kill while the
        // other makes namespace changes only: it holds many lazy changes when the kill comes.
        let quiet_mount = (round % 2 == 1).then_some((round / 2) % 2);
        let quiet_ms = if quiet_mount.is_some() {
            (100 + rng.below(600)).min(before_ms)
        } else {
            0
        };
        tokio::time::sleep(Duration::from_millis(before_ms - quiet_ms)).await;
        if let Some(m) = quiet_mount {
            quiet[m].store(true, Ordering::Relaxed);
            tokio::time::sleep(Duration::from_millis(quiet_ms)).await;
        }
        let killed = Instant::now();
        mds.kill9_and_restart();
        a.wait_new_session(round).await;
        b.wait_new_session(round).await;
        let pause = killed.elapsed();
        pauses.push(pause);
        for q in &quiet {
            q.store(false, Ordering::Relaxed);
        }
        tokio::time::sleep(Duration::from_millis(200 + rng.below(800))).await;
        stop.store(true, Ordering::Relaxed);
        let joined = timed(
            &format!("round {round}: the workers stop"),
            120,
            move || {
                running
                    .into_iter()
                    .map(|h| h.join().unwrap())
                    .collect::<Vec<_>>()
            },
        )
        .await;
        let mut errors = Vec::new();
        for (w, err) in joined {
            if let Some(e) = err {
                errors.push(format!(
                    "worker {} (mount {}), op #{}: {e}\n  last operations:\n  {}",
                    w.id,
                    w.id / WORKERS_PER_MOUNT,
                    w.ops,
                    w.tail()
                ));
            }
            workers.push(w);
        }
        assert!(
            errors.is_empty(),
            "seed {seed}, round {round} (server killed {before_ms} ms in): the workload saw errors:\n{}\n{}",
            errors.join("\n"),
            logs(&[&a, &b], &mds)
        );
        let want = expected(&fixed, workers.iter().map(|w| &w.model));
        let what = format!("seed {seed}, after round {round}");
        let ms = mounts.clone();
        let moved: Vec<Worker> = std::mem::take(&mut workers);
        let (moved, checked) = timed(&format!("round {round}: the check"), 120, move || {
            let refs: Vec<&Worker> = moved.iter().collect();
            let r = check_mounts(&what, &ms, &want, &refs);
            (moved, r)
        })
        .await;
        workers = moved;
        if let Err(e) = checked {
            let tails: Vec<String> = workers
                .iter()
                .map(|w| format!("worker {}:\n  {}", w.id, w.tail()))
                .collect();
            panic!(
                "{e}\nlast operations:\n{}\n{}",
                tails.join("\n"),
                logs(&[&a, &b], &mds)
            );
        }
        let ops: u64 = workers.iter().map(|w| w.ops).sum();
        let names: usize = workers.iter().map(|w| w.model.names.len()).sum();
        eprintln!(
            "ns_crash: round {round}/{rounds}: killed {before_ms} ms in{}, both sessions back after {} ms; {ops} operations so far, {names} names, both mounts as told; records replayed so far: mount a {}, mount b {}",
            quiet_mount.map_or(String::new(), |m| format!(
                " (mount {m} quiet for the last {quiet_ms} ms)"
            )),
            pause.as_millis(),
            replayed_records(&a.log_text()),
            replayed_records(&b.log_text()),
        );
        for w in &mut workers {
            observed += w.observations.len();
            w.observations.clear();
        }
    }
    let mut counts: BTreeMap<&str, u64> = BTreeMap::new();
    for w in &workers {
        for (op, c) in &w.op_counts {
            *counts.entry(op).or_default() += c;
        }
    }
    let longest = workers.iter().map(|w| w.longest).max().unwrap_or_default();
    pauses.sort();
    let (ra, rb) = (
        replayed_records(&a.log_text()),
        replayed_records(&b.log_text()),
    );
    // Round 1 kills the server while one mount makes only lazy namespace changes: the agents
    // must have had records to replay (else the kills tested nothing of the replay).
    assert!(
        rounds == 0 || ra + rb > 0,
        "seed {seed}: no agent replayed anything: every change was durable before each kill\n{}",
        logs(&[&a, &b], &mds)
    );
    for (i, ag) in [&a, &b].into_iter().enumerate() {
        assert!(
            !ag.log_text().contains("refused the replay"),
            "seed {seed}: agent {i}: a replay was refused\n{}",
            logs(&[&a, &b], &mds)
        );
    }
    eprintln!(
        "ns_crash: seed {seed}: {rounds} server kills, {} operations {counts:?}, 0 errors, 0 mismatches, {observed} looks through the other mount still true ({} retried after ESTALE); records replayed: mount a {ra}, mount b {rb}; kill to both sessions back: median {} ms, max {} ms; longest operation {} ms; {} s",
        workers.iter().map(|w| w.ops).sum::<u64>(),
        ESTALE_RETRIES.load(Ordering::Relaxed),
        pauses[pauses.len() / 2].as_millis(),
        pauses[pauses.len() - 1].as_millis(),
        longest.as_millis(),
        started.elapsed().as_secs()
    );
    drop(a);
    drop(b);
    mds.stop_and_fsck(dir.path());
}

/// Runs `steps` operations of `w` on a thread of its own; its first error fails the test.
async fn run_steps(w: Worker, steps: usize, what: &str) -> Worker {
    let what2 = what.to_owned();
    let (w, err) = timed(what, 120, move || {
        let mut w = w;
        for _ in 0..steps {
            if let Err(e) = w.step() {
                return (w, Some(e));
            }
        }
        (w, None)
    })
    .await;
    if let Some(e) = err {
        panic!(
            "{what2}: op #{}: {e}\n  last operations:\n  {}",
            w.ops,
            w.tail()
        );
    }
    w
}

/// Walks `mount` and compares it with `want`.
async fn check_one(
    what: &str,
    mount: &Path,
    workers: Vec<Worker>,
    want: BTreeMap<String, Seen>,
) -> Vec<Worker> {
    let m = mount.to_owned();
    let what2 = what.to_owned();
    let (workers, r) = timed(what, 60, move || {
        let refs: Vec<&Worker> = workers.iter().collect();
        let r = check_mounts(&what2, &[m], &want, &refs);
        (workers, r)
    })
    .await;
    if let Err(e) = r {
        panic!("{e}");
    }
    workers
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_killed_with_unsynced_changes_loses_only_those() {
    if !can_mount() {
        return;
    }
    let seed = san::seed("ns_crash agent kill");
    let dir = tempfile::tempdir().unwrap();
    let (mut mds, luns) = start_mds(dir.path());
    let mut a = Agent::mount_as(dir.path(), "mnt-a", "h26-doomed", DOOMED_OPTS, &mds, &luns).await;
    let b = Agent::mount_as(dir.path(), "mnt-b", "h26-survivor", MOUNT_OPTS, &mds, &luns).await;
    let mb = b.mount.clone();
    let fixed = timed("the fixed directories", 30, move || make_fixed(&mb, 2)).await;
    let mut wa = Worker::new(0, &a.mount, &b.mount, seed);
    let mut wb = Worker::new(1, &b.mount, &a.mount, seed);
    // A's changes must stay lazy until the kill: no looks through the other mount (a read
    // there makes them durable).
    wa.observe_one_in = u64::MAX;
    wb = run_steps(wb, 100, "B's first 100 operations").await;
    wa = run_steps(wa, 100, "A's first 100 operations").await;

    // 1. A killed, the server lives: it applied everything A was answered, but for what A
    // held back and had not sent, which a node that dies loses (docs/posix.md "Buffered
    // writes: the write-back cache"; not acknowledged by a close or fsync): sent within
    // A's `writeback_age`, so the kill waits for that.
    tokio::time::sleep(HELD_BACK_AT_MOST).await;
    a.kill9();
    let killed = Instant::now();
    tokio::time::sleep(Duration::from_millis(2 * TTL_MS + 1000)).await;
    let want = expected(&fixed, [&wa.model, &wb.model]);
    let ws = check_one(
        "after A's kill -9 (server alive)",
        &b.mount,
        vec![wa, wb],
        want,
    )
    .await;
    let [wa0, wb0]: [Worker; 2] = ws.try_into().ok().unwrap();
    let (mut wa, mut wb) = (wa0, wb0);
    eprintln!(
        "ns_crash agent kill: A killed after {} operations; {} s later B sees all of them",
        wa.ops,
        killed.elapsed().as_secs()
    );

    // 2. A mounted again, then killed together with the server inside the lazy second.
    let a2 = Agent::mount_as(
        dir.path(),
        "mnt-a2",
        "h26-doomed2",
        DOOMED_OPTS,
        &mds,
        &luns,
    )
    .await;
    wa.mount = a2.mount.clone();
    wb.other = a2.mount.clone();
    wa.observe_one_in = u64::MAX;
    wb = run_steps(wb, 50, "B's next 50 operations").await;
    wa = run_steps(wa, 50, "A's next 50 operations").await;
    // A's durability point: fsync of its directory.
    let pa = wa.path("p0");
    timed("A's directory fsync", 30, move || {
        let f = std::fs::File::open(&pa).unwrap();
        f.sync_all().unwrap();
    })
    .await;
    let synced = wa.ops;
    let mut snapshots = vec![wa.model.clone()];
    // Namespace changes only from here (a close after a write sends an fsync).
    wa.lazy_only = true;
    // B's operations in between must reach the server as B's: a look through A's mount is
    // A's session's read, which A's own changes need not be durable for.
    wb.sent_at_once = true;
    let tail = 30;
    // The first state of A's that must survive: whatever B does next makes A's lazy changes
    // durable first (a change of B's is committed durably, as it would follow A's: one owner
    // at a time; a read, its lookups included, waits for them; so does a write's completion).
    let mut first = 0;
    for i in 0..tail {
        wa = run_steps(wa, 1, "A's unsynced operations").await;
        snapshots.push(wa.model.clone());
        if i < 20 && i % 10 == 9 {
            wb = run_steps(wb, 1, "B between A's operations").await;
            first = i + 1;
        }
    }
    let mut a2 = a2;
    a2.kill9();
    mds.kill9_and_restart();
    b.wait_new_session(1).await;
    let mb = b.mount.clone();
    let got = timed("B's walk after the restart", 60, move || {
        walk(&mb.join(ROOT))
    })
    .await
    .unwrap();
    let matching = (first..snapshots.len())
        .rev()
        .find(|k| expected(&fixed, [&snapshots[*k], &wb.model]) == got);
    let Some(k) = matching else {
        let diff_all = differences(&expected(&fixed, [&wa.model, &wb.model]), &got);
        let diff_synced = differences(&expected(&fixed, [&snapshots[first], &wb.model]), &got);
        panic!(
            "seed {seed}: after A and the server were killed the namespace is no prefix of A's operations after its fsync (#{synced}) and B's last operation (A's #{}) with all of B's.\nagainst everything:\n  {}\nagainst A's state at B's last operation:\n  {}\nA's last operations:\n  {}\nB's last operations:\n  {}\n{}",
            synced + first as u64,
            diff_all.join("\n  "),
            diff_synced.join("\n  "),
            wa.tail(),
            wb.tail(),
            logs(&[&b], &mds)
        );
    };
    eprintln!(
        "ns_crash agent kill: seed {seed}: A and the server killed {} operations after A's directory fsync, B's last operation after {first} of them; {k} of them survived, {} lost (a suffix); all of B's {} operations there",
        tail,
        tail - k,
        wb.ops
    );
    assert!(
        !b.log_text().contains("refused the replay"),
        "B: a replay was refused\n{}",
        logs(&[&b], &mds)
    );
    drop(a);
    drop(b);
    mds.stop_and_fsck(dir.path());
}
