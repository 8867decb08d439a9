//! `sanfs-mds`: the metadata server. It owns the namespace, every file's extent map, the
//! free-space allocator, sessions and grants; every change is one durable transaction.
//!
//! The modules depend one way, from the gRPC boundary down to the tables:
//! `serve` -> `service` -> {`ns`, `data`, `grants`, `proxy`, `reclaim`, `recovery`} ->
//! `space` -> `quota` -> `store` (-> `handles`, `clock`).
//!
//! - [`store`]: redb tables, the storage backends, and the group-commit committer (a leaf).
//! - [`quota`]: directory quotas (what a CSI volume is): charges, checks, queries.
//! - [`space`]: file space: allocation, extent maps, punch, zero range, trim, release.
//! - [`ns`]: the namespace's POSIX rules over those tables.
//! - [`recovery`]: what a start frees after opening the store (orphans, preallocation).
//! - [`handles`]: the open-handle table.
//! - [`fsck`]: the offline consistency check.
//! - [`backup`]: `restore`: a backup (written online by `Store::backup`) checked and installed.
//! - [`config`]: the `mds.toml` configuration.
//! - [`device`], [`format`], [`inspect`]: the LUNs (labels, LVM2 import, `volume inspect`).
//! - [`grow`]: growing the volume while mounted (LUNs added, or an extended LVM2 LV).
//! - [`locks`], [`grants`], [`data`]: byte-range locks, grants (the direct path's control
//!   info 1 to 4), and their store jobs.
//! - [`proxy`], [`datadev`]: the proxied path and the server's own handles on the LUNs.
//! - [`reclaim`]: the reclaim window after a restart and the replay of lazy completions.
//! - [`clock`]: the clock seam.
//! - [`service`]: the five `sanfs.v1` gRPC services (Session, Namespace, Data, Admin, Locks) over one shared server state.
//! - [`serve`]: binding, TLS, the serving loop, fail-stop.
//! - [`activity`]: per-session and per-RPC counters for ServerStatus (a leaf).
//! - [`metrics`]: Prometheus counters (read through [`metrics::Counters`]) and the
//!   `/metrics` responder.
//!
//! The binary (`main.rs`) is a thin command line over these modules.

pub mod activity;
pub mod advisory;
pub mod backup;
pub mod clock;
pub mod config;
pub mod data;
pub mod datadev;
pub mod device;
pub mod format;
pub mod fsck;
pub mod grants;
pub mod grow;
pub mod ha;
pub mod handles;
pub mod handshake;
pub mod inspect;
pub mod leases;
pub mod locks;
pub mod metrics;
pub mod ns;
pub mod proxy;
pub mod quota;
pub mod reclaim;
pub mod recovery;
pub mod replies;
pub mod reserved;
pub mod serve;
pub mod service;
pub mod smallfiles;
pub mod space;
pub mod store;
