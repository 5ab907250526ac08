//! `ferry backup --resume` (issue 29): a backup killed after a checkpoint continues
//! without reading again what it stored, and its snapshot restores exactly.

use crate::common::json::{Json, JsonExt};
use crate::common::*;
use crate::incremental_backup::{qemu_img, qemu_io, s, Export};
use std::fs;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

fn ferry_cmd(args: &[&str]) -> Command {
    let mut c = Command::new(ferry_bin());
    c.args(args).env_remove("FERRY_PASSWORD").env_remove("FERRY_PASSWORD_FILE").env_remove("RUST_LOG");
    c
}

fn ferry(args: &[&str]) -> Output {
    run_ok(&mut ferry_cmd(args))
}

pub(crate) fn checkpoints(repo: &Path) -> usize {
    fs::read_dir(repo.join("checkpoints"))
        .map(|rd| rd.filter_map(|e| e.ok()).filter(|e| !e.file_name().to_string_lossy().starts_with('.')).count())
        .unwrap_or(0)
}

#[test]
fn a_killed_backup_resumes_reading_only_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let repo = d.join("repo");
    ferry(&["repo", "init", s(&repo)]);
    let size = 8 * MIB as usize;
    let data = Rng::new(29).bytes(size);
    let src = write_sparse_file(d, "disk.raw", &data);
    let target = format!("{}::vm", repo.display());
    // About 8 s at 1 MiB/s, a checkpoint every 0.3 s: killed once some are stored.
    let mut slow = ferry_cmd(&["backup", "--rate", "1M", s(&src), &target])
        .env("FERRY_CHECKPOINT_SECS", "0.3")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    assert!(wait_until(Duration::from_secs(10), || checkpoints(&repo) == 1), "no checkpoint was stored");
    std::thread::sleep(Duration::from_millis(1500));
    slow.kill().unwrap(); // SIGKILL
    slow.wait().unwrap();
    assert_eq!(checkpoints(&repo), 1);
    // `repo list` tells of it; `repo check` finds nothing wrong.
    let list = ferry(&["repo", "list", s(&repo)]);
    assert!(list.stderr.contains("interrupted backup of vm"), "{}", list.describe());
    ferry(&["repo", "check", s(&repo)]);
    // Another source (same size) cannot continue it: refused, saying what differs and the way out.
    let other = write_sparse_file(d, "other.raw", &data);
    let out = run_fails(&mut ferry_cmd(&["backup", "--resume", s(&other), &target]));
    assert!(out.stderr.contains("cannot be resumed") && out.stderr.contains("without --resume"), "{}", out.describe());
    // The resume reads only what the checkpoint does not hold.
    let out = ferry(&["backup", "--resume", "--json", s(&src), &target]);
    assert!(out.stderr.contains("resuming the backup of vm"), "{}", out.describe());
    let snap = Json::must_parse(out.stdout.trim());
    let read = snap.get("read").and_then(|r| r.as_u64()).unwrap();
    assert!(read > 0 && read < size as u64 - MIB, "read {read} of {size} bytes\n{}", out.describe());
    assert_eq!(checkpoints(&repo), 0, "the committed backup left its checkpoint");
    let restored = d.join("restored.raw");
    ferry(&["copy", &target, s(&restored)]);
    qemu_img(&["compare", "-f", "raw", "-F", "raw", s(&restored), s(&src)]);
    let check = ferry(&["repo", "check", s(&repo)]);
    assert!(!check.stdout.contains("interrupted"), "{}", check.describe());
}

#[test]
fn a_backup_without_resume_discards_the_interrupted_one() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let repo = d.join("repo");
    ferry(&["repo", "init", s(&repo)]);
    let data = Rng::new(30).bytes(4 * MIB as usize);
    let src = write_sparse_file(d, "disk.raw", &data);
    let target = format!("{}::vm", repo.display());
    let mut slow = ferry_cmd(&["backup", "--rate", "1M", s(&src), &target])
        .env("FERRY_CHECKPOINT_SECS", "0.2")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    assert!(wait_until(Duration::from_secs(10), || checkpoints(&repo) == 1), "no checkpoint was stored");
    slow.kill().unwrap();
    slow.wait().unwrap();
    // gc keeps what the checkpoint refers to: check still passes afterwards.
    ferry(&["repo", "gc", s(&repo)]);
    ferry(&["repo", "check", s(&repo)]);
    let out = ferry(&["backup", "--json", s(&src), &target]);
    assert!(out.stderr.contains("discarding the interrupted backup"), "{}", out.describe());
    let snap = Json::must_parse(out.stdout.trim());
    assert_eq!(snap.get("read").and_then(|r| r.as_u64()), Some(4 * MIB));
    assert_eq!(checkpoints(&repo), 0);
}

/// An incremental backup through `qemu-nbd -B b0`, killed, resumed: only the rest of the
/// bitmap's ranges are read.
#[test]
fn a_killed_dirty_bitmap_backup_resumes() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let repo = d.join("repo");
    ferry(&["repo", "init", s(&repo)]);
    let target = format!("{}::vm", repo.display());
    let img = d.join("vm.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", s(&img), &(32 * MIB).to_string()]);
    qemu_img(&["bitmap", "--add", s(&img), "b0"]);
    let day0: Vec<String> = (0..4u64).map(|i| format!("write -P {} {} {}", 0x40 + i, i * 8 * MIB, MIB)).collect();
    qemu_io("qcow2", s(&img), &day0);
    let e = Export::qemu_nbd(d, "src", &img, "qcow2", true, Some("b0"));
    let full = Json::must_parse(ferry(&["backup", "--json", &e.uri(), &target]).stdout.trim());
    let since = full.at("id").as_str().unwrap().to_string();
    e.stop();
    qemu_img(&["bitmap", "--clear", s(&img), "b0"]);
    // Day 1: 6 MiB changed, in 1 MiB pieces.
    let day1: Vec<String> = (0..6u64).map(|i| format!("write -P {} {} {}", 0x60 + i, i * 5 * MIB, MIB)).collect();
    qemu_io("qcow2", s(&img), &day1);
    let e = Export::qemu_nbd(d, "src", &img, "qcow2", true, Some("b0"));
    let mut slow = ferry_cmd(&["backup", "--rate", "1M", "--dirty-bitmap", "b0", "--since", &since, &e.uri(), &target])
        .env("FERRY_CHECKPOINT_SECS", "0.3")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    assert!(wait_until(Duration::from_secs(10), || checkpoints(&repo) == 1), "no checkpoint was stored");
    std::thread::sleep(Duration::from_millis(1200));
    slow.kill().unwrap();
    slow.wait().unwrap();
    // An NBD export cannot show that its disk is the one the interrupted run read: a
    // resume needs the user's word for it.
    let uri = e.uri();
    // Each run ends with the snapshot the map continues, the source and the disk.
    let tail = [since.as_str(), &uri, &target];
    let out =
        run_fails(&mut ferry_cmd(&[&["backup", "--resume", "--dirty-bitmap", "b0", "--since"], &tail[..]].concat()));
    assert!(out.stderr.contains("--same-source") && out.stderr.contains("two versions"), "{}", out.describe());
    // Another change map than the interrupted run's is refused too.
    let extents = d.join("extents.bin");
    std::fs::write(&extents, [1u8]).unwrap();
    let extents = format!("bitmap:64K:{}", extents.display());
    let head = ["backup", "--resume", "--same-source", "--extents-from", &extents, "--since"];
    let out = run_fails(&mut ferry_cmd(&[&head[..], &tail].concat()));
    assert!(out.stderr.contains("cannot be resumed"), "{}", out.describe());
    let head = ["backup", "--resume", "--same-source", "--json", "--dirty-bitmap", "b0", "--since"];
    let out = ferry(&[&head[..], &tail].concat());
    e.stop();
    assert!(out.stderr.contains("resuming the backup of vm"), "{}", out.describe());
    let snap = Json::must_parse(out.stdout.trim());
    assert_eq!(snap.at("changes").at("kind").as_str(), Some("dirty-bitmap"), "{snap}");
    let read = snap.u64_at("read");
    assert!(read > 0 && read < 5 * MIB, "read {read} of the bitmap's 6 MiB\n{}", out.describe());
    let restored = d.join("restored.raw");
    ferry(&["copy", &target, s(&restored)]);
    qemu_img(&["compare", "-f", "raw", "-F", "qcow2", s(&restored), s(&img)]);
    ferry(&["repo", "check", s(&repo)]);
    // A local qcow2 image that ferry tracks itself cannot be resumed: it says to read it
    // with --no-bitmap.
    let out = run_fails(&mut ferry_cmd(&["backup", "--resume", s(&img), &target]));
    assert!(out.stderr.contains("--no-bitmap"), "{}", out.describe());
}
