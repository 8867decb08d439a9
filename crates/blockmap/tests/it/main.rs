//! Integration tests of `sanfs-blockmap` against the world outside the pure core: one test
//! binary, one module per boundary.
//!
//! - [`lvm_real`]: the LVM2 parsers and layout against volume groups written by the real lvm2
//!   tools on loop devices (needs root and lvm2; prints "skipped" otherwise).
#![allow(clippy::unwrap_used, reason = "tests")]

mod lvm_real;
