//! The few etcd v3 calls leader election needs (`sanfs_proto::etcd`, generated from the
//! subset of etcd's API in `crates/proto/proto/etcd/`), over one gRPC channel that moves to
//! the next endpoint of the list when its member stops answering.

use std::sync::Mutex;
use std::time::Duration;

use sanfs_proto::etcd::etcdserverpb::kv_client::KvClient;
use sanfs_proto::etcd::etcdserverpb::lease_client::LeaseClient;
use sanfs_proto::etcd::etcdserverpb::{
    LeaseGrantRequest, LeaseKeepAliveRequest, LeaseRevokeRequest, RangeRequest,
};
use sanfs_proto::etcd::mvccpb::KeyValue;
use sanfs_proto::etcd::v3electionpb::election_client::ElectionClient;
use sanfs_proto::etcd::v3electionpb::{CampaignRequest, LeaderKey, LeaderRequest, ResignRequest};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

/// How long one connection attempt to an etcd member may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);

/// An etcd call's failure, with the endpoint it was sent to.
#[derive(Debug, thiserror::Error)]
pub enum EtcdError {
    #[error("no etcd endpoint answered: {0}")]
    Unreachable(String),
    #[error("etcd {endpoint}: {status}")]
    Call {
        endpoint: String,
        status: Box<tonic::Status>,
    },
    #[error("etcd endpoint {0:?}: {1}")]
    Endpoint(String, String),
}

/// PEM files for TLS to etcd (`[ha.tls]`): etcd's CA, and this server's client certificate
/// and key when etcd asks for one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdTls {
    pub ca: std::path::PathBuf,
    pub cert: Option<std::path::PathBuf>,
    pub key: Option<std::path::PathBuf>,
}

/// A client of an etcd cluster (see the module doc).
#[derive(Debug)]
pub struct Etcd {
    endpoints: Vec<Endpoint>,
    names: Vec<String>,
    /// The endpoint in use and its channel.
    current: Mutex<(usize, Option<Channel>)>,
}

impl Etcd {
    /// A client of the members at `urls` (`http://host:2379`, `https://...`); nothing is
    /// connected yet.
    pub fn new(urls: &[String], tls: Option<&EtcdTls>) -> Result<Etcd, EtcdError> {
        if urls.is_empty() {
            return Err(EtcdError::Endpoint(
                String::new(),
                "no etcd endpoint given".into(),
            ));
        }
        let tls_config = tls.map(load_tls).transpose()?;
        let mut endpoints = Vec::with_capacity(urls.len());
        for url in urls {
            let bad = |e: &dyn std::fmt::Display| EtcdError::Endpoint(url.clone(), e.to_string());
            let mut ep = Endpoint::from_shared(url.clone())
                .map_err(|e| bad(&e))?
                .connect_timeout(CONNECT_TIMEOUT)
                .tcp_nodelay(true)
                .http2_keep_alive_interval(Duration::from_secs(1))
                .keep_alive_timeout(Duration::from_secs(2));
            if url.starts_with("https://") {
                let Some(t) = &tls_config else {
                    return Err(bad(&"an https endpoint needs [ha.tls] (etcd's CA)"));
                };
                ep = ep.tls_config(t.clone()).map_err(|e| bad(&e))?;
            } else if !url.starts_with("http://") {
                return Err(bad(&"not an http:// or https:// URL"));
            }
            endpoints.push(ep);
        }
        Ok(Etcd {
            endpoints,
            names: urls.to_vec(),
            current: Mutex::new((0, None)),
        })
    }

    /// The channel to the member in use, connecting (in list order from the last one used)
    /// when there is none.
    async fn channel(&self) -> Result<(usize, Channel), EtcdError> {
        let start = {
            let cur = self.current.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(c) = &cur.1 {
                return Ok((cur.0, c.clone()));
            }
            cur.0
        };
        let mut why = Vec::new();
        for k in 0..self.endpoints.len() {
            let i = (start + k) % self.endpoints.len();
            match self.endpoints[i].connect().await {
                Ok(c) => {
                    let mut cur = self.current.lock().unwrap_or_else(|p| p.into_inner());
                    *cur = (i, Some(c.clone()));
                    return Ok((i, c));
                }
                Err(e) => why.push(format!("{}: {e}", self.names[i])),
            }
        }
        Err(EtcdError::Unreachable(why.join("; ")))
    }

    /// Forgets the channel to member `i` after it failed: the next call tries the next one.
    fn failed(&self, i: usize) {
        let mut cur = self.current.lock().unwrap_or_else(|p| p.into_inner());
        if cur.0 == i {
            *cur = ((i + 1) % self.endpoints.len(), None);
        }
    }

    /// Runs `call` on the member in use; a transport failure moves to the next member and
    /// tries again, once per member.
    async fn call<T, F, Fut>(&self, call: F) -> Result<T, EtcdError>
    where
        F: Fn(Channel) -> Fut,
        Fut: std::future::Future<Output = Result<T, tonic::Status>>,
    {
        let mut last = None;
        for _ in 0..self.endpoints.len() {
            let (i, channel) = self.channel().await?;
            match call(channel).await {
                Ok(v) => return Ok(v),
                Err(status) => {
                    let transport = is_transport(&status);
                    let err = EtcdError::Call {
                        endpoint: self.names[i].clone(),
                        status: Box::new(status),
                    };
                    if !transport {
                        return Err(err);
                    }
                    self.failed(i);
                    last = Some(err);
                }
            }
        }
        Err(last.unwrap_or_else(|| EtcdError::Unreachable("no endpoint".into())))
    }

    /// A new lease of `ttl_s` seconds; returns its id and the TTL etcd granted.
    pub async fn grant(&self, ttl_s: i64) -> Result<(i64, i64), EtcdError> {
        let r = self
            .call(|c| async move {
                LeaseClient::new(c)
                    .lease_grant(LeaseGrantRequest { ttl: ttl_s, id: 0 })
                    .await
            })
            .await?
            .into_inner();
        if !r.error.is_empty() || r.id == 0 {
            return Err(EtcdError::Unreachable(format!(
                "lease not granted: {}",
                r.error
            )));
        }
        Ok((r.id, r.ttl))
    }

    /// One keep-alive of `lease`: the seconds it has left now (0 or less: it is gone).
    pub async fn keep_alive(&self, lease: i64) -> Result<i64, EtcdError> {
        self.call(|c| async move {
            let req = tokio_stream::once(LeaseKeepAliveRequest { id: lease });
            let mut answers = LeaseClient::new(c)
                .lease_keep_alive(req)
                .await?
                .into_inner();
            match answers.message().await? {
                Some(a) => Ok(a.ttl),
                None => Err(tonic::Status::unavailable("keep-alive stream ended")),
            }
        })
        .await
    }

    /// Revokes `lease` (its keys, our election key among them, go at once).
    pub async fn revoke(&self, lease: i64) -> Result<(), EtcdError> {
        self.call(|c| async move {
            LeaseClient::new(c)
                .lease_revoke(LeaseRevokeRequest { id: lease })
                .await
        })
        .await
        .map(|_| ())
    }

    /// Campaigns in election `name` with `lease`, advertising `value`: returns once this
    /// candidate leads (its key is the oldest under `name/`).
    pub async fn campaign(
        &self,
        name: &str,
        lease: i64,
        value: &str,
    ) -> Result<LeaderKey, EtcdError> {
        let r = self
            .call(|c| async move {
                ElectionClient::new(c)
                    .campaign(CampaignRequest {
                        name: name.as_bytes().to_vec(),
                        lease,
                        value: value.as_bytes().to_vec(),
                    })
                    .await
            })
            .await?
            .into_inner();
        r.leader
            .ok_or_else(|| EtcdError::Unreachable("campaign answered without a leader key".into()))
    }

    /// The current leader's key and value in election `name`, if there is one.
    pub async fn leader(&self, name: &str) -> Result<Option<KeyValue>, EtcdError> {
        let r = self
            .call(|c| async move {
                ElectionClient::new(c)
                    .leader(LeaderRequest {
                        name: name.as_bytes().to_vec(),
                    })
                    .await
            })
            .await;
        match r {
            Ok(r) => Ok(r.into_inner().kv),
            // etcd answers "election: no leader" as an error.
            Err(EtcdError::Call { status, .. }) if status.message().contains("no leader") => {
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    /// Every candidate of election `name` (the leader first: oldest key first).
    pub async fn candidates(&self, name: &str) -> Result<Vec<KeyValue>, EtcdError> {
        let prefix = format!("{name}/").into_bytes();
        let end = prefix_end(&prefix);
        let r = self
            .call(|c| {
                let (key, range_end) = (prefix.clone(), end.clone());
                async move {
                    KvClient::new(c)
                        .range(RangeRequest {
                            key,
                            range_end,
                            limit: 0,
                        })
                        .await
                }
            })
            .await?
            .into_inner();
        let mut kvs = r.kvs;
        kvs.sort_by_key(|kv| kv.create_revision);
        Ok(kvs)
    }

    /// Steps down: deletes this leader's key, so that the next candidate leads at once.
    pub async fn resign(&self, leader: &LeaderKey) -> Result<(), EtcdError> {
        self.call(|c| {
            let leader = leader.clone();
            async move {
                ElectionClient::new(c)
                    .resign(ResignRequest {
                        leader: Some(leader),
                    })
                    .await
            }
        })
        .await
        .map(|_| ())
    }
}

/// The end of the key range of every key starting with `prefix` (etcd's convention: the
/// prefix with its last byte below 0xff incremented).
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

fn is_transport(status: &tonic::Status) -> bool {
    matches!(
        status.code(),
        tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Cancelled
    )
}

fn load_tls(t: &EtcdTls) -> Result<ClientTlsConfig, EtcdError> {
    let read = |p: &std::path::Path| {
        std::fs::read(p).map_err(|e| EtcdError::Endpoint(p.display().to_string(), e.to_string()))
    };
    let mut c = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(read(&t.ca)?));
    match (&t.cert, &t.key) {
        (Some(cert), Some(key)) => {
            c = c.identity(Identity::from_pem(read(cert)?, read(key)?));
        }
        (None, None) => {}
        _ => {
            return Err(EtcdError::Endpoint(
                "[ha.tls]".into(),
                "cert and key go together".into(),
            ));
        }
    }
    Ok(c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_end_is_the_next_key_after_every_key_with_the_prefix() {
        assert_eq!(prefix_end(b"sanfs/mds/"), b"sanfs/mds0".to_vec());
        assert_eq!(prefix_end(&[b'a', 0xff]), b"b".to_vec());
        assert_eq!(prefix_end(&[0xff]), vec![0]);
    }

    #[test]
    fn endpoints_are_checked_when_the_client_is_made() {
        assert!(Etcd::new(&[], None).is_err());
        assert!(Etcd::new(&["ftp://x:1".into()], None).is_err());
        assert!(Etcd::new(&["https://x:2379".into()], None).is_err());
        assert!(Etcd::new(&["http://127.0.0.1:2379".into()], None).is_ok());
    }
}
