//! Online metadata backup and restore (issue 21 item 6) with real processes: a `sanfs-mds`
//! process serves a `sanfs-agent` FUSE mount on which a writer creates fsync'd files while
//! `sanfs-admin backup` copies the store. Checked: the backup is clean for `fsck --backup`
//! and names the file system; a second backup to the same path is refused (EEXIST) and leaves
//! the first as it was; `restore` is refused while the server runs (exit 4), without --force
//! over an existing store, for a damaged backup (bytes flipped) and for the LUNs of another
//! file system, each changing nothing; after the restore the server starts on the restored
//! store, every file acknowledged before the backup began reads back byte-exact through a new
//! mount, files begun after it returned are gone, the volume takes new files, and fsck of the
//! store is clean. Root only (FUSE).

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use sanfs_testcluster::ChildGuard;
use serde_json::Value;

use crate::quickstart::mds_binary;
use crate::san::{can_mount, is_mounted};

const MIB: u64 = 1 << 20;

fn q(p: &Path) -> String {
    format!("{:?}", p.display().to_string())
}

/// Writes `mds.toml` for a server on `sock` over `luns` with its store at `meta`, and formats.
fn configure(dir: &Path, name: &str, luns: usize, sock: &Path, meta: &Path) -> PathBuf {
    let paths: Vec<PathBuf> = (0..luns)
        .map(|i| dir.join(format!("{name}-lun{i}")))
        .collect();
    for l in &paths {
        File::create(l).unwrap().set_len(64 * MIB).unwrap();
    }
    let devices: Vec<String> = paths.iter().map(|l| q(l)).collect();
    let config = dir.join(format!("{name}.toml"));
    std::fs::write(
        &config,
        format!(
            "[server]\nlisten_unix = {}\nlease_ttl_ms = 2000\n\
             [metadata]\npath = {}\n\
             [volume]\nlayout = \"striped\"\nstripe_unit = \"64KiB\"\ndevices = [{}]\n",
            q(sock),
            q(meta),
            devices.join(", ")
        ),
    )
    .unwrap();
    let out = Command::new(mds_binary())
        .args(["format", "--config", config.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(out.status.success(), "format: {out:?}");
    config
}

fn run(mut cmd: Command) -> Output {
    let mut child = ChildGuard::spawn(cmd.stdout(Stdio::piped()).stderr(Stdio::piped())).unwrap();
    let st = child
        .wait_timeout(Duration::from_secs(60))
        .unwrap()
        .expect("the command ends within 60 s");
    let c = child.child_mut();
    let mut stdout = Vec::new();
    let mut stderr = Vec::new();
    std::io::Read::read_to_end(c.stdout.as_mut().unwrap(), &mut stdout).unwrap();
    std::io::Read::read_to_end(c.stderr.as_mut().unwrap(), &mut stderr).unwrap();
    Output {
        status: st,
        stdout,
        stderr,
    }
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn mds(args: &[&str]) -> Output {
    let mut cmd = Command::new(mds_binary());
    cmd.args(args).env("RUST_LOG", "warn");
    run(cmd)
}

/// The contents of file `i` of the writer: its own size and bytes.
fn contents(i: u64) -> Vec<u8> {
    let len = 4096 * (1 + (i % 37)) as usize + (i as usize * 131) % 4096;
    (0..len)
        .map(|k| (k as u64).wrapping_mul(31).wrapping_add(i * 7919) as u8)
        .collect()
}

struct Setup {
    dir: tempfile::TempDir,
    config: PathBuf,
    sock: PathBuf,
    mount: PathBuf,
    server: Option<ChildGuard>,
    agent: Option<ChildGuard>,
}

impl Setup {
    fn new() -> Setup {
        let dir = tempfile::Builder::new()
            .prefix("sanfs-h15-backup-")
            .tempdir()
            .unwrap();
        let sock = dir.path().join("mds.sock");
        let config = configure(dir.path(), "fs", 2, &sock, &dir.path().join("meta.redb"));
        let mount = dir.path().join("mnt");
        std::fs::create_dir(&mount).unwrap();
        let mut s = Setup {
            dir,
            config,
            sock,
            mount,
            server: None,
            agent: None,
        };
        s.start_server();
        s.mount_agent();
        s
    }

    fn start_server(&mut self) {
        let _ = std::fs::remove_file(&self.sock);
        let mut cmd = Command::new(mds_binary());
        cmd.args(["serve", "--config", self.config.to_str().unwrap()])
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(self.dir.path().join("mds.log"))
                    .unwrap(),
            );
        let mut server = ChildGuard::spawn(&mut cmd).unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::os::unix::net::UnixStream::connect(&self.sock).is_err() {
            if let Some(st) = server.try_wait().unwrap() {
                panic!("sanfs-mds exited: {st}; log:\n{}", self.log("mds.log"));
            }
            assert!(Instant::now() < deadline, "sanfs-mds did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
        self.server = Some(server);
    }

    fn stop_server(&mut self) {
        let st = self
            .server
            .take()
            .unwrap()
            .terminate(Duration::from_secs(10))
            .unwrap();
        assert!(st.success(), "sanfs-mds stopped with {st}");
    }

    fn mount_agent(&mut self) {
        let run_dir = self.dir.path().join("run");
        std::fs::create_dir_all(&run_dir).unwrap();
        let opts = format!(
            "devices={},client_name=h15-backup-mount",
            self.dir.path().join("fs-lun*").display()
        );
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_sanfs-agent"));
        cmd.arg("mount")
            .arg(format!("unix:{}", self.sock.display()))
            .arg(&self.mount)
            .args(["-o", &opts, "--foreground"])
            .env("SANFS_RUN_DIR", &run_dir)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stderr(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(self.dir.path().join("agent.log"))
                    .unwrap(),
            );
        let mut child = ChildGuard::spawn(&mut cmd).unwrap();
        let deadline = Instant::now() + Duration::from_secs(60);
        while !is_mounted(&self.mount) {
            if let Some(st) = child.try_wait().unwrap() {
                panic!("sanfs-agent exited: {st}; log:\n{}", self.log("agent.log"));
            }
            assert!(Instant::now() < deadline, "the mount did not appear");
            std::thread::sleep(Duration::from_millis(20));
        }
        self.agent = Some(child);
    }

    fn unmount(&mut self) {
        rustix::mount::unmount(&self.mount, rustix::mount::UnmountFlags::empty()).unwrap();
        if let Some(mut a) = self.agent.take()
            && !matches!(a.wait_timeout(Duration::from_secs(10)), Ok(Some(_)))
        {
            let _ = a.kill9();
        }
    }

    fn log(&self, name: &str) -> String {
        std::fs::read_to_string(self.dir.path().join(name)).unwrap_or_default()
    }

    /// `sanfs-admin --server unix:SOCK ARGS` (root on the unix socket: an administrator).
    fn admin(&self, args: &[&str]) -> Output {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_sanfs-admin"));
        cmd.arg("--server")
            .arg(format!("unix:{}", self.sock.display()))
            .args(args);
        run(cmd)
    }

    fn restore(&self, config: &Path, backup: &Path, force: bool) -> Output {
        let mut args = vec![
            "restore",
            "--config",
            config.to_str().unwrap(),
            backup.to_str().unwrap(),
        ];
        if force {
            args.push("--force");
        }
        mds(&args)
    }
}

impl Drop for Setup {
    fn drop(&mut self) {
        if is_mounted(&self.mount) {
            let _ = rustix::mount::unmount(&self.mount, rustix::mount::UnmountFlags::empty());
        }
        if let Some(mut a) = self.agent.take()
            && !matches!(a.wait_timeout(Duration::from_secs(10)), Ok(Some(_)))
        {
            let _ = a.kill9();
        }
        if is_mounted(&self.mount) {
            let _ = rustix::mount::unmount(&self.mount, rustix::mount::UnmountFlags::DETACH);
        }
        if let Some(mut s) = self.server.take() {
            let _ = s.terminate(Duration::from_secs(5));
        }
    }
}

#[test]
fn a_backup_taken_under_a_writer_restores_to_a_store_that_serves_the_files_acknowledged_before_it()
{
    if !can_mount("backup::a_backup_taken_under_a_writer_restores") {
        return;
    }
    let mut s = Setup::new();
    let work = s.mount.join("w");
    std::fs::create_dir(&work).unwrap();

    // The writer: file i is created, written, fsync'd and closed; `done` counts the files
    // acknowledged so far, `started` the files begun.
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let started = Arc::new(AtomicU64::new(0));
    let writer = {
        let (stop, done, started, work) = (stop.clone(), done.clone(), started.clone(), work);
        std::thread::spawn(move || {
            let mut i = 0u64;
            while !stop.load(Ordering::SeqCst) {
                started.store(i + 1, Ordering::SeqCst);
                let mut f = File::create(work.join(format!("f{i}"))).unwrap();
                f.write_all(&contents(i)).unwrap();
                f.sync_all().unwrap();
                drop(f);
                i += 1;
                done.store(i, Ordering::SeqCst);
            }
            i
        })
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    while done.load(Ordering::SeqCst) < 30 {
        assert!(Instant::now() < deadline, "the writer is stuck");
        std::thread::sleep(Duration::from_millis(10));
    }

    // The backup, while the writer goes on.
    let backup = s.dir.path().join("backups").join("mds-backup.redb");
    std::fs::create_dir(backup.parent().unwrap()).unwrap();
    let acknowledged_before = done.load(Ordering::SeqCst);
    let out = s.admin(&["backup", backup.to_str().unwrap(), "--json"]);
    let begun_by_then = started.load(Ordering::SeqCst);
    assert!(
        out.status.success(),
        "backup: {}\n{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    let reply: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(
        reply["inodes"].as_u64().unwrap() >= acknowledged_before + 2,
        "{reply}"
    );
    assert_eq!(
        reply["size_bytes"].as_u64().unwrap(),
        std::fs::metadata(&backup).unwrap().len()
    );
    let fs_uuid = reply["fs_uuid"].as_str().unwrap().to_owned();
    // Only the backup in its directory: no temporary file left.
    let names: Vec<String> = std::fs::read_dir(backup.parent().unwrap())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, ["mds-backup.redb"]);
    // The server logs it.
    assert!(s.log("mds.log").contains("metadata store backed up"));

    // More files after it, then the writer stops.
    let more = done.load(Ordering::SeqCst) + 20;
    while done.load(Ordering::SeqCst) < more {
        assert!(
            Instant::now() < deadline + Duration::from_secs(60),
            "the writer is stuck"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    stop.store(true, Ordering::SeqCst);
    let written = writer.join().unwrap();
    std::fs::write(s.mount.join("after"), vec![9u8; MIB as usize]).unwrap();

    // The same path again: refused, and the backup stays as it was.
    let first = std::fs::read(&backup).unwrap();
    let again = s.admin(&["backup", backup.to_str().unwrap()]);
    assert_eq!(again.status.code(), Some(1), "{again:?}");
    assert!(text(&again.stderr).contains("file exists"), "{again:?}");
    assert!(std::fs::read(&backup).unwrap() == first);

    // fsck of the backup: clean, and it says what it is.
    let out = mds(&["fsck", "--backup", backup.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let t = text(&out.stdout);
    assert!(t.contains(&format!("backup of fs {fs_uuid}")), "{t}");
    assert!(t.contains("clean"), "{t}");

    // Restore while the server runs: the store is in use.
    let meta = s.dir.path().join("meta.redb");
    let out = s.restore(&s.config, &backup, true);
    assert_eq!(out.status.code(), Some(4), "{out:?}");
    assert!(text(&out.stderr).contains("in use"), "{out:?}");

    // The mount stays up through the restore (an operator who forgot a node): it must
    // refuse the restored server below.
    s.stop_server();
    let live = std::fs::read(&meta).unwrap();

    // Without --force over the store that exists: refused.
    let out = s.restore(&s.config, &backup, false);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(text(&out.stderr).contains("--force"), "{out:?}");
    // A damaged backup: 4 KiB of its middle flipped.
    let damaged = s.dir.path().join("damaged.redb");
    let mut bytes = first.clone();
    let mid = bytes.len() / 2 / 4096 * 4096;
    for b in &mut bytes[mid..mid + 4096] {
        *b ^= 0x5a;
    }
    std::fs::write(&damaged, &bytes).unwrap();
    let out = s.restore(&s.config, &damaged, true);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(text(&out.stderr).contains("nothing was written"), "{out:?}");
    let out = mds(&["fsck", "--backup", damaged.to_str().unwrap()]);
    assert_ne!(out.status.code(), Some(0), "{out:?}");
    // The LUNs of another file system.
    let other_meta = s.dir.path().join("other.redb");
    let other = configure(
        s.dir.path(),
        "other",
        1,
        &s.dir.path().join("other.sock"),
        &other_meta,
    );
    let other_before = std::fs::read(&other_meta).unwrap();
    let out = s.restore(&other, &backup, true);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(text(&out.stderr).contains("another file system"), "{out:?}");
    assert!(std::fs::read(&other_meta).unwrap() == other_before);
    assert!(
        std::fs::read(&meta).unwrap() == live,
        "a refused restore changed the store"
    );

    // The restore.
    let out = s.restore(&s.config, &backup, true);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    assert!(text(&out.stdout).contains("restored"), "{out:?}");

    // Served again. The mount that stayed up refuses the restored server (its restore count
    // changed under it): its calls fail with EIO, the reason in its log.
    s.start_server();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !s
        .log("agent.log")
        .contains("restored from a backup since this mount")
    {
        assert!(
            Instant::now() < deadline,
            "the agent mounted across the restore did not refuse the restored server; log:\n{}",
            s.log("agent.log")
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let e = std::fs::metadata(s.mount.join("looked-up-after-the-restore")).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e}");
    s.unmount();
    // Mounted again: the files acknowledged before the backup, byte-exact; those begun after
    // it returned, gone; new files fit.
    s.mount_agent();
    let work = s.mount.join("w");
    for i in 0..acknowledged_before {
        let got = std::fs::read(work.join(format!("f{i}")))
            .unwrap_or_else(|e| panic!("f{i} (acknowledged before the backup): {e}"));
        assert!(got == contents(i), "f{i} differs after the restore");
    }
    for i in begun_by_then..written {
        assert!(
            !work.join(format!("f{i}")).exists(),
            "f{i} was begun after the backup returned"
        );
    }
    assert!(!s.mount.join("after").exists());
    let fresh = vec![3u8; 4 * MIB as usize];
    std::fs::write(s.mount.join("fresh"), &fresh).unwrap();
    s.unmount();
    s.mount_agent();
    assert!(std::fs::read(s.mount.join("fresh")).unwrap() == fresh);
    s.unmount();
    s.stop_server();
    let out = mds(&["fsck", "--config", s.config.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
}
