//! The engine end to end over a [`MemStore`]: backups through the writer as the copy
//! engine drives it, reads back, incremental sharing, encryption, blkhash, retention, gc,
//! damage, locks and crashes.
use crate::format::{KdfCost, Lock, LockKind, Manifest, ZERO};
use crate::maint::{self, Policy, VerifyOptions};
use crate::store::{MemStore, Store};
use crate::{lock, BackupOptions, Error, InitOptions, Repository, SnapshotImage, SnapshotInfo, SnapshotWriter};
use ferry_backend::{Backend, ZeroMode, HOLE};
use std::sync::{Arc, Mutex};

mod checkmem;
mod clock;
mod condemn_split;
mod copy;
mod damagecap;
mod gcmem;
mod gcwalk;
mod heal;
mod hints;
mod indexkeep;
mod keys;
mod migrate;
mod recover;
mod resume;
mod retention;
mod reviewfix;
mod scale;
mod speed;
mod writermem;

const K: usize = 1024;
const CS: usize = 64 * K;

/// The options of [`new_repo`]: small pages, and a cheap key where `encrypt`.
fn init_opts(encrypt: bool) -> InitOptions {
    InitOptions {
        chunk_size: CS as u32,
        page_entries: 16,
        encrypt: encrypt
            .then(|| (crate::Passphrase::new(b"secret words".to_vec()), KdfCost { m_kib: 8192, t: 1, p: 1 })),
        ..InitOptions::default()
    }
}

pub(crate) fn new_repo(encrypt: bool) -> (Arc<MemStore>, Arc<Repository>) {
    let store = Arc::new(MemStore::new());
    let repo = Repository::init(store.clone(), &init_opts(encrypt)).unwrap();
    (store, Arc::new(repo))
}

/// A disk image: compressible text, random chunks and zero chunks, with a short last chunk.
fn disk(len: usize, seed: u64) -> Vec<u8> {
    let mut v = vec![0u8; len];
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for (i, c) in v.chunks_mut(CS).enumerate() {
        match i % 5 {
            0 => {} // zero
            1 | 2 => {
                for b in c.iter_mut() {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    *b = x as u8;
                }
            }
            _ => {
                let text = format!("chunk {i} of disk {seed}: the quick brown fox. ");
                for (j, b) in c.iter_mut().enumerate() {
                    *b = text.as_bytes()[j % text.len()];
                }
            }
        }
    }
    v
}

fn opts(name: &str, size: u64, base: Option<SnapshotInfo>) -> BackupOptions {
    BackupOptions { base, pack_size: 256 * K, ..BackupOptions::new(name, size) }
}

/// Writes `data` as the copy engine does: 1 MiB requests from three threads, zero
/// ranges through `zero`, and the tail in 4 KiB-aligned pieces.
fn write_all(w: &Arc<SnapshotWriter>, data: &[u8]) {
    let mib = 1 << 20;
    let aligned = data.len() / mib * mib;
    std::thread::scope(|s| {
        for t in 0..3 {
            let w = w.clone();
            s.spawn(move || {
                for (i, piece) in data[..aligned].chunks(mib).enumerate() {
                    if i % 3 != t {
                        continue;
                    }
                    let off = (i * mib) as u64;
                    if ferry_hash::is_zero(piece) {
                        w.zero(off, piece.len() as u64, ZeroMode::default(), false).unwrap();
                    } else {
                        w.write(piece, off, false).unwrap();
                    }
                }
            });
        }
    });
    // The tail: pieces of 12 KiB, from the end backwards (parts of chunks meet later).
    let tail: Vec<(usize, &[u8])> =
        data[aligned..].chunks(12 * K).enumerate().map(|(i, p)| (aligned + i * 12 * K, p)).collect();
    for (off, p) in tail.into_iter().rev() {
        w.write(p, off as u64, false).unwrap();
    }
}

fn backup(repo: &Arc<Repository>, name: &str, data: &[u8], base: Option<SnapshotInfo>) -> SnapshotInfo {
    let w = SnapshotWriter::start(repo.clone(), opts(name, data.len() as u64, base)).unwrap();
    write_all(&w, data);
    w.commit(data.len() as u64).unwrap()
}

fn read_back(repo: &Arc<Repository>, snap: &SnapshotInfo) -> Vec<u8> {
    let img = SnapshotImage::open(repo.clone(), snap).unwrap();
    let mut out = vec![0u8; img.size() as usize];
    // Odd sizes and offsets: parts of chunks, several chunks.
    let mut pos = 0;
    let mut step = 3000;
    while pos < out.len() {
        let n = step.min(out.len() - pos);
        img.read(&mut out[pos..pos + n], pos as u64).unwrap();
        pos += n;
        step = if step > 300_000 { 3000 } else { step * 3 };
    }
    out
}

fn objects(store: &MemStore, prefix: &str) -> Vec<(String, u64)> {
    store.list(prefix).unwrap()
}

#[test]
fn full_backup_reads_back_and_stores_no_zero_chunk() {
    let (store, repo) = new_repo(false);
    let data = disk(5 * (1 << 20) + 3 * CS + 5000, 1);
    let snap = backup(&repo, "vm1-sda", &data, None);
    assert!(read_back(&repo, &snap) == data, "the snapshot does not read back as written");
    let chunks = data.len().div_ceil(CS);
    let zero = data.chunks(CS).filter(|c| ferry_hash::is_zero(c)).count();
    let s = &snap.manifest.stats;
    assert_eq!(s.written_chunks, chunks as u64);
    assert_eq!(s.zero_chunks, zero as u64);
    assert_eq!(s.new_chunks, (chunks - zero) as u64);
    // Exactly the non-zero chunks and the pages are stored.
    let index = repo.load_index().unwrap();
    let pages = repo.pages(&snap).unwrap().nonzero().len();
    assert_eq!(index.blobs.len(), chunks - zero + pages);
    assert_eq!(objects(&store, "index/").len(), 1, "one index object per backup");
    assert!(objects(&store, "data/").len() > 1, "packs are closed at the pack size");
    let img = SnapshotImage::open(repo.clone(), &snap).unwrap();
    let mut ex = Vec::new();
    img.extents(0, CS as u64 * 3, 100, &mut ex).unwrap();
    assert_eq!(ex[0].flags, HOLE, "a zero chunk is a hole: {ex:?}");
    assert_eq!(ex[0].length, CS as u64);
    assert_eq!(img.describe(), format!("memory store::vm1-sda@{}", &snap.id[..8]));
}

#[test]
fn incremental_shares_pages_and_stores_only_new_chunks() {
    let (_store, repo) = new_repo(false);
    let day1 = disk(4 << 20, 2);
    let s1 = backup(&repo, "d", &day1, None);
    let before = repo.load_index().unwrap().blobs.len();
    // Day 2: two chunks changed in page 1 (chunks 16..32), a 4 KiB write in chunk 40
    // (completed from the base at commit), a zeroed chunk in page 3.
    let mut day2 = day1.clone();
    let w = SnapshotWriter::start(repo.clone(), opts("d", day2.len() as u64, Some(s1.clone()))).unwrap();
    let new: Vec<u8> = (0..2 * CS).map(|i| (i * 7 % 251) as u8).collect();
    day2[17 * CS..19 * CS].copy_from_slice(&new);
    w.write(&new, 17 * CS as u64, false).unwrap();
    day2[40 * CS + 8192..40 * CS + 12288].fill(0xEE);
    w.write(&[0xEE; 4096], (40 * CS + 8192) as u64, false).unwrap();
    day2[51 * CS..52 * CS].fill(0);
    w.zero(51 * CS as u64, CS as u64, ZeroMode::default(), false).unwrap();
    let s2 = w.commit(3 * CS as u64).unwrap();
    assert_eq!(s2.manifest.parent.as_deref(), Some(s1.id.as_str()));
    assert!(read_back(&repo, &s2) == day2, "the incremental snapshot does not read back");
    assert!(read_back(&repo, &s1) == day1, "the base changed");
    let (p1, p2) = (repo.pages(&s1).unwrap().to_vec(), repo.pages(&s2).unwrap().to_vec());
    let changed: Vec<usize> = (0..p1.len()).filter(|&i| p1[i] != p2[i]).collect();
    assert_eq!(changed, vec![1, 2, 3], "only the pages with changes are new");
    assert_eq!(s2.manifest.stats.new_chunks, 3, "two written chunks and the completed one");
    let after = repo.load_index().unwrap().blobs.len();
    assert_eq!(after - before, 3 + 3, "three chunks and three pages");
    // The latest of the disk is the new one, even within the same second.
    assert_eq!(repo.resolve("d", None).unwrap().id, s2.id);
    assert_eq!(repo.resolve("d", Some(&s1.id[..6])).unwrap().id, s1.id);
    assert!(matches!(repo.resolve("e", None), Err(Error::NotFound(_))));
    assert!(matches!(repo.resolve("d", Some("zz")), Err(Error::Invalid(_))));
}

#[test]
fn unaligned_pieces_from_many_threads_make_whole_chunks() {
    let (_store, repo) = new_repo(true);
    let day1 = disk((3 << 20) + 7 * 4096, 20);
    let s1 = backup(&repo, "d", &day1, None);
    // Day 2 rewrites everything in 4 KiB-aligned pieces of 4 KiB to 200 KiB, each chunk
    // in several pieces from several threads, in no order; zero pieces through zero().
    let mut day2 = disk(day1.len(), 21);
    day2[100_000 & !4095..300_000 & !4095].fill(0);
    let mut pieces = Vec::new();
    let mut x = 7u64;
    let mut pos = 0;
    while pos < day2.len() {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let len = (((x >> 33) % 50 + 1) as usize * 4096).min(day2.len() - pos);
        pieces.push((pos, len));
        pos += len;
    }
    for i in (1..pieces.len()).rev() {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        pieces.swap(i, (x >> 33) as usize % (i + 1));
    }
    let w = SnapshotWriter::start(repo.clone(), opts("d", day2.len() as u64, Some(s1))).unwrap();
    std::thread::scope(|s| {
        for t in 0..4 {
            let (w, pieces, day2) = (w.clone(), &pieces, &day2);
            s.spawn(move || {
                for (off, len) in pieces.iter().skip(t).step_by(4) {
                    let p = &day2[*off..off + len];
                    if ferry_hash::is_zero(p) {
                        w.zero(*off as u64, *len as u64, ZeroMode::default(), false).unwrap();
                    } else {
                        w.write(p, *off as u64, false).unwrap();
                    }
                }
            });
        }
    });
    let s2 = w.commit(day2.len() as u64).unwrap();
    assert!(read_back(&repo, &s2) == day2, "pieces did not make the disk");
    assert_eq!(s2.manifest.stats.written_chunks, day2.len().div_ceil(CS) as u64, "each chunk made once");
}

#[test]
fn size_change_drops_or_adds_zero_chunks() {
    let (_store, repo) = new_repo(false);
    let day1 = disk(2 << 20, 3);
    let s1 = backup(&repo, "d", &day1, None);
    // Larger: the base's content, then zeroes.
    let w = SnapshotWriter::start(repo.clone(), opts("d", (3 << 20) + 100, Some(s1.clone()))).unwrap();
    let s2 = w.commit(0).unwrap();
    let mut want = day1.clone();
    want.resize((3 << 20) + 100, 0);
    assert!(read_back(&repo, &s2) == want);
    // Smaller.
    let w = SnapshotWriter::start(repo.clone(), opts("d", (1 << 20) + 10, Some(s2))).unwrap();
    let s3 = w.commit(0).unwrap();
    assert!(read_back(&repo, &s3) == day1[..(1 << 20) + 10]);
}

#[test]
fn encrypted_round_trip_and_wrong_passphrase() {
    let (store, repo) = new_repo(true);
    let data = disk(2 << 20, 4);
    let snap = backup(&repo, "secret-disk", &data, None);
    let wrong = Repository::open(store.clone(), &|| Ok(crate::Passphrase::new(b"not it".to_vec())));
    match wrong {
        Err(Error::Passphrase(m)) => assert!(m.contains("--password-file"), "{m}"),
        Err(e) => panic!("wrong passphrase gave {e}"),
        Ok(_) => panic!("a wrong passphrase opened the repository"),
    }
    let repo2 =
        Arc::new(Repository::open(store.clone(), &|| Ok(crate::Passphrase::new(b"secret words".to_vec()))).unwrap());
    let snap2 = repo2.resolve("secret-disk", None).unwrap();
    assert_eq!(snap2.id, snap.id);
    assert!(read_back(&repo2, &snap2) == data);
    // Nothing readable in the store: no disk name, no text.
    for (name, _) in objects(&store, "") {
        let bytes = store.get(&name, u64::MAX).unwrap();
        let hay = String::from_utf8_lossy(&bytes);
        assert!(!hay.contains("secret-disk") && !hay.contains("quick brown fox"), "{name} leaks plain text");
    }
    let r = maint::verify(&repo2, &VerifyOptions::all(2)).unwrap();
    assert!(r.problems.is_empty(), "{:?}", r.problems);
    // An unencrypted repository never asks for a passphrase.
    let (plain_store, _) = new_repo(false);
    Repository::open(plain_store, &|| panic!("asked for a passphrase")).unwrap();
}

#[test]
fn blkhash_is_blkhash_of_the_bytes() {
    let (_store, repo) = new_repo(false);
    let data = disk(3 * (1 << 20) + 12345, 5);
    let snap = backup(&repo, "d", &data, None);
    let h = ferry_hash::BlockHasher::new(ferry_hash::Algorithm::Sha256, CS);
    h.add(0, &data);
    let want = ferry_hash::hex(&h.finish(data.len() as u64).unwrap());
    assert_eq!(snap.manifest.blkhash.as_deref(), Some(want.as_str()));
    let img = SnapshotImage::open(repo.clone(), &snap).unwrap();
    assert_eq!(img.blkhash().map(|d| ferry_hash::hex(&d)), Some(want));
}

fn fake(id: &str, time: &str) -> SnapshotInfo {
    SnapshotInfo::listed(
        id.into(),
        Manifest {
            version: 1,
            name: "d".into(),
            time: time.into(),
            size: 0,
            chunk_size: CS as u32,
            page_entries: 16,
            page_packs: crate::format::PackCount(0),
            pages: crate::format::PageCount(0, Default::default()),
            parent: None,
            migrated_from: None,
            source: String::new(),
            changes: crate::format::Changes::Full,
            blkhash: None,
            stats: Default::default(),
            host: String::new(),
            ferry: String::new(),
            copied_from: None,
            tags: Vec::new(),
            note: String::new(),
        },
    )
}

#[test]
fn keep_rules() {
    // Newest first: two a day for 40 days from 2026-03-10 back.
    let mut snaps = Vec::new();
    let start = "2026-03-10T20:00:00Z".parse::<jiff::Timestamp>().unwrap();
    for i in 0..80 {
        let t = start - jiff::SignedDuration::from_hours(12 * i);
        snaps.push(fake(&format!("{i:04}"), &t.strftime("%Y-%m-%dT%H:%M:%SZ").to_string()));
    }
    let kept = |p: Policy| -> Vec<usize> {
        maint::keep(&snaps, &p).iter().enumerate().filter(|(_, k)| **k).map(|(i, _)| i).collect()
    };
    assert_eq!(kept(Policy::default()).len(), 80, "no rule keeps everything");
    assert_eq!(kept(Policy { keep_last: Some(3), ..Policy::default() }), vec![0, 1, 2]);
    // The newest of each of the 3 latest days: 20:00 of each day.
    assert_eq!(kept(Policy { keep_daily: Some(3), ..Policy::default() }), vec![0, 2, 4]);
    // 2026-03-10 is a Tuesday: its ISO week began on 03-09; the week before on 03-02.
    assert_eq!(kept(Policy { keep_weekly: Some(2), ..Policy::default() }), vec![0, 4]);
    // March (days 10..1: 20 snapshots, i=0..19), February's newest is 02-28 20:00: i=20.
    assert_eq!(kept(Policy { keep_monthly: Some(2), ..Policy::default() }), vec![0, 20]);
    assert_eq!(
        kept(Policy { keep_last: Some(1), keep_monthly: Some(2), keep_daily: Some(2), ..Policy::default() }),
        vec![0, 2, 20]
    );
}

#[test]
fn forget_and_gc_free_exactly_the_dead_data() {
    let (store, repo) = new_repo(false);
    let a1 = disk(3 << 20, 10);
    let s1 = backup(&repo, "a", &a1, None);
    let mut a2 = a1.clone();
    a2[CS..4 * CS].fill(0x42);
    let s2 = backup(&repo, "a", &a2, Some(s1.clone()));
    let b1 = disk(2 << 20, 11);
    let sb = backup(&repo, "b", &b1, None);
    let before = maint::stats(&repo).unwrap();
    let r = maint::forget(&repo, Some("a"), &Policy { keep_last: Some(1), ..Policy::default() }, true).unwrap();
    assert_eq!(r.removed, vec![s1.id.clone()]);
    assert_eq!(objects(&store, "snapshots/").len(), 3, "a dry run removes nothing");
    let r = maint::forget(&repo, None, &Policy { keep_last: Some(1), ..Policy::default() }, false).unwrap();
    assert_eq!(r.removed, vec![s1.id.clone()]);
    let mut kept = r.kept.clone();
    kept.sort();
    let mut want = vec![s2.id.clone(), sb.id.clone()];
    want.sort();
    assert_eq!(kept, want);
    // A reader that loaded the index before gc moved its blobs still reads.
    let img = SnapshotImage::open(repo.clone(), &s2).unwrap();
    let g = maint::gc(&repo, None).unwrap();
    assert!(g.bytes_after < g.bytes_before, "{g:?}");
    assert!(g.packs_repacked > 0, "{g:?}");
    let mut got = vec![0u8; a2.len()];
    img.read(&mut got, 0).unwrap();
    assert!(got == a2, "a reader opened before gc reads wrong data");
    assert!(g.blobs_freed >= 1, "{g:?}");
    // b's, kept as it was (its packs stay whole); one for the packs of a that stay (a's
    // two objects rewritten), one for the new packs (stored before the record).
    assert_eq!(objects(&store, "index/").len(), 3, "gc leaves three index objects: {g:?}");
    assert_eq!((g.index_kept, g.index_rewritten), (1, 2));
    // What is left is exactly what the kept snapshots use.
    let after = maint::stats(&repo).unwrap();
    assert_eq!(after.snapshots, 2);
    assert!(after.unique_stored < before.unique_stored);
    let index = repo.load_index().unwrap();
    let live = live_blobs(&repo, &index, &[&s2, &sb]);
    let indexed: std::collections::HashSet<_> = index.blobs.keys().copied().collect();
    assert!(indexed.is_superset(&live), "gc lost a live blob");
    // Unused blobs stay only in packs of which less than the threshold (10%) is unused
    // (which chunks share a pack depends on the writer's threads).
    let mut per_pack: std::collections::HashMap<_, (u64, u64)> = std::collections::HashMap::new();
    for (id, loc) in &index.blobs {
        let e = per_pack.entry(loc.pack).or_default();
        e.1 += loc.stored_len as u64;
        if !live.contains(id) {
            e.0 += loc.stored_len as u64;
        }
    }
    for (pack, (dead, all)) in &per_pack {
        assert!(dead * 100 < all * 10, "pack {} is {dead} of {all} bytes unused after gc", crate::format::hex(pack));
    }
    // With no threshold, gc leaves exactly the live blobs.
    maint::gc_with(&repo, None, 0).unwrap();
    let index = repo.load_index().unwrap();
    let indexed: std::collections::HashSet<_> = index.blobs.keys().copied().collect();
    assert_eq!(indexed, live, "the index holds exactly the live blobs");
    assert!(read_back(&repo, &s2) == a2);
    assert!(read_back(&repo, &sb) == b1);
    let r = maint::verify(&repo, &VerifyOptions::all(2)).unwrap();
    // No note of the index (gc moved chunks of s2's pages: their hints went stale, a note).
    assert!(
        r.problems.is_empty()
            && r.notes.iter().all(|n| !n.contains("index") || only_stale_hints(std::slice::from_ref(n))),
        "{r:?}"
    );
    // A second gc has nothing to do.
    let g2 = maint::gc(&repo, None).unwrap();
    assert_eq!(g2.packs_deleted, 0, "{g2:?}");
}

/// gc's live set and its list of copies go through the spill sorter (a few records a run
/// in these tests): a gc whose sets are far over the budget keeps exactly what is used.
#[test]
fn gc_spills_its_sets_and_keeps_exactly_the_live_blobs() {
    let (_store, repo) = new_repo(false);
    let a1 = disk(4 << 20, 21);
    let s1 = backup(&repo, "a", &a1, None);
    let mut a2 = a1.clone();
    a2[..CS * 20].fill(0x17);
    let s2 = backup(&repo, "a", &a2, Some(s1.clone()));
    // Another disk that shares part of its chunks.
    let mut c = disk(2 << 20, 22);
    c[..CS * 8].copy_from_slice(&a2[CS * 30..CS * 38]);
    let s3 = backup(&repo, "c", &c, None);
    maint::forget_ids(&repo, None, std::slice::from_ref(&s1.id), false, None).unwrap();
    let g = maint::gc_with(&repo, None, 0).unwrap();
    assert!(g.spill_runs > 8 && g.spill_bytes > 0, "gc wrote no spill runs: {g:?}");
    let index = repo.load_index().unwrap();
    let live = live_blobs(&repo, &index, &[&s2, &s3]);
    let indexed: std::collections::HashSet<_> = index.blobs.keys().copied().collect();
    assert_eq!(indexed, live, "the index holds exactly the live blobs");
    assert!(read_back(&repo, &s2) == a2);
    assert!(read_back(&repo, &s3) == c);
    let r = maint::check(&repo).unwrap();
    assert!(r.problems.is_empty(), "{r:?}");
}

/// The blob ids that `snaps` use: their pages and their chunks.
fn live_blobs(
    repo: &Repository,
    index: &crate::Index,
    snaps: &[&SnapshotInfo],
) -> std::collections::HashSet<crate::format::Digest> {
    let mut live = std::collections::HashSet::new();
    for s in snaps {
        for d in repo.pages(s).unwrap().nonzero() {
            live.insert(repo.crypto.blob_id(d));
        }
        for e in repo.entries(index, s).unwrap().into_iter().filter(|e| *e != ZERO) {
            live.insert(repo.crypto.blob_id(&e));
        }
    }
    live
}

/// The pack and offset of the chunk at `chunk` of a snapshot.
fn where_is(repo: &Repository, snap: &SnapshotInfo, chunk: usize) -> (String, u64) {
    let index = repo.load_index().unwrap();
    let e = repo.entries(&index, snap).unwrap()[chunk];
    let loc = index.blobs[&repo.crypto.blob_id(&e)];
    (crate::repo::pack_name(&loc.pack), loc.offset as u64 + loc.stored_len as u64 / 2)
}

#[test]
fn verify_names_the_snapshot_and_range_of_a_flipped_byte() {
    let (store, repo) = new_repo(false);
    let data = disk(2 << 20, 12);
    let snap = backup(&repo, "d", &data, None);
    let ok = maint::verify(&repo, &VerifyOptions::all(2)).unwrap();
    assert!(ok.problems.is_empty(), "{:?}", ok.problems);
    assert!(ok.bytes_read > 0);
    // Chunk 7 (random data: i % 5 == 2).
    let (pack, at) = where_is(&repo, &snap, 7);
    store.tamper(&pack, |v| v[at as usize] ^= 1);
    assert!(maint::check(&repo).unwrap().problems.is_empty(), "check reads no data");
    let r = maint::verify(&repo, &VerifyOptions::all(2)).unwrap();
    assert_eq!(r.problems.len(), 1, "{:?}", r.problems);
    let p = &r.problems[0];
    assert_eq!(p.object, pack);
    assert_eq!(p.hits, vec![(snap.id.clone(), "d".to_string(), 7 * CS as u64, CS as u64)]);
    // Reading it says where.
    let img = SnapshotImage::open(repo.clone(), &snap).unwrap();
    let mut buf = vec![0u8; 4096];
    let e = img.read(&mut buf, 7 * CS as u64 + 100).unwrap_err();
    let m = e.to_string();
    assert!(m.contains(&pack) && m.contains(&format!("{}..{}", 7 * CS, 8 * CS)), "{m}");
    assert_eq!(e.kind, ferry_backend::ErrorKind::Io);
}

/// A damaged page blob: check's walk names its pack, and verify's read of the pack finds
/// it again. One entry for the pack, not two.
#[test]
fn verify_names_a_pack_with_a_damaged_page_once() {
    let (store, repo) = new_repo(false);
    let data = disk(2 << 20, 14);
    let snap = backup(&repo, "d", &data, None);
    let index = repo.load_index().unwrap();
    let page = repo.pages(&snap).unwrap().to_vec()[0];
    let loc = index.blobs[&repo.crypto.blob_id(&page)];
    let pack = crate::repo::pack_name(&loc.pack);
    store.tamper(&pack, |v| v[loc.offset as usize + loc.stored_len as usize / 2] ^= 1);
    let c = maint::check(&repo).unwrap();
    assert_eq!(c.problems.iter().filter(|p| p.object == pack).count(), 1, "{:?}", c.problems);
    let r = maint::verify(&repo, &VerifyOptions::all(2)).unwrap();
    let named: Vec<&maint::Problem> = r.problems.iter().filter(|p| p.object == pack).collect();
    assert_eq!(named.len(), 1, "{:?}", r.problems);
    assert!(named[0].why.contains("damaged"), "{:?}", named[0]);
    assert!(!named[0].hits.is_empty(), "{:?}", named[0]);
}

#[test]
fn check_names_a_deleted_pack_and_what_it_hits() {
    let (store, repo) = new_repo(false);
    let data = disk(2 << 20, 13);
    let snap = backup(&repo, "d", &data, None);
    let (pack, _) = where_is(&repo, &snap, 1);
    store.delete(&pack).unwrap();
    let r = maint::check(&repo).unwrap();
    assert_eq!(r.problems.len(), 1, "{:?}", r.problems);
    assert_eq!(r.problems[0].object, pack);
    assert!(r.problems[0].why.contains("missing"));
    assert!(!r.problems[0].hits.is_empty());
    assert!(r.problems[0].hits.iter().any(|h| h.0 == snap.id && h.2 <= CS as u64 && h.2 + h.3 >= 2 * CS as u64));
    // gc refuses to work on a repository that lost live data.
    assert!(maint::gc(&repo, None).is_err());
}

#[test]
fn locks_conflict_as_specified() {
    let (store, repo) = new_repo(false);
    let w1 = SnapshotWriter::start(repo.clone(), opts("a", 1 << 20, None)).unwrap();
    match SnapshotWriter::start(repo.clone(), opts("a", 1 << 20, None)) {
        Err(Error::Locked(m)) => assert!(m.contains("backup") && m.contains(&std::process::id().to_string()), "{m}"),
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("two backups of one disk at once"),
    }
    let w2 = SnapshotWriter::start(repo.clone(), opts("b", 1 << 20, None)).unwrap();
    // gc runs beside backups (FORMAT.md §8a).
    maint::gc(&repo, None).unwrap();
    // forget does not conflict with backups.
    maint::forget(&repo, None, &Policy::default(), false).unwrap();
    drop(w1);
    w2.commit(0).unwrap();
    assert!(objects(&store, "locks/").is_empty(), "locks are removed when released");
    // A gc lock that excludes backups (repair's, an older ferry's gc) holds everyone else off.
    let g = lock::acquire(repo.store(), LockKind::Gc, None, None).unwrap();
    assert!(matches!(SnapshotWriter::start(repo.clone(), opts("a", 1 << 20, None)), Err(Error::Locked(_))));
    // Waiting works once the holder lets go.
    let t = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(300));
        drop(g);
    });
    let w = SnapshotWriter::start(
        repo.clone(),
        BackupOptions { wait_lock: Some(std::time::Duration::from_secs(10)), ..opts("a", 1 << 20, None) },
    )
    .unwrap();
    t.join().unwrap();
    drop(w);
}

#[test]
fn stale_lock_of_a_dead_process_is_removed() {
    let (store, repo) = new_repo(false);
    // A lock that cannot be read holds everyone off, and says so.
    store.put("locks/00000000000000000000000000000009", b"{garbage").unwrap();
    match SnapshotWriter::start(repo.clone(), opts("a", 1 << 20, None)) {
        Err(Error::Locked(m)) => assert!(m.contains("locks/00000000000000000000000000000009"), "{m}"),
        _ => panic!("an unreadable lock was ignored"),
    }
    store.delete("locks/00000000000000000000000000000009").unwrap();
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let dead = child.id();
    child.wait().unwrap();
    let now = jiff::Timestamp::now().to_string();
    let l = Lock {
        kind: LockKind::Gc,
        disk: None,
        host: crate::repo::hostname(),
        pid: dead,
        time: now.clone(),
        refreshed: now,
        boot: lock::this_boot(),
        pid_start: None,
        condemned: false,
        shared: false,
    };
    store.put("locks/00000000000000000000000000000001", &l.to_bytes()).unwrap();
    // An old lock of another host is stale too (written an hour ago by the store's clock).
    let old = "2020-01-01T00:00:00Z".to_string();
    let l2 = Lock { host: "elsewhere".into(), pid: 1, time: old.clone(), refreshed: old, ..l.clone() };
    store.set_clock_offset(-3600);
    store.put("locks/00000000000000000000000000000002", &l2.to_bytes()).unwrap();
    store.set_clock_offset(0);
    let listed = lock::list(repo.store()).unwrap();
    assert_eq!(listed.len(), 2);
    assert!(listed.iter().all(|(_, _, stale)| *stale));
    let w = SnapshotWriter::start(repo.clone(), opts("a", 1 << 20, None)).unwrap();
    let names: Vec<String> = objects(&store, "locks/").into_iter().map(|(n, _)| n).collect();
    assert_eq!(names.len(), 1, "the stale locks are gone: {names:?}");
    drop(w);
    // A live lock of another host, refreshed now, holds.
    let now = jiff::Timestamp::now().to_string();
    let l3 = Lock { host: "elsewhere".into(), pid: 1, time: now.clone(), refreshed: now, ..l };
    store.put("locks/00000000000000000000000000000003", &l3.to_bytes()).unwrap();
    match SnapshotWriter::start(repo.clone(), opts("a", 1 << 20, None)) {
        Err(Error::Locked(m)) => assert!(m.contains("elsewhere"), "{m}"),
        _ => panic!("a live gc lock did not hold"),
    }
}

#[test]
fn crash_mid_backup_leaves_a_whole_repository() {
    let (store, repo) = new_repo(false);
    let data = disk(4 << 20, 14);
    let s1 = backup(&repo, "d", &data, None);
    let packs_before = objects(&store, "data/").len();
    {
        let w = SnapshotWriter::start(repo.clone(), opts("d", data.len() as u64, Some(s1.clone()))).unwrap();
        let other = disk(3 << 20, 16);
        w.write(&other, 0, false).unwrap();
        // Dropped without commit: a kill -9 before the manifest.
    }
    assert!(objects(&store, "data/").len() > packs_before, "the crashed backup stored packs");
    let r = maint::check(&repo).unwrap();
    assert!(r.problems.is_empty(), "{:?}", r.problems);
    assert!(r.notes.iter().any(|n| n.contains("in no index object")), "{:?}", r.notes);
    assert_eq!(repo.snapshots().unwrap().len(), 1);
    let g = maint::gc(&repo, None).unwrap();
    assert!(g.packs_deleted > 0, "{g:?}");
    assert_eq!(objects(&store, "data/").len(), packs_before);
    assert!(read_back(&repo, &s1) == data);
    let r = maint::verify(&repo, &VerifyOptions::all(2)).unwrap();
    assert!(r.problems.is_empty() && !r.notes.iter().any(|n| n.contains("in no index object")), "{r:?}");
}

#[test]
fn init_refuses_a_repository_and_open_an_empty_store() {
    let (store, _repo) = new_repo(false);
    assert!(matches!(Repository::init(store, &InitOptions::default()), Err(Error::Invalid(_))));
    let empty = Arc::new(MemStore::new());
    assert!(matches!(Repository::open(empty, &|| Ok(crate::Passphrase::default())), Err(Error::NoRepository(_))));
}

#[test]
fn read_data_percent_covers_every_pack_in_turn() {
    for count in [1usize, 2, 3, 10, 77, 1000] {
        for percent in [1, 7, 10, 33, 50, 99] {
            let width = (percent * count).div_ceil(100);
            let mut seen = vec![false; count];
            for day in 0..count.div_ceil(width) as u64 {
                let read: Vec<usize> =
                    (0..count).filter(|r| maint::ReadData::Percent(percent as u32).selected(*r, count, day)).collect();
                // About the share asked, and never none: 10% of 2 packs reads one.
                assert_eq!(read.len(), width, "{percent}% of {count} packs on day {day}");
                read.iter().for_each(|r| seen[*r] = true);
            }
            assert!(seen.iter().all(|s| *s), "{percent}% does not cover every one of {count} packs in turn");
        }
    }
}

#[test]
fn read_data_subsets_cut_the_packs_once() {
    for count in [0usize, 1, 4, 5, 6, 100, 1001] {
        for t in [1u32, 2, 5, 10] {
            let mut times = vec![0; count];
            for n in 1..=t {
                let sub = maint::ReadData::Subset(n, t);
                let read: Vec<usize> = (0..count).filter(|r| sub.selected(*r, count, 0)).collect();
                // The same every day, and as equal as can be.
                assert!((0..count).all(|r| sub.selected(r, count, 0) == sub.selected(r, count, 99)));
                assert!(read.len() >= count / t as usize && read.len() <= count.div_ceil(t as usize), "{n}/{t}");
                read.iter().for_each(|r| times[*r] += 1);
            }
            assert!(times.iter().all(|n| *n == 1), "{t} subsets of {count} packs: {times:?}");
        }
    }
    use maint::ReadData::{Percent, Subset};
    assert_eq!(maint::ReadData::parse("10"), Ok(Percent(10)));
    assert_eq!(maint::ReadData::parse("10%"), Ok(Percent(10)));
    assert_eq!(maint::ReadData::parse("2/5"), Ok(Subset(2, 5)));
    for bad in ["0", "101", "0/5", "6/5", "1/0", "x", "%", "1/", "-1"] {
        assert!(maint::ReadData::parse(bad).is_err(), "{bad}");
    }
}

/// CPU seconds this process has used (user and system), from /proc.
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let after = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let f: Vec<f64> = after.split_whitespace().map(|x| x.parse().unwrap_or(0.0)).collect();
    // Fields 14 and 15 (utime, stime) are the 12th and 13th after the command name.
    (f.get(11).unwrap_or(&0.0) + f.get(12).unwrap_or(&0.0)) / 100.0
}

/// Throughput of a full backup and a restore through the engine, over a directory and
/// in memory, plain and encrypted (not a check: run with
/// `cargo test --release -p ferry-repo -- --ignored throughput --nocapture`).
#[test]
#[ignore]
fn throughput() {
    let size = 512usize << 20;
    let mut data = vec![0u8; size];
    let mut x = 1u64;
    for c in data.chunks_mut(4096) {
        // Log-like text: compresses about 4:1.
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let text = format!("{x:016x} GET /index.html 200 {} bytes; ", x % 10000);
        for (j, b) in c.iter_mut().enumerate() {
            *b = text.as_bytes()[j % text.len()] ^ ((x >> (j % 64)) as u8 & (j % 7 == 0) as u8);
        }
    }
    for (kind, encrypt) in [("memory", false), ("directory", false), ("directory", true)] {
        let dir = tempfile::tempdir().unwrap();
        let store: Arc<dyn Store> = match kind {
            "memory" => Arc::new(MemStore::new()),
            _ => Arc::new(crate::store::DirStore::create(&dir.path().join("r")).unwrap()),
        };
        let opts = InitOptions {
            encrypt: encrypt.then(|| (crate::Passphrase::new(b"pw".to_vec()), KdfCost { m_kib: 8192, t: 1, p: 1 })),
            ..InitOptions::default()
        };
        let repo = Arc::new(Repository::init(store, &opts).unwrap());
        let t = std::time::Instant::now();
        let cpu = cpu_seconds();
        let level = std::env::var("FERRY_REPO_LEVEL").ok().and_then(|l| l.parse().ok()).unwrap_or(crate::DEFAULT_LEVEL);
        let w = SnapshotWriter::start(repo.clone(), BackupOptions { level, ..BackupOptions::new("big", size as u64) })
            .unwrap();
        std::thread::scope(|s| {
            for th in 0..2 {
                let (w, data) = (w.clone(), &data);
                s.spawn(move || {
                    for (i, p) in data.chunks(1 << 20).enumerate().filter(|(i, _)| i % 2 == th) {
                        w.write(p, (i << 20) as u64, false).unwrap();
                    }
                });
            }
        });
        let snap = w.commit(size as u64).unwrap();
        let secs = t.elapsed().as_secs_f64();
        eprintln!(
            "{kind} store, encrypted {encrypt}: backup {:.0} MB/s, {:.0} MB per CPU second (stored {} MB)",
            size as f64 / secs / 1e6,
            size as f64 / (cpu_seconds() - cpu) / 1e6,
            w.stats().new_stored >> 20
        );
        let img = SnapshotImage::open(repo.clone(), &snap).unwrap();
        let t = std::time::Instant::now();
        let cpu = cpu_seconds();
        std::thread::scope(|s| {
            for th in 0..2 {
                let img = img.clone();
                s.spawn(move || {
                    let mut buf = vec![0u8; 1 << 20];
                    for i in (0..size >> 20).filter(|i| i % 2 == th) {
                        img.read(&mut buf, (i << 20) as u64).unwrap();
                    }
                });
            }
        });
        eprintln!(
            "{kind} store, encrypted {encrypt}: restore {:.0} MB/s, {:.0} MB per CPU second",
            size as f64 / t.elapsed().as_secs_f64() / 1e6,
            size as f64 / (cpu_seconds() - cpu) / 1e6
        );
    }
}

/// A store that counts ranged reads (`.1`), and reads of manifests (`.2`).
#[allow(clippy::type_complexity)]
fn counting(mem: Arc<MemStore>) -> (Arc<Hooked>, Arc<std::sync::atomic::AtomicU64>, Arc<std::sync::atomic::AtomicU64>) {
    let store = Arc::new(Hooked::new(mem));
    let (ranged, manifests) =
        (Arc::new(std::sync::atomic::AtomicU64::new(0)), Arc::new(std::sync::atomic::AtomicU64::new(0)));
    let (r, m) = (ranged.clone(), manifests.clone());
    store.set_hook(Some(Box::new(move |_, when, op, name| {
        let counter = match (when, op) {
            (When::Before, Op::GetRange) => &r,
            (When::Before, Op::Get) if name.starts_with("snapshots/") => &m,
            _ => return Ok(()),
        };
        counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    })));
    (store, ranged, manifests)
}

#[test]
fn small_sequential_reads_fetch_ahead() {
    let mem = Arc::new(MemStore::new());
    let (store, ranged, _) = counting(mem.clone());
    let repo = Arc::new(Repository::init(store, &InitOptions::default()).unwrap());
    let mut data = disk(4 << 20, 30);
    data.iter_mut().step_by(4096).for_each(|b| *b = 1); // no zero chunk
    let snap = backup(&repo, "d", &data, None);
    let img = SnapshotImage::open(repo.clone(), &snap).unwrap();
    let before = ranged.load(std::sync::atomic::Ordering::Relaxed);
    let mut got = vec![0u8; data.len()];
    for (i, c) in got.chunks_mut(4096).enumerate() {
        img.read(c, (i * 4096) as u64).unwrap();
    }
    assert!(got == data);
    let reads = ranged.load(std::sync::atomic::Ordering::Relaxed) - before;
    // 64 chunks in 16 packs of 4 (the test's pack size): one request per chunk without
    // read-ahead, one per pack with it.
    assert!(reads <= 20, "{reads} ranged reads for 64 chunks read 4 KiB at a time");
}

/// check, gc and stats read each manifest once: they list the snapshots with their pages
/// instead of reading every manifest again for them.
#[test]
fn check_gc_and_stats_read_each_manifest_once() {
    let (store, _, manifests) = counting(Arc::new(MemStore::new()));
    let repo = Arc::new(Repository::init(store, &InitOptions::default()).unwrap());
    let data = disk(1 << 20, 31);
    backup(&repo, "d", &data, None);
    backup(&repo, "e", &disk(1 << 20, 32), None);
    let runs: [(&str, &dyn Fn()); 3] = [
        ("check", &|| assert!(maint::check(&repo).unwrap().problems.is_empty())),
        ("gc", &|| assert!(maint::gc(&repo, None).is_ok())),
        ("stats", &|| assert!(maint::stats(&repo).is_ok())),
    ];
    for (what, run) in runs {
        let before = manifests.load(std::sync::atomic::Ordering::Relaxed);
        run();
        let reads = manifests.load(std::sync::atomic::Ordering::Relaxed) - before;
        assert_eq!(reads, 2, "{what} read the 2 manifests {reads} times");
    }
}

#[test]
fn check_names_a_truncated_index_and_the_snapshots_it_hits() {
    let (store, repo) = new_repo(true);
    let data = disk(2 << 20, 40);
    let s1 = backup(&repo, "d", &data, None);
    let mut d2 = data.clone();
    d2[..CS].fill(9);
    let s2 = backup(&repo, "d", &d2, Some(s1.clone()));
    // The first backup's index object, cut short.
    let first = objects(&store, "index/")
        .into_iter()
        .map(|(n, _)| n)
        .find(|n| repo.read_index_object(n).unwrap().iter().any(|p| p.blobs.len() > 4))
        .unwrap();
    store.tamper(&first, |v| v.truncate(v.len() / 2));
    let r = maint::check(&repo).unwrap();
    assert!(r.problems.iter().any(|p| p.object == first), "{:?}", r.problems);
    // Both snapshots use what only that object listed: each is named with its ranges.
    for s in [&s1, &s2] {
        assert!(
            r.problems.iter().any(|p| p.hits.iter().any(|h| h.0 == s.id && h.1 == "d" && h.3 > 0)),
            "{} not named: {:?}",
            s.id,
            r.problems
        );
    }
    // gc refuses to run on it rather than free what it cannot see.
    assert!(maint::gc(&repo, None).is_err());
}

#[test]
fn of_two_racing_lockers_exactly_one_wins() {
    let (_store, repo) = new_repo(false);
    for _ in 0..30 {
        let barrier = std::sync::Barrier::new(2);
        let wins = std::sync::atomic::AtomicU32::new(0);
        let guards = Mutex::new(Vec::new());
        std::thread::scope(|s| {
            for _ in 0..2 {
                s.spawn(|| {
                    barrier.wait();
                    let tag = repo.crypto().disk_tag("t");
                    if let Ok(g) = lock::acquire(repo.store(), LockKind::Backup, Some(tag), None) {
                        wins.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        guards.lock().unwrap().push(g);
                    }
                });
            }
        });
        assert_eq!(wins.into_inner(), 1, "two lockers of one disk at once");
    }
}

/// A store that, right after our lock is written, has another writer's lock appear (one
/// that listed before ours was written, so holds), and removes it after `gone` if given.
fn racing(racer: (String, Vec<u8>), gone: Option<std::time::Duration>) -> Arc<Hooked> {
    let inner = Arc::new(MemStore::new());
    let store = Arc::new(Hooked::new(inner.clone()));
    let mut armed = true;
    store.set_hook(Some(Box::new(move |s, when, op, name| {
        if (when, op) == (When::After, Op::Put) && name.starts_with("locks/") && std::mem::take(&mut armed) {
            s.put(&racer.0, &racer.1)?;
            if let Some(after) = gone {
                let (inner, n) = (inner.clone(), racer.0.clone());
                std::thread::spawn(move || {
                    std::thread::sleep(after);
                    inner.delete(&n).unwrap();
                });
            }
        }
        Ok(())
    })));
    store
}

/// A lock later than ours that stays is one whose writer listed before ours was
/// written and holds: ours gives way. One that goes (its writer saw ours) lets ours hold.
#[test]
fn a_later_lock_that_stays_holds() {
    let (_store, repo) = new_repo(false);
    let tag = repo.crypto().disk_tag("d");
    let later = (jiff::Timestamp::now() + jiff::SignedDuration::from_secs(60)).to_string();
    let l = Lock {
        kind: LockKind::Backup,
        disk: Some(tag.clone()),
        host: crate::repo::hostname(),
        pid: std::process::id(),
        time: later.clone(),
        refreshed: later,
        boot: lock::this_boot(),
        pid_start: None,
        condemned: false,
        shared: false,
    };
    let name = "locks/0000000000000000000000000000000a".to_string();
    for gone in [None, Some(std::time::Duration::from_millis(300))] {
        let store: Arc<dyn Store> = racing((name.clone(), l.to_bytes()), gone);
        let got = lock::acquire(&store, LockKind::Backup, Some(tag.clone()), None);
        match (gone, got) {
            (None, Err(Error::Locked(m))) => assert!(m.contains(&name), "{m}"),
            (None, Err(e)) => panic!("{e}"),
            (None, Ok(_)) => panic!("two backup locks of one disk held at once"),
            (Some(_), r) => assert!(r.is_ok(), "a later lock that went away still held ours off"),
        }
    }
}

/// A repository in `store` with disks a and b of the same data `a` backed up side by
/// side: every chunk stored twice, in different packs.
pub(crate) fn two_copies(store: Arc<dyn Store>, a: &[u8]) -> (Arc<Repository>, [SnapshotInfo; 2]) {
    let init = InitOptions { chunk_size: CS as u32, page_entries: 16, ..InitOptions::default() };
    let repo = Arc::new(Repository::init(store, &init).unwrap());
    let start = |name: &str| SnapshotWriter::start(repo.clone(), BackupOptions::new(name, a.len() as u64)).unwrap();
    // b starts before a commits and writes after: it stores every chunk again (its index
    // is the one it started with, and a's chunks are no longer claimed), whatever the
    // timing of a's packs (writing both before either commits left it to timing). b
    // writes its chunks last to first, one thread: its packs then never hold the same
    // bytes as one of a's (a pack's name is its digest, so an identical pack would be one
    // copy, not two; three threads made that a matter of timing).
    let (wa, wb) = (start("a"), start("b"));
    write_all(&wa, a);
    let sa = wa.commit(a.len() as u64).unwrap();
    for (i, piece) in a.chunks(CS).enumerate().rev() {
        wb.write(piece, (i * CS) as u64, false).unwrap();
    }
    let sb = wb.commit(a.len() as u64).unwrap();
    (repo, [sa, sb])
}

/// gc reads the preferred copy of each blob with several in pack order, neighbours in one
/// ranged read: two disks of the same data backed up side by side (neither saw the other's
/// chunks, so every chunk has two copies) cost a read per pack, not one a copy; one copy
/// of each is kept, and both snapshots read back.
#[test]
fn gc_checks_duplicate_copies_a_pack_range_at_a_time() {
    let mem = Arc::new(MemStore::new());
    let (store, ranged, _) = counting(mem.clone());
    let a = disk(4 << 20, 23);
    let (repo, [sa, sb]) = two_copies(store, &a);
    let several = repo.load_index().unwrap().more.len() as u64;
    assert!(several > 40, "{several} blobs with two copies");
    let before = ranged.load(std::sync::atomic::Ordering::Relaxed);
    let g = maint::gc(&repo, None).unwrap();
    let reads = ranged.load(std::sync::atomic::Ordering::Relaxed) - before;
    // Each snapshot's pages (4 each), then one read per pack of preferred copies.
    assert!(reads <= 12, "{reads} ranged reads for {several} blobs with two copies");
    assert!(g.packs_deleted > 0, "{g:?}");
    assert!(repo.load_index().unwrap().more.is_empty(), "a blob still has two copies");
    assert!(read_back(&repo, &sa) == a && read_back(&repo, &sb) == a);
    let r = maint::check(&repo).unwrap();
    assert!(r.problems.is_empty(), "{r:?}");
}

/// A backup of many unique chunks that each store in a few bytes (a number, then zeroes)
/// closes its pack at [`format::PACK_BLOBS`] blobs, not only by bytes: a 32 MiB pack of
/// them would list more blobs than a trailer or index object may, and both would then be
/// refused as damaged. Every pack reads back and check finds nothing wrong.
#[test]
fn a_pack_of_tiny_blobs_never_lists_more_than_a_reader_accepts() {
    let mem = Arc::new(MemStore::new());
    let init = InitOptions { chunk_size: 4096, ..InitOptions::default() };
    let repo = Arc::new(Repository::init(mem.clone(), &init).unwrap());
    let n = crate::format::PACK_BLOBS + 100;
    let size = (n * 4096) as u64;
    let w = SnapshotWriter::start(repo.clone(), BackupOptions::new("tiny", size)).unwrap();
    let mut chunk = vec![0u8; 4096];
    for i in 0..n {
        chunk[..8].copy_from_slice(&(i as u64 + 1).to_le_bytes());
        w.write(&chunk, (i * 4096) as u64, false).unwrap();
    }
    let s = w.commit(size).unwrap();
    let (good, bad) = repo.index_objects().unwrap();
    assert!(bad.is_empty());
    let counts: Vec<usize> = good.iter().flat_map(|(_, ps)| ps.iter().map(|p| p.blobs.len())).collect();
    assert!(counts.iter().all(|&c| c <= crate::format::PACK_BLOBS), "{counts:?}");
    assert!(objects(&mem, "data/").len() >= 2, "{counts:?}");
    let back = read_back(&repo, &s);
    for i in [0, n / 2, n - 1] {
        assert_eq!(back[i * 4096..i * 4096 + 8], (i as u64 + 1).to_le_bytes(), "chunk {i}");
    }
    let r = maint::check(&repo).unwrap();
    assert!(r.problems.is_empty(), "{r:?}");
}

/// A sorter's spill that fails (a full disk) stops gc at once: no further page is read,
/// nothing is deleted, and the error names the directory written and what to do.
#[test]
fn a_failed_spill_stops_gc_before_it_reads_more_pages() {
    let mem = Arc::new(MemStore::new());
    let (store, ranged, _) = counting(mem.clone());
    let init = InitOptions { chunk_size: 4096, page_entries: 16, ..InitOptions::default() };
    let repo = Arc::new(Repository::init(store, &init).unwrap());
    let a = disk(12 << 20, 24);
    backup(&repo, "a", &a, None);
    let reads = || ranged.load(std::sync::atomic::Ordering::Relaxed);
    // A gc that has nothing to free reads every page.
    let before = reads();
    maint::gc(&repo, None).unwrap();
    let all_pages = reads() - before;
    assert!(all_pages > 2 * 64, "{all_pages} pages");
    let listed = |prefix| objects(&mem, prefix);
    let (data, index) = (listed("data/"), listed("index/"));
    crate::spill::FAIL_SPILLS_OF.with(|f| *f.borrow_mut() = Some("live set"));
    let before = reads();
    let e = maint::gc(&repo, None);
    crate::spill::FAIL_SPILLS_OF.with(|f| *f.borrow_mut() = None);
    let e = e.expect_err("a gc whose spill fails fails").to_string();
    // The first batch of pages (64, read at once) at most.
    assert!(reads() - before <= 64, "{} pages read after the spill failed", reads() - before);
    let dir = repo.index_cache().map_or_else(std::env::temp_dir, |c| c.spill_dir().to_path_buf());
    assert!(e.contains("gc's live set") && e.contains(&dir.display().to_string()), "{e}");
    assert!(e.contains("free space there") && (e.contains("FERRY_CACHE_DIR") || e.contains("TMPDIR")), "{e}");
    assert_eq!((listed("data/"), listed("index/")), (data, index));
}

/// Whether check's `notes` say nothing but that chunk hints went stale (after a gc that
/// moved chunks).
fn only_stale_hints(notes: &[String]) -> bool {
    notes.iter().all(|n| n.contains("chunk hint(s)"))
}

/// A store operation, as a [`Hooked`] store's hook sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Op {
    Get,
    GetRange,
    Len,
    Put,
    Delete,
    List,
}

/// Whether a hook runs before an operation (an error it returns is the operation's) or
/// after one that succeeded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum When {
    Before,
    After,
}

/// A hook of a [`Hooked`] store: given the store below (so that what it does is not hooked
/// again), when, the operation and the name (or the prefix listed).
pub(crate) type Hook = Box<dyn FnMut(&MemStore, When, Op, &str) -> std::io::Result<()> + Send>;

/// The one store that wraps a [`MemStore`] with hooks, for the tests that need a store to
/// fail, panic or change under a running operation: puts or deletes of names with a prefix
/// fail (a crash at that point), ranged reads panic while `panic_reads` is set (a bug
/// anywhere below a read), and `hook` runs around every operation (another process acting
/// at that instant).
pub(crate) struct Hooked {
    pub(crate) inner: Arc<MemStore>,
    pub(crate) fail_put: Mutex<Option<&'static str>>,
    pub(crate) fail_delete: Mutex<Option<&'static str>>,
    /// The kind of the error a failing put gives (`Other`: a crash).
    pub(crate) put_error: Mutex<std::io::ErrorKind>,
    pub(crate) panic_reads: std::sync::atomic::AtomicBool,
    hook: Mutex<Option<Hook>>,
}

/// The tests that only make operations fail call it this.
pub(crate) type Failing = Hooked;

impl Hooked {
    pub(crate) fn new(inner: Arc<MemStore>) -> Self {
        Hooked {
            inner,
            fail_put: Mutex::new(None),
            fail_delete: Mutex::new(None),
            put_error: Mutex::new(std::io::ErrorKind::Other),
            panic_reads: false.into(),
            hook: Mutex::new(None),
        }
    }

    /// Runs `hook` around each operation from now on (`None`: no more).
    pub(crate) fn set_hook(&self, hook: Option<Hook>) {
        *self.hook.lock().unwrap() = hook;
    }

    /// Runs `f` after each put of a name under `prefix`, given the store below.
    pub(crate) fn after_put(&self, prefix: &'static str, mut f: impl FnMut(&MemStore) + Send + 'static) {
        self.set_hook(Some(Box::new(move |s, when, op, name| {
            if when == When::After && op == Op::Put && name.starts_with(prefix) {
                f(s);
            }
            Ok(())
        })));
    }

    fn around<T>(&self, op: Op, name: &str, f: impl FnOnce(&MemStore) -> std::io::Result<T>) -> std::io::Result<T> {
        let run = |when| match self.hook.lock().unwrap().as_mut() {
            Some(h) => h(&self.inner, when, op, name),
            None => Ok(()),
        };
        run(When::Before)?;
        let r = f(&self.inner)?;
        run(When::After)?;
        Ok(r)
    }
}

/// What another process that took every lock for stale does: removes them.
pub(crate) fn drop_locks(s: &MemStore) {
    for (name, _) in s.list("locks/").unwrap() {
        s.delete(&name).unwrap();
    }
}

impl Store for Hooked {
    fn describe(&self) -> String {
        self.inner.describe()
    }
    fn get(&self, name: &str, limit: u64) -> std::io::Result<Vec<u8>> {
        self.around(Op::Get, name, |s| s.get(name, limit))
    }
    fn get_range(&self, name: &str, offset: u64, len: u64) -> std::io::Result<Vec<u8>> {
        assert!(!self.panic_reads.load(std::sync::atomic::Ordering::SeqCst), "a read that panics");
        self.around(Op::GetRange, name, |s| s.get_range(name, offset, len))
    }
    fn len(&self, name: &str) -> std::io::Result<u64> {
        self.around(Op::Len, name, |s| s.len(name))
    }
    fn put(&self, name: &str, data: &[u8]) -> std::io::Result<()> {
        if self.fail_put.lock().unwrap().is_some_and(|p| name.starts_with(p)) {
            return Err(std::io::Error::new(*self.put_error.lock().unwrap(), "crash"));
        }
        self.around(Op::Put, name, |s| s.put(name, data))
    }
    fn delete(&self, name: &str) -> std::io::Result<()> {
        if self.fail_delete.lock().unwrap().is_some_and(|p| name.starts_with(p)) {
            return Err(std::io::Error::other("crash"));
        }
        self.around(Op::Delete, name, |s| s.delete(name))
    }
    fn list(&self, prefix: &str) -> std::io::Result<Vec<(String, u64)>> {
        self.around(Op::List, prefix, |s| s.list(prefix))
    }
}

/// When gc's condemned record appears, the index already lists the packs that hold the
/// repacked copies: a backup that starts then and reads the record finds them indexed,
/// and need not store again what the condemned packs held.
#[test]
fn gc_indexes_the_repacked_copies_before_its_condemned_record() {
    let inner = Arc::new(MemStore::new());
    let store = Arc::new(Hooked::new(inner.clone()));
    let opts = InitOptions { chunk_size: CS as u32, page_entries: 16, ..InitOptions::default() };
    let repo = Arc::new(Repository::init(store.clone(), &opts).unwrap());
    let a1 = disk(3 << 20, 60);
    let s1 = backup(&repo, "a", &a1, None);
    let mut a2 = a1.clone();
    a2[CS..6 * CS].fill(5);
    let s2 = backup(&repo, "a", &a2, Some(s1.clone()));
    maint::forget_ids(&repo, None, std::slice::from_ref(&s1.id), false, None).unwrap();
    // The packs every index object lists at the instant the record is stored.
    let at_record: Arc<Mutex<Option<std::collections::HashSet<[u8; 32]>>>> = Arc::default();
    let (seen, below) = (at_record.clone(), inner.clone());
    store.set_hook(Some(Box::new(move |_, when, op, name| {
        if (when, op) == (When::Before, Op::Put) && name.starts_with("gc/") {
            let other = Repository::open(below.clone(), &|| panic!("asked for a passphrase")).unwrap();
            let (objects, bad) = other.index_objects().unwrap();
            assert!(bad.is_empty());
            let packs = objects.iter().flat_map(|(_, ps)| ps.iter().map(|p| p.pack)).collect();
            *seen.lock().unwrap() = Some(packs);
        }
        Ok(())
    })));
    let g = maint::gc_with(&repo, None, 0).unwrap();
    store.set_hook(None);
    assert!(g.packs_repacked > 0, "{g:?}");
    let at_record = at_record.lock().unwrap().take().expect("gc stored a condemned record");
    let (objects, _) = repo.index_objects().unwrap();
    for (_, ps) in &objects {
        for p in ps {
            assert!(at_record.contains(&p.pack), "pack {} was indexed after the record", crate::format::hex(&p.pack));
        }
    }
    assert!(read_back(&repo, &s2) == a2);
}

/// Where a gc is stopped, by a failing store (FORMAT.md §9): at the put of a pack, a
/// condemned record or an index object, or at the removal of one.
pub(crate) const GC_STOPS: [(Option<&str>, Option<&str>); 6] = [
    (Some("data/"), None),
    (Some("gc/"), None),
    (Some("index/"), None),
    (None, Some("index/")),
    (None, Some("data/")),
    (None, Some("gc/")),
];

/// gc stopped at each step of FORMAT.md §9 leaves a repository that check passes, whose
/// snapshots read back, and that the next gc finishes.
#[test]
fn gc_stopped_at_any_step_leaves_a_whole_repository() {
    for (put, delete) in GC_STOPS {
        let inner = Arc::new(MemStore::new());
        let store = Arc::new(Failing::new(inner.clone()));
        let repo = Arc::new(
            Repository::init(store.clone(), &InitOptions { page_entries: 16, ..InitOptions::default() }).unwrap(),
        );
        let a1 = disk(3 << 20, 50);
        let s1 = backup(&repo, "a", &a1, None);
        let mut a2 = a1.clone();
        a2[CS..5 * CS].fill(3);
        let s2 = backup(&repo, "a", &a2, Some(s1.clone()));
        let b = disk(1 << 20, 51);
        let sb = backup(&repo, "b", &b, None);
        maint::forget(&repo, Some("a"), &Policy { keep_last: Some(1), ..Policy::default() }, false).unwrap();
        *store.fail_put.lock().unwrap() = put;
        *store.fail_delete.lock().unwrap() = delete;
        assert!(maint::gc(&repo, None).is_err(), "gc did not stop at {put:?} {delete:?}");
        *store.fail_put.lock().unwrap() = None;
        *store.fail_delete.lock().unwrap() = None;
        // The gc lock of the stopped gc is gone with it (its guard dropped).
        let r = maint::check(&repo).unwrap();
        assert!(r.problems.is_empty(), "{put:?} {delete:?}: {:?}", r.problems);
        assert!(read_back(&repo, &s2) == a2 && read_back(&repo, &sb) == b, "{put:?} {delete:?}");
        maint::gc(&repo, None).unwrap();
        // b's, kept as it was; the packs of a that stay and the new packs: an index
        // object each.
        assert!(objects(&inner, "index/").len() <= 3, "{put:?} {delete:?}");
        let r = maint::verify(&repo, &VerifyOptions::all(2)).unwrap();
        assert!(
            r.problems.is_empty() && r.notes.iter().all(|n| !n.contains("in no index")),
            "{put:?} {delete:?}: {r:?}"
        );
        assert!(read_back(&repo, &s2) == a2 && read_back(&repo, &sb) == b);
    }
}

#[test]
fn index_objects_are_cut_so_each_stays_readable() {
    let (store, repo) = new_repo(false);
    let data = disk(3 << 20, 11);
    let snap = backup(&repo, "cut", &data, None);
    let index = repo.load_index().unwrap();
    // The packs of the repository, as an index lists them.
    let mut packs: std::collections::BTreeMap<[u8; 32], Vec<crate::format::BlobEntry>> = Default::default();
    for (id, l) in &index.blobs {
        packs.entry(l.pack).or_default().push(crate::format::BlobEntry {
            id: *id,
            kind: l.kind,
            offset: l.offset,
            stored_len: l.stored_len,
            plain_len: l.plain_len,
        });
    }
    let packs: Vec<crate::format::PackBlobs> =
        packs.into_iter().map(|(pack, blobs)| crate::format::PackBlobs { pack, blobs }).collect();
    assert!(packs.len() > 2, "the test needs several packs");
    for (name, _) in objects(&store, "index/") {
        store.delete(&name).unwrap();
    }
    let split = 12 + 36 + packs[0].blobs.len() * crate::format::ENTRY_LEN;
    let (names, _) = repo.put_index_split(&packs, split).unwrap();
    assert!(names.len() >= 2, "{} index objects", names.len());
    let again = repo.load_index().unwrap();
    assert_eq!(again.blobs.len(), index.blobs.len(), "every blob is indexed once more");
    assert!(read_back(&repo, &snap) == data);
}

#[test]
fn a_backup_whose_lock_was_removed_does_not_commit() {
    let (store, repo) = new_repo(false);
    let data = disk(1 << 20, 12);
    let w = SnapshotWriter::start(repo.clone(), opts("gone", data.len() as u64, None)).unwrap();
    write_all(&w, &data);
    for (name, _) in objects(&store, "locks/") {
        store.delete(&name).unwrap();
    }
    assert!(matches!(w.commit(data.len() as u64), Err(Error::Locked(_))), "committed without its lock");
    assert!(objects(&store, "snapshots/").is_empty());
}

/// A backup whose lock another process removed (taking it for stale after a freeze, then
/// running gc, which deletes the packs no index object lists yet) stores no further
/// index object or checkpoint: they could name packs that are gone (FORMAT.md §8). Its
/// next checkpoint stops it, and every later write, checkpoint and the commit fail.
#[test]
fn a_backup_whose_lock_was_removed_stores_no_index_or_checkpoint() {
    let (store, repo) = new_repo(false);
    let data = disk(4 << 20, 13);
    let mib = 1 << 20;
    let o =
        BackupOptions { checkpoint_every: Some(std::time::Duration::ZERO), ..opts("gone", data.len() as u64, None) };
    let w = SnapshotWriter::start(repo.clone(), o).unwrap();
    w.write(&data[..mib], 0, false).unwrap();
    w.checkpoint().unwrap();
    let object = repo.checkpoint_object("gone");
    let (index, checkpoint) = (objects(&store, "index/"), store.get(&object, 1 << 20).unwrap());
    assert!(!index.is_empty());
    for (name, _) in objects(&store, "locks/") {
        store.delete(&name).unwrap();
    }
    let e = w.write(&data[mib..2 * mib], mib as u64, false).unwrap_err();
    let why = format!("{e} {}", e.source.as_ref().map(|s| s.to_string()).unwrap_or_default());
    assert!(why.contains("was removed") && why.contains("run it again"), "{why}");
    assert!(w.write(&data[2 * mib..3 * mib], 2 * mib as u64, false).is_err(), "a write went on without the lock");
    assert!(matches!(w.checkpoint(), Err(Error::Locked(_))), "a checkpoint without the lock");
    assert!(matches!(w.commit(data.len() as u64), Err(Error::Locked(_))), "committed without its lock");
    assert_eq!(objects(&store, "index/"), index, "an index object was stored without the lock");
    assert_eq!(store.get(&object, 1 << 20).unwrap(), checkpoint, "a checkpoint was stored without the lock");
    assert!(objects(&store, "snapshots/").is_empty());
}

/// A checkpoint left by a backup stopped between storing its snapshot and removing its
/// checkpoint is superseded by that snapshot: not offered for resume. One that continues
/// the disk's latest snapshot is.
#[test]
fn a_checkpoint_left_after_its_commit_is_superseded() {
    let (store, repo) = new_repo(false);
    let data = disk(1 << 20, 15);
    for (name, base) in [("first", None), ("next", Some(backup(&repo, "next", &data, None)))] {
        let w = SnapshotWriter::start(repo.clone(), opts(name, data.len() as u64, base.clone())).unwrap();
        write_all(&w, &data);
        w.checkpoint().unwrap();
        let object = repo.checkpoint_object(name);
        let saved = store.get(&object, 1 << 20).unwrap();
        let ck = repo.checkpoint(name).unwrap().unwrap();
        assert!(ck.superseded_by(&repo.snapshots().unwrap()).is_none(), "{name}: a live checkpoint is superseded");
        let r = maint::check(&repo).unwrap();
        assert!(r.notes.iter().any(|n| n.contains("can be resumed")), "{name}: {:?}", r.notes);
        let snap = w.commit(data.len() as u64).unwrap();
        store.put(&object, &saved).unwrap();
        let ck = repo.checkpoint(name).unwrap().unwrap();
        let all = repo.snapshots().unwrap();
        assert_eq!(ck.superseded_by(&all).map(|s| s.id.as_str()), Some(snap.id.as_str()), "{name}");
        // Another disk's later snapshot supersedes nothing of this one.
        let others: Vec<SnapshotInfo> = all.iter().filter(|s| s.manifest.name != name).cloned().collect();
        assert!(ck.superseded_by(&others).is_none(), "{name}");
        let r = maint::check(&repo).unwrap();
        assert!(r.problems.is_empty(), "{:?}", r.problems);
        assert!(
            r.notes.iter().any(|n| n.contains("leftover checkpoint") && n.contains(&snap.id[..8]))
                && !r.notes.iter().any(|n| n.contains("can be resumed")),
            "{name}: {:?}",
            r.notes
        );
        repo.discard_checkpoint(name).unwrap();
    }
}

/// Why a checkpoint cannot be resumed, in words (not Rust's debug form of the value).
#[test]
fn a_resume_mismatch_says_what_each_backup_reads() {
    let (_store, repo) = new_repo(false);
    let data = disk(1 << 20, 16);
    let w = SnapshotWriter::start(repo.clone(), opts("m", data.len() as u64, None)).unwrap();
    write_all(&w, &data);
    w.checkpoint().unwrap();
    let ck = repo.checkpoint("m").unwrap().unwrap();
    let other = BackupOptions {
        changes: crate::format::Changes::ExtentsFrom { file: "/var/lib/maps/m.json".into() },
        ..opts("m", data.len() as u64, None)
    };
    let why = crate::checkpoint_mismatch(&ck.checkpoint, &other).join("; ");
    assert_eq!(why, "it read the whole disk, this backup the ranges listed in \"/var/lib/maps/m.json\"");
}

#[test]
fn a_dead_pid_of_another_boot_or_namespace_is_not_stale() {
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let dead = child.id();
    child.wait().unwrap();
    let now = jiff::Timestamp::now().to_string();
    let l = Lock {
        kind: LockKind::Gc,
        disk: None,
        host: crate::repo::hostname(),
        pid: dead,
        time: now.clone(),
        refreshed: now,
        boot: Some("another-boot pid:[1]".into()),
        pid_start: None,
        condemned: false,
        shared: false,
    };
    assert!(lock::stale(&l, None).is_none(), "a PID of another namespace was taken for this machine's");
    assert!(lock::stale(&Lock { boot: None, ..l.clone() }, None).is_none());
    assert!(lock::stale(&Lock { boot: lock::this_boot(), ..l }, None).is_some());
}

#[test]
fn a_chunk_list_beyond_half_the_memory_limit_is_refused() {
    let gib = 1u64 << 30;
    // 1 GiB allowed (a container's limit on a larger machine): a list of 512 MiB at most.
    assert!(crate::repo::entry_list_within((gib / 2) / 32, "m", Some(gib)).is_ok());
    match crate::repo::entry_list_within((gib / 2) / 32 + 1, "snapshots/x", Some(gib)) {
        Err(Error::Invalid(m)) => assert!(m.contains("snapshots/x") && m.contains("control group"), "{m}"),
        _ => panic!("a list over half the limit was allocated"),
    }
    // Unknown memory: only what the allocator refuses.
    assert!(crate::repo::entry_list_within(u64::MAX / 64, "m", None).is_err());
}

/// Two hosts, one store, clocks apart: a lock's age is told by its writer's time and the
/// store's time of its last write together, so that no clock off alone makes a live lock
/// stale (FORMAT.md §8).
#[test]
fn clock_skew_alone_never_makes_a_lock_stale() {
    use crate::store::StoreTime;
    use std::time::{Duration, SystemTime};
    let (store, repo) = new_repo(false);
    let mins = |m: i64| jiff::SignedDuration::from_secs(m * 60);
    let lock_at = |refreshed: jiff::Timestamp| Lock {
        kind: LockKind::Gc,
        disk: None,
        host: "elsewhere".into(),
        pid: 1,
        time: refreshed.to_string(),
        refreshed: refreshed.to_string(),
        boot: None,
        pid_start: None,
        condemned: false,
        shared: false,
    };
    let name = "locks/0000000000000000000000000000000b";
    // The writer's clock is two hours behind: its lock, written just now, says two hours
    // ago. The store wrote it now by its own clock, so it holds.
    let behind = lock_at(jiff::Timestamp::now() - mins(120));
    store.put(name, &behind.to_bytes()).unwrap();
    match SnapshotWriter::start(repo.clone(), opts("a", 1 << 20, None)) {
        Err(Error::Locked(m)) => assert!(m.contains("elsewhere"), "{m}"),
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("a live lock of a host whose clock is behind was removed as stale"),
    }
    assert!(lock::list(repo.store()).unwrap().iter().all(|(_, _, stale)| !stale));
    // The store's clock is off this host's too (an hour ahead): its own times still agree.
    store.set_clock_offset(3600);
    store.put(name, &behind.to_bytes()).unwrap();
    assert!(lock::list(repo.store()).unwrap().iter().all(|(_, _, stale)| !stale));
    // Written an hour ago by the store's clock, and old by its writer's: stale, removed.
    store.set_clock_offset(-3600);
    store.put(name, &behind.to_bytes()).unwrap();
    store.set_clock_offset(0);
    assert!(lock::list(repo.store()).unwrap().iter().all(|(_, _, stale)| *stale));
    drop(SnapshotWriter::start(repo.clone(), opts("a", 1 << 20, None)).unwrap());
    assert!(objects(&store, "locks/").is_empty());

    // The rule itself, at a fixed now.
    let now = SystemTime::now();
    let ago = |m: u64| now - Duration::from_secs(m * 60);
    let fresh = lock_at(jiff::Timestamp::try_from(now).unwrap());
    let old = lock_at(jiff::Timestamp::try_from(ago(45)).unwrap());
    let at = |modified, store_now| Some(StoreTime { modified, now: store_now });
    // No store time: the writer's time alone (as before).
    assert!(lock::stale_by_time(&old, None, now).is_some());
    assert!(lock::stale_by_time(&fresh, None, now).is_none());
    // Old by its writer's clock, written 5 minutes ago by the store's: live.
    assert!(lock::stale_by_time(&old, at(ago(5), None), now).is_none());
    assert!(lock::stale_by_time(&old, at(ago(5), Some(now)), now).is_none());
    // The store's clock 2 hours ahead of this host's, the lock written 5 minutes ago by it.
    let ahead = now + Duration::from_secs(7200);
    assert!(lock::stale_by_time(&old, at(ahead - Duration::from_secs(300), Some(ahead)), now).is_none());
    // Fresh by its writer's clock (this host's clock behind), old by the store's: live.
    assert!(lock::stale_by_time(&fresh, at(ago(60), Some(now)), now).is_none());
    // Old by both: stale, and the message says when the store wrote it.
    let why = lock::stale_by_time(&old, at(ago(45), Some(now)), now).expect("stale");
    assert!(why.contains("45 minutes ago"), "{why}");
    // A store time in the future (the store's clock jumped back): not stale.
    assert!(lock::stale_by_time(&old, at(now + Duration::from_secs(600), None), now).is_none());
}

/// A store whose ranged reads wait until `want` of them are in at once (or 5 s pass).
struct Gate {
    inner: Arc<MemStore>,
    inside: Mutex<usize>,
    cv: std::sync::Condvar,
    want: usize,
    met: std::sync::atomic::AtomicBool,
    /// What [`Store::local`] says (the memory store behind it is local either way).
    local: bool,
}

impl Gate {
    /// A gate before `inner` for `want` ranged reads at once, closed (reads wait).
    fn new(inner: Arc<MemStore>, want: usize, local: bool) -> Gate {
        Gate { inner, inside: Mutex::new(0), cv: std::sync::Condvar::new(), want, met: false.into(), local }
    }
}

impl Store for Gate {
    fn describe(&self) -> String {
        self.inner.describe()
    }
    fn local(&self) -> bool {
        self.local
    }
    fn get(&self, name: &str, limit: u64) -> std::io::Result<Vec<u8>> {
        self.inner.get(name, limit)
    }
    fn get_range(&self, name: &str, offset: u64, len: u64) -> std::io::Result<Vec<u8>> {
        use std::sync::atomic::Ordering::SeqCst;
        let mut n = self.inside.lock().unwrap();
        *n += 1;
        self.cv.notify_all();
        let timeout = std::time::Duration::from_secs(5);
        n = self.cv.wait_timeout_while(n, timeout, |n| *n < self.want && !self.met.load(SeqCst)).unwrap().0;
        if *n >= self.want {
            self.met.store(true, SeqCst);
            self.cv.notify_all();
        }
        *n -= 1;
        drop(n);
        self.inner.get_range(name, offset, len)
    }
    fn len(&self, name: &str) -> std::io::Result<u64> {
        self.inner.len(name)
    }
    fn put(&self, name: &str, data: &[u8]) -> std::io::Result<()> {
        self.inner.put(name, data)
    }
    fn delete(&self, name: &str) -> std::io::Result<()> {
        self.inner.delete(name)
    }
    fn list(&self, prefix: &str) -> std::io::Result<Vec<(String, u64)>> {
        self.inner.list(prefix)
    }
}

/// The reads of one NBD connection (the server's io_queue) are read side by side, and
/// handed back in the order they came with their data.
#[test]
fn a_connections_reads_run_side_by_side_in_order() {
    let (store, repo) = new_repo(false);
    let data = disk(4 << 20, 7);
    let snap = backup(&repo, "d", &data, None);
    let gate = Arc::new(Gate::new(store, 4, false));
    let repo = Arc::new(Repository::open(gate.clone(), &|| unreachable!()).unwrap());
    let img = SnapshotImage::open(repo, &snap).unwrap();
    let mut q = img.io_queue().expect("a snapshot reads a connection's requests side by side");
    // 4 KiB in each of the first chunks that hold data, none cached yet.
    let offsets: Vec<u64> = (0..64u64).filter(|c| c % 5 != 0).take(12).map(|c| c * CS as u64 + 4096).collect();
    for &o in &offsets {
        q.submit_read(vec![0; 4096], o);
    }
    assert_eq!(q.len(), offsets.len());
    for &o in &offsets {
        let (buf, r) = q.complete().unwrap();
        r.unwrap();
        assert!(buf[..] == data[o as usize..o as usize + 4096], "the read at {o} came back with other bytes");
    }
    assert!(q.complete().is_none());
    assert!(gate.met.load(std::sync::atomic::Ordering::SeqCst), "the reads of one queue ran one at a time");
    // A write to the read-only snapshot is refused in its turn.
    q.submit_read(vec![0; 512], 0);
    q.submit_write(vec![1; 512], 0);
    assert!(q.complete().unwrap().1.is_ok());
    assert!(q.complete().unwrap().1.is_err());
}

/// Chunks read in part are cached up to the budget the image was opened with (each image
/// keeping at least MIN_CACHE_BYTES), not a fixed 256 chunks.
#[test]
fn the_cache_holds_what_its_budget_allows() {
    let (_store, repo) = new_repo(false);
    let data = disk(40 << 20, 8);
    let snap = backup(&repo, "d", &data, None);
    let nonzero = data.chunks(CS).filter(|c| !ferry_hash::is_zero(c)).count() as u64;
    assert!(nonzero * CS as u64 > crate::MIN_CACHE_BYTES);
    for (budget, want) in [(1 << 30, nonzero * CS as u64), (0, crate::MIN_CACHE_BYTES)] {
        let img = SnapshotImage::open_with_cache(repo.clone(), &snap, budget).unwrap();
        let mut buf = vec![0u8; 4096];
        for _pass in 0..2 {
            for c in 0..data.len() / CS {
                let o = c * CS + 100;
                img.read(&mut buf, o as u64).unwrap();
                assert!(buf[..] == data[o..o + 4096]);
            }
        }
        assert_eq!(img.cached_bytes(), want, "budget {budget}");
    }
}

/// A read of a connection's queue that panics fails alone, in its turn: the connection
/// is not left waiting for it, and the pool reads on.
#[test]
fn a_read_that_panics_fails_alone() {
    let (store, repo) = new_repo(false);
    let data = disk(2 << 20, 9);
    let snap = backup(&repo, "d", &data, None);
    let st = Arc::new(Failing::new(store));
    let repo = Arc::new(Repository::open(st.clone(), &|| unreachable!()).unwrap());
    let img = SnapshotImage::open(repo, &snap).unwrap();
    let mut q = img.io_queue().unwrap();
    st.panic_reads.store(true, std::sync::atomic::Ordering::SeqCst);
    let (tx, rx) = std::sync::mpsc::channel();
    let waiter = std::thread::spawn(move || {
        q.submit_read(vec![0; 4096], CS as u64 + 4096);
        let (_, r) = q.complete().unwrap();
        tx.send(r.is_err()).unwrap();
        q
    });
    let failed = rx.recv_timeout(std::time::Duration::from_secs(20)).expect("the connection waits forever");
    assert!(failed, "a read that panicked succeeded");
    let mut q = waiter.join().unwrap();
    st.panic_reads.store(false, std::sync::atomic::Ordering::SeqCst);
    let o = CS + 4096;
    q.submit_read(vec![0; 4096], o as u64);
    let (buf, r) = q.complete().unwrap();
    r.unwrap();
    assert!(buf[..] == data[o..o + 4096]);
}

/// Listing reads manifests a few at a time, never more bytes at once than its budget
/// (but one larger than the budget alone).
#[test]
fn byte_budget_bounds_what_threads_hold_at_once() {
    use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
    let budget = crate::repo::ByteBudget::new(100);
    let (held, peak) = (AtomicU64::new(0), AtomicU64::new(0));
    let sizes: Vec<u64> = (0..64).map(|i| [10, 40, 70, 250][i % 4]).collect();
    let got = crate::repo::par_map(&sizes, 8, |&n| {
        budget.with(n, || {
            let now = held.fetch_add(n, SeqCst) + n;
            if now > n {
                peak.fetch_max(now, SeqCst);
            }
            assert!(now <= 100 || now == n, "{now} bytes held at once");
            std::thread::sleep(std::time::Duration::from_millis(1));
            held.fetch_sub(n, SeqCst);
            n
        })
    });
    assert_eq!(got, sizes);
    assert!(peak.load(SeqCst) > 0, "small ones are read together");
}

/// Bytes held by a thread that panics are given back: the others do not wait for ever.
#[test]
fn byte_budget_is_given_back_by_a_thread_that_panics() {
    let budget = Arc::new(crate::repo::ByteBudget::new(100));
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| budget.with(100, || panic!("boom"))));
    assert!(r.is_err());
    // Another thread (left behind, not joined, should it wait for ever) takes bytes.
    let (tx, rx) = std::sync::mpsc::channel();
    let b = budget.clone();
    std::thread::spawn(move || tx.send(b.with(60, || 7)));
    assert_eq!(rx.recv_timeout(std::time::Duration::from_secs(10)), Ok(7), "the budget was not given back");
}

/// A snapshot's chunk list is read a window of pages at a time (8 pages in these tests):
/// one of 21 pages, zero pages among them, reads back whole, from a listing (its pages
/// read again from its manifest) and incrementally; a damaged page in the last window is
/// named by its number.
#[test]
fn chunk_lists_are_read_a_window_of_pages_at_a_time() {
    let (store, repo) = new_repo(false);
    let mut data = disk(21 * 16 * CS - 5000, 41);
    data[3 * 16 * CS..5 * 16 * CS].fill(0);
    let first = backup(&repo, "d", &data, None);
    let listed = repo.resolve("d", None).unwrap();
    assert!(listed.held_pages().is_none(), "a listed snapshot holds no pages");
    assert!(read_back(&repo, &listed) == data);
    let pages = repo.pages(&listed).unwrap();
    assert_eq!((pages.count(), pages.nonzero().len()), (21, 19));
    let index = repo.load_index().unwrap();
    assert_eq!(repo.entries(&index, &listed).unwrap(), repo.entries(&index, &first).unwrap());
    let mut day2 = data.clone();
    day2[19 * 16 * CS..19 * 16 * CS + 10].fill(7);
    let second = backup(&repo, "d", &day2, Some(listed));
    assert!(read_back(&repo, &repo.resolve("d", None).unwrap()) == day2);
    // Page 20 is in the third window.
    let page = repo.crypto.blob_id(&pages.to_vec()[20]);
    let loc = index.blobs[&page];
    store.tamper(&crate::repo::pack_name(&loc.pack), |v| v[loc.offset as usize] ^= 1);
    let e = repo.entries(&repo.load_index().unwrap(), &second).unwrap_err().to_string();
    assert!(e.contains("page 20"), "{e}");
}

/// A version 3 backup says where each chunk and each page is (FORMAT.md §7c): every hint
/// is the index's place of that blob; a version 2 repository's backup stays version 1
/// manifests and kind 1 pages.
#[test]
fn a_version_3_snapshot_says_where_each_chunk_and_page_is() {
    use crate::format::{BlobKind, LOCATED_VERSION};
    use crate::runs::BlobLookup;
    for encrypt in [false, true] {
        let (_store, repo) = new_repo(encrypt);
        let data = disk(3 << 20, 5);
        let s1 = backup(&repo, "d", &data, None);
        assert_eq!(s1.manifest.version, LOCATED_VERSION);
        let index = repo.load_index().unwrap();
        let (entries, hints) = repo.entries_hinted(&index, &s1, true).unwrap();
        let mut hinted = 0;
        for (ci, d) in entries.iter().enumerate() {
            if *d == ZERO {
                assert!(hints.get(ci).is_none(), "zero chunk {ci} has a hint");
                continue;
            }
            let loc = index.first(&repo.crypto.blob_id(d)).unwrap();
            assert_eq!(hints.get(ci), Some(loc.at()), "chunk {ci}");
            hinted += 1;
        }
        assert!(hinted > 10);
        let pages = repo.pages(&s1).unwrap();
        for (d, h) in pages.iter_hinted().filter(|(d, _)| *d != ZERO) {
            let loc = index.first(&repo.crypto.blob_id(&d)).unwrap();
            assert_eq!(loc.kind, BlobKind::Located);
            assert!(!h.is_none());
            assert_eq!(
                (pages.packs()[h.pack as usize], h.offset, h.stored_len),
                (loc.pack, loc.offset, loc.stored_len)
            );
        }
        assert!(read_back(&repo, &s1) == data);
    }
    let store = Arc::new(MemStore::new());
    let opts = InitOptions { chunk_size: CS as u32, page_entries: 16, version: 2, ..InitOptions::default() };
    let repo = Arc::new(Repository::init(store, &opts).unwrap());
    let s = backup(&repo, "d", &disk(1 << 20, 6), None);
    assert_eq!(s.manifest.version, crate::format::VERSION);
    let index = repo.load_index().unwrap();
    let pages = repo.pages(&s).unwrap();
    assert!(pages.packs().is_empty());
    for d in pages.nonzero() {
        assert_eq!(index.first(&repo.crypto.blob_id(d)).unwrap().kind, BlobKind::Page);
    }
}
