//! Round trips of single control messages: a `GetAttr` (the floor of every round trip), a
//! grant (`MapRead` + `Complete`, `MapWrite` + `Complete`, no device I/O in between) and a
//! proxied `Read` / `Write`, for sizes 4 KiB to 8 MiB, over plain gRPC as an agent sends them. Shown as median, 90th percentile and
//! maximum, the number of round trips slower than 20 ms, and the CPU each round trip costs
//! the caller and the server together (`grant-write` is the grant round trip of issue 20:
//! MapWrite + Complete, one caller).
//!
//! This is the regression row for a stall once seen here: ~40 ms per request on proxied
//! reads below 1 MiB and on grants of 2 MiB and more. A round trip on loopback takes well
//! under a millisecond; a stall shows up as a median or p90 near 40 ms (the delayed-ACK
//! timer of a peer waiting on Nagle's algorithm).

use std::time::{Duration, Instant};

use anyhow::Context;
use sanfs_proto::model::MAX_MESSAGE_SIZE;
use sanfs_proto::pb;
use sanfs_proto::pb::data_client::DataClient;
use sanfs_proto::pb::namespace_client::NamespaceClient;
use sanfs_proto::pb::session_client::SessionClient;
use tonic::transport::{Channel, Endpoint};

use crate::cluster::BenchCluster;
use crate::util::{percentile, size_label};

/// One kind of round trip at one size.
#[derive(Debug, Clone, serde::Serialize)]
pub struct LatencyRow {
    /// `getattr` (the floor: one read-only RPC), `grant-read`, `grant-write`, `proxied-read`,
    /// `proxied-write`.
    pub what: &'static str,
    pub size: u64,
    pub n: u64,
    pub median_us: f64,
    pub p90_us: f64,
    pub max_us: f64,
    /// Round trips that took 20 ms or more.
    pub slow: u64,
    /// CPU microseconds per round trip, this process (the caller) and the server together.
    #[serde(default)]
    pub cpu_us_per_op: Option<f64>,
}

/// The latency table.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct LatencyReport {
    pub rows: Vec<LatencyRow>,
}

fn cred() -> Option<pb::Credentials> {
    Some(pb::Credentials {
        uid: 0,
        gid: 0,
        groups: vec![],
    })
}

/// A raw agent: a session (no stream: its read grants are not cacheable) and a handle on a
/// file of `len` bytes.
struct RawAgent {
    ch: Channel,
    data: DataClient<Channel>,
    session: u64,
    epoch: u64,
    handle: u64,
    ino: u64,
}

async fn raw_agent(
    cluster: &BenchCluster,
    name: &str,
    len: u64,
    fill: bool,
) -> anyhow::Result<RawAgent> {
    let ch = Endpoint::from_shared(format!("http://{}", cluster.addr))?
        .tcp_nodelay(true)
        .connect()
        .await
        .context("connect")?;
    let opened = SessionClient::new(ch.clone())
        .open_session(pb::OpenSessionRequest {
            protocol_version: sanfs_proto::model::PROTOCOL_VERSION,
            client_name: "sanfs-bench-latency".into(),
            host: "localhost".into(),
            agent_version: env!("CARGO_PKG_VERSION").into(),
        })
        .await?
        .into_inner();
    let created = NamespaceClient::new(ch.clone())
        .create(pb::CreateRequest {
            cred: cred(),
            session: opened.session,
            parent: 1,
            name: name.as_bytes().to_vec(),
            perm: 0o644,
            exclusive: false,
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
    let ino = created.attr.context("create without attributes")?.ino;
    let mut agent = RawAgent {
        ch: ch.clone(),
        data: DataClient::new(ch)
            .max_decoding_message_size(MAX_MESSAGE_SIZE)
            .max_encoding_message_size(MAX_MESSAGE_SIZE),
        session: opened.session,
        epoch: opened.epoch,
        handle: created.handle,
        ino,
    };
    // Written blocks, so that read grants map device I/O and proxied reads read the LUNs.
    let chunk = 1 << 20;
    let mut off = 0;
    while fill && off < len {
        agent
            .data
            .write(pb::WriteRequest {
                cred: cred(),
                session: agent.session,
                handle: agent.handle,
                inode: agent.ino,
                offset: off,
                data: vec![0x3c; chunk.min(len - off) as usize],
                sync: false,
                append: false,
                request_id: None,
                then_set_attr: None,
            })
            .await
            .context("write the latency file")?;
        off += chunk;
    }
    Ok(agent)
}

impl RawAgent {
    fn map_req(&self, len: u64) -> pb::MapRequest {
        pb::MapRequest {
            cred: cred(),
            session: self.session,
            epoch: self.epoch,
            handle: self.handle,
            inode: self.ino,
            offset: 0,
            length: len,
            sync: false,
            ..Default::default()
        }
    }

    async fn grant(&mut self, write: bool, len: u64) -> anyhow::Result<()> {
        let g = if write {
            self.data.map_write(self.map_req(len)).await
        } else {
            self.data.map_read(self.map_req(len)).await
        }?
        .into_inner();
        self.data
            .complete(pb::CompleteRequest {
                session: self.session,
                epoch: self.epoch,
                grant_id: g.grant_id,
                status: pb::IoStatus::Ok as i32,
                errors: vec![],
                bytes_done: if write { g.length } else { 0 },
                sync: false,
                ..Default::default()
            })
            .await?;
        Ok(())
    }

    /// A `GetAttr`: the floor of every round trip (one read-only RPC, no store write).
    async fn getattr(&mut self) -> anyhow::Result<()> {
        NamespaceClient::new(self.ch.clone())
            .get_attr(pb::GetAttrRequest {
                cred: cred(),
                inode: self.ino,
                session: None,
            })
            .await?;
        Ok(())
    }

    async fn proxied(&mut self, write: bool, len: u64) -> anyhow::Result<()> {
        if write {
            self.data
                .write(pb::WriteRequest {
                    cred: cred(),
                    session: self.session,
                    handle: self.handle,
                    inode: self.ino,
                    offset: 0,
                    data: vec![0x5a; len as usize],
                    sync: false,
                    append: false,
                    request_id: None,
                    then_set_attr: None,
                })
                .await?;
        } else {
            self.data
                .read(pb::ReadRequest {
                    cred: cred(),
                    session: self.session,
                    handle: self.handle,
                    inode: self.ino,
                    offset: 0,
                    length: len,
                })
                .await?;
        }
        Ok(())
    }
}

/// Measures every kind at every size, `iters` round trips each (fewer for large proxied
/// transfers), each kind on a fresh session so that no lease runs out on the way.
pub async fn run(
    cluster: &BenchCluster,
    sizes: &[u64],
    iters: u64,
    bar: &indicatif::ProgressBar,
) -> anyhow::Result<LatencyReport> {
    let max = sizes.iter().copied().max().unwrap_or(1 << 20);
    let mut report = LatencyReport::default();
    for (k, what) in [
        "getattr",
        "grant-read",
        "grant-write",
        "proxied-read",
        "proxied-write",
    ]
    .into_iter()
    .enumerate()
    {
        for (i, &size) in sizes.iter().enumerate() {
            // A GetAttr has no size: once.
            if what == "getattr" && i > 0 {
                continue;
            }
            // A session of its own per size: these sessions send no heartbeats, and each
            // size takes at most 5 s of the 10 s lease.
            let mut agent = raw_agent(cluster, &format!("latency-{k}"), max, i == 0).await?;
            bar.set_message(format!("{what} {}", size_label(size)));
            let proxied = what.starts_with("proxied");
            // Proxied transfers move the bytes: fewer of the large ones.
            let n = if proxied {
                iters.min((256 << 20) / size).max(10)
            } else {
                iters
            };
            let write = what.ends_with("write");
            let mut lat = Vec::with_capacity(n as usize);
            let meter = crate::cpu::CpuMeter::start(cluster.server_pid());
            let started = Instant::now();
            for _ in 0..n {
                let t = Instant::now();
                if what == "getattr" {
                    agent.getattr().await?;
                } else if proxied {
                    agent.proxied(write, size).await?;
                } else {
                    agent.grant(write, size).await?;
                }
                lat.push(t.elapsed().as_secs_f64() * 1e6);
                if started.elapsed() > Duration::from_secs(5) {
                    break;
                }
            }
            let cpu_s = meter.cpu_s();
            let slow = lat.iter().filter(|us| **us >= 20_000.0).count() as u64;
            let count = lat.len() as u64;
            report.rows.push(LatencyRow {
                what,
                size,
                n: count,
                median_us: percentile(&mut lat, 50.0),
                p90_us: percentile(&mut lat, 90.0),
                max_us: percentile(&mut lat, 100.0),
                slow,
                cpu_us_per_op: (count > 0).then(|| cpu_s * 1e6 / count as f64),
            });
            bar.inc(1);
            let _ = SessionClient::new(
                Endpoint::from_shared(format!("http://{}", cluster.addr))?
                    .connect()
                    .await?,
            )
            .close_session(pb::CloseSessionRequest {
                session: agent.session,
                epoch: agent.epoch,
            })
            .await;
        }
    }
    Ok(report)
}

impl std::fmt::Display for LatencyReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "Control-message round trips (one request at a time, loopback gRPC)"
        )?;
        writeln!(
            f,
            "{:<14} {:>6} {:>6} {:>11} {:>11} {:>11} {:>6} {:>10}",
            "round trip", "size", "n", "median us", "p90 us", "max us", ">=20ms", "CPU us/op"
        )?;
        for r in &self.rows {
            writeln!(
                f,
                "{:<14} {:>6} {:>6} {:>11.0} {:>11.0} {:>11.0} {:>6} {:>10}",
                r.what,
                size_label(r.size),
                r.n,
                r.median_us,
                r.p90_us,
                r.max_us,
                r.slow,
                r.cpu_us_per_op
                    .map_or("-".to_owned(), |c| format!("{c:.0}"))
            )?;
        }
        Ok(())
    }
}
