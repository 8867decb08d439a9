//! `sanfs-proto`: the `sanfs.v1` wire protocol and the validated domain types that the rest of
//! the code uses. Generated protobuf types ([`pb`]) are converted to these types at the receive
//! boundary (`TryFrom`, in [`model`]) and never reach core logic; [`status`] is the one place
//! that maps file-system errors to gRPC statuses and back. [`csi`] is the Container Storage
//! Interface (v1) that the CSI driver serves, with its own validated request types. [`units`]
//! reads sizes and durations as people write them, the same way on every surface.
//! [`exposition`] serves Prometheus text over HTTP (the server's, the agent's and the CSI
//! node's metrics endpoints).
#![deny(unsafe_code)]

pub mod csi;
pub mod exposition;
pub mod headers;
pub mod local_socket;
pub mod model;
pub mod status;
pub mod types;
pub mod units;

/// The code generated from `proto/sanfs/v1/sanfs.proto` (messages, clients and servers).
/// Only [`model`] and the gRPC service glue should touch these types.
#[allow(
    clippy::all,
    clippy::pedantic,
    rust_2018_idioms,
    missing_docs,
    reason = "generated code"
)]
pub mod pb {
    tonic::include_proto!("sanfs.v1");

    /// The encoded `FileDescriptorSet` of `sanfs.v1` (for gRPC reflection and tests).
    pub const FILE_DESCRIPTOR_SET: &[u8] =
        include_bytes!(concat!(env!("OUT_DIR"), "/sanfs_v1_descriptor.bin"));
}

/// etcd's v3 API, the subset `sanfs-mds` uses for leader election and fencing (clients only;
/// `proto/etcd/`). Our own generated code rather than the `etcd-client` crate, whose build
/// needs `protoc`: ours builds with protox like the rest of the protocol.
#[allow(
    clippy::all,
    clippy::pedantic,
    rust_2018_idioms,
    missing_docs,
    reason = "generated code"
)]
pub mod etcd {
    pub mod mvccpb {
        tonic::include_proto!("mvccpb");
    }
    pub mod etcdserverpb {
        tonic::include_proto!("etcdserverpb");
    }
    pub mod v3electionpb {
        tonic::include_proto!("v3electionpb");
    }
}
