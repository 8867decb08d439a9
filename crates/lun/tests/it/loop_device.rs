//! Loop devices with 512- and 4096-byte logical blocks: opened direct, described, probed.

use std::fs::File;
use std::os::unix::fs::FileExt;

use sanfs_blockmap::label::{DeviceLabel, LabelLayout};
use sanfs_blockmap::volume::DeviceId;
use sanfs_lun::{Access, AlignedBuf, LunIdentity};
use sanfs_testcluster::{LunKind, Luns, skip_unless_root};

const SIZE: u64 = 8 << 20;

fn label(device_uuid: u128) -> DeviceLabel {
    DeviceLabel {
        fs_uuid: uuid::Uuid::from_u128(7),
        device_uuid: uuid::Uuid::from_u128(device_uuid),
        device_index: 0,
        device_count: 1,
        device_size: SIZE,
        data_offset: 1 << 20,
        block_size: 4096,
        layout: LabelLayout::Linear,
        formatted_at: 0,
    }
}

#[test]
fn loop_devices_report_their_sector_size_and_serve_unaligned_reads() {
    if skip_unless_root("loop-device LUNs") {
        return;
    }
    for sector_size in [512u32, 4096] {
        let dir = tempfile::tempdir().unwrap();
        let luns =
            Luns::create_with_sector_size(dir.path(), 1, SIZE, LunKind::Loop, Some(sector_size))
                .unwrap();
        let dev = &luns.paths()[0];
        let (file, direct) = sanfs_lun::open_direct(dev, Access::ReadWrite).unwrap();
        assert!(direct, "a loop device takes O_DIRECT");
        let g = sanfs_lun::describe(&file).unwrap();
        assert!(matches!(g.identity, LunIdentity::BlockDevice { .. }));
        assert_eq!(g.size_bytes, SIZE);
        assert_eq!(g.logical_block_size, sector_size, "{}", dev.display());

        // Aligned direct writes of a pattern, then reads at odd offsets through the span.
        let mut buf = AlignedBuf::zeroed(3 * 4096);
        for (i, b) in buf.as_mut_slice().iter_mut().enumerate() {
            *b = (i % 251) as u8;
        }
        file.write_all_at(buf.as_slice(), 8192).unwrap();
        file.sync_data().unwrap();
        // An unaligned direct read is refused by the device itself...
        let mut odd = AlignedBuf::zeroed(4096);
        assert!(file.read_exact_at(odd.as_mut_slice(), 8192 + 100).is_err());
        // ...and read_direct turns it into an aligned one.
        for (off, len) in [
            (0u64, 1usize),
            (100, 3000),
            (4095, 2),
            (8191, 4),
            (12_000, 100),
        ] {
            let got = sanfs_lun::read_direct(&file, 8192 + off, len, g.logical_block_size).unwrap();
            assert_eq!(
                got,
                &buf.as_slice()[off as usize..off as usize + len],
                "{sector_size}: {off}+{len}"
            );
        }
    }
}

#[test]
fn a_label_names_the_device_whatever_path_leads_to_it() {
    if skip_unless_root("loop-device LUNs") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let luns = Luns::create(dir.path(), 2, SIZE, LunKind::Loop).unwrap();
    let (dev0, dev1) = (&luns.paths()[0], &luns.paths()[1]);
    // dev0 labelled through the device, dev1 left blank.
    let (file, _) = sanfs_lun::open_direct(dev0, Access::ReadWrite).unwrap();
    let mut head = AlignedBuf::zeroed(4096);
    head.as_mut_slice().copy_from_slice(&label(42).encode());
    file.write_all_at(head.as_slice(), 0).unwrap();
    file.sync_data().unwrap();

    let want = Some(DeviceId::Sanfs(uuid::Uuid::from_u128(42)));
    assert_eq!(sanfs_lun::probe_identity(dev0).unwrap(), want);
    // The backing file carries the same identity (what a file-backed LUN is found by).
    assert_eq!(
        sanfs_lun::probe_identity(&luns.backing_files()[0]).unwrap(),
        want
    );
    assert_eq!(sanfs_lun::probe_identity(dev1).unwrap(), None);
    assert_eq!(
        sanfs_lun::read_head(dev0).unwrap().len(),
        sanfs_lun::probe::HEAD_BYTES
    );

    // Two opens of one device: one identity; two devices: two.
    let again = sanfs_lun::describe(&File::open(dev0).unwrap()).unwrap();
    assert_eq!(again.identity, sanfs_lun::describe(&file).unwrap().identity);
    let other = sanfs_lun::describe(&File::open(dev1).unwrap()).unwrap();
    assert_ne!(other.identity, again.identity);
}

#[test]
fn an_exclusive_open_keeps_a_second_one_out() {
    if skip_unless_root("loop-device LUNs") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let luns = Luns::create(dir.path(), 1, SIZE, LunKind::Loop).unwrap();
    let dev = &luns.paths()[0];
    let held = sanfs_lun::open_exclusive(dev, Access::ReadWrite).unwrap();
    let e = sanfs_lun::open_exclusive(dev, Access::ReadWrite).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc_ebusy()), "{e}");
    // Shared opens (the direct read path, probes) still work.
    assert!(sanfs_lun::probe_identity(dev).is_ok());
    drop(held);
    // Free again. Another process of this machine that scans loop devices (an agent's
    // `devices=/dev/loop*`, a format's probe) may hold it exclusively for a moment: a
    // bounded retry on EBUSY, not a failure.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        match sanfs_lun::open_exclusive(dev, Access::ReadWrite) {
            Ok(_) => break,
            Err(e)
                if e.raw_os_error() == Some(libc_ebusy())
                    && std::time::Instant::now() < deadline =>
            {
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
            Err(e) => panic!("exclusive open after the holder let go: {e}"),
        }
    }
}

fn libc_ebusy() -> i32 {
    rustix::io::Errno::BUSY.raw_os_error()
}
