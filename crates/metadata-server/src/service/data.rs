//! The Data service: fallocate, extents and fsync now; grants (the direct path) and the
//! proxied path come with issue 4 and answer `UNIMPLEMENTED` until then, rather than pretend.

use std::sync::Arc;

use sanfs_blockmap::extent::Extent;
use sanfs_proto::model::{
    ExtentMapping, FallocateMode, FallocateRequest, FsyncRequest, GetExtentsReply,
    GetExtentsRequest, HandleRef, PhysPiece,
};
use sanfs_proto::pb;
use sanfs_proto::pb::data_server::Data;
use sanfs_proto::types::{ByteRange, Credentials, FsError, InodeId};
use tonic::{Request, Response, Status};

use super::{Server, convert, fs_status, grants_not_yet, note, rpc};
use crate::ns::Reader;

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
    /// Checks that `handle` is an open handle of `session` on `inode`, opened for writing
    /// when `write`; answers ESTALE (stale handle) or EBADF-like EACCES otherwise.
    fn check_handle(&self, h: &HandleRef, inode: InodeId, write: bool) -> Result<(), Status> {
        self.check_session(h.session)?;
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
            let attr = t.getattr(bs, req.inode.0)?;
            t.access(&req.cred, req.inode.0, MAY_READ)?;
            Ok((attr, t.extent_list(req.inode.0)?))
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
            drop(request);
            Err(grants_not_yet())
        })
        .await
    }

    async fn map_write(
        &self,
        request: Request<pb::MapRequest>,
    ) -> Result<Response<pb::Grant>, Status> {
        rpc("MapWrite", async {
            drop(request);
            Err(grants_not_yet())
        })
        .await
    }

    async fn complete(
        &self,
        request: Request<pb::CompleteRequest>,
    ) -> Result<Response<pb::CompleteReply>, Status> {
        rpc("Complete", async {
            drop(request);
            Err(grants_not_yet())
        })
        .await
    }

    async fn return_grant(
        &self,
        request: Request<pb::ReturnGrantRequest>,
    ) -> Result<Response<pb::ReturnGrantReply>, Status> {
        rpc("ReturnGrant", async {
            drop(request);
            Err(grants_not_yet())
        })
        .await
    }

    async fn read(
        &self,
        request: Request<pb::ReadRequest>,
    ) -> Result<Response<pb::ReadReply>, Status> {
        rpc("Read", async {
            drop(request);
            Err(grants_not_yet())
        })
        .await
    }

    async fn write(
        &self,
        request: Request<pb::WriteRequest>,
    ) -> Result<Response<pb::WriteReply>, Status> {
        rpc("Write", async {
            drop(request);
            Err(grants_not_yet())
        })
        .await
    }

    async fn fsync(
        &self,
        request: Request<pb::FsyncRequest>,
    ) -> Result<Response<pb::FsyncReply>, Status> {
        rpc("Fsync", async {
            let req: FsyncRequest = convert(request.into_inner())?;
            note(Some(req.handle.session.0), Some(req.inode.0));
            self.server.check_handle(&req.handle, req.inode, false)?;
            // Every metadata change is durable before it is acknowledged, and there are no
            // lazy Unwritten -> Written conversions before grants exist: nothing to flush.
            let bs = self.server.store.block_size();
            self.server.read(|t| t.getattr(bs, req.inode.0))?;
            Ok(pb::FsyncReply {})
        })
        .await
    }

    async fn fallocate(
        &self,
        request: Request<pb::FallocateRequest>,
    ) -> Result<Response<pb::FallocateReply>, Status> {
        rpc("Fallocate", async {
            let req: FallocateRequest = convert(request.into_inner())?;
            note(Some(req.handle.session.0), Some(req.inode.0));
            let keep_size = match req.mode {
                FallocateMode::Allocate => false,
                FallocateMode::AllocateKeepSize => true,
                // Punching and zeroing must recall cached read grants first: with grants.
                FallocateMode::PunchHole
                | FallocateMode::ZeroRange
                | FallocateMode::ZeroRangeKeepSize => {
                    return Err(fs_status(&FsError::NotSupported));
                }
            };
            self.server.check_handle(&req.handle, req.inode, true)?;
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
                        ino,
                        offset,
                        len,
                        keep_size,
                    )
                })
                .await?;
            Ok(attr.into())
        })
        .await
    }

    async fn get_extents(
        &self,
        request: Request<pb::GetExtentsRequest>,
    ) -> Result<Response<pb::GetExtentsReply>, Status> {
        rpc("GetExtents", async {
            let req: GetExtentsRequest = convert(request.into_inner())?;
            note(None, Some(req.inode.0));
            Ok(self.server.extents(&req)?.into())
        })
        .await
    }
}
