//! The generated services over a real HTTP/2 connection on 127.0.0.1: a server that
//! validates with the model and answers errors through `status`, and the generated client
//! converting back. Proves that the errno survives the transport and that an 8 MiB proxied
//! payload passes with `MAX_MESSAGE_SIZE` configured (tonic's default limit is 4 MiB).

use std::net::SocketAddr;

use sanfs_proto::model::*;
use sanfs_proto::pb;
use sanfs_proto::pb::admin_client::AdminClient;
use sanfs_proto::pb::admin_server::{Admin, AdminServer};
use sanfs_proto::pb::data_client::DataClient;
use sanfs_proto::pb::data_server::{Data, DataServer};
use sanfs_proto::status::{errno_of, field_of, fs_error_from_status};
use sanfs_proto::types::*;
use tonic::transport::{Channel, Server};
use tonic::{Code, Request, Response, Status};

use crate::fixtures::*;

/// An Admin service over a fixed volume; quotas exist on inode 7 only.
struct TestAdmin;

#[tonic::async_trait]
impl Admin for TestAdmin {
    async fn get_volume(
        &self,
        _: Request<pb::GetVolumeRequest>,
    ) -> Result<Response<pb::GetVolumeReply>, Status> {
        Ok(Response::new(
            VolumeInfo {
                fs_uuid: uuid::Uuid::from_u128(0xfeed),
                volume: striped_volume(),
            }
            .into(),
        ))
    }

    async fn server_status(
        &self,
        _: Request<pb::ServerStatusRequest>,
    ) -> Result<Response<pb::ServerStatusReply>, Status> {
        Err(FsError::NotSupported.into())
    }

    async fn set_quota(
        &self,
        request: Request<pb::SetQuotaRequest>,
    ) -> Result<Response<pb::SetQuotaReply>, Status> {
        let r = SetQuotaRequest::try_from(request.into_inner())?;
        if !r.cred.is_root() {
            return Err(FsError::Perm.into());
        }
        Ok(Response::new(
            QuotaInfo {
                inode: r.inode,
                limits: r.limits,
                used_bytes: 0,
                used_inodes: 0,
            }
            .into(),
        ))
    }

    async fn get_quota(
        &self,
        request: Request<pb::GetQuotaRequest>,
    ) -> Result<Response<pb::GetQuotaReply>, Status> {
        let r = InodeRequest::try_from(request.into_inner())?;
        if r.inode != InodeId(7) {
            return Err(FsError::NotFound.into());
        }
        Ok(Response::new(
            QuotaInfo {
                inode: r.inode,
                limits: QuotaLimits::default(),
                used_bytes: 1,
                used_inodes: 1,
            }
            .into(),
        ))
    }

    async fn evict_session(
        &self,
        _: Request<pb::EvictSessionRequest>,
    ) -> Result<Response<pb::EvictSessionReply>, Status> {
        Err(FsError::NotSupported.into())
    }

    async fn grow_volume(
        &self,
        _: Request<pb::GrowVolumeRequest>,
    ) -> Result<Response<pb::GrowVolumeReply>, Status> {
        Err(FsError::NotSupported.into())
    }

    async fn backup_store(
        &self,
        _: Request<pb::BackupStoreRequest>,
    ) -> Result<Response<pb::BackupStoreReply>, Status> {
        Err(FsError::NotSupported.into())
    }

    async fn list_quotas(
        &self,
        _: Request<pb::ListQuotasRequest>,
    ) -> Result<Response<pb::ListQuotasReply>, Status> {
        Err(FsError::NotSupported.into())
    }
}

/// A Data service of which only the proxied path answers (it echoes what it is given);
/// the direct-path calls are outside this test.
struct TestData;

fn not_here() -> Status {
    Status::unimplemented("not part of the loopback test")
}

#[tonic::async_trait]
impl Data for TestData {
    async fn map_read(&self, _: Request<pb::MapRequest>) -> Result<Response<pb::Grant>, Status> {
        Err(not_here())
    }

    async fn map_write(&self, _: Request<pb::MapRequest>) -> Result<Response<pb::Grant>, Status> {
        Err(not_here())
    }

    async fn complete(
        &self,
        _: Request<pb::CompleteRequest>,
    ) -> Result<Response<pb::CompleteReply>, Status> {
        Err(not_here())
    }

    async fn return_grant(
        &self,
        _: Request<pb::ReturnGrantRequest>,
    ) -> Result<Response<pb::ReturnGrantReply>, Status> {
        Err(not_here())
    }

    async fn read(
        &self,
        request: Request<pb::ReadRequest>,
    ) -> Result<Response<pb::ReadReply>, Status> {
        let r = ReadRequest::try_from(request.into_inner())?;
        let len = usize::try_from(r.range.len()).map_err(|_| FsError::FileTooBig)?;
        Ok(Response::new(
            ReadReply {
                data: vec![0x5A; len],
                eof: false,
            }
            .into(),
        ))
    }

    async fn write(
        &self,
        request: Request<pb::WriteRequest>,
    ) -> Result<Response<pb::WriteReply>, Status> {
        let r = WriteRequest::try_from(request.into_inner())?;
        let WritePosition::At(offset) = r.position else {
            return Err(FsError::NotSupported.into());
        };
        let mut a = attr(r.inode.0, FileType::Regular);
        a.size = offset + r.data.len() as u64;
        Ok(Response::new(
            WriteReply {
                written: ByteRange::new(offset, r.data.len() as u64)?,
                attr: a,
                lease_ms: 0,
            }
            .into(),
        ))
    }

    async fn fsync(
        &self,
        _: Request<pb::FsyncRequest>,
    ) -> Result<Response<pb::FsyncReply>, Status> {
        Err(not_here())
    }

    async fn fallocate(
        &self,
        _: Request<pb::FallocateRequest>,
    ) -> Result<Response<pb::FallocateReply>, Status> {
        Err(not_here())
    }

    async fn get_extents(
        &self,
        _: Request<pb::GetExtentsRequest>,
    ) -> Result<Response<pb::GetExtentsReply>, Status> {
        Err(not_here())
    }

    async fn replay_writes(
        &self,
        _: Request<pb::ReplayWritesRequest>,
    ) -> Result<Response<pb::ReplayWritesReply>, Status> {
        Err(not_here())
    }

    async fn delegate(
        &self,
        _: Request<pb::DelegateRequest>,
    ) -> Result<Response<pb::DelegateReply>, Status> {
        Err(not_here())
    }
}

async fn serve() -> (SocketAddr, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
    let server = tokio::spawn(async move {
        Server::builder()
            .add_service(AdminServer::new(TestAdmin))
            .add_service(
                DataServer::new(TestData)
                    .max_decoding_message_size(MAX_MESSAGE_SIZE)
                    .max_encoding_message_size(MAX_MESSAGE_SIZE),
            )
            .serve_with_incoming(incoming)
            .await
            .unwrap();
    });
    (addr, server)
}

async fn channel(addr: SocketAddr) -> Channel {
    Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap()
}

#[tokio::test]
async fn admin_over_http2() {
    let (addr, server) = serve().await;
    let mut admin = AdminClient::new(channel(addr).await);

    let reply = admin.get_volume(pb::GetVolumeRequest {}).await.unwrap();
    let info = VolumeInfo::try_from(reply.into_inner()).unwrap();
    assert_eq!(info.volume, striped_volume());

    let err = admin
        .server_status(pb::ServerStatusRequest {})
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unimplemented);
    assert_eq!(fs_error_from_status(&err), FsError::NotSupported);
    assert_eq!(errno_of(&err), Some(95));

    let get = |inode| InodeRequest {
        cred: cred(),
        inode: InodeId(inode),
    };
    let reply = admin
        .get_quota(pb::GetQuotaRequest::from(get(7)))
        .await
        .unwrap();
    assert_eq!(
        QuotaInfo::try_from(reply.into_inner()).unwrap().used_bytes,
        1
    );
    let err = admin
        .get_quota(pb::GetQuotaRequest::from(get(8)))
        .await
        .unwrap_err();
    assert_eq!(fs_error_from_status(&err), FsError::NotFound);
    assert_eq!(errno_of(&err), Some(2));

    // A malformed request: refused with the field named.
    let err = admin
        .get_quota(pb::GetQuotaRequest {
            cred: None,
            inode: 7,
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert_eq!(field_of(&err), Some("cred"));

    let set = SetQuotaRequest {
        cred: cred(),
        inode: InodeId(7),
        limits: QuotaLimits {
            capacity_bytes: Some(MIB),
            inodes: None,
        },
    };
    let err = admin
        .set_quota(pb::SetQuotaRequest::from(set.clone()))
        .await
        .unwrap_err();
    assert_eq!(fs_error_from_status(&err), FsError::Perm);
    let reply = admin
        .set_quota(pb::SetQuotaRequest::from(SetQuotaRequest {
            cred: Credentials::root(),
            ..set
        }))
        .await
        .unwrap();
    let q = QuotaInfo::try_from(reply.into_inner()).unwrap();
    assert_eq!(q.limits.capacity_bytes, Some(MIB));
    server.abort();
}

#[tokio::test]
async fn eight_mib_proxied_io_passes_with_the_message_size_set() {
    let (addr, server) = serve().await;
    let chan = channel(addr).await;
    let mut data = DataClient::new(chan.clone())
        .max_decoding_message_size(MAX_MESSAGE_SIZE)
        .max_encoding_message_size(MAX_MESSAGE_SIZE);
    let write = WriteRequest {
        cred: cred(),
        handle: handle(),
        inode: InodeId(42),
        position: WritePosition::At(4096),
        data: vec![7; MAX_INLINE_DATA],
        sync: true,
        then: None,
    };
    let reply = data
        .write(pb::WriteRequest::from(write.clone()))
        .await
        .unwrap();
    let reply = WriteReply::try_from(reply.into_inner()).unwrap();
    assert_eq!(reply.written, range(4096, MAX_INLINE_DATA as u64));
    assert_eq!(reply.attr.size, 4096 + MAX_INLINE_DATA as u64);

    let read = ReadRequest {
        cred: cred(),
        handle: handle(),
        inode: InodeId(42),
        range: range(0, MAX_INLINE_DATA as u64),
    };
    let reply = data
        .read(pb::ReadRequest::from(read.clone()))
        .await
        .unwrap();
    let reply = ReadReply::try_from(reply.into_inner()).unwrap();
    assert_eq!(reply.data.len(), MAX_INLINE_DATA);
    assert!(reply.data.iter().all(|&b| b == 0x5A));

    // One byte over the hard cap passes the transport but not the handler's conversion.
    let mut big = pb::WriteRequest::from(write);
    big.data.push(0);
    let err = data.write(big).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert_eq!(field_of(&err), Some("data"));

    // tonic's default 4 MiB limit would refuse the same 8 MiB read reply.
    let mut default_limits = DataClient::new(chan);
    let err = default_limits
        .read(pb::ReadRequest::from(read))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::OutOfRange, "{err:?}");
    server.abort();
}
