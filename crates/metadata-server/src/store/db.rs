//! Opening the database on its backend (file, block device, crash-simulating disk), and
//! loading what the committer keeps in memory.

use super::device::open_device;
use super::journal;
use super::*;

/// How an existing store is opened read-write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verify {
    /// Trust a cleanly closed store as it is (redb's plain open; recovery only after a crash).
    Trust,
    /// Verify the checksum of every page of the committed trees and rebuild the allocator
    /// state at every open (redb's integrity check on open): a store altered outside redb (a
    /// torn image, a bad restore) is refused as corrupt instead of trusted, where a plain open
    /// may panic or serve garbage. The server's open does this.
    Pages,
}

fn builder(verify: Verify) -> redb::Builder {
    let mut b = Database::builder();
    b.set_check_integrity_on_open(verify == Verify::Pages);
    b.set_repair_callback(move |session| {
        if verify == Verify::Pages {
            tracing::debug!(
                progress = session.progress(),
                "metadata store: verifying page checksums"
            );
        } else {
            tracing::warn!(
                progress = session.progress(),
                "metadata store: repairing after an unclean shutdown"
            );
        }
    });
    b
}

pub(crate) fn open_db(
    backend: &Backend,
    create: bool,
    force: bool,
    verify: Verify,
) -> Result<Database, StoreError> {
    Ok(open_db_journaled(backend, create, force, verify)?.0)
}

/// [`open_db`], and for a file store the handle that holds its journal's syncs during one
/// commit (`journal::SyncHolder`: one sync per durable commit instead of redb's two).
pub(crate) fn open_db_journaled(
    backend: &Backend,
    create: bool,
    force: bool,
    verify: Verify,
) -> Result<(Database, Option<journal::SyncHolder>), StoreError> {
    let b = builder(verify);
    Ok(match backend {
        Backend::File(path) => {
            let jpath = journal::journal_path(path);
            if create && path.exists() && std::fs::metadata(path)?.len() > 0 {
                if !force {
                    return Err(StoreError::Exists(path.clone()));
                }
                std::fs::remove_file(path)?;
            }
            if create {
                // A journal left by an earlier store here is not this one's.
                remove_if_present(&jpath)?;
            } else if !path.exists() || std::fs::metadata(path)?.len() == 0 {
                return Err(no_store(path));
            }
            // Durable commits go through the journal (store::journal).
            let (db, holder) = retry_in_use(|| {
                let journaled = journal::Journaled::open_file(path, create).map_err(in_use)?;
                let holder = journaled.sync_holder();
                Ok((b.create_with_backend(journaled)?, holder))
            })?;
            (db, Some(holder))
        }
        Backend::Device(path) => {
            let (file, capacity) = open_device(path, true)?;
            let db = if create {
                b.create_with_backend(BlockDeviceBackend::initialise(file, capacity)?)?
            } else {
                b.create_with_backend(BlockDeviceBackend::open(file, capacity)?)?
            };
            (db, None)
        }
        Backend::FencedDevice(path, fence) => {
            if create {
                return Err(StoreError::Io(std::io::Error::other(
                    "a leader never formats the metadata device",
                )));
            }
            let (file, capacity) = open_device(path, true)?;
            let db = b.create_with_backend(BlockDeviceBackend::open_fenced(
                file,
                capacity,
                fence.clone(),
            )?)?;
            (db, None)
        }
        Backend::Sim(disk) => (b.create_with_backend(disk.clone())?, None),
    })
}

/// Opens an existing store without changing a byte of it (fsck): a store that needs redb's
/// repair answers [`StoreError::NeedsRepair`], one held by a running server
/// [`StoreError::InUse`]. Run inside [`guard_damage`].
pub(crate) fn open_db_read_only(backend: &Backend) -> Result<redb::ReadOnlyDatabase, StoreError> {
    let b = builder(Verify::Trust);
    match backend {
        Backend::File(path) => {
            if !path.exists() {
                return Err(no_store(path));
            }
            // What the journal holds is read with the file, not applied to it.
            retry_in_use(|| {
                let backend = journal::ReadOnlyJournaled::open_file(path).map_err(in_use)?;
                Ok(b.open_read_only_with_backend(backend)?)
            })
        }
        Backend::Device(path) | Backend::FencedDevice(path, _) => {
            let (file, capacity) = open_device(path, false)?;
            Ok(b.open_read_only_with_backend(BlockDeviceBackend::open(file, capacity)?)?)
        }
        Backend::Sim(disk) => Ok(b.open_read_only_with_backend(disk.clone())?),
    }
}

/// The store's bytes, read without changing them (to repair a copy in memory: `--dry-run`).
pub(crate) fn read_image(backend: &Backend) -> Result<Vec<u8>, StoreError> {
    use redb::StorageBackend;
    let read_all = |b: &dyn StorageBackend| -> Result<Vec<u8>, StoreError> {
        let len = usize::try_from(b.len()?)
            .map_err(|_| StoreError::Damaged("the store's length does not fit in memory".into()))?;
        let mut buf = vec![0u8; len];
        b.read(0, &mut buf)?;
        Ok(buf)
    };
    match backend {
        Backend::File(path) => {
            if !path.exists() {
                return Err(no_store(path));
            }
            // The identity and the bytes of one open file (not two opens of the path).
            let mut file = std::fs::File::open(path)?;
            let owner = journal::file_identity(&file)?;
            let mut image = Vec::new();
            std::io::Read::read_to_end(&mut file, &mut image)?;
            journal::apply_to_image(&mut image, owner, &journal::journal_path(path))?;
            Ok(image)
        }
        Backend::Device(path) | Backend::FencedDevice(path, _) => {
            let (file, capacity) = open_device(path, false)?;
            read_all(&BlockDeviceBackend::open(file, capacity)?)
        }
        Backend::Sim(disk) => read_all(disk),
    }
}

/// A journal held by another process means a server runs on the store.
/// How long an opener keeps trying a store file that another holds.
const IN_USE_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

/// Runs `open` again while it answers [`StoreError::InUse`], for at most [`IN_USE_WAIT`]. The
/// store's locks (`flock`) belong to the open file, and a child process that this process
/// starts holds a copy of every descriptor from its `fork` until its `exec` closes them: a
/// store closed a moment before can still look held by another opener. A real other opener
/// (a running server) is still refused, a second later.
fn retry_in_use<T>(mut open: impl FnMut() -> Result<T, StoreError>) -> Result<T, StoreError> {
    let deadline = std::time::Instant::now() + IN_USE_WAIT;
    loop {
        match open() {
            Err(StoreError::InUse) if std::time::Instant::now() < deadline => {
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            r => return r,
        }
    }
}

fn in_use(e: std::io::Error) -> StoreError {
    if e.kind() == std::io::ErrorKind::WouldBlock {
        StoreError::InUse
    } else {
        StoreError::Io(e)
    }
}

pub(crate) fn remove_if_present(path: &std::path::Path) -> std::io::Result<()> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

fn no_store(path: &std::path::Path) -> StoreError {
    StoreError::Io(std::io::Error::new(
        std::io::ErrorKind::NotFound,
        format!(
            "no metadata store at {} (run sanfs-mds format)",
            path.display()
        ),
    ))
}

pub(super) fn bump_boot_epoch(db: &Database) -> Result<u64, StoreError> {
    let txn = db.begin_write()?;
    let epoch = {
        let mut counters = txn.open_table(COUNTERS)?;
        let epoch = counters
            .get(KEY_BOOT_EPOCH)?
            .map(|v| v.value())
            .unwrap_or(0)
            + 1;
        counters.insert(KEY_BOOT_EPOCH, epoch)?;
        epoch
    };
    txn.commit()?;
    Ok(epoch)
}

pub(super) fn load(db: &Database) -> Result<(Superblock, Volume, State), StoreError> {
    let r = db.begin_read()?;
    let sup = r.open_table(SUPER)?;
    let sb_bytes = sup
        .get(KEY_SUPER)?
        .ok_or_else(|| StoreError::Corrupt("no super record".into()))?;
    let sb = Superblock::decode(sb_bytes.value())
        .map_err(|e| StoreError::Corrupt(format!("super record: {e}")))?;
    let vol_bytes = sup
        .get(KEY_VOLUME)?
        .ok_or_else(|| StoreError::Corrupt("no volume record".into()))?;
    let volume = codec::decode_volume(vol_bytes.value())
        .map_err(|e| StoreError::Corrupt(format!("volume record: {e}")))?;
    let counters = r.open_table(COUNTERS)?;
    let counter = |k: &str| -> Result<u64, StoreError> {
        Ok(counters
            .get(k)?
            .ok_or_else(|| StoreError::Corrupt(format!("no counter {k}")))?
            .value())
    };
    let next_inode = counter(KEY_NEXT_INODE)?;
    let generation = counter(KEY_GENERATION)?;
    let free = r.open_table(FREE)?;
    let mut extents = Vec::with_capacity(usize::try_from(free.len()?).unwrap_or(0));
    for e in free.iter()? {
        let (k, v) = e?;
        extents.push((k.value(), v.value()));
    }
    let alloc = Allocator::from_free(&volume.allocation_groups(), sb.stripe_unit_blocks, extents)
        .map_err(|e| StoreError::Corrupt(format!("free-space table: {e}")))?;
    let usage = Usage::default();
    usage
        .free_blocks
        .store(alloc.free_blocks(), Ordering::Relaxed);
    usage
        .total_blocks
        .store(alloc.capacity_blocks(), Ordering::Relaxed);
    usage
        .inodes
        .store(r.open_table(INODES)?.len()?, Ordering::Relaxed);
    Ok((
        sb,
        volume,
        State {
            alloc,
            next_inode,
            generation,
            handles: Arc::new(Mutex::new(Handles::default())),
            usage: Arc::new(usage),
        },
    ))
}

/// The paths of LUNs added by growths (the `"grown_devices"` record; absent: none).
pub(super) fn load_grown_devices(db: &Database) -> Result<GrownDevices, StoreError> {
    let r = db.begin_read()?;
    let sup = r.open_table(SUPER)?;
    match sup.get(KEY_GROWN_DEVICES)? {
        None => Ok(GrownDevices::default()),
        Some(v) => GrownDevices::decode(v.value())
            .map_err(|e| StoreError::Corrupt(format!("grown-devices record: {e}"))),
    }
}
