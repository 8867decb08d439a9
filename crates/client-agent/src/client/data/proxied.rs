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
            let mut span = crate::stages::Span::wall(crate::stages::Stage::Proxied);
            span.set_bytes(want as u64);
            let reply: ReadReply = self
                .call("Read reply", Pin::Handle(fh), |_| {
                    let mut data = self.data();
                    let req = req.clone();
                    async move { data.read(req).await }
                })
                .await?;
            drop(span);
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

    /// Writes `data` at `offset` through the server, in calls of at most
    /// `max_inline_bytes`; the attribute changes `then` go with the last of them.
    #[allow(
        clippy::too_many_arguments,
        reason = "one proxied write's fields, each distinct"
    )]
    pub(super) async fn proxied_write(
        &self,
        view: &SessionView,
        cred: &Credentials,
        fh: &FileHandle,
        ino: InodeId,
        offset: u64,
        data: &[u8],
        then: Option<&SetAttr>,
    ) -> Result<Option<Attr>, FsError> {
        let chunk = view.server.max_inline_bytes.max(1) as usize;
        let mut attr = None;
        let mut done = 0usize;
        while done < data.len() {
            let piece = &data[done..(done + chunk).min(data.len())];
            let position = WritePosition::At(offset + done as u64);
            // The attribute changes go with the last piece (after every byte).
            let last = done + piece.len() == data.len();
            let then = then.filter(|_| last).cloned();
            let reply = self
                .proxied_write_one(cred, fh, ino, position, piece, None, then)
                .await?;
            attr = Some(reply.attr);
            done += piece.len();
        }
        Ok(attr)
    }

    /// One proxied Write of all of `data` (at most `max_inline_bytes`) at `position`, with
    /// the reply-cache id `once` (appends) and the attribute changes `then` applied after it
    /// (`ServerInfo::write_sets_attr`): a reply that wrote less is an error.
    #[allow(
        clippy::too_many_arguments,
        reason = "one proxied Write's fields, each distinct"
    )]
    pub(super) async fn proxied_write_one(
        &self,
        cred: &Credentials,
        fh: &FileHandle,
        ino: InodeId,
        position: WritePosition,
        data: &[u8],
        once: Option<pb::RequestId>,
        then: Option<SetAttr>,
    ) -> Result<WriteReply, FsError> {
        let mut req = pb::WriteRequest::from(WriteRequest {
            cred: cred.clone(),
            handle: handle_ref(fh),
            inode: ino,
            position,
            data: data.to_vec(),
            sync: false,
            then,
        });
        req.request_id = once;
        bump(&self.counters.proxied_writes);
        let mut span = crate::stages::Span::wall(crate::stages::Stage::Proxied);
        span.set_bytes(data.len() as u64);
        // The call waits for the creates this agent answered to reach the server: first,
        // so that a create's reply (which renews what is cached of its file) does not come
        // after the mark and leave the write's answer unused.
        self.creates.drain().await;
        let mark = self.leases.mark();
        let sent = std::time::Instant::now();
        let reply: WriteReply = self
            .call("Write reply", Pin::Handle(fh), |_| {
                let mut client = self.data();
                let req = req.clone();
                async move { client.write(req).await }
            })
            .await?;
        // The size and mtime moved (also for a write held back earlier and written back
        // now): what the lease cache holds of them goes (the server recalls only the other
        // nodes' leases), replaced by the reply's under the lease that came with it.
        // A small file written whole by this call: its bytes are kept too, under that lease.
        let whole = (position == WritePosition::At(0) && reply.written.len() == data.len() as u64)
            .then_some(data);
        self.leases.put_own_write(
            &reply.attr,
            reply.lease_ms,
            sent,
            self.lease_deadline(),
            mark,
            whole,
        );
        if reply.written.len() != data.len() as u64 {
            return Err(FsError::Io(format!(
                "proxied write of {} bytes wrote {}",
                data.len(),
                reply.written.len()
            )));
        }
        add(&self.counters.proxied_write_bytes, data.len() as u64);
        Ok(reply)
    }
}
