//! The Data service: grants (the direct path: MapRead/MapWrite are control info 1 -> 2,
//! Complete is 3 -> 4), the proxied path (Read, Write), fallocate, extents and fsync.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use sanfs_blockmap::extent::Extent;
use sanfs_proto::model::{
    CompleteReply, CompleteRequest, DelegateReply, DelegateRequest, ExtentMapping, FallocateMode,
    FallocateRequest, FsyncRequest, GetExtentsReply, GetExtentsRequest, Grant, HandleRef,
    IoOutcome, LockMode, MapRequest, PhysPiece, ReadReply, ReadRequest, ReplayOutcome,
    ReplayWritesReply, ReplayWritesRequest, ReturnGrantRequest, SetAttrRequest, WritePosition,
    WriteReply, WriteRequest, request_id,
};
use sanfs_proto::pb;
use sanfs_proto::pb::data_server::Data;
use sanfs_proto::types::{ByteRange, Credentials, FsError, GrantId, InodeId, SessionEpoch};
use tonic::{Request, Response, Status};

use super::identity::{NodeIdentity, caller};
use super::{Server, accept, convert, fs_status, note, rpc};
use crate::data::Mapped;
use crate::ns::Reader;
use crate::proxy::{AppendOnce, Position};

/// `access(2)` read bit.
const MAY_READ: u32 = 4;

/// The Data service over the shared server.
#[derive(Debug, Clone)]
pub struct DataService {
    server: Arc<Server>,
}

impl DataService {
    pub fn new(server: Arc<Server>) -> DataService {
        DataService { server }
    }
}

impl Server {
    /// fallocate PUNCH_HOLE and ZERO_RANGE: under an exclusive lock over the range (recalling
    /// cached read grants there, waiting for write grants), the partial blocks at its edges
    /// are zeroed on the LUN through the proxied path, then the whole blocks inside are
    /// unmapped (punch) or turned Unwritten with every hole allocated (zero range) in one
    /// transaction. A zero range that grows the file first zeroes the old end-of-file block's
    /// tail, as an extension does.
    async fn punch_or_zero(
        &self,
        ino: u64,
        range: ByteRange,
        mode: FallocateMode,
        session: u64,
    ) -> Result<sanfs_proto::types::Attr, Status> {
        use crate::proxy::SizeOf;
        let bs = u64::from(self.store.block_size());
        let (offset, len) = (range.offset(), range.len());
        let fs = |e: FsError| fs_status(&e);
        if len == 0 {
            return Err(fs(FsError::Invalid("fallocate of 0 bytes".into())));
        }
        let end = offset
            .checked_add(len)
            .filter(|e| *e <= sanfs_proto::types::MAX_FILE_SIZE)
            .ok_or_else(|| fs(FsError::FileTooBig))?;
        let keep_size = mode != FallocateMode::ZeroRange;
        let old = self.read(|t| t.getattr_size(ino))?;
        let from = (offset / bs * bs).min(if keep_size { u64::MAX } else { old / bs * bs });
        let to = if keep_size {
            end.div_ceil(bs) * bs
        } else {
            u64::MAX
        };
        let _held = self
            .grants
            .exclusive(ino, crate::locks::Span::new(from, to - from), session)
            .await
            .map_err(fs)?;
        let dp = self.grants.data_path();
        // The size may have changed while the lock was awaited: read it under the lock.
        let size = self.read(|t| t.getattr_size(ino))?;
        if !keep_size && end > size {
            dp.zero_eof_tail(ino, size).await.map_err(fs)?;
        }
        let (first_full, end_full) = (offset.div_ceil(bs), end / bs);
        if first_full > end_full {
            dp.zero_in_block(ino, offset, len).await.map_err(fs)?;
        } else {
            if !offset.is_multiple_of(bs) {
                dp.zero_in_block(ino, offset, first_full * bs - offset)
                    .await
                    .map_err(fs)?;
            }
            if !end.is_multiple_of(bs) {
                dp.zero_in_block(ino, end_full * bs, end - end_full * bs)
                    .await
                    .map_err(fs)?;
            }
        }
        match mode {
            FallocateMode::PunchHole => {
                self.write(move |ctx| {
                    crate::space::punch_blocks(ctx, InodeId(ino), first_full, end_full)
                })
                .await
            }
            _ => {
                let attr = self
                    .write(move |ctx| {
                        crate::space::zero_range(ctx, InodeId(ino), offset, end, keep_size)
                    })
                    .await?;
                // Its fresh and converted blocks are zeroed on the LUNs before a write grant
                // can hand them out (still under the lock).
                dp.zero_fresh().await.map_err(fs)?;
                Ok(attr)
            }
        }
    }

    /// Checks that `handle` is an open handle of `session` on `inode`, opened for writing
    /// when `write`; answers ESTALE (stale handle) or EBADF-like EACCES otherwise.
    pub(crate) fn check_handle(
        &self,
        who: &NodeIdentity,
        h: &HandleRef,
        inode: InodeId,
        write: bool,
    ) -> Result<(), Status> {
        self.check_session(who, h.session)?;
        let file = self.store.handles().by_handle.get(&h.handle.0).copied();
        match file {
            Some(f) if f.session == h.session.0 && f.ino == inode.0 => {
                if write && !f.write {
                    Err(fs_status(&FsError::Access))
                } else {
                    Ok(())
                }
            }
            _ => Err(fs_status(&FsError::Stale)),
        }
    }

    fn extents(&self, req: &GetExtentsRequest) -> Result<GetExtentsReply, Status> {
        let bs = self.store.block_size();
        let (attr, extents) = self.read(|t| {
            let attr = t.getattr(bs, req.inode)?;
            t.access(&req.cred, req.inode, MAY_READ)?;
            Ok((attr, t.extent_list(req.inode)?))
        })?;
        let bs64 = u64::from(bs);
        let volume = self.store.volume();
        let mut out = Vec::new();
        for e in extents {
            let mapped = map_extent(&e, bs64, |off, len| {
                volume
                    .map(off, len)
                    .map(|runs| {
                        runs.into_iter()
                            .map(|r| PhysPiece {
                                device: r.device,
                                phys_off: r.phys_off,
                                len: r.len,
                            })
                            .collect()
                    })
                    .map_err(|e| e.to_string())
            })
            .map_err(|why| {
                fs_status(&FsError::Io(format!(
                    "corrupt metadata: extent {e:?} of inode {}: {why}",
                    req.inode.0
                )))
            })?;
            if mapped.file_range.overlaps(&req.range) {
                out.push(mapped);
            }
        }
        Ok(GetExtentsReply {
            extents: out,
            file_size: attr.size,
            block_size: bs,
        })
    }
}

impl Server {
    /// A delegation of `ino` to `session` (epoch `epoch`), or `None`. Other sessions'
    /// attribute leases go first for a write delegation (its holder answers for the size;
    /// none is given while it lives), and the session is recorded first (durably, once per
    /// session): after a restart the reclaim window waits for its agent to reclaim what it
    /// holds back. Only to a session that can hear the recall, and not to one being evicted.
    pub(crate) async fn delegate_to(
        &self,
        session: u64,
        epoch: u64,
        ino: u64,
        write: bool,
    ) -> Option<u64> {
        if !self.has_stream(session) {
            return None;
        }
        self.delegate_as(session, epoch, ino, write).await
    }

    /// [`Server::delegate_to`] without the stream check: for a reclaim in the reclaim
    /// window, whose session attaches its stream only after its reclaim is complete (a
    /// recall sent before is sent again at the attach: [`crate::grants::Grants::attach`]).
    async fn delegate_as(&self, session: u64, epoch: u64, ino: u64, write: bool) -> Option<u64> {
        if write && let Err(e) = self.record_session(session).await {
            tracing::warn!(session, ino, error = %e, "delegation refused: the session could not be recorded");
            return None;
        }
        let _leases = if write {
            Some(self.recall_attr_leases(ino, session).await)
        } else {
            None
        };
        if self.grants.is_fenced(session) {
            return None;
        }
        self.grants.delegate(session, epoch, ino, write)
    }

    /// A write delegation reclaimed in the reclaim window by the agent of `previous` (a
    /// recorded session of the last run that has not completed its reclaim), now under its
    /// new `session`: it held writes back under it when the server stopped, so another
    /// node's first calls after the window must recall it, as before the stop. `None` when
    /// that session may not reclaim (the window is over, or it is not one that waits).
    async fn reclaim_delegation(
        &self,
        session: u64,
        previous: u64,
        epoch: u64,
        ino: u64,
    ) -> Option<u64> {
        if !self.reclaim.authorize(previous) {
            tracing::warn!(
                session,
                previous,
                ino,
                "delegation reclaim refused: that session has nothing to reclaim now (not recorded, done, or the reclaim window is over)"
            );
            return None;
        }
        let delegation = self.delegate_as(session, epoch, ino, true).await;
        metrics::counter!(
            "sanfs_delegation_reclaims_total",
            "outcome" => if delegation.is_some() { "granted" } else { "refused" }
        )
        .increment(1);
        delegation
    }

    /// A grant must name this start's epoch: anything older is from before a restart.
    fn check_grant_epoch(&self, epoch: SessionEpoch) -> Result<(), Status> {
        if epoch == self.epoch {
            Ok(())
        } else {
            Err(fs_status(&FsError::StaleSession))
        }
    }

    /// ReplayWrites (see `crate::reclaim`): every record in one durable commit, after the
    /// LUNs are flushed (what agents wrote before the restart may still sit in their caches;
    /// the data first, then the metadata that makes it readable). Records of a session that
    /// may not replay (not recorded, reclaim completed, window closed) are all refused.
    async fn replay(&self, req: &ReplayWritesRequest) -> Result<Vec<ReplayOutcome>, Status> {
        let previous = req.previous_session.0;
        // A record whose commit survived the stop changes nothing: it is answered `Durable`
        // whoever sends it and whenever (a clean stop makes every lazy completion durable
        // and may leave its session unrecorded, with no window to replay in).
        // A record whose commit survived the stop changes nothing: `Durable` whoever sends
        // it and whenever (a clean stop makes lazy work durable and may leave its session
        // unrecorded, with no window to replay in). Only the others need the window.
        let survived = self.store.survived();
        let durable = |r: &sanfs_proto::model::ReplayRecord| crate::reclaim::survived(survived, r);
        let all_durable = req.records.iter().all(durable);
        if !all_durable && !self.reclaim.authorize(previous) {
            let outcomes: Vec<ReplayOutcome> = req
                .records
                .iter()
                .map(|r| {
                    if durable(r) {
                        ReplayOutcome::Durable
                    } else {
                        ReplayOutcome::Refused
                    }
                })
                .collect();
            tracing::warn!(
                session = req.session.0,
                previous,
                refused = outcomes
                    .iter()
                    .filter(|o| **o == ReplayOutcome::Refused)
                    .count(),
                "replay refused: that session has nothing to reclaim now (not recorded, done, or the reclaim window is over)"
            );
            return Ok(outcomes);
        }
        let mut outcomes = Vec::with_capacity(req.records.len());
        if all_durable {
            outcomes.resize(req.records.len(), ReplayOutcome::Durable);
        } else {
            let volume = self.store.volume_cell();
            let records = req.records.clone();
            // The replayed writes' data is flushed before their conversions are durable.
            let results = self
                .write_data(move |ctx| {
                    records
                        .iter()
                        .map(|r| crate::reclaim::replay_write(ctx, &volume.get(), survived, r))
                        .collect::<Result<Vec<_>, _>>()
                })
                .await?;
            for (record, (outcome, why)) in req.records.iter().zip(results) {
                match outcome {
                    ReplayOutcome::Refused => tracing::error!(
                        session = req.session.0,
                        inode = record.inode.0,
                        offset = record.range.offset(),
                        len = record.range.len(),
                        reason = why.as_deref().unwrap_or(""),
                        "replay of a lazy completion refused: that write is lost"
                    ),
                    _ => tracing::debug!(inode = record.inode.0, ?outcome, "replayed"),
                }
                outcomes.push(outcome);
            }
        }
        if req.reclaim_complete {
            // Replayed namespace changes are lazy commits: durable before the window may end.
            self.store.sync().await.map_err(|e| fs_status(&e))?;
            tracing::info!(session = req.session.0, previous, "reclaim complete");
            self.reclaim.complete(previous);
        }
        Ok(outcomes)
    }

    /// Whether the session has a stream attached (and so can be recalled).
    pub(crate) fn has_stream(&self, session: u64) -> bool {
        self.sessions()
            .by_id
            .get(&session)
            .is_some_and(|s| s.stream.is_some())
    }
}

/// The wire grant for a mapped range (control info 2).
fn grant_reply(
    id: u64,
    req: &MapRequest,
    mapped: Mapped,
    mode: LockMode,
    cacheable: bool,
) -> Result<Grant, Status> {
    let range = ByteRange::new(mapped.offset, mapped.len)
        .map_err(|e| fs_status(&FsError::Invalid(e.to_string())))?;
    Ok(Grant {
        grant_id: GrantId(id),
        epoch: req.epoch,
        inode: req.inode,
        range,
        mode,
        device_ios: mapped.plan.device_ios,
        zero_fill: mapped.plan.zero_fill,
        file_size: mapped.file_size,
        cacheable,
    })
}

/// One extent record in bytes with its physical pieces; an error if it does not fit.
fn map_extent(
    e: &Extent,
    block_size: u64,
    map: impl FnOnce(u64, u64) -> Result<Vec<PhysPiece>, String>,
) -> Result<ExtentMapping, String> {
    let file_off = e
        .file_block
        .checked_mul(block_size)
        .ok_or("file offset overflows")?;
    let len = e
        .len_blocks
        .checked_mul(block_size)
        .ok_or("length overflows")?;
    let vol_off = e
        .vol_block
        .checked_mul(block_size)
        .ok_or("volume offset overflows")?;
    let file_range = ByteRange::new(file_off, len).map_err(|e| e.to_string())?;
    Ok(ExtentMapping {
        file_range,
        vol_off,
        state: e.state,
        pieces: map(vol_off, len)?,
    })
}

#[tonic::async_trait]
impl Data for DataService {
    async fn map_read(
        &self,
        request: Request<pb::MapRequest>,
    ) -> Result<Response<pb::Grant>, Status> {
        rpc("MapRead", async {
            let who = caller(&request)?;
            let req: MapRequest = accept(request)?;
            self.server.wait_reclaim().await;
            note(Some(req.handle.session.0), Some(req.inode.0));
            self.server.check_grant_epoch(req.epoch)?;
            self.server
                .check_handle(&who, &req.handle, req.inode, false)?;
            // A read grant may be cached when its session can hear a recall.
            let cacheable = self.server.has_stream(req.handle.session.0);
            let (id, mapped) = self
                .server
                .grants
                .map_read(
                    req.handle.session,
                    req.epoch,
                    req.inode,
                    req.range.offset(),
                    req.range.len(),
                    cacheable,
                )
                .await
                .map_err(|e| fs_status(&e))?;
            // What it saw of other sessions' namespace changes is durable first.
            self.server.barrier(Some(req.handle.session)).await?;
            Ok(grant_reply(id, &req, mapped, LockMode::Shared, cacheable)?.into())
        })
        .await
    }

    async fn map_write(
        &self,
        request: Request<pb::MapRequest>,
    ) -> Result<Response<pb::Grant>, Status> {
        rpc("MapWrite", async {
            let who = caller(&request)?;
            let req: MapRequest = accept(request)?;
            self.server.wait_reclaim().await;
            note(Some(req.handle.session.0), Some(req.inode.0));
            self.server.check_grant_epoch(req.epoch)?;
            self.server
                .check_handle(&who, &req.handle, req.inode, true)?;
            // A write layout only for a session that can hear its recall.
            let layout = req.layout && self.server.has_stream(req.handle.session.0);
            // Other sessions' attribute leases go before the grant is out (none is given
            // while it lives: its writes change the size until completed).
            let _leases = self
                .server
                .recall_attr_leases(req.inode.0, req.handle.session.0)
                .await;
            let grants = &self.server.grants;
            let (session, epoch, ino) = (req.handle.session, req.epoch, req.inode);
            let range = (req.range.offset(), req.range.len());
            let (id, mapped) = if layout && req.ahead {
                grants
                    .map_layout_ahead(session, epoch, ino, range, req.cred.is_root())
                    .await
            } else {
                grants
                    .map_write(
                        session,
                        epoch,
                        ino,
                        range.0,
                        range.1,
                        req.cred.is_root(),
                        layout,
                    )
                    .await
            }
            .map_err(|e| fs_status(&e))?;
            self.server.barrier(Some(req.handle.session)).await?;
            Ok(grant_reply(id, &req, mapped, LockMode::Exclusive, layout)?.into())
        })
        .await
    }

    async fn complete(
        &self,
        request: Request<pb::CompleteRequest>,
    ) -> Result<Response<pb::CompleteReply>, Status> {
        rpc("Complete", async {
            let who = caller(&request)?;
            let req: CompleteRequest = convert(request.into_inner())?;
            note(Some(req.session.0), None);
            self.server.check_session(&who, req.session)?;
            if let IoOutcome::DeviceErrors(errors) = &req.outcome {
                for e in errors {
                    tracing::warn!(
                        session = req.session.0,
                        grant = req.grant_id.0,
                        device = e.device.0,
                        phys_off = e.phys_off,
                        len = e.len,
                        errno = e.errno,
                        "device I/O failed on the direct path"
                    );
                }
            }
            let grants = &self.server.grants;
            let (session, epoch, id) = (req.session.0, req.epoch.0, req.grant_id.0);
            let (attr, commit_seq) = match req.keep_at {
                Some(at) => {
                    let parts: Vec<(u64, u64)> = std::iter::once((at, req.bytes_done))
                        .chain(req.more.iter().map(|p| (p.offset(), p.len())))
                        .collect();
                    grants
                        .complete_parts_numbered(session, epoch, id, &parts, req.sync)
                        .await
                }
                None => {
                    grants
                        .complete_numbered(session, epoch, id, req.bytes_done, req.sync)
                        .await
                }
            }
            .map_err(|e| fs_status(&e.to_fs()))?;
            if commit_seq > 0 {
                self.server.record_session(session).await?;
            }
            self.server.barrier(Some(req.session)).await?;
            Ok(CompleteReply {
                attr,
                commit_seq,
                durable_seq: self.server.store.durable_seq(),
            }
            .into())
        })
        .await
    }

    async fn return_grant(
        &self,
        request: Request<pb::ReturnGrantRequest>,
    ) -> Result<Response<pb::ReturnGrantReply>, Status> {
        rpc("ReturnGrant", async {
            let who = caller(&request)?;
            let req: ReturnGrantRequest = convert(request.into_inner())?;
            note(Some(req.session.0), None);
            self.server.check_session(&who, req.session)?;
            let ids: Vec<u64> = req.grant_ids.iter().map(|g| g.0).collect();
            self.server
                .grants
                .return_grants(req.session.0, req.epoch.0, &ids)
                .await
                .map_err(|e| fs_status(&e.to_fs()))?;
            Ok(pb::ReturnGrantReply {})
        })
        .await
    }

    async fn read(
        &self,
        request: Request<pb::ReadRequest>,
    ) -> Result<Response<pb::ReadReply>, Status> {
        rpc("Read", async {
            let who = caller(&request)?;
            let req: ReadRequest = accept(request)?;
            self.server.wait_reclaim().await;
            note(Some(req.handle.session.0), Some(req.inode.0));
            self.server
                .check_handle(&who, &req.handle, req.inode, false)?;
            let (data, eof) = self
                .server
                .grants
                .data_path()
                .read(
                    req.inode.0,
                    req.range.offset(),
                    req.range.len(),
                    req.handle.session.0,
                )
                .await
                .map_err(|e| fs_status(&e))?;
            self.server
                .grants
                .stats
                .proxied_read_bytes
                .fetch_add(data.len() as u64, Ordering::Relaxed);
            crate::activity::add_proxied(false, data.len() as u64);
            self.server.barrier(Some(req.handle.session)).await?;
            Ok(ReadReply { data, eof }.into())
        })
        .await
    }

    async fn write(
        &self,
        request: Request<pb::WriteRequest>,
    ) -> Result<Response<pb::WriteReply>, Status> {
        rpc("Write", async {
            let who = caller(&request)?;
            let mut request = request;
            let id = request_id(request.get_mut().request_id.take()).map_err(Status::from)?;
            let req: WriteRequest = accept(request)?;
            self.server.wait_reclaim().await;
            note(Some(req.handle.session.0), Some(req.inode.0));
            self.server
                .check_handle(&who, &req.handle, req.inode, true)?;
            let len = req.data.len() as u64;
            let then = req.then.map(|changes| SetAttrRequest {
                cred: req.cred.clone(),
                inode: req.inode,
                changes,
                handle: None,
            });
            if then.is_some() {
                // As a SetAttr: writes of other nodes that returned before it are in first
                // (none sets the mtime after it).
                self.server
                    .grants
                    .settle_others(req.inode.0, req.handle.session.0)
                    .await;
            }
            let leases = self
                .server
                .recall_attr_leases(req.inode.0, req.handle.session.0)
                .await;
            let pos = match req.position {
                WritePosition::At(off) => Position::At(off),
                WritePosition::Append => Position::Append(id.map(|id| AppendOnce {
                    id,
                    session: req.handle.session.0,
                })),
            };
            let (off, attr) = self
                .server
                .grants
                .data_path()
                .write(
                    req.inode.0,
                    pos,
                    req.data,
                    req.cred.is_root(),
                    req.handle.session.0,
                    then,
                )
                .await
                .map_err(|e| fs_status(&e))?;
            self.server
                .grants
                .stats
                .proxied_write_bytes
                .fetch_add(len, Ordering::Relaxed);
            crate::activity::add_proxied(true, len);
            let written = ByteRange::new(off, len)
                .map_err(|e| fs_status(&FsError::Invalid(e.to_string())))?;
            self.server.barrier(Some(req.handle.session)).await?;
            // The attributes after the write, leased to the writer's agent (its next stat asks
            // nothing).
            let since = leases.end();
            let (attr, lease_ms) =
                self.server
                    .lease_changed_attr(Some(req.handle.session.0), req.inode, since, attr);
            Ok(WriteReply {
                written,
                attr,
                lease_ms,
            }
            .into())
        })
        .await
    }

    async fn fsync(
        &self,
        request: Request<pb::FsyncRequest>,
    ) -> Result<Response<pb::FsyncReply>, Status> {
        rpc("Fsync", async {
            let who = caller(&request)?;
            let req: FsyncRequest = accept(request)?;
            note(Some(req.handle.session.0), Some(req.inode.0));
            self.server
                .check_handle(&who, &req.handle, req.inode, false)?;
            // The lazy commits (Unwritten -> Written conversions of Complete without sync,
            // namespace changes made under a session) become durable here, all of them.
            // What the server wrote on the proxied path may sit in the LUNs' write caches:
            // flush them. The agent flushes the LUNs it wrote itself.
            self.server.read(|t| t.inode(req.inode))?;
            // The data first (the LUNs' write caches are flushed: also what the server wrote
            // in place on the proxied path), then the metadata that makes it readable: lazy
            // conversions of completed direct and proxied writes become durable here. A
            // crash between the two leaves blocks Unwritten (zeros), never Written over data
            // still in a cache.
            self.server
                .store
                .sync_data()
                .await
                .map_err(|e| fs_status(&e))?;
            Ok(pb::FsyncReply {})
        })
        .await
    }

    async fn fallocate(
        &self,
        request: Request<pb::FallocateRequest>,
    ) -> Result<Response<pb::FallocateReply>, Status> {
        rpc("Fallocate", async {
            let who = caller(&request)?;
            let req: FallocateRequest = accept(request)?;
            self.server.wait_reclaim().await;
            note(Some(req.handle.session.0), Some(req.inode.0));
            self.server
                .check_handle(&who, &req.handle, req.inode, true)?;
            let _leases = self
                .server
                .recall_attr_leases(req.inode.0, req.handle.session.0)
                .await;
            let keep_size = match req.mode {
                FallocateMode::Allocate => false,
                FallocateMode::AllocateKeepSize => true,
                FallocateMode::PunchHole
                | FallocateMode::ZeroRange
                | FallocateMode::ZeroRangeKeepSize => {
                    self.server
                        .check_handle(&who, &req.handle, req.inode, true)?;
                    let attr = self
                        .server
                        .punch_or_zero(req.inode.0, req.range, req.mode, req.handle.session.0)
                        .await?;
                    return Ok(attr.into());
                }
            };
            self.server
                .check_handle(&who, &req.handle, req.inode, true)?;
            // An allocation that grows the file is a size change like a truncate up: under
            // the size-change lock (recalling cached read grants past the old end), with the
            // old end-of-file block's tail zeroed on the LUN first, so that bytes a shrinking
            // truncate left there read as zeros and not as the old data.
            use crate::proxy::SizeOf;
            let end = req.range.offset().saturating_add(req.range.len());
            let grows = !keep_size
                && self
                    .server
                    .store
                    .read(|t| t.getattr_size(req.inode.0))
                    .is_ok_and(|size| end > size);
            let _guard = if grows {
                self.server
                    .size_change_guard(req.inode.0, end, req.handle.session.0)
                    .await?
            } else {
                None
            };
            // The handle's open mode decides, not the file's current mode (POSIX: a file
            // opened for writing stays writable after chmod 0444): the handle was checked
            // above, so the allocation itself runs with root's permission bypass.
            let ino = req.inode.0;
            let (offset, len) = (req.range.offset(), req.range.len());
            let attr = self
                .server
                .write(move |ctx| {
                    crate::ns::allocate_range(
                        ctx,
                        &Credentials::root(),
                        InodeId(ino),
                        offset,
                        len,
                        keep_size,
                    )
                })
                .await?;
            // The new blocks are zeroed on the LUNs now rather than by the next grant there.
            self.server
                .grants
                .data_path()
                .zero_fresh()
                .await
                .map_err(|e| fs_status(&e))?;
            Ok(attr.into())
        })
        .await
    }

    async fn get_extents(
        &self,
        request: Request<pb::GetExtentsRequest>,
    ) -> Result<Response<pb::GetExtentsReply>, Status> {
        rpc("GetExtents", async {
            self.server.wait_reclaim().await;
            let req: GetExtentsRequest = accept(request)?;
            note(None, Some(req.inode.0));
            Ok(self.server.extents(&req)?.into())
        })
        .await
    }

    async fn replay_writes(
        &self,
        request: Request<pb::ReplayWritesRequest>,
    ) -> Result<Response<pb::ReplayWritesReply>, Status> {
        rpc("ReplayWrites", async {
            let who = caller(&request)?;
            let req: ReplayWritesRequest = convert(request.into_inner())?;
            note(Some(req.session.0), None);
            self.server.check_session(&who, req.session)?;
            self.server.check_grant_epoch(req.epoch)?;
            let outcomes = self.server.replay(&req).await?;
            Ok(ReplayWritesReply { outcomes }.into())
        })
        .await
    }

    async fn delegate(
        &self,
        request: Request<pb::DelegateRequest>,
    ) -> Result<Response<pb::DelegateReply>, Status> {
        rpc("Delegate", async {
            let who = caller(&request)?;
            let req: DelegateRequest = convert(request.into_inner())?;
            // A reclaim is made in the window (before the agent says its reclaim is
            // complete); anything else waits for the window's end, as new grants do.
            if req.reclaim_of.is_none() {
                self.server.wait_reclaim().await;
            }
            let session = req.handle.session.0;
            note(Some(session), Some(req.inode.0));
            self.server.check_grant_epoch(req.epoch)?;
            self.server
                .check_handle(&who, &req.handle, req.inode, req.write)?;
            let (epoch, ino) = (req.epoch.0, req.inode.0);
            let delegation = match req.reclaim_of {
                Some(previous) => {
                    self.server
                        .reclaim_delegation(session, previous.0, epoch, ino)
                        .await
                }
                None => {
                    self.server
                        .delegate_to(session, epoch, ino, req.write)
                        .await
                }
            };
            tracing::debug!(
                session,
                inode = ino,
                write = req.write,
                reclaim_of = ?req.reclaim_of,
                ?delegation,
                "delegate"
            );
            Ok(DelegateReply {
                delegation: delegation.map(GrantId),
            }
            .into())
        })
        .await
    }
}
