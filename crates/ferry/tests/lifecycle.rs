//! How ferry's processes begin and end: a copy interrupted by SIGINT or SIGTERM fails
//! cleanly (an S3 upload aborted, or kept and named under --resume), a server started
//! with --exit-with-parent follows its parent, and `-x NAME` names the default export.

use crate::common::*;
use crate::remote_images::{journals, keys, make_bucket, pending_uploads, s3ferry, wait_for_parts};
use ferry_testsupport::moto::moto;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Starts `c` with stdout and stderr piped.
fn start(c: &mut Command) -> Child {
    spawn_serialized(c.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped())).expect("start ferry")
}

/// Sends `sig` to `child`, waits (at most 10 s) for it to exit and returns what it
/// printed and how long it took after the signal.
fn interrupt(mut child: Child, sig: i32) -> (Output, Duration) {
    let t0 = Instant::now();
    // SAFETY: kill(2) on our own child's pid.
    unsafe {
        libc::kill(child.id() as libc::pid_t, sig);
    }
    let ok = wait_until(Duration::from_secs(10), || child.try_wait().unwrap().is_some());
    let took = t0.elapsed();
    if !ok {
        let _ = child.kill();
    }
    let out = child.wait_with_output().unwrap();
    let out = Output {
        what: format!("ferry (signal {sig})"),
        status: out.status,
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    };
    assert!(ok, "ferry did not exit within 10 s of signal {sig}\n{}", out.describe());
    (out, took)
}

/// A 40 MiB source of data in `dir`: eight 5 MiB parts.
fn source(dir: &Path) -> std::path::PathBuf {
    write_sparse_file(dir, "src.raw", &Rng::new(28).bytes(40 * MIB as usize))
}

#[test]
fn sigint_during_an_s3_upload_aborts_it() {
    moto();
    make_bucket("sigint-bkt");
    let tmp = tempfile::tempdir().unwrap();
    let src = source(tmp.path());
    let url = "s3://sigint-bkt/disk.raw";
    let child = start(&mut s3ferry(["copy", "--rate", "4M", "-C", "2", "--requests", "1", s(&src), url]));
    let id = wait_for_parts("sigint-bkt", "disk.raw", 1);
    let (out, took) = interrupt(child, libc::SIGINT);
    assert!(id.is_some(), "no part was stored before ferry ended\n{}", out.describe());
    assert_eq!(out.status.code(), Some(130), "{}", out.describe());
    assert!(out.stderr.contains("interrupted by SIGINT"), "{}", out.describe());
    assert!(out.stderr.contains(&format!("the upload to {url} was aborted")), "{}", out.describe());
    assert!(took < Duration::from_secs(5), "ferry took {took:?} to stop\n{}", out.describe());
    assert!(pending_uploads("sigint-bkt", "disk.raw").is_empty(), "the upload and its parts were left behind");
    assert!(keys("sigint-bkt").is_empty(), "an interrupted upload made an object");
}

#[test]
fn sigterm_during_a_resumable_s3_upload_keeps_and_names_it() {
    moto();
    make_bucket("sigterm-bkt");
    let tmp = tempfile::tempdir().unwrap();
    let src = source(tmp.path());
    let state = tmp.path().join("state");
    let url = "s3://sigterm-bkt/disk.raw";
    let args = ["copy", "--resume", "--resume-dir", s(&state), "-C", "2", "--requests", "1"];
    let child = start(s3ferry(args).args(["--rate", "4M", s(&src), url]));
    let id = wait_for_parts("sigterm-bkt", "disk.raw", 1);
    let (out, _) = interrupt(child, libc::SIGTERM);
    let id = id.unwrap_or_else(|| panic!("no part was stored before ferry ended\n{}", out.describe()));
    assert_eq!(out.status.code(), Some(143), "{}", out.describe());
    assert!(out.stderr.contains("interrupted by SIGTERM"), "{}", out.describe());
    assert!(out.stderr.contains(&format!("the upload {id} to {url} is kept")), "{}", out.describe());
    let kept = pending_uploads("sigterm-bkt", "disk.raw");
    assert_eq!(kept.len(), 1, "{kept:?}");
    assert_eq!(kept[0].0, id);
    assert_eq!(journals(&state).len(), 1, "the journal naming the upload is kept");
    // The same command finishes it.
    run_ok(s3ferry(args).args([s(&src), url]));
    assert_eq!(keys("sigterm-bkt"), ["disk.raw"]);
    assert!(pending_uploads("sigterm-bkt", "disk.raw").is_empty());
}

#[test]
fn an_interrupted_local_or_nbd_copy_fails_at_once() {
    let tmp = tempfile::tempdir().unwrap();
    let src = source(tmp.path());
    let dst = tmp.path().join("dst.raw");
    // A slow local copy: stopped while it waits for its rate.
    let child = start(Command::new(ferry_bin()).args(["copy", "--rate", "2M", s(&src), s(&dst)]));
    assert!(wait_until(Duration::from_secs(10), || std::fs::metadata(&dst).is_ok_and(|m| m.len() > 0)));
    let (out, took) = interrupt(child, libc::SIGINT);
    assert_eq!(out.status.code(), Some(130), "{}", out.describe());
    assert!(out.stderr.contains("ferry: error: interrupted by SIGINT"), "{}", out.describe());
    assert!(took < Duration::from_secs(5), "ferry took {took:?} to stop\n{}", out.describe());

    // Replies that come slowly (nbdkit's rate filter, 4 connections' requests queued
    // behind each other) do not hold the stop up.
    require("nbdkit");
    let kit = Nbdkit::start(tmp.path(), &["--filter=rate", "pattern", "64M", "rate=1M"]);
    let child = start(Command::new(ferry_bin()).args(["copy", &kit.uri(), "null:"]));
    // Its copy workers are running (so the handlers, installed first, are in place).
    let pid = child.id();
    assert!(wait_until(Duration::from_secs(10), || std::fs::read_dir(format!("/proc/{pid}/task"))
        .is_ok_and(|d| d.count() > 2)));
    std::thread::sleep(Duration::from_millis(300));
    let (out, took) = interrupt(child, libc::SIGTERM);
    assert_eq!(out.status.code(), Some(143), "{}", out.describe());
    assert!(took < Duration::from_secs(5), "ferry took {took:?} to stop\n{}", out.describe());

    assert!(!out.stderr.contains("panicked"), "{}", out.describe());
}

#[test]
fn a_second_signal_exits_at_once() {
    // An HTTP server that takes connections and never answers: opening the source waits,
    // and nothing there looks at the first signal.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/disk.raw", silent.local_addr().unwrap());
    let mut child = start(Command::new(ferry_bin()).args(["copy", &url, "null:"]));
    // Its connection shows it is past the handlers' installation (the first thing a copy
    // does), however slowly the loaded machine started it.
    silent.set_nonblocking(true).unwrap();
    let mut conn = None;
    assert!(wait_until(Duration::from_secs(10), || {
        conn = silent.accept().ok();
        conn.is_some()
    }));
    // SAFETY: kill(2) on our own child's pid.
    unsafe {
        libc::kill(child.id() as libc::pid_t, libc::SIGINT);
    }
    std::thread::sleep(Duration::from_millis(500));
    assert!(child.try_wait().unwrap().is_none(), "the first signal was meant to be noted, not to kill");
    let (out, took) = interrupt(child, libc::SIGTERM);
    assert_eq!(out.status.code(), Some(143), "{}", out.describe());
    assert!(took < Duration::from_secs(5), "{}", out.describe());
    drop((conn, silent));
}

/// Whether process `pid` is gone (or a zombie nobody has reaped yet).
fn gone(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat.rsplit_once(") ").is_some_and(|(_, rest)| rest.starts_with('Z') || rest.starts_with('X')),
    }
}

#[test]
fn serve_with_exit_with_parent_follows_its_parent() {
    use std::io::BufRead;
    let tmp = tempfile::tempdir().unwrap();
    let sock = tmp.path().join("nbd.sock");
    // A shell starts the server in the background, says its pid, and waits: killing the
    // shell (with -9: it cannot pass anything on) leaves the server an orphan.
    let script = format!(
        "{} serve --exit-with-parent -U {} memory:1M </dev/null >/dev/null 2>&1 & echo $!; wait",
        ferry_bin().display(),
        s(&sock)
    );
    let mut shell = spawn_serialized(Command::new("sh").args(["-c", &script]).stdout(Stdio::piped())).unwrap();
    let mut line = String::new();
    std::io::BufReader::new(shell.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let pid: u32 = line.trim().parse().unwrap();
    assert!(wait_until(Duration::from_secs(10), || std::os::unix::net::UnixStream::connect(&sock).is_ok()));
    std::thread::sleep(Duration::from_millis(200));
    assert!(!gone(pid), "the server ended before its parent did");
    shell.kill().unwrap();
    shell.wait().unwrap();
    let exited = wait_until(Duration::from_secs(3), || gone(pid));
    if !exited {
        // SAFETY: kill(2) on the server this test started.
        unsafe {
            libc::kill(pid as libc::pid_t, libc::SIGKILL);
        }
    }
    assert!(exited, "ferry serve --exit-with-parent outlived its parent by 3 s");
}

#[test]
fn export_name_names_the_positional_export() {
    let tmp = tempfile::tempdir().unwrap();
    let img = write_sparse_file(tmp.path(), "disk.raw", &Rng::new(5).bytes(MIB as usize));
    // The image is offered as "disk", beside a named scratch export: one opening of it.
    let mut srv = ServerBuilder::new(s(&img)).args(&["-x", "disk", "--export", "scratch=memory:2M"]).start();
    let out = run_ok(Command::new(ferry_bin()).args(["info", "--list", "--json", &srv.uri()]));
    let names: Vec<String> = serde_json::from_str::<serde_json::Value>(&out.stdout).unwrap()["exports"]
        .as_array()
        .unwrap_or_else(|| panic!("{}", out.describe()))
        .iter()
        .map(|e| e["export-name"].as_str().unwrap_or_default().to_string())
        .collect();
    let mut sorted = names.clone();
    sorted.sort();
    assert_eq!(sorted, ["disk", "scratch"], "{}", out.describe());
    if which("qemu-img").is_some() {
        let out = run_ok(&mut cmd("qemu-img", ["info", "--output=json", &srv.uri_export("disk")]));
        assert!(out.stdout.contains("\"virtual-size\": 1048576"), "{}", out.describe());
    }
    let back = tmp.path().join("back.raw");
    run_ok(Command::new(ferry_bin()).args(["copy", &srv.uri_export("disk"), s(&back)]));
    assert_eq!(std::fs::read(&back).unwrap(), std::fs::read(&img).unwrap());
    // No export is served for "": -x renames the default one, as qemu-nbd's -x does.
    run_fails(Command::new(ferry_bin()).args(["info", &srv.uri()]));
    srv.stop();

    // --run's $uri names the export.
    let out = run_ok(Command::new(ferry_bin()).args([
        "serve",
        "-U",
        s(&tmp.path().join("run.sock")),
        "-x",
        "disk",
        "pattern:1M",
        "--run",
        "echo \"$uri\"",
    ]));
    assert!(out.stdout.trim_end().starts_with("nbd+unix:///disk?socket="), "{}", out.describe());
}
