//! Valid domain values of every message family, and the round-trip helper.

use std::fmt::Debug;

use prost::Message;
use sanfs_blockmap::volume::{
    DeviceId, DeviceIndex, LayoutKind, LvmPvId, Segment, StripeLeg, Volume, VolumeDevice,
};
use sanfs_proto::model::*;
use sanfs_proto::types::*;
use uuid::Uuid;

pub const KIB: u64 = 1024;
pub const MIB: u64 = 1024 * KIB;

/// domain -> pb -> bytes -> pb -> domain, which must give the value back. Returns the pb.
pub fn round_trip<D, P>(value: D) -> P
where
    D: Clone + PartialEq + Debug + TryFrom<P, Error = ProtocolError>,
    P: Message + Default + From<D> + Clone,
{
    let p = P::from(value.clone());
    let bytes = p.encode_to_vec();
    let decoded = P::decode(bytes.as_slice()).unwrap();
    let back = D::try_from(decoded.clone()).unwrap_or_else(|e| panic!("{value:?}: {e}"));
    assert_eq!(back, value);
    decoded
}

/// The conversion of `p` must fail; returns the error.
pub fn rejected<D, P>(p: P) -> ProtocolError
where
    D: Debug + TryFrom<P, Error = ProtocolError>,
{
    match D::try_from(p) {
        Ok(d) => panic!("accepted: {d:?}"),
        Err(e) => e,
    }
}

pub fn cred() -> Credentials {
    Credentials {
        uid: 1000,
        gid: 100,
        groups: vec![10, 20, 30],
    }
}

pub fn name(s: &str) -> FileName {
    FileName::new(s).unwrap()
}

pub fn ts(sec: i64, nsec: u32) -> Timestamp {
    Timestamp::new(sec, nsec).unwrap()
}

pub fn attr(ino: u64, kind: FileType) -> Attr {
    Attr {
        ino: InodeId(ino),
        kind,
        perm: 0o4755,
        nlink: 2,
        uid: 1000,
        gid: 100,
        size: 123_456,
        allocated: 131_072,
        atime: ts(-5, 999_999_999),
        mtime: ts(1_700_000_000, 1),
        ctime: ts(1_700_000_001, 0),
        btime: ts(0, 0),
        rdev: 0,
        generation: 7,
        no_xattrs: false,
    }
}

pub fn range(offset: u64, len: u64) -> ByteRange {
    ByteRange::new(offset, len).unwrap()
}

pub fn handle() -> HandleRef {
    HandleRef {
        session: SessionId(5),
        handle: OpenHandle(9),
    }
}

pub fn server_info() -> ServerInfo {
    ServerInfo {
        fs_uuid: Uuid::from_u128(0xfeed),
        block_size: 4096,
        direct_io_threshold: 64 * KIB,
        max_grant_bytes: 64 * MIB,
        max_inline_bytes: 8 << 20,
        server_version: "sanfs-mds 0.1.0".into(),
        restores: 2,
        multi_part_complete: true,
        write_sets_attr: true,
        releases_with_changes: true,
    }
}

/// A read grant over 64 KiB striped 32 KiB + hole + 16 KiB: d0 gets buffer [0, 16K) and
/// [32K, 48K) gathered into one I/O, d1 gets [16K, 32K), [48K, 64K) is a hole.
pub fn read_grant() -> Grant {
    Grant {
        grant_id: GrantId(77),
        epoch: SessionEpoch(3),
        inode: InodeId(42),
        range: range(MIB, 64 * KIB),
        mode: LockMode::Shared,
        device_ios: vec![
            DeviceIo {
                device: DeviceIndex(0),
                phys_off: MIB,
                len: 32 * KIB,
                iov: vec![
                    BufRange {
                        buf_off: 0,
                        len: 16 * KIB,
                    },
                    BufRange {
                        buf_off: 32 * KIB,
                        len: 16 * KIB,
                    },
                ],
            },
            DeviceIo {
                device: DeviceIndex(1),
                phys_off: 2 * MIB,
                len: 16 * KIB,
                iov: vec![BufRange {
                    buf_off: 16 * KIB,
                    len: 16 * KIB,
                }],
            },
        ],
        zero_fill: vec![BufRange {
            buf_off: 48 * KIB,
            len: 16 * KIB,
        }],
        file_size: 2 * MIB,
        cacheable: true,
    }
}

pub fn write_grant() -> Grant {
    Grant {
        grant_id: GrantId(78),
        epoch: SessionEpoch(3),
        inode: InodeId(42),
        range: range(0, 8 * KIB),
        mode: LockMode::Exclusive,
        device_ios: vec![DeviceIo {
            device: DeviceIndex(2),
            phys_off: 4 * MIB,
            len: 8 * KIB,
            iov: vec![BufRange {
                buf_off: 0,
                len: 8 * KIB,
            }],
        }],
        zero_fill: vec![],
        file_size: 0,
        cacheable: false,
    }
}

pub fn devices(n: u32, size: u64) -> Vec<VolumeDevice> {
    (0..n)
        .map(|i| VolumeDevice {
            uuid: DeviceId::Sanfs(Uuid::from_u128(u128::from(i) + 1)),
            size_bytes: size,
        })
        .collect()
}

pub fn striped_volume() -> Volume {
    Volume::striped(4096, devices(4, 9 * MIB), MIB, 64 * KIB).unwrap()
}

pub fn linear_volume() -> Volume {
    Volume::linear(4096, devices(2, 5 * MIB), MIB).unwrap()
}

/// Two segments (striped over 2 LVM PVs, then linear on a third), as an imported LVM2 LV.
pub fn lvm_volume() -> Volume {
    let pv =
        |c: u8| DeviceId::LvmPv(LvmPvId::parse(&String::from_utf8(vec![c; 32]).unwrap()).unwrap());
    let devices = vec![
        VolumeDevice {
            uuid: pv(b'a'),
            size_bytes: 4 * MIB,
        },
        VolumeDevice {
            uuid: pv(b'b'),
            size_bytes: 4 * MIB,
        },
        VolumeDevice {
            uuid: pv(b'c'),
            size_bytes: 4 * MIB,
        },
    ];
    let segments = vec![
        Segment {
            vol_start: 0,
            len: 256 * KIB,
            stripe_unit: 64 * KIB,
            legs: vec![
                StripeLeg {
                    device: DeviceIndex(0),
                    phys_start: MIB,
                },
                StripeLeg {
                    device: DeviceIndex(1),
                    phys_start: MIB,
                },
            ],
        },
        Segment {
            vol_start: 256 * KIB,
            len: 512 * KIB,
            stripe_unit: 4096,
            legs: vec![StripeLeg {
                device: DeviceIndex(2),
                phys_start: 2 * MIB,
            }],
        },
    ];
    Volume::from_segments(
        4096,
        devices,
        segments,
        LayoutKind::Lvm {
            vg_name: "vg0".into(),
            lv_name: "lv0".into(),
        },
    )
    .unwrap()
}
