//! `sanfs-mds`: the metadata server. It owns the namespace, every file's extent map, the
//! free-space allocator, sessions and grants; every change is one durable transaction.
//!
//! The binary (`main.rs`) is a thin command line over these modules.

pub mod config;
pub mod device;
pub mod format;
pub mod inspect;
