//! `sanfs-agent`: the client side of the direct path (issue 5).
//!
//! So far its device layer: [`discovery`] finds this node's LUNs of a volume by label
//! identity and opens them with `O_DIRECT`; [`buf`] provides the aligned buffers and their
//! pool; [`engine`] moves a grant's I/O plan between those buffers and the LUNs, all devices at
//! once, with `io_uring` (or `preadv`/`pwritev` where the kernel has no `io_uring`).
//!
//! On top of it, [`client`] is the `sanfs_client` library: a session with its lease and
//! session stream, the namespace calls, and the data path (direct or proxied, with cached read
//! grants), which the FUSE mount, the bench and the tests use; [`fuse`] is the FUSE file system
//! over it that `sanfs-agent mount` serves; [`csi`] is the CSI driver `sanfs-csi` (volumes as
//! directories with quotas, staged on a node with `sanfs-agent mount`). [`control`] is each
//! mount's control socket (what `sanfs-agent status` and `bmap` ask), [`metrics`] the agent's
//! Prometheus endpoint. [`mount_options`] parses a mount's source and `-o` options (for
//! `sanfs-agent mount`, the `mount.sanfs` helper of [`mount_helper`], fstab and the systemd
//! examples), [`logging`] sends the agent's log to stderr, a file or syslog, and
//! [`quickstart`] brings a one-machine sanfs up and down. [`stages`] counts where the data
//! path spends its time and CPU.

pub mod admin;
pub mod buf;
pub mod client;
pub mod control;
pub mod csi;
pub mod discovery;
pub mod engine;
pub mod fuse;
pub mod logging;
pub mod metrics;
pub mod mount_helper;
pub mod mount_options;
pub mod mountinfo;
pub mod quickstart;
pub mod stages;
