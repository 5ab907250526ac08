//! `ferry repo migrate` (FORMAT.md §9): interrupted, and its lock lost.
use super::*;
use crate::maint::GcOptions;
use std::time::Duration;

fn v1_repo(store: Arc<dyn Store>) -> Arc<Repository> {
    let o = InitOptions { chunk_size: CS as u32, page_entries: 16, version: 1, ..InitOptions::default() };
    Arc::new(Repository::init(store, &o).unwrap())
}

fn reopen(store: Arc<dyn Store>) -> Arc<Repository> {
    Arc::new(Repository::open(store, &|| unreachable!()).unwrap())
}

fn gc_now(repo: &Repository) {
    maint::gc_opts(repo, &GcOptions { wait: None, repack_percent: 10, condemn_margin: Duration::ZERO }).unwrap();
}

/// Unique chunks that compress to a few bytes: the version 1 pages are most of the bytes.
fn filled(len: usize) -> Vec<u8> {
    let mut d = vec![0u8; len];
    for (i, c) in d.chunks_mut(CS).enumerate() {
        c.fill(i as u8 + 1);
    }
    d
}

/// A migrate killed after storing the new manifest, before deleting the old one: `old`
/// put back as the deletion never happened.
fn interrupted(store: &Arc<MemStore>, data: &[u8]) -> Arc<Repository> {
    let repo = v1_repo(store.clone());
    let s1 = backup(&repo, "a", data, None);
    let name = format!("snapshots/{}", s1.id);
    let old = store.get(&name, 1 << 30).unwrap();
    crate::migrate::migrate(&repo, false, &mut |_| {}).unwrap();
    store.put(&name, &old).unwrap();
    reopen(store.clone())
}

/// gc after an interrupted migrate deletes the hidden old manifest (migrate's last step)
/// before it marks, so that a forget of the new one never brings the old one back with
/// its pages freed.
#[test]
fn gc_then_forget_after_an_interrupted_migrate() {
    let store = Arc::new(MemStore::new());
    let d1 = filled(2 << 20);
    let repo = interrupted(&store, &d1);
    gc_now(&repo);
    gc_now(&repo);
    assert_eq!(store.list("snapshots/").unwrap().len(), 1, "the old manifest stays after gc");
    let listed = repo.snapshots().unwrap();
    let mut d2 = d1.clone();
    d2[..CS].fill(0xee);
    let s2 = backup(&repo, "a", &d2, listed.last().cloned());
    maint::forget(&repo, Some("a"), &Policy { keep_last: Some(1), ..Policy::default() }, false).unwrap();
    let (after, bad) = repo.snapshots_lenient().unwrap();
    assert!(bad.is_empty());
    assert_eq!(after.iter().map(|s| s.id.clone()).collect::<Vec<_>>(), vec![s2.id.clone()]);
    assert_eq!(read_back(&repo, &s2), d2);
    assert!(maint::check(&repo).unwrap().problems.is_empty());
}

/// forget after an interrupted migrate finishes it too: the forgotten snapshot's old
/// manifest does not come back.
#[test]
fn forget_after_an_interrupted_migrate() {
    let store = Arc::new(MemStore::new());
    let d1 = disk(2 << 20, 5);
    let repo = interrupted(&store, &d1);
    let listed = repo.snapshots().unwrap();
    let d2 = disk(2 << 20, 6);
    let s2 = backup(&repo, "a", &d2, listed.last().cloned());
    maint::forget(&repo, Some("a"), &Policy { keep_last: Some(1), ..Policy::default() }, false).unwrap();
    gc_now(&repo);
    let (after, bad) = repo.snapshots_lenient().unwrap();
    assert!(bad.is_empty());
    assert_eq!(after.iter().map(|s| s.id.clone()).collect::<Vec<_>>(), vec![s2.id.clone()]);
    assert!(maint::check(&repo).unwrap().problems.is_empty());
}

/// A migrate whose lock is lost while it stores a new manifest deletes that manifest
/// again and keeps the old one: it never deletes without its lock.
#[test]
fn migrate_stops_when_its_lock_is_lost() {
    let mem = Arc::new(MemStore::new());
    let thief = Arc::new(Hooked::new(mem.clone()));
    let repo = v1_repo(thief.clone());
    let data = disk(2 << 20, 7);
    let s1 = backup(&repo, "a", &data, None);
    // The locks vanish (another host took them for stale) once a manifest is stored.
    thief.after_put("snapshots/", drop_locks);
    let e = crate::migrate::migrate(&repo, false, &mut |_| {}).unwrap_err();
    assert!(matches!(e, Error::Locked(_)), "{e}");
    thief.set_hook(None);
    let names: Vec<String> = mem.list("snapshots/").unwrap().into_iter().map(|(n, _)| n).collect();
    assert_eq!(names, vec![format!("snapshots/{}", s1.id)], "the old manifest alone stays");
    let repo = reopen(mem.clone());
    let listed = repo.snapshots().unwrap();
    assert_eq!(read_back(&repo, &listed[0]), data);
    // A rerun finishes the job.
    crate::migrate::migrate(&repo, false, &mut |_| {}).unwrap();
    let listed = repo.snapshots().unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].manifest.migrated_from.as_deref(), Some(s1.id.as_str()));
    assert_eq!(read_back(&repo, &listed[0]), data);
}

/// A manifest that cannot be read, and a snapshot one of whose pages cannot, are skipped
/// and reported: the other snapshots are migrated.
#[test]
fn migrate_skips_what_is_damaged_and_migrates_the_rest() {
    let store = Arc::new(MemStore::new());
    let repo = v1_repo(store.clone());
    let packs = || -> Vec<String> { store.list("data/").unwrap().into_iter().map(|(n, _)| n).collect() };
    let a = backup(&repo, "a", &disk(1 << 20, 11), None);
    let before_b = packs();
    // Chunks (and pages) of their own, shared with no other disk.
    let own = |seed: u8| {
        let mut d = vec![0u8; 1 << 20];
        d.chunks_mut(CS).enumerate().for_each(|(i, c)| c.fill(seed.wrapping_add(i as u8)));
        d
    };
    let b = backup(&repo, "b", &own(1), None);
    let of_b: Vec<String> = packs().into_iter().filter(|n| !before_b.contains(n)).collect();
    let cdata = own(101);
    let c = backup(&repo, "c", &cdata, None);
    // a's manifest garbled; every pack b stored garbled past its first bytes.
    store.put(&format!("snapshots/{}", a.id), b"not a manifest").unwrap();
    for n in &of_b {
        let mut bytes = store.get(n, 1 << 30).unwrap();
        bytes.iter_mut().skip(16).for_each(|x| *x ^= 0x5a);
        store.put(n, &bytes).unwrap();
    }
    let repo = reopen(store.clone());
    let r = crate::migrate::migrate(&repo, false, &mut |_| {}).unwrap();
    for id in [&a.id, &b.id] {
        assert!(r.skipped.iter().any(|s| s.starts_with(&format!("snapshots/{id}"))), "{:?}", r.skipped);
    }
    assert_eq!((r.migrated, r.skipped.len()), (1, 2), "{r:?}");
    let repo = reopen(store.clone());
    let (listed, _) = repo.snapshots_lenient().unwrap();
    let c2 = listed.iter().find(|s| s.manifest.name == "c").unwrap();
    assert_eq!(c2.manifest.migrated_from.as_deref(), Some(c.id.as_str()));
    assert_eq!(read_back(&repo, c2), cdata);
}

/// A listing names a migrated parent by its new id; reading a snapshot's pages accepts
/// that parent only when its manifest was migrated from the one the stored manifest names,
/// not any other.
#[test]
fn pages_follow_a_migrated_parent_and_nothing_else() {
    let store = Arc::new(MemStore::new());
    let repo = v1_repo(store.clone());
    let s1 = backup(&repo, "a", &filled(CS * 20), None);
    let s2 = backup(&repo, "a", &disk(CS * 20, 2), Some(s1.clone()));
    let other = backup(&repo, "b", &disk(CS * 4, 3), None);
    let old2 = store.get(&format!("snapshots/{}", s2.id), 1 << 30).unwrap();
    crate::migrate::migrate(&repo, false, &mut |_| {}).unwrap();
    // s2 as it was before the migrate (one stopped before it got to s2), its parent migrated.
    let repo = reopen(store.clone());
    let new2 = repo.snapshots().unwrap().into_iter().find(|s| s.manifest.migrated_from.as_deref() == Some(&s2.id));
    store.delete(&format!("snapshots/{}", new2.unwrap().id)).unwrap();
    store.put(&format!("snapshots/{}", s2.id), &old2).unwrap();
    let snaps = repo.snapshots().unwrap();
    let listed2 = snaps.iter().find(|s| s.id == s2.id).unwrap().clone();
    let new1 = snaps.iter().find(|s| s.manifest.migrated_from.as_deref() == Some(&s1.id)).unwrap();
    assert_eq!(listed2.manifest.parent.as_deref(), Some(new1.id.as_str()));
    assert!(repo.pages(&listed2).is_ok());
    // Another snapshot named as the parent is not the manifest stored.
    let other_id = snaps.iter().find(|s| s.manifest.migrated_from.as_deref() == Some(&other.id)).unwrap().id.clone();
    let mut wrong = listed2.clone();
    wrong.manifest.parent = Some(other_id);
    let e = repo.pages(&wrong).unwrap_err();
    assert!(matches!(e, Error::Damaged { .. }), "{e}");
}

/// A resumed backup through a repository opened before a migrate is refused too, before
/// it writes anything.
#[test]
fn a_resume_opened_before_a_migrate_is_refused() {
    let store = Arc::new(MemStore::new());
    let repo = v1_repo(store.clone());
    let d1 = filled(2 << 20);
    let w = SnapshotWriter::start(repo.clone(), opts("b", d1.len() as u64, None)).unwrap();
    w.write(&d1[..1 << 20], 0, false).unwrap();
    w.checkpoint().unwrap();
    drop(w);
    let ck = repo.checkpoint("b").unwrap().expect("a checkpoint");
    crate::migrate::migrate(&reopen(store.clone()), false, &mut |_| {}).unwrap();
    let before = store.list("").unwrap();
    let e = SnapshotWriter::resume(repo.clone(), opts("b", d1.len() as u64, None), &ck).err().unwrap();
    assert!(e.to_string().contains("changed since this command opened it"), "{e}");
    assert_eq!(store.list("").unwrap(), before, "nothing is written");
}

/// A backup through a repository opened before a migrate (a libvirt run's second disk,
/// or a backup that waited for its lock) is refused before it writes anything: it would
/// store version 1 pages in a version 3 repository. Reopened, it goes on.
#[test]
fn a_backup_opened_before_a_migrate_is_refused() {
    let store = Arc::new(MemStore::new());
    let repo = v1_repo(store.clone());
    let d1 = filled(1 << 20);
    let s1 = backup(&repo, "a", &d1, None);
    crate::migrate::migrate(&reopen(store.clone()), false, &mut |_| {}).unwrap();
    let before = store.list("").unwrap();
    let e = SnapshotWriter::start(repo.clone(), opts("b", d1.len() as u64, None)).err().unwrap();
    assert!(e.to_string().contains("changed since this command opened it"), "{e}");
    assert_eq!(store.list("").unwrap(), before, "nothing is written");
    let repo = reopen(store.clone());
    let listed = repo.snapshots().unwrap();
    assert_eq!(listed.len(), 1);
    assert_ne!(listed[0].id, s1.id, "migrated");
    let s2 = backup(&repo, "b", &d1, None);
    assert_eq!(read_back(&repo, &s2), d1);
    assert!(maint::check(&repo).unwrap().problems.is_empty());
}

/// The migrated parent a listing names is read again to check a snapshot's pages: a store
/// that fails to read it gives a store error (a read error's exit status) that names it
/// and the snapshot and says to try again, and a parent damaged since is damage of that
/// parent, never of the snapshot.
#[test]
fn an_unreadable_migrated_parent_is_a_store_error_and_a_damaged_one_its_own_damage() {
    let inner = Arc::new(MemStore::new());
    let store = Arc::new(Hooked::new(inner.clone()));
    let repo = v1_repo(store.clone());
    let s1 = backup(&repo, "a", &filled(CS * 20), None);
    let s2 = backup(&repo, "a", &disk(CS * 20, 2), Some(s1.clone()));
    let old2 = inner.get(&format!("snapshots/{}", s2.id), 1 << 30).unwrap();
    crate::migrate::migrate(&repo, false, &mut |_| {}).unwrap();
    // s2 as a migrate stopped before it got to s2 left it, its parent migrated.
    let repo = reopen(store.clone());
    let new2 = repo.snapshots().unwrap().into_iter().find(|s| s.manifest.migrated_from.as_deref() == Some(&s2.id));
    inner.delete(&format!("snapshots/{}", new2.unwrap().id)).unwrap();
    inner.put(&format!("snapshots/{}", s2.id), &old2).unwrap();
    let listed2 = repo.snapshots().unwrap().into_iter().find(|s| s.id == s2.id).unwrap();
    let parent = format!("snapshots/{}", listed2.manifest.parent.clone().unwrap());
    assert_ne!(parent, format!("snapshots/{}", s1.id), "listed by its new id");

    let failing = parent.clone();
    store.set_hook(Some(Box::new(move |_, when, op, name| match (when, op) {
        (When::Before, Op::Get) if name == failing => Err(std::io::Error::other("connection reset")),
        _ => Ok(()),
    })));
    let e = repo.pages(&listed2).unwrap_err();
    assert!(matches!(e, Error::Store { .. }), "{e}");
    assert_eq!(e.failure(), None, "a read error's exit status, not damage's");
    let msg = e.to_string();
    assert!(msg.contains(&parent) && msg.contains(&s2.id) && msg.contains("try again"), "{msg}");
    store.set_hook(None);
    assert!(repo.pages(&listed2).is_ok(), "it reads once the store does");

    let mut bad = inner.get(&parent, 1 << 30).unwrap();
    bad[10] ^= 1;
    inner.put(&parent, &bad).unwrap();
    match repo.pages(&listed2).unwrap_err() {
        Error::Damaged { object, why } => {
            assert_eq!(object, parent, "the parent is damaged, not the snapshot");
            assert!(why.contains(&s2.id), "{why}");
        }
        e => panic!("{e}"),
    }
}

/// A migration whose located pages would fill a pack past the blob cap (a reader refuses
/// a trailer that lists too many) closes the pack at the cap and opens another: no pack
/// it writes lists more than [`crate::migrate::PACK_BLOBS`] blobs (4 in the crate's
/// tests, 65,536 otherwise), and the snapshot reads back whole.
#[test]
fn a_migration_splits_its_located_pages_at_the_pack_blob_cap() {
    let store = Arc::new(MemStore::new());
    let repo = v1_repo(store.clone());
    // 14 pages of 16 chunks, each a located page of its own.
    let data = filled(14 * 16 * CS);
    backup(&repo, "a", &data, None);
    crate::migrate::migrate(&repo, false, &mut |_| {}).unwrap();
    let repo = reopen(store.clone());
    let (objects, _) = repo.index_objects().unwrap();
    let located: Vec<usize> = objects
        .iter()
        .flat_map(|(_, ps)| ps.iter())
        .map(|p| p.blobs.iter().filter(|b| b.kind == crate::format::BlobKind::Located).count())
        .filter(|n| *n > 0)
        .collect();
    assert_eq!(located.iter().sum::<usize>(), 14, "{located:?}");
    assert!(located.iter().all(|n| *n <= crate::migrate::PACK_BLOBS), "{located:?}");
    assert_eq!(located.len(), 14usize.div_ceil(crate::migrate::PACK_BLOBS), "{located:?}");
    let listed = repo.snapshots().unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(read_back(&repo, &listed[0]), data);
    assert!(maint::check(&repo).unwrap().problems.is_empty());
}

/// A page that only the manifest from before a migration lists, and that cannot be read,
/// stops gc with the name of that manifest and of the snapshot migrated from it (main
/// said only "a migrated snapshot", whichever manifest listed it); nothing is deleted.
#[test]
fn gc_names_the_old_manifest_whose_page_it_cannot_read() {
    let store = Arc::new(MemStore::new());
    let repo = v1_repo(store.clone());
    let data = filled(2 << 20);
    let s1 = backup(&repo, "a", &data, None);
    let page = repo.pages(&s1).unwrap().nonzero()[0];
    let name = format!("snapshots/{}", s1.id);
    let old = store.get(&name, 1 << 30).unwrap();
    crate::migrate::migrate(&repo, false, &mut |_| {}).unwrap();
    store.put(&name, &old).unwrap();
    let repo = reopen(store.clone());
    let new = repo.snapshots().unwrap()[0].id.clone();
    let loc = repo.load_index().unwrap().blobs[&repo.crypto.blob_id(&page)];
    store.tamper(&crate::repo::pack_name(&loc.pack), |v| v[loc.offset as usize + loc.stored_len as usize / 2] ^= 0x5a);
    let packs = store.list("data/").unwrap();
    let e = maint::gc_opts(&repo, &GcOptions { wait: None, repack_percent: 10, condemn_margin: Duration::ZERO })
        .unwrap_err()
        .to_string();
    let want = format!("page {} of snapshots/{}", crate::format::hex(&page), s1.id);
    assert!(e.contains(&want) && e.contains(&format!("migration to snapshot {new}")), "{want}: {e}");
    assert_eq!(store.list("data/").unwrap(), packs, "gc deleted a pack");
}
