//! Metadata operations per second, `bonnie++ -n` style: one process creates N empty files
//! in a fresh directory, stats them in random order, lists the directory, and deletes them,
//! through the FUSE mount and through the library, with a local file system on the same
//! machine as the reference (ext4 on a loop device as root, else the work directory's).
//! Then the concurrent case: 16 callers through plain gRPC ([`crate::metadata`]), which is
//! where group commit shows.
//!
//! sanfs acknowledges every create and unlink only once it is durable (a group commit with
//! `fdatasync`); the local file system does not sync at all. The comparison is the one a
//! user makes, not a like-for-like one.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, bail};
use sanfs_client_agent::client::Client;
use sanfs_proto::model::OpenFlags;
use sanfs_proto::types::{Credentials, ROOT_INODE};
use sanfs_testcluster::{LunKind, Luns};

use crate::cluster::BenchCluster;
use crate::env::{Env, MountPoint};
use crate::metadata::{MetadataParams, MetadataReport};
use crate::util::MIB;

/// One target's rates.
#[derive(Debug, Clone, serde::Serialize)]
pub struct MdRow {
    /// `local (ext4)`, `mount`, `library`.
    pub target: String,
    pub files: u64,
    pub create_per_s: f64,
    pub stat_per_s: f64,
    pub readdir_entries_per_s: f64,
    pub unlink_per_s: f64,
}

/// The metadata figure.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct MdFig {
    pub rows: Vec<MdRow>,
    pub concurrent: Option<MetadataReport>,
    pub skipped: Vec<String>,
}

/// A permutation of `0..n` (a fixed LCG shuffle: the same order every run).
fn shuffled(n: u64) -> Vec<u64> {
    let mut v: Vec<u64> = (0..n).collect();
    let mut x: u64 = 0x2545_f491_4f6c_dd1d;
    for i in (1..v.len()).rev() {
        x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
        let j = (x >> 33) as usize % (i + 1);
        v.swap(i, j);
    }
    v
}

fn rate(ops: u64, started: Instant) -> f64 {
    ops as f64 / started.elapsed().as_secs_f64().max(1e-9)
}

/// The four phases on a directory of a mounted file system.
fn on_path(target: &str, dir: &Path, n: u64) -> anyhow::Result<MdRow> {
    std::fs::create_dir(dir).with_context(|| format!("mkdir {}", dir.display()))?;
    let name = |i: u64| dir.join(format!("f{i:07}"));
    let t = Instant::now();
    for i in 0..n {
        std::fs::File::create_new(name(i)).with_context(|| format!("create {i}"))?;
    }
    let create = rate(n, t);
    let t = Instant::now();
    for i in shuffled(n) {
        std::fs::metadata(name(i)).with_context(|| format!("stat {i}"))?;
    }
    let stat = rate(n, t);
    let t = Instant::now();
    let listed = std::fs::read_dir(dir)?.count() as u64;
    if listed != n {
        bail!("{target}: readdir listed {listed} of {n} files");
    }
    let readdir = rate(listed, t);
    let t = Instant::now();
    for i in 0..n {
        std::fs::remove_file(name(i)).with_context(|| format!("unlink {i}"))?;
    }
    let unlink = rate(n, t);
    std::fs::remove_dir(dir)?;
    Ok(MdRow {
        target: target.into(),
        files: n,
        create_per_s: create,
        stat_per_s: stat,
        readdir_entries_per_s: readdir,
        unlink_per_s: unlink,
    })
}

/// The four phases through the library.
async fn on_library(client: &Client, dir_name: &str, n: u64) -> anyhow::Result<MdRow> {
    let cred = Credentials::root();
    let dir = client.mkdir(&cred, ROOT_INODE, dir_name, 0o755).await?.ino;
    let name = |i: u64| format!("f{i:07}");
    let flags = OpenFlags {
        read: true,
        write: true,
        append: false,
        truncate: false,
    };
    let t = Instant::now();
    for i in 0..n {
        let c = client
            .create(&cred, dir, name(i), 0o644, true, flags)
            .await?;
        client.release(&c.handle).await?;
    }
    let create = rate(n, t);
    let t = Instant::now();
    for i in shuffled(n) {
        client.lookup(&cred, dir, name(i)).await?;
    }
    let stat = rate(n, t);
    let t = Instant::now();
    let (mut cookie, mut listed) = (0, 0u64);
    loop {
        let r = client.readdir(&cred, dir, cookie, 1024, false).await?;
        listed += r
            .entries
            .iter()
            .filter(|e| e.name.as_bytes()[0] == b'f')
            .count() as u64;
        match r.entries.last() {
            Some(e) if !r.eof => cookie = e.cookie,
            _ => break,
        }
    }
    if listed != n {
        bail!("library: readdir listed {listed} of {n} files");
    }
    let readdir = rate(listed, t);
    let t = Instant::now();
    for i in 0..n {
        client.unlink(&cred, dir, name(i)).await?;
    }
    let unlink = rate(n, t);
    client.rmdir(&cred, ROOT_INODE, dir_name).await?;
    Ok(MdRow {
        target: "library".into(),
        files: n,
        create_per_s: create,
        stat_per_s: stat,
        readdir_entries_per_s: readdir,
        unlink_per_s: unlink,
    })
}

/// A local file system for the reference: ext4 on a loop device (root), else `work`'s own.
struct LocalFs {
    dir: PathBuf,
    label: String,
    mounted: Option<PathBuf>,
    _luns: Option<Luns>,
    _tmp: tempfile::TempDir,
}

impl LocalFs {
    fn new(work: &Path) -> anyhow::Result<LocalFs> {
        let tmp = tempfile::Builder::new()
            .prefix("sanfs-bench-local-")
            .tempdir_in(work)?;
        if sanfs_testcluster::is_root() && crate::util::which("mkfs.ext4").is_some() {
            let luns = Luns::create(tmp.path(), 1, 512 * MIB, LunKind::Loop)?;
            let dev = luns.paths()[0].clone();
            let mnt = tmp.path().join("mnt");
            std::fs::create_dir(&mnt)?;
            let ok = Command::new("mkfs.ext4")
                .args(["-q", "-F"])
                .arg(&dev)
                .status()?
                .success()
                && Command::new("mount")
                    .arg(&dev)
                    .arg(&mnt)
                    .status()?
                    .success();
            if ok {
                return Ok(LocalFs {
                    dir: mnt.clone(),
                    label: "local ext4 (loop)".into(),
                    mounted: Some(mnt),
                    _luns: Some(luns),
                    _tmp: tmp,
                });
            }
        }
        let fs = std::fs::read_to_string("/proc/self/mounts")
            .ok()
            .and_then(|m| {
                m.lines()
                    .filter_map(|l| {
                        let f: Vec<&str> = l.split_whitespace().collect();
                        (f.len() > 2 && work.starts_with(f[1]))
                            .then(|| (f[1].len(), f[2].to_owned()))
                    })
                    .max()
                    .map(|(_, t)| t)
            })
            .unwrap_or_else(|| "?".into());
        Ok(LocalFs {
            dir: tmp.path().to_path_buf(),
            label: format!("local {fs}"),
            mounted: None,
            _luns: None,
            _tmp: tmp,
        })
    }
}

impl Drop for LocalFs {
    fn drop(&mut self) {
        if let Some(m) = self.mounted.take() {
            let _ = rustix::mount::unmount(&m, rustix::mount::UnmountFlags::empty());
        }
    }
}

pub async fn run_md(
    env: &Env,
    cluster: &BenchCluster,
    mount: Option<&MountPoint>,
) -> anyhow::Result<MdFig> {
    let n: u64 = env.pick(2000, 500, 50);
    let mut fig = MdFig::default();
    let bar = env.bar(4, "metadata");
    bar.set_message("local");
    let local = LocalFs::new(&env.work)?;
    let (label, dir) = (local.label.clone(), local.dir.join("bonnie"));
    fig.rows.push(
        tokio::task::spawn_blocking(move || on_path(&label, &dir, n))
            .await
            .context("metadata thread")??,
    );
    drop(local);
    bar.inc(1);
    bar.set_message("mount");
    match mount {
        Some(m) => {
            let dir = m.path().join(format!("bonnie-{}", std::process::id()));
            fig.rows.push(
                tokio::task::spawn_blocking(move || on_path("sanfs mount", &dir, n))
                    .await
                    .context("metadata thread")??,
            );
        }
        None => fig.skipped.push("mount: no FUSE mount".into()),
    }
    bar.inc(1);
    bar.set_message("library");
    let client = BenchCluster::connect(cluster.client_config("bench-metadata")).await?;
    fig.rows
        .push(on_library(&client, &format!("bonnie-lib-{}", std::process::id()), n).await?);
    bar.inc(1);
    if env.existing.is_none() {
        bar.set_message("16 gRPC callers");
        fig.concurrent = Some(
            crate::metadata::run(&MetadataParams {
                callers: 16,
                files: (n / 8).max(4) as usize,
                dir: Some(env.work.clone()),
            })
            .await?,
        );
    }
    bar.inc(1);
    bar.finish_and_clear();
    Ok(fig)
}

impl std::fmt::Display for MdFig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "Metadata, bonnie++ -n style: one process, sequential create, random stat, readdir, sequential unlink"
        )?;
        writeln!(
            f,
            "{:<20} {:>6} {:>10} {:>10} {:>12} {:>10}",
            "target", "files", "create/s", "stat/s", "readdir e/s", "unlink/s"
        )?;
        for r in &self.rows {
            writeln!(
                f,
                "{:<20} {:>6} {:>10.0} {:>10.0} {:>12.0} {:>10.0}",
                r.target,
                r.files,
                r.create_per_s,
                r.stat_per_s,
                r.readdir_entries_per_s,
                r.unlink_per_s
            )?;
        }
        if let Some(c) = &self.concurrent {
            writeln!(f, "{c}")?;
        }
        for s in &self.skipped {
            writeln!(f, "skipped: {s}")?;
        }
        Ok(())
    }
}
