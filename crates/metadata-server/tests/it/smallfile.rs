//! Small files with their open (`OpenRequest.read_small`) and the server's memory of them
//! (`sanfs_mds::smallfiles`): an open gets the whole file as last written by any path, and
//! the bytes kept in memory go as soon as an exclusive lock on the file is granted (before
//! its holder can write), so a direct write through a grant is never answered stale.

use sanfs_mds::data;
use sanfs_mds::locks::{LockMode, Span};
use sanfs_mds::proxy::Position;
use sanfs_proto::pb;
use sanfs_proto::types::InodeId;

use crate::coherence::{cluster, create, device_write};
use crate::harness::{Clients, root, start_with_luns};

const TTL_MS: u64 = 10_000;

/// A proxied write, acknowledged.
pub(crate) async fn write(
    c: &mut Clients,
    session: u64,
    handle: u64,
    ino: u64,
    offset: u64,
    data: &[u8],
) {
    try_write(c, session, handle, ino, offset, data)
        .await
        .expect("proxied write");
}

/// [`write`] that answers the server's error instead of failing the test.
pub(crate) async fn try_write(
    c: &mut Clients,
    session: u64,
    handle: u64,
    ino: u64,
    offset: u64,
    data: &[u8],
) -> Result<(), tonic::Status> {
    c.data
        .write(pb::WriteRequest {
            cred: root(),
            session,
            handle,
            inode: ino,
            offset,
            data: data.to_vec(),
            sync: true,
            append: false,
            request_id: None,
            then_set_attr: None,
        })
        .await
        .map(|_| ())
}

/// Opens `ino` (`read`/`write` as asked, asking for up to `read_small` bytes): the reply's
/// bytes, its size, and the handle (released by the caller).
async fn open(
    c: &mut Clients,
    session: u64,
    ino: u64,
    read: bool,
    write: bool,
    read_small: u64,
) -> (Option<Vec<u8>>, u64, u64) {
    let r =
        c.ns.open(pb::OpenRequest {
            cred: root(),
            session,
            inode: ino,
            flags: Some(pb::OpenFlags {
                read,
                write,
                append: false,
                truncate: false,
            }),
            read_small,
        })
        .await
        .expect("open")
        .into_inner();
    (r.data, r.attr.expect("attr").size, r.handle)
}

async fn release(c: &mut Clients, session: u64, handle: u64) {
    c.ns.release(pb::ReleaseRequest { session, handle })
        .await
        .expect("release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_that_asks_gets_a_small_file_whole_as_any_node_last_wrote_it() {
    let srv = start_with_luns(TTL_MS).await;
    let mut a = srv.clients().await;
    let mut b = srv.clients().await;
    let (sa, _) = a.open_session().await;
    let (sb, _) = b.open_session().await;
    let (ino, ha) = a.create_file(sa, "f").await;
    write(&mut a, sa, ha, ino, 0, b"hello world").await;

    let (data, size, h) = open(&mut b, sb, ino, true, false, 64 << 10).await;
    assert_eq!(data.as_deref(), Some(&b"hello world"[..]));
    assert_eq!(size, 11);
    release(&mut b, sb, h).await;
    // Not asked, asked for less than the file, or not opened for reading: no bytes.
    for (read, write, ask) in [(true, false, 0), (true, false, 5), (false, true, 64 << 10)] {
        let (data, _, h) = open(&mut b, sb, ino, read, write, ask).await;
        assert_eq!(data, None, "read {read} write {write} asking {ask}");
        release(&mut b, sb, h).await;
    }

    // A's write of part of the file (kept bytes go with its lock), then a truncate.
    write(&mut a, sa, ha, ino, 6, b"WORLD").await;
    let (data, _, h) = open(&mut b, sb, ino, true, false, 64 << 10).await;
    assert_eq!(data.as_deref(), Some(&b"hello WORLD"[..]));
    release(&mut b, sb, h).await;
    a.ns.set_attr(pb::SetAttrRequest {
        cred: root(),
        inode: ino,
        changes: Some(pb::SetAttrChanges {
            size: Some(5),
            ..Default::default()
        }),
        handle: Some(ha),
        session: Some(sa),
    })
    .await
    .expect("truncate");
    let (data, size, h) = open(&mut b, sb, ino, true, false, 64 << 10).await;
    assert_eq!((data.as_deref(), size), (Some(&b"hello"[..]), 5));
    release(&mut b, sb, h).await;

    // Past the server's limit (its direct-I/O threshold, 64 KiB): never.
    write(&mut a, sa, ha, ino, 0, &vec![7u8; (64 << 10) + 1]).await;
    let (data, size, h) = open(&mut b, sb, ino, true, false, u64::MAX).await;
    assert_eq!((data, size), (None, (64 << 10) + 1));
    release(&mut b, sb, h).await;
    release(&mut a, sa, ha).await;
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kept_bytes_go_as_an_exclusive_lock_is_granted_before_a_direct_write() {
    let c = cluster();
    let dp = &c.dp;
    let ino = create(dp, "small");
    let first = vec![1u8; 5000];
    dp.write(ino, Position::At(0), first.clone(), true, 0, None)
        .await
        .expect("proxied write");
    assert_eq!(
        dp.small.size(),
        (1, 5000),
        "a whole small file written: kept"
    );
    let (got, eof) = dp.read(ino, 0, 10_000, 0).await.expect("proxied read");
    assert_eq!((got, eof), (first, true));

    // A direct writer: its exclusive lock first (as a write grant takes), then the device
    // write and the completion, as an agent does.
    let held = dp
        .lock(ino, Span::new(0, 8192), LockMode::Exclusive, 7)
        .await
        .expect("exclusive lock");
    assert_eq!(
        dp.small.size(),
        (0, 0),
        "gone as the lock is granted, before the holder writes"
    );
    let vol = dp.store.volume().clone();
    let g = dp
        .store
        .write(move |ctx| data::map_write(ctx, &vol, InodeId(ino), 0, 8192))
        .await
        .expect("map write");
    let second = vec![2u8; 8192];
    device_write(&c.luns, &g.plan, &second);
    dp.store
        .write_data(true, sanfs_mds::store::Luns::All, move |ctx| {
            data::complete_write(ctx, InodeId(ino), 0, 8192, false)
        })
        .await
        .expect("complete");
    drop(held);
    let (got, eof) = dp.read(ino, 0, 10_000, 0).await.expect("proxied read");
    assert_eq!(
        (got, eof),
        (second.clone(), true),
        "the direct write's bytes"
    );
    assert_eq!(dp.small.size(), (1, 8192), "read whole: kept again");
    let (got, _) = dp.read(ino, 100, 10, 0).await.expect("from memory");
    assert_eq!(got, second[100..110].to_vec());
}

/// A proxied write with attribute changes (`WriteRequest.then_set_attr`, what an agent sends
/// at the close of a small file whose `chmod`/`utimensat` it held back): both in one durable
/// call, the changes after the bytes (the mtime set wins over the write's); a change the
/// caller may not make refuses the whole call with nothing written; never with an append.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_with_attribute_changes_applies_both_or_neither() {
    let srv = start_with_luns(TTL_MS).await;
    let mut a = srv.clients().await;
    let (sa, _) = a.open_session().await;
    let (ino, ha) = a.create_file(sa, "f").await;
    let at = |sec: i64| pb::TimeSet {
        value: Some(pb::time_set::Value::At(pb::Timestamp { sec, nsec: 0 })),
    };
    let request = |cred: Option<pb::Credentials>, data: &[u8], perm: u32| pb::WriteRequest {
        cred,
        session: sa,
        handle: ha,
        inode: ino,
        offset: 0,
        data: data.to_vec(),
        sync: false,
        append: false,
        request_id: None,
        then_set_attr: Some(pb::SetAttrChanges {
            perm: Some(perm),
            mtime: Some(at(1_000_000)),
            atime: Some(at(2_000_000)),
            ..Default::default()
        }),
    };
    let reply = a
        .data
        .write(request(root(), b"hello", 0o640))
        .await
        .expect("write with changes")
        .into_inner();
    let attr = reply.attr.expect("attr");
    assert_eq!((attr.size, attr.perm), (5, 0o640));
    assert_eq!(
        attr.mtime.map(|t| t.sec),
        Some(1_000_000),
        "set after the write"
    );
    assert_eq!(attr.atime.map(|t| t.sec), Some(2_000_000));
    let stat = |c: &mut Clients| {
        let mut ns = c.ns.clone();
        async move {
            ns.get_attr(pb::GetAttrRequest {
                cred: root(),
                inode: ino,
                session: None,
            })
            .await
            .expect("getattr")
            .into_inner()
            .attr
            .expect("attr")
        }
    };
    // (A GetAttr also says whether the file has extended attributes; a write's reply does
    // not.)
    let attr = pb::Attr {
        no_xattrs: true,
        ..attr
    };
    assert_eq!(stat(&mut a).await, attr);

    // Not the owner: a chmod is refused, and so is the write that carries it.
    let stranger = Some(pb::Credentials {
        uid: 1000,
        gid: 1000,
        groups: vec![],
    });
    let e = a
        .data
        .write(request(stranger, b"HELLO, WORLD", 0o600))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
    assert_eq!(stat(&mut a).await, attr, "nothing changed");
    let (data, _, h) = open(&mut a, sa, ino, true, false, 64 << 10).await;
    assert_eq!(data.as_deref(), Some(&b"hello"[..]), "nothing written");
    release(&mut a, sa, h).await;

    // Never with an append, nor setting a size.
    let mut append = request(root(), b"x", 0o600);
    append.append = true;
    let e = a.data.write(append).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    let mut sized = request(root(), b"x", 0o600);
    sized.then_set_attr = Some(pb::SetAttrChanges {
        size: Some(0),
        ..Default::default()
    });
    let e = a.data.write(sized).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert_eq!(stat(&mut a).await, attr, "nothing changed");
    release(&mut a, sa, ha).await;
    srv.stop().await;
}
