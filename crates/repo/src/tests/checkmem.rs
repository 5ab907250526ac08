//! check and verify in bounded memory (issue 35): the locations, the chunks the pages use
//! and their hints are sorted on disk and joined; with a budget of a few records (many
//! runs merged) they report exactly what they report with everything in memory.
use super::*;
use crate::locations::USE;

/// A copy of every object of `store`, opened.
fn copy(store: &MemStore) -> (Arc<MemStore>, Repository) {
    let to = Arc::new(MemStore::new());
    for (name, _) in store.list("").unwrap() {
        to.put(&name, &store.get(&name, u64::MAX).unwrap()).unwrap();
    }
    let repo = Repository::open(to.clone(), &|| Ok(crate::Passphrase::new(b"secret words".to_vec()))).unwrap();
    (to, repo)
}

/// A report as text, less the name of the damage record verify writes (new each time).
fn text(r: &maint::Report) -> String {
    let notes: Vec<&String> = r.notes.iter().filter(|n| !n.starts_with("the damage is recorded in")).collect();
    format!(
        "{} {} {} {} {} {} {:?} {notes:?}",
        r.snapshots, r.packs, r.blobs_checked, r.bytes_read, r.packs_read, r.bytes_present, r.problems
    )
}

/// Runs `f` with a budget of 300 bytes (a few records a run) and of 64 MiB (no run
/// written), each on its own copy of `store`; both must say the same.
fn same_with_any_budget(store: &MemStore, f: impl Fn(&Repository, usize) -> String) -> String {
    let (_, small_repo) = copy(store);
    let small = f(&small_repo, 300);
    let (_, w) = maint::check_walk_in(&small_repo, 300).unwrap();
    assert!(w.spilled.runs() > 10, "the sorters spilled: {:?}", w.spilled);
    let (_, big_repo) = copy(store);
    let big = f(&big_repo, 64 << 20);
    assert_eq!(small, big);
    small
}

#[test]
fn check_and_verify_spilled_report_what_they_report_in_memory() {
    // Two disks of the same data, each with its own copies; gc keeps one copy of each
    // chunk, so that the other disk's hints go stale. Then a second generation of x.
    let data = disk(2 << 20, 21);
    let (store, repo) = new_repo(true);
    let len = data.len() as u64;
    let wx = SnapshotWriter::start(repo.clone(), opts("x", len, None)).unwrap();
    let wy = SnapshotWriter::start(repo.clone(), opts("y", len, None)).unwrap();
    write_all(&wx, &data);
    write_all(&wy, &data);
    let x1 = wx.commit(len).unwrap();
    let _y1 = wy.commit(len).unwrap();
    maint::gc_opts(
        &repo,
        &maint::GcOptions { wait: None, repack_percent: 10, condemn_margin: std::time::Duration::ZERO },
    )
    .unwrap();
    let mut d2 = data.clone();
    for c in [1usize, 9, 20] {
        d2[c * CS..c * CS + 8].copy_from_slice(&(77 + c as u64).to_le_bytes());
    }
    let x2 = backup(&repo, "x", &d2, Some(x1.clone()));
    // A disk of its own, whose index object is deleted below.
    let before = objects(&store, "index/");
    backup(&repo, "z", &disk(1 << 20, 33), None);
    let z_index: Vec<String> =
        objects(&store, "index/").into_iter().filter(|o| !before.contains(o)).map(|(n, _)| n).collect();
    assert_eq!(z_index.len(), 1, "{z_index:?}");
    let clean = same_with_any_budget(&store, |r, b| text(&maint::check_in(r, b).unwrap()));
    assert!(clean.contains("hint"), "stale hints are noted: {clean}");
    // Damage of each kind: a pack deleted, a pack cut short, a byte flipped in a chunk
    // (verify finds it), an index object deleted (chunks in no index object).
    let (deleted, _) = where_is(&repo, &x2, 1);
    let (short, _) = where_is(&repo, &x1, 28);
    let (flipped, at) = where_is(&repo, &x1, 3);
    assert!(deleted != short && short != flipped && flipped != deleted, "three packs");
    store.delete(&deleted).unwrap();
    store.tamper(&short, |v| v.truncate(v.len() / 2));
    store.tamper(&flipped, |v| v[at as usize] ^= 1);
    store.delete(&z_index[0]).unwrap();
    let checked = same_with_any_budget(&store, |r, b| text(&maint::check_in(r, b).unwrap()));
    for what in ["missing from the store", "shorter than its blobs", "in no index object"] {
        assert!(checked.contains(what), "{what}: {checked}");
    }
    let verified = same_with_any_budget(&store, |r, b| text(&maint::verify_in(r, &VerifyOptions::all(2), b).unwrap()));
    assert!(verified.contains("damaged (first"), "{verified}");
    // Once verify recorded the damage: check and verify read the records.
    maint::verify(&repo, &VerifyOptions::all(2)).unwrap();
    let recorded = same_with_any_budget(&store, |r, b| {
        let c = text(&maint::check_in(r, b).unwrap());
        let v = text(&maint::verify_in(r, &VerifyOptions::all(2), b).unwrap());
        format!("{c}\n{v}")
    });
    assert!(recorded.contains("recorded damaged"), "{recorded}");
}

/// Many snapshots of one disk, each a chunk changed: every snapshot's page is distinct,
/// and each lists the chunks the others share. The sorter of the chunks the pages use
/// writes one record per chunk a run, not one per entry of each page (issue 35: disk that
/// follows the distinct chunks, not the snapshots).
#[test]
fn the_chunks_the_pages_use_are_written_once_per_chunk_however_many_pages_list_them() {
    let (_, repo) = new_repo(false);
    let mut data = disk(2 << 20, 5);
    let mut prev = None;
    for s in 0..60u64 {
        let c = (s as usize * 7) % 32;
        data[c * CS..c * CS + 8].copy_from_slice(&(1000 + s).to_le_bytes());
        prev = Some(backup(&repo, "x", &data, prev));
    }
    // 200 records held, more than the distinct chunks: a run per 200 page entries.
    let budget = 200 * USE;
    let (r, w) = maint::check_walk_in(&repo, budget).unwrap();
    assert!(r.problems.is_empty(), "{:?}", r.problems);
    let distinct = r.blobs_checked;
    assert!(distinct < 200, "{distinct} chunks");
    let uses = w.spilled.uses;
    // 60 new pages or more, of 16 entries or more: 4 runs or more.
    assert!(uses.runs >= 4, "{uses:?}");
    assert!(uses.bytes <= uses.runs * distinct * USE as u64, "{uses:?}, {distinct} distinct chunks");
}
