//! Retention (`crate::retain`): restic's rules and reasons, protection, tags, and gc's
//! dry run.
use super::*;
use crate::retain::{self, Within};
use jiff::tz::TimeZone;
use std::collections::HashSet;

/// Snapshots of one disk at `times` (newest first), ids `0000`, `0001`...
fn at(times: &[&str]) -> Vec<SnapshotInfo> {
    times.iter().enumerate().map(|(i, t)| fake(&format!("{i:04}"), t)).collect()
}

fn why(snaps: &[SnapshotInfo], p: &Policy, tz: &TimeZone) -> Vec<Vec<String>> {
    let now = "2030-01-01T00:00:00Z".parse().unwrap();
    retain::reasons(snaps, p, &HashSet::new(), tz, now)
}

#[test]
fn hourly_and_yearly_buckets_keep_the_newest_of_each() {
    let snaps = at(&[
        "2026-03-10T20:40:00Z",
        "2026-03-10T20:10:00Z",
        "2026-03-10T19:59:00Z",
        "2025-12-31T23:00:00Z",
        "2025-06-01T00:00:00Z",
        "2024-01-01T00:00:00Z",
        "2023-05-05T00:00:00Z",
    ]);
    let kept = |p: Policy| -> Vec<usize> {
        why(&snaps, &p, &TimeZone::UTC).iter().enumerate().filter(|(_, r)| !r.is_empty()).map(|(i, _)| i).collect()
    };
    assert_eq!(kept(Policy { keep_hourly: Some(2), ..Policy::default() }), vec![0, 2]);
    assert_eq!(kept(Policy { keep_yearly: Some(3), ..Policy::default() }), vec![0, 3, 5]);
    // Counts left when the oldest comes: it is kept too (restic 0.15 and later).
    assert_eq!(kept(Policy { keep_yearly: Some(9), ..Policy::default() }), vec![0, 3, 5, 6]);
    assert_eq!(kept(Policy { keep_last: Some(7), ..Policy::default() }), (0..7).collect::<Vec<_>>());
}

#[test]
fn the_calendar_is_read_in_the_zone_given() {
    // 23:30 UTC on 03-09 is 00:30 on 03-10 in Berlin: one day there, two in UTC.
    let snaps = at(&["2026-03-10T10:00:00Z", "2026-03-09T23:30:00Z", "2026-03-08T10:00:00Z"]);
    let p = Policy { keep_daily: Some(2), ..Policy::default() };
    let berlin = TimeZone::get("Europe/Berlin").unwrap();
    let count = |tz: &TimeZone| why(&snaps, &p, tz).iter().filter(|r| !r.is_empty()).count();
    let days = |tz: &TimeZone| why(&snaps, &p, tz)[1].is_empty();
    assert!(!days(&TimeZone::UTC), "in UTC 03-09 is a day of its own");
    assert!(days(&berlin), "in Berlin it is 03-10's");
    assert_eq!((count(&TimeZone::UTC), count(&berlin)), (2, 2));
}

#[test]
fn within_counts_from_the_latest_snapshot_not_from_now_nor_the_future() {
    let snaps = at(&[
        "2031-01-01T00:00:00Z", // in the future of `now`: not the latest
        "2026-03-10T12:00:00Z",
        "2026-03-03T12:00:01Z",
        "2026-03-03T12:00:00Z",
        "2026-02-01T00:00:00Z",
    ]);
    let p = Policy { keep_within: Some(Within::parse("7d").unwrap()), ..Policy::default() };
    let r = why(&snaps, &p, &TimeZone::UTC);
    let kept: Vec<bool> = r.iter().map(|r| !r.is_empty()).collect();
    // Newer than 03-03 12:00 (not equal), and the future one.
    assert_eq!(kept, [true, true, true, false, false]);
    assert_eq!(r[1], ["within 7d"]);
}

#[test]
fn every_reason_is_given() {
    let mut snaps = at(&["2026-03-10T12:00:00Z", "2026-03-09T12:00:00Z", "2026-01-09T12:00:00Z"]);
    snaps[2].manifest.tags = vec!["keep".into(), "db".into()];
    let p = Policy {
        keep_daily: Some(1),
        keep_monthly: Some(1),
        keep_within: Some(Within::parse("1d").unwrap()),
        keep_tags: vec![vec!["keep".into()], vec!["db".into(), "other".into()]],
        ..Policy::default()
    };
    let protected: HashSet<String> = ["0001".to_string()].into();
    let now = "2030-01-01T00:00:00Z".parse().unwrap();
    let r = retain::reasons(&snaps, &p, &protected, &TimeZone::UTC, now);
    assert_eq!(r[0], ["within 1d", "daily snapshot", "monthly snapshot"]);
    assert_eq!(r[1], ["protected"]);
    assert_eq!(r[2], ["tag keep"], "db,other needs both tags");
    // The same without the protection: removed.
    let r = retain::reasons(&snaps, &p, &HashSet::new(), &TimeZone::UTC, now);
    assert!(r[1].is_empty());
}

#[test]
fn a_protected_snapshot_is_never_forgotten() {
    let (_store, repo) = new_repo(true);
    let a = backup(&repo, "d", &disk(3 * CS, 1), None);
    let b = backup(&repo, "d", &disk(3 * CS, 2), Some(a.clone()));
    assert!(retain::set_protected(&repo, &a, true, None).unwrap());
    assert!(!retain::set_protected(&repo, &a, true, None).unwrap(), "once");
    let r = maint::forget(&repo, None, &Policy { keep_last: Some(1), ..Policy::default() }, false).unwrap();
    assert_eq!(r.removed, Vec::<String>::new());
    assert_eq!(r.reasons[&a.id], ["protected"]);
    assert_eq!(r.reasons[&b.id], ["last snapshot"]);
    // Nor by its id.
    let e = maint::forget_ids(&repo, None, &[a.id[..8].to_string()], false, None).unwrap_err();
    assert!(e.to_string().contains("protected"), "{e}");
    assert_eq!(repo.snapshots().unwrap().len(), 2);
    // Unprotected, the policy decides again.
    assert!(retain::set_protected(&repo, &a, false, None).unwrap());
    let r = maint::forget(&repo, None, &Policy { keep_last: Some(1), ..Policy::default() }, false).unwrap();
    assert_eq!(r.removed, std::slice::from_ref(&a.id));
}

#[test]
fn tags_and_a_note_are_kept_and_bounded() {
    let (_store, repo) = new_repo(false);
    let data = disk(2 * CS, 3);
    let o = BackupOptions {
        tags: vec!["weekly".into(), "db:pg".into()],
        note: "before the upgrade".into(),
        ..opts("d", data.len() as u64, None)
    };
    let w = SnapshotWriter::start(repo.clone(), o).unwrap();
    write_all(&w, &data);
    let s = w.commit(data.len() as u64).unwrap();
    let listed = repo.resolve("d", None).unwrap();
    assert_eq!(listed.id, s.id);
    assert_eq!(listed.manifest.tags, ["weekly", "db:pg"]);
    assert_eq!(listed.manifest.note, "before the upgrade");
    for (tags, note) in [
        (vec!["a,b".to_string()], ""),
        (vec![String::new()], ""),
        (vec!["t".to_string(); 17], ""),
        (vec![], "two\nlines"),
        (vec![], "\u{1b}[31mred"),
        (vec![], "bidi \u{202e}txt.exe"),
        (vec![], "zero\u{200b}width"),
    ] {
        let o = BackupOptions { tags, note: note.into(), ..opts("d", data.len() as u64, None) };
        assert!(matches!(SnapshotWriter::start(repo.clone(), o), Err(Error::Invalid(_))));
    }
}

#[test]
fn a_gc_dry_run_says_what_gc_frees_and_changes_nothing() {
    let (store, repo) = new_repo(false);
    let a = backup(&repo, "d", &disk(40 * CS, 4), None);
    backup(&repo, "e", &disk(40 * CS, 5), None);
    maint::forget_ids(&repo, None, &[a.id[..8].to_string()], false, None).unwrap();
    // The stale lock of a forget whose process is gone: gc removes it, a dry run leaves it.
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let dead = child.id();
    child.wait().unwrap();
    let now = jiff::Timestamp::now().to_string();
    let stale = crate::format::Lock {
        kind: crate::format::LockKind::Forget,
        disk: None,
        host: crate::repo::hostname(),
        pid: dead,
        time: now.clone(),
        refreshed: now,
        boot: crate::lock::this_boot(),
        pid_start: None,
        condemned: false,
        shared: false,
    };
    store.put("locks/00000000000000000000000000000001", &stale.to_bytes()).unwrap();
    let before: Vec<String> = store.list("").unwrap().into_iter().map(|(n, _)| n).collect();
    let o = maint::GcOptions { wait: None, repack_percent: 10, condemn_margin: std::time::Duration::ZERO };
    let dry = maint::gc_dry_run(&repo, &o).unwrap();
    let after: Vec<String> = store.list("").unwrap().into_iter().map(|(n, _)| n).collect();
    assert_eq!(before, after, "a dry run writes and removes nothing");
    assert!(dry.packs_deleted + dry.packs_repacked > 0 && dry.bytes_freed > 0, "{dry:?}");
    let real = maint::gc_opts(&repo, &o).unwrap();
    assert_eq!(
        (dry.packs_deleted, dry.packs_repacked, dry.blobs_freed),
        (real.packs_deleted, real.packs_repacked, real.blobs_freed)
    );
    assert_eq!(dry.bytes_before, real.bytes_before);
}

#[test]
fn forget_removes_the_points_whose_snapshots_are_all_gone_and_points_follow_migrations() {
    use crate::{PointDisk, PointRecord};
    let (_store, repo) = new_repo(false);
    let a = backup(&repo, "vm-vda", &disk(2 * CS, 1), None);
    let b = backup(&repo, "vm-vdb", &disk(2 * CS, 2), None);
    let c = backup(&repo, "vm-vda", &disk(2 * CS, 3), None);
    let pd = |s: &SnapshotInfo, t: &str| PointDisk {
        target: t.into(),
        name: s.manifest.name.clone(),
        snapshot: s.id.clone(),
        tracked: false,
    };
    let both = repo
        .put_point(&PointRecord::new("vm", None, None, "<domain/>".into(), vec![pd(&a, "vda"), pd(&b, "vdb")]))
        .unwrap();
    let one = repo.put_point(&PointRecord::new("vm", None, None, "<domain/>".into(), vec![pd(&a, "vda")])).unwrap();
    let later = repo.put_point(&PointRecord::new("vm", None, None, "<domain/>".into(), vec![pd(&c, "vda")])).unwrap();
    let r = maint::forget_ids(&repo, None, &[a.id[..8].to_string()], true, None).unwrap();
    assert!(r.notes.iter().any(|n| n.contains(&one[..8]) && n.contains("would be")), "{:?}", r.notes);
    assert_eq!(repo.points().unwrap().0.len(), 3, "a dry run removes nothing");
    let r = maint::forget_ids(&repo, None, &[a.id[..8].to_string()], false, None).unwrap();
    assert_eq!(r.notes.len(), 1, "{:?}", r.notes);
    let left: Vec<String> = repo.points().unwrap().0.into_iter().map(|(id, _)| id).collect();
    assert!(left.contains(&both) && left.contains(&later) && !left.contains(&one), "{left:?}");
    // A snapshot migrated has a new id; its manifest names the old one.
    let mut moved = fake(&"e".repeat(64), "2026-11-28T10:00:00Z");
    moved.manifest.migrated_from = Some(c.id.clone());
    let (mut points, _) = repo.points().unwrap();
    crate::points::follow_migrations(&mut points, &[moved]);
    let p = points.iter().find(|(id, _)| *id == later).unwrap();
    assert_eq!(p.1.disks[0].snapshot, "e".repeat(64));
}

#[test]
fn within_keeps_everything_when_every_snapshot_is_in_the_future() {
    // The forget host's clock is behind every writer's: no snapshot is before now, and
    // restic then counts each as within (nothing to measure the span from).
    let snaps = at(&["2031-03-10T12:00:00Z", "2031-01-01T00:00:00Z", "2030-06-01T00:00:00Z"]);
    let p = Policy { keep_within: Some(Within::parse("7d").unwrap()), ..Policy::default() };
    let r = why(&snaps, &p, &TimeZone::UTC);
    assert!(r.iter().all(|r| r == &["within 7d"]), "{r:?}");
}

#[test]
fn the_latest_is_kept_and_the_rules_run_by_time() {
    // The repository's order (a snapshot after its parent, whatever the clocks said):
    // the second is dated after the first, the fourth after the third.
    let snaps = at(&[
        "2026-03-10T10:00:00Z",
        "2026-03-12T10:00:00Z",
        "2026-03-01T10:00:00Z",
        "2026-03-11T10:00:00Z",
        "2026-03-10T09:00:00Z",
    ]);
    let kept = |p: Policy| -> Vec<usize> {
        why(&snaps, &p, &TimeZone::UTC).iter().enumerate().filter(|(_, r)| !r.is_empty()).map(|(i, _)| i).collect()
    };
    // The two newest by time (as restic), and the disk's latest (the first: what a restore
    // takes), though its host's clock was behind.
    assert_eq!(kept(Policy { keep_last: Some(2), ..Policy::default() }), vec![0, 1, 3]);
    assert_eq!(why(&snaps, &Policy { keep_last: Some(1), ..Policy::default() }, &TimeZone::UTC)[0], [retain::LATEST]);
    // Days by time: 03-12, 03-11, 03-10 (its newest, the first).
    assert_eq!(kept(Policy { keep_daily: Some(3), ..Policy::default() }), vec![0, 1, 3]);
    // Counts left when the oldest by time comes: it is kept; 03-10's second does not count twice.
    assert_eq!(kept(Policy { keep_daily: Some(9), ..Policy::default() }), vec![0, 1, 2, 3]);
    assert_eq!(kept(Policy { keep_daily: Some(4), ..Policy::default() }), vec![0, 1, 2, 3]);
    // With a tag rule alone, the latest is kept though untagged.
    assert_eq!(kept(Policy { keep_tags: vec![vec!["none".into()]], ..Policy::default() }), vec![0]);
}

#[test]
fn protect_refuses_a_snapshot_a_forget_removed() {
    let (store, repo) = new_repo(false);
    let a = backup(&repo, "d", &disk(3 * CS, 1), None);
    backup(&repo, "d", &disk(3 * CS, 2), Some(a.clone()));
    // The caller resolved `a`, then a forget removed it before protect took the lock.
    maint::forget_ids(&repo, None, &[a.id[..8].to_string()], false, None).unwrap();
    let e = retain::set_protected(&repo, &a, true, None).unwrap_err();
    assert!(matches!(e, Error::NotFound(_)), "{e}");
    assert!(store.list("protected/").unwrap().is_empty(), "no mark of a removed snapshot");
}

#[test]
fn migrate_moves_each_mark_to_the_new_id() {
    let store = Arc::new(MemStore::new());
    let opts = InitOptions { chunk_size: CS as u32, page_entries: 16, version: 1, ..InitOptions::default() };
    let repo = Arc::new(Repository::init(store.clone(), &opts).unwrap());
    let a = backup(&repo, "d", &disk(3 * CS, 1), None);
    let b = backup(&repo, "d", &disk(3 * CS, 2), Some(a.clone()));
    assert!(retain::set_protected(&repo, &a, true, None).unwrap());
    crate::migrate::migrate(&repo, false, &mut |_| {}).unwrap();
    let repo = Arc::new(Repository::open(store, &|| panic!("asked for a passphrase")).unwrap());
    let snaps = repo.snapshots().unwrap();
    let new_a = snaps.iter().find(|s| s.manifest.migrated_from.as_deref() == Some(a.id.as_str())).unwrap();
    assert_eq!(retain::protected(&repo).unwrap(), HashSet::from([new_a.id.clone()]), "the old mark is gone");
    let r = maint::forget(&repo, None, &Policy { keep_last: Some(1), ..Policy::default() }, false).unwrap();
    assert_eq!(r.reasons[&new_a.id], ["protected"]);
    assert!(r.removed.is_empty(), "{:?}", r.removed);
    assert!(snaps.iter().any(|s| s.manifest.migrated_from.as_deref() == Some(b.id.as_str())));
    assert_eq!(repo.snapshots().unwrap().len(), 2, "the protected snapshot stays");
}

#[test]
fn the_mark_of_the_id_a_snapshot_was_migrated_from_counts_for_it() {
    // A migrate stopped after storing the new manifest, before writing its mark.
    let mut snaps = at(&["2026-03-10T12:00:00Z", "2026-03-09T12:00:00Z"]);
    snaps[1].manifest.migrated_from = Some("old1".into());
    let protected: HashSet<String> = ["old1".to_string()].into();
    let p = Policy { keep_last: Some(1), ..Policy::default() };
    let now = "2030-01-01T00:00:00Z".parse().unwrap();
    let r = retain::reasons(&snaps, &p, &protected, &TimeZone::UTC, now);
    assert_eq!(r[1], ["protected"]);
}

#[test]
fn a_fixed_time_before_the_disks_latest_snapshot_is_refused() {
    let (_store, repo) = new_repo(false);
    let data = disk(2 * CS, 3);
    let at = |t: &str, base: Option<SnapshotInfo>| BackupOptions {
        time: Some(t.parse().unwrap()),
        ..opts("d", data.len() as u64, base)
    };
    let w = SnapshotWriter::start(repo.clone(), at("2026-11-20T10:00:00Z", None)).unwrap();
    write_all(&w, &data);
    let a = w.commit(data.len() as u64).unwrap();
    // A full backup (no parent) dated earlier would be listed before `a`.
    let e = SnapshotWriter::start(repo.clone(), at("2026-11-19T10:00:00Z", None)).err().unwrap();
    assert!(matches!(e, Error::Invalid(_)), "{e}");
    // The same time, a later one, or another disk: fine.
    drop(SnapshotWriter::start(repo.clone(), at("2026-11-20T10:00:00Z", Some(a.clone()))).unwrap());
    drop(
        SnapshotWriter::start(repo.clone(), BackupOptions { name: "e".into(), ..at("2026-11-01T10:00:00Z", None) })
            .unwrap(),
    );
    assert_eq!(repo.snapshots().unwrap().len(), 1);
}

#[test]
fn gc_removes_the_marks_of_snapshots_that_are_gone() {
    let (store, repo) = new_repo(false);
    let a = backup(&repo, "d", &disk(3 * CS, 1), None);
    let b = backup(&repo, "d", &disk(3 * CS, 2), Some(a.clone()));
    assert!(retain::set_protected(&repo, &a, true, None).unwrap());
    assert!(retain::set_protected(&repo, &b, true, None).unwrap());
    // An older ferry's forget (or a person) removed `a` but not its mark.
    store.delete(&format!("snapshots/{}", a.id)).unwrap();
    let o = maint::GcOptions { wait: None, repack_percent: 10, condemn_margin: std::time::Duration::ZERO };
    maint::gc_dry_run(&repo, &o).unwrap();
    assert_eq!(retain::protected(&repo).unwrap().len(), 2, "a dry run removes nothing");
    maint::gc_opts(&repo, &o).unwrap();
    assert_eq!(retain::protected(&repo).unwrap(), HashSet::from([b.id.clone()]));
}

#[test]
fn unprotect_removes_the_mark_a_stopped_migrate_left_under_the_old_id() {
    let store = Arc::new(MemStore::new());
    let opts = InitOptions { chunk_size: CS as u32, page_entries: 16, version: 1, ..InitOptions::default() };
    let repo = Arc::new(Repository::init(store.clone(), &opts).unwrap());
    let a = backup(&repo, "d", &disk(3 * CS, 1), None);
    assert!(retain::set_protected(&repo, &a, true, None).unwrap());
    let old_manifest = store.get(&format!("snapshots/{}", a.id), 1 << 30).unwrap();
    let old_mark = store.get(&format!("protected/{}", a.id), 1 << 20).unwrap();
    crate::migrate::migrate(&repo, false, &mut |_| {}).unwrap();
    // Stopped after storing the new manifest, before marking it: the old manifest and mark stay.
    let repo = Arc::new(Repository::open(store.clone(), &|| panic!("asked for a passphrase")).unwrap());
    let new_a = repo.snapshots().unwrap().pop().unwrap();
    assert_eq!(new_a.manifest.migrated_from.as_deref(), Some(a.id.as_str()));
    store.delete(&format!("protected/{}", new_a.id)).unwrap();
    store.put(&format!("snapshots/{}", a.id), &old_manifest).unwrap();
    store.put(&format!("protected/{}", a.id), &old_mark).unwrap();
    let new_a = repo.snapshots().unwrap().pop().unwrap();
    assert!(retain::is_protected(&retain::protected(&repo).unwrap(), &new_a));
    assert!(!retain::set_protected(&repo, &new_a, true, None).unwrap(), "protected already");
    assert!(retain::set_protected(&repo, &new_a, false, None).unwrap());
    assert!(retain::protected(&repo).unwrap().is_empty(), "the old id's mark is gone");
}

/// gc lists the marks before the snapshots: a snapshot stored and protected while gc
/// prunes the marks keeps its mark.
#[test]
fn gc_keeps_the_mark_of_a_snapshot_stored_meanwhile() {
    let inner = Arc::new(MemStore::new());
    let store = Arc::new(Hooked::new(inner.clone()));
    let o = InitOptions { chunk_size: CS as u32, page_entries: 16, ..InitOptions::default() };
    let repo = Arc::new(Repository::init(store.clone(), &o).unwrap());
    let a = backup(&repo, "d", &disk(3 * CS, 1), None);
    let b = backup(&repo, "d", &disk(3 * CS, 2), Some(a.clone()));
    let manifest = format!("snapshots/{}", b.id);
    let bytes = inner.get(&manifest, 1 << 30).unwrap();
    inner.delete(&manifest).unwrap();
    // `b` is stored, then protected, just before gc lists `protected/`.
    let mut armed = true;
    let mark = format!("protected/{}", b.id);
    store.set_hook(Some(Box::new(move |s, when, op, prefix| {
        if (when, op, prefix) == (When::Before, Op::List, "protected/") && std::mem::take(&mut armed) {
            s.put(&manifest, &bytes)?;
            s.put(&mark, b"protected meanwhile\n")?;
        }
        Ok(())
    })));
    let o = maint::GcOptions { wait: None, repack_percent: 10, condemn_margin: std::time::Duration::ZERO };
    maint::gc_opts(&repo, &o).unwrap();
    store.set_hook(None);
    assert!(retain::protected(&repo).unwrap().contains(&b.id), "gc removed the mark of a snapshot stored meanwhile");
}
