//! Who does what: per-session and per-RPC counters for `ServerStatus` (`sanfs-admin top`).
//!
//! Each request runs inside [`charged`] (the service layer wraps every gRPC service in
//! [`Charged`]), which opens a per-request tally in a task-local. The handler names its
//! session (`service::note`), and the grant and proxied-path code adds what it handed out or
//! moved ([`add_grant`], [`add_proxied`]); when the answer is sent, [`Activity::record`] adds
//! the tally to the session's counters, to the server's totals and to the RPC's own. A
//! request that names no session (the namespace calls) counts in its RPC's tally and the
//! server's totals only.
//!
//! Counters of a session go when it ends ([`Activity::forget_session`]) and, for a request
//! that came in as it ended, when the status is next read ([`Activity::retain_sessions`]);
//! the server's totals keep what they did. At most [`MAX_TRACKED_SESSIONS`] sessions have
//! counters of their own at once.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::Duration;

use sanfs_proto::model::{Activity as Counters, MAX_STATUS_RPCS, RpcTally};

/// Most sessions with counters of their own; requests of more count in the totals only.
pub const MAX_TRACKED_SESSIONS: usize = 65_536;

/// What one request did, collected while it runs.
#[derive(Debug, Default, Clone, Copy)]
struct Tally {
    session: Option<u64>,
    read_grants: u64,
    write_grants: u64,
    granted_read_bytes: u64,
    granted_write_bytes: u64,
    proxied_read_bytes: u64,
    proxied_write_bytes: u64,
}

tokio::task_local! {
    /// The activity table of the server answering the current request.
    static TABLE: Arc<Activity>;
    /// What the current request did so far.
    static TALLY: RefCell<Tally>;
}

/// Per-session and per-RPC counters of one server.
#[derive(Debug, Default)]
pub struct Activity {
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    sessions: HashMap<u64, Counters>,
    totals: Counters,
    rpcs: BTreeMap<&'static str, RpcTally>,
}

fn add(to: &mut u64, n: u64) {
    *to = to.saturating_add(n);
}

/// Adds one answered request's tally to `c`.
fn add_tally(c: &mut Counters, t: &Tally, error: bool, micros: u64) {
    add(&mut c.rpcs, 1);
    add(&mut c.rpc_errors, u64::from(error));
    add(&mut c.rpc_micros, micros);
    add(&mut c.read_grants, t.read_grants);
    add(&mut c.write_grants, t.write_grants);
    add(&mut c.granted_read_bytes, t.granted_read_bytes);
    add(&mut c.granted_write_bytes, t.granted_write_bytes);
    add(&mut c.proxied_read_bytes, t.proxied_read_bytes);
    add(&mut c.proxied_write_bytes, t.proxied_write_bytes);
}

impl Activity {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn record(&self, rpc: &'static str, tally: &Tally, error: bool, elapsed: Duration) {
        let micros = u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX);
        let mut inner = self.lock();
        add_tally(&mut inner.totals, tally, error, micros);
        if let Some(session) = tally.session
            && (inner.sessions.len() < MAX_TRACKED_SESSIONS
                || inner.sessions.contains_key(&session))
        {
            add_tally(
                inner.sessions.entry(session).or_default(),
                tally,
                error,
                micros,
            );
        }
        let bounded = inner.rpcs.len() < MAX_STATUS_RPCS || inner.rpcs.contains_key(rpc);
        if bounded {
            let t = inner.rpcs.entry(rpc).or_insert_with(|| RpcTally {
                rpc: rpc.to_owned(),
                count: 0,
                errors: 0,
                micros: 0,
            });
            add(&mut t.count, 1);
            add(&mut t.errors, u64::from(error));
            add(&mut t.micros, micros);
        }
    }

    /// The counters of `session` (zero when it did nothing yet).
    pub fn session(&self, session: u64) -> Counters {
        self.lock()
            .sessions
            .get(&session)
            .copied()
            .unwrap_or_default()
    }

    /// The server's totals.
    pub fn totals(&self) -> Counters {
        self.lock().totals
    }

    /// Every RPC's tally, by name.
    pub fn rpcs(&self) -> Vec<RpcTally> {
        self.lock().rpcs.values().cloned().collect()
    }

    /// Forgets the counters of an ended session.
    pub fn forget_session(&self, session: u64) {
        self.lock().sessions.remove(&session);
    }

    /// Forgets the counters of sessions for which `live` is false.
    pub fn retain_sessions(&self, live: impl Fn(u64) -> bool) {
        self.lock().sessions.retain(|id, _| live(*id));
    }
}

/// Runs one request with a tally of its own, charged to `table` (when the request runs
/// under [`Charged`]) once it is answered.
pub async fn charged<T, E>(
    rpc: &'static str,
    fut: impl Future<Output = Result<T, E>>,
    elapsed: impl FnOnce() -> Duration,
) -> Result<T, E> {
    let (r, tally) = TALLY
        .scope(RefCell::new(Tally::default()), async {
            let r = fut.await;
            (r, TALLY.with(|t| *t.borrow()))
        })
        .await;
    let _ = TABLE.try_with(|table| table.record(rpc, &tally, r.is_err(), elapsed()));
    r
}

fn with_tally(f: impl FnOnce(&mut Tally)) {
    let _ = TALLY.try_with(|t| f(&mut t.borrow_mut()));
}

/// Names the session the current request acts for.
pub fn note_session(session: u64) {
    with_tally(|t| t.session = Some(session));
}

/// Adds a grant of `bytes` handed out by the current request.
pub fn add_grant(write: bool, bytes: u64) {
    with_tally(|t| {
        if write {
            add(&mut t.write_grants, 1);
            add(&mut t.granted_write_bytes, bytes);
        } else {
            add(&mut t.read_grants, 1);
            add(&mut t.granted_read_bytes, bytes);
        }
    });
}

/// Adds bytes the current request moved on the proxied path.
pub fn add_proxied(write: bool, bytes: u64) {
    with_tally(|t| {
        if write {
            add(&mut t.proxied_write_bytes, bytes);
        } else {
            add(&mut t.proxied_read_bytes, bytes);
        }
    });
}

/// A gRPC service whose requests are charged to one server's [`Activity`].
#[derive(Debug, Clone)]
pub struct Charged<S> {
    inner: S,
    table: Arc<Activity>,
}

impl<S> Charged<S> {
    pub fn new(inner: S, table: Arc<Activity>) -> Charged<S> {
        Charged { inner, table }
    }
}

impl<S: tonic::server::NamedService> tonic::server::NamedService for Charged<S> {
    const NAME: &'static str = S::NAME;
}

impl<S, R> tower::Service<R> for Charged<S>
where
    S: tower::Service<R>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = tokio::task::futures::TaskLocalFuture<Arc<Activity>, S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: R) -> Self::Future {
        TABLE.scope(self.table.clone(), self.inner.call(request))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_request_is_charged_to_its_session_its_rpc_and_the_totals() {
        let table = Arc::new(Activity::default());
        let ok: Result<(), ()> = TABLE
            .scope(
                table.clone(),
                charged(
                    "MapWrite",
                    async {
                        note_session(7);
                        add_grant(true, 4096);
                        add_proxied(false, 10);
                        Ok(())
                    },
                    || Duration::from_micros(250),
                ),
            )
            .await;
        assert_eq!(ok, Ok(()));
        let failed: Result<(), ()> = TABLE
            .scope(
                table.clone(),
                charged("Lookup", async { Err(()) }, || Duration::from_micros(5)),
            )
            .await;
        assert_eq!(failed, Err(()));
        let s = table.session(7);
        assert_eq!((s.rpcs, s.rpc_errors, s.rpc_micros), (1, 0, 250));
        assert_eq!((s.write_grants, s.granted_write_bytes), (1, 4096));
        assert_eq!(s.proxied_read_bytes, 10);
        let t = table.totals();
        assert_eq!((t.rpcs, t.rpc_errors, t.rpc_micros), (2, 1, 255));
        let names: Vec<(String, u64, u64)> = table
            .rpcs()
            .into_iter()
            .map(|r| (r.rpc, r.count, r.errors))
            .collect();
        assert_eq!(names, [("Lookup".into(), 1, 1), ("MapWrite".into(), 1, 0)]);
        table.forget_session(7);
        assert_eq!(table.session(7), Counters::default());
        table.retain_sessions(|_| false);
        assert_eq!(table.totals().rpcs, 2);
    }

    #[test]
    fn sessions_beyond_the_bound_count_in_the_totals_only() {
        let table = Activity::default();
        let tally = |s: u64| Tally {
            session: Some(s),
            ..Tally::default()
        };
        for s in 0..=MAX_TRACKED_SESSIONS as u64 {
            table.record("Heartbeat", &tally(s), false, Duration::ZERO);
        }
        assert_eq!(table.session(0).rpcs, 1);
        assert_eq!(table.session(MAX_TRACKED_SESSIONS as u64).rpcs, 0);
        assert_eq!(table.totals().rpcs, MAX_TRACKED_SESSIONS as u64 + 1);
        // A tracked session goes on counting; an ended one makes room.
        table.record("Heartbeat", &tally(0), false, Duration::ZERO);
        assert_eq!(table.session(0).rpcs, 2);
        table.forget_session(1);
        table.record("Heartbeat", &tally(u64::MAX), false, Duration::ZERO);
        assert_eq!(table.session(u64::MAX).rpcs, 1);
    }

    #[tokio::test]
    async fn outside_a_charged_service_nothing_is_recorded_and_nothing_fails() {
        let r: Result<u8, ()> = charged(
            "X",
            async {
                note_session(1);
                Ok(3)
            },
            || Duration::ZERO,
        )
        .await;
        assert_eq!(r, Ok(3));
        note_session(1);
        add_grant(false, 1);
    }
}
