//! A zeroed byte buffer whose start is aligned for direct I/O, in safe code: an
//! over-allocated `Vec` and an aligned window into it.
//!
//! The agent's data path has its own pooled buffers (client-agent `buf`); this one serves the
//! probes and the server's proxied I/O, where a buffer lives for one transfer.

/// Alignment of the buffer's start: enough for every device's direct-I/O memory alignment.
pub const DIRECT_ALIGN: usize = 4096;

/// `len` zeroed bytes starting at a [`DIRECT_ALIGN`]-aligned address.
#[derive(Debug)]
pub struct AlignedBuf {
    raw: Vec<u8>,
    shift: usize,
    len: usize,
}

impl AlignedBuf {
    pub fn zeroed(len: usize) -> AlignedBuf {
        let raw = vec![0u8; len + DIRECT_ALIGN];
        let shift = raw.as_ptr().align_offset(DIRECT_ALIGN).min(DIRECT_ALIGN);
        AlignedBuf { raw, shift, len }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_slice(&self) -> &[u8] {
        &self.raw[self.shift..self.shift + self.len]
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.raw[self.shift..self.shift + self.len]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_window_is_aligned_zeroed_and_of_the_asked_length() {
        for len in [0, 1, 511, 4096, 10_000] {
            let mut buf = AlignedBuf::zeroed(len);
            assert_eq!(buf.len(), len);
            assert_eq!(buf.is_empty(), len == 0);
            assert!(buf.as_slice().iter().all(|b| *b == 0));
            assert_eq!(buf.as_mut_slice().as_ptr() as usize % DIRECT_ALIGN, 0);
        }
    }
}
