//! `sanfs-agent`: the client side of the direct path (issue 5).
//!
//! So far its device layer: [`discovery`] finds this node's LUNs of a volume by label
//! identity and opens them with `O_DIRECT`; [`buf`] provides the aligned buffers and their
//! pool; [`engine`] moves a grant's I/O plan between those buffers and the LUNs, all devices at
//! once, with `io_uring` (or `preadv`/`pwritev` where the kernel has no `io_uring`).

pub mod buf;
pub mod discovery;
pub mod engine;
