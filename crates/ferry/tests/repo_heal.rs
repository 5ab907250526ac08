//! Damage in a backup repository heals and never spreads (issue 34, items 1, 3 and 4),
//! through the CLI as the review's scripts drove it:
//!
//! * a lost pack: an incremental backup's snapshot (`--extents-from`) restores byte for
//!   byte (it reads the lost chunks again), and after one full backup of the unchanged disk
//!   its newest snapshot restores, in every trial (the index keeps every copy of a chunk,
//!   and readers use any present one);
//! * the only pack lost (the latest snapshot's pages unreadable): a full backup warns and
//!   goes on without the base; a change-map backup refuses and says to run one without;
//! * one damaged manifest (a flipped byte, or zero bytes): restore, list, backup, forget
//!   and hash of the other disks work, each naming it in a warning; asking for it by id is
//!   an error; a change-map backup refuses; check names it once.

use crate::common::json::{Json, JsonExt};
use crate::common::*;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// `ferry ARGS` without any passphrase or log settings from the test's environment.
fn ferry_cmd(args: &[&str]) -> Command {
    let mut c = Command::new(ferry_bin());
    c.args(args).env_remove("FERRY_PASSWORD").env_remove("FERRY_PASSWORD_FILE").env_remove("RUST_LOG");
    c
}

fn ferry(args: &[&str]) -> Output {
    run_ok(&mut ferry_cmd(args))
}

fn ferry_fails(args: &[&str]) -> Output {
    run_fails(&mut ferry_cmd(args))
}

fn init(dir: &Path) -> PathBuf {
    let repo = dir.join("repo");
    ferry(&["repo", "init", s(&repo)]);
    repo
}

/// `ferry backup --json ARGS`: the new snapshot's id.
fn backup(args: &[&str]) -> String {
    let mut a = vec!["backup", "--json"];
    a.extend_from_slice(args);
    let out = ferry(&a);
    Json::must_parse(out.stdout.trim()).at("id").as_str().unwrap().to_string()
}

/// A disk of `mib` MiB: random bytes (incompressible, so chunks fill packs), every 7th
/// MiB a hole.
fn make_disk(path: &Path, mib: usize, seed: u64) -> Vec<u8> {
    let mut rng = Rng::new(seed);
    let mut data = vec![0u8; mib << 20];
    for (i, m) in data.chunks_mut(1 << 20).enumerate() {
        if i % 7 != 3 {
            rng.fill(m);
        }
    }
    fs::write(path, &data).unwrap();
    data
}

/// Rewrites `n` 64 KiB chunks of the disk at `path` (`data`, updated) and writes the
/// nbdinfo-style map of exactly those to `map`.
fn change(path: &Path, data: &mut [u8], seed: u64, n: usize, map: &Path) {
    let mut rng = Rng::new(seed);
    let chunks = data.len() / 65536;
    let mut rows = Vec::new();
    let mut picked: Vec<usize> = (0..n).map(|_| rng.below(chunks as u64) as usize).collect();
    picked.sort();
    picked.dedup();
    for c in picked {
        rng.fill(&mut data[c * 65536..(c + 1) * 65536]);
        rows.push(format!(r#"{{"offset": {}, "length": 65536, "type": 1}}"#, c * 65536));
    }
    fs::write(path, &*data).unwrap();
    fs::write(map, format!("[{}]", rows.join(", "))).unwrap();
}

/// Restores `snap` and checks it is `want`, byte for byte.
fn assert_restores(snap: &str, want: &[u8], out: &Path) {
    let _ = fs::remove_file(out);
    ferry(&["copy", snap, s(out)]);
    let got = fs::read(out).unwrap();
    assert!(got == want, "{snap} does not restore to the disk it was taken from");
}

/// The files under `dir`, recursively, with their sizes.
fn files(dir: &Path) -> Vec<(PathBuf, u64)> {
    let mut out = Vec::new();
    for e in fs::read_dir(dir).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_dir() {
            out.extend(files(&e.path()));
        } else {
            out.push((e.path(), e.metadata().unwrap().len()));
        }
    }
    out
}

#[test]
fn a_lost_pack_heals_with_the_next_backup() {
    // The full backup's snapshot failed to restore in about half the trials when readers
    // used the first copy listed: 4 trials miss that with a chance of 1 in 16.
    for trial in 0..4u64 {
        let dir = tempfile::tempdir().unwrap();
        let repo = init(dir.path());
        let img = dir.path().join("a.raw");
        let mut data = make_disk(&img, 40, 100 + trial);
        let target = format!("{}::a", repo.display());
        let first = backup(&[s(&img), &target]);
        // The largest pack is a full one: data chunks only.
        let (big, _) = files(&repo.join("data")).into_iter().max_by_key(|(_, l)| *l).unwrap();
        fs::remove_file(&big).unwrap();
        let map = dir.path().join("map.json");
        change(&img, &mut data, trial, 4, &map);
        let extents = format!("--extents-from={}", map.display());
        let inc = backup(&[&extents, "--since", &first, s(&img), &target]);
        let out = dir.path().join("out.raw");
        assert_restores(&format!("{target}@{}", &inc[..8]), &data, &out);
        let full = backup(&[s(&img), &target]);
        assert_restores(&format!("{target}@{}", &full[..8]), &data, &out);
        assert_restores(&target, &data, &out);
        // check names the lost pack, and at most the first snapshot as damaged (the old
        // content of the changed chunks is lost with it); without that one, gc drops the
        // lost pack from the index and the repository is whole.
        let c = run(&mut ferry_cmd(&["repo", "check", s(&repo)]));
        assert!(c.stdout.contains("missing"), "{}", c.describe());
        for id in [&inc, &full] {
            assert!(!c.stdout.contains(&format!("snapshot {}", &id[..8])), "{}", c.describe());
        }
        ferry(&["repo", "forget", &target, "--keep-last", "2"]);
        ferry(&["repo", "gc", s(&repo)]);
        let c = ferry(&["repo", "check", s(&repo)]);
        assert!(c.stdout.contains("no damage found"), "{}", c.describe());
    }
}

#[test]
fn an_unreadable_base_stops_only_a_change_map_backup() {
    let dir = tempfile::tempdir().unwrap();
    let repo = init(dir.path());
    let img = dir.path().join("b.raw");
    let mut data = make_disk(&img, 4, 7);
    let target = format!("{}::b", repo.display());
    let first = backup(&[s(&img), &target]);
    for (p, _) in files(&repo.join("data")) {
        fs::remove_file(p).unwrap();
    }
    let map = dir.path().join("map.json");
    change(&img, &mut data, 8, 2, &map);
    let extents = format!("--extents-from={}", map.display());
    let e = ferry_fails(&["backup", &extents, "--since", &first, s(&img), &target]);
    assert!(e.stderr.contains("without the change map") && e.stderr.contains(&first[..8]), "{}", e.describe());
    // A backup that reads everything warns and goes on; its snapshot has no parent.
    let out = ferry(&["backup", "--json", s(&img), &target]);
    assert!(out.stderr.contains("cannot be read") && out.stderr.contains(&first[..8]), "{}", out.describe());
    let doc = Json::must_parse(out.stdout.trim());
    assert!(doc.at("parent").is_null(), "{}", out.describe());
    let second = doc.at("id").as_str().unwrap().to_string();
    assert_restores(&target, &data, &dir.path().join("out.raw"));
    // And the change-map backups work again on top of it.
    change(&img, &mut data, 9, 2, &map);
    backup(&[&extents, "--since", &second, s(&img), &target]);
    assert_restores(&target, &data, &dir.path().join("out.raw"));
}

#[test]
fn one_damaged_manifest_blocks_no_other_disk() {
    for empty in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let repo = init(dir.path());
        let (ia, ib) = (dir.path().join("a.raw"), dir.path().join("b.raw"));
        make_disk(&ia, 2, 1);
        let mut b = make_disk(&ib, 2, 2);
        let (ta, tb) = (format!("{}::a", repo.display()), format!("{}::b", repo.display()));
        let sa = backup(&[s(&ia), &ta]);
        let sb = backup(&[s(&ib), &tb]);
        let object = format!("snapshots/{sa}");
        let path = repo.join(&object);
        let mut bytes = fs::read(&path).unwrap();
        if empty {
            bytes.clear();
        } else {
            bytes[10] ^= 1;
        }
        fs::write(&path, bytes).unwrap();
        let out = dir.path().join("out.raw");
        // Restore b, latest and by id: a warning names the damaged manifest.
        let _ = fs::remove_file(&out);
        let r = ferry(&["copy", &tb, s(&out)]);
        assert!(r.stderr.contains(&object), "{}", r.describe());
        assert!(fs::read(&out).unwrap() == b);
        assert_restores(&format!("{tb}@{}", &sb[..8]), &b, &out);
        let l = ferry(&["repo", "list", s(&repo)]);
        assert!(l.stdout.contains(&sb[..8]) && l.stderr.contains(&object), "{}", l.describe());
        let h = ferry(&["hash", &tb]);
        assert!(!h.stdout.trim().is_empty());
        // The damaged one itself: an error that names it.
        let e = ferry_fails(&["copy", &format!("{ta}@{}", &sa[..8]), s(&out)]);
        assert!(e.stderr.contains(&object), "{}", e.describe());
        // A full backup of b goes on; a change-map one without --since refuses (the damaged
        // manifest may be b's latest snapshot), one that names its base goes on.
        let map = dir.path().join("map.json");
        change(&ib, &mut b, 3, 2, &map);
        let extents = format!("--extents-from={}", map.display());
        let e = ferry_fails(&["backup", &extents, s(&ib), &tb]);
        assert!(e.stderr.contains(&object) && e.stderr.contains("without --extents-from"), "{}", e.describe());
        let sb2 = backup(&[s(&ib), &tb]);
        assert_restores(&tb, &b, &out);
        change(&ib, &mut b, 4, 2, &map);
        let sb3 = backup(&[&extents, "--since", &sb2, s(&ib), &tb]);
        assert_restores(&tb, &b, &out);
        // forget removes what its rule says of the readable ones, and keeps the damaged one.
        let f = ferry(&["repo", "forget", &tb, "--keep-last", "1"]);
        assert!(f.stdout.contains("1 kept, 2 removed"), "{}", f.describe());
        assert!(path.exists(), "forget removed the damaged manifest");
        let l = ferry(&["repo", "list", "--json", s(&repo)]);
        let doc = Json::must_parse(l.stdout.trim());
        let ids: Vec<&str> = doc.as_array().unwrap().iter().map(|s| s.at("id").as_str().unwrap()).collect();
        assert_eq!(ids, vec![sb3.as_str()]);
        // check names it once, and does not send the user back to check.
        let c = run(&mut ferry_cmd(&["repo", "check", s(&repo)]));
        let line = c.stdout.lines().find(|l| l.contains(&object)).unwrap_or_else(|| panic!("{}", c.describe()));
        assert_eq!(line.matches(&object).count(), 1, "{line}");
        assert!(!line.contains("ferry repo check"), "{line}");
    }
}
