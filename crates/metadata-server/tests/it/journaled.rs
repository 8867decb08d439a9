//! Small proxied writes journaled with their commit instead of flushing the LUNs
//! (`store::journal::DataJournal`): the data a write acknowledged is rewritten onto its LUN at
//! the next start when it may not have reached the LUN's media (here: the LUN files lose it
//! while the server is down after a `kill -9`), and a client's later direct write of the same blocks is never
//! overwritten by that replay (a write grant settles the journal first).

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use sanfs_proto::pb;

use crate::crash_real::{Expect, Server, check, connect, free_port, fsck, setup};
use crate::harness::{Clients, root};

const BLOCK: u64 = 4096;
/// Nothing is settled in the background during a test (an hour).
const NEVER: u64 = 3_600_000;

fn luns(dir: &Path) -> Vec<PathBuf> {
    (0..4).map(|i| dir.join(format!("lun{i}"))).collect()
}

/// `len` bytes no other test writes, distinct per `tag`.
fn pattern(tag: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| tag ^ (i as u8).wrapping_mul(31) ^ (i >> 8) as u8)
        .collect()
}

/// The LUN blocks that hold the first block of `data` (as the LUN files are now): wiped to
/// zeros, as a LUN that loses its volatile cache at a power cut would lose them. Answers how
/// many blocks were wiped.
fn lose_from_luns(dir: &Path, data: &[u8]) -> usize {
    let head = &data[..BLOCK as usize];
    let mut wiped = 0;
    for lun in luns(dir) {
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&lun)
            .unwrap();
        let len = f.metadata().unwrap().len();
        let mut buf = vec![0u8; 1 << 20];
        let mut at = 0;
        while at < len {
            let n = (len - at).min(buf.len() as u64) as usize;
            f.read_exact_at(&mut buf[..n], at).unwrap();
            for (i, block) in buf[..n].chunks(BLOCK as usize).enumerate() {
                if block == head {
                    f.write_all_at(&vec![0u8; BLOCK as usize], at + i as u64 * BLOCK)
                        .unwrap();
                    wiped += 1;
                }
            }
            at += n as u64;
        }
        f.sync_all().unwrap();
    }
    wiped
}

/// The real `sanfs-mds` over four LUN files in a directory of its own, settling nothing in
/// the background; started again after each `kill -9`.
struct RealServer {
    dir: tempfile::TempDir,
    config: PathBuf,
    addr: std::net::SocketAddr,
}

impl RealServer {
    fn new() -> RealServer {
        let dir = tempfile::tempdir().unwrap();
        let port = free_port();
        let config = setup(dir.path(), port);
        let text = std::fs::read_to_string(&config).unwrap();
        std::fs::write(
            &config,
            text.replacen("[server]\n", &format!("[server]\nsettle_ms = {NEVER}\n"), 1),
        )
        .unwrap();
        let addr = format!("127.0.0.1:{port}").parse().unwrap();
        RealServer { dir, config, addr }
    }

    fn dir(&self) -> &Path {
        self.dir.path()
    }

    async fn start(&self) -> (Server, Clients) {
        let mut server = Server::start(&self.config, &self.dir.path().join("mds.log"));
        let c = Clients::new(connect(self.addr, &mut server).await);
        (server, c)
    }

    fn fsck_clean(&self) {
        let (code, out) = fsck(&self.config);
        assert_eq!(code, 0, "fsck after the kills:\n{out}");
    }
}

async fn write(c: &mut Clients, session: u64, handle: u64, ino: u64, data: &[u8]) {
    c.data
        .write(pb::WriteRequest {
            cred: root(),
            session,
            handle,
            inode: ino,
            offset: 0,
            data: data.to_vec(),
            sync: false,
            append: false,
            request_id: None,
            then_set_attr: None,
        })
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_journaled_write_lost_by_its_lun_is_written_again_at_the_next_start() {
    let real = RealServer::new();
    let (mut server, mut c) = real.start().await;
    let (session, _) = c.open_session().await;
    let data = pattern(0x5a, 5000);
    let (ino, h) = c.create_file(session, "small").await;
    write(&mut c, session, h, ino, &data).await;
    // kill -9, and the LUN loses the block the server wrote and never flushed.
    server.kill();
    assert_eq!(
        lose_from_luns(real.dir(), &data),
        1,
        "the written block on a LUN"
    );
    let (mut server, mut c) = real.start().await;
    // The acknowledged bytes are back from the journal.
    let (session, _) = c.open_session().await;
    check(&mut c, session, "small", &Expect::Present(data.clone())).await;
    // Written again and settled at the start: on the LUN, and the journal lets it be.
    server.kill();
    assert_eq!(lose_from_luns(real.dir(), &data), 1);
    real.fsck_clean();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_write_after_a_journaled_one_is_never_overwritten_by_its_replay() {
    let real = RealServer::new();
    let (mut server, mut c) = real.start().await;
    let (session, epoch) = c.open_session().await;
    let old = pattern(0x11, 2 * BLOCK as usize);
    let new = pattern(0x77, 2 * BLOCK as usize);
    let (ino, h) = c.create_file(session, "both").await;
    // Journaled by the server, not settled.
    write(&mut c, session, h, ino, &old).await;
    // A client writes the same blocks itself, under a write grant, durably.
    let grant = c
        .data
        .map_write(pb::MapRequest {
            cred: root(),
            session,
            epoch,
            handle: h,
            inode: ino,
            offset: 0,
            length: 2 * BLOCK,
            sync: true,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let lun_files = luns(real.dir());
    for io in &grant.device_ios {
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&lun_files[io.device as usize])
            .unwrap();
        let mut bytes = Vec::new();
        for piece in &io.iov {
            bytes.extend_from_slice(
                &new[piece.buf_off as usize..(piece.buf_off + piece.len) as usize],
            );
        }
        f.write_all_at(&bytes, io.phys_off).unwrap();
        f.sync_all().unwrap();
    }
    c.data
        .complete(pb::CompleteRequest {
            session,
            epoch,
            grant_id: grant.grant_id,
            status: pb::IoStatus::Ok as i32,
            bytes_done: 2 * BLOCK,
            sync: true,
            ..Default::default()
        })
        .await
        .unwrap();
    server.kill();
    let (mut server, mut c) = real.start().await;
    // Not the older journaled bytes, replayed over the client's.
    let (session, _) = c.open_session().await;
    check(&mut c, session, "both", &Expect::Present(new)).await;
    server.kill();
    real.fsck_clean();
}
