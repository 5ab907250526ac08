//! Backups into a repository (`ferry repo`, `ferry backup`, `REPO::NAME[@ID]` as a
//! source), end to end with qemu's tools:
//!
//! * 30 days of writes, write-zeroes and discards on a qcow2 image with a persistent
//!   bitmap, backed up each day through `qemu-nbd -r -B b0` (day 1 full, then
//!   `--dirty-bitmap b0 --since` the day before's snapshot, the bitmap cleared after each backup as the incremental-backup
//!   tests clear it); every snapshot restores to its day's image, and its `ferry hash`
//!   from the index is the image's.
//! * 30 days of libvirt's pull mode through qemu-storage-daemon (as incremental_backup.rs
//!   drives it), the guest writing during each backup.
//! * Encryption, forget + gc, verify and check against damage, serving a snapshot, and
//!   concurrent backups.

use crate::common::json::{Json, JsonExt};
use crate::common::*;
use crate::incremental_backup::{qemu_img, qemu_io, s, snapshot, Export, Qsd};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

/// `ferry ARGS` without any passphrase from the test's environment.
fn ferry_cmd(args: &[&str]) -> Command {
    let mut c = Command::new(ferry_bin());
    c.args(args).env_remove("FERRY_PASSWORD").env_remove("FERRY_PASSWORD_FILE").env_remove("RUST_LOG");
    c
}

fn ferry(args: &[&str]) -> Output {
    run_ok(&mut ferry_cmd(args))
}

fn init(dir: &Path) -> PathBuf {
    let repo = dir.join("repo");
    let out = ferry(&["repo", "init", s(&repo)]);
    assert!(out.stdout.contains("not encrypted"), "{}", out.describe());
    repo
}

/// `ferry backup --json ARGS`: the new snapshot's JSON.
fn backup(args: &[&str]) -> Json {
    let mut a = vec!["backup", "--json"];
    a.extend_from_slice(args);
    let out = ferry(&a);
    Json::must_parse(out.stdout.trim())
}

/// The first field of `ferry hash SRC`.
fn ferry_hash(src: &str) -> String {
    let out = ferry(&["hash", src]);
    out.stdout.split_whitespace().next().unwrap_or_else(|| panic!("no digest: {}", out.describe())).to_string()
}

/// `REPO::NAME@ID`.
fn spec(repo: &Path, name: &str, id: &str) -> String {
    format!("{}::{name}@{id}", repo.display())
}

/// Restores `snap` (`REPO::NAME@ID`) to a new raw file and checks it equals `want`
/// (`qemu-img compare`, format `fmt`); returns the restored file.
fn assert_restores(snap: &str, want: &Path, fmt: &str, out: &Path) {
    let _ = fs::remove_file(out);
    ferry(&["copy", snap, s(out)]);
    qemu_img(&["compare", "-f", "raw", "-F", fmt, s(out), s(want)]);
}

/// Total bytes of the files under `dir`.
fn du(dir: &Path) -> u64 {
    let mut n = 0;
    for e in fs::read_dir(dir).unwrap() {
        let e = e.unwrap();
        let m = e.metadata().unwrap();
        n += if m.is_dir() { du(&e.path()) } else { m.len() };
    }
    n
}

/// The objects under `repo/sub` (e.g. `data`, `index`), as relative paths, sorted.
pub(crate) fn objects(repo: &Path, sub: &str) -> Vec<PathBuf> {
    fn walk(d: &Path, out: &mut Vec<PathBuf>) {
        let Ok(rd) = fs::read_dir(d) else { return };
        for e in rd {
            let p = e.unwrap().path();
            if p.is_dir() {
                walk(&p, out);
            } else if !p.file_name().unwrap().to_string_lossy().starts_with('.') {
                out.push(p);
            }
        }
    }
    let mut v = Vec::new();
    walk(&repo.join(sub), &mut v);
    v.sort();
    v
}

/// One day's changes to a 64 MiB image: scattered writes of assorted sizes, write-zeroes
/// over data, discards; day 0 fills a quarter of the disk.
fn day_workload(day: u64) -> Vec<String> {
    let mut rng = Rng::new(0xda7 + day);
    let mut v = Vec::new();
    if day == 0 {
        for i in 0..16u64 {
            v.push(format!("write -P {} {} {}", 0x10 + i, i * 4 * MIB, MIB));
        }
    }
    for _ in 0..12 {
        let off = rng.below(64 * MIB / 4096 - 64) * 4096;
        let len = 4096 * (1 + rng.below(48));
        v.push(format!("write -P {} {off} {len}", 1 + rng.below(250)));
    }
    for _ in 0..2 {
        let off = rng.below(63) * MIB;
        v.push(format!("write -z {off} {}", 64 * KIB * (1 + rng.below(8))));
        let off = rng.below(63) * MIB;
        v.push(format!("discard {off} {}", 64 * KIB * (1 + rng.below(8))));
    }
    v
}

/// (a) 30 days through `qemu-nbd -r -B b0`.
#[test]
fn thirty_days_from_qemu_nbd_dirty_bitmap() {
    let dir = tempfile::Builder::new().prefix("ferry-repo30").tempdir().unwrap();
    let d = dir.path();
    let repo = init(d);
    let target = format!("{}::vm1-sda", repo.display());
    let img = d.join("vm.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", s(&img), &(64 * MIB).to_string()]);
    qemu_img(&["bitmap", "--add", s(&img), "b0"]);
    let mut days: Vec<(String, String)> = Vec::new(); // (id, blkhash of the day's image)
    let saved = [0usize, 14, 29];
    for day in 0..30u64 {
        qemu_io("qcow2", s(&img), &day_workload(day));
        let e = Export::qemu_nbd(d, "src", &img, "qcow2", true, Some("b0"));
        // Each day's map continues the snapshot of the day before (--since its id).
        let snap = match days.last() {
            None => backup(&[&e.uri(), &target]),
            Some((prev, _)) => backup(&["--dirty-bitmap", "b0", "--since", prev, &e.uri(), &target]),
        };
        e.stop();
        qemu_img(&["bitmap", "--clear", s(&img), "b0"]);
        let id = snap.at("id").as_str().unwrap().to_string();
        assert_eq!(snap.at("name").as_str(), Some("vm1-sda"), "{snap}");
        assert_eq!(snap.u64_at("size"), 64 * MIB, "{snap}");
        if day > 0 {
            // Only the changed ranges were read: a few MiB, not the 16 MiB of data.
            assert!(snap.u64_at("read") < 8 * MIB, "day {day} read too much: {snap}");
            assert_eq!(snap.at("changes").at("kind").as_str(), Some("dirty-bitmap"), "{snap}");
            assert_eq!(snap.at("parent").as_str(), Some(days[day as usize - 1].0.as_str()), "{snap}");
        }
        if saved.contains(&(day as usize)) {
            snapshot(s(&img), "qcow2", &d.join(format!("day{day}.raw")));
        }
        days.push((id, ferry_hash(s(&img))));
    }
    let list = Json::must_parse(&ferry(&["repo", "list", "--json", s(&repo)]).stdout);
    assert_eq!(list.as_array().unwrap().len(), 30, "{list}");
    let text = ferry(&["repo", "list", s(&repo), "vm1-sda"]).stdout;
    assert!(text.contains(&days[29].0[..8]) && text.contains("dirty-bitmap b0"), "{text}");
    let out = d.join("restored.raw");
    for (day, (id, hash)) in days.iter().enumerate() {
        let sp = spec(&repo, "vm1-sda", id);
        // From the index, and from the data as a restore reads it (the restored files of
        // three days are compared with those days' images too).
        assert_eq!(&ferry_hash(&sp), hash, "ferry hash {sp} (day {day})");
        let read = ferry(&["copy", "--hash", &sp, "null:"]).stdout;
        assert!(read.starts_with(hash.as_str()), "day {day}: the data of {sp} hashes to {read}, the image to {hash}");
        if saved.contains(&day) {
            assert_restores(&sp, &d.join(format!("day{day}.raw")), "raw", &out);
        }
    }
    // REPO::NAME is the latest; a unique prefix of 4 digits is enough.
    let latest = format!("{}::vm1-sda", repo.display());
    assert_eq!(ferry_hash(&latest), days[29].1);
    let info = ferry(&["info", &spec(&repo, "vm1-sda", &days[3].0[..8])]).stdout;
    assert!(info.contains(&days[3].0) && info.contains("dirty-bitmap b0") && info.contains(&days[2].0), "{info}");
    let r = ferry(&["repo", "check", s(&repo)]);
    assert!(r.stdout.contains("no damage"), "{}", r.describe());
}

/// Refusals: a change map without a previous snapshot, a size change with one, a
/// snapshot as a copy destination or a writable export, a read pool of no thread.
#[test]
fn refusals_say_what_to_do() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let repo = init(d);
    let t = format!("{}::disk", repo.display());
    let img = write_sparse_file(d, "a.raw", &data_with_holes(4 * MIB as usize, 7));
    let ext = d.join("ext.json");
    fs::write(&ext, r#"[{"offset": 0, "length": 65536, "type": 1}]"#).unwrap();
    let out = run_fails(&mut ferry_cmd(&["backup", "--extents-from", s(&ext), s(&img), &t]));
    assert!(out.stderr.contains("first backup of disk reads everything"), "{}", out.describe());
    backup(&[s(&img), &t]);
    let big = write_sparse_file(d, "b.raw", &data_with_holes(5 * MIB as usize, 8));
    let out = run_fails(&mut ferry_cmd(&["backup", "--extents-from", s(&ext), s(&big), &t]));
    assert!(out.stderr.contains("full backup"), "{}", out.describe());
    // Without a change map, another size is a full read of its own (with no parent: a
    // second later, so that it is the latest by time, which has whole seconds).
    std::thread::sleep(Duration::from_millis(1100));
    let snap = backup(&[s(&big), &t]);
    assert_eq!(snap.u64_at("size"), 5 * MIB);
    assert_restores(&format!("{t}@{}", snap.at("id").as_str().unwrap()), &big, "raw", &d.join("o.raw"));
    // An incremental with a map onto the 5 MiB base.
    let snap2 = backup(&["--extents-from", s(&ext), "--since", snap.at("id").as_str().unwrap(), s(&big), &t]);
    assert!(snap2.u64_at("read") <= 65536, "{snap2}");
    let out = run_fails(&mut ferry_cmd(&["copy", s(&img), &t]));
    assert!(out.stderr.contains("ferry backup"), "{}", out.describe());
    let out = run_fails(&mut ferry_cmd(&["serve", "-U", s(&d.join("x.sock")), &t]));
    assert!(out.stderr.contains("--read-only"), "{}", out.describe());
    // A read pool of no thread (or over 64) is refused before anything is served.
    for bad in ["0", "65"] {
        let mut c = ferry_cmd(&["serve", "-r", "-U", s(&d.join("x.sock")), "--run", "true", &t]);
        let out = run_fails(c.env("FERRY_REPO_READ_THREADS", bad));
        assert!(
            out.stderr.contains("FERRY_REPO_READ_THREADS=\"") && out.stderr.contains("from 1 to 64"),
            "{}",
            out.describe()
        );
    }
    let out = run_fails(&mut ferry_cmd(&["copy", &format!("{t}@0000"), s(&d.join("n.raw"))]));
    assert!(!out.stderr.is_empty(), "{}", out.describe());
}

/// (b) libvirt's pull mode, 30 days: each day qemu-storage-daemon's fleecing export of
/// that moment and its dirty bitmap since the day before, the guest writing on meanwhile.
#[test]
fn pull_mode_from_qemu_storage_daemon() {
    let dir = tempfile::Builder::new().prefix("ferry-repopull").tempdir().unwrap();
    let d = dir.path();
    let repo = init(d);
    let target = format!("{}::guest", repo.display());
    let img = d.join("disk.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", s(&img), &(64 * MIB).to_string()]);
    let mut qsd = Qsd::start(d, &img);
    let guest = qsd.uri("guest");
    qemu_io("raw", &guest, &crate::incremental_backup::workload(0));
    // (id, blkhash of the day's point in time, that point saved as a raw file)
    let mut snaps: Vec<(String, String, Option<PathBuf>)> = Vec::new();
    let saved = [0u32, 1, 14, 29];
    for round in 0..30u32 {
        if round > 0 {
            qemu_io("raw", &guest, &crate::incremental_backup::workload(round));
        }
        let name = format!("backup{round}");
        let old = (round > 0).then(|| format!("b{}", round - 1));
        qsd.begin_backup(d, &name, old.as_deref(), &format!("b{round}"));
        let src = qsd.uri(&name);
        let want = saved.contains(&round).then(|| {
            let want = d.join(format!("want{round}.raw"));
            snapshot(&src, "raw", &want);
            want
        });
        let hash = ferry_hash(&src);
        qemu_io("raw", &guest, &crate::incremental_backup::during_backup(round));
        let snap = match (&old, snaps.last()) {
            (Some(b), Some((prev, _, _))) => backup(&["--dirty-bitmap", b, "--since", prev, &src, &target]),
            _ => backup(&[&src, &target]),
        };
        qsd.end_backup(&name);
        if round > 0 {
            assert!(snap.u64_at("read") < 16 * MIB, "day {round} read too much: {snap}");
            assert_eq!(snap.at("parent").as_str(), Some(snaps[round as usize - 1].0.as_str()), "{snap}");
        }
        snaps.push((snap.at("id").as_str().unwrap().to_string(), hash, want));
    }
    qsd.quit();
    let list = Json::must_parse(&ferry(&["repo", "list", "--json", s(&repo)]).stdout);
    assert_eq!(list.as_array().unwrap().len(), 30, "{list}");
    for (day, (id, hash, want)) in snaps.iter().enumerate() {
        let sp = spec(&repo, "guest", id);
        // The blkhash from the index, and of the data as a restore reads it.
        assert_eq!(&ferry_hash(&sp), hash, "ferry hash {sp} (day {day})");
        let read = ferry(&["copy", "--hash", &sp, "null:"]).stdout;
        assert!(read.starts_with(hash.as_str()), "day {day}: the data of {sp} hashes to {read}, the image to {hash}");
        if let Some(want) = want {
            assert_restores(&sp, want, "raw", &d.join("restored.raw"));
        }
    }
}

/// (c) Encryption: passphrases, and no plaintext in the store.
#[test]
fn encrypted_repository() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // Incompressible data: stored as is in a plain repository, so a window of it is found
    // in its packs there (the check below can see plaintext), and must not be when encrypted.
    let data = Rng::new(99).bytes(2 * MIB as usize);
    let img = write_sparse_file(d, "disk.raw", &data);
    let needle = &data[100_000..100_064];
    let found_in =
        |repo: &Path| objects(repo, "data").iter().any(|p| fs::read(p).unwrap().windows(64).any(|w| w == needle));

    let plain = init(d);
    backup(&[s(&img), &format!("{}::d", plain.display())]);
    assert!(found_in(&plain), "the plaintext check sees nothing even unencrypted");

    let enc = d.join("enc");
    let pw = d.join("pw");
    fs::write(&pw, "correct horse\n").unwrap();
    let out = run_fails(&mut ferry_cmd(&["repo", "init", "--encrypt", s(&enc)]));
    assert!(out.stderr.contains("passphrase"), "{}", out.describe());
    let out = ferry(&["repo", "init", "--encrypt", "--kdf-memory", "8M", "--password-file", s(&pw), s(&enc)]);
    assert!(out.stdout.contains("encrypted") && out.stderr.contains("passphrase"), "{}", out.describe());
    let t = format!("{}::d", enc.display());
    let snap = backup(&["--password-file", s(&pw), s(&img), &t]);
    assert!(!found_in(&enc), "plaintext found in an encrypted repository's packs");
    let id = snap.at("id").as_str().unwrap();

    // No passphrase: says how to give one. A wrong one: says so.
    let out = run_fails(&mut ferry_cmd(&["copy", &t, s(&d.join("x.raw"))]));
    assert!(out.stderr.contains("FERRY_PASSWORD"), "{}", out.describe());
    let out = run_fails(ferry_cmd(&["repo", "list", s(&enc)]).env("FERRY_PASSWORD", "wrong horse"));
    assert!(out.stderr.to_lowercase().contains("passphrase"), "{}", out.describe());
    // The right one, from the environment or a file.
    let out_file = d.join("restored.raw");
    run_ok(ferry_cmd(&["copy", &format!("{t}@{id}"), s(&out_file)]).env("FERRY_PASSWORD", "correct horse"));
    assert_file_eq(&out_file, &data);
    let h = run_ok(ferry_cmd(&["hash", &t]).env("FERRY_PASSWORD_FILE", s(&pw))).stdout;
    assert!(h.starts_with(&ferry_hash(s(&img))), "{h}");
    let info = run_ok(ferry_cmd(&["info", &t]).env("FERRY_PASSWORD", "correct horse")).stdout;
    assert!(info.contains("(encrypted"), "{info}");
}

/// The processes ferry starts (`ferry serve --run`, an S3 profile's `credential_process`)
/// do not get FERRY_PASSWORD from its environment.
#[test]
fn children_do_not_get_the_passphrase() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let seen = d.join("seen");
    let show = format!("printf '[%s][%s]' \"$FERRY_PASSWORD\" \"$FERRY_PASSWORD_FILE\" > '{}'", seen.display());
    let sock = d.join("s.sock");
    let mut c = ferry_cmd(&["serve", "-U", s(&sock), "--run", &show, "memory:1M"]);
    run_ok(c.env("FERRY_PASSWORD", "correct horse").env("FERRY_PASSWORD_FILE", "/pw"));
    // The file's name is no secret: it stays.
    assert_eq!(fs::read_to_string(&seen).unwrap(), "[][/pw]");

    let script = d.join("creds.sh");
    fs::write(&script, format!("#!/bin/sh\n{show}\nexit 3\n")).unwrap();
    fs::set_permissions(&script, fs::Permissions::from_mode(0o755)).unwrap();
    fs::create_dir_all(d.join(".aws")).unwrap();
    fs::write(d.join(".aws/config"), format!("[profile p]\ncredential_process = {}\n", script.display())).unwrap();
    fs::remove_file(&seen).unwrap();
    let mut c = ferry_cmd(&["info", "s3://bucket/key"]);
    for v in [
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_CONFIG_FILE",
        "AWS_SHARED_CREDENTIALS_FILE",
        "AWS_WEB_IDENTITY_TOKEN_FILE",
        "AWS_ROLE_ARN",
    ] {
        c.env_remove(v);
    }
    c.env("HOME", d).env("AWS_PROFILE", "p").env("AWS_ENDPOINT_URL", "http://127.0.0.1:9");
    let out = run_fails(c.env("FERRY_PASSWORD", "correct horse").env("FERRY_PASSWORD_FILE", "/pw"));
    assert!(out.stderr.contains("credential_process"), "{}", out.describe());
    assert_eq!(fs::read_to_string(&seen).unwrap(), "[][/pw]");
}

/// A raw disk of `len` bytes whose `day`'s data differs from every other day's.
fn day_disk(d: &Path, day: u64, len: usize) -> (PathBuf, Vec<u8>) {
    let mut data = data_with_holes(len, 1000);
    let changed = Rng::new(day + 1).bytes(len / 4);
    let at = (day as usize % 4) * len / 4;
    data[at..at + len / 4].copy_from_slice(&changed);
    (write_sparse_file(d, &format!("day{day}.raw"), &data), data)
}

/// (d) forget --keep-last 3, then gc: the kept snapshots restore exactly, the others are
/// gone, and the repository shrinks.
#[test]
fn forget_and_gc() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let repo = init(d);
    let t = format!("{}::disk", repo.display());
    let mut snaps = Vec::new();
    for day in 0..6u64 {
        let (p, _) = day_disk(d, day, 8 * MIB as usize);
        let snap = backup(&[s(&p), &t]);
        snaps.push((snap.at("id").as_str().unwrap().to_string(), p));
    }
    // A second disk that forget REPO::disk leaves alone.
    let (other, _) = day_disk(d, 9, 2 * MIB as usize);
    backup(&[s(&other), &format!("{}::other", repo.display())]);
    let before = du(&repo);
    let dry = ferry(&["repo", "forget", "--keep-last", "3", "--dry-run", &t]);
    assert!(dry.stdout.contains("would remove"), "{}", dry.describe());
    assert_eq!(Json::must_parse(&ferry(&["repo", "list", "--json", s(&repo)]).stdout).as_array().unwrap().len(), 7);
    let out = ferry(&["repo", "forget", "--keep-last", "3", "--json", &t]);
    let r = Json::must_parse(&out.stdout);
    let removed: Vec<&str> = r.array_at("removed").iter().map(|v| v.as_str().unwrap()).collect();
    let want_removed: Vec<&str> = snaps[..3].iter().map(|s| s.0.as_str()).collect();
    let mut sorted = removed.clone();
    sorted.sort();
    let mut want_sorted = want_removed.clone();
    want_sorted.sort();
    assert_eq!(sorted, want_sorted, "{}", out.describe());
    let list = Json::must_parse(&ferry(&["repo", "list", "--json", s(&repo)]).stdout);
    let ids: Vec<&str> = list.as_array().unwrap().iter().map(|v| v.at("id").as_str().unwrap()).collect();
    assert_eq!(ids.len(), 4, "{list}");
    for (id, _) in &snaps[3..] {
        assert!(ids.contains(&id.as_str()), "{id} not kept: {list}");
    }
    let gc = ferry(&["repo", "gc", s(&repo)]);
    let after = du(&repo);
    assert!(after < before, "gc freed nothing: {before} -> {after}\n{}", gc.describe());
    for (id, p) in &snaps[3..] {
        assert_restores(&spec(&repo, "disk", id), p, "raw", &d.join("r.raw"));
    }
    for (id, _) in &snaps[..3] {
        run_fails(&mut ferry_cmd(&["copy", &spec(&repo, "disk", id), s(&d.join("gone.raw"))]));
    }
    assert_restores(&format!("{}::other", repo.display()), &other, "raw", &d.join("r.raw"));
    let c = ferry(&["repo", "check", s(&repo)]);
    assert!(c.stdout.contains("no damage"), "{}", c.describe());
    let v = ferry(&["repo", "verify", s(&repo)]);
    assert!(v.stdout.contains("no damage"), "{}", v.describe());
    let st = Json::must_parse(&ferry(&["repo", "stats", "--json", s(&repo)]).stdout);
    assert_eq!(st.u64_at("snapshots"), 4, "{st}");
    assert_eq!(st.u64_at("disks"), 2, "{st}");
}

/// The largest file first (a pack of data, rather than one of pages).
fn largest_first(mut v: Vec<PathBuf>) -> Vec<PathBuf> {
    v.sort_by_key(|p| std::cmp::Reverse(fs::metadata(p).unwrap().len()));
    v
}

/// (e) verify and check find damage and name what it hits: a flipped byte in a pack, a
/// deleted pack, a truncated index object.
#[test]
fn verify_and_check_name_damage() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let repo = init(d);
    // Two disks that share no chunk, each backup's data in packs of its own.
    let a = write_sparse_file(d, "a.raw", &Rng::new(5).bytes(4 * MIB as usize));
    let a1 = backup(&[s(&a), &format!("{}::a", repo.display())]);
    let packs_a = largest_first(objects(&repo, "data"));
    let b = write_sparse_file(d, "b.raw", &Rng::new(6).bytes(4 * MIB as usize));
    let b1 = backup(&[s(&b), &format!("{}::b", repo.display())]);
    let packs_b = largest_first(objects(&repo, "data").into_iter().filter(|p| !packs_a.contains(p)).collect());
    assert!(!packs_a.is_empty() && !packs_b.is_empty(), "{packs_a:?} {packs_b:?}");
    let (a1, b1) = (a1.at("id").as_str().unwrap().to_string(), b1.at("id").as_str().unwrap().to_string());
    let hash_a = ferry_hash(&spec(&repo, "a", &a1));
    let v = ferry(&["repo", "verify", s(&repo)]);
    assert!(v.stdout.contains("no damage"), "{}", v.describe());

    // A flipped byte in a's pack: verify names a's snapshot, not b's.
    let mut bytes = fs::read(&packs_a[0]).unwrap();
    bytes[200] ^= 0x40;
    fs::write(&packs_a[0], &bytes).unwrap();
    let out = run(&mut ferry_cmd(&["repo", "verify", s(&repo)]));
    assert_eq!(out.status.code(), Some(13), "{}", out.describe());
    let pack_a_name = packs_a[0].file_name().unwrap().to_str().unwrap();
    assert!(out.stdout.contains(pack_a_name), "the pack is not named\n{}", out.describe());
    assert!(out.stdout.contains(&a1[..8]), "a's snapshot is not named\n{}", out.describe());
    assert!(!out.stdout.contains(&b1[..8]), "b's snapshot is named\n{}", out.describe());
    // check reads no data, but verify recorded the damage in the repository: check names
    // it from the record. `ferry hash` takes a's blkhash from its index, while a restore
    // reads the damaged chunk and fails.
    let out = run(&mut ferry_cmd(&["repo", "check", s(&repo)]));
    assert_eq!(out.status.code(), Some(13), "{}", out.describe());
    assert!(out.stdout.contains("recorded damaged by `ferry repo verify`"), "{}", out.describe());
    assert!(out.stdout.contains(&a1[..8]) && !out.stdout.contains(&b1[..8]), "{}", out.describe());
    assert_eq!(ferry_hash(&spec(&repo, "a", &a1)), hash_a, "ferry hash read the data instead of the index");
    let out = run_fails(&mut ferry_cmd(&["copy", &spec(&repo, "a", &a1), s(&d.join("a.out"))]));
    assert!(out.stderr.contains(pack_a_name), "{}", out.describe());

    // b's pack deleted: check names it and b's snapshot.
    fs::remove_file(&packs_b[0]).unwrap();
    let out = run(&mut ferry_cmd(&["repo", "check", s(&repo)]));
    assert_eq!(out.status.code(), Some(13), "{}", out.describe());
    let pack_b_name = packs_b[0].file_name().unwrap().to_str().unwrap();
    assert!(out.stdout.contains(pack_b_name), "the deleted pack is not named\n{}", out.describe());
    assert!(out.stdout.contains(&b1[..8]), "b's snapshot is not named\n{}", out.describe());

    // A truncated index object: an error naming it.
    let index = objects(&repo, "index");
    assert!(!index.is_empty());
    let victim = &index[0];
    let len = fs::metadata(victim).unwrap().len();
    fs::OpenOptions::new().write(true).open(victim).unwrap().set_len(len / 2).unwrap();
    let out = run(&mut ferry_cmd(&["repo", "check", s(&repo)]));
    assert!(!out.status.success(), "{}", out.describe());
    let name = victim.file_name().unwrap().to_str().unwrap();
    assert!(
        out.stdout.contains(name) || out.stderr.contains(name),
        "the truncated index object is not named\n{}",
        out.describe()
    );
}

/// (f) A snapshot served read-only: qemu-img reads it, nbdinfo --map shows its holes.
#[test]
fn serve_a_snapshot() {
    require("nbdinfo");
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let repo = init(d);
    let len = 16 * MIB as usize;
    let data = data_with_holes(len, 31);
    let img = write_sparse_file(d, "disk.raw", &data);
    let id = backup(&[s(&img), &format!("{}::disk", repo.display())]).at("id").as_str().unwrap().to_string();
    let sp = spec(&repo, "disk", &id[..6]);
    let server = ServerBuilder::new(&sp).read_only().start();
    let uri = server.uri();
    qemu_img(&["compare", "-f", "raw", "-F", "raw", &uri, s(&img)]);
    let map = Json::must_parse(&run_ok(&mut cmd("nbdinfo", ["--json", "--map", &uri])).stdout);
    let chunk = 64 * KIB as usize;
    let mut covered = 0u64;
    for e in map.as_array().unwrap() {
        let (off, l, ty) = (e.u64_at("offset") as usize, e.u64_at("length") as usize, e.u64_at("type"));
        assert_eq!(off as u64, covered, "{map}");
        covered += l as u64;
        for c in (off..off + l).step_by(chunk) {
            let end = (c + chunk).min(len);
            let zero = data[c..end].iter().all(|&b| b == 0);
            assert_eq!(ty & 2 != 0, zero, "chunk at {c}: map type {ty}, data zero: {zero}\n{map}");
        }
    }
    assert_eq!(covered, len as u64);
    // Nothing can write it.
    let out = run(&mut cmd("qemu-io", ["-f", "raw", "-c", "write 0 4096", &uri]));
    assert!(
        !out.status.success() || out.stderr.contains("failed") || out.stdout.contains("failed"),
        "{}",
        out.describe()
    );
}

/// Two snapshots of one disk served side by side: each offers the chunks that differ from
/// the other as `qemu:dirty-bitmap:ID8`, so an NBD backup tool copies only the difference.
#[test]
fn serve_two_snapshots_offers_their_difference() {
    require("nbdinfo");
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let repo = init(d);
    let len = 8 * MIB as usize;
    let old = data_with_holes(len, 41);
    let mut new = old.clone();
    // Changes in chunks 3, 17..=18 (a write across their border) and 100 (now zero).
    let chunk = 64 * KIB as usize;
    new[3 * chunk + 10] ^= 0xff;
    for b in &mut new[18 * chunk - 100..18 * chunk + 100] {
        *b = b.wrapping_add(1);
    }
    new[100 * chunk..101 * chunk].fill(0);
    let t = format!("{}::disk", repo.display());
    let img = write_sparse_file(d, "old.raw", &old);
    let id1 = backup(&[s(&img), &t]).at("id").as_str().unwrap().to_string();
    let img = write_sparse_file(d, "new.raw", &new);
    let id2 = backup(&[s(&img), &t]).at("id").as_str().unwrap().to_string();
    let server = ServerBuilder::new(&spec(&repo, "disk", &id2))
        .read_only()
        .args(&["--export", &format!("old={}", spec(&repo, "disk", &id1))])
        .start();
    let map = |uri: &str, ctx: &str| -> Vec<(u64, u64)> {
        let out = run_ok(&mut cmd("nbdinfo", ["--json", &format!("--map=qemu:dirty-bitmap:{ctx}"), uri]));
        let v = Json::must_parse(&out.stdout);
        v.as_array()
            .unwrap()
            .iter()
            .filter(|e| e.u64_at("type") & 1 != 0)
            .map(|e| (e.u64_at("offset"), e.u64_at("length")))
            .collect()
    };
    let c = chunk as u64;
    let want: Vec<(u64, u64)> = vec![(3 * c, c), (17 * c, 2 * c), (100 * c, c)];
    let want = if old[100 * chunk..101 * chunk].iter().all(|&b| b == 0) { want[..2].to_vec() } else { want };
    assert_eq!(map(&server.uri(), &id1[..8]), want, "the new snapshot's changes since the old");
    assert_eq!(map(&server.uri_export("old"), &id2[..8]), want, "the old snapshot's differences from the new");
}

/// (g) Backups of two disks at once both succeed; a second backup of the same disk is
/// refused while one runs, and waits for it with --wait.
#[test]
fn concurrent_backups() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let repo = init(d);
    let a = write_sparse_file(d, "a.raw", &Rng::new(1).bytes(4 * MIB as usize));
    let b = write_sparse_file(d, "b.raw", &Rng::new(2).bytes(4 * MIB as usize));
    let ta = format!("{}::a", repo.display());
    let tb = format!("{}::b", repo.display());
    // About 2 s each at 2 MiB/s.
    let slow = |src: &Path, t: &str| {
        ferry_cmd(&["backup", "--rate", "2M", s(src), t]).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap()
    };
    let ca = slow(&a, &ta);
    let cb = slow(&b, &tb);
    assert!(wait_until(Duration::from_secs(10), || objects(&repo, "locks").len() >= 2), "no locks taken");
    // The same disk meanwhile: refused at once, naming the running backup's process.
    let out = run_fails(&mut ferry_cmd(&["backup", s(&a), &ta]));
    assert!(out.stderr.contains(&ca.id().to_string()), "the holder is not named\n{}", out.describe());
    // A gc meanwhile must not free what the running backups will reference: it waits.
    let gc = ferry_cmd(&["repo", "gc", "--wait", "60", s(&repo)])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // With --wait it waits for the running one.
    let waited = ferry(&["backup", "--json", "--wait", "60", s(&a), &ta]);
    for c in [ca, cb, gc] {
        let o = c.wait_with_output().unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
    let c = ferry(&["repo", "check", s(&repo)]);
    assert!(c.stdout.contains("no damage"), "{}", c.describe());
    let list = Json::must_parse(&ferry(&["repo", "list", "--json", s(&repo)]).stdout);
    assert_eq!(list.as_array().unwrap().len(), 3, "{list}\n{}", waited.describe());
    assert_restores(&ta, &a, "raw", &d.join("ra.raw"));
    assert_restores(&tb, &b, "raw", &d.join("rb.raw"));
    assert!(objects(&repo, "locks").is_empty(), "locks left behind");
}

/// The bitmaps of `img` (qemu-img info), as (name, flags).
fn qcow2_bitmaps(img: &Path) -> Vec<(String, Vec<String>)> {
    let info = Json::must_parse(&qemu_img(&["info", "--output=json", s(img)]).stdout);
    let Some(list) = info.at("format-specific").at("data").get("bitmaps").and_then(Json::as_array) else {
        return Vec::new();
    };
    list.iter()
        .map(|b| {
            let flags = b.array_at("flags").iter().map(|f| f.as_str().unwrap().to_string()).collect();
            (b.at("name").as_str().unwrap().to_string(), flags)
        })
        .collect()
}

/// (optional) A stopped VM's local qcow2 image, its change tracking kept by ferry: the
/// first backup adds a bitmap named after its snapshot, each later one reads only what it
/// marks and restarts it after the commit; a backup killed midway, and a snapshot of the
/// disk taken from elsewhere in between, never make a later backup miss a change.
#[test]
fn stopped_vm_qcow2_tracked_by_ferry() {
    let dir = tempfile::Builder::new().prefix("ferry-repotrack").tempdir().unwrap();
    let d = dir.path();
    let repo = init(d);
    let t = format!("{}::vm", repo.display());
    let img = d.join("vm.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", s(&img), &(64 * MIB).to_string()]);
    let mut days: Vec<(String, String)> = Vec::new();
    // ferry's bitmaps are named ferry-REPO8-NAME-ID16 (REPO8: the repository id's start).
    let config = Json::must_parse(&fs::read_to_string(repo.join("config")).unwrap());
    let repo8: String = config.at("id").as_str().unwrap().chars().take(8).collect();
    let tracked = |id: &str| format!("ferry-{repo8}-vm-{}", &id[..16]);
    for day in 0..6u64 {
        qemu_io("qcow2", s(&img), &day_workload(day));
        if day == 2 {
            // Killed midway (4 MiB more changed, read at 1 MiB/s): no snapshot, the
            // bitmap untouched, the lock stale.
            qemu_io("qcow2", s(&img), &[format!("write -P 0x77 {} {}", 40 * MIB, 4 * MIB)]);
            let mut child = ferry_cmd(&["backup", "--rate", "1M", s(&img), &t])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap();
            assert!(wait_until(Duration::from_secs(10), || !objects(&repo, "locks").is_empty()), "no lock taken");
            std::thread::sleep(Duration::from_millis(300));
            assert!(child.try_wait().unwrap().is_none(), "the backup to kill has ended already");
            child.kill().unwrap();
            child.wait().unwrap();
        }
        if day == 4 {
            // A snapshot of the disk from elsewhere: the bitmap does not continue it.
            let other = write_sparse_file(d, "other.raw", &Rng::new(4).bytes(64 * MIB as usize));
            backup(&[s(&other), &t]);
        }
        let snap = backup(&[s(&img), &t]);
        let id = snap.at("id").as_str().unwrap().to_string();
        let bitmaps = qcow2_bitmaps(&img);
        assert_eq!(bitmaps, [(tracked(&id), vec!["auto".to_string()])], "day {day}");
        match day {
            0 | 4 => assert_eq!(snap.at("changes").at("kind").as_str(), Some("full"), "day {day}: {snap}"),
            _ => {
                let prev = &days[day as usize - 1].0;
                let want = serde_json::json!({"kind": "dirty-bitmap", "bitmap": tracked(prev)});
                assert_eq!(snap.at("changes"), &want, "day {day}: {snap}");
                assert!(snap.u64_at("read") < 8 * MIB, "day {day} read too much: {snap}");
            }
        }
        days.push((id, ferry_hash(s(&img))));
    }
    for (day, (id, hash)) in days.iter().enumerate() {
        let sp = spec(&repo, "vm", id);
        let read = ferry(&["copy", "--hash", &sp, "null:"]).stdout;
        assert!(read.starts_with(hash.as_str()), "day {day}: {sp} reads as {read}, the image was {hash}");
    }
    // --no-bitmap leaves the image alone.
    let before = qcow2_bitmaps(&img);
    backup(&["--no-bitmap", s(&img), &t]);
    assert_eq!(qcow2_bitmaps(&img), before);
    qemu_img(&["check", s(&img)]);
}

/// A repository under an S3 prefix (moto): backups, restores, verify, few objects.
#[test]
fn s3_repository_on_moto() {
    use crate::remote_images::{keys, make_bucket, s3ferry};
    make_bucket("ferry-repo-bkt");
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let repo = "s3://ferry-repo-bkt/backups";
    let t = format!("{repo}::disk");
    let run_s3 = |args: &[&str]| {
        let mut c = s3ferry(args);
        c.env_remove("FERRY_PASSWORD").env_remove("FERRY_PASSWORD_FILE");
        run_ok(&mut c)
    };
    run_s3(&["repo", "init", repo]);
    let mut snaps = Vec::new();
    for day in 0..3u64 {
        let (p, _) = day_disk(d, day, 8 * MIB as usize);
        let out = run_s3(&["backup", "--json", s(&p), &t]);
        snaps.push((Json::must_parse(out.stdout.trim()).at("id").as_str().unwrap().to_string(), p));
    }
    for (id, p) in &snaps {
        let out = d.join("restored.raw");
        let _ = fs::remove_file(&out);
        run_s3(&["copy", &format!("{t}@{id}"), s(&out)]);
        qemu_img(&["compare", "-f", "raw", "-F", "raw", s(&out), s(p)]);
        let h = run_s3(&["hash", &format!("{t}@{id}")]).stdout;
        assert!(h.starts_with(&ferry_hash(s(p))), "{h}");
    }
    let v = run_s3(&["repo", "verify", repo]);
    assert!(v.stdout.contains("no damage"), "{}", v.describe());
    let k = keys("ferry-repo-bkt");
    assert!(k.iter().all(|k| k.starts_with("backups/")), "{k:?}");
    assert!(k.contains(&"backups/config".to_string()), "{k:?}");
    // Packs hold many chunks: a few objects per backup, not one per chunk.
    assert!(k.len() < 30, "{} objects for 3 backups: {k:?}", k.len());
}
