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
