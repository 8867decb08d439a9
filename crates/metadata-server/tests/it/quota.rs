//! Directory quotas through gRPC on real LUNs (what a CSI volume is): writing past the
//! capacity fails with EDQUOT and changes nothing; raising the quota lets the write through;
//! usage is exact in GetQuota and in statfs inside the directory; renames and links across
//! quotas answer EXDEV; the inode limit holds; fsck agrees with the usage.

use sanfs_mds::store::Backend;
use sanfs_proto::pb;
use sanfs_proto::status::errno_of;
use tonic::Code;

use crate::harness::{Clients, root, rw, start_with_luns};

const KIB: u64 = 1024;
const MIB: u64 = 1 << 20;

async fn mkdir(c: &mut Clients, parent: u64, name: &str) -> u64 {
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
    .ino
}

async fn create(
    c: &mut Clients,
    session: u64,
    parent: u64,
    name: &str,
) -> Result<(u64, u64), tonic::Status> {
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
    .map(|r| {
        let r = r.into_inner();
        (r.attr.unwrap().ino, r.handle)
    })
}

async fn write(
    c: &mut Clients,
    session: u64,
    handle: u64,
    inode: u64,
    offset: u64,
    len: u64,
) -> Result<pb::WriteReply, tonic::Status> {
    c.data
        .write(pb::WriteRequest {
            cred: root(),
            session,
            handle,
            inode,
            offset,
            data: vec![0xab; len as usize],
            sync: false,
            append: false,
            request_id: None,
            then_set_attr: None,
        })
        .await
        .map(|r| r.into_inner())
}

async fn quota(c: &mut Clients, dir: u64) -> pb::QuotaInfo {
    c.admin
        .get_quota(pb::GetQuotaRequest {
            cred: root(),
            inode: dir,
        })
        .await
        .unwrap()
        .into_inner()
        .quota
        .unwrap()
}

async fn set_quota(
    c: &mut Clients,
    dir: u64,
    bytes: u64,
    inodes: u64,
) -> Result<(), tonic::Status> {
    c.admin
        .set_quota(pb::SetQuotaRequest {
            cred: root(),
            inode: dir,
            limits: Some(pb::QuotaLimits {
                capacity_bytes: Some(bytes),
                inodes: Some(inodes),
            }),
        })
        .await
        .map(|_| ())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_directory_quota_holds_is_exact_and_can_grow() {
    let srv = start_with_luns(60_000).await;
    let mut c = srv.clients().await;
    let (session, _) = c.open_session().await;
    let vol = mkdir(&mut c, 1, "vol").await;
    set_quota(&mut c, vol, MIB, 8).await.unwrap();
    // Quotas do not nest.
    let inner = mkdir(&mut c, vol, "inner").await;
    let nested = set_quota(&mut c, inner, MIB, 8).await;
    assert!(nested.is_err(), "quotas do not nest");
    let (f, h) = create(&mut c, session, vol, "f").await.unwrap();

    // 512 KiB fit in 1 MiB; 600 KiB more do not: EDQUOT, and nothing changes.
    write(&mut c, session, h, f, 0, 512 * KIB).await.unwrap();
    let before = quota(&mut c, vol).await;
    assert_eq!(before.used_bytes, 512 * KIB, "usage is exact");
    assert_eq!(before.used_inodes, 2, "the subdirectory and f");
    let over = write(&mut c, session, h, f, 512 * KIB, 600 * KIB)
        .await
        .unwrap_err();
    assert_eq!(over.code(), Code::ResourceExhausted, "{over:?}");
    assert_eq!(errno_of(&over), Some(122), "EDQUOT");
    assert_eq!(
        quota(&mut c, vol).await,
        before,
        "a refused write changes nothing"
    );
    let size =
        c.ns.get_attr(pb::GetAttrRequest {
            cred: root(),
            inode: f,
            session: None,
        })
        .await
        .unwrap()
        .into_inner()
        .attr
        .unwrap()
        .size;
    assert_eq!(size, 512 * KIB);

    // statfs inside the directory shows the quota.
    let st =
        c.ns.stat_fs(pb::StatFsRequest {
            cred: root(),
            inode: f,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(st.total_blocks * u64::from(st.block_size), MIB);
    assert_eq!(st.free_blocks * u64::from(st.block_size), 512 * KIB);

    // Raising the quota (ControllerExpandVolume) lets the same write through.
    set_quota(&mut c, vol, 4 * MIB, 8).await.unwrap();
    write(&mut c, session, h, f, 512 * KIB, 600 * KIB)
        .await
        .unwrap();
    let after = quota(&mut c, vol).await;
    assert_eq!(
        after.used_bytes,
        (512 + 600) * KIB,
        "600 KiB is 150 whole blocks"
    );

    // Moving out of the quota, or linking across it, is a move between file systems.
    let out =
        c.ns.rename(pb::RenameRequest {
            cred: root(),
            old_parent: vol,
            old_name: b"f".to_vec(),
            new_parent: 1,
            new_name: b"f".to_vec(),
            mode: pb::RenameMode::Replace as i32,
            request_id: None,
        })
        .await
        .unwrap_err();
    assert_eq!(errno_of(&out), Some(18), "EXDEV: {out:?}");
    let link =
        c.ns.link(pb::LinkRequest {
            cred: root(),
            inode: f,
            new_parent: 1,
            new_name: b"g".to_vec(),
            request_id: None,
        })
        .await
        .unwrap_err();
    assert_eq!(errno_of(&link), Some(18), "EXDEV: {link:?}");

    // The inode limit: 8 inodes, two are the subdirectory and f.
    for i in 0..6 {
        create(&mut c, session, vol, &format!("n{i}"))
            .await
            .unwrap();
    }
    let full = create(&mut c, session, vol, "one-too-many")
        .await
        .unwrap_err();
    assert_eq!(errno_of(&full), Some(122), "{full:?}");
    assert_eq!(quota(&mut c, vol).await.used_inodes, 8);

    // Only empty directories take a new quota.
    let busy = set_quota(&mut c, 1, MIB, 8).await.unwrap_err();
    assert_eq!(busy.code(), Code::InvalidArgument, "{busy:?}");

    // Unlinking gives the space and the inode back.
    c.ns.release(pb::ReleaseRequest { session, handle: h })
        .await
        .unwrap();
    c.ns.unlink(pb::UnlinkRequest {
        cred: root(),
        parent: vol,
        name: b"f".to_vec(),
        request_id: None,
    })
    .await
    .unwrap();
    let q = quota(&mut c, vol).await;
    assert_eq!(q.used_bytes, 0);
    assert_eq!(q.used_inodes, 7, "6 files and the subdirectory");

    let dir = srv.stop_keeping_files().await;
    let backend = Backend::File(dir.path().join("mds.redb"));
    let rep = sanfs_mds::fsck::check(&backend).unwrap();
    assert!(rep.is_clean(), "{rep}");

    // Usage damaged on purpose is recomputed from the inodes by `fsck --repair`.
    {
        let db = redb::Database::open(dir.path().join("mds.redb")).unwrap();
        let txn = db.begin_write().unwrap();
        {
            use redb::ReadableTable;
            let mut t = txn.open_table(sanfs_mds::store::QUOTAS).unwrap();
            let (bytes, inodes, _, _) = t.get(vol).unwrap().unwrap().value();
            t.insert(vol, (bytes, inodes, 1234, 99)).unwrap();
        }
        txn.commit().unwrap();
    }
    let rep = sanfs_mds::fsck::check(&backend).unwrap();
    assert_eq!(
        rep.fixes,
        vec![sanfs_mds::fsck::Fix::QuotaUsage {
            dir: vol,
            blocks: 0,
            inodes: 7
        }],
        "{rep}"
    );
    let repaired =
        sanfs_mds::fsck::repair(&backend, false, sanfs_proto::types::Timestamp::default()).unwrap();
    assert!(repaired.after.is_clean(), "{repaired}");
    assert!(sanfs_mds::fsck::check(&backend).unwrap().is_clean());
}
