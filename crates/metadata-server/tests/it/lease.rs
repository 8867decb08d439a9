//! Grants and leases through the real gRPC services, with real time (lease TTL 1 s) and real
//! LUNs: a cached read grant is recalled before a conflicting write; a client that ignores
//! the recall and stops heartbeating loses its grants within TTL + 1 s of its last
//! heartbeat, its locks go, and the range its uncompleted write grant covered reads as zeros
//! through both paths. A `GetAttr` waits for the write grants on its file and answers the
//! completed size.

use std::time::{Duration, Instant};

use sanfs_proto::pb;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use crate::harness::{Clients, root, rw, start_with_luns};

const MIB: u64 = 1 << 20;
const TTL_MS: u64 = 1000;

/// An attached session stream: what the client sends, what it receives.
pub(crate) struct Stream {
    pub(crate) tx: mpsc::Sender<pb::SessionStreamRequest>,
    pub(crate) rx: tonic::Streaming<pb::SessionStreamReply>,
}

pub(crate) async fn attach(c: &mut Clients, session: u64, epoch: u64) -> Stream {
    let (tx, rx) = mpsc::channel(16);
    tx.send(pb::SessionStreamRequest {
        event: Some(pb::session_stream_request::Event::Attach(pb::Attach {
            session,
            epoch,
        })),
    })
    .await
    .unwrap();
    let rx = c
        .session
        .session_stream(ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    Stream { tx, rx }
}

pub(crate) async fn heartbeat(s: &Stream, seq: u64) {
    s.tx.send(pb::SessionStreamRequest {
        event: Some(pb::session_stream_request::Event::Heartbeat(
            pb::Heartbeat { seq, renew: None },
        )),
    })
    .await
    .unwrap();
}

async fn open(c: &mut Clients, session: u64, ino: u64) -> u64 {
    c.ns.open(pb::OpenRequest {
        cred: root(),
        session,
        inode: ino,
        flags: rw(),
        read_small: 0,
    })
    .await
    .unwrap()
    .into_inner()
    .handle
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ignored_recall_and_a_silent_client_lose_their_grants_within_ttl_plus_one_second() {
    let srv = start_with_luns(TTL_MS).await;
    let mut a = srv.clients().await;
    let mut b = srv.clients().await;
    let (sa, epoch) = a.open_session().await;
    let (sb, _) = b.open_session().await;
    let mut stream_a = attach(&mut a, sa, epoch).await;
    let stream_b = attach(&mut b, sb, epoch).await;
    // B keeps its lease for the whole test.
    let hb = tokio::spawn(async move {
        for seq in 1.. {
            heartbeat(&stream_b, seq).await;
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    });

    // A writes 1 MiB of 0x5a the proxied way, then takes a cached read grant of it and a
    // write grant over the next MiB that it never completes.
    let (ino, ha) = a.create_file(sa, "f").await;
    a.data
        .write(pb::WriteRequest {
            cred: root(),
            session: sa,
            handle: ha,
            inode: ino,
            offset: 0,
            data: vec![0x5a; MIB as usize],
            sync: true,
            append: false,
            request_id: None,
            then_set_attr: None,
        })
        .await
        .unwrap();
    let map = |session: u64, handle: u64, offset: u64, length: u64| pb::MapRequest {
        cred: root(),
        session,
        epoch,
        handle,
        inode: ino,
        offset,
        length,
        sync: false,
        ..Default::default()
    };
    let cached = a
        .data
        .map_read(map(sa, ha, 0, MIB))
        .await
        .unwrap()
        .into_inner();
    assert!(
        cached.cacheable,
        "a session with a stream gets cacheable read grants"
    );
    let abandoned = a
        .data
        .map_write(map(sa, ha, MIB, MIB))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(abandoned.device_ios.iter().map(|d| d.len).sum::<u64>(), MIB);
    heartbeat(&stream_a, 1).await;
    let last_heartbeat = Instant::now();
    // From now on A is silent and ignores every recall.

    // B wants to write the first 64 KiB: A's cached read grant is recalled first.
    let hbh = open(&mut b, sb, ino).await;
    let mut b2 = b.data.clone();
    let write_req = map(sb, hbh, 0, 64 * 1024);
    let writer = tokio::spawn(async move { (b2.map_write(write_req).await, Instant::now()) });
    let recall = loop {
        let m = tokio::time::timeout(Duration::from_secs(5), stream_a.rx.message())
            .await
            .expect("a recall within 5 s")
            .unwrap()
            .unwrap();
        if let Some(pb::session_stream_reply::Event::Recall(r)) = m.event {
            break r;
        }
    };
    assert_eq!(recall.grant_ids, vec![cached.grant_id]);
    let (granted, at) = writer.await.unwrap();
    let waited = at - last_heartbeat;
    eprintln!(
        "a silent session's grants went {waited:?} after its last heartbeat (TTL {TTL_MS} ms)"
    );
    let grant = granted.unwrap().into_inner();
    // The server drops them TTL + grace (250 ms here) after the last heartbeat, scanning
    // every 50 ms: about TTL + 0.3 s (measured and printed above; docs/performance.md). The
    // bound here leaves room for a loaded CI machine; timing goals live in benchmarks.
    assert!(
        waited <= Duration::from_millis(TTL_MS + 3000),
        "grants of a silent session must go soon after their lease, took {waited:?}"
    );
    assert!(
        waited >= Duration::from_millis(TTL_MS),
        "not before the lease ran out: {waited:?}"
    );
    b.data
        .complete(pb::CompleteRequest {
            session: sb,
            epoch,
            grant_id: grant.grant_id,
            status: pb::IoStatus::Ok as i32,
            errors: vec![],
            bytes_done: 0,
            sync: false,
            ..Default::default()
        })
        .await
        .unwrap();

    // A's session is gone: its Complete is refused.
    let late = a
        .data
        .complete(pb::CompleteRequest {
            session: sa,
            epoch,
            grant_id: abandoned.grant_id,
            status: pb::IoStatus::Ok as i32,
            errors: vec![],
            bytes_done: MIB,
            sync: false,
            ..Default::default()
        })
        .await;
    assert!(
        late.is_err(),
        "a Complete of an expired session was accepted"
    );

    // The abandoned range reads as zeros through both paths once B extends the file over it.
    b.data
        .write(pb::WriteRequest {
            cred: root(),
            session: sb,
            handle: hbh,
            inode: ino,
            offset: 2 * MIB - 1,
            data: vec![1],
            sync: false,
            append: false,
            request_id: None,
            then_set_attr: None,
        })
        .await
        .unwrap();
    let proxied = b
        .data
        .read(pb::ReadRequest {
            cred: root(),
            session: sb,
            handle: hbh,
            inode: ino,
            offset: MIB,
            length: 64 * 1024,
        })
        .await
        .unwrap()
        .into_inner()
        .data;
    assert!(
        proxied.iter().all(|x| *x == 0),
        "proxied read of the abandoned range"
    );
    let rg = b
        .data
        .map_read(map(sb, hbh, MIB, MIB))
        .await
        .unwrap()
        .into_inner();
    let zero: u64 = rg.zero_fill.iter().map(|z| z.len).sum();
    assert!(
        zero >= MIB - 4096,
        "the abandoned range is zero fill in a read grant: {rg:?}"
    );
    hb.abort();
    srv.stop().await;
}

/// A `GetAttr` waits for the write grants on its file to end (`Grants::settle_attr`), and is
/// woken when the last one is completed: it answers the completed size at once, long before
/// its bound (the lock timeout, over 20 s with this lease) would have let it read without.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_getattr_waits_for_a_write_grant_and_answers_once_it_is_completed() {
    let srv = start_with_luns(10_000).await;
    let mut a = srv.clients().await;
    let mut b = srv.clients().await;
    let (sa, epoch) = a.open_session().await;
    let (ino, ha) = a.create_file(sa, "settled").await;
    let grant = a
        .data
        .map_write(pb::MapRequest {
            cred: root(),
            session: sa,
            epoch,
            handle: ha,
            inode: ino,
            offset: 0,
            length: MIB,
            sync: false,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let getattr = tokio::spawn(async move {
        b.ns.get_attr(pb::GetAttrRequest {
            cred: root(),
            inode: ino,
            session: None,
        })
        .await
        .map(|r| r.into_inner().attr.unwrap())
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !getattr.is_finished(),
        "GetAttr answered while a write grant on the file was live"
    );
    a.data
        .complete(pb::CompleteRequest {
            session: sa,
            epoch,
            grant_id: grant.grant_id,
            status: pb::IoStatus::Ok as i32,
            errors: vec![],
            bytes_done: MIB,
            sync: false,
            ..Default::default()
        })
        .await
        .unwrap();
    let attr = tokio::time::timeout(Duration::from_secs(5), getattr)
        .await
        .expect("GetAttr is woken when the grant ends, not at its bound")
        .unwrap()
        .unwrap();
    assert_eq!(attr.size, MIB, "the completed write's size");
    srv.stop().await;
}

/// A session that closes its last handle on a file while one of its grants there waits for
/// its lock (an agent's read-ahead or write-back still asking as the application closes)
/// loses that grant, not its session: the call is answered `Stale` (as for the closed
/// handle), never `StaleSession`, which would make the agent drop the session and every
/// file it has open with it. (The two-mount exerciser's agents lost their sessions so.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_ended_by_the_close_of_its_file_does_not_end_the_session() {
    use sanfs_proto::status::fs_error_from_status;
    use sanfs_proto::types::FsError;
    let srv = start_with_luns(10_000).await;
    let mut a = srv.clients().await;
    let mut b = srv.clients().await;
    let (sa, epoch) = a.open_session().await;
    let (sb, _) = b.open_session().await;
    let stream_b = attach(&mut b, sb, epoch).await;
    heartbeat(&stream_b, 1).await;
    let (ino, ha) = a.create_file(sa, "closed-while-waiting").await;
    let map = move |session: u64, handle: u64, length: u64| pb::MapRequest {
        cred: root(),
        session,
        epoch,
        handle,
        inode: ino,
        offset: 0,
        length,
        sync: false,
        ..Default::default()
    };
    // A writes: B's read waits for A's grant.
    let grant = a
        .data
        .map_write(map(sa, ha, MIB))
        .await
        .unwrap()
        .into_inner();
    let hb = open(&mut b, sb, ino).await;
    let mut reader = b.data.clone();
    let read = tokio::spawn(async move { reader.map_read(map(sb, hb, 64 * 1024)).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!read.is_finished(), "the read waits for the write grant");
    // B closes the file while its read grant waits.
    b.ns.release(pb::ReleaseRequest {
        session: sb,
        handle: hb,
    })
    .await
    .unwrap();
    a.data
        .complete(pb::CompleteRequest {
            session: sa,
            epoch,
            grant_id: grant.grant_id,
            status: pb::IoStatus::Ok as i32,
            errors: vec![],
            bytes_done: MIB,
            sync: false,
            ..Default::default()
        })
        .await
        .unwrap();
    let answered = tokio::time::timeout(Duration::from_secs(5), read)
        .await
        .expect("the read is answered once the write grant ends")
        .unwrap();
    if let Err(status) = &answered {
        assert_eq!(
            fs_error_from_status(status),
            FsError::Stale,
            "the file was closed, the session lives: {status:?}"
        );
    }
    // The session lives: B opens the file again and reads it.
    let hb = open(&mut b, sb, ino).await;
    b.data
        .map_read(map(sb, hb, 64 * 1024))
        .await
        .expect("the session still serves");
    srv.stop().await;
}
