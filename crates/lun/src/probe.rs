//! Which LUN a device is: its first bytes read with direct I/O, and the identity found in
//! them (the sanfs label's device UUID, else the LVM2 PV UUID). Paths differ between nodes;
//! identities do not.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;

use sanfs_blockmap::label::{DeviceLabel, PROBE_SIZE};
use sanfs_blockmap::lvm::{LABEL_SCAN_BYTES, parse_pv_label};
use sanfs_blockmap::volume::DeviceId;

use crate::buf::AlignedBuf;
use crate::open::{Access, open_direct};

/// How many bytes [`read_head`] reads: enough for [`sanfs_blockmap::label::probe`] and for
/// the LVM2 label scan.
pub const HEAD_BYTES: usize = if PROBE_SIZE > LABEL_SCAN_BYTES {
    PROBE_SIZE
} else {
    LABEL_SCAN_BYTES
};

/// Reads the first [`HEAD_BYTES`] (fewer if the device is smaller) with `O_DIRECT` where the
/// file system allows it.
pub fn read_head(path: &Path) -> io::Result<Vec<u8>> {
    let (file, _) = open_direct(path, Access::Read)?;
    let mut buf = AlignedBuf::zeroed(HEAD_BYTES);
    let buf = buf.as_mut_slice();
    let mut got = 0usize;
    while got < buf.len() {
        match file.read_at(&mut buf[got..], got as u64) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
        // A direct read of a file whose end is not block aligned returns a short, unaligned
        // tail; anything after it would be misaligned, and there is nothing after it anyway.
        if !got.is_multiple_of(512) {
            break;
        }
    }
    Ok(buf[..got].to_vec())
}

/// The identity in a device's first bytes: its sanfs label, else its LVM2 PV label.
pub fn identify(head: &[u8]) -> Option<DeviceId> {
    if let Ok(label) = DeviceLabel::decode(head) {
        return Some(DeviceId::Sanfs(label.device_uuid));
    }
    parse_pv_label(head)
        .ok()
        .map(|pv| DeviceId::LvmPv(pv.pv_id))
}

/// Reads the identity of the device or file at `path` (`None`: no label).
pub fn probe_identity(path: &Path) -> io::Result<Option<DeviceId>> {
    Ok(identify(&read_head(path)?))
}

/// Reads `len` bytes at `off` through an `O_DIRECT` descriptor: the span around the range,
/// aligned to `align` (the logical block size), into an aligned buffer, then the wanted bytes
/// out of it. The caller checks the range against the device's size.
pub fn read_direct(file: &File, off: u64, len: usize, align: u32) -> io::Result<Vec<u8>> {
    let align = u64::from(align.max(1));
    let start = off - off % align;
    let end = off
        .checked_add(len as u64)
        .and_then(|end| end.div_ceil(align).checked_mul(align))
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "range past 2^64"))?;
    let span = usize::try_from(end - start).map_err(io::Error::other)?;
    let mut buf = AlignedBuf::zeroed(span);
    file.read_exact_at(buf.as_mut_slice(), start)?;
    let from = (off - start) as usize;
    Ok(buf.as_slice()[from..from + len].to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identify_knows_sanfs_labels_and_nothing_else() {
        let label = DeviceLabel {
            fs_uuid: uuid::Uuid::from_u128(1),
            device_uuid: uuid::Uuid::from_u128(2),
            device_index: 0,
            device_count: 1,
            device_size: 1 << 30,
            data_offset: 1 << 20,
            block_size: 4096,
            layout: sanfs_blockmap::label::LabelLayout::Linear,
            formatted_at: 0,
        };
        let mut head = label.encode();
        head.resize(PROBE_SIZE, 0);
        assert_eq!(
            identify(&head),
            Some(DeviceId::Sanfs(uuid::Uuid::from_u128(2)))
        );
        assert_eq!(identify(&vec![0u8; PROBE_SIZE]), None);
        assert_eq!(identify(b"short"), None);
    }

    #[test]
    fn direct_reads_pick_the_bytes_out_of_an_aligned_span() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("lun");
        let data: Vec<u8> = (0..8192u32).map(|i| (i % 251) as u8).collect();
        std::fs::write(&path, &data).unwrap();
        // A regular file without O_DIRECT exercises the span arithmetic alone.
        let file = File::open(&path).unwrap();
        for (off, len) in [(0, 1), (511, 2), (1000, 3000), (4096, 4096), (8191, 1)] {
            let got = read_direct(&file, off, len, 512).unwrap();
            assert_eq!(got, &data[off as usize..off as usize + len], "{off}+{len}");
        }
        assert!(read_direct(&file, 8000, 1000, 512).is_err(), "past the end");
        assert!(read_direct(&file, u64::MAX - 1, 2, 512).is_err());
    }
}
