//! Prometheus metrics: what the server counts, and a tiny HTTP/1.1 responder that serves
//! them in the text format on `GET /metrics`.
//!
//! | metric | kind | labels | meaning |
//! |---|---|---|---|
//! | `sanfs_rpc_requests_total` | counter | `rpc`, `code` | requests answered, by gRPC code |
//! | `sanfs_rpc_duration_seconds` | histogram | `rpc` | time from request to answer |
//! | `sanfs_commits_total` | counter | | durable group commits |
//! | `sanfs_commit_ops_total` | counter | | metadata transactions made durable |
//! | `sanfs_commit_ops_per_commit` | gauge | | `sanfs_commit_ops_total / sanfs_commits_total` |
//! | `sanfs_commit_duration_seconds` | histogram | | time of each durable commit: its transactions, then the fsync |
//! | `sanfs_commit_ops` | histogram | | transactions carried by each commit (group commit) |
//! | `sanfs_sessions` | gauge | | live sessions |
//! | `sanfs_grants_total` | counter | `op` | grants issued, read and write |
//! | `sanfs_grant_bytes_total` | counter | `op` | bytes those grants covered |
//! | `sanfs_grants_live` | gauge | | grants out now |
//! | `sanfs_recalls_total` | counter | | recalls of cached grants sent to holders |
//! | `sanfs_leases_total` | counter | `kind`, `result` | attribute (`attr`) and entry (`entry`) leases and directories' create delegations (`creates`) `granted`; create delegations `recalled`; leases `refused` (kind `any`) |
//! | `sanfs_lease_recalls_total` | counter | `result` | lease recalls `sent`, and those that went unanswered for the lease's term (`timeout`) |
//! | `sanfs_lease_renewals_total` | counter | `result` | leases renewed for another term by agents' heartbeats (`renewed`), and those asked for but no longer held (`lost`) |
//! | `sanfs_leases_live` | gauge | | (inode, session) lease holds now |
//! | `sanfs_lock_waits_total` | counter | | requests that waited for a range lock |
//! | `sanfs_expired_grants_total` | counter | | grants dropped with their session |
//! | `sanfs_evictions_total` | counter | | sessions evicted (hold limit, `Admin.EvictSession`) |
//! | `sanfs_namespace_barrier_syncs_total` | counter | | syncs made before a read so that it sees no other session's change that is not yet durable |
//! | `sanfs_namespace_replays_total` | counter | `outcome` | namespace changes sent again after a restart (`sanfs-replay`): `durable` (it had survived), `replayed`, `refused` |
//! | `sanfs_reserved_inodes_total` | counter | | inode numbers reserved to sessions (`ReserveInodes`) for creates answered by their agents |
//! | `sanfs_delegation_reclaims_total` | counter | `outcome` | write delegations reclaimed in the reclaim window by agents that held writes back under them (`granted`, `refused`) |
//! | `sanfs_zeroed_bytes_total` | counter | | bytes zeroed on the LUNs before they were granted Unwritten |
//! | `sanfs_proxied_bytes_total` | counter | `op` | bytes read and written through the server |
//! | `sanfs_open_small_files_total` | counter | | opens answered with the whole of a small file (`OpenRequest.read_small`) |
//! | `sanfs_handles_released_with_calls_total` | counter | | open handles released with another call (its `sanfs-release` header) |
//! | `sanfs_tls_handshakes_refused_total` | counter | | connections closed before their TLS handshake completed ([`crate::handshake`]) |
//! | `sanfs_auth_refused_total` | counter | `code` | callers refused by the authenticator (`service::identity`) |
//! | `sanfs_insecure_requests_total` | counter | | plaintext calls accepted because of `insecure` |
//! | `sanfs_foreign_session_refused_total` | counter | | calls naming another identity's session |
//! | `sanfs_backups_total` | counter | `result` | backups of the metadata store (`Admin.BackupStore`), `ok` or `failed` |
//! | `sanfs_backup_duration_seconds` | gauge | | time the last backup that succeeded took |
//! | `sanfs_backup_last_success_timestamp_seconds` | gauge | | when (server clock, Unix seconds) the last backup that succeeded was taken |
//! | `sanfs_build_info` | gauge | `version` | always 1: the serving version |
//! | `sanfs_capacity_bytes` | gauge | | the volume's data capacity |
//! | `sanfs_free_bytes` | gauge | | data capacity no file holds |
//! | `sanfs_inodes` | gauge | | inodes in use |
//!
//! Every family carries its `# HELP` text (`describe_*` below).
//!
//! RPC counters and latencies go to the process-wide `metrics` recorder, installed once by
//! [`install`]; what the server counts itself is published per scrape ([`render`]), read
//! through one narrow interface, [`Counters`], which the service implements (so this module
//! knows nothing of the service). The
//! exporter's own HTTP listener is compiled out (default features off), and
//! [`serve_metrics`] answers scrapes through the shared endpoint
//! ([`sanfs_proto::exposition`], hyper's HTTP/1.1): `GET` or `HEAD /metrics`, anything else a
//! 404 (405 for another method), keep-alive, a bounded request head and its timeout.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use sanfs_proto::exposition::{self, Page};
use tokio::net::TcpListener;

use crate::store::{COMMIT_OPS, COMMIT_SECONDS, DATA_FLUSHES};

/// Counter: opens answered with the whole of a small file (`OpenRequest::read_small`).
pub const OPEN_SMALL_FILES: &str = "sanfs_open_small_files_total";
/// Counter: handles released with another call (its `sanfs-release` header).
pub const RELEASED_WITH_CALLS: &str = "sanfs_handles_released_with_calls_total";

/// What the server counts itself, as read at one scrape.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct Figures {
    pub read_grants: u64,
    pub write_grants: u64,
    pub granted_read_bytes: u64,
    pub granted_write_bytes: u64,
    pub recalls: u64,
    pub lock_waits: u64,
    pub expired_grants: u64,
    pub evictions: u64,
    pub zeroed_bytes: u64,
    pub proxied_read_bytes: u64,
    pub proxied_write_bytes: u64,
    pub grants_live: usize,
    pub commits: u64,
    pub commit_ops: u64,
    pub sessions: usize,
    /// The volume's data blocks, in bytes.
    pub capacity_bytes: u64,
    /// Of them free (not allocated to any file), in bytes.
    pub free_bytes: u64,
    /// Inodes in use.
    pub inodes: u64,
    /// Attribute and entry leases ([`crate::leases`]).
    pub leases: LeaseFigures,
}

/// Attribute and entry leases given, refused and recalled.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct LeaseFigures {
    pub attr_granted: u64,
    pub entry_granted: u64,
    pub refused: u64,
    pub recalls: u64,
    pub recall_timeouts: u64,
    /// Renewed by heartbeats, and asked for but no longer held.
    pub renewed: u64,
    pub renew_lost: u64,
    pub live: usize,
    /// Create delegations of directories given, and taken back (recalled).
    pub creates_granted: u64,
    pub creates_recalled: u64,
}

/// The server's own counters, read at each scrape (the service implements it).
pub trait Counters: Send + Sync {
    fn figures(&self) -> Figures;
}

/// Buckets of `sanfs_commit_ops`: transactions per commit, 1 to 4096.
const COMMIT_OPS_BUCKETS: &[f64] = &[
    1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 4096.0,
];

/// Latency buckets of `sanfs_rpc_duration_seconds` and `sanfs_commit_duration_seconds`, 50 us
/// to 10 s.
const DURATION_BUCKETS: &[f64] = &[
    0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 10.0,
];

static HANDLE: OnceLock<Option<PrometheusHandle>> = OnceLock::new();

/// Installs the Prometheus recorder as the process's `metrics` recorder (once); `None` if
/// another recorder was installed first.
pub fn install() -> Option<&'static PrometheusHandle> {
    HANDLE
        .get_or_init(|| {
            let buckets = [
                ("sanfs_rpc_duration_seconds", DURATION_BUCKETS),
                (COMMIT_SECONDS, DURATION_BUCKETS),
                (COMMIT_OPS, COMMIT_OPS_BUCKETS),
            ];
            let mut builder = PrometheusBuilder::new();
            for (name, list) in buckets {
                builder = match builder.set_buckets_for_metric(Matcher::Full(name.to_owned()), list)
                {
                    Ok(b) => b,
                    // Only an empty bucket list is refused; ours are not empty.
                    Err(_) => PrometheusBuilder::new(),
                };
            }
            let recorder = builder.build_recorder();
            let handle = recorder.handle();
            match metrics::set_global_recorder(recorder) {
                Ok(()) => {
                    describe_recorded();
                    Some(handle)
                }
                Err(_) => {
                    tracing::warn!("another metrics recorder is installed: no Prometheus metrics");
                    None
                }
            }
        })
        .as_ref()
}

/// The `# HELP` lines of what is recorded as it happens (the process-wide recorder).
fn describe_recorded() {
    use metrics::{Unit, describe_counter, describe_histogram};
    describe_counter!(
        "sanfs_namespace_barrier_syncs_total",
        "Syncs made before a read so that it sees no other session's change that is not yet durable."
    );
    describe_counter!(
        "sanfs_namespace_replays_total",
        "Namespace changes sent again after a restart, by outcome (durable, replayed, refused)."
    );
    describe_counter!(
        "sanfs_reserved_inodes_total",
        "Inode numbers reserved to sessions for creates answered by their agents (ReserveInodes)."
    );
    describe_counter!(
        "sanfs_delegation_reclaims_total",
        "Write delegations reclaimed in the reclaim window after a restart, by outcome (granted, refused)."
    );
    describe_counter!(
        "sanfs_rpc_requests_total",
        "Requests answered, by RPC and gRPC code."
    );
    describe_histogram!(
        "sanfs_rpc_duration_seconds",
        Unit::Seconds,
        "Time from a request to its answer, by RPC."
    );
    describe_histogram!(
        COMMIT_SECONDS,
        Unit::Seconds,
        "Time of each durable commit of the metadata store (its transactions, then the fsync)."
    );
    describe_histogram!(
        COMMIT_OPS,
        "Metadata transactions carried by each commit (group commit)."
    );
    describe_counter!(
        DATA_FLUSHES,
        "Flushes of the data LUNs' write caches before a durable commit that makes written data readable."
    );
    {
        use crate::store::journal::*;
        describe_counter!(
            JOURNAL_RECORDS,
            "Records appended to the metadata journal (one per sync the store asked for)."
        );
        describe_counter!(
            JOURNAL_BYTES,
            Unit::Bytes,
            "Bytes appended to the metadata journal."
        );
        describe_counter!(
            JOURNAL_PAGE_BYTES,
            Unit::Bytes,
            "Bytes of the metadata store's page changes before they were packed into journal records."
        );
        describe_counter!(
            JOURNAL_SYNCS,
            "Syncs of the metadata journal (one per durable commit)."
        );
        describe_counter!(
            JOURNAL_CHECKPOINTS,
            "Checkpoints: the metadata store's file synced and its journal emptied."
        );
        describe_counter!(
            JOURNAL_REPLAYED,
            "Journal records replayed when the metadata store was opened."
        );
    }
    describe_counter!(
        crate::proxy::DATA_JOURNALED,
        "Small proxied writes journaled with their commit instead of a flush of the data LUNs."
    );
    describe_counter!(
        crate::proxy::DATA_SETTLES,
        "Settlings of journaled data: the data LUNs flushed, the journal told it need not replay it."
    );
    describe_counter!(
        "sanfs_tls_handshakes_refused_total",
        "Connections closed before their TLS handshake completed."
    );
    describe_counter!(
        "sanfs_auth_refused_total",
        "Callers refused by the authenticator, by gRPC code."
    );
    describe_counter!(
        "sanfs_insecure_requests_total",
        "Plaintext calls accepted because server.insecure is set."
    );
    describe_counter!(
        "sanfs_backups_total",
        "Backups of the metadata store (Admin.BackupStore), by result (ok, failed)."
    );
    metrics::describe_gauge!(
        "sanfs_backup_duration_seconds",
        Unit::Seconds,
        "Time the last successful backup of the metadata store took."
    );
    metrics::describe_gauge!(
        "sanfs_backup_last_success_timestamp_seconds",
        Unit::Seconds,
        "When the last successful backup of the metadata store was taken (Unix seconds)."
    );
    describe_counter!(
        "sanfs_foreign_session_refused_total",
        "Calls naming a session of another identity, refused."
    );
    describe_counter!(
        OPEN_SMALL_FILES,
        "Opens answered with the whole of a small file (OpenRequest.read_small)."
    );
    describe_counter!(
        RELEASED_WITH_CALLS,
        "Open handles released with another call (its sanfs-release header), not by a Release of their own."
    );
}

/// Counts and times one answered request.
pub fn record_rpc(rpc: &'static str, code: tonic::Code, elapsed: Duration) {
    metrics::counter!("sanfs_rpc_requests_total", "rpc" => rpc, "code" => format!("{code:?}"))
        .increment(1);
    metrics::histogram!("sanfs_rpc_duration_seconds", "rpc" => rpc).record(elapsed.as_secs_f64());
}

/// Counts one backup of the metadata store; a successful one (`taken_at_sec`: its snapshot's
/// time) also sets the last backup's time and duration.
pub fn record_backup(result: Result<i64, ()>, elapsed: Duration) {
    match result {
        Ok(taken_at_sec) => {
            metrics::counter!("sanfs_backups_total", "result" => "ok").increment(1);
            metrics::gauge!("sanfs_backup_duration_seconds").set(elapsed.as_secs_f64());
            #[allow(
                clippy::cast_precision_loss,
                reason = "Unix seconds fit an f64 exactly until the year 285 million"
            )]
            metrics::gauge!("sanfs_backup_last_success_timestamp_seconds").set(taken_at_sec as f64);
        }
        Err(()) => metrics::counter!("sanfs_backups_total", "result" => "failed").increment(1),
    }
}

/// The text exposition of every metric.
///
/// What the server counts itself (grants, recalls, proxied bytes, commits, sessions) is
/// published into a recorder made for this scrape, so that the figures are exactly this
/// server's even where a process runs several servers (the agent's acceptance tests do); the
/// process-wide recorder holds only what is recorded as it happens (the RPC counters and
/// latencies). The two expositions never share a metric name.
pub fn render(server: &dyn Counters) -> String {
    let figures = server.figures();
    let own = PrometheusBuilder::new().build_recorder();
    metrics::with_local_recorder(&own, || publish(&figures));
    let mut text = own.handle().render();
    text.push_str(&install().map(|h| h.render()).unwrap_or_default());
    text
}

/// Sets the server's own counters and gauges in the current recorder, with their `# HELP`.
fn publish(f: &Figures) {
    describe_published();
    metrics::gauge!("sanfs_build_info", "version" => env!("CARGO_PKG_VERSION")).set(1.0);
    metrics::gauge!("sanfs_capacity_bytes").set(f.capacity_bytes as f64);
    metrics::gauge!("sanfs_free_bytes").set(f.free_bytes as f64);
    metrics::gauge!("sanfs_inodes").set(f.inodes as f64);
    metrics::counter!("sanfs_grants_total", "op" => "read").absolute(f.read_grants);
    metrics::counter!("sanfs_grants_total", "op" => "write").absolute(f.write_grants);
    metrics::counter!("sanfs_grant_bytes_total", "op" => "read").absolute(f.granted_read_bytes);
    metrics::counter!("sanfs_grant_bytes_total", "op" => "write").absolute(f.granted_write_bytes);
    metrics::counter!("sanfs_recalls_total").absolute(f.recalls);
    let l = &f.leases;
    metrics::counter!("sanfs_leases_total", "kind" => "attr", "result" => "granted")
        .absolute(l.attr_granted);
    metrics::counter!("sanfs_leases_total", "kind" => "entry", "result" => "granted")
        .absolute(l.entry_granted);
    metrics::counter!("sanfs_leases_total", "kind" => "creates", "result" => "granted")
        .absolute(l.creates_granted);
    metrics::counter!("sanfs_leases_total", "kind" => "creates", "result" => "recalled")
        .absolute(l.creates_recalled);
    metrics::counter!("sanfs_leases_total", "kind" => "any", "result" => "refused")
        .absolute(l.refused);
    metrics::counter!("sanfs_lease_recalls_total", "result" => "sent").absolute(l.recalls);
    metrics::counter!("sanfs_lease_recalls_total", "result" => "timeout")
        .absolute(l.recall_timeouts);
    metrics::counter!("sanfs_lease_renewals_total", "result" => "renewed").absolute(l.renewed);
    metrics::counter!("sanfs_lease_renewals_total", "result" => "lost").absolute(l.renew_lost);
    metrics::gauge!("sanfs_leases_live").set(l.live as f64);
    metrics::counter!("sanfs_lock_waits_total").absolute(f.lock_waits);
    metrics::counter!("sanfs_expired_grants_total").absolute(f.expired_grants);
    metrics::counter!("sanfs_evictions_total").absolute(f.evictions);
    metrics::counter!("sanfs_zeroed_bytes_total").absolute(f.zeroed_bytes);
    metrics::counter!("sanfs_proxied_bytes_total", "op" => "read").absolute(f.proxied_read_bytes);
    metrics::counter!("sanfs_proxied_bytes_total", "op" => "write").absolute(f.proxied_write_bytes);
    metrics::gauge!("sanfs_grants_live").set(f.grants_live as f64);
    metrics::counter!("sanfs_commits_total").absolute(f.commits);
    metrics::counter!("sanfs_commit_ops_total").absolute(f.commit_ops);
    let per_commit = if f.commits == 0 {
        0.0
    } else {
        f.commit_ops as f64 / f.commits as f64
    };
    metrics::gauge!("sanfs_commit_ops_per_commit").set(per_commit);
    metrics::gauge!("sanfs_sessions").set(f.sessions as f64);
}

/// The `# HELP` lines of what [`publish`] sets.
fn describe_published() {
    use metrics::{Unit, describe_counter, describe_gauge};
    describe_gauge!(
        "sanfs_build_info",
        "Always 1; the label says which sanfs-mds version serves."
    );
    describe_gauge!(
        "sanfs_capacity_bytes",
        Unit::Bytes,
        "Data capacity of the volume."
    );
    describe_gauge!(
        "sanfs_free_bytes",
        Unit::Bytes,
        "Data capacity not allocated to any file."
    );
    describe_gauge!("sanfs_inodes", "Inodes in use.");
    describe_counter!(
        "sanfs_grants_total",
        "Grants handed out, by op (read, write)."
    );
    describe_counter!(
        "sanfs_grant_bytes_total",
        Unit::Bytes,
        "Bytes covered by the grants handed out, by op."
    );
    describe_counter!(
        "sanfs_recalls_total",
        "Recalls of cached grants and layouts sent to agents."
    );
    describe_counter!(
        "sanfs_lock_waits_total",
        "Grant or proxied requests that waited for a conflicting range lock."
    );
    describe_counter!(
        "sanfs_expired_grants_total",
        "Grants dropped because their session's lease ended."
    );
    describe_counter!("sanfs_evictions_total", "Sessions evicted.");
    describe_counter!(
        "sanfs_leases_total",
        "Attribute and entry leases granted (by kind) and refused."
    );
    describe_counter!(
        "sanfs_lease_recalls_total",
        "Lease recalls sent to agents, and those unanswered for the lease's term."
    );
    describe_counter!(
        "sanfs_lease_renewals_total",
        "Leases renewed by agents' heartbeats, and those asked for but no longer held."
    );
    describe_gauge!("sanfs_leases_live", "Attribute and entry lease holds now.");
    describe_counter!(
        "sanfs_zeroed_bytes_total",
        Unit::Bytes,
        "Bytes zeroed on the LUNs before they were handed out."
    );
    describe_counter!(
        "sanfs_proxied_bytes_total",
        Unit::Bytes,
        "Bytes read or written by the server itself (the proxied path), by op."
    );
    describe_gauge!("sanfs_grants_live", "Grants held now.");
    describe_counter!(
        "sanfs_commits_total",
        "Durable group commits of the metadata store."
    );
    describe_counter!(
        "sanfs_commit_ops_total",
        "Metadata transactions made durable."
    );
    describe_gauge!(
        "sanfs_commit_ops_per_commit",
        "Transactions per durable commit (group commit)."
    );
    describe_gauge!("sanfs_sessions", "Live agent sessions.");
}

/// Answers scrapes (`GET /metrics`) on `listener` until the task is dropped.
pub async fn serve_metrics(listener: TcpListener, server: Arc<dyn Counters>) {
    let render = Arc::new(move || render(server.as_ref()));
    exposition::serve(listener, Arc::new([("/metrics", Page::Render(render))])).await;
}
