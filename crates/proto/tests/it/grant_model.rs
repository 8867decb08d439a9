//! The grant plan check against a brute-force model: random plans (a partition of the
//! granted range into buffer pieces spread over devices and zero fill, then perhaps one
//! mutation) are accepted exactly when every 512-byte unit of the buffer is covered once.

use proptest::prelude::*;
use sanfs_proto::model::Grant;
use sanfs_proto::pb;
use sanfs_proto::types::*;

const UNIT: u64 = 512;

#[derive(Debug, Clone)]
enum Mutation {
    None,
    Shift { piece: usize, units: i64 },
    Resize { piece: usize, units: i64 },
    Drop { piece: usize },
    Duplicate { piece: usize },
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        2 => Just(Mutation::None),
        1 => (0..64usize, -3..=3i64).prop_map(|(piece, units)| Mutation::Shift { piece, units }),
        1 => (0..64usize, -3..=3i64).prop_map(|(piece, units)| Mutation::Resize { piece, units }),
        1 => (0..64usize).prop_map(|piece| Mutation::Drop { piece }),
        1 => (0..64usize).prop_map(|piece| Mutation::Duplicate { piece }),
    ]
}

/// Pieces in units: (start, len, owner) where owner 0 is zero fill and 1..=3 a device.
fn build(len_units: u64, cuts: &[u64], owners: &[u8], m: &Mutation) -> Vec<(i64, i64, u8)> {
    let mut bounds: Vec<u64> = cuts.iter().map(|c| c % (len_units + 1)).collect();
    bounds.push(0);
    bounds.push(len_units);
    bounds.sort_unstable();
    bounds.dedup();
    let mut pieces: Vec<(i64, i64, u8)> = bounds
        .windows(2)
        .enumerate()
        .map(|(i, w)| (w[0] as i64, (w[1] - w[0]) as i64, owners[i % owners.len()]))
        .collect();
    let n = pieces.len();
    if n > 0 {
        match *m {
            Mutation::None => {}
            Mutation::Shift { piece, units } => pieces[piece % n].0 += units,
            Mutation::Resize { piece, units } => pieces[piece % n].1 += units,
            Mutation::Drop { piece } => {
                pieces.remove(piece % n);
            }
            Mutation::Duplicate { piece } => {
                let p = pieces[piece % n];
                pieces.push(p);
            }
        }
    }
    pieces
}

/// The model: every unit of [0, len) covered exactly once, no piece empty or outside.
fn whole(len_units: u64, pieces: &[(i64, i64, u8)]) -> bool {
    let mut count = vec![0u32; len_units as usize];
    for &(start, len, _) in pieces {
        if len <= 0 || start < 0 || start + len > len_units as i64 {
            return false;
        }
        for u in start..start + len {
            count[u as usize] += 1;
        }
    }
    count.iter().all(|&c| c == 1)
}

fn to_grant(len_units: u64, pieces: &[(i64, i64, u8)]) -> Option<pb::Grant> {
    let mut grant = pb::Grant {
        grant_id: 1,
        epoch: 1,
        inode: 2,
        offset: 0,
        length: len_units * UNIT,
        mode: pb::LockMode::Shared.into(),
        file_size: len_units * UNIT,
        cacheable: true,
        ..pb::Grant::default()
    };
    for device in 1..=3u32 {
        let iov: Vec<pb::BufRange> = pieces
            .iter()
            .filter(|p| u32::from(p.2) == device)
            .map(|&(s, l, _)| {
                Some(pb::BufRange {
                    buf_off: u64::try_from(s).ok()? * UNIT,
                    len: u64::try_from(l).ok()? * UNIT,
                })
            })
            .collect::<Option<_>>()?;
        if iov.is_empty() {
            continue;
        }
        let len = iov.iter().map(|b| b.len).sum();
        grant.device_ios.push(pb::DeviceIo {
            device,
            phys_off: u64::from(device) << 30,
            len,
            iov,
        });
    }
    for &(s, l, owner) in pieces {
        if owner == 0 {
            grant.zero_fill.push(pb::BufRange {
                buf_off: u64::try_from(s).ok()? * UNIT,
                len: u64::try_from(l).ok()? * UNIT,
            });
        }
    }
    Some(grant)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn grant_check_matches_the_coverage_model(
        len_units in 0u64..40,
        cuts in proptest::collection::vec(0u64..64, 0..8),
        owners in proptest::collection::vec(0u8..=3, 1..6),
        m in mutation(),
    ) {
        let pieces = build(len_units, &cuts, &owners, &m);
        let expect = whole(len_units, &pieces);
        // A negative offset or length cannot be written on the wire; the model calls
        // such a plan broken and there is nothing to send.
        let Some(grant) = to_grant(len_units, &pieces) else {
            prop_assert!(!expect);
            return Ok(());
        };
        let got = Grant::try_from(grant.clone());
        prop_assert_eq!(got.is_ok(), expect, "{:?} -> {:?}", pieces, got);
        if let Err(e) = got {
            prop_assert!(e.field_path().is_some());
            // The only refusals here are about coverage or empty pieces.
            prop_assert!(matches!(e.root(), ProtocolError::InvalidField { .. }), "{}", e);
        }
    }
}
