//! Directory quotas (the Admin service's SetQuota and GetQuota): what the CSI driver makes a
//! volume of. Setting a quota is root's; the server refuses it on a non-empty directory or one
//! inside another quota.

use sanfs_proto::model::{GetQuotaRequest, QuotaInfo, QuotaLimits, SetQuotaRequest};
use sanfs_proto::pb;
use sanfs_proto::pb::admin_client::AdminClient;
use sanfs_proto::types::{Credentials, FsError, InodeId};

use super::{Client, malformed};

impl Client {
    /// Sets (or changes) the quota of directory `dir`; returns it with its usage.
    pub async fn set_quota(
        &self,
        cred: &Credentials,
        dir: InodeId,
        limits: QuotaLimits,
    ) -> Result<QuotaInfo, FsError> {
        let session = self.inner.session_for_call()?;
        let req = pb::SetQuotaRequest::from(SetQuotaRequest {
            cred: cred.clone(),
            inode: dir,
            limits,
        });
        let reply = AdminClient::new(self.inner.channel.clone())
            .set_quota(req)
            .await
            .map_err(|s| self.inner.status_error(session, &s))?
            .into_inner();
        QuotaInfo::try_from(reply).map_err(|e| malformed("SetQuota reply", e))
    }

    /// The quota set on directory `dir` itself, with its usage; `None` when it has none.
    pub async fn get_quota(
        &self,
        cred: &Credentials,
        dir: InodeId,
    ) -> Result<Option<QuotaInfo>, FsError> {
        let session = self.inner.session_for_call()?;
        let req = pb::GetQuotaRequest::from(GetQuotaRequest {
            cred: cred.clone(),
            inode: dir,
        });
        match AdminClient::new(self.inner.channel.clone())
            .get_quota(req)
            .await
        {
            Ok(reply) => QuotaInfo::try_from(reply.into_inner())
                .map(Some)
                .map_err(|e| malformed("GetQuota reply", e)),
            Err(s) => match self.inner.status_error(session, &s) {
                FsError::NoAttr => Ok(None),
                e => Err(e),
            },
        }
    }
}
