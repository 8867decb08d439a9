//! A real server driven over gRPC as an attacker would (issue 16, docs/security.md):
//! unauthenticated plaintext, a local non-root user on the unix socket, a certificate of
//! another CA, another node's session ids, admin calls from a plain node, a session flood,
//! root on a root-squashed node. Each is refused; the server stays up and fsck is clean after.

use std::sync::{Arc, Mutex};

use sanfs_mds::clock::Clock;
use sanfs_mds::service::identity::{AccessConfig, ClientPolicy, NOBODY};
use sanfs_mds::store::Backend;
use sanfs_proto::pb;
use tonic::Code;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

use crate::harness::{Ca, Clients, ca, leaf, root, rw, start_with, write_server_tls};

const ROOT: u64 = 1;

/// A client of `srv` presenting a certificate for `name` signed by `issuer`.
async fn tls_clients(
    addr: std::net::SocketAddr,
    ca_pem: &str,
    issuer: &Ca,
    name: &str,
) -> Result<Clients, tonic::transport::Error> {
    let (cert, key) = leaf(issuer, &[name], true);
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(ca_pem))
        .domain_name("localhost")
        .identity(Identity::from_pem(cert, key));
    let ch = Channel::from_shared(format!("https://127.0.0.1:{}", addr.port()))
        .unwrap()
        .tls_config(tls)?
        .connect()
        .await?;
    Ok(Clients::new(ch))
}

/// A channel over one already connected unix stream.
async fn unix_channel(stream: std::os::unix::net::UnixStream) -> Channel {
    stream.set_nonblocking(true).unwrap();
    let slot = Arc::new(Mutex::new(Some(
        tokio::net::UnixStream::from_std(stream).unwrap(),
    )));
    Endpoint::from_static("http://[::1]:1")
        .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
            let s = slot.lock().unwrap().take();
            async move {
                s.map(hyper_util::rt::TokioIo::new)
                    .ok_or_else(|| std::io::Error::other("the one stream is used"))
            }
        }))
        .await
        .unwrap()
}

/// Connects to `path` from a thread whose effective uid is `uid`: SO_PEERCRED records the
/// connecting thread's credentials (Linux credentials are per thread; the raw syscall changes
/// only this thread's, and the saved uid 0 lets it change back).
fn connect_as(
    uid: u32,
    path: std::path::PathBuf,
) -> std::io::Result<std::os::unix::net::UnixStream> {
    std::thread::spawn(move || {
        let keep = libc::uid_t::MAX; // -1: leave unchanged
        // SAFETY: a raw setresuid on this thread only; no memory is involved.
        let r = unsafe { libc::syscall(libc::SYS_setresuid, keep, uid, keep) };
        assert_eq!(r, 0, "setresuid: {}", std::io::Error::last_os_error());
        let s = std::os::unix::net::UnixStream::connect(&path);
        // SAFETY: as above, back to root (the saved uid is still 0).
        let r = unsafe { libc::syscall(libc::SYS_setresuid, keep, 0, keep) };
        assert_eq!(r, 0, "setresuid back: {}", std::io::Error::last_os_error());
        s
    })
    .join()
    .unwrap()
}

async fn open_session(c: &mut Clients) -> Result<(u64, u64), tonic::Status> {
    let r = c
        .session
        .open_session(pb::OpenSessionRequest {
            protocol_version: 1,
            client_name: "hostile".into(),
            host: "h".into(),
            agent_version: "0".into(),
        })
        .await?
        .into_inner();
    Ok((r.session, r.epoch))
}

fn cred(uid: u32) -> Option<pb::Credentials> {
    Some(pb::Credentials {
        uid,
        gid: uid,
        groups: vec![],
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plaintext_tcp_is_refused_without_insecure() {
    let srv = start_with(Clock::System, |o, _| o.insecure = false).await;
    let mut c = srv.clients().await;
    let e = open_session(&mut c).await.unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated, "{e:?}");
    assert!(e.message().contains("plaintext"), "{e:?}");
    let e =
        c.ns.get_attr(pb::GetAttrRequest {
            cred: root(),
            inode: ROOT,
            session: None,
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated);
    let e = c
        .admin
        .server_status(pb::ServerStatusRequest {})
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated);
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_unix_socket_takes_root_and_listed_uids_only() {
    // Root: it connects as another uid.
    if sanfs_testcluster::skip_unless_root("the_unix_socket_takes_root_and_listed_uids_only") {
        return;
    }
    let sock_dir = tempfile::tempdir().unwrap();
    let sock = sock_dir.path().join("mds.sock");
    let path = sock.clone();
    let srv = start_with(Clock::System, move |o, _| {
        o.insecure = false;
        o.listen_unix = Some(path);
        o.access.unix_uids = vec![990];
    })
    .await;
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&sock).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600, "the socket is made 0600");

    // Root on the server's host: served, an admin.
    let mut c = Clients::new(unix_channel(connect_as(0, sock.clone()).unwrap()).await);
    open_session(&mut c).await.unwrap();
    let st = c
        .admin
        .server_status(pb::ServerStatusRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(st.sessions.len(), 1);
    assert_eq!(st.sessions[0].identity, "unix:uid=0");

    // uid 1000 cannot even connect to a 0600 socket; with the mode opened up, SO_PEERCRED
    // still names it, and it is refused.
    assert!(connect_as(1000, sock.clone()).is_err());
    std::fs::set_permissions(&sock, std::fs::Permissions::from_mode(0o666)).unwrap();
    let mut stranger = Clients::new(unix_channel(connect_as(1000, sock.clone()).unwrap()).await);
    let e = open_session(&mut stranger).await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    assert!(e.message().contains("uid 1000"), "{e:?}");
    let e = stranger
        .ns
        .get_attr(pb::GetAttrRequest {
            cred: root(),
            inode: ROOT,
            session: None,
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied);

    // A listed uid is served, but is no admin.
    let mut listed = Clients::new(unix_channel(connect_as(990, sock.clone()).unwrap()).await);
    open_session(&mut listed).await.unwrap();
    let e = listed
        .admin
        .server_status(pb::ServerStatusRequest {})
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied);
    let e = listed
        .admin
        .list_quotas(pb::ListQuotasRequest {})
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied);
    assert!(
        e.message().contains("ListQuotas needs an admin identity"),
        "{e:?}"
    );
    // Root lists them (none yet).
    let quotas = c
        .admin
        .list_quotas(pb::ListQuotasRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!((quotas.quotas.len(), quotas.quotas_total), (0, 0));
    srv.stop().await;
    assert!(!sock.exists(), "the socket is removed at stop");
}

/// A TLS server with three known nodes: `admin-node` (admin), `squashed-node` (root squashed),
/// and any other name (defaults), and a small session cap.
async fn tls_server(our_ca: &Ca, cap: usize) -> crate::harness::Running {
    let dir = tempfile::tempdir().unwrap();
    let paths = write_server_tls(dir.path(), our_ca);
    let r = crate::harness::start_with_luns_and(10_000, move |o| {
        o.insecure = false;
        o.tls = Some(paths);
        o.access = AccessConfig {
            clients: vec![
                (
                    "admin-node".to_owned(),
                    ClientPolicy {
                        admin: true,
                        ..ClientPolicy::NODE
                    },
                ),
                (
                    "squashed-node".to_owned(),
                    ClientPolicy {
                        root_squash: true,
                        ..ClientPolicy::NODE
                    },
                ),
            ],
            max_sessions_per_identity: cap,
            ..AccessConfig::default()
        };
    })
    .await;
    // The TLS files are read at start.
    drop(dir);
    r
}

async fn stop_and_fsck(srv: crate::harness::Running) {
    let dir = srv.stop_keeping_files().await;
    let report = sanfs_mds::fsck::check(&Backend::File(dir.path().join("mds.redb"))).unwrap();
    assert!(report.is_clean(), "fsck after the attacks:\n{report}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_of_another_ca_is_refused() {
    let our_ca = ca("sanfs test CA");
    let other = ca("some other CA");
    let srv = tls_server(&our_ca, 64).await;
    match tls_clients(srv.addr, &our_ca.pem, &other, "admin-node").await {
        Err(_) => {}
        Ok(mut c) => {
            // The handshake fails when the first call is made: a transport error, never an
            // answer from a service.
            let e = open_session(&mut c).await.unwrap_err();
            assert!(
                matches!(
                    e.code(),
                    Code::Unknown | Code::Unavailable | Code::Cancelled
                ),
                "{e:?}"
            );
        }
    }
    // The server is still up for a good node.
    let mut good = tls_clients(srv.addr, &our_ca.pem, &our_ca, "node-a")
        .await
        .unwrap();
    open_session(&mut good).await.unwrap();
    stop_and_fsck(srv).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_handles_and_grants_of_another_node_are_refused() {
    let our_ca = ca("sanfs test CA");
    let srv = tls_server(&our_ca, 64).await;
    let mut a = tls_clients(srv.addr, &our_ca.pem, &our_ca, "node-a")
        .await
        .unwrap();
    let mut b = tls_clients(srv.addr, &our_ca.pem, &our_ca, "node-b")
        .await
        .unwrap();
    let (sa, epoch) = open_session(&mut a).await.unwrap();
    let (sb, _) = open_session(&mut b).await.unwrap();
    assert_ne!(sa, sb);
    // Tokens, not a sequence: far apart (the chance of two random ids within 2^32 is 2^-31).
    assert!(sa.abs_diff(sb) > 1 << 32, "{sa} {sb}");

    // Node A writes a file through the proxied path and holds a write grant.
    let created =
        a.ns.create(create_releasing(sa, "secret", ""))
            .await
            .unwrap()
            .into_inner();
    let (ino, handle) = (created.attr.unwrap().ino, created.handle);
    a.data
        .write(pb::WriteRequest {
            cred: root(),
            session: sa,
            handle,
            inode: ino,
            offset: 0,
            data: b"node a's data".to_vec(),
            sync: true,
            append: false,
            request_id: None,
            then_set_attr: None,
        })
        .await
        .unwrap();
    let grant = a
        .data
        .map_write(pb::MapRequest {
            cred: root(),
            session: sa,
            epoch,
            handle,
            inode: ino,
            offset: 1 << 20,
            length: 1 << 20,
            sync: false,
            layout: false,
            ahead: false,
        })
        .await
        .unwrap()
        .into_inner();

    let denied = |r: Result<(), tonic::Status>, what: &str| {
        let e = r.expect_err(what);
        assert_eq!(e.code(), Code::PermissionDenied, "{what}: {e:?}");
        // A server's answer (EPERM), not a transport failure the agent would retry.
        assert_eq!(
            sanfs_proto::status::errno_of(&e),
            Some(libc::EPERM),
            "{what}"
        );
        assert!(e.message().contains("another identity"), "{what}: {e:?}");
    };
    // B names A's session, handle and grant: every call refused.
    denied(
        b.data
            .read(pb::ReadRequest {
                cred: root(),
                session: sa,
                handle,
                inode: ino,
                offset: 0,
                length: 4096,
            })
            .await
            .map(drop),
        "read through another node's handle",
    );
    denied(
        b.data
            .complete(pb::CompleteRequest {
                session: sa,
                epoch,
                grant_id: grant.grant_id,
                status: pb::IoStatus::Ok as i32,
                errors: vec![],
                bytes_done: 1 << 20,
                sync: false,
                keep: false,
                offset: 0,
                more: vec![],
            })
            .await
            .map(drop),
        "complete another node's grant",
    );
    denied(
        b.data
            .map_read(pb::MapRequest {
                cred: root(),
                session: sa,
                epoch,
                handle,
                inode: ino,
                offset: 0,
                length: 4096,
                sync: false,
                layout: false,
                ahead: false,
            })
            .await
            .map(drop),
        "map through another node's handle",
    );
    denied(
        b.ns.open(pb::OpenRequest {
            cred: root(),
            session: sa,
            inode: ino,
            flags: rw(),
            read_small: 0,
        })
        .await
        .map(drop),
        "open in another node's session",
    );
    denied(
        b.ns.release(pb::ReleaseRequest {
            session: sa,
            handle,
        })
        .await
        .map(drop),
        "release another node's handle",
    );
    let attach = pb::SessionStreamRequest {
        event: Some(pb::session_stream_request::Event::Attach(pb::Attach {
            session: sa,
            epoch,
        })),
    };
    let r = b
        .session
        .session_stream(tokio_stream::iter(vec![attach]))
        .await;
    match r {
        Err(e) => assert_eq!(e.code(), Code::PermissionDenied, "{e:?}"),
        Ok(stream) => {
            let e = stream.into_inner().message().await.unwrap_err();
            assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
        }
    }
    denied(
        b.session
            .close_session(pb::CloseSessionRequest { session: sa, epoch })
            .await
            .map(drop),
        "close another node's session",
    );

    // A's session, handle and grant are untouched: its grant completes, its data reads back.
    a.data
        .complete(pb::CompleteRequest {
            session: sa,
            epoch,
            grant_id: grant.grant_id,
            status: pb::IoStatus::Ok as i32,
            errors: vec![],
            bytes_done: 0,
            sync: false,
            keep: false,
            offset: 0,
            more: vec![],
        })
        .await
        .unwrap();
    let data = a
        .data
        .read(pb::ReadRequest {
            cred: root(),
            session: sa,
            handle,
            inode: ino,
            offset: 0,
            length: 13,
        })
        .await
        .unwrap()
        .into_inner()
        .data;
    assert_eq!(data, b"node a's data");
    a.ns.release(pb::ReleaseRequest {
        session: sa,
        handle,
    })
    .await
    .unwrap();
    a.session
        .close_session(pb::CloseSessionRequest { session: sa, epoch })
        .await
        .unwrap();
    stop_and_fsck(srv).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_calls_need_an_admin_and_sessions_are_capped() {
    let our_ca = ca("sanfs test CA");
    let srv = tls_server(&our_ca, 3).await;
    let mut plain = tls_clients(srv.addr, &our_ca.pem, &our_ca, "node-a")
        .await
        .unwrap();
    let mut admin = tls_clients(srv.addr, &our_ca.pem, &our_ca, "admin-node")
        .await
        .unwrap();
    let e = plain
        .admin
        .server_status(pb::ServerStatusRequest {})
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    let e = plain
        .admin
        .set_quota(pb::SetQuotaRequest {
            cred: root(),
            inode: ROOT,
            limits: Some(pb::QuotaLimits {
                capacity_bytes: Some(1),
                inodes: None,
            }),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");

    for _ in 0..3 {
        open_session(&mut plain).await.unwrap();
    }
    let e = open_session(&mut plain).await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    // The cap is per identity: another node still opens one.
    open_session(&mut admin).await.unwrap();

    let st = admin
        .admin
        .server_status(pb::ServerStatusRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(st.sessions_total, 4);
    let mut owners: Vec<&str> = st.sessions.iter().map(|s| s.identity.as_str()).collect();
    owners.sort_unstable();
    assert_eq!(owners, ["admin-node", "node-a", "node-a", "node-a"]);
    stop_and_fsck(srv).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_status_stays_bounded_with_many_sessions() {
    let srv = start_with(Clock::System, |o, _| {
        o.access.max_sessions_per_identity = 1500;
    })
    .await;
    let mut c = srv.clients().await;
    for _ in 0..1200 {
        open_session(&mut c).await.unwrap();
    }
    let st = c
        .admin
        .server_status(pb::ServerStatusRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(st.sessions_total, 1200);
    assert_eq!(
        st.sessions.len(),
        sanfs_proto::model::MAX_STATUS_SESSIONS,
        "the list is bounded"
    );
    let ids: Vec<u64> = st.sessions.iter().map(|s| s.session).collect();
    assert!(
        ids.windows(2).all(|w| w[0] < w[1]),
        "the lowest ids, in order"
    );
    srv.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn root_squash_makes_root_nobody() {
    let our_ca = ca("sanfs test CA");
    let srv = tls_server(&our_ca, 64).await;
    let mut admin = tls_clients(srv.addr, &our_ca.pem, &our_ca, "admin-node")
        .await
        .unwrap();
    let mut squashed = tls_clients(srv.addr, &our_ca.pem, &our_ca, "squashed-node")
        .await
        .unwrap();
    let (sa, _) = open_session(&mut admin).await.unwrap();
    let (ss, _) = open_session(&mut squashed).await.unwrap();
    let created = admin
        .ns
        .create(pb::CreateRequest {
            delegate: false,
            inode: 0,
            time: None,
            request_id: None,
            cred: root(),
            session: sa,
            parent: ROOT,
            name: b"root-only".to_vec(),
            perm: 0o600,
            exclusive: true,
            flags: rw(),
        })
        .await
        .unwrap()
        .into_inner();
    let ino = created.attr.unwrap().ino;
    admin
        .ns
        .release(pb::ReleaseRequest {
            session: sa,
            handle: created.handle,
        })
        .await
        .unwrap();

    // The squashed node's root cannot open a root 0600 file...
    let e = squashed
        .ns
        .open(pb::OpenRequest {
            cred: root(),
            session: ss,
            inode: ino,
            flags: Some(pb::OpenFlags {
                read: true,
                write: false,
                append: false,
                truncate: false,
            }),
            read_small: 0,
        })
        .await
        .unwrap_err();
    assert_eq!(
        sanfs_proto::status::errno_of(&e),
        Some(libc::EACCES),
        "{e:?}"
    );
    // ... nor chmod the root directory ...
    let e = squashed
        .ns
        .set_attr(pb::SetAttrRequest {
            cred: root(),
            inode: ROOT,
            changes: Some(pb::SetAttrChanges {
                perm: Some(0o777),
                ..Default::default()
            }),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert!(
        matches!(
            sanfs_proto::status::errno_of(&e),
            Some(libc::EPERM | libc::EACCES)
        ),
        "{e:?}"
    );
    // ... and what it creates (in a world-writable directory) belongs to nobody.
    let dir = admin
        .ns
        .mkdir(pb::MkdirRequest {
            request_id: None,
            cred: root(),
            parent: ROOT,
            name: b"public".to_vec(),
            perm: 0o777,
            delegate: false,
        })
        .await
        .unwrap()
        .into_inner()
        .attr
        .unwrap();
    admin
        .ns
        .set_attr(pb::SetAttrRequest {
            cred: root(),
            inode: dir.ino,
            changes: Some(pb::SetAttrChanges {
                perm: Some(0o1777),
                ..Default::default()
            }),
            ..Default::default()
        })
        .await
        .unwrap();
    let made = squashed
        .ns
        .create(pb::CreateRequest {
            delegate: false,
            inode: 0,
            time: None,
            request_id: None,
            cred: root(),
            session: ss,
            parent: dir.ino,
            name: b"mine".to_vec(),
            perm: 0o644,
            exclusive: true,
            flags: rw(),
        })
        .await
        .unwrap()
        .into_inner();
    let attr = made.attr.unwrap();
    assert_eq!((attr.uid, attr.gid), (NOBODY, NOBODY));
    // An unsquashed node's users are believed as they are (AUTH_SYS from a trusted node).
    let e = admin
        .ns
        .open(pb::OpenRequest {
            cred: cred(1000),
            session: sa,
            inode: ino,
            flags: rw(),
            read_small: 0,
        })
        .await
        .unwrap_err();
    assert_eq!(sanfs_proto::status::errno_of(&e), Some(libc::EACCES));
    squashed
        .ns
        .release(pb::ReleaseRequest {
            session: ss,
            handle: made.handle,
        })
        .await
        .unwrap();
    stop_and_fsck(srv).await;
}

/// A create of `name` in the root under `session`, with `release` as its `sanfs-release`
/// header (none when empty).
fn create_releasing(session: u64, name: &str, release: &str) -> tonic::Request<pb::CreateRequest> {
    let mut req = tonic::Request::new(pb::CreateRequest {
        delegate: false,
        inode: 0,
        time: None,
        request_id: None,
        cred: root(),
        session,
        parent: ROOT,
        name: name.as_bytes().to_vec(),
        perm: 0o600,
        exclusive: true,
        flags: rw(),
    });
    if !release.is_empty() {
        req.metadata_mut()
            .insert(sanfs_proto::headers::RELEASE, release.parse().unwrap());
    }
    req
}

/// A `Release` of `handle` under `session`, with `release` as its `sanfs-release` header.
fn release_with(session: u64, handle: u64, release: &str) -> tonic::Request<pb::ReleaseRequest> {
    let mut req = tonic::Request::new(pb::ReleaseRequest { session, handle });
    if !release.is_empty() {
        req.metadata_mut()
            .insert(sanfs_proto::headers::RELEASE, release.parse().unwrap());
    }
    req
}

/// Handles released with another call (`sanfs-release`, docs/protocol.md "Handles released
/// with a later call"): only the caller's own session's, and a bad header changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handles_released_with_a_call_are_only_the_callers_own() {
    let our_ca = ca("sanfs test CA");
    let srv = tls_server(&our_ca, 64).await;
    let mut a = tls_clients(srv.addr, &our_ca.pem, &our_ca, "node-a")
        .await
        .unwrap();
    let mut b = tls_clients(srv.addr, &our_ca.pem, &our_ca, "node-b")
        .await
        .unwrap();
    let (sa, _) = open_session(&mut a).await.unwrap();
    let (sb, _) = open_session(&mut b).await.unwrap();
    let mut handles = Vec::new();
    for name in ["f1", "f2", "f3", "f4"] {
        let r = a.ns.create(create_releasing(sa, name, "")).await.unwrap();
        handles.push(r.into_inner().handle);
    }
    let (h1, h2, h3, h4) = (handles[0], handles[1], handles[2], handles[3]);
    let still_open = |c: &mut Clients, h: u64| {
        let mut ns = c.ns.clone();
        async move {
            ns.release(release_with(sa, h, ""))
                .await
                .map(|_| ())
                .map_err(|e| e.code())
        }
    };

    // Node B names node A's session: refused, and neither the create nor the release happens.
    let e =
        b.ns.create(create_releasing(sb, "b1", &format!("{sa}:{h1}")))
            .await
            .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    // Node B names its own session with node A's handle: not open under it, skipped.
    b.ns.create(create_releasing(sb, "b2", &format!("{sb}:{h1}")))
        .await
        .unwrap();
    // Malformed headers: refused, nothing changes.
    for bad in [
        format!("{sa}"),
        format!("{sa}:x"),
        format!("0:{h1}"),
        format!("{sa}:{h1},,"),
    ] {
        let e =
            a.ns.create(create_releasing(sa, "a-bad", &bad))
                .await
                .unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{bad:?}: {e:?}");
    }
    let lookup = |c: &mut Clients, name: &str| {
        let mut ns = c.ns.clone();
        let name = name.as_bytes().to_vec();
        async move {
            ns.lookup(pb::LookupRequest {
                cred: root(),
                parent: ROOT,
                name,
                session: None,
            })
            .await
            .map(|_| ())
            .map_err(|e| e.code())
        }
    };
    assert_eq!(lookup(&mut a, "b1").await, Err(Code::NotFound));
    assert_eq!(lookup(&mut a, "a-bad").await, Err(Code::NotFound));
    assert_eq!(lookup(&mut a, "b2").await, Ok(()));
    // So h1 is still open: its own Release is answered (a released handle is stale).
    assert_eq!(still_open(&mut a, h1).await, Ok(()));

    // Node A's create releases h2 with itself; a Release carries h4 (and an unknown handle).
    a.ns.create(create_releasing(sa, "f5", &format!("{sa}:{h2}")))
        .await
        .unwrap();
    a.ns.release(release_with(sa, h3, &format!("{sa}:{h4},987654321")))
        .await
        .unwrap();
    for h in [h1, h2, h3, h4] {
        assert_eq!(
            still_open(&mut a, h).await,
            Err(Code::NotFound),
            "handle {h} was not released"
        );
    }
    stop_and_fsck(srv).await;
}

/// A session stream opened and left silent (no attach ever sent, the stream kept open) is
/// refused once a lease has passed, instead of holding its task and h2 stream for ever
/// (found by fuzz_calls: the call never returned).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_stream_that_never_attaches_is_refused_after_a_lease() {
    let srv = crate::harness::start_with_luns(1000).await;
    let mut c = srv.clients().await;
    let (tx, rx) = tokio::sync::mpsc::channel::<pb::SessionStreamRequest>(1);
    let started = std::time::Instant::now();
    let r = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        c.session
            .session_stream(tokio_stream::wrappers::ReceiverStream::new(rx)),
    )
    .await
    .expect("a silent stream is answered within a lease, not left open");
    let e = r.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert!(e.message().contains("no attach"), "{e:?}");
    assert!(started.elapsed() >= std::time::Duration::from_millis(900));
    drop(tx);
    // The server still serves.
    c.open_session().await;
    stop_and_fsck(srv).await;
}

/// An attribute change its caller may not make is refused at once: it recalls no other
/// session's lease and settles nobody's writes first (fuzz_calls found refused chmods
/// waiting a lease's term for a recall nobody answered).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_attribute_change_waits_for_nobodys_lease() {
    let srv = crate::harness::start_with_luns(10_000).await;
    let mut c = srv.clients().await;
    let (sa, epoch) = c.open_session().await;
    let (ino, _) = c.create_file(sa, "f").await;
    // Session A attaches its stream (leases go only to sessions that can be recalled) and
    // then answers no recall: a recall would wait for the lease's term, 10 s.
    let (tx, rx) = tokio::sync::mpsc::channel::<pb::SessionStreamRequest>(4);
    tx.send(pb::SessionStreamRequest {
        event: Some(pb::session_stream_request::Event::Attach(pb::Attach {
            session: sa,
            epoch,
        })),
    })
    .await
    .unwrap();
    let _stream = c
        .session
        .session_stream(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap();
    let mut leased = 0;
    for _ in 0..100 {
        leased =
            c.ns.get_attr(pb::GetAttrRequest {
                cred: root(),
                inode: ino,
                session: Some(sa),
            })
            .await
            .unwrap()
            .into_inner()
            .lease_ms;
        if leased > 0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert!(leased > 0, "no lease was given: nothing to recall");
    let user = Some(pb::Credentials {
        uid: 1000,
        gid: 1000,
        groups: vec![],
    });
    for changes in [
        pb::SetAttrChanges {
            perm: Some(0o777),
            ..Default::default()
        },
        pb::SetAttrChanges {
            size: Some(0),
            ..Default::default()
        },
    ] {
        let started = std::time::Instant::now();
        let e =
            c.ns.set_attr(pb::SetAttrRequest {
                cred: user.clone(),
                inode: ino,
                changes: Some(changes),
                handle: None,
                session: None,
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::PermissionDenied, "{changes:?}: {e:?}");
        assert!(
            started.elapsed() < std::time::Duration::from_secs(5),
            "a refused change waited {:?} for a recall ({changes:?})",
            started.elapsed()
        );
    }
    drop(tx);
    stop_and_fsck(srv).await;
}
