//! `mount.sanfs`, the helper mount(8) runs for `mount -t sanfs SPEC DIR -o OPTS` and for fstab
//! lines of type `sanfs` (`sanfs-agent` started under that name: an installed symlink), and
//! the daemonising start of an agent that it, a plain `sanfs-agent mount` and `quickstart`
//! share ([`spawn_agent`]).
//!
//! mount(8) calls `/sbin/mount.sanfs SPEC DIR [-sfnv] [-o OPTS]`: `-s` sloppy (unknown options
//! are reported and skipped), `-f` fake (check everything, mount nothing), `-n` no mtab (there
//! is none to write), `-v` verbose. Exit status as mount(8) documents for helpers: 0 mounted,
//! 1 bad invocation or options, 32 the mount failed. `-o remount` changes only what a live
//! mount can change: its read-only flag (`remount,ro` / `remount,rw`); any other option is
//! refused with a clear message, the mount left as it was.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

use crate::control;
use crate::logging;
use crate::mount_options::{self, LogTarget};

/// mount(8)'s helper exit status for a bad invocation.
pub const EXIT_USAGE: u8 = 1;
/// mount(8)'s helper exit status for a failed mount.
pub const EXIT_MOUNT_FAILED: u8 = 32;
/// The name under which `sanfs-agent` acts as the mount helper.
pub const HELPER_NAME: &str = "mount.sanfs";
/// Its second name: mount(8) looks for `mount.fuse.sanfs` for a live mount of type
/// `fuse.sanfs` (`mount -o remount,ro DIR` without `-t`), before fuse3's `mount.fuse`.
pub const FUSE_HELPER_NAME: &str = "mount.fuse.sanfs";

/// Whether `argv0` names the mount helper.
pub fn is_helper_name(argv0: &str) -> bool {
    std::path::Path::new(argv0)
        .file_name()
        .is_some_and(|n| n == HELPER_NAME || n == FUSE_HELPER_NAME)
}

/// The arguments mount(8) gives a helper.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct HelperArgs {
    pub source: String,
    pub dir: PathBuf,
    pub options: Vec<String>,
    pub sloppy: bool,
    pub fake: bool,
    pub no_mtab: bool,
    pub verbose: bool,
}

/// Parses `SPEC DIR [-sfnvrw] [-o OPTS] [-t TYPE]` (flags may come anywhere and be combined).
pub fn parse_helper_args(args: &[String]) -> anyhow::Result<HelperArgs> {
    let mut h = HelperArgs::default();
    let mut positional = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        if let Some(flags) = a.strip_prefix('-').filter(|f| !f.is_empty()) {
            let mut chars = flags.chars();
            while let Some(c) = chars.next() {
                match c {
                    's' => h.sloppy = true,
                    'f' => h.fake = true,
                    'n' => h.no_mtab = true,
                    'v' => h.verbose = true,
                    'r' => h.options.push("ro".to_owned()),
                    'w' => h.options.push("rw".to_owned()),
                    'o' | 't' | 'N' => {
                        let rest: String = chars.by_ref().collect();
                        let value = if rest.is_empty() {
                            it.next()
                                .with_context(|| format!("-{c} needs a value"))?
                                .clone()
                        } else {
                            rest
                        };
                        match c {
                            'o' => h.options.push(value),
                            't' => {
                                if value != "sanfs" && value != crate::fuse::MOUNT_FSTYPE {
                                    bail!("mount.sanfs mounts type sanfs, not {value:?}");
                                }
                            }
                            _ => bail!("-N (another mount namespace) is not supported"),
                        }
                    }
                    _ => bail!("unknown flag -{c} (mount.sanfs SPEC DIR [-sfnv] [-o OPTIONS])"),
                }
            }
        } else {
            positional.push(a.clone());
        }
    }
    match <[String; 2]>::try_from(positional) {
        Ok([source, dir]) => {
            h.source = source;
            h.dir = PathBuf::from(dir);
        }
        Err(p) => bail!(
            "expected SPEC and DIR, got {} argument(s) (mount.sanfs SERVER[,SERVER...]:PORT[:/SUBDIR] DIR [-sfnv] [-o OPTIONS])",
            p.len()
        ),
    }
    Ok(h)
}

/// Runs the helper; returns the exit status, having said what went wrong on stderr.
pub fn helper_main(args: &[String]) -> u8 {
    let mut h = match parse_helper_args(args) {
        Ok(h) => h,
        Err(e) => {
            eprintln!("{HELPER_NAME}: {e:#}");
            return EXIT_USAGE;
        }
    };
    // mount(8) passes a live mount's kernel options back with `-o remount`.
    h.options = mount_options::without_kernel_options(&h.options);
    let (opts, ignored) = match mount_options::parse_options_sloppy(&h.options, h.sloppy) {
        Ok(v) => v,
        Err(e) => {
            eprintln!("{HELPER_NAME}: {e:#}");
            return EXIT_USAGE;
        }
    };
    for i in &ignored {
        eprintln!("{HELPER_NAME}: ignoring unknown option {i:?} (sloppy)");
    }
    if let Err(e) = mount_options::parse_source(&h.source) {
        eprintln!("{HELPER_NAME}: {e:#}");
        return EXIT_USAGE;
    }
    if opts.remount {
        return match remount(&h, opts.read_only) {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("{HELPER_NAME}: {e:#}");
                EXIT_MOUNT_FAILED
            }
        };
    }
    let dir = match std::fs::canonicalize(&h.dir) {
        Ok(d) if d.is_dir() => d,
        Ok(d) => {
            eprintln!(
                "{HELPER_NAME}: mount point {} is not a directory",
                d.display()
            );
            return EXIT_MOUNT_FAILED;
        }
        Err(e) => {
            eprintln!("{HELPER_NAME}: mount point {}: {e}", h.dir.display());
            return EXIT_MOUNT_FAILED;
        }
    };
    // The agent parses strictly: what sloppy skipped does not reach it.
    let agent_options: Vec<String> = h
        .options
        .iter()
        .flat_map(|o| o.split(','))
        .filter(|i| !i.is_empty() && !ignored.iter().any(|x| x == i))
        .map(str::to_owned)
        .collect();
    let log = opts
        .log
        .clone()
        .unwrap_or_else(|| logging::default_daemon_target(&dir));
    if h.fake {
        if h.verbose {
            println!(
                "{HELPER_NAME}: would mount {} at {} (options {:?}, log {})",
                h.source,
                dir.display(),
                agent_options.join(","),
                describe_log(&log)
            );
        }
        return 0;
    }
    let exe = match std::env::current_exe() {
        Ok(e) => e,
        Err(e) => {
            eprintln!("{HELPER_NAME}: find the sanfs-agent executable: {e}");
            return EXIT_MOUNT_FAILED;
        }
    };
    match spawn_agent(&exe, &h.source, &dir, &agent_options, &log) {
        Ok(pid) => {
            if h.verbose {
                println!(
                    "{HELPER_NAME}: {} mounted at {} (agent pid {pid}, log {})",
                    h.source,
                    dir.display(),
                    describe_log(&log)
                );
            }
            0
        }
        Err(e) => {
            eprintln!("{HELPER_NAME}: {e:#}");
            EXIT_MOUNT_FAILED
        }
    }
}

/// Where the log goes, for a person.
pub fn describe_log(log: &LogTarget) -> String {
    match log {
        LogTarget::Stderr => "stderr".to_owned(),
        LogTarget::File(p) => p.display().to_string(),
        LogTarget::Syslog => "syslog (journalctl -t sanfs-agent)".to_owned(),
    }
}

/// `-o remount[,ro|rw]`: sets the mount point's read-only flag (keeping its other flags);
/// refuses any option that needs a new agent.
fn remount(h: &HelperArgs, read_only: bool) -> anyhow::Result<()> {
    let fixed = mount_options::remount_unchangeable(&h.options);
    if !fixed.is_empty() {
        bail!(
            "remount can change only ro/rw; these options are fixed while mounted: {} (umount {} and mount again with the new options)",
            fixed.join(","),
            h.dir.display()
        );
    }
    let dir = std::fs::canonicalize(&h.dir)
        .with_context(|| format!("mount point {}", h.dir.display()))?;
    if !control::fuse_mounts()?.iter().any(|m| m.mount_point == dir) {
        bail!("{} is not a sanfs mount: nothing to remount", dir.display());
    }
    if h.fake {
        return Ok(());
    }
    use rustix::fs::StatVfsMountFlags as V;
    use rustix::mount::MountFlags as M;
    let now = rustix::fs::statvfs(&dir)
        .with_context(|| format!("statvfs {}", dir.display()))?
        .f_flag;
    let mut flags = M::BIND;
    for (v, m) in [
        (V::NOSUID, M::NOSUID),
        (V::NODEV, M::NODEV),
        (V::NOEXEC, M::NOEXEC),
        (V::NOATIME, M::NOATIME),
        (V::NODIRATIME, M::NODIRATIME),
        (V::RELATIME, M::RELATIME),
    ] {
        if now.contains(v) {
            flags |= m;
        }
    }
    if read_only {
        flags |= M::RDONLY;
    }
    rustix::mount::mount_remount(&dir, flags, "").with_context(|| {
        format!(
            "remount {} {}",
            dir.display(),
            if read_only { "ro" } else { "rw" }
        )
    })?;
    Ok(())
}

/// Mount ids of every mount at `dir` (any type), from mountinfo.
fn mount_ids_at(dir: &Path) -> anyhow::Result<Vec<u64>> {
    let mounts = crate::mountinfo::read()
        .with_context(|| format!("read {}", crate::mountinfo::MOUNTINFO))?;
    Ok(mounts
        .into_iter()
        .filter(|m| m.mount_point == dir)
        .map(|m| m.id)
        .collect())
}

/// Starts `exe mount SOURCE DIR --foreground -o OPTIONS,log=LOG` as a daemon (own process
/// group and session-less stdio, stderr to the log file when logging to a file) and waits
/// until its mount appears at `dir` (a canonical path). Returns the agent's pid. Refuses a
/// `dir` that already has a sanfs mount.
pub fn spawn_agent(
    exe: &Path,
    source: &str,
    dir: &Path,
    options: &[String],
    log: &LogTarget,
) -> anyhow::Result<u32> {
    use std::os::unix::process::CommandExt;
    use std::process::Stdio;
    if control::fuse_mounts()?.iter().any(|m| m.mount_point == dir) {
        bail!(
            "{} is already mounted (a FUSE mount is there)",
            dir.display()
        );
    }
    let before = mount_ids_at(dir)?;
    let mut opts: Vec<String> = options
        .iter()
        .flat_map(|o| o.split(','))
        .filter(|i| !i.is_empty() && !i.starts_with("log="))
        .map(str::to_owned)
        .collect();
    let (stderr, log_start) = match log {
        LogTarget::Stderr => {
            opts.push("log=stderr".to_owned());
            (Stdio::inherit(), None)
        }
        LogTarget::File(p) => {
            opts.push(format!("log={}", p.display()));
            let f = logging::open_log_file(p)?;
            let start = f.metadata().map(|m| m.len()).unwrap_or(0);
            (Stdio::from(f), Some((p.clone(), start)))
        }
        LogTarget::Syslog => {
            opts.push("log=syslog".to_owned());
            (Stdio::null(), None)
        }
    };
    let mut cmd = std::process::Command::new(exe);
    cmd.arg("mount")
        .arg(source)
        .arg(dir)
        .arg("--foreground")
        .arg("-o")
        .arg(opts.join(","))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(stderr)
        .process_group(0);
    let mut child = cmd
        .spawn()
        .with_context(|| format!("start the agent {}", exe.display()))?;
    let pid = child.id();
    let deadline = Instant::now() + Duration::from_secs(60);
    let tail = || match &log_start {
        Some((p, start)) => format!(
            "; its log {}:\n{}",
            p.display(),
            log_tail(p, *start).unwrap_or_default()
        ),
        None => format!("; its log: {}", describe_log(log)),
    };
    loop {
        if mount_ids_at(dir)?.iter().any(|id| !before.contains(id)) {
            tracing::debug!(pid, "agent running");
            return Ok(pid);
        }
        if let Some(status) = child.try_wait()? {
            bail!("the agent exited before mounting ({status}){}", tail());
        }
        if Instant::now() >= deadline {
            bail!(
                "the mount did not appear within 60 s (agent pid {pid} left running){}",
                tail()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The last lines (at most 20) a log file got since byte `start`.
fn log_tail(path: &Path, start: u64) -> anyhow::Result<String> {
    let bytes = std::fs::read(path)?;
    let new = bytes.get(start as usize..).unwrap_or_default();
    let text = String::from_utf8_lossy(new);
    let lines: Vec<&str> = text.lines().collect();
    Ok(lines[lines.len().saturating_sub(20)..].join("\n"))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]

    use super::*;

    fn args(a: &[&str]) -> Vec<String> {
        a.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn helper_args_as_mount_passes_them() {
        let h = parse_helper_args(&args(&[
            "mds:7410:/a",
            "/mnt/x",
            "-s",
            "-f",
            "-n",
            "-v",
            "-o",
            "rw,threshold=64k",
        ]))
        .unwrap();
        assert_eq!(h.source, "mds:7410:/a");
        assert_eq!(h.dir, Path::new("/mnt/x"));
        assert!(h.sloppy && h.fake && h.no_mtab && h.verbose);
        assert_eq!(h.options, ["rw,threshold=64k"]);
        let h = parse_helper_args(&args(&["-snv", "-oro", "s:1", "/m", "-t", "sanfs"])).unwrap();
        assert!(h.sloppy && h.no_mtab && h.verbose && !h.fake);
        assert_eq!(h.options, ["ro"]);
        assert_eq!(h.source, "s:1");
        assert!(parse_helper_args(&args(&["s:1"])).is_err());
        assert!(parse_helper_args(&args(&["s:1", "/m", "/n"])).is_err());
        assert!(parse_helper_args(&args(&["s:1", "/m", "-o"])).is_err());
        assert!(parse_helper_args(&args(&["s:1", "/m", "-x"])).is_err());
        assert!(parse_helper_args(&args(&["s:1", "/m", "-t", "nfs"])).is_err());
    }

    #[test]
    fn helper_refuses_bad_options_with_usage_status() {
        assert_eq!(
            helper_main(&args(&["s:1", "/nonexistent", "-o", "threshold=big"])),
            EXIT_USAGE
        );
        assert_eq!(
            helper_main(&args(&["s:1", "/nonexistent", "-o", "bogus"])),
            EXIT_USAGE
        );
        assert_eq!(helper_main(&args(&["nocolon", "/nonexistent"])), EXIT_USAGE);
        // Sloppy skips the unknown option; the missing mount point then fails the mount.
        assert_eq!(
            helper_main(&args(&["s:1", "/nonexistent/x", "-s", "-o", "bogus"])),
            EXIT_MOUNT_FAILED
        );
    }
}
