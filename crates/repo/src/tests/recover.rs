//! Damage records (FORMAT.md §7b) and repair, over a [`MemStore`] with small packs.
use super::*;
use crate::recover::{self, RepairOptions};

fn verify_all(repo: &Repository) -> maint::Report {
    maint::verify(repo, &VerifyOptions::all(2)).unwrap()
}

/// Every index object lost: repair indexes every pack again from its (encrypted)
/// trailer; a dry run writes nothing; the snapshot reads back and gc frees nothing.
#[test]
fn repair_indexes_every_pack_again() {
    let (store, repo) = new_repo(true);
    let data = disk(2 << 20, 21);
    let snap = backup(&repo, "d", &data, None);
    let packs = objects(&store, "data/");
    assert!(packs.len() > 2, "small packs: {packs:?}");
    for (name, _) in objects(&store, "index/") {
        store.tamper(&name, |v| v.truncate(v.len() / 2));
    }
    assert!(maint::gc(&repo, None).is_err(), "gc refuses while the index is damaged");
    assert_eq!(objects(&store, "data/"), packs);
    let before = (objects(&store, "index/"), objects(&store, "locks/"));
    let dry = recover::repair(&repo, &RepairOptions { dry_run: true, ..RepairOptions::default() }).unwrap();
    assert_eq!(dry.packs_indexed.len(), packs.len());
    assert_eq!((objects(&store, "index/"), objects(&store, "locks/")), before, "a dry run changes nothing");
    let r = recover::repair(&repo, &RepairOptions::default()).unwrap();
    assert_eq!(r.packs_indexed.len(), packs.len());
    assert_eq!(r.index_removed.len(), before.0.len());
    assert!(r.packs_unreadable.is_empty() && r.manifests.is_empty());
    assert!(maint::check(&repo).unwrap().problems.is_empty());
    assert_eq!(read_back(&repo, &snap), data);
    let g = maint::gc(&repo, None).unwrap();
    assert_eq!(g.packs_deleted, 0);
    assert_eq!(read_back(&repo, &snap), data);
}

/// A damaged chunk: verify records it; a backup of the same data stores that chunk
/// again (one new chunk); both snapshots read back; gc removes the damaged copy and the
/// record, and verify is clean.
#[test]
fn recorded_damage_is_stored_again_and_collected() {
    for encrypt in [false, true] {
        let (store, repo) = new_repo(encrypt);
        let data = disk(2 << 20, 22);
        let s1 = backup(&repo, "d", &data, None);
        let (pack, at) = where_is(&repo, &s1, 7);
        store.tamper(&pack, |v| v[at as usize] ^= 1);
        let r = verify_all(&repo);
        assert_eq!(r.problems.len(), 1, "{:?}", r.problems);
        assert_eq!(objects(&store, "damage/").len(), 1);
        assert_eq!(maint::damaged_snapshots(&repo, std::slice::from_ref(&s1)).unwrap().len(), 1);
        let w = SnapshotWriter::start(repo.clone(), opts("d", data.len() as u64, Some(s1.clone()))).unwrap();
        write_all(&w, &data);
        let s2 = w.commit(data.len() as u64).unwrap();
        assert_eq!(s2.manifest.stats.new_chunks, 1, "the damaged chunk is stored again");
        assert_eq!(read_back(&repo, &s1), data);
        assert_eq!(read_back(&repo, &s2), data);
        assert!(maint::damaged_snapshots(&repo, &[s1.clone(), s2.clone()]).unwrap().is_empty());
        let r = verify_all(&repo);
        assert!(r.problems.is_empty(), "{:?}", r.problems);
        maint::gc(&repo, None).unwrap();
        assert!(objects(&store, "damage/").is_empty());
        assert!(!objects(&store, "data/").iter().any(|(n, _)| *n == pack));
        let r = verify_all(&repo);
        // gc moved chunks of s1's and s2's pages: their hints there went stale (a note).
        assert!(r.problems.is_empty() && only_stale_hints(&r.notes), "{:?} {:?}", r.problems, r.notes);
        assert_eq!(read_back(&repo, &s1), data);
    }
}

/// A damage record that cannot be read stops gc; repair removes it.
#[test]
fn an_unreadable_damage_record_stops_gc_until_repair() {
    let (store, repo) = new_repo(false);
    let data = disk(1 << 20, 23);
    let s1 = backup(&repo, "d", &data, None);
    store.put("damage/00", b"{}").unwrap();
    let e = maint::gc(&repo, None).unwrap_err().to_string();
    assert!(e.contains("ferry repo repair"), "{e}");
    let r = recover::repair(&repo, &RepairOptions::default()).unwrap();
    assert_eq!(r.damage_removed.len(), 1);
    assert!(objects(&store, "damage/").is_empty());
    maint::gc(&repo, None).unwrap();
    assert_eq!(read_back(&repo, &s1), data);
}

/// A recorded pack that reads back whole again (mended by hand, or read wrong once):
/// verify clears its record and reports no damage.
#[test]
fn verify_clears_the_record_of_a_mended_pack() {
    let (store, repo) = new_repo(true);
    let data = disk(1 << 20, 24);
    let s1 = backup(&repo, "d", &data, None);
    let (pack, at) = where_is(&repo, &s1, 2);
    store.tamper(&pack, |v| v[at as usize] ^= 1);
    assert_eq!(verify_all(&repo).problems.len(), 1);
    assert_eq!(maint::check(&repo).unwrap().problems.len(), 1, "check knows the record");
    store.tamper(&pack, |v| v[at as usize] ^= 1);
    let r = verify_all(&repo);
    assert!(r.problems.is_empty(), "{:?}", r.problems);
    assert!(r.notes.iter().any(|n| n.contains("reads back whole now")), "{:?}", r.notes);
    assert!(objects(&store, "damage/").is_empty());
    let r = maint::check(&repo).unwrap();
    assert!(r.problems.is_empty() && r.notes.is_empty(), "{:?} {:?}", r.problems, r.notes);
    assert_eq!(read_back(&repo, &s1), data);
}

/// repair stopped at each of its writes (the new index objects, the removal of the
/// damaged ones) leaves a repository whose snapshot reads back, and the next repair
/// finishes; so does a gc with damage records stopped at each of its steps.
#[test]
fn repair_and_gc_with_records_stopped_at_any_step() {
    for (put, delete) in [(Some("index/"), None), (None, Some("index/"))] {
        let inner = Arc::new(MemStore::new());
        let store = Arc::new(Failing::new(inner.clone()));
        let repo = Arc::new(
            Repository::init(store.clone(), &InitOptions { page_entries: 16, ..InitOptions::default() }).unwrap(),
        );
        let data = disk(2 << 20, 25);
        let s1 = backup(&repo, "d", &data, None);
        for (name, _) in objects(&inner, "index/") {
            inner.tamper(&name, |v| v.truncate(40));
        }
        *store.fail_put.lock().unwrap() = put;
        *store.fail_delete.lock().unwrap() = delete;
        assert!(recover::repair(&repo, &RepairOptions::default()).is_err(), "{put:?} {delete:?}");
        *store.fail_put.lock().unwrap() = None;
        *store.fail_delete.lock().unwrap() = None;
        if put.is_none() {
            // Stopped after the new index objects: the snapshot reads already.
            assert_eq!(read_back(&repo, &s1), data, "{delete:?}");
        }
        recover::repair(&repo, &RepairOptions::default()).unwrap();
        assert!(maint::check(&repo).unwrap().problems.is_empty(), "{put:?} {delete:?}");
        assert_eq!(read_back(&repo, &s1), data);
    }
    let steps = [
        (Some("data/"), None),
        (Some("index/"), None),
        (None, Some("index/")),
        (None, Some("data/")),
        (None, Some("damage/")),
    ];
    for (put, delete) in steps {
        let inner = Arc::new(MemStore::new());
        let store = Arc::new(Failing::new(inner.clone()));
        let repo = Arc::new(
            Repository::init(store.clone(), &InitOptions { page_entries: 16, ..InitOptions::default() }).unwrap(),
        );
        let data = disk(2 << 20, 26);
        let s1 = backup(&repo, "d", &data, None);
        let (pack, at) = where_is(&repo, &s1, 7);
        inner.tamper(&pack, |v| v[at as usize] ^= 1);
        verify_all(&repo);
        let s2 = backup(&repo, "d", &data, Some(s1.clone()));
        *store.fail_put.lock().unwrap() = put;
        *store.fail_delete.lock().unwrap() = delete;
        assert!(maint::gc(&repo, None).is_err(), "gc did not stop at {put:?} {delete:?}");
        *store.fail_put.lock().unwrap() = None;
        *store.fail_delete.lock().unwrap() = None;
        assert!(read_back(&repo, &s1) == data && read_back(&repo, &s2) == data, "{put:?} {delete:?}");
        // Whatever step it stopped at, the damaged copy is never read nor deduplicated.
        assert!(maint::damaged_snapshots(&repo, &[s1.clone(), s2.clone()]).unwrap().is_empty());
        maint::gc(&repo, None).unwrap();
        let r = verify_all(&repo);
        assert!(r.problems.is_empty() && only_stale_hints(&r.notes), "{put:?} {delete:?}: {r:?}");
        assert!(objects(&inner, "damage/").is_empty());
        assert!(read_back(&repo, &s1) == data && read_back(&repo, &s2) == data);
    }
}

/// A chunk of a change-map backup's base recorded damaged, with no good copy: the backup
/// treats it as lost (it reads it from the source again, or commits nothing), the new
/// snapshot is whole and not marked damaged, and gc then keeps the new good copy and
/// drops the damaged one with its record.
#[test]
fn a_change_map_backup_reads_recorded_damage_of_its_base_again() {
    let (store, repo) = new_repo(true);
    let data = disk(2 << 20, 23);
    let s1 = backup(&repo, "d", &data, None);
    let cs = s1.manifest.chunk_size as usize;
    let (pack, at) = where_is(&repo, &s1, 7);
    store.tamper(&pack, |v| v[at as usize] ^= 1);
    verify_all(&repo);
    assert_eq!(objects(&store, "damage/").len(), 1);
    let size = data.len() as u64;
    let start = || {
        let o = crate::BackupOptions {
            changes: crate::format::Changes::ExtentsFrom { file: "map.json".into() },
            ..opts("d", size, Some(s1.clone()))
        };
        SnapshotWriter::start(repo.clone(), o).unwrap()
    };
    // Nothing changed; the damaged chunk is to be read again.
    let w = start();
    let lost = w.lost_ranges();
    assert_eq!(lost, vec![(7 * cs as u64, cs as u64)], "only the damaged chunk");
    let e = w.commit(0).unwrap_err();
    assert!(e.to_string().contains("nothing was committed"), "{e}");
    drop(w);
    let w = start();
    for (o, l) in w.lost_ranges() {
        w.write(&data[o as usize..(o + l) as usize], o, false).unwrap();
    }
    let s2 = w.commit(cs as u64).unwrap();
    assert_eq!(s2.manifest.stats.new_chunks, 1, "the damaged chunk is stored again");
    // Two copies now, the good one first, for every reader.
    let index = repo.load_index().unwrap();
    let id = repo.crypto.blob_id(&repo.entries(&index, &s2).unwrap()[7]);
    let copies: Vec<String> = index.locations(&id).map(|l| crate::repo::pack_name(&l.pack)).collect();
    assert_eq!(copies.len(), 2);
    assert_eq!(copies[1], pack, "the damaged copy last");
    assert!(maint::damaged_snapshots(&repo, &[s1.clone(), s2.clone()]).unwrap().is_empty());
    assert!(maint::check(&repo).unwrap().problems.is_empty());
    assert_eq!(read_back(&repo, &s1), data);
    assert_eq!(read_back(&repo, &s2), data);
    maint::gc(&repo, None).unwrap();
    assert!(objects(&store, "damage/").is_empty());
    assert!(!objects(&store, "data/").iter().any(|(n, _)| *n == pack));
    let index = repo.load_index().unwrap();
    assert!(index.more.is_empty(), "one copy of each blob is left");
    assert!(verify_all(&repo).problems.is_empty());
    assert_eq!(read_back(&repo, &s1), data);
}
