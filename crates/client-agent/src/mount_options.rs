//! The mount source (`SERVER:PORT[:/SUBDIR]`, several servers `SERVER,SERVER:PORT[:/SUBDIR]`,
//! or `unix:/SOCKET[:/SUBDIR]`) and the `-o` options of a sanfs mount, parsed
//! once for every way a mount is asked for: `sanfs-agent mount`, `mount -t sanfs` (the
//! `mount.sanfs` helper), an fstab line, the systemd units' `agent.env` and `.mount` files
//! (their examples in `deploy/examples` are checked with this parser), and `quickstart`.
//!
//! Unknown options are errors, unless the caller is sloppy (`mount -s`): then they are
//! returned to be reported and skipped. mount(8)'s own generic options (`_netdev`,
//! `defaults`, `noauto`, `x-*`, ...) mean nothing to the agent and are accepted.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, bail};

use crate::engine::EngineKind;

/// Where the agent's log lines go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LogTarget {
    /// Standard error (the default in the foreground).
    Stderr,
    /// Appended to this file (made with its directory when missing).
    File(PathBuf),
    /// The local syslog socket `/dev/log` (journald's when systemd runs), facility daemon.
    Syslog,
}

/// The parsed `-o` options.
#[derive(Debug, Clone)]
pub struct MountOpts {
    pub attr_ttl: Duration,
    pub entry_ttl: Duration,
    pub allow_other: bool,
    /// Mount even when none of the volume's LUNs is found (all I/O through the server).
    pub allow_proxied_only: bool,
    pub read_only: bool,
    pub engine: EngineKind,
    /// LUN discovery globs; empty: the built-in defaults.
    pub devices: Vec<String>,
    pub tls_ca: Option<PathBuf>,
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
    pub tls_domain: Option<String>,
    pub client_name: String,
    pub metrics: Option<std::net::SocketAddr>,
    pub device_retry: Duration,
    /// `rescan=DURATION`: how often the volume is read again and missing LUNs looked for
    /// (0: only when a grant names a LUN this agent does not know).
    pub rescan_interval: Duration,
    /// `threshold=SIZE`: this mount's direct-I/O threshold instead of the server's.
    pub direct_io_threshold: Option<u64>,
    /// `writeback=SIZE` (0: off), `writeback_file=SIZE`, `writeback_age=DURATION`: the
    /// write-back cache of small buffered writes (see [`crate::client::WriteBackConfig`]).
    pub writeback: crate::client::WriteBackConfig,
    /// `dirsync`: every namespace change durable when it returns (a disk sync at the server
    /// per change), instead of answered at once and kept by the agent until durable.
    pub dirsync: bool,
    /// `async_creates=on|off`: creates in a directory this mount made answered at once and
    /// sent behind the answer (docs/posix.md "Durability of namespace changes"). On by
    /// default; the server makes the file with the time the agent answered it at.
    pub async_creates: bool,
    /// `page_cache=on|off`: files opened for reading only, or for plain buffered reading and
    /// writing, use the kernel's page cache
    /// (coherent: docs/posix.md "Caching and coherence").
    pub page_cache: bool,
    /// `log=FILE|syslog|stderr`; `None`: stderr in the foreground, chosen when daemonised.
    pub log: Option<LogTarget>,
    /// `log_level=error|warn|info|debug|trace`; `None`: `RUST_LOG`, else `info`.
    pub log_level: Option<String>,
    /// `remount` was asked for (mount(8) `-o remount`).
    pub remount: bool,
    /// `accept_epoch_regression`: accept a server whose epoch went backwards (after a
    /// deliberate restore of the metadata store from an older copy).
    pub accept_epoch_regression: bool,
    /// `hard` (the default) or `soft[,retrans_timeout=DURATION]`: how long a call waits for an
    /// unreachable or restarting server (see [`crate::client::RetryPolicy`]).
    pub retry: crate::client::RetryPolicy,
    /// `threads=N`: the agent's async worker threads (RPCs, planning, completions); `None`:
    /// [`default_threads`].
    pub threads: Option<usize>,
    /// `write_behind=SIZE`: the most bytes of plain buffered writes answered before their
    /// device I/O (inside a write layout; 0 turns it off).
    pub write_behind: u64,
}

/// The most `threads=` takes.
const MAX_THREADS: usize = 64;

/// The agent's async worker threads when `threads=` is not given: half the CPUs it may run
/// on, 1 to 4. Each request hops from a FUSE thread to a worker and back; on a small machine
/// a second worker mostly wakes up to find nothing to do, and its wake-ups cost more than
/// it takes over (one worker on 2 CPUs: 10-20% less time per metadata call, large I/O as fast
/// or faster; docs/performance.md "Stop 30").
pub fn default_threads() -> usize {
    std::thread::available_parallelism().map_or(2, |n| (n.get() / 2).clamp(1, 4))
}

impl Default for MountOpts {
    fn default() -> MountOpts {
        MountOpts {
            attr_ttl: Duration::ZERO,
            entry_ttl: Duration::ZERO,
            allow_other: false,
            allow_proxied_only: false,
            read_only: false,
            engine: EngineKind::Auto,
            devices: Vec::new(),
            tls_ca: None,
            tls_cert: None,
            tls_key: None,
            tls_domain: None,
            client_name: "sanfs-agent".to_owned(),
            metrics: None,
            device_retry: Duration::from_secs(5),
            rescan_interval: crate::client::DEFAULT_RESCAN_INTERVAL,
            direct_io_threshold: None,
            writeback: crate::client::WriteBackConfig::default(),
            dirsync: false,
            async_creates: true,
            page_cache: true,
            log: None,
            log_level: None,
            remount: false,
            accept_epoch_regression: false,
            retry: crate::client::RetryPolicy::Hard,
            threads: None,
            write_behind: crate::fuse::DEFAULT_WRITE_BEHIND,
        }
    }
}

/// mount(8) and fstab options that mean nothing to the agent.
const GENERIC: &[&str] = &[
    "defaults",
    "auto",
    "noauto",
    "nofail",
    "_netdev",
    "user",
    "nouser",
    "users",
    "owner",
    "group",
    "dev",
    "nodev",
    "suid",
    "nosuid",
    "exec",
    "noexec",
    "atime",
    "noatime",
    "relatime",
    "strictatime",
    "nodiratime",
    "diratime",
    "sync",
    "async",
    "loud",
    "silent",
];

/// Options `-o remount` can change on a live mount: the mount point's read-only flag. Every
/// other agent option is fixed at mount time.
pub const REMOUNT_CHANGEABLE: &[&str] = &["ro", "rw"];

/// The options the kernel shows for a live FUSE mount (/proc/self/mountinfo), which mount(8)
/// hands back to the helper with `-o remount`: they describe the mount as it is.
pub const FUSE_KERNEL_OPTIONS: &[&str] = &[
    "fd",
    "rootmode",
    "user_id",
    "group_id",
    "default_permissions",
    "allow_other",
    "max_read",
    "blksize",
];

/// For `-o remount`: the options without those the kernel reports for the live mount
/// ([`FUSE_KERNEL_OPTIONS`]); other options are left as given. Without `remount`, all.
pub fn without_kernel_options(raw: &[String]) -> Vec<String> {
    let items = || {
        raw.iter()
            .flat_map(|r| r.split(','))
            .filter(|i| !i.is_empty())
    };
    if !items().any(|i| i == "remount") {
        return raw.to_vec();
    }
    let kept: Vec<&str> = items()
        .filter(|i| {
            let key = i.split_once('=').map_or(*i, |(k, _)| k);
            !FUSE_KERNEL_OPTIONS.contains(&key)
        })
        .collect();
    vec![kept.join(",")]
}

/// A duration as every sanfs surface reads it ([`sanfs_proto::units::parse_duration`]):
/// `1s`, `500ms`, `2m`, `1h`, `0`, `2` (seconds).
pub fn parse_duration(s: &str) -> anyhow::Result<Duration> {
    sanfs_proto::units::parse_duration(s).map_err(anyhow::Error::msg)
}

/// A byte size as every sanfs surface reads it ([`sanfs_proto::units::parse_size`]): `65536`,
/// `64k`, `64KiB`, `64KB`, `1M`, `1G` (binary units).
pub fn parse_size(s: &str) -> anyhow::Result<u64> {
    sanfs_proto::units::parse_size(s).map_err(anyhow::Error::msg)
}

/// Parses the comma-separated `-o` strings. With `sloppy`, unknown options are skipped and
/// returned (to be reported); without, the first one is an error.
pub fn parse_options_sloppy(
    raw: &[String],
    sloppy: bool,
) -> anyhow::Result<(MountOpts, Vec<String>)> {
    let mut o = MountOpts::default();
    let mut ignored = Vec::new();
    let mut last_was_devices = false;
    // `soft` and its `retrans_timeout=` may come in any order; the last of hard/soft wins.
    let mut soft: Option<bool> = None;
    let mut soft_timeout: Option<Duration> = None;
    for item in raw
        .iter()
        .flat_map(|r| r.split(','))
        .filter(|i| !i.is_empty())
    {
        let (key, value) = match item.split_once('=') {
            Some((k, v)) => (k, Some(v)),
            None => (item, None),
        };
        // `devices=GLOB,GLOB`: a bare path after it continues the list.
        if value.is_none() && key.contains('/') && last_was_devices {
            o.devices
                .extend(key.split(':').filter(|g| !g.is_empty()).map(str::to_owned));
            continue;
        }
        last_was_devices = false;
        match key {
            "attr_ttl" => o.attr_ttl = duration_option(key, value)?,
            "entry_ttl" => o.entry_ttl = duration_option(key, value)?,
            "allow_other" => o.allow_other = true,
            "allow_proxied_only" => o.allow_proxied_only = true,
            "ro" => o.read_only = true,
            "rw" => o.read_only = false,
            "page_cache" => {
                o.page_cache = match need(key, value)? {
                    "on" => true,
                    "off" => false,
                    v => bail!("page_cache={v}: on or off"),
                }
            }
            "async_creates" => {
                o.async_creates = match need(key, value)? {
                    "on" => true,
                    "off" => false,
                    v => bail!("async_creates={v}: on or off"),
                }
            }
            "remount" => o.remount = true,
            "accept_epoch_regression" => o.accept_epoch_regression = true,
            "engine" => {
                o.engine = match need(key, value)? {
                    "uring" => EngineKind::Uring,
                    "sync" => EngineKind::Sync,
                    "auto" => EngineKind::Auto,
                    v => bail!("engine={v}: uring, sync or auto"),
                }
            }
            "devices" => {
                o.devices.extend(
                    need(key, value)?
                        .split(':')
                        .filter(|g| !g.is_empty())
                        .map(str::to_owned),
                );
                last_was_devices = true;
            }
            "tls_ca" => o.tls_ca = Some(need(key, value)?.into()),
            "tls_cert" => o.tls_cert = Some(need(key, value)?.into()),
            "tls_key" => o.tls_key = Some(need(key, value)?.into()),
            "tls_domain" => o.tls_domain = Some(need(key, value)?.to_owned()),
            "client_name" => o.client_name = need(key, value)?.to_owned(),
            "metrics" => {
                let v = need(key, value)?;
                o.metrics = Some(
                    v.parse()
                        .with_context(|| format!("metrics={v}: not ADDRESS:PORT"))?,
                );
            }
            "device_retry" => o.device_retry = duration_option(key, value)?,
            "rescan" => o.rescan_interval = duration_option(key, value)?,
            "hard" => soft = Some(false),
            "soft" => soft = Some(true),
            "retrans_timeout" => soft_timeout = Some(duration_option(key, value)?),
            "writeback" => {
                let v = need(key, value)?;
                o.writeback.total_bytes = parse_size(v)
                    .with_context(|| format!("writeback={v}: bad size (0 turns it off)"))?;
            }
            "writeback_file" => {
                let v = need(key, value)?;
                o.writeback.file_bytes = parse_size(v)
                    .ok()
                    .filter(|n| *n > 0)
                    .with_context(|| format!("writeback_file={v}: bad size (more than 0)"))?;
            }
            "writeback_age" => o.writeback.max_age = duration_option(key, value)?,
            "dirsync" => o.dirsync = true,
            "read_cache" => {
                let v = need(key, value)?;
                o.writeback.read_cache_bytes = parse_size(v)
                    .with_context(|| format!("read_cache={v}: bad size (0 turns it off)"))?;
            }
            "write_behind" => {
                let v = need(key, value)?;
                o.write_behind = parse_size(v)
                    .with_context(|| format!("write_behind={v}: bad size (0 turns it off)"))?;
            }
            "threads" => {
                let v = need(key, value)?;
                o.threads = Some(
                    v.parse::<usize>()
                        .ok()
                        .filter(|n| (1..=MAX_THREADS).contains(n))
                        .with_context(|| {
                            format!("threads={v}: a number of threads, 1 to {MAX_THREADS}")
                        })?,
                );
            }
            "threshold" => {
                let v = need(key, value)?;
                o.direct_io_threshold = Some(
                    parse_size(v)
                        .with_context(|| format!("threshold={v}: bad direct-I/O threshold"))?,
                );
            }
            "log" => {
                o.log = Some(match need(key, value)? {
                    "stderr" => LogTarget::Stderr,
                    "syslog" | "journal" => LogTarget::Syslog,
                    p if Path::new(p).is_absolute() => LogTarget::File(p.into()),
                    p => bail!("log={p}: an absolute file path, syslog or stderr"),
                })
            }
            "log_level" => {
                let v = need(key, value)?;
                if !["error", "warn", "info", "debug", "trace"].contains(&v) {
                    bail!("log_level={v}: error, warn, info, debug or trace");
                }
                o.log_level = Some(v.to_owned());
            }
            k if GENERIC.contains(&k) => {}
            k if k.starts_with("x-") || k == "comment" => {}
            _ if sloppy => ignored.push(item.to_owned()),
            k => bail!("unknown mount option {k:?}"),
        }
    }
    match (soft, soft_timeout) {
        (Some(true), t) => {
            let t = t.unwrap_or(crate::client::DEFAULT_SOFT_TIMEOUT);
            if t.is_zero() {
                bail!("retrans_timeout=0: a soft mount needs a timeout above zero");
            }
            o.retry = crate::client::RetryPolicy::Soft(t);
        }
        (_, Some(_)) => bail!("retrans_timeout= goes with soft (a hard mount waits forever)"),
        _ => {}
    }
    Ok((o, ignored))
}

/// Parses the comma-separated `-o` strings; an unknown option is an error.
pub fn parse_options(raw: &[String]) -> anyhow::Result<MountOpts> {
    parse_options_sloppy(raw, false).map(|(o, _)| o)
}

fn duration_option(key: &str, value: Option<&str>) -> anyhow::Result<Duration> {
    let v = need(key, value)?;
    parse_duration(v).with_context(|| format!("{key}={v}"))
}

fn need<'a>(key: &str, value: Option<&'a str>) -> anyhow::Result<&'a str> {
    value
        .filter(|v| !v.is_empty())
        .with_context(|| format!("option {key} needs a value"))
}

/// `host:port[:/subdir]`, several servers (`mds1,mds2:7410[:/subdir]`: an entry without a
/// port takes the next one's; `a:7410,b:7411`; see [`crate::client::parse_servers`]), or
/// `unix:/socket/path[:/subdir]` split into the server address in the one string form
/// `ClientConfig::server` takes (`host:port`, `a:7410,b:7410` or `unix:/socket/path`) and the
/// sub-directory (`/` if none). A unix socket path may contain neither `:` nor `,` (a unix
/// socket is a single server, never part of a list).
pub fn parse_source(source: &str) -> anyhow::Result<(String, String)> {
    const UNIX_IN_LIST: &str = "a unix: socket is a single server, never part of a list";
    if let Some(rest) = source.strip_prefix("unix:") {
        let (path, subdir) = match rest.split_once(':') {
            Some((p, d)) => (p, d),
            None => (rest, "/"),
        };
        if path.contains(',') {
            bail!("source {source:?}: {UNIX_IN_LIST}");
        }
        if !path.starts_with('/') || path.len() < 2 || !subdir.starts_with('/') {
            bail!("source {source:?} is not unix:/SOCKET/PATH[:/SUBDIR]");
        }
        return Ok((format!("unix:{path}"), subdir.to_owned()));
    }
    if source.contains(",unix:") {
        bail!("source {source:?}: {UNIX_IN_LIST}");
    }
    let (server, subdir) = match source.find(":/") {
        Some(i) => (&source[..i], &source[i + 1..]),
        None => (source, "/"),
    };
    let servers = crate::client::parse_servers(server).map_err(|why| {
        anyhow::anyhow!(
            "source {source:?} is not SERVER:PORT[:/SUBDIR], SERVER,SERVER:PORT[:/SUBDIR] or \
             unix:/SOCKET[:/SUBDIR]: {why}"
        )
    })?;
    Ok((crate::client::join_servers(&servers), subdir.to_owned()))
}

/// The options of a remount that the agent cannot change live, if any.
pub fn remount_unchangeable(raw: &[String]) -> Vec<String> {
    raw.iter()
        .flat_map(|r| r.split(','))
        .filter(|i| !i.is_empty())
        .filter(|i| {
            let key = i.split_once('=').map_or(*i, |(k, _)| k);
            key != "remount"
                && !REMOUNT_CHANGEABLE.contains(&key)
                && !GENERIC.contains(&key)
                && !key.starts_with("x-")
                && key != "comment"
        })
        .map(str::to_owned)
        .collect()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]

    use super::*;

    fn s(v: &str) -> Vec<String> {
        vec![v.to_owned()]
    }

    #[test]
    fn a_remount_drops_the_options_the_kernel_reports_for_the_live_mount() {
        // What mount(8) passes for `mount -o remount,ro DIR` of a live mount.
        let raw = s(
            "rw,nosuid,nodev,relatime,user_id=0,group_id=0,default_permissions,allow_other,remount,ro",
        );
        assert_eq!(
            without_kernel_options(&raw),
            s("rw,nosuid,nodev,relatime,remount,ro")
        );
        assert!(remount_unchangeable(&without_kernel_options(&raw)).is_empty());
        // Not a remount: nothing dropped (allow_other is a mount option of ours).
        assert_eq!(
            without_kernel_options(&s("allow_other,ro")),
            s("allow_other,ro")
        );
        // A remount that tries to change something else is still refused.
        assert_eq!(
            remount_unchangeable(&without_kernel_options(&s("remount,attr_ttl=0,user_id=0"))),
            vec!["attr_ttl=0".to_owned()]
        );
    }

    #[test]
    fn options_parse() {
        let o = parse_options(&[
            "attr_ttl=2s,entry_ttl=250ms,allow_other".to_owned(),
            "ro,engine=sync,devices=/dev/loop*,/srv/luns/*:/x/y,_netdev,x-systemd.automount"
                .to_owned(),
        ])
        .unwrap();
        assert_eq!(o.attr_ttl, Duration::from_secs(2));
        assert_eq!(o.entry_ttl, Duration::from_millis(250));
        assert!(o.allow_other && o.read_only);
        assert!(
            !o.dirsync,
            "namespace changes are answered before durable by default"
        );
        assert!(parse_options(&s("dirsync")).unwrap().dirsync);
        assert!(o.async_creates);
        assert!(
            !parse_options(&s("async_creates=off"))
                .unwrap()
                .async_creates
        );
        assert!(
            !parse_options(&s("async_creates=off"))
                .unwrap()
                .async_creates
        );
        assert!(parse_options(&s("async_creates=maybe")).is_err());
        assert_eq!(o.engine, EngineKind::Sync);
        assert_eq!(o.devices, ["/dev/loop*", "/srv/luns/*", "/x/y"]);
        let d = parse_options(&[]).unwrap();
        // Without a lease nothing is cached by default (docs/posix.md "Caching and coherence").
        assert_eq!((d.attr_ttl, d.entry_ttl), (Duration::ZERO, Duration::ZERO));
        assert!(d.devices.is_empty() && !d.read_only && d.direct_io_threshold.is_none());
        assert!(parse_options(&s("bogus")).is_err());
        assert!(parse_options(&s("attr_ttl=fast")).is_err());
        assert!(parse_options(&s("engine=spdk")).is_err());
        assert!(!d.accept_epoch_regression);
        assert!(
            parse_options(&s("ro,accept_epoch_regression"))
                .unwrap()
                .accept_epoch_regression
        );
        let m = parse_options(&s("metrics=10.0.0.2:9420,device_retry=250ms")).unwrap();
        assert_eq!(m.metrics, Some("10.0.0.2:9420".parse().unwrap()));
        assert_eq!(m.device_retry, Duration::from_millis(250));
        assert_eq!(m.rescan_interval, Duration::from_secs(30));
        let m = parse_options(&s("rescan=2s")).unwrap();
        assert_eq!(m.rescan_interval, Duration::from_secs(2));
        assert!(parse_options(&s("rescan=often")).is_err());
        assert!(parse_options(&s("metrics=nowhere")).is_err());
    }

    #[test]
    fn threshold_sizes() {
        let t = |v: &str| {
            parse_options(&s(&format!("threshold={v}"))).map(|o| o.direct_io_threshold.unwrap())
        };
        assert_eq!(t("65536").unwrap(), 65536);
        assert_eq!(t("64k").unwrap(), 65536);
        assert_eq!(t("64K").unwrap(), 65536);
        assert_eq!(t("64KiB").unwrap(), 65536);
        assert_eq!(t("1M").unwrap(), 1 << 20);
        assert_eq!(t("1MiB").unwrap(), 1 << 20);
        assert_eq!(t("2g").unwrap(), 2 << 30);
        assert_eq!(t("0").unwrap(), 0);
        for bad in [
            "",
            "k",
            "64x",
            "1.5",
            "-1",
            "99999999999999999999",
            "16777216T",
        ] {
            let e = t(bad).unwrap_err();
            assert!(format!("{e:#}").contains("threshold"), "{bad}: {e:#}");
        }
    }

    #[test]
    fn write_behind() {
        assert_eq!(
            parse_options(&s("rw")).unwrap().write_behind,
            crate::fuse::DEFAULT_WRITE_BEHIND
        );
        assert_eq!(
            parse_options(&s("write_behind=64M")).unwrap().write_behind,
            64 << 20
        );
        assert_eq!(parse_options(&s("write_behind=0")).unwrap().write_behind, 0);
        for bad in ["write_behind=lots", "write_behind"] {
            let e = parse_options(&s(bad)).unwrap_err();
            assert!(format!("{e:#}").contains("write_behind"), "{bad}: {e:#}");
        }
    }

    #[test]
    fn threads() {
        assert_eq!(parse_options(&s("rw")).unwrap().threads, None);
        assert_eq!(parse_options(&s("threads=3")).unwrap().threads, Some(3));
        for bad in ["threads=0", "threads=65", "threads=two", "threads"] {
            let e = parse_options(&s(bad)).unwrap_err();
            assert!(format!("{e:#}").contains("threads"), "{bad}: {e:#}");
        }
        assert!((1..=4).contains(&default_threads()));
    }

    #[test]
    fn log_options() {
        let o = parse_options(&s("log=/var/log/sanfs/a.log,log_level=debug")).unwrap();
        assert_eq!(o.log, Some(LogTarget::File("/var/log/sanfs/a.log".into())));
        assert_eq!(o.log_level.as_deref(), Some("debug"));
        assert_eq!(
            parse_options(&s("log=syslog")).unwrap().log,
            Some(LogTarget::Syslog)
        );
        assert!(parse_options(&s("log=relative.log")).is_err());
        assert!(parse_options(&s("log_level=loud")).is_err());
    }

    #[test]
    fn sloppy_skips_unknown_options_and_says_which() {
        let (o, ignored) =
            parse_options_sloppy(&s("ro,vers=4,attr_ttl=2s,nolock,_netdev"), true).unwrap();
        assert!(o.read_only);
        assert_eq!(o.attr_ttl, Duration::from_secs(2));
        assert_eq!(ignored, ["vers=4", "nolock"]);
        // Sloppy does not excuse a known option's bad value.
        assert!(parse_options_sloppy(&s("threshold=big"), true).is_err());
    }

    #[test]
    fn hard_and_soft() {
        use crate::client::{DEFAULT_SOFT_TIMEOUT, RetryPolicy};
        assert_eq!(parse_options(&[]).unwrap().retry, RetryPolicy::Hard);
        assert_eq!(parse_options(&s("hard")).unwrap().retry, RetryPolicy::Hard);
        assert_eq!(
            parse_options(&s("soft")).unwrap().retry,
            RetryPolicy::Soft(DEFAULT_SOFT_TIMEOUT)
        );
        assert_eq!(
            parse_options(&s("retrans_timeout=30s,soft")).unwrap().retry,
            RetryPolicy::Soft(Duration::from_secs(30))
        );
        // The last of hard and soft wins.
        assert_eq!(
            parse_options(&s("soft,hard")).unwrap().retry,
            RetryPolicy::Hard
        );
        assert!(parse_options(&s("hard,retrans_timeout=1s")).is_err());
        assert!(parse_options(&s("retrans_timeout=1s")).is_err());
        assert!(parse_options(&s("soft,retrans_timeout=0")).is_err());
        assert!(parse_options(&s("soft,retrans_timeout=soon")).is_err());
    }

    #[test]
    fn remount_subset() {
        assert!(remount_unchangeable(&s("remount,ro,_netdev")).is_empty());
        assert_eq!(
            remount_unchangeable(&s("remount,attr_ttl=0,rw")),
            ["attr_ttl=0"]
        );
    }

    #[test]
    fn source_parse() {
        let s = |x: &str| parse_source(x).unwrap();
        assert_eq!(s("mds:7000"), ("mds:7000".to_owned(), "/".to_owned()));
        assert_eq!(
            s("10.0.0.1:7000:/a/b"),
            ("10.0.0.1:7000".to_owned(), "/a/b".to_owned())
        );
        assert!(parse_source("mds").is_err());
        assert!(parse_source("mds:port:/x").is_err());
        assert_eq!(
            s("unix:/run/sanfs/mds.sock"),
            ("unix:/run/sanfs/mds.sock".to_owned(), "/".to_owned())
        );
        assert_eq!(
            s("unix:/run/sanfs/mds.sock:/tenant-a"),
            (
                "unix:/run/sanfs/mds.sock".to_owned(),
                "/tenant-a".to_owned()
            )
        );
        assert!(parse_source("unix:relative.sock").is_err());
        // Several servers: one string form, ports filled in from the next entry.
        assert_eq!(
            s("mds1,mds2:7410:/sub"),
            ("mds1:7410,mds2:7410".to_owned(), "/sub".to_owned())
        );
        assert_eq!(
            s("a:7410,b:7411:/sub"),
            ("a:7410,b:7411".to_owned(), "/sub".to_owned())
        );
        assert_eq!(
            s("a:7410,b:7411"),
            ("a:7410,b:7411".to_owned(), "/".to_owned())
        );
        assert_eq!(
            s("[::1]:7410:/x"),
            ("[::1]:7410".to_owned(), "/x".to_owned())
        );
        assert_eq!(
            s("[fd00::1],[fd00::2]:7410:/x"),
            ("[fd00::1]:7410,[fd00::2]:7410".to_owned(), "/x".to_owned())
        );
        for (bad, says) in [
            ("a,,b:7410:/x", "empty entry"),
            ("a:7410,:/x", "empty entry"),
            ("a:7410,b:/x", "has no port"),
            ("a,b:99999:/x", "bad port"),
            ("a:7410,a:7410", "names a:7410 twice"),
            ("a:7410,unix:/run/s.sock", "single server"),
            ("unix:/run/s.sock,a:7410", "single server"),
            ("unix:/run/s.sock,a:7410:/x", "single server"),
        ] {
            let e = format!("{:#}", parse_source(bad).unwrap_err());
            assert!(e.contains(says), "{bad:?}: {e}");
        }
        assert!(parse_source("unix:/").is_err());
        assert!(parse_source("unix:/s.sock:sub").is_err());
    }
}
