//! This process's mount table, `/proc/self/mountinfo`, as the agent's parts need it: the CSI
//! node plugin (which mount sits at a path), the control socket (the FUSE mounts and their
//! device numbers) and the `mount.sanfs` helper (the mount ids at a directory) all read it
//! here, and nowhere else.
//!
//! The lines are parsed by `procfs-core` ([`MountInfo::from_line`]), a line it cannot parse
//! costs that line only. It keeps the kernel's octal escapes (`\040` for a space, `\011` a
//! tab, `\012` a newline, `\134` a backslash) in the paths and the source; [`unescape`] undoes
//! them, so a mount point is the path a caller compares with.

use std::io;
use std::path::PathBuf;

use procfs_core::process::MountInfo;

/// The mount table this process sees.
pub const MOUNTINFO: &str = "/proc/self/mountinfo";

/// One mount of the table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mount {
    /// The mount id (the first field), unique among the mounts of the table.
    pub id: u64,
    /// The device number of the mounted file system (what `stat` reports as `st_dev` for the
    /// files on it).
    pub major: u32,
    pub minor: u32,
    /// The path inside the mounted file system that is mounted here.
    pub root: String,
    pub mount_point: PathBuf,
    /// Whether the mount (not the file system) is read-only: `ro` among its per-mount options.
    pub read_only: bool,
    /// The file-system type (`fuse`, `fuse.sanfs`, `ext4`, ...).
    pub fs_type: String,
    /// The source (for sanfs: `SERVER:PORT:/SUBDIR`, the agent's FUSE fsname); empty for
    /// `none`.
    pub source: String,
}

impl Mount {
    pub fn is_read_only(&self) -> bool {
        self.read_only
    }

    fn from_info(m: MountInfo) -> Option<Mount> {
        let (major, minor) = m.majmin.split_once(':')?;
        Some(Mount {
            id: u64::try_from(m.mnt_id).ok()?,
            major: major.parse().ok()?,
            minor: minor.parse().ok()?,
            root: unescape(&m.root),
            mount_point: PathBuf::from(unescape(&m.mount_point.to_string_lossy())),
            read_only: m.mount_options.contains_key("ro"),
            fs_type: unescape(&m.fs_type),
            source: m.mount_source.as_deref().map(unescape).unwrap_or_default(),
        })
    }
}

/// Undoes the octal escapes the kernel writes in mountinfo fields; a `\` not followed by
/// three octal digits stays.
pub fn unescape(field: &str) -> String {
    let b = field.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while let Some(&c) = b.get(i) {
        let octal = b
            .get(i + 1..i + 4)
            .filter(|d| d.iter().all(|d| (b'0'..=b'7').contains(d)))
            .and_then(|d| std::str::from_utf8(d).ok())
            .and_then(|d| u8::from_str_radix(d, 8).ok());
        match (c, octal) {
            (b'\\', Some(v)) => {
                out.push(v);
                i += 4;
            }
            _ => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The mounts of a mountinfo text, in its order; lines that do not parse are skipped.
pub fn parse(text: &str) -> Vec<Mount> {
    text.lines()
        .filter_map(|line| MountInfo::from_line(line).ok())
        .filter_map(Mount::from_info)
        .collect()
}

/// The mounts this process sees, in the table's order (a mount stacked on another at the
/// same path comes after it).
pub fn read() -> io::Result<Vec<Mount>> {
    Ok(parse(&std::fs::read_to_string(MOUNTINFO)?))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]

    use std::path::Path;

    use super::*;

    #[test]
    fn lines_parse_with_escapes_and_optional_fields() {
        let text = "\
36 35 98:0 /mnt1 /mnt/parent rw,noatime master:1 - ext3 /dev/root rw,errors=continue
613 30 0:58 /in\\040fs /var/lib/kubelet/a\\040b\\011c ro,relatime shared:330 unbindable - fuse.sanfs 10.0.0.1:7410:/csi/p\\134q rw,user_id=0
22 1 8:1 / / rw - tmpfs none rw
garbage line
-1 1 8:1 / /negative rw - ext4 /dev/x rw
40 1 8:1 / /cut-short rw -
";
        let m = parse(text);
        assert_eq!(
            m[1],
            Mount {
                id: 613,
                major: 0,
                minor: 58,
                root: "/in fs".to_owned(),
                mount_point: PathBuf::from("/var/lib/kubelet/a b\tc"),
                read_only: true,
                fs_type: "fuse.sanfs".to_owned(),
                source: "10.0.0.1:7410:/csi/p\\q".to_owned(),
            }
        );
        assert_eq!(m.len(), 3, "{m:?}");
        assert_eq!((m[0].id, m[0].major, m[0].minor), (36, 98, 0));
        assert!(!m[0].is_read_only());
        assert_eq!(m[0].root, "/mnt1");
        assert_eq!(m[2].source, "");
        assert_eq!(unescape("a\\134b\\011"), "a\\b\t");
        assert_eq!(unescape("trailing\\04"), "trailing\\04");
        assert_eq!(unescape("not\\089octal"), "not\\089octal");
    }

    /// The kernel's escape of a space in a mount point, undone: a tmpfs mounted at a
    /// directory whose name has a space and a tab is found at that path.
    #[test]
    fn a_mount_point_with_a_space_is_found_by_its_path() {
        if sanfs_testcluster::skip_unless_root("mounting a tmpfs at a path with a space") {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let at = dir.path().join("h18 with space\tand tab");
        std::fs::create_dir(&at).unwrap();
        let ro = rustix::mount::MountFlags::RDONLY;
        rustix::mount::mount("sanfs-h18 src", &at, "tmpfs", ro, None::<&std::ffi::CStr>).unwrap();
        let at = std::fs::canonicalize(&at).unwrap();
        let found = read().unwrap().into_iter().rfind(|m| m.mount_point == at);
        rustix::mount::unmount(&at, rustix::mount::UnmountFlags::DETACH).unwrap();
        let found = found.unwrap();
        assert_eq!(found.fs_type, "tmpfs");
        assert_eq!(found.source, "sanfs-h18 src");
        assert!(found.is_read_only());
        assert!(read().unwrap().iter().all(|m| m.mount_point != at));
        assert!(
            read()
                .unwrap()
                .iter()
                .any(|m| m.mount_point == Path::new("/"))
        );
    }
}
