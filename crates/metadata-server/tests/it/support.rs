//! Shared helpers: a small striped volume, stores on the crash-simulating disk, requests.

use sanfs_blockmap::volume::{DeviceId, Volume, VolumeDevice};
use sanfs_mds::clock::Clock;
use sanfs_mds::store::backend::{FaultPlan, SimDisk};
use sanfs_mds::store::{Backend, FsInfo, Store};
use sanfs_proto::types::FileName;
use uuid::Uuid;

pub const MIB: u64 = 1 << 20;

/// 4 LUNs of 64 MiB, 64 KiB stripe unit, 4 KiB blocks.
pub fn volume() -> Volume {
    let devices = (0..4)
        .map(|i| VolumeDevice {
            uuid: DeviceId::Sanfs(Uuid::from_u128(100 + i)),
            size_bytes: 64 * MIB,
        })
        .collect();
    Volume::striped(4096, devices, MIB, 64 * 1024).unwrap()
}

pub fn fs_info() -> FsInfo {
    FsInfo {
        fs_uuid: Uuid::from_u128(7),
        volume: volume(),
        lvm: None,
    }
}

/// A freshly formatted store on a fault-free simulated disk; the disk is returned too.
pub fn new_store(clock: &Clock) -> (Store, SimDisk) {
    let disk = SimDisk::new(FaultPlan::default());
    sanfs_testcluster::mds::create_store(&Backend::Sim(disk.clone()), &fs_info(), clock).unwrap();
    let store = Store::open(&Backend::Sim(disk.clone()), clock.clone(), 64).unwrap();
    (store, disk)
}

pub fn name(s: &str) -> FileName {
    FileName::new(s.as_bytes().to_vec()).unwrap()
}

/// A write's completion (`data::complete_write` of `[off, off + len)`) as a durable data
/// commit, for tests outside an async runtime.
pub fn complete_blocking(store: &Store, ino: u64, off: u64, len: u64) -> sanfs_proto::types::Attr {
    tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap()
        .block_on(
            store.write_data(true, sanfs_mds::store::Luns::All, move |ctx| {
                sanfs_mds::data::complete_write(
                    ctx,
                    sanfs_proto::types::InodeId(ino),
                    off,
                    len,
                    false,
                )
            }),
        )
        .unwrap()
        .0
}
