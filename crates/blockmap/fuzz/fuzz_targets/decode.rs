//! Fuzzes the binary decoders of stored and transmitted structures (extent lists, volumes,
//! device labels, allocator states): nothing may panic, whatever decodes must be valid, and re-encoding what
//! decoded must decode to the same value.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sanfs_blockmap::alloc::Allocator;
use sanfs_blockmap::codec::{decode_extents, decode_volume, encode_extents, encode_volume};
use sanfs_blockmap::extent::ExtentMap;
use sanfs_blockmap::label::{probe, DeviceLabel};

fuzz_target!(|data: &[u8]| {
    if let Ok(extents) = decode_extents(data) {
        assert_eq!(decode_extents(&encode_extents(&extents)).as_ref(), Ok(&extents));
        ExtentMap::from_extents(extents).expect("decoded extents form a valid map");
    }
    if let Ok(volume) = decode_volume(data) {
        assert_eq!(decode_volume(&encode_volume(&volume)).as_ref(), Ok(&volume));
    }
    if let Ok(label) = DeviceLabel::decode(data) {
        assert_eq!(DeviceLabel::decode(&label.encode()).as_ref(), Ok(&label));
    }
    if let Ok(alloc) = Allocator::decode(data) {
        alloc.check_invariants().expect("decoded allocator is consistent");
        // The encoding is canonical.
        assert_eq!(alloc.encode(), data);
    }
    let _ = probe(data);
});
