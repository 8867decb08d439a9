//! A completion cannot expose blocks that were not written (docs/security.md): a client that
//! fallocates, takes a write grant and completes it without any device I/O makes the range
//! Written, but the server zeroed those blocks on the LUNs before the grant left, so a
//! proxied read (and the LUN itself) shows zeros, not the deleted file whose blocks they were.

use std::os::unix::fs::FileExt;

use sanfs_proto::pb;
use sanfs_proto::types::InodeId;

use crate::harness::{Running, root, rw, start_with_luns};

const MIB: u64 = 1 << 20;

/// The bytes on the LUN files under `ios`.
fn lun_bytes(srv: &Running, ios: &[pb::DeviceIo]) -> Vec<u8> {
    let mut out = Vec::new();
    for io in ios {
        let f = std::fs::File::open(srv.dir().join(format!("lun{}", io.device))).unwrap();
        let mut buf = vec![0u8; io.len as usize];
        f.read_exact_at(&mut buf, io.phys_off).unwrap();
        out.extend(buf);
    }
    out
}

fn runs(ios: &[pb::DeviceIo]) -> Vec<(u32, u64, u64)> {
    ios.iter().map(|d| (d.device, d.phys_off, d.len)).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_without_device_io_exposes_zeros_not_a_deleted_files_bytes() {
    let srv = start_with_luns(10_000).await;
    let mut c = srv.clients().await;
    let (session, epoch) = c.open_session().await;
    let create = |name: &str| pb::CreateRequest {
        delegate: false,
        inode: 0,
        time: None,
        request_id: None,
        cred: root(),
        session,
        parent: 1,
        name: name.into(),
        perm: 0o600,
        exclusive: true,
        flags: rw(),
    };
    let map = |handle: u64, inode: u64| pb::MapRequest {
        cred: root(),
        session,
        epoch,
        handle,
        inode,
        offset: 0,
        length: MIB,
        sync: false,
        ..Default::default()
    };
    let complete = |grant_id: u64, bytes_done: u64| pb::CompleteRequest {
        session,
        epoch,
        grant_id,
        status: pb::IoStatus::Ok as i32,
        errors: vec![],
        bytes_done,
        sync: true,
        ..Default::default()
    };

    // Another user's secret: 1 MiB through the server, then deleted.
    let r = c.ns.create(create("secret")).await.unwrap().into_inner();
    let (secret, hs) = (r.attr.unwrap().ino, r.handle);
    c.data
        .write(pb::WriteRequest {
            cred: root(),
            session,
            handle: hs,
            inode: secret,
            offset: 0,
            data: vec![0x5e; MIB as usize],
            sync: true,
            append: false,
            request_id: None,
            then_set_attr: None,
        })
        .await
        .unwrap();
    let g = c.data.map_read(map(hs, secret)).await.unwrap().into_inner();
    let secret_runs = runs(&g.device_ios);
    let secret_g_ios = g.device_ios.clone();
    assert!(
        lun_bytes(&srv, &g.device_ios).iter().all(|&x| x == 0x5e),
        "the secret is on the LUNs"
    );
    c.data.complete(complete(g.grant_id, MIB)).await.unwrap();
    c.ns.release(pb::ReleaseRequest {
        session,
        handle: hs,
    })
    .await
    .unwrap();
    c.ns.unlink(pb::UnlinkRequest {
        request_id: None,
        cred: root(),
        parent: 1,
        name: b"secret".to_vec(),
    })
    .await
    .unwrap();

    // The attack: fallocate all the free space (so the secret's blocks are among it), take
    // write grants over it and complete them whole without writing anything.
    let st =
        c.ns.stat_fs(pb::StatFsRequest {
            cred: root(),
            inode: 1,
        })
        .await
        .unwrap()
        .into_inner();
    let len = st.free_blocks * u64::from(st.block_size);
    let r = c.ns.create(create("probe")).await.unwrap().into_inner();
    let (probe, hp) = (r.attr.unwrap().ino, r.handle);
    c.data
        .fallocate(pb::FallocateRequest {
            cred: root(),
            session,
            handle: hp,
            inode: probe,
            offset: 0,
            length: len,
            mode: pb::FallocateMode::Allocate as i32,
        })
        .await
        .unwrap();
    let mut reused = false;
    let mut at = 0;
    while at < len {
        let g = c
            .data
            .map_write(pb::MapRequest {
                offset: at,
                length: len - at,
                ..map(hp, probe)
            })
            .await
            .unwrap()
            .into_inner();
        reused |= runs(&g.device_ios).iter().any(|r| {
            secret_runs.contains(r)
                || secret_runs
                    .iter()
                    .any(|s| s.0 == r.0 && s.1 < r.1 + r.2 && r.1 < s.1 + s.2)
        });
        c.data
            .complete(complete(g.grant_id, g.length))
            .await
            .unwrap();
        at += g.length;
    }
    assert!(
        reused,
        "the secret's blocks were handed out again (else this test proves nothing)"
    );
    let mut at = 0;
    while at < len {
        let got = c
            .data
            .read(pb::ReadRequest {
                cred: root(),
                session,
                handle: hp,
                inode: probe,
                offset: at,
                length: (4 * MIB).min(len - at),
            })
            .await
            .unwrap()
            .into_inner()
            .data;
        assert!(!got.is_empty());
        assert!(
            !got.contains(&0x5e),
            "a proxied read at {at} after a completion without device I/O shows the secret"
        );
        at += got.len() as u64;
    }
    assert!(
        lun_bytes(&srv, &secret_g_ios).iter().all(|&x| x == 0),
        "the secret's blocks were zeroed on the LUNs before they were granted again"
    );
    c.ns.release(pb::ReleaseRequest {
        session,
        handle: hp,
    })
    .await
    .unwrap();
    c.ns.unlink(pb::UnlinkRequest {
        request_id: None,
        cred: root(),
        parent: 1,
        name: b"probe".to_vec(),
    })
    .await
    .unwrap();

    // A fresh write grant (allocation by MapWrite itself) is zeroed the same way.
    let r = c.ns.create(create("probe2")).await.unwrap().into_inner();
    let (probe2, hp2) = (r.attr.unwrap().ino, r.handle);
    c.data
        .write(pb::WriteRequest {
            cred: root(),
            session,
            handle: hp2,
            inode: probe2,
            offset: 0,
            data: vec![0x6f; MIB as usize],
            sync: true,
            append: false,
            request_id: None,
            then_set_attr: None,
        })
        .await
        .unwrap();
    c.ns.set_attr(pb::SetAttrRequest {
        cred: root(),
        inode: probe2,
        changes: Some(pb::SetAttrChanges {
            size: Some(0),
            ..Default::default()
        }),
        handle: Some(hp2),
        session: Some(session),
    })
    .await
    .unwrap();
    let g = c
        .data
        .map_write(map(hp2, probe2))
        .await
        .unwrap()
        .into_inner();
    assert!(
        lun_bytes(&srv, &g.device_ios).iter().all(|&x| x == 0),
        "a write grant's fresh blocks are zeroed before it leaves"
    );
    c.data.complete(complete(g.grant_id, MIB)).await.unwrap();
    srv.stop().await;
}

/// Blocks noted for zeroing when the server stopped (a crash between the allocation's commit
/// and the zeroing) are zeroed at the next start, before anything is served, and the note is
/// gone; fsck stays clean.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocks_noted_for_zeroing_when_the_server_stopped_are_zeroed_at_the_next_start() {
    use sanfs_mds::clock::Clock;
    use sanfs_mds::store::{Backend, Store};

    let srv = start_with_luns(10_000).await;
    let mut c = srv.clients().await;
    let (session, epoch) = c.open_session().await;
    let r =
        c.ns.create(pb::CreateRequest {
            delegate: false,
            inode: 0,
            time: None,
            request_id: None,
            cred: root(),
            session,
            parent: 1,
            name: "f".into(),
            perm: 0o600,
            exclusive: true,
            flags: rw(),
        })
        .await
        .unwrap()
        .into_inner();
    let (ino, h) = (r.attr.unwrap().ino, r.handle);
    c.data
        .write(pb::WriteRequest {
            cred: root(),
            session,
            handle: h,
            inode: ino,
            offset: 0,
            data: vec![0x5e; MIB as usize],
            sync: true,
            append: false,
            request_id: None,
            then_set_attr: None,
        })
        .await
        .unwrap();
    let g = c
        .data
        .map_read(pb::MapRequest {
            cred: root(),
            session,
            epoch,
            handle: h,
            inode: ino,
            offset: 0,
            length: MIB,
            sync: false,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let ios = g.device_ios.clone();
    assert!(lun_bytes(&srv, &ios).iter().all(|&x| x == 0x5e));
    let dir = srv.stop_keeping_files().await;

    // As if the last run had noted the file's blocks and stopped before zeroing them.
    let backend = Backend::File(dir.path().join("mds.redb"));
    {
        let store = Store::open(&backend, Clock::System, 8).unwrap();
        let extents = store
            .read(|t| {
                use sanfs_mds::ns::Reader;
                t.extent_list(InodeId(ino))
            })
            .unwrap();
        assert!(!extents.is_empty());
        store
            .write(move |ctx| {
                for e in &extents {
                    ctx.mark_unzeroed(e.vol_block, e.len_blocks)?;
                }
                Ok(())
            })
            .await
            .unwrap();
        assert!(!store.unzeroed_runs().unwrap().is_empty());
        store.close();
    }
    let luns: Vec<std::path::PathBuf> =
        (0..4).map(|i| dir.path().join(format!("lun{i}"))).collect();
    let kept = backend.clone();
    let srv = crate::harness::start_with(Clock::System, move |o, _| {
        o.backend = kept;
        o.data_devices = luns;
    })
    .await;
    let read_luns = |ios: &[pb::DeviceIo]| {
        let mut out = Vec::new();
        for io in ios {
            let f = std::fs::File::open(dir.path().join(format!("lun{}", io.device))).unwrap();
            let mut buf = vec![0u8; io.len as usize];
            f.read_exact_at(&mut buf, io.phys_off).unwrap();
            out.extend(buf);
        }
        out
    };
    assert!(
        read_luns(&ios).iter().all(|&x| x == 0),
        "the noted blocks were zeroed before the server served"
    );
    srv.stop().await;
    let store = Store::open(&backend, Clock::System, 8).unwrap();
    assert!(
        store.unzeroed_runs().unwrap().is_empty(),
        "and the note is gone"
    );
    store.close();
    let rep = sanfs_mds::fsck::check(&backend).unwrap();
    assert!(rep.is_clean(), "{rep}");
}
