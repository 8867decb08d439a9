//! Eviction through the real gRPC services, in real time (lease TTL 1 s, so the default hold
//! limit is 2 s) on real file-backed LUNs: a node that keeps heartbeating but never completes
//! its write grant (its SAN I/O hangs) is evicted once another node has waited for it past the
//! hold limit; the other node's stat, read, write and truncate of the range then succeed; the
//! stuck node's bytes, written to the LUN under the grant but never completed, never appear;
//! its later Complete, attach and MapWrite are refused. `Admin.EvictSession` does the same on
//! an administrator's word.

use std::io::{Seek, SeekFrom, Write};
use std::time::{Duration, Instant};

use sanfs_proto::pb;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use crate::harness::{Clients, Running, root, rw, start_with_luns};

const MIB: u64 = 1 << 20;
const TTL_MS: u64 = 1000;
/// The default hold limit: two lease periods.
const HOLD_LIMIT_MS: u64 = 2 * TTL_MS;

/// A session whose stream is attached and heartbeats every 200 ms until the stream ends;
/// what the server sends arrives on `events`.
struct Node {
    c: Clients,
    session: u64,
    epoch: u64,
    events: mpsc::UnboundedReceiver<(Instant, pb::session_stream_reply::Event)>,
    heartbeats: tokio::task::JoinHandle<()>,
}

async fn node(srv: &Running) -> Node {
    let mut c = srv.clients().await;
    let (session, epoch) = c.open_session().await;
    let (tx, rx) = mpsc::channel(16);
    tx.send(attach_msg(session, epoch)).await.unwrap();
    let mut inbound = c
        .session
        .session_stream(ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    let heartbeats = tokio::spawn(async move {
        for seq in 1.. {
            let hb = pb::SessionStreamRequest {
                event: Some(pb::session_stream_request::Event::Heartbeat(
                    pb::Heartbeat { seq, renew: None },
                )),
            };
            if tx.send(hb).await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    });
    let (ev_tx, events) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok(Some(m)) = inbound.message().await {
            if let Some(e) = m.event {
                let _ = ev_tx.send((Instant::now(), e));
            }
        }
    });
    Node {
        c,
        session,
        epoch,
        events,
        heartbeats,
    }
}

fn attach_msg(session: u64, epoch: u64) -> pb::SessionStreamRequest {
    pb::SessionStreamRequest {
        event: Some(pb::session_stream_request::Event::Attach(pb::Attach {
            session,
            epoch,
        })),
    }
}

impl Node {
    /// Waits for `SessionEnded` on the stream (skipping acknowledgements); returns when it
    /// arrived and the message.
    async fn ended(&mut self, within: Duration) -> (Instant, pb::SessionEnded) {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let (at, e) = tokio::time::timeout_at(deadline, self.events.recv())
                .await
                .expect("SessionEnded in time")
                .expect("the stream ended without SessionEnded");
            if let pb::session_stream_reply::Event::Ended(end) = e {
                return (at, end);
            }
        }
    }

    /// Acknowledgements received in `window` from now.
    async fn acks_within(&mut self, window: Duration) -> usize {
        let deadline = tokio::time::Instant::now() + window;
        let mut acks = 0;
        while let Ok(Some((_, e))) = tokio::time::timeout_at(deadline, self.events.recv()).await {
            if matches!(e, pb::session_stream_reply::Event::HeartbeatAck(_)) {
                acks += 1;
            }
        }
        acks
    }

    async fn create(&mut self, name: &str) -> (u64, u64) {
        let r = self
            .c
            .ns
            .create(pb::CreateRequest {
                delegate: false,
                inode: 0,
                time: None,
                request_id: None,
                cred: root(),
                session: self.session,
                parent: 1,
                name: name.into(),
                perm: 0o644,
                exclusive: false,
                flags: rw(),
            })
            .await
            .unwrap()
            .into_inner();
        (r.attr.unwrap().ino, r.handle)
    }

    async fn open(&mut self, ino: u64) -> u64 {
        self.c
            .ns
            .open(pb::OpenRequest {
                cred: root(),
                session: self.session,
                inode: ino,
                flags: rw(),
                read_small: 0,
            })
            .await
            .unwrap()
            .into_inner()
            .handle
    }

    fn map(&self, handle: u64, ino: u64, offset: u64, length: u64) -> pb::MapRequest {
        pb::MapRequest {
            cred: root(),
            session: self.session,
            epoch: self.epoch,
            handle,
            inode: ino,
            offset,
            length,
            sync: false,
            ..Default::default()
        }
    }

    fn complete(&self, grant_id: u64, bytes_done: u64) -> pb::CompleteRequest {
        pb::CompleteRequest {
            session: self.session,
            epoch: self.epoch,
            grant_id,
            status: pb::IoStatus::Ok as i32,
            errors: vec![],
            bytes_done,
            sync: true,
            ..Default::default()
        }
    }

    fn read(&self, handle: u64, ino: u64, offset: u64, length: u64) -> pb::ReadRequest {
        pb::ReadRequest {
            cred: root(),
            session: self.session,
            handle,
            inode: ino,
            offset,
            length,
        }
    }
}

/// Writes `byte` over every device I/O of `grant` straight to the LUN files, as the holder's
/// device I/O would.
fn write_grant_to_luns(srv: &Running, grant: &pb::Grant, byte: u8) {
    for io in &grant.device_ios {
        let path = srv.dir().join(format!("lun{}", io.device));
        let mut f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
        f.seek(SeekFrom::Start(io.phys_off)).unwrap();
        f.write_all(&vec![byte; io.len as usize]).unwrap();
        f.sync_all().unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_that_heartbeats_but_never_completes_is_evicted_and_the_others_proceed() {
    let srv = start_with_luns(TTL_MS).await;
    let mut a = node(&srv).await;
    let mut b = node(&srv).await;

    // A makes a 2 MiB file of Unwritten blocks (fallocate), takes a write grant of its second
    // MiB, writes 0xee there on the LUNs, and never completes: its SAN I/O "hangs".
    let (ino, ha) = a.create("stuck").await;
    a.c.data
        .fallocate(pb::FallocateRequest {
            cred: root(),
            session: a.session,
            handle: ha,
            inode: ino,
            offset: 0,
            length: 2 * MIB,
            mode: pb::FallocateMode::Allocate as i32,
        })
        .await
        .unwrap();
    let stuck =
        a.c.data
            .map_write(a.map(ha, ino, MIB, MIB))
            .await
            .unwrap()
            .into_inner();
    assert_eq!(stuck.device_ios.iter().map(|d| d.len).sum::<u64>(), MIB);
    write_grant_to_luns(&srv, &stuck, 0xee);

    // B's stat and read of the range wait for A's grant.
    let hb = b.open(ino).await;
    let t0 = Instant::now();
    let mut ns = b.c.ns.clone();
    let stat = tokio::spawn(async move {
        let r = ns
            .get_attr(pb::GetAttrRequest {
                cred: root(),
                inode: ino,
                session: None,
            })
            .await;
        (r, Instant::now())
    });
    let mut data = b.c.data.clone();
    let read_req = b.read(hb, ino, MIB, 64 * 1024);
    let read = tokio::spawn(async move { (data.read(read_req).await, Instant::now()) });

    // A is evicted once B has waited the hold limit: its stream says so.
    let (evicted_at, end) = a.ended(Duration::from_secs(10)).await;
    let evicted_after = evicted_at - t0;
    eprintln!(
        "evicted {evicted_after:?} after another node began to wait (limit {HOLD_LIMIT_MS} ms)"
    );
    assert_eq!(end.reason, pb::SessionEndReason::Evicted as i32, "{end:?}");
    assert!(end.message.contains("hold limit"), "{end:?}");
    assert!(
        evicted_after >= Duration::from_millis(HOLD_LIMIT_MS - 100),
        "not before the hold limit: {evicted_after:?}"
    );
    assert!(
        evicted_after <= Duration::from_millis(HOLD_LIMIT_MS + 2000),
        "evicted within the bound (plus room for a loaded machine): {evicted_after:?}"
    );
    // Its completion is refused at once, although its lease has not run out yet.
    let refused = a.c.data.complete(a.complete(stuck.grant_id, MIB)).await;
    let status = refused.expect_err("an evicted session's Complete is refused");
    assert_eq!(status.code(), tonic::Code::FailedPrecondition, "{status:?}");

    // B's stat and read then succeed, once A's lease has run out.
    let (attr, stat_at) = stat.await.unwrap();
    let attr = attr.expect("stat succeeds").into_inner().attr.unwrap();
    assert_eq!(attr.size, 2 * MIB);
    let (got, read_at) = read.await.unwrap();
    let got = got.expect("read succeeds").into_inner().data;
    assert_eq!(got.len(), 64 * 1024);
    assert!(
        got.iter().all(|&x| x == 0),
        "the stuck grant's range stays Unwritten: zeros, not the uncompleted bytes"
    );
    for (what, at) in [("stat", stat_at), ("read", read_at)] {
        let waited = at - t0;
        eprintln!("B's {what} waited {waited:?}");
        assert!(
            waited <= Duration::from_millis(HOLD_LIMIT_MS + TTL_MS + 4000),
            "B's {what} waited {waited:?}"
        );
    }
    // And so do B's write and truncate of that range, and a direct read grant there.
    b.c.data
        .write(pb::WriteRequest {
            cred: root(),
            session: b.session,
            handle: hb,
            inode: ino,
            offset: MIB,
            data: vec![0x77; 4096],
            sync: true,
            append: false,
            request_id: None,
            then_set_attr: None,
        })
        .await
        .expect("B writes the range");
    b.c.ns
        .set_attr(pb::SetAttrRequest {
            cred: root(),
            inode: ino,
            changes: Some(pb::SetAttrChanges {
                size: Some(MIB + MIB / 2),
                ..Default::default()
            }),
            handle: Some(hb),
            session: Some(b.session),
        })
        .await
        .expect("B truncates the range");
    let got =
        b.c.data
            .read(b.read(hb, ino, MIB, MIB))
            .await
            .unwrap()
            .into_inner()
            .data;
    assert_eq!(got.len() as u64, MIB / 2);
    assert!(got[..4096].iter().all(|&x| x == 0x77), "B's write");
    assert!(
        got[4096..].iter().all(|&x| x == 0),
        "the rest reads as zeros"
    );
    let rg =
        b.c.data
            .map_read(b.map(hb, ino, MIB, MIB / 2))
            .await
            .expect("a read grant of the range")
            .into_inner();
    let zero: u64 = rg.zero_fill.iter().map(|z| z.len).sum();
    assert_eq!(zero, MIB / 2 - 4096, "{rg:?}");

    // A's session is gone: its heartbeats are not answered, it cannot attach again, its
    // calls and its late Complete are refused.
    assert_eq!(a.acks_within(Duration::from_millis(500)).await, 0);
    let (tx, rx) = mpsc::channel(1);
    tx.send(attach_msg(a.session, a.epoch)).await.unwrap();
    let again = match a.c.session.session_stream(ReceiverStream::new(rx)).await {
        Err(s) => Err(s),
        Ok(r) => r.into_inner().message().await.map(|_| ()),
    };
    assert_eq!(
        again.expect_err("an evicted session cannot attach").code(),
        tonic::Code::FailedPrecondition
    );
    let late = a.c.data.complete(a.complete(stuck.grant_id, MIB)).await;
    assert!(
        late.is_err(),
        "a late Complete of an evicted session: {late:?}"
    );
    let map = a.c.data.map_write(a.map(ha, ino, 0, MIB)).await;
    assert!(map.is_err(), "an evicted session's MapWrite: {map:?}");
    let status =
        b.c.admin
            .server_status(pb::ServerStatusRequest {})
            .await
            .unwrap()
            .into_inner();
    let live: Vec<u64> = status.sessions.iter().map(|s| s.session).collect();
    assert_eq!(
        live,
        vec![b.session],
        "A's session ended at its lease's end"
    );

    a.heartbeats.abort();
    b.heartbeats.abort();
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_administrator_evicts_a_session_and_its_grants_go_at_its_lease_end() {
    let srv = start_with_luns(TTL_MS).await;
    let mut a = node(&srv).await;
    let mut b = node(&srv).await;
    let (ino, ha) = a.create("admin").await;
    let grant =
        a.c.data
            .map_write(a.map(ha, ino, 0, MIB))
            .await
            .unwrap()
            .into_inner();

    // Bad requests change nothing.
    let zero =
        b.c.admin
            .evict_session(pb::EvictSessionRequest {
                session: 0,
                reason: String::new(),
            })
            .await
            .expect_err("session 0");
    assert_eq!(zero.code(), tonic::Code::InvalidArgument);
    let unknown =
        b.c.admin
            .evict_session(pb::EvictSessionRequest {
                session: a.session + 1000,
                reason: String::new(),
            })
            .await
            .expect_err("an unknown session");
    assert_eq!(unknown.code(), tonic::Code::NotFound);

    let reply =
        b.c.admin
            .evict_session(pb::EvictSessionRequest {
                session: a.session,
                reason: "node a's SAN path is down".into(),
            })
            .await
            .unwrap()
            .into_inner();
    let evicted = Instant::now();
    assert!(reply.lease_remaining_ms <= TTL_MS + 900, "{reply:?}");
    let (_, end) = a.ended(Duration::from_secs(5)).await;
    assert_eq!(end.reason, pb::SessionEndReason::Evicted as i32);
    assert!(end.message.contains("SAN path is down"), "{end:?}");
    // Evicting it again is harmless.
    b.c.admin
        .evict_session(pb::EvictSessionRequest {
            session: a.session,
            reason: String::new(),
        })
        .await
        .unwrap();
    let refused = a.c.data.complete(a.complete(grant.grant_id, MIB)).await;
    assert!(refused.is_err(), "fenced: {refused:?}");

    // B's write of the range proceeds once A's lease has run out, not before.
    let hb = b.open(ino).await;
    let g =
        b.c.data
            .map_write(b.map(hb, ino, 0, MIB))
            .await
            .expect("B's write grant")
            .into_inner();
    let waited = evicted.elapsed();
    assert!(
        waited <= Duration::from_millis(reply.lease_remaining_ms + 2000),
        "{waited:?} {reply:?}"
    );
    b.c.data
        .complete(b.complete(g.grant_id, MIB))
        .await
        .unwrap();
    a.heartbeats.abort();
    b.heartbeats.abort();
    srv.stop().await;
}
