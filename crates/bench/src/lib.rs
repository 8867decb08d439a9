//! `sanfs-bench`: the paper's experiments and the benchmarks of sanfs, as a tool for users
//! (run it on your own hardware) and for us (docs/performance.md).
//!
//! - [`metadata`]: metadata operations per second through gRPC (create, stat, readdir,
//!   unlink) with many concurrent callers, and operations per durable commit (group commit).
//!
//! The criterion benchmarks of the pure core live in `benches/`.

pub mod metadata;
