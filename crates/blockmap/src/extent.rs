//! A file's extent map, with the semantics of XFS's bmbt.
//!
//! An [`Extent`] maps a run of file blocks to a run of volume blocks (both in units of the
//! volume's block size) and is either `Written` (the blocks hold file data) or `Unwritten`
//! (allocated but never written: the blocks read as zeros, whatever they hold on the LUN).
//! A file block with no extent is a hole, which also reads as zeros.
//!
//! [`ExtentMap`] keeps the records of one file in a `BTreeMap` keyed by file block, so that
//! lookups stay logarithmic for files with millions of extents. Its records are always in
//! canonical form: sorted, non-overlapping, non-empty, free of arithmetic overflow, and merged
//! wherever two neighbours are contiguous in both file and volume space and share a state.
//! Every mutation re-checks this in debug builds. The map knows nothing of free space: the
//! caller frees the volume blocks of the pieces that [`ExtentMap::insert`],
//! [`ExtentMap::punch`] and [`ExtentMap::truncate`] hand back.

use std::collections::BTreeMap;
use std::fmt;
use std::ops::Bound;

/// Whether an extent's blocks hold file data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ExtentState {
    /// The blocks hold file data.
    Written,
    /// Allocated but not yet written: reads return zeros (XFS's `XFS_EXT_UNWRITTEN`).
    Unwritten,
}

/// A run of `len_blocks` file blocks from `file_block` on, stored at the volume blocks from
/// `vol_block` on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Extent {
    pub file_block: u64,
    pub vol_block: u64,
    pub len_blocks: u64,
    pub state: ExtentState,
}

impl Extent {
    /// One past the last file block, if that does not overflow.
    pub fn checked_file_end(&self) -> Option<u64> {
        self.file_block.checked_add(self.len_blocks)
    }

    /// One past the last volume block, if that does not overflow.
    pub fn checked_vol_end(&self) -> Option<u64> {
        self.vol_block.checked_add(self.len_blocks)
    }

    /// Checks that the extent is non-empty and that neither of its ends overflows.
    pub fn validate(&self) -> Result<(), ExtentError> {
        if self.len_blocks == 0 {
            return Err(ExtentError::Empty {
                file_block: self.file_block,
            });
        }
        if self.checked_file_end().is_none() {
            return Err(ExtentError::FileOverflow {
                file_block: self.file_block,
                len_blocks: self.len_blocks,
            });
        }
        if self.checked_vol_end().is_none() {
            return Err(ExtentError::VolumeOverflow {
                vol_block: self.vol_block,
                len_blocks: self.len_blocks,
            });
        }
        Ok(())
    }

    /// End of a validated extent (records of an [`ExtentMap`] always are).
    fn file_end(&self) -> u64 {
        self.file_block + self.len_blocks
    }

    /// The part of this extent covering file blocks `[lo, hi)`, which must lie inside it.
    fn clip(&self, lo: u64, hi: u64) -> Extent {
        debug_assert!(self.file_block <= lo && lo < hi && hi <= self.file_end());
        Extent {
            file_block: lo,
            vol_block: self.vol_block + (lo - self.file_block),
            len_blocks: hi - lo,
            state: self.state,
        }
    }

    /// Whether `next` continues this extent in file and volume space with the same state.
    fn merges_with(&self, next: &Extent) -> bool {
        self.state == next.state
            && self.file_block.checked_add(self.len_blocks) == Some(next.file_block)
            && self.vol_block.checked_add(self.len_blocks) == Some(next.vol_block)
    }
}

impl fmt::Display for Extent {
    /// `file_block+len@vol_block` followed by `W` or `U`, e.g. `0+4@100W`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match self.state {
            ExtentState::Written => 'W',
            ExtentState::Unwritten => 'U',
        };
        write!(
            f,
            "{}+{}@{}{state}",
            self.file_block, self.len_blocks, self.vol_block
        )
    }
}

/// One piece of a looked-up file range: mapped (written or unwritten) or a hole.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Piece {
    Mapped(Extent),
    Hole { file_block: u64, len_blocks: u64 },
}

impl Piece {
    pub fn file_block(&self) -> u64 {
        match self {
            Piece::Mapped(e) => e.file_block,
            Piece::Hole { file_block, .. } => *file_block,
        }
    }

    pub fn len_blocks(&self) -> u64 {
        match self {
            Piece::Mapped(e) => e.len_blocks,
            Piece::Hole { len_blocks, .. } => *len_blocks,
        }
    }
}

impl fmt::Display for Piece {
    /// An extent as in [`Extent`]'s `Display`, a hole as `file_block+len hole`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Piece::Mapped(e) => e.fmt(f),
            Piece::Hole {
                file_block,
                len_blocks,
            } => write!(f, "{file_block}+{len_blocks} hole"),
        }
    }
}

/// Why an extent or a set of extents was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ExtentError {
    #[error("empty extent at file block {file_block}")]
    Empty { file_block: u64 },
    #[error("extent at file block {file_block} of {len_blocks} blocks ends past 2^64")]
    FileOverflow { file_block: u64, len_blocks: u64 },
    #[error("extent at volume block {vol_block} of {len_blocks} blocks ends past 2^64")]
    VolumeOverflow { vol_block: u64, len_blocks: u64 },
    #[error("extents {first} and {second} overlap in the file")]
    Overlap { first: Extent, second: Extent },
}

/// Above this many records the debug-build check after a mutation looks only at the records
/// around the mutated range, so that debug builds stay usable on very large maps.
const FULL_CHECK_MAX_RECORDS: usize = 4096;

/// The extent map of one file: canonical (sorted, disjoint, merged) extent records.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExtentMap {
    /// Records keyed by their `file_block`.
    records: BTreeMap<u64, Extent>,
    /// Sum of the records' lengths.
    mapped_blocks: u64,
}

impl ExtentMap {
    /// An empty map: the whole file is a hole.
    pub fn new() -> ExtentMap {
        ExtentMap::default()
    }

    /// A map of these extents, in any order. Neighbours that can be merged are merged; empty,
    /// overflowing or overlapping extents are refused.
    pub fn from_extents(mut extents: Vec<Extent>) -> Result<ExtentMap, ExtentError> {
        for e in &extents {
            e.validate()?;
        }
        if !extents.is_sorted_by_key(|e| e.file_block) {
            extents.sort_unstable_by_key(|e| e.file_block);
        }
        let mut merged: Vec<Extent> = Vec::with_capacity(extents.len());
        let mut mapped_blocks = 0u64;
        for e in extents {
            mapped_blocks = mapped_blocks
                .checked_add(e.len_blocks)
                .expect("disjoint extents of u64 blocks sum to at most 2^64 - 1");
            match merged.last_mut() {
                Some(last) if last.file_end() > e.file_block => {
                    return Err(ExtentError::Overlap {
                        first: *last,
                        second: e,
                    });
                }
                Some(last) if last.merges_with(&e) => last.len_blocks += e.len_blocks,
                _ => merged.push(e),
            }
        }
        let map = ExtentMap {
            records: merged.into_iter().map(|e| (e.file_block, e)).collect(),
            mapped_blocks,
        };
        map.debug_check(0, u64::MAX);
        Ok(map)
    }

    /// The records in file order.
    pub fn iter(&self) -> impl DoubleEndedIterator<Item = Extent> + '_ {
        self.records.values().copied()
    }

    /// The records in file order, as a vector.
    pub fn to_vec(&self) -> Vec<Extent> {
        self.iter().collect()
    }

    /// Number of records.
    pub fn len(&self) -> usize {
        self.records.len()
    }

    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    /// Number of file blocks that are mapped (written or unwritten).
    pub fn mapped_blocks(&self) -> u64 {
        self.mapped_blocks
    }

    /// One past the last mapped file block (0 for an empty map).
    pub fn end_block(&self) -> u64 {
        self.records
            .values()
            .next_back()
            .map_or(0, Extent::file_end)
    }

    /// The record containing `file_block`, or else the first record after it.
    fn first_key_from(&self, file_block: u64) -> Option<u64> {
        match self.records.range(..=file_block).next_back() {
            Some((&k, e)) if e.file_end() > file_block => Some(k),
            _ => self.records.range(file_block..).next().map(|(&k, _)| k),
        }
    }

    /// The exact cover of file blocks `[file_block, file_block + len_blocks)` (clipped at
    /// 2^64) by mapped pieces and holes, in file order. Mapped pieces are the map's records
    /// clipped to the range, so two consecutive mapped pieces are never mergeable.
    pub fn lookup(&self, file_block: u64, len_blocks: u64) -> Vec<Piece> {
        let mut pieces = Vec::new();
        self.lookup_with(file_block, len_blocks, |p| pieces.push(p));
        pieces
    }

    /// Like [`ExtentMap::lookup`], but hands each piece to `f` instead of collecting them.
    pub fn lookup_with(&self, file_block: u64, len_blocks: u64, mut f: impl FnMut(Piece)) {
        let end = file_block.saturating_add(len_blocks);
        if end == file_block {
            return;
        }
        let mut pos = file_block;
        if let Some(first) = self.first_key_from(file_block).filter(|&k| k < end) {
            for e in self.records.range(first..end).map(|(_, e)| e) {
                if e.file_block > pos {
                    f(Piece::Hole {
                        file_block: pos,
                        len_blocks: e.file_block - pos,
                    });
                    pos = e.file_block;
                }
                let hi = e.file_end().min(end);
                f(Piece::Mapped(e.clip(pos, hi)));
                pos = hi;
            }
        }
        if pos < end {
            f(Piece::Hole {
                file_block: pos,
                len_blocks: end - pos,
            });
        }
    }

    /// Maps `extent`, replacing whatever was mapped in its file range. Returns the displaced
    /// pieces (clipped to the range, in file order) so that the caller can free their volume
    /// blocks; records at the edges are split, and the new extent is merged with neighbours
    /// that continue it in file and volume space with the same state.
    ///
    /// The map does not track volume space: if the caller re-maps blocks it already mapped
    /// there, the displaced pieces name the same volume blocks as `extent`.
    pub fn insert(&mut self, extent: Extent) -> Result<Vec<Extent>, ExtentError> {
        extent.validate()?;
        let end = extent.file_end();
        let displaced = self.remove_range(extent.file_block, end);
        self.records.insert(extent.file_block, extent);
        self.mapped_blocks += extent.len_blocks;
        self.merge_around(extent.file_block, end);
        self.debug_check(extent.file_block, end);
        Ok(displaced)
    }

    /// Unmaps file blocks `[file_block, file_block + len_blocks)` (clipped at 2^64), leaving a
    /// hole. Returns the removed pieces in file order.
    pub fn punch(&mut self, file_block: u64, len_blocks: u64) -> Vec<Extent> {
        let end = file_block.saturating_add(len_blocks);
        let removed = self.remove_range(file_block, end);
        self.debug_check(file_block, end);
        removed
    }

    /// Unmaps every block from `from_block` on. Returns the removed pieces in file order.
    pub fn truncate(&mut self, from_block: u64) -> Vec<Extent> {
        let removed = self.remove_range(from_block, u64::MAX);
        self.debug_check(from_block, u64::MAX);
        removed
    }

    /// Marks the unwritten blocks inside `[file_block, file_block + len_blocks)` (clipped at
    /// 2^64) as written, splitting records at the range's edges and merging afterwards.
    /// Holes and written blocks are left alone. Returns the number of blocks converted.
    pub fn convert_to_written(&mut self, file_block: u64, len_blocks: u64) -> u64 {
        self.convert(
            file_block,
            len_blocks,
            ExtentState::Unwritten,
            ExtentState::Written,
        )
    }

    /// Marks the written blocks inside `[file_block, file_block + len_blocks)` (clipped at
    /// 2^64) as unwritten: they keep their volume blocks and read as zeros (fallocate's zero
    /// range, as XFS does it). Holes and unwritten blocks are left alone. Returns the number of
    /// blocks converted.
    pub fn convert_to_unwritten(&mut self, file_block: u64, len_blocks: u64) -> u64 {
        self.convert(
            file_block,
            len_blocks,
            ExtentState::Written,
            ExtentState::Unwritten,
        )
    }

    fn convert(
        &mut self,
        file_block: u64,
        len_blocks: u64,
        from: ExtentState,
        to: ExtentState,
    ) -> u64 {
        let end = file_block.saturating_add(len_blocks);
        if end == file_block {
            return 0;
        }
        let targets: Vec<Extent> = match self.first_key_from(file_block).filter(|&k| k < end) {
            Some(first) => self
                .records
                .range(first..end)
                .map(|(_, e)| *e)
                .filter(|e| e.state == from)
                .collect(),
            None => Vec::new(),
        };
        let mut converted = 0;
        for e in targets {
            let lo = e.file_block.max(file_block);
            let hi = e.file_end().min(end);
            self.records.remove(&e.file_block);
            if e.file_block < lo {
                self.records.insert(e.file_block, e.clip(e.file_block, lo));
            }
            let mut middle = e.clip(lo, hi);
            middle.state = to;
            self.records.insert(lo, middle);
            if hi < e.file_end() {
                self.records.insert(hi, e.clip(hi, e.file_end()));
            }
            converted += hi - lo;
        }
        if converted > 0 {
            self.merge_around(file_block, end);
        }
        self.debug_check(file_block, end);
        converted
    }

    /// Removes everything mapped in `[start, end)`, splitting the records that straddle its
    /// edges, and returns the removed pieces in file order.
    fn remove_range(&mut self, start: u64, end: u64) -> Vec<Extent> {
        if start >= end {
            return Vec::new();
        }
        self.split_at(start);
        self.split_at(end);
        let keys: Vec<u64> = self.records.range(start..end).map(|(&k, _)| k).collect();
        let mut removed = Vec::with_capacity(keys.len());
        for k in keys {
            if let Some(e) = self.records.remove(&k) {
                self.mapped_blocks -= e.len_blocks;
                removed.push(e);
            }
        }
        removed
    }

    /// Splits the record that contains `at` without starting there into two records meeting
    /// at `at` (which are then mergeable: the caller removes or changes one of them).
    fn split_at(&mut self, at: u64) {
        let straddler = self
            .records
            .range_mut(..at)
            .next_back()
            .filter(|(_, e)| e.file_end() > at)
            .map(|(_, e)| {
                let whole = *e;
                *e = whole.clip(whole.file_block, at);
                whole.clip(at, whole.file_end())
            });
        if let Some(tail) = straddler {
            self.records.insert(at, tail);
        }
    }

    /// Merges every mergeable pair of neighbours from the last record starting before `lo`
    /// through the first record starting after `hi`.
    fn merge_around(&mut self, lo: u64, hi: u64) {
        let start = self
            .records
            .range(..lo)
            .next_back()
            .or_else(|| self.records.range(lo..).next())
            .map(|(&k, _)| k);
        let Some(mut key) = start else {
            return;
        };
        loop {
            let next = self
                .records
                .range((Bound::Excluded(key), Bound::Unbounded))
                .next()
                .map(|(_, e)| *e);
            let Some(next) = next else {
                return;
            };
            let cur = self
                .records
                .get_mut(&key)
                .expect("key was read from the map just before");
            if cur.merges_with(&next) {
                cur.len_blocks += next.len_blocks;
                self.records.remove(&next.file_block);
            } else if next.file_block > hi {
                return;
            } else {
                key = next.file_block;
            }
        }
    }

    /// Checks the map's invariants: every record is keyed by its file block, non-empty and
    /// free of overflow; records are sorted and disjoint; no two neighbours are mergeable; and
    /// the mapped-block count is right.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut total = 0u64;
        let mut prev: Option<&Extent> = None;
        for (&k, e) in &self.records {
            check_record(k, e, prev)?;
            total = total
                .checked_add(e.len_blocks)
                .ok_or_else(|| "mapped block count overflows".to_string())?;
            prev = Some(e);
        }
        if total != self.mapped_blocks {
            return Err(format!(
                "mapped block count is {} but the records hold {total}",
                self.mapped_blocks
            ));
        }
        Ok(())
    }

    /// The invariants of the records from two before `lo` to two after `hi`.
    fn check_region(&self, lo: u64, hi: u64) -> Result<(), String> {
        let before: Vec<(&u64, &Extent)> = self.records.range(..lo).rev().take(2).collect();
        let inside = self.records.range(lo..hi);
        let after = self.records.range(hi..).take(2);
        let mut prev: Option<&Extent> = None;
        for (&k, e) in before.into_iter().rev().chain(inside).chain(after) {
            check_record(k, e, prev)?;
            prev = Some(e);
        }
        Ok(())
    }

    /// In debug builds, panics if a mutation of `[lo, hi)` broke the invariants.
    fn debug_check(&self, lo: u64, hi: u64) {
        if cfg!(debug_assertions) {
            let checked = if self.records.len() <= FULL_CHECK_MAX_RECORDS {
                self.check_invariants()
            } else {
                self.check_region(lo, hi)
            };
            debug_assert!(checked.is_ok(), "extent map invariant broken: {checked:?}");
        }
    }
}

fn check_record(key: u64, e: &Extent, prev: Option<&Extent>) -> Result<(), String> {
    if key != e.file_block {
        return Err(format!("record {e} is keyed by {key}"));
    }
    e.validate().map_err(|err| err.to_string())?;
    if let Some(p) = prev {
        if p.file_end() > e.file_block {
            return Err(format!("records {p} and {e} overlap or are out of order"));
        }
        if p.merges_with(e) {
            return Err(format!("records {p} and {e} should have been merged"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use ExtentState::{Unwritten, Written};
    use proptest::prelude::*;

    /// Parses a fixture such as `"0+4@100W 6+3@200U"`.
    fn ext(text: &str) -> Extent {
        let (file_block, rest) = text.split_once('+').unwrap();
        let (len_blocks, rest) = rest.split_once('@').unwrap();
        let (vol_block, state) = rest.split_at(rest.len() - 1);
        Extent {
            file_block: file_block.parse().unwrap(),
            vol_block: vol_block.parse().unwrap(),
            len_blocks: len_blocks.parse().unwrap(),
            state: match state {
                "W" => Written,
                "U" => Unwritten,
                other => panic!("bad state {other}"),
            },
        }
    }

    fn exts(text: &str) -> Vec<Extent> {
        text.split_whitespace().map(ext).collect()
    }

    fn map(text: &str) -> ExtentMap {
        ExtentMap::from_extents(exts(text)).unwrap()
    }

    fn show<T: fmt::Display>(items: &[T]) -> String {
        items
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// The whole map from block 0 to its end, holes included.
    fn show_map(m: &ExtentMap) -> String {
        show(&m.lookup(0, m.end_block()))
    }

    #[test]
    fn lookup_covers_the_range_with_clipped_extents_and_holes() {
        let m = map("0+4@100W 6+3@200U 9+1@300W");
        assert_eq!(show_map(&m), "0+4@100W 4+2 hole 6+3@200U 9+1@300W");
        assert_eq!(show(&m.lookup(2, 6)), "2+2@102W 4+2 hole 6+2@200U");
        assert_eq!(show(&m.lookup(7, 10)), "7+2@201U 9+1@300W 10+7 hole");
        assert_eq!(show(&m.lookup(20, 3)), "20+3 hole");
        assert_eq!(show(&m.lookup(5, 0)), "");
        assert_eq!(
            show(&m.lookup(u64::MAX - 2, 10)),
            format!("{}+2 hole", u64::MAX - 2)
        );
        assert_eq!((m.len(), m.mapped_blocks(), m.end_block()), (3, 8, 10));
        assert_eq!(ExtentMap::new().end_block(), 0);
        assert_eq!(show(&ExtentMap::new().lookup(0, 4)), "0+4 hole");
    }

    #[test]
    fn from_extents_sorts_merges_and_validates() {
        let m = map("4+2@104W 0+4@100W 6+1@106U");
        assert_eq!(show(&m.to_vec()), "0+6@100W 6+1@106U");
        assert_eq!(
            ExtentMap::from_extents(exts("0+4@100W 3+2@200W")),
            Err(ExtentError::Overlap {
                first: ext("0+4@100W"),
                second: ext("3+2@200W")
            })
        );
        assert_eq!(
            ExtentMap::from_extents(exts("5+0@1W")),
            Err(ExtentError::Empty { file_block: 5 })
        );
        let over = Extent {
            file_block: u64::MAX - 1,
            vol_block: 0,
            len_blocks: 2,
            state: Written,
        };
        assert!(matches!(
            ExtentMap::from_extents(vec![over]),
            Err(ExtentError::FileOverflow { .. })
        ));
        let vol_over = Extent {
            file_block: 0,
            vol_block: u64::MAX,
            len_blocks: 1,
            state: Written,
        };
        assert!(matches!(
            ExtentMap::from_extents(vec![vol_over]),
            Err(ExtentError::VolumeOverflow { .. })
        ));
        // The largest extents are fine.
        let last = Extent {
            file_block: u64::MAX - 1,
            vol_block: u64::MAX - 1,
            len_blocks: 1,
            state: Written,
        };
        let mut m = ExtentMap::from_extents(vec![last]).unwrap();
        assert_eq!(m.end_block(), u64::MAX);
        assert_eq!(m.truncate(u64::MAX - 1), vec![last]);
    }

    #[test]
    fn insert_replaces_splits_and_merges() {
        let mut m = map("0+10@100W");
        // Into the middle: the record is split around it; the old blocks are handed back.
        assert_eq!(show(&m.insert(ext("3+2@500U")).unwrap()), "3+2@103W");
        assert_eq!(show(&m.to_vec()), "0+3@100W 3+2@500U 5+5@105W");
        // Putting the old blocks back merges all three again.
        assert_eq!(show(&m.insert(ext("3+2@103W")).unwrap()), "3+2@500U");
        assert_eq!(show(&m.to_vec()), "0+10@100W");
        // Across a hole and two records.
        let mut m = map("0+4@100W 6+4@200U 12+2@300W");
        let displaced = m.insert(ext("2+9@900U")).unwrap();
        assert_eq!(show(&displaced), "2+2@102W 6+4@200U");
        assert_eq!(show_map(&m), "0+2@100W 2+9@900U 11+1 hole 12+2@300W");
        // Contiguous in the file but not on the volume: no merge.
        let mut m = map("0+4@100W");
        m.insert(ext("4+4@200W")).unwrap();
        assert_eq!(show(&m.to_vec()), "0+4@100W 4+4@200W");
        // Contiguous on both but of another state: no merge.
        let mut m = map("0+4@100W");
        m.insert(ext("4+4@104U")).unwrap();
        assert_eq!(show(&m.to_vec()), "0+4@100W 4+4@104U");
        // Bridging two records.
        let mut m = map("0+4@100W 8+4@108W");
        assert_eq!(m.insert(ext("4+4@104W")).unwrap(), vec![]);
        assert_eq!(show(&m.to_vec()), "0+12@100W");
        assert_eq!(m.mapped_blocks(), 12);
        assert_eq!(
            m.insert(ext("1+0@5W")),
            Err(ExtentError::Empty { file_block: 1 })
        );
    }

    #[test]
    fn punch_and_truncate_return_what_they_removed() {
        let mut m = map("0+10@100W 12+4@200U");
        assert_eq!(show(&m.punch(2, 3)), "2+3@102W");
        assert_eq!(
            show_map(&m),
            "0+2@100W 2+3 hole 5+5@105W 10+2 hole 12+4@200U"
        );
        assert_eq!(show(&m.punch(8, 5)), "8+2@108W 12+1@200U");
        assert_eq!(show(&m.punch(30, u64::MAX)), "");
        assert_eq!(show(&m.truncate(6)), "6+2@106W 13+3@201U");
        assert_eq!(show_map(&m), "0+2@100W 2+3 hole 5+1@105W");
        assert_eq!(m.mapped_blocks(), 3);
        assert_eq!(show(&m.truncate(0)), "0+2@100W 5+1@105W");
        assert!(m.is_empty());
    }

    #[test]
    fn convert_to_written_splits_and_merges() {
        let mut m = map("0+4@100W 4+8@104U 14+2@300U");
        assert_eq!(m.convert_to_written(6, 2), 2);
        assert_eq!(
            show(&m.to_vec()),
            "0+4@100W 4+2@104U 6+2@106W 8+4@108U 14+2@300U"
        );
        // Converting the rest merges everything that is contiguous on the volume.
        assert_eq!(m.convert_to_written(0, 100), 8);
        assert_eq!(show(&m.to_vec()), "0+12@100W 14+2@300W");
        assert_eq!(m.convert_to_written(0, 100), 0);
        assert_eq!(m.convert_to_written(3, 0), 0);
        // Merging with the left neighbour when the converted range starts at a record.
        let mut m = map("0+4@100W 4+4@104U");
        assert_eq!(m.convert_to_written(4, 2), 2);
        assert_eq!(show(&m.to_vec()), "0+6@100W 6+2@106U");
    }

    #[test]
    fn a_million_extents_stay_fast() {
        // Every other block mapped, so no two records merge.
        let n = 1_000_000u64;
        let extents: Vec<Extent> = (0..n)
            .map(|i| Extent {
                file_block: 2 * i,
                vol_block: 3 * i,
                len_blocks: 1,
                state: if i % 2 == 0 { Written } else { Unwritten },
            })
            .collect();
        let mut m = ExtentMap::from_extents(extents).unwrap();
        assert_eq!(m.len(), n as usize);
        let start = std::time::Instant::now();
        for i in (0..n).step_by(997) {
            let pieces = m.lookup(2 * i, 3);
            assert_eq!(pieces.len(), 3);
            assert_eq!(pieces[0], Piece::Mapped(m.records[&(2 * i)]));
        }
        let elapsed = start.elapsed();
        assert_eq!(
            show(&m.insert(ext("1001+5@9000000W")).unwrap()),
            "1002+1@1503U 1004+1@1506W"
        );
        assert_eq!(m.convert_to_written(0, 10), 2);
        assert_eq!(m.punch(2_000_000 - 6, 4).len(), 2);
        m.check_invariants().unwrap();
        // ~1000 lookups in a debug build; a linear scan would take seconds.
        assert!(elapsed.as_secs() < 2, "lookups took {elapsed:?}");
    }

    // ---- Property test against a brute-force model ----

    const MODEL_BLOCKS: u64 = 256;

    /// One mapping per file block.
    type Model = Vec<Option<(u64, ExtentState)>>;

    /// The canonical records of the model: maximal runs contiguous in file and volume space
    /// with one state, inside `[lo, hi)`.
    fn model_runs(model: &Model, lo: u64, hi: u64) -> Vec<Extent> {
        let mut runs: Vec<Extent> = Vec::new();
        for b in lo..hi {
            let Some((vol, state)) = model[b as usize] else {
                continue;
            };
            let block = Extent {
                file_block: b,
                vol_block: vol,
                len_blocks: 1,
                state,
            };
            match runs.last_mut() {
                Some(last) if last.merges_with(&block) => last.len_blocks += 1,
                _ => runs.push(block),
            }
        }
        runs
    }

    fn model_lookup(model: &Model, lo: u64, hi: u64) -> Vec<Piece> {
        let mut pieces = Vec::new();
        let mut pos = lo;
        for e in model_runs(model, lo, hi) {
            if e.file_block > pos {
                pieces.push(Piece::Hole {
                    file_block: pos,
                    len_blocks: e.file_block - pos,
                });
            }
            pos = e.file_end();
            pieces.push(Piece::Mapped(e));
        }
        if pos < hi {
            pieces.push(Piece::Hole {
                file_block: pos,
                len_blocks: hi - pos,
            });
        }
        pieces
    }

    #[derive(Debug, Clone)]
    enum Op {
        Insert(Extent),
        Punch(u64, u64),
        Truncate(u64),
        Convert(u64, u64),
        Unconvert(u64, u64),
        Lookup(u64, u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        // Ranges stay below MODEL_BLOCKS; volume blocks come from a small space so that
        // neighbours are often contiguous on the volume and merge.
        let range = (0u64..200, 0u64..=56);
        prop_oneof![
            4 => (range.clone(), 0u64..4, any::<bool>()).prop_map(|((f, len), k, w)| {
                Op::Insert(Extent {
                    file_block: f,
                    vol_block: f + 1000 * k,
                    len_blocks: len.max(1),
                    state: if w { Written } else { Unwritten },
                })
            }),
            1 => range.clone().prop_map(|(f, l)| Op::Punch(f, l)),
            1 => (0u64..MODEL_BLOCKS).prop_map(Op::Truncate),
            2 => range.clone().prop_map(|(f, l)| Op::Convert(f, l)),
            1 => range.clone().prop_map(|(f, l)| Op::Unconvert(f, l)),
            2 => range.prop_map(|(f, l)| Op::Lookup(f, l)),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(1024))]

        #[test]
        fn extent_map_matches_a_block_by_block_model(ops in prop::collection::vec(op(), 1..60)) {
            let mut m = ExtentMap::new();
            let mut model: Model = vec![None; MODEL_BLOCKS as usize];
            for op in ops {
                match op {
                    Op::Insert(e) => {
                        let expected = model_runs(&model, e.file_block, e.file_end());
                        for b in e.file_block..e.file_end() {
                            model[b as usize] = Some((e.vol_block + b - e.file_block, e.state));
                        }
                        prop_assert_eq!(m.insert(e).unwrap(), expected);
                    }
                    Op::Punch(f, len) => {
                        let expected = model_runs(&model, f, f + len);
                        for b in f..f + len {
                            model[b as usize] = None;
                        }
                        prop_assert_eq!(m.punch(f, len), expected);
                    }
                    Op::Truncate(f) => {
                        let expected = model_runs(&model, f, MODEL_BLOCKS);
                        for b in f..MODEL_BLOCKS {
                            model[b as usize] = None;
                        }
                        prop_assert_eq!(m.truncate(f), expected);
                    }
                    Op::Convert(f, len) => {
                        let mut expected = 0;
                        for slot in &mut model[f as usize..(f + len) as usize] {
                            if let Some((_, state @ Unwritten)) = slot {
                                *state = Written;
                                expected += 1;
                            }
                        }
                        prop_assert_eq!(m.convert_to_written(f, len), expected);
                    }
                    Op::Unconvert(f, len) => {
                        let mut expected = 0;
                        for slot in &mut model[f as usize..(f + len) as usize] {
                            if let Some((_, state @ Written)) = slot {
                                *state = Unwritten;
                                expected += 1;
                            }
                        }
                        prop_assert_eq!(m.convert_to_unwritten(f, len), expected);
                    }
                    Op::Lookup(f, len) => {
                        prop_assert_eq!(m.lookup(f, len), model_lookup(&model, f, f + len));
                    }
                }
                prop_assert_eq!(m.check_invariants(), Ok(()));
                let runs = model_runs(&model, 0, MODEL_BLOCKS);
                prop_assert_eq!(m.to_vec(), runs.clone());
                prop_assert_eq!(m.mapped_blocks(), runs.iter().map(|e| e.len_blocks).sum::<u64>());
                prop_assert_eq!(m.end_block(), runs.last().map_or(0, Extent::file_end));
                prop_assert_eq!(m.lookup(0, MODEL_BLOCKS), model_lookup(&model, 0, MODEL_BLOCKS));
            }
        }
    }
}
