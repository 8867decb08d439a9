//! fallocate's punch hole and zero range end to end: two nodes, data on the LUNs, a cached
//! read grant on the other node in the way, and every byte checked against a model.

use sanfs_proto::model::FallocateMode;
use sanfs_proto::types::FsError;

use crate::cluster::{self, MIB, Model, Rng, assert_bytes, create, open, root};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn punch_hole_and_zero_range_read_as_zeros_on_every_node() {
    let srv = cluster::start(10_000).await;
    let a = srv.client("a").await;
    let b = srv.client("b").await;
    let (ino, ha) = create(&a, "holes").await;
    let hb = open(&b, ino).await;
    let mut rng = Rng::new(23);
    let mut model = Model::default();
    let size = 4 * MIB;
    let data = rng.bytes(size as usize);
    a.write_at(&root(), &ha, ino, 0, &data).await.unwrap();
    model.write(0, &data);
    let full = a.getattr(&root(), ino).await.unwrap().allocated;

    // (offset, len, mode): unaligned edges in different blocks, both edges in one block,
    // block aligned, and ranges that run past the end of file.
    let cases = [
        (10_000, 300_000, FallocateMode::PunchHole),
        (MIB + 100, 50, FallocateMode::PunchHole),
        (2 * MIB, 256 * 1024, FallocateMode::PunchHole),
        (3 * MIB - 7, 70_000, FallocateMode::ZeroRangeKeepSize),
        (size - 4096 - 3, 8192, FallocateMode::ZeroRangeKeepSize),
        (size - 100, 10_000, FallocateMode::ZeroRange),
    ];
    for (i, (offset, len, mode)) in cases.into_iter().enumerate() {
        // B holds a cached read grant over the whole file: the change must recall it.
        let got = b.read_at(&root(), &hb, ino, 0, size).await.unwrap();
        assert_bytes(&got, model.read(0, size), &format!("case {i}: before"));
        let attr = a
            .fallocate(&root(), &ha, ino, offset, len, mode)
            .await
            .unwrap();
        let cur = model.0.len() as u64;
        let end = offset + len;
        let zero_to = if mode == FallocateMode::ZeroRange {
            end
        } else {
            end.min(cur)
        };
        model.write(offset, &vec![0u8; (zero_to - offset) as usize]);
        let now = model.0.len() as u64;
        assert_eq!(attr.size, now, "case {i}: size");
        for (who, c, h) in [("a", &a, &ha), ("b", &b, &hb)] {
            let got = c.read_at(&root(), h, ino, 0, now + MIB).await.unwrap();
            assert_bytes(&got, &model.0, &format!("case {i}: {who} after {mode:?}"));
        }
    }
    // The punched whole blocks went back to the free space; zero range keeps its blocks.
    // (The last zero range grows the file by at most 3 blocks.)
    let after = a.getattr(&root(), ino).await.unwrap().allocated;
    let punched = ((10_000u64.div_ceil(4096)..310_000 / 4096).count() as u64 + 64) * 4096;
    assert!(
        after <= full - punched + 3 * 4096,
        "{after} of {full} bytes allocated"
    );

    // Bad input changes nothing.
    let before = a.getattr(&root(), ino).await.unwrap();
    for (offset, len) in [(0, 0), (u64::MAX - 10, 100)] {
        let e = a
            .fallocate(&root(), &ha, ino, offset, len, FallocateMode::PunchHole)
            .await
            .unwrap_err();
        assert!(
            matches!(
                e,
                FsError::Invalid(_) | FsError::FileTooBig | FsError::Range
            ),
            "{e:?}"
        );
    }
    let got = a
        .read_at(&root(), &ha, ino, 0, model.0.len() as u64)
        .await
        .unwrap();
    assert_bytes(&got, &model.0, "after refused calls");
    assert_eq!(
        a.getattr(&root(), ino).await.unwrap().allocated,
        before.allocated
    );

    a.close().await.unwrap();
    b.close().await.unwrap();
    srv.stop().await;
}

/// Found by the exerciser (`sanfs-bench exercise`): a shrinking truncate to an unaligned size
/// leaves the old bytes past the new end in the end-of-file block on the LUN; an extending
/// fallocate (default mode) must make them read as zeros, as a truncate up and a write past
/// the end do. Also through the other node, which held a cached read grant of the file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_extending_fallocate_reads_zeros_past_the_old_end_of_file() {
    let srv = cluster::start(10_000).await;
    let a = srv.client("a").await;
    let b = srv.client("b").await;
    let (ino, ha) = create(&a, "grow").await;
    let hb = open(&b, ino).await;
    let mut model = Model::default();
    // Direct (64 KiB aligned) and proxied (small, unaligned) data in the end-of-file block.
    for (offset, len) in [(0u64, 256 * 1024u64), (300_000, 5_000)] {
        let data = vec![0xab; len as usize];
        a.write_at(&root(), &ha, ino, offset, &data).await.unwrap();
        model.write(offset, &data);
    }
    for (shrink_to, grow_by, who) in [(200_001u64, 70_000u64, "a"), (5_000, 1, "b")] {
        let got = b.read_at(&root(), &hb, ino, 0, 400_000).await.unwrap();
        assert_bytes(&got, &model.0, "before the shrink");
        a.truncate(&root(), Some(&ha), ino, shrink_to)
            .await
            .unwrap();
        model.truncate(shrink_to);
        let (c, h) = if who == "a" { (&a, &ha) } else { (&b, &hb) };
        let attr = c
            .fallocate(&root(), h, ino, shrink_to, grow_by, FallocateMode::Allocate)
            .await
            .unwrap();
        model.truncate(shrink_to + grow_by);
        assert_eq!(attr.size, shrink_to + grow_by);
        for (name, c, h) in [("a", &a, &ha), ("b", &b, &hb)] {
            let got = c.read_at(&root(), h, ino, 0, 400_000).await.unwrap();
            assert_bytes(
                &got,
                &model.0,
                &format!(
                    "{name} after shrinking to {shrink_to} and fallocating {grow_by} by {who}"
                ),
            );
        }
    }
    a.close().await.unwrap();
    b.close().await.unwrap();
    srv.stop().await;
}
