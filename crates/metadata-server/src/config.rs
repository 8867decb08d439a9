//! The `mds.toml` configuration file: where the server listens, its TLS material, where the
//! metadata store lives and which LUNs make up the volume.
//!
//! Every section rejects unknown keys (a misspelt key is an error, never silently ignored).
//! Sizes are written either as an integer number of bytes or as a string with a binary suffix
//! (`"64KiB"`, `"4k"`, `"1M"`, `"1GiB"`; every multiplier is a power of 1024). [`MdsConfig::load`]
//! parses and validates; errors name the file. An annotated example lives in
//! `deploy/examples/mds.toml` and is parsed by a test with these structs.

use std::collections::BTreeSet;
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use serde::{Deserialize, Deserializer};

use crate::service::identity::{AccessConfig, ClientPolicy, DEFAULT_MAX_SESSIONS_PER_IDENTITY};

/// The whole `mds.toml`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MdsConfig {
    #[serde(default)]
    pub server: ServerConfig,
    /// Absent: no TLS (only allowed on a loopback address or with `server.insecure`).
    #[serde(default)]
    pub tls: Option<TlsConfig>,
    pub metadata: MetadataConfig,
    pub volume: VolumeConfig,
    /// `[client_defaults]`: what a certificate identity without a `[[clients]]` entry may do.
    #[serde(default)]
    pub client_defaults: ClientConfig,
    /// `[[clients]]`: what each named identity (certificate CN or DNS name, or `unix:uid=N`)
    /// may do.
    #[serde(default)]
    pub clients: Vec<NamedClientConfig>,
    /// `[ha]`: several servers on one metadata LUN, the leader elected by etcd (`crate::ha`).
    #[serde(default)]
    pub ha: Option<HaConfig>,
}

/// `[ha]`: high availability on etcd (docs/operations.md, "High availability").
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HaConfig {
    /// etcd client URLs (`http://host:2379`; `https://` with `[ha.tls]`).
    pub etcd: Vec<String>,
    /// The election's name: one per file system, the same on every candidate.
    #[serde(default = "default_election")]
    pub election: String,
    /// The address agents reach this server at (`host:port`); default `server.listen`.
    #[serde(default)]
    pub advertise: Option<String>,
    /// The etcd lease's TTL in seconds: how long a dead leader holds the election, and how
    /// long a leader cut off from etcd may still write (less a margin).
    #[serde(default = "default_ha_lease_ttl_s")]
    pub lease_ttl_s: u32,
    /// TLS to etcd: its CA, and a client certificate and key if etcd asks for one.
    #[serde(default)]
    pub tls: Option<HaTlsConfig>,
}

/// `[ha.tls]`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HaTlsConfig {
    pub ca: PathBuf,
    #[serde(default)]
    pub cert: Option<PathBuf>,
    #[serde(default)]
    pub key: Option<PathBuf>,
}

fn default_election() -> String {
    "sanfs/mds".to_owned()
}

fn default_ha_lease_ttl_s() -> u32 {
    2
}

/// What one identity may do (docs/security.md).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ClientConfig {
    /// May make admin calls (ServerStatus, SetQuota).
    pub admin: bool,
    /// uid 0 (and gid 0) in this node's requests become `squash_uid`/`squash_gid`.
    pub root_squash: bool,
    pub squash_uid: u32,
    pub squash_gid: u32,
}

impl Default for ClientConfig {
    fn default() -> ClientConfig {
        let p = ClientPolicy::NODE;
        ClientConfig {
            admin: p.admin,
            root_squash: p.root_squash,
            squash_uid: p.squash_uid,
            squash_gid: p.squash_gid,
        }
    }
}

impl ClientConfig {
    fn policy(&self) -> ClientPolicy {
        ClientPolicy {
            admin: self.admin,
            root_squash: self.root_squash,
            squash_uid: self.squash_uid,
            squash_gid: self.squash_gid,
        }
    }
}

/// One `[[clients]]` entry: a name and the keys of [`ClientConfig`] (each defaulting as
/// there).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NamedClientConfig {
    /// The identity's name: a certificate's subject CN (else its first DNS name), or
    /// `unix:uid=N` for a unix socket peer.
    pub name: String,
    #[serde(default)]
    pub admin: bool,
    #[serde(default)]
    pub root_squash: bool,
    #[serde(default = "nobody")]
    pub squash_uid: u32,
    #[serde(default = "nobody")]
    pub squash_gid: u32,
}

fn nobody() -> u32 {
    crate::service::identity::NOBODY
}

impl NamedClientConfig {
    fn policy(&self) -> ClientPolicy {
        ClientPolicy {
            admin: self.admin,
            root_squash: self.root_squash,
            squash_uid: self.squash_uid,
            squash_gid: self.squash_gid,
        }
    }
}

/// `[server]`: the gRPC endpoint and the server's tunables.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    pub listen: SocketAddr,
    /// Also serve on this unix socket (mode 0600) for agents on the server's own host.
    pub listen_unix: Option<PathBuf>,
    /// Local uids besides 0 that may use the unix socket.
    pub unix_uids: Vec<u32>,
    /// Live sessions one identity may hold at once.
    pub max_sessions_per_identity: usize,
    /// Where Prometheus metrics are served; none when absent.
    pub metrics_addr: Option<SocketAddr>,
    /// Accept plaintext TCP without authentication (logged loudly at start).
    pub insecure: bool,
    /// I/O below this many bytes takes the proxied path.
    #[serde(deserialize_with = "deserialize_size")]
    pub direct_threshold: u64,
    pub lease_ttl_ms: u64,
    /// How long a grant may block others (a recall or a conflicting request waiting for it)
    /// before its session is evicted; absent: two lease periods.
    pub grant_hold_limit_ms: Option<u64>,
    /// Group commit: at most this many operations per durable commit.
    pub commit_batch_max: usize,
    /// Small proxied writes are journaled with their commit and settled (the data LUNs
    /// flushed, the journal told) at least this often: what a restart rewrites.
    pub settle_ms: u64,
    /// Async worker threads serving calls; 0: [`ServerConfig::worker_threads`]'s default.
    pub threads: usize,
}

impl ServerConfig {
    /// The async worker threads to start: `threads`, else half the CPUs (at least 1). Every
    /// call wakes a worker; on a small host a second one mostly wakes up to find nothing to
    /// do, and costs more than it takes over (docs/performance.md "Stop 30").
    pub fn worker_threads(&self) -> usize {
        if self.threads > 0 {
            return self.threads;
        }
        std::thread::available_parallelism().map_or(1, |n| (n.get() / 2).max(1))
    }
}

/// The most `server.threads` takes.
pub const MAX_THREADS: usize = 1024;

/// Default gRPC listen address.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:7410";
/// Default direct-I/O threshold: 64 KiB.
pub const DEFAULT_DIRECT_THRESHOLD: u64 = 64 << 10;
/// Default session lease TTL.
pub const DEFAULT_LEASE_TTL_MS: u64 = 10_000;
/// Default interval of the settling of journaled data (`server.settle_ms`).
pub const DEFAULT_SETTLE_MS: u64 = 1000;
/// Default group-commit batch limit.
pub const DEFAULT_COMMIT_BATCH_MAX: usize = 256;
/// Default file system block size.
pub const DEFAULT_BLOCK_SIZE: u32 = 4096;
/// Default stripe unit of a striped volume.
pub const DEFAULT_STRIPE_UNIT: u64 = 64 << 10;

impl Default for ServerConfig {
    fn default() -> ServerConfig {
        ServerConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 7410)),
            listen_unix: None,
            unix_uids: Vec::new(),
            max_sessions_per_identity: DEFAULT_MAX_SESSIONS_PER_IDENTITY,
            metrics_addr: None,
            insecure: false,
            direct_threshold: DEFAULT_DIRECT_THRESHOLD,
            lease_ttl_ms: DEFAULT_LEASE_TTL_MS,
            grant_hold_limit_ms: None,
            commit_batch_max: DEFAULT_COMMIT_BATCH_MAX,
            settle_ms: DEFAULT_SETTLE_MS,
            threads: 0,
        }
    }
}

/// `[tls]`: the server's certificate and key, and the CA that client certificates must chain
/// to (mutual TLS). All three are required when the section is present.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsConfig {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub ca: PathBuf,
}

/// `[metadata]`: where the metadata store lives.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MetadataConfig {
    pub path: PathBuf,
    #[serde(default)]
    pub kind: MetadataKind,
}

/// What `metadata.path` names.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MetadataKind {
    /// A file on a local file system (the default).
    #[default]
    File,
    /// A (small) block device of its own.
    Block,
}

/// `[volume]`: the data LUNs and how blocks are laid over them.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VolumeConfig {
    pub layout: LayoutKindConfig,
    #[serde(default = "default_block_size")]
    pub block_size: u32,
    /// Striped only: bytes per stripe unit, a multiple of `block_size`.
    #[serde(default = "default_stripe_unit", deserialize_with = "deserialize_size")]
    pub stripe_unit: u64,
    /// Where file data starts on sanfs-labelled LUNs (linear and striped).
    #[serde(default = "default_data_offset", deserialize_with = "deserialize_size")]
    pub data_offset: u64,
    /// linear/striped: the LUNs in volume order; lvm: the PVs to read. When serving, a glob
    /// in the last component (`*`, `?`) is expanded (matches taken by label identity);
    /// `format` refuses globs for linear/striped.
    #[serde(default)]
    pub devices: Vec<PathBuf>,
    /// lvm only: the volume group.
    #[serde(default)]
    pub lvm_vg: Option<String>,
    /// lvm only: the logical volume in `lvm_vg`.
    #[serde(default)]
    pub lvm_lv: Option<String>,
}

/// `volume.layout`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LayoutKindConfig {
    Linear,
    Striped,
    Lvm,
}

impl fmt::Display for LayoutKindConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LayoutKindConfig::Linear => "linear",
            LayoutKindConfig::Striped => "striped",
            LayoutKindConfig::Lvm => "lvm",
        })
    }
}

fn default_block_size() -> u32 {
    DEFAULT_BLOCK_SIZE
}

fn default_stripe_unit() -> u64 {
    DEFAULT_STRIPE_UNIT
}

fn default_data_offset() -> u64 {
    sanfs_blockmap::label::DEFAULT_DATA_OFFSET
}

/// Parses a size as every sanfs surface does ([`sanfs_proto::units::parse_size`]: binary
/// units, `64K` = `64KB` = `64KiB` = 65536).
pub fn parse_size(text: &str) -> Result<u64, String> {
    sanfs_proto::units::parse_size(text)
}

fn deserialize_size<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Size {
        Bytes(u64),
        Text(String),
    }
    match Size::deserialize(d).map_err(|_| {
        serde::de::Error::custom("expected a size: a number of bytes or a string such as \"64KiB\"")
    })? {
        Size::Bytes(n) => Ok(n),
        Size::Text(s) => parse_size(&s).map_err(serde::de::Error::custom),
    }
}

impl MdsConfig {
    /// Who may connect and what each identity may do, for `serve`.
    pub fn access(&self) -> AccessConfig {
        AccessConfig {
            unix_uids: self.server.unix_uids.clone(),
            clients: self
                .clients
                .iter()
                .map(|c| (c.name.clone(), c.policy()))
                .collect(),
            client_defaults: self.client_defaults.policy(),
            max_sessions_per_identity: self.server.max_sessions_per_identity,
        }
    }

    /// Reads, parses and validates the config file at `path`.
    pub fn load(path: &Path) -> anyhow::Result<MdsConfig> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("read config file {}", path.display()))?;
        let config = MdsConfig::parse(&text)
            .with_context(|| format!("parse config file {}", path.display()))?;
        config
            .validate()
            .with_context(|| format!("invalid config file {}", path.display()))?;
        Ok(config)
    }

    /// The `[ha]` section as the server's options, if there is one.
    pub fn ha_options(&self) -> Option<crate::ha::HaOptions> {
        let ha = self.ha.as_ref()?;
        Some(crate::ha::HaOptions {
            etcd: ha.etcd.clone(),
            election: ha.election.clone(),
            advertise: ha
                .advertise
                .clone()
                .unwrap_or_else(|| self.server.listen.to_string()),
            lease_ttl_s: i64::from(ha.lease_ttl_s),
            tls: ha.tls.as_ref().map(|t| crate::ha::EtcdTls {
                ca: t.ca.clone(),
                cert: t.cert.clone(),
                key: t.key.clone(),
            }),
        })
    }

    /// Parses TOML text without validating it.
    pub fn parse(text: &str) -> anyhow::Result<MdsConfig> {
        Ok(toml::from_str(text)?)
    }

    /// Checks what the types cannot: ranges, multiples, the fields each layout needs, and that
    /// plaintext is only used where it was asked for.
    pub fn validate(&self) -> anyhow::Result<()> {
        let s = &self.server;
        if self.tls.is_none() && !s.listen.ip().is_loopback() && !s.insecure {
            bail!(
                "server.listen {} is not a loopback address and there is no [tls] section; \
                 add [tls] or set server.insecure = true",
                s.listen
            );
        }
        if s.direct_threshold == 0 {
            bail!("server.direct_threshold must be positive");
        }
        if s.lease_ttl_ms == 0 {
            bail!("server.lease_ttl_ms must be positive");
        }
        if s.grant_hold_limit_ms == Some(0) {
            bail!("server.grant_hold_limit_ms must be positive");
        }
        if s.settle_ms == 0 {
            bail!("server.settle_ms must be positive");
        }
        if s.commit_batch_max == 0 {
            bail!("server.commit_batch_max must be positive");
        }
        if s.threads > MAX_THREADS {
            bail!("server.threads must be at most {MAX_THREADS} (0: half the CPUs)");
        }
        if s.max_sessions_per_identity == 0 {
            bail!("server.max_sessions_per_identity must be positive");
        }
        if s.listen_unix.as_ref().is_some_and(|p| p.is_relative()) {
            bail!("server.listen_unix must be an absolute path");
        }
        if let Some(ha) = &self.ha {
            validate_ha(ha, self.metadata.kind)?;
        }
        let mut names = BTreeSet::new();
        for c in &self.clients {
            if c.name.is_empty() {
                bail!("a [[clients]] entry has an empty name");
            }
            if !names.insert(&c.name) {
                bail!("[[clients]] names {:?} twice", c.name);
            }
        }
        if let Some(tls) = &self.tls {
            for (name, path) in [("cert", &tls.cert), ("key", &tls.key), ("ca", &tls.ca)] {
                if path.as_os_str().is_empty() {
                    bail!("tls.{name} is empty");
                }
            }
        }
        if self.metadata.path.as_os_str().is_empty() {
            bail!("metadata.path is empty");
        }
        self.volume.validate()?;
        if self.volume.devices.contains(&self.metadata.path) {
            bail!(
                "metadata.path {} is also a volume device",
                self.metadata.path.display()
            );
        }
        Ok(())
    }
}

impl VolumeConfig {
    /// The `[volume]` part of [`MdsConfig::validate`].
    pub fn validate(&self) -> anyhow::Result<()> {
        let bs = self.block_size;
        if !bs.is_power_of_two() || !(512..=65536).contains(&bs) {
            bail!("volume.block_size {bs} is not a power of two from 512 to 65536");
        }
        if self.devices.is_empty() {
            bail!("volume.devices is empty");
        }
        let mut seen = BTreeSet::new();
        for dev in &self.devices {
            if dev.as_os_str().is_empty() {
                bail!("volume.devices holds an empty path");
            }
            if !seen.insert(dev) {
                bail!("volume.devices lists {} twice", dev.display());
            }
        }
        match self.layout {
            LayoutKindConfig::Linear | LayoutKindConfig::Striped => {
                if self.lvm_vg.is_some() || self.lvm_lv.is_some() {
                    bail!(
                        "volume.lvm_vg and volume.lvm_lv only apply to layout = \"lvm\", not {:?}",
                        self.layout.to_string()
                    );
                }
                let label = sanfs_blockmap::label::LABEL_SIZE as u64;
                if self.data_offset < label || !self.data_offset.is_multiple_of(u64::from(bs)) {
                    bail!(
                        "volume.data_offset {} must be at least {label} (the label) and a \
                         multiple of volume.block_size {bs}",
                        self.data_offset
                    );
                }
                if self.layout == LayoutKindConfig::Striped
                    && (self.stripe_unit == 0 || !self.stripe_unit.is_multiple_of(u64::from(bs)))
                {
                    bail!(
                        "volume.stripe_unit {} is not a positive multiple of volume.block_size {bs}",
                        self.stripe_unit
                    );
                }
            }
            LayoutKindConfig::Lvm => {
                for (name, value) in [("lvm_vg", &self.lvm_vg), ("lvm_lv", &self.lvm_lv)] {
                    match value {
                        None => bail!("layout = \"lvm\" needs volume.{name}"),
                        Some(v) if v.is_empty() => bail!("volume.{name} is empty"),
                        Some(_) => {}
                    }
                }
            }
        }
        Ok(())
    }
}

/// The paths the server tries for the volume's LUNs at start: `volume.devices` (a glob in
/// the last component expanded, its matches sorted; a glob that matches nothing is logged),
/// then the paths growths were given (the store's grown-devices record), each path once.
/// Which LUN a path is stays the label's word ([`DataDevices::add`]).
pub fn device_paths(configured: &[PathBuf], grown: &[PathBuf]) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = Vec::with_capacity(configured.len() + grown.len());
    for entry in configured {
        if sanfs_lun::glob::is_glob(entry) {
            let matches = sanfs_lun::glob::expand_globs(std::slice::from_ref(entry));
            if matches.is_empty() {
                tracing::warn!(glob = %entry.display(), "volume.devices: the glob matches nothing");
            }
            out.extend(matches);
        } else {
            out.push(entry.clone());
        }
    }
    out.extend(grown.iter().cloned());
    let mut seen = std::collections::HashSet::new();
    out.retain(|p| seen.insert(p.clone()));
    out
}

/// `[ha]`'s rules: etcd URLs, a TTL etcd accepts, and the shared metadata LUN.
fn validate_ha(ha: &HaConfig, kind: MetadataKind) -> anyhow::Result<()> {
    if ha.etcd.is_empty() {
        bail!("ha.etcd needs at least one etcd URL");
    }
    for url in &ha.etcd {
        if !(url.starts_with("http://") || url.starts_with("https://")) {
            bail!("ha.etcd {url:?} is not an http:// or https:// URL");
        }
        if url.starts_with("https://") && ha.tls.is_none() {
            bail!("ha.etcd {url:?} is https: add [ha.tls] with etcd's CA");
        }
    }
    if ha.election.is_empty() || ha.election.ends_with('/') {
        bail!("ha.election must be a non-empty name without a trailing '/'");
    }
    if !(1..=60).contains(&ha.lease_ttl_s) {
        bail!("ha.lease_ttl_s must be 1 to 60 seconds");
    }
    if ha
        .tls
        .as_ref()
        .is_some_and(|t| t.cert.is_some() != t.key.is_some())
    {
        bail!("[ha.tls] cert and key go together");
    }
    if kind != MetadataKind::Block {
        bail!("[ha] needs metadata.kind = \"block\": every candidate opens the same metadata LUN");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `volume.devices` globs are expanded (matches sorted; plain paths kept as given, even
    /// absent ones, for the start to report), the growths' paths follow, each path once.
    #[test]
    fn device_paths_expand_globs_and_add_the_grown_luns() {
        let dir = tempfile::tempdir().unwrap();
        for n in ["wwn-b", "wwn-a", "other"] {
            std::fs::write(dir.path().join(n), b"x").unwrap();
        }
        let p = |n: &str| dir.path().join(n);
        let got = device_paths(
            &[p("wwn-*"), p("absent"), p("none-*"), p("other")],
            &[p("grown0"), p("wwn-a"), p("grown0")],
        );
        assert_eq!(
            got,
            vec![p("wwn-a"), p("wwn-b"), p("absent"), p("other"), p("grown0")]
        );
    }

    const FULL: &str = r#"
        [server]
        listen = "0.0.0.0:7410"
        metrics_addr = "127.0.0.1:9410"
        insecure = false
        direct_threshold = "128KiB"
        lease_ttl_ms = 5000
        grant_hold_limit_ms = 15000
        commit_batch_max = 64
        [tls]
        cert = "/etc/sanfs/server.crt"
        key = "/etc/sanfs/server.key"
        ca = "/etc/sanfs/ca.crt"
        [metadata]
        path = "/dev/sdz"
        kind = "block"
        [volume]
        layout = "striped"
        block_size = 8192
        stripe_unit = "256k"
        data_offset = "2MiB"
        devices = ["/dev/loop0", "/dev/loop1"]
    "#;

    const MINIMAL: &str = r#"
        [metadata]
        path = "/var/lib/sanfs/meta.redb"
        [volume]
        layout = "linear"
        devices = ["/dev/sdb"]
    "#;

    fn with_volume(volume: &str) -> String {
        format!("[metadata]\npath = \"/m\"\n[volume]\n{volume}\n")
    }

    fn invalid(text: &str) -> String {
        let config = MdsConfig::parse(text).unwrap();
        format!("{:#}", config.validate().unwrap_err())
    }

    #[test]
    fn a_full_example_parses() {
        let c = MdsConfig::parse(FULL).unwrap();
        c.validate().unwrap();
        assert_eq!(c.server.listen, "0.0.0.0:7410".parse().unwrap());
        assert_eq!(
            c.server.metrics_addr,
            Some("127.0.0.1:9410".parse().unwrap())
        );
        assert_eq!(c.server.direct_threshold, 128 << 10);
        assert_eq!(c.server.lease_ttl_ms, 5000);
        assert_eq!(c.server.grant_hold_limit_ms, Some(15000));
        assert_eq!(c.server.commit_batch_max, 64);
        assert_eq!(
            c.tls,
            Some(TlsConfig {
                cert: "/etc/sanfs/server.crt".into(),
                key: "/etc/sanfs/server.key".into(),
                ca: "/etc/sanfs/ca.crt".into(),
            })
        );
        assert_eq!(
            c.metadata,
            MetadataConfig {
                path: "/dev/sdz".into(),
                kind: MetadataKind::Block
            }
        );
        assert_eq!(
            c.volume,
            VolumeConfig {
                layout: LayoutKindConfig::Striped,
                block_size: 8192,
                stripe_unit: 256 << 10,
                data_offset: 2 << 20,
                devices: vec!["/dev/loop0".into(), "/dev/loop1".into()],
                lvm_vg: None,
                lvm_lv: None,
            }
        );
    }

    #[test]
    fn defaults_fill_a_minimal_file() {
        let c = MdsConfig::parse(MINIMAL).unwrap();
        c.validate().unwrap();
        assert_eq!(c.server, ServerConfig::default());
        assert_eq!(c.server.listen.to_string(), DEFAULT_LISTEN);
        assert_eq!(c.tls, None);
        assert_eq!(c.metadata.kind, MetadataKind::File);
        assert_eq!(c.volume.block_size, 4096);
        assert_eq!(c.volume.stripe_unit, 64 << 10);
        assert_eq!(
            c.volume.data_offset,
            sanfs_blockmap::label::DEFAULT_DATA_OFFSET
        );
    }

    #[test]
    fn unknown_keys_are_rejected_in_every_section() {
        for text in [
            format!("colour = 1\n{MINIMAL}"),
            format!("[server]\nlistne = \"127.0.0.1:1\"\n{MINIMAL}"),
            format!("[tls]\ncert = \"a\"\nkey = \"b\"\nca = \"c\"\ncrl = \"d\"\n{MINIMAL}"),
            "[metadata]\npath = \"/m\"\nsize = 3\n[volume]\nlayout = \"linear\"\ndevices = [\"/d\"]"
                .to_owned(),
        ] {
            let err = format!("{:#}", MdsConfig::parse(&text).unwrap_err());
            assert!(err.contains("unknown field"), "{text}: {err}");
        }
        let err = MdsConfig::parse(&with_volume(
            "layout = \"linear\"\ndevices = [\"/d\"]\nstripe_size = 4096",
        ))
        .unwrap_err();
        assert!(
            format!("{err:#}").contains("unknown field `stripe_size`"),
            "{err:#}"
        );
        let err =
            MdsConfig::parse(&with_volume("layout = \"raid5\"\ndevices = [\"/d\"]")).unwrap_err();
        assert!(format!("{err:#}").contains("raid5"), "{err:#}");
    }

    #[test]
    fn sizes_take_numbers_and_binary_suffixes() {
        for (text, bytes) in [
            ("4096", 4096),
            ("0", 0),
            ("512B", 512),
            ("4k", 4096),
            ("4K", 4096),
            ("64KiB", 65536),
            ("64 KiB", 65536),
            ("1M", 1 << 20),
            ("1MiB", 1 << 20),
            ("1GiB", 1 << 30),
            ("3G", 3 << 30),
            ("2TiB", 2 << 40),
            // The same reading as mount options and the CSI driver: binary, whatever the
            // spelling.
            ("4KB", 4096),
            ("1MB", 1 << 20),
            ("1.5M", 3 << 19),
        ] {
            assert_eq!(parse_size(text), Ok(bytes), "{text}");
        }
        for bad in ["", "k", "-1", "1.5", "4x", "99999999999P", "0x10"] {
            assert!(parse_size(bad).is_err(), "{bad:?} accepted");
        }
        let c = MdsConfig::parse(&with_volume(
            "layout = \"striped\"\ndevices = [\"/d\"]\nstripe_unit = 131072\ndata_offset = \"4M\"",
        ))
        .unwrap();
        assert_eq!(
            (c.volume.stripe_unit, c.volume.data_offset),
            (128 << 10, 4 << 20)
        );
        // "64KB" reads as mount options and the CSI driver read it: 64 KiB.
        let c = MdsConfig::parse(&with_volume(
            "layout = \"striped\"\ndevices = [\"/d\"]\nstripe_unit = \"64KB\"",
        ))
        .unwrap();
        assert_eq!(c.volume.stripe_unit, 64 << 10);
        let err = MdsConfig::parse(&with_volume(
            "layout = \"striped\"\ndevices = [\"/d\"]\nstripe_unit = \"64QB\"",
        ))
        .unwrap_err();
        assert!(format!("{err:#}").contains("64QB"), "{err:#}");
        let err = MdsConfig::parse(&with_volume(
            "layout = \"striped\"\ndevices = [\"/d\"]\nstripe_unit = true",
        ))
        .unwrap_err();
        assert!(format!("{err:#}").contains("expected a size"), "{err:#}");
    }

    #[test]
    fn validation_names_the_problem() {
        let cases = [
            (
                "layout = \"striped\"\ndevices = [\"/a\"]\nstripe_unit = 6144",
                "stripe_unit 6144 is not a positive multiple",
            ),
            (
                "layout = \"striped\"\ndevices = [\"/a\"]\nstripe_unit = 0",
                "stripe_unit 0",
            ),
            (
                "layout = \"lvm\"\ndevices = [\"/a\"]\nlvm_lv = \"lv\"",
                "needs volume.lvm_vg",
            ),
            (
                "layout = \"lvm\"\ndevices = [\"/a\"]\nlvm_vg = \"vg\"",
                "needs volume.lvm_lv",
            ),
            (
                "layout = \"linear\"\ndevices = [\"/a\"]\nlvm_vg = \"vg\"",
                "only apply to layout = \"lvm\"",
            ),
            (
                "layout = \"linear\"\ndevices = []",
                "volume.devices is empty",
            ),
            ("layout = \"linear\"", "volume.devices is empty"),
            (
                "layout = \"linear\"\ndevices = [\"/a\", \"/a\"]",
                "lists /a twice",
            ),
            (
                "layout = \"linear\"\ndevices = [\"/a\"]\nblock_size = 3000",
                "block_size 3000",
            ),
            (
                "layout = \"linear\"\ndevices = [\"/a\"]\nblock_size = 131072",
                "block_size 131072",
            ),
            (
                "layout = \"linear\"\ndevices = [\"/a\"]\ndata_offset = 512",
                "data_offset 512",
            ),
            (
                "layout = \"linear\"\ndevices = [\"/m\"]",
                "also a volume device",
            ),
        ];
        for (volume, expect) in cases {
            let err = invalid(&with_volume(volume));
            assert!(err.contains(expect), "{volume}: {err}");
        }
        let plain = format!("[server]\nlisten = \"0.0.0.0:7410\"\n{MINIMAL}");
        assert!(invalid(&plain).contains("not a loopback address"));
        let insecure = format!("[server]\nlisten = \"0.0.0.0:7410\"\ninsecure = true\n{MINIMAL}");
        MdsConfig::parse(&insecure).unwrap().validate().unwrap();
        let zero = format!("[server]\nlease_ttl_ms = 0\n{MINIMAL}");
        assert!(invalid(&zero).contains("lease_ttl_ms"));
        let zero = format!("[server]\ngrant_hold_limit_ms = 0\n{MINIMAL}");
        assert!(invalid(&zero).contains("grant_hold_limit_ms"));
        let many = format!("[server]\nthreads = 100000\n{MINIMAL}");
        assert!(invalid(&many).contains("server.threads"));
        let three = MdsConfig::parse(&format!("[server]\nthreads = 3\n{MINIMAL}")).unwrap();
        three.validate().unwrap();
        assert_eq!(three.server.worker_threads(), 3);
        let auto = MdsConfig::parse(MINIMAL).unwrap();
        assert!(auto.server.worker_threads() >= 1);
        let partial_tls = format!("[tls]\ncert = \"c\"\nkey = \"k\"\n{MINIMAL}");
        let err = MdsConfig::parse(&partial_tls).unwrap_err();
        assert!(format!("{err:#}").contains("missing field `ca`"), "{err:#}");
    }

    #[test]
    fn identities_and_the_unix_socket() {
        let text = format!(
            "[server]\nlisten_unix = \"/run/sanfs/mds.sock\"\nunix_uids = [990]\n\
             max_sessions_per_identity = 8\n\
             [client_defaults]\nroot_squash = true\n\
             [[clients]]\nname = \"admin-node\"\nadmin = true\n\
             [[clients]]\nname = \"unix:uid=990\"\nroot_squash = true\nsquash_uid = 7\n{MINIMAL}"
        );
        let c = MdsConfig::parse(&text).unwrap();
        c.validate().unwrap();
        assert_eq!(c.server.listen_unix, Some("/run/sanfs/mds.sock".into()));
        let a = c.access();
        assert_eq!(a.unix_uids, [990]);
        assert_eq!(a.max_sessions_per_identity, 8);
        assert!(a.client_defaults.root_squash && !a.client_defaults.admin);
        assert_eq!(a.clients.len(), 2);
        assert!(a.clients[0].1.admin && !a.clients[0].1.root_squash);
        let unix = a.unix_identity(Some(990)).unwrap();
        assert_eq!((unix.policy.squash_uid, unix.policy.squash_gid), (7, 65534));
        let default = MdsConfig::parse(MINIMAL).unwrap().access();
        assert_eq!(default.max_sessions_per_identity, 64);
        assert!(!default.client_defaults.admin && !default.client_defaults.root_squash);

        for (bad, expect) in [
            (
                "[[clients]]\nname = \"a\"\n[[clients]]\nname = \"a\"\n",
                "twice",
            ),
            ("[[clients]]\nname = \"\"\n", "empty name"),
            (
                "[server]\nmax_sessions_per_identity = 0\n",
                "max_sessions_per_identity",
            ),
            ("[server]\nlisten_unix = \"mds.sock\"\n", "absolute"),
        ] {
            let err = invalid(&format!("{bad}{MINIMAL}"));
            assert!(err.contains(expect), "{bad}: {err}");
        }
        let err = MdsConfig::parse(&format!(
            "[[clients]]\nname = \"a\"\nsquash = true\n{MINIMAL}"
        ))
        .unwrap_err();
        assert!(format!("{err:#}").contains("unknown field"), "{err:#}");
    }

    /// A block metadata LUN with the given `[ha]` body.
    fn with_ha(ha: &str) -> String {
        format!(
            "[server]\nlisten = \"127.0.0.1:7410\"\n[metadata]\npath = \"/dev/sdz\"\nkind = \"block\"\n\
             [volume]\nlayout = \"linear\"\ndevices = [\"/dev/sdb\"]\n[ha]\n{ha}\n"
        )
    }

    #[test]
    fn the_ha_section_parses_with_defaults_and_tls() {
        let c = MdsConfig::parse(&with_ha("etcd = [\"http://10.0.0.1:2379\"]")).unwrap();
        c.validate().unwrap();
        let ha = c.ha_options().unwrap();
        assert_eq!(ha.etcd, ["http://10.0.0.1:2379"]);
        assert_eq!(ha.election, "sanfs/mds");
        assert_eq!(
            ha.advertise, "127.0.0.1:7410",
            "advertise defaults to server.listen"
        );
        assert_eq!(ha.lease_ttl_s, 2);
        assert_eq!(ha.tls, None);
        assert_eq!(MdsConfig::parse(MINIMAL).unwrap().ha_options(), None);

        let c = MdsConfig::parse(&with_ha(
            "etcd = [\"https://e1:2379\", \"https://e2:2379\"]\nelection = \"fs1/mds\"\n\
             advertise = \"mds-a.example:7410\"\nlease_ttl_s = 60\n\
             [ha.tls]\nca = \"/etc/sanfs/etcd-ca.pem\"\ncert = \"/c.pem\"\nkey = \"/k.pem\"",
        ))
        .unwrap();
        c.validate().unwrap();
        let ha = c.ha_options().unwrap();
        assert_eq!(ha.etcd.len(), 2);
        assert_eq!(
            (ha.election.as_str(), ha.advertise.as_str(), ha.lease_ttl_s),
            ("fs1/mds", "mds-a.example:7410", 60)
        );
        assert_eq!(
            ha.tls,
            Some(crate::ha::EtcdTls {
                ca: "/etc/sanfs/etcd-ca.pem".into(),
                cert: Some("/c.pem".into()),
                key: Some("/k.pem".into()),
            })
        );
    }

    #[test]
    fn ha_validation_names_the_problem() {
        for (ha, expect) in [
            ("etcd = []", "at least one etcd URL"),
            (
                "etcd = [\"10.0.0.1:2379\"]",
                "not an http:// or https:// URL",
            ),
            (
                "etcd = [\"grpc://e:2379\"]",
                "not an http:// or https:// URL",
            ),
            ("etcd = [\"https://e:2379\"]", "add [ha.tls]"),
            (
                "etcd = [\"http://e:2379\"]\nlease_ttl_s = 0",
                "1 to 60 seconds",
            ),
            (
                "etcd = [\"http://e:2379\"]\nlease_ttl_s = 61",
                "1 to 60 seconds",
            ),
            ("etcd = [\"http://e:2379\"]\nelection = \"\"", "ha.election"),
            (
                "etcd = [\"http://e:2379\"]\nelection = \"a/\"",
                "trailing '/'",
            ),
            (
                "etcd = [\"https://e:2379\"]\n[ha.tls]\nca = \"/ca\"\ncert = \"/c\"",
                "cert and key go together",
            ),
        ] {
            let err = invalid(&with_ha(ha));
            assert!(err.contains(expect), "{ha}: {err}");
        }
        // The store in a file cannot be shared by candidates.
        let file = format!("{MINIMAL}[ha]\netcd = [\"http://e:2379\"]\n");
        assert!(invalid(&file).contains("needs metadata.kind = \"block\""));
        // Unknown keys and a negative TTL are refused when parsing.
        for bad in [
            "etcd = [\"http://e:2379\"]\nttl = 2",
            "etcd = [\"http://e:2379\"]\nlease_ttl_s = -1",
            "election = \"x\"",
            "etcd = [\"https://e:2379\"]\n[ha.tls]\nca = \"/ca\"\ncrl = \"/crl\"",
        ] {
            assert!(MdsConfig::parse(&with_ha(bad)).is_err(), "{bad} parsed");
        }
    }

    #[test]
    fn load_names_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("mds.toml");
        let err = MdsConfig::load(&path).unwrap_err();
        assert!(format!("{err:#}").contains(&path.display().to_string()));
        std::fs::write(&path, "[volume]\nlayout = 3\n").unwrap();
        let err = format!("{:#}", MdsConfig::load(&path).unwrap_err());
        assert!(
            err.starts_with(&format!("parse config file {}", path.display())),
            "{err}"
        );
        std::fs::write(&path, with_volume("layout = \"linear\"\ndevices = []")).unwrap();
        let err = format!("{:#}", MdsConfig::load(&path).unwrap_err());
        assert!(err.starts_with("invalid config file"), "{err}");
        std::fs::write(&path, MINIMAL).unwrap();
        assert_eq!(
            MdsConfig::load(&path).unwrap(),
            MdsConfig::parse(MINIMAL).unwrap()
        );
    }

    #[test]
    fn the_deploy_example_parses_and_validates() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/examples/mds.toml");
        let config = MdsConfig::load(&path).unwrap();
        assert_eq!(config.volume.layout, LayoutKindConfig::Striped);
        assert!(config.tls.is_some());
    }
}
