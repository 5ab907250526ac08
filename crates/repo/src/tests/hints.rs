//! Location hints (FORMAT.md §7c): the places a backup names for the chunks of its base,
//! and what check says of hints gone stale.
use super::*;
use crate::format::{BlobAt, Digest};
use crate::runs::RunIndex;

/// Each entry of `snap`'s located pages, with its hint.
fn hints(repo: &Arc<Repository>, snap: &SnapshotInfo) -> Vec<(Digest, Option<BlobAt>)> {
    let index = RunIndex::open(repo).unwrap();
    let mut out = Vec::new();
    repo.each_located_page(&index, snap, |_, page| {
        out.extend(page.entries.iter().enumerate().map(|(i, e)| (*e, page.at(i))));
        Ok(())
    })
    .unwrap();
    out
}

/// Two disks of the same data backed up side by side (in an encrypted repository, so that
/// their packs differ): each stores its own copy of every chunk.
fn twins(data: &[u8]) -> (Arc<MemStore>, Arc<Repository>, SnapshotInfo, SnapshotInfo) {
    let (store, repo) = new_repo(true);
    let len = data.len() as u64;
    let wx = SnapshotWriter::start(repo.clone(), opts("x", len, None)).unwrap();
    let wy = SnapshotWriter::start(repo.clone(), opts("y", len, None)).unwrap();
    write_all(&wx, data);
    write_all(&wy, data);
    let x = wx.commit(len).unwrap();
    let y = wy.commit(len).unwrap();
    (store, repo, x, y)
}

/// A full backup reads every chunk again: where one has the base's content, the base's
/// hint is kept (not the index's first copy), so an unchanged page is the base's page.
#[test]
fn a_full_backup_of_unchanged_data_keeps_its_bases_pages() {
    let data = disk(1 << 20, 11);
    let (_store, repo, x1, y1) = twins(&data);
    assert_ne!(hints(&repo, &x1), hints(&repo, &y1), "each disk hints at its own copy");
    for base in [x1, y1] {
        let again = backup(&repo, &base.manifest.name, &data, Some(base.clone()));
        assert_eq!(hints(&repo, &again), hints(&repo, &base), "{}", base.manifest.name);
        let pages = |s: &SnapshotInfo| repo.pages(s).unwrap().iter().collect::<Vec<_>>();
        assert_eq!(pages(&again), pages(&base), "the unchanged pages of {} are its base's", base.manifest.name);
        assert_eq!(read_back(&repo, &again), data);
    }
}

/// A base hint at a copy that verify recorded damaged is not named again: the new page
/// names a good copy.
#[test]
fn a_base_hint_at_a_copy_recorded_damaged_is_dropped() {
    let data = disk(1 << 20, 12);
    let (store, repo, x1, _y1) = twins(&data);
    let (entry, at) = hints(&repo, &x1).into_iter().find_map(|(e, h)| Some((e, h?))).unwrap();
    store.tamper(&crate::repo::pack_name(&at.pack), |v| v[at.offset as usize + 8] ^= 1);
    let r = maint::verify(&repo, &VerifyOptions::all(2)).unwrap();
    assert!(!r.problems.is_empty(), "verify found no damage");
    let x2 = backup(&repo, "x", &data, Some(x1.clone()));
    let named: Vec<Option<BlobAt>> =
        hints(&repo, &x2).into_iter().filter(|(e, _)| *e == entry).map(|(_, h)| h).collect();
    assert!(!named.is_empty());
    assert!(named.iter().all(|h| h.is_some() && *h != Some(at)), "the damaged copy is named again: {named:?}");
    assert_eq!(read_back(&repo, &x2), data);
}

/// check says how many hints went stale (a gc dropped the copies they name), as a note,
/// not as damage.
#[test]
fn check_counts_stale_hints_as_a_note() {
    let data = disk(1 << 20, 13);
    let (_store, repo, _x1, _y1) = twins(&data);
    let r = maint::check(&repo).unwrap();
    assert!(r.problems.is_empty() && !r.notes.iter().any(|n| n.contains("hint")), "{:?}", r.notes);
    // gc keeps one copy of each chunk: the other disk's hints now name dropped copies.
    maint::gc_opts(
        &repo,
        &maint::GcOptions { wait: None, repack_percent: 10, condemn_margin: std::time::Duration::ZERO },
    )
    .unwrap();
    let r = maint::check(&repo).unwrap();
    assert!(r.problems.is_empty(), "{:?}", r.problems);
    let note = r.notes.iter().find(|n| n.contains("hint")).unwrap_or_else(|| panic!("no note: {:?}", r.notes));
    let n: u64 = note.split(' ').next().unwrap().parse().unwrap();
    let nonzero = data.chunks(CS).filter(|c| !ferry_hash::is_zero(c)).count() as u64;
    assert!(n > 0 && n <= nonzero, "{note}");
    assert!(note.contains("next backup"), "{note}");
}
