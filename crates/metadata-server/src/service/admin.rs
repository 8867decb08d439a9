//! The Admin service: the volume layout agents plan their I/O with, the server's status,
//! directory quotas, evicting a session, growing the volume (`crate::grow`), and an online
//! backup of the metadata store (`Store::backup`).
//!
//! Calls that only an administrator may make (ServerStatus, SetQuota, ListQuotas,
//! EvictSession, GrowVolume, BackupStore) check the
//! caller's transport identity with `NodeIdentity::require_admin` (`service::identity`), the
//! one place that decides who that is.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use sanfs_proto::model::{
    BackupStoreReply, BackupStoreRequest, CommitStats, EvictSessionReply, EvictSessionRequest,
    GrowVolumeReply, GrowVolumeRequest, InodeRequest, MAX_LISTED_QUOTAS, MAX_STATUS_SESSIONS,
    QuotaList, ServerStatus, SessionSummary, SetQuotaRequest, VolumeInfo,
};
use sanfs_proto::pb;
use sanfs_proto::pb::admin_server::Admin;
use sanfs_proto::types::SessionId;
use tonic::{Request, Response, Status};

use super::identity::caller;
use super::{SERVER_VERSION, Server, accept, convert, fs_status, note, rpc};

/// The Admin service over the shared server.
#[derive(Debug, Clone)]
pub struct AdminService {
    server: Arc<Server>,
}

impl AdminService {
    pub fn new(server: Arc<Server>) -> AdminService {
        AdminService { server }
    }
}

impl Server {
    /// The status ServerStatus reports.
    pub fn status(&self) -> ServerStatus {
        let now = self.now_ns();
        let ms_between =
            |from: i64, to: i64| u64::try_from(to.saturating_sub(from) / 1_000_000).unwrap_or(0);
        let started_ns = self
            .started
            .sec
            .saturating_mul(1_000_000_000)
            .saturating_add(i64::from(self.started.nsec));
        let mut open_handles: std::collections::HashMap<u64, u32> =
            std::collections::HashMap::new();
        for f in self.store.handles().by_handle.values() {
            *open_handles.entry(f.session).or_insert(0) += 1;
        }
        let grants = self.grants.per_session();
        let (read_grants, write_grants) = grants.values().fold((0u64, 0u64), |(r, w), g| {
            (r + u64::from(g.0), w + u64::from(g.1))
        });
        let table = self.sessions();
        let sessions_total = table.by_id.len() as u64;
        // The reply is bounded: the first MAX_STATUS_SESSIONS by id (25,000 sessions once made
        // it exceed the message limit).
        let mut ids: Vec<u64> = table.by_id.keys().copied().collect();
        ids.sort_unstable();
        ids.truncate(MAX_STATUS_SESSIONS);
        let sessions: Vec<SessionSummary> = ids
            .iter()
            .filter_map(|id| table.by_id.get(id).map(|s| (id, s)))
            .map(|(id, s)| SessionSummary {
                session: SessionId(*id),
                client_name: s.client_name.clone(),
                host: s.host.clone(),
                grants: grants.get(id).map_or(0, |g| g.0.saturating_add(g.1)),
                open_handles: open_handles.get(id).copied().unwrap_or(0),
                lease_remaining_ms: ms_between(now, s.deadline_ns),
                identity: s.owner.clone(),
                activity: self.activity.session(*id),
            })
            .collect();
        let live: std::collections::HashSet<u64> = table.by_id.keys().copied().collect();
        drop(table);
        self.activity.retain_sessions(|id| live.contains(&id));
        let stats = self.store.stats();
        ServerStatus {
            epoch: self.epoch,
            fs_uuid: self.store.superblock().fs_uuid,
            server_version: SERVER_VERSION.to_owned(),
            uptime_ms: ms_between(started_ns, now),
            sessions,
            sessions_total,
            read_grants,
            write_grants,
            commits: CommitStats {
                transactions: stats.ops.load(Ordering::Relaxed),
                commits: stats.commits.load(Ordering::Relaxed),
                pending: self.pending_writes.load(Ordering::Relaxed),
            },
            rpcs: self.activity.rpcs(),
            activity: self.activity.totals(),
        }
    }
}

#[tonic::async_trait]
impl Admin for AdminService {
    async fn get_volume(
        &self,
        request: Request<pb::GetVolumeRequest>,
    ) -> Result<Response<pb::GetVolumeReply>, Status> {
        rpc("GetVolume", async {
            // The request has no fields: nothing to convert.
            drop(request);
            let info = VolumeInfo {
                fs_uuid: self.server.store.superblock().fs_uuid,
                volume: self.server.store.volume().as_ref().clone(),
            };
            Ok(info.into())
        })
        .await
    }

    async fn server_status(
        &self,
        request: Request<pb::ServerStatusRequest>,
    ) -> Result<Response<pb::ServerStatusReply>, Status> {
        rpc("ServerStatus", async {
            caller(&request)?.require_admin("ServerStatus")?;
            Ok(self.server.status().into())
        })
        .await
    }

    async fn set_quota(
        &self,
        request: Request<pb::SetQuotaRequest>,
    ) -> Result<Response<pb::SetQuotaReply>, Status> {
        rpc("SetQuota", async {
            caller(&request)?.require_admin("SetQuota")?;
            let req: SetQuotaRequest = accept(request)?;
            note(None, Some(req.inode.0));
            // A quota is set on an empty directory only: files an agent created there and
            // has not sent yet come first (and its create delegation goes: creates there
            // may now fail).
            self.server.settle_creates(&[req.inode.0], None).await;
            let info = self
                .server
                .write(move |ctx| crate::quota::set(ctx, &req.cred, req.inode.0, &req.limits))
                .await?;
            Ok(info.into())
        })
        .await
    }

    async fn evict_session(
        &self,
        request: Request<pb::EvictSessionRequest>,
    ) -> Result<Response<pb::EvictSessionReply>, Status> {
        rpc("EvictSession", async {
            caller(&request)?.require_admin("EvictSession")?;
            let req: EvictSessionRequest = convert(request.into_inner())?;
            note(Some(req.session.0), None);
            let why = if req.reason.is_empty() {
                "evicted by an administrator".to_owned()
            } else {
                format!("evicted by an administrator: {}", req.reason)
            };
            let remaining = self
                .server
                .evict_session(req.session.0, &why)
                .ok_or_else(|| fs_status(&sanfs_proto::types::FsError::NotFound))?;
            Ok(EvictSessionReply {
                lease_remaining_ms: remaining,
            }
            .into())
        })
        .await
    }

    async fn grow_volume(
        &self,
        request: Request<pb::GrowVolumeRequest>,
    ) -> Result<Response<pb::GrowVolumeReply>, Status> {
        rpc("GrowVolume", async {
            caller(&request)?.require_admin("GrowVolume")?;
            let req: GrowVolumeRequest = convert(request.into_inner())?;
            let devices = self.server.grants.data_path().devices.clone();
            let now = self.server.clock.now().sec;
            let grown = crate::grow::grow(&self.server.store, &devices, req, now)
                .await
                .map_err(|e| fs_status(&e))?;
            Ok(GrowVolumeReply {
                volume: VolumeInfo {
                    fs_uuid: self.server.store.superblock().fs_uuid,
                    volume: grown.volume.as_ref().clone(),
                },
                old_size_bytes: grown.old_size_bytes,
            }
            .into())
        })
        .await
    }

    async fn backup_store(
        &self,
        request: Request<pb::BackupStoreRequest>,
    ) -> Result<Response<pb::BackupStoreReply>, Status> {
        rpc("BackupStore", async {
            let who = caller(&request)?;
            who.require_admin("BackupStore")?;
            let req: BackupStoreRequest = convert(request.into_inner())?;
            let server = self.server.clone();
            let taken_at = server.clock.now();
            // A copy of the whole store: off the async workers. It reads one snapshot; the
            // committer goes on meanwhile.
            let started = std::time::Instant::now();
            let path = std::path::PathBuf::from(&req.path);
            let done = tokio::task::spawn_blocking(move || {
                server
                    .store
                    .backup(&path, req.force, taken_at, SERVER_VERSION)
            })
            .await
            .map_err(|e| Status::internal(format!("the backup task failed: {e}")))?;
            let elapsed = started.elapsed();
            match done {
                Ok(info) => {
                    crate::metrics::record_backup(Ok(info.record.taken_at.sec), elapsed);
                    tracing::info!(
                        path = %info.path.display(),
                        fs_uuid = %info.record.fs_uuid,
                        epoch = info.record.boot_epoch,
                        commit_seq = info.record.commit_seq,
                        inodes = info.inodes,
                        size_bytes = info.size_bytes,
                        elapsed_ms = elapsed.as_millis() as u64,
                        by = %who.name,
                        "metadata store backed up"
                    );
                    let epoch = sanfs_proto::types::SessionEpoch(info.record.boot_epoch.max(1));
                    Ok(BackupStoreReply {
                        fs_uuid: info.record.fs_uuid,
                        epoch,
                        commit_seq: info.record.commit_seq,
                        taken_at: info.record.taken_at,
                        inodes: info.inodes,
                        size_bytes: info.size_bytes,
                    }
                    .into())
                }
                Err(e) => {
                    crate::metrics::record_backup(Err(()), elapsed);
                    tracing::warn!(path = %req.path, error = %e, "metadata store backup failed");
                    Err(fs_status(&e))
                }
            }
        })
        .await
    }

    async fn list_quotas(
        &self,
        request: Request<pb::ListQuotasRequest>,
    ) -> Result<Response<pb::ListQuotasReply>, Status> {
        rpc("ListQuotas", async {
            caller(&request)?.require_admin("ListQuotas")?;
            let bs = self.server.store.block_size();
            let all = crate::quota::list(&self.server.store).map_err(|e| fs_status(&e))?;
            let quotas_total = all.len() as u64;
            let quotas = all
                .into_iter()
                .take(MAX_LISTED_QUOTAS)
                .map(|(dir, q)| q.info(dir, bs))
                .collect();
            Ok(QuotaList {
                quotas,
                quotas_total,
            }
            .into())
        })
        .await
    }

    async fn get_quota(
        &self,
        request: Request<pb::GetQuotaRequest>,
    ) -> Result<Response<pb::GetQuotaReply>, Status> {
        rpc("GetQuota", async {
            let req: InodeRequest = accept(request)?;
            note(None, Some(req.inode.0));
            let bs = self.server.store.block_size();
            match crate::quota::quota_of(&self.server.store, req.inode.0)
                .map_err(|e| fs_status(&e))?
            {
                Some((dir, q)) if dir == req.inode.0 => Ok(q.info(dir, bs).into()),
                _ => Err(fs_status(&sanfs_proto::types::FsError::NoAttr)),
            }
        })
        .await
    }
}
