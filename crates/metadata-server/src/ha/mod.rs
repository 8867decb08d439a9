//! High availability: several `sanfs-mds` candidates share one metadata LUN; etcd elects the
//! one that serves, and fences the others (docs/operations.md, "High availability").
//!
//! - **Election.** Each candidate takes an etcd lease (`ha.lease_ttl_s`, 2 s by default) and
//!   campaigns in the election `ha.election` with its advertised address as value (etcd's
//!   election service: the oldest key under the name leads). A standby does not open the
//!   store and does not listen: agents, which try every server address they were given,
//!   reach only the leader.
//! - **Fencing epoch.** The leader's epoch is its election key's create revision: later
//!   leaders always have larger ones. Before it reads anything the leader writes its epoch
//!   into the metadata device's header (refusing if the header holds one as new), and every
//!   commit re-checks it there (`store::device`).
//! - **Self-fencing.** A [`Keeper`] renews the lease every third of its TTL and moves the
//!   [`Fence`]'s deadline to the send time of the last answered keep-alive plus the TTL, less
//!   a margin; the device refuses writes past the deadline, so a leader cut off from etcd (or
//!   paused) stops writing before etcd can elect another. The keeper also checks that this
//!   server still leads the election.
//! - **Losing leadership** (the deadline passed, the key is gone, the device names a newer
//!   epoch): the process starts over as a candidate at once by executing itself again (same
//!   pid, every descriptor closed, nothing of the old state kept), so it becomes a standby.
//! - **A clean stop** (SIGTERM) resigns and revokes the lease after serving has stopped, so a
//!   standby takes over without waiting for the lease to run out: a rolling restart.

pub mod etcd;
pub mod gate;

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use sanfs_proto::etcd::v3electionpb::LeaderKey;
use serde::Serialize;

pub use etcd::{Etcd, EtcdError, EtcdTls};

use crate::store::fence::Fence;

/// Gauge: 1 while this process leads (it is only scraped while it serves).
pub const HA_LEADER: &str = "sanfs_ha_leader";
/// Gauge: this leader's fencing epoch.
pub const HA_EPOCH: &str = "sanfs_ha_epoch";
/// Gauge: seconds from winning the election to serving (the takeover's own share).
pub const HA_TAKEOVER_SECONDS: &str = "sanfs_ha_takeover_seconds";
/// Gauge: seconds this leader may still write (its fence's deadline from now).
pub const HA_FENCE_REMAINING_SECONDS: &str = "sanfs_ha_fence_remaining_seconds";

/// What `[ha]` in mds.toml configures.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HaOptions {
    /// etcd client URLs.
    pub etcd: Vec<String>,
    /// The election's name (its keys live under `NAME/`).
    pub election: String,
    /// The address agents use for this server (the election key's value; `status` shows it).
    pub advertise: String,
    /// The etcd lease's TTL in seconds.
    pub lease_ttl_s: i64,
    /// TLS to etcd.
    pub tls: Option<EtcdTls>,
}

/// The part of the TTL kept as a safety margin between the deadline this process computes
/// and the lease's end at etcd (clock rate differences, the time a write takes to reach the
/// device).
fn margin(ttl: Duration) -> Duration {
    (ttl / 5).max(Duration::from_millis(200))
}

/// How often etcd is asked again while it does not answer.
const RETRY: Duration = Duration::from_millis(500);

/// A leadership won: the fence, and the means to give it back.
pub struct Leadership {
    etcd: Arc<Etcd>,
    lease: i64,
    key: LeaderKey,
    fence: Arc<Fence>,
    lost: tokio::sync::watch::Receiver<bool>,
    keeper: tokio::task::JoinHandle<()>,
    /// When the election was won.
    pub won_at: Instant,
}

impl std::fmt::Debug for Leadership {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Leadership")
            .field("lease", &self.lease)
            .field("epoch", &self.fence.epoch())
            .finish_non_exhaustive()
    }
}

impl Leadership {
    /// The fence the metadata device checks.
    pub fn fence(&self) -> Arc<Fence> {
        self.fence.clone()
    }

    /// The fencing epoch.
    pub fn epoch(&self) -> u64 {
        self.fence.epoch()
    }

    /// Resolves once leadership is lost (never after a clean [`Leadership::resign`]).
    pub async fn lost(&self) {
        let mut rx = self.lost.clone();
        let _ = rx.wait_for(|l| *l).await;
    }

    /// Steps down after serving stopped: the key and the lease go, a standby leads at once.
    pub async fn resign(self) {
        self.keeper.abort();
        self.fence.lose("resigned");
        if let Err(e) = self.etcd.resign(&self.key).await {
            tracing::warn!(error = %e, "resign: the lease will run out instead");
        }
        if let Err(e) = self.etcd.revoke(self.lease).await {
            tracing::warn!(error = %e, "revoke the etcd lease");
        }
        tracing::info!(fencing_epoch = self.fence.epoch(), "resigned leadership");
    }
}

/// Why a campaign ended without leadership.
#[derive(Debug, thiserror::Error)]
pub enum CampaignError {
    /// The lease ran out while campaigning (etcd unreachable or without quorum for longer
    /// than the TTL): start over with a new one.
    #[error("the etcd lease was lost while campaigning")]
    LeaseLost,
    #[error("{0}")]
    Etcd(String),
}

/// Waits for etcd, takes a lease, and campaigns until this server leads. `on_standby` is
/// called once the lease is held and the campaign sent (the server is a standby from then).
pub async fn campaign(
    ha: &HaOptions,
    on_standby: impl FnOnce(),
) -> Result<Leadership, CampaignError> {
    let etcd = Arc::new(
        Etcd::new(&ha.etcd, ha.tls.as_ref()).map_err(|e| CampaignError::Etcd(e.to_string()))?,
    );
    let mut complained = None::<Instant>;
    let (lease, ttl) = loop {
        match etcd.grant(ha.lease_ttl_s).await {
            Ok(granted) => break granted,
            Err(e) => {
                if complained.is_none_or(|t| t.elapsed() >= Duration::from_secs(30)) {
                    tracing::warn!(error = %e, "etcd does not answer; still trying");
                    complained = Some(Instant::now());
                }
                tokio::time::sleep(RETRY).await;
            }
        }
    };
    let ttl = Duration::from_secs(u64::try_from(ttl.max(1)).unwrap_or(1));
    // The lease is kept from now on; the fence gets its epoch when the campaign is won.
    let granted_at = Instant::now();
    let fence = Arc::new(Fence::new(0, granted_at + ttl.saturating_sub(margin(ttl))));
    let (lost_tx, lost_rx) = tokio::sync::watch::channel(false);
    let keeper_state = Keeper {
        etcd: etcd.clone(),
        lease,
        ttl,
        fence: fence.clone(),
        election: ha.election.clone(),
        lost: lost_tx,
        key: tokio::sync::OnceCell::new(),
    };
    let keeper_key = Arc::new(keeper_state);
    let keeper = tokio::spawn(keeper_key.clone().run());
    tracing::info!(
        election = %ha.election,
        lease = format!("{lease:x}"),
        ttl_s = ttl.as_secs(),
        advertise = %ha.advertise,
        "candidate: campaigning (a standby until elected)"
    );
    on_standby();
    let mut lost = lost_rx.clone();
    let key = loop {
        let campaigned = tokio::select! {
            r = etcd.campaign(&ha.election, lease, &ha.advertise) => r,
            _ = lost.wait_for(|l| *l) => {
                keeper.abort();
                return Err(CampaignError::LeaseLost);
            }
        };
        match campaigned {
            Ok(key) => break key,
            Err(e) => {
                tracing::warn!(error = %e, "campaign interrupted; campaigning again");
                tokio::time::sleep(RETRY).await;
            }
        }
    };
    let epoch = u64::try_from(key.rev).unwrap_or(0);
    if epoch == 0 {
        keeper.abort();
        return Err(CampaignError::Etcd(format!(
            "etcd answered the campaign with revision {}",
            key.rev
        )));
    }
    fence.set_epoch(epoch);
    let _ = keeper_key.key.set(key.key.clone());
    tracing::info!(fencing_epoch = epoch, "elected leader");
    Ok(Leadership {
        etcd,
        lease,
        key,
        fence,
        lost: lost_rx,
        keeper,
        won_at: Instant::now(),
    })
}

/// Renews the lease and watches the leadership (see the module doc).
struct Keeper {
    etcd: Arc<Etcd>,
    lease: i64,
    ttl: Duration,
    fence: Arc<Fence>,
    election: String,
    lost: tokio::sync::watch::Sender<bool>,
    /// This server's election key, once it leads.
    key: tokio::sync::OnceCell<Vec<u8>>,
}

impl Keeper {
    async fn run(self: Arc<Self>) {
        let every = self.ttl / 3;
        loop {
            let sent = Instant::now();
            match tokio::time::timeout(every, self.etcd.keep_alive(self.lease)).await {
                Ok(Ok(left)) if left > 0 => {
                    let left = Duration::from_secs(u64::try_from(left).unwrap_or(0));
                    self.fence
                        .extend(sent + left.saturating_sub(margin(self.ttl)));
                }
                Ok(Ok(_)) => self.fence.lose("the etcd lease expired"),
                Ok(Err(e)) => tracing::warn!(error = %e, "etcd keep-alive failed"),
                Err(_) => tracing::warn!("etcd keep-alive unanswered"),
            }
            if let Some(key) = self.key.get() {
                self.check_leader(key).await;
            }
            if self.fence.check().is_err() {
                let _ = self.lost.send(true);
                return;
            }
            metrics::gauge!(HA_FENCE_REMAINING_SECONDS).set(
                self.fence
                    .deadline()
                    .saturating_duration_since(Instant::now())
                    .as_secs_f64(),
            );
            tokio::time::sleep_until((sent + every).into()).await;
        }
    }

    /// Loses the fence when etcd says another key leads (say an operator deleted ours).
    async fn check_leader(&self, key: &[u8]) {
        let asked = tokio::time::timeout(self.ttl / 3, self.etcd.leader(&self.election)).await;
        match asked {
            Ok(Ok(Some(kv))) if kv.key != key => self.fence.lose(format!(
                "etcd names another leader ({})",
                String::from_utf8_lossy(&kv.value)
            )),
            Ok(Ok(None)) => self.fence.lose("etcd has no leader for the election"),
            _ => {}
        }
    }
}

/// Starts this process over as a candidate (see the module doc). Returns only on failure.
pub fn start_over() -> anyhow::Error {
    use std::os::unix::process::CommandExt;
    let mut args = std::env::args_os();
    let argv0 = args.next().unwrap_or_default();
    let err = std::process::Command::new("/proc/self/exe")
        .arg0(argv0)
        .args(args)
        .exec();
    anyhow::Error::new(err).context("execute sanfs-mds again as a candidate")
}

/// What `sanfs-mds status` reports of an HA pair.
#[derive(Debug, Clone, Serialize)]
pub struct HaStatus {
    pub election: String,
    /// The leader's advertised address, if one leads.
    pub leader: Option<String>,
    /// The leader's fencing epoch.
    pub epoch: Option<u64>,
    /// The standbys' advertised addresses, next leader first.
    pub standbys: Vec<String>,
    /// The fencing epoch in the metadata device's header (the last leader that claimed it).
    pub device_epoch: Option<u64>,
}

/// Asks etcd who leads and who stands by.
pub async fn status(ha: &HaOptions) -> anyhow::Result<HaStatus> {
    let etcd = Etcd::new(&ha.etcd, ha.tls.as_ref())?;
    let all = etcd
        .candidates(&ha.election)
        .await
        .context("list the candidates in etcd")?;
    let mut names = all.iter().map(|kv| {
        (
            String::from_utf8_lossy(&kv.value).into_owned(),
            kv.create_revision,
        )
    });
    let first = names.next();
    Ok(HaStatus {
        election: ha.election.clone(),
        leader: first.as_ref().map(|(a, _)| a.clone()),
        epoch: first.and_then(|(_, rev)| u64::try_from(rev).ok()),
        standbys: names.map(|(a, _)| a).collect(),
        device_epoch: None,
    })
}
