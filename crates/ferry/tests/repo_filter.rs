//! The local index cache's filters (issue 35): a cache whose filter files cannot be
//! written (a read-only directory, a full disk) keeps working, and says so once a run,
//! naming the file and what it costs.

use crate::common::*;
use crate::repo_crash::{ferry_cmd, s};
use std::fs;
use std::path::{Path, PathBuf};

/// `len` bytes that no other call makes (no chunk of them is stored twice).
fn random(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut out = Vec::with_capacity(len);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

/// Every file under `dir` whose name starts with `prefix`.
fn named(dir: &Path, prefix: &str) -> Vec<PathBuf> {
    let mut found = Vec::new();
    for e in fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            found.extend(named(&p, prefix));
        } else if e.file_name().to_string_lossy().starts_with(prefix) {
            found.push(p);
        }
    }
    found
}

#[test]
fn a_filter_that_cannot_be_written_is_warned_about_once_and_backups_go_on() {
    let t = tempfile::Builder::new().prefix("ferry-filter").tempdir().unwrap();
    let repo = t.path().join("repo");
    let cache = t.path().join("cache");
    let ferry = |args: &[&str]| {
        let mut c = ferry_cmd(args);
        c.env("FERRY_CACHE_DIR", &cache);
        run_ok(&mut c)
    };
    ferry(&["repo", "init", s(&repo)]);
    // Disks of 8 MiB, 1 MiB and 64 KiB: each backup's index objects become a run of the
    // cache (with its filter) when the next backup opens it, each run over 4 times the
    // size of the next, so none is merged away.
    let backup = |name: &str, bytes: &[u8]| {
        let img = t.path().join(format!("{name}.raw"));
        fs::write(&img, bytes).unwrap();
        ferry(&["backup", s(&img), &format!("{}::{name}", s(&repo))])
    };
    backup("a", &random(8 << 20, 1));
    backup("b", &random(1 << 20, 2));
    backup("c", &random(64 << 10, 3));
    let filters = named(&cache, "filter-");
    assert_eq!(filters.len(), 2, "a filter for the runs of a and b: {filters:?}");
    // A directory in each filter's place: neither read nor replaced, whoever runs this.
    for f in &filters {
        fs::remove_file(f).unwrap();
        fs::create_dir(f).unwrap();
    }
    // Small, as the next: the runs of c and d are merged, those of a and b kept.
    let d = random(64 << 10, 4);
    let out = backup("d", &d);
    let warnings: Vec<&str> = out.stderr.lines().filter(|l| l.contains("cannot be written")).collect();
    assert_eq!(warnings.len(), 1, "one warning a run, not one per filter:\n{}", out.stderr);
    assert!(
        filters.iter().any(|f| warnings[0].contains(s(f))) && warnings[0].contains("slower"),
        "it names the file and what it costs: {}",
        warnings[0]
    );
    let restored = t.path().join("restored.raw");
    ferry(&["copy", &format!("{}::d", s(&repo)), s(&restored)]);
    assert!(fs::read(&restored).unwrap() == d, "the backup made without filters restores");
    // The next run says it again (the filters are still not there).
    let out = backup("e", &random(64 << 10, 5));
    assert_eq!(out.stderr.matches("cannot be written").count(), 1, "{}", out.stderr);
}
