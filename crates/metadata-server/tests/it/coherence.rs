//! The proxied path and the direct path on real (file-backed) LUNs formatted by `format`:
//! a "direct" client that does the device I/O itself from grants (plain pread/pwrite on the
//! LUN files, as an agent would with O_DIRECT), and proxied reads and writes through the
//! server, interleaved at random on shared files; every read is checked against a model.

use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use sanfs_blockmap::plan::IoPlan;
use sanfs_mds::clock::Clock;
use sanfs_mds::data;
use sanfs_mds::datadev::DataDevices;
use sanfs_mds::ns;
use sanfs_mds::proxy::{DataPath, Position};
use sanfs_mds::store::{Backend, ROOT, Store};
use sanfs_proto::model::{CreateRequest, OpenFlags};
use sanfs_proto::types::{Credentials, InodeId, SessionId};
use sanfs_testcluster::mds;

use crate::support::{MIB, name};

pub struct Cluster {
    pub dir: tempfile::TempDir,
    pub luns: Vec<PathBuf>,
    pub dp: DataPath,
}

pub fn cluster() -> Cluster {
    let dir = tempfile::tempdir().unwrap();
    let luns = mds::file_luns(dir.path(), 4, 64 * MIB).unwrap();
    let backend = Backend::File(dir.path().join("meta.redb"));
    mds::format(
        &mds::striped(&luns, 4096, 64 * 1024),
        &backend,
        &Clock::System,
    )
    .unwrap();
    let store = Arc::new(Store::open(&backend, Clock::System, 64).unwrap());
    let devices = Arc::new(DataDevices::open(&store.volume(), &luns));
    assert_eq!(devices.present(), 4);
    let dp = DataPath::new(store, devices, Duration::from_secs(10));
    Cluster { dir, luns, dp }
}

pub fn create(dp: &DataPath, n: &str) -> u64 {
    create_in(&dp.store, n)
}

/// Creates a regular file in the root of `store`; returns its inode.
pub fn create_in(store: &Store, n: &str) -> u64 {
    try_create_in(store, n).unwrap()
}

/// [`create_in`] that answers the store's error.
pub fn try_create_in(store: &Store, n: &str) -> Result<u64, sanfs_proto::types::FsError> {
    let n = name(n);
    store
        .write_blocking(move |ctx| {
            ns::create(
                ctx,
                &CreateRequest {
                    delegate: false,
                    inode: None,
                    time: None,
                    cred: Credentials::root(),
                    session: SessionId(1),
                    parent: InodeId(ROOT),
                    name: n,
                    perm: 0o644,
                    exclusive: true,
                    flags: OpenFlags {
                        read: true,
                        write: true,
                        append: false,
                        truncate: false,
                    },
                },
            )
        })
        .map(|r| r.attr.ino.0)
}

/// The direct client's device I/O for a plan: pwrite/pread on the LUN files.
pub fn device_write(luns: &[PathBuf], plan: &IoPlan, buf: &[u8]) {
    for io in &plan.device_ios {
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&luns[io.device.as_usize()])
            .unwrap();
        let mut tmp = Vec::with_capacity(io.len as usize);
        for p in &io.iov {
            tmp.extend_from_slice(&buf[p.buf_off as usize..(p.buf_off + p.len) as usize]);
        }
        f.write_all_at(&tmp, io.phys_off).unwrap();
    }
}

pub fn device_read(luns: &[PathBuf], plan: &IoPlan, buf: &mut [u8]) {
    for z in &plan.zero_fill {
        buf[z.buf_off as usize..(z.buf_off + z.len) as usize].fill(0);
    }
    for io in &plan.device_ios {
        let f = std::fs::File::open(&luns[io.device.as_usize()]).unwrap();
        let mut tmp = vec![0u8; io.len as usize];
        f.read_exact_at(&mut tmp, io.phys_off).unwrap();
        let mut at = 0;
        for p in &io.iov {
            buf[p.buf_off as usize..(p.buf_off + p.len) as usize]
                .copy_from_slice(&tmp[at..at + p.len as usize]);
            at += p.len as usize;
        }
    }
}

/// Compares a read with the model, naming the first file offset that differs.
fn same(got: &[u8], want: &[u8], off: u64, step: usize) {
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
        panic!(
            "step {step}: file byte {} reads {:#04x}, the model says {:#04x}",
            off + i as u64,
            got[i],
            want[i]
        );
    }
    assert_eq!(got.len(), want.len(), "step {step}");
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn direct_and_proxied_io_interleave_coherently() {
    let seed: u64 = std::env::var("SANFS_COHERENCE_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0xC0FFEE);
    eprintln!("coherence seed {seed} (SANFS_COHERENCE_SEED to replay)");
    let c = cluster();
    let dp = &c.dp;
    let bs = 4096u64;
    let files: Vec<u64> = (0..3).map(|i| create(dp, &format!("f{i}"))).collect();
    let mut model: Vec<Vec<u8>> = vec![Vec::new(); files.len()];
    let mut rng = Rng(seed | 1);
    let vol = dp.store.volume().clone();
    for step in 0..300 {
        let fi = rng.below(files.len() as u64) as usize;
        let ino = files[fi];
        let m = &mut model[fi];
        match rng.below(4) {
            // Direct write from a grant: aligned, 4 KiB .. 512 KiB.
            0 => {
                let off = rng.below(256) * bs;
                let len = (1 + rng.below(128)) * bs;
                let v = vol.clone();
                let g = dp
                    .store
                    .write(move |ctx| data::map_write(ctx, &v, InodeId(ino), off, len))
                    .await
                    .unwrap();
                let fill = (step as u8).wrapping_mul(31) | 1;
                let buf: Vec<u8> = (0..len).map(|i| fill ^ (i as u8)).collect();
                device_write(&c.luns, &g.plan, &buf);
                let attr = dp
                    .store
                    .write_data(true, sanfs_mds::store::Luns::All, move |ctx| {
                        data::complete_write(ctx, InodeId(ino), off, len, false)
                    })
                    .await
                    .unwrap()
                    .0;
                let end = (off + len) as usize;
                if m.len() < end {
                    m.resize(end, 0);
                }
                m[off as usize..end].copy_from_slice(&buf);
                assert_eq!(attr.size, m.len() as u64, "step {step}");
            }
            // Proxied write: any offset and length.
            1 => {
                let off = rng.below(1 << 20);
                let len = 1 + rng.below(70_000);
                let fill = (step as u8).wrapping_mul(17) | 1;
                let buf: Vec<u8> = (0..len).map(|i| fill ^ (i as u8).rotate_left(3)).collect();
                let (at, attr) = dp
                    .write(ino, Position::At(off), buf.clone(), true, 0, None)
                    .await
                    .unwrap();
                assert_eq!(at, off);
                let end = (off + len) as usize;
                if m.len() < end {
                    m.resize(end, 0);
                }
                m[off as usize..end].copy_from_slice(&buf);
                assert_eq!(attr.size, m.len() as u64, "step {step}");
            }
            // Direct read from a grant.
            2 => {
                let off = rng.below(300) * bs;
                let len = (1 + rng.below(64)) * bs;
                let g = dp
                    .store
                    .read(|t| data::map_read(t, &vol, bs as u32, InodeId(ino), off, len))
                    .unwrap();
                let mut buf = vec![0xAAu8; g.len as usize];
                device_read(&c.luns, &g.plan, &mut buf);
                let size = m.len() as u64;
                assert_eq!(g.file_size, size);
                let stop = (off + len).min(size);
                if off < size {
                    same(
                        &buf[..(stop - off) as usize],
                        &m[off as usize..stop as usize],
                        off,
                        step,
                    );
                }
            }
            // Proxied read.
            _ => {
                let off = rng.below(1 << 20);
                let len = 1 + rng.below(100_000);
                let (data, eof) = dp.read(ino, off, len, 0).await.unwrap();
                let size = m.len() as u64;
                let stop = (off + len).min(size);
                let want: &[u8] = if off < size {
                    &m[off as usize..stop as usize]
                } else {
                    &[]
                };
                assert_eq!(
                    data.len(),
                    want.len(),
                    "step {step} proxied read {off}+{len} size {size}"
                );
                same(&data, want, off, step);
                assert_eq!(eof, off + len >= size);
            }
        }
    }
    dp.store.close();
}

/// A small proxied write on a store with a journal is one durable commit: its allocation,
/// its bytes (in the commit's journal record) and its completion; its LUN write runs
/// beside that commit. (Two before: a lazy allocation, then the completion.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_proxied_write_is_one_commit_and_reads_back_exact() {
    let c = cluster();
    let ino = create(&c.dp, "one");
    let commits = || {
        c.dp.store
            .stats()
            .commits
            .load(std::sync::atomic::Ordering::Relaxed)
    };
    let mut model = Vec::new();
    // A new file's first bytes, an unaligned extension, an overwrite inside, a larger one.
    for (i, (off, len)) in [(0u64, 5000usize), (5000, 3000), (100, 200), (8000, 70_000)]
        .into_iter()
        .enumerate()
    {
        let data: Vec<u8> = (0..len).map(|k| (k * 7 + i * 31) as u8 | 1).collect();
        let before = commits();
        c.dp.write(ino, Position::At(off), data.clone(), true, 0, None)
            .await
            .unwrap();
        assert_eq!(commits() - before, 1, "write {i}: one commit");
        let end = off as usize + len;
        if model.len() < end {
            model.resize(end, 0);
        }
        model[off as usize..end].copy_from_slice(&data);
        let (back, _) = c.dp.read(ino, 0, model.len() as u64, 0).await.unwrap();
        assert!(back == model, "write {i}: read back differs");
    }
}
