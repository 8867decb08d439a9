//! Integration tests of `sanfs-blockmap` against the world outside the pure core: one test
//! binary, one module per boundary.
//!
//! - [`lvm_real`]: the LVM2 parsers and layout against volume groups written by the real lvm2
//!   tools on loop devices (needs root and lvm2; otherwise it says it was skipped, or fails under
//!   `SANFS_REQUIRE_ROOT=1`, see `sanfs_testcluster::skip_unless`).
#![allow(clippy::unwrap_used, reason = "tests")]

mod lvm_real;
