//! Fuzzes the LVM2 text metadata parser and, for every LV it accepts, the layout built from
//! it: nothing may panic, and every volume built must map its bytes exactly once.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sanfs_blockmap::lvm::{lv_map, parse_vg_metadata};

fuzz_target!(|data: &[u8]| {
    let Ok(vg) = parse_vg_metadata(data) else {
        return;
    };
    for lv in &vg.lvs {
        let Ok(volume) = vg.lv_volume(&lv.name, 4096) else {
            continue;
        };
        let size = volume.size_bytes();
        assert_eq!(size, lv.size_extents() * vg.extent_size_bytes());
        // The first and last MiB (at most 256 stripe units of 4 KiB each).
        for (off, len) in [
            (0, size.min(1 << 20)),
            (size - size.min(1 << 20), size.min(1 << 20)),
        ] {
            let runs = lv_map(&volume, off, len).expect("in range");
            let mut at = off;
            for r in &runs {
                assert_eq!(r.vol_off, at);
                assert!(r.len > 0);
                at += r.len;
            }
            assert_eq!(at, off + len);
        }
        assert!(lv_map(&volume, size, 1).is_err());
    }
});
