//! Integration tests of `sanfs-proto`, organised by boundary: round trips of every message
//! family, one rejection test per validation rule, the error-status mapping, and a fuzz-style
//! property test that feeds arbitrary messages through every conversion.
#![allow(clippy::unwrap_used, reason = "tests")]

mod exposition;
mod fixtures;
mod fuzz;
mod grant_model;
mod leases;
mod loopback;
mod reject;
mod roundtrip;
mod status;
