//! The open-handle table: which inode each open handle names, and how many handles are open
//! per inode. Not durable: handles die with their sessions and with the server. The committer
//! keeps the table next to the tables (`store::State::handles`) so that namespace jobs can ask
//! whether an inode whose last link goes is still open (then it lives on as an orphan).

use std::collections::HashMap;

/// Open file handles: which inode each names, and how many are open per inode (an inode
/// with no links left lives on as an orphan until its last handle is released).
#[derive(Debug, Default)]
pub struct Handles {
    pub next: u64,
    pub by_handle: HashMap<u64, OpenFile>,
    pub open_count: HashMap<u64, u32>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpenFile {
    pub ino: u64,
    pub session: u64,
    pub write: bool,
}

impl Handles {
    pub fn open(&mut self, ino: u64, session: u64, write: bool) -> u64 {
        self.next += 1;
        let h = self.next;
        self.open_as(h, ino, session, write);
        h
    }

    /// Registers handle `h`, chosen by the caller (a create with a reserved inode number:
    /// `sanfs_proto::model::reserved_create_handle`, which the server's own numbers never
    /// reach); one still open under that number is replaced.
    pub fn open_as(&mut self, h: u64, ino: u64, session: u64, write: bool) {
        if self.by_handle.contains_key(&h) {
            self.release(h);
        }
        self.by_handle.insert(
            h,
            OpenFile {
                ino,
                session,
                write,
            },
        );
        *self.open_count.entry(ino).or_insert(0) += 1;
    }

    /// Forgets a handle; returns its file and whether that was the inode's last handle.
    pub fn release(&mut self, handle: u64) -> Option<(OpenFile, bool)> {
        let f = self.by_handle.remove(&handle)?;
        let last = match self.open_count.get_mut(&f.ino) {
            Some(n) if *n > 1 => {
                *n -= 1;
                false
            }
            _ => {
                self.open_count.remove(&f.ino);
                true
            }
        };
        Some((f, last))
    }

    /// Whether `handle` is open for writing on `ino` (an ftruncate's right to truncate).
    pub fn writes(&self, handle: u64, ino: u64) -> bool {
        self.by_handle
            .get(&handle)
            .is_some_and(|f| f.ino == ino && f.write)
    }

    pub fn is_open(&self, ino: u64) -> bool {
        self.open_count.contains_key(&ino)
    }

    /// The sessions holding a handle on `ino` (each once).
    pub fn sessions_of(&self, ino: u64) -> Vec<u64> {
        let mut s: Vec<u64> = self
            .by_handle
            .values()
            .filter(|f| f.ino == ino)
            .map(|f| f.session)
            .collect();
        s.sort_unstable();
        s.dedup();
        s
    }
}
