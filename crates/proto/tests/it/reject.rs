//! One test per validation rule: a valid message with one field broken is refused, and the
//! error names the field. Boundary values one step inside the limits are accepted.

use std::fmt::Debug;

use sanfs_blockmap::volume::Volume;
use sanfs_proto::model::*;
use sanfs_proto::pb;
use sanfs_proto::types::*;

use crate::fixtures::*;

/// Converts `valid` to pb, applies each mutation to a fresh copy and checks that the
/// conversion back fails with an error whose field path is the one given.
/// One rejection case: the expected field path and the mutation that breaks the message.
type Case<P> = (&'static str, Box<dyn Fn(&mut P)>);

fn check<D, P>(valid: D, cases: Vec<Case<P>>)
where
    D: Debug + Clone + TryFrom<P, Error = ProtocolError>,
    P: From<D> + Clone + Debug,
{
    let base = P::from(valid.clone());
    assert!(D::try_from(base.clone()).is_ok(), "fixture must be valid");
    for (path, mutate) in cases {
        let mut p = base.clone();
        mutate(&mut p);
        let e = rejected::<D, P>(p.clone());
        assert_eq!(e.field_path().as_deref(), Some(path), "{e} for {p:?}");
    }
}

macro_rules! cases {
    ($ty:ty; $($path:literal => |$p:ident| $body:expr),* $(,)?) => {
        vec![$(($path, Box::new(|$p: &mut $ty| { $body; }) as Box<dyn Fn(&mut $ty)>)),*]
    };
}

fn entry() -> EntryRequest {
    EntryRequest {
        cred: cred(),
        parent: ROOT_INODE,
        name: name("f"),
    }
}

#[test]
fn names_ids_and_credentials() {
    check::<EntryRequest, pb::LookupRequest>(
        entry(),
        cases![pb::LookupRequest;
            "cred" => |p| p.cred = None,
            "cred.groups" => |p| p.cred.as_mut().unwrap().groups = vec![1; MAX_GROUPS + 1],
            "parent" => |p| p.parent = 0,
            "name" => |p| p.name = vec![],
            "name" => |p| p.name = b"a/b".to_vec(),
            "name" => |p| p.name = b"a\0".to_vec(),
            "name" => |p| p.name = b".".to_vec(),
            "name" => |p| p.name = b"..".to_vec(),
            "name" => |p| p.name = vec![b'x'; NAME_MAX + 1],
        ],
    );
    // The root causes keep their errno meaning.
    let mut p = pb::LookupRequest::from(entry());
    p.name = vec![b'x'; NAME_MAX + 1];
    let e = rejected::<EntryRequest, _>(p);
    assert_eq!(e.root(), &ProtocolError::NameTooLong(256));
    assert_eq!(FsError::from(e), FsError::NameTooLong);
    // Boundaries: 65536 groups and a 255-byte name are fine.
    let mut p = pb::LookupRequest::from(entry());
    p.cred.as_mut().unwrap().groups = vec![1; MAX_GROUPS];
    p.name = vec![b'x'; NAME_MAX];
    assert!(EntryRequest::try_from(p).is_ok());
}

#[test]
fn attributes_and_timestamps() {
    check::<Attr, pb::Attr>(
        attr(5, FileType::Regular),
        cases![pb::Attr;
            "ino" => |p| p.ino = 0,
            "kind" => |p| p.kind = 0,
            "kind" => |p| p.kind = 8,
            "kind" => |p| p.kind = -1,
            "perm" => |p| p.perm = 0o10000,
            "size" => |p| p.size = MAX_FILE_SIZE + 1,
            "atime" => |p| p.atime = None,
            "mtime.nsec" => |p| p.mtime.as_mut().unwrap().nsec = 1_000_000_000,
            "ctime.nsec" => |p| p.ctime.as_mut().unwrap().nsec = u32::MAX,
            "btime" => |p| p.btime = None,
        ],
    );
    check::<Attr, pb::GetAttrReply>(
        attr(5, FileType::Regular),
        cases![pb::GetAttrReply; "attr" => |p| p.attr = None, "attr.ino" => |p| p.attr.as_mut().unwrap().ino = 0],
    );
}

#[test]
fn setattr_changes() {
    let valid = SetAttrRequest {
        cred: cred(),
        inode: InodeId(9),
        changes: SetAttr {
            perm: Some(0o644),
            size: Some(10),
            atime: Some(TimeSet::Now),
            mtime: Some(TimeSet::At(ts(1, 2))),
            ctime: Some(ts(3, 4)),
            ..SetAttr::default()
        },
        handle: Some(handle()),
    };
    check::<SetAttrRequest, pb::SetAttrRequest>(
        valid,
        cases![pb::SetAttrRequest;
            "changes" => |p| p.changes = None,
            "inode" => |p| p.inode = 0,
            "changes.perm" => |p| p.changes.as_mut().unwrap().perm = Some(0o17777),
            "changes.size" => |p| p.changes.as_mut().unwrap().size = Some(MAX_FILE_SIZE + 1),
            "changes.atime.now" => |p| p.changes.as_mut().unwrap().atime =
                Some(pb::TimeSet { value: Some(pb::time_set::Value::Now(false)) }),
            "changes.atime.value" => |p| p.changes.as_mut().unwrap().atime =
                Some(pb::TimeSet { value: None }),
            "changes.mtime.at.nsec" => |p| p.changes.as_mut().unwrap().mtime =
                Some(pb::TimeSet { value: Some(pb::time_set::Value::At(pb::Timestamp { sec: 0, nsec: 2_000_000_000 })) }),
            "changes.ctime.nsec" => |p| p.changes.as_mut().unwrap().ctime =
                Some(pb::Timestamp { sec: 0, nsec: 1_000_000_000 }),
            "session" => |p| p.session = None,
            "session" => |p| { p.handle = None; },
            "handle" => |p| p.handle = Some(0),
            "session" => |p| p.session = Some(0),
        ],
    );
}

#[test]
fn create_open_and_flags() {
    let flags = OpenFlags {
        read: true,
        write: true,
        append: false,
        truncate: false,
    };
    let create = CreateRequest {
        cred: cred(),
        session: SessionId(5),
        parent: ROOT_INODE,
        name: name("f"),
        perm: 0o644,
        exclusive: true,
        flags,
        delegate: true,
        inode: None,
        time: None,
    };
    check::<CreateRequest, pb::CreateRequest>(
        create,
        cases![pb::CreateRequest;
            "session" => |p| p.session = 0,
            "perm" => |p| p.perm = 0o100644,
            "flags" => |p| p.flags = None,
            "flags.flags" => |p| p.flags = Some(pb::OpenFlags { read: false, write: false, append: false, truncate: false }),
            "flags.flags" => |p| p.flags = Some(pb::OpenFlags { read: true, write: false, append: true, truncate: false }),
            "flags.flags" => |p| p.flags = Some(pb::OpenFlags { read: true, write: false, append: false, truncate: true }),
        ],
    );
    check::<CreateReply, pb::CreateReply>(
        CreateReply {
            attr: attr(5, FileType::Regular),
            handle: OpenHandle(1),
            created: true,
            lease_ms: 0,
            delegation: None,
        },
        cases![pb::CreateReply;
            "handle" => |p| p.handle = 0,
            "attr" => |p| p.attr.as_mut().unwrap().kind = pb::FileType::Directory.into(),
        ],
    );
    check::<OpenRequest, pb::OpenRequest>(
        OpenRequest {
            cred: cred(),
            session: SessionId(5),
            inode: InodeId(5),
            flags,
            read_small: 0,
        },
        cases![pb::OpenRequest; "session" => |p| p.session = 0, "inode" => |p| p.inode = 0, "flags" => |p| p.flags = None],
    );
    check::<OpenReply, pb::OpenReply>(
        OpenReply {
            handle: OpenHandle(1),
            attr: attr(5, FileType::Regular),
            data: None,
            lease_ms: 0,
        },
        cases![pb::OpenReply;
            "handle" => |p| p.handle = 0,
            "attr" => |p| p.attr = None,
            "data" => |p| p.data = Some(vec![7; 10]),
            "data" => |p| {
                p.data = Some(Vec::new());
                p.attr.as_mut().unwrap().kind = pb::FileType::Directory.into();
                p.attr.as_mut().unwrap().size = 0;
            },
        ],
    );
    check::<HandleRef, pb::ReleaseRequest>(
        handle(),
        cases![pb::ReleaseRequest; "session" => |p| p.session = 0, "handle" => |p| p.handle = 0],
    );
    check::<AccessRequest, pb::AccessRequest>(
        AccessRequest {
            cred: cred(),
            inode: InodeId(5),
            mask: 7,
        },
        cases![pb::AccessRequest; "mask" => |p| p.mask = 8, "cred" => |p| p.cred = None],
    );
}

#[test]
fn mknod_rename_link_symlink() {
    check::<MknodRequest, pb::MknodRequest>(
        MknodRequest {
            cred: cred(),
            parent: ROOT_INODE,
            name: name("n"),
            kind: FileType::Fifo,
            perm: 0o600,
            rdev: 0,
        },
        cases![pb::MknodRequest;
            "kind" => |p| p.kind = pb::FileType::Directory.into(),
            "kind" => |p| p.kind = pb::FileType::Symlink.into(),
            "kind" => |p| p.kind = 0,
            "rdev" => |p| p.rdev = 5,
            "perm" => |p| p.perm = u32::MAX,
        ],
    );
    check::<RenameRequest, pb::RenameRequest>(
        RenameRequest {
            cred: cred(),
            old_parent: InodeId(2),
            old_name: name("a"),
            new_parent: InodeId(3),
            new_name: name("b"),
            mode: RenameMode::NoReplace,
        },
        cases![pb::RenameRequest;
            "mode" => |p| p.mode = 0,
            "mode" => |p| p.mode = 4,
            "old_parent" => |p| p.old_parent = 0,
            "new_parent" => |p| p.new_parent = 0,
            "old_name" => |p| p.old_name = b"..".to_vec(),
            "new_name" => |p| p.new_name = vec![],
        ],
    );
    check::<LinkRequest, pb::LinkRequest>(
        LinkRequest {
            cred: cred(),
            inode: InodeId(9),
            new_parent: InodeId(2),
            new_name: name("l"),
        },
        cases![pb::LinkRequest; "inode" => |p| p.inode = 0, "new_name" => |p| p.new_name = b"x/y".to_vec()],
    );
    check::<SymlinkRequest, pb::SymlinkRequest>(
        SymlinkRequest {
            cred: cred(),
            parent: ROOT_INODE,
            name: name("s"),
            target: SymlinkTarget::new("t").unwrap(),
        },
        cases![pb::SymlinkRequest;
            "target.target" => |p| p.target = vec![],
            "target.target" => |p| p.target = b"a\0".to_vec(),
            "target" => |p| p.target = vec![b'x'; SYMLINK_MAX + 1],
        ],
    );
    check::<SymlinkTarget, pb::ReadlinkReply>(
        SymlinkTarget::new("t").unwrap(),
        cases![pb::ReadlinkReply; "target.target" => |p| p.target = vec![]],
    );
}

#[test]
fn readdir() {
    check::<ReadDirRequest, pb::ReadDirRequest>(
        ReadDirRequest {
            cred: cred(),
            inode: ROOT_INODE,
            cookie: 0,
            max_entries: 10,
            plus: true,
        },
        cases![pb::ReadDirRequest;
            "max_entries" => |p| p.max_entries = 0,
            "max_entries" => |p| p.max_entries = MAX_READDIR_ENTRIES + 1,
            "cookie" => |p| p.cookie = 1,
            "cookie" => |p| p.cookie = 2,
        ],
    );
    let entry = DirEntry {
        name: name("f"),
        inode: InodeId(10),
        kind: FileType::Regular,
        cookie: FIRST_DIR_COOKIE,
        attr: Some(attr(10, FileType::Regular)),
    };
    check::<DirEntry, pb::DirEntry>(
        entry.clone(),
        cases![pb::DirEntry;
            "cookie" => |p| p.cookie = 2,
            "inode" => |p| p.inode = 0,
            "kind" => |p| p.kind = 99,
            "attr" => |p| p.attr.as_mut().unwrap().ino = 11,
            "attr" => |p| p.attr.as_mut().unwrap().kind = pb::FileType::Directory.into(),
            "attr.perm" => |p| p.attr.as_mut().unwrap().perm = 0o20000,
            "name" => |p| p.name = b".".to_vec(),
        ],
    );
    check::<ReadDirReply, pb::ReadDirReply>(
        ReadDirReply {
            entries: vec![entry],
            eof: true,
            parent: ROOT_INODE,
        },
        cases![pb::ReadDirReply;
            "parent" => |p| p.parent = 0,
            "entries.cookie" => |p| p.entries[0].cookie = 0,
            "entries" => |p| p.entries = vec![p.entries[0].clone(); MAX_READDIR_ENTRIES as usize + 1],
        ],
    );
}

#[test]
fn statfs_and_xattrs() {
    check::<StatFs, pb::StatFsReply>(
        StatFs {
            block_size: 4096,
            total_blocks: 10,
            free_blocks: 5,
            avail_blocks: 4,
            total_inodes: 10,
            free_inodes: 9,
            name_max: 255,
        },
        cases![pb::StatFsReply;
            "block_size" => |p| p.block_size = 0,
            "block_size" => |p| p.block_size = 3000,
            "free_blocks" => |p| p.free_blocks = 11,
            "avail_blocks" => |p| p.avail_blocks = 6,
            "free_inodes" => |p| p.free_inodes = 11,
            "name_max" => |p| p.name_max = 0,
            "name_max" => |p| p.name_max = 256,
        ],
    );
    let x = XattrRequest {
        cred: cred(),
        inode: InodeId(5),
        name: XattrName::new("user.a").unwrap(),
    };
    check::<XattrRequest, pb::GetXattrRequest>(
        x,
        cases![pb::GetXattrRequest;
            "name" => |p| p.name = vec![],
            "name" => |p| p.name = b"user.\0".to_vec(),
            "name" => |p| p.name = vec![b'u'; XATTR_NAME_MAX + 1],
        ],
    );
    check::<SetXattrRequest, pb::SetXattrRequest>(
        SetXattrRequest {
            cred: cred(),
            inode: InodeId(5),
            name: XattrName::new("user.a").unwrap(),
            value: vec![1; XATTR_SIZE_MAX],
            mode: XattrMode::Create,
        },
        cases![pb::SetXattrRequest;
            "value" => |p| p.value = vec![1; XATTR_SIZE_MAX + 1],
            "mode" => |p| p.mode = 0,
            "mode" => |p| p.mode = 17,
        ],
    );
    check::<XattrValue, pb::GetXattrReply>(
        XattrValue(vec![]),
        cases![pb::GetXattrReply; "value" => |p| p.value = vec![0; XATTR_SIZE_MAX + 1]],
    );
    // 256 names of 255 bytes + NUL = 65536 bytes is the most listxattr returns.
    let names = XattrNames(
        (0..256)
            .map(|_| XattrName::new(vec![b'n'; 255]).unwrap())
            .collect(),
    );
    check::<XattrNames, pb::ListXattrReply>(
        names,
        cases![pb::ListXattrReply;
            "names" => |p| p.names.push(b"x".to_vec()),
            "names" => |p| p.names[3] = vec![],
        ],
    );
}

fn map_request() -> MapRequest {
    MapRequest {
        cred: cred(),
        handle: handle(),
        epoch: SessionEpoch(3),
        inode: InodeId(42),
        range: range(0, 4096),
        sync: false,
        layout: false,
        ahead: false,
    }
}

#[test]
fn map_requests() {
    check::<MapRequest, pb::MapRequest>(
        map_request(),
        cases![pb::MapRequest;
            "session" => |p| p.session = 0,
            "epoch" => |p| p.epoch = 0,
            "handle" => |p| p.handle = 0,
            "inode" => |p| p.inode = 0,
            "range" => |p| p.length = 0,
            "range" => |p| p.offset = u64::MAX,
            "range" => |p| { p.offset = MAX_FILE_SIZE; p.length = 1; },
            "cred" => |p| p.cred = None,
            "ahead" => |p| p.ahead = true,
        ],
    );
    let mut p = pb::MapRequest::from(map_request());
    p.offset = u64::MAX - 1;
    let e = rejected::<MapRequest, _>(p);
    assert!(matches!(e.root(), ProtocolError::RangeOverflow { .. }));
    assert_eq!(FsError::from(e), FsError::FileTooBig);
}

#[test]
fn grants_must_be_whole_plans() {
    check::<Grant, pb::Grant>(
        read_grant(),
        cases![pb::Grant;
            "grant_id" => |p| p.grant_id = 0,
            "epoch" => |p| p.epoch = 0,
            "inode" => |p| p.inode = 0,
            "mode" => |p| p.mode = 0,
            "mode" => |p| p.mode = 3,
            "range" => |p| p.offset = u64::MAX,
            "file_size" => |p| p.file_size = MAX_FILE_SIZE + 1,
            // A gap: the hole is missing.
            "device_ios" => |p| p.zero_fill.clear(),
            // An overlap: the hole also covers the last device piece.
            "device_ios" => |p| p.zero_fill[0] = pb::BufRange { buf_off: 32 * KIB, len: 32 * KIB },
            // Too much: the hole passes the end of the grant.
            "device_ios" => |p| p.zero_fill[0].len = 32 * KIB,
            "zero_fill" => |p| p.zero_fill.push(pb::BufRange { buf_off: 64 * KIB, len: 0 }),
            "device_ios" => |p| p.zero_fill[0] = pb::BufRange { buf_off: u64::MAX, len: 16 * KIB },
            "device_ios" => |p| p.length = 128 * KIB,
            "device_ios.len" => |p| p.device_ios[1].len = 0,
            "device_ios.phys_off" => |p| p.device_ios[1].phys_off += 1,
            "device_ios.phys_off" => |p| { p.device_ios[1].len = 1000; p.device_ios[1].iov[0].len = 1000; },
            "device_ios.phys_off" => |p| p.device_ios[1].phys_off = u64::MAX - 511,
            "device_ios.iov" => |p| p.device_ios[0].iov[1].len = 8 * KIB,
            "device_ios.iov" => |p| p.device_ios[0].iov.push(pb::BufRange { buf_off: 0, len: 0 }),
            "device_ios.iov" => |p| p.device_ios[0].iov[0].len = u64::MAX,
        ],
    );
    check::<Grant, pb::Grant>(
        write_grant(),
        cases![pb::Grant;
            "zero_fill" => |p| {
                p.device_ios[0].len = 4096;
                p.device_ios[0].iov[0].len = 4096;
                p.zero_fill.push(pb::BufRange { buf_off: 4096, len: 4096 });
            },
            "length" => |p| { p.length = 0; p.device_ios.clear(); },
        ],
    );
}

fn complete() -> CompleteRequest {
    CompleteRequest {
        session: SessionId(5),
        epoch: SessionEpoch(3),
        grant_id: GrantId(78),
        outcome: IoOutcome::DeviceErrors(vec![ExtentError {
            device: sanfs_blockmap::volume::DeviceIndex(0),
            phys_off: 0,
            len: 4096,
            errno: 5,
        }]),
        bytes_done: 0,
        sync: false,
        keep_at: None,
        more: vec![],
    }
}

#[test]
fn completions() {
    check::<CompleteRequest, pb::CompleteRequest>(
        complete(),
        cases![pb::CompleteRequest;
            "session" => |p| p.session = 0,
            "epoch" => |p| p.epoch = 0,
            "grant_id" => |p| p.grant_id = 0,
            "status" => |p| p.status = 0,
            "status" => |p| p.status = 9,
            "errors" => |p| p.errors.clear(),
            "errors" => |p| p.status = pb::IoStatus::Ok.into(),
            "errors.errno" => |p| p.errors[0].errno = 0,
            "errors.errno" => |p| p.errors[0].errno = -5,
            "errors.errno" => |p| p.errors[0].errno = 4096,
            "errors.phys_off" => |p| p.errors[0].phys_off = u64::MAX,
            "bytes_done" => |p| p.bytes_done = u64::MAX,
            "offset" => |p| p.offset = 4096,
            "offset" => |p| { p.keep = true; p.offset = u64::MAX - 10; },
            "more" => |p| p.more.push(pb::CompletedPart { offset: 0, length: 4096 }),
            "more" => |p| { p.keep = true; p.more.push(pb::CompletedPart { offset: 4096, length: 0 }); },
            "more" => |p| { p.keep = true; p.more.push(pb::CompletedPart { offset: u64::MAX - 10, length: 4096 }); },
            "more" => |p| {
                p.keep = true;
                p.more = vec![pb::CompletedPart { offset: 0, length: 4096 }; MAX_COMPLETE_PARTS];
            },
        ],
    );
    check::<ReturnGrantRequest, pb::ReturnGrantRequest>(
        ReturnGrantRequest {
            session: SessionId(5),
            epoch: SessionEpoch(3),
            grant_ids: vec![GrantId(1)],
        },
        cases![pb::ReturnGrantRequest;
            "grant_ids" => |p| p.grant_ids.clear(),
            "grant_ids" => |p| p.grant_ids.push(0),
            "grant_ids" => |p| p.grant_ids = vec![1; MAX_GRANTS_PER_MESSAGE + 1],
            "epoch" => |p| p.epoch = 0,
        ],
    );
}

#[test]
fn proxied_payloads_are_capped() {
    check::<ReadRequest, pb::ReadRequest>(
        ReadRequest {
            cred: cred(),
            handle: handle(),
            inode: InodeId(42),
            range: range(0, MAX_INLINE_DATA as u64),
        },
        cases![pb::ReadRequest;
            "length" => |p| p.length = MAX_INLINE_DATA as u64 + 1,
            "range" => |p| p.length = 0,
            "range" => |p| p.offset = MAX_FILE_SIZE,
            "handle" => |p| p.handle = 0,
            "session" => |p| p.session = 0,
        ],
    );
    check::<ReadReply, pb::ReadReply>(
        ReadReply {
            data: vec![],
            eof: true,
        },
        cases![pb::ReadReply; "data" => |p| p.data = vec![0; MAX_INLINE_DATA + 1]],
    );
    check::<WriteRequest, pb::WriteRequest>(
        WriteRequest {
            cred: cred(),
            handle: handle(),
            inode: InodeId(42),
            position: WritePosition::At(10),
            data: vec![1; 10],
            sync: false,
            then: Some(SetAttr {
                perm: Some(0o600),
                ..SetAttr::default()
            }),
        },
        cases![pb::WriteRequest;
            "data" => |p| p.data = vec![0; MAX_INLINE_DATA + 1],
            "data" => |p| p.data.clear(),
            "offset" => |p| p.append = true,
            "then_set_attr" => |p| { p.offset = 0; p.append = true },
            "then_set_attr" => |p| p.then_set_attr = Some(pb::SetAttrChanges { size: Some(1), ..Default::default() }),
            "then_set_attr" => |p| p.then_set_attr = Some(pb::SetAttrChanges { ctime: Some(pb::Timestamp::default()), ..Default::default() }),
            "perm" => |p| p.then_set_attr = Some(pb::SetAttrChanges { perm: Some(0o170000), ..Default::default() }),
            "range" => |p| p.offset = MAX_FILE_SIZE - 9,
            "inode" => |p| p.inode = 0,
        ],
    );
    check::<WriteReply, pb::WriteReply>(
        WriteReply {
            written: range(0, 10),
            attr: attr(42, FileType::Regular),
            lease_ms: 1_000,
        },
        cases![pb::WriteReply;
            "bytes_written" => |p| p.bytes_written = MAX_INLINE_DATA as u64 + 1,
            "written" => |p| p.offset = u64::MAX,
            "attr" => |p| p.attr = None,
            "lease_ms" => |p| p.lease_ms = u64::MAX,
        ],
    );
    check::<FsyncRequest, pb::FsyncRequest>(
        FsyncRequest {
            cred: cred(),
            handle: handle(),
            inode: InodeId(42),
            data_only: false,
        },
        cases![pb::FsyncRequest; "handle" => |p| p.handle = 0, "inode" => |p| p.inode = 0],
    );
}

#[test]
fn fallocate_and_extents() {
    check::<FallocateRequest, pb::FallocateRequest>(
        FallocateRequest {
            cred: cred(),
            handle: handle(),
            inode: InodeId(42),
            range: range(0, 4096),
            mode: FallocateMode::PunchHole,
        },
        cases![pb::FallocateRequest;
            "mode" => |p| p.mode = 0,
            "mode" => |p| p.mode = 6,
            "range" => |p| p.length = 0,
        ],
    );
    check::<GetExtentsRequest, pb::GetExtentsRequest>(
        GetExtentsRequest {
            cred: cred(),
            inode: InodeId(42),
            range: range(0, 4096),
        },
        cases![pb::GetExtentsRequest; "range" => |p| p.length = 0, "range" => |p| p.length = u64::MAX],
    );
    let extent = |off: u64| ExtentMapping {
        file_range: range(off, 8192),
        vol_off: 0,
        state: ExtentState::Written,
        pieces: vec![PhysPiece {
            device: sanfs_blockmap::volume::DeviceIndex(0),
            phys_off: 0,
            len: 8192,
        }],
    };
    check::<GetExtentsReply, pb::GetExtentsReply>(
        GetExtentsReply {
            extents: vec![extent(0), extent(8192)],
            file_size: 16384,
            block_size: 4096,
        },
        cases![pb::GetExtentsReply;
            "extents" => |p| p.extents[1].file_off = 4096,
            "extents" => |p| p.extents.swap(0, 1),
            "extents.state" => |p| p.extents[0].state = 0,
            "extents.file_range" => |p| p.extents[0].len = 0,
            "extents.pieces" => |p| p.extents[0].pieces[0].len = 4096,
            "extents.pieces" => |p| p.extents[0].pieces.clear(),
            "extents.vol_off" => |p| p.extents[0].vol_off = u64::MAX,
            "block_size" => |p| p.block_size = 100,
            "file_size" => |p| p.file_size = u64::MAX,
        ],
    );
}

#[test]
fn session_messages() {
    check::<OpenSessionRequest, pb::OpenSessionRequest>(
        OpenSessionRequest {
            protocol_version: 1,
            client_name: "a".into(),
            host: String::new(),
            agent_version: String::new(),
        },
        cases![pb::OpenSessionRequest;
            "protocol_version" => |p| p.protocol_version = 0,
            "client_name" => |p| p.client_name.clear(),
            "client_name" => |p| p.client_name = "x".repeat(MAX_TEXT_LEN + 1),
            "host" => |p| p.host = "x".repeat(MAX_TEXT_LEN + 1),
            "agent_version" => |p| p.agent_version = "x".repeat(MAX_TEXT_LEN + 1),
        ],
    );
    check::<OpenSessionReply, pb::OpenSessionReply>(
        OpenSessionReply {
            session: SessionId(1),
            epoch: SessionEpoch(1),
            lease_ttl_ms: 1,
            server: server_info(),
        },
        cases![pb::OpenSessionReply;
            "session" => |p| p.session = 0,
            "epoch" => |p| p.epoch = 0,
            "lease_ttl_ms" => |p| p.lease_ttl_ms = 0,
            "server" => |p| p.server = None,
            "server.fs_uuid" => |p| p.server.as_mut().unwrap().fs_uuid = vec![0; 16],
            "server.fs_uuid" => |p| p.server.as_mut().unwrap().fs_uuid = vec![1; 15],
            "server.block_size" => |p| p.server.as_mut().unwrap().block_size = 131072,
            "server.block_size" => |p| p.server.as_mut().unwrap().block_size = 256,
            "server.max_grant_bytes" => |p| p.server.as_mut().unwrap().max_grant_bytes = 0,
            "server.max_grant_bytes" => |p| p.server.as_mut().unwrap().max_grant_bytes = 6000,
            "server.max_inline_bytes" => |p| p.server.as_mut().unwrap().max_inline_bytes = 0,
            "server.max_inline_bytes" => |p| p.server.as_mut().unwrap().max_inline_bytes = (8 << 20) + 1,
            "server.server_version" => |p| p.server.as_mut().unwrap().server_version = "v".repeat(256),
        ],
    );
    check::<SessionRef, pb::CloseSessionRequest>(
        SessionRef {
            session: SessionId(1),
            epoch: SessionEpoch(1),
        },
        cases![pb::CloseSessionRequest; "session" => |p| p.session = 0, "epoch" => |p| p.epoch = 0],
    );
    use pb::session_stream_request::Event as C;
    check::<ClientEvent, pb::SessionStreamRequest>(
        ClientEvent::Heartbeat {
            seq: 1,
            renew: Some(LeaseRenew {
                attrs: vec![InodeId(3)],
                entries: vec![InodeId(1)],
            }),
        },
        cases![pb::SessionStreamRequest;
            "event" => |p| p.event = None,
            "heartbeat.renew.attrs" => |p| if let Some(C::Heartbeat(h)) = &mut p.event { h.renew.as_mut().unwrap().attrs.push(0) },
            "heartbeat.renew.entries" => |p| if let Some(C::Heartbeat(h)) = &mut p.event { h.renew.as_mut().unwrap().entries = vec![5; 65_537] },
            "attach.session" => |p| p.event = Some(C::Attach(pb::Attach { session: 0, epoch: 1 })),
            "attach.epoch" => |p| p.event = Some(C::Attach(pb::Attach { session: 1, epoch: 0 })),
            "recall_ack.grant_ids" => |p| p.event = Some(C::RecallAck(pb::RecallAck { grant_ids: vec![] })),
            "grant_return.grant_ids" => |p| p.event = Some(C::GrantReturn(pb::GrantReturn { grant_ids: vec![0] })),
        ],
    );
    let recall = Recall {
        grant_ids: vec![GrantId(1)],
        inode: InodeId(4),
        range: range(0, 4096),
        reason: RecallReason::Conflict,
        delegation: false,
    };
    check::<Recall, pb::Recall>(
        recall.clone(),
        cases![pb::Recall;
            "grant_ids" => |p| p.grant_ids.clear(),
            "inode" => |p| p.inode = 0,
            "range" => |p| p.length = u64::MAX,
            "reason" => |p| p.reason = 0,
            "reason" => |p| p.reason = 5,
        ],
    );
    use pb::session_stream_reply::Event as S;
    check::<ServerEvent, pb::SessionStreamReply>(
        ServerEvent::Recall(recall),
        cases![pb::SessionStreamReply;
            "event" => |p| p.event = None,
            "recall.inode" => |p| if let Some(S::Recall(r)) = &mut p.event { r.inode = 0 },
            "heartbeat_ack.lease_ttl_ms" => |p| p.event = Some(S::HeartbeatAck(pb::HeartbeatAck { seq: 1, lease_ttl_ms: 0, durable_seq: 0, renewed: None })),
            "heartbeat_ack.renewed.lease_ms" => |p| p.event = Some(S::HeartbeatAck(pb::HeartbeatAck { seq: 1, lease_ttl_ms: 9, durable_seq: 0, renewed: Some(pb::LeaseRenewed::default()) })),
            "heartbeat_ack.renewed.lost_attrs" => |p| p.event = Some(S::HeartbeatAck(pb::HeartbeatAck { seq: 1, lease_ttl_ms: 9, durable_seq: 0, renewed: Some(pb::LeaseRenewed { lease_ms: 9, lost_attrs: vec![0], lost_entries: vec![] }) })),
            "ended.reason" => |p| p.event = Some(S::Ended(pb::SessionEnded { reason: 0, message: String::new() })),
            "ended.reason" => |p| p.event = Some(S::Ended(pb::SessionEnded { reason: 77, message: String::new() })),
            "ended.message" => |p| p.event = Some(S::Ended(pb::SessionEnded { reason: 1, message: "m".repeat(4097) })),
        ],
    );
}

#[test]
fn device_ids_and_volumes() {
    check::<Volume, pb::Volume>(
        striped_volume(),
        cases![pb::Volume;
            "layout" => |p| p.layout = None,
            "devices" => |p| p.devices = vec![p.devices[0].clone(); MAX_VOLUME_DEVICES + 1],
            "devices.id" => |p| p.devices[0].id = None,
            "devices.id.id" => |p| p.devices[0].id = Some(pb::DeviceId { id: None }),
            "devices.id.sanfs_uuid" => |p| p.devices[0].id = Some(pb::DeviceId { id: Some(pb::device_id::Id::SanfsUuid(vec![7; 3])) }),
            "devices.id.sanfs_uuid" => |p| p.devices[0].id = Some(pb::DeviceId { id: Some(pb::device_id::Id::SanfsUuid(vec![0; 16])) }),
            "devices.id.lvm_pv_id" => |p| p.devices[0].id = Some(pb::DeviceId { id: Some(pb::device_id::Id::LvmPvId("short".into())) }),
            "segments.legs" => |p| p.segments[0].legs.clear(),
            "segments.stripe_unit" => |p| p.segments[0].stripe_unit = u64::MAX / 2,
            "segments.len" => |p| p.segments[0].vol_start = u64::MAX,
            // What Volume::from_segments refuses: duplicate devices, bad block size, a
            // leg past its device, a segment not starting at 0, a missing device.
            "volume" => |p| p.devices[1] = p.devices[0].clone(),
            "volume" => |p| p.block_size = 4095,
            "volume" => |p| p.segments[0].legs[0].phys_start = 9 * MIB,
            "volume" => |p| p.segments[0].vol_start = 4096,
            "volume" => |p| p.segments[0].legs[0].device = 4,
            "volume" => |p| p.segments.clear(),
        ],
    );
    check::<Volume, pb::Volume>(
        lvm_volume(),
        cases![pb::Volume;
            "lvm.vg_name" => |p| p.layout = Some(pb::volume::Layout::Lvm(pb::LvmLayout { vg_name: String::new(), lv_name: "x".into() })),
            "lvm.lv_name" => |p| p.layout = Some(pb::volume::Layout::Lvm(pb::LvmLayout { vg_name: "x".into(), lv_name: "y".repeat(256) })),
        ],
    );
    check::<VolumeInfo, pb::GetVolumeReply>(
        VolumeInfo {
            fs_uuid: uuid::Uuid::from_u128(1),
            volume: linear_volume(),
        },
        cases![pb::GetVolumeReply; "fs_uuid" => |p| p.fs_uuid.clear(), "volume" => |p| p.volume = None],
    );
}

#[test]
fn admin_status_and_quotas() {
    check::<ServerStatus, pb::ServerStatusReply>(
        ServerStatus {
            epoch: SessionEpoch(1),
            fs_uuid: uuid::Uuid::from_u128(1),
            server_version: String::new(),
            uptime_ms: 0,
            sessions: vec![SessionSummary {
                session: SessionId(1),
                client_name: String::new(),
                host: String::new(),
                grants: 0,
                open_handles: 0,
                lease_remaining_ms: 0,
                identity: "unix:uid=0".into(),
                activity: Activity::default(),
            }],
            sessions_total: 1,
            read_grants: 0,
            write_grants: 0,
            commits: CommitStats::default(),
            rpcs: vec![RpcTally {
                rpc: "Lookup".into(),
                count: 1,
                errors: 0,
                micros: 10,
            }],
            activity: Activity::default(),
        },
        cases![pb::ServerStatusReply;
            "epoch" => |p| p.epoch = 0,
            "commits" => |p| p.commits = None,
            "sessions.session" => |p| p.sessions[0].session = 0,
            "sessions.host" => |p| p.sessions[0].host = "h".repeat(256),
            "sessions.identity" => |p| p.sessions[0].identity = "i".repeat(256),
            "sessions_total" => |p| p.sessions_total = 0,
            "sessions" => |p| {
                let one = p.sessions[0].clone();
                p.sessions = vec![one; MAX_STATUS_SESSIONS + 1];
                p.sessions_total = u64::MAX;
            },
            "fs_uuid" => |p| p.fs_uuid = vec![0; 16],
            "activity" => |p| p.activity = None,
            "sessions.activity" => |p| p.sessions[0].activity = None,
            "sessions.activity.rpc_errors" => |p| {
                if let Some(a) = p.sessions[0].activity.as_mut() {
                    a.rpc_errors = a.rpcs + 1;
                }
            },
            "rpcs.rpc" => |p| p.rpcs[0].rpc = String::new(),
            "rpcs.rpc" => |p| p.rpcs[0].rpc = "R".repeat(MAX_RPC_NAME_LEN + 1),
            "rpcs.errors" => |p| p.rpcs[0].errors = p.rpcs[0].count + 1,
            "rpcs" => |p| {
                let one = p.rpcs[0].clone();
                p.rpcs = vec![one; MAX_STATUS_RPCS + 1];
            },
        ],
    );
    let q = QuotaInfo {
        inode: InodeId(7),
        limits: QuotaLimits::default(),
        used_bytes: 0,
        used_inodes: 0,
    };
    check::<QuotaList, pb::ListQuotasReply>(
        QuotaList {
            quotas: vec![q.clone()],
            quotas_total: 1,
        },
        cases![pb::ListQuotasReply;
            "quotas.inode" => |p| p.quotas[0].inode = 0,
            "quotas.limits" => |p| p.quotas[0].limits = None,
            "quotas_total" => |p| p.quotas_total = 0,
            "quotas" => |p| {
                let one = p.quotas[0];
                p.quotas = vec![one; MAX_LISTED_QUOTAS + 1];
                p.quotas_total = u64::MAX;
            },
        ],
    );
    check::<QuotaInfo, pb::GetQuotaReply>(
        q,
        cases![pb::GetQuotaReply;
            "quota" => |p| p.quota = None,
            "quota.inode" => |p| p.quota.as_mut().unwrap().inode = 0,
            "quota.limits" => |p| p.quota.as_mut().unwrap().limits = None,
        ],
    );
    check::<SetQuotaRequest, pb::SetQuotaRequest>(
        SetQuotaRequest {
            cred: Credentials::root(),
            inode: InodeId(7),
            limits: QuotaLimits::default(),
        },
        cases![pb::SetQuotaRequest; "limits" => |p| p.limits = None, "inode" => |p| p.inode = 0],
    );
    check::<EvictSessionRequest, pb::EvictSessionRequest>(
        EvictSessionRequest {
            session: SessionId(3),
            reason: "stuck".into(),
        },
        cases![pb::EvictSessionRequest;
            "session" => |p| p.session = 0,
            "reason" => |p| p.reason = "x".repeat(256),
        ],
    );
}

#[test]
fn grow_volume() {
    check::<GrowVolumeRequest, pb::GrowVolumeRequest>(
        GrowVolumeRequest {
            device_paths: vec!["/dev/loop7".into(), "/dev/loop8".into()],
            layout: GrowLayout::Striped {
                stripe_unit: 64 * 1024,
            },
            force: false,
        },
        cases![pb::GrowVolumeRequest;
            "layout" => |p| p.layout = 0,
            "layout" => |p| p.layout = 99,
            "stripe_unit" => |p| p.stripe_unit = 0,
            "stripe_unit" => |p| p.stripe_unit = 1000,
            "device_paths" => |p| p.device_paths.clear(),
            "device_paths" => |p| p.device_paths[0] = "loop7".into(),
            "device_paths" => |p| p.device_paths[0] = "/dev/\0x".into(),
            "device_paths" => |p| p.device_paths[0] = format!("/{}", "d".repeat(4096)),
            "device_paths" => |p| p.device_paths = vec!["/dev/x".into(); 65],
        ],
    );
    check::<GrowVolumeRequest, pb::GrowVolumeRequest>(
        GrowVolumeRequest {
            device_paths: vec!["/dev/loop7".into()],
            layout: GrowLayout::Linear,
            force: true,
        },
        cases![pb::GrowVolumeRequest;
            "stripe_unit" => |p| p.stripe_unit = 65536,
            "device_paths" => |p| p.device_paths.push("/dev/loop8".into()),
            "device_paths" => |p| p.device_paths.clear(),
        ],
    );
    let volume = linear_volume();
    let size = volume.size_bytes();
    check::<GrowVolumeReply, pb::GrowVolumeReply>(
        GrowVolumeReply {
            volume: VolumeInfo {
                fs_uuid: uuid::Uuid::from_u128(1),
                volume,
            },
            old_size_bytes: size / 2,
        },
        cases![pb::GrowVolumeReply;
            "volume" => |p| p.volume = None,
            "old_size_bytes" => |p| p.old_size_bytes = p.volume.as_ref().map_or(0, pb_volume_size),
        ],
    );
}

#[test]
fn backup_store() {
    check::<BackupStoreRequest, pb::BackupStoreRequest>(
        BackupStoreRequest {
            path: "/var/backups/mds.redb".into(),
            force: false,
        },
        cases![pb::BackupStoreRequest;
            "path" => |p| p.path.clear(),
            "path" => |p| p.path = "mds.redb".into(),
            "path" => |p| p.path = "/var/backups/".into(),
            "path" => |p| p.path = "/var/\0x".into(),
            "path" => |p| p.path = format!("/{}", "b".repeat(4096)),
        ],
    );
    check::<BackupStoreReply, pb::BackupStoreReply>(
        BackupStoreReply {
            fs_uuid: uuid::Uuid::from_u128(2),
            epoch: SessionEpoch(3),
            commit_seq: 9,
            taken_at: Timestamp::new(1_795_000_000, 0).unwrap(),
            inodes: 4,
            size_bytes: 65536,
        },
        cases![pb::BackupStoreReply;
            "fs_uuid" => |p| p.fs_uuid = vec![1, 2, 3],
            "epoch" => |p| p.epoch = 0,
            "taken_at" => |p| p.taken_at = None,
            "taken_at.nsec" => |p| p.taken_at = Some(pb::Timestamp { sec: 0, nsec: 1_000_000_000 }),
            "inodes" => |p| p.inodes = 0,
            "size_bytes" => |p| p.size_bytes = 0,
        ],
    );
}

#[test]
fn request_ids() {
    let valid = RequestId {
        client: 9,
        seq: 5,
        lowest_pending: 3,
    };
    check::<RequestId, pb::RequestId>(
        valid,
        cases![pb::RequestId;
            "client" => |p| p.client = 0,
            "seq" => |p| p.seq = 0,
            "lowest_pending" => |p| p.lowest_pending = 6,
        ],
    );
    // As a field of a request, the path names it.
    let e = request_id(Some(pb::RequestId {
        client: 0,
        seq: 1,
        lowest_pending: 0,
    }))
    .unwrap_err();
    assert_eq!(e.field_path().as_deref(), Some("request_id.client"));
    let ok = pb::RequestId {
        client: 1,
        seq: 1,
        lowest_pending: 1,
    };
    assert!(request_id(Some(ok)).unwrap().is_some());
}

fn replay_request() -> ReplayWritesRequest {
    ReplayWritesRequest {
        session: SessionId(77),
        epoch: SessionEpoch(4),
        previous_session: SessionId(12),
        records: vec![ReplayRecord {
            inode: InodeId(42),
            epoch: SessionEpoch(3),
            commit_seq: 9,
            range: ByteRange::new(64 * KIB, 128 * KIB).unwrap(),
            runs: vec![ReplayRun {
                file_off: 64 * KIB,
                device: sanfs_blockmap::volume::DeviceIndex(0),
                phys_off: MIB,
                len: 128 * KIB,
            }],
        }],
        reclaim_complete: true,
    }
}

#[test]
fn replay_writes_records_are_whole() {
    check::<ReplayWritesRequest, pb::ReplayWritesRequest>(
        replay_request(),
        cases![pb::ReplayWritesRequest;
            "session" => |p| p.session = 0,
            "epoch" => |p| p.epoch = 0,
            "previous_session" => |p| p.previous_session = 0,
            "records" => |p| { let r = p.records[0].clone(); p.records = vec![r; MAX_REPLAY_RECORDS + 1]; },
            "records.inode" => |p| p.records[0].inode = 0,
            "records.epoch" => |p| p.records[0].epoch = 0,
            "records.commit_seq" => |p| p.records[0].commit_seq = 0,
            "records.offset" => |p| p.records[0].length = 0,
            "records.offset" => |p| p.records[0].offset = MAX_FILE_SIZE,
            "records.runs" => |p| p.records[0].runs.clear(),
            "records.runs" => |p| p.records[0].runs[0].file_off = 0,
            "records.runs" => |p| p.records[0].runs[0].len = 256 * KIB,
            "records.runs.file_off" => |p| p.records[0].runs[0].len = 0,
            "records.runs.phys_off" => |p| p.records[0].runs[0].phys_off = u64::MAX,
        ],
    );
    check::<ReplayWritesReply, pb::ReplayWritesReply>(
        ReplayWritesReply {
            outcomes: vec![ReplayOutcome::Replayed],
        },
        cases![pb::ReplayWritesReply;
            "outcomes" => |p| p.outcomes = vec![0],
            "outcomes" => |p| p.outcomes = vec![9],
        ],
    );
}

/// The size of a wire volume that converts (the old size must lie below it).
fn pb_volume_size(p: &pb::GetVolumeReply) -> u64 {
    VolumeInfo::try_from(p.clone()).map_or(0, |v| v.volume.size_bytes())
}
