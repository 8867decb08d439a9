//! `sanfs-mds`: the metadata server. It owns the namespace, every file's extent map, the
//! free-space allocator, sessions and grants; every change is one durable transaction.
//!
//! - [`store`]: redb tables, the storage backends, and the group-commit committer.
//! - [`ns`]: the namespace's POSIX rules over those tables.
//! - [`clock`]: the clock seam.
//! - [`service`]: the four `sanfs.v1` gRPC services over one shared server state.
//! - [`serve`]: binding, TLS, the serving loop, fail-stop.
//! - [`metrics`]: Prometheus counters and the `/metrics` responder.
//!
//! The binary (`main.rs`) is a thin command line over these modules.

pub mod clock;
pub mod metrics;
pub mod ns;
pub mod serve;
pub mod service;
pub mod store;
