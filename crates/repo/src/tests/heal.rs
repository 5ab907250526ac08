//! Damage heals and never spreads (issue 34, items 1, 3 and 4): a copy in a lost pack does
//! not hide a good one, a backup never commits a chunk it knows is gone, an unreadable
//! base stops only a change-map backup, and one damaged manifest stops no other disk.
use super::{backup, disk, new_repo, opts, read_back, where_is, write_all, CS};
use crate::format::{BlobKind, Changes, Digest, PackBlobs};
use crate::maint::{self, Policy};
use crate::repo::{build_index, pack_name, Location};
use crate::store::{MemStore, Store};
use crate::{Error, Index, Repository, SnapshotInfo, SnapshotWriter};
use ferry_backend::Backend;
use std::sync::Arc;

fn loc(pack: u8, offset: u32) -> Location {
    Location { pack: [pack; 32], kind: BlobKind::Data, offset, stored_len: 10, plain_len: 10 }
}

#[test]
fn the_index_keeps_every_copy_and_drops_only_lost_ones() {
    let id: Digest = [7; 32];
    let mut index = Index::default();
    index.add(id, loc(1, 0));
    index.add(id, loc(2, 50));
    index.add(id, loc(1, 0)); // the same copy listed twice
    index.add([8; 32], loc(2, 60));
    assert_eq!(index.locations(&id).map(|l| l.pack[0]).collect::<Vec<_>>(), [1, 2]);
    assert_eq!(index.more.len(), 1, "only blobs with several copies take room beside the first");
    // Pack 1 lost: the blob keeps its copy in pack 2, first now.
    assert_eq!(index.retain_packs(|p| p[0] != 1), 0);
    assert_eq!(index.blobs[&id].pack[0], 2);
    assert!(index.more.is_empty());
    // Pack 2 lost too: both blobs leave.
    assert_eq!(index.retain_packs(|p| p[0] != 2), 2);
    assert!(!index.contains(&id) && index.locations(&id).next().is_none());
}

/// The packs holding chunk `chunk` of `snap`, first copy first.
fn copies(repo: &Repository, snap: &SnapshotInfo, chunk: usize) -> Vec<String> {
    let index = repo.load_index().unwrap();
    let e = repo.entries(&index, snap).unwrap()[chunk];
    index.locations(&repo.crypto.blob_id(&e)).map(|l| pack_name(&l.pack)).collect()
}

/// The blob id of chunk `chunk` of `snap`.
fn chunk_id(repo: &Repository, snap: &SnapshotInfo, chunk: usize) -> Digest {
    let index = repo.load_index().unwrap();
    repo.crypto.blob_id(&repo.entries(&index, snap).unwrap()[chunk])
}

/// Index objects that list `pack` again, each with another part of its blobs (always
/// `keep`, the blob the test looks at; encrypted, each also gets a random nonce), until one
/// sorts before `other`: the index then lists `pack`'s copy of `keep` first, whatever names
/// the backups' own index objects got. Hundreds of names to draw from, so it never fails
/// in practice.
fn list_first(store: &MemStore, repo: &Repository, pack: &str, other: &str, keep: &Digest) {
    let (objects, _) = repo.index_objects().unwrap();
    let listed: PackBlobs =
        objects.iter().flat_map(|(_, ps)| ps.iter()).find(|p| pack_name(&p.pack) == pack).unwrap().clone();
    let n = listed.blobs.len();
    assert!(listed.blobs.iter().any(|b| b.id == *keep), "{pack} does not hold the blob looked at");
    // Other packs listed again beside it (harmless: the same copies) give more names.
    // Each other pack alone, and each pair of them: a small repository (a pack of two
    // blobs, few other packs) still gives enough distinct names.
    let singles: Vec<PackBlobs> =
        objects.iter().flat_map(|(_, ps)| ps.iter()).filter(|p| p.pack != listed.pack).cloned().collect();
    let others: Vec<Vec<PackBlobs>> = std::iter::once(Vec::new())
        .chain(singles.iter().map(|p| vec![p.clone()]))
        .chain(
            (0..singles.len())
                .flat_map(|a| (a + 1..singles.len()).map(move |b| (a, b)))
                .map(|(a, b)| vec![singles[a].clone(), singles[b].clone()]),
        )
        // And one other pack listed again up to 256 times (each count another name).
        .chain(singles.iter().take(1).flat_map(|p| (2..=256).map(move |r| vec![p.clone(); r])))
        .collect();
    let rounds = if repo.crypto.is_encrypted() { 16 } else { 1 };
    let parts =
        (0..rounds).flat_map(|_| others.iter()).flat_map(|o| (0..n).flat_map(move |i| (i..n).map(move |j| (o, i, j))));
    for (extra, i, j) in parts {
        let blobs = listed.blobs.iter().enumerate().filter(|(k, b)| (*k != i && *k != j) || b.id == *keep);
        let part = PackBlobs { pack: listed.pack, blobs: blobs.map(|(_, b)| *b).collect() };
        let all: Vec<PackBlobs> = std::iter::once(part).chain(extra.iter().cloned()).collect();
        let (names, _) = repo.put_index(&all).unwrap();
        if names[0].as_str() < other {
            return;
        }
        store.delete(&names[0]).unwrap();
    }
    panic!("no index object naming {pack} sorts before {other} ({n} blobs)");
}

/// The index objects of the repository in `store`.
fn index_names(store: &MemStore) -> Vec<String> {
    store.list("index/").unwrap().into_iter().map(|(n, _)| n).collect()
}

/// A full backup of disk `d` (`data`) on top of `base`, in packs of another size than
/// [`backup`]'s: the chunks it stores again make other packs than those lost (the same
/// chunks in a pack of the same size would make the same pack, under the lost one's name).
fn backup_in_small_packs(repo: &Arc<Repository>, data: &[u8], base: &SnapshotInfo) -> SnapshotInfo {
    let o = crate::BackupOptions { pack_size: 100 * 1024, ..opts("d", data.len() as u64, Some(base.clone())) };
    let w = SnapshotWriter::start(repo.clone(), o).unwrap();
    write_all(&w, data);
    w.commit(data.len() as u64).unwrap()
}

#[test]
fn a_copy_in_a_lost_pack_does_not_hide_the_one_a_full_backup_stored_again() {
    for encrypt in [false, true] {
        let (store, repo) = new_repo(encrypt);
        let data = disk(3 << 20, 31);
        let first = backup(&repo, "d", &data, None);
        let (lost, _) = where_is(&repo, &first, 7);
        let index_before = index_names(&store);
        store.delete(&lost).unwrap();
        // A full backup of the unchanged disk stores the lost chunks again.
        let second = backup_in_small_packs(&repo, &data, &first);
        let new_index: Vec<String> = index_names(&store).into_iter().filter(|n| !index_before.contains(n)).collect();
        list_first(&store, &repo, &lost, new_index.iter().min().unwrap(), &chunk_id(&repo, &first, 7));
        let c = copies(&repo, &second, 7);
        assert_eq!(c.len(), 2, "{c:?}");
        assert_eq!(c[0], lost, "the lost copy is listed first");
        // Both snapshots read: the first one's chunks have a good copy again.
        assert!(read_back(&repo, &second) == data, "the new snapshot does not read back");
        assert!(read_back(&repo, &first) == data, "the old snapshot does not read back");
        // check names the lost pack but no snapshot that lost data, and says gc drops it.
        let r = maint::check(&repo).unwrap();
        assert_eq!(r.problems.len(), 1, "{:?}", r.problems);
        assert_eq!(r.problems[0].object, lost);
        assert!(r.problems[0].hits.is_empty(), "{:?}", r.problems[0]);
        assert!(r.problems[0].why.contains("gc"), "{}", r.problems[0].why);
        let v = maint::verify(&repo, &maint::VerifyOptions::all(2)).unwrap();
        assert!(v.problems.iter().all(|p| p.hits.is_empty()), "{:?}", v.problems);
        // gc drops the lost pack from the index: the repository is whole again.
        maint::gc(&repo, None).unwrap();
        assert!(maint::check(&repo).unwrap().problems.is_empty());
        assert!(read_back(&repo, &first) == data && read_back(&repo, &second) == data);
    }
}

#[test]
fn a_page_whose_first_copy_is_lost_reads_from_another() {
    let (store, repo) = new_repo(false);
    let data = disk(2 << 20, 32);
    let first = backup(&repo, "d", &data, None);
    // The pages are in the last pack written; lose it, store them again with a backup.
    let page = repo.crypto.blob_id(&repo.pages(&first).unwrap().to_vec()[0]);
    let index = repo.load_index().unwrap();
    let pack = pack_name(&index.blobs[&page].pack);
    let index_before = index_names(&store);
    store.delete(&pack).unwrap();
    // Its base unreadable, a full backup goes on without it (item 3) and stores every page
    // and chunk again.
    let second = backup_in_small_packs(&repo, &data, &first);
    assert_eq!(second.manifest.parent, None);
    assert_eq!(repo.pages(&second).unwrap(), repo.pages(&first).unwrap());
    let new_index: Vec<String> = index_names(&store).into_iter().filter(|n| !index_before.contains(n)).collect();
    list_first(&store, &repo, &pack, new_index.iter().min().unwrap(), &page);
    let index = repo.load_index().unwrap();
    assert_eq!(pack_name(&index.blobs[&page].pack), pack, "the lost copy of the page is listed first");
    assert!(read_back(&repo, &first) == data);
    assert!(maint::check(&repo).unwrap().problems.iter().all(|p| p.hits.is_empty()));
}

/// The data packs of `snap` (not the last one, which holds its pages).
fn a_data_pack(repo: &Repository, snap: &SnapshotInfo) -> String {
    let (pack, _) = where_is(repo, snap, 1);
    let index = repo.load_index().unwrap();
    let page = repo.crypto.blob_id(&repo.pages(snap).unwrap().to_vec()[0]);
    assert_ne!(pack_name(&index.blobs[&page].pack), pack, "chunk 1 shares its pack with the pages");
    pack
}

#[test]
fn an_incremental_backup_reads_the_lost_chunks_of_its_base_again_or_commits_nothing() {
    let (store, repo) = new_repo(false);
    let mut data = disk(3 << 20, 33);
    let first = backup(&repo, "d", &data, None);
    let lost = a_data_pack(&repo, &first);
    store.delete(&lost).unwrap();
    // Chunk 2 changes; a change map names it alone.
    data[2 * CS..3 * CS].fill(0xa5);
    let size = data.len() as u64;
    let map = Changes::ExtentsFrom { file: "map.json".into() };
    let start = || {
        let o = crate::BackupOptions { changes: map.clone(), ..opts("d", size, Some(first.clone())) };
        SnapshotWriter::start(repo.clone(), o).unwrap()
    };
    let w = start();
    let lost_ranges = w.lost_ranges();
    assert!(!lost_ranges.is_empty());
    assert!(lost_ranges.iter().any(|(o, l)| *o <= CS as u64 && o + l >= 2 * CS as u64), "{lost_ranges:?}");
    // Only the change written: the commit refuses (it would name lost chunks).
    w.write(&data[2 * CS..3 * CS], 2 * CS as u64, false).unwrap();
    let e = w.commit(CS as u64).unwrap_err();
    assert!(e.to_string().contains("lost") && e.to_string().contains("nothing was committed"), "{e}");
    assert!(repo.snapshots().unwrap().len() == 1, "nothing was committed");
    drop(w);
    // The change and the lost ranges written: committed, and it reads back whole.
    let w = start();
    w.write(&data[2 * CS..3 * CS], 2 * CS as u64, false).unwrap();
    for (o, l) in w.lost_ranges() {
        w.write(&data[o as usize..(o + l) as usize], o, false).unwrap();
    }
    let snap = w.commit(CS as u64).unwrap();
    assert!(read_back(&repo, &snap) == data, "the incremental snapshot does not read back");
}

#[test]
fn an_unreadable_base_stops_a_change_map_backup_but_not_a_full_one() {
    let (store, repo) = new_repo(true);
    let data = disk(1 << 20, 34);
    let first = backup(&repo, "d", &data, None);
    // The only packs: the disk's chunks and pages are gone.
    for (p, _) in store.list("data/").unwrap() {
        store.delete(&p).unwrap();
    }
    let size = data.len() as u64;
    let map = crate::BackupOptions {
        changes: Changes::DirtyBitmap { bitmap: "b0".into() },
        ..opts("d", size, Some(first.clone()))
    };
    let e = SnapshotWriter::start(repo.clone(), map).err().expect("a change map on an unreadable base");
    assert!(matches!(e, Error::Invalid(_)), "{e:?}");
    let m = e.to_string();
    assert!(m.contains("without the change map") && m.contains(&first.id[..8]), "{m}");
    // A full backup needs nothing from it.
    let w = SnapshotWriter::start(repo.clone(), opts("d", size, Some(first.clone()))).unwrap();
    write_all(&w, &data);
    let snap = w.commit(size).unwrap();
    assert_eq!(snap.manifest.parent, None);
    assert!(read_back(&repo, &snap) == data);
}

/// Flips a byte of `snapshots/ID`, or empties it.
fn damage_manifest(store: &MemStore, id: &str, empty: bool) {
    store.tamper(&format!("snapshots/{id}"), |v| if empty { v.clear() } else { v[10] ^= 1 });
}

#[test]
fn one_damaged_manifest_stops_no_other_disk() {
    for (encrypt, empty) in [(false, false), (true, true)] {
        let (store, repo) = new_repo(encrypt);
        let (a, b) = (disk(1 << 20, 35), disk(1 << 20, 36));
        let sa = backup(&repo, "a", &a, None);
        let sb1 = backup(&repo, "b", &b, None);
        let sb2 = backup(&repo, "b", &b, Some(sb1.clone()));
        damage_manifest(&store, &sa.id, empty);
        assert!(repo.snapshots().is_err(), "the strict list (gc's) still fails");
        assert_eq!(repo.resolve("b", None).unwrap().id, sb2.id);
        assert_eq!(repo.resolve("b", Some(&sb1.id[..8])).unwrap().id, sb1.id);
        // The damaged one asked for by id: an error naming it.
        let e = repo.resolve("a", Some(&sa.id[..8])).unwrap_err();
        assert!(matches!(&e, Error::Damaged { object, .. } if *object == format!("snapshots/{}", sa.id)), "{e:?}");
        assert!(matches!(repo.resolve("a", None), Err(Error::NotFound(_))));
        // check names it once, without sending the user back to check.
        let r = maint::check(&repo).unwrap();
        let p = r.problems.iter().find(|p| p.object == format!("snapshots/{}", sa.id)).unwrap();
        assert!(!p.why.contains("snapshots/") && !p.why.contains("ferry repo check"), "{}", p.why);
        // forget keeps the damaged one and removes no more than asked.
        let f = maint::forget(&repo, None, &Policy { keep_last: Some(1), ..Policy::default() }, false).unwrap();
        assert_eq!(f.removed, vec![sb1.id.clone()]);
        assert!(f.notes.iter().any(|n| n.contains(&sa.id)), "{:?}", f.notes);
        assert!(store.get(&format!("snapshots/{}", sa.id), 1 << 20).is_ok(), "the damaged manifest is kept");
        assert_eq!(repo.resolve("b", None).unwrap().id, sb2.id);
    }
}

#[test]
fn forget_with_a_damaged_manifest_never_removes_what_its_rules_keep() {
    // keep() over a list with one snapshot left out keeps every snapshot it kept before.
    use super::fake;
    let all: Vec<SnapshotInfo> = [
        "2026-11-28T10:00:00Z",
        "2026-11-28T08:00:00Z",
        "2026-11-27T10:00:00Z",
        "2026-11-20T10:00:00Z",
        "2026-10-01T10:00:00Z",
        "2026-09-01T10:00:00Z",
    ]
    .iter()
    .enumerate()
    .map(|(i, t)| fake(&format!("{i:064x}"), t))
    .collect();
    let policies = [
        Policy { keep_last: Some(2), ..Policy::default() },
        Policy { keep_daily: Some(2), ..Policy::default() },
        Policy { keep_weekly: Some(1), keep_monthly: Some(2), ..Policy::default() },
    ];
    for p in &policies {
        let full = maint::keep(&all, p);
        for skip in 0..all.len() {
            let part: Vec<SnapshotInfo> =
                all.iter().enumerate().filter(|(i, _)| *i != skip).map(|(_, s)| s.clone()).collect();
            let kept = maint::keep(&part, p);
            for (s, k) in part.iter().zip(kept) {
                let i = all.iter().position(|x| x.id == s.id).unwrap();
                assert!(k || !full[i], "{p:?} without {skip} removes {i}, which it kept");
            }
        }
    }
}

#[test]
fn an_index_built_from_objects_lists_each_copy_once() {
    let (_store, repo) = new_repo(false);
    let data = disk(1 << 20, 37);
    backup(&repo, "d", &data, None);
    let (objects, _) = repo.index_objects().unwrap();
    let twice: Vec<_> = objects.iter().chain(objects.iter()).cloned().collect();
    let index = build_index(twice);
    assert!(index.more.is_empty(), "the same copy in two index objects is one copy");
}

/// Two present copies of a chunk (a lost pack came back after a backup stored its chunks
/// again), the one gc meets first damaged: gc checks the copy it keeps, keeps the good one,
/// and both snapshots still read; with or without verify having run first.
#[test]
fn gc_keeps_the_good_copy_of_a_chunk_not_the_first() {
    for verify_first in [false, true] {
        let (store, repo) = new_repo(true);
        let data = disk(3 << 20, 39);
        let first = backup(&repo, "d", &data, None);
        let (pack, _) = where_is(&repo, &first, 7);
        let saved = store.get(&pack, 1 << 30).unwrap();
        store.delete(&pack).unwrap();
        let second = backup_in_small_packs(&repo, &data, &first);
        store.put(&pack, &saved).unwrap();
        // Bit rot in the copy in the lower-named pack: the one gc took without reading it.
        let id = chunk_id(&repo, &first, 7);
        let index = repo.load_index().unwrap();
        let locs: Vec<Location> = index.locations(&id).copied().collect();
        assert_eq!(locs.len(), 2, "{locs:?}");
        let low = locs.iter().min_by_key(|l| l.pack).unwrap();
        store.tamper(&pack_name(&low.pack), |v| v[low.offset as usize + low.stored_len as usize / 2] ^= 1);
        assert!(read_back(&repo, &first) == data && read_back(&repo, &second) == data);
        if verify_first {
            let v = maint::verify(&repo, &maint::VerifyOptions::all(2)).unwrap();
            assert!(v.problems.iter().all(|p| p.hits.is_empty()), "{:?}", v.problems);
        }
        maint::gc(&repo, None).unwrap();
        assert!(read_back(&repo, &first) == data, "the good copy was freed (verify first: {verify_first})");
        assert!(read_back(&repo, &second) == data);
        let v = maint::verify(&repo, &maint::VerifyOptions::all(2)).unwrap();
        assert!(v.problems.is_empty(), "{:?}", v.problems);
    }
}

#[test]
fn a_damaged_first_copy_is_passed_over_for_a_good_one() {
    let (store, repo) = new_repo(true);
    let data = disk(3 << 20, 38);
    let first = backup(&repo, "d", &data, None);
    let (pack, at) = where_is(&repo, &first, 7);
    let saved = store.get(&pack, 1 << 30).unwrap();
    let index_before = index_names(&store);
    store.delete(&pack).unwrap();
    let second = backup_in_small_packs(&repo, &data, &first);
    let new_index: Vec<String> = index_names(&store).into_iter().filter(|n| !index_before.contains(n)).collect();
    list_first(&store, &repo, &pack, new_index.iter().min().unwrap(), &chunk_id(&repo, &first, 7));
    // The pack comes back, with a byte of chunk 7 changed: present, but damaged.
    let mut bad = saved;
    bad[at as usize] ^= 1;
    store.put(&pack, &bad).unwrap();
    assert_eq!(copies(&repo, &second, 7)[0], pack);
    assert!(read_back(&repo, &second) == data, "the good copy was not used");
    // verify names the damaged pack, but no snapshot: each of its blobs has a good copy.
    let v = maint::verify(&repo, &maint::VerifyOptions::all(2)).unwrap();
    assert!(v.problems.iter().any(|p| p.object == pack), "{:?}", v.problems);
    assert!(v.problems.iter().all(|p| p.hits.is_empty()), "{:?}", v.problems);
}

#[test]
fn a_full_backup_that_went_on_without_its_unreadable_base_resumes() {
    let (store, repo) = new_repo(false);
    let data = disk(2 << 20, 39);
    let first = backup(&repo, "d", &data, None);
    for (p, _) in store.list("data/").unwrap() {
        store.delete(&p).unwrap();
    }
    let size = data.len() as u64;
    // Interrupted after half the disk: its checkpoint has no base.
    let w = SnapshotWriter::start(repo.clone(), opts("d", size, Some(first.clone()))).unwrap();
    w.write(&data[..1 << 20], 0, false).unwrap();
    w.checkpoint().unwrap();
    drop(w);
    let ck = repo.checkpoint("d").unwrap().expect("a checkpoint");
    assert_eq!(ck.checkpoint.base, None);
    // Resumed as the next run asks (the disk's latest snapshot as its base, still
    // unreadable): it goes on without it.
    let w = SnapshotWriter::resume(repo.clone(), opts("d", size, Some(first.clone())), &ck).unwrap();
    let done = w.done_ranges();
    assert_eq!(done, vec![(0, 1 << 20)]);
    w.write(&data[1 << 20..], 1 << 20, false).unwrap();
    let snap = w.commit(size).unwrap();
    assert_eq!(snap.manifest.parent, None);
    assert!(read_back(&repo, &snap) == data);
}
