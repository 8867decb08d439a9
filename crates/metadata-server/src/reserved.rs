//! Inode numbers set aside for a session's agent (docs/protocol.md "Creates answered by the
//! agent"): a `ReserveInodes` call advances the store's inode and generation counters by its
//! count in a durable commit and notes the numbers here, under the session. A `Create` that
//! names one of them (`CreateRequest::inode`) makes the file with that number and its
//! generation, once: the number is taken out when the create runs.
//!
//! In memory only. A restart forgets every reservation: the numbers stay unused for ever (the
//! counters were durable), except that an agent replays a create it was answered with its
//! number, as any replayed create (`reclaim::replay_change`). A session's end forgets its
//! numbers.
//!
//! Bounded: at most [`MAX_BLOCKS_PER_SESSION`] reservations with numbers left per session.

use std::collections::HashMap;
use std::sync::Mutex;

use sanfs_proto::model::ReserveInodesReply;
use sanfs_proto::types::{FsError, InodeId};

/// Reservations with numbers left that one session may hold at once.
pub const MAX_BLOCKS_PER_SESSION: usize = 4;

/// One reservation: which of its numbers are still free.
#[derive(Debug)]
struct Block {
    reply: ReserveInodesReply,
    /// One bit per number, set once taken.
    taken: Vec<u64>,
    left: u32,
}

/// The reservations of every live session.
#[derive(Debug, Default)]
pub struct Reserved {
    by_session: Mutex<HashMap<u64, Vec<Block>>>,
}

impl Reserved {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Vec<Block>>> {
        self.by_session.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether `session` may reserve more numbers now.
    pub fn has_room(&self, session: u64) -> bool {
        self.lock()
            .get(&session)
            .is_none_or(|b| b.len() < MAX_BLOCKS_PER_SESSION)
    }

    /// Notes the numbers of `reply` as `session`'s.
    pub fn add(&self, session: u64, reply: ReserveInodesReply) {
        let words = usize::try_from(reply.count.div_ceil(64)).unwrap_or(0);
        self.lock().entry(session).or_default().push(Block {
            reply,
            taken: vec![0; words],
            left: reply.count,
        });
    }

    /// Takes number `ino` out of `session`'s reservations for its create; answers its
    /// generation. An error (changing nothing) unless it is reserved to the session and not
    /// taken yet.
    pub fn take(&self, session: u64, ino: InodeId) -> Result<u64, FsError> {
        let mut all = self.lock();
        let not_reserved = || {
            FsError::Invalid(format!(
                "inode {} is not reserved to this session, or was used already",
                ino.0
            ))
        };
        let blocks = all.get_mut(&session).ok_or_else(not_reserved)?;
        let (at, generation) = blocks
            .iter()
            .enumerate()
            .find_map(|(at, b)| b.reply.generation_of(ino).map(|g| (at, g)))
            .ok_or_else(not_reserved)?;
        let block = &mut blocks[at];
        let i = ino.0 - block.reply.first.0;
        let (word, bit) = (
            usize::try_from(i / 64).unwrap_or(usize::MAX),
            1u64 << (i % 64),
        );
        let w = block.taken.get_mut(word).ok_or_else(not_reserved)?;
        if *w & bit != 0 {
            return Err(not_reserved());
        }
        *w |= bit;
        block.left -= 1;
        if block.left == 0 {
            blocks.remove(at);
            if blocks.is_empty() {
                all.remove(&session);
            }
        }
        Ok(generation)
    }

    /// Forgets every number of `session` (it ended).
    pub fn forget_session(&self, session: u64) {
        self.lock().remove(&session);
    }

    /// Numbers reserved and not used, over every session (metrics).
    pub fn left(&self) -> u64 {
        self.lock()
            .values()
            .flatten()
            .map(|b| u64::from(b.left))
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(first: u64, count: u32, first_generation: u64) -> ReserveInodesReply {
        ReserveInodesReply {
            first: InodeId(first),
            count,
            first_generation,
        }
    }

    #[test]
    fn a_number_is_taken_once_with_its_generation_and_only_by_its_session() {
        let r = Reserved::default();
        r.add(7, block(100, 70, 500));
        assert_eq!(r.take(7, InodeId(100)).unwrap(), 500);
        assert_eq!(r.take(7, InodeId(169)).unwrap(), 569);
        assert_eq!(r.take(7, InodeId(164)).unwrap(), 564);
        assert!(r.take(7, InodeId(100)).is_err(), "taken twice");
        assert!(r.take(7, InodeId(170)).is_err(), "past the block");
        assert!(r.take(7, InodeId(99)).is_err(), "before the block");
        assert!(r.take(8, InodeId(101)).is_err(), "another session's");
        assert_eq!(r.left(), 67);
        r.forget_session(7);
        assert!(r.take(7, InodeId(101)).is_err(), "forgotten");
        assert_eq!(r.left(), 0);
    }

    #[test]
    fn a_used_up_block_makes_room_for_another() {
        let r = Reserved::default();
        for k in 0..MAX_BLOCKS_PER_SESSION as u64 {
            assert!(r.has_room(1));
            r.add(1, block(10 * k + 1, 2, 0));
        }
        assert!(!r.has_room(1));
        assert!(r.has_room(2), "per session");
        r.take(1, InodeId(1)).unwrap();
        assert!(!r.has_room(1));
        r.take(1, InodeId(2)).unwrap();
        assert!(r.has_room(1));
    }
}
