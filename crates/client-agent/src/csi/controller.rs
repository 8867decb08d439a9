//! The Controller service: a volume is the directory `ROOT/ID` with a directory quota.
//!
//! - CreateVolume makes the directory (mode/uid/gid from the StorageClass parameters) and
//!   sets its quota; a retry with the same name finds it and answers the same volume when the
//!   capacity and inode limit are compatible, ALREADY_EXISTS otherwise. A directory left
//!   without its quota by an interrupted create is completed by the retry.
//! - DeleteVolume removes the tree below the directory and the directory (its quota goes with
//!   it); a volume that is already gone is success.
//! - ControllerExpandVolume raises the quota (never lowers it); it takes effect at once on
//!   every node, so no node expansion is needed.
//! - ListVolumes pages through the root directory by its stable readdir cookies: the token is
//!   the cookie of the last entry returned, so volumes created between pages are not missed
//!   and deleting the last volume of a page does not invalidate the token.
//! - GetCapacity reports the file system's free space; a volume may not be larger than the
//!   whole file system (OUT_OF_RANGE), quotas may otherwise overcommit it.

use std::sync::Arc;

use sanfs_proto::csi::{
    Capacity, ControllerCapability, ControllerExpandVolumeRequest, ControllerExpanded,
    CreateVolumeRequest, DeleteVolumeRequest, GetCapacityRequest, ListVolumesRequest,
    ValidateVolumeCapabilitiesRequest, Validation, Volume, VolumePage, pb,
};
use sanfs_proto::model::{QuotaLimits, StatFs};
use sanfs_proto::types::{Credentials, FileType, FsError, InodeId, SetAttr};
use tonic::{Request, Response, Status};

use super::volume;
use super::{CsiError, Driver, VolumeOnServer, convert};

/// Most directory levels DeleteVolume descends (deeper trees are refused, not half-deleted
/// in a loop without end).
const MAX_DELETE_DEPTH: usize = 2048;

/// Entries asked for per ReadDir while listing or deleting.
const READDIR_BATCH: u32 = 1024;

pub struct ControllerService {
    driver: Arc<Driver>,
}

impl ControllerService {
    pub fn new(driver: Arc<Driver>) -> ControllerService {
        ControllerService { driver }
    }
}

/// The capabilities of the controller service.
pub fn controller_capabilities() -> Vec<ControllerCapability> {
    vec![
        ControllerCapability::CreateDeleteVolume,
        ControllerCapability::ListVolumes,
        ControllerCapability::GetCapacity,
        ControllerCapability::ExpandVolume,
    ]
}

fn to_volume(v: &VolumeOnServer) -> Volume {
    Volume {
        volume_id: v.name.to_string(),
        capacity_bytes: v.capacity,
        volume_context: Default::default(),
    }
}

impl Driver {
    async fn fs_stats(&self) -> Result<StatFs, CsiError> {
        let client = self.client()?;
        Ok(client
            .statfs(&Credentials::root(), sanfs_proto::types::ROOT_INODE)
            .await?)
    }

    async fn create_volume(&self, req: CreateVolumeRequest) -> Result<Volume, CsiError> {
        volume::check_capabilities(&req.volume_capabilities).map_err(CsiError::Unsupported)?;
        if req.content_source.is_some() {
            return Err(CsiError::Unsupported(
                "sanfs volumes start empty: no snapshot or clone sources".to_owned(),
            ));
        }
        let params = volume::parse_params(&req.parameters).map_err(CsiError::Unsupported)?;
        let fs = self.fs_stats().await?;
        let bs = u64::from(fs.block_size);
        let capacity = volume::capacity_for(
            req.capacity_range.as_ref(),
            self.config.default_capacity,
            bs,
        )
        .map_err(CsiError::OutOfRange)?;
        let fs_bytes = fs.total_blocks.saturating_mul(bs);
        if capacity > fs_bytes {
            return Err(CsiError::OutOfRange(format!(
                "{capacity} bytes is more than the whole file system ({fs_bytes} bytes)"
            )));
        }
        let id = volume::volume_id(&req.name);
        let _guard = self.locks.lock(&id).await;
        if let Some(existing) = self.find_volume(&id).await? {
            let fits = volume::capacity_fits(req.capacity_range.as_ref(), existing.capacity)
                && (params.inodes.is_none() || params.inodes == existing.inode_limit);
            if !fits {
                return Err(CsiError::AlreadyExists(format!(
                    "volume {:?} exists with {} bytes{} (incompatible with this request)",
                    req.name.as_str(),
                    existing.capacity,
                    existing
                        .inode_limit
                        .map(|i| format!(" and {i} inodes"))
                        .unwrap_or_default()
                )));
            }
            return Ok(to_volume(&existing));
        }
        let client = self.client()?;
        let cred = Credentials::root();
        let root = self
            .root_dir(true)
            .await?
            .ok_or_else(|| CsiError::Internal("the volume root vanished".to_owned()))?;
        let dir = volume::directory_of(&id)
            .ok_or_else(|| CsiError::Internal(format!("made an invalid volume id {id:?}")))?;
        let attr = match client.mkdir(&cred, root, dir.as_bytes(), params.mode).await {
            Ok(a) => a,
            // A directory without a quota: an interrupted create (complete it) or something
            // that is not ours (refuse to take it over unless it is empty).
            Err(FsError::Exists) => {
                let a = client.lookup(&cred, root, dir.as_bytes()).await?;
                if a.kind != FileType::Directory || a.size != 0 {
                    return Err(CsiError::AlreadyExists(format!(
                        "{} exists in the file system and is not a sanfs volume",
                        self.volume_path_in_fs(&id)
                    )));
                }
                a
            }
            Err(e) => return Err(e.into()),
        };
        let made = async {
            client
                .setattr(
                    &cred,
                    attr.ino,
                    SetAttr {
                        perm: Some(params.mode),
                        uid: Some(params.uid),
                        gid: Some(params.gid),
                        ..SetAttr::default()
                    },
                    None,
                )
                .await?;
            client
                .set_quota(
                    &cred,
                    attr.ino,
                    QuotaLimits {
                        capacity_bytes: Some(capacity),
                        inodes: params.inodes,
                    },
                )
                .await
        }
        .await;
        match made {
            Ok(q) => {
                tracing::info!(volume = %id, name = req.name.as_str(), capacity, inodes = ?params.inodes, "volume created");
                Ok(Volume {
                    volume_id: id,
                    capacity_bytes: q.limits.capacity_bytes.unwrap_or(capacity),
                    volume_context: Default::default(),
                })
            }
            Err(e) => {
                // Leave nothing half made behind.
                if let Err(e2) = client.rmdir(&cred, root, dir.as_bytes()).await {
                    tracing::warn!(volume = %id, error = %e2, "could not remove the directory of a failed create");
                }
                Err(e.into())
            }
        }
    }

    async fn delete_volume(&self, req: DeleteVolumeRequest) -> Result<(), CsiError> {
        let id = req.volume_id.as_str();
        let _guard = self.locks.lock(id).await;
        let Some(v) = self.find_volume(id).await? else {
            tracing::info!(volume = id, "delete: no such volume (already deleted)");
            return Ok(());
        };
        let client = self.client()?;
        let cred = Credentials::root();
        self.remove_tree(client, &cred, v.ino, 0).await?;
        match client.rmdir(&cred, v.root, v.name.as_bytes()).await {
            Ok(()) | Err(FsError::NotFound) => {}
            Err(e) => return Err(e.into()),
        }
        tracing::info!(volume = id, "volume deleted");
        Ok(())
    }

    /// Removes everything below directory `dir` (depth-first, at most [`MAX_DELETE_DEPTH`]).
    fn remove_tree<'a>(
        &'a self,
        client: &'a crate::client::Client,
        cred: &'a Credentials,
        dir: InodeId,
        depth: usize,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), CsiError>> + Send + 'a>>
    {
        Box::pin(async move {
            if depth > MAX_DELETE_DEPTH {
                return Err(CsiError::FailedPrecondition(format!(
                    "the volume's tree is deeper than {MAX_DELETE_DEPTH} levels"
                )));
            }
            let mut cookie = 0;
            loop {
                let page = client
                    .readdir(cred, dir, cookie, READDIR_BATCH, false)
                    .await?;
                for e in &page.entries {
                    cookie = e.cookie;
                    let r = if e.kind == FileType::Directory {
                        self.remove_tree(client, cred, e.inode, depth + 1).await?;
                        client.rmdir(cred, dir, e.name.as_bytes()).await
                    } else {
                        client.unlink(cred, dir, e.name.as_bytes()).await
                    };
                    match r {
                        Ok(()) | Err(FsError::NotFound) => {}
                        Err(e) => return Err(e.into()),
                    }
                }
                if page.eof || page.entries.is_empty() {
                    return Ok(());
                }
            }
        })
    }

    async fn validate(
        &self,
        req: ValidateVolumeCapabilitiesRequest,
    ) -> Result<Validation, CsiError> {
        if self.find_volume(req.volume_id.as_str()).await?.is_none() {
            return Err(CsiError::NoVolume(req.volume_id.as_str().to_owned()));
        }
        if let Err(why) = volume::check_capabilities(&req.volume_capabilities) {
            return Ok(Validation::NotConfirmed(why));
        }
        if let Err(why) = volume::parse_params(&req.parameters) {
            return Ok(Validation::NotConfirmed(why));
        }
        Ok(Validation::Confirmed {
            volume_context: req.volume_context,
            volume_capabilities: req.volume_capabilities,
            parameters: req.parameters,
        })
    }

    async fn list_volumes(&self, req: ListVolumesRequest) -> Result<VolumePage, CsiError> {
        let mut cookie = match &req.starting_token {
            None => 0,
            Some(t) => t
                .parse::<u64>()
                .ok()
                .filter(|c| *c >= sanfs_proto::model::FIRST_DIR_COOKIE)
                .ok_or_else(|| CsiError::Aborted(format!("invalid starting_token {t:?}")))?,
        };
        let Some(root) = self.root_dir(false).await? else {
            return Ok(VolumePage {
                entries: Vec::new(),
                next_token: None,
            });
        };
        let client = self.client()?;
        let cred = Credentials::root();
        let max = req.max_entries.map_or(usize::MAX, |m| m as usize);
        let mut entries = Vec::new();
        loop {
            let page = client
                .readdir(&cred, root, cookie, READDIR_BATCH, false)
                .await?;
            let n = page.entries.len();
            for (i, e) in page.entries.into_iter().enumerate() {
                cookie = e.cookie;
                if e.kind != FileType::Directory {
                    continue;
                }
                let id = e.name.to_string();
                if volume::directory_of(&id).is_none() {
                    continue;
                }
                let Some(q) = client.get_quota(&cred, e.inode).await? else {
                    continue;
                };
                entries.push(Volume {
                    volume_id: id,
                    capacity_bytes: q.limits.capacity_bytes.unwrap_or(0),
                    volume_context: Default::default(),
                });
                if entries.len() == max {
                    let more = i + 1 < n || !page.eof;
                    return Ok(VolumePage {
                        entries,
                        next_token: more.then(|| cookie.to_string()),
                    });
                }
            }
            if page.eof || n == 0 {
                return Ok(VolumePage {
                    entries,
                    next_token: None,
                });
            }
        }
    }

    async fn get_capacity(&self, req: GetCapacityRequest) -> Result<Capacity, CsiError> {
        volume::parse_params(&req.parameters).map_err(CsiError::Unsupported)?;
        let fs = self.fs_stats().await?;
        let bs = u64::from(fs.block_size);
        if volume::check_capabilities(&req.volume_capabilities).is_err() {
            // No space at all for volumes sanfs cannot make.
            return Ok(Capacity {
                available_bytes: 0,
                maximum_volume_size: None,
            });
        }
        Ok(Capacity {
            available_bytes: fs.avail_blocks.saturating_mul(bs),
            maximum_volume_size: Some(fs.total_blocks.saturating_mul(bs)),
        })
    }

    async fn expand_volume(
        &self,
        req: ControllerExpandVolumeRequest,
    ) -> Result<ControllerExpanded, CsiError> {
        if let Some(cap) = &req.volume_capability {
            volume::check_capability(cap).map_err(CsiError::Unsupported)?;
        }
        let id = req.volume_id.as_str();
        let _guard = self.locks.lock(id).await;
        let v = self
            .find_volume(id)
            .await?
            .ok_or_else(|| CsiError::NoVolume(id.to_owned()))?;
        let done = |capacity_bytes| ControllerExpanded {
            capacity_bytes,
            node_expansion_required: false,
        };
        // Already as large as asked: nothing to do (a quota never shrinks here).
        if req
            .capacity_range
            .required_bytes
            .is_none_or(|r| v.capacity >= r)
        {
            if req
                .capacity_range
                .limit_bytes
                .is_some_and(|l| v.capacity > l)
            {
                return Err(CsiError::OutOfRange(format!(
                    "the volume already has {} bytes, above the limit; volumes do not shrink",
                    v.capacity
                )));
            }
            return Ok(done(v.capacity));
        }
        let fs = self.fs_stats().await?;
        let bs = u64::from(fs.block_size);
        let capacity =
            volume::capacity_for(Some(&req.capacity_range), self.config.default_capacity, bs)
                .map_err(CsiError::OutOfRange)?;
        let fs_bytes = fs.total_blocks.saturating_mul(bs);
        if capacity > fs_bytes {
            return Err(CsiError::OutOfRange(format!(
                "{capacity} bytes is more than the whole file system ({fs_bytes} bytes)"
            )));
        }
        let q = self
            .client()?
            .set_quota(
                &Credentials::root(),
                v.ino,
                QuotaLimits {
                    capacity_bytes: Some(capacity),
                    inodes: v.inode_limit,
                },
            )
            .await?;
        tracing::info!(
            volume = id,
            from = v.capacity,
            to = capacity,
            "volume expanded"
        );
        Ok(done(q.limits.capacity_bytes.unwrap_or(capacity)))
    }
}

#[tonic::async_trait]
impl pb::controller_server::Controller for ControllerService {
    async fn create_volume(
        &self,
        request: Request<pb::CreateVolumeRequest>,
    ) -> Result<Response<pb::CreateVolumeResponse>, Status> {
        let req: CreateVolumeRequest = convert(request.into_inner())?;
        let v = self.driver.create_volume(req).await?;
        Ok(Response::new(v.into()))
    }

    async fn delete_volume(
        &self,
        request: Request<pb::DeleteVolumeRequest>,
    ) -> Result<Response<pb::DeleteVolumeResponse>, Status> {
        let req: DeleteVolumeRequest = convert(request.into_inner())?;
        self.driver.delete_volume(req).await?;
        Ok(Response::new(pb::DeleteVolumeResponse {}))
    }

    async fn validate_volume_capabilities(
        &self,
        request: Request<pb::ValidateVolumeCapabilitiesRequest>,
    ) -> Result<Response<pb::ValidateVolumeCapabilitiesResponse>, Status> {
        let req: ValidateVolumeCapabilitiesRequest = convert(request.into_inner())?;
        Ok(Response::new(self.driver.validate(req).await?.into()))
    }

    async fn list_volumes(
        &self,
        request: Request<pb::ListVolumesRequest>,
    ) -> Result<Response<pb::ListVolumesResponse>, Status> {
        let req: ListVolumesRequest = convert(request.into_inner())?;
        Ok(Response::new(self.driver.list_volumes(req).await?.into()))
    }

    async fn get_capacity(
        &self,
        request: Request<pb::GetCapacityRequest>,
    ) -> Result<Response<pb::GetCapacityResponse>, Status> {
        let req: GetCapacityRequest = convert(request.into_inner())?;
        Ok(Response::new(self.driver.get_capacity(req).await?.into()))
    }

    async fn controller_get_capabilities(
        &self,
        _request: Request<pb::ControllerGetCapabilitiesRequest>,
    ) -> Result<Response<pb::ControllerGetCapabilitiesResponse>, Status> {
        Ok(Response::new(controller_capabilities().into()))
    }

    async fn controller_expand_volume(
        &self,
        request: Request<pb::ControllerExpandVolumeRequest>,
    ) -> Result<Response<pb::ControllerExpandVolumeResponse>, Status> {
        let req: ControllerExpandVolumeRequest = convert(request.into_inner())?;
        Ok(Response::new(self.driver.expand_volume(req).await?.into()))
    }
}
