//! POSIX advisory record locks (`fcntl(F_SETLK)`, and `flock` emulated as a whole-file record
//! lock, as NFS does) on one file, as values.
//!
//! A [`FileLocks`] is the set of locks held on one file by any number of owners. The rules are
//! POSIX's: a read (shared) lock conflicts only with another owner's write lock over an
//! overlapping range; a write (exclusive) lock conflicts with any other owner's lock there. An
//! owner's own locks never conflict with each other: a new lock replaces whatever that owner
//! held in its range (upgrading, downgrading, or splitting an older lock), and an owner's
//! overlapping or adjacent locks of one kind merge into one. Unlocking a range removes the
//! owner's coverage there, splitting a lock that straddles it.
//!
//! Ranges are inclusive `[start, end]` byte offsets, as `struct flock` speaks after the kernel
//! resolved `l_whence` and `l_len`; `end == u64::MAX` is "to the end of any file".
//!
//! The metadata server keeps one table per inode for the whole cluster (owners are a session
//! and the agent's lock owner); the agent keeps the same table of what it holds, to reclaim it
//! after a server restart.

/// Shared (`F_RDLCK`) or exclusive (`F_WRLCK`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LockKind {
    Read,
    Write,
}

/// One held lock: `owner` holds `[start, end]` (inclusive) as `kind`; `pid` is what
/// `F_GETLK` reports to another process that it conflicts with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LockRecord<O> {
    pub owner: O,
    pub kind: LockKind,
    pub start: u64,
    pub end: u64,
    pub pid: u32,
}

impl<O: PartialEq> LockRecord<O> {
    fn overlaps(&self, start: u64, end: u64) -> bool {
        self.start <= end && start <= self.end
    }

    /// Whether a lock of `kind` by `owner` over `[start, end]` cannot coexist with this one.
    pub fn conflicts_with(&self, owner: &O, kind: LockKind, start: u64, end: u64) -> bool {
        self.owner != *owner
            && self.overlaps(start, end)
            && (kind == LockKind::Write || self.kind == LockKind::Write)
    }
}

/// The locks held on one file. Records of one owner never overlap, and never touch when they
/// are of one kind (they are merged); records of different owners overlap only when both are
/// read locks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileLocks<O> {
    records: Vec<LockRecord<O>>,
}

impl<O> Default for FileLocks<O> {
    fn default() -> Self {
        FileLocks {
            records: Vec::new(),
        }
    }
}

/// Why a range was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum LockRangeError {
    #[error("lock range ends before it starts ({start} > {end})")]
    Inverted { start: u64, end: u64 },
}

fn check_range(start: u64, end: u64) -> Result<(), LockRangeError> {
    if start > end {
        return Err(LockRangeError::Inverted { start, end });
    }
    Ok(())
}

impl<O: Clone + PartialEq> FileLocks<O> {
    pub fn new() -> FileLocks<O> {
        FileLocks::default()
    }

    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    /// Every held lock, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = &LockRecord<O>> {
        self.records.iter()
    }

    /// The first lock (lowest start) that keeps `owner` from locking `[start, end]` as `kind`
    /// (what `F_GETLK` reports), or `None` if it could be placed.
    pub fn conflict(
        &self,
        owner: &O,
        kind: LockKind,
        start: u64,
        end: u64,
    ) -> Option<&LockRecord<O>> {
        self.records
            .iter()
            .filter(|r| r.conflicts_with(owner, kind, start, end))
            .min_by_key(|r| r.start)
    }

    /// Places a lock if nothing conflicts (`F_SETLK`); on a conflict, nothing changes and the
    /// conflicting lock is returned.
    pub fn try_lock(
        &mut self,
        owner: O,
        kind: LockKind,
        start: u64,
        end: u64,
        pid: u32,
    ) -> Result<Result<(), LockRecord<O>>, LockRangeError> {
        check_range(start, end)?;
        if let Some(c) = self.conflict(&owner, kind, start, end) {
            return Ok(Err(c.clone()));
        }
        self.remove_range(&owner, start, end);
        let mut new = LockRecord {
            owner,
            kind,
            start,
            end,
            pid,
        };
        // Merge with the owner's locks of the same kind that touch the new one.
        self.records.retain(|r| {
            let touches = r.owner == new.owner
                && r.kind == new.kind
                && r.start <= new.end.saturating_add(1)
                && new.start <= r.end.saturating_add(1);
            if touches {
                new.start = new.start.min(r.start);
                new.end = new.end.max(r.end);
            }
            !touches
        });
        self.records.push(new);
        Ok(Ok(()))
    }

    /// Removes `owner`'s locks inside `[start, end]` (`F_UNLCK`), splitting those that
    /// straddle its edges. Unlocking what is not held is not an error.
    pub fn unlock(&mut self, owner: &O, start: u64, end: u64) -> Result<(), LockRangeError> {
        check_range(start, end)?;
        self.remove_range(owner, start, end);
        Ok(())
    }

    /// Removes every lock of the owners `which` selects; returns how many records went.
    pub fn remove_owners(&mut self, mut which: impl FnMut(&O) -> bool) -> usize {
        let before = self.records.len();
        self.records.retain(|r| !which(&r.owner));
        before - self.records.len()
    }

    fn remove_range(&mut self, owner: &O, start: u64, end: u64) {
        let mut kept = Vec::with_capacity(self.records.len() + 1);
        for r in self.records.drain(..) {
            if r.owner != *owner || !r.overlaps(start, end) {
                kept.push(r);
                continue;
            }
            if r.start < start {
                kept.push(LockRecord {
                    end: start - 1,
                    ..r.clone()
                });
            }
            if r.end > end {
                kept.push(LockRecord {
                    start: end + 1,
                    ..r.clone()
                });
            }
        }
        self.records = kept;
    }

    /// Checks the invariants in the type's doc; for tests and debug builds.
    pub fn check_invariants(&self) -> Result<(), String> {
        for (i, a) in self.records.iter().enumerate() {
            if a.start > a.end {
                return Err(format!("record {i} is inverted"));
            }
            for b in &self.records[i + 1..] {
                if a.owner == b.owner {
                    let touch =
                        a.start <= b.end.saturating_add(1) && b.start <= a.end.saturating_add(1);
                    if a.overlaps(b.start, b.end) || (touch && a.kind == b.kind) {
                        return Err(format!(
                            "one owner's records [{}, {}] and [{}, {}] overlap or are unmerged",
                            a.start, a.end, b.start, b.end
                        ));
                    }
                } else if a.overlaps(b.start, b.end)
                    && (a.kind == LockKind::Write || b.kind == LockKind::Write)
                {
                    return Err(format!(
                        "conflicting records [{}, {}] and [{}, {}] of two owners",
                        a.start, a.end, b.start, b.end
                    ));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    use LockKind::{Read, Write};

    fn held(l: &FileLocks<u8>) -> Vec<(u8, LockKind, u64, u64)> {
        let mut v: Vec<_> = l
            .iter()
            .map(|r| (r.owner, r.kind, r.start, r.end))
            .collect();
        v.sort_by_key(|r| (r.0, r.2));
        v
    }

    #[test]
    fn posix_rules() {
        let mut l = FileLocks::new();
        assert_eq!(l.try_lock(1, Read, 0, 99, 10).unwrap(), Ok(()));
        // Another reader shares; a writer conflicts with the first reader.
        assert_eq!(l.try_lock(2, Read, 50, 149, 20).unwrap(), Ok(()));
        let c = l.try_lock(3, Write, 120, 200, 30).unwrap().unwrap_err();
        assert_eq!((c.owner, c.pid), (2, 20));
        assert_eq!(l.conflict(&3, Write, 0, 10).map(|r| r.owner), Some(1));
        // Owner 1 upgrades part of its own lock: blocked by owner 2's read lock over 50..=99.
        assert!(l.try_lock(1, Write, 60, 70, 10).unwrap().is_err());
        assert_eq!(l.try_lock(1, Write, 10, 20, 10).unwrap(), Ok(()));
        assert_eq!(
            held(&l),
            vec![
                (1, Read, 0, 9),
                (1, Write, 10, 20),
                (1, Read, 21, 99),
                (2, Read, 50, 149)
            ]
        );
        // Unlocking a middle range splits; adjacent same-kind locks merge back.
        l.unlock(&1, 10, 20).unwrap();
        assert_eq!(l.try_lock(1, Read, 10, 20, 10).unwrap(), Ok(()));
        assert_eq!(held(&l), vec![(1, Read, 0, 99), (2, Read, 50, 149)]);
        // Whole-file locks to the end of any file.
        assert_eq!(l.remove_owners(|o| *o == 1), 1);
        l.unlock(&2, 0, u64::MAX).unwrap();
        assert!(l.is_empty());
        assert_eq!(l.try_lock(4, Write, 0, u64::MAX, 1).unwrap(), Ok(()));
        assert!(l.try_lock(5, Read, u64::MAX, u64::MAX, 1).unwrap().is_err());
        assert!(
            l.try_lock(5, Read, 9, 8, 1).is_err(),
            "inverted range refused"
        );
        l.check_invariants().unwrap();
    }

    /// Byte-by-byte model over 64 bytes: for each owner, what it holds at each byte.
    type Model = Vec<[Option<LockKind>; 64]>;

    fn model_conflict(m: &Model, owner: usize, kind: LockKind, s: u64, e: u64) -> bool {
        (0..m.len()).filter(|&o| o != owner).any(|o| {
            (s..=e).any(|b| match m[o][b as usize] {
                Some(Write) => true,
                Some(Read) => kind == Write,
                None => false,
            })
        })
    }

    #[derive(Debug, Clone)]
    enum Op {
        Lock(usize, LockKind, u64, u64),
        Unlock(usize, u64, u64),
        Drop(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        let range = (0u64..64, 0u64..16).prop_map(|(s, l)| (s, (s + l).min(63)));
        let kind = prop_oneof![Just(Read), Just(Write)];
        prop_oneof![
            4 => (0usize..3, kind, range.clone()).prop_map(|(o, k, (s, e))| Op::Lock(o, k, s, e)),
            2 => (0usize..3, range).prop_map(|(o, (s, e))| Op::Unlock(o, s, e)),
            1 => (0usize..3).prop_map(Op::Drop),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn file_locks_match_a_byte_model(ops in prop::collection::vec(op(), 1..80)) {
            let mut l: FileLocks<usize> = FileLocks::new();
            let mut m: Model = vec![[None; 64]; 3];
            for op in ops {
                match op {
                    Op::Lock(o, k, s, e) => {
                        let conflict = model_conflict(&m, o, k, s, e);
                        prop_assert_eq!(l.conflict(&o, k, s, e).is_some(), conflict);
                        let r = l.try_lock(o, k, s, e, 0).unwrap();
                        prop_assert_eq!(r.is_err(), conflict);
                        if !conflict {
                            for b in s..=e {
                                m[o][b as usize] = Some(k);
                            }
                        }
                    }
                    Op::Unlock(o, s, e) => {
                        l.unlock(&o, s, e).unwrap();
                        for b in s..=e {
                            m[o][b as usize] = None;
                        }
                    }
                    Op::Drop(o) => {
                        l.remove_owners(|x| *x == o);
                        m[o] = [None; 64];
                    }
                }
                prop_assert_eq!(l.check_invariants(), Ok(()));
                // The table holds exactly the model's bytes.
                let mut got: Model = vec![[None; 64]; 3];
                for r in l.iter() {
                    for b in r.start..=r.end {
                        got[r.owner][b as usize] = Some(r.kind);
                    }
                }
                prop_assert_eq!(&got, &m);
            }
        }
    }
}
