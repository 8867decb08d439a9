//! Online growth of the volume (issue 22): LUNs added to a mounted striped volume with
//! `GrowVolume` (the admin library behind `sanfs-admin grow`), under a writer. Files written
//! before, during and after the growth read back byte-exact; the allocator uses the new space
//! at once (a file larger than the old free space lands on the new LUNs, as `bmap` shows);
//! statfs shows the new capacity; an agent connected before the growth learns of it when a
//! grant names a LUN it does not know, and then reads the new LUNs directly; an agent that
//! could not see a LUN at connect (nor one of the added ones) finds them by its periodic
//! rescan once they appear under its globs. LUNs are loop devices as root, files otherwise.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use sanfs_blockmap::volume::{DeviceIndex, Volume};
use sanfs_client_agent::admin::Admin;
use sanfs_client_agent::client::{Client, ClientConfig, DeviceHealth};
use sanfs_client_agent::engine::{EngineConfig, EngineKind};
use sanfs_mds::clock::Clock;
use sanfs_mds::store::Backend;
use sanfs_proto::model::GrowLayout;
use sanfs_proto::types::{InodeId, ROOT_INODE};
use sanfs_testcluster::mds;
use sanfs_testcluster::{LunKind, Luns};

use crate::cluster::{MIB, Rng, assert_bytes, create, open, root};

const LUN_SIZE: u64 = 16 * MIB;
const STRIPE_UNIT: u64 = 64 * 1024;

fn globs(paths: &[PathBuf]) -> Vec<String> {
    paths
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect()
}

fn config(server: &str, name: &str, globs: Vec<String>) -> ClientConfig {
    let mut c = ClientConfig::new(server.to_owned(), globs);
    c.client_name = name.to_owned();
    c.engine = EngineConfig {
        kind: EngineKind::Auto,
        queue_depth_per_device: 8,
    };
    c
}

async fn write_file(c: &Client, name: &str, data: &[u8]) -> InodeId {
    let (ino, fh) = create(c, name).await;
    for (i, chunk) in data.chunks(MIB as usize).enumerate() {
        c.write_at(&root(), &fh, ino, i as u64 * MIB, chunk)
            .await
            .unwrap_or_else(|e| panic!("write {name} at {i} MiB: {e}"));
    }
    c.fsync(&root(), &fh, ino, false).await.unwrap();
    ino
}

async fn read_file(c: &Client, ino: InodeId, len: u64) -> Vec<u8> {
    let fh = open(c, ino).await;
    c.read_at(&root(), &fh, ino, 0, len).await.unwrap()
}

/// The device indexes a file's `bmap` names, by UUID against `volume`.
async fn devices_used(c: &Client, ino: InodeId, volume: &Volume) -> Vec<u32> {
    let map = c.bmap(&root(), ino).await.unwrap();
    let mut used: Vec<u32> = map
        .entries
        .iter()
        .map(|e| {
            let i = volume
                .devices()
                .iter()
                .position(|d| d.uuid.to_string() == e.device_uuid)
                .unwrap_or_else(|| panic!("bmap names {} outside the volume", e.device_uuid));
            i as u32
        })
        .collect();
    used.sort_unstable();
    used.dedup();
    used
}

async fn wait_health(c: &Client, d: DeviceIndex, want: DeviceHealth, within: Duration) {
    let started = Instant::now();
    while c.device_health(d) != want {
        assert!(
            started.elapsed() < within,
            "LUN {d} still {:?} after {within:?}",
            c.device_health(d)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn luns_added_while_mounted_are_used_at_once_by_every_agent() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("old")).unwrap();
    std::fs::create_dir(dir.path().join("new")).unwrap();
    std::fs::create_dir(dir.path().join("links")).unwrap();
    let old = Luns::create(&dir.path().join("old"), 2, LUN_SIZE, LunKind::Auto).unwrap();
    let new = Luns::create(&dir.path().join("new"), 2, LUN_SIZE, LunKind::Auto).unwrap();
    eprintln!("grow test: loop devices: {}", old.is_loop());
    let backend = Backend::File(dir.path().join("mds.redb"));
    mds::format(
        &mds::striped(old.paths(), 4096, STRIPE_UNIT),
        &backend,
        &Clock::System,
    )
    .unwrap();
    let opts = mds::serve_options(
        "127.0.0.1:0".parse().unwrap(),
        backend,
        old.paths().to_vec(),
    );
    let mut serving = mds::spawn_serve(&tokio::runtime::Handle::current(), opts, Clock::System);
    let server = serving.listening().await.unwrap().to_string();
    let all: Vec<PathBuf> = old.paths().iter().chain(new.paths()).cloned().collect();

    // A: every LUN, old and new, under its globs. B: the same, connected before the growth
    // and never told. C: old LUN 0 and new LUN 0 only, plus a directory of links that is
    // empty at connect; it rescans every second.
    let a = Client::connect(config(&server, "a", globs(&all)))
        .await
        .unwrap();
    let b = Client::connect(config(&server, "b", globs(&all)))
        .await
        .unwrap();
    let links = dir.path().join("links");
    let mut c_config = config(
        &server,
        "c",
        vec![
            old.paths()[0].to_string_lossy().into_owned(),
            new.paths()[0].to_string_lossy().into_owned(),
            format!("{}/*", links.display()),
        ],
    );
    c_config.rescan_interval = Duration::from_secs(1);
    let c = Client::connect(c_config).await.unwrap();
    assert_eq!(c.device_health(DeviceIndex(1)), DeviceHealth::Missing);

    let old_volume = a.volume();
    let old_stat = a.statfs(&root(), ROOT_INODE).await.unwrap();
    assert_eq!(old_stat.total_blocks, old_volume.size_blocks());

    // Before: most of the old volume (30 MiB) used.
    let mut rng = Rng::new(22);
    let before = rng.bytes(16 * MIB as usize);
    let before_ino = write_file(&a, "before", &before).await;

    // During: a writer overwrites a 4 MiB file round after round while the volume grows.
    let (busy_ino, busy_fh) = create(&a, "busy").await;
    let a = Arc::new(a);
    let stop = Arc::new(AtomicBool::new(false));
    let rounds = Arc::new(AtomicU64::new(0));
    let writer = {
        let (a, stop, rounds) = (a.clone(), stop.clone(), rounds.clone());
        tokio::spawn(async move {
            let mut round = 0u64;
            while !stop.load(Ordering::SeqCst) || round < 3 {
                round += 1;
                let data = busy_round(round);
                for (i, chunk) in data.chunks(MIB as usize).enumerate() {
                    a.write_at(&root(), &busy_fh, busy_ino, i as u64 * MIB, chunk)
                        .await
                        .unwrap_or_else(|e| panic!("busy round {round}: {e}"));
                }
                a.fsync(&root(), &busy_fh, busy_ino, true).await.unwrap();
                rounds.store(round, Ordering::SeqCst);
            }
            round
        })
    };
    wait_rounds(&rounds, 1, &writer).await;

    // The growth: the two new LUNs as a stripe set.
    let admin = Admin::connect(&server, None).await.unwrap();
    let grown = admin
        .grow(
            globs(new.paths()),
            GrowLayout::Striped {
                stripe_unit: STRIPE_UNIT,
            },
            false,
        )
        .await
        .unwrap();
    let volume = grown.volume.volume.clone();
    assert_eq!(grown.old_size_bytes, old_volume.size_bytes());
    assert_eq!(volume.devices().len(), 4);
    volume.check_grows(&old_volume).unwrap();
    // The same LUNs again are refused, and nothing changes.
    let again = admin
        .grow(globs(&new.paths()[..1]), GrowLayout::Linear, true)
        .await
        .expect_err("a LUN of the volume is not added twice");
    assert!(format!("{again:#}").contains("already LUN"), "{again:#}");

    // statfs shows the new capacity at once.
    let stat = a.statfs(&root(), ROOT_INODE).await.unwrap();
    assert_eq!(stat.total_blocks, volume.size_blocks());
    assert_eq!(
        stat.total_blocks - old_stat.total_blocks,
        (volume.size_bytes() - old_volume.size_bytes()) / 4096
    );

    // The writer goes on a little, then stops.
    let at_growth = rounds.load(Ordering::SeqCst);
    wait_rounds(&rounds, at_growth + 2, &writer).await;
    stop.store(true, Ordering::SeqCst);
    let last_round = writer.await.unwrap();

    // After: a file larger than the old free space: on the new LUNs.
    a.rescan().await.unwrap();
    assert_eq!(a.volume().devices().len(), 4);
    let after = rng.bytes(20 * MIB as usize);
    let after_ino = write_file(&a, "after", &after).await;
    let used = devices_used(&a, after_ino, &volume).await;
    assert!(
        used.contains(&2) && used.contains(&3),
        "the new LUNs hold part of the file: {used:?}"
    );
    for d in [2, 3] {
        assert_eq!(a.device_health(DeviceIndex(d)), DeviceHealth::Ok);
        assert!(
            a.engine_stats().devices[d as usize].write_bytes > 0,
            "A wrote LUN {d} directly"
        );
    }

    // Every file reads back byte-exact through A.
    assert_bytes(
        &read_file(&a, before_ino, before.len() as u64).await,
        &before,
        "before",
    );
    assert_bytes(
        &read_file(&a, busy_ino, 4 * MIB).await,
        &busy_round(last_round),
        "busy",
    );
    assert_bytes(
        &read_file(&a, after_ino, after.len() as u64).await,
        &after,
        "after",
    );

    // B never asked: its first read of the new LUNs goes through the server and makes it
    // read the volume again; then it reads them directly.
    assert_eq!(b.volume().devices().len(), 2);
    assert_bytes(
        &read_file(&b, after_ino, after.len() as u64).await,
        &after,
        "after, B's first read",
    );
    let started = Instant::now();
    while b.volume().devices().len() != 4 {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "B did not take up the grown volume"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for d in [2, 3] {
        wait_health(
            &b,
            DeviceIndex(d),
            DeviceHealth::Ok,
            Duration::from_secs(10),
        )
        .await;
    }
    let direct_before = b.engine_stats().devices[2].read_bytes;
    assert_bytes(
        &read_file(&b, after_ino, after.len() as u64).await,
        &after,
        "after, B again",
    );
    assert!(
        b.engine_stats().devices[2].read_bytes > direct_before,
        "B reads new LUN 2 directly"
    );
    assert_bytes(
        &read_file(&b, before_ino, before.len() as u64).await,
        &before,
        "before, B",
    );
    let b_map = devices_used(&b, after_ino, &volume).await;
    assert_eq!(b_map, used, "B's bmap of the file");

    // C: new LUN 0 found by its own rescan (it is under its globs); old LUN 1 and new LUN 1
    // missing until they appear under the links directory, then found by the periodic rescan.
    wait_health(
        &c,
        DeviceIndex(2),
        DeviceHealth::Ok,
        Duration::from_secs(10),
    )
    .await;
    assert_eq!(c.device_health(DeviceIndex(1)), DeviceHealth::Missing);
    assert_eq!(c.device_health(DeviceIndex(3)), DeviceHealth::Missing);
    assert_bytes(
        &read_file(&c, after_ino, after.len() as u64).await,
        &after,
        "after, C with two LUNs missing",
    );
    link(&old.paths()[1], &links.join("old1"));
    link(&new.paths()[1], &links.join("new1"));
    for d in [1, 3] {
        wait_health(
            &c,
            DeviceIndex(d),
            DeviceHealth::Ok,
            Duration::from_secs(10),
        )
        .await;
    }
    let proxied = c.status().bytes.proxied_read;
    assert_bytes(
        &read_file(&c, before_ino, before.len() as u64).await,
        &before,
        "before, C with every LUN",
    );
    assert_bytes(
        &read_file(&c, after_ino, after.len() as u64).await,
        &after,
        "after, C with every LUN",
    );
    assert_eq!(
        c.status().bytes.proxied_read,
        proxied,
        "C reads everything directly once it found the LUNs"
    );

    c.close().await.unwrap();
    b.close().await.unwrap();
    Arc::into_inner(a).unwrap().close().await.unwrap();
    serving.stop().await.unwrap();

    // The growth is durable: a new server on the same store, given every LUN, serves the
    // grown volume and the files.
    let backend = Backend::File(dir.path().join("mds.redb"));
    let opts = mds::serve_options("127.0.0.1:0".parse().unwrap(), backend, all.clone());
    let mut serving = mds::spawn_serve(&tokio::runtime::Handle::current(), opts, Clock::System);
    let server = serving.listening().await.unwrap().to_string();
    let d = Client::connect(config(&server, "d", globs(&all)))
        .await
        .unwrap();
    assert_eq!(*d.volume(), volume);
    assert_eq!(
        d.statfs(&root(), ROOT_INODE).await.unwrap().total_blocks,
        volume.size_blocks()
    );
    assert_bytes(
        &read_file(&d, after_ino, after.len() as u64).await,
        &after,
        "after, after a restart",
    );
    d.close().await.unwrap();
    serving.stop().await.unwrap();
    drop((old, new));
}

/// The server remembers the LUNs a growth added: restarted with the unchanged `devices` (the
/// old LUNs only), it opens the new ones too (the store's grown-devices record), and a file
/// whose blocks lie on them reads back byte-exact through the proxied path (an agent that
/// sees no LUN at all). Restarted again with `devices` a glob over links to the old LUNs, the
/// same: the glob is expanded and matched by label identity.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_server_opens_the_luns_a_growth_added_and_devices_globs() {
    let dir = tempfile::tempdir().unwrap();
    for d in ["old", "new", "links"] {
        std::fs::create_dir(dir.path().join(d)).unwrap();
    }
    let old = Luns::create(&dir.path().join("old"), 2, LUN_SIZE, LunKind::Auto).unwrap();
    let new = Luns::create(&dir.path().join("new"), 1, LUN_SIZE, LunKind::Auto).unwrap();
    eprintln!("grow restart test: loop devices: {}", old.is_loop());
    let db = dir.path().join("mds.redb");
    mds::format(
        &mds::striped(old.paths(), 4096, STRIPE_UNIT),
        &Backend::File(db.clone()),
        &Clock::System,
    )
    .unwrap();
    let start = |devices: Vec<PathBuf>| {
        let opts = mds::serve_options(
            "127.0.0.1:0".parse().unwrap(),
            Backend::File(db.clone()),
            devices,
        );
        mds::spawn_serve(&tokio::runtime::Handle::current(), opts, Clock::System)
    };
    let mut serving = start(old.paths().to_vec());
    let server = serving.listening().await.unwrap().to_string();
    let all: Vec<PathBuf> = old.paths().iter().chain(new.paths()).cloned().collect();
    let a = Client::connect(config(&server, "a", globs(&all)))
        .await
        .unwrap();
    // Most of the old volume (2 x 15 MiB after the data offset) used first.
    let mut rng = Rng::new(2216);
    let fill = rng.bytes(24 * MIB as usize);
    let fill_ino = write_file(&a, "fill", &fill).await;
    let admin = Admin::connect(&server, None).await.unwrap();
    let grown = admin
        .grow(globs(new.paths()), GrowLayout::Linear, false)
        .await
        .unwrap();
    let volume = grown.volume.volume.clone();
    assert_eq!(volume.devices().len(), 3);
    let after = rng.bytes(12 * MIB as usize);
    let after_ino = write_file(&a, "after", &after).await;
    assert!(
        devices_used(&a, after_ino, &volume).await.contains(&2),
        "part of the file lies on the new LUN"
    );
    a.close().await.unwrap();
    drop(admin);
    serving.stop().await.unwrap();

    // An agent with no LUN: every byte goes through the server.
    let proxied_only = |server: &str| config(server, "p", Vec::new());
    for (round, devices) in [
        ("unchanged devices", old.paths().to_vec()),
        ("a devices glob", {
            for (i, p) in old.paths().iter().enumerate() {
                link(p, &dir.path().join("links").join(format!("old-{i}")));
            }
            vec![dir.path().join("links").join("old-*")]
        }),
    ] {
        let mut serving = start(devices);
        let server = serving.listening().await.unwrap().to_string();
        let p = Client::connect(proxied_only(&server)).await.unwrap();
        assert_eq!(*p.volume(), volume, "{round}");
        for i in 0..3 {
            assert_eq!(
                p.device_health(DeviceIndex(i)),
                DeviceHealth::Missing,
                "{round}: the reader has no LUN"
            );
        }
        assert_bytes(
            &read_file(&p, after_ino, after.len() as u64).await,
            &after,
            &format!("after, proxied, {round}"),
        );
        assert_bytes(
            &read_file(&p, fill_ino, fill.len() as u64).await,
            &fill,
            &format!("fill, proxied, {round}"),
        );
        assert!(
            p.status().bytes.proxied_read >= (after.len() + fill.len()) as u64,
            "{round}: {:?}",
            p.status().bytes
        );
        p.close().await.unwrap();
        serving.stop().await.unwrap();
    }
    drop((old, new));
}

/// Waits until the writer finished round `target` (it fails the test if it ended or 60 s
/// passed first).
async fn wait_rounds(rounds: &AtomicU64, target: u64, writer: &tokio::task::JoinHandle<u64>) {
    let started = Instant::now();
    while rounds.load(Ordering::SeqCst) < target {
        assert!(!writer.is_finished(), "the writer ended early");
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the writer did not reach round {target}: {}",
            rounds.load(Ordering::SeqCst)
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The bytes of the busy file's round `round`.
fn busy_round(round: u64) -> Vec<u8> {
    Rng::new(1000 + round).bytes(4 * MIB as usize)
}

fn link(target: &Path, at: &Path) {
    std::os::unix::fs::symlink(target, at).unwrap();
}

/// Loop devices and an LVM2 volume group made with activation off, removed (by exact name)
/// on drop, also when an assertion fails.
pub(crate) struct LvmLab {
    pub(crate) dir: tempfile::TempDir,
    pub(crate) loops: Vec<String>,
    pub(crate) vg: Option<String>,
}

impl LvmLab {
    pub(crate) fn add_loop(&mut self, size: u64) -> String {
        let file = self.dir.path().join(format!("pv{}.img", self.loops.len()));
        std::fs::File::create(&file).unwrap().set_len(size).unwrap();
        let out = std::process::Command::new("losetup")
            .args(["-f", "--show", "--direct-io=on"])
            .arg(&file)
            .output()
            .unwrap();
        assert!(out.status.success(), "losetup: {out:?}");
        let dev = String::from_utf8(out.stdout).unwrap().trim().to_owned();
        assert!(dev.starts_with("/dev/loop"), "losetup printed {dev:?}");
        self.loops.push(dev.clone());
        dev
    }

    /// Only our loop devices; no device-mapper, udev, or files under /etc/lvm.
    fn config(&self) -> String {
        let accept: Vec<String> = self.loops.iter().map(|d| format!("\"a|^{d}$|\"")).collect();
        format!(
            "devices {{ filter = [ {}, \"r|.*|\" ] scan_lvs = 0 obtain_device_list_from_udev = 0 \
             use_devicesfile = 0 hints = \"none\" }} global {{ activation = 0 }} \
             backup {{ backup = 0 archive = 0 }}",
            accept.join(", ")
        )
    }

    pub(crate) fn try_lvm(&self, command: &str, args: &[&str]) -> Result<String, String> {
        let out = std::process::Command::new("lvm")
            .arg(command)
            .arg("--config")
            .arg(self.config())
            .args(args)
            .env("LVM_SUPPRESS_FD_WARNINGS", "1")
            .output()
            .map_err(|e| format!("lvm {command}: {e}"))?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        } else {
            Err(format!(
                "lvm {command} {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            ))
        }
    }

    pub(crate) fn lvm(&self, command: &str, args: &[&str]) -> String {
        self.try_lvm(command, args)
            .unwrap_or_else(|e| panic!("{e}"))
    }
}

impl Drop for LvmLab {
    fn drop(&mut self) {
        if let Some(vg) = self.vg.take()
            && let Err(e) = self.try_lvm("vgremove", &["-f", &vg])
        {
            eprintln!("grow lvm cleanup: {e}");
        }
        if !self.loops.is_empty() {
            let mut args = vec!["-ff", "-y"];
            args.extend(self.loops.iter().map(String::as_str));
            let _ = self.try_lvm("pvremove", &args);
        }
        for dev in &self.loops {
            let _ = std::process::Command::new("losetup")
                .arg("-d")
                .arg(dev)
                .status();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_lvextended_logical_volume_is_taken_up_while_mounted() {
    if sanfs_testcluster::skip_unless(
        "an_lvextended_logical_volume_is_taken_up_while_mounted",
        &[
            sanfs_testcluster::Need::Tool("lvm"),
            sanfs_testcluster::Need::LoopDevices,
        ],
    ) {
        return;
    }
    let mut lab = LvmLab {
        dir: tempfile::tempdir().unwrap(),
        loops: Vec::new(),
        vg: None,
    };
    let pvs: Vec<String> = (0..3).map(|_| lab.add_loop(64 * MIB)).collect();
    let vg = format!("sanfs_h12_grow_{}", std::process::id());
    let lv_path = format!("{vg}/lv0");
    lab.lvm("pvcreate", &[&pvs[0], &pvs[1], &pvs[2]]);
    lab.lvm("vgcreate", &[&vg, &pvs[0], &pvs[1]]);
    lab.vg = Some(vg.clone());
    lab.lvm(
        "lvcreate",
        &["-an", "-Zn", "-i2", "-I64k", "-L16M", "-n", "lv0", &vg],
    );

    // Format the LV (nothing written to the PVs) and serve it, the server opening PVs 0 and 1.
    let backend = Backend::File(lab.dir.path().join("mds.redb"));
    let cfg = sanfs_mds::config::VolumeConfig {
        layout: sanfs_mds::config::LayoutKindConfig::Lvm,
        block_size: 4096,
        stripe_unit: STRIPE_UNIT,
        data_offset: MIB,
        devices: vec![PathBuf::from(&pvs[0]), PathBuf::from(&pvs[1])],
        lvm_vg: Some(vg.clone()),
        lvm_lv: Some("lv0".to_owned()),
    };
    let formatted = sanfs_mds::format::format_volume(&cfg, false, 0).unwrap();
    sanfs_mds::store::Store::create(
        &backend,
        &sanfs_mds::store::FsInfo {
            fs_uuid: formatted.fs_uuid,
            volume: formatted.volume.clone(),
            lvm: formatted.lvm.clone(),
        },
        true,
        &Clock::System,
    )
    .unwrap();
    let opts = mds::serve_options("127.0.0.1:0".parse().unwrap(), backend, cfg.devices.clone());
    let mut serving = mds::spawn_serve(&tokio::runtime::Handle::current(), opts, Clock::System);
    let server = serving.listening().await.unwrap().to_string();
    let all: Vec<PathBuf> = pvs.iter().map(PathBuf::from).collect();
    let a = Arc::new(
        Client::connect(config(&server, "a", globs(&all)))
            .await
            .unwrap(),
    );
    let old_volume = a.volume();
    assert_eq!(old_volume.size_bytes(), 16 * MIB);
    let old_stat = a.statfs(&root(), ROOT_INODE).await.unwrap();

    let mut rng = Rng::new(2222);
    let before = rng.bytes(8 * MIB as usize);
    let before_ino = write_file(&a, "before", &before).await;

    // A writer overwrites a 2 MiB file while the LV is extended and the volume grows.
    let (busy_ino, busy_fh) = create(&a, "busy").await;
    let stop = Arc::new(AtomicBool::new(false));
    let rounds = Arc::new(AtomicU64::new(0));
    let writer = {
        let (a, stop, rounds) = (a.clone(), stop.clone(), rounds.clone());
        tokio::spawn(async move {
            let mut round = 0u64;
            while !stop.load(Ordering::SeqCst) || round < 3 {
                round += 1;
                let data = busy_round(round);
                a.write_at(&root(), &busy_fh, busy_ino, 0, &data[..2 * MIB as usize])
                    .await
                    .unwrap_or_else(|e| panic!("busy round {round}: {e}"));
                rounds.store(round, Ordering::SeqCst);
            }
            round
        })
    };

    // lvextend onto a new PV: a new linear segment on PV 2.
    eprintln!("grow lvm: extending the LV");
    lab.lvm("vgextend", &[&vg, &pvs[2]]);
    lab.lvm("lvextend", &["-i1", "-L+16M", &lv_path, &pvs[2]]);
    let admin = Admin::connect(&server, None).await.unwrap();
    // Without PV 2's path the server cannot find the PV the LV now uses.
    let refused = admin
        .grow(Vec::new(), GrowLayout::Lvm, false)
        .await
        .expect_err("PV 2 is not among the server's LUNs");
    assert!(format!("{refused:#}").contains("not among"), "{refused:#}");
    let grown = admin
        .grow(vec![pvs[2].clone()], GrowLayout::Lvm, false)
        .await
        .unwrap();
    let volume = grown.volume.volume.clone();
    assert_eq!(grown.old_size_bytes, 16 * MIB);
    assert_eq!(volume.size_bytes(), 32 * MIB);
    assert_eq!(volume.devices().len(), 3);
    // lvextend again on PV 2: LVM merges it into the last segment (same PV, contiguous).
    lab.lvm("lvextend", &["-i1", "-L+8M", &lv_path, &pvs[2]]);
    eprintln!("grow lvm: grown once, extending again");
    let grown2 = admin
        .grow(Vec::new(), GrowLayout::Lvm, false)
        .await
        .unwrap();
    eprintln!("grow lvm: grown twice");
    let volume2 = grown2.volume.volume.clone();
    assert_eq!(volume2.size_bytes(), 40 * MIB);
    assert_eq!(volume2.segments().len(), volume.segments().len());
    // Nothing more to take up: refused, nothing changes.
    admin
        .grow(Vec::new(), GrowLayout::Lvm, false)
        .await
        .expect_err("the LV did not grow");
    let stat = a.statfs(&root(), ROOT_INODE).await.unwrap();
    assert_eq!(stat.total_blocks, volume2.size_blocks());
    assert_eq!(stat.total_blocks - old_stat.total_blocks, 24 * MIB / 4096);

    let at_growth = rounds.load(Ordering::SeqCst);
    wait_rounds(&rounds, at_growth + 2, &writer).await;
    stop.store(true, Ordering::SeqCst);
    let last_round = writer.await.unwrap();

    // A file larger than the old free space lands on PV 2, read back byte-exact, as every
    // file written before and during the growth.
    let after = rng.bytes(16 * MIB as usize);
    let after_ino = write_file(&a, "after", &after).await;
    let used = devices_used(&a, after_ino, &volume2).await;
    assert!(used.contains(&2), "PV 2 holds part of the file: {used:?}");
    assert_eq!(a.device_health(DeviceIndex(2)), DeviceHealth::Ok);
    assert_bytes(
        &read_file(&a, after_ino, after.len() as u64).await,
        &after,
        "after",
    );
    assert_bytes(
        &read_file(&a, before_ino, before.len() as u64).await,
        &before,
        "before",
    );
    assert_bytes(
        &read_file(&a, busy_ino, 2 * MIB).await,
        &busy_round(last_round)[..2 * MIB as usize],
        "busy",
    );
    // The bytes are where LVM2 says: PV 2's first extent starts at its pe_start.
    let map = a.bmap(&root(), after_ino).await.unwrap();
    let on_pv2 = map
        .entries
        .iter()
        .find(|e| e.device_uuid == volume2.devices()[2].uuid.to_string())
        .unwrap();
    let pe_start: u64 = lab
        .lvm(
            "pvs",
            &[
                "--noheadings",
                "--units",
                "b",
                "--nosuffix",
                "-o",
                "pe_start",
                &pvs[2],
            ],
        )
        .trim()
        .parse()
        .unwrap();
    let mut raw = vec![0u8; on_pv2.len.min(MIB) as usize];
    use std::os::unix::fs::FileExt;
    std::fs::File::open(&pvs[2])
        .unwrap()
        .read_exact_at(&mut raw, on_pv2.phys_off)
        .unwrap();
    let at = on_pv2.file_off as usize;
    assert!(on_pv2.phys_off >= pe_start);
    assert_bytes(&raw, &after[at..at + raw.len()], "PV 2's bytes, read raw");

    Arc::into_inner(a).unwrap().close().await.unwrap();
    serving.stop().await.unwrap();
}
