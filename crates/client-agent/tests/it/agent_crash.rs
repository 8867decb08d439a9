//! Acceptance, agent crash (issue 5): `kill -9` of a real `sanfs-agent` (node A, its own
//! network namespace, its LUN writes slowed by a blkio throttle so that the kill lands inside
//! a grant) in the middle of large writes through its FUSE mount. Node B (in-process, another
//! namespace) then reads the range A was writing: it proceeds once A's session has expired
//! (measured from the kill and printed; the bound asserted is generous), and every sector it
//! reads is A's new data, the file's old data, or zeros; never the blocks of the file deleted
//! before (the LUNs were first filled with a stamped file that was then unlinked, so A's new
//! blocks are that file's old blocks). Up to six attempts, until one kill lands while A holds a
//! write grant on new blocks (the server's `sanfs_expired_grants_total` grows and the victim keeps
//! unwritten extents). Needs root and /dev/fuse.

use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

use sanfs_client_agent::client::Client;
use sanfs_proto::types::{Credentials, FsError, InodeId, ROOT_INODE};
use sanfs_testcluster::Throttle;

use crate::cluster::rw;
use crate::san::{self, MIB, Rng, San, SanOptions, metric, read_raw};

const TTL_MS: u64 = 2000;
const ATTEMPTS: usize = 6;
/// The victim file: old data in [0, V), a hole in [V, 2V); A writes [V, 2V) then [0, V).
const V: u64 = 8 * MIB;
const SECTOR: usize = 512;
/// Per-LUN write cap for A.
const THROTTLE_BPS: u64 = 4 << 20;

/// A sector stamped with `tag` and the byte offset of each 16-byte record.
fn stamp(tag: &[u8; 8], off: u64, len: usize) -> Vec<u8> {
    let mut v = Vec::with_capacity(len);
    let mut at = off;
    while v.len() < len {
        v.extend_from_slice(tag);
        v.extend_from_slice(&at.to_le_bytes());
        at += 16;
    }
    v.truncate(len);
    v
}

const NEW: &[u8; 8] = b"AGENT-A!";
const OLD: &[u8; 8] = b"OLD-DATA";
const DELETED: &[u8; 8] = b"DELETED!";

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

#[derive(Debug, Default)]
struct Sectors {
    new: u64,
    old: u64,
    zero: u64,
    torn: u64,
}

/// Whether `sector` (at file offset `off`) is a write of A's torn by the kill: A's new bytes
/// up to some byte, then what was there before (zeros, or the old data below `V`). A 1 MiB
/// `pwrite` from a buffer that is not page aligned reaches FUSE as two requests (1 MiB - m,
/// then m bytes, m the buffer's offset in its page); a kill between them leaves the last
/// block of that MiB written up to byte 4096 - m. The application never saw that write
/// succeed, and the bytes are its own, at their own offset: allowed, but only there.
fn torn_write(sector: &[u8], off: u64) -> bool {
    if off % MIB < MIB - 4096 {
        return false;
    }
    let new = stamp(NEW, off, SECTOR);
    let before = if off < V {
        stamp(OLD, off, SECTOR)
    } else {
        vec![0u8; SECTOR]
    };
    let cut = sector.iter().zip(&new).take_while(|(a, b)| a == b).count();
    cut > 0 && sector[cut..] == before[cut..]
}

/// Fills the volume with a stamped file until it is full, then unlinks it.
async fn leave_a_deleted_file(c: std::sync::Arc<Client>) -> u64 {
    let cred = Credentials::root();
    let f = c
        .create(&cred, ROOT_INODE, "deleted", 0o644, false, rw())
        .await
        .unwrap();
    let chunk = 8 * MIB;
    let mut off = 0;
    for _ in 0..256 {
        match c
            .write_at(
                &cred,
                &f.handle,
                f.attr.ino,
                off,
                &stamp(DELETED, off, chunk as usize),
            )
            .await
        {
            Ok(_) => off += chunk,
            Err(FsError::NoSpace) => break,
            Err(e) => panic!("filling the volume: {e}"),
        }
    }
    c.fsync(&cred, &f.handle, f.attr.ino, false).await.unwrap();
    c.release(&f.handle).await.unwrap();
    c.unlink(&cred, ROOT_INODE, "deleted").await.unwrap();
    off
}

#[test]
fn killed_agent_leaves_no_stale_blocks_and_the_other_node_proceeds() {
    if !san::can_mount("the agent crash test") {
        return;
    }
    let seed = san::seed("agent crash");
    let mut rng = Rng::new(seed);
    let san = San::start(SanOptions {
        lun_size: 64 * MIB,
        lease_ttl_ms: TTL_MS,
        ..SanOptions::default()
    });
    let b = san.node(1, "survivor");
    let filled = b.run(leave_a_deleted_file);
    eprintln!(
        "agent crash: a {} MiB stamped file filled the volume and was unlinked",
        filled / MIB
    );
    let mut landed = false;
    // Where in A's writes the kill lands depends on the machine's load: the next attempt
    // kills earlier when A had written past the hole, later when it had not started.
    let mut delay_scale = 1.0f64;
    for attempt in 0..ATTEMPTS {
        let name = format!("victim{attempt}");
        let n2 = name.clone();
        let ino: InodeId = b.run(move |c| async move {
            let cred = Credentials::root();
            let f = c
                .create(&cred, ROOT_INODE, n2.as_str(), 0o644, false, rw())
                .await
                .unwrap();
            c.write_at(&cred, &f.handle, f.attr.ino, 0, &stamp(OLD, 0, V as usize))
                .await
                .unwrap();
            c.truncate(&cred, Some(&f.handle), f.attr.ino, 2 * V)
                .await
                .unwrap();
            f.attr.ino
        });
        let mut a = san.mount_agent(0, &format!("doomed{attempt}"), &san.globs(), "");
        let throttle = if san.luns.is_loop() {
            let limits: Vec<_> = san
                .luns
                .paths()
                .iter()
                .map(|p| (p.as_path(), 0, THROTTLE_BPS))
                .collect();
            match Throttle::create("crash", &limits) {
                Ok(t) => {
                    t.add_pid(a.child.pid()).unwrap();
                    Some(t)
                }
                Err(e) => {
                    eprintln!("agent crash: no blkio throttle ({e}); A writes at full speed");
                    None
                }
            }
        } else {
            None
        };
        let path = a.p(&name);
        let writer = std::thread::spawn(move || {
            let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
            let order = (V / MIB..2 * V / MIB).chain(0..V / MIB);
            let mut done = 0u64;
            for mib in order {
                let off = mib * MIB;
                if f.write_all_at(&stamp(NEW, off, MIB as usize), off).is_err() {
                    break;
                }
                done += 1;
            }
            done
        });
        // Into A's writes of the hole (the first 8 MiB, at about 16 MiB/s with the throttle),
        // where they allocate blocks.
        let base_ms = if throttle.is_some() {
            80 + rng.below(300)
        } else {
            5 + rng.below(30)
        };
        let delay_ms = ((base_ms as f64) * delay_scale) as u64;
        std::thread::sleep(Duration::from_millis(delay_ms));
        let expired_before = metric(&san.server_metrics(), "sanfs_expired_grants_total", &[]);
        a.kill9();
        let killed = Instant::now();
        let completed = writer.join().unwrap();
        let got = b.run(move |c| async move {
            let cred = Credentials::root();
            let (fh, _) = c.open(&cred, ino, rw()).await.unwrap();
            c.read_at(&cred, &fh, ino, 0, 2 * V).await.unwrap()
        });
        let proceeded = killed.elapsed();
        let expired =
            metric(&san.server_metrics(), "sanfs_expired_grants_total", &[]) - expired_before;
        assert_eq!(got.len() as u64, 2 * V);
        let mut s = Sectors::default();
        for (i, sector) in got.chunks(SECTOR).enumerate() {
            let off = (i * SECTOR) as u64;
            if sector == stamp(NEW, off, SECTOR) {
                s.new += 1;
            } else if off < V && sector == stamp(OLD, off, SECTOR) {
                s.old += 1;
            } else if sector.iter().all(|&x| x == 0) {
                s.zero += 1;
            } else if torn_write(sector, off) {
                s.torn += 1;
            } else if contains(sector, DELETED) {
                panic!(
                    "sector at {off} shows the deleted file's old block (attempt {attempt}, seed {seed})"
                );
            } else {
                panic!(
                    "sector at {off} is neither new, old nor zero (attempt {attempt}, seed {seed}): \
                     starts {:02x?}, ends {:02x?}",
                    &sector[..32],
                    &sector[SECTOR - 32..]
                );
            }
        }
        // Where A's uncompleted range lies on the LUNs: unwritten extents over the deleted
        // file's stamped blocks.
        let layout =
            b.run(move |c| async move { c.bmap(&Credentials::root(), ino).await.unwrap() });
        let mut unwritten = 0u64;
        let mut deleted_beneath = 0u64;
        let mut new_beneath = 0u64;
        // Inside the file (B read all of it); past its end lie only blocks allocated ahead of
        // A's writer (a layout asked ahead, speculative preallocation), which no read reaches
        // and the file's last close frees.
        for e in layout
            .entries
            .iter()
            .filter(|e| e.state == "unwritten" && e.file_off < 2 * V)
        {
            unwritten += e.len;
            let raw = read_raw(
                std::path::Path::new(e.device_path.as_deref().unwrap()),
                e.phys_off,
                e.len,
            );
            for (i, c) in raw.chunks(SECTOR).enumerate() {
                if contains(c, DELETED) {
                    deleted_beneath += SECTOR as u64;
                } else if c == stamp(NEW, e.file_off + (i * SECTOR) as u64, SECTOR) {
                    new_beneath += SECTOR as u64;
                }
            }
            // What lies beneath, the read showed as zeros.
            let at = e.file_off as usize;
            let inside = e.len.min(2 * V - e.file_off) as usize;
            assert!(
                got[at..at + inside].iter().all(|&x| x == 0),
                "an unwritten extent at {} reads as zeros",
                e.file_off
            );
        }
        eprintln!(
            "agent crash: attempt {attempt}: killed {delay_ms} ms in ({completed} MiB written by then); write grants expired with A's session: {expired}; B proceeded {} ms after the kill (lease TTL {TTL_MS} ms); B read sectors: A's new data {}, old data {}, zeros {}, torn at the end of an unacknowledged write {}; {} KiB left unwritten (reading as zeros), beneath them {} KiB of A's unacknowledged data and {} KiB of the deleted file",
            proceeded.as_millis(),
            s.new,
            s.old,
            s.zero,
            s.torn,
            unwritten / 1024,
            new_beneath / 1024,
            deleted_beneath / 1024
        );
        assert!(
            proceeded < Duration::from_millis(TTL_MS + 10_000),
            "B waited {proceeded:?}"
        );
        // B writes over the dead agent's range and reads it back.
        let check = rng.bytes(MIB as usize);
        let c2 = check.clone();
        let back = b.run(move |c| async move {
            let cred = Credentials::root();
            let (fh, _) = c.open(&cred, ino, rw()).await.unwrap();
            c.write_at(&cred, &fh, ino, V, &c2).await.unwrap();
            c.read_at(&cred, &fh, ino, V, MIB).await.unwrap()
        });
        assert!(back == check, "B writes where A died");
        drop(throttle);
        drop(a);
        // Done once a kill landed inside a write grant on newly allocated blocks (the
        // uncompleted range then exists and was read as zeros).
        if expired > 0.0 && unwritten > 0 {
            landed = true;
            break;
        }
        if completed >= V / MIB {
            delay_scale *= 0.5;
        } else if completed == 0 {
            delay_scale *= 1.5;
        }
    }
    assert!(
        landed,
        "no kill landed inside a write grant on new blocks in {ATTEMPTS} attempts"
    );
}
