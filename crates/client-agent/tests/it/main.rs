//! Integration tests of the agent's device layer, by boundary: the engines against real files
//! and loop devices (`engine_io`), discovery against labelled LUNs (`discovery`). Tests that
//! need root (loop devices, LVM) print "skipped: needs root" and pass without it.

#![allow(clippy::unwrap_used, reason = "tests")]

mod discovery;
mod engine_io;
mod support;
