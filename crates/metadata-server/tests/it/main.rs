//! Integration tests of `sanfs-mds`: one test binary, one module per boundary.
//!
//! - [`support`]: building stores and volumes for the tests.
//! - [`smoke`]: the store and namespace through the committer.
//! - [`harness`]: a server started in-process with `serve`, its clients, test certificates.
//! - [`serve`]: the four gRPC services end to end: namespace, sessions, TLS, metrics.
#![allow(clippy::unwrap_used, reason = "tests")]

mod harness;
mod serve;
mod smoke;
#[allow(
    unused_imports,
    reason = "support.rs imports Credentials that no helper uses yet; left as it is (owned elsewhere)"
)]
mod support;
