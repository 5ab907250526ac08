//! The local index cache (issue 35): backups, restores and `hash` look blobs up in sorted
//! run files under `FERRY_CACHE_DIR` instead of loading the whole index into memory, and
//! the cache never changes what they do:
//!
//! * restores and backups stay byte-exact after gc rewrote the index (the cache is stale:
//!   its runs name index objects that are gone);
//! * a corrupted run (a block or its header) is discarded and rebuilt, the restore exact;
//! * a cache directory that other users may write is not used (a private temporary one
//!   is, and removed);
//! * deleting the cache changes nothing: the next backup deduplicates as before.

use crate::common::json::{Json, JsonExt};
use crate::common::*;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// `ferry ARGS` with its index cache in `cache` and its temporary files in `tmp`.
fn ferry_in(cache: &Path, tmp: &Path, args: &[&str]) -> Output {
    fs::create_dir_all(tmp).unwrap();
    let mut c = Command::new(ferry_bin());
    c.args(args)
        .env_remove("FERRY_PASSWORD")
        .env_remove("FERRY_PASSWORD_FILE")
        .env_remove("RUST_LOG")
        .env("FERRY_CACHE_DIR", cache)
        .env("TMPDIR", tmp);
    run_ok(&mut c)
}

struct Setup {
    _dir: tempfile::TempDir,
    root: PathBuf,
    cache: PathBuf,
    repo: PathBuf,
    img: PathBuf,
    data: Vec<u8>,
}

impl Setup {
    /// A repository and a disk of `mib` MiB of random bytes.
    fn new(mib: usize) -> Setup {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().to_path_buf();
        let mut data = vec![0u8; mib << 20];
        Rng::new(35).fill(&mut data);
        let img = root.join("disk.raw");
        fs::write(&img, &data).unwrap();
        let st = Setup { cache: root.join("cache"), repo: root.join("repo"), img, data, root, _dir: dir };
        // Version 2: its restores read the index through the cache, which these tests
        // watch (a version 3 restore reads none: tests/repo_located.rs).
        st.ferry(&["repo", "init", "--format-version", "2", s(&st.repo)]);
        st
    }

    fn ferry(&self, args: &[&str]) -> Output {
        ferry_in(&self.cache, &self.root.join("tmp"), args)
    }

    fn target(&self) -> String {
        format!("{}::d", s(&self.repo))
    }

    /// Backs the disk up; the new chunks it stored.
    fn backup(&self) -> u64 {
        let out = self.ferry(&["backup", "--json", s(&self.img), &self.target()]);
        Json::must_parse(out.stdout.trim()).at("new_chunks").as_u64().unwrap()
    }

    /// Restores the latest snapshot and checks it byte for byte, and its hash; the
    /// restore's output.
    fn assert_restores(&self) -> Output {
        let out = self.root.join("out.raw");
        let _ = fs::remove_file(&out);
        let o = self.ferry(&["copy", &self.target(), s(&out)]);
        assert!(fs::read(&out).unwrap() == self.data, "the restore differs: {}", o.describe());
        let hash = |what: &str| self.ferry(&["hash", what]).stdout.split_whitespace().next().unwrap().to_string();
        assert_eq!(hash(&self.target()), hash(s(&self.img)));
        o
    }

    /// Changes `n` chunks of the disk.
    fn change(&mut self, seed: u64, n: usize) {
        let mut rng = Rng::new(seed);
        let chunks = self.data.len() / 65536;
        for _ in 0..n {
            let c = rng.below(chunks as u64) as usize;
            rng.fill(&mut self.data[c * 65536..(c + 1) * 65536]);
        }
        fs::write(&self.img, &self.data).unwrap();
    }

    /// The cache's run files.
    fn runs(&self) -> Vec<PathBuf> {
        let mut out = Vec::new();
        let mut dirs = vec![self.cache.clone()];
        while let Some(d) = dirs.pop() {
            for e in fs::read_dir(&d).into_iter().flatten().flatten() {
                let p = e.path();
                if p.is_dir() {
                    dirs.push(p);
                } else if p.file_name().unwrap().to_string_lossy().starts_with("run-") {
                    out.push(p);
                }
            }
        }
        out.sort();
        out
    }

    fn index_objects(&self) -> Vec<String> {
        let mut v: Vec<String> = fs::read_dir(self.repo.join("index"))
            .unwrap()
            .flatten()
            .map(|e| e.file_name().into_string().unwrap())
            .collect();
        v.sort();
        v
    }
}

fn flip(path: &Path, at: u64) {
    use std::os::unix::fs::FileExt;
    let f = fs::OpenOptions::new().read(true).write(true).open(path).unwrap();
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, at).unwrap();
    f.write_all_at(&[b[0] ^ 0x10], at).unwrap();
}

#[test]
fn backups_and_restores_stay_exact_after_gc_rewrote_the_index() {
    let mut st = Setup::new(4);
    st.backup();
    st.assert_restores();
    assert!(!st.runs().is_empty(), "the restore keeps the index in the cache");
    st.change(1, 40);
    st.backup();
    st.assert_restores();
    let before = st.index_objects();
    st.ferry(&["repo", "forget", &st.target(), "--keep-last", "1"]);
    st.ferry(&["repo", "gc", s(&st.repo)]);
    let after = st.index_objects();
    assert!(before.iter().any(|o| !after.contains(o)), "gc rewrote the index: {before:?} {after:?}");
    // The runs name index objects that are gone: their entries are skipped.
    st.assert_restores();
    assert_eq!(st.backup(), 0, "an unchanged disk stores nothing new");
    st.change(2, 8);
    assert!(st.backup() > 0);
    st.assert_restores();
    let c = st.ferry(&["repo", "check", s(&st.repo)]);
    assert!(c.stdout.contains("no damage found"), "{}", c.describe());
}

#[test]
fn a_corrupted_cache_is_rebuilt_and_the_restore_is_exact() {
    let st = Setup::new(3);
    st.backup();
    st.assert_restores();
    // A flipped byte in a block of entries: found when it is read.
    let runs = st.runs();
    assert_eq!(runs.len(), 1);
    let len = fs::metadata(&runs[0]).unwrap().len();
    flip(&runs[0], len / 2);
    let o = st.assert_restores();
    assert!(o.stderr.contains("is discarded"), "{}", o.describe());
    let rebuilt = st.runs();
    assert!(rebuilt.len() == 1 && rebuilt != runs, "{rebuilt:?}");
    // A flipped count in a header: found when it is opened.
    flip(&rebuilt[0], 20);
    let o = st.assert_restores();
    assert!(o.stderr.contains("is discarded"), "{}", o.describe());
    assert_eq!(st.backup(), 0, "the rebuilt cache deduplicates as before");
    // The list of runs damaged: built again.
    let list = rebuilt[0].parent().unwrap().join("runs");
    fs::write(&list, b"garbage").unwrap();
    st.assert_restores();
    assert!(fs::read_to_string(&list).unwrap().starts_with("ferry index cache"));
}

#[test]
fn a_cache_directory_writable_by_others_is_not_used() {
    let st = Setup::new(2);
    fs::create_dir(&st.cache).unwrap();
    fs::set_permissions(&st.cache, fs::Permissions::from_mode(0o777)).unwrap();
    let before = st.backup();
    assert!(before > 0);
    let o = st.assert_restores();
    assert!(o.stderr.contains("is not used") && o.stderr.contains("other users may write it"), "{}", o.describe());
    assert!(fs::read_dir(&st.cache).unwrap().next().is_none(), "nothing is written there");
    // The private directory used instead is removed.
    assert!(fs::read_dir(st.root.join("tmp")).unwrap().next().is_none(), "no temporary directory is left");
    assert_eq!(st.backup(), 0);
}

#[test]
fn deleting_the_cache_changes_nothing() {
    let mut st = Setup::new(2);
    st.backup();
    st.assert_restores();
    assert!(!st.runs().is_empty());
    fs::remove_dir_all(&st.cache).unwrap();
    assert_eq!(st.backup(), 0, "the index is read again: nothing is stored twice");
    st.assert_restores();
    fs::remove_dir_all(&st.cache).unwrap();
    st.change(3, 4);
    let added = st.backup();
    assert!((1..=4).contains(&added), "{added}");
    fs::remove_dir_all(&st.cache).unwrap();
    st.assert_restores();
}
