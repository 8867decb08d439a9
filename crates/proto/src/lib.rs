//! `sanfs-proto`: the `sanfs.v1` wire protocol and the validated domain types that the rest of
//! the code uses. Generated protobuf types are converted to these types at the receive
//! boundary (`TryFrom`) and never reach core logic.
#![deny(unsafe_code)]

pub mod types;
