//! The server-kill harness (`sanfs-bench server-kill`): what an application on a mount sees
//! while the metadata server is killed with SIGKILL and started again, round after round.
//!
//! It builds a cluster on this machine ([`BenchCluster`]: LUNs, `sanfs-mds` as a real
//! process) and mounts it with `sanfs-agent mount`; writer threads keep their files open for
//! the whole run and write records of many sizes (buffered and `O_DIRECT`, aligned and not),
//! with `fsync` and close-and-reopen mixed in. Meanwhile the server is killed at a random
//! moment, left down for a random while, and started again with the same command line. After
//! each restart every writer stops, calls `fsync`, and reads its whole file back through its
//! open descriptor: every byte a `write()` acknowledged must be there, because the agent lived
//! through the kill (the contract of docs/posix.md: an acknowledged write survives a kill -9 of
//! the server while its agent lives; what fsync or close acknowledged survives both).
//!
//! The run counts what the applications saw: errors by errno (EIO, ESTALE, ...), short
//! writes, and bytes missing or wrong at a check. On a hard mount the contract allows none of
//! them, so any count above 0 fails the run. The pause each kill caused (kill to the first
//! completed write after it) is reported too.

use std::collections::BTreeMap;
use std::fs::File;
use std::os::fd::IntoRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use sanfs_client_agent::buf::AlignedBuf;
use sanfs_testcluster::LunKind;

use crate::cluster::{BenchCluster, ClusterSpec, Mount, ServerMode};
use crate::util::MIB;

/// What to run.
#[derive(Debug, Clone)]
pub struct ServerKillParams {
    pub seed: u64,
    /// Kill-and-restart rounds.
    pub rounds: u64,
    /// Writer threads (each its own file; even ones buffered, odd ones `O_DIRECT`).
    pub writers: usize,
    /// Writes stay below this offset.
    pub max_file_size: u64,
    /// Where the LUN files, the store and the mount point go (not tmpfs: O_DIRECT).
    pub dir: PathBuf,
    /// Longest a check may wait for the writers (a hung mount fails the run, never hangs it).
    pub check_timeout: Duration,
    /// SIGTERM (a clean restart) instead of SIGKILL.
    pub term: bool,
    pub progress: bool,
}

/// What the applications saw.
#[derive(Debug, Default, Clone, serde::Serialize)]
pub struct ServerKillOutcome {
    pub seed: u64,
    pub rounds: u64,
    pub writes: u64,
    pub bytes_written: u64,
    pub fsyncs: u64,
    pub closes: u64,
    /// Failed calls by errno name (`EIO`, `ESTALE`, ...) and call (`write EIO`).
    pub errors: BTreeMap<String, u64>,
    pub short_writes: u64,
    /// Checks that found bytes missing or wrong, with where.
    pub lost: Vec<String>,
    /// Per round: from the kill to the first write completed after the restart, in ms.
    pub pauses_ms: Vec<u64>,
    pub elapsed_s: f64,
}

impl ServerKillOutcome {
    /// "N writes, E errors, S short, L lost": the progress line's tally.
    pub fn tally(&self) -> String {
        format!(
            "{} writes, {} errors, {} short, {} lost",
            self.writes,
            self.errors.values().sum::<u64>(),
            self.short_writes,
            self.lost.len()
        )
    }

    /// Whether the run kept the contract: no error, no short write, nothing lost.
    pub fn clean(&self) -> bool {
        self.errors.is_empty() && self.short_writes == 0 && self.lost.is_empty()
    }

    /// Errors whose errno is `name` (e.g. "EIO"), over all calls.
    pub fn errno_count(&self, name: &str) -> u64 {
        self.errors
            .iter()
            .filter(|(k, _)| k.split_whitespace().nth(1) == Some(name))
            .map(|(_, v)| *v)
            .sum()
    }
}

/// A small, seeded random stream (xorshift*), one per writer.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed.max(1))
    }
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next() % n }
    }
}

/// Shared between the writers and the conductor.
struct Shared {
    /// Set while writers must stop at their next call and check.
    check: AtomicBool,
    /// Set when the run is over.
    stop: AtomicBool,
    /// Writes completed so far (the conductor watches it for the pause after a restart).
    writes_done: AtomicU64,
    outcome: Mutex<ServerKillOutcome>,
}

impl Shared {
    fn error(&self, call: &str, e: &std::io::Error) {
        let name = errno_name(e);
        let mut o = self.outcome.lock().unwrap_or_else(|p| p.into_inner());
        *o.errors.entry(format!("{call} {name}")).or_default() += 1;
    }
    fn with<R>(&self, f: impl FnOnce(&mut ServerKillOutcome) -> R) -> R {
        f(&mut self.outcome.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

fn errno_name(e: &std::io::Error) -> String {
    match e.raw_os_error() {
        Some(libc::EIO) => "EIO".into(),
        Some(libc::ESTALE) => "ESTALE".into(),
        Some(libc::ENOTCONN) => "ENOTCONN".into(),
        Some(libc::ETIMEDOUT) => "ETIMEDOUT".into(),
        Some(libc::EAGAIN) => "EAGAIN".into(),
        Some(libc::EINTR) => "EINTR".into(),
        Some(libc::ENOENT) => "ENOENT".into(),
        Some(libc::ENOSPC) => "ENOSPC".into(),
        Some(n) => format!("errno{n}"),
        None => format!("{:?}", e.kind()),
    }
}

/// One writer's file and its model: the bytes every acknowledged write put there.
struct Writer {
    index: usize,
    path: PathBuf,
    direct: bool,
    file: Option<File>,
    model: Vec<u8>,
    /// Bytes of the model that a failed write may or may not have changed (not checked).
    unsure: Vec<(u64, u64)>,
    rng: Rng,
    max: u64,
}

impl Writer {
    fn open(&self, create: bool) -> std::io::Result<File> {
        let mut o = std::fs::OpenOptions::new();
        o.read(true).write(true).create(create);
        if self.direct {
            #[allow(
                clippy::disallowed_methods,
                reason = "a file on the mount, opened as an application opens it: not a LUN"
            )]
            o.custom_flags(libc::O_DIRECT);
        }
        o.open(&self.path)
    }

    /// One random write; returns false if the writer lost its file (cannot go on).
    fn write_once(&mut self, shared: &Shared) -> bool {
        let Some(file) = self.file.as_ref() else {
            return false;
        };
        let (offset, len) = if self.direct {
            let blocks = [1u64, 2, 16, 32, 256][self.rng.below(5) as usize];
            let len = blocks * 4096;
            let off = self.rng.below((self.max - len) / 4096) * 4096;
            (off, len)
        } else {
            let len = match self.rng.below(6) {
                0 => 1 + self.rng.below(600),
                1 => 4096,
                2 => 8192,
                3 => 64 << 10,
                4 => 128 << 10,
                _ => 1 + self.rng.below(1 << 20),
            };
            (self.rng.below(self.max - len), len)
        };
        let fill = (self.rng.next() as u8) | 1;
        let mut buf = AlignedBuf::zeroed(len as usize);
        for (i, b) in buf.as_mut_slice().iter_mut().enumerate() {
            *b = fill.wrapping_add((i / 512) as u8);
        }
        match file.write_at(buf.as_slice(), offset) {
            Ok(n) => {
                let n = n as u64;
                if n < len {
                    shared.with(|o| o.short_writes += 1);
                }
                self.apply(offset, &buf.as_slice()[..n as usize]);
                shared.writes_done.fetch_add(1, Ordering::SeqCst);
                shared.with(|o| {
                    o.writes += 1;
                    o.bytes_written += n;
                });
            }
            Err(e) => {
                shared.error("write", &e);
                self.unsure.push((offset, len));
            }
        }
        true
    }

    fn apply(&mut self, offset: u64, data: &[u8]) {
        let end = offset as usize + data.len();
        if self.model.len() < end {
            self.model.resize(end, 0);
        }
        self.model[offset as usize..end].copy_from_slice(data);
    }

    fn fsync(&self, shared: &Shared) {
        if let Some(f) = &self.file {
            match f.sync_all() {
                Ok(()) => shared.with(|o| o.fsyncs += 1),
                Err(e) => shared.error("fsync", &e),
            }
        }
    }

    /// close(2) with its result (what `File`'s drop throws away), then open again.
    fn close_and_reopen(&mut self, shared: &Shared) {
        if let Some(f) = self.file.take() {
            let fd = f.into_raw_fd();
            // SAFETY: `fd` came from `into_raw_fd` just above, so this code owns it and
            // nothing else closes or uses it afterwards.
            let rc = unsafe { libc::close(fd) };
            if rc == 0 {
                shared.with(|o| o.closes += 1);
            } else {
                shared.error("close", &std::io::Error::last_os_error());
            }
        }
        match self.open(false) {
            Ok(f) => self.file = Some(f),
            Err(e) => shared.error("open", &e),
        }
    }

    /// fsync, then read the whole file through the open descriptor and compare.
    fn check(&mut self, shared: &Shared, round: u64) {
        self.fsync(shared);
        let Some(file) = self.file.as_ref() else {
            return;
        };
        let size = match file.metadata() {
            Ok(m) => m.len(),
            Err(e) => {
                shared.error("fstat", &e);
                return;
            }
        };
        if size < self.model.len() as u64 && !self.covered_by_unsure(size, self.model.len() as u64)
        {
            shared.with(|o| {
                o.lost.push(format!(
                    "round {round}: writer {} file size {size} < {} acknowledged",
                    self.index,
                    self.model.len()
                ))
            });
        }
        let mut got = AlignedBuf::zeroed(size.div_ceil(4096).max(1) as usize * 4096);
        let mut done = 0usize;
        while (done as u64) < size {
            let chunk = (size as usize - done).min(4 << 20).div_ceil(4096) * 4096;
            match file.read_at(&mut got.as_mut_slice()[done..done + chunk], done as u64) {
                Ok(0) => break,
                Ok(n) => done += n,
                Err(e) => {
                    shared.error("read", &e);
                    return;
                }
            }
        }
        let got = &got.as_slice()[..done.min(size as usize)];
        let mut first_bad = None;
        let mut bad = 0u64;
        for (i, want) in self.model.iter().enumerate() {
            if got.get(i) != Some(want) && !self.in_unsure(i as u64) {
                first_bad.get_or_insert(i);
                bad += 1;
            }
        }
        if let Some(at) = first_bad {
            shared.with(|o| {
                o.lost.push(format!(
                    "round {round}: writer {} ({}): {bad} bytes differ, first at offset {at}",
                    self.index,
                    if self.direct { "O_DIRECT" } else { "buffered" }
                ))
            });
        }
    }

    fn in_unsure(&self, at: u64) -> bool {
        self.unsure.iter().any(|&(o, l)| at >= o && at < o + l)
    }

    fn covered_by_unsure(&self, from: u64, to: u64) -> bool {
        (from..to).all(|a| self.in_unsure(a))
    }
}

/// Runs the harness; an `Err` is a failure of the harness itself (set-up, a hung mount).
pub async fn run(p: &ServerKillParams) -> anyhow::Result<ServerKillOutcome> {
    let started = Instant::now();
    std::fs::create_dir_all(&p.dir).with_context(|| format!("create {}", p.dir.display()))?;
    let spec = ClusterSpec {
        tag: "kill".into(),
        luns: 4,
        lun_size: 256 * MIB,
        stripe_unit: Some(64 << 10),
        direct_threshold: 64 << 10,
        server: ServerMode::Process,
        lun_kind: LunKind::Auto,
    };
    let mut cluster = BenchCluster::start(&spec, &p.dir).await?;
    let mnt_dir = tempfile::Builder::new()
        .prefix("sanfs-server-kill-")
        .tempdir_in(&p.dir)?;
    let mnt = mnt_dir.path().join("mnt");
    std::fs::create_dir(&mnt)?;
    let mount = Mount::start(&cluster, &mnt)?;
    let crew = Writers::start(&mount.path, p.seed, p.writers, p.max_file_size)?;

    let mut rng = Rng::new(p.seed);
    for round in 1..=p.rounds {
        crew.set_round(round);
        tokio::time::sleep(Duration::from_millis(300 + rng.below(1200))).await;
        let killed = Instant::now();
        if p.term {
            cluster.terminate_server()?;
        } else {
            cluster.kill_server()?;
        }
        tokio::time::sleep(Duration::from_millis(rng.below(1500))).await;
        let before = crew.writes_done();
        let restarting = Instant::now();
        cluster.restart_server()?;
        let accepting = restarting.elapsed();
        // The pause: until a write completes after the restart (bounded).
        crew.wait_write_after(before, p.check_timeout).await;
        let pause = killed.elapsed();
        crew.shared.with(|o| {
            o.pauses_ms.push(pause.as_millis() as u64);
            o.rounds = round;
        });
        // Let them run a little on the new server, then check everything.
        tokio::time::sleep(Duration::from_millis(rng.below(500))).await;
        crew.check(round == p.rounds, p.check_timeout).await?;
        if p.progress {
            eprintln!(
                "server-kill: round {round}/{}: pause {} ms (server accepting after {} ms), {}",
                p.rounds,
                pause.as_millis(),
                accepting.as_millis(),
                crew.outcome().tally()
            );
        }
    }
    if p.rounds == 0 {
        crew.check(true, p.check_timeout).await?;
    }
    let mut out = crew.finish();
    out.seed = p.seed;
    drop(mount);
    drop(cluster);
    out.elapsed_s = started.elapsed().as_secs_f64();
    Ok(out)
}

/// The writer threads on a mount and the two barriers where they meet the conductor at each
/// check (arrive stopped, then checked). The failover harness (`crate::failover`) uses the
/// same crew.
pub(crate) struct Writers {
    shared: Arc<Shared>,
    stopped: Arc<Barrier>,
    checked: Arc<Barrier>,
    rounds_seen: Arc<AtomicU64>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Writers {
    /// Creates `writers` files in `dir` (even ones buffered, odd ones `O_DIRECT`) and starts a
    /// thread writing each.
    pub(crate) fn start(
        dir: &std::path::Path,
        seed: u64,
        writers: usize,
        max_file_size: u64,
    ) -> anyhow::Result<Writers> {
        let shared = Arc::new(Shared {
            check: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            writes_done: AtomicU64::new(0),
            outcome: Mutex::new(ServerKillOutcome {
                seed,
                ..ServerKillOutcome::default()
            }),
        });
        let stopped = Arc::new(Barrier::new(writers + 1));
        let checked = Arc::new(Barrier::new(writers + 1));
        let rounds_seen = Arc::new(AtomicU64::new(0));
        let mut crew = Writers {
            shared,
            stopped,
            checked,
            rounds_seen,
            threads: Vec::new(),
        };
        for index in 0..writers {
            let mut w = Writer {
                index,
                path: dir.join(format!("w{index}")),
                direct: index % 2 == 1,
                file: None,
                model: Vec::new(),
                unsure: Vec::new(),
                rng: Rng::new(seed ^ (index as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15)),
                max: max_file_size.max(2 * MIB),
            };
            w.file = Some(
                w.open(true)
                    .with_context(|| format!("create {}", w.path.display()))?,
            );
            let (shared, stopped, checked, rounds_seen) = (
                Arc::clone(&crew.shared),
                Arc::clone(&crew.stopped),
                Arc::clone(&crew.checked),
                Arc::clone(&crew.rounds_seen),
            );
            crew.threads.push(std::thread::spawn(move || {
                loop {
                    if shared.check.load(Ordering::SeqCst) || shared.stop.load(Ordering::SeqCst) {
                        let last = shared.stop.load(Ordering::SeqCst);
                        stopped.wait();
                        w.check(&shared, rounds_seen.load(Ordering::SeqCst));
                        checked.wait();
                        if last {
                            if let Some(f) = w.file.take() {
                                drop(f);
                            }
                            return;
                        }
                        continue;
                    }
                    match w.rng.below(40) {
                        0..=2 => w.fsync(&shared),
                        3 => w.close_and_reopen(&shared),
                        _ => {
                            if !w.write_once(&shared) {
                                // Lost its file: wait for the next check (which reports it).
                                std::thread::sleep(Duration::from_millis(20));
                            }
                        }
                    }
                }
            }));
        }
        Ok(crew)
    }

    /// The round the checks report.
    pub(crate) fn set_round(&self, round: u64) {
        self.rounds_seen.store(round, Ordering::SeqCst);
    }

    /// Writes completed so far.
    pub(crate) fn writes_done(&self) -> u64 {
        self.shared.writes_done.load(Ordering::SeqCst)
    }

    /// Waits until more than `before` writes completed, at most `timeout`.
    pub(crate) async fn wait_write_after(&self, before: u64, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while self.writes_done() == before && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Counts a failed call of someone else on the mount (the failover probe) with the rest.
    pub(crate) fn error(&self, call: &str, e: &std::io::Error) {
        self.shared.error(call, e);
    }

    /// Stops every writer for a check (fsync, read back, compare) and lets them go on, or,
    /// when `last`, end.
    pub(crate) async fn check(&self, last: bool, timeout: Duration) -> anyhow::Result<()> {
        if last {
            self.shared.stop.store(true, Ordering::SeqCst);
        } else {
            self.shared.check.store(true, Ordering::SeqCst);
        }
        wait_barrier(&self.stopped, timeout, "the writers to stop for a check").await?;
        self.shared.check.store(false, Ordering::SeqCst);
        wait_barrier(&self.checked, timeout, "the writers' checks").await
    }

    /// What the applications saw so far.
    pub(crate) fn outcome(&self) -> ServerKillOutcome {
        self.shared.with(|o| o.clone())
    }

    /// Joins the threads (after the last check) and returns the outcome.
    pub(crate) fn finish(self) -> ServerKillOutcome {
        for t in self.threads {
            let _ = t.join();
        }
        self.shared.with(|o| o.clone())
    }
}

/// Waits for `barrier` on a blocking thread, at most `timeout` (a hung mount fails the run).
async fn wait_barrier(barrier: &Arc<Barrier>, timeout: Duration, what: &str) -> anyhow::Result<()> {
    let b = Arc::clone(barrier);
    let waited = tokio::time::timeout(timeout, tokio::task::spawn_blocking(move || b.wait())).await;
    match waited {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e)) => bail!("waiting for {what}: {e}"),
        Err(_) => bail!(
            "waited {} s for {what}: a call on the mount hangs",
            timeout.as_secs()
        ),
    }
}

/// The median of `v` (0 for none).
pub fn median(v: &[u64]) -> u64 {
    let mut s = v.to_vec();
    s.sort_unstable();
    s.get(s.len() / 2).copied().unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shared() -> Shared {
        Shared {
            check: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            writes_done: AtomicU64::new(0),
            outcome: Mutex::new(ServerKillOutcome::default()),
        }
    }

    fn writer(dir: &std::path::Path, seed: u64) -> Writer {
        let mut w = Writer {
            index: 0,
            path: dir.join("f"),
            direct: false,
            file: None,
            model: Vec::new(),
            unsure: Vec::new(),
            rng: Rng::new(seed),
            max: 2 * MIB,
        };
        w.file = Some(w.open(true).unwrap());
        w
    }

    #[test]
    fn a_check_passes_on_intact_files_and_finds_bytes_lost_behind_its_back() {
        let seed = 7;
        println!("seed {seed}");
        let dir = tempfile::tempdir().unwrap();
        let s = shared();
        let mut w = writer(dir.path(), seed);
        for _ in 0..20 {
            assert!(w.write_once(&s));
        }
        w.close_and_reopen(&s);
        w.check(&s, 1);
        let o = s.with(|o| o.clone());
        assert!(o.clean(), "{o:?}");
        assert_eq!(o.writes, 20);
        // What a server that forgot a completion looks like: the file back to a shorter size.
        let half = w.model.len() as u64 / 2;
        w.file.as_ref().unwrap().set_len(half).unwrap();
        w.check(&s, 2);
        let o = s.with(|o| o.clone());
        assert!(!o.clean());
        assert_eq!(o.lost.len(), 2, "{:?}", o.lost);
    }

    #[test]
    fn errors_are_counted_by_errno_over_all_calls() {
        let s = shared();
        s.error("write", &std::io::Error::from_raw_os_error(libc::EIO));
        s.error("fsync", &std::io::Error::from_raw_os_error(libc::EIO));
        s.error("open", &std::io::Error::from_raw_os_error(libc::ESTALE));
        let o = s.with(|o| o.clone());
        assert_eq!(o.errno_count("EIO"), 2);
        assert_eq!(o.errno_count("ESTALE"), 1);
        assert!(!o.clean());
        assert_eq!(median(&[5, 1, 9]), 5);
    }
}
