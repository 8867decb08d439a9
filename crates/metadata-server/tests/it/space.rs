//! File space: every way blocks leave a file (punch, trim past EOF, truncate, destroy) goes
//! through `space::release`, which frees exactly the blocks it is given and uncharges them
//! from the file's quota.

use std::sync::atomic::Ordering;

use sanfs_mds::clock::Clock;
use sanfs_mds::store::{ROOT, Store};
use sanfs_mds::{ns, quota, space};
use sanfs_proto::model::{
    CreateRequest, EntryRequest, MkdirRequest, OpenFlags, QuotaLimits, SetAttrRequest,
};
use sanfs_proto::types::{Credentials, InodeId, SessionId, SetAttr};

use crate::support::{MIB, name, new_store};

fn free(store: &Store) -> u64 {
    store.usage().free_blocks.load(Ordering::Relaxed)
}

fn used(store: &Store, ino: InodeId) -> u64 {
    quota::quota_of(store, ino.0)
        .unwrap()
        .map(|(_, q)| q.used_blocks)
        .unwrap()
}

#[test]
fn every_way_out_frees_and_uncharges_exactly_what_it_unmaps() {
    let clock = Clock::manual(1000);
    let (store, disk) = new_store(&clock);
    let bs = u64::from(store.block_size());
    let dir = store
        .write_blocking(|ctx| {
            let d = ns::mkdir(
                ctx,
                &MkdirRequest {
                    cred: Credentials::root(),
                    parent: InodeId(ROOT),
                    name: name("vol"),
                    perm: 0o755,
                    delegate: false,
                },
            )?;
            let limits = QuotaLimits {
                capacity_bytes: Some(64 * MIB),
                inodes: None,
            };
            quota::set(ctx, &Credentials::root(), d.ino.0, &limits)?;
            Ok(d.ino)
        })
        .unwrap();
    let file = |n: &'static str| {
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
                        parent: dir,
                        name: name(n),
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
            .unwrap()
    };
    let (fa, fb) = (file("a"), file("b"));
    let (a, b) = (fa.attr.ino, fb.attr.ino);
    let free0 = free(&store);
    assert_eq!(used(&store, dir), 0);

    // 256 blocks to `a` (the size grows to 1 MiB), 256 to `b` past its end (size stays 0).
    store
        .write_blocking(move |ctx| ns::allocate_range(ctx, &Credentials::root(), a, 0, MIB, false))
        .unwrap();
    store
        .write_blocking(move |ctx| ns::allocate_range(ctx, &Credentials::root(), b, 0, MIB, true))
        .unwrap();
    let per_file = MIB / bs;
    assert_eq!(used(&store, dir), 2 * per_file);
    assert_eq!(free(&store), free0 - 2 * per_file);

    // Punch: the quarter [16, 80) of `a`'s blocks goes back.
    store
        .write_blocking(move |ctx| space::punch_blocks(ctx, a, 16, 80))
        .unwrap();
    assert_eq!(used(&store, dir), 2 * per_file - 64);
    assert_eq!(free(&store), free0 - 2 * per_file + 64);

    // Trim past EOF: all of `b`'s blocks lie past its end of file.
    let trimmed = store
        .write_blocking(move |ctx| space::trim_unwritten_past_eof(ctx, b, 0, per_file))
        .unwrap();
    assert_eq!(trimmed, per_file);
    assert_eq!(used(&store, dir), per_file - 64);

    // Truncate `a` to one block and a half: blocks from the third on go (14 of them before the
    // punched hole, 176 after it).
    let half = bs + bs / 2;
    store
        .write_blocking(move |ctx| {
            ns::setattr(
                ctx,
                &SetAttrRequest {
                    cred: Credentials::root(),
                    inode: a,
                    handle: None,
                    changes: SetAttr {
                        size: Some(half),
                        ..SetAttr::default()
                    },
                },
            )
        })
        .unwrap();
    assert_eq!(used(&store, dir), 2);
    assert_eq!(free(&store), free0 - 2);

    // Destroy: unlinking the last name of a closed file frees the rest and its inode charge.
    for h in [fa.handle, fb.handle] {
        assert!(store.handles().release(h.0).is_some_and(|(_, last)| last));
    }
    for n in ["a", "b"] {
        store
            .write_blocking(move |ctx| {
                ns::unlink(
                    ctx,
                    &EntryRequest {
                        cred: Credentials::root(),
                        parent: dir,
                        name: name(n),
                    },
                    false,
                )
            })
            .unwrap();
    }
    assert_eq!(used(&store, dir), 0);
    assert_eq!(free(&store), free0);
    let q = quota::quota_of(&store, dir.0).unwrap().unwrap().1;
    assert_eq!(q.used_inodes, 0);

    store.close();
    drop(store);
    let rep = sanfs_mds::fsck::check(&sanfs_mds::store::Backend::Sim(disk)).unwrap();
    assert!(rep.is_clean(), "{rep}");
}
