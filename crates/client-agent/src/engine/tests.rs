//! The engines against files: both backends, one batch over several devices, per-op errors
//! and poisoning, statistics, replaced handles.

use super::*;
use std::os::unix::fs::FileExt;

fn files(n: usize, len: u64) -> (tempfile::TempDir, Vec<File>) {
    let dir = tempfile::tempdir().unwrap();
    let files = (0..n)
        .map(|i| {
            let f = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(true)
                .open(dir.path().join(format!("lun{i}")))
                .unwrap();
            f.set_len(len).unwrap();
            f
        })
        .collect();
    (dir, files)
}

fn dup(files: &[File]) -> Vec<Option<File>> {
    files.iter().map(|f| Some(f.try_clone().unwrap())).collect()
}

fn engines(files: &[File]) -> Vec<Engine> {
    let mut out = vec![
        Engine::new(
            &EngineConfig {
                kind: EngineKind::Sync,
                queue_depth_per_device: 4,
            },
            dup(files),
        )
        .unwrap(),
    ];
    match Engine::new(
        &EngineConfig {
            kind: EngineKind::Uring,
            queue_depth_per_device: 2,
        },
        dup(files),
    ) {
        Ok(e) => out.push(e),
        Err(e) => {
            let thread = std::thread::current();
            let test = thread.name().unwrap_or("an engine test");
            sanfs_testcluster::skip(&format!("{test}, uring engine"), &format!("{e}"));
        }
    }
    out
}

fn piece(buf_off: u64, len: u64) -> BufRange {
    BufRange { buf_off, len }
}

#[tokio::test]
async fn both_engines_scatter_and_gather_across_devices() {
    let (_dir, files) = files(3, 1 << 20);
    for engine in engines(&files) {
        let mut buf = AlignedBuf::zeroed(6 * 4096);
        for (i, b) in buf.iter_mut().enumerate() {
            *b = (i / 4096) as u8 + 1;
        }
        // Pages 0 and 3 to d0 (one gathered write), 1 to d1, 2 to d2, 4..6 to d0 later.
        let ops = vec![
            DeviceOp {
                device: DeviceIndex(0),
                phys_off: 8192,
                kind: OpKind::Write,
                iov: vec![piece(0, 4096), piece(3 * 4096, 4096)],
            },
            DeviceOp {
                device: DeviceIndex(1),
                phys_off: 4096,
                kind: OpKind::Write,
                iov: vec![piece(4096, 4096)],
            },
            DeviceOp {
                device: DeviceIndex(2),
                phys_off: 0,
                kind: OpKind::Write,
                iov: vec![piece(2 * 4096, 4096)],
            },
            DeviceOp {
                device: DeviceIndex(0),
                phys_off: 65536,
                kind: OpKind::Write,
                iov: vec![piece(4 * 4096, 2 * 4096)],
            },
            DeviceOp::flush(DeviceIndex(1)),
        ];
        let done = engine.submit(buf, ops.clone()).await.unwrap();
        assert!(
            done.results.iter().all(Result::is_ok),
            "{}: {:?}",
            engine.name(),
            done.results
        );
        let mut page = vec![0u8; 4096];
        files[0].read_exact_at(&mut page, 8192 + 4096).unwrap();
        assert!(page.iter().all(|&b| b == 4));
        files[2].read_exact_at(&mut page, 0).unwrap();
        assert!(page.iter().all(|&b| b == 3));

        let reads: Vec<DeviceOp> = ops
            .into_iter()
            .map(|o| DeviceOp {
                kind: if o.kind == OpKind::Write {
                    OpKind::Read
                } else {
                    o.kind
                },
                ..o
            })
            .collect();
        let back = engine
            .submit(AlignedBuf::zeroed(6 * 4096), reads)
            .await
            .unwrap();
        assert!(back.results.iter().all(Result::is_ok));
        assert_eq!(
            back.buf.as_slice(),
            done.buf.as_slice(),
            "{}",
            engine.name()
        );
    }
}

#[tokio::test]
async fn errors_are_per_op_and_failed_writes_poison_the_device() {
    let (_dir, files) = files(2, 8192);
    for engine in engines(&files) {
        let ops = vec![
            DeviceOp {
                device: DeviceIndex(0),
                phys_off: 0,
                kind: OpKind::Read,
                iov: vec![piece(0, 4096)],
            },
            DeviceOp {
                device: DeviceIndex(1),
                phys_off: 4096,
                kind: OpKind::Read,
                iov: vec![piece(4096, 8192)],
            },
            DeviceOp {
                device: DeviceIndex(7),
                phys_off: 0,
                kind: OpKind::Read,
                iov: vec![piece(0, 4096)],
            },
        ];
        let done = engine
            .submit(AlignedBuf::zeroed(3 * 4096), ops)
            .await
            .unwrap();
        assert!(done.results[0].is_ok());
        let e = done.results[1].as_ref().unwrap_err();
        assert_eq!(
            (e.error, e.failed_at, e.errno()),
            (IoErrKind::UnexpectedEof, 8192, libc::EIO)
        );
        assert_eq!(
            done.results[2].as_ref().unwrap_err().error,
            IoErrKind::NoDevice
        );

        // Poisoned by hand here; a real failed write is in the next test.
        assert!(!engine.is_poisoned(DeviceIndex(0)));
        engine.state().poison(DeviceIndex(0));
        let done = engine
            .submit(
                AlignedBuf::zeroed(4096),
                vec![DeviceOp {
                    device: DeviceIndex(0),
                    phys_off: 0,
                    kind: OpKind::Read,
                    iov: vec![piece(0, 4096)],
                }],
            )
            .await
            .unwrap();
        assert_eq!(
            done.results[0].as_ref().unwrap_err().error,
            IoErrKind::Poisoned
        );
        engine.clear_poison(DeviceIndex(0));
        assert!(!engine.is_poisoned(DeviceIndex(0)));
    }
}

#[tokio::test]
async fn a_failed_write_poisons_its_device_only() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ro");
    std::fs::write(&path, vec![0u8; 8192]).unwrap();
    let (_d2, ok) = files(1, 8192);
    let devs = || {
        vec![
            Some(File::open(&path).unwrap()), // read-only: writes fail with EBADF
            Some(ok[0].try_clone().unwrap()),
        ]
    };
    let mut all = vec![
        Engine::new(
            &EngineConfig {
                kind: EngineKind::Sync,
                queue_depth_per_device: 1,
            },
            devs(),
        )
        .unwrap(),
    ];
    if let Ok(e) = Engine::new(&EngineConfig::default(), devs()) {
        all.push(e);
    }
    for engine in all {
        let w = |d| DeviceOp {
            device: DeviceIndex(d),
            phys_off: 0,
            kind: OpKind::Write,
            iov: vec![piece(0, 4096)],
        };
        let done = engine
            .submit(AlignedBuf::zeroed(4096), vec![w(0), w(1)])
            .await
            .unwrap();
        assert_eq!(
            done.results[0].as_ref().unwrap_err().errno(),
            libc::EBADF,
            "{}",
            engine.name()
        );
        assert!(done.results[1].is_ok());
        assert!(engine.is_poisoned(DeviceIndex(0)));
        assert!(!engine.is_poisoned(DeviceIndex(1)));
    }
}

#[tokio::test]
async fn stats_count_ops_requests_and_overlap_and_a_replaced_handle_is_used() {
    let (_dir2, fresh) = files(1, 1 << 20);
    let (_dir, files) = files(4, 1 << 20);
    for engine in engines(&files) {
        let read = |d| DeviceOp {
            device: DeviceIndex(d),
            phys_off: 4096,
            kind: OpKind::Read,
            iov: vec![piece(u64::from(d) * 8192, 8192)],
        };
        engine.reset_max_in_flight();
        let done = engine
            .submit(AlignedBuf::zeroed(4 * 8192), (0..4).map(read).collect())
            .await
            .unwrap();
        assert!(done.results.iter().all(Result::is_ok));
        let st = engine.stats();
        for d in &st.devices {
            assert_eq!((d.read_ops, d.read_bytes, d.submissions), (1, 8192, 1));
            assert_eq!((d.write_ops, d.errors), (0, 0));
        }
        assert_eq!(st.in_flight, 0);
        assert!(st.max_in_flight >= 1 && st.max_in_flight <= 4, "{st:?}");
        if engine.name() == "uring" {
            // One ring: the batch's four requests enter the kernel together.
            assert_eq!(st.max_in_flight, 4, "{st:?}");
        }
        // Device 2 now writes to another file.
        engine
            .replace_device(DeviceIndex(2), fresh[0].try_clone().unwrap())
            .await
            .unwrap();
        let mut buf = AlignedBuf::zeroed(4096);
        buf.as_mut_slice().fill(0xee);
        let w = DeviceOp {
            device: DeviceIndex(2),
            phys_off: 0,
            kind: OpKind::Write,
            iov: vec![piece(0, 4096)],
        };
        let done = engine.submit(buf, vec![w]).await.unwrap();
        assert!(done.results[0].is_ok());
        let mut got = [0u8; 4096];
        fresh[0].read_exact_at(&mut got, 0).unwrap();
        assert_eq!(got, [0xee; 4096], "{}", engine.name());
        files[2].read_exact_at(&mut got, 0).unwrap();
        assert_eq!(got, [0; 4096], "the old handle is no longer written");
        fresh[0].write_all_at(&[0; 4096], 0).unwrap();
        assert_eq!(engine.stats().devices[2].write_ops, 1);
    }
}

#[tokio::test]
async fn empty_batches_and_dropped_futures_are_harmless() {
    let (_dir, files) = files(1, 1 << 20);
    for engine in engines(&files) {
        let done = engine
            .submit(AlignedBuf::zeroed(0), Vec::new())
            .await
            .unwrap();
        assert!(done.results.is_empty());
        for _ in 0..20 {
            drop(engine.submit(
                AlignedBuf::zeroed(65536),
                vec![DeviceOp {
                    device: DeviceIndex(0),
                    phys_off: 0,
                    kind: OpKind::Read,
                    iov: vec![piece(0, 65536)],
                }],
            ));
        }
        drop(engine); // joins after the abandoned I/O completes
    }
}

#[tokio::test]
async fn a_slot_without_a_handle_takes_one_later_and_a_slot_beyond_the_engine_cannot() {
    let (_dir, files) = files(2, 1 << 20);
    for kind in [EngineKind::Sync, EngineKind::Uring] {
        // Device 0 present, devices 1 and 2 not yet (a LUN found later, a spare slot).
        let slots = vec![Some(files[0].try_clone().unwrap()), None, None];
        let engine = match Engine::new(
            &EngineConfig {
                kind,
                queue_depth_per_device: 2,
            },
            slots,
        ) {
            Ok(e) => e,
            Err(e) => {
                sanfs_testcluster::skip("slot attach, uring engine", &format!("{e}"));
                continue;
            }
        };
        assert_eq!(engine.slots(), 3);
        let write = |d: u32, fill: u8| {
            let mut buf = AlignedBuf::zeroed(4096);
            buf.as_mut_slice().fill(fill);
            (
                buf,
                vec![DeviceOp {
                    device: DeviceIndex(d),
                    phys_off: 8192,
                    kind: OpKind::Write,
                    iov: vec![piece(0, 4096)],
                }],
            )
        };
        let (buf, ops) = write(1, 0x5a);
        let done = engine.submit(buf, ops).await.unwrap();
        assert_eq!(
            done.results[0].as_ref().unwrap_err().error,
            IoErrKind::NoDevice,
            "{}",
            engine.name()
        );
        assert!(!engine.has_device(DeviceIndex(1)));
        engine
            .replace_device(DeviceIndex(1), files[1].try_clone().unwrap())
            .await
            .unwrap();
        assert!(engine.has_device(DeviceIndex(1)));
        let (buf, ops) = write(1, 0x5a);
        let done = engine.submit(buf, ops).await.unwrap();
        assert!(done.results[0].is_ok(), "{}", engine.name());
        let mut got = [0u8; 4096];
        files[1].read_exact_at(&mut got, 8192).unwrap();
        assert_eq!(got, [0x5a; 4096], "{}", engine.name());
        files[1].write_all_at(&[0; 4096], 8192).unwrap();
        assert!(
            engine
                .replace_device(DeviceIndex(3), files[1].try_clone().unwrap())
                .await
                .is_err()
        );
        assert!(!engine.has_device(DeviceIndex(2)));
    }
}
