//! The index cache against the in-memory index it replaces for readers and backups.
use super::*;
use crate::format::{BlobEntry, DamagedPack};
use crate::store::{MemStore, Store};
use crate::InitOptions;
use std::os::unix::fs::PermissionsExt;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn id(n: u64) -> Digest {
    crate::repo::sha256(&n.to_le_bytes())
}

fn new_repo() -> (Arc<MemStore>, Arc<Repository>) {
    let store = Arc::new(MemStore::new());
    let repo = Arc::new(Repository::init(store.clone(), &InitOptions::default()).unwrap());
    (store, repo)
}

/// The repository `store` holds, opened again, with its cache in `dir` (runs written
/// every `build` entries).
fn opened(store: &Arc<MemStore>, dir: &Path, build: usize) -> Arc<Repository> {
    let repo = Repository::open(store.clone(), &|| unreachable!()).unwrap();
    assert!(repo.set_index_cache(Some(Cache { dir: dir.to_path_buf(), private: None, build_entries: build })));
    Arc::new(repo)
}

/// Stores an index object of random packs and blobs: packs from a pool of 6 (so a pack
/// is listed by several objects), each blob at a slot of its pack that always holds the
/// same blob, ids from a pool of `pool` (so a blob has copies in several packs, and the
/// same copy is listed by several objects).
fn random_object(repo: &Repository, rng: &mut Rng, pool: u64) -> String {
    let mut packs = Vec::new();
    let mut used = HashSet::new();
    for _ in 0..1 + rng.below(3) {
        let p = rng.below(6);
        if !used.insert(p) {
            continue;
        }
        let mut slots: Vec<u32> = (0..1 + rng.below(60)).map(|_| rng.below(400) as u32).collect();
        slots.sort_unstable();
        slots.dedup();
        let blobs = slots
            .into_iter()
            .map(|slot| {
                let b = (p * 7919 + slot as u64 * 104_729) % pool;
                BlobEntry {
                    id: id(b),
                    kind: if b.is_multiple_of(7) { BlobKind::Page } else { BlobKind::Data },
                    offset: slot * 1000,
                    stored_len: 100 + (b as u32 % 50),
                    plain_len: 1000 + b as u32,
                }
            })
            .collect();
        packs.push(PackBlobs { pack: id(1_000_000 + p), blobs });
    }
    let (names, _) = repo.put_index_split(&packs, usize::MAX).unwrap();
    assert!(repo.read_index_object(&names[0]).is_ok());
    names.into_iter().next().unwrap()
}

fn sorted(mut v: Vec<Location>) -> Vec<(Digest, u32, u32, u32)> {
    let mut out: Vec<_> = v.drain(..).map(|l| (l.pack, l.offset, l.stored_len, l.plain_len)).collect();
    out.sort();
    out
}

/// Every id of the pool has the same locations through the cache as in memory, and
/// the same answer to `contains` and `contains_each`.
fn same_as_memory(repo: &Arc<Repository>, ix: &RunIndex, pool: u64) {
    let mem = repo.load_index_lenient().unwrap();
    let mut ids: Vec<Digest> = (0..pool + 5).map(id).collect();
    ids.sort();
    for i in &ids {
        let want: Vec<Location> = Index::locations(&mem, i).copied().collect();
        assert_eq!(sorted(ix.locations(i)), sorted(want.clone()), "locations of {}", format::hex(i));
        assert_eq!(ix.contains(i), !want.is_empty());
        if let Some(first) = ix.first(i) {
            assert_eq!(first.kind, want[0].kind);
        }
    }
    let each = ix.contains_each(&ids);
    assert_eq!(each, ids.iter().map(|i| mem.contains(i)).collect::<Vec<_>>());
}

#[test]
fn lookups_equal_the_in_memory_index_through_many_runs_merges_and_deletions() {
    let (store, _) = new_repo();
    let dir = tempfile::tempdir().unwrap();
    // Runs of ~40 entries: every open builds several, and merges them.
    let repo = opened(&store, dir.path(), 40);
    let mut rng = Rng(0x1234_5678_9abc_def1);
    let pool = 300;
    let mut names = Vec::new();
    for round in 0..8 {
        for _ in 0..4 {
            names.push(random_object(&repo, &mut rng, pool));
        }
        if round == 5 {
            // gc rewrote part of the index: those objects are gone.
            for n in names.drain(..).filter(|_| rng.below(10) < 4) {
                store.delete(&n).unwrap();
            }
        }
        let ix = RunIndex::open(&repo).unwrap();
        assert!((1..=MAX_RUNS).contains(&ix.runs()), "{} runs", ix.runs());
        same_as_memory(&repo, &ix, pool);
    }
    // Each index object is covered by one run, once.
    let ix = RunIndex::open(&repo).unwrap();
    let covered: Vec<Digest> = ix.parts.iter().flat_map(|p| p.run.as_ref().unwrap().meta.objects.clone()).collect();
    let listed = store.list("index/").unwrap();
    assert_eq!(covered.len(), covered.iter().collect::<HashSet<_>>().len());
    assert!(covered.len() >= listed.len(), "dead objects are dropped by merges, not before");
    // A warm open reads no index object: they may all go unreadable in the store.
    let before = std::fs::read_to_string(dir.path().join(MANIFEST)).unwrap();
    let again = RunIndex::open(&repo).unwrap();
    assert_eq!(std::fs::read_to_string(dir.path().join(MANIFEST)).unwrap(), before);
    same_as_memory(&repo, &again, pool);
    // Files private.
    for e in std::fs::read_dir(dir.path()).unwrap().flatten() {
        assert_eq!(e.metadata().unwrap().permissions().mode() & 0o777, 0o600, "{:?}", e.file_name());
    }
}

#[test]
fn damaged_copies_come_last_and_backups_see_only_present_good_copies() {
    let (store, _) = new_repo();
    let dir = tempfile::tempdir().unwrap();
    let repo = opened(&store, dir.path(), 1000);
    let (a, b) = (id(1_000_001), id(1_000_002));
    let entry =
        |n: u64, offset: u32| BlobEntry { id: id(n), kind: BlobKind::Data, offset, stored_len: 9, plain_len: 8 };
    let one = |pack, blobs| repo.put_index_split(&[PackBlobs { pack, blobs }], usize::MAX).unwrap();
    one(a, vec![entry(1, 0), entry(2, 10)]);
    one(b, vec![entry(1, 0), entry(3, 10)]);
    repo.put_damage(vec![DamagedPack {
        pack: format::hex(&a),
        why: "flipped".into(),
        blobs: vec![format::hex(&id(1)), format::hex(&id(2))],
    }])
    .unwrap();
    let ix = RunIndex::open(&repo).unwrap();
    let packs = |ix: &RunIndex, n| ix.locations(&id(n)).iter().map(|l| l.pack).collect::<Vec<_>>();
    assert_eq!(packs(&ix, 1), vec![b, a], "the damaged copy after the good one");
    assert_eq!(packs(&ix, 2), vec![a], "the damaged copy as the last resort");
    let backup = ix.without_damaged();
    assert_eq!(packs(&backup, 1), vec![b]);
    assert!(!backup.contains(&id(2)) && backup.contains(&id(3)));
    assert_eq!(backup.contains_each(&[id(1), id(2), id(3)]), vec![true, false, true]);
    // Pack b gone from data/: a backup sees only a's copies (and not the damaged ones).
    let present = ix.clone().only_present([a].into_iter().collect());
    assert_eq!(present.packs_gone(), 1);
    assert_eq!(packs(&present, 1), vec![a]);
    assert!(!present.without_damaged().contains(&id(1)) && !present.contains(&id(3)));
}

fn run_files(dir: &Path) -> Vec<PathBuf> {
    cache_files(dir, "run-")
}

/// The files of the cache whose names start with `prefix`, sorted.
fn cache_files(dir: &Path, prefix: &str) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with(prefix))
        .collect();
    v.sort();
    v
}

fn flip(path: &Path, at: u64) {
    let f = std::fs::OpenOptions::new().read(true).write(true).open(path).unwrap();
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, at).unwrap();
    f.write_all_at(&[b[0] ^ 0x40], at).unwrap();
}

#[test]
fn a_corrupt_block_or_header_is_rebuilt_from_the_store() {
    let (store, _) = new_repo();
    let dir = tempfile::tempdir().unwrap();
    let repo = opened(&store, dir.path(), 100_000);
    let mut rng = Rng(77);
    for _ in 0..12 {
        random_object(&repo, &mut rng, 2000);
    }
    drop(RunIndex::open(&repo).unwrap());
    let files = run_files(dir.path());
    assert_eq!(files.len(), 1);
    let meta = Meta::parse(&File::open(&files[0]).unwrap(), std::fs::metadata(&files[0]).unwrap().len()).unwrap();
    assert!(meta.fence.len() > 2, "several blocks");
    // A byte of an entry of block 1 rots after the run was opened: lookups still answer
    // right (its objects read from the store), and the run is removed to be rebuilt.
    let ix = RunIndex::open(&repo).unwrap();
    flip(&files[0], meta.entries_at() + (BLOCK as u64 + 3) * ENTRY as u64 + 40);
    same_as_memory(&repo, &ix, 2000);
    assert!(!files[0].exists());
    let ix = RunIndex::open(&repo).unwrap();
    assert_eq!(ix.runs(), 1);
    same_as_memory(&repo, &ix, 2000);
    // A flipped header count: the run is discarded when opened, and rebuilt.
    let files = run_files(dir.path());
    flip(&files[0], 17);
    let ix = RunIndex::open(&repo).unwrap();
    assert_eq!(ix.runs(), 1);
    assert!(!files[0].exists());
    same_as_memory(&repo, &ix, 2000);
    // A damaged list of runs: rebuilt.
    std::fs::write(dir.path().join(MANIFEST), b"ferry index cache 1\nkey 00\nrun ../x\n").unwrap();
    let ix = RunIndex::open(&repo).unwrap();
    same_as_memory(&repo, &ix, 2000);
    assert_eq!(run_files(dir.path()).len(), 1, "the stray runs are removed");
}

#[test]
fn two_builders_at_once_build_once() {
    let (store, _) = new_repo();
    let dir = tempfile::tempdir().unwrap();
    let first = opened(&store, dir.path(), 50);
    let mut rng = Rng(99);
    for _ in 0..20 {
        random_object(&first, &mut rng, 500);
    }
    let second = opened(&store, dir.path(), 50);
    let (x, y) = std::thread::scope(|s| {
        let a = s.spawn(|| RunIndex::open(&first).unwrap());
        let b = s.spawn(|| RunIndex::open(&second).unwrap());
        (a.join().unwrap(), b.join().unwrap())
    });
    same_as_memory(&first, &x, 500);
    same_as_memory(&second, &y, 500);
    let ix = RunIndex::open(&first).unwrap();
    let covered: usize = ix.parts.iter().map(|p| p.run.as_ref().unwrap().meta.objects.len()).sum();
    assert_eq!(covered, 20, "each index object in one run");
    assert_eq!(run_files(dir.path()).len(), ix.runs());
}

#[test]
fn merge_plans_keep_runs_few_and_tiered() {
    assert_eq!(merge_plan(&[]), None);
    assert_eq!(merge_plan(&[10]), None);
    assert_eq!(merge_plan(&[100, 10]), None);
    assert_eq!(merge_plan(&[100, 30]), Some(0));
    assert_eq!(merge_plan(&[1000, 10, 10]), Some(1));
    assert_eq!(merge_plan(&[5; 6]), Some(0));
    assert_eq!(merge_plan(&[625, 125, 25, 5, 1]), Some(3), "at most four runs");
}

#[test]
fn only_a_private_directory_holds_a_cache_and_old_ones_are_pruned() {
    let root = tempfile::tempdir().unwrap();
    let id = format::hex(&id(5));
    let open = root.path().join("open");
    std::fs::create_dir(&open).unwrap();
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
    assert!(trusted_dir(&open, &id).unwrap_err().contains("other users may write it"));
    assert!(!open.join(&id).exists());
    let mine = root.path().join("mine");
    let dir = trusted_dir(&mine, &id).unwrap();
    assert_eq!(dir, mine.join(&id).join("index"));
    for d in [&mine, &mine.join(&id), &dir] {
        assert_eq!(std::fs::metadata(d).unwrap().permissions().mode() & 0o777, 0o700);
    }
    // Another repository's directory unused for 31 days goes; one used yesterday stays.
    let (old, recent) = (mine.join(format::hex(&[1; 32])), mine.join(format::hex(&[2; 32])));
    for (d, days) in [(&old, 31), (&recent, 1)] {
        std::fs::create_dir(d).unwrap();
        File::open(d).unwrap().set_modified(SystemTime::now() - Duration::from_secs(days * 86400)).unwrap();
    }
    trusted_dir(&mine, &id).unwrap();
    assert!(!old.exists() && recent.exists());
    // The private fallback is removed with its cache.
    let c = Cache::private().unwrap();
    let p = c.private.clone().unwrap();
    assert!(c.dir.is_dir());
    drop(c);
    assert!(!p.exists());
}

#[test]
fn hostile_run_bytes_are_refused_without_panic() {
    let (store, _) = new_repo();
    let dir = tempfile::tempdir().unwrap();
    let repo = opened(&store, dir.path(), 100_000);
    let mut rng = Rng(3);
    for _ in 0..4 {
        random_object(&repo, &mut rng, 600);
    }
    drop(RunIndex::open(&repo).unwrap());
    let bytes = std::fs::read(&run_files(dir.path())[0]).unwrap();
    let meta = Meta::parse(&bytes[..], bytes.len() as u64).unwrap();
    let mut hits = 0;
    meta.lookup(&bytes[..], &meta.fence[1], &mut BlockCache::default(), |_| hits += 1).unwrap();
    assert!(hits >= 1);
    for cut in [0, 7, HEADER, HEADER + 5, bytes.len() / 2, bytes.len() - 1] {
        fuzz(&bytes[..cut]);
        assert!(Meta::parse(&bytes[..cut], cut as u64).is_err());
    }
    for at in (0..bytes.len()).step_by(97) {
        let mut b = bytes.clone();
        b[at] ^= 0x81;
        fuzz(&b);
    }
    let mut huge = bytes.clone();
    huge[16..20].copy_from_slice(&u32::MAX.to_le_bytes());
    huge[24..32].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(Meta::parse(&huge[..], huge.len() as u64).is_err());
    fuzz(&huge);
}

/// Lookup cost at scale (run by hand: `cargo test --release -p ferry-repo --lib
/// runs::tests::lookup_speed -- --ignored --nocapture`): a million entries in one run,
/// random hits and misses.
#[test]
#[ignore]
fn lookup_speed() {
    let (store, _) = new_repo();
    let dir = tempfile::tempdir().unwrap();
    let repo = opened(&store, dir.path(), BUILD_ENTRIES);
    let n = 1_000_000u64;
    let per_pack = 10_000u64;
    let packs: Vec<PackBlobs> = (0..n / per_pack)
        .map(|p| PackBlobs {
            pack: id(u64::MAX - p),
            blobs: (0..per_pack)
                .map(|i| BlobEntry {
                    id: id(p * per_pack + i),
                    kind: BlobKind::Data,
                    offset: i as u32 * 100,
                    stored_len: 90,
                    plain_len: 65536,
                })
                .collect(),
        })
        .collect();
    repo.put_index_split(&packs, usize::MAX).unwrap();
    drop(packs);
    let t = std::time::Instant::now();
    let ix = RunIndex::open(&repo).unwrap();
    eprintln!("cold open of {n} entries: {:?}", t.elapsed());
    let t = std::time::Instant::now();
    let ix2 = RunIndex::open(&repo).unwrap();
    eprintln!("warm open: {:?} ({} runs)", t.elapsed(), ix2.runs());
    let k = 200_000u64;
    let t = std::time::Instant::now();
    let hits = (0..k).filter(|i| ix.first(&id(i * 4 % n)).is_some()).count();
    let el = t.elapsed();
    assert_eq!(hits as u64, k);
    eprintln!("hits: {:.2} us each", el.as_secs_f64() * 1e6 / k as f64);
    let t = std::time::Instant::now();
    let misses = (0..k).filter(|i| ix.contains(&id(n + i))).count();
    assert_eq!(misses, 0);
    eprintln!("misses: {:.2} us each", t.elapsed().as_secs_f64() * 1e6 / k as f64);
    let mut ids: Vec<Digest> = (0..k).map(|i| id(i * 3)).collect();
    ids.sort();
    let t = std::time::Instant::now();
    assert!(ix.contains_each(&ids).iter().all(|b| *b));
    eprintln!("sorted batch: {:.2} us each", t.elapsed().as_secs_f64() * 1e6 / k as f64);
    // What a backup asks of its new chunks: a sorted batch of ids the index lacks.
    let mut ids: Vec<Digest> = (0..k).map(|i| id(n + i)).collect();
    ids.sort();
    let t = std::time::Instant::now();
    assert!(ix.contains_each(&ids).iter().all(|b| !*b));
    eprintln!("sorted batch of misses: {:.2} us each", t.elapsed().as_secs_f64() * 1e6 / k as f64);
    let mem = repo.load_index_lenient().unwrap();
    let t = std::time::Instant::now();
    let hits = (0..k).filter(|i| BlobLookup::first(&mem, &id(i * 4 % n)).is_some()).count();
    assert_eq!(hits as u64, k);
    eprintln!("in-memory hits: {:.2} us each", t.elapsed().as_secs_f64() * 1e6 / k as f64);
}

/// A listing of index/ older than a run (taken before another process built it) keeps
/// the rows of the objects the run covers and the listing lacks: they may be newer than
/// the listing, and the next process would read them from the store again.
#[test]
fn an_older_listing_keeps_the_run_of_a_newer_object() {
    let (store, repo) = new_repo();
    let dir = tempfile::tempdir().unwrap();
    let mut rng = Rng(7);
    let a = random_object(&repo, &mut rng, 500);
    let old_at = std::time::SystemTime::now();
    let old_listing = store.list("index/").unwrap();
    let b = random_object(&repo, &mut rng, 500);
    let r = opened(&store, dir.path(), 1 << 20);
    let cache = Cache { dir: dir.path().to_path_buf(), private: None, build_entries: 1 << 20 };
    let new_at = std::time::SystemTime::now();
    let new_listing = store.list("index/").unwrap();
    let runs = cache.update(&r, &new_listing, new_at).unwrap().unwrap();
    let covered =
        |runs: &[Run]| runs.iter().flat_map(|r| r.meta.objects.iter().map(|d| format::hex(d))).collect::<Vec<String>>();
    assert!(covered(&runs).iter().any(|o| b.ends_with(o.as_str())));
    drop(runs);
    // The process that listed before b was stored takes the lock now.
    let runs = cache.update(&r, &old_listing, old_at).unwrap().unwrap();
    drop(runs);
    let after = cache.read_manifest(&key_fingerprint(&r));
    assert!(
        covered(&after).iter().any(|o| b.ends_with(o.as_str())),
        "{b} was dropped from the cache by a process with an older listing (a: {a})"
    );
    // A listing begun after the run was written drops what it lacks.
    store.delete(&b).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(250));
    let runs = cache.update(&r, &store.list("index/").unwrap(), std::time::SystemTime::now()).unwrap().unwrap();
    drop(runs);
    let after = cache.read_manifest(&key_fingerprint(&r));
    assert!(covered(&after).iter().all(|o| !b.ends_with(o.as_str())), "{b} was deleted and stays");
}

/// An open that waits for the cache's lock lists index/ after it got it: the objects
/// stored meanwhile are in its index.
#[test]
fn an_open_that_waits_for_the_lock_lists_after() {
    let (store, repo) = new_repo();
    let dir = tempfile::tempdir().unwrap();
    let mut rng = Rng(11);
    random_object(&repo, &mut rng, 500);
    let r = opened(&store, dir.path(), 1 << 20);
    let cache = Cache { dir: dir.path().to_path_buf(), private: None, build_entries: 1 << 20 };
    let held = cache.lock_file().unwrap();
    let opener = {
        let r = r.clone();
        std::thread::spawn(move || RunIndex::open(&r).unwrap())
    };
    std::thread::sleep(std::time::Duration::from_millis(200));
    let b = random_object(&repo, &mut rng, 500);
    drop(held);
    let ix = opener.join().unwrap();
    let covered: Vec<String> =
        ix.parts.iter().flat_map(|p| p.run.as_ref().unwrap().meta.objects.iter().map(|d| format::hex(d))).collect();
    assert!(covered.iter().any(|o| b.ends_with(o.as_str())), "{b}, stored while the open waited, is not in its index");
    assert!(ix.usable.iter().all(|u| u.iter().all(|l| *l)), "a row of a listed object is not live");
}

/// A process that holds the cache's lock for longer than a process waits (one stopped
/// or hung) does not stop others: they use the runs as they are, read only, and read
/// into memory only the index objects stored since (not the whole index).
#[test]
fn a_lock_held_too_long_is_done_without() {
    let (store, repo) = new_repo();
    let dir = tempfile::tempdir().unwrap();
    let mut rng = Rng(13);
    random_object(&repo, &mut rng, 500);
    let r = opened(&store, dir.path(), 1 << 20);
    drop(RunIndex::open(&r).unwrap());
    let cache = Cache { dir: dir.path().to_path_buf(), private: None, build_entries: 1 << 20 };
    let held = cache.lock_file().unwrap();
    let start = std::time::Instant::now();
    let e = cache.update(&r, &store.list("index/").unwrap(), std::time::SystemTime::now()).unwrap().err().unwrap();
    assert_eq!(e.kind(), std::io::ErrorKind::TimedOut, "{e}");
    assert!(start.elapsed() >= LOCK_WAIT && start.elapsed() < LOCK_WAIT * 3, "{:?}", start.elapsed());
    let newer = random_object(&repo, &mut rng, 500);
    let ix = RunIndex::open(&r).unwrap();
    assert_eq!(ix.runs(), 1, "the cache's run was not used while another held its lock");
    let in_memory: Vec<&Index> = ix.parts.iter().filter(|p| p.run.is_none()).filter_map(|p| p.fallback.get()).collect();
    assert_eq!(in_memory.len(), 1);
    let names: Vec<&str> = in_memory[0].objects.iter().map(|o| o.as_str()).collect();
    assert_eq!(names, [newer.as_str()], "only the object stored since is read into memory");
    same_as_memory(&r, &ix, 500);
    drop(held);
}

/// The filter files of the cache (`filter-…`), sorted.
fn filter_files(dir: &Path) -> Vec<PathBuf> {
    cache_files(dir, "filter-")
}

/// Each run's filter says "maybe" for every id the run holds, as written and as read back.
fn filters_hold_their_runs(ix: &RunIndex, dir: &Path) {
    for part in &ix.parts {
        let run = part.run.as_ref().unwrap();
        let f = run.filter().expect("a run of this size has a filter");
        let mut buf = Vec::new();
        for b in 0..run.meta.fence.len() {
            for e in run.meta.read_block(&run.file, b, &mut buf).unwrap().chunks_exact(ENTRY) {
                assert!(f.may_contain(&digest_at(e, 0)), "the filter of {} hides an id it holds", run.name);
            }
        }
        assert_eq!(run.read_filter(dir).unwrap().as_ref(), Some(f), "the filter file of {}", run.name);
        assert_eq!(run.build_filter().unwrap().as_ref(), Some(f));
    }
}

/// Every run has a filter that never says "absent" for an id the run holds, built with
/// the run (new and merged); most other ids are answered by it alone. A filter file that
/// is corrupt, of another run, or missing is not trusted: it is built again from its run,
/// and lookups stay those of the in-memory index throughout.
#[test]
fn each_run_has_a_filter_that_never_hides_an_id_it_holds() {
    let (store, _) = new_repo();
    let dir = tempfile::tempdir().unwrap();
    let repo = opened(&store, dir.path(), 300);
    let mut rng = Rng(91);
    for _ in 0..20 {
        random_object(&repo, &mut rng, 3000);
        drop(RunIndex::open(&repo).unwrap());
    }
    let ix = RunIndex::open(&repo).unwrap();
    assert!(ix.runs() > 1, "merged and new runs");
    assert_eq!(filter_files(dir.path()).len(), ix.runs(), "one filter a run, no stray one");
    filters_hold_their_runs(&ix, dir.path());
    same_as_memory(&repo, &ix, 3000);
    let others = 10_000u64;
    let alone = (0..others).filter(|i| ix.parts.iter().all(|p| !p.run.as_ref().unwrap().may_hold(&id(1 << 40 | i))));
    assert!(alone.count() as u64 > others * 95 / 100, "ids no run holds read the runs' blocks");
    drop(ix);
    // A flipped bit (set or cleared), another run's filter in place of one, none at all.
    type Spoil = fn(&[PathBuf]);
    let spoils: [Spoil; 3] = [
        |f| flip(&f[0], crate::bloom::HEADER as u64 + 5),
        |f| {
            std::fs::copy(&f[1], &f[0]).unwrap();
        },
        |f| std::fs::remove_file(&f[0]).unwrap(),
    ];
    for spoil in spoils {
        let filters = filter_files(dir.path());
        assert!(filters.len() >= 2);
        let kept = std::fs::read(&filters[1]).unwrap();
        spoil(&filters);
        let ix = RunIndex::open(&repo).unwrap();
        filters_hold_their_runs(&ix, dir.path());
        same_as_memory(&repo, &ix, 3000);
        assert_eq!(std::fs::read(&filters[1]).unwrap(), kept, "a good filter is kept as it is");
    }
}

/// A filter is loaded when a backup's view first asks it, not when the cache is opened:
/// restore, serve and hash (lookups of present ids) never hold one.
#[test]
fn filters_are_loaded_only_for_a_backups_lookups() {
    let (store, _) = new_repo();
    let dir = tempfile::tempdir().unwrap();
    let repo = opened(&store, dir.path(), 300);
    let mut rng = Rng(91);
    for _ in 0..20 {
        random_object(&repo, &mut rng, 3000);
        drop(RunIndex::open(&repo).unwrap());
    }
    let loaded = |ix: &RunIndex| ix.parts.iter().filter(|p| p.run.as_ref().unwrap().filter.get().is_some()).count();
    let ix = RunIndex::open(&repo).unwrap();
    assert!(ix.runs() > 1);
    assert_eq!(loaded(&ix), 0, "opening the cache read a filter");
    let ids: Vec<Digest> = (0..3000).map(id).collect();
    let _ = ix.locations_each(&ids);
    let _ = BlobLookup::locations(&ix, &id(1));
    assert_eq!(loaded(&ix), 0, "a lookup outside a backup read a filter");
    same_as_memory(&repo, &ix, 3000);
    let backup = ix.without_damaged();
    let _ = backup.contains_each(&ids);
    assert_eq!(loaded(&backup), backup.runs(), "a backup's lookups use every run's filter");
}

/// The list of runs is taken only whole, of its key, every line after its head a run's
/// name (never a path).
#[test]
fn a_list_of_runs_is_taken_only_whole_and_of_its_key() {
    let (a, b) = (format!("run-{}", "a".repeat(24)), format!("run-{}", "0".repeat(24)));
    let list = format!("{MANIFEST_HEAD}\nkey k1\nrun {a}\nrun {b}\n");
    assert_eq!(listed_runs(&list, "k1"), Listed::Runs(vec![a.as_str(), b.as_str()]));
    assert_eq!(listed_runs(&format!("{MANIFEST_HEAD}\nkey k1\n"), "k1"), Listed::Runs(vec![]));
    assert_eq!(listed_runs(&list, "k2"), Listed::OtherKey);
    assert_eq!(listed_runs("", "k1"), Listed::OtherKey);
    assert_eq!(listed_runs(&list.replacen(MANIFEST_HEAD, "ferry index cache 2", 1), "k1"), Listed::OtherKey);
    for bad in ["run ../../etc/passwd", "run run-abc", "filter-aaaaaaaaaaaaaaaaaaaaaaaa", "", "run  run-x"] {
        assert_eq!(listed_runs(&format!("{list}{bad}\n"), "k1"), Listed::Damaged, "{bad:?}");
    }
    fuzz(list.as_bytes());
}

/// The update after a gc that removed some index objects and stored one reads that one
/// alone (the others are covered), skips the removed ones' entries, and once the removed
/// ones are over a quarter of a run, merges them away.
#[test]
fn an_update_after_a_gc_reads_only_what_it_stored_and_drops_what_it_removed() {
    let (store, repo) = new_repo();
    let dir = tempfile::tempdir().unwrap();
    let mut rng = Rng(0x5eed_1de7);
    let pool = 400;
    let mut names: Vec<String> = (0..12).map(|_| random_object(&repo, &mut rng, pool)).collect();
    let counted = Arc::new(crate::tests::Hooked::new(store.clone()));
    let reads = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let r = reads.clone();
    counted.set_hook(Some(Box::new(move |_, when, op, name| {
        if (when, op) == (crate::tests::When::Before, crate::tests::Op::Get) && name.starts_with("index/") {
            r.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        Ok(())
    })));
    let repo = Repository::open(counted, &|| unreachable!()).unwrap();
    assert!(repo.set_index_cache(Some(Cache { dir: dir.path().to_path_buf(), private: None, build_entries: 1 << 20 })));
    let repo = Arc::new(repo);
    drop(RunIndex::open(&repo).unwrap());
    assert_eq!(reads.swap(0, std::sync::atomic::Ordering::Relaxed), 12);
    // gc: four objects rewritten into one.
    std::thread::sleep(std::time::Duration::from_millis(250));
    for n in names.drain(..4) {
        store.delete(&n).unwrap();
    }
    names.push(random_object(&repo, &mut rng, pool));
    reads.store(0, std::sync::atomic::Ordering::Relaxed); // random_object reads it back
    let ix = RunIndex::open(&repo).unwrap();
    assert_eq!(reads.load(std::sync::atomic::Ordering::Relaxed), 1, "the update read more than the new object");
    same_as_memory(&repo, &ix, pool);
    // A third of the entries were dead: the run holding them was merged without them.
    let covered: HashSet<String> = ix
        .parts
        .iter()
        .flat_map(|p| p.run.as_ref().unwrap().meta.objects.iter().map(|d| format!("index/{}", format::hex(d))))
        .collect();
    assert_eq!(covered, names.iter().cloned().collect::<HashSet<_>>());
}
