//! The node's mount table as the node plugin needs it: which mount sits at a path (parsed
//! from `/proc/self/mountinfo`), whether a sanfs FUSE mount still has its agent (a mount whose
//! agent died answers `ENOTCONN`), bind mounts (read-only and with `nosuid`/`nodev`/`noexec`/
//! `noatime` on request) and unmounts. Everything here blocks; callers run it on
//! `spawn_blocking`.

use std::io;
use std::path::{Path, PathBuf};

use rustix::mount::{MountFlags, UnmountFlags};

use super::volume::MountOptions;

/// Whether a mount-table file system type can be a sanfs FUSE mount: the agent mounts with
/// the `mount` system call as type `fuse` (its subtype `sanfs` shows as `fuse.sanfs` only when
/// mounted through fusermount). The source (`SERVER:PORT:/SUBDIR`) says which volume it is.
pub fn is_fuse_type(fs_type: &str) -> bool {
    fs_type == "fuse" || fs_type == "fuse.sanfs"
}

/// One mount of `/proc/self/mountinfo` ([`crate::mountinfo`] parses it).
pub use crate::mountinfo::Mount as MountEntry;

/// Parses mountinfo text; malformed lines are skipped.
pub fn parse_mountinfo(text: &str) -> Vec<MountEntry> {
    crate::mountinfo::parse(text)
}

/// The mount at exactly `path` (the topmost, when several are stacked), if any.
pub fn mount_at(path: &Path) -> io::Result<Option<MountEntry>> {
    Ok(crate::mountinfo::read()?
        .into_iter()
        .rev()
        .find(|m| m.mount_point == path))
}

/// Most symbolic links [`canonical`] follows in one path (as the kernel's 40).
const MAX_SYMLINKS: usize = 40;

/// `path` (absolute) with every symbolic link in it resolved and `.`/`..` taken out: the form
/// the kernel records mount points in, in mountinfo (a kubelet path under a symlinked
/// `/var/lib/kubelet` is mounted at, and listed under, the link's target). Components that do
/// not exist yet, or cannot be looked at (a mount point whose agent died answers `ENOTCONN`),
/// are kept as they are. A link loop is `ELOOP`.
pub fn canonical(path: &Path) -> io::Result<PathBuf> {
    use std::collections::VecDeque;
    use std::ffi::OsString;
    use std::path::Component;

    fn push_front(rest: &mut VecDeque<OsString>, path: &Path) {
        for c in path.components().rev() {
            match c {
                Component::Normal(n) => rest.push_front(n.to_owned()),
                Component::ParentDir => rest.push_front(OsString::from("..")),
                Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
            }
        }
    }

    if !path.is_absolute() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} is not an absolute path", path.display()),
        ));
    }
    let mut out = PathBuf::from("/");
    let mut rest = VecDeque::new();
    push_front(&mut rest, path);
    let mut links = 0;
    while let Some(name) = rest.pop_front() {
        if name == ".." {
            out.pop();
            continue;
        }
        let next = out.join(&name);
        match std::fs::symlink_metadata(&next) {
            Ok(m) if m.file_type().is_symlink() => {
                links += 1;
                if links > MAX_SYMLINKS {
                    return Err(io::Error::from_raw_os_error(libc::ELOOP));
                }
                let target = std::fs::read_link(&next)?;
                if target.is_absolute() {
                    out = PathBuf::from("/");
                }
                push_front(&mut rest, &target);
            }
            _ => out = next,
        }
    }
    Ok(out)
}

/// What is at a path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PathState {
    Missing,
    Directory,
    /// Exists but is not a directory.
    Other,
    /// A FUSE mount whose daemon is gone (`ENOTCONN`, `ECONNABORTED`) or broken.
    Dead,
}

/// Looks at `path` with `stat` (which a FUSE mount answers through its agent).
pub fn path_state(path: &Path) -> PathState {
    match std::fs::metadata(path) {
        Ok(m) if m.is_dir() => PathState::Directory,
        Ok(_) => PathState::Other,
        Err(e) if e.kind() == io::ErrorKind::NotFound => PathState::Missing,
        Err(e) => {
            if !matches!(e.raw_os_error(), Some(libc::ENOTCONN | libc::ECONNABORTED)) {
                tracing::warn!(path = %path.display(), error = %e, "mount point cannot be read: treating it as dead");
            }
            PathState::Dead
        }
    }
}

/// Bind-mounts `source` at `target`, then applies `options` (a bind mount takes read-only
/// and the other per-mount flags only on a remount).
pub fn bind(source: &Path, target: &Path, options: MountOptions) -> io::Result<()> {
    rustix::mount::mount_bind(source, target)?;
    let mut flags = MountFlags::BIND;
    if options.read_only {
        flags |= MountFlags::RDONLY;
    }
    if options.nosuid {
        flags |= MountFlags::NOSUID;
    }
    if options.nodev {
        flags |= MountFlags::NODEV;
    }
    if options.noexec {
        flags |= MountFlags::NOEXEC;
    }
    if options.noatime {
        flags |= MountFlags::NOATIME;
    }
    if flags != MountFlags::BIND
        && let Err(e) = rustix::mount::mount_remount(target, flags, "")
    {
        // Never leave a writable mount where a read-only one was asked for.
        let _ = rustix::mount::unmount(target, UnmountFlags::DETACH);
        return Err(e.into());
    }
    Ok(())
}

/// Unmounts `path`; a mount whose agent is gone is detached (it cannot answer a sync unmount).
pub fn unmount(path: &Path, dead: bool) -> io::Result<()> {
    let flags = if dead {
        UnmountFlags::DETACH
    } else {
        UnmountFlags::empty()
    };
    match rustix::mount::unmount(path, flags) {
        Ok(()) => Ok(()),
        Err(e) if e == rustix::io::Errno::BUSY && !dead => {
            // A process still has a file open in it: detach now, the kernel finishes when
            // the last user lets go (as `umount -l`).
            tracing::warn!(path = %path.display(), "mount busy: detaching lazily");
            rustix::mount::unmount(path, UnmountFlags::DETACH).map_err(Into::into)
        }
        Err(e) => Err(e.into()),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]

    use super::*;

    #[test]
    fn mountinfo_lines_parse_with_escapes_and_optional_fields() {
        let text = "\
36 35 98:0 /mnt1 /mnt/parent rw,noatime master:1 - ext3 /dev/root rw,errors=continue
612 29 0:58 / /var/lib/kubelet/plugins/x/globalmount rw,nosuid,nodev,relatime shared:330 - fuse.sanfs 10.0.0.1:7410:/csi/pvc-1 rw,user_id=0,group_id=0,allow_other
613 30 0:58 / /var/lib/kubelet/pods/p/volumes/a\\040b/mount ro,relatime shared:330 - fuse.sanfs 10.0.0.1:7410:/csi/pvc-1 rw,user_id=0
garbage line
";
        let m = parse_mountinfo(text);
        assert_eq!(m.len(), 3);
        assert_eq!(m[0].fs_type, "ext3");
        assert_eq!(m[0].root, "/mnt1");
        assert_eq!(m[1].source, "10.0.0.1:7410:/csi/pvc-1");
        assert!(is_fuse_type(&m[1].fs_type) && !is_fuse_type(&m[0].fs_type));
        assert!(!m[1].is_read_only());
        assert_eq!(
            m[2].mount_point,
            PathBuf::from("/var/lib/kubelet/pods/p/volumes/a b/mount")
        );
        assert!(m[2].is_read_only());
    }

    #[test]
    fn canonical_paths_resolve_links_in_any_component_and_keep_missing_ones() {
        let dir = tempfile::tempdir().unwrap();
        let base = std::fs::canonicalize(dir.path()).unwrap();
        std::fs::create_dir_all(base.join("real/plugins")).unwrap();
        std::os::unix::fs::symlink(base.join("real"), base.join("abs")).unwrap();
        std::os::unix::fs::symlink("real/plugins", base.join("rel")).unwrap();
        std::os::unix::fs::symlink("../real", base.join("real/up")).unwrap();
        std::os::unix::fs::symlink("loop", base.join("loop")).unwrap();
        let c = |p: &str| canonical(&base.join(p)).unwrap();
        assert_eq!(c("abs/plugins/x/mount"), base.join("real/plugins/x/mount"));
        assert_eq!(c("rel/staging"), base.join("real/plugins/staging"));
        assert_eq!(c("real/up/up/plugins"), base.join("real/plugins"));
        assert_eq!(c("abs"), base.join("real"));
        assert_eq!(c("real/./plugins/../plugins"), base.join("real/plugins"));
        assert_eq!(c("no/such/path"), base.join("no/such/path"));
        assert_eq!(canonical(Path::new("/")).unwrap(), PathBuf::from("/"));
        assert_eq!(
            canonical(&base.join("loop/x")).unwrap_err().raw_os_error(),
            Some(libc::ELOOP)
        );
        assert_eq!(
            canonical(Path::new("relative")).unwrap_err().kind(),
            io::ErrorKind::InvalidInput
        );
    }

    #[test]
    fn the_root_mount_is_found_and_a_missing_path_is_missing() {
        assert!(mount_at(Path::new("/")).unwrap().is_some());
        assert!(
            mount_at(Path::new("/no/such/mount/point"))
                .unwrap()
                .is_none()
        );
        assert_eq!(path_state(Path::new("/")), PathState::Directory);
        assert_eq!(path_state(Path::new("/no/such/path")), PathState::Missing);
        assert_eq!(
            path_state(Path::new("/proc/self/mountinfo")),
            PathState::Other
        );
    }
}
