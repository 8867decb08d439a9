//! The CSI driver end to end: the real `sanfs-csi` binary serving its unix socket, driven
//! over gRPC the way the external-provisioner, the external-resizer and the kubelet drive it,
//! against a real metadata server on file LUNs. The node tests stage and publish with real
//! `sanfs-agent` FUSE mounts (root and /dev/fuse, else "skipped") and then use the published
//! paths with plain `std::fs` calls, as a pod would.
//!
//! Cleanup: each driver is a [`ChildGuard`] (killed by pid), and a [`Sweep`] detaches any
//! mount a failed test left under its own directory, which also ends the agents serving them.

use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use sanfs_client_agent::csi::mounts::parse_mountinfo;
use sanfs_proto::csi::pb;
use sanfs_proto::csi::pb::controller_client::ControllerClient;
use sanfs_proto::csi::pb::identity_client::IdentityClient;
use sanfs_proto::csi::pb::node_client::NodeClient;
use sanfs_proto::types::{Credentials, FileType, ROOT_INODE};
use sanfs_testcluster::{ChildGuard, Netns, Network};
use tonic::Code;
use tonic::transport::{Channel, Endpoint};

use crate::cluster::{self, MIB, NetServer};
use crate::mount::{can_mount, timed};

type Mode = pb::volume_capability::access_mode::Mode;

/// The root directory of the volumes in the test file systems.
const ROOT: &str = "/k8s";

/// A channel to a unix socket.
async fn uds_channel(path: &Path) -> Channel {
    let path = path.to_owned();
    Endpoint::from_static("http://csi.invalid")
        .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
            let path = path.clone();
            async move {
                let s = tokio::net::UnixStream::connect(path).await?;
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(s))
            }
        }))
        .await
        .unwrap()
}

/// One running `sanfs-csi` and its three clients.
struct Csi {
    identity: IdentityClient<Channel>,
    ctl: ControllerClient<Channel>,
    node: NodeClient<Channel>,
    guard: ChildGuard,
}

/// How to start one driver.
struct DriverArgs<'a> {
    ns: &'a Netns,
    socket: PathBuf,
    mode: &'a str,
    node_id: &'a str,
    server: String,
    luns: &'a [PathBuf],
    /// More flags (e.g. `--tls-ca ...`).
    extra: Vec<String>,
}

impl Csi {
    async fn start(a: DriverArgs<'_>) -> Csi {
        let luns: Vec<String> = a
            .luns
            .iter()
            .map(|p| p.to_string_lossy().into_owned())
            .collect();
        let mut cmd: Command = a.ns.command(env!("CARGO_BIN_EXE_sanfs-csi"));
        cmd.arg("--endpoint")
            .arg(format!("unix://{}", a.socket.display()))
            .args(["--mode", a.mode, "--node-id", a.node_id, "--root", ROOT])
            .args(["--server", &a.server])
            .args(["--devices", &luns.join(",")])
            .args(["--agent", env!("CARGO_BIN_EXE_sanfs-agent")])
            .args(["--mount-timeout", "30"])
            .args(&a.extra)
            .env(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".to_owned()),
            )
            .stdin(Stdio::null());
        let mut guard = ChildGuard::spawn(&mut cmd).unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        while !a.socket.exists() {
            if let Some(st) = guard.try_wait().unwrap() {
                panic!("sanfs-csi exited before serving: {st}");
            }
            assert!(Instant::now() < deadline, "no CSI socket within 30 s");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let ch = uds_channel(&a.socket).await;
        let mut identity = IdentityClient::new(ch.clone());
        // Ready once the driver's session at the server is open.
        loop {
            let r = identity
                .probe(pb::ProbeRequest {})
                .await
                .unwrap()
                .into_inner();
            if r.ready == Some(true) {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the driver is not ready within 30 s"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Csi {
            identity,
            ctl: ControllerClient::new(ch.clone()),
            node: NodeClient::new(ch),
            guard,
        }
    }
}

/// Detaches (deepest first) every mount left under a test's directory.
struct Sweep(PathBuf);

impl Drop for Sweep {
    fn drop(&mut self) {
        for _ in 0..16 {
            let text = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
            let left: Vec<PathBuf> = parse_mountinfo(&text)
                .into_iter()
                .map(|m| m.mount_point)
                .filter(|p| p.starts_with(&self.0))
                .collect();
            if left.is_empty() {
                return;
            }
            for p in left.iter().rev() {
                eprintln!("sweep: detaching {}", p.display());
                let _ = rustix::mount::unmount(p, rustix::mount::UnmountFlags::DETACH);
            }
        }
    }
}

fn capability(mode: Mode) -> pb::VolumeCapability {
    use pb::volume_capability as vc;
    pb::VolumeCapability {
        access_type: Some(vc::AccessType::Mount(vc::MountVolume::default())),
        access_mode: Some(vc::AccessMode { mode: mode.into() }),
    }
}

fn create_request(name: &str, bytes: i64, mode: Mode) -> pb::CreateVolumeRequest {
    pb::CreateVolumeRequest {
        name: name.to_owned(),
        capacity_range: Some(pb::CapacityRange {
            required_bytes: bytes,
            limit_bytes: 0,
        }),
        volume_capabilities: vec![capability(mode)],
        ..Default::default()
    }
}

async fn create(csi: &mut Csi, name: &str, bytes: i64, mode: Mode) -> pb::Volume {
    csi.ctl
        .create_volume(create_request(name, bytes, mode))
        .await
        .unwrap()
        .into_inner()
        .volume
        .unwrap()
}

async fn stage(csi: &mut Csi, id: &str, staging: &Path, mode: Mode) {
    csi.node
        .node_stage_volume(pb::NodeStageVolumeRequest {
            volume_id: id.to_owned(),
            staging_target_path: staging.to_string_lossy().into_owned(),
            volume_capability: Some(capability(mode)),
            ..Default::default()
        })
        .await
        .unwrap();
}

async fn publish(
    csi: &mut Csi,
    id: &str,
    staging: &Path,
    target: &Path,
    mode: Mode,
    readonly: bool,
) -> Result<(), tonic::Status> {
    csi.node
        .node_publish_volume(pb::NodePublishVolumeRequest {
            volume_id: id.to_owned(),
            staging_target_path: staging.to_string_lossy().into_owned(),
            target_path: target.to_string_lossy().into_owned(),
            volume_capability: Some(capability(mode)),
            readonly,
            ..Default::default()
        })
        .await
        .map(drop)
}

async fn unpublish(csi: &mut Csi, id: &str, target: &Path) {
    csi.node
        .node_unpublish_volume(pb::NodeUnpublishVolumeRequest {
            volume_id: id.to_owned(),
            target_path: target.to_string_lossy().into_owned(),
        })
        .await
        .unwrap();
}

async fn unstage(csi: &mut Csi, id: &str, staging: &Path) {
    csi.node
        .node_unstage_volume(pb::NodeUnstageVolumeRequest {
            volume_id: id.to_owned(),
            staging_target_path: staging.to_string_lossy().into_owned(),
        })
        .await
        .unwrap();
}

/// (bytes, inodes) usage of a volume at `path`.
async fn stats(csi: &mut Csi, id: &str, path: &Path) -> (pb::VolumeUsage, pb::VolumeUsage) {
    let r = csi
        .node
        .node_get_volume_stats(pb::NodeGetVolumeStatsRequest {
            volume_id: id.to_owned(),
            volume_path: path.to_string_lossy().into_owned(),
            staging_target_path: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    let unit = |u: pb::volume_usage::Unit| {
        r.usage
            .iter()
            .find(|x| x.unit == u as i32)
            .cloned()
            .unwrap()
    };
    (
        unit(pb::volume_usage::Unit::Bytes),
        unit(pb::volume_usage::Unit::Inodes),
    )
}

async fn expand(csi: &mut Csi, id: &str, bytes: i64) -> pb::ControllerExpandVolumeResponse {
    csi.ctl
        .controller_expand_volume(pb::ControllerExpandVolumeRequest {
            volume_id: id.to_owned(),
            capacity_range: Some(pb::CapacityRange {
                required_bytes: bytes,
                limit_bytes: 0,
            }),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
}

async fn delete(csi: &mut Csi, id: &str) {
    csi.ctl
        .delete_volume(pb::DeleteVolumeRequest {
            volume_id: id.to_owned(),
            ..Default::default()
        })
        .await
        .unwrap();
}

async fn list(
    csi: &mut Csi,
    max: i32,
    token: &str,
) -> Result<pb::ListVolumesResponse, tonic::Status> {
    csi.ctl
        .list_volumes(pb::ListVolumesRequest {
            max_entries: max,
            starting_token: token.to_owned(),
        })
        .await
        .map(|r| r.into_inner())
}

/// Every volume id, following the tokens `max` at a time.
async fn list_all(csi: &mut Csi, max: i32) -> Vec<String> {
    let mut ids = Vec::new();
    let mut token = String::new();
    for _ in 0..1000 {
        let page = list(csi, max, &token).await.unwrap();
        assert!(max == 0 || page.entries.len() <= max as usize);
        ids.extend(
            page.entries
                .into_iter()
                .map(|e| e.volume.unwrap().volume_id),
        );
        if page.next_token.is_empty() {
            return ids;
        }
        token = page.next_token;
    }
    panic!("ListVolumes did not end within 1000 pages");
}

/// Sum of `st_blocks * 512` and count of the files and directories below `dir`.
fn du(dir: &Path) -> (u64, u64) {
    let mut bytes = 0;
    let mut count = 0;
    for e in std::fs::read_dir(dir).unwrap() {
        let e = e.unwrap();
        let m = std::fs::symlink_metadata(e.path()).unwrap();
        bytes += m.blocks() * 512;
        count += 1;
        if m.is_dir() {
            let (b, c) = du(&e.path());
            bytes += b;
            count += c;
        }
    }
    (bytes, count)
}

/// One node: a server on loopback, a driver in mode `both`, and the directories the kubelet
/// would make (a staging directory, and a parent for the pods' target paths).
struct OneNode {
    srv: cluster::Cluster,
    dir: tempfile::TempDir,
    _sweep: Sweep,
    csi: Csi,
    staging: PathBuf,
    pods: PathBuf,
}

impl OneNode {
    async fn start() -> OneNode {
        Self::start_with(None).await
    }

    /// With mutual TLS between the server and both the driver and its agents.
    async fn start_with(tls: Option<&cluster::Pki>) -> OneNode {
        Self::start_args(tls, Vec::new()).await
    }

    /// With more flags for the driver.
    async fn start_args(tls: Option<&cluster::Pki>, more: Vec<String>) -> OneNode {
        Self::start_full(tls, more, str::to_owned).await
    }

    /// With the driver's `--server` made from the server's address.
    async fn start_full(
        tls: Option<&cluster::Pki>,
        more: Vec<String>,
        server: impl FnOnce(&str) -> String,
    ) -> OneNode {
        let srv = cluster::start_with(10_000, tls.map(|p| p.server.clone())).await;
        let mut extra = tls.map_or_else(Vec::new, |p| {
            let path = |p: &PathBuf| p.to_string_lossy().into_owned();
            vec![
                "--tls-ca".to_owned(),
                path(&p.ca),
                "--tls-cert".to_owned(),
                path(&p.agent_cert),
                "--tls-key".to_owned(),
                path(&p.agent_key),
            ]
        });
        extra.extend(more);
        let dir = tempfile::tempdir().unwrap();
        let sweep = Sweep(dir.path().to_owned());
        let csi = Csi::start(DriverArgs {
            ns: &Netns::host(),
            socket: dir.path().join("csi.sock"),
            mode: "both",
            node_id: "node-a",
            server: server(&srv.addr.to_string()),
            luns: &srv.luns,
            extra,
        })
        .await;
        let staging = dir.path().join("staging");
        std::fs::create_dir(&staging).unwrap();
        let pods = dir.path().join("pods");
        std::fs::create_dir(&pods).unwrap();
        OneNode {
            srv,
            dir,
            _sweep: sweep,
            csi,
            staging,
            pods,
        }
    }
}

#[track_caller]
fn assert_no_mounts_below(dir: &Path) {
    let text = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let left: Vec<PathBuf> = parse_mountinfo(&text)
        .into_iter()
        .map(|m| m.mount_point)
        .filter(|p| p.starts_with(dir))
        .collect();
    assert!(left.is_empty(), "mounts left: {left:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn controller_volumes_are_idempotent_listed_expanded_and_deleted() {
    let srv = cluster::start(10_000).await;
    let dir = tempfile::tempdir().unwrap();
    let host = Netns::host();
    let mut csi = Csi::start(DriverArgs {
        ns: &host,
        socket: dir.path().join("ctl.sock"),
        mode: "controller",
        node_id: "ctl",
        server: srv.addr.to_string(),
        luns: &srv.luns,
        extra: Vec::new(),
    })
    .await;

    let info = csi
        .identity
        .get_plugin_info(pb::GetPluginInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.name, "sanfs.csi.example.invalid");
    // The node service is not served in controller mode.
    let err = csi
        .node
        .node_get_info(pb::NodeGetInfoRequest {})
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unimplemented);

    // Create: the same name twice is the same volume; a larger size is ALREADY_EXISTS.
    let a = create(
        &mut csi,
        "pvc-a",
        3 * MIB as i64,
        Mode::MultiNodeMultiWriter,
    )
    .await;
    assert_eq!(a.volume_id, "pvc-a");
    assert_eq!(a.capacity_bytes, 3 * MIB as i64);
    let again = create(
        &mut csi,
        "pvc-a",
        3 * MIB as i64,
        Mode::MultiNodeMultiWriter,
    )
    .await;
    assert_eq!(again, a);
    let bigger = csi
        .ctl
        .create_volume(create_request(
            "pvc-a",
            4 * MIB as i64,
            Mode::MultiNodeMultiWriter,
        ))
        .await
        .unwrap_err();
    assert_eq!(bigger.code(), Code::AlreadyExists, "{bigger:?}");
    // An odd size is rounded up to whole blocks.
    let odd = create(&mut csi, "pvc-odd", 10_000, Mode::SingleNodeWriter).await;
    assert_eq!(odd.capacity_bytes, 12_288);
    // A name that is no plain directory name gets a hashed id.
    let slashy = create(
        &mut csi,
        "team/data vol",
        MIB as i64,
        Mode::SingleNodeWriter,
    )
    .await;
    assert!(slashy.volume_id.starts_with('_') && slashy.volume_id.len() == 65);
    // Block access, unknown parameters and snapshot sources are refused; nothing is made.
    let mut block = create_request("pvc-block", MIB as i64, Mode::SingleNodeWriter);
    block.volume_capabilities[0].access_type = Some(pb::volume_capability::AccessType::Block(
        pb::volume_capability::BlockVolume {},
    ));
    let e = csi.ctl.create_volume(block).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    let mut typo = create_request("pvc-typo", MIB as i64, Mode::SingleNodeWriter);
    typo.parameters.insert("inode".into(), "10".into());
    assert_eq!(
        csi.ctl.create_volume(typo).await.unwrap_err().code(),
        Code::InvalidArgument
    );
    // More than the whole file system: OUT_OF_RANGE.
    let huge = csi
        .ctl
        .create_volume(create_request("pvc-huge", 1 << 40, Mode::SingleNodeWriter))
        .await
        .unwrap_err();
    assert_eq!(huge.code(), Code::OutOfRange);

    // Validate: confirmed for RWX mounts, not for block, NOT_FOUND for no volume.
    let v = csi
        .ctl
        .validate_volume_capabilities(pb::ValidateVolumeCapabilitiesRequest {
            volume_id: a.volume_id.clone(),
            volume_capabilities: vec![capability(Mode::MultiNodeMultiWriter)],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(v.confirmed.is_some());
    let v = csi
        .ctl
        .validate_volume_capabilities(pb::ValidateVolumeCapabilitiesRequest {
            volume_id: a.volume_id.clone(),
            volume_capabilities: vec![capability(Mode::MultiNodeSingleWriter)],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(v.confirmed.is_none() && !v.message.is_empty());
    let e = csi
        .ctl
        .validate_volume_capabilities(pb::ValidateVolumeCapabilitiesRequest {
            volume_id: "pvc-nope".into(),
            volume_capabilities: vec![capability(Mode::SingleNodeWriter)],
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound);

    // List with pages of 2: every volume once; a bad token is ABORTED.
    for i in 0..5 {
        create(
            &mut csi,
            &format!("pvc-list-{i}"),
            MIB as i64,
            Mode::SingleNodeWriter,
        )
        .await;
    }
    let mut all = list_all(&mut csi, 2).await;
    all.sort();
    let mut unpaged = list_all(&mut csi, 0).await;
    unpaged.sort();
    assert_eq!(all, unpaged);
    assert_eq!(all.len(), 8, "{all:?}");
    assert_eq!(
        list(&mut csi, 1, "invalid-token").await.unwrap_err().code(),
        Code::Aborted
    );
    // A volume created between pages appears on a later page; deleting the last volume of
    // a page keeps its token valid.
    let first = list(&mut csi, 2, "").await.unwrap();
    let last_of_page = first.entries[1].volume.clone().unwrap().volume_id;
    delete(&mut csi, &last_of_page).await;
    create(&mut csi, "pvc-late", MIB as i64, Mode::SingleNodeWriter).await;
    let mut rest = Vec::new();
    let mut token = first.next_token.clone();
    while !token.is_empty() {
        let p = list(&mut csi, 2, &token).await.unwrap();
        rest.extend(p.entries.into_iter().map(|e| e.volume.unwrap().volume_id));
        token = p.next_token;
    }
    assert!(rest.contains(&"pvc-late".to_owned()), "{rest:?}");
    assert!(!rest.contains(&last_of_page));

    // Capacity: what the file system has free; at most its size per volume.
    let cap = csi
        .ctl
        .get_capacity(pb::GetCapacityRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert!(cap.available_capacity > 0);
    assert!(cap.maximum_volume_size.unwrap() >= cap.available_capacity);

    // Expand grows the quota (visible to the server), never shrinks it, and is idempotent.
    let e = expand(&mut csi, "pvc-a", 8 * MIB as i64).await;
    assert_eq!(
        (e.capacity_bytes, e.node_expansion_required),
        (8 * MIB as i64, false)
    );
    let e = expand(&mut csi, "pvc-a", 2 * MIB as i64).await;
    assert_eq!(e.capacity_bytes, 8 * MIB as i64);
    let client = srv.client("check").await;
    let root = Credentials::root();
    let k8s = client.lookup(&root, ROOT_INODE, "k8s").await.unwrap();
    let vol = client.lookup(&root, k8s.ino, "pvc-a").await.unwrap();
    let q = client.get_quota(&root, vol.ino).await.unwrap().unwrap();
    assert_eq!(q.limits.capacity_bytes, Some(8 * MIB));
    let e = csi
        .ctl
        .controller_expand_volume(pb::ControllerExpandVolumeRequest {
            volume_id: "pvc-nope".into(),
            capacity_range: Some(pb::CapacityRange {
                required_bytes: MIB as i64,
                limit_bytes: 0,
            }),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound);

    // Delete removes the whole tree below the volume and the quota; twice is fine.
    let d = client.mkdir(&root, vol.ino, "sub", 0o755).await.unwrap();
    let f = client
        .create(&root, d.ino, "file", 0o644, true, cluster::rw())
        .await
        .unwrap();
    client
        .write_at(&root, &f.handle, f.attr.ino, 0, &[7u8; 100_000])
        .await
        .unwrap();
    client.release(&f.handle).await.unwrap();
    delete(&mut csi, "pvc-a").await;
    delete(&mut csi, "pvc-a").await;
    assert_eq!(
        client.lookup(&root, k8s.ino, "pvc-a").await.unwrap_err(),
        sanfs_proto::types::FsError::NotFound
    );
    let ids = list_all(&mut csi, 0).await;
    assert!(!ids.contains(&"pvc-a".to_owned()));
    // A directory under the root without a quota is not a volume.
    let plain = client
        .mkdir(&root, k8s.ino, "not-a-volume", 0o755)
        .await
        .unwrap();
    assert_eq!(plain.kind, FileType::Directory);
    assert!(
        !list_all(&mut csi, 0)
            .await
            .contains(&"not-a-volume".to_owned())
    );
    drop(client);
    drop(csi.guard);
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quota_edquot_then_expand_then_exact_stats() {
    if !can_mount() {
        return;
    }
    let OneNode {
        srv,
        dir,
        _sweep,
        mut csi,
        staging,
        pods,
    } = OneNode::start().await;
    let mode = Mode::MultiNodeMultiWriter;
    let vol = create(&mut csi, "pvc-quota", 8 * MIB as i64, mode).await;
    let id = vol.volume_id.clone();
    let target = pods.join("mount");
    stage(&mut csi, &id, &staging, mode).await;
    stage(&mut csi, &id, &staging, mode).await; // idempotent
    publish(&mut csi, &id, &staging, &target, mode, false)
        .await
        .unwrap();
    publish(&mut csi, &id, &staging, &target, mode, false)
        .await
        .unwrap(); // idempotent
    // The same target read-only is incompatible with the read-write publish there.
    let e = publish(&mut csi, &id, &staging, &target, mode, true)
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::AlreadyExists);

    // df inside the pod's mount shows the quota.
    let st = rustix::fs::statvfs(&target).unwrap();
    assert_eq!(st.f_blocks * st.f_frsize, 8 * MIB);

    // Write 1 MiB at a time until the quota stops it: EDQUOT, at most 8 MiB in.
    let t = target.clone();
    let (written, errno) = timed("fill the volume", 120, move || {
        std::fs::write(t.join("small"), b"small file").unwrap();
        std::fs::create_dir(t.join("d")).unwrap();
        let mut f = std::fs::File::create(t.join("d/big")).unwrap();
        let chunk = crate::support::pattern(MIB as usize, 3);
        let mut written = 0u64;
        for _ in 0..32 {
            match f.write_all(&chunk) {
                Ok(()) => written += MIB,
                Err(e) => return (written, e.raw_os_error()),
            }
        }
        (written, None)
    })
    .await;
    assert_eq!(
        errno,
        Some(libc::EDQUOT),
        "writing past the capacity fails with EDQUOT"
    );
    assert!(
        (4 * MIB..8 * MIB).contains(&written),
        "{written} bytes went in"
    );

    // The usage the kubelet sees is the quota's, exactly: the allocated blocks of every file
    // (as stat shows them) and the number of files and directories.
    let (bytes, inodes) = stats(&mut csi, &id, &target).await;
    let t = target.clone();
    let (du_bytes, du_count) = timed("du", 30, move || du(&t)).await;
    assert_eq!(bytes.total, 8 * MIB as i64);
    assert_eq!(bytes.used as u64, du_bytes, "used bytes = sum of st_blocks");
    assert!(bytes.used as u64 >= written);
    assert_eq!(bytes.available, bytes.total - bytes.used);
    assert_eq!(
        inodes.used as u64, du_count,
        "used inodes = files + directories"
    );
    assert_eq!(inodes.used, 3);
    let client = srv.client("check").await;
    let root = Credentials::root();
    let k8s = client.lookup(&root, ROOT_INODE, "k8s").await.unwrap();
    let dir_attr = client.lookup(&root, k8s.ino, &id).await.unwrap();
    let q = client
        .get_quota(&root, dir_attr.ino)
        .await
        .unwrap()
        .unwrap();
    assert_eq!((q.used_bytes, q.used_inodes), (bytes.used as u64, 3));

    // The resizer grows the volume; the same write now goes through.
    let e = expand(&mut csi, &id, 16 * MIB as i64).await;
    assert_eq!(e.capacity_bytes, 16 * MIB as i64);
    let ne = csi
        .node
        .node_expand_volume(pb::NodeExpandVolumeRequest {
            volume_id: id.clone(),
            volume_path: target.to_string_lossy().into_owned(),
            capacity_range: Some(pb::CapacityRange {
                required_bytes: 16 * MIB as i64,
                limit_bytes: 0,
            }),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(ne.capacity_bytes, 16 * MIB as i64);
    let t = target.clone();
    timed("write after expanding", 120, move || {
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(t.join("d/big"))
            .unwrap();
        f.write_all(&crate::support::pattern(4 * MIB as usize, 4))
            .unwrap();
    })
    .await;
    let st = rustix::fs::statvfs(&target).unwrap();
    assert_eq!(st.f_blocks * st.f_frsize, 16 * MIB);
    let (bytes, _) = stats(&mut csi, &id, &target).await;
    let t = target.clone();
    let (du_bytes, _) = timed("du", 30, move || du(&t)).await;
    assert_eq!(bytes.total, 16 * MIB as i64);
    assert_eq!(bytes.used as u64, du_bytes);
    assert!(bytes.used as u64 >= written + 4 * MIB);

    // Stats for a path where the volume is not mounted: NOT_FOUND.
    let e = csi
        .node
        .node_get_volume_stats(pb::NodeGetVolumeStatsRequest {
            volume_id: id.clone(),
            volume_path: pods.to_string_lossy().into_owned(),
            staging_target_path: String::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound);

    // Take it down: the target directory goes, the mounts go, the agent exits; twice is fine.
    unpublish(&mut csi, &id, &target).await;
    unpublish(&mut csi, &id, &target).await;
    assert!(!target.exists());
    unstage(&mut csi, &id, &staging).await;
    unstage(&mut csi, &id, &staging).await;
    assert_no_mounts_below(dir.path());
    delete(&mut csi, &id).await;
    drop(client);
    drop(csi.guard);
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_pods_and_a_pod_on_a_second_node_share_a_volume() {
    if !can_mount() {
        return;
    }
    let net = Network::create(2).unwrap();
    let srv = NetServer::start_in(net.server(), net.server_ip(), 10_000);
    let dir = tempfile::tempdir().unwrap();
    let _sweep = Sweep(dir.path().to_owned());
    let server = srv.addr.to_string();
    let mut a = Csi::start(DriverArgs {
        ns: net.node(0),
        socket: dir.path().join("a.sock"),
        mode: "both",
        node_id: "node-a",
        server: server.clone(),
        luns: &srv.luns,
        extra: Vec::new(),
    })
    .await;
    let mut b = Csi::start(DriverArgs {
        ns: net.node(1),
        socket: dir.path().join("b.sock"),
        mode: "node",
        node_id: "node-b",
        server,
        luns: &srv.luns,
        extra: Vec::new(),
    })
    .await;
    let node_b = b
        .node
        .node_get_info(pb::NodeGetInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(node_b.node_id, "node-b");

    let mode = Mode::MultiNodeMultiWriter;
    let id = create(&mut a, "pvc-shared", 32 * MIB as i64, mode)
        .await
        .volume_id;
    let mk = |p: &str| {
        let p = dir.path().join(p);
        std::fs::create_dir_all(&p).unwrap();
        p
    };
    let (stage_a, stage_b) = (mk("a/staging"), mk("b/staging"));
    let (pod1, pod2, pod3, pod4) = (
        mk("a/pod1").join("mount"),
        mk("a/pod2").join("mount"),
        mk("b/pod3").join("mount"),
        mk("b/pod4").join("mount"),
    );
    stage(&mut a, &id, &stage_a, mode).await;
    publish(&mut a, &id, &stage_a, &pod1, mode, false)
        .await
        .unwrap();
    publish(&mut a, &id, &stage_a, &pod2, mode, false)
        .await
        .unwrap();
    stage(&mut b, &id, &stage_b, mode).await;
    publish(&mut b, &id, &stage_b, &pod3, mode, false)
        .await
        .unwrap();
    publish(&mut b, &id, &stage_b, &pod4, mode, true)
        .await
        .unwrap();

    let (p1, p2, p3, p4) = (pod1.clone(), pod2.clone(), pod3.clone(), pod4.clone());
    timed("pods share the volume", 120, move || {
        // Pod 1 writes a small file (proxied) and pod 2 on the same node reads it.
        std::fs::write(p1.join("hello"), b"from pod 1").unwrap();
        assert_eq!(std::fs::read(p2.join("hello")).unwrap(), b"from pod 1");
        // Pod 2 writes 3 MiB (direct path, striped); pod 3 on node B reads it whole.
        let big = crate::support::pattern(3 * MIB as usize + 777, 9);
        std::fs::write(p2.join("big"), &big).unwrap();
        assert_eq!(std::fs::read(p3.join("big")).unwrap(), big);
        assert_eq!(std::fs::read(p3.join("hello")).unwrap(), b"from pod 1");
        // Pod 3 answers; pods 1 and 2 on node A read it.
        std::fs::write(p3.join("reply"), b"from pod 3 on node b").unwrap();
        assert_eq!(
            std::fs::read(p1.join("reply")).unwrap(),
            b"from pod 3 on node b"
        );
        assert_eq!(
            std::fs::read(p2.join("reply")).unwrap(),
            b"from pod 3 on node b"
        );
        // Pod 4 is read-only: it reads, it cannot write.
        assert_eq!(std::fs::read(p4.join("big")).unwrap(), big);
        let e = std::fs::write(p4.join("nope"), b"x").unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EROFS));
    })
    .await;
    // Both nodes report the same exact usage.
    let (ua, ia) = stats(&mut a, &id, &pod1).await;
    let (ub, ib) = stats(&mut b, &id, &pod3).await;
    assert_eq!((ua.used, ia.used), (ub.used, ib.used));
    assert_eq!(ia.used, 3);
    assert!(ua.used as u64 >= 3 * MIB);

    for pod in [&pod1, &pod2] {
        unpublish(&mut a, &id, pod).await;
    }
    for pod in [&pod3, &pod4] {
        unpublish(&mut b, &id, pod).await;
    }
    unstage(&mut a, &id, &stage_a).await;
    unstage(&mut b, &id, &stage_b).await;
    delete(&mut a, &id).await;
    drop(a.guard);
    drop(b.guard);
    drop(srv);
}

/// The pid of the `sanfs-agent` serving `staging` (found by its exact command line).
fn agent_serving(staging: &Path) -> Option<u32> {
    let want = staging.as_os_str().as_encoded_bytes();
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: u32 = e.file_name().to_str()?.parse().ok()?;
        let cmdline = std::fs::read(e.path().join("cmdline")).ok()?;
        let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
        let is_agent = args.first()?.ends_with(b"sanfs-agent");
        (is_agent && args.contains(&want)).then_some(pid)
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_agent_is_replaced_when_the_volume_is_published_again() {
    if !can_mount() {
        return;
    }
    let OneNode {
        srv,
        dir,
        _sweep,
        mut csi,
        staging,
        pods,
    } = OneNode::start().await;
    let mode = Mode::MultiNodeMultiWriter;
    let id = create(&mut csi, "pvc-restart", 8 * MIB as i64, mode)
        .await
        .volume_id;
    let (pod1, pod2) = (pods.join("one"), pods.join("two"));
    stage(&mut csi, &id, &staging, mode).await;
    publish(&mut csi, &id, &staging, &pod1, mode, false)
        .await
        .unwrap();
    let p1 = pod1.clone();
    timed("write", 30, move || {
        std::fs::write(p1.join("kept"), b"still here").unwrap()
    })
    .await;

    // The node's agent dies (kill -9): the pod's mount answers ENOTCONN, stats say so.
    let pid = agent_serving(&staging).expect("an agent serves the staging path");
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(pid as i32).unwrap(),
        rustix::process::Signal::KILL,
    )
    .unwrap();
    let p1 = pod1.clone();
    let errno = timed("see the dead mount", 30, move || {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match std::fs::metadata(p1.join("kept")) {
                Err(e) => return e.raw_os_error(),
                Ok(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
                Ok(_) => return None,
            }
        }
    })
    .await;
    // ENOTCONN, or ECONNABORTED for a request that was in flight when the connection died.
    assert!(
        matches!(errno, Some(libc::ENOTCONN | libc::ECONNABORTED)),
        "{errno:?}"
    );
    let e = csi
        .node
        .node_get_volume_stats(pb::NodeGetVolumeStatsRequest {
            volume_id: id.clone(),
            volume_path: pod1.to_string_lossy().into_owned(),
            staging_target_path: String::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");

    // A pod started afterwards gets a working volume: publishing mounts the staging path
    // again with a new agent. The old pod's mount stays dead until that pod restarts.
    publish(&mut csi, &id, &staging, &pod2, mode, false)
        .await
        .unwrap();
    assert_ne!(agent_serving(&staging), Some(pid));
    let (p1, p2) = (pod1.clone(), pod2.clone());
    timed("read through the new agent", 30, move || {
        assert_eq!(std::fs::read(p2.join("kept")).unwrap(), b"still here");
        let dead = std::fs::metadata(p1.join("kept"))
            .unwrap_err()
            .raw_os_error();
        assert!(
            matches!(dead, Some(libc::ENOTCONN | libc::ECONNABORTED)),
            "{dead:?}"
        );
    })
    .await;
    let (bytes, _) = stats(&mut csi, &id, &pod2).await;
    assert!(bytes.used > 0);

    // Unpublishing the dead mount works (detached) and removes the directory.
    unpublish(&mut csi, &id, &pod1).await;
    assert!(!pod1.exists());
    unpublish(&mut csi, &id, &pod2).await;
    unstage(&mut csi, &id, &staging).await;
    assert_no_mounts_below(dir.path());
    delete(&mut csi, &id).await;
    drop(csi.guard);
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_driver_and_its_agents_speak_mutual_tls() {
    if !can_mount() {
        return;
    }
    let certs = tempfile::tempdir().unwrap();
    let pki = cluster::pki(certs.path());
    let OneNode {
        srv,
        dir,
        _sweep,
        mut csi,
        staging,
        pods,
    } = OneNode::start_with(Some(&pki)).await;
    let mode = Mode::SingleNodeWriter;
    let id = create(&mut csi, "pvc-tls", 4 * MIB as i64, mode)
        .await
        .volume_id;
    let target = pods.join("mount");
    stage(&mut csi, &id, &staging, mode).await;
    publish(&mut csi, &id, &staging, &target, mode, false)
        .await
        .unwrap();
    let t = target.clone();
    timed("write and read over TLS", 30, move || {
        let data = crate::support::pattern(300_000, 5);
        std::fs::write(t.join("f"), &data).unwrap();
        assert_eq!(std::fs::read(t.join("f")).unwrap(), data);
    })
    .await;
    let (bytes, inodes) = stats(&mut csi, &id, &target).await;
    assert!(bytes.used >= 300_000 && inodes.used == 1);
    unpublish(&mut csi, &id, &target).await;
    unstage(&mut csi, &id, &staging).await;
    assert_no_mounts_below(dir.path());
    delete(&mut csi, &id).await;
    drop(csi.guard);
    srv.stop().await;
}

/// Issue 21: given several server addresses, the first refusing (as a standby does: it does
/// not listen), the driver and the agents it starts talk to the one that answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_list_reaches_the_server_that_answers() {
    if !can_mount() {
        return;
    }
    let dead = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let OneNode {
        srv,
        dir,
        _sweep,
        mut csi,
        staging,
        pods,
    } = OneNode::start_full(None, Vec::new(), |addr| format!("{dead},{addr}")).await;
    let mode = Mode::SingleNodeWriter;
    let id = create(&mut csi, "pvc-list", 4 * MIB as i64, mode)
        .await
        .volume_id;
    let target = pods.join("mount");
    stage(&mut csi, &id, &staging, mode).await;
    publish(&mut csi, &id, &staging, &target, mode, false)
        .await
        .unwrap();
    // The agent was given the whole list.
    let text = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let source = parse_mountinfo(&text)
        .into_iter()
        .find(|m| m.mount_point == staging)
        .map(|m| m.source)
        .unwrap();
    assert!(
        source.starts_with(&format!("{dead},{}:/", srv.addr)) && source.ends_with(&id),
        "{source}"
    );
    let t = target.clone();
    timed("write and read through a server list", 30, move || {
        let data = crate::support::pattern(300_000, 7);
        std::fs::write(t.join("f"), &data).unwrap();
        assert_eq!(std::fs::read(t.join("f")).unwrap(), data);
    })
    .await;
    unpublish(&mut csi, &id, &target).await;
    unstage(&mut csi, &id, &staging).await;
    assert_no_mounts_below(dir.path());
    delete(&mut csi, &id).await;
    drop(csi.guard);
    srv.stop().await;
}

/// Whether the mount table lists a mount at exactly `path`.
fn mounted_at(path: &Path) -> bool {
    let text = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    parse_mountinfo(&text).iter().any(|m| m.mount_point == path)
}

/// Issue 16 item 7: kubelet paths under a symbolic link (`/var/lib/kubelet` often is one)
/// stage, publish, report and come down as plain ones, mounted (and found in mountinfo) at
/// the link's target; and an unpublish or unstage naming a volume that is not the one mounted
/// at the path (an unknown volume, or another one) leaves that mount and its directory alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn symlinked_kubelet_paths_and_mounts_of_other_volumes() {
    if !can_mount() {
        return;
    }
    let mut n = OneNode::start().await;
    let base = std::fs::canonicalize(n.dir.path()).unwrap();
    let real = base.join("real-kubelet");
    std::fs::create_dir_all(real.join("pods/pod1")).unwrap();
    std::os::unix::fs::symlink(&real, base.join("kubelet")).unwrap();
    // A relative link inside, too.
    std::os::unix::fs::symlink("pods", real.join("p")).unwrap();
    let link = base.join("kubelet");
    let (staging, target) = (link.join("staging"), link.join("p/pod1/mount"));
    let (real_staging, real_target) = (real.join("staging"), real.join("pods/pod1/mount"));

    let mode = Mode::SingleNodeWriter;
    let id = create(&mut n.csi, "pvc-linked", 16 * MIB as i64, mode)
        .await
        .volume_id;
    stage(&mut n.csi, &id, &staging, mode).await;
    assert!(mounted_at(&real_staging), "staged at the link's target");
    stage(&mut n.csi, &id, &staging, mode).await; // idempotent: found in mountinfo
    publish(&mut n.csi, &id, &staging, &target, mode, false)
        .await
        .unwrap();
    assert!(mounted_at(&real_target));
    publish(&mut n.csi, &id, &staging, &target, mode, false)
        .await
        .unwrap();
    let (t, r) = (target.clone(), real_target.clone());
    timed("write through the linked path", 30, move || {
        std::fs::write(t.join("f"), b"via the link").unwrap();
        assert_eq!(std::fs::read(r.join("f")).unwrap(), b"via the link");
    })
    .await;
    let (bytes, _) = stats(&mut n.csi, &id, &target).await;
    assert!(bytes.used > 0);

    // A second volume, staged and published at plain paths.
    let other = create(&mut n.csi, "pvc-other", 16 * MIB as i64, mode)
        .await
        .volume_id;
    let other_staging = n.staging.clone();
    let other_target = n.pods.join("pod2");
    stage(&mut n.csi, &other, &other_staging, mode).await;
    publish(
        &mut n.csi,
        &other,
        &other_staging,
        &other_target,
        mode,
        false,
    )
    .await
    .unwrap();
    for (vol, path, unstaging) in [
        ("no-such-volume", &other_target, false),
        (id.as_str(), &other_target, false),
        ("no-such-volume", &other_staging, true),
        (id.as_str(), &other_staging, true),
    ] {
        let r = if unstaging {
            n.csi
                .node
                .node_unstage_volume(pb::NodeUnstageVolumeRequest {
                    volume_id: vol.to_owned(),
                    staging_target_path: path.to_string_lossy().into_owned(),
                })
                .await
                .map(drop)
        } else {
            n.csi
                .node
                .node_unpublish_volume(pb::NodeUnpublishVolumeRequest {
                    volume_id: vol.to_owned(),
                    target_path: path.to_string_lossy().into_owned(),
                })
                .await
                .map(drop)
        };
        let e = r.expect_err("another volume's mount is refused");
        assert_eq!(e.code(), Code::FailedPrecondition, "{vol} at {path:?}: {e}");
        assert!(mounted_at(path), "{vol} at {path:?}: the mount is left");
        assert!(path.is_dir());
    }
    let p = other_target.clone();
    timed("the other volume still serves", 30, move || {
        std::fs::write(p.join("g"), b"still here").unwrap();
    })
    .await;

    // Down through the links: nothing is left at the real paths.
    unpublish(&mut n.csi, &id, &target).await;
    assert!(!mounted_at(&real_target) && !real_target.exists());
    unpublish(&mut n.csi, &id, &target).await; // idempotent
    unstage(&mut n.csi, &id, &staging).await;
    assert!(!mounted_at(&real_staging));
    unpublish(&mut n.csi, &other, &other_target).await;
    unstage(&mut n.csi, &other, &other_staging).await;
    assert_no_mounts_below(&base);
    delete(&mut n.csi, &id).await;
    delete(&mut n.csi, &other).await;
    n.srv.stop().await;
}

/// `GET /metrics` on `port`, the body.
fn scrape(port: u16) -> String {
    use std::io::Read as _;
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    assert!(out.starts_with("HTTP/1.1 200 OK"), "{out}");
    out.split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default()
}

/// Issue 22 item 3: `sanfs-csi --metrics` is the node's one metrics endpoint: its own
/// metrics and those of each volume's agent (asked over the agent's control socket, no port
/// per agent), labelled by volume, each family described once; two volumes staged on the node
/// both mount and both report; an unstaged volume's agent leaves the scrape. `metrics=` in
/// the agents' options (which would give every agent the same port) is refused at start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_metrics_endpoint_per_node_with_every_agent_labelled_by_volume() {
    if !can_mount() {
        return;
    }
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let OneNode {
        srv,
        dir,
        _sweep,
        mut csi,
        staging,
        pods,
    } = OneNode::start_args(None, vec!["--metrics".into(), format!("127.0.0.1:{port}")]).await;
    let mode = Mode::MultiNodeMultiWriter;
    let body = scrape(port);
    assert!(body.contains("sanfs_csi_volumes_staged 0"), "{body}");
    // The liveness endpoint on the same port.
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.write_all(b"GET /healthz HTTP/1.1\r\nConnection: close\r\n\r\n")
        .unwrap();
    let mut health = String::new();
    std::io::Read::read_to_string(&mut s, &mut health).unwrap();
    assert!(
        health.starts_with("HTTP/1.1 200 OK") && health.ends_with("ok\n"),
        "{health}"
    );
    assert!(body.contains("sanfs_csi_server_session 1"), "{body}");
    assert!(body.contains("sanfs_csi_build_info{version="), "{body}");

    let mut ids = Vec::new();
    for name in ["pvc-h14-m1", "pvc-h14-m2"] {
        let id = create(&mut csi, name, 64 * MIB as i64, mode)
            .await
            .volume_id;
        let st = staging.join(name);
        stage(&mut csi, &id, &st, mode).await;
        let target = pods.join(name);
        publish(&mut csi, &id, &st, &target, mode, false)
            .await
            .unwrap();
        timed("write through the published volume", 60, move || {
            std::fs::write(target.join("f"), vec![9u8; 2 * MIB as usize]).unwrap();
            std::fs::read(target.join("f")).unwrap().len()
        })
        .await;
        ids.push((id, st, pods.join(name)));
    }
    let body = scrape(port);
    assert!(body.contains("sanfs_csi_volumes_staged 2"), "{body}");
    for (id, _, _) in &ids {
        assert!(
            body.contains(&format!("sanfs_csi_agent_up{{volume=\"{id}\"}} 1")),
            "{body}"
        );
        let written = format!("sanfs_agent_direct_bytes_total{{volume=\"{id}\",op=\"write\"}} ");
        let v: f64 = body
            .lines()
            .find_map(|l| l.strip_prefix(&written))
            .unwrap_or_else(|| panic!("no {written} in:\n{body}"))
            .trim()
            .parse()
            .unwrap();
        // Most of the 2 MiB went direct (a tail shorter than a block may go proxied).
        assert!(v >= MIB as f64, "{written}{v}");
        assert!(
            body.contains(&format!(
                "sanfs_agent_fuse_op_seconds_count{{volume=\"{id}\",op=\"write\"}}"
            )),
            "{body}"
        );
    }
    // One HELP and TYPE per family, however many agents.
    for line in body.lines().filter(|l| l.starts_with("# TYPE ")) {
        assert_eq!(body.matches(&format!("{line}\n")).count(), 1, "{line}");
    }
    assert_eq!(
        body.matches("# TYPE sanfs_agent_direct_bytes_total counter")
            .count(),
        1,
        "{body}"
    );

    let (id, st, target) = ids.pop().unwrap();
    unpublish(&mut csi, &id, &target).await;
    unstage(&mut csi, &id, &st).await;
    let body = scrape(port);
    assert!(body.contains("sanfs_csi_volumes_staged 1"), "{body}");
    assert!(!body.contains(&format!("volume=\"{id}\"")), "{body}");
    let (id, st, target) = ids.pop().unwrap();
    unpublish(&mut csi, &id, &target).await;
    unstage(&mut csi, &id, &st).await;
    drop(csi);

    let out = Command::new(env!("CARGO_BIN_EXE_sanfs-csi"))
        .args([
            "--endpoint",
            &format!("unix://{}", dir.path().join("x.sock").display()),
        ])
        .args(["--server", &srv.addr.to_string()])
        .args(["--agent-options", "attr_ttl=1s,metrics=127.0.0.1:9999"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--metrics"), "{err}");
    assert_no_mounts_below(dir.path());
}
