//! Acceptance, coherence (issue 5): node A writes, node B reads the range right after A's
//! write returned; iterations of mixed sizes (1 B to 1 MiB)
//! at mixed offsets, the roles swapping every iteration, on two nodes in two network
//! namespaces; zero stale reads. Every 16th iteration the reader also reads a 2 MiB window
//! around the write and compares it with the model, so that staleness next to the written
//! range (a cached read grant that outlived a recall) is caught too. Reads of 64 KiB and more
//! go direct, so the readers keep cached read grants that the writes must recall.
//!
//! The acceptance figure is 10,000 iterations (`SANFS_COHERENCE_ITERS=10000`, about 6 minutes
//! in a debug build on a loaded 2-core machine); CI runs 2,000 by default.

use std::time::Instant;

use sanfs_proto::types::{Credentials, ROOT_INODE};

use crate::cluster::rw;
use crate::san::{self, BLOCK, MIB, Pool, Rng, San, SanOptions, log_size};

const FILE_SIZE: u64 = 8 * MIB;
const MAX_IO: u64 = MIB;
const WINDOW: u64 = 2 * MIB;

#[test]
fn a_read_right_after_another_nodes_write_sees_it() {
    let iterations: u64 = std::env::var("SANFS_COHERENCE_ITERS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2_000);
    let seed = san::seed("coherence");
    let san = San::start(SanOptions::default());
    let nodes = [san.node(0, "coh-a"), san.node(1, "coh-b")];
    let cred = Credentials::root();
    let rw = rw();
    let c2 = cred.clone();
    let created = nodes[0]
        .run(move |c| async move {
            c.create(&c2, ROOT_INODE, "coherent", 0o644, false, rw)
                .await
        })
        .unwrap();
    let ino = created.attr.ino;
    let c2 = cred.clone();
    let fh_b = nodes[1].run(move |c| async move { c.open(&c2, ino, rw).await.unwrap().0 });
    let fhs = [created.handle, fh_b];
    let mut model = vec![0u8; FILE_SIZE as usize];
    let (c2, fh) = (cred.clone(), fhs[0]);
    let zeros = model.clone();
    nodes[0]
        .run(move |c| async move { c.write_at(&c2, &fh, ino, 0, &zeros).await })
        .unwrap();

    let mut rng = Rng::new(seed);
    let pool = Pool::new(&mut rng, 4 * MAX_IO as usize);
    let mut stale = 0u64;
    let mut reported = 0;
    let mut bytes = 0u64;
    let started = Instant::now();
    for i in 0..iterations {
        let (w, r) = if i % 2 == 0 { (0, 1) } else { (1, 0) };
        let len = log_size(&mut rng, MAX_IO);
        let mut off = rng.below(FILE_SIZE - len + 1);
        if rng.below(2) == 0 {
            off = off / BLOCK * BLOCK;
        }
        let data = pool.take(&mut rng, len as usize);
        model[off as usize..(off + len) as usize].copy_from_slice(&data);
        let (c2, fh) = (cred.clone(), fhs[w]);
        nodes[w]
            .run(move |c| async move { c.write_at(&c2, &fh, ino, off, &data).await })
            .unwrap_or_else(|e| panic!("iteration {i}: write {len} at {off}: {e}"));
        // Right after the write returned: the other node reads it.
        let (c2, fh) = (cred.clone(), fhs[r]);
        let (woff, wlen) = if i % 16 == 15 {
            let start = off.saturating_sub(WINDOW / 2) / BLOCK * BLOCK;
            (start, WINDOW.min(FILE_SIZE - start))
        } else {
            (off, len)
        };
        let got = nodes[r]
            .run(move |c| async move { c.read_at(&c2, &fh, ino, woff, wlen).await })
            .unwrap_or_else(|e| panic!("iteration {i}: read {wlen} at {woff}: {e}"));
        bytes += len + wlen;
        let want = &model[woff as usize..(woff + wlen) as usize];
        if got != want {
            stale += 1;
            if reported < 5 {
                reported += 1;
                let first = got.iter().zip(want).position(|(a, b)| a != b);
                eprintln!(
                    "coherence: STALE at iteration {i}: node {r} read {wlen} at {woff} after node {w} wrote {len} at {off}: first difference at {first:?} (got {} bytes)",
                    got.len()
                );
            }
        }
    }
    let elapsed = started.elapsed();
    let st: Vec<_> = nodes.iter().map(|n| n.client().status()).collect();
    eprintln!(
        "coherence: {iterations} iterations ({:.1} MiB) in {:.1} s ({:.2} ms each), {stale} stale reads; recalls answered A {} B {}, reads from cached grants A {} B {}",
        bytes as f64 / MIB as f64,
        elapsed.as_secs_f64(),
        elapsed.as_secs_f64() * 1000.0 / iterations.max(1) as f64,
        st[0].grants.recalls,
        st[1].grants.recalls,
        st[0].grants.cached_reads,
        st[1].grants.cached_reads
    );
    assert_eq!(stale, 0, "stale reads (seed {seed})");
    assert!(
        st[0].grants.recalls + st[1].grants.recalls > 0,
        "cached read grants were in play (recalled by the other node's writes)"
    );
}

/// A truncate that extends a file while another node's writes to it are held back (or their
/// completions in flight): the server locks the file's end, which recalls the other node's
/// delegation and layouts, and only then zeroes the old end-of-file block's tail, past the
/// end as it is after they were written (past the end it read before, it wiped the bytes
/// the recall wrote: the exerciser's seed 10933671707378236266 at op 26722). A write grant
/// past the end of file waits for the same recall and zeroes the same way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_extending_truncate_keeps_what_the_recall_it_waits_for_wrote() {
    use std::os::unix::fs::FileExt;
    if !crate::mount::can_mount() {
        return;
    }
    let srv = crate::cluster::start(10_000).await;
    let a = crate::mount::Mount::start(&srv, "trunc-a", "").await;
    let b = crate::mount::Mount::start(&srv, "trunc-b", "").await;
    let (pa, pb) = (a.p("f"), b.p("f"));
    let bad = crate::mount::timed(
        "writes held back, then another node's truncate",
        300,
        move || {
            let mut bad = Vec::new();
            for round in 0..20u8 {
                std::fs::write(&pa, b"abc").unwrap();
                let fb = std::fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .open(&pb)
                    .unwrap();
                let fa = std::fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .open(&pa)
                    .unwrap();
                // b's short write, then a's longer one over it (both small: held back).
                fb.write_all_at(&vec![0xb0 | (round & 0xf); 1_176], 0)
                    .unwrap();
                let data: Vec<u8> = (0..65_536u32).map(|i| (i % 251) as u8 ^ round).collect();
                fa.write_all_at(&data, 0).unwrap();
                // b extends the file (a truncate, or a long write past the end): what a
                // wrote must stay.
                if round % 2 == 0 {
                    fb.set_len(4_127_453 + u64::from(round)).unwrap();
                } else {
                    fb.write_all_at(&[7u8; 128 << 10], 1 << 20).unwrap();
                }
                let mut got = vec![0u8; 8_192];
                fb.read_exact_at(&mut got, 0).unwrap();
                if got[..] != data[..8_192] {
                    let first = got.iter().zip(&data).position(|(x, y)| x != y).unwrap();
                    bad.push(format!("round {round}: bytes differ from {first}"));
                }
            }
            bad
        },
    )
    .await;
    assert!(bad.is_empty(), "{bad:?}");
    drop(a);
    drop(b);
    srv.stop().await;
}
