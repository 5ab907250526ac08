//! What a backup builds on (issue 34, "never build on a wrong base"):
//!
//! * a change map (`--dirty-bitmap`, `--extents-from`) is applied only to the snapshot it
//!   continues, named by `--since ID`: a stale bitmap (one bitmap, two repositories), a
//!   snapshot list that went back (the newest manifest deleted from the store) and a map
//!   without `--since` are refused, and another image's bitmap of the same size is caught
//!   by the sample of unchanged chunks read from the source;
//! * a snapshot records its writer's clock, never its parent's: after a snapshot dated a
//!   year ahead, later ones keep their own days for retention.

use crate::common::json::{Json, JsonExt};
use crate::common::*;
use crate::incremental_backup::{qemu_img, qemu_io, s, Export};
use std::fs;
use std::path::Path;
use std::process::Command;

/// `ferry ARGS` with no passphrase or log settings from the test's environment.
fn ferry_cmd(args: &[&str]) -> Command {
    let mut c = Command::new(ferry_bin());
    c.args(args).env_remove("FERRY_PASSWORD").env_remove("FERRY_PASSWORD_FILE").env_remove("RUST_LOG");
    c
}

fn ferry(args: &[&str]) -> Output {
    run_ok(&mut ferry_cmd(args))
}

/// `ferry backup --json ARGS`: the new snapshot's id.
fn backup(args: &[&str]) -> String {
    let mut a = vec!["backup", "--json"];
    a.extend_from_slice(args);
    let out = ferry(&a);
    let snap = Json::must_parse(out.stdout.trim());
    snap.at("id").as_str().unwrap_or_else(|| panic!("no id: {}", out.describe())).to_string()
}

/// The ids of the snapshots of `name` in `repo`, oldest first.
fn ids(repo: &str, name: &str) -> Vec<String> {
    let list = Json::must_parse(&ferry(&["repo", "list", "--json", repo, name]).stdout);
    list.as_array().unwrap().iter().map(|s| s.at("id").as_str().unwrap().to_string()).collect()
}

/// The id of the latest snapshot of `name` in `repo` (for tests whose backups print none).
pub(crate) fn latest_id(repo: &str, name: &str) -> String {
    ids(repo, name).pop().unwrap_or_else(|| panic!("{repo} has no snapshot of {name}"))
}

/// `qemu-img convert` of `img` to raw, and the restore of `snap` compared with it.
fn assert_restores(snap: &str, img: &Path, d: &Path) {
    let restored = d.join("restored.raw");
    let _ = fs::remove_file(&restored);
    ferry(&["copy", snap, s(&restored)]);
    qemu_img(&["compare", "-f", "raw", "-F", "qcow2", s(&restored), s(img)]);
}

/// A 16 MiB qcow2 image filled with `fill`, with the persistent bitmap b0.
fn image(d: &Path, name: &str, fill: u8) -> std::path::PathBuf {
    let img = d.join(name);
    qemu_img(&["create", "-q", "-f", "qcow2", s(&img), &(16 * MIB).to_string()]);
    qemu_io("qcow2", s(&img), &[format!("write -P {fill} 0 16M")]);
    qemu_img(&["bitmap", "--add", s(&img), "b0"]);
    img
}

/// `ferry backup --json ARGS SRC TARGET` from `qemu-nbd -r -B b0 IMG`.
fn backup_from(d: &Path, img: &Path, args: &[&str], target: &str) -> Output {
    backup_on(d, img, args, target, None)
}

/// [`backup_from`] on a host whose record of repositories is in `state` (its own).
fn backup_on(d: &Path, img: &Path, args: &[&str], target: &str, state: Option<&Path>) -> Output {
    let e = Export::qemu_nbd(d, "src", img, "qcow2", true, Some("b0"));
    let uri = e.uri();
    let mut a = vec!["backup", "--json"];
    a.extend_from_slice(args);
    a.extend_from_slice(&[&uri, target]);
    let mut c = ferry_cmd(&a);
    if let Some(state) = state {
        c.env("FERRY_STATE_DIR", state);
    }
    let out = run(&mut c);
    e.stop();
    out
}

fn id_of(out: &Output) -> String {
    assert!(out.status.success(), "{}", out.describe());
    Json::must_parse(out.stdout.trim()).at("id").as_str().unwrap().to_string()
}

/// r5: one bitmap feeding two repositories, cleared after the first one's backup. The
/// second repository's backup names the snapshot the bitmap continues (the first
/// repository's), which is not its own: refused. Without --since: refused with the
/// commands to run. The way out it names (a backup without the map) restores the disk.
#[test]
fn a_stale_bitmap_is_refused() {
    require("qemu-io");
    let dir = tempfile::Builder::new().prefix("ferry-base-stale").tempdir().unwrap();
    let d = dir.path();
    let (local, offsite) = (d.join("local"), d.join("offsite"));
    ferry(&["repo", "init", s(&local)]);
    ferry(&["repo", "init", s(&offsite)]);
    let (lt, ot) = (format!("{}::vm", local.display()), format!("{}::vm", offsite.display()));
    let img = image(d, "vm.qcow2", 0x11);
    // Day 1: a full backup into each.
    let l1 = id_of(&backup_from(d, &img, &[], &lt));
    let o1 = id_of(&backup_from(d, &img, &[], &ot));
    qemu_img(&["bitmap", "--clear", s(&img), "b0"]);
    // Day 2: change A, the local backup with the bitmap, which is then cleared.
    qemu_io("qcow2", s(&img), &["write -P 0x22 1M 64k".into()]);
    let l2 = id_of(&backup_from(d, &img, &["--dirty-bitmap", "b0", "--since", &l1], &lt));
    qemu_img(&["bitmap", "--clear", s(&img), "b0"]);
    // Day 3: change B; the bitmap continues l2, a snapshot of the other repository.
    qemu_io("qcow2", s(&img), &["write -P 0x33 2M 64k".into()]);
    let out = backup_from(d, &img, &["--dirty-bitmap", "b0", "--since", &l2], &ot);
    assert!(!out.status.success(), "a stale bitmap was applied\n{}", out.describe());
    for want in [&format!("--since {l2}"), "not there", &o1[..8], "ferry backup 'nbd+unix:", "reads everything"] {
        assert!(out.stderr.contains(want), "{want:?} missing\n{}", out.describe());
    }
    // A prefix of it, too.
    let out = backup_from(d, &img, &["--dirty-bitmap", "b0", "--since", &l2[..8]], &ot);
    assert!(!out.status.success() && out.stderr.contains("not there"), "{}", out.describe());
    // No --since: refused, with the commands to run instead.
    let out = backup_from(d, &img, &["--dirty-bitmap", "b0"], &ot);
    assert!(!out.status.success(), "{}", out.describe());
    for want in ["--dirty-bitmap needs --since ID", "--dirty-bitmap b0 --since ID", &o1[..8], "reads everything"] {
        assert!(out.stderr.contains(want), "{want:?} missing\n{}", out.describe());
    }
    assert!(out.stderr.contains("ferry backup 'nbd+unix://"), "{}", out.describe());
    // --since without a map means nothing.
    let out = backup_from(d, &img, &["--since", &o1], &ot);
    assert!(!out.status.success() && out.stderr.contains("--since names"), "{}", out.describe());
    // Nothing was added to the offsite repository; the full backup it says to run is whole.
    assert_eq!(ids(s(&offsite), "vm"), [o1.as_str()]);
    let o2 = id_of(&backup_from(d, &img, &[], &ot));
    assert_restores(&format!("{ot}@{o2}"), &img, d);
    // The local one, continued with the id its last backup printed, is whole too.
    let l3 = id_of(&backup_from(d, &img, &["--dirty-bitmap", "b0", "--since", &l2], &lt));
    assert_restores(&format!("{lt}@{l3}"), &img, d);
}

/// r5: the bitmap of another image of the same size, into vm's name with vm's latest
/// snapshot as --since: the unchanged chunks read from the source are not vm's. The same
/// with an --extents-from map of another raw disk.
#[test]
fn another_images_map_is_refused() {
    require("qemu-io");
    let dir = tempfile::Builder::new().prefix("ferry-base-other").tempdir().unwrap();
    let d = dir.path();
    let repo = d.join("repo");
    ferry(&["repo", "init", s(&repo)]);
    let t = format!("{}::vm", repo.display());
    let vm = image(d, "vm.qcow2", 0x11);
    let v1 = id_of(&backup_from(d, &vm, &[], &t));
    let other = image(d, "other.qcow2", 0x44);
    qemu_io("qcow2", s(&other), &["write -P 0x55 0 64k".into()]);
    let out = backup_from(d, &other, &["--dirty-bitmap", "b0", "--since", &v1], &t);
    assert!(!out.status.success(), "another image's bitmap was applied\n{}", out.describe());
    assert!(out.stderr.contains("does not fit") && out.stderr.contains("another disk"), "{}", out.describe());
    assert_eq!(ids(s(&repo), "vm"), [v1.as_str()]);
    // vm's own bitmap (empty) passes the same check.
    let v2 = id_of(&backup_from(d, &vm, &["--dirty-bitmap", "b0", "--since", &v1], &t));
    assert_restores(&format!("{t}@{v2}"), &vm, d);
    // --extents-from: a raw disk and another of the same size, a map of one chunk.
    let a = write_sparse_file(d, "a.raw", &data_with_holes(4 * MIB as usize, 1));
    let b = write_sparse_file(d, "b.raw", &data_with_holes(4 * MIB as usize, 2));
    let map = d.join("map.json");
    fs::write(&map, r#"[{"offset": 0, "length": 65536, "type": 1}]"#).unwrap();
    let ta = format!("{}::a", repo.display());
    let a1 = backup(&[s(&a), &ta]);
    let out = run_fails(&mut ferry_cmd(&["backup", "--extents-from", s(&map), "--since", &a1, s(&b), &ta]));
    assert!(out.stderr.contains("does not fit"), "{}", out.describe());
    backup(&["--extents-from", s(&map), "--since", &a1[..6], s(&a), &ta]);
}

/// repro-security 01: someone who can delete one object of the store removes the newest
/// manifest; the next --dirty-bitmap backup names it (the bitmap continues it) and is
/// refused instead of storing a disk without the changes it held. Encrypted repository.
#[test]
fn the_newest_snapshot_deleted_from_the_store_is_refused() {
    require("qemu-io");
    let dir = tempfile::Builder::new().prefix("ferry-base-deleted").tempdir().unwrap();
    let d = dir.path();
    let repo = d.join("repo");
    let pass = d.join("pass");
    fs::write(&pass, "correct horse battery staple\n").unwrap();
    let pf = s(&pass);
    ferry(&["repo", "init", "--encrypt", "--kdf-memory", "8M", "--password-file", pf, s(&repo)]);
    let t = format!("{}::vm1", repo.display());
    let img = image(d, "disk.qcow2", 0xaa);
    let s1 = id_of(&backup_from(d, &img, &["--password-file", pf], &t));
    qemu_img(&["bitmap", "--clear", s(&img), "b0"]);
    qemu_io("qcow2", s(&img), &["write -P 0x11 1M 64K".into()]);
    let s2 = id_of(&backup_from(d, &img, &["--password-file", pf, "--dirty-bitmap", "b0", "--since", &s1], &t));
    qemu_img(&["bitmap", "--clear", s(&img), "b0"]);
    fs::remove_file(repo.join("snapshots").join(&s2)).unwrap();
    qemu_io("qcow2", s(&img), &["write -P 0x22 8M 64K".into()]);
    // This host saw s2: its record refuses first. Another host, which never saw s2 (its
    // own state directory), is refused by --since: s2 is not in the store.
    let other = d.join("other-host");
    for state in [None, Some(other.as_path())] {
        let args = ["--password-file", pf, "--dirty-bitmap", "b0", "--since", &s2];
        let out = backup_on(d, &img, &args, &t, state);
        assert!(!out.status.success(), "a backup built on the day before\n{}", out.describe());
        assert!(!out.stderr.contains("panicked"), "{}", out.describe());
        let why = if state.is_none() { "the store went back" } else { "--since" };
        assert!(out.stderr.contains(why), "{}", out.describe());
    }
    let list = Json::must_parse(&ferry(&["repo", "list", "--json", "--password-file", pf, s(&repo)]).stdout);
    assert_eq!(list.as_array().unwrap().len(), 1, "a snapshot was made: {list}");
    // The way out: a backup without the map (on this host, accepting what the store holds).
    let s3 = id_of(&backup_on(d, &img, &["--password-file", pf, "--accept-rollback"], &t, None));
    let restored = d.join("restored.raw");
    run_ok(ferry_cmd(&["copy", &format!("{t}@{s3}"), s(&restored)]).env("FERRY_PASSWORD_FILE", pf));
    qemu_img(&["compare", "-f", "raw", "-F", "qcow2", s(&restored), s(&img)]);
}

/// r6: a snapshot dated a year ahead (as a host with that clock would write it) in an
/// unencrypted repository; three backups continue it, each recording this host's time (the
/// first warns), listed after it; `forget --keep-daily` sees today and that day apart.
#[test]
fn a_future_dated_parent_does_not_freeze_the_clock() {
    require("sha256sum");
    let dir = tempfile::Builder::new().prefix("ferry-base-time").tempdir().unwrap();
    let d = dir.path();
    let repo = d.join("repo");
    ferry(&["repo", "init", s(&repo)]);
    let t = format!("{}::a", repo.display());
    let mut data = data_with_holes(8 * MIB as usize, 3);
    let img = write_sparse_file(d, "a.raw", &data);
    let s1 = backup(&[s(&img), &t]);
    // The manifest re-dated and stored under its new id, with s1 as its parent.
    let ahead = rfc3339(now() + 365 * 86400);
    let future = plant(&repo, &s1, &ahead, d);
    assert_eq!(latest_id(s(&repo), "a"), future);
    let mut chain = vec![s1.clone(), future.clone()];
    for i in 0..3u64 {
        let at = (i as usize + 1) * MIB as usize;
        Rng::new(40 + i).fill(&mut data[at..at + 64 * KIB as usize]);
        fs::write(&img, &data).unwrap();
        let map = d.join("map.json");
        fs::write(&map, format!(r#"[{{"offset": {at}, "length": 65536, "type": 1}}]"#)).unwrap();
        let base = chain.last().unwrap().clone();
        let out = ferry(&["backup", "--json", "--extents-from", s(&map), "--since", &base, s(&img), &t]);
        let snap = Json::must_parse(out.stdout.trim());
        let time = snap.at("time").as_str().unwrap().to_string();
        assert_ne!(time, ahead, "the parent's time was copied\n{}", out.describe());
        let today = [rfc3339(now() - 60), rfc3339(now())].map(|t| t[..10].to_string());
        assert!(today.iter().any(|d| time.starts_with(d.as_str())), "{time} is not today\n{}", out.describe());
        assert_eq!(snap.at("parent").as_str(), Some(base.as_str()), "{snap}");
        assert_eq!(out.stderr.contains("ahead of this host's clock"), i == 0, "{}", out.describe());
        chain.push(snap.at("id").as_str().unwrap().to_string());
    }
    // Each listed after its parent; restores are the disk.
    assert_eq!(ids(s(&repo), "a"), chain);
    let restored = d.join("restored.raw");
    ferry(&["copy", &t, s(&restored)]);
    assert_file_eq(&restored, &data);
    // Retention: the newest of today and the one of the future day; and, as restic (0.15
    // and later) does while a rule has counts left, the oldest; the rest goes.
    let out = ferry(&["repo", "forget", "--json", "--keep-daily", "7", "--dry-run", s(&repo)]);
    let r = Json::must_parse(&out.stdout);
    let mut kept: Vec<&str> = r.array_at("kept").iter().map(|v| v.as_str().unwrap()).collect();
    kept.sort();
    let mut want = vec![chain[4].as_str(), future.as_str(), s1.as_str()];
    want.sort();
    assert_eq!(kept, want, "{}", out.describe());
}

/// Seconds since the epoch.
fn now() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs() as i64
}

/// A copy of snapshot `id` of the unencrypted `repo`, dated `time`, with `id` as its
/// parent, stored under its own id (as a host with that clock would have written it).
pub(crate) fn plant(repo: &Path, id: &str, time: &str, d: &Path) -> String {
    let mut m: serde_json::Value = serde_json::from_slice(&fs::read(repo.join("snapshots").join(id)).unwrap()).unwrap();
    m["time"] = serde_json::Value::String(time.into());
    m["parent"] = serde_json::Value::String(id.into());
    let planted = d.join("planted");
    fs::write(&planted, serde_json::to_vec(&m).unwrap()).unwrap();
    let sum = run_ok(&mut cmd("sha256sum", [s(&planted)])).stdout;
    let new = sum.split_whitespace().next().unwrap().to_string();
    fs::copy(&planted, repo.join("snapshots").join(&new)).unwrap();
    new
}

/// An interrupted --extents-from backup is continued by --resume only on the base it
/// started from: once another snapshot is the disk's latest, the old --since is refused
/// (not the latest) and the new one too (the checkpoint continued another base).
#[test]
fn a_resume_keeps_its_base() {
    require("sha256sum");
    let dir = tempfile::Builder::new().prefix("ferry-base-resume").tempdir().unwrap();
    let d = dir.path();
    let repo = d.join("repo");
    ferry(&["repo", "init", s(&repo)]);
    let t = format!("{}::a", repo.display());
    let mut data = data_with_holes(8 * MIB as usize, 5);
    let img = write_sparse_file(d, "a.raw", &data);
    let s1 = backup(&[s(&img), &t]);
    Rng::new(6).fill(&mut data[MIB as usize..7 * MIB as usize]);
    fs::write(&img, &data).unwrap();
    let map = d.join("map.json");
    fs::write(&map, format!(r#"[{{"offset": {MIB}, "length": {}, "type": 1}}]"#, 6 * MIB)).unwrap();
    let args = ["backup", "--rate", "1M", "--extents-from", s(&map), "--since", &s1, s(&img), &t];
    let mut slow = ferry_cmd(&args)
        .env("FERRY_CHECKPOINT_SECS", "0.3")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // A stored checkpoint, not the temporary file it is written to first.
    let stored = || {
        fs::read_dir(repo.join("checkpoints"))
            .map(|rd| rd.flatten().any(|e| !e.file_name().to_string_lossy().starts_with('.')))
            .unwrap_or(false)
    };
    assert!(wait_until(std::time::Duration::from_secs(10), stored), "no checkpoint was stored");
    slow.kill().unwrap();
    slow.wait().unwrap();
    // Another snapshot of the disk becomes its latest (a second later: listed after s1).
    let s2 = plant(&repo, &s1, &rfc3339(now() + 1), d);
    let resume = |since: &str| {
        run_fails(&mut ferry_cmd(&["backup", "--resume", "--extents-from", s(&map), "--since", since, s(&img), &t]))
    };
    let out = resume(&s1);
    assert!(out.stderr.contains("is not its latest"), "{}", out.describe());
    // s2 is not what the interrupted backup stored (another source): the checkpoint is no
    // leftover, and it continued s1, not s2.
    let out = resume(&s2);
    assert!(out.stderr.contains("cannot be resumed") && out.stderr.contains(&s1[..8]), "{}", out.describe());
    assert_eq!(ids(s(&repo), "a"), [s1.as_str(), s2.as_str()]);
}

/// RFC 3339 UTC of `secs` since the epoch (whole seconds), as FORMAT.md writes times.
fn rfc3339(secs: i64) -> String {
    run_ok(&mut cmd("date", ["-u", "-d", &format!("@{secs}"), "+%Y-%m-%dT%H:%M:%SZ"])).stdout.trim().to_string()
}
