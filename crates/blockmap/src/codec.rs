//! Binary encodings: little-endian, versioned, checksummed.
//!
//! Every persistent or transmitted structure of the pure core is written with [`Writer`] and
//! read back with [`Reader`], which never panics on short or hostile input. Stored records are
//! wrapped in an [`envelope`](seal): `magic (4) | version (u16) | flags (u16, 0) | payload
//! length (u32) | payload | crc32c of everything before it (u32)`. See docs/on-disk-format.md.
//!
//! Encodings of the core's own types live here too: [`encode_extents`] / [`decode_extents`]
//! (magic `SXT1`) and [`encode_volume`] / [`decode_volume`] (magic `SVL1`). Their decoders
//! never panic and only return values that pass the same checks as the types' constructors,
//! so they are ready to be fuzzed. The allocator state (magic `SAL1`) uses the same envelope
//! from [`Allocator::encode`](crate::alloc::Allocator::encode).

use uuid::Uuid;

use crate::extent::{Extent, ExtentState};
use crate::volume::{
    DeviceId, DeviceIndex, LayoutKind, LvmPvId, Segment, StripeLeg, Volume, VolumeDevice,
};

/// Why bytes could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("truncated: needed {needed} more bytes at offset {at}")]
    Truncated { at: usize, needed: usize },
    #[error("bad magic {found:02x?}, expected {expected:02x?}")]
    BadMagic { expected: [u8; 4], found: [u8; 4] },
    #[error("unsupported version {found} (this build reads up to {supported})")]
    UnsupportedVersion { found: u16, supported: u16 },
    #[error("checksum mismatch: stored {stored:#010x}, computed {computed:#010x}")]
    BadChecksum { stored: u32, computed: u32 },
    #[error("{extra} trailing bytes after the record")]
    TrailingBytes { extra: usize },
    #[error("invalid value: {0}")]
    Invalid(String),
}

/// Appends little-endian integers and byte strings to a buffer.
#[derive(Debug, Default, Clone)]
pub struct Writer {
    buf: Vec<u8>,
}

impl Writer {
    pub fn new() -> Writer {
        Writer::default()
    }

    pub fn with_capacity(cap: usize) -> Writer {
        Writer {
            buf: Vec::with_capacity(cap),
        }
    }

    pub fn u8(&mut self, v: u8) -> &mut Writer {
        self.buf.push(v);
        self
    }

    pub fn u16(&mut self, v: u16) -> &mut Writer {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }

    pub fn u32(&mut self, v: u32) -> &mut Writer {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }

    pub fn u64(&mut self, v: u64) -> &mut Writer {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }

    pub fn i64(&mut self, v: i64) -> &mut Writer {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }

    /// Raw bytes without a length prefix.
    pub fn raw(&mut self, v: &[u8]) -> &mut Writer {
        self.buf.extend_from_slice(v);
        self
    }

    /// A byte string with a u32 length prefix.
    pub fn bytes(&mut self, v: &[u8]) -> &mut Writer {
        let len = u32::try_from(v.len()).expect("encoded byte strings are below 4 GiB");
        self.u32(len);
        self.raw(v)
    }

    pub fn len(&self) -> usize {
        self.buf.len()
    }

    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }

    pub fn into_vec(self) -> Vec<u8> {
        self.buf
    }
}

/// Reads little-endian integers from a byte slice; every read is bounds-checked.
#[derive(Debug, Clone)]
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Reader<'a> {
        Reader { buf, pos: 0 }
    }

    /// Current offset from the start.
    pub fn position(&self) -> usize {
        self.pos
    }

    pub fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    /// The next `n` bytes.
    pub fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        let avail = self.remaining();
        if n > avail {
            return Err(DecodeError::Truncated {
                at: self.pos,
                needed: n - avail,
            });
        }
        let out = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(out)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }

    pub fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.array::<1>()?[0])
    }

    pub fn u16(&mut self) -> Result<u16, DecodeError> {
        Ok(u16::from_le_bytes(self.array()?))
    }

    pub fn u32(&mut self) -> Result<u32, DecodeError> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    pub fn u64(&mut self) -> Result<u64, DecodeError> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    pub fn i64(&mut self) -> Result<i64, DecodeError> {
        Ok(i64::from_le_bytes(self.array()?))
    }

    /// A byte string written by [`Writer::bytes`].
    pub fn bytes(&mut self) -> Result<&'a [u8], DecodeError> {
        let len = self.u32()? as usize;
        self.take(len)
    }

    /// A count of items that each take at least `min_item_len` bytes; refuses counts that
    /// cannot fit in what is left, so that a hostile count never makes us allocate.
    pub fn count(&mut self, min_item_len: usize) -> Result<usize, DecodeError> {
        let n = self.u32()? as usize;
        let need = n.saturating_mul(min_item_len.max(1));
        if need > self.remaining() {
            return Err(DecodeError::Truncated {
                at: self.pos,
                needed: need - self.remaining(),
            });
        }
        Ok(n)
    }

    /// Fails unless every byte was consumed.
    pub fn finish(self) -> Result<(), DecodeError> {
        match self.remaining() {
            0 => Ok(()),
            extra => Err(DecodeError::TrailingBytes { extra }),
        }
    }
}

const ENVELOPE_HEADER: usize = 4 + 2 + 2 + 4;

/// Wraps `payload` in an envelope with `magic`, `version` and a crc32c.
pub fn seal(magic: [u8; 4], version: u16, payload: &[u8]) -> Vec<u8> {
    let mut w = Writer::with_capacity(ENVELOPE_HEADER + payload.len() + 4);
    w.raw(&magic).u16(version).u16(0).bytes(payload);
    let crc = crc32c::crc32c(&w.buf);
    w.u32(crc);
    w.into_vec()
}

/// Checks an envelope written by [`seal`] and returns `(version, payload)`. Versions above
/// `max_version` are refused; the caller decides how to read older ones.
pub fn open(magic: [u8; 4], max_version: u16, bytes: &[u8]) -> Result<(u16, &[u8]), DecodeError> {
    let mut r = Reader::new(bytes);
    let found: [u8; 4] = r.array()?;
    if found != magic {
        return Err(DecodeError::BadMagic {
            expected: magic,
            found,
        });
    }
    let version = r.u16()?;
    let _flags = r.u16()?;
    let payload = r.bytes()?;
    let covered = r.position();
    let stored = r.u32()?;
    r.finish()?;
    let computed = crc32c::crc32c(&bytes[..covered]);
    if stored != computed {
        return Err(DecodeError::BadChecksum { stored, computed });
    }
    if version == 0 || version > max_version {
        return Err(DecodeError::UnsupportedVersion {
            found: version,
            supported: max_version,
        });
    }
    Ok((version, payload))
}

// ---- Extent lists ----

/// Magic of an encoded extent list.
pub const EXTENTS_MAGIC: [u8; 4] = *b"SXT1";
/// Current version of the extent-list encoding.
pub const EXTENTS_VERSION: u16 = 1;
/// Bytes of one encoded extent: file block, volume block, length (u64 each), state (u8).
const EXTENT_RECORD_LEN: usize = 8 + 8 + 8 + 1;

fn state_tag(state: ExtentState) -> u8 {
    match state {
        ExtentState::Written => 0,
        ExtentState::Unwritten => 1,
    }
}

/// Encodes extents (in file order, disjoint, as [`ExtentMap::iter`](crate::extent::ExtentMap)
/// yields them or a grant carries them) in a sealed envelope:
/// `count (u32) | count x (file_block u64, vol_block u64, len_blocks u64, state u8)`, state 0
/// written, 1 unwritten.
pub fn encode_extents(extents: &[Extent]) -> Vec<u8> {
    let count = u32::try_from(extents.len()).expect("an extent list has fewer than 2^32 records");
    let mut w = Writer::with_capacity(4 + extents.len() * EXTENT_RECORD_LEN);
    w.u32(count);
    for e in extents {
        w.u64(e.file_block)
            .u64(e.vol_block)
            .u64(e.len_blocks)
            .u8(state_tag(e.state));
    }
    seal(EXTENTS_MAGIC, EXTENTS_VERSION, &w.into_vec())
}

/// Decodes [`encode_extents`] output. The result is always a valid extent list: every
/// extent non-empty and free of overflow, sorted by file block and disjoint, so
/// [`ExtentMap::from_extents`](crate::extent::ExtentMap::from_extents) accepts it.
pub fn decode_extents(bytes: &[u8]) -> Result<Vec<Extent>, DecodeError> {
    let (_version, payload) = open(EXTENTS_MAGIC, EXTENTS_VERSION, bytes)?;
    let mut r = Reader::new(payload);
    let n = r.count(EXTENT_RECORD_LEN)?;
    let mut extents: Vec<Extent> = Vec::with_capacity(n);
    for i in 0..n {
        let file_block = r.u64()?;
        let vol_block = r.u64()?;
        let len_blocks = r.u64()?;
        let state = match r.u8()? {
            0 => ExtentState::Written,
            1 => ExtentState::Unwritten,
            tag => return Err(invalid(format!("extent {i}: unknown state {tag}"))),
        };
        let e = Extent {
            file_block,
            vol_block,
            len_blocks,
            state,
        };
        e.validate()
            .map_err(|err| invalid(format!("extent {i}: {err}")))?;
        if let Some(prev) = extents.last()
            && prev.checked_file_end().is_none_or(|end| end > e.file_block)
        {
            return Err(invalid(format!(
                "extent {i} ({e}) overlaps or precedes extent {} ({prev})",
                i - 1
            )));
        }
        extents.push(e);
    }
    r.finish()?;
    Ok(extents)
}

fn invalid(reason: String) -> DecodeError {
    DecodeError::Invalid(reason)
}

// ---- Volumes ----

/// Magic of an encoded volume.
pub const VOLUME_MAGIC: [u8; 4] = *b"SVL1";
/// Current version of the volume encoding.
pub const VOLUME_VERSION: u16 = 1;

const DEVICE_SANFS: u8 = 0;
const DEVICE_LVM_PV: u8 = 1;
const KIND_LINEAR: u8 = 0;
const KIND_STRIPED: u8 = 1;
const KIND_LVM: u8 = 2;
/// Smallest encoded device: tag, 16-byte UUID, size.
const DEVICE_MIN_LEN: usize = 1 + 16 + 8;
/// Smallest encoded segment: vol_start, len, stripe_unit, leg count.
const SEGMENT_MIN_LEN: usize = 8 + 8 + 8 + 4;
/// Encoded stripe leg: device index, physical start.
const LEG_LEN: usize = 4 + 8;

/// Encodes a volume in a sealed envelope (the metadata server keeps it in its superblock; the
/// protocol sends it to agents):
///
/// ```text
/// block_size u32
/// kind: u8 tag; 0 linear | 1 striped (stripe_unit u64, width u32) | 2 lvm (vg bytes, lv bytes)
/// device count u32, each: tag u8 (0 sanfs UUID: 16 bytes | 1 LVM PV id: 32 bytes), size u64
/// segment count u32, each: vol_start u64, len u64, stripe_unit u64,
///                          leg count u32, each: device u32, phys_start u64
/// ```
/// Byte strings carry a u32 length prefix.
pub fn encode_volume(volume: &Volume) -> Vec<u8> {
    let mut w = Writer::new();
    w.u32(volume.block_size());
    match volume.kind() {
        LayoutKind::Linear => {
            w.u8(KIND_LINEAR);
        }
        LayoutKind::Striped { stripe_unit, width } => {
            w.u8(KIND_STRIPED).u64(*stripe_unit).u32(*width);
        }
        LayoutKind::Lvm { vg_name, lv_name } => {
            w.u8(KIND_LVM)
                .bytes(vg_name.as_bytes())
                .bytes(lv_name.as_bytes());
        }
    }
    let device_count =
        u32::try_from(volume.devices().len()).expect("a volume has fewer than 2^32 devices");
    w.u32(device_count);
    for dev in volume.devices() {
        match dev.uuid {
            DeviceId::Sanfs(uuid) => w.u8(DEVICE_SANFS).raw(uuid.as_bytes()),
            DeviceId::LvmPv(id) => w.u8(DEVICE_LVM_PV).raw(id.as_bytes()),
        };
        w.u64(dev.size_bytes);
    }
    let segment_count =
        u32::try_from(volume.segments().len()).expect("a volume has fewer than 2^32 segments");
    w.u32(segment_count);
    for seg in volume.segments() {
        let legs = u32::try_from(seg.legs.len()).expect("a segment has fewer than 2^32 legs");
        w.u64(seg.vol_start)
            .u64(seg.len)
            .u64(seg.stripe_unit)
            .u32(legs);
        for leg in &seg.legs {
            w.u32(leg.device.0).u64(leg.phys_start);
        }
    }
    seal(VOLUME_MAGIC, VOLUME_VERSION, &w.into_vec())
}

fn utf8(bytes: &[u8], what: &str) -> Result<String, DecodeError> {
    String::from_utf8(bytes.to_vec()).map_err(|_| invalid(format!("{what} is not UTF-8")))
}

/// Decodes [`encode_volume`] output and checks it as [`Volume::from_segments`] does, so a
/// decoded volume is always one that could have been built.
pub fn decode_volume(bytes: &[u8]) -> Result<Volume, DecodeError> {
    let (_version, payload) = open(VOLUME_MAGIC, VOLUME_VERSION, bytes)?;
    let mut r = Reader::new(payload);
    let block_size = r.u32()?;
    let kind = match r.u8()? {
        KIND_LINEAR => LayoutKind::Linear,
        KIND_STRIPED => LayoutKind::Striped {
            stripe_unit: r.u64()?,
            width: r.u32()?,
        },
        KIND_LVM => LayoutKind::Lvm {
            vg_name: utf8(r.bytes()?, "volume group name")?,
            lv_name: utf8(r.bytes()?, "logical volume name")?,
        },
        tag => return Err(invalid(format!("unknown layout kind {tag}"))),
    };
    let device_count = r.count(DEVICE_MIN_LEN)?;
    let mut devices = Vec::with_capacity(device_count);
    for i in 0..device_count {
        let uuid = match r.u8()? {
            DEVICE_SANFS => {
                let mut raw = [0u8; 16];
                raw.copy_from_slice(r.take(16)?);
                DeviceId::Sanfs(Uuid::from_bytes(raw))
            }
            DEVICE_LVM_PV => {
                let raw = r.take(32)?;
                let id = std::str::from_utf8(raw).ok().and_then(LvmPvId::parse);
                DeviceId::LvmPv(id.ok_or_else(|| invalid(format!("device {i}: bad LVM PV id")))?)
            }
            tag => return Err(invalid(format!("device {i}: unknown id tag {tag}"))),
        };
        devices.push(VolumeDevice {
            uuid,
            size_bytes: r.u64()?,
        });
    }
    let segment_count = r.count(SEGMENT_MIN_LEN)?;
    let mut segments = Vec::with_capacity(segment_count);
    for i in 0..segment_count {
        let vol_start = r.u64()?;
        let len = r.u64()?;
        let stripe_unit = r.u64()?;
        let leg_count = r.count(LEG_LEN)?;
        let mut legs = Vec::with_capacity(leg_count);
        for _ in 0..leg_count {
            legs.push(StripeLeg {
                device: DeviceIndex(r.u32()?),
                phys_start: r.u64()?,
            });
        }
        // Volume::from_segments multiplies these; keep hostile values from overflowing there.
        let width = u64::try_from(legs.len()).unwrap_or(u64::MAX);
        if stripe_unit.checked_mul(width).is_none() {
            return Err(invalid(format!(
                "segment {i}: {width} legs of {stripe_unit} bytes overflow"
            )));
        }
        segments.push(Segment {
            vol_start,
            len,
            stripe_unit,
            legs,
        });
    }
    r.finish()?;
    Volume::from_segments(block_size, devices, segments, kind)
        .map_err(|err| invalid(format!("volume: {err}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envelope_round_trips_and_detects_damage() {
        let sealed = seal(*b"TEST", 1, b"payload");
        assert_eq!(open(*b"TEST", 1, &sealed), Ok((1, &b"payload"[..])));
        assert!(matches!(
            open(*b"XXXX", 1, &sealed),
            Err(DecodeError::BadMagic { .. })
        ));
        for i in 0..sealed.len() {
            let mut bad = sealed.clone();
            bad[i] ^= 0x40;
            assert!(
                open(*b"TEST", 1, &bad).is_err(),
                "flip at {i} went unnoticed"
            );
        }
        for n in 0..sealed.len() {
            assert!(open(*b"TEST", 1, &sealed[..n]).is_err());
        }
        let newer = seal(*b"TEST", 2, b"x");
        assert!(matches!(
            open(*b"TEST", 1, &newer),
            Err(DecodeError::UnsupportedVersion { .. })
        ));
    }

    use crate::extent::ExtentMap;
    use crate::plan::test_support::{self, Rng};
    use proptest::prelude::*;

    fn ext(file_block: u64, len_blocks: u64, vol_block: u64, unwritten: bool) -> Extent {
        Extent {
            file_block,
            vol_block,
            len_blocks,
            state: if unwritten {
                ExtentState::Unwritten
            } else {
                ExtentState::Written
            },
        }
    }

    /// The payload of a sealed record.
    fn payload(sealed: &[u8]) -> Vec<u8> {
        sealed[ENVELOPE_HEADER..sealed.len() - 4].to_vec()
    }

    /// Extents as `encode_extents` lays them out, without any checks.
    fn raw_extents(extents: &[Extent]) -> Vec<u8> {
        let mut w = Writer::new();
        w.u32(extents.len() as u32);
        for e in extents {
            w.u64(e.file_block)
                .u64(e.vol_block)
                .u64(e.len_blocks)
                .u8(state_tag(e.state));
        }
        seal(EXTENTS_MAGIC, EXTENTS_VERSION, &w.into_vec())
    }

    fn assert_every_bit_flip_is_detected(sealed: &[u8], decode: impl Fn(&[u8]) -> bool) {
        for i in 0..sealed.len() {
            for bit in 0..8 {
                let mut bad = sealed.to_vec();
                bad[i] ^= 1 << bit;
                assert!(
                    !decode(&bad),
                    "flip of bit {bit} of byte {i} went unnoticed"
                );
            }
        }
        for n in 0..sealed.len() {
            assert!(
                !decode(&sealed[..n]),
                "truncation to {n} bytes went unnoticed"
            );
        }
        let mut longer = sealed.to_vec();
        longer.push(0);
        assert!(!decode(&longer));
    }

    #[test]
    fn extents_round_trip_and_detect_damage() {
        let extents = vec![
            ext(0, 4, 100, false),
            ext(6, 3, 200, true),
            ext(u64::MAX - 5, 5, u64::MAX - 5, false),
        ];
        let sealed = encode_extents(&extents);
        assert_eq!(&sealed[..4], b"SXT1");
        assert_eq!(
            sealed.len(),
            ENVELOPE_HEADER + 4 + 3 * EXTENT_RECORD_LEN + 4
        );
        assert_eq!(decode_extents(&sealed), Ok(extents));
        assert_eq!(decode_extents(&encode_extents(&[])), Ok(vec![]));
        assert_every_bit_flip_is_detected(&sealed, |b| decode_extents(b).is_ok());
    }

    #[test]
    fn invalid_extent_lists_are_refused_even_with_a_good_checksum() {
        let bad_lists = [
            vec![ext(0, 0, 1, false)],
            vec![ext(u64::MAX - 1, 2, 0, false)],
            vec![ext(0, 2, u64::MAX - 1, false)],
            vec![ext(0, 4, 100, false), ext(3, 1, 200, false)],
            vec![ext(10, 4, 100, false), ext(0, 1, 200, false)],
            vec![ext(5, 1, 100, false), ext(5, 1, 200, false)],
        ];
        for list in bad_lists {
            let r = decode_extents(&raw_extents(&list));
            assert!(matches!(r, Err(DecodeError::Invalid(_))), "{list:?}: {r:?}");
        }
        let mut bytes = payload(&raw_extents(&[ext(0, 1, 1, false)]));
        *bytes.last_mut().unwrap() = 7;
        let r = decode_extents(&seal(EXTENTS_MAGIC, 1, &bytes));
        assert!(matches!(r, Err(DecodeError::Invalid(m)) if m.contains("unknown state 7")));
        // A count far beyond the payload is refused before anything is allocated.
        let mut w = Writer::new();
        w.u32(u32::MAX);
        let r = decode_extents(&seal(EXTENTS_MAGIC, 1, &w.into_vec()));
        assert!(matches!(r, Err(DecodeError::Truncated { .. })));
        let mut trailing = payload(&encode_extents(&[ext(0, 1, 1, false)]));
        trailing.push(0);
        assert_eq!(
            decode_extents(&seal(EXTENTS_MAGIC, 1, &trailing)),
            Err(DecodeError::TrailingBytes { extra: 1 })
        );
        assert!(matches!(
            decode_extents(&seal(EXTENTS_MAGIC, 2, &[0, 0, 0, 0])),
            Err(DecodeError::UnsupportedVersion { .. })
        ));
        assert!(matches!(
            decode_extents(&encode_volume(&test_support::volume(&mut Rng::new(1), 0))),
            Err(DecodeError::BadMagic { .. })
        ));
    }

    #[test]
    fn volumes_round_trip_and_detect_damage() {
        let mut rng = Rng::new(42);
        for kind in 0..3 {
            let v = test_support::volume(&mut rng, kind);
            let sealed = encode_volume(&v);
            assert_eq!(&sealed[..4], b"SVL1");
            assert_eq!(decode_volume(&sealed).as_ref(), Ok(&v));
            assert_every_bit_flip_is_detected(&sealed, |b| decode_volume(b).is_ok());
        }
    }

    #[test]
    fn invalid_volumes_are_refused_even_with_a_good_checksum() {
        let sanfs_dev = |w: &mut Writer, id: u8, size: u64| {
            w.u8(DEVICE_SANFS).raw(&[id; 16]).u64(size);
        };
        // block size, kind, devices, then one segment with the given legs.
        let volume = |block_size: u32, su: u64, seg_len: u64, legs: &[(u32, u64)]| {
            let mut w = Writer::new();
            w.u32(block_size).u8(KIND_LINEAR).u32(2);
            sanfs_dev(&mut w, 1, 1 << 20);
            sanfs_dev(&mut w, 2, 1 << 20);
            w.u32(1).u64(0).u64(seg_len).u64(su).u32(legs.len() as u32);
            for &(d, p) in legs {
                w.u32(d).u64(p);
            }
            seal(VOLUME_MAGIC, VOLUME_VERSION, &w.into_vec())
        };
        let good = volume(4096, 65536, 1 << 18, &[(0, 0), (1, 0)]);
        let v = decode_volume(&good).unwrap();
        assert_eq!((v.size_bytes(), v.segments()[0].legs.len()), (1 << 18, 2));
        let bad = [
            // A stripe unit whose row size overflows u64 (must not panic in from_segments).
            volume(4096, 1 << 63, 1 << 18, &[(0, 0), (1, 0)]),
            volume(4096, u64::MAX - 4095, 1 << 18, &[(0, 0), (1, 0)]),
            volume(1000, 65536, 1 << 18, &[(0, 0), (1, 0)]),
            volume(4096, 65536, 1 << 18, &[(0, 0), (7, 0)]),
            volume(4096, 65536, 1 << 18, &[(0, 0), (0, 65536)]),
            volume(4096, 65536, 1 << 18, &[(0, u64::MAX - 100), (1, 0)]),
            volume(4096, 65536, 1 << 18, &[]),
            volume(4096, 65536, 0, &[(0, 0)]),
        ];
        for (i, bytes) in bad.iter().enumerate() {
            let r = decode_volume(bytes);
            assert!(matches!(r, Err(DecodeError::Invalid(_))), "case {i}: {r:?}");
        }
        let tagged = |tag: u8, body: &[u8]| {
            let mut w = Writer::new();
            w.u32(4096)
                .u8(KIND_LINEAR)
                .u32(1)
                .u8(tag)
                .raw(body)
                .u64(1 << 20);
            w.u32(1).u64(0).u64(4096).u64(4096).u32(1).u32(0).u64(0);
            seal(VOLUME_MAGIC, VOLUME_VERSION, &w.into_vec())
        };
        let pv = b"aDdf5UXy1c00AbcdEFghijklmnopqrst";
        assert!(decode_volume(&tagged(DEVICE_LVM_PV, pv)).is_ok());
        let mut bad_pv = *pv;
        bad_pv[3] = b'-';
        for bytes in [
            tagged(DEVICE_LVM_PV, &bad_pv),
            tagged(DEVICE_LVM_PV, &[0xff; 32]),
            tagged(9, &[0; 16]),
        ] {
            assert!(matches!(
                decode_volume(&bytes),
                Err(DecodeError::Invalid(_))
            ));
        }
        let mut w = Writer::new();
        w.u32(4096).u8(KIND_LVM).bytes(&[0xc3]).bytes(b"lv");
        let r = decode_volume(&seal(VOLUME_MAGIC, VOLUME_VERSION, &w.into_vec()));
        assert!(matches!(r, Err(DecodeError::Invalid(m)) if m.contains("UTF-8")));
    }

    /// Sorted, disjoint, non-empty extents, some near 2^64.
    fn extent_list() -> impl Strategy<Value = Vec<Extent>> {
        prop::collection::vec(
            (0u64..1 << 20, 1u64..1 << 20, any::<u64>(), any::<bool>()),
            0..40,
        )
        .prop_map(|raw| {
            let mut out = Vec::new();
            let mut next = 0u64;
            for (gap, len, vol, unwritten) in raw {
                let Some(file_block) = next.checked_add(gap) else {
                    break;
                };
                if file_block.checked_add(len).is_none() {
                    break;
                }
                let vol_block = vol.min(u64::MAX - len);
                out.push(ext(file_block, len, vol_block, unwritten));
                next = file_block + len;
                if out.len() % 7 == 6 {
                    next = next.max(u64::MAX - (1 << 24));
                }
            }
            out
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(1024))]

        #[test]
        fn extent_lists_round_trip(extents in extent_list()) {
            let sealed = encode_extents(&extents);
            prop_assert_eq!(decode_extents(&sealed), Ok(extents.clone()));
            let map = ExtentMap::from_extents(extents).unwrap();
            let again = ExtentMap::from_extents(decode_extents(&encode_extents(&map.to_vec())).unwrap());
            prop_assert_eq!(again, Ok(map));
        }

        #[test]
        fn volumes_round_trip(kind in 0u8..3, seed in any::<u64>()) {
            let v = test_support::volume(&mut Rng::new(seed), kind);
            prop_assert_eq!(decode_volume(&encode_volume(&v)), Ok(v));
        }

        /// Damaged payloads with a valid checksum (what a buggy writer could produce) never
        /// panic the decoders, and whatever they accept is valid.
        #[test]
        fn decoders_survive_resealed_damage(
            which in 0u8..2,
            seed in any::<u64>(),
            edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
            cut in any::<prop::sample::Index>(),
            do_cut in any::<bool>(),
        ) {
            let mut rng = Rng::new(seed);
            let (magic, sealed) = if which == 0 {
                let mut m = ExtentMap::new();
                for _ in 0..rng.range(0, 12) {
                    let len = rng.range(1, 1000);
                    let f = rng.below(10_000);
                    m.insert(ext(f, len, rng.below(1 << 40), rng.chance(1, 2))).unwrap();
                }
                (EXTENTS_MAGIC, encode_extents(&m.to_vec()))
            } else {
                let kind = rng.below(3) as u8;
                (VOLUME_MAGIC, encode_volume(&test_support::volume(&mut rng, kind)))
            };
            let mut body = payload(&sealed);
            if !body.is_empty() {
                for (at, value) in edits {
                    let i = at.index(body.len());
                    body[i] = value;
                }
                if do_cut {
                    body.truncate(cut.index(body.len()));
                }
            }
            let resealed = seal(magic, 1, &body);
            if which == 0 {
                if let Ok(extents) = decode_extents(&resealed) {
                    prop_assert!(ExtentMap::from_extents(extents).is_ok());
                }
            } else if let Ok(v) = decode_volume(&resealed) {
                prop_assert_eq!(decode_volume(&encode_volume(&v)), Ok(v));
            }
        }

        #[test]
        fn decoders_survive_random_bytes(bytes in prop::collection::vec(any::<u8>(), 0..200)) {
            let _ = decode_extents(&bytes);
            let _ = decode_volume(&bytes);
            let _ = decode_extents(&seal(EXTENTS_MAGIC, 1, &bytes));
            let _ = decode_volume(&seal(VOLUME_MAGIC, 1, &bytes));
        }
    }

    #[test]
    fn reader_refuses_hostile_counts() {
        let mut w = Writer::new();
        w.u32(u32::MAX).u64(1);
        let bytes = w.into_vec();
        let mut r = Reader::new(&bytes);
        assert!(matches!(r.count(16), Err(DecodeError::Truncated { .. })));
    }
}
