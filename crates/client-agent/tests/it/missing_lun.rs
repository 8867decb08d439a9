//! Acceptance, missing LUN (issue 5): node B's agent (a real `sanfs-agent mount` in its own
//! network namespace) is not given LUN 3 (its device globs leave it out). B still writes and
//! reads correctly, its I/O on LUN 3 going through the server; node A (all LUNs, in-process)
//! reads B's data and B reads A's; and B reports the LUN missing: in `sanfs-agent status`
//! (text and JSON), in its metrics (`sanfs_agent_missing_luns`, `sanfs_agent_lun_usable`),
//! and in a WARN line of its log. Needs root and /dev/fuse.

use std::os::unix::fs::FileExt;

use sanfs_client_agent::client::DeviceHealth;
use sanfs_client_agent::control::MountStatus;
use sanfs_proto::types::{Credentials, ROOT_INODE};

use crate::cluster::rw;
use crate::san::{self, MIB, Rng, San, SanOptions, metric};

#[test]
fn a_node_without_one_lun_reads_and_writes_through_the_server_and_reports_it() {
    if !san::can_mount("the missing-LUN test") {
        return;
    }
    let san = San::start(SanOptions::default());
    let a = san.node(0, "full");
    let mut globs = san.globs();
    let hidden = globs.remove(3);
    let b = san.mount_agent(1, "partial", &globs, "");

    // B writes (small, unaligned and large), A checks; A writes, B checks.
    let mut rng = Rng::new(33);
    let sizes = [1usize, 4096, 100_000, 12 * MIB as usize];
    let mut written = 0u64;
    for (i, &len) in sizes.iter().enumerate() {
        let data = rng.bytes(len);
        let path = b.p(&format!("from-b-{i}"));
        let off = if i % 2 == 0 { 0 } else { 777 };
        let f = std::fs::File::create(&path).unwrap();
        f.write_all_at(&data, off).unwrap();
        drop(f);
        written += len as u64;
        let mut back = vec![0u8; len];
        std::fs::File::open(&path)
            .unwrap()
            .read_exact_at(&mut back, off)
            .unwrap();
        assert!(back == data, "B reads back its {len} bytes");
        let cred = Credentials::root();
        let name = format!("from-b-{i}");
        let got = a.run(move |c| async move {
            let attr = c.lookup(&cred, ROOT_INODE, name.as_str()).await.unwrap();
            let (fh, _) = c.open(&cred, attr.ino, rw()).await.unwrap();
            c.read_at(&cred, &fh, attr.ino, off, len as u64)
                .await
                .unwrap()
        });
        assert!(got == data, "A reads B's {len} bytes");
    }
    let from_a = rng.bytes(16 * MIB as usize);
    let (cred, d2) = (Credentials::root(), from_a.clone());
    a.run(move |c| async move {
        let f = c
            .create(&cred, ROOT_INODE, "from-a", 0o644, false, rw())
            .await
            .unwrap();
        c.write_at(&cred, &f.handle, f.attr.ino, 0, &d2)
            .await
            .unwrap();
    });
    let got = std::fs::read(b.p("from-a")).unwrap();
    assert!(got == from_a, "B reads A's 16 MiB");
    // Stripe-unit reads: those on LUNs 0 to 2 go direct even on B.
    let f = std::fs::File::open(b.p("from-a")).unwrap();
    for unit in 0..8u64 {
        let mut buf = vec![0u8; 65536];
        f.read_exact_at(&mut buf, unit * 65536).unwrap();
        let at = (unit * 65536) as usize;
        assert!(buf[..] == from_a[at..at + 65536]);
    }

    // status, text and JSON
    let mp = b.mount.to_str().unwrap();
    let out = san.cli(&["status", "--json", mp]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let st: MountStatus = serde_json::from_slice(&out.stdout).unwrap();
    let missing: Vec<_> = st.agent.missing().collect();
    assert_eq!(missing.len(), 1, "{:?}", st.agent.devices);
    assert_eq!(missing[0].index, 3);
    assert_eq!(missing[0].path, None);
    for d in &st.agent.devices[..3] {
        assert_eq!(d.state, DeviceHealth::Ok);
        assert!(d.path.is_some());
    }
    // Every byte B wrote went one way or the other; all of the 12 MiB write through the
    // server (each of its grants touches LUN 3).
    assert_eq!(
        st.agent.bytes.proxied_write + st.agent.bytes.direct_write,
        written,
        "{:?}",
        st.agent.bytes
    );
    assert!(
        st.agent.bytes.proxied_write >= 12 * MIB,
        "B's large write went through the server: {:?}",
        st.agent.bytes
    );
    assert!(st.agent.lease_valid && st.agent.session > 0);
    let text = san.cli(&["status", mp]);
    assert!(text.status.success());
    let text = String::from_utf8_lossy(&text.stdout).into_owned();
    eprintln!("missing LUN: sanfs-agent status says:\n{text}");
    assert!(
        text.contains("1 missing") && text.contains("MISSING"),
        "{text}"
    );
    let all = san.cli(&["status", "--json"]);
    let all: Vec<MountStatus> = serde_json::from_slice(&all.stdout).unwrap();
    assert!(
        all.iter().any(|m| m.mount_point == mp),
        "status without a mount point lists it"
    );

    // metrics
    let m = b.metrics_text();
    let missing_luns = metric(&m, "sanfs_agent_missing_luns", &[]);
    let usable3 = metric(&m, "sanfs_agent_lun_usable", &[("device", "3")]);
    let usable0 = metric(&m, "sanfs_agent_lun_usable", &[("device", "0")]);
    let proxied_w = metric(&m, "sanfs_agent_proxied_bytes_total", &[("op", "write")]);
    let proxied_r = metric(&m, "sanfs_agent_proxied_bytes_total", &[("op", "read")]);
    let direct_r = metric(&m, "sanfs_agent_direct_bytes_total", &[("op", "read")]);
    eprintln!(
        "missing LUN: metrics: missing_luns {missing_luns}, lun_usable 0:{usable0} 3:{usable3}, proxied read {proxied_r} write {proxied_w}, direct read {direct_r}"
    );
    assert_eq!(missing_luns, 1.0);
    assert_eq!(usable3, 0.0);
    assert_eq!(usable0, 1.0);
    assert!(proxied_w >= (12 * MIB) as f64);
    assert!(direct_r > 0.0, "reads on the LUNs B has go direct");
    assert!(
        m.contains("sanfs_agent_device_io_seconds_bucket"),
        "latency histograms"
    );

    // the log
    let log = b.log();
    let warn = log
        .lines()
        .find(|l| l.contains("WARN") && l.contains("not found on this node"));
    assert!(
        warn.is_some(),
        "a WARN line about the missing LUN in:\n{log}"
    );
    eprintln!(
        "missing LUN: {} hidden from B; log: {}",
        hidden,
        warn.unwrap_or_default().trim()
    );
}
