//! A server restart is a pause, not an error (issue 15, "No error for a restart"): a real
//! `sanfs-mds` process serves a real `sanfs-agent` FUSE mount; while threads work on the mount
//! (namespace calls: create, stat, mkdir, readdir, rename, unlink, rmdir; data calls:
//! buffered and O_DIRECT writes and reads), the server is killed with SIGKILL, stays down for
//! ~3 s, and is started again with the same command line. Every call blocks meanwhile and
//! then succeeds: 0 EIO, 0 ESTALE, 0 errors at all, 0 short writes, and each thread gets work
//! done after the restart. A `soft` mount with a short `retrans_timeout` instead answers EIO
//! once the server has been gone that long. Root only (FUSE).

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sanfs_client_agent::buf::AlignedBuf;
use sanfs_testcluster::ChildGuard;

use crate::quickstart::mds_binary;
use crate::san::{can_mount, is_mounted};

const MIB: u64 = 1 << 20;

/// A server and a mount of it, all real processes, in one temporary directory.
struct Setup {
    dir: tempfile::TempDir,
    config: PathBuf,
    port: u16,
    server: Option<ChildGuard>,
    agent: Option<ChildGuard>,
    mount: PathBuf,
    /// A second node's mount, when a test made one ([`Setup::mount_other`]).
    other: Option<(PathBuf, ChildGuard)>,
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl Setup {
    fn new(lease_ttl_ms: u64) -> Setup {
        let dir = tempfile::Builder::new()
            .prefix("sanfs-h3-restart-")
            .tempdir()
            .unwrap();
        let port = free_port();
        let luns: Vec<PathBuf> = (0..4).map(|i| dir.path().join(format!("lun{i}"))).collect();
        for l in &luns {
            File::create(l).unwrap().set_len(128 * MIB).unwrap();
        }
        let devices: Vec<String> = luns
            .iter()
            .map(|l| format!("{:?}", l.display().to_string()))
            .collect();
        let config = dir.path().join("mds.toml");
        std::fs::write(
            &config,
            format!(
                "[server]\nlisten = \"127.0.0.1:{port}\"\ninsecure = true\nlease_ttl_ms = {lease_ttl_ms}\n\
                 [metadata]\npath = {:?}\n\
                 [volume]\nlayout = \"striped\"\nstripe_unit = \"64KiB\"\ndevices = [{}]\n",
                dir.path().join("meta.redb").display().to_string(),
                devices.join(", ")
            ),
        )
        .unwrap();
        let out = Command::new(mds_binary())
            .args(["format", "--config", config.to_str().unwrap()])
            .output()
            .unwrap();
        assert!(out.status.success(), "format: {out:?}");
        let mount = dir.path().join("mnt");
        std::fs::create_dir(&mount).unwrap();
        let mut s = Setup {
            dir,
            config,
            port,
            server: None,
            agent: None,
            mount,
            other: None,
        };
        s.start_server();
        s
    }

    /// Starts the server (always the same command line) and waits until it listens.
    fn start_server(&mut self) {
        let next = self.prepare_server();
        self.start_prepared(next);
    }

    /// A shell that execs the server (always the same command line) once told to. It is
    /// forked now, while the server is up: a fork while it is down would, at the child's exec,
    /// close the FUSE files this test process (any of its tests) holds open, and such a close
    /// (FUSE flush) of a file with lazily completed writes waits for the server: a deadlock.
    /// The shell's own exec closes them too, and the kernel lets the spawning thread go on
    /// (vfork) before it does: so this waits for the shell's "ready", which it can only say
    /// once its exec, those closes included, is over. (Without that wait, a kill of the server
    /// right after could leave the shell stuck in that close for good.)
    fn prepare_server(&self) -> ChildGuard {
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join("mds.log"))
            .unwrap();
        let mut cmd = Command::new("sh");
        cmd.arg("-c")
            .arg("echo ready && read _go && exec \"$0\" serve --config \"$1\" > /dev/null")
            .arg(mds_binary())
            .arg(&self.config)
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

    /// Lets a [`Setup::prepare_server`] shell exec the server (no fork) and waits until it
    /// listens.
    fn start_prepared(&mut self, mut child: ChildGuard) {
        let mut go = child.child_mut().stdin.take().unwrap();
        go.write_all(b"go\n").unwrap();
        drop(go);
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
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

    fn mount(&mut self, extra: &str) {
        let child = self.spawn_agent(&self.mount, "h3-restart", extra, "agent.log");
        self.agent = Some(child);
    }

    /// A second node's mount of the same server (its own session); answers its path.
    fn mount_other(&mut self) -> PathBuf {
        let path = self.dir.path().join("mnt-b");
        std::fs::create_dir(&path).unwrap();
        let child = self.spawn_agent(&path, "h3-restart-b", "", "agent-b.log");
        self.other = Some((path.clone(), child));
        path
    }

    /// The mount's control socket (the agents' run directory is the test's own).
    fn status(&self, mount: &Path) -> serde_json::Value {
        use sanfs_client_agent::control;
        let (entry, _) = control::mount_of(mount).unwrap();
        let socket = control::socket_path(&self.dir.path().join("run"), entry.major, entry.minor);
        let st = control::ask(&socket, &control::Request::Status)
            .unwrap()
            .status
            .unwrap();
        serde_json::to_value(&st).unwrap()
    }

    fn spawn_agent(&self, mount: &Path, name: &str, extra: &str, log: &str) -> ChildGuard {
        let run_dir = self.dir.path().join("run");
        std::fs::create_dir_all(&run_dir).unwrap();
        let mut opts = format!(
            "devices={},client_name={name}",
            self.dir.path().join("lun*").display()
        );
        if !extra.is_empty() {
            opts = format!("{opts},{extra}");
        }
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_sanfs-agent"));
        cmd.arg("mount")
            .arg(format!("127.0.0.1:{}", self.port))
            .arg(mount)
            .args(["-o", &opts, "--foreground"])
            .env("SANFS_RUN_DIR", &run_dir)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stderr(File::create(self.dir.path().join(log)).unwrap());
        let mut child = ChildGuard::spawn(&mut cmd).unwrap();
        let deadline = Instant::now() + Duration::from_secs(60);
        while !is_mounted(mount) {
            if let Some(st) = child.try_wait().unwrap() {
                panic!("sanfs-agent exited: {st}; log:\n{}", self.log(log));
            }
            assert!(Instant::now() < deadline, "the mount did not appear");
            std::thread::sleep(Duration::from_millis(20));
        }
        child
    }

    fn log(&self, name: &str) -> String {
        std::fs::read_to_string(self.dir.path().join(name)).unwrap_or_default()
    }
}

impl Drop for Setup {
    fn drop(&mut self) {
        if let Some((path, mut agent)) = self.other.take() {
            if is_mounted(&path) {
                let _ = rustix::mount::unmount(&path, rustix::mount::UnmountFlags::DETACH);
            }
            if !matches!(agent.wait_timeout(Duration::from_secs(10)), Ok(Some(_))) {
                let _ = agent.kill9();
            }
        }
        if is_mounted(&self.mount) {
            let _ = rustix::mount::unmount(&self.mount, rustix::mount::UnmountFlags::DETACH);
        }
        if let Some(mut a) = self.agent.take()
            && !matches!(a.wait_timeout(Duration::from_secs(10)), Ok(Some(_)))
        {
            let _ = a.kill9();
        }
        if let Some(mut s) = self.server.take() {
            let _ = s.terminate(Duration::from_secs(5));
        }
    }
}

/// Where the run is: before the kill, while the server is down, after the restart.
const BEFORE: u8 = 0;
const DOWN: u8 = 1;
const AFTER: u8 = 2;

/// What the threads saw.
#[derive(Debug, Default)]
struct Seen {
    /// Failed calls by (call, errno).
    errors: BTreeMap<(String, i32), u64>,
    short_writes: u64,
    /// Content that differed when the whole iteration ran after the restart.
    bad_content: Vec<String>,
    /// Iterations done after the restart, by thread.
    after: BTreeMap<String, u64>,
}

type Shared = Arc<Mutex<Seen>>;

fn fail(seen: &Shared, call: &str, e: &std::io::Error) {
    let errno = e.raw_os_error().unwrap_or(-1);
    *seen
        .lock()
        .unwrap()
        .errors
        .entry((call.to_owned(), errno))
        .or_default() += 1;
}

/// Runs `f` (one call), counting a failure under `call`; `None` when it failed.
fn attempt<T>(seen: &Shared, call: &str, f: impl FnOnce() -> std::io::Result<T>) -> Option<T> {
    match f() {
        Ok(v) => Some(v),
        Err(e) => {
            fail(seen, call, &e);
            None
        }
    }
}

fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// A namespace worker: create + write + read back, stat, mkdir, readdir, rename, unlink, rmdir.
fn namespace_worker(root: &Path, id: usize, stop: &AtomicBool, phase: &AtomicU8, seen: &Shared) {
    let me = format!("ns{id}");
    let base = root.join(&me);
    std::fs::create_dir(&base).unwrap();
    let mut i = 0u64;
    while !stop.load(Ordering::SeqCst) {
        i += 1;
        let started = phase.load(Ordering::SeqCst);
        let f = base.join(format!("f{i}"));
        let d = base.join(format!("d{i}"));
        let data = pattern(20_000 + (i as usize % 7) * 1000, i);
        if let Some(mut file) = attempt(seen, "create", || File::create(&f)) {
            match file.write(&data) {
                Ok(n) if n < data.len() => seen.lock().unwrap().short_writes += 1,
                Ok(_) => {}
                Err(e) => fail(seen, "write", &e),
            }
            drop(file);
        }
        if let Some(back) = attempt(seen, "read", || std::fs::read(&f))
            && back != data
            && started == AFTER
        {
            seen.lock().unwrap().bad_content.push(format!(
                "{}: {} bytes back",
                f.display(),
                back.len()
            ));
        }
        attempt(seen, "stat", || std::fs::metadata(&f));
        attempt(seen, "mkdir", || std::fs::create_dir(&d));
        let g = d.join("g");
        attempt(seen, "rename", || std::fs::rename(&f, &g));
        attempt(seen, "readdir", || {
            std::fs::read_dir(&d)?.collect::<std::io::Result<Vec<_>>>()
        });
        attempt(seen, "unlink", || std::fs::remove_file(&g));
        attempt(seen, "rmdir", || std::fs::remove_dir(&d));
        if started == AFTER {
            *seen.lock().unwrap().after.entry(me.clone()).or_default() += 1;
        }
    }
}

/// A data worker on one open file: writes of 1 MiB (O_DIRECT: aligned; else buffered at odd
/// offsets), each read back, the fd kept open across the restart.
fn data_worker(
    root: &Path,
    id: usize,
    direct: bool,
    stop: &AtomicBool,
    phase: &AtomicU8,
    seen: &Shared,
) {
    let me = format!("{}{id}", if direct { "direct" } else { "buffered" });
    let path = root.join(&me);
    let mut o = OpenOptions::new();
    o.read(true).write(true).create(true);
    if direct {
        #[allow(
            clippy::disallowed_methods,
            reason = "a file on the mount, opened as an application opens it: not a LUN"
        )]
        o.custom_flags(libc::O_DIRECT);
    }
    let file = o.open(&path).unwrap();
    let len = MIB as usize;
    let mut i = 0u64;
    while !stop.load(Ordering::SeqCst) {
        i += 1;
        let started = phase.load(Ordering::SeqCst);
        let slot = i % 8;
        let off = if direct { slot * MIB } else { slot * MIB + 17 };
        let data = pattern(len, i * 31 + id as u64);
        let buf = AlignedBuf::from_slice(&data);
        match file.write_at(buf.as_slice(), off) {
            Ok(n) if n < len => seen.lock().unwrap().short_writes += 1,
            Ok(_) => {}
            Err(e) => fail(seen, "pwrite", &e),
        }
        let mut back = AlignedBuf::zeroed(len);
        match file.read_at(back.as_mut_slice(), off) {
            Ok(n) if n == len && back.as_slice() == data.as_slice() => {}
            Ok(n) if started == AFTER => seen
                .lock()
                .unwrap()
                .bad_content
                .push(format!("{me} at {off}: {n} bytes, differing")),
            Ok(_) => {}
            Err(e) => fail(seen, "pread", &e),
        }
        if started == AFTER {
            *seen.lock().unwrap().after.entry(me.clone()).or_default() += 1;
        }
    }
}

#[test]
fn server_restart_is_a_pause_not_an_error() {
    if !can_mount("the server restart test") {
        return;
    }
    let mut s = Setup::new(3000);
    s.mount("");
    // A call that never comes back would hang the test binary (threads blocked in FUSE):
    // after 5 minutes, fail loudly instead.
    let finished = Arc::new(AtomicBool::new(false));
    {
        let (finished, log) = (finished.clone(), s.dir.path().join("agent.log"));
        let mds_log = s.dir.path().join("mds.log");
        let agent = s.agent.as_ref().map(ChildGuard::pid);
        let mount = s.mount.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_secs(300));
            if !finished.load(Ordering::SeqCst) {
                let log = std::fs::read_to_string(log).unwrap_or_default();
                let mds = std::fs::read_to_string(mds_log).unwrap_or_default();
                eprintln!("restart test hung for 5 minutes; agent log:\n{log}\nserver log:\n{mds}");
                // Files of this process still open on the mount would hold its exit in a
                // FUSE flush for as long as the server is away: the agent goes first, so
                // that the abort ends the run instead of hanging it.
                if let Some(pid) = agent.and_then(|p| i32::try_from(p).ok())
                    && let Some(pid) = rustix::process::Pid::from_raw(pid)
                {
                    let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
                }
                let _ = rustix::mount::unmount(&mount, rustix::mount::UnmountFlags::DETACH);
                std::process::abort();
            }
        });
    }
    let root = s.mount.clone();
    let stop = Arc::new(AtomicBool::new(false));
    let phase = Arc::new(AtomicU8::new(BEFORE));
    let seen: Shared = Arc::default();
    let mut threads = Vec::new();
    for id in 0..3 {
        let (root, stop, phase, seen) = (root.clone(), stop.clone(), phase.clone(), seen.clone());
        threads.push(std::thread::spawn(move || {
            namespace_worker(&root, id, &stop, &phase, &seen)
        }));
    }
    for (id, direct) in [(0, false), (1, true)] {
        let (root, stop, phase, seen) = (root.clone(), stop.clone(), phase.clone(), seen.clone());
        threads.push(std::thread::spawn(move || {
            data_worker(&root, id, direct, &stop, &phase, &seen)
        }));
    }
    std::thread::sleep(Duration::from_secs(2));
    let next = s.prepare_server();
    s.kill_server();
    phase.store(DOWN, Ordering::SeqCst);
    let killed = Instant::now();
    std::thread::sleep(Duration::from_secs(3));
    s.start_prepared(next);
    phase.store(AFTER, Ordering::SeqCst);
    eprintln!("server down for {} ms", killed.elapsed().as_millis());
    // Until every thread has done work after the restart (at most 60 s).
    let deadline = Instant::now() + Duration::from_secs(60);
    while seen
        .lock()
        .unwrap()
        .after
        .values()
        .filter(|n| **n >= 3)
        .count()
        < threads.len()
        && Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(100));
    }
    stop.store(true, Ordering::SeqCst);
    let join_deadline = Instant::now() + Duration::from_secs(60);
    while threads.iter().any(|t| !t.is_finished()) {
        assert!(
            Instant::now() < join_deadline,
            "threads still blocked 60 s after the restart; agent log:\n{}",
            s.log("agent.log")
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    for t in threads {
        t.join().unwrap();
    }
    finished.store(true, Ordering::SeqCst);
    let seen = seen.lock().unwrap();
    let log = s.log("agent.log");
    eprintln!("restart: {seen:?}");
    assert!(
        seen.errors.is_empty() && seen.short_writes == 0 && seen.bad_content.is_empty(),
        "errors {:?}, short writes {}, bad content {:?}; agent log:\n{log}",
        seen.errors,
        seen.short_writes,
        seen.bad_content
    );
    assert_eq!(
        seen.after.len(),
        5,
        "work after the restart: {:?}",
        seen.after
    );
    assert!(
        log.contains("server not responding, still trying") && log.contains("server OK"),
        "the agent says when the server went and came back:\n{log}"
    );
}

#[test]
fn soft_mount_gives_up_with_eio() {
    if !can_mount("the soft mount test") {
        return;
    }
    let mut s = Setup::new(3000);
    s.mount("soft,retrans_timeout=2s");
    let f = s.mount.join("kept");
    std::fs::write(&f, b"before").unwrap();
    let next = s.prepare_server();
    s.kill_server();
    let t = Instant::now();
    // attr_ttl defaults to 1 s: past it, the stat asks the server.
    std::thread::sleep(Duration::from_millis(1100));
    let e = std::fs::metadata(s.mount.join("never-made")).unwrap_err();
    let waited = t.elapsed();
    assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e}");
    assert!(
        waited >= Duration::from_secs(2) && waited < Duration::from_secs(30),
        "gave up after {waited:?}"
    );
    // Back: the same mount works again.
    s.start_prepared(next);
    let names: Vec<_> = std::fs::read_dir(&s.mount)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(names.iter().any(|n| n == "kept"), "{names:?}");
}

/// A file unlinked while open lives on across a kill -9 of the server (the agent opens it
/// again in the reclaim window; the server reaps only orphans nobody opened again), and is
/// freed at its last close: its blocks go back (`df`), and fsck of the stopped store is clean.
#[test]
fn a_file_unlinked_while_open_survives_a_server_restart() {
    unlinked_while_open_across_a_restart(false);
}

/// The same across a clean stop (SIGTERM, a rolling restart): the agent closes its old
/// session as it fences, and the stopping server must not release that session's handles
/// (that destroyed the file before the agent could open it again). The race was seen in the
/// HA failover run (`scripts/ci/failover`, seed 3867944826670326950); here the close does not
/// always reach the stopping server in time, so this test does not fail without the fix on
/// every run: it keeps the clean stop's path covered.
#[test]
fn a_file_unlinked_while_open_survives_a_clean_server_restart() {
    unlinked_while_open_across_a_restart(true);
}

/// An open for reading that the agent answered itself (docs/posix.md "Opens answered by
/// the agent") is made at the restarted server in the reclaim window, with the agent's
/// other opens: another node that unlinks the file after the restart (no lease of this
/// node's to recall then) leaves it alive for the descriptor, whose reads past the kernel's
/// pages still get every byte. (Without the reclaim's make it fails in most runs; in the
/// others the restarted server still kept the inode, an orphan of its last run, when the
/// read made the open late.)
#[test]
fn an_open_answered_by_the_agent_survives_a_server_kill_and_another_nodes_unlink() {
    if !can_mount("the answered-open restart test") {
        return;
    }
    let mut s = Setup::new(3000);
    s.mount("");
    let other = s.mount_other();
    let path = s.mount.join("read-here");
    let data = pattern(300_000 + 777, 23);
    std::fs::write(&path, &data).unwrap();
    // Read once: the kernel keeps its pages, and the next open is answered here.
    assert!(std::fs::read(&path).unwrap() == data);
    let opens_here = |s: &Setup| s.status(&s.mount)["agent"]["opens_here"].as_u64().unwrap();
    let before = opens_here(&s);
    let file = File::open(&path).unwrap();
    assert_eq!(
        opens_here(&s),
        before + 1,
        "the open is answered by the agent"
    );
    let next = s.prepare_server();
    s.kill_server();
    s.start_prepared(next);
    std::fs::remove_file(other.join("read-here")).unwrap();
    crate::support::drop_pages(&file);
    let mut back = vec![0u8; data.len()];
    file.read_exact_at(&mut back, 0).unwrap_or_else(|e| {
        panic!(
            "read after the restart and the unlink: {e}; agent log:\n{}",
            s.log("agent.log")
        )
    });
    assert!(back == data, "the unlinked file's bytes after the restart");
    drop(file);
}

fn unlinked_while_open_across_a_restart(clean: bool) {
    if !can_mount("the unlinked-while-open restart test") {
        return;
    }
    let mut s = Setup::new(3000);
    s.mount("");
    let path = s.mount.join("scratch");
    let data = pattern(3 * MIB as usize + 12_345, 21);
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)
        .unwrap();
    file.write_all_at(&data, 0).unwrap();
    file.sync_all().unwrap();
    std::fs::remove_file(&path).unwrap();
    let free_before = rustix::fs::statvfs(&s.mount).unwrap().f_bfree;
    let next = s.prepare_server();
    if clean {
        s.server
            .take()
            .unwrap()
            .terminate(Duration::from_secs(10))
            .unwrap();
    } else {
        s.kill_server();
    }
    s.start_prepared(next);
    // Through the descriptor kept open: every byte, and it still takes writes.
    let mut back = vec![0u8; data.len()];
    file.read_exact_at(&mut back, 0).unwrap();
    assert!(back == data, "the unlinked file's bytes after the restart");
    file.write_all_at(b"after the restart", 0).unwrap();
    let mut head = [0u8; 17];
    file.read_exact_at(&mut head, 0).unwrap();
    assert_eq!(&head, b"after the restart");
    let log = s.log("mds.log");
    assert!(
        !log.contains("reaping an inode unlinked while open"),
        "the server reaped it: {log}"
    );
    // The last close frees it.
    drop(file);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let free = rustix::fs::statvfs(&s.mount).unwrap().f_bfree;
        if free > free_before {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the blocks of the closed orphan did not come back ({free} <= {free_before})"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    rustix::mount::unmount(&s.mount, rustix::mount::UnmountFlags::empty()).unwrap();
    if let Some(mut a) = s.agent.take() {
        a.wait_timeout(Duration::from_secs(10)).unwrap();
    }
    s.server
        .take()
        .unwrap()
        .terminate(Duration::from_secs(10))
        .unwrap();
    let fsck = Command::new(mds_binary())
        .args(["fsck", "--config", s.config.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(fsck.status.success(), "fsck: {fsck:?}");
}
