//! The `ferry serve` command line: captive mode (--run), bad specs, signals, binding.

use crate::common::raw::*;
use crate::common::*;
use std::net::TcpListener;
use std::process::Command;
use std::time::Duration;

fn ferry(args: &[&str]) -> Command {
    let mut c = Command::new(ferry_bin());
    c.args(args);
    c
}

fn ferry_run(args: &[&str]) -> Output {
    run_timeout(&mut ferry(args), Duration::from_secs(60))
}

/// For invocations that must fail at once (a server that starts serving instead is
/// killed after 15 s and the test fails).
fn ferry_fails(args: &[&str]) -> Output {
    let out = run_timeout(&mut ferry(args), Duration::from_secs(15));
    assert!(!out.status.success(), "`ferry {}` must fail\n{}", args.join(" "), out.describe());
    out
}

#[test]
fn run_captive_nbdinfo_unix() {
    require("nbdinfo");
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("s.sock");
    let sock_s = sock.to_str().unwrap();
    let script = format!(r#"test -n "$uri" && test "$unixsocket" = "{sock_s}" && nbdinfo "$uri""#);
    let out = ferry_run(&["serve", "--unix", sock_s, "--run", &script, "memory:16M"]);
    assert!(out.status.success(), "{}", out.describe());
    assert_eq!(out.status.code(), Some(0));
    assert!(out.stdout.contains("export-size: 16777216"), "nbdinfo output missing\n{}", out.describe());
}

#[test]
fn run_captive_tcp_sets_port() {
    require("nbdinfo");
    let port = free_port().to_string();
    let script =
        format!(r#"test "$port" = "{port}" && case "$uri" in nbd://*) ;; *) exit 9;; esac && nbdinfo --size "$uri""#);
    let out = ferry_run(&["serve", "--port", &port, "--run", &script, "null:3G"]);
    assert!(out.status.success(), "{}", out.describe());
    assert!(out.stdout.lines().any(|l| l.trim() == (3u64 << 30).to_string()), "{}", out.describe());
}

#[test]
fn run_exit_status_is_passed_on() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("s.sock");
    let out = ferry_run(&["serve", "-U", sock.to_str().unwrap(), "--run", "exit 3", "memory:1M"]);
    assert_eq!(out.status.code(), Some(3), "ferry must exit with the --run command's status\n{}", out.describe());
    let sock2 = dir.path().join("s2.sock");
    let out = ferry_run(&["serve", "-U", sock2.to_str().unwrap(), "--run", "true", "memory:1M"]);
    assert_eq!(out.status.code(), Some(0), "{}", out.describe());
}

/// Captive mode with real I/O: copy into a file export and back out inside --run.
#[test]
fn run_captive_copy_roundtrip_file_export() {
    require("nbdcopy");
    let dir = tempfile::tempdir().unwrap();
    let size = 4 * MIB as usize;
    let disk = write_sparse_file(dir.path(), "disk.img", &vec![0u8; size]);
    let data = data_with_holes(size, 31);
    let input = write_sparse_file(dir.path(), "in.img", &data);
    let out_img = dir.path().join("out.img");
    let sock = dir.path().join("s.sock");
    let script = format!(r#"nbdcopy "{}" "$uri" && nbdcopy "$uri" "{}""#, input.display(), out_img.display());
    let out =
        ferry_run(&["serve", "-U", sock.to_str().unwrap(), "--run", &script, &format!("file:{}", disk.display())]);
    assert!(out.status.success(), "{}", out.describe());
    assert_file_eq(&out_img, &data);
    assert_file_eq(&disk, &data);
}

#[track_caller]
fn assert_bad_spec(spec: &str, mention: &str) {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("s.sock");
    let out = ferry_fails(&["serve", "--unix", sock.to_str().unwrap(), spec]);
    assert!(out.stderr.contains(mention), "the error for spec {spec:?} should mention {mention:?}\n{}", out.describe());
}

#[test]
fn bad_specs_fail_with_a_clear_message() {
    assert_bad_spec("memory:abc", "abc");
    assert_bad_spec("bogus:1", "bogus");
    assert_bad_spec("memory", "memory");
    assert_bad_spec("null:", "size");
    assert_bad_spec("file:/nonexistent/ferry-test/disk.img", "/nonexistent/ferry-test/disk.img");
    // No spec at all.
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("s.sock");
    let out = ferry_fails(&["serve", "--unix", sock.to_str().unwrap()]);
    assert!(!out.stderr.trim().is_empty(), "{}", out.describe());
}

/// ferry-only: the nbdkit shim does not validate --export specs.
#[test]
fn bad_export_option_fails() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("s.sock");
    let s = sock.to_str().unwrap();
    let out = ferry_fails(&["serve", "-U", s, "--export", "x=bogus:1", "memory:1M"]);
    assert!(out.stderr.contains("bogus"), "{}", out.describe());
    ferry_fails(&["serve", "-U", s, "--export", "no-equals-sign", "memory:1M"]);
}

/// ferry-only: help text names the options.
#[test]
fn help_lists_options() {
    let out = ferry_run(&["serve", "--help"]);
    assert!(out.status.success(), "{}", out.describe());
    for opt in [
        "--unix",
        "--bind",
        "--port",
        "--read-only",
        "--export",
        "--description",
        "--run",
        "--max-connections",
        "--handshake-timeout",
    ] {
        assert!(out.stdout.contains(opt), "`ferry serve --help` does not mention {opt}\n{}", out.stdout);
    }
}

#[test]
fn sigterm_with_client_connected_exits_zero_and_keeps_file_data() {
    let dir = tempfile::tempdir().unwrap();
    let size = 8 * MIB as usize;
    let disk = write_sparse_file(dir.path(), "disk.img", &vec![0u8; size]);
    let mut server = Server::unix(&format!("file:{}", disk.display()), &[]);
    let (mut c, got_size, _) = RawClient::handshake(&server);
    assert_eq!(got_size, size as u64);
    let mut want = vec![0u8; size];
    for (i, off) in [0u64, 3 * MIB + 17, 8 * MIB - 4096].into_iter().enumerate() {
        let d = Rng::new(40 + i as u64).bytes(4096);
        assert_eq!(c.write(off, &d, 0), 0);
        want[off as usize..off as usize + 4096].copy_from_slice(&d);
    }
    // No FLUSH: the data was acknowledged, so it must be in the file after shutdown.
    let st = server.signal_and_wait(libc::SIGTERM, Duration::from_secs(10));
    assert_eq!(st.code(), Some(0), "SIGTERM with a client connected must exit 0\n{}", server.stderr());
    assert!(c.closed_within(Duration::from_secs(2)), "the client's connection must be closed");
    assert_file_eq(&disk, &want);
}

#[test]
fn sigint_exits_zero() {
    let mut server = Server::tcp("memory:16M", &[]);
    let (mut c, _, _) = RawClient::handshake(&server);
    assert_eq!(c.write(0, b"hello", 0), 0);
    let st = server.signal_and_wait(libc::SIGINT, Duration::from_secs(10));
    assert_eq!(st.code(), Some(0), "SIGINT must exit 0\n{}", server.stderr());
}

#[test]
fn sigterm_idle_exits_zero() {
    let mut server = Server::unix("memory:16M", &[]);
    let st = server.stop();
    assert_eq!(st.code(), Some(0), "SIGTERM must exit 0\n{}", server.stderr());
}

#[test]
fn explicit_bind_and_tcp_nbdinfo() {
    require("nbdinfo");
    let server = ServerBuilder::new("memory:16M").bind("127.0.0.1").start();
    let out = run_ok(&mut cmd("nbdinfo", ["--size", &server.uri()]));
    assert_eq!(out.stdout.trim(), (16 * MIB).to_string());
}

#[test]
fn port_in_use_fails() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port().to_string();
    let out = ferry_fails(&["serve", "--port", &port, "memory:1M"]);
    assert!(!out.stderr.trim().is_empty(), "{}", out.describe());
    drop(l);
}

#[test]
fn read_only_file_export_leaves_file_untouched() {
    require("nbdinfo");
    let dir = tempfile::tempdir().unwrap();
    let data = data_with_holes(2 * MIB as usize, 50);
    let disk = write_sparse_file(dir.path(), "disk.img", &data);
    let server = Server::unix(&format!("file:{}", disk.display()), &["-r"]);
    let (mut c, _, flags) = RawClient::handshake(&server);
    assert_ne!(flags & TFLAG_READ_ONLY, 0);
    assert_eq!(c.write(0, &[0xffu8; 4096], 0), EPERM);
    assert_eq!(c.read(0, 4096).unwrap(), data[..4096].to_vec());
    drop(c);
    assert_file_eq(&disk, &data);
    let out = run_ok(&mut cmd("nbdinfo", ["--json", &server.uri()]));
    assert!(out.stdout.contains("\"is_read_only\": true"), "{}", out.stdout);
}

/// An OS error is printed once, not once by the error that embeds it and again as its
/// `source()` (issue 13: "No such file or directory (os error 2): No such file or
/// directory (os error 2)").
#[test]
fn each_os_error_is_printed_once() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nonexistent");
    let missing = missing.to_str().unwrap();
    let src = dir.path().join("src.img");
    std::fs::write(&src, [1u8; 4096]).unwrap();
    let cases: [&[&str]; 3] = [
        &["copy", missing, "null:"],
        &["copy", src.to_str().unwrap(), &format!("{missing}/sub/dst.img")],
        &["serve", &format!("file:{missing}")],
    ];
    for args in cases {
        let out = ferry_fails(args);
        let n = out.stderr.matches("No such file or directory").count();
        assert_eq!(n, 1, "`ferry {}`: the OS error must appear exactly once\n{}", args.join(" "), out.describe());
        assert!(out.stderr.contains(missing), "the message must name the path\n{}", out.describe());
    }
}

/// `ferry --help` names every `bench` subcommand in its one-line summary.
#[test]
fn bench_summary_names_its_subcommands() {
    let out = ferry_run(&["--help"]);
    assert!(out.status.success(), "{}", out.describe());
    let line = out.stdout.lines().find(|l| l.trim_start().starts_with("bench")).expect("bench in --help");
    let subs = ferry_run(&["bench", "--help"]);
    let mut named = 0;
    for l in subs.stdout.lines().skip_while(|l| !l.starts_with("Commands:")).skip(1) {
        let Some(sub) = l.split_whitespace().next() else { break };
        if sub == "help" {
            continue;
        }
        assert!(line.contains(&format!("bench {sub}")), "`ferry --help` line {line:?} must name `bench {sub}`");
        named += 1;
    }
    assert!(named >= 2, "ferry bench --help lists its subcommands\n{}", subs.describe());
}

/// Refusals of S3 specs that need no server: they come before any request is sent.
#[test]
fn s3_refusals_before_any_request() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src.img");
    std::fs::write(&src, vec![7u8; 4096]).unwrap();
    // An unreachable endpoint: a refusal that got as far as a request would say so instead.
    let s3 = |args: &[&str]| {
        let mut c = ferry(args);
        c.env("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
            .env("AWS_ACCESS_KEY_ID", "k")
            .env("AWS_SECRET_ACCESS_KEY", "s")
            .env("AWS_REGION", "us-east-1");
        let out = run_timeout(&mut c, Duration::from_secs(15));
        assert!(!out.status.success(), "`ferry {}` must fail\n{}", args.join(" "), out.describe());
        out
    };
    // S3 signs its requests: an Authorization header would clash.
    let out = s3(&["hash", "--header", "Authorization: Bearer t", "s3://bkt/key"]);
    assert!(out.stderr.contains("--header Authorization cannot go with s3://"), "{}", out.describe());
    // A resumable upload from a stream is refused before an upload is started.
    let out = s3(&["copy", "--resume", "-", "s3://bkt/key"]);
    assert!(out.stderr.contains("is a stream"), "{}", out.describe());
    assert!(!out.stderr.contains("CreateMultipartUpload"), "{}", out.describe());
}
