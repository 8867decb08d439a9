//! Attribute and entry leases (docs/protocol.md "Attribute and entry leases"; issue 19).
//!
//! An **attribute lease** on an inode lets a session's agent answer `stat` from its caches; an
//! **entry lease** on a directory lets it answer lookups of names in it (negative ones
//! included). Both are handed out with Lookup, GetAttr and ReadDir replies to the session the
//! request names, for a term (the session lease's TTL, renewed by heartbeats) counted from
//! the request's send time on the agent's side, and are kept here in a table of holders.
//!
//! **Recall.** Before a change to what a lease covers (the handlers call
//! `Server::recall_leases` (service/leases.rs) before their write job), the server sends a `LeaseRecall` to every
//! holder on its session stream, takes the holders out of the table, and waits until each has
//! acknowledged (its agent dropped the cached attributes or names, the kernel's included) or
//! until that lease's term has run out. The change is marked as in progress while it runs
//! ([`LeaseChange`], dropped after the write job): no lease on the inode is given meanwhile,
//! nor one whose attributes were read before the change began (the caller takes
//! [`Leases::mark`] before it reads; a change begun or ended since refuses the grant), so
//! nothing read before the change stays cached after it.
//!
//! **Sizes.** An attribute lease on a file is not given while another session holds a write
//! grant or write delegation there (its writes change the size behind the server's back until
//! completed); handing one out recalls the others' attribute leases (see the Data service).
//!
//! **Bounded.** At most [`MAX_LEASES_PER_SESSION`] inodes per session and [`MAX_LEASES`] in
//! all: past that no lease is given (the reply says 0) until terms run out; expired holds are
//! pruned at most once a second.
//!
//! **Renewal.** A holder's heartbeat renews, for a new term, the holds it names that it
//! still has ([`Leases::renew`]): a lease in use lives until a change recalls it.
//!
//! A server restart forgets the table: agents drop what they cached under leases when they
//! open their next session (docs/posix.md "Caching and coherence").

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use sanfs_proto::model::LeaseRecall;
use sanfs_proto::types::InodeId;
use tokio::time::Instant;

/// Inodes one session may hold leases on at once.
pub const MAX_LEASES_PER_SESSION: usize = 65_536;
/// Inodes with leases in all.
pub const MAX_LEASES: usize = 1_048_576;
/// Buckets of the "change begun since" check (inodes hash into them).
const BUCKETS: usize = 4096;

/// What a lease on an inode covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Covered {
    /// Its attributes.
    Attr,
    /// Its names (a directory).
    Entries,
}

/// Counters for metrics.
#[derive(Debug, Default)]
pub struct LeaseStats {
    pub attr_granted: AtomicU64,
    pub entry_granted: AtomicU64,
    /// Leases not given: a change in progress or begun since the read, another session's
    /// write grant, or a full table.
    pub refused: AtomicU64,
    /// LeaseRecall messages sent.
    pub recalls: AtomicU64,
    /// Recalls not acknowledged before the lease's term ran out.
    pub recall_timeouts: AtomicU64,
    /// Leases renewed for another term (a heartbeat's renewal), and those asked but no
    /// longer held.
    pub renewed: AtomicU64,
    pub renew_lost: AtomicU64,
    /// Create delegations given, and recalled.
    pub creates_granted: AtomicU64,
    pub creates_recalled: AtomicU64,
}

#[derive(Debug, Default, Clone, Copy)]
struct Held {
    attr: Option<Instant>,
    entries: Option<Instant>,
}

impl Held {
    fn until(&self) -> Option<Instant> {
        self.attr.max(self.entries)
    }
}

#[derive(Debug)]
struct Table {
    /// inode -> session -> what it holds there and until when.
    by_ino: HashMap<u64, HashMap<u64, Held>>,
    /// session -> the inodes it holds leases on.
    by_session: HashMap<u64, HashSet<u64>>,
    /// Changes in progress per inode.
    changing: HashMap<u64, usize>,
    /// Changes begun so far.
    seq: u64,
    /// Per bucket, the `seq` of the last change begun on an inode there.
    changed: Vec<u64>,
    next_recall: u64,
    /// Recalls sent and not acknowledged: id -> session.
    outstanding: HashMap<u64, u64>,
    last_prune: Instant,
    /// Create delegations: directory -> its holder and until when
    /// ([`Leases::grant_creates`]).
    creators: HashMap<u64, (u64, Instant)>,
}

fn bucket(ino: u64) -> usize {
    // Fibonacci hashing: neighbouring inode numbers land apart.
    (ino.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 52) as usize % BUCKETS
}

/// The lease table of the server.
#[derive(Debug)]
pub struct Leases {
    table: Mutex<Table>,
    acked: tokio::sync::Notify,
    term: Duration,
    pub stats: LeaseStats,
    /// How many create delegations the table holds (reads skip the table while 0).
    creators: std::sync::atomic::AtomicUsize,
}

/// A change in progress on some inodes (`Server::recall_leases` (service/leases.rs)): while it lives, no lease
/// is given there. Dropped after the change's write job.
#[must_use = "the change is over when this is dropped"]
#[derive(Debug)]
pub struct LeaseChange<'a> {
    leases: &'a Leases,
    inos: Vec<u64>,
    /// Inodes whose attributes change and on which the changer (`except`) holds an
    /// attribute lease: not recalled; its reply tells its agent to drop them
    /// (`sanfs-forget`).
    own: Vec<InodeId>,
}

impl LeaseChange<'_> {
    /// The changer's own attribute leases this change alters ([`LeaseChange::own`]).
    pub fn own(&self) -> &[InodeId] {
        &self.own
    }
}

impl LeaseChange<'_> {
    /// Ends the change now (its write job is done) and answers a mark ([`Leases::mark`]) as
    /// of its end: a lease on what the change made, granted with it, is refused if another
    /// change began there since.
    pub fn end(mut self) -> u64 {
        self.finish()
    }

    fn finish(&mut self) -> u64 {
        let mut t = self.leases.lock();
        // Ended now: a read that began while it was in progress (before its write job) may
        // have seen the old state, so its grant is refused too.
        t.seq += 1;
        let seq = t.seq;
        for ino in std::mem::take(&mut self.inos) {
            t.changed[bucket(ino)] = seq;
            if let Some(n) = t.changing.get_mut(&ino) {
                *n -= 1;
                if *n == 0 {
                    t.changing.remove(&ino);
                }
            }
        }
        seq
    }
}

impl Drop for LeaseChange<'_> {
    fn drop(&mut self) {
        if !self.inos.is_empty() {
            self.finish();
        }
    }
}

impl Leases {
    /// A table whose leases last `term`.
    pub fn new(term: Duration) -> Leases {
        Leases {
            table: Mutex::new(Table {
                by_ino: HashMap::new(),
                by_session: HashMap::new(),
                changing: HashMap::new(),
                seq: 0,
                changed: vec![0; BUCKETS],
                next_recall: 0,
                outstanding: HashMap::new(),
                last_prune: Instant::now(),
                creators: HashMap::new(),
            }),
            creators: std::sync::atomic::AtomicUsize::new(0),
            acked: tokio::sync::Notify::new(),
            term,
            stats: LeaseStats::default(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The term of a lease given now, in milliseconds.
    pub fn term_ms(&self) -> u64 {
        u64::try_from(self.term.as_millis()).unwrap_or(u64::MAX)
    }

    /// Taken before the attributes or names a lease will cover are read: a change begun
    /// after it refuses the grant.
    pub fn mark(&self) -> u64 {
        self.lock().seq
    }

    /// Gives `session` a lease covering `what` of `ino`, unless a change there is in
    /// progress or began after `since` ([`Leases::mark`]) or the table is full. Answers
    /// whether it was given.
    pub fn grant(&self, session: u64, ino: u64, what: Covered, since: u64) -> bool {
        let now = Instant::now();
        let mut t = self.lock();
        if now.duration_since(t.last_prune) >= Duration::from_secs(1) {
            prune(&mut t, now);
            self.creators.store(t.creators.len(), Ordering::Relaxed);
        }
        let refused = t.changing.contains_key(&ino)
            || t.changed[bucket(ino)] > since
            || t.creators
                .get(&ino)
                .is_some_and(|(holder, until)| *holder != session && *until > now)
            || (!t.by_ino.contains_key(&ino) && t.by_ino.len() >= MAX_LEASES)
            || t.by_session
                .get(&session)
                .is_some_and(|s| s.len() >= MAX_LEASES_PER_SESSION && !s.contains(&ino));
        if refused {
            drop(t);
            self.stats.refused.fetch_add(1, Ordering::Relaxed);
            return false;
        }
        let until = now + self.term;
        let held = t.by_ino.entry(ino).or_default().entry(session).or_default();
        match what {
            Covered::Attr => held.attr = Some(until),
            Covered::Entries => held.entries = Some(until),
        }
        t.by_session.entry(session).or_default().insert(ino);
        drop(t);
        let c = match what {
            Covered::Attr => &self.stats.attr_granted,
            Covered::Entries => &self.stats.entry_granted,
        };
        c.fetch_add(1, Ordering::Relaxed);
        true
    }

    /// Begins a change to `changes`: marks them changing, takes the leases of every session
    /// but `except` there out of the table, and answers the recalls to send (session, recall,
    /// until when the lease would have lasted).
    pub(crate) fn begin(
        &self,
        changes: &[(u64, Covered)],
        except: Option<u64>,
    ) -> (LeaseChange<'_>, Vec<(u64, LeaseRecall, Instant)>) {
        let now = Instant::now();
        let mut t = self.lock();
        t.seq += 1;
        let seq = t.seq;
        let mut inos: Vec<u64> = changes.iter().map(|(ino, _)| *ino).collect();
        inos.sort_unstable();
        inos.dedup();
        let mut recalls = Vec::new();
        let mut own = Vec::new();
        for &ino in &inos {
            *t.changing.entry(ino).or_insert(0) += 1;
            t.changed[bucket(ino)] = seq;
            if let Some(r) = take_creator(&mut t, ino, except, now) {
                self.stats.creates_recalled.fetch_add(1, Ordering::Relaxed);
                recalls.push(r);
            }
            let attr = changes.contains(&(ino, Covered::Attr));
            let entries = changes.contains(&(ino, Covered::Entries));
            let Some(holders) = t.by_ino.get_mut(&ino) else {
                continue;
            };
            let mut hit: Vec<(u64, Held)> = Vec::new();
            holders.retain(|session, held| {
                if Some(*session) == except {
                    if attr && held.attr.is_some_and(|u| u > now) {
                        own.push(InodeId(ino));
                    }
                    return true;
                }
                let mut taken = Held::default();
                if attr && held.attr.is_some_and(|u| u > now) {
                    taken.attr = held.attr.take();
                }
                if entries && held.entries.is_some_and(|u| u > now) {
                    taken.entries = held.entries.take();
                }
                if taken.until().is_some() {
                    hit.push((*session, taken));
                }
                held.until().is_some_and(|u| u > now)
            });
            if holders.is_empty() {
                t.by_ino.remove(&ino);
            }
            for (session, taken) in hit {
                if !t.by_ino.get(&ino).is_some_and(|h| h.contains_key(&session))
                    && let Some(s) = t.by_session.get_mut(&session)
                {
                    s.remove(&ino);
                }
                let recall = t.issue_recall(session, ino, |r| {
                    r.attr = taken.attr.is_some();
                    r.entries = taken.entries.is_some();
                });
                recalls.push((session, recall, taken.until().unwrap_or(now)));
            }
        }
        self.creators.store(t.creators.len(), Ordering::Relaxed);
        drop(t);
        (
            LeaseChange {
                leases: self,
                inos,
                own,
            },
            recalls,
        )
    }

    /// Renews for a new term, from now, the attribute leases on `attrs` and the entry leases
    /// on `entries` that `session` still holds (a heartbeat's renewal; docs/protocol.md
    /// "Attribute and entry leases"). Answers those not renewed: not held (recalled, never
    /// given, or run out: a change may have gone ahead without recalling it) or with a change
    /// in progress there. A lease still held was recalled by no change since it was given, so
    /// what its holder cached under it is still exact.
    pub fn renew(
        &self,
        session: u64,
        attrs: &[InodeId],
        entries: &[InodeId],
    ) -> (Vec<InodeId>, Vec<InodeId>) {
        let now = Instant::now();
        let until = now + self.term;
        let mut t = self.lock();
        let mut renew = |ino: InodeId, what: Covered| {
            if t.changing.contains_key(&ino.0) {
                return false;
            }
            let Some(held) = t.by_ino.get_mut(&ino.0).and_then(|h| h.get_mut(&session)) else {
                return false;
            };
            let term = match what {
                Covered::Attr => &mut held.attr,
                Covered::Entries => &mut held.entries,
            };
            match term {
                Some(u) if *u > now => {
                    *u = until;
                    true
                }
                _ => false,
            }
        };
        let lost_attrs: Vec<InodeId> = attrs
            .iter()
            .copied()
            .filter(|i| !renew(*i, Covered::Attr))
            .collect();
        let lost_entries: Vec<InodeId> = entries
            .iter()
            .copied()
            .filter(|i| !renew(*i, Covered::Entries))
            .collect();
        // A directory's create delegation lives as long as its entry lease.
        for ino in entries {
            if lost_entries.contains(ino) {
                continue;
            }
            if let Some((holder, u)) = t.creators.get_mut(&ino.0)
                && *holder == session
                && *u > now
            {
                *u = until;
            }
        }
        drop(t);
        let lost = lost_attrs.len() + lost_entries.len();
        let asked = attrs.len() + entries.len();
        self.stats
            .renewed
            .fetch_add((asked - lost) as u64, Ordering::Relaxed);
        self.stats
            .renew_lost
            .fetch_add(lost as u64, Ordering::Relaxed);
        (lost_attrs, lost_entries)
    }

    /// LeaseRecall `id` was acknowledged by `session`.
    pub fn acked(&self, session: u64, id: u64) {
        let mut t = self.lock();
        if t.outstanding.get(&id) == Some(&session) {
            t.outstanding.remove(&id);
            drop(t);
            self.acked.notify_waiters();
        }
    }

    /// A session ended: its leases and the recalls waiting for it go.
    pub fn expire_session(&self, session: u64) {
        let mut t = self.lock();
        for ino in t.by_session.remove(&session).unwrap_or_default() {
            if let Some(h) = t.by_ino.get_mut(&ino) {
                h.remove(&session);
                if h.is_empty() {
                    t.by_ino.remove(&ino);
                }
            }
        }
        t.outstanding.retain(|_, s| *s != session);
        t.creators.retain(|_, (holder, _)| *holder != session);
        self.creators.store(t.creators.len(), Ordering::Relaxed);
        drop(t);
        self.acked.notify_waiters();
    }

    /// Gives `session` the create delegation on directory `dir` (docs/protocol.md "Creates
    /// answered by the agent"): exclusive, so refused while another session holds any lease
    /// there, a change there is in progress or began after `since`, or the table is full.
    /// The holder's entry and attribute leases on `dir` are its own affair (they come with
    /// the reply that gives it). Answers whether it was given.
    pub fn grant_creates(&self, session: u64, dir: u64, since: u64) -> bool {
        let now = Instant::now();
        let mut t = self.lock();
        let others = t.by_ino.get(&dir).is_some_and(|h| {
            h.iter()
                .any(|(s, held)| *s != session && held.until().is_some_and(|u| u > now))
        });
        let refused = others
            || t.changing.contains_key(&dir)
            || t.changed[bucket(dir)] > since
            || t.creators
                .get(&dir)
                .is_some_and(|(holder, until)| *holder != session && *until > now)
            || t.creators.len() >= MAX_LEASES;
        if refused {
            drop(t);
            self.stats.refused.fetch_add(1, Ordering::Relaxed);
            return false;
        }
        t.creators.insert(dir, (session, now + self.term));
        self.creators.store(t.creators.len(), Ordering::Relaxed);
        drop(t);
        self.stats.creates_granted.fetch_add(1, Ordering::Relaxed);
        true
    }

    /// Before a read of `inos` (their attributes, or names in them) for `reader` (`None`: a
    /// caller without a session): takes out the create delegations other sessions hold on
    /// them and answers the recalls to send (their holders send the creates they answered
    /// first). Cheap when no delegation is held anywhere.
    pub(crate) fn settle_creates(
        &self,
        inos: &[u64],
        reader: Option<u64>,
    ) -> Vec<(u64, LeaseRecall, Instant)> {
        if self.creators.load(Ordering::Relaxed) == 0 {
            return Vec::new();
        }
        let now = Instant::now();
        let mut t = self.lock();
        let recalls: Vec<_> = inos
            .iter()
            .filter_map(|ino| take_creator(&mut t, *ino, reader, now))
            .collect();
        self.creators.store(t.creators.len(), Ordering::Relaxed);
        drop(t);
        self.stats
            .creates_recalled
            .fetch_add(recalls.len() as u64, Ordering::Relaxed);
        recalls
    }

    /// Waits until each of `waits` (recall id, the lease's end) is acknowledged or its
    /// lease has run out.
    pub(crate) async fn wait(&self, mut waits: Vec<(u64, Instant)>) {
        loop {
            let acked = self.acked.notified();
            tokio::pin!(acked);
            acked.as_mut().enable();
            let now = Instant::now();
            {
                let mut t = self.lock();
                waits.retain(|(id, until)| {
                    if !t.outstanding.contains_key(id) {
                        return false;
                    }
                    if *until <= now {
                        t.outstanding.remove(id);
                        self.stats.recall_timeouts.fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(
                            recall = id,
                            "a lease recall went unanswered for the lease's term"
                        );
                        return false;
                    }
                    true
                });
            }
            let Some(first) = waits.iter().map(|(_, u)| *u).min() else {
                return;
            };
            let _ = tokio::time::timeout_at(first, acked).await;
        }
    }

    /// Leases held now (for status and tests).
    pub fn live(&self) -> usize {
        let now = Instant::now();
        self.lock()
            .by_ino
            .values()
            .flat_map(|h| h.values())
            .filter(|h| h.until().is_some_and(|u| u > now))
            .count()
    }
}

/// Forgets holds whose term has run out.
fn prune(t: &mut Table, now: Instant) {
    t.last_prune = now;
    let Table {
        by_ino, by_session, ..
    } = t;
    by_ino.retain(|ino, holders| {
        holders.retain(|session, held| {
            if held.attr.is_some_and(|u| u <= now) {
                held.attr = None;
            }
            if held.entries.is_some_and(|u| u <= now) {
                held.entries = None;
            }
            let keep = held.until().is_some();
            if !keep && let Some(s) = by_session.get_mut(session) {
                s.remove(ino);
            }
            keep
        });
        !holders.is_empty()
    });
    by_session.retain(|_, s| !s.is_empty());
    t.creators.retain(|_, (_, until)| *until > now);
}

/// Takes the create delegation on `ino` out of the table when someone other than `except`
/// holds it (and it has not run out): answers the recall to send its holder.
fn take_creator(
    t: &mut Table,
    ino: u64,
    except: Option<u64>,
    now: Instant,
) -> Option<(u64, LeaseRecall, Instant)> {
    let (holder, until) = *t.creators.get(&ino)?;
    if Some(holder) == except {
        return None;
    }
    t.creators.remove(&ino);
    if until <= now {
        return None;
    }
    let recall = t.issue_recall(holder, ino, |r| r.creates = true);
    Some((holder, recall, until))
}

impl Table {
    /// A recall of what `session` holds on `ino` (`what` says which), noted outstanding
    /// until acknowledged.
    fn issue_recall(
        &mut self,
        session: u64,
        ino: u64,
        what: impl FnOnce(&mut LeaseRecall),
    ) -> LeaseRecall {
        self.next_recall += 1;
        let id = self.next_recall;
        self.outstanding.insert(id, session);
        let mut recall = LeaseRecall {
            id,
            inode: InodeId(ino),
            attr: false,
            entries: false,
            creates: false,
        };
        what(&mut recall);
        recall
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_change_takes_other_holders_out_and_refuses_reads_from_before_it() {
        let l = Leases::new(Duration::from_secs(10));
        let m = l.mark();
        assert!(l.grant(1, 7, Covered::Attr, m));
        assert!(l.grant(2, 7, Covered::Attr, m));
        assert!(l.grant(2, 8, Covered::Entries, m));
        let before = l.mark();
        let (change, recalls) = l.begin(&[(7, Covered::Attr), (8, Covered::Attr)], Some(1));
        // Session 1 is the changer; session 2's attribute lease on 7 is recalled, its entry
        // lease on 8 is not (only 8's attributes change).
        assert_eq!(recalls.len(), 1);
        let (session, recall, _) = recalls[0];
        assert_eq!(
            (session, recall.inode, recall.attr, recall.entries),
            (2, InodeId(7), true, false)
        );
        // The changer's own attribute lease on 7 stays; its reply says to drop it.
        assert_eq!(change.own(), &[InodeId(7)]);
        // While the change runs, and for reads begun before it or while it ran, no lease.
        let during = l.mark();
        assert!(!l.grant(3, 7, Covered::Attr, during));
        drop(change);
        assert!(!l.grant(3, 7, Covered::Attr, before));
        assert!(!l.grant(3, 7, Covered::Attr, during));
        assert!(l.grant(3, 7, Covered::Attr, l.mark()));
        // Acknowledged: the wait ends at once.
        l.acked(2, recall.id);
        tokio::time::timeout(
            Duration::from_secs(1),
            l.wait(vec![(recall.id, Instant::now() + Duration::from_secs(60))]),
        )
        .await
        .expect("an acknowledged recall is not waited for");
    }

    #[tokio::test(start_paused = true)]
    async fn a_renewed_lease_outlives_its_first_term_and_is_still_recalled() {
        let term = Duration::from_secs(10);
        let l = Leases::new(term);
        let m = l.mark();
        assert!(l.grant(1, 7, Covered::Attr, m));
        assert!(l.grant(1, 8, Covered::Entries, m));
        assert!(l.grant(2, 9, Covered::Attr, m));
        assert!(l.grant(1, 10, Covered::Attr, m));
        tokio::time::advance(Duration::from_secs(6)).await;
        // 9 is session 2's, 11 nobody's, 8 holds names and not attributes: not renewed.
        let (lost_attrs, lost_entries) = l.renew(
            1,
            &[InodeId(7), InodeId(9), InodeId(11), InodeId(8)],
            &[InodeId(8), InodeId(7)],
        );
        assert_eq!(lost_attrs, vec![InodeId(9), InodeId(11), InodeId(8)]);
        assert_eq!(lost_entries, vec![InodeId(7)]);
        // Past the first term: the renewed holds live, 10 (not renewed) ran out.
        tokio::time::advance(Duration::from_secs(6)).await;
        assert_eq!(l.renew(1, &[InodeId(10)], &[]).0, vec![InodeId(10)]);
        let (change, recalls) = l.begin(&[(7, Covered::Attr), (8, Covered::Entries)], Some(3));
        let recalled: Vec<(u64, InodeId, bool, bool)> = recalls
            .iter()
            .map(|(s, r, _)| (*s, r.inode, r.attr, r.entries))
            .collect();
        assert_eq!(
            recalled,
            vec![(1, InodeId(7), true, false), (1, InodeId(8), false, true)],
            "a renewed lease is recalled like a fresh one"
        );
        // Recalled, or with a change in progress: not renewed.
        assert_eq!(
            l.renew(1, &[InodeId(7)], &[InodeId(8)]),
            (vec![InodeId(7)], vec![InodeId(8)])
        );
        drop(change);
        assert!(l.grant(1, 7, Covered::Attr, l.mark()));
        let during = l.begin(&[(7, Covered::Attr)], Some(1)).0;
        assert_eq!(l.renew(1, &[InodeId(7)], &[]).0, vec![InodeId(7)]);
        drop(during);
        assert_eq!(l.stats.renewed.load(Ordering::Relaxed), 2);
        assert_eq!(l.stats.renew_lost.load(Ordering::Relaxed), 8);
    }

    #[tokio::test(start_paused = true)]
    async fn an_unanswered_recall_is_waited_for_until_the_term_ends() {
        let l = Leases::new(Duration::from_secs(10));
        assert!(l.grant(2, 7, Covered::Entries, l.mark()));
        let (_change, recalls) = l.begin(&[(7, Covered::Entries)], None);
        assert_eq!(recalls.len(), 1);
        let (_, recall, until) = recalls[0];
        let started = Instant::now();
        l.wait(vec![(recall.id, until)]).await;
        assert!(started.elapsed() >= Duration::from_secs(9));
        assert_eq!(l.stats.recall_timeouts.load(Ordering::Relaxed), 1);
        // An ended session's recalls are not waited for.
        assert!(l.grant(4, 9, Covered::Attr, l.mark()));
        let (_change, recalls) = l.begin(&[(9, Covered::Attr)], None);
        l.expire_session(4);
        let started = Instant::now();
        l.wait(recalls.iter().map(|(_, r, u)| (r.id, *u)).collect())
            .await;
        assert!(started.elapsed() < Duration::from_secs(1));
    }

    #[tokio::test(start_paused = true)]
    async fn a_create_delegation_is_exclusive_and_recalled_by_another_sessions_read_or_change() {
        let l = Leases::new(Duration::from_secs(10));
        // Exclusive: not given over another session's lease, nor twice.
        assert!(l.grant(2, 5, Covered::Entries, l.mark()));
        assert!(!l.grant_creates(1, 5, l.mark()));
        assert!(l.grant_creates(1, 7, l.mark()));
        assert!(!l.grant_creates(2, 7, l.mark()));
        // While it is held, nobody else gets a lease there; the holder does.
        assert!(!l.grant(2, 7, Covered::Entries, l.mark()));
        assert!(!l.grant(2, 7, Covered::Attr, l.mark()));
        assert!(l.grant(1, 7, Covered::Entries, l.mark()));
        // The holder's own reads recall nothing; another's read recalls it, once.
        assert!(l.settle_creates(&[7], Some(1)).is_empty());
        let recalls = l.settle_creates(&[7, 8], Some(2));
        let got: Vec<(u64, InodeId, bool, bool, bool)> = recalls
            .iter()
            .map(|(s, r, _)| (*s, r.inode, r.attr, r.entries, r.creates))
            .collect();
        assert_eq!(got, vec![(1, InodeId(7), false, false, true)]);
        assert!(l.settle_creates(&[7], None).is_empty());
        assert!(l.grant(2, 7, Covered::Entries, l.mark()));
        // A change by another session recalls it too (with the holder's entry lease).
        assert!(l.grant_creates(1, 9, l.mark()));
        let (_change, recalls) = l.begin(&[(9, Covered::Attr)], Some(2));
        assert_eq!(recalls.len(), 1);
        assert!(recalls[0].1.creates);
        // Renewed with the entry lease; gone with the session.
        assert!(l.grant_creates(1, 11, l.mark()));
        assert!(l.grant(1, 11, Covered::Entries, l.mark()));
        tokio::time::advance(Duration::from_secs(8)).await;
        assert!(l.renew(1, &[], &[InodeId(11)]).1.is_empty());
        tokio::time::advance(Duration::from_secs(8)).await;
        assert_eq!(l.settle_creates(&[11], Some(2)).len(), 1, "renewed");
        assert!(l.grant_creates(1, 12, l.mark()));
        l.expire_session(1);
        assert!(l.settle_creates(&[12], None).is_empty());
        assert!(l.grant_creates(3, 12, l.mark()));
        // Not renewed: it runs out.
        tokio::time::advance(Duration::from_secs(11)).await;
        assert!(l.settle_creates(&[12], None).is_empty());
        assert_eq!(l.stats.creates_granted.load(Ordering::Relaxed), 5);
        assert_eq!(l.stats.creates_recalled.load(Ordering::Relaxed), 3);
    }

    #[test]
    fn a_session_holds_a_bounded_number() {
        let l = Leases::new(Duration::from_secs(10));
        let m = l.mark();
        for ino in 0..MAX_LEASES_PER_SESSION as u64 {
            assert!(l.grant(1, ino + 10, Covered::Attr, m));
        }
        assert!(!l.grant(1, 5, Covered::Attr, m));
        // Renewing one it holds is fine, and another session is not limited by it.
        assert!(l.grant(1, 10, Covered::Entries, m));
        assert!(l.grant(2, 5, Covered::Attr, m));
        l.expire_session(1);
        assert_eq!(l.live(), 1);
    }
}
