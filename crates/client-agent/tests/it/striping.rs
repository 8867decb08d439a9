//! Acceptance, striping (issue 5): on a 4-LUN striped volume (64 KiB stripe unit) a 4 MiB
//! aligned read issues exactly one I/O per device (the engine counts ops and the requests it
//! hands the kernel per device: the sixteen stripe units each LUN holds are physically
//! contiguous there and go as one vectored I/O, the paper's method B), and the four are in the
//! kernel together (the engine's high-water mark of requests in flight, reset before the
//! read, reaches 4: no device waited for another). The reader is a fresh node, so nothing is
//! cached.

use std::time::Instant;

use sanfs_proto::types::{Credentials, ROOT_INODE};

use crate::cluster::rw;
use crate::san::{MIB, Rng, San, SanOptions};

#[test]
fn a_4_mib_aligned_read_issues_one_io_per_lun_all_in_flight_together() {
    let san = San::start(SanOptions {
        lun_size: 64 * MIB,
        ..SanOptions::default()
    });
    let (a, b) = (san.node(0, "stripe-w"), san.node(1, "stripe-r"));
    let cred = Credentials::root();
    let rw = rw();
    let data = Rng::new(4).bytes(4 * MIB as usize);
    let (c2, d2) = (cred.clone(), data.clone());
    let ino = a.run(move |c| async move {
        let f = c
            .create(&c2, ROOT_INODE, "striped", 0o644, false, rw)
            .await
            .unwrap();
        c.write_at(&c2, &f.handle, f.attr.ino, 0, &d2)
            .await
            .unwrap();
        f.attr.ino
    });
    let c2 = cred.clone();
    let layout = b.run(move |c| async move { c.bmap(&c2, ino).await.unwrap() });
    let reader = b.client();
    let luns = reader.volume().devices().len();
    assert_eq!(luns, 4);
    let c2 = cred.clone();
    let fh = b.run(move |c| async move { c.open(&c2, ino, rw).await.unwrap().0 });
    let before = reader.engine_stats();
    reader.reset_max_in_flight();
    let started = Instant::now();
    let c2 = cred.clone();
    let got = b.run(move |c| async move { c.read_at(&c2, &fh, ino, 0, 4 * MIB).await.unwrap() });
    let elapsed = started.elapsed();
    let after = reader.engine_stats();
    assert!(got == data, "the read returns what was written");
    eprintln!(
        "striping: 4 MiB read in {:.2} ms by the {} engine; layout {} pieces; requests in flight at once: {}",
        elapsed.as_secs_f64() * 1000.0,
        reader.status().engine,
        layout.entries.len(),
        after.max_in_flight
    );
    for d in 0..luns {
        let (x, y) = (&before.devices[d], &after.devices[d]);
        eprintln!(
            "striping: LUN {d}: {} read op(s), {} request(s) to the kernel, {} bytes",
            y.read_ops - x.read_ops,
            y.submissions - x.submissions,
            y.read_bytes - x.read_bytes
        );
        assert_eq!(y.read_ops - x.read_ops, 1, "one I/O on LUN {d}");
        assert_eq!(y.submissions - x.submissions, 1, "one request on LUN {d}");
        assert_eq!(y.read_bytes - x.read_bytes, MIB, "1 MiB from LUN {d}");
    }
    assert_eq!(
        after.max_in_flight, 4,
        "the four device reads were in flight together"
    );
}
