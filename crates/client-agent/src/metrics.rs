//! The agent's Prometheus metrics (`sanfs-agent mount -o metrics=ADDR`).
//!
//! | metric | kind | labels | meaning |
//! |---|---|---|---|
//! | `sanfs_agent_direct_bytes_total` | counter | `op` | bytes read / written on the direct path |
//! | `sanfs_agent_proxied_bytes_total` | counter | `op` | bytes read / written through the server |
//! | `sanfs_agent_grants_total` | counter | `op` | grants asked for (MapRead / MapWrite) |
//! | `sanfs_agent_cached_reads_total` | counter | | reads served from a cached read grant |
//! | `sanfs_agent_layout_writes_total` | counter | | writes done inside a cached write layout |
//! | `sanfs_agent_layouts_ahead_total` | counter | | write layouts asked for ahead of a sequential writer |
//! | `sanfs_agent_cached_grants` | gauge | | read grants cached now |
//! | `sanfs_agent_recalls_total` | counter | | recalls of cached grants answered |
//! | `sanfs_agent_lease_cache_total` | counter | `kind`, `result` | stats (`attr`), lookups (`entry`), extended attribute reads (`xattr`), directory opens (`access`) and listings (`listing`) answered under a lease (`hit`, no RPC) or asked of the server (`miss`) |
//! | `sanfs_agent_lease_recalls_total` | counter | | attribute and entry lease recalls answered |
//! | `sanfs_agent_lease_renewals_total` | counter | `result` | leases renewed by heartbeats (`renewed`), and those asked for that the server no longer held (`lost`) |
//! | `sanfs_agent_small_file_opens_total` | counter | | opens of small files answered with the file's bytes |
//! | `sanfs_agent_small_file_reads_total` | counter | | reads answered from those bytes (no round trip) |
//! | `sanfs_agent_lease_cached` | gauge | `kind` | attributes (`attr`) and names (`entry`) cached under leases now |
//! | `sanfs_agent_sessions_total`, `sanfs_agent_fences_total` | counter | | sessions opened; sessions lost |
//! | `sanfs_agent_creates_here_total` | counter | `result` | creates answered by the agent before the server (`answered`), and those the server then refused (`lost`) |
//! | `sanfs_agent_unlinks_here_total` | counter | `result` | unlinks of files it made answered by the agent before the server (`answered`), and those the server then refused (`lost`) |
//! | `sanfs_agent_renames_here_total` | counter | `result` | renames within their directory of files it made answered by the agent before the server (`answered`), and those the server then refused (`lost`) |
//! | `sanfs_agent_small_files_written_total` | counter | | small files kept in the agent with the bytes it wrote to them whole (a `tar x` or `cp` of small files), under the attribute lease of the write's reply, answering reads as a small file's bytes from its open do |
//! | `sanfs_agent_opens_here_total` | counter | `result` | opens for reading answered by the agent under the file's attribute lease, its pages kept by the kernel (`answered`), and those made at the server later (`made_later`: a read the pages did not answer, a recall, an unlink by this node) |
//! | `sanfs_agent_dir_attrs_here_total` | counter | `result` | changes of the mode, owners or times of a directory it made answered by the agent before the server (`answered`), and those the server then refused (`lost`) |
//! | `sanfs_agent_lease_valid`, `sanfs_agent_lease_remaining_seconds` | gauge | | the lease now |
//! | `sanfs_agent_missing_luns`, `sanfs_agent_poisoned_luns` | gauge | | LUNs not found here; LUNs poisoned by a failed write |
//! | `sanfs_agent_lun_usable` | gauge | `device`, `uuid` | 1 when direct I/O goes to the LUN |
//! | `sanfs_agent_device_ios_total` | counter | `device`, `op` | device I/Os issued |
//! | `sanfs_agent_device_bytes_total` | counter | `device`, `op` | device bytes moved |
//! | `sanfs_agent_device_errors_total` | counter | `device` | failed device I/Os |
//! | `sanfs_agent_device_io_seconds` | histogram | `device`, `op` | latency of each request to the kernel |
//! | `sanfs_agent_device_recoveries_total` | counter | | poisoned LUNs brought back |
//! | `sanfs_agent_writeback_dirty_bytes` | gauge | | bytes of small buffered writes held back now |
//! | `sanfs_agent_writeback_held_writes_total` | counter | | writes held back (answered without I/O) |
//! | `sanfs_agent_writeback_held_attrs_total`, `sanfs_agent_writeback_attr_flushes_total`, `sanfs_agent_writeback_attrs_with_bytes_total` | counter | | attribute changes held back (answered without a call); the `SetAttr`s that sent them; the held changes sent with the file's bytes in their last proxied `Write` instead |
//! | `sanfs_agent_writeback_flushes_total`, `sanfs_agent_writeback_bytes_total` | counter | | write-backs run; bytes they wrote |
//! | `sanfs_agent_writeback_recalls_total` | counter | | delegation recalls that wrote held-back bytes first |
//! | `sanfs_agent_delegations_total` | counter | `result` | delegations `granted` / `refused`, and write delegations `reclaimed` from a restarted server |
//! | `sanfs_agent_read_cache_bytes` | gauge | | file bytes in the read cache now |
//! | `sanfs_agent_read_cache_total` | counter | `result` | buffered reads answered by the read cache (`hit`) or read and kept (`miss`) |
//! | `sanfs_agent_fuse_op_seconds` | histogram | `op` | time from a FUSE request's arrival to its answer, by request (`lookup`, `getattr`, `read`, `write`, `create`, ...) |
//! | `sanfs_agent_stage_calls_total`, `sanfs_agent_stage_bytes_total` | counter | `stage` | calls of a data-path stage and the bytes they moved ([`crate::stages`]) |
//! | `sanfs_agent_stage_seconds` | gauge (only grows) | `stage`, `clock` | time spent in a stage so far: `wall`, or the thread CPU (`cpu`) of the stages that measure it |
//!
//! The recorder is the process's `metrics` recorder ([`install`], once, before the client
//! connects so that the engine's latency histograms register with it). Counters are kept by
//! the client and engine themselves and published at each scrape ([`render`]). [`serve`]
//! answers `GET /metrics` on a TCP listener through the shared endpoint
//! ([`sanfs_proto::exposition`], hyper's HTTP/1.1: keep-alive, `HEAD`, 404 for another path,
//! 405 for another method, a bounded request head and its timeout).

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use sanfs_proto::exposition::{self, Page};
use tokio::net::TcpListener;

use crate::client::{Client, DeviceHealth};
use crate::engine::DEVICE_IO_SECONDS;
use crate::fuse::FUSE_OP_SECONDS;

/// Latency buckets of device requests and FUSE requests, 20 us to 5 s.
const LATENCY_BUCKETS: &[f64] = &[
    0.000_02, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1,
    0.25, 0.5, 1.0, 5.0,
];

static HANDLE: OnceLock<Option<PrometheusHandle>> = OnceLock::new();

/// Installs the Prometheus recorder as the process's `metrics` recorder (once); `None` if
/// another recorder was there first.
pub fn install() -> Option<&'static PrometheusHandle> {
    HANDLE
        .get_or_init(|| {
            let builder = PrometheusBuilder::new()
                .set_buckets_for_metric(
                    Matcher::Full(DEVICE_IO_SECONDS.to_owned()),
                    LATENCY_BUCKETS,
                )
                .and_then(|b| {
                    b.set_buckets_for_metric(
                        Matcher::Full(FUSE_OP_SECONDS.to_owned()),
                        LATENCY_BUCKETS,
                    )
                })
                .unwrap_or_else(|_| PrometheusBuilder::new());
            let recorder = builder.build_recorder();
            let handle = recorder.handle();
            match metrics::set_global_recorder(recorder) {
                Ok(()) => {
                    metrics::describe_histogram!(
                        FUSE_OP_SECONDS,
                        metrics::Unit::Seconds,
                        "Time from a FUSE request's arrival to its answer, by request."
                    );
                    Some(handle)
                }
                Err(_) => {
                    tracing::warn!("another metrics recorder is installed: no agent metrics");
                    None
                }
            }
        })
        .as_ref()
}

/// Publishes `client`'s counters and renders every metric in the text format.
pub fn render(client: &Client) -> String {
    let s = client.status();
    let bytes = [
        (
            "sanfs_agent_direct_bytes_total",
            "read",
            s.bytes.direct_read,
        ),
        (
            "sanfs_agent_direct_bytes_total",
            "write",
            s.bytes.direct_write,
        ),
        (
            "sanfs_agent_proxied_bytes_total",
            "read",
            s.bytes.proxied_read,
        ),
        (
            "sanfs_agent_proxied_bytes_total",
            "write",
            s.bytes.proxied_write,
        ),
        ("sanfs_agent_grants_total", "read", s.grants.read),
        ("sanfs_agent_grants_total", "write", s.grants.write),
    ];
    for (name, op, v) in bytes {
        metrics::counter!(name, "op" => op).absolute(v);
    }
    metrics::counter!("sanfs_agent_cached_reads_total").absolute(s.grants.cached_reads);
    metrics::counter!("sanfs_agent_layout_writes_total").absolute(s.grants.layout_writes);
    metrics::counter!("sanfs_agent_layouts_ahead_total").absolute(s.grants.layouts_ahead);
    metrics::gauge!("sanfs_agent_cached_grants").set(s.grants.cached_now as f64);
    metrics::counter!("sanfs_agent_recalls_total").absolute(s.grants.recalls);
    let l = &s.leases;
    for (kind, result, v) in [
        ("attr", "hit", l.attr_hits),
        ("attr", "miss", l.attr_misses),
        ("entry", "hit", l.entry_hits),
        ("entry", "miss", l.entry_misses),
        ("xattr", "hit", l.xattr_hits),
        ("xattr", "miss", l.xattr_misses),
        ("access", "hit", l.access_hits),
        ("access", "miss", l.access_misses),
        ("listing", "hit", l.listing_hits),
        ("listing", "miss", l.listing_misses),
    ] {
        metrics::counter!("sanfs_agent_lease_cache_total", "kind" => kind, "result" => result)
            .absolute(v);
    }
    metrics::counter!("sanfs_agent_lease_recalls_total").absolute(l.recalls);
    metrics::counter!("sanfs_agent_lease_renewals_total", "result" => "renewed")
        .absolute(l.renewed);
    metrics::counter!("sanfs_agent_lease_renewals_total", "result" => "lost")
        .absolute(l.renew_lost);
    metrics::counter!("sanfs_agent_small_file_opens_total").absolute(l.small_file_opens);
    metrics::counter!("sanfs_agent_small_file_reads_total").absolute(l.small_file_reads);
    metrics::counter!("sanfs_agent_small_files_written_total").absolute(l.small_files_written);
    metrics::gauge!("sanfs_agent_lease_cached", "kind" => "attr").set(l.attrs_now as f64);
    metrics::gauge!("sanfs_agent_lease_cached", "kind" => "entry").set(l.names_now as f64);
    metrics::counter!("sanfs_agent_creates_here_total", "result" => "answered")
        .absolute(s.creates.here);
    metrics::counter!("sanfs_agent_creates_here_total", "result" => "lost")
        .absolute(s.creates.lost);
    metrics::counter!("sanfs_agent_unlinks_here_total", "result" => "answered")
        .absolute(s.creates.unlinks_here);
    metrics::counter!("sanfs_agent_unlinks_here_total", "result" => "lost")
        .absolute(s.creates.unlinks_lost);
    metrics::counter!("sanfs_agent_renames_here_total", "result" => "answered")
        .absolute(s.creates.renames_here);
    metrics::counter!("sanfs_agent_renames_here_total", "result" => "lost")
        .absolute(s.creates.renames_lost);
    metrics::counter!("sanfs_agent_dir_attrs_here_total", "result" => "answered")
        .absolute(s.creates.attrs_here);
    metrics::counter!("sanfs_agent_dir_attrs_here_total", "result" => "lost")
        .absolute(s.creates.attrs_lost);
    metrics::counter!("sanfs_agent_opens_here_total", "result" => "answered")
        .absolute(s.opens_here);
    metrics::counter!("sanfs_agent_opens_here_total", "result" => "made_later")
        .absolute(s.opens_made_later);
    metrics::counter!("sanfs_agent_sessions_total").absolute(s.sessions_opened);
    metrics::counter!("sanfs_agent_fences_total").absolute(s.fences);
    metrics::counter!("sanfs_agent_device_recoveries_total").absolute(s.device_recoveries);
    let w = &s.write_back;
    metrics::gauge!("sanfs_agent_writeback_dirty_bytes").set(w.dirty_bytes as f64);
    metrics::counter!("sanfs_agent_writeback_held_writes_total").absolute(w.held_writes);
    metrics::counter!("sanfs_agent_writeback_held_attrs_total").absolute(w.held_attrs);
    metrics::counter!("sanfs_agent_writeback_attr_flushes_total").absolute(w.attr_flushes);
    metrics::counter!("sanfs_agent_writeback_attrs_with_bytes_total").absolute(w.attrs_with_bytes);
    metrics::counter!("sanfs_agent_writeback_flushes_total").absolute(w.flushes);
    metrics::counter!("sanfs_agent_writeback_bytes_total").absolute(w.flushed_bytes);
    metrics::counter!("sanfs_agent_writeback_recalls_total").absolute(w.recalls_flushed);
    metrics::counter!("sanfs_agent_delegations_total", "result" => "granted")
        .absolute(w.delegations);
    metrics::counter!("sanfs_agent_delegations_total", "result" => "refused").absolute(w.refusals);
    metrics::counter!("sanfs_agent_delegations_total", "result" => "reclaimed")
        .absolute(w.reclaimed);
    metrics::gauge!("sanfs_agent_read_cache_bytes").set(w.cached_bytes as f64);
    metrics::counter!("sanfs_agent_read_cache_total", "result" => "hit").absolute(w.cache_hits);
    metrics::counter!("sanfs_agent_read_cache_total", "result" => "miss").absolute(w.cache_misses);
    metrics::counter!("sanfs_agent_read_aheads_total").absolute(w.read_aheads);
    for st in &s.stages {
        let stage = st.stage.clone();
        metrics::counter!("sanfs_agent_stage_calls_total", "stage" => stage.clone())
            .absolute(st.calls);
        metrics::counter!("sanfs_agent_stage_bytes_total", "stage" => stage.clone())
            .absolute(st.bytes);
        // Totals that only grow, in seconds (the `metrics` counters hold whole numbers).
        metrics::gauge!("sanfs_agent_stage_seconds", "stage" => stage.clone(), "clock" => "wall")
            .set(st.wall_ns as f64 / 1e9);
        metrics::gauge!("sanfs_agent_stage_seconds", "stage" => stage, "clock" => "cpu")
            .set(st.cpu_ns as f64 / 1e9);
    }
    metrics::gauge!("sanfs_agent_lease_valid").set(if s.lease_valid { 1.0 } else { 0.0 });
    metrics::gauge!("sanfs_agent_lease_remaining_seconds")
        .set(Duration::from_millis(s.lease_remaining_ms).as_secs_f64());
    let count = |h: DeviceHealth| s.devices.iter().filter(|d| d.state == h).count() as f64;
    metrics::gauge!("sanfs_agent_missing_luns").set(count(DeviceHealth::Missing));
    metrics::gauge!("sanfs_agent_poisoned_luns").set(count(DeviceHealth::Poisoned));
    for d in &s.devices {
        let device = d.index.to_string();
        let usable = if d.state == DeviceHealth::Ok {
            1.0
        } else {
            0.0
        };
        metrics::gauge!("sanfs_agent_lun_usable", "device" => device.clone(), "uuid" => d.uuid.clone())
            .set(usable);
        for (op, ios, bytes) in [
            ("read", d.read_ops, d.read_bytes),
            ("write", d.write_ops, d.write_bytes),
        ] {
            metrics::counter!("sanfs_agent_device_ios_total", "device" => device.clone(), "op" => op)
                .absolute(ios);
            metrics::counter!("sanfs_agent_device_bytes_total", "device" => device.clone(), "op" => op)
                .absolute(bytes);
        }
        metrics::counter!("sanfs_agent_device_errors_total", "device" => device).absolute(d.errors);
    }
    install().map(PrometheusHandle::render).unwrap_or_default()
}

/// Answers scrapes on `listener` until the task is dropped.
pub async fn serve(listener: TcpListener, client: Arc<Client>) {
    serve_text(listener, Arc::new(move || render(&client))).await;
}

/// What a scrape answers: the whole exposition, made on a blocking thread.
pub type Render = exposition::Render;

/// Answers scrapes on `listener` with what `render` makes, and `GET /healthz` with `ok` (a
/// liveness probe: the process answers, whatever the server), until the task is dropped.
pub async fn serve_text(listener: TcpListener, render: Render) {
    let pages = [
        ("/metrics", Page::Render(render)),
        ("/healthz", Page::Fixed("ok\n")),
    ];
    exposition::serve(listener, Arc::new(pages)).await;
}
