//! The import rule's LVM2 checks at server start and agent mount (issue 22), with real lvm2
//! on loop devices (activation off, no device-mapper): after `format` of an LV, a read-only
//! LV (`lvchange -pr`) and an exported VG (`vgexport`) refuse a mount by an agent of the
//! running server and a start of the server, in the words of `format`; made writable again,
//! the LV serves and mounts.

use std::path::PathBuf;

use sanfs_client_agent::client::{Client, ClientConfig, ConnectError};
use sanfs_mds::clock::Clock;
use sanfs_mds::store::Backend;
use sanfs_testcluster::mds;

use crate::cluster::MIB;
use crate::grow::LvmLab;

fn config(server: &str, name: &str, pvs: &[String]) -> ClientConfig {
    let mut c = ClientConfig::new(server.to_owned(), pvs.to_vec());
    c.client_name = name.to_owned();
    c
}

async fn mount_refusal(server: &str, pvs: &[String]) -> String {
    match Client::connect(config(server, "refused", pvs)).await {
        Ok(c) => {
            c.close().await.unwrap();
            panic!("the agent mounted a refused logical volume");
        }
        Err(e @ ConnectError::LvmRefused(_)) => e.to_string(),
        Err(e) => panic!("refused for another reason: {e}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_lv_or_an_exported_vg_refuses_serve_and_mount() {
    if sanfs_testcluster::skip_unless(
        "a_read_only_lv_or_an_exported_vg_refuses_serve_and_mount",
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
    let pvs: Vec<String> = (0..2).map(|_| lab.add_loop(32 * MIB)).collect();
    let vg = format!("sanfs_h16_import_{}", std::process::id());
    let lv = format!("{vg}/lv0");
    lab.lvm("pvcreate", &[&pvs[0], &pvs[1]]);
    lab.lvm("vgcreate", &[&vg, &pvs[0], &pvs[1]]);
    lab.vg = Some(vg.clone());
    lab.lvm(
        "lvcreate",
        &["-an", "-Zn", "-i2", "-I64k", "-L16M", "-n", "lv0", &vg],
    );

    let db = lab.dir.path().join("mds.redb");
    let cfg = sanfs_mds::config::VolumeConfig {
        layout: sanfs_mds::config::LayoutKindConfig::Lvm,
        block_size: 4096,
        stripe_unit: 64 * 1024,
        data_offset: MIB,
        devices: pvs.iter().map(PathBuf::from).collect(),
        lvm_vg: Some(vg.clone()),
        lvm_lv: Some("lv0".to_owned()),
    };
    let formatted = sanfs_mds::format::format_volume(&cfg, false, 0).unwrap();
    sanfs_mds::store::Store::create(
        &Backend::File(db.clone()),
        &sanfs_mds::store::FsInfo {
            fs_uuid: formatted.fs_uuid,
            volume: formatted.volume.clone(),
            lvm: formatted.lvm.clone(),
        },
        true,
        &Clock::System,
    )
    .unwrap();
    let start = || {
        let opts = mds::serve_options(
            "127.0.0.1:0".parse().unwrap(),
            Backend::File(db.clone()),
            cfg.devices.clone(),
        );
        mds::spawn_serve(&tokio::runtime::Handle::current(), opts, Clock::System)
    };
    let start_refusal = || async {
        let mut serving = start();
        match serving.listening().await {
            Ok(addr) => {
                serving.stop().await.unwrap();
                panic!("the server served a refused logical volume on {addr}");
            }
            Err(e) => format!("{e:#}"),
        }
    };

    // Usable: the server serves, an agent mounts.
    let mut serving = start();
    let server = serving.listening().await.unwrap().to_string();
    Client::connect(config(&server, "a", &pvs))
        .await
        .unwrap()
        .close()
        .await
        .unwrap();

    // A read-only LV: the running server's next mount is refused, and so is a start.
    lab.lvm("lvchange", &["-pr", &lv]);
    let refused = mount_refusal(&server, &pvs).await;
    eprintln!("read-only LV, mount: {refused}");
    for want in [
        &format!("logical volume {lv} cannot be used; refusing to mount"),
        "read-only",
    ] {
        assert!(refused.contains(want), "{want:?} in {refused}");
    }
    serving.stop().await.unwrap();
    let refused = start_refusal().await;
    eprintln!("read-only LV, start: {refused}");
    for want in [
        &format!("logical volume {lv} cannot be used; refusing to serve"),
        "read-only",
    ] {
        assert!(refused.contains(want), "{want:?} in {refused}");
    }

    // Writable again: serves and mounts. Then the VG exported: refused both ways.
    lab.lvm("lvchange", &["-prw", &lv]);
    let mut serving = start();
    let server = serving.listening().await.unwrap().to_string();
    Client::connect(config(&server, "b", &pvs))
        .await
        .unwrap()
        .close()
        .await
        .unwrap();
    lab.lvm("vgexport", &[&vg]);
    let refused = mount_refusal(&server, &pvs).await;
    eprintln!("exported VG, mount: {refused}");
    assert!(refused.contains("refusing to mount"), "{refused}");
    assert!(refused.contains("exported"), "{refused}");
    serving.stop().await.unwrap();
    let refused = start_refusal().await;
    eprintln!("exported VG, start: {refused}");
    assert!(refused.contains("refusing to serve"), "{refused}");
    assert!(refused.contains("exported"), "{refused}");
    // vgremove (the lab's cleanup) needs the VG imported.
    lab.lvm("vgimport", &[&vg]);
}
