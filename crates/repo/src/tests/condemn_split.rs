//! gc's condemned records split when there are more packs than one record may name, and
//! its removal of temporary files that may be a writer's.
use super::*;
use crate::format::CondemnedRecord;
use crate::maint::GcOptions;
use std::time::Duration;

/// gc condemning more packs than a record may name (a limit made small here) stores
/// several records, each of which parses and reads; a later gc deletes by all of them.
#[test]
fn gc_condemning_more_packs_than_a_record_holds_stores_several_that_parse() {
    for encrypt in [false, true] {
        let (store, repo) = new_repo(encrypt);
        let first = disk(3 << 20, 1);
        backup(&repo, "a", &first, None);
        let second = disk(3 << 20, 99);
        let s2 = backup(&repo, "a", &second, None);
        maint::forget(&repo, Some("a"), &Policy { keep_last: Some(1), ..Policy::default() }, false).unwrap();
        let b = disk(1 << 20, 2);
        let w = SnapshotWriter::start(repo.clone(), opts("b", b.len() as u64, None)).unwrap();
        crate::condemn::RECORD_PACKS.with(|c| c.set(2));
        let gc = || {
            maint::gc_opts(&repo, &GcOptions { wait: None, repack_percent: 10, condemn_margin: Duration::ZERO })
                .unwrap()
        };
        let g1 = gc();
        crate::condemn::RECORD_PACKS.with(|c| c.set(crate::format::MAX_CONDEMNED_PACKS));
        assert!(g1.packs_condemned > 2, "too few packs condemned to split: {g1:?}");
        let records = objects(&store, "gc/condemned/");
        assert_eq!(records.len() as u64, g1.packs_condemned.div_ceil(2), "{records:?} {g1:?}");
        let c = repo.condemned().unwrap();
        assert!(c.unreadable.is_empty(), "{:?}", c.unreadable);
        assert_eq!(c.records.len(), records.len());
        for (name, r) in &c.records {
            assert!(r.packs.len() <= 2 && r.backups.len() == 1, "{name}: {r:?}");
            assert!(CondemnedRecord::parse(&r.to_bytes()).is_ok());
        }
        assert_eq!(c.packs().len() as u64, g1.packs_condemned);
        write_all(&w, &b);
        let sb = w.commit(b.len() as u64).unwrap();
        let g2 = gc();
        assert_eq!(g2.packs_deleted + g2.packs_spared, g1.packs_condemned, "{g2:?}");
        assert!(objects(&store, "gc/condemned/").is_empty());
        assert!(read_back(&repo, &s2) == second && read_back(&repo, &sb) == b);
    }
}

/// A temporary file a writer has just created stays, though no backup ran when gc
/// started (one may start while it runs); one older than an hour goes.
#[test]
fn gc_leaves_a_fresh_temporary_file_alone_when_no_backup_runs() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("r");
    let store: Arc<dyn Store> = Arc::new(crate::store::DirStore::create(&root).unwrap());
    let repo =
        Arc::new(Repository::init(store, &InitOptions { chunk_size: CS as u32, ..InitOptions::default() }).unwrap());
    backup(&repo, "a", &disk(1 << 20, 3), None);
    let fresh = root.join("index/.tmp-00112233aabbccdd");
    let old = root.join("index/.tmp-8899aabbccddeeff");
    std::fs::write(&fresh, b"a pack being written").unwrap();
    std::fs::write(&old, b"half an index").unwrap();
    let f = std::fs::File::options().write(true).open(&old).unwrap();
    f.set_modified(std::time::SystemTime::now() - Duration::from_secs(7200)).unwrap();
    drop(f);
    maint::gc_opts(&repo, &GcOptions { wait: None, repack_percent: 10, condemn_margin: Duration::ZERO }).unwrap();
    assert!(fresh.exists(), "gc removed a fresh temporary file");
    assert!(!old.exists(), "gc left a temporary file two hours old");
}

/// A record removed between the listing and its read condemns nothing and is no
/// unreadable record (no warning for a backup).
#[test]
fn a_record_removed_after_the_listing_is_not_unreadable() {
    let inner = Arc::new(MemStore::new());
    // The listing of `gc/condemned/` removes what it lists just after (as a gc removing
    // its records between another's listing and reads).
    let store = Arc::new(Hooked::new(inner.clone()));
    store.set_hook(Some(Box::new(|s, when, op, prefix| {
        if (when, op, prefix) == (When::After, Op::List, crate::condemn::PREFIX) {
            for (name, _) in s.list(prefix)? {
                s.delete(&name)?;
            }
        }
        Ok(())
    })));
    let repo = Repository::init(store, &InitOptions::default()).unwrap();
    repo.put_condemned(&[[7; 32]], &[]).unwrap();
    assert_eq!(objects(&inner, "gc/condemned/").len(), 1);
    let c = repo.condemned().unwrap();
    assert!(c.records.is_empty() && c.unreadable.is_empty(), "{:?}", c.unreadable);
    assert!(objects(&inner, "gc/condemned/").is_empty());
}
