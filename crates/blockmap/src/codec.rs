//! Binary encodings: little-endian, versioned, checksummed.
//!
//! Every persistent or transmitted structure of the pure core is written with [`Writer`] and
//! read back with [`Reader`], which never panics on short or hostile input. Stored records are
//! wrapped in an [`envelope`](seal): `magic (4) | version (u16) | flags (u16, 0) | payload
//! length (u32) | payload | crc32c of everything before it (u32)`. See docs/on-disk-format.md.

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

    #[test]
    fn reader_refuses_hostile_counts() {
        let mut w = Writer::new();
        w.u32(u32::MAX).u64(1);
        let bytes = w.into_vec();
        let mut r = Reader::new(&bytes);
        assert!(matches!(r.count(16), Err(DecodeError::Truncated { .. })));
    }
}
