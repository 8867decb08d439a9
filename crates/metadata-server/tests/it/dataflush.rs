//! Written data is flushed from the LUNs' volatile write caches before the commit that makes
//! it readable (Unwritten -> Written) is durable: a power cut that loses both the metadata
//! disk's unsynced writes and the LUNs' caches never leaves a Written block whose data was
//! only in a cache (it would read as the block's old bytes).
//!
//! The data LUN here is a model with a volatile cache (what was written and not flushed) and
//! durable media; the store's data flush moves the cache to the media, and a crash of the
//! metadata disk (`SimDisk`) is the power cut of both.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sanfs_blockmap::extent::ExtentState;
use sanfs_mds::clock::Clock;
use sanfs_mds::data;
use sanfs_mds::ns::Reader;
use sanfs_mds::store::backend::{FaultPlan, SimDisk};
use sanfs_mds::store::{Backend, Luns, Store};
use sanfs_proto::types::InodeId;

use crate::coherence::{create_in, try_create_in};
use crate::crash::seed_from_env;
use crate::support::fs_info;

const BLOCK: u64 = 4096;

/// LUNs with volatile write caches: the files whose data was written, on the LUN each went to
/// (one of three), and the files whose data a flush of that LUN made durable.
#[derive(Default)]
struct CachedLuns {
    cache: HashSet<(u32, u64)>,
    media: HashSet<u64>,
}

/// The LUN file `f`'s data goes to.
fn lun_of(f: u64) -> u32 {
    (f % 3) as u32
}

impl CachedLuns {
    /// Writes file `f`'s data (into its LUN's cache); answers the LUNs to name in its
    /// completion.
    fn write(&mut self, f: u64) -> Luns {
        self.cache.insert((lun_of(f), f));
        Luns::listed(vec![lun_of(f)])
    }
}

/// Sets the store's data flush over `luns`: moves the named LUNs' caches to the media,
/// unless the power is off already (the crashed metadata disk) or `failing` is set (a LUN
/// that fails its flushes).
fn flush_into(
    store: &Store,
    luns: &Arc<Mutex<CachedLuns>>,
    disk: &SimDisk,
    failing: &Arc<AtomicBool>,
) {
    let (luns, disk, failing) = (luns.clone(), disk.clone(), failing.clone());
    assert!(store.set_data_flush(Box::new(move |named| {
        if disk.has_crashed() {
            return Err("the power is off".into());
        }
        if failing.load(Ordering::SeqCst) {
            return Err("the LUN failed its flush (simulated)".into());
        }
        let mut l = luns.lock().unwrap();
        let flushed: Vec<(u32, u64)> = l
            .cache
            .iter()
            .filter(|(lun, _)| match named {
                Luns::All => true,
                Luns::Listed(v) => v.contains(lun),
            })
            .copied()
            .collect();
        for e in flushed {
            l.cache.remove(&e);
            l.media.insert(e.1);
        }
        Ok(())
    })));
}

fn fresh(disk: &SimDisk) -> Store {
    let backend = Backend::Sim(disk.clone());
    sanfs_testcluster::mds::create_store(&backend, &fs_info(), &Clock::System).unwrap();
    Store::open(&backend, Clock::System, 16).unwrap()
}

fn written(store: &Store, ino: u64) -> bool {
    store
        .read(|t| t.extent_list(InodeId(ino)))
        .unwrap()
        .iter()
        .any(|e| e.state == ExtentState::Written)
}

/// One step of the workload.
#[derive(Debug, Clone, Copy)]
enum Step {
    /// Allocate a block Unwritten (durably), write its data (to the cache), complete it
    /// lazily (as a direct write's `Complete` without sync).
    LazyWrite,
    /// The same, completed durably (a proxied write, or `Complete` with sync).
    DurableWrite,
    /// A durable change that is not about data (a create): it makes lazy work durable.
    Create,
    /// An fsync.
    Sync,
}

fn plan(seed: u64, steps: usize) -> Vec<Step> {
    let mut s = seed | 1;
    (0..steps)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            match s % 8 {
                0..=3 => Step::LazyWrite,
                4 | 5 => Step::DurableWrite,
                6 => Step::Create,
                _ => Step::Sync,
            }
        })
        .collect()
}

/// Runs `steps` on `store` until the first failure (the crash); answers the files written.
fn run(store: &Store, lun: &Arc<Mutex<CachedLuns>>, steps: &[Step]) -> Vec<u64> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let vol = store.volume();
    let mut files = Vec::new();
    rt.block_on(async {
        // The files written, created and allocated first (a write grant allocates before
        // the device I/O), so that completions follow each other with no other durable
        // commit between them.
        let mut fresh = Vec::new();
        for i in 0..steps.len() {
            let Ok(f) = try_create_in(store, &format!("f{i}")) else {
                return;
            };
            let v = vol.clone();
            if store
                .write(move |ctx| data::map_write(ctx, &v, InodeId(f), 0, BLOCK))
                .await
                .is_err()
            {
                return;
            }
            fresh.push(f);
        }
        for (i, (step, f)) in steps.iter().zip(fresh).enumerate() {
            let ok = match step {
                Step::LazyWrite | Step::DurableWrite => {
                    let durable = matches!(step, Step::DurableWrite);
                    files.push(f);
                    let luns = lun.lock().unwrap().write(f);
                    store
                        .write_data(durable, luns, move |ctx| {
                            data::complete_write(ctx, InodeId(f), 0, BLOCK, true)
                        })
                        .await
                        .is_ok()
                }
                Step::Create => try_create_in(store, &format!("c{i}")).is_ok(),
                Step::Sync => store.sync_data().await.is_ok(),
            };
            if !ok {
                break;
            }
        }
    });
    files
}

/// A power cut at every point of a random workload of lazy and durable completions: every
/// block the recovered store says is Written had its data flushed to the media first.
#[test]
fn a_power_cut_never_leaves_written_blocks_whose_data_was_only_in_a_cache() {
    let seed = seed_from_env();
    eprintln!("data flush seed {seed} (SANFS_CRASH_SEED to replay)");
    let steps = plan(seed, 40);
    // A fault-free run to count the disk calls of the workload.
    let (first_op, total_ops) = {
        let disk = SimDisk::new(FaultPlan::default());
        let store = fresh(&disk);
        let lun = Arc::new(Mutex::new(CachedLuns::default()));
        flush_into(&store, &lun, &disk, &Arc::new(AtomicBool::new(false)));
        let first = disk.ops();
        let files = run(&store, &lun, &steps);
        assert!(files.iter().all(|f| written(&store, *f)), "seed {seed}");
        (first, disk.ops())
    };
    let (mut crashes, mut written_checked) = (0, 0);
    for at in (first_op + 1..=total_ops).step_by(3) {
        let disk = SimDisk::new(FaultPlan {
            crash_at_op: Some(at),
            torn_writes: true,
            fail_sync: None,
            seed: seed ^ at,
        });
        let store = fresh(&disk);
        let lun = Arc::new(Mutex::new(CachedLuns::default()));
        flush_into(&store, &lun, &disk, &Arc::new(AtomicBool::new(false)));
        let files = run(&store, &lun, &steps);
        disk.crash_now();
        drop(store);
        let media = std::mem::take(&mut lun.lock().unwrap().media);
        let disk = SimDisk::from_image(disk.durable_image(), FaultPlan::default());
        let store = Store::open(&Backend::Sim(disk), Clock::System, 16).unwrap();
        for f in files {
            let exists = store.read(|t| t.getattr(4096, InodeId(f))).is_ok();
            if exists && written(&store, f) {
                written_checked += 1;
                assert!(
                    media.contains(&f),
                    "seed {seed}, crash at disk call {at}: file {f} is Written but its data \
                     never left the LUN's cache"
                );
            }
        }
        crashes += 1;
    }
    assert!(
        crashes > 10 && written_checked > 10,
        "seed {seed}: the crashes checked something ({crashes} crashes, {written_checked} Written files)"
    );
    eprintln!("seed {seed}: {crashes} power cuts, {written_checked} Written files checked");
}

/// A lazy completion's data is flushed by the next durable commit of anything (its LUN with
/// that commit's own), and by the store's own sync of lazy work; nothing is flushed where
/// nothing was written; a failed flush refuses its batch with a clear error and changes
/// nothing, and the next durable commit flushes again.
#[test]
fn lazy_data_is_flushed_before_it_becomes_durable_and_a_failed_flush_changes_nothing() {
    let disk = SimDisk::new(FaultPlan::default());
    let store = fresh(&disk);
    let luns = Arc::new(Mutex::new(CachedLuns::default()));
    let failing = Arc::new(AtomicBool::new(false));
    flush_into(&store, &luns, &disk, &failing);
    let flushes = || store.stats().data_flushes.load(Ordering::Relaxed);
    let on_media = |f: u64| luns.lock().unwrap().media.contains(&f);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let vol = store.volume();
    // A file with one block allocated Unwritten, its data not written yet.
    let file = |n: &str| {
        let f = create_in(&store, n);
        let v = vol.clone();
        store
            .write_blocking(move |ctx| data::map_write(ctx, &v, InodeId(f), 0, BLOCK))
            .unwrap();
        f
    };
    let complete = |f: u64, durable: bool| {
        let named = luns.lock().unwrap().write(f);
        store.write_data(durable, named, move |ctx| {
            data::complete_write(ctx, InodeId(f), 0, BLOCK, true)
        })
    };
    rt.block_on(async {
        // Durable changes without data flush nothing.
        let (a, b) = (file("a"), file("b"));
        store.sync().await.unwrap();
        assert_eq!(flushes(), 0);
        assert_ne!(lun_of(a), lun_of(b), "two LUNs");
        // A lazy completion: committed, not flushed, until a durable commit of anything.
        let (_, seq) = complete(a, false).await.unwrap();
        assert!(seq > store.durable_seq(), "committed lazily");
        assert_eq!(flushes(), 0);
        assert!(!on_media(a));
        // A durable completion on another LUN: one flush, of both LUNs.
        complete(b, true).await.unwrap();
        assert_eq!(flushes(), 1);
        assert!(on_media(a) && on_media(b), "both LUNs were flushed");
        assert!(store.durable_seq() >= seq);
        // A lazy completion, then a durable create: flushed first.
        let c = file("c");
        complete(c, false).await.unwrap();
        let flushed = flushes();
        create_in(&store, "d");
        assert_eq!(
            flushes(),
            flushed + 1,
            "the create's durable commit flushed first"
        );
        assert!(on_media(c));
        // The store's own sync of lazy work flushes too.
        let e = file("e");
        complete(e, false).await.unwrap();
        let flushed = flushes();
        let waited = std::time::Instant::now();
        while flushes() == flushed && waited.elapsed() < Duration::from_secs(10) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(
            on_media(e),
            "the interval sync flushed the lazy completion's data"
        );
        // A failed flush: the durable completion is refused, nothing of it is there, and
        // the store goes on.
        let g = file("g");
        failing.store(true, Ordering::SeqCst);
        let err = complete(g, true).await.unwrap_err();
        assert!(err.to_string().contains("flushing the data LUNs"), "{err}");
        assert!(!written(&store, g), "a refused completion changes nothing");
        assert!(
            !store.poisoned(),
            "a LUN's failed flush does not stop the store"
        );
        // A lazy completion is committed (no flush needed yet) but cannot become durable
        // while flushes fail.
        let (_, seq) = complete(g, false).await.unwrap();
        assert!(
            store.sync().await.is_err(),
            "no durable commit without the flush"
        );
        assert!(store.durable_seq() < seq);
        failing.store(false, Ordering::SeqCst);
        store.sync().await.unwrap();
        assert!(store.durable_seq() >= seq && written(&store, g));
        assert!(on_media(g));
    });
}

/// A lazy change is committed on the thread that queued it when nobody else is committing
/// (no hand-off to the committer thread and back), durable work on the committer thread; the
/// committer still makes such lazy work durable within the interval; and jobs commit in the
/// order each submitter queued them, whoever commits them, under concurrent submitters.
#[test]
fn lazy_changes_commit_on_their_own_thread_in_order_and_become_durable_in_time() {
    let disk = SimDisk::new(FaultPlan::default());
    let store = Arc::new(fresh(&disk));
    let thread_name = || std::thread::current().name().unwrap_or("").to_string();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    std::thread::Builder::new()
        .name("submitter".into())
        .spawn({
            let store = store.clone();
            move || {
                rt.block_on(async {
                    // Whoever finds the engine free commits: the committer thread may be
                    // finishing a loop of its own (the store's open) when the first is
                    // queued, so a few are tried, apart.
                    let mut here = None;
                    for _ in 0..20 {
                        let (ran_on, seq) = store
                            .write_lazy_numbered(move |_| Ok(thread_name()))
                            .await
                            .unwrap();
                        if ran_on == "submitter" {
                            here = Some(seq);
                            break;
                        }
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                    let seq = here.expect("a lazy change, nobody committing: on its own thread");
                    assert!(seq > store.durable_seq(), "committed, not durable yet");
                    // The committer was told of it: durable within the interval.
                    let waited = std::time::Instant::now();
                    while store.durable_seq() < seq && waited.elapsed() < Duration::from_secs(5) {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                    assert!(store.durable_seq() >= seq, "made durable by the committer");
                    let ran_on = store.write(move |_| Ok(thread_name())).await.unwrap();
                    assert_eq!(ran_on, "sanfs-committer", "durable work");
                });
            }
        })
        .unwrap()
        .join()
        .unwrap();

    // Four submitters, each alternating lazy and durable jobs: each one's jobs run and
    // commit in its own order.
    let ran = Arc::new(Mutex::new(Vec::new()));
    let submitters: Vec<_> = (0..4u64)
        .map(|t| {
            let (store, ran) = (store.clone(), ran.clone());
            std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                rt.block_on(async {
                    let mut last = 0;
                    for i in 0..200u64 {
                        let ran = ran.clone();
                        let job = move |_: &mut sanfs_mds::store::Ctx<'_>| {
                            ran.lock().unwrap().push((t, i));
                            Ok(())
                        };
                        let seq = if i % 3 == 0 {
                            store.write(job).await.unwrap();
                            store.durable_seq()
                        } else {
                            store.write_lazy_numbered(job).await.unwrap().1
                        };
                        assert!(
                            seq >= last,
                            "submitter {t}: job {i} committed before {}",
                            i - 1
                        );
                        last = seq;
                    }
                });
            })
        })
        .collect();
    for s in submitters {
        s.join().unwrap();
    }
    let ran = ran.lock().unwrap();
    assert_eq!(ran.len(), 800);
    for t in 0..4u64 {
        let mine: Vec<u64> = ran.iter().filter(|r| r.0 == t).map(|r| r.1).collect();
        assert_eq!(
            mine,
            (0..200).collect::<Vec<_>>(),
            "submitter {t}'s jobs in order"
        );
    }
}
