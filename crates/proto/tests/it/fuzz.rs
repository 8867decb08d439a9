//! Fuzz-style property tests: arbitrary `sanfs.v1` messages (every field given an arbitrary
//! value, boundary values favoured) go through every `TryFrom`. A conversion must never
//! panic; when it refuses, the error names a field and maps to INVALID_ARGUMENT; when it
//! accepts, re-encoding the domain value and converting again gives the same value.
//!
//! Messages are generated from the protocol's own descriptor (prost-reflect), so a field
//! added to the .proto is fuzzed without touching this file; a Request or Reply message added
//! without a conversion fails `every_request_and_reply_is_converted`.
//!
//! proptest prints the failing seed; `SANFS_FUZZ_SEED=N` replays one seed over all targets.

use std::collections::BTreeSet;
use std::fmt::Debug;

use proptest::prelude::*;
use prost::Message;
use prost::bytes::Bytes;
use prost_reflect::{DescriptorPool, DynamicMessage, Kind, MessageDescriptor, Value};
use sanfs_blockmap::volume::{DeviceId, Segment, Volume, VolumeDevice};
use sanfs_proto::model::*;
use sanfs_proto::pb;
use sanfs_proto::types::*;
use tonic::{Code, Status};

/// How one message's bytes went through its conversion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Accepted,
    Rejected,
}

type Target = fn(&[u8]) -> Outcome;

/// Decodes `bytes` as `P` and converts it to `D`, checking the properties in the module doc.
fn target<P, D>(bytes: &[u8]) -> Outcome
where
    P: Message + Default + From<D>,
    D: TryFrom<P, Error = ProtocolError> + Clone + PartialEq + Debug,
{
    let Ok(p) = P::decode(bytes) else {
        // Raw fuzz bytes that are not a message at all: prost refuses them, nothing to check.
        return Outcome::Rejected;
    };
    match D::try_from(p) {
        Ok(d) => {
            let again = D::try_from(P::from(d.clone()))
                .unwrap_or_else(|e| panic!("{d:?} re-encoded is refused: {e}"));
            assert_eq!(again, d);
            Outcome::Accepted
        }
        Err(e) => {
            assert!(e.field_path().is_some(), "error names no field: {e}");
            let status = Status::from(e.clone());
            assert_eq!(status.code(), Code::InvalidArgument);
            Outcome::Rejected
        }
    }
}

macro_rules! targets {
    ($($pb:ident => $d:ty),* $(,)?) => {
        vec![$((concat!("sanfs.v1.", stringify!($pb)), target::<pb::$pb, $d> as Target)),*]
    };
}

/// Every message with a conversion, by full protobuf name.
fn targets() -> Vec<(&'static str, Target)> {
    targets![
        // common
        Credentials => Credentials,
        Timestamp => Timestamp,
        Attr => Attr,
        TimeSet => TimeSet,
        SetAttrChanges => SetAttr,
        DeviceId => DeviceId,
        // session
        OpenSessionRequest => OpenSessionRequest,
        ServerInfo => ServerInfo,
        OpenSessionReply => OpenSessionReply,
        CloseSessionRequest => SessionRef,
        Attach => SessionRef,
        SessionStreamRequest => ClientEvent,
        Recall => Recall,
        SessionStreamReply => ServerEvent,
        // namespace
        LookupRequest => EntryRequest,
        LookupReply => Attr,
        GetAttrRequest => GetAttrRequest,
        GetAttrReply => Attr,
        SetAttrRequest => SetAttrRequest,
        SetAttrReply => Attr,
        OpenFlags => OpenFlags,
        CreateRequest => CreateRequest,
        CreateReply => CreateReply,
        MkdirRequest => MkdirRequest,
        MkdirReply => Attr,
        MknodRequest => MknodRequest,
        MknodReply => Attr,
        UnlinkRequest => EntryRequest,
        RmdirRequest => EntryRequest,
        RenameRequest => RenameRequest,
        LinkRequest => LinkRequest,
        LinkReply => Attr,
        SymlinkRequest => SymlinkRequest,
        SymlinkReply => Attr,
        ReadlinkRequest => InodeRequest,
        ReadlinkReply => SymlinkTarget,
        ReadDirRequest => ReadDirRequest,
        DirEntry => DirEntry,
        ReadDirReply => ReadDirReply,
        StatFsRequest => InodeRequest,
        StatFsReply => StatFs,
        GetXattrRequest => XattrRequest,
        GetXattrReply => XattrValue,
        SetXattrRequest => SetXattrRequest,
        ListXattrRequest => InodeRequest,
        ListXattrReply => XattrNames,
        RemoveXattrRequest => XattrRequest,
        OpenRequest => OpenRequest,
        OpenReply => OpenReply,
        ReleaseRequest => HandleRef,
        AccessRequest => AccessRequest,
        ReserveInodesRequest => ReserveInodesRequest,
        ReserveInodesReply => ReserveInodesReply,
        CreateBatchRequest => CreateBatchRequest,
        CreateBatchReply => CreateBatchReply,
        CreateResult => CreateResult,
        ChangeBatchRequest => ChangeBatchRequest,
        ChangeBatchReply => ChangeBatchReply,
        // data
        MapRequest => MapRequest,
        DeviceIo => DeviceIo,
        Grant => Grant,
        ExtentError => ExtentError,
        CompleteRequest => CompleteRequest,
        CompleteReply => CompleteReply,
        ReplayRecord => ReplayRecord,
        ReplayWritesRequest => ReplayWritesRequest,
        ReplayWritesReply => ReplayWritesReply,
        ReturnGrantRequest => ReturnGrantRequest,
        ReadRequest => ReadRequest,
        ReadReply => ReadReply,
        WriteRequest => WriteRequest,
        WriteReply => WriteReply,
        FsyncRequest => FsyncRequest,
        DelegateRequest => DelegateRequest,
        DelegateReply => DelegateReply,
        FallocateRequest => FallocateRequest,
        FallocateReply => Attr,
        GetExtentsRequest => GetExtentsRequest,
        ExtentMapping => ExtentMapping,
        GetExtentsReply => GetExtentsReply,
        // admin
        VolumeDevice => VolumeDevice,
        Segment => Segment,
        Volume => Volume,
        GetVolumeReply => VolumeInfo,
        GrowVolumeRequest => GrowVolumeRequest,
        GrowVolumeReply => GrowVolumeReply,
        BackupStoreRequest => BackupStoreRequest,
        BackupStoreReply => BackupStoreReply,
        SessionSummary => SessionSummary,
        ServerStatusReply => ServerStatus,
        QuotaInfo => QuotaInfo,
        SetQuotaRequest => SetQuotaRequest,
        SetQuotaReply => QuotaInfo,
        GetQuotaRequest => InodeRequest,
        GetQuotaReply => QuotaInfo,
        ListQuotasReply => QuotaList,
        EvictSessionRequest => EvictSessionRequest,
        EvictSessionReply => EvictSessionReply,
        // locks
        FileLock => FileLock,
        LockRequest => LockRequest,
        GetLockReply => GetLockReply,
    ]
}

fn pool() -> DescriptorPool {
    DescriptorPool::decode(pb::FILE_DESCRIPTOR_SET).unwrap()
}

/// splitmix64: small, seedable, good enough to pick field values.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn percent(&mut self, p: u64) -> bool {
        self.next() % 100 < p
    }

    fn pick<T: Clone>(&mut self, items: &[T]) -> T {
        items[self.below(items.len())].clone()
    }
}

const U64S: &[u64] = &[
    0,
    1,
    2,
    3,
    4,
    5,
    7,
    8,
    255,
    256,
    511,
    512,
    4095,
    4096,
    4097,
    8192,
    65536,
    1 << 20,
    8 << 20,
    (8 << 20) + 1,
    999_999_999,
    1_000_000_000,
    u32::MAX as u64,
    i64::MAX as u64,
    i64::MAX as u64 + 1,
    u64::MAX - 1,
    u64::MAX,
];

fn any_u64(rng: &mut Rng) -> u64 {
    match rng.below(4) {
        0 => rng.next(),
        1 => (rng.next() % (1 << 18)) * 4096,
        _ => rng.pick(U64S),
    }
}

fn any_u32(rng: &mut Rng) -> u32 {
    match rng.below(4) {
        0 => rng.next() as u32,
        1 => rng.pick(&[0o644, 0o7777, 0o10000, 4096, 100]),
        _ => {
            let v = any_u64(rng);
            u32::try_from(v).unwrap_or(u32::MAX)
        }
    }
}

fn any_i64(rng: &mut Rng) -> i64 {
    let random = rng.next() as i64;
    rng.pick(&[0, 1, -1, i64::MIN, i64::MAX, 1_700_000_000, random])
}

fn any_i32(rng: &mut Rng) -> i32 {
    let random = rng.next() as i32;
    rng.pick(&[0, 1, 5, -1, 4095, 4096, i32::MIN, i32::MAX, random])
}

fn any_string(rng: &mut Rng) -> String {
    match rng.below(8) {
        0 => String::new(),
        1 => "x".repeat(255),
        2 => "x".repeat(256),
        3 => "aaaaaa-aaaa-aaaa-aaaa-aaaa-aaaa-aaaaaa".into(),
        4 => "m".repeat(4097),
        5 => "\u{fc}n\u{ef}".into(),
        _ => "node-a".into(),
    }
}

fn any_bytes(rng: &mut Rng) -> Bytes {
    let v: Vec<u8> = match rng.below(14) {
        0 => vec![],
        1 => b".".to_vec(),
        2 => b"..".to_vec(),
        3 => b"a/b".to_vec(),
        4 => b"a\0".to_vec(),
        5 => vec![b'x'; 255],
        6 => vec![b'x'; 256],
        7 => vec![0; 16],
        8 => (0..16).map(|_| rng.next() as u8).collect(),
        9 => (0..rng.below(40)).map(|_| rng.next() as u8).collect(),
        10 => vec![b'x'; 4097],
        11 if rng.percent(10) => vec![b'v'; 65537],
        _ => b"f".to_vec(),
    };
    Bytes::from(v)
}

fn any_value(kind: &Kind, rng: &mut Rng, depth: u32) -> Value {
    match kind {
        Kind::Uint64 | Kind::Fixed64 => Value::U64(any_u64(rng)),
        Kind::Uint32 | Kind::Fixed32 => Value::U32(any_u32(rng)),
        Kind::Int64 | Kind::Sint64 | Kind::Sfixed64 => Value::I64(any_i64(rng)),
        Kind::Int32 | Kind::Sint32 | Kind::Sfixed32 => Value::I32(any_i32(rng)),
        Kind::Bool => Value::Bool(rng.percent(50)),
        Kind::String => Value::String(any_string(rng)),
        Kind::Bytes => Value::Bytes(any_bytes(rng)),
        Kind::Double => Value::F64(0.0),
        Kind::Float => Value::F32(0.0),
        Kind::Enum(e) => {
            let known: Vec<i32> = e.values().map(|v| v.number()).filter(|&n| n != 0).collect();
            if rng.percent(85) && !known.is_empty() {
                Value::EnumNumber(rng.pick(&known))
            } else {
                Value::EnumNumber(rng.pick(&[0, 99, -1, i32::MAX]))
            }
        }
        Kind::Message(m) => Value::Message(any_message(m, rng, depth + 1)),
    }
}

/// A message with arbitrary values: each real oneof gets one member (or none), optional and
/// message fields are present 85% of the time, lists get 0 to 3 elements.
fn any_message(desc: &MessageDescriptor, rng: &mut Rng, depth: u32) -> DynamicMessage {
    let mut msg = DynamicMessage::new(desc.clone());
    if depth > 6 {
        return msg;
    }
    for oneof in desc.oneofs().filter(|o| !o.is_synthetic()) {
        let members: Vec<_> = oneof.fields().collect();
        if rng.percent(90) {
            let field = rng.pick(&members);
            let v = any_value(&field.kind(), rng, depth);
            msg.set_field(&field, v);
        }
    }
    for field in desc.fields() {
        if field.containing_oneof().is_some_and(|o| !o.is_synthetic()) {
            continue;
        }
        if field.is_list() {
            let n = rng.pick(&[0, 0, 1, 1, 2, 3]);
            let items = (0..n)
                .map(|_| any_value(&field.kind(), rng, depth))
                .collect();
            msg.set_field(&field, Value::List(items));
        } else if field.supports_presence() {
            if rng.percent(85) {
                let v = any_value(&field.kind(), rng, depth);
                msg.set_field(&field, v);
            }
        } else {
            let v = any_value(&field.kind(), rng, depth);
            msg.set_field(&field, v);
        }
    }
    msg
}

/// A seed per target, so that one proptest seed exercises different values everywhere.
fn seed_for(seed: u64, name: &str) -> u64 {
    name.bytes().fold(seed, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01B3)
    })
}

fn run_all(seed: u64) -> Vec<(&'static str, Outcome)> {
    let pool = pool();
    targets()
        .into_iter()
        .map(|(name, f)| {
            let desc = pool.get_message_by_name(name).unwrap();
            let mut rng = Rng(seed_for(seed, name));
            let bytes = any_message(&desc, &mut rng, 0).encode_to_vec();
            (name, f(&bytes))
        })
        .collect()
}

#[test]
fn every_request_and_reply_is_converted() {
    let pool = pool();
    let converted: BTreeSet<&str> = targets().iter().map(|t| t.0).collect();
    for name in &converted {
        assert!(
            pool.get_message_by_name(name).is_some(),
            "{name} is not in the .proto"
        );
    }
    let mut missing = Vec::new();
    for m in pool.all_messages() {
        let name = m.full_name();
        let is_rpc = name.ends_with("Request") || name.ends_with("Reply");
        if is_rpc && m.fields().len() > 0 && !converted.contains(name) {
            missing.push(name.to_owned());
        }
    }
    assert!(missing.is_empty(), "no checked conversion for {missing:?}");
}

/// The generator reaches the accepting path of most conversions, so the round-trip property
/// is exercised and not just the rejections. (Whole volumes and grants are rarely valid by
/// chance; their accepting paths are covered by the round-trip tests.)
#[test]
fn the_fuzzer_reaches_valid_messages() {
    let n = targets().len();
    let mut accepted = vec![0u32; n];
    let seeds = 300u64;
    for seed in 0..seeds {
        for (i, (_, outcome)) in run_all(seed).into_iter().enumerate() {
            if outcome == Outcome::Accepted {
                accepted[i] += 1;
            }
        }
    }
    let never: Vec<_> = targets()
        .iter()
        .zip(&accepted)
        .filter(|(_, a)| **a == 0)
        .map(|(t, _)| t.0)
        .collect();
    let reached = n - never.len();
    println!(
        "{reached}/{n} conversions accepted at least one of {seeds} messages; never: {never:?}"
    );
    assert!(
        reached * 10 >= n * 8,
        "only {reached}/{n} reached; never: {never:?}"
    );
}

#[test]
fn replay_one_seed() {
    let seed = std::env::var("SANFS_FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5A4F_5300);
    println!("SANFS_FUZZ_SEED={seed}");
    run_all(seed);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn arbitrary_messages_never_panic(seed in any::<u64>()) {
        run_all(seed);
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
        for (_, f) in targets() {
            f(&bytes);
        }
    }
}

// Keep the blockmap types named above in use when a target list changes.
const _: fn(DeviceId, Segment, Volume, VolumeDevice) = |_, _, _, _| {};
