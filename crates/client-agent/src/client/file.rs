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
use sanfs_proto::types::{Credentials, FsError, InodeId};

use super::{Client, FileHandle, WriteOutcome};

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
        let mut reopens = 0u32;
        let mut $fh = $file.current();
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
