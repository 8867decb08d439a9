//! Copying a store table by table: an online backup of the live store into a new redb file
//! ([`Store::backup`]), and the copy of a backup into a configured store ([`install`], for
//! `sanfs-mds restore`, which checks the backup first: `crate::backup`).
//!
//! A backup is a plain redb file of the same tables as a live store, plus one record, the
//! `backup` key of the `super` table ([`BackupRecord`]), saying what it is. It is copied from
//! one read transaction (MVCC: commits go on meanwhile, and the copy holds exactly the changes
//! committed before the transaction began), into a file of a temporary name in the target's
//! directory, committed (fsync), renamed to the target (without `force` with `RENAME_NOREPLACE`, which
//! fails if the target appeared meanwhile), and the directory synced. A failure removes the
//! temporary file: nothing half-written is left under the target's name.

use std::path::{Path, PathBuf};

use redb::{ReadTransaction, TableHandle, WriteTransaction};

use super::*;
use records::BackupRecord;

/// The key of the [`BackupRecord`] in a backup's [`SUPER`] table.
pub const KEY_BACKUP: &str = "backup";

/// What a backup holds, as [`Store::backup`] reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackupInfo {
    pub record: BackupRecord,
    pub inodes: u64,
    pub size_bytes: u64,
    pub path: PathBuf,
}

/// Every table a store may hold: a table not listed here is refused by the copy rather than
/// silently left out.
const TABLE_NAMES: [&str; 14] = [
    "super", "counters", "inodes", "dirents", "cookies", "extents", "free", "xattrs", "orphans",
    "prealloc", "unzeroed", "quotas", "replies", "sessions",
];

/// A copy's failure: `source` for the store read from, otherwise the file written.
fn copy_error(e: impl Into<redb::Error>) -> FsError {
    match e.into() {
        redb::Error::Io(e) => io_error(&e, "write the copy"),
        other => FsError::Io(format!("copy the metadata store: {other}")),
    }
}

/// An I/O error of the target as the errno a caller can act on.
pub fn io_error(e: &std::io::Error, what: &str) -> FsError {
    use std::io::ErrorKind as K;
    match e.kind() {
        K::StorageFull | K::QuotaExceeded => FsError::NoSpace,
        K::AlreadyExists => FsError::Exists,
        K::PermissionDenied => FsError::Access,
        K::ReadOnlyFilesystem => FsError::Perm,
        K::NotFound => FsError::NotFound,
        K::NotADirectory => FsError::NotDir,
        K::IsADirectory => FsError::IsDir,
        K::InvalidFilename => FsError::NameTooLong,
        _ => FsError::Io(format!("{what}: {e}")),
    }
}

fn copy_table<K: redb::Key + 'static, V: redb::Value + 'static>(
    r: &ReadTransaction,
    w: &WriteTransaction,
    def: TableDefinition<'_, K, V>,
) -> Result<u64, FsError> {
    let src = match r.open_table(def) {
        Ok(t) => t,
        Err(redb::TableError::TableDoesNotExist(_)) => return Ok(0),
        Err(e) => return Err(copy_error(e)),
    };
    let mut dst = w.open_table(def).map_err(copy_error)?;
    let mut n = 0u64;
    for item in src.iter().map_err(copy_error)? {
        let (k, v) = item.map_err(copy_error)?;
        dst.insert(k.value(), v.value()).map_err(copy_error)?;
        n += 1;
    }
    Ok(n)
}

/// Copies every table of `r` into `w` (the [`KEY_BACKUP`] record too: the caller adds or
/// removes it). Refuses a source with a table this server does not know.
pub(crate) fn copy_tables(r: &ReadTransaction, w: &WriteTransaction) -> Result<(), FsError> {
    for t in r.list_tables().map_err(copy_error)? {
        if !TABLE_NAMES.contains(&t.name()) {
            return Err(FsError::Io(format!(
                "the store holds a table {:?} this server does not know: not copied",
                t.name()
            )));
        }
    }
    if r.list_multimap_tables()
        .map_err(copy_error)?
        .next()
        .is_some()
    {
        return Err(FsError::Io(
            "the store holds a multimap table this server does not know: not copied".into(),
        ));
    }
    copy_table(r, w, SUPER)?;
    copy_table(r, w, COUNTERS)?;
    copy_table(r, w, INODES)?;
    copy_table(r, w, DIRENTS)?;
    copy_table(r, w, COOKIES)?;
    copy_table(r, w, EXTENTS)?;
    copy_table(r, w, FREE)?;
    copy_table(r, w, XATTRS)?;
    copy_table(r, w, ORPHANS)?;
    copy_table(r, w, PREALLOC)?;
    copy_table(r, w, UNZEROED)?;
    copy_table(r, w, QUOTAS)?;
    copy_table(r, w, REPLIES)?;
    copy_table(r, w, SESSIONS)?;
    Ok(())
}

/// The [`BackupRecord`] of a store (`None` in a live store).
pub fn backup_record(r: &ReadTransaction) -> Result<Option<BackupRecord>, StoreError> {
    let sup = r.open_table(SUPER)?;
    match sup.get(KEY_BACKUP)? {
        None => Ok(None),
        Some(v) => BackupRecord::decode(v.value())
            .map(Some)
            .map_err(|e| StoreError::Corrupt(format!("backup record: {e}"))),
    }
}

/// The superblock of a store.
pub fn superblock(r: &ReadTransaction) -> Result<Superblock, StoreError> {
    let sup = r.open_table(SUPER)?;
    let v = sup
        .get(KEY_SUPER)?
        .ok_or_else(|| StoreError::Corrupt("no super record".into()))?;
    Superblock::decode(v.value()).map_err(|e| StoreError::Corrupt(format!("super record: {e}")))
}

/// The volume recorded in a store.
pub fn volume_of(r: &ReadTransaction) -> Result<Volume, StoreError> {
    let sup = r.open_table(SUPER)?;
    let v = sup
        .get(KEY_VOLUME)?
        .ok_or_else(|| StoreError::Corrupt("no volume record".into()))?;
    codec::decode_volume(v.value()).map_err(|e| StoreError::Corrupt(format!("volume record: {e}")))
}

/// The start count recorded in a store (0 if none).
pub fn boot_epoch_of(r: &ReadTransaction) -> Result<u64, StoreError> {
    let counters = r.open_table(COUNTERS)?;
    Ok(counters.get(KEY_BOOT_EPOCH)?.map_or(0, |v| v.value()))
}

/// How many times the store of `r` was restored from a backup (0: never).
pub fn restores_of(r: &ReadTransaction) -> Result<u64, StoreError> {
    let counters = r.open_table(COUNTERS)?;
    Ok(counters.get(KEY_RESTORES)?.map_or(0, |v| v.value()))
}

/// A new redb database in an empty file.
fn new_file_db(file: std::fs::File) -> Result<Database, FsError> {
    let backend = redb::backends::FileBackend::new(file).map_err(copy_error)?;
    Database::builder()
        .create_with_backend(backend)
        .map_err(copy_error)
}

/// A temporary file removed on drop unless kept.
struct TempFile(Option<PathBuf>);

impl TempFile {
    fn keep(mut self) {
        self.0 = None;
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// A new file of a temporary name beside `target` (mode 0600), and its path.
fn temp_beside(target: &Path) -> Result<(std::fs::File, TempFile), FsError> {
    use std::os::unix::fs::OpenOptionsExt;
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let dir = target.parent().unwrap_or(Path::new("/"));
    let name = target
        .file_name()
        .ok_or_else(|| FsError::Invalid(format!("{} names no file", target.display())))?;
    let tmp = dir.join(format!(
        ".{}.tmp-{}-{}",
        name.to_string_lossy(),
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(|e| io_error(&e, &format!("create {}", tmp.display())))?;
    Ok((file, TempFile(Some(tmp))))
}

/// Puts the finished temporary file at `target` (replacing a file there only with `force`)
/// and syncs the directory.
fn install_file(tmp: TempFile, target: &Path, force: bool) -> Result<(), FsError> {
    let Some(from) = tmp.0.clone() else {
        return Err(FsError::Io("the copy is gone".into()));
    };
    let what = |e: &std::io::Error| io_error(e, &format!("install {}", target.display()));
    std::fs::File::open(&from)
        .and_then(|f| f.sync_all())
        .map_err(|e| what(&e))?;
    if force {
        std::fs::rename(&from, target).map_err(|e| what(&e))?;
    } else {
        // Fails with EEXIST if the target appeared since it was checked.
        rustix::fs::renameat_with(
            rustix::fs::CWD,
            &from,
            rustix::fs::CWD,
            target,
            rustix::fs::RenameFlags::NOREPLACE,
        )
        .map_err(|e| what(&std::io::Error::from(e)))?;
    }
    tmp.keep();
    let dir = target.parent().unwrap_or(Path::new("/"));
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| io_error(&e, &format!("sync the directory {}", dir.display())))
}

impl Store {
    /// Writes a consistent copy of every acknowledged change to a new redb file at `target`
    /// (absolute, in a directory that exists; an existing file only with `force`), from one
    /// read snapshot while the store keeps committing. See the module's doc.
    pub fn backup(
        &self,
        target: &Path,
        force: bool,
        taken_at: Timestamp,
        server_version: &str,
    ) -> Result<BackupInfo, FsError> {
        if !target.is_absolute() {
            return Err(FsError::Invalid(format!(
                "{} is not an absolute path",
                target.display()
            )));
        }
        match std::fs::symlink_metadata(target) {
            Ok(m) if m.is_dir() => return Err(FsError::IsDir),
            Ok(_) if !force => return Err(FsError::Exists),
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(io_error(&e, &format!("look at {}", target.display()))),
        }
        let (file, tmp) = temp_beside(target)?;
        let fs_uuid = self.sb.fs_uuid;
        let (record, inodes) = self.snapshot(|r| {
            let counters = r.open_table(COUNTERS)?;
            let get =
                |k: &str| -> Result<u64, OpError> { Ok(counters.get(k)?.map_or(0, |v| v.value())) };
            let record = BackupRecord {
                fs_uuid,
                boot_epoch: get(KEY_BOOT_EPOCH)?,
                commit_epoch: get(KEY_LAST_COMMIT_EPOCH)?,
                commit_seq: get(KEY_LAST_COMMIT)?,
                taken_at,
                server_version: server_version.to_owned(),
            };
            let inodes = r.open_table(INODES)?.len()?;
            let db = new_file_db(file).map_err(OpError::Fs)?;
            let w = db.begin_write().map_err(|e| OpError::Fs(copy_error(e)))?;
            copy_tables(r, &w)?;
            w.open_table(SUPER)
                .and_then(|mut sup| {
                    sup.insert(KEY_BACKUP, record.encode().as_slice())?;
                    Ok(())
                })
                .map_err(|e| OpError::Fs(copy_error(e)))?;
            w.commit().map_err(|e| OpError::Fs(copy_error(e)))?;
            drop(db);
            Ok((record, inodes))
        })?;
        install_file(tmp, target, force)?;
        let size_bytes = std::fs::metadata(target)
            .map_err(|e| io_error(&e, "size of the backup"))?
            .len();
        Ok(BackupInfo {
            record,
            inodes,
            size_bytes,
            path: target.to_owned(),
        })
    }
}

/// Copies the store read by `r` (a checked backup) into `target`, without its backup record
/// and with the start count set to `boot_epoch`: a file store is written beside the target and
/// renamed over it; a store on a block device is written in place (initialised first). The
/// caller has checked that the target may be replaced.
pub fn install(
    r: &ReadTransaction,
    target: &Backend,
    boot_epoch: u64,
    restores: u64,
) -> Result<(), FsError> {
    let fill = |db: &Database| -> Result<(), FsError> {
        let w = db.begin_write().map_err(copy_error)?;
        copy_tables(r, &w)?;
        {
            let mut sup = w.open_table(SUPER).map_err(copy_error)?;
            sup.remove(KEY_BACKUP).map_err(copy_error)?;
            let mut counters = w.open_table(COUNTERS).map_err(copy_error)?;
            counters
                .insert(KEY_BOOT_EPOCH, boot_epoch)
                .map_err(copy_error)?;
            counters
                .insert(KEY_RESTORES, restores)
                .map_err(copy_error)?;
        }
        w.commit().map_err(copy_error)
    };
    match target {
        Backend::File(path) => {
            let (file, tmp) = temp_beside(path)?;
            let db = new_file_db(file)?;
            fill(&db)?;
            drop(db);
            install_file(tmp, path, true)?;
            // The journal of the store replaced is not the new one's (it would be ignored
            // anyway: it names the old file).
            super::db::remove_if_present(&super::journal::journal_path(path))
                .map_err(|e| io_error(&e, "remove the replaced store's journal"))
        }
        Backend::Device(_) | Backend::FencedDevice(..) | Backend::Sim(_) => {
            let db = open_db(target, true, true, Verify::Trust).map_err(|e| match e {
                StoreError::Io(e) => io_error(&e, "open the metadata device"),
                other => FsError::Io(other.to_string()),
            })?;
            fill(&db)
        }
    }
}
