//! Located snapshots (issue 35, FORMAT.md §7c): in a version 3 repository a snapshot says
//! where its chunks are, so restore, serve and hash read no index (the disaster-recovery
//! host with a cold cache); hints made stale by a gc that repacks are followed through
//! the index; `ferry repo migrate` upgrades version 1 and 2 repositories in place, and a
//! migrate killed at any point is finished by the next.

use crate::common::*;
use crate::repo_crash::{ferry_cmd, s};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

const MIB: usize = 1 << 20;

/// A repository and the host-local cache its commands use.
struct Repo {
    _dir: tempfile::TempDir,
    dir: PathBuf,
    repo: String,
    cache: PathBuf,
    password: Option<PathBuf>,
}

impl Repo {
    /// `ferry repo init` with `args` (a format version, --encrypt).
    fn init(args: &[&str]) -> Repo {
        let dir = tempfile::Builder::new().prefix("ferry-located").tempdir().unwrap();
        let d = dir.path().to_path_buf();
        let password = args.contains(&"--encrypt").then(|| {
            let p = d.join("pw");
            fs::write(&p, "correct horse\n").unwrap();
            p
        });
        let r = Repo { repo: s(&d.join("repo")).to_string(), cache: d.join("cache"), dir: d, _dir: dir, password };
        let mut a = vec!["repo", "init", "--kdf-memory", "8M"];
        a.extend_from_slice(args);
        let repo = r.repo.clone();
        a.push(&repo);
        r.ok(&a);
        r
    }

    fn cmd(&self, args: &[&str]) -> Command {
        let mut c = ferry_cmd(args);
        c.env("FERRY_CACHE_DIR", &self.cache);
        if let Some(p) = &self.password {
            c.env("FERRY_PASSWORD_FILE", p);
        }
        c
    }

    fn ok(&self, args: &[&str]) -> Output {
        run_ok(&mut self.cmd(args))
    }

    fn snap(&self, name: &str) -> String {
        format!("{}::{name}", self.repo)
    }

    /// A raw image of `bytes` in the test's directory.
    fn image(&self, name: &str, bytes: &[u8]) -> PathBuf {
        let p = self.dir.join(name);
        fs::write(&p, bytes).unwrap();
        p
    }

    /// `ferry backup --json IMG REPO::NAME`: the new snapshot's id.
    fn backup(&self, img: &Path, name: &str) -> String {
        let out = self.ok(&["backup", "--json", s(img), &self.snap(name)]);
        let v: serde_json::Value = serde_json::from_str(out.stdout.trim()).unwrap();
        v["id"].as_str().unwrap().to_string()
    }

    /// `ferry copy SNAP FILE`, then the file's bytes.
    fn restore(&self, snap: &str) -> Result<Vec<u8>, std::process::Output> {
        let out = self.dir.join("restored.raw");
        let _ = fs::remove_file(&out);
        let o = self.cmd(&["copy", snap, s(&out)]).output().unwrap();
        if !o.status.success() {
            return Err(o);
        }
        Ok(fs::read(&out).unwrap())
    }

    /// The first field of `ferry hash SRC`.
    fn hash(&self, src: &str) -> Result<String, std::process::Output> {
        let o = self.cmd(&["hash", src]).output().unwrap();
        if !o.status.success() {
            return Err(o);
        }
        Ok(String::from_utf8_lossy(&o.stdout).split_whitespace().next().unwrap_or("").to_string())
    }

    /// The cache deleted and `index/` moved away: a host that never saw the repository,
    /// and a repository whose index cannot help it. Returns a guard that puts it back.
    fn without_index(&self) -> IndexAway {
        let _ = fs::remove_dir_all(&self.cache);
        let index = Path::new(&self.repo).join("index");
        let away = self.dir.join("index-away");
        fs::rename(&index, &away).unwrap();
        fs::create_dir(&index).unwrap();
        IndexAway { index, away }
    }
}

struct IndexAway {
    index: PathBuf,
    away: PathBuf,
}

impl Drop for IndexAway {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.index);
        let _ = fs::rename(&self.away, &self.index);
    }
}

/// Two disks backed up twice each (the second time with a quarter changed): the images of
/// the latest, by disk name.
fn fleet(r: &Repo) -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    for (i, name) in ["vm1-sda", "vm2-sda"].iter().enumerate() {
        let mut bytes = Rng::new(i as u64 + 1).bytes(6 * MIB);
        bytes[2 * MIB..3 * MIB].fill(0);
        let img = r.image(&format!("{name}.raw"), &bytes);
        r.backup(&img, name);
        Rng::new(i as u64 + 50).fill(&mut bytes[4 * MIB..5 * MIB + 12345]);
        let img = r.image(&format!("{name}.raw"), &bytes);
        r.backup(&img, name);
        out.push((name.to_string(), bytes));
    }
    out
}

/// (a) Version 3: restore, serve and hash of a snapshot need no index: with the cache
/// deleted and `index/` moved away they still give the disk byte for byte. Version 1
/// cannot (the same steps fail), which shows that the test can fail.
#[test]
fn a_located_snapshot_reads_without_any_index() {
    let r = Repo::init(&[]);
    let config = fs::read_to_string(Path::new(&r.repo).join("config")).unwrap();
    assert!(config.contains("\"version\": 3"), "{config}");
    let disks = fleet(&r);
    for (name, want) in &disks {
        let img = r.image("want.raw", want);
        let want_hash = r.hash(s(&img)).unwrap();
        let _away = r.without_index();
        let got = r.restore(&r.snap(name)).unwrap_or_else(|o| panic!("restore without an index: {o:?}"));
        assert!(got == *want, "{name} restored without an index differs");
        assert_eq!(r.hash(&r.snap(name)).unwrap(), want_hash);
        // Served, and read by qemu-img.
        let sock = r.dir.join("s.sock");
        let out = r.dir.join("served.raw");
        let _ = fs::remove_file(&out);
        let conv = format!("qemu-img convert -f raw -O raw \"$uri\" '{}'", out.display());
        r.ok(&["serve", "-r", "-U", s(&sock), "--run", &conv, &r.snap(name)]);
        assert!(fs::read(&out).unwrap() == *want, "{name} served without an index differs");
    }

    let old = Repo::init(&["--format-version", "1"]);
    let disks = fleet(&old);
    let _away = old.without_index();
    assert!(old.restore(&old.snap(&disks[0].0)).is_err(), "a version 1 snapshot restored without its index");
}

/// (b) A gc that repacks moves chunks that an older snapshot's hints name: the snapshot
/// still restores byte for byte (the hints fail, the index is followed).
#[test]
fn hints_made_stale_by_a_repacking_gc_are_followed_through_the_index() {
    let r = Repo::init(&[]);
    let mut bytes = Rng::new(7).bytes(8 * MIB);
    let img = r.image("d.raw", &bytes);
    let first = r.backup(&img, "d");
    // Half of the disk changes: the first snapshot's packs hold the second's unchanged
    // half and the first's changed half, which dies when the first is forgotten.
    Rng::new(8).fill(&mut bytes[..4 * MIB]);
    let img = r.image("d.raw", &bytes);
    r.backup(&img, "d");
    r.ok(&["repo", "forget", &r.repo, &first]);
    let packs_before = pack_names(&r.repo);
    let gc = r.ok(&["repo", "gc", "--condemn-margin", "0", &r.repo]);
    let packs_after = pack_names(&r.repo);
    assert!(
        packs_before.iter().any(|p| !packs_after.contains(p)),
        "the gc deleted no pack, so no hint went stale: {}",
        gc.describe()
    );
    let _ = fs::remove_dir_all(&r.cache);
    let got = r.restore(&r.snap("d")).unwrap_or_else(|o| panic!("restore after gc: {o:?}"));
    assert!(got == bytes, "the snapshot restored after a repacking gc differs");
    let img = r.image("want.raw", &bytes);
    assert_eq!(r.hash(&r.snap("d")).unwrap(), r.hash(s(&img)).unwrap());
    let check = r.ok(&["repo", "check", &r.repo]);
    assert!(check.stdout.contains("no damage"), "{}", check.describe());
}

/// The pack objects of a repository directory.
fn pack_names(repo: &str) -> Vec<String> {
    let mut v = Vec::new();
    for d in fs::read_dir(Path::new(repo).join("data")).unwrap().flatten() {
        for p in fs::read_dir(d.path()).unwrap().flatten() {
            v.push(p.file_name().to_string_lossy().to_string());
        }
    }
    v.sort();
    v
}

/// Each disk's snapshots in a chain of 3: (name, image of each snapshot, oldest first).
fn chains(r: &Repo) -> Vec<(String, Vec<Vec<u8>>)> {
    let mut out = Vec::new();
    for (i, name) in ["vm1-sda", "vm2-sdb"].iter().enumerate() {
        let mut bytes = Rng::new(i as u64 + 11).bytes(3 * MIB + 4096);
        bytes[MIB..MIB + MIB / 2].fill(0);
        let mut images = Vec::new();
        for round in 0..3u64 {
            if round > 0 {
                let at = (round as usize * 700_000) % (2 * MIB);
                Rng::new(round * 31 + i as u64).fill(&mut bytes[at..at + 300_000]);
            }
            let img = r.image(&format!("{name}.raw"), &bytes);
            r.backup(&img, name);
            images.push(bytes.clone());
        }
        out.push((name.to_string(), images));
    }
    out
}

/// The snapshots of `repo list --json`, each with its parent: (name, time, blkhash, id,
/// parent), oldest first per disk.
fn listed(r: &Repo) -> Vec<(String, String, String, String, String)> {
    let out = r.ok(&["repo", "list", "--json", &r.repo]);
    let v: serde_json::Value = serde_json::from_str(out.stdout.trim()).unwrap();
    let mut snaps: Vec<_> = v
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            let f = |k: &str| s[k].as_str().unwrap_or("").to_string();
            (f("name"), f("time"), f("blkhash"), f("id"), f("parent"))
        })
        .collect();
    snaps.sort();
    snaps
}

/// Every listed snapshot restores to its image (by name and time, oldest first per
/// disk), and each one's parent is the one listed before it.
fn assert_chains_restore(r: &Repo, disks: &[(String, Vec<Vec<u8>>)]) {
    let snaps = listed(r);
    for (name, images) in disks {
        let mine: Vec<_> = snaps.iter().filter(|s| s.0 == *name).collect();
        assert_eq!(mine.len(), images.len(), "{name}: {snaps:?}");
        for (k, (s, want)) in mine.iter().zip(images).enumerate() {
            let got = r.restore(&format!("{}@{}", r.snap(name), s.3)).unwrap_or_else(|o| panic!("{name} {k}: {o:?}"));
            assert!(got == *want, "{name} snapshot {k} restores other bytes");
            let parent = if k == 0 { "" } else { mine[k - 1].3.as_str() };
            assert_eq!(s.4, parent, "{name} snapshot {k}'s parent");
        }
    }
}

/// (c) Migrating a version 1 repository (two disks, chains of 3) and an encrypted version
/// 2 one: the same names, times and blkhashes; every snapshot restores byte for byte, and
/// without an index once migrated; backups go on from the migrated snapshots; check is
/// clean.
#[test]
fn migrate_upgrades_version_1_and_encrypted_version_2_repositories() {
    for args in [&["--format-version", "1"][..], &["--format-version", "2", "--encrypt"][..]] {
        let r = Repo::init(args);
        let disks = chains(&r);
        let before = listed(&r);
        let dry = r.ok(&["repo", "migrate", "--dry-run", &r.repo]);
        assert!(dry.stdout.contains("6 snapshot(s) would be migrated"), "{}", dry.describe());
        assert_eq!(listed(&r), before, "a dry run changed the repository");
        let out = r.ok(&["repo", "migrate", &r.repo]);
        assert!(out.stdout.contains("6 snapshot(s) migrated"), "{}", out.describe());
        let config = fs::read_to_string(Path::new(&r.repo).join("config")).unwrap();
        assert!(config.contains("\"version\": 3"), "{config}");
        let after = listed(&r);
        let key = |v: &[(String, String, String, String, String)]| {
            v.iter().map(|s| (s.0.clone(), s.1.clone(), s.2.clone())).collect::<Vec<_>>()
        };
        assert_eq!(key(&after), key(&before), "{args:?}: names, times or blkhashes changed");
        assert!(after.iter().all(|a| before.iter().all(|b| a.3 != b.3)), "a snapshot kept its old id");
        assert_chains_restore(&r, &disks);
        {
            let _away = r.without_index();
            for (name, images) in &disks {
                let got = r.restore(&r.snap(name)).unwrap_or_else(|o| panic!("{name} without an index: {o:?}"));
                assert!(got == *images[2], "{name} restored without an index differs");
            }
        }
        let again = r.ok(&["repo", "migrate", &r.repo]);
        assert!(again.stdout.contains("0 snapshot(s) migrated"), "{}", again.describe());
        // Backups go on, incremental from the migrated snapshots.
        let mut more = disks.clone();
        for (name, images) in more.iter_mut() {
            let mut bytes = images[2].clone();
            bytes[..1000].fill(7);
            let img = r.image("next.raw", &bytes);
            r.backup(&img, name);
            images.push(bytes);
        }
        assert_chains_restore(&r, &more);
        let check = r.ok(&["repo", "check", &r.repo]);
        assert!(check.stdout.contains("no damage"), "{}", check.describe());
    }
}

/// An encrypted version 1 repository is refused, and stays as it was.
#[test]
fn migrate_refuses_an_encrypted_version_1_repository() {
    let r = Repo::init(&["--format-version", "1", "--encrypt"]);
    let img = r.image("d.raw", &Rng::new(3).bytes(MIB));
    r.backup(&img, "d");
    let out = run_fails(&mut r.cmd(&["repo", "migrate", &r.repo]));
    let err = &out.stderr;
    assert!(err.contains("stays readable and writable as version 1"), "{err}");
    let config = fs::read_to_string(Path::new(&r.repo).join("config")).unwrap();
    assert!(config.contains("\"version\": 1"), "{config}");
    assert!(r.restore(&r.snap("d")).unwrap() == fs::read(&img).unwrap());
}

/// (d) A migrate stopped after each of its writes in turn (as kill -9 would: the process
/// aborts), of a version 1 and of an encrypted version 2 repository, leaves a repository whose every listed snapshot restores, and the next migrate
/// finishes the job.
#[test]
fn a_migrate_killed_after_any_write_is_finished_by_the_next() {
    for args in [&["--format-version", "1"][..], &["--format-version", "2", "--encrypt"][..]] {
        killed_at_each_write(args);
    }
}

fn killed_at_each_write(args: &[&str]) {
    let r = Repo::init(args);
    let disks = chains(&r);
    let before = listed(&r);
    let key = |v: &[(String, String, String, String, String)]| {
        v.iter().map(|s| (s.0.clone(), s.1.clone(), s.2.clone())).collect::<Vec<_>>()
    };
    // Stops after the config, around the first snapshots' writes, then further apart.
    for n in [1, 2, 3, 4, 5, 6, 9, 12, 17, 22, 1000] {
        // A copy of the repository as it was, for each stop point.
        let copy = Repo::init(args);
        fs::remove_dir_all(&copy.repo).unwrap();
        copy_dir(Path::new(&r.repo), Path::new(&copy.repo));
        let o =
            copy.cmd(&["repo", "migrate", &copy.repo]).env("FERRY_TEST_MIGRATE_ABORT", n.to_string()).output().unwrap();
        if o.status.success() {
            assert_eq!(n, 1000, "the migrate made fewer than {n} writes");
            assert_chains_restore(&copy, &disks);
            break;
        }
        assert_eq!(o.status.code(), Some(137), "stop {n}: {o:?}");
        // Stopped after write n (its lock left behind, as a killed process leaves it):
        // what is listed reads whole.
        let mid = listed(&copy);
        for s in &mid {
            let want = &disks.iter().find(|d| d.0 == s.0).unwrap().1;
            let k = before.iter().filter(|b| b.0 == s.0).position(|b| b.1 == s.1).unwrap();
            let got =
                copy.restore(&format!("{}@{}", copy.snap(&s.0), s.3)).unwrap_or_else(|o| panic!("stop {n}: {o:?}"));
            assert!(got == want[k], "stop {n}: {} snapshot {k} restores other bytes", s.0);
        }
        assert_eq!(key(&mid), key(&before), "stop {n}: the listing changed");
        copy.ok(&["repo", "migrate", &copy.repo]);
        assert_eq!(key(&listed(&copy)), key(&before), "stop {n}: after the second migrate");
        assert_chains_restore(&copy, &disks);
        let check = copy.ok(&["repo", "check", &copy.repo]);
        assert!(check.stdout.contains("no damage"), "stop {n}: {}", check.describe());
    }
}

/// A change map started at a snapshot that migrate gave a new id continues it: `--since`
/// with the old id (whole, or a prefix) is the migrated latest.
#[test]
fn since_an_id_from_before_migrate_names_the_migrated_snapshot() {
    let r = Repo::init(&["--format-version", "1"]);
    let disks: Vec<(&str, Vec<u8>, String)> = ["d", "e"]
        .iter()
        .enumerate()
        .map(|(i, name)| {
            let bytes = Rng::new(9 + i as u64).bytes(4 * MIB);
            let img = r.image(&format!("{name}.raw"), &bytes);
            (*name, bytes, r.backup(&img, name))
        })
        .collect();
    r.ok(&["repo", "migrate", &r.repo]);
    let map = r.dir.join("map.json");
    fs::write(&map, r#"[{"offset": 0, "length": 65536, "type": 1}]"#).unwrap();
    for (name, mut bytes, old) in disks {
        bytes[..1000].fill(7);
        let img = r.image(&format!("{name}.raw"), &bytes);
        let since = if name == "d" { old.clone() } else { old[..8].to_string() };
        let out = r.ok(&["backup", "--extents-from", s(&map), "--since", &since, s(&img), &r.snap(name)]);
        assert!(out.stderr.contains("was migrated"), "{}", out.describe());
        assert!(r.restore(&r.snap(name)).unwrap() == bytes);
    }
}

fn copy_dir(from: &Path, to: &Path) {
    fs::create_dir_all(to).unwrap();
    for e in fs::read_dir(from).unwrap().flatten() {
        let dest = to.join(e.file_name());
        if e.path().is_dir() {
            copy_dir(&e.path(), &dest);
        } else {
            fs::copy(e.path(), dest).unwrap();
        }
    }
}
