//! Checkpoints and resumed backups (FORMAT.md §7a).
use super::*;
use crate::CheckpointInfo;

/// Writes `data[start..end]` in 1 MiB requests (zeroes through `zero`).
fn write_range(w: &SnapshotWriter, data: &[u8], start: usize, end: usize) {
    let mut pos = start;
    while pos < end {
        let n = (1 << 20).min(end - pos);
        write_piece(w, data, pos, n);
        pos += n;
    }
}

/// Writes `data[pos..pos + n]` in one request (zeroes through `zero`).
pub(super) fn write_piece(w: &SnapshotWriter, data: &[u8], pos: usize, n: usize) {
    let piece = &data[pos..pos + n];
    if ferry_hash::is_zero(piece) {
        w.zero(pos as u64, n as u64, ZeroMode::default(), false).unwrap();
    } else {
        w.write(piece, pos as u64, false).unwrap();
    }
}

/// Writes everything but `done` (sorted byte ranges).
fn write_rest(w: &SnapshotWriter, data: &[u8], done: &[(u64, u64)]) {
    let mut pos = 0usize;
    for &(off, len) in done {
        write_range(w, data, pos, off as usize);
        pos = (off + len) as usize;
    }
    write_range(w, data, pos, data.len());
}

/// Starts a backup of `data`, writes its first `first` bytes, checkpoints, writes a bit
/// more (lost), and drops the writer: an interrupted backup.
fn interrupted(repo: &Arc<Repository>, name: &str, data: &[u8], base: Option<SnapshotInfo>, first: usize) {
    let w = SnapshotWriter::start(repo.clone(), opts(name, data.len() as u64, base)).unwrap();
    write_range(&w, data, 0, first);
    w.checkpoint().unwrap();
    write_range(&w, data, first, first + (1 << 20));
    drop(w);
}

fn resume(repo: &Arc<Repository>, name: &str, data: &[u8], base: Option<SnapshotInfo>) -> (SnapshotInfo, u64) {
    let ck: CheckpointInfo = repo.checkpoint(name).unwrap().expect("a checkpoint");
    let w = SnapshotWriter::resume(repo.clone(), opts(name, data.len() as u64, base), &ck).unwrap();
    let done = w.done_ranges();
    write_rest(&w, data, &done);
    let snap = w.commit(0).unwrap();
    (snap, done.iter().map(|r| r.1).sum())
}

#[test]
fn a_resumed_backup_reads_back_exactly_and_its_checkpoint_goes() {
    for encrypt in [false, true] {
        let (store, repo) = new_repo(encrypt);
        let data = disk(5 * (1 << 20) + 3 * CS + 5000, 7);
        interrupted(&repo, "vm1-sda", &data, None, 2 << 20);
        assert_eq!(objects(&store, "checkpoints/").len(), 1);
        assert!(repo.snapshots().unwrap().is_empty(), "an interrupted backup made a snapshot");
        let ck = repo.checkpoint("vm1-sda").unwrap().unwrap();
        assert_eq!(ck.checkpoint.done, vec![[0, 32]], "the chunks written before the checkpoint are done");
        assert_eq!(ck.checkpoint.done_bytes(), 2 << 20);
        let r = maint::check(&repo).unwrap();
        assert!(r.problems.is_empty(), "{:?}", r.problems);
        assert!(r.notes.iter().any(|n| n.contains("interrupted backup of vm1-sda")), "{:?}", r.notes);
        let (snap, done) = resume(&repo, "vm1-sda", &data, None);
        assert_eq!(done, 2 << 20);
        assert!(read_back(&repo, &snap) == data, "the resumed snapshot does not read back as written");
        assert!(objects(&store, "checkpoints/").is_empty(), "the committed backup left its checkpoint");
        assert!(repo.checkpoint("vm1-sda").unwrap().is_none());
        let r = maint::check(&repo).unwrap();
        assert!(r.problems.is_empty(), "{:?}", r.problems);
        // The resumed backup stored only what the checkpoint had not.
        let chunks = data.len().div_ceil(CS) as u64;
        assert_eq!(snap.manifest.stats.written_chunks, chunks - 32);
    }
}

#[test]
fn a_resumed_incremental_backup_keeps_its_base_and_reads_back() {
    let (_store, repo) = new_repo(false);
    let day1 = disk(4 << 20, 2);
    let base = backup(&repo, "d", &day1, None);
    let mut day2 = day1.clone();
    day2[100..200].fill(9);
    day2[(3 << 20) + 5..(3 << 20) + 70000].fill(3);
    interrupted(&repo, "d", &day2, Some(base.clone()), 1 << 20);
    // Another base is refused, and says how to get out.
    let ck = repo.checkpoint("d").unwrap().unwrap();
    let e = SnapshotWriter::resume(repo.clone(), opts("d", day2.len() as u64, None), &ck).err().unwrap();
    assert!(e.to_string().contains("without resuming"), "{e}");
    let e = SnapshotWriter::resume(repo.clone(), opts("d", 5 << 20, Some(base.clone())), &ck).err().unwrap();
    assert!(e.to_string().contains("bytes"), "{e}");
    let (snap, done) = resume(&repo, "d", &day2, Some(base.clone()));
    assert_eq!(done, 1 << 20);
    assert_eq!(snap.manifest.parent.as_deref(), Some(base.id.as_str()));
    assert!(read_back(&repo, &snap) == day2);
    assert!(read_back(&repo, &base) == day1);
}

#[test]
fn gc_between_the_interrupt_and_the_resume_keeps_what_the_checkpoint_stored() {
    let (store, repo) = new_repo(true);
    let data = disk(4 << 20, 11);
    interrupted(&repo, "g", &data, None, 3 << 20);
    let done_chunks: Vec<[u8; 32]> = data[..3 << 20]
        .chunks(CS)
        .filter(|c| !ferry_hash::is_zero(c))
        .map(|c| repo.crypto.blob_id(&crate::blob::digest(c)))
        .collect();
    let g = maint::gc(&repo, None).unwrap();
    assert!(g.packs_deleted > 0, "the packs stored after the checkpoint are orphans: {g:?}");
    let index = repo.load_index().unwrap();
    for id in &done_chunks {
        assert!(index.blobs.contains_key(id), "gc removed a chunk the checkpoint stored");
    }
    let before = objects(&store, "data/").iter().map(|o| o.1).sum::<u64>();
    let (snap, _) = resume(&repo, "g", &data, None);
    assert!(read_back(&repo, &snap) == data);
    // The done chunks were not stored again: only the last MiB's chunks are new.
    let last: std::collections::HashSet<_> =
        data[3 << 20..].chunks(CS).filter(|c| !ferry_hash::is_zero(c)).map(crate::blob::digest).collect();
    assert_eq!(snap.manifest.stats.new_chunks, last.len() as u64);
    assert!(objects(&store, "data/").iter().map(|o| o.1).sum::<u64>() > before);
    let r = maint::check(&repo).unwrap();
    assert!(r.problems.is_empty(), "{:?}", r.problems);
}

#[test]
fn a_damaged_checkpoint_is_an_error_naming_it() {
    let (store, repo) = new_repo(false);
    let data = disk(2 << 20, 5);
    interrupted(&repo, "x", &data, None, 1 << 20);
    let object = repo.checkpoint_object("x");
    store.tamper(&object, |b| {
        let n = b.len() / 2;
        b[n] ^= 0x41;
    });
    let e = repo.checkpoint("x").expect_err("a damaged checkpoint reads");
    assert!(matches!(e, Error::Damaged { .. }) && e.to_string().contains(&object), "{e}");
    let r = maint::check(&repo).unwrap();
    assert!(r.problems.iter().any(|p| p.object == object), "{:?}", r.problems);
    // A fresh backup goes on (and its commit removes the damaged checkpoint).
    backup(&repo, "x", &data, None);
    assert!(repo.checkpoint("x").unwrap().is_none());
}

#[test]
fn checkpoints_come_from_the_write_path_when_due() {
    let (_store, repo) = new_repo(false);
    let data = disk(3 << 20, 3);
    let o = BackupOptions { checkpoint_every: Some(std::time::Duration::ZERO), ..opts("t", data.len() as u64, None) };
    let w = SnapshotWriter::start(repo.clone(), o).unwrap();
    write_all(&w, &data);
    let ck = repo.checkpoint("t").unwrap().expect("a checkpoint from the write path");
    assert!(ck.checkpoint.done_bytes() > 0);
    let snap = w.commit(0).unwrap();
    assert!(read_back(&repo, &snap) == data);
    assert!(repo.checkpoint("t").unwrap().is_none());
}

/// A backup interrupted in a version 1 repository resumes after `ferry repo migrate`
/// replaced its base's manifest (the checkpoint names the old id).
#[test]
fn a_backup_resumes_after_its_base_was_migrated() {
    let store = Arc::new(MemStore::new());
    let o = InitOptions { chunk_size: CS as u32, page_entries: 16, version: 1, ..InitOptions::default() };
    let repo = Arc::new(Repository::init(store.clone(), &o).unwrap());
    let day1 = disk(4 << 20, 40);
    let s1 = backup(&repo, "d", &day1, None);
    let mut day2 = day1.clone();
    day2[..CS].fill(7);
    interrupted(&repo, "d", &day2, Some(s1.clone()), 2 << 20);
    crate::migrate::migrate(&repo, false, &mut |_| {}).unwrap();
    let repo = Arc::new(Repository::open(store.clone(), &|| unreachable!()).unwrap());
    let base = repo.snapshots().unwrap().pop().unwrap();
    assert_eq!(base.manifest.migrated_from.as_deref(), Some(s1.id.as_str()));
    let (snap, done) = resume(&repo, "d", &day2, Some(base));
    assert!(done > 0, "nothing was resumed");
    assert_eq!(read_back(&repo, &snap), day2);
}
