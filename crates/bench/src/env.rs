//! What every figure needs to know about the run: how long (full, `--quick`, `--smoke`),
//! where to put LUN files, how to run the server, or which existing cluster to measure.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use sanfs_client_agent::discovery::{DiscoveryConfig, discover};
use sanfs_client_agent::engine::{Engine, EngineConfig};
use sanfs_testcluster::LunKind;

use crate::cluster::{BenchCluster, ClusterSpec, Mount, ServerMode};
use crate::util::{Budget, GIB, MIB};

/// How long a run takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Length {
    /// The documented figures (`sanfs-bench run`: the paper's parts at most 15 minutes on 2
    /// cores; the everyday and metadata-mount parts take longer).
    Full,
    /// A short look (the paper's parts at most 3 minutes, the mount parts about 2 each).
    Quick,
    /// Every code path once with tiny sizes (CI).
    Smoke,
}

/// An existing sanfs to measure instead of a cluster of the bench's own.
#[derive(Debug, Clone)]
pub struct Existing {
    pub server: SocketAddr,
    pub metrics: Option<SocketAddr>,
    /// Where this node finds the LUNs.
    pub globs: Vec<String>,
    /// Where it is mounted (for the mount rows); none: those rows are skipped.
    pub mount: Option<PathBuf>,
}

/// The run's settings.
#[derive(Debug, Clone)]
pub struct Env {
    pub length: Length,
    /// Where LUN files, stores and mount points go.
    pub work: PathBuf,
    pub server_mode: ServerMode,
    pub existing: Option<Existing>,
    /// Print progress bars.
    pub progress: bool,
    /// I/O sizes asked for on the command line (figure 6, crossover, latency).
    pub sizes: Option<Vec<u64>>,
    /// Counts of the everyday and mount-metadata parts asked for on the command line.
    pub counts: Counts,
    /// Runs of figure 6, reported as each cell's median and spread (at least 1).
    pub fig6_runs: u32,
}

/// Counts asked for on the command line instead of the length's defaults.
#[derive(Debug, Clone, Default)]
pub struct Counts {
    /// Bytes of the everyday part's sequential, random and bonnie files.
    pub everyday_file_len: Option<u64>,
    /// Files and directories of the everyday part's small-file tree.
    pub tree_files: Option<u64>,
    pub tree_dirs: Option<u64>,
    /// Files of the everyday table's source tree.
    pub src_files: Option<u64>,
    /// Files of each configuration of the mount-metadata part (shared by its processes).
    pub md_files: Option<u64>,
    /// Processes of the mount-metadata part's concurrent configurations.
    pub md_processes: Option<u64>,
}

impl Env {
    /// Seconds one throughput cell runs.
    pub fn cell_budget(&self) -> Budget {
        match self.length {
            Length::Full => Budget::new(1.0, 8, 1 << 20),
            Length::Quick => Budget::new(0.25, 4, 1 << 20),
            Length::Smoke => Budget::new(0.02, 2, 64),
        }
    }

    /// Bytes of each file the throughput figures read and write.
    pub fn file_len(&self) -> u64 {
        match self.length {
            Length::Full => 256 * MIB,
            Length::Quick => 64 * MIB,
            Length::Smoke => 16 * MIB,
        }
    }

    /// The sizes asked for, else `default`.
    pub fn sizes_or(&self, default: Vec<u64>) -> Vec<u64> {
        self.sizes.clone().unwrap_or(default)
    }

    pub fn pick<T: Clone>(&self, full: T, quick: T, smoke: T) -> T {
        match self.length {
            Length::Full => full,
            Length::Quick => quick,
            Length::Smoke => smoke,
        }
    }

    /// A progress bar (hidden when progress is off).
    pub fn bar(&self, len: u64, what: &str) -> indicatif::ProgressBar {
        if self.progress {
            crate::util::progress(len, what)
        } else {
            indicatif::ProgressBar::hidden()
        }
    }

    /// A cluster of the bench's own with `luns` LUNs (striped with `stripe_unit`, or linear),
    /// or the existing one.
    pub async fn cluster(
        &self,
        tag: &str,
        luns: usize,
        stripe_unit: Option<u64>,
        lun_size: u64,
    ) -> anyhow::Result<BenchCluster> {
        if let Some(e) = &self.existing {
            return Ok(BenchCluster::existing(e.server, e.metrics, e.globs.clone()));
        }
        BenchCluster::start(
            &ClusterSpec {
                tag: tag.to_owned(),
                luns,
                lun_size: lun_size.max(GIB / 8),
                stripe_unit,
                direct_threshold: 64 * 1024,
                server: self.server_mode,
                lun_kind: LunKind::Auto,
            },
            &self.work,
        )
        .await
    }

    /// A FUSE mount of `cluster` (the existing mount for an existing cluster), or why not.
    pub fn mount(&self, cluster: &BenchCluster, tag: &str) -> Result<MountPoint, String> {
        if let Some(e) = &self.existing {
            return match &e.mount {
                Some(p) => Ok(MountPoint::Existing(p.clone())),
                None => Err("no --mount given for the existing cluster".into()),
            };
        }
        if !sanfs_testcluster::is_root() {
            return Err("FUSE mounts need root".into());
        }
        if crate::util::sibling_binary("sanfs-agent").is_none() {
            return Err("sanfs-agent not found beside sanfs-bench (cargo build --release -p sanfs-client-agent)".into());
        }
        let dir = tempfile::Builder::new()
            .prefix(&format!("sanfs-bench-mnt-{tag}-"))
            .tempdir_in(&self.work)
            .map_err(|e| format!("mount point: {e}"))?;
        let path = dir.path().join("mnt");
        std::fs::create_dir(&path).map_err(|e| format!("mount point: {e}"))?;
        let m = Mount::start(cluster, &path).map_err(|e| format!("{e:#}"))?;
        Ok(MountPoint::Own(m, dir))
    }
}

/// A mounted sanfs.
pub enum MountPoint {
    Own(Mount, tempfile::TempDir),
    Existing(PathBuf),
}

impl MountPoint {
    pub fn path(&self) -> &std::path::Path {
        match self {
            MountPoint::Own(m, _) => &m.path,
            MountPoint::Existing(p) => p,
        }
    }

    /// The agent's process id, when the bench started it.
    pub fn agent_pid(&self) -> Option<u32> {
        match self {
            MountPoint::Own(m, _) => Some(m.agent_pid()),
            MountPoint::Existing(_) => None,
        }
    }

    /// The agent's data-path stage counters now (`sanfs-agent status`, through the mount's
    /// control socket); `None` if the agent does not answer.
    pub fn agent_stages(&self) -> Option<Vec<sanfs_client_agent::stages::StageStat>> {
        use sanfs_client_agent::control;
        let (entry, _) = control::mount_of(self.path()).ok()?;
        let socket = control::socket_path(&control::run_dir(), entry.major, entry.minor);
        let reply = control::ask(&socket, &control::Request::Status).ok()?;
        Some(reply.status?.agent.stages)
    }
}

/// The agent's engine on this node's LUNs of `volume` (found by label, as the agent does):
/// what raw I/O runs on.
pub fn raw_engine(
    volume: &sanfs_blockmap::volume::Volume,
    globs: &[String],
) -> anyhow::Result<Arc<Engine>> {
    let found = discover(
        volume,
        &DiscoveryConfig {
            globs: globs.to_vec(),
        },
    );
    if !found.missing.is_empty() {
        anyhow::bail!(
            "LUNs of the volume not found on this node: {:?}",
            found.missing
        );
    }
    let files = found.into_files(volume.devices().len());
    Ok(Arc::new(
        Engine::new(&EngineConfig::default(), files).context("start the raw I/O engine")?,
    ))
}
