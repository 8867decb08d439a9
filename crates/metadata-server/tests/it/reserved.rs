//! Inode numbers reserved to a session (`ReserveInodes`) and creates that name one
//! (`CreateRequest.inode`; docs/protocol.md "Creates answered by the agent"): over gRPC, a
//! number is used once, only by its session, with its generation and its known handle, and
//! bad requests change nothing; at the store level the reservation survives a crash.

use sanfs_mds::clock::Clock;
use sanfs_mds::store::backend::{FaultPlan, SimDisk};
use sanfs_mds::store::{Backend, Store};
use sanfs_proto::pb;
use sanfs_proto::types::SessionId;
use tonic::Code;

use crate::harness::{Clients, root, rw, start};

fn with<T>(session: u64, req: T) -> tonic::Request<T> {
    let mut r = tonic::Request::new(req);
    sanfs_proto::headers::set_session(r.metadata_mut(), SessionId(session));
    r
}

fn create(session: u64, name: &str, inode: u64, exclusive: bool) -> pb::CreateRequest {
    pb::CreateRequest {
        cred: root(),
        session,
        parent: 1,
        name: name.into(),
        perm: 0o640,
        exclusive,
        flags: rw(),
        delegate: false,
        inode,
        time: None,
        request_id: None,
    }
}

async fn reserve(
    c: &mut Clients,
    session: u64,
    count: u32,
) -> Result<pb::ReserveInodesReply, Code> {
    c.ns.reserve_inodes(with(session, pb::ReserveInodesRequest { session, count }))
        .await
        .map(tonic::Response::into_inner)
        .map_err(|s| s.code())
}

async fn root_attr(c: &mut Clients) -> pb::Attr {
    attr_of(c, 1).await
}

async fn attr_of(c: &mut Clients, inode: u64) -> pb::Attr {
    let got = c.ns.get_attr(pb::GetAttrRequest {
        cred: root(),
        inode,
        session: None,
    });
    got.await.unwrap().into_inner().attr.unwrap()
}

async fn exists(c: &mut Clients, name: &str) -> bool {
    c.ns.lookup(pb::LookupRequest {
        cred: root(),
        parent: 1,
        name: name.into(),
        session: None,
    })
    .await
    .is_ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reserved_number_makes_one_file_of_its_session_with_its_generation_and_handle() {
    let srv = start().await;
    let mut a = srv.clients().await;
    let mut b = srv.clients().await;
    let (sa, _) = a.open_session().await;
    let (sb, _) = b.open_session().await;
    let r = reserve(&mut a, sa, 8).await.unwrap();
    assert_eq!(r.count, 8);
    let (first, generation) = (r.first_inode, r.first_generation);

    let made =
        a.ns.create(with(sa, create(sa, "x", first + 3, true)))
            .await
            .unwrap()
            .into_inner();
    let attr = made.attr.unwrap();
    assert_eq!(attr.ino, first + 3);
    assert_eq!(attr.generation, generation + 3);
    assert_eq!(attr.perm, 0o640);
    assert!(made.created);
    assert_eq!(
        made.handle,
        (first + 3) | (1 << 63),
        "the handle the agent knows"
    );
    // The handle is a real one: it closes.
    a.ns.release(pb::ReleaseRequest {
        session: sa,
        handle: made.handle,
    })
    .await
    .unwrap();

    // Refused, and nothing made: the number again, another session's number, a number never
    // reserved, and a create with a number that is not exclusive.
    let refusals = [
        (false, "again", first + 3, true),
        (true, "theirs", first + 4, true),
        (false, "unknown", first + 100, true),
        (false, "shared", first + 5, false),
    ];
    for (by_b, name, ino, exclusive) in refusals {
        let (c, s) = if by_b { (&mut b, sb) } else { (&mut a, sa) };
        let e =
            c.ns.create(with(s, create(s, name, ino, exclusive)))
                .await
                .unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{name}: {e:?}");
        assert!(!exists(c, name).await, "{name} was made");
    }
    // The number of a refused non-exclusive create is still free to use.
    let made =
        a.ns.create(with(sa, create(sa, "shared", first + 5, true)))
            .await
            .unwrap()
            .into_inner();
    assert_eq!(made.attr.unwrap().ino, first + 5);
    // A taken name: refused (EEXIST), and its number is spent, not given to another name.
    let e =
        a.ns.create(with(sa, create(sa, "x", first + 6, true)))
            .await
            .unwrap_err();
    assert_eq!(e.code(), Code::AlreadyExists, "{e:?}");

    // A file the server numbers itself never gets a reserved number.
    let (plain, _) = a.create_file(sa, "plain").await;
    assert!(
        plain >= first + 8,
        "{plain} is within {first}..{}",
        first + 8
    );

    // Bad counts; and at most four reservations with numbers left per session.
    assert_eq!(
        reserve(&mut a, sa, 0).await.unwrap_err(),
        Code::InvalidArgument
    );
    assert_eq!(
        reserve(&mut a, sa, 4097).await.unwrap_err(),
        Code::InvalidArgument
    );
    for _ in 0..3 {
        reserve(&mut a, sa, 1).await.unwrap();
    }
    assert_eq!(
        reserve(&mut a, sa, 1).await.unwrap_err(),
        Code::InvalidArgument
    );
    assert!(
        reserve(&mut b, sb, 1).await.is_ok(),
        "another session has its own room"
    );

    let dir = srv.stop_keeping_files().await;
    let report = sanfs_mds::fsck::check(&Backend::File(dir.path().join("mds.redb"))).unwrap();
    assert!(report.is_clean(), "fsck:\n{report}");
}

/// A create the agent answered gives the time its application saw: the file and the
/// parent's change get it, up to a second ahead of the server's clock (the unit test of
/// `agent_time` has the bounds), and the parent's times never go back; a time on a create
/// without a reserved number, or out of range, is refused and makes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_answered_by_its_agent_keeps_the_agents_time() {
    let srv = start().await;
    let mut a = srv.clients().await;
    let (sa, _) = a.open_session().await;
    let r = reserve(&mut a, sa, 4).await.unwrap();
    // The server's clock, as a create it times itself shows it.
    let plain =
        a.ns.create(with(sa, create(sa, "plain", 0, true)))
            .await
            .unwrap()
            .into_inner();
    let now = plain.attr.unwrap().mtime.unwrap();
    let key = |t: &pb::Timestamp| (t.sec, t.nsec);
    let at = |sec: i64, nsec: u32| Some(pb::Timestamp { sec, nsec });
    let timed = |name: &str, ino: u64, time: Option<pb::Timestamp>| pb::CreateRequest {
        time,
        ..create(sa, name, ino, true)
    };
    let cases = [
        // The agent's time, kept to the nanosecond.
        ("kept", at(now.sec, now.nsec + 1)),
        // Before the parent's last change (the create above): the file's own; the parent
        // keeps its later time.
        ("behind", at(now.sec - 30, 7)),
        // Far ahead of the server's clock: a second ahead of it.
        ("ahead", at(now.sec + 60, 0)),
    ];
    for (i, (name, sent)) in cases.into_iter().enumerate() {
        let before = root_attr(&mut a).await.mtime.unwrap();
        let made =
            a.ns.create(with(sa, timed(name, r.first_inode + i as u64, sent)))
                .await
                .unwrap()
                .into_inner();
        let attr = made.attr.unwrap();
        let t = attr.mtime.unwrap();
        let dir = root_attr(&mut a).await;
        let parent = if name == "behind" { before } else { t };
        assert_eq!(dir.mtime, Some(parent), "{name}: the parent's mtime");
        assert_eq!(dir.ctime, Some(parent), "{name}: the parent's ctime");
        match name {
            "kept" | "behind" => assert_eq!(Some(t), sent),
            _ => assert!(
                key(&t) >= (now.sec + 1, now.nsec) && t.sec <= now.sec + 30,
                "{t:?} vs {now:?}"
            ),
        }
        assert_eq!(attr.ctime, attr.mtime, "{name}");
        assert_eq!(attr.atime, attr.mtime, "{name}");
    }
    // A time without a reserved number, and a time with nanoseconds out of range: refused.
    for (name, ino, time) in [
        ("untimely", 0, at(now.sec, 0)),
        ("bad-nsec", r.first_inode + 3, at(now.sec, 1_000_000_000)),
    ] {
        let e =
            a.ns.create(with(sa, timed(name, ino, time)))
                .await
                .unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{name}: {e:?}");
        assert!(!exists(&mut a, name).await, "{name} was made");
    }
}

/// The counters a reservation advanced are durable when it is answered: after a crash no new
/// file gets a reserved number, and a replayed create still can.
#[test]
fn a_reservation_survives_a_crash() {
    let disk = SimDisk::new(FaultPlan::default());
    let backend = Backend::Sim(disk.clone());
    sanfs_testcluster::mds::create_store(&backend, &crate::support::fs_info(), &Clock::System)
        .unwrap();
    let store = Store::open(&backend, Clock::System, 16).unwrap();
    let (first, _) = store
        .write_blocking(|ctx| ctx.reserve_inode_numbers(100))
        .unwrap();
    disk.crash_now();
    drop(store);
    let disk = SimDisk::from_image(disk.durable_image(), FaultPlan::default());
    let store = Store::open(&Backend::Sim(disk), Clock::System, 16).unwrap();
    let made = crate::coherence::create_in(&store, "after");
    assert!(
        made >= first + 100,
        "{made} is within {first}..{}",
        first + 100
    );
}

fn mkdir(name: &str, parent: u64, delegate: bool) -> pb::MkdirRequest {
    pb::MkdirRequest {
        cred: root(),
        parent,
        name: name.into(),
        perm: 0o755,
        delegate,
        request_id: None,
    }
}

/// A's agent, as far as the server sees it: lease recalls of attributes and names are
/// acknowledged at once; recalls of create delegations come out of the answer, for the test
/// to send its creates before it acknowledges them.
fn recalls_of_creates(
    stream: crate::lease::Stream,
) -> (
    tokio::sync::mpsc::Receiver<pb::LeaseRecall>,
    tokio::sync::mpsc::Sender<pb::SessionStreamRequest>,
) {
    let crate::lease::Stream { tx, mut rx } = stream;
    let (out, recalls) = tokio::sync::mpsc::channel(16);
    let acks = tx.clone();
    tokio::spawn(async move {
        while let Ok(Some(m)) = rx.message().await {
            let Some(pb::session_stream_reply::Event::LeaseRecall(r)) = m.event else {
                continue;
            };
            if r.creates {
                if out.send(r).await.is_err() {
                    return;
                }
            } else {
                ack(&acks, r.id).await;
            }
        }
    });
    (recalls, tx)
}

async fn next_recall(r: &mut tokio::sync::mpsc::Receiver<pb::LeaseRecall>) -> pb::LeaseRecall {
    tokio::time::timeout(std::time::Duration::from_secs(10), r.recv())
        .await
        .expect("a recall of a create delegation within 10 s")
        .expect("the stream lives")
}

async fn ack(tx: &tokio::sync::mpsc::Sender<pb::SessionStreamRequest>, id: u64) {
    tx.send(pb::SessionStreamRequest {
        event: Some(pb::session_stream_request::Event::LeaseRecallAck(
            pb::LeaseRecallAck { id },
        )),
    })
    .await
    .unwrap();
}

/// What issue 19's creates answered by the agent rely on: a directory made with its create
/// delegation asked for is delegated to its maker's session alone (with a stream to hear the
/// recall); another session's read of it (a lookup in it, a listing that shows it) or change
/// in it recalls the delegation first and waits until the holder has sent the creates it
/// answered, so that the read sees them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_sessions_look_into_a_delegated_directory_waits_for_the_creates_answered_there() {
    let srv = start().await;
    let mut a = srv.clients().await;
    let mut b = srv.clients().await;
    let (sa, epoch) = a.open_session().await;
    let (sb, _) = b.open_session().await;
    let stream = crate::lease::attach(&mut a, sa, epoch).await;
    crate::lease::heartbeat(&stream, 1).await;
    let (mut stream, acks) = recalls_of_creates(stream);

    let d =
        a.ns.mkdir(with(sa, mkdir("d", 1, true)))
            .await
            .unwrap()
            .into_inner();
    assert!(d.creates_ms > 0, "delegated to its maker");
    let d = d.attr.unwrap().ino;
    // Not without a stream to hear the recall, nor unasked.
    let e =
        b.ns.mkdir(with(sb, mkdir("e", 1, true)))
            .await
            .unwrap()
            .into_inner();
    assert_eq!(e.creates_ms, 0, "B has no stream");
    let f =
        a.ns.mkdir(with(sa, mkdir("f", 1, false)))
            .await
            .unwrap()
            .into_inner();
    assert_eq!(f.creates_ms, 0, "not asked");

    // A's own reads there recall nothing.
    let r = reserve(&mut a, sa, 4).await.unwrap();
    let mut own = a.ns.clone();
    own.lookup(pb::LookupRequest {
        cred: root(),
        parent: d,
        name: "x".into(),
        session: Some(sa),
    })
    .await
    .unwrap_err();

    // B looks for "x" in d while A (as its agent would) has answered a create of it that it
    // has not sent: B's lookup waits for A's recall to be acknowledged, and A sends the create
    // before it acknowledges.
    let mut looker = b.ns.clone();
    let lookup = tokio::spawn(async move {
        looker
            .lookup(pb::LookupRequest {
                cred: root(),
                parent: d,
                name: "x".into(),
                session: Some(sb),
            })
            .await
            .map(|r| r.into_inner().attr.unwrap().ino)
    });
    let recall = next_recall(&mut stream).await;
    assert_eq!((recall.inode, recall.creates), (d, true));
    assert!(!lookup.is_finished(), "B's lookup waits for the recall");
    let mut req = create(sa, "x", r.first_inode, true);
    req.parent = d;
    a.ns.create(with(sa, req)).await.unwrap();
    ack(&acks, recall.id).await;
    let found = tokio::time::timeout(std::time::Duration::from_secs(10), lookup)
        .await
        .unwrap()
        .unwrap()
        .expect("B finds the file A's application was told exists");
    assert_eq!(found, r.first_inode);

    // A change of B's in another delegated directory recalls it first, as does a listing
    // that shows one (its attributes count the files made in it).
    let g =
        a.ns.mkdir(with(sa, mkdir("g", 1, true)))
            .await
            .unwrap()
            .into_inner();
    assert!(g.creates_ms > 0);
    let g = g.attr.unwrap().ino;
    let mut changer = b.ns.clone();
    let change = tokio::spawn(async move {
        let mut req = create(sb, "y", 0, true);
        req.parent = g;
        changer.create(with(sb, req)).await.map(drop)
    });
    let recall = next_recall(&mut stream).await;
    assert_eq!((recall.inode, recall.creates), (g, true));
    ack(&acks, recall.id).await;
    change.await.unwrap().unwrap();

    let h =
        a.ns.mkdir(with(sa, mkdir("h", 1, true)))
            .await
            .unwrap()
            .into_inner();
    let h = h.attr.unwrap().ino;
    let mut lister = b.ns.clone();
    let list = tokio::spawn(async move {
        lister
            .read_dir(with(
                sb,
                pb::ReadDirRequest {
                    cred: root(),
                    inode: 1,
                    cookie: 0,
                    max_entries: 100,
                    plus: true,
                    session: Some(sb),
                },
            ))
            .await
            .map(drop)
    });
    let recall = next_recall(&mut stream).await;
    assert_eq!((recall.inode, recall.creates), (h, true));
    ack(&acks, recall.id).await;
    list.await.unwrap().unwrap();
    srv.stop().await;
}

/// `CreateBatch`: each create answered on its own, in order (made, or refused with its
/// error number, the others made all the same); a batch with a create that names no
/// reserved number, or with none at all, is refused whole and makes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_of_creates_is_answered_one_by_one() {
    let srv = start().await;
    let mut a = srv.clients().await;
    let (sa, _) = a.open_session().await;
    let r = reserve(&mut a, sa, 8).await.unwrap();
    let f = r.first_inode;
    a.create_file(sa, "taken").await;
    let batch = |items: Vec<(&str, u64)>| pb::CreateBatchRequest {
        creates: items
            .into_iter()
            .map(|(name, ino)| create(sa, name, ino, true))
            .collect(),
    };
    let reply =
        a.ns.create_batch(with(
            sa,
            batch(vec![("b1", f), ("b2", f), ("taken", f + 1), ("b3", f + 2)]),
        ))
        .await
        .unwrap()
        .into_inner();
    let got: Vec<(Option<u64>, u32)> = reply
        .results
        .iter()
        .map(|r| {
            (
                r.reply
                    .as_ref()
                    .and_then(|c| c.attr.as_ref())
                    .map(|a| a.ino),
                r.errno,
            )
        })
        .collect();
    assert_eq!(
        got,
        vec![
            (Some(f), 0),
            (None, libc_einval()),
            (None, libc_eexist()),
            (Some(f + 2), 0)
        ]
    );
    assert!(reply.results[0].commit_seq > 0 || reply.results[0].durable_seq > 0);
    assert!(exists(&mut a, "b1").await && exists(&mut a, "b3").await);
    assert!(!exists(&mut a, "b2").await);
    // Refused whole: a create without its number, or an empty batch.
    for bad in [batch(vec![("c1", f + 3), ("c2", 0)]), batch(vec![])] {
        let e = a.ns.create_batch(with(sa, bad)).await.unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    }
    assert!(!exists(&mut a, "c1").await);
    srv.stop().await;
}

/// `ChangeBatch`: unlinks and renames side by side, each answered on its own (one refusal
/// does not stop the others), each with its commit; a batch naming one entry twice, an
/// empty one, or one with a replay header is refused whole and changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_of_unlinks_and_renames_is_answered_one_by_one() {
    use pb::batched_change::Change;
    let srv = start().await;
    let mut a = srv.clients().await;
    let (sa, _) = a.open_session().await;
    for name in ["u1", "u2", "r1", "r2", "keep"] {
        a.create_file(sa, name).await;
    }
    let unlink = |name: &str| pb::BatchedChange {
        change: Some(Change::Unlink(pb::UnlinkRequest {
            cred: root(),
            parent: 1,
            name: name.into(),
            request_id: None,
        })),
    };
    let rename = |from: &str, to: &str| pb::BatchedChange {
        change: Some(Change::Rename(pb::RenameRequest {
            cred: root(),
            old_parent: 1,
            old_name: from.into(),
            new_parent: 1,
            new_name: to.into(),
            mode: pb::RenameMode::Noreplace as i32,
            request_id: None,
        })),
    };
    let batch = |changes| pb::ChangeBatchRequest { changes };
    let reply =
        a.ns.change_batch(with(
            sa,
            batch(vec![
                unlink("u1"),
                rename("r1", "s1"),
                unlink("missing"),
                rename("r2", "keep"),
                unlink("u2"),
            ]),
        ))
        .await
        .unwrap()
        .into_inner();
    let errnos: Vec<u32> = reply.results.iter().map(|r| r.errno).collect();
    assert_eq!(errnos, vec![0, 0, 2, libc_eexist(), 0]);
    assert!(reply.results[0].commit_seq > 0 || reply.results[0].durable_seq > 0);
    for (name, there) in [
        ("u1", false),
        ("u2", false),
        ("r1", false),
        ("s1", true),
        ("r2", true),
        ("keep", true),
    ] {
        assert_eq!(exists(&mut a, name).await, there, "{name}");
    }
    // Refused whole: one entry twice (here "keep", renamed over and unlinked), or nothing.
    for bad in [
        batch(vec![rename("r2", "t2"), unlink("t2")]),
        batch(vec![unlink("keep"), rename("s1", "keep")]),
        batch(vec![]),
    ] {
        let e = a.ns.change_batch(with(sa, bad)).await.unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    }
    assert!(exists(&mut a, "r2").await && exists(&mut a, "keep").await);
    assert!(!exists(&mut a, "t2").await);
    srv.stop().await;
}

fn libc_einval() -> u32 {
    22
}

fn libc_eexist() -> u32 {
    17
}

/// `ChangeBatch` with attribute changes (a directory's `chmod` and `utimensat` answered by
/// its agent): each made as `SetAttr` makes it, with the ctime the agent gave; one the
/// caller may not make is refused on its own and changes nothing; one with a size, or
/// beside an unlink in its directory, refuses the batch whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_makes_attribute_changes_with_their_ctime_and_refuses_them_alone() {
    use pb::batched_change::Change;
    let srv = start().await;
    let mut a = srv.clients().await;
    let (sa, _) = a.open_session().await;
    let (f, _) = a.create_file(sa, "f").await;
    let at = |sec: i64, nsec: u32| pb::Timestamp { sec, nsec };
    let set = |cred: Option<pb::Credentials>, inode: u64, size: Option<u64>| pb::BatchedChange {
        change: Some(Change::SetAttr(pb::SetAttrRequest {
            cred,
            inode,
            changes: Some(pb::SetAttrChanges {
                perm: Some(0o750),
                size,
                mtime: Some(pb::TimeSet {
                    value: Some(pb::time_set::Value::At(at(1000, 0))),
                }),
                ctime: Some(at(2000, 5)),
                ..Default::default()
            }),
            handle: None,
            session: None,
        })),
    };
    let stranger = Some(pb::Credentials {
        uid: 1000,
        gid: 1000,
        groups: vec![],
    });
    let file_attr = |a: &pb::Attr| (a.perm, a.mtime, a.ctime);
    let before = file_attr(&attr_of(&mut a, f).await);
    let reply =
        a.ns.change_batch(with(
            sa,
            pb::ChangeBatchRequest {
                changes: vec![set(root(), 1, None), set(stranger, f, None)],
            },
        ))
        .await
        .unwrap()
        .into_inner();
    let errnos: Vec<u32> = reply.results.iter().map(|r| r.errno).collect();
    assert_eq!(errnos, vec![0, 1], "made, and EPERM for a stranger");
    let dir = root_attr(&mut a).await;
    assert_eq!(
        (dir.perm & 0o7777, dir.mtime, dir.ctime),
        (0o750, Some(at(1000, 0)), Some(at(2000, 5)))
    );
    let after = file_attr(&attr_of(&mut a, f).await);
    assert_eq!(after, before, "the refused change changed nothing");
    let unlink = pb::BatchedChange {
        change: Some(Change::Unlink(pb::UnlinkRequest {
            cred: root(),
            parent: 1,
            name: "f".into(),
            request_id: None,
        })),
    };
    for bad in [
        vec![set(root(), f, Some(0))],
        vec![set(root(), 1, None), unlink],
    ] {
        let e =
            a.ns.change_batch(with(sa, pb::ChangeBatchRequest { changes: bad }))
                .await
                .unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    }
    assert!(exists(&mut a, "f").await);
    srv.stop().await;
}
