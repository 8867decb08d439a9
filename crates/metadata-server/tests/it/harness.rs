//! A server started in-process with `serve`, clients for it, and test certificates.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use sanfs_mds::clock::Clock;
use sanfs_mds::serve::{ServeOptions, TlsPaths};
use sanfs_mds::store::Backend;
use sanfs_proto::model::MAX_MESSAGE_SIZE;
use sanfs_proto::pb;
use sanfs_proto::pb::admin_client::AdminClient;
use sanfs_proto::pb::data_client::DataClient;
use sanfs_proto::pb::namespace_client::NamespaceClient;
use sanfs_proto::pb::session_client::SessionClient;
use sanfs_testcluster::mds;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tonic::transport::Channel;

use crate::support::fs_info;

/// A running server.
pub struct Running {
    pub addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    pub task: JoinHandle<anyhow::Result<()>>,
    /// Holds the store file.
    _dir: tempfile::TempDir,
}

/// Options for a plaintext server on 127.0.0.1:0 over a fresh file store in `dir`.
pub fn options(dir: &Path, clock: &Clock) -> ServeOptions {
    let backend = Backend::File(dir.join("mds.redb"));
    mds::create_store(&backend, &fs_info(), clock).unwrap();
    mds::serve_options("127.0.0.1:0".parse().unwrap(), backend, Vec::new())
}

/// Starts `serve` on four 32 MiB file-backed LUNs formatted by `format` (64 KiB stripes),
/// so that grants and the proxied path have real devices, with the lease TTL given.
pub async fn start_with_luns(lease_ttl_ms: u64) -> Running {
    start_with_luns_and(lease_ttl_ms, |_| {}).await
}

/// [`start_with_luns`] with the options then changed by `tweak`.
pub async fn start_with_luns_and(
    lease_ttl_ms: u64,
    tweak: impl FnOnce(&mut ServeOptions) + Send + 'static,
) -> Running {
    const MIB: u64 = 1 << 20;
    start_with(Clock::System, move |o, dir| {
        let luns = mds::file_luns(dir, 4, 32 * MIB).unwrap();
        mds::format(
            &mds::striped(&luns, 4096, 64 * 1024),
            &o.backend,
            &Clock::System,
        )
        .unwrap();
        o.data_devices = luns;
        o.lease_ttl_ms = lease_ttl_ms;
        tweak(o);
    })
    .await
}

/// Starts `serve` with the default options changed by `tweak`.
pub async fn start_with(clock: Clock, tweak: impl FnOnce(&mut ServeOptions, &Path)) -> Running {
    let dir = tempfile::tempdir().unwrap();
    let mut opts = options(dir.path(), &clock);
    tweak(&mut opts, dir.path());
    let mut serving = mds::spawn_serve(&tokio::runtime::Handle::current(), opts, clock);
    let addr = serving.listening().await.unwrap();
    let (stop, task) = serving.into_parts();
    Running {
        addr,
        stop,
        task,
        _dir: dir,
    }
}

pub async fn start() -> Running {
    start_with(Clock::System, |_, _| {}).await
}

impl Running {
    pub async fn channel(&self) -> Channel {
        Channel::from_shared(format!("http://{}", self.addr))
            .unwrap()
            .connect()
            .await
            .unwrap()
    }

    pub async fn clients(&self) -> Clients {
        Clients::new(self.channel().await)
    }

    /// The directory of the store and (with [`start_with_luns`]) the LUNs `lun0`..`lun3`.
    pub fn dir(&self) -> &Path {
        self._dir.path()
    }

    /// Stops the server and checks that it stopped cleanly.
    pub async fn stop(self) {
        self.stop_keeping_files().await;
    }

    /// [`Running::stop`], handing back the directory with the store (`mds.redb`) and LUNs.
    pub async fn stop_keeping_files(mut self) -> tempfile::TempDir {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        let r = tokio::time::timeout(std::time::Duration::from_secs(20), self.task)
            .await
            .expect("serve stops within the grace");
        r.unwrap().unwrap();
        std::mem::replace(&mut self._dir, tempfile::tempdir().unwrap())
    }
}

/// One client per service on one channel.
pub struct Clients {
    pub session: SessionClient<Channel>,
    pub ns: NamespaceClient<Channel>,
    pub data: DataClient<Channel>,
    pub admin: AdminClient<Channel>,
}

impl Clients {
    pub fn new(ch: Channel) -> Clients {
        Clients {
            session: SessionClient::new(ch.clone()),
            ns: NamespaceClient::new(ch.clone()),
            data: DataClient::new(ch.clone())
                .max_decoding_message_size(MAX_MESSAGE_SIZE)
                .max_encoding_message_size(MAX_MESSAGE_SIZE),
            admin: AdminClient::new(ch),
        }
    }

    /// Opens a session; returns (session, epoch).
    /// Creates (or opens) `name` in the root, read-write, under `session`: its inode and
    /// open handle.
    pub async fn create_file(&mut self, session: u64, name: &str) -> (u64, u64) {
        let r = self
            .ns
            .create(pb::CreateRequest {
                delegate: false,
                inode: 0,
                time: None,
                cred: root(),
                session,
                parent: 1,
                name: name.into(),
                perm: 0o644,
                exclusive: false,
                flags: rw(),
                request_id: None,
            })
            .await
            .expect("create")
            .into_inner();
        (r.attr.expect("attr").ino, r.handle)
    }

    pub async fn open_session(&mut self) -> (u64, u64) {
        let r = self
            .session
            .open_session(pb::OpenSessionRequest {
                protocol_version: 1,
                client_name: "test".into(),
                host: "localhost".into(),
                agent_version: "0".into(),
            })
            .await
            .unwrap()
            .into_inner();
        (r.session, r.epoch)
    }

    /// What an agent does first under a new server epoch (docs/protocol.md, "Reclaim
    /// window"): says that `previous`'s reclaim is complete (nothing to replay), so that the
    /// window does not wait for it (a session that held an orphan open, or completed lazily,
    /// is recorded and waited for).
    pub async fn reclaim_complete(&mut self, session: u64, epoch: u64, previous: u64) {
        self.data
            .replay_writes(pb::ReplayWritesRequest {
                session,
                epoch,
                previous_session: previous,
                records: vec![],
                reclaim_complete: true,
            })
            .await
            .unwrap();
    }
}

pub fn root() -> Option<pb::Credentials> {
    Some(pb::Credentials {
        uid: 0,
        gid: 0,
        groups: vec![],
    })
}

pub fn rw() -> Option<pb::OpenFlags> {
    Some(pb::OpenFlags {
        read: true,
        write: true,
        append: false,
        truncate: false,
    })
}

/// A CA: its issuer and its certificate in PEM.
pub struct Ca {
    pub issuer: Issuer<'static, KeyPair>,
    pub pem: String,
}

pub fn ca(name: &str) -> Ca {
    let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    p.distinguished_name.push(DnType::CommonName, name);
    p.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let key = KeyPair::generate().unwrap();
    let cert = p.self_signed(&key).unwrap();
    Ca {
        issuer: Issuer::new(p, key),
        pem: cert.pem(),
    }
}

/// A leaf certificate signed by `ca`: (certificate PEM, key PEM).
pub fn leaf(ca: &Ca, names: &[&str], client: bool) -> (String, String) {
    let mut p =
        CertificateParams::new(names.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>()).unwrap();
    p.distinguished_name.push(
        DnType::CommonName,
        names.first().copied().unwrap_or("agent"),
    );
    p.extended_key_usages = vec![if client {
        ExtendedKeyUsagePurpose::ClientAuth
    } else {
        ExtendedKeyUsagePurpose::ServerAuth
    }];
    let key = KeyPair::generate().unwrap();
    let cert = p.signed_by(&key, &ca.issuer).unwrap();
    (cert.pem(), key.serialize_pem())
}

/// Writes the server's TLS files into `dir`.
pub fn write_server_tls(dir: &Path, ca: &Ca) -> TlsPaths {
    let (cert, key) = leaf(ca, &["localhost", "127.0.0.1"], false);
    let write = |name: &str, text: &str| -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p
    };
    TlsPaths {
        cert: write("server.pem", &cert),
        key: write("server.key", &key),
        ca: write("ca.pem", &ca.pem),
    }
}
