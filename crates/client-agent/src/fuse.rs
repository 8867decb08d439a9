//! The FUSE mount (issue 6): a thin [`fuser::Filesystem`] over the [`Client`] library.
//!
//! fuser calls the trait synchronously on its worker threads; every request is handed to the
//! tokio runtime as a task that answers the request's `Reply*` when the client call returns,
//! so requests run concurrently (a slow read does not hold up a lookup).
//!
//! **Inode numbers** are the server's: the FUSE inode number is the sanfs inode number, except
//! when a sub-directory is mounted as the root: then that directory and the real root swap
//! numbers (FUSE's root is always 1), which keeps the mapping a bijection with no table.
//! Nothing per inode is kept here, so `forget` has nothing to do.
//!
//! **File data** enters the kernel's page cache only for files opened for reading only, or for
//! plain buffered reading and writing ([`page_cached_open`]), and stays coherent there (`pages`: the kernel checks the attributes
//! before each read and drops the pages at a new size or mtime; attributes are valid only
//! under this node's lease). Every other open answers `FOPEN_DIRECT_IO` (paper 4.4), but a
//! plain `O_DIRECT` one ([`parallel_direct_open`]: the kernel's own direct-I/O path then
//! sends the pieces of one large request at once): requests are up to 1 MiB, and reads and
//! writes go to the client library (its write-back and read caches under delegations, then
//! direct or proxied).
//!
//! **Handles.** A FUSE file handle names an [`OpenFile`] here: the inode, the open flags and
//! the current [`FileHandle`]. A handle of a replaced session answers ESTALE; the file is then
//! re-opened once with the same flags (without `O_TRUNC`) and the call retried.
//!
//! **Credentials** are the request's uid and gid plus the caller's supplementary groups from
//! `/proc/PID/status`, as read up to a second before for the same living thread and ids
//! (`groups`: never another process's); the kernel checks permissions first with the caller's
//! exact credentials (`default_permissions`), and the server again at every call (an open of a
//! directory under its attribute lease: the agent).

use std::collections::HashMap;
use std::ffi::OsStr;
use std::future::Future;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fuser::{
    AccessFlags, Errno, FileAttr, FopenFlags, Generation, INodeNo, KernelConfig, LockOwner,
    RenameFlags, ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory, ReplyDirectoryPlus, ReplyEmpty,
    ReplyEntry, ReplyLock, ReplyLseek, ReplyOpen, ReplyStatfs, ReplyWrite, ReplyXattr, Request,
    TimeOrNow, WriteFlags,
};
use sanfs_blockmap::advisory::LockKind;
use sanfs_proto::model::{FallocateMode, FileLock, LockType, OpenFlags};
use sanfs_proto::types::{
    Attr, Credentials, FileType, FsError, InodeId, RenameMode, SetAttr, TimeSet, Timestamp,
    XattrMode,
};

use crate::buf::{AlignedBuf, BufferPool};
use crate::client::leases::WithTtl;
use crate::client::{Client, FileHandle, LockWait, OpenFile, SeekWhat, retrying};
use crate::stages::{Span, Stage};

/// Largest read or write request the kernel sends (and the readahead limit).
pub const MAX_IO_BYTES: u32 = 1 << 20;

/// Histogram of the time from a FUSE request's arrival to its answer, in seconds, by `op`
/// (the request's name: `lookup`, `getattr`, `read`, `write`, `create`, ...).
pub const FUSE_OP_SECONDS: &str = "sanfs_agent_fuse_op_seconds";

/// Directory entries asked of the server per ReadDir call.
const READDIR_BATCH: u32 = 256;

/// How the mount behaves (from `-o` options).
#[derive(Debug, Clone)]
pub struct FsOptions {
    /// How long the kernel may cache attributes (0: ask every time).
    pub attr_ttl: Duration,
    /// How long the kernel may cache name lookups (0: ask every time).
    pub entry_ttl: Duration,
    /// The sanfs inode shown as the mount's root (the root directory or a sub-directory).
    pub root: InodeId,
    /// Buffered opens may use the kernel's page cache (`page_cache=`).
    pub page_cache: bool,
    /// The most bytes of writes answered before their device I/O (`write_behind=`; 0: none).
    pub write_behind: u64,
}

impl Default for FsOptions {
    fn default() -> FsOptions {
        FsOptions {
            attr_ttl: Duration::ZERO,
            entry_ttl: Duration::ZERO,
            root: InodeId(1),
            page_cache: true,
            write_behind: DEFAULT_WRITE_BEHIND,
        }
    }
}

/// The sanfs inode behind FUSE inode number `fuse` on a mount whose root is `root` (the
/// mount's root and the real root swap numbers; every other number is the same).
pub fn sanfs_ino(root: InodeId, fuse: u64) -> InodeId {
    InodeId(match fuse {
        1 => root.0,
        n if n == root.0 => 1,
        n => n,
    })
}

/// Whether an open with `raw` flags of a file of `kind` may use the kernel's page cache
/// (`pages`): reading only, or reading and writing with plain buffered writes (the kernel
/// writes them through, page by page, and keeps what it wrote). Never with `O_DIRECT`,
/// `O_TRUNC` (an open that truncates), `O_APPEND` (the end of file is the server's, never
/// the kernel's idea of the size), `O_SYNC` or `O_DSYNC`, or for a write-only open (which
/// reads nothing).
fn page_cached_open(raw: i32, truncate: bool, kind: FileType) -> bool {
    let plain = raw & (libc::O_DIRECT | libc::O_APPEND | libc::O_SYNC | libc::O_DSYNC) == 0;
    let mode = raw & libc::O_ACCMODE;
    kind == FileType::Regular
        && plain
        && !truncate
        && (mode == libc::O_RDONLY || mode == libc::O_RDWR)
}

/// Whether an open is answered without `FOPEN_DIRECT_IO` so that the kernel sends the
/// pieces of one large `O_DIRECT` read or write (1 MiB each) all at once (`FUSE_ASYNC_DIO`)
/// instead of one after the other: a plain `O_DIRECT` open of a regular file. Not with
/// `O_APPEND` (a synchronous append's pieces stay one after the other, each appended at
/// the server's end of file; an asynchronous one's are put in order by `append_order`) nor
/// `O_SYNC` / `O_DSYNC` (each write is made durable before it is answered, piece by piece).
fn parallel_direct_open(raw: i32, kind: FileType) -> bool {
    kind == FileType::Regular
        && raw & libc::O_DIRECT != 0
        && raw & (libc::O_APPEND | libc::O_SYNC | libc::O_DSYNC) == 0
}

/// One open file behind a FUSE file handle.
struct FuseFile {
    /// The inode, flags and current handle (re-opened after a session change). Its lock
    /// also serialises append writes (size, then write).
    file: Arc<OpenFile>,
    /// `O_SYNC` (`Some(false)`: data and metadata) or `O_DSYNC` (`Some(true)`: data only):
    /// every write is followed by an fsync before it is answered.
    sync: Option<bool>,
    /// Opened with `O_DIRECT`: its writes are never held back.
    direct: bool,
    /// Opened in the kernel's cached mode (`pages`).
    cached: bool,
    /// `O_APPEND | O_DIRECT`: the pieces of one asynchronous write, sent at once, are
    /// appended in the kernel's order (`append_order`).
    append_order: Option<append_order::AppendOrder>,
}

struct State {
    client: Arc<Client>,
    options: FsOptions,
    files: Mutex<HashMap<u64, Arc<FuseFile>>>,
    next_fh: AtomicU64,
    /// The volume's block size (statfs).
    block_size: u32,
    /// The ioctl commands answered ENOTTY so far (each is logged once; at most
    /// [`IOCTLS_REMEMBERED`] are remembered).
    ioctls_seen: Mutex<std::collections::BTreeSet<u32>>,
    /// Reused aligned buffers for the data of write requests (a fresh 1 MiB allocation
    /// costs its page faults at every write).
    write_bufs: BufferPool,
    /// File data in the kernel's page cache.
    pages: pages::KernelPages,
    /// Open directory handles: where a listing read through each reached its end (the
    /// offset the kernel asks from next), once it has.
    dir_ends: Mutex<HashMap<u64, Option<u64>>>,
    /// Writes answered before their device I/O (`behind`).
    behind: Arc<behind::WritesBehind>,
    /// The kernel sends the pieces of one `O_DIRECT` request at once (`FUSE_ASYNC_DIO`):
    /// see [`parallel_direct_open`].
    async_dio: AtomicBool,
}

/// Requests' worth of writes answered before their device I/O, by default.
const WRITE_BEHIND_REQUESTS: usize = 16;

/// Aligned buffers kept for write requests beyond those of the writes answered early
/// (`write_behind=`): for the writes being answered meanwhile. A write that
/// finds none free copies into a fresh allocation, whose first touch of every page faults (a
/// 1 MiB copy then costs up to three times its CPU).
const SPARE_WRITE_BUFFERS: usize = WRITE_BEHIND_REQUESTS;

/// The write buffers kept with `write_behind` bytes of writes answered early.
fn write_buffers(write_behind: u64) -> usize {
    let behind = usize::try_from(write_behind.div_ceil(u64::from(MAX_IO_BYTES))).unwrap_or(0);
    // Bounded: a larger write-behind then takes fresh buffers for its excess.
    behind.min(1024) + SPARE_WRITE_BUFFERS
}

/// The most bytes of writes answered before their device I/O, by default.
pub const DEFAULT_WRITE_BEHIND: u64 = WRITE_BEHIND_REQUESTS as u64 * MAX_IO_BYTES as u64;

/// The smallest write answered before its device I/O: smaller ones are held back or go
/// through the server, and wait for nothing long.
const WRITE_BEHIND_MIN: usize = 64 << 10;

/// Whether a write of `len` bytes at `offset` through `file` may be answered before its
/// device I/O (`behind`): a plain buffered write of whole blocks, not a shared mapping's
/// pages written back, not `O_SYNC`/`O_DSYNC` (durable before it returns), `O_DIRECT` (on
/// the LUNs before it returns) or `O_APPEND` (its offset is decided by the write). (A write
/// with partial blocks at its edges holds them back to meet its neighbours' bytes, which
/// its answer would then overtake.)
fn answered_early(file: &FuseFile, from_pages: bool, offset: u64, len: usize, block: u32) -> bool {
    let block = u64::from(block.max(1));
    !from_pages
        && file.sync.is_none()
        && !file.direct
        && !file.file.flags().append
        && len >= WRITE_BEHIND_MIN
        && offset.is_multiple_of(block)
        && (len as u64).is_multiple_of(block)
}

/// How many distinct unsupported ioctl commands are remembered (and logged once each).
const IOCTLS_REMEMBERED: usize = 64;

/// `st_blksize` of every file: the preferred I/O size. Tools size their buffers by it (`cmp`,
/// `cat`, `cp` use at least it): 1 MiB, the largest FUSE request, is above the direct-I/O
/// threshold, so their I/O takes the direct path instead of going through the server 4 KiB at a
/// time (a `cmp` of 1 GiB took 316 s with 4096 here).
const PREFERRED_IO_SIZE: u32 = 1 << 20;

/// The FUSE file system of one mount.
pub struct SanFs {
    state: Arc<State>,
    runtime: tokio::runtime::Handle,
    /// Callers' groups for reads and writes (see `groups`).
    groups: groups::GroupsCache,
}

mod append_order;
mod behind;
mod groups;
mod pages;

pub use pages::{PAGE_INVALIDATIONS, PageInvalidator};

/// Where the mount's way to drop the kernel's cached pages is put once the FUSE session
/// exists (its notifier): until then, and without it, every open is in direct mode.
pub struct PageCacheSlot(Arc<State>);

impl PageCacheSlot {
    /// Sets how pages are dropped (once; false if already set). The slot goes with it: it
    /// holds the file system's state, and with it the client, whose session the agent
    /// ends at unmount once nothing else holds it.
    pub fn install(self, f: PageInvalidator) -> bool {
        self.0.pages.set_invalidator(f)
    }
}

fn errno(e: &FsError) -> Errno {
    let n = e.errno();
    // An I/O error is what an application cannot act on: the log says what it was.
    if n == libc::EIO {
        tracing::warn!(error = %e, "answering EIO");
    }
    Errno::from_i32(n)
}

fn to_system_time(t: Timestamp) -> SystemTime {
    if t.sec >= 0 {
        UNIX_EPOCH + Duration::new(t.sec.unsigned_abs(), t.nsec)
    } else {
        UNIX_EPOCH - Duration::from_secs(t.sec.unsigned_abs()) + Duration::from_nanos(t.nsec.into())
    }
}

fn to_timestamp(t: SystemTime) -> Result<Timestamp, FsError> {
    let (sec, nsec) = match t.duration_since(UNIX_EPOCH) {
        Ok(d) => (
            i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
            d.subsec_nanos(),
        ),
        Err(e) => {
            let d = e.duration();
            let secs = i64::try_from(d.as_secs()).unwrap_or(i64::MAX);
            if d.subsec_nanos() == 0 {
                (-secs, 0)
            } else {
                (-secs - 1, 1_000_000_000 - d.subsec_nanos())
            }
        }
    };
    Timestamp::new(sec, nsec).map_err(|e| FsError::Invalid(e.to_string()))
}

fn to_time_set(t: TimeOrNow) -> Result<TimeSet, FsError> {
    Ok(match t {
        TimeOrNow::Now => TimeSet::Now,
        TimeOrNow::SpecificTime(t) => TimeSet::At(to_timestamp(t)?),
    })
}

fn fuse_kind(k: FileType) -> fuser::FileType {
    match k {
        FileType::Regular => fuser::FileType::RegularFile,
        FileType::Directory => fuser::FileType::Directory,
        FileType::Symlink => fuser::FileType::Symlink,
        FileType::Fifo => fuser::FileType::NamedPipe,
        FileType::Socket => fuser::FileType::Socket,
        FileType::CharDevice => fuser::FileType::CharDevice,
        FileType::BlockDevice => fuser::FileType::BlockDevice,
    }
}

/// The file type in a `mode`'s `S_IFMT` bits (mknod).
fn kind_of_mode(mode: u32) -> Option<FileType> {
    Some(match mode & libc::S_IFMT {
        libc::S_IFREG | 0 => FileType::Regular,
        libc::S_IFIFO => FileType::Fifo,
        libc::S_IFSOCK => FileType::Socket,
        libc::S_IFCHR => FileType::CharDevice,
        libc::S_IFBLK => FileType::BlockDevice,
        libc::S_IFDIR => FileType::Directory,
        _ => return None,
    })
}

/// sanfs open flags of Linux `open(2)` flags.
fn open_flags(flags: i32) -> OpenFlags {
    let (read, write) = match flags & libc::O_ACCMODE {
        libc::O_WRONLY => (false, true),
        libc::O_RDWR => (true, true),
        _ => (true, false),
    };
    OpenFlags {
        read,
        write,
        append: write && flags & libc::O_APPEND != 0,
        truncate: write && flags & libc::O_TRUNC != 0,
    }
}

/// Whether `open(2)` flags ask for synchronous writes: `Some(data_only)`.
fn sync_of(flags: i32) -> Option<bool> {
    if flags & libc::O_SYNC == libc::O_SYNC {
        Some(false)
    } else if flags & libc::O_DSYNC != 0 {
        Some(true)
    } else {
        None
    }
}

/// The supplementary groups of process `pid` from `/proc/PID/status` (none for pid 0, the
/// kernel, or a process that is gone).
fn read_groups(pid: u32) -> Vec<u32> {
    if pid == 0 {
        return Vec::new();
    }
    proc_status(pid)
        .and_then(|s| {
            s.lines().find_map(|l| l.strip_prefix("Groups:")).map(|g| {
                g.split_whitespace()
                    .filter_map(|n| n.parse().ok())
                    .collect()
            })
        })
        .unwrap_or_default()
}

/// `/proc/PID/status` of process `pid` (`None`: gone), read with one `read` into a buffer it
/// fits in (~1.4 KiB): `read_to_string` spends a `statx` and seven growing reads on it, per
/// FUSE request. The kernel makes the whole text at the first read and hands as much of it
/// as fits, so a read that did not fill the buffer has all of it.
fn proc_status(pid: u32) -> Option<String> {
    use std::io::Read;
    let mut f = std::fs::File::open(format!("/proc/{pid}/status")).ok()?;
    let mut buf = vec![0u8; 8192];
    let n = f.read(&mut buf).ok()?;
    if n == buf.len() {
        // Longer than ever seen: the rest as it comes.
        f.read_to_end(&mut buf).ok()?;
    } else {
        buf.truncate(n);
    }
    String::from_utf8(buf).ok()
}

fn name_bytes(name: &OsStr) -> Vec<u8> {
    name.as_bytes().to_vec()
}

impl SanFs {
    /// A file system over `client`; requests run on `runtime`.
    pub fn new(client: Arc<Client>, options: FsOptions, runtime: tokio::runtime::Handle) -> SanFs {
        let block_size = client.server_info().block_size;
        let pages = pages::KernelPages::default();
        if !options.page_cache {
            pages.switch_off();
        }
        let behind = behind::WritesBehind::new(options.write_behind);
        let write_bufs =
            BufferPool::new(MAX_IO_BYTES as usize, write_buffers(options.write_behind));
        SanFs {
            state: Arc::new(State {
                client,
                options,
                files: Mutex::new(HashMap::new()),
                next_fh: AtomicU64::new(1),
                block_size,
                ioctls_seen: Mutex::new(std::collections::BTreeSet::new()),
                write_bufs,
                behind,
                pages,
                dir_ends: Mutex::new(HashMap::new()),
                async_dio: AtomicBool::new(false),
            }),
            runtime,
            groups: groups::GroupsCache::default(),
        }
    }

    /// Where the way to drop cached pages goes once the FUSE session runs.
    pub fn page_cache_slot(&self) -> PageCacheSlot {
        PageCacheSlot(Arc::clone(&self.state))
    }

    /// The caller's credentials: the request's uid and gid, and the supplementary groups of
    /// its thread from `/proc/PID/status` as read up to [`groups::GROUPS_TTL`] before for the
    /// same living thread and ids (see `groups`); none for the kernel (pid 0).
    fn credentials(&self, req: &Request) -> Credentials {
        let _span = Span::cpu(Stage::FuseCredentials);
        let (pid, uid, gid) = (req.pid(), req.uid(), req.gid());
        let groups = if pid == 0 {
            Vec::new()
        } else {
            self.groups
                .groups(pid, uid, gid, std::time::Instant::now(), || {
                    read_groups(pid)
                })
        };
        Credentials { uid, gid, groups }
    }

    /// Runs `f` on the runtime as a task of its own; the time until it has answered goes to
    /// [`FUSE_OP_SECONDS`] under `op`.
    fn spawn<F, Fut>(&self, op: &'static str, f: F)
    where
        F: FnOnce(Arc<State>) -> Fut,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let started = std::time::Instant::now();
        let answered = f(Arc::clone(&self.state));
        self.runtime.spawn(async move {
            answered.await;
            metrics::histogram!(FUSE_OP_SECONDS, "op" => op)
                .record(started.elapsed().as_secs_f64());
        });
    }
}

impl State {
    /// The open flags of a handle outside the kernel's page cache: `FOPEN_DIRECT_IO`, except
    /// for a plain `O_DIRECT` open when the kernel sends a request's pieces at once
    /// ([`parallel_direct_open`]): its I/O bypasses the page cache anyway, and the kernel
    /// keeps what it may have cached of the file coherent around it (written back and
    /// dropped over the range).
    fn direct_open_flags(&self, raw: i32, kind: FileType) -> FopenFlags {
        if self.async_dio.load(Ordering::Relaxed) && parallel_direct_open(raw, kind) {
            FopenFlags::empty()
        } else {
            FopenFlags::FOPEN_DIRECT_IO
        }
    }

    /// sanfs inode of a FUSE inode number.
    fn ino(&self, fuse: INodeNo) -> InodeId {
        sanfs_ino(self.options.root, fuse.0)
    }

    /// FUSE inode number of a sanfs inode.
    fn fuse_ino(&self, ino: InodeId) -> INodeNo {
        let root = self.options.root.0;
        INodeNo(match ino.0 {
            n if n == root => 1,
            1 => root,
            n => n,
        })
    }

    fn attr(&self, a: &Attr) -> FileAttr {
        // This node's held-back writes count (size, mtime).
        let a = &self.client.buffered_attr(a.clone());
        FileAttr {
            ino: self.fuse_ino(a.ino),
            size: a.size,
            blocks: a.allocated.div_ceil(512),
            atime: to_system_time(a.atime),
            mtime: to_system_time(a.mtime),
            ctime: to_system_time(a.ctime),
            crtime: to_system_time(a.btime),
            kind: fuse_kind(a.kind),
            perm: u16::try_from(a.perm & 0o7777).unwrap_or(0),
            nlink: a.nlink,
            uid: a.uid,
            gid: a.gid,
            rdev: u32::try_from(a.rdev).unwrap_or(u32::MAX),
            blksize: PREFERRED_IO_SIZE.max(self.block_size),
            flags: 0,
        }
    }

    fn reply_entry(&self, reply: ReplyEntry, r: Result<Attr, FsError>) {
        self.reply_entry_leased(reply, r.map(|a| (a, None)));
    }

    /// An entry whose name and attributes may be held under leases for `ttl`. The kernel
    /// keeps the name that long only where a recall can make it forget names without a lock
    /// (`LeaseCache::kernel_names`); otherwise it gets the mount's entry TTL and asks the
    /// agent, which answers from its lease cache (see `client::leases`).
    fn reply_entry_leased(&self, reply: ReplyEntry, r: Result<WithTtl<Attr>, FsError>) {
        match r {
            Ok((a, ttl)) => {
                let entry_ttl = match ttl {
                    Some(t) if self.client.leases().kernel_names() => t,
                    _ => self.options.entry_ttl,
                };
                let fa = self.attr(&a);
                reply.entry_with_ttls(
                    &self.attr_ttl(&fa, ttl.unwrap_or(self.options.attr_ttl)),
                    &entry_ttl,
                    &fa,
                    Generation(a.generation),
                );
            }
            Err(e) => reply.error(errno(&e)),
        }
    }

    /// A lookup's answer: a name under leases as [`State::reply_entry_leased`]; a name known
    /// absent under the directory's entry lease is a negative entry the kernel keeps (where
    /// it can be made to forget names), so that repeated lookups of it stay in the kernel.
    fn reply_lookup(
        &self,
        reply: ReplyEntry,
        parent: InodeId,
        name: &[u8],
        r: Result<WithTtl<Attr>, FsError>,
    ) {
        if matches!(r, Err(FsError::NotFound))
            && self.client.leases().kernel_names()
            && let Some(ttl) = self.client.leases().negative_ttl(parent, name)
        {
            // Node id 0: "no such name", kept for the TTL.
            let none = FileAttr {
                ino: INodeNo(0),
                size: 0,
                blocks: 0,
                atime: std::time::UNIX_EPOCH,
                mtime: std::time::UNIX_EPOCH,
                ctime: std::time::UNIX_EPOCH,
                crtime: std::time::UNIX_EPOCH,
                kind: fuser::FileType::RegularFile,
                perm: 0,
                nlink: 0,
                uid: 0,
                gid: 0,
                rdev: 0,
                blksize: PREFERRED_IO_SIZE.max(self.block_size),
                flags: 0,
            };
            reply.entry_with_ttls(&Duration::ZERO, &ttl, &none, Generation(0));
            return;
        }
        self.reply_entry_leased(reply, r);
    }

    fn reply_attr_leased(&self, reply: ReplyAttr, r: Result<WithTtl<Attr>, FsError>) {
        match r {
            Ok((a, ttl)) => {
                let fa = self.attr(&a);
                reply.attr(
                    &self.attr_ttl(&fa, ttl.unwrap_or(self.options.attr_ttl)),
                    &fa,
                );
            }
            Err(e) => reply.error(errno(&e)),
        }
    }

    /// How long the kernel may hold attributes `a`: `ttl`, or 0 when they carry a change of
    /// the file's data the kernel would not see by itself (its next read then asks, and its
    /// `GETATTR` drops the pages first: [`State::getattr_view`]).
    fn attr_ttl(&self, a: &FileAttr, ttl: Duration) -> Duration {
        if self.pages.stale(self.ino(a.ino), &pages::Seen::of(a)) {
            Duration::ZERO
        } else {
            ttl
        }
    }

    /// Attributes `a` as a `GETATTR` gives them to the kernel (asked before every read of a
    /// file in cached mode whose attributes expired), and whether they carry a change it
    /// would not see by itself: then its pages must go first ([`State::drop_pages`]).
    fn getattr_view(&self, a: &Attr) -> (FileAttr, bool) {
        let fa = self.attr(a);
        let stale = self.pages.stale(a.ino, &pages::Seen::of(&fa));
        (fa, stale)
    }

    /// Answers a `GETATTR` with `fa` (of `ino`), which the kernel then holds for `ttl`.
    fn reply_getattr(&self, reply: ReplyAttr, ino: InodeId, fa: &FileAttr, ttl: Option<Duration>) {
        self.pages.seen(ino, pages::Seen::of(fa));
        reply.attr(&ttl.unwrap_or(self.options.attr_ttl), fa);
    }

    /// Drops the kernel's cached pages of `ino` in `[offset, offset + len)` (len 0: to the
    /// end), off the runtime's threads (it waits for reads in flight on those pages).
    async fn drop_pages(self: &Arc<State>, ino: InodeId, offset: u64, len: u64) {
        let st = Arc::clone(self);
        if let Err(e) =
            tokio::task::spawn_blocking(move || st.pages.invalidate(ino, offset, len)).await
        {
            tracing::warn!(ino = %ino, error = %e, "dropping cached pages failed");
        }
    }

    /// Before a `SETATTR` is answered with `a`: the kernel takes the attributes of that
    /// answer as they are, without dropping its pages for a new size or mtime (as it does for
    /// a `GETATTR`'s), and compares later ones with them. So where they carry a size or mtime
    /// it was not given (another node's write that this answer is the first to show), or the
    /// change set the mtime itself (which hides whether the data moved before it), its pages
    /// of the file go first.
    async fn before_setattr_reply(self: &Arc<State>, a: &Attr, set_mtime: bool) {
        if !self.pages.holds(a.ino) {
            return;
        }
        let now = pages::Seen::of(&self.attr(a));
        if set_mtime || self.pages.data_moved(a.ino, &now) {
            self.drop_pages(a.ino, 0, 0).await;
        }
        self.pages.seen(a.ino, now);
    }

    /// After this node changed the data of `ino` in `[offset, offset + len)` (len 0: to the
    /// end): the kernel's pages of it go, where it may hold any, before the change is
    /// answered.
    async fn changed_data(self: &Arc<State>, ino: InodeId, offset: u64, len: u64) {
        if self.pages.holds(ino) {
            self.drop_pages(ino, offset, len).await;
        }
    }

    /// This node changes the attributes of `inos` and the names `dirs`: what the lease cache
    /// holds of them goes (the kernel updates its own copy from the change).
    fn forget(&self, inos: &[InodeId], dirs: &[(InodeId, &[u8])]) {
        self.client.leases().forget(inos, dirs);
    }

    /// Whether the listing read through directory handle `fh` reached its end at `offset`:
    /// the kernel asks once more from there (and again at every `getdents` after the end),
    /// and the answer, nothing more, needs no `ReadDir` (a name made since then may or may
    /// not be listed: POSIX leaves that open until the next `rewinddir`; a `seekdir` to
    /// anywhere else asks the server).
    fn listed_to_end(&self, fh: u64, offset: u64) -> bool {
        let ends = self.dir_ends.lock().unwrap_or_else(|e| e.into_inner());
        ends.get(&fh).copied().flatten() == Some(offset)
    }

    /// A listing through directory handle `fh` answered up to `end` (`Some`: the offset of
    /// its last entry, with nothing after it).
    fn listing_ended(&self, fh: u64, end: Option<u64>) {
        let mut ends = self.dir_ends.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(e) = ends.get_mut(&fh) {
            *e = end;
        }
    }

    fn file(&self, fh: fuser::FileHandle) -> Result<Arc<FuseFile>, FsError> {
        self.files
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&fh.0)
            .cloned()
            .ok_or_else(|| FsError::Invalid(format!("unknown file handle {}", fh.0)))
    }

    /// A new FUSE handle for an open file (`cached`: in the kernel's cached mode) whose size
    /// the kernel was told is `size`.
    #[allow(
        clippy::too_many_arguments,
        reason = "the open's result, flags and mode; two call sites (open, create)"
    )]
    fn insert(
        &self,
        ino: InodeId,
        flags: OpenFlags,
        raw_flags: i32,
        handle: FileHandle,
        cred: &Credentials,
        cached: bool,
        size: u64,
    ) -> fuser::FileHandle {
        let open = Arc::new(OpenFile::new(ino, flags, handle, cred));
        self.client.track_open_file(&open);
        self.insert_file(open, raw_flags, cached, size)
    }

    /// An open for reading answered here, on FUSE's thread, without the server
    /// ([`OpenFile::deferred`]): a plain buffered one of a regular file whose attributes
    /// this node holds under its lease (so that the server recalls it before another node
    /// unlinks or changes the file, and the open is made at the server first), that the
    /// caller may read by them, and whose pages the kernel kept as of those attributes.
    /// `None`: open it at the server.
    fn open_here(
        &self,
        ino: InodeId,
        raw: i32,
        flags: OpenFlags,
        cred: &Credentials,
    ) -> Option<(fuser::FileHandle, bool)> {
        let reading_only = flags.read && !flags.write && !flags.append && !flags.truncate;
        if !reading_only || !self.pages.usable() || self.behind.busy(ino) {
            return None;
        }
        let (attr, _) = self.client.cached_attr(ino)?;
        let seen = pages::Seen::of(&self.attr(&attr));
        // The kernel's pages as of these attributes, or the bytes of a small file kept here
        // (from its open, or written whole by this node), which answer its reads.
        let kept = self.pages.would_keep(ino, seen);
        if !page_cached_open(raw, false, attr.kind)
            || self.client.has_held_attrs(ino)
            || !(kept || self.client.holds_small_file(ino))
            || !matches!(self.client.leased_access(cred, ino, 4), Some(Ok(())))
        {
            return None;
        }
        // Noted among the open files before the lease is looked at again: a recall from
        // here on finds it, and makes it at the server before it is acknowledged.
        let open = Arc::new(OpenFile::deferred(ino, flags, cred));
        self.client.track_open_file(&open);
        // (The lease went meanwhile: opened at the server.)
        self.client.cached_attr(ino)?;
        let keep = self.pages.open(ino, seen);
        if kept && !keep {
            // The pages moved meanwhile: opened at the server.
            self.pages.release(ino);
            return None;
        }
        self.client.note_open_here();
        let fh = self.insert_file(open, raw, true, attr.size);
        Some((fh, keep))
    }

    fn insert_file(
        &self,
        open: Arc<OpenFile>,
        raw_flags: i32,
        cached: bool,
        size: u64,
    ) -> fuser::FileHandle {
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        let flags = open.flags();
        let file = Arc::new(FuseFile {
            file: open,
            sync: sync_of(raw_flags),
            direct: raw_flags & libc::O_DIRECT != 0,
            cached,
            append_order: (flags.append && raw_flags & libc::O_DIRECT != 0)
                .then(|| append_order::AppendOrder::new(size)),
        });
        self.files
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(fh, file);
        fuser::FileHandle(fh)
    }
}

/// Runs `$body` with `$fh` bound to the file's current handle; when it answers ESTALE, the
/// file is re-opened once and `$body` runs again with the new handle.
macro_rules! with_handle {
    ($st:expr, $cred:expr, $file:expr, |$fh:ident| $body:expr) => {
        retrying!($file.file, &$st.client, &$cred, |$fh| $body)
    };
}

async fn do_setattr(
    st: &State,
    cred: &Credentials,
    ino: InodeId,
    changes: SetAttr,
    file: Option<Arc<FuseFile>>,
) -> Result<Attr, FsError> {
    let rest = SetAttr {
        size: None,
        ..changes.clone()
    };
    let nothing_else = rest == SetAttr::default();
    let mut attr = None;
    if let Some(size) = changes.size {
        attr = Some(match &file {
            Some(f) => with_handle!(st, cred, f, |fh| st
                .client
                .truncate(cred, Some(&fh), ino, size)
                .await)?,
            None => st.client.truncate(cred, None, ino, size).await?,
        });
    }
    match attr {
        Some(a) if nothing_else => Ok(a),
        _ => match &file {
            Some(f) => {
                with_handle!(st, cred, f, |fh| st
                    .client
                    .setattr(cred, ino, rest.clone(), Some(&fh))
                    .await)
            }
            None => st.client.setattr(cred, ino, rest, None).await,
        },
    }
}

async fn do_readdir(
    st: &State,
    cred: &Credentials,
    ino: InodeId,
    offset: u64,
    mut reply: ReplyDirectory,
) -> Result<Option<u64>, (ReplyDirectory, FsError)> {
    let mut cookie = if offset <= 2 { 0 } else { offset };
    // The offset of the last entry answered (the kernel asks from it next).
    let mut last = offset;
    let first = match st
        .client
        .readdir(cred, ino, cookie, READDIR_BATCH, false)
        .await
    {
        Ok(r) => r,
        Err(e) => return Err((reply, e)),
    };
    if offset == 0 {
        if reply.add(st.fuse_ino(ino), 1, fuser::FileType::Directory, ".") {
            reply.ok();
            return Ok(None);
        }
        last = 1;
    }
    if offset <= 1 {
        if reply.add(
            st.fuse_ino(first.parent),
            2,
            fuser::FileType::Directory,
            "..",
        ) {
            reply.ok();
            return Ok(None);
        }
        last = 2;
    }
    let mut batch = first;
    loop {
        for e in &batch.entries {
            if reply.add(
                st.fuse_ino(e.inode),
                e.cookie,
                fuse_kind(e.kind),
                OsStr::from_bytes(e.name.as_bytes()),
            ) {
                reply.ok();
                return Ok(None);
            }
            cookie = e.cookie;
            last = e.cookie;
        }
        if batch.eof || batch.entries.is_empty() {
            reply.ok();
            return Ok(Some(last));
        }
        batch = match st
            .client
            .readdir(cred, ino, cookie, READDIR_BATCH, false)
            .await
        {
            Ok(r) => r,
            Err(e) => return Err((reply, e)),
        };
    }
}

async fn do_readdirplus(
    st: &State,
    cred: &Credentials,
    ino: InodeId,
    offset: u64,
    mut reply: ReplyDirectoryPlus,
) -> Result<Option<u64>, (ReplyDirectoryPlus, FsError)> {
    let ttl = st.options.entry_ttl;
    let mut cookie = if offset <= 2 { 0 } else { offset };
    // The offset of the last entry answered (the kernel asks from it next).
    let mut last = offset;
    let first = match st
        .client
        .readdir_leased(cred, ino, cookie, READDIR_BATCH, true)
        .await
    {
        Ok(r) => r,
        Err(e) => return Err((reply, e)),
    };
    if offset <= 1 {
        // The kernel takes no lookup reference on `.` and `..`; their attributes are the
        // directory's own (the `..` entry's inode number is what matters).
        // Under its attribute lease, from the cache.
        let dir = match st.client.cached_attr(ino) {
            Some((a, _)) => a,
            None => match st.client.getattr_leased(cred, ino).await {
                Ok((a, _)) => a,
                Err(e) => return Err((reply, e)),
            },
        };
        let dot = st.attr(&dir);
        if offset == 0 && reply.add(dot.ino, 1, ".", &Duration::ZERO, &dot, Generation(0)) {
            reply.ok();
            return Ok(None);
        }
        let dotdot = FileAttr {
            ino: st.fuse_ino(first.parent),
            ..dot
        };
        if reply.add(dotdot.ino, 2, "..", &Duration::ZERO, &dotdot, Generation(0)) {
            reply.ok();
            return Ok(None);
        }
        last = 2;
    }
    let mut batch = first;
    loop {
        for e in &batch.entries {
            let Some(a) = &e.attr else {
                return Err((reply, FsError::Io("ReadDir plus without attributes".into())));
            };
            // Under the leases the listing gave (name and attributes as cached, unchanged
            // since), the kernel keeps them as a lookup's.
            let leased = if st.client.leases().kernel_names() {
                match st.client.cached_lookup(ino, e.name.as_bytes()) {
                    Some(Ok((cached, Some(t)))) if cached == *a => Some(t),
                    _ => None,
                }
            } else {
                None
            };
            let fa = st.attr(a);
            if reply.add(
                st.fuse_ino(e.inode),
                e.cookie,
                OsStr::from_bytes(e.name.as_bytes()),
                &st.attr_ttl(&fa, leased.unwrap_or(ttl)),
                &fa,
                Generation(a.generation),
            ) {
                reply.ok();
                return Ok(None);
            }
            cookie = e.cookie;
            last = e.cookie;
        }
        if batch.eof || batch.entries.is_empty() {
            reply.ok();
            return Ok(Some(last));
        }
        batch = match st
            .client
            .readdir_leased(cred, ino, cookie, READDIR_BATCH, true)
            .await
        {
            Ok(r) => r,
            Err(e) => return Err((reply, e)),
        };
    }
}

impl fuser::Filesystem for SanFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        let _ = config.set_max_write(MAX_IO_BYTES);
        let _ = config.set_max_readahead(MAX_IO_BYTES);
        // POSIX and flock locks come here (held cluster-wide by the server) instead of being
        // kept by this node's kernel alone.
        let wanted = fuser::InitFlags::FUSE_DO_READDIRPLUS
            | fuser::InitFlags::FUSE_READDIRPLUS_AUTO
            | fuser::InitFlags::FUSE_PARALLEL_DIROPS
            | fuser::InitFlags::FUSE_POSIX_LOCKS
            | fuser::InitFlags::FUSE_FLOCK_LOCKS
            // Shared mmap of a direct-I/O file (kernel 6.6+): its pages go through the page
            // cache while mapped, written back through this file system; reads and writes keep
            // bypassing it.
            | fuser::InitFlags::FUSE_DIRECT_IO_ALLOW_MMAP
            // Files in cached mode: the kernel checks the attributes before each read and
            // drops the pages at a new size or mtime (`pages`).
            | fuser::InitFlags::FUSE_AUTO_INVAL_DATA
            // The server clears setuid/setgid at a chown, and at a truncate or write by a
            // caller other than root, and file capabilities at a chown, a truncate or any
            // write, as the kernel would: the kernel
            // then sends a chown or truncate as it is, instead of asking for the attributes
            // first (a `GetAttr` round trip) to send a mode without those bits.
            | fuser::InitFlags::FUSE_HANDLE_KILLPRIV_V2
            // The pieces of one large O_DIRECT read or write in flight at once
            // (`parallel_direct_open`).
            | fuser::InitFlags::FUSE_ASYNC_DIO;
        let granted = wanted & config.capabilities();
        let _ = config.add_capabilities(granted);
        self.state.async_dio.store(
            granted.contains(fuser::InitFlags::FUSE_ASYNC_DIO),
            Ordering::Relaxed,
        );
        self.state
            .pages
            .set_auto_inval(granted.contains(fuser::InitFlags::FUSE_AUTO_INVAL_DATA));
        Ok(())
    }

    fn lookup(&self, req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        // Under the leases: answered here, on FUSE's thread (the cache never blocks).
        let started = std::time::Instant::now();
        if let Some(r) = self
            .state
            .client
            .cached_lookup(self.state.ino(parent), name.as_bytes())
        {
            self.state
                .reply_lookup(reply, self.state.ino(parent), name.as_bytes(), r);
            metrics::histogram!(FUSE_OP_SECONDS, "op" => "lookup")
                .record(started.elapsed().as_secs_f64());
            return;
        }
        let cred = self.credentials(req);
        let name = name_bytes(name);
        self.spawn("lookup", move |st| async move {
            let r = st.client.lookup_leased(&cred, st.ino(parent), &name).await;
            st.reply_lookup(reply, st.ino(parent), &name, r);
        });
    }

    fn getattr(
        &self,
        req: &Request,
        ino: INodeNo,
        _fh: Option<fuser::FileHandle>,
        reply: ReplyAttr,
    ) {
        let started = std::time::Instant::now();
        let cached = self.state.client.cached_attr(self.state.ino(ino));
        if let Some((a, ttl)) = &cached {
            let (fa, stale) = self.state.getattr_view(a);
            if !stale {
                self.state.reply_getattr(reply, a.ino, &fa, *ttl);
                metrics::histogram!(FUSE_OP_SECONDS, "op" => "getattr")
                    .record(started.elapsed().as_secs_f64());
                return;
            }
        }
        let cred = self.credentials(req);
        self.spawn("getattr", move |st| async move {
            // (A change the kernel would not see drops its pages, off FUSE's thread.)
            let r = match cached {
                Some(r) => Ok(r),
                None => st.client.getattr_leased(&cred, st.ino(ino)).await,
            };
            match r {
                Ok((a, ttl)) => {
                    let (fa, stale) = st.getattr_view(&a);
                    if stale {
                        st.drop_pages(a.ino, 0, 0).await;
                    }
                    st.reply_getattr(reply, a.ino, &fa, ttl);
                }
                Err(e) => reply.error(errno(&e)),
            }
        });
    }

    fn setattr(
        &self,
        req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        fh: Option<fuser::FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let cred = self.credentials(req);
        self.spawn("setattr", move |st| async move {
            let r = async {
                let changes = SetAttr {
                    perm: mode.map(|m| m & 0o7777),
                    uid,
                    gid,
                    size,
                    atime: atime.map(to_time_set).transpose()?,
                    mtime: mtime.map(to_time_set).transpose()?,
                    ctime: None,
                };
                let file = fh.map(|fh| st.file(fh)).transpose()?;
                let set_mtime = changes.mtime.is_some();
                let sized = changes.size.is_some();
                let r = do_setattr(&st, &cred, st.ino(ino), changes, file).await;
                // A size change moved what the lease cache holds of the file. (A change of
                // mode, owners or times: the client forgot it, and keeps the reply under the
                // lease that came with it; one held back here leaves the server's attributes
                // as they are, and what the cache holds of them good.)
                if sized && !st.client.has_held_attrs(st.ino(ino)) {
                    st.forget(&[st.ino(ino)], &[]);
                }
                if let Ok(a) = &r {
                    st.before_setattr_reply(a, set_mtime).await;
                }
                r
            }
            .await;
            // The kernel keeps the answer as long as the lease cache holds exactly it.
            let r = r.map(|a| {
                let ttl = st
                    .client
                    .cached_attr(a.ino)
                    .filter(|(c, _)| *c == a)
                    .and_then(|(_, ttl)| ttl);
                (a, ttl)
            });
            st.reply_attr_leased(reply, r);
        });
    }

    fn readlink(&self, req: &Request, ino: INodeNo, reply: ReplyData) {
        let cred = self.credentials(req);
        self.spawn("readlink", move |st| async move {
            match st.client.readlink(&cred, st.ino(ino)).await {
                Ok(t) => reply.data(&t),
                Err(e) => reply.error(errno(&e)),
            }
        });
    }

    fn mknod(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        rdev: u32,
        reply: ReplyEntry,
    ) {
        let cred = self.credentials(req);
        let name = name_bytes(name);
        self.spawn("mknod", move |st| async move {
            let r = match kind_of_mode(mode) {
                Some(FileType::Directory) | None => {
                    Err(FsError::Invalid(format!("mknod of mode {mode:o}")))
                }
                Some(kind) => {
                    let perm = mode & !umask & 0o7777;
                    st.client
                        .mknod(&cred, st.ino(parent), &name, kind, perm, rdev.into())
                        .await
                }
            };
            st.reply_entry(reply, r);
        });
    }

    fn mkdir(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        reply: ReplyEntry,
    ) {
        let cred = self.credentials(req);
        let name = name_bytes(name);
        self.spawn("mkdir", move |st| async move {
            let perm = mode & !umask & 0o7777;
            let r = st.client.mkdir(&cred, st.ino(parent), &name, perm).await;
            st.reply_entry(reply, r);
        });
    }

    fn unlink(&self, req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let cred = self.credentials(req);
        let name = name_bytes(name);
        self.spawn("unlink", move |st| async move {
            let r = st.client.unlink(&cred, st.ino(parent), &name).await;
            match r {
                Ok(()) => reply.ok(),
                Err(e) => reply.error(errno(&e)),
            }
        });
    }

    fn rmdir(&self, req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let cred = self.credentials(req);
        let name = name_bytes(name);
        self.spawn("rmdir", move |st| async move {
            let r = st.client.rmdir(&cred, st.ino(parent), &name).await;
            match r {
                Ok(()) => reply.ok(),
                Err(e) => reply.error(errno(&e)),
            }
        });
    }

    fn symlink(
        &self,
        req: &Request,
        parent: INodeNo,
        link_name: &OsStr,
        target: &Path,
        reply: ReplyEntry,
    ) {
        let cred = self.credentials(req);
        let name = name_bytes(link_name);
        let target = target.as_os_str().as_bytes().to_vec();
        self.spawn("symlink", move |st| async move {
            let r = st
                .client
                .symlink(&cred, st.ino(parent), &name, target)
                .await;
            st.reply_entry(reply, r);
        });
    }

    fn rename(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        let mode = if flags.is_empty() {
            RenameMode::Replace
        } else if flags == RenameFlags::RENAME_NOREPLACE {
            RenameMode::NoReplace
        } else if flags == RenameFlags::RENAME_EXCHANGE {
            RenameMode::Exchange
        } else {
            // RENAME_WHITEOUT (overlayfs) or a contradictory combination.
            reply.error(Errno::EINVAL);
            return;
        };
        let cred = self.credentials(req);
        let name = name_bytes(name);
        let newname = name_bytes(newname);
        self.spawn("rename", move |st| async move {
            let r = st
                .client
                .rename(
                    &cred,
                    st.ino(parent),
                    &name,
                    st.ino(newparent),
                    &newname,
                    mode,
                )
                .await;
            match r {
                Ok(()) => reply.ok(),
                Err(e) => reply.error(errno(&e)),
            }
        });
    }

    fn link(
        &self,
        req: &Request,
        ino: INodeNo,
        newparent: INodeNo,
        newname: &OsStr,
        reply: ReplyEntry,
    ) {
        let cred = self.credentials(req);
        let newname = name_bytes(newname);
        self.spawn("link", move |st| async move {
            let r = st
                .client
                .link(&cred, st.ino(ino), st.ino(newparent), &newname)
                .await;
            st.reply_entry(reply, r);
        });
    }

    fn open(&self, req: &Request, ino: INodeNo, flags: fuser::OpenFlags, reply: ReplyOpen) {
        let cred = self.credentials(req);
        let raw = flags.0;
        let flags = open_flags(raw);
        if let Some((fh, keep)) = self.state.open_here(self.state.ino(ino), raw, flags, &cred) {
            let open = if keep {
                FopenFlags::FOPEN_KEEP_CACHE
            } else {
                FopenFlags::empty()
            };
            reply.opened(fh, open);
            return;
        }
        self.spawn("open", move |st| async move {
            let ino = st.ino(ino);
            // The server checks the open against the mode this node's held-back attribute
            // changes set: they go first.
            st.client.attrs_barrier(ino).await;
            // A buffered reader of a small file gets its bytes with the open.
            let opened = if raw & libc::O_DIRECT == 0 {
                st.client.open_reading(&cred, ino, flags).await
            } else {
                st.client.open(&cred, ino, flags).await
            };
            if flags.truncate {
                st.forget(&[ino], &[]);
            }
            match opened {
                Ok((handle, attr)) => {
                    // Plain buffered reads (and writes): the kernel's page cache (`pages`).
                    let cached =
                        page_cached_open(raw, flags.truncate, attr.kind) && st.pages.usable();
                    let fh = st.insert(ino, flags, raw, handle, &cred, cached, attr.size);
                    let open = if !cached {
                        st.direct_open_flags(raw, attr.kind)
                    } else if st.pages.open(ino, pages::Seen::of(&st.attr(&attr))) {
                        FopenFlags::FOPEN_KEEP_CACHE
                    } else {
                        FopenFlags::empty()
                    };
                    reply.opened(fh, open);
                }
                Err(e) => reply.error(errno(&e)),
            }
        });
    }

    fn read(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: fuser::FileHandle,
        offset: u64,
        size: u32,
        _flags: fuser::OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        // With writes of the file in flight (answered before their device I/O) the read
        // waits for them in its task: neither the read cache, nor a small file's bytes, nor
        // the leased size know them yet.
        let writes_in_flight = self.state.behind.busy(self.state.ino(ino));
        // A buffered read the read cache answers needs no task (the common case of a
        // sequential reader under a delegation): answered here, on FUSE's thread. So is one
        // of a small file whose bytes came with its open.
        if let Ok(file) = self.state.file(fh)
            && !file.direct
            && !writes_in_flight
        {
            let started = std::time::Instant::now();
            let sino = self.state.ino(ino);
            if let Some(buf) =
                self.state
                    .client
                    .small_file_read(sino, offset, size.min(MAX_IO_BYTES) as usize)
            {
                let mut span = Span::wall_since(Stage::FuseRead, started);
                span.set_bytes(buf.len() as u64);
                reply_data(reply, &buf);
                metrics::histogram!(FUSE_OP_SECONDS, "op" => "read")
                    .record(started.elapsed().as_secs_f64());
                return;
            }
            if let Some((buf, ahead)) = self.state.client.try_read_cached_now(
                self.state.ino(ino),
                offset,
                size.min(MAX_IO_BYTES) as usize,
            ) {
                let mut span = Span::wall_since(Stage::FuseRead, started);
                span.set_bytes(buf.len() as u64);
                reply_data(reply, &buf);
                metrics::histogram!(FUSE_OP_SECONDS, "op" => "read")
                    .record(started.elapsed().as_secs_f64());
                // The sequential reader's next chunks, read in the background.
                if let Some(ahead) = ahead
                    && !file.file.is_deferred()
                {
                    let _runtime = self.runtime.enter();
                    self.state.client.spawn_read_ahead(
                        &self.credentials(req),
                        &file.file.current(),
                        ahead,
                    );
                }
                return;
            }
        }
        // A read at or past the end of file, whose size the attribute lease makes exact
        // (the last read of every `cat`), needs no task either.
        if !writes_in_flight
            && self
                .state
                .client
                .leased_size(self.state.ino(ino))
                .is_some_and(|size| offset >= size)
        {
            reply.data(&[]);
            return;
        }
        let started = std::time::Instant::now();
        let cred = self.credentials(req);
        self.spawn("read", move |st| async move {
            st.behind.wait_idle(st.ino(ino)).await;
            let mut span = Span::wall_since(Stage::FuseRead, started);
            let r = async {
                let file = st.file(fh)?;
                let ino = st.ino(ino);
                let size = size.min(MAX_IO_BYTES) as usize;
                // O_DIRECT reads go to the LUNs, into the aligned buffer the answer is sent
                // from (no copy when the whole read goes the direct path); buffered ones
                // through the read cache (client::writeback).
                if file.direct {
                    let (buf, n) = with_handle!(st, cred, file, |h| st
                        .client
                        .read_aligned(&cred, &h, ino, offset, aligned_zeroed(size))
                        .await)?;
                    return Ok::<_, FsError>(Answer::Aligned(buf, n));
                }
                // An open answered here is made now; a small file's bytes come with it.
                if file.file.deferred_open() {
                    file.file.opened(&st.client).await?;
                    if let Some(buf) = st.client.small_file_read(ino, offset, size) {
                        return Ok(Answer::Vec(buf));
                    }
                }
                let mut buf = {
                    let _copy = Span::cpu(Stage::Copy);
                    vec![0u8; size]
                };
                let n = with_handle!(st, cred, file, |h| st
                    .client
                    .read_cached(&cred, &h, ino, offset, &mut buf)
                    .await)?;
                buf.truncate(n);
                Ok(Answer::Vec(buf))
            }
            .await;
            match r {
                Ok(answer) => {
                    let data = answer.as_slice();
                    span.set_bytes(data.len() as u64);
                    reply_data(reply, data);
                }
                Err(e) => reply.error(errno(&e)),
            }
        });
    }

    fn write(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: fuser::FileHandle,
        offset: u64,
        data: &[u8],
        write_flags: WriteFlags,
        _flags: fuser::OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        let started = std::time::Instant::now();
        let cred = self.credentials(req);
        // Written back from the kernel's own pages (a shared mapping's dirty pages): they hold
        // these bytes already and stay under writeback until this is answered, so they are
        // not dropped (that would wait for this very answer: a deadlock).
        let from_pages = write_flags.contains(WriteFlags::FUSE_WRITE_CACHE);
        // Such a write goes where its pages are, also when the handle the kernel writes them
        // back through was opened with O_APPEND (any writable handle of the file serves).
        let appends = move |file: &FuseFile| file.file.flags().append && !from_pages;
        // A small buffered write under the file's held write delegation needs no task:
        // held back here, on FUSE's thread (client::writeback). Through a handle in the
        // kernel's cached mode, the kernel's pages hold these bytes already (and stay
        // locked until this is answered: they are never dropped for it); otherwise, where
        // the kernel may hold pages of the file, they must go first (a task).
        if let Ok(file) = self.state.file(fh)
            && !file.direct
            && file.sync.is_none()
            && !appends(&file)
            && (file.cached || !self.state.pages.holds(self.state.ino(ino)))
            // An earlier write of these bytes still in flight lands first (a task waits).
            && !self.state.behind.overlaps(
                self.state.ino(ino),
                offset,
                offset.saturating_add(data.len() as u64),
            )
            && let Some(w) = self
                .state
                .client
                .try_write_back_now(&cred, &file.file, offset, data)
        {
            // Nothing changed at the server: what the lease cache holds of the file stays
            // exact, and the attributes this node gives add the held-back size to it
            // (`State::attr`). So the kernel's next look at the size (before each read of a
            // cached file) is answered here, not by the server. Except the setuid and setgid
            // bits a writer other than root clears (the server will when the bytes get there).
            if !cred.is_root() {
                self.state
                    .client
                    .leases()
                    .written_by_other_than_root(self.state.ino(ino));
            }
            let mut span = Span::wall_since(Stage::FuseWrite, started);
            span.set_bytes(w.written);
            reply_written(reply, w.written);
            metrics::histogram!(FUSE_OP_SECONDS, "op" => "write")
                .record(started.elapsed().as_secs_f64());
            return;
        }
        // One copy out of FUSE's request buffer, into an aligned buffer the devices can
        // write from.
        let mut buf = {
            let mut copy = Span::cpu(Stage::Copy);
            copy.set_bytes(data.len() as u64);
            // A pooled buffer when one is free (every byte of it overwritten here), else a
            // fresh one.
            let pooled = self
                .state
                .write_bufs
                .try_take()
                .and_then(|mut b| b.set_len(data.len()).then_some(b));
            match pooled {
                Some(mut b) => {
                    b.as_mut_slice().copy_from_slice(data);
                    b
                }
                None => AlignedBuf::from_slice(data),
            }
        };
        let len = buf.len();
        self.spawn("write", move |st| async move {
            let mut span = Some(Span::wall_since(Stage::FuseWrite, started));
            let sino = st.ino(ino);
            let end = offset.saturating_add(len as u64);
            // This node's earlier writes of these bytes still in flight land first (two
            // device writes of the same bytes are not ordered by the devices).
            st.behind.wait_clear(sino, offset, end).await;
            // A plain write inside a write layout this node holds is answered now; its
            // device I/O and completion go on below (`behind`). The layout is held in use
            // from before the answer until the write's own use of it: a recall (another
            // node's read or write there) waits for the write. Not while another handle on
            // this node may hold the file's pages in the kernel (they would have to be
            // dropped, under the write, as below), unless the write comes through the
            // kernel's pages itself (they hold its bytes).
            // (Nor over bytes held back on this node, which are older and would land after
            // it, nor before held-back attribute changes, whose times come before it.)
            let early = match st.file(fh) {
                Ok(f)
                    if answered_early(&f, from_pages, offset, len, st.block_size)
                        && (f.cached || !st.pages.holds(sino))
                        && !st.client.holds_back_before(sino, offset, end) =>
                {
                    st.behind
                        .admit(sino, offset, len as u64)
                        .and_then(|ticket| {
                            st.client
                                .pin_write_layout(sino, offset, len as u64)
                                .map(|pin| (ticket, pin))
                        })
                }
                _ => None,
            };
            let (ticket, mut pin) = early.unzip();
            let answered = ticket.is_some();
            let mut reply = Some(reply);
            let mut behind_span = None;
            if answered {
                st.client.begin_write_behind(sino);
                // As a write answered after its I/O would: the lease cache's size and mtime go.
                st.forget(&[sino], &[]);
                if let Some(mut s) = span.take() {
                    s.set_bytes(len as u64);
                }
                if let Some(r) = reply.take() {
                    reply_written(r, len as u64);
                }
                let mut s = Span::wall(Stage::WriteBehind);
                s.set_bytes(len as u64);
                behind_span = Some(s);
            }
            let r = async {
                let file = st.file(fh)?;
                let ino = st.ino(ino);
                let written = if appends(&file) {
                    // O_APPEND: the server writes at its end of file, atomically with every
                    // other node's writes; one append at a time through this handle, the
                    // pieces of one O_DIRECT request in the kernel's order.
                    if let Some(order) = &file.append_order {
                        order.turn(offset).await;
                    }
                    let appended = file.file.append(&st.client, &cred, buf.as_slice()).await;
                    if let Some(order) = &file.append_order {
                        let n = appended.as_ref().map_or(0, |(_, o)| o.written);
                        order.done(offset, n as u64);
                    }
                    let (at, outcome) = appended?;
                    st.changed_data(ino, at, outcome.written).await;
                    outcome
                } else {
                    // A small buffered write is held back under the file's write delegation
                    // (client::writeback); otherwise, or when it cannot be, written through.
                    // (Not one answered already: it goes into the layout it holds, and
                    // nothing it does may wait for that layout to be idle.)
                    let held = if file.sync.is_none() && !file.direct && !answered {
                        st.client
                            .write_back(&cred, &file.file, offset, buf.as_slice())
                            .await?
                    } else {
                        None
                    };
                    match held {
                        Some(w) => w,
                        None => with_handle!(st, cred, file, |h| {
                            if let Some(pin) = pin.take() {
                                // Answered already: inside the layout held for it (a
                                // retry after a session change goes the usual way).
                                st.client.write_pinned(&cred, &h, &mut buf, pin).await
                            } else if buf.len() == len && file.sync.is_none() && !file.direct {
                                st.client
                                    .write_buffered_buf(&cred, &file.file, &h, offset, &mut buf)
                                    .await
                            } else if buf.len() == len {
                                st.client
                                    .write_at_buf(&cred, &h, ino, offset, &mut buf)
                                    .await
                            } else {
                                // Lost with an engine that stopped: never a retry of fewer
                                // bytes.
                                Err(FsError::Io("the write's buffer was lost".to_owned()))
                            }
                        })?,
                    }
                };
                // Written through the kernel's pages (a cached handle, or a mapping's write-back):
                // they hold the bytes, and are locked until this is answered. (Answered
                // already: below, once reads that wait for this write may go.)
                if !file.file.flags().append && !from_pages && !file.cached && !answered {
                    st.changed_data(ino, offset, written.written).await;
                }
                if let Some(data_only) = file.sync {
                    with_handle!(st, cred, file, |h| st
                        .client
                        .fsync(&cred, &h, ino, data_only)
                        .await)?;
                }
                Ok::<_, FsError>(written)
            }
            .await;
            // Written (size, mtime) or maybe partly: what the lease cache holds goes, and
            // after a failure whatever the kernel may have cached of the file.
            st.forget(&[sino], &[]);
            let cached = st.file(fh).is_ok_and(|f| f.cached);
            if let Some(ticket) = ticket {
                // Answered already: a failure is the file's next write, fsync or close's.
                let error = match &r {
                    Ok(w) if w.written < len as u64 => Some(FsError::Io(format!(
                        "a write answered before its device I/O wrote {} of {len} bytes",
                        w.written
                    ))),
                    Ok(_) => None,
                    Err(e) => Some(e.clone()),
                };
                st.client.end_write_behind(sino, error);
                // Not used (the write failed before it reached the layout).
                if let Some(pin) = pin.take() {
                    st.client.unpin_write_layout(pin);
                }
                // Reads of the file waiting for this write go on now; only then are pages
                // dropped (such a read holds the kernel's pages it fills locked).
                drop(ticket);
                drop(behind_span);
                if !from_pages && !cached && r.is_ok() {
                    st.changed_data(sino, offset, len as u64).await;
                }
            }
            // (A failed write through the kernel's pages: the kernel no longer takes them as
            // up to date itself.)
            if r.is_err() && !from_pages && !cached {
                st.changed_data(sino, 0, 0).await;
            }
            match (reply, r) {
                (Some(reply), Ok(w)) => {
                    if let Some(s) = span.as_mut() {
                        s.set_bytes(w.written);
                    }
                    reply_written(reply, w.written);
                }
                (Some(reply), Err(e)) => reply.error(errno(&e)),
                (None, _) => {}
            }
        });
    }

    fn flush(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: fuser::FileHandle,
        lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        // No client cache of data, but writes inside a write layout return before their
        // completion is answered: close waits for those and reports one that failed (as a
        // failed writeback), makes lazily completed writes durable, and reports a write lost
        // in a server restart (EIO, once). A close also drops the closing process's POSIX locks on the file
        // (any descriptor of it), cluster-wide; only when this agent holds some, to keep
        // close cheap.
        let sino = self.state.ino(ino);
        let held_back = self.state.client.has_held_back(sino);
        let behind = held_back || self.state.client.has_writes_behind(sino);
        if self.state.client.locks_held() == 0 && !behind {
            reply.ok();
            return;
        }
        let cred = self.credentials(req);
        self.spawn("flush", move |st| async move {
            if held_back {
                // close writes what this node held back (its failure is answered below).
                let _ = st.client.flush_file(sino).await;
            }
            let written = if behind {
                st.client.flush_writes(sino).await
            } else {
                Ok(())
            };
            // close is a durability point: writes the server completed lazily are made
            // durable before close answers (a server restart after it loses nothing).
            let written = match written {
                Ok(()) if st.client.has_unsynced_writes(sino) => {
                    async {
                        let file = st.file(fh)?;
                        with_handle!(st, cred, file, |h| st
                            .client
                            .fsync(&cred, &h, sino, true)
                            .await)
                    }
                    .await
                }
                w => w,
            };
            if st.client.locks_held() > 0 {
                let r = async {
                    let file = st.file(fh)?;
                    with_handle!(st, cred, file, |h| st
                        .client
                        .release_lock_owner(&cred, &h, sino, lock_owner.0)
                        .await)
                }
                .await;
                if let Err(e) = r {
                    tracing::warn!(ino = %sino, error = %e, "dropping a closing owner's locks failed");
                }
            }
            match written {
                Ok(()) => reply.ok(),
                Err(e) => reply.error(errno(&e)),
            }
        });
    }

    /// No ioctl is supported: ENOTTY, as a file system without the command answers (fsstress
    /// and `cp` probe FS_IOC_* commands). Logged once per command, not per call.
    fn ioctl(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: fuser::FileHandle,
        _flags: fuser::IoctlFlags,
        cmd: u32,
        _in_data: &[u8],
        _out_size: u32,
        reply: fuser::ReplyIoctl,
    ) {
        let first = {
            let mut seen = self
                .state
                .ioctls_seen
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            seen.len() < IOCTLS_REMEMBERED && seen.insert(cmd)
        };
        if first {
            tracing::info!(
                cmd = format_args!("{cmd:#x}"),
                ino = ino.0,
                "unsupported ioctl: ENOTTY (logged once per command)"
            );
        }
        reply.error(Errno::ENOTTY);
    }

    fn getlk(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: fuser::FileHandle,
        lock_owner: LockOwner,
        start: u64,
        end: u64,
        typ: i32,
        pid: u32,
        reply: ReplyLock,
    ) {
        let Some(lock) = file_lock(typ, start, end, pid) else {
            reply.error(Errno::EINVAL);
            return;
        };
        let cred = self.credentials(req);
        self.spawn("getlk", move |st| async move {
            let r = async {
                let file = st.file(fh)?;
                let ino = st.ino(ino);
                with_handle!(st, cred, file, |h| st
                    .client
                    .getlk(&cred, &h, ino, lock_owner.0, lock)
                    .await)
            }
            .await;
            match r {
                Ok(Some(c)) => {
                    let typ = match c.typ {
                        LockType::Lock(LockKind::Write) => libc::F_WRLCK,
                        _ => libc::F_RDLCK,
                    };
                    reply.locked(c.start, c.end, typ, c.pid);
                }
                // No conflict: F_UNLCK, the range as asked.
                Ok(None) => reply.locked(start, end, libc::F_UNLCK, 0),
                Err(e) => reply.error(errno(&e)),
            }
        });
    }

    fn setlk(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: fuser::FileHandle,
        lock_owner: LockOwner,
        start: u64,
        end: u64,
        typ: i32,
        pid: u32,
        sleep: bool,
        reply: ReplyEmpty,
    ) {
        let Some(lock) = file_lock(typ, start, end, pid) else {
            reply.error(Errno::EINVAL);
            return;
        };
        let cred = self.credentials(req);
        // The kernel does not tell this file system about signals (fuser drops FUSE_INTERRUPT):
        // a waiter is interrupted when its process has a signal pending it does not block or
        // ignore, as a local F_SETLKW would be.
        let waiter = req.pid();
        self.spawn("setlk", move |st| async move {
            let interrupted = move || signal_pending(waiter);
            let wait = if sleep {
                LockWait::Until(&interrupted)
            } else {
                LockWait::No
            };
            let r = async {
                let file = st.file(fh)?;
                let ino = st.ino(ino);
                with_handle!(st, cred, file, |h| st
                    .client
                    .setlk(&cred, &h, ino, lock_owner.0, lock, wait)
                    .await)
            }
            .await;
            match r {
                Ok(()) => reply.ok(),
                Err(e) => reply.error(errno(&e)),
            }
        });
    }

    fn release(
        &self,
        req: &Request,
        _ino: INodeNo,
        fh: fuser::FileHandle,
        _flags: fuser::OpenFlags,
        lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        let file = self
            .state
            .files
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&fh.0);
        reply.ok();
        if let Some(file) = file {
            if file.cached {
                self.state.pages.release(file.file.ino());
            }
            // Whom as only for flock's locks (the release itself is the handle's).
            let cred = (lock_owner.is_some() && self.state.client.locks_held() > 0)
                .then(|| self.credentials(req));
            // Nothing to send first: released with a later call, without a task here (an
            // open answered here and never made at the server: nothing to release).
            if cred.is_none() {
                if file.file.close_deferred() {
                    return;
                }
                match self.state.client.release_later(&file.file.current()) {
                    Some(true) => {
                        self.spawn("release", |st| async move {
                            st.client.flush_releases_later().await;
                        });
                        return;
                    }
                    Some(false) => return,
                    None => {}
                }
            }
            self.spawn("release", move |st| async move {
                // flock's locks belong to the open file and go with its last descriptor.
                if let (Some(owner), Some(cred)) = (lock_owner, cred)
                    && !file.file.is_deferred()
                    && let Err(e) = st
                        .client
                        .release_lock_owner(&cred, &file.file.current(), file.file.ino(), owner.0)
                        .await
                {
                    tracing::warn!(ino = %file.file.ino(), error = %e, "dropping flock locks failed");
                }
                // A handle of a replaced session is already gone at the server.
                if let Err(e) = file.file.release(&st.client).await {
                    tracing::warn!(ino = %file.file.ino(), error = %e, "release failed");
                }
            });
        }
    }

    fn fsync(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: fuser::FileHandle,
        datasync: bool,
        reply: ReplyEmpty,
    ) {
        let cred = self.credentials(req);
        self.spawn("fsync", move |st| async move {
            let r = async {
                let file = st.file(fh)?;
                let ino = st.ino(ino);
                with_handle!(st, cred, file, |h| st
                    .client
                    .fsync(&cred, &h, ino, datasync)
                    .await)
            }
            .await;
            match r {
                Ok(()) => reply.ok(),
                Err(e) => reply.error(errno(&e)),
            }
        });
    }

    fn opendir(&self, req: &Request, ino: INodeNo, _flags: fuser::OpenFlags, reply: ReplyOpen) {
        // Directories are read by cookie; opening checks read permission. The handle only
        // remembers where its listing ended (see `State::listed_to_end`).
        let cred = self.credentials(req);
        self.spawn("opendir", move |st| async move {
            match st.client.access(&cred, st.ino(ino), 4).await {
                Ok(()) => {
                    let fh = st.next_fh.fetch_add(1, Ordering::Relaxed);
                    st.dir_ends
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .insert(fh, None);
                    reply.opened(fuser::FileHandle(fh), FopenFlags::empty());
                }
                Err(e) => reply.error(errno(&e)),
            }
        });
    }

    fn readdir(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: fuser::FileHandle,
        offset: u64,
        reply: ReplyDirectory,
    ) {
        if self.state.listed_to_end(fh.0, offset) {
            reply.ok();
            return;
        }
        let cred = self.credentials(req);
        self.spawn("readdir", move |st| async move {
            match do_readdir(&st, &cred, st.ino(ino), offset, reply).await {
                Ok(end) => st.listing_ended(fh.0, end),
                Err((reply, e)) => reply.error(errno(&e)),
            }
        });
    }

    fn readdirplus(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: fuser::FileHandle,
        offset: u64,
        reply: ReplyDirectoryPlus,
    ) {
        if self.state.listed_to_end(fh.0, offset) {
            reply.ok();
            return;
        }
        let cred = self.credentials(req);
        self.spawn("readdirplus", move |st| async move {
            match do_readdirplus(&st, &cred, st.ino(ino), offset, reply).await {
                Ok(end) => st.listing_ended(fh.0, end),
                Err((reply, e)) => reply.error(errno(&e)),
            }
        });
    }

    fn releasedir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: fuser::FileHandle,
        _flags: fuser::OpenFlags,
        reply: ReplyEmpty,
    ) {
        self.state
            .dir_ends
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&fh.0);
        reply.ok();
    }

    fn fsyncdir(
        &self,
        req: &Request,
        ino: INodeNo,
        _fh: fuser::FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        // Namespace changes may be answered before they are durable: this one waits until
        // every change this agent was answered is (docs/posix.md, "Durability").
        let cred = self.credentials(req);
        self.spawn("fsyncdir", move |st| async move {
            match st.client.sync_namespace(&cred, st.ino(ino)).await {
                Ok(()) => reply.ok(),
                Err(e) => reply.error(errno(&e)),
            }
        });
    }

    fn statfs(&self, req: &Request, ino: INodeNo, reply: ReplyStatfs) {
        let cred = self.credentials(req);
        self.spawn("statfs", move |st| async move {
            match st.client.statfs(&cred, st.ino(ino)).await {
                Ok(s) => reply.statfs(
                    s.total_blocks,
                    s.free_blocks,
                    s.avail_blocks,
                    s.total_inodes,
                    s.free_inodes,
                    s.block_size,
                    s.name_max,
                    s.block_size,
                ),
                Err(e) => reply.error(errno(&e)),
            }
        });
    }

    fn setxattr(
        &self,
        req: &Request,
        ino: INodeNo,
        name: &OsStr,
        value: &[u8],
        flags: i32,
        _position: u32,
        reply: ReplyEmpty,
    ) {
        let mode = match flags {
            0 => XattrMode::Either,
            libc::XATTR_CREATE => XattrMode::Create,
            libc::XATTR_REPLACE => XattrMode::Replace,
            _ => {
                reply.error(Errno::EINVAL);
                return;
            }
        };
        let cred = self.credentials(req);
        let name = name_bytes(name);
        let value = value.to_vec();
        self.spawn("setxattr", move |st| async move {
            let r = st
                .client
                .setxattr(&cred, st.ino(ino), name, &value, mode)
                .await;
            st.forget(&[st.ino(ino)], &[]);
            match r {
                Ok(()) => reply.ok(),
                Err(e) => reply.error(errno(&e)),
            }
        });
    }

    fn getxattr(&self, req: &Request, ino: INodeNo, name: &OsStr, size: u32, reply: ReplyXattr) {
        let cred = self.credentials(req);
        // Under the inode's attribute lease: answered here, on FUSE's thread (`ls -l` asks
        // for an ACL of every file).
        if let Some(r) = self
            .state
            .client
            .cached_xattr(&cred, self.state.ino(ino), name.as_bytes())
        {
            match r {
                Ok(v) => reply_xattr(reply, size, &v),
                Err(e) => reply.error(errno(&e)),
            }
            return;
        }
        let name = name_bytes(name);
        self.spawn("getxattr", move |st| async move {
            match st.client.getxattr(&cred, st.ino(ino), name).await {
                Ok(v) => reply_xattr(reply, size, &v),
                Err(e) => reply.error(errno(&e)),
            }
        });
    }

    fn listxattr(&self, req: &Request, ino: INodeNo, size: u32, reply: ReplyXattr) {
        let cred = self.credentials(req);
        self.spawn("listxattr", move |st| async move {
            match st.client.listxattr(&cred, st.ino(ino)).await {
                Ok(names) => {
                    let mut list = Vec::new();
                    for n in names {
                        list.extend_from_slice(&n);
                        list.push(0);
                    }
                    reply_xattr(reply, size, &list);
                }
                Err(e) => reply.error(errno(&e)),
            }
        });
    }

    fn removexattr(&self, req: &Request, ino: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let cred = self.credentials(req);
        let name = name_bytes(name);
        self.spawn("removexattr", move |st| async move {
            let r = st.client.removexattr(&cred, st.ino(ino), name).await;
            st.forget(&[st.ino(ino)], &[]);
            match r {
                Ok(()) => reply.ok(),
                Err(e) => reply.error(errno(&e)),
            }
        });
    }

    fn access(&self, req: &Request, ino: INodeNo, mask: AccessFlags, reply: ReplyEmpty) {
        let cred = self.credentials(req);
        let mask = u32::try_from(mask.bits() & 7).unwrap_or(0);
        self.spawn("access", move |st| async move {
            match st.client.access(&cred, st.ino(ino), mask).await {
                Ok(()) => reply.ok(),
                Err(e) => reply.error(errno(&e)),
            }
        });
    }

    fn create(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        let cred = self.credentials(req);
        let name = name_bytes(name);
        let open = open_flags(flags);
        let exclusive = flags & libc::O_EXCL != 0;
        self.spawn("create", move |st| async move {
            let perm = mode & !umask & 0o7777;
            let r = st
                .client
                .create(&cred, st.ino(parent), &name, perm, exclusive, open)
                .await;
            // (The client dropped what its cache held of the name before it asked.)
            match r {
                Ok(c) => {
                    // A file read and written with plain buffered I/O: in the kernel's page
                    // cache (`pages`). A new file has no pages there; an existing one (a
                    // create without O_EXCL) may, under another name: they go first.
                    let cached = page_cached_open(flags & !libc::O_TRUNC, false, c.attr.kind)
                        && st.pages.usable();
                    if cached {
                        st.pages
                            .open(c.attr.ino, pages::Seen::of(&st.attr(&c.attr)));
                        st.drop_pages(c.attr.ino, 0, 0).await;
                    }
                    let fh = st.insert(
                        c.attr.ino,
                        open,
                        flags,
                        c.handle,
                        &cred,
                        cached,
                        c.attr.size,
                    );
                    // Name and attributes under the leases given with the reply, where the
                    // kernel can be made to forget names (one TTL for both here).
                    let ttl = match c.ttl {
                        Some(t) if st.client.leases().kernel_names() => t,
                        _ => st.options.entry_ttl,
                    };
                    reply.created(
                        &ttl,
                        &st.attr(&c.attr),
                        Generation(c.attr.generation),
                        fh,
                        if cached {
                            FopenFlags::empty()
                        } else {
                            st.direct_open_flags(flags, c.attr.kind)
                        },
                    );
                }
                Err(e) => reply.error(errno(&e)),
            }
        });
    }

    fn lseek(
        &self,
        req: &Request,
        ino: INodeNo,
        _fh: fuser::FileHandle,
        offset: i64,
        whence: i32,
        reply: ReplyLseek,
    ) {
        // The kernel sends only SEEK_DATA and SEEK_HOLE; it answers the others itself.
        let what = match whence {
            libc::SEEK_DATA => SeekWhat::Data,
            libc::SEEK_HOLE => SeekWhat::Hole,
            _ => {
                reply.error(Errno::EINVAL);
                return;
            }
        };
        let Ok(offset) = u64::try_from(offset) else {
            reply.error(Errno::ENXIO);
            return;
        };
        let cred = self.credentials(req);
        self.spawn("lseek", move |st| async move {
            let ino = st.ino(ino);
            match st.client.seek(&cred, ino, offset, what).await {
                Ok(Some(pos)) => match i64::try_from(pos) {
                    Ok(pos) => reply.offset(pos),
                    Err(_) => reply.error(Errno::EOVERFLOW),
                },
                Ok(None) => reply.error(Errno::ENXIO),
                Err(e) => reply.error(errno(&e)),
            }
        });
    }

    fn fallocate(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: fuser::FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        const KEEP_SIZE: i32 = libc::FALLOC_FL_KEEP_SIZE;
        const PUNCH: i32 = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
        const ZERO: i32 = libc::FALLOC_FL_ZERO_RANGE;
        const ZERO_KEEP: i32 = libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE;
        let mode = match mode {
            0 => FallocateMode::Allocate,
            KEEP_SIZE => FallocateMode::AllocateKeepSize,
            PUNCH => FallocateMode::PunchHole,
            ZERO => FallocateMode::ZeroRange,
            ZERO_KEEP => FallocateMode::ZeroRangeKeepSize,
            _ => {
                reply.error(Errno::EOPNOTSUPP);
                return;
            }
        };
        let cred = self.credentials(req);
        self.spawn("fallocate", move |st| async move {
            let r = async {
                let file = st.file(fh)?;
                let ino = st.ino(ino);
                let r = with_handle!(st, cred, file, |h| st
                    .client
                    .fallocate(&cred, &h, ino, offset, length, mode)
                    .await);
                st.forget(&[ino], &[]);
                st.changed_data(ino, offset, length).await;
                r
            }
            .await;
            match r {
                Ok(_) => reply.ok(),
                Err(e) => reply.error(errno(&e)),
            }
        });
    }
}

/// Answers a getxattr or listxattr: the length when `size` is 0 (a probe), ERANGE when the
/// caller's buffer is too small, else the bytes.
/// The bytes a read answers with.
enum Answer {
    Vec(Vec<u8>),
    /// The first `n` bytes.
    Aligned(AlignedBuf, usize),
}

impl Answer {
    fn as_slice(&self) -> &[u8] {
        match self {
            Answer::Vec(v) => v,
            Answer::Aligned(b, n) => b.as_slice().get(..*n).unwrap_or_default(),
        }
    }
}

/// A zeroed aligned buffer of `len` bytes, counted as [`Stage::Copy`].
fn aligned_zeroed(len: usize) -> AlignedBuf {
    let _copy = Span::cpu(Stage::Copy);
    AlignedBuf::zeroed(len)
}

/// Answers a read with `data`, counted as [`Stage::FuseReply`] (the kernel copies the bytes
/// out of `data` in this write to `/dev/fuse`).
fn reply_data(reply: ReplyData, data: &[u8]) {
    let mut span = Span::cpu(Stage::FuseReply);
    span.set_bytes(data.len() as u64);
    reply.data(data);
}

/// Answers a write, counted as [`Stage::FuseReply`].
fn reply_written(reply: ReplyWrite, written: u64) {
    let _span = Span::cpu(Stage::FuseReply);
    reply.written(u32::try_from(written).unwrap_or(u32::MAX));
}

fn reply_xattr(reply: ReplyXattr, size: u32, value: &[u8]) {
    let len = u32::try_from(value.len()).unwrap_or(u32::MAX);
    if size == 0 {
        reply.size(len);
    } else if len > size {
        reply.error(Errno::ERANGE);
    } else {
        reply.data(value);
    }
}

/// The lock a FUSE getlk/setlk describes (`typ` F_RDLCK, F_WRLCK or F_UNLCK; `[start, end]`).
fn file_lock(typ: i32, start: u64, end: u64, pid: u32) -> Option<FileLock> {
    let typ = match typ {
        libc::F_RDLCK => LockType::Lock(LockKind::Read),
        libc::F_WRLCK => LockType::Lock(LockKind::Write),
        libc::F_UNLCK => LockType::Unlock,
        _ => return None,
    };
    (start <= end).then_some(FileLock {
        typ,
        start,
        end,
        pid,
    })
}

/// Whether process `pid` has a signal pending that it neither blocks nor ignores (or is gone):
/// what ends a local F_SETLKW with EINTR.
fn signal_pending(pid: u32) -> bool {
    let Some(status) = proc_status(pid) else {
        return true;
    };
    let mask = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
            .unwrap_or(0)
    };
    let pending = mask("SigPnd:") | mask("ShdPnd:");
    pending & !mask("SigBlk:") & !mask("SigIgn:") != 0
}

/// The file-system type of a sanfs mount in /proc/self/mountinfo: `fuse.sanfs`, so that
/// mount(8) hands `-o remount` to our own helper (`/sbin/mount.fuse.sanfs`, or
/// `mount.sanfs` with `-t sanfs`), never to fuse3's `mount.fuse`, which would run the mount's
/// source as a program.
pub const MOUNT_FSTYPE: &str = "fuse.sanfs";

/// Mounts a FUSE file system of type [`MOUNT_FSTYPE`] at `mountpoint` (as root: mount(2) with
/// a fresh `/dev/fuse`), named `source` in the mount table, `nosuid,nodev`, with
/// `default_permissions` (and `allow_other` when asked); returns the `/dev/fuse` descriptor
/// to serve it on (`fuser::Session::from_fd`). fuser's own mount call always says `fuse`.
pub fn kernel_mount(
    mountpoint: &Path,
    source: &str,
    read_only: bool,
    allow_other: bool,
) -> std::io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::MetadataExt;
    let dev = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/fuse")?;
    let root_mode = std::fs::metadata(mountpoint)?.mode() & libc::S_IFMT;
    let mut data = format!(
        "fd={},rootmode={root_mode:o},user_id={},group_id={},default_permissions",
        dev.as_raw_fd(),
        rustix::process::geteuid().as_raw(),
        rustix::process::getegid().as_raw(),
    );
    if allow_other {
        data.push_str(",allow_other");
    }
    use rustix::mount::MountFlags as M;
    let mut flags = M::NOSUID | M::NODEV;
    if read_only {
        flags |= M::RDONLY;
    }
    let data = std::ffi::CString::new(data).map_err(std::io::Error::other)?;
    rustix::mount::mount(source, mountpoint, MOUNT_FSTYPE, flags, data.as_c_str()).map_err(
        |e| {
            std::io::Error::new(
                std::io::Error::from(e).kind(),
                format!(
                    "mount({source}, {}, {MOUNT_FSTYPE}): {e}",
                    mountpoint.display()
                ),
            )
        },
    )?;
    Ok(dev.into())
}

/// `FUSE_NOTIFY_INC_EPOCH` (Linux 6.16, FUSE 7.44): every name the kernel caches for this
/// mount is looked up again before its next use. Takes no lock in the kernel, so it may be
/// sent while a FUSE request of this mount holds a directory's lock. An error (`EINVAL`)
/// where the kernel does not have it.
pub fn bump_name_epoch(dev: &std::os::fd::OwnedFd) -> std::io::Result<()> {
    /// `fuse_notify_code::FUSE_NOTIFY_INC_EPOCH`.
    const FUSE_NOTIFY_INC_EPOCH: i32 = 8;
    // A notification is a bare `fuse_out_header`: length, the code in the error field,
    // unique 0; this one has no body.
    let mut header = [0u8; 16];
    header[0..4].copy_from_slice(&16u32.to_ne_bytes());
    header[4..8].copy_from_slice(&FUSE_NOTIFY_INC_EPOCH.to_ne_bytes());
    let n = rustix::io::write(dev, &header)?;
    if n == header.len() {
        Ok(())
    } else {
        Err(std::io::Error::other(format!("short write of {n} bytes")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inode_numbers_swap_only_the_two_roots() {
        let sub = InodeId(42);
        assert_eq!(sanfs_ino(sub, 1), sub);
        assert_eq!(sanfs_ino(sub, 42), InodeId(1));
        assert_eq!(sanfs_ino(sub, 7), InodeId(7));
        assert_eq!(sanfs_ino(InodeId(1), 1), InodeId(1));
    }

    #[test]
    fn a_callers_groups_and_signals_come_from_its_status_read_whole() {
        let me = std::process::id();
        let whole = std::fs::read_to_string(format!("/proc/{me}/status")).unwrap();
        let once = proc_status(me).unwrap();
        // Only counters that move between two reads may differ: the same lines, same names.
        let names = |s: &str| {
            s.lines()
                .map(|l| l.split(':').next().unwrap_or("").to_owned())
                .collect::<Vec<_>>()
        };
        assert_eq!(names(&once), names(&whole));
        let groups: Vec<u32> = rustix::process::getgroups()
            .unwrap()
            .into_iter()
            .map(|g| g.as_raw())
            .collect();
        let mut read = read_groups(me);
        let mut want = groups;
        read.sort_unstable();
        want.sort_unstable();
        want.dedup();
        read.dedup();
        assert_eq!(read, want);
        assert!(!signal_pending(me));
        // A process that is gone: no groups, and a lock wait of it ends.
        assert!(proc_status(u32::MAX).is_none());
        assert!(read_groups(u32::MAX).is_empty());
        assert!(signal_pending(u32::MAX));
    }
}
