//! Crash consistency of the metadata store on the crash-simulating disk.
//!
//! A seeded workload of namespace and allocation operations runs once on a fault-free disk
//! (the reference): the namespace and extent maps are read back after every operation, giving
//! `D_0` (after format) .. `D_n`. Then the same workload is replayed again and again, the disk
//! crashing at the Nth write, set_len or sync (every N, or every sync failing in turn). After
//! each crash the store is reopened from the durable image (redb recovery) and must show
//! exactly `D_a` or `D_{a+1}`, where `a` operations were acknowledged: every acknowledged
//! operation survives, the one in flight is all there or not there at all, nothing else
//! happens. fsck must be clean, and the recovered store must take new writes. A power cut
//! after the last operation must keep all of them. The reference run is the model: it also
//! checks that a refused operation changes nothing.
//!
//! Not covered here: batches of more than one operation (the workload is sequential, so each
//! group commit holds one), and files unlinked while open (orphans are reaped at restart,
//! which this model does not follow: `create` closes its handle at once).
//!
//! The seed is printed; `SANFS_CRASH_SEED=<n>` (decimal or 0x-hex) replays one; the test with
//! the pinned seed crashes at every disk call.

use std::collections::BTreeMap;
use std::hash::{BuildHasher, Hasher};
use std::time::Instant;

use redb::StorageBackend;
use sanfs_blockmap::extent::Extent;
use sanfs_mds::clock::Clock;
use sanfs_mds::fsck;
use sanfs_mds::ns::{self, Reader};
use sanfs_mds::store::backend::{FaultPlan, SimDisk};
use sanfs_mds::store::{Backend, OpError, ROOT, Store};
use sanfs_proto::model::{
    CreateRequest, EntryRequest, LinkRequest, MkdirRequest, MknodRequest, OpenFlags,
    ReadDirRequest, RenameRequest, SetAttrRequest, SetXattrRequest, SymlinkRequest, XattrRequest,
};
use sanfs_proto::types::{
    Attr, Credentials, FileType, FsError, InodeId, RenameMode, SessionId, SetAttr, SymlinkTarget,
    TimeSet, Timestamp, XattrMode, XattrName,
};

use crate::support::{fs_info, name};

/// Operations per workload: enough for a tree of a few dozen inodes with real extents.
const WORKLOAD_OPS: usize = 100;
const PINNED_SEED: u64 = 0x5a4e_f5c4_a5e0_0001;
pub(crate) const EPOCH_SEC: i64 = 1_700_000_000;

/// xorshift64*: a deterministic stream from a seed, no dependency.
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Rng {
        Rng((seed ^ 0x2545_f491_4f6c_dd1d) | 1)
    }

    pub(crate) fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    pub(crate) fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }

    fn pick<'a, T>(&mut self, items: &'a [T]) -> Option<&'a T> {
        if items.is_empty() {
            None
        } else {
            items.get(self.below(items.len() as u64) as usize)
        }
    }
}

/// One workload step, with inode numbers resolved against the reference run's state (a
/// replay reaches the same state, so the numbers mean the same inodes).
#[derive(Debug, Clone)]
pub(crate) enum Op {
    Mkdir {
        parent: u64,
        name: String,
        perm: u32,
    },
    /// create(2) then close: no handle stays open (an open unlinked file would be an orphan,
    /// reaped at restart, which the model does not follow).
    Create {
        parent: u64,
        name: String,
        exclusive: bool,
        truncate: bool,
    },
    Mknod {
        parent: u64,
        name: String,
        kind: FileType,
        rdev: u64,
    },
    Symlink {
        parent: u64,
        name: String,
        target: String,
    },
    Link {
        ino: u64,
        parent: u64,
        name: String,
    },
    Rename {
        old_parent: u64,
        old_name: String,
        new_parent: u64,
        new_name: String,
        mode: RenameMode,
    },
    Unlink {
        parent: u64,
        name: String,
    },
    Rmdir {
        parent: u64,
        name: String,
    },
    SetAttr {
        ino: u64,
        changes: SetAttr,
    },
    SetXattr {
        ino: u64,
        name: String,
        value: Vec<u8>,
        mode: XattrMode,
    },
    RemoveXattr {
        ino: u64,
        name: String,
    },
    Allocate {
        ino: u64,
        offset: u64,
        len: u64,
        keep_size: bool,
    },
    /// fallocate PUNCH_HOLE's transaction: whole file blocks `[first, end)` unmapped.
    Punch {
        ino: u64,
        first: u64,
        end: u64,
    },
    /// fallocate ZERO_RANGE's transaction over bytes `[offset, end)`.
    ZeroRange {
        ino: u64,
        offset: u64,
        end: u64,
        keep_size: bool,
    },
}

fn cred() -> Credentials {
    Credentials::root()
}

fn xname(s: &str) -> XattrName {
    XattrName::new(s.as_bytes().to_vec()).unwrap()
}

pub(crate) fn apply(store: &Store, op: &Op) -> Result<(), FsError> {
    match op.clone() {
        Op::Mkdir {
            parent,
            name: n,
            perm,
        } => store.write_blocking(move |ctx| {
            let r = MkdirRequest {
                cred: cred(),
                parent: InodeId(parent),
                name: name(&n),
                perm,
                delegate: false,
            };
            ns::mkdir(ctx, &r).map(drop)
        }),
        Op::Create {
            parent,
            name: n,
            exclusive,
            truncate,
        } => store.write_blocking(move |ctx| {
            let r = CreateRequest {
                delegate: false,
                inode: None,
                time: None,
                cred: cred(),
                session: SessionId(1),
                parent: InodeId(parent),
                name: name(&n),
                perm: 0o644,
                exclusive,
                flags: OpenFlags {
                    read: true,
                    write: true,
                    append: false,
                    truncate,
                },
            };
            let reply = ns::create(ctx, &r)?;
            // Closed at once, in the same job: nothing is left open.
            let mut handles = ctx.st.handles.lock().unwrap();
            handles.release(reply.handle.0);
            Ok(())
        }),
        Op::Mknod {
            parent,
            name: n,
            kind,
            rdev,
        } => store.write_blocking(move |ctx| {
            let r = MknodRequest {
                cred: cred(),
                parent: InodeId(parent),
                name: name(&n),
                kind,
                perm: 0o640,
                rdev,
            };
            ns::mknod(ctx, &r).map(drop)
        }),
        Op::Symlink {
            parent,
            name: n,
            target,
        } => store.write_blocking(move |ctx| {
            let r = SymlinkRequest {
                cred: cred(),
                parent: InodeId(parent),
                name: name(&n),
                target: SymlinkTarget::new(target.into_bytes()).unwrap(),
            };
            ns::symlink(ctx, &r).map(drop)
        }),
        Op::Link {
            ino,
            parent,
            name: n,
        } => store.write_blocking(move |ctx| {
            let r = LinkRequest {
                cred: cred(),
                inode: InodeId(ino),
                new_parent: InodeId(parent),
                new_name: name(&n),
            };
            ns::link(ctx, &r).map(drop)
        }),
        Op::Rename {
            old_parent,
            old_name,
            new_parent,
            new_name,
            mode,
        } => store.write_blocking(move |ctx| {
            let r = RenameRequest {
                cred: cred(),
                old_parent: InodeId(old_parent),
                old_name: name(&old_name),
                new_parent: InodeId(new_parent),
                new_name: name(&new_name),
                mode,
            };
            ns::rename(ctx, &r)
        }),
        Op::Unlink { parent, name: n } => store.write_blocking(move |ctx| {
            let r = EntryRequest {
                cred: cred(),
                parent: InodeId(parent),
                name: name(&n),
            };
            ns::unlink(ctx, &r, false)
        }),
        Op::Rmdir { parent, name: n } => store.write_blocking(move |ctx| {
            let r = EntryRequest {
                cred: cred(),
                parent: InodeId(parent),
                name: name(&n),
            };
            ns::unlink(ctx, &r, true)
        }),
        Op::SetAttr { ino, changes } => store.write_blocking(move |ctx| {
            let r = SetAttrRequest {
                cred: cred(),
                inode: InodeId(ino),
                changes,
                handle: None,
            };
            ns::setattr(ctx, &r).map(drop)
        }),
        Op::SetXattr {
            ino,
            name: n,
            value,
            mode,
        } => store.write_blocking(move |ctx| {
            let r = SetXattrRequest {
                cred: cred(),
                inode: InodeId(ino),
                name: xname(&n),
                value,
                mode,
            };
            ns::setxattr(ctx, &r)
        }),
        Op::RemoveXattr { ino, name: n } => store.write_blocking(move |ctx| {
            let r = XattrRequest {
                cred: cred(),
                inode: InodeId(ino),
                name: xname(&n),
            };
            ns::removexattr(ctx, &r)
        }),
        Op::Allocate {
            ino,
            offset,
            len,
            keep_size,
        } => store.write_blocking(move |ctx| {
            ns::allocate_range(ctx, &cred(), InodeId(ino), offset, len, keep_size).map(drop)
        }),
        Op::Punch { ino, first, end } => store.write_blocking(move |ctx| {
            sanfs_mds::space::punch_blocks(ctx, InodeId(ino), first, end).map(drop)
        }),
        Op::ZeroRange {
            ino,
            offset,
            end,
            keep_size,
        } => store.write_blocking(move |ctx| {
            sanfs_mds::space::zero_range(ctx, InodeId(ino), offset, end, keep_size).map(drop)
        }),
    }
}

/// One directory entry as the public read API shows it, with everything the inode holds.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Node {
    dir: u64,
    cookie: u64,
    kind: FileType,
    attr: Attr,
    /// A directory's `..` (readdir's parent).
    dotdot: Option<u64>,
    target: Option<Vec<u8>>,
    xattrs: Vec<(Vec<u8>, Vec<u8>)>,
    extents: Vec<Extent>,
}

/// The whole namespace, canonical and comparable: path -> node, plus space and inode usage.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct State {
    nodes: BTreeMap<String, Node>,
    free_blocks: u64,
    inodes: u64,
}

impl State {
    fn dirs(&self) -> Vec<(&str, u64)> {
        self.nodes
            .iter()
            .filter(|(_, n)| n.kind == FileType::Directory)
            .map(|(p, n)| (p.as_str(), n.attr.ino.0))
            .collect()
    }

    /// Every entry but the root: (parent directory, name, node).
    fn entries(&self) -> Vec<(u64, &str, &Node)> {
        self.nodes
            .iter()
            .filter(|(p, _)| p.as_str() != "/")
            .map(|(p, n)| (n.dir, p.rsplit('/').next().unwrap(), n))
            .collect()
    }

    fn regular_files(&self) -> Vec<&Node> {
        self.nodes
            .values()
            .filter(|n| n.kind == FileType::Regular)
            .collect()
    }
}

pub(crate) fn dump(store: &Store) -> State {
    let bs = store.block_size();
    let nodes = store
        .read(|t| {
            let mut nodes = BTreeMap::new();
            let root = t.getattr(bs, InodeId(ROOT))?;
            let mut stack = vec![("/".to_string(), ROOT, 0u64, root, ROOT)];
            while let Some((path, ino, cookie, attr, dir)) = stack.pop() {
                let mut node = Node {
                    dir,
                    cookie,
                    kind: attr.kind,
                    attr,
                    dotdot: None,
                    target: None,
                    xattrs: Vec::new(),
                    extents: t.extent_list(InodeId(ino))?,
                };
                for n in t.listxattr(&cred(), InodeId(ino))? {
                    let r = XattrRequest {
                        cred: cred(),
                        inode: InodeId(ino),
                        name: XattrName::new(n.clone()).unwrap(),
                    };
                    let v = t.getxattr(&r)?;
                    node.xattrs.push((n, v));
                }
                match node.kind {
                    FileType::Symlink => node.target = Some(t.readlink(InodeId(ino))?),
                    FileType::Directory => {
                        let mut from = 0;
                        loop {
                            let r = ReadDirRequest {
                                cred: cred(),
                                inode: InodeId(ino),
                                cookie: from,
                                max_entries: 7,
                                plus: true,
                            };
                            let reply = t.readdir(bs, &r)?;
                            node.dotdot = Some(reply.parent.0);
                            for e in reply.entries {
                                let attr = e.attr.expect("readdirplus gives attributes");
                                assert_eq!((attr.ino, attr.kind), (e.inode, e.kind));
                                let name = String::from_utf8(e.name.as_bytes().to_vec()).unwrap();
                                let child = if path == "/" {
                                    format!("/{name}")
                                } else {
                                    format!("{path}/{name}")
                                };
                                from = e.cookie;
                                stack.push((child, e.inode.0, e.cookie, attr, ino));
                            }
                            if reply.eof {
                                break;
                            }
                        }
                    }
                    _ => {}
                }
                nodes.insert(path, node);
            }
            Ok::<_, OpError>(nodes)
        })
        .unwrap();
    let usage = store.usage();
    State {
        nodes,
        free_blocks: usage.free_blocks.load(std::sync::atomic::Ordering::SeqCst),
        inodes: usage.inodes.load(std::sync::atomic::Ordering::SeqCst),
    }
}

/// Where two states differ, briefly (for a failure message).
fn diff(want: &State, got: &State) -> String {
    let mut out = Vec::new();
    if (want.free_blocks, want.inodes) != (got.free_blocks, got.inodes) {
        out.push(format!(
            "usage: want {} free blocks, {} inodes; got {}, {}",
            want.free_blocks, want.inodes, got.free_blocks, got.inodes
        ));
    }
    for (p, n) in &want.nodes {
        match got.nodes.get(p) {
            None => out.push(format!("missing {p}")),
            Some(g) if g != n => out.push(format!("differs {p}:\n  want {n:?}\n  got  {g:?}")),
            _ => {}
        }
    }
    for p in got.nodes.keys().filter(|p| !want.nodes.contains_key(*p)) {
        out.push(format!("extra {p}"));
    }
    out.truncate(8);
    out.join("\n")
}

const NAMES: [&str; 8] = ["a", "b", "c", "d", "e", "f", "g", "h"];
const XATTRS: [&str; 4] = ["user.x", "user.y", "trusted.t", "security.s"];

/// The next operation, chosen from what exists now.
pub(crate) fn generate(rng: &mut Rng, s: &State) -> Op {
    let dirs = s.dirs();
    let entries = s.entries();
    let files = s.regular_files();
    // Subdirectories rather than the root (`dirs[0]`), whose few names fill up first.
    let dir = |rng: &mut Rng| match dirs.get(1..) {
        Some(sub) if !sub.is_empty() && rng.chance(60) => rng.pick(sub).unwrap().1,
        _ => rng.pick(&dirs).unwrap().1,
    };
    let new_name = |rng: &mut Rng| rng.pick(&NAMES).unwrap().to_string();
    let any_ino = |rng: &mut Rng| rng.pick(&entries).map_or(ROOT, |e| e.2.attr.ino.0);
    // A regular file mostly, anything sometimes (the operation then fails, changing nothing).
    let file_ino = |rng: &mut Rng| {
        if rng.chance(90)
            && let Some(f) = rng.pick(&files)
        {
            return f.attr.ino.0;
        }
        any_ino(rng)
    };
    if dirs.len() < 4 && rng.chance(20) {
        return Op::Mkdir {
            parent: dir(rng),
            name: new_name(rng),
            perm: 0o755,
        };
    }
    loop {
        let op = match rng.below(100) {
            0..8 => Op::Mkdir {
                parent: dir(rng),
                name: new_name(rng),
                perm: 0o755,
            },
            8..24 => Op::Create {
                parent: dir(rng),
                name: new_name(rng),
                exclusive: rng.chance(70),
                truncate: rng.chance(30),
            },
            24..26 => Op::Mknod {
                parent: dir(rng),
                name: new_name(rng),
                kind: if rng.chance(50) {
                    FileType::Fifo
                } else {
                    FileType::CharDevice
                },
                rdev: rng.below(1 << 16),
            },
            26..30 => Op::Symlink {
                parent: dir(rng),
                name: new_name(rng),
                target: format!(
                    "../{}/{}",
                    new_name(rng),
                    "x".repeat(rng.below(300) as usize + 1)
                ),
            },
            30..35 => {
                let Some(e) = rng.pick(&entries) else {
                    continue;
                };
                Op::Link {
                    ino: e.2.attr.ino.0,
                    parent: dir(rng),
                    name: new_name(rng),
                }
            }
            35..47 => {
                let Some(e) = rng.pick(&entries) else {
                    continue;
                };
                let mode = match rng.below(10) {
                    0..6 => RenameMode::Replace,
                    6..8 => RenameMode::NoReplace,
                    _ => RenameMode::Exchange,
                };
                // Over an existing entry now and then.
                let (new_parent, new_name) = match rng.pick(&entries) {
                    Some(d) if rng.chance(30) => (d.0, d.1.to_string()),
                    _ => (dir(rng), new_name(rng)),
                };
                Op::Rename {
                    old_parent: e.0,
                    old_name: e.1.to_string(),
                    new_parent,
                    new_name,
                    mode,
                }
            }
            47..52 => {
                let Some(e) = rng.pick(&entries) else {
                    continue;
                };
                Op::Unlink {
                    parent: e.0,
                    name: e.1.to_string(),
                }
            }
            52..55 => {
                // A directory mostly, anything sometimes (ENOTDIR).
                let subdirs: Vec<_> = entries
                    .iter()
                    .filter(|e| e.2.kind == FileType::Directory)
                    .copied()
                    .collect();
                let from = if rng.chance(60) && !subdirs.is_empty() {
                    &subdirs
                } else {
                    &entries
                };
                let Some(e) = rng.pick(from) else { continue };
                Op::Rmdir {
                    parent: e.0,
                    name: e.1.to_string(),
                }
            }
            55..68 => {
                let mut changes = SetAttr::default();
                let ino = match rng.below(5) {
                    0 => {
                        changes.perm = Some(rng.below(0o10000) as u32);
                        any_ino(rng)
                    }
                    1 => {
                        changes.uid = Some([0, 1000][rng.below(2) as usize]);
                        changes.gid = Some([0, 100][rng.below(2) as usize]);
                        any_ino(rng)
                    }
                    2 => {
                        changes.mtime = Some(TimeSet::At(Timestamp {
                            sec: rng.below(1 << 30) as i64,
                            nsec: 5,
                        }));
                        changes.atime = Some(TimeSet::Now);
                        any_ino(rng)
                    }
                    _ => {
                        let ino = file_ino(rng);
                        let size = s
                            .nodes
                            .values()
                            .find(|n| n.attr.ino.0 == ino)
                            .map_or(0, |n| n.attr.size);
                        // Down (freeing blocks) or up (a hole).
                        changes.size = Some(if rng.chance(65) {
                            rng.below(size + 1)
                        } else {
                            size + rng.below(2 << 20)
                        });
                        ino
                    }
                };
                Op::SetAttr { ino, changes }
            }
            68..76 => {
                let len = if rng.chance(10) {
                    3000
                } else {
                    rng.below(200) as usize
                };
                let byte = rng.below(256) as u8;
                Op::SetXattr {
                    ino: any_ino(rng),
                    name: rng.pick(&XATTRS).unwrap().to_string(),
                    value: vec![byte; len],
                    mode: [XattrMode::Either, XattrMode::Create, XattrMode::Replace]
                        [rng.below(3) as usize],
                }
            }
            76..79 => Op::RemoveXattr {
                ino: any_ino(rng),
                name: rng.pick(&XATTRS).unwrap().to_string(),
            },
            _ => {
                let aligned = rng.chance(70);
                let mut offset = rng.below(2 << 20);
                let mut len = rng.below(1 << 20) + 1;
                if aligned {
                    offset &= !4095;
                    len = len.div_ceil(4096) * 4096;
                }
                let ino = file_ino(rng);
                match rng.below(4) {
                    0 => Op::Punch {
                        ino,
                        first: offset / 4096,
                        end: (offset + len) / 4096,
                    },
                    1 => Op::ZeroRange {
                        ino,
                        offset,
                        end: offset + len,
                        keep_size: rng.chance(50),
                    },
                    _ => Op::Allocate {
                        ino,
                        offset,
                        len,
                        keep_size: rng.chance(30),
                    },
                }
            }
        };
        return op;
    }
}

/// The reference run: the operations, their answers, and the state after each.
struct Workload {
    seed: u64,
    ops: Vec<Op>,
    answers: Vec<Result<(), FsError>>,
    /// `states[k]`: after the first k operations.
    states: Vec<State>,
    /// Mutating disk calls by format and open, and by the end of the workload.
    format_disk_ops: u64,
    total_disk_ops: u64,
    /// The same for syncs.
    format_syncs: u64,
    total_syncs: u64,
}

fn format(disk: &SimDisk, clock: &Clock) -> Result<Store, String> {
    sanfs_testcluster::mds::create_store(&Backend::Sim(disk.clone()), &fs_info(), clock)
        .map_err(|e| format!("{e:#}"))?;
    Store::open(&Backend::Sim(disk.clone()), clock.clone(), 64).map_err(|e| e.to_string())
}

pub(crate) fn tick(clock: &Clock) {
    clock.advance_ns(1_000_000_007);
}

fn reference(seed: u64) -> Workload {
    let clock = Clock::manual(EPOCH_SEC);
    let disk = SimDisk::new(FaultPlan::default());
    let store = format(&disk, &clock).unwrap();
    let (format_disk_ops, format_syncs) = (disk.ops(), disk.syncs());
    let mut rng = Rng::new(seed);
    let mut states = vec![dump(&store)];
    let mut ops = Vec::new();
    let mut answers = Vec::new();
    for _ in 0..WORKLOAD_OPS {
        let op = generate(&mut rng, states.last().unwrap());
        tick(&clock);
        let answer = apply(&store, &op);
        let after = dump(&store);
        if let Err(e) = &answer {
            assert!(!matches!(e, FsError::Io(_)), "seed {seed}: {op:?}: {e}");
            // A refused operation leaves no trace.
            let before = states.last().unwrap();
            assert!(
                after == *before,
                "seed {seed}: {op:?} failed ({e}) but changed:\n{}",
                diff(before, &after)
            );
        }
        ops.push(op);
        answers.push(answer);
        states.push(after);
    }
    let (total_disk_ops, total_syncs) = (disk.ops(), disk.syncs());
    let failed = answers.iter().filter(|a| a.is_err()).count();
    let last = states.last().unwrap();
    eprintln!(
        "crash workload seed {seed:#x}: {} operations ({failed} refused), {} paths, {} extents, {} disk calls ({} by format)",
        ops.len(),
        last.nodes.len(),
        last.nodes.values().map(|n| n.extents.len()).sum::<usize>(),
        total_disk_ops,
        format_disk_ops,
    );
    Workload {
        seed,
        ops,
        answers,
        states,
        format_disk_ops,
        total_disk_ops,
        format_syncs,
        total_syncs,
    }
}

/// How a replay on a faulty disk ended.
enum Replay {
    /// The fault hit format (no workload ran).
    InFormat,
    /// An operation failed with EIO: the store (poisoned) and how many were acknowledged.
    Faulted(Store, usize),
    /// The workload finished without meeting the fault; the store is still up.
    Finished(Store),
}

/// Replays the workload on `disk` until an operation fails with EIO. Every other answer
/// must be the reference run's.
fn replay(w: &Workload, disk: &SimDisk, what: &str) -> Replay {
    let clock = Clock::manual(EPOCH_SEC);
    let Ok(store) = format(disk, &clock) else {
        return Replay::InFormat;
    };
    for (i, op) in w.ops.iter().enumerate() {
        tick(&clock);
        match apply(&store, op) {
            Err(FsError::Io(_)) => {
                assert!(
                    store.poisoned(),
                    "{what}: an I/O error must poison the store"
                );
                return Replay::Faulted(store, i);
            }
            answer => {
                assert_eq!(
                    answer, w.answers[i],
                    "{what}: operation {i} {op:?} answered differently in a replay"
                );
                // A refused operation answers its refusal even when its batch's commit
                // failed (it changed nothing either way); the store is poisoned all the same.
                if store.poisoned() {
                    return Replay::Faulted(store, i);
                }
            }
        }
    }
    Replay::Finished(store)
}

/// Restarts from `image` and checks the state is `D_acked` or `D_{acked+1}`, fsck is clean,
/// and the store takes new writes. Returns whether the operation in flight (unacknowledged)
/// survived with a visible change.
fn check_recovery(w: &Workload, image: Vec<u8>, acked: usize, what: &str) -> bool {
    let what = format!(
        "seed {:#x}, {what}, {acked} operations acknowledged",
        w.seed
    );
    // fsck straight after the restart (a dry-run repair: redb's recovery on a copy in memory,
    // and none of our repairs needed), and again below after the store has taken new writes.
    let copy = Backend::Sim(SimDisk::from_image(image.clone(), FaultPlan::default()));
    let report = fsck::repair(&copy, true, sanfs_proto::types::Timestamp::default())
        .unwrap_or_else(|e| panic!("{what}: fsck cannot read the store: {e}"));
    assert!(
        report.fixes.is_empty() && report.after.is_clean(),
        "{what}: fsck after the crash:\n{report}"
    );
    let disk = SimDisk::from_image(image, FaultPlan::default());
    let backend = Backend::Sim(disk.clone());
    let clock = Clock::manual(EPOCH_SEC + 1_000_000);
    let store =
        Store::open(&backend, clock, 64).unwrap_or_else(|e| panic!("{what}: reopen failed: {e}"));
    let got = dump(&store);
    let before = &w.states[acked];
    let after = w.states.get(acked + 1).unwrap_or(before);
    if got != *before && got != *after {
        panic!(
            "{what}: the recovered state is neither D_{acked} nor D_{} (in flight: {:?})\nagainst D_{acked}:\n{}\nagainst D_{}:\n{}",
            acked + 1,
            w.ops.get(acked),
            diff(before, &got),
            acked + 1,
            diff(after, &got),
        );
    }
    // The recovered store takes new writes: a directory and a file with blocks, which must
    // come from really free space (fsck below finds any double ownership).
    let dir = store
        .write_blocking(|ctx| {
            let r = MkdirRequest {
                cred: cred(),
                parent: InodeId(ROOT),
                name: name("recovered"),
                perm: 0o755,
                delegate: false,
            };
            ns::mkdir(ctx, &r)
        })
        .unwrap_or_else(|e| panic!("{what}: mkdir after recovery: {e}"));
    let file = store
        .write_blocking(move |ctx| {
            let r = MknodRequest {
                cred: cred(),
                parent: dir.ino,
                name: name("f"),
                kind: FileType::Regular,
                perm: 0o644,
                rdev: 0,
            };
            ns::mknod(ctx, &r)
        })
        .unwrap_or_else(|e| panic!("{what}: create after recovery: {e}"));
    store
        .write_blocking(move |ctx| ns::allocate_range(ctx, &cred(), file.ino, 0, 1 << 20, false))
        .unwrap_or_else(|e| panic!("{what}: allocate after recovery: {e}"));
    store.close();
    drop(store);
    let report =
        fsck::check(&backend).unwrap_or_else(|e| panic!("{what}: fsck cannot read the store: {e}"));
    assert!(
        report.is_clean(),
        "{what}: fsck after new writes:\n{report}"
    );
    got != *before
}

/// The seed of the randomized tests: `SANFS_CRASH_SEED` (decimal or 0x-hex), else random.
pub(crate) fn seed_from_env() -> u64 {
    match std::env::var("SANFS_CRASH_SEED") {
        Ok(s) => {
            let s = s.trim();
            match s.strip_prefix("0x") {
                Some(hex) => u64::from_str_radix(hex, 16),
                None => s.parse(),
            }
            .unwrap_or_else(|e| panic!("SANFS_CRASH_SEED={s}: {e}"))
        }
        Err(_) => std::collections::hash_map::RandomState::new()
            .build_hasher()
            .finish(),
    }
}

/// Crashes at every `stride`th mutating disk call of the workload; returns the crash points
/// checked and at how many of them the operation in flight survived.
fn crash_everywhere(w: &Workload, stride: u64, torn_writes: bool) -> (u64, u64) {
    let mut checked = 0;
    let mut in_flight_survived = 0;
    let mut n = w.format_disk_ops + 1;
    while n <= w.total_disk_ops {
        let plan = FaultPlan {
            crash_at_op: Some(n),
            torn_writes,
            fail_sync: None,
            seed: w.seed ^ n,
        };
        let what = format!(
            "crash at disk call {n}{}",
            if torn_writes { " (torn writes)" } else { "" }
        );
        let disk = SimDisk::new(plan);
        let Replay::Faulted(store, acked) = replay(w, &disk, &what) else {
            panic!("{what}: the crash did not hit the workload");
        };
        assert!(disk.has_crashed());
        drop(store);
        if check_recovery(w, disk.durable_image(), acked, &what) {
            in_flight_survived += 1;
        }
        checked += 1;
        n += stride;
    }
    // And a power cut after the last operation: all of them must be there.
    let plan = FaultPlan {
        torn_writes,
        seed: w.seed,
        ..FaultPlan::default()
    };
    let disk = SimDisk::new(plan);
    let what = "power cut after the workload";
    let Replay::Finished(store) = replay(w, &disk, what) else {
        panic!("{what}: a fault-free replay failed");
    };
    disk.crash_now();
    drop(store);
    check_recovery(w, disk.durable_image(), w.ops.len(), what);
    checked += 1;
    (checked, in_flight_survived)
}

fn run_crashes(seed: u64, stride: u64, torn_writes: bool) {
    let t0 = Instant::now();
    let w = reference(seed);
    let (checked, in_flight) = crash_everywhere(&w, stride, torn_writes);
    eprintln!(
        "crash seed {seed:#x}: {checked} crash points checked (every {stride}th disk call{}; \
         the operation in flight survived at {in_flight}) in {:.1?}",
        if torn_writes { ", torn writes" } else { "" },
        t0.elapsed()
    );
    assert!(checked >= 100, "only {checked} crash points");
}

#[test]
fn crash_at_every_disk_call_pinned_seed() {
    run_crashes(PINNED_SEED, 1, false);
}

#[test]
fn crash_at_every_disk_call_random_seed() {
    let seed = seed_from_env();
    eprintln!("SANFS_CRASH_SEED={seed:#x}");
    run_crashes(seed, 2, false);
}

#[test]
fn crash_with_torn_writes() {
    let seed = seed_from_env();
    eprintln!("SANFS_CRASH_SEED={seed:#x}");
    run_crashes(seed, 3, true);
}

/// A failed sync stops the store (fail-stop): the operation and every later one answer EIO.
/// Then either the power goes (a random subset of the unsynced writes survives) or the
/// process exits and the writes reach the disk later after all: either way a restart shows
/// `D_a` or `D_{a+1}`.
#[test]
fn failed_sync_stops_the_store() {
    let t0 = Instant::now();
    let seed = seed_from_env();
    eprintln!("SANFS_CRASH_SEED={seed:#x}");
    let w = reference(seed);
    let mut checked = 0;
    let mut in_flight = 0;
    for k in w.format_syncs + 1..=w.total_syncs {
        let plan = FaultPlan {
            crash_at_op: None,
            torn_writes: true,
            fail_sync: Some(k),
            seed: seed ^ k,
        };
        let power_cut = k % 2 == 1;
        let what = format!(
            "sync {k} fails, then {}",
            if power_cut {
                "power cut"
            } else {
                "exit and late writeback"
            }
        );
        let disk = SimDisk::new(plan);
        let (store, acked) = match replay(&w, &disk, &what) {
            Replay::Faulted(store, acked) => (store, acked),
            Replay::InFormat | Replay::Finished(_) => {
                panic!("{what}: the failed sync went unnoticed")
            }
        };
        assert!(
            store.poisoned(),
            "{what}: a failed sync must poison the store"
        );
        let later = store.write_blocking(|ctx| {
            let r = MkdirRequest {
                cred: cred(),
                parent: InodeId(ROOT),
                name: name("later"),
                perm: 0o755,
                delegate: false,
            };
            ns::mkdir(ctx, &r)
        });
        assert!(
            matches!(later, Err(FsError::Io(_))),
            "{what}: a write after a failed sync: {later:?}"
        );
        assert!(
            store.read(|t| t.getattr(4096, InodeId(ROOT))).is_err(),
            "{what}: a read after a failed sync"
        );
        if power_cut {
            disk.crash_now();
            drop(store);
        } else {
            drop(store);
            disk.sync_data().unwrap();
            disk.crash_now();
        }
        if check_recovery(&w, disk.durable_image(), acked, &what) {
            in_flight += 1;
        }
        checked += 1;
    }
    eprintln!(
        "crash seed {seed:#x}: {checked} failed syncs checked (the operation in flight \
         survived at {in_flight}) in {:.1?}",
        t0.elapsed()
    );
    assert!(checked > 50, "only {checked} syncs in the workload");
}
