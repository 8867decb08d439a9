//! What a sanfs CSI volume is, as values: the volume id a CO name maps to, the capacity a
//! requested range gives, the StorageClass parameters, and which capabilities sanfs serves.
//! No I/O here.
//!
//! **Volume ids.** A volume is the directory `ROOT/ID` of the file system, carrying a
//! directory quota. `ID` is derived from the CO's name alone, so a retried CreateVolume finds
//! the same directory (idempotency by name) and the id is stable for the life of the volume:
//! a *plain* name (1 to 128 bytes of `[A-Za-z0-9._-]`, starting with a letter or digit, as
//! Kubernetes' `pvc-<uid>` names are) is its own id; any other name (CSI allows any Unicode
//! without control characters, `/` included) becomes `_` followed by the 64 hex digits of its
//! SHA-256. The two forms cannot collide (a plain name never starts with `_`), every id is a
//! safe single directory name (no `/`, never `.` or `..`) within CSI's 128-byte string limit,
//! and an id of neither form is one sanfs never made: it names no volume.

use std::collections::BTreeMap;

use sanfs_proto::csi::{AccessMode, AccessType, CapacityRange, VolumeCapability, VolumeName};
use sanfs_proto::types::FileName;
use sha2::{Digest, Sha256};

/// Longest plain volume id (CSI's string limit).
const MAX_ID_LEN: usize = 128;

fn is_plain(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= MAX_ID_LEN
        && b[0].is_ascii_alphanumeric()
        && b.iter()
            .all(|&c| c.is_ascii_alphanumeric() || matches!(c, b'.' | b'_' | b'-'))
}

/// The volume id (and directory name) of the volume the CO calls `name`.
pub fn volume_id(name: &VolumeName) -> String {
    if is_plain(name.as_str()) {
        return name.as_str().to_owned();
    }
    let digest = Sha256::digest(name.as_str().as_bytes());
    let mut id = String::with_capacity(65);
    id.push('_');
    for byte in digest {
        id.push_str(&format!("{byte:02x}"));
    }
    id
}

/// The directory name of volume id `id`, or `None` if sanfs never makes such an id.
pub fn directory_of(id: &str) -> Option<FileName> {
    let hashed = id.len() == 65
        && id.starts_with('_')
        && id[1..]
            .bytes()
            .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c));
    if !(is_plain(id) || hashed) {
        return None;
    }
    FileName::new(id.as_bytes().to_vec()).ok()
}

/// The parameters a StorageClass may give (`CreateVolumeRequest.parameters`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VolumeParams {
    /// Most files and directories in the volume (`inodes`); `None`: no inode limit.
    pub inodes: Option<u64>,
    /// Permission bits of the volume's top directory (`mode`, octal; default 0777 so that
    /// pods running as any user can write, as the file system has no fsGroup handling).
    pub mode: u32,
    /// Owner of the volume's top directory (`uid`, `gid`; default 0).
    pub uid: u32,
    pub gid: u32,
}

impl Default for VolumeParams {
    fn default() -> VolumeParams {
        VolumeParams {
            inodes: None,
            mode: 0o777,
            uid: 0,
            gid: 0,
        }
    }
}

/// Keys the external-provisioner adds (`--extra-create-metadata`); informative only.
const CO_METADATA_PREFIX: &str = "csi.storage.k8s.io/";

/// Parses StorageClass parameters; unknown keys are refused (a typo must not silently give a
/// volume without the limit the user asked for).
pub fn parse_params(map: &BTreeMap<String, String>) -> Result<VolumeParams, String> {
    let mut p = VolumeParams::default();
    for (key, value) in map {
        let number = |radix: u32| {
            u64::from_str_radix(value.trim(), radix)
                .map_err(|_| format!("parameter {key}={value:?} is not a number"))
        };
        let id = || -> Result<u32, String> {
            u32::try_from(number(10)?).map_err(|_| format!("parameter {key}={value:?} is too big"))
        };
        match key.as_str() {
            "inodes" => {
                let n = number(10)?;
                if n == 0 {
                    return Err("parameter inodes=0 leaves no room for any file".to_owned());
                }
                p.inodes = Some(n);
            }
            "mode" => {
                let m = number(8)?;
                if m > 0o7777 {
                    return Err(format!("parameter mode={value:?} has bits above 07777"));
                }
                p.mode = u32::try_from(m).map_err(|_| "mode".to_owned())?;
            }
            "uid" => p.uid = id()?,
            "gid" => p.gid = id()?,
            k if k.starts_with(CO_METADATA_PREFIX) => {}
            k => {
                return Err(format!(
                    "unknown parameter {k:?} (sanfs takes inodes, mode, uid, gid)"
                ));
            }
        }
    }
    Ok(p)
}

/// The capacity a new volume gets: the required size rounded up to whole blocks (the quota
/// counts blocks), but never above the limit; without a required size, `default` (also
/// rounded, and capped by the limit). Errors when that is 0.
pub fn capacity_for(
    range: Option<&CapacityRange>,
    default: u64,
    block_size: u64,
) -> Result<u64, String> {
    let round_up = |n: u64| -> u64 {
        n.div_ceil(block_size)
            .checked_mul(block_size)
            .unwrap_or(u64::MAX / block_size * block_size)
    };
    let want = match range.and_then(|r| r.required_bytes) {
        Some(required) => round_up(required),
        None => round_up(default),
    };
    let capacity = match range.and_then(|r| r.limit_bytes) {
        Some(limit) => want.min(limit),
        None => want,
    };
    if capacity == 0 {
        return Err("a volume needs a capacity above 0".to_owned());
    }
    Ok(capacity)
}

/// Whether an existing volume of `capacity` bytes satisfies `range`.
pub fn capacity_fits(range: Option<&CapacityRange>, capacity: u64) -> bool {
    let Some(r) = range else {
        return true;
    };
    r.required_bytes.is_none_or(|req| capacity >= req)
        && r.limit_bytes.is_none_or(|l| capacity <= l)
}

/// Mount options sanfs applies to a published volume (on the bind mount).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MountOptions {
    pub read_only: bool,
    pub nosuid: bool,
    pub nodev: bool,
    pub noexec: bool,
    pub noatime: bool,
}

/// The mount options in `flags` (a PersistentVolume's `mountOptions`). Options that mean
/// nothing for a bind mount of a sanfs volume are refused, not ignored.
pub fn mount_options(flags: &[String]) -> Result<MountOptions, String> {
    let mut o = MountOptions::default();
    for flag in flags.iter().flat_map(|f| f.split(',')).map(str::trim) {
        match flag {
            "" | "rw" | "defaults" | "suid" | "dev" | "exec" | "atime" | "relatime" => {}
            "ro" => o.read_only = true,
            "nosuid" => o.nosuid = true,
            "nodev" => o.nodev = true,
            "noexec" => o.noexec = true,
            "noatime" => o.noatime = true,
            f => {
                return Err(format!(
                    "mount option {f:?} is not supported (ro, rw, nosuid, nodev, noexec, noatime)"
                ));
            }
        }
    }
    Ok(o)
}

/// Checks that sanfs serves `cap`: a file-system volume (not block), of file system type
/// `sanfs` (or unnamed), in one of the access modes sanfs offers: the single-node ones and
/// MULTI_NODE_READER_ONLY / MULTI_NODE_MULTI_WRITER.
pub fn check_capability(cap: &VolumeCapability) -> Result<(), String> {
    let AccessType::Mount(mount) = &cap.access_type else {
        return Err(
            "block access is not supported: a sanfs volume is a directory of a shared file system"
                .to_owned(),
        );
    };
    if !matches!(mount.fs_type.as_str(), "" | "sanfs" | "fuse.sanfs") {
        return Err(format!(
            "file system type {:?} is not supported (only sanfs)",
            mount.fs_type
        ));
    }
    if !mount.volume_mount_group.is_empty() {
        return Err("volume_mount_group is not supported".to_owned());
    }
    mount_options(&mount.mount_flags)?;
    match cap.access_mode {
        AccessMode::SingleNodeWriter
        | AccessMode::SingleNodeReaderOnly
        | AccessMode::MultiNodeReaderOnly
        | AccessMode::MultiNodeMultiWriter => Ok(()),
        m => Err(format!("access mode {m:?} is not supported")),
    }
}

/// Checks every capability; the first unsupported one is the error.
pub fn check_capabilities(caps: &[VolumeCapability]) -> Result<(), String> {
    caps.iter().try_for_each(check_capability)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]

    use super::*;
    use sanfs_proto::csi::MountVolume;

    fn name(s: &str) -> VolumeName {
        VolumeName::new(s.to_owned()).unwrap()
    }

    #[test]
    fn plain_names_are_their_own_ids_others_are_hashed() {
        let pvc = "pvc-0b3c8f1e-58a1-4a77-9e53-3c1a1b2d4f00";
        assert_eq!(volume_id(&name(pvc)), pvc);
        let max = "a".repeat(128);
        assert_eq!(volume_id(&name(&max)), max);
        for odd in ["a/b", "..", ".hidden", "_x", "with space", "ü", "x\ty"] {
            let id = volume_id(&name(odd));
            assert_eq!(id.len(), 65, "{odd:?}");
            assert!(id.starts_with('_'));
            assert!(directory_of(&id).is_some(), "{odd:?} -> {id}");
            // Stable: the same name, the same id.
            assert_eq!(id, volume_id(&name(odd)));
        }
        assert_ne!(volume_id(&name("a/b")), volume_id(&name("a/c")));
        // Every id sanfs makes names a directory; ids it never makes name none.
        assert!(directory_of(pvc).is_some());
        for never in [
            "",
            ".",
            "..",
            "a/b",
            "_abc",
            "-x",
            &"a".repeat(129),
            &format!("_{}", "G".repeat(64)),
        ] {
            assert!(directory_of(never).is_none(), "{never:?}");
        }
    }

    #[test]
    fn capacity_rounds_up_to_blocks_within_the_limit() {
        let r = |required_bytes, limit_bytes| CapacityRange {
            required_bytes,
            limit_bytes,
        };
        let bs = 4096;
        assert_eq!(capacity_for(None, 1 << 30, bs), Ok(1 << 30));
        assert_eq!(capacity_for(Some(&r(Some(1), None)), 0, bs), Ok(4096));
        assert_eq!(
            capacity_for(Some(&r(Some(8192), Some(8192))), 0, bs),
            Ok(8192)
        );
        assert_eq!(
            capacity_for(Some(&r(Some(5000), Some(6000))), 0, bs),
            Ok(6000)
        );
        assert_eq!(
            capacity_for(Some(&r(None, Some(10_000))), 1 << 30, bs),
            Ok(10_000)
        );
        assert!(capacity_for(None, 0, bs).is_err());
        assert!(capacity_for(Some(&r(Some(u64::MAX), None)), 0, bs).is_ok());
        assert!(capacity_fits(None, 1));
        assert!(capacity_fits(Some(&r(Some(100), None)), 4096));
        assert!(!capacity_fits(Some(&r(Some(8192), Some(8192))), 4096));
        assert!(!capacity_fits(Some(&r(None, Some(100))), 4096));
    }

    #[test]
    fn parameters_are_checked() {
        let p = |pairs: &[(&str, &str)]| {
            parse_params(
                &pairs
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                    .collect(),
            )
        };
        assert_eq!(p(&[]), Ok(VolumeParams::default()));
        let got = p(&[
            ("inodes", "1000"),
            ("mode", "2775"),
            ("uid", "1000"),
            ("gid", "2000"),
            ("csi.storage.k8s.io/pvc/name", "data"),
        ])
        .unwrap();
        assert_eq!(
            got,
            VolumeParams {
                inodes: Some(1000),
                mode: 0o2775,
                uid: 1000,
                gid: 2000
            }
        );
        assert!(p(&[("inode", "5")]).is_err());
        assert!(p(&[("inodes", "0")]).is_err());
        assert!(p(&[("mode", "999")]).is_err());
        assert!(p(&[("mode", "17777")]).is_err());
        assert!(p(&[("uid", "-1")]).is_err());
        assert!(p(&[("uid", "4294967296")]).is_err());
    }

    #[test]
    fn capabilities_sanfs_serves() {
        let cap = |access_type, access_mode| VolumeCapability {
            access_type,
            access_mode,
        };
        let mount = |fs: &str, flags: &[&str]| {
            AccessType::Mount(MountVolume {
                fs_type: fs.to_owned(),
                mount_flags: flags.iter().map(|f| (*f).to_owned()).collect(),
                volume_mount_group: String::new(),
            })
        };
        assert!(check_capability(&cap(mount("", &[]), AccessMode::MultiNodeMultiWriter)).is_ok());
        assert!(
            check_capability(&cap(
                mount("sanfs", &["ro", "noexec"]),
                AccessMode::SingleNodeWriter
            ))
            .is_ok()
        );
        assert!(check_capability(&cap(AccessType::Block, AccessMode::SingleNodeWriter)).is_err());
        assert!(check_capability(&cap(mount("ext4", &[]), AccessMode::SingleNodeWriter)).is_err());
        assert!(
            check_capability(&cap(mount("", &["vers=4"]), AccessMode::SingleNodeWriter)).is_err()
        );
        assert!(check_capability(&cap(mount("", &[]), AccessMode::MultiNodeSingleWriter)).is_err());
        assert_eq!(
            mount_options(&["ro,nosuid".to_owned(), "nodev".to_owned()]),
            Ok(MountOptions {
                read_only: true,
                nosuid: true,
                nodev: true,
                noexec: false,
                noatime: false
            })
        );
    }
}
