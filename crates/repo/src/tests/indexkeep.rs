//! gc keeps the index objects whose packs it leaves as they are (FORMAT.md §9, step 5),
//! so that the local index cache of every host takes in only what gc wrote.
use super::*;
use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};

fn index_names(store: &MemStore) -> HashSet<String> {
    objects(store, "index/").into_iter().map(|(n, _)| n).collect()
}

/// A repository over a [`Hooked`] store that counts the reads of index objects, with a
/// private index cache.
struct Keep {
    inner: Arc<MemStore>,
    store: Arc<Hooked>,
    repo: Arc<Repository>,
    index_reads: Arc<AtomicU64>,
    /// Every snapshot that stays, with its bytes.
    snaps: Vec<(SnapshotInfo, Vec<u8>)>,
    /// The index objects of the backups whose packs gc leaves alone.
    untouched: HashSet<String>,
    /// The index object(s) of the snapshot that is forgotten.
    forgotten: HashSet<String>,
}

/// Disk `a` backed up, then again with most of its chunks changed, and its first snapshot
/// forgotten (its packs partly or wholly unused); disks `b` to `e` backed up once each.
/// Every backup stores its own index object.
fn keep_setup(encrypt: bool) -> Keep {
    let inner = Arc::new(MemStore::new());
    let store = Arc::new(Hooked::new(inner.clone()));
    let index_reads = Arc::new(AtomicU64::new(0));
    let reads = index_reads.clone();
    store.set_hook(Some(Box::new(move |_, when, op, name| {
        if (when, op) == (When::Before, Op::Get) && name.starts_with("index/") {
            reads.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    })));
    let repo = Arc::new(Repository::init(store.clone(), &init_opts(encrypt)).unwrap());
    assert!(repo.set_index_cache(crate::runs::Cache::private()));
    let mut seen = index_names(&inner);
    let mut new_objects = |inner: &MemStore| {
        let now = index_names(inner);
        let new: HashSet<String> = now.difference(&seen).cloned().collect();
        seen = now;
        assert!(!new.is_empty(), "a backup stored no index object");
        new
    };
    let a1 = disk(2 << 20, 70);
    let s1 = backup(&repo, "a", &a1, None);
    let forgotten = new_objects(&inner);
    let mut a2 = a1.clone();
    for (i, c) in a2.chunks_mut(CS).enumerate().skip(2).take(20) {
        c.fill(i as u8 + 1);
        c[..8].copy_from_slice(&(i as u64 + 7000).to_le_bytes());
    }
    let s2 = backup(&repo, "a", &a2, Some(s1.clone()));
    let mut untouched = new_objects(&inner);
    let mut snaps = vec![(s2, a2)];
    for (k, name) in ["b", "c", "d", "e"].into_iter().enumerate() {
        let data = disk(2 << 20, 71 + k as u64);
        snaps.push((backup(&repo, name, &data, None), data));
        untouched.extend(new_objects(&inner));
    }
    maint::forget_ids(&repo, None, std::slice::from_ref(&s1.id), false, None).unwrap();
    Keep { inner, store, repo, index_reads, snaps, untouched, forgotten }
}

fn all_read_back(k: &Keep, what: &str) {
    for (s, data) in &k.snaps {
        assert!(read_back(&k.repo, s) == *data, "{what}: {} does not read back", s.manifest.name);
    }
}

/// A gc that repacks the packs of one snapshot among many keeps the other backups' index
/// objects under their names, removes only the forgotten one's, and a host's index cache
/// then reads only the objects gc stored; every snapshot reads back byte for byte.
#[test]
fn gc_keeps_the_index_objects_of_untouched_packs() {
    for encrypt in [false, true] {
        let k = keep_setup(encrypt);
        // A warm cache: it covers every index object.
        drop(crate::runs::RunIndex::open(&k.repo).unwrap());
        let before = index_names(&k.inner);
        let g = maint::gc_with(&k.repo, None, 0).unwrap();
        assert!(g.packs_repacked >= 1, "encrypt {encrypt}: {g:?}");
        let after = index_names(&k.inner);
        assert!(
            k.untouched.is_subset(&after),
            "encrypt {encrypt}: gc removed {:?} of the untouched index objects",
            k.untouched.difference(&after).collect::<Vec<_>>()
        );
        assert!(k.forgotten.is_disjoint(&after), "encrypt {encrypt}: the forgotten snapshot's object stays");
        assert_eq!(g.index_kept as usize, k.untouched.len(), "encrypt {encrypt}: {g:?}");
        let stored: HashSet<&String> = after.difference(&before).collect();
        assert!(!stored.is_empty() && stored.len() < after.len(), "encrypt {encrypt}: {stored:?}");
        // The cache takes in only what gc stored.
        k.index_reads.store(0, Ordering::Relaxed);
        drop(crate::runs::RunIndex::open(&k.repo).unwrap());
        assert_eq!(k.index_reads.load(Ordering::Relaxed), stored.len() as u64, "encrypt {encrypt}");
        all_read_back(&k, "after gc");
        let r = maint::check(&k.repo).unwrap();
        assert!(r.problems.is_empty(), "encrypt {encrypt}: {:?}", r.problems);
        // Later gcs keep them too, and one with nothing left to do changes nothing.
        maint::gc(&k.repo, None).unwrap();
        let settled = index_names(&k.inner);
        assert!(k.untouched.is_subset(&settled), "encrypt {encrypt}");
        let g = maint::gc(&k.repo, None).unwrap();
        assert_eq!(index_names(&k.inner), settled, "encrypt {encrypt}: {g:?}");
        assert_eq!(g.index_rewritten, 0);
        all_read_back(&k, "after three gcs");
    }
}

/// Small index objects (one a backup) are merged when gc rewrites any object, so that
/// their number does not only grow; large ones whose packs stay are kept.
#[test]
fn gc_merges_small_index_objects_and_keeps_large_ones() {
    let (store, repo) = new_repo(false);
    let big = disk(2 << 20, 80);
    let sb = backup(&repo, "big", &big, None);
    let large = index_names(&store);
    let mut small = Vec::new();
    for k in 0..3u64 {
        // Chunk 0 zero, chunk 1 random: one data blob and one page.
        let d = disk(2 * CS, 81 + k);
        small.push((backup(&repo, &format!("s{k}"), &d, None), d));
    }
    let before = index_names(&store);
    assert_eq!(before.len(), large.len() + 3);
    let g = maint::gc(&repo, None).unwrap();
    let after = index_names(&store);
    assert!(large.is_subset(&after), "{g:?}");
    assert_eq!(after.len(), large.len() + 1, "the small objects are merged into one: {g:?}");
    assert_eq!((g.index_kept, g.index_rewritten), (large.len() as u64, 3));
    // One small object alone is not rewritten again.
    let g = maint::gc(&repo, None).unwrap();
    assert_eq!(index_names(&store), after, "{g:?}");
    assert!(read_back(&repo, &sb) == big);
    for (s, d) in &small {
        assert!(read_back(&repo, s) == *d);
    }
}

/// gc stopped at each of its writes, where it keeps most index objects: the repository
/// stays whole, every snapshot reads back, and the next gc finishes and keeps the
/// untouched objects still.
#[test]
fn a_gc_that_keeps_index_objects_stopped_at_any_step_leaves_a_whole_repository() {
    for (put, delete) in GC_STOPS {
        let k = keep_setup(false);
        let what = format!("{put:?} {delete:?}");
        *k.store.fail_put.lock().unwrap() = put;
        *k.store.fail_delete.lock().unwrap() = delete;
        assert!(maint::gc_with(&k.repo, None, 0).is_err(), "gc did not stop at {what}");
        *k.store.fail_put.lock().unwrap() = None;
        *k.store.fail_delete.lock().unwrap() = None;
        let r = maint::check(&k.repo).unwrap();
        assert!(r.problems.is_empty(), "{what}: {:?}", r.problems);
        all_read_back(&k, &what);
        maint::gc_with(&k.repo, None, 0).unwrap();
        assert!(k.untouched.is_subset(&index_names(&k.inner)), "{what}");
        let r = maint::verify(&k.repo, &VerifyOptions::all(2)).unwrap();
        assert!(r.problems.is_empty() && r.notes.iter().all(|n| !n.contains("in no index")), "{what}: {r:?}");
        all_read_back(&k, &what);
    }
}
