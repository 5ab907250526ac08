//! `ferry copy --resume`: copies killed with SIGKILL at random moments and started again
//! end byte-identical to the source, reading again at most what was in flight plus one
//! journal interval per kill (counted by nbdkit's stats filter); journals that are
//! corrupt, truncated, of a changed source or of another ferry version are refused
//! without writing anything, and --restart then copies from the beginning.

use crate::common::*;
use ferry_client::copy::journal::Record;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

const SIZE: u64 = 32 * MIB;
/// --resume-interval of the killed NBD-source copies.
const INTERVAL: u64 = MIB;
/// Their requests: -C 1 -R 2 --request-size 256K.
const REQUEST: u64 = 256 * KIB;
const IN_FLIGHT: u64 = 2 * REQUEST;
/// --rate: a 32 MiB copy takes about 4 s, so kills land in the middle.
const RATE: &str = "8M";

/// What nbdkit's `pattern` plugin serves: each 8-byte word is its own offset, big-endian.
pub(crate) fn pattern(size: u64) -> Vec<u8> {
    (0..size / 8).flat_map(|i| (i * 8).to_be_bytes()).collect()
}

/// An nbdkit of our own (not [`Nbdkit`]): stopped with SIGTERM so that the stats filter
/// writes its file.
pub(crate) struct Kit {
    child: Child,
    sock: PathBuf,
}

impl Kit {
    pub(crate) fn start(sock: &Path, args: &[&str]) -> Kit {
        require("nbdkit");
        let _ = std::fs::remove_file(sock);
        let child = Command::new("nbdkit")
            .args(["-f", "--exit-with-parent", "-U"])
            .arg(sock)
            .args(args)
            .stdin(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start nbdkit");
        let ok = (0..200).any(|_| {
            std::thread::sleep(Duration::from_millis(50));
            std::os::unix::net::UnixStream::connect(sock).is_ok()
        });
        assert!(ok, "nbdkit did not start listening on {}", sock.display());
        Kit { child, sock: sock.to_owned() }
    }

    pub(crate) fn uri(&self) -> String {
        format!("nbd+unix:///?socket={}", self.sock.display())
    }

    /// SIGKILL, and waits for the exit: what the server had not written goes with it.
    pub(crate) fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM, and waits for the exit (the stats file is written then).
    pub(crate) fn stop(&mut self) {
        let _ = Command::new("kill").arg(self.child.id().to_string()).status();
        let _ = self.child.wait();
    }
}

impl Drop for Kit {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Bytes read according to nbdkit's stats file (`read: N ops, T s, X MiB, ...`).
fn stats_read_bytes(file: &Path) -> u64 {
    let text = std::fs::read_to_string(file).unwrap_or_else(|e| panic!("stats file {}: {e}", file.display()));
    let line = text.lines().find(|l| l.starts_with("read:")).unwrap_or_else(|| panic!("no read line in:\n{text}"));
    let field = line.split(", ").nth(2).unwrap_or_else(|| panic!("bad read line {line:?}"));
    let (num, unit) = field.split_once(' ').unwrap_or_else(|| panic!("bad size {field:?}"));
    let mult = match unit {
        "bytes" | "B" => 1.0,
        "KiB" => KIB as f64,
        "MiB" => MIB as f64,
        "GiB" => (1u64 << 30) as f64,
        u => panic!("unit {u:?} in {line:?}"),
    };
    (num.parse::<f64>().unwrap() * mult) as u64
}

pub(crate) fn ferry_copy(args: &[&str]) -> Command {
    let mut c = Command::new(ferry_bin());
    c.arg("copy").args(args).stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::piped());
    c
}

/// Starts `ferry copy ARGS` and kills it with SIGKILL after `after`.
fn kill_after(args: &[&str], after: Duration) {
    let mut child = ferry_copy(args).stderr(Stdio::null()).spawn().expect("start ferry");
    std::thread::sleep(after);
    let done = child.try_wait().unwrap();
    assert!(done.is_none(), "the copy ended before it was killed ({done:?}): slow it down");
    child.kill().unwrap();
    child.wait().unwrap();
}

/// Starts `ferry copy ARGS`, waits until its journal has a watermark of at least `at`,
/// then `jitter` more, and kills it with SIGKILL. Progress, not time, picks the moment,
/// so a loaded machine does not move it.
fn kill_at_progress(args: &[&str], journal: &dyn Fn() -> PathBuf, at: u64, jitter: Duration) {
    let mut child = ferry_copy(args).stderr(Stdio::null()).spawn().expect("start ferry");
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let w = std::fs::read(journal()).ok().and_then(|b| Record::decode(&b).ok()).map_or(0, |r| r.watermark);
        if w >= at {
            break;
        }
        let done = child.try_wait().unwrap();
        assert!(done.is_none(), "the copy ended ({done:?}) before its watermark reached {at}: slow it down");
        assert!(std::time::Instant::now() < deadline, "the watermark stayed at {w}, below {at}, for 60 s");
        std::thread::sleep(Duration::from_millis(10));
    }
    std::thread::sleep(jitter);
    child.kill().unwrap();
    child.wait().unwrap();
}

/// Runs `ferry copy ARGS` to its end; (exit success, stderr).
pub(crate) fn run_copy(args: &[&str]) -> (bool, String) {
    let out = ferry_copy(args).output().expect("run ferry");
    (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
}

fn watermark(journal: &Path) -> u64 {
    Record::decode(&std::fs::read(journal).unwrap()).unwrap().watermark
}

/// Kills the copy `args` at three random moments, then lets it finish; returns the
/// watermarks seen after each kill.
fn kill_three_times_then_finish(args: &[&str], journal: &dyn Fn() -> PathBuf, seed: u64) -> Vec<u64> {
    let mut rng = Rng::new(seed);
    let mut marks = Vec::new();
    // Once 10%, 40% and 80% of the source is flushed, plus 0-300 ms (up to 2.4 MiB more
    // at the rate), so the kill lands at a random place between two journal stores.
    for pct in [10u64, 40, 80] {
        let jitter = Duration::from_millis(rng.below(300));
        kill_at_progress(args, journal, SIZE * pct / 100, jitter);
        let j = journal();
        assert!(j.exists(), "a --resume copy killed past {pct}% left no journal at {}", j.display());
        marks.push(watermark(&j));
    }
    let (ok, err) = run_copy(args);
    assert!(ok, "the resumed copy failed: {err}");
    assert!(!journal().exists(), "the journal outlived the completed copy");
    marks
}

/// The bound of the brief: each kill re-reads at most what was in flight plus one
/// interval (what completed since the last stored watermark is at most one interval plus
/// what completed while the worker emptied its slots for the store, and what was in
/// flight at the kill); one more request of slack. Per kill 2.25 MiB here, against the
/// 3-10 MiB each killed run copied: a copy that did not resume from its watermark fails.
fn assert_reread_bound(read: u64, kills: u64) {
    let reread = read.saturating_sub(SIZE);
    let bound = kills * (INTERVAL + 2 * IN_FLIGHT + REQUEST);
    eprintln!("read {read} bytes for a {SIZE}-byte source over {kills} kills: {reread} read twice (bound {bound})");
    assert!(reread <= bound, "{reread} bytes read twice over {kills} kills, more than {bound}");
}

#[test]
fn nbd_to_file_killed_at_random_moments_resumes_byte_identical() {
    let dir = tempfile::tempdir().unwrap();
    let stats = dir.path().join("stats.txt");
    let statsfile = format!("statsfile={}", stats.display());
    let mut kit = Kit::start(&dir.path().join("src.sock"), &["--filter=stats", "pattern", "32M", &statsfile]);
    let dst = dir.path().join("dst.img");
    let (uri, d) = (kit.uri(), dst.display().to_string());
    let args = [
        "--resume",
        "--resume-interval",
        "1M",
        "--rate",
        RATE,
        "-C",
        "1",
        "-R",
        "2",
        "--request-size",
        "256K",
        &uri,
        &d,
    ];
    let jpath = dir.path().join("dst.img.ferry-resume");
    let marks = kill_three_times_then_finish(&args, &|| jpath.clone(), 1);
    assert!(marks.windows(2).all(|m| m[0] <= m[1]), "a resumed run's watermark went back: {marks:?}");
    assert!(std::fs::read(&dst).unwrap() == pattern(SIZE), "the destination differs from the source");
    kit.stop();
    assert_reread_bound(stats_read_bytes(&stats), 3);
}

#[test]
fn nbd_to_nbd_killed_at_random_moments_resumes_byte_identical() {
    let dir = tempfile::tempdir().unwrap();
    let stats = dir.path().join("stats.txt");
    let statsfile = format!("statsfile={}", stats.display());
    let mut src = Kit::start(&dir.path().join("src.sock"), &["--filter=stats", "pattern", "32M", &statsfile]);
    let dst = Kit::start(&dir.path().join("dst.sock"), &["memory", "32M"]);
    let state = dir.path().join("state");
    let (su, du, sd) = (src.uri(), dst.uri(), state.display().to_string());
    let args = [
        "--resume",
        "--resume-dir",
        &sd,
        "--resume-interval",
        "1M",
        "--rate",
        RATE,
        "-C",
        "1",
        "-R",
        "2",
        "--request-size",
        "256K",
        &su,
        &du,
    ];
    let journal = || {
        // A store in progress has its temporary file beside the journal.
        let found: Vec<PathBuf> = std::fs::read_dir(&state).map_or(Vec::new(), |r| {
            r.map(|e| e.unwrap().path()).filter(|p| p.extension().is_some_and(|x| x == "ferry-resume")).collect()
        });
        assert!(found.len() <= 1, "more than one journal: {found:?}");
        found.into_iter().next().unwrap_or_else(|| state.join("missing"))
    };
    let marks = kill_three_times_then_finish(&args, &journal, 2);
    assert!(marks.windows(2).all(|m| m[0] <= m[1]), "a resumed run's watermark went back: {marks:?}");
    let back = dir.path().join("back.img");
    let (ok, err) = run_copy(&[&du, back.to_str().unwrap()]);
    assert!(ok, "reading the destination back: {err}");
    assert!(std::fs::read(&back).unwrap() == pattern(SIZE), "the destination differs from the source");
    src.stop();
    assert_reread_bound(stats_read_bytes(&stats), 3);
}

#[test]
fn file_to_new_qcow2_killed_and_resumed_compares_equal() {
    require("qemu-img");
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src.img");
    // Data with holes and zero runs, so the new image's zeroed state matters.
    let mut data = Rng::new(7).bytes(SIZE as usize);
    for hole in [(4 * MIB, 3 * MIB), (20 * MIB, 5 * MIB)] {
        data[hole.0 as usize..(hole.0 + hole.1) as usize].fill(0);
    }
    std::fs::write(&src, &data).unwrap();
    let dst = dir.path().join("dst.qcow2");
    let (s, d) = (src.display().to_string(), dst.display().to_string());
    let args = ["--resume", "--resume-interval", "2M", "--rate", RATE, "-C", "2", "-R", "2", &s, &d];
    let jpath = dir.path().join("dst.qcow2.ferry-resume");
    let marks = kill_three_times_then_finish(&args, &|| jpath.clone(), 3);
    assert!(marks.windows(2).all(|m| m[0] <= m[1]), "a resumed run's watermark went back: {marks:?}");
    run_ok(Command::new("qemu-img").args(["compare", "-f", "raw", "-F", "qcow2", &s, &d]));
    run_ok(Command::new("qemu-img").args(["check", &d]));
}

/// A copy killed once, leaving a journal with a watermark above 0; returns (source,
/// destination, journal) in `dir`.
fn interrupted(dir: &Path) -> (PathBuf, PathBuf, PathBuf) {
    let src = dir.join("src.img");
    std::fs::write(&src, Rng::new(11).bytes(SIZE as usize)).unwrap();
    let dst = dir.join("dst.img");
    let args = resumable(&src, &dst);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let j = dir.join("dst.img.ferry-resume");
    kill_at_progress(&args, &|| j.clone(), 4 * MIB, Duration::from_millis(100));
    assert!(watermark(&j) >= 4 * MIB, "the killed copy's watermark went back");
    (src, dst, j)
}

fn resumable(src: &Path, dst: &Path) -> Vec<String> {
    ["--resume", "--resume-interval", "2M", "--rate", RATE]
        .iter()
        .map(|s| s.to_string())
        .chain([src.display().to_string(), dst.display().to_string()])
        .collect()
}

/// `ferry copy --resume SRC DST` is refused (exit != 0, the message names the problem and
/// --restart), nothing is written; then --restart copies the whole source.
fn refused_then_restart(src: &Path, dst: &Path, journal: &Path, says: &str) {
    let before = std::fs::read(dst).unwrap();
    let jbefore = std::fs::read(journal).unwrap();
    let (ok, err) = run_copy(&["--resume", src.to_str().unwrap(), dst.to_str().unwrap()]);
    assert!(!ok, "a bad journal was used");
    assert!(err.contains(says) && err.contains("--restart"), "the refusal does not say {says:?} and --restart: {err}");
    assert!(std::fs::read(dst).unwrap() == before, "the refused copy wrote its destination");
    assert_eq!(std::fs::read(journal).unwrap(), jbefore, "the refused copy changed the journal");
    let (ok, err) = run_copy(&["--restart", src.to_str().unwrap(), dst.to_str().unwrap()]);
    assert!(ok, "--restart failed: {err}");
    assert!(std::fs::read(dst).unwrap() == std::fs::read(src).unwrap(), "--restart did not copy the source");
    assert!(!journal.exists(), "the journal outlived the restarted copy");
}

#[test]
fn corrupt_truncated_changed_or_foreign_journals_are_refused_and_restart_works() {
    // A flipped byte.
    let dir = tempfile::tempdir().unwrap();
    let (src, dst, j) = interrupted(dir.path());
    let mut b = std::fs::read(&j).unwrap();
    b[40] ^= 0x20;
    std::fs::write(&j, &b).unwrap();
    refused_then_restart(&src, &dst, &j, "checksum");

    // Truncated.
    let dir = tempfile::tempdir().unwrap();
    let (src, dst, j) = interrupted(dir.path());
    let b = std::fs::read(&j).unwrap();
    std::fs::write(&j, &b[..b.len() / 2]).unwrap();
    refused_then_restart(&src, &dst, &j, "not usable");

    // Another ferry version (a well-formed journal otherwise).
    let dir = tempfile::tempdir().unwrap();
    let (src, dst, j) = interrupted(dir.path());
    let mut r = Record::decode(&std::fs::read(&j).unwrap()).unwrap();
    r.ferry_version = "0.0.1-other".into();
    std::fs::write(&j, r.encode()).unwrap();
    refused_then_restart(&src, &dst, &j, "ferry 0.0.1-other");

    // The source changed since (same bytes, new mtime).
    let dir = tempfile::tempdir().unwrap();
    let (src, dst, j) = interrupted(dir.path());
    std::thread::sleep(Duration::from_millis(20));
    let data = std::fs::read(&src).unwrap();
    std::fs::write(&src, &data).unwrap();
    refused_then_restart(&src, &dst, &j, "source is not the same");

    // Another destination's journal (copied beside this one).
    let dir = tempfile::tempdir().unwrap();
    let (src, dst, j) = interrupted(dir.path());
    let other = dir.path().join("other.img");
    std::fs::copy(&dst, &other).unwrap();
    let oj = dir.path().join("other.img.ferry-resume");
    std::fs::copy(&j, &oj).unwrap();
    refused_then_restart(&src, &other, &oj, "destination is not the same");
}

#[test]
fn journal_only_with_resume_and_gone_after_completion() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src.img");
    std::fs::write(&src, Rng::new(5).bytes(SIZE as usize)).unwrap();
    let dst = dir.path().join("dst.img");
    let j = dir.path().join("dst.img.ferry-resume");
    let (s, d) = (src.to_str().unwrap(), dst.to_str().unwrap());
    // Without --resume nothing is journalled, even when killed.
    kill_after(&["--rate", RATE, s, d], Duration::from_millis(800));
    assert!(!j.exists(), "a copy without --resume wrote a journal");
    // An uninterrupted --resume copy leaves none.
    let (ok, err) = run_copy(&["--resume", s, d]);
    assert!(ok, "{err}");
    assert!(!j.exists(), "the journal outlived the completed copy");
    assert!(std::fs::read(&dst).unwrap() == std::fs::read(&src).unwrap());
    // A copy without --resume removes the journal of an interrupted --resume copy (it
    // rewrites the destination, so that journal would lie).
    let args = resumable(&src, &dst);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    kill_at_progress(&args, &|| j.clone(), 1, Duration::ZERO);
    assert!(j.exists());
    let (ok, err) = run_copy(&[s, d]);
    assert!(ok, "{err}");
    assert!(!j.exists(), "a copy without --resume left a stale journal");
    // --resume with a stream source is refused before anything is written.
    let (ok, err) = run_copy(&["--resume", "-", d]);
    assert!(!ok && err.contains("stream"), "{err}");
}

#[test]
fn a_resumed_copy_verifies_and_hashes_the_whole_source() {
    let dir = tempfile::tempdir().unwrap();
    let (src, dst, j) = interrupted(dir.path());
    let (s, d) = (src.to_str().unwrap(), dst.to_str().unwrap());
    let out = Command::new(ferry_bin()).args(["copy", "--resume", "--verify", s, d]).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(!j.exists());
    let digests: Vec<&str> = stdout.lines().map(|l| l.split_whitespace().next().unwrap_or("")).collect();
    assert_eq!(digests.len(), 2, "{stdout}");
    let whole = Command::new(ferry_bin()).args(["hash", s]).output().unwrap();
    let whole = String::from_utf8_lossy(&whole.stdout).split_whitespace().next().unwrap_or("").to_string();
    assert!(
        digests[0] == whole && digests[1] == whole,
        "resumed copy printed {digests:?}, `ferry hash` of the source {whole}"
    );
}
