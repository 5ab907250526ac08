//! check and verify at scale (issue 35): the walk reads each distinct page once and keeps
//! no snapshot's list of entries, and its findings stay exact: the chunks it counts, the
//! damage it finds, and the snapshots and byte ranges it attributes the damage to.
use super::{backup, new_repo, CS};
use crate::format::{Digest, ZERO};
use crate::maint::{self, VerifyOptions};
use crate::repo::pack_name;
use crate::store::Store;
use crate::{Repository, SnapshotInfo};
use std::collections::{BTreeSet, HashSet};

/// A disk of `chunks` chunks, chunk i holding only the number `first + i` (a few bytes
/// that compress to a tiny blob: many blobs a pack), chunks in `zero` all zero.
fn numbered(chunks: usize, first: u64, zero: std::ops::Range<usize>) -> Vec<u8> {
    let mut v = vec![0u8; chunks * CS];
    for (i, c) in v.chunks_mut(CS).enumerate() {
        if !zero.contains(&i) {
            c[..8].copy_from_slice(&(first + i as u64).to_le_bytes());
        }
    }
    v
}

/// The distinct non-zero pages of `snaps`.
fn distinct_pages(repo: &Repository, snaps: &[&SnapshotInfo]) -> HashSet<Digest> {
    snaps.iter().flat_map(|s| repo.pages(s).unwrap().nonzero().to_vec()).collect()
}

/// The chunk numbers of `snap` that read a blob (chunk or page) stored in `pack`, worked
/// out from the whole index and the snapshot's whole list of entries.
fn chunks_in_pack(repo: &Repository, snap: &SnapshotInfo, pack: &str) -> BTreeSet<u64> {
    let index = repo.load_index().unwrap();
    let entries = repo.entries(&index, snap).unwrap();
    let pe = snap.manifest.page_entries as usize;
    let pages = repo.pages(snap).unwrap().to_vec();
    let in_pack =
        |d: &Digest| *d != ZERO && index.locations(&repo.crypto.blob_id(d)).all(|l| pack_name(&l.pack) == pack);
    let mut out = BTreeSet::new();
    for (i, e) in entries.iter().enumerate() {
        let page = pages[i / pe];
        if in_pack(e) || in_pack(&page) {
            out.insert(i as u64);
        }
    }
    out
}

/// The chunk numbers of `snap` that a problem's hits name.
fn hit_chunks(p: &maint::Problem, snap: &SnapshotInfo) -> BTreeSet<u64> {
    let cs = CS as u64;
    p.hits.iter().filter(|h| h.0 == snap.id).flat_map(|h| h.2 / cs..(h.2 + h.3).div_ceil(cs)).collect()
}

#[test]
fn check_reads_each_distinct_page_once_and_finds_what_it_found() {
    let (store, repo) = new_repo(false);
    // Two generations of disk d (zero pages among them; the second changes a few
    // chunks), and disk e, whose first page is d's and whose third is d's first again (a
    // page at another position).
    let d1 = numbered(320, 1, 100..148);
    let s1 = backup(&repo, "d", &d1, None);
    let packs_before: HashSet<String> = store.list("data/").unwrap().into_iter().map(|(n, _)| n).collect();
    let mut d2 = d1.clone();
    for c in [5usize, 40, 41, 200] {
        d2[c * CS..c * CS + 8].copy_from_slice(&(900_000 + c as u64).to_le_bytes());
    }
    let s2 = backup(&repo, "d", &d2, Some(s1.clone()));
    let new_pack = store.list("data/").unwrap().into_iter().map(|(n, _)| n).find(|n| !packs_before.contains(n));
    let new_pack = new_pack.expect("the second backup stored its changes in a pack of their own");
    let mut e = numbered(64, 5_000_000, 0..0);
    e[..16 * CS].copy_from_slice(&d1[..16 * CS]);
    e[32 * CS..48 * CS].copy_from_slice(&d1[..16 * CS]);
    let s3 = backup(&repo, "e", &e, None);
    let snaps = [&s1, &s2, &s3];

    // A whole repository: no problem, each distinct page read once, every chunk counted.
    let (r, w) = maint::check_walk(&repo).unwrap();
    assert!(r.problems.is_empty(), "{:?}", r.problems);
    assert_eq!(w.page_reads, distinct_pages(&repo, &snaps).len() as u64);
    let index = repo.load_index().unwrap();
    let chunks: HashSet<Digest> = snaps
        .iter()
        .flat_map(|s| repo.entries(&index, s).unwrap())
        .filter(|d| *d != ZERO)
        .map(|d| repo.crypto.blob_id(&d))
        .collect();
    assert_eq!(r.blobs_checked, chunks.len() as u64);
    let mut per_pack: std::collections::HashMap<Digest, usize> = std::collections::HashMap::new();
    for l in index.blobs.values() {
        *per_pack.entry(l.pack).or_default() += 1;
    }
    let one_pack = per_pack.into_values().max().unwrap();
    assert!(one_pack > 200, "many blobs a pack: {one_pack}");
    assert!(maint::verify(&repo, &VerifyOptions::all(2)).unwrap().problems.is_empty());

    // The second generation's own pack lost: check names it, and exactly the chunks of
    // the second generation that read a chunk or a page in it (none of the others).
    let want = chunks_in_pack(&repo, &s2, &new_pack);
    assert!(want.contains(&5) && want.contains(&200), "{want:?}");
    store.delete(&new_pack).unwrap();
    let r = maint::check(&repo).unwrap();
    assert_eq!(r.problems.len(), 1, "{:?}", r.problems);
    let p = &r.problems[0];
    assert_eq!(p.object, new_pack);
    assert_eq!(hit_chunks(p, &s2), want);
    assert!(p.hits.iter().all(|h| h.0 == s2.id), "{:?}", p.hits);
}

#[test]
fn verify_attributes_a_damaged_shared_chunk_to_every_range_that_reads_it() {
    let (store, repo) = new_repo(true);
    let d1 = numbered(96, 1, 40..60);
    let s1 = backup(&repo, "d", &d1, None);
    let mut d2 = d1.clone();
    d2[70 * CS..70 * CS + 8].copy_from_slice(&7u64.to_le_bytes());
    let s2 = backup(&repo, "d", &d2, Some(s1.clone()));
    let mut e = numbered(32, 1, 0..0);
    e[..CS].copy_from_slice(&d1[3 * CS..4 * CS]);
    let s3 = backup(&repo, "e", &e, None);
    // Chunk 3 of d (number 4): chunk 3 of both generations, chunk 3 of e and chunk 0 of e.
    let index = repo.load_index().unwrap();
    let digest = repo.entries(&index, &s1).unwrap()[3];
    let loc = index.blobs[&repo.crypto.blob_id(&digest)];
    store.tamper(&pack_name(&loc.pack), |v| v[loc.offset as usize + loc.stored_len as usize / 2] ^= 1);
    let r = maint::verify(&repo, &VerifyOptions::all(2)).unwrap();
    assert_eq!(r.problems.len(), 1, "{:?}", r.problems);
    let p = &r.problems[0];
    assert_eq!(hit_chunks(p, &s1), BTreeSet::from([3]));
    assert_eq!(hit_chunks(p, &s2), BTreeSet::from([3]));
    assert_eq!(hit_chunks(p, &s3), BTreeSet::from([0, 3]));
    assert_eq!(p.hits.len(), 4, "{:?}", p.hits);
}

/// Problems are said in the order of a walk of one snapshot after another, though the walk
/// goes position by position: a damaged page at position 3 of the first snapshot comes
/// before one at position 0 of the second, and each names its own snapshot's range.
#[test]
fn problems_come_in_snapshot_order_with_their_own_ranges() {
    let (store, repo) = new_repo(false);
    let sd = backup(&repo, "d", &numbered(80, 1, 0..0), None);
    let se = backup(&repo, "e", &numbered(80, 1_000, 0..0), None);
    let index = repo.load_index().unwrap();
    let damaged_pack = |s: &SnapshotInfo, i: usize| {
        let page = repo.pages(s).unwrap().to_vec()[i];
        let loc = index.blobs[&repo.crypto.blob_id(&page)];
        store.tamper(&pack_name(&loc.pack), |v| v[loc.offset as usize + loc.stored_len as usize / 2] ^= 1);
        pack_name(&loc.pack)
    };
    let (pd, pe) = (damaged_pack(&sd, 3), damaged_pack(&se, 0));
    assert_ne!(pd, pe, "each disk's pages are in a pack of its own");
    let r = maint::check(&repo).unwrap();
    let objects: Vec<&str> = r.problems.iter().map(|p| p.object.as_str()).collect();
    assert_eq!(objects, [pd.as_str(), pe.as_str()], "{:?}", r.problems);
    assert_eq!(hit_chunks(&r.problems[0], &sd), (48..64).collect());
    assert!(hit_chunks(&r.problems[0], &se).is_empty());
    assert_eq!(hit_chunks(&r.problems[1], &se), (0..16).collect());
    assert!(hit_chunks(&r.problems[1], &sd).is_empty());
}
