//! The FUSE mount end to end: the real `sanfs-agent mount --foreground` binary as a child
//! process against the in-process server, driven through plain `std::fs` calls on the mount.
//! Needs root and /dev/fuse ("skipped: ..." otherwise, a failure under `SANFS_REQUIRE_ROOT=1`).
//! Every file system call runs on a blocking thread under a timeout, and every mount is taken down by its
//! guard (clean unmount, else kill the agent by PID and detach lazily): a bug fails the test,
//! never hangs it.

use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use sanfs_proto::pb;
use sanfs_proto::pb::data_client::DataClient;

use crate::cluster::{self, Cluster, MIB};

/// Whether FUSE mounts can be made here: root and /dev/fuse (the test's thread, which libtest
/// names after the test, names it in the skip line, or the failure under
/// `SANFS_REQUIRE_ROOT=1`).
pub(crate) fn can_mount() -> bool {
    let thread = std::thread::current();
    let test = thread.name().unwrap_or("a FUSE mount test");
    !sanfs_testcluster::skip_unless(test, &[sanfs_testcluster::Need::Fuse])
}

fn is_mounted(path: &Path) -> bool {
    let want = path.to_string_lossy();
    std::fs::read_to_string("/proc/self/mounts").is_ok_and(|m| {
        m.lines()
            .any(|l| l.split_whitespace().nth(1) == Some(want.as_ref()))
    })
}

/// Aborts the FUSE connection of the mount at `path` (`/sys/fs/fuse/connections/N/abort`,
/// N its device's minor number from `/proc/self/mountinfo`; fusectl mounted when it is not):
/// every request waiting on it fails at once.
fn abort_fuse_connection(path: &Path) {
    let want = path.to_string_lossy();
    let Some(minor) = std::fs::read_to_string("/proc/self/mountinfo")
        .ok()
        .and_then(|m| {
            m.lines().find_map(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                (f.get(4) == Some(&want.as_ref()))
                    .then(|| f.get(2)?.split(':').nth(1).map(str::to_owned))
                    .flatten()
            })
        })
    else {
        return;
    };
    let conns = Path::new("/sys/fs/fuse/connections");
    if !conns.join(&minor).exists() {
        let _ = Command::new("mount")
            .args(["-t", "fusectl", "none"])
            .arg(conns)
            .status();
    }
    eprintln!("aborting the FUSE connection {minor} of {}", path.display());
    let _ = std::fs::write(conns.join(&minor).join("abort"), "1");
}

/// A shared writable mapping of the first `len` bytes of an open file (which must be that
/// long), unmapped on drop.
struct SharedMapping {
    base: *mut libc::c_void,
    len: usize,
}

impl SharedMapping {
    fn new(f: &std::fs::File, len: usize) -> SharedMapping {
        use std::os::fd::AsRawFd;
        // SAFETY: a fresh shared mapping of an open file (the fd lives through the call); the
        // result is checked, and unmapped once, in `drop`.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                f.as_raw_fd(),
                0,
            )
        };
        assert_ne!(
            base,
            libc::MAP_FAILED,
            "{}",
            std::io::Error::last_os_error()
        );
        SharedMapping { base, len }
    }

    fn bytes(&mut self) -> &mut [u8] {
        // SAFETY: `base` maps `len` writable bytes for the life of `self`, borrowed mutably
        // once; the caller mapped no more than the file holds.
        unsafe { std::slice::from_raw_parts_mut(self.base.cast::<u8>(), self.len) }
    }

    /// `msync(MS_SYNC)`: the stores reach the file system before it returns.
    fn sync(&self) {
        // SAFETY: the live mapping of `len` bytes at `base`.
        let r = unsafe { libc::msync(self.base, self.len, libc::MS_SYNC) };
        assert_eq!(r, 0, "{}", std::io::Error::last_os_error());
    }
}

impl Drop for SharedMapping {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, unmapped once.
        unsafe {
            libc::munmap(self.base, self.len);
        }
    }
}

/// Runs blocking file-system work on a thread of its own; panics if it takes longer than
/// `secs` (the thread is left behind, unblocked when the guard takes the mount down).
pub(crate) async fn timed<T: Send + 'static>(
    what: &str,
    secs: u64,
    f: impl FnOnce() -> T + Send + 'static,
) -> T {
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match tokio::time::timeout(Duration::from_secs(secs), rx).await {
        Ok(Ok(v)) => v,
        Ok(Err(_)) => panic!("{what}: the worker thread panicked"),
        Err(_) => panic!("{what}: no answer within {secs} s"),
    }
}

/// One `sanfs-agent mount --foreground` child and its mount point; dropping it unmounts.
/// `sanfs-agent mount SERVER[subdir] path -o devices=...,client_name=name[,extra] --foreground`.
fn agent_command(srv: &Cluster, subdir: &str, path: &Path, name: &str, extra: &str) -> Command {
    let devices: Vec<String> = srv
        .luns
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    let mut opts = format!("devices={},client_name={name}", devices.join(":"));
    if !extra.is_empty() {
        opts = format!("{opts},{extra}");
    }
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_sanfs-agent"));
    cmd.arg("mount")
        .arg(format!("{}{subdir}", srv.addr))
        .arg(path)
        .arg("-o")
        .arg(&opts)
        .arg("--foreground")
        .env(
            "RUST_LOG",
            std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".to_owned()),
        )
        .stdin(Stdio::null());
    cmd
}

pub(crate) struct Mount {
    pub(crate) path: PathBuf,
    child: Option<Child>,
    _dir: tempfile::TempDir,
}

impl Mount {
    pub(crate) async fn start(srv: &Cluster, name: &str, extra: &str) -> Mount {
        Mount::start_at(srv, "", name, extra).await
    }

    /// Mounts `SERVER:PORT` followed by `subdir` (e.g. `:/some/dir`, or empty).
    async fn start_at(srv: &Cluster, subdir: &str, name: &str, extra: &str) -> Mount {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("mnt");
        std::fs::create_dir(&path).unwrap();
        let child = agent_command(srv, subdir, &path, name, extra)
            .spawn()
            .unwrap();
        let mut m = Mount {
            path,
            child: Some(child),
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while !is_mounted(&m.path) {
            if let Some(st) = m.child.as_mut().unwrap().try_wait().unwrap() {
                panic!("sanfs-agent exited before mounting: {st}");
            }
            assert!(Instant::now() < deadline, "mount did not appear in 30 s");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        m
    }

    pub(crate) fn p(&self, rel: &str) -> PathBuf {
        self.path.join(rel)
    }

    fn pid(&self) -> u32 {
        self.child.as_ref().unwrap().id()
    }

    /// Waits (at most `secs`) for the agent to exit.
    fn wait_exit(&mut self, secs: u64) -> Option<std::process::ExitStatus> {
        let child = self.child.as_mut()?;
        let deadline = Instant::now() + Duration::from_secs(secs);
        loop {
            if let Some(st) = child.try_wait().unwrap() {
                self.child = None;
                return Some(st);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        if is_mounted(&self.path) {
            let _ = rustix::mount::unmount(&self.path, rustix::mount::UnmountFlags::empty());
        }
        if self.wait_exit(10).is_none()
            && let Some(c) = self.child.as_mut()
        {
            let _ = c.kill();
            // An agent thread stuck in the kernel (a FUSE deadlock: the bug a test found)
            // keeps the process from exiting: the connection is aborted, which frees it.
            if self.wait_exit(10).is_none() {
                abort_fuse_connection(&self.path);
                let _ = self.wait_exit(30);
            }
        }
        if is_mounted(&self.path) {
            let _ = rustix::mount::unmount(&self.path, rustix::mount::UnmountFlags::DETACH);
        }
    }
}

pub(crate) fn errno_of<T: std::fmt::Debug>(r: std::io::Result<T>) -> i32 {
    r.expect_err("expected an error").raw_os_error().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mount_serves_posix_calls() {
    if !can_mount() {
        return;
    }
    let srv = cluster::start(10_000).await;
    let m = Mount::start(&srv, "posix", "").await;
    let root = m.path.clone();
    timed("posix calls", 60, move || {
        let p = |r: &str| root.join(r);
        // create, write, read
        std::fs::write(p("a.txt"), b"hello").unwrap();
        assert_eq!(std::fs::read(p("a.txt")).unwrap(), b"hello");
        // O_APPEND writes at the end
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(p("a.txt"))
            .unwrap();
        f.write_all(b", world").unwrap();
        drop(f);
        assert_eq!(std::fs::read(p("a.txt")).unwrap(), b"hello, world");
        // O_SYNC and O_DSYNC writes (each followed by an fsync at the server)
        for flag in [libc::O_SYNC, libc::O_DSYNC] {
            #[allow(
                clippy::disallowed_methods,
                reason = "a file on the mount, opened as an application opens it: not a LUN"
            )]
            let mut f = std::fs::OpenOptions::new()
                .append(true)
                .custom_flags(flag)
                .open(p("a.txt"))
                .unwrap();
            f.write_all(b"!").unwrap();
        }
        assert_eq!(std::fs::read(p("a.txt")).unwrap(), b"hello, world!!");
        // pwrite in the middle, read at an offset
        let mut f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(p("a.txt"))
            .unwrap();
        f.seek(SeekFrom::Start(7)).unwrap();
        f.write_all(b"W").unwrap();
        f.seek(SeekFrom::Start(5)).unwrap();
        let mut s = String::new();
        f.read_to_string(&mut s).unwrap();
        assert_eq!(s, ", World!!");
        // ftruncate down and up
        f.set_len(5).unwrap();
        assert_eq!(f.metadata().unwrap().len(), 5);
        f.set_len(8).unwrap();
        drop(f);
        assert_eq!(std::fs::read(p("a.txt")).unwrap(), b"hello\0\0\0");
        // O_TRUNC
        std::fs::write(p("a.txt"), b"x").unwrap();
        assert_eq!(std::fs::read(p("a.txt")).unwrap(), b"x");
        // O_EXCL
        let e = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(p("a.txt"));
        assert_eq!(errno_of(e), libc::EEXIST);
        // chmod, utimens
        std::fs::set_permissions(
            p("a.txt"),
            std::os::unix::fs::PermissionsExt::from_mode(0o600),
        )
        .unwrap();
        assert_eq!(
            std::fs::metadata(p("a.txt")).unwrap().mode() & 0o7777,
            0o600
        );
        let f = std::fs::File::open(p("a.txt")).unwrap();
        let t = std::time::UNIX_EPOCH + Duration::new(1_000_000_000, 5);
        f.set_modified(t).unwrap();
        drop(f);
        assert_eq!(
            std::fs::metadata(p("a.txt")).unwrap().modified().unwrap(),
            t
        );
        // mkdir, rename (plain, NOREPLACE, EXCHANGE), link, symlink, readdir
        std::fs::create_dir(p("d")).unwrap();
        std::fs::rename(p("a.txt"), p("d/b.txt")).unwrap();
        assert_eq!(errno_of(std::fs::metadata(p("a.txt"))), libc::ENOENT);
        std::fs::write(p("c.txt"), b"c").unwrap();
        let cwd = rustix::fs::CWD;
        let r = rustix::fs::renameat_with(
            cwd,
            p("c.txt"),
            cwd,
            p("d/b.txt"),
            rustix::fs::RenameFlags::NOREPLACE,
        );
        assert_eq!(r, Err(rustix::io::Errno::EXIST));
        rustix::fs::renameat_with(
            cwd,
            p("c.txt"),
            cwd,
            p("d/b.txt"),
            rustix::fs::RenameFlags::EXCHANGE,
        )
        .unwrap();
        assert_eq!(std::fs::read(p("c.txt")).unwrap(), b"x");
        assert_eq!(std::fs::read(p("d/b.txt")).unwrap(), b"c");
        std::fs::hard_link(p("c.txt"), p("d/hard")).unwrap();
        assert_eq!(std::fs::metadata(p("c.txt")).unwrap().nlink(), 2);
        assert_eq!(
            std::fs::metadata(p("c.txt")).unwrap().ino(),
            std::fs::metadata(p("d/hard")).unwrap().ino()
        );
        std::os::unix::fs::symlink("../c.txt", p("d/sym")).unwrap();
        assert_eq!(
            std::fs::read_link(p("d/sym")).unwrap(),
            PathBuf::from("../c.txt")
        );
        assert_eq!(std::fs::read(p("d/sym")).unwrap(), b"x");
        let mut names: Vec<String> = std::fs::read_dir(p("d"))
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        assert_eq!(names, ["b.txt", "hard", "sym"]);
        // a directory longer than one readdir reply
        std::fs::create_dir(p("many")).unwrap();
        for i in 0..300 {
            std::fs::write(p(&format!("many/file-with-a-longish-name-{i:04}")), b"").unwrap();
        }
        assert_eq!(std::fs::read_dir(p("many")).unwrap().count(), 300);
        // xattrs, including the size probe
        rustix::fs::setxattr(
            p("c.txt"),
            "user.k",
            b"value",
            rustix::fs::XattrFlags::CREATE,
        )
        .unwrap();
        assert_eq!(rustix::fs::getxattr_query(p("c.txt"), "user.k").unwrap(), 5);
        let mut buf = [0u8; 64];
        let n = rustix::fs::getxattr(p("c.txt"), "user.k", &mut buf[..]).unwrap();
        assert_eq!(&buf[..n], b"value");
        let n = rustix::fs::listxattr(p("c.txt"), &mut buf[..]).unwrap();
        assert_eq!(&buf[..n], b"user.k\0");
        let mut small = [0u8; 2];
        assert_eq!(
            rustix::fs::getxattr(p("c.txt"), "user.k", &mut small[..]),
            Err(rustix::io::Errno::RANGE)
        );
        rustix::fs::removexattr(p("c.txt"), "user.k").unwrap();
        assert_eq!(
            rustix::fs::getxattr(p("c.txt"), "user.k", &mut buf[..]),
            Err(rustix::io::Errno::NODATA)
        );
        // statfs
        let st = rustix::fs::statfs(p("")).unwrap();
        assert!(st.f_blocks > 0);
        // unlink, rmdir
        assert_eq!(errno_of(std::fs::remove_dir(p("d"))), libc::ENOTEMPTY);
        for n in ["d/b.txt", "d/hard", "d/sym"] {
            std::fs::remove_file(p(n)).unwrap();
        }
        assert_eq!(std::fs::metadata(p("c.txt")).unwrap().nlink(), 1);
        std::fs::remove_dir(p("d")).unwrap();
        std::fs::remove_file(p("c.txt")).unwrap();
        assert_eq!(errno_of(std::fs::metadata(p("d"))), libc::ENOENT);
    })
    .await;
    drop(m);
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mount_64_mib_file_round_trips_on_all_luns() {
    if !can_mount() {
        return;
    }
    let srv = cluster::start(10_000).await;
    let m = Mount::start(&srv, "big", "").await;
    let path = m.p("big");
    const LEN: usize = 64 << 20;
    let ino = timed("64 MiB write and read back", 240, move || {
        let data = crate::support::pattern(LEN, 7);
        let mut f = std::fs::File::create(&path).unwrap();
        for chunk in data.chunks(MIB as usize) {
            f.write_all(chunk).unwrap();
        }
        f.sync_all().unwrap();
        drop(f);
        assert_eq!(std::fs::metadata(&path).unwrap().len(), LEN as u64);
        let mut f = std::fs::File::open(&path).unwrap();
        let mut buf = vec![0u8; MIB as usize];
        for (i, want) in data.chunks(MIB as usize).enumerate() {
            f.read_exact(&mut buf).unwrap();
            if buf != want {
                let at = buf.iter().zip(want).position(|(a, b)| a != b).unwrap();
                panic!("differs at byte {}", i * MIB as usize + at);
            }
        }
        assert_eq!(f.read(&mut buf).unwrap(), 0, "nothing past the end");
        std::fs::metadata(&path).unwrap().ino()
    })
    .await;
    let mut data = DataClient::connect(format!("http://{}", srv.addr))
        .await
        .unwrap();
    let ext = data
        .get_extents(pb::GetExtentsRequest {
            cred: Some(cluster::root().into()),
            inode: ino,
            offset: 0,
            length: LEN as u64,
        })
        .await
        .unwrap()
        .into_inner();
    let ext = sanfs_proto::model::GetExtentsReply::try_from(ext).unwrap();
    assert_eq!(ext.file_size, LEN as u64);
    let mut devices: Vec<u32> = ext
        .extents
        .iter()
        .flat_map(|e| e.pieces.iter().map(|p| p.device.0))
        .collect();
    devices.sort_unstable();
    devices.dedup();
    assert_eq!(
        devices,
        vec![0, 1, 2, 3],
        "the file is striped over all 4 LUNs"
    );
    drop(m);
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_mounts_see_each_others_writes() {
    if !can_mount() {
        return;
    }
    let srv = cluster::start(10_000).await;
    let a = Mount::start(&srv, "node-a", "attr_ttl=0,entry_ttl=0").await;
    let b = Mount::start(&srv, "node-b", "attr_ttl=0,entry_ttl=0").await;
    let (pa, pb) = (a.p("shared"), b.p("shared"));
    timed("two nodes", 120, move || {
        let one = crate::support::pattern(3 * MIB as usize + 123, 1);
        std::fs::write(&pa, &one).unwrap();
        assert_eq!(std::fs::read(&pb).unwrap(), one, "b reads a's file");
        // b overwrites part of it (direct and proxied pieces); a sees it at once
        let two = crate::support::pattern(MIB as usize + 5000, 2);
        let mut f = std::fs::OpenOptions::new().write(true).open(&pb).unwrap();
        f.seek(SeekFrom::Start(4096 * 3 + 17)).unwrap();
        f.write_all(&two).unwrap();
        drop(f);
        let mut want = one.clone();
        want[4096 * 3 + 17..4096 * 3 + 17 + two.len()].copy_from_slice(&two);
        assert_eq!(std::fs::read(&pa).unwrap(), want, "a reads b's overwrite");
        // an append through b lands after a's view of the end
        let mut f = std::fs::OpenOptions::new().append(true).open(&pb).unwrap();
        f.write_all(b"tail").unwrap();
        drop(f);
        want.extend_from_slice(b"tail");
        assert_eq!(std::fs::read(&pa).unwrap(), want);
        std::fs::remove_file(&pa).unwrap();
        assert_eq!(errno_of(std::fs::metadata(&pb)), libc::ENOENT);
    })
    .await;
    drop(a);
    drop(b);
    srv.stop().await;
}

/// `sanfs-agent umount` of a directory that is not a mount point says so, not just EINVAL.
#[test]
fn umount_of_a_plain_directory_says_it_is_not_a_mount_point() {
    if !can_mount() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_sanfs-agent"))
        .arg("umount")
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("not a mount point"), "{err}");
}

/// A mount against an address where no server listens says "connection refused", not only
/// "transport error".
#[test]
fn a_mount_without_a_server_says_connection_refused() {
    if !can_mount() {
        return;
    }
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_sanfs-agent"))
        .arg("mount")
        .arg(format!("127.0.0.1:{port}"))
        .arg(dir.path())
        .arg("--foreground")
        .env("RUST_LOG", "error")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.to_lowercase().contains("connection refused"), "{err}");
}

/// Under systemd (Type=notify) the agent says READY=1 only once the mount exists, and
/// STOPPING=1 when it is told to stop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_notifies_systemd_once_mounted() {
    if !can_mount() {
        return;
    }
    let srv = cluster::start(10_000).await;
    let dir = tempfile::tempdir().unwrap();
    let mnt = dir.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let notify_path = dir.path().join("notify.sock");
    let notify = std::os::unix::net::UnixDatagram::bind(&notify_path).unwrap();
    notify
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let mut child = agent_command(&srv, "", &mnt, "notify", "")
        .env("NOTIFY_SOCKET", &notify_path)
        .spawn()
        .unwrap();
    let mnt2 = mnt.clone();
    let (first, mounted_then, second) = tokio::task::spawn_blocking(move || {
        let mut buf = [0u8; 256];
        let n = notify.recv(&mut buf).expect("a notification within 30 s");
        let first = String::from_utf8_lossy(&buf[..n]).into_owned();
        let mounted_then = is_mounted(&mnt2);
        rustix::process::kill_process(
            rustix::process::Pid::from_child(&child),
            rustix::process::Signal::TERM,
        )
        .unwrap();
        let n = notify.recv(&mut buf).expect("a notification at stop");
        let second = String::from_utf8_lossy(&buf[..n]).into_owned();
        let status = child.wait().unwrap();
        assert!(status.success(), "agent: {status}");
        (first, mounted_then, second)
    })
    .await
    .unwrap();
    assert!(first.contains("READY=1"), "{first:?}");
    assert!(mounted_then, "READY=1 came before the mount existed");
    assert!(second.contains("STOPPING=1"), "{second:?}");
    assert!(!is_mounted(&mnt));
    srv.stop().await;
}

/// An unsupported ioctl answers ENOTTY (what a file system without the command answers), and
/// the agent logs each command once, not once per call (fsstress made thousands of lines).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unsupported_ioctls_answer_enotty_and_are_logged_once() {
    if !can_mount() {
        return;
    }
    let srv = cluster::start(10_000).await;
    let logdir = tempfile::tempdir().unwrap();
    let log = logdir.path().join("agent.log");
    let m = Mount::start(
        &srv,
        "ioctl",
        &format!("log={},log_level=info", log.display()),
    )
    .await;
    let file = m.p("f");
    timed("ioctls", 60, move || {
        std::fs::write(&file, b"x").unwrap();
        let f = std::fs::File::open(&file).unwrap();
        for _ in 0..20 {
            let mut flags: libc::c_long = 0;
            // SAFETY: FS_IOC_GETFLAGS writes one long into `flags`, which outlives the call.
            let r = unsafe {
                libc::ioctl(
                    std::os::fd::AsRawFd::as_raw_fd(&f),
                    libc::FS_IOC_GETFLAGS,
                    &mut flags as *mut libc::c_long,
                )
            };
            assert_eq!(r, -1);
            assert_eq!(
                std::io::Error::last_os_error().raw_os_error(),
                Some(libc::ENOTTY)
            );
        }
    })
    .await;
    drop(m);
    let text = std::fs::read_to_string(&log).unwrap();
    assert_eq!(text.matches("unsupported ioctl").count(), 1, "log:\n{text}");
    srv.stop().await;
}

/// O_APPEND from two nodes at once: every record lands whole, once, and none overwrites
/// another (the end of file is the server's, taken under its whole-file lock).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn appends_from_two_mounts_keep_every_record() {
    if !can_mount() {
        return;
    }
    const RECORDS: usize = 2000;
    const LEN: usize = 64;
    let srv = cluster::start(10_000).await;
    let a = Mount::start(&srv, "node-a", "").await;
    let b = Mount::start(&srv, "node-b", "").await;
    let (pa, pb) = (a.p("log"), b.p("log"));
    timed("appends from two nodes", 180, move || {
        std::fs::write(&pa, b"").unwrap();
        let record = |node: u8, i: usize| {
            let mut r = format!("node {} record {i:06} ", node as char).into_bytes();
            r.resize(LEN - 1, node);
            r.push(b'\n');
            r
        };
        let writers: Vec<_> = [(b'a', pa.clone()), (b'b', pb.clone())]
            .into_iter()
            .map(|(node, path)| {
                std::thread::spawn(move || {
                    let mut f = std::fs::OpenOptions::new()
                        .append(true)
                        .open(&path)
                        .unwrap();
                    for i in 0..RECORDS {
                        f.write_all(&record(node, i)).unwrap();
                    }
                })
            })
            .collect();
        for w in writers {
            w.join().unwrap();
        }
        let all = std::fs::read(&pb).unwrap();
        assert_eq!(all.len(), 2 * RECORDS * LEN, "every record, once");
        let mut seen = std::collections::BTreeSet::new();
        for chunk in all.chunks(LEN) {
            let node = chunk[5];
            let i: usize = std::str::from_utf8(&chunk[14..20])
                .unwrap()
                .parse()
                .unwrap();
            assert_eq!(chunk, record(node, i).as_slice(), "a whole record");
            assert!(seen.insert((node, i)), "record {} {i} twice", node as char);
        }
        // Each node's records in the order it wrote them.
        for node in [b'a', b'b'] {
            let order: Vec<usize> = all
                .chunks(LEN)
                .filter(|c| c[5] == node)
                .map(|c| std::str::from_utf8(&c[14..20]).unwrap().parse().unwrap())
                .collect();
            assert_eq!(order, (0..RECORDS).collect::<Vec<_>>());
        }
    })
    .await;
    drop(a);
    drop(b);
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_agent_leaves_enotconn_and_unmounts() {
    if !can_mount() {
        return;
    }
    let srv = cluster::start(10_000).await;
    let mut m = Mount::start(&srv, "victim", "").await;
    let path = m.path.clone();
    let file = m.p("f");
    timed("write before the kill", 30, move || {
        std::fs::write(&file, b"data").unwrap()
    })
    .await;
    let pid = m.pid();
    let status = Command::new("kill")
        .args(["-9", &pid.to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    assert!(m.wait_exit(10).is_some(), "the agent died");
    let probe = path.clone();
    let e = timed("stat after the kill", 10, move || {
        errno_of(std::fs::metadata(probe.join("f")))
    })
    .await;
    assert_eq!(e, libc::ENOTCONN);
    assert!(is_mounted(&path), "the dead mount is still listed");
    let target = path.clone();
    timed("lazy unmount", 10, move || {
        rustix::mount::unmount(&target, rustix::mount::UnmountFlags::DETACH).unwrap()
    })
    .await;
    assert!(!is_mounted(&path));
    drop(m);
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_unmounts_on_sigterm_and_umount() {
    if !can_mount() {
        return;
    }
    let srv = cluster::start(10_000).await;
    // SIGTERM: the agent unmounts and exits cleanly.
    let mut m = Mount::start(&srv, "term", "").await;
    let status = Command::new("kill")
        .args(["-TERM", &m.pid().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let st = m.wait_exit(20).expect("the agent exits after SIGTERM");
    assert!(st.success(), "{st}");
    assert!(!is_mounted(&m.path));
    drop(m);
    // `sanfs-agent umount`: likewise.
    let mut m = Mount::start(&srv, "umount", "").await;
    let st = Command::new(env!("CARGO_BIN_EXE_sanfs-agent"))
        .arg("umount")
        .arg(&m.path)
        .status()
        .unwrap();
    assert!(st.success());
    let st = m.wait_exit(20).expect("the agent exits after umount");
    assert!(st.success(), "{st}");
    assert!(!is_mounted(&m.path));
    drop(m);
    srv.stop().await;
}

/// `sanfs-agent umount` returns once the agent has exited: a mount again at once with the
/// same `metrics=` port finds the port free (it failed with "address in use" when umount
/// returned before the agent let go of its listener).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn umount_then_mount_again_with_the_same_metrics_port() {
    if !can_mount() {
        return;
    }
    let srv = cluster::start(10_000).await;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let metrics = format!("metrics=127.0.0.1:{port}");
    for round in 0..3 {
        let mut m = Mount::start(&srv, &format!("metrics-{round}"), &metrics).await;
        let got = std::net::TcpStream::connect(("127.0.0.1", port));
        assert!(
            got.is_ok(),
            "round {round}: the agent serves metrics on {port}"
        );
        drop(got);
        let st = Command::new(env!("CARGO_BIN_EXE_sanfs-agent"))
            .arg("umount")
            .arg(&m.path)
            .status()
            .unwrap();
        assert!(st.success());
        // Exited already (not merely unmounted): its status is there at once.
        let st = m
            .wait_exit(0)
            .expect("the agent has exited when umount returns");
        assert!(st.success(), "{st}");
    }
    srv.stop().await;
}

/// `devices=` globs that match none of the volume's LUNs: the mount is refused with the
/// reason (every byte would go through the server), unless `allow_proxied_only`, with which it
/// mounts, works through the server, and `sanfs-agent status` warns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn devices_matching_no_lun_refuse_the_mount_unless_allow_proxied_only() {
    if !can_mount() {
        return;
    }
    let srv = cluster::start(10_000).await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("mnt");
    std::fs::create_dir(&path).unwrap();
    let none = dir.path().join("no-such-lun*");
    let agent = |extra: &str| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_sanfs-agent"));
        c.arg("mount")
            .arg(srv.addr.to_string())
            .arg(&path)
            .arg("-o")
            .arg(format!(
                "devices={},client_name=h10-no-lun{extra}",
                none.display()
            ))
            .arg("--foreground")
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null());
        c
    };
    let out = timed("mount without LUNs", 60, {
        let mut c = agent("");
        move || c.output().unwrap()
    })
    .await;
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "mounted without any LUN: {err}");
    assert!(
        err.contains("none of the volume's 4 LUNs was found under devices=")
            && err.contains("allow_proxied_only"),
        "{err}"
    );
    assert!(!is_mounted(&path));

    let child = agent(",allow_proxied_only").spawn().unwrap();
    let m = Mount {
        path: path.clone(),
        child: Some(child),
        _dir: dir,
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while !is_mounted(&m.path) {
        assert!(Instant::now() < deadline, "allow_proxied_only: no mount");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let data = vec![5u8; 3 * MIB as usize];
    let f = m.p("f");
    let back = timed("write and read through the server", 60, {
        let data = data.clone();
        move || {
            std::fs::write(&f, &data).unwrap();
            std::fs::read(&f).unwrap()
        }
    })
    .await;
    assert!(back == data, "3 MiB read back through the server");
    let out = Command::new(env!("CARGO_BIN_EXE_sanfs-agent"))
        .arg("status")
        .arg(&m.path)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("0 of 4 found")
            && text.contains("WARN")
            && text.contains("allow_proxied_only"),
        "{text}"
    );
    drop(m);
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subdir_mount_read_only() {
    if !can_mount() {
        return;
    }
    let srv = cluster::start(10_000).await;
    let a = Mount::start(&srv, "writer", "").await;
    let (sub, file) = (a.p("exports/one"), a.p("exports/one/f"));
    timed("prepare the sub-directory", 30, move || {
        std::fs::create_dir_all(&sub).unwrap();
        std::fs::write(&file, b"in the subdir").unwrap();
    })
    .await;
    let b = Mount::start_at(&srv, ":/exports/one", "reader", "ro").await;
    let root = b.path.clone();
    timed("read through the sub-directory mount", 30, move || {
        assert_eq!(std::fs::read(root.join("f")).unwrap(), b"in the subdir");
        let names: Vec<_> = std::fs::read_dir(&root)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["f"]);
        assert_eq!(std::fs::metadata(&root).unwrap().ino(), 1);
        assert_eq!(errno_of(std::fs::write(root.join("g"), b"x")), libc::EROFS);
    })
    .await;
    drop(b);
    // A sub-directory that does not exist: the agent refuses to mount.
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_sanfs-agent"))
        .arg("mount")
        .arg(format!("{}:/no/such", srv.addr))
        .arg(dir.path())
        .arg("--foreground")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(!is_mounted(dir.path()));
    drop(a);
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_file_survives_a_server_restart() {
    if !can_mount() {
        return;
    }
    let mut srv = cluster::start(2_000).await;
    let m = Mount::start(&srv, "restart", "").await;
    let path = m.p("f");
    let f = timed("open and write", 30, move || {
        let mut f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        f.write_all(b"before").unwrap();
        f
    })
    .await;
    // A new server epoch: the agent's session and its open handles are gone.
    srv.restart().await;
    let back = timed("write and read through the old descriptor", 60, move || {
        let mut f = f;
        f.write_all(b" after").unwrap();
        f.seek(SeekFrom::Start(0)).unwrap();
        let mut s = String::new();
        f.read_to_string(&mut s).unwrap();
        s
    })
    .await;
    assert_eq!(back, "before after");
    drop(m);
    srv.stop().await;
}

/// `fcntl(F_SETLK / F_GETLK)` of a write lock on `[start, start + len)`; the conflict's
/// `(type, pid)` for F_GETLK.
fn fcntl_lock(
    file: &std::fs::File,
    cmd: i32,
    typ: i32,
    start: i64,
    len: i64,
) -> std::io::Result<(i32, i32)> {
    use std::os::fd::AsRawFd;
    // SAFETY: an all-zero `struct flock` is a valid value of the plain C struct.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = typ as i16;
    fl.l_whence = libc::SEEK_SET as i16;
    fl.l_start = start;
    fl.l_len = len;
    // SAFETY: the descriptor is open for the call's duration and `fl` outlives it.
    let r = unsafe { libc::fcntl(file.as_raw_fd(), cmd, &mut fl) };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok((i32::from(fl.l_type), fl.l_pid))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locks_exclude_each_other_across_two_mounts() {
    if !can_mount() {
        return;
    }
    let srv = cluster::start(10_000).await;
    let m1 = Mount::start(&srv, "lock1", "").await;
    let m2 = Mount::start(&srv, "lock2", "").await;
    let (p1, p2) = (m1.p("shared.lock"), m2.p("shared.lock"));
    std::fs::write(&p1, b"x").unwrap();

    // fcntl: a write lock through mount 1 (node 1) is seen and refused through mount 2.
    let pid = std::process::id() as i32;
    let (q1, q2) = (p1.clone(), p2.clone());
    timed("fcntl across mounts", 30, move || {
        let f1 = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&q1)
            .unwrap();
        let f2 = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&q2)
            .unwrap();
        fcntl_lock(&f1, libc::F_SETLK, libc::F_WRLCK, 0, 100).unwrap();
        let e = fcntl_lock(&f2, libc::F_SETLK, libc::F_RDLCK, 50, 1).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EAGAIN));
        let (typ, holder) = fcntl_lock(&f2, libc::F_GETLK, libc::F_RDLCK, 0, 0).unwrap();
        assert_eq!((typ, holder), (i32::from(libc::F_WRLCK as i16), pid));
        // Outside the range: fine. Closing node 1's descriptor drops its locks.
        fcntl_lock(&f2, libc::F_SETLK, libc::F_WRLCK, 100, 10).unwrap();
        drop(f1);
        fcntl_lock(&f2, libc::F_SETLK, libc::F_WRLCK, 0, 100).unwrap();
    })
    .await;

    // flock(1) through mount 1 holds the file for a while; through mount 2 `flock -n` is
    // refused, and a blocking flock gets it once the holder exits.
    let marker = m1.p("held");
    let holder = Command::new("flock")
        .arg(&p1)
        .arg("-c")
        .arg(format!("touch {}; sleep 2", marker.display()))
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while !marker.exists() {
        assert!(Instant::now() < deadline, "the holder never got the lock");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let p2b = p2.clone();
    let refused = timed("flock -n", 30, move || {
        Command::new("flock")
            .args(["-n", "-E", "42"])
            .arg(&p2b)
            .arg("true")
            .status()
            .unwrap()
    })
    .await;
    assert_eq!(
        refused.code(),
        Some(42),
        "flock -n through the other mount is refused"
    );
    let waited = timed("flock", 30, move || {
        let t = Instant::now();
        let st = Command::new("flock").arg(&p2).arg("true").status().unwrap();
        (st, t.elapsed())
    })
    .await;
    assert!(waited.0.success());
    eprintln!("the blocking flock through mount 2 waited {:?}", waited.1);
    let mut holder = holder;
    assert!(holder.wait().unwrap().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sparse_files_seek_data_and_holes_and_shared_mmap_writes_reach_other_nodes() {
    if !can_mount() {
        return;
    }
    let srv = cluster::start(10_000).await;
    let m1 = Mount::start(&srv, "seek1", "").await;
    let m2 = Mount::start(&srv, "seek2", "attr_ttl=0,entry_ttl=0").await;
    let (p1, p2) = (m1.p("sparse"), m2.p("sparse"));
    timed("seek and mmap", 60, move || {
        use std::os::fd::AsRawFd;
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&p1)
            .unwrap();
        let block = vec![0xabu8; 64 * 1024];
        f.write_all_at(&block, 0).unwrap();
        f.write_all_at(&block, 2 * MIB).unwrap();
        let size = 2 * MIB + 64 * 1024;
        let seek = |off: u64, whence: i32| {
            // SAFETY: lseek on a descriptor open for the call's duration.
            let r = unsafe { libc::lseek(f.as_raw_fd(), off as i64, whence) };
            if r < 0 {
                Err(std::io::Error::last_os_error().raw_os_error().unwrap())
            } else {
                Ok(r as u64)
            }
        };
        assert_eq!(seek(0, libc::SEEK_DATA), Ok(0));
        assert_eq!(seek(0, libc::SEEK_HOLE), Ok(64 * 1024));
        assert_eq!(seek(100_000, libc::SEEK_DATA), Ok(2 * MIB));
        assert_eq!(seek(100_000, libc::SEEK_HOLE), Ok(100_000));
        assert_eq!(
            seek(2 * MIB + 5, libc::SEEK_HOLE),
            Ok(size),
            "the end of file is a hole"
        );
        assert_eq!(seek(size, libc::SEEK_DATA), Err(libc::ENXIO));

        // A shared writable mapping: the bytes written into it reach the LUNs at msync, and
        // another node reads them.
        let mut map = SharedMapping::new(&f, 8192);
        assert!(
            map.bytes().iter().all(|b| *b == 0xab),
            "the mapping shows the file"
        );
        map.bytes()[100..105].copy_from_slice(b"mmap!");
        map.sync();
        drop(map);
        let mut got = [0u8; 5];
        std::fs::File::open(&p2)
            .unwrap()
            .read_exact_at(&mut got, 100)
            .unwrap();
        assert_eq!(&got, b"mmap!");
    })
    .await;
}

/// Runs `argv` as uid/gid 1000 with no supplementary groups (`setpriv`), under a 10 s
/// `timeout`; returns its exit status and standard output.
pub(crate) fn as_uid_1000(argv: &[&str]) -> (std::process::ExitStatus, Vec<u8>) {
    let out = Command::new("setpriv")
        .args([
            "--reuid=1000",
            "--regid=1000",
            "--clear-groups",
            "timeout",
            "10",
        ])
        .args(argv)
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .unwrap();
    (out.status, out.stdout)
}

/// Bytes this node holds back and an attribute change after them keep the application's
/// order: a `chmod u+s` by the file's owner after its write keeps the bit, a `futimens` after
/// a write (as `cp -p` does) keeps its mtime, and a write after a `chmod u+s` clears the bit
/// (the writer's node having looked at the file in between). Each seen through this node and
/// another node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_back_writes_and_attribute_changes_keep_the_applications_order() {
    use std::os::unix::fs::PermissionsExt;
    if !can_mount() {
        return;
    }
    let srv = cluster::start(10_000).await;
    let m = Mount::start(&srv, "order", "allow_other").await;
    let other = Mount::start(&srv, "order-other", "").await;
    // uid 1000 must reach the mount point: the temp dir above it is 0700.
    std::fs::set_permissions(
        m.path.parent().unwrap(),
        std::fs::Permissions::from_mode(0o755),
    )
    .unwrap();
    let (f, g, mnt) = (m.p("f"), other.p("f"), m.path.clone());
    let (t, u) = (m.p("times"), other.p("times"));
    timed("held-back writes and attribute changes", 120, move || {
        let mode = |p: &Path| std::fs::metadata(p).unwrap().mode() & 0o7777;
        let both = |want: u32, what: &str| {
            assert_eq!(mode(&f), want, "{what}: this node");
            assert_eq!(mode(&g), want, "{what}: another node");
        };
        let held = || {
            agent_status(&mnt)["agent"]["write_back"]["held_writes"]
                .as_u64()
                .unwrap()
        };
        let held_before = held();
        std::fs::write(&f, vec![7u8; 5000]).unwrap();
        std::os::unix::fs::chown(&f, Some(1000), Some(1000)).unwrap();
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o755)).unwrap();
        let file = f.to_str().unwrap();
        // A write in place, then chmod u+s, then close.
        let script = format!("exec 3<>{file}; printf abc >&3; chmod 4755 {file}; exec 3>&-");
        let (st, _) = as_uid_1000(&["sh", "-c", &script]);
        assert!(st.success(), "uid 1000 writes, then sets setuid");
        both(0o4755, "chmod u+s after a write");
        // chmod u+s, a write in place, a look at the file, then close.
        let script = format!(
            "chmod 4755 {file}; exec 3<>{file}; printf xyz >&3; stat -c %a {file}; exec 3>&-"
        );
        let (st, _) = as_uid_1000(&["sh", "-c", &script]);
        assert!(st.success(), "uid 1000 sets setuid, then writes");
        both(0o755, "a write by uid 1000 after chmod u+s");
        // A write, then its mtime set on the open file, then close (`cp -p`).
        let when = std::time::UNIX_EPOCH + Duration::from_secs(1_000_000_000);
        {
            let w = std::fs::File::create(&t).unwrap();
            use std::io::Write;
            (&w).write_all(&[9u8; 5000]).unwrap();
            w.set_times(std::fs::FileTimes::new().set_modified(when))
                .unwrap();
        }
        let mtime = |p: &Path| std::fs::metadata(p).unwrap().modified().unwrap();
        assert_eq!(mtime(&t), when, "the mtime set after a write: this node");
        assert_eq!(mtime(&u), when, "the mtime set after a write: another node");
        assert!(held() > held_before, "writes were held back");
    })
    .await;
    drop(m);
    drop(other);
    srv.stop().await;
}

/// A node that holds a file's pages in its kernel (a reader's open) and changes its mode
/// after another node rewrote it: the answer to the `chmod` is the first to carry the new
/// mtime, and the kernel takes it without dropping its pages (as it would for a `GETATTR`'s);
/// the agent drops them before it answers, so the next read sees the other node's bytes
/// (exerciser seed 11772079121994438444, op #32254).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chmod_answer_that_shows_another_nodes_write_drops_the_cached_pages() {
    use std::io::Read as _;
    use std::os::unix::fs::{FileExt as _, PermissionsExt as _};
    if !can_mount() {
        return;
    }
    let srv = cluster::start(10_000).await;
    let a = Mount::start(&srv, "chmod-pages-a", "").await;
    let b = Mount::start(&srv, "chmod-pages-b", "").await;
    let (pa, pb) = (a.p("f"), b.p("f"));
    timed("a chmod answer and the cached pages", 60, move || {
        std::fs::write(&pa, vec![1u8; 196_608]).unwrap();
        for round in 2u8..6 {
            let mut reader = std::fs::File::open(&pa).unwrap();
            let mut seen = Vec::new();
            reader.read_to_end(&mut seen).unwrap();
            assert!(seen.iter().all(|b| *b == round - 1));
            // The other node rewrites in place: same size, a new mtime.
            std::thread::sleep(Duration::from_millis(20));
            let w = std::fs::OpenOptions::new().write(true).open(&pb).unwrap();
            w.write_all_at(&vec![round; 196_608], 0).unwrap();
            drop(w);
            let mode = if round % 2 == 0 { 0o600 } else { 0o644 };
            reader
                .set_permissions(std::fs::Permissions::from_mode(mode))
                .unwrap();
            let mut got = vec![0u8; 196_608];
            reader.read_exact_at(&mut got, 0).unwrap();
            let stale = got.iter().filter(|b| **b != round).count();
            assert_eq!(
                stale, 0,
                "round {round}: old bytes after the other node's write"
            );
        }
    })
    .await;
    drop(a);
    drop(b);
    srv.stop().await;
}

/// An explicit mtime set through one node after another node's write returned (held back
/// there, or completed behind it) stays: the server ends the other node's write delegation
/// and layouts before it applies the change, so no write-back or completion sets the mtime
/// after it (exerciser seed 7991677471961935470, op #56283).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_mtime_set_after_another_nodes_write_is_not_undone_by_it() {
    use std::os::unix::fs::FileExt as _;
    if !can_mount() {
        return;
    }
    let srv = cluster::start(10_000).await;
    let a = Mount::start(&srv, "mtime-a", "").await;
    let b = Mount::start(&srv, "mtime-b", "").await;
    let (pa, pb) = (a.p("f"), b.p("f"));
    timed("an mtime after another node's write", 60, move || {
        let when = std::time::UNIX_EPOCH + Duration::from_secs(1_000_000_000);
        std::fs::write(&pa, [1u8; 10]).unwrap();
        for (round, len) in [(0u8, 4096usize), (1, 65_536), (2, 1 << 20)] {
            // Both open first: the writer's node then holds the file alone.
            let wa = std::fs::OpenOptions::new().write(true).open(&pa).unwrap();
            let hb = std::fs::File::open(&pb).unwrap();
            wa.write_all_at(&vec![round; len], 0).unwrap();
            hb.set_times(std::fs::FileTimes::new().set_modified(when))
                .unwrap();
            drop(wa);
            drop(hb);
            for p in [&pa, &pb] {
                let got = std::fs::metadata(p).unwrap().modified().unwrap();
                assert_eq!(got, when, "round {round} ({len} bytes): {}", p.display());
            }
        }
    })
    .await;
    drop(a);
    drop(b);
    srv.stop().await;
}

/// A cut to the middle of a block leaves the old bytes past the new end in that block; a
/// write past the end later must find them zeroed. Here the writer's next write starts the
/// file (offset 0, held back, then written back under a write layout 8 MiB long, which
/// reaches past the end of file), and a write past the end inside that layout asks the
/// server nothing: the grant itself must have zeroed the tail (exerciser seed
/// 7991677471961935470, op #25925: 2,136 old bytes read back after the cut).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_layout_past_a_cut_end_of_file_reads_zeros_between() {
    use std::os::unix::fs::FileExt as _;
    if !can_mount() {
        return;
    }
    let srv = cluster::start(10_000).await;
    let m = Mount::start(&srv, "cut-tail", "").await;
    let other = Mount::start(&srv, "cut-tail-other", "").await;
    let (here, there) = (m.p("f"), other.p("f"));
    timed("a layout past a cut end of file", 60, move || {
        let (cut, far) = (1_488_808u64, 1_683_456u64);
        std::fs::write(&here, crate::support::pattern(5_177_346, 3)).unwrap();
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&here)
            .unwrap();
        f.set_len(cut).unwrap();
        f.write_all_at(&crate::support::pattern(65_536, 4), 0)
            .unwrap();
        f.write_all_at(&crate::support::pattern(4096, 5), far)
            .unwrap();
        drop(f);
        for p in [&here, &there] {
            let bytes = std::fs::read(p).unwrap();
            assert_eq!(bytes.len() as u64, far + 4096);
            let gap = &bytes[cut as usize..far as usize];
            let stale = gap.iter().filter(|b| **b != 0).count();
            assert_eq!(
                stale,
                0,
                "{}: old bytes between the cut and the write",
                p.display()
            );
        }
    })
    .await;
    drop(m);
    drop(other);
    srv.stop().await;
}

/// Attribute changes of a file made on this node and held under its write delegation
/// (`chmod`, `futimens`, a `chown` to its own owners: what `tar x` does to each file it
/// writes) are answered without a call and sent after the held-back bytes, in the last
/// proxied `Write` of those bytes (`WriteRequest.then_set_attr`):
/// exact on this node and, through the recall, on another node while the file is still open;
/// in the application's order (a `chown` after a `chmod u+s` clears the bit, one before it
/// does not; a write after a `futimens` moves the mtime on); and an open by another user on
/// this node is checked against the mode set.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_back_attribute_changes_are_exact_everywhere_and_in_order() {
    use std::io::Write;
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    if !can_mount() {
        return;
    }
    let srv = cluster::start(10_000).await;
    let m = Mount::start(&srv, "held-attrs", "allow_other").await;
    let other = Mount::start(&srv, "held-attrs-other", "").await;
    // uid 1000 must reach the mount point: the temp dir above it is 0700.
    std::fs::set_permissions(
        m.path.parent().unwrap(),
        std::fs::Permissions::from_mode(0o755),
    )
    .unwrap();
    let (mnt, here, there) = (m.path.clone(), m.path.clone(), other.path.clone());
    timed("held-back attribute changes", 120, move || {
        let counter = |name: &str| {
            agent_status(&mnt)["agent"]["write_back"][name]
                .as_u64()
                .unwrap()
        };
        let create = |name: &str| {
            std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(here.join(name))
                .unwrap()
        };
        let when = std::time::UNIX_EPOCH + Duration::from_secs(1_000_000_000);
        let look = |name: &str| {
            [&here, &there].map(|dir| {
                let md = std::fs::metadata(dir.join(name)).unwrap();
                (md.mode() & 0o7777, md.modified().unwrap(), md.len())
            })
        };

        // tar's order: write, the mtime, the owners it has, the mode (setuid kept).
        let (held, sent) = (counter("held_attrs"), counter("attr_flushes"));
        let with_bytes = counter("attrs_with_bytes");
        let f = create("tar");
        (&f).write_all(&[5u8; 5000]).unwrap();
        f.set_times(std::fs::FileTimes::new().set_modified(when))
            .unwrap();
        std::os::unix::fs::fchown(&f, Some(0), Some(0)).unwrap();
        f.set_permissions(std::fs::Permissions::from_mode(0o4755))
            .unwrap();
        assert_eq!(
            counter("held_attrs") - held,
            3,
            "the three changes were held back"
        );
        assert_eq!(counter("attr_flushes"), sent, "and not sent yet");
        let [mine, theirs] = look("tar");
        assert_eq!(mine, (0o4755, when, 5000), "this node, the file open");
        assert_eq!(
            theirs,
            (0o4755, when, 5000),
            "another node, the file open here"
        );
        drop(f);
        assert_eq!(look("tar"), [(0o4755, when, 5000); 2], "after close");
        // Sent by the write-back (the recall's), in the bytes' own proxied `Write`.
        assert_eq!(
            counter("attrs_with_bytes"),
            with_bytes + 1,
            "sent with the bytes"
        );
        assert_eq!(
            counter("attr_flushes"),
            sent,
            "not in a SetAttr of their own"
        );

        // chmod u+s, then a chown to the same owners: the chown clears the bit.
        let f = create("kill");
        (&f).write_all(&[6u8; 3000]).unwrap();
        f.set_permissions(std::fs::Permissions::from_mode(0o4755))
            .unwrap();
        std::os::unix::fs::fchown(&f, Some(0), Some(0)).unwrap();
        assert_eq!(
            look("kill").map(|l| l.0),
            [0o755; 2],
            "chown after chmod u+s"
        );
        drop(f);
        assert_eq!(look("kill").map(|l| l.0), [0o755; 2], "after close");

        // A write after the mtime was set moves it on.
        let f = create("later");
        (&f).write_all(&[7u8; 1000]).unwrap();
        f.set_times(std::fs::FileTimes::new().set_modified(when))
            .unwrap();
        (&f).write_all(&[8u8; 1000]).unwrap();
        drop(f);
        for (mode, mtime, len) in look("later") {
            assert_eq!((mode, len), (0o600, 2000));
            assert!(mtime > when, "a write after futimens sets the mtime");
        }

        // Another user on this node opens the file by the mode set while it is open here.
        let f = create("shared");
        (&f).write_all(b"readable now").unwrap();
        let held = counter("held_attrs");
        f.set_permissions(std::fs::Permissions::from_mode(0o644))
            .unwrap();
        assert_eq!(counter("held_attrs"), held + 1, "the chmod was held back");
        let path = here.join("shared");
        let (st, out) = as_uid_1000(&["cat", path.to_str().unwrap()]);
        assert!(st.success(), "uid 1000 reads a file made 0644 here");
        assert_eq!(out, b"readable now");
        drop(f);
        assert_eq!(look("shared").map(|l| l.0), [0o644; 2]);
    })
    .await;
    drop(m);
    drop(other);
    srv.stop().await;
}

/// The mount leaves clearing setuid/setgid and file capabilities to the server
/// (`FUSE_HANDLE_KILLPRIV_V2`: the kernel sends a chown or truncate as it is, without asking
/// for the attributes first), which must do what the kernel would: a truncate or write by
/// another user than root clears setuid, and setgid where the group may execute; root's
/// keeps them; a chown clears them, also root's; a chown or truncate removes
/// `security.capability`. Each seen through this node and another node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn setuid_setgid_and_file_capabilities_go_as_the_kernel_drops_them() {
    use std::os::unix::fs::PermissionsExt;
    if !can_mount() {
        return;
    }
    let srv = cluster::start(10_000).await;
    let m = Mount::start(&srv, "killpriv", "allow_other").await;
    let other = Mount::start(&srv, "killpriv-other", "").await;
    // uid 1000 must reach the mount point: the temp dir above it is 0700.
    std::fs::set_permissions(
        m.path.parent().unwrap(),
        std::fs::Permissions::from_mode(0o755),
    )
    .unwrap();
    let (f, g) = (m.p("f"), other.p("f"));
    timed("setuid, setgid and capabilities", 120, move || {
        let mode = |p: &Path| std::fs::metadata(p).unwrap().mode() & 0o7777;
        let set = |m: u32| {
            std::fs::set_permissions(&f, std::fs::Permissions::from_mode(m)).unwrap();
            assert_eq!(mode(&f), m);
        };
        let both = |want: u32, what: &str| {
            assert_eq!(mode(&f), want, "{what}: this node");
            assert_eq!(mode(&g), want, "{what}: another node");
        };
        std::fs::write(&f, b"0123456789abcdef").unwrap();
        std::os::unix::fs::chown(&f, Some(1000), Some(1000)).unwrap();
        set(0o6775);
        // uid 1000 truncates its file: both bits go (the group may execute).
        let (st, _) = as_uid_1000(&["truncate", "-s", "10", f.to_str().unwrap()]);
        assert!(st.success(), "uid 1000 truncates its file");
        both(0o775, "a truncate by uid 1000");
        // Without group execute, setgid stays (it marks locking, not privilege).
        set(0o6764);
        let (st, _) = as_uid_1000(&["truncate", "-s", "8", f.to_str().unwrap()]);
        assert!(st.success());
        both(
            0o2764,
            "a truncate by uid 1000 of a file the group cannot execute",
        );
        // A write by uid 1000.
        set(0o6775);
        let script = format!("printf x >> {}", f.display());
        let (st, _) = as_uid_1000(&["sh", "-c", &script]);
        assert!(st.success(), "uid 1000 appends to its file");
        both(0o775, "a write by uid 1000");
        // A small write in place (held back under the file's delegation, written at close).
        set(0o6775);
        let of = format!("of={}", f.display());
        let (st, _) = as_uid_1000(&[
            "dd",
            "if=/dev/zero",
            &of,
            "bs=3",
            "count=1",
            "seek=1",
            "conv=notrunc",
        ]);
        assert!(st.success(), "uid 1000 writes in place");
        both(0o775, "a write in place by uid 1000");
        set(0o6775);
        // Root's truncate keeps both.
        std::fs::OpenOptions::new()
            .write(true)
            .open(&f)
            .unwrap()
            .set_len(4)
            .unwrap();
        both(0o6775, "a truncate by root");
        // A chown clears them, root's too.
        std::os::unix::fs::chown(&f, Some(1000), Some(1000)).unwrap();
        both(0o775, "a chown");
        // File capabilities (a version 2 `vfs_cap_data`: CAP_NET_RAW permitted and
        // effective) go at a chown, a truncate and a write (root's too).
        let cap: [u8; 20] = {
            let mut c = [0u8; 20];
            c[..4].copy_from_slice(&0x0200_0001u32.to_le_bytes());
            c[4..8].copy_from_slice(&(1u32 << 13).to_le_bytes());
            c
        };
        let has_cap = |p: &Path| {
            let mut buf = [0u8; 64];
            match rustix::fs::getxattr(p, "security.capability", &mut buf[..]) {
                Ok(n) => Some(buf[..n].to_vec()),
                Err(rustix::io::Errno::NODATA) => None,
                Err(e) => panic!("getxattr {}: {e}", p.display()),
            }
        };
        let changes = ["chown", "truncate", "small write", "long write"];
        for (k, change) in changes.into_iter().enumerate() {
            rustix::fs::setxattr(
                &f,
                "security.capability",
                &cap,
                rustix::fs::XattrFlags::empty(),
            )
            .unwrap();
            assert_eq!(has_cap(&f).as_deref(), Some(&cap[..]), "{change}: set");
            assert_eq!(
                has_cap(&g).as_deref(),
                Some(&cap[..]),
                "{change}: seen elsewhere"
            );
            match k {
                0 => std::os::unix::fs::chown(&f, Some(0), Some(0)).unwrap(),
                1 => std::fs::OpenOptions::new()
                    .write(true)
                    .open(&f)
                    .unwrap()
                    .set_len(2)
                    .unwrap(),
                // Root's writes too (a changed binary keeps no capability): one held back
                // on this node, one long enough to go to the LUNs at once.
                _ => {
                    let mut file = std::fs::OpenOptions::new().write(true).open(&f).unwrap();
                    let len = if k == 2 { 1 } else { 300 << 10 };
                    std::io::Write::write_all(&mut file, &vec![b'w'; len]).unwrap();
                    assert_eq!(has_cap(&f), None, "after a {change}, still open");
                }
            }
            assert_eq!(has_cap(&f), None, "after a {change}: this node");
            assert_eq!(has_cap(&g), None, "after a {change}: another node");
        }
    })
    .await;
    drop(m);
    drop(other);
    srv.stop().await;
}

/// Issue 16 item 5: on an `allow_other` mount every access is permission-checked, also
/// through dentries the kernel has cached for root and for objects the kernel serves itself.
/// uid 1000 cannot read a 0644 file inside root's 0700 directory while root keeps using that
/// file (100 tries, each interleaved with root's reads), nor open root's 0600 FIFO.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allow_other_mount_checks_permissions_for_other_users() {
    use std::os::unix::fs::PermissionsExt;
    if !can_mount() {
        return;
    }
    let srv = cluster::start(10_000).await;
    let m = Mount::start(&srv, "perms", "allow_other").await;
    // uid 1000 must reach the mount point: the temp dir above it is 0700.
    std::fs::set_permissions(
        m.path.parent().unwrap(),
        std::fs::Permissions::from_mode(0o755),
    )
    .unwrap();
    let root = m.path.clone();
    timed("root-only objects and uid 1000 attempts", 300, move || {
        use std::sync::atomic::{AtomicBool, Ordering};
        let (dir, file, fifo) = (root.join("d"), root.join("d/f"), root.join("fifo"));
        std::fs::create_dir(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
        std::fs::write(&file, b"root's secret\n").unwrap();
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
        let st = Command::new("mkfifo")
            .arg("-m600")
            .arg(&fifo)
            .status()
            .unwrap();
        assert!(st.success(), "mkfifo");
        // The test can fail: uid 1000 reads a file of its own on this mount.
        let open_dir = root.join("open");
        std::fs::create_dir(&open_dir).unwrap();
        std::fs::set_permissions(&open_dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::write(open_dir.join("f"), b"anyone\n").unwrap();
        let (st, out) = as_uid_1000(&["cat", open_dir.join("f").to_str().unwrap()]);
        assert!(
            st.success() && out == b"anyone\n",
            "uid 1000 reads a 0644 file in a 0755 dir"
        );

        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let root_user = {
            let (stop, file) = (std::sync::Arc::clone(&stop), file.clone());
            std::thread::spawn(move || {
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    assert_eq!(std::fs::read(&file).unwrap(), b"root's secret\n");
                    std::fs::metadata(&file).unwrap();
                    n += 1;
                }
                n
            })
        };
        let path = file.to_str().unwrap().to_owned();
        let mut leaked = 0;
        for _ in 0..100 {
            let (st, out) = as_uid_1000(&["cat", &path]);
            if st.success() || !out.is_empty() {
                leaked += 1;
            }
        }
        stop.store(true, Ordering::Relaxed);
        let root_reads = root_user.join().unwrap();
        assert!(root_reads > 0, "root used the file meanwhile");
        assert_eq!(leaked, 0, "uid 1000 read through root's 0700 directory");

        // `<>` opens read-write, which does not wait for a writer: without a permission
        // check it succeeds at once.
        let (st, _) = as_uid_1000(&["sh", "-c", &format!(": <> {}", fifo.display())]);
        assert!(!st.success(), "uid 1000 opened root's 0600 FIFO");
        // Root still can.
        let st = Command::new("timeout")
            .args(["10", "sh", "-c", &format!(": <> {}", fifo.display())])
            .status()
            .unwrap();
        assert!(st.success(), "root opens its FIFO");
    })
    .await;
    drop(m);
    srv.stop().await;
}

/// The agent's status of mount `path`, as JSON, asked over its control socket from this
/// process (a `sanfs-agent status` child would be a fork and exec, which closes this
/// process's descriptors of files on the mount in the child: a FUSE flush, a close).
/// A field (`calls`, `bytes`, `wall_ns`, `cpu_ns`) of one of the agent's stages in an
/// [`agent_status`].
fn stage(st: &serde_json::Value, name: &str, field: &str) -> u64 {
    st["agent"]["stages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["stage"] == name)
        .unwrap_or_else(|| panic!("no stage {name} in {st}"))[field]
        .as_u64()
        .unwrap()
}

pub(crate) fn agent_status(path: &Path) -> serde_json::Value {
    use sanfs_client_agent::control;
    let (entry, _) = control::mount_of(path).unwrap();
    let socket = control::socket_path(&control::run_dir(), entry.major, entry.minor);
    let st = control::ask(&socket, &control::Request::Status)
        .unwrap()
        .status
        .unwrap();
    serde_json::to_value(&st).unwrap()
}

/// A seed for a randomized test, printed (`SANFS_SEED` repeats one).
pub(crate) fn test_seed(what: &str) -> u64 {
    let seed = std::env::var("SANFS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            use std::hash::{BuildHasher, Hasher};
            std::collections::hash_map::RandomState::new()
                .build_hasher()
                .finish()
        });
    println!("{what}: seed {seed} (SANFS_SEED={seed} repeats it)");
    seed
}

pub(crate) fn xorshift(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

/// Small buffered writes of one node are held back under its write delegation (no fsync, no
/// close), and another node's read sees every byte of them at once: the read recalls the
/// delegation, and the recall is answered only once they are written. Then again, after the
/// writer took a new delegation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_back_writes_are_read_by_another_node_at_once() {
    if !can_mount() {
        return;
    }
    let srv = cluster::start(10_000).await;
    let a = Mount::start(&srv, "node-a", "").await;
    let b = Mount::start(&srv, "node-b", "").await;
    let (pa, pb, mnt_a) = (a.p("f"), b.p("f"), a.path.clone());
    let mut x = test_seed("held-back writes") | 1;
    timed("held-back writes read elsewhere", 240, move || {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new()
            .create(true)
            .truncate(true)
            .read(true)
            .write(true)
            .open(&pa)
            .unwrap();
        let mut model: Vec<u8> = Vec::new();
        for round in 0..6u8 {
            for i in 0..300u32 {
                // Mostly sequential appends of odd sizes, some rewrites inside.
                let len = 1 + (xorshift(&mut x) % 9000) as usize;
                let off = if i % 4 == 3 && !model.is_empty() {
                    (xorshift(&mut x) % model.len() as u64) as usize
                } else {
                    model.len()
                };
                let data: Vec<u8> = (0..len)
                    .map(|k| (k as u8).wrapping_mul(31).wrapping_add(round ^ (i as u8)))
                    .collect();
                f.write_all_at(&data, off as u64).unwrap();
                if model.len() < off + len {
                    model.resize(off + len, 0);
                }
                model[off..off + len].copy_from_slice(&data);
            }
            let got = std::fs::read(&pb).unwrap();
            assert_eq!(got.len(), model.len(), "round {round}: the size B reads");
            if let Some(at) = got.iter().zip(&model).position(|(g, m)| g != m) {
                panic!(
                    "round {round}: byte {at} differs: B read {} for {}",
                    got[at], model[at]
                );
            }
            // The writer asks for its delegation again after a recall's quiet second.
            std::thread::sleep(Duration::from_millis(1200));
        }
        let st = agent_status(&mnt_a);
        let wb = &st["agent"]["write_back"];
        assert!(
            wb["held_writes"].as_u64().unwrap() > 500,
            "writes were held back: {wb}"
        );
        assert!(
            wb["recalls_flushed"].as_u64().unwrap() >= 5,
            "B's reads recalled held-back bytes: {wb}"
        );
        drop(f);
        let st = agent_status(&mnt_a);
        assert_eq!(
            st["agent"]["write_back"]["dirty_bytes"], 0,
            "close wrote everything"
        );
    })
    .await;
    drop(a);
    drop(b);
    srv.stop().await;
}

/// Two nodes write disjoint blocks of one file at once, in small buffered writes: the write
/// delegation goes back and forth between them, and the file ends with every block of both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_nodes_writing_disjoint_blocks_of_one_file_keep_both() {
    if !can_mount() {
        return;
    }
    const BLOCKS: u64 = 600;
    const BS: usize = 4096;
    let srv = cluster::start(10_000).await;
    let a = Mount::start(&srv, "node-a", "").await;
    let b = Mount::start(&srv, "node-b", "").await;
    let (pa, pb) = (a.p("shared"), b.p("shared"));
    timed("disjoint writers", 240, move || {
        use std::os::unix::fs::FileExt;
        std::fs::write(&pa, b"").unwrap();
        let block = |n: u64| vec![(n % 251) as u8 + 1; BS];
        let writers: Vec<_> = [(0u64, pa.clone()), (1u64, pb.clone())]
            .into_iter()
            .map(|(parity, path)| {
                std::thread::spawn(move || {
                    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
                    for n in (0..BLOCKS).filter(|n| n % 2 == parity) {
                        // Each block in two halves: unaligned writes too.
                        let data = block(n);
                        let at = n * BS as u64;
                        f.write_all_at(&data[..1000], at).unwrap();
                        f.write_all_at(&data[1000..], at + 1000).unwrap();
                    }
                    f.sync_all().unwrap();
                })
            })
            .collect();
        for w in writers {
            w.join().unwrap();
        }
        for path in [&pa, &pb] {
            let got = std::fs::read(path).unwrap();
            assert_eq!(got.len() as u64, BLOCKS * BS as u64);
            for (n, chunk) in got.chunks(BS).enumerate() {
                assert_eq!(chunk, block(n as u64).as_slice(), "block {n} via {path:?}");
            }
        }
    })
    .await;
    drop(a);
    drop(b);
    srv.stop().await;
}

/// A node killed with -9 while it holds writes back loses exactly those: another node then
/// reads the synced writes whole and, where the lost ones were, the file's older bytes (or
/// the new ones, for a piece written back before the kill), never anything else; and its
/// read waits for the dead node's lease instead of failing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writer_killed_with_held_back_writes_loses_only_those() {
    if !can_mount() {
        return;
    }
    const LEN: usize = 2 << 20;
    let srv = cluster::start(10_000).await;
    let mut a = Mount::start(&srv, "victim", "").await;
    let b = Mount::start(&srv, "reader", "").await;
    let (pa, pb, mnt_a) = (a.p("f"), b.p("f"), a.path.clone());
    let old: Vec<u8> = (0..LEN).map(|i| (i % 97) as u8 | 0x80).collect();
    let new: Vec<u8> = (0..LEN).map(|i| (i % 89) as u8 & 0x7f).collect();
    let (o, n) = (old.clone(), new.clone());
    // The older bytes are durable; then the first half is rewritten and fsync'd, the second
    // half rewritten and held back.
    let f = timed("writes before the kill", 120, move || {
        use std::os::unix::fs::FileExt;
        std::fs::write(&pa, &o).unwrap();
        let f = std::fs::OpenOptions::new().write(true).open(&pa).unwrap();
        for (i, chunk) in n[..LEN / 2].chunks(3000).enumerate() {
            f.write_all_at(chunk, (i * 3000) as u64).unwrap();
        }
        f.sync_data().unwrap();
        for (i, chunk) in n[LEN / 2..].chunks(3000).enumerate() {
            f.write_all_at(chunk, (LEN / 2 + i * 3000) as u64).unwrap();
        }
        let st = agent_status(&mnt_a);
        assert!(
            st["agent"]["write_back"]["dirty_bytes"].as_u64().unwrap() > 0,
            "writes are held back at the kill: {}",
            st["agent"]["write_back"]
        );
        f
    })
    .await;
    // Signalled from this process: a `kill` child would be a fork and exec, which closes
    // this process's descriptor of the file in the child (a FUSE flush: a write-back).
    let pid = rustix::process::Pid::from_raw(i32::try_from(a.pid()).unwrap()).unwrap();
    rustix::process::kill_process(pid, rustix::process::Signal::KILL).unwrap();
    assert!(a.wait_exit(10).is_some(), "the agent died");
    drop(f);
    let got = timed("read after the kill", 60, move || {
        std::fs::read(&pb).unwrap()
    })
    .await;
    assert_eq!(got.len(), LEN);
    assert!(
        got[..LEN / 2] == new[..LEN / 2],
        "the fsync'd half is whole"
    );
    let mut lost = 0usize;
    for i in LEN / 2..LEN {
        if got[i] == old[i] {
            lost += 1;
        } else {
            assert_eq!(
                got[i], new[i],
                "byte {i} is neither the older nor the newer one"
            );
        }
    }
    assert!(lost > 0, "the held-back writes were lost with the node");
    let target = a.path.clone();
    timed("lazy unmount", 10, move || {
        rustix::mount::unmount(&target, rustix::mount::UnmountFlags::DETACH).unwrap()
    })
    .await;
    drop(a);
    drop(b);
    srv.stop().await;
}

/// Small reads of a file are answered from the reading node's cache while it holds a read
/// delegation, and a write by another node (which recalls it first) is seen by the very next
/// read: never a stale byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cached_reads_see_another_nodes_write_at_once() {
    if !can_mount() {
        return;
    }
    const LEN: usize = 1 << 20;
    let srv = cluster::start(10_000).await;
    // Without the kernel's page cache: this is about the agent's cache.
    let a = Mount::start(&srv, "reader", "page_cache=off").await;
    let b = Mount::start(&srv, "writer", "").await;
    let (pa, pb, mnt_a) = (a.p("f"), b.p("f"), a.path.clone());
    let mut x = test_seed("cached reads") | 1;
    timed("cached reads and a writer elsewhere", 240, move || {
        use std::os::unix::fs::FileExt;
        let mut model: Vec<u8> = (0..LEN).map(|i| (i % 253) as u8).collect();
        std::fs::write(&pb, &model).unwrap();
        // (With the kernel's page cache, buffered reads are
        // `a_file_read_through_the_page_cache_sees_every_change_of_any_node` and
        // `a_file_read_and_written_through_the_page_cache_stays_coherent`.)
        let r = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&pa)
            .unwrap();
        let w = std::fs::OpenOptions::new().write(true).open(&pb).unwrap();
        for round in 0..20u8 {
            // A: many small reads, sequential and random.
            for i in 0..200 {
                let len = 1 + (xorshift(&mut x) % 5000) as usize;
                let off = if i % 2 == 0 {
                    (i as usize * 4096) % LEN
                } else {
                    (xorshift(&mut x) % LEN as u64) as usize
                };
                let mut buf = vec![0u8; len];
                let n = r.read_at(&mut buf, off as u64).unwrap();
                let want = &model[off..(off + len).min(model.len())];
                assert_eq!(&buf[..n], want, "round {round}: read at {off}+{len}");
            }
            // B: a small write somewhere (through B's cache of held-back writes, or not).
            let off = (xorshift(&mut x) % (LEN as u64 - 100)) as usize;
            let data = vec![round.wrapping_add(1); 1 + (xorshift(&mut x) % 99) as usize];
            w.write_all_at(&data, off as u64).unwrap();
            model[off..off + data.len()].copy_from_slice(&data);
            // A's next read of it sees it.
            let mut buf = vec![0u8; data.len()];
            let n = r.read_at(&mut buf, off as u64).unwrap();
            assert_eq!(
                &buf[..n],
                &data[..],
                "round {round}: A reads B's write at {off}"
            );
            // The delegation is asked for again after a second.
            if round % 5 == 4 {
                std::thread::sleep(Duration::from_millis(1100));
            }
        }
        // Most reads that reach A's agent at all (the kernel's page cache answers many
        // before it, how many depends on the kernel) are answered from its cache, not by
        // the server.
        let st = agent_status(&mnt_a);
        let wb = &st["agent"]["write_back"];
        let (hits, misses) = (
            wb["cache_hits"].as_u64().unwrap(),
            wb["cache_misses"].as_u64().unwrap(),
        );
        assert!(
            hits >= 200 && misses * 10 < hits,
            "reads were answered from the cache: {wb}"
        );
    })
    .await;
    drop(a);
    drop(b);
    srv.stop().await;
}

/// `GET /metrics` of an agent's `metrics=` listener, the body.
fn scrape(port: u16) -> String {
    use std::io::Read as _;
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    assert!(out.starts_with("HTTP/1.1 200 OK"), "{out}");
    out.split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default()
}

/// The count of the FUSE latency histogram for `op` in a scrape (0 when absent).
fn fuse_op_count(body: &str, op: &str) -> u64 {
    let key = format!("sanfs_agent_fuse_op_seconds_count{{op=\"{op}\"}} ");
    body.lines()
        .find_map(|l| l.strip_prefix(&key))
        .map_or(0, |v| v.trim().parse().unwrap())
}

/// Issue 22 item 2: every FUSE request is timed in `sanfs_agent_fuse_op_seconds`, by op; the
/// family carries its HELP, and a request adds to its op's count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fuse_requests_are_timed_by_op() {
    if !can_mount() {
        return;
    }
    let srv = cluster::start(10_000).await;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let m = Mount::start(&srv, "h14-fuse-ops", &format!("metrics=127.0.0.1:{port}")).await;
    let dir = m.p("d");
    let body = timed("file operations, then a scrape", 60, move || {
        std::fs::create_dir(&dir).unwrap();
        let f = dir.join("f");
        std::fs::write(&f, vec![7u8; 300_000]).unwrap();
        assert_eq!(std::fs::read(&f).unwrap().len(), 300_000);
        assert!(std::fs::metadata(dir.join("absent")).is_err());
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);
        scrape(port)
    })
    .await;
    assert!(
        body.contains("# HELP sanfs_agent_fuse_op_seconds "),
        "{body}"
    );
    assert!(
        body.contains("sanfs_agent_fuse_op_seconds_bucket{op=\"write\",le=\"0.00002\"}"),
        "{body}"
    );
    for op in [
        "lookup", "getattr", "mkdir", "create", "write", "open", "read", "opendir",
    ] {
        assert!(fuse_op_count(&body, op) > 0, "no {op} timed:\n{body}");
    }
    assert!(
        fuse_op_count(&body, "readdir") + fuse_op_count(&body, "readdirplus") > 0,
        "{body}"
    );
    let writes = fuse_op_count(&body, "write");
    let f = m.p("d/f");
    let after = timed("one more write", 60, move || {
        let mut file = std::fs::OpenOptions::new().write(true).open(&f).unwrap();
        file.write_all(&[1u8; 4096]).unwrap();
        drop(file);
        scrape(port)
    })
    .await;
    assert!(fuse_op_count(&after, "write") > writes, "{after}");
    drop(m);
    srv.stop().await;
}

/// Issue 20: the agent counts its data path by stage. O_DIRECT writes and reads of 1 MiB
/// through the mount (the devices write from, and read into, the request's own aligned
/// buffer) round-trip their bytes, and `status` and the metrics show the FUSE requests, the
/// copies, the device waits and the engine's CPU that moved them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn o_direct_io_round_trips_and_is_counted_by_stage() {
    use std::os::unix::fs::{FileExt as _, OpenOptionsExt as _};
    if !can_mount() {
        return;
    }
    let srv = cluster::start(10_000).await;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let m = Mount::start(&srv, "h24-stages", &format!("metrics=127.0.0.1:{port}")).await;
    let path = m.p("direct");
    let mnt = m.p("");
    let before = agent_status(&mnt);
    let (after, body) = timed("O_DIRECT writes and reads, then status", 60, move || {
        #[allow(
            clippy::disallowed_methods,
            reason = "a file on the mount, opened as an application opens it: not a LUN"
        )]
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .custom_flags(libc::O_DIRECT)
            .open(&path)
            .unwrap();
        let mut data = sanfs_client_agent::buf::AlignedBuf::zeroed(1 << 20);
        for i in 0..4u64 {
            for (k, b) in data.as_mut_slice().iter_mut().enumerate() {
                *b = (k as u64).wrapping_mul(31).wrapping_add(i) as u8;
            }
            f.write_all_at(data.as_slice(), i << 20).unwrap();
        }
        f.sync_all().unwrap();
        let mut back = sanfs_client_agent::buf::AlignedBuf::zeroed(1 << 20);
        for i in 0..4u64 {
            f.read_exact_at(back.as_mut_slice(), i << 20).unwrap();
            assert!(
                back.as_slice()
                    .iter()
                    .enumerate()
                    .all(|(k, b)| *b == (k as u64).wrapping_mul(31).wrapping_add(i) as u8),
                "MiB {i} read back wrong"
            );
        }
        drop(f);
        (agent_status(&mnt), scrape(port))
    })
    .await;
    let d = |name: &str, field: &str| stage(&after, name, field) - stage(&before, name, field);
    assert!(d("fuse-write", "calls") >= 4, "{after}");
    assert!(d("fuse-write", "bytes") >= 4 << 20, "{after}");
    assert!(d("fuse-read", "calls") >= 4, "{after}");
    assert!(d("fuse-read", "bytes") >= 4 << 20, "{after}");
    // One copy per write request (out of FUSE's buffer), and the reads' device I/O.
    assert!(d("copy", "bytes") >= 4 << 20, "{after}");
    assert!(d("device-wait", "calls") >= 4, "{after}");
    assert!(
        d("fuse-write", "wall_ns") > 0 && d("fuse-reply", "cpu_ns") > 0,
        "{after}"
    );
    assert!(d("engine", "calls") > 0, "{after}");
    assert!(
        body.contains("sanfs_agent_stage_calls_total{stage=\"fuse-write\"}"),
        "{body}"
    );
    assert!(
        body.lines()
            .any(|l| l.starts_with("sanfs_agent_stage_seconds{")
                && l.contains("stage=\"device-wait\"")
                && l.contains("clock=\"wall\"")),
        "{body}"
    );
    drop(m);
    srv.stop().await;
}

/// Issue 20: plain buffered writes of whole blocks inside this node's write layout are
/// answered before their device I/O (write-behind, `fuse::behind`). Every byte stays exact:
/// rewrites of bytes still in flight land last, another node reading at once (its read
/// recalls the layout, which waits for the writes) and this node reading through another
/// handle see everything, the size is exact, and fsync and close report nothing. Without
/// the early answers the `write-behind` stage stays at 0 and the test fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_answered_before_their_device_io_are_exact_here_and_on_another_node() {
    use std::os::unix::fs::FileExt as _;
    if !can_mount() {
        return;
    }
    let srv = cluster::start(10_000).await;
    let a = Mount::start(&srv, "behind-a", "").await;
    let b = Mount::start(&srv, "behind-b", "").await;
    let (path, mnt, other) = (a.p("behind"), a.p(""), b.p("behind"));
    const MIBS: u64 = 24;
    let (before, after, model) = timed("write-behind on one node, reads on two", 120, move || {
        let before = agent_status(&mnt);
        let mut model = vec![0u8; (MIBS * MIB) as usize];
        let mut buf = sanfs_client_agent::buf::AlignedBuf::zeroed(MIB as usize);
        // Written only (the kernel's direct mode): every write is a FUSE request of its own.
        let w = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        let mut put = |w: &std::fs::File, model: &mut [u8], at: u64, seed: u8| {
            let data = crate::support::pattern(MIB as usize, seed);
            buf.as_mut_slice().copy_from_slice(&data);
            w.write_all_at(buf.as_slice(), at).unwrap();
            model[at as usize..(at + MIB) as usize].copy_from_slice(&data);
        };
        for i in 0..MIBS {
            put(&w, &mut model, i * MIB, i as u8);
        }
        // The same MiB again and again, back to back: the last one wins.
        for k in 0..8u8 {
            put(&w, &mut model, 3 * MIB, 100 + k);
        }
        // Another node at once, the writer still open and not synced.
        assert!(
            std::fs::read(&other).unwrap() == model,
            "another node read other bytes"
        );
        // This node, through another handle.
        let r = std::fs::File::open(&path).unwrap();
        let mut back = vec![0u8; model.len()];
        r.read_exact_at(&mut back, 0).unwrap();
        assert!(back == model, "this node read other bytes");
        // Past the end: the size follows at once.
        model.resize(((MIBS + 1) * MIB) as usize, 0);
        put(&w, &mut model, MIBS * MIB, 77);
        assert_eq!(w.metadata().unwrap().len(), (MIBS + 1) * MIB);
        w.sync_all().unwrap();
        drop(w);
        (before, agent_status(&mnt), model)
    })
    .await;
    let d = |name: &str, field: &str| stage(&after, name, field) - stage(&before, name, field);
    assert!(
        d("write-behind", "calls") >= MIBS / 2,
        "most writes are answered before their device I/O: {after}"
    );
    let (own, theirs) = (a.p("behind"), b.p("behind"));
    let (mine, others) = timed("read back on both mounts", 60, move || {
        (
            std::fs::read(&own).unwrap(),
            std::fs::read(&theirs).unwrap(),
        )
    })
    .await;
    assert!(mine == model && others == model, "read back after close");
    drop(a);
    drop(b);
    srv.stop().await;
}

/// Issue 20: a sequential writer's next write layout is asked for in the background while
/// it writes inside the one before (`Inner::layout_ahead`): one `MapWrite` per layout, none
/// of them twice. Closed right after its last write (a layout asked ahead may still be on
/// its way), the node keeps no layout of the file: another node then truncates and rewrites
/// it, and both nodes read exactly that, also through a layout this node asks again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sequential_writers_next_layout_is_asked_ahead_and_none_outlives_its_close() {
    use std::os::unix::fs::FileExt as _;
    if !can_mount() {
        return;
    }
    let srv = cluster::start(10_000).await;
    let a = Mount::start(&srv, "ahead-a", "").await;
    let b = Mount::start(&srv, "ahead-b", "").await;
    let (path, mnt, other) = (a.p("ahead"), a.p(""), b.p("ahead"));
    // Layouts that grow: 8 MiB (the default `write_layout`), 16 MiB, then as much as the
    // server grants a guess on this 256 MiB volume (an eighth of its free space, ~28 MiB),
    // and one asked past the end. Of 8 MiB each it would take seven.
    const MIBS: u64 = 48;
    let grants =
        |st: &serde_json::Value, field: &str| st["agent"]["grants"][field].as_u64().unwrap();
    let free = |dir: &std::path::Path| {
        let st = rustix::fs::statvfs(dir).unwrap();
        st.f_bfree * st.f_frsize
    };
    let (before, after, cached, free_before, free_after) =
        timed("a sequential writer, then its close", 120, move || {
            let free_before = free(&mnt);
            let before = agent_status(&mnt);
            let mut buf = sanfs_client_agent::buf::AlignedBuf::zeroed(MIB as usize);
            let w = std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .open(&path)
                .unwrap();
            for i in 0..MIBS {
                buf.as_mut_slice()
                    .copy_from_slice(&crate::support::pattern(MIB as usize, i as u8));
                w.write_all_at(buf.as_slice(), i * MIB).unwrap();
            }
            drop(w);
            let after = agent_status(&mnt);
            // The release goes after close(2) returns: bounded wait for it to give the layouts
            // back.
            // And the blocks of the layouts past the end come back.
            let (mut cached, mut free_after) = (u64::MAX, 0);
            for _ in 0..200 {
                cached = agent_status(&mnt)["agent"]["grants"]["cached_now"]
                    .as_u64()
                    .unwrap();
                free_after = free(&mnt);
                if cached == 0 && free_after + (MIBS + 1) * MIB >= free_before {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
            (before, after, cached, free_before, free_after)
        })
        .await;
    let asked = grants(&after, "write") - grants(&before, "write");
    let ahead = grants(&after, "layouts_ahead") - grants(&before, "layouts_ahead");
    assert!(
        ahead >= 2 && ahead + 1 >= asked,
        "the layouts after the first are asked ahead: {ahead} of {asked}: {after}"
    );
    assert!(
        asked <= 4,
        "the layouts grow, none is asked twice: {asked} MapWrites for {MIBS} MiB: {after}"
    );
    assert_eq!(cached, 0, "a layout outlived the file's close");
    assert!(
        free_after + (MIBS + 1) * MIB >= free_before,
        "the layouts' blocks past the end were kept after the close: {free_before} bytes \
         free before, {free_after} after {MIBS} MiB"
    );
    // Another node truncates and rewrites the file (the layouts this node had there would
    // be stale now), then this node writes past it again and both read the same bytes.
    let (path, other2) = (a.p("ahead"), other.clone());
    let (mine, theirs, model) = timed("another node's rewrite, then this node's", 120, move || {
        let mut model = crate::support::pattern((12 * MIB) as usize, 200);
        let o = std::fs::OpenOptions::new()
            .write(true)
            .truncate(true)
            .open(&other2)
            .unwrap();
        o.write_all_at(&model, 0).unwrap();
        o.sync_all().unwrap();
        drop(o);
        let mut buf = sanfs_client_agent::buf::AlignedBuf::zeroed(MIB as usize);
        let w = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        for i in 12..20u64 {
            let data = crate::support::pattern(MIB as usize, 100 + i as u8);
            buf.as_mut_slice().copy_from_slice(&data);
            w.write_all_at(buf.as_slice(), i * MIB).unwrap();
            model.extend_from_slice(&data);
        }
        w.sync_all().unwrap();
        drop(w);
        (
            std::fs::read(&path).unwrap(),
            std::fs::read(&other2).unwrap(),
            model,
        )
    })
    .await;
    assert!(mine == model, "this node read other bytes");
    assert!(theirs == model, "the other node read other bytes");
    drop(a);
    drop(b);
    srv.stop().await;
}

/// Issue 20: a large `O_DIRECT` read or write (8 MiB) reaches the agent as 1 MiB pieces all
/// in flight at once (`FUSE_ASYNC_DIO`: a plain `O_DIRECT` open is answered without
/// `FOPEN_DIRECT_IO`), and the pieces of a sequential writer's request wait for the one
/// layout the first of them asks for: a layout per 8-64 MiB as for a buffered writer, not a
/// grant per piece (before the wait: one `MapWrite` and one `Complete` per MiB). Another
/// node that opened the file with `O_DIRECT` while it was short, and whose kernel so knew
/// the old size, reads every byte written past it (the kernel asks for the size again once
/// the writer's layout recalled its attributes), and so does the writer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_o_direct_requests_go_in_pieces_at_once_under_one_layout_and_stay_coherent() {
    use std::os::unix::fs::{FileExt as _, OpenOptionsExt as _};
    if !can_mount() {
        return;
    }
    let srv = cluster::start(10_000).await;
    let a = Mount::start(&srv, "odirect-a", "").await;
    let b = Mount::start(&srv, "odirect-b", "").await;
    let (path, mnt, other) = (a.p("big"), a.p(""), b.p("big"));
    const REQ: usize = 8 << 20;
    const REQS: u64 = 4;
    let grants =
        |st: &serde_json::Value, field: &str| st["agent"]["grants"][field].as_u64().unwrap();
    let (before, after, model, mine, theirs) =
        timed("8 MiB O_DIRECT writes and reads", 120, move || {
            #[allow(
                clippy::disallowed_methods,
                reason = "a file on the mount opened with O_DIRECT, as an application would"
            )]
            let direct = |p: &std::path::Path, write: bool| {
                std::fs::OpenOptions::new()
                    .read(true)
                    .write(write)
                    .create(write)
                    .custom_flags(libc::O_DIRECT)
                    .open(p)
                    .unwrap()
            };
            let mut buf = sanfs_client_agent::buf::AlignedBuf::zeroed(REQ);
            // 1 MiB first, then the reader opens (its kernel knows 1 MiB).
            let w = direct(&path, true);
            let first = crate::support::pattern(MIB as usize, 1);
            buf.as_mut_slice()[..MIB as usize].copy_from_slice(&first);
            w.write_all_at(&buf.as_slice()[..MIB as usize], 0).unwrap();
            let r = direct(&other, false);
            let mut small = sanfs_client_agent::buf::AlignedBuf::zeroed(MIB as usize);
            assert_eq!(r.read_at(small.as_mut_slice(), 0).unwrap(), MIB as usize);
            let before = agent_status(&mnt);
            let mut model = first;
            for i in 0..REQS {
                let data = crate::support::pattern(REQ, 10 + i as u8);
                buf.as_mut_slice().copy_from_slice(&data);
                w.write_all_at(buf.as_slice(), MIB + i * REQ as u64)
                    .unwrap();
                model.extend_from_slice(&data);
            }
            let after = agent_status(&mnt);
            // The other node reads it all through the descriptor it opened before, in 8 MiB
            // O_DIRECT reads (in pieces at once too); then the writer does.
            let read_all = |f: &std::fs::File| {
                let mut out = Vec::new();
                let mut rb = sanfs_client_agent::buf::AlignedBuf::zeroed(REQ);
                loop {
                    let n = f.read_at(rb.as_mut_slice(), out.len() as u64).unwrap();
                    out.extend_from_slice(&rb.as_slice()[..n]);
                    if n == 0 {
                        break out;
                    }
                }
            };
            let theirs = read_all(&r);
            let mine = read_all(&w);
            (before, after, model, mine, theirs)
        })
        .await;
    assert!(
        theirs == model,
        "the other node read {} bytes, other than written",
        theirs.len()
    );
    assert!(
        mine == model,
        "the writer read {} bytes, other than written",
        mine.len()
    );
    let asked = grants(&after, "write") - grants(&before, "write");
    // One layout per request or fewer (they grow); a piece that reaches the agent before the
    // request's first one has asked is not seen as sequential and asks a grant of its own,
    // which a loaded machine makes now and then (11 once in a full run). Without the wait:
    // one per piece (33).
    assert!(
        asked <= 16,
        "the pieces of each request wait for one layout: {asked} MapWrites for {} MiB: {after}",
        REQS * 8
    );
    drop(a);
    drop(b);
    srv.stop().await;
}

/// An asynchronous (`io_uring`) `O_APPEND | O_DIRECT` write of several MiB reaches the agent
/// as 1 MiB pieces all at once (`FUSE_ASYNC_DIO`), which can arrive out of order; each is
/// appended at the server's end of file, so the agent puts them back in the kernel's order
/// first (`fuse::append_order`): the file holds each request's bytes in order, after what
/// was there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn asynchronous_o_direct_appends_land_in_order() {
    use std::os::unix::fs::OpenOptionsExt as _;
    if !can_mount() {
        return;
    }
    let srv = cluster::start(10_000).await;
    let m = Mount::start(&srv, "aio-append", "").await;
    let path = m.p("log");
    const REQ: usize = 4 << 20;
    const ROUNDS: u8 = 6;
    let (model, got) = timed("io_uring appends of 4 MiB", 120, move || {
        #[allow(
            clippy::disallowed_methods,
            reason = "a file on the mount opened with O_APPEND | O_DIRECT, as an application would"
        )]
        let f = std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .custom_flags(libc::O_DIRECT)
            .open(&path)
            .unwrap();
        let mut ring = io_uring::IoUring::new(4).unwrap();
        let mut buf = sanfs_client_agent::buf::AlignedBuf::zeroed(REQ);
        let mut model = Vec::new();
        for round in 0..ROUNDS {
            // Each MiB of the request tells its place: a reordering shows.
            let data: Vec<u8> = (0..REQ)
                .map(|i| ((i >> 20) as u8).wrapping_mul(16).wrapping_add(round))
                .collect();
            buf.as_mut_slice().copy_from_slice(&data);
            let write = io_uring::opcode::Write::new(
                io_uring::types::Fd(std::os::fd::AsRawFd::as_raw_fd(&f)),
                buf.as_mut_slice().as_mut_ptr(),
                u32::try_from(REQ).unwrap(),
            )
            .offset(u64::MAX)
            .build();
            // SAFETY: the buffer and the file outlive the operation: it is waited for
            // below (`submit_and_wait(1)` and its completion) before either is touched.
            unsafe { ring.submission().push(&write).unwrap() };
            ring.submit_and_wait(1).unwrap();
            let cqe = ring.completion().next().unwrap();
            assert_eq!(cqe.result(), i32::try_from(REQ).unwrap(), "round {round}");
            model.extend_from_slice(&data);
        }
        drop(f);
        (model, std::fs::read(&path).unwrap())
    })
    .await;
    assert_eq!(got.len(), model.len(), "the appends' total length");
    if let Some(at) = got.iter().zip(&model).position(|(g, w)| g != w) {
        panic!(
            "MiB {} of the file holds MiB {} of round {} (a piece appended out of order)",
            at >> 20,
            (got[at] >> 4) & 0xf,
            got[at] & 0xf
        );
    }
    drop(m);
    srv.stop().await;
}

/// Issue 18: a program whose buffer is not page aligned (most: `malloc`, Python, Java) has
/// each 1 MiB buffered write split by the kernel into a piece of 1 MiB - 16 bytes and one of
/// 16 (a request holds at most 256 pages). The partial blocks at the pieces' edges are held
/// back under the file's write delegation and go out with their neighbours as whole blocks:
/// no byte goes through the server (before, two proxied writes per 1 MiB). Another mount
/// reads every byte; so does this one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_writes_from_an_unaligned_buffer_send_no_byte_through_the_server() {
    use std::os::unix::fs::FileExt as _;
    if !can_mount() {
        return;
    }
    let srv = cluster::start(10_000).await;
    let a = Mount::start(&srv, "unaligned-a", "").await;
    let b = Mount::start(&srv, "unaligned-b", "").await;
    let (path, mnt, other) = (a.p("unaligned"), a.p(""), b.p("unaligned"));
    const MIBS: u64 = 16;
    let data = crate::support::pattern((MIBS * MIB) as usize, 11);
    let want = data.clone();
    let (before, after) = timed("16 MiB of unaligned 1 MiB writes", 120, move || {
        let before = agent_status(&mnt);
        // 16 bytes past a page boundary, as malloc hands out a large buffer.
        let mut buf = sanfs_client_agent::buf::AlignedBuf::zeroed((MIB + 4096) as usize);
        let f = std::fs::File::create(&path).unwrap();
        for (i, chunk) in data.chunks(MIB as usize).enumerate() {
            let unaligned = &mut buf.as_mut_slice()[16..16 + MIB as usize];
            unaligned.copy_from_slice(chunk);
            f.write_all_at(unaligned, i as u64 * MIB).unwrap();
        }
        f.sync_all().unwrap();
        drop(f);
        (before, agent_status(&mnt))
    })
    .await;
    let d = |field: &str| {
        let at = |st: &serde_json::Value| st["agent"]["bytes"][field].as_u64().unwrap();
        at(&after) - at(&before)
    };
    assert_eq!(d("proxied_write"), 0, "no byte through the server: {after}");
    assert!(d("direct_write") >= MIBS * MIB, "{after}");
    let own = a.p("unaligned");
    let (mine, theirs) = timed("read back on both mounts", 60, move || {
        (std::fs::read(&own).unwrap(), std::fs::read(&other).unwrap())
    })
    .await;
    for (got, who) in [(mine, "this mount"), (theirs, "the other mount")] {
        assert_eq!(got.len(), want.len(), "{who}");
        if let Some(at) = got.iter().zip(&want).position(|(x, y)| x != y) {
            panic!("{who} reads a wrong byte at {at}");
        }
    }
    drop(a);
    drop(b);
    srv.stop().await;
}

/// Issue 18: a sequential reader under a read delegation is read ahead of, in the
/// background: its reads are answered from the cache (a handful of misses for 16 MiB, where
/// every 1 MiB was a synchronous miss before), and another node's write ahead of the reader
/// (which recalls the delegation, dropping what was read ahead) is what the reader then reads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sequential_reader_is_read_ahead_of_and_still_sees_another_nodes_write() {
    if !can_mount() {
        return;
    }
    const LEN: usize = 16 << 20;
    const READ: usize = 64 << 10;
    let srv = cluster::start(10_000).await;
    // Without the kernel's page cache, which reads ahead by itself: this is about the agent's.
    let a = Mount::start(&srv, "ahead-reader", "page_cache=off").await;
    let b = Mount::start(&srv, "ahead-writer", "").await;
    let (pa, pb, mnt_a) = (a.p("f"), b.p("f"), a.path.clone());
    timed(
        "a sequential reader and a writer elsewhere",
        240,
        move || {
            use std::os::unix::fs::FileExt;
            let mut model = crate::support::pattern(LEN, 21);
            std::fs::write(&pb, &model).unwrap();
            let r = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(&pa)
                .unwrap();
            let read_all = |r: &std::fs::File, model: &[u8], pass: &str, mid: Option<&dyn Fn()>| {
                let mut buf = vec![0u8; READ];
                for (i, want) in model.chunks(READ).enumerate() {
                    if i == model.len() / READ / 2
                        && let Some(f) = mid
                    {
                        f();
                    }
                    let n = r.read_at(&mut buf, (i * READ) as u64).unwrap();
                    if buf[..n] != *want {
                        let at = buf.iter().zip(want).position(|(x, y)| x != y);
                        panic!("{pass}: read {i} differs at {at:?} (of {n} bytes)");
                    }
                }
            };
            // The delegation comes with the second read; the rest is read ahead of the reader.
            let wb =
                |st: &serde_json::Value, k: &str| st["agent"]["write_back"][k].as_u64().unwrap();
            let before = agent_status(&mnt_a);
            read_all(&r, &model, "first pass", None);
            let after = agent_status(&mnt_a);
            let misses = wb(&after, "cache_misses") - wb(&before, "cache_misses");
            let hits = wb(&after, "cache_hits") - wb(&before, "cache_hits");
            let aheads = wb(&after, "read_aheads") - wb(&before, "read_aheads");
            assert!(aheads >= 4, "read ahead: {after}");
            assert!(
                misses <= 8 && hits >= (LEN / READ) as u64 - 8,
                "answered from what was read ahead ({hits} hits, {misses} misses): {after}"
            );
            // A second pass; half way through, B writes ahead of the reader: A reads B's bytes.
            let w = std::fs::OpenOptions::new().write(true).open(&pb).unwrap();
            let patch = vec![0xA5u8; 3 * READ + 100];
            let at = LEN / 2 + 2 * READ + 17;
            model[at..at + patch.len()].copy_from_slice(&patch);
            let write = || w.write_all_at(&patch, at as u64).unwrap();
            read_all(&r, &model, "second pass", Some(&write));
        },
    )
    .await;
    drop(a);
    drop(b);
    srv.stop().await;
}

/// The kernel writes a shared mapping's dirty pages back through the handle the mapping was
/// made with, also one opened with O_APPEND: those writes go where the pages are (they were
/// appended, each page landing at the end of file: found by the exerciser's mapped writes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_mapping_made_through_an_append_handle_is_written_back_in_place() {
    if !can_mount() {
        return;
    }
    const LEN: usize = 64 * 1024;
    let srv = cluster::start(10_000).await;
    let a = Mount::start(&srv, "mmap-append", "").await;
    let b = Mount::start(&srv, "mmap-append-other", "").await;
    let (pa, pb) = (a.p("f"), b.p("f"));
    timed(
        "msync of a mapping made through an O_APPEND handle",
        60,
        move || {
            use std::os::unix::fs::FileExt;
            let mut model = crate::support::pattern(LEN, 9);
            std::fs::write(&pa, &model).unwrap();
            // The kernel writes back through the handle a writable mapping was made with: one
            // opened with O_APPEND (for reading too, as a mapping needs).
            let f = std::fs::OpenOptions::new()
                .read(true)
                .append(true)
                .open(&pa)
                .unwrap();
            let mut map = SharedMapping::new(&f, LEN);
            map.bytes()[5000..5010].fill(0xAB);
            model[5000..5010].fill(0xAB);
            map.sync();
            drop(map);
            drop(f);
            for (p, node) in [(&pa, "this node"), (&pb, "another node")] {
                let got = std::fs::read(p).unwrap();
                assert_eq!(got.len(), LEN, "{node}: the size");
                assert!(got == model, "{node}: the mapping's bytes in place");
            }
            let mut one = [0u8; 10];
            std::fs::File::open(&pb)
                .unwrap()
                .read_exact_at(&mut one, 5000)
                .unwrap();
            assert_eq!(one, [0xAB; 10]);
        },
    )
    .await;
    drop(a);
    drop(b);
    srv.stop().await;
}

/// A file whose pages the kernel holds (read through a handle opened for reading only) and
/// that is then written through a shared mapping: the mapping's dirty pages are written back
/// through FUSE while they are under writeback, and the agent must answer those writes
/// without dropping the very pages they come from (that waited for its own answer: `msync`
/// hung for good, found by an fsx-style run).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_mapping_of_a_file_in_the_page_cache_is_written_back() {
    if !can_mount() {
        return;
    }
    const LEN: usize = 64 * 1024;
    let srv = cluster::start(10_000).await;
    let a = Mount::start(&srv, "pages-mmap", "").await;
    let b = Mount::start(&srv, "pages-mmap-other", "").await;
    let (pa, pb) = (a.p("f"), b.p("f"));
    timed("msync of a mapping over cached pages", 60, move || {
        use std::os::unix::fs::FileExt;
        let mut model = crate::support::pattern(LEN, 5);
        std::fs::write(&pa, &model).unwrap();
        // Read for reading only: the kernel keeps the pages (and the agent knows it may).
        let r = std::fs::File::open(&pa).unwrap();
        let mut got = vec![0u8; LEN];
        r.read_exact_at(&mut got, 0).unwrap();
        assert!(got == model);
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&pa)
            .unwrap();
        let mut map = SharedMapping::new(&f, LEN);
        for (round, at) in [(0u8, 100usize), (1, 20_000), (2, LEN - 10)] {
            map.bytes()[at..at + 10].fill(0xE0 + round);
            model[at..at + 10].fill(0xE0 + round);
            map.sync();
        }
        drop(map);
        r.read_exact_at(&mut got, 0).unwrap();
        assert!(got == model, "the cached handle reads the mapping's bytes");
        drop(f);
        let mut other = vec![0u8; LEN];
        std::fs::File::open(&pb)
            .unwrap()
            .read_exact_at(&mut other, 0)
            .unwrap();
        assert!(other == model, "another node reads the mapping's bytes");
    })
    .await;
    drop(a);
    drop(b);
    srv.stop().await;
}

/// A small file's bytes come with its open and answer its reads with no round trip
/// (docs/posix.md "Small files with their open"); every change of either node is then what
/// the next read sees: another node's write in place with the mtime set back, a truncate, an
/// append, this node's own write through another handle; read through handles opened for
/// reading only and read-write (whose reads all reach the agent).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_file_read_with_its_open_sees_every_change_of_any_node() {
    if !can_mount() {
        return;
    }
    let srv = cluster::start(10_000).await;
    let a = Mount::start(&srv, "small-reader", "").await;
    let b = Mount::start(&srv, "small-writer", "").await;
    let (pa, pb, mnt_a) = (a.p("s"), b.p("s"), a.path.clone());
    timed("a small file read with its open", 120, move || {
        use std::os::unix::fs::FileExt;
        let small =
            |st: &serde_json::Value, what: &str| st["agent"]["leases"][what].as_u64().unwrap_or(0);
        let mut model = crate::support::pattern(10_000, 7);
        std::fs::write(&pb, &model).unwrap();
        let read_all = |f: &std::fs::File| {
            let mut got = vec![0u8; 70_000];
            let mut n = 0;
            loop {
                let k = f.read_at(&mut got[n..], n as u64).unwrap();
                if k == 0 {
                    break;
                }
                n += k;
            }
            got.truncate(n);
            got
        };
        // Both kinds of reader, each opened anew after every change (a stat first: the
        // attribute lease that says the file is small), and one read-write handle kept.
        let kept = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&pa)
            .unwrap();
        let check = |model: &[u8], what: &str| {
            std::fs::metadata(&pa).unwrap();
            let ro = std::fs::File::open(&pa).unwrap();
            assert!(read_all(&ro) == model, "{what}: read-only open");
            let rw = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(&pa)
                .unwrap();
            assert!(read_all(&rw) == model, "{what}: read-write open");
            assert!(read_all(&kept) == model, "{what}: the handle kept open");
        };
        check(&model, "first");
        let st = agent_status(&mnt_a);
        assert!(
            small(&st, "small_file_opens") >= 1,
            "no open came with the bytes"
        );
        assert!(
            small(&st, "small_file_reads") >= 1,
            "no read came from them"
        );

        // Another node writes in place and sets the mtime back.
        let w = std::fs::OpenOptions::new().write(true).open(&pb).unwrap();
        let mtime = std::fs::metadata(&pb).unwrap().modified().unwrap();
        w.write_all_at(&[0x5A; 300], 4000).unwrap();
        w.set_times(std::fs::FileTimes::new().set_modified(mtime))
            .unwrap();
        model[4000..4300].fill(0x5A);
        check(&model, "after another node's write, mtime set back");

        // This node's own write through the kept handle.
        kept.write_all_at(&[0x11; 100], 50).unwrap();
        model[50..150].fill(0x11);
        check(&model, "after this node's own write");

        // Another node truncates, then appends.
        w.set_len(1000).unwrap();
        model.truncate(1000);
        check(&model, "after another node's truncate");
        let mut ap = std::fs::OpenOptions::new().append(true).open(&pb).unwrap();
        std::io::Write::write_all(&mut ap, &[0xC3; 3000]).unwrap();
        model.extend_from_slice(&[0xC3; 3000]);
        check(&model, "after another node's append");
        let st = agent_status(&mnt_a);
        assert!(
            small(&st, "small_file_opens") >= 4,
            "opens after each change came with the bytes again"
        );
    })
    .await;
    drop(a);
    drop(b);
    srv.stop().await;
}

/// `count()` once two reads of it 50 ms apart agree (at most 2 s): a counter that the agent
/// moves just after it answers.
fn settled_count(count: impl Fn() -> u64) -> u64 {
    let mut last = count();
    for _ in 0..40 {
        std::thread::sleep(Duration::from_millis(50));
        let now = count();
        if now == last {
            return now;
        }
        last = now;
    }
    last
}

/// Issue 18: a file opened for reading and writing with plain buffered I/O is in the kernel's
/// page cache too: what it wrote reads back from the pages (the agent is not asked), and the
/// pages never outlive a change by anyone else: another node's write in place and its
/// truncate, and this node's own write through another handle. Another node reads what the
/// handle wrote (held back here until the recall).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_read_and_written_through_the_page_cache_stays_coherent() {
    if !can_mount() {
        return;
    }
    const LEN: usize = 2 << 20;
    let srv = cluster::start(10_000).await;
    let a = Mount::start(&srv, "pages-rw-a", "").await;
    let b = Mount::start(&srv, "pages-rw-b", "").await;
    let (pa, pb, mnt_a) = (a.p("f"), b.p("f"), a.path.clone());
    timed(
        "a cached read-write handle and changes from both nodes",
        240,
        move || {
            use std::os::unix::fs::FileExt;
            let mut model = crate::support::pattern(LEN, 51);
            std::fs::write(&pb, &model).unwrap();
            let rw = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(&pa)
                .unwrap();
            let read_all = |f: &std::fs::File, len: usize| {
                let mut got = vec![0u8; len + 4096];
                let mut n = 0;
                loop {
                    let k = f.read_at(&mut got[n..], n as u64).unwrap();
                    if k == 0 {
                        break;
                    }
                    n += k;
                }
                got.truncate(n);
                got
            };
            let check = |f: &std::fs::File, model: &[u8], what: &str| {
                let got = read_all(f, model.len());
                assert_eq!(got.len(), model.len(), "{what}: the size");
                if let Some(at) = got.iter().zip(model).position(|(x, y)| x != y) {
                    panic!("{what}: a stale byte at {at}");
                }
            };
            // The agent counts a read as its task ends, just after the answer: the count
            // is taken once it stopped moving.
            let fuse_reads =
                || settled_count(|| stage(&agent_status(&mnt_a), "fuse-read", "calls"));
            check(&rw, &model, "first read");
            let before = fuse_reads();
            check(&rw, &model, "second read");
            assert_eq!(
                fuse_reads(),
                before,
                "the second read came from the page cache"
            );

            // Small writes through the handle (held back by the agent), read back through it.
            for (i, at) in [4096 * 3 + 17, LEN / 2 - 100, LEN - 5000]
                .into_iter()
                .enumerate()
            {
                let patch = vec![0x40 + i as u8; 3000];
                rw.write_all_at(&patch, at as u64).unwrap();
                model[at..at + patch.len()].copy_from_slice(&patch);
            }
            check(&rw, &model, "own writes through the handle");
            // Past the end: the file grows.
            let tail = vec![0x77u8; 10_000];
            rw.write_all_at(&tail, LEN as u64).unwrap();
            model.extend_from_slice(&tail);
            check(&rw, &model, "an own write past the end");

            // Another node reads what this handle wrote (recalled from this node).
            let other = std::fs::File::open(&pb).unwrap();
            check(&other, &model, "another node's read of the handle's writes");
            drop(other);

            // Another node writes in place, then truncates.
            let w = std::fs::OpenOptions::new().write(true).open(&pb).unwrap();
            let at = LEN / 3 + 5;
            let patch = vec![0xA5u8; 20_000];
            w.write_all_at(&patch, at as u64).unwrap();
            model[at..at + patch.len()].copy_from_slice(&patch);
            check(&rw, &model, "after another node's write");
            w.set_len((LEN / 2) as u64).unwrap();
            model.truncate(LEN / 2);
            check(&rw, &model, "after another node's truncate");

            // This node's own write through another handle (write-only: not cached).
            let own = std::fs::OpenOptions::new().write(true).open(&pa).unwrap();
            let patch = vec![0x11u8; 700];
            let at = 4096 * 7 + 9;
            own.write_all_at(&patch, at as u64).unwrap();
            model[at..at + patch.len()].copy_from_slice(&patch);
            check(
                &rw,
                &model,
                "after this node's write through another handle",
            );
            drop(own);

            // The handle's own truncate, and writes after it.
            rw.set_len(100_000).unwrap();
            model.truncate(100_000);
            let patch = vec![0x99u8; 4096];
            rw.write_all_at(&patch, 50_000).unwrap();
            model[50_000..54_096].copy_from_slice(&patch);
            check(&rw, &model, "after the handle's truncate and write");
            rw.sync_all().unwrap();
            drop(rw);
            let got = std::fs::read(&pb).unwrap();
            assert!(got == model, "another node reads the file as written");
        },
    )
    .await;
    drop(a);
    drop(b);
    srv.stop().await;
}

/// A small file's open brings its bytes (answering its reads without a round trip); this
/// node's own writes held back after it are never hidden by them: a read of a page the
/// kernel does not have whole (a write through a cached read-write handle filled only part
/// of it) is answered with the written bytes, through this node and another. (The two-mount
/// exerciser found a shared mapping's write-back carrying such a stale page to the server.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_files_bytes_from_its_open_never_hide_this_nodes_held_back_writes() {
    if !can_mount() {
        return;
    }
    const LEN: usize = 16 << 10;
    let srv = cluster::start(10_000).await;
    let a = Mount::start(&srv, "small-held-a", "").await;
    let b = Mount::start(&srv, "small-held-b", "").await;
    let (pa, pb, mnt_a) = (a.p("f"), b.p("f"), a.path.clone());
    timed(
        "a small file's bytes and held-back writes",
        120,
        move || {
            use std::os::unix::fs::FileExt;
            let held = || {
                agent_status(&mnt_a)["agent"]["write_back"]["held_writes"]
                    .as_u64()
                    .unwrap()
            };
            let mut model = crate::support::pattern(LEN, 61);
            std::fs::write(&pb, &model).unwrap();
            let rw = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(&pa)
                .unwrap();
            // Parts of pages, so that the kernel keeps none of them whole.
            let mut patch = |i: usize, at: usize| {
                let bytes = vec![0x30 + i as u8; 200];
                rw.write_all_at(&bytes, at as u64).unwrap();
                model[at..at + bytes.len()].copy_from_slice(&bytes);
            };
            // The first writes take the file's write delegation; then all is written out.
            patch(0, 3 * 4096 + 7);
            patch(1, 3 * 4096 + 900);
            rw.sync_all().unwrap();
            // An open for reading now brings the bytes (no write of this node pending).
            let r = std::fs::File::open(&pa).unwrap();
            let held_before = held();
            for (i, at) in [10usize, 4096 + 300, 2 * 4096 + 3000]
                .into_iter()
                .enumerate()
            {
                patch(2 + i, at);
            }
            assert!(held() > held_before, "writes were held back");
            let mut got = vec![0u8; LEN];
            r.read_exact_at(&mut got, 0).unwrap();
            if let Some(at) = got.iter().zip(&model).position(|(x, y)| x != y) {
                panic!("this node's read through another handle: a stale byte at {at}");
            }
            drop((r, rw));
            let got = std::fs::read(&pb).unwrap();
            assert!(got == model, "another node reads the file as written");
        },
    )
    .await;
    drop(a);
    drop(b);
    srv.stop().await;
}

/// Issue 18: a file opened for reading only is read through the kernel's page cache (a second
/// read of it asks the agent nothing), and the cached pages never outlive a change: another
/// node's write in place, the same write with the old mtime set back (size and mtime as
/// before: only the ctime tells), a truncate, and this node's own write through another
/// handle (held back under its delegation, the mtime not moved yet) are each what the
/// reader's next `read(2)` through the handle it kept open sees.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_read_through_the_page_cache_sees_every_change_of_any_node() {
    if !can_mount() {
        return;
    }
    const LEN: usize = 4 << 20;
    let srv = cluster::start(10_000).await;
    let a = Mount::start(&srv, "pages-reader", "").await;
    let b = Mount::start(&srv, "pages-writer", "").await;
    let (pa, pb, mnt_a) = (a.p("f"), b.p("f"), a.path.clone());
    timed(
        "a cached reader and changes from both nodes",
        240,
        move || {
            use std::os::unix::fs::FileExt;
            let mut model = crate::support::pattern(LEN, 33);
            std::fs::write(&pb, &model).unwrap();
            let r = std::fs::File::open(&pa).unwrap();
            let check = |model: &[u8], what: &str| {
                let mut got = vec![0u8; model.len() + 4096];
                let mut n = 0;
                loop {
                    let k = r.read_at(&mut got[n..], n as u64).unwrap();
                    if k == 0 {
                        break;
                    }
                    n += k;
                }
                assert_eq!(n, model.len(), "{what}: the size");
                if let Some(at) = got[..n].iter().zip(model).position(|(x, y)| x != y) {
                    panic!("{what}: a stale byte at {at}");
                }
            };
            // The agent counts a read as its task ends, just after the answer: the count
            // is taken once it stopped moving.
            let fuse_reads =
                || settled_count(|| stage(&agent_status(&mnt_a), "fuse-read", "calls"));
            check(&model, "first read");
            let before = fuse_reads();
            check(&model, "second read");
            assert_eq!(
                fuse_reads(),
                before,
                "the second read came from the page cache"
            );

            // Another node writes in place (size unchanged).
            let w = std::fs::OpenOptions::new().write(true).open(&pb).unwrap();
            let at = LEN / 3 + 123;
            let patch = vec![0x5Au8; 10_000];
            w.write_all_at(&patch, at as u64).unwrap();
            model[at..at + patch.len()].copy_from_slice(&patch);
            check(&model, "after another node's write");

            // The same again, then the mtime it had set back: size and mtime as the reader
            // last saw them.
            let mtime = std::fs::metadata(&pb).unwrap().modified().unwrap();
            check(&model, "once more");
            let patch = vec![0xC3u8; 5000];
            let at = 2 * LEN / 3 + 7;
            w.write_all_at(&patch, at as u64).unwrap();
            w.sync_all().unwrap();
            w.set_times(std::fs::FileTimes::new().set_modified(mtime))
                .unwrap();
            model[at..at + patch.len()].copy_from_slice(&patch);
            assert_eq!(std::fs::metadata(&pb).unwrap().modified().unwrap(), mtime);
            check(&model, "after a write whose mtime was set back");

            // This node's own small write through another handle (held back).
            let own = std::fs::OpenOptions::new().write(true).open(&pa).unwrap();
            let patch = vec![0x11u8; 300];
            let at = 4096 * 5 + 50;
            own.write_all_at(&patch, at as u64).unwrap();
            model[at..at + patch.len()].copy_from_slice(&patch);
            check(&model, "after this node's own write");
            drop(own);

            // Another node truncates.
            w.set_len((LEN / 2) as u64).unwrap();
            model.truncate(LEN / 2);
            check(&model, "after another node's truncate");

            // A new open of the unchanged file keeps what is cached.
            drop(r);
            let r2 = std::fs::File::open(&pa).unwrap();
            let mut buf = vec![0u8; LEN / 2];
            r2.read_exact_at(&mut buf, 0).unwrap();
            assert!(buf == model, "a new open reads the file");
            let before = fuse_reads();
            let r3 = std::fs::File::open(&pa).unwrap();
            r3.read_exact_at(&mut buf, 0).unwrap();
            assert!(buf == model);
            assert_eq!(
                fuse_reads(),
                before,
                "an open of an unchanged file keeps its pages"
            );
        },
    )
    .await;
    drop(a);
    drop(b);
    srv.stop().await;
}

/// A small file's bytes held back and written at its close go through the server in one
/// proxied `Write` whatever their length (here whole blocks, 64 KiB and 96 KiB: the direct
/// path cost a write layout over fresh blocks, the device write, its completion, an `Fsync`
/// and the layout's return), exact on another node; scattered extents (more than two) still
/// go direct under one layout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_files_bytes_go_through_the_server_at_its_close() {
    use std::os::unix::fs::FileExt;
    if !can_mount() {
        return;
    }
    let srv = cluster::start(10_000).await;
    let m = Mount::start(&srv, "small-close", "").await;
    let other = Mount::start(&srv, "small-close-other", "").await;
    let (mnt, here, there) = (m.path.clone(), m.path.clone(), other.path.clone());
    timed("small files' bytes at close", 120, move || {
        let count = |name: &str| settled_count(|| stage(&agent_status(&mnt), name, "calls"));
        for (i, len) in [64usize << 10, 96 << 10].into_iter().enumerate() {
            let name = format!("f{i}");
            let data = crate::support::pattern(len, 40 + i as u8);
            let (maps, proxied) = (count("map-write"), count("proxied"));
            // One buffered write, held back (shorter than the write-back's 128 KiB).
            std::fs::write(here.join(&name), &data).unwrap();
            assert_eq!(count("map-write"), maps, "{len} bytes: no write layout");
            assert_eq!(
                count("proxied"),
                proxied + 1,
                "{len} bytes: one proxied Write"
            );
            assert_eq!(
                std::fs::read(there.join(&name)).unwrap(),
                data,
                "{len} bytes there"
            );
        }
        // Three scattered whole blocks of a new file: direct, under one write layout.
        let f = std::fs::File::create(here.join("scattered")).unwrap();
        let maps = count("map-write");
        for k in 0..3u64 {
            f.write_all_at(&[k as u8 + 1; 4096], k * (64 << 10))
                .unwrap();
        }
        f.sync_all().unwrap();
        assert!(
            count("map-write") > maps,
            "scattered extents: a write layout"
        );
        drop(f);
        let got = std::fs::read(there.join("scattered")).unwrap();
        for k in 0..3usize {
            assert!(
                got[k * (64 << 10)..][..4096]
                    .iter()
                    .all(|b| *b == k as u8 + 1)
            );
        }
    })
    .await;
    drop(m);
    drop(other);
    srv.stop().await;
}

/// Sets this thread's supplementary groups and file-system ids with raw system calls (glibc's
/// wrappers would change every thread of the test process). A file-system uid other than 0
/// drops the thread's file-system capabilities (`CAP_DAC_OVERRIDE`, ...) and keeps
/// `CAP_SETGID`; back to 0, they return.
fn thread_creds(groups: &[u32], fsuid: u32, fsgid: u32) {
    // SAFETY: the pointer and length describe `groups`, which outlives the call; the kernel
    // only reads it. The raw calls change this thread's credentials alone.
    let r = unsafe {
        libc::syscall(
            libc::SYS_setgroups,
            groups.len(),
            groups.as_ptr().cast::<libc::gid_t>(),
        )
    };
    assert_eq!(r, 0, "setgroups: {}", std::io::Error::last_os_error());
    // SAFETY: plain integer arguments; setfsgid/setfsuid cannot fail in a way that matters
    // here (checked by reading the ids back below through the file system's behaviour).
    unsafe {
        libc::syscall(libc::SYS_setfsgid, fsgid);
        libc::syscall(libc::SYS_setfsuid, fsuid);
    }
}

/// The agent reuses a caller's supplementary groups read up to a second before (`fuse/groups`):
/// a thread that drops a group is refused at once what only that group allowed, because the
/// kernel checks first with its exact credentials (`default_permissions`); the agent's older
/// groups never widen that.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_a_thread_drops_stops_counting_at_once() {
    use std::os::unix::fs::{PermissionsExt, chown};
    if !can_mount() {
        return;
    }
    let srv = cluster::start(10_000).await;
    let m = Mount::start(&srv, "groups", "allow_other").await;
    std::fs::set_permissions(
        m.path.parent().unwrap(),
        std::fs::Permissions::from_mode(0o755),
    )
    .unwrap();
    let dir = m.p("team");
    std::fs::create_dir(&dir).unwrap();
    chown(&dir, Some(0), Some(4242)).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o770)).unwrap();
    timed("a dropped group", 60, move || {
        thread_creds(&[4242], 1000, 1000);
        let member = std::fs::write(dir.join("by-member"), b"x");
        thread_creds(&[], 1000, 1000);
        let dropped = std::fs::write(dir.join("after-drop"), b"x");
        let listed = std::fs::read_dir(&dir).map(|d| d.count());
        thread_creds(&[], 0, 0);
        member.expect("a member of the directory's group creates in it");
        assert_eq!(
            dropped.map_err(|e| e.raw_os_error()),
            Err(Some(libc::EACCES)),
            "a create once the group is dropped"
        );
        assert_eq!(
            listed.map_err(|e| e.raw_os_error()),
            Err(Some(libc::EACCES)),
            "a listing once the group is dropped"
        );
        assert!(!dir.join("after-drop").exists());
    })
    .await;
    drop(m);
    srv.stop().await;
}

/// A write by a caller other than root clears the file's setuid bit, and its setgid bit where
/// the group may execute (as Linux does for a writer without CAP_FSETID; the C pjdfstest's
/// chmod/12): seen at once through the writer's descriptor and by the next stat, whether the
/// bytes are held back on this node, written through, or long; root's writes keep them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_by_another_than_root_clears_setuid_and_setgid_at_once() {
    use std::io::Write;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    if !can_mount() {
        return;
    }
    let srv = cluster::start(10_000).await;
    let m = Mount::start(&srv, "setid", "allow_other").await;
    std::fs::set_permissions(
        m.path.parent().unwrap(),
        std::fs::Permissions::from_mode(0o755),
    )
    .unwrap();
    let dir = m.p("d");
    std::fs::create_dir(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    timed("writes clearing setid bits", 60, move || {
        let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().mode() & 0o7777;
        let mut n = 0;
        for (writer, want) in [(1000, true), (0, false)] {
            for read_write in [false, true] {
                for len in [1usize, 200 << 10] {
                    for (before, after) in [
                        (0o4777, 0o777),
                        (0o2777, 0o777),
                        (0o6777, 0o777),
                        (0o2767, 0o2767),
                    ] {
                        n += 1;
                        let f = dir.join(format!("f{n}"));
                        std::fs::write(&f, b"").unwrap();
                        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(before))
                            .unwrap();
                        assert_eq!(mode(&f), before);
                        thread_creds(&[], writer, writer);
                        let mut file = std::fs::OpenOptions::new()
                            .read(read_write)
                            .write(true)
                            .open(&f)
                            .unwrap();
                        file.write_all(&vec![b'x'; len]).unwrap();
                        let seen = file.metadata().unwrap().mode() & 0o7777;
                        // Written out: the server's attributes from now on.
                        file.sync_all().unwrap();
                        drop(file);
                        thread_creds(&[], 0, 0);
                        let want = if want { after } else { before };
                        let case = format!("uid {writer}, {len} bytes, rw {read_write}");
                        assert_eq!(seen, want, "{before:o} after a write, fstat ({case})");
                        assert_eq!(mode(&f), want, "{before:o} after a write, stat ({case})");
                        // And after root's next write (which clears nothing).
                        let mut file = std::fs::OpenOptions::new().append(true).open(&f).unwrap();
                        file.write_all(b"y").unwrap();
                        let seen = file.metadata().unwrap().mode() & 0o7777;
                        assert_eq!(seen, want, "{before:o} after root's next write ({case})");
                    }
                }
            }
        }
        // The owner's own chmod (or utimes) held back on the node, then the owner's write:
        // the write comes last, so the bits go.
        for set_times in [false, true] {
            n += 1;
            let f = dir.join(format!("f{n}"));
            std::fs::write(&f, b"").unwrap();
            std::os::unix::fs::chown(&f, Some(1000), Some(1000)).unwrap();
            std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o644)).unwrap();
            thread_creds(&[], 1000, 1000);
            let mut file = std::fs::OpenOptions::new().write(true).open(&f).unwrap();
            file.write_all(b"a").unwrap();
            file.set_permissions(std::fs::Permissions::from_mode(0o6775))
                .unwrap();
            if set_times {
                file.set_modified(std::time::SystemTime::UNIX_EPOCH)
                    .unwrap();
            }
            file.write_all(b"b").unwrap();
            let seen = file.metadata().unwrap().mode() & 0o7777;
            file.sync_all().unwrap();
            drop(file);
            thread_creds(&[], 0, 0);
            assert_eq!(
                seen, 0o775,
                "the owner's chmod then write, fstat (times {set_times})"
            );
            assert_eq!(
                mode(&f),
                0o775,
                "the owner's chmod then write (times {set_times})"
            );
        }
    })
    .await;
    drop(m);
    srv.stop().await;
}

/// A close with nothing to send first is released with the agent's next create, or by
/// itself a few milliseconds later (docs/protocol.md "Handles released with a later call"):
/// either way the handle ends at the server, so an unlinked file's blocks come back once its
/// last descriptor is closed, and a loop of creates and closes leaves no handle open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closed_handles_are_released_with_later_calls_or_by_themselves() {
    if !can_mount() {
        return;
    }
    let srv = cluster::start(10_000).await;
    let m = Mount::start(&srv, "release", "").await;
    let dir = m.p("d");
    timed("closes released later", 120, move || {
        std::fs::create_dir(&dir).unwrap();
        let free = || {
            let st = rustix::fs::statvfs(&dir).unwrap();
            st.f_bfree * st.f_frsize
        };
        for i in 0..300 {
            std::fs::write(dir.join(format!("f{i}")), b"").unwrap();
        }
        let size = 8u64 << 20;
        for then_create in [true, false] {
            let before = free();
            let big = dir.join("big");
            std::fs::write(&big, vec![7u8; size as usize]).unwrap();
            let reader = std::fs::File::open(&big).unwrap();
            std::fs::remove_file(&big).unwrap();
            // Unlinked but open: its blocks stay.
            assert!(free() + size / 2 <= before, "the open file's blocks went");
            drop(reader);
            if then_create {
                std::fs::write(dir.join("next"), b"").unwrap();
            }
            let deadline = Instant::now() + Duration::from_secs(20);
            while free() < before && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            assert!(
                free() >= before,
                "an unlinked file's blocks never came back after its close (then_create \
                 {then_create}): {} of {before} bytes free",
                free()
            );
        }
        for i in 0..300 {
            std::fs::remove_file(dir.join(format!("f{i}"))).unwrap();
        }
    })
    .await;
    drop(m);
    srv.stop().await;
}
