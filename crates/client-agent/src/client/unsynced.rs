//! Completed-but-unsynced writes: the agent's records of write completions the server
//! acknowledged without making them durable (docs/protocol.md, "Durability of completions").
//!
//! A Complete without `sync` is committed lazily: its reply carries the number of the server's
//! commit that holds it (`commit_seq`) and how far the server's commits are durable
//! (`durable_seq`). Until a reply or a heartbeat acknowledgement of the same server epoch says
//! `durable_seq >= commit_seq`, or the file is fsync'd, the agent keeps a [`WriteRecord`]: the
//! file range and where on the LUNs it wrote it. If the server restarts first, the session
//! task replays the records to the new epoch before the new session goes live
//! (`session::replay`); a record the server refuses marks its file *write lost*, and the
//! file's next fsync or close answers EIO (once), never 0.
//!
//! Pure bookkeeping, no I/O: every transition is a method here and is unit tested below.

use std::collections::{HashMap, HashSet};

use sanfs_blockmap::plan::{DeviceIo, phys_runs};
use sanfs_proto::model::{ReplayOutcome, ReplayRecord, ReplayRun};
use sanfs_proto::pb;
use sanfs_proto::types::{ByteRange, InodeId, SessionEpoch, SessionId};

/// The commit number of a record whose completion got no answer (the session was lost with
/// it in flight): the server may or may not have applied it. A new server epoch replays it
/// like any other record; the same epoch (the session was fenced or evicted, the server lives)
/// means it was refused, and the write is lost ([`Unsynced::unanswered_lost`]).
pub const UNANSWERED: u64 = u64::MAX;

/// One lazily committed write completion.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct WriteRecord {
    pub epoch: SessionEpoch,
    pub commit_seq: u64,
    pub range: ByteRange,
    pub runs: Vec<ReplayRun>,
}

impl WriteRecord {
    /// The record of a completion of `range`, written by the plan `device_ios` whose buffer
    /// offsets count from `range`'s start.
    pub fn new(
        epoch: SessionEpoch,
        commit_seq: u64,
        range: ByteRange,
        device_ios: &[DeviceIo],
    ) -> WriteRecord {
        let runs = phys_runs(device_ios)
            .into_iter()
            .map(|r| ReplayRun {
                file_off: range.offset() + r.buf_off,
                device: r.device,
                phys_off: r.phys_off,
                len: r.len,
            })
            .collect();
        WriteRecord {
            epoch,
            commit_seq,
            range,
            runs,
        }
    }

    /// The wire form of the record for `ino`.
    pub fn to_replay(&self, ino: InodeId) -> ReplayRecord {
        ReplayRecord {
            inode: ino,
            epoch: self.epoch,
            commit_seq: self.commit_seq,
            range: self.range,
            runs: self.runs.clone(),
        }
    }
}

/// A namespace change the server answered before it was durable (docs/protocol.md,
/// "Namespace changes before they are durable"): the request as sent, to send again to a
/// restarted server.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum NsChange {
    Create(pb::CreateRequest),
    Mkdir(pb::MkdirRequest),
    Mknod(pb::MknodRequest),
    Symlink(pb::SymlinkRequest),
    Link(pb::LinkRequest),
    Unlink(pb::UnlinkRequest),
    Rmdir(pb::RmdirRequest),
    Rename(pb::RenameRequest),
    SetAttr(pb::SetAttrRequest),
    SetXattr(pb::SetXattrRequest),
    RemoveXattr(pb::RemoveXattrRequest),
}

/// One namespace change not durable yet.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct NsRecord {
    pub epoch: SessionEpoch,
    /// The session it was made under.
    pub session: SessionId,
    pub commit_seq: u64,
    pub change: NsChange,
    /// For a create: the inode and generation it made (the replay makes the same); for an
    /// unlink or rename answered here: the file it changed.
    pub inode: Option<(InodeId, u64)>,
}

/// A record to replay, in the order the old server committed them.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Replay {
    Write(InodeId, WriteRecord),
    Change(NsRecord),
}

impl Replay {
    fn order(&self) -> (SessionEpoch, u64) {
        match self {
            Replay::Write(_, r) => (r.epoch, r.commit_seq),
            Replay::Change(r) => (r.epoch, r.commit_seq),
        }
    }
}

/// Every file's records, the namespace changes, and the files whose writes were lost.
#[derive(Debug, Default)]
pub(crate) struct Unsynced {
    by_inode: HashMap<InodeId, Vec<WriteRecord>>,
    lost: HashSet<InodeId>,
    /// In the order they were answered.
    changes: Vec<NsRecord>,
}

impl Unsynced {
    /// Keeps `record` of `ino` until it is durable.
    pub fn record(&mut self, ino: InodeId, record: WriteRecord) {
        self.by_inode.entry(ino).or_default().push(record);
    }

    /// Keeps the namespace change `record` until it is durable.
    pub fn record_change(&mut self, record: NsRecord) {
        self.changes.push(record);
    }

    /// The newest commit number of the namespace changes of `epoch` (what a sync sent now
    /// covers).
    pub fn newest_change(&self, epoch: SessionEpoch) -> Option<u64> {
        self.changes
            .iter()
            .filter(|r| r.epoch == epoch && r.commit_seq != UNANSWERED)
            .map(|r| r.commit_seq)
            .max()
    }

    /// A sync of `epoch` (an fsync, a directory's fsync) succeeded after the namespace
    /// changes up to `upto` were answered: they are durable.
    pub fn changes_synced(&mut self, epoch: SessionEpoch, upto: u64) {
        self.changes
            .retain(|r| r.epoch != epoch || r.commit_seq > upto);
    }

    /// The server of `epoch` says its commits up to `durable_seq` are durable.
    pub fn durable(&mut self, epoch: SessionEpoch, durable_seq: u64) {
        if durable_seq == 0 {
            return;
        }
        self.changes_synced(epoch, durable_seq);
        self.by_inode.retain(|_, records| {
            records.retain(|r| r.epoch != epoch || r.commit_seq > durable_seq);
            !records.is_empty()
        });
    }

    /// The newest commit number of `ino`'s records in `epoch` (what an fsync sent now covers).
    pub fn newest(&self, ino: InodeId, epoch: SessionEpoch) -> Option<u64> {
        self.by_inode
            .get(&ino)?
            .iter()
            .filter(|r| r.epoch == epoch && r.commit_seq != UNANSWERED)
            .map(|r| r.commit_seq)
            .max()
    }

    /// An fsync of `ino` in `epoch` succeeded after its records up to `upto` were made:
    /// they are durable (every commit before the fsync's is).
    pub fn synced(&mut self, ino: InodeId, epoch: SessionEpoch, upto: u64) {
        if let Some(records) = self.by_inode.get_mut(&ino) {
            records.retain(|r| r.epoch != epoch || r.commit_seq > upto);
            if records.is_empty() {
                self.by_inode.remove(&ino);
            }
        }
    }

    /// A new session of the same server epoch: the completions that got no answer were
    /// refused with the old session (fenced or evicted), so their writes are lost.
    pub fn unanswered_lost(&mut self) {
        let lost = &mut self.lost;
        self.by_inode.retain(|ino, records| {
            let before = records.len();
            records.retain(|r| r.commit_seq != UNANSWERED);
            if records.len() != before {
                lost.insert(*ino);
            }
            !records.is_empty()
        });
    }

    /// Whether `ino` has records not durable yet.
    pub fn has(&self, ino: InodeId) -> bool {
        self.by_inode.contains_key(&ino)
    }

    /// Whether `ino` has records, or a lost write to report.
    pub fn pending(&self, ino: InodeId) -> bool {
        self.has(ino) || self.lost.contains(&ino)
    }

    /// Every record of an epoch other than `epoch`: what a new server epoch must replay.
    pub fn to_replay(&self, epoch: SessionEpoch) -> Vec<(InodeId, WriteRecord)> {
        let mut all: Vec<(InodeId, WriteRecord)> = self
            .by_inode
            .iter()
            .flat_map(|(ino, records)| {
                records
                    .iter()
                    .filter(|r| r.epoch != epoch)
                    .map(|r| (*ino, r.clone()))
            })
            .collect();
        // In commit order, file by file: the order the old server applied them.
        all.sort_by_key(|(ino, r)| (r.epoch, r.commit_seq, *ino));
        all
    }

    /// Every record, write completions and namespace changes, of an epoch other than
    /// `epoch`, in the order the old server committed them.
    pub fn to_replay_all(&self, epoch: SessionEpoch) -> Vec<Replay> {
        let mut all: Vec<Replay> = self
            .to_replay(epoch)
            .into_iter()
            .map(|(ino, r)| Replay::Write(ino, r))
            .chain(
                self.changes
                    .iter()
                    .filter(|r| r.epoch != epoch)
                    .cloned()
                    .map(Replay::Change),
            )
            .collect();
        // Stable: records of one commit keep their order (writes file by file, then changes
        // as they were answered).
        all.sort_by_key(Replay::order);
        all
    }

    /// The server answered the replay of the namespace change `record` (or refused it: the
    /// change is lost, which the caller logs): it is forgotten.
    pub fn change_replayed(&mut self, record: &NsRecord) {
        if let Some(i) = self.changes.iter().position(|r| r == record) {
            self.changes.remove(i);
        }
    }

    /// The server answered the create of `ino` that this agent answered first (its record
    /// was kept as [`UNANSWERED`]): the record takes the commit that holds it, or goes
    /// when that is durable already (`None`: it goes, refused or lost).
    pub fn create_answered(&mut self, epoch: SessionEpoch, ino: InodeId, seq: Option<u64>) {
        let i = self.changes.iter().position(|r| {
            r.epoch == epoch
                && r.commit_seq == UNANSWERED
                && matches!(r.change, NsChange::Create(_))
                && r.inode.is_some_and(|(i, _)| i == ino)
        });
        self.settle_unanswered(i, seq);
    }

    /// [`Unsynced::create_answered`] of another change this agent answered first: the
    /// oldest unanswered record of `change`.
    pub fn change_answered(&mut self, epoch: SessionEpoch, change: &NsChange, seq: Option<u64>) {
        let i = self
            .changes
            .iter()
            .position(|r| r.epoch == epoch && r.commit_seq == UNANSWERED && r.change == *change);
        self.settle_unanswered(i, seq);
    }

    fn settle_unanswered(&mut self, i: Option<usize>, seq: Option<u64>) {
        let Some(i) = i else {
            return;
        };
        match seq {
            Some(seq) => self.changes[i].commit_seq = seq,
            None => {
                self.changes.remove(i);
            }
        }
    }

    /// Namespace changes kept.
    pub fn change_count(&self) -> u64 {
        self.changes.len() as u64
    }

    /// The server answered the replay of `record`: it is forgotten, and if it was refused
    /// the file's write is lost.
    pub fn replayed(&mut self, ino: InodeId, record: &WriteRecord, outcome: ReplayOutcome) {
        if let Some(records) = self.by_inode.get_mut(&ino) {
            if let Some(i) = records.iter().position(|r| r == record) {
                records.remove(i);
            }
            if records.is_empty() {
                self.by_inode.remove(&ino);
            }
        }
        if outcome == ReplayOutcome::Refused {
            self.lost.insert(ino);
        }
    }

    /// Whether `ino` lost a write that was not reported yet; reporting it clears it.
    pub fn take_lost(&mut self, ino: InodeId) -> bool {
        self.lost.remove(&ino)
    }

    /// Records kept, files with a lost write not reported yet.
    pub fn counts(&self) -> (u64, u64) {
        let records = self.by_inode.values().map(|r| r.len() as u64).sum();
        (records, self.lost.len() as u64)
    }
}

#[cfg(test)]
mod tests {
    use sanfs_blockmap::plan::BufRange;
    use sanfs_blockmap::volume::DeviceIndex;

    use super::*;

    const KIB: u64 = 1024;

    fn rec(epoch: u64, seq: u64, offset: u64) -> WriteRecord {
        let io = DeviceIo {
            device: DeviceIndex(0),
            phys_off: 1 << 20,
            len: 64 * KIB,
            iov: vec![BufRange {
                buf_off: 0,
                len: 64 * KIB,
            }],
        };
        WriteRecord::new(
            SessionEpoch(epoch),
            seq,
            ByteRange::new(offset, 64 * KIB).unwrap(),
            &[io],
        )
    }

    #[test]
    fn a_record_names_the_file_bytes_and_where_they_were_written() {
        let r = rec(1, 5, 128 * KIB);
        assert_eq!(
            r.runs,
            vec![ReplayRun {
                file_off: 128 * KIB,
                device: DeviceIndex(0),
                phys_off: 1 << 20,
                len: 64 * KIB
            }]
        );
        let wire = r.to_replay(InodeId(9));
        assert_eq!((wire.inode, wire.commit_seq), (InodeId(9), 5));
    }

    #[test]
    fn durable_seq_drops_records_of_its_epoch_only() {
        let mut u = Unsynced::default();
        let (a, b) = (InodeId(2), InodeId(3));
        u.record(a, rec(1, 5, 0));
        u.record(a, rec(1, 8, 64 * KIB));
        u.record(b, rec(1, 6, 0));
        u.record(b, rec(2, 3, 64 * KIB));
        u.durable(SessionEpoch(1), 0);
        assert_eq!(u.counts(), (4, 0), "0 reports nothing");
        u.durable(SessionEpoch(1), 6);
        assert_eq!(u.counts(), (2, 0));
        assert_eq!(u.newest(a, SessionEpoch(1)), Some(8));
        assert_eq!(u.newest(b, SessionEpoch(1)), None);
        assert_eq!(u.newest(b, SessionEpoch(2)), Some(3));
        u.durable(SessionEpoch(2), 100);
        assert!(!u.has(b), "epoch 2's durable seq dropped its record");
        assert!(u.has(a), "and left epoch 1's");
        u.durable(SessionEpoch(1), 8);
        assert!(!u.has(a) && u.counts() == (0, 0));
    }

    #[test]
    fn fsync_drops_the_records_it_covered_and_keeps_later_ones() {
        let mut u = Unsynced::default();
        let a = InodeId(2);
        u.record(a, rec(1, 5, 0));
        let upto = u.newest(a, SessionEpoch(1)).unwrap();
        // A completion answered while the fsync was on its way: not covered.
        u.record(a, rec(1, 9, 64 * KIB));
        u.record(InodeId(3), rec(1, 4, 0));
        u.synced(a, SessionEpoch(1), upto);
        assert_eq!(u.newest(a, SessionEpoch(1)), Some(9));
        assert!(u.has(InodeId(3)), "another file's record stays");
        u.synced(a, SessionEpoch(1), 9);
        assert!(!u.has(a) && !u.pending(a));
    }

    #[test]
    fn replay_takes_old_epochs_in_commit_order_and_a_refusal_is_reported_once() {
        let mut u = Unsynced::default();
        let (a, b) = (InodeId(2), InodeId(3));
        u.record(b, rec(1, 7, 0));
        u.record(a, rec(1, 5, 0));
        u.record(a, rec(2, 1, 64 * KIB));
        let todo = u.to_replay(SessionEpoch(2));
        let order: Vec<(u64, u64)> = todo.iter().map(|(i, r)| (i.0, r.commit_seq)).collect();
        assert_eq!(order, vec![(2, 5), (3, 7)]);
        u.replayed(todo[0].0, &todo[0].1, ReplayOutcome::Replayed);
        u.replayed(todo[1].0, &todo[1].1, ReplayOutcome::Refused);
        assert_eq!(u.counts(), (1, 1));
        assert!(u.pending(b) && !u.has(b));
        assert!(u.take_lost(b), "the lost write is reported");
        assert!(!u.take_lost(b), "once");
        assert!(!u.pending(b));
        assert!(u.has(a), "the record of the current epoch stays");
    }

    fn change(epoch: u64, seq: u64) -> NsRecord {
        NsRecord {
            epoch: SessionEpoch(epoch),
            session: SessionId(10 + epoch),
            commit_seq: seq,
            change: NsChange::Mkdir(pb::MkdirRequest {
                name: format!("d{seq}").into_bytes(),
                ..Default::default()
            }),
            inode: Some((InodeId(100 + seq), 1)),
        }
    }

    #[test]
    fn namespace_changes_go_when_durable_and_replay_interleaved_with_writes() {
        let mut u = Unsynced::default();
        let a = InodeId(2);
        u.record_change(change(1, 3));
        u.record(a, rec(1, 4, 0));
        u.record_change(change(1, 5));
        u.record_change(change(1, 6));
        u.record_change(change(2, 1));
        assert_eq!(u.newest_change(SessionEpoch(1)), Some(6));
        let order: Vec<(u64, bool)> = u
            .to_replay_all(SessionEpoch(2))
            .iter()
            .map(|r| match r {
                Replay::Write(_, w) => (w.commit_seq, true),
                Replay::Change(c) => (c.commit_seq, false),
            })
            .collect();
        assert_eq!(order, vec![(3, false), (4, true), (5, false), (6, false)]);
        u.durable(SessionEpoch(1), 5);
        assert_eq!(u.change_count(), 2, "3 and 5 are durable");
        u.changes_synced(SessionEpoch(1), 6);
        assert_eq!(u.change_count(), 1, "epoch 2's change stays");
        let last = change(2, 1);
        u.change_replayed(&last);
        assert_eq!(u.change_count(), 0);
    }

    #[test]
    fn an_unanswered_completion_is_replayed_to_a_new_epoch_and_lost_in_the_same_one() {
        let ino = InodeId(7);
        let epoch = SessionEpoch(3);
        let range = ByteRange::new(0, 4096).unwrap();
        let mut u = Unsynced::default();
        u.record(ino, WriteRecord::new(epoch, UNANSWERED, range, &[]));
        // Neither durable_seq nor an fsync of the same epoch covers it.
        u.durable(epoch, 1_000);
        assert_eq!(u.newest(ino, epoch), None);
        u.synced(ino, epoch, 1_000);
        assert!(u.has(ino));
        // A new epoch replays it.
        assert_eq!(u.to_replay(SessionEpoch(4)).len(), 1);
        // The same epoch: lost, reported once.
        u.unanswered_lost();
        assert!(!u.has(ino));
        assert!(u.take_lost(ino));
        assert!(!u.take_lost(ino));
    }
}
