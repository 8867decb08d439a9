//! FsError <-> tonic::Status: every variant survives the round trip with its errno, and
//! statuses from elsewhere (transport, other peers) still map to a sensible errno.

use sanfs_proto::status::*;
use sanfs_proto::types::*;
use tonic::metadata::MetadataValue;
use tonic::{Code, Status};

/// The status as the agent receives it: encoded into HTTP/2 trailers and decoded again.
fn over_the_wire(status: &Status) -> Status {
    let mut headers = tonic::codegen::http::HeaderMap::new();
    status.add_header(&mut headers).unwrap();
    Status::from_header_map(&headers).unwrap()
}

fn every_fs_error() -> Vec<FsError> {
    vec![
        FsError::NotFound,
        FsError::Exists,
        FsError::NotDir,
        FsError::IsDir,
        FsError::NotEmpty,
        FsError::Access,
        FsError::Perm,
        FsError::NameTooLong,
        FsError::Invalid("offset 3 is not block aligned".into()),
        FsError::NoSpace,
        FsError::QuotaExceeded,
        FsError::TooManyLinks,
        FsError::FileTooBig,
        FsError::NoAttr,
        FsError::Range,
        FsError::NotSymlink,
        FsError::Stale,
        FsError::StaleSession,
        FsError::LockTimeout,
        FsError::Io("d1: read at 4096: EIO".into()),
        FsError::NotSupported,
        FsError::CrossDevice,
        FsError::WouldBlock,
        FsError::Interrupted,
    ]
}

#[test]
fn every_fs_error_round_trips_with_its_errno() {
    let errors = every_fs_error();
    for e in &errors {
        let status = Status::from(e.clone());
        assert_eq!(status.code(), code_of(e), "{e:?}");
        assert_eq!(errno_of(&status), Some(e.errno()), "{e:?}");
        assert!(is_server_error(&status));
        assert_eq!(&fs_error_from_status(&status), e);
        // Through the HTTP/2 header encoding too, as the agent receives it.
        let wire = over_the_wire(&status);
        assert_eq!(&fs_error_from_status(&wire), e, "over the wire");
        assert_eq!(errno_of(&wire), Some(e.errno()));
    }
    // Every kind is distinct, so errors that share an errno stay apart.
    let mut kinds: Vec<_> = errors.iter().map(kind_of).collect();
    kinds.sort_unstable();
    kinds.dedup();
    assert_eq!(kinds.len(), errors.len());
    assert_eq!(FsError::Stale.errno(), FsError::StaleSession.errno());
}

#[test]
fn non_ascii_detail_survives_the_wire() {
    let e = FsError::Invalid("name \u{e9}\u{1F600} refused".into());
    let status = Status::from(e.clone());
    let wire = over_the_wire(&status);
    assert_eq!(fs_error_from_status(&wire), e);
}

#[test]
fn the_exact_grpc_codes() {
    let expect = [
        (FsError::NotFound, Code::NotFound),
        (FsError::Exists, Code::AlreadyExists),
        (FsError::NotEmpty, Code::FailedPrecondition),
        (FsError::Access, Code::PermissionDenied),
        (FsError::Invalid(String::new()), Code::InvalidArgument),
        (FsError::NoSpace, Code::ResourceExhausted),
        (FsError::FileTooBig, Code::OutOfRange),
        (FsError::StaleSession, Code::FailedPrecondition),
        (FsError::LockTimeout, Code::Aborted),
        (FsError::WouldBlock, Code::FailedPrecondition),
        (FsError::Io(String::new()), Code::Internal),
        (FsError::NotSupported, Code::Unimplemented),
    ];
    for (e, code) in expect {
        assert_eq!(Status::from(e).code(), code);
    }
}

#[test]
fn protocol_errors_are_invalid_argument_naming_the_field() {
    let e = ProtocolError::InvalidField {
        field: "nsec",
        reason: "1000000000 is not below 10^9".into(),
    }
    .in_field("atime")
    .in_field("changes");
    let status = Status::from(e.clone());
    assert_eq!(status.code(), Code::InvalidArgument);
    assert_eq!(field_of(&status), Some("changes.atime.nsec"));
    assert!(status.message().contains("nsec"), "{}", status.message());
    assert_eq!(errno_of(&status), Some(22));
    assert_eq!(fs_error_from_status(&status), FsError::from(e));

    let e = ProtocolError::NameTooLong(256).in_field("name");
    let status = Status::from(e);
    assert_eq!(status.code(), Code::InvalidArgument);
    assert_eq!(field_of(&status), Some("name"));
    assert_eq!(errno_of(&status), Some(36));
    assert_eq!(fs_error_from_status(&status), FsError::NameTooLong);

    let e = ProtocolError::RangeOverflow {
        offset: u64::MAX,
        len: 1,
    }
    .in_field("range");
    let status = Status::from(e);
    assert_eq!(errno_of(&status), Some(27));
    assert_eq!(fs_error_from_status(&status), FsError::FileTooBig);

    let status = Status::from(ProtocolError::MissingField("cred"));
    assert_eq!(field_of(&status), Some("cred"));
}

#[test]
fn statuses_without_sanfs_metadata() {
    let cases = [
        (Status::unavailable("connection refused"), "Io"),
        (Status::deadline_exceeded("timeout"), "Io"),
        (Status::cancelled("gone"), "Io"),
        (Status::internal("x"), "Io"),
        (Status::not_found("x"), "NotFound"),
        (Status::already_exists("x"), "Exists"),
        (Status::permission_denied("x"), "Access"),
        (Status::unauthenticated("x"), "Access"),
        (Status::invalid_argument("x"), "Invalid"),
        (Status::resource_exhausted("x"), "NoSpace"),
        (Status::unimplemented("x"), "NotSupported"),
        (Status::aborted("x"), "LockTimeout"),
        (Status::out_of_range("x"), "Range"),
    ];
    for (status, want) in cases {
        assert!(!is_server_error(&status));
        let got = format!("{:?}", fs_error_from_status(&status));
        assert!(got.starts_with(want), "{status:?} -> {got}");
    }
    let e = fs_error_from_status(&Status::unavailable("connection refused"));
    assert_eq!(e.errno(), 5);
    assert!(e.to_string().contains("connection refused"));
}

#[test]
fn errno_only_and_unknown_kinds_fall_back() {
    let mut s = Status::new(Code::Unknown, "m");
    s.metadata_mut()
        .insert(ERRNO_KEY, MetadataValue::from_static("39"));
    assert_eq!(fs_error_from_status(&s), FsError::NotEmpty);
    // A kind this version does not know falls back to the errno.
    s.metadata_mut()
        .insert(ERROR_KIND_KEY, MetadataValue::from_static("brand_new"));
    assert_eq!(fs_error_from_status(&s), FsError::NotEmpty);
    // An errno with no variant of its own is an I/O error that keeps the number.
    let mut s = Status::new(Code::Unknown, "m");
    s.metadata_mut()
        .insert(ERRNO_KEY, MetadataValue::from_static("71"));
    let e = fs_error_from_status(&s);
    assert_eq!(e.errno(), 5);
    assert!(e.to_string().contains("errno 71"));
    // Garbage in the errno is ignored, the code decides.
    let mut s = Status::new(Code::NotFound, "m");
    s.metadata_mut()
        .insert(ERRNO_KEY, MetadataValue::from_static("ENOENT"));
    assert_eq!(fs_error_from_status(&s), FsError::NotFound);
}
