//! `sanfs-bench`: the paper's experiments (section 5, figures 6 to 10) and the benchmarks of
//! sanfs, as a tool for users (run it on your own hardware) and for us
//! (docs/performance.md).
//!
//! - [`suite`] runs the asked-for parts and gathers a [`report::Report`] (tables, JSON,
//!   PNG plots through [`plot`], the goals checked).
//! - [`cluster`] builds the bench's own test cluster (LUNs, volume, server, FUSE mount) or
//!   uses an existing one; [`env`] holds the run's settings.
//! - [`cpu`] measures the CPU seconds per GiB of every throughput row (issue 20).
//! - [`io`] is the timed sequential I/O loop against raw LUN blocks, the library, a mount;
//!   [`nfs`] the NFS peer (nfs-ganesha and libnfs); [`worker`] the reader processes.
//! - The figures: [`fig6`] (throughput vs I/O size), [`threshold`] (the crossover),
//!   [`fig7`] (striping), [`fig8`] (figures 8 and 9: methods A and B), [`fig10`]
//!   (processes), [`mdfig`] (metadata, bonnie++ -n style), [`metadata`] (concurrent gRPC
//!   callers and group commit), [`latency`] (control-message round trips).
//! - Through a mount, with ext4 and MooseFS measured in the same run ([`peers`]):
//!   [`everyday`] (everyday I/O, small-file trees, `tar x` and friends) and [`mdmount`]
//!   (metadata operations per second from 1 and 8 processes).
//!
//! - [`exercise`] is the model-based random-operation exerciser over two mounts
//!   (`sanfs-bench exercise`), a conformance check rather than a measurement.
//!
//! The criterion benchmarks live in `benches/`.

pub mod cluster;
pub mod cpu;
pub mod env;
pub mod everyday;
pub mod exercise;
pub mod failover;
pub mod fig10;
pub mod fig6;
pub mod fig7;
pub mod fig8;
pub mod io;
pub mod latency;
pub mod mdfig;
pub mod mdmount;
pub mod metadata;
pub mod nfs;
pub mod peers;
pub mod plot;
pub mod report;
pub mod serverkill;
pub mod suite;
pub mod threshold;
pub mod util;
pub mod worker;
