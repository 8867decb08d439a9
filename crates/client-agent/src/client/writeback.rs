//! Write-back under write delegations (issue 18; docs/posix.md "Buffered writes").
//!
//! A small buffered write (shorter than [`WriteBackConfig::max_write`]) to a file this agent
//! holds a **write delegation** on is kept in memory here and answered at once; the file's
//! held-back bytes are written later, in large pieces, through the ordinary write path
//! ([`Client::write_through`]: direct where the pieces are long and aligned, proxied
//! otherwise, and proxied for a write-back of a few short extents: a small file's bytes). The delegation is what makes this coherent: while it is held, no other
//! session reads, writes, truncates or stats the file without the server recalling it
//! first, and the recall is acknowledged only once everything held back is written
//! ([`Inner::recall_delegation`]). The holder's own I/O never waits for its delegation
//! (server side: a delegation does not conflict with its own session's locks).
//!
//! **When held-back bytes are written:** when a file has [`WriteBackConfig::file_bytes`] of
//! them or the agent [`WriteBackConfig::total_bytes`] (the writer that crosses the line
//! writes its file back before it is answered); when they are older than
//! [`WriteBackConfig::max_age`] (a background task); before any other I/O of this agent on
//! the file that must see them in order (a read, a write through, an append, a truncate, a
//! fallocate, a seek for data or holes); at fsync and close (then made durable); at a
//! recall; and after a new session (a server restart), as soon as it serves.
//!
//! **Order.** One write-back of a file at a time ([`FileState::flusher`]): what a write-back
//! took out of the table is written before any later I/O of the file that waited for it.
//! A write that fails is reported (EIO, ENOSPC, EDQUOT) by the file's next fsync or close,
//! as a failed page write-back is on a local file system.
//!
//! **Attributes.** Until held-back bytes are written the server's size does not show them:
//! [`Client::buffered_attr`] is what this node reports instead (the larger size; the mtime
//! is set when they are written back).
//!
//! **Attribute changes** (`chmod`, `utimensat` with explicit times, a `chown` to the owners
//! the file has) of a file made here that this node holds the write delegation of are held
//! back too ([`Client::hold_attr_change`]), when the server is sure to accept them as they
//! are: the caller owns the file, the change moves no ownership (so no quota), and the file
//! has no extended attribute (no ACL or capability a change would touch). They are sent as
//! one `SetAttr` by the same write-back, after the file's held-back bytes, so that the
//! server applies them in the application's order (`tar x` and `cp -p` write, then set the
//! times and the mode). Whatever a held-back change could not be applied after (a write, a
//! truncate, an open, an extended attribute call, another caller's change) writes back
//! first.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use sanfs_proto::model::{DelegateReply, DelegateRequest};
use sanfs_proto::pb;
use sanfs_proto::types::{
    Attr, ByteRange, Credentials, FileType, FsError, GrantId, InodeId, S_ISGID, SetAttr, TimeSet,
    Timestamp, cleared_setid,
};

use super::data::{Through, WriteOutcome};
use super::file::{OpenFile, retrying};
use super::rpc::Pin;
use super::{Client, FileHandle, Inner, add, bump};
use crate::buf::AlignedBuf;
use crate::stages::{Span, Stage};

/// Write-back limits (mount options `writeback=`, `writeback_file=`, `writeback_age=`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriteBackConfig {
    /// Held-back bytes of the whole agent; 0 turns write-back off.
    pub total_bytes: u64,
    /// Held-back bytes of one file that start its write-back.
    pub file_bytes: u64,
    /// Writes at least this long are written through at once (large writes gain nothing).
    pub max_write: u64,
    /// Held-back bytes older than this are written back by the background task.
    pub max_age: Duration,
    /// Bytes of file data the agent keeps cached for reads under delegations (0: no read
    /// cache).
    pub read_cache_bytes: u64,
}

impl Default for WriteBackConfig {
    fn default() -> WriteBackConfig {
        WriteBackConfig {
            total_bytes: 256 << 20,
            file_bytes: 8 << 20,
            max_write: 128 << 10,
            max_age: Duration::from_secs(5),
            read_cache_bytes: 256 << 20,
        }
    }
}

/// How long a refused delegation is not asked for again.
const REFUSAL_BACKOFF: Duration = Duration::from_secs(1);

/// How many recalled-but-unknown delegation ids are remembered.
const MAX_TOMBSTONES: usize = 1024;

/// A delegation this agent holds.
#[derive(Debug, Clone, Copy)]
struct Held {
    id: GrantId,
    /// The session generation it was given under: useless under any other.
    generation: u64,
    /// A write delegation (also good for reads), or a read delegation.
    write: bool,
}

impl Held {
    /// Whether a recall of `ids` is of this delegation: one of them, or any while it is
    /// still asked for with a create ([`ASKED`]: its reply brings the id).
    fn recalled_by(&self, ids: &[GrantId]) -> bool {
        self.id == ASKED || ids.contains(&self.id)
    }
}

/// The id a write delegation has while it is asked for with a create the agent answered
/// itself ([`WriteBack::expect_created`]), until the create's reply names it: no
/// delegation of the server has it (0 is "refused" on the wire).
const ASKED: GrantId = GrantId(0);

/// The read cache's unit: file bytes `[i * CHUNK, (i + 1) * CHUNK)`.
const CHUNK: u64 = 128 << 10;

/// How far ahead of a sequential reader the read cache is filled, in the background: eight
/// of its reads, at least [`READ_AHEAD_MIN`] and at most [`READ_AHEAD_MAX`]. A read-ahead
/// starts when less than half of that is cached ahead of the reader. (With 1 MiB at least,
/// a reader of 8 KiB caught up with each read-ahead of 512 KiB and waited for it: half the
/// speed of reading 1 MiB at each miss.)
const READ_AHEAD_READS: u64 = 8;
const READ_AHEAD_MIN: u64 = 4 << 20;
const READ_AHEAD_MAX: u64 = 16 << 20;

/// Reads shorter than this are read ahead of in the reader's own read instead, at a miss
/// ([`READ_AHEAD_MIN`] more): the reader waits for it, but on two cores a read-ahead beside
/// a reader of 4-8 KiB took the CPU its reads needed (its cache hits ran 40% slower).
const READ_AHEAD_BACKGROUND: u64 = 64 << 10;

/// A read-ahead under way: chunks `[first, end)`; `done` closes when its chunks are kept
/// (or it ended without them).
struct Ahead {
    first: u64,
    end: u64,
    done: tokio::sync::watch::Receiver<()>,
}

impl Ahead {
    fn running(&self) -> bool {
        self.done.has_changed().is_ok()
    }
}

/// A read-ahead to run ([`Client::read_ahead`]): chunks `[first, first + count)` of `ino`,
/// kept only if no cached chunk of the file was dropped (`drop_gen`) and no write-back took
/// held-back bytes (`flush_gen`) since it was planned. Dropping it ends it.
#[derive(Debug)]
pub struct ReadAhead {
    ino: InodeId,
    first: u64,
    count: u64,
    drop_gen: u64,
    flush_gen: u64,
    _done: tokio::sync::watch::Sender<()>,
}

/// Attribute changes of one file held back under its write delegation
/// ([`Client::hold_attr_change`]).
struct HeldAttrs {
    /// Whom they are made as (one caller: another one's change writes these back first).
    cred: Credentials,
    /// What the write-back sends: the mode and times set, in one `SetAttr`.
    changes: SetAttr,
    /// A `chown` to the file's own owners was held: it changes only the ctime (sent as
    /// one when nothing else is).
    chown: bool,
    /// The file's attributes as this node reports them meanwhile.
    attr: Attr,
    since: Instant,
    /// The write-back sending them is under way: they stay what this node reports until it
    /// is answered.
    sending: bool,
}

/// One file's write-back state.
#[derive(Default)]
struct FileState {
    delegation: Option<Held>,
    /// A recall of the delegation is being served: nothing more is held back.
    recalling: bool,
    /// Not asked again before then (refused, or recalled a moment ago).
    quiet_until: Option<Instant>,
    /// Held-back bytes: non-overlapping, non-adjacent extents by offset.
    dirty: BTreeMap<u64, Vec<u8>>,
    dirty_bytes: u64,
    /// When the oldest held-back byte was written.
    dirty_since: Option<Instant>,
    /// Whom the held-back bytes are written as, and through which open file.
    writer: Option<(Arc<OpenFile>, Credentials)>,
    /// The size this node's held-back writes give the file (until they are written).
    end: u64,
    /// Attribute changes held back after the bytes.
    attrs: Option<HeldAttrs>,
    /// One write-back of this file at a time.
    flusher: Arc<tokio::sync::Mutex<()>>,
    /// Write-backs under way: their bytes are out of `dirty` but not on the LUNs yet, so
    /// I/O that must come after them waits for them ([`Client::write_back_barrier`]).
    flushing: u32,
    /// A write-back was started beside the writer (the file reached its flush limit) and has
    /// not taken the held-back bytes yet: up to twice the limit is held meanwhile.
    flush_started: bool,
    /// Writes of this file (held back or not) in their first step: a delegation asked for.
    asking: bool,
    /// Read cache: whole chunks by index; only the chunk at the end of file may be shorter.
    chunks: BTreeMap<u64, Arc<Vec<u8>>>,
    cached_bytes: u64,
    /// Bumped whenever the cached chunks are dropped: a read that started under an older
    /// value does not keep what it read.
    cache_gen: u64,
    /// Reads without a delegation (one is asked for from the second read on).
    reads: u32,
    /// Where the last read ended (a read from there is sequential: read ahead).
    last_read_end: u64,
    last_use: Option<Instant>,
    /// The read-ahead under way, if any.
    ahead: Option<Ahead>,
    /// Bumped when cached chunks are dropped as stale (not when held-back writes are put
    /// into them), and when a write-back takes held-back bytes: a read-ahead that saw
    /// neither keeps what it read, with the held-back bytes put in ([`Client::read_ahead`]).
    drop_gen: u64,
    flush_gen: u64,
}

/// Copies `data` at file offset `off` into the cached `chunks` it overlaps (whole chunks
/// only: the caller dropped the short one at the end of file).
fn copy_into_chunks(chunks: &mut BTreeMap<u64, Arc<Vec<u8>>>, off: u64, data: &[u8]) {
    if data.is_empty() {
        return;
    }
    let end = off + data.len() as u64;
    for i in off / CHUNK..=(end - 1) / CHUNK {
        if let Some(chunk) = chunks.get_mut(&i) {
            let start = i * CHUNK;
            let (from, to) = (off.max(start), end.min(start + CHUNK));
            let at = |x: u64| usize::try_from(x).unwrap_or(usize::MAX);
            let (dst, src, n) = (at(from - start), at(from - off), at(to - from));
            if let Some(dst) = Arc::make_mut(chunk).get_mut(dst..dst + n) {
                dst.copy_from_slice(&data[src..src + n]);
            }
        }
    }
}

/// The bytes read for the cache, cut into chunks (before the table's lock is taken: a
/// read-ahead's megabytes are not copied under it).
fn chunked(data: &[u8]) -> Vec<Arc<Vec<u8>>> {
    data.chunks(CHUNK as usize)
        .map(|piece| Arc::new(piece.to_vec()))
        .collect()
}

/// Adds a signed change to an agent-wide byte count.
fn add_signed(total: &AtomicU64, delta: i64) {
    if delta >= 0 {
        total.fetch_add(delta.unsigned_abs(), Ordering::Relaxed);
    } else {
        total.fetch_sub(delta.unsigned_abs(), Ordering::Relaxed);
    }
}

/// Whether `f`'s read cache may be used: a delegation of session `generation` is held, with
/// no recall under way.
fn caching(f: &FileState, generation: u64) -> bool {
    !f.recalling && f.delegation.is_some_and(|d| d.generation == generation)
}

/// Whether `f`'s write delegation of session `generation` is held, with no recall under way.
fn delegated(f: &FileState, generation: u64) -> bool {
    !f.recalling
        && f.delegation
            .is_some_and(|d| d.generation == generation && d.write)
}

/// Whether a write of `f` may be held back: its write delegation is held, and no attribute
/// change is held back (a write goes after one: its mtime, the bits it clears; the ordinary
/// path writes the change back first).
fn may_hold_write(f: &FileState, generation: u64) -> bool {
    delegated(f, generation) && f.attrs.is_none()
}

/// How many bytes of one file may be held back before a write waits for a write-back: the
/// configured limit, twice it while a write-back started beside the writer is under way.
fn file_limit(f: &FileState, limit: u64) -> u64 {
    if f.flush_started || f.flushing > 0 {
        limit.saturating_mul(2)
    } else {
        limit
    }
}

/// What a write-back takes out of the table: the extents, and whom they are written as.
type Taken = (BTreeMap<u64, Vec<u8>>, Arc<OpenFile>, Credentials);

/// Ends a write-back's `flushing` mark however its future ends.
struct Flushing<'a>(&'a WriteBack, InodeId);

impl Drop for Flushing<'_> {
    fn drop(&mut self) {
        self.0.flushed(self.1);
    }
}

/// Whether mode `perm` has a bit a `chown` clears ([`cleared_setid`]).
fn privileged(perm: u32) -> bool {
    cleared_setid(perm) != perm
}

/// What the attribute change `c` by `cred` makes of a file whose attributes are `cur`, when
/// the server is sure to accept it and to come to the same: the caller owns the file (by
/// uid: a squashed root does not), owners stay as they are, no setgid bit outside the
/// caller's groups, no bit a `chown` would clear, explicit times only. `None`: send it.
fn held_change(cred: &Credentials, cur: &Attr, c: &SetAttr, now: Timestamp) -> Option<Attr> {
    if cur.kind != FileType::Regular {
        return None;
    }
    answered_change(cred, cur, c, now)
}

/// The attributes after change `c` of an inode whose attributes are `cur`, by `cred`, at
/// `now`, when the server is sure to make it exactly so ([`held_change`]'s rules, for any
/// kind of inode): else `None`.
pub(super) fn answered_change(
    cred: &Credentials,
    cur: &Attr,
    c: &SetAttr,
    now: Timestamp,
) -> Option<Attr> {
    if cred.uid != cur.uid || c.size.is_some() || c.ctime.is_some() {
        return None;
    }
    if c.uid.is_some_and(|u| u != cur.uid) || c.gid.is_some_and(|g| g != cur.gid) {
        return None;
    }
    let chown = c.uid.is_some() || c.gid.is_some();
    let mut next = cur.clone();
    if let Some(p) = c.perm {
        let p = p & 0o7777;
        if (p & S_ISGID != 0 && !cred.in_group(cur.gid)) || (chown && privileged(p)) {
            return None;
        }
        next.perm = p;
    }
    if chown && privileged(cur.perm) {
        return None;
    }
    for (set, field) in [(c.atime, &mut next.atime), (c.mtime, &mut next.mtime)] {
        match set {
            None => {}
            Some(TimeSet::At(t)) => *field = t,
            Some(TimeSet::Now) => return None,
        }
    }
    next.ctime = now.max(cur.ctime);
    Some(next)
}

/// This node's clock as a timestamp (the ctime a held-back change shows until it is sent,
/// the times of a file created here until the server's reply).
pub(super) fn wall_clock() -> Timestamp {
    #[allow(
        clippy::disallowed_methods,
        reason = "the one wall-clock reading of the agent, for a ctime it only shows; \
                  `held_change` takes the time as an argument, which is what its tests set"
    )]
    let d = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    Timestamp {
        sec: i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
        nsec: d.subsec_nanos(),
    }
}

/// The write-back table of one agent.
pub(crate) struct WriteBack {
    config: WriteBackConfig,
    files: Mutex<HashMap<InodeId, FileState>>,
    /// Delegation recalls that came before the delegation's own reply.
    tombstones: Mutex<HashSet<GrantId>>,
    total: AtomicU64,
    /// Bytes in read caches, over all files.
    cached: AtomicU64,
    pub(crate) counters: WriteBackCounters,
    /// The read-ahead's device buffers, reused.
    ra_bufs: crate::buf::Recycler,
}

/// What write-back did (metrics, status).
#[derive(Debug, Default)]
pub(crate) struct WriteBackCounters {
    pub held_writes: AtomicU64,
    pub held_attrs: AtomicU64,
    pub attr_flushes: AtomicU64,
    pub attrs_with_bytes: AtomicU64,
    pub flushes: AtomicU64,
    pub flushed_bytes: AtomicU64,
    pub recalls_flushed: AtomicU64,
    pub delegations: AtomicU64,
    pub refusals: AtomicU64,
    pub reclaimed: AtomicU64,
    pub cache_hits: AtomicU64,
    pub cache_misses: AtomicU64,
    pub read_aheads: AtomicU64,
}

/// How many held-back extents of one file a write-back writes at once.
const WRITE_BACK_PARALLEL: usize = 32;

/// A write-back of at most this many extents and bytes goes through the server, one proxied
/// `Write` per extent, whatever their length: a small file's bytes at its close. Direct, it
/// cost a write layout over fresh blocks (their allocation and zeroing), the device write,
/// its completion, a `Fsync` for the close and the layout's return: 6.2-6.7 ms for a new
/// file of 64 KiB against 1.3-1.5 ms for one of 32 KiB written proxied (the server writes,
/// flushes and commits in one call). Scattered extents (random writes) keep the direct path
/// under one layout, written in parallel.
const PROXIED_WRITE_BACK_EXTENTS: usize = 2;
const PROXIED_WRITE_BACK_BYTES: u64 = 1 << 20;

/// The widest gap between two held-back extents that one write layout spans. A layout
/// allocates what it covers (holes too, as Unwritten blocks inside the file), so a layout
/// over sparse writes to a sparse file would take space the writes never use: at most this
/// much per extent, and see [`WRITE_BACK_MIN_DENSITY`].
const WRITE_BACK_MAX_GAP: u64 = 1 << 20;

/// A write-back takes a layout over a window only where the held-back bytes are at least
/// 1/this of the window's span (a sparse file's holes in it take at most this many times
/// the bytes written).
const WRITE_BACK_MIN_DENSITY: u64 = 16;

/// Held-back extents (sorted by offset, disjoint) cut into windows that one write layout can
/// cover: each window spans at most `max_span` bytes from its first extent's start to its
/// last one's end (an extent longer than that is a window of its own), with gaps of at most
/// [`WRITE_BACK_MAX_GAP`] between its extents.
fn write_back_windows(extents: Vec<(u64, Vec<u8>)>, max_span: u64) -> Vec<Vec<(u64, Vec<u8>)>> {
    let mut windows: Vec<Vec<(u64, Vec<u8>)>> = Vec::new();
    let (mut start, mut last_end) = (0u64, 0u64);
    for (off, data) in extents {
        let end = off + data.len() as u64;
        match windows.last_mut() {
            Some(w) if end - start <= max_span && off - last_end <= WRITE_BACK_MAX_GAP => {
                w.push((off, data));
            }
            _ => {
                start = off;
                windows.push(vec![(off, data)]);
            }
        }
        last_end = end;
    }
    windows
}

/// The span a write-back window's layout covers: from its first extent's start to its last
/// one's end, where the window has two extents or more and held-back bytes at least
/// 1/[`WRITE_BACK_MIN_DENSITY`] of the span; else `None` (its extents go their usual way).
fn layout_span(window: &[(u64, Vec<u8>)]) -> Option<ByteRange> {
    let (first, last) = (window.first()?, window.last()?);
    let span = ByteRange::new(first.0, last.0 + last.1.len() as u64 - first.0).ok()?;
    let bytes: u64 = window.iter().map(|(_, d)| d.len() as u64).sum();
    (window.len() >= 2 && bytes.saturating_mul(WRITE_BACK_MIN_DENSITY) >= span.len())
        .then_some(span)
}

/// Puts `data` at `off` into `map`; returns how many bytes the map grew by.
fn insert(map: &mut BTreeMap<u64, Vec<u8>>, off: u64, data: &[u8]) -> u64 {
    let end = off + data.len() as u64;
    // The extents that overlap or touch [off, end): starts <= end, ends >= off.
    let touching: Vec<u64> = map
        .range(..=end)
        .rev()
        .take_while(|(s, v)| **s + v.len() as u64 >= off)
        .map(|(s, _)| *s)
        .collect();
    // Common cases in place: inside or extending one extent that starts at or before `off`.
    if let [start] = touching[..]
        && start <= off
        && let Some(v) = map.get_mut(&start)
    {
        let at = usize::try_from(off - start).unwrap_or(usize::MAX);
        let before = v.len() as u64;
        let keep = v.len().min(at + data.len());
        if at + data.len() <= v.len() {
            v[at..keep].copy_from_slice(data);
        } else {
            v.truncate(at);
            v.extend_from_slice(data);
        }
        return v.len() as u64 - before;
    }
    let first = touching.last().copied().unwrap_or(off).min(off);
    let mut last_end = end;
    let mut old_bytes = 0u64;
    let mut merged = Vec::new();
    for start in touching.iter().rev() {
        if let Some(v) = map.remove(start) {
            old_bytes += v.len() as u64;
            last_end = last_end.max(start + v.len() as u64);
            let at = usize::try_from(start - first).unwrap_or(usize::MAX);
            if merged.len() < at + v.len() {
                merged.resize(at + v.len(), 0);
            }
            merged[at..at + v.len()].copy_from_slice(&v);
        }
    }
    let len = usize::try_from(last_end - first).unwrap_or(usize::MAX);
    merged.resize(len, 0);
    let at = usize::try_from(off - first).unwrap_or(usize::MAX);
    merged[at..at + data.len()].copy_from_slice(data);
    let grew = merged.len() as u64 - old_bytes;
    map.insert(first, merged);
    grew
}

impl FileState {
    /// Whether bytes or attribute changes of the file are held back here.
    fn holds_back(&self) -> bool {
        self.dirty_bytes > 0 || self.attrs.is_some()
    }

    /// Drops every cached chunk; returns the bytes freed.
    fn drop_cache(&mut self) -> u64 {
        self.chunks.clear();
        self.cache_gen += 1;
        self.drop_gen += 1;
        std::mem::take(&mut self.cached_bytes)
    }

    /// Drops the chunks `[off, off + len)` touches and the chunk at the end of file (a write
    /// there may move the end); returns the bytes freed.
    fn drop_range(&mut self, off: u64, len: u64) -> u64 {
        let (first, last) = (off / CHUNK, (off + len.max(1) - 1) / CHUNK);
        let doomed: Vec<u64> = self
            .chunks
            .iter()
            .filter(|(i, c)| (first..=last).contains(*i) || (c.len() as u64) < CHUNK)
            .map(|(i, _)| *i)
            .collect();
        let mut freed = 0;
        for i in doomed {
            if let Some(c) = self.chunks.remove(&i) {
                freed += c.len() as u64;
            }
        }
        self.cache_gen += 1;
        self.drop_gen += 1;
        self.cached_bytes = self.cached_bytes.saturating_sub(freed);
        freed
    }

    /// Puts a held-back write into the cached chunks it lies in, so that they keep holding
    /// what the file holds (a read they answer needs no write-back first); the chunk at the
    /// end of file goes (the write may move the end). A read of chunks under way does not
    /// keep what it read (it may have read the LUNs before this write). Returns the bytes
    /// freed.
    fn patch_cache(&mut self, off: u64, data: &[u8]) -> u64 {
        self.cache_gen += 1;
        if self.chunks.is_empty() || data.is_empty() {
            return 0;
        }
        let freed = self.drop_short_chunks();
        copy_into_chunks(&mut self.chunks, off, data);
        freed
    }

    /// Drops the chunk at the end of file (shorter than a chunk, or empty): a write may move
    /// the end. Returns the bytes freed.
    fn drop_short_chunks(&mut self) -> u64 {
        let short: Vec<u64> = self
            .chunks
            .iter()
            .filter(|(_, c)| (c.len() as u64) < CHUNK)
            .map(|(i, _)| *i)
            .collect();
        let mut freed = 0;
        for i in short {
            if let Some(c) = self.chunks.remove(&i) {
                freed += c.len() as u64;
            }
        }
        self.cached_bytes = self.cached_bytes.saturating_sub(freed);
        freed
    }

    /// Puts the held-back bytes of `[start, end)` into the cached chunks they lie in (what a
    /// read-ahead read from the LUNs lacks them); with bytes held back, the chunk at the end
    /// of file goes, as in [`FileState::patch_cache`]. Returns the bytes freed.
    fn put_held(&mut self, start: u64, end: u64) -> u64 {
        if self.dirty.is_empty() {
            return 0;
        }
        let freed = self.drop_short_chunks();
        let from = self
            .dirty
            .range(..start)
            .next_back()
            .map_or(start, |(off, _)| *off);
        for (off, data) in self.dirty.range(from..end) {
            copy_into_chunks(&mut self.chunks, *off, data);
        }
        freed
    }

    /// Holds back `data` at `offset`, written as `cred` through `file` (and puts it in the
    /// cached chunks); returns by how many bytes the held-back set grew and how many cached
    /// bytes went ([`WriteBack::hold`] counts both in the agent's totals).
    fn hold(
        &mut self,
        file: &Arc<OpenFile>,
        cred: &Credentials,
        offset: u64,
        data: &[u8],
    ) -> (u64, u64) {
        let freed = self.patch_cache(offset, data);
        // Attribute changes held from before: the server applies them after these bytes, and
        // a writer other than root clears setuid and setgid (`cleared_setid`) after them.
        if !cred.is_root()
            && let Some(h) = &mut self.attrs
        {
            h.attr.perm = cleared_setid(h.attr.perm);
            if let Some(p) = h.changes.perm.as_mut() {
                *p = cleared_setid(*p);
            }
        }
        let grew = insert(&mut self.dirty, offset, data);
        self.dirty_bytes += grew;
        self.dirty_since.get_or_insert_with(Instant::now);
        if self
            .writer
            .as_ref()
            .is_none_or(|(w, c)| !Arc::ptr_eq(w, file) || c != cred)
        {
            self.writer = Some((file.clone(), cred.clone()));
        }
        self.end = self.end.max(offset + data.len() as u64);
        (grew, freed)
    }

    /// After a sequential read of `len` bytes ending at `end`: the read-ahead now due (the
    /// chunks missing in the window ahead of the reader), marked as under way. `None` while
    /// one is under way, while a write-back is (its bytes may or may not be on the LUNs when
    /// they are read), when the end of file is cached, or when at least half the window ahead
    /// is cached. (Held-back bytes are put into the chunks when they are kept.)
    fn read_ahead_due(&mut self, ino: InodeId, end: u64, len: u64) -> Option<ReadAhead> {
        if len < READ_AHEAD_BACKGROUND
            || self.ahead.as_ref().is_some_and(Ahead::running)
            || self.flushing > 0
        {
            return None;
        }
        let window = len
            .saturating_mul(READ_AHEAD_READS)
            .clamp(READ_AHEAD_MIN, READ_AHEAD_MAX);
        let mut first = end / CHUNK;
        while let Some(c) = self.chunks.get(&first) {
            if (c.len() as u64) < CHUNK {
                return None;
            }
            first += 1;
        }
        if first * CHUNK >= end + window / 2 {
            return None;
        }
        let last = (end + window).div_ceil(CHUNK).max(first + 1);
        let (tx, rx) = tokio::sync::watch::channel(());
        self.ahead = Some(Ahead {
            first,
            end: last,
            done: rx,
        });
        Some(ReadAhead {
            ino,
            first,
            count: last - first,
            drop_gen: self.drop_gen,
            flush_gen: self.flush_gen,
            _done: tx,
        })
    }

    /// A read of `len` bytes at `offset` got `n` from the cache or the LUNs: where the
    /// reader is now, and the read-ahead due if it reads sequentially.
    fn read_done(&mut self, ino: InodeId, offset: u64, n: usize, len: u64) -> Option<ReadAhead> {
        let sequential = offset == self.last_read_end;
        self.last_read_end = offset + n as u64;
        sequential
            .then(|| self.read_ahead_due(ino, self.last_read_end, len))
            .flatten()
    }

    /// The read-ahead under way that covers chunks `[first, last]`: what to wait for.
    fn ahead_covering(&self, first: u64, last: u64) -> Option<tokio::sync::watch::Receiver<()>> {
        self.ahead
            .as_ref()
            .filter(|a| a.running() && a.first <= first && last < a.end)
            .map(|a| a.done.clone())
    }

    /// Keeps the chunks read from chunk `first` on (`pieces`, from [`chunked`]: the bytes
    /// read, of `span` asked; fewer at the end of file); returns the bytes it added to the
    /// cache.
    fn keep_chunks(&mut self, first: u64, pieces: Vec<Arc<Vec<u8>>>, span: u64) -> i64 {
        let mut added = 0i64;
        let mut n = 0u64;
        for (k, piece) in pieces.into_iter().enumerate() {
            n += piece.len() as u64;
            added += piece.len() as i64;
            let old = self.chunks.insert(first + k as u64, piece);
            added -= old.map_or(0, |o| o.len() as i64);
        }
        if n < span && n.is_multiple_of(CHUNK) {
            // The end of file on a chunk boundary: an empty chunk there answers reads past
            // it (a shorter last chunk does that otherwise).
            if let Some(old) = self.chunks.insert(first + n / CHUNK, Arc::new(Vec::new())) {
                added -= old.len() as i64;
            }
        }
        self.cached_bytes = self.cached_bytes.saturating_add_signed(added);
        added
    }

    /// Copies `[off, off + buf.len())` from the cached chunks: `Some(n)` when every byte is
    /// there or the end of file comes first (n bytes), `None` when a chunk is missing.
    fn serve(&self, off: u64, buf: &mut [u8]) -> Option<usize> {
        self.serve_with(off, buf.len(), |at, piece| {
            buf[at..at + piece.len()].copy_from_slice(piece);
        })
    }

    /// [`FileState::serve`] of at most `len` bytes, each cached piece handed to `put` with
    /// its place in the read, in order (a caller may append them to a buffer it did not
    /// have to zero first).
    fn serve_with(&self, off: u64, len: usize, mut put: impl FnMut(usize, &[u8])) -> Option<usize> {
        let mut done = 0usize;
        while done < len {
            let pos = off + done as u64;
            let chunk = self.chunks.get(&(pos / CHUNK))?;
            let at = usize::try_from(pos % CHUNK).ok()?;
            if at >= chunk.len() {
                // The chunk ends the file before `pos`.
                return Some(done);
            }
            let n = (chunk.len() - at).min(len - done);
            put(done, &chunk[at..at + n]);
            done += n;
            if (chunk.len() as u64) < CHUNK && at + n == chunk.len() {
                return Some(done);
            }
        }
        Some(done)
    }
}

impl WriteBack {
    pub(crate) fn new(config: WriteBackConfig) -> WriteBack {
        WriteBack {
            config,
            files: Mutex::new(HashMap::new()),
            tombstones: Mutex::new(HashSet::new()),
            total: AtomicU64::new(0),
            cached: AtomicU64::new(0),
            counters: WriteBackCounters::default(),
            ra_bufs: crate::buf::Recycler::default(),
        }
    }

    /// [`FileState::hold`] of file `f`, counted in the agent's held-back and cached totals;
    /// returns the agent's held-back bytes now.
    fn hold(
        &self,
        f: &mut FileState,
        (file, cred): (&Arc<OpenFile>, &Credentials),
        offset: u64,
        data: &[u8],
    ) -> u64 {
        let (grew, freed) = f.hold(file, cred, offset, data);
        self.cached.fetch_sub(freed, Ordering::Relaxed);
        self.total.fetch_add(grew, Ordering::Relaxed) + grew
    }

    /// After a hold that left the agent with `total` held-back bytes: `(the file's, total,
    /// whether a write-back starts beside the writer)`. At the file's limit one starts, once.
    fn limits_after_hold(&self, f: &mut FileState, total: u64) -> (u64, u64, bool) {
        let limit = self.config.file_bytes;
        let start = f.dirty_bytes >= limit
            && f.dirty_bytes < limit.saturating_mul(2)
            && total < self.config.total_bytes
            && !f.flush_started;
        f.flush_started |= start;
        (f.dirty_bytes, total, start)
    }

    /// A create answered here (`ino`, under session generation `generation`) asks for the
    /// new file's write delegation with it: its writes and attribute changes are held back
    /// from now on, as under the delegation itself. Sound because no other session can
    /// reach the file before the create reaches the server (the directory's create
    /// delegation), and the server gives the delegation with the create; its reply names it
    /// ([`WriteBack::created_answered`]). A recall that comes first is served as the
    /// recall of this one (`mark_recalled`), its write-back after the reply.
    pub(crate) fn expect_created(&self, ino: InodeId, generation: u64) {
        self.files().entry(ino).or_default().delegation = Some(Held {
            id: ASKED,
            generation,
            write: true,
        });
    }

    /// The reply of a create answered here that asked for the write delegation
    /// ([`WriteBack::expect_created`]): the delegation it gave (`None`: refused, or the
    /// create is lost). Answers whether bytes or attribute changes are held back without a
    /// delegation now, to be written back at once ([`Client::write_back_undelegated`]).
    pub(crate) fn created_answered(&self, ino: InodeId, id: Option<GrantId>) -> bool {
        let mut files = self.files();
        let Some(f) = files.get_mut(&ino) else {
            return false;
        };
        let Some(asked) = f.delegation.filter(|d| d.id == ASKED) else {
            return false;
        };
        match id {
            // A recall being served already ends it by this id.
            Some(id) => {
                f.delegation = Some(Held { id, ..asked });
                bump(&self.counters.delegations);
                false
            }
            None => {
                f.delegation = None;
                bump(&self.counters.refusals);
                f.holds_back()
            }
        }
    }

    fn files(&self) -> MutexGuard<'_, HashMap<InodeId, FileState>> {
        self.files.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn tombstones(&self) -> MutexGuard<'_, HashSet<GrantId>> {
        self.tombstones.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn enabled(&self) -> bool {
        self.config.total_bytes > 0
    }

    /// Held-back bytes now, over all files.
    pub(crate) fn dirty_bytes(&self) -> u64 {
        self.total.load(Ordering::Relaxed)
    }

    /// Whether `ino` has held-back bytes or attribute changes.
    pub(crate) fn has_dirty(&self, ino: InodeId) -> bool {
        self.files().get(&ino).is_some_and(FileState::holds_back)
    }

    /// Whether `ino` has attribute changes held back (or being sent).
    pub(crate) fn has_held_attrs(&self, ino: InodeId) -> bool {
        self.files().get(&ino).is_some_and(|f| f.attrs.is_some())
    }

    /// The files with held-back bytes older than the age limit, or held under a
    /// delegation of an older session (a server restart).
    fn due(&self, generation: u64) -> Vec<InodeId> {
        let now = Instant::now();
        self.files()
            .iter()
            .filter(|(_, f)| f.dirty_bytes > 0 || f.attrs.as_ref().is_some_and(|h| !h.sending))
            .filter(|(_, f)| {
                let old = |t: Instant| now.duration_since(t) >= self.config.max_age;
                f.dirty_since.is_some_and(old)
                    || f.attrs.as_ref().is_some_and(|h| old(h.since))
                    || f.delegation.is_none_or(|d| d.generation != generation)
            })
            .map(|(ino, _)| *ino)
            .collect()
    }

    /// Takes every held-back extent of `ino` out (a write-back is about to write them).
    fn take(&self, ino: InodeId) -> Option<Taken> {
        let mut files = self.files();
        let f = files.get_mut(&ino)?;
        if f.dirty.is_empty() {
            f.flush_started = false;
            return None;
        }
        let (file, cred) = f.writer.clone()?;
        let dirty = std::mem::take(&mut f.dirty);
        self.total.fetch_sub(f.dirty_bytes, Ordering::Relaxed);
        f.dirty_bytes = 0;
        f.dirty_since = None;
        f.flushing += 1;
        f.flush_gen += 1;
        f.flush_started = false;
        Some((dirty, file, cred))
    }

    /// Takes the attribute changes of `ino` held back for sending (they stay what this node
    /// reports until [`WriteBack::attrs_sent`]): whom as, and the `SetAttr` to send.
    fn take_attrs(&self, ino: InodeId) -> Option<(Credentials, SetAttr)> {
        let mut files = self.files();
        let f = files.get_mut(&ino)?;
        let h = f.attrs.as_mut().filter(|h| !h.sending)?;
        h.sending = true;
        let mut changes = h.changes.clone();
        if h.chown && changes == SetAttr::default() {
            // Alone, the chown is sent as it was made (the owners the file has: it clears no
            // bit, the file had none it would).
            changes.uid = Some(h.attr.uid);
            changes.gid = Some(h.attr.gid);
        }
        let cred = h.cred.clone();
        f.flushing += 1;
        Some((cred, changes))
    }

    /// The held attribute changes [`WriteBack::take_attrs`] took were answered (or failed):
    /// the server answers for them now.
    fn attrs_sent(&self, ino: InodeId) {
        if let Some(f) = self.files().get_mut(&ino)
            && f.attrs.as_ref().is_some_and(|h| h.sending)
        {
            f.attrs = None;
        }
    }

    /// A write-back of `ino` that [`WriteBack::take`] began is over (done, failed or
    /// dropped).
    fn flushed(&self, ino: InodeId) {
        if let Some(f) = self.files().get_mut(&ino) {
            f.flushing = f.flushing.saturating_sub(1);
        }
    }

    /// Whether `ino` has bytes held back on this node or on their way to the LUNs.
    pub(crate) fn unsettled(&self, ino: InodeId) -> bool {
        self.files()
            .get(&ino)
            .is_some_and(|f| f.dirty_bytes > 0 || f.flushing > 0 || f.attrs.is_some())
    }

    /// Whether bytes of `[off, end)` may be held back on this node: a held-back extent
    /// overlaps it, or a write-back is under way (its extents are not known here).
    fn unsettled_over(&self, ino: InodeId, off: u64, end: u64) -> bool {
        self.files().get(&ino).is_some_and(|f| {
            f.flushing > 0
                || f.dirty
                    .range(..end)
                    .next_back()
                    .is_some_and(|(s, v)| s + v.len() as u64 > off)
        })
    }

    fn flusher(&self, ino: InodeId) -> Arc<tokio::sync::Mutex<()>> {
        self.files().entry(ino).or_default().flusher.clone()
    }

    /// Notes a delegation recall; returns whether this agent knew the delegation (else it
    /// is remembered, so that its reply, when it comes, is not used).
    fn mark_recalled(&self, ino: InodeId, ids: &[GrantId]) -> bool {
        let mut files = self.files();
        // One asked for with a create answered here is the one recalled, whose id its
        // reply brings: its recall writes back after that reply (the write-back waits for
        // the creates answered here).
        if let Some(f) = files.get_mut(&ino)
            && f.delegation.is_some_and(|d| d.recalled_by(ids))
        {
            f.recalling = true;
            return true;
        }
        // Still holding the table: a delegation whose reply is being taken in is either
        // set already (above) or finds its tombstone when it is set (`adopt`).
        let mut t = self.tombstones();
        if t.len() >= MAX_TOMBSTONES {
            t.clear();
        }
        t.extend(ids.iter().copied());
        false
    }

    /// The recall of `ids` is served: the delegation is gone; not asked for again for a
    /// moment (the other node is using the file). A delegation the file holds now that is
    /// not one of `ids` stays (reclaimed from a restarted server while the old server's
    /// recall was being served: [`WriteBack::adopt_reclaimed`]).
    fn recalled(&self, ino: InodeId, ids: &[GrantId]) {
        if let Some(f) = self.files().get_mut(&ino)
            && f.delegation.is_none_or(|d| d.recalled_by(ids))
        {
            let freed = f.drop_cache();
            self.cached.fetch_sub(freed, Ordering::Relaxed);
            f.delegation = None;
            f.recalling = false;
            f.quiet_until = Some(Instant::now() + REFUSAL_BACKOFF);
        }
    }

    /// The files whose write delegation a restarted server must give back in its reclaim
    /// window: those with writes or attribute changes held back, or a write-back of them
    /// under way (its bytes are on their way to the server, not on the LUNs yet). Another
    /// node's first calls after the window then recall the delegation, as before the stop,
    /// and see every byte (docs/protocol.md "Delegations").
    pub(crate) fn to_reclaim(&self) -> Vec<InodeId> {
        self.files()
            .iter()
            .filter(|(_, f)| f.holds_back() || f.flushing > 0)
            .map(|(ino, _)| *ino)
            .collect()
    }

    /// Takes in the write delegations the restarted server gave back ([`WriteBack::to_reclaim`])
    /// under session generation `generation`: held as before the stop, so what is held back
    /// stays held until the usual write-back, and a recall of the old server that was being
    /// served no longer stops new writes from being held.
    pub(crate) fn adopt_reclaimed(&self, reclaimed: &[(InodeId, GrantId)], generation: u64) {
        let mut files = self.files();
        for (ino, id) in reclaimed {
            let f = files.entry(*ino).or_default();
            f.delegation = Some(Held {
                id: *id,
                generation,
                write: true,
            });
            f.recalling = false;
            f.quiet_until = None;
            bump(&self.counters.reclaimed);
        }
    }

    /// This agent's session, when it holds a current write delegation on `ino` (its own
    /// GetAttr then does not recall it).
    pub(crate) fn holder_session(
        &self,
        ino: InodeId,
        view: &super::SessionView,
    ) -> Option<sanfs_proto::types::SessionId> {
        self.files()
            .get(&ino)
            .and_then(|f| f.delegation)
            .filter(|d| d.generation == view.generation)
            .map(|_| view.session)
    }

    /// Takes in a delegation that was just given, under the table's lock: one recalled
    /// before this (its tombstone is there: the recall was acknowledged at once) is not
    /// ours any more. Returns whether `f` holds it now.
    fn adopt(&self, f: &mut FileState, held: Held) -> bool {
        if self.tombstones().remove(&held.id) {
            return false;
        }
        f.delegation = Some(held);
        true
    }

    /// The file's last handle here closed: the server dropped its delegation with it.
    pub(crate) fn forget(&self, ino: InodeId) {
        tracing::debug!(%ino, "the file's last handle here closed: its delegation is gone");
        let mut files = self.files();
        if let Some(f) = files.get_mut(&ino) {
            let freed = f.drop_cache();
            self.cached.fetch_sub(freed, Ordering::Relaxed);
        }
        if let Some(f) = files.get(&ino)
            && f.dirty_bytes == 0
            && f.attrs.is_none()
            && !f.asking
            && Arc::strong_count(&f.flusher) == 1
        {
            files.remove(&ino);
        } else if let Some(f) = files.get_mut(&ino) {
            f.delegation = None;
        }
    }

    /// A write-back ended: with nothing held back any more, the server answers for the
    /// size and mtime again.
    fn written_out(&self, ino: InodeId) {
        if let Some(f) = self.files().get_mut(&ino)
            && f.dirty.is_empty()
        {
            f.end = 0;
        }
    }

    /// This node wrote `[off, off + len)` of `ino` (through, not held back): cached chunks
    /// there are stale.
    pub(crate) fn wrote(&self, ino: InodeId, off: u64, len: u64) {
        // Also with nothing cached: a read of the LUNs under way must not keep what it read.
        if let Some(f) = self.files().get_mut(&ino) {
            let freed = f.drop_range(off, len);
            self.cached.fetch_sub(freed, Ordering::Relaxed);
        }
    }

    /// Every cached chunk of `ino` is stale (a truncate, a fallocate, an append).
    pub(crate) fn drop_cache(&self, ino: InodeId) {
        if let Some(f) = self.files().get_mut(&ino) {
            let freed = f.drop_cache();
            self.cached.fetch_sub(freed, Ordering::Relaxed);
        }
    }

    /// Over the read cache's size: the files used longest ago lose their chunks.
    fn trim_cache(&self) {
        let limit = self.config.read_cache_bytes;
        if self.cached.load(Ordering::Relaxed) <= limit {
            return;
        }
        let mut files = self.files();
        let mut by_age: Vec<(Option<Instant>, InodeId)> = files
            .iter()
            .filter(|(_, f)| !f.chunks.is_empty())
            .map(|(ino, f)| (f.last_use, *ino))
            .collect();
        by_age.sort();
        for (_, ino) in by_age {
            if self.cached.load(Ordering::Relaxed) <= limit / 2 {
                break;
            }
            if let Some(f) = files.get_mut(&ino) {
                let freed = f.drop_cache();
                self.cached.fetch_sub(freed, Ordering::Relaxed);
            }
        }
    }

    /// The size this node's writes gave `ino`; reset by a truncate.
    fn reset_end(&self, ino: InodeId) {
        if let Some(f) = self.files().get_mut(&ino) {
            f.end = 0;
        }
    }
}

impl Client {
    /// A buffered write held back under the file's write delegation (asked for here when
    /// there is none). `None`: not held back (write-back off, the write is long, the
    /// delegation refused or being recalled): the caller writes it through. The file's
    /// write-back may run before this returns (it crossed a limit).
    pub async fn write_back(
        &self,
        cred: &Credentials,
        file: &Arc<OpenFile>,
        offset: u64,
        data: &[u8],
    ) -> Result<Option<WriteOutcome>, FsError> {
        let wb = &self.inner.writeback;
        let len = data.len() as u64;
        if !wb.enabled() || len == 0 || len >= wb.config.max_write {
            return Ok(None);
        }
        let ino = file.ino();
        if !self.held_write_delegation(file).await {
            return Ok(None);
        }
        let generation = self.inner.lock_state().view.generation;
        let (file_dirty, total, started) = {
            let mut files = wb.files();
            let f = files.entry(ino).or_default();
            // Checked again under the lock: a recall may have come meanwhile.
            if !may_hold_write(f, generation) {
                return Ok(None);
            }
            let total = wb.hold(f, (file, cred), offset, data);
            wb.limits_after_hold(f, total)
        };
        bump(&wb.counters.held_writes);
        self.after_hold(ino, file_dirty, total, started).await;
        Ok(Some(WriteOutcome {
            written: len,
            attr: None,
        }))
    }

    /// Whether this session holds `file`'s write delegation, asked for here when there is
    /// none (and no refusal is fresh) and taken when granted.
    async fn held_write_delegation(&self, file: &Arc<OpenFile>) -> bool {
        let wb = &self.inner.writeback;
        let ino = file.ino();
        let generation = self.inner.lock_state().view.generation;
        let want = {
            let mut files = wb.files();
            let f = files.entry(ino).or_default();
            if f.recalling || f.asking {
                return false;
            }
            match f.delegation {
                Some(d) if d.generation == generation && d.write => false,
                _ => {
                    if f.quiet_until.is_some_and(|t| Instant::now() < t) {
                        return false;
                    }
                    f.delegation = None;
                    f.asking = true;
                    true
                }
            }
        };
        if want {
            let got = self.ask_delegation(&file.current(), ino, true).await;
            let mut files = wb.files();
            let f = files.entry(ino).or_default();
            f.asking = false;
            let taken = match got {
                Some(held) => wb.adopt(f, held),
                None => false,
            };
            if !taken {
                f.quiet_until = Some(Instant::now() + REFUSAL_BACKOFF);
                return false;
            }
        }
        true
    }

    /// After a hold that left the file with `file_dirty` held-back bytes and the agent with
    /// `total`: the write-back that `started` runs beside the writer; past twice the file's
    /// limit or the agent's, the writer waits for one.
    async fn after_hold(&self, ino: InodeId, file_dirty: u64, total: u64, started: bool) {
        let config = &self.inner.writeback.config;
        if started {
            let client = Client::borrowed(Arc::clone(&self.inner));
            tokio::spawn(async move {
                // A failure is the file's next write's, fsync's or close's error.
                let _ = client.flush_file(ino).await;
            });
        } else if file_dirty >= config.file_bytes.saturating_mul(2) || total >= config.total_bytes {
            // A failure is the file's next write's, fsync's or close's error.
            let _ = self.flush_file(ino).await;
        }
    }

    /// A buffered write too long to hold back ([`WriteBackConfig::max_write`]) whose first or
    /// last block is partial, under the file's write delegation: its whole blocks are written
    /// through (directly, from `buf` itself when the write starts on a block) and the partial
    /// blocks at its edges are held back where a cached write layout has allocated them
    /// (written through otherwise), to be written with what comes next to them. A
    /// writer whose buffer is not page aligned has each large write split by the kernel into
    /// a long piece and a short one (a piece holds at most 256 pages): before, each edge was a
    /// proxied write. Otherwise (no delegation, no edges, a middle too short to go direct),
    /// [`Client::write_at_buf`].
    pub async fn write_buffered_buf(
        &self,
        cred: &Credentials,
        file: &Arc<OpenFile>,
        fh: &FileHandle,
        offset: u64,
        buf: &mut AlignedBuf,
    ) -> Result<WriteOutcome, FsError> {
        let ino = file.ino();
        let len = buf.len() as u64;
        let end = offset + len;
        let wb = &self.inner.writeback;
        let (block, threshold) = {
            let state = self.inner.lock_state();
            (
                u64::from(state.view.server.block_size).max(1),
                self.inner.threshold(&state.view),
            )
        };
        let head_end = offset.next_multiple_of(block);
        let tail_start = end / block * block;
        let edges = head_end != offset || tail_start != end;
        if !wb.enabled()
            || len < wb.config.max_write
            || !edges
            || tail_start <= head_end
            || tail_start - head_end < threshold
            || !self.held_write_delegation(file).await
        {
            return self.write_at_buf(cred, fh, ino, offset, buf).await;
        }
        // Held-back bytes inside the write go first (the write is newer); others stay.
        // Held-back attribute changes go first too (the write's mtime is after them).
        if wb.unsettled_over(ino, offset, end) || wb.has_held_attrs(ino) {
            let _ = self.flush_file(ino).await;
        }
        let at = |pos: u64| usize::try_from(pos - offset).unwrap_or(usize::MAX);
        let head = buf.as_slice()[..at(head_end)].to_vec();
        let tail = buf.as_slice()[at(tail_start)..].to_vec();
        let outcome = if head.is_empty() {
            // The middle starts the buffer: written from it, shortened to the middle (and
            // whole again after, for a retry; a buffer the engine lost stays short).
            buf.set_len(at(tail_start));
            let written = self.write_through_buf(cred, fh, ino, head_end, buf).await;
            buf.set_len(usize::try_from(len).unwrap_or(usize::MAX));
            written?
        } else {
            let mut middle = {
                let mut copy = Span::cpu(Stage::Copy);
                copy.set_bytes(tail_start - head_end);
                AlignedBuf::from_slice(&buf.as_slice()[at(head_end)..at(tail_start)])
            };
            self.write_through_buf(cred, fh, ino, head_end, &mut middle)
                .await?
        };
        let generation = self.inner.lock_state().view.generation;
        // An edge is held back only on blocks a cached write layout has allocated already
        // (the writer's layout ahead): there its write-back cannot fail for want of space
        // or quota, which a long write reports itself (ENOSPC, EDQUOT), not its close.
        let (mut hold, mut through) = (Vec::new(), Vec::new());
        for (off, data) in [(offset, head), (tail_start, tail)] {
            if data.is_empty() {
                continue;
            }
            let blocks = ByteRange::new(off / block * block, block)?;
            if self.inner.cache.covers_write(ino, blocks, generation) {
                hold.push((off, data));
            } else {
                through.push((off, data));
            }
        }
        let held = (!hold.is_empty())
            .then(|| {
                let mut files = wb.files();
                let f = files.entry(ino).or_default();
                // A recall may have come while the middle was written: then the edges go now.
                may_hold_write(f, generation).then(|| {
                    let mut total = 0;
                    for (off, data) in &hold {
                        total = wb.hold(f, (file, cred), *off, data);
                    }
                    wb.limits_after_hold(f, total)
                })
            })
            .flatten();
        match held {
            Some((file_dirty, total, started)) => {
                bump(&wb.counters.held_writes);
                self.after_hold(ino, file_dirty, total, started).await;
            }
            None => through.append(&mut hold),
        }
        for (off, data) in through {
            self.write_through(cred, fh, ino, off, &data, Through::default())
                .await?;
        }
        Ok(WriteOutcome {
            written: len,
            attr: outcome.attr,
        })
    }

    /// [`Client::write_back`] of a write that needs no waiting: the file's write delegation
    /// is held (this session's, no recall under way) and the file's and the agent's held-back
    /// bytes stay under their flush limits with it. Runs on the caller's thread (FUSE's own,
    /// without a task); `None` leaves the write to [`Client::write_back`].
    pub fn try_write_back_now(
        &self,
        cred: &Credentials,
        file: &Arc<OpenFile>,
        offset: u64,
        data: &[u8],
    ) -> Option<WriteOutcome> {
        let wb = &self.inner.writeback;
        let len = data.len() as u64;
        if !wb.enabled() || len == 0 || len >= wb.config.max_write {
            return None;
        }
        let ino = file.ino();
        let generation = self.inner.lock_state().view.generation;
        {
            let mut files = wb.files();
            let f = files.get_mut(&ino)?;
            if f.asking
                || !may_hold_write(f, generation)
                || f.dirty_bytes + len >= file_limit(f, wb.config.file_bytes)
                || wb.total.load(Ordering::Relaxed) + len >= wb.config.total_bytes
            {
                return None;
            }
            wb.hold(f, (file, cred), offset, data);
        }
        bump(&wb.counters.held_writes);
        Some(WriteOutcome {
            written: len,
            attr: None,
        })
    }

    /// [`Client::read_cached`] of a read the cache answers at once: nothing held back, the
    /// delegation held (this session's, no recall under way), the bytes in cached chunks.
    /// Runs on the caller's thread; `None` leaves the read to [`Client::read_cached`].
    /// The buffer (`size` bytes at most, fewer at end of file) is made only once the file
    /// qualifies, so a read the cache cannot answer costs no allocation here.
    pub fn try_read_cached_now(
        &self,
        ino: InodeId,
        offset: u64,
        size: usize,
    ) -> Option<(Vec<u8>, Option<ReadAhead>)> {
        let wb = &self.inner.writeback;
        if wb.config.read_cache_bytes == 0 || size == 0 {
            return None;
        }
        let generation = self.inner.lock_state().view.generation;
        let mut files = wb.files();
        let f = files.get_mut(&ino)?;
        // Held-back writes are in the cached chunks (`FileState::patch_cache`): what they
        // answer is the file's content, written back or not.
        if !caching(f, generation) {
            return None;
        }
        let mut copy = Span::cpu(Stage::Copy);
        // Filled by appending: no zeroing of up to 1 MiB first.
        let mut buf = Vec::with_capacity(size);
        let n = f.serve_with(offset, size, |_, piece| buf.extend_from_slice(piece))?;
        copy.set_bytes(n as u64);
        drop(copy);
        f.last_use = Some(Instant::now());
        bump(&wb.counters.cache_hits);
        let next = f.read_done(ino, offset, n, size as u64);
        Some((buf, next))
    }

    /// A read through the mount's read cache: served from the file's cached chunks while
    /// this node holds a delegation on it (asked for from the file's second read on), else
    /// read (with read-ahead for a sequential reader) and kept. Without a delegation, or with
    /// the cache off, a plain [`Client::read_into`].
    pub async fn read_cached(
        &self,
        cred: &Credentials,
        fh: &FileHandle,
        ino: InodeId,
        offset: u64,
        buf: &mut [u8],
    ) -> Result<usize, FsError> {
        let wb = &self.inner.writeback;
        if wb.config.read_cache_bytes == 0 || buf.is_empty() {
            return self.read_into(cred, fh, ino, offset, buf).await;
        }
        // The cached chunks hold this node's held-back writes too (`FileState::patch_cache`):
        // a read they answer needs no write-back. What this node held back is read from the
        // LUNs only once written (below, on a miss).
        let generation = self.inner.lock_state().view.generation;
        let len = buf.len() as u64;
        let (want, hit) = {
            let mut files = wb.files();
            let f = files.entry(ino).or_default();
            f.last_use = Some(Instant::now());
            if f.delegation.is_some_and(|d| d.generation != generation) {
                f.delegation = None;
                let freed = f.drop_cache();
                wb.cached.fetch_sub(freed, Ordering::Relaxed);
            }
            if f.delegation.is_some() && !f.recalling {
                let mut copy = Span::cpu(Stage::Copy);
                let hit = f.serve(offset, buf).map(|n| {
                    copy.set_bytes(n as u64);
                    bump(&wb.counters.cache_hits);
                    (n, f.read_done(ino, offset, n, len))
                });
                (false, hit)
            } else {
                f.reads = f.reads.saturating_add(1);
                let quiet = f.quiet_until.is_some_and(|t| Instant::now() < t);
                let want = f.reads >= 2 && !f.recalling && !f.asking && !quiet;
                f.asking |= want;
                (want, None)
            }
        };
        if let Some((n, next)) = hit {
            if let Some(next) = next {
                self.spawn_read_ahead(cred, fh, next);
            }
            return Ok(n);
        }
        if want {
            let got = self.ask_delegation(fh, ino, false).await;
            let mut files = wb.files();
            let f = files.entry(ino).or_default();
            f.asking = false;
            let taken = match got {
                Some(held) if f.delegation.is_none() => wb.adopt(f, held),
                Some(_) => true,
                None => false,
            };
            if !taken {
                f.quiet_until = Some(Instant::now() + REFUSAL_BACKOFF);
            }
        }
        let (first, last) = (offset / CHUNK, (offset + len - 1) / CHUNK);
        // A read-ahead under way that brings these chunks: waited for, then served (before
        // any write-back, which would make it drop what it read).
        let ahead = wb
            .files()
            .get(&ino)
            .and_then(|f| f.ahead_covering(first, last));
        if let Some(mut done) = ahead {
            let _ = done.changed().await;
            let mut files = wb.files();
            if let Some(f) = files.get_mut(&ino)
                && caching(f, generation)
                && let Some(n) = f.serve(offset, buf)
            {
                bump(&wb.counters.cache_hits);
                let next = f.read_done(ino, offset, n, len);
                drop(files);
                if let Some(next) = next {
                    self.spawn_read_ahead(cred, fh, next);
                }
                return Ok(n);
            }
        }
        // A miss reads the LUNs: what this node held back goes there first.
        self.write_back_barrier(ino).await;
        let usable = wb
            .files()
            .get(&ino)
            .filter(|f| f.delegation.is_some() && !f.recalling)
            .map(|f| (f.cache_gen, offset == f.last_read_end));
        let Some((cache_gen, sequential)) = usable else {
            return self.read_into(cred, fh, ino, offset, buf).await;
        };
        bump(&wb.counters.cache_misses);
        // The whole chunks the read lies in; a sequential reader's next ones come from the
        // read-ahead started below, or for a short reader with this read.
        let last = if sequential && len < READ_AHEAD_BACKGROUND {
            last + READ_AHEAD_MIN / CHUNK
        } else {
            last
        };
        let start = first * CHUNK;
        let span = (last + 1 - first) * CHUNK;
        // An aligned buffer: when the chunks go the direct path the device I/O lands in it
        // (no bounce buffer and copy in between).
        let tmp = {
            let _copy = Span::cpu(Stage::Copy);
            AlignedBuf::zeroed(usize::try_from(span).map_err(|_| FsError::Range)?)
        };
        let (tmp, n) = self.read_aligned(cred, fh, ino, start, tmp).await?;
        let tmp = tmp.as_slice().get(..n).unwrap_or_default();
        let at = usize::try_from(offset - start).map_err(|_| FsError::Range)?;
        // Past the end of file: nothing (`at` may lie beyond what was read).
        let copied = tmp.len().saturating_sub(at).min(buf.len());
        let mut copy = Span::cpu(Stage::Copy);
        copy.set_bytes(copied as u64);
        if copied > 0 {
            buf[..copied].copy_from_slice(&tmp[at..at + copied]);
        }
        let pieces = chunked(tmp);
        let next = {
            let mut files = wb.files();
            match files.get_mut(&ino) {
                Some(f) if f.cache_gen == cache_gen && caching(f, generation) => {
                    let added = f.keep_chunks(first, pieces, span);
                    add_signed(&wb.cached, added);
                    f.read_done(ino, offset, copied, len)
                }
                _ => None,
            }
        };
        drop(copy);
        wb.trim_cache();
        if let Some(next) = next {
            self.spawn_read_ahead(cred, fh, next);
        }
        Ok(copied)
    }

    /// Runs a read-ahead ([`FileState::read_ahead_due`]) beside the reader (on the current
    /// tokio runtime).
    pub fn spawn_read_ahead(&self, cred: &Credentials, fh: &FileHandle, ra: ReadAhead) {
        let client = Client::borrowed(Arc::clone(&self.inner));
        let (cred, fh) = (cred.clone(), *fh);
        tokio::spawn(async move { client.read_ahead(&cred, &fh, ra).await });
    }

    /// Reads the chunks of a read-ahead and keeps them in the read cache, if nothing made
    /// the file's cache stale meanwhile (a dropped chunk: a write, a recall; a write-back:
    /// `drop_gen`, `flush_gen`). A failure keeps nothing: the reader reads for itself.
    async fn read_ahead(&self, cred: &Credentials, fh: &FileHandle, ra: ReadAhead) {
        let wb = &self.inner.writeback;
        let generation = self.inner.lock_state().view.generation;
        let (start, span) = (ra.first * CHUNK, ra.count * CHUNK);
        let Ok(len) = usize::try_from(span) else {
            return;
        };
        bump(&wb.counters.read_aheads);
        let read = self
            .read_aligned_as_is(cred, fh, ra.ino, start, wb.ra_bufs.take(len))
            .await;
        if let Ok((tmp, n)) = read {
            let pieces = chunked(tmp.as_slice().get(..n).unwrap_or_default());
            wb.ra_bufs.give(tmp);
            let mut files = wb.files();
            if let Some(f) = files.get_mut(&ra.ino)
                && f.drop_gen == ra.drop_gen
                && f.flush_gen == ra.flush_gen
                && f.flushing == 0
                && caching(f, generation)
            {
                // The LUNs held every byte not held back here when the read-ahead was
                // planned (no write-back under way) and no write-back took any since: the
                // held-back bytes, put in, make the chunks the file's content.
                let added = f.keep_chunks(ra.first, pieces, span);
                let freed = f.put_held(start, start + span);
                add_signed(&wb.cached, added - i64::try_from(freed).unwrap_or(i64::MAX));
            }
        }
        // `ra` ends here (its `done` closes): readers waiting for it look again.
        drop(ra);
        wb.trim_cache();
    }

    /// Asks the server for a delegation on `ino` (write: exclusive) under handle `fh`.
    async fn ask_delegation(&self, fh: &FileHandle, ino: InodeId, write: bool) -> Option<Held> {
        let inner = &self.inner;
        let fh = *fh;
        let view = inner.view_for(Some(&fh)).ok()?;
        let req = pb::DelegateRequest::from(DelegateRequest {
            handle: super::data::handle_ref(&fh),
            inode: ino,
            epoch: view.epoch,
            write,
            reclaim_of: None,
        });
        let reply: Result<DelegateReply, FsError> = inner
            .call("Delegate reply", Pin::Handle(&fh), |_| {
                let mut data = inner.data();
                async move { data.delegate(req).await }
            })
            .await;
        let wb = &inner.writeback;
        match reply {
            Ok(DelegateReply {
                delegation: Some(id),
            }) => {
                bump(&wb.counters.delegations);
                Some(Held {
                    id,
                    generation: view.generation,
                    write,
                })
            }
            Ok(_) => {
                bump(&wb.counters.refusals);
                None
            }
            Err(e) => {
                tracing::debug!(%ino, error = %e, "Delegate failed");
                None
            }
        }
    }

    /// Whether a create should ask for the new file's write delegation with it (write-back
    /// on, the file opened for writing).
    pub(crate) fn delegate_on_create(&self, flags: &sanfs_proto::model::OpenFlags) -> bool {
        self.inner.writeback.enabled() && flags.write
    }

    /// The write delegation the server gave with the creation of `ino` (`CreateReply`),
    /// under session generation `generation`: held as if asked for by the file's first
    /// buffered write (which then needs no `Delegate` call).
    pub(crate) fn adopt_created_delegation(&self, ino: InodeId, id: GrantId, generation: u64) {
        let wb = &self.inner.writeback;
        let mut files = wb.files();
        let f = files.entry(ino).or_default();
        let held = Held {
            id,
            generation,
            write: true,
        };
        if f.delegation.is_none() && !f.asking && !f.recalling && wb.adopt(f, held) {
            bump(&wb.counters.delegations);
        }
    }

    /// Writes back every file with bytes or attribute changes held back and no delegation
    /// to hold them (one asked for with a create answered here and refused): before a
    /// recall of the directory's create delegation is acknowledged, so that whoever looks
    /// there next sees them.
    pub(crate) async fn write_back_undelegated(&self) {
        let due: Vec<InodeId> = self
            .inner
            .writeback
            .files()
            .iter()
            .filter(|(_, f)| f.delegation.is_none() && f.holds_back())
            .map(|(ino, _)| *ino)
            .collect();
        for ino in due {
            // A failure is the file's next fsync's or close's error.
            let _ = self.flush_file(ino).await;
        }
    }

    /// Writes every held-back byte of `ino` (one write-back of a file at a time: this waits
    /// for one in progress). A failed write is the file's error, reported by its next
    /// fsync or close (and returned here).
    pub async fn flush_file(&self, ino: InodeId) -> Result<(), FsError> {
        let wb = &self.inner.writeback;
        let flusher = wb.flusher(ino);
        let _one = flusher.lock().await;
        let taken = wb.take(ino);
        // The attribute changes held after those bytes, in the application's order: sent
        // with the bytes' last proxied write where they can be (one call, one durable
        // commit, for `tar x` and `cp -p` of a small file), else after them.
        let held = wb.take_attrs(ino);
        // Ends the `flushing` mark `take_attrs` made, however this ends.
        let _attrs_flushing = held.is_some().then(|| Flushing(wb, ino));
        let (bytes, held) = match taken {
            Some(taken) => self.write_back_bytes(ino, taken, held).await,
            None => (Ok(()), held),
        };
        let attrs = match held {
            Some(held) => self.write_back_attrs(ino, held).await,
            None => Ok(()),
        };
        bytes.and(attrs)
    }

    /// Sends the attribute changes [`WriteBack::take_attrs`] took (the caller ends their
    /// `flushing` mark). A failure is answered by the file's next fsync or close, as a failed
    /// write-back is.
    async fn write_back_attrs(
        &self,
        ino: InodeId,
        (cred, changes): (Credentials, SetAttr),
    ) -> Result<(), FsError> {
        let wb = &self.inner.writeback;
        bump(&wb.counters.attr_flushes);
        tracing::debug!(%ino, ?changes, "sending held-back attribute changes");
        let r = self
            .set_attr_now(&cred, ino, changes, None)
            .await
            .map(|_| ());
        if let Err(e) = &r {
            tracing::warn!(%ino, error = %e, "sending held-back attribute changes failed: the file's next fsync or close answers it");
            // Kept for that answer as a failed write's is (`set_attr_now` waits for the
            // file's writes in flight, so it is noted after it).
            self.inner.begin_pending(ino);
            self.inner.end_pending(ino, Some(e.clone()));
        }
        wb.attrs_sent(ino);
        r
    }

    /// Holds back the attribute change `c` of `ino` by `cred`, when this node holds the
    /// file's write delegation and the server is sure to accept the change as it is (see the
    /// module's documentation, and `held_change`); returns the attributes this node
    /// reports after it. `None`: the change is to be sent now.
    pub(crate) fn hold_attr_change(
        &self,
        cred: &Credentials,
        ino: InodeId,
        c: &SetAttr,
    ) -> Option<Attr> {
        let wb = &self.inner.writeback;
        if !wb.enabled() || *c == SetAttr::default() {
            return None;
        }
        // What the server holds of the file, exact under its attribute lease, and that it
        // has no extended attribute (a file made here: no ACL, no capability).
        let (leased, _) = self.cached_attr(ino)?;
        if !self.inner.leases.is_bare(ino) {
            return None;
        }
        let generation = self.inner.lock_state().view.generation;
        let attr = {
            let mut files = wb.files();
            let f = files.get_mut(&ino)?;
            if !delegated(f, generation) || f.flushing > 0 {
                return None;
            }
            let cur = match &f.attrs {
                Some(h) if h.cred != *cred => return None,
                Some(h) => h.attr.clone(),
                None => leased,
            };
            let next = held_change(cred, &cur, c, wall_clock())?;
            let h = f.attrs.get_or_insert_with(|| HeldAttrs {
                cred: cred.clone(),
                changes: SetAttr::default(),
                chown: false,
                attr: cur,
                since: Instant::now(),
                sending: false,
            });
            if c.perm.is_some() {
                h.changes.perm = Some(next.perm);
            }
            h.changes.atime = c.atime.or(h.changes.atime);
            h.changes.mtime = c.mtime.or(h.changes.mtime);
            h.chown |= c.uid.is_some() || c.gid.is_some();
            h.attr = next.clone();
            next
        };
        bump(&wb.counters.held_attrs);
        Some(self.buffered_attr(attr))
    }

    /// Writes the extents [`WriteBack::take`] took, and with the last of them the attribute
    /// changes `held` ([`WriteBack::take_attrs`]) where that write goes proxied as the same
    /// caller; returns the held changes it did not send.
    async fn write_back_bytes(
        &self,
        ino: InodeId,
        taken: Taken,
        held: Option<(Credentials, SetAttr)>,
    ) -> (Result<(), FsError>, Option<(Credentials, SetAttr)>) {
        let wb = &self.inner.writeback;
        let (dirty, file, cred) = taken;
        let mut held = held;
        let _flushing = Flushing(wb, ino);
        bump(&wb.counters.flushes);
        tracing::debug!(%ino, extents = dirty.len(), "writing back held-back bytes");
        self.inner.begin_pending(ino);
        let mut failed = None;
        let block = u64::from(self.inner.volume().block_size()).max(1);
        // A few short extents (a small file's bytes) go through the server, one by one,
        // unless this node holds a write layout there already (a writer's stream: its
        // pieces go direct inside it, for no more than a batched completion). Else
        // whole-block extents first, window by window: several in a window share one write
        // layout over it and are written directly, a few at a time (disjoint, so in any
        // order), their completions batched; then the others, one by one.
        let proxied = dirty.len() <= PROXIED_WRITE_BACK_EXTENTS
            && dirty.values().map(|d| d.len() as u64).sum::<u64>() <= PROXIED_WRITE_BACK_BYTES
            && !dirty.iter().any(|(off, d)| {
                ByteRange::new(*off, d.len() as u64)
                    .is_ok_and(|r| self.inner.cache.overlaps(ino, r, None))
            });
        let (whole, partial): (Vec<_>, Vec<_>) = dirty.into_iter().partition(|(off, data)| {
            !proxied && off.is_multiple_of(block) && (data.len() as u64).is_multiple_of(block)
        });
        // One extent, with the attribute changes `then` after it where they can go with it
        // (answered: whether they did).
        let write_one = |off: u64, data: Vec<u8>, then: Option<SetAttr>| {
            let (file, cred) = (&file, &cred);
            async move {
                let how = Through {
                    then: then.as_ref(),
                    proxied,
                };
                let r = retrying!(file, self, cred, |fh| self
                    .write_through(cred, &fh, ino, off, &data, how)
                    .await);
                (off, data, r)
            }
        };
        let mut outcomes = Vec::new();
        for window in write_back_windows(whole, self.server_info().max_grant_bytes) {
            if let Some(span) = layout_span(&window) {
                let fh = file.current();
                self.inner
                    .layout_for_write_back(&cred, &fh, ino, span)
                    .await;
            }
            let done: Vec<_> = futures_util::stream::iter(window)
                .map(|(off, data)| write_one(off, data, None))
                .buffer_unordered(WRITE_BACK_PARALLEL)
                .collect()
                .await;
            outcomes.extend(done);
        }
        let last = partial.len().checked_sub(1);
        for (i, (off, data)) in partial.into_iter().enumerate() {
            let then = held
                .as_ref()
                .filter(|(by, _)| Some(i) == last && *by == cred)
                .map(|(_, changes)| changes.clone());
            let with_then = then.is_some();
            let mut done = write_one(off, data, then).await;
            match done.2 {
                Ok((_, true)) => {
                    bump(&wb.counters.attrs_with_bytes);
                    held = None;
                    wb.attrs_sent(ino);
                }
                // Refused with the changes (the file's owner or mode moved meanwhile): the
                // bytes alone, then the changes on their own, whose answer is reported.
                Err(FsError::Perm | FsError::Access) if with_then => {
                    done = write_one(off, done.1, None).await;
                }
                _ => {}
            }
            outcomes.push(done);
        }
        for (off, data, r) in outcomes {
            let len = data.len() as u64;
            match r {
                Ok(_) => add(&wb.counters.flushed_bytes, len),
                Err(e) => {
                    tracing::warn!(%ino, offset = off, len, error = %e, "writing back held-back bytes failed: the file's next fsync or close answers it");
                    failed.get_or_insert(e);
                }
            }
        }
        self.inner.end_pending(ino, failed.clone());
        // Everything held back is out: the server's size and mtime are the file's now (and
        // may be smaller than this node's writes made it: another node's truncate after a
        // recall).
        wb.written_out(ino);
        let r = match failed {
            Some(e) => Err(e),
            None => Ok(()),
        };
        (r, held)
    }

    /// Before I/O of `ino` that must come after its held-back bytes: writes them. A failed
    /// write-back is not answered here but by the file's next write, fsync or close (once).
    pub(crate) async fn write_back_barrier(&self, ino: InodeId) {
        // Also while a write-back is under way (the age flusher's, or another write's at the
        // flush limit): its bytes are not on the LUNs yet; the flusher's lock waits for it.
        if self.inner.writeback.unsettled(ino) {
            let _ = self.flush_file(ino).await;
        }
    }

    /// Before a call whose answer the server bases on the file's mode or times (an open's
    /// permission check, an extended attribute change): this node's held-back attribute
    /// changes of `ino` are sent (with the bytes held back before them).
    pub async fn attrs_barrier(&self, ino: InodeId) {
        if self.inner.writeback.has_held_attrs(ino) {
            let _ = self.flush_file(ino).await;
        }
    }

    /// Whether this node holds back bytes of `ino` in `[start, end)` (or a write-back of
    /// them is under way), or attribute changes of it: what a write there must send first.
    pub fn holds_back_before(&self, ino: InodeId, start: u64, end: u64) -> bool {
        let wb = &self.inner.writeback;
        wb.unsettled_over(ino, start, end) || wb.has_held_attrs(ino)
    }

    /// Whether `ino` has bytes held back on this node.
    pub fn has_held_back(&self, ino: InodeId) -> bool {
        self.inner.writeback.has_dirty(ino)
    }

    /// Writes back every file that is due (old held-back bytes, or held under a delegation
    /// of an earlier session).
    pub async fn flush_due(&self) {
        let generation = self.inner.lock_state().view.generation;
        for ino in self.inner.writeback.due(generation) {
            let _ = self.flush_file(ino).await;
        }
    }

    /// What this node's held-back writes make of `attr`: the larger size. (The mtime is
    /// the server's: set when they are written back, at the latest at fsync or close.)
    pub fn buffered_attr(&self, mut attr: Attr) -> Attr {
        if let Some(f) = self.inner.writeback.files().get(&attr.ino) {
            if f.end > attr.size {
                attr.size = f.end;
            }
            // Held-back bytes of a writer other than root clear setuid and setgid when they
            // reach the server (`LeaseCache::written_by_other_than_root`).
            if !f.dirty.is_empty() && f.writer.as_ref().is_some_and(|(_, c)| !c.is_root()) {
                attr.perm = cleared_setid(attr.perm);
            }
            // Held-back attribute changes: the mode, the times they set, their ctime.
            if let Some(h) = &f.attrs {
                attr.perm = h.attr.perm;
                attr.ctime = attr.ctime.max(h.attr.ctime);
                if h.changes.atime.is_some() {
                    attr.atime = h.attr.atime;
                }
                if h.changes.mtime.is_some() {
                    attr.mtime = h.attr.mtime;
                }
            }
        }
        attr
    }

    /// Whether `ino` has attribute changes held back on this node (or being sent).
    pub fn has_held_attrs(&self, ino: InodeId) -> bool {
        self.inner.writeback.has_held_attrs(ino)
    }

    /// A truncate of `ino` is about to run: what it cuts must not come back from a later
    /// write-back, and the size is the server's again.
    pub(crate) async fn before_truncate(&self, ino: InodeId) -> Result<(), FsError> {
        self.write_back_barrier(ino).await;
        self.inner.writeback.reset_end(ino);
        self.inner.writeback.drop_cache(ino);
        self.inner.take_write_error(ino)
    }

    /// The last handle of `ino` on this agent was released (the server dropped the
    /// delegation with it).
    pub fn forget_delegation(&self, ino: InodeId) {
        self.inner.writeback.forget(ino);
    }

    /// Write-back figures: (held-back bytes now, held writes, write-backs, bytes written
    /// back, recalls that wrote back, delegations, refusals).
    pub fn write_back_stats(&self) -> WriteBackStats {
        let wb = &self.inner.writeback;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        WriteBackStats {
            dirty_bytes: wb.dirty_bytes(),
            held_writes: get(&wb.counters.held_writes),
            held_attrs: get(&wb.counters.held_attrs),
            attr_flushes: get(&wb.counters.attr_flushes),
            attrs_with_bytes: get(&wb.counters.attrs_with_bytes),
            flushes: get(&wb.counters.flushes),
            flushed_bytes: get(&wb.counters.flushed_bytes),
            recalls_flushed: get(&wb.counters.recalls_flushed),
            delegations: get(&wb.counters.delegations),
            refusals: get(&wb.counters.refusals),
            reclaimed: get(&wb.counters.reclaimed),
            cached_bytes: wb.cached.load(Ordering::Relaxed),
            cache_hits: get(&wb.counters.cache_hits),
            cache_misses: get(&wb.counters.cache_misses),
            read_aheads: get(&wb.counters.read_aheads),
        }
    }
}

/// Write-back figures of one agent.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct WriteBackStats {
    /// Bytes held back now.
    pub dirty_bytes: u64,
    /// Writes held back (answered without I/O).
    pub held_writes: u64,
    /// Write-backs run, and the bytes they wrote.
    pub flushes: u64,
    pub flushed_bytes: u64,
    /// Delegation recalls that had bytes to write back first.
    pub recalls_flushed: u64,
    /// Delegations given, and refused.
    pub delegations: u64,
    pub refusals: u64,
    /// Write delegations a restarted server gave back in its reclaim window (writes were
    /// held back under them when it stopped).
    #[serde(default)]
    pub reclaimed: u64,
    /// Attribute changes held back (answered without a call), and the `SetAttr`s that
    /// sent them.
    #[serde(default)]
    pub held_attrs: u64,
    #[serde(default)]
    pub attr_flushes: u64,
    /// Held attribute changes sent with the file's bytes, in their last proxied `Write`.
    #[serde(default)]
    pub attrs_with_bytes: u64,
    /// Bytes in the read cache now; reads it answered, and reads it did not (read and kept).
    #[serde(default)]
    pub cached_bytes: u64,
    #[serde(default)]
    pub cache_hits: u64,
    #[serde(default)]
    pub cache_misses: u64,
    /// Read-aheads run for sequential readers (chunks read in the background).
    #[serde(default)]
    pub read_aheads: u64,
}

/// The background write-back: every half second, the files that are due
/// ([`WriteBack::due`]). Runs until the client is dropped.
pub(crate) async fn run(inner: Arc<Inner>) {
    if !inner.writeback.enabled() {
        return;
    }
    let client = Client::borrowed(inner);
    loop {
        tokio::time::sleep(Duration::from_millis(500)).await;
        client.flush_due().await;
    }
}

impl Inner {
    /// A recall of delegation(s) `ids` on `ino`: nothing more is held back, everything held
    /// back is written, and the delegation is gone; the caller then acknowledges.
    pub(crate) async fn recall_delegation(self: &Arc<Inner>, ino: InodeId, ids: &[GrantId]) {
        let wb = &self.writeback;
        if !wb.mark_recalled(ino, ids) {
            return;
        }
        let had = wb.has_dirty(ino);
        let client = Client::borrowed(self.clone());
        // Until everything is out: writes that were held back just before the mark.
        for _ in 0..4 {
            if client.flush_file(ino).await.is_err() || !wb.has_dirty(ino) {
                break;
            }
        }
        // The write-back's own completions behind it (inside write layouts) are in before the
        // acknowledgement: whoever recalled then sees the size and every byte.
        self.settle(ino).await;
        if had {
            bump(&wb.counters.recalls_flushed);
        }
        wb.recalled(ino, ids);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_delegation_asked_with_a_create_is_named_by_its_reply_and_recalled_before_it() {
        let wb = WriteBack::new(WriteBackConfig::default());
        let (ino, id) = (InodeId(5), GrantId(77));
        wb.expect_created(ino, 1);
        assert!(delegated(&wb.files()[&ino], 1), "held from the create on");
        assert!(
            !delegated(&wb.files()[&ino], 2),
            "not under another session"
        );
        // The recall comes before the reply: it is this delegation's, served here.
        assert!(wb.mark_recalled(ino, &[id]));
        assert!(wb.tombstones().is_empty());
        assert!(!wb.created_answered(ino, Some(id)));
        assert_eq!(wb.files()[&ino].delegation.map(|d| d.id), Some(id));
        wb.recalled(ino, &[id]);
        assert!(wb.files()[&ino].delegation.is_none());
        // Refused with bytes held back: they are to be written back at once.
        let other = InodeId(6);
        wb.expect_created(other, 1);
        wb.files().get_mut(&other).unwrap().dirty_bytes = 10;
        assert!(wb.created_answered(other, None));
        assert!(wb.files()[&other].delegation.is_none());
        // A reply for a file that asked nothing changes nothing.
        assert!(!wb.created_answered(InodeId(7), None));
        assert!(!wb.created_answered(other, Some(id)));
    }

    #[test]
    fn held_back_writes_patch_the_cached_chunks_and_drop_the_one_at_the_end_of_file() {
        let mut f = FileState::default();
        let c = CHUNK as usize;
        f.chunks.insert(0, Arc::new(vec![1u8; c]));
        f.chunks.insert(1, Arc::new(vec![2u8; c]));
        f.chunks.insert(3, Arc::new(vec![4u8; 100])); // the end of file
        f.cached_bytes = 2 * CHUNK + 100;
        let gen0 = f.cache_gen;
        // Across chunks 0 and 1, and into chunk 2, which is not cached.
        let freed = f.patch_cache(CHUNK - 10, &vec![9u8; c + 20]);
        assert_eq!(freed, 100, "the chunk at the end of file goes");
        assert_eq!(f.cached_bytes, 2 * CHUNK);
        assert!(f.cache_gen > gen0, "reads under way keep nothing");
        assert!(!f.chunks.contains_key(&3) && !f.chunks.contains_key(&2));
        let mut buf = vec![0u8; 2 * c];
        assert_eq!(f.serve(0, &mut buf), Some(2 * c));
        let want: Vec<u8> = (0..2 * c)
            .map(|i| if i >= c - 10 { 9 } else { 1 })
            .collect();
        assert_eq!(buf, want);
    }

    /// Where the cached chunks from the file's start end.
    fn ra_end(f: &FileState) -> u64 {
        (0..).take_while(|i| f.chunks.contains_key(i)).count() as u64 * CHUNK
    }

    #[test]
    fn a_read_ahead_fills_the_window_ahead_of_a_sequential_reader_once() {
        let mut f = FileState::default();
        let ino = InodeId(9);
        // A 4 KiB reader is read ahead of in its own reads, at a miss.
        assert!(f.read_ahead_due(ino, 4096, 4096).is_none());
        // A 64 KiB reader at 0: 4 MiB ahead (the least window), from the first chunk.
        let ra = f.read_ahead_due(ino, 65536, 65536).expect("due");
        assert_eq!(
            (ra.first, ra.count),
            (0, (65536 + READ_AHEAD_MIN).div_ceil(CHUNK))
        );
        // One at a time.
        assert!(f.read_ahead_due(ino, 131072, 65536).is_none());
        assert!(f.ahead_covering(0, 3).is_some());
        assert!(f.ahead_covering(0, ra.count).is_none(), "past its end");
        let got: Vec<u8> = (0..ra.count * CHUNK).map(|i| (i % 251) as u8).collect();
        let added = f.keep_chunks(ra.first, chunked(&got), ra.count * CHUNK);
        assert_eq!(added, (ra.count * CHUNK) as i64);
        drop(ra);
        assert!(
            f.ahead_covering(0, 3).is_none(),
            "ended: nothing to wait for"
        );
        // More than half the window is cached ahead: nothing due.
        assert!(f.read_ahead_due(ino, 131072, 65536).is_none());
        // Near its end: the next window, from the first chunk not cached.
        let cached = ra_end(&f);
        let ra = f.read_ahead_due(ino, cached - CHUNK, 65536).expect("due");
        assert_eq!(ra.first * CHUNK, cached);
        // A 1 MiB reader reads 8 MiB ahead, an 8 MiB one at most 16 MiB.
        let mut g = FileState::default();
        assert_eq!(
            g.read_ahead_due(ino, 1 << 20, 1 << 20).unwrap().count,
            (8 << 20) / CHUNK
        );
        let mut h = FileState::default();
        assert_eq!(
            h.read_ahead_due(ino, 0, 8 << 20).unwrap().count,
            READ_AHEAD_MAX / CHUNK
        );
        // The end of file cached: nothing to read ahead; a write-back under way: none either.
        let mut e = FileState::default();
        e.chunks.insert(0, Arc::new(vec![0u8; 100]));
        assert!(e.read_ahead_due(ino, 50, 65536).is_none());
        let mut w = FileState {
            flushing: 1,
            ..FileState::default()
        };
        assert!(w.read_ahead_due(ino, 0, 65536).is_none());
    }

    #[test]
    fn a_read_ahead_puts_the_held_back_bytes_into_what_it_read() {
        let mut f = FileState::default();
        let c = CHUNK as usize;
        let cred = Credentials::root();
        let flags = sanfs_proto::model::OpenFlags {
            read: true,
            write: true,
            append: false,
            truncate: false,
        };
        let handle = FileHandle {
            session: sanfs_proto::types::SessionId(1),
            handle: sanfs_proto::types::OpenHandle(1),
        };
        let file = Arc::new(OpenFile::new(InodeId(3), flags, handle, &cred));
        // Held back while the read-ahead read the LUNs (which hold zeros there).
        f.hold(&file, &cred, 10, &[7u8; 20]);
        f.hold(&file, &cred, CHUNK - 5, &[8u8; 10]);
        f.hold(&file, &cred, 5 * CHUNK, &[9u8; 4]); // past what the read-ahead read
        let read = vec![0u8; c + 300]; // the file ends 300 bytes into chunk 1
        f.keep_chunks(0, chunked(&read), 2 * CHUNK);
        let freed = f.put_held(0, 2 * CHUNK);
        assert_eq!(
            freed, 300,
            "the chunk at the end of file goes: the writes may move it"
        );
        assert!(!f.chunks.contains_key(&1));
        let mut buf = vec![0xFFu8; c];
        assert_eq!(f.serve(0, &mut buf), Some(c));
        let mut want = vec![0u8; c];
        want[10..30].fill(7);
        want[c - 5..].fill(8);
        assert_eq!(buf, want);
    }

    #[test]
    fn write_back_windows_cover_at_most_one_layout_each() {
        let e = |off: u64, len: usize| (off, vec![0u8; len]);
        let spans = |w: &[Vec<(u64, Vec<u8>)>]| -> Vec<Vec<u64>> {
            w.iter()
                .map(|w| w.iter().map(|(o, _)| *o).collect())
                .collect()
        };
        assert!(write_back_windows(Vec::new(), 1 << 20).is_empty());
        // Blocks within 4 MiB with gaps up to 1 MiB: one window; past 4 MiB another.
        let m = |n: u64| n << 20;
        let w = write_back_windows(
            vec![
                e(0, 4096),
                e(m(1) + 4096, 4096),
                e(m(2), 4096),
                e(m(3), 4096),
                e(m(4), 4096),
            ],
            m(4),
        );
        assert_eq!(
            spans(&w),
            vec![vec![0, m(1) + 4096, m(2), m(3)], vec![m(4)]]
        );
        // A gap wider than WRITE_BACK_MAX_GAP starts a window.
        let w = write_back_windows(vec![e(0, 4096), e(m(1) + 8192, 4096)], 1 << 30);
        assert_eq!(spans(&w), vec![vec![0], vec![m(1) + 8192]]);
        // An extent longer than a window is a window of its own.
        let w = write_back_windows(
            vec![e(0, 4096), e(8192, 3 << 20), e(3 << 20 | 1 << 19, 4096)],
            1 << 20,
        );
        assert_eq!(
            spans(&w),
            vec![vec![0], vec![8192], vec![3 << 20 | 1 << 19]]
        );
    }

    fn flat(map: &BTreeMap<u64, Vec<u8>>, len: usize) -> Vec<Option<u8>> {
        let mut out = vec![None; len];
        for (s, v) in map {
            for (i, b) in v.iter().enumerate() {
                out[*s as usize + i] = Some(*b);
            }
        }
        out
    }

    #[test]
    fn inserts_merge_like_a_byte_array() {
        let seed: u64 = std::env::var("SANFS_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| {
                use std::hash::{BuildHasher, Hasher};
                std::collections::hash_map::RandomState::new()
                    .build_hasher()
                    .finish()
            });
        println!("seed {seed} (SANFS_SEED to repeat)");
        let mut x = seed | 1;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let size = 4096usize;
        for _ in 0..200 {
            let mut map = BTreeMap::new();
            let mut model: Vec<Option<u8>> = vec![None; size];
            let mut bytes = 0u64;
            for _ in 0..50 {
                let off = (next() % size as u64) as usize;
                let len = 1 + (next() % 300) as usize;
                let len = len.min(size - off);
                let fill = (next() % 251) as u8;
                let data: Vec<u8> = (0..len).map(|i| fill.wrapping_add(i as u8)).collect();
                bytes += insert(&mut map, off as u64, &data);
                for (i, b) in data.iter().enumerate() {
                    model[off + i] = Some(*b);
                }
                assert_eq!(flat(&map, size), model, "seed {seed}");
                let held: u64 = map.values().map(|v| v.len() as u64).sum();
                assert_eq!(held, bytes, "seed {seed}: the growth count is exact");
                // Never two extents that overlap or touch.
                let mut prev_end = None;
                for (s, v) in &map {
                    if let Some(e) = prev_end {
                        assert!(*s > e, "seed {seed}: extents at {s} and before {e} touch");
                    }
                    prev_end = Some(s + v.len() as u64);
                }
            }
        }
    }

    #[test]
    fn the_cache_answers_up_to_the_end_of_file_and_forgets_it_at_a_write() {
        let mut f = FileState::default();
        let c = CHUNK as usize;
        f.chunks.insert(0, Arc::new(vec![1; c]));
        f.chunks.insert(1, Arc::new(vec![2; 100]));
        let mut buf = vec![0u8; c + 500];
        assert_eq!(
            f.serve(0, &mut buf),
            Some(c + 100),
            "short at the end of file"
        );
        assert_eq!(
            f.serve(CHUNK + 100, &mut buf),
            Some(0),
            "at the end of file"
        );
        assert_eq!(f.serve(2 * CHUNK, &mut buf), None, "past it: not known");
        // An empty chunk is an end of file on a chunk boundary.
        let mut g = FileState::default();
        g.chunks.insert(0, Arc::new(Vec::new()));
        assert_eq!(g.serve(0, &mut buf), Some(0));
        // A write anywhere drops the end-of-file chunk (it may move) and what it touches.
        f.drop_range(5 * CHUNK, 1);
        assert!(f.chunks.contains_key(&0) && !f.chunks.contains_key(&1));
        g.drop_range(5 * CHUNK, 1);
        assert!(g.chunks.is_empty());
    }

    #[test]
    fn sequential_small_writes_grow_one_extent() {
        let mut map = BTreeMap::new();
        for i in 0..1000u64 {
            assert_eq!(insert(&mut map, i * 4096, &[i as u8; 4096]), 4096);
        }
        assert_eq!(map.len(), 1);
        assert_eq!(map[&0].len(), 4096 * 1000);
        // A rewrite in place does not grow it.
        assert_eq!(insert(&mut map, 8192, &[9; 100]), 0);
    }

    fn file(uid: u32, gid: u32, perm: u32) -> Attr {
        Attr {
            ino: InodeId(7),
            kind: FileType::Regular,
            perm,
            nlink: 1,
            uid,
            gid,
            size: 0,
            allocated: 0,
            atime: Timestamp::default(),
            mtime: Timestamp::default(),
            ctime: Timestamp { sec: 5, nsec: 0 },
            btime: Timestamp::default(),
            rdev: 0,
            generation: 0,
            no_xattrs: false,
        }
    }

    fn cred(uid: u32, gid: u32, groups: &[u32]) -> Credentials {
        Credentials {
            uid,
            gid,
            groups: groups.to_vec(),
        }
    }

    #[test]
    fn a_change_is_held_only_where_the_server_takes_it_as_it_is() {
        let now = Timestamp { sec: 9, nsec: 0 };
        let at = TimeSet::At(Timestamp { sec: 1, nsec: 0 });
        let root = cred(0, 0, &[]);
        let owner = cred(1000, 1000, &[]);
        let mode = |m: u32| SetAttr {
            perm: Some(m),
            ..SetAttr::default()
        };
        let owners = |u: u32, g: u32| SetAttr {
            uid: Some(u),
            gid: Some(g),
            ..SetAttr::default()
        };
        // tar as root on its own file: the times, the owners it has, the mode.
        let f = file(0, 0, 0o600);
        let t = SetAttr {
            mtime: Some(at),
            ..SetAttr::default()
        };
        let after = held_change(&root, &f, &t, now).unwrap();
        assert_eq!((after.mtime.sec, after.ctime), (1, now));
        assert!(held_change(&root, &f, &owners(0, 0), now).is_some());
        assert_eq!(
            held_change(&root, &f, &mode(0o4755), now).unwrap().perm,
            0o4755
        );
        // The owner by uid only: root on another's file may be squashed by the server.
        assert!(held_change(&root, &file(1000, 1000, 0o600), &mode(0o644), now).is_none());
        assert!(held_change(&owner, &file(1000, 1000, 0o600), &mode(0o644), now).is_some());
        assert!(held_change(&cred(1001, 1000, &[]), &file(1000, 1000, 0o600), &t, now).is_none());
        // Ownership that moves (quota), a size, the server's clock, an explicit ctime: sent.
        assert!(held_change(&root, &f, &owners(1000, 0), now).is_none());
        assert!(held_change(&root, &f, &owners(0, 5), now).is_none());
        for c in [
            SetAttr {
                size: Some(0),
                ..SetAttr::default()
            },
            SetAttr {
                mtime: Some(TimeSet::Now),
                ..SetAttr::default()
            },
            SetAttr {
                ctime: Some(now),
                ..SetAttr::default()
            },
        ] {
            assert!(held_change(&root, &f, &c, now).is_none(), "{c:?}");
        }
        // setgid outside the caller's groups: the server may clear it.
        let g = file(1000, 50, 0o600);
        assert!(held_change(&owner, &g, &mode(0o2755), now).is_none());
        assert!(held_change(&cred(1000, 1000, &[50]), &g, &mode(0o2755), now).is_some());
        // A chown that would clear a bit, or one with a mode that has one: sent.
        assert!(held_change(&root, &file(0, 0, 0o4755), &owners(0, 0), now).is_none());
        assert!(held_change(&root, &file(0, 0, 0o2775), &owners(0, 0), now).is_none());
        assert!(held_change(&root, &file(0, 0, 0o2745), &owners(0, 0), now).is_some());
        let both = SetAttr {
            perm: Some(0o4755),
            ..owners(0, 0)
        };
        assert!(held_change(&root, &f, &both, now).is_none());
        // Not a regular file.
        let mut d = file(0, 0, 0o755);
        d.kind = FileType::Directory;
        assert!(held_change(&root, &d, &mode(0o700), now).is_none());
    }
}
