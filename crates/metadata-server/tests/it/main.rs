//! Integration tests of the `sanfs-mds` binary: one test binary, one module per boundary.
//!
//! `format_cli` and `inspect_cli` run the real binary on file-backed LUNs in a temporary
//! directory. `lvm_real` drives the real lvm2 tools on loop devices; it needs root, lvm2 and
//! loop devices, and otherwise prints why it was skipped and passes.

#![allow(clippy::unwrap_used, reason = "tests")]

mod common;
mod format_cli;
mod inspect_cli;
mod lvm_real;
