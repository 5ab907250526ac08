//! Locks and checkpoints of a backup repository (FORMAT.md §7a, §8), end to end through
//! the CLI:
//!
//! * a backup frozen for longer than a lock lives (SIGSTOP, its lock back-dated), whose
//!   lock a gc then takes for stale, stops when it thaws: it stores no index object or
//!   checkpoint naming the packs gc deleted, `check` passes and gc runs;
//! * the lock of a killed backup whose parent never collects it (a zombie, as under a
//!   container's first process that reaps nothing) is stale, and so is a lock whose PID
//!   now belongs to another process (started at another time);
//! * a checkpoint left by a backup killed between its commit and the checkpoint's removal
//!   is not offered for resume, and `--resume` goes on with a notice;
//! * what `check` says of a damaged checkpoint.

use crate::common::json::{Json, JsonExt};
use crate::common::*;
use crate::repo_crash::{ferry_cmd, s};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, SystemTime};

/// A disk of `mib` MiB of random bytes (incompressible: packs fill at their size).
fn random_disk(d: &Path, name: &str, mib: usize, seed: u64) -> PathBuf {
    let p = d.join(name);
    fs::write(&p, Rng::new(seed).bytes(mib << 20)).unwrap();
    p
}

/// A new repository and a disk `a` to back up into it, in a temporary directory.
struct Setup {
    dir: tempfile::TempDir,
    repo_p: PathBuf,
    /// The repository, as the command line names it.
    repo: String,
    img: PathBuf,
    /// `REPO::a`.
    t: String,
}

fn setup(what: &str, mib: usize, seed: u64) -> Setup {
    let dir = tempfile::Builder::new().prefix(&format!("ferry-locks-{what}")).tempdir().unwrap();
    let repo_p = dir.path().join("repo");
    let repo = s(&repo_p).to_string();
    run_ok(&mut ferry_cmd(&["repo", "init", &repo]));
    let img = random_disk(dir.path(), "a.raw", mib, seed);
    let t = format!("{repo}::a");
    Setup { dir, repo_p, repo, img, t }
}

/// `ferry backup ARGS` in the background, checkpointing every `every` seconds.
fn spawn_backup(args: &[&str], every: &str) -> Child {
    let mut c = ferry_cmd(&[&["backup"], args].concat());
    c.env("FERRY_CHECKPOINT_SECS", every).stdout(Stdio::piped()).stderr(Stdio::piped());
    spawn_serialized(&mut c).unwrap()
}

fn signal(pid: u32, sig: &str) {
    run_ok(&mut cmd("kill", [sig, &pid.to_string()]));
}

/// The objects under `repo/dir` (not the temporary files a write renames into place),
/// with their modification times.
fn objects(repo: &Path, dir: &str) -> Vec<(PathBuf, SystemTime)> {
    fn walk(d: &Path, out: &mut Vec<(PathBuf, SystemTime)>) {
        let Ok(rd) = fs::read_dir(d) else { return };
        for e in rd.flatten() {
            let p = e.path();
            if p.is_dir() {
                walk(&p, out);
            } else if !e.file_name().to_string_lossy().starts_with('.') {
                if let Ok(m) = e.metadata().and_then(|m| m.modified()) {
                    out.push((p, m));
                }
            }
        }
    }
    let mut v = Vec::new();
    walk(&repo.join(dir), &mut v);
    v.sort();
    v
}

/// Whether a pack was stored after the last checkpoint (or before any): one that no
/// index object lists yet, which a gc deletes as an orphan.
fn unindexed_pack(repo: &Path) -> bool {
    let last_checkpoint = objects(repo, "checkpoints").iter().map(|(_, t)| *t).max();
    objects(repo, "data").iter().any(|(_, t)| last_checkpoint.is_none_or(|c| *t > c))
}

/// What /proc says of process `pid`: its state letter and start time (field 22).
pub(crate) fn proc_stat(pid: u32) -> Option<(char, u64)> {
    let text = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let mut f = text[text.rfind(')')? + 1..].split_whitespace();
    let state = f.next()?.chars().next()?;
    Some((state, f.nth(18)?.parse().ok()?))
}

/// Sets the lock's times (its own and the file's) two hours back, as a freeze of two
/// hours leaves them.
fn back_date(lock: &Path) {
    let mut l: serde_json::Value = serde_json::from_slice(&fs::read(lock).unwrap()).unwrap();
    let old = run_ok(&mut cmd("date", ["-u", "-d", "2 hours ago", "+%Y-%m-%dT%H:%M:%S.%NZ"])).stdout;
    l["time"] = old.trim().into();
    l["refreshed"] = old.trim().into();
    fs::write(lock, serde_json::to_vec(&l).unwrap()).unwrap();
    let f = fs::File::options().write(true).open(lock).unwrap();
    f.set_modified(SystemTime::now() - Duration::from_secs(7200)).unwrap();
}

fn check_ok(repo: &str, after: &str) -> Output {
    let out = run(&mut ferry_cmd(&["repo", "check", repo]));
    assert!(out.status.success() && out.stdout.contains("no damage"), "check fails after {after}\n{}", out.describe());
    out
}

/// Item 10 of issue 34: a backup frozen long enough for its lock to be taken for stale,
/// with packs stored since its last checkpoint; a gc meanwhile removes its lock and those
/// packs. Thawed, the backup stops at its next checkpoint with an error that says why,
/// and stores no index object or checkpoint naming the deleted packs: check passes, gc is
/// not blocked, and the checkpoint from before the freeze still resumes.
#[test]
fn a_frozen_backup_whose_lock_was_taken_stops() {
    // 160 MiB at 32 MiB/s, a checkpoint every 1.5 s: a 32 MiB pack fills about every
    // second, so between two checkpoints there is a moment with a pack no index lists.
    let Setup { dir: _dir, repo_p, repo, img, t } = setup("frozen", 160, 7);
    let mut child = spawn_backup(&["--rate", "32M", s(&img), &t], "1.5");
    let pid = child.id();
    let mut stopped = false;
    for _ in 0..400 {
        std::thread::sleep(Duration::from_millis(20));
        if child.try_wait().unwrap().is_some() {
            break;
        }
        if objects(&repo_p, "checkpoints").is_empty() || !unindexed_pack(&repo_p) {
            continue;
        }
        signal(pid, "-STOP");
        // A checkpoint may have come in between: then go on to the next moment.
        if unindexed_pack(&repo_p) {
            stopped = true;
            break;
        }
        signal(pid, "-CONT");
    }
    assert!(stopped, "the backup was never stopped with a checkpoint and an unindexed pack");
    let locks = objects(&repo_p, "locks");
    assert_eq!(locks.len(), 1, "{locks:?}");
    back_date(&locks[0].0);
    let packs_before = objects(&repo_p, "data").len();
    // Another process takes the lock for stale and collects the unindexed packs.
    let gc = run_ok(&mut ferry_cmd(&["repo", "gc", &repo]));
    assert!(gc.stderr.contains("removing the stale lock"), "{}", gc.describe());
    assert!(objects(&repo_p, "data").len() < packs_before, "gc deleted no orphan pack\n{}", gc.describe());
    let checkpoint = fs::read(&objects(&repo_p, "checkpoints")[0].0).unwrap();
    let index = objects(&repo_p, "index");
    signal(pid, "-CONT");
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the backup committed without its lock\n{err}");
    assert!(
        err.contains("was removed from") && err.contains("run it again") && err.contains("--resume"),
        "the error does not say why, and what to do\n{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    assert!(objects(&repo_p, "snapshots").is_empty());
    // Nothing stored after the gc names its packs: the index objects and the checkpoint
    // are the ones gc left.
    assert_eq!(objects(&repo_p, "index"), index, "the thawed backup stored an index object");
    assert_eq!(fs::read(&objects(&repo_p, "checkpoints")[0].0).unwrap(), checkpoint, "a checkpoint after the gc");
    let what = "a frozen backup whose lock was taken";
    check_ok(&repo, what);
    let gc = run_ok(&mut ferry_cmd(&["repo", "gc", &repo]));
    assert!(!gc.stderr.contains("lock"), "{}", gc.describe());
    check_ok(&repo, &format!("{what}, then gc"));
    // The checkpoint from before the freeze resumes, and the snapshot is the disk.
    let resumed = run_ok(&mut ferry_cmd(&["backup", "--resume", s(&img), &t]));
    assert!(resumed.stderr.contains("resuming the backup of a"), "{}", resumed.describe());
    let want = run_ok(&mut ferry_cmd(&["hash", s(&img)])).stdout;
    assert_eq!(run_ok(&mut ferry_cmd(&["hash", &t])).stdout.split_whitespace().next(), want.split_whitespace().next());
    check_ok(&repo, &format!("{what}, then a resume"));
}

/// The boot id and PID namespace a lock of this machine records (as ferry writes them).
pub(crate) fn this_boot() -> String {
    let boot = fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap();
    let ns = fs::read_link("/proc/self/ns/pid").unwrap();
    format!("{} {}", boot.trim(), ns.display())
}

pub(crate) fn hostname() -> String {
    fs::read_to_string("/proc/sys/kernel/hostname").unwrap().trim().to_string()
}

/// Item 11: a backup killed while its parent (here: this test) does not collect it stays
/// a zombie, and its lock is stale: the next backup removes it, saying why.
#[test]
fn the_lock_of_a_killed_uncollected_holder_is_stale() {
    let Setup { dir: _dir, repo_p, repo, img, t } = setup("zombie", 16, 8);
    let mut child = spawn_backup(&["--rate", "2M", s(&img), &t], "30");
    let pid = child.id();
    assert!(wait_until(Duration::from_secs(20), || objects(&repo_p, "locks").len() == 1), "no lock taken");
    let lock: serde_json::Value = serde_json::from_slice(&fs::read(&objects(&repo_p, "locks")[0].0).unwrap()).unwrap();
    assert_eq!(lock["pid"].as_u64(), Some(pid as u64));
    let start = proc_stat(pid).map(|(_, start)| start);
    child.kill().unwrap(); // SIGKILL, not collected
    assert!(
        wait_until(Duration::from_secs(10), || proc_stat(pid).is_some_and(|(state, _)| state == 'Z')),
        "the killed backup is not a zombie"
    );
    let out = run(&mut ferry_cmd(&["backup", s(&img), &t]));
    let zombie = proc_stat(pid);
    child.wait().unwrap();
    assert!(matches!(zombie, Some(('Z', _))), "the holder was collected before the next backup ran");
    assert!(out.status.success(), "the lock of a zombie holder held\n{}", out.describe());
    assert!(
        out.stderr.contains("removing the stale lock") && out.stderr.contains(&format!("process {pid} has exited")),
        "{}",
        out.describe()
    );
    assert_eq!(lock["pid_start"].as_u64(), start, "the lock's start time");
    check_ok(&repo, "a zombie's lock");
}

/// Item 11: a lock whose PID runs, but as a process started at another time than the
/// lock records, is stale (the number was reused); with the recorded start time, it holds.
#[test]
fn the_lock_of_a_reused_pid_is_stale() {
    let Setup { dir: _dir, repo_p, img, t, .. } = setup("reused", 1, 9);
    // The process that now has the holder's number.
    let mut other = cmd("sleep", ["60"]).spawn().unwrap();
    let (_, start) = proc_stat(other.id()).unwrap();
    let now = run_ok(&mut cmd("date", ["-u", "+%Y-%m-%dT%H:%M:%S.%NZ"])).stdout.trim().to_string();
    let lock = |pid_start: u64| {
        serde_json::json!({
            "kind": "gc", "host": hostname(), "pid": other.id(), "time": now, "refreshed": now,
            "boot": this_boot(), "pid_start": pid_start,
        })
        .to_string()
    };
    fs::create_dir_all(repo_p.join("locks")).unwrap();
    let name = repo_p.join("locks/0123456789abcdef0123456789abcdef");
    fs::write(&name, lock(start)).unwrap();
    let out = run_fails(&mut ferry_cmd(&["backup", s(&img), &t]));
    assert!(out.stderr.contains("is locked by a gc"), "{}", out.describe());
    fs::write(&name, lock(start + 1)).unwrap();
    let out = run(&mut ferry_cmd(&["backup", s(&img), &t]));
    let _ = other.kill();
    let _ = other.wait();
    assert!(out.status.success(), "a lock of a reused PID held\n{}", out.describe());
    assert!(out.stderr.contains("removing the stale lock") && out.stderr.contains("reused"), "{}", out.describe());
    assert!(!name.exists());
}

/// `ferry backup --extents-from MAP` of a disk whose quarter at `seed` changed.
fn change(img: &Path, d: &Path, seed: u64) -> PathBuf {
    let mut data = fs::read(img).unwrap();
    let quarter = data.len() / 4;
    let at = (seed as usize % 4) * quarter;
    Rng::new(seed).fill(&mut data[at..at + quarter]);
    fs::write(img, &data).unwrap();
    let map = d.join(format!("map{seed}.json"));
    fs::write(&map, format!(r#"[{{"offset": {at}, "length": {quarter}, "type": 1}}]"#)).unwrap();
    map
}

/// A backup killed as soon as its first checkpoint is stored: the checkpoint's bytes.
fn killed_after_a_checkpoint(repo_p: &Path, args: &[&str]) -> (PathBuf, Vec<u8>) {
    let mut child = spawn_backup(args, "0.2");
    let found = wait_until(Duration::from_secs(30), || !objects(repo_p, "checkpoints").is_empty());
    let _ = child.kill();
    let out = child.wait_with_output().unwrap();
    assert!(found, "no checkpoint stored\n{}", String::from_utf8_lossy(&out.stderr));
    let (p, _) = objects(repo_p, "checkpoints").remove(0);
    let bytes = fs::read(&p).unwrap();
    (p, bytes)
}

/// Item 12: a checkpoint left by a backup killed between storing its snapshot and removing
/// its checkpoint (put back exactly) is not offered for resume; a nightly `--resume`
/// discards it with a notice and backs up; with nothing to resume, `--resume` backs up.
#[test]
fn a_checkpoint_left_after_its_commit_is_not_resumed() {
    let Setup { dir, repo_p, repo, img, t } = setup("leftover", 16, 10);
    let d = dir.path();
    let id = |out: &Output| Json::must_parse(out.stdout.trim()).at("id").as_str().unwrap().to_string();
    let s0 = id(&run_ok(&mut ferry_cmd(&["backup", "--json", s(&img), &t])));
    let map = change(&img, d, 1);
    let args = ["--rate", "2M", "--extents-from", s(&map), "--since", &s0, s(&img), &t];
    let (object, saved) = killed_after_a_checkpoint(&repo_p, &args);
    // Resumed, it commits and removes its checkpoint; put back, it is what a kill between
    // the two leaves.
    let out = run_ok(&mut ferry_cmd(&[
        "backup",
        "--json",
        "--resume",
        "--extents-from",
        s(&map),
        "--since",
        &s0,
        s(&img),
        &t,
    ]));
    assert!(out.stderr.contains("resuming the backup of a"), "{}", out.describe());
    let s1 = id(&out);
    assert!(!object.exists());
    fs::write(&object, &saved).unwrap();
    let list = run_ok(&mut ferry_cmd(&["repo", "list", &repo]));
    assert!(
        list.stderr.contains("leftover checkpoint of a") && !list.stderr.contains("--resume` continues"),
        "{}",
        list.describe()
    );
    let check = check_ok(&repo, "a leftover checkpoint");
    assert!(
        check.stderr.contains("leftover checkpoint of a") && !check.stderr.contains("can be resumed"),
        "{}",
        check.describe()
    );
    // The next nightly run, with --resume as always: a notice, and a backup.
    let map2 = change(&img, d, 2);
    let out =
        run(&mut ferry_cmd(&["backup", "--json", "--resume", "--extents-from", s(&map2), "--since", &s1, s(&img), &t]));
    assert!(out.status.success(), "--resume refused a leftover checkpoint\n{}", out.describe());
    assert!(
        out.stderr.contains("discarding the checkpoint of") && out.stderr.contains("nothing to resume"),
        "{}",
        out.describe()
    );
    assert!(!object.exists(), "the leftover checkpoint stays");
    let s2 = id(&out);
    let want = run_ok(&mut ferry_cmd(&["hash", s(&img)])).stdout;
    assert_eq!(run_ok(&mut ferry_cmd(&["hash", &t])).stdout.split_whitespace().next(), want.split_whitespace().next());
    // And the night after, with nothing to resume.
    let map3 = change(&img, d, 3);
    let out = run_ok(&mut ferry_cmd(&["backup", "--resume", "--extents-from", s(&map3), "--since", &s2, s(&img), &t]));
    assert!(out.stderr.contains("no interrupted backup to resume"), "{}", out.describe());
    check_ok(&repo, "backups after a leftover checkpoint");
}

/// A damaged interrupted backup in `check`: named as such, and counted apart from the
/// snapshots (not "snapshot checkpoi of a", "1 of 0 snapshots affected").
#[test]
fn check_names_a_damaged_checkpoint_as_an_interrupted_backup() {
    let Setup { dir: _dir, repo_p, repo, img, t } = setup("damaged", 8, 11);
    let (object, _) = killed_after_a_checkpoint(&repo_p, &["--rate", "2M", s(&img), &t]);
    for (p, _) in objects(&repo_p, "data") {
        fs::remove_file(p).unwrap();
    }
    let out = run_fails(&mut ferry_cmd(&["repo", "check", &repo]));
    let tag = object.file_name().unwrap().to_string_lossy().to_string();
    assert!(
        out.stdout.contains(&format!("the interrupted backup of a (checkpoints/{tag})"))
            && out.stdout.contains("0 of 0 snapshots affected, and 1 interrupted backup")
            && !out.stdout.contains("checkpoi of"),
        "{}",
        out.describe()
    );
}
