//! Batched write-behind completions: the parts of one write layout completed behind their
//! writes queue up while a `Complete{keep}` of that layout is in flight, and the next one
//! completes all of them (issue 20). Contiguous or overlapping parts become one range, so a
//! sequential writer pays one completion round trip per batch, not one per write.
//!
//! The queue is plain bookkeeping (no I/O, no clock): each layout has at most one sender,
//! which takes batches with [`Batcher::next`] until the queue is empty. Before it takes a
//! batch the sender waits up to [`LINGER`] for more parts, unless the batch is full or
//! someone waits for the layout or the file; so a part waits at most that, plus an earlier
//! batch of its layout in flight. A batch holds at most [`MAX_BATCH_PARTS`] parts and
//! [`MAX_BATCH_BYTES`] bytes (the rest goes in the next one).

use std::collections::{HashMap, VecDeque};

use sanfs_proto::types::{ByteRange, GrantId};

/// The most parts one batch completes.
pub(crate) const MAX_BATCH_PARTS: usize = 64;

/// The most bytes (the sum of its parts) one batch completes; a single larger part goes alone.
pub(crate) const MAX_BATCH_BYTES: u64 = 64 << 20;

/// How long a layout's sender waits, with no completion of the layout in flight, for more
/// parts to join a batch that is not full, unless someone waits for the layout or the file
/// (a recall, an fsync, a read, a stat, a close: [`super::super::cache::GrantCache::hurry`]).
pub(crate) const LINGER: std::time::Duration = std::time::Duration::from_millis(8);

/// A layout's queue key: the session generation it was granted under and its grant id.
pub(crate) type LayoutKey = (u64, GrantId);

#[derive(Debug, Default)]
struct Queue {
    parts: VecDeque<ByteRange>,
}

/// The completion queues of this agent's write layouts. A layout has a queue only while its
/// sender runs.
#[derive(Debug, Default)]
pub(crate) struct Batcher {
    queues: HashMap<LayoutKey, Queue>,
}

/// What one completion round trip completes: whole parts, in arrival order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Batch {
    pub(crate) parts: Vec<ByteRange>,
}

/// One range of a batch sent in one `Complete{keep}`, and the parts it covers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Run {
    pub(crate) range: ByteRange,
    pub(crate) parts: Vec<ByteRange>,
}

impl Batcher {
    /// Queues a completed part of layout `key`. True: no sender runs for it; the caller
    /// starts one (which then takes this part in its first batch).
    pub(crate) fn push(&mut self, key: LayoutKey, part: ByteRange) -> bool {
        let mut started = false;
        let q = self.queues.entry(key).or_insert_with(|| {
            started = true;
            Queue::default()
        });
        q.parts.push_back(part);
        started
    }

    /// The next batch of `key`'s sender, or `None` when its queue is empty: the sender ends
    /// then, and the next [`Batcher::push`] starts a new one.
    pub(crate) fn next(&mut self, key: LayoutKey) -> Option<Batch> {
        let q = self.queues.get_mut(&key)?;
        let mut parts = Vec::new();
        let mut bytes = 0u64;
        while let Some(p) = q.parts.front() {
            let full = parts.len() >= MAX_BATCH_PARTS
                || (!parts.is_empty() && bytes.saturating_add(p.len()) > MAX_BATCH_BYTES);
            if full {
                break;
            }
            bytes = bytes.saturating_add(p.len());
            parts.extend(q.parts.pop_front());
        }
        if parts.is_empty() {
            self.queues.remove(&key);
            return None;
        }
        Some(Batch { parts })
    }

    /// Whether `key`'s queue holds a full batch (its sender need not wait for more).
    pub(crate) fn full(&self, key: LayoutKey) -> bool {
        self.queues.get(&key).is_some_and(|q| {
            q.parts.len() >= MAX_BATCH_PARTS
                || q.parts.iter().map(ByteRange::len).sum::<u64>() >= MAX_BATCH_BYTES
        })
    }

    /// Parts queued (not yet taken by a sender) for `key`.
    #[cfg(test)]
    pub(crate) fn queued(&self, key: LayoutKey) -> usize {
        self.queues.get(&key).map_or(0, |q| q.parts.len())
    }
}

impl Batch {
    /// The sum of the parts' lengths.
    #[cfg(test)]
    pub(crate) fn bytes(&self) -> u64 {
        self.parts.iter().map(ByteRange::len).sum()
    }

    /// The batch as ranges to complete: parts sorted by offset, touching or overlapping
    /// ones merged into one range. Every part is in exactly one run.
    pub(crate) fn runs(&self) -> Vec<Run> {
        let mut parts = self.parts.clone();
        parts.sort_by_key(|p| (p.offset(), p.len()));
        let mut runs: Vec<Run> = Vec::new();
        for p in parts {
            if let Some(last) = runs.last_mut()
                && p.offset() <= last.range.end()
            {
                let end = last.range.end().max(p.end());
                // Both ends are valid ranges' ends, so the merged range is valid too.
                if let Ok(merged) = ByteRange::new(last.range.offset(), end - last.range.offset()) {
                    last.range = merged;
                    last.parts.push(p);
                    continue;
                }
            }
            runs.push(Run {
                range: p,
                parts: vec![p],
            });
        }
        runs
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(offset: u64, len: u64) -> ByteRange {
        ByteRange::new(offset, len).unwrap()
    }

    const A: LayoutKey = (1, GrantId(7));
    const B: LayoutKey = (1, GrantId(8));

    #[test]
    fn first_part_starts_a_sender_later_ones_queue_behind_it() {
        let mut b = Batcher::default();
        assert!(b.push(A, r(0, 4096)), "nothing in flight: start a sender");
        assert_eq!(b.next(A).unwrap().parts, vec![r(0, 4096)]);
        // The first batch is in flight: later parts queue, no second sender.
        assert!(!b.push(A, r(4096, 4096)));
        assert!(!b.push(A, r(8192, 4096)));
        assert!(b.push(B, r(0, 4096)), "another layout has its own sender");
        assert_eq!(b.queued(A), 2);
        let batch = b.next(A).unwrap();
        assert_eq!(batch.parts, vec![r(4096, 4096), r(8192, 4096)]);
        assert_eq!(batch.bytes(), 8192);
        assert_eq!(batch.runs().len(), 1, "contiguous parts: one range");
        assert_eq!(batch.runs()[0].range, r(4096, 8192));
        // Empty: the sender ends, and the next part starts a new one.
        assert_eq!(b.next(A), None);
        assert_eq!(b.next(A), None);
        assert!(b.push(A, r(12288, 4096)));
        assert_eq!(b.queued(B), 1);
    }

    #[test]
    fn a_queue_is_full_at_the_part_or_byte_bound() {
        let mut b = Batcher::default();
        assert!(!b.full(A), "no queue");
        for i in 0..MAX_BATCH_PARTS as u64 - 1 {
            b.push(A, r(i * 4096, 4096));
        }
        assert!(!b.full(A));
        b.push(A, r(1 << 30, 4096));
        assert!(b.full(A), "{MAX_BATCH_PARTS} parts");
        b.push(B, r(0, MAX_BATCH_BYTES - 1));
        assert!(!b.full(B));
        b.push(B, r(MAX_BATCH_BYTES, 1));
        assert!(b.full(B), "{MAX_BATCH_BYTES} bytes");
    }

    #[test]
    fn runs_merge_contiguous_and_overlapping_parts_and_keep_gaps_apart() {
        let batch = Batch {
            parts: vec![
                r(8192, 4096),
                r(0, 4096),
                r(4096, 4096),
                r(20480, 4096),
                r(22528, 4096), // overlaps the one before
                r(40960, 100),
            ],
        };
        let runs = batch.runs();
        let ranges: Vec<ByteRange> = runs.iter().map(|x| x.range).collect();
        assert_eq!(ranges, vec![r(0, 12288), r(20480, 6144), r(40960, 100)]);
        // Every part is answered by exactly one run, which covers it.
        let mut covered: Vec<ByteRange> = runs
            .iter()
            .flat_map(|run| {
                for p in &run.parts {
                    assert!(run.range.offset() <= p.offset() && p.end() <= run.range.end());
                }
                run.parts.clone()
            })
            .collect();
        covered.sort_by_key(|p| p.offset());
        let mut want = batch.parts.clone();
        want.sort_by_key(|p| p.offset());
        assert_eq!(covered, want);
    }

    #[test]
    fn a_batch_is_bounded_in_parts_and_bytes() {
        let mut b = Batcher::default();
        let n = MAX_BATCH_PARTS as u64 * 2 + 3;
        for i in 0..n {
            b.push(A, r(i * 4096, 4096));
        }
        let mut sizes = Vec::new();
        let mut all = Vec::new();
        while let Some(batch) = b.next(A) {
            sizes.push(batch.parts.len());
            all.extend(batch.parts);
        }
        assert_eq!(sizes, vec![MAX_BATCH_PARTS, MAX_BATCH_PARTS, 3]);
        assert_eq!(all.len() as u64, n, "every part taken once, in order");
        assert!(all.windows(2).all(|w| w[0].end() == w[1].offset()));

        // Bytes: 24 MiB parts, at most 64 MiB a batch; a part larger than the bound goes alone.
        let mib = 1u64 << 20;
        for i in 0..4 {
            b.push(A, r(i * 24 * mib, 24 * mib));
        }
        b.push(A, r(96 * mib, 80 * mib));
        b.push(A, r(176 * mib, mib));
        let mut bytes = Vec::new();
        while let Some(batch) = b.next(A) {
            assert!(batch.parts.len() == 1 || batch.bytes() <= MAX_BATCH_BYTES);
            bytes.push(batch.bytes() / mib);
        }
        assert_eq!(bytes, vec![48, 48, 80, 1]);
    }

    #[test]
    fn random_batches_answer_every_part_exactly_once() {
        // A small deterministic generator (no clock, no dependency): pushes and takes
        // interleaved; every pushed part comes out in exactly one run of one batch.
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut rand = move |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        let mut b = Batcher::default();
        let mut pushed = Vec::new();
        let mut answered = Vec::new();
        let mut sender = false;
        for _ in 0..2000 {
            if rand(3) > 0 {
                let part = r(rand(256) * 4096, (1 + rand(8)) * 4096);
                pushed.push(part);
                if b.push(A, part) {
                    assert!(!sender, "one sender per layout");
                    sender = true;
                }
            } else if sender {
                match b.next(A) {
                    Some(batch) => {
                        assert!(batch.parts.len() <= MAX_BATCH_PARTS);
                        for run in batch.runs() {
                            answered.extend(run.parts);
                        }
                    }
                    None => sender = false,
                }
            }
        }
        while sender {
            match b.next(A) {
                Some(batch) => batch
                    .runs()
                    .into_iter()
                    .for_each(|x| answered.extend(x.parts)),
                None => sender = false,
            }
        }
        let key = |p: &ByteRange| (p.offset(), p.len());
        pushed.sort_by_key(key);
        answered.sort_by_key(key);
        assert_eq!(pushed, answered);
    }
}
