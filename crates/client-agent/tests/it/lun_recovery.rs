//! A LUN poisoned by a failed write comes back: the client's health task probes it again
//! after `device_retry` (doubling while probes fail), finds it by its label identity, opens
//! it afresh, and direct I/O on it resumes; while it is poisoned (and while a probe cannot
//! find it) its I/O goes through the server and succeeds.

use std::time::{Duration, Instant};

use sanfs_blockmap::volume::DeviceIndex;
use sanfs_client_agent::client::{Client, DeviceHealth, FaultInjection};

use crate::cluster::{self, MIB, assert_bytes, create, open, root};

async fn wait_for(c: &Client, d: DeviceIndex, want: DeviceHealth, within: Duration) -> Duration {
    let started = Instant::now();
    while c.device_health(d) != want {
        assert!(
            started.elapsed() < within,
            "LUN {d} still {:?} after {within:?}",
            c.device_health(d)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    started.elapsed()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poisoned_lun_is_probed_and_reopened_and_direct_io_resumes() {
    let srv = cluster::start(10_000).await;
    let a = srv.client("a").await;
    // Node C opened LUN 1 read-only (its writes there fail as on a failing path).
    let mut config = srv.config("c");
    config.faults = FaultInjection {
        read_only_devices: vec![DeviceIndex(1)],
        ..FaultInjection::default()
    };
    config.device_retry = Duration::from_millis(300);
    let c = Client::connect(config).await.unwrap();
    let lun1 = DeviceIndex(1);
    let (ino, hc) = create(&c, "recover").await;
    let ha = open(&a, ino).await;
    let data = vec![0x5au8; 4 * MIB as usize];
    let err = c
        .write_at(&root(), &hc, ino, 0, &data)
        .await
        .expect_err("the write on the read-only handle fails");
    assert_eq!(err.errno(), libc::EIO);
    assert_eq!(c.device_health(lun1), DeviceHealth::Poisoned);
    // While poisoned, and while the probe cannot find the LUN, its I/O goes through the server.
    let lun_path = srv.luns[1].clone();
    let away = lun_path.with_extension("away");
    std::fs::rename(&lun_path, &away).unwrap();
    c.write_at(&root(), &hc, ino, 0, &data).await.unwrap();
    let proxied = c.status().bytes.proxied_write;
    assert!(proxied >= MIB, "LUN 1's share went proxied: {proxied}");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(
        c.device_health(lun1),
        DeviceHealth::Poisoned,
        "probes fail while the LUN cannot be found"
    );
    std::fs::rename(&away, &lun_path).unwrap();
    // Probes back off (300 ms doubling): well within 20 s it is back.
    let took = wait_for(&c, lun1, DeviceHealth::Ok, Duration::from_secs(20)).await;
    let st = c.status();
    eprintln!(
        "lun recovery: LUN 1 back {} ms after it was reachable again; recoveries {}",
        took.as_millis(),
        st.device_recoveries
    );
    assert_eq!(st.device_recoveries, 1);
    // Direct writes reach LUN 1 again, through the new read-write handle.
    let before = c.engine_stats().devices[1];
    let data2 = vec![0xc3u8; 4 * MIB as usize];
    c.write_at(&root(), &hc, ino, 0, &data2).await.unwrap();
    let after = c.engine_stats().devices[1];
    assert!(
        after.write_ops > before.write_ops && after.write_bytes - before.write_bytes >= MIB,
        "direct writes on LUN 1 again: {before:?} -> {after:?}"
    );
    assert_eq!(c.device_health(lun1), DeviceHealth::Ok);
    let got = a.read_at(&root(), &ha, ino, 0, 4 * MIB).await.unwrap();
    assert_bytes(&got, &data2, "after recovery");
    a.close().await.unwrap();
    c.close().await.unwrap();
    srv.stop().await;
}
