//! Directory quotas (the Admin service's SetQuota and GetQuota): what the CSI driver makes a
//! volume of. Setting a quota is root's; the server refuses it on a non-empty directory or one
//! inside another quota.

use sanfs_proto::model::{GetQuotaRequest, QuotaInfo, QuotaLimits, SetQuotaRequest};
use sanfs_proto::pb;
use sanfs_proto::pb::admin_client::AdminClient;
use sanfs_proto::types::{Credentials, FsError, InodeId};

use super::Client;
use super::rpc::Pin;

impl Client {
    /// Sets (or changes) the quota of directory `dir`; returns it with its usage.
    pub async fn set_quota(
        &self,
        cred: &Credentials,
        dir: InodeId,
        limits: QuotaLimits,
    ) -> Result<QuotaInfo, FsError> {
        let req = pb::SetQuotaRequest::from(SetQuotaRequest {
            cred: cred.clone(),
            inode: dir,
            limits,
        });
        self.inner
            .call("SetQuota reply", Pin::Any, |_| {
                let mut admin = AdminClient::new(self.inner.channel.clone());
                let req = req.clone();
                async move { admin.set_quota(req).await }
            })
            .await
    }

    /// The quota set on directory `dir` itself, with its usage; `None` when it has none.
    pub async fn get_quota(
        &self,
        cred: &Credentials,
        dir: InodeId,
    ) -> Result<Option<QuotaInfo>, FsError> {
        let req = pb::GetQuotaRequest::from(GetQuotaRequest {
            cred: cred.clone(),
            inode: dir,
        });
        let r = self
            .inner
            .call("GetQuota reply", Pin::Any, |_| {
                let mut admin = AdminClient::new(self.inner.channel.clone());
                let req = req.clone();
                async move { admin.get_quota(req).await }
            })
            .await;
        match r {
            Ok(q) => Ok(Some(q)),
            Err(FsError::NoAttr) => Ok(None),
            Err(e) => Err(e),
        }
    }
}
