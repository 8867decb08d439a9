//! The free-space allocator: which volume blocks are free, and which ones a file gets next.
//!
//! Free space is kept per allocation group (one group per device region, from
//! [`Volume::allocation_groups`](crate::volume::Volume::allocation_groups), so that files spread
//! over the LUNs) in two indexes, as XFS does with its bnobt and cntbt: a `BTreeMap` from start
//! block to length, and a `BTreeSet` of `(length, start)`. Units are volume blocks.
//!
//! [`Allocator::allocate`] tries, in order: the exact blocks after the file's last one (the
//! hint), for perfect contiguity; one contiguous extent near the hint in the hint's group, or
//! the best fit by length in the next groups (rotating over groups when there is no hint),
//! aligned to the stripe unit for requests of at least one stripe unit; the same without
//! alignment; and finally several extents, largest first, up to the caller's cap. Every
//! contiguous path is logarithmic in the number of free extents.
//!
//! Every mutation returns a [`FreeSpaceDelta`]: the free-extent records that disappeared and
//! appeared, so that the metadata server can mirror the free set in a table keyed by start in
//! the same transaction. A failed call changes nothing. In debug builds every mutation re-checks
//! the invariants ([`Allocator::check_invariants`]). The state encodes with
//! [`Allocator::encode`] (magic `SAL1`, see docs/on-disk-format.md).

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Bound::{Excluded, Unbounded};

use crate::codec::{self, DecodeError, Reader, Writer};

/// Magic of an encoded allocator state.
pub const ALLOC_MAGIC: [u8; 4] = *b"SAL1";
/// Current version of the allocator-state encoding.
pub const ALLOC_VERSION: u16 = 1;

/// How many free extents on each side of the hint a near allocation looks at before it settles
/// for the best fit by length in the hint's group.
const NEAR_STEPS: usize = 8;
/// How many extents of barely sufficient length an aligned best fit tries before it asks for
/// one long enough to hold an aligned run wherever it starts.
const ALIGNED_PROBES: usize = 8;
/// Up to this many free extents the debug self-check checks everything after each mutation;
/// above, only the neighbourhood of what changed.
const FULL_CHECK_MAX_RECORDS: usize = 256;
/// Encoded group or free extent: start, length (u64 each).
const RANGE_RECORD_LEN: usize = 8 + 8;

/// Why an allocator call failed. A failed call changes nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AllocError {
    #[error("zero-length request")]
    Empty,
    #[error("blocks {start}+{len_blocks} overflow u64")]
    Overflow { start: u64, len_blocks: u64 },
    #[error("no space: wanted {wanted} blocks, {free} free")]
    NoSpace { wanted: u64, free: u64 },
    #[error(
        "too fragmented: wanted {wanted} blocks in at most {max_extents} extents, \
         the largest {max_extents} free extents hold {reachable}"
    )]
    Fragmented {
        wanted: u64,
        max_extents: usize,
        reachable: u64,
    },
    #[error("blocks {start}+{len_blocks} are (partly) free already")]
    DoubleFree { start: u64, len_blocks: u64 },
    #[error("blocks {start}+{len_blocks} are (partly) in use")]
    InUse { start: u64, len_blocks: u64 },
    #[error("blocks {start}+{len_blocks} lie (partly) outside every allocation group")]
    OutOfRange { start: u64, len_blocks: u64 },
    #[error("allocation group {index}: {reason}")]
    InvalidGroups { index: usize, reason: &'static str },
    #[error("free extent {start}+{len_blocks}: {reason}")]
    InvalidFreeExtent {
        start: u64,
        len_blocks: u64,
        reason: &'static str,
    },
}

/// The free-extent records `(start, len_blocks)` one mutation removed and added.
///
/// Applying a delta to the free set of the state before the call (delete every `removed`
/// record, then insert every `added` one) gives exactly the free set after it, as
/// [`Allocator::free_extents`] lists it. Applying the deltas of successive calls in order
/// therefore keeps a mirror (the metadata server's table keyed by start) equal to the
/// allocator. Removals come first because an added record may reuse a removed record's start.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FreeSpaceDelta {
    pub removed: Vec<(u64, u64)>,
    pub added: Vec<(u64, u64)>,
}

impl FreeSpaceDelta {
    pub fn is_empty(&self) -> bool {
        self.removed.is_empty() && self.added.is_empty()
    }
}

/// The extents one [`Allocator::allocate`] handed out, sorted by start, and its delta.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Allocation {
    /// `(vol_block, len_blocks)`, sorted by `vol_block`.
    pub extents: Vec<(u64, u64)>,
    pub delta: FreeSpaceDelta,
}

/// The free space of one allocation group `[start, end)`, indexed by start and by length.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Group {
    start: u64,
    end: u64,
    /// bnobt: start -> length.
    by_start: BTreeMap<u64, u64>,
    /// cntbt: (length, start).
    by_len: BTreeSet<(u64, u64)>,
    free_blocks: u64,
}

/// A free extent `(start, len_blocks)`.
type Record = (u64, u64);

impl Group {
    fn empty(start: u64, end: u64) -> Group {
        Group {
            start,
            end,
            by_start: BTreeMap::new(),
            by_len: BTreeSet::new(),
            free_blocks: 0,
        }
    }

    fn insert(&mut self, (start, len): Record, delta: &mut FreeSpaceDelta) {
        self.by_start.insert(start, len);
        self.by_len.insert((len, start));
        self.free_blocks += len;
        delta.added.push((start, len));
    }

    fn remove(&mut self, (start, len): Record, delta: &mut FreeSpaceDelta) {
        self.by_start.remove(&start);
        self.by_len.remove(&(len, start));
        self.free_blocks -= len;
        delta.removed.push((start, len));
    }

    /// The free extent holding `block`.
    fn containing(&self, block: u64) -> Option<Record> {
        let (&start, &len) = self.by_start.range(..=block).next_back()?;
        (block - start < len).then_some((start, len))
    }

    /// The free extent holding all of `[start, start + len)`.
    fn holding(&self, start: u64, len: u64) -> Option<Record> {
        let rec = self.containing(start)?;
        let end = start.checked_add(len)?;
        (end <= rec.0 + rec.1).then_some(rec)
    }

    /// Whether any block of `[start, start + len)` is free.
    fn overlaps_free(&self, start: u64, len: u64) -> bool {
        if self.containing(start).is_some() {
            return true;
        }
        self.by_start
            .range((Excluded(start), Unbounded))
            .next()
            .is_some_and(|(&next, _)| next - start < len)
    }

    /// `block` rounded up to the stripe unit, counted from the group's start.
    fn align_up(&self, block: u64, su: u64) -> Option<u64> {
        match (block - self.start) % su {
            0 => Some(block),
            off => block.checked_add(su - off),
        }
    }

    /// The lowest start in `rec` of an `su`-aligned run of `len` blocks.
    fn fit_head(&self, (start, rec_len): Record, len: u64, su: u64) -> Option<u64> {
        let at = if su > 1 {
            self.align_up(start, su)?
        } else {
            start
        };
        let end = at.checked_add(len)?;
        (end <= start + rec_len).then_some(at)
    }

    /// The highest start in `rec` of an `su`-aligned run of `len` blocks.
    fn fit_tail(&self, (start, rec_len): Record, len: u64, su: u64) -> Option<u64> {
        if len > rec_len {
            return None;
        }
        let mut at = start + rec_len - len;
        if su > 1 {
            at -= (at - self.start) % su;
        }
        (at >= start).then_some(at)
    }

    /// The shortest free extent holding an `su`-aligned run of `len` blocks, and where.
    fn best_fit(&self, len: u64, su: u64) -> Option<(Record, u64)> {
        if su <= 1 {
            let &(rec_len, start) = self.by_len.range((len, 0)..).next()?;
            return Some(((start, rec_len), start));
        }
        for &(rec_len, start) in self.by_len.range((len, 0)..).take(ALIGNED_PROBES) {
            if let Some(at) = self.fit_head((start, rec_len), len, su) {
                return Some(((start, rec_len), at));
            }
        }
        // Any extent this long holds an aligned run, wherever it starts.
        let need = len.checked_add(su - 1)?;
        let &(rec_len, start) = self.by_len.range((need, 0)..).next()?;
        let at = self.fit_head((start, rec_len), len, su)?;
        Some(((start, rec_len), at))
    }

    /// The `su`-aligned run of `len` free blocks nearest to `hint` among the few free extents
    /// around it, else the best fit in the group.
    fn near(&self, hint: u64, len: u64, su: u64) -> Option<(Record, u64)> {
        let mut best: Option<(u64, Record, u64)> = None;
        // The first extent that fits on each side is the nearest on that side.
        for (&start, &rec_len) in self.by_start.range(hint..).take(NEAR_STEPS) {
            if let Some(at) = self.fit_head((start, rec_len), len, su) {
                best = Some((at.abs_diff(hint), (start, rec_len), at));
                break;
            }
        }
        for (&start, &rec_len) in self.by_start.range(..hint).rev().take(NEAR_STEPS) {
            if let Some(at) = self.fit_tail((start, rec_len), len, su) {
                // An extent holding the hint that could not serve it exactly ends too early,
                // so `at < hint` here.
                let distance = hint.abs_diff(at);
                if best.is_none_or(|(d, _, _)| distance < d) {
                    best = Some((distance, (start, rec_len), at));
                }
                break;
            }
        }
        match best {
            Some((_, rec, at)) => Some((rec, at)),
            None => self.best_fit(len, su),
        }
    }

    /// Takes `[at, at + len)`, which lies inside the free extent `rec`.
    fn carve(&mut self, rec: Record, at: u64, len: u64, delta: &mut FreeSpaceDelta) {
        let (start, rec_len) = rec;
        debug_assert!(start <= at && at + len <= start + rec_len);
        self.remove(rec, delta);
        if at > start {
            self.insert((start, at - start), delta);
        }
        let (end, rec_end) = (at + len, start + rec_len);
        if end < rec_end {
            self.insert((end, rec_end - end), delta);
        }
    }

    /// Returns `[start, start + len)`, which lies inside the group and is entirely in use,
    /// merging it with free neighbours.
    fn release(&mut self, start: u64, len: u64, delta: &mut FreeSpaceDelta) {
        let (mut new_start, mut new_len) = (start, len);
        if let Some((&prev, &prev_len)) = self.by_start.range(..start).next_back()
            && prev + prev_len == start
        {
            self.remove((prev, prev_len), delta);
            new_start = prev;
            new_len += prev_len;
        }
        let end = start + len;
        if let Some(&next_len) = self.by_start.get(&end) {
            self.remove((end, next_len), delta);
            new_len += next_len;
        }
        self.insert((new_start, new_len), delta);
    }

    /// The invariants of the records from two before `lo` to two after `hi`.
    fn check_records(&self, lo: u64, hi: u64, index: usize) -> Result<(), String> {
        let before: Vec<(&u64, &u64)> = self.by_start.range(..lo).rev().take(2).collect();
        let inside = self.by_start.range(lo..hi);
        let after = self.by_start.range(hi..).take(2);
        let mut prev_end: Option<u64> = None;
        for (&start, &len) in before.into_iter().rev().chain(inside).chain(after) {
            let end = start.checked_add(len);
            if len == 0 || start < self.start || end.is_none_or(|end| end > self.end) {
                return Err(format!(
                    "group {index} [{}, {}): bad free extent {start}+{len}",
                    self.start, self.end
                ));
            }
            if prev_end.is_some_and(|p| p >= start) {
                return Err(format!(
                    "group {index}: free extent {start}+{len} overlaps or touches its predecessor"
                ));
            }
            if !self.by_len.contains(&(len, start)) {
                return Err(format!(
                    "group {index}: free extent {start}+{len} is missing from the length index"
                ));
            }
            prev_end = end;
        }
        if self.by_start.len() != self.by_len.len() {
            return Err(format!(
                "group {index}: {} records by start, {} by length",
                self.by_start.len(),
                self.by_len.len()
            ));
        }
        Ok(())
    }
}

/// The free-space allocator of one volume. See the module documentation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Allocator {
    groups: Vec<Group>,
    /// Alignment for requests of at least this many blocks; 0 or 1: none.
    stripe_unit_blocks: u64,
    capacity_blocks: u64,
    free_blocks: u64,
    /// The group where the next allocation without a hint starts looking.
    cursor: usize,
}

impl Allocator {
    /// An allocator over `groups` (`(start_block, len_blocks)`, non-empty, sorted and
    /// disjoint, as [`Volume::allocation_groups`](crate::volume::Volume::allocation_groups)
    /// returns them) with every block free.
    pub fn new(groups: &[(u64, u64)], stripe_unit_blocks: u64) -> Result<Allocator, AllocError> {
        let mut a = Allocator::empty(groups, stripe_unit_blocks)?;
        let mut delta = FreeSpaceDelta::default();
        for g in &mut a.groups {
            g.insert((g.start, g.end - g.start), &mut delta);
        }
        a.free_blocks = a.capacity_blocks;
        a.debug_check(&[]);
        Ok(a)
    }

    /// An allocator over `groups` whose free blocks are `free` (in any order; extents may
    /// touch each other and span adjacent groups, they are merged and split as needed). Fails
    /// if an extent is empty, overflows, lies outside the groups or overlaps another.
    pub fn from_free(
        groups: &[(u64, u64)],
        stripe_unit_blocks: u64,
        free: impl IntoIterator<Item = (u64, u64)>,
    ) -> Result<Allocator, AllocError> {
        let mut free: Vec<(u64, u64)> = free.into_iter().collect();
        free.sort_unstable();
        Allocator::with_free(groups, stripe_unit_blocks, &free, false)
    }

    /// Groups without free space.
    fn empty(groups: &[(u64, u64)], stripe_unit_blocks: u64) -> Result<Allocator, AllocError> {
        let invalid = |index, reason| Err(AllocError::InvalidGroups { index, reason });
        if groups.is_empty() {
            return invalid(0, "no allocation groups");
        }
        if u32::try_from(groups.len()).is_err() {
            return invalid(0, "more than 2^32 allocation groups");
        }
        let mut out: Vec<Group> = Vec::with_capacity(groups.len());
        let mut capacity_blocks = 0u64;
        for (index, &(start, len)) in groups.iter().enumerate() {
            if len == 0 {
                return invalid(index, "empty");
            }
            let Some(end) = start.checked_add(len) else {
                return invalid(index, "end overflows u64");
            };
            if out.last().is_some_and(|prev| prev.end > start) {
                return invalid(index, "not sorted, or overlaps its predecessor");
            }
            // Disjoint ranges of u64 hold at most u64::MAX blocks together.
            capacity_blocks += len;
            out.push(Group::empty(start, end));
        }
        Ok(Allocator {
            groups: out,
            stripe_unit_blocks,
            capacity_blocks,
            free_blocks: 0,
            cursor: 0,
        })
    }

    /// Builds from free extents sorted by start. `canonical` (for decoding) also refuses
    /// extents that span groups or touch their predecessor instead of merging them.
    fn with_free(
        groups: &[(u64, u64)],
        stripe_unit_blocks: u64,
        free: &[(u64, u64)],
        canonical: bool,
    ) -> Result<Allocator, AllocError> {
        let mut a = Allocator::empty(groups, stripe_unit_blocks)?;
        let mut scratch = FreeSpaceDelta::default();
        let mut prev_end: Option<u64> = None;
        for &(start, len) in free {
            let invalid = |reason| {
                Err(AllocError::InvalidFreeExtent {
                    start,
                    len_blocks: len,
                    reason,
                })
            };
            let pieces = match a.pieces(start, len) {
                Ok(pieces) => pieces,
                Err(AllocError::Empty) => return invalid("empty"),
                Err(AllocError::Overflow { .. }) => return invalid("end overflows u64"),
                Err(_) => return invalid("outside every allocation group"),
            };
            if prev_end.is_some_and(|p| p > start) {
                return invalid("overlaps another free extent");
            }
            if canonical && pieces.len() > 1 {
                return invalid("not canonical: spans allocation groups");
            }
            for (g, piece_start, piece_len) in pieces {
                let group = &mut a.groups[g];
                match group.by_start.last_key_value() {
                    Some((&last, &last_len)) if last + last_len == piece_start => {
                        if canonical {
                            return invalid("not canonical: touches its predecessor");
                        }
                        group.remove((last, last_len), &mut scratch);
                        group.insert((last, last_len + piece_len), &mut scratch);
                    }
                    _ => group.insert((piece_start, piece_len), &mut scratch),
                }
            }
            a.free_blocks += len;
            prev_end = Some(start + len);
        }
        a.debug_check(&[]);
        Ok(a)
    }

    /// Total blocks of all groups.
    pub fn capacity_blocks(&self) -> u64 {
        self.capacity_blocks
    }

    pub fn free_blocks(&self) -> u64 {
        self.free_blocks
    }

    pub fn used_blocks(&self) -> u64 {
        self.capacity_blocks - self.free_blocks
    }

    /// Alignment for requests of at least this many blocks; 0 or 1: none.
    pub fn stripe_unit_blocks(&self) -> u64 {
        self.stripe_unit_blocks
    }

    /// The allocation groups, `(start_block, len_blocks)`.
    pub fn groups(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.groups.iter().map(|g| (g.start, g.end - g.start))
    }

    /// The free extents `(start, len_blocks)` sorted by start: maximal within each group
    /// (extents never span groups; neighbours in different groups stay separate records).
    pub fn free_extents(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.groups
            .iter()
            .flat_map(|g| g.by_start.iter().map(|(&start, &len)| (start, len)))
    }

    /// Number of free-extent records.
    pub fn free_extent_count(&self) -> usize {
        self.groups.iter().map(|g| g.by_start.len()).sum()
    }

    /// Whether every block of `[start, start + len_blocks)` is free (false for an empty,
    /// overflowing or out-of-range range).
    pub fn is_free(&self, start: u64, len_blocks: u64) -> bool {
        self.pieces(start, len_blocks).is_ok_and(|pieces| {
            pieces
                .iter()
                .all(|&(g, s, l)| self.groups[g].holding(s, l).is_some())
        })
    }

    /// Allocates `len_blocks` blocks in at most `max_extents` extents.
    ///
    /// `hint` is the volume block after the file's last one. With a hint inside a group: the
    /// exact blocks from the hint if they are free, else the nearest fitting extent around
    /// the hint in its group, else the other groups. Without a hint, the groups are tried
    /// from a cursor that moves on after each allocation, so that files spread over the LUNs.
    /// Requests of at least one stripe unit are aligned to it where possible (except at an
    /// exact hint). One contiguous extent is preferred; failing that, several, largest first.
    ///
    /// Errors: [`AllocError::Empty`] for zero blocks, [`AllocError::NoSpace`] if fewer blocks
    /// are free, [`AllocError::Fragmented`] if `max_extents` extents cannot hold them. A
    /// failed call changes nothing.
    pub fn allocate(
        &mut self,
        len_blocks: u64,
        hint: Option<u64>,
        max_extents: usize,
    ) -> Result<Allocation, AllocError> {
        let len = len_blocks;
        if len == 0 {
            return Err(AllocError::Empty);
        }
        if len > self.free_blocks {
            return Err(AllocError::NoSpace {
                wanted: len,
                free: self.free_blocks,
            });
        }
        if max_extents == 0 {
            return Err(AllocError::Fragmented {
                wanted: len,
                max_extents,
                reachable: 0,
            });
        }
        // The hint's group, or the group of the file's last block if the hint is past its end.
        let hinted = hint.and_then(|h| {
            let g = self
                .group_of(h)
                .or_else(|| h.checked_sub(1).and_then(|last| self.group_of(last)))?;
            Some((g, h))
        });
        if let Some((g, h)) = hinted
            && let Some(rec) = self.groups[g].holding(h, len)
        {
            return Ok(self.take_one(g, rec, h, len, false));
        }
        let n = self.groups.len();
        let first = hinted.map_or(self.cursor, |(g, _)| g);
        let su = self.stripe_unit_blocks;
        let alignments: &[u64] = if su > 1 && len >= su { &[su, 1] } else { &[1] };
        for &align in alignments {
            for i in 0..n {
                let g = (first + i) % n;
                let group = &self.groups[g];
                let found = match hinted {
                    Some((hg, h)) if hg == g => group.near(h, len, align),
                    _ => group.best_fit(len, align),
                };
                if let Some((rec, at)) = found {
                    return Ok(self.take_one(g, rec, at, len, hinted.is_none()));
                }
            }
        }
        self.take_scattered(len, max_extents, hinted.is_none())
    }

    /// Takes `[at, at + len)` from the free extent `rec` of group `g`.
    fn take_one(
        &mut self,
        g: usize,
        rec: Record,
        at: u64,
        len: u64,
        move_cursor: bool,
    ) -> Allocation {
        let mut delta = FreeSpaceDelta::default();
        self.groups[g].carve(rec, at, len, &mut delta);
        self.free_blocks -= len;
        if move_cursor {
            self.cursor = (g + 1) % self.groups.len();
        }
        self.debug_check(&[(g, rec.0, rec.0 + rec.1)]);
        Allocation {
            extents: vec![(at, len)],
            delta,
        }
    }

    /// Takes `len` blocks (no single free extent holds them, but the allocator does) in at
    /// most `max_extents` extents: the largest free extents of all groups, the last one
    /// replaced by the shortest extent that holds the remainder.
    fn take_scattered(
        &mut self,
        len: u64,
        max_extents: usize,
        move_cursor: bool,
    ) -> Result<Allocation, AllocError> {
        let mut heads: Vec<_> = self
            .groups
            .iter()
            .map(|g| g.by_len.iter().rev().peekable())
            .collect();
        let mut chosen: Vec<(usize, Record)> = Vec::new();
        let mut sum = 0u64;
        while sum < len && chosen.len() < max_extents {
            let mut largest: Option<(u64, usize)> = None;
            for (g, head) in heads.iter_mut().enumerate() {
                if let Some(&&(l, _)) = head.peek()
                    && largest.is_none_or(|(best, _)| l > best)
                {
                    largest = Some((l, g));
                }
            }
            let Some((_, g)) = largest else { break };
            let Some(&(l, s)) = heads[g].next() else {
                break;
            };
            chosen.push((g, (s, l)));
            sum += l;
        }
        let Some(mut last) = chosen.pop().filter(|_| sum >= len) else {
            return Err(AllocError::Fragmented {
                wanted: len,
                max_extents,
                reachable: sum,
            });
        };
        let rest = len - (sum - last.1.1);
        let taken: BTreeSet<(usize, u64)> = chosen.iter().map(|&(g, (s, _))| (g, s)).collect();
        for (g, group) in self.groups.iter().enumerate() {
            let shortest = group
                .by_len
                .range((rest, 0)..)
                .find(|&&(_, s)| !taken.contains(&(g, s)));
            if let Some(&(l, s)) = shortest
                && l < last.1.1
            {
                last = (g, (s, l));
            }
        }
        let mut delta = FreeSpaceDelta::default();
        let mut extents = Vec::with_capacity(chosen.len() + 1);
        let mut touched = Vec::with_capacity(chosen.len() + 1);
        for &(g, rec) in &chosen {
            self.groups[g].remove(rec, &mut delta);
            extents.push(rec);
            touched.push((g, rec.0, rec.0 + rec.1));
        }
        let (g, rec) = last;
        self.groups[g].carve(rec, rec.0, rest, &mut delta);
        extents.push((rec.0, rest));
        touched.push((g, rec.0, rec.0 + rec.1));
        extents.sort_unstable();
        self.free_blocks -= len;
        if move_cursor {
            self.cursor = (self.cursor + 1) % self.groups.len();
        }
        self.debug_check(&touched);
        Ok(Allocation { extents, delta })
    }

    /// Reserves exactly `[start, start + len_blocks)` if every block of it is free (recovery,
    /// import). The range may span adjacent groups.
    pub fn allocate_exact(
        &mut self,
        start: u64,
        len_blocks: u64,
    ) -> Result<FreeSpaceDelta, AllocError> {
        let pieces = self.pieces(start, len_blocks)?;
        let mut recs = Vec::with_capacity(pieces.len());
        for &(g, s, l) in &pieces {
            match self.groups[g].holding(s, l) {
                Some(rec) => recs.push(rec),
                None => return Err(AllocError::InUse { start, len_blocks }),
            }
        }
        let mut delta = FreeSpaceDelta::default();
        let mut touched = Vec::with_capacity(pieces.len());
        for (&(g, s, l), rec) in pieces.iter().zip(recs) {
            self.groups[g].carve(rec, s, l, &mut delta);
            touched.push((g, rec.0, rec.0 + rec.1));
        }
        self.free_blocks -= len_blocks;
        self.debug_check(&touched);
        Ok(delta)
    }

    /// Frees `[start, start + len_blocks)`, merging it with free neighbours. Every block must
    /// be in use and inside the groups; the range may span adjacent groups.
    pub fn free(&mut self, start: u64, len_blocks: u64) -> Result<FreeSpaceDelta, AllocError> {
        let pieces = self.pieces(start, len_blocks)?;
        if pieces
            .iter()
            .any(|&(g, s, l)| self.groups[g].overlaps_free(s, l))
        {
            return Err(AllocError::DoubleFree { start, len_blocks });
        }
        let mut delta = FreeSpaceDelta::default();
        let mut touched = Vec::with_capacity(pieces.len());
        for &(g, s, l) in &pieces {
            self.groups[g].release(s, l, &mut delta);
            touched.push((g, s, s + l));
        }
        self.free_blocks += len_blocks;
        self.debug_check(&touched);
        Ok(delta)
    }

    /// The group holding `block`.
    fn group_of(&self, block: u64) -> Option<usize> {
        let g = self.groups.partition_point(|g| g.end <= block);
        (g < self.groups.len() && self.groups[g].start <= block).then_some(g)
    }

    /// `[start, start + len)` cut at group boundaries: `(group, start, len)` pieces.
    fn pieces(&self, start: u64, len: u64) -> Result<Vec<(usize, u64, u64)>, AllocError> {
        if len == 0 {
            return Err(AllocError::Empty);
        }
        let out_of_range = AllocError::OutOfRange {
            start,
            len_blocks: len,
        };
        let end = start.checked_add(len).ok_or(AllocError::Overflow {
            start,
            len_blocks: len,
        })?;
        let mut g = self.group_of(start).ok_or(out_of_range.clone())?;
        let mut pieces = Vec::with_capacity(1);
        let mut at = start;
        loop {
            let group = &self.groups[g];
            let piece_end = end.min(group.end);
            pieces.push((g, at, piece_end - at));
            if piece_end == end {
                return Ok(pieces);
            }
            g += 1;
            if self
                .groups
                .get(g)
                .is_none_or(|next| next.start != piece_end)
            {
                return Err(out_of_range);
            }
            at = piece_end;
        }
    }

    /// Checks every invariant: each group's free extents lie inside it, are non-empty, sorted,
    /// neither overlap nor touch (so are merged), and appear in both indexes; the per-group
    /// and total free counts are right (so free + used = capacity); the cursor names a group.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut free = 0u64;
        for (index, g) in self.groups.iter().enumerate() {
            if index > 0 && self.groups[index - 1].end > g.start {
                return Err(format!("group {index} overlaps its predecessor"));
            }
            g.check_records(0, u64::MAX, index)?;
            let sum = g.by_start.values().try_fold(0u64, |a, &l| a.checked_add(l));
            if sum != Some(g.free_blocks) {
                return Err(format!(
                    "group {index}: free count {} but its records hold {sum:?}",
                    g.free_blocks
                ));
            }
            free += g.free_blocks;
        }
        if free != self.free_blocks || free > self.capacity_blocks {
            return Err(format!(
                "free count {} but the groups hold {free} (capacity {})",
                self.free_blocks, self.capacity_blocks
            ));
        }
        let capacity: u64 = self.groups.iter().map(|g| g.end - g.start).sum();
        if capacity != self.capacity_blocks {
            return Err(format!(
                "capacity {} but the groups hold {capacity}",
                self.capacity_blocks
            ));
        }
        if self.cursor >= self.groups.len() {
            return Err(format!("cursor {} past the groups", self.cursor));
        }
        Ok(())
    }

    /// In debug builds, panics if a mutation touching `(group, lo, hi)` broke the invariants.
    fn debug_check(&self, touched: &[(usize, u64, u64)]) {
        if cfg!(debug_assertions) {
            let checked = if self.free_extent_count() <= FULL_CHECK_MAX_RECORDS {
                self.check_invariants()
            } else {
                let total: u64 = self.groups.iter().map(|g| g.free_blocks).sum();
                touched
                    .iter()
                    .try_for_each(|&(g, lo, hi)| self.groups[g].check_records(lo, hi, g))
                    .and_then(|()| {
                        (total == self.free_blocks)
                            .then_some(())
                            .ok_or_else(|| "free counts disagree".to_string())
                    })
            };
            debug_assert!(checked.is_ok(), "allocator invariant broken: {checked:?}");
        }
    }

    /// Encodes the state in a sealed envelope (magic `SAL1`, version 1):
    ///
    /// ```text
    /// stripe_unit_blocks u64
    /// cursor u32
    /// group count u32, each: start u64, len_blocks u64
    /// free extent count u32, each: start u64, len_blocks u64   (sorted, as free_extents())
    /// ```
    pub fn encode(&self) -> Vec<u8> {
        let records = self.free_extent_count();
        let mut w = Writer::with_capacity(8 + 4 + 8 * 2 + (self.groups.len() + records) * 16);
        let cursor = u32::try_from(self.cursor).expect("the cursor names one of < 2^32 groups");
        let group_count = u32::try_from(self.groups.len()).expect("new refuses 2^32 groups");
        w.u64(self.stripe_unit_blocks).u32(cursor).u32(group_count);
        for (start, len) in self.groups() {
            w.u64(start).u64(len);
        }
        w.u32(u32::try_from(records).expect("fewer than 2^32 free extents"));
        for (start, len) in self.free_extents() {
            w.u64(start).u64(len);
        }
        codec::seal(ALLOC_MAGIC, ALLOC_VERSION, &w.into_vec())
    }

    /// Decodes [`Allocator::encode`] output. Everything is checked: the groups as
    /// [`Allocator::new`] checks them, the free extents sorted, inside one group each, disjoint
    /// and merged, the cursor inside the groups. Never panics.
    pub fn decode(bytes: &[u8]) -> Result<Allocator, DecodeError> {
        let (_version, payload) = codec::open(ALLOC_MAGIC, ALLOC_VERSION, bytes)?;
        let mut r = Reader::new(payload);
        let stripe_unit_blocks = r.u64()?;
        let cursor = r.u32()? as usize;
        let read_ranges = |r: &mut Reader<'_>| -> Result<Vec<(u64, u64)>, DecodeError> {
            let n = r.count(RANGE_RECORD_LEN)?;
            let mut out = Vec::with_capacity(n);
            for _ in 0..n {
                out.push((r.u64()?, r.u64()?));
            }
            Ok(out)
        };
        let groups = read_ranges(&mut r)?;
        let free = read_ranges(&mut r)?;
        r.finish()?;
        if free.windows(2).any(|w| w[0].0 >= w[1].0) {
            return Err(DecodeError::Invalid(
                "free extents not sorted by start".into(),
            ));
        }
        let mut a = Allocator::with_free(&groups, stripe_unit_blocks, &free, true)
            .map_err(|err| DecodeError::Invalid(format!("allocator: {err}")))?;
        if cursor >= a.groups.len() {
            return Err(DecodeError::Invalid(format!(
                "cursor {cursor} past {} groups",
                a.groups.len()
            )));
        }
        a.cursor = cursor;
        Ok(a)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn alloc(a: &mut Allocator, len: u64, hint: Option<u64>, max_extents: usize) -> Vec<Record> {
        a.allocate(len, hint, max_extents).unwrap().extents
    }

    fn free_list(a: &Allocator) -> Vec<Record> {
        a.free_extents().collect()
    }

    /// Applies `delta` to a mirror of the free set keyed by start, checking that every removed
    /// record was there and that no added one was.
    fn apply(mirror: &mut BTreeMap<u64, u64>, delta: &FreeSpaceDelta) {
        for &(start, len) in &delta.removed {
            assert_eq!(mirror.remove(&start), Some(len), "removed {start}+{len}");
        }
        for &(start, len) in &delta.added {
            assert_eq!(mirror.insert(start, len), None, "added {start}+{len}");
        }
    }

    #[test]
    fn exact_hint_beats_alignment_and_alignment_is_group_relative() {
        let mut a = Allocator::new(&[(100, 1000)], 16).unwrap();
        // Below one stripe unit: no alignment, best fit from the group's start.
        assert_eq!(alloc(&mut a, 5, None, 1), [(100, 5)]);
        // Exactly at the hint, though unaligned.
        assert_eq!(alloc(&mut a, 16, Some(105), 1), [(105, 16)]);
        // One stripe unit without a hint: aligned to the group's start (100 + 16k).
        assert_eq!(alloc(&mut a, 16, None, 1), [(132, 16)]);
        // The hint is taken: the nearest aligned run after it ([121, 132) is too short).
        assert_eq!(alloc(&mut a, 16, Some(110), 1), [(148, 16)]);
        assert_eq!(free_list(&a), [(121, 11), (164, 936)]);
        a.check_invariants().unwrap();
    }

    #[test]
    fn alignment_falls_back_to_unaligned_and_near_looks_both_ways() {
        let mut a = Allocator::from_free(&[(0, 20)], 8, [(1, 19)]).unwrap();
        // No aligned run of 16 in [1, 20): take it unaligned.
        assert_eq!(alloc(&mut a, 16, None, 1), [(1, 16)]);
        // Near: free [0,10) and [50,54) and [90,100); hint 60 is used.
        let mut a = Allocator::from_free(&[(0, 100)], 0, [(0, 10), (50, 4), (90, 10)]).unwrap();
        assert_eq!(
            alloc(&mut a, 5, Some(40), 1),
            [(5, 5)],
            "left is nearer (35 vs 50)"
        );
        let mut a = Allocator::from_free(&[(0, 100)], 0, [(0, 10), (50, 4), (90, 10)]).unwrap();
        assert_eq!(alloc(&mut a, 5, Some(80), 1), [(90, 5)], "right is nearer");
        assert_eq!(
            alloc(&mut a, 4, Some(53), 1),
            [(50, 4)],
            "hint inside a short extent"
        );
    }

    #[test]
    fn several_extents_largest_first_last_one_best_fit() {
        let free = [(0, 10), (20, 20), (50, 30), (90, 8)];
        let fresh = || Allocator::from_free(&[(0, 100)], 0, free).unwrap();
        // (len, max_extents, expected extents or error)
        type Case = (u64, usize, Result<&'static [Record], AllocError>);
        let cases: &[Case] = &[
            (30, 1, Ok(&[(50, 30)])),
            (25, 1, Ok(&[(50, 25)])),
            (45, 3, Ok(&[(20, 15), (50, 30)])),
            (36, 3, Ok(&[(50, 30), (90, 6)])),
            (68, 4, Ok(&[(0, 10), (20, 20), (50, 30), (90, 8)])),
            (
                31,
                1,
                Err(AllocError::Fragmented {
                    wanted: 31,
                    max_extents: 1,
                    reachable: 30,
                }),
            ),
            (
                65,
                3,
                Err(AllocError::Fragmented {
                    wanted: 65,
                    max_extents: 3,
                    reachable: 60,
                }),
            ),
            (
                1,
                0,
                Err(AllocError::Fragmented {
                    wanted: 1,
                    max_extents: 0,
                    reachable: 0,
                }),
            ),
            (
                69,
                9,
                Err(AllocError::NoSpace {
                    wanted: 69,
                    free: 68,
                }),
            ),
            (0, 1, Err(AllocError::Empty)),
        ];
        for (len, max, want) in cases {
            let mut a = fresh();
            let before = a.clone();
            let mut mirror: BTreeMap<u64, u64> = free.into_iter().collect();
            let got = a.allocate(*len, None, *max);
            match (&got, want) {
                (Ok(got), Ok(want)) => {
                    assert_eq!(got.extents, *want, "{len} in {max}");
                    apply(&mut mirror, &got.delta);
                    assert_eq!(mirror.into_iter().collect::<Vec<_>>(), free_list(&a));
                    assert_eq!(a.free_blocks(), 68 - len);
                }
                (Err(got), Err(want)) => {
                    assert_eq!(got, want, "{len} in {max}");
                    assert_eq!(a, before, "a failed allocation changed the state");
                }
                _ => panic!("{len} in {max}: got {got:?}, want {want:?}"),
            }
        }
    }

    #[test]
    fn free_coalesces_with_both_neighbours() {
        let mut a = Allocator::new(&[(0, 30)], 0).unwrap();
        let mut mirror: BTreeMap<u64, u64> = free_list(&a).into_iter().collect();
        for _ in 0..3 {
            apply(&mut mirror, &a.allocate(10, None, 1).unwrap().delta);
        }
        assert_eq!(a.free_blocks(), 0);
        let d = a.free(0, 10).unwrap();
        assert_eq!((d.removed, d.added), (vec![], vec![(0, 10)]));
        mirror.insert(0, 10);
        let d = a.free(20, 10).unwrap();
        assert_eq!(
            (d.removed.clone(), d.added.clone()),
            (vec![], vec![(20, 10)])
        );
        apply(&mut mirror, &d);
        let d = a.free(10, 10).unwrap();
        assert_eq!(d.removed, [(0, 10), (20, 10)]);
        assert_eq!(d.added, [(0, 30)]);
        apply(&mut mirror, &d);
        assert_eq!(mirror.into_iter().collect::<Vec<_>>(), [(0, 30)]);
        assert_eq!((a.free_blocks(), a.used_blocks()), (30, 0));
    }

    #[test]
    fn bad_frees_and_exact_reservations_change_nothing() {
        let mut a = Allocator::new(&[(0, 100), (100, 100), (300, 50)], 0).unwrap();
        a.allocate_exact(90, 20).unwrap(); // spans groups 0 and 1
        a.allocate_exact(300, 50).unwrap();
        assert_eq!(free_list(&a), [(0, 90), (110, 90)]);
        let before = a.clone();
        let cases = [
            (
                95,
                20,
                AllocError::DoubleFree {
                    start: 95,
                    len_blocks: 20,
                },
            ),
            (
                85,
                10,
                AllocError::DoubleFree {
                    start: 85,
                    len_blocks: 10,
                },
            ),
            (
                0,
                1,
                AllocError::DoubleFree {
                    start: 0,
                    len_blocks: 1,
                },
            ),
            (
                340,
                20,
                AllocError::OutOfRange {
                    start: 340,
                    len_blocks: 20,
                },
            ),
            (
                199,
                2,
                AllocError::OutOfRange {
                    start: 199,
                    len_blocks: 2,
                },
            ),
            (
                250,
                1,
                AllocError::OutOfRange {
                    start: 250,
                    len_blocks: 1,
                },
            ),
            (5, 0, AllocError::Empty),
            (
                5,
                u64::MAX,
                AllocError::Overflow {
                    start: 5,
                    len_blocks: u64::MAX,
                },
            ),
        ];
        for (start, len, want) in cases {
            assert_eq!(a.free(start, len), Err(want.clone()), "free {start}+{len}");
            assert_eq!(a, before);
        }
        assert_eq!(
            a.allocate_exact(80, 11),
            Err(AllocError::InUse {
                start: 80,
                len_blocks: 11
            })
        );
        assert_eq!(
            a.allocate_exact(150, 100),
            Err(AllocError::OutOfRange {
                start: 150,
                len_blocks: 100
            })
        );
        assert_eq!(a, before);
        assert!(a.is_free(0, 90) && a.is_free(110, 90));
        assert!(!a.is_free(0, 91) && !a.is_free(300, 1) && !a.is_free(0, 0));
        assert!(!a.is_free(250, 1) && !a.is_free(u64::MAX, 2));
        // Freeing across the group boundary gives one record per group.
        let d = a.free(90, 20).unwrap();
        assert_eq!(d.added, [(0, 100), (100, 100)]);
        assert_eq!(a.free_blocks(), 200);
    }

    #[test]
    fn allocations_without_a_hint_rotate_over_groups() {
        let groups = [(0, 100), (100, 100), (200, 100), (300, 100)];
        let mut a = Allocator::new(&groups, 0).unwrap();
        let starts: Vec<u64> = (0..8).map(|_| alloc(&mut a, 10, None, 1)[0].0).collect();
        assert_eq!(starts, [0, 100, 200, 300, 10, 110, 210, 310]);
        // A hint keeps a file in its group and does not move the cursor.
        assert_eq!(alloc(&mut a, 10, Some(20), 1), [(20, 10)]);
        assert_eq!(alloc(&mut a, 10, None, 1), [(30, 10)]);
        // A hint past every group counts as none.
        assert_eq!(alloc(&mut a, 10, Some(9999), 1), [(120, 10)]);
        // A hint just past a group's end (a file ending there) stays near it.
        let mut b = Allocator::from_free(&[(0, 100), (200, 100)], 0, [(0, 50), (250, 50)]).unwrap();
        assert_eq!(alloc(&mut b, 10, Some(100), 1), [(40, 10)]);
        // A full group sends the hinted file to the next one.
        a.allocate_exact(220, 80).unwrap();
        assert_eq!(alloc(&mut a, 10, Some(225), 1), [(320, 10)]);
    }

    #[test]
    fn from_free_validates_and_merges() {
        let groups = [(0, 100), (100, 100), (300, 100)];
        let a = Allocator::from_free(&groups, 4, [(50, 10), (10, 5), (15, 5), (90, 20)]).unwrap();
        assert_eq!(free_list(&a), [(10, 10), (50, 10), (90, 10), (100, 10)]);
        assert_eq!(a.free_blocks(), 40);
        let bad = |start, len_blocks, reason| {
            Err::<Allocator, _>(AllocError::InvalidFreeExtent {
                start,
                len_blocks,
                reason,
            })
        };
        let cases: &[(&[Record], Result<Allocator, AllocError>)] = &[
            (&[(5, 0)], bad(5, 0, "empty")),
            (&[(5, u64::MAX)], bad(5, u64::MAX, "end overflows u64")),
            (&[(250, 10)], bad(250, 10, "outside every allocation group")),
            (&[(190, 20)], bad(190, 20, "outside every allocation group")),
            (
                &[(10, 10), (15, 10)],
                bad(15, 10, "overlaps another free extent"),
            ),
            (
                &[(10, 10), (10, 1)],
                bad(10, 10, "overlaps another free extent"),
            ),
        ];
        for (free, want) in cases {
            assert_eq!(
                &Allocator::from_free(&groups, 4, free.iter().copied()),
                want
            );
        }
        let bad_groups = |index, reason| Err(AllocError::InvalidGroups { index, reason });
        for (groups, want) in [
            (&[][..], bad_groups(0, "no allocation groups")),
            (
                &[(0, 10), (5, 10)][..],
                bad_groups(1, "not sorted, or overlaps its predecessor"),
            ),
            (
                &[(10, 10), (0, 5)][..],
                bad_groups(1, "not sorted, or overlaps its predecessor"),
            ),
            (&[(0, 0)][..], bad_groups(0, "empty")),
            (&[(u64::MAX, 1)][..], bad_groups(0, "end overflows u64")),
        ] {
            assert_eq!(Allocator::new(groups, 0), want);
            assert_eq!(Allocator::from_free(groups, 0, []), want);
        }
        let edge = Allocator::new(&[(u64::MAX - 10, 10)], 0).unwrap();
        assert_eq!(edge.capacity_blocks(), 10);
    }

    fn assert_every_bit_flip_is_detected(sealed: &[u8]) {
        for i in 0..sealed.len() {
            for bit in 0..8 {
                let mut bad = sealed.to_vec();
                bad[i] ^= 1 << bit;
                assert!(Allocator::decode(&bad).is_err(), "flip {bit} of byte {i}");
            }
        }
        for n in 0..sealed.len() {
            assert!(Allocator::decode(&sealed[..n]).is_err(), "cut to {n}");
        }
        let mut longer = sealed.to_vec();
        longer.push(0);
        assert!(Allocator::decode(&longer).is_err());
    }

    #[test]
    fn state_round_trips_and_detects_damage() {
        let mut a = Allocator::new(&[(0, 100), (100, 100), (1000, 64)], 8).unwrap();
        alloc(&mut a, 10, None, 1);
        alloc(&mut a, 30, Some(50), 1);
        a.allocate_exact(1010, 3).unwrap();
        let sealed = a.encode();
        assert_eq!(&sealed[..4], b"SAL1");
        assert_eq!(sealed.len(), 12 + 8 + 4 + 4 + 3 * 16 + 4 + 5 * 16 + 4);
        assert_eq!(Allocator::decode(&sealed), Ok(a.clone()));
        assert_every_bit_flip_is_detected(&sealed);
        // The cursor survives, so the next hint-less allocation goes to the same group.
        let mut b = Allocator::decode(&sealed).unwrap();
        assert_eq!(b.allocate(5, None, 1), a.allocate(5, None, 1));
    }

    #[test]
    fn invalid_states_are_refused_even_with_a_good_checksum() {
        let state = |cursor: u32, groups: &[Record], free: &[Record], count: Option<u32>| {
            let mut w = Writer::new();
            w.u64(0).u32(cursor).u32(groups.len() as u32);
            for &(s, l) in groups {
                w.u64(s).u64(l);
            }
            w.u32(count.unwrap_or(free.len() as u32));
            for &(s, l) in free {
                w.u64(s).u64(l);
            }
            codec::seal(ALLOC_MAGIC, ALLOC_VERSION, &w.into_vec())
        };
        let g = [(0, 100), (100, 100)];
        assert!(Allocator::decode(&state(1, &g, &[(0, 10), (100, 5)], None)).is_ok());
        for (i, bytes) in [
            state(2, &g, &[(0, 10)], None),
            state(0, &g, &[(0, 10), (10, 5)], None),
            state(0, &g, &[(90, 20)], None),
            state(0, &g, &[(20, 10), (0, 5)], None),
            state(0, &g, &[(0, 10), (0, 10)], None),
            state(0, &g, &[(0, 10), (5, 10)], None),
            state(0, &g, &[(0, 0)], None),
            state(0, &g, &[(150, 60)], None),
            state(0, &[(0, 10), (5, 10)], &[], None),
            state(0, &[], &[], None),
        ]
        .iter()
        .enumerate()
        {
            let r = Allocator::decode(bytes);
            assert!(matches!(r, Err(DecodeError::Invalid(_))), "case {i}: {r:?}");
        }
        let r = Allocator::decode(&state(0, &g, &[(0, 10)], Some(u32::MAX)));
        assert!(matches!(r, Err(DecodeError::Truncated { .. })), "{r:?}");
        let r = Allocator::decode(&codec::encode_extents(&[]));
        assert!(matches!(r, Err(DecodeError::BadMagic { .. })));
    }

    // ---- Against a brute-force model ----

    /// Who owns each block of `[base, base + owner.len())`, and which group it is in.
    struct Model {
        base: u64,
        group: Vec<Option<usize>>,
        used: Vec<bool>,
    }

    impl Model {
        fn new(groups: &[Record], base: u64) -> Model {
            let size = groups.iter().map(|&(s, l)| s + l - base).max().unwrap_or(0) as usize;
            let mut group = vec![None; size];
            for (g, &(s, l)) in groups.iter().enumerate() {
                for b in s..s + l {
                    group[(b - base) as usize] = Some(g);
                }
            }
            Model {
                base,
                group,
                used: vec![false; size],
            }
        }

        /// Model indexes of `[start, start + len)` if it lies inside the groups.
        fn blocks(&self, start: u64, len: u64) -> Option<std::ops::Range<usize>> {
            let end = start.checked_add(len)?;
            let lo = usize::try_from(start.checked_sub(self.base)?).ok()?;
            let hi = usize::try_from(end - self.base).ok()?;
            (len > 0 && hi <= self.group.len() && self.group[lo..hi].iter().all(Option::is_some))
                .then_some(lo..hi)
        }

        fn free_blocks(&self) -> u64 {
            self.group
                .iter()
                .zip(&self.used)
                .filter(|(g, u)| g.is_some() && !**u)
                .count() as u64
        }

        /// Maximal free runs within each group, as `free_extents` must list them.
        fn runs(&self) -> Vec<Record> {
            let mut out: Vec<Record> = Vec::new();
            let mut prev: Option<(usize, usize)> = None; // (group, index)
            for (i, g) in self.group.iter().enumerate() {
                let Some(g) = *g else { continue };
                if self.used[i] {
                    continue;
                }
                let b = self.base + i as u64;
                match (prev, out.last_mut()) {
                    (Some((pg, pi)), Some(last)) if pg == g && pi + 1 == i => last.1 += 1,
                    _ => out.push((b, 1)),
                }
                prev = Some((g, i));
            }
            out
        }

        fn set(&mut self, blocks: std::ops::Range<usize>, used: bool) {
            for i in blocks {
                assert_ne!(
                    self.used[i], used,
                    "block {} handed out twice or freed twice",
                    i
                );
                self.used[i] = used;
            }
        }
    }

    #[derive(Debug, Clone)]
    enum Op {
        Alloc {
            len: u64,
            hint: Option<u64>,
            max_extents: usize,
        },
        /// Frees up to `len` used blocks from the `pick`th used block on.
        FreeUsed {
            pick: prop::sample::Index,
            len: u64,
        },
        /// Frees any range (mostly an error).
        FreeAny {
            at: u64,
            len: u64,
        },
        Exact {
            at: u64,
            len: u64,
        },
    }

    fn op() -> impl Strategy<Value = Op> {
        let len = prop_oneof![8 => 1u64..40, 1 => 40u64..200, 1 => Just(0u64), 1 => Just(u64::MAX)];
        prop_oneof![
            5 => (1u64..60, prop::option::of(0u64..700), 1usize..5)
                .prop_map(|(len, hint, max_extents)| Op::Alloc { len, hint, max_extents }),
            4 => (any::<prop::sample::Index>(), 1u64..60)
                .prop_map(|(pick, len)| Op::FreeUsed { pick, len }),
            1 => (0u64..700, len.clone()).prop_map(|(at, len)| Op::FreeAny { at, len }),
            1 => (0u64..700, len).prop_map(|(at, len)| Op::Exact { at, len }),
        ]
    }

    /// `(base, groups)`: up to 4 groups of up to 150 blocks with gaps, from 0, from 1000 or
    /// near the end of u64.
    fn groups() -> impl Strategy<Value = (u64, Vec<Record>)> {
        (
            prop_oneof![Just(0u64), Just(1000), Just(u64::MAX - 700)],
            prop::collection::vec((0u64..3, 1u64..150), 1..5),
        )
            .prop_map(|(base, raw)| {
                let mut at = base;
                let mut groups = Vec::new();
                for (gap, len) in raw {
                    at += gap * 7;
                    groups.push((at, len));
                    at += len;
                }
                (base, groups)
            })
    }

    fn run(base: u64, groups: &[Record], su: u64, ops: &[Op]) -> Result<(), TestCaseError> {
        let mut a = Allocator::new(groups, su).unwrap();
        let mut m = Model::new(groups, base);
        let mut mirror: BTreeMap<u64, u64> = a.free_extents().collect();
        for op in ops {
            let before = a.clone();
            let runs_before = m.runs();
            let delta = match *op {
                Op::Alloc {
                    len,
                    hint,
                    max_extents,
                } => {
                    let hint = hint.map(|h| base + h);
                    let model_free = m.free_blocks();
                    let longest = runs_before.iter().map(|r| r.1).max().unwrap_or(0);
                    match a.allocate(len, hint, max_extents) {
                        Ok(got) => {
                            prop_assert!(got.extents.len() <= max_extents);
                            prop_assert_eq!(got.extents.iter().map(|e| e.1).sum::<u64>(), len);
                            if longest >= len {
                                prop_assert_eq!(got.extents.len(), 1, "not contiguous");
                            }
                            let exact_ok = hint.is_some_and(|h| {
                                runs_before.iter().any(|&(s, l)| {
                                    s <= h && h.checked_add(len).is_some_and(|e| e <= s + l)
                                })
                            });
                            if exact_ok {
                                prop_assert_eq!(&got.extents, &vec![(hint.unwrap(), len)]);
                            }
                            // Alignment: guaranteed whenever some free extent holds an aligned
                            // run wherever it starts, unless the hint was served exactly.
                            let aligned_fits = su > 1
                                && len >= su
                                && runs_before.iter().any(|r| r.1 >= len + su - 1);
                            if aligned_fits && !exact_ok {
                                let at = got.extents[0].0;
                                let group = groups.iter().find(|g| g.0 <= at && at - g.0 < g.1);
                                prop_assert!(
                                    group.is_some_and(|g| (at - g.0) % su == 0),
                                    "{:?} not aligned to {}",
                                    got.extents,
                                    su
                                );
                            }
                            for &(s, l) in &got.extents {
                                let blocks = m.blocks(s, l);
                                prop_assert!(blocks.is_some(), "{}+{} outside the groups", s, l);
                                let blocks = blocks.unwrap();
                                prop_assert!(
                                    !m.used[blocks.clone()].contains(&true),
                                    "{}+{} in use",
                                    s,
                                    l
                                );
                                m.set(blocks, true);
                            }
                            Some(got.delta)
                        }
                        Err(AllocError::NoSpace { wanted, free }) => {
                            prop_assert_eq!((wanted, free), (len, model_free));
                            prop_assert!(len > model_free);
                            None
                        }
                        Err(AllocError::Fragmented { .. }) => {
                            prop_assert!(len <= model_free && longest < len);
                            None
                        }
                        Err(e) => return Err(TestCaseError::fail(format!("{op:?}: {e}"))),
                    }
                }
                Op::FreeUsed { pick, len } => {
                    let used: Vec<usize> = (0..m.used.len()).filter(|&i| m.used[i]).collect();
                    if used.is_empty() {
                        continue;
                    }
                    let lo = used[pick.index(used.len())];
                    let mut hi = lo;
                    while hi < m.used.len() && m.used[hi] && ((hi - lo) as u64) < len {
                        hi += 1;
                    }
                    let d = a.free(base + lo as u64, (hi - lo) as u64);
                    prop_assert!(d.is_ok(), "{:?}: {:?}", op, d);
                    m.set(lo..hi, false);
                    d.ok()
                }
                Op::FreeAny { at, len } | Op::Exact { at, len } => {
                    let freeing = matches!(op, Op::FreeAny { .. });
                    let start = base.saturating_add(at);
                    let blocks = m.blocks(start, len);
                    let expect_ok = blocks
                        .clone()
                        .is_some_and(|b| m.used[b].iter().all(|&u| u == freeing));
                    let got = if freeing {
                        a.free(start, len)
                    } else {
                        a.allocate_exact(start, len)
                    };
                    prop_assert_eq!(got.is_ok(), expect_ok, "{:?}: {:?}", op, got);
                    if let Some(b) = blocks.filter(|_| expect_ok) {
                        m.set(b, !freeing);
                    }
                    got.ok()
                }
            };
            match delta {
                Some(delta) => apply(&mut mirror, &delta),
                None => prop_assert_eq!(&a, &before, "a failed call changed the state"),
            }
            prop_assert_eq!(a.check_invariants(), Ok(()));
            prop_assert_eq!(a.free_blocks(), m.free_blocks());
            prop_assert_eq!(a.used_blocks() + a.free_blocks(), a.capacity_blocks());
            let listed = free_list(&a);
            prop_assert_eq!(&listed, &m.runs());
            prop_assert_eq!(
                &listed,
                &mirror.iter().map(|(&s, &l)| (s, l)).collect::<Vec<_>>()
            );
        }
        prop_assert_eq!(Allocator::decode(&a.encode()), Ok(a.clone()));
        prop_assert_eq!(
            Allocator::from_free(groups, su, a.free_extents())
                .map(|b| b.free_extents().collect::<Vec<_>>()),
            Ok(free_list(&a))
        );
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn matches_a_brute_force_model(
            (base, groups) in groups(),
            su in prop_oneof![Just(0u64), Just(1), 2u64..9, Just(16)],
            ops in prop::collection::vec(op(), 1..80),
        ) {
            run(base, &groups, su, &ops)?;
        }

        /// Random bytes and resealed damage never panic the decoder; what it accepts re-encodes
        /// to the same bytes.
        #[test]
        fn decoder_survives_damage(
            edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..6),
            raw in prop::collection::vec(any::<u8>(), 0..120),
        ) {
            let mut a = Allocator::new(&[(0, 100), (100, 50), (400, 30)], 4).unwrap();
            a.allocate(7, None, 1).unwrap();
            a.allocate_exact(120, 3).unwrap();
            let sealed = a.encode();
            let mut body = sealed[12..sealed.len() - 4].to_vec();
            for (at, value) in edits {
                let i = at.index(body.len());
                body[i] = value;
            }
            for bytes in [codec::seal(ALLOC_MAGIC, 1, &body), codec::seal(ALLOC_MAGIC, 1, &raw), raw] {
                if let Ok(b) = Allocator::decode(&bytes) {
                    prop_assert_eq!(b.check_invariants(), Ok(()));
                    prop_assert_eq!(b.encode(), bytes);
                }
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(8))]

        /// Long sequences, so that fragmentation builds up.
        #[test]
        fn long_sequences_match_the_model(
            (base, groups) in groups(),
            su in prop_oneof![Just(0u64), Just(4), Just(16)],
            ops in prop::collection::vec(op(), 1500..2000),
        ) {
            run(base, &groups, su, &ops)?;
        }
    }

    /// Xorshift64*: a seeded source for the long test without another dependency.
    struct XorShift(u64);

    impl XorShift {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
        }

        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
    }

    /// 100k random allocations and frees on 4 groups; set `SANFS_ALLOC_SEED` to replay a seed.
    #[test]
    fn long_random_alloc_free() {
        let seed = std::env::var("SANFS_ALLOC_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(0x5EED_A110C_u64);
        println!("long_random_alloc_free: SANFS_ALLOC_SEED={seed}");
        let mut rng = XorShift(seed.max(1));
        let groups = [(0, 16384), (16384, 16384), (40000, 16384), (56384, 8192)];
        let mut a = Allocator::new(&groups, 16).unwrap();
        let mut m = Model::new(&groups, 0);
        let mut mirror: BTreeMap<u64, u64> = a.free_extents().collect();
        let mut owned: Vec<Record> = Vec::new();
        let (mut allocs, mut frees, mut failures) = (0, 0, 0);
        for i in 0..100_000u32 {
            // Keep the volume between empty and about 80% full, fragmenting as it goes.
            let full = a.used_blocks() * 5 > a.capacity_blocks() * 4;
            let grow = owned.is_empty() || (!full && rng.below(100) < 60);
            if grow {
                let max_len = if rng.below(4) == 0 { 600 } else { 64 };
                let len = 1 + rng.below(max_len);
                let hint = match rng.below(3) {
                    0 => None,
                    1 => owned.last().map(|&(s, l)| s + l),
                    _ => Some(rng.below(70_000)),
                };
                match a.allocate(len, hint, 1 + rng.below(6) as usize) {
                    Ok(got) => {
                        for &(s, l) in &got.extents {
                            m.set(m.blocks(s, l).expect("inside the groups"), true);
                            owned.push((s, l));
                        }
                        apply(&mut mirror, &got.delta);
                        allocs += 1;
                    }
                    Err(AllocError::NoSpace { .. } | AllocError::Fragmented { .. }) => {
                        failures += 1;
                    }
                    Err(e) => panic!("seed {seed}, op {i}: {e}"),
                }
            } else {
                let (s, l) = owned.swap_remove(rng.below(owned.len() as u64) as usize);
                // Sometimes free only a part and keep the rest.
                let cut = if rng.below(4) == 0 { rng.below(l) } else { 0 };
                let keep_head = rng.below(2) == 0;
                let (free_at, free_len) = match (cut, keep_head) {
                    (0, _) => (s, l),
                    (c, true) => {
                        owned.push((s, c));
                        (s + c, l - c)
                    }
                    (c, false) => {
                        owned.push((s + c, l - c));
                        (s, c)
                    }
                };
                let d = a
                    .free(free_at, free_len)
                    .unwrap_or_else(|e| panic!("seed {seed}, op {i}: {e}"));
                m.set(m.blocks(free_at, free_len).unwrap(), false);
                apply(&mut mirror, &d);
                frees += 1;
            }
            if i % 5000 == 0 {
                assert_eq!(a.check_invariants(), Ok(()), "seed {seed}, op {i}");
                assert_eq!(a.free_blocks(), m.free_blocks(), "seed {seed}, op {i}");
                assert_eq!(free_list(&a), m.runs(), "seed {seed}, op {i}");
                assert!(mirror.iter().map(|(&s, &l)| (s, l)).eq(a.free_extents()));
            }
        }
        println!(
            "{allocs} allocations, {frees} frees, {failures} refused, {} free extents",
            a.free_extent_count()
        );
        assert!(allocs > 25_000 && frees > 25_000);
        assert_eq!(Allocator::decode(&a.encode()), Ok(a));
    }
}
