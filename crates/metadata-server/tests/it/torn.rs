//! Torn store images: a damaged store is refused or recovered, never a panic or an abort.
//!
//! A seeded workload (the crash tests' generator) runs on a store in a file; the file is
//! copied at several moments while the store is open (live copies, as a backup tool or a
//! disk that lost some writes would see it), and once after a clean stop. Each torn image is
//! made of random 4 KiB pieces of two of those copies. On each image:
//! - the real `sanfs-mds fsck` (read-only) must exit 0, 1, 2 or 3 (never a signal) and leave
//!   the image's bytes as they were; on some images `fsck --repair` (the read-write open
//!   with redb's repair that `serve` also does) must exit 0, 1 or 2; on a few, the real
//!   `sanfs-mds serve` must refuse with exit 2 and a message, or keep serving;
//! - in-process, the store open that `serve` uses must answer `Ok` or an error, never panic;
//!   a store that opens must take a write and then pass a read-only fsck.
//!
//! The number of images comes from `SANFS_TORN_IMAGES` (default 100; the acceptance run is
//! 1,000); the seed is printed, `SANFS_CRASH_SEED` replays one. The outcome counts are printed.

use std::panic::AssertUnwindSafe;
use std::path::Path;

use sanfs_mds::clock::Clock;
use sanfs_mds::fsck;
use sanfs_mds::store::{Backend, Store, StoreError};

use crate::common::{mds, write_config};
use crate::crash::{EPOCH_SEC, Rng, apply, dump, generate, seed_from_env, tick};
use crate::support::fs_info;

const PIECE: usize = 4096;
const OPS_BETWEEN_COPIES: usize = 30;
const LIVE_COPIES: usize = 4;
/// The real binary runs on every this many images (it costs a process start each).
const BINARY_EVERY: usize = 10;
/// `sanfs-mds serve` runs on every this many images.
const SERVE_EVERY: usize = 50;

/// Runs the real `sanfs-mds serve` on `config` for at most 20 s: `Some(exit code)` if it
/// ended by itself (`None` inside: killed by a signal), `None` if it was still running.
fn serve_briefly(config: &Path) -> (Option<Option<i32>>, String) {
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_sanfs-mds"))
        .args(["serve", "--config", config.to_str().unwrap()])
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = std::time::Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break Some(st.code());
        }
        if t0.elapsed() > std::time::Duration::from_secs(20) {
            child.kill().unwrap();
            child.wait().unwrap();
            break None;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    let mut err = String::new();
    if let Some(mut e) = child.stderr.take() {
        use std::io::Read;
        let _ = e.read_to_string(&mut err);
    }
    (status, err)
}

fn images_from_env() -> usize {
    match std::env::var("SANFS_TORN_IMAGES") {
        Ok(s) => s
            .trim()
            .parse()
            .unwrap_or_else(|e| panic!("SANFS_TORN_IMAGES={s}: {e}")),
        Err(_) => 100,
    }
}

/// Copies of the store file taken at several moments of a seeded workload.
fn copies(seed: u64, dir: &Path) -> Vec<Vec<u8>> {
    let path = dir.join("live.redb");
    let clock = Clock::manual(EPOCH_SEC);
    let backend = Backend::File(path.clone());
    sanfs_testcluster::mds::create_store(&backend, &fs_info(), &clock).unwrap();
    let store = Store::open(&backend, clock.clone(), 64).unwrap();
    let mut rng = Rng::new(seed);
    let mut state = dump(&store);
    let mut out = Vec::new();
    for _ in 0..LIVE_COPIES {
        for _ in 0..OPS_BETWEEN_COPIES {
            let op = generate(&mut rng, &state);
            tick(&clock);
            let _ = apply(&store, &op);
            state = dump(&store);
        }
        out.push(std::fs::read(&path).unwrap());
    }
    drop(store);
    out.push(std::fs::read(&path).unwrap());
    out
}

/// One image of 4 KiB pieces, each from `a` or `b` at random (zeros past a copy's end); as
/// long as one of them.
fn tear(rng: &mut Rng, a: &[u8], b: &[u8]) -> Vec<u8> {
    let len = if rng.below(2) == 0 { a.len() } else { b.len() };
    let mut out = vec![0u8; len];
    for (i, piece) in out.chunks_mut(PIECE).enumerate() {
        let src = if rng.below(2) == 0 { a } else { b };
        let start = i * PIECE;
        if start < src.len() {
            let n = piece.len().min(src.len() - start);
            piece[..n].copy_from_slice(&src[start..start + n]);
        }
    }
    out
}

#[derive(Debug, Default)]
struct Counts {
    refused: usize,
    recovered: usize,
    opened_with_problems: usize,
    panicked: usize,
    binary_runs: usize,
    binary_aborts: usize,
    serve_runs: usize,
    serve_refused: usize,
}

#[test]
fn torn_images_are_refused_or_recovered_never_a_panic() {
    let seed = seed_from_env();
    let n = images_from_env();
    eprintln!("torn images: seed {seed:#x} (SANFS_CRASH_SEED), {n} images (SANFS_TORN_IMAGES)");
    let dir = tempfile::tempdir().unwrap();
    let snaps = copies(seed, dir.path());
    let config = write_config(
        dir.path(),
        "layout = \"linear\"\ndevices = [\"/nonexistent/sanfs-h1-lun\"]",
    );
    let meta = dir.path().join("meta.redb");
    let serve_config = dir.path().join("serve.toml");
    std::fs::write(
        &serve_config,
        format!(
            "[server]\nlisten = \"127.0.0.1:0\"\n\n{}",
            std::fs::read_to_string(&config).unwrap()
        ),
    )
    .unwrap();
    let opened = dir.path().join("opened.redb");
    let mut rng = Rng::new(seed ^ 0x7041_4e00);
    let mut c = Counts::default();
    let mut failures = Vec::new();
    for i in 0..n {
        let a = rng.below(snaps.len() as u64) as usize;
        let b = (a + 1 + rng.below(snaps.len() as u64 - 1) as usize) % snaps.len();
        let image = tear(&mut rng, &snaps[a], &snaps[b]);
        let what = format!("seed {seed:#x}, image {i} (copies {a} and {b})");

        if i % BINARY_EVERY == 0 {
            std::fs::write(&meta, &image).unwrap();
            let run = mds(["fsck", "--config", config.to_str().unwrap()]);
            c.binary_runs += 1;
            if !matches!(run.code, Some(0..=3)) {
                c.binary_aborts += 1;
                failures.push(format!("{what}: fsck: {run:?}"));
            }
            if std::fs::read(&meta).unwrap() != image {
                failures.push(format!("{what}: fsck changed the store's bytes"));
            }
            if run.code == Some(3) && !run.stderr.contains("needs repair") {
                failures.push(format!("{what}: exit 3 without saying why: {run:?}"));
            }
            if run.code == Some(2) && run.stderr.trim().is_empty() {
                failures.push(format!("{what}: exit 2 without a message: {run:?}"));
            }
            let run = mds(["fsck", "--repair", "--config", config.to_str().unwrap()]);
            c.binary_runs += 1;
            if !matches!(run.code, Some(0..=2)) {
                c.binary_aborts += 1;
                failures.push(format!("{what}: fsck --repair: {run:?}"));
            }
        }

        if i % SERVE_EVERY == 0 {
            std::fs::write(&meta, &image).unwrap();
            let (status, stderr) = serve_briefly(&serve_config);
            c.serve_runs += 1;
            match status {
                // Refused (the store) or stopped later (this config's LUN does not exist).
                Some(Some(2)) if !stderr.trim().is_empty() => {
                    if stderr.contains("metadata store damaged") {
                        c.serve_refused += 1;
                    }
                    eprintln!(
                        "{what}: serve: {}",
                        stderr.trim().lines().last().unwrap_or("")
                    );
                }
                None => {}
                other => failures.push(format!("{what}: serve ended with {other:?}: {stderr}")),
            }
        }

        // The open `serve` does, on a fresh copy of the image.
        std::fs::write(&opened, &image).unwrap();
        let backend = Backend::File(opened.clone());
        let clock = Clock::manual(EPOCH_SEC + 10_000_000);
        let result =
            std::panic::catch_unwind(AssertUnwindSafe(|| Store::open(&backend, clock, 64)));
        match result {
            Err(_) => {
                c.panicked += 1;
                failures.push(format!("{what}: Store::open panicked"));
            }
            Ok(Err(e)) => {
                c.refused += 1;
                if !matches!(e, StoreError::Damaged(_)) {
                    eprintln!("{what}: refused: {e}");
                }
            }
            Ok(Ok(store)) => {
                // dump() unwraps: a record that does not decode is a store that should not
                // have opened.
                let wrote = std::panic::catch_unwind(AssertUnwindSafe(|| {
                    apply(
                        &store,
                        &generate(&mut Rng::new(seed ^ i as u64), &dump(&store)),
                    )
                }));
                drop(store);
                let Ok(wrote) = wrote else {
                    c.opened_with_problems += 1;
                    eprintln!("{what}: opened but its records do not read back");
                    continue;
                };
                match std::panic::catch_unwind(AssertUnwindSafe(|| fsck::check(&backend))) {
                    Err(_) => {
                        c.panicked += 1;
                        failures.push(format!("{what}: fsck panicked after an open"));
                    }
                    Ok(Ok(rep)) if rep.is_clean() => c.recovered += 1,
                    Ok(Ok(rep)) => {
                        c.opened_with_problems += 1;
                        eprintln!("{what}: opened (write: {wrote:?}) but fsck finds:\n{rep}");
                    }
                    Ok(Err(e)) => {
                        c.opened_with_problems += 1;
                        eprintln!("{what}: opened (write: {wrote:?}) but fsck refuses: {e}");
                    }
                }
            }
        }
    }
    eprintln!(
        "torn images: seed {seed:#x}, {n} images: {} refused, {} recovered (fsck clean), {} opened with problems, {} panicked; real fsck: {} runs, {} aborted; real serve: {} runs, {} refused the store",
        c.refused,
        c.recovered,
        c.opened_with_problems,
        c.panicked,
        c.binary_runs,
        c.binary_aborts,
        c.serve_runs,
        c.serve_refused
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert_eq!(
        c.opened_with_problems, 0,
        "seed {seed:#x}: a torn store opened but is not consistent"
    );
}
