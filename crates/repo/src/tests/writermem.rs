//! A backup's memory does not grow with the chunks it stores: the blobs an index object
//! lists move from the writer's memory to its own runs ([`crate::runs::OwnRuns`]), and
//! deduplication, located pages and resumes work as they did.
use super::*;
use crate::CheckpointInfo;

/// Writes `data[start..end]` in 256 KiB requests, in order, from this thread (zeroes
/// through `zero`): packs are the same bytes each time.
fn write_in_order(w: &SnapshotWriter, data: &[u8], start: usize, end: usize) {
    write_checkpointing(w, data, start, end, usize::MAX)
}

/// [`write_in_order`], with a checkpoint after every `every` requests.
fn write_checkpointing(w: &SnapshotWriter, data: &[u8], start: usize, end: usize, every: usize) {
    let mut pos = start;
    let mut k = 0;
    while pos < end {
        k += 1;
        if k % every == 0 {
            w.checkpoint().unwrap();
        }
        let n = (256 * K).min(end - pos);
        super::resume::write_piece(w, data, pos, n);
        pos += n;
    }
}

/// `disk(first)`, then the same bytes again, `times` times: chunks that come back long
/// after their blobs left memory.
fn repeating(first: usize, times: usize, seed: u64) -> Vec<u8> {
    disk(first, seed).repeat(times)
}

/// A backup of `data` in order, checkpointed every 3 requests (the same packs each time),
/// keeping `keep` blobs in memory; with what it held at the end (before the commit).
fn backup_keeping(repo: &Arc<Repository>, data: &[u8], keep: usize) -> (SnapshotInfo, (usize, usize, u64)) {
    let w = SnapshotWriter::start(repo.clone(), opts("d", data.len() as u64, None)).unwrap();
    w.keep_in_memory(keep);
    write_checkpointing(&w, data, 0, data.len(), 3);
    let held = w.own_held();
    (w.commit(data.len() as u64).unwrap(), held)
}

/// The distinct non-zero chunks of `data`.
fn distinct(data: &[u8]) -> usize {
    let set: std::collections::HashSet<&[u8]> = data.chunks(CS).filter(|c| !ferry_hash::is_zero(c)).collect();
    set.len()
}

#[test]
fn blobs_moved_out_of_memory_still_deduplicate_and_the_pages_are_the_same() {
    // 2.5 MiB of distinct chunks (about 24 of them not zero, half compressible), four times.
    let data = repeating(40 * CS + 3000, 4, 3);
    let (store_a, repo_a) = new_repo(false);
    let (a, held_a) = backup_keeping(&repo_a, &data, usize::MAX);
    let (store_b, repo_b) = new_repo(false);
    let (b, held_b) = backup_keeping(&repo_b, &data, 8);
    // Everything stayed in memory in the first, and little in the second.
    assert_eq!(held_a.2, 0, "{held_a:?}");
    assert!(held_b.2 > 16 && held_b.0 < held_a.0 && held_b.1 < held_a.1, "{held_a:?} {held_b:?}");
    for (repo, s) in [(&repo_a, &a), (&repo_b, &b)] {
        // Each distinct chunk stored once, though it came back after it left memory.
        assert_eq!(s.manifest.stats.new_chunks, distinct(&data) as u64);
        assert!(read_back(repo, s) == data);
        let r = maint::check(repo).unwrap();
        assert!(r.problems.is_empty(), "{:?}", r.problems);
        let index = repo.load_index().unwrap();
        assert!(index.more.is_empty(), "a blob was stored twice");
    }
    // The same packs, and the same located pages naming the same places.
    assert_eq!(objects(&store_a, "data/"), objects(&store_b, "data/"));
    assert_eq!(a.manifest.pages, b.manifest.pages);
    assert_eq!(a.manifest.page_packs, b.manifest.page_packs);
    assert_eq!(a.manifest.blkhash, b.manifest.blkhash);
}

/// Threads that store the same chunks at once: each blob is stored by one of them, while
/// blobs move out of memory meanwhile.
#[test]
fn threads_storing_the_same_chunks_store_each_once() {
    for encrypt in [false, true] {
        let (_store, repo) = new_repo(encrypt);
        let one = disk(48 * CS, 9);
        let data = one.repeat(4);
        let n = one.len();
        // A checkpoint as soon as 6 blobs wait for one (and one at each write).
        let o =
            BackupOptions { checkpoint_every: Some(std::time::Duration::ZERO), ..opts("d", data.len() as u64, None) };
        let w = SnapshotWriter::start(repo.clone(), o).unwrap();
        w.keep_in_memory(6);
        std::thread::scope(|s| {
            for t in 0..4 {
                let w = &w;
                let data = &data;
                s.spawn(move || write_in_order(w, data, t * n, (t + 1) * n));
            }
        });
        // Then all of it again, from two threads, once the blobs are out of memory.
        assert!(w.own_held().2 > 0, "{:?}", w.own_held());
        std::thread::scope(|s| {
            for t in 0..2 {
                let w = &w;
                let data = &data;
                s.spawn(move || write_in_order(w, data, t * 2 * n, (t + 1) * 2 * n));
            }
        });
        let snap = w.commit(data.len() as u64).unwrap();
        assert_eq!(snap.manifest.stats.new_chunks, distinct(&one) as u64);
        assert!(read_back(&repo, &snap) == data);
        assert!(repo.load_index().unwrap().more.is_empty(), "a blob was stored twice");
        let r = maint::check(&repo).unwrap();
        assert!(r.problems.is_empty(), "{:?}", r.problems);
    }
}

/// A backup killed after its blobs moved out of memory resumes from its checkpoint; the
/// resumed one deduplicates against what the killed one stored.
#[test]
fn a_backup_killed_after_its_blobs_moved_out_resumes() {
    let (_store, repo) = new_repo(true);
    let data = repeating(32 * CS, 3, 12);
    let len = data.len() as u64;
    let w = SnapshotWriter::start(repo.clone(), opts("d", len, None)).unwrap();
    w.keep_in_memory(4);
    write_in_order(&w, &data, 0, 40 * CS);
    w.checkpoint().unwrap();
    assert!(w.own_held().2 > 0, "{:?}", w.own_held());
    write_in_order(&w, &data, 40 * CS, 60 * CS);
    drop(w);
    let ck: CheckpointInfo = repo.checkpoint("d").unwrap().expect("a checkpoint");
    let w = SnapshotWriter::resume(repo.clone(), opts("d", len, None), &ck).unwrap();
    w.keep_in_memory(4);
    let done = w.done_ranges();
    assert_eq!(done, vec![(0, 40 * CS as u64)]);
    write_in_order(&w, &data, 40 * CS, data.len());
    let snap = w.commit(0).unwrap();
    assert!(read_back(&repo, &snap) == data);
    // The chunks of 40..96 are those of 8..32 again: the killed backup stored each of
    // them before its checkpoint (which indexed their packs), so none is new.
    assert_eq!(snap.manifest.stats.new_chunks, 0);
    let r = maint::check(&repo).unwrap();
    assert!(r.problems.is_empty(), "{:?}", r.problems);
}

/// Where its own runs cannot be written (the cache directory became a file once the
/// backup started), a backup keeps its blobs in memory: its checkpoints succeed, it
/// resumes from them, and the snapshot restores.
#[test]
fn a_backup_whose_own_runs_cannot_be_written_keeps_its_blobs_in_memory() {
    let (_store, repo) = new_repo(false);
    let tmp = tempfile::tempdir().unwrap();
    let spill = tmp.path().join("cache");
    std::fs::create_dir(&spill).unwrap();
    assert!(repo.set_index_cache(Some(crate::runs::Cache::in_dir(spill.join("repo")))));
    let data = repeating(32 * CS, 3, 14);
    let len = data.len() as u64;
    let w = SnapshotWriter::start(repo.clone(), opts("d", len, None)).unwrap();
    w.keep_in_memory(4);
    let unusable = || {
        std::fs::rename(&spill, tmp.path().join("gone")).unwrap();
        std::fs::write(&spill, b"not a directory").unwrap();
    };
    unusable();
    // A checkpoint every 2 requests: each tries to move the blobs out, and fails.
    write_checkpointing(&w, &data, 0, 40 * CS, 2);
    w.checkpoint().unwrap();
    assert_eq!(w.own_held().2, 0, "{:?}", w.own_held());
    drop(w);
    let ck: CheckpointInfo = repo.checkpoint("d").unwrap().expect("a checkpoint");
    std::fs::remove_file(&spill).unwrap();
    std::fs::rename(tmp.path().join("gone"), &spill).unwrap();
    let w = SnapshotWriter::resume(repo.clone(), opts("d", len, None), &ck).unwrap();
    w.keep_in_memory(4);
    unusable();
    assert_eq!(w.done_ranges(), vec![(0, 40 * CS as u64)]);
    write_checkpointing(&w, &data, 40 * CS, data.len(), 2);
    let snap = w.commit(0).unwrap();
    assert!(read_back(&repo, &snap) == data);
    assert_eq!(snap.manifest.stats.new_chunks, 0);
    assert_eq!(w.own_held().2, 0, "{:?}", w.own_held());
    std::fs::remove_file(&spill).unwrap();
    std::fs::rename(tmp.path().join("gone"), &spill).unwrap();
    let r = maint::check(&repo).unwrap();
    assert!(r.problems.is_empty(), "{:?}", r.problems);
}

/// A writer dropped while a merge of its own runs runs stops it and waits for its thread.
#[test]
fn a_writer_dropped_while_its_runs_merge_joins_the_merge() {
    let (_store, repo) = new_repo(false);
    let data = disk(96 * CS, 31);
    let mut seen = 0;
    for _ in 0..20 {
        let w = SnapshotWriter::start(repo.clone(), opts("d", data.len() as u64, None)).unwrap();
        w.keep_in_memory(1);
        let mut pos = 0;
        let mut running = None;
        while pos < data.len() && running.is_none() {
            let n = (2 * CS).min(data.len() - pos);
            super::resume::write_piece(&w, &data, pos, n);
            pos += n;
            w.checkpoint().unwrap();
            let (r, weak) = w.merge_running();
            running = r.then_some(weak);
        }
        let Some(weak) = running else { continue };
        drop(w);
        assert!(weak.upgrade().is_none(), "the merge thread outlived its writer");
        seen += 1;
        if seen == 3 {
            break;
        }
    }
    println!("dropped {seen} writers while their runs merged");
}

/// Own runs merged beside the backup find every blob where it was, and runs added while
/// the merge ran stay after its run.
#[test]
fn own_runs_merged_find_what_they_held() {
    use crate::format::{BlobEntry, BlobKind, PackBlobs};
    use crate::runs::OwnRuns;
    let dir = tempfile::tempdir().unwrap();
    let batch = |b: u8| -> Vec<PackBlobs> {
        (0..3u8)
            .map(|p| PackBlobs {
                pack: [b * 16 + p; 32],
                blobs: (0..50u32)
                    .map(|i| BlobEntry {
                        id: crate::repo::sha256(&[b, p, i as u8]),
                        kind: BlobKind::Data,
                        offset: i * 100,
                        stored_len: 100,
                        plain_len: 4096,
                    })
                    .collect(),
            })
            .collect()
    };
    let mut own = OwnRuns::default();
    let mut all = Vec::new();
    let mut merged = 0;
    for b in 0..12u8 {
        let packs = batch(b);
        all.extend(packs.iter().flat_map(|p| p.blobs.iter().map(move |e| (p.pack, *e))));
        own = own.with(dir.path(), packs).unwrap();
        if let Some(mut m) = own.merge_due() {
            m.run(dir.path(), &std::sync::atomic::AtomicBool::new(false)).unwrap();
            // A batch added while the merge ran.
            let later = batch(100 + b);
            all.extend(later.iter().flat_map(|p| p.blobs.iter().map(move |e| (p.pack, *e))));
            own = own.with(dir.path(), later).unwrap();
            own = own.with_merged(&m).expect("the merged runs are still there");
            merged += 1;
        }
        assert!(own.runs() <= 5, "{} runs", own.runs());
    }
    assert!(merged > 2);
    assert_eq!(own.entries(), all.len() as u64);
    for (pack, e) in &all {
        assert!(own.may_hold(&e.id));
        let l = own.find(&e.id).unwrap().expect("a blob moved out is found");
        assert_eq!((l.pack, l.offset, l.stored_len, l.plain_len), (*pack, e.offset, e.stored_len, e.plain_len));
    }
    assert!(own.find(&[7; 32]).unwrap().is_none());
    // Nothing named is left in the directory: the runs' files have no name.
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

/// Blobs moved out of memory whose packs a gc beside the backup condemned (they were
/// overwritten before a checkpoint used them, then written again) are stored again at
/// commit, read through the runs: the disk's next backup finds every chunk of its base.
#[test]
fn moved_blobs_in_packs_condemned_meanwhile_are_stored_again() {
    for encrypt in [false, true] {
        let (_store, repo) = new_repo(encrypt);
        let a = disk(2 << 20, 21);
        let b = disk(2 << 20, 22);
        let len = a.len() as u64;
        let w = SnapshotWriter::start(repo.clone(), opts("d", len, None)).unwrap();
        w.keep_in_memory(4);
        write_in_order(&w, &a, 0, a.len());
        w.checkpoint().unwrap();
        // `a` overwritten: the next checkpoint uses none of its packs.
        write_in_order(&w, &b, 0, b.len());
        w.checkpoint().unwrap();
        assert!(w.own_held().2 > 0, "{:?}", w.own_held());
        let g = maint::gc_opts(
            &repo,
            &maint::GcOptions { wait: None, repack_percent: 10, condemn_margin: std::time::Duration::from_secs(3600) },
        )
        .unwrap();
        assert!(g.packs_condemned > 0, "{g:?}");
        // `a` again: deduplicated against the moved blobs, in condemned packs.
        write_in_order(&w, &a, 0, a.len());
        let snap = w.commit(len).unwrap();
        assert!(read_back(&repo, &snap) == a);
        let next = SnapshotWriter::start(repo.clone(), opts("d", len, Some(snap.clone()))).unwrap();
        assert!(next.lost_ranges().is_empty(), "encrypt {encrypt}: {:?}", next.lost_ranges());
        drop(next);
        let r = maint::check(&repo).unwrap();
        assert!(r.problems.is_empty(), "{:?}", r.problems);
    }
}
