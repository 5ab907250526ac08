//! `ferry serve` metadata contexts: `-B/--bitmap` and `-A/--allocation-depth`, and the
//! maps nbdinfo reads through them, compared with qemu-nbd's on the same qcow2 image.
//!
//! qemu-nbd runs under nbdinfo's captive mode (`nbdinfo ... -- [ qemu-nbd ... ]`): it
//! exits with its only client. ferry is started and stopped by the test harness (a
//! captive ferry outlives an nbdinfo that fails).

use crate::common::*;
use std::path::{Path, PathBuf};

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// `nbdinfo ARGS -- [ qemu-nbd -r -f qcow2 QEMU_ARGS... ]`, its stdout.
fn nbdinfo_qemu(args: &[&str], qemu_args: &[&str]) -> String {
    require("nbdinfo");
    require("qemu-nbd");
    let mut c = cmd("nbdinfo", args);
    c.args(["--", "[", "qemu-nbd", "-r", "-f", "qcow2"]).args(qemu_args).arg("]");
    run_ok(&mut c).stdout
}

/// `nbdinfo ARGS URI` against a ferry server, its stdout.
fn nbdinfo_ferry(args: &[&str], server: &Server) -> String {
    require("nbdinfo");
    run_ok(cmd("nbdinfo", args).arg(server.uri())).stdout
}

/// `ferry serve -r ARGS SPEC`, running until dropped.
fn ferry_serve(args: &[&str], spec: &str) -> Server {
    ServerBuilder::new(spec).read_only().args(args).start()
}

/// A child process killed when dropped (a failing assertion leaves nothing running).
struct Kill(std::process::Child);
impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The contexts nbdinfo --json lists, sorted.
fn contexts(json: &str) -> Vec<String> {
    let v: serde_json::Value = serde_json::from_str(json).unwrap();
    let mut got: Vec<String> = serde_json::from_value(v["exports"][0]["contexts"].clone()).unwrap();
    got.sort();
    got
}

/// A qcow2 image made by qemu: 64 MiB, persistent bitmaps b0 (recording the writes
/// below) and b1 (added after them: clean), scattered writes and write-zeroes.
fn image(dir: &Path) -> PathBuf {
    require("qemu-img");
    require("qemu-io");
    let img = dir.join("img.qcow2");
    run_ok(&mut cmd("qemu-img", ["create", "-q", "-f", "qcow2", s(&img), "64M"]));
    run_ok(&mut cmd("qemu-img", ["bitmap", "--add", s(&img), "b0"]));
    run_ok(&mut cmd(
        "qemu-io",
        [
            "-f",
            "qcow2",
            "-c",
            "write -P 1 0 64k",
            "-c",
            "write -P 2 1M 4k",
            "-c",
            "write -P 3 5M 192k",
            "-c",
            "write -z 9M 1M",
            "-c",
            "write -P 4 20M 64k",
            "-c",
            "write -P 5 63M 1M",
            s(&img),
        ],
    ));
    run_ok(&mut cmd("qemu-img", ["bitmap", "--add", s(&img), "b1"]));
    img
}

#[test]
fn flags_are_documented() {
    let out = run_ok(&mut cmd(s(&ferry_bin()), ["serve", "--help"])).stdout;
    for flag in ["-B, --bitmap <NAME>", "-A, --allocation-depth"] {
        assert!(out.contains(flag), "serve --help lacks {flag}:\n{out}");
    }
}

#[test]
fn a_bitmap_not_offered_is_an_error_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path());
    let sock = dir.path().join("f.sock");
    for (spec, name) in [("memory:1M", "b0"), (s(&img), "nope")] {
        let out =
            run_fails(&mut cmd(s(&ferry_bin()), ["serve", "-r", "-U", s(&sock), "--run", "true", "-B", name, spec]));
        assert!(
            out.stderr.contains(&format!("--bitmap {name}"))
                && out.stderr.contains("missing, or inconsistent: in use by a program that did not close it"),
            "{}",
            out.describe()
        );
        assert!(!sock.exists() || std::os::unix::net::UnixStream::connect(&sock).is_err());
    }
    // -B names the default export's bitmaps: an --export without it is not checked.
    let out = run_ok(&mut cmd(
        s(&ferry_bin()),
        ["serve", "-r", "-U", s(&sock), "--run", "true", "-A", "--export", "other=memory:1M", "memory:1M"],
    ));
    assert!(out.status.success());
}

#[test]
fn contexts_offered_follow_the_flags() {
    // A memory disk has base:allocation only, with or without -A.
    for extra in [&[][..], &["-A"][..]] {
        let srv = ferry_serve(extra, "memory:1M");
        assert_eq!(contexts(&nbdinfo_ferry(&["--json"], &srv)), ["base:allocation"]);
    }
    // base:allocation maps the same through ferry and qemu-nbd.
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path());
    let srv = ferry_serve(&[], s(&img));
    let ferry = nbdinfo_ferry(&["--map"], &srv);
    drop(srv);
    let qemu = nbdinfo_qemu(&["--map"], &[s(&img)]);
    assert_eq!(ferry, qemu, "nbdinfo --map: ferry (left) and qemu-nbd (right) differ");
}

/// Needs the qcow2 crate's persistent bitmaps and allocation depth (merged from the
/// other helpers of issue 20): until then ferry offers neither, and -B b0 fails.
#[test]
fn maps_match_qemu_nbd() {
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path());
    // qemu as the client (extended headers, base:allocation and the bitmap selected
    // together): the same map from either server.
    let map = |sock: &Path| {
        let opts = format!("driver=nbd,server.type=unix,server.path={},x-dirty-bitmap=qemu:dirty-bitmap:b0", s(sock));
        run_ok(&mut cmd("qemu-img", ["map", "--output=json", "--image-opts", &opts])).stdout
    };
    let srv = ferry_serve(&["-B", "b0"], s(&img));
    let Addr::Unix(sock) = &srv.addr else { unreachable!() };
    let f = map(sock);
    drop(srv);
    let qsock = dir.path().join("q.sock");
    let qemu = Kill(
        std::process::Command::new("qemu-nbd")
            .args(["-r", "-f", "qcow2", "-B", "b0", "-t", "-k", s(&qsock), s(&img)])
            .spawn()
            .expect("start qemu-nbd"),
    );
    let t = std::time::Instant::now();
    // -t: the probe is not its last client.
    while std::os::unix::net::UnixStream::connect(&qsock).is_err() && t.elapsed().as_secs() < 10 {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let q = map(&qsock);
    drop(qemu);
    assert_eq!(f, q, "qemu-img map with x-dirty-bitmap: ferry (left) and qemu-nbd (right) differ");
    for map in ["--map=qemu:dirty-bitmap:b0", "--map=qemu:allocation-depth", "--map"] {
        let srv = ferry_serve(&["-B", "b0", "-A"], s(&img));
        let f = nbdinfo_ferry(&[map], &srv);
        drop(srv);
        let q = nbdinfo_qemu(&[map], &["-B", "b0", "-A", s(&img)]);
        assert!(!q.is_empty());
        assert_eq!(f, q, "nbdinfo {map}: ferry (left) and qemu-nbd (right) differ");
    }
    // Offered: base:allocation, allocation depth, b0 (not b1: -B names b0 only).
    let srv = ferry_serve(&["-B", "b0", "-A"], s(&img));
    assert_eq!(
        contexts(&nbdinfo_ferry(&["--json"], &srv)),
        ["base:allocation", "qemu:allocation-depth", "qemu:dirty-bitmap:b0"]
    );
    drop(srv);
    // Without flags: every bitmap, no allocation depth.
    let srv = ferry_serve(&[], s(&img));
    assert_eq!(
        contexts(&nbdinfo_ferry(&["--json"], &srv)),
        ["base:allocation", "qemu:dirty-bitmap:b0", "qemu:dirty-bitmap:b1"]
    );
}
