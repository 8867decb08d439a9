//! The records the metadata store keeps, and their encodings.
//!
//! Every value is sealed with `blockmap::codec::seal` (magic, version, length, crc32c), so a
//! record that redb returns intact but that some bug or tool mangled is still caught: decoding
//! checks the checksum and every field, and never panics. Byte layouts are in
//! docs/on-disk-format.md ("Metadata store").

use sanfs_blockmap::codec::{self, DecodeError, Reader, Writer};
use sanfs_proto::types::{Attr, FileType, InodeId, Timestamp};
use uuid::Uuid;

const INODE_MAGIC: [u8; 4] = *b"SIN1";
/// Version 2 added `project` (the directory quota the inode is charged to); version 1
/// records read as `project = 0`.
const INODE_VERSION: u16 = 2;
const SUPER_MAGIC: [u8; 4] = *b"SSB1";
const SUPER_VERSION: u16 = 1;
const GROWN_DEVICES_MAGIC: [u8; 4] = *b"SGD1";
const GROWN_DEVICES_VERSION: u16 = 1;
/// Most paths a [`GrownDevices`] record holds (a volume has at most 4096 devices).
const MAX_GROWN_DEVICE_PATHS: u32 = 4096;
/// Longest path in a [`GrownDevices`] record (Linux's `PATH_MAX`).
const MAX_GROWN_DEVICE_PATH_BYTES: usize = 4096;

/// The version of the metadata store's layout (tables and records). Bumped on any change
/// that an older server could misread.
pub const STORE_FORMAT_VERSION: u32 = 1;

/// One inode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InodeRec {
    pub kind: FileType,
    /// Permission bits (`0o7777`).
    pub perm: u32,
    pub uid: u32,
    pub gid: u32,
    pub nlink: u32,
    /// Bytes; for a directory the number of entries, for a symlink the target's length.
    pub size: u64,
    /// Volume blocks mapped to the file (the sum of its extents' lengths).
    pub blocks: u64,
    pub atime: Timestamp,
    pub mtime: Timestamp,
    pub ctime: Timestamp,
    pub btime: Timestamp,
    pub rdev: u64,
    pub generation: u64,
    /// Directories: the parent directory (the root is its own parent). 0 otherwise.
    pub parent: u64,
    /// Directories: the next readdir cookie to hand out. 0 otherwise.
    pub next_cookie: u64,
    /// Symlinks: the target.
    pub target: Vec<u8>,
    /// The directory quota this inode is charged to (the quota directory's inode), 0 for none.
    /// Set at creation from the parent; renames and links across quotas are refused (EXDEV).
    pub project: u64,
}

impl InodeRec {
    pub fn attr(&self, ino: InodeId, block_size: u32) -> Attr {
        Attr {
            ino,
            kind: self.kind,
            perm: self.perm,
            nlink: self.nlink,
            uid: self.uid,
            gid: self.gid,
            size: self.size,
            allocated: self.blocks.saturating_mul(u64::from(block_size)),
            atime: self.atime,
            mtime: self.mtime,
            ctime: self.ctime,
            btime: self.btime,
            rdev: self.rdev,
            generation: self.generation,
            no_xattrs: false,
        }
    }

    pub fn is_dir(&self) -> bool {
        self.kind == FileType::Directory
    }

    /// Ok for a regular file; EISDIR for a directory, EINVAL for anything else: what data
    /// operations answer on an inode that holds no file data.
    pub fn regular(&self) -> Result<(), sanfs_proto::types::FsError> {
        match self.kind {
            FileType::Regular => Ok(()),
            FileType::Directory => Err(sanfs_proto::types::FsError::IsDir),
            _ => Err(sanfs_proto::types::FsError::Invalid(
                "not a regular file".into(),
            )),
        }
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::with_capacity(128 + self.target.len());
        w.u8(kind_code(self.kind))
            .u32(self.perm)
            .u32(self.uid)
            .u32(self.gid)
            .u32(self.nlink)
            .u64(self.size)
            .u64(self.blocks);
        for t in [self.atime, self.mtime, self.ctime, self.btime] {
            w.i64(t.sec).u32(t.nsec);
        }
        w.u64(self.rdev)
            .u64(self.generation)
            .u64(self.parent)
            .u64(self.next_cookie)
            .bytes(&self.target)
            .u64(self.project);
        codec::seal(INODE_MAGIC, INODE_VERSION, &w.into_vec())
    }

    pub fn decode(bytes: &[u8]) -> Result<InodeRec, DecodeError> {
        let (version, payload) = codec::open(INODE_MAGIC, INODE_VERSION, bytes)?;
        let mut r = Reader::new(payload);
        let kind = kind_from_code(r.u8()?)?;
        let perm = r.u32()?;
        if perm & !0o7777 != 0 {
            return Err(DecodeError::Invalid(format!("mode bits {perm:o}")));
        }
        let uid = r.u32()?;
        let gid = r.u32()?;
        let nlink = r.u32()?;
        let size = r.u64()?;
        let blocks = r.u64()?;
        let mut times = [Timestamp::default(); 4];
        for t in &mut times {
            let sec = r.i64()?;
            let nsec = r.u32()?;
            *t = Timestamp::new(sec, nsec).map_err(|e| DecodeError::Invalid(e.to_string()))?;
        }
        let rdev = r.u64()?;
        let generation = r.u64()?;
        let parent = r.u64()?;
        let next_cookie = r.u64()?;
        let target = r.bytes()?.to_vec();
        let project = if version >= 2 { r.u64()? } else { 0 };
        r.finish()?;
        let [atime, mtime, ctime, btime] = times;
        Ok(InodeRec {
            kind,
            perm,
            uid,
            gid,
            nlink,
            size,
            blocks,
            atime,
            mtime,
            ctime,
            btime,
            rdev,
            generation,
            parent,
            next_cookie,
            target,
            project,
        })
    }
}

pub fn kind_code(kind: FileType) -> u8 {
    match kind {
        FileType::Regular => 1,
        FileType::Directory => 2,
        FileType::Symlink => 3,
        FileType::Fifo => 4,
        FileType::Socket => 5,
        FileType::CharDevice => 6,
        FileType::BlockDevice => 7,
    }
}

pub fn kind_from_code(code: u8) -> Result<FileType, DecodeError> {
    Ok(match code {
        1 => FileType::Regular,
        2 => FileType::Directory,
        3 => FileType::Symlink,
        4 => FileType::Fifo,
        5 => FileType::Socket,
        6 => FileType::CharDevice,
        7 => FileType::BlockDevice,
        other => return Err(DecodeError::Invalid(format!("file type code {other}"))),
    })
}

/// What the store knows about the file system as a whole (the `super` record).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Superblock {
    pub format_version: u32,
    pub fs_uuid: Uuid,
    pub block_size: u32,
    /// Stripe unit in blocks used for allocation alignment (0: none).
    pub stripe_unit_blocks: u64,
    pub created: Timestamp,
    /// For a volume imported from LVM2: the VG and LV names.
    pub lvm: Option<(String, String)>,
}

impl Superblock {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::with_capacity(96);
        w.u32(self.format_version)
            .raw(self.fs_uuid.as_bytes())
            .u32(self.block_size)
            .u64(self.stripe_unit_blocks)
            .i64(self.created.sec)
            .u32(self.created.nsec);
        match &self.lvm {
            None => w.u8(0),
            Some((vg, lv)) => w.u8(1).bytes(vg.as_bytes()).bytes(lv.as_bytes()),
        };
        codec::seal(SUPER_MAGIC, SUPER_VERSION, &w.into_vec())
    }

    pub fn decode(bytes: &[u8]) -> Result<Superblock, DecodeError> {
        let (_, payload) = codec::open(SUPER_MAGIC, SUPER_VERSION, bytes)?;
        let mut r = Reader::new(payload);
        let format_version = r.u32()?;
        if format_version != STORE_FORMAT_VERSION {
            return Err(DecodeError::Invalid(format!(
                "metadata store format {format_version}; this server reads {STORE_FORMAT_VERSION}"
            )));
        }
        let fs_uuid =
            Uuid::from_slice(r.take(16)?).map_err(|e| DecodeError::Invalid(e.to_string()))?;
        let block_size = r.u32()?;
        if !block_size.is_power_of_two() || !(512..=65536).contains(&block_size) {
            return Err(DecodeError::Invalid(format!("block size {block_size}")));
        }
        let stripe_unit_blocks = r.u64()?;
        let sec = r.i64()?;
        let nsec = r.u32()?;
        let created = Timestamp::new(sec, nsec).map_err(|e| DecodeError::Invalid(e.to_string()))?;
        let lvm = match r.u8()? {
            0 => None,
            1 => {
                let text = |r: &mut Reader<'_>| -> Result<String, DecodeError> {
                    String::from_utf8(r.bytes()?.to_vec())
                        .map_err(|e| DecodeError::Invalid(e.to_string()))
                };
                Some((text(&mut r)?, text(&mut r)?))
            }
            other => return Err(DecodeError::Invalid(format!("lvm flag {other}"))),
        };
        r.finish()?;
        Ok(Superblock {
            format_version,
            fs_uuid,
            block_size,
            stripe_unit_blocks,
            created,
            lvm,
        })
    }
}

const BACKUP_MAGIC: [u8; 4] = *b"SBK1";
const BACKUP_VERSION: u16 = 1;

/// What a backup is (the `backup` record of a backup's `super` table, written by
/// `Store::backup`; a live store has none): the file system, the server start and the last
/// commit of the snapshot it was copied from, and when.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackupRecord {
    pub fs_uuid: Uuid,
    /// The server's start count (boot epoch) when the snapshot was taken.
    pub boot_epoch: u64,
    /// The (epoch, number) of the last commit in the snapshot.
    pub commit_epoch: u64,
    pub commit_seq: u64,
    pub taken_at: Timestamp,
    /// The version of the server that wrote it.
    pub server_version: String,
}

impl BackupRecord {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::with_capacity(96);
        w.raw(self.fs_uuid.as_bytes())
            .u64(self.boot_epoch)
            .u64(self.commit_epoch)
            .u64(self.commit_seq)
            .i64(self.taken_at.sec)
            .u32(self.taken_at.nsec)
            .bytes(self.server_version.as_bytes());
        codec::seal(BACKUP_MAGIC, BACKUP_VERSION, &w.into_vec())
    }

    pub fn decode(bytes: &[u8]) -> Result<BackupRecord, DecodeError> {
        let (_, payload) = codec::open(BACKUP_MAGIC, BACKUP_VERSION, bytes)?;
        let mut r = Reader::new(payload);
        let fs_uuid =
            Uuid::from_slice(r.take(16)?).map_err(|e| DecodeError::Invalid(e.to_string()))?;
        let boot_epoch = r.u64()?;
        let commit_epoch = r.u64()?;
        let commit_seq = r.u64()?;
        let sec = r.i64()?;
        let nsec = r.u32()?;
        let taken_at =
            Timestamp::new(sec, nsec).map_err(|e| DecodeError::Invalid(e.to_string()))?;
        let server_version = String::from_utf8(r.bytes()?.to_vec())
            .map_err(|e| DecodeError::Invalid(e.to_string()))?;
        r.finish()?;
        Ok(BackupRecord {
            fs_uuid,
            boot_epoch,
            commit_epoch,
            commit_seq,
            taken_at,
            server_version,
        })
    }
}

/// The server-host paths of the LUNs added by growths (`Admin.GrowVolume`, as given to it),
/// in the order they were added, each once: a restarted server opens them besides
/// `volume.devices` (the `"grown_devices"` record of the `super` table, written in the
/// transaction of the growth). Paths only; which device each is stays the label's word.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GrownDevices {
    pub paths: Vec<std::path::PathBuf>,
}

impl GrownDevices {
    /// Adds the paths not listed yet, keeping the order.
    pub fn extend(&mut self, paths: &[std::path::PathBuf]) {
        for p in paths {
            if !self.paths.contains(p) {
                self.paths.push(p.clone());
            }
        }
    }

    pub fn encode(&self) -> Vec<u8> {
        use std::os::unix::ffi::OsStrExt;
        let mut w = Writer::with_capacity(16 + self.paths.len() * 40);
        w.u32(u32::try_from(self.paths.len()).unwrap_or(u32::MAX));
        for p in &self.paths {
            w.bytes(p.as_os_str().as_bytes());
        }
        codec::seal(GROWN_DEVICES_MAGIC, GROWN_DEVICES_VERSION, &w.into_vec())
    }

    pub fn decode(bytes: &[u8]) -> Result<GrownDevices, DecodeError> {
        use std::os::unix::ffi::OsStrExt;
        let (_, payload) = codec::open(GROWN_DEVICES_MAGIC, GROWN_DEVICES_VERSION, bytes)?;
        let mut r = Reader::new(payload);
        let count = r.u32()?;
        if count > MAX_GROWN_DEVICE_PATHS {
            return Err(DecodeError::Invalid(format!(
                "{count} grown device paths (at most {MAX_GROWN_DEVICE_PATHS})"
            )));
        }
        let mut paths = Vec::with_capacity(count as usize);
        for _ in 0..count {
            let raw = r.bytes()?;
            if raw.is_empty() || raw.len() > MAX_GROWN_DEVICE_PATH_BYTES || raw.contains(&0) {
                return Err(DecodeError::Invalid(format!(
                    "a grown device path of {} bytes",
                    raw.len()
                )));
            }
            paths.push(std::path::PathBuf::from(std::ffi::OsStr::from_bytes(raw)));
        }
        r.finish()?;
        Ok(GrownDevices { paths })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> InodeRec {
        InodeRec {
            kind: FileType::Symlink,
            perm: 0o777,
            uid: 1000,
            gid: 100,
            nlink: 1,
            size: 6,
            blocks: 0,
            atime: Timestamp { sec: 1, nsec: 2 },
            mtime: Timestamp { sec: 3, nsec: 4 },
            ctime: Timestamp { sec: 5, nsec: 6 },
            btime: Timestamp { sec: -7, nsec: 8 },
            rdev: 0,
            generation: 9,
            parent: 0,
            next_cookie: 0,
            target: b"/a/b/c".to_vec(),
            project: 7,
        }
    }

    #[test]
    fn inode_roundtrip_and_corruption() {
        let rec = sample();
        let bytes = rec.encode();
        assert_eq!(InodeRec::decode(&bytes).unwrap(), rec);
        for i in 0..bytes.len() {
            let mut bad = bytes.clone();
            bad[i] ^= 0x40;
            assert!(InodeRec::decode(&bad).is_err(), "flip at {i} not caught");
        }
        assert!(InodeRec::decode(&bytes[..bytes.len() - 1]).is_err());
    }

    #[test]
    fn backup_record_roundtrip_and_corruption() {
        let rec = BackupRecord {
            fs_uuid: Uuid::from_u128(7),
            boot_epoch: 3,
            commit_epoch: 3,
            commit_seq: 99,
            taken_at: Timestamp {
                sec: 1_795_000_000,
                nsec: 5,
            },
            server_version: "0.1.0".into(),
        };
        let bytes = rec.encode();
        assert_eq!(BackupRecord::decode(&bytes).unwrap(), rec);
        for i in 0..bytes.len() {
            let mut bad = bytes.clone();
            bad[i] ^= 0x10;
            assert!(
                BackupRecord::decode(&bad).is_err(),
                "flip at {i} not caught"
            );
        }
    }

    #[test]
    fn superblock_roundtrip() {
        let sb = Superblock {
            format_version: STORE_FORMAT_VERSION,
            fs_uuid: Uuid::from_u128(42),
            block_size: 4096,
            stripe_unit_blocks: 16,
            created: Timestamp { sec: 10, nsec: 0 },
            lvm: Some(("vg0".into(), "lv0".into())),
        };
        assert_eq!(Superblock::decode(&sb.encode()).unwrap(), sb);
    }

    #[test]
    fn grown_devices_roundtrip_dedup_and_corruption() {
        let mut g = GrownDevices::default();
        g.extend(&["/dev/loop7".into(), "/dev/disk/by-id/wwn-0x5000c5".into()]);
        g.extend(&["/dev/loop7".into(), "/dev/loop9".into()]);
        let want: Vec<std::path::PathBuf> = vec![
            "/dev/loop7".into(),
            "/dev/disk/by-id/wwn-0x5000c5".into(),
            "/dev/loop9".into(),
        ];
        assert_eq!(g.paths, want);
        let bytes = g.encode();
        assert_eq!(GrownDevices::decode(&bytes).unwrap(), g);
        assert_eq!(
            GrownDevices::decode(&GrownDevices::default().encode()).unwrap(),
            GrownDevices::default()
        );
        for i in 0..bytes.len() {
            let mut bad = bytes.clone();
            bad[i] ^= 0x40;
            assert!(
                GrownDevices::decode(&bad).is_err(),
                "flip at {i} not caught"
            );
        }
        assert!(GrownDevices::decode(&bytes[..bytes.len() - 1]).is_err());
        // Sealed but with an empty path or a NUL in one: refused.
        for raw in [&b""[..], b"/dev/a\0b"] {
            let mut w = Writer::new();
            w.u32(1).bytes(raw);
            let sealed = codec::seal(GROWN_DEVICES_MAGIC, GROWN_DEVICES_VERSION, &w.into_vec());
            assert!(GrownDevices::decode(&sealed).is_err());
        }
    }
}
