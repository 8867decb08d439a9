//! The proxied path: Read and Write through the server, chunked to `max_inline_bytes`.

use super::*;

impl Inner {
    pub(super) async fn proxied_read(
        &self,
        view: &SessionView,
        cred: &Credentials,
        fh: &FileHandle,
        ino: InodeId,
        offset: u64,
        buf: &mut [u8],
    ) -> Result<usize, FsError> {
        let chunk = view.server.max_inline_bytes.max(1) as usize;
        let mut done = 0usize;
        while done < buf.len() {
            let want = (buf.len() - done).min(chunk);
            let req = ReadRequest {
                cred: cred.clone(),
                handle: handle_ref(fh),
                inode: ino,
                range: ByteRange::new(offset + done as u64, want as u64)?,
            };
            bump(&self.counters.proxied_reads);
            let req = pb::ReadRequest::from(req);
            let reply: ReadReply = self
                .call("Read reply", Pin::Handle(fh), |_| {
                    let mut data = self.data();
                    let req = req.clone();
                    async move { data.read(req).await }
                })
                .await?;
            let n = reply.data.len().min(want);
            buf[done..done + n].copy_from_slice(&reply.data[..n]);
            add(&self.counters.proxied_read_bytes, n as u64);
            done += n;
            if n < want {
                break;
            }
        }
        Ok(done)
    }

    pub(super) async fn proxied_write(
        &self,
        view: &SessionView,
        cred: &Credentials,
        fh: &FileHandle,
        ino: InodeId,
        offset: u64,
        data: &[u8],
    ) -> Result<Option<Attr>, FsError> {
        let chunk = view.server.max_inline_bytes.max(1) as usize;
        let mut attr = None;
        let mut done = 0usize;
        while done < data.len() {
            let piece = &data[done..(done + chunk).min(data.len())];
            let req = WriteRequest {
                cred: cred.clone(),
                handle: handle_ref(fh),
                inode: ino,
                position: WritePosition::At(offset + done as u64),
                data: piece.to_vec(),
                sync: false,
            };
            bump(&self.counters.proxied_writes);
            let req = pb::WriteRequest::from(req);
            let reply: WriteReply = self
                .call("Write reply", Pin::Handle(fh), |_| {
                    let mut data = self.data();
                    let req = req.clone();
                    async move { data.write(req).await }
                })
                .await?;
            if reply.written.len() != piece.len() as u64 {
                return Err(FsError::Io(format!(
                    "proxied write of {} bytes wrote {}",
                    piece.len(),
                    reply.written.len()
                )));
            }
            attr = Some(reply.attr);
            add(&self.counters.proxied_write_bytes, piece.len() as u64);
            done += piece.len();
        }
        Ok(attr)
    }
}
