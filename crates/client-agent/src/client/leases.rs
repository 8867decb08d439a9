//! The agent's side of attribute and entry leases (docs/protocol.md "Attribute and entry
//! leases"; docs/posix.md "Caching and coherence").
//!
//! Lookup, GetAttr and ReadDir ask for leases for the current session; a reply's `lease_ms`
//! says for how long (from the request's send time) the server recalls them before another
//! change. Under them this cache keeps:
//! - **attributes** per inode (the kernel gets them with a TTL up to the lease's end, and a
//!   recall invalidates the kernel's copy with `Notifier::inval_inode` before it is acked);
//! - **the whole bytes of small files** given with an open (`OpenRequest::read_small`), under
//!   the attribute lease held when the open was sent and only until its end
//!   ([`LeaseCache::content`]; docs/posix.md "Small files with their open");
//! - **names** per directory under its entry lease, negative ones included. Where the kernel
//!   can forget every name it caches without taking a lock (`FUSE_NOTIFY_INC_EPOCH`, Linux
//!   6.16 and later: [`LeaseCache::set_kernel_names_invalidator`]), a name found under its
//!   leases is given to the kernel with a TTL up to the leases' end, and a recall of a
//!   directory's names bumps the kernel's epoch before it is acked: every cached name is then
//!   looked up again, from here. Otherwise the kernel is given entry TTL 0 and every path walk
//!   asks the agent, which answers from here. Never `inval_entry`: it takes the directory's
//!   lock, and a FUSE request of this node in that directory may hold it while it waits for
//!   the server, which waits for this recall.
//!
//! **Races.** A reply may arrive after the recall of what it grants (the recall travels on the
//! session stream, the reply on its own call). Every request takes [`LeaseCache::mark`]
//! before it is sent; a recall, an own change or a new session since then (per inode, hashed
//! into buckets) makes the reply's lease unusable here.
//!
//! **Bounded.** At most [`MAX_ATTRS`] attributes and [`MAX_NAMES`] names: past that, expired
//! ones are pruned and, if still full, nothing more is kept (the reply is used without a
//! lease). What the agent drops needs no return: the server's hold ends with its term.
//!
//! **Renewed.** Each heartbeat asks the server to renew the leases that would run out before
//! the one after next and were used here lately ([`LeaseCache::renewal`]); the answer extends
//! those the server still held and nothing touched since ([`LeaseCache::renewed`]). So a
//! lease in use lasts until a change recalls it, not one term.
//!
//! Nothing outlives the session: terms are capped at the session lease's deadline, and a new
//! session (or a lost one) clears everything, the kernel's attributes included.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use sanfs_proto::model::{
    ChangedDirs, DirEntry, EntryRequest, GetAttrRequest, LeaseRenew, LeaseRenewed, Leased,
    LeasedLookup, LeasedReadDir, ReadDirReply, ReadDirRequest,
};
use sanfs_proto::pb;
use sanfs_proto::types::{Attr, Credentials, FileName, FileType, FsError, InodeId, cleared_setid};

use super::Client;
use super::rpc::Pin;

/// Attributes kept at most.
pub const MAX_ATTRS: usize = 262_144;
/// Names (positive and negative) kept at most.
pub const MAX_NAMES: usize = 262_144;
const BUCKETS: usize = 4096;

fn bucket(ino: InodeId) -> usize {
    (ino.0.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 52) as usize % BUCKETS
}

/// Whether the server answers "no such attribute" for `name` on a file that has none: a
/// well-formed name in the `user.`, `trusted.` or `security.` namespace (`system.*` is
/// EOPNOTSUPP; a malformed name is refused).
fn plain_xattr_name(name: &[u8]) -> bool {
    sanfs_proto::types::XattrName::new(name.to_vec()).is_ok()
        && [&b"user."[..], b"trusted.", b"security."]
            .iter()
            .any(|p| name.len() > p.len() && name.starts_with(p))
}

/// An extended attribute of an inode as one caller asked it: (inode, caller key, name).
type XattrKey = (InodeId, u64, Vec<u8>);

/// Attribute leases one heartbeat asks to renew at most ([`LeaseCache::renewal`]).
pub const RENEW_ATTRS: usize = 49_152;
/// Entry leases one heartbeat asks to renew at most.
pub const RENEW_DIRS: usize = 8_192;
/// A lease not used here for this long is not renewed: it runs out (a bounded cache keeps
/// what is in use; the server holds at most 65,536 inodes per session).
pub const RENEW_IDLE: Duration = Duration::from_secs(600);

/// Extended attributes (values or absences) cached at most; past it the cache starts over.
const MAX_XATTRS: usize = 65_536;
/// The longest extended attribute value cached (ACLs, capabilities and labels are short).
const MAX_XATTR_CACHED: usize = 4_096;

/// The largest file whose whole bytes an open asks for ([`LeaseCache::content`]): the
/// server's default `direct_io_threshold` (a longer one's reads go the direct path).
pub const SMALL_FILE_MAX: u64 = 64 << 10;
/// Bytes of small files kept at most; past it, those whose lease ended go, and if still full
/// nothing more is kept.
const MAX_CONTENT_BYTES: usize = 64 << 20;

/// Invalidates the kernel's cached attributes of an inode (set by the FUSE layer).
pub type KernelInvalidator = Box<dyn Fn(InodeId) + Send + Sync>;
/// Makes the kernel look every name up again (set by the FUSE layer when it can).
pub type KernelNamesInvalidator = Box<dyn Fn() + Send + Sync>;

/// Counters (status and metrics).
#[derive(Debug, Default)]
pub struct LeaseCounters {
    pub attr_hits: AtomicU64,
    pub attr_misses: AtomicU64,
    pub entry_hits: AtomicU64,
    pub entry_misses: AtomicU64,
    pub xattr_hits: AtomicU64,
    pub xattr_misses: AtomicU64,
    pub access_hits: AtomicU64,
    pub access_misses: AtomicU64,
    /// Reads answered from a small file's bytes given with its open, and opens that got them.
    pub content_hits: AtomicU64,
    pub content_opens: AtomicU64,
    /// Small files kept with the bytes this agent wrote to them whole.
    pub content_writes: AtomicU64,
    /// Directory listings answered from a listing kept under the entry lease, and not.
    pub listing_hits: AtomicU64,
    pub listing_misses: AtomicU64,
    pub recalls: AtomicU64,
    /// Leases renewed by heartbeats, and those asked for that the server no longer held.
    pub renewed: AtomicU64,
    pub renew_lost: AtomicU64,
}

#[derive(Debug)]
struct Dir {
    until: Instant,
    /// The cache's `seq` when this hold began: a name found absent is kept only by a request
    /// marked after it (sent while the lease was held, so a change would have recalled it).
    since: u64,
    names: HashMap<Vec<u8>, Option<InodeId>>,
    /// Every name of the directory is in `names`: one that is not there is absent (a
    /// directory this agent made, while it holds its entry lease and every change of its
    /// own there put the names it added).
    complete: bool,
    /// The whole listing as the server answered it under this hold (a `ReadDir` with
    /// attributes from its start to its end, in one reply that gave the entry lease): later
    /// listings are answered from it ([`LeaseCache::listing`]). Dropped with any change of
    /// this agent's in the directory; a recall drops the whole hold.
    listing: Option<Listing>,
}

impl Dir {
    /// Names kept under this hold, the listing's included (counted against [`MAX_NAMES`]).
    fn held(&self) -> usize {
        self.names.len() + self.listing.as_ref().map_or(0, |l| l.entries.len())
    }
}

/// A directory's listing kept under its entry lease.
#[derive(Debug)]
struct Listing {
    /// The directory's parent, for `..`.
    parent: InodeId,
    /// (name, inode, kind, cookie), in cookie order.
    entries: Vec<(FileName, InodeId, FileType, u64)>,
}

/// What this node's attribute lease says of a file as a small one
/// ([`LeaseCache::small_file`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SmallHint {
    /// No lease held: unknown.
    Unknown,
    /// Small, under a lease that ends then.
    Small(Instant),
    /// Not a small regular file.
    NotSmall,
}

/// A small file's bytes, given with an open ([`LeaseCache::content`]).
#[derive(Debug)]
struct Content {
    data: Vec<u8>,
    mark: u64,
    until: Instant,
}

#[derive(Debug)]
struct State {
    seq: u64,
    /// Marks below this are of an earlier session.
    floor: u64,
    /// Per bucket: the `seq` of the last recall or own change there.
    touched: Vec<u64>,
    /// Per bucket: the `seq` of the last recall there (own changes not counted).
    recalled: Vec<u64>,
    attrs: HashMap<InodeId, (Attr, Instant)>,
    dirs: HashMap<InodeId, Dir>,
    names: usize,
    /// Extended attributes answered by the server (a value, or none by that name), per
    /// inode, caller and name, with the mark of the request and the end of the attribute
    /// lease held when it was asked: good while that lease holds and nothing touched the
    /// inode since (see [`LeaseCache::xattr`]).
    xattrs: HashMap<XattrKey, (Option<Vec<u8>>, u64, Instant)>,
    /// Whole small files given with their opens, per inode, with the mark of the request and
    /// the end of the attribute lease held when it was sent (see [`LeaseCache::content`]).
    contents: HashMap<InodeId, Content>,
    content_bytes: usize,
    /// Files this agent created, with the mark of the create and the end of its leases:
    /// they have no extended attribute while no recall came there (another node's
    /// `SetXattr` recalls the attribute lease) and this agent set none (see
    /// [`LeaseCache::xattr`]). Own writes and attribute changes do not end it.
    bare: HashMap<InodeId, (u64, Instant)>,
    /// Own changes in progress per directory, and the number of the last one begun there.
    own: HashMap<InodeId, (usize, u64)>,
    own_next: u64,
    /// When each leased inode (attributes, or a directory's names) was last used here: a
    /// heartbeat renews the most recently used first, and none idle for [`RENEW_IDLE`]
    /// ([`LeaseCache::renewal`]).
    used: HashMap<InodeId, Instant>,
}

impl State {
    /// Whether `ino` is a file made here that is known to have no extended attribute.
    fn bare(&self, ino: InodeId, now: Instant) -> bool {
        self.bare.get(&ino).is_some_and(|(mark, until)| {
            *until > now && *mark >= self.floor && self.recalled[bucket(ino)] <= *mark
        })
    }

    fn usable(&self, mark: u64, ino: InodeId) -> bool {
        mark >= self.floor && self.touched[bucket(ino)] <= mark
    }

    /// Keeps `attr` until `end`, if the table has room (pruned of what ran out when full).
    /// Attributes that say the inode has no extended attribute make it bare until then too
    /// (the same lease covers both).
    fn keep_attr(&mut self, attr: &Attr, end: Instant) -> bool {
        if self.attrs.len() >= MAX_ATTRS && !self.attrs.contains_key(&attr.ino) {
            self.prune(Instant::now());
            if self.attrs.len() >= MAX_ATTRS {
                return false;
            }
        }
        self.attrs.insert(attr.ino, (attr.clone(), end));
        if attr.no_xattrs {
            // Under the mark of now, which no recall has passed (the caller checked the
            // request's).
            self.keep_bare(attr.ino, self.seq, end);
        }
        true
    }

    /// `ino` has no extended attribute until `end`, unless a recall after `mark` comes
    /// (room permitting; a longer hold already kept stays).
    fn keep_bare(&mut self, ino: InodeId, mark: u64, end: Instant) {
        if self.bare.len() >= MAX_XATTRS {
            let now = Instant::now();
            self.bare.retain(|_, (_, until)| *until > now);
        }
        if self.bare.len() < MAX_XATTRS {
            let e = self.bare.entry(ino).or_insert((mark, end));
            if e.1 < end {
                *e = (mark, end);
            }
        }
    }

    fn touch(&mut self, ino: InodeId) {
        self.seq += 1;
        let seq = self.seq;
        self.touched[bucket(ino)] = seq;
    }

    /// This agent changes `inos` (attributes) and the names in `dirs`: what is cached there
    /// goes.
    fn forget(&mut self, inos: &[InodeId], dirs: &[(InodeId, &[u8])]) {
        for ino in inos {
            self.touch(*ino);
            self.attrs.remove(ino);
            self.drop_content(*ino);
        }
        for (dir, name) in dirs {
            self.touch(*dir);
            self.attrs.remove(dir);
            if let Some(l) = self.dirs.get_mut(dir).and_then(|d| d.listing.take()) {
                self.names -= l.entries.len();
            }
            // The name's inode changes too (link count, ctime).
            let child = self.dirs.get_mut(dir).and_then(|d| d.names.remove(*name));
            if let Some(child) = child {
                self.names -= 1;
                if let Some(ino) = child {
                    self.touch(ino);
                    self.attrs.remove(&ino);
                    self.drop_content(ino);
                }
            }
        }
    }

    /// Keeps `name` in `parent` (`None`: absent) under the directory's hold until `until`
    /// (checked by the caller).
    fn hold_name(
        &mut self,
        parent: InodeId,
        name: &[u8],
        ino: Option<InodeId>,
        until: Instant,
        now: Instant,
    ) {
        if self.dirs.get(&parent).is_none_or(|d| d.until <= now) {
            // A new hold: none before, or one that ran out (what it kept may be stale now:
            // no recall reached this agent after its end).
            self.seq += 1;
            let since = self.seq;
            let fresh = Dir {
                until,
                since,
                names: HashMap::new(),
                complete: false,
                listing: None,
            };
            if let Some(old) = self.dirs.insert(parent, fresh) {
                self.names -= old.held();
            }
        }
        if let Some(dir) = self.dirs.get_mut(&parent) {
            dir.until = dir.until.max(until);
            if dir.names.insert(name.to_vec(), ino).is_none() {
                self.names += 1;
            }
        }
    }

    /// Puts `name` -> `ino` that this agent's own change added in `dir` (held until `until`,
    /// see [`State::hold_name`]); the directory is complete again if it was before.
    fn put_own_name(
        &mut self,
        dir: InodeId,
        name: &[u8],
        ino: InodeId,
        until: Instant,
        now: Instant,
        was_complete: bool,
    ) {
        self.hold_name(dir, name, Some(ino), until, now);
        if let Some(d) = self.dirs.get_mut(&dir) {
            d.complete = was_complete;
        }
    }

    /// Holds `dir`, just made by this agent, until `until`: empty, every name known.
    fn hold_empty_dir(&mut self, dir: InodeId, until: Instant) {
        self.seq += 1;
        let empty = Dir {
            until,
            since: self.seq,
            names: HashMap::new(),
            complete: true,
            listing: None,
        };
        if let Some(old) = self.dirs.insert(dir, empty) {
            self.names -= old.held();
        }
    }

    /// [`LeaseCache::listing`] as of `now`.
    fn listed(
        &self,
        dir: InodeId,
        cookie: u64,
        max: usize,
        plus: bool,
        now: Instant,
    ) -> Option<ReadDirReply> {
        let d = self.dirs.get(&dir).filter(|d| d.until > now)?;
        let l = d.listing.as_ref()?;
        let start = l.entries.partition_point(|e| e.3 <= cookie);
        let end = start.saturating_add(max.max(1)).min(l.entries.len());
        let mut entries = Vec::with_capacity(end - start);
        for (name, ino, kind, c) in &l.entries[start..end] {
            let attr = if plus {
                let (a, _) = self.attrs.get(ino).filter(|(_, until)| *until > now)?;
                Some(a.clone())
            } else {
                None
            };
            entries.push(DirEntry {
                name: name.clone(),
                inode: *ino,
                kind: *kind,
                cookie: *c,
                attr,
            });
        }
        Some(ReadDirReply {
            entries,
            eof: end == l.entries.len(),
            parent: l.parent,
        })
    }

    fn drop_content(&mut self, ino: InodeId) {
        if let Some(c) = self.contents.remove(&ino) {
            self.content_bytes -= c.data.len();
        }
    }

    /// The bytes of `ino` kept from its open, while they are good: the lease held when the
    /// open was sent still holds and nothing touched the inode since it was marked.
    fn content(&self, ino: InodeId, now: Instant) -> Option<&[u8]> {
        self.contents
            .get(&ino)
            .filter(|c| c.until > now && self.usable(c.mark, ino))
            .map(|c| c.data.as_slice())
    }

    /// Keeps a small file's bytes, if there is room (made by pruning what ran out).
    fn keep_content(&mut self, ino: InodeId, c: Content, now: Instant) -> bool {
        let len = c.data.len();
        if self.content_bytes + len > MAX_CONTENT_BYTES {
            self.prune_contents(now);
            if self.content_bytes + len > MAX_CONTENT_BYTES {
                return false;
            }
        }
        self.content_bytes += len;
        self.contents.insert(ino, c);
        true
    }

    fn prune_contents(&mut self, now: Instant) {
        let mut freed = 0;
        self.contents.retain(|_, c| {
            let keep = c.until > now;
            if !keep {
                freed += c.data.len();
            }
            keep
        });
        self.content_bytes -= freed;
    }

    fn drop_dir(&mut self, dir: InodeId) {
        if let Some(d) = self.dirs.remove(&dir) {
            self.names -= d.held();
        }
    }

    fn prune(&mut self, now: Instant) {
        self.attrs.retain(|_, (_, until)| *until > now);
        self.xattrs.retain(|_, (_, _, until)| *until > now);
        self.prune_contents(now);
        let mut gone = 0;
        self.dirs.retain(|_, d| {
            let keep = d.until > now;
            if !keep {
                gone += d.held();
            }
            keep
        });
        self.names -= gone;
    }
}

/// Attributes and names cached under leases.
pub struct LeaseCache {
    state: Mutex<State>,
    kernel: OnceLock<KernelInvalidator>,
    kernel_names: OnceLock<KernelNamesInvalidator>,
    pub counters: LeaseCounters,
}

impl std::fmt::Debug for LeaseCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.lock();
        f.debug_struct("LeaseCache")
            .field("attrs", &s.attrs.len())
            .field("names", &s.names)
            .finish()
    }
}

impl Default for LeaseCache {
    fn default() -> Self {
        LeaseCache {
            state: Mutex::new(State {
                seq: 0,
                floor: 0,
                touched: vec![0; BUCKETS],
                recalled: vec![0; BUCKETS],
                attrs: HashMap::new(),
                dirs: HashMap::new(),
                names: 0,
                xattrs: HashMap::new(),
                contents: HashMap::new(),
                content_bytes: 0,
                bare: HashMap::new(),
                own: HashMap::new(),
                own_next: 0,
                used: HashMap::new(),
            }),
            kernel: OnceLock::new(),
            kernel_names: OnceLock::new(),
            counters: LeaseCounters::default(),
        }
    }
}

/// Counts `hit` as a hit or a miss of the cache; answers it.
fn counted<T>(hit: Option<T>, hits: &AtomicU64, misses: &AtomicU64) -> Option<T> {
    let c = if hit.is_some() { hits } else { misses };
    c.fetch_add(1, Ordering::Relaxed);
    hit
}

/// When a lease granted for `lease_ms` on a request sent at `sent` ends, capped at the
/// session's `deadline`; `None` when it has ended already or there is none.
fn lease_end(sent: Instant, lease_ms: u64, deadline: Instant) -> Option<Instant> {
    if lease_ms == 0 {
        return None;
    }
    let end = (sent + Duration::from_millis(lease_ms)).min(deadline);
    (end > Instant::now()).then_some(end)
}

impl LeaseCache {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Sets how the kernel's attributes are invalidated (once, by the FUSE layer).
    pub fn set_kernel_invalidator(&self, f: KernelInvalidator) {
        let _ = self.kernel.set(f);
    }

    /// Sets how the kernel forgets every name it caches, without a lock (once, by the FUSE
    /// layer, when the kernel has it): names under leases may then be cached by the kernel.
    pub fn set_kernel_names_invalidator(&self, f: KernelNamesInvalidator) {
        let _ = self.kernel_names.set(f);
    }

    /// Whether the kernel may cache names under their leases (see
    /// [`LeaseCache::set_kernel_names_invalidator`]).
    pub fn kernel_names(&self) -> bool {
        self.kernel_names.get().is_some()
    }

    fn invalidate_kernel_names(&self) {
        if let Some(k) = self.kernel_names.get() {
            k();
        }
    }

    fn invalidate_kernel(&self, inos: &[InodeId]) {
        if let Some(k) = self.kernel.get() {
            for ino in inos {
                k(*ino);
            }
        }
    }

    /// Taken before a request that may hand out leases is sent.
    pub fn mark(&self) -> u64 {
        self.lock().seq
    }

    /// Cached attributes of `ino` and how long they stay valid.
    pub fn attr(&self, ino: InodeId) -> Option<(Attr, Duration)> {
        let now = Instant::now();
        let hit = {
            let mut s = self.lock();
            let hit = s
                .attrs
                .get(&ino)
                .filter(|(_, until)| *until > now)
                .map(|(a, until)| (a.clone(), *until - now));
            if hit.is_some() {
                s.used.insert(ino, now);
            }
            hit
        };
        counted(hit, &self.counters.attr_hits, &self.counters.attr_misses)
    }

    /// A cached name in `parent`: `Some(Some((attr, ttl)))` for a name and the attributes of
    /// its inode, `Some(None)` for a name known not to exist, `None` when not cached.
    #[allow(
        clippy::option_option,
        reason = "not cached / cached absent / cached present"
    )]
    pub fn entry(&self, parent: InodeId, name: &[u8]) -> Option<Option<(Attr, Duration)>> {
        let now = Instant::now();
        let hit = {
            let mut s = self.lock();
            let hit = s
                .dirs
                .get(&parent)
                .filter(|d| d.until > now)
                .and_then(|d| match d.names.get(name) {
                    Some(n) => Some((*n, d.until)),
                    None if d.complete => Some((None, d.until)),
                    None => None,
                })
                .and_then(|(n, dir_until)| match n {
                    None => Some(None),
                    Some(ino) => s
                        .attrs
                        .get(&ino)
                        .filter(|(_, until)| *until > now)
                        .map(|(a, until)| Some((a.clone(), (*until).min(dir_until) - now))),
                });
            if let Some(found) = &hit {
                s.used.insert(parent, now);
                if let Some((a, _)) = found {
                    s.used.insert(a.ino, now);
                }
            }
            hit
        };
        counted(hit, &self.counters.entry_hits, &self.counters.entry_misses)
    }

    /// How long `name` stays known absent in `parent` (`None`: not cached as absent under
    /// the directory's entry lease).
    pub fn negative_ttl(&self, parent: InodeId, name: &[u8]) -> Option<Duration> {
        let now = Instant::now();
        self.lock()
            .dirs
            .get(&parent)
            .filter(|d| {
                d.until > now
                    && match d.names.get(name) {
                        Some(n) => n.is_none(),
                        None => d.complete,
                    }
            })
            .map(|d| d.until - now)
    }

    /// Keeps `attr` under a lease of `lease_ms` from `sent` (request marked `mark`); answers
    /// the TTL the kernel may keep it for, `None` without a usable lease.
    pub fn put_attr(
        &self,
        attr: &Attr,
        lease_ms: u64,
        sent: Instant,
        deadline: Instant,
        mark: u64,
    ) -> Option<Duration> {
        let end = lease_end(sent, lease_ms, deadline)?;
        let mut s = self.lock();
        if !s.usable(mark, attr.ino) || !s.keep_attr(attr, end) {
            return None;
        }
        Some(end.saturating_duration_since(Instant::now()))
    }

    /// This agent changed the attributes of `attr.ino` with a call sent at `mark` whose reply
    /// says they are now `attr`, under a lease of `lease_ms` (0: none): what the cache held
    /// of them goes, and the reply is kept instead unless anything touched the inode since
    /// the call was sent (a recall, or another change of this agent's, whose reply may be
    /// newer).
    pub fn put_own_attr(
        &self,
        attr: &Attr,
        lease_ms: u64,
        sent: Instant,
        deadline: Instant,
        mark: u64,
    ) {
        self.put_own_write(attr, lease_ms, sent, deadline, mark, None);
    }

    /// [`LeaseCache::put_own_attr`] of a write of this agent's own, with its bytes when it
    /// wrote the whole of a small file (from offset 0 to the size `attr` gives): those are
    /// kept as the file's bytes too, under the same lease, as an open's would be
    /// ([`LeaseCache::put_content`]); so that reading back what `tar x` or `cp` just wrote
    /// asks the server nothing.
    pub fn put_own_write(
        &self,
        attr: &Attr,
        lease_ms: u64,
        sent: Instant,
        deadline: Instant,
        mark: u64,
        whole: Option<&[u8]>,
    ) {
        let mut s = self.lock();
        let quiet = s.usable(mark, attr.ino);
        s.forget(&[attr.ino], &[]);
        let Some(end) = lease_end(sent, lease_ms, deadline).filter(|_| quiet) else {
            return;
        };
        if !s.keep_attr(attr, end) {
            return;
        }
        if let Some(data) = whole.filter(|d| {
            attr.kind == FileType::Regular
                && !d.is_empty()
                && d.len() as u64 == attr.size
                && attr.size <= SMALL_FILE_MAX
        }) {
            // As of now (the forget above touched the inode): what touches it next ends
            // them.
            let kept = Content {
                data: data.to_vec(),
                mark: s.seq,
                until: end,
            };
            if s.keep_content(attr.ino, kept, Instant::now()) {
                self.counters.content_writes.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Keeps the name `name` in `parent` (`None`: known absent) under the directory's entry
    /// lease of `lease_ms` from `sent`. A `lease_ms` of 0 keeps a negative name only under
    /// an entry lease held since before the request was marked.
    #[allow(
        clippy::too_many_arguments,
        reason = "the name, its lease and its request"
    )]
    pub fn put_entry(
        &self,
        parent: InodeId,
        name: &[u8],
        ino: Option<InodeId>,
        lease_ms: u64,
        sent: Instant,
        deadline: Instant,
        mark: u64,
    ) -> bool {
        let now = Instant::now();
        let mut s = self.lock();
        if !s.usable(mark, parent) {
            return false;
        }
        let end = lease_end(sent, lease_ms, deadline);
        if s.names >= MAX_NAMES {
            s.prune(now);
            if s.names >= MAX_NAMES {
                return false;
            }
        }
        let held_since = s
            .dirs
            .get(&parent)
            .filter(|d| d.until > now)
            .map(|d| d.since);
        let until = match end {
            Some(end) => end,
            // No lease of its own (a name found absent): only under a hold older than the
            // request.
            None if held_since.is_some_and(|since| since <= mark) => now,
            None => return false,
        };
        s.hold_name(parent, name, ino, until, now);
        true
    }

    /// An extended attribute of `ino` as `caller` (a key of the caller's credentials) was
    /// answered it before: `Some(None)` for none by that name. Only while the inode's
    /// attribute lease holds (a `SetXattr` or `RemoveXattr` of another node recalls it) and
    /// nothing of this agent's own touched the inode since it was asked.
    #[allow(
        clippy::option_option,
        reason = "not cached / cached absent / cached value"
    )]
    pub fn xattr(&self, ino: InodeId, caller: u64, name: &[u8]) -> Option<Option<Vec<u8>>> {
        let now = Instant::now();
        let hit = {
            let s = self.lock();
            s.xattrs
                .get(&(ino, caller, name.to_vec()))
                .filter(|(_, mark, until)| *until > now && s.usable(*mark, ino))
                .map(|(value, _, _)| value.clone())
                .or_else(|| {
                    // A file made here and given none since: absent, by any name the server
                    // answers "no such attribute" for (not `system.*`: EOPNOTSUPP).
                    (s.bare(ino, now) && plain_xattr_name(name)).then_some(None)
                })
        };
        counted(hit, &self.counters.xattr_hits, &self.counters.xattr_misses)
    }

    /// What the attribute lease held on `ino` now says of it as a small file (at most
    /// [`SMALL_FILE_MAX`] bytes, regular, not empty): an open for reading asks for the bytes
    /// of one that is, or of one no lease speaks of ([`LeaseCache::put_content`]).
    pub fn small_file(&self, ino: InodeId) -> SmallHint {
        let now = Instant::now();
        match self
            .lock()
            .attrs
            .get(&ino)
            .filter(|(_, until)| *until > now)
        {
            None => SmallHint::Unknown,
            Some((a, until))
                if a.kind == FileType::Regular && a.size > 0 && a.size <= SMALL_FILE_MAX =>
            {
                SmallHint::Small(*until)
            }
            Some(_) => SmallHint::NotSmall,
        }
    }

    /// Whether the bytes of `ino` given with an earlier open are kept and still good (an
    /// open need not ask again).
    pub fn holds_content(&self, ino: InodeId) -> bool {
        self.lock().content(ino, Instant::now()).is_some()
    }

    /// Keeps the whole of a small file, given with an open sent at `mark` while the
    /// attribute lease that ends at `until` was held ([`LeaseCache::small_file`]): only if
    /// nothing touched the inode since (a recall, this agent's own change). It answers reads
    /// ([`LeaseCache::content`]) until that lease ends or something touches the inode.
    pub fn put_content(&self, ino: InodeId, data: Vec<u8>, mark: u64, until: Instant) {
        let now = Instant::now();
        let mut s = self.lock();
        if until <= now || !s.usable(mark, ino) {
            return;
        }
        s.drop_content(ino);
        if s.keep_content(ino, Content { data, mark, until }, now) {
            self.counters.content_opens.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A read of `ino` answered from the bytes its open gave ([`LeaseCache::put_content`]):
    /// at most `len` bytes from `offset`, fewer at the end of file (the size is exact while
    /// the lease holds). `None`: not kept, or no longer good. Never blocks: fit for a FUSE
    /// thread.
    pub fn content(&self, ino: InodeId, offset: u64, len: usize) -> Option<Vec<u8>> {
        let now = Instant::now();
        let s = self.lock();
        let data = s.content(ino, now)?;
        let from = usize::try_from(offset)
            .unwrap_or(usize::MAX)
            .min(data.len());
        let to = from.saturating_add(len).min(data.len());
        let out = data[from..to].to_vec();
        drop(s);
        self.counters.content_hits.fetch_add(1, Ordering::Relaxed);
        Some(out)
    }

    /// Whether `ino` is a file this agent made that is known to have no extended attribute
    /// (no ACL, no file capabilities).
    pub fn is_bare(&self, ino: InodeId) -> bool {
        self.lock().bare(ino, Instant::now())
    }

    /// This agent sets or removes an extended attribute of `ino`: it is no longer known to
    /// have none.
    pub fn forget_bare(&self, ino: InodeId) {
        self.lock().bare.remove(&ino);
    }

    /// Keeps the server's answer for an extended attribute (see [`LeaseCache::xattr`]),
    /// asked at `mark`: only while the inode's attributes are held under a lease and nothing
    /// touched it since the request.
    pub fn put_xattr(
        &self,
        ino: InodeId,
        caller: u64,
        name: &[u8],
        value: Option<&[u8]>,
        mark: u64,
    ) {
        if value.is_some_and(|v| v.len() > MAX_XATTR_CACHED) {
            return;
        }
        let now = Instant::now();
        let mut s = self.lock();
        // Good until the lease held now ends: one given later (after this one ran out, when
        // no recall reached this agent) does not vouch for it.
        let Some(until) = s
            .attrs
            .get(&ino)
            .map(|(_, until)| *until)
            .filter(|until| *until > now)
        else {
            return;
        };
        if !s.usable(mark, ino) {
            return;
        }
        if s.xattrs.len() >= MAX_XATTRS {
            s.xattrs.clear();
        }
        s.xattrs.insert(
            (ino, caller, name.to_vec()),
            (value.map(<[u8]>::to_vec), mark, until),
        );
    }

    /// A write by a caller other than root is accepted for `ino`: the server clears the
    /// file's setuid and setgid bits when it applies it (as Linux does for a writer without
    /// CAP_FSETID, [`cleared_setid`]), so what this node holds of its mode shows them cleared
    /// from now on (the kernel asks again after every write: it drops its size and times).
    pub fn written_by_other_than_root(&self, ino: InodeId) {
        let mut s = self.lock();
        if let Some((a, _)) = s.attrs.get_mut(&ino) {
            a.perm = cleared_setid(a.perm);
        }
    }

    /// A recall of the server: forgets the attributes of `ino` (the kernel's too) and/or the
    /// names in directory `ino`. Call it before acknowledging, never on a FUSE thread.
    pub fn recall(&self, ino: InodeId, attr: bool, entries: bool) {
        self.counters.recalls.fetch_add(1, Ordering::Relaxed);
        {
            let mut s = self.lock();
            s.touch(ino);
            let seq = s.seq;
            s.recalled[bucket(ino)] = seq;
            if attr {
                s.attrs.remove(&ino);
                s.drop_content(ino);
            }
            if entries {
                s.drop_dir(ino);
            }
        }
        if entries {
            self.invalidate_kernel_names();
        }
        if attr {
            self.invalidate_kernel(&[ino]);
        }
    }

    /// This agent changes `inos` (attributes) and the names in `dirs`: what it cached there
    /// goes (the kernel updates its own copy from the change's reply).
    pub fn forget(&self, inos: &[InodeId], dirs: &[(InodeId, &[u8])]) {
        self.lock().forget(inos, dirs);
    }

    /// Begins a namespace change of this agent that removes the names `removed` and adds
    /// the names `added` (and changes the attributes of `inos`): what the cache holds of
    /// them and of their directories goes, and the change is noted in progress on each
    /// directory until [`OwnChange::end`]. The first added name is the one a create or mkdir
    /// makes.
    pub fn begin_own(
        &self,
        inos: &[InodeId],
        removed: &[(InodeId, &[u8])],
        added: &[(InodeId, &[u8])],
    ) -> OwnChange<'_> {
        let mut s = self.lock();
        let names: Vec<(InodeId, &[u8])> = added.iter().chain(removed).copied().collect();
        // The inode the first removed name held, as cached now (a rename moves it).
        let now = Instant::now();
        let moved = removed.first().and_then(|(dir, name)| {
            s.dirs
                .get(dir)
                .filter(|d| d.until > now)
                .and_then(|d| d.names.get(*name).copied().flatten())
        });
        s.forget(inos, &names);
        let mut dirs: Vec<(InodeId, u64)> = Vec::new();
        for (dir, _) in &names {
            if dirs.iter().any(|(d, _)| d == dir) {
                continue;
            }
            s.own_next += 1;
            let n = s.own_next;
            let e = s.own.entry(*dir).or_insert((0, 0));
            e.0 += 1;
            e.1 = n;
            dirs.push((*dir, n));
        }
        OwnChange {
            cache: self,
            inos: inos.to_vec(),
            names: names.iter().map(|(d, n)| (*d, n.to_vec())).collect(),
            added: added.len(),
            moved,
            dirs,
            mark: s.seq,
            sent: Instant::now(),
            ended: false,
        }
    }

    /// The session ended or was replaced: nothing cached under its leases is valid any more,
    /// the kernel's attributes included.
    pub fn clear(&self) {
        let inos: Vec<InodeId> = {
            let mut s = self.lock();
            s.seq += 1;
            s.floor = s.seq;
            s.dirs.clear();
            s.names = 0;
            s.xattrs.clear();
            s.contents.clear();
            s.content_bytes = 0;
            s.bare.clear();
            s.used.clear();
            s.attrs.drain().map(|(ino, _)| ino).collect()
        };
        self.invalidate_kernel_names();
        self.invalidate_kernel(&inos);
    }

    /// The leases to ask the server to renew with a heartbeat sent now, and the mark to
    /// apply its answer with ([`LeaseCache::renewed`]): those ending within `horizon` (they
    /// would run out before the heartbeat after next), used here in the last [`RENEW_IDLE`],
    /// the most recently used first, at most [`RENEW_ATTRS`] attribute and [`RENEW_DIRS`]
    /// entry leases (the server holds at most 65,536 inodes per session: room is left for
    /// new ones). `None`: nothing to renew.
    pub fn renewal(&self, horizon: Duration) -> Option<(u64, LeaseRenew)> {
        let now = Instant::now();
        let mut s = self.lock();
        let s = &mut *s;
        // Forget the use of what is no longer cached.
        let (attrs, dirs) = (&s.attrs, &s.dirs);
        s.used
            .retain(|ino, _| attrs.contains_key(ino) || dirs.contains_key(ino));
        let due = |until: Instant| until > now && until <= now + horizon;
        let pick = |used: &mut HashMap<InodeId, Instant>,
                    due_inos: Vec<InodeId>,
                    max: usize|
         -> Vec<InodeId> {
            let mut v: Vec<(Instant, InodeId)> = due_inos
                .into_iter()
                .map(|ino| (*used.entry(ino).or_insert(now), ino))
                .filter(|(at, _)| now.saturating_duration_since(*at) < RENEW_IDLE)
                .collect();
            v.sort_unstable_by_key(|(at, _)| std::cmp::Reverse(*at));
            v.truncate(max);
            v.into_iter().map(|(_, ino)| ino).collect()
        };
        let due_attrs: Vec<InodeId> = s
            .attrs
            .iter()
            .filter(|(_, (_, until))| due(*until))
            .map(|(ino, _)| *ino)
            .collect();
        let due_dirs: Vec<InodeId> = s
            .dirs
            .iter()
            .filter(|(_, d)| due(d.until))
            .map(|(ino, _)| *ino)
            .collect();
        let renew = LeaseRenew {
            attrs: pick(&mut s.used, due_attrs, RENEW_ATTRS),
            entries: pick(&mut s.used, due_dirs, RENEW_DIRS),
        };
        if renew.attrs.is_empty() && renew.entries.is_empty() {
            return None;
        }
        Some((s.seq, renew))
    }

    /// The server renewed, for `lease_ms` from `sent`, the leases of `asked` (sent marked
    /// `mark`) but those in `renewed`'s lost lists: each one still cached here, and that
    /// nothing touched since the heartbeat was marked (a recall, an own change, a new
    /// session), is kept until then (capped at the session's `deadline`).
    pub fn renewed(
        &self,
        mark: u64,
        sent: Instant,
        asked: &LeaseRenew,
        renewed: &LeaseRenewed,
        deadline: Instant,
    ) {
        let Some(end) = lease_end(sent, renewed.lease_ms, deadline) else {
            return;
        };
        let now = Instant::now();
        let lost_attrs: std::collections::HashSet<InodeId> =
            renewed.lost_attrs.iter().copied().collect();
        let lost_dirs: std::collections::HashSet<InodeId> =
            renewed.lost_entries.iter().copied().collect();
        let mut kept = 0u64;
        {
            let mut s = self.lock();
            for ino in asked.attrs.iter().filter(|i| !lost_attrs.contains(i)) {
                if !s.usable(mark, *ino) {
                    continue;
                }
                if let Some((_, until)) = s.attrs.get_mut(ino)
                    && *until > now
                {
                    *until = (*until).max(end);
                    kept += 1;
                    if s.bare(*ino, now)
                        && let Some((_, until)) = s.bare.get_mut(ino)
                    {
                        *until = (*until).max(end);
                    }
                }
            }
            for dir in asked.entries.iter().filter(|i| !lost_dirs.contains(i)) {
                if !s.usable(mark, *dir) {
                    continue;
                }
                if let Some(d) = s.dirs.get_mut(dir)
                    && d.until > now
                {
                    d.until = d.until.max(end);
                    kept += 1;
                }
            }
        }
        self.counters.renewed.fetch_add(kept, Ordering::Relaxed);
        self.counters.renew_lost.fetch_add(
            (renewed.lost_attrs.len() + renewed.lost_entries.len()) as u64,
            Ordering::Relaxed,
        );
    }

    /// Keeps the listing of `dir` that a `ReadDir` with attributes from its start answered
    /// whole (`reply.eof`), under the entry lease that reply gave (the request was marked
    /// `mark`: nothing touched the directory since, so the lease covers what was read).
    pub fn put_listing(&self, dir: InodeId, mark: u64, reply: &ReadDirReply) {
        if !reply.eof {
            return;
        }
        let now = Instant::now();
        let mut s = self.lock();
        let n = reply.entries.len();
        if !s.usable(mark, dir) || s.names + n > MAX_NAMES {
            return;
        }
        let Some(d) = s.dirs.get_mut(&dir).filter(|d| d.until > now) else {
            return;
        };
        let entries = reply
            .entries
            .iter()
            .map(|e| (e.name.clone(), e.inode, e.kind, e.cookie))
            .collect();
        let old = d.listing.replace(Listing {
            parent: reply.parent,
            entries,
        });
        let old = old.map_or(0, |l| l.entries.len());
        s.names = s.names + n - old;
    }

    /// Entries of `dir`'s listing after `cookie` (0: from the start), at most `max`, from the
    /// listing kept under its entry lease, with their attributes (`plus`) from the attribute
    /// leases; `None` when not kept, or when an entry's attributes are not.
    pub fn listing(
        &self,
        dir: InodeId,
        cookie: u64,
        max: usize,
        plus: bool,
    ) -> Option<ReadDirReply> {
        let now = Instant::now();
        let hit = {
            let mut s = self.lock();
            let hit = s.listed(dir, cookie, max, plus, now);
            if hit.is_some() {
                s.used.insert(dir, now);
            }
            hit
        };
        counted(
            hit,
            &self.counters.listing_hits,
            &self.counters.listing_misses,
        )
    }

    /// (attributes, names) kept now.
    pub fn size(&self) -> (usize, usize) {
        let s = self.lock();
        (s.attrs.len(), s.names)
    }
}

/// A namespace change of this agent in progress ([`LeaseCache::begin_own`]).
#[must_use = "end it with the change's reply"]
#[derive(Debug)]
pub struct OwnChange<'a> {
    cache: &'a LeaseCache,
    inos: Vec<InodeId>,
    /// The names added (the first `added`), then those removed.
    names: Vec<(InodeId, Vec<u8>)>,
    added: usize,
    /// The inode of the first removed name, where the cache knew it when the change began.
    moved: Option<InodeId>,
    /// Each directory and the number of this change there.
    dirs: Vec<(InodeId, u64)>,
    mark: u64,
    sent: Instant,
    ended: bool,
}

impl OwnChange<'_> {
    /// The change is answered (or failed: `changed` is `None`). What the cache holds of its
    /// names goes again (a reply of this agent's own that was read before the change may
    /// have come meanwhile), and the directories the server says it altered are kept under
    /// the leases given with them, unless a recall came there since the change began or
    /// another change of this agent ran there meanwhile (its reply may be newer).
    pub fn end(mut self, changed: Option<&ChangedDirs>, deadline: Instant) {
        self.finish(changed, None, deadline);
    }

    /// [`OwnChange::end`] of a create: `made` is the file it made or opened (the first
    /// added name) and the term of the leases on it and its directory's names given with
    /// the reply; kept under the same rules. Answers how long the kernel may keep them.
    /// `created`: the call made the file (it has no extended attribute yet).
    pub fn end_made(
        mut self,
        changed: Option<&ChangedDirs>,
        made: (&Attr, u64),
        created: bool,
        deadline: Instant,
    ) -> Option<Duration> {
        self.finish(changed, Some(Made::File(made.0, made.1, created)), deadline)
    }

    /// [`OwnChange::end`] of a change of the attributes of its inode (the only one): `attr`
    /// as changed and the term of the lease on it given with the reply; kept unless a recall
    /// came there since the change began.
    pub fn end_attr(
        mut self,
        changed: Option<&ChangedDirs>,
        attr: (&Attr, u64),
        deadline: Instant,
    ) {
        self.finish(changed, Some(Made::Attr(attr.0, attr.1)), deadline);
    }

    /// [`OwnChange::end`] of a mkdir that made `dir`: with the leases the reply gave on it
    /// (its attributes and its names), it is kept as a directory whose every name is known:
    /// none yet.
    pub fn end_mkdir(mut self, changed: Option<&ChangedDirs>, dir: &Attr, deadline: Instant) {
        self.finish(changed, Some(Made::Dir(dir)), deadline);
    }

    /// [`OwnChange::end`] of a rename that moved the first removed name to the first added
    /// one (not an exchange): the new name is put with the inode the old one held, where the
    /// cache knew it, so that a directory known complete stays so (a later lookup of a name
    /// absent there needs no round trip).
    pub fn end_moved(mut self, changed: Option<&ChangedDirs>, deadline: Instant) {
        let made = self.moved.map(Made::Moved);
        self.finish(changed, made, deadline);
    }

    fn finish(
        &mut self,
        changed: Option<&ChangedDirs>,
        made: Option<Made<'_>>,
        deadline: Instant,
    ) -> Option<Duration> {
        self.ended = true;
        let names: Vec<(InodeId, &[u8])> =
            self.names.iter().map(|(d, n)| (*d, n.as_slice())).collect();
        let now = Instant::now();
        let mut s = self.cache.lock();
        // An attribute change's reply is kept only if nothing touched the inode since the
        // change began (a recall, or another change of this agent's: its reply may be newer).
        let untouched = match &made {
            Some(Made::Attr(attr, _)) => s.usable(self.mark, attr.ino),
            _ => false,
        };
        s.forget(&self.inos, &names);
        // Whether the first added name's directory knew every name (kept if it is put).
        let was_complete = names[..self.added]
            .first()
            .is_some_and(|(dir, _)| s.dirs.get(dir).is_some_and(|d| d.until > now && d.complete));
        // A name this change added is not known until put back below.
        for (dir, _) in &names[..self.added] {
            if let Some(d) = s.dirs.get_mut(dir) {
                d.complete = false;
            }
        }
        let quiet =
            |s: &State, ino: InodeId| self.mark >= s.floor && s.recalled[bucket(ino)] <= self.mark;
        let alone = |s: &State, dir: InodeId, n: u64| {
            s.own
                .get(&dir)
                .is_some_and(|(busy, last)| *busy == 1 && *last == n)
        };
        let first = match (self.added, self.names.first(), self.dirs.first()) {
            (1.., Some((dir, name)), Some((_, n))) => Some((
                *dir,
                name.as_slice(),
                alone(&s, *dir, *n) && quiet(&s, *dir),
            )),
            _ => None,
        };
        let mut ttl = None;
        match (made, first) {
            (Some(Made::File(attr, lease_ms, created)), Some((dir, name, true)))
                if quiet(&s, attr.ino) && s.attrs.len() < MAX_ATTRS && s.names < MAX_NAMES =>
            {
                // The create's leases cover the file and the directory's names.
                if let Some(end) = lease_end(self.sent, lease_ms, deadline) {
                    s.attrs.insert(attr.ino, (attr.clone(), end));
                    s.put_own_name(dir, name, attr.ino, end, now, was_complete);
                    ttl = Some(end.saturating_duration_since(now));
                    if created {
                        s.keep_bare(attr.ino, self.mark, end);
                    }
                }
            }
            (Some(Made::Dir(attr)), Some((parent, name, true)))
                if quiet(&s, attr.ino) && s.attrs.len() < MAX_ATTRS =>
            {
                let leased = changed
                    .filter(|c| c.attrs.iter().any(|a| a.ino == attr.ino))
                    .and_then(|c| lease_end(self.sent, c.lease_ms, deadline));
                if let Some(end) = leased {
                    s.attrs.insert(attr.ino, (attr.clone(), end));
                    s.hold_empty_dir(attr.ino, end);
                    // Its name, where the parent's names are held already.
                    if s.names < MAX_NAMES && s.dirs.get(&parent).is_some_and(|d| d.until > now) {
                        s.put_own_name(parent, name, attr.ino, now, now, was_complete);
                    }
                }
            }
            (Some(Made::Attr(attr, lease_ms)), _) if untouched && self.inos == [attr.ino] => {
                if let Some(end) = lease_end(self.sent, lease_ms, deadline)
                    && s.keep_attr(attr, end)
                {
                    ttl = Some(end.saturating_duration_since(now));
                }
            }
            (Some(Made::Moved(ino)), Some((dir, name, true)))
                if s.names < MAX_NAMES && s.dirs.get(&dir).is_some_and(|d| d.until > now) =>
            {
                // Under the directory's hold as it is (its term unchanged).
                s.put_own_name(dir, name, ino, now, now, was_complete);
            }
            _ => {}
        }
        for (dir, n) in &self.dirs {
            if alone(&s, *dir, *n)
                && quiet(&s, *dir)
                && let Some(changed) = changed
                && let Some(attr) = changed.attrs.iter().find(|a| a.ino == *dir)
                && let Some(end) = lease_end(self.sent, changed.lease_ms, deadline)
                && (s.attrs.len() < MAX_ATTRS || s.attrs.contains_key(dir))
            {
                s.attrs.insert(*dir, (attr.clone(), end));
            }
            if let Some(e) = s.own.get_mut(dir) {
                e.0 -= 1;
                if e.0 == 0 {
                    s.own.remove(dir);
                }
            }
        }
        ttl
    }
}

/// What a create or mkdir made ([`OwnChange::end_made`], [`OwnChange::end_mkdir`]).
enum Made<'a> {
    /// A file, the term of the create's leases, and whether the call made it.
    File(&'a Attr, u64, bool),
    /// A directory (its leases come with the changed directories).
    Dir(&'a Attr),
    /// A name moved (renamed) with the inode it held.
    Moved(InodeId),
    /// The attributes an attribute change left, and the term of the lease given on them.
    Attr(&'a Attr, u64),
}

impl Drop for OwnChange<'_> {
    fn drop(&mut self) {
        if !self.ended {
            self.finish(None, None, Instant::now());
        }
    }
}

/// An attribute or entry answered with how long the kernel may keep it (`None`: no lease,
/// the mount's TTL without one applies).
pub type WithTtl<T> = (T, Option<Duration>);

impl Client {
    /// The lease cache's counters (status, metrics).
    pub fn lease_counts(&self) -> super::status::LeaseCounts {
        let c = &self.inner.leases.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let (attrs, names) = self.inner.leases.size();
        super::status::LeaseCounts {
            attr_hits: get(&c.attr_hits),
            attr_misses: get(&c.attr_misses),
            entry_hits: get(&c.entry_hits),
            entry_misses: get(&c.entry_misses),
            xattr_hits: get(&c.xattr_hits),
            xattr_misses: get(&c.xattr_misses),
            access_hits: get(&c.access_hits),
            access_misses: get(&c.access_misses),
            small_file_opens: get(&c.content_opens),
            small_file_reads: get(&c.content_hits),
            small_files_written: get(&c.content_writes),
            recalls: get(&c.recalls),
            listing_hits: get(&c.listing_hits),
            listing_misses: get(&c.listing_misses),
            renewed: get(&c.renewed),
            renew_lost: get(&c.renew_lost),
            attrs_now: attrs as u64,
            names_now: names as u64,
            kernel_names: self.inner.leases.kernel_names(),
        }
    }

    /// The attribute and entry lease cache of this agent.
    pub fn leases(&self) -> &LeaseCache {
        &self.inner.leases
    }

    /// When the session's lease ends (agent rule), or now when it is not live.
    pub(super) fn lease_deadline(&self) -> Instant {
        self.inner.lease_deadline()
    }

    /// A lookup answered from the cache while its leases hold (`None`: ask the server with
    /// [`Client::lookup_leased`]). Never blocks: fit for a FUSE thread.
    pub fn cached_lookup(
        &self,
        parent: InodeId,
        entry: &[u8],
    ) -> Option<Result<WithTtl<Attr>, FsError>> {
        // A name the server would refuse (too long, `/`, NUL, `.`, `..`) is never answered
        // here (a directory known complete would say "absent"): the server's error stands.
        if entry.is_empty()
            || entry.len() > sanfs_proto::types::NAME_MAX
            || entry.iter().any(|&b| b == b'/' || b == 0)
            || entry == b"."
            || entry == b".."
        {
            return None;
        }
        Some(match self.inner.leases.entry(parent, entry)? {
            // This node's own writes of the file complete behind them: the server's size
            // and mtime wait for them (see `lookup_leased`).
            Some((attr, _)) if self.inner.completing(attr.ino) => return None,
            Some((attr, ttl)) => Ok((attr, Some(ttl))),
            None => Err(FsError::NotFound),
        })
    }

    /// The file's size as this node's reads must see it, where it is known exactly without
    /// asking: its size under the attribute lease (no other node changes it while the lease
    /// lives: a write grant or delegation recalls it first; none while this node's own
    /// completions are on their way), grown by what this node holds back. `None`: unknown.
    /// Never blocks: fit for a FUSE thread.
    pub fn leased_size(&self, ino: InodeId) -> Option<u64> {
        let (attr, _) = self.cached_attr(ino)?;
        (attr.kind == FileType::Regular).then(|| self.buffered_attr(attr).size)
    }

    /// Attributes answered from the cache while their lease holds (`None`: ask the server
    /// with [`Client::getattr_leased`]). Never blocks: fit for a FUSE thread.
    pub fn cached_attr(&self, ino: InodeId) -> Option<WithTtl<Attr>> {
        // The lease was taken before this node's own writes whose completions are still on
        // their way: their size and mtime are not in it (the completion forgets it).
        if self.inner.completing(ino) {
            return None;
        }
        self.inner
            .leases
            .attr(ino)
            .map(|(attr, ttl)| (attr, Some(ttl)))
    }

    /// A permission check (an open of a directory) answered under the inode's attribute
    /// lease, where its mode and owners are exact: the server's own rule on them, which the
    /// server applies again at every call the access is for. `None`: ask the server.
    pub(crate) fn leased_access(
        &self,
        cred: &Credentials,
        ino: InodeId,
        mask: u32,
    ) -> Option<Result<(), FsError>> {
        // With this node's held-back attribute changes (a mode changed here).
        let answer = self.cached_attr(ino).map(|(attr, _)| {
            if self.buffered_attr(attr).permits(cred, mask & 7) {
                Ok(())
            } else {
                Err(FsError::Access)
            }
        });
        let c = &self.inner.leases.counters;
        counted(answer, &c.access_hits, &c.access_misses)
    }

    /// An extended attribute answered from the cache (`None`: ask the server with
    /// [`Client::getxattr`], which keeps its answer). Never blocks: fit for a FUSE thread.
    pub fn cached_xattr(
        &self,
        cred: &Credentials,
        ino: InodeId,
        name: &[u8],
    ) -> Option<Result<Vec<u8>, FsError>> {
        let v = self.inner.leases.xattr(ino, caller_key(cred), name)?;
        Some(v.ok_or(FsError::NoAttr))
    }

    /// Lookup from the server, asking for an attribute lease on the inode and an entry lease
    /// on `parent` (see [`Client::cached_lookup`] first).
    pub async fn lookup_leased(
        &self,
        cred: &Credentials,
        parent: InodeId,
        entry: &[u8],
    ) -> Result<WithTtl<Attr>, FsError> {
        let cache = &self.inner.leases;
        let name = FileName::new(entry.to_vec())?;
        let (mark, sent) = (cache.mark(), Instant::now());
        let r: Result<Leased<Attr>, FsError> = self
            .inner
            .call("Lookup reply", Pin::Any, |view| {
                let req = pb::LookupRequest::from(LeasedLookup {
                    entry: EntryRequest {
                        cred: cred.clone(),
                        parent,
                        name: name.clone(),
                    },
                    session: Some(view.session),
                });
                let mut ns = self.inner.ns();
                async move { ns.lookup(req).await }
            })
            .await;
        let deadline = self.lease_deadline();
        match r {
            Ok(l) => {
                let ino = l.value.ino;
                let (attr, ttl) = if self.inner.completing(ino) {
                    // This node's own writes of the file complete behind them: the size and
                    // mtime answered may not show them. Asked again once they are completed.
                    self.getattr_leased(cred, ino).await?
                } else {
                    let ttl = cache.put_attr(&l.value, l.lease_ms, sent, deadline, mark);
                    (l.value, ttl)
                };
                // The TTL the kernel gets covers the name too: both must be kept.
                let named = ttl.is_some()
                    && cache.put_entry(parent, entry, Some(ino), l.lease_ms, sent, deadline, mark);
                Ok((attr, ttl.filter(|_| named)))
            }
            Err(FsError::NotFound) => {
                // Absent: kept only under an entry lease held since before the request.
                cache.put_entry(parent, entry, None, 0, sent, deadline, mark);
                Err(FsError::NotFound)
            }
            Err(e) => Err(e),
        }
    }

    /// GetAttr from the server, asking for an attribute lease (see [`Client::cached_attr`]
    /// first).
    pub async fn getattr_leased(
        &self,
        cred: &Credentials,
        ino: InodeId,
    ) -> Result<WithTtl<Attr>, FsError> {
        let cache = &self.inner.leases;
        // This agent's writes completed behind them count (size, mtime).
        self.inner.settle(ino).await;
        let (mark, sent) = (cache.mark(), Instant::now());
        let l: Leased<Attr> = self
            .inner
            .call("GetAttr reply", Pin::Any, |view| {
                let req = pb::GetAttrRequest::from(GetAttrRequest {
                    cred: cred.clone(),
                    inode: ino,
                    session: Some(view.session),
                });
                let mut ns = self.inner.ns();
                async move { ns.get_attr(req).await }
            })
            .await?;
        let ttl = cache.put_attr(&l.value, l.lease_ms, sent, self.lease_deadline(), mark);
        Ok((l.value, ttl))
    }

    /// ReadDir asking for leases: with `plus`, the entries and their attributes go into the
    /// cache (later lookups of them are answered here).
    pub async fn readdir_leased(
        &self,
        cred: &Credentials,
        ino: InodeId,
        cookie: u64,
        max_entries: u32,
        plus: bool,
    ) -> Result<ReadDirReply, FsError> {
        let cache = &self.inner.leases;
        if let Some(r) = self.cached_listing(ino, cookie, max_entries, plus) {
            return Ok(r);
        }
        // A listing from its start is asked whole (up to the most one reply holds), so that
        // it can be kept under the entry lease its reply gives.
        let max_entries = if cookie == 0 && plus {
            sanfs_proto::model::MAX_READDIR_ENTRIES
        } else {
            max_entries
        };
        let (mark, sent) = (cache.mark(), Instant::now());
        let mut l: Leased<ReadDirReply> = self
            .inner
            .call("ReadDir reply", Pin::Any, |view| {
                let req = pb::ReadDirRequest::from(LeasedReadDir {
                    request: ReadDirRequest {
                        cred: cred.clone(),
                        inode: ino,
                        cookie,
                        max_entries: max_entries.clamp(1, sanfs_proto::model::MAX_READDIR_ENTRIES),
                        plus,
                    },
                    session: plus.then_some(view.session),
                });
                // The session header even without leases: the server then syncs only other
                // sessions' changes before it answers, not this one's.
                let req = super::rpc::with_session(req, view);
                let mut ns = self.inner.ns();
                async move { ns.read_dir(req).await }
            })
            .await?;
        for e in &mut l.value.entries {
            if let Some(a) = e.attr.as_mut()
                && self.inner.completing(e.inode)
            {
                // This node's own writes of the file complete behind them (see
                // `lookup_leased`): its attributes are asked again once they are.
                *a = self.getattr_leased(cred, e.inode).await?.0;
            }
        }
        if plus && l.lease_ms > 0 {
            let deadline = self.lease_deadline();
            for e in &l.value.entries {
                if let Some(a) = &e.attr
                    && cache
                        .put_attr(a, l.lease_ms, sent, deadline, mark)
                        .is_some()
                {
                    cache.put_entry(
                        ino,
                        e.name.as_bytes(),
                        Some(e.inode),
                        l.lease_ms,
                        sent,
                        deadline,
                        mark,
                    );
                }
            }
            if cookie == 0 {
                cache.put_listing(ino, mark, &l.value);
            }
        }
        Ok(l.value)
    }

    /// A listing answered from the one kept under the directory's entry lease
    /// ([`LeaseCache::listing`]), unless an entry's attributes wait for this node's own
    /// writes to complete (see `lookup_leased`).
    pub(super) fn cached_listing(
        &self,
        ino: InodeId,
        cookie: u64,
        max_entries: u32,
        plus: bool,
    ) -> Option<ReadDirReply> {
        let r = self
            .inner
            .leases
            .listing(ino, cookie, max_entries as usize, plus)?;
        (!r.entries.iter().any(|e| self.inner.completing(e.inode))).then_some(r)
    }
}

/// Who asks, as a key of the extended attribute cache: answers depend on the caller (a
/// `trusted.` name, a file it may not read), so one caller's are never another's.
pub(super) fn caller_key(cred: &Credentials) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    cred.uid.hash(&mut h);
    cred.gid.hash(&mut h);
    cred.groups.hash(&mut h);
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;
    use sanfs_proto::types::{FileType, Timestamp};

    fn attr(ino: u64) -> Attr {
        let t = Timestamp { sec: 0, nsec: 0 };
        Attr {
            ino: InodeId(ino),
            kind: FileType::Regular,
            perm: 0o644,
            nlink: 1,
            uid: 0,
            gid: 0,
            size: 0,
            allocated: 0,
            atime: t,
            mtime: t,
            ctime: t,
            btime: t,
            rdev: 0,
            generation: 0,
            no_xattrs: false,
        }
    }

    fn far() -> Instant {
        Instant::now() + Duration::from_secs(3600)
    }

    #[test]
    fn a_recall_before_the_reply_makes_its_lease_unusable() {
        let c = LeaseCache::default();
        let mark = c.mark();
        c.recall(InodeId(5), true, false);
        assert_eq!(
            c.put_attr(&attr(5), 10_000, Instant::now(), far(), mark),
            None
        );
        assert!(c.attr(InodeId(5)).is_none());
        let mark = c.mark();
        let ttl = c.put_attr(&attr(5), 10_000, Instant::now(), far(), mark);
        assert!(ttl.is_some_and(|t| t > Duration::from_secs(9)));
        assert!(c.attr(InodeId(5)).is_some());
        c.recall(InodeId(5), true, false);
        assert!(c.attr(InodeId(5)).is_none());
    }

    #[test]
    fn a_heartbeat_renews_what_is_due_and_untouched_and_nothing_the_server_lost() {
        let c = LeaseCache::default();
        let now = Instant::now();
        // 5, 6 and 7 end within the horizon, 8 well after it; directory 1 within it.
        for ino in [5, 6, 7] {
            c.put_attr(&attr(ino), 2_000, now, far(), c.mark());
        }
        c.put_attr(&attr(8), 60_000, now, far(), c.mark());
        assert!(c.put_entry(InodeId(1), b"x", None, 2_000, now, far(), c.mark()));
        let (mark, asked) = c.renewal(Duration::from_secs(5)).expect("leases are due");
        let mut attrs = asked.attrs.clone();
        attrs.sort_unstable();
        assert_eq!(attrs, vec![InodeId(5), InodeId(6), InodeId(7)]);
        assert_eq!(asked.entries, vec![InodeId(1)]);
        // A recall of 6 after the heartbeat was marked: not renewed here, whatever the
        // server says; 7 the server no longer held.
        c.recall(InodeId(6), true, false);
        let sent = Instant::now();
        let answer = LeaseRenewed {
            lease_ms: 30_000,
            lost_attrs: vec![InodeId(7)],
            lost_entries: vec![],
        };
        c.renewed(mark, sent, &asked, &answer, far());
        let ttl = |ino| c.attr(InodeId(ino)).map(|(_, t)| t);
        assert!(
            ttl(5).is_some_and(|t| t > Duration::from_secs(20)),
            "renewed"
        );
        assert!(ttl(6).is_none(), "recalled");
        assert!(
            ttl(7).is_some_and(|t| t <= Duration::from_secs(2)),
            "lost: as it was"
        );
        assert!(
            c.negative_ttl(InodeId(1), b"x")
                .is_some_and(|t| t > Duration::from_secs(20))
        );
        assert_eq!(c.counters.renewed.load(Ordering::Relaxed), 2);
        assert_eq!(c.counters.renew_lost.load(Ordering::Relaxed), 1);
        // Never past the session's deadline.
        let (mark, asked) = c.renewal(Duration::from_secs(5)).expect("7 is still due");
        assert_eq!(asked.attrs, vec![InodeId(7)]);
        let deadline = Instant::now() + Duration::from_secs(3);
        let answer = LeaseRenewed {
            lease_ms: 30_000,
            lost_attrs: vec![],
            lost_entries: vec![],
        };
        c.renewed(mark, Instant::now(), &asked, &answer, deadline);
        assert!(ttl(7).is_some_and(|t| t <= Duration::from_secs(3)));
        // A new session: nothing is renewed from a heartbeat marked before it.
        let (mark, asked) = c.renewal(Duration::from_secs(5)).expect("7 is due");
        c.clear();
        c.put_attr(&attr(7), 2_000, Instant::now(), far(), c.mark());
        c.renewed(mark, Instant::now(), &asked, &answer, far());
        assert!(ttl(7).is_some_and(|t| t <= Duration::from_secs(2)));
    }

    #[test]
    fn attributes_that_say_no_xattrs_answer_absent_names_until_a_recall() {
        let c = LeaseCache::default();
        let mut a = attr(9);
        c.put_attr(&a, 10_000, Instant::now(), far(), c.mark());
        assert_eq!(c.xattr(InodeId(9), 0, b"user.x"), None, "not said: ask");
        a.no_xattrs = true;
        c.put_attr(&a, 10_000, Instant::now(), far(), c.mark());
        assert_eq!(c.xattr(InodeId(9), 0, b"user.x"), Some(None));
        assert_eq!(c.xattr(InodeId(9), 0, b"system.posix_acl_access"), None);
        c.recall(InodeId(9), true, false);
        assert_eq!(c.xattr(InodeId(9), 0, b"user.x"), None);
        // A reply marked before a recall says nothing.
        let mark = c.mark();
        c.recall(InodeId(9), true, false);
        c.put_attr(&a, 10_000, Instant::now(), far(), mark);
        assert_eq!(c.xattr(InodeId(9), 0, b"user.x"), None);
    }

    #[test]
    fn the_most_recently_used_are_renewed_and_the_idle_run_out() {
        let c = LeaseCache::default();
        let now = Instant::now();
        for ino in 1..=3 {
            c.put_attr(&attr(ino), 2_000, now, far(), c.mark());
        }
        // First seen by a renewal: as if used then.
        let (_, asked) = c.renewal(Duration::from_secs(5)).unwrap();
        assert_eq!(asked.attrs.len(), 3);
        {
            let mut s = c.lock();
            let long_ago = now.checked_sub(RENEW_IDLE + Duration::from_secs(1));
            for ino in [1, 2] {
                if let Some(at) = long_ago {
                    s.used.insert(InodeId(ino), at);
                }
            }
        }
        // 2 is used again; 1 stays idle.
        assert!(c.attr(InodeId(2)).is_some());
        let (_, asked) = c.renewal(Duration::from_secs(5)).unwrap();
        if now
            .checked_sub(RENEW_IDLE + Duration::from_secs(1))
            .is_some()
        {
            assert_eq!(asked.attrs, vec![InodeId(2), InodeId(3)]);
        }
    }

    fn small(ino: u64, size: u64) -> Attr {
        let mut a = attr(ino);
        a.size = size;
        a
    }

    #[test]
    fn a_small_files_bytes_answer_reads_until_a_recall_an_own_change_or_the_leases_end() {
        let c = LeaseCache::default();
        let ino = InodeId(7);
        assert_eq!(c.small_file(ino), SmallHint::Unknown, "no lease");
        c.put_attr(&small(7, 5), 10_000, Instant::now(), far(), c.mark());
        let SmallHint::Small(until) = c.small_file(ino) else {
            panic!("a small file under its lease");
        };
        let mark = c.mark();
        c.put_content(ino, b"hello".to_vec(), mark, until);
        assert!(c.holds_content(ino));
        assert_eq!(c.content(ino, 1, 3), Some(b"ell".to_vec()));
        assert_eq!(c.content(ino, 4, 100), Some(b"o".to_vec()));
        assert_eq!(
            c.content(ino, 9, 1),
            Some(Vec::new()),
            "past the end of file"
        );
        c.recall(ino, true, false);
        assert_eq!(c.content(ino, 0, 5), None, "a recall drops them");
        // Asked before a recall that came before the reply: never kept.
        c.put_attr(&small(7, 5), 10_000, Instant::now(), far(), c.mark());
        let mark = c.mark();
        c.recall(ino, true, false);
        c.put_content(ino, b"hello".to_vec(), mark, far());
        assert!(!c.holds_content(ino));
        // This agent's own change of the file drops them.
        c.put_attr(&small(7, 5), 10_000, Instant::now(), far(), c.mark());
        c.put_content(ino, b"hello".to_vec(), c.mark(), far());
        assert!(c.holds_content(ino));
        c.forget(&[ino], &[]);
        assert_eq!(c.content(ino, 0, 5), None);
        // Good only until the lease held when they were asked ends, even if a later reply
        // gives a new one (another node may have written in between, unrecalled).
        c.put_content(ino, b"hello".to_vec(), c.mark(), Instant::now());
        assert!(!c.holds_content(ino), "a lease already over keeps nothing");
        let soon = Instant::now() + Duration::from_millis(30);
        c.put_content(ino, b"hello".to_vec(), c.mark(), soon);
        assert!(c.holds_content(ino));
        std::thread::sleep(Duration::from_millis(40));
        c.put_attr(&small(7, 5), 10_000, Instant::now(), far(), c.mark());
        assert_eq!(c.content(ino, 0, 5), None);
        // A new session forgets everything.
        c.put_content(ino, b"hello".to_vec(), c.mark(), far());
        c.clear();
        assert!(!c.holds_content(ino));
    }

    #[test]
    fn a_small_file_written_whole_here_keeps_its_bytes_under_the_writes_lease() {
        let c = LeaseCache::default();
        let ino = InodeId(7);
        let now = Instant::now;
        // The whole file, from 0 to its size: kept, and read back.
        c.put_own_write(&small(7, 5), 10_000, now(), far(), c.mark(), Some(b"hello"));
        assert_eq!(c.content(ino, 0, 5), Some(b"hello".to_vec()));
        assert!(c.attr(ino).is_some(), "with the write's attributes");
        // Not the whole file (the size says more), no lease, or a touch while the write was
        // on its way: nothing kept (the bytes held before go with the own change).
        c.put_own_write(&small(7, 6), 10_000, now(), far(), c.mark(), Some(b"hello"));
        assert!(!c.holds_content(ino));
        c.put_own_write(&small(7, 5), 0, now(), far(), c.mark(), Some(b"hello"));
        assert!(!c.holds_content(ino));
        let mark = c.mark();
        c.recall(ino, true, false);
        c.put_own_write(&small(7, 5), 10_000, now(), far(), mark, Some(b"hello"));
        assert!(!c.holds_content(ino) && c.attr(ino).is_none());
        // Kept, then ended by a recall, and by this agent's next change.
        c.put_own_write(&small(7, 5), 10_000, now(), far(), c.mark(), Some(b"hello"));
        c.recall(ino, true, false);
        assert!(!c.holds_content(ino));
        c.put_own_write(&small(7, 5), 10_000, now(), far(), c.mark(), Some(b"hello"));
        c.put_own_attr(&small(7, 9), 10_000, now(), far(), c.mark());
        assert!(!c.holds_content(ino));
    }

    #[test]
    fn a_lease_says_whether_a_file_is_small() {
        let c = LeaseCache::default();
        let m = c.mark();
        c.put_attr(&small(1, 0), 10_000, Instant::now(), far(), m);
        c.put_attr(
            &small(2, SMALL_FILE_MAX + 1),
            10_000,
            Instant::now(),
            far(),
            m,
        );
        let mut dir = small(3, 10);
        dir.kind = FileType::Directory;
        c.put_attr(&dir, 10_000, Instant::now(), far(), m);
        c.put_attr(&small(4, SMALL_FILE_MAX), 10_000, Instant::now(), far(), m);
        assert_eq!(c.small_file(InodeId(1)), SmallHint::NotSmall, "empty");
        assert_eq!(c.small_file(InodeId(2)), SmallHint::NotSmall, "too long");
        assert_eq!(c.small_file(InodeId(3)), SmallHint::NotSmall, "a directory");
        assert!(matches!(c.small_file(InodeId(4)), SmallHint::Small(_)));
        assert_eq!(c.small_file(InodeId(5)), SmallHint::Unknown, "no lease");
    }

    #[test]
    fn an_extended_attribute_is_good_only_under_the_lease_it_was_asked_under() {
        let c = LeaseCache::default();
        let ino = InodeId(8);
        let soon = Instant::now() + Duration::from_millis(30);
        c.put_attr(&attr(8), 10_000, Instant::now(), soon, c.mark());
        c.put_xattr(ino, 1, b"user.a", Some(b"v"), c.mark());
        assert_eq!(c.xattr(ino, 1, b"user.a"), Some(Some(b"v".to_vec())));
        std::thread::sleep(Duration::from_millis(40));
        // A new lease after the old one ran out does not vouch for the old answer.
        c.put_attr(&attr(8), 10_000, Instant::now(), far(), c.mark());
        assert_eq!(c.xattr(ino, 1, b"user.a"), None);
    }

    #[test]
    fn names_live_under_the_directory_lease_and_go_with_its_recall() {
        let c = LeaseCache::default();
        let (dir, sent) = (InodeId(2), Instant::now());
        let mark = c.mark();
        c.put_attr(&attr(9), 10_000, sent, far(), mark);
        c.put_entry(dir, b"a", Some(InodeId(9)), 10_000, sent, far(), mark);
        // A negative name needs an entry lease held since before its request.
        let mark = c.mark();
        c.put_entry(dir, b"gone", None, 0, sent, far(), mark);
        assert!(matches!(c.entry(dir, b"a"), Some(Some((a, _))) if a.ino == InodeId(9)));
        assert_eq!(c.entry(dir, b"gone"), Some(None));
        assert_eq!(c.entry(dir, b"other"), None);
        c.recall(dir, false, true);
        assert_eq!(c.entry(dir, b"a"), None);
        assert_eq!(c.entry(dir, b"gone"), None);
        // No lease on the directory: no negative name.
        c.put_entry(dir, b"gone", None, 0, sent, far(), c.mark());
        assert_eq!(c.entry(dir, b"gone"), None);
        assert_eq!(c.size().1, 0);
    }

    #[test]
    fn a_hold_newer_than_the_request_keeps_no_absent_name_and_a_lapsed_hold_nothing() {
        let c = LeaseCache::default();
        let dir = InodeId(2);
        // A lookup of "x" sent before the directory's hold began: its "absent" may predate a
        // change that no recall could have told this agent about.
        let early = c.mark();
        let mark = c.mark();
        c.put_attr(&attr(9), 10_000, Instant::now(), far(), mark);
        c.put_entry(dir, b"a", Some(InodeId(9)), 50, Instant::now(), far(), mark);
        assert!(!c.put_entry(dir, b"x", None, 0, Instant::now(), far(), early));
        assert_eq!(c.entry(dir, b"x"), None);
        assert_eq!(c.negative_ttl(dir, b"x"), None);
        assert!(c.put_entry(dir, b"y", None, 0, Instant::now(), far(), c.mark()));
        assert!(c.negative_ttl(dir, b"y").is_some());
        // The hold runs out; a new one must not bring back what the old one kept.
        std::thread::sleep(Duration::from_millis(80));
        let mark = c.mark();
        c.put_entry(
            dir,
            b"b",
            Some(InodeId(9)),
            10_000,
            Instant::now(),
            far(),
            mark,
        );
        assert_eq!(c.entry(dir, b"a"), None);
        assert_eq!(c.negative_ttl(dir, b"y"), None);
        assert!(matches!(c.entry(dir, b"b"), Some(Some(_))));
        assert_eq!(c.size().1, 1);
    }

    fn dir(ino: u64) -> Attr {
        Attr {
            kind: FileType::Directory,
            ..attr(ino)
        }
    }

    #[test]
    fn an_own_change_keeps_its_directory_unless_a_recall_or_another_change_came() {
        let c = LeaseCache::default();
        let d = InodeId(2);
        let changed = ChangedDirs {
            attrs: vec![dir(2)],
            lease_ms: 10_000,
        };
        // Alone: the directory's new attributes are kept, the name is forgotten.
        let mark = c.mark();
        c.put_attr(&attr(9), 10_000, Instant::now(), far(), mark);
        c.put_entry(
            d,
            b"a",
            Some(InodeId(9)),
            10_000,
            Instant::now(),
            far(),
            mark,
        );
        let own = c.begin_own(&[], &[(d, b"a".as_slice())], &[]);
        assert!(
            c.attr(InodeId(9)).is_none(),
            "the name's inode goes at the start"
        );
        own.end(Some(&changed), far());
        assert!(c.attr(d).is_some());
        assert_eq!(c.entry(d, b"a"), None);
        // A recall of the directory during the change: nothing kept.
        let own = c.begin_own(&[], &[], &[(d, b"b".as_slice())]);
        assert!(c.attr(d).is_none());
        c.recall(d, true, false);
        own.end(Some(&changed), far());
        assert!(c.attr(d).is_none());
        // Two changes of this agent at once in one directory: neither reply is kept (either
        // may be the older one).
        let first = c.begin_own(&[], &[], &[(d, b"c".as_slice())]);
        let second = c.begin_own(&[], &[], &[(d, b"e".as_slice())]);
        second.end(Some(&changed), far());
        assert!(c.attr(d).is_none());
        first.end(Some(&changed), far());
        assert!(c.attr(d).is_none());
        // A failed change (dropped) ends it too: the next one alone is kept again.
        drop(c.begin_own(&[], &[], &[(d, b"f".as_slice())]));
        let made = c.begin_own(&[], &[], &[(d, b"g".as_slice())]);
        let ttl = made.end_made(Some(&changed), (&attr(11), 10_000), true, far());
        assert!(ttl.is_some());
        assert!(c.attr(d).is_some());
        assert!(matches!(c.entry(d, b"g"), Some(Some((a, _))) if a.ino == InodeId(11)));
    }

    #[test]
    fn a_file_made_here_has_no_extended_attribute_until_one_is_set_or_a_recall_comes() {
        let c = LeaseCache::default();
        let d = InodeId(2);
        let changed = ChangedDirs {
            attrs: vec![dir(2)],
            lease_ms: 10_000,
        };
        let f = InodeId(11);
        let _ = c.begin_own(&[], &[], &[(d, b"f".as_slice())]).end_made(
            Some(&changed),
            (&attr(11), 10_000),
            true,
            far(),
        );
        assert_eq!(c.xattr(f, 0, b"security.capability"), Some(None));
        assert_eq!(c.xattr(f, 7, b"user.x"), Some(None), "any caller");
        assert_eq!(
            c.xattr(f, 0, b"system.posix_acl_access"),
            None,
            "EOPNOTSUPP there"
        );
        assert_eq!(c.xattr(f, 0, b"user."), None, "not a name the server takes");
        // Its own writes and attribute changes do not end it.
        c.forget(&[f], &[]);
        let _ = c.begin_own(&[f], &[], &[]);
        assert_eq!(c.xattr(f, 0, b"user.x"), Some(None));
        // Its own setxattr does.
        c.forget_bare(f);
        assert_eq!(c.xattr(f, 0, b"user.x"), None);
        // A recall (another node's setxattr) does.
        let g = InodeId(12);
        let _ = c.begin_own(&[], &[], &[(d, b"g".as_slice())]).end_made(
            Some(&changed),
            (&attr(12), 10_000),
            true,
            far(),
        );
        assert_eq!(c.xattr(g, 0, b"user.x"), Some(None));
        c.recall(g, true, false);
        assert_eq!(c.xattr(g, 0, b"user.x"), None);
        // A file that was there already (O_CREAT without O_EXCL) may have some.
        let h = InodeId(13);
        let _ = c.begin_own(&[], &[], &[(d, b"h".as_slice())]).end_made(
            Some(&changed),
            (&attr(13), 10_000),
            false,
            far(),
        );
        assert_eq!(c.xattr(h, 0, b"user.x"), None);
    }

    /// A cache holding directory 20, made by this agent as `d` in 2: known empty.
    fn made_dir() -> (LeaseCache, InodeId) {
        let c = LeaseCache::default();
        let changed = ChangedDirs {
            attrs: vec![dir(2), dir(20)],
            lease_ms: 10_000,
        };
        c.begin_own(&[], &[], &[(InodeId(2), b"d".as_slice())])
            .end_mkdir(Some(&changed), &dir(20), far());
        (c, InodeId(20))
    }

    #[test]
    fn a_rename_in_a_complete_directory_puts_the_new_name_and_keeps_it_complete() {
        let (c, new) = made_dir();
        let in_new = ChangedDirs {
            attrs: vec![dir(20)],
            lease_ms: 10_000,
        };
        for (name, ino) in [(b"f", 30), (b"h", 31)] {
            let _ = c.begin_own(&[], &[], &[(new, name.as_slice())]).end_made(
                Some(&in_new),
                (&attr(ino), 10_000),
                true,
                far(),
            );
        }
        // f -> g: g is f's inode, f is absent, and any other name still known absent.
        c.begin_own(&[], &[(new, b"f".as_slice())], &[(new, b"g".as_slice())])
            .end_moved(Some(&in_new), far());
        // The moved inode's attributes changed (ctime): asked again, then found under g.
        assert_eq!(c.entry(new, b"g"), None);
        let _ = c.put_attr(&attr(30), 10_000, Instant::now(), far(), c.mark());
        assert!(matches!(c.entry(new, b"g"), Some(Some((a, _))) if a.ino == InodeId(30)));
        assert_eq!(c.entry(new, b"f"), Some(None));
        assert_eq!(c.entry(new, b"y"), Some(None));
        // Onto an existing name: the moved inode replaces it.
        c.begin_own(&[], &[(new, b"g".as_slice())], &[(new, b"h".as_slice())])
            .end_moved(Some(&in_new), far());
        let _ = c.put_attr(&attr(30), 10_000, Instant::now(), far(), c.mark());
        assert!(matches!(c.entry(new, b"h"), Some(Some((a, _))) if a.ino == InodeId(30)));
        assert_eq!(c.entry(new, b"y"), Some(None));
        // A recall of the directory's names while the rename is in flight: nothing is put.
        let own = c.begin_own(&[], &[(new, b"h".as_slice())], &[(new, b"k".as_slice())]);
        c.recall(new, false, true);
        own.end_moved(Some(&in_new), far());
        assert_eq!(c.entry(new, b"k"), None);
        assert_eq!(c.entry(new, b"y"), None);
    }

    #[test]
    fn a_rename_of_a_name_the_cache_did_not_know_ends_completeness() {
        let (c, new) = made_dir();
        // From another directory whose names are not held: the inode is not known.
        c.begin_own(
            &[],
            &[(InodeId(3), b"x".as_slice())],
            &[(new, b"g".as_slice())],
        )
        .end_moved(None, far());
        assert_eq!(c.entry(new, b"g"), None);
        assert_eq!(c.entry(new, b"y"), None);
    }

    #[test]
    fn a_directory_this_agent_made_knows_every_name_until_it_adds_one_it_cannot_put() {
        let c = LeaseCache::default();
        let (parent, new) = (InodeId(2), InodeId(20));
        let changed = ChangedDirs {
            attrs: vec![dir(2), dir(20)],
            lease_ms: 10_000,
        };
        c.begin_own(&[], &[], &[(parent, b"d".as_slice())])
            .end_mkdir(Some(&changed), &dir(20), far());
        // Empty and complete: any name is absent, without asking.
        assert_eq!(c.entry(new, b"x"), Some(None));
        assert!(c.negative_ttl(new, b"x").is_some());
        // A create there keeps it complete (the name is put); an unlink too (now absent).
        let in_new = ChangedDirs {
            attrs: vec![dir(20)],
            lease_ms: 10_000,
        };
        c.begin_own(&[], &[], &[(new, b"f".as_slice())]).end_made(
            Some(&in_new),
            (&attr(30), 10_000),
            true,
            far(),
        );
        assert!(matches!(c.entry(new, b"f"), Some(Some((a, _))) if a.ino == InodeId(30)));
        assert_eq!(c.entry(new, b"y"), Some(None));
        c.begin_own(&[], &[(new, b"f".as_slice())], &[])
            .end(Some(&in_new), far());
        assert_eq!(c.entry(new, b"f"), Some(None));
        // A symlink (a name added and not put): no longer complete.
        c.begin_own(&[], &[], &[(new, b"s".as_slice())])
            .end(Some(&in_new), far());
        assert_eq!(c.entry(new, b"s"), None);
        assert_eq!(c.entry(new, b"y"), None);
        // A failed create (dropped) in a complete directory also ends it.
        c.begin_own(&[], &[], &[(parent, b"e".as_slice())])
            .end_mkdir(
                Some(&ChangedDirs {
                    attrs: vec![dir(2), dir(21)],
                    lease_ms: 10_000,
                }),
                &dir(21),
                far(),
            );
        assert_eq!(c.entry(InodeId(21), b"z"), Some(None));
        drop(c.begin_own(&[], &[], &[(InodeId(21), b"z".as_slice())]));
        assert_eq!(c.entry(InodeId(21), b"z"), None);
        // A recall of its names ends it.
        c.begin_own(&[], &[], &[(parent, b"g".as_slice())])
            .end_mkdir(
                Some(&ChangedDirs {
                    attrs: vec![dir(2), dir(22)],
                    lease_ms: 10_000,
                }),
                &dir(22),
                far(),
            );
        assert_eq!(c.entry(InodeId(22), b"q"), Some(None));
        c.recall(InodeId(22), false, true);
        assert_eq!(c.entry(InodeId(22), b"q"), None);
    }

    #[test]
    fn terms_end_at_the_session_deadline_and_a_new_session_clears_everything() {
        let c = LeaseCache::default();
        let soon = Instant::now() + Duration::from_secs(2);
        let mark = c.mark();
        let ttl = c.put_attr(&attr(5), 60_000, Instant::now(), soon, mark);
        assert!(ttl.is_some_and(|t| t <= Duration::from_secs(2)));
        let gone = std::sync::Arc::new(Mutex::new(Vec::new()));
        let g = gone.clone();
        c.set_kernel_invalidator(Box::new(move |ino| g.lock().unwrap().push(ino)));
        c.clear();
        assert_eq!(*gone.lock().unwrap(), vec![InodeId(5)]);
        assert!(c.attr(InodeId(5)).is_none());
        // A reply to a request sent before the new session is not kept.
        assert_eq!(
            c.put_attr(&attr(6), 60_000, Instant::now(), far(), mark),
            None
        );
    }

    #[test]
    fn own_changes_forget_the_name_and_its_inode() {
        let c = LeaseCache::default();
        let (dir, sent, mark) = (InodeId(2), Instant::now(), c.mark());
        c.put_attr(&attr(9), 10_000, sent, far(), mark);
        c.put_attr(&attr(2), 10_000, sent, far(), mark);
        c.put_entry(dir, b"a", Some(InodeId(9)), 10_000, sent, far(), mark);
        c.forget(&[], &[(dir, b"a")]);
        assert_eq!(c.entry(dir, b"a"), None);
        assert!(c.attr(InodeId(9)).is_none());
        assert!(c.attr(InodeId(2)).is_none());
    }
}
