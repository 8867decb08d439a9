//! Replays of lazy completions after a crash, at the store level (`sanfs_mds::reclaim`): a
//! crash-simulating disk keeps only what was durable; the lost completion is replayed when
//! the file still maps the blocks the agent wrote, refused when it does not (freed, or other
//! blocks), and answered DURABLE when it had survived. And the committer
//! makes lazy work durable on its own within its bound.

use std::time::{Duration, Instant};

use sanfs_blockmap::plan::phys_runs;
use sanfs_mds::clock::Clock;
use sanfs_mds::data::{Mapped, complete_write, map_write};
use sanfs_mds::ns::Reader;
use sanfs_mds::reclaim::replay_write;
use sanfs_mds::space::trim_unwritten_past_eof;
use sanfs_mds::store::ReaderInodes;
use sanfs_mds::store::backend::{FaultPlan, SimDisk};
use sanfs_mds::store::{Backend, LAZY_SYNC_AFTER, Luns, Store};
use sanfs_proto::model::{ReplayOutcome, ReplayRecord, ReplayRun};
use sanfs_proto::types::{ByteRange, InodeId, SessionEpoch};

const KIB: u64 = 1024;

/// The agent's record of a completion of `[offset, offset + len)` written by `mapped`'s plan.
fn record(ino: u64, epoch: u64, seq: u64, mapped: &Mapped) -> ReplayRecord {
    ReplayRecord {
        inode: InodeId(ino),
        epoch: SessionEpoch(epoch),
        commit_seq: seq,
        range: ByteRange::new(mapped.offset, mapped.len).unwrap(),
        runs: phys_runs(&mapped.plan.device_ios)
            .into_iter()
            .map(|r| ReplayRun {
                file_off: mapped.offset + r.buf_off,
                device: r.device,
                phys_off: r.phys_off,
                len: r.len,
            })
            .collect(),
    }
}

fn size(store: &Store, ino: u64) -> u64 {
    store.read(|t| t.getattr(4096, InodeId(ino))).unwrap().size
}

async fn replay(store: &Store, r: ReplayRecord) -> ReplayOutcome {
    let (volume, survived) = (store.volume().clone(), store.survived());
    store
        .write_data(true, Luns::All, move |ctx| {
            replay_write(ctx, &volume, survived, &r)
        })
        .await
        .unwrap()
        .0
        .0
}

#[test]
fn a_lost_lazy_completion_is_replayed_only_onto_the_blocks_it_wrote() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let disk = SimDisk::new(FaultPlan::default());
    let backend = Backend::Sim(disk.clone());
    sanfs_testcluster::mds::create_store(&backend, &crate::support::fs_info(), &Clock::System)
        .unwrap();
    let store = Store::open(&backend, Clock::System, 16).unwrap();
    let epoch = store.boot_epoch();
    let vol = store.volume().clone();
    let (f, g) = (
        crate::coherence::create_in(&store, "kept"),
        crate::coherence::create_in(&store, "moved"),
    );
    let (mf, mg, seq_f, seq_g, durable) = rt.block_on(async {
        let v = vol.clone();
        let mf = store
            .write(move |ctx| map_write(ctx, &v, InodeId(f), 0, 128 * KIB))
            .await
            .unwrap();
        let v = vol.clone();
        let mg = store
            .write(move |ctx| map_write(ctx, &v, InodeId(g), 0, 64 * KIB))
            .await
            .unwrap();
        let durable = store.durable_seq();
        let (_, seq_f) = store
            .write_data(false, Luns::All, move |ctx| {
                complete_write(ctx, InodeId(f), 0, 128 * KIB, false)
            })
            .await
            .unwrap();
        let (_, seq_g) = store
            .write_data(false, Luns::All, move |ctx| {
                complete_write(ctx, InodeId(g), 0, 64 * KIB, false)
            })
            .await
            .unwrap();
        (mf, mg, seq_f, seq_g, durable)
    });
    assert!(
        seq_f > durable && seq_g > seq_f,
        "lazy commits are numbered after the durable ones"
    );
    assert_eq!(size(&store, f), 128 * KIB);
    disk.crash_now();
    drop(store);

    let disk = SimDisk::from_image(disk.durable_image(), FaultPlan::default());
    let store = Store::open_deferring_recovery(&Backend::Sim(disk), Clock::System, 16).unwrap();
    assert_eq!(
        store.survived(),
        (epoch, durable),
        "the last durable commit survived"
    );
    assert_eq!(
        size(&store, f),
        0,
        "the lazy completion was lost with the server"
    );
    rt.block_on(async {
        // A record that had survived is answered DURABLE and changes nothing.
        let old = record(f, epoch, durable, &mf);
        assert_eq!(replay(&store, old).await, ReplayOutcome::Durable);
        assert_eq!(size(&store, f), 0);
        // Other LUN bytes than the file maps there: refused.
        let mut wrong = record(f, epoch, seq_f, &mf);
        wrong.runs[0].phys_off += 4096;
        assert_eq!(replay(&store, wrong).await, ReplayOutcome::Refused);
        // A record of an epoch that is not the last run's is checked, not trusted.
        let mut other_epoch = record(f, epoch + 5, 1, &mf);
        other_epoch.runs[0].device = sanfs_blockmap::volume::DeviceIndex(3);
        assert_eq!(replay(&store, other_epoch).await, ReplayOutcome::Refused);
        // The right blocks: replayed, the size is back, the range Written.
        assert_eq!(
            replay(&store, record(f, epoch, seq_f, &mf)).await,
            ReplayOutcome::Replayed
        );
        assert_eq!(size(&store, f), 128 * KIB);
        let written = store
            .read(|t| t.extent_map_of(InodeId(f)))
            .unwrap()
            .iter()
            .all(|e| e.state == sanfs_blockmap::extent::ExtentState::Written);
        assert!(written, "the replayed range is Written");
        // g's blocks were freed (the recovery after the window trims Unwritten blocks past
        // the end of file; they may go to another file next): g's record is refused.
        store
            .write(move |ctx| trim_unwritten_past_eof(ctx, InodeId(g), 0, 16))
            .await
            .unwrap();
        assert_eq!(
            replay(&store, record(g, epoch, seq_g, &mg)).await,
            ReplayOutcome::Refused
        );
        assert_eq!(size(&store, g), 0);
        // A file that is gone: refused.
        let mut gone = record(f, epoch, seq_f, &mf);
        gone.inode = InodeId(999_999);
        assert_eq!(replay(&store, gone).await, ReplayOutcome::Refused);
    });
}

#[test]
fn lazy_work_becomes_durable_on_its_own_within_the_bound() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let disk = SimDisk::new(FaultPlan::default());
    let backend = Backend::Sim(disk.clone());
    sanfs_testcluster::mds::create_store(&backend, &crate::support::fs_info(), &Clock::System)
        .unwrap();
    let store = Store::open(&backend, Clock::System, 16).unwrap();
    let vol = store.volume().clone();
    let f = crate::coherence::create_in(&store, "timer");
    rt.block_on(async {
        let v = vol.clone();
        store
            .write(move |ctx| map_write(ctx, &v, InodeId(f), 0, 64 * KIB))
            .await
            .unwrap();
        let (_, seq) = store
            .write_data(false, Luns::All, move |ctx| {
                complete_write(ctx, InodeId(f), 0, 64 * KIB, false)
            })
            .await
            .unwrap();
        assert!(store.durable_seq() < seq);
        let t = Instant::now();
        while store.durable_seq() < seq {
            assert!(
                t.elapsed() < LAZY_SYNC_AFTER + Duration::from_secs(5),
                "lazy work not durable after {:?}",
                t.elapsed()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    });
    // And it really is: it survives a crash.
    disk.crash_now();
    drop(store);
    let disk = SimDisk::from_image(disk.durable_image(), FaultPlan::default());
    let store = Store::open(&Backend::Sim(disk), Clock::System, 16).unwrap();
    assert_eq!(size(&store, f), 64 * KIB);
}

/// Issue 19: namespace changes answered before they were durable (lazy commits owned by a
/// session) are lost with the server and replayed by their agent, in order, onto the durable
/// state: the names come back with the inode numbers and generations the agent was answered;
/// a second replay of the same changes (a restart during the first) applies nothing twice;
/// and a change of a second session after the first session's lazy ones is committed
/// durably, so that a crash loses only one session's changes.
#[test]
fn lost_namespace_changes_are_replayed_in_order_with_their_inode_numbers() {
    use sanfs_mds::reclaim::{NsChange, change_survived, replay_change};
    use sanfs_proto::model::{
        CreateRequest, EntryRequest, LinkRequest, MkdirRequest, OpenFlags, RenameRequest,
        SetAttrRequest, SetXattrRequest, SymlinkRequest,
    };
    use sanfs_proto::types::{
        Credentials, RenameMode, SessionId, SetAttr, SymlinkTarget, XattrMode, XattrName,
    };
    let rt = tokio::runtime::Runtime::new().unwrap();
    let disk = SimDisk::new(FaultPlan::default());
    let backend = Backend::Sim(disk.clone());
    sanfs_testcluster::mds::create_store(&backend, &crate::support::fs_info(), &Clock::System)
        .unwrap();
    let store = Store::open(&backend, Clock::System, 16).unwrap();
    let epoch = store.boot_epoch();
    let root = Credentials::root();
    let name = crate::support::name;
    let dir = crate::coherence::create_in(&store, "kept");
    // The directory the changes are made in, durable.
    let d = rt.block_on(async {
        let r = MkdirRequest {
            cred: root.clone(),
            parent: InodeId(1),
            name: name("d"),
            perm: 0o755,
            delegate: false,
        };
        store
            .write(move |ctx| sanfs_mds::ns::mkdir(ctx, &r))
            .await
            .unwrap()
            .ino
    });
    let durable = store.durable_seq();
    let session = 7u64;
    let create = CreateRequest {
        delegate: false,
        inode: None,
        time: None,
        cred: root.clone(),
        session: SessionId(session),
        parent: d,
        name: name("a"),
        perm: 0o644,
        exclusive: true,
        flags: OpenFlags {
            read: true,
            write: true,
            append: false,
            truncate: false,
        },
    };
    let mkdir = MkdirRequest {
        cred: root.clone(),
        parent: d,
        name: name("sub"),
        perm: 0o700,
        delegate: false,
    };
    let symlink = SymlinkRequest {
        cred: root.clone(),
        parent: d,
        name: name("l"),
        target: SymlinkTarget::new(b"a".to_vec()).unwrap(),
    };
    // Each change with what it made (for creates) and its commit number, as the agent keeps.
    type Kept = (NsChange, Option<(InodeId, u64)>, u64);
    let mut changes: Vec<Kept> = Vec::new();
    rt.block_on(async {
        let (r, seq) = {
            let req = create.clone();
            store
                .write_owned(session, move |ctx| sanfs_mds::ns::create(ctx, &req))
                .await
                .unwrap()
        };
        let a = r.attr.ino;
        changes.push((
            NsChange::Create(create.clone()),
            Some((a, r.attr.generation)),
            seq,
        ));
        let req = mkdir.clone();
        let (attr, seq) = store
            .write_owned(session, move |ctx| sanfs_mds::ns::mkdir(ctx, &req))
            .await
            .unwrap();
        changes.push((
            NsChange::Mkdir(mkdir.clone()),
            Some((attr.ino, attr.generation)),
            seq,
        ));
        let req = symlink.clone();
        let (attr, seq) = store
            .write_owned(session, move |ctx| sanfs_mds::ns::symlink(ctx, &req))
            .await
            .unwrap();
        changes.push((
            NsChange::Symlink(symlink.clone()),
            Some((attr.ino, attr.generation)),
            seq,
        ));
        let rename = RenameRequest {
            cred: root.clone(),
            old_parent: d,
            old_name: name("a"),
            new_parent: changes[1].1.unwrap().0,
            new_name: name("a2"),
            mode: RenameMode::Replace,
        };
        let link = LinkRequest {
            cred: root.clone(),
            inode: a,
            new_parent: d,
            new_name: name("h"),
        };
        let unlink_l = EntryRequest {
            cred: root.clone(),
            parent: d,
            name: name("l"),
        };
        let chmod = SetAttrRequest {
            cred: root.clone(),
            inode: a,
            changes: SetAttr {
                perm: Some(0o600),
                ..SetAttr::default()
            },
            handle: None,
        };
        let xattr = SetXattrRequest {
            cred: root.clone(),
            inode: a,
            name: XattrName::new(b"user.k".to_vec()).unwrap(),
            value: b"v".to_vec(),
            mode: XattrMode::Either,
        };
        for change in [
            NsChange::Rename(rename),
            NsChange::Link(link),
            NsChange::Unlink(unlink_l),
            NsChange::SetAttr(chmod),
            NsChange::SetXattr(xattr),
        ] {
            let c = change.clone();
            let (_, seq) = store
                .write_owned(session, move |ctx| replay_change(ctx, &c, None).map(drop))
                .await
                .unwrap();
            changes.push((change, None, seq));
        }
    });
    assert!(
        changes.iter().all(|(_, _, seq)| *seq > durable),
        "one session's changes stay lazy: {changes:?}"
    );
    // Another session's change after them is committed durably (and with it theirs).
    let other = rt.block_on(async {
        let (_, seq) = store.write_owned(9, |_| Ok(())).await.unwrap();
        seq
    });
    assert_eq!(
        store.durable_seq(),
        other,
        "a second session's change is durable"
    );
    assert!(!store.foreign_undurable(session) && !store.foreign_undurable(9));
    // Once more lazily, then the crash.
    let lookup = |store: &Store, parent: InodeId, n: &str| {
        store.read(|t| {
            t.lookup(
                4096,
                &EntryRequest {
                    cred: Credentials::root(),
                    parent,
                    name: crate::support::name(n),
                },
            )
        })
    };
    let later = rt.block_on(async {
        let req = MkdirRequest {
            cred: Credentials::root(),
            parent: d,
            name: crate::support::name("later"),
            perm: 0o755,
            delegate: false,
        };
        let r = req.clone();
        let (attr, seq) = store
            .write_owned(session, move |ctx| sanfs_mds::ns::mkdir(ctx, &r))
            .await
            .unwrap();
        (NsChange::Mkdir(req), Some((attr.ino, attr.generation)), seq)
    });
    assert!(
        store.foreign_undurable(9),
        "session 9 would see session 7's change"
    );
    assert!(
        !store.foreign_undurable(session),
        "but not session 7 itself"
    );
    let survived_at = store.durable_seq();
    let a = changes[0].1.unwrap().0;
    let sub = changes[1].1.unwrap().0;
    disk.crash_now();
    drop(store);

    let disk = SimDisk::from_image(disk.durable_image(), FaultPlan::default());
    let store = Store::open_deferring_recovery(&Backend::Sim(disk), Clock::System, 16).unwrap();
    assert_eq!(store.survived(), (epoch, survived_at));
    assert!(
        lookup(&store, d, "later").is_err(),
        "the last lazy change was lost with the server"
    );
    // The earlier ones had become durable with session 9's change: answered DURABLE.
    for (_, _, seq) in &changes {
        assert!(change_survived(store.survived(), epoch, *seq));
    }
    assert!(!change_survived(store.survived(), epoch, later.2));
    // The lost one is replayed with its inode number, twice without harm.
    for round in 0..2 {
        let (change, inode) = (later.0.clone(), later.1);
        let outcome = rt.block_on(store.write(move |ctx| replay_change(ctx, &change, inode)));
        let expect = if round == 0 {
            ReplayOutcome::Replayed
        } else {
            ReplayOutcome::Durable
        };
        assert_eq!(outcome.unwrap(), expect, "round {round}");
    }
    let got = lookup(&store, d, "later").unwrap();
    assert_eq!((got.ino, got.generation), later.1.unwrap());
    assert_eq!(lookup(&store, sub, "a2").unwrap().ino, a);
    assert_eq!(lookup(&store, d, "h").unwrap().ino, a);
    assert!(lookup(&store, d, "l").is_err() && lookup(&store, d, "a").is_err());
    assert_eq!(lookup(&store, sub, "a2").unwrap().perm, 0o600);
    // A create whose number is taken by another inode now is refused, not applied.
    let mut clash = changes[0].0.clone();
    if let NsChange::Create(c) = &mut clash {
        c.name = crate::support::name("clash");
    }
    let taken = Some((InodeId(dir), 1));
    let refused = rt.block_on(store.write(move |ctx| replay_change(ctx, &clash, taken)));
    assert!(refused.is_err(), "a taken inode number: {refused:?}");
    assert!(lookup(&store, d, "clash").is_err());
    // A removal or a rename tagged with the inode it changed (one its agent answered
    // itself) is found done when its name names another inode (made after it), and is
    // applied when it names that one.
    let later_ino = later.1.unwrap();
    let (a_tag, later_tag) = (Some((a, 1)), Some(later_ino));
    let unlink_later = NsChange::Rmdir(EntryRequest {
        cred: root.clone(),
        parent: d,
        name: crate::support::name("later"),
    });
    let rename_h = NsChange::Rename(RenameRequest {
        cred: root.clone(),
        old_parent: d,
        old_name: crate::support::name("h"),
        new_parent: d,
        new_name: crate::support::name("h2"),
        mode: RenameMode::Replace,
    });
    for (change, tag, expect) in [
        (unlink_later.clone(), a_tag, ReplayOutcome::Durable),
        (rename_h.clone(), later_tag, ReplayOutcome::Durable),
        (rename_h, a_tag, ReplayOutcome::Replayed),
        (unlink_later, later_tag, ReplayOutcome::Replayed),
    ] {
        let what = format!("{change:?} tagged {tag:?}");
        let outcome = rt.block_on(store.write(move |ctx| replay_change(ctx, &change, tag)));
        assert_eq!(outcome.unwrap(), expect, "{what}");
    }
    assert!(lookup(&store, d, "later").is_err());
    assert!(lookup(&store, d, "h").is_err());
    assert_eq!(lookup(&store, d, "h2").unwrap().ino, a);
    // New inodes are numbered after the replayed ones.
    let fresh = crate::coherence::create_in(&store, "fresh");
    assert!(
        fresh > later.1.unwrap().0.0,
        "{fresh} after the replayed inode"
    );
}

/// All the changes of the namespace test above replayed onto the durable state they were
/// made on, one by one, give what the live server gave (no crash in between: the replay
/// path alone, against the same requests).
#[test]
fn replaying_every_kind_of_change_onto_a_fresh_store_rebuilds_the_same_names() {
    use sanfs_mds::reclaim::{NsChange, replay_change};
    use sanfs_proto::model::{CreateRequest, EntryRequest, MkdirRequest, OpenFlags};
    use sanfs_proto::types::{Credentials, SessionId};
    let (store, _disk) = crate::support::new_store(&Clock::System);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mk = |n: &str| MkdirRequest {
        cred: Credentials::root(),
        parent: InodeId(1),
        name: crate::support::name(n),
        perm: 0o755,
        delegate: false,
    };
    let cr = |n: &str| CreateRequest {
        delegate: false,
        inode: None,
        time: None,
        cred: Credentials::root(),
        session: SessionId(3),
        parent: InodeId(1),
        name: crate::support::name(n),
        perm: 0o644,
        exclusive: false,
        flags: OpenFlags {
            read: true,
            write: false,
            append: false,
            truncate: false,
        },
    };
    // Made with chosen numbers, far from the next free one.
    for (i, change) in [
        NsChange::Mkdir(mk("x")),
        NsChange::Create(cr("y")),
        NsChange::Rmdir(EntryRequest {
            cred: Credentials::root(),
            parent: InodeId(1),
            name: crate::support::name("x"),
        }),
    ]
    .into_iter()
    .enumerate()
    {
        let inode = matches!(change, NsChange::Mkdir(_) | NsChange::Create(_))
            .then_some((InodeId(5000 + i as u64), 77));
        let outcome = rt
            .block_on(store.write(move |ctx| replay_change(ctx, &change, inode)))
            .unwrap();
        assert_eq!(outcome, ReplayOutcome::Replayed, "change {i}");
    }
    let y = store
        .read(|t| {
            t.lookup(
                4096,
                &EntryRequest {
                    cred: Credentials::root(),
                    parent: InodeId(1),
                    name: crate::support::name("y"),
                },
            )
        })
        .unwrap();
    assert_eq!((y.ino, y.generation), (InodeId(5001), 77));
    // The replayed create's handle was closed again: nothing holds y open.
    assert!(!store.handles().is_open(5001));
    let next = crate::coherence::create_in(&store, "z");
    assert!(
        next > 5001,
        "the next inode number passed the replayed ones: {next}"
    );
}
