//! `sanfs-admin`: an administrator's view of a metadata server over the Admin service
//! (`status`, `clients`, `evict`, `quota get|set|list`, `grow`). It connects as the agent does
//! ([`connect_channel`]: `unix:/path` known by its uid, or mutual TLS with a certificate that
//! `[[clients]]` of mds.toml marks `admin = true`), so the server alone decides who is an
//! administrator (`NodeIdentity::require_admin`); a refusal is reported with the server's
//! words. Every read command can answer in JSON (`--json`), one object per call.
//!
//! Directories are named by their path inside the volume (`/tenant-a`), resolved from the
//! root with `Lookup` as root; the mount point of a node does not matter.

use std::fmt::Write as _;
use std::time::Duration;

use anyhow::{Context, bail};
use sanfs_proto::model::{
    EvictSessionReply, EvictSessionRequest, GrowLayout, GrowVolumeReply, GrowVolumeRequest,
    InodeRequest, QuotaInfo, QuotaLimits, QuotaList, ServerStatus, SetQuotaRequest, StatFs,
    VolumeInfo,
};
use sanfs_proto::pb;
use sanfs_proto::pb::admin_client::AdminClient;
use sanfs_proto::pb::namespace_client::NamespaceClient;
use sanfs_proto::types::{Attr, Credentials, FileName, FileType, InodeId, ROOT_INODE, SessionId};
use serde_json::{Value, json};
use tonic::transport::Channel;

use crate::client::{TlsConfig, connect_channel};

/// The server's unix socket where `--server` is not given (as in deploy/mds.toml).
pub const DEFAULT_SERVER: &str = "unix:/run/sanfs/mds.sock";

/// A connection to the server's Admin and Namespace services.
pub struct Admin {
    server: String,
    channel: Channel,
}

/// A gRPC status as an error that says which call failed and the server's own words.
fn refused(call: &str, s: &tonic::Status) -> anyhow::Error {
    match s.code() {
        tonic::Code::PermissionDenied | tonic::Code::Unauthenticated => {
            anyhow::anyhow!("the server refused {call}: {}", s.message())
        }
        tonic::Code::Unavailable => {
            anyhow::anyhow!("{call}: the server is unavailable: {}", s.message())
        }
        _ => {
            let e = sanfs_proto::status::fs_error_from_status(s);
            anyhow::anyhow!("{call}: {e} ({})", s.message())
        }
    }
}

fn malformed(call: &str, e: impl std::fmt::Display) -> anyhow::Error {
    anyhow::anyhow!("{call}: malformed reply from the server: {e}")
}

impl Admin {
    /// Connects to `server` (`host:port` or `unix:/path`), over mutual TLS when `tls` is given.
    pub async fn connect(server: &str, tls: Option<&TlsConfig>) -> anyhow::Result<Admin> {
        let channel = connect_channel(server, tls)
            .await
            .with_context(|| format!("connect to {server}"))?;
        Ok(Admin {
            server: server.to_owned(),
            channel,
        })
    }

    fn admin(&self) -> AdminClient<Channel> {
        AdminClient::new(self.channel.clone())
    }

    /// ServerStatus (admin identities only).
    pub async fn server_status(&self) -> anyhow::Result<ServerStatus> {
        let r = self
            .admin()
            .server_status(pb::ServerStatusRequest {})
            .await
            .map_err(|s| refused("ServerStatus", &s))?;
        ServerStatus::try_from(r.into_inner()).map_err(|e| malformed("ServerStatus", e))
    }

    /// The volume (GetVolume) and its capacity and free space (StatFs of the root).
    pub async fn volume(&self) -> anyhow::Result<(VolumeInfo, StatFs)> {
        let r = self
            .admin()
            .get_volume(pb::GetVolumeRequest {})
            .await
            .map_err(|s| refused("GetVolume", &s))?;
        let volume = VolumeInfo::try_from(r.into_inner()).map_err(|e| malformed("GetVolume", e))?;
        let req = InodeRequest {
            cred: Credentials::root(),
            inode: ROOT_INODE,
        };
        let r = NamespaceClient::new(self.channel.clone())
            .stat_fs(pb::StatFsRequest::from(req))
            .await
            .map_err(|s| refused("StatFs", &s))?;
        let st = StatFs::try_from(r.into_inner()).map_err(|e| malformed("StatFs", e))?;
        Ok((volume, st))
    }

    /// The inode of the directory at `path` inside the volume (`/` is the root).
    pub async fn resolve(&self, path: &str) -> anyhow::Result<InodeId> {
        if !path.starts_with('/') {
            bail!("{path:?}: give the directory's path inside the volume, from its root (/...)");
        }
        let mut ino = ROOT_INODE;
        let mut ns = NamespaceClient::new(self.channel.clone());
        let mut attr: Option<Attr> = None;
        for part in path.split('/').filter(|p| !p.is_empty()) {
            let name = FileName::new(part.as_bytes().to_vec())
                .map_err(|e| anyhow::anyhow!("{path:?}: bad name {part:?}: {e}"))?;
            let req = sanfs_proto::model::EntryRequest {
                cred: Credentials::root(),
                parent: ino,
                name,
            };
            let r = ns
                .lookup(pb::LookupRequest::from(req))
                .await
                .map_err(|s| refused(&format!("Lookup of {part:?} in {path:?}"), &s))?;
            let a = Attr::try_from(r.into_inner()).map_err(|e| malformed("Lookup", e))?;
            ino = a.ino;
            attr = Some(a);
        }
        if let Some(a) = attr
            && a.kind != FileType::Directory
        {
            bail!("{path:?} is not a directory (quotas are set on directories)");
        }
        Ok(ino)
    }

    /// GetQuota of the directory at `path`; `None` when it carries no quota.
    pub async fn quota_get(&self, path: &str) -> anyhow::Result<Option<QuotaInfo>> {
        let inode = self.resolve(path).await?;
        let req = InodeRequest {
            cred: Credentials::root(),
            inode,
        };
        match self.admin().get_quota(pb::GetQuotaRequest::from(req)).await {
            Ok(r) => Ok(Some(
                QuotaInfo::try_from(r.into_inner()).map_err(|e| malformed("GetQuota", e))?,
            )),
            Err(s)
                if sanfs_proto::status::fs_error_from_status(&s)
                    == sanfs_proto::types::FsError::NoAttr =>
            {
                Ok(None)
            }
            Err(s) => Err(refused("GetQuota", &s)),
        }
    }

    /// SetQuota on the directory at `path` (an empty directory in no quota, or one already
    /// carrying a quota).
    pub async fn quota_set(&self, path: &str, limits: QuotaLimits) -> anyhow::Result<QuotaInfo> {
        let inode = self.resolve(path).await?;
        let req = SetQuotaRequest {
            cred: Credentials::root(),
            inode,
            limits,
        };
        let r = self
            .admin()
            .set_quota(pb::SetQuotaRequest::from(req))
            .await
            .map_err(|s| refused("SetQuota", &s))?;
        QuotaInfo::try_from(r.into_inner()).map_err(|e| malformed("SetQuota", e))
    }

    /// ListQuotas (admin identities only).
    pub async fn quota_list(&self) -> anyhow::Result<QuotaList> {
        let r = self
            .admin()
            .list_quotas(pb::ListQuotasRequest {})
            .await
            .map_err(|s| refused("ListQuotas", &s))?;
        QuotaList::try_from(r.into_inner()).map_err(|e| malformed("ListQuotas", e))
    }

    /// EvictSession (admin identities only).
    pub async fn evict(&self, session: u64, reason: &str) -> anyhow::Result<EvictSessionReply> {
        if session == 0 {
            bail!("session 0 does not exist (session ids start at 1; see `sanfs-admin clients`)");
        }
        let req = EvictSessionRequest {
            session: SessionId(session),
            reason: reason.to_owned(),
        };
        let r = self
            .admin()
            .evict_session(pb::EvictSessionRequest::from(req))
            .await
            .map_err(|s| {
                if s.code() == tonic::Code::NotFound {
                    anyhow::anyhow!(
                        "no live session {session} at {} (see `sanfs-admin clients`)",
                        self.server
                    )
                } else {
                    refused("EvictSession", &s)
                }
            })?;
        EvictSessionReply::try_from(r.into_inner()).map_err(|e| malformed("EvictSession", e))
    }

    /// GrowVolume (admin identities only): `paths` as the server's host names them.
    pub async fn grow(
        &self,
        paths: Vec<String>,
        layout: GrowLayout,
        force: bool,
    ) -> anyhow::Result<GrowVolumeReply> {
        let req = GrowVolumeRequest {
            device_paths: paths,
            layout,
            force,
        };
        let r = self
            .admin()
            .grow_volume(pb::GrowVolumeRequest::from(req))
            .await
            .map_err(|s| refused("GrowVolume", &s))?;
        GrowVolumeReply::try_from(r.into_inner()).map_err(|e| malformed("GrowVolume", e))
    }

    pub fn server(&self) -> &str {
        &self.server
    }
}

/// `grow` as JSON.
pub fn grow_json(r: &GrowVolumeReply) -> Value {
    let v = &r.volume.volume;
    json!({
        "old_size_bytes": r.old_size_bytes,
        "size_bytes": v.size_bytes(),
        "luns": v.devices().len(),
        "segments": v.segments().len(),
        "devices": v.devices().iter().map(|d| d.uuid.to_string()).collect::<Vec<_>>(),
    })
}

/// `grow` as text.
pub fn grow_text(j: &Value) -> String {
    let n = |x: &Value| x.as_u64().unwrap_or(0);
    format!(
        "volume grown from {} to {} ({} LUNs, {} segments)\n",
        bytes(n(&j["old_size_bytes"])),
        bytes(n(&j["size_bytes"])),
        n(&j["luns"]),
        n(&j["segments"])
    )
}

/// `status` as JSON.
pub fn status_json(server: &str, s: &ServerStatus, v: &VolumeInfo, st: &StatFs) -> Value {
    let bs = u64::from(st.block_size);
    let layout = match v.volume.kind() {
        sanfs_blockmap::volume::LayoutKind::Linear => "linear",
        sanfs_blockmap::volume::LayoutKind::Striped { .. } => "striped",
        sanfs_blockmap::volume::LayoutKind::Lvm { .. } => "lvm",
    };
    json!({
        "server": server,
        "server_version": s.server_version,
        "epoch": s.epoch.0,
        "fs_uuid": s.fs_uuid.to_string(),
        "uptime_ms": s.uptime_ms,
        "volume": {
            "layout": layout,
            "luns": v.volume.devices().len(),
            "block_size": st.block_size,
            "size_bytes": st.total_blocks.saturating_mul(bs),
            "free_bytes": st.free_blocks.saturating_mul(bs),
            "used_bytes": st.total_blocks.saturating_sub(st.free_blocks).saturating_mul(bs),
            "inodes": st.total_inodes.saturating_sub(st.free_inodes),
        },
        "sessions": s.sessions_total,
        "read_grants": s.read_grants,
        "write_grants": s.write_grants,
        "commits": {
            "transactions": s.commits.transactions,
            "commits": s.commits.commits,
            "pending": s.commits.pending,
        },
    })
}

/// `status` as text.
pub fn status_text(j: &Value) -> String {
    let v = &j["volume"];
    let mut out = String::new();
    let n = |x: &Value| x.as_u64().unwrap_or(0);
    let _ = writeln!(
        out,
        "server      {} (sanfs-mds {}), up {}",
        j["server"].as_str().unwrap_or(""),
        j["server_version"].as_str().unwrap_or(""),
        duration(n(&j["uptime_ms"]))
    );
    let _ = writeln!(out, "epoch       {}", n(&j["epoch"]));
    let _ = writeln!(
        out,
        "volume      {} ({}, {} LUNs, block size {})",
        j["fs_uuid"].as_str().unwrap_or(""),
        v["layout"].as_str().unwrap_or(""),
        n(&v["luns"]),
        n(&v["block_size"])
    );
    let size = n(&v["size_bytes"]);
    let free = n(&v["free_bytes"]);
    let pct = (free as f64 * 100.0).checked_div_nonzero(size as f64);
    let _ = writeln!(
        out,
        "capacity    {} ({} bytes), free {} ({pct:.1}%), {} inodes",
        bytes(size),
        size,
        bytes(free),
        n(&v["inodes"])
    );
    let _ = writeln!(
        out,
        "sessions    {}, grants {} read / {} write",
        n(&j["sessions"]),
        n(&j["read_grants"]),
        n(&j["write_grants"])
    );
    let c = &j["commits"];
    let _ = writeln!(
        out,
        "commits     {} transactions in {} commits, {} pending",
        n(&c["transactions"]),
        n(&c["commits"]),
        n(&c["pending"])
    );
    out
}

trait DivNonZero {
    fn checked_div_nonzero(self, d: f64) -> f64;
}

impl DivNonZero for f64 {
    fn checked_div_nonzero(self, d: f64) -> f64 {
        if d > 0.0 { self / d } else { 0.0 }
    }
}

/// `clients` as JSON: every listed session.
pub fn clients_json(s: &ServerStatus) -> Value {
    let sessions: Vec<Value> = s
        .sessions
        .iter()
        .map(|c| {
            json!({
                "session": c.session.0,
                "identity": c.identity,
                "client_name": c.client_name,
                "host": c.host,
                "lease_remaining_ms": c.lease_remaining_ms,
                "grants": c.grants,
                "open_handles": c.open_handles,
            })
        })
        .collect();
    json!({ "sessions_total": s.sessions_total, "sessions": sessions })
}

/// `clients` as text: a table.
pub fn clients_text(j: &Value) -> String {
    let mut out = format!(
        "{:>8}  {:<20} {:<16} {:<16} {:>7} {:>6} {:>7}\n",
        "SESSION", "IDENTITY", "CLIENT", "HOST", "LEASE", "GRANTS", "HANDLES"
    );
    let empty = Vec::new();
    let list = j["sessions"].as_array().unwrap_or(&empty);
    for c in list {
        let _ = writeln!(
            out,
            "{:>8}  {:<20} {:<16} {:<16} {:>7} {:>6} {:>7}",
            c["session"].as_u64().unwrap_or(0),
            c["identity"].as_str().unwrap_or(""),
            c["client_name"].as_str().unwrap_or(""),
            c["host"].as_str().unwrap_or(""),
            duration(c["lease_remaining_ms"].as_u64().unwrap_or(0)),
            c["grants"].as_u64().unwrap_or(0),
            c["open_handles"].as_u64().unwrap_or(0),
        );
    }
    let total = j["sessions_total"].as_u64().unwrap_or(0);
    if total > list.len() as u64 {
        let _ = writeln!(
            out,
            "({} more sessions not listed)",
            total - list.len() as u64
        );
    }
    out
}

/// One quota as JSON (`path` when known).
pub fn quota_json(path: Option<&str>, q: &QuotaInfo) -> Value {
    json!({
        "path": path,
        "inode": q.inode.0,
        "capacity_bytes": q.limits.capacity_bytes,
        "inodes": q.limits.inodes,
        "used_bytes": q.used_bytes,
        "used_inodes": q.used_inodes,
    })
}

/// Quotas as a text table.
pub fn quotas_text(list: &[Value]) -> String {
    let mut out = format!(
        "{:>10}  {:>12} {:>12} {:>10} {:>10}  PATH\n",
        "INODE", "LIMIT", "USED", "INODES", "USED"
    );
    let lim = |v: &Value, f: fn(u64) -> String| v.as_u64().map_or("-".to_owned(), f);
    for q in list {
        let _ = writeln!(
            out,
            "{:>10}  {:>12} {:>12} {:>10} {:>10}  {}",
            q["inode"].as_u64().unwrap_or(0),
            lim(&q["capacity_bytes"], bytes),
            bytes(q["used_bytes"].as_u64().unwrap_or(0)),
            lim(&q["inodes"], |n| n.to_string()),
            q["used_inodes"].as_u64().unwrap_or(0),
            q["path"].as_str().unwrap_or("-"),
        );
    }
    out
}

/// A limit given on the command line: a size (`10G`, `65536`), a count, or `none`.
pub fn parse_limit(s: &str, size: bool) -> anyhow::Result<Option<u64>> {
    if s == "none" {
        return Ok(None);
    }
    if size {
        crate::mount_options::parse_size(s).map(Some)
    } else {
        s.parse::<u64>()
            .map(Some)
            .with_context(|| format!("{s:?} is not a number of inodes (or none)"))
    }
}

/// Bytes in binary units, one decimal: `1.5 GiB`.
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

/// Milliseconds as `950ms`, `9.5s`, `3m20s`, `2h05m`, `3d04h`.
pub fn duration(ms: u64) -> String {
    let d = Duration::from_millis(ms);
    let s = d.as_secs();
    if ms < 1000 {
        format!("{ms}ms")
    } else if s < 60 {
        format!("{:.1}s", d.as_secs_f64())
    } else if s < 3600 {
        format!("{}m{:02}s", s / 60, s % 60)
    } else if s < 86400 {
        format!("{}h{:02}m", s / 3600, s % 3600 / 60)
    } else {
        format!("{}d{:02}h", s / 86400, s % 86400 / 3600)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_durations_read_as_an_admin_expects() {
        assert_eq!(bytes(0), "0 B");
        assert_eq!(bytes(1023), "1023 B");
        assert_eq!(bytes(1536), "1.5 KiB");
        assert_eq!(bytes(10 << 30), "10.0 GiB");
        assert_eq!(duration(950), "950ms");
        assert_eq!(duration(9_500), "9.5s");
        assert_eq!(duration(200_000), "3m20s");
        assert_eq!(duration(7_500_000), "2h05m");
        assert_eq!(duration(3 * 86_400_000 + 4 * 3_600_000), "3d04h");
    }

    #[test]
    fn limits_take_sizes_counts_and_none() {
        assert_eq!(parse_limit("10M", true).unwrap(), Some(10 << 20));
        assert_eq!(parse_limit("none", true).unwrap(), None);
        assert_eq!(parse_limit("1000", false).unwrap(), Some(1000));
        assert_eq!(parse_limit("none", false).unwrap(), None);
        assert!(parse_limit("10X", true).is_err());
        assert!(parse_limit("1k", false).is_err());
        assert!(parse_limit("", true).is_err());
    }

    #[test]
    fn clients_table_names_every_session_and_the_unlisted_rest() {
        let j = json!({
            "sessions_total": 3,
            "sessions": [
                {"session": 7, "identity": "unix:uid=0", "client_name": "node-a", "host": "h1",
                 "lease_remaining_ms": 9500, "grants": 2, "open_handles": 1},
                {"session": 9, "identity": "node-b", "client_name": "node-b", "host": "h2",
                 "lease_remaining_ms": 300, "grants": 0, "open_handles": 0},
            ],
        });
        let t = clients_text(&j);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 4, "{t}");
        assert!(
            lines[0].contains("SESSION") && lines[0].contains("LEASE"),
            "{t}"
        );
        assert!(
            lines[1].contains("unix:uid=0") && lines[1].contains("9.5s"),
            "{t}"
        );
        assert!(
            lines[2].trim_start().starts_with('9') && lines[2].contains("300ms"),
            "{t}"
        );
        assert_eq!(lines[3], "(1 more sessions not listed)");
    }

    #[test]
    fn quota_table_shows_absent_limits_as_dashes() {
        let q = QuotaInfo {
            inode: InodeId(12),
            limits: QuotaLimits {
                capacity_bytes: Some(1 << 20),
                inodes: None,
            },
            used_bytes: 4096,
            used_inodes: 1,
        };
        let t = quotas_text(&[quota_json(Some("/t"), &q)]);
        let row = t.lines().nth(1).unwrap();
        let cols: Vec<&str> = row.split_whitespace().collect();
        assert_eq!(
            cols,
            ["12", "1.0", "MiB", "4.0", "KiB", "-", "1", "/t"],
            "{t}"
        );
    }
}
