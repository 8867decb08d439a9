//! Acceptance, end to end on two nodes (issue 5): agents in two network namespaces write and
//! read shared files with random sizes (1 B to 8 MiB) and offsets; every byte read matches a
//! model; afterwards every file is rebuilt from the raw LUNs at the offsets `bmap` reports
//! (the real `sanfs-agent bmap --json` on a FUSE mount when root, else the library call it
//! uses) and must equal the model; and the server's `sanfs_proxied_bytes_total` grew by
//! exactly what the routing rule sends proxied, computed here from the rule.
//!
//! The bytes moved are `SANFS_E2E_BYTES` (default 256 MiB; the acceptance figure is 1 GiB:
//! `SANFS_E2E_BYTES=1073741824`). Seeded (`SANFS_SEED`), the seed printed.

use std::time::Instant;

use sanfs_client_agent::client::{BmapEntry, ByteCounts};
use sanfs_proto::types::{Credentials, ROOT_INODE};

use crate::cluster::rw;
use crate::san::{
    self, BLOCK, MIB, Pool, Rng, San, SanOptions, THRESHOLD, log_size, metric, read_raw,
};

const FILES: usize = 3;
/// Offsets stay below this (reads may start past the end of file).
const SPAN: u64 = 48 * MIB;
const MAX_IO: u64 = 8 * MIB;
const DEFAULT_BYTES: u64 = 256 * MIB;

/// The routing rule as docs/protocol.md states it, written out independently of the client:
/// an I/O shorter than the threshold goes through the server; a longer one sends its unaligned
/// head (up to the first block boundary) and tail (after the last one) through the server and
/// the aligned middle directly, unless that middle is itself shorter than the threshold, in
/// which case all of it goes through the server. Returns (head end, middle end) for a split
/// I/O.
fn direct_middle(off: u64, len: u64) -> Option<(u64, u64)> {
    let end = off + len;
    if len < THRESHOLD {
        return None;
    }
    let first_boundary = off.div_ceil(BLOCK) * BLOCK;
    let last_boundary = end / BLOCK * BLOCK;
    if last_boundary <= first_boundary || last_boundary - first_boundary < THRESHOLD {
        return None;
    }
    Some((first_boundary, last_boundary))
}

/// Bytes a write of `len` at `off` sends through the server.
fn proxied_write_bytes(off: u64, len: u64) -> u64 {
    match direct_middle(off, len) {
        None => len,
        Some((h, m)) => (h - off) + (off + len - m),
    }
}

/// Bytes a read of `len` at `off` of a file of `size` bytes gets through the server: the
/// server returns only bytes before end of file, and a read that ends early (at end of file)
/// issues nothing after that point.
fn proxied_read_bytes(off: u64, len: u64, size: u64) -> u64 {
    let end = off + len;
    let seen = |a: u64, b: u64| b.min(size).saturating_sub(a);
    match direct_middle(off, len) {
        None => seen(off, end),
        Some((h, m)) if size < m => seen(off, h),
        Some((h, m)) => seen(off, h) + seen(m, end),
    }
}

#[test]
fn routing_model_examples() {
    // A check of the test's own model against hand-worked cases.
    assert_eq!(proxied_write_bytes(0, 1), 1);
    assert_eq!(proxied_write_bytes(0, THRESHOLD), 0);
    assert_eq!(
        proxied_write_bytes(1, THRESHOLD),
        THRESHOLD,
        "middle too short"
    );
    assert_eq!(proxied_write_bytes(100, 2 * THRESHOLD), BLOCK, "3996 + 100");
    assert_eq!(proxied_read_bytes(100, 2 * THRESHOLD, 0), 0);
    assert_eq!(proxied_read_bytes(100, 2 * THRESHOLD, 50), 0);
    assert_eq!(proxied_read_bytes(100, 2 * THRESHOLD, 200), 100);
    assert_eq!(
        proxied_read_bytes(100, 2 * THRESHOLD, BLOCK + 1),
        BLOCK - 100
    );
    assert_eq!(
        proxied_read_bytes(100, 2 * THRESHOLD, 10 * THRESHOLD),
        BLOCK
    );
    assert_eq!(
        proxied_read_bytes(4000, 2 * THRESHOLD + 200, 10 * THRESHOLD),
        96 + 104
    );
}

struct Figures {
    ops: u64,
    read_bytes: u64,
    write_bytes: u64,
    expect_proxied_read: u64,
    expect_proxied_write: u64,
}

#[test]
fn two_nodes_random_io_matches_model_luns_and_proxied_counter() {
    let budget: u64 = std::env::var("SANFS_E2E_BYTES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(DEFAULT_BYTES);
    let seed = san::seed("e2e");
    let san = San::start(SanOptions::default());
    let nodes = [san.node(0, "e2e-a"), san.node(1, "e2e-b")];
    let cred = Credentials::root();
    let rw = rw();
    // Shared files: created on node A, opened on both.
    let mut inos = Vec::new();
    let mut handles = [Vec::new(), Vec::new()];
    for f in 0..FILES {
        let (cred2, name) = (cred.clone(), format!("shared{f}"));
        let created = nodes[0].run(move |c| async move {
            c.create(&cred2, ROOT_INODE, &name, 0o644, false, rw).await
        });
        let created = created.unwrap();
        inos.push(created.attr.ino);
        handles[0].push(created.handle);
        let (cred2, ino) = (cred.clone(), created.attr.ino);
        handles[1]
            .push(nodes[1].run(move |c| async move { c.open(&cred2, ino, rw).await.unwrap().0 }));
    }
    let before = san.server_metrics();
    let base_read = metric(&before, "sanfs_proxied_bytes_total", &[("op", "read")]);
    let base_write = metric(&before, "sanfs_proxied_bytes_total", &[("op", "write")]);

    let mut rng = Rng::new(seed);
    let pool = Pool::new(&mut rng, 2 * MAX_IO as usize);
    // The files' bytes (zeros past the end of file) and sizes.
    let mut model: Vec<Vec<u8>> = vec![vec![0u8; SPAN as usize]; FILES];
    let mut sizes = [0u64; FILES];
    let mut fig = Figures {
        ops: 0,
        read_bytes: 0,
        write_bytes: 0,
        expect_proxied_read: 0,
        expect_proxied_write: 0,
    };
    let started = Instant::now();
    while fig.read_bytes + fig.write_bytes < budget {
        let n = rng.below(2) as usize;
        let f = rng.below(FILES as u64) as usize;
        let len = log_size(&mut rng, MAX_IO);
        let write = sizes[f] == 0 || rng.below(2) == 0;
        let limit = if write { SPAN - len } else { SPAN };
        let mut off = rng.below(limit + 1);
        if rng.below(3) == 0 {
            off = off / BLOCK * BLOCK;
        }
        let (ino, fh, cred2) = (inos[f], handles[n][f], cred.clone());
        fig.ops += 1;
        if write {
            let data = pool.take(&mut rng, len as usize);
            let end = off + len;
            sizes[f] = sizes[f].max(end);
            model[f][off as usize..end as usize].copy_from_slice(&data);
            fig.expect_proxied_write += proxied_write_bytes(off, len);
            fig.write_bytes += len;
            nodes[n]
                .run(move |c| async move { c.write_at(&cred2, &fh, ino, off, &data).await })
                .unwrap_or_else(|e| {
                    panic!("op {}: write {len} at {off} on node {n}: {e}", fig.ops)
                });
        } else {
            let size = sizes[f];
            // Under the file's attribute lease (after the node's own write, say) the node
            // knows the size exactly and reads only up to it, split as that shorter read.
            fig.expect_proxied_read += match nodes[n].client().leased_size(ino) {
                Some(known) => {
                    assert_eq!(known, size, "op {}: node {n}'s leased size", fig.ops);
                    proxied_read_bytes(off, len.min(size.saturating_sub(off)), size)
                }
                None => proxied_read_bytes(off, len, size),
            };
            let got = nodes[n]
                .run(move |c| async move { c.read_at(&cred2, &fh, ino, off, len).await })
                .unwrap_or_else(|e| panic!("op {}: read {len} at {off} on node {n}: {e}", fig.ops));
            let from = (off.min(size)) as usize;
            let to = ((off + len).min(size)) as usize;
            fig.read_bytes += got.len() as u64;
            if got[..] != model[f][from..to] {
                let first = got
                    .iter()
                    .zip(&model[f][from..to])
                    .position(|(a, b)| a != b);
                panic!(
                    "op {}: node {n} read {len} at {off} of file {f} (size {size}): got {} bytes, want {}; first difference at {first:?} (seed {seed})",
                    fig.ops,
                    got.len(),
                    to - from
                );
            }
        }
    }
    let elapsed = started.elapsed();
    let after = san.server_metrics();
    let proxied_read = metric(&after, "sanfs_proxied_bytes_total", &[("op", "read")]) - base_read;
    let proxied_write =
        metric(&after, "sanfs_proxied_bytes_total", &[("op", "write")]) - base_write;
    let stats: Vec<_> = nodes.iter().map(|n| n.client().status()).collect();
    eprintln!(
        "e2e: {} ops, {:.1} MiB read + {:.1} MiB written in {:.1} s ({:.1} MiB/s)",
        fig.ops,
        fig.read_bytes as f64 / MIB as f64,
        fig.write_bytes as f64 / MIB as f64,
        elapsed.as_secs_f64(),
        (fig.read_bytes + fig.write_bytes) as f64 / MIB as f64 / elapsed.as_secs_f64()
    );
    for (i, s) in stats.iter().enumerate() {
        eprintln!(
            "e2e: node {i}: direct read {} write {}; proxied read {} write {}; grants read {} write {}, cached reads {}, recalls {}",
            s.bytes.direct_read,
            s.bytes.direct_write,
            s.bytes.proxied_read,
            s.bytes.proxied_write,
            s.grants.read,
            s.grants.write,
            s.grants.cached_reads,
            s.grants.recalls
        );
    }
    eprintln!(
        "e2e: server proxied bytes: read {proxied_read} (rule: {}), write {proxied_write} (rule: {})",
        fig.expect_proxied_read, fig.expect_proxied_write
    );
    assert_eq!(
        proxied_read as u64, fig.expect_proxied_read,
        "proxied read bytes"
    );
    assert_eq!(
        proxied_write as u64, fig.expect_proxied_write,
        "proxied write bytes"
    );
    let total = |f: fn(&ByteCounts) -> u64| stats.iter().map(|s| f(&s.bytes)).sum::<u64>();
    assert_eq!(
        total(|b| b.proxied_read + b.proxied_write),
        fig.expect_proxied_read + fig.expect_proxied_write,
        "the nodes' own proxied counters"
    );
    let direct = total(|b| b.direct_read + b.direct_write);
    assert!(
        direct > fig.read_bytes.min(fig.write_bytes),
        "most bytes go direct: {direct}"
    );

    // The layouts: from the real command line on a mount of node A when possible.
    let library: Vec<Vec<BmapEntry>> = inos
        .iter()
        .map(|&ino| {
            let cred2 = cred.clone();
            nodes[0]
                .run(move |c| async move { c.bmap(&cred2, ino).await })
                .unwrap()
                .entries
        })
        .collect();
    let layouts = if san::can_mount("bmap through the command line") {
        let agent = san.mount_agent(0, "e2e-bmap", &san.globs(), "");
        let from_cli: Vec<Vec<BmapEntry>> = (0..FILES)
            .map(|f| {
                let path = agent.p(&format!("shared{f}"));
                let out = san.cli(&["bmap", "--json", path.to_str().unwrap()]);
                assert!(
                    out.status.success(),
                    "bmap: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
                serde_json::from_slice(&out.stdout).unwrap()
            })
            .collect();
        assert_eq!(
            from_cli, library,
            "the command line shows what the library sees"
        );
        let text = san.cli(&["bmap", agent.p("shared0").to_str().unwrap()]);
        assert!(text.status.success());
        let text = String::from_utf8_lossy(&text.stdout);
        eprintln!("e2e: sanfs-agent bmap (first lines):");
        for line in text.lines().take(5) {
            eprintln!("  {line}");
        }
        from_cli
    } else {
        library
    };
    let mut pieces = 0usize;
    for (f, entries) in layouts.iter().enumerate() {
        rebuild_from_luns(&san, f, entries, &model[f][..sizes[f] as usize]);
        pieces += entries.len();
    }
    eprintln!(
        "e2e: {pieces} device pieces in {FILES} files; every file rebuilt from the raw LUNs equals the model"
    );
}

/// Rebuilds a file from the raw LUN bytes at its layout's offsets and compares it with the
/// model: written pieces hold the data, unwritten pieces and holes read as zeros.
fn rebuild_from_luns(san: &San, f: usize, entries: &[BmapEntry], model: &[u8]) {
    let size = model.len() as u64;
    let mut rebuilt = vec![0u8; model.len()];
    for e in entries {
        assert!(
            e.file_off % BLOCK == 0 && e.len % BLOCK == 0 && e.phys_off % BLOCK == 0,
            "{e:?}"
        );
        if e.state != "written" || e.file_off >= size {
            continue;
        }
        let path = e.device_path.as_deref().expect("every LUN is on node A");
        assert!(
            san.luns.paths().iter().any(|p| p.to_str() == Some(path)),
            "{path} is one of the cluster's LUNs"
        );
        let raw = read_raw(std::path::Path::new(path), e.phys_off, e.len);
        let n = e.len.min(size - e.file_off) as usize;
        let at = e.file_off as usize;
        rebuilt[at..at + n].copy_from_slice(&raw[..n]);
    }
    if rebuilt != model {
        let first = rebuilt.iter().zip(model).position(|(a, b)| a != b);
        panic!("file {f}: the raw LUNs differ from the model, first at byte {first:?}");
    }
}
