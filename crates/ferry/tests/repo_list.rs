//! Lists, `info` and names without whole manifests (issue 35, part "list"):
//!
//! * a crafted manifest of the largest disk a manifest may describe (2^24 all-zero pages,
//!   48 MiB of JSON) is listed, shown by `info` and found by an id prefix within 256 MiB
//!   of address space: listing keeps each snapshot's summary, and its pages only as bits
//!   while they are checked (it took 1.2 GB before);
//! * snapshots are listed without their pages, and the commands that use a snapshot's
//!   pages (restore, hash, a backup's base, check, forget and gc) read them again for the
//!   snapshot they use.

use crate::common::json::{Json, JsonExt};
use crate::common::*;
use crate::incremental_backup::s;
use crate::repo_trust::ok;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

/// `ferry ARGS` on `host` with at most `mib` MiB of address space (`prlimit --as`): an
/// allocation past it fails, and ferry aborts.
fn within(host: &Path, mib: u64, args: &[&str]) -> Output {
    require("prlimit");
    let mut c = Command::new("prlimit");
    c.arg(format!("--as={}", mib << 20)).arg(ferry_bin()).args(args);
    c.env("FERRY_STATE_DIR", host).env("MALLOC_ARENA_MAX", "2").env_remove("RUST_LOG");
    run_ok(&mut c)
}

/// Stores `json` as a manifest of the unencrypted repository `repo` (its object is named
/// by its SHA-256, as ferry names it); returns its id.
fn plant(repo: &Path, json: &[u8]) -> String {
    let tmp = repo.join("planted.tmp");
    fs::write(&tmp, json).unwrap();
    let out = run_ok(&mut cmd("sha256sum", [s(&tmp)]));
    let id = out.stdout.split_whitespace().next().unwrap().to_string();
    fs::create_dir_all(repo.join("snapshots")).unwrap();
    fs::rename(&tmp, repo.join("snapshots").join(&id)).unwrap();
    id
}

/// A manifest of disk `name` of `pages` all-zero pages of 256 chunks of 64 KiB.
fn zero_manifest(name: &str, pages: u64) -> Vec<u8> {
    let mut list = "\"\",".repeat(pages as usize);
    list.pop();
    format!(
        r#"{{"version":1,"name":"{name}","time":"2026-11-01T22:00:00Z","size":{},"chunk_size":65536,"page_entries":256,"pages":[{list}],"parent":null,"source":"crafted","changes":{{"kind":"full"}},"blkhash":null}}"#,
        pages * 256 * 65536
    )
    .into_bytes()
}

fn new_repo(d: &Path) -> (PathBuf, PathBuf) {
    let (host, repo) = (d.join("host"), d.join("repo"));
    fs::create_dir(&host).unwrap();
    ok(&host, &["repo", "init", s(&repo)]);
    (host, repo)
}

#[test]
fn a_crafted_manifest_of_the_largest_disk_is_listed_in_bounded_memory() {
    let d = tempfile::tempdir().unwrap();
    let (host, repo) = new_repo(d.path());
    let json = zero_manifest("big", 1 << 24);
    assert!(json.len() > 48 << 20, "{} bytes", json.len());
    let id = plant(&repo, &json);
    let size = ((1u64 << 24) * 256 * 65536).to_string();
    let listed = within(&host, 256, &["repo", "list", "--json", s(&repo)]);
    let v = Json::must_parse(listed.stdout.trim());
    assert!(v.to_string().contains(&id) && v.to_string().contains(&size), "{}", listed.describe());
    let shown = within(&host, 256, &["info", &format!("{}::big", repo.display())]);
    assert!(shown.stdout.contains(&size) && shown.stdout.contains(&id), "{}", shown.describe());
    let named = within(&host, 256, &["info", &format!("{}::big@{}", repo.display(), &id[..8])]);
    assert!(named.stdout.contains(&id), "{}", named.describe());
}

/// A 2 MiB disk of 32 distinct chunks, chunk `i` holding byte `b + i` (0 for a zero chunk).
fn disk(d: &Path, name: &str, b: u8) -> PathBuf {
    let data: Vec<u8> =
        (0..2 * MIB as usize).map(|i| if (i >> 16) % 5 == 4 { 0 } else { b.wrapping_add((i >> 16) as u8) }).collect();
    write_sparse_file(d, name, &data)
}

fn backup(host: &Path, src: &Path, target: &str) -> String {
    let out = ok(host, &["backup", "--json", "--no-bitmap", s(src), target]);
    Json::must_parse(out.stdout.trim()).at("id").as_str().unwrap().to_string()
}

#[test]
fn snapshots_listed_without_pages_restore_hash_and_continue() {
    let d = tempfile::tempdir().unwrap();
    let (host, repo) = new_repo(d.path());
    let target = format!("{}::vm", repo.display());
    let (day1, day2) = (disk(d.path(), "day1.raw", 1), disk(d.path(), "day2.raw", 9));
    let first = backup(&host, &day1, &target);
    let second = backup(&host, &day2, &target);
    // Another disk's snapshot among them.
    let big = plant(&repo, &zero_manifest("big", 1 << 10));
    let listed = ok(&host, &["repo", "list", s(&repo)]);
    for id in [&first, &second, &big] {
        assert!(listed.stdout.contains(&id[..8]), "{}", listed.describe());
    }
    for (id, file) in [(&first, &day1), (&second, &day2)] {
        let spec = format!("{target}@{}", &id[..8]);
        let want = ok(&host, &["hash", s(file)]).stdout;
        assert_eq!(ok(&host, &["hash", &spec]).stdout.split_whitespace().next(), want.split_whitespace().next());
        let out = d.path().join("restored.raw");
        let _ = fs::remove_file(&out);
        ok(&host, &["copy", &spec, s(&out)]);
        assert!(fs::read(&out).unwrap() == fs::read(file).unwrap(), "{spec} does not restore");
    }
    let check = ok(&host, &["repo", "check", s(&repo)]);
    assert!(check.stdout.contains("no damage"), "{}", check.describe());
    // Forget the first; gc keeps what the second uses (its pages read again).
    ok(&host, &["repo", "forget", &target, &first[..8]]);
    ok(&host, &["repo", "gc", s(&repo)]);
    let out = d.path().join("after-gc.raw");
    ok(&host, &["copy", &target, s(&out)]);
    assert!(fs::read(&out).unwrap() == fs::read(&day2).unwrap(), "the latest does not restore after gc");
}
