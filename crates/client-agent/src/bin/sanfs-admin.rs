//! `sanfs-admin`: the administrator's command line for a metadata server ([`admin`]).
//!
//! `sanfs-admin [--server unix:/run/sanfs/mds.sock | HOST:PORT[,HOST:PORT...]] [--tls-ca F --tls-cert F
//! --tls-key F [--tls-domain NAME]] [--json] COMMAND`, where COMMAND is `status`, `clients`,
//! `top [--interval SECS] [--count N]`, `evict SESSION [--reason TEXT]`, `quota get DIR`, `quota set DIR [--bytes SIZE|none]
//! [--inodes N|none]`, `quota list` or `grow --layout linear|striped|lvm [--stripe-unit SIZE]
//! [--force] [DEVICE...]` or `backup PATH [--force]`. Exit status 0 on success, 1 when the server refused or
//! failed (the reason on stderr), 2 for a usage error.
//!
//! [`admin`]: sanfs_client_agent::admin

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::bail;
use clap::{Args, Parser, Subcommand};
use sanfs_client_agent::admin::{self, Admin};
use sanfs_client_agent::client::TlsConfig;
use sanfs_proto::model::{GrowLayout, QuotaLimits};
use serde_json::json;

#[derive(Parser)]
#[command(
    name = "sanfs-admin",
    version,
    about = "sanfs administration: server status, clients, eviction, directory quotas, volume growth, metadata backup"
)]
struct Cli {
    #[command(flatten)]
    conn: Conn,
    /// Print the answer of a read command as one JSON object.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Args)]
struct Conn {
    /// The metadata server: `unix:/path` of its unix socket on this host (known by your
    /// uid: root is an administrator) or `host:port` (mutual TLS with an admin certificate);
    /// or several (`mds1,mds2:7410`, `a:7410,b:7411`): whichever answers (the leader).
    #[arg(long, global = true, env = "SANFS_SERVER", default_value = admin::DEFAULT_SERVER)]
    server: String,
    /// The CA that signed the server's certificate (with --tls-cert and --tls-key).
    #[arg(long, global = true, env = "SANFS_TLS_CA")]
    tls_ca: Option<PathBuf>,
    /// This administrator's certificate: its name must have `admin = true` in mds.toml.
    #[arg(long, global = true, env = "SANFS_TLS_CERT")]
    tls_cert: Option<PathBuf>,
    #[arg(long, global = true, env = "SANFS_TLS_KEY")]
    tls_key: Option<PathBuf>,
    /// The name to check the server's certificate against (default: the host of --server,
    /// of each address in a list).
    #[arg(long, global = true)]
    tls_domain: Option<String>,
}

#[derive(Subcommand)]
enum Command {
    /// The server, its epoch, the volume's capacity and free space, sessions and grants.
    Status,
    /// The live sessions: id, identity, client name, host, lease left, grants, open files.
    Clients,
    /// A live view, refreshed every --interval: RPC rates and latency, commits, grants, and
    /// bytes direct and proxied, for the server and per client. On a terminal the screen is
    /// redrawn; otherwise each refresh is printed after the last (with --json: one object a
    /// line).
    Top {
        /// Seconds between refreshes (at least 0.1).
        #[arg(long, default_value_t = 2.0)]
        interval: f64,
        /// Stop after this many refreshes (default: until interrupted).
        #[arg(long)]
        count: Option<u64>,
    },
    /// Evict a session (docs/protocol.md "Eviction"): fenced now, its grants gone when its
    /// lease runs out; its agent opens a new session.
    Evict {
        session: u64,
        /// Why (logged by the server and told to the agent).
        #[arg(long, default_value = "")]
        reason: String,
    },
    /// Directory quotas.
    #[command(subcommand)]
    Quota(QuotaCommand),
    /// Grow the volume while it is mounted (docs/operations.md "Growing the volume"): add
    /// LUNs as a new segment (linear: one LUN; striped: all of them), or take up an LVM2
    /// logical volume extended with lvextend.
    Grow {
        /// linear, striped or lvm.
        #[arg(long)]
        layout: String,
        /// The stripe unit of a striped growth (64K, 1M, 65536).
        #[arg(long)]
        stripe_unit: Option<String>,
        /// Overwrite a signature found on a LUN to add.
        #[arg(long)]
        force: bool,
        /// The LUNs to add, as the server's host names them (lvm: further PVs the LV now
        /// uses that the server does not open yet).
        devices: Vec<String>,
    },
    /// Have the server write a consistent copy of its metadata store while it serves
    /// (docs/operations.md "Backing up the metadata store"); restore it with
    /// `sanfs-mds restore`.
    Backup {
        /// Where, on the server's host: an absolute path in a directory that exists.
        path: String,
        /// Replace a file that exists there.
        #[arg(long)]
        force: bool,
    },
}

#[derive(Subcommand)]
enum QuotaCommand {
    /// The quota of DIR (a path inside the volume, e.g. /tenant-a).
    Get { dir: String },
    /// Set the quota of DIR (empty and in no quota, or already carrying one).
    Set {
        dir: String,
        /// Byte limit (10G, 512M, 65536) or `none`.
        #[arg(long, default_value = "none")]
        bytes: String,
        /// Inode limit or `none`.
        #[arg(long, default_value = "none")]
        inodes: String,
    },
    /// Every quota on the volume.
    List,
}

fn tls(c: &Conn) -> anyhow::Result<Option<TlsConfig>> {
    match (&c.tls_ca, &c.tls_cert, &c.tls_key) {
        (None, None, None) => Ok(None),
        (Some(ca), Some(cert), Some(key)) => Ok(Some(TlsConfig {
            ca: ca.clone(),
            cert: cert.clone(),
            key: key.clone(),
            domain: c.tls_domain.clone(),
        })),
        _ => bail!("--tls-ca, --tls-cert and --tls-key go together"),
    }
}

fn print(json: bool, value: &serde_json::Value, text: impl FnOnce(&serde_json::Value) -> String) {
    if json {
        println!("{value}");
    } else {
        print!("{}", text(value));
    }
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    let tls = tls(&cli.conn)?;
    let a = Admin::connect(&cli.conn.server, tls.as_ref()).await?;
    match cli.command {
        Command::Status => {
            let s = a.server_status().await?;
            let (v, st) = a.volume().await?;
            print(
                cli.json,
                &admin::status_json(a.server(), &s, &v, &st),
                admin::status_text,
            );
        }
        Command::Clients => {
            let s = a.server_status().await?;
            print(cli.json, &admin::clients_json(&s), admin::clients_text);
        }
        Command::Top { interval, count } => top(&a, cli.json, interval, count).await?,
        Command::Evict { session, reason } => {
            let r = a.evict(session, &reason).await?;
            println!(
                "session {session} evicted; its grants go in {}",
                admin::duration(r.lease_remaining_ms)
            );
        }
        Command::Quota(QuotaCommand::Get { dir }) => match a.quota_get(&dir).await? {
            Some(q) => {
                let j = admin::quota_json(Some(&dir), &q);
                print(cli.json, &j, |j| {
                    admin::quotas_text(std::slice::from_ref(j))
                });
            }
            None => {
                if cli.json {
                    println!("{}", json!({"path": dir, "quota": null}));
                } else {
                    println!("{dir}: no quota");
                }
            }
        },
        Command::Quota(QuotaCommand::Set { dir, bytes, inodes }) => {
            let limits = QuotaLimits {
                capacity_bytes: admin::parse_limit(&bytes, true)?,
                inodes: admin::parse_limit(&inodes, false)?,
            };
            let q = a.quota_set(&dir, limits).await?;
            print(cli.json, &admin::quota_json(Some(&dir), &q), |j| {
                admin::quotas_text(std::slice::from_ref(j))
            });
        }
        Command::Grow {
            layout,
            stripe_unit,
            force,
            devices,
        } => {
            let layout = match (layout.as_str(), stripe_unit) {
                ("linear", None) => GrowLayout::Linear,
                ("lvm", None) => GrowLayout::Lvm,
                ("striped", Some(su)) => GrowLayout::Striped {
                    stripe_unit: admin::parse_limit(&su, true)?
                        .ok_or_else(|| anyhow::anyhow!("--stripe-unit needs a size"))?,
                },
                ("striped", None) => bail!("a striped growth needs --stripe-unit"),
                ("linear" | "lvm", Some(_)) => bail!("--stripe-unit is for --layout striped"),
                (other, _) => bail!("--layout {other:?}: linear, striped or lvm"),
            };
            let devices = devices
                .into_iter()
                .map(|d| {
                    std::path::absolute(&d)
                        .map(|p| p.to_string_lossy().into_owned())
                        .map_err(|e| anyhow::anyhow!("{d}: {e}"))
                })
                .collect::<anyhow::Result<Vec<String>>>()?;
            let r = a.grow(devices, layout, force).await?;
            print(cli.json, &admin::grow_json(&r), admin::grow_text);
        }
        Command::Backup { path, force } => {
            let r = a.backup(path.clone(), force).await?;
            print(cli.json, &admin::backup_json(&path, &r), admin::backup_text);
        }
        Command::Quota(QuotaCommand::List) => {
            let l = a.quota_list().await?;
            let list: Vec<serde_json::Value> = l
                .quotas
                .iter()
                .map(|q| admin::quota_json(None, q))
                .collect();
            let j = json!({"quotas_total": l.quotas_total, "quotas": list});
            print(cli.json, &j, |j| {
                let mut t = admin::quotas_text(j["quotas"].as_array().map_or(&[], |v| v));
                if l.quotas_total > l.quotas.len() as u64 {
                    t.push_str(&format!(
                        "({} more quotas not listed)\n",
                        l.quotas_total - l.quotas.len() as u64
                    ));
                }
                t
            });
        }
    }
    Ok(())
}

/// `top`: a ServerStatus sample every `interval` seconds; each refresh shows the rates
/// between the last two.
async fn top(a: &Admin, json: bool, interval: f64, count: Option<u64>) -> anyhow::Result<()> {
    use std::io::{IsTerminal, Write};
    if !interval.is_finite() || interval < 0.1 {
        bail!("--interval must be at least 0.1 seconds");
    }
    let redraw = !json && std::io::stdout().is_terminal();
    let period = std::time::Duration::from_secs_f64(interval);
    let mut before = a.server_status().await?;
    let mut taken = std::time::Instant::now();
    let mut shown = 0u64;
    while count.is_none_or(|c| shown < c) {
        tokio::time::sleep(period).await;
        let after = a.server_status().await?;
        let j = admin::top_json(&before, &after, taken.elapsed().as_secs_f64());
        taken = std::time::Instant::now();
        let mut out = std::io::stdout().lock();
        if json {
            writeln!(out, "{j}")?;
        } else if redraw {
            // Home the cursor and clear the screen, then draw.
            write!(out, "\x1b[H\x1b[2J{}", admin::top_text(&j))?;
        } else {
            if shown > 0 {
                writeln!(out)?;
            }
            write!(out, "{}", admin::top_text(&j))?;
        }
        out.flush()?;
        before = after;
        shown += 1;
    }
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("sanfs-admin: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("sanfs-admin: {e:#}");
            ExitCode::FAILURE
        }
    }
}
