//! Review findings of issue 35's fifth round: verify counts the chunks it did not trace,
//! not their copies; gc checks duplicate copies a window of a pack's blobs at a time, and
//! its new index objects keep the old objects' pack order.
use super::*;
use crate::format::Digest;
use crate::maint::{Held, RANGES_KEPT};

/// Two disks of the same data backed up side by side in a memory store: every chunk
/// stored twice, in different packs ([`super::two_copies`]).
fn two_copies(len: usize) -> (Arc<MemStore>, Arc<Repository>, Vec<u8>, [SnapshotInfo; 2]) {
    let mem = Arc::new(MemStore::new());
    let a = disk(len, 31);
    let (repo, snaps) = super::two_copies(mem.clone(), &a);
    (mem, repo, a, snaps)
}

/// A chunk whose two copies are both damaged is one chunk not traced, not two: verify's
/// note counts distinct chunks (main counted each damaged copy).
#[test]
fn verify_counts_the_chunks_not_traced_not_their_damaged_copies() {
    let (mem, repo, _, _) = two_copies(2 << 20);
    let mut ids = std::collections::HashSet::new();
    let (objects, _) = repo.index_objects().unwrap();
    for (_, ps) in &objects {
        for p in ps {
            let blobs: Vec<(u32, u32)> =
                p.blobs.iter().filter(|b| !b.kind.is_page()).map(|b| (b.offset, b.stored_len)).collect();
            ids.extend(p.blobs.iter().filter(|b| !b.kind.is_page()).map(|b| b.id));
            mem.tamper(&crate::repo::pack_name(&p.pack), |v| {
                for (o, l) in &blobs {
                    v[(*o + *l / 2) as usize] ^= 0x5a;
                }
            });
        }
    }
    // Distinct chunks (the disk repeats none, but has zero chunks, which are not stored).
    let chunks = ids.len();
    assert!(chunks > 16, "{chunks} chunks");
    let copies = repo.load_index().unwrap().more.len();
    assert!(copies * 2 > chunks, "{copies} of {chunks} chunks have a second copy");
    let one = Held { chunks: 1, ranges: RANGES_KEPT };
    let v = maint::verify_held(&repo, &VerifyOptions::all(2), crate::spill::BUDGET, one).unwrap();
    assert!(!v.problems.is_empty());
    let want = format!("{} more damaged or missing chunk(s)", chunks - 1);
    assert!(v.notes.iter().any(|n| n.starts_with(&want)), "{want}: {:?}", v.notes);
}

/// gc's check of duplicate copies reads a pack's blobs from its table a window at a time
/// (main read a pack's whole list, up to 65,536 rows), and still keeps one good copy of
/// each chunk.
#[test]
fn gc_checks_duplicate_copies_a_window_of_blobs_at_a_time() {
    let (_, repo, a, [sa, sb]) = two_copies(2 << 20);
    assert!(repo.load_index().unwrap().more.len() > 20);
    crate::maint::PACK_ROWS_MOST.with(|m| m.set(0));
    let g = maint::gc(&repo, None).unwrap();
    let most = crate::maint::PACK_ROWS_MOST.with(|m| m.get());
    assert!(most > 0 && most <= crate::maint::PACK_BLOCK, "{most} rows read at once");
    assert!(g.packs_deleted > 0, "{g:?}");
    assert!(repo.load_index().unwrap().more.is_empty(), "a blob still has two copies");
    assert!(read_back(&repo, &sa) == a && read_back(&repo, &sb) == a);
    assert!(maint::check(&repo).unwrap().problems.is_empty());
}

/// The packs of index objects gc rewrites are listed by its new objects in the order the
/// old objects listed them, objects in name order (FORMAT.md §9, step 5), not in pack-id
/// order: six backups' small objects merged into one.
#[test]
fn gc_writes_the_rewritten_objects_packs_in_their_old_order() {
    let (_, repo) = new_repo(false);
    let mut snaps = Vec::new();
    for s in 0..6u64 {
        let data = disk(2 * CS, 300 + s);
        snaps.push((backup(&repo, &format!("o{s}"), &data, None), data));
    }
    let packs_of = |objects: &[crate::repo::IndexObject]| -> Vec<Digest> {
        let mut objects: Vec<&crate::repo::IndexObject> = objects.iter().collect();
        objects.sort_by(|x, y| x.0.cmp(&y.0));
        let mut v: Vec<Digest> = Vec::new();
        for p in objects.iter().flat_map(|(_, ps)| ps.iter()) {
            if !v.contains(&p.pack) {
                v.push(p.pack);
            }
        }
        v
    };
    let (before, _) = repo.index_objects().unwrap();
    assert_eq!(before.len(), 6);
    let old = packs_of(&before);
    let mut by_id = old.clone();
    by_id.sort();
    assert_ne!(old, by_id, "the old order is the pack-id order: the test would not tell them apart");
    let g = maint::gc(&repo, None).unwrap();
    assert_eq!((g.index_rewritten, g.index_kept), (6, 0), "{g:?}");
    let (after, _) = repo.index_objects().unwrap();
    assert_eq!(after.len(), 1, "six small objects merged into one");
    assert_eq!(packs_of(&after), old);
    for (snap, data) in &snaps {
        assert_eq!(&read_back(&repo, snap), data);
    }
}

/// A failed page that no kept snapshot lists, where no manifest was hidden by a
/// migration, is named as what it is, not as "a migrated snapshot" (main's words for
/// every such page); one hidden manifest that no longer lists it is named with its
/// migration.
#[test]
fn gc_names_a_failed_page_no_snapshot_lists_without_calling_it_migrated() {
    let (_, repo) = new_repo(false);
    let d = [7u8; 32];
    let e = crate::maint::failed_page_object(&repo, &[], &d);
    assert!(e.contains(&crate::format::hex(&d)) && e.contains("no snapshot or checkpoint lists now"), "{e}");
    assert!(!e.contains("migrat"), "{e}");
    let hidden = [("0a".repeat(32), "0b".repeat(32))];
    let e = crate::maint::failed_page_object(&repo, &hidden, &d);
    let want = format!(
        "snapshots/{} (the manifest from before its migration to snapshot {}), removed since",
        "0a".repeat(32),
        "0b".repeat(32)
    );
    assert!(e.contains(&want), "{e}");
}
