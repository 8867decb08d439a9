//! The Identity service: the driver's name and version, its capabilities (the Controller
//! service, online volume expansion; no topology: every node that sees the LUNs and the
//! server can use every volume), and Probe, which reports the session at the metadata server.

use std::sync::Arc;

use sanfs_proto::csi::{PluginCapability, PluginInfo, ProbeReply, pb};
use tonic::{Request, Response, Status};

use super::Driver;

pub struct IdentityService {
    driver: Arc<Driver>,
}

impl IdentityService {
    pub fn new(driver: Arc<Driver>) -> IdentityService {
        IdentityService { driver }
    }
}

/// The capabilities of the plugin as a whole: the same in every mode, as the specification
/// asks of all instances of one version.
pub fn plugin_capabilities() -> Vec<PluginCapability> {
    vec![
        PluginCapability::ControllerService,
        PluginCapability::OnlineVolumeExpansion,
    ]
}

#[tonic::async_trait]
impl pb::identity_server::Identity for IdentityService {
    async fn get_plugin_info(
        &self,
        _request: Request<pb::GetPluginInfoRequest>,
    ) -> Result<Response<pb::GetPluginInfoResponse>, Status> {
        let info = PluginInfo {
            name: self.driver.config.driver_name.clone(),
            vendor_version: env!("CARGO_PKG_VERSION").to_owned(),
            manifest: [(
                "mode".to_owned(),
                format!("{:?}", self.driver.config.mode).to_lowercase(),
            )]
            .into(),
        };
        Ok(Response::new(info.into()))
    }

    async fn get_plugin_capabilities(
        &self,
        _request: Request<pb::GetPluginCapabilitiesRequest>,
    ) -> Result<Response<pb::GetPluginCapabilitiesResponse>, Status> {
        Ok(Response::new(plugin_capabilities().into()))
    }

    /// Ready once the session at the metadata server is open and its lease valid; not ready
    /// while the first connection is still being made; FAILED_PRECONDITION when the session
    /// was lost (the client is re-establishing it).
    async fn probe(
        &self,
        _request: Request<pb::ProbeRequest>,
    ) -> Result<Response<pb::ProbeResponse>, Status> {
        let Ok(client) = self.driver.client() else {
            return Ok(Response::new(ProbeReply { ready: Some(false) }.into()));
        };
        let (session, valid) = client.session();
        if !valid {
            return Err(Status::failed_precondition(format!(
                "the session {session} with the metadata server {} is lost; re-establishing",
                self.driver.config.server
            )));
        }
        Ok(Response::new(ProbeReply { ready: Some(true) }.into()))
    }
}
