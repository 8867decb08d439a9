//! The reply cache of non-idempotent requests (`replies.rs`): a request sent again with the
//! same `request_id` gets the first try's reply instead of running again, also after a
//! `kill -9` of the real server between the commit and the reply; the cached reply is in the
//! same transaction as the change (a crash before that commit was durable loses both, and the
//! retry then runs afresh); entries below an agent's lowest pending request and old entries
//! are forgotten.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use sanfs_mds::clock::Clock;
use sanfs_mds::ns;
use sanfs_mds::replies::{self, MAX_AGE_SECS, Once};
use sanfs_mds::store::backend::{FaultPlan, SimDisk};
use sanfs_mds::store::{Backend, ROOT, Store};
use sanfs_proto::model::{MkdirRequest, RequestId};
use sanfs_proto::pb;
use sanfs_proto::status::fs_error_from_status;
use sanfs_proto::types::{Credentials, FsError, InodeId};

use crate::harness::{Clients, root, rw};
use crate::support::{fs_info, name};

const EPOCH_SEC: i64 = 1_700_000_000;

fn id(seq: u64, lowest_pending: u64) -> RequestId {
    RequestId {
        client: 0x00c1_1e47,
        seq,
        lowest_pending,
    }
}

/// Mkdir `n` in the root through the reply cache (`lazy`: a commit that is not synced).
fn mkdir(store: &Store, n: &str, id: Option<RequestId>, lazy: bool) -> Result<Once<u64>, FsError> {
    let r = MkdirRequest {
        cred: Credentials::root(),
        parent: InodeId(ROOT),
        name: name(n),
        perm: 0o755,
        delegate: false,
    };
    let job = move |ctx: &mut sanfs_mds::store::Ctx<'_>| {
        replies::run_once(ctx, id, 0, |ctx| {
            ns::mkdir(ctx, &r).map(pb::MkdirReply::from)
        })
    };
    let once = if lazy {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(store.write_lazy(job))?
    } else {
        store.write_blocking(job)?
    };
    let ino = |p: &pb::MkdirReply| p.attr.as_ref().unwrap().ino;
    Ok(match once {
        Once::Fresh(p) => Once::Fresh(ino(&p)),
        Once::Replayed(s) => Once::Replayed(replies::Stored {
            reply: ino(&s.reply),
            session: s.session,
        }),
    })
}

fn entries(store: &Store) -> u64 {
    store.write_blocking(|ctx| replies::count(ctx)).unwrap()
}

#[test]
fn a_cached_reply_commits_with_its_change_and_is_forgotten_in_time() {
    let clock = Clock::manual(EPOCH_SEC);
    let disk = SimDisk::new(FaultPlan::default());
    sanfs_testcluster::mds::create_store(&Backend::Sim(disk.clone()), &fs_info(), &clock).unwrap();
    let store = Store::open(&Backend::Sim(disk.clone()), clock.clone(), 64).unwrap();

    // A durable change with its reply.
    let Once::Fresh(durable) = mkdir(&store, "durable", Some(id(1, 1)), false).unwrap() else {
        panic!("a new request runs")
    };
    // The same request again, before any crash: the stored reply, nothing runs.
    assert!(matches!(
        mkdir(&store, "durable", Some(id(1, 1)), false).unwrap(),
        Once::Replayed(s) if s.reply == durable
    ));
    assert_eq!(entries(&store), 1);
    // A lazy one (committed, not yet synced: any durable commit would sync it too).
    let Once::Fresh(_) = mkdir(&store, "lazy", Some(id(2, 1)), true).unwrap() else {
        panic!("a new request runs")
    };

    // Crash: only what was synced survives, the change and its reply together.
    let image = disk.durable_image();
    store.close();
    let disk = SimDisk::from_image(image, FaultPlan::default());
    let store = Store::open(&Backend::Sim(disk.clone()), clock.clone(), 64).unwrap();
    let exists = |n: &str| {
        store
            .read(|t| t.dirent(InodeId(ROOT), n.as_bytes()))
            .unwrap()
            .is_some()
    };
    assert!(exists("durable") && !exists("lazy"));
    assert_eq!(entries(&store), 1, "the lazy change's reply went with it");
    // Retried after the crash: the durable one answers as the first try did (not EEXIST);
    // the lost one runs afresh.
    assert!(matches!(
        mkdir(&store, "durable", Some(id(1, 1)), false).unwrap(),
        Once::Replayed(s) if s.reply == durable
    ));
    let Once::Fresh(lazy) = mkdir(&store, "lazy", Some(id(2, 1)), false).unwrap() else {
        panic!("a change lost in the crash runs again")
    };
    assert!(exists("lazy"));
    assert!(matches!(
        mkdir(&store, "lazy", Some(id(2, 1)), false).unwrap(),
        Once::Replayed(s) if s.reply == lazy
    ));
    // Without an id nothing is cached: the name exists.
    assert_eq!(
        mkdir(&store, "durable", None, false).unwrap_err(),
        FsError::Exists
    );
    // A refused request stores nothing.
    assert_eq!(
        mkdir(&store, "durable", Some(id(3, 1)), false).unwrap_err(),
        FsError::Exists
    );
    assert_eq!(entries(&store), 2);

    // The agent says it will not send 1..=3 again: they are forgotten (seq 1 would now run
    // again, and fail as a plain mkdir does).
    let Once::Fresh(_) = mkdir(&store, "later", Some(id(4, 4)), false).unwrap() else {
        panic!("a new request runs")
    };
    assert_eq!(entries(&store), 1);
    assert_eq!(
        mkdir(&store, "durable", Some(id(1, 1)), false).unwrap_err(),
        FsError::Exists
    );

    // Old entries go at the next start's sweep.
    clock.advance_ns((MAX_AGE_SECS + 1) * 1_000_000_000);
    assert_eq!(store.write_blocking(replies::sweep).unwrap(), 1);
    assert_eq!(entries(&store), 0);
}

// ---- the real server, killed after the commit ----

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_sanfs-mds")
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn setup(dir: &Path, port: u16) -> PathBuf {
    let luns: Vec<PathBuf> = (0..2).map(|i| dir.join(format!("lun{i}"))).collect();
    for l in &luns {
        std::fs::File::create(l).unwrap().set_len(32 << 20).unwrap();
    }
    let devices: Vec<String> = luns
        .iter()
        .map(|l| format!("{:?}", l.display().to_string()))
        .collect();
    let config = dir.join("mds.toml");
    std::fs::write(
        &config,
        format!(
            "[server]\nlisten = \"127.0.0.1:{port}\"\ninsecure = true\nlease_ttl_ms = 600000\n\
             [metadata]\npath = {:?}\n\
             [volume]\nlayout = \"striped\"\nstripe_unit = \"64KiB\"\ndevices = [{}]\n",
            dir.join("meta.redb").display().to_string(),
            devices.join(", ")
        ),
    )
    .unwrap();
    let out = Command::new(bin())
        .args(["format", "--config", config.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(out.status.success(), "format: {out:?}");
    config
}

/// The server process; killed (SIGKILL) when dropped.
struct Server(Child);

impl Server {
    fn kill9(&mut self) {
        let _ = self.0.kill(); // SIGKILL
        let _ = self.0.wait();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill9();
    }
}

async fn start(config: &Path, port: u16) -> (Server, Clients) {
    let mut child = Server(
        Command::new(bin())
            .args(["serve", "--config", config.to_str().unwrap()])
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        assert!(child.0.try_wait().unwrap().is_none(), "sanfs-mds exited");
        if let Ok(ch) = tonic::transport::Channel::from_shared(format!("http://127.0.0.1:{port}"))
            .unwrap()
            .connect()
            .await
        {
            return (child, Clients::new(ch));
        }
        assert!(Instant::now() < deadline, "sanfs-mds did not start");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn create(session: u64, name: &str, id: Option<RequestId>) -> pb::CreateRequest {
    pb::CreateRequest {
        delegate: false,
        inode: 0,
        time: None,
        cred: root(),
        session,
        parent: ROOT,
        name: name.into(),
        perm: 0o644,
        exclusive: true,
        flags: rw(),
        request_id: id.map(Into::into),
    }
}

#[tokio::test]
async fn a_create_retried_after_kill_9_gets_its_reply_not_eexist() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let config = setup(dir.path(), port);
    let (mut server, mut c) = start(&config, port).await;
    let (session, _) = c.open_session().await;
    let first =
        c.ns.create(create(session, "once", Some(id(1, 1))))
            .await
            .unwrap()
            .into_inner();
    let ino = first.attr.as_ref().unwrap().ino;
    c.ns.unlink(pb::UnlinkRequest {
        cred: root(),
        parent: ROOT,
        name: "gone".into(),
        request_id: None,
    })
    .await
    .unwrap_err();
    c.ns.mkdir(pb::MkdirRequest {
        cred: root(),
        parent: ROOT,
        name: "d".into(),
        perm: 0o755,
        delegate: false,
        request_id: Some(id(2, 1).into()),
    })
    .await
    .unwrap();
    c.ns.rmdir(pb::RmdirRequest {
        cred: root(),
        parent: ROOT,
        name: "d".into(),
        request_id: Some(id(3, 1).into()),
    })
    .await
    .unwrap();
    // The replies are "lost": the server dies right after the commits.
    server.kill9();
    let (_server, mut c) = start(&config, port).await;
    let (new_session, _) = c.open_session().await;
    assert_ne!(new_session, session);
    // The retries, under the new session, with the same ids.
    let again =
        c.ns.create(create(new_session, "once", Some(id(1, 1))))
            .await
            .expect("a retried create is answered as the first try was")
            .into_inner();
    assert_eq!(again.attr.as_ref().unwrap().ino, ino, "the same inode");
    assert!(again.created);
    // Its handle belongs to the new session: usable, and released cleanly.
    c.ns.release(pb::ReleaseRequest {
        session: new_session,
        handle: again.handle,
    })
    .await
    .expect("the handle of the replayed create is the new session's");
    c.ns.rmdir(pb::RmdirRequest {
        cred: root(),
        parent: ROOT,
        name: "d".into(),
        request_id: Some(id(3, 1).into()),
    })
    .await
    .expect("a retried rmdir is answered as the first try was (not ENOENT)");
    // Without the cache the same create is EEXIST: the name was there all along.
    let e =
        c.ns.create(create(new_session, "once", None))
            .await
            .unwrap_err();
    assert_eq!(fs_error_from_status(&e), FsError::Exists);
    let e =
        c.ns.create(create(new_session, "once", Some(id(9, 9))))
            .await
            .unwrap_err();
    assert_eq!(fs_error_from_status(&e), FsError::Exists, "a new id runs");
}

fn append(
    session: u64,
    handle: u64,
    ino: u64,
    data: &[u8],
    id: Option<RequestId>,
) -> pb::WriteRequest {
    pb::WriteRequest {
        cred: root(),
        session,
        handle,
        inode: ino,
        offset: 0,
        data: data.to_vec(),
        sync: false,
        append: true,
        request_id: id.map(Into::into),
        then_set_attr: None,
    }
}

#[tokio::test]
async fn an_append_retried_after_kill_9_is_not_written_twice() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let config = setup(dir.path(), port);
    let (mut server, mut c) = start(&config, port).await;
    let (session, _) = c.open_session().await;
    let file =
        c.ns.create(create(session, "log", None))
            .await
            .unwrap()
            .into_inner();
    let ino = file.attr.as_ref().unwrap().ino;
    let first = c
        .data
        .write(append(session, file.handle, ino, b"one\n", Some(id(1, 1))))
        .await
        .unwrap()
        .into_inner();
    assert_eq!((first.offset, first.bytes_written), (0, 4));
    // The same append again, on the live server: answered from the first try.
    let again = c
        .data
        .write(append(session, file.handle, ino, b"one\n", Some(id(1, 1))))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(again.offset, 0);
    // The reply is "lost": the server dies right after the commit.
    server.kill9();
    let (_server, mut c) = start(&config, port).await;
    let (new_session, _) = c.open_session().await;
    let reopened =
        c.ns.open(pb::OpenRequest {
            cred: root(),
            session: new_session,
            inode: ino,
            flags: rw(),
            read_small: 0,
        })
        .await
        .unwrap()
        .into_inner();
    let retried = c
        .data
        .write(append(
            new_session,
            reopened.handle,
            ino,
            b"one\n",
            Some(id(1, 1)),
        ))
        .await
        .expect("a retried append is answered as the first try was")
        .into_inner();
    assert_eq!((retried.offset, retried.bytes_written), (0, 4));
    assert_eq!(retried.attr.as_ref().unwrap().size, 4, "written once");
    // A new append (a new id) goes to the end.
    let next = c
        .data
        .write(append(
            new_session,
            reopened.handle,
            ino,
            b"two\n",
            Some(id(2, 2)),
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(next.offset, 4);
    let read = c
        .data
        .read(pb::ReadRequest {
            cred: root(),
            session: new_session,
            handle: reopened.handle,
            inode: ino,
            offset: 0,
            length: 64,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(read.data, b"one\ntwo\n");
}

// ---- a request id used again for another kind of request (found by fuzz_calls) ----

/// A request id is one request's: sent again with another kind of request (a buggy or
/// hostile agent), it is refused with EINVAL and nothing runs; it is never answered with the
/// earlier request's reply (a symlink "made" as the mkdir's directory), nor with "corrupt
/// metadata" (a stored Mkdir reply read as a Write reply). The first request's own retry still
/// gets its reply.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_id_reused_for_another_kind_of_request_is_refused() {
    let srv = crate::harness::start_with_luns(10_000).await;
    let mut c = srv.clients().await;
    let (session, _) = c.open_session().await;
    let rid = |seq| Some(pb::RequestId::from(id(seq, 1)));
    let mkdir = pb::MkdirRequest {
        cred: root(),
        parent: ROOT,
        name: b"d".to_vec(),
        perm: 0o755,
        delegate: false,
        request_id: rid(1),
    };
    let made = c.ns.mkdir(mkdir.clone()).await.unwrap().into_inner();
    // The same id on a symlink: refused, no symlink made.
    let e =
        c.ns.symlink(pb::SymlinkRequest {
            cred: root(),
            parent: ROOT,
            name: b"s".to_vec(),
            target: b"d".to_vec(),
            request_id: rid(1),
        })
        .await
        .unwrap_err();
    assert!(
        matches!(fs_error_from_status(&e), FsError::Invalid(_)),
        "{e:?}"
    );
    assert!(e.message().contains("Mkdir"), "{e:?}");
    let gone =
        c.ns.lookup(pb::LookupRequest {
            cred: root(),
            parent: ROOT,
            name: b"s".to_vec(),
            session: None,
        })
        .await
        .unwrap_err();
    assert_eq!(fs_error_from_status(&gone), FsError::NotFound);
    // The same id on an append: refused, nothing written.
    let file =
        c.ns.create(create(session, "log", None))
            .await
            .unwrap()
            .into_inner();
    let ino = file.attr.as_ref().unwrap().ino;
    let e = c
        .data
        .write(append(session, file.handle, ino, b"x", Some(id(1, 1))))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    // An append's id on a mknod: refused.
    c.data
        .write(append(session, file.handle, ino, b"one\n", Some(id(2, 1))))
        .await
        .unwrap();
    let e =
        c.ns.mknod(pb::MknodRequest {
            cred: root(),
            parent: ROOT,
            name: b"n".to_vec(),
            kind: pb::FileType::Fifo as i32,
            perm: 0o644,
            rdev: 0,
            request_id: rid(2),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    let attr =
        c.ns.get_attr(pb::GetAttrRequest {
            cred: root(),
            inode: ino,
            session: None,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        attr.attr.unwrap().size,
        4,
        "only the append with its own id wrote"
    );
    // The mkdir's own retry: its reply.
    let again = c.ns.mkdir(mkdir).await.unwrap().into_inner();
    assert_eq!(again.attr.unwrap().ino, made.attr.unwrap().ino);
    let dir = srv.stop_keeping_files().await;
    let report = sanfs_mds::fsck::check(&Backend::File(dir.path().join("mds.redb"))).unwrap();
    assert!(report.is_clean(), "{report}");
}
