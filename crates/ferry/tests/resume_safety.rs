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
use ferry_testsupport::nginx::{Nginx, NginxConf, NginxSetup};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::OnceLock;
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

fn mode(p: &Path) -> u32 {
    std::fs::metadata(p).unwrap().permissions().mode() & 0o777
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
        if let Some(done) = child.try_wait().unwrap() {
            let mut err = String::new();
            if let Some(mut e) = child.stderr.take() {
                let _ = std::io::Read::read_to_string(&mut e, &mut err);
            }
            panic!("the copy ended ({done:?}) before its watermark reached {at}: slow it down\n{err}");
        }
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
        assert_eq!(mode(&self.state), 0o700, "the state directory is not its owner's only");
        assert_eq!(mode(&journal_in(&self.state).unwrap()), 0o600, "the journal is not its owner's only");
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

// ---------------------------------------------------------------------------------
// Block-device sources
// ---------------------------------------------------------------------------------

/// A loop device, detached when dropped.
struct Loop(String);

impl Loop {
    /// Attaches `file` to a free loop device; the test fails (it does not skip) where
    /// that is not possible.
    fn attach(file: &Path) -> Loop {
        let out = run(Command::new("losetup").args(["-f", "--show"]).arg(file));
        assert!(out.status.success(), "losetup cannot make a loop device (this test needs root):\n{}", out.describe());
        Loop(out.stdout.trim().to_string())
    }

    /// Attaches `file` to this loop device's node again (after [`Loop::detach`]).
    fn reattach(&self, file: &Path) {
        let mut last = String::new();
        // The kernel may take a moment to release the node.
        for _ in 0..50 {
            let out = run(Command::new("losetup").arg(&self.0).arg(file));
            if out.status.success() {
                return;
            }
            last = out.describe();
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("cannot attach {} to {}:\n{last}", file.display(), self.0);
    }

    fn detach(&self) {
        run_ok(Command::new("losetup").args(["-d", &self.0]));
    }
}

impl Drop for Loop {
    fn drop(&mut self) {
        let _ = Command::new("losetup").args(["-d", &self.0]).output();
    }
}

/// A loop device source given another file (same node, same size) between two runs is
/// not the same source: refused, nothing written. With the first file back it resumes,
/// and the result is that file.
#[test]
fn a_loop_device_given_other_contents_is_not_resumed_into() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("a.img"), dir.path().join("b.img"));
    let a_data = Rng::new(0xa).bytes(16 * MIB as usize);
    std::fs::write(&a, &a_data).unwrap();
    std::fs::write(&b, Rng::new(0xb).bytes(16 * MIB as usize)).unwrap();
    let lo = Loop::attach(&a);
    let dst = dir.path().join("dst.img");
    let journal = dir.path().join("dst.img.ferry-resume");
    let args = ["--resume", "--resume-interval", "1M", "--rate", "4M", &lo.0, dst.to_str().unwrap()];
    let mut child = ferry_copy(&args).spawn().expect("start ferry");
    let j = journal.clone();
    wait_watermark(&mut child, &|| Some(j.clone()), 2 * MIB);
    child.kill().unwrap();
    child.wait().unwrap();
    lo.detach();
    lo.reattach(&b);
    let before = std::fs::read(&dst).unwrap();
    let jbefore = std::fs::read(&journal).unwrap();
    let (ok, err) = run_copy(&["--resume", &lo.0, dst.to_str().unwrap()]);
    assert!(!ok, "a loop device given other contents was resumed into");
    assert!(err.contains("source is not the same") && err.contains("--restart"), "{err}");
    assert!(std::fs::read(&dst).unwrap() == before, "the refused copy wrote its destination");
    assert_eq!(std::fs::read(&journal).unwrap(), jbefore, "the refused copy changed the journal");
    lo.detach();
    lo.reattach(&a);
    let (ok, err) = run_copy(&["--resume", &lo.0, dst.to_str().unwrap()]);
    assert!(ok, "the same loop device and file again was not resumed: {err}");
    assert!(std::fs::read(&dst).unwrap() == a_data, "the destination differs from the source");
    assert!(!journal.exists());
}

// ---------------------------------------------------------------------------------
// HTTP sources: no secret in the journal, 0600, no links followed
// ---------------------------------------------------------------------------------

const USER1: (&str, &str) = ("alice", "Pa55-one-secret");
const USER2: (&str, &str) = ("bob", "Pa55-two-secret");
const SIG: &str = "X-Amz-Signature=deadbeefsecretsig";
const SIG2: &str = "X-Amz-Signature=cafef00dothersig";

/// An nginx serving disk.raw and other.raw (16 MiB each, other contents) under /auth/
/// to two Basic-auth users.
fn nginx() -> &'static Nginx {
    static NGINX: OnceLock<Nginx> = OnceLock::new();
    NGINX.get_or_init(|| {
        let setup = NginxSetup::new("ferry-resume-nginx");
        std::fs::write(setup.data().join("disk.raw"), Rng::new(0xd15c).bytes(16 * MIB as usize)).unwrap();
        std::fs::write(setup.data().join("other.raw"), Rng::new(0x07e4).bytes(16 * MIB as usize)).unwrap();
        let mut users = String::new();
        for (u, p) in [USER1, USER2] {
            setup.htpasswd(u, p);
            users += &std::fs::read_to_string(setup.dir().join("htpasswd")).unwrap();
        }
        std::fs::write(setup.dir().join("htpasswd"), users).unwrap();
        let dir = setup.dir().display();
        let server = format!(
            "location /auth/ {{ alias {dir}/data/; auth_basic \"ferry\"; auth_basic_user_file {dir}/htpasswd; }}"
        );
        setup.start(&NginxConf { ca_name: "ferry resume test CA", http: "access_log off;", server: &server })
    })
}

fn url(user: (&str, &str), object: &str, query: &str) -> String {
    format!("http://{}:{}@127.0.0.1:{}/auth/{object}?{query}", user.0, user.1, nginx().http)
}

#[track_caller]
fn assert_no_secret(what: &str, text: &str) {
    for secret in [USER1.1, USER2.1, SIG, SIG2, "deadbeef", "cafef00d", "X-Amz"] {
        assert!(!text.contains(secret), "{what} holds a secret ({secret}):\n{text}");
    }
}

/// A presigned, password-carrying source killed mid-copy: its journal is 0600 and holds
/// neither; another source onto the same destination is refused without printing any;
/// the same object with another password and another signature resumes.
#[test]
fn the_journal_of_an_http_source_holds_no_secret_and_a_resigned_url_resumes() {
    let n = nginx();
    let dir = tempfile::tempdir().unwrap();
    let dst = dir.path().join("dst.img");
    let journal = dir.path().join("dst.img.ferry-resume");
    let first = url(USER1, "disk.raw", SIG);
    let args = [
        "--resume",
        "--resume-interval",
        "1M",
        "--rate",
        "4M",
        "-C",
        "1",
        "--request-size",
        "256K",
        &first,
        dst.to_str().unwrap(),
    ];
    let mut child = ferry_copy(&args).spawn().expect("start ferry");
    let j = journal.clone();
    wait_watermark(&mut child, &|| Some(j.clone()), 2 * MIB);
    child.kill().unwrap();
    child.wait().unwrap();
    assert_eq!(mode(&journal), 0o600, "the journal is readable by others");
    let text = std::fs::read_to_string(&journal).unwrap();
    assert_no_secret("the journal", &text);
    assert!(text.contains("/auth/disk.raw"), "the journal does not name the source:\n{text}");
    // Another object onto the same destination: refused, and the message shows no secret.
    let (ok, err) =
        run_copy(&["--resume", "--request-size", "256K", &url(USER2, "other.raw", SIG2), dst.to_str().unwrap()]);
    assert!(!ok && err.contains("does not match") && err.contains("/auth/other.raw"), "{err}");
    assert_no_secret("the refusal", &err);
    // The same object signed again, fetched as another user: the same copy, resumed.
    let (ok, err) =
        run_copy(&["--resume", "--request-size", "256K", &url(USER2, "disk.raw", SIG2), dst.to_str().unwrap()]);
    assert!(ok, "a re-signed URL did not resume: {err}");
    assert_no_secret("the resumed copy's messages", &err);
    assert!(std::fs::read(&dst).unwrap() == std::fs::read(n.dir.join("data/disk.raw")).unwrap());
    assert!(!journal.exists());
}

/// A symbolic link planted at the journal's path is neither read nor written through:
/// the copy refuses it (naming it), --restart replaces the link, and its target is
/// never touched.
#[test]
fn a_link_planted_at_the_journal_path_is_not_followed() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src.img");
    std::fs::write(&src, Rng::new(3).bytes(4 * MIB as usize)).unwrap();
    let dst = dir.path().join("dst.img");
    let victim = dir.path().join("victim");
    std::fs::write(&victim, b"not a journal").unwrap();
    let journal = dir.path().join("dst.img.ferry-resume");
    std::os::unix::fs::symlink(&victim, &journal).unwrap();
    let (s, d) = (src.to_str().unwrap(), dst.to_str().unwrap());
    let (ok, err) = run_copy(&["--resume", s, d]);
    assert!(!ok && err.contains("symbolic link"), "{err}");
    assert_eq!(std::fs::read(&victim).unwrap(), b"not a journal");
    let (ok, err) = run_copy(&["--restart", "--resume-interval", "1M", s, d]);
    assert!(ok, "{err}");
    assert_eq!(std::fs::read(&victim).unwrap(), b"not a journal", "written through the planted link");
    assert!(std::fs::symlink_metadata(&journal).is_err(), "the journal outlived the copy");
    assert!(std::fs::read(&dst).unwrap() == std::fs::read(&src).unwrap());
}

/// An object replaced between a killed `--resume` copy and its rerun (same size, new
/// content, so a new ETag): the resumed copy is refused, since its first part came from
/// the old object; `--restart` then copies the new one whole.
#[test]
fn a_resumed_copy_of_a_replaced_http_object_is_refused() {
    let n = nginx();
    let object = n.dir.join("data/replaced.raw");
    let old = Rng::new(0x01d).bytes(16 * MIB as usize);
    std::fs::write(&object, &old).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let dst = dir.path().join("dst.img");
    let journal = dir.path().join("dst.img.ferry-resume");
    let src = url(USER1, "replaced.raw", SIG);
    let (s, d) = (src.as_str(), dst.to_str().unwrap());
    let args = ["--resume", "--resume-interval", "1M", "--rate", "4M", "-C", "1", "--request-size", "256K", s, d];
    let mut child = ferry_copy(&args).spawn().expect("start ferry");
    let j = journal.clone();
    wait_watermark(&mut child, &|| Some(j.clone()), 2 * MIB);
    child.kill().unwrap();
    child.wait().unwrap();
    let text = std::fs::read_to_string(&journal).unwrap();
    assert!(text.contains("etag="), "the journal does not pin the object's version:\n{text}");
    // nginx's ETag is the mtime and size: replace the object with another mtime.
    let new = Rng::new(0x4e3).bytes(16 * MIB as usize);
    std::fs::write(&object, &new).unwrap();
    run_ok(&mut cmd("touch", ["-d", "2001-01-01 00:00:00", object.to_str().unwrap()]));
    let (ok, err) = run_copy(&["--resume", "--request-size", "256K", s, d]);
    assert!(!ok && err.contains("does not match"), "a replaced object was resumed into: {err}");
    assert_no_secret("the refusal", &err);
    let (ok, err) = run_copy(&["--restart", "--request-size", "256K", s, d]);
    assert!(ok, "{err}");
    assert!(std::fs::read(&dst).unwrap() == new, "--restart did not copy the new object");
}
