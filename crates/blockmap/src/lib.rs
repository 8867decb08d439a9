//! `sanfs-blockmap`: the pure core of sanfs.
//!
//! Everything here takes values and returns values: no files, no sockets, no clock, no async.
//! The metadata server and the client agent own the side effects; this crate owns the rules.
//!
//! - [`volume`]: how the blocks of one file system are laid over its LUNs (linear, striped, or
//!   the segments of an imported LVM2 logical volume), and mapping volume bytes to device bytes.
//! - [`lvm`]: LVM2 import: the on-disk PV label and metadata-area header, the text metadata,
//!   and the volume an LV's segments make.
//! - [`import`]: the import rule: which found device is which volume device (an identity on
//!   two devices is refused), and whether an LVM2 VG's state lets an LV be used.
//! - [`extent`]: a file's extent map with XFS bmbt semantics (Written / Unwritten extents).
//! - [`alloc`]: the free-space allocator (by start and by length, per allocation group).
//! - [`plan`]: the I/O planner that turns a file byte range into per-device I/O.
//! - [`label`]: the sanfs device label and recognising signatures already on a device.
//! - [`codec`]: little-endian, versioned, checksummed binary encodings of the above.
//! - [`advisory`]: POSIX advisory record locks on one file (fcntl, and flock as NFS does it).
#![deny(unsafe_code)]

pub mod advisory;
pub mod alloc;
pub mod codec;
pub mod extent;
pub mod import;
pub mod label;
pub mod lvm;
pub mod plan;
pub mod volume;
