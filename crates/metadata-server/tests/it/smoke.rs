//! The store and namespace through the real committer: a first end-to-end check.

use sanfs_mds::clock::Clock;
use sanfs_mds::ns::{self, Reader};
use sanfs_mds::store::ROOT;
use sanfs_proto::model::{CreateRequest, EntryRequest, MkdirRequest, OpenFlags, ReadDirRequest};
use sanfs_proto::types::{Credentials, FsError, InodeId, SessionId};

use crate::support::{name, new_store};

#[test]
fn mkdir_create_lookup_readdir_survive_reopen() {
    let clock = Clock::manual(1000);
    let (store, disk) = new_store(&clock);
    let bs = store.block_size();
    let d = store
        .write_blocking(|ctx| {
            ns::mkdir(
                ctx,
                &MkdirRequest {
                    cred: Credentials::root(),
                    parent: InodeId(ROOT),
                    name: name("d"),
                    perm: 0o755,
                    delegate: false,
                },
            )
        })
        .unwrap();
    for i in 0..10 {
        store
            .write_blocking(move |ctx| {
                ns::create(
                    ctx,
                    &CreateRequest {
                        delegate: false,
                        inode: None,
                        time: None,
                        cred: Credentials::root(),
                        session: SessionId(1),
                        parent: d.ino,
                        name: name(&format!("f{i}")),
                        perm: 0o644,
                        exclusive: true,
                        flags: OpenFlags {
                            read: true,
                            write: true,
                            append: false,
                            truncate: false,
                        },
                    },
                )
            })
            .unwrap();
    }
    let again = store.write_blocking(move |ctx| {
        ns::mkdir(
            ctx,
            &MkdirRequest {
                cred: Credentials::root(),
                parent: InodeId(ROOT),
                name: name("d"),
                perm: 0o755,
                delegate: false,
            },
        )
    });
    assert_eq!(again.unwrap_err(), FsError::Exists);
    store.close();
    drop(store);

    let store =
        sanfs_mds::store::Store::open(&sanfs_mds::store::Backend::Sim(disk), clock.clone(), 64)
            .unwrap();
    let got = store
        .read(|t| {
            t.lookup(
                bs,
                &EntryRequest {
                    cred: Credentials::root(),
                    parent: InodeId(ROOT),
                    name: name("d"),
                },
            )
        })
        .unwrap();
    assert_eq!(got.ino, d.ino);
    assert_eq!(got.nlink, 2);
    assert_eq!(got.size, 10);
    let list = store
        .read(|t| {
            t.readdir(
                bs,
                &ReadDirRequest {
                    cred: Credentials::root(),
                    inode: d.ino,
                    cookie: 0,
                    max_entries: 4,
                    plus: true,
                },
            )
        })
        .unwrap();
    assert_eq!(list.entries.len(), 4);
    assert!(!list.eof);
    assert_eq!(list.parent, InodeId(ROOT));
    assert_eq!(list.entries[0].name.as_bytes(), b"f0");
}

/// A direct write's grant and completion (control info 1 to 4) at the store: blocks are
/// allocated Unwritten before the grant, read as zeros until completed, then Written; a 1 MiB
/// write on 4 stripes of 64 KiB is one device I/O per LUN.
#[test]
fn map_write_then_complete_converts_exactly_the_done_prefix() {
    use sanfs_mds::data;
    let clock = Clock::manual(1000);
    let (store, disk) = new_store(&clock);
    let bs = store.block_size();
    let vol = store.volume().clone();
    let f = store
        .write_blocking(|ctx| {
            ns::create(
                ctx,
                &CreateRequest {
                    delegate: false,
                    inode: None,
                    time: None,
                    cred: Credentials::root(),
                    session: SessionId(1),
                    parent: InodeId(ROOT),
                    name: name("f"),
                    perm: 0o644,
                    exclusive: true,
                    flags: OpenFlags {
                        read: true,
                        write: true,
                        append: false,
                        truncate: false,
                    },
                },
            )
        })
        .unwrap();
    let ino = f.attr.ino.0;
    let v = vol.clone();
    let m = store
        .write_blocking(move |ctx| data::map_write(ctx, &v, InodeId(ino), 0, 1 << 20))
        .unwrap();
    assert_eq!(m.plan.device_ios.len(), 4, "{:?}", m.plan);
    assert_eq!(m.plan.device_bytes(), 1 << 20);
    let r = store
        .read(|t| data::map_read(t, &vol, bs, InodeId(ino), 0, 1 << 20))
        .unwrap();
    assert_eq!(r.len, 0, "size is still 0: nothing to read");
    // Unaligned ranges are refused and change nothing.
    let v = vol.clone();
    let bad = store.write_blocking(move |ctx| data::map_write(ctx, &v, InodeId(ino), 512, 4096));
    assert!(matches!(bad, Err(FsError::Invalid(_))), "{bad:?}");
    // The device wrote the first 768 KiB only.
    let attr = crate::support::complete_blocking(&store, ino, 0, 768 << 10);
    assert_eq!(attr.size, 768 << 10);
    let ext = store.read(|t| t.extent_list(InodeId(ino))).unwrap();
    let written: u64 = ext
        .iter()
        .filter(|e| e.state == sanfs_blockmap::extent::ExtentState::Written)
        .map(|e| e.len_blocks)
        .sum();
    assert_eq!(written * u64::from(bs), 768 << 10);
    let r = store
        .read(|t| data::map_read(t, &vol, bs, InodeId(ino), 0, 1 << 20))
        .unwrap();
    assert_eq!(r.len, 768 << 10);
    assert_eq!(r.plan.zero_fill_bytes(), 0);
    assert_eq!(r.plan.device_ios.len(), 4);
    store.close();
    drop(store);
    let rep = sanfs_mds::fsck::check(&sanfs_mds::store::Backend::Sim(disk)).unwrap();
    assert!(rep.is_clean(), "{rep}");
    assert_eq!(rep.used_blocks, 256);
}

/// Issue 16 item 6: a sequential write into the last blocks below the largest file size gets
/// no speculative preallocation past that size (SEEK_DATA, SEEK_HOLE and bmap then failed
/// with EIO until close), and fsck finds an extent there.
#[test]
fn preallocation_stops_at_the_largest_file_size_and_fsck_checks_it() {
    use sanfs_blockmap::extent::ExtentMap;
    use sanfs_mds::data;
    use sanfs_proto::types::MAX_FILE_SIZE;
    let clock = Clock::manual(1000);
    let (store, disk) = new_store(&clock);
    let bs = u64::from(store.block_size());
    let vol = store.volume().clone();
    let f = store
        .write_blocking(|ctx| {
            ns::create(
                ctx,
                &CreateRequest {
                    delegate: false,
                    inode: None,
                    time: None,
                    cred: Credentials::root(),
                    session: SessionId(1),
                    parent: InodeId(ROOT),
                    name: name("f"),
                    perm: 0o644,
                    exclusive: true,
                    flags: OpenFlags {
                        read: true,
                        write: true,
                        append: false,
                        truncate: false,
                    },
                },
            )
        })
        .unwrap();
    let ino = f.attr.ino.0;
    let max_end_block = MAX_FILE_SIZE.div_ceil(bs);
    // Two blocks below the largest aligned end, asking 1024 blocks (4 MiB) ahead: at most the
    // blocks up to the largest file size are taken.
    let offset = (MAX_FILE_SIZE / bs - 2) * bs;
    let v = vol.clone();
    let (m, ahead) = store
        .write_blocking(move |ctx| data::map_write_ahead(ctx, &v, InodeId(ino), offset, bs, 1024))
        .unwrap();
    assert_eq!(m.len, bs);
    assert!(ahead.1 <= max_end_block, "ahead {ahead:?}");
    let ext = store.read(|t| t.extent_list(InodeId(ino))).unwrap();
    let end = ext
        .iter()
        .map(|e| e.file_block + e.len_blocks)
        .max()
        .unwrap();
    assert!(end <= max_end_block, "extents end at block {end}: {ext:?}");
    assert_eq!(end, offset / bs + 1 + (ahead.1 - ahead.0));
    // The write lands; a second one right after it is within the preallocation.
    crate::support::complete_blocking(&store, ino, offset, bs);
    store.close();
    drop(store);
    let backend = sanfs_mds::store::Backend::Sim(disk.clone());
    let rep = sanfs_mds::fsck::check(&backend).unwrap();
    assert!(rep.is_clean(), "{rep}");

    // Damage: the file's last extent moved past the largest file size. fsck says so.
    let store = sanfs_mds::store::Store::open(&backend, clock.clone(), 64).unwrap();
    store
        .write_blocking(move |ctx| {
            let mut ext = ctx.t.extent_map(InodeId(ino))?.to_vec();
            let last = ext.last_mut().unwrap();
            last.file_block = max_end_block;
            let map = ExtentMap::from_extents(ext).unwrap();
            sanfs_mds::space::save_extents(&mut ctx.t, InodeId(ino), &map)
        })
        .unwrap();
    store.close();
    drop(store);
    let rep = sanfs_mds::fsck::check(&sanfs_mds::store::Backend::Sim(disk)).unwrap();
    assert!(
        rep.problems
            .iter()
            .any(|p| p.contains("passes the largest file size")),
        "{rep}"
    );
}
