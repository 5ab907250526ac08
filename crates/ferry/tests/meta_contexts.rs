//! `ferry serve` metadata contexts: `-B/--bitmap` and `-A/--allocation-depth`, and the
//! maps nbdinfo reads through them, compared with qemu-nbd's on the same qcow2 image.
//!
//! Both servers run under nbdinfo's captive mode (`nbdinfo ... -- [ SERVER ... ]`,
//! systemd socket activation): no port, no socket path, nothing left running.

mod common;

use common::*;
use std::path::{Path, PathBuf};

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// `nbdinfo ARGS -- [ SERVER... ]`, its stdout.
fn nbdinfo_captive<S: AsRef<std::ffi::OsStr>>(args: &[&str], server: &[S]) -> String {
    require("nbdinfo");
    let mut c = cmd("nbdinfo", args);
    c.arg("--").arg("[").args(server).arg("]");
    run_ok(&mut c).stdout
}

fn ferry_serve(args: &[&str]) -> Vec<String> {
    let mut v = vec![ferry_bin().to_str().unwrap().to_string(), "serve".to_string()];
    v.extend(args.iter().map(|s| s.to_string()));
    v
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
        let mut args = vec!["-r"];
        args.extend_from_slice(extra);
        args.push("memory:1M");
        let out = nbdinfo_captive(&["--json"], &ferry_serve(&args));
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["exports"][0]["contexts"], serde_json::json!(["base:allocation"]), "{out}");
    }
    // base:allocation maps the same through ferry and qemu-nbd.
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path());
    let ferry = nbdinfo_captive(&["--map"], &ferry_serve(&["-r", s(&img)]));
    let qemu = nbdinfo_captive(&["--map"], &["qemu-nbd", "-r", "-f", "qcow2", s(&img)]);
    assert_eq!(ferry, qemu, "nbdinfo --map: ferry (left) and qemu-nbd (right) differ");
}

/// Needs the qcow2 crate's persistent bitmaps and allocation depth (merged from the
/// other helpers of issue 20): until then ferry offers neither, and -B b0 fails.
#[test]
fn maps_match_qemu_nbd() {
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path());
    let ferry = ferry_serve(&["-r", "-B", "b0", "-A", s(&img)]);
    let qemu = ["qemu-nbd", "-r", "-B", "b0", "-A", "-f", "qcow2", s(&img)];
    for map in ["--map=qemu:dirty-bitmap:b0", "--map=qemu:allocation-depth", "--map"] {
        let f = nbdinfo_captive(&[map], &ferry);
        let q = nbdinfo_captive(&[map], &qemu);
        assert!(!q.is_empty());
        assert_eq!(f, q, "nbdinfo {map}: ferry (left) and qemu-nbd (right) differ");
    }
    // Offered: base:allocation, allocation depth, b0 (not b1: -B names b0 only).
    let out = nbdinfo_captive(&["--json"], &ferry);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let mut got: Vec<String> = serde_json::from_value(v["exports"][0]["contexts"].clone()).unwrap();
    got.sort();
    assert_eq!(got, ["base:allocation", "qemu:allocation-depth", "qemu:dirty-bitmap:b0"]);
    // Without flags: every bitmap, no allocation depth.
    let out = nbdinfo_captive(&["--json"], &ferry_serve(&["-r", s(&img)]));
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let mut got: Vec<String> = serde_json::from_value(v["exports"][0]["contexts"].clone()).unwrap();
    got.sort();
    assert_eq!(got, ["base:allocation", "qemu:dirty-bitmap:b0", "qemu:dirty-bitmap:b1"]);
}
