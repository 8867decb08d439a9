//! The open-handle table: which inode each open handle names, and how many handles are open
//! per inode. Not durable: handles die with their sessions and with the server. The committer
//! keeps the table next to the tables (`store::State::handles`) so that namespace jobs can ask
//! whether an inode whose last link goes is still open (then it lives on as an orphan).

use std::collections::HashMap;

/// Open file handles: which inode each names, and how many are open per inode and session
/// (an inode with no links left lives on as an orphan until its last handle is released).
/// Every question of a release or an unlink is answered from the per-inode counts, never by
/// a walk over all the handles (thousands are open at once under a `tar x` or 8 writers).
#[derive(Debug, Default)]
pub struct Handles {
    pub next: u64,
    pub by_handle: HashMap<u64, OpenFile>,
    /// Per inode: the sessions with handles on it, and how many each.
    per_inode: HashMap<u64, Vec<(u64, u32)>>,
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
        let sessions = self.per_inode.entry(ino).or_default();
        match sessions.iter_mut().find(|(s, _)| *s == session) {
            Some((_, n)) => *n += 1,
            None => sessions.push((session, 1)),
        }
    }

    /// Forgets a handle; returns its file and whether that was the inode's last handle.
    pub fn release(&mut self, handle: u64) -> Option<(OpenFile, bool)> {
        let f = self.by_handle.remove(&handle)?;
        let last = match self.per_inode.get_mut(&f.ino) {
            Some(sessions) => {
                if let Some(i) = sessions.iter().position(|(s, _)| *s == f.session) {
                    sessions[i].1 -= 1;
                    if sessions[i].1 == 0 {
                        sessions.swap_remove(i);
                    }
                }
                sessions.is_empty()
            }
            None => true,
        };
        if last {
            self.per_inode.remove(&f.ino);
        }
        Some((f, last))
    }

    /// Whether `handle` is open for writing on `ino` (an ftruncate's right to truncate).
    pub fn writes(&self, handle: u64, ino: u64) -> bool {
        self.by_handle
            .get(&handle)
            .is_some_and(|f| f.ino == ino && f.write)
    }

    pub fn is_open(&self, ino: u64) -> bool {
        self.per_inode.contains_key(&ino)
    }

    /// Whether `session` holds a handle on `ino`.
    pub fn open_by(&self, session: u64, ino: u64) -> bool {
        self.per_inode
            .get(&ino)
            .is_some_and(|sessions| sessions.iter().any(|(s, _)| *s == session))
    }

    /// The sessions holding a handle on `ino` (each once, in order).
    pub fn sessions_of(&self, ino: u64) -> Vec<u64> {
        let mut s: Vec<u64> = self
            .per_inode
            .get(&ino)
            .map(|sessions| sessions.iter().map(|(s, _)| *s).collect())
            .unwrap_or_default();
        s.sort_unstable();
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_counts_per_inode_and_session_follow_opens_and_releases() {
        let mut h = Handles::default();
        let a1 = h.open(7, 1, true);
        let a2 = h.open(7, 1, false);
        let b = h.open(7, 2, false);
        let other = h.open(8, 2, true);
        assert_eq!(h.sessions_of(7), vec![1, 2]);
        assert!(h.open_by(1, 7) && h.open_by(2, 7) && !h.open_by(1, 8));
        assert_eq!(
            h.release(a1),
            Some((
                OpenFile {
                    ino: 7,
                    session: 1,
                    write: true
                },
                false
            ))
        );
        assert!(h.open_by(1, 7), "one handle of session 1 is left");
        assert_eq!(h.release(a2).map(|(_, last)| last), Some(false));
        assert!(!h.open_by(1, 7));
        assert_eq!(h.sessions_of(7), vec![2]);
        assert_eq!(h.release(a2), None, "released twice");
        assert_eq!(h.release(b).map(|(_, last)| last), Some(true));
        assert!(!h.is_open(7) && h.sessions_of(7).is_empty());
        // A reserved number opened again replaces the handle under it.
        h.open_as(1 << 63 | 9, 9, 3, true);
        h.open_as(1 << 63 | 9, 9, 3, true);
        assert_eq!(h.release(1 << 63 | 9).map(|(_, last)| last), Some(true));
        assert!(!h.is_open(9));
        assert!(h.is_open(8) && h.writes(other, 8) && !h.writes(other, 7));
    }
}
