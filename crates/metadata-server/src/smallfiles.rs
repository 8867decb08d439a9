//! Whole small files in the server's memory (docs/protocol.md "Open with a small file's
//! bytes"): the bytes
//! of files of at most [`SMALL_FILE_MAX`] that the proxied path wrote or read whole, so that
//! an `Open` that asks for a small file's bytes (`OpenRequest::read_small`) and a proxied
//! `Read` of one are answered without a device read.
//!
//! **Never stale.** A file's bytes change only under an exclusive range lock on it (proxied
//! writes, write grants and layouts, truncates, fallocates, a write delegation's write-back):
//! the range locks call [`SmallFiles::forget`] for the inode as they grant any exclusive
//! lock on it, before its holder can write. Bytes are kept only by their reader under a
//! shared lock on the whole file (no exclusive lock there then) or by their writer under its
//! exclusive lock, after the write. Each entry also keeps the size, mtime, ctime and inode
//! generation it was kept with, and answers only attributes equal to them (a second guard,
//! and the one for an inode number used again).
//!
//! **Bounded**: at most [`MAX_BYTES`], the least recently used going first.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

use sanfs_proto::types::{Attr, Timestamp};

/// The largest file kept: the default `direct_io_threshold` (a longer file's reads go the
/// direct path, from the agents' own LUN handles).
pub const SMALL_FILE_MAX: u64 = 64 << 10;
/// Bytes kept at most.
pub const MAX_BYTES: usize = 64 << 20;

/// What an entry was kept with: it answers only while the file's attributes still say so.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Version {
    size: u64,
    mtime: Timestamp,
    ctime: Timestamp,
    generation: u64,
}

impl Version {
    fn of(a: &Attr) -> Version {
        Version {
            size: a.size,
            mtime: a.mtime,
            ctime: a.ctime,
            generation: a.generation,
        }
    }
}

#[derive(Debug)]
struct Kept {
    data: Vec<u8>,
    version: Version,
    /// Its key in `Inner::by_use`.
    used: u64,
}

#[derive(Debug, Default)]
struct Inner {
    files: HashMap<u64, Kept>,
    /// Use tick -> inode, oldest first.
    by_use: BTreeMap<u64, u64>,
    tick: u64,
    bytes: usize,
}

impl Inner {
    fn remove(&mut self, ino: u64) {
        if let Some(k) = self.files.remove(&ino) {
            self.by_use.remove(&k.used);
            self.bytes -= k.data.len();
        }
    }

    fn touch(&mut self, ino: u64) {
        self.tick += 1;
        let tick = self.tick;
        if let Some(k) = self.files.get_mut(&ino) {
            self.by_use.remove(&k.used);
            k.used = tick;
            self.by_use.insert(tick, ino);
        }
    }
}

/// The cache (see the module's text).
#[derive(Debug)]
pub struct SmallFiles {
    inner: Mutex<Inner>,
    max_bytes: usize,
}

impl Default for SmallFiles {
    fn default() -> Self {
        SmallFiles::new(MAX_BYTES)
    }
}

impl SmallFiles {
    pub fn new(max_bytes: usize) -> SmallFiles {
        SmallFiles {
            inner: Mutex::new(Inner::default()),
            max_bytes,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Keeps `data`, the whole file `attr` describes (its length is the size). Call it under
    /// a lock that keeps every writer out (see the module's text).
    pub fn put(&self, attr: &Attr, data: Vec<u8>) {
        let ino = attr.ino.0;
        if data.len() as u64 != attr.size
            || attr.size == 0
            || attr.size > SMALL_FILE_MAX
            || data.len() > self.max_bytes
        {
            return;
        }
        let mut s = self.lock();
        s.remove(ino);
        while s.bytes + data.len() > self.max_bytes {
            let Some((_, oldest)) = s.by_use.pop_first() else {
                break;
            };
            if let Some(k) = s.files.remove(&oldest) {
                s.bytes -= k.data.len();
            }
        }
        s.tick += 1;
        let used = s.tick;
        s.bytes += data.len();
        s.by_use.insert(used, ino);
        s.files.insert(
            ino,
            Kept {
                data,
                version: Version::of(attr),
                used,
            },
        );
    }

    /// The bytes `[off, off + len)` of the file `attr` describes (fewer at its end), if it is
    /// kept with these very attributes.
    pub fn read(&self, attr: &Attr, off: u64, len: u64) -> Option<Vec<u8>> {
        let ino = attr.ino.0;
        let mut s = self.lock();
        let k = s.files.get(&ino)?;
        if k.version != Version::of(attr) {
            s.remove(ino);
            return None;
        }
        let from = usize::try_from(off).ok()?.min(k.data.len());
        let to = usize::try_from(off.saturating_add(len))
            .unwrap_or(usize::MAX)
            .min(k.data.len());
        let out = k.data[from..to].to_vec();
        s.touch(ino);
        Some(out)
    }

    /// Whether anything of `ino` is kept (whatever its attributes now).
    pub fn holds(&self, ino: u64) -> bool {
        self.lock().files.contains_key(&ino)
    }

    /// The file's bytes may change (an exclusive lock on it was granted): what is kept goes.
    pub fn forget(&self, ino: u64) {
        let mut s = self.lock();
        if s.files.contains_key(&ino) {
            s.remove(ino);
        }
    }

    /// (files, bytes) kept now.
    pub fn size(&self) -> (usize, usize) {
        let s = self.lock();
        (s.files.len(), s.bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sanfs_proto::types::{FileType, InodeId};

    fn attr(ino: u64, size: u64, mtime: i64) -> Attr {
        let ts = |s| Timestamp { sec: s, nsec: 0 };
        Attr {
            ino: InodeId(ino),
            kind: FileType::Regular,
            perm: 0o644,
            nlink: 1,
            uid: 0,
            gid: 0,
            size,
            allocated: 4096,
            atime: ts(1),
            mtime: ts(mtime),
            ctime: ts(mtime),
            btime: ts(1),
            rdev: 0,
            generation: 1,
            no_xattrs: false,
        }
    }

    #[test]
    fn kept_bytes_answer_only_the_attributes_they_were_kept_with() {
        let c = SmallFiles::default();
        c.put(&attr(5, 5, 10), b"hello".to_vec());
        assert_eq!(c.read(&attr(5, 5, 10), 1, 3), Some(b"ell".to_vec()));
        assert_eq!(c.read(&attr(5, 5, 10), 3, 100), Some(b"lo".to_vec()));
        assert_eq!(
            c.read(&attr(5, 5, 10), 9, 1),
            Some(Vec::new()),
            "past the end"
        );
        assert_eq!(c.read(&attr(5, 5, 11), 0, 5), None, "a new mtime");
        assert_eq!(c.read(&attr(5, 5, 10), 0, 5), None, "and it is gone");
        let mut again = attr(5, 5, 10);
        c.put(&again, b"hello".to_vec());
        again.generation = 2;
        assert_eq!(c.read(&again, 0, 5), None, "an inode number used again");
    }

    #[test]
    fn only_whole_small_files_are_kept_and_forget_drops_them() {
        let c = SmallFiles::default();
        c.put(&attr(1, 6, 1), b"hello".to_vec());
        c.put(&attr(2, 0, 1), Vec::new());
        c.put(
            &attr(3, SMALL_FILE_MAX + 1, 1),
            vec![0; usize::try_from(SMALL_FILE_MAX).unwrap_or(0) + 1],
        );
        assert_eq!(c.size(), (0, 0));
        c.put(&attr(4, 3, 1), b"abc".to_vec());
        c.forget(4);
        assert_eq!(c.read(&attr(4, 3, 1), 0, 3), None);
        assert_eq!(c.size(), (0, 0));
    }

    #[test]
    fn past_its_bound_the_least_recently_used_go_first() {
        let c = SmallFiles::new(10);
        c.put(&attr(1, 4, 1), b"aaaa".to_vec());
        c.put(&attr(2, 4, 1), b"bbbb".to_vec());
        assert!(c.read(&attr(1, 4, 1), 0, 4).is_some(), "1 used last");
        c.put(&attr(3, 4, 1), b"cccc".to_vec());
        assert_eq!(c.size(), (2, 8));
        assert!(c.read(&attr(2, 4, 1), 0, 4).is_none(), "2 went");
        assert!(c.read(&attr(1, 4, 1), 0, 4).is_some());
        assert!(c.read(&attr(3, 4, 1), 0, 4).is_some());
    }
}
