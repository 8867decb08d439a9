//! Integration tests of `sanfs-mds`: one test binary, one module per boundary.
//!
//! - [`support`]: building stores and volumes for the tests.
//! - [`posix`]: POSIX namespace rules as a table of cases.
//! - [`smoke`]: the store and namespace through the committer.
#![allow(clippy::unwrap_used, reason = "tests")]

mod posix;
mod smoke;
mod support;
