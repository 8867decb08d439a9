//! Cutting a sub-range out of a grant's I/O plan, so that a read inside a cached read grant
//! moves only the bytes asked for.
//!
//! Pure: a grant's `device_ios` and `zero_fill` in, the plan of the buffer range
//! `[start, end)` (relative to the grant's start) out, with buffer offsets rebased to `start`.
//! Each device I/O's pieces lie back to back on its device in `iov` order, so a piece cut to
//! the range keeps its device position; kept pieces that stay physically contiguous stay in
//! one device I/O.

use sanfs_blockmap::plan::{BufRange, DeviceIo, IoPlan};

/// The plan of `[start, end)` of a grant's buffer (`start <= end`, both inside the grant).
pub(crate) fn sub_plan(
    device_ios: &[DeviceIo],
    zero_fill: &[BufRange],
    start: u64,
    end: u64,
) -> IoPlan {
    let _span = crate::stages::Span::cpu(crate::stages::Stage::Plan);
    let mut out: Vec<DeviceIo> = Vec::new();
    for io in device_ios {
        let mut dev_cursor = io.phys_off;
        let mut current: Option<DeviceIo> = None;
        for p in &io.iov {
            let (ps, pe) = (p.buf_off, p.buf_off.saturating_add(p.len));
            let (cs, ce) = (ps.max(start), pe.min(end));
            if cs < ce {
                let phys = dev_cursor + (cs - ps);
                let piece = BufRange {
                    buf_off: cs - start,
                    len: ce - cs,
                };
                match current.as_mut() {
                    Some(c) if c.phys_off + c.len == phys => {
                        c.len += piece.len;
                        c.iov.push(piece);
                    }
                    _ => {
                        out.extend(current.take());
                        current = Some(DeviceIo {
                            device: io.device,
                            phys_off: phys,
                            len: piece.len,
                            iov: vec![piece],
                        });
                    }
                }
            }
            dev_cursor = dev_cursor.saturating_add(p.len);
        }
        out.extend(current);
    }
    let zero_fill = zero_fill
        .iter()
        .filter_map(|z| {
            let (cs, ce) = (
                z.buf_off.max(start),
                z.buf_off.saturating_add(z.len).min(end),
            );
            (cs < ce).then(|| BufRange {
                buf_off: cs - start,
                len: ce - cs,
            })
        })
        .collect();
    IoPlan {
        len: end - start,
        device_ios: out,
        zero_fill,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sanfs_blockmap::volume::DeviceIndex;

    fn piece(buf_off: u64, len: u64) -> BufRange {
        BufRange { buf_off, len }
    }

    #[test]
    fn cuts_striped_pieces_and_rebases_them() {
        // Two devices, stripe unit 8: buffer [0,8) d0@100, [8,16) d1@200, [16,24) d0@108,
        // [24,32) zero fill.
        let ios = vec![
            DeviceIo {
                device: DeviceIndex(0),
                phys_off: 100,
                len: 16,
                iov: vec![piece(0, 8), piece(16, 8)],
            },
            DeviceIo {
                device: DeviceIndex(1),
                phys_off: 200,
                len: 8,
                iov: vec![piece(8, 8)],
            },
        ];
        let zero = vec![piece(24, 8)];
        let p = sub_plan(&ios, &zero, 4, 28);
        assert_eq!(p.len, 24);
        assert_eq!(
            p.device_ios,
            vec![
                DeviceIo {
                    device: DeviceIndex(0),
                    phys_off: 104,
                    len: 12,
                    iov: vec![piece(0, 4), piece(12, 8)],
                },
                DeviceIo {
                    device: DeviceIndex(1),
                    phys_off: 200,
                    len: 8,
                    iov: vec![piece(4, 8)],
                },
            ]
        );
        assert_eq!(p.zero_fill, vec![piece(20, 4)]);
        // A cut that ends inside the first piece and starts after it on the same device
        // leaves a physical gap: two device I/Os.
        let ios2 = vec![DeviceIo {
            device: DeviceIndex(0),
            phys_off: 0,
            len: 16,
            iov: vec![piece(8, 8), piece(0, 8)],
        }];
        let p = sub_plan(&ios2, &[], 4, 12);
        assert_eq!(p.device_ios.len(), 2);
        assert_eq!(p.device_ios[0].phys_off, 0);
        assert_eq!(p.device_ios[0].iov, vec![piece(4, 4)]);
        assert_eq!(p.device_ios[1].phys_off, 12);
        assert_eq!(p.device_ios[1].iov, vec![piece(0, 4)]);
    }
}
