//! `ferry repo copy` ([`crate::copy`]) between repositories over memory stores: entries
//! carried over between two chunk sizes alike, chunks cut again between two that differ,
//! what a second copy sends, order and times, damage in the source, interruption.
use super::*;
use crate::copy::{copy, CopyOptions, CopyReport, Event, Progress, Select};
use std::sync::atomic::{AtomicBool, Ordering};

fn repo_with(chunk_size: u32, passphrase: Option<&[u8]>) -> (Arc<MemStore>, Arc<Repository>) {
    let store = Arc::new(MemStore::new());
    let opts = InitOptions {
        chunk_size,
        page_entries: 16,
        encrypt: passphrase.map(|p| (crate::Passphrase::new(p.to_vec()), KdfCost { m_kib: 8192, t: 1, p: 1 })),
        ..InitOptions::default()
    };
    (store.clone(), Arc::new(Repository::init(store, &opts).unwrap()))
}

fn run(src: &Arc<Repository>, dst: &Arc<Repository>, select: Select) -> CopyReport {
    let opts = CopyOptions { threads: 3, ..CopyOptions::default() };
    copy(src, dst, &select, &opts, &Progress::default(), &|_| {}).unwrap()
}

fn latest(repo: &Arc<Repository>, name: &str) -> SnapshotInfo {
    repo.resolve(name, None).unwrap()
}

fn assert_clean(repo: &Arc<Repository>) {
    let r = maint::check(repo).unwrap();
    assert!(r.problems.is_empty(), "{:?}", r.problems);
}

/// Two disks, the first with two snapshots (the second changed in a few chunks and grown
/// by a short tail).
fn source(chunk_size: u32, passphrase: Option<&[u8]>) -> (Arc<Repository>, Vec<(SnapshotInfo, Vec<u8>)>) {
    let (_, src) = repo_with(chunk_size, passphrase);
    let a1 = disk(40 * CS + 1234, 1);
    let s1 = backup(&src, "a", &a1, None);
    let mut a2 = a1.clone();
    a2[3 * CS..3 * CS + 100].fill(0x55);
    a2[17 * CS + 9] ^= 1;
    a2.extend_from_slice(&disk(2 * CS + 77, 9));
    let s2 = backup(&src, "a", &a2, Some(s1.clone()));
    let b = disk(9 * CS + 5, 2);
    let s3 = backup(&src, "b", &b, None);
    (src, vec![(s1, a1), (s2, a2), (s3, b)])
}

#[test]
fn entries_carry_over_between_keys_and_a_second_copy_sends_nothing() {
    let (src, snaps) = source(CS as u32, None);
    let (_, dst) = repo_with(CS as u32, Some(b"another key"));
    let r = run(&src, &dst, Select::All);
    assert_eq!((r.copied.len(), r.skipped.len(), r.failed.len()), (3, 0, 0), "{r:?}");
    assert!(r.chunks_sent > 0 && r.bytes_sent > 0, "{r:?}");
    // The second snapshot of `a` sends only what changed: its parent is the first copy.
    let (c1, c2) = (&r.copied[0], &r.copied[1]);
    assert_eq!(c2.parent.as_deref(), Some(c1.id.as_str()));
    assert!(c2.chunks_sent <= 4, "{c2:?}");
    assert!(c2.bytes_read <= 4 * CS as u64, "{c2:?}");
    let (all, _) = dst.snapshots_skipping().unwrap();
    for (snap, data) in &snaps {
        let copy = all.iter().find(|c| c.manifest.copied_from.as_ref().unwrap().snapshot == snap.id).unwrap();
        assert_eq!(read_back(&dst, copy), *data, "the copy of {} reads back", snap.id);
        let (m, c) = (&snap.manifest, &copy.manifest);
        assert!(m.blkhash.is_some());
        assert_eq!(
            (&c.blkhash, &c.time, &c.host, &c.source, c.size),
            (&m.blkhash, &m.time, &m.host, &m.source, m.size)
        );
        assert_eq!(c.copied_from.as_ref().unwrap().repository, src.config().id);
    }
    let first = r.copied.iter().map(|c| c.source_id.clone()).collect::<Vec<_>>();
    assert_clean(&dst);
    // Again: everything is there; nothing is read or sent.
    let again = run(&src, &dst, Select::All);
    assert_eq!((again.copied.len(), again.skipped.len(), again.bytes_sent, again.bytes_read), (0, 3, 0, 0));
    // And back: the destination's copies are the source's snapshots.
    let back = run(&dst, &src, Select::All);
    assert_eq!((back.copied.len(), back.skipped.len()), (0, 3), "{back:?}");
    // A third repository holding copies of the copies knows them too.
    let (_, third) = repo_with(CS as u32, None);
    assert_eq!(run(&dst, &third, Select::Disk("a".into())).copied.len(), 2);
    let r = run(&src, &third, Select::All);
    assert_eq!((r.copied.len(), r.skipped.len()), (1, 2), "{r:?}");
    // Each names the snapshot of the first repository it is a copy of.
    let (all, _) = third.snapshots_skipping().unwrap();
    for c in &all {
        let from = c.manifest.copied_from.as_ref().unwrap();
        assert!(from.repository == src.config().id && first.contains(&from.snapshot), "{from:?}");
    }
}

#[test]
fn other_chunk_sizes_are_cut_again_and_a_day_two_copy_reads_what_changed() {
    let (src, snaps) = source(CS as u32, Some(b"source key"));
    let (_, dst) = repo_with(16 * 1024, None);
    let one = run(&src, &dst, Select::One { name: "a".into(), id: snaps[0].0.id[..8].into() });
    assert_eq!(one.copied.len(), 1, "{one:?}");
    assert!(one.copied[0].rechunked);
    let day2 = run(&src, &dst, Select::Disk("a".into()));
    assert_eq!((day2.copied.len(), day2.skipped.len()), (1, 1), "{day2:?}");
    // Blocks of 1 MiB where the snapshot equals the one the parent was copied from are
    // left alone: 3 changed blocks (two changes and the grown tail), not 43.
    assert!(day2.bytes_read <= 4 << 20, "{day2:?}");
    let (all, _) = dst.snapshots_skipping().unwrap();
    assert_eq!(all.len(), 2);
    assert_eq!(read_back(&dst, &all[0]), snaps[0].1);
    assert_eq!(read_back(&dst, &all[1]), snaps[1].1);
    // Back into 64 KiB chunks: the blkhash is the first repository's again.
    let (_, third) = repo_with(CS as u32, None);
    run(&dst, &third, Select::All);
    let c = latest(&third, "a");
    assert_eq!(c.manifest.blkhash, snaps[1].0.manifest.blkhash);
    assert_eq!(read_back(&third, &c), snaps[1].1);
    assert_clean(&dst);
    assert_clean(&third);
}

#[test]
fn an_old_snapshot_copied_last_does_not_become_the_latest() {
    let (src, snaps) = source(CS as u32, None);
    let (_, dst) = repo_with(CS as u32, None);
    let newer = run(&src, &dst, Select::One { name: "a".into(), id: snaps[1].0.id.clone() });
    let older = run(&src, &dst, Select::One { name: "a".into(), id: snaps[0].0.id.clone() });
    assert_eq!(older.copied[0].parent, None, "{older:?}");
    assert_eq!(latest(&dst, "a").id, newer.copied[0].id);
    // A local backup in the destination continues the latest, the copy of the newer.
    assert_eq!(read_back(&dst, &latest(&dst, "a")), snaps[1].1);
}

#[test]
fn a_copy_is_never_dated_after_the_copiers_clock() {
    let (_, src) = repo_with(CS as u32, None);
    let data = disk(3 * CS, 4);
    let real = backup(&src, "f", &data, None);
    // The same snapshot, as a host whose clock was a century ahead would have written it.
    let mut m = crate::format::Manifest::parse(
        &src.read_named(&format!("snapshots/{}", real.id), "snapshots/", 1 << 20, crate::repo::AAD_SNAPSHOT).unwrap(),
        &src.limits(),
    )
    .unwrap();
    m.time = "2126-01-01T00:00:00Z".into();
    let sealed = src.crypto().seal(crate::repo::AAD_SNAPSHOT, &m.to_bytes());
    let id = crate::format::hex(&crate::repo::sha256(&sealed));
    src.store().put(&format!("snapshots/{id}"), &sealed).unwrap();
    src.store().delete(&format!("snapshots/{}", real.id)).unwrap();
    let (_, dst) = repo_with(CS as u32, None);
    let before = jiff::Timestamp::now();
    let r = run(&src, &dst, Select::All);
    let c = latest(&dst, "f");
    let t: jiff::Timestamp = c.manifest.time.parse().unwrap();
    assert!(t >= before && t <= jiff::Timestamp::now(), "{r:?}");
    assert_eq!(c.manifest.copied_from.as_ref().unwrap().time, "2126-01-01T00:00:00Z");
}

#[test]
fn a_damaged_source_snapshot_is_named_and_the_others_are_copied() {
    let (src, snaps) = source(CS as u32, None);
    // Lose the packs of disk b only: its chunks are in packs written after a's.
    let b_only: Vec<String> = {
        let index = src.load_index().unwrap();
        let a: std::collections::HashSet<crate::format::Digest> = [&snaps[0].0, &snaps[1].0]
            .iter()
            .flat_map(|s| src.entries(&index, s).unwrap())
            .filter(|d| *d != ZERO)
            .flat_map(|d| index.locations(&src.crypto().blob_id(&d)).map(|l| l.pack).collect::<Vec<_>>())
            .collect();
        src.entries(&index, &snaps[2].0)
            .unwrap()
            .into_iter()
            .filter(|d| *d != ZERO)
            .flat_map(|d| index.locations(&src.crypto().blob_id(&d)).map(|l| l.pack).collect::<Vec<_>>())
            .filter(|p| !a.contains(p))
            .map(|p| crate::repo::pack_name(&p))
            .collect()
    };
    assert!(!b_only.is_empty());
    for p in &b_only {
        let _ = src.store().delete(p);
    }
    let (_, dst) = repo_with(CS as u32, None);
    let r = run(&src, &dst, Select::All);
    assert_eq!((r.copied.len(), r.failed.len()), (2, 1), "{r:?}");
    let f = &r.failed[0];
    assert_eq!(f.source_id, snaps[2].0.id);
    assert!(f.error.contains(&snaps[2].0.id[..8]) && f.error.contains(" of b "), "{}", f.error);
    assert_eq!(read_back(&dst, &latest(&dst, "a")), snaps[1].1);
    assert!(dst.resolve("b", None).is_err());
}

#[test]
fn an_interrupted_copy_continues_from_its_checkpoint() {
    // Large enough for several reads of 4 MiB.
    let (_, src) = repo_with(CS as u32, None);
    let a = disk(300 * CS, 7);
    let snaps = [(backup(&src, "a", &a, None), a)];
    let (_, dst) = repo_with(CS as u32, Some(b"k"));
    let cancel = Arc::new(AtomicBool::new(false));
    let opts = CopyOptions {
        threads: 1,
        checkpoint_every: Some(std::time::Duration::ZERO),
        cancel: Some(cancel.clone()),
        ..CopyOptions::default()
    };
    let progress = Progress::default();
    // Stopped once the copy is under way and some of it is stored.
    let stopped = std::thread::scope(|s| {
        let watch = s.spawn(|| {
            while progress.done.load(Ordering::Relaxed) < 8 * CS as u64 {
                std::thread::yield_now();
            }
            cancel.store(true, Ordering::SeqCst);
        });
        let r = copy(&src, &dst, &Select::Disk("a".into()), &opts, &progress, &|_| {});
        cancel.store(true, Ordering::SeqCst);
        watch.join().unwrap();
        r
    });
    assert!(matches!(stopped, Err(Error::Interrupted)), "{stopped:?}");
    assert!(dst.checkpoint("a").unwrap().is_some());
    let resumed = Mutex::new(None);
    let r = copy(&src, &dst, &Select::All, &CopyOptions::default(), &Progress::default(), &|e| {
        if let Event::Start { resumed: Some(n), .. } = e {
            resumed.lock().unwrap().get_or_insert(n);
        }
    })
    .unwrap();
    assert_eq!(r.copied.len(), 1, "{r:?}");
    assert!(r.copied[0].resumed && resumed.into_inner().unwrap().unwrap() > 0, "{r:?}");
    assert!(dst.checkpoint("a").unwrap().is_none());
    for (snap, data) in &snaps {
        let (all, _) = dst.snapshots_skipping().unwrap();
        let c = all.iter().find(|c| c.manifest.copied_from.as_ref().unwrap().snapshot == snap.id).unwrap();
        assert_eq!(read_back(&dst, c), *data);
    }
    assert_clean(&dst);
}

#[test]
fn a_source_that_cannot_be_locked_is_copied_without_a_lock() {
    // Read-only credentials: the source's lock cannot be written.
    let store = Arc::new(Failing::new(Arc::new(MemStore::new())));
    let src =
        Arc::new(Repository::init(store.clone(), &InitOptions { page_entries: 16, ..InitOptions::default() }).unwrap());
    let data = disk(5 * CS + 99, 11);
    backup(&src, "ro", &data, None);
    *store.fail_put.lock().unwrap() = Some("locks/");
    // A store that fails otherwise is not taken for read-only: refused.
    let (_, dst) = repo_with(CS as u32, None);
    let opts = CopyOptions { threads: 2, ..CopyOptions::default() };
    let e = copy(&src, &dst, &Select::All, &opts, &Progress::default(), &|_| {}).unwrap_err();
    assert!(matches!(e, Error::Store { .. }), "{e:?}");
    *store.put_error.lock().unwrap() = std::io::ErrorKind::PermissionDenied;
    let r = run(&src, &dst, Select::All);
    assert_eq!(r.copied.len(), 1, "{r:?}");
    assert_eq!(read_back(&dst, &latest(&dst, "ro")), data);
    // A source whose lock another process holds is refused, not read without one.
    *store.fail_put.lock().unwrap() = None;
    let _gc = lock::acquire_gc(&(store.clone() as Arc<dyn Store>), None).unwrap();
    let opts = CopyOptions { threads: 2, ..CopyOptions::default() };
    let (_, other) = repo_with(CS as u32, None);
    let e = copy(&src, &other, &Select::All, &opts, &Progress::default(), &|_| {}).unwrap_err();
    assert!(matches!(e, Error::Locked(_)), "{e:?}");
}

/// Snapshot `s` of `repo` with its manifest changed by `edit` (as another host or an
/// older ferry would have written it): the new snapshot, in place of `s`.
fn rewrite(repo: &Arc<Repository>, s: &SnapshotInfo, edit: impl FnOnce(&mut crate::format::Manifest)) -> SnapshotInfo {
    let mut m = crate::format::Manifest::parse(
        &repo.read_named(&format!("snapshots/{}", s.id), "snapshots/", 1 << 20, crate::repo::AAD_SNAPSHOT).unwrap(),
        &repo.limits(),
    )
    .unwrap();
    edit(&mut m);
    let sealed = repo.crypto().seal(crate::repo::AAD_SNAPSHOT, &m.to_bytes());
    let id = crate::format::hex(&crate::repo::sha256(&sealed));
    repo.store().put(&format!("snapshots/{id}"), &sealed).unwrap();
    repo.store().delete(&format!("snapshots/{}", s.id)).unwrap();
    repo.resolve(&s.manifest.name, Some(&id)).unwrap()
}

#[test]
fn the_copy_of_the_sources_latest_is_the_latest_when_the_sources_clock_went_back() {
    let (_, src) = repo_with(CS as u32, None);
    let a1 = disk(6 * CS, 1);
    let s1 = backup(&src, "a", &a1, None);
    let mut a2 = a1.clone();
    a2[0..100].fill(0x77);
    let s2 = backup(&src, "a", &a2, Some(s1.clone()));
    // The second backup's host clock was an hour behind the first's.
    let t1: jiff::Timestamp = s1.manifest.time.parse().unwrap();
    let back = (t1 - jiff::SignedDuration::from_secs(3600)).to_string();
    let s2 = rewrite(&src, &s2, |m| m.time = back.clone());
    assert_eq!(latest(&src, "a").id, s2.id);
    let (_, dst) = repo_with(CS as u32, None);
    let r = run(&src, &dst, Select::All);
    let l = latest(&dst, "a");
    assert_eq!(l.manifest.copied_from.as_ref().unwrap().snapshot, s2.id, "{r:?}");
    assert_eq!(l.manifest.parent.as_deref(), Some(r.copied[0].id.as_str()));
    assert_eq!(read_back(&dst, &l), a2);
}

#[test]
fn a_copy_of_a_copy_is_dated_as_the_snapshot_it_copies() {
    let (_, a) = repo_with(CS as u32, None);
    let x = disk(4 * CS, 2);
    let sx = backup(&a, "f", &x, None);
    // Dated ahead of every clock: its copy in B is dated when it was made.
    let sx = rewrite(&a, &sx, |m| m.time = "2126-01-01T00:00:00Z".into());
    let (_, b) = repo_with(CS as u32, None);
    run(&a, &b, Select::All);
    let xb = latest(&b, "f");
    assert_ne!(xb.manifest.time, "2126-01-01T00:00:00Z");
    std::thread::sleep(std::time::Duration::from_millis(20));
    let mut y = x.clone();
    y[0..10].fill(9);
    backup(&b, "f", &y, Some(xb.clone()));
    let (_, c) = repo_with(CS as u32, None);
    run(&b, &c, Select::All);
    let (all, _) = c.snapshots_skipping().unwrap();
    let xc = all.iter().find(|s| s.manifest.copied_from.as_ref().unwrap().snapshot == sx.id).unwrap();
    assert_eq!(xc.manifest.time, xb.manifest.time, "the copy of B's copy is dated as B's");
    assert_eq!(read_back(&c, &latest(&c, "f")), y);
}

#[test]
fn a_copy_keeps_tags_and_note_and_a_version_1_source_copies_into_version_3() {
    let src = Arc::new(
        Repository::init(
            Arc::new(MemStore::new()),
            &InitOptions { chunk_size: CS as u32, page_entries: 16, version: 1, ..InitOptions::default() },
        )
        .unwrap(),
    );
    let data = disk(7 * CS + 3, 5);
    let s = backup(&src, "t", &data, None);
    let s = rewrite(&src, &s, |m| {
        m.tags = vec!["daily".into(), "keep".into()];
        m.note = "before the upgrade".into();
    });
    let (_, dst) = repo_with(CS as u32, None);
    assert_eq!(dst.config().version, crate::format::LOCATED_CONFIG_VERSION);
    let r = run(&src, &dst, Select::All);
    assert_eq!(r.copied.len(), 1, "{r:?}");
    let c = latest(&dst, "t");
    assert_eq!((&c.manifest.tags, &c.manifest.note), (&s.manifest.tags, &s.manifest.note));
    assert_eq!(c.manifest.version, crate::format::LOCATED_VERSION);
    assert_eq!(read_back(&dst, &c), data);
    assert_clean(&dst);
}

#[test]
fn a_manifest_that_cannot_be_read_fails_the_copy_of_one_disk_too() {
    let (src, _) = source(CS as u32, None);
    src.store().put(&format!("snapshots/{}", "ab".repeat(32)), b"not a manifest").unwrap();
    let (_, dst) = repo_with(CS as u32, None);
    for select in [Select::All, Select::Disk("a".into())] {
        let r = run(&src, &dst, select.clone());
        assert_eq!(r.failed.len(), 1, "{select:?}: {r:?}");
        assert_eq!(r.failed[0].source_id, "ab".repeat(32));
    }
}

/// A copy of every snapshot of `src` into `dst` interrupted once 8 chunks are done, with a
/// checkpoint after each chunk: it leaves its checkpoint in `dst`.
fn interrupt_copy(src: &Arc<Repository>, dst: &Arc<Repository>) {
    let cancel = Arc::new(AtomicBool::new(false));
    let opts = CopyOptions {
        threads: 1,
        checkpoint_every: Some(std::time::Duration::ZERO),
        cancel: Some(cancel.clone()),
        ..CopyOptions::default()
    };
    let progress = Progress::default();
    let _ = std::thread::scope(|s| {
        let watch = s.spawn(|| {
            while progress.done.load(Ordering::Relaxed) < 8 * CS as u64 {
                std::thread::yield_now();
            }
            cancel.store(true, Ordering::SeqCst);
        });
        let r = copy(src, dst, &Select::All, &opts, &progress, &|_| {});
        cancel.store(true, Ordering::SeqCst);
        watch.join().unwrap();
        r
    });
}

#[test]
fn the_leftover_checkpoint_of_a_finished_copy_is_recognised_and_removed() {
    let (_, src) = repo_with(CS as u32, None);
    let a = disk(300 * CS, 7);
    backup(&src, "a", &a, None);
    let (_, dst) = repo_with(CS as u32, None);
    interrupt_copy(&src, &dst);
    let ck = dst.checkpoint("a").unwrap().unwrap();
    let bytes = dst.store().get(&ck.object, 1 << 30).unwrap();
    let r = run(&src, &dst, Select::All);
    assert_eq!(r.copied.len(), 1);
    // Killed between storing the manifest and removing the checkpoint.
    dst.store().put(&ck.object, &bytes).unwrap();
    let (theirs, _) = dst.snapshots_skipping().unwrap();
    let ck = dst.checkpoint("a").unwrap().unwrap();
    assert_eq!(ck.superseded_by(&theirs).map(|s| s.id.as_str()), Some(r.copied[0].id.as_str()));
    let again = run(&src, &dst, Select::All);
    assert_eq!(again.skipped.len(), 1);
    assert!(dst.checkpoint("a").unwrap().is_none(), "the rerun left the leftover checkpoint");
}

#[test]
fn a_checkpoint_that_cannot_be_resumed_is_copied_afresh() {
    let (_, src) = repo_with(CS as u32, None);
    let a = disk(300 * CS, 8);
    backup(&src, "a", &a, None);
    let (dst_store, dst) = repo_with(CS as u32, None);
    interrupt_copy(&src, &dst);
    assert!(dst.checkpoint("a").unwrap().is_some());
    // The checkpoint's pages and chunks are lost: it cannot be continued.
    for p in dst_store.list("data/").unwrap() {
        dst_store.delete(&p.0).unwrap();
    }
    let r = run(&src, &dst, Select::All);
    assert_eq!((r.copied.len(), r.failed.len()), (1, 0), "{r:?}");
    assert!(!r.copied[0].resumed);
    assert_eq!(read_back(&dst, &latest(&dst, "a")), a);
}

/// Two copies into one destination side by side: the second stores a snapshot after the
/// first listed the destination and before it takes the disk's lock. The first lists
/// again under the lock and skips it: one copy of each snapshot, never two.
#[test]
fn a_snapshot_another_copy_stored_meanwhile_is_not_stored_twice() {
    let (src, snaps) = source(CS as u32, None);
    let (_, dst) = repo_with(CS as u32, None);
    let b = &snaps[2].0;
    // The other copy reads another copy of the source (this one holds the source's lock):
    // a copy of a copy is known as the snapshot it copies.
    let (_, other) = repo_with(CS as u32, None);
    let there = run(&src, &other, Select::One { name: "b".into(), id: b.id.clone() });
    let b_there = there.copied[0].id.clone();
    let beside = AtomicBool::new(false);
    let on = |e: Event| {
        // Once the first snapshot is copied (the destination was listed before it), the
        // other copy stores `b`.
        if matches!(e, Event::Copied(_)) && !beside.swap(true, Ordering::SeqCst) {
            let one = Select::One { name: "b".into(), id: b_there.clone() };
            assert_eq!(run(&other, &dst, one).copied.len(), 1);
        }
    };
    let opts = CopyOptions { threads: 3, ..CopyOptions::default() };
    let r = copy(&src, &dst, &Select::All, &opts, &Progress::default(), &on).unwrap();
    assert_eq!((r.copied.len(), r.skipped.len(), r.failed.len()), (2, 1, 0), "{r:?}");
    assert_eq!(r.skipped[0].source_id, b.id);
    let (all, _) = dst.snapshots_skipping().unwrap();
    let copies = all.iter().filter(|c| c.manifest.copied_from.as_ref().unwrap().snapshot == b.id).count();
    assert_eq!(copies, 1, "one copy of the snapshot of b");
    assert_eq!(all.len(), 3);
    assert_clean(&dst);
}

/// `repo copy` takes a shared lock on its source: a second copy from the same source
/// (to another offsite repository) and a backup into the source run beside it, while a
/// forget or a gc of the source waits for it.
#[test]
fn two_copies_from_one_source_run_at_once_and_a_forget_waits_for_both() {
    let (src, snaps) = source(CS as u32, None);
    let (_, first) = repo_with(CS as u32, None);
    let (_, second) = repo_with(CS as u32, Some(b"offsite"));
    let store = src.store().clone();
    let beside = AtomicBool::new(false);
    let on = |e: Event| {
        if !matches!(e, Event::Copied(_)) || beside.swap(true, Ordering::SeqCst) {
            return;
        }
        // The first copy holds its lock on the source now.
        assert!(lock::list(&store).unwrap().iter().any(|(_, l, _)| l.what() == "read"));
        let r = run(&src, &second, Select::All);
        assert_eq!((r.copied.len(), r.failed.len()), (3, 0), "the second copy ran beside the first: {r:?}");
        backup(&src, "c", &disk(3 * CS, 5), None);
        let e = lock::acquire(&store, crate::format::LockKind::Forget, None, None).err().unwrap();
        assert!(matches!(&e, Error::Locked(m) if m.contains("a read by process")), "{e}");
        let e = lock::acquire_gc(&store, None).err().unwrap();
        assert!(matches!(e, Error::Locked(_)), "{e}");
    };
    let opts = CopyOptions { threads: 2, ..CopyOptions::default() };
    let r = copy(&src, &first, &Select::All, &opts, &Progress::default(), &on).unwrap();
    assert!(beside.load(Ordering::SeqCst));
    assert_eq!((r.copied.len(), r.failed.len()), (3, 0), "{r:?}");
    for repo in [&first, &second] {
        for (snap, data) in &snaps {
            let (all, _) = repo.snapshots_skipping().unwrap();
            let copy = all.iter().find(|c| c.manifest.copied_from.as_ref().unwrap().snapshot == snap.id).unwrap();
            assert_eq!(read_back(repo, copy), *data);
        }
        assert_clean(repo);
    }
    // Both copies are over: their locks are gone and a forget holds.
    assert!(lock::list(&store).unwrap().is_empty());
    drop(lock::acquire(&store, crate::format::LockKind::Forget, None, None).unwrap());
}
