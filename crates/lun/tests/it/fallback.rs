//! A file system that refuses `O_DIRECT` (ramfs): the LUN is used buffered, and the strict
//! open says no.

use std::path::{Path, PathBuf};
use std::process::Command;

use sanfs_lun::Access;
use sanfs_testcluster::skip_unless_root;

/// A ramfs mounted on a fresh directory, unmounted (by its path) on drop.
struct Ramfs {
    dir: tempfile::TempDir,
}

impl Ramfs {
    fn mount() -> Ramfs {
        let dir = tempfile::Builder::new()
            .prefix("sanfs-lun-ramfs")
            .tempdir()
            .unwrap();
        let status = Command::new("mount")
            .args(["-t", "ramfs", "sanfs-lun-test"])
            .arg(dir.path())
            .status()
            .unwrap();
        assert!(status.success(), "mount ramfs on {}", dir.path().display());
        Ramfs { dir }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }
}

impl Drop for Ramfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(self.dir.path()).status();
    }
}

fn write_file(path: &Path, len: usize) -> Vec<u8> {
    let data: Vec<u8> = (0..len).map(|i| (i % 253) as u8).collect();
    std::fs::write(path, &data).unwrap();
    data
}

#[test]
fn where_o_direct_is_refused_the_lun_is_used_buffered() {
    if skip_unless_root("mounting a ramfs") {
        return;
    }
    let fs = Ramfs::mount();
    let path = fs.path("lun");
    let data = write_file(&path, 10_000);

    let strict = sanfs_lun::open_direct_strict(&path, Access::Read).unwrap_err();
    assert_eq!(
        strict.raw_os_error(),
        Some(rustix::io::Errno::INVAL.raw_os_error())
    );
    let (file, direct) = sanfs_lun::open_direct(&path, Access::ReadWrite).unwrap();
    assert!(!direct, "ramfs has no O_DIRECT: buffered");
    let g = sanfs_lun::describe(&file).unwrap();
    assert_eq!((g.size_bytes, g.logical_block_size), (10_000, 512));
    // The probe reads the whole (short, unaligned) file buffered.
    assert_eq!(sanfs_lun::read_head(&path).unwrap(), data);
    assert_eq!(sanfs_lun::probe_identity(&path).unwrap(), None);
}

#[test]
fn a_file_that_takes_o_direct_is_opened_direct() {
    // Cargo's target directory is on a local disk file system, which takes O_DIRECT (/tmp may
    // be a tmpfs that does not, on kernels before 6.6).
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let path = dir.path().join("lun");
    std::fs::File::create(&path)
        .unwrap()
        .set_len(1 << 20)
        .unwrap();
    let (file, direct) = sanfs_lun::open_direct(&path, Access::ReadWrite).unwrap();
    assert!(direct);
    sanfs_lun::open_direct_strict(&path, Access::Read).unwrap();
    let g = sanfs_lun::describe(&file).unwrap();
    assert_eq!(g.size_bytes, 1 << 20);
    // A short tail: the head is the whole file even though its length is not aligned.
    let short = dir.path().join("short");
    let data = write_file(&short, 700);
    assert_eq!(sanfs_lun::read_head(&short).unwrap(), data);
}
