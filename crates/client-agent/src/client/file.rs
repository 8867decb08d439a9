//! [`OpenFile`]: an open file that outlives its session.
//!
//! A [`FileHandle`] belongs to one session; after the session is replaced (the lease lapsed,
//! the server restarted) calls on it answer ESTALE. An `OpenFile` keeps the inode and the
//! open flags beside its current handle, and its calls re-open the file under the new
//! session (with the same flags, never `O_TRUNC`: the file was truncated at the first open)
//! and retry. Concurrent callers that find the same stale handle re-open once. This is what
//! the FUSE mount does for every open file, and what a long-running library user (the bench,
//! the CSI driver) wants; callers that manage handles themselves keep using [`FileHandle`].

use std::sync::Mutex;

use sanfs_proto::model::OpenFlags;
use sanfs_proto::types::{Credentials, FsError, InodeId, OpenHandle, SessionId};

use super::{Client, FileHandle, WriteOutcome};

/// The handle of an open this agent answered itself and has not made at the server yet
/// ([`OpenFile::deferred`]); no session is numbered 0.
const DEFERRED: FileHandle = FileHandle {
    session: SessionId(0),
    handle: OpenHandle(0),
};
/// A deferred open closed before it was made: nothing to make, nothing to release.
const CLOSED: FileHandle = FileHandle {
    session: SessionId(0),
    handle: OpenHandle(1),
};

/// How many times in a row a call on an [`OpenFile`] re-opens it after ESTALE before the
/// error is the answer (every re-open follows a new session).
pub const MAX_REOPENS: u32 = 64;

/// Whether `e` means "this handle's session is gone".
pub fn is_stale(e: &FsError) -> bool {
    matches!(e, FsError::Stale | FsError::StaleSession)
}

/// An open file whose handle is renewed after a session change (see the module doc).
#[derive(Debug)]
pub struct OpenFile {
    ino: InodeId,
    flags: OpenFlags,
    /// Whose open it is: a re-open is made with the same credentials.
    cred: Credentials,
    handle: Mutex<FileHandle>,
    /// Serialises re-opens, and whatever else a caller needs done one at a time per file.
    serial: tokio::sync::Mutex<()>,
    /// One append at a time through this open file (its records in the order written).
    appends: tokio::sync::Mutex<()>,
}

/// Runs `$call` with `$fh` bound to an [`OpenFile`]'s current handle; on ESTALE (the
/// handle's session was replaced: the server restarted, or the lease lapsed) re-opens the
/// file under the new session and runs the whole call again with the new handle, as often
/// as that happens (at most [`MAX_REOPENS`] times in a row). The re-open waits for the new
/// session as every call does. (A macro rather than a function taking a closure: the call
/// borrows the caller's buffers.)
macro_rules! retrying {
    ($file:expr, $client:expr, $cred:expr, |$fh:ident| $call:expr) => {{
        // A deferred open is made at the server first.
        match $file.opened($client).await {
            Err(e) => Err(e),
            Ok(first) => {
                let mut reopens = 0u32;
                let mut $fh = first;
                loop {
                    match $call {
                        Err(e)
                            if $crate::client::is_stale(&e)
                                && reopens < $crate::client::MAX_REOPENS =>
                        {
                            reopens += 1;
                            match $file.reopen($client, $cred, $fh).await {
                                Ok(fh) => $fh = fh,
                                Err(e2) => {
                                    tracing::warn!(ino = %$file.ino(), error = %e2, "re-open after a stale handle failed");
                                    break Err(e);
                                }
                            }
                        }
                        r => break r,
                    }
                }
            }
        }
    }};
}
pub(crate) use retrying;

impl OpenFile {
    /// Wraps a handle `open` returned for `ino` with `flags`, opened with `cred`.
    pub fn new(ino: InodeId, flags: OpenFlags, handle: FileHandle, cred: &Credentials) -> OpenFile {
        OpenFile {
            ino,
            flags: OpenFlags {
                truncate: false,
                ..flags
            },
            cred: cred.clone(),
            handle: Mutex::new(handle),
            serial: tokio::sync::Mutex::new(()),
            appends: tokio::sync::Mutex::new(()),
        }
    }

    /// An open of `ino` for reading that this agent answered itself, made at the server only
    /// when something needs the handle ([`OpenFile::opened`]): a read the kernel's pages do
    /// not answer, a lock, a recall of the file's attribute lease (another node's unlink,
    /// rename over it, or change), this node's own unlink or rename over it, or a server
    /// restart's reclaim. Closed before any of these, it costs the server nothing
    /// (docs/protocol.md "Opens answered by the agent").
    pub(crate) fn deferred(ino: InodeId, flags: OpenFlags, cred: &Credentials) -> OpenFile {
        OpenFile::new(ino, flags, DEFERRED, cred)
    }

    /// Whether its open is not made at the server (yet, or ever: closed before it was).
    pub fn is_deferred(&self) -> bool {
        let h = self.current();
        h == DEFERRED || h == CLOSED
    }

    /// Whether it is a deferred open not made yet, nor closed.
    pub(crate) fn deferred_open(&self) -> bool {
        self.current() == DEFERRED
    }

    /// The handle to call the server with: a deferred open is made first, once (with the
    /// opener's credentials, after this node's held-back attribute changes of the file).
    pub async fn opened(&self, client: &Client) -> Result<FileHandle, FsError> {
        self.make(client, true).await
    }

    /// [`OpenFile::opened`] in a recall, or before this node's unlink of the file: plainly
    /// (no held-back attribute change sent first, no small file's bytes read with it: the
    /// server may be waiting for this very recall with the file's range locked), and without
    /// waiting for a make in progress (that one may be waiting for the server, which waits
    /// for the recall): two makes at once keep the first answered and release the other.
    async fn opened_plainly(&self, client: &Client) -> Result<FileHandle, FsError> {
        self.make(client, false).await
    }

    async fn make(&self, client: &Client, reading: bool) -> Result<FileHandle, FsError> {
        let h = self.current();
        if h.session != DEFERRED.session {
            return Ok(h);
        }
        let _serial = if reading {
            Some(self.serial.lock().await)
        } else {
            None
        };
        match self.current() {
            CLOSED => return Err(FsError::Stale),
            DEFERRED => {}
            h => return Ok(h),
        }
        let (handle, _) = if reading {
            // (Boxed: held-back changes are sent through a writer's handle, which comes
            // here.)
            Box::pin(client.attrs_barrier(self.ino)).await;
            client
                .open_reading(&self.cred, self.ino, self.flags)
                .await?
        } else {
            client.open(&self.cred, self.ino, self.flags).await?
        };
        let now = {
            let mut h = self.handle.lock().unwrap_or_else(|e| e.into_inner());
            if *h == DEFERRED {
                *h = handle;
                super::bump(&client.inner.counters.opens_made_later);
                return Ok(handle);
            }
            *h
        };
        // Closed while it was being made, or made meanwhile by a reclaim: this one goes.
        let _ = Box::pin(client.release(&handle)).await;
        if now == CLOSED {
            Err(FsError::Stale)
        } else {
            Ok(now)
        }
    }

    /// Closes a deferred open: true when it was one (nothing to release at the server; one
    /// being made is released by its maker).
    pub(crate) fn close_deferred(&self) -> bool {
        let mut h = self.handle.lock().unwrap_or_else(|e| e.into_inner());
        if *h == DEFERRED || *h == CLOSED {
            *h = CLOSED;
            return true;
        }
        false
    }

    pub fn ino(&self) -> InodeId {
        self.ino
    }

    /// The flags it is (re-)opened with (`truncate` cleared).
    pub fn flags(&self) -> OpenFlags {
        self.flags
    }

    /// The credentials it was opened with.
    pub fn cred(&self) -> &Credentials {
        &self.cred
    }

    /// Puts `new` in place of `old` (the reclaim's re-open, `session::reopen_files`); false
    /// when the handle is not `old` any more (a caller re-opened it already).
    pub(crate) fn replace_handle(&self, old: FileHandle, new: FileHandle) -> bool {
        let mut h = self.handle.lock().unwrap_or_else(|e| e.into_inner());
        if *h != old {
            return false;
        }
        *h = new;
        true
    }

    /// The handle to use now.
    pub fn current(&self) -> FileHandle {
        *self.handle.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Holds this file's lock (re-opens take it too).
    pub async fn serial(&self) -> tokio::sync::MutexGuard<'_, ()> {
        self.serial.lock().await
    }

    /// Re-opens the file after `stale` was refused; returns the handle to retry with. If
    /// another caller re-opened it already, that handle.
    pub async fn reopen(
        &self,
        client: &Client,
        cred: &Credentials,
        stale: FileHandle,
    ) -> Result<FileHandle, FsError> {
        let _serial = self.serial.lock().await;
        let current = self.current();
        if current != stale {
            return Ok(current);
        }
        let (handle, _) = client.open(cred, self.ino, self.flags).await?;
        tracing::info!(ino = %self.ino, old = ?stale, new = ?handle, "re-opened a file under a new session");
        *self.handle.lock().unwrap_or_else(|e| e.into_inner()) = handle;
        Ok(handle)
    }

    /// [`Client::read_at`], re-opening after a session change.
    pub async fn read_at(
        &self,
        client: &Client,
        cred: &Credentials,
        offset: u64,
        len: u64,
    ) -> Result<Vec<u8>, FsError> {
        retrying!(self, client, cred, |fh| client
            .read_at(cred, &fh, self.ino, offset, len)
            .await)
    }

    /// [`Client::read_into`], re-opening after a session change.
    pub async fn read_into(
        &self,
        client: &Client,
        cred: &Credentials,
        offset: u64,
        buf: &mut [u8],
    ) -> Result<usize, FsError> {
        retrying!(self, client, cred, |fh| client
            .read_into(cred, &fh, self.ino, offset, buf)
            .await)
    }

    /// [`Client::write_at`], re-opening after a session change.
    pub async fn write_at(
        &self,
        client: &Client,
        cred: &Credentials,
        offset: u64,
        data: &[u8],
    ) -> Result<WriteOutcome, FsError> {
        retrying!(self, client, cred, |fh| client
            .write_at(cred, &fh, self.ino, offset, data)
            .await)
    }

    /// [`Client::append`], re-opening after a session change; every try carries the same
    /// reply-cache id, so a try whose reply was lost is not appended twice.
    pub async fn append(
        &self,
        client: &Client,
        cred: &Credentials,
        data: &[u8],
    ) -> Result<(u64, WriteOutcome), FsError> {
        let _one = self.appends.lock().await;
        let pending = client.inner.requests.begin();
        retrying!(self, client, cred, |fh| client
            .append_as(cred, &fh, self.ino, data, &pending)
            .await)
    }

    /// [`Client::fsync`], re-opening after a session change.
    pub async fn fsync(
        &self,
        client: &Client,
        cred: &Credentials,
        data_only: bool,
    ) -> Result<(), FsError> {
        retrying!(self, client, cred, |fh| client
            .fsync(cred, &fh, self.ino, data_only)
            .await)
    }

    /// [`Client::release`] of the current handle; a handle of a replaced session is gone
    /// already, which is not an error here.
    pub async fn release(&self, client: &Client) -> Result<(), FsError> {
        if self.close_deferred() {
            return Ok(());
        }
        match client.release(&self.current()).await {
            Err(e) if is_stale(&e) => Ok(()),
            r => r,
        }
    }
}

impl Client {
    /// Notes `file` among this agent's open files: after a server restart or takeover it is
    /// opened again in the reclaim window, before the agent says its reclaim is complete
    /// (so that a file unlinked while open survives the restart). The FUSE mount notes
    /// every open file; the note goes when the last `Arc` does.
    pub fn track_open_file(&self, file: &std::sync::Arc<OpenFile>) {
        let mut files = self
            .inner
            .open_files
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        files.retain(|w| w.strong_count() > 0);
        files.push(std::sync::Arc::downgrade(file));
    }

    /// Whether the whole of small file `ino` is kept here under its lease (its reads need
    /// no handle), and no write of this node's own is on its way.
    pub(crate) fn holds_small_file(&self, ino: InodeId) -> bool {
        !self.own_writes_pending(ino) && self.inner.leases.holds_content(ino)
    }

    /// Counts an open answered here ([`OpenFile::deferred`]).
    pub(crate) fn note_open_here(&self) {
        super::bump(&self.inner.counters.opens_here);
    }

    /// Makes at the server every deferred open of `ino` ([`OpenFile::deferred`]): before a
    /// recall of its attribute lease is acknowledged (the change behind it may be an unlink:
    /// the open must be there first, so that the file lives on while open).
    pub(crate) async fn open_deferred(&self, ino: InodeId) {
        self.make_deferred(self.deferred_files(), Some(ino)).await;
    }

    /// Makes the opens of `files` of inode `ino` (of any inode: `None`).
    async fn make_deferred(&self, files: Vec<std::sync::Arc<OpenFile>>, ino: Option<InodeId>) {
        for f in files {
            if ino.is_none_or(|i| i == f.ino())
                && let Err(e) = f.opened_plainly(self).await
            {
                tracing::debug!(ino = %f.ino(), error = %e, "a deferred open could not be made");
            }
        }
    }

    /// [`Client::open_deferred`] of the file `name` in `parent` names, before this node
    /// unlinks it or renames another file over it; of every deferred open when the name's
    /// inode is not known here.
    pub(crate) async fn open_deferred_named(&self, parent: InodeId, name: &[u8]) {
        let deferred = self.deferred_files();
        if deferred.is_empty() {
            return;
        }
        let ino = match self.inner.leases.entry(parent, name) {
            Some(Some((a, _))) => Some(a.ino),
            Some(None) => return,
            None => None,
        };
        self.make_deferred(deferred, ino).await;
    }

    fn deferred_files(&self) -> Vec<std::sync::Arc<OpenFile>> {
        open_files(&self.inner)
            .into_iter()
            .filter(|f| f.deferred_open())
            .collect()
    }

    /// Opens `ino` as an [`OpenFile`] (re-opened by itself after a session change).
    pub async fn open_file(
        &self,
        cred: &Credentials,
        ino: InodeId,
        flags: OpenFlags,
    ) -> Result<OpenFile, FsError> {
        let (handle, _) = self.open(cred, ino, flags).await?;
        Ok(OpenFile::new(ino, flags, handle, cred))
    }
}

/// This agent's open files now ([`Client::track_open_file`]).
pub(super) fn open_files(inner: &super::Inner) -> Vec<std::sync::Arc<OpenFile>> {
    let mut all = inner.open_files.lock().unwrap_or_else(|e| e.into_inner());
    all.retain(|w| w.strong_count() > 0);
    all.iter().filter_map(std::sync::Weak::upgrade).collect()
}
