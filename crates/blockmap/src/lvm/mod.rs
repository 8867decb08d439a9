//! LVM2 import: read an existing LVM2 logical volume's layout and turn it into a
//! [`Volume`](crate::volume::Volume).
//!
//! sanfs can run on an LVM2 logical volume that already exists on the shared LUNs, without
//! device-mapper: every node maps volume bytes to (PV, physical byte) itself, exactly as the
//! kernel's `striped` target would. This module is pure: the caller reads the bytes, this module
//! parses and checks them. The reading sequence for one PV is:
//!
//! 1. read the first [`LABEL_SCAN_BYTES`] of the device, [`parse_pv_label`] finds the
//!    `LABELONE` label in sectors 0 to 3 and returns the PV UUID and its metadata areas;
//! 2. read [`MDA_HEADER_SIZE`] bytes at a metadata area's offset, [`parse_mda_header`] checks
//!    them and [`MdaHeader::metadata_location`] says which one or two byte extents hold the
//!    committed metadata text (the area is a ring buffer, so the text may wrap);
//! 3. read those extents, concatenated, and check them with [`MetadataLocation::verify_text`];
//! 4. [`parse_vg_metadata`] turns the text (or a `vgcfgbackup` file) into [`VgMetadata`];
//! 5. [`VgMetadata::lv_volume`] builds the volume of one LV, and [`lv_map`] maps any LV
//!    byte range to runs of (PV UUID, physical byte offset, length).
//!
//! Only `striped` segments (which include linear ones, `stripe_count = 1`) can be imported;
//! every other segment type (raid, mirror, thin, cache, snapshot, vdo, ...) is reported by name
//! when its LV is asked for, and LVs that other LVs build on are refused, because writing them
//! directly would corrupt the LV on top.
//!
//! LVM2 checksums its on-disk structures with its own CRC-32 ([`calc_crc`]), not crc32c.

mod label;
mod layout;
mod metadata;
mod text;

pub use label::{
    ByteExtent, DiskArea, LABEL_SCAN_BYTES, LABEL_SCAN_SECTORS, MDA_HEADER_SIZE, MdaHeader,
    MetadataLocation, PV_EXT_USED, PvHeaderExtension, PvLabel, RAW_LOCN_IGNORED, RawLocn,
    SECTOR_SIZE, parse_mda_header, parse_pv_label,
};
pub use layout::{PvRun, lv_map};
pub use metadata::{
    LvMeta, LvSegment, MAX_METADATA_TEXT_BYTES, PvMeta, VgMetadata, parse_vg_metadata,
};

use crate::volume::{DeviceId, DeviceIndex, LvmPvId, VolumeError};

/// The initial value LVM2 feeds to [`calc_crc`] (`INITIAL_CRC` in lvm2's `lib/misc/crc.h`).
pub const INITIAL_CRC: u32 = 0xf597_a6cf;

/// Table of the reflected CRC-32 polynomial 0xEDB88320, one entry per byte value.
const CRC_TABLE: [u32; 256] = {
    let mut table = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        let mut c = i as u32;
        let mut k = 0;
        while k < 8 {
            c = if c & 1 != 0 {
                (c >> 1) ^ 0xedb8_8320
            } else {
                c >> 1
            };
            k += 1;
        }
        table[i] = c;
        i += 1;
    }
    table
};

/// LVM2's checksum (`calc_crc` in lvm2's `lib/misc/crc.c`): the reflected CRC-32 of IEEE
/// 802.3, but started from `initial` (normally [`INITIAL_CRC`]) and without the final
/// inversion. Feeding the result back as `initial` continues the checksum over more bytes.
pub fn calc_crc(initial: u32, data: &[u8]) -> u32 {
    data.iter().fold(initial, |crc, &b| {
        (crc >> 8) ^ CRC_TABLE[((crc ^ u32::from(b)) & 0xff) as usize]
    })
}

/// Why LVM2 bytes, text or a layout could not be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LvmError {
    #[error("no LVM2 label (LABELONE) in the first {sectors} sectors")]
    NoLabel { sectors: usize },
    #[error("{what} truncated: needed {needed} bytes, have {have}")]
    Truncated {
        what: &'static str,
        needed: u64,
        have: u64,
    },
    #[error("{what} checksum mismatch: stored {stored:#010x}, computed {computed:#010x}")]
    BadChecksum {
        what: &'static str,
        stored: u32,
        computed: u32,
    },
    #[error("{what}: bad magic")]
    BadMagic { what: &'static str },
    #[error("{what}: unsupported version {found} (this build reads version {supported})")]
    UnsupportedVersion {
        what: &'static str,
        found: u64,
        supported: u64,
    },
    #[error("PV label type {found:?} is not \"LVM2 001\"")]
    UnsupportedLabelType { found: String },
    #[error("invalid {what}: {reason}")]
    Invalid { what: &'static str, reason: String },
    #[error("the metadata area holds no committed metadata")]
    NoMetadata,
    #[error(
        "the metadata area is marked ignored, so its text may be stale; read another PV's metadata area"
    )]
    MetadataIgnored,
    #[error("metadata text of {len} bytes exceeds the limit of {max} bytes")]
    TooLarge { len: u64, max: u64 },
    #[error("metadata syntax error at line {line}: {reason}")]
    Syntax { line: u32, reason: String },
    #[error("metadata sections nested deeper than {max} levels at line {line}")]
    TooDeep { line: u32, max: usize },
    #[error("metadata {path}: {reason}")]
    Metadata { path: String, reason: String },
    #[error("no logical volume named {0:?} in the volume group")]
    NoSuchLv(String),
    #[error(
        "logical volume {lv}, {segment}: segment type {segtype:?} is not supported (only striped and linear segments can be imported)"
    )]
    UnsupportedSegmentType {
        lv: String,
        segment: String,
        segtype: String,
    },
    #[error(
        "logical volume {lv}, {segment}: stripe {stripe} lies on logical volume {on_lv:?}, not on a PV (stacked LVs, e.g. a pvmove in progress, are not supported)"
    )]
    StackedLv {
        lv: String,
        segment: String,
        stripe: usize,
        on_lv: String,
    },
    #[error(
        "logical volume {lv} is used by {user_lv} ({segment} of type {segtype:?}); writing it directly would corrupt {user_lv}"
    )]
    UsedByOtherLv {
        lv: String,
        user_lv: String,
        segment: String,
        segtype: String,
    },
    #[error(
        "logical volume {lv} is not VISIBLE: it is an LVM-internal volume and cannot be imported"
    )]
    HiddenLv { lv: String },
    #[error("logical volume {lv}: {source}")]
    Volume {
        lv: String,
        #[source]
        source: VolumeError,
    },
    #[error(
        "volume group {vg} is exported (vgexport): it was handed over to another system; \
         run `vgimport {vg}` there first if sanfs is to use it"
    )]
    ExportedVg { vg: String },
    #[error(
        "logical volume {vg}/{lv} is read-only (no WRITE status): sanfs writes to it; make \
         it writable with `lvchange --permission rw {vg}/{lv}` first"
    )]
    ReadOnlyLv { vg: String, lv: String },
    #[error(
        "PV {pv} ({id}) of volume group {vg} is flagged MISSING (lvm2 could not find it when it \
         last wrote the metadata, so its contents may be stale){}",
        if *used {
            format!(": logical volume {lv} lies on it; restore it (`vgextend --restoremissing`) first")
        } else {
            format!("; logical volume {lv} does not use it")
        }
    )]
    MissingPv {
        vg: String,
        pv: String,
        id: LvmPvId,
        lv: String,
        used: bool,
    },
    #[error("volume device {index} is {device}, not an LVM2 PV")]
    NotLvmDevice {
        index: DeviceIndex,
        device: DeviceId,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc_matches_ieee_crc32_relation_and_known_values() {
        // With initial 0xffffffff and no final inversion this is the bitwise NOT of the
        // standard CRC-32, whose check value for "123456789" is 0xcbf43926.
        assert_eq!(calc_crc(0xffff_ffff, b"123456789"), !0xcbf4_3926);
        assert_eq!(calc_crc(INITIAL_CRC, b""), INITIAL_CRC);
        assert_eq!(calc_crc(0, b""), 0);
        // Chaining over two pieces equals one pass over the whole.
        let data = b"The quick brown fox jumps over the lazy dog";
        let (a, b) = data.split_at(17);
        assert_eq!(
            calc_crc(calc_crc(INITIAL_CRC, a), b),
            calc_crc(INITIAL_CRC, data)
        );
    }

    #[test]
    fn crc_matches_checksums_written_by_lvm2() {
        // Bytes captured from a PV written by lvm2 2.03.16 (see testdata/): the label sector's
        // crc_xl covers bytes 20..512 of its sector, the mda header's covers bytes 4..512, and
        // the metadata text's checksum in raw_locn[0] covers the whole text with its NUL.
        let sectors = include_bytes!("testdata/real_label_sectors.bin");
        let label = &sectors[512..1024];
        let stored = u32::from_le_bytes([label[16], label[17], label[18], label[19]]);
        assert_eq!(stored, 0x0e45_8c7d);
        assert_eq!(calc_crc(INITIAL_CRC, &label[20..]), stored);

        let mdah = include_bytes!("testdata/real_mda_header.bin");
        let stored = u32::from_le_bytes([mdah[0], mdah[1], mdah[2], mdah[3]]);
        assert_eq!(calc_crc(INITIAL_CRC, &mdah[4..]), stored);

        let text = include_bytes!("testdata/real_mda_text.bin");
        // raw_locn[0].checksum at offset 40 + 16 of the header.
        let stored = u32::from_le_bytes([mdah[56], mdah[57], mdah[58], mdah[59]]);
        assert_eq!(stored, 0xecf7_a657);
        assert_eq!(calc_crc(INITIAL_CRC, text), stored);
    }
}
