//! sanfs-lun against real LUNs: loop devices (root) and files, and a file system that refuses
//! `O_DIRECT` (ramfs, root).

#![allow(clippy::unwrap_used, reason = "tests")]

mod fallback;
mod loop_device;
