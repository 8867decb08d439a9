//! Integration tests of the agent, by boundary: the engines against real files and loop
//! devices (`engine_io`), discovery against labelled LUNs (`discovery`), and the client
//! library against a real in-process metadata server on file-backed LUNs (`client`, with its
//! fixture `cluster`), the FUSE mount (`mount`) and the CSI driver (`csi`). Tests that
//! need root (loop devices, LVM) print "skipped: needs root" and pass without it.

#![allow(clippy::unwrap_used, reason = "tests")]

mod client;
mod cluster;
mod csi;
mod discovery;
mod engine_io;
mod fallocate;
mod locks;
mod mount;
mod support;
