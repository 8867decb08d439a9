//! Small proxied writes journaled with their commit instead of flushing the LUNs
//! (`store::journal::DataJournal`), on the real server killed with SIGKILL: the data a write
//! acknowledged is written onto its LUN again at the next start when it may not have reached
//! the LUN's media (here the LUN files lose it while the server is down), in order, and a
//! client's later direct write of the same blocks is never overwritten by that replay (a
//! write grant settles the journal first).

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use sanfs_proto::pb;

use crate::crash_real::{Expect, Server, check, connect, free_port, fsck, setup};
use crate::harness::{Clients, root};
use crate::smallfile::{try_write, write};

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

    /// The LUN files as they are now (to put back with [`RealServer::put_luns`]).
    fn copy_luns(&self) -> Vec<Vec<u8>> {
        luns(self.dir())
            .iter()
            .map(|l| std::fs::read(l).unwrap())
            .collect()
    }

    fn put_luns(&self, images: &[Vec<u8>]) {
        for (l, img) in luns(self.dir()).iter().zip(images) {
            std::fs::write(l, img).unwrap();
        }
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_journaled_write_lost_by_its_lun_is_written_again_at_the_next_start() {
    let real = RealServer::new();
    let (mut server, mut c) = real.start().await;
    let (session, _) = c.open_session().await;
    let data = pattern(0x5a, 5000);
    let (ino, h) = c.create_file(session, "small").await;
    write(&mut c, session, h, ino, 0, &data).await;
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
    write(&mut c, session, h, ino, 0, &old).await;
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

/// The LUN files moved onto a tmpfs of their own (`size`), each replaced by a symbolic link
/// to its copy, so that a test can fill that tmpfs and make the LUNs refuse writes into their
/// holes (ENOSPC). Unmounted when dropped.
struct LunsOnTmpfs {
    mount: PathBuf,
}

impl LunsOnTmpfs {
    fn new(dir: &Path, size: &str) -> LunsOnTmpfs {
        let mount = dir.join("luns-tmpfs");
        std::fs::create_dir(&mount).unwrap();
        let st = std::process::Command::new("mount")
            .args([
                "-t",
                "tmpfs",
                "-o",
                &format!("size={size}"),
                "sanfs-luns-tmpfs",
            ])
            .arg(&mount)
            .status()
            .unwrap();
        assert!(st.success(), "mount a tmpfs on {}", mount.display());
        let moved = LunsOnTmpfs { mount };
        for lun in luns(dir) {
            let copy = moved.mount.join(lun.file_name().unwrap());
            let st = std::process::Command::new("cp")
                .arg("--sparse=always")
                .arg(&lun)
                .arg(&copy)
                .status()
                .unwrap();
            assert!(st.success(), "copy {}", lun.display());
            std::fs::remove_file(&lun).unwrap();
            std::os::unix::fs::symlink(&copy, &lun).unwrap();
        }
        moved
    }

    /// Fills the tmpfs (a file of its own) until it refuses a block.
    fn fill(&self) {
        use std::io::Write;
        let mut f = std::fs::File::create(self.mount.join("filler")).unwrap();
        for size in [1usize << 20, BLOCK as usize] {
            let chunk = vec![0xeeu8; size];
            // Bounded: the tmpfs is at most a few hundred MiB.
            for _ in 0..100_000 {
                match f.write(&chunk) {
                    Ok(n) if n == size => {}
                    Ok(_) => break,
                    Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => break,
                    Err(e) => panic!("filling the tmpfs: {e}"),
                }
            }
        }
    }

    fn empty(&self) {
        std::fs::remove_file(self.mount.join("filler")).unwrap();
    }
}

impl Drop for LunsOnTmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.mount)
            .status();
    }
}

/// The LUN (index) whose file holds the first block of `data` now.
fn lun_holding(dir: &Path, data: &[u8]) -> Option<usize> {
    let head = &data[..BLOCK as usize];
    luns(dir).iter().position(|lun| {
        let image = std::fs::read(lun).unwrap();
        image.chunks(BLOCK as usize).any(|block| block == head)
    })
}

/// A start whose journal holds acknowledged data for a LUN this server does not have now
/// refuses to serve (clients that have the LUN would read the bytes from before the write,
/// and a later replay could put the journaled bytes over what they wrote since); once the
/// LUN is back the next start writes the data and serves it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_without_the_lun_of_journaled_data_refuses_to_serve() {
    let real = RealServer::new();
    let (mut server, mut c) = real.start().await;
    let (session, _) = c.open_session().await;
    let data = pattern(0x6b, 5000);
    let (ino, h) = c.create_file(session, "small").await;
    write(&mut c, session, h, ino, 0, &data).await;
    server.kill();
    let lun = lun_holding(real.dir(), &data).expect("the written block on a LUN");
    let path = &luns(real.dir())[lun];
    let away = path.with_extension("away");
    std::fs::rename(path, &away).unwrap();
    let mut server = Server::start(&real.config, &real.dir().join("mds.log"));
    let status = server
        .exited_within(std::time::Duration::from_secs(30))
        .expect("a start without the LUN of journaled data stops by itself");
    assert!(!status.success(), "{status}");
    let log = std::fs::read_to_string(real.dir().join("mds.log")).unwrap();
    assert!(
        log.contains(&format!("could not be written to LUN {lun}")),
        "{log}"
    );
    // Back, having lost the block meanwhile: the journal writes it again.
    std::fs::rename(&away, path).unwrap();
    assert_eq!(lose_from_luns(real.dir(), &data), 1);
    let (mut server, mut c) = real.start().await;
    let (session, _) = c.open_session().await;
    check(&mut c, session, "small", &Expect::Present(data.clone())).await;
    server.kill();
    real.fsck_clean();
}

/// A journaled write is written to its LUN beside its durable commit: when the LUN refuses
/// it after the commit may be durable, the writer gets an error, the server stops by itself
/// (fail-stop) instead of serving blocks whose bytes are not on the LUN, and the next start
/// writes the journaled bytes there: the file reads back whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_journaled_write_its_lun_refuses_stops_the_server_and_is_written_at_the_next_start() {
    if sanfs_testcluster::skip_unless_root("LUNs on a small tmpfs") {
        return;
    }
    let real = RealServer::new();
    let tmpfs = LunsOnTmpfs::new(real.dir(), "256m");
    let (mut server, mut c) = real.start().await;
    let (session, _) = c.open_session().await;
    let first = pattern(0x21, 5000);
    let (ino, h) = c.create_file(session, "first").await;
    write(&mut c, session, h, ino, 0, &first).await;
    // Fresh blocks of the next file are holes in the LUN files: refused now.
    let (ino, h) = c.create_file(session, "second").await;
    tmpfs.fill();
    let data = pattern(0x42, 5000);
    let refused = try_write(&mut c, session, h, ino, 0, &data).await;
    assert!(refused.is_err(), "a write its LUN refused: {refused:?}");
    let status = server
        .exited_within(std::time::Duration::from_secs(30))
        .expect("the server stops by itself after a journaled write failed on its LUN");
    assert!(!status.success(), "{status}");
    let log = std::fs::read_to_string(real.dir().join("mds.log")).unwrap();
    assert!(log.contains("a journaled write failed on its LUN"), "{log}");
    // Room again: the next start writes the journaled bytes onto the LUN.
    tmpfs.empty();
    let (mut server, mut c) = real.start().await;
    let (session, _) = c.open_session().await;
    check(&mut c, session, "first", &Expect::Present(first)).await;
    check(&mut c, session, "second", &Expect::Present(data.clone())).await;
    // On the LUN now, not only in the journal: lose it there and it is gone for good (the
    // start settled it).
    server.kill();
    assert_eq!(
        lose_from_luns(real.dir(), &data),
        1,
        "the written block on a LUN"
    );
    real.fsck_clean();
    drop(tmpfs);
}

/// A seeded run of proxied writes (new files, overwrites, unaligned extensions, across stripe
/// units and LUNs, up to 200 KiB each) that are all journaled and never settled; `kill -9`;
/// then every LUN is put back as it was before the server first started (it lost every
/// unflushed write). The next start writes the journal's data again, in order: every file
/// reads back exactly as the last acknowledged writes left it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_journaled_write_comes_back_in_order_onto_luns_that_lost_them_all() {
    let seed = crate::crash::seed_from_env();
    eprintln!("journaled replay seed {seed} (SANFS_CRASH_SEED to replay)");
    let mut rng = crate::crash_real::Rng(seed | 1);
    let real = RealServer::new();
    let blank = real.copy_luns();
    let (mut server, mut c) = real.start().await;
    let (session, _) = c.open_session().await;
    let mut files: Vec<(String, u64, u64, Vec<u8>)> = Vec::new();
    let mut total = 0usize;
    // Below the 4 MiB that would make a write settle first.
    while total < 3 << 20 {
        let pick = rng.next() % 4;
        if pick == 0 || files.is_empty() {
            let name = format!("f{}", files.len());
            let (ino, h) = c.create_file(session, &name).await;
            files.push((name, ino, h, Vec::new()));
            continue;
        }
        let i = (rng.next() % files.len() as u64) as usize;
        let (_, ino, h, model) = &mut files[i];
        let len = 1 + (rng.next() % (200 << 10)) as usize;
        // Overwrite inside, or extend from anywhere up to just past the end.
        let off = (rng.next() % (model.len() as u64 + 5000)) as usize;
        let bytes: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
        write(&mut c, session, *h, *ino, off as u64, &bytes).await;
        if model.len() < off + len {
            model.resize(off + len, 0);
        }
        model[off..off + len].copy_from_slice(&bytes);
        total += len;
    }
    server.kill();
    real.put_luns(&blank);
    let (mut server, mut c) = real.start().await;
    let (session, _) = c.open_session().await;
    for (name, _, _, model) in &files {
        check(&mut c, session, name, &Expect::Present(model.clone())).await;
    }
    eprintln!(
        "seed {seed}: {} files, {total} bytes written, all back",
        files.len()
    );
    server.kill();
    real.fsck_clean();
}
