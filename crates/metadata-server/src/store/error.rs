//! The store's errors: a job's ([`OpError`]) and an open's ([`StoreError`]), and the guard
//! that turns a panic of the storage library on damaged bytes into an error.

use super::*;

/// Why a job failed: a file-system answer for the caller, or a storage failure that poisons
/// the store.
#[derive(Debug)]
pub enum OpError {
    Fs(FsError),
    Store(String),
}

impl From<FsError> for OpError {
    fn from(e: FsError) -> OpError {
        OpError::Fs(e)
    }
}

macro_rules! store_errors {
    ($($t:ty),*) => {$(
        impl From<$t> for OpError {
            fn from(e: $t) -> OpError {
                OpError::Store(e.to_string())
            }
        }
    )*};
}
store_errors!(
    redb::StorageError,
    redb::TableError,
    redb::TransactionError,
    redb::CommitError,
    redb::DatabaseError
);

/// A record that does not decode: the operation fails with EIO, the store stays up.
pub fn corrupt(what: impl std::fmt::Display, e: impl std::fmt::Display) -> OpError {
    OpError::Fs(FsError::Io(format!("corrupt metadata: {what}: {e}")))
}

/// Errors of opening or creating a store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("metadata store: {0}")]
    Redb(String),
    #[error("metadata store is corrupt: {0}")]
    Corrupt(String),
    #[error("metadata store at {0} already exists (use --force to replace it)")]
    Exists(PathBuf),
    #[error("metadata store I/O: {0}")]
    Io(#[from] std::io::Error),
    /// The storage library failed (panicked) on the store's bytes: the image is damaged.
    #[error("metadata store damaged: {0}")]
    Damaged(String),
    /// The store was not shut down cleanly and a read-only open cannot read it as it is.
    #[error(
        "metadata store needs repair (it was not shut down cleanly); nothing was changed: \
         run `sanfs-mds fsck --repair` (or start the server, which repairs it on open)"
    )]
    NeedsRepair,
    /// Another process (a running server) holds the store's lock.
    #[error(
        "metadata store is in use (another process, such as a running sanfs-mds serve, holds \
         its lock): stop that server first"
    )]
    InUse,
}

impl StoreError {
    /// From an error of opening the database (read-only or not).
    fn from_open(e: redb::DatabaseError) -> StoreError {
        match e {
            redb::DatabaseError::DatabaseAlreadyOpen => StoreError::InUse,
            redb::DatabaseError::RepairAborted => StoreError::NeedsRepair,
            redb::DatabaseError::Storage(e) => StoreError::from(e),
            other => StoreError::Redb(other.to_string()),
        }
    }
}

/// Runs `f` (an open, a repair, a full read of the store) so that a panic of the storage
/// library on damaged bytes becomes [`StoreError::Damaged`] instead of taking the process
/// down. redb 4 panics on some torn images (assertions and slice bounds in its page and
/// B-tree code, see docs/operations.md, "Damaged stores"); a failure of ours would be a bug,
/// but it is caught the same way. The panic message is printed by the panic hook (no abort:
/// the profile unwinds) and carried in the error.
pub fn guard_damage<T>(
    what: &str,
    f: impl FnOnce() -> Result<T, StoreError>,
) -> Result<T, StoreError> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(payload) => {
            let msg = payload
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".to_owned());
            Err(StoreError::Damaged(format!(
                "{what}: the storage library failed on the store's bytes ({msg})"
            )))
        }
    }
}

impl From<OpError> for StoreError {
    fn from(e: OpError) -> StoreError {
        match e {
            OpError::Fs(e) => StoreError::Corrupt(e.to_string()),
            OpError::Store(s) => StoreError::Redb(s),
        }
    }
}

macro_rules! store_open_errors {
    ($($t:ty),*) => {$(
        impl From<$t> for StoreError {
            fn from(e: $t) -> StoreError {
                StoreError::Redb(e.to_string())
            }
        }
    )*};
}
store_open_errors!(redb::TableError, redb::TransactionError, redb::CommitError);

impl From<redb::StorageError> for StoreError {
    fn from(e: redb::StorageError) -> StoreError {
        match e {
            redb::StorageError::Corrupted(why) => StoreError::Damaged(why),
            other => StoreError::Redb(other.to_string()),
        }
    }
}

impl From<redb::DatabaseError> for StoreError {
    fn from(e: redb::DatabaseError) -> StoreError {
        StoreError::from_open(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_inside_the_guard_is_a_damaged_store_error() {
        let r: Result<(), StoreError> = guard_damage("open the metadata store", || {
            let bytes: &[u8] = &[1, 2];
            // A slice index past the end, as redb's B-tree code does on a torn page.
            let end = bytes.len() + usize::from(bytes[0]);
            drop(bytes[..end].to_vec());
            Ok(())
        });
        let e = r.unwrap_err();
        assert!(matches!(e, StoreError::Damaged(_)), "{e}");
        assert!(
            e.to_string()
                .starts_with("metadata store damaged: open the metadata store")
        );
        assert!(e.to_string().contains("range end index 3"), "{e}");
        assert!(guard_damage("x", || Ok::<_, StoreError>(7)).unwrap() == 7);
        assert!(matches!(
            guard_damage("x", || Err::<(), _>(StoreError::InUse)),
            Err(StoreError::InUse)
        ));
    }
}
