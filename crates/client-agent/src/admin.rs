//! `sanfs-admin`: an administrator's view of a metadata server over the Admin service
//! (`status`, `clients`, `top`, `evict`, `quota get|set|list`, `grow`). It connects as the agent does
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
    Activity, BackupStoreReply, BackupStoreRequest, EvictSessionReply, EvictSessionRequest,
    GrowLayout, GrowVolumeReply, GrowVolumeRequest, InodeRequest, QuotaInfo, QuotaLimits,
    QuotaList, ServerStatus, SetQuotaRequest, StatFs, VolumeInfo,
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

    /// Has the server write a consistent copy of its metadata store to `path` on the
    /// server's host (docs/operations.md "Backing up the metadata store").
    pub async fn backup(&self, path: String, force: bool) -> anyhow::Result<BackupStoreReply> {
        let req = BackupStoreRequest { path, force };
        let r = self
            .admin()
            .backup_store(pb::BackupStoreRequest::from(req))
            .await
            .map_err(|s| refused("BackupStore", &s))?;
        BackupStoreReply::try_from(r.into_inner()).map_err(|e| malformed("BackupStore", e))
    }

    pub fn server(&self) -> &str {
        &self.server
    }
}

/// `backup` as JSON.
pub fn backup_json(path: &str, r: &BackupStoreReply) -> Value {
    json!({
        "path": path,
        "fs_uuid": r.fs_uuid.to_string(),
        "epoch": r.epoch.0,
        "commit_seq": r.commit_seq,
        "taken_at": r.taken_at.sec,
        "inodes": r.inodes,
        "size_bytes": r.size_bytes,
    })
}

/// `backup` as text.
pub fn backup_text(j: &Value) -> String {
    format!(
        "backup {}: fs {}, server epoch {}, last commit {}, taken at {} (Unix seconds), {} inodes, {} bytes\n",
        j["path"].as_str().unwrap_or(""),
        j["fs_uuid"].as_str().unwrap_or(""),
        j["epoch"],
        j["commit_seq"],
        j["taken_at"],
        j["inodes"],
        j["size_bytes"],
    )
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

/// A session id in JSON: a decimal string, since ids use all 64 bits and JSON readers that keep
/// numbers as doubles (jq 1.6, JavaScript) round them above 2^53.
fn session_json(id: u64) -> Value {
    json!(id.to_string())
}

/// A session id back from [`session_json`] (a number is accepted too); 0 when absent.
fn session_of(v: &Value) -> u64 {
    v.as_str()
        .and_then(|s| s.parse().ok())
        .or_else(|| v.as_u64())
        .unwrap_or(0)
}

/// `clients` as JSON: every listed session.
pub fn clients_json(s: &ServerStatus) -> Value {
    let sessions: Vec<Value> = s
        .sessions
        .iter()
        .map(|c| {
            json!({
                "session": session_json(c.session.0),
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
        "{:>20}  {:<20} {:<16} {:<16} {:>7} {:>6} {:>7}\n",
        "SESSION", "IDENTITY", "CLIENT", "HOST", "LEASE", "GRANTS", "HANDLES"
    );
    let empty = Vec::new();
    let list = j["sessions"].as_array().unwrap_or(&empty);
    for c in list {
        let _ = writeln!(
            out,
            "{:>20}  {:<20} {:<16} {:<16} {:>7} {:>6} {:>7}",
            session_of(&c["session"]),
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

/// Per second, from a counter's growth over `secs` (0 when the counter went back: a server
/// restart between two samples).
fn rate(before: u64, after: u64, secs: f64) -> f64 {
    if secs > 0.0 {
        after.saturating_sub(before) as f64 / secs
    } else {
        0.0
    }
}

/// Mean microseconds per request over the growth of `(count, micros)`.
fn mean_us(before: (u64, u64), after: (u64, u64)) -> u64 {
    let n = after.0.saturating_sub(before.0);
    after.1.saturating_sub(before.1).checked_div(n).unwrap_or(0)
}

/// The rates of `Activity` counters between two samples.
fn activity_rates(before: &Activity, after: &Activity, secs: f64) -> Value {
    json!({
        "rpcs_per_sec": rate(before.rpcs, after.rpcs, secs),
        "errors_per_sec": rate(before.rpc_errors, after.rpc_errors, secs),
        "mean_latency_us": mean_us(
            (before.rpcs, before.rpc_micros),
            (after.rpcs, after.rpc_micros),
        ),
        "read_grants_per_sec": rate(before.read_grants, after.read_grants, secs),
        "write_grants_per_sec": rate(before.write_grants, after.write_grants, secs),
        "direct_read_bytes_per_sec":
            rate(before.granted_read_bytes, after.granted_read_bytes, secs),
        "direct_write_bytes_per_sec":
            rate(before.granted_write_bytes, after.granted_write_bytes, secs),
        "proxied_read_bytes_per_sec":
            rate(before.proxied_read_bytes, after.proxied_read_bytes, secs),
        "proxied_write_bytes_per_sec":
            rate(before.proxied_write_bytes, after.proxied_write_bytes, secs),
    })
}

/// One refresh of `top` as JSON: what changed between two ServerStatus samples, as rates
/// over the server's own clock (its uptime), `fallback_secs` when that did not move.
///
/// `rpcs` lists the RPCs answered in the interval, busiest first; `clients` every listed
/// session, busiest first (a session new since `before` counts from zero). Direct bytes are
/// the bytes the grants handed out covered; proxied bytes went through the server.
pub fn top_json(before: &ServerStatus, after: &ServerStatus, fallback_secs: f64) -> Value {
    let server_secs = after.uptime_ms.saturating_sub(before.uptime_ms) as f64 / 1000.0;
    let secs = if after.uptime_ms > before.uptime_ms {
        server_secs
    } else {
        fallback_secs
    };
    let mut rpcs: Vec<Value> = after
        .rpcs
        .iter()
        .filter_map(|t| {
            let b = before.rpcs.iter().find(|b| b.rpc == t.rpc);
            let (count, errors, micros) = b.map_or((0, 0, 0), |b| (b.count, b.errors, b.micros));
            (t.count > count).then(|| {
                json!({
                    "rpc": t.rpc,
                    "per_sec": rate(count, t.count, secs),
                    "errors_per_sec": rate(errors, t.errors, secs),
                    "mean_latency_us": mean_us((count, micros), (t.count, t.micros)),
                })
            })
        })
        .collect();
    let by_rate = |a: &Value, b: &Value, key: &str| {
        let f = |v: &Value| v[key].as_f64().unwrap_or(0.0);
        f(b).total_cmp(&f(a))
    };
    rpcs.sort_by(|a, b| by_rate(a, b, "per_sec"));
    let mut clients: Vec<Value> = after
        .sessions
        .iter()
        .map(|s| {
            let was = before
                .sessions
                .iter()
                .find(|b| b.session == s.session)
                .map_or(Activity::default(), |b| b.activity);
            let mut c = activity_rates(&was, &s.activity, secs);
            c["session"] = session_json(s.session.0);
            c["client_name"] = json!(s.client_name);
            c["host"] = json!(s.host);
            c["identity"] = json!(s.identity);
            c["grants_held"] = json!(s.grants);
            c
        })
        .collect();
    clients.sort_by(|a, b| {
        by_rate(a, b, "rpcs_per_sec")
            .then_with(|| session_of(&a["session"]).cmp(&session_of(&b["session"])))
    });
    json!({
        "uptime_ms": after.uptime_ms,
        "interval_ms": (secs * 1000.0).round() as u64,
        "sessions_total": after.sessions_total,
        "grants_held": { "read": after.read_grants, "write": after.write_grants },
        "commits_pending": after.commits.pending,
        "commits_per_sec": rate(before.commits.commits, after.commits.commits, secs),
        "transactions_per_sec":
            rate(before.commits.transactions, after.commits.transactions, secs),
        "server": activity_rates(&before.activity, &after.activity, secs),
        "rpcs": rpcs,
        "clients": clients,
    })
}

/// At most this many RPCs and clients in one text refresh of `top`.
const TOP_ROWS: usize = 20;

/// A rate for a table: `0`, `3.5`, `120`.
fn per_sec(v: &Value) -> String {
    let x = v.as_f64().unwrap_or(0.0);
    if x == 0.0 {
        "0".to_owned()
    } else if x < 100.0 {
        format!("{x:.1}")
    } else {
        format!("{x:.0}")
    }
}

/// Bytes per second for a table: `0`, `1.5 MiB`.
fn bytes_per_sec(v: &Value) -> String {
    let x = v.as_f64().unwrap_or(0.0);
    if x == 0.0 {
        "0".to_owned()
    } else {
        bytes(x as u64)
    }
}

/// One refresh of `top` as text: a summary line, the busiest RPCs, the busiest clients.
pub fn top_text(j: &Value) -> String {
    let mut out = String::new();
    let n = |x: &Value| x.as_u64().unwrap_or(0);
    let s = &j["server"];
    let _ = writeln!(
        out,
        "up {}, every {}: {} sessions, {} RPC/s ({} errors/s, mean {}us), {} commits/s ({} transactions/s, {} pending)",
        duration(n(&j["uptime_ms"])),
        duration(n(&j["interval_ms"])),
        n(&j["sessions_total"]),
        per_sec(&s["rpcs_per_sec"]),
        per_sec(&s["errors_per_sec"]),
        n(&s["mean_latency_us"]),
        per_sec(&j["commits_per_sec"]),
        per_sec(&j["transactions_per_sec"]),
        n(&j["commits_pending"]),
    );
    let _ = writeln!(
        out,
        "grants {}/s read, {}/s write ({} read, {} write held); direct {}/s read, {}/s write; proxied {}/s read, {}/s write",
        per_sec(&s["read_grants_per_sec"]),
        per_sec(&s["write_grants_per_sec"]),
        n(&j["grants_held"]["read"]),
        n(&j["grants_held"]["write"]),
        bytes_per_sec(&s["direct_read_bytes_per_sec"]),
        bytes_per_sec(&s["direct_write_bytes_per_sec"]),
        bytes_per_sec(&s["proxied_read_bytes_per_sec"]),
        bytes_per_sec(&s["proxied_write_bytes_per_sec"]),
    );
    let empty = Vec::new();
    let _ = writeln!(
        out,
        "\n{:<22} {:>9} {:>9} {:>10}",
        "RPC", "PER SEC", "ERRORS/S", "MEAN US"
    );
    for r in j["rpcs"].as_array().unwrap_or(&empty).iter().take(TOP_ROWS) {
        let _ = writeln!(
            out,
            "{:<22} {:>9} {:>9} {:>10}",
            r["rpc"].as_str().unwrap_or(""),
            per_sec(&r["per_sec"]),
            per_sec(&r["errors_per_sec"]),
            n(&r["mean_latency_us"]),
        );
    }
    let _ = writeln!(
        out,
        "\n{:>20}  {:<16} {:>8} {:>8} {:>7} {:>7} {:>11} {:>11} {:>11} {:>11}",
        "SESSION",
        "CLIENT",
        "RPC/S",
        "MEAN US",
        "GRANT/S",
        "HELD",
        "DIRECT R/S",
        "DIRECT W/S",
        "PROXY R/S",
        "PROXY W/S"
    );
    let clients = j["clients"].as_array().unwrap_or(&empty);
    for c in clients.iter().take(TOP_ROWS) {
        let grants = c["read_grants_per_sec"].as_f64().unwrap_or(0.0)
            + c["write_grants_per_sec"].as_f64().unwrap_or(0.0);
        let _ = writeln!(
            out,
            "{:>20}  {:<16} {:>8} {:>8} {:>7} {:>7} {:>11} {:>11} {:>11} {:>11}",
            session_of(&c["session"]),
            c["client_name"].as_str().unwrap_or(""),
            per_sec(&c["rpcs_per_sec"]),
            n(&c["mean_latency_us"]),
            per_sec(&json!(grants)),
            n(&c["grants_held"]),
            bytes_per_sec(&c["direct_read_bytes_per_sec"]),
            bytes_per_sec(&c["direct_write_bytes_per_sec"]),
            bytes_per_sec(&c["proxied_read_bytes_per_sec"]),
            bytes_per_sec(&c["proxied_write_bytes_per_sec"]),
        );
    }
    let more = n(&j["sessions_total"]).saturating_sub(clients.len().min(TOP_ROWS) as u64);
    if more > 0 {
        let _ = writeln!(out, "({more} more sessions not shown)");
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
                {"session": "7", "identity": "unix:uid=0", "client_name": "node-a", "host": "h1",
                 "lease_remaining_ms": 9500, "grants": 2, "open_handles": 1},
                {"session": "9", "identity": "node-b", "client_name": "node-b", "host": "h2",
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

    fn status(
        uptime_ms: u64,
        sessions: Vec<(u64, Activity)>,
        rpcs: &[(&str, u64, u64)],
    ) -> ServerStatus {
        use sanfs_proto::model::{CommitStats, RpcTally, SessionSummary};
        ServerStatus {
            epoch: sanfs_proto::types::SessionEpoch(1),
            fs_uuid: uuid::Uuid::from_u128(1),
            server_version: "t".into(),
            uptime_ms,
            sessions_total: sessions.len() as u64,
            sessions: sessions
                .into_iter()
                .map(|(id, activity)| SessionSummary {
                    session: SessionId(id),
                    client_name: format!("node-{id}"),
                    host: "h".into(),
                    grants: 1,
                    open_handles: 0,
                    lease_remaining_ms: 1000,
                    identity: "unix:uid=0".into(),
                    activity,
                })
                .collect(),
            read_grants: 0,
            write_grants: 1,
            commits: CommitStats::default(),
            rpcs: rpcs
                .iter()
                .map(|(rpc, count, micros)| RpcTally {
                    rpc: (*rpc).into(),
                    count: *count,
                    errors: 0,
                    micros: *micros,
                })
                .collect(),
            activity: Activity::default(),
        }
    }

    #[test]
    fn top_rates_are_growth_over_the_servers_interval_busiest_first() {
        let a = |rpcs, micros, bytes| Activity {
            rpcs,
            rpc_micros: micros,
            granted_write_bytes: bytes,
            ..Activity::default()
        };
        let before = status(
            10_000,
            vec![(1, a(10, 1000, 0)), (2, a(5, 0, 0))],
            &[("MapWrite", 4, 400), ("Lookup", 9, 90)],
        );
        let after = status(
            12_000,
            // Session 2 did nothing; session 3 is new (counted from zero).
            vec![(1, a(30, 5000, 4 << 20)), (2, a(5, 0, 0)), (3, a(8, 80, 0))],
            &[("MapWrite", 10, 1000), ("Lookup", 9, 90), ("Write", 2, 50)],
        );
        let j = top_json(&before, &after, 99.0);
        assert_eq!(j["interval_ms"], 2000, "{j}");
        let rpcs: Vec<(&str, f64, u64)> = j["rpcs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| {
                (
                    r["rpc"].as_str().unwrap(),
                    r["per_sec"].as_f64().unwrap(),
                    r["mean_latency_us"].as_u64().unwrap(),
                )
            })
            .collect();
        // Lookup did not move: not listed.
        assert_eq!(rpcs, [("MapWrite", 3.0, 100), ("Write", 1.0, 25)]);
        let clients: Vec<(u64, f64)> = j["clients"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| {
                (
                    session_of(&c["session"]),
                    c["rpcs_per_sec"].as_f64().unwrap(),
                )
            })
            .collect();
        assert_eq!(clients, [(1, 10.0), (3, 4.0), (2, 0.0)]);
        let c1 = &j["clients"][0];
        assert_eq!(c1["mean_latency_us"], 200, "{c1}");
        assert_eq!(
            c1["direct_write_bytes_per_sec"],
            f64::from(2u32 << 20),
            "{c1}"
        );
        // A server restart between samples (uptime went back): the local interval, and no
        // negative rates.
        let j = top_json(&after, &before, 4.0);
        assert_eq!(j["interval_ms"], 4000, "{j}");
        assert!(j["rpcs"].as_array().unwrap().is_empty(), "{j}");
        let t = top_text(&top_json(&before, &after, 1.0));
        assert!(t.contains("MapWrite") && t.contains("node-3"), "{t}");
        assert!(t.contains("2.0 MiB"), "{t}");
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
