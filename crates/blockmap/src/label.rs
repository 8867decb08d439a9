//! The sanfs device label, and recognising what else a device may already hold.
//!
//! `sanfs-mds format` writes a [`DeviceLabel`] into the first [`LABEL_SIZE`] bytes of every
//! data LUN it formats; agents find their LUNs by reading it (the device UUID, never the path).
//! File data starts at `data_offset` (1 MiB by default), so the label never shares a block with
//! data. LUNs taken from an LVM2 logical volume carry no sanfs label: LVM's own PV label names
//! them.
//!
//! [`probe`] recognises existing signatures (sanfs, LVM2, XFS, ext2/3/4, btrfs, swap, a
//! partition table, ISO 9660) in bytes the caller read from the start of a device, so that
//! `format` can refuse to overwrite them. Layout in docs/on-disk-format.md.

use uuid::Uuid;

use crate::codec::{self, DecodeError, Reader, Writer};

/// Bytes reserved for the label at the start of a device.
pub const LABEL_SIZE: usize = 4096;

/// Default start of file data on a labelled device.
pub const DEFAULT_DATA_OFFSET: u64 = 1 << 20;

/// How many bytes from the start of a device [`probe`] wants to see.
pub const PROBE_SIZE: usize = 68 * 1024;

const LABEL_MAGIC: [u8; 4] = *b"SNFS";
const LABEL_VERSION: u16 = 1;

/// The layout a label records, so that a device can be inspected on its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LabelLayout {
    Linear,
    Striped { stripe_unit: u64 },
}

/// What `format` writes at the start of each data LUN.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceLabel {
    /// The file system this LUN belongs to.
    pub fs_uuid: Uuid,
    /// This LUN's identity.
    pub device_uuid: Uuid,
    /// Position of this LUN in the volume.
    pub device_index: u32,
    /// Number of LUNs in the volume.
    pub device_count: u32,
    /// Device size in bytes when it was formatted.
    pub device_size: u64,
    /// Where file data starts on this device.
    pub data_offset: u64,
    /// The file system's block size.
    pub block_size: u32,
    pub layout: LabelLayout,
    /// Seconds since the Unix epoch when the file system was formatted (the caller's clock).
    pub formatted_at: i64,
}

impl DeviceLabel {
    /// The label as the [`LABEL_SIZE`] bytes to write at offset 0 (zero padded).
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::with_capacity(128);
        w.raw(self.fs_uuid.as_bytes())
            .raw(self.device_uuid.as_bytes())
            .u32(self.device_index)
            .u32(self.device_count)
            .u64(self.device_size)
            .u64(self.data_offset)
            .u32(self.block_size);
        match self.layout {
            LabelLayout::Linear => w.u8(0).u64(0),
            LabelLayout::Striped { stripe_unit } => w.u8(1).u64(stripe_unit),
        };
        w.i64(self.formatted_at);
        let mut out = codec::seal(LABEL_MAGIC, LABEL_VERSION, &w.into_vec());
        out.resize(LABEL_SIZE, 0);
        out
    }

    /// Reads a label from the first bytes of a device. Anything after the sealed record is
    /// padding and ignored.
    pub fn decode(bytes: &[u8]) -> Result<DeviceLabel, DecodeError> {
        // The envelope's length field sits after magic (4), version (2) and flags (2).
        let mut head = Reader::new(bytes);
        head.take(8)?;
        let payload_len = head.u32()? as usize;
        let total = 12usize.saturating_add(payload_len).saturating_add(4);
        if total > LABEL_SIZE {
            return Err(DecodeError::Invalid(format!(
                "label record of {total} bytes"
            )));
        }
        let sealed = bytes.get(..total).ok_or_else(|| DecodeError::Truncated {
            at: bytes.len(),
            needed: total.saturating_sub(bytes.len()),
        })?;
        let (_version, payload) = codec::open(LABEL_MAGIC, LABEL_VERSION, sealed)?;
        let mut r = Reader::new(payload);
        let uuid = |r: &mut Reader<'_>| -> Result<Uuid, DecodeError> {
            let b = r.take(16)?;
            Uuid::from_slice(b).map_err(|e| DecodeError::Invalid(e.to_string()))
        };
        let fs_uuid = uuid(&mut r)?;
        let device_uuid = uuid(&mut r)?;
        let device_index = r.u32()?;
        let device_count = r.u32()?;
        let device_size = r.u64()?;
        let data_offset = r.u64()?;
        let block_size = r.u32()?;
        let layout = match (r.u8()?, r.u64()?) {
            (0, _) => LabelLayout::Linear,
            (1, stripe_unit) if stripe_unit > 0 => LabelLayout::Striped { stripe_unit },
            (kind, _) => return Err(DecodeError::Invalid(format!("layout kind {kind}"))),
        };
        let formatted_at = r.i64()?;
        r.finish()?;
        if device_index >= device_count {
            return Err(DecodeError::Invalid(format!(
                "device index {device_index} of {device_count} devices"
            )));
        }
        if data_offset < LABEL_SIZE as u64 || data_offset > device_size {
            return Err(DecodeError::Invalid(format!(
                "data offset {data_offset} outside the device of {device_size} bytes"
            )));
        }
        Ok(DeviceLabel {
            fs_uuid,
            device_uuid,
            device_index,
            device_count,
            device_size,
            data_offset,
            block_size,
            layout,
            formatted_at,
        })
    }
}

/// A signature found at the start of a device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Signature {
    /// A valid sanfs label.
    Sanfs(DeviceLabel),
    /// The sanfs magic with a record that does not decode (damaged or from a newer version).
    DamagedSanfs(String),
    /// An LVM2 physical volume label (`LABELONE` in one of the first four sectors).
    LvmPv,
    Xfs,
    Ext,
    Btrfs,
    Swap,
    /// An MBR or GPT partition table.
    PartitionTable,
    Iso9660,
}

impl std::fmt::Display for Signature {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Signature::Sanfs(l) => write!(
                f,
                "sanfs label (fs {}, device {} = {} of {})",
                l.fs_uuid, l.device_uuid, l.device_index, l.device_count
            ),
            Signature::DamagedSanfs(why) => write!(f, "damaged sanfs label ({why})"),
            Signature::LvmPv => f.write_str("LVM2 physical volume"),
            Signature::Xfs => f.write_str("XFS file system"),
            Signature::Ext => f.write_str("ext2/3/4 file system"),
            Signature::Btrfs => f.write_str("btrfs file system"),
            Signature::Swap => f.write_str("swap space"),
            Signature::PartitionTable => f.write_str("partition table"),
            Signature::Iso9660 => f.write_str("ISO 9660 image"),
        }
    }
}

fn has(bytes: &[u8], at: usize, magic: &[u8]) -> bool {
    bytes.get(at..at + magic.len()) == Some(magic)
}

/// Every signature recognised in `bytes`, the first bytes of a device (ideally
/// [`PROBE_SIZE`] of them; fewer only finds fewer).
pub fn probe(bytes: &[u8]) -> Vec<Signature> {
    let mut found = Vec::new();
    if has(bytes, 0, &LABEL_MAGIC) {
        found.push(match DeviceLabel::decode(bytes) {
            Ok(label) => Signature::Sanfs(label),
            Err(e) => Signature::DamagedSanfs(e.to_string()),
        });
    }
    if (0..4).any(|s| has(bytes, s * 512, b"LABELONE")) {
        found.push(Signature::LvmPv);
    }
    if has(bytes, 0, b"XFSB") {
        found.push(Signature::Xfs);
    }
    if has(bytes, 1024 + 56, &[0x53, 0xEF]) {
        found.push(Signature::Ext);
    }
    if has(bytes, 65536 + 64, b"_BHRfS_M") {
        found.push(Signature::Btrfs);
    }
    if [4096usize, 8192, 16384, 65536]
        .iter()
        .any(|page| has(bytes, page - 10, b"SWAPSPACE2") || has(bytes, page - 10, b"SWAP-SPACE"))
    {
        found.push(Signature::Swap);
    }
    if has(bytes, 512, b"EFI PART") || (has(bytes, 510, &[0x55, 0xAA]) && mbr_has_partition(bytes))
    {
        found.push(Signature::PartitionTable);
    }
    if has(bytes, 32769, b"CD001") {
        found.push(Signature::Iso9660);
    }
    found
}

/// An MBR boot signature alone is common (boot sectors, FAT); count it as a partition table
/// only when one of the four entries is in use with a valid boot flag.
fn mbr_has_partition(bytes: &[u8]) -> bool {
    (0..4).any(|i| {
        let e = 446 + i * 16;
        match (bytes.get(e), bytes.get(e + 4)) {
            (Some(&flag), Some(&kind)) => (flag == 0 || flag == 0x80) && kind != 0,
            _ => false,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn label() -> DeviceLabel {
        DeviceLabel {
            fs_uuid: Uuid::from_u128(0x1234),
            device_uuid: Uuid::from_u128(0x5678),
            device_index: 2,
            device_count: 4,
            device_size: 1 << 30,
            data_offset: DEFAULT_DATA_OFFSET,
            block_size: 4096,
            layout: LabelLayout::Striped { stripe_unit: 65536 },
            formatted_at: 1_790_000_000,
        }
    }

    #[test]
    fn label_round_trips_and_fills_its_sector_range() {
        let bytes = label().encode();
        assert_eq!(bytes.len(), LABEL_SIZE);
        assert_eq!(DeviceLabel::decode(&bytes), Ok(label()));
        assert_eq!(probe(&bytes), vec![Signature::Sanfs(label())]);
    }

    #[test]
    fn damaged_labels_are_reported_not_trusted() {
        let bytes = label().encode();
        let payload_len = u32::from_le_bytes(bytes[8..12].try_into().unwrap()) as usize;
        for i in 0..12 + payload_len + 4 {
            let mut bad = bytes.clone();
            bad[i] ^= 1;
            assert!(
                DeviceLabel::decode(&bad).is_err(),
                "flip at byte {i} went unnoticed"
            );
        }
        let mut bad = bytes.clone();
        bad[20] ^= 1;
        assert!(matches!(
            probe(&bad).as_slice(),
            [Signature::DamagedSanfs(_)]
        ));
        let mut inconsistent = label();
        inconsistent.device_index = 4;
        assert!(DeviceLabel::decode(&inconsistent.encode()).is_err());
    }

    #[test]
    fn probe_finds_foreign_signatures() {
        let mut dev = vec![0u8; PROBE_SIZE];
        assert!(probe(&dev).is_empty());
        dev[512..520].copy_from_slice(b"LABELONE");
        dev[0..4].copy_from_slice(b"XFSB");
        dev[1080..1082].copy_from_slice(&[0x53, 0xEF]);
        dev[4086..4096].copy_from_slice(b"SWAPSPACE2");
        assert_eq!(
            probe(&dev),
            vec![
                Signature::LvmPv,
                Signature::Xfs,
                Signature::Ext,
                Signature::Swap
            ]
        );
        assert!(probe(&dev[..100]).contains(&Signature::Xfs));
    }
}
