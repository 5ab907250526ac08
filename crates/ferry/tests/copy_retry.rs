//! `ferry copy --retries`, `--retry-delay`, `--request-timeout` (issue 21) against real
//! failing servers: nbdkit's error filter (a share of reads or writes fail), its delay
//! filter (a server slower than the timeout), and an nbdkit source killed with -9 in the
//! middle of a copy and started again on the same socket.

use crate::common::*;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn ferry(args: &[&str]) -> Command {
    let mut c = Command::new(ferry_bin());
    c.args(args);
    c
}

/// What nbdkit's pattern plugin serves: each 8-byte word is its offset, big-endian.
fn pattern(len: usize) -> Vec<u8> {
    (0..len / 8).flat_map(|i| ((i * 8) as u64).to_be_bytes()).collect()
}

fn retries_in(stderr: &str) -> u64 {
    stderr.lines().find_map(|l| l.strip_prefix("retries: ")).and_then(|n| n.trim().parse().ok()).unwrap_or(0)
}

#[test]
fn read_errors_of_a_source_are_retried_and_the_copy_is_exact() {
    let dir = tempfile::tempdir().unwrap();
    let k = Nbdkit::start(dir.path(), &["--filter=error", "pattern", "8M", "error-pread=EIO", "error-pread-rate=20%"]);
    let dst = dir.path().join("dst.img");
    let out = run_ok(&mut ferry(&[
        "copy",
        "--stats",
        "--retries",
        "30",
        "--retry-delay",
        "0.001",
        "--request-size",
        "256K",
        &k.uri(),
        dst.to_str().unwrap(),
    ]));
    assert_eq!(std::fs::read(&dst).unwrap(), pattern(8 << 20));
    let n = retries_in(&out.stderr);
    assert!(n > 0, "20% of reads failed, yet nothing was retried\n{}", out.describe());
    assert!(out.stderr.contains("retry") && out.stderr.contains("EIO"), "each retry is logged\n{}", out.describe());
    // Without retries the first error ends the copy, naming the offset.
    // (128 reads: all of them succeeding by chance is 0.8^128.)
    let out =
        run_fails(&mut ferry(&["copy", "--retries", "0", "--request-size", "64K", &k.uri(), dst.to_str().unwrap()]));
    assert!(out.stderr.contains("offset") && out.stderr.contains("EIO"), "{}", out.describe());
}

#[test]
fn write_errors_of_a_destination_are_retried_and_verified() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src.img");
    std::fs::write(&src, pattern(8 << 20)).unwrap();
    let k = Nbdkit::start(dir.path(), &["--filter=error", "memory", "8M", "error-pwrite=EIO", "error-pwrite-rate=20%"]);
    let out = run_ok(&mut ferry(&[
        "copy",
        "--stats",
        "--verify",
        "--retries",
        "30",
        "--retry-delay",
        "0.001",
        "--request-size",
        "256K",
        src.to_str().unwrap(),
        &k.uri(),
    ]));
    assert!(retries_in(&out.stderr) > 0, "{}", out.describe());
}

#[test]
fn permanent_errors_are_not_retried() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src.img");
    std::fs::write(&src, pattern(4 << 20)).unwrap();
    let k =
        Nbdkit::start(dir.path(), &["--filter=error", "memory", "4M", "error-pwrite=ENOSPC", "error-pwrite-rate=100%"]);
    let t = Instant::now();
    // A long delay: were ENOSPC retried, this would take minutes.
    let out =
        run_fails(&mut ferry(&["copy", "--retries", "5", "--retry-delay", "30", src.to_str().unwrap(), &k.uri()]));
    assert!(t.elapsed() < Duration::from_secs(20), "{}", out.describe());
    assert!(out.stderr.contains("ENOSPC") && out.stderr.contains("offset"), "{}", out.describe());
    assert!(!out.stderr.contains("retry"), "{}", out.describe());
}

#[test]
fn a_source_killed_and_restarted_on_its_socket_does_not_end_the_copy() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("src.sock");
    // Every read takes 20 ms: 64K requests, 4 at a time, make an 8 MiB copy last 0.6 s+.
    let args = ["--filter=delay", "pattern", "16M", "rdelay=20ms"];
    let mut k = Nbdkit::start_at(&sock, &args);
    let dst = dir.path().join("dst.img");
    let child = ferry(&[
        "copy",
        "--stats",
        "-C",
        "1",
        "-R",
        "4",
        "--request-size",
        "64K",
        "--retry-delay",
        "1",
        &k.uri(),
        dst.to_str().unwrap(),
    ])
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    std::thread::sleep(Duration::from_millis(700));
    k.kill9();
    std::thread::sleep(Duration::from_secs(1));
    let _k2 = Nbdkit::start_at(&sock, &args);
    let o = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{stderr}");
    assert!(retries_in(&stderr) > 0, "{stderr}");
    assert!(std::fs::read(&dst).unwrap() == pattern(16 << 20), "the destination differs from the source");
}

#[test]
fn a_server_slower_than_the_request_timeout_does_not_hang_the_copy() {
    let dir = tempfile::tempdir().unwrap();
    let k = Nbdkit::start(dir.path(), &["--filter=delay", "pattern", "1M", "rdelay=30"]);
    let dst = dir.path().join("dst.img");
    let t = Instant::now();
    let out = run_fails(&mut ferry(&[
        "copy",
        "--request-timeout",
        "0.5",
        "--retries",
        "2",
        "--retry-delay",
        "0.1",
        &k.uri(),
        dst.to_str().unwrap(),
    ]));
    assert!(t.elapsed() < Duration::from_secs(20), "{}", out.describe());
    assert!(out.stderr.contains("request timeout"), "{}", out.describe());
    assert!(out.stderr.contains("after 2 retries"), "{}", out.describe());
}

#[test]
fn out_of_range_retry_settings_are_refused_at_parse_time() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src.img");
    std::fs::write(&src, [1u8; 4096]).unwrap();
    let dst = dir.path().join("dst.img");
    for bad in [
        vec!["--retries", "101"],
        vec!["--retries", "-1"],
        vec!["--retry-delay", "-1"],
        vec!["--retry-delay", "61"],
        vec!["--retry-delay", "nan"],
        vec!["--request-timeout", "0"],
        vec!["--request-timeout", "3601"],
    ] {
        let mut args = vec!["copy"];
        args.extend_from_slice(&bad);
        args.extend_from_slice(&[src.to_str().unwrap(), dst.to_str().unwrap()]);
        let out = run_fails(&mut ferry(&args));
        assert_eq!(out.status.code(), Some(2), "a usage error\n{}", out.describe());
        assert!(!dst.exists());
    }
}

/// The destination (nbdkit's file plugin: what it acknowledged is in the page cache and
/// survives the process) killed with -9 in the middle of a copy and started again on its
/// socket a second later: the writes in flight go again and the result is exact. With
/// --verify the copy proves it and succeeds; without, it cannot know that the restarted
/// server kept what it had acknowledged, and says so with a non-zero exit.
#[test]
fn a_destination_killed_and_restarted_on_its_socket_does_not_end_the_copy() {
    for verify in [true, false] {
        destination_restarted(verify);
    }
}

fn destination_restarted(verify: bool) {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src.img");
    let data = pattern(16 << 20);
    std::fs::write(&src, &data).unwrap();
    let img = dir.path().join("dst.img");
    std::fs::write(&img, vec![0u8; 16 << 20]).unwrap();
    let sock = dir.path().join("dst.sock");
    let img_arg = img.to_str().unwrap().to_string();
    let args = ["--filter=delay", "file", &img_arg, "wdelay=20ms"];
    let mut k = Nbdkit::start_at(&sock, &args);
    let uri = k.uri();
    let mut cmd =
        vec!["copy", "--stats", "-C", "1", "-R", "4", "--request-size", "64K", "--retry-delay", "1", "--flush"];
    if verify {
        cmd.push("--verify");
    }
    cmd.extend([src.to_str().unwrap(), uri.as_str()]);
    let child = ferry(&cmd).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    std::thread::sleep(Duration::from_millis(700));
    k.kill9();
    std::thread::sleep(Duration::from_secs(1));
    let _k2 = Nbdkit::start_at(&sock, &args);
    let o = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(retries_in(&stderr) > 0 || !verify, "{stderr}");
    if verify {
        assert!(o.status.success(), "{stderr}");
    } else {
        assert!(!o.status.success(), "an unproven copy after a destination restart must not succeed: {stderr}");
        assert!(stderr.contains("not known to be complete") && stderr.contains("--verify"), "{stderr}");
    }
    assert!(std::fs::read(&img).unwrap() == data, "the destination differs from the source");
}

/// A source that comes back with another size is not the same source: the copy ends at
/// once instead of mixing two disks.
#[test]
fn a_source_that_comes_back_with_another_size_ends_the_copy() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("src.sock");
    let mut k = Nbdkit::start_at(&sock, &["--filter=delay", "pattern", "16M", "rdelay=20ms"]);
    let dst = dir.path().join("dst.img");
    let child = ferry(&[
        "copy",
        "-C",
        "1",
        "-R",
        "4",
        "--request-size",
        "64K",
        "--retry-delay",
        "1",
        &k.uri(),
        dst.to_str().unwrap(),
    ])
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    std::thread::sleep(Duration::from_millis(500));
    k.kill9();
    let _k2 = Nbdkit::start_at(&sock, &["--filter=delay", "pattern", "8M", "rdelay=20ms"]);
    let o = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{stderr}");
    assert!(stderr.contains("16777216") && stderr.contains("8388608"), "names both sizes: {stderr}");
    assert_eq!(stderr.matches("reconnecting").count(), 1, "not retried: {stderr}");
}
