//! Integration tests of `sanfs-mds`: one test binary, one module per boundary.
//!
//! - [`support`]: building stores and volumes for the in-process tests.
//! - [`smoke`]: the store and namespace through the committer.
//! - [`space`]: file space: every way blocks leave a file frees and uncharges exactly them.
//! - [`posix`]: POSIX namespace rules as a table of cases.
//! - [`coherence`], [`grants`]: the direct and proxied paths on file-backed LUNs.
//! - [`crash_real`]: `kill -9` of the real server during a gRPC workload.
//! - `ha`: high availability with real etcd: takeover after `kill -9`, fencing of a paused
//!   leader, etcd quorum loss, a rolling restart (root, loop devices and etcd).
//! - [`harness`]: a server started in-process with `serve`, its clients, test certificates.
//! - [`serve`]: the five gRPC services end to end: namespace, sessions, TLS, metrics.
//! - [`lease`]: grants, recalls and lease expiry through gRPC in real time on real LUNs.
//! - [`evict`]: eviction of a session whose grant others wait for past the hold limit, and
//!   `Admin.EvictSession`.
//! - [`journaled`]: small proxied writes journaled with their commit: replayed onto a LUN
//!   that lost them, never over a client's later write.
//! - [`zeroing`]: a completion without device I/O exposes zeros, not a deleted file's bytes.
//! - [`deploy_units`]: the systemd units pass `systemd-analyze verify`.
//! - [`quota`]: directory quotas through gRPC: EDQUOT, growth, exact usage, EXDEV, fsck.
//! - [`crash`]: crash consistency: a crash at every disk write or sync of a seeded workload
//!   recovers to exactly the acknowledged operations, with fsck clean.
//! - [`torn`]: torn store images (random 4 KiB pieces of copies taken at several moments) are
//!   refused or recovered by `fsck` and the store open, never a panic or an abort.
//! - [`fuzz_calls`]: seeded random hostile calls of every service (boundary and garbage
//!   values, other nodes' sessions, grants never issued) against the real server, in process
//!   and as the real binary: never a hang or a panic, the server keeps serving, fsck clean,
//!   a well-behaved node's files unchanged (`SANFS_FUZZ_CALLS`, `SANFS_FUZZ_SEED`).
//! - `fsck_cli`: fsck never changes the store; needs-repair, in-use, `--repair`, `--dry-run`.
//! - `format_cli` and `inspect_cli` run the real binary on file-backed LUNs in a temporary
//!   directory; [`common`] holds their helpers.
//! - `lvm_real` drives the real lvm2 tools on loop devices; it needs root, lvm2 and loop
//!   devices, and otherwise says why it was skipped and passes (fails under
//!   `SANFS_REQUIRE_ROOT=1`, as every gated test: `sanfs_testcluster::skip_unless`).
#![allow(clippy::unwrap_used, reason = "tests")]

mod backup_cli;
mod coherence;
mod common;
mod crash;
mod crash_real;
mod dataflush;
mod deploy_units;
mod evict;
mod format_cli;
mod fsck_cli;
mod fuzz_calls;
mod grants;
mod grow;
mod ha;
mod harness;
mod hostile;
mod inspect_cli;
mod journaled;
mod lease;
mod lvm_real;
mod posix;
mod quota;
mod replay;
mod replies;
mod reserved;
mod serve;
mod smallfile;
mod smoke;
mod space;
mod support;
mod torn;
mod zeroing;
