//! Integration tests of the agent, by boundary: the engines against real files and loop
//! devices (`engine_io`), discovery against labelled LUNs (`discovery`), the client library
//! against a real in-process metadata server on file-backed LUNs (`client`, `lun_recovery`,
//! `fallocate`, `locks`, `evict`, with their fixture `cluster`), the FUSE mount (`mount`), mount(8)'s
//! against a real in-process metadata server on file-backed LUNs (`client`, `epoch`, `lun_recovery`,
//! `fallocate`, `locks`, with their fixture `cluster`), the FUSE mount (`mount`), mount(8)'s
//! helper `mount.sanfs` with fstab (`mount_sanfs`), `quickstart`, the deployment examples
//! (`deploy`), the CSI driver (`csi`), and the acceptance tests of the data path on a multi-node test cluster
//! (`san`: network namespaces, loop-device LUNs, real agent processes): `e2e`, `coherence`,
//! `agent_crash`, `striping`, `missing_lun`; a mount of several server addresses that follows
//! the one that answers (`failover`); kill -9 of the server under a real mount (`replay`, and
//! issue 19's crash acceptance of namespace changes on two mounts, `ns_crash`). Tests that
//! need root (loop devices, namespaces, FUSE) say that they were skipped and pass without it, or fail under `SANFS_REQUIRE_ROOT=1`
//! (CI; `sanfs_testcluster::skip_unless`); the `san` ones run on loopback with plain files
//! instead where they can.

#![allow(clippy::unwrap_used, reason = "tests")]

mod admin;
mod agent_crash;
mod backup;
mod client;
mod cluster;
mod coherence;
mod creates;
mod csi;
mod deploy;
mod discovery;
mod e2e;
mod engine_io;
mod epoch;
mod evict;
mod failover;
mod fallocate;
mod grow;
mod layouts;
mod leases;
mod locks;
mod lun_recovery;
mod lvm_import;
mod missing_lun;
mod mount;
mod mount_sanfs;
mod ns_crash;
mod quickstart;
mod replay;
mod restart;
mod san;
mod striping;
mod support;
