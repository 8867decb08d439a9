//! The five services through `serve` over real gRPC connections: the namespace round trip,
//! refusals of bad input, sessions and lease expiry, TLS, metrics, stop and fail-stop.

use std::time::Duration;

use sanfs_mds::clock::Clock;
use sanfs_mds::store::Backend;
use sanfs_mds::store::backend::{FaultPlan, SimDisk};
use sanfs_proto::pb;
use sanfs_proto::status::{errno_of, field_of};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tonic::Code;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};

use crate::harness::{Clients, ca, leaf, root, rw, start, start_with, write_server_tls};

const ROOT: u64 = 1;

async fn mkdir(c: &mut Clients, parent: u64, name: &str) -> pb::Attr {
    c.ns.mkdir(pb::MkdirRequest {
        cred: root(),
        parent,
        name: name.into(),
        perm: 0o755,
        delegate: false,
        request_id: None,
    })
    .await
    .unwrap()
    .into_inner()
    .attr
    .unwrap()
}

async fn create(c: &mut Clients, session: u64, parent: u64, name: &str) -> (pb::Attr, u64) {
    let r =
        c.ns.create(pb::CreateRequest {
            delegate: false,
            inode: 0,
            time: None,
            cred: root(),
            session,
            parent,
            name: name.into(),
            perm: 0o644,
            exclusive: true,
            flags: rw(),
            request_id: None,
        })
        .await
        .unwrap()
        .into_inner();
    (r.attr.unwrap(), r.handle)
}

async fn getattr(c: &mut Clients, inode: u64) -> Result<pb::Attr, tonic::Status> {
    c.ns.get_attr(pb::GetAttrRequest {
        cred: root(),
        inode,
        session: None,
    })
    .await
    .map(|r| r.into_inner().attr.unwrap())
}

async fn lookup(c: &mut Clients, parent: u64, name: &str) -> Result<pb::Attr, tonic::Status> {
    c.ns.lookup(pb::LookupRequest {
        session: None,
        cred: root(),
        parent,
        name: name.into(),
    })
    .await
    .map(|r| r.into_inner().attr.unwrap())
}

/// Every entry of a directory, read `page` entries at a time by cookie.
async fn list(c: &mut Clients, dir: u64, page: u32) -> Vec<(String, u64)> {
    let mut out = Vec::new();
    let mut cookie = 0;
    loop {
        let r =
            c.ns.read_dir(pb::ReadDirRequest {
                session: None,
                cred: root(),
                inode: dir,
                cookie,
                max_entries: page,
                plus: false,
            })
            .await
            .unwrap()
            .into_inner();
        assert!(r.entries.len() <= page as usize);
        for e in &r.entries {
            assert!(e.cookie >= 3, "cookies 0 to 2 are not the server's");
            out.push((String::from_utf8(e.name.clone()).unwrap(), e.inode));
            cookie = e.cookie;
        }
        if r.eof {
            return out;
        }
        assert!(!r.entries.is_empty(), "no progress without eof");
    }
}

async fn statfs(c: &mut Clients) -> pb::StatFsReply {
    c.ns.stat_fs(pb::StatFsRequest {
        cred: root(),
        inode: ROOT,
    })
    .await
    .unwrap()
    .into_inner()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn namespace_round_trip() {
    let srv = start().await;
    let mut c = srv.clients().await;
    let (session, _epoch) = c.open_session().await;

    let d = mkdir(&mut c, ROOT, "d").await;
    assert_eq!(d.kind, pb::FileType::Directory as i32);
    let mut handles = Vec::new();
    for i in 0..10 {
        let (a, h) = create(&mut c, session, d.ino, &format!("f{i}")).await;
        assert_eq!(a.kind, pb::FileType::Regular as i32);
        assert_ne!(h, 0);
        handles.push(h);
    }

    // Attributes: chmod and truncate.
    let f0 = lookup(&mut c, d.ino, "f0").await.unwrap();
    let a =
        c.ns.set_attr(pb::SetAttrRequest {
            cred: root(),
            inode: f0.ino,
            changes: Some(pb::SetAttrChanges {
                perm: Some(0o600),
                size: Some(12345),
                ..Default::default()
            }),
            handle: None,
            session: None,
        })
        .await
        .unwrap()
        .into_inner()
        .attr
        .unwrap();
    assert_eq!((a.perm, a.size), (0o600, 12345));
    assert_eq!(getattr(&mut c, f0.ino).await.unwrap().size, 12345);

    // Paginated listing: every entry once, in a stable order, whatever the page size.
    let all = list(&mut c, d.ino, 4096).await;
    assert_eq!(all.len(), 10);
    assert_eq!(list(&mut c, d.ino, 3).await, all);
    assert_eq!(list(&mut c, d.ino, 1).await, all);

    // Rename, unlink, link.
    c.ns.rename(pb::RenameRequest {
        cred: root(),
        old_parent: d.ino,
        old_name: b"f0".to_vec(),
        new_parent: ROOT,
        new_name: b"g0".to_vec(),
        mode: pb::RenameMode::Noreplace as i32,
        request_id: None,
    })
    .await
    .unwrap();
    assert_eq!(lookup(&mut c, ROOT, "g0").await.unwrap().ino, f0.ino);
    assert_eq!(
        lookup(&mut c, d.ino, "f0").await.unwrap_err().code(),
        Code::NotFound
    );
    let linked =
        c.ns.link(pb::LinkRequest {
            cred: root(),
            inode: f0.ino,
            new_parent: d.ino,
            new_name: b"hard".to_vec(),
            request_id: None,
        })
        .await
        .unwrap()
        .into_inner()
        .attr
        .unwrap();
    assert_eq!(linked.nlink, 2);
    c.ns.unlink(pb::UnlinkRequest {
        cred: root(),
        parent: ROOT,
        name: b"g0".to_vec(),
        request_id: None,
    })
    .await
    .unwrap();
    assert_eq!(getattr(&mut c, f0.ino).await.unwrap().nlink, 1);

    // Symlinks.
    let s =
        c.ns.symlink(pb::SymlinkRequest {
            cred: root(),
            parent: d.ino,
            name: b"s".to_vec(),
            target: b"../elsewhere/x".to_vec(),
            request_id: None,
        })
        .await
        .unwrap()
        .into_inner()
        .attr
        .unwrap();
    let t =
        c.ns.readlink(pb::ReadlinkRequest {
            cred: root(),
            inode: s.ino,
        })
        .await
        .unwrap()
        .into_inner()
        .target;
    assert_eq!(t, b"../elsewhere/x");
    let not_link =
        c.ns.readlink(pb::ReadlinkRequest {
            cred: root(),
            inode: d.ino,
        })
        .await
        .unwrap_err();
    assert_eq!(errno_of(&not_link), Some(22));

    // Xattrs.
    c.ns.set_xattr(pb::SetXattrRequest {
        cred: root(),
        inode: d.ino,
        name: b"user.colour".to_vec(),
        value: b"blue".to_vec(),
        mode: pb::XattrMode::Create as i32,
    })
    .await
    .unwrap();
    let v =
        c.ns.get_xattr(pb::GetXattrRequest {
            cred: root(),
            inode: d.ino,
            name: b"user.colour".to_vec(),
        })
        .await
        .unwrap()
        .into_inner()
        .value;
    assert_eq!(v, b"blue");
    let names =
        c.ns.list_xattr(pb::ListXattrRequest {
            cred: root(),
            inode: d.ino,
        })
        .await
        .unwrap()
        .into_inner()
        .names;
    assert_eq!(names, vec![b"user.colour".to_vec()]);
    c.ns.remove_xattr(pb::RemoveXattrRequest {
        cred: root(),
        inode: d.ino,
        name: b"user.colour".to_vec(),
    })
    .await
    .unwrap();
    let gone =
        c.ns.get_xattr(pb::GetXattrRequest {
            cred: root(),
            inode: d.ino,
            name: b"user.colour".to_vec(),
        })
        .await
        .unwrap_err();
    assert_eq!(errno_of(&gone), Some(61));

    // Access, mknod, open/release, rmdir of a non-empty directory.
    c.ns.access(pb::AccessRequest {
        cred: Some(pb::Credentials {
            uid: 1000,
            gid: 1000,
            groups: vec![],
        }),
        inode: d.ino,
        mask: 5,
    })
    .await
    .unwrap();
    let denied =
        c.ns.access(pb::AccessRequest {
            cred: Some(pb::Credentials {
                uid: 1000,
                gid: 1000,
                groups: vec![],
            }),
            inode: d.ino,
            mask: 2,
        })
        .await
        .unwrap_err();
    assert_eq!(denied.code(), Code::PermissionDenied);
    c.ns.mknod(pb::MknodRequest {
        cred: root(),
        parent: d.ino,
        name: b"fifo".to_vec(),
        kind: pb::FileType::Fifo as i32,
        perm: 0o600,
        rdev: 0,
        request_id: None,
    })
    .await
    .unwrap();
    let f1 = lookup(&mut c, d.ino, "f1").await.unwrap();
    let opened =
        c.ns.open(pb::OpenRequest {
            cred: root(),
            session,
            inode: f1.ino,
            flags: Some(pb::OpenFlags {
                read: true,
                write: true,
                append: false,
                truncate: true,
            }),
            read_small: 0,
        })
        .await
        .unwrap()
        .into_inner();
    handles.push(opened.handle);
    for h in handles {
        c.ns.release(pb::ReleaseRequest { session, handle: h })
            .await
            .unwrap();
    }
    let twice =
        c.ns.release(pb::ReleaseRequest {
            session,
            handle: opened.handle,
        })
        .await
        .unwrap_err();
    assert_eq!(errno_of(&twice), Some(116), "a released handle is stale");
    let not_empty =
        c.ns.rmdir(pb::RmdirRequest {
            cred: root(),
            parent: ROOT,
            name: b"d".to_vec(),
            request_id: None,
        })
        .await
        .unwrap_err();
    assert_eq!(errno_of(&not_empty), Some(39));

    // Statfs, volume and status.
    let st = statfs(&mut c).await;
    assert_eq!(st.block_size, 4096);
    // 4 LUNs of 64 MiB in 4 KiB blocks, less what labels and metadata keep.
    assert!(st.total_blocks > 0 && st.total_blocks <= 4 * 64 * 1024 * 1024 / 4096);
    assert!(st.free_blocks <= st.total_blocks && st.free_blocks > 0);
    assert!(st.total_inodes > st.free_inodes);
    assert_eq!(st.name_max, 255);
    let vol = c
        .admin
        .get_volume(pb::GetVolumeRequest {})
        .await
        .unwrap()
        .into_inner();
    let vol = sanfs_proto::model::VolumeInfo::try_from(vol).unwrap();
    assert_eq!(vol.volume, crate::support::volume());
    let status = c
        .admin
        .server_status(pb::ServerStatusRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(status.sessions.len(), 1);
    assert_eq!(status.sessions[0].session, session);
    let commits = status.commits.unwrap();
    assert!(commits.transactions >= 15 && commits.commits >= 1);

    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_invalid_argument_and_changes_nothing() {
    let srv = start().await;
    let mut c = srv.clients().await;
    let (session, _) = c.open_session().await;
    let (file, handle) = create(&mut c, session, ROOT, "file").await;
    let before = list(&mut c, ROOT, 100).await;
    let stat_before = statfs(&mut c).await;

    let e = getattr(&mut c, 0).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    assert_eq!(field_of(&e), Some("inode"));

    for bad in [b"a/b".to_vec(), vec![b'x'; 256], vec![], b"..".to_vec()] {
        let e =
            c.ns.mkdir(pb::MkdirRequest {
                cred: root(),
                parent: ROOT,
                name: bad.clone(),
                perm: 0o755,
                delegate: false,
                request_id: None,
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{bad:?}");
        assert_eq!(field_of(&e), Some("name"));
    }
    let long =
        c.ns.create(pb::CreateRequest {
            delegate: false,
            inode: 0,
            time: None,
            cred: root(),
            session,
            parent: ROOT,
            name: vec![b'y'; 256],
            perm: 0o644,
            exclusive: true,
            flags: rw(),
            request_id: None,
        })
        .await
        .unwrap_err();
    assert_eq!(long.code(), Code::InvalidArgument);
    assert_eq!(errno_of(&long), Some(36), "ENAMETOOLONG");

    let missing_cred =
        c.ns.mkdir(pb::MkdirRequest {
            cred: None,
            parent: ROOT,
            name: b"ok".to_vec(),
            perm: 0o755,
            delegate: false,
            request_id: None,
        })
        .await
        .unwrap_err();
    assert_eq!(missing_cred.code(), Code::InvalidArgument);

    let overflow = c
        .data
        .fallocate(pb::FallocateRequest {
            cred: root(),
            session,
            handle,
            inode: file.ino,
            offset: u64::MAX - 10,
            length: 100,
            mode: pb::FallocateMode::Allocate as i32,
        })
        .await
        .unwrap_err();
    assert_eq!(overflow.code(), Code::InvalidArgument);
    let unspecified = c
        .data
        .fallocate(pb::FallocateRequest {
            cred: root(),
            session,
            handle,
            inode: file.ino,
            offset: 0,
            length: 4096,
            mode: 0,
        })
        .await
        .unwrap_err();
    assert_eq!(unspecified.code(), Code::InvalidArgument);
    let rename =
        c.ns.rename(pb::RenameRequest {
            cred: root(),
            old_parent: ROOT,
            old_name: b"file".to_vec(),
            new_parent: ROOT,
            new_name: b"x/y".to_vec(),
            mode: pb::RenameMode::Replace as i32,
            request_id: None,
        })
        .await
        .unwrap_err();
    assert_eq!(rename.code(), Code::InvalidArgument);

    assert_eq!(list(&mut c, ROOT, 100).await, before);
    let stat_after = statfs(&mut c).await;
    assert_eq!(stat_after.free_blocks, stat_before.free_blocks);
    assert_eq!(
        stat_after.total_inodes - stat_after.free_inodes,
        stat_before.total_inodes - stat_before.free_inodes
    );
    assert_eq!(getattr(&mut c, file.ino).await.unwrap().size, 0);
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_inode_or_session_is_refused() {
    let srv = start().await;
    let mut c = srv.clients().await;
    assert_eq!(
        getattr(&mut c, 999_999).await.unwrap_err().code(),
        Code::NotFound
    );
    let e =
        c.ns.read_dir(pb::ReadDirRequest {
            session: None,
            cred: root(),
            inode: 424_242,
            cookie: 0,
            max_entries: 10,
            plus: true,
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    assert_eq!(
        lookup(&mut c, ROOT, "nothing").await.unwrap_err().code(),
        Code::NotFound
    );
    // A session that was never opened cannot own handles.
    let stale =
        c.ns.create(pb::CreateRequest {
            delegate: false,
            inode: 0,
            time: None,
            cred: root(),
            session: 77,
            parent: ROOT,
            name: b"f".to_vec(),
            perm: 0o644,
            exclusive: true,
            flags: rw(),
            request_id: None,
        })
        .await
        .unwrap_err();
    assert_eq!(stale.code(), Code::FailedPrecondition);
    assert_eq!(errno_of(&stale), Some(116));
    assert_eq!(
        lookup(&mut c, ROOT, "f").await.unwrap_err().code(),
        Code::NotFound
    );
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grants_work_without_luns_and_proxied_io_names_the_missing_lun() {
    // This server has a volume but none of its LUNs: grants need no device on the server,
    // the proxied path does and fails with EIO; hole punching is not built yet.
    let srv = start().await;
    let mut c = srv.clients().await;
    let (session, epoch) = c.open_session().await;
    let (file, handle) = create(&mut c, session, ROOT, "f").await;
    let map = pb::MapRequest {
        cred: root(),
        session,
        epoch,
        handle,
        inode: file.ino,
        offset: 0,
        length: 1 << 20,
        sync: false,
        ..Default::default()
    };
    // Control info 1 -> 2: a write grant on 4 stripes of 64 KiB is one I/O per LUN.
    let grant = c.data.map_write(map.clone()).await.unwrap().into_inner();
    assert_eq!(grant.device_ios.len(), 4, "{grant:?}");
    assert_eq!(grant.length, 1 << 20);
    // ServerStatus counts the live grant, for its session and in all.
    let grants = |st: pb::ServerStatusReply| {
        let s = st.sessions.iter().find(|s| s.session == session).unwrap();
        (s.grants, st.read_grants, st.write_grants)
    };
    let status = c.admin.server_status(pb::ServerStatusRequest {}).await;
    assert_eq!(grants(status.unwrap().into_inner()), (1, 0, 1));
    // A grant of an old epoch is refused.
    let stale = c
        .data
        .map_write(pb::MapRequest {
            epoch: epoch + 1,
            ..map.clone()
        })
        .await
        .unwrap_err();
    assert_ne!(stale.code(), Code::Ok);
    // Control info 3 -> 4.
    let reply = c
        .data
        .complete(pb::CompleteRequest {
            session,
            epoch,
            grant_id: grant.grant_id,
            status: pb::IoStatus::Ok as i32,
            errors: vec![],
            bytes_done: 1 << 20,
            sync: false,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(reply.attr.unwrap().size, 1 << 20);
    let status = c.admin.server_status(pb::ServerStatusRequest {}).await;
    assert_eq!(
        grants(status.unwrap().into_inner()),
        (0, 0, 0),
        "completed: gone"
    );
    // Twice: refused.
    let twice = c
        .data
        .complete(pb::CompleteRequest {
            session,
            epoch,
            grant_id: grant.grant_id,
            status: pb::IoStatus::Ok as i32,
            errors: vec![],
            bytes_done: 1 << 20,
            sync: false,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_ne!(twice.code(), Code::Ok);
    // A read grant now plans device reads.
    let rg = c.data.map_read(map).await.unwrap().into_inner();
    assert_eq!(rg.device_ios.len(), 4);
    c.data
        .return_grant(pb::ReturnGrantRequest {
            session,
            epoch,
            grant_ids: vec![rg.grant_id],
        })
        .await
        .unwrap();
    // The proxied path needs the LUNs on the server.
    let read = c
        .data
        .read(pb::ReadRequest {
            cred: root(),
            session,
            handle,
            inode: file.ino,
            offset: 0,
            length: 10,
        })
        .await
        .unwrap_err();
    assert_eq!(read.code(), Code::Internal, "{read:?}");
    assert!(
        read.message().contains("not available on the server"),
        "{read:?}"
    );
    // Punching whole blocks is metadata only; a partial block of written data must be zeroed
    // on the LUN, which this server cannot reach: refused, and nothing changes.
    let punch = |offset, length| pb::FallocateRequest {
        cred: root(),
        session,
        handle,
        inode: file.ino,
        offset,
        length,
        mode: pb::FallocateMode::PunchHole as i32,
    };
    let allocated = getattr(&mut c, file.ino).await.unwrap().allocated;
    let attr = c
        .data
        .fallocate(punch(0, 4096))
        .await
        .unwrap()
        .into_inner()
        .attr
        .unwrap();
    assert_eq!((attr.size, attr.allocated), (1 << 20, allocated - 4096));
    let partial = c.data.fallocate(punch(8192, 100)).await.unwrap_err();
    assert_eq!(partial.code(), Code::Internal, "{partial:?}");
    let after = getattr(&mut c, file.ino).await.unwrap();
    assert_eq!(after.allocated, allocated - 4096);
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fallocate_extents_and_fsync() {
    let srv = start().await;
    let mut c = srv.clients().await;
    let (session, _) = c.open_session().await;
    let (file, handle) = create(&mut c, session, ROOT, "big").await;
    let attr = c
        .data
        .fallocate(pb::FallocateRequest {
            cred: root(),
            session,
            handle,
            inode: file.ino,
            offset: 0,
            length: 1 << 20,
            mode: pb::FallocateMode::Allocate as i32,
        })
        .await
        .unwrap()
        .into_inner()
        .attr
        .unwrap();
    assert_eq!(attr.size, 1 << 20);
    assert_eq!(attr.allocated, 1 << 20);
    let ext = c
        .data
        .get_extents(pb::GetExtentsRequest {
            cred: root(),
            inode: file.ino,
            offset: 0,
            length: 1 << 20,
        })
        .await
        .unwrap()
        .into_inner();
    let ext = sanfs_proto::model::GetExtentsReply::try_from(ext).unwrap();
    assert_eq!(ext.file_size, 1 << 20);
    assert_eq!(ext.block_size, 4096);
    let total: u64 = ext.extents.iter().map(|e| e.file_range.len()).sum();
    assert_eq!(total, 1 << 20);
    for e in &ext.extents {
        assert_eq!(e.state, sanfs_proto::model::ExtentState::Unwritten);
        assert_eq!(
            e.pieces.iter().map(|p| p.len).sum::<u64>(),
            e.file_range.len()
        );
    }
    // The 64 KiB stripe unit over 4 LUNs: a 1 MiB range touches every LUN.
    let mut devices: Vec<u32> = ext
        .extents
        .iter()
        .flat_map(|e| e.pieces.iter().map(|p| p.device.0))
        .collect();
    devices.sort_unstable();
    devices.dedup();
    assert_eq!(devices, vec![0, 1, 2, 3]);

    c.data
        .fsync(pb::FsyncRequest {
            cred: root(),
            session,
            handle,
            inode: file.ino,
            data_only: false,
        })
        .await
        .unwrap();
    let wrong = c
        .data
        .fsync(pb::FsyncRequest {
            cred: root(),
            session,
            handle: handle + 1000,
            inode: file.ino,
            data_only: true,
        })
        .await
        .unwrap_err();
    assert_eq!(errno_of(&wrong), Some(116));
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_stream_answers_heartbeats() {
    let srv = start().await;
    let mut c = srv.clients().await;
    let (session, epoch) = c.open_session().await;
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tx.send(pb::SessionStreamRequest {
        event: Some(pb::session_stream_request::Event::Attach(pb::Attach {
            session,
            epoch,
        })),
    })
    .await
    .unwrap();
    let mut replies = c
        .session
        .session_stream(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    for seq in 1..=3 {
        tx.send(pb::SessionStreamRequest {
            event: Some(pb::session_stream_request::Event::Heartbeat(
                pb::Heartbeat { seq, renew: None },
            )),
        })
        .await
        .unwrap();
        let r = replies.message().await.unwrap().unwrap();
        match r.event {
            Some(pb::session_stream_reply::Event::HeartbeatAck(a)) => {
                assert_eq!(a.seq, seq);
                assert_eq!(a.lease_ttl_ms, 10_000);
            }
            other => panic!("expected an ack, got {other:?}"),
        }
    }

    // A stream that does not start with attach is refused.
    let (tx2, rx2) = tokio::sync::mpsc::channel(4);
    tx2.send(pb::SessionStreamRequest {
        event: Some(pb::session_stream_request::Event::Heartbeat(
            pb::Heartbeat {
                seq: 1,
                renew: None,
            },
        )),
    })
    .await
    .unwrap();
    let refused = c
        .session
        .session_stream(tokio_stream::wrappers::ReceiverStream::new(rx2))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::FailedPrecondition);

    // A wrong epoch is a stale session.
    let e = c
        .session
        .close_session(pb::CloseSessionRequest {
            session,
            epoch: epoch + 1,
        })
        .await
        .unwrap_err();
    assert_eq!(errno_of(&e), Some(116));
    c.session
        .close_session(pb::CloseSessionRequest { session, epoch })
        .await
        .unwrap();
    // Closing the session ends its stream.
    let end = tokio::time::timeout(Duration::from_secs(5), replies.message())
        .await
        .unwrap();
    assert!(matches!(end, Ok(None) | Err(_)), "{end:?}");
    drop(tx);

    // A second stream attached to a session replaces the first, which is told so.
    let (session, epoch) = c.open_session().await;
    let attach = |session, epoch| pb::SessionStreamRequest {
        event: Some(pb::session_stream_request::Event::Attach(pb::Attach {
            session,
            epoch,
        })),
    };
    let (tx1, rx1) = tokio::sync::mpsc::channel(4);
    tx1.send(attach(session, epoch)).await.unwrap();
    let mut first = c
        .session
        .session_stream(tokio_stream::wrappers::ReceiverStream::new(rx1))
        .await
        .unwrap()
        .into_inner();
    let (tx2, rx2) = tokio::sync::mpsc::channel(4);
    tx2.send(attach(session, epoch)).await.unwrap();
    let mut second = c
        .session
        .session_stream(tokio_stream::wrappers::ReceiverStream::new(rx2))
        .await
        .unwrap()
        .into_inner();
    let ended = first.message().await.unwrap().unwrap();
    match ended.event {
        Some(pb::session_stream_reply::Event::Ended(e)) => {
            assert_eq!(e.reason, pb::SessionEndReason::Replaced as i32);
        }
        other => panic!("expected the end of the replaced stream, got {other:?}"),
    }

    // Stopping the server ends attached streams, so the stop does not wait for agents.
    let started = std::time::Instant::now();
    srv.stop().await;
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "{:?}",
        started.elapsed()
    );
    let last = second.message().await;
    if let Ok(Some(r)) = last {
        match r.event {
            Some(pb::session_stream_reply::Event::Ended(e)) => {
                assert_eq!(e.reason, pb::SessionEndReason::Shutdown as i32);
            }
            other => panic!("expected the end of the stream, got {other:?}"),
        }
    }
    drop((tx1, tx2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_session_releases_handles_and_destroys_orphans() {
    let clock = Clock::manual(1_000_000);
    let srv = start_with(clock.clone(), |o, _| o.lease_ttl_ms = 200).await;
    let mut c = srv.clients().await;
    let (session, _) = c.open_session().await;
    let (file, _handle) = create(&mut c, session, ROOT, "doomed").await;
    let used = |s: &pb::StatFsReply| s.total_inodes - s.free_inodes;
    let with_file = statfs(&mut c).await;
    c.ns.unlink(pb::UnlinkRequest {
        cred: root(),
        parent: ROOT,
        name: b"doomed".to_vec(),
        request_id: None,
    })
    .await
    .unwrap();
    // The open handle keeps the unlinked inode alive, through several expiry rounds.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let orphan = getattr(&mut c, file.ino).await.unwrap();
    assert_eq!(orphan.nlink, 0);
    assert_eq!(used(&statfs(&mut c).await), used(&with_file));

    // The lease lapses (TTL plus the grace) on the server's clock.
    clock.advance_ns(5_000_000_000);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        match getattr(&mut c, file.ino).await {
            Err(e) if e.code() == Code::NotFound => break,
            Ok(_) if tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            other => panic!("the orphan outlived its session: {other:?}"),
        }
    }
    assert_eq!(used(&statfs(&mut c).await), used(&with_file) - 1);
    let status = c
        .admin
        .server_status(pb::ServerStatusRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(status.sessions.is_empty());
    // Its handles went with it.
    let e =
        c.ns.open(pb::OpenRequest {
            cred: root(),
            session,
            inode: ROOT,
            flags: Some(pb::OpenFlags {
                read: true,
                ..Default::default()
            }),
            read_small: 0,
        })
        .await
        .unwrap_err();
    assert_eq!(errno_of(&e), Some(116));
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closed_session_releases_handles_and_destroys_orphans() {
    let srv = start().await;
    let mut c = srv.clients().await;
    let (session, epoch) = c.open_session().await;
    let (file, _) = create(&mut c, session, ROOT, "tmp").await;
    c.ns.unlink(pb::UnlinkRequest {
        cred: root(),
        parent: ROOT,
        name: b"tmp".to_vec(),
        request_id: None,
    })
    .await
    .unwrap();
    assert!(getattr(&mut c, file.ino).await.is_ok());
    c.session
        .close_session(pb::CloseSessionRequest { session, epoch })
        .await
        .unwrap();
    assert_eq!(
        getattr(&mut c, file.ino).await.unwrap_err().code(),
        Code::NotFound
    );
    srv.stop().await;
}

async fn tls_channel(
    addr: std::net::SocketAddr,
    ca_pem: &str,
    identity: Option<(String, String)>,
) -> Result<Channel, tonic::transport::Error> {
    let mut tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(ca_pem))
        .domain_name("localhost");
    if let Some((cert, key)) = identity {
        tls = tls.identity(Identity::from_pem(cert, key));
    }
    Channel::from_shared(format!("https://127.0.0.1:{}", addr.port()))
        .unwrap()
        .tls_config(tls)?
        .connect()
        .await
}

async fn tls_getattr(
    addr: std::net::SocketAddr,
    ca_pem: &str,
    identity: Option<(String, String)>,
) -> Result<pb::Attr, String> {
    let ch = tls_channel(addr, ca_pem, identity)
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let mut c = Clients::new(ch);
    getattr(&mut c, ROOT).await.map_err(|e| format!("rpc: {e}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_serves_known_agents_only() {
    let our_ca = ca("sanfs test CA");
    let other = ca("some other CA");
    let dir = tempfile::tempdir().unwrap();
    let paths = write_server_tls(dir.path(), &our_ca);
    let srv = start_with(Clock::System, |o, _| o.tls = Some(paths)).await;

    let good = leaf(&our_ca, &["agent-1"], true);
    let attr = tls_getattr(srv.addr, &our_ca.pem, Some(good))
        .await
        .unwrap();
    assert_eq!(attr.ino, ROOT);

    let stranger = leaf(&other, &["agent-2"], true);
    let e = tls_getattr(srv.addr, &our_ca.pem, Some(stranger)).await;
    assert!(e.is_err(), "a client of another CA was served");
    let e = tls_getattr(srv.addr, &our_ca.pem, None).await;
    assert!(e.is_err(), "a client without a certificate was served");

    // Plaintext against the TLS port gets nowhere either.
    let plain = Channel::from_shared(format!("http://{}", srv.addr))
        .unwrap()
        .connect()
        .await;
    if let Ok(ch) = plain {
        assert!(getattr(&mut Clients::new(ch), ROOT).await.is_err());
    }
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plaintext_on_a_non_loopback_address_is_refused() {
    let clock = Clock::System;
    let dir = tempfile::tempdir().unwrap();
    let mut opts = crate::harness::options(dir.path(), &clock);
    opts.listen = "0.0.0.0:0".parse().unwrap();
    opts.insecure = false;
    let r = sanfs_mds::serve::serve(opts, clock, |_| panic!("must not start"), async {}).await;
    let e = r.unwrap_err().to_string();
    assert!(e.contains("refusing to serve plaintext"), "{e}");
    assert!(e.contains("insecure"), "{e}");
}

/// The value of the sample `name` (no labels) in a text exposition; panics when absent.
fn sample(body: &str, name: &str) -> f64 {
    body.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no sample {name} in:\n{body}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_are_served_on_get_metrics() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let maddr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let srv = start_with(Clock::System, |o, _| o.metrics_addr = Some(maddr)).await;
    let mut c = srv.clients().await;
    c.open_session().await;
    mkdir(&mut c, ROOT, "m").await;
    getattr(&mut c, ROOT).await.unwrap();

    let get = |path: &'static str| async move {
        let mut s = tokio::net::TcpStream::connect(maddr).await.unwrap();
        s.write_all(
            format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await
        .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        out
    };
    let body = get("/metrics").await;
    assert!(body.starts_with("HTTP/1.1 200 OK\r\n"), "{body}");
    for name in [
        "sanfs_rpc_requests_total",
        "sanfs_rpc_duration_seconds",
        "sanfs_commits_total",
        "sanfs_commit_ops_total",
        "sanfs_sessions",
        "sanfs_capacity_bytes",
        "sanfs_free_bytes",
        "sanfs_inodes",
    ] {
        assert!(body.contains(name), "{name} missing from:\n{body}");
        assert!(
            body.contains(&format!("# HELP {name} ")),
            "no HELP for {name}:\n{body}"
        );
    }
    assert!(
        body.contains(&format!(
            "sanfs_build_info{{version=\"{}\"}} 1",
            env!("CARGO_PKG_VERSION")
        )),
        "{body}"
    );
    // Every metric family has its HELP.
    for line in body.lines().filter(|l| l.starts_with("# TYPE ")) {
        let name = line.split(' ').nth(2).unwrap();
        assert!(
            body.contains(&format!("# HELP {name} ")),
            "no HELP for {name}"
        );
    }
    assert!(body.contains("rpc=\"GetAttr\""), "{body}");
    assert!(body.contains("code=\"Ok\""), "{body}");
    // The commit histograms: a durable commit (a mkdir) adds to both.
    let durable_commits = sample(&body, "sanfs_commit_duration_seconds_count");
    let commits = sample(&body, "sanfs_commit_ops_count");
    assert!(body.contains("sanfs_commit_ops_bucket{le=\"1\"}"), "{body}");
    mkdir(&mut c, ROOT, "m2").await;
    let after = get("/metrics").await;
    assert!(
        sample(&after, "sanfs_commit_duration_seconds_count") > durable_commits,
        "{after}"
    );
    assert!(
        sample(&after, "sanfs_commit_ops_count") > commits,
        "{after}"
    );
    assert!(
        sample(&after, "sanfs_commit_duration_seconds_sum") > 0.0,
        "{after}"
    );
    let nope = get("/").await;
    assert!(nope.starts_with("HTTP/1.1 404"), "{nope}");
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_store_stops_the_server() {
    let clock = Clock::System;
    let disk = SimDisk::new(FaultPlan::default());
    sanfs_testcluster::mds::create_store(
        &Backend::Sim(disk.clone()),
        &crate::support::fs_info(),
        &clock,
    )
    .unwrap();
    let backend = Backend::Sim(disk.clone());
    let srv = start_with(clock, move |o, _| o.backend = backend).await;
    let mut c = srv.clients().await;
    mkdir(&mut c, ROOT, "before").await;
    disk.crash_now();
    let e =
        c.ns.mkdir(pb::MkdirRequest {
            cred: root(),
            parent: ROOT,
            name: b"after".to_vec(),
            perm: 0o755,
            delegate: false,
            request_id: None,
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Internal);
    let r = tokio::time::timeout(Duration::from_secs(20), srv.task)
        .await
        .expect("serve stops after the store fails");
    let e = r.unwrap().unwrap_err().to_string();
    assert!(e.contains("fail-stop"), "{e}");
}

/// Issue 16 item 6: refused TLS handshakes are logged (WARN, with the peer's address,
/// rate-limited: `handshake` module) and counted in `sanfs_tls_handshakes_refused_total`; a
/// served agent is not counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_tls_handshakes_are_counted() {
    let our_ca = ca("sanfs test CA");
    let other = ca("some other CA");
    let dir = tempfile::tempdir().unwrap();
    let paths = write_server_tls(dir.path(), &our_ca);
    let maddr = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let srv = start_with(Clock::System, |o, _| {
        o.tls = Some(paths);
        o.metrics_addr = Some(maddr);
    })
    .await;
    let refused = || async move {
        let mut s = tokio::net::TcpStream::connect(maddr).await.unwrap();
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        out.lines()
            .find_map(|l| l.strip_prefix("sanfs_tls_handshakes_refused_total "))
            .map_or(0, |v| v.trim().parse::<u64>().unwrap())
    };
    let before = refused().await;
    let good = leaf(&our_ca, &["agent-1"], true);
    tls_getattr(srv.addr, &our_ca.pem, Some(good))
        .await
        .unwrap();
    let stranger = leaf(&other, &["agent-2"], true);
    assert!(
        tls_getattr(srv.addr, &our_ca.pem, Some(stranger))
            .await
            .is_err()
    );
    assert!(tls_getattr(srv.addr, &our_ca.pem, None).await.is_err());
    // A probe: connect, send garbage, go.
    let mut s = tokio::net::TcpStream::connect(srv.addr).await.unwrap();
    s.write_all(b"not a TLS client hello\r\n").await.unwrap();
    drop(s);
    // The counter is process-wide (other tests may add to it): at least our three.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let n = refused().await;
        if n >= before + 3 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "refused handshakes counted: {n}, before: {before}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    srv.stop().await;
}

/// A session's reads (Lookup, ReadDir with or without attributes) see its own changes
/// answered before they were durable without making them durable first (its agent keeps
/// them); another session's read makes them durable before it is answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_sync_only_other_sessions_changes_first() {
    use sanfs_proto::headers;
    use sanfs_proto::types::SessionId;
    let srv = start().await;
    let mut a = srv.clients().await;
    let mut b = srv.clients().await;
    let (sa, _) = a.open_session().await;
    let (sb, _) = b.open_session().await;
    fn with<T>(session: u64, req: T) -> tonic::Request<T> {
        let mut r = tonic::Request::new(req);
        sanfs_proto::headers::set_session(r.metadata_mut(), SessionId(session));
        r
    }
    let mkdir = |name: &str| pb::MkdirRequest {
        cred: root(),
        parent: 1,
        name: name.into(),
        perm: 0o755,
        delegate: false,
        request_id: None,
    };
    let read_dir = |session: Option<u64>, plus: bool| pb::ReadDirRequest {
        cred: root(),
        inode: 1,
        cookie: 0,
        max_entries: 100,
        plus,
        session,
    };
    // A's own reads between two of its lazy changes (retried when the lazy commit's own
    // timer, 1 s, may have made the first durable meanwhile).
    let mut checked = false;
    for round in 0..3 {
        let started = std::time::Instant::now();
        let first =
            a.ns.mkdir(with(sa, mkdir(&format!("a{round}"))))
                .await
                .unwrap();
        let note = headers::commit(first.metadata()).unwrap().unwrap();
        assert!(
            note.seq > note.durable_seq,
            "answered before it was durable"
        );
        a.ns.read_dir(with(sa, read_dir(None, false)))
            .await
            .unwrap();
        a.ns.read_dir(read_dir(Some(sa), true)).await.unwrap();
        a.ns.lookup(pb::LookupRequest {
            cred: root(),
            parent: 1,
            name: format!("a{round}").into(),
            session: Some(sa),
        })
        .await
        .unwrap();
        let second =
            a.ns.mkdir(with(sa, mkdir(&format!("b{round}"))))
                .await
                .unwrap();
        let after = headers::commit(second.metadata()).unwrap().unwrap();
        if started.elapsed() < Duration::from_millis(500) {
            assert!(
                after.durable_seq < note.seq,
                "A's own reads made its change durable"
            );
            checked = true;
            break;
        }
    }
    assert!(
        checked,
        "three rounds of four calls each took 500 ms or more"
    );
    // B's read makes A's changes durable before it answers.
    let last = a.ns.mkdir(with(sa, mkdir("c"))).await.unwrap();
    let note = headers::commit(last.metadata()).unwrap().unwrap();
    b.ns.read_dir(read_dir(Some(sb), true)).await.unwrap();
    let mine = b.ns.mkdir(with(sb, mkdir("d"))).await.unwrap();
    let after = headers::commit(mine.metadata()).unwrap().unwrap();
    assert!(
        after.durable_seq >= note.seq,
        "B's read waited for A's change"
    );
    srv.stop().await;
}

/// Every metric the server's code names has its `# HELP` text (a `describe_*!` in
/// metrics.rs) and a row in metrics.rs's table, not only those the other tests happen to make
/// count: `sanfs_namespace_barrier_syncs_total` and `sanfs_namespace_replays_total` had
/// neither (found when fuzz_calls made a barrier sync before `metrics_are_served_on_get_metrics`
/// scraped the shared recorder).
#[test]
fn every_metric_named_in_the_code_is_described() {
    /// The string literals right after each `macro!(` in `text`.
    fn names_after(text: &str, macro_open: &str) -> Vec<String> {
        let mut out = Vec::new();
        let mut rest = text;
        while let Some(at) = rest.find(macro_open) {
            rest = &rest[at + macro_open.len()..];
            let arg = rest.trim_start();
            if let Some(lit) = arg.strip_prefix('"')
                && let Some(end) = lit.find('"')
            {
                out.push(lit[..end].to_owned());
            }
        }
        out
    }
    fn sources(dir: &std::path::Path, out: &mut Vec<String>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                sources(&p, out);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(std::fs::read_to_string(&p).unwrap());
            }
        }
    }
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut texts = Vec::new();
    sources(&src, &mut texts);
    let metrics_rs = std::fs::read_to_string(src.join("metrics.rs")).unwrap();
    let described_in = |text: &str| -> Vec<String> {
        [
            "describe_counter!(",
            "describe_gauge!(",
            "describe_histogram!(",
        ]
        .iter()
        .flat_map(|m| names_after(text, m))
        .collect()
    };
    // What the code outside metrics.rs counts goes to the process-wide recorder: its HELP is
    // set once, by `describe_recorded` (`publish`'s go to a recorder of their own per scrape).
    let start = metrics_rs.find("fn describe_recorded()").unwrap();
    let end = start + metrics_rs[start..].find("\n}\n").unwrap();
    let recorded = described_in(&metrics_rs[start..end]);
    let anywhere = described_in(&metrics_rs);
    let mut missing = Vec::new();
    for text in &texts {
        let described = if *text == metrics_rs {
            &anywhere
        } else {
            &recorded
        };
        for m in ["counter!(", "gauge!(", "histogram!("] {
            for name in names_after(text, m) {
                let row = format!("//! | `{name}` |");
                if !described.contains(&name) || !metrics_rs.contains(&row) {
                    missing.push(name);
                }
            }
        }
    }
    missing.sort();
    missing.dedup();
    assert!(
        missing.is_empty(),
        "metrics without a describe_* or a row in metrics.rs's table: {missing:?}"
    );
}
