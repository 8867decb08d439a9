//! The file systems sanfs is compared with through a mount, each on a LUN equal to sanfs'
//! (a file of the same size attached as a loop device with direct I/O), set up and removed by
//! the bench in the same run: ext4 (the local-disk reference) and MooseFS 3.0 (a shared file
//! system with a metadata server, a chunk server and a FUSE client).
//!
//! MooseFS' chunk server refuses 127.0.0.1, so its three daemons run in a network namespace
//! of the bench's own with an address on a bridge (10.99.0.1), every MooseFS program started
//! with `nsenter --net` only (the FUSE mount stays visible to the bench). Its configs, its
//! metadata directory and the chunk server's disk (ext4 on the equal LUN) are the bench's
//! own; one copy of each chunk (`mfssetgoal 1`, like one LUN) and no trash (`mfssettrashtime
//! 0`, so that deleted files free their space at once). Every process is stopped by its own
//! id, every mount and loop device removed by its exact name.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use sanfs_testcluster::{ChildGuard, LunKind, Luns, Netns};

use crate::cluster::is_mounted;
use crate::util::which;

/// The Debian packages of the MooseFS peer.
pub const MOOSEFS_PACKAGES: &str = "moosefs-master moosefs-chunkserver moosefs-client";

/// A directory on a mounted file system to measure, and the processes (besides the bench's
/// own) that do its work, for CPU time.
#[derive(Debug, Clone)]
pub struct FsTarget {
    /// `sanfs`, `ext4`, `moosefs`.
    pub name: String,
    pub dir: PathBuf,
    pub pids: Vec<u32>,
}

fn run(cmd: &mut Command) -> anyhow::Result<String> {
    let out = cmd.output().with_context(|| format!("run {cmd:?}"))?;
    if !out.status.success() {
        bail!(
            "{cmd:?}: {}{}",
            String::from_utf8_lossy(&out.stderr).trim(),
            String::from_utf8_lossy(&out.stdout).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// ext4 made on a loop device of its own and mounted; unmounted and removed on drop.
pub struct Ext4 {
    pub mnt: PathBuf,
    mounted: bool,
    _luns: Luns,
    _dir: tempfile::TempDir,
}

impl Ext4 {
    /// Why ext4 on a loop device cannot be made here, or `None`.
    pub fn unavailable() -> Option<String> {
        if !sanfs_testcluster::is_root() {
            return Some("needs root (loop device, mount)".into());
        }
        which("mkfs.ext4")
            .is_none()
            .then(|| "mkfs.ext4 missing: apt-get install e2fsprogs".into())
    }

    /// ext4 on a LUN of `lun_size` bytes in a fresh directory under `work`.
    pub fn start(work: &Path, tag: &str, lun_size: u64) -> anyhow::Result<Ext4> {
        if let Some(why) = Self::unavailable() {
            bail!("{why}");
        }
        let dir = tempfile::Builder::new()
            .prefix(&format!("sanfs-bench-ext4-{tag}-"))
            .tempdir_in(work)?;
        let luns = Luns::create(dir.path(), 1, lun_size, LunKind::Loop)?;
        let dev = luns.paths()[0].clone();
        let mnt = dir.path().join("mnt");
        std::fs::create_dir(&mnt)?;
        let mut fs = Ext4 {
            mnt,
            mounted: false,
            _luns: luns,
            _dir: dir,
        };
        run(Command::new("mkfs.ext4").args(["-q", "-F"]).arg(&dev))?;
        run(Command::new("mount").arg(&dev).arg(&fs.mnt))?;
        fs.mounted = true;
        Ok(fs)
    }

    pub fn target(&self) -> FsTarget {
        FsTarget {
            name: "ext4".into(),
            dir: self.mnt.clone(),
            pids: Vec::new(),
        }
    }
}

fn unmount(path: &Path) {
    let _ = rustix::mount::unmount(path, rustix::mount::UnmountFlags::empty())
        .or_else(|_| rustix::mount::unmount(path, rustix::mount::UnmountFlags::DETACH));
}

impl Drop for Ext4 {
    fn drop(&mut self) {
        if self.mounted {
            unmount(&self.mnt);
        }
    }
}

/// A MooseFS of one master, one chunk server (on ext4 over its own loop device) and one
/// `mfsmount`, in a network namespace of its own; all of it stopped and removed on drop.
pub struct MooseFs {
    pub mnt: PathBuf,
    mount: Option<ChildGuard>,
    chunkserver: Option<ChildGuard>,
    master: Option<ChildGuard>,
    netns: Option<Netns>,
    hdd: PathBuf,
    hdd_mounted: bool,
    _luns: Luns,
    dir: tempfile::TempDir,
}

/// The master's address on the namespace's bridge.
const MASTER_IP: &str = "10.99.0.1";

impl MooseFs {
    /// Why MooseFS cannot run here, or `None`.
    pub fn unavailable() -> Option<String> {
        if !sanfs_testcluster::is_root() {
            return Some("needs root (loop device, network namespace, FUSE)".into());
        }
        let mut missing = Vec::new();
        for (bin, pkg) in [
            ("mfsmaster", "moosefs-master"),
            ("mfschunkserver", "moosefs-chunkserver"),
            ("mfsmount", "moosefs-client"),
            ("mfssetgoal", "moosefs-client"),
            ("mkfs.ext4", "e2fsprogs"),
            ("nsenter", "util-linux"),
            ("ip", "iproute2"),
        ] {
            if which(bin).is_none() && !missing.contains(&pkg) {
                missing.push(pkg);
            }
        }
        if !Path::new("/var/lib/mfs/metadata.mfs.empty").exists()
            && !missing.contains(&"moosefs-master")
        {
            missing.push("moosefs-master");
        }
        if missing.is_empty() {
            None
        } else {
            Some(format!(
                "missing {}: apt-get install {MOOSEFS_PACKAGES}",
                missing.join(", ")
            ))
        }
    }

    /// Starts MooseFS with its chunk server's disk on a LUN of `lun_size` bytes, mounted in a
    /// fresh directory under `work`.
    pub fn start(work: &Path, tag: &str, lun_size: u64) -> anyhow::Result<MooseFs> {
        if let Some(why) = Self::unavailable() {
            bail!("{why}");
        }
        // The daemons run as user mfs: every directory above their state must be searchable
        // by others. A work directory under a private one (a `mktemp -d` clone, mode 0700)
        // is not: MooseFS then keeps its state under /var/tmp instead.
        let base = if searchable_by_others(work) {
            work.to_path_buf()
        } else {
            let fallback = PathBuf::from("/var/tmp");
            eprintln!(
                "moosefs: {} is not searchable by the mfs user (a parent is private): its state goes under {}",
                work.display(),
                fallback.display()
            );
            fallback
        };
        let dir = tempfile::Builder::new()
            .prefix(&format!("sanfs-bench-mfs-{tag}-"))
            .tempdir_in(&base)?;
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))?;
        let luns = Luns::create(dir.path(), 1, lun_size, LunKind::Loop)?;
        let dev = luns.paths()[0].clone();
        let d = dir.path().to_path_buf();
        let (master_dir, cs_dir, hdd, mnt) =
            (d.join("master"), d.join("cs"), d.join("hdd"), d.join("mnt"));
        for p in [&master_dir, &cs_dir, &hdd, &mnt] {
            std::fs::create_dir(p)?;
        }
        let mut fs = MooseFs {
            mnt,
            mount: None,
            chunkserver: None,
            master: None,
            netns: None,
            hdd: hdd.clone(),
            hdd_mounted: false,
            _luns: luns,
            dir,
        };
        run(Command::new("mkfs.ext4").args(["-q", "-F"]).arg(&dev))?;
        run(Command::new("mount").arg(&dev).arg(&hdd))?;
        fs.hdd_mounted = true;
        std::fs::copy(
            "/var/lib/mfs/metadata.mfs.empty",
            master_dir.join("metadata.mfs"),
        )
        .context("copy MooseFS' empty metadata")?;
        run(Command::new("chown")
            .arg("-R")
            .arg("mfs:mfs")
            .arg(&master_dir)
            .arg(&cs_dir)
            .arg(&hdd))
        .context("the MooseFS daemons run as user mfs")?;
        let text = |p: &Path| p.to_string_lossy().into_owned();
        std::fs::write(
            d.join("mfsexports.cfg"),
            "* / rw,alldirs,admin,maproot=0:0\n",
        )?;
        std::fs::write(d.join("mfstopology.cfg"), "")?;
        std::fs::write(d.join("mfshdd.cfg"), format!("{}\n", text(&hdd)))?;
        std::fs::write(
            d.join("mfsmaster.cfg"),
            format!(
                "DATA_PATH = {}\nEXPORTS_FILENAME = {}\nTOPOLOGY_FILENAME = {}\n",
                text(&master_dir),
                text(&d.join("mfsexports.cfg")),
                text(&d.join("mfstopology.cfg"))
            ),
        )?;
        std::fs::write(
            d.join("mfschunkserver.cfg"),
            format!(
                "DATA_PATH = {}\nHDD_CONF_FILENAME = {}\nMASTER_HOST = {MASTER_IP}\n\
                 HDD_LEAVE_SPACE_DEFAULT = 16MiB\n",
                text(&cs_dir),
                text(&d.join("mfshdd.cfg"))
            ),
        )?;
        let netns = Netns::create(&format!("mfs{tag}"))?;
        let ns = netns
            .name()
            .context("a namespace without a name")?
            .to_owned();
        for args in [
            vec!["-n", &ns, "link", "add", "br0", "type", "bridge"],
            vec!["-n", &ns, "addr", "add", "10.99.0.1/24", "dev", "br0"],
            vec!["-n", &ns, "link", "set", "br0", "up"],
        ] {
            run(Command::new("ip").args(&args))?;
        }
        fs.netns = Some(netns);
        let master_cfg = d.join("mfsmaster.cfg");
        fs.master = Some(fs.daemon(
            "mfsmaster",
            &["-f", "-c", &text(&master_cfg), "start"],
            "master.log",
        )?);
        fs.wait_port(9420, "master.log")?;
        let cs_cfg = d.join("mfschunkserver.cfg");
        fs.chunkserver = Some(fs.daemon(
            "mfschunkserver",
            &["-f", "-c", &text(&cs_cfg), "start"],
            "chunkserver.log",
        )?);
        fs.wait_port(9422, "chunkserver.log")?;
        let mnt = text(&fs.mnt);
        fs.mount = Some(fs.daemon("mfsmount", &["-f", &mnt, "-H", MASTER_IP], "mount.log")?);
        let deadline = Instant::now() + Duration::from_secs(30);
        while !is_mounted(&fs.mnt) {
            if Instant::now() >= deadline {
                bail!(
                    "mfsmount did not mount in 30 s: {}",
                    fs.log_tail("mount.log")
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        for tool in ["mfssetgoal", "mfssettrashtime"] {
            let mut cmd = fs.ns()?.command(tool);
            run(cmd.args(["-r", if tool == "mfssetgoal" { "1" } else { "0" }, &mnt]))?;
        }
        // Writes fail until the chunk server has registered its disk with the master.
        let probe = fs.mnt.join(".sanfs-bench-probe");
        retry(Duration::from_secs(30), || {
            std::fs::write(&probe, b"probe")?;
            std::fs::File::open(&probe)?.sync_all()?;
            Ok(())
        })
        .with_context(|| format!("first write: {}", fs.log_tail("chunkserver.log")))?;
        std::fs::remove_file(&probe)?;
        Ok(fs)
    }

    fn ns(&self) -> anyhow::Result<&Netns> {
        self.netns.as_ref().context("the MooseFS namespace is gone")
    }

    /// Starts `program ARGS` in the namespace, its output into `log`.
    fn daemon(&self, program: &str, args: &[&str], log: &str) -> anyhow::Result<ChildGuard> {
        let log = std::fs::File::create(self.dir.path().join(log))?;
        let mut cmd = self.ns()?.command(program);
        cmd.args(args)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        ChildGuard::spawn(&mut cmd).with_context(|| format!("start {program}"))
    }

    fn wait_port(&self, port: u16, log: &str) -> anyhow::Result<()> {
        let addr = format!("{MASTER_IP}:{port}").parse()?;
        self.ns()?
            .wait_for_tcp(addr, Duration::from_secs(30))
            .with_context(|| self.log_tail(log))
    }

    fn log_tail(&self, name: &str) -> String {
        let s = std::fs::read_to_string(self.dir.path().join(name)).unwrap_or_default();
        let lines: Vec<&str> = s.lines().rev().take(5).collect();
        lines.into_iter().rev().collect::<Vec<_>>().join(" | ")
    }

    pub fn target(&self) -> FsTarget {
        let pids = [&self.mount, &self.chunkserver, &self.master]
            .into_iter()
            .flatten()
            .map(ChildGuard::pid)
            .collect();
        FsTarget {
            name: "moosefs".into(),
            dir: self.mnt.clone(),
            pids,
        }
    }
}

impl Drop for MooseFs {
    fn drop(&mut self) {
        if is_mounted(&self.mnt) {
            unmount(&self.mnt);
        }
        if let Some(mut m) = self.mount.take() {
            let _ = m.terminate(Duration::from_secs(10));
        }
        if let Some(mut c) = self.chunkserver.take() {
            let _ = c.terminate(Duration::from_secs(20));
        }
        if let Some(mut m) = self.master.take() {
            // The master writes its metadata out on SIGTERM.
            let _ = m.terminate(Duration::from_secs(30));
        }
        self.netns.take();
        if self.hdd_mounted {
            unmount(&self.hdd);
        }
    }
}

/// Waits until `f` succeeds or `timeout` passes; the last error otherwise.
fn retry<T>(timeout: Duration, mut f: impl FnMut() -> anyhow::Result<T>) -> anyhow::Result<T> {
    let deadline = Instant::now() + timeout;
    loop {
        match f() {
            Ok(v) => return Ok(v),
            Err(e) if Instant::now() >= deadline => return Err(e),
            Err(_) => std::thread::sleep(Duration::from_millis(200)),
        }
    }
}

/// Whether `dir` and every directory above it may be searched by any user (mode `o+x`).
fn searchable_by_others(dir: &Path) -> bool {
    let Ok(full) = dir.canonicalize() else {
        return false;
    };
    full.ancestors()
        .all(|d| std::fs::metadata(d).is_ok_and(|m| m.permissions().mode() & 0o001 != 0))
}
