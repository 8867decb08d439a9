//! The store's write-ahead journal: a durable commit of the metadata database costs one
//! sequential write and one sync of a small file, not a sync of the pages it scattered over
//! the database file (docs/architecture.md "The metadata journal"; the format in
//! docs/protocol.md "On-disk formats: the metadata journal").
//!
//! [`Journaled`] sits between redb and the database file (redb's `StorageBackend` seam). Every
//! write and length change redb makes goes to a page overlay in memory (reads see it); the
//! database file is left as it was at the last checkpoint. Where redb asks for a sync
//! (`sync_data`, the end of every durable commit), the pages written since the last record
//! are appended to the journal as one checksummed record (each page once, as it is then, and
//! the length changes) and only the journal is synced. When the journal is full, and at a
//! clean close, the overlay is written into the database file, which is synced, and the
//! journal emptied (a *checkpoint*: a new generation in its header, with the length of the
//! database file then).
//!
//! The database file never holds a page before the record that carries it is synced, so a
//! power cut that loses unsynced records (the first of a two-phase commit's two) loses
//! exactly them, whatever redb wrote since.
//!
//! **Why this is exact after a crash.** What redb asked to be durable is the database file as
//! of the last checkpoint (synced) plus, in order, every operation of the complete records
//! since. Opening replays exactly that onto the file: cut back to the checkpoint's length, then
//! every operation of every record whose generation, sequence number and checksum are right,
//! up to the first that is not (a torn last record; the rest is ignored), then a sync and a
//! checkpoint. Between checkpoints the file is not written at all; at a checkpoint every
//! record is synced before the file is written, and a crash in the middle of writing it
//! replays the same records over it. A journal belongs to one database file (its device,
//! inode and birth time in the header): one left beside a file that was replaced (a restore,
//! a new format) is ignored.
//!
//! Readers that must not change a byte (fsck, `inspect`, a dry run) see the replay in memory
//! ([`ReadOnlyJournaled`], [`apply_to_image`]).
//!
//! A failed journal write or sync fails every later call (fail-stop, as the store itself).

use std::fs::File;
use std::io::ErrorKind;
use std::ops::Bound;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, Weak};

use redb::StorageBackend;
use redb::backends::FileBackend;

/// How large the journal grows before a checkpoint empties it.
pub const JOURNAL_MAX: u64 = 16 << 20;
/// The journal file is grown by zero-filled steps of this (writing into allocated blocks
/// makes a record's sync cheaper than growing the file with it).
const GROW_STEP: u64 = 4 << 20;
/// The header takes the first block.
const HEADER_LEN: u64 = 4096;
const MAGIC: [u8; 8] = *b"SANFSJNL";
/// The journal's format version (docs/on-disk-format.md). Version 2 added data records
/// (`OP_DATA`, `OP_SETTLED`), version 3 packed page operations (`OP_PACKED`); a journal of
/// an older version reads as one without them.
pub const JOURNAL_VERSION: u32 = 3;
const RECORD_MAGIC: u32 = u32::from_le_bytes(*b"SJRC");
/// magic u32, reserved u32, generation u64, seq u64, payload length u64, operations u32,
/// crc32c u32.
const RECORD_HEAD: usize = 40;
const OP_WRITE: u8 = 1;
const OP_SET_LEN: u8 = 2;
/// Bytes written to a data LUN, journaled so that their write needs no flush of the LUN
/// before it is acknowledged ([`DataJournal`]).
const OP_DATA: u8 = 3;
/// Every data operation up to this id is on its LUN, flushed: not replayed.
const OP_SETTLED: u8 = 4;
/// Page writes and length changes packed with LZ4 (version 3): a commit's pages are mostly
/// zeros and near repeats (redb's allocator state), ~160 KiB that pack into ~10 KiB, and the
/// journal's sync costs by the byte on the commit path. The data operations stay unpacked
/// (file bytes rarely pack, and they are copied onto the LUNs from the record at a replay).
const OP_PACKED: u8 = 5;
/// Page operations shorter than this are not packed.
const PACK_MIN: usize = 1024;
/// The most an LZ4 block expands to: every 255 bytes of output take at least one of input.
const LZ4_MAX_EXPANSION: u64 = 255;
/// redb's database header (its commit slots) lies within this many bytes of the start.
const REDB_HEADER_LEN: u64 = 4096;
/// Pages of the in-memory replay of read-only views.
const PAGE: u64 = 4096;

/// Journal records appended (metrics).
pub const JOURNAL_RECORDS: &str = "sanfs_journal_records_total";
/// Bytes of journal records appended.
pub const JOURNAL_BYTES: &str = "sanfs_journal_bytes_total";
/// Syncs of the journal.
pub const JOURNAL_SYNCS: &str = "sanfs_journal_syncs_total";
/// Bytes of redb's page operations before they were packed (against `JOURNAL_BYTES`: how
/// much packing saves).
pub const JOURNAL_PAGE_BYTES: &str = "sanfs_journal_page_bytes_total";
/// Checkpoints (the database file synced, the journal emptied).
pub const JOURNAL_CHECKPOINTS: &str = "sanfs_journal_checkpoints_total";
/// Records replayed when the store was opened.
pub const JOURNAL_REPLAYED: &str = "sanfs_journal_replayed_records_total";

fn err(msg: impl Into<String>) -> std::io::Error {
    std::io::Error::other(msg.into())
}

/// Where the journal of database file `main` lives: beside it, `<name>.journal`.
pub fn journal_path(main: &Path) -> PathBuf {
    let mut name = main.as_os_str().to_owned();
    name.push(".journal");
    PathBuf::from(name)
}

/// Which database file a journal belongs to: device, inode and birth time (0 where the file
/// system keeps none). A file put in its place (a restore, a new format) differs.
pub fn file_identity(file: &File) -> std::io::Result<[u64; 3]> {
    let m = file.metadata()?;
    let born = m
        .created()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
    Ok([m.dev(), m.ino(), born])
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Header {
    generation: u64,
    /// The database file's length at the checkpoint this generation starts from.
    base_len: u64,
    owner: [u64; 3],
}

impl Header {
    const LEN: usize = 8 + 4 + 4 + 8 + 8 + 24 + 4;

    /// The header block, of format `version` (1: a journal that holds no data operation, left
    /// by a clean close so that an older server can open the store).
    fn encode(&self, version: u32) -> Vec<u8> {
        let mut b = Vec::with_capacity(HEADER_LEN as usize);
        b.extend_from_slice(&MAGIC);
        b.extend_from_slice(&version.to_le_bytes());
        b.extend_from_slice(&0u32.to_le_bytes());
        b.extend_from_slice(&self.generation.to_le_bytes());
        b.extend_from_slice(&self.base_len.to_le_bytes());
        for v in self.owner {
            b.extend_from_slice(&v.to_le_bytes());
        }
        let crc = crc32c::crc32c(&b);
        b.extend_from_slice(&crc.to_le_bytes());
        b.resize(HEADER_LEN as usize, 0);
        b
    }

    /// `Ok(None)`: no header (a new or torn one: nothing to replay).
    fn decode(b: &[u8]) -> std::io::Result<Option<Header>> {
        if b.len() < Header::LEN || b[..8] != MAGIC {
            return Ok(None);
        }
        let body = &b[..Header::LEN - 4];
        if crc32c::crc32c(body) != le32(b, Header::LEN - 4) {
            return Ok(None);
        }
        let version = le32(b, 8);
        if version == 0 || version > JOURNAL_VERSION {
            return Err(err(format!(
                "the metadata journal has format version {version}, this server knows \
                 {JOURNAL_VERSION}: use the sanfs-mds that wrote it"
            )));
        }
        Ok(Some(Header {
            generation: le64(b, 16),
            base_len: le64(b, 24),
            owner: [le64(b, 32), le64(b, 40), le64(b, 48)],
        }))
    }
}

fn le32(b: &[u8], at: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(a)
}

fn le64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

/// One change redb made to the database file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    Write {
        offset: u64,
        data: Vec<u8>,
    },
    SetLen(u64),
    /// Bytes `data` written at `offset` of data LUN `lun` (data operation `id`).
    Data {
        id: u64,
        lun: u32,
        offset: u64,
        data: Vec<u8>,
    },
    /// Data operations up to `0` are settled (on their LUNs, flushed).
    Settled(u64),
}

fn encode_write(out: &mut Vec<u8>, offset: u64, data: &[u8]) {
    out.push(OP_WRITE);
    out.extend_from_slice(&offset.to_le_bytes());
    out.extend_from_slice(&(data.len() as u64).to_le_bytes());
    out.extend_from_slice(data);
}

fn encode_set_len(out: &mut Vec<u8>, len: u64) {
    out.push(OP_SET_LEN);
    out.extend_from_slice(&len.to_le_bytes());
}

fn encode_data(out: &mut Vec<u8>, op: &DataOp) {
    out.push(OP_DATA);
    out.extend_from_slice(&op.id.to_le_bytes());
    out.extend_from_slice(&op.lun.to_le_bytes());
    out.extend_from_slice(&op.offset.to_le_bytes());
    out.extend_from_slice(&(op.data.len() as u64).to_le_bytes());
    out.extend_from_slice(&op.data);
}

fn encode_settled(out: &mut Vec<u8>, upto: u64) {
    out.push(OP_SETTLED);
    out.extend_from_slice(&upto.to_le_bytes());
}

/// The operations of a record's payload (its checksum was right, so a payload that does
/// not parse is damage, not a torn write).
fn decode_ops(p: &[u8], count: u32) -> std::io::Result<Vec<Op>> {
    let mut ops = Vec::with_capacity((count as usize).min(p.len()));
    decode_ops_into(p, count, true, &mut ops)?;
    Ok(ops)
}

/// Decodes `count` operations of `p` (all of it) onto `ops`; `outer`: `p` is a record's
/// payload, in which a packed operation may stand (not inside another).
fn decode_ops_into(
    mut p: &[u8],
    count: u32,
    outer: bool,
    ops: &mut Vec<Op>,
) -> std::io::Result<()> {
    let damaged = || err("a metadata journal record is damaged (checksum right, contents not)");
    for _ in 0..count {
        let (&kind, rest) = p.split_first().ok_or_else(damaged)?;
        p = rest;
        match kind {
            OP_WRITE => {
                if p.len() < 16 {
                    return Err(damaged());
                }
                let offset = le64(p, 0);
                let len = usize::try_from(le64(p, 8)).map_err(|_| damaged())?;
                p = &p[16..];
                if p.len() < len {
                    return Err(damaged());
                }
                ops.push(Op::Write {
                    offset,
                    data: p[..len].to_vec(),
                });
                p = &p[len..];
            }
            OP_SET_LEN => {
                if p.len() < 8 {
                    return Err(damaged());
                }
                ops.push(Op::SetLen(le64(p, 0)));
                p = &p[8..];
            }
            OP_DATA => {
                if p.len() < 28 {
                    return Err(damaged());
                }
                let (id, lun, offset) = (le64(p, 0), le32(p, 8), le64(p, 12));
                let len = usize::try_from(le64(p, 20)).map_err(|_| damaged())?;
                p = &p[28..];
                if p.len() < len || id == 0 {
                    return Err(damaged());
                }
                ops.push(Op::Data {
                    id,
                    lun,
                    offset,
                    data: p[..len].to_vec(),
                });
                p = &p[len..];
            }
            OP_SETTLED => {
                if p.len() < 8 {
                    return Err(damaged());
                }
                ops.push(Op::Settled(le64(p, 0)));
                p = &p[8..];
            }
            OP_PACKED if outer => {
                if p.len() < 20 {
                    return Err(damaged());
                }
                let (raw_len, inner, packed_len) = (le64(p, 0), le32(p, 8), le64(p, 12));
                p = &p[20..];
                let packed_len = usize::try_from(packed_len).map_err(|_| damaged())?;
                if p.len() < packed_len
                    || raw_len > (packed_len as u64).saturating_mul(LZ4_MAX_EXPANSION)
                {
                    return Err(damaged());
                }
                let mut raw = vec![0u8; usize::try_from(raw_len).map_err(|_| damaged())?];
                match lz4_flex::block::decompress_into(&p[..packed_len], &mut raw) {
                    Ok(n) if n == raw.len() => {}
                    _ => return Err(damaged()),
                }
                decode_ops_into(&raw, inner, false, ops)?;
                p = &p[packed_len..];
            }
            _ => return Err(damaged()),
        }
    }
    if !p.is_empty() {
        return Err(damaged());
    }
    Ok(())
}

/// A record's operations, encoded after room for its head, so that the record is sealed in
/// place (no copy of the payload on the commit path).
#[derive(Debug)]
struct Pending {
    buf: Vec<u8>,
    ops: u32,
    /// Page operations encoded before they are packed into `buf` (kept for its capacity).
    pages: Vec<u8>,
}

impl Pending {
    fn new() -> Pending {
        Pending {
            buf: vec![0u8; RECORD_HEAD],
            ops: 0,
            pages: Vec::new(),
        }
    }

    /// Appends `raw`, `count` encoded operations, as one packed operation where that is
    /// shorter, else as they are.
    fn push_packed(&mut self, raw: &[u8], count: u32) {
        if count == 0 {
            return;
        }
        metrics::counter!(JOURNAL_PAGE_BYTES).increment(raw.len() as u64);
        let at = self.buf.len();
        if raw.len() >= PACK_MIN {
            self.buf.push(OP_PACKED);
            self.buf
                .extend_from_slice(&(raw.len() as u64).to_le_bytes());
            self.buf.extend_from_slice(&count.to_le_bytes());
            self.buf.extend_from_slice(&0u64.to_le_bytes());
            let start = self.buf.len();
            self.buf.resize(
                start + lz4_flex::block::get_maximum_output_size(raw.len()),
                0,
            );
            match lz4_flex::block::compress_into(raw, &mut self.buf[start..]) {
                Ok(n) if start + n - at < raw.len() => {
                    self.buf.truncate(start + n);
                    self.buf[start - 8..start].copy_from_slice(&(n as u64).to_le_bytes());
                    self.ops += 1;
                    return;
                }
                _ => self.buf.truncate(at),
            }
        }
        self.buf.extend_from_slice(raw);
        self.ops += count;
    }

    fn clear(&mut self) {
        self.buf.truncate(RECORD_HEAD);
        self.ops = 0;
    }

    fn push_data(&mut self, op: &DataOp) {
        encode_data(&mut self.buf, op);
        self.ops += 1;
    }

    fn push_settled(&mut self, upto: u64) {
        encode_settled(&mut self.buf, upto);
        self.ops += 1;
    }

    /// The record of generation `generation`, number `seq`: head filled in, padded so that
    /// the next record starts 8-byte aligned.
    fn seal(&mut self, generation: u64, seq: u64) -> &[u8] {
        let payload_len = (self.buf.len() - RECORD_HEAD) as u64;
        let head = &mut self.buf[..RECORD_HEAD];
        head[0..4].copy_from_slice(&RECORD_MAGIC.to_le_bytes());
        head[4..8].copy_from_slice(&0u32.to_le_bytes());
        head[8..16].copy_from_slice(&generation.to_le_bytes());
        head[16..24].copy_from_slice(&seq.to_le_bytes());
        head[24..32].copy_from_slice(&payload_len.to_le_bytes());
        head[32..36].copy_from_slice(&self.ops.to_le_bytes());
        let crc = crc32c::crc32c_append(
            crc32c::crc32c(&self.buf[..RECORD_HEAD - 4]),
            &self.buf[RECORD_HEAD..],
        );
        self.buf[RECORD_HEAD - 4..RECORD_HEAD].copy_from_slice(&crc.to_le_bytes());
        self.buf.resize(self.buf.len().next_multiple_of(8), 0);
        &self.buf
    }
}

/// What redb changed since the last record: the pages it wrote (their bytes are in the
/// store's [`Overlay`]) and how its length moved. The next record carries each page once,
/// as it is then, however often it was written in between.
#[derive(Debug)]
struct Dirty {
    pages: std::collections::BTreeSet<u64>,
    /// The length at the last record.
    start_len: u64,
    /// The least length since.
    min_len: u64,
    /// Something changed (a length change alone is a record too).
    any: bool,
    /// A write reached redb's header (a commit point).
    header: bool,
}

impl Dirty {
    fn new(len: u64) -> Dirty {
        Dirty {
            pages: Default::default(),
            start_len: len,
            min_len: len,
            any: false,
            header: false,
        }
    }

    fn write(&mut self, offset: u64, len: usize) {
        if len == 0 {
            return;
        }
        let last = (offset + len as u64 - 1) / PAGE;
        self.pages.extend(offset / PAGE..=last);
        self.any = true;
        self.header |= offset < REDB_HEADER_LEN;
    }

    fn set_len(&mut self, len: u64) {
        self.min_len = self.min_len.min(len);
        self.any = true;
    }

    /// The operations that take the store from its state at the last record to `now`'s:
    /// the length cut to the least it was (what lay past it is gone), set to the length now,
    /// then every page written, as it is now.
    /// They go into the record packed (`Pending::push_packed`).
    fn encode(&self, now: &Overlay, out: &mut Pending) {
        out.clear();
        let mut raw = std::mem::take(&mut out.pages);
        raw.clear();
        let mut count = 0u32;
        let mut len = self.start_len;
        if self.min_len < len {
            encode_set_len(&mut raw, self.min_len);
            count += 1;
            len = self.min_len;
        }
        if now.len != len {
            encode_set_len(&mut raw, now.len);
            count += 1;
        }
        for &no in &self.pages {
            let start = no * PAGE;
            // A page cut off by a shorter length and not written again reads as zeros,
            // which the two length changes above leave it.
            if start >= now.len {
                continue;
            }
            if let Some(page) = now.pages.get(&no) {
                let n = (now.len - start).min(PAGE) as usize;
                encode_write(&mut raw, start, &page[..n]);
                count += 1;
            }
        }
        out.push_packed(&raw, count);
        out.pages = raw;
    }
}

/// What a journal holds: its header and the operations of its complete records, in order,
/// and where the next record goes.
#[derive(Debug)]
struct Contents {
    header: Header,
    records: Vec<Vec<Op>>,
    end: u64,
}

fn read_exact(dev: &dyn StorageBackend, offset: u64, len: usize) -> std::io::Result<Vec<u8>> {
    let mut b = vec![0u8; len];
    dev.read(offset, &mut b)?;
    Ok(b)
}

/// Reads journal `log` of database file `owner`: `None` when it holds no header of that file.
fn read_contents(log: &dyn StorageBackend, owner: [u64; 3]) -> std::io::Result<Option<Contents>> {
    let len = log.len()?;
    if len < HEADER_LEN {
        return Ok(None);
    }
    let Some(header) = Header::decode(&read_exact(log, 0, HEADER_LEN as usize)?)? else {
        return Ok(None);
    };
    if header.owner != owner {
        return Ok(None);
    }
    let mut records = Vec::new();
    let mut at = HEADER_LEN;
    loop {
        if at + RECORD_HEAD as u64 > len {
            break;
        }
        let head = read_exact(log, at, RECORD_HEAD)?;
        let payload_len = le64(&head, 24);
        if le32(&head, 0) != RECORD_MAGIC
            || le64(&head, 8) != header.generation
            || le64(&head, 16) != records.len() as u64 + 1
            || payload_len > len - at - RECORD_HEAD as u64
        {
            break;
        }
        let Ok(plen) = usize::try_from(payload_len) else {
            break;
        };
        let payload = read_exact(log, at + RECORD_HEAD as u64, plen)?;
        let crc = crc32c::crc32c_append(crc32c::crc32c(&head[..RECORD_HEAD - 4]), &payload);
        if crc != le32(&head, RECORD_HEAD - 4) {
            break;
        }
        records.push(decode_ops(&payload, le32(&head, 32))?);
        at = (at + RECORD_HEAD as u64 + payload_len).next_multiple_of(8);
    }
    Ok(Some(Contents {
        header,
        records,
        end: at,
    }))
}

#[derive(Debug)]
struct LogState {
    header: Header,
    next_seq: u64,
    /// Where the next record goes.
    end: u64,
    /// The journal's length (grown in zero-filled steps).
    log_len: u64,
    /// The store as redb sees it: the database file as of the last checkpoint, with every
    /// page written since on top. The file itself is written only at a checkpoint, after the
    /// records that hold those pages are synced: so a power cut can never leave it with
    /// pages of a commit whose record it lost (over pages the surviving state still uses).
    cache: Overlay,
    /// What changed since the last record.
    dirty: Dirty,
    /// The next record, encoded (its buffer is kept between records).
    pending: Pending,
    /// A write or sync failed: every later call fails.
    failed: bool,
    stats: JournalStats,
    /// Syncs are held back ([`SyncHold`]).
    held: bool,
    /// Records were appended and not synced since (the first of a commit's two, or a commit's
    /// under a hold): the hold's release, or the next checkpoint, syncs them.
    unsynced: bool,
    /// Data written to the LUNs and journaled, not settled yet ([`DataJournal`]).
    data: DataLog,
}

/// One data operation: bytes written at `offset` of data LUN `lun`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DataOp {
    /// Increasing across the journal's generations (settling names the last one settled).
    pub id: u64,
    pub lun: u32,
    pub offset: u64,
    pub data: Vec<u8>,
}

/// The data operations the journal holds and the LUNs may not (docs/on-disk-format.md
/// "Data records").
#[derive(Debug, Default)]
struct DataLog {
    next_id: u64,
    /// Every operation up to this id is on its LUN, flushed.
    settled: u64,
    /// The `settled` the journal's records say so far.
    settled_recorded: u64,
    /// Operations not settled, by id; `.1`: in a record already.
    ops: std::collections::BTreeMap<u64, (DataOp, bool)>,
    /// Ids of `ops` not known to be on their LUNs (replayed from the journal at open and not
    /// written since).
    unwritten: std::collections::BTreeSet<u64>,
    bytes: u64,
}

impl DataLog {
    /// Pushes what the next record must carry: the operations not in a record yet (all of
    /// them with `all`: the first record of a generation), and how far they are settled.
    fn push_into(&mut self, out: &mut Pending, all: bool) {
        for (op, recorded) in self.ops.values_mut() {
            if all || !*recorded {
                out.push_data(op);
                *recorded = true;
            }
        }
        if all || self.settled != self.settled_recorded {
            out.push_settled(self.settled);
            self.settled_recorded = self.settled;
        }
    }
}

/// What the journal did (for metrics and tests).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct JournalStats {
    /// Records appended.
    pub records: u64,
    /// Syncs of the journal.
    pub syncs: u64,
    /// Bytes of records appended.
    pub bytes: u64,
    /// Checkpoints (syncs of the database file, journal emptied).
    pub checkpoints: u64,
    /// Records replayed when the journal was opened.
    pub replayed: u64,
}

/// The lock methods of `StorageBackend`, answered by the database file (`self.main`): redb
/// locks the file it opens, as with its own file backend.
macro_rules! delegate_locks {
    () => {
        fn try_lock_range(&self, s: Bound<u64>, e: Bound<u64>) -> Result<bool, redb::BackendError> {
            self.main.try_lock_range(s, e)
        }

        fn try_lock_shared_range(
            &self,
            s: Bound<u64>,
            e: Bound<u64>,
        ) -> Result<bool, redb::BackendError> {
            self.main.try_lock_shared_range(s, e)
        }

        fn lock_range(&self, s: Bound<u64>, e: Bound<u64>) -> Result<(), redb::BackendError> {
            self.main.lock_range(s, e)
        }

        fn lock_shared_range(
            &self,
            s: Bound<u64>,
            e: Bound<u64>,
        ) -> Result<(), redb::BackendError> {
            self.main.lock_shared_range(s, e)
        }

        fn unlock_range(&self, s: Bound<u64>, e: Bound<u64>) -> Result<(), redb::BackendError> {
            self.main.unlock_range(s, e)
        }

        fn query_lock_range(
            &self,
            s: Bound<u64>,
            e: Bound<u64>,
        ) -> Result<bool, redb::BackendError> {
            self.main.query_lock_range(s, e)
        }
    };
}

/// redb's storage: the database file `main`, journaled in `log` (module docs).
#[derive(Debug)]
pub struct Journaled {
    main: Box<dyn StorageBackend>,
    max: u64,
    log: Arc<Log>,
    /// Held for the journal's life: one process replays and appends at a time.
    _lock: Option<File>,
}

/// The journal file and its state, shared with the [`SyncHold`]s of its store's committer.
#[derive(Debug)]
struct Log {
    file: Box<dyn StorageBackend>,
    state: Mutex<LogState>,
    /// `state.data.bytes`, readable without the lock (which a journal sync holds): the
    /// server asks before every write grant whether anything waits to be settled.
    unsettled: std::sync::atomic::AtomicU64,
}

impl Log {
    fn lock(&self) -> std::sync::MutexGuard<'_, LogState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Appends the sealed record in `st.pending` at the journal's end (not synced), growing
    /// the file in zero-filled steps up to `max`.
    fn write_sealed(&self, st: &mut LogState, max: u64) -> std::io::Result<()> {
        let (end, rec_len) = (st.end, st.pending.buf.len() as u64);
        while st.log_len < end + rec_len {
            let step = GROW_STEP.min(max.saturating_sub(st.log_len)).max(rec_len);
            self.file.set_len(st.log_len + step)?;
            // Written, not just sized: blocks allocated now make each record's sync cheaper.
            self.file.write(st.log_len, &vec![0u8; step as usize])?;
            st.log_len += step;
        }
        self.file.write(end, &st.pending.buf)?;
        st.end += rec_len;
        st.next_seq += 1;
        st.stats.records += 1;
        st.stats.bytes += rec_len;
        metrics::counter!(JOURNAL_RECORDS).increment(1);
        metrics::counter!(JOURNAL_BYTES).increment(rec_len);
        Ok(())
    }

    /// Appends and syncs a record of data operations alone: every one not settled (`all`,
    /// the first record of a generation), or those not in a record yet, and how far they
    /// are settled. The pages redb wrote since the last record stay for the next one.
    fn data_record(&self, st: &mut LogState, all: bool) -> std::io::Result<()> {
        let (generation, seq) = (st.header.generation, st.next_seq);
        let LogState { pending, data, .. } = &mut *st;
        pending.clear();
        data.push_into(pending, all);
        pending.seal(generation, seq);
        self.write_sealed(st, u64::MAX)?;
        self.file.sync_data()?;
        st.unsynced = false;
        st.stats.syncs += 1;
        metrics::counter!(JOURNAL_SYNCS).increment(1);
        Ok(())
    }

    /// The first record of a new generation: the data not settled, carried over.
    fn carry(&self, st: &mut LogState) -> std::io::Result<()> {
        self.data_record(st, true)
    }
}

/// The data operations of `c`'s records that are not settled (from a journal being
/// replayed), their ids kept.
fn unsettled_data(c: &Contents) -> DataLog {
    let mut log = DataLog::default();
    let mut last = 0u64;
    for op in c.records.iter().flatten() {
        match op {
            Op::Data {
                id,
                lun,
                offset,
                data,
            } => {
                last = last.max(*id);
                let op = DataOp {
                    id: *id,
                    lun: *lun,
                    offset: *offset,
                    data: data.clone(),
                };
                log.ops.insert(*id, (op, false));
            }
            Op::Settled(upto) => {
                last = last.max(*upto);
                log.settled = log.settled.max(*upto);
            }
            Op::Write { .. } | Op::SetLen(_) => {}
        }
    }
    let settled = log.settled;
    log.ops.retain(|id, _| *id > settled);
    log.unwritten = log.ops.keys().copied().collect();
    log.bytes = log.ops.values().map(|(o, _)| o.data.len() as u64).sum();
    log.settled_recorded = 0;
    log.next_id = last + 1;
    log
}

/// Data written to the LUNs by the server and journaled with the metadata commit that makes
/// it readable, instead of a flush of the LUNs before that commit: a durable small write
/// costs one sync (the journal's), not two. The journal keeps each such operation, and
/// replays it onto the LUNs after a crash, until it is *settled*: the LUNs flushed after it
/// was written there. Whoever else writes the same blocks (a client under a write grant,
/// the server without the journal) settles first, so that a replay can never put older
/// bytes over newer ones (docs/architecture.md "Data in the metadata journal").
#[derive(Debug, Clone)]
pub struct DataJournal(Weak<Log>);

impl DataJournal {
    fn log(&self) -> std::io::Result<Arc<Log>> {
        self.0
            .upgrade()
            .ok_or_else(|| err("the metadata store is closed"))
    }

    /// Adds operations for the LUNs (`(LUN, offset, bytes)`): carried by the next record, so
    /// durable with the next durable commit. The caller writes them to their LUNs (not
    /// flushed) before the next [`DataJournal::settle`] takes its point, or marks them
    /// [`DataJournal::not_written`]. Answers their ids; `Ok(None)`, nothing added, when the
    /// journal would then hold more than `limit` bytes not settled.
    pub fn stage(
        &self,
        ops: Vec<(u32, u64, Vec<u8>)>,
        limit: u64,
    ) -> std::io::Result<Option<Vec<u64>>> {
        let log = self.log()?;
        let mut st = log.lock();
        Journaled::check(&st)?;
        let adding: u64 = ops.iter().map(|o| o.2.len() as u64).sum();
        if st.data.bytes + adding > limit {
            return Ok(None);
        }
        let mut ids = Vec::with_capacity(ops.len());
        for (lun, offset, data) in ops {
            let id = st.data.next_id.max(1);
            st.data.next_id = id + 1;
            ids.push(id);
            let op = DataOp {
                id,
                lun,
                offset,
                data,
            };
            st.data.ops.insert(id, (op, false));
        }
        st.data.bytes += adding;
        log.unsettled.store(st.data.bytes, Ordering::Relaxed);
        Ok(Some(ids))
    }

    /// Staged operations `ids` did not reach their LUNs: no settling passes them, and the
    /// next start writes them there (as operations replayed after a crash).
    pub fn not_written(&self, ids: &[u64]) {
        if let Some(log) = self.0.upgrade() {
            let mut st = log.lock();
            let d = &mut st.data;
            for id in ids {
                if d.ops.contains_key(id) {
                    d.unwritten.insert(*id);
                }
            }
        }
    }

    /// Takes staged operations `ids` back, before any record carries them (the change they
    /// belong to failed in the transaction that staged them): they are never replayed.
    /// Answers whether every one of them was still unrecorded.
    pub fn unstage(&self, ids: &[u64]) -> bool {
        let Some(log) = self.0.upgrade() else {
            return false;
        };
        let mut st = log.lock();
        let d = &mut st.data;
        let mut all = true;
        for id in ids {
            match d.ops.get(id) {
                Some((_, false)) => {
                    if let Some((op, _)) = d.ops.remove(id) {
                        d.bytes -= op.data.len() as u64;
                    }
                }
                _ => all = false,
            }
        }
        log.unsettled.store(st.data.bytes, Ordering::Relaxed);
        all
    }

    /// Bytes of data the journal holds, not settled.
    pub fn unsettled_bytes(&self) -> u64 {
        self.0
            .upgrade()
            .map_or(0, |l| l.unsettled.load(Ordering::Relaxed))
    }

    /// The last operation that a flush of the LUNs now would settle: every one up to it is on
    /// its LUN. `None`: nothing to settle.
    pub fn settle_point(&self) -> Option<u64> {
        let log = self.0.upgrade()?;
        if log.unsettled.load(Ordering::Relaxed) == 0 {
            return None;
        }
        let st = log.lock();
        let d = &st.data;
        let (&first, &last) = (d.ops.keys().next()?, d.ops.keys().next_back()?);
        // Up to the first operation not written to its LUN since the store was opened.
        let point = d.unwritten.first().map_or(last, |&u| u - 1);
        (first <= point).then_some(point)
    }

    /// Operations replayed from the journal that the LUNs may not hold: the server writes
    /// each one ([`DataJournal::written`]) before the LUNs are used.
    pub fn unwritten(&self) -> Vec<DataOp> {
        let Some(log) = self.0.upgrade() else {
            return Vec::new();
        };
        let st = log.lock();
        st.data
            .unwritten
            .iter()
            .filter_map(|id| st.data.ops.get(id).map(|(o, _)| o.clone()))
            .collect()
    }

    /// Operation `id` is written to its LUN again (not flushed).
    pub fn written(&self, id: u64) {
        if let Some(log) = self.0.upgrade() {
            log.lock().data.unwritten.remove(&id);
        }
    }

    /// The LUNs were flushed after every operation up to `upto` was written there: they
    /// leave the journal, by a record synced now.
    pub fn settle(&self, upto: u64) -> std::io::Result<()> {
        let log = self.log()?;
        let mut st = log.lock();
        Journaled::check(&st)?;
        if upto <= st.data.settled {
            return Ok(());
        }
        let d = &mut st.data;
        d.settled = upto;
        let keep = d.ops.split_off(&(upto + 1));
        let gone = std::mem::replace(&mut d.ops, keep);
        d.bytes -= gone.values().map(|(o, _)| o.data.len() as u64).sum::<u64>();
        log.unsettled.store(d.bytes, Ordering::Relaxed);
        d.unwritten.retain(|id| *id > upto);
        let r = log.data_record(&mut st, false);
        Journaled::failing(&mut st, r)
    }
}

/// Holds back the journal's syncs while one durable redb commit runs
/// ([`Journaled::sync_holder`]): redb syncs twice per commit (its two-phase commit, which its
/// quick repair needs: pages and the new secondary slot, then the swapped primary), and each
/// sync writes the header, so each appended record would be synced. Within one commit the
/// journal orders the records by itself (a record is replayed only after every one before
/// it, and only whole), so the first sync buys nothing: a crash after it replays the first
/// record alone, whose header still names the old commit as primary, exactly as a crash
/// before it. While held, records are appended and not synced; [`SyncHold::release`] syncs
/// once, before the commit is answered.
///
/// It does not keep the journal open: the journal file (and its lock) goes with the store's
/// database; a hold after that holds nothing.
#[derive(Debug, Clone)]
pub struct SyncHolder(Weak<Log>);

impl SyncHolder {
    /// The handle of this journal's data operations ([`DataJournal`]).
    pub fn data_journal(&self) -> DataJournal {
        DataJournal(self.0.clone())
    }

    /// Holds syncs until [`SyncHold::release`] (a hold dropped unreleased syncs too).
    pub fn hold(&self) -> SyncHold {
        let log = self.0.upgrade();
        if let Some(log) = &log {
            log.lock().held = true;
        }
        SyncHold(log)
    }
}

/// A hold of the journal's syncs ([`SyncHolder::hold`]).
#[must_use = "release it once the commit returns"]
#[derive(Debug)]
pub struct SyncHold(Option<Arc<Log>>);

impl SyncHold {
    /// Ends the hold and syncs what was appended under it (and any record appended unsynced
    /// before): the commit is durable when this answers `Ok`. A failed sync fails every later
    /// journal call (fail-stop).
    pub fn release(mut self) -> std::io::Result<()> {
        self.end()
    }

    fn end(&mut self) -> std::io::Result<()> {
        let Some(log) = self.0.take() else {
            return Ok(());
        };
        let mut st = log.lock();
        st.held = false;
        if !st.unsynced {
            return Ok(());
        }
        Journaled::check(&st)?;
        let r = log.file.sync_data();
        if r.is_err() {
            st.failed = true;
        } else {
            st.unsynced = false;
            st.stats.syncs += 1;
            metrics::counter!(JOURNAL_SYNCS).increment(1);
        }
        r
    }
}

impl Drop for SyncHold {
    fn drop(&mut self) {
        if let Err(e) = self.end() {
            tracing::error!(error = %e, "the metadata journal's sync failed");
        }
    }
}

fn apply(main: &dyn StorageBackend, ops: &[Op]) -> std::io::Result<()> {
    for op in ops {
        match op {
            Op::Write { offset, data } => {
                let end = offset + data.len() as u64;
                if main.len()? < end {
                    main.set_len(end)?;
                }
                main.write(*offset, data)?;
            }
            Op::SetLen(len) => main.set_len(*len)?,
            // Data LUNs' bytes: written by the server once its LUNs are open (DataJournal).
            Op::Data { .. } | Op::Settled(_) => {}
        }
    }
    Ok(())
}

impl Journaled {
    /// Opens database file `path` (`create`: made if missing) with its journal beside it,
    /// replaying the journal first. `InUse` (an `ErrorKind::WouldBlock` error) when another
    /// process holds the journal.
    pub fn open_file(path: &Path, create: bool) -> std::io::Result<Journaled> {
        let jpath = journal_path(path);
        let lock = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&jpath)?;
        // Held by another process: `ErrorKind::WouldBlock`.
        lock.try_lock()?;
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(create)
            .truncate(false)
            .open(path)?;
        let owner = file_identity(&file)?;
        let log = FileBackend::new(lock.try_clone()?).map_err(|e| err(e.to_string()))?;
        let main = FileBackend::new(file).map_err(|e| err(e.to_string()))?;
        let mut j = Journaled::open(Box::new(main), Box::new(log), owner, JOURNAL_MAX)?;
        j._lock = Some(lock);
        Ok(j)
    }

    /// Opens the journaled store `main` with journal `log` of at most `max` bytes: replays
    /// what the journal holds for `owner` onto `main`, syncs it, and starts a new generation.
    pub fn open(
        main: Box<dyn StorageBackend>,
        log: Box<dyn StorageBackend>,
        owner: [u64; 3],
        max: u64,
    ) -> std::io::Result<Journaled> {
        let max = max.max(2 * HEADER_LEN);
        let contents = read_contents(log.as_ref(), owner)?;
        let mut stats = JournalStats::default();
        let generation = match &contents {
            Some(c) => {
                if !c.records.is_empty() {
                    main.set_len(c.header.base_len)?;
                    for ops in &c.records {
                        apply(main.as_ref(), ops)?;
                    }
                    main.sync_data()?;
                    stats.replayed = c.records.len() as u64;
                    metrics::counter!(JOURNAL_REPLAYED).increment(stats.replayed);
                    tracing::info!(
                        records = c.records.len(),
                        bytes = c.end - HEADER_LEN,
                        "metadata journal replayed"
                    );
                }
                c.header.generation + 1
            }
            None => 1,
        };
        let data = contents.as_ref().map(unsettled_data).unwrap_or_default();
        let header = Header {
            generation,
            base_len: main.len()?,
            owner,
        };
        let log_len = log.len()?;
        if log_len < HEADER_LEN {
            log.set_len(HEADER_LEN)?;
        }
        log.write(0, &header.encode(JOURNAL_VERSION))?;
        log.sync_data()?;
        let len = main.len()?;
        let cache = Overlay::new(main.as_ref(), len)?;
        let j = Journaled {
            main,
            max,
            log: Arc::new(Log {
                file: log,
                unsettled: std::sync::atomic::AtomicU64::new(data.bytes),
                state: Mutex::new(LogState {
                    header,
                    next_seq: 1,
                    end: HEADER_LEN,
                    log_len: log_len.max(HEADER_LEN),
                    cache,
                    dirty: Dirty::new(len),
                    pending: Pending::new(),
                    failed: false,
                    stats,
                    held: false,
                    unsynced: false,
                    data,
                }),
            }),
            _lock: None,
        };
        {
            // Data the LUNs may not hold yet stays in the journal's new generation until the
            // server has written it there (DataJournal::unwritten).
            let mut st = j.lock();
            if !st.data.ops.is_empty() {
                tracing::info!(
                    operations = st.data.ops.len(),
                    bytes = st.data.bytes,
                    "journaled data to write to the data LUNs"
                );
                j.log.carry(&mut st)?;
            }
        }
        Ok(j)
    }

    /// What the journal did so far.
    pub fn stats(&self) -> JournalStats {
        self.lock().stats
    }

    /// A handle that holds this journal's syncs during one commit ([`SyncHolder`]).
    pub fn sync_holder(&self) -> SyncHolder {
        SyncHolder(Arc::downgrade(&self.log))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, LogState> {
        self.log.lock()
    }

    fn check(st: &LogState) -> std::io::Result<()> {
        if st.failed {
            return Err(err(
                "the metadata journal failed earlier; restart the server",
            ));
        }
        Ok(())
    }

    /// Writes every page since the last checkpoint into the database file, syncs it and
    /// starts a new, empty generation of the journal. Records appended and not synced are
    /// synced first: the file must never hold pages of a record a power cut could still
    /// lose (they may overwrite pages the state before that record uses).
    fn checkpoint(&self, st: &mut LogState, closing: bool) -> std::io::Result<()> {
        if st.unsynced {
            self.log.file.sync_data()?;
            st.unsynced = false;
            st.stats.syncs += 1;
            metrics::counter!(JOURNAL_SYNCS).increment(1);
        }
        st.cache.write_to(self.main.as_ref())?;
        self.main.sync_data()?;
        let header = Header {
            generation: st.header.generation + 1,
            base_len: self.main.len()?,
            owner: st.header.owner,
        };
        // A clean close that leaves no data in the journal leaves a version 1 journal (empty):
        // the server before data records opens it.
        let version = if closing && st.data.ops.is_empty() {
            1
        } else {
            JOURNAL_VERSION
        };
        self.log.file.write(0, &header.encode(version))?;
        self.log.file.sync_data()?;
        st.header = header;
        st.next_seq = 1;
        st.end = HEADER_LEN;
        st.dirty = Dirty::new(st.cache.len);
        // Everything appended before is in the synced database file now.
        st.unsynced = false;
        st.stats.checkpoints += 1;
        metrics::counter!(JOURNAL_CHECKPOINTS).increment(1);
        if !st.data.ops.is_empty() {
            // Data not settled is not in the database file: it moves to the new generation.
            self.log.carry(st)?;
        }
        Ok(())
    }

    fn sync_locked(&self, st: &mut LogState) -> std::io::Result<()> {
        if !st.dirty.any {
            return Ok(());
        }
        let (generation, seq, end) = (st.header.generation, st.next_seq, st.end);
        let LogState {
            dirty,
            cache,
            pending,
            data,
            ..
        } = &mut *st;
        dirty.encode(cache, pending);
        data.push_into(pending, false);
        let rec_len = pending.seal(generation, seq).len() as u64;
        if end + rec_len > self.max {
            // Full (or a record larger than the journal): the database file itself is synced.
            return self.checkpoint(st, false);
        }
        self.log.write_sealed(st, self.max)?;
        // redb's durable state is what its header names: a sync of pages it has not named
        // yet (the first of a commit's two) only orders them before the header, which the
        // journal does by itself (a record is replayed only after every one before it). So
        // the journal is synced when a record writes the header: one sync per commit.
        if st.dirty.header && st.held {
            // Synced when the hold ends (SyncHold): the commit is not answered before.
            st.unsynced = true;
        } else if st.dirty.header {
            self.log.file.sync_data()?;
            st.unsynced = false;
            st.stats.syncs += 1;
            metrics::counter!(JOURNAL_SYNCS).increment(1);
        } else {
            st.unsynced = true;
        }
        st.dirty = Dirty::new(st.cache.len);
        Ok(())
    }

    fn failing<T>(st: &mut LogState, r: std::io::Result<T>) -> std::io::Result<T> {
        if r.is_err() {
            st.failed = true;
        }
        r
    }
}

impl StorageBackend for Journaled {
    fn len(&self) -> Result<u64, std::io::Error> {
        Ok(self.lock().cache.len)
    }

    fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), std::io::Error> {
        self.lock().cache.read(self.main.as_ref(), offset, out)
    }

    fn set_len(&self, len: u64) -> Result<(), std::io::Error> {
        let mut st = self.lock();
        Self::check(&st)?;
        st.cache.set_len(len);
        st.dirty.set_len(len);
        Ok(())
    }

    fn sync_data(&self) -> Result<(), std::io::Error> {
        let mut st = self.lock();
        Self::check(&st)?;
        let r = self.sync_locked(&mut st);
        Self::failing(&mut st, r)
    }

    fn write(&self, offset: u64, data: &[u8]) -> Result<(), std::io::Error> {
        let mut st = self.lock();
        Self::check(&st)?;
        let r = st.cache.write(self.main.as_ref(), offset, data);
        Self::failing(&mut st, r)?;
        st.dirty.write(offset, data.len());
        Ok(())
    }

    fn close(&self) -> Result<(), std::io::Error> {
        {
            let mut st = self.lock();
            if !st.failed {
                // A clean close leaves the journal empty: what was written is synced in the
                // database file. Unsynced writes of a commit never acknowledged go with it,
                // as redb's own file backend would write them.
                let r = self.checkpoint(&mut st, true);
                Self::failing(&mut st, r)?;
            }
        }
        let r = self.log.file.close();
        self.main.close().and(r)
    }

    delegate_locks!();
}

/// The database as the journal leaves it, in memory, page by page, over the file: the live
/// view of a [`Journaled`] store (pages since its last checkpoint) and the view of readers
/// that must not change a byte of the file.
#[derive(Debug, Default)]
struct Overlay {
    len: u64,
    /// Bytes of the file below this are the file's; above, zeros (cut by a length change).
    main_valid: u64,
    pages: std::collections::BTreeMap<u64, Box<[u8]>>,
}

/// Adjacent pages are written to the database file in runs of at most this many bytes.
const WRITE_RUN: usize = 1 << 20;

impl Overlay {
    fn new(main: &dyn StorageBackend, base_len: u64) -> std::io::Result<Overlay> {
        Ok(Overlay {
            len: base_len,
            main_valid: base_len.min(main.len()?),
            pages: Default::default(),
        })
    }

    /// Page `no`, made part of the overlay (read from the file, or zeros, the first time).
    fn page_mut(&mut self, main: &dyn StorageBackend, no: u64) -> std::io::Result<&mut [u8]> {
        use std::collections::btree_map::Entry;
        let main_valid = self.main_valid;
        match self.pages.entry(no) {
            Entry::Occupied(e) => Ok(e.into_mut()),
            Entry::Vacant(e) => {
                let mut p = vec![0u8; PAGE as usize].into_boxed_slice();
                let start = no * PAGE;
                if start < main_valid {
                    let n = (main_valid - start).min(PAGE) as usize;
                    main.read(start, &mut p[..n])?;
                }
                Ok(e.insert(p))
            }
        }
    }

    fn write(
        &mut self,
        main: &dyn StorageBackend,
        offset: u64,
        data: &[u8],
    ) -> std::io::Result<()> {
        let mut at = offset;
        let mut rest = data;
        while !rest.is_empty() {
            let within = (at % PAGE) as usize;
            let n = rest.len().min(PAGE as usize - within);
            self.page_mut(main, at / PAGE)?[within..within + n].copy_from_slice(&rest[..n]);
            at += n as u64;
            rest = &rest[n..];
        }
        self.len = self.len.max(offset + data.len() as u64);
        Ok(())
    }

    fn set_len(&mut self, len: u64) {
        if len < self.len {
            self.main_valid = self.main_valid.min(len);
            self.pages.retain(|no, _| no * PAGE < len);
            if let Some(p) = self.pages.get_mut(&(len / PAGE)) {
                p[(len % PAGE) as usize..].fill(0);
            }
        }
        self.len = len;
    }

    fn apply(&mut self, main: &dyn StorageBackend, op: &Op) -> std::io::Result<()> {
        match op {
            Op::Write { offset, data } => self.write(main, *offset, data),
            Op::SetLen(len) => {
                self.set_len(*len);
                Ok(())
            }
            Op::Data { .. } | Op::Settled(_) => Ok(()),
        }
    }

    /// Writes the overlay into `main` (not synced) and empties it: `main` then reads as the
    /// overlay did.
    fn write_to(&mut self, main: &dyn StorageBackend) -> std::io::Result<()> {
        if self.main_valid < main.len()? {
            main.set_len(self.main_valid)?;
        }
        if main.len()? != self.len {
            main.set_len(self.len)?;
        }
        let mut run: Vec<u8> = Vec::new();
        let mut run_start = 0u64;
        for (&no, page) in &self.pages {
            let start = no * PAGE;
            if start >= self.len {
                break;
            }
            let n = (self.len - start).min(PAGE) as usize;
            if !run.is_empty() && (run_start + run.len() as u64 != start || run.len() >= WRITE_RUN)
            {
                main.write(run_start, &run)?;
                run.clear();
            }
            if run.is_empty() {
                run_start = start;
            }
            run.extend_from_slice(&page[..n]);
        }
        if !run.is_empty() {
            main.write(run_start, &run)?;
        }
        self.pages.clear();
        self.main_valid = self.len;
        Ok(())
    }

    fn read(&self, main: &dyn StorageBackend, offset: u64, out: &mut [u8]) -> std::io::Result<()> {
        if offset + out.len() as u64 > self.len {
            return Err(std::io::Error::new(
                ErrorKind::UnexpectedEof,
                "read past the end of the metadata store",
            ));
        }
        let mut at = offset;
        let mut done = 0;
        while done < out.len() {
            let no = at / PAGE;
            let within = (at % PAGE) as usize;
            let n = (out.len() - done).min(PAGE as usize - within);
            if let Some(p) = self.pages.get(&no) {
                out[done..done + n].copy_from_slice(&p[within..within + n]);
            } else {
                let dst = &mut out[done..done + n];
                let from_main = self.main_valid.saturating_sub(at).min(n as u64) as usize;
                if from_main > 0 {
                    main.read(at, &mut dst[..from_main])?;
                }
                dst[from_main..].fill(0);
            }
            at += n as u64;
            done += n;
        }
        Ok(())
    }
}

/// A database file with its journal replayed in memory: reads only.
#[derive(Debug)]
pub struct ReadOnlyJournaled {
    main: Box<dyn StorageBackend>,
    overlay: Option<Overlay>,
    _lock: Option<File>,
}

impl ReadOnlyJournaled {
    /// Opens database file `path` for reading with what its journal holds (the journal is
    /// only read). `WouldBlock` when a process that writes it holds the journal.
    pub fn open_file(path: &Path) -> std::io::Result<ReadOnlyJournaled> {
        let file = File::open(path)?;
        let owner = file_identity(&file)?;
        let jpath = journal_path(path);
        let (log, lock) = match File::open(&jpath) {
            Ok(j) => {
                j.try_lock_shared()?;
                let log = FileBackend::new(j.try_clone()?).map_err(|e| err(e.to_string()))?;
                (Some(log), Some(j))
            }
            Err(e) if e.kind() == ErrorKind::NotFound => (None, None),
            Err(e) => return Err(e),
        };
        let main = FileBackend::new(file).map_err(|e| err(e.to_string()))?;
        let log = log.as_ref().map(|l| l as &dyn StorageBackend);
        let mut r = ReadOnlyJournaled::open(Box::new(main), log, owner)?;
        r._lock = lock;
        Ok(r)
    }

    /// `main` as journal `log` (if any) of `owner` would leave it.
    pub fn open(
        main: Box<dyn StorageBackend>,
        log: Option<&dyn StorageBackend>,
        owner: [u64; 3],
    ) -> std::io::Result<ReadOnlyJournaled> {
        let mut overlay = None;
        if let Some(log) = log
            && let Some(c) = read_contents(log, owner)?
            && !c.records.is_empty()
        {
            let mut o = Overlay::new(main.as_ref(), c.header.base_len)?;
            for op in c.records.iter().flatten() {
                o.apply(main.as_ref(), op)?;
            }
            overlay = Some(o);
        }
        Ok(ReadOnlyJournaled {
            main,
            overlay,
            _lock: None,
        })
    }
}

impl StorageBackend for ReadOnlyJournaled {
    fn len(&self) -> Result<u64, std::io::Error> {
        match &self.overlay {
            Some(o) => Ok(o.len),
            None => self.main.len(),
        }
    }

    fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), std::io::Error> {
        match &self.overlay {
            Some(o) => o.read(self.main.as_ref(), offset, out),
            None => self.main.read(offset, out),
        }
    }

    fn set_len(&self, _len: u64) -> Result<(), std::io::Error> {
        Err(err("the metadata store is open for reading only"))
    }

    fn sync_data(&self) -> Result<(), std::io::Error> {
        Ok(())
    }

    fn write(&self, _offset: u64, _data: &[u8]) -> Result<(), std::io::Error> {
        Err(err("the metadata store is open for reading only"))
    }

    fn close(&self) -> Result<(), std::io::Error> {
        self.main.close()
    }

    delegate_locks!();
}

/// Database file image `image` as its journal at `jpath` would leave it (a dry run's copy).
pub fn apply_to_image(image: &mut Vec<u8>, owner: [u64; 3], jpath: &Path) -> std::io::Result<()> {
    let j = match File::open(jpath) {
        Ok(j) => j,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    let log = FileBackend::new(j).map_err(|e| err(e.to_string()))?;
    match read_contents(&log, owner)? {
        Some(c) => replay_into_image(image, &c),
        None => Ok(()),
    }
}

/// Replays `c` onto an image in memory (as [`Journaled::open`] does onto the file).
fn replay_into_image(image: &mut Vec<u8>, c: &Contents) -> std::io::Result<()> {
    if c.records.is_empty() {
        return Ok(());
    }
    let size = |n: u64| usize::try_from(n).map_err(|_| err("the store does not fit in memory"));
    image.resize(size(c.header.base_len)?, 0);
    for op in c.records.iter().flatten() {
        match op {
            Op::Write { offset, data } => {
                let start = size(*offset)?;
                let end = start + data.len();
                if image.len() < end {
                    image.resize(end, 0);
                }
                image[start..end].copy_from_slice(data);
            }
            Op::SetLen(len) => image.resize(size(*len)?, 0),
            Op::Data { .. } | Op::Settled(_) => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::backend::{FaultPlan, SimDisk};
    use redb::{Database, Durability, ReadableDatabase, ReadableTable, TableDefinition};

    const T: TableDefinition<'_, u64, &[u8]> = TableDefinition::new("t");
    const OWNER: [u64; 3] = [7, 8, 9];

    /// The crash disk's xorshift stream.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            crate::store::backend::xorshift(&mut self.0)
        }
        fn below(&mut self, n: u64) -> u64 {
            self.next() % n.max(1)
        }
    }

    fn value(key: u64, len: usize) -> Vec<u8> {
        (0..len).map(|i| (key as usize * 31 + i) as u8).collect()
    }

    fn db(main: &SimDisk, log: &SimDisk, max: u64) -> std::io::Result<Database> {
        Ok(db_held(main, log, max)?.0)
    }

    /// [`db`] with the handle that holds its journal's syncs.
    fn db_held(main: &SimDisk, log: &SimDisk, max: u64) -> std::io::Result<(Database, SyncHolder)> {
        let j = Journaled::open(Box::new(main.clone()), Box::new(log.clone()), OWNER, max)?;
        let holder = j.sync_holder();
        let db = Database::builder()
            .create_with_backend(j)
            .map_err(|e| err(e.to_string()))?;
        Ok((db, holder))
    }

    /// Key `key` with a value of 100 bytes, in a durable commit of its own.
    fn put(db: &Database, key: u64) {
        let w = db.begin_write().unwrap();
        w.open_table(T)
            .unwrap()
            .insert(key, value(key, 100).as_slice())
            .unwrap();
        w.commit().unwrap();
    }

    /// Every key and its value length in a table.
    fn contents(r: &redb::ReadTransaction) -> Vec<(u64, usize)> {
        let Ok(t) = r.open_table(T) else {
            return Vec::new();
        };
        t.iter()
            .unwrap()
            .map(|e| {
                let (k, v) = e.unwrap();
                let (k, v) = (k.value(), v.value().to_vec());
                assert_eq!(
                    v,
                    value(k, v.len()),
                    "key {k} holds bytes it was never given"
                );
                (k, v.len())
            })
            .collect()
    }

    /// Commits key after key (some lazily, without a sync) until the disks "lose power" at a
    /// random call of either, or the process is killed (every write that returned survives,
    /// synced or not). What was acknowledged (a durable commit returned) must be in the store
    /// reopened from what the disks kept, and nothing but a prefix of what was committed.
    fn crash_round(seed: u64) -> (u64, u64, u64) {
        let mut rng = Rng(seed | 1);
        let torn = rng.below(2) == 0;
        // As the server commits: redb's quick repair (two syncs per commit) under a hold of
        // the journal's syncs (one), acknowledged once the hold is released.
        let held = rng.below(2) == 0;
        // A kill of the process, not a power cut.
        let kill = rng.below(3) == 0;
        let plan = |rng: &mut Rng| FaultPlan {
            crash_at_op: None,
            torn_writes: torn,
            fail_sync: None,
            seed: rng.next(),
        };
        let main = SimDisk::new(plan(&mut rng));
        let log = SimDisk::new(plan(&mut rng));
        // Small enough that checkpoints happen, also in the middle of the crash window.
        let max = 64 * 1024 + rng.below(512 * 1024);
        let (store, holder) = db_held(&main, &log, max).unwrap();
        let crash_after = rng.below(4000);
        let mut acked = 0u64;
        let mut sizes = Vec::new();
        let mut calls = 0;
        for key in 0..400u64 {
            let big = rng.below(8) == 0;
            let len = 1 + rng.below(if big { 20_000 } else { 600 }) as usize;
            let lazy = rng.below(3) == 0;
            let r = (|| -> Result<(), Box<dyn std::error::Error>> {
                let mut w = store.begin_write()?;
                if lazy {
                    w.set_durability(Durability::None)?;
                }
                w.set_quick_repair(held);
                {
                    let mut t = w.open_table(T)?;
                    t.insert(key, value(key, len).as_slice())?;
                    if key > 3 && rng.below(4) == 0 {
                        // Old keys go again: freed pages are reused.
                        let gone = rng.below(key);
                        t.remove(gone)?;
                        t.insert(gone, value(gone, sizes[gone as usize]).as_slice())?;
                    }
                }
                if held && !lazy {
                    let hold = holder.hold();
                    w.commit()?;
                    hold.release()?;
                } else {
                    w.commit()?;
                }
                Ok(())
            })();
            sizes.push(len);
            if r.is_err() {
                break;
            }
            if !lazy {
                acked = key + 1;
            }
            calls = main.ops() + log.ops();
            if calls >= crash_after {
                // A power cut between two calls, or (below) in the middle of the next one.
                if rng.below(2) == 0 {
                    main.crash_now();
                    log.crash_now();
                    break;
                }
            }
        }
        let _ = calls;
        let checkpoints = log.syncs();
        let (main_img, log_img) = if kill {
            // The process dies (its disks live on): what it wrote is there.
            let images = (main.live_image(), log.live_image());
            main.crash_now();
            log.crash_now();
            drop(store);
            images
        } else {
            // The power goes (if it has not).
            main.crash_now();
            log.crash_now();
            drop(store);
            (main.durable_image(), log.durable_image())
        };

        // Read-only, in memory: what the journal holds, read without changing a byte.
        let ro = ReadOnlyJournaled::open(
            Box::new(SimDisk::from_image(main_img.clone(), FaultPlan::default())),
            Some(&SimDisk::from_image(log_img.clone(), FaultPlan::default())),
            OWNER,
        )
        .unwrap();
        let mut image = main_img.clone();
        if let Some(c) = read_contents(
            &SimDisk::from_image(log_img.clone(), FaultPlan::default()),
            OWNER,
        )
        .unwrap()
        {
            replay_into_image(&mut image, &c).unwrap();
        }
        let mut seen = vec![0u8; ro.len().unwrap() as usize];
        ro.read(0, &mut seen).unwrap();
        assert!(
            seen == image,
            "seed {seed:#x}: the read-only view differs from the replay"
        );

        // Replayed onto the file, as a server's open does.
        let main2 = SimDisk::from_image(main_img, FaultPlan::default());
        let log2 = SimDisk::from_image(log_img, FaultPlan::default());
        let j =
            Journaled::open(Box::new(main2.clone()), Box::new(log2.clone()), OWNER, max).unwrap();
        let replayed = j.stats().replayed;
        let db2 = Database::builder().create_with_backend(j).unwrap();
        let got = contents(&db2.begin_read().unwrap());
        let present: Vec<u64> = got.iter().map(|(k, _)| *k).collect();
        let upto = present.last().map_or(0, |k| k + 1);
        assert!(
            upto >= acked,
            "seed {seed:#x}: keys below {acked} were acknowledged durable, the store has {upto}"
        );
        assert_eq!(
            present,
            (0..upto).collect::<Vec<_>>(),
            "seed {seed:#x}: not a prefix of the commits"
        );
        for (k, len) in got {
            assert_eq!(len, sizes[k as usize], "seed {seed:#x}: key {k}'s value");
        }
        // And it goes on: a commit after the replay, then a clean close leaves the journal
        // empty.
        let w = db2.begin_write().unwrap();
        w.open_table(T)
            .unwrap()
            .insert(upto, value(upto, 10).as_slice())
            .unwrap();
        w.commit().unwrap();
        drop(db2);
        let c = read_contents(&log2, OWNER).unwrap().unwrap();
        assert!(
            c.records.is_empty(),
            "seed {seed:#x}: a clean close left records"
        );
        (acked, replayed, checkpoints)
    }

    #[test]
    fn a_power_cut_keeps_every_acknowledged_commit_and_nothing_torn() {
        let base: u64 = match std::env::var("SANFS_JOURNAL_SEED") {
            Ok(s) => s.parse().expect("SANFS_JOURNAL_SEED: a number"),
            Err(_) => {
                use std::hash::{BuildHasher, Hasher};
                std::collections::hash_map::RandomState::new()
                    .build_hasher()
                    .finish()
            }
        };
        let rounds: u64 = std::env::var("SANFS_JOURNAL_ROUNDS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(60);
        eprintln!("journal crash rounds: {rounds}, seed {base} (SANFS_JOURNAL_SEED)");
        let (mut acked, mut replayed, mut syncs) = (0, 0, 0);
        for i in 0..rounds {
            let (a, r, s) = crash_round(base.wrapping_add(i.wrapping_mul(0x9e37_79b9_7f4a_7c15)));
            acked += a;
            replayed += r;
            syncs += s;
        }
        eprintln!(
            "{acked} commits acknowledged, {replayed} records replayed, {syncs} journal syncs"
        );
        assert!(
            replayed > 0 && acked > rounds,
            "the rounds crashed before they did anything"
        );
    }

    #[test]
    fn a_commit_costs_one_journal_sync_and_the_file_none() {
        let (main, log) = (
            SimDisk::new(FaultPlan::default()),
            SimDisk::new(FaultPlan::default()),
        );
        let db = db(&main, &log, JOURNAL_MAX).unwrap();
        let (main_syncs, log_syncs) = (main.syncs(), log.syncs());
        for key in 0..10u64 {
            put(&db, key);
        }
        assert_eq!(main.syncs(), main_syncs, "the database file was synced");
        assert_eq!(
            log.syncs() - log_syncs,
            10,
            "one journal sync per durable commit"
        );
    }

    #[test]
    fn a_two_phase_commit_under_a_hold_costs_one_journal_sync() {
        let (main, log) = (
            SimDisk::new(FaultPlan::default()),
            SimDisk::new(FaultPlan::default()),
        );
        let (db, holder) = db_held(&main, &log, JOURNAL_MAX).unwrap();
        let put_quick = |key: u64, held: bool| {
            let mut w = db.begin_write().unwrap();
            w.set_quick_repair(true);
            w.open_table(T)
                .unwrap()
                .insert(key, value(key, 100).as_slice())
                .unwrap();
            let hold = held.then(|| holder.hold());
            let before = log.syncs();
            w.commit().unwrap();
            if let Some(h) = hold {
                // Both records appended, neither synced yet: then one sync.
                assert_eq!(log.syncs(), before, "synced under the hold");
                h.release().unwrap();
                assert_eq!(log.syncs(), before + 1);
            }
        };
        let start = log.syncs();
        for key in 0..5u64 {
            put_quick(key, false);
        }
        assert_eq!(
            log.syncs() - start,
            10,
            "redb's two-phase commit: two syncs"
        );
        let start = log.syncs();
        for key in 5..10u64 {
            put_quick(key, true);
        }
        assert_eq!(log.syncs() - start, 5, "one sync per commit under a hold");
        // A hold over no durable commit syncs nothing.
        let start = log.syncs();
        holder.hold().release().unwrap();
        drop(holder.hold());
        assert_eq!(log.syncs(), start);
        let r = db.begin_read().unwrap();
        assert_eq!(contents(&r).len(), 10);
    }

    #[test]
    fn a_sync_holder_does_not_keep_the_journal_open() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("db");
        let j = Journaled::open_file(&path, true).unwrap();
        let holder = j.sync_holder();
        drop(j);
        // The lock went with the journal: the next opener gets it.
        let again = Journaled::open_file(&path, false).unwrap();
        holder.hold().release().unwrap();
        drop(again);
    }

    #[test]
    fn a_journal_of_another_file_is_ignored_and_a_newer_one_refused() {
        let (main, log) = (
            SimDisk::new(FaultPlan::default()),
            SimDisk::new(FaultPlan::default()),
        );
        {
            let db = db(&main, &log, 1 << 20).unwrap();
            put(&db, 1);
            main.crash_now();
            log.crash_now();
        }
        let log_img = log.durable_image();
        assert!(
            !read_contents(
                &SimDisk::from_image(log_img.clone(), FaultPlan::default()),
                OWNER
            )
            .unwrap()
            .unwrap()
            .records
            .is_empty()
        );
        let other = [7, 8, 10];
        let l = SimDisk::from_image(log_img.clone(), FaultPlan::default());
        assert!(read_contents(&l, other).unwrap().is_none());
        // A version 1 header (no data records) reads; a newer one is refused, not ignored.
        let with_version = |v: u8| {
            let mut img = log_img.clone();
            img[8] = v;
            let crc = crc32c::crc32c(&img[..Header::LEN - 4]);
            img[Header::LEN - 4..Header::LEN].copy_from_slice(&crc.to_le_bytes());
            SimDisk::from_image(img, FaultPlan::default())
        };
        assert!(read_contents(&with_version(1), OWNER).unwrap().is_some());
        assert!(read_contents(&with_version(2), OWNER).unwrap().is_some());
        let e = read_contents(&with_version(4), OWNER).unwrap_err();
        assert!(e.to_string().contains("format version 4"), "{e}");
    }

    /// The journal as a crash would leave it: what each disk had synced.
    fn crashed(main: &SimDisk, log: &SimDisk) -> (SimDisk, SimDisk) {
        (
            SimDisk::from_image(main.durable_image(), FaultPlan::default()),
            SimDisk::from_image(log.durable_image(), FaultPlan::default()),
        )
    }

    fn data_op(lun: u32, offset: u64, fill: u8) -> (u32, u64, Vec<u8>) {
        (lun, offset, vec![fill; 4096])
    }

    /// (lun, offset, first byte) of each operation to write again after an open.
    fn unwritten(dj: &DataJournal) -> Vec<(u32, u64, u8)> {
        dj.unwritten()
            .iter()
            .map(|o| (o.lun, o.offset, o.data[0]))
            .collect()
    }

    #[test]
    fn journaled_data_is_replayed_after_a_crash_until_it_is_settled() {
        let (main, log) = (
            SimDisk::new(FaultPlan::default()),
            SimDisk::new(FaultPlan::default()),
        );
        let (db, holder) = db_held(&main, &log, JOURNAL_MAX).unwrap();
        let dj = holder.data_journal();
        assert_eq!(
            dj.stage(vec![data_op(0, 4096, 1), data_op(1, 0, 2)], 1 << 20)
                .unwrap()
                .map(|ids| ids.len()),
            Some(2)
        );
        assert_eq!(dj.unsettled_bytes(), 8192);
        // Durable with the next durable commit, not before.
        let (m, l) = crashed(&main, &log);
        let j = Journaled::open(Box::new(m), Box::new(l), OWNER, JOURNAL_MAX).unwrap();
        assert!(unwritten(&j.sync_holder().data_journal()).is_empty());
        put(&db, 1);
        assert!(
            dj.stage(vec![data_op(0, 8192, 3)], 1 << 20)
                .unwrap()
                .is_some()
        );
        put(&db, 2);
        // Over the limit: refused, nothing added.
        assert!(dj.stage(vec![data_op(0, 0, 9)], 12288).unwrap().is_none());
        let (m, l) = crashed(&main, &log);
        let (m2, l2) = (m.clone(), l.clone());
        let j = Journaled::open(Box::new(m), Box::new(l), OWNER, JOURNAL_MAX).unwrap();
        let dj2 = j.sync_holder().data_journal();
        assert_eq!(unwritten(&dj2), vec![(0, 4096, 1), (1, 0, 2), (0, 8192, 3)]);
        // Not written again yet: nothing can be settled past it.
        assert_eq!(dj2.settle_point(), None);
        drop(j);
        // Reopened again before anything was written: the same three (carried over).
        let j = Journaled::open(
            Box::new(m2.clone()),
            Box::new(l2.clone()),
            OWNER,
            JOURNAL_MAX,
        )
        .unwrap();
        let dj2 = j.sync_holder().data_journal();
        assert_eq!(unwritten(&dj2).len(), 3);
        for o in dj2.unwritten().iter().take(2) {
            dj2.written(o.id);
        }
        let point = dj2.settle_point().expect("two written");
        dj2.settle(point).unwrap();
        assert_eq!(unwritten(&dj2), vec![(0, 8192, 3)]);
        drop(j);
        let j = Journaled::open(Box::new(m2), Box::new(l2), OWNER, JOURNAL_MAX).unwrap();
        let dj2 = j.sync_holder().data_journal();
        assert_eq!(
            unwritten(&dj2),
            vec![(0, 8192, 3)],
            "settled data is never replayed"
        );
        // New operations get ids past every one the journal held.
        let old = dj2.unwritten()[0].id;
        dj2.written(old);
        assert!(
            dj2.stage(vec![data_op(2, 0, 4)], 1 << 20)
                .unwrap()
                .is_some()
        );
        assert_eq!(dj2.settle_point(), Some(old + 1));
        // And the store's own pages are untouched by all this.
        drop(db);
    }

    #[test]
    fn a_clean_close_without_data_leaves_a_journal_the_older_server_reads() {
        let (main, log) = (
            SimDisk::new(FaultPlan::default()),
            SimDisk::new(FaultPlan::default()),
        );
        let (db, holder) = db_held(&main, &log, JOURNAL_MAX).unwrap();
        let dj = holder.data_journal();
        assert!(dj.stage(vec![data_op(0, 0, 5)], 1 << 20).unwrap().is_some());
        put(&db, 1);
        assert_eq!(
            u32::from(log.live_image()[8]),
            JOURNAL_VERSION,
            "a journal with data is of this version"
        );
        dj.written(1);
        dj.settle(1).unwrap();
        drop(db);
        assert_eq!(log.live_image()[8], 1, "nothing left for a newer reader");
        let j = Journaled::open(
            Box::new(main.clone()),
            Box::new(log.clone()),
            OWNER,
            JOURNAL_MAX,
        )
        .unwrap();
        assert!(unwritten(&j.sync_holder().data_journal()).is_empty());
    }

    #[test]
    fn no_settling_passes_staged_data_its_lun_did_not_take() {
        let (main, log) = (
            SimDisk::new(FaultPlan::default()),
            SimDisk::new(FaultPlan::default()),
        );
        let (db, holder) = db_held(&main, &log, JOURNAL_MAX).unwrap();
        let dj = holder.data_journal();
        let first = dj.stage(vec![data_op(0, 0, 1)], 1 << 20).unwrap().unwrap();
        let second = dj.stage(vec![data_op(1, 0, 2)], 1 << 20).unwrap().unwrap();
        put(&db, 1);
        // Staged data is written by its stager: a settling may pass it at once.
        assert_eq!(dj.settle_point(), second.last().copied());
        dj.not_written(&second);
        assert_eq!(dj.settle_point(), first.last().copied());
        dj.not_written(&first);
        assert_eq!(dj.settle_point(), None);
        // Written again (as after a start), it settles.
        for id in first.iter().chain(&second) {
            dj.written(*id);
        }
        assert_eq!(dj.settle_point(), second.last().copied());
    }

    #[test]
    fn data_taken_back_before_a_record_carries_it_is_never_replayed() {
        let (main, log) = (
            SimDisk::new(FaultPlan::default()),
            SimDisk::new(FaultPlan::default()),
        );
        let (db, holder) = db_held(&main, &log, JOURNAL_MAX).unwrap();
        let dj = holder.data_journal();
        let kept = dj.stage(vec![data_op(0, 0, 1)], 1 << 20).unwrap().unwrap();
        let back = dj
            .stage(vec![data_op(1, 4096, 2)], 1 << 20)
            .unwrap()
            .unwrap();
        assert_eq!(dj.unsettled_bytes(), 8192);
        assert!(dj.unstage(&back), "not in a record yet");
        assert_eq!(dj.unsettled_bytes(), 4096);
        put(&db, 1);
        // In a record now: too late to take back.
        assert!(!dj.unstage(&kept));
        let (m, l) = crashed(&main, &log);
        let j = Journaled::open(Box::new(m), Box::new(l), OWNER, JOURNAL_MAX).unwrap();
        assert_eq!(unwritten(&j.sync_holder().data_journal()), vec![(0, 0, 1)]);
    }

    #[test]
    fn unsettled_data_moves_to_each_new_generation_and_through_a_clean_close() {
        let (main, log) = (
            SimDisk::new(FaultPlan::default()),
            SimDisk::new(FaultPlan::default()),
        );
        // A small journal: checkpoints every few commits.
        let (db, holder) = db_held(&main, &log, 64 << 10).unwrap();
        let dj = holder.data_journal();
        assert!(dj.stage(vec![data_op(0, 0, 7)], 1 << 20).unwrap().is_some());
        for key in 0..40u64 {
            put(&db, key);
        }
        let (m, l) = crashed(&main, &log);
        let j = Journaled::open(Box::new(m), Box::new(l), OWNER, 64 << 10).unwrap();
        assert_eq!(unwritten(&j.sync_holder().data_journal()), vec![(0, 0, 7)]);
        drop(j);
        // A clean close checkpoints the store: the data stays in the journal (this version).
        drop(db);
        assert_eq!(u32::from(log.live_image()[8]), JOURNAL_VERSION);
        let j = Journaled::open(
            Box::new(main.clone()),
            Box::new(log.clone()),
            OWNER,
            64 << 10,
        )
        .unwrap();
        assert_eq!(unwritten(&j.sync_holder().data_journal()), vec![(0, 0, 7)]);
        let db = Database::builder()
            .create_with_backend(j)
            .map_err(|e| err(e.to_string()))
            .unwrap();
        let r = db.begin_read().unwrap();
        assert_eq!(contents(&r).len(), 40, "every commit kept");
    }

    #[test]
    fn a_file_store_held_by_one_opener_is_in_use_for_the_next() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("meta.redb");
        let first = Journaled::open_file(&path, true).unwrap();
        let e = Journaled::open_file(&path, false).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::WouldBlock, "{e}");
        let e = ReadOnlyJournaled::open_file(&path).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::WouldBlock, "{e}");
        drop(first);
        ReadOnlyJournaled::open_file(&path).unwrap();
    }

    #[test]
    fn a_damaged_record_stops_the_replay_there() {
        let ops = vec![
            Op::SetLen(8192),
            Op::Write {
                offset: 10,
                data: b"hello".to_vec(),
            },
        ];
        let mut pending = Pending::new();
        let mut raw = Vec::new();
        encode_set_len(&mut raw, 8192);
        encode_write(&mut raw, 10, b"hello");
        // Too short to pack: the operations as they are (as every older journal has them).
        pending.push_packed(&raw, 2);
        let payload = pending.buf[RECORD_HEAD..].to_vec();
        assert_eq!(payload, raw);
        assert_eq!(decode_ops(&payload, 2).unwrap(), ops);
        assert!(decode_ops(&payload, 3).is_err());
        assert!(decode_ops(&payload[..payload.len() - 1], 2).is_err());
        let log = SimDisk::new(FaultPlan::default());
        let h = Header {
            generation: 5,
            base_len: 0,
            owner: OWNER,
        };
        let r1 = pending.seal(5, 1).to_vec();
        let mut r2 = pending.seal(5, 2).to_vec();
        let r3 = pending.seal(5, 3).to_vec();
        log.set_len(HEADER_LEN + (r1.len() + r2.len() + r3.len()) as u64)
            .unwrap();
        log.write(0, &h.encode(JOURNAL_VERSION)).unwrap();
        log.write(HEADER_LEN, &r1).unwrap();
        r2[RECORD_HEAD + 3] ^= 1;
        log.write(HEADER_LEN + r1.len() as u64, &r2).unwrap();
        log.write(HEADER_LEN + (r1.len() + r2.len()) as u64, &r3)
            .unwrap();
        let c = read_contents(&log, OWNER).unwrap().unwrap();
        assert_eq!(c.records, vec![ops.clone()]);
        // A version 2 journal (no packed operations) reads the same.
        log.write(0, &h.encode(2)).unwrap();
        let c = read_contents(&log, OWNER).unwrap().unwrap();
        assert_eq!(c.records, vec![ops]);
    }

    /// Pages as redb leaves them: a few bytes of keys, then zeros.
    fn sparse_pages(n: u64) -> (Vec<u8>, Vec<Op>) {
        let (mut raw, mut ops) = (Vec::new(), Vec::new());
        for no in 0..n {
            let mut page = vec![0u8; PAGE as usize];
            for (i, b) in page.iter_mut().take(300).enumerate() {
                *b = (no as usize * 7 + i / 8) as u8;
            }
            encode_write(&mut raw, no * PAGE, &page);
            ops.push(Op::Write {
                offset: no * PAGE,
                data: page,
            });
        }
        (raw, ops)
    }

    #[test]
    fn page_operations_are_packed_and_read_back_exact() {
        let (raw, ops) = sparse_pages(40);
        let mut pending = Pending::new();
        pending.push_packed(&raw, 40);
        assert_eq!(pending.ops, 1, "one packed operation");
        assert_eq!(pending.buf[RECORD_HEAD], OP_PACKED);
        let payload = pending.buf[RECORD_HEAD..].to_vec();
        assert!(
            payload.len() * 8 < raw.len(),
            "{} bytes packed from {}",
            payload.len(),
            raw.len()
        );
        assert_eq!(decode_ops(&payload, 1).unwrap(), ops);
        // Damage is an error, never a panic or a huge allocation.
        assert!(decode_ops(&payload[..payload.len() - 1], 1).is_err());
        let mut bomb = payload.clone();
        let packed_len = le64(&payload, 13);
        bomb[1..9].copy_from_slice(&(packed_len * LZ4_MAX_EXPANSION + 1).to_le_bytes());
        assert!(decode_ops(&bomb, 1).is_err());
        let mut short = payload.clone();
        short[1..9].copy_from_slice(&(raw.len() as u64 - 1).to_le_bytes());
        assert!(decode_ops(&short, 1).is_err());
        let mut fewer = payload.clone();
        fewer[9..13].copy_from_slice(&39u32.to_le_bytes());
        assert!(decode_ops(&fewer, 1).is_err());
        for at in (21..payload.len()).step_by(7) {
            let mut flipped = payload.clone();
            flipped[at] ^= 0x5a;
            // Damaged LZ4 data fails or unpacks to other operations; it never panics.
            let _ = decode_ops(&flipped, 1);
        }
        // A packed operation inside a packed one is damage.
        let mut nested = Pending::new();
        let mut inner = payload.clone();
        inner.extend_from_slice(&raw[..PACK_MIN]);
        nested.push_packed(&inner, 2);
        assert!(decode_ops(&nested.buf[RECORD_HEAD..], nested.ops).is_err());
    }

    #[test]
    fn a_commits_pages_go_into_the_journal_packed() {
        let (main, log) = (
            SimDisk::new(FaultPlan::default()),
            SimDisk::new(FaultPlan::default()),
        );
        let store = db(&main, &log, JOURNAL_MAX).unwrap();
        for key in 0..10u64 {
            put(&store, key);
        }
        let c = read_contents(&log, OWNER).unwrap().unwrap();
        let pages: usize = c
            .records
            .iter()
            .flatten()
            .map(|op| match op {
                Op::Write { data, .. } => data.len(),
                _ => 0,
            })
            .sum();
        let written = c.end - HEADER_LEN;
        assert!(
            written * 4 < pages as u64,
            "{written} bytes of records for {pages} bytes of pages"
        );
        // A power cut now: the store comes back from the packed records.
        let (main, log) = crashed(&main, &log);
        drop(store);
        let store = db(&main, &log, JOURNAL_MAX).unwrap();
        let r = store.begin_read().unwrap();
        assert_eq!(contents(&r).len(), 10);
    }
}
