//! `sanfs-mds`: the metadata server. It owns the namespace, every file's extent map, the
//! free-space allocator, sessions and grants; every change is one durable transaction.
//!
//! - [`store`]: redb tables, the storage backends, and the group-commit committer.
//! - [`ns`]: the namespace's POSIX rules over those tables.
//! - [`fsck`]: the offline consistency check.
//! - [`config`]: the `mds.toml` configuration.
//! - [`device`], [`format`], [`inspect`]: the LUNs (labels, LVM2 import, `volume inspect`).
//! - [`clock`]: the clock seam.
//!
//! The binary (`main.rs`) is a thin command line over these modules.

pub mod clock;
pub mod config;
pub mod data;
pub mod datadev;
pub mod device;
pub mod format;
pub mod fsck;
pub mod grants;
pub mod inspect;
pub mod locks;
pub mod ns;
pub mod proxy;
pub mod store;
