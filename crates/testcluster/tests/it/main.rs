//! The test SAN's parts, on the real machine: loop devices, namespaces joined by a bridge,
//! blkio throttles and child guards; each checks that what it made is gone afterwards.

#![allow(clippy::unwrap_used, reason = "tests")]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use sanfs_testcluster::{
    ChildGuard, LunKind, Luns, Need, Netns, Network, Throttle, skip_unless, skip_unless_root,
};

fn losetup_lists(dev: &Path) -> bool {
    let out = Command::new("losetup").arg("-a").output().unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .any(|l| l.starts_with(&format!("{}:", dev.display())))
}

fn netns_exists(name: &str) -> bool {
    Path::new("/run/netns").join(name).exists()
}

#[test]
fn file_luns_are_sparse_files_removed_on_drop() {
    let dir = tempfile::tempdir().unwrap();
    let luns = Luns::create(dir.path(), 3, 8 << 20, LunKind::File).unwrap();
    assert!(!luns.is_loop());
    assert_eq!(luns.paths(), luns.backing_files());
    for p in luns.paths() {
        assert_eq!(std::fs::metadata(p).unwrap().len(), 8 << 20);
    }
    let paths = luns.paths().to_vec();
    drop(luns);
    assert!(paths.iter().all(|p| !p.exists()));
}

#[test]
fn loop_luns_are_attached_with_direct_io_and_detached_on_drop() {
    if skip_unless("loop-device LUNs", &[Need::LoopDevices]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let luns = Luns::create(dir.path(), 2, 16 << 20, LunKind::Loop).unwrap();
    assert!(luns.is_loop());
    let devs = luns.paths().to_vec();
    for (dev, file) in devs.iter().zip(luns.backing_files()) {
        assert!(losetup_lists(dev), "{} attached", dev.display());
        let name = dev.file_name().unwrap().to_str().unwrap();
        let dio = std::fs::read_to_string(format!("/sys/block/{name}/loop/dio")).unwrap();
        assert_eq!(dio.trim(), "1", "{name} uses direct I/O");
        let backing =
            std::fs::read_to_string(format!("/sys/block/{name}/loop/backing_file")).unwrap();
        assert_eq!(Path::new(backing.trim()), file.as_path());
    }
    let files = luns.backing_files().to_vec();
    drop(luns);
    // A device name may be reused at once by a test running beside this one: what must be gone
    // is every attachment of our files.
    for entry in std::fs::read_dir("/sys/block").unwrap() {
        let backing = entry.unwrap().path().join("loop/backing_file");
        let Ok(text) = std::fs::read_to_string(&backing) else {
            continue;
        };
        // A deleted backing file reads as "<path> (deleted)".
        let still = files
            .iter()
            .find(|f| text.starts_with(&*f.to_string_lossy()));
        assert!(
            still.is_none(),
            "{} still attached: {}",
            text.trim(),
            backing.display()
        );
    }
}

#[test]
fn nodes_reach_the_server_over_the_bridge_and_only_there() {
    if skip_unless(
        "network namespaces",
        &[Need::Tool("ip"), Need::Tool("nsenter")],
    ) {
        return;
    }
    let net = Network::create(2).unwrap();
    assert!(net.is_isolated());
    let names: Vec<String> = std::iter::once(net.server())
        .chain((0..2).map(|i| net.node(i)))
        .map(|n| n.name().unwrap().to_owned())
        .collect();
    assert!(names.iter().all(|n| netns_exists(n)));

    // A server thread inside the server namespace, bound to its LAN address, answering each
    // connection with the address it came from.
    let addr = SocketAddr::new(net.server_ip(), 7777);
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let server = net
        .server()
        .run_thread("echo", move || {
            let l = TcpListener::bind(addr)?;
            ready_tx.send(())?;
            for _ in 0..2 {
                let (mut s, peer) = l.accept()?;
                s.write_all(peer.ip().to_string().as_bytes())?;
            }
            Ok(())
        })
        .unwrap();
    ready_rx.recv_timeout(Duration::from_secs(10)).unwrap();
    for i in 0..2 {
        let got = net
            .node(i)
            .run_thread("client", move || {
                let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
                let mut peer = String::new();
                s.read_to_string(&mut peer)?;
                Ok(peer)
            })
            .unwrap()
            .join()
            .unwrap()
            .unwrap();
        assert_eq!(
            got,
            net.node_ip(i).to_string(),
            "node {i} comes from its own address"
        );
    }
    server.join().unwrap().unwrap();
    // The LAN exists only inside the namespaces: the host has none of its addresses.
    let host = Command::new("ip")
        .args(["-o", "-4", "addr"])
        .output()
        .unwrap();
    let host = String::from_utf8_lossy(&host.stdout);
    assert!(
        !host.contains(&format!("{}/24", net.server_ip())),
        "host: {host}"
    );

    // wait_for_tcp sees a listener that comes up late.
    let late = SocketAddr::new(net.server_ip(), 7778);
    let listener = net
        .server()
        .run_thread("late", move || {
            std::thread::sleep(Duration::from_millis(200));
            let l = TcpListener::bind(late)?;
            let _ = l.accept()?;
            Ok(())
        })
        .unwrap();
    net.node(0)
        .wait_for_tcp(late, Duration::from_secs(10))
        .unwrap();
    listener.join().unwrap().unwrap();

    let ip_out = net
        .node(1)
        .command("ip")
        .args(["-o", "-4", "addr"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&ip_out.stdout);
    assert!(
        text.contains(&format!("{}/24", net.node_ip(1))),
        "node 1's address: {text}"
    );
    assert!(
        !text.contains(&net.node_ip(0).to_string()),
        "node 0's address is not node 1's"
    );

    drop(net);
    assert!(names.iter().all(|n| !netns_exists(n)), "namespaces deleted");
}

#[test]
fn a_mount_made_inside_a_node_namespace_is_visible_on_the_host() {
    if skip_unless_root("network namespaces and mounts") {
        return;
    }
    let ns = Netns::create("mnt").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let status = ns
        .command("mount")
        .args(["-t", "tmpfs", "sanfs-testcluster-tmpfs"])
        .arg(dir.path())
        .status()
        .unwrap();
    assert!(status.success());
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap();
    let visible = mounts
        .lines()
        .any(|l| l.contains(&format!(" {} tmpfs", dir.path().display())));
    let _ = Command::new("umount").arg(dir.path()).status();
    assert!(visible, "the mount is in the host's mount namespace");
}

#[test]
fn a_throttled_process_is_accounted_to_its_cgroup() {
    if skip_unless("blkio throttles on loop devices", &[Need::LoopDevices]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let luns = Luns::create(dir.path(), 1, 16 << 20, LunKind::Loop).unwrap();
    let dev = &luns.paths()[0];
    let throttle = Throttle::create("thr", &[(dev.as_path(), 64 << 20, 32 << 20)]).unwrap();
    let caps =
        std::fs::read_to_string(throttle.path().join("blkio.throttle.read_bps_device")).unwrap();
    assert!(
        caps.contains(&(64u64 << 20).to_string()),
        "read cap set: {caps}"
    );

    // A reader that waits until it is in the cgroup (it reads its own cgroup file first).
    let script = format!(
        "while ! grep -q '{}' /proc/self/cgroup; do sleep 0.01; done; \
         dd if={} of=/dev/null bs=1M count=4 iflag=direct status=none",
        throttle.path().file_name().unwrap().to_str().unwrap(),
        dev.display()
    );
    let mut child = ChildGuard::spawn(Command::new("sh").args(["-c", &script])).unwrap();
    throttle.add_pid(child.pid()).unwrap();
    let status = child
        .wait_timeout(Duration::from_secs(60))
        .unwrap()
        .unwrap();
    assert!(status.success());
    let serviced =
        std::fs::read_to_string(throttle.path().join("blkio.throttle.io_service_bytes")).unwrap();
    let read: u64 = serviced
        .lines()
        .filter(|l| l.ends_with(" Read") || l.split_whitespace().nth(1) == Some("Read"))
        .filter_map(|l| l.split_whitespace().nth(2)?.parse::<u64>().ok())
        .sum();
    assert!(
        read >= 4 << 20,
        "4 MiB read accounted to the cgroup: {serviced}"
    );
    let cg = throttle.path().to_owned();
    drop(throttle);
    assert!(!cg.exists(), "cgroup removed");
}

#[test]
fn a_child_guard_kills_and_reaps() {
    let mut child = ChildGuard::spawn(Command::new("sleep").arg("100")).unwrap();
    assert!(child.try_wait().unwrap().is_none());
    let status = child.kill9().unwrap();
    assert_eq!(status.signal(), Some(9));

    let mut polite = ChildGuard::spawn(Command::new("sleep").arg("100")).unwrap();
    let status = polite.terminate(Duration::from_secs(5)).unwrap();
    assert_eq!(status.signal(), Some(15));

    let pid = {
        let g = ChildGuard::spawn(Command::new("sleep").arg("100")).unwrap();
        g.pid()
    };
    assert!(
        !Path::new(&format!("/proc/{pid}")).exists(),
        "a dropped guard's child is gone"
    );
}

/// Whether the process `pid` still exists (a zombie counts as gone).
fn process_runs(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        !s.rsplit(')')
            .next()
            .unwrap_or("")
            .trim_start()
            .starts_with('Z')
    })
}

/// The pids of the etcd processes whose command line names `dir`.
fn etcd_pids_in(dir: &Path) -> Vec<u32> {
    let needle = dir.display().to_string();
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| {
                let c = String::from_utf8_lossy(&c);
                let argv0 = c.split('\0').next().unwrap_or("");
                Path::new(argv0).file_name().is_some_and(|n| n == "etcd") && c.contains(&needle)
            })
        })
        .filter(|&pid| process_runs(pid))
        .collect()
}

#[test]
fn an_etcd_member_rejoins_and_the_cluster_kills_exactly_its_members_on_drop() {
    if skip_unless("the etcd cluster test", &[Need::Tool("etcd")]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut etcd = sanfs_testcluster::EtcdCluster::start(dir.path(), 3).unwrap();
    let endpoints = etcd.endpoints();
    assert_eq!(endpoints.len(), 3);
    let mut unique = endpoints.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(unique.len(), 3, "{endpoints:?}");
    assert!(endpoints.iter().all(|e| e.starts_with("http://127.0.0.1:")));
    assert_eq!(etcd_pids_in(dir.path()).len(), 3);

    // One member lost: the other two keep a quorum.
    etcd.stop_member(2).unwrap();
    assert_eq!(etcd_pids_in(dir.path()).len(), 2);
    let port: u16 = endpoints[2].rsplit(':').next().unwrap().parse().unwrap();
    assert!(TcpStream::connect(("127.0.0.1", port)).is_err());
    etcd.wait_healthy(0, Duration::from_secs(30)).unwrap();
    // It comes back on its data directory and ports and rejoins.
    etcd.start_member(2).unwrap();
    etcd.wait_healthy(2, Duration::from_secs(30)).unwrap();
    assert!(etcd.log(2).contains(&format!("127.0.0.1:{port}")));
    assert!(
        etcd.start_member(2).is_err(),
        "a running member started twice"
    );

    drop(etcd);
    assert!(
        etcd_pids_in(dir.path()).is_empty(),
        "etcd members outlive their cluster"
    );
}
