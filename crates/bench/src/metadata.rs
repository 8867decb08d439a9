//! Metadata operations per second through the real gRPC services, from an in-process client
//! with many concurrent callers, against a server whose store is a durable file (every
//! acknowledged operation is on disk: `fdatasync` per group commit).
//!
//! Each caller works in a directory of its own: it creates `files` files, stats each one,
//! lists its directory, and unlinks them all. The figures are operations per second per phase
//! and the operations per durable commit that group commit reached under that load.

use std::time::{Duration, Instant};

use anyhow::Context;
use sanfs_blockmap::volume::{DeviceId, Volume, VolumeDevice};
use sanfs_mds::clock::Clock;
use sanfs_mds::store::{Backend, FsInfo};
use sanfs_proto::pb;
use sanfs_proto::pb::admin_client::AdminClient;
use sanfs_proto::pb::namespace_client::NamespaceClient;
use sanfs_proto::pb::session_client::SessionClient;
use tonic::transport::Channel;

/// What to run.
#[derive(Debug, Clone)]
pub struct MetadataParams {
    /// Concurrent callers.
    pub callers: usize,
    /// Files per caller.
    pub files: usize,
    /// Where the store file lives (a directory); a fresh temporary one if `None`.
    pub dir: Option<std::path::PathBuf>,
}

/// One phase's result.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Phase {
    pub op: &'static str,
    pub ops: u64,
    pub seconds: f64,
    pub ops_per_sec: f64,
}

/// The whole run's result.
#[derive(Debug, Clone, serde::Serialize)]
pub struct MetadataReport {
    pub callers: usize,
    pub files_per_caller: usize,
    pub phases: Vec<Phase>,
    /// Durable commits and the transactions they carried, over the whole run.
    pub commits: u64,
    pub transactions: u64,
    pub ops_per_commit: f64,
}

fn cred() -> Option<pb::Credentials> {
    Some(pb::Credentials {
        uid: 0,
        gid: 0,
        groups: vec![],
    })
}

/// A volume of four 1 TiB LUNs (the metadata benchmark does no data I/O: the LUNs need not
/// exist).
fn volume() -> anyhow::Result<Volume> {
    let devices = (0..4u128)
        .map(|i| VolumeDevice {
            uuid: DeviceId::Sanfs(uuid::Uuid::from_u128(0x5a4f5 + i)),
            size_bytes: 1 << 40,
        })
        .collect();
    Volume::striped(4096, devices, 1 << 20, 64 << 10).context("build the benchmark volume")
}

async fn caller(
    ch: Channel,
    session: u64,
    index: usize,
    files: usize,
    phase: &'static str,
) -> anyhow::Result<u64> {
    let mut ns = NamespaceClient::new(ch);
    let dir_name = format!("caller{index}");
    let dir = ns
        .lookup(pb::LookupRequest {
            session: None,
            cred: cred(),
            parent: 1,
            name: dir_name.clone().into(),
        })
        .await?
        .into_inner()
        .attr
        .context("lookup without attributes")?
        .ino;
    let mut ops = 0u64;
    match phase {
        "create" => {
            for f in 0..files {
                let r = ns
                    .create(pb::CreateRequest {
                        cred: cred(),
                        session,
                        parent: dir,
                        name: format!("f{f}").into(),
                        perm: 0o644,
                        exclusive: true,
                        flags: Some(pb::OpenFlags {
                            read: true,
                            write: true,
                            append: false,
                            truncate: false,
                        }),
                        delegate: false,
                        inode: 0,
                        time: None,
                        request_id: None,
                    })
                    .await?
                    .into_inner();
                ns.release(pb::ReleaseRequest {
                    session,
                    handle: r.handle,
                })
                .await?;
                ops += 1;
            }
        }
        "stat" => {
            for f in 0..files {
                ns.lookup(pb::LookupRequest {
                    session: None,
                    cred: cred(),
                    parent: dir,
                    name: format!("f{f}").into(),
                })
                .await?;
                ops += 1;
            }
        }
        "readdir" => {
            let mut cookie = 0;
            loop {
                let r = ns
                    .read_dir(pb::ReadDirRequest {
                        session: None,
                        cred: cred(),
                        inode: dir,
                        cookie,
                        max_entries: 256,
                        plus: true,
                    })
                    .await?
                    .into_inner();
                ops += r.entries.len() as u64;
                match r.entries.last() {
                    Some(e) if !r.eof => cookie = e.cookie,
                    _ => break,
                }
            }
        }
        _ => {
            for f in 0..files {
                ns.unlink(pb::UnlinkRequest {
                    cred: cred(),
                    parent: dir,
                    name: format!("f{f}").into(),
                    request_id: None,
                })
                .await?;
                ops += 1;
            }
        }
    }
    Ok(ops)
}

/// Runs the benchmark.
pub async fn run(p: &MetadataParams) -> anyhow::Result<MetadataReport> {
    let tmp = tempfile::tempdir()?;
    let dir = p.dir.clone().unwrap_or_else(|| tmp.path().to_path_buf());
    let store_path = dir.join(format!("bench-{}.redb", std::process::id()));
    let backend = Backend::File(store_path.clone());
    let info = FsInfo {
        fs_uuid: uuid::Uuid::new_v4(),
        volume: volume()?,
        lvm: None,
    };
    sanfs_testcluster::mds::create_store(&backend, &info, &Clock::System)?;
    let mut opts =
        sanfs_testcluster::mds::serve_options("127.0.0.1:0".parse()?, backend, Vec::new());
    opts.lease_ttl_ms = 60_000;
    opts.batch_max = 256;
    let mut server = sanfs_testcluster::mds::spawn_serve(
        &tokio::runtime::Handle::current(),
        opts,
        Clock::System,
    );
    let addr = server.listening().await?;
    let ch = Channel::from_shared(format!("http://{addr}"))?
        .connect()
        .await?;
    let session = SessionClient::new(ch.clone())
        .open_session(pb::OpenSessionRequest {
            protocol_version: sanfs_proto::model::PROTOCOL_VERSION,
            client_name: "sanfs-bench".into(),
            host: "localhost".into(),
            agent_version: env!("CARGO_PKG_VERSION").into(),
        })
        .await?
        .into_inner()
        .session;
    let mut ns = NamespaceClient::new(ch.clone());
    for i in 0..p.callers {
        ns.mkdir(pb::MkdirRequest {
            cred: cred(),
            parent: 1,
            name: format!("caller{i}").into(),
            perm: 0o755,
            delegate: false,
            request_id: None,
        })
        .await?;
    }
    let mut admin = AdminClient::new(ch.clone());
    let before = admin
        .server_status(pb::ServerStatusRequest {})
        .await?
        .into_inner()
        .commits
        .unwrap_or_default();
    let mut phases = Vec::new();
    for op in ["create", "stat", "readdir", "unlink"] {
        let started = Instant::now();
        let mut tasks = Vec::new();
        for i in 0..p.callers {
            tasks.push(tokio::spawn(caller(ch.clone(), session, i, p.files, op)));
        }
        let mut ops = 0;
        for t in tasks {
            ops += t.await??;
        }
        let seconds = started.elapsed().as_secs_f64().max(1e-9);
        phases.push(Phase {
            op,
            ops,
            seconds,
            ops_per_sec: ops as f64 / seconds,
        });
    }
    let after = admin
        .server_status(pb::ServerStatusRequest {})
        .await?
        .into_inner()
        .commits
        .unwrap_or_default();
    tokio::time::timeout(Duration::from_secs(30), server.stop())
        .await
        .context("the server did not stop")??;
    let _ = std::fs::remove_file(&store_path);
    let commits = after.commits - before.commits;
    let transactions = after.transactions - before.transactions;
    Ok(MetadataReport {
        callers: p.callers,
        files_per_caller: p.files,
        phases,
        commits,
        transactions,
        ops_per_commit: transactions as f64 / commits.max(1) as f64,
    })
}

impl std::fmt::Display for MetadataReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "metadata through gRPC, {} concurrent callers x {} files, durable file store",
            self.callers, self.files_per_caller
        )?;
        writeln!(
            f,
            "{:<10} {:>10} {:>10} {:>12}",
            "op", "ops", "seconds", "ops/s"
        )?;
        for p in &self.phases {
            writeln!(
                f,
                "{:<10} {:>10} {:>10.3} {:>12.0}",
                p.op, p.ops, p.seconds, p.ops_per_sec
            )?;
        }
        write!(
            f,
            "group commit: {} transactions in {} durable commits = {:.1} per commit",
            self.transactions, self.commits, self.ops_per_commit
        )
    }
}
