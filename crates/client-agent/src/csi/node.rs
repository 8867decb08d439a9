//! The Node service: stage (one `sanfs-agent mount` of the volume's directory per volume per
//! node), publish (a bind mount of the staging path into the pod's target path, read-only when
//! asked), the reverse of both, volume stats from the quota, and node expansion (nothing to do:
//! the quota is in force everywhere as soon as the controller raises it).
//!
//! Every path in a request is resolved once, on arrival, to its canonical form (symbolic links
//! followed, as the kernel records mount points), and only that form is used afterwards.
//! Every call is idempotent and looks at the mount table rather than at remembered state, so
//! a restarted driver finds what an earlier run set up. A staging mount whose agent died
//! (`ENOTCONN`) is mounted afresh when the volume is staged or published again; bind mounts
//! made from the dead one stay dead until their pods start again (see docs/kubernetes.md).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sanfs_proto::csi::{
    NodeCapability, NodeExpandVolumeRequest, NodeExpanded, NodeGetVolumeStatsRequest, NodeInfo,
    NodePublishVolumeRequest, NodeStageVolumeRequest, NodeUnpublishVolumeRequest,
    NodeUnstageVolumeRequest, Usage, VolumeStats, pb,
};
use sanfs_proto::types::Credentials;
use tonic::{Request, Response, Status};

use super::mounts::{self, MountEntry, PathState};
use super::volume;
use super::{CsiError, Driver, VolumeOnServer, convert, io_error};

/// Longest a stat or mount-table look may take (a hung FUSE mount must not hang the driver).
const BLOCKING_TIMEOUT: Duration = Duration::from_secs(30);

/// Most mounts one unpublish or unstage takes off a path (stacked mounts).
const MAX_STACKED_MOUNTS: usize = 8;

pub struct NodeService {
    driver: Arc<Driver>,
}

impl NodeService {
    pub fn new(driver: Arc<Driver>) -> NodeService {
        NodeService { driver }
    }
}

/// The capabilities of the node service.
pub fn node_capabilities() -> Vec<NodeCapability> {
    vec![
        NodeCapability::StageUnstageVolume,
        NodeCapability::GetVolumeStats,
        NodeCapability::ExpandVolume,
    ]
}

/// Runs blocking mount-table or file-system work off the runtime, bounded in time.
async fn blocking<T: Send + 'static>(
    what: &'static str,
    f: impl FnOnce() -> std::io::Result<T> + Send + 'static,
) -> Result<T, CsiError> {
    match tokio::time::timeout(BLOCKING_TIMEOUT, tokio::task::spawn_blocking(f)).await {
        Ok(Ok(r)) => r.map_err(|e| io_error(what, e)),
        Ok(Err(e)) => Err(io_error(what, e)),
        Err(_) => Err(CsiError::Internal(format!(
            "{what}: no answer within {BLOCKING_TIMEOUT:?}"
        ))),
    }
}

/// The mount at `path` and what `stat` says of it.
async fn look(path: &Path) -> Result<(Option<MountEntry>, PathState), CsiError> {
    let p = path.to_owned();
    blocking("read the mount table", move || {
        let m = mounts::mount_at(&p)?;
        Ok((m, mounts::path_state(&p)))
    })
    .await
}

/// `path` as the mount table names it, every symbolic link resolved
/// ([`mounts::canonical`]): each node call resolves its paths once, here, and then uses only
/// the result (to mount, to find its mounts in mountinfo and to unmount).
async fn canonical(path: &Path) -> Result<PathBuf, CsiError> {
    let p = path.to_owned();
    blocking("resolve the path", move || mounts::canonical(&p)).await
}

impl Driver {
    async fn stage(&self, req: NodeStageVolumeRequest) -> Result<(), CsiError> {
        volume::check_capability(&req.volume_capability).map_err(CsiError::Unsupported)?;
        let id = req.volume_id.as_str();
        let _guard = self.locks.lock(id).await;
        if self.find_volume(id).await?.is_none() {
            return Err(CsiError::NoVolume(id.to_owned()));
        }
        let read_only = req.volume_capability.access_mode.is_read_only();
        let staging = canonical(req.staging_target_path.as_path()).await?;
        self.ensure_staged(id, &staging, read_only).await
    }

    /// Makes sure the volume's agent mount is live at `staging` (mounting it, or mounting it
    /// again over a dead one).
    async fn ensure_staged(
        &self,
        id: &str,
        staging: &Path,
        read_only: bool,
    ) -> Result<(), CsiError> {
        let (entry, state) = look(staging).await?;
        match entry {
            Some(m) if self.is_volume_mount(&m, id) => {
                if state != PathState::Dead {
                    return Ok(());
                }
                tracing::warn!(volume = id, staging = %staging.display(), "staging mount is dead (agent gone): mounting it again");
                let p = staging.to_owned();
                blocking("detach the dead staging mount", move || {
                    mounts::unmount(&p, true)
                })
                .await?;
            }
            Some(m) => {
                return Err(CsiError::AlreadyExists(format!(
                    "{} already has a mount of {} ({})",
                    staging.display(),
                    m.source,
                    m.fs_type
                )));
            }
            None => {}
        }
        match look(staging).await?.1 {
            PathState::Directory => {}
            PathState::Missing => {
                let p = staging.to_owned();
                blocking("create the staging directory", move || {
                    std::fs::create_dir_all(&p)
                })
                .await?;
            }
            PathState::Other | PathState::Dead => {
                return Err(CsiError::FailedPrecondition(format!(
                    "staging path {} is not a usable directory",
                    staging.display()
                )));
            }
        }
        self.run_agent(id, staging, read_only).await
    }

    /// Starts `sanfs-agent mount --foreground` for volume `id` at `staging` and waits until the
    /// mount is there (or the agent failed, or [`super::Config::mount_timeout`] passed).
    async fn run_agent(&self, id: &str, staging: &Path, read_only: bool) -> Result<(), CsiError> {
        let c = &self.config;
        let mut opts = vec![
            "allow_other".to_owned(),
            format!(
                "client_name={}",
                format!("csi:{}:{id}", c.node_id)
                    .chars()
                    .filter(|ch| *ch != ',')
                    .take(200)
                    .collect::<String>()
            ),
        ];
        if read_only {
            opts.push("ro".to_owned());
        }
        if !c.devices.is_empty() {
            opts.push(format!("devices={}", c.devices.join(":")));
        }
        if let Some(tls) = &c.tls {
            opts.push(format!("tls_ca={}", tls.ca.display()));
            opts.push(format!("tls_cert={}", tls.cert.display()));
            opts.push(format!("tls_key={}", tls.key.display()));
            if let Some(d) = &tls.domain {
                opts.push(format!("tls_domain={d}"));
            }
        }
        opts.extend(c.agent_options.iter().cloned());
        let mut cmd = tokio::process::Command::new(&c.agent_path);
        cmd.arg("mount")
            .arg(self.mount_source(id))
            .arg(staging)
            .arg("--foreground")
            .arg("-o")
            .arg(opts.join(","))
            .stdin(std::process::Stdio::null())
            // Its own process group: a signal to the driver's group does not take mounts down.
            .process_group(0)
            .kill_on_drop(false);
        let mut child = cmd
            .spawn()
            .map_err(|e| io_error(&format!("start {}", c.agent_path.display()), e))?;
        let pid = child.id().unwrap_or(0);
        let deadline = Instant::now() + c.mount_timeout;
        let result = loop {
            if let (Some(m), _) = look(staging).await?
                && self.is_volume_mount(&m, id)
            {
                break Ok(());
            }
            match child.try_wait() {
                Ok(Some(status)) => {
                    break Err(CsiError::Internal(format!(
                        "the agent for volume {id} exited before mounting it: {status} (see the driver's log)"
                    )));
                }
                Ok(None) => {}
                Err(e) => break Err(io_error("wait for the agent", e)),
            }
            if Instant::now() >= deadline {
                let _ = child.start_kill();
                // Had it mounted after all, its mount would be left dead: take it off.
                let _ = tokio::time::timeout(Duration::from_secs(5), child.wait()).await;
                if let Ok((Some(m), _)) = look(staging).await
                    && self.is_volume_mount(&m, id)
                {
                    let p = staging.to_owned();
                    let _ = blocking("detach the killed agent's mount", move || {
                        mounts::unmount(&p, true)
                    })
                    .await;
                }
                break Err(CsiError::Internal(format!(
                    "the agent for volume {id} did not mount it within {:?}",
                    c.mount_timeout
                )));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        if result.is_ok() {
            tracing::info!(volume = id, staging = %staging.display(), agent_pid = pid, "volume staged");
        }
        // Reap the agent whenever it ends (after its unmount).
        let staging = staging.to_owned();
        let id = id.to_owned();
        tokio::spawn(async move {
            match child.wait().await {
                Ok(status) => {
                    tracing::info!(volume = %id, staging = %staging.display(), agent_pid = pid, %status, "agent exited")
                }
                Err(e) => {
                    tracing::warn!(volume = %id, agent_pid = pid, error = %e, "waiting for the agent failed")
                }
            }
        });
        result
    }

    async fn unstage(&self, req: NodeUnstageVolumeRequest) -> Result<(), CsiError> {
        let id = req.volume_id.as_str();
        let _guard = self.locks.lock(id).await;
        let staging = canonical(req.staging_target_path.as_path()).await?;
        let staging = staging.as_path();
        self.take_down(id, staging).await?;
        tracing::info!(volume = id, staging = %staging.display(), "volume unstaged");
        Ok(())
    }

    /// Unmounts every sanfs mount of volume `id` stacked at `path`; refuses to touch a mount
    /// of anything else (another volume's, another FUSE file system's, any other), whatever
    /// `id` is: only a mount whose type and source say it is this volume's is ours.
    async fn take_down(&self, id: &str, path: &Path) -> Result<(), CsiError> {
        for _ in 0..MAX_STACKED_MOUNTS {
            let (entry, state) = look(path).await?;
            match entry {
                None => return Ok(()),
                Some(m) if self.is_volume_mount(&m, id) => {
                    let p = path.to_owned();
                    let dead = state == PathState::Dead;
                    blocking("unmount", move || mounts::unmount(&p, dead)).await?;
                }
                Some(m) => {
                    return Err(CsiError::FailedPrecondition(format!(
                        "{} holds a {} mount of {}, not one of volume {id}: left as it is",
                        path.display(),
                        m.fs_type,
                        m.source
                    )));
                }
            }
        }
        Err(CsiError::Internal(format!(
            "{} still has mounts after {MAX_STACKED_MOUNTS} unmounts",
            path.display()
        )))
    }

    async fn publish(&self, req: NodePublishVolumeRequest) -> Result<(), CsiError> {
        volume::check_capability(&req.volume_capability).map_err(CsiError::Unsupported)?;
        let flags = match &req.volume_capability.access_type {
            sanfs_proto::csi::AccessType::Mount(m) => {
                volume::mount_options(&m.mount_flags).map_err(CsiError::Unsupported)?
            }
            sanfs_proto::csi::AccessType::Block => {
                return Err(CsiError::Unsupported(
                    "block access is not supported".to_owned(),
                ));
            }
        };
        let staging = req.staging_target_path.as_ref().ok_or_else(|| {
            CsiError::FailedPrecondition(
                "staging_target_path is not set: this driver stages volumes (STAGE_UNSTAGE_VOLUME)"
                    .to_owned(),
            )
        })?;
        let id = req.volume_id.as_str();
        let _guard = self.locks.lock(id).await;
        if self.find_volume(id).await?.is_none() {
            return Err(CsiError::NoVolume(id.to_owned()));
        }
        let staging = canonical(staging.as_path()).await?;
        let staging = staging.as_path();
        match look(staging).await? {
            (Some(m), state) if self.is_volume_mount(&m, id) => {
                if state == PathState::Dead {
                    self.ensure_staged(id, staging, m.is_read_only()).await?;
                }
            }
            _ => {
                return Err(CsiError::FailedPrecondition(format!(
                    "volume {id} is not staged at {}",
                    staging.display()
                )));
            }
        }
        let mut options = flags;
        options.read_only |= req.readonly || req.volume_capability.access_mode.is_read_only();
        let target = canonical(req.target_path.as_path()).await?;
        let target = target.as_path();
        let (entry, state) = look(target).await?;
        match entry {
            Some(m) if self.is_volume_mount(&m, id) && state != PathState::Dead => {
                if m.is_read_only() == options.read_only {
                    return Ok(());
                }
                return Err(CsiError::AlreadyExists(format!(
                    "volume {id} is published at {} {}",
                    target.display(),
                    if m.is_read_only() {
                        "read-only"
                    } else {
                        "read-write"
                    }
                )));
            }
            Some(m) if self.is_volume_mount(&m, id) => {
                let t = target.to_owned();
                blocking("detach a dead publish mount", move || {
                    mounts::unmount(&t, true)
                })
                .await?;
            }
            Some(m) => {
                return Err(CsiError::AlreadyExists(format!(
                    "{} already has a mount of {} ({})",
                    target.display(),
                    m.source,
                    m.fs_type
                )));
            }
            None => {}
        }
        let (src, dst) = (staging.to_owned(), target.to_owned());
        blocking("bind-mount the volume", move || {
            match mounts::path_state(&dst) {
                PathState::Missing => std::fs::create_dir(&dst)?,
                PathState::Directory => {}
                PathState::Other | PathState::Dead => {
                    return Err(std::io::Error::other(format!(
                        "target path {} is not a directory",
                        dst.display()
                    )));
                }
            }
            mounts::bind(&src, &dst, options)
        })
        .await?;
        tracing::info!(volume = id, target = %target.display(), read_only = options.read_only, "volume published");
        Ok(())
    }

    async fn unpublish(&self, req: NodeUnpublishVolumeRequest) -> Result<(), CsiError> {
        let id = req.volume_id.as_str();
        let _guard = self.locks.lock(id).await;
        let target = canonical(req.target_path.as_path()).await?;
        let target = target.as_path();
        self.take_down(id, target).await?;
        // The specification: the plugin removes what it made at the target path.
        let t = target.to_owned();
        let removed = blocking(
            "remove the target directory",
            move || match std::fs::remove_dir(&t) {
                Ok(()) => Ok(true),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
                Err(e) => Err(e),
            },
        )
        .await;
        match removed {
            Ok(_) => {
                tracing::info!(volume = id, target = %target.display(), "volume unpublished");
                Ok(())
            }
            Err(e) => Err(CsiError::FailedPrecondition(format!(
                "unmounted, but {} is left: {e}",
                target.display()
            ))),
        }
    }

    /// The volume, and a check that `path` is a live mount of it (NOT_FOUND otherwise).
    async fn mounted_volume(&self, id: &str, path: &Path) -> Result<VolumeOnServer, CsiError> {
        let v = self
            .find_volume(id)
            .await?
            .ok_or_else(|| CsiError::NoVolume(id.to_owned()))?;
        let not_here =
            || CsiError::NotFound(format!("volume {id} is not mounted at {}", path.display()));
        if !path.is_absolute() {
            return Err(not_here());
        }
        let path = canonical(path).await?;
        let path = path.as_path();
        match look(path).await? {
            (Some(m), PathState::Dead) if self.is_volume_mount(&m, id) => {
                Err(CsiError::FailedPrecondition(format!(
                    "the agent serving volume {id} at {} is gone (ENOTCONN)",
                    path.display()
                )))
            }
            (Some(m), _) if self.is_volume_mount(&m, id) => Ok(v),
            _ => Err(not_here()),
        }
    }

    async fn volume_stats(&self, req: NodeGetVolumeStatsRequest) -> Result<VolumeStats, CsiError> {
        let id = req.volume_id.as_str();
        let v = self.mounted_volume(id, req.volume_path.as_path()).await?;
        let st = self.client()?.statfs(&Credentials::root(), v.ino).await?;
        let bs = u64::from(st.block_size);
        Ok(VolumeStats {
            bytes: Usage {
                total: v.capacity,
                used: v.used_bytes,
                available: v
                    .capacity
                    .saturating_sub(v.used_bytes)
                    .min(st.avail_blocks.saturating_mul(bs)),
            },
            inodes: Usage {
                total: v.inode_limit.unwrap_or(st.total_inodes),
                used: v.used_inodes,
                available: st.free_inodes,
            },
        })
    }

    async fn node_expand(&self, req: NodeExpandVolumeRequest) -> Result<NodeExpanded, CsiError> {
        if let Some(cap) = &req.volume_capability {
            volume::check_capability(cap).map_err(CsiError::Unsupported)?;
        }
        let id = req.volume_id.as_str();
        let v = self.mounted_volume(id, req.volume_path.as_path()).await?;
        if let Some(required) = req.capacity_range.and_then(|r| r.required_bytes)
            && required > v.capacity
        {
            return Err(CsiError::OutOfRange(format!(
                "the volume's quota is {} bytes: ControllerExpandVolume grows it (a node cannot)",
                v.capacity
            )));
        }
        Ok(NodeExpanded {
            capacity_bytes: v.capacity,
        })
    }
}

#[tonic::async_trait]
impl pb::node_server::Node for NodeService {
    async fn node_stage_volume(
        &self,
        request: Request<pb::NodeStageVolumeRequest>,
    ) -> Result<Response<pb::NodeStageVolumeResponse>, Status> {
        let req: NodeStageVolumeRequest = convert(request.into_inner())?;
        self.driver.stage(req).await?;
        Ok(Response::new(pb::NodeStageVolumeResponse {}))
    }

    async fn node_unstage_volume(
        &self,
        request: Request<pb::NodeUnstageVolumeRequest>,
    ) -> Result<Response<pb::NodeUnstageVolumeResponse>, Status> {
        let req: NodeUnstageVolumeRequest = convert(request.into_inner())?;
        self.driver.unstage(req).await?;
        Ok(Response::new(pb::NodeUnstageVolumeResponse {}))
    }

    async fn node_publish_volume(
        &self,
        request: Request<pb::NodePublishVolumeRequest>,
    ) -> Result<Response<pb::NodePublishVolumeResponse>, Status> {
        let req: NodePublishVolumeRequest = convert(request.into_inner())?;
        self.driver.publish(req).await?;
        Ok(Response::new(pb::NodePublishVolumeResponse {}))
    }

    async fn node_unpublish_volume(
        &self,
        request: Request<pb::NodeUnpublishVolumeRequest>,
    ) -> Result<Response<pb::NodeUnpublishVolumeResponse>, Status> {
        let req: NodeUnpublishVolumeRequest = convert(request.into_inner())?;
        self.driver.unpublish(req).await?;
        Ok(Response::new(pb::NodeUnpublishVolumeResponse {}))
    }

    async fn node_get_volume_stats(
        &self,
        request: Request<pb::NodeGetVolumeStatsRequest>,
    ) -> Result<Response<pb::NodeGetVolumeStatsResponse>, Status> {
        let req: NodeGetVolumeStatsRequest = convert(request.into_inner())?;
        Ok(Response::new(self.driver.volume_stats(req).await?.into()))
    }

    async fn node_expand_volume(
        &self,
        request: Request<pb::NodeExpandVolumeRequest>,
    ) -> Result<Response<pb::NodeExpandVolumeResponse>, Status> {
        let req: NodeExpandVolumeRequest = convert(request.into_inner())?;
        Ok(Response::new(self.driver.node_expand(req).await?.into()))
    }

    async fn node_get_capabilities(
        &self,
        _request: Request<pb::NodeGetCapabilitiesRequest>,
    ) -> Result<Response<pb::NodeGetCapabilitiesResponse>, Status> {
        Ok(Response::new(node_capabilities().into()))
    }

    async fn node_get_info(
        &self,
        _request: Request<pb::NodeGetInfoRequest>,
    ) -> Result<Response<pb::NodeGetInfoResponse>, Status> {
        let info = NodeInfo::new(self.driver.config.node_id.clone(), 0)
            .map_err(|e| sanfs_proto::csi::invalid_argument(&e))?;
        Ok(Response::new(info.into()))
    }
}
