//! `ferry copy --resume` must never end with exit 0 and a destination that differs from
//! the source (issue 28):
//!
//! * a destination server killed with -9 and started again mid-copy loses what it had
//!   acknowledged but not flushed (nbdkit's cache filter in write-back mode): the copy
//!   that reconnects sends it again, and a journal stored after the reconnect does not
//!   claim it, so a later `--resume` run fills it too;
//! * a block-device source re-created with other contents (a loop device given another
//!   file) is refused, and resumes once the first file is back;
//! * the journal of an HTTP source keeps no password and no query string, is 0600, is
//!   not written through a planted symlink, and a re-signed URL resumes.

use crate::common::*;
use crate::copy_resume::{ferry_copy, pattern, run_copy, Kit};
use ferry_client::copy::journal::Record;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::{Duration, Instant};

const SIZE: u64 = 32 * MIB;

/// The one journal in a state directory, if any (a store in progress has its temporary
/// file beside it, under another name).
fn journal_in(state: &Path) -> Option<PathBuf> {
    let found: Vec<PathBuf> = std::fs::read_dir(state).map_or(Vec::new(), |r| {
        r.map(|e| e.unwrap().path()).filter(|p| p.extension().is_some_and(|x| x == "ferry-resume")).collect()
    });
    assert!(found.len() <= 1, "more than one journal: {found:?}");
    found.into_iter().next()
}

fn watermark_at(journal: &Path) -> u64 {
    std::fs::read(journal).ok().and_then(|b| Record::decode(&b).ok()).map_or(0, |r| r.watermark)
}

/// Waits until the journal `journal()` names has a watermark of at least `at`; the copy
/// `child` must still run.
fn wait_watermark(child: &mut Child, journal: &dyn Fn() -> Option<PathBuf>, at: u64) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let w = journal().map_or(0, |j| watermark_at(&j));
        if w >= at {
            return w;
        }
        let done = child.try_wait().unwrap();
        assert!(done.is_none(), "the copy ended ({done:?}) before its watermark reached {at}: slow it down");
        assert!(Instant::now() < deadline, "the watermark stayed at {w}, below {at}, for 60 s");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A pattern source file, a zeroed destination file behind nbdkit's file plugin with the
/// cache filter in write-back mode (what it acknowledges stays in nbdkit's own cache
/// until a flush), and the `--resume` copy between them.
struct Restart {
    _dir: tempfile::TempDir,
    img: PathBuf,
    state: PathBuf,
    sock: PathBuf,
    kit_args: Vec<String>,
    kit: Kit,
    args: Vec<String>,
}

impl Restart {
    fn new() -> Restart {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("src.img");
        std::fs::write(&src, pattern(SIZE)).unwrap();
        let img = dir.path().join("dst.img");
        std::fs::write(&img, vec![0u8; SIZE as usize]).unwrap();
        let sock = dir.path().join("dst.sock");
        let kit_args: Vec<String> = ["--filter=cache", "file", img.to_str().unwrap(), "cache=writeback"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let kit = Kit::start(&sock, &kit_args.iter().map(String::as_str).collect::<Vec<_>>());
        let state = dir.path().join("state");
        let args = [
            "--resume",
            "--resume-dir",
            state.to_str().unwrap(),
            "--resume-interval",
            "1M",
            "--rate",
            "8M",
            "--retries",
            "20",
            "--retry-delay",
            "0.2",
            "-C",
            "1",
            "-R",
            "2",
            "--request-size",
            "256K",
            src.to_str().unwrap(),
            &kit.uri(),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        Restart { _dir: dir, img, state, sock, kit_args, kit, args }
    }

    fn args(&self) -> Vec<&str> {
        self.args.iter().map(String::as_str).collect()
    }

    /// Starts the copy, and once its watermark is at 8 MiB kills the destination server
    /// with -9 (losing what it had not flushed) and starts it again on its socket.
    fn copy_and_restart_destination(&mut self) -> Child {
        let mut child = ferry_copy(&self.args()).spawn().expect("start ferry");
        let state = self.state.clone();
        wait_watermark(&mut child, &|| journal_in(&state), 8 * MIB);
        // Half a journal interval on (at the rate), so that writes acknowledged since
        // the last flush are lost with the server.
        std::thread::sleep(Duration::from_millis(70));
        self.kit.kill9();
        std::thread::sleep(Duration::from_millis(300));
        self.kit = Kit::start(&self.sock, &self.kit_args.iter().map(String::as_str).collect::<Vec<_>>());
        child
    }

    fn assert_destination_is_the_source(&mut self) {
        // The copy flushed; SIGTERM lets nbdkit go.
        self.kit.stop();
        let got = std::fs::read(&self.img).unwrap();
        let want = pattern(SIZE);
        let differ = got.chunks(64 * 1024).zip(want.chunks(64 * 1024)).filter(|(a, b)| a != b).count();
        assert!(differ == 0, "the destination differs from the source in {differ} of its 64 KiB blocks");
    }
}

/// The copy that reconnects to the restarted destination sends again what the lost
/// server acknowledged after the last flush, and succeeds with an exact destination.
#[test]
fn a_copy_whose_destination_lost_unflushed_writes_sends_them_again() {
    require("nbdkit");
    let mut r = Restart::new();
    let child = r.copy_and_restart_destination();
    let o = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "the copy failed: {stderr}");
    assert!(journal_in(&r.state).is_none(), "the journal outlived the copy");
    r.assert_destination_is_the_source();
    assert!(stderr.contains("reconnecting") && stderr.contains("again"), "{stderr}");
}

/// The copy killed after it reconnected (and stored watermarks past the lost writes'
/// place): the resumed run fills what the lost server never wrote.
#[test]
fn a_journal_stored_after_a_destination_restart_does_not_claim_lost_writes() {
    require("nbdkit");
    let mut r = Restart::new();
    let mut child = r.copy_and_restart_destination();
    let state = r.state.clone();
    wait_watermark(&mut child, &|| journal_in(&state), 16 * MIB);
    child.kill().unwrap();
    child.wait().unwrap();
    let args: Vec<&str> = r.args().into_iter().filter(|a| *a != "--rate" && *a != "8M").collect();
    let (ok, err) = run_copy(&args);
    assert!(ok, "the resumed copy failed: {err}");
    r.assert_destination_is_the_source();
}
