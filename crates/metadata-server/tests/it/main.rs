//! Integration tests of `sanfs-mds`: one test binary, one module per boundary.
//!
//! - [`support`]: building stores and volumes for the tests.
//! - [`smoke`]: the store and namespace through the committer.
#![allow(clippy::unwrap_used, reason = "tests")]

mod smoke;
mod support;
