//! `sanfs-bench exercise`: the model-based random-operation exerciser (issue 6).
//!
//! It mounts one file system twice (two `sanfs-agent mount` processes: two agents, two
//! sessions, each in a network namespace of its own when run as root), or takes two mount
//! points of an existing cluster (`--mounts A B`), and runs a seeded stream of random
//! operations on a few files, each through a randomly chosen mount: open (sometimes with
//! `O_CREAT`, `O_EXCL`, `O_TRUNC`, `O_APPEND`), pread/pwrite of 1 B to 4 MiB at aligned and
//! unaligned offsets (so the direct path, the proxied path and the unaligned edges all run),
//! truncate up and down, fallocate (default, `KEEP_SIZE`, `PUNCH_HOLE`, `ZERO_RANGE`), rename
//! (also over an existing file), unlink and recreate, fsync, stat and fstat, close, and
//! shared mappings inside the file (stores then `msync`, and loads; after an `fstat`). An
//! in-memory model holds every file's bytes and size (and the files still open after their
//! last name went). Every read, stat and error is checked against the model; the first
//! mismatch stops the run with the seed, the op index, the last operations and the differing
//! byte range.
//!
//! The mounts use `attr_ttl=0,entry_ttl=0` (strict): with the default 1 s attribute TTL the
//! kernel may answer a `stat` (or clamp a read) from a size cached before the other mount
//! changed the file, and a name lookup may be answered from a cached dentry after the other
//! mount renamed or unlinked it. Those are the documented, allowed staleness of cached
//! attributes, not data incoherence, and the model would flag them; strict TTLs make every
//! `stat` and lookup ask the server, so the model's single order of operations is what both
//! mounts must see. A third of the handles, and every read by name, are opened for reading
//! only: read through the kernel's page cache, checked against the same model.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fmt::Write as _;
use std::fs::{File, OpenOptions};
use std::io::ErrorKind;
use std::net::SocketAddr;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use rustix::fs::FallocateFlags;
use sanfs_mds::clock::Clock;
use sanfs_mds::store::Backend;
use sanfs_testcluster::{ChildGuard, LunKind, Luns, Network, mds};

use crate::cluster::is_mounted;
use crate::util::{KIB, MIB, sibling_binary};

/// Where the two mounts' agents live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum NetMode {
    /// Network namespaces when root, the host's loopback otherwise.
    #[default]
    Auto,
    /// A network namespace per agent (and one for the server); needs root.
    Netns,
    /// Everything on the host's loopback.
    Loopback,
}

/// What to run.
#[derive(Debug, Clone)]
pub struct ExerciseParams {
    pub seed: u64,
    pub ops: u64,
    /// How many file names the operations use.
    pub files: usize,
    /// No write, truncate or fallocate makes a file larger than this.
    pub max_file_size: u64,
    /// Two existing mount points of the same file system (else the exerciser builds its own
    /// cluster and mounts it twice).
    pub mounts: Option<[PathBuf; 2]>,
    pub net: NetMode,
    /// Where the own cluster's LUN files and mount points go (not tmpfs: O_DIRECT).
    pub dir: PathBuf,
    /// How many operations the failure report shows.
    pub tail: usize,
    /// Progress lines on stderr every 10%.
    pub progress: bool,
    /// Ends the run early (between two operations) once set: `sanfs-bench failover` runs
    /// the exerciser until its rounds are done.
    pub stop: Option<std::sync::Arc<std::sync::atomic::AtomicBool>>,
}

/// How a run ended.
#[derive(Debug)]
pub struct Outcome {
    pub ops_done: u64,
    pub elapsed: Duration,
    /// The first mismatch, as a readable report (None: the run matched the model).
    pub mismatch: Option<String>,
    /// Operations run, by kind.
    pub counts: BTreeMap<&'static str, u64>,
    /// Time spent in each kind of operation (the mounts' side and the model's).
    pub times: BTreeMap<&'static str, Duration>,
    pub bytes_written: u64,
    pub bytes_read: u64,
    /// Whether the agents ran in network namespaces of their own.
    pub isolated: bool,
}

/// Refuses a `--mounts` directory that is not on a sanfs mount served by an agent here.
fn check_sanfs_mount(path: &Path) -> anyhow::Result<()> {
    use sanfs_client_agent::control;
    let (entry, _) = control::mount_of(path)?;
    let served = control::sanfs_mounts()?
        .iter()
        .any(|m| (m.major, m.minor) == (entry.major, entry.minor));
    if !served {
        bail!(
            "{} is on the FUSE mount {} of another file system (no sanfs agent's control socket for it)",
            path.display(),
            entry.mount_point.display()
        );
    }
    Ok(())
}

/// Builds (or takes) the two mounts and runs the exerciser on them.
pub fn run(params: &ExerciseParams) -> anyhow::Result<Outcome> {
    match &params.mounts {
        Some([a, b]) => {
            // Mismatches found on another file system would say nothing about sanfs, and
            // none found would say less.
            for m in [a, b] {
                check_sanfs_mount(m)?;
            }
            let mounts = [a.clone(), b.clone()];
            exercise(params, &mounts, false)
        }
        None => {
            let cluster = OwnCluster::start(params)?;
            let mounts = [
                cluster.mounts[0].path.clone(),
                cluster.mounts[1].path.clone(),
            ];
            let isolated = cluster.net.is_isolated();
            let outcome = exercise(params, &mounts, isolated);
            let failed = !matches!(&outcome, Ok(o) if o.mismatch.is_none());
            for (i, m) in cluster.mounts.iter().enumerate() {
                if failed {
                    // The agents' logs outlive the cluster when the run failed.
                    let keep = params
                        .dir
                        .join(format!("sanfs-exercise-{}-agent{i}.log", params.seed));
                    if std::fs::copy(&m.log, &keep).is_ok() {
                        eprintln!("exercise: agent {i}'s log kept in {}", keep.display());
                    }
                }
                if !is_mounted(&m.path) {
                    eprintln!(
                        "exercise: the mount {} is gone; agent log {}:\n{}",
                        m.path.display(),
                        m.log.display(),
                        std::fs::read_to_string(&m.log).unwrap_or_default()
                    );
                }
            }
            outcome
        }
    }
}

// ------------------------------------------------------------------------------------------
// The own cluster: LUNs, the server in its namespace, two agents in theirs.

struct AgentMount {
    path: PathBuf,
    log: PathBuf,
    child: ChildGuard,
}

impl Drop for AgentMount {
    fn drop(&mut self) {
        if is_mounted(&self.path) {
            let _ = rustix::mount::unmount(&self.path, rustix::mount::UnmountFlags::empty())
                .or_else(|_| {
                    rustix::mount::unmount(&self.path, rustix::mount::UnmountFlags::DETACH)
                });
        }
        let _ = self.child.terminate(Duration::from_secs(10));
    }
}

/// Dropped in field order: mounts, server, LUNs, network, directories.
struct OwnCluster {
    mounts: Vec<AgentMount>,
    _server: mds::ServeThread,
    _luns: Luns,
    net: Network,
    _store_dir: tempfile::TempDir,
    _dir: tempfile::TempDir,
}

impl OwnCluster {
    fn start(params: &ExerciseParams) -> anyhow::Result<OwnCluster> {
        let agent = sibling_binary("sanfs-agent").context(
            "sanfs-agent not found beside sanfs-bench or on PATH (build it: cargo build -p sanfs-client-agent)",
        )?;
        std::fs::create_dir_all(&params.dir)
            .with_context(|| format!("create {}", params.dir.display()))?;
        let dir = tempfile::Builder::new()
            .prefix("sanfs-exercise-")
            .tempdir_in(&params.dir)
            .with_context(|| format!("make a directory in {}", params.dir.display()))?;
        let net = match params.net {
            NetMode::Auto => Network::create(2)?,
            NetMode::Netns => Network::isolated(2)?,
            NetMode::Loopback => Network::loopback(2),
        };
        // Room for every file at its largest, with preallocation and fragmentation to spare.
        let lun_size = (params.max_file_size * params.files as u64 * 2 / 4 + 64 * MIB)
            .next_multiple_of(MIB)
            .max(128 * MIB);
        let luns = Luns::create(dir.path(), 4, lun_size, LunKind::Auto)?;
        let volume = mds::striped(luns.paths(), 4096, 64 * KIB);
        // The metadata store on tmpfs where there is one: every metadata change is a durable
        // commit, and on a disk each costs milliseconds the exerciser does not test.
        let store_dir = tempfile::Builder::new()
            .prefix("sanfs-exercise-mds-")
            .tempdir_in("/dev/shm")
            .or_else(|_| {
                tempfile::Builder::new()
                    .prefix("mds-")
                    .tempdir_in(dir.path())
            })
            .context("make the metadata store's directory")?;
        let store_path = store_dir.path().join("mds.redb");
        crate::cluster::format_into_store(&volume, &store_path)?;
        let backend = Backend::File(store_path);
        // Plaintext on the exerciser's own private bridge.
        let mut opts = mds::serve_options(
            SocketAddr::new(net.server_ip(), 0),
            backend,
            luns.paths().to_vec(),
        );
        opts.batch_max = 256;
        let server =
            mds::ServeThread::start(Some(net.server()), "exercise-mds", 2, opts, Clock::System)?;
        let addr = server.addr;
        let run_dir = dir.path().join("run");
        std::fs::create_dir(&run_dir).context("make the control socket directory")?;
        let globs: Vec<String> = luns
            .paths()
            .iter()
            .map(|p| p.to_string_lossy().into_owned())
            .collect();
        let mut mounts = Vec::new();
        for i in 0..2 {
            let path = dir.path().join(format!("mnt{i}"));
            std::fs::create_dir(&path).context("make a mount point")?;
            let log = dir.path().join(format!("agent{i}.log"));
            let child = ChildGuard::spawn(
                net.node(i)
                    .command(&agent)
                    .arg("mount")
                    .arg(addr.to_string())
                    .arg(&path)
                    .arg("-o")
                    .arg(format!(
                        "devices={},client_name=exercise-{i},attr_ttl=0,entry_ttl=0",
                        globs.join(":")
                    ))
                    .arg("--foreground")
                    .env("SANFS_RUN_DIR", &run_dir)
                    .env(
                        "RUST_LOG",
                        std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".to_owned()),
                    )
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(File::create(&log).context("create the agent log")?),
            )?;
            let mut m = AgentMount { path, log, child };
            let deadline = Instant::now() + Duration::from_secs(60);
            while !is_mounted(&m.path) {
                if let Some(status) = m.child.try_wait()? {
                    bail!(
                        "sanfs-agent mount exited with {status}:\n{}",
                        std::fs::read_to_string(&m.log).unwrap_or_default()
                    );
                }
                if Instant::now() >= deadline {
                    bail!("sanfs-agent did not mount {} in 60 s", m.path.display());
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            mounts.push(m);
        }
        eprintln!(
            "exercise: server {addr}, two agents ({}), 4 striped LUNs of {} MiB ({})",
            if net.is_isolated() {
                "network namespaces"
            } else {
                "loopback"
            },
            lun_size / MIB,
            if luns.is_loop() {
                "loop devices"
            } else {
                "plain files"
            }
        );
        Ok(OwnCluster {
            mounts,
            _server: server,
            _luns: luns,
            net,
            _store_dir: store_dir,
            _dir: dir,
        })
    }
}

// ------------------------------------------------------------------------------------------
// The random stream.

/// SplitMix64: small, fast and the same everywhere, so a seed replays exactly.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n` > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }

    pub fn chance(&mut self, num: u64, den: u64) -> bool {
        self.below(den) < num
    }

    /// Log-uniform in `1..=max`: small and large sizes equally often per octave.
    pub fn log_size(&mut self, max: u64) -> u64 {
        let bits = 64 - max.max(1).leading_zeros() as u64;
        let b = self.below(bits) + 1;
        let hi = (1u64 << b).min(max + 1);
        let lo = 1u64 << (b - 1);
        (lo + self.below(hi - lo)).min(max)
    }
}

/// The bytes a write puts down: a function of the seed and the op index only.
fn write_data(seed: u64, op: u64, len: usize) -> Vec<u8> {
    let mut r = Rng::new(seed ^ op.wrapping_mul(0x2545_f491_4f6c_dd1d) ^ 0x5eed);
    let mut v = Vec::with_capacity(len + 8);
    while v.len() < len {
        v.extend_from_slice(&r.next_u64().to_le_bytes());
    }
    v.truncate(len);
    v
}

// ------------------------------------------------------------------------------------------
// The model.

type Ino = u64;

#[derive(Default)]
struct Model {
    /// Name slot -> inode.
    names: BTreeMap<usize, Ino>,
    /// Inode -> its bytes (the size is the length).
    inodes: HashMap<Ino, Vec<u8>>,
    /// Inode -> its mode and mtime, where an `Attrs` operation set them and nothing changed
    /// them since (a change of the data sets the mtime to a time the model does not know).
    attrs: HashMap<Ino, KnownAttrs>,
    next_ino: Ino,
}

#[derive(Debug, Default, Clone, Copy)]
struct KnownAttrs {
    mode: Option<u32>,
    mtime: Option<i64>,
}

struct Handle {
    /// Its number in the log (stable while it is open).
    id: u64,
    mount: usize,
    file: File,
    ino: Ino,
    append: bool,
    /// Opened `O_RDONLY` (on sanfs: through the kernel's page cache); never written through.
    read_only: bool,
    /// The name it was opened by (for the log).
    slot: usize,
}

impl Model {
    fn create(&mut self, slot: usize) -> Ino {
        self.next_ino += 1;
        let ino = self.next_ino;
        self.inodes.insert(ino, Vec::new());
        self.names.insert(slot, ino);
        ino
    }

    /// Drops inodes that have no name and no open handle.
    fn collect(&mut self, handles: &[Handle]) {
        let names = &self.names;
        self.inodes.retain(|ino, _| {
            names.values().any(|n| n == ino) || handles.iter().any(|h| h.ino == *ino)
        });
        let inodes = &self.inodes;
        self.attrs.retain(|ino, _| inodes.contains_key(ino));
    }

    /// The data of `ino` changed: its mtime is the time of the change.
    fn data_changed(&mut self, ino: Ino) {
        if let Some(a) = self.attrs.get_mut(&ino) {
            a.mtime = None;
        }
    }

    /// What the model knows of the mode and mtime of `ino` against a `stat` of it.
    fn check_attrs(&self, ino: Ino, md: &std::fs::Metadata) -> Result<(), Mismatch> {
        use std::os::unix::fs::MetadataExt;
        let known = self.attrs.get(&ino).copied().unwrap_or_default();
        if let Some(mode) = known.mode
            && md.mode() & 0o7777 != mode
        {
            return Err(Mismatch(format!(
                "mode {:o} but the model has {mode:o}",
                md.mode() & 0o7777
            )));
        }
        if let Some(sec) = known.mtime
            && (md.mtime(), md.mtime_nsec()) != (sec, 0)
        {
            return Err(Mismatch(format!(
                "mtime {}.{:09} but the model has {sec}",
                md.mtime(),
                md.mtime_nsec()
            )));
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Copy)]
enum FallocMode {
    Default,
    KeepSize,
    PunchHole,
    ZeroRange,
    ZeroRangeKeepSize,
}

impl FallocMode {
    fn flags(self) -> FallocateFlags {
        match self {
            FallocMode::Default => FallocateFlags::empty(),
            FallocMode::KeepSize => FallocateFlags::KEEP_SIZE,
            FallocMode::PunchHole => FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE,
            FallocMode::ZeroRange => FallocateFlags::ZERO_RANGE,
            FallocMode::ZeroRangeKeepSize => FallocateFlags::ZERO_RANGE | FallocateFlags::KEEP_SIZE,
        }
    }

    /// What the model's bytes become.
    fn apply(self, data: &mut Vec<u8>, off: u64, len: u64) {
        let end = (off + len) as usize;
        let size = data.len();
        match self {
            FallocMode::KeepSize => {}
            FallocMode::Default => {
                if end > size {
                    data.resize(end, 0);
                }
            }
            FallocMode::PunchHole | FallocMode::ZeroRangeKeepSize => {
                let s = (off as usize).min(size);
                let e = end.min(size);
                data[s..e].fill(0);
            }
            FallocMode::ZeroRange => {
                if end > size {
                    data.resize(end, 0);
                }
                data[off as usize..end].fill(0);
            }
        }
    }
}

/// Through which file an operation goes.
#[derive(Debug, Clone, Copy)]
enum Via {
    /// An open handle (index into the handle table).
    Handle(usize),
    /// Open the name on this mount for this operation only.
    Path(usize, usize),
}

#[derive(Debug, Clone)]
enum Op {
    Open {
        mount: usize,
        slot: usize,
        creat: bool,
        excl: bool,
        trunc: bool,
        append: bool,
        read_only: bool,
    },
    Close(usize),
    Write {
        via: Via,
        off: u64,
        len: u64,
    },
    Read {
        via: Via,
        off: u64,
        len: u64,
    },
    /// Stores into a shared mapping of `[off, off + len)` (inside the file), then `msync`.
    MapWrite {
        via: Via,
        off: u64,
        len: u64,
    },
    /// Loads from a shared mapping of `[off, off + len)` (inside the file).
    MapRead {
        via: Via,
        off: u64,
        len: u64,
    },
    Truncate {
        via: Via,
        size: u64,
    },
    Fallocate {
        via: Via,
        mode: FallocMode,
        off: u64,
        len: u64,
    },
    Rename {
        mount: usize,
        from: usize,
        to: usize,
    },
    Unlink {
        mount: usize,
        slot: usize,
    },
    Fsync(usize),
    Stat {
        mount: usize,
        slot: usize,
    },
    Fstat(usize),
    /// On the file of `via`, in this order: `fchown` to its owners (root's), `fchmod`,
    /// `futimens` of the mtime (explicit seconds), as `tar x` and `cp -p` do.
    Attrs {
        via: Via,
        chown: bool,
        mode: Option<u32>,
        mtime: Option<i64>,
    },
}

impl Op {
    fn kind(&self) -> &'static str {
        match self {
            Op::Open { .. } => "open",
            Op::Close(_) => "close",
            Op::Write { .. } => "write",
            Op::Read { .. } => "read",
            Op::MapWrite { .. } => "mmap write",
            Op::MapRead { .. } => "mmap read",
            Op::Truncate { .. } => "truncate",
            Op::Fallocate { .. } => "fallocate",
            Op::Rename { .. } => "rename",
            Op::Unlink { .. } => "unlink",
            Op::Fsync(_) => "fsync",
            Op::Stat { .. } => "stat",
            Op::Fstat(_) => "fstat",
            Op::Attrs { .. } => "attrs",
        }
    }
}

/// Run state: the model, the real handles, the log.
struct Exerciser<'a> {
    seed: u64,
    mounts: [PathBuf; 2],
    params: &'a ExerciseParams,
    rng: Rng,
    model: Model,
    handles: Vec<Handle>,
    next_handle: u64,
    log: VecDeque<String>,
    counts: BTreeMap<&'static str, u64>,
    times: BTreeMap<&'static str, Duration>,
    bytes_written: u64,
    bytes_read: u64,
}

const MAX_HANDLES: usize = 6;
const MAX_IO: u64 = 4 * MIB;

/// A failed check: the report's body.
struct Mismatch(String);

impl<'a> Exerciser<'a> {
    fn path(&self, mount: usize, slot: usize) -> PathBuf {
        self.mounts[mount].join(format!("f{slot}"))
    }

    fn handle_desc(&self, h: usize) -> String {
        let hd = &self.handles[h];
        format!(
            "h{}(m{} f{} ino#{}{})",
            hd.id,
            hd.mount,
            hd.slot,
            hd.ino,
            if hd.append { " append" } else { "" }
        )
    }

    fn via_desc(&self, via: Via) -> String {
        match via {
            Via::Handle(h) => self.handle_desc(h),
            Via::Path(m, s) => match self.model.names.get(&s) {
                Some(ino) => format!("m{m}:f{s}(ino#{ino})"),
                None => format!("m{m}:f{s}"),
            },
        }
    }

    /// After a read that did not match: the same range read again through each mount by
    /// name, buffered and with `O_DIRECT` (past the kernel's page cache), each said to match
    /// the model or not. Tells a stale cache on one node from bytes lost at the server.
    #[allow(
        clippy::disallowed_methods,
        reason = "a file on the mount read with O_DIRECT, as an application would"
    )]
    fn second_look(&self, op: &Op) -> String {
        use std::os::unix::fs::OpenOptionsExt;
        let Op::Read { via, off, len } = *op else {
            return String::new();
        };
        let slot = match via {
            Via::Handle(h) => self.handles[h].slot,
            Via::Path(_, s) => s,
        };
        let Some(want) = self
            .model
            .names
            .get(&slot)
            .and_then(|ino| self.model.inodes.get(ino))
        else {
            return String::new();
        };
        let range = |b: &[u8]| {
            let start = (off as usize).min(b.len());
            let end = (off.saturating_add(len) as usize).min(b.len());
            b[start..end].to_vec()
        };
        let want = range(want);
        let mut out = String::from("\nsecond look (by name, the same range):");
        for mount in 0..self.mounts.len() {
            for (how, flags) in [("buffered", 0), ("O_DIRECT", libc::O_DIRECT)] {
                let got = std::fs::OpenOptions::new()
                    .read(true)
                    .custom_flags(flags)
                    .open(self.path(mount, slot))
                    .and_then(|f| {
                        let mut buf = vec![0u8; len as usize];
                        let mut done = 0;
                        while done < buf.len() {
                            let n = f.read_at(&mut buf[done..], off + done as u64)?;
                            if n == 0 {
                                break;
                            }
                            done += n;
                        }
                        buf.truncate(done);
                        Ok(buf)
                    });
                let verdict = match got {
                    Ok(b) if b == want => "the model's bytes".to_owned(),
                    Ok(b) => format!("other bytes ({} read)", b.len()),
                    Err(e) => format!("error {e}"),
                };
                let _ = write!(out, "\n  m{mount} {how}: {verdict}");
            }
        }
        out
    }

    fn describe(&self, op: &Op) -> String {
        match op {
            Op::Open {
                mount,
                slot,
                creat,
                excl,
                trunc,
                append,
                read_only,
            } => {
                let mut f = String::from(if *read_only { "O_RDONLY" } else { "O_RDWR" });
                for (on, name) in [
                    (*creat, "|O_CREAT"),
                    (*excl, "|O_EXCL"),
                    (*trunc, "|O_TRUNC"),
                    (*append, "|O_APPEND"),
                ] {
                    if on {
                        f.push_str(name);
                    }
                }
                format!("open m{mount}:f{slot} {f}")
            }
            Op::Close(h) => format!("close {}", self.handle_desc(*h)),
            Op::Write { via, off, len } => {
                format!("pwrite {} off={off} len={len}", self.via_desc(*via))
            }
            Op::Read { via, off, len } => {
                format!("pread {} off={off} len={len}", self.via_desc(*via))
            }
            Op::MapWrite { via, off, len } => {
                format!(
                    "mmap write+msync {} off={off} len={len}",
                    self.via_desc(*via)
                )
            }
            Op::MapRead { via, off, len } => {
                format!("mmap read {} off={off} len={len}", self.via_desc(*via))
            }
            Op::Truncate { via, size } => format!("truncate {} size={size}", self.via_desc(*via)),
            Op::Fallocate {
                via,
                mode,
                off,
                len,
            } => {
                format!(
                    "fallocate {} {mode:?} off={off} len={len}",
                    self.via_desc(*via)
                )
            }
            Op::Rename { mount, from, to } => format!("rename m{mount}:f{from} -> f{to}"),
            Op::Unlink { mount, slot } => format!("unlink m{mount}:f{slot}"),
            Op::Fsync(h) => format!("fsync {}", self.handle_desc(*h)),
            Op::Stat { mount, slot } => format!("stat m{mount}:f{slot}"),
            Op::Fstat(h) => format!("fstat {}", self.handle_desc(*h)),
            Op::Attrs {
                via,
                chown,
                mode,
                mtime,
            } => format!(
                "attrs {} chown={chown} mode={} mtime={mtime:?}",
                self.via_desc(*via),
                mode.map_or("-".to_owned(), |m| format!("{m:o}"))
            ),
        }
    }

    fn existing_slot(&mut self) -> Option<usize> {
        if self.model.names.is_empty() {
            return None;
        }
        let keys: Vec<usize> = self.model.names.keys().copied().collect();
        Some(keys[self.rng.below(keys.len() as u64) as usize])
    }

    /// An offset: at the start, at EOF, inside the file, or anywhere below `limit`; aligned to
    /// 64 KiB, to 4 KiB, or not at all.
    fn offset(&mut self, size: u64, limit: u64) -> u64 {
        let raw = match self.rng.below(5) {
            0 => 0,
            1 => size,
            2 | 3 => self.rng.below(size + 1),
            _ => self.rng.below(limit + 1),
        };
        self.align(raw, false)
    }

    fn align(&mut self, v: u64, up: bool) -> u64 {
        let unit = match self.rng.below(3) {
            0 => 64 * KIB,
            1 => 4 * KIB,
            _ => 1,
        };
        if up {
            v.next_multiple_of(unit).max(unit)
        } else {
            v / unit * unit
        }
    }

    /// A range inside a file of `size` bytes (`None` for an empty file).
    fn inside(&mut self, size: u64) -> Option<(u64, u64)> {
        if size == 0 {
            return None;
        }
        let raw = self.rng.below(size);
        let off = self.align(raw, false);
        let len = self.length().min(size - off).max(1);
        Some((off, len))
    }

    fn length(&mut self) -> u64 {
        let l = self.rng.log_size(MAX_IO);
        self.align(l, true).min(MAX_IO)
    }

    /// A target for a data operation: a handle (one open for writing when the operation
    /// writes) or a name.
    fn via(&mut self, write: bool) -> Option<Via> {
        let usable: Vec<usize> = (0..self.handles.len())
            .filter(|&h| !write || !self.handles[h].read_only)
            .collect();
        if !usable.is_empty() && self.rng.chance(2, 3) {
            return Some(Via::Handle(
                usable[self.rng.below(usable.len() as u64) as usize],
            ));
        }
        let slot = self.existing_slot()?;
        Some(Via::Path(self.rng.below(2) as usize, slot))
    }

    fn ino_of(&self, via: Via) -> Ino {
        match via {
            Via::Handle(h) => self.handles[h].ino,
            Via::Path(_, s) => self.model.names[&s],
        }
    }

    /// The model's bytes of the file of `via`.
    fn model_bytes(&mut self, via: Via) -> &mut Vec<u8> {
        let ino = self.ino_of(via);
        self.model
            .inodes
            .get_mut(&ino)
            .expect("inode of a live name")
    }

    fn size_of(&self, via: Via) -> u64 {
        self.model.inodes[&self.ino_of(via)].len() as u64
    }

    fn generate(&mut self) -> Op {
        let files = self.params.files;
        let max = self.params.max_file_size;
        loop {
            let pick = self.rng.below(100);
            let op = match pick {
                0..=7 => {
                    let slot = self.rng.below(files as u64) as usize;
                    let exists = self.model.names.contains_key(&slot);
                    let creat = !exists || self.rng.chance(1, 2);
                    // A third for reading only (a reader's open: the page cache on sanfs).
                    let read_only = self.rng.chance(1, 3);
                    Some(Op::Open {
                        mount: self.rng.below(2) as usize,
                        slot,
                        creat,
                        excl: creat && self.rng.chance(1, 5),
                        trunc: !read_only && self.rng.chance(1, 8),
                        append: !read_only && self.rng.chance(1, 5),
                        read_only,
                    })
                }
                8..=11 => (!self.handles.is_empty())
                    .then(|| Op::Close(self.rng.below(self.handles.len() as u64) as usize)),
                12..=32 => self.via(true).map(|via| {
                    let size = self.size_of(via);
                    let off = self.offset(size, max).min(max - 1);
                    let len = self.length().min(max - off).max(1);
                    Op::Write { via, off, len }
                }),
                // A mapping inside the file (past its end a load or store faults).
                33..=36 => self.via(true).and_then(|via| {
                    let (off, len) = self.inside(self.size_of(via))?;
                    Some(Op::MapWrite { via, off, len })
                }),
                37..=57 => self.via(false).map(|via| {
                    let size = self.size_of(via);
                    let off = self.offset(size, max + 64 * KIB);
                    let len = self.length();
                    Op::Read { via, off, len }
                }),
                58..=61 => self.via(false).and_then(|via| {
                    let (off, len) = self.inside(self.size_of(via))?;
                    Some(Op::MapRead { via, off, len })
                }),
                62..=67 => self.via(true).map(|via| {
                    let size = self.size_of(via);
                    let new = match self.rng.below(4) {
                        0 => 0,
                        1 => self.rng.below(size + 1),
                        _ => self.rng.below(max + 1),
                    };
                    let size = self.align(new, false);
                    Op::Truncate { via, size }
                }),
                68..=75 => self.via(true).map(|via| {
                    let size = self.size_of(via);
                    let mode = match self.rng.below(5) {
                        0 => FallocMode::Default,
                        1 => FallocMode::KeepSize,
                        2 => FallocMode::PunchHole,
                        3 => FallocMode::ZeroRange,
                        _ => FallocMode::ZeroRangeKeepSize,
                    };
                    let off = self.offset(size, max).min(max - 1);
                    let len = self.length().min(max - off).max(1);
                    Op::Fallocate {
                        via,
                        mode,
                        off,
                        len,
                    }
                }),
                76..=79 => self.existing_slot().map(|from| {
                    let mut to = self.rng.below(files as u64) as usize;
                    if to == from {
                        to = (to + 1) % files;
                    }
                    Op::Rename {
                        mount: self.rng.below(2) as usize,
                        from,
                        to,
                    }
                }),
                80..=82 => self.existing_slot().map(|slot| Op::Unlink {
                    mount: self.rng.below(2) as usize,
                    slot,
                }),
                83..=86 => (!self.handles.is_empty())
                    .then(|| Op::Fsync(self.rng.below(self.handles.len() as u64) as usize)),
                87..=90 => Some(Op::Stat {
                    mount: self.rng.below(2) as usize,
                    slot: self.rng.below(files as u64) as usize,
                }),
                91..=94 => self.via(false).map(|via| {
                    let chown = self.rng.chance(1, 3);
                    let mtime = self
                        .rng
                        .chance(2, 3)
                        .then(|| 1_000_000_000 + self.rng.below(1 << 20) as i64);
                    let modes = [0o600, 0o640, 0o644, 0o755];
                    let mode = (self.rng.chance(2, 3) || (!chown && mtime.is_none()))
                        .then(|| modes[self.rng.below(modes.len() as u64) as usize]);
                    Op::Attrs {
                        via,
                        chown,
                        mode,
                        mtime,
                    }
                }),
                _ => (!self.handles.is_empty())
                    .then(|| Op::Fstat(self.rng.below(self.handles.len() as u64) as usize)),
            };
            if let Some(op) = op {
                return op;
            }
        }
    }

    /// Opens the name of a `Via::Path` for one operation: for reading only when it only
    /// reads, as a reader (`cat`, `cp`) would.
    fn open_path(&self, mount: usize, slot: usize, write: bool) -> std::io::Result<File> {
        OpenOptions::new()
            .read(true)
            .write(write)
            .open(self.path(mount, slot))
    }

    /// Runs `f` on the file of `via` (a name is opened for writing when `write`).
    fn with_file<T>(
        &self,
        via: Via,
        write: bool,
        f: impl FnOnce(&File) -> std::io::Result<T>,
    ) -> std::io::Result<T> {
        match via {
            Via::Handle(h) => f(&self.handles[h].file),
            Via::Path(m, s) => {
                let file = self.open_path(m, s, write)?;
                f(&file)
            }
        }
    }

    /// Runs one operation on the mounts and the model; returns what the log shows.
    fn apply(&mut self, index: u64, op: &Op) -> Result<String, Mismatch> {
        let unexpected = |what: &str, e: std::io::Error| {
            Mismatch(format!(
                "{what}: unexpected error {e} (the model expected success)"
            ))
        };
        match *op {
            Op::Open {
                mount,
                slot,
                creat,
                excl,
                trunc,
                append,
                read_only,
            } => {
                let exists = self.model.names.contains_key(&slot);
                let mut o = OpenOptions::new();
                o.read(true).write(!read_only);
                let mut flags = 0;
                if read_only {
                    // (std's create needs write access: the flags themselves.)
                    if creat {
                        flags |= libc::O_CREAT;
                    }
                    if creat && excl {
                        flags |= libc::O_EXCL;
                    }
                } else if creat && excl {
                    o.create_new(true);
                } else if creat {
                    o.create(true);
                }
                if trunc {
                    flags |= libc::O_TRUNC;
                }
                if append {
                    flags |= libc::O_APPEND;
                }
                #[allow(
                    clippy::disallowed_methods,
                    reason = "a file on the mount, opened as an application opens it: not a LUN"
                )]
                o.custom_flags(flags).mode(0o644);
                let result = o.open(self.path(mount, slot));
                let expect_err = if exists && creat && excl {
                    Some(ErrorKind::AlreadyExists)
                } else if !exists && !creat {
                    Some(ErrorKind::NotFound)
                } else {
                    None
                };
                match (result, expect_err) {
                    (Ok(file), None) => {
                        let ino = if exists {
                            self.model.names[&slot]
                        } else {
                            self.model.create(slot)
                        };
                        if trunc {
                            self.model.inodes.get_mut(&ino).map(Vec::clear);
                            self.model.data_changed(ino);
                        }
                        if self.handles.len() >= MAX_HANDLES {
                            self.handles.remove(0);
                        }
                        self.next_handle += 1;
                        self.handles.push(Handle {
                            id: self.next_handle,
                            mount,
                            file,
                            ino,
                            append,
                            read_only,
                            slot,
                        });
                        self.model.collect(&self.handles);
                        Ok(format!("ok h{} ino#{ino}", self.next_handle))
                    }
                    (Err(e), Some(kind)) if e.kind() == kind => Ok(format!("{kind:?} as expected")),
                    (Err(e), None) => Err(unexpected("open", e)),
                    (Ok(_), Some(kind)) => Err(Mismatch(format!(
                        "open succeeded; the model expected {kind:?}"
                    ))),
                    (Err(e), Some(kind)) => Err(Mismatch(format!(
                        "open failed with {e}; the model expected {kind:?}"
                    ))),
                }
            }
            Op::Close(h) => {
                self.handles.remove(h);
                self.model.collect(&self.handles);
                Ok("ok".into())
            }
            Op::Write { via, off, len } => {
                let data = write_data(self.seed, index, len as usize);
                let append = matches!(via, Via::Handle(h) if self.handles[h].append);
                self.with_file(via, true, |f| f.write_all_at(&data, off))
                    .map_err(|e| unexpected("pwrite", e))?;
                self.bytes_written += len;
                self.model.data_changed(self.ino_of(via));
                let buf = self.model_bytes(via);
                // pwrite on an O_APPEND file appends (Linux), whatever the offset.
                let at = if append { buf.len() } else { off as usize };
                let end = at + len as usize;
                if end > buf.len() {
                    buf.resize(end, 0);
                }
                buf[at..end].copy_from_slice(&data);
                Ok(format!("ok at {at}, size {}", buf.len()))
            }
            Op::Read { via, off, len } => {
                let mut got = vec![0u8; len as usize];
                let n = self
                    .with_file(via, false, |f| {
                        let mut done = 0usize;
                        // Bounded: every round reads at least one byte or stops.
                        while done < got.len() {
                            let r = f.read_at(&mut got[done..], off + done as u64)?;
                            if r == 0 {
                                break;
                            }
                            done += r;
                        }
                        Ok(done)
                    })
                    .map_err(|e| unexpected("pread", e))?;
                got.truncate(n);
                self.bytes_read += n as u64;
                let model = &self.model.inodes[&self.ino_of(via)];
                let start = (off as usize).min(model.len());
                let end = ((off + len) as usize).min(model.len());
                let want = &model[start..end];
                check_bytes(off, want, &got, model.len() as u64)?;
                Ok(format!("ok {n} bytes"))
            }
            Op::MapWrite { via, off, len } => {
                let data = write_data(self.seed, index, len as usize);
                self.with_file(via, true, |f| {
                    let mut map = SharedMap::new(f, off, len, true)?;
                    map.bytes_mut().copy_from_slice(&data);
                    map.sync()
                })
                .map_err(|e| unexpected("mmap write", e))?;
                self.bytes_written += len;
                self.model.data_changed(self.ino_of(via));
                let buf = self.model_bytes(via);
                buf[off as usize..(off + len) as usize].copy_from_slice(&data);
                Ok("ok".into())
            }
            Op::MapRead { via, off, len } => {
                let got = self
                    .with_file(via, false, |f| {
                        let map = SharedMap::new(f, off, len, false)?;
                        Ok(map.bytes().to_vec())
                    })
                    .map_err(|e| unexpected("mmap read", e))?;
                self.bytes_read += len;
                let model = &self.model.inodes[&self.ino_of(via)];
                let want = &model[off as usize..(off + len) as usize];
                check_bytes(off, want, &got, model.len() as u64)?;
                Ok(format!("ok {len} bytes"))
            }
            Op::Truncate { via, size } => {
                self.with_file(via, true, |f| f.set_len(size))
                    .map_err(|e| unexpected("truncate", e))?;
                self.model.data_changed(self.ino_of(via));
                let buf = self.model_bytes(via);
                buf.resize(size as usize, 0);
                Ok("ok".into())
            }
            Op::Fallocate {
                via,
                mode,
                off,
                len,
            } => {
                self.with_file(via, true, |f| {
                    rustix::fs::fallocate(f, mode.flags(), off, len).map_err(std::io::Error::from)
                })
                .map_err(|e| unexpected("fallocate", e))?;
                self.model.data_changed(self.ino_of(via));
                let buf = self.model_bytes(via);
                mode.apply(buf, off, len);
                Ok(format!("ok size {}", buf.len()))
            }
            Op::Rename { mount, from, to } => {
                std::fs::rename(self.path(mount, from), self.path(mount, to))
                    .map_err(|e| unexpected("rename", e))?;
                let ino = self.model.names.remove(&from).expect("a live name");
                self.model.names.insert(to, ino);
                self.model.collect(&self.handles);
                Ok("ok".into())
            }
            Op::Unlink { mount, slot } => {
                std::fs::remove_file(self.path(mount, slot))
                    .map_err(|e| unexpected("unlink", e))?;
                self.model.names.remove(&slot);
                self.model.collect(&self.handles);
                Ok("ok".into())
            }
            Op::Fsync(h) => {
                self.handles[h]
                    .file
                    .sync_all()
                    .map_err(|e| unexpected("fsync", e))?;
                Ok("ok".into())
            }
            Op::Stat { mount, slot } => {
                let got = std::fs::metadata(self.path(mount, slot));
                match (got, self.model.names.get(&slot)) {
                    (Ok(md), Some(ino)) => {
                        let want = self.model.inodes[ino].len() as u64;
                        if md.len() != want {
                            return Err(Mismatch(format!(
                                "stat size {} but the model has {want}",
                                md.len()
                            )));
                        }
                        self.model.check_attrs(*ino, &md)?;
                        Ok(format!("ok size {want}"))
                    }
                    (Err(e), None) if e.kind() == ErrorKind::NotFound => Ok("ENOENT".into()),
                    (Ok(md), None) => Err(Mismatch(format!(
                        "stat found a file of {} bytes; the model has no such name",
                        md.len()
                    ))),
                    (Err(e), Some(_)) => Err(unexpected("stat", e)),
                    (Err(e), None) => Err(Mismatch(format!(
                        "stat failed with {e}; the model expected ENOENT"
                    ))),
                }
            }
            Op::Fstat(h) => {
                let md = self.handles[h]
                    .file
                    .metadata()
                    .map_err(|e| unexpected("fstat", e))?;
                let want = self.model.inodes[&self.handles[h].ino].len() as u64;
                if md.len() != want {
                    return Err(Mismatch(format!(
                        "fstat size {} but the model has {want}",
                        md.len()
                    )));
                }
                self.model.check_attrs(self.handles[h].ino, &md)?;
                Ok(format!("ok size {want}"))
            }
            Op::Attrs {
                via,
                chown,
                mode,
                mtime,
            } => {
                use std::os::unix::fs::PermissionsExt;
                self.with_file(via, false, |f| {
                    if chown {
                        std::os::unix::fs::fchown(f, Some(0), Some(0))?;
                    }
                    if let Some(m) = mode {
                        f.set_permissions(std::fs::Permissions::from_mode(m))?;
                    }
                    if let Some(sec) = mtime {
                        let when = std::time::UNIX_EPOCH
                            + std::time::Duration::from_secs(sec.unsigned_abs());
                        f.set_times(std::fs::FileTimes::new().set_modified(when))?;
                    }
                    Ok(())
                })
                .map_err(|e| unexpected("attrs", e))?;
                let known = self.model.attrs.entry(self.ino_of(via)).or_default();
                known.mode = mode.or(known.mode);
                known.mtime = mtime.or(known.mtime);
                Ok("ok".into())
            }
        }
    }

    /// Reads every named file whole through both mounts and compares.
    fn final_check(&mut self) -> Result<(), Mismatch> {
        let names: Vec<(usize, Ino)> = self.model.names.iter().map(|(s, i)| (*s, *i)).collect();
        for (slot, ino) in names {
            for mount in 0..2 {
                let path = self.path(mount, slot);
                let got = std::fs::read(&path)
                    .map_err(|e| Mismatch(format!("final read of {}: {e}", path.display())))?;
                let want = &self.model.inodes[&ino];
                check_bytes(0, want, &got, want.len() as u64).map_err(|Mismatch(m)| {
                    Mismatch(format!("final read of m{mount}:f{slot}: {m}"))
                })?;
            }
        }
        Ok(())
    }
}

/// Compares a read's bytes with the model's; describes the first differing range.
/// A shared mapping of `[off, off + len)` of an open file (the mapping starts at the page
/// below `off`), unmapped on drop.
struct SharedMap {
    base: *mut libc::c_void,
    map_len: usize,
    at: usize,
    len: usize,
}

impl SharedMap {
    /// Maps the range after an `fstat`, as a program learns the size before it maps: the
    /// kernel faults at a page past the size it holds (SIGBUS), and the `fstat` gives it the
    /// size another node may have changed. A size short of the range is an error here.
    fn new(f: &File, off: u64, len: u64, write: bool) -> std::io::Result<SharedMap> {
        let size = f.metadata()?.len();
        if size < off + len {
            return Err(std::io::Error::other(format!(
                "fstat says {size} bytes: the mapping {off}+{len} would fault"
            )));
        }
        let page = 4096u64;
        let start = off / page * page;
        let at = usize::try_from(off - start).map_err(std::io::Error::other)?;
        let len = usize::try_from(len).map_err(std::io::Error::other)?;
        let map_len = at + len;
        let prot = if write {
            libc::PROT_READ | libc::PROT_WRITE
        } else {
            libc::PROT_READ
        };
        let start = libc::off_t::try_from(start).map_err(std::io::Error::other)?;
        // SAFETY: a fresh shared mapping of an open file (the fd lives through the call);
        // the result is checked, and the mapping is unmapped once, in `drop`.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                prot,
                libc::MAP_SHARED,
                std::os::fd::AsRawFd::as_raw_fd(f),
                start,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(SharedMap {
            base,
            map_len,
            at,
            len,
        })
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: `base` maps `map_len >= at + len` bytes for the life of `self`; the
        // exerciser keeps the range inside the file, so no page of it is past the end.
        unsafe { std::slice::from_raw_parts(self.base.cast::<u8>().add(self.at), self.len) }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `bytes`, mapped writable (`new` with `write`), borrowed mutably once.
        unsafe { std::slice::from_raw_parts_mut(self.base.cast::<u8>().add(self.at), self.len) }
    }

    /// `msync(MS_SYNC)`: the stores reach the file system before it returns.
    fn sync(&self) -> std::io::Result<()> {
        // SAFETY: the live mapping of `map_len` bytes at `base`.
        if unsafe { libc::msync(self.base, self.map_len, libc::MS_SYNC) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }
}

impl Drop for SharedMap {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, unmapped once.
        unsafe {
            libc::munmap(self.base, self.map_len);
        }
    }
}

fn check_bytes(off: u64, want: &[u8], got: &[u8], model_size: u64) -> Result<(), Mismatch> {
    let common = want.len().min(got.len());
    let first = (0..common).find(|&i| want[i] != got[i]);
    if first.is_none() && want.len() == got.len() {
        return Ok(());
    }
    let mut msg = String::new();
    if want.len() != got.len() {
        let _ = writeln!(
            msg,
            "read returned {} bytes at offset {off}; the model expects {} (model size {model_size})",
            got.len(),
            want.len()
        );
    }
    if let Some(first) = first {
        // The differing run: from the first differing byte to the last one before the next
        // 4 KiB of equal bytes.
        let mut last = first;
        let mut equal_run = 0usize;
        for i in first..common {
            if want[i] != got[i] {
                last = i;
                equal_run = 0;
            } else {
                equal_run += 1;
                if equal_run >= 4096 {
                    break;
                }
            }
        }
        let total = (first..common).filter(|&i| want[i] != got[i]).count();
        let show = |v: &[u8], i: usize| {
            v[i..(i + 16).min(v.len())]
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect::<String>()
        };
        let _ = writeln!(
            msg,
            "bytes differ in file range {}..{} ({} bytes; {total} differing bytes in the read; model size {model_size})",
            off + first as u64,
            off + last as u64 + 1,
            last - first + 1
        );
        let _ = writeln!(
            msg,
            "  expected at {}: {}",
            off + first as u64,
            show(want, first)
        );
        let _ = write!(
            msg,
            "  got      at {}: {}",
            off + first as u64,
            show(got, first)
        );
        if got[first..=last].iter().all(|&b| b == 0) {
            msg.push_str("  (zeros)");
        }
    }
    Err(Mismatch(msg))
}

/// Runs the operations on two mount points of one file system.
fn exercise(
    params: &ExerciseParams,
    mounts: &[PathBuf; 2],
    isolated: bool,
) -> anyhow::Result<Outcome> {
    if params.files == 0 || params.max_file_size == 0 {
        bail!("--files and --max-size must be at least 1");
    }
    // A directory of this run's own on the file system, seen through both mounts.
    let sub = format!("exercise-{}-{}", params.seed, std::process::id());
    std::fs::create_dir(mounts[0].join(&sub))
        .with_context(|| format!("make {} on {}", sub, mounts[0].display()))?;
    let dirs = [mounts[0].join(&sub), mounts[1].join(&sub)];
    let deadline = Instant::now() + Duration::from_secs(10);
    while !dirs[1].is_dir() {
        if Instant::now() >= deadline {
            bail!(
                "{} is not seen through {}: are the two mount points the same file system?",
                sub,
                mounts[1].display()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut ex = Exerciser {
        seed: params.seed,
        mounts: dirs.clone(),
        params,
        rng: Rng::new(params.seed),
        model: Model::default(),
        handles: Vec::new(),
        next_handle: 0,
        log: VecDeque::new(),
        counts: BTreeMap::new(),
        times: BTreeMap::new(),
        bytes_written: 0,
        bytes_read: 0,
    };
    let started = Instant::now();
    let mut mismatch = None;
    let mut done = 0;
    let step = (params.ops / 10).max(1);
    for index in 0..params.ops {
        if params
            .stop
            .as_ref()
            .is_some_and(|s| s.load(std::sync::atomic::Ordering::SeqCst))
        {
            break;
        }
        let op = ex.generate();
        let desc = ex.describe(&op);
        *ex.counts.entry(op.kind()).or_default() += 1;
        let t0 = Instant::now();
        let result = ex.apply(index, &op);
        *ex.times.entry(op.kind()).or_default() += t0.elapsed();
        let line = match &result {
            Ok(r) => format!("#{index} {desc} -> {r}"),
            Err(_) => format!("#{index} {desc} -> MISMATCH"),
        };
        ex.log.push_back(line);
        while ex.log.len() > params.tail.max(1) {
            ex.log.pop_front();
        }
        done = index + 1;
        if let Err(Mismatch(m)) = result {
            let m = m + &ex.second_look(&op);
            mismatch = Some(report(params.seed, index, &desc, &m, &ex.log));
            break;
        }
        if params.progress && done % step == 0 {
            eprintln!(
                "exercise: {done}/{} ops, {:.1} s",
                params.ops,
                started.elapsed().as_secs_f64()
            );
        }
    }
    if mismatch.is_none()
        && let Err(Mismatch(m)) = ex.final_check()
    {
        mismatch = Some(report(params.seed, done, "final check", &m, &ex.log));
    }
    let elapsed = started.elapsed();
    // Clean up this run's files (best effort; an existing cluster keeps nothing of ours).
    ex.handles.clear();
    if mismatch.is_none() {
        let _ = std::fs::remove_dir_all(&dirs[0]);
    }
    Ok(Outcome {
        ops_done: done,
        elapsed,
        mismatch,
        counts: ex.counts,
        times: ex.times,
        bytes_written: ex.bytes_written,
        bytes_read: ex.bytes_read,
        isolated,
    })
}

fn report(seed: u64, index: u64, desc: &str, what: &str, log: &VecDeque<String>) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "MISMATCH at op #{index} (seed {seed}): {desc}");
    let _ = writeln!(s, "{what}");
    let _ = writeln!(s, "last {} operations:", log.len());
    for l in log {
        let _ = writeln!(s, "  {l}");
    }
    let _ = write!(
        s,
        "replay: sanfs-bench exercise --seed {seed} --ops {}",
        index + 1
    );
    s
}

/// Parses `--mounts A B` (two paths) for the command line.
pub fn mounts_arg(v: &[PathBuf]) -> anyhow::Result<Option<[PathBuf; 2]>> {
    match v {
        [] => Ok(None),
        [a, b] => {
            for p in [a, b] {
                if !Path::new(p).is_dir() {
                    bail!("--mounts: {} is not a directory", p.display());
                }
            }
            Ok(Some([a.clone(), b.clone()]))
        }
        _ => bail!("--mounts takes exactly two mount points"),
    }
}

/// A random seed for a run that was given none (from the kernel's random pool).
pub fn random_seed() -> anyhow::Result<u64> {
    let mut b = [0u8; 8];
    rustix::rand::getrandom(&mut b, rustix::rand::GetRandomFlags::empty())
        .context("getrandom for a seed")?;
    Ok(u64::from_le_bytes(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_stream_is_a_function_of_the_seed() {
        let a: Vec<u64> = {
            let mut r = Rng::new(7);
            (0..8).map(|_| r.next_u64()).collect()
        };
        let b: Vec<u64> = {
            let mut r = Rng::new(7);
            (0..8).map(|_| r.next_u64()).collect()
        };
        assert_eq!(a, b);
        assert_eq!(write_data(7, 3, 100), write_data(7, 3, 100));
        assert_ne!(write_data(7, 3, 100), write_data(7, 4, 100));
    }

    #[test]
    fn log_sizes_stay_in_range_and_reach_both_ends() {
        let mut r = Rng::new(1);
        let v: Vec<u64> = (0..20_000).map(|_| r.log_size(MAX_IO)).collect();
        assert!(v.iter().all(|&x| (1..=MAX_IO).contains(&x)));
        assert!(v.iter().any(|&x| x < 16));
        assert!(v.iter().any(|&x| x > 2 * MIB));
    }

    #[test]
    fn fallocate_modes_change_the_model_as_the_kernel_does() {
        let mut d = vec![1u8; 10];
        FallocMode::KeepSize.apply(&mut d, 5, 100);
        assert_eq!(d, vec![1; 10]);
        FallocMode::PunchHole.apply(&mut d, 8, 100);
        assert_eq!(d, [1, 1, 1, 1, 1, 1, 1, 1, 0, 0]);
        FallocMode::Default.apply(&mut d, 9, 3);
        assert_eq!(d.len(), 12);
        FallocMode::ZeroRange.apply(&mut d, 0, 2);
        assert_eq!(&d[..3], &[0, 0, 1]);
        FallocMode::ZeroRangeKeepSize.apply(&mut d, 11, 5);
        assert_eq!(d.len(), 12);
        FallocMode::ZeroRange.apply(&mut d, 11, 5);
        assert_eq!(d.len(), 16);
    }

    #[test]
    fn a_mismatch_names_the_differing_range() {
        let want = vec![7u8; 10_000];
        let mut got = want.clone();
        got[100..200].fill(0);
        let Err(Mismatch(m)) = check_bytes(4096, &want, &got, 20_000) else {
            panic!("no mismatch found");
        };
        assert!(m.contains("file range 4196..4296"), "{m}");
        assert!(m.contains("(zeros)"), "{m}");
        let Err(Mismatch(m)) = check_bytes(0, &want, &want[..10], 10_000) else {
            panic!("a short read passed");
        };
        assert!(m.contains("returned 10 bytes"), "{m}");
        assert!(check_bytes(0, &want, &want, 10_000).is_ok());
    }
}
