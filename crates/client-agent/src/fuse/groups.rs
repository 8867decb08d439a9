//! The supplementary groups of the callers of requests, kept briefly.
//!
//! FUSE hands the agent a request's uid, gid and pid but not the caller's supplementary
//! groups: they come from `/proc/PID/status`, whose text the kernel builds at each read (tens
//! of microseconds of CPU; 13% of the agent's CPU in an `rm -rf` when read for every request,
//! docs/performance.md). The groups read for the same thread less than [`GROUPS_TTL`] ago are
//! used again, for every request. The mount has `default_permissions`: the kernel has checked
//! each request against the caller's exact credentials before it reaches the agent, so groups
//! up to a second old can only make the server's second check refuse what a group added in
//! that second allows (an error, never a wider access than the kernel granted). A release
//! reads none unless it drops flock locks.
//!
//! Safe against pid reuse and bounded against `setgroups`:
//! - an entry is keyed by (pid, uid, gid): a request with other ids reads afresh;
//! - it holds a pidfd of the process, opened *before* its status was read, and it is kept
//!   only if that process was still alive after the read (so the status was that
//!   process's), and used only while the process has not exited (a pid that died, and may
//!   be reused, is never served from an old entry);
//! - it lives [`GROUPS_TTL`]: a `setgroups` shows at the latest that much later;
//! - FUSE names the calling thread: the pidfd is the thread's (`PIDFD_THREAD`, Linux 6.9);
//!   on older kernels only a main thread has one, and a pid without a pidfd is not cached.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long a caller's groups are used again.
pub(crate) const GROUPS_TTL: Duration = Duration::from_secs(1);

/// The most callers remembered (the table is cleared when full).
const MAX_CALLERS: usize = 1024;

struct Entry {
    uid: u32,
    gid: u32,
    groups: Vec<u32>,
    read_at: Instant,
    pidfd: OwnedFd,
}

/// Recently read groups of requests' callers, by pid.
#[derive(Default)]
pub(crate) struct GroupsCache {
    entries: Mutex<HashMap<u32, Entry>>,
}

impl GroupsCache {
    /// The supplementary groups of process `pid` (uid `uid`, gid `gid`): from the cache when read less than [`GROUPS_TTL`] ago for the same living process and
    /// ids, else from `read` (which reads `/proc/PID/status`).
    pub(crate) fn groups(
        &self,
        pid: u32,
        uid: u32,
        gid: u32,
        now: Instant,
        read: impl FnOnce() -> Vec<u32>,
    ) -> Vec<u32> {
        {
            let entries = self.lock();
            if let Some(e) = entries.get(&pid)
                && e.uid == uid
                && e.gid == gid
                && now.saturating_duration_since(e.read_at) < GROUPS_TTL
                && alive(&e.pidfd)
            {
                return e.groups.clone();
            }
        }
        let pidfd = pidfd_of(pid);
        let groups = read();
        if let Some(pidfd) = pidfd
            && alive(&pidfd)
        {
            let mut entries = self.lock();
            if entries.len() >= MAX_CALLERS && !entries.contains_key(&pid) {
                entries.clear();
            }
            entries.insert(
                pid,
                Entry {
                    uid,
                    gid,
                    groups: groups.clone(),
                    read_at: now,
                    pidfd,
                },
            );
        } else {
            self.lock().remove(&pid);
        }
        groups
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u32, Entry>> {
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A pidfd of the thread `pid` (FUSE names the calling thread), or of the process when the
/// kernel has no thread pidfds (before Linux 6.9; then only a main thread has one).
fn pidfd_of(pid: u32) -> Option<OwnedFd> {
    use rustix::process::{Pid, PidfdFlags, pidfd_open};
    let pid = Pid::from_raw(i32::try_from(pid).ok()?)?;
    // PIDFD_THREAD is O_EXCL (linux/pidfd.h); its pidfd polls readable when the thread exits.
    let thread = PidfdFlags::from_bits_retain(libc::O_EXCL as u32);
    pidfd_open(pid, thread)
        .or_else(|_| pidfd_open(pid, PidfdFlags::empty()))
        .ok()
}

/// Whether the process of `pidfd` has not exited (a pidfd polls readable once it has).
fn alive(pidfd: &OwnedFd) -> bool {
    use rustix::event::{PollFd, PollFlags, Timespec, poll};
    let mut fds = [PollFd::new(pidfd, PollFlags::IN)];
    let zero = Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    matches!(poll(&mut fds, Some(&zero)), Ok(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn me() -> u32 {
        std::process::id()
    }

    #[test]
    fn groups_are_read_again_after_the_ttl_or_for_other_ids() {
        let c = GroupsCache::default();
        let t0 = Instant::now();
        let reads = std::cell::Cell::new(0);
        let read = |g: u32| {
            reads.set(reads.get() + 1);
            vec![g]
        };
        assert_eq!(c.groups(me(), 5, 6, t0, || read(1)), vec![1]);
        assert_eq!(
            c.groups(me(), 5, 6, t0 + Duration::from_millis(500), || read(2)),
            vec![1],
            "the same living process within the TTL: cached"
        );
        assert_eq!(reads.get(), 1);
        assert_eq!(
            c.groups(me(), 5, 7, t0 + Duration::from_millis(500), || read(3)),
            vec![3],
            "another gid: read afresh"
        );
        assert_eq!(
            c.groups(
                me(),
                5,
                7,
                t0 + Duration::from_millis(500) + GROUPS_TTL,
                || { read(4) }
            ),
            vec![4],
            "past the TTL: read afresh"
        );
        assert_eq!(reads.get(), 3);
    }

    #[test]
    fn a_threads_groups_are_cached_by_its_thread_id() {
        // What FUSE hands over for a multi-threaded caller: the calling thread's id.
        let tid: u32 = std::thread::spawn(|| {
            let link = std::fs::read_link("/proc/thread-self").unwrap();
            link.file_name().unwrap().to_str().unwrap().parse().unwrap()
        })
        .join()
        .unwrap();
        // That thread is gone: never cached.
        let c = GroupsCache::default();
        let t0 = Instant::now();
        assert_eq!(c.groups(tid, 0, 0, t0, || vec![1]), vec![1]);
        assert_eq!(c.groups(tid, 0, 0, t0, || vec![2]), vec![2]);
        // A living thread that is not the main one: cached where the kernel has thread
        // pidfds (Linux 6.9 and later).
        let (tx, rx) = std::sync::mpsc::channel();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let t = std::thread::spawn(move || {
            let link = std::fs::read_link("/proc/thread-self").unwrap();
            let tid: u32 = link.file_name().unwrap().to_str().unwrap().parse().unwrap();
            tx.send(tid).unwrap();
            let _ = done_rx.recv();
        });
        let tid = rx.recv().unwrap();
        assert_eq!(c.groups(tid, 0, 0, t0, || vec![3]), vec![3]);
        let thread_pidfds = pidfd_of(tid).is_some();
        let again = c.groups(tid, 0, 0, t0, || vec![4]);
        assert_eq!(again, if thread_pidfds { vec![3] } else { vec![4] });
        done_tx.send(()).unwrap();
        t.join().unwrap();
        assert_eq!(
            c.groups(tid, 0, 0, t0, || vec![5]),
            vec![5],
            "the thread exited: its entry is not used"
        );
    }

    #[test]
    fn a_dead_process_is_never_served_from_its_entry() {
        let c = GroupsCache::default();
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .expect("spawn sleep");
        let pid = child.id();
        let t0 = Instant::now();
        assert_eq!(c.groups(pid, 0, 0, t0, || vec![10]), vec![10]);
        assert_eq!(c.groups(pid, 0, 0, t0, || vec![11]), vec![10], "cached");
        child.kill().unwrap();
        child.wait().unwrap();
        // The pid may be reused from now on: the entry must not answer for it.
        assert_eq!(c.groups(pid, 0, 0, t0, || vec![12]), vec![12]);
    }
}
