//! domain -> pb -> bytes -> pb -> domain gives the value back, for every message family and
//! every enum value.

use sanfs_blockmap::volume::{DeviceIndex, Volume};
use sanfs_proto::model::*;
use sanfs_proto::pb;
use sanfs_proto::types::*;
use uuid::Uuid;

use crate::fixtures::*;

const ALL_TYPES: [FileType; 7] = [
    FileType::Regular,
    FileType::Directory,
    FileType::Symlink,
    FileType::Fifo,
    FileType::Socket,
    FileType::CharDevice,
    FileType::BlockDevice,
];

#[test]
fn session_messages() {
    round_trip::<_, pb::OpenSessionRequest>(OpenSessionRequest {
        protocol_version: PROTOCOL_VERSION,
        client_name: "node-a".into(),
        host: "node-a.example".into(),
        agent_version: "0.1.0".into(),
    });
    let reply = round_trip::<_, pb::OpenSessionReply>(OpenSessionReply {
        session: SessionId(5),
        epoch: SessionEpoch(3),
        lease_ttl_ms: 15_000,
        server: server_info(),
    });
    assert_eq!(reply.server.unwrap().block_size, 4096);
    round_trip::<_, pb::ServerInfo>(server_info());
    let r = SessionRef {
        session: SessionId(5),
        epoch: SessionEpoch(3),
    };
    round_trip::<_, pb::CloseSessionRequest>(r);
    round_trip::<_, pb::Attach>(r);
}

#[test]
fn session_stream_events() {
    for e in [
        ClientEvent::Attach(SessionRef {
            session: SessionId(1),
            epoch: SessionEpoch(u64::MAX),
        }),
        ClientEvent::Heartbeat {
            seq: 0,
            renew: None,
        },
        ClientEvent::Heartbeat {
            seq: u64::MAX,
            renew: Some(LeaseRenew {
                attrs: vec![InodeId(1), InodeId(7)],
                entries: vec![InodeId(1)],
            }),
        },
        ClientEvent::Heartbeat {
            seq: 3,
            renew: Some(LeaseRenew::default()),
        },
        ClientEvent::RecallAck {
            grant_ids: vec![GrantId(1), GrantId(2)],
        },
        ClientEvent::GrantReturn {
            grant_ids: vec![GrantId(9)],
        },
    ] {
        round_trip::<_, pb::SessionStreamRequest>(e);
    }
    let mut events = vec![
        ServerEvent::HeartbeatAck {
            seq: 4,
            lease_ttl_ms: 10_000,
            durable_seq: 17,
            renewed: None,
        },
        ServerEvent::HeartbeatAck {
            seq: 5,
            lease_ttl_ms: 10_000,
            durable_seq: 0,
            renewed: Some(LeaseRenewed {
                lease_ms: 10_000,
                lost_attrs: vec![InodeId(9)],
                lost_entries: vec![],
            }),
        },
    ];
    for reason in [
        RecallReason::Conflict,
        RecallReason::LayoutChanged,
        RecallReason::Resource,
        RecallReason::Shutdown,
    ] {
        events.push(ServerEvent::Recall(Recall {
            grant_ids: vec![GrantId(3), GrantId(4)],
            inode: InodeId(42),
            range: range(4096, 8192),
            reason,
            delegation: reason == RecallReason::Conflict,
        }));
    }
    for reason in [
        SessionEndReason::Expired,
        SessionEndReason::Shutdown,
        SessionEndReason::Evicted,
        SessionEndReason::Replaced,
    ] {
        events.push(ServerEvent::Ended {
            reason,
            message: "bye".into(),
        });
    }
    for e in events {
        round_trip::<_, pb::SessionStreamReply>(e);
    }
}

#[test]
fn entry_and_inode_requests() {
    let e = EntryRequest {
        cred: cred(),
        parent: ROOT_INODE,
        name: FileName::new(vec![b'x'; NAME_MAX]).unwrap(),
    };
    round_trip::<_, pb::LookupRequest>(e.clone());
    round_trip::<_, pb::UnlinkRequest>(e.clone());
    round_trip::<_, pb::RmdirRequest>(e);
    let i = InodeRequest {
        cred: Credentials::root(),
        inode: InodeId(u64::MAX),
    };
    round_trip::<_, pb::GetAttrRequest>(GetAttrRequest {
        cred: Credentials::root(),
        inode: InodeId(7),
        session: None,
    });
    round_trip::<_, pb::GetAttrRequest>(GetAttrRequest {
        cred: Credentials::root(),
        inode: InodeId(7),
        session: Some(SessionId(9)),
    });
    round_trip::<_, pb::ReadlinkRequest>(i.clone());
    round_trip::<_, pb::StatFsRequest>(i.clone());
    round_trip::<_, pb::ListXattrRequest>(i.clone());
    round_trip::<_, pb::GetQuotaRequest>(i);
}

#[test]
fn attr_replies_of_every_file_type() {
    for (n, kind) in ALL_TYPES.into_iter().enumerate() {
        let mut a = attr(n as u64 + 2, kind);
        if matches!(kind, FileType::CharDevice | FileType::BlockDevice) {
            a.rdev = 0x0801;
        }
        round_trip::<_, pb::Attr>(a.clone());
        round_trip::<_, pb::LookupReply>(a.clone());
        round_trip::<_, pb::GetAttrReply>(a.clone());
        round_trip::<_, pb::SetAttrReply>(a.clone());
        round_trip::<_, pb::MkdirReply>(a.clone());
        round_trip::<_, pb::MknodReply>(a.clone());
        round_trip::<_, pb::LinkReply>(a.clone());
        round_trip::<_, pb::SymlinkReply>(a.clone());
        round_trip::<_, pb::CompleteReply>(CompleteReply {
            attr: a.clone(),
            commit_seq: 12,
            durable_seq: 11,
        });
        round_trip::<_, pb::FallocateReply>(a);
    }
}

#[test]
fn setattr_with_every_kind_of_change() {
    round_trip::<_, pb::SetAttrRequest>(SetAttrRequest {
        cred: cred(),
        inode: InodeId(42),
        changes: SetAttr {
            perm: Some(0o7777),
            uid: Some(0),
            gid: Some(u32::MAX),
            size: Some(MAX_FILE_SIZE),
            atime: Some(TimeSet::Now),
            mtime: Some(TimeSet::At(ts(i64::MIN, 999_999_999))),
            ctime: Some(ts(i64::MAX, 0)),
        },
        handle: Some(handle()),
    });
    round_trip::<_, pb::SetAttrRequest>(SetAttrRequest {
        cred: cred(),
        inode: InodeId(42),
        changes: SetAttr::default(),
        handle: None,
    });
    // Size 0 (truncate to zero) is a present field, not an absent one.
    let p = round_trip::<_, pb::SetAttrRequest>(SetAttrRequest {
        cred: cred(),
        inode: InodeId(42),
        changes: SetAttr {
            size: Some(0),
            ..SetAttr::default()
        },
        handle: None,
    });
    assert_eq!(p.changes.unwrap().size, Some(0));
}

#[test]
fn create_open_release_access() {
    let flags = OpenFlags {
        read: true,
        write: true,
        append: true,
        truncate: true,
    };
    round_trip::<_, pb::CreateRequest>(CreateRequest {
        cred: cred(),
        session: SessionId(5),
        parent: ROOT_INODE,
        name: name("file"),
        perm: 0o644,
        exclusive: true,
        flags,
        delegate: true,
        inode: None,
        time: None,
    });
    round_trip::<_, pb::CreateReply>(CreateReply {
        attr: attr(43, FileType::Regular),
        handle: OpenHandle(1),
        created: false,
        lease_ms: 10_000,
        delegation: None,
    });
    round_trip::<_, pb::CreateReply>(CreateReply {
        attr: attr(44, FileType::Regular),
        handle: OpenHandle(2),
        created: true,
        lease_ms: 10_000,
        delegation: Some(GrantId(17)),
    });
    round_trip::<_, pb::OpenRequest>(OpenRequest {
        cred: cred(),
        session: SessionId(5),
        inode: InodeId(43),
        flags: OpenFlags {
            read: true,
            write: false,
            append: false,
            truncate: false,
        },
        read_small: 65_536,
    });
    round_trip::<_, pb::OpenReply>(OpenReply {
        handle: OpenHandle(u64::MAX),
        attr: attr(43, FileType::Regular),
        data: None,
        lease_ms: 0,
    });
    let mut small = attr(43, FileType::Regular);
    small.size = 5;
    round_trip::<_, pb::OpenReply>(OpenReply {
        handle: OpenHandle(7),
        attr: small,
        data: Some(b"hello".to_vec()),
        lease_ms: 10_000,
    });
    round_trip::<_, pb::ReleaseRequest>(handle());
    for mask in 0..=7 {
        round_trip::<_, pb::AccessRequest>(AccessRequest {
            cred: cred(),
            inode: InodeId(43),
            mask,
        });
    }
}

#[test]
fn making_and_removing_names() {
    round_trip::<_, pb::MkdirRequest>(MkdirRequest {
        cred: cred(),
        parent: ROOT_INODE,
        name: name("dir"),
        perm: 0o1777,
        delegate: false,
    });
    for (kind, rdev) in [
        (FileType::Regular, 0),
        (FileType::Fifo, 0),
        (FileType::Socket, 0),
        (FileType::CharDevice, 0x0103),
        (FileType::BlockDevice, 0x0801),
    ] {
        round_trip::<_, pb::MknodRequest>(MknodRequest {
            cred: cred(),
            parent: ROOT_INODE,
            name: name("node"),
            kind,
            perm: 0o600,
            rdev,
        });
    }
    for mode in [
        RenameMode::Replace,
        RenameMode::NoReplace,
        RenameMode::Exchange,
    ] {
        round_trip::<_, pb::RenameRequest>(RenameRequest {
            cred: cred(),
            old_parent: InodeId(2),
            old_name: name("a"),
            new_parent: InodeId(3),
            new_name: name("b"),
            mode,
        });
    }
    round_trip::<_, pb::LinkRequest>(LinkRequest {
        cred: cred(),
        inode: InodeId(43),
        new_parent: InodeId(2),
        new_name: name("hard"),
    });
    let target = SymlinkTarget::new(vec![b'/'; SYMLINK_MAX]).unwrap();
    round_trip::<_, pb::SymlinkRequest>(SymlinkRequest {
        cred: cred(),
        parent: ROOT_INODE,
        name: name("sym"),
        target: target.clone(),
    });
    round_trip::<_, pb::ReadlinkReply>(target);
}

#[test]
fn readdir_pages_with_and_without_attrs() {
    round_trip::<_, pb::ReadDirRequest>(ReadDirRequest {
        cred: cred(),
        inode: ROOT_INODE,
        cookie: 0,
        max_entries: MAX_READDIR_ENTRIES,
        plus: true,
    });
    round_trip::<_, pb::ReadDirRequest>(ReadDirRequest {
        cred: cred(),
        inode: ROOT_INODE,
        cookie: FIRST_DIR_COOKIE,
        max_entries: 1,
        plus: false,
    });
    let entries: Vec<DirEntry> = (0..100u64)
        .map(|i| DirEntry {
            name: name(&format!("f{i}")),
            inode: InodeId(100 + i),
            kind: FileType::Regular,
            cookie: FIRST_DIR_COOKIE + i,
            attr: (i % 2 == 0).then(|| attr(100 + i, FileType::Regular)),
        })
        .collect();
    round_trip::<_, pb::ReadDirReply>(ReadDirReply {
        entries,
        eof: true,
        parent: ROOT_INODE,
    });
    round_trip::<_, pb::ReadDirReply>(ReadDirReply {
        entries: vec![],
        eof: false,
        parent: InodeId(9),
    });
}

#[test]
fn statfs_and_xattrs() {
    round_trip::<_, pb::StatFsReply>(StatFs {
        block_size: 4096,
        total_blocks: 1000,
        free_blocks: 600,
        avail_blocks: 500,
        total_inodes: 10,
        free_inodes: 10,
        name_max: NAME_MAX as u32,
    });
    let x = XattrRequest {
        cred: cred(),
        inode: InodeId(43),
        name: XattrName::new("user.comment").unwrap(),
    };
    round_trip::<_, pb::GetXattrRequest>(x.clone());
    round_trip::<_, pb::RemoveXattrRequest>(x);
    round_trip::<_, pb::GetXattrReply>(XattrValue(vec![0xAB; XATTR_SIZE_MAX]));
    round_trip::<_, pb::GetXattrReply>(XattrValue(vec![]));
    for mode in [XattrMode::Either, XattrMode::Create, XattrMode::Replace] {
        round_trip::<_, pb::SetXattrRequest>(SetXattrRequest {
            cred: cred(),
            inode: InodeId(43),
            name: XattrName::new("trusted.x").unwrap(),
            value: b"\0binary\xff".to_vec(),
            mode,
        });
    }
    round_trip::<_, pb::ListXattrReply>(XattrNames(vec![
        XattrName::new("user.a").unwrap(),
        XattrName::new("user.b").unwrap(),
    ]));
}

#[test]
fn map_requests_and_grants() {
    round_trip::<_, pb::MapRequest>(MapRequest {
        cred: cred(),
        handle: handle(),
        epoch: SessionEpoch(3),
        inode: InodeId(42),
        range: range(MIB, 64 * KIB),
        sync: true,
        layout: false,
        ahead: false,
    });
    round_trip::<_, pb::MapRequest>(MapRequest {
        cred: cred(),
        handle: handle(),
        epoch: SessionEpoch(3),
        inode: InodeId(42),
        range: range(MIB, 8 * MIB),
        sync: false,
        layout: true,
        ahead: true,
    });
    round_trip::<_, pb::Grant>(Grant {
        cacheable: true,
        ..write_grant()
    });
    round_trip::<_, pb::Grant>(read_grant());
    round_trip::<_, pb::Grant>(write_grant());
    // A read at or past the end of file: an empty grant with no I/O.
    round_trip::<_, pb::Grant>(Grant {
        range: range(4 * MIB, 0),
        device_ios: vec![],
        zero_fill: vec![],
        cacheable: false,
        ..read_grant()
    });
    // A read of a hole only: all zero fill.
    round_trip::<_, pb::Grant>(Grant {
        device_ios: vec![],
        zero_fill: vec![BufRange {
            buf_off: 0,
            len: 64 * KIB,
        }],
        ..read_grant()
    });
    for io in read_grant().device_ios {
        round_trip::<_, pb::DeviceIo>(io);
    }
}

#[test]
fn completions_and_returns() {
    round_trip::<_, pb::CompleteRequest>(CompleteRequest {
        session: SessionId(5),
        epoch: SessionEpoch(3),
        grant_id: GrantId(78),
        outcome: IoOutcome::Ok,
        bytes_done: 8 * KIB,
        sync: false,
        keep_at: None,
        more: vec![],
    });
    round_trip::<_, pb::CompleteRequest>(CompleteRequest {
        session: SessionId(5),
        epoch: SessionEpoch(3),
        grant_id: GrantId(78),
        outcome: IoOutcome::Ok,
        bytes_done: 64 * KIB,
        sync: false,
        keep_at: Some(MIB),
        more: vec![],
    });
    round_trip::<_, pb::CompleteRequest>(CompleteRequest {
        session: SessionId(5),
        epoch: SessionEpoch(3),
        grant_id: GrantId(78),
        outcome: IoOutcome::Ok,
        bytes_done: 4 * KIB,
        sync: false,
        keep_at: Some(MIB),
        more: vec![
            ByteRange::new(3 * MIB, 4 * KIB).unwrap(),
            ByteRange::new(2 * MIB, 12 * KIB).unwrap(),
        ],
    });
    round_trip::<_, pb::CompleteRequest>(CompleteRequest {
        session: SessionId(5),
        epoch: SessionEpoch(3),
        grant_id: GrantId(78),
        outcome: IoOutcome::DeviceErrors(vec![
            ExtentError {
                device: DeviceIndex(2),
                phys_off: 4 * MIB,
                len: 4096,
                errno: 5,
            },
            ExtentError {
                device: DeviceIndex(0),
                phys_off: 0,
                len: 512,
                errno: 4095,
            },
        ]),
        bytes_done: 0,
        sync: true,
        keep_at: None,
        more: vec![],
    });
    round_trip::<_, pb::ReturnGrantRequest>(ReturnGrantRequest {
        session: SessionId(5),
        epoch: SessionEpoch(3),
        grant_ids: vec![GrantId(77), GrantId(u64::MAX)],
    });
}

#[test]
fn proxied_path() {
    round_trip::<_, pb::ReadRequest>(ReadRequest {
        cred: cred(),
        handle: handle(),
        inode: InodeId(42),
        range: range(100, MAX_INLINE_DATA as u64),
    });
    round_trip::<_, pb::ReadReply>(ReadReply {
        data: vec![7; MAX_INLINE_DATA],
        eof: false,
    });
    round_trip::<_, pb::ReadReply>(ReadReply {
        data: vec![],
        eof: true,
    });
    round_trip::<_, pb::WriteRequest>(WriteRequest {
        cred: cred(),
        handle: handle(),
        inode: InodeId(42),
        position: WritePosition::At(MAX_FILE_SIZE - 3),
        data: b"abc".to_vec(),
        sync: true,
        then: None,
    });
    round_trip::<_, pb::WriteRequest>(WriteRequest {
        cred: cred(),
        handle: handle(),
        inode: InodeId(42),
        position: WritePosition::At(0),
        data: b"abc".to_vec(),
        sync: false,
        then: Some(SetAttr {
            perm: Some(0o640),
            uid: Some(0),
            gid: Some(0),
            atime: Some(TimeSet::Now),
            mtime: Some(TimeSet::At(Timestamp { sec: 0, nsec: 0 })),
            ..SetAttr::default()
        }),
    });
    let p = round_trip::<_, pb::WriteRequest>(WriteRequest {
        cred: cred(),
        handle: handle(),
        inode: InodeId(42),
        position: WritePosition::Append,
        data: vec![1; MAX_INLINE_DATA],
        sync: false,
        then: None,
    });
    assert!(p.append);
    round_trip::<_, pb::WriteReply>(WriteReply {
        written: range(12, 3),
        attr: attr(42, FileType::Regular),
        lease_ms: 30_000,
    });
    round_trip::<_, pb::FsyncRequest>(FsyncRequest {
        cred: cred(),
        handle: handle(),
        inode: InodeId(42),
        data_only: true,
    });
}

#[test]
fn fallocate_modes_and_linux_flags() {
    for mode in [
        FallocateMode::Allocate,
        FallocateMode::AllocateKeepSize,
        FallocateMode::PunchHole,
        FallocateMode::ZeroRange,
        FallocateMode::ZeroRangeKeepSize,
    ] {
        round_trip::<_, pb::FallocateRequest>(FallocateRequest {
            cred: cred(),
            handle: handle(),
            inode: InodeId(42),
            range: range(0, MIB),
            mode,
        });
        assert_eq!(
            FallocateMode::from_linux_flags(mode.linux_flags()),
            Some(mode)
        );
    }
    assert_eq!(FallocateMode::PunchHole.linux_flags(), 0x03);
    assert_eq!(FallocateMode::ZeroRangeKeepSize.linux_flags(), 0x11);
    // PUNCH_HOLE without KEEP_SIZE is invalid in Linux too.
    assert_eq!(FallocateMode::from_linux_flags(0x02), None);
    assert_eq!(FallocateMode::from_linux_flags(0x08), None);
}

#[test]
fn extents() {
    round_trip::<_, pb::GetExtentsRequest>(GetExtentsRequest {
        cred: cred(),
        inode: InodeId(42),
        range: range(0, MAX_FILE_SIZE),
    });
    round_trip::<_, pb::GetExtentsReply>(GetExtentsReply {
        extents: vec![
            ExtentMapping {
                file_range: range(0, 128 * KIB),
                vol_off: 32 * KIB,
                state: ExtentState::Written,
                pieces: vec![
                    PhysPiece {
                        device: DeviceIndex(0),
                        phys_off: MIB + 32 * KIB,
                        len: 32 * KIB,
                    },
                    PhysPiece {
                        device: DeviceIndex(1),
                        phys_off: MIB,
                        len: 64 * KIB,
                    },
                    PhysPiece {
                        device: DeviceIndex(2),
                        phys_off: MIB,
                        len: 32 * KIB,
                    },
                ],
            },
            ExtentMapping {
                file_range: range(256 * KIB, 4 * KIB),
                vol_off: 0,
                state: ExtentState::Unwritten,
                pieces: vec![PhysPiece {
                    device: DeviceIndex(0),
                    phys_off: MIB,
                    len: 4 * KIB,
                }],
            },
        ],
        file_size: 300 * KIB,
        block_size: 4096,
    });
}

#[test]
fn volumes_of_every_layout() {
    for v in [linear_volume(), striped_volume(), lvm_volume()] {
        let p = round_trip::<Volume, pb::Volume>(v.clone());
        assert_eq!(p.devices.len(), v.devices().len());
        round_trip::<_, pb::GetVolumeReply>(VolumeInfo {
            fs_uuid: Uuid::from_u128(0xfeed),
            volume: v,
        });
    }
    let p = pb::Volume::from(&striped_volume());
    assert_eq!(
        p.layout,
        Some(pb::volume::Layout::Striped(pb::StripedLayout {
            stripe_unit: 64 * KIB,
            width: 4
        }))
    );
    // The LVM PV ids travel as their hyphenated text.
    let p = pb::Volume::from(&lvm_volume());
    let id = p.devices[0].id.clone().unwrap().id.unwrap();
    assert_eq!(
        id,
        pb::device_id::Id::LvmPvId("aaaaaa-aaaa-aaaa-aaaa-aaaa-aaaa-aaaaaa".into())
    );
}

#[test]
fn status_and_quotas() {
    round_trip::<_, pb::ServerStatusReply>(ServerStatus {
        epoch: SessionEpoch(3),
        fs_uuid: Uuid::from_u128(0xfeed),
        server_version: "0.1.0".into(),
        uptime_ms: 1234,
        sessions: vec![SessionSummary {
            session: SessionId(5),
            client_name: "node-a".into(),
            host: "h".into(),
            grants: 2,
            open_handles: 3,
            lease_remaining_ms: 9000,
            identity: "node-a.example".into(),
            activity: Activity {
                rpcs: 10,
                rpc_errors: 1,
                rpc_micros: 5000,
                read_grants: 2,
                write_grants: 3,
                granted_read_bytes: 1 << 20,
                granted_write_bytes: 3 << 20,
                proxied_read_bytes: 100,
                proxied_write_bytes: 200,
            },
        }],
        sessions_total: 25_000,
        read_grants: 1,
        write_grants: 1,
        commits: CommitStats {
            transactions: 100,
            commits: 10,
            pending: 1,
        },
        rpcs: vec![RpcTally {
            rpc: "MapWrite".into(),
            count: 7,
            errors: 2,
            micros: 900,
        }],
        activity: Activity {
            rpcs: 12,
            ..Activity::default()
        },
    });
    let q = QuotaInfo {
        inode: InodeId(7),
        limits: QuotaLimits {
            capacity_bytes: Some(0),
            inodes: None,
        },
        used_bytes: 5,
        used_inodes: 1,
    };
    round_trip::<_, pb::SetQuotaReply>(q.clone());
    round_trip::<_, pb::GetQuotaReply>(q.clone());
    round_trip::<_, pb::ListQuotasReply>(QuotaList {
        quotas: vec![
            q.clone(),
            QuotaInfo {
                inode: InodeId(9),
                ..q
            },
        ],
        quotas_total: 2,
    });
    round_trip::<_, pb::ListQuotasReply>(QuotaList::default());
    round_trip::<_, pb::SetQuotaRequest>(SetQuotaRequest {
        cred: Credentials::root(),
        inode: InodeId(7),
        limits: QuotaLimits {
            capacity_bytes: Some(10 * MIB),
            inodes: Some(1000),
        },
    });
    round_trip::<_, pb::EvictSessionRequest>(EvictSessionRequest {
        session: SessionId(u64::MAX),
        reason: "write grant held past its bound".into(),
    });
    round_trip::<_, pb::EvictSessionRequest>(EvictSessionRequest {
        session: SessionId(1),
        reason: String::new(),
    });
    round_trip::<_, pb::EvictSessionReply>(EvictSessionReply {
        lease_remaining_ms: 10_900,
    });
}

#[test]
fn grow_volume() {
    for layout in [
        GrowLayout::Linear,
        GrowLayout::Striped {
            stripe_unit: 64 * KIB,
        },
    ] {
        let n = if layout == GrowLayout::Linear { 1 } else { 3 };
        round_trip::<_, pb::GrowVolumeRequest>(GrowVolumeRequest {
            device_paths: (0..n).map(|i| format!("/dev/loop{i}")).collect(),
            layout,
            force: n == 3,
        });
    }
    round_trip::<_, pb::GrowVolumeRequest>(GrowVolumeRequest {
        device_paths: Vec::new(),
        layout: GrowLayout::Lvm,
        force: false,
    });
    let volume = striped_volume();
    round_trip::<_, pb::GrowVolumeReply>(GrowVolumeReply {
        old_size_bytes: volume.size_bytes() - 4096,
        volume: VolumeInfo {
            fs_uuid: Uuid::from_u128(0xfeed),
            volume,
        },
    });
}

#[test]
fn backup_store() {
    for force in [false, true] {
        round_trip::<_, pb::BackupStoreRequest>(BackupStoreRequest {
            path: "/var/backups/sanfs/mds-20261126.redb".into(),
            force,
        });
    }
    round_trip::<_, pb::BackupStoreReply>(BackupStoreReply {
        fs_uuid: Uuid::from_u128(0xbac0),
        epoch: SessionEpoch(7),
        commit_seq: u64::MAX,
        taken_at: Timestamp::new(1_795_000_000, 999_999_999).unwrap(),
        inodes: 1,
        size_bytes: 1 << 20,
    });
}

#[test]
fn request_ids() {
    let id = RequestId {
        client: u64::MAX,
        seq: 7,
        lowest_pending: 7,
    };
    round_trip::<_, pb::RequestId>(id);
    round_trip::<_, pb::RequestId>(RequestId {
        client: 1,
        seq: u64::MAX,
        lowest_pending: 0,
    });
    // Carried by the non-idempotent requests; absent means "not cached".
    let mut p = pb::MkdirRequest {
        request_id: Some(id.into()),
        ..Default::default()
    };
    let bytes = prost::Message::encode_to_vec(&p);
    let back: pb::MkdirRequest = prost::Message::decode(bytes.as_slice()).unwrap();
    assert_eq!(request_id(back.request_id).unwrap(), Some(id));
    p.request_id = None;
    assert_eq!(request_id(p.request_id).unwrap(), None);
}

#[test]
fn replay_writes() {
    let record = ReplayRecord {
        inode: InodeId(42),
        epoch: SessionEpoch(3),
        commit_seq: 9,
        range: ByteRange::new(1 << 20, 128 * 1024).unwrap(),
        runs: vec![
            ReplayRun {
                file_off: 1 << 20,
                device: DeviceIndex(0),
                phys_off: 8 << 20,
                len: 64 * 1024,
            },
            ReplayRun {
                file_off: (1 << 20) + 64 * 1024,
                device: DeviceIndex(1),
                phys_off: 8 << 20,
                len: 64 * 1024,
            },
        ],
    };
    round_trip::<_, pb::ReplayRecord>(record.clone());
    for reclaim_complete in [false, true] {
        round_trip::<_, pb::ReplayWritesRequest>(ReplayWritesRequest {
            session: SessionId(77),
            epoch: SessionEpoch(4),
            previous_session: SessionId(12),
            records: vec![record.clone()],
            reclaim_complete,
        });
    }
    round_trip::<_, pb::ReplayWritesReply>(ReplayWritesReply {
        outcomes: vec![
            ReplayOutcome::Replayed,
            ReplayOutcome::Durable,
            ReplayOutcome::Refused,
        ],
    });
}

#[test]
fn delegate_round_trips_and_zero_means_refused() {
    let req = DelegateRequest {
        handle: HandleRef {
            session: SessionId(5),
            handle: OpenHandle(6),
        },
        inode: InodeId(7),
        epoch: SessionEpoch(2),
        write: true,
        reclaim_of: None,
    };
    round_trip::<_, pb::DelegateRequest>(req.clone());
    round_trip::<_, pb::DelegateRequest>(DelegateRequest {
        reclaim_of: Some(SessionId(4)),
        ..req
    });
    for d in [None, Some(GrantId(11))] {
        round_trip::<_, pb::DelegateReply>(DelegateReply { delegation: d });
    }
    // A delegation needs a real handle and inode.
    assert!(
        DelegateRequest::try_from(pb::DelegateRequest {
            session: 5,
            handle: 6,
            inode: 0,
            epoch: 2,
            write: false,
            reclaim_of: 0,
        })
        .is_err()
    );
    // Only a write delegation is reclaimed.
    assert!(
        DelegateRequest::try_from(pb::DelegateRequest {
            session: 5,
            handle: 6,
            inode: 7,
            epoch: 2,
            write: false,
            reclaim_of: 4,
        })
        .is_err()
    );
}
