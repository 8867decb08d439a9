//! LUN access shared by the metadata server and the agent: how a LUN (a block device, or a
//! regular file standing in for one) is opened, how big its direct-I/O unit is, and which LUN
//! it is.
//!
//! - [`open`]: every open of a LUN, with `O_DIRECT` ([`open::open_direct`] falls back to
//!   buffered I/O where the file system refuses it, as tmpfs does) or `O_EXCL`. This is the
//!   one place in the workspace that passes custom open flags for a device; clippy's
//!   `disallowed-methods` (clippy.toml) refuses `OpenOptionsExt::custom_flags` elsewhere.
//! - [`geometry`]: what an open LUN is ([`LunIdentity`]), its size and its logical block
//!   size (sysfs for a block device, `statx(STATX_DIOALIGN)` for a file, else 512).
//! - [`probe`]: reading the first bytes of a LUN with direct I/O and recognising its identity
//!   in them (a sanfs [`DeviceLabel`](sanfs_blockmap::label::DeviceLabel), else an LVM2 PV
//!   label), so that LUNs are found by identity, never by path.
//! - [`glob`]: device globs (`*`, `?`, `[...]` in the last path component), as the agent's
//!   `devices=` and the server's `volume.devices` name LUNs.
//! - [`lvm`]: an LVM2 PV read from its device (label and metadata areas) and the import
//!   rule's checks of the VG and LV state applied to what was read.
//! - [`buf`]: a safe aligned buffer for the direct reads and writes above.
//!
//! The parsing of labels stays in blockmap (pure); this crate does the I/O around it. Errors
//! are `std::io::Error`: every caller handles them as "this LUN is not usable" and reports
//! the path.

#![deny(unsafe_code)]

pub mod buf;
pub mod geometry;
pub mod glob;
pub mod lvm;
pub mod open;
pub mod probe;

pub use buf::AlignedBuf;
pub use geometry::{Geometry, LunIdentity, describe, dio_alignment, logical_block_size};
pub use open::{Access, open_buffered, open_direct, open_direct_strict, open_exclusive};
pub use probe::{identify, probe_identity, read_direct, read_head};
