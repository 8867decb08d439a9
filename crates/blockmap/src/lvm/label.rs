//! The binary parts of an LVM2 PV: the `LABELONE` label with its `pv_header`, and the
//! metadata area header (`mda_header`) that says where the current metadata text lies.
//!
//! Layouts follow lvm2's `lib/label/label.h` and `lib/format_text/layout.h`; all integers are
//! little-endian. The label sits in one of the first four 512-byte sectors:
//!
//! ```text
//! label_header (32 bytes)   id "LABELONE" | sector_xl u64 | crc_xl u32 | offset_xl u32 | type "LVM2 001"
//! pv_header at offset_xl    pv_uuid [32] | device_size_xl u64 |
//!                           data areas {offset u64, size u64}... {0,0} |
//!                           metadata areas {offset u64, size u64}... {0,0} |
//!                           pv_header_extension: version u32 | flags u32 | bootloader areas... {0,0}
//! ```
//!
//! `crc_xl` covers the label sector from `offset_xl` (byte 20) to its end. A metadata area
//! starts with a 512-byte header:
//!
//! ```text
//! checksum_xl u32 | magic " LVM2 x[5A%r0N*>" | version u32 (1) | start u64 | size u64 |
//! raw_locn {offset u64, size u64, checksum u32, flags u32}... {0,...}
//! ```
//!
//! `checksum_xl` covers bytes 4..512. `raw_locn[0]` locates the committed metadata text,
//! relative to `start`, in the ring buffer that follows the header; its `checksum` covers the
//! whole text (which lvm2 ends with a NUL byte).

use super::{INITIAL_CRC, LvmError, calc_crc, metadata::MAX_METADATA_TEXT_BYTES};
use crate::codec::Reader;
use crate::volume::LvmPvId;

/// Size of a sector in LVM2's on-disk layout.
pub const SECTOR_SIZE: usize = 512;
/// LVM2 looks for its label in this many sectors from the start of a device.
pub const LABEL_SCAN_SECTORS: usize = 4;
/// Bytes to read from the start of a device for [`parse_pv_label`].
pub const LABEL_SCAN_BYTES: usize = SECTOR_SIZE * LABEL_SCAN_SECTORS;
/// Size of the header at the start of a metadata area.
pub const MDA_HEADER_SIZE: usize = 512;
/// `raw_locn.flags` bit: this metadata area is ignored (`pvchange --metadataignore`).
pub const RAW_LOCN_IGNORED: u32 = 0x1;
/// `pv_header_extension.flags` bit: the PV belongs to a VG.
pub const PV_EXT_USED: u32 = 0x1;

const LABEL_ID: &[u8; 8] = b"LABELONE";
const LABEL_TYPE: &[u8; 8] = b"LVM2 001";
const LABEL_HEADER_SIZE: usize = 32;
/// Offset of `offset_xl` in the label header: the label CRC covers from here on.
const LABEL_CRC_FROM: usize = 20;
const FMTT_MAGIC: &[u8; 16] = b" LVM2 x[5A%r0N*>";
const FMTT_VERSION: u32 = 1;

/// A `disk_locn`: a byte range on the device. A data area's `size` of 0 means "to the end of
/// the device".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DiskArea {
    pub offset: u64,
    pub size: u64,
}

/// The `pv_header_extension` that lvm2 2.02.110 and later write after the area lists.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PvHeaderExtension {
    pub version: u32,
    /// [`PV_EXT_USED`] and future bits.
    pub flags: u32,
    pub bootloader_areas: Vec<DiskArea>,
}

/// A parsed LVM2 PV label.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PvLabel {
    /// The sector (0 to 3) that holds the label.
    pub sector: u64,
    pub pv_id: LvmPvId,
    /// The device size lvm2 recorded when it wrote the label, in bytes.
    pub device_size_bytes: u64,
    /// Where the physical extents live (normally one area from `pe_start`).
    pub data_areas: Vec<DiskArea>,
    /// The metadata areas (zero, one or two: at the start and at the end of the device).
    pub metadata_areas: Vec<DiskArea>,
    /// Absent on PVs written by old lvm2 versions.
    pub extension: Option<PvHeaderExtension>,
}

fn truncated(what: &'static str, needed: usize, have: usize) -> LvmError {
    LvmError::Truncated {
        what,
        needed: needed as u64,
        have: have as u64,
    }
}

/// Reads with `r`, turning a short read into [`LvmError::Truncated`] about `what`.
fn read<'a, T>(
    what: &'static str,
    r: &mut Reader<'a>,
    f: impl FnOnce(&mut Reader<'a>) -> Result<T, crate::codec::DecodeError>,
) -> Result<T, LvmError> {
    let at = r.position();
    f(r).map_err(|e| match e {
        crate::codec::DecodeError::Truncated { needed, .. } => {
            truncated(what, at + needed, at + r.remaining())
        }
        other => LvmError::Invalid {
            what,
            reason: other.to_string(),
        },
    })
}

fn array<const N: usize>(what: &'static str, r: &mut Reader<'_>) -> Result<[u8; N], LvmError> {
    let bytes = read(what, r, |r| r.take(N))?;
    let mut a = [0u8; N];
    a.copy_from_slice(bytes);
    Ok(a)
}

/// Reads a list of `disk_locn` ended by an entry whose offset is 0 (as lvm2 does).
fn disk_areas(what: &'static str, r: &mut Reader<'_>) -> Result<Vec<DiskArea>, LvmError> {
    let mut areas = Vec::new();
    loop {
        let offset = read(what, r, Reader::u64)?;
        let size = read(what, r, Reader::u64)?;
        if offset == 0 {
            return Ok(areas);
        }
        areas.push(DiskArea { offset, size });
    }
}

/// Finds and parses the LVM2 label in `first_sectors`, the first [`LABEL_SCAN_BYTES`] (or
/// more) bytes of a device. As lvm2 does, a sector whose label is damaged is skipped in favour
/// of a later valid one; if none is valid, the first damage found is reported.
pub fn parse_pv_label(first_sectors: &[u8]) -> Result<PvLabel, LvmError> {
    if first_sectors.len() < LABEL_SCAN_BYTES {
        return Err(truncated(
            "PV label scan area",
            LABEL_SCAN_BYTES,
            first_sectors.len(),
        ));
    }
    let mut first_error = None;
    for (sector, bytes) in first_sectors
        .chunks_exact(SECTOR_SIZE)
        .take(LABEL_SCAN_SECTORS)
        .enumerate()
    {
        if !bytes.starts_with(LABEL_ID) {
            continue;
        }
        match parse_label_sector(bytes, sector as u64) {
            Ok(label) => return Ok(label),
            Err(e) => {
                first_error.get_or_insert(e);
            }
        }
    }
    Err(first_error.unwrap_or(LvmError::NoLabel {
        sectors: LABEL_SCAN_SECTORS,
    }))
}

/// Parses one 512-byte sector that starts with `LABELONE`.
fn parse_label_sector(bytes: &[u8], sector: u64) -> Result<PvLabel, LvmError> {
    const WHAT: &str = "PV label";
    let mut r = Reader::new(bytes);
    let _id: [u8; 8] = array(WHAT, &mut r)?;
    let sector_xl = read(WHAT, &mut r, Reader::u64)?;
    let crc_xl = read(WHAT, &mut r, Reader::u32)?;
    let offset_xl = read(WHAT, &mut r, Reader::u32)?;
    let label_type: [u8; 8] = array(WHAT, &mut r)?;
    if sector_xl != sector {
        return Err(LvmError::Invalid {
            what: WHAT,
            reason: format!("label found in sector {sector} says it belongs in sector {sector_xl}"),
        });
    }
    let covered = bytes.get(LABEL_CRC_FROM..).unwrap_or_default();
    let computed = calc_crc(INITIAL_CRC, covered);
    if computed != crc_xl {
        return Err(LvmError::BadChecksum {
            what: WHAT,
            stored: crc_xl,
            computed,
        });
    }
    if &label_type != LABEL_TYPE {
        return Err(LvmError::UnsupportedLabelType {
            found: String::from_utf8_lossy(&label_type).into_owned(),
        });
    }
    let pv_header = usize::try_from(offset_xl)
        .ok()
        .filter(|o| (LABEL_HEADER_SIZE..SECTOR_SIZE).contains(o))
        .and_then(|o| bytes.get(o..))
        .ok_or_else(|| LvmError::Invalid {
            what: WHAT,
            reason: format!("pv_header offset {offset_xl} lies outside the label sector"),
        })?;

    const PVH: &str = "pv_header";
    let mut r = Reader::new(pv_header);
    let uuid: [u8; 32] = array(PVH, &mut r)?;
    let pv_id = std::str::from_utf8(&uuid)
        .ok()
        .and_then(LvmPvId::parse)
        .ok_or_else(|| LvmError::Invalid {
            what: PVH,
            reason: format!(
                "PV UUID {:?} is not 32 characters from [0-9A-Za-z]",
                String::from_utf8_lossy(&uuid)
            ),
        })?;
    let device_size_bytes = read(PVH, &mut r, Reader::u64)?;
    let data_areas = disk_areas("pv_header data area list", &mut r)?;
    let metadata_areas = disk_areas("pv_header metadata area list", &mut r)?;
    // The extension follows the lists; old lvm2 left zeros there (version 0 = none).
    let extension = if r.remaining() < 8 {
        None
    } else {
        const EXT: &str = "pv_header_extension";
        let version = read(EXT, &mut r, Reader::u32)?;
        let flags = read(EXT, &mut r, Reader::u32)?;
        if version == 0 {
            None
        } else {
            Some(PvHeaderExtension {
                version,
                flags,
                bootloader_areas: disk_areas("pv_header_extension bootloader area list", &mut r)?,
            })
        }
    };
    Ok(PvLabel {
        sector,
        pv_id,
        device_size_bytes,
        data_areas,
        metadata_areas,
        extension,
    })
}

/// One `raw_locn` of a metadata area header: where a copy of the metadata text lies, relative
/// to the start of the metadata area.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RawLocn {
    pub offset: u64,
    pub size: u64,
    pub checksum: u32,
    /// [`RAW_LOCN_IGNORED`].
    pub flags: u32,
}

/// A checked metadata area header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MdaHeader {
    /// Absolute byte offset of the metadata area (and of this header) on the device.
    pub start: u64,
    /// Size of the whole metadata area in bytes, header included.
    pub size: u64,
    /// Slot 0 is the committed metadata, slot 1 (if present) the precommitted one.
    pub raw_locns: Vec<RawLocn>,
}

/// A byte range on a device to read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ByteExtent {
    pub offset: u64,
    pub len: u64,
}

/// Where the committed metadata text lies on the device: one extent, or two when the text
/// wraps from the end of the ring buffer back to just after the header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetadataLocation {
    /// The extents to read, in order; their concatenation is the text.
    pub pieces: Vec<ByteExtent>,
    /// Total length of the text in bytes.
    pub size: u64,
    /// lvm2's checksum of the whole text.
    pub checksum: u32,
}

/// Parses and checks the metadata area header in `bytes` (at least [`MDA_HEADER_SIZE`] bytes
/// read at `area.offset`), where `area` is one of [`PvLabel::metadata_areas`].
pub fn parse_mda_header(bytes: &[u8], area: DiskArea) -> Result<MdaHeader, LvmError> {
    const WHAT: &str = "metadata area header";
    let bytes = bytes
        .get(..MDA_HEADER_SIZE)
        .ok_or_else(|| truncated(WHAT, MDA_HEADER_SIZE, bytes.len()))?;
    let mut r = Reader::new(bytes);
    let stored = read(WHAT, &mut r, Reader::u32)?;
    let computed = calc_crc(INITIAL_CRC, bytes.get(4..).unwrap_or_default());
    if stored != computed {
        return Err(LvmError::BadChecksum {
            what: WHAT,
            stored,
            computed,
        });
    }
    let magic: [u8; 16] = array(WHAT, &mut r)?;
    if &magic != FMTT_MAGIC {
        return Err(LvmError::BadMagic { what: WHAT });
    }
    let version = read(WHAT, &mut r, Reader::u32)?;
    if version != FMTT_VERSION {
        return Err(LvmError::UnsupportedVersion {
            what: WHAT,
            found: u64::from(version),
            supported: u64::from(FMTT_VERSION),
        });
    }
    let start = read(WHAT, &mut r, Reader::u64)?;
    let size = read(WHAT, &mut r, Reader::u64)?;
    if start != area.offset {
        return Err(LvmError::Invalid {
            what: WHAT,
            reason: format!(
                "header says the area starts at byte {start}, the PV label says {}",
                area.offset
            ),
        });
    }
    if size <= MDA_HEADER_SIZE as u64 || size > area.size {
        return Err(LvmError::Invalid {
            what: WHAT,
            reason: format!(
                "area size {size} is not between {} and the label's {}",
                MDA_HEADER_SIZE + 1,
                area.size
            ),
        });
    }
    let mut raw_locns = Vec::new();
    // The list ends at an entry with offset 0 or at the end of the header sector.
    while r.remaining() >= 24 {
        let offset = read(WHAT, &mut r, Reader::u64)?;
        let len = read(WHAT, &mut r, Reader::u64)?;
        let checksum = read(WHAT, &mut r, Reader::u32)?;
        let flags = read(WHAT, &mut r, Reader::u32)?;
        if offset == 0 {
            // An ignored area keeps its flag in an otherwise empty slot 0.
            if raw_locns.is_empty() && flags & RAW_LOCN_IGNORED != 0 {
                raw_locns.push(RawLocn {
                    offset,
                    size: len,
                    checksum,
                    flags,
                });
            }
            break;
        }
        raw_locns.push(RawLocn {
            offset,
            size: len,
            checksum,
            flags,
        });
    }
    Ok(MdaHeader {
        start,
        size,
        raw_locns,
    })
}

impl MdaHeader {
    /// Where the committed metadata text (slot 0) lies, as absolute device byte extents.
    pub fn metadata_location(&self) -> Result<MetadataLocation, LvmError> {
        const WHAT: &str = "metadata location (raw_locn 0)";
        let Some(slot) = self.raw_locns.first() else {
            return Err(LvmError::NoMetadata);
        };
        if slot.flags & RAW_LOCN_IGNORED != 0 {
            return Err(LvmError::MetadataIgnored);
        }
        if slot.offset == 0 && slot.size == 0 {
            return Err(LvmError::NoMetadata);
        }
        let header = MDA_HEADER_SIZE as u64;
        let ring = self.size - header;
        if slot.offset < header || slot.offset >= self.size {
            return Err(LvmError::Invalid {
                what: WHAT,
                reason: format!(
                    "text offset {} lies outside the ring buffer [{header}, {})",
                    slot.offset, self.size
                ),
            });
        }
        if slot.size == 0 || slot.size > ring {
            return Err(LvmError::Invalid {
                what: WHAT,
                reason: format!(
                    "text size {} is not between 1 and the ring buffer's {ring} bytes",
                    slot.size
                ),
            });
        }
        if slot.size > MAX_METADATA_TEXT_BYTES as u64 {
            return Err(LvmError::TooLarge {
                len: slot.size,
                max: MAX_METADATA_TEXT_BYTES as u64,
            });
        }
        // offset < size and slot.size <= ring, so neither sum can overflow past
        // self.size + ring; self.start + self.size is checked below.
        let first_len = slot.size.min(self.size - slot.offset);
        let wrap = slot.size - first_len;
        let absolute = |rel: u64| {
            self.start.checked_add(rel).ok_or(LvmError::Invalid {
                what: WHAT,
                reason: "metadata area runs past 2^64 bytes".into(),
            })
        };
        let mut pieces = vec![ByteExtent {
            offset: absolute(slot.offset)?,
            len: first_len,
        }];
        if wrap > 0 {
            pieces.push(ByteExtent {
                offset: absolute(header)?,
                len: wrap,
            });
        }
        absolute(self.size)?;
        Ok(MetadataLocation {
            pieces,
            size: slot.size,
            checksum: slot.checksum,
        })
    }
}

impl MetadataLocation {
    /// Checks `text`, the concatenation of [`MetadataLocation::pieces`] as read from the
    /// device, against its length and lvm2 checksum.
    pub fn verify_text(&self, text: &[u8]) -> Result<(), LvmError> {
        const WHAT: &str = "metadata text";
        if text.len() as u64 != self.size {
            return Err(LvmError::Invalid {
                what: WHAT,
                reason: format!("{} bytes given, the header says {}", text.len(), self.size),
            });
        }
        let computed = calc_crc(INITIAL_CRC, text);
        if computed != self.checksum {
            return Err(LvmError::BadChecksum {
                what: WHAT,
                stored: self.checksum,
                computed,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Builds LVM2 on-disk structures for tests, the way lvm2 writes them.
    pub(crate) struct LabelImage {
        pub sector: usize,
        pub uuid: [u8; 32],
        pub device_size: u64,
        pub data_areas: Vec<(u64, u64)>,
        pub metadata_areas: Vec<(u64, u64)>,
        pub extension: Option<(u32, u32)>,
    }

    impl LabelImage {
        pub(crate) fn typical() -> LabelImage {
            LabelImage {
                sector: 1,
                uuid: *b"fTl1wa5zrCD1B4lEu7NF08PZ9GBZIGkM",
                device_size: 64 << 20,
                data_areas: vec![(1 << 20, 0)],
                metadata_areas: vec![(4096, 1_044_480)],
                extension: Some((2, PV_EXT_USED)),
            }
        }

        /// The four label sectors, checksummed.
        pub(crate) fn build(&self) -> Vec<u8> {
            let mut sector = vec![0u8; SECTOR_SIZE];
            let mut w = crate::codec::Writer::new();
            w.raw(LABEL_ID)
                .u64(self.sector as u64)
                .u32(0)
                .u32(32)
                .raw(LABEL_TYPE)
                .raw(&self.uuid)
                .u64(self.device_size);
            for &(o, s) in &self.data_areas {
                w.u64(o).u64(s);
            }
            w.u64(0).u64(0);
            for &(o, s) in &self.metadata_areas {
                w.u64(o).u64(s);
            }
            w.u64(0).u64(0);
            if let Some((version, flags)) = self.extension {
                w.u32(version).u32(flags).u64(0).u64(0);
            }
            let body = w.into_vec();
            sector[..body.len()].copy_from_slice(&body);
            let crc = calc_crc(INITIAL_CRC, &sector[20..]);
            sector[16..20].copy_from_slice(&crc.to_le_bytes());
            let mut image = vec![0u8; LABEL_SCAN_BYTES];
            image[self.sector * SECTOR_SIZE..][..SECTOR_SIZE].copy_from_slice(&sector);
            image
        }
    }

    /// A 512-byte mda header with the given raw_locns, checksummed.
    pub(crate) fn mda_header(start: u64, size: u64, locns: &[RawLocn]) -> Vec<u8> {
        let mut w = crate::codec::Writer::new();
        w.u32(0)
            .raw(FMTT_MAGIC)
            .u32(FMTT_VERSION)
            .u64(start)
            .u64(size);
        for l in locns {
            w.u64(l.offset).u64(l.size).u32(l.checksum).u32(l.flags);
        }
        let mut bytes = w.into_vec();
        bytes.resize(MDA_HEADER_SIZE, 0);
        rechecksum_mda(&mut bytes);
        bytes
    }

    fn rechecksum_mda(bytes: &mut [u8]) {
        let crc = calc_crc(INITIAL_CRC, &bytes[4..MDA_HEADER_SIZE]);
        bytes[..4].copy_from_slice(&crc.to_le_bytes());
    }

    fn rechecksum_label(image: &mut [u8], sector: usize) {
        let s = &mut image[sector * SECTOR_SIZE..][..SECTOR_SIZE];
        let crc = calc_crc(INITIAL_CRC, &s[20..]);
        s[16..20].copy_from_slice(&crc.to_le_bytes());
    }

    #[test]
    fn parses_a_label_written_by_lvm2() {
        let bytes = include_bytes!("testdata/real_label_sectors.bin");
        let label = parse_pv_label(bytes).unwrap();
        assert_eq!(label.sector, 1);
        assert_eq!(
            label.pv_id.to_string(),
            "fTl1wa-5zrC-D1B4-lEu7-NF08-PZ9G-BZIGkM"
        );
        assert_eq!(label.device_size_bytes, 64 << 20);
        assert_eq!(
            label.data_areas,
            vec![DiskArea {
                offset: 1 << 20,
                size: 0
            }]
        );
        assert_eq!(
            label.metadata_areas,
            vec![DiskArea {
                offset: 4096,
                size: 1_044_480
            }]
        );
        assert_eq!(
            label.extension,
            Some(PvHeaderExtension {
                version: 2,
                flags: PV_EXT_USED,
                bootloader_areas: vec![]
            })
        );
    }

    #[test]
    fn parses_an_mda_header_written_by_lvm2() {
        let bytes = include_bytes!("testdata/real_mda_header.bin");
        let area = DiskArea {
            offset: 4096,
            size: 1_044_480,
        };
        let h = parse_mda_header(bytes, area).unwrap();
        assert_eq!((h.start, h.size), (4096, 1_044_480));
        assert_eq!(h.raw_locns.len(), 1);
        let loc = h.metadata_location().unwrap();
        assert_eq!(
            loc.pieces,
            vec![ByteExtent {
                offset: 4096 + 0xc00,
                len: 0x5a7
            }]
        );
        let text = include_bytes!("testdata/real_mda_text.bin");
        loc.verify_text(text).unwrap();
        let mut bad = text.to_vec();
        bad[100] ^= 1;
        assert!(matches!(
            loc.verify_text(&bad),
            Err(LvmError::BadChecksum { .. })
        ));
        assert!(matches!(
            loc.verify_text(&text[1..]),
            Err(LvmError::Invalid { .. })
        ));
    }

    #[test]
    fn label_round_trips_in_every_scan_sector() {
        for sector in 0..LABEL_SCAN_SECTORS {
            let img = LabelImage {
                sector,
                data_areas: vec![(1 << 20, 0), (9 << 20, 4096)],
                metadata_areas: vec![(4096, 1 << 20), ((63 << 20) + 4096, 1 << 20)],
                extension: None,
                ..LabelImage::typical()
            };
            let label = parse_pv_label(&img.build()).unwrap();
            assert_eq!(label.sector, sector as u64);
            assert_eq!(label.data_areas.len(), 2);
            assert_eq!(label.data_areas[1].size, 4096);
            assert_eq!(label.metadata_areas.len(), 2);
            assert_eq!(label.extension, None);
        }
    }

    #[test]
    fn damaged_labels_are_refused_with_the_reason() {
        let good = LabelImage::typical().build();
        assert_eq!(
            parse_pv_label(&[0u8; LABEL_SCAN_BYTES]),
            Err(LvmError::NoLabel { sectors: 4 })
        );
        assert!(matches!(
            parse_pv_label(&good[..LABEL_SCAN_BYTES - 1]),
            Err(LvmError::Truncated { .. })
        ));
        // Every single-bit flip from the CRC-covered bytes on is caught.
        for byte in 512 + 16..1024 {
            let mut bad = good.clone();
            bad[byte] ^= 0x10;
            assert!(
                matches!(parse_pv_label(&bad), Err(LvmError::BadChecksum { .. })),
                "flip at {byte} went unnoticed"
            );
        }
        // A label that claims another sector.
        let mut bad = good.clone();
        bad[512 + 8] = 2;
        rechecksum_label(&mut bad, 1);
        assert!(matches!(
            parse_pv_label(&bad),
            Err(LvmError::Invalid { .. })
        ));
        // Another label type.
        let mut bad = good.clone();
        bad[512 + 24..512 + 32].copy_from_slice(b"LVM1 001");
        rechecksum_label(&mut bad, 1);
        assert!(matches!(
            parse_pv_label(&bad),
            Err(LvmError::UnsupportedLabelType { .. })
        ));
        // pv_header offset pointing outside the sector, or into the label header.
        for offset in [0u32, 31, 512, u32::MAX] {
            let mut bad = good.clone();
            bad[512 + 20..512 + 24].copy_from_slice(&offset.to_le_bytes());
            rechecksum_label(&mut bad, 1);
            assert!(
                matches!(parse_pv_label(&bad), Err(LvmError::Invalid { .. })),
                "offset {offset}"
            );
        }
        // A UUID with a character outside [0-9A-Za-z].
        let mut bad = good.clone();
        bad[512 + 32] = b'-';
        rechecksum_label(&mut bad, 1);
        assert!(matches!(
            parse_pv_label(&bad),
            Err(LvmError::Invalid { .. })
        ));
    }

    #[test]
    fn area_lists_without_terminator_are_truncated_not_read_past_the_sector() {
        let img = LabelImage {
            data_areas: (1..40).map(|i| (i << 20, 4096)).collect(),
            ..LabelImage::typical()
        };
        // Build by hand: the lists overflow the sector, so write just the sector's worth.
        let mut sector = vec![0u8; SECTOR_SIZE];
        let mut w = crate::codec::Writer::new();
        w.raw(LABEL_ID)
            .u64(0)
            .u32(0)
            .u32(32)
            .raw(LABEL_TYPE)
            .raw(&img.uuid)
            .u64(img.device_size);
        for &(o, s) in &img.data_areas {
            w.u64(o).u64(s);
        }
        let body = w.into_vec();
        sector.copy_from_slice(&body[..SECTOR_SIZE]);
        let crc = calc_crc(INITIAL_CRC, &sector[20..]);
        sector[16..20].copy_from_slice(&crc.to_le_bytes());
        let mut image = vec![0u8; LABEL_SCAN_BYTES];
        image[..SECTOR_SIZE].copy_from_slice(&sector);
        assert!(matches!(
            parse_pv_label(&image),
            Err(LvmError::Truncated { .. })
        ));
    }

    #[test]
    fn a_damaged_label_is_skipped_for_a_later_valid_one() {
        let mut image = LabelImage {
            sector: 3,
            ..LabelImage::typical()
        }
        .build();
        let earlier = LabelImage {
            sector: 0,
            ..LabelImage::typical()
        }
        .build();
        image[..SECTOR_SIZE].copy_from_slice(&earlier[..SECTOR_SIZE]);
        image[100] ^= 1; // damage sector 0's label
        assert_eq!(parse_pv_label(&image).unwrap().sector, 3);
    }

    const AREA: DiskArea = DiskArea {
        offset: 4096,
        size: 8192,
    };

    fn locn(offset: u64, size: u64) -> RawLocn {
        RawLocn {
            offset,
            size,
            checksum: 0,
            flags: 0,
        }
    }

    #[test]
    fn metadata_location_in_one_piece_and_wrapped() {
        let h = parse_mda_header(&mda_header(4096, 8192, &[locn(1024, 2000)]), AREA).unwrap();
        let loc = h.metadata_location().unwrap();
        assert_eq!(
            loc.pieces,
            vec![ByteExtent {
                offset: 5120,
                len: 2000
            }]
        );
        // Ends exactly at the end of the area: still one piece.
        let h = parse_mda_header(&mda_header(4096, 8192, &[locn(7168, 1024)]), AREA).unwrap();
        assert_eq!(h.metadata_location().unwrap().pieces.len(), 1);
        // Wraps: 1024 bytes at the end, 976 after the header.
        let h = parse_mda_header(&mda_header(4096, 8192, &[locn(7168, 2000)]), AREA).unwrap();
        let loc = h.metadata_location().unwrap();
        assert_eq!(
            loc.pieces,
            vec![
                ByteExtent {
                    offset: 4096 + 7168,
                    len: 1024
                },
                ByteExtent {
                    offset: 4096 + 512,
                    len: 976
                }
            ]
        );
        // The checksum of wrapped text covers the concatenation.
        let text: Vec<u8> = (0..2000u32).map(|i| (i % 251) as u8).collect();
        let mut with_crc = locn(7168, 2000);
        with_crc.checksum = calc_crc(calc_crc(INITIAL_CRC, &text[..1024]), &text[1024..]);
        let h = parse_mda_header(&mda_header(4096, 8192, &[with_crc]), AREA).unwrap();
        h.metadata_location().unwrap().verify_text(&text).unwrap();
    }

    #[test]
    fn empty_ignored_and_bad_locations_are_refused() {
        let h = parse_mda_header(&mda_header(4096, 8192, &[]), AREA).unwrap();
        assert_eq!(h.metadata_location(), Err(LvmError::NoMetadata));
        let mut ignored = locn(1024, 100);
        ignored.flags = RAW_LOCN_IGNORED;
        let h = parse_mda_header(&mda_header(4096, 8192, &[ignored]), AREA).unwrap();
        assert_eq!(h.metadata_location(), Err(LvmError::MetadataIgnored));
        let mut ignored_empty = locn(0, 0);
        ignored_empty.flags = RAW_LOCN_IGNORED;
        let h = parse_mda_header(&mda_header(4096, 8192, &[ignored_empty]), AREA).unwrap();
        assert_eq!(h.metadata_location(), Err(LvmError::MetadataIgnored));
        for (offset, size) in [(100, 10), (8192, 10), (1024, 0), (1024, 8192 - 511)] {
            let h = parse_mda_header(&mda_header(4096, 8192, &[locn(offset, size)]), AREA).unwrap();
            assert!(
                matches!(h.metadata_location(), Err(LvmError::Invalid { .. })),
                "{offset}+{size}"
            );
        }
    }

    #[test]
    fn damaged_mda_headers_are_refused() {
        let good = mda_header(4096, 8192, &[locn(1024, 100)]);
        assert!(matches!(
            parse_mda_header(&good[..511], AREA),
            Err(LvmError::Truncated { .. })
        ));
        for byte in 0..MDA_HEADER_SIZE {
            let mut bad = good.clone();
            bad[byte] ^= 0x01;
            assert!(
                matches!(
                    parse_mda_header(&bad, AREA),
                    Err(LvmError::BadChecksum { .. })
                ),
                "flip at {byte} went unnoticed"
            );
        }
        let mut bad = good.clone();
        bad[5] = b'X';
        rechecksum_mda(&mut bad);
        assert_eq!(
            parse_mda_header(&bad, AREA),
            Err(LvmError::BadMagic {
                what: "metadata area header"
            })
        );
        let mut bad = good.clone();
        bad[20] = 2;
        rechecksum_mda(&mut bad);
        assert!(matches!(
            parse_mda_header(&bad, AREA),
            Err(LvmError::UnsupportedVersion { found: 2, .. })
        ));
        // Start that disagrees with the label, size bigger than the label's area, tiny size.
        for (start, size) in [(0, 8192), (4096, 8193), (4096, 512)] {
            assert!(
                matches!(
                    parse_mda_header(&mda_header(start, size, &[]), AREA),
                    Err(LvmError::Invalid { .. })
                ),
                "{start} {size}"
            );
        }
        // A metadata area near 2^64 cannot produce offsets that overflow.
        let far = DiskArea {
            offset: u64::MAX - 4096,
            size: 8192,
        };
        let h = parse_mda_header(&mda_header(far.offset, 8192, &[locn(1024, 100)]), far).unwrap();
        assert!(matches!(
            h.metadata_location(),
            Err(LvmError::Invalid { .. })
        ));
    }
}
