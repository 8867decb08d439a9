//! Attribute and entry leases on the wire (docs/protocol.md "Attribute and entry leases"):
//! the lease terms of Lookup, GetAttr and ReadDir replies, the session Lookup and ReadDir
//! name, and LeaseRecall / LeaseRecallAck on the session stream: round trips, and each rule
//! refused with the field named.

use sanfs_proto::model::*;
use sanfs_proto::pb;
use sanfs_proto::types::*;

use crate::fixtures::*;

fn entry() -> EntryRequest {
    EntryRequest {
        cred: cred(),
        parent: ROOT_INODE,
        name: name("f"),
    }
}

fn readdir() -> ReadDirRequest {
    ReadDirRequest {
        cred: cred(),
        inode: ROOT_INODE,
        cookie: 0,
        max_entries: 10,
        plus: true,
    }
}

fn path_of<D, P>(p: P) -> String
where
    D: std::fmt::Debug + TryFrom<P, Error = ProtocolError>,
{
    let e = D::try_from(p).expect_err("must be refused");
    e.field_path().unwrap_or_default()
}

#[test]
fn leased_requests_and_replies_round_trip() {
    for session in [None, Some(SessionId(7))] {
        round_trip::<_, pb::LookupRequest>(LeasedLookup {
            entry: entry(),
            session,
        });
        round_trip::<_, pb::ReadDirRequest>(LeasedReadDir {
            request: readdir(),
            session,
        });
    }
    for lease_ms in [0, 10_000, MAX_LEASE_MS] {
        let leased = Leased {
            value: attr(5, FileType::Regular),
            lease_ms,
        };
        round_trip::<_, pb::LookupReply>(leased.clone());
        round_trip::<_, pb::SetAttrReply>(leased.clone());
        round_trip::<_, pb::GetAttrReply>(leased);
        round_trip::<_, pb::ReadDirReply>(Leased {
            value: ReadDirReply {
                entries: vec![],
                eof: true,
                parent: ROOT_INODE,
            },
            lease_ms,
        });
    }
    // The plain conversions ask for and carry no lease.
    assert_eq!(pb::LookupRequest::from(entry()).session, None);
    assert_eq!(pb::ReadDirRequest::from(readdir()).session, None);
    assert_eq!(
        pb::GetAttrReply::from(attr(5, FileType::Regular)).lease_ms,
        0
    );
}

#[test]
fn lease_recalls_and_their_acks_round_trip() {
    for (attr, entries, creates) in [
        (true, false, false),
        (false, true, false),
        (true, true, false),
        (false, false, true),
        (true, true, true),
    ] {
        round_trip::<_, pb::SessionStreamReply>(ServerEvent::LeaseRecall(LeaseRecall {
            id: 3,
            inode: InodeId(42),
            attr,
            entries,
            creates,
        }));
    }
    round_trip::<_, pb::SessionStreamRequest>(ClientEvent::LeaseRecallAck { id: u64::MAX });
}

#[test]
fn bad_leases_are_refused_naming_the_field() {
    let mut p = pb::LookupRequest::from(LeasedLookup {
        entry: entry(),
        session: None,
    });
    p.session = Some(0);
    assert_eq!(path_of::<LeasedLookup, _>(p), "session");
    let mut p = pb::ReadDirRequest::from(LeasedReadDir {
        request: readdir(),
        session: None,
    });
    p.session = Some(0);
    assert_eq!(path_of::<LeasedReadDir, _>(p.clone()), "session");
    p.session = Some(1);
    p.max_entries = 0;
    assert_eq!(path_of::<LeasedReadDir, _>(p), "max_entries");
    let leased = Leased {
        value: attr(5, FileType::Regular),
        lease_ms: MAX_LEASE_MS + 1,
    };
    let p = pb::LookupReply {
        attr: Some(leased.value.clone().into()),
        lease_ms: leased.lease_ms,
    };
    assert_eq!(path_of::<Leased<Attr>, _>(p), "lease_ms");
    let p = pb::GetAttrReply {
        attr: None,
        lease_ms: 1,
    };
    assert_eq!(path_of::<Leased<Attr>, _>(p), "attr");
    let p = pb::SetAttrReply {
        attr: Some(leased.value.clone().into()),
        lease_ms: u64::MAX,
    };
    assert_eq!(path_of::<Leased<Attr>, _>(p), "lease_ms");
    let p = pb::ReadDirReply {
        parent: 1,
        lease_ms: u64::MAX,
        ..Default::default()
    };
    assert_eq!(path_of::<Leased<ReadDirReply>, _>(p), "lease_ms");

    use pb::session_stream_reply::Event as S;
    let recall = |id, inode, attr, entries| pb::SessionStreamReply {
        event: Some(S::LeaseRecall(pb::LeaseRecall {
            id,
            inode,
            attr,
            entries,
            creates: false,
        })),
    };
    assert_eq!(
        path_of::<ServerEvent, _>(recall(0, 5, true, false)),
        "lease_recall.id"
    );
    assert_eq!(
        path_of::<ServerEvent, _>(recall(1, 0, true, false)),
        "lease_recall.inode"
    );
    assert_eq!(
        path_of::<ServerEvent, _>(recall(1, 5, false, false)),
        "lease_recall.attr"
    );
    use pb::session_stream_request::Event as C;
    let ack = pb::SessionStreamRequest {
        event: Some(C::LeaseRecallAck(pb::LeaseRecallAck { id: 0 })),
    };
    assert_eq!(path_of::<ClientEvent, _>(ack), "lease_recall_ack.id");
}
