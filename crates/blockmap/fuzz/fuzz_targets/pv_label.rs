//! Fuzzes the LVM2 PV label and metadata area header parsers.
//!
//! Input: one mode byte, then the label scan area (2048 bytes), then a metadata area header
//! (512 bytes), then metadata text. Mode bit 0 makes the label checksums valid, bit 1 the mda
//! header checksum, and bit 2 takes the metadata area's place from the header itself instead
//! of from the label, so that the fuzzer reaches the code behind the checksums.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sanfs_blockmap::lvm::{
    DiskArea, INITIAL_CRC, LABEL_SCAN_BYTES, LABEL_SCAN_SECTORS, MDA_HEADER_SIZE, SECTOR_SIZE,
    calc_crc, parse_mda_header, parse_pv_label,
};

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let mut image = rest.to_vec();
    if mode & 1 != 0 {
        for s in 0..LABEL_SCAN_SECTORS {
            if let Some(sector) = image.get_mut(s * SECTOR_SIZE..(s + 1) * SECTOR_SIZE) {
                let crc = calc_crc(INITIAL_CRC, &sector[20..]);
                sector[16..20].copy_from_slice(&crc.to_le_bytes());
            }
        }
    }
    let label = parse_pv_label(&image);
    if let Ok(label) = &label {
        assert!(label.sector < LABEL_SCAN_SECTORS as u64);
    }

    let mut header = image.get(LABEL_SCAN_BYTES..).unwrap_or_default().to_vec();
    if mode & 2 != 0 && header.len() >= MDA_HEADER_SIZE {
        let crc = calc_crc(INITIAL_CRC, &header[4..MDA_HEADER_SIZE]);
        header[..4].copy_from_slice(&crc.to_le_bytes());
    }
    let area = match &label {
        Ok(l) if mode & 4 == 0 && !l.metadata_areas.is_empty() => l.metadata_areas[0],
        _ if header.len() >= 40 => DiskArea {
            offset: u64_at(&header, 24),
            size: u64_at(&header, 32),
        },
        _ => DiskArea {
            offset: 4096,
            size: 1 << 20,
        },
    };
    let Ok(mda) = parse_mda_header(&header, area) else {
        return;
    };
    let Ok(location) = mda.metadata_location() else {
        return;
    };
    // The pieces add up to the text, lie in the ring after the header, and do not overlap.
    let total: u64 = location.pieces.iter().map(|p| p.len).sum();
    assert_eq!(total, location.size);
    assert!(location.pieces.len() <= 2);
    let ring_start = mda.start + MDA_HEADER_SIZE as u64;
    for p in &location.pieces {
        assert!(p.len > 0);
        assert!(p.offset >= ring_start && p.offset + p.len <= mda.start + mda.size);
    }
    if let [a, b] = location.pieces[..] {
        assert_eq!(b.offset, ring_start);
        assert!(b.offset + b.len <= a.offset);
    }
    let text = header.get(MDA_HEADER_SIZE..).unwrap_or_default();
    let _ = location.verify_text(text);
});
