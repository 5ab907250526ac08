//! `ferry copy --verify` and `--expect-hash`: copies that prove their result (issue 21),
//! against real destinations, one of which loses writes (nbdkit's null plugin accepts
//! every write and keeps nothing).

use crate::common::*;
use std::path::{Path, PathBuf};
use std::process::Command;

/// `len` bytes: `zero_blocks` 64 KiB blocks of zeroes, then data that is never zero.
fn source(dir: &Path, len: usize, zero_blocks: usize) -> PathBuf {
    let mut data = vec![0u8; len];
    for (i, b) in data.iter_mut().enumerate().skip(zero_blocks * 65536) {
        *b = (i % 251) as u8 | 1;
    }
    let p = dir.join("src.img");
    std::fs::write(&p, &data).unwrap();
    p
}

fn ferry(args: &[&str]) -> Command {
    let mut c = Command::new(ferry_bin());
    c.args(args);
    c
}

fn digest_of(path: &Path, alg: &str) -> String {
    let out = run_ok(&mut ferry(&["hash", "--digest", alg, path.to_str().unwrap()]));
    out.stdout.split_whitespace().next().unwrap().to_string()
}

#[test]
fn expect_hash_passes_on_the_right_digest_and_prints_it() {
    let dir = tempfile::tempdir().unwrap();
    let src = source(dir.path(), 3 << 20, 2);
    for alg in ["sha256", "sha512", "blake3"] {
        let want = digest_of(&src, alg);
        let dst = dir.path().join(format!("ok-{alg}.img"));
        let out = run_ok(&mut ferry(&[
            "copy",
            "--digest",
            alg,
            "--expect-hash",
            &want.to_uppercase(),
            src.to_str().unwrap(),
            dst.to_str().unwrap(),
        ]));
        assert_eq!(out.stdout, format!("{want}  {}\n", src.display()), "{}", out.describe());
        assert_eq!(std::fs::read(&dst).unwrap(), std::fs::read(&src).unwrap());
    }
}

#[test]
fn wrong_expect_hash_fails_and_leaves_no_destination_that_looks_complete() {
    let dir = tempfile::tempdir().unwrap();
    let src = source(dir.path(), 2 << 20, 1);
    let right = digest_of(&src, "sha256");
    let wrong = "0".repeat(64);
    assert_ne!(right, wrong);
    // A new raw file and a new qcow2 image: created by the copy, removed.
    for name in ["new.img", "new.qcow2"] {
        let dst = dir.path().join(name);
        let out =
            run_fails(&mut ferry(&["copy", "--expect-hash", &wrong, src.to_str().unwrap(), dst.to_str().unwrap()]));
        assert_eq!(out.status.code(), Some(1), "{}", out.describe());
        assert!(out.stderr.contains(&right) && out.stderr.contains(&wrong), "{}", out.describe());
        assert!(out.stderr.contains("was removed"), "{}", out.describe());
        assert!(!dst.exists(), "{name}: a destination the copy created must not be left behind");
    }
    // An existing file: left, but named as not to be trusted.
    let dst = dir.path().join("existing.img");
    std::fs::write(&dst, vec![7u8; 4 << 20]).unwrap();
    let out = run_fails(&mut ferry(&["copy", "--expect-hash", &wrong, src.to_str().unwrap(), dst.to_str().unwrap()]));
    assert!(out.stderr.contains("must not be trusted"), "{}", out.describe());
    assert!(dst.exists());
    // An NBD destination: likewise.
    let k = Nbdkit::start(dir.path(), &["memory", "2M"]);
    let out = run_fails(&mut ferry(&["copy", "--expect-hash", &wrong, src.to_str().unwrap(), &k.uri()]));
    assert!(out.stderr.contains("must not be trusted"), "{}", out.describe());
}

#[test]
fn malformed_expect_hash_and_conflicting_digests_are_refused_before_writing() {
    let dir = tempfile::tempdir().unwrap();
    let src = source(dir.path(), 1 << 20, 0);
    let dst = dir.path().join("dst.img");
    let s = src.to_str().unwrap();
    let d = dst.to_str().unwrap();
    for args in [
        vec!["copy", "--expect-hash", "abc", s, d],
        vec!["copy", "--expect-hash", &"g".repeat(64), s, d],
        // A sha256-long digest for sha512.
        vec!["copy", "--digest", "sha512", "--expect-hash", &"0".repeat(64), s, d],
        vec!["copy", "--hash=md5", "--digest", "sha1", "--verify", s, d],
        vec!["copy", "--verify", s, "null:"],
        vec!["copy", "--verify", s, "-"],
    ] {
        let out = run_fails(&mut ferry(&args));
        assert!(!out.stderr.is_empty(), "{}", out.describe());
        assert!(!dst.exists(), "refused at parse time, nothing created: {}", out.describe());
    }
}

#[test]
fn verify_passes_for_good_copies_and_prints_both_digests() {
    let dir = tempfile::tempdir().unwrap();
    let src = source(dir.path(), (3 << 20) + 4097, 3);
    let want = digest_of(&src, "sha256");
    let k = Nbdkit::start(dir.path(), &["memory", "8M"]);
    let raw = dir.path().join("v.img");
    let q = dir.path().join("v.qcow2");
    for dst in [raw.to_str().unwrap().to_string(), q.to_str().unwrap().to_string(), k.uri()] {
        let out = run_ok(&mut ferry(&["copy", "--verify", src.to_str().unwrap(), &dst]));
        assert_eq!(out.stdout, format!("{want}  {}\n{want}  {dst}\n", src.display()), "{}", out.describe());
    }
}

/// nbdkit's null plugin takes every write and keeps nothing: the copy "succeeds", and
/// only reading the destination back shows that the data never landed. The first three
/// blocks of the source are zeroes (which null does read back), so the first differing
/// block is block 3.
#[test]
fn verify_catches_a_destination_that_loses_writes_and_names_the_block() {
    let dir = tempfile::tempdir().unwrap();
    let src = source(dir.path(), 2 << 20, 3);
    let k = Nbdkit::start(dir.path(), &["null", "2M"]);
    // Without --verify the loss goes unnoticed.
    run_ok(&mut ferry(&["copy", src.to_str().unwrap(), &k.uri()]));
    let out = run_fails(&mut ferry(&["copy", "--verify", src.to_str().unwrap(), &k.uri()]));
    assert_eq!(out.status.code(), Some(1), "{}", out.describe());
    assert!(out.stderr.contains("--verify failed"), "{}", out.describe());
    assert!(out.stderr.contains("first differing block: 3 (offset 196608, 65536-byte blocks)"), "{}", out.describe());
    // Both digests were printed before the failure, the destination's being all zeroes'.
    let lines: Vec<&str> = out.stdout.lines().collect();
    assert_eq!(lines.len(), 2, "{}", out.describe());
    assert_eq!(lines[0], format!("{}  {}", digest_of(&src, "sha256"), src.display()));
    let zeroes = dir.path().join("zeroes.img");
    std::fs::write(&zeroes, vec![0u8; 2 << 20]).unwrap();
    assert_eq!(lines[1], format!("{}  {}", digest_of(&zeroes, "sha256"), k.uri()));
    // From a stream the block cannot be found again, but the mismatch is still caught.
    let mut c = ferry(&["copy", "--verify", "-", &k.uri()]);
    c.stdin(std::fs::File::open(&src).unwrap());
    let out = c.output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("--verify failed") && err.contains("stream"), "{err}");
}
