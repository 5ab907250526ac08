//! `ferry repo copy` (issue 37, offsite copies): directory to directory between keys and
//! chunk sizes, directory to S3 (moto) and back, a second copy that sends nothing, a
//! day-2 copy that sends what changed, a copy killed with SIGKILL and run again, a
//! damaged source snapshot. Every copy restores byte for byte, its `ferry hash` (blkhash)
//! is the source's, and `repo check` of each destination is clean.

use crate::common::json::{Json, JsonExt};
use crate::common::*;
use crate::remote_images::{make_bucket, s3ferry};
use crate::repo_crash::{ferry_cmd, s};
use crate::repo_resume::checkpoints;
use ferry_testsupport::moto::moto;
use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

/// A command for the repositories of a test (with the passphrase it needs, if any).
type Mk<'a> = dyn Fn(&[&str]) -> Command + 'a;

fn plain(args: &[&str]) -> Command {
    ferry_cmd(args)
}

/// `ferry repo copy ... --json`, which must succeed: its report.
fn copy_json(mk: &Mk<'_>, args: &[&str]) -> Json {
    let mut a = vec!["repo", "copy", "--json"];
    a.extend_from_slice(args);
    let out = run_ok(&mut mk(&a));
    Json::must_parse(&out.stdout)
}

/// The first field of `ferry hash SRC`.
fn hash(mk: &Mk<'_>, src: &str) -> String {
    let out = run_ok(&mut mk(&["hash", src]));
    out.stdout.split_whitespace().next().unwrap().to_string()
}

/// Every snapshot of `repo` restores to `want[its copied_from's snapshot or its id]`,
/// and hashes as the source snapshot does (`hashes`, by source id).
fn assert_copies(mk: &Mk<'_>, repo: &str, want: &[(String, Vec<u8>, String)], d: &Path) {
    let list = Json::must_parse(&run_ok(&mut mk(&["repo", "list", "--json", repo])).stdout);
    let list = list.as_array().unwrap();
    assert_eq!(list.len(), want.len(), "{list:?}");
    for snap in list {
        let from = snap.at("copied_from").at("snapshot").as_str().unwrap();
        let (_, data, hash_want) = want.iter().find(|w| w.0 == from).unwrap_or_else(|| panic!("{snap}"));
        let (name, id) = (snap.at("name").as_str().unwrap(), snap.at("id").as_str().unwrap());
        let spec = format!("{repo}::{name}@{id}");
        let out = d.join(format!("restored-{}.raw", &id[..8]));
        run_ok(&mut mk(&["copy", &spec, s(&out)]));
        assert_file_eq(&out, data);
        fs::remove_file(&out).unwrap();
        assert_eq!(&hash(mk, &spec), hash_want, "{spec}");
    }
    let check = run_ok(&mut mk(&["repo", "check", repo]));
    assert!(check.stdout.contains("no damage"), "{}", check.describe());
}

/// Two snapshots of `vm` (the second with 1 MiB changed) and one of `other` in `repo`:
/// (source id, content, `ferry hash` of the snapshot) each.
fn fill(mk: &Mk<'_>, repo: &str, d: &Path) -> Vec<(String, Vec<u8>, String)> {
    let mut out = Vec::new();
    let mut vm = data_with_holes(8 * MIB as usize, 37);
    let mut backup = |name: &str, data: &[u8], file: &str| {
        let img = write_sparse_file(d, file, data);
        let t = format!("{repo}::{name}");
        let j = Json::must_parse(run_ok(&mut mk(&["backup", "--json", s(&img), &t])).stdout.trim());
        let id = j.at("id").as_str().unwrap().to_string();
        let h = hash(mk, &format!("{t}@{id}"));
        assert_eq!(h, hash(mk, s(&img)), "the snapshot's blkhash is its image's");
        out.push((id, data.to_vec(), h));
    };
    backup("vm", &vm, "vm1.raw");
    Rng::new(38).fill(&mut vm[3 * MIB as usize..4 * MIB as usize]);
    backup("vm", &vm, "vm2.raw");
    backup("other", &data_with_holes(2 * MIB as usize + 12345, 39), "other.raw");
    out
}

fn copied(j: &Json) -> usize {
    j.array_at("copied").len()
}

#[test]
fn directory_copies_between_keys_and_chunk_sizes_restore_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (r1, r2, r3) = (d.join("r1"), d.join("r2"), d.join("r3"));
    let pw = d.join("pw");
    fs::write(&pw, "a key of the offsite copy\n").unwrap();
    run_ok(&mut plain(&["repo", "init", s(&r1)]));
    run_ok(&mut plain(&["repo", "init", "--encrypt", "--kdf-memory", "8M", "--password-file", s(&pw), s(&r2)]));
    run_ok(&mut plain(&["repo", "init", "--chunk-size", "16K", s(&r3)]));
    let want = fill(&plain, s(&r1), d);
    let (vm1, vm2) = (&want[0].0, &want[1].0);

    // One snapshot first (REPO::NAME@ID), then the disk: the day-2 copy sends what changed.
    let one = copy_json(&plain, &[&format!("{}::vm@{}", s(&r1), &vm1[..8]), s(&r2), "--to-password-file", s(&pw)]);
    assert_eq!(copied(&one), 1, "{one}");
    let day2 = copy_json(&plain, &[&format!("{}::vm", s(&r1)), s(&r2), "--to-password-file", s(&pw)]);
    assert_eq!((copied(&day2), day2.array_at("skipped").len()), (1, 1), "{day2}");
    let c = &day2.array_at("copied")[0];
    assert_eq!(c.at("source_id").as_str(), Some(vm2.as_str()), "{day2}");
    assert_eq!(c.at("parent").as_str(), one.array_at("copied")[0].at("id").as_str(), "{day2}");
    // 1 MiB changed: 16 chunks of 64 KiB, and the pages that list them.
    assert!(c.u64_at("chunks_sent") <= 16 && c.u64_at("bytes_read") <= MIB, "{day2}");
    // Everything: only `other` is left to copy; then nothing at all.
    let all = copy_json(&plain, &[s(&r1), s(&r2), "--to-password-file", s(&pw)]);
    assert_eq!((copied(&all), all.array_at("skipped").len()), (1, 2), "{all}");
    let list = run_ok(&mut plain(&["repo", "list", s(&r2), "--password-file", s(&pw)]));
    assert!(list.stdout.contains(&format!("copy of {}", &vm1[..8])), "{}", list.describe());
    let again = copy_json(&plain, &[s(&r1), s(&r2), "--to-password-file", s(&pw)]);
    assert_eq!((copied(&again), again.u64_at("chunks_sent"), again.u64_at("bytes_sent")), (0, 0, 0), "{again}");
    assert_eq!(again.u64_at("bytes_read"), 0, "{again}");
    let with_key = |args: &[&str]| {
        let mut c = plain(args);
        c.env("FERRY_PASSWORD_FILE", &pw);
        c
    };
    assert_copies(&with_key, s(&r2), &want, d);
    // Without the destination's passphrase: refused, saying how to give it.
    let out = run_fails(&mut plain(&["repo", "copy", s(&r1), s(&r2)]));
    assert!(out.stderr.contains("--to-password-file"), "{}", out.describe());

    // Encrypted into another key: the passphrase of each.
    let (r4, pw4) = (d.join("r4"), d.join("pw4"));
    fs::write(&pw4, "the other key\n").unwrap();
    run_ok(&mut plain(&["repo", "init", "--encrypt", "--kdf-memory", "8M", "--password-file", s(&pw4), s(&r4)]));
    let other = copy_json(&plain, &[s(&r2), s(&r4), "--password-file", s(&pw), "--to-password-file", s(&pw4)]);
    assert_eq!(copied(&other), 3, "{other}");
    let with_key4 = |args: &[&str]| {
        let mut c = plain(args);
        c.env("FERRY_PASSWORD_FILE", &pw4);
        c
    };
    assert_copies(&with_key4, s(&r4), &want, d);

    // Encrypted into plain text: refused (the source's passphrase, tried on the
    // destination, does not notice a config swapped for an unencrypted one) unless asked.
    let out = run_fails(&mut plain(&["repo", "copy", s(&r2), s(&r3), "--password-file", s(&pw)]));
    assert!(out.stderr.contains("--to-unencrypted"), "{}", out.describe());
    let list = Json::must_parse(&run_ok(&mut plain(&["repo", "list", "--json", s(&r3)])).stdout);
    assert!(list.as_array().unwrap().is_empty(), "{list}");
    // Encrypted 64 KiB into plain 16 KiB: cut again; the hashes stay the source's.
    let cut = copy_json(&plain, &[s(&r2), s(&r3), "--password-file", s(&pw), "--to-unencrypted"]);
    assert_eq!(copied(&cut), 3, "{cut}");
    assert!(cut.array_at("copied").iter().all(|c| c.at("rechunked").as_bool() == Some(true)), "{cut}");
    assert_copies(&plain, s(&r3), &want, d);
    // Back into the first repository: it has them all (they are its own snapshots).
    let back = copy_json(&plain, &[s(&r3), s(&r1)]);
    assert_eq!((copied(&back), back.array_at("skipped").len()), (0, 3), "{back}");
}

fn s3_cmd(args: &[&str]) -> Command {
    let mut c = s3ferry(args);
    c.env_remove("FERRY_PASSWORD").env_remove("FERRY_PASSWORD_FILE").env_remove("RUST_LOG");
    c
}

#[test]
fn directory_to_s3_and_back() {
    moto();
    make_bucket("repo-copy");
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (local, back) = (d.join("local"), d.join("back"));
    let remote = "s3://repo-copy/offsite";
    run_ok(&mut s3_cmd(&["repo", "init", s(&local)]));
    let want = fill(&s3_cmd, s(&local), d);
    let mut init = s3_cmd(&["repo", "init", "--encrypt", "--kdf-memory", "8M", remote]);
    run_ok(init.env("FERRY_PASSWORD", "offsite words"));
    // The destination's passphrase from the environment.
    let mut up = s3_cmd(&["repo", "copy", "--json", "-p", s(&local), remote]);
    let out = run_ok(up.env("FERRY_TO_PASSWORD", "offsite words"));
    let up = Json::must_parse(&out.stdout);
    assert_eq!(copied(&up), 3, "{up}");
    assert!(out.stderr.contains("copying snapshot"), "no progress\n{}", out.describe());
    let enc = |args: &[&str]| {
        let mut c = s3_cmd(args);
        c.env("FERRY_PASSWORD", "offsite words");
        c
    };
    assert_copies(&enc, remote, &want, d);
    // And back, into 128 KiB chunks.
    run_ok(&mut s3_cmd(&["repo", "init", "--chunk-size", "128K", s(&back)]));
    let down = copy_json(&enc, &[remote, s(&back), "--to-unencrypted"]);
    assert_eq!(copied(&down), 3, "{down}");
    assert_copies(&s3_cmd, s(&back), &want, d);
    let again = copy_json(&enc, &[remote, s(&back), "--to-unencrypted"]);
    assert_eq!((copied(&again), again.u64_at("bytes_sent")), (0, 0), "{again}");
}

/// Two new unencrypted repositories in `d`: `r1` and `r2`.
fn two_repos(d: &Path) -> (PathBuf, PathBuf) {
    let (r1, r2) = (d.join("r1"), d.join("r2"));
    run_ok(&mut plain(&["repo", "init", s(&r1)]));
    run_ok(&mut plain(&["repo", "init", s(&r2)]));
    (r1, r2)
}

#[test]
fn a_copy_killed_midway_continues_when_run_again() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (r1, r2) = two_repos(d);
    let size = 8 * MIB as usize;
    let data = Rng::new(40).bytes(size);
    let img = write_sparse_file(d, "disk.raw", &data);
    run_ok(&mut plain(&["backup", s(&img), &format!("{}::vm", s(&r1))]));
    // About 8 s at 1 MiB/s, a checkpoint every 0.3 s: killed once some are stored.
    let mut slow = plain(&["repo", "copy", "--rate", "1M", "-j", "1", s(&r1), s(&r2)])
        .env("FERRY_CHECKPOINT_SECS", "0.3")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    assert!(wait_until(Duration::from_secs(10), || checkpoints(&r2) == 1), "no checkpoint was stored");
    std::thread::sleep(Duration::from_millis(1500));
    slow.kill().unwrap(); // SIGKILL
    slow.wait().unwrap();
    assert_eq!(checkpoints(&r2), 1);
    let list = Json::must_parse(&run_ok(&mut plain(&["repo", "list", "--json", s(&r2)])).stdout);
    assert!(list.as_array().unwrap().is_empty(), "{list}");
    let list = run_ok(&mut plain(&["repo", "list", s(&r2)]));
    assert!(list.stderr.contains("interrupted copy of vm"), "{}", list.describe());
    run_ok(&mut plain(&["repo", "check", s(&r2)]));
    // Run again: it continues, reading only what the checkpoint does not hold.
    let out = run_ok(&mut plain(&["repo", "copy", "--json", "-p", s(&r1), s(&r2)]));
    assert!(out.stderr.contains("resuming"), "{}", out.describe());
    let j = Json::must_parse(&out.stdout);
    let c = &j.array_at("copied")[0];
    assert_eq!(c.at("resumed").as_bool(), Some(true), "{j}");
    let read = c.u64_at("bytes_read");
    assert!(read > 0 && read < size as u64 - MIB, "read {read} of {size}: {j}");
    assert_eq!(checkpoints(&r2), 0, "the copy left its checkpoint");
    let restored = d.join("restored.raw");
    run_ok(&mut plain(&["copy", &format!("{}::vm", s(&r2)), s(&restored)]));
    assert_file_eq(&restored, &data);
    let check = run_ok(&mut plain(&["repo", "check", s(&r2)]));
    assert!(check.stdout.contains("no damage"), "{}", check.describe());
}

fn packs(repo: &Path) -> BTreeSet<PathBuf> {
    let mut out = BTreeSet::new();
    for sub in fs::read_dir(repo.join("data")).unwrap() {
        for p in fs::read_dir(sub.unwrap().path()).unwrap() {
            out.insert(p.unwrap().path());
        }
    }
    out
}

#[test]
fn a_damaged_source_snapshot_is_named_and_the_others_are_copied() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (r1, r2) = two_repos(d);
    let a = Rng::new(41).bytes(MIB as usize);
    run_ok(&mut plain(&["backup", s(&write_sparse_file(d, "a.raw", &a)), &format!("{}::a", s(&r1))]));
    let before = packs(&r1);
    let b = Rng::new(42).bytes(MIB as usize);
    let out =
        run_ok(&mut plain(&["backup", "--json", s(&write_sparse_file(d, "b.raw", &b)), &format!("{}::b", s(&r1))]));
    let b_id = Json::must_parse(out.stdout.trim()).at("id").as_str().unwrap().to_string();
    for p in packs(&r1).difference(&before) {
        fs::remove_file(p).unwrap();
    }
    let out = run(&mut plain(&["repo", "copy", s(&r1), s(&r2)]));
    assert_eq!(out.status.code(), Some(1), "{}", out.describe());
    assert!(out.stderr.contains(&b_id[..8]) && out.stderr.contains(" of b "), "{}", out.describe());
    assert!(out.stdout.contains("1 snapshot(s) copied") && out.stdout.contains("1 failed"), "{}", out.describe());
    let restored = d.join("a.back");
    run_ok(&mut plain(&["copy", &format!("{}::a", s(&r2)), s(&restored)]));
    assert_file_eq(&restored, &a);
}
