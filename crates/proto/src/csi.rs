//! CSI v1, the Container Storage Interface, as sanfs serves it: the generated wire types
//! ([`pb`], from `proto/csi/v1/csi.proto`) and the validated requests and replies the CSI driver
//! (`sanfs-csi` in the agent crate) works with.
//!
//! Each request the driver serves converts with `TryFrom` here, once: required fields present
//! (the specification's "This field is REQUIRED"), enums known, sizes inside the
//! specification's limits (128-byte strings, 4 KiB maps, node ids of 256 bytes), capacities not
//! negative, paths absolute. A failed conversion is a [`ProtocolError`] naming the field, which
//! the driver answers with `INVALID_ARGUMENT` ([`invalid_argument`]), as the specification's
//! error scheme asks for a missing or invalid field. Replies convert from domain types with
//! `From`. `secrets` maps are never converted (sanfs needs none), so they are never kept or
//! logged.
//!
//! Whether a volume id names a volume, whether a capability is one sanfs supports, and what a
//! capacity rounds to are the driver's questions, not this module's.

use std::collections::BTreeMap;
use std::path::{Component, Path, PathBuf};

use crate::types::ProtocolError;

/// The code generated from `proto/csi/v1/csi.proto` (messages, clients and servers).
#[allow(
    clippy::all,
    clippy::pedantic,
    rust_2018_idioms,
    missing_docs,
    reason = "generated code"
)]
pub mod pb {
    tonic::include_proto!("csi.v1");
}

/// The specification's size limit of a string field, bytes.
pub const MAX_STRING_LEN: usize = 128;
/// The specification's size limit of a `map<string, string>` field (keys and values), bytes.
pub const MAX_MAP_BYTES: usize = 4096;
/// Longest node id (`NodeGetInfoResponse.node_id` overrides the string limit).
pub const MAX_NODE_ID_LEN: usize = 256;
/// Longest path accepted (the paths override the string limit; Linux PATH_MAX).
pub const MAX_PATH_LEN: usize = 4096;

/// The status for a request that failed validation: `INVALID_ARGUMENT` with the field named.
pub fn invalid_argument(e: &ProtocolError) -> tonic::Status {
    tonic::Status::invalid_argument(e.to_string())
}

fn invalid(field: &'static str, reason: impl Into<String>) -> ProtocolError {
    ProtocolError::InvalidField {
        field,
        reason: reason.into(),
    }
}

fn required<T>(value: Option<T>, field: &'static str) -> Result<T, ProtocolError> {
    value.ok_or(ProtocolError::MissingField(field))
}

/// A string field that must be set (non-empty) and at most `max` bytes.
fn required_string(
    value: String,
    field: &'static str,
    max: usize,
) -> Result<String, ProtocolError> {
    if value.is_empty() {
        return Err(ProtocolError::MissingField(field));
    }
    if value.len() > max {
        return Err(invalid(
            field,
            format!("is {} bytes long (at most {max})", value.len()),
        ));
    }
    if value.contains('\0') {
        return Err(invalid(field, "contains NUL"));
    }
    Ok(value)
}

/// A `map<string, string>` field within the 4 KiB limit.
fn string_map(
    map: std::collections::HashMap<String, String>,
    field: &'static str,
) -> Result<BTreeMap<String, String>, ProtocolError> {
    let bytes: usize = map.iter().map(|(k, v)| k.len() + v.len()).sum();
    if bytes > MAX_MAP_BYTES {
        return Err(invalid(
            field,
            format!("holds {bytes} bytes (at most {MAX_MAP_BYTES})"),
        ));
    }
    Ok(map.into_iter().collect())
}

fn nonnegative(value: i64, field: &'static str) -> Result<u64, ProtocolError> {
    u64::try_from(value).map_err(|_| invalid(field, format!("{value} is negative")))
}

/// A u64 for an `int64` field that must not be negative: clamped to `i64::MAX`.
pub fn to_int64(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

/// The CO's name for a volume (`CreateVolumeRequest.name`): 1 to 128 bytes, none of the
/// control characters the specification bans (U+0000-U+0008, U+000B, U+000C, U+000E-U+001F,
/// U+007F-U+009F).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct VolumeName(String);

impl VolumeName {
    pub fn new(name: String) -> Result<VolumeName, ProtocolError> {
        let name = required_string(name, "name", MAX_STRING_LEN)?;
        let banned = |c: char| matches!(c, '\u{0}'..='\u{8}' | '\u{b}' | '\u{c}' | '\u{e}'..='\u{1f}' | '\u{7f}'..='\u{9f}');
        if let Some(c) = name.chars().find(|&c| banned(c)) {
            return Err(invalid(
                "name",
                format!("contains the control character U+{:04X}", u32::from(c)),
            ));
        }
        Ok(VolumeName(name))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// A volume id as the CO sends it back: 1 to 128 bytes, no NUL. (Whether it names a volume
/// is the driver's question: an id it could never have made names no volume.)
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct VolumeId(String);

impl VolumeId {
    pub fn new(id: String) -> Result<VolumeId, ProtocolError> {
        required_string(id, "volume_id", MAX_STRING_LEN).map(VolumeId)
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// A path on the node (staging and target paths): absolute, no NUL, no `..` component, at
/// most [`MAX_PATH_LEN`] bytes (see [`NodePath::lookup`] for the one exception).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NodePath(PathBuf);

impl NodePath {
    pub fn new(path: String, field: &'static str) -> Result<NodePath, ProtocolError> {
        let path = required_string(path, field, MAX_PATH_LEN)?;
        let p = PathBuf::from(path);
        if !p.is_absolute() {
            return Err(invalid(field, "is not an absolute path"));
        }
        if p.components().any(|c| c == Component::ParentDir) {
            return Err(invalid(field, "has a `..` component"));
        }
        Ok(NodePath(p))
    }

    /// A path the driver only looks for (`volume_path` of NodeGetVolumeStats and
    /// NodeExpandVolume): checked as [`NodePath::new`], except that it may be relative. A
    /// relative path is never where a volume is mounted, which the driver answers with
    /// NOT_FOUND ("volume does not exist on the specified path"), not INVALID_ARGUMENT.
    pub fn lookup(path: String, field: &'static str) -> Result<NodePath, ProtocolError> {
        let path = required_string(path, field, MAX_PATH_LEN)?;
        let p = PathBuf::from(path);
        if p.components().any(|c| c == Component::ParentDir) {
            return Err(invalid(field, "has a `..` component"));
        }
        Ok(NodePath(p))
    }

    /// An optional path field: empty is `None`.
    fn optional(path: String, field: &'static str) -> Result<Option<NodePath>, ProtocolError> {
        if path.is_empty() {
            return Ok(None);
        }
        NodePath::new(path, field).map(Some)
    }

    pub fn as_path(&self) -> &Path {
        &self.0
    }
}

/// How a volume may be shared (`VolumeCapability.AccessMode.Mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AccessMode {
    SingleNodeWriter,
    SingleNodeReaderOnly,
    MultiNodeReaderOnly,
    MultiNodeSingleWriter,
    MultiNodeMultiWriter,
    SingleNodeSingleWriter,
    SingleNodeMultiWriter,
}

impl AccessMode {
    /// Whether the mode allows no writes at all.
    pub fn is_read_only(self) -> bool {
        matches!(
            self,
            AccessMode::SingleNodeReaderOnly | AccessMode::MultiNodeReaderOnly
        )
    }
}

type PbMode = pb::volume_capability::access_mode::Mode;

impl From<AccessMode> for PbMode {
    fn from(m: AccessMode) -> PbMode {
        match m {
            AccessMode::SingleNodeWriter => PbMode::SingleNodeWriter,
            AccessMode::SingleNodeReaderOnly => PbMode::SingleNodeReaderOnly,
            AccessMode::MultiNodeReaderOnly => PbMode::MultiNodeReaderOnly,
            AccessMode::MultiNodeSingleWriter => PbMode::MultiNodeSingleWriter,
            AccessMode::MultiNodeMultiWriter => PbMode::MultiNodeMultiWriter,
            AccessMode::SingleNodeSingleWriter => PbMode::SingleNodeSingleWriter,
            AccessMode::SingleNodeMultiWriter => PbMode::SingleNodeMultiWriter,
        }
    }
}

fn access_mode(p: Option<pb::volume_capability::AccessMode>) -> Result<AccessMode, ProtocolError> {
    let raw = required(p, "access_mode")?.mode;
    let mode =
        PbMode::try_from(raw).map_err(|_| invalid("access_mode", format!("unknown mode {raw}")))?;
    Ok(match mode {
        PbMode::Unknown => return Err(ProtocolError::MissingField("access_mode")),
        PbMode::SingleNodeWriter => AccessMode::SingleNodeWriter,
        PbMode::SingleNodeReaderOnly => AccessMode::SingleNodeReaderOnly,
        PbMode::MultiNodeReaderOnly => AccessMode::MultiNodeReaderOnly,
        PbMode::MultiNodeSingleWriter => AccessMode::MultiNodeSingleWriter,
        PbMode::MultiNodeMultiWriter => AccessMode::MultiNodeMultiWriter,
        PbMode::SingleNodeSingleWriter => AccessMode::SingleNodeSingleWriter,
        PbMode::SingleNodeMultiWriter => AccessMode::SingleNodeMultiWriter,
    })
}

/// A file-system (mount) access type.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct MountVolume {
    /// Empty when the CO named none.
    pub fs_type: String,
    pub mount_flags: Vec<String>,
    /// Empty when the CO named none.
    pub volume_mount_group: String,
}

/// How the volume is accessed.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum AccessType {
    Block,
    Mount(MountVolume),
}

/// One way the CO means to use a volume.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct VolumeCapability {
    pub access_type: AccessType,
    pub access_mode: AccessMode,
}

impl TryFrom<pb::VolumeCapability> for VolumeCapability {
    type Error = ProtocolError;

    fn try_from(p: pb::VolumeCapability) -> Result<Self, ProtocolError> {
        use pb::volume_capability::AccessType as Pb;
        let access_type = match required(p.access_type, "access_type")? {
            Pb::Block(_) => AccessType::Block,
            Pb::Mount(m) => {
                let flag_bytes: usize = m.mount_flags.iter().map(String::len).sum();
                if flag_bytes > MAX_MAP_BYTES {
                    return Err(invalid(
                        "mount_flags",
                        format!("hold {flag_bytes} bytes (at most {MAX_MAP_BYTES})"),
                    ));
                }
                if m.fs_type.len() > MAX_STRING_LEN {
                    return Err(invalid("fs_type", "is longer than 128 bytes"));
                }
                if m.volume_mount_group.len() > MAX_STRING_LEN {
                    return Err(invalid("volume_mount_group", "is longer than 128 bytes"));
                }
                AccessType::Mount(MountVolume {
                    fs_type: m.fs_type,
                    mount_flags: m.mount_flags,
                    volume_mount_group: m.volume_mount_group,
                })
            }
        };
        Ok(VolumeCapability {
            access_type,
            access_mode: access_mode(p.access_mode)?,
        })
    }
}

impl From<VolumeCapability> for pb::VolumeCapability {
    fn from(c: VolumeCapability) -> Self {
        use pb::volume_capability as vc;
        pb::VolumeCapability {
            access_type: Some(match c.access_type {
                AccessType::Block => vc::AccessType::Block(vc::BlockVolume {}),
                AccessType::Mount(m) => vc::AccessType::Mount(vc::MountVolume {
                    fs_type: m.fs_type,
                    mount_flags: m.mount_flags,
                    volume_mount_group: m.volume_mount_group,
                }),
            }),
            access_mode: Some(vc::AccessMode {
                mode: PbMode::from(c.access_mode).into(),
            }),
        }
    }
}

fn capability(
    p: Option<pb::VolumeCapability>,
    field: &'static str,
) -> Result<VolumeCapability, ProtocolError> {
    VolumeCapability::try_from(required(p, field)?).map_err(|e| e.in_field(field))
}

fn capabilities(
    p: Vec<pb::VolumeCapability>,
    field: &'static str,
    nonempty: bool,
) -> Result<Vec<VolumeCapability>, ProtocolError> {
    if nonempty && p.is_empty() {
        return Err(ProtocolError::MissingField(field));
    }
    p.into_iter()
        .map(|c| VolumeCapability::try_from(c).map_err(|e| e.in_field(field)))
        .collect()
}

/// A wanted size: at least `required_bytes`, at most `limit_bytes` (`None`: unset). When both
/// are set, `required_bytes <= limit_bytes`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CapacityRange {
    pub required_bytes: Option<u64>,
    pub limit_bytes: Option<u64>,
}

impl CapacityRange {
    /// Whether neither bound is set.
    pub fn is_unset(&self) -> bool {
        self.required_bytes.is_none() && self.limit_bytes.is_none()
    }
}

impl TryFrom<pb::CapacityRange> for CapacityRange {
    type Error = ProtocolError;

    fn try_from(p: pb::CapacityRange) -> Result<Self, ProtocolError> {
        let required_bytes = nonnegative(p.required_bytes, "required_bytes")?;
        let limit_bytes = nonnegative(p.limit_bytes, "limit_bytes")?;
        let r = CapacityRange {
            required_bytes: (required_bytes > 0).then_some(required_bytes),
            limit_bytes: (limit_bytes > 0).then_some(limit_bytes),
        };
        if let (Some(req), Some(lim)) = (r.required_bytes, r.limit_bytes)
            && req > lim
        {
            return Err(invalid(
                "required_bytes",
                format!("{req} is above limit_bytes {lim}"),
            ));
        }
        Ok(r)
    }
}

fn capacity_range(
    p: Option<pb::CapacityRange>,
    field: &'static str,
) -> Result<Option<CapacityRange>, ProtocolError> {
    p.map(|c| CapacityRange::try_from(c).map_err(|e| e.in_field(field)))
        .transpose()
}

/// Where a new volume's content should come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ContentSource {
    Snapshot(String),
    Volume(String),
}

// ---------------------------------------------------------------------------------------------
// Controller requests
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CreateVolumeRequest {
    pub name: VolumeName,
    pub capacity_range: Option<CapacityRange>,
    /// At least one.
    pub volume_capabilities: Vec<VolumeCapability>,
    pub parameters: BTreeMap<String, String>,
    pub content_source: Option<ContentSource>,
}

impl TryFrom<pb::CreateVolumeRequest> for CreateVolumeRequest {
    type Error = ProtocolError;

    fn try_from(p: pb::CreateVolumeRequest) -> Result<Self, ProtocolError> {
        use pb::volume_content_source::Type;
        let content_source = match p.volume_content_source.and_then(|s| s.r#type) {
            None => None,
            Some(Type::Snapshot(s)) => Some(ContentSource::Snapshot(s.snapshot_id)),
            Some(Type::Volume(v)) => Some(ContentSource::Volume(v.volume_id)),
        };
        Ok(CreateVolumeRequest {
            name: VolumeName::new(p.name)?,
            capacity_range: capacity_range(p.capacity_range, "capacity_range")?
                .filter(|c| !c.is_unset()),
            volume_capabilities: capabilities(p.volume_capabilities, "volume_capabilities", true)?,
            parameters: string_map(p.parameters, "parameters")?,
            content_source,
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeleteVolumeRequest {
    pub volume_id: VolumeId,
}

impl TryFrom<pb::DeleteVolumeRequest> for DeleteVolumeRequest {
    type Error = ProtocolError;

    fn try_from(p: pb::DeleteVolumeRequest) -> Result<Self, ProtocolError> {
        Ok(DeleteVolumeRequest {
            volume_id: VolumeId::new(p.volume_id)?,
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ValidateVolumeCapabilitiesRequest {
    pub volume_id: VolumeId,
    pub volume_context: BTreeMap<String, String>,
    /// At least one.
    pub volume_capabilities: Vec<VolumeCapability>,
    pub parameters: BTreeMap<String, String>,
}

impl TryFrom<pb::ValidateVolumeCapabilitiesRequest> for ValidateVolumeCapabilitiesRequest {
    type Error = ProtocolError;

    fn try_from(p: pb::ValidateVolumeCapabilitiesRequest) -> Result<Self, ProtocolError> {
        Ok(ValidateVolumeCapabilitiesRequest {
            volume_id: VolumeId::new(p.volume_id)?,
            volume_context: string_map(p.volume_context, "volume_context")?,
            volume_capabilities: capabilities(p.volume_capabilities, "volume_capabilities", true)?,
            parameters: string_map(p.parameters, "parameters")?,
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListVolumesRequest {
    /// `None`: no limit.
    pub max_entries: Option<u32>,
    /// `None`: from the start.
    pub starting_token: Option<String>,
}

impl TryFrom<pb::ListVolumesRequest> for ListVolumesRequest {
    type Error = ProtocolError;

    fn try_from(p: pb::ListVolumesRequest) -> Result<Self, ProtocolError> {
        let max = u32::try_from(p.max_entries)
            .map_err(|_| invalid("max_entries", format!("{} is negative", p.max_entries)))?;
        if p.starting_token.len() > MAX_STRING_LEN {
            return Err(invalid("starting_token", "is longer than 128 bytes"));
        }
        Ok(ListVolumesRequest {
            max_entries: (max > 0).then_some(max),
            starting_token: (!p.starting_token.is_empty()).then_some(p.starting_token),
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GetCapacityRequest {
    pub volume_capabilities: Vec<VolumeCapability>,
    pub parameters: BTreeMap<String, String>,
}

impl TryFrom<pb::GetCapacityRequest> for GetCapacityRequest {
    type Error = ProtocolError;

    fn try_from(p: pb::GetCapacityRequest) -> Result<Self, ProtocolError> {
        Ok(GetCapacityRequest {
            volume_capabilities: capabilities(p.volume_capabilities, "volume_capabilities", false)?,
            parameters: string_map(p.parameters, "parameters")?,
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ControllerExpandVolumeRequest {
    pub volume_id: VolumeId,
    /// At least one bound set.
    pub capacity_range: CapacityRange,
    pub volume_capability: Option<VolumeCapability>,
}

impl TryFrom<pb::ControllerExpandVolumeRequest> for ControllerExpandVolumeRequest {
    type Error = ProtocolError;

    fn try_from(p: pb::ControllerExpandVolumeRequest) -> Result<Self, ProtocolError> {
        let capacity_range = capacity_range(p.capacity_range, "capacity_range")?
            .filter(|c| !c.is_unset())
            .ok_or(ProtocolError::MissingField("capacity_range"))?;
        Ok(ControllerExpandVolumeRequest {
            volume_id: VolumeId::new(p.volume_id)?,
            capacity_range,
            volume_capability: p
                .volume_capability
                .map(|c| capability(Some(c), "volume_capability"))
                .transpose()?,
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Node requests
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeStageVolumeRequest {
    pub volume_id: VolumeId,
    pub staging_target_path: NodePath,
    pub volume_capability: VolumeCapability,
    pub volume_context: BTreeMap<String, String>,
}

impl TryFrom<pb::NodeStageVolumeRequest> for NodeStageVolumeRequest {
    type Error = ProtocolError;

    fn try_from(p: pb::NodeStageVolumeRequest) -> Result<Self, ProtocolError> {
        Ok(NodeStageVolumeRequest {
            volume_id: VolumeId::new(p.volume_id)?,
            staging_target_path: NodePath::new(p.staging_target_path, "staging_target_path")?,
            volume_capability: capability(p.volume_capability, "volume_capability")?,
            volume_context: string_map(p.volume_context, "volume_context")?,
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeUnstageVolumeRequest {
    pub volume_id: VolumeId,
    pub staging_target_path: NodePath,
}

impl TryFrom<pb::NodeUnstageVolumeRequest> for NodeUnstageVolumeRequest {
    type Error = ProtocolError;

    fn try_from(p: pb::NodeUnstageVolumeRequest) -> Result<Self, ProtocolError> {
        Ok(NodeUnstageVolumeRequest {
            volume_id: VolumeId::new(p.volume_id)?,
            staging_target_path: NodePath::new(p.staging_target_path, "staging_target_path")?,
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodePublishVolumeRequest {
    pub volume_id: VolumeId,
    /// Required by a driver that stages (the driver says so: FAILED_PRECONDITION).
    pub staging_target_path: Option<NodePath>,
    pub target_path: NodePath,
    pub volume_capability: VolumeCapability,
    pub readonly: bool,
    pub volume_context: BTreeMap<String, String>,
}

impl TryFrom<pb::NodePublishVolumeRequest> for NodePublishVolumeRequest {
    type Error = ProtocolError;

    fn try_from(p: pb::NodePublishVolumeRequest) -> Result<Self, ProtocolError> {
        Ok(NodePublishVolumeRequest {
            volume_id: VolumeId::new(p.volume_id)?,
            staging_target_path: NodePath::optional(p.staging_target_path, "staging_target_path")?,
            target_path: NodePath::new(p.target_path, "target_path")?,
            volume_capability: capability(p.volume_capability, "volume_capability")?,
            readonly: p.readonly,
            volume_context: string_map(p.volume_context, "volume_context")?,
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeUnpublishVolumeRequest {
    pub volume_id: VolumeId,
    pub target_path: NodePath,
}

impl TryFrom<pb::NodeUnpublishVolumeRequest> for NodeUnpublishVolumeRequest {
    type Error = ProtocolError;

    fn try_from(p: pb::NodeUnpublishVolumeRequest) -> Result<Self, ProtocolError> {
        Ok(NodeUnpublishVolumeRequest {
            volume_id: VolumeId::new(p.volume_id)?,
            target_path: NodePath::new(p.target_path, "target_path")?,
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeGetVolumeStatsRequest {
    pub volume_id: VolumeId,
    pub volume_path: NodePath,
    pub staging_target_path: Option<NodePath>,
}

impl TryFrom<pb::NodeGetVolumeStatsRequest> for NodeGetVolumeStatsRequest {
    type Error = ProtocolError;

    fn try_from(p: pb::NodeGetVolumeStatsRequest) -> Result<Self, ProtocolError> {
        Ok(NodeGetVolumeStatsRequest {
            volume_id: VolumeId::new(p.volume_id)?,
            volume_path: NodePath::lookup(p.volume_path, "volume_path")?,
            staging_target_path: NodePath::optional(p.staging_target_path, "staging_target_path")?,
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeExpandVolumeRequest {
    pub volume_id: VolumeId,
    pub volume_path: NodePath,
    pub capacity_range: Option<CapacityRange>,
    pub staging_target_path: Option<NodePath>,
    pub volume_capability: Option<VolumeCapability>,
}

impl TryFrom<pb::NodeExpandVolumeRequest> for NodeExpandVolumeRequest {
    type Error = ProtocolError;

    fn try_from(p: pb::NodeExpandVolumeRequest) -> Result<Self, ProtocolError> {
        Ok(NodeExpandVolumeRequest {
            volume_id: VolumeId::new(p.volume_id)?,
            volume_path: NodePath::lookup(p.volume_path, "volume_path")?,
            capacity_range: capacity_range(p.capacity_range, "capacity_range")?
                .filter(|c| !c.is_unset()),
            staging_target_path: NodePath::optional(p.staging_target_path, "staging_target_path")?,
            volume_capability: p
                .volume_capability
                .map(|c| capability(Some(c), "volume_capability"))
                .transpose()?,
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Replies
// ---------------------------------------------------------------------------------------------

/// GetPluginInfo.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PluginInfo {
    pub name: String,
    pub vendor_version: String,
    pub manifest: BTreeMap<String, String>,
}

impl From<PluginInfo> for pb::GetPluginInfoResponse {
    fn from(i: PluginInfo) -> Self {
        pb::GetPluginInfoResponse {
            name: i.name,
            vendor_version: i.vendor_version,
            manifest: i.manifest.into_iter().collect(),
        }
    }
}

/// What the plugin as a whole can do (GetPluginCapabilities).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PluginCapability {
    ControllerService,
    OnlineVolumeExpansion,
}

impl From<Vec<PluginCapability>> for pb::GetPluginCapabilitiesResponse {
    fn from(caps: Vec<PluginCapability>) -> Self {
        use pb::plugin_capability::{Service, Type, VolumeExpansion, service, volume_expansion};
        let capabilities = caps
            .into_iter()
            .map(|c| pb::PluginCapability {
                r#type: Some(match c {
                    PluginCapability::ControllerService => Type::Service(Service {
                        r#type: service::Type::ControllerService.into(),
                    }),
                    PluginCapability::OnlineVolumeExpansion => {
                        Type::VolumeExpansion(VolumeExpansion {
                            r#type: volume_expansion::Type::Online.into(),
                        })
                    }
                }),
            })
            .collect();
        pb::GetPluginCapabilitiesResponse { capabilities }
    }
}

/// Probe: `ready` `None` means ready.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProbeReply {
    pub ready: Option<bool>,
}

impl From<ProbeReply> for pb::ProbeResponse {
    fn from(p: ProbeReply) -> Self {
        pb::ProbeResponse { ready: p.ready }
    }
}

/// A provisioned volume.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Volume {
    pub volume_id: String,
    pub capacity_bytes: u64,
    pub volume_context: BTreeMap<String, String>,
}

impl From<Volume> for pb::Volume {
    fn from(v: Volume) -> Self {
        pb::Volume {
            capacity_bytes: to_int64(v.capacity_bytes),
            volume_id: v.volume_id,
            volume_context: v.volume_context.into_iter().collect(),
            content_source: None,
            accessible_topology: Vec::new(),
        }
    }
}

impl From<Volume> for pb::CreateVolumeResponse {
    fn from(v: Volume) -> Self {
        pb::CreateVolumeResponse {
            volume: Some(v.into()),
        }
    }
}

/// ValidateVolumeCapabilities: confirmed (with what was checked), or why not.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Validation {
    Confirmed {
        volume_context: BTreeMap<String, String>,
        volume_capabilities: Vec<VolumeCapability>,
        parameters: BTreeMap<String, String>,
    },
    NotConfirmed(String),
}

impl From<Validation> for pb::ValidateVolumeCapabilitiesResponse {
    fn from(v: Validation) -> Self {
        match v {
            Validation::Confirmed {
                volume_context,
                volume_capabilities,
                parameters,
            } => pb::ValidateVolumeCapabilitiesResponse {
                confirmed: Some(pb::validate_volume_capabilities_response::Confirmed {
                    volume_context: volume_context.into_iter().collect(),
                    volume_capabilities: volume_capabilities.into_iter().map(Into::into).collect(),
                    parameters: parameters.into_iter().collect(),
                }),
                message: String::new(),
            },
            Validation::NotConfirmed(message) => pb::ValidateVolumeCapabilitiesResponse {
                confirmed: None,
                message,
            },
        }
    }
}

/// One page of ListVolumes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumePage {
    pub entries: Vec<Volume>,
    /// `None` on the last page.
    pub next_token: Option<String>,
}

impl From<VolumePage> for pb::ListVolumesResponse {
    fn from(p: VolumePage) -> Self {
        pb::ListVolumesResponse {
            entries: p
                .entries
                .into_iter()
                .map(|v| pb::list_volumes_response::Entry {
                    volume: Some(v.into()),
                    status: None,
                })
                .collect(),
            next_token: p.next_token.unwrap_or_default(),
        }
    }
}

/// GetCapacity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capacity {
    pub available_bytes: u64,
    pub maximum_volume_size: Option<u64>,
}

impl From<Capacity> for pb::GetCapacityResponse {
    fn from(c: Capacity) -> Self {
        pb::GetCapacityResponse {
            available_capacity: to_int64(c.available_bytes),
            maximum_volume_size: c.maximum_volume_size.map(to_int64),
        }
    }
}

/// What the controller service can do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ControllerCapability {
    CreateDeleteVolume,
    ListVolumes,
    GetCapacity,
    ExpandVolume,
}

impl From<Vec<ControllerCapability>> for pb::ControllerGetCapabilitiesResponse {
    fn from(caps: Vec<ControllerCapability>) -> Self {
        use pb::controller_service_capability::{Rpc, Type, rpc};
        let capabilities = caps
            .into_iter()
            .map(|c| {
                let t = match c {
                    ControllerCapability::CreateDeleteVolume => rpc::Type::CreateDeleteVolume,
                    ControllerCapability::ListVolumes => rpc::Type::ListVolumes,
                    ControllerCapability::GetCapacity => rpc::Type::GetCapacity,
                    ControllerCapability::ExpandVolume => rpc::Type::ExpandVolume,
                };
                pb::ControllerServiceCapability {
                    r#type: Some(Type::Rpc(Rpc { r#type: t.into() })),
                }
            })
            .collect();
        pb::ControllerGetCapabilitiesResponse { capabilities }
    }
}

/// ControllerExpandVolume.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ControllerExpanded {
    pub capacity_bytes: u64,
    pub node_expansion_required: bool,
}

impl From<ControllerExpanded> for pb::ControllerExpandVolumeResponse {
    fn from(e: ControllerExpanded) -> Self {
        pb::ControllerExpandVolumeResponse {
            capacity_bytes: to_int64(e.capacity_bytes),
            node_expansion_required: e.node_expansion_required,
        }
    }
}

/// What the node service can do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeCapability {
    StageUnstageVolume,
    GetVolumeStats,
    ExpandVolume,
}

impl From<Vec<NodeCapability>> for pb::NodeGetCapabilitiesResponse {
    fn from(caps: Vec<NodeCapability>) -> Self {
        use pb::node_service_capability::{Rpc, Type, rpc};
        let capabilities = caps
            .into_iter()
            .map(|c| {
                let t = match c {
                    NodeCapability::StageUnstageVolume => rpc::Type::StageUnstageVolume,
                    NodeCapability::GetVolumeStats => rpc::Type::GetVolumeStats,
                    NodeCapability::ExpandVolume => rpc::Type::ExpandVolume,
                };
                pb::NodeServiceCapability {
                    r#type: Some(Type::Rpc(Rpc { r#type: t.into() })),
                }
            })
            .collect();
        pb::NodeGetCapabilitiesResponse { capabilities }
    }
}

/// NodeGetInfo.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeInfo {
    pub node_id: String,
    /// 0: the CO decides.
    pub max_volumes_per_node: u64,
}

impl NodeInfo {
    /// Checks a node id against the specification's limit (256 bytes, not empty).
    pub fn new(node_id: String, max_volumes_per_node: u64) -> Result<NodeInfo, ProtocolError> {
        Ok(NodeInfo {
            node_id: required_string(node_id, "node_id", MAX_NODE_ID_LEN)?,
            max_volumes_per_node,
        })
    }
}

impl From<NodeInfo> for pb::NodeGetInfoResponse {
    fn from(i: NodeInfo) -> Self {
        pb::NodeGetInfoResponse {
            node_id: i.node_id,
            max_volumes_per_node: to_int64(i.max_volumes_per_node),
            accessible_topology: None,
        }
    }
}

/// Totals in one unit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    pub total: u64,
    pub used: u64,
    pub available: u64,
}

/// NodeGetVolumeStats: bytes and inodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VolumeStats {
    pub bytes: Usage,
    pub inodes: Usage,
}

impl From<VolumeStats> for pb::NodeGetVolumeStatsResponse {
    fn from(s: VolumeStats) -> Self {
        let usage = |u: Usage, unit: pb::volume_usage::Unit| pb::VolumeUsage {
            available: to_int64(u.available),
            total: to_int64(u.total),
            used: to_int64(u.used),
            unit: unit.into(),
        };
        pb::NodeGetVolumeStatsResponse {
            usage: vec![
                usage(s.bytes, pb::volume_usage::Unit::Bytes),
                usage(s.inodes, pb::volume_usage::Unit::Inodes),
            ],
        }
    }
}

/// NodeExpandVolume.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeExpanded {
    pub capacity_bytes: u64,
}

impl From<NodeExpanded> for pb::NodeExpandVolumeResponse {
    fn from(e: NodeExpanded) -> Self {
        pb::NodeExpandVolumeResponse {
            capacity_bytes: to_int64(e.capacity_bytes),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]

    use super::*;
    use pb::volume_capability as vc;

    fn mount_cap(mode: PbMode) -> pb::VolumeCapability {
        pb::VolumeCapability {
            access_type: Some(vc::AccessType::Mount(vc::MountVolume::default())),
            access_mode: Some(vc::AccessMode { mode: mode.into() }),
        }
    }

    #[test]
    fn names_refuse_banned_control_characters_and_overlong_values() {
        assert!(VolumeName::new("pvc-1234 ü/x\t\n\r".into()).is_ok());
        assert!(VolumeName::new("a".repeat(128)).is_ok());
        assert_eq!(
            VolumeName::new(String::new()),
            Err(ProtocolError::MissingField("name"))
        );
        assert!(VolumeName::new("a".repeat(129)).is_err());
        for bad in ["a\u{1}", "a\u{b}", "\u{1f}", "x\u{7f}", "x\u{85}"] {
            assert!(VolumeName::new(bad.into()).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn capabilities_need_an_access_type_and_a_known_mode() {
        let ok = VolumeCapability::try_from(mount_cap(PbMode::MultiNodeMultiWriter)).unwrap();
        assert_eq!(ok.access_mode, AccessMode::MultiNodeMultiWriter);
        assert_eq!(
            pb::VolumeCapability::from(ok.clone()),
            mount_cap(PbMode::MultiNodeMultiWriter)
        );
        assert!(VolumeCapability::try_from(mount_cap(PbMode::Unknown)).is_err());
        let mut unknown = mount_cap(PbMode::SingleNodeWriter);
        unknown.access_mode = Some(vc::AccessMode { mode: 99 });
        assert!(VolumeCapability::try_from(unknown).is_err());
        let mut no_type = mount_cap(PbMode::SingleNodeWriter);
        no_type.access_type = None;
        assert_eq!(
            VolumeCapability::try_from(no_type),
            Err(ProtocolError::MissingField("access_type"))
        );
        let mut no_mode = mount_cap(PbMode::SingleNodeWriter);
        no_mode.access_mode = None;
        assert!(VolumeCapability::try_from(no_mode).is_err());
    }

    #[test]
    fn capacity_ranges_are_nonnegative_and_ordered() {
        let r = |required_bytes, limit_bytes| {
            CapacityRange::try_from(pb::CapacityRange {
                required_bytes,
                limit_bytes,
            })
        };
        assert_eq!(r(0, 0).unwrap(), CapacityRange::default());
        assert_eq!(
            r(5, 0).unwrap(),
            CapacityRange {
                required_bytes: Some(5),
                limit_bytes: None
            }
        );
        assert!(r(-1, 0).is_err());
        assert!(r(0, -1).is_err());
        assert!(r(10, 5).is_err());
        assert!(r(5, 5).is_ok());
    }

    #[test]
    fn requests_name_their_missing_fields() {
        let e = CreateVolumeRequest::try_from(pb::CreateVolumeRequest {
            name: "v".into(),
            ..Default::default()
        })
        .unwrap_err();
        assert_eq!(e, ProtocolError::MissingField("volume_capabilities"));
        let e = NodePublishVolumeRequest::try_from(pb::NodePublishVolumeRequest {
            volume_id: "v".into(),
            target_path: "relative/path".into(),
            volume_capability: Some(mount_cap(PbMode::SingleNodeWriter)),
            ..Default::default()
        })
        .unwrap_err();
        assert_eq!(e.field_path().as_deref(), Some("target_path"));
        let e = NodeStageVolumeRequest::try_from(pb::NodeStageVolumeRequest {
            volume_id: "v".into(),
            staging_target_path: "/a/../b".into(),
            volume_capability: Some(mount_cap(PbMode::SingleNodeWriter)),
            ..Default::default()
        })
        .unwrap_err();
        assert_eq!(e.field_path().as_deref(), Some("staging_target_path"));
        let e = ControllerExpandVolumeRequest::try_from(pb::ControllerExpandVolumeRequest {
            volume_id: "v".into(),
            capacity_range: Some(pb::CapacityRange::default()),
            ..Default::default()
        })
        .unwrap_err();
        assert_eq!(e, ProtocolError::MissingField("capacity_range"));
        let e = ListVolumesRequest::try_from(pb::ListVolumesRequest {
            max_entries: -1,
            starting_token: String::new(),
        })
        .unwrap_err();
        assert_eq!(e.field_path().as_deref(), Some("max_entries"));
        let big: std::collections::HashMap<String, String> =
            [("k".to_owned(), "v".repeat(5000))].into();
        let e = CreateVolumeRequest::try_from(pb::CreateVolumeRequest {
            name: "v".into(),
            volume_capabilities: vec![mount_cap(PbMode::SingleNodeWriter)],
            parameters: big,
            ..Default::default()
        })
        .unwrap_err();
        assert_eq!(e.field_path().as_deref(), Some("parameters"));
    }

    #[test]
    fn replies_clamp_sizes_to_int64() {
        let v = pb::Volume::from(Volume {
            volume_id: "v".into(),
            capacity_bytes: u64::MAX,
            volume_context: BTreeMap::new(),
        });
        assert_eq!(v.capacity_bytes, i64::MAX);
        let s = pb::NodeGetVolumeStatsResponse::from(VolumeStats {
            bytes: Usage {
                total: 100,
                used: 40,
                available: 60,
            },
            inodes: Usage {
                total: 10,
                used: 3,
                available: 7,
            },
        });
        assert_eq!(s.usage.len(), 2);
        assert_eq!(s.usage[0].unit, pb::volume_usage::Unit::Bytes as i32);
        assert_eq!((s.usage[1].total, s.usage[1].used), (10, 3));
    }
}
