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
