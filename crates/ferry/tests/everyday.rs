//! The last leftovers of issue 37 (everyday administration), through the CLI:
//!
//! * `ferry mount --daemon` returns once the file system is up, its messages go to
//!   `--log FILE`, an unmount ends the background process; a mount that cannot be made
//!   exits with its error's status and leaves no process behind;
//! * `ferry compare` skips what block status says reads as zeroes, on either side, and
//!   still finds a difference there: sparse files, a qcow2 image, a snapshot, against
//!   `qemu-img compare`'s verdicts;
//! * the shared passphrase flags: `--password-command` where it was missing
//!   (`repo protect`, `repo copy`'s source).

use crate::common::*;
use crate::repo_crash::{ferry_cmd, s};
use std::fs;
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

const MIB: usize = 1 << 20;

fn code(out: &Output) -> i32 {
    out.status.code().unwrap_or_else(|| panic!("killed\n{}", out.describe()))
}

fn is_mounted(dir: &Path) -> bool {
    let dir = fs::canonicalize(dir).unwrap();
    fs::read_to_string("/proc/self/mounts").unwrap().lines().any(|l| l.split(' ').nth(1) == Some(s(&dir)))
}

/// The processes whose command line names `needle` (a mount point of this test), other
/// than zombies (a reaped background process's parent may be a container's first
/// process, which collects no children).
fn processes_naming(needle: &str) -> Vec<u32> {
    let mut found = Vec::new();
    for e in fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else { continue };
        let cmdline = fs::read(e.path().join("cmdline")).unwrap_or_default();
        let stat = fs::read_to_string(e.path().join("stat")).unwrap_or_default();
        let zombie = stat.rsplit_once(')').is_some_and(|(_, rest)| rest.trim_start().starts_with('Z'));
        if !zombie && String::from_utf8_lossy(&cmdline).contains(needle) {
            found.push(pid);
        }
    }
    found
}

fn unmount(dir: &Path) {
    let root = fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(1) == Some("0"));
    match root {
        true => run_ok(&mut cmd("umount", [s(dir)])),
        false => run_ok(&mut cmd("fusermount3", ["-u", s(dir)])),
    };
}

#[test]
fn mount_daemon_returns_once_mounted_and_an_unmount_ends_it() {
    assert!(which("fusermount3").is_some() || which("fusermount").is_some(), "install fuse3 (fusermount3)");
    let d = tempfile::tempdir().unwrap();
    let data = Rng::new(37).bytes(4 * MIB);
    let disk = d.path().join("d.raw");
    fs::write(&disk, &data).unwrap();
    let repo = d.path().join("repo");
    run_ok(ferry_cmd(&["repo", "init", "--encrypt", "--kdf-memory", "8M", s(&repo)]).env("FERRY_PASSWORD", "pw"));
    run_ok(ferry_cmd(&["backup", s(&disk), &format!("{}::vm", repo.display())]).env("FERRY_PASSWORD", "pw"));

    // Up when the command returns: no wait. Its output pipes are closed by then (the
    // test reads both to their end), and the passphrase came from --password-command.
    let dir = d.path().join("mnt-daemon");
    fs::create_dir(&dir).unwrap();
    let log = d.path().join("mount.log");
    let t0 = Instant::now();
    // The repository and the log named relative to the working directory, which the
    // daemon leaves.
    let o = run(ferry_cmd(&[
        "mount",
        "--daemon",
        "--log",
        "mount.log",
        "--password-command",
        "echo pw",
        "repo::vm",
        s(&dir),
    ])
    .current_dir(d.path()));
    assert_eq!(code(&o), 0, "{}", o.describe());
    assert!(t0.elapsed() < Duration::from_secs(60));
    assert!(is_mounted(&dir), "not mounted when --daemon returned: {}", o.describe());
    assert_same_bytes(&fs::read(dir.join("disk.raw")).unwrap(), &data, "disk.raw");
    let pids = processes_naming(s(&dir));
    assert_eq!(pids.len(), 1, "one background process: {pids:?}");
    // It holds no pipe of the command's nor its terminal: a last error would go to its
    // log rather than fail on a pipe nobody reads.
    for fd in 0..3 {
        let to = fs::read_link(format!("/proc/{}/fd/{fd}", pids[0])).unwrap();
        assert_eq!(to, Path::new("/dev/null"), "fd {fd}");
    }
    assert_eq!(fs::read_link(format!("/proc/{}/cwd", pids[0])).unwrap(), Path::new("/"), "its working directory");
    // Its messages are in the log, not on the terminal it was started from.
    let said = fs::read_to_string(&log).unwrap();
    assert!(said.contains(&format!("mounted on {} by process {}", dir.display(), pids[0])), "{said}");
    assert!(!o.stderr.contains("mounted on"), "{}", o.describe());

    // An unmount ends it.
    unmount(&dir);
    let gone = wait_until(Duration::from_secs(20), || processes_naming(s(&dir)).is_empty());
    assert!(gone, "the background process is still there after the unmount: {}", fs::read_to_string(&log).unwrap());
    assert!(fs::read_to_string(&log).unwrap().contains("unmounted"));

    // Until it is up, the background process has the command's standard input: a password
    // command (or the prompt) reads it there.
    let stdin_dir = d.path().join("mnt-stdin");
    fs::create_dir(&stdin_dir).unwrap();
    fs::write(d.path().join("answer"), "pw\n").unwrap();
    let snapshot = format!("{}::vm", repo.display());
    let args = ["mount", "-d", "--log", s(&log), "--password-command", "head -n1", &snapshot, s(&stdin_dir)];
    let o = cmd("timeout", [&["60", s(&ferry_bin())][..], &args].concat())
        .env_remove("FERRY_PASSWORD")
        .stdin(fs::File::open(d.path().join("answer")).unwrap())
        .output()
        .unwrap();
    assert!(o.status.success(), "{:?}: {}", o.status, String::from_utf8_lossy(&o.stderr));
    assert!(is_mounted(&stdin_dir));
    unmount(&stdin_dir);
    assert!(wait_until(Duration::from_secs(20), || processes_naming(s(&stdin_dir)).is_empty()));

    // A mount that cannot be made: its error and status, and no process left behind.
    let dir = d.path().join("mnt-fails");
    fs::create_dir(&dir).unwrap();
    for (snapshot, want, says) in [
        (format!("{}::vm", d.path().join("none").display()), 10, "none"),
        (format!("{}::nope", repo.display()), 1, "nope"),
    ] {
        let o = run(ferry_cmd(&["mount", "-d", "--log", s(&log), &snapshot, s(&dir)])
            .env("FERRY_PASSWORD", "pw")
            .stdin(Stdio::null()));
        assert_eq!(code(&o), want, "{}", o.describe());
        assert!(o.stderr.contains(says), "the error is on the caller's terminal: {}", o.describe());
        assert!(!is_mounted(&dir));
        assert!(processes_naming(s(&dir)).is_empty(), "a failed --daemon left a process");
    }
    // A password command that leaves something behind holding the background process's
    // standard error (an agent): the failed mount still returns at once, with its status.
    let t0 = Instant::now();
    let o = run(ferry_cmd(&[
        "mount",
        "-d",
        "--log",
        s(&log),
        "--password-command",
        "sleep 20 >/dev/null & echo pw",
        &format!("{}::nope", repo.display()),
        s(&dir),
    ])
    .stdin(Stdio::null()));
    assert_eq!(code(&o), 1, "{}", o.describe());
    assert!(o.stderr.contains("nope"), "{}", o.describe());
    assert!(t0.elapsed() < Duration::from_secs(10), "waited for the agent: {:?}", t0.elapsed());
    // --log without --daemon: a usage error.
    let o = run(&mut ferry_cmd(&["mount", "--log", s(&log), &format!("{}::vm", repo.display()), s(&dir)]));
    assert_eq!(code(&o), 2, "{}", o.describe());
}

/// `qemu-img compare`'s and `ferry compare`'s exit status and verdict for one pair.
fn both(a: &Path, b: &Path) -> (i32, String) {
    let q = run(&mut cmd("qemu-img", ["compare", s(a), s(b)]));
    let f = run(&mut ferry_cmd(&["compare", s(a), s(b)]));
    assert_eq!(code(&f), code(&q), "ferry compare {a:?} {b:?}: {}\nqemu-img: {}", f.describe(), q.describe());
    assert_eq!(f.stdout, q.stdout, "ferry compare {a:?} {b:?}");
    (code(&f), f.stdout)
}

#[test]
fn compare_skips_zeroes_by_block_status_and_still_finds_differences_there() {
    require("qemu-img");
    let d = tempfile::tempdir().unwrap();
    // 8 MiB with data in MiB 3 only: the rest is holes in the sparse files.
    let mut data = vec![0u8; 8 * MIB];
    data[3 * MIB..4 * MIB].copy_from_slice(&Rng::new(5).bytes(MIB));
    let sparse = write_sparse_file(d.path(), "sparse.raw", &data);
    let dense = d.path().join("dense.raw");
    fs::write(&dense, &data).unwrap();
    let qcow2 = d.path().join("sparse.qcow2");
    run_ok(&mut cmd("qemu-img", ["convert", "-q", "-O", "qcow2", s(&sparse), s(&qcow2)]));
    for (a, b) in [(&sparse, &dense), (&dense, &sparse), (&sparse, &qcow2), (&qcow2, &dense)] {
        assert_eq!(both(a, b), (0, "Images are identical.\n".into()));
    }
    // A byte where the other side has a hole (both ways), in a block that is half hole
    // and half data, and past a hole on both sides: each found at its offset.
    for at in [5 * MIB + 4097, 4 * MIB - 1, 3 * MIB, 7 * MIB + 511] {
        let mut other = data.clone();
        other[at] ^= 0x40;
        let changed = write_sparse_file(d.path(), "changed.raw", &other);
        let want = format!("Content mismatch at offset {}!\n", at / 512 * 512);
        assert_eq!(both(&sparse, &changed), (1, want.clone()), "byte {at}");
        assert_eq!(both(&changed, &qcow2), (1, want.clone()), "byte {at}");
        // A snapshot against the file: the same verdict.
        let repo = d.path().join("repo");
        if !repo.exists() {
            run_ok(&mut ferry_cmd(&["repo", "init", s(&repo)]));
            run_ok(&mut ferry_cmd(&["backup", s(&sparse), &format!("{}::disk", repo.display())]));
        }
        let snap = format!("{}::disk", repo.display());
        let o = run(&mut ferry_cmd(&["compare", &snap, s(&changed)]));
        assert_eq!((code(&o), o.stdout.as_str()), (1, want.as_str()), "{}", o.describe());
        let o = run(&mut ferry_cmd(&["compare", s(&qcow2), &snap]));
        assert_eq!((code(&o), o.stdout.as_str()), (0, "Images are identical.\n"), "{}", o.describe());
    }
}

/// Holes are not read: two 64 GiB sparse files with a few bytes of data compare in
/// moments (reading them, as before, took minutes), and a difference past the holes is
/// found at its offset.
#[test]
fn compare_does_not_read_holes() {
    use std::os::unix::fs::FileExt;
    let d = tempfile::tempdir().unwrap();
    let (a, b) = (d.path().join("a.raw"), d.path().join("b.raw"));
    for p in [&a, &b] {
        let f = fs::File::create(p).unwrap();
        f.set_len(64 << 30).unwrap();
        f.write_all_at(b"data", 40 << 30).unwrap();
    }
    let timed = |args: &[&str]| {
        let t0 = Instant::now();
        let o = run(&mut cmd("timeout", [&["60", s(&ferry_bin())], args].concat()));
        (o, t0.elapsed())
    };
    let (o, took) = timed(&["compare", s(&a), s(&b)]);
    assert_eq!((code(&o), o.stdout.as_str()), (0, "Images are identical.\n"), "{}", o.describe());
    assert!(took < Duration::from_secs(30), "{took:?}");
    fs::File::options().write(true).open(&b).unwrap().write_all_at(b"x", (50 << 30) + 7).unwrap();
    let (o, _) = timed(&["compare", s(&a), s(&b)]);
    assert_eq!(o.stdout, format!("Content mismatch at offset {}!\n", 50u64 << 30), "{}", o.describe());
}

/// `qemu-nbd` takes one client at a time by default (`-e 1`): compare asks its block
/// status on the connection it reads with, and so finishes, with one thread, in moments
/// (a second connection for block status waited for the first until the client gave up).
#[test]
fn compare_against_qemu_nbd_serving_one_client() {
    require("qemu-nbd");
    let d = tempfile::tempdir().unwrap();
    let mut data = vec![0u8; 4 * MIB];
    data[MIB..2 * MIB].copy_from_slice(&Rng::new(6).bytes(MIB));
    let served = write_sparse_file(d.path(), "served.raw", &data);
    let mut other = data.clone();
    other[MIB + 4097] ^= 1;
    let changed = write_sparse_file(d.path(), "changed.raw", &other);
    let sock = d.path().join("nbd.sock");
    let mut server = cmd("qemu-nbd", ["-t", "-r", "-f", "raw", "-k", s(&sock), s(&served)])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    assert!(wait_until(Duration::from_secs(10), || sock.exists()), "qemu-nbd did not start");
    let uri = format!("nbd+unix:///?socket={}", sock.display());
    let t0 = Instant::now();
    let o = run(&mut ferry_cmd(&["compare", "-t", "1", &uri, s(&served)]));
    let o2 = run(&mut ferry_cmd(&["compare", "-t", "1", &uri, s(&changed)]));
    let _ = server.kill();
    let _ = server.wait();
    assert_eq!((code(&o), o.stdout.as_str()), (0, "Images are identical.\n"), "{}", o.describe());
    let want = format!("Content mismatch at offset {}!\n", (MIB + 4096));
    assert_eq!((code(&o2), o2.stdout.as_str()), (1, want.as_str()), "{}", o2.describe());
    assert!(t0.elapsed() < Duration::from_secs(20), "{:?}", t0.elapsed());
}

#[test]
fn protect_and_copy_take_the_passphrase_from_a_command() {
    let d = tempfile::tempdir().unwrap();
    let disk = d.path().join("d.raw");
    fs::write(&disk, Rng::new(8).bytes(MIB)).unwrap();
    let (src, dst) = (d.path().join("src"), d.path().join("dst"));
    run_ok(ferry_cmd(&["repo", "init", "--encrypt", "--kdf-memory", "8M", s(&src)]).env("FERRY_PASSWORD", "pw"));
    run_ok(&mut ferry_cmd(&["repo", "init", s(&dst)]));
    run_ok(ferry_cmd(&["backup", s(&disk), &format!("{}::vm", src.display())]).env("FERRY_PASSWORD", "pw"));
    let list = run_ok(ferry_cmd(&["repo", "list", "--json", s(&src)]).env("FERRY_PASSWORD", "pw"));
    let v: serde_json::Value = serde_json::from_str(&list.stdout).unwrap();
    let id = v[0]["id"].as_str().unwrap().to_string();
    let snap = format!("{}::vm@{id}", src.display());
    let o = run(ferry_cmd(&["repo", "protect", "--password-command", "echo pw", &snap]).stdin(Stdio::null()));
    assert_eq!(code(&o), 0, "{}", o.describe());
    assert!(o.stdout.contains("protected"), "{}", o.describe());
    let o = run(ferry_cmd(&["repo", "copy", "--password-command", "echo pw", s(&src), s(&dst), "--to-unencrypted"])
        .stdin(Stdio::null()));
    assert_eq!(code(&o), 0, "{}", o.describe());
    let list = run_ok(&mut ferry_cmd(&["repo", "list", "--json", s(&dst)]));
    let v: serde_json::Value = serde_json::from_str(&list.stdout).unwrap();
    assert_eq!(v.as_array().unwrap().len(), 1, "{}", list.stdout);
    // An encrypted destination of the same passphrase: the command runs once, its answer
    // tried on the destination too.
    let dst2 = d.path().join("dst2");
    run_ok(ferry_cmd(&["repo", "init", "--encrypt", "--kdf-memory", "8M", s(&dst2)]).env("FERRY_PASSWORD", "pw"));
    let runs = d.path().join("runs");
    let command = format!("echo run >> '{}'; echo pw", runs.display());
    let o = run(ferry_cmd(&["repo", "copy", "--password-command", &command, s(&src), s(&dst2)]).stdin(Stdio::null()));
    assert_eq!(code(&o), 0, "{}", o.describe());
    assert_eq!(fs::read_to_string(&runs).unwrap(), "run\n", "the password command ran more than once");
}
