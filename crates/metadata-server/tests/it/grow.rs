//! `Store::grow`: a grown volume is committed with its new free space in one transaction: the
//! allocator hands out the new blocks at once, statfs capacity follows, the old blocks keep
//! their place, a plan made from a volume that changed meanwhile or that is no growth is
//! refused without a change, and the grown store reopens (with the paths the growth was
//! given, for the server to open at start) and passes fsck.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use sanfs_blockmap::volume::{DeviceId, VolumeDevice};
use sanfs_mds::clock::Clock;
use sanfs_mds::fsck;
use sanfs_mds::ns;
use sanfs_mds::store::{Backend, ROOT, Store};
use sanfs_proto::model::{CreateRequest, OpenFlags};
use sanfs_proto::types::{Credentials, FsError, InodeId, SessionId};
use uuid::Uuid;

use crate::support::{MIB, name, new_store, volume};

fn create(store: &Store, n: &'static str) -> InodeId {
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
                    parent: InodeId(ROOT),
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
        .attr
        .ino
}

fn allocate(store: &Store, ino: InodeId, bytes: u64) -> Result<(), FsError> {
    store.write_blocking(move |ctx| {
        ns::allocate_range(ctx, &Credentials::root(), ino, 0, bytes, false).map(|_| ())
    })
}

#[tokio::test]
async fn a_grown_volume_is_allocated_at_once_and_survives_a_reopen() {
    let clock = Clock::manual(1000);
    let (store, disk) = new_store(&clock);
    let bs = u64::from(store.block_size());
    let old = store.volume();
    assert_eq!(*old, volume());
    // Most of the 4 x 63 MiB volume to one file: 100 MiB more does not fit.
    let a = create(&store, "a");
    allocate(&store, a, 200 * MIB).unwrap();
    let b = create(&store, "b");
    assert_eq!(allocate(&store, b, 100 * MIB), Err(FsError::NoSpace));
    let free_before = store.usage().free_blocks.load(Ordering::Relaxed);
    let extents_a = store.read(move |t| t.extents(a)).unwrap();

    // Two LUNs of 64 MiB striped at the end.
    let new_devices: Vec<VolumeDevice> = (0..2)
        .map(|i| VolumeDevice {
            uuid: DeviceId::Sanfs(Uuid::from_u128(200 + i)),
            size_bytes: 64 * MIB,
        })
        .collect();
    let grown = old
        .with_segment_appended(new_devices, MIB, Some(64 * 1024))
        .unwrap();
    assert!(store.grown_device_paths().is_empty());
    let given: Vec<std::path::PathBuf> = vec!["/dev/loop70".into(), "/dev/loop71".into()];
    let added = store
        .grow(old.clone(), grown.clone(), &given)
        .await
        .unwrap();
    assert_eq!(store.grown_device_paths(), given);
    assert_eq!(added, (grown.size_bytes() - old.size_bytes()) / bs);
    assert_eq!(*store.volume(), grown);
    assert_eq!(
        store.usage().total_blocks.load(Ordering::Relaxed),
        grown.size_blocks()
    );
    assert_eq!(
        store.usage().free_blocks.load(Ordering::Relaxed),
        free_before + added
    );

    // The same plan again: the volume changed meanwhile. A smaller volume: no growth.
    let refused: Vec<std::path::PathBuf> = vec!["/dev/loop72".into()];
    let again = store.grow(old.clone(), grown.clone(), &refused).await;
    assert!(matches!(again, Err(FsError::Invalid(_))), "{again:?}");
    let shrink = store
        .grow(Arc::new(grown.clone()), (*old).clone(), &refused)
        .await;
    assert!(matches!(shrink, Err(FsError::Invalid(_))), "{shrink:?}");
    assert_eq!(*store.volume(), grown);
    assert_eq!(
        store.grown_device_paths(),
        given,
        "a refused growth records no path"
    );

    // The new space is used at once: 100 MiB now fit, partly past the old end.
    allocate(&store, b, 100 * MIB).unwrap();
    let extents_b = store.read(move |t| t.extents(b)).unwrap();
    assert!(
        extents_b
            .iter()
            .any(|e| e.vol_block + e.len_blocks > old.size_blocks()),
        "some of b lies in the new segment: {extents_b:?}"
    );
    assert_eq!(store.read(move |t| t.extents(a)).unwrap(), extents_a);

    // Durable: reopened, the store has the grown volume and passes fsck.
    store.close();
    drop(store);
    let backend = Backend::Sim(disk.clone());
    let store = Store::open(&backend, clock.clone(), 64).unwrap();
    assert_eq!(*store.volume(), grown);
    assert_eq!(store.grown_device_paths(), given);
    assert_eq!(
        store.usage().total_blocks.load(Ordering::Relaxed),
        grown.size_blocks()
    );
    store.close();
    drop(store);
    let report = fsck::check(&backend).unwrap();
    assert!(report.is_clean(), "{:?}", report.problems);
    assert_eq!(report.capacity_blocks, grown.size_blocks());
}
