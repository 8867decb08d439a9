//! The Server's side of attribute and entry leases (the table is crate::leases): recalls
//! before changes, grants with replies.

use std::sync::atomic::Ordering;

use sanfs_proto::model::{LeaseRecall, ServerEvent};
use sanfs_proto::types::{Attr, InodeId};
use tokio::time::Instant;

use crate::ns::Reader;

use super::Server;
use crate::leases::{Covered, LeaseChange};

impl Server {
    /// Before a change to `changes` (attributes of an inode, names of a directory) made on
    /// behalf of `except` (a session whose own leases stay; `None`: every holder's go):
    /// recalls the leases of every other holder and waits for their acknowledgement or the
    /// end of their term. The answer marks the change in progress: keep it until the change's
    /// write job is done.
    pub(crate) async fn recall_leases(
        &self,
        changes: &[(u64, Covered)],
        except: Option<u64>,
    ) -> LeaseChange<'_> {
        let (change, recalls) = self.leases.begin(changes, except);
        self.send_recalls_and_wait(recalls).await;
        change
    }

    /// Before a read of `inos` (their attributes, or the names in them) for `reader`: the
    /// create delegations other sessions hold there are recalled, and waited for (their
    /// agents send the creates they answered first), so that the read sees every file an
    /// application was told exists (docs/protocol.md "Creates answered by the agent").
    /// Nothing to do, and no lock taken, while no session holds one.
    /// Answers whether any was recalled (what was read before may then be old).
    pub(crate) async fn settle_creates(&self, inos: &[u64], reader: Option<u64>) -> bool {
        let recalls = self.leases.settle_creates(inos, reader);
        let any = !recalls.is_empty();
        self.send_recalls_and_wait(recalls).await;
        any
    }

    /// Gives `session` the create delegation on directory `dir`, which it just made (its
    /// reply's mark `since`), when it can hear a recall and no quota with an inode limit
    /// covers the directory (a create its agent answered must not fail at the server):
    /// answers its term in milliseconds, 0 when none is given.
    pub(crate) fn grant_creates(&self, session: u64, dir: u64, since: u64) -> u64 {
        if !self.has_stream(session) {
            return 0;
        }
        match crate::quota::quota_of(&self.store, dir) {
            Ok(None) => {}
            Ok(Some((_, row))) if row.limit_inodes.is_none() => {}
            _ => return 0,
        }
        if self.leases.grant_creates(session, dir, since) {
            self.leases.term_ms()
        } else {
            0
        }
    }

    /// Sends `recalls` on their sessions' streams and waits until each is acknowledged or
    /// its lease's term has run out.
    async fn send_recalls_and_wait(&self, recalls: Vec<(u64, LeaseRecall, Instant)>) {
        if recalls.is_empty() {
            return;
        }
        let mut waits = Vec::with_capacity(recalls.len());
        for (session, recall, until) in recalls {
            let tx = self
                .sessions()
                .by_id
                .get(&session)
                .and_then(|s| s.stream.as_ref().map(|(_, tx, _)| tx.clone()));
            // A holder without a stream cannot hear it: its lease runs out.
            if let Some(tx) = tx {
                self.leases.stats.recalls.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(
                    session,
                    inode = recall.inode.0,
                    id = recall.id,
                    attr = recall.attr,
                    entries = recall.entries,
                    creates = recall.creates,
                    "lease recall"
                );
                let _ = tx.send(Ok(ServerEvent::LeaseRecall(recall).into())).await;
            }
            waits.push((recall.id, until));
        }
        self.leases.wait(waits).await;
    }

    /// Before a data call of `caller` that moves the size or mtime of `ino` (a write grant or
    /// layout, a proxied write, fallocate, a write delegation): every other session's
    /// attribute lease on it goes ([`Server::recall_leases`]).
    pub(crate) async fn recall_attr_leases(&self, ino: u64, caller: u64) -> LeaseChange<'_> {
        self.recall_leases(&[(ino, Covered::Attr)], Some(caller))
            .await
    }

    /// Gives `session` (checked: it must be live and the caller's) leases on `what` when it
    /// can hear their recall: answers the term in milliseconds, 0 when any was refused.
    pub(crate) fn grant_leases(
        &self,
        session: Option<u64>,
        what: &[(u64, Covered)],
        since: u64,
    ) -> u64 {
        let Some(session) = session.filter(|s| self.has_stream(*s)) else {
            return 0;
        };
        let mut all = true;
        for &(ino, covered) in what {
            // Sizes: no attribute lease while another session writes the file under a grant.
            if covered == Covered::Attr && self.grants.writer_other_than(ino, session) {
                self.leases.stats.refused.fetch_add(1, Ordering::Relaxed);
                all = false;
                continue;
            }
            all &= self.leases.grant(session, ino, covered, since);
        }
        if all { self.leases.term_ms() } else { 0 }
    }

    /// After a change of `ino` by `session` that ended at `since` (`LeaseChange::end`) and
    /// left `changed`: an attribute lease on the inode for the changer, with its attributes
    /// read again now (they then hold every change that ended before the lease; the change's
    /// own may be older than another's). `(changed, 0)` when none is given.
    pub(crate) fn lease_changed_attr(
        &self,
        session: Option<u64>,
        ino: InodeId,
        since: u64,
        changed: Attr,
    ) -> (Attr, u64) {
        let bs = self.store.block_size();
        let Ok(now) = self.read(|t| t.getattr(bs, ino)) else {
            return (changed, 0);
        };
        match self.grant_leases(session, &[(ino.0, Covered::Attr)], since) {
            0 => (changed, 0),
            ms => (now, ms),
        }
    }
}
