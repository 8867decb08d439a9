//! Who is calling: the caller's node identity, taken from the transport once per request,
//! and what that identity may do (docs/security.md).
//!
//! A caller proves who it is by its connection, never by a request field:
//! - mutual TLS: the client certificate (checked against the configured CA by the TLS layer)
//!   names the node, by its subject CN or else its first DNS subject alternative name;
//! - the local unix socket: the peer's uid read with SO_PEERCRED; uid 0 and the uids listed in
//!   `server.unix_uids` are accepted, every other local user is refused;
//! - plaintext TCP: only with `server.insecure = true` (every such caller is the one identity
//!   `insecure`, trusted with everything: the operator said so); refused otherwise.
//!
//! [`Authenticator`] runs as a tonic interceptor in front of every service: it refuses
//! callers it cannot name (`UNAUTHENTICATED`, or `PERMISSION_DENIED` for a refused local
//! uid) and puts the [`Caller`] into the request's extensions, where handlers find it with
//! [`caller`]. What an identity may do ([`ClientPolicy`]: admin calls, root squashing, a
//! subtree) comes from `[[clients]]` entries of `mds.toml`, keyed by the identity's name, or
//! from `[client_defaults]`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use sanfs_proto::types::Credentials;
use tonic::transport::server::{TcpConnectInfo, UdsConnectInfo};
use tonic::{Request, Status};

/// The uid and gid a squashed root becomes unless configured (Debian's `nobody`/`nogroup`).
pub const NOBODY: u32 = 65534;

/// Default cap on live sessions per identity.
pub const DEFAULT_MAX_SESSIONS_PER_IDENTITY: usize = 64;

/// What one identity may do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientPolicy {
    /// May make admin calls (`ServerStatus`, `SetQuota`).
    pub admin: bool,
    /// uid 0 in requests becomes `squash_uid`/`squash_gid` (and root's groups are dropped).
    pub root_squash: bool,
    pub squash_uid: u32,
    pub squash_gid: u32,
}

impl ClientPolicy {
    /// An authenticated node with no entry of its own: its users' credentials are trusted
    /// (AUTH_SYS), no admin calls.
    pub const NODE: ClientPolicy = ClientPolicy {
        admin: false,
        root_squash: false,
        squash_uid: NOBODY,
        squash_gid: NOBODY,
    };

    /// Everything allowed: root on the server's own host, or an insecure server.
    pub const TRUSTED: ClientPolicy = ClientPolicy {
        admin: true,
        root_squash: false,
        squash_uid: NOBODY,
        squash_gid: NOBODY,
    };

    /// Applies root squashing to one request's credentials.
    pub fn squash(&self, cred: &mut Credentials) {
        if !self.root_squash {
            return;
        }
        if cred.uid == 0 {
            cred.uid = self.squash_uid;
            cred.gid = self.squash_gid;
            cred.groups.clear();
        } else if cred.gid == 0 {
            cred.gid = self.squash_gid;
        }
        for g in &mut cred.groups {
            if *g == 0 {
                *g = self.squash_gid;
            }
        }
    }
}

/// How the caller reached the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// Mutual TLS with a client certificate.
    Tls,
    /// The local unix socket; the peer's uid from SO_PEERCRED.
    Unix { uid: u32 },
    /// Plaintext TCP on an insecure server.
    Insecure,
}

/// An authenticated caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeIdentity {
    /// The certificate's name, `unix:uid=N`, or `insecure`.
    pub name: String,
    pub transport: Transport,
    pub policy: ClientPolicy,
}

/// The caller of one request, as the handlers see it.
pub type Caller = Arc<NodeIdentity>;

impl NodeIdentity {
    /// Fails with `PERMISSION_DENIED` unless the identity may make admin calls.
    pub fn require_admin(&self, what: &str) -> Result<(), Status> {
        if self.policy.admin {
            Ok(())
        } else {
            Err(refused(format!(
                "{what} needs an admin identity; {:?} is not one (see admin in [[clients]] of mds.toml)",
                self.name
            )))
        }
    }
}

/// `PERMISSION_DENIED` as a file-system error (EPERM, kind `perm`: the agent sees the
/// server's answer, not a transport failure) with `message` saying why.
pub fn refused(message: String) -> Status {
    let perm = sanfs_proto::status::status_from_fs_error(&sanfs_proto::types::FsError::Perm);
    Status::with_metadata(perm.code(), message, perm.metadata().clone())
}

/// Who may connect and what each identity may do: the server's half of docs/security.md.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AccessConfig {
    /// Local uids accepted on the unix socket besides 0.
    pub unix_uids: Vec<u32>,
    /// Per identity name.
    pub clients: Vec<(String, ClientPolicy)>,
    /// For certificate identities with no entry in `clients`.
    pub client_defaults: ClientPolicy,
    /// Live sessions one identity may hold at once.
    pub max_sessions_per_identity: usize,
}

impl Default for AccessConfig {
    fn default() -> AccessConfig {
        AccessConfig {
            unix_uids: Vec::new(),
            clients: Vec::new(),
            client_defaults: ClientPolicy::NODE,
            max_sessions_per_identity: DEFAULT_MAX_SESSIONS_PER_IDENTITY,
        }
    }
}

impl AccessConfig {
    fn policy_for(&self, name: &str, fallback: &ClientPolicy) -> ClientPolicy {
        self.clients
            .iter()
            .find(|(n, _)| n == name)
            .map_or_else(|| fallback.clone(), |(_, p)| p.clone())
    }

    /// The identity of a unix socket peer with this uid, or why it is refused.
    pub fn unix_identity(&self, uid: Option<u32>) -> Result<NodeIdentity, Status> {
        let Some(uid) = uid else {
            return Err(Status::unauthenticated(
                "the unix socket peer's credentials (SO_PEERCRED) could not be read",
            ));
        };
        if uid != 0 && !self.unix_uids.contains(&uid) {
            return Err(Status::permission_denied(format!(
                "local uid {uid} may not use the server's unix socket (only uid 0 and \
                 server.unix_uids)"
            )));
        }
        let name = format!("unix:uid={uid}");
        let fallback = if uid == 0 {
            ClientPolicy::TRUSTED
        } else {
            self.client_defaults.clone()
        };
        let policy = self.policy_for(&name, &fallback);
        Ok(NodeIdentity {
            name,
            transport: Transport::Unix { uid },
            policy,
        })
    }

    /// The identity a client certificate (DER) names, or why it is refused.
    pub fn tls_identity(&self, cert_der: &[u8]) -> Result<NodeIdentity, Status> {
        let name = certificate_name(cert_der).ok_or_else(|| {
            Status::unauthenticated(
                "the client certificate names no node (no subject CN and no DNS name)",
            )
        })?;
        let policy = self.policy_for(&name, &self.client_defaults);
        Ok(NodeIdentity {
            name,
            transport: Transport::Tls,
            policy,
        })
    }
}

/// The node a certificate names: its subject CN, else its first DNS subject alternative name.
pub fn certificate_name(der: &[u8]) -> Option<String> {
    use x509_parser::prelude::{FromDer, GeneralName, X509Certificate};
    let (_, cert) = X509Certificate::from_der(der).ok()?;
    if let Some(cn) = cert
        .subject()
        .iter_common_name()
        .next()
        .and_then(|cn| cn.as_str().ok())
        .filter(|cn| !cn.is_empty())
    {
        return Some(cn.to_owned());
    }
    let san = cert.subject_alternative_name().ok().flatten()?;
    san.value.general_names.iter().find_map(|n| match n {
        GeneralName::DNSName(d) if !d.is_empty() => Some((*d).to_owned()),
        _ => None,
    })
}

/// Names the caller of every request from its connection (the tonic interceptor in front of
/// every service).
#[derive(Debug, Clone)]
pub struct Authenticator {
    access: Arc<AccessConfig>,
    /// Whether this listener is TLS (then a request without a client certificate is refused).
    tls: bool,
    /// Plaintext TCP accepted (and trusted with everything).
    insecure: bool,
    /// The first insecure call is logged at WARN (and all of them counted).
    warned: Arc<AtomicBool>,
}

impl Authenticator {
    pub fn new(access: Arc<AccessConfig>, tls: bool, insecure: bool) -> Authenticator {
        Authenticator {
            access,
            tls,
            insecure,
            warned: Arc::new(AtomicBool::new(false)),
        }
    }

    /// The one function that names a caller.
    pub fn identify<T>(&self, req: &Request<T>) -> Result<NodeIdentity, Status> {
        if let Some(uds) = req.extensions().get::<UdsConnectInfo>() {
            return self
                .access
                .unix_identity(uds.peer_cred.as_ref().map(|c| c.uid()));
        }
        if self.tls {
            let certs = req.peer_certs().ok_or_else(|| {
                Status::unauthenticated("no client certificate: this server requires mutual TLS")
            })?;
            let leaf = certs.first().ok_or_else(|| {
                Status::unauthenticated("no client certificate: this server requires mutual TLS")
            })?;
            return self.access.tls_identity(leaf.as_ref());
        }
        if self.insecure {
            metrics::counter!("sanfs_insecure_requests_total").increment(1);
            if !self.warned.swap(true, Ordering::Relaxed) {
                let peer = req
                    .extensions()
                    .get::<TcpConnectInfo>()
                    .and_then(TcpConnectInfo::remote_addr);
                tracing::warn!(
                    peer = ?peer,
                    "INSECURE: accepted an unauthenticated plaintext call; every caller may claim \
                     any user, root included (further ones are only counted: \
                     sanfs_insecure_requests_total)"
                );
            }
            return Ok(NodeIdentity {
                name: "insecure".to_owned(),
                transport: Transport::Insecure,
                policy: ClientPolicy::TRUSTED,
            });
        }
        Err(Status::unauthenticated(
            "plaintext TCP is refused: connect with a client certificate (mutual TLS), over the \
             server's unix socket, or set server.insecure = true",
        ))
    }
}

impl tonic::service::Interceptor for Authenticator {
    fn call(&mut self, mut req: Request<()>) -> Result<Request<()>, Status> {
        match self.identify(&req) {
            Ok(id) => {
                req.extensions_mut().insert::<Caller>(Arc::new(id));
                Ok(req)
            }
            Err(status) => {
                metrics::counter!("sanfs_auth_refused_total", "code" => format!("{:?}", status.code()))
                    .increment(1);
                tracing::info!(error = %status.message(), "refused a caller");
                Err(status)
            }
        }
    }
}

/// A domain request that carries user credentials.
pub trait WithCred {
    fn cred_mut(&mut self) -> &mut Credentials;
}

impl WithCred for sanfs_proto::model::LeasedLookup {
    fn cred_mut(&mut self) -> &mut Credentials {
        &mut self.entry.cred
    }
}

impl WithCred for sanfs_proto::model::LeasedReadDir {
    fn cred_mut(&mut self) -> &mut Credentials {
        &mut self.request.cred
    }
}

macro_rules! with_cred {
    ($($t:ident),* $(,)?) => {
        $(impl WithCred for sanfs_proto::model::$t {
            fn cred_mut(&mut self) -> &mut Credentials {
                &mut self.cred
            }
        })*
    };
}

with_cred!(
    EntryRequest,
    InodeRequest,
    GetAttrRequest,
    SetAttrRequest,
    CreateRequest,
    MkdirRequest,
    MknodRequest,
    RenameRequest,
    LinkRequest,
    SymlinkRequest,
    ReadDirRequest,
    XattrRequest,
    SetXattrRequest,
    OpenRequest,
    AccessRequest,
    MapRequest,
    ReadRequest,
    WriteRequest,
    FsyncRequest,
    FallocateRequest,
    GetExtentsRequest,
    LockRequest,
    SetQuotaRequest,
);

/// The caller the interceptor named (`UNAUTHENTICATED` if none: a service served without it).
pub fn caller<T>(req: &Request<T>) -> Result<Caller, Status> {
    req.extensions()
        .get::<Caller>()
        .cloned()
        .ok_or_else(|| Status::unauthenticated("the caller was not authenticated"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unix_peers_other_than_root_and_listed_uids_are_refused() {
        let access = AccessConfig {
            unix_uids: vec![990],
            ..AccessConfig::default()
        };
        let root = access.unix_identity(Some(0)).unwrap();
        assert_eq!(root.name, "unix:uid=0");
        assert!(root.policy.admin);
        let listed = access.unix_identity(Some(990)).unwrap();
        assert!(!listed.policy.admin);
        let refused = access.unix_identity(Some(1000)).unwrap_err();
        assert_eq!(refused.code(), tonic::Code::PermissionDenied);
        assert!(refused.message().contains("uid 1000"), "{refused:?}");
        let unknown = access.unix_identity(None).unwrap_err();
        assert_eq!(unknown.code(), tonic::Code::Unauthenticated);
    }

    #[test]
    fn plaintext_is_refused_unless_insecure() {
        let req = Request::new(());
        let strict = Authenticator::new(Arc::new(AccessConfig::default()), false, false);
        let e = strict.identify(&req).unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated);
        assert!(e.message().contains("plaintext"), "{e:?}");
        let loose = Authenticator::new(Arc::new(AccessConfig::default()), false, true);
        assert_eq!(loose.identify(&req).unwrap().transport, Transport::Insecure);
        let tls = Authenticator::new(Arc::new(AccessConfig::default()), true, true);
        assert_eq!(
            tls.identify(&req).unwrap_err().code(),
            tonic::Code::Unauthenticated
        );
    }

    #[test]
    fn certificates_name_nodes_by_cn_then_dns_name() {
        let mut params = rcgen::CertificateParams::new(vec!["node-b.example".to_owned()]).unwrap();
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "node-a");
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = params.self_signed(&key).unwrap();
        assert_eq!(certificate_name(cert.der()).as_deref(), Some("node-a"));
        let mut params = rcgen::CertificateParams::new(vec!["node-b.example".to_owned()]).unwrap();
        params.distinguished_name = rcgen::DistinguishedName::new();
        let cert = params.self_signed(&key).unwrap();
        assert_eq!(
            certificate_name(cert.der()).as_deref(),
            Some("node-b.example")
        );
        assert_eq!(certificate_name(b"not a certificate"), None);
        let access = AccessConfig {
            clients: vec![(
                "node-b.example".to_owned(),
                ClientPolicy {
                    root_squash: true,
                    ..ClientPolicy::NODE
                },
            )],
            ..AccessConfig::default()
        };
        let id = access.tls_identity(cert.der()).unwrap();
        assert!(id.policy.root_squash && !id.policy.admin);
    }

    #[test]
    fn root_squash_turns_root_into_nobody() {
        let policy = ClientPolicy {
            root_squash: true,
            ..ClientPolicy::NODE
        };
        let mut root = Credentials::root();
        root.groups = vec![0, 5];
        policy.squash(&mut root);
        assert_eq!((root.uid, root.gid, root.groups), (NOBODY, NOBODY, vec![]));
        let mut user = Credentials {
            uid: 1000,
            gid: 0,
            groups: vec![0, 100],
        };
        policy.squash(&mut user);
        assert_eq!(
            (user.uid, user.gid, user.groups),
            (1000, NOBODY, vec![NOBODY, 100])
        );
        let mut kept = Credentials::root();
        ClientPolicy::NODE.squash(&mut kept);
        assert_eq!(kept, Credentials::root());
    }
}
