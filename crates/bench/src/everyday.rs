//! Everyday I/O through a mount (issue 18), in one run on sanfs (the bench's own one-LUN
//! cluster and FUSE mount), ext4 on an equal loop device and MooseFS 3.0 ([`crate::peers`]):
//!
//! - buffered sequential writes (then `fsync`, inside the time) and cold reads (the file's
//!   page cache dropped with `fadvise(DONTNEED)` first) of 4 KiB, 8 KiB, 64 KiB, 1 MiB;
//! - random 4 KiB and 8 KiB writes inside one preallocated file, then `fsync`;
//! - bonnie++-style block write, rewrite (read 8 KiB, change it, write it back in place) and
//!   block read, 8 KiB chunks (bonnie's own), a loop of the bench's own;
//! - a tree of small files (1 to 64 KiB, sizes from a fixed sequence) in directories:
//!   written (then `sync -f`), then read cold;
//! - the everyday table, in seconds: `tar x` of a source tree (a tarball made
//!   deterministically from the crates of this machine's cargo registry: sorted names, zero
//!   times and owners), `ls -lR`, `grep -r`, `cp -r`, `rm -rf`, each followed by `sync -f`
//!   where it writes. Caches stay warm between them, as for a user working in the tree.
//!
//! Every throughput row carries the CPU seconds spent per GiB moved, summed over the bench
//! process (which does the I/O), and for sanfs its agent and `sanfs-mds`, for MooseFS its
//! `mfsmount`, chunk server and master (`/proc/PID/stat`). Kernel threads (ext4's writeback,
//! the loop devices' workers) are counted for none.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{Context, bail};

use crate::cpu::CpuMeter;
use crate::env::{Env, MountPoint};
use crate::peers::{Ext4, FsTarget, MooseFs};
use crate::util::{KIB, MIB, mb_per_s, pattern, size_label};

/// How much each row does.
#[derive(Debug, Clone, serde::Serialize)]
pub struct EverydayParams {
    /// Bytes of the sequential and bonnie files, and of the random-write file.
    pub file_len: u64,
    /// Longest one throughput row runs (it stops earlier at the end of its file).
    pub row_secs: f64,
    pub seq_sizes: Vec<u64>,
    pub tree_files: u64,
    pub tree_dirs: u64,
    /// Files wanted in the source tarball (whole crates, so a few more).
    pub src_files: u64,
}

impl EverydayParams {
    pub fn of(env: &Env) -> EverydayParams {
        EverydayParams {
            file_len: env.counts.everyday_file_len.unwrap_or(env.pick(
                256 * MIB,
                64 * MIB,
                4 * MIB,
            )),
            row_secs: env.pick(20.0, 5.0, 1.0),
            seq_sizes: vec![4 * KIB, 8 * KIB, 64 * KIB, MIB],
            tree_files: env.counts.tree_files.unwrap_or(env.pick(10_000, 1_000, 40)),
            tree_dirs: env.counts.tree_dirs.unwrap_or(env.pick(100, 10, 4)),
            src_files: env.counts.src_files.unwrap_or(env.pick(1_500, 500, 30)),
        }
    }

    /// LUN bytes each file system gets: room for the largest row's files twice over.
    pub fn lun_size(&self) -> u64 {
        let tree = self.tree_files * 33 * KIB;
        (4 * self.file_len + 2 * tree + 256 * MIB).next_multiple_of(64 * MIB)
    }
}

/// One measurement on one file system.
#[derive(Debug, Clone, serde::Serialize)]
pub struct EverydayCell {
    /// `seq write 4K`, `tar x`, ...
    pub test: String,
    /// `sanfs`, `ext4`, `moosefs`.
    pub target: String,
    pub bytes: u64,
    pub secs: f64,
    /// For throughput rows; the time rows have `None`.
    pub mb_s: Option<f64>,
    pub cpu_s: f64,
    pub cpu_s_per_gib: Option<f64>,
}

/// The everyday figure.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Everyday {
    pub params: Option<EverydayParams>,
    /// The file systems measured, sanfs first.
    pub targets: Vec<String>,
    pub cells: Vec<EverydayCell>,
    /// The source tree of the everyday table: crates and files.
    pub source_tree: Option<String>,
    pub skipped: Vec<String>,
}

impl Everyday {
    pub fn get(&self, test: &str, target: &str) -> Option<&EverydayCell> {
        self.cells
            .iter()
            .find(|c| c.test == test && c.target == target)
    }

    /// Tests in the order they ran.
    pub fn tests(&self) -> Vec<String> {
        let mut v: Vec<String> = Vec::new();
        for c in &self.cells {
            if !v.contains(&c.test) {
                v.push(c.test.clone());
            }
        }
        v
    }
}

/// Measures `f`, which moves `bytes` (0 for a time row), with the CPU of the target's
/// processes.
fn timed(
    t: &FsTarget,
    test: &str,
    throughput: bool,
    f: impl FnOnce() -> anyhow::Result<u64>,
) -> anyhow::Result<EverydayCell> {
    let cpu = CpuMeter::start(t.pids.iter().copied());
    let started = Instant::now();
    let bytes = f().with_context(|| format!("{test} on {}", t.name))?;
    let secs = started.elapsed().as_secs_f64().max(1e-9);
    let used = cpu.finish(bytes);
    Ok(EverydayCell {
        test: test.into(),
        target: t.name.clone(),
        bytes,
        secs,
        mb_s: throughput.then(|| mb_per_s(bytes, secs)),
        cpu_s: used.cpu_s,
        cpu_s_per_gib: used.cpu_s_per_gib.filter(|_| throughput),
    })
}

fn drop_cache(f: &File) -> anyhow::Result<()> {
    rustix::fs::fadvise(f, 0, None, rustix::fs::Advice::DontNeed)?;
    Ok(())
}

fn open_rw(path: &Path, truncate: bool) -> anyhow::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(truncate)
        .open(path)
        .with_context(|| format!("open {}", path.display()))
}

/// Writes `len` bytes from offset 0 in `size` pieces (or fewer, when `secs` run out), then
/// fsync; returns the bytes written.
fn write_seq(f: &File, size: u64, len: u64, secs: f64, seed: u64) -> anyhow::Result<u64> {
    let buf = pattern(size as usize, seed);
    let started = Instant::now();
    let mut off = 0;
    while off + size <= len && (off == 0 || started.elapsed().as_secs_f64() < secs) {
        f.write_all_at(&buf, off)?;
        off += size;
    }
    f.sync_all()?;
    Ok(off)
}

/// Reads `len` bytes from offset 0 in `size` pieces; returns the bytes read.
fn read_seq(f: &File, size: u64, len: u64) -> anyhow::Result<u64> {
    let mut buf = vec![0u8; size as usize];
    let mut off = 0;
    while off < len {
        let n = f.read_at(&mut buf, off)?;
        if n == 0 {
            bail!("end of file at {off} of {len}");
        }
        off += n as u64;
    }
    Ok(off)
}

/// A fixed pseudo-random sequence (xorshift), the same every run.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// The tree's files: `(directory, file, size)` with sizes of 1 to 64 KiB.
fn tree_files(p: &EverydayParams) -> Vec<(u64, u64, u64)> {
    let mut rng = Rng(0x5eed_7ee5);
    (0..p.tree_files)
        .map(|i| (i % p.tree_dirs.max(1), i, KIB + rng.next() % (63 * KIB + 1)))
        .collect()
}

fn sync_fs(dir: &Path) -> anyhow::Result<()> {
    let f = File::open(dir)?;
    rustix::fs::syncfs(&f)?;
    Ok(())
}

fn shell(dir: &Path, program: &str, args: &[&str], ok_codes: &[i32]) -> anyhow::Result<()> {
    let out = Command::new(program)
        .args(args)
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .with_context(|| format!("run {program}"))?;
    match out.status.code() {
        Some(c) if ok_codes.contains(&c) => Ok(()),
        _ => bail!(
            "{program} {args:?} in {}: {} {}",
            dir.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ),
    }
}

/// The cargo registry's source directory with the most crates.
fn registry_src() -> Option<PathBuf> {
    let home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")))?;
    std::fs::read_dir(home.join("registry/src"))
        .ok()?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.is_dir())
        .max_by_key(|p| std::fs::read_dir(p).map_or(0, |d| d.count()))
}

fn count_files(dir: &Path) -> u64 {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return 0;
    };
    rd.filter_map(Result::ok)
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => count_files(&e.path()),
            Ok(t) if t.is_file() => 1,
            _ => 0,
        })
        .sum()
}

/// A tarball of the first crates (by name) of the cargo registry that hold at least `want`
/// files, made with sorted names and zeroed times and owners; its description.
fn make_tarball(work: &Path, want: u64) -> anyhow::Result<(PathBuf, String)> {
    let src = registry_src().context("no cargo registry sources (~/.cargo/registry/src)")?;
    let mut crates: Vec<String> = std::fs::read_dir(&src)?
        .filter_map(Result::ok)
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    crates.sort();
    let (mut picked, mut files) = (Vec::new(), 0);
    for c in crates {
        if files >= want {
            break;
        }
        files += count_files(&src.join(&c));
        picked.push(c);
    }
    if files < want {
        bail!("the cargo registry holds only {files} files");
    }
    let tar = work.join("everyday-src.tar");
    let mut cmd = Command::new("tar");
    cmd.args([
        "--sort=name",
        "--mtime=@0",
        "--owner=0",
        "--group=0",
        "--numeric-owner",
        "--no-xattrs",
        "-cf",
    ])
    .arg(&tar)
    .arg("-C")
    .arg(&src)
    .args(&picked);
    let out = cmd.output().context("run tar")?;
    if !out.status.success() {
        bail!("tar c: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    let desc = format!(
        "{} crates ({} .. {}), {files} files, {} MiB",
        picked.len(),
        picked.first().map_or("", |s| s.as_str()),
        picked.last().map_or("", |s| s.as_str()),
        std::fs::metadata(&tar)?.len() >> 20
    );
    Ok((tar, desc))
}

/// Every row on one file system, in a fresh directory of it.
fn on_target(
    t: &FsTarget,
    p: &EverydayParams,
    tarball: Option<&Path>,
    out: &mut Vec<EverydayCell>,
) -> anyhow::Result<()> {
    let base = t.dir.join(format!("everyday-{}", std::process::id()));
    std::fs::create_dir(&base).with_context(|| format!("mkdir {}", base.display()))?;
    // Sequential, per size: a new file, written then read cold.
    for &size in &p.seq_sizes {
        let path = base.join(format!("seq-{}", size_label(size)));
        let f = open_rw(&path, true)?;
        let w = timed(t, &format!("seq write {}", size_label(size)), true, || {
            write_seq(&f, size, p.file_len, p.row_secs, size)
        })?;
        let written = w.bytes;
        out.push(w);
        // Read cold through the writer's handle, then as `cat`, `cp` or a compiler reads it:
        // a new open for reading only (on sanfs the kernel's page cache serves that one; a
        // read-write handle reads through the agent).
        let read_cold = |f: &File, row: &str| {
            drop_cache(f)?;
            timed(t, &format!("{row} {}", size_label(size)), true, || {
                read_seq(f, size, written)
            })
        };
        out.push(read_cold(&f, "seq read")?);
        drop(f);
        let f = File::open(&path).with_context(|| format!("open {}", path.display()))?;
        out.push(read_cold(&f, "read-only read")?);
        drop(f);
        std::fs::remove_file(&path)?;
    }
    // Random writes inside one file, written whole first (untimed).
    let path = base.join("random");
    let f = open_rw(&path, true)?;
    write_seq(&f, MIB, p.file_len, f64::INFINITY, 7)?;
    for size in [4 * KIB, 8 * KIB] {
        let slots = p.file_len / size;
        let buf = pattern(size as usize, size ^ 0x77);
        let mut rng = Rng(0x2545_f491 ^ size);
        out.push(timed(
            t,
            &format!("random write {}", size_label(size)),
            true,
            || {
                let started = Instant::now();
                let mut n = 0u64;
                while n < slots && started.elapsed().as_secs_f64() < p.row_secs {
                    f.write_all_at(&buf, (rng.next() % slots) * size)?;
                    n += 1;
                }
                f.sync_all()?;
                Ok(n * size)
            },
        )?);
    }
    drop(f);
    std::fs::remove_file(&path)?;
    // bonnie++ style, 8 KiB chunks: block write, rewrite, block read.
    let chunk = 8 * KIB;
    let path = base.join("bonnie");
    let f = open_rw(&path, true)?;
    let w = timed(t, "bonnie block write", true, || {
        write_seq(&f, chunk, p.file_len, p.row_secs, 99)
    })?;
    let len = w.bytes;
    out.push(w);
    drop_cache(&f)?;
    out.push(timed(t, "bonnie rewrite", true, || {
        let mut buf = vec![0u8; chunk as usize];
        let mut off = 0;
        while off < len {
            f.read_exact_at(&mut buf, off)?;
            buf[0] = buf[0].wrapping_add(1);
            f.write_all_at(&buf, off)?;
            off += chunk;
        }
        f.sync_all()?;
        // bonnie counts the bytes once (read and written back).
        Ok(len)
    })?);
    drop_cache(&f)?;
    out.push(timed(t, "bonnie block read", true, || {
        read_seq(&f, chunk, len)
    })?);
    drop(f);
    std::fs::remove_file(&path)?;
    // The tree of small files.
    let tree = base.join("tree");
    std::fs::create_dir(&tree)?;
    let files = tree_files(p);
    let name = |d: u64, i: u64| tree.join(format!("d{d:03}")).join(format!("f{i:05}"));
    let label = format!("tree write {} files", p.tree_files);
    let data = pattern(64 * KIB as usize, 5);
    out.push(timed(t, &label, true, || {
        for d in 0..p.tree_dirs.max(1) {
            std::fs::create_dir(tree.join(format!("d{d:03}")))?;
        }
        let mut bytes = 0;
        for &(d, i, size) in &files {
            let mut f = File::create_new(name(d, i))?;
            f.write_all(&data[..size as usize])?;
            bytes += size;
        }
        sync_fs(&tree)?;
        Ok(bytes)
    })?);
    for &(d, i, _) in &files {
        drop_cache(&File::open(name(d, i))?)?;
    }
    let label = format!("tree read {} files", p.tree_files);
    out.push(timed(t, &label, true, || {
        let mut buf = Vec::with_capacity(64 * KIB as usize);
        let mut bytes = 0;
        for &(d, i, size) in &files {
            buf.clear();
            let n = File::open(name(d, i))?.read_to_end(&mut buf)? as u64;
            if n != size {
                bail!("{} holds {n} bytes, not {size}", name(d, i).display());
            }
            bytes += n;
        }
        Ok(bytes)
    })?);
    std::fs::remove_dir_all(&tree)?;
    sync_fs(&base)?;
    // The everyday table.
    if let Some(tar) = tarball {
        let tar = tar.to_string_lossy().into_owned();
        out.push(timed(t, "tar x", false, || {
            shell(&base, "tar", &["-xf", &tar, "--no-same-owner"], &[0])?;
            sync_fs(&base)?;
            Ok(0)
        })?);
        out.push(timed(t, "ls -lR", false, || {
            shell(&base, "ls", &["-lR", "."], &[0])?;
            Ok(0)
        })?);
        out.push(timed(t, "grep -r", false, || {
            // 0: found, 1: not found; both are a complete pass over the tree.
            shell(&base, "grep", &["-r", "-c", "unsafe", "."], &[0, 1])?;
            Ok(0)
        })?);
        let entries: Vec<String> = std::fs::read_dir(&base)?
            .filter_map(Result::ok)
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        std::fs::create_dir(base.join("copy"))?;
        out.push(timed(t, "cp -r", false, || {
            let mut args = vec!["-r"];
            args.extend(entries.iter().map(String::as_str));
            args.push("copy");
            shell(&base, "cp", &args, &[0])?;
            sync_fs(&base)?;
            Ok(0)
        })?);
        out.push(timed(t, "rm -rf", false, || {
            let mut args = vec!["-rf"];
            args.extend(entries.iter().map(String::as_str));
            args.push("copy");
            shell(&base, "rm", &args, &[0])?;
            sync_fs(&base)?;
            Ok(0)
        })?);
    }
    std::fs::remove_dir_all(&base)?;
    Ok(())
}

/// The sanfs mount and its peers, measured one after the other.
pub async fn run_everyday(env: &Env) -> anyhow::Result<Everyday> {
    let p = EverydayParams::of(env);
    let mut fig = Everyday {
        params: Some(p.clone()),
        ..Everyday::default()
    };
    let lun_size = p.lun_size();
    let tmp = tempfile::Builder::new()
        .prefix("sanfs-bench-everyday-")
        .tempdir_in(&env.work)?;
    let tarball = match make_tarball(tmp.path(), p.src_files) {
        Ok((t, desc)) => {
            fig.source_tree = Some(desc);
            Some(t)
        }
        Err(e) => {
            fig.skipped.push(format!("everyday table: {e:#}"));
            None
        }
    };
    let bar = env.bar(3, "everyday");
    bar.set_message("sanfs");
    let cluster = env.cluster("ev", 1, None, lun_size).await?;
    match env.mount(&cluster, "ev") {
        Ok(m) => {
            let t = sanfs_target(&m, &cluster);
            fig.cells.extend(measure(&t, &p, tarball.as_deref()).await?);
            fig.targets.push(t.name);
        }
        Err(why) => fig.skipped.push(format!("sanfs: {why}")),
    }
    drop(cluster);
    bar.inc(1);
    bar.set_message("ext4");
    match Ext4::start(&env.work, "ev", lun_size) {
        Ok(fs) => {
            let t = fs.target();
            fig.cells.extend(measure(&t, &p, tarball.as_deref()).await?);
            fig.targets.push(t.name);
        }
        Err(e) => fig.skipped.push(format!("ext4: {e:#}")),
    }
    bar.inc(1);
    bar.set_message("moosefs");
    match MooseFs::start(&env.work, "ev", lun_size) {
        Ok(fs) => {
            let t = fs.target();
            fig.cells.extend(measure(&t, &p, tarball.as_deref()).await?);
            fig.targets.push(t.name);
        }
        Err(e) => fig.skipped.push(format!("moosefs: {e:#}")),
    }
    bar.inc(1);
    bar.finish_and_clear();
    Ok(fig)
}

/// The sanfs mount as a target: the agent's and the server's processes.
pub fn sanfs_target(m: &MountPoint, cluster: &crate::cluster::BenchCluster) -> FsTarget {
    FsTarget {
        name: "sanfs".into(),
        dir: m.path().to_path_buf(),
        pids: m
            .agent_pid()
            .into_iter()
            .chain(cluster.server_pid())
            .collect(),
    }
}

async fn measure(
    t: &FsTarget,
    p: &EverydayParams,
    tarball: Option<&Path>,
) -> anyhow::Result<Vec<EverydayCell>> {
    let (t, p, tarball) = (t.clone(), p.clone(), tarball.map(Path::to_path_buf));
    tokio::task::spawn_blocking(move || {
        let mut out = Vec::new();
        on_target(&t, &p, tarball.as_deref(), &mut out).map(|()| out)
    })
    .await
    .context("everyday thread")?
}

/// `a / b` with three significant digits for small ratios (sanfs can be 100x off a peer).
pub fn ratio(a: f64, b: f64) -> String {
    if b.is_nan() || b <= 0.0 {
        return "-".into();
    }
    let r = a / b;
    if r >= 0.1 {
        format!("{r:.2}")
    } else if r >= 0.01 {
        format!("{r:.3}")
    } else {
        format!("{r:.4}")
    }
}

impl std::fmt::Display for Everyday {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "Everyday I/O through the mount (MB/s with CPU s/GiB; the table rows in seconds); \
             ratios sanfs/peer: MB/s (higher is better for sanfs) or seconds (lower is better)"
        )?;
        if let Some(p) = &self.params {
            writeln!(
                f,
                "files of {} (rows stop after {:.0} s), tree of {} files (1-64K) in {} directories",
                size_label(p.file_len),
                p.row_secs,
                p.tree_files,
                p.tree_dirs
            )?;
        }
        if let Some(s) = &self.source_tree {
            writeln!(f, "source tree: {s}")?;
        }
        write!(f, "{:<24}", "test")?;
        for t in &self.targets {
            write!(f, " {:>20}", t)?;
        }
        for t in self.targets.iter().skip(1) {
            write!(f, " {:>10}", format!("sanfs/{t}"))?;
        }
        writeln!(f)?;
        for test in self.tests() {
            write!(f, "{test:<24}")?;
            for t in &self.targets {
                let cell = match self.get(&test, t) {
                    Some(c) => match (c.mb_s, c.cpu_s_per_gib) {
                        (Some(mb), Some(cpu)) => format!("{mb:.1} ({cpu:.1} s/G)"),
                        (Some(mb), None) => format!("{mb:.1}"),
                        _ => format!("{:.2} s", c.secs),
                    },
                    None => "-".into(),
                };
                write!(f, " {cell:>20}")?;
            }
            let sanfs = self.get(&test, "sanfs");
            for t in self.targets.iter().skip(1) {
                let r = match (sanfs, self.get(&test, t)) {
                    (Some(a), Some(b)) => match (a.mb_s, b.mb_s) {
                        (Some(x), Some(y)) => ratio(x, y),
                        _ => ratio(a.secs, b.secs),
                    },
                    _ => "-".into(),
                };
                write!(f, " {r:>10}")?;
            }
            writeln!(f)?;
        }
        for s in &self.skipped {
            writeln!(f, "skipped: {s}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tree_sizes_are_fixed_and_in_range() {
        let p = EverydayParams {
            file_len: MIB,
            row_secs: 1.0,
            seq_sizes: vec![],
            tree_files: 1000,
            tree_dirs: 10,
            src_files: 0,
        };
        let a = tree_files(&p);
        assert_eq!(a, tree_files(&p));
        assert!(
            a.iter()
                .all(|&(d, _, s)| d < 10 && (KIB..=64 * KIB).contains(&s))
        );
        // Spread over the range, not bunched at one end.
        let mean = a.iter().map(|x| x.2).sum::<u64>() / a.len() as u64;
        assert!((24 * KIB..40 * KIB).contains(&mean), "{mean}");
    }

    #[test]
    fn ratios_and_missing_cells_print() {
        let cell = |test: &str, target: &str, mb_s, secs| EverydayCell {
            test: test.into(),
            target: target.into(),
            bytes: 1,
            secs,
            mb_s,
            cpu_s: 0.0,
            cpu_s_per_gib: mb_s.map(|_| 2.0),
        };
        let fig = Everyday {
            targets: vec!["sanfs".into(), "ext4".into()],
            cells: vec![
                cell("seq write 4K", "sanfs", Some(50.0), 1.0),
                cell("seq write 4K", "ext4", Some(200.0), 1.0),
                cell("tar x", "sanfs", None, 3.0),
                cell("tar x", "ext4", None, 1.5),
                cell("ls -lR", "sanfs", None, 1.0),
            ],
            ..Everyday::default()
        };
        let s = fig.to_string();
        assert!(s.contains("50.0 (2.0 s/G)"), "{s}");
        let line = |t: &str| s.lines().find(|l| l.starts_with(t)).unwrap().to_owned();
        assert!(line("seq write 4K").ends_with("0.25"), "{s}");
        assert_eq!(ratio(1.0, 300.0), "0.0033");
        assert_eq!(ratio(1.0, 0.0), "-");
        assert!(line("tar x").ends_with("2.00"), "{s}");
        assert!(line("ls -lR").ends_with('-'), "{s}");
    }
}
