//! gc, check, verify and hash in memory that does not grow with the repository (issue 35):
//! what they hold is counted here, not their RSS.
use super::*;
use crate::maint::{Held, RANGES_KEPT};

/// A disk of `chunks` chunks whose even chunks are random (by `seed`) and odd ones zero:
/// damage to its chunks comes as ranges of one chunk each.
fn striped(chunks: usize, seed: u64) -> Vec<u8> {
    let mut v = vec![0u8; chunks * CS];
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for c in v.chunks_mut(CS).step_by(2) {
        for b in c.iter_mut() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *b = x as u8;
        }
    }
    v
}

/// gc takes the snapshots' pages a window of manifests at a time as it lists them (each
/// manifest read once): it never holds every snapshot's page list (main held them all,
/// from the listing to the end of the mark), and it keeps every chunk they use. Six
/// windows of snapshots, so that a window that does not let the page lists go (or one of
/// every manifest) holds several times what is allowed, not barely more.
#[test]
fn gc_holds_a_window_of_page_lists_not_every_snapshots() {
    let (_, repo) = new_repo(false);
    let n = 6 * crate::repo::FETCH_THREADS;
    let mut snaps = Vec::new();
    for s in 0..n as u64 {
        let data = disk(2 * CS, 100 + s);
        snaps.push((backup(&repo, &format!("d{s}"), &data, None), data));
    }
    crate::repo::PAGE_LISTS_MOST.with(|m| m.set(0));
    maint::gc_opts(
        &repo,
        &maint::GcOptions { wait: None, repack_percent: 10, condemn_margin: std::time::Duration::ZERO },
    )
    .unwrap();
    let most = crate::repo::PAGE_LISTS_MOST.with(|m| m.get());
    assert!(most > 0 && most <= crate::repo::FETCH_THREADS, "{most} page lists held at once, of {n}");
    for (snap, data) in &snaps {
        assert_eq!(&read_back(&repo, snap), data, "{}", snap.manifest.name);
    }
    assert!(maint::check(&repo).unwrap().problems.is_empty());
}

/// A page that cannot be read stops gc, naming the snapshot that uses it, however many
/// windows of snapshots come before it; nothing is deleted.
#[test]
fn gc_names_the_snapshot_of_a_page_it_cannot_read_and_deletes_nothing() {
    let (store, repo) = new_repo(false);
    let mut last = None;
    for s in 0..12u64 {
        last = Some(backup(&repo, &format!("d{s}"), &disk(256 * K, 200 + s), None));
    }
    let last = last.unwrap();
    // The pack of the last snapshot's page, cut short (its chunks may share it).
    let index = repo.load_index().unwrap();
    let pages = repo.pages(&last).unwrap();
    let page = pages.nonzero()[0];
    let loc = index.blobs[&repo.crypto.blob_id(&page)];
    let pack = crate::repo::pack_name(&loc.pack);
    store.tamper(&pack, |v| v.truncate(loc.offset as usize));
    let before = objects(&store, "");
    let e = maint::gc_opts(
        &repo,
        &maint::GcOptions { wait: None, repack_percent: 10, condemn_margin: std::time::Duration::ZERO },
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("gc stopped before deleting anything") && e.contains(&last.id), "{e}");
    let after = objects(&store, "");
    for (name, _) in &before {
        assert!(after.iter().any(|(n, _)| n == name), "{name} was deleted");
    }
}

/// The packs that hold `snap`'s chunks and no page blob.
fn data_packs(repo: &Repository, snap: &SnapshotInfo, chunks: usize) -> Vec<String> {
    let (objects, _) = repo.index_objects().unwrap();
    let page_packs: Vec<String> = objects
        .iter()
        .flat_map(|(_, ps)| ps.iter())
        .filter(|p| p.blobs.iter().any(|b| b.kind.is_page()))
        .map(|p| crate::repo::pack_name(&p.pack))
        .collect();
    let mut packs: Vec<String> =
        (0..chunks).step_by(2).map(|c| where_is(repo, snap, c).0).filter(|p| !page_packs.contains(p)).collect();
    packs.sort();
    packs.dedup();
    packs
}

/// The ranges, and their bytes, that a report's problems give snapshot `id`: those
/// listed and those only counted.
fn ranges_of(r: &maint::Report, id: &str) -> (u64, u64, usize) {
    let (mut n, mut bytes, mut listed) = (0, 0, 0);
    for p in &r.problems {
        for h in p.hits.iter().filter(|h| h.0 == id) {
            n += 1;
            bytes += h.3;
            listed += 1;
        }
        for h in p.more_hits.iter().filter(|h| h.0 == id) {
            n += h.2;
            bytes += h.3;
        }
    }
    (n, bytes, listed)
}

/// Much damage: check and verify hold a bounded part of it (the damaged chunks traced to
/// snapshots, the ranges listed per snapshot) and count the rest, said in a note; the
/// problems are the same, so their exit status is too.
#[test]
fn check_and_verify_hold_a_bounded_part_of_much_damage_and_count_the_rest() {
    let (store, repo) = new_repo(false);
    let chunks = 64;
    let z = backup(&repo, "z", &striped(chunks, 7), None);
    let lost = data_packs(&repo, &z, chunks);
    assert!(lost.len() >= 4, "{lost:?}");
    for p in &lost {
        store.delete(p).unwrap();
    }
    let objects_of = |r: &maint::Report| r.problems.iter().map(|p| p.object.clone()).collect::<Vec<_>>();
    let full = maint::check(&repo).unwrap();
    let (n, bytes, listed) = ranges_of(&full, &z.id);
    assert!(n >= 8 && listed as u64 == n, "{n} ranges, {listed} listed: {:?}", full.problems);
    assert_eq!(bytes, n * CS as u64, "a chunk a range");
    assert!(!full.notes.iter().any(|n| n.contains("not traced")), "{:?}", full.notes);
    // Four damaged chunks held: the same problems, four ranges traced, the rest counted.
    let few = Held { chunks: 4, ranges: RANGES_KEPT };
    let r = maint::check_held(&repo, crate::spill::BUDGET, few).unwrap();
    assert_eq!(objects_of(&r), objects_of(&full));
    assert_eq!(ranges_of(&r, &z.id), (4, 4 * CS as u64, 4));
    let want =
        format!("{} more damaged or missing chunk(s) (distinct chunks, not copies) were counted but not traced", n - 4);
    assert!(r.notes.iter().any(|x| x.contains(&want)), "{want}: {:?}", r.notes);
    let v = maint::verify_held(&repo, &VerifyOptions::all(2), crate::spill::BUDGET, few).unwrap();
    assert_eq!(objects_of(&v), objects_of(&full));
    assert!(v.notes.iter().any(|x| x.contains("were counted but not traced")), "{:?}", v.notes);
    // One range listed per problem and snapshot: the others counted, with their bytes.
    let one = Held { chunks: 1 << 18, ranges: 1 };
    let r = maint::check_held(&repo, crate::spill::BUDGET, one).unwrap();
    assert_eq!(objects_of(&r), objects_of(&full));
    let (n1, bytes1, listed1) = ranges_of(&r, &z.id);
    assert_eq!((n1, bytes1), (n, bytes));
    assert!(listed1 <= r.problems.len() && listed1 < n as usize, "{listed1} listed");
    assert!(r.problems.iter().all(|p| p.hits.len() <= 1));
    assert!(r.problems.iter().any(|p| !p.more_hits.is_empty()));
}

/// A snapshot's blkhash from its pages alone is the one recorded at backup, and the one
/// its image gives from every entry; a large sparse snapshot (64 GiB) is hashed without
/// its list of entries (a million digests) being held.
#[test]
fn a_large_sparse_snapshots_blkhash_comes_from_its_pages_a_window_at_a_time() {
    let (_, repo) = new_repo(true);
    let size = 64u64 << 30;
    let w = SnapshotWriter::start(repo.clone(), opts("big", size, None)).unwrap();
    let data = disk(2 << 20, 9);
    for at in [0u64, 17 << 30, size - (2 << 20)] {
        w.write(&data, at, false).unwrap();
    }
    let snap = w.commit(size).unwrap();
    let got = crate::snapshot_blkhash(&repo, &snap).unwrap().expect("64 KiB chunks");
    assert_eq!(Some(crate::format::hex(&got)), snap.manifest.blkhash);
    let img = SnapshotImage::open(repo.clone(), &snap).unwrap();
    assert_eq!(img.blkhash(), Some(got));
    // Chunks other than 64 KiB: no blkhash from the index.
    let store = Arc::new(MemStore::new());
    let init = InitOptions { chunk_size: 4096, page_entries: 16, ..InitOptions::default() };
    let small = Arc::new(Repository::init(store, &init).unwrap());
    let s = backup(&small, "s", &disk(256 * K, 3), None);
    assert_eq!(crate::snapshot_blkhash(&small, &s).unwrap(), None);
}

/// Recorded damage whose chunks are past what check and verify hold (so not traced to the
/// snapshots that read them) stays a problem: it is never said to be unread, and verify
/// never reports no damage while snapshots read damaged chunks (review of gcmem).
#[test]
fn recorded_damage_past_what_is_held_stays_a_problem() {
    let (store, repo) = new_repo(false);
    let chunks = 64;
    let z = backup(&repo, "z", &striped(chunks, 7), None);
    let packs = data_packs(&repo, &z, chunks);
    assert!(packs.len() >= 2, "{packs:?}");
    let mut sorted = packs.clone();
    sorted.sort();
    let lowest = sorted[0].clone();
    let orig = store.get(&lowest, u64::MAX).unwrap();
    let (objects, _) = repo.index_objects().unwrap();
    for (_, ps) in &objects {
        for p in ps {
            let name = crate::repo::pack_name(&p.pack);
            if !packs.contains(&name) {
                continue;
            }
            let blobs: Vec<(u32, u32)> = p.blobs.iter().map(|b| (b.offset, b.stored_len)).collect();
            store.tamper(&name, |v| {
                for (o, l) in &blobs {
                    v[(*o + *l / 2) as usize] ^= 0x55;
                }
            });
        }
    }
    // verify records every pack damaged.
    let v = maint::verify(&repo, &VerifyOptions::all(2)).unwrap();
    assert_eq!(v.problems.len(), packs.len(), "{v:?}");
    let full = maint::check(&repo).unwrap();
    assert_eq!(full.problems.len(), packs.len(), "{full:?}");
    let few = Held { chunks: 1, ranges: RANGES_KEPT };
    let r = maint::check_held(&repo, crate::spill::BUDGET, few).unwrap();
    assert_eq!(r.problems.len(), full.problems.len(), "recorded problems said unread past the cap: {:?}", r.notes);
    assert!(!r.notes.iter().any(|n| n.contains("no snapshot reads it")), "{:?}", r.notes);
    let vv = maint::verify_held(&repo, &VerifyOptions::all(2), crate::spill::BUDGET, few).unwrap();
    assert_eq!(vv.problems.len(), packs.len(), "{:?}", vv.notes);
    // The lowest pack mended: verify clears its record; the others, still damaged and read
    // by z, stay problems (they vanished: "no damage found" while z reads damaged chunks).
    let o2 = orig.clone();
    store.tamper(&lowest, move |v| *v = o2.clone());
    let four = Held { chunks: 4, ranges: RANGES_KEPT };
    let vf = maint::verify_held(&repo, &VerifyOptions::all(2), crate::spill::BUDGET, four).unwrap();
    assert_eq!(vf.problems.len(), packs.len() - 1, "{:?}", vf.notes);
}
