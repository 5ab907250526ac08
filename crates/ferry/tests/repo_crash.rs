//! Crash safety of a backup repository (FORMAT.md §9), end to end through the CLI:
//!
//! * `kill -9` at moments drawn from seeded RNGs during `ferry backup` (full and
//!   incremental), `ferry repo forget` and `ferry repo gc`; after each kill `ferry repo
//!   check` passes, every snapshot `ferry repo list` shows restores to exactly the disk
//!   it was taken from, the next run completes, and a gc afterwards leaves nothing
//!   behind (no orphan packs, no temporary files) and the repository no larger.
//! * A full disk (a small tmpfs, so these tests need root): the backup fails saying so,
//!   the repository stays whole, and with room again the next backup works.
//! * Two backups of different disks and a gc at once: gc runs beside them (FORMAT.md §8a)
//!   and frees nothing a backup wrote; a later gc spares what they then committed.

use crate::common::json::{Json, JsonExt};
use crate::common::*;
use std::collections::{BTreeSet, HashMap};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub(crate) fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// `ferry ARGS` without any passphrase or log settings from the test's environment.
pub(crate) fn ferry_cmd(args: &[&str]) -> Command {
    let mut c = Command::new(ferry_bin());
    c.args(args).env_remove("FERRY_PASSWORD").env_remove("FERRY_PASSWORD_FILE").env_remove("RUST_LOG");
    c
}

/// `ferry ARGS`; a gc removes temporary files of any age (those killed writers left: no
/// writer runs beside the gcs run this way, but one).
fn ferry(args: &[&str]) -> Output {
    let mut c = ferry_cmd(args);
    if args.starts_with(&["repo", "gc"]) {
        c.env("FERRY_GC_TEMP_AGE", "0").env("FERRY_TEST_UNSAFE_GC_TEMP_AGE", "1");
    }
    run_ok(&mut c)
}

/// The first field of `ferry hash SRC`.
fn hash_of(src: &str) -> String {
    let out = ferry(&["hash", src]);
    out.stdout.split_whitespace().next().unwrap_or_else(|| panic!("no digest: {}", out.describe())).to_string()
}

fn spawn(args: &[&str]) -> Child {
    ferry_cmd(args).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap()
}

/// Kills `c` with SIGKILL after `after` unless it ended before; whether it was killed,
/// and its output.
fn kill_after(mut c: Child, after: Duration) -> (bool, std::process::Output) {
    let deadline = Instant::now() + after;
    loop {
        if c.try_wait().unwrap().is_some() {
            return (false, c.wait_with_output().unwrap());
        }
        if Instant::now() >= deadline {
            c.kill().unwrap(); // SIGKILL
            return (true, c.wait_with_output().unwrap());
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Every file under `dir` (relative paths), sorted.
fn files(dir: &Path) -> BTreeSet<PathBuf> {
    fn walk(root: &Path, d: &Path, out: &mut BTreeSet<PathBuf>) {
        for e in fs::read_dir(d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                walk(root, &p, out);
            } else {
                out.insert(p.strip_prefix(root).unwrap().to_path_buf());
            }
        }
    }
    let mut v = BTreeSet::new();
    walk(dir, dir, &mut v);
    v
}

fn du(dir: &Path) -> u64 {
    files(dir).iter().map(|p| fs::metadata(dir.join(p)).map(|m| m.len()).unwrap_or(0)).sum()
}

/// `ferry repo check REPO` exits 0 and says so.
fn check_ok(repo: &str, after: &str) -> Output {
    let out = run(&mut ferry_cmd(&["repo", "check", repo]));
    assert!(out.status.success() && out.stdout.contains("no damage"), "check fails after {after}\n{}", out.describe());
    out
}

/// (id, name) of every snapshot `ferry repo list --json` shows.
pub(crate) fn listed(mk: Mk, repo: &str) -> Vec<(String, String)> {
    let out = run_ok(&mut mk(&["repo", "list", "--json", repo]));
    Json::must_parse(&out.stdout)
        .as_array()
        .unwrap()
        .iter()
        .map(|v| (v.at("id").as_str().unwrap().to_string(), v.at("name").as_str().unwrap().to_string()))
        .collect()
}

/// How a test makes a `ferry` command (with the environment its repository needs).
pub(crate) type Mk = fn(&[&str]) -> Command;

/// What each snapshot must hold: its disk's `ferry hash` when it was taken.
pub(crate) struct Expect {
    pub(crate) known: HashMap<String, String>,
    pub(crate) mk: Mk,
}

impl Default for Expect {
    fn default() -> Self {
        Expect { known: HashMap::new(), mk: ferry_cmd }
    }
}

impl Expect {
    fn hash(&self, src: &str) -> String {
        let out = run_ok(&mut (self.mk)(&["hash", src]));
        out.stdout.split_whitespace().next().unwrap_or_else(|| panic!("no digest: {}", out.describe())).to_string()
    }

    /// Every listed snapshot is either known or the one `pending` (name, hash) backup
    /// that may have completed before the kill; each restores to its hash, through the
    /// index (`ferry hash REPO::NAME@ID`) and through its data (`ferry copy`).
    pub(crate) fn assert_restore(&mut self, repo: &str, pending: Option<(&str, &str)>, tmp: &Path, after: &str) {
        let list = listed(self.mk, repo);
        let mut pending = pending;
        for (id, name) in &list {
            let want = match self.known.get(id) {
                Some(h) => h.clone(),
                None => match pending.take() {
                    Some((n, h)) if n == name => {
                        self.known.insert(id.clone(), h.to_string());
                        h.to_string()
                    }
                    _ => panic!("after {after}: snapshot {id} of {name} was never taken (list: {list:?})"),
                },
            };
            let sp = format!("{repo}::{name}@{id}");
            assert_eq!(self.hash(&sp), want, "after {after}: ferry hash {sp} (from its index)");
            let out = tmp.join("restored.raw");
            let _ = fs::remove_file(&out);
            run_ok(&mut (self.mk)(&["copy", &sp, s(&out)]));
            assert_eq!(self.hash(s(&out)), want, "after {after}: {sp} restored");
        }
        // Snapshots that were listed before and not forgotten are still there.
        for id in self.known.keys() {
            assert!(list.iter().any(|(i, _)| i == id), "after {after}: snapshot {id} is gone: {list:?}");
        }
    }

    /// Forgets the snapshots that are no longer listed.
    pub(crate) fn forget(&mut self, repo: &str) {
        let list = listed(self.mk, repo);
        self.known.retain(|id, _| list.iter().any(|(i, _)| i == id));
    }
}

/// After a final gc: check passes without orphans, the repository holds config, locks/
/// (empty), data/, index/ and snapshots/ objects only: nothing temporary is left.
fn assert_clean(repo: &Path, after: &str) {
    let out = check_ok(s(repo), after);
    assert!(
        !format!("{}{}", out.stdout, out.stderr).contains("in no index object"),
        "after {after}, gc left orphans\n{}",
        out.describe()
    );
    let all = files(repo);
    let left: Vec<&PathBuf> = all
        .iter()
        .filter(|p| {
            let temp = p.file_name().unwrap().to_string_lossy().starts_with(".tmp-");
            // A lock being written when its writer was killed is left as a temporary
            // file of a few hundred bytes: gc leaves locks/ alone (others write there).
            if p.starts_with("locks") {
                !temp
            } else {
                temp || p.file_name().unwrap().to_string_lossy().starts_with('.')
            }
        })
        .collect();
    assert!(left.is_empty(), "after {after}, gc left these in {}: {left:?}", repo.display());
}

/// A disk of `len` random bytes (incompressible: packs fill at their size), with zero
/// MiBs here and there.
fn disk(d: &Path, name: &str, len: usize, seed: u64) -> (PathBuf, Vec<u8>) {
    let mut data = Rng::new(seed).bytes(len);
    for (i, m) in data.chunks_mut(MIB as usize).enumerate() {
        if i % 7 == 3 {
            m.fill(0);
        }
    }
    (write_sparse_file(d, name, &data), data)
}

/// Changes a quarter of `data` (from `seed`), writes it to `path`, and returns an
/// `--extents-from` map of the change.
fn change(path: &Path, data: &mut [u8], seed: u64, d: &Path) -> PathBuf {
    let len = data.len();
    let at = (seed as usize % 4) * len / 4;
    Rng::new(seed + 100).fill(&mut data[at..at + len / 4]);
    fs::write(path, &*data).unwrap();
    let map = d.join(format!("changes{seed}.json"));
    fs::write(&map, format!(r#"[{{"offset": {at}, "length": {}, "type": 1}}]"#, len / 4)).unwrap();
    map
}

const SEEDS: [u64; 3] = [11, 22, 33];
/// 40 MiB: a 32 MiB pack is written in the middle of a full backup.
const DISK: usize = 40 << 20;

/// (a) kill -9 during full and incremental backups.
#[test]
fn kill_during_backup() {
    for seed in SEEDS {
        let dir = tempfile::Builder::new().prefix("ferry-crash-b").tempdir().unwrap();
        let d = dir.path();
        let repo_p = d.join("repo");
        let repo = s(&repo_p).to_string();
        ferry(&["repo", "init", &repo]);
        let t = format!("{repo}::disk");
        let (img, mut data) = disk(d, "disk.raw", DISK, seed);
        let mut rng = Rng::new(seed);
        let mut exp = Expect::default();
        // Full: 40 MiB at 16 MiB/s, about 2.5 s; killed within 3 s.
        let h0 = hash_of(s(&img));
        let at = Duration::from_millis(100 + rng.below(2900));
        let (killed, o) = kill_after(spawn(&["backup", "--rate", "16M", s(&img), &t]), at);
        let what = format!("seed {seed}: a full backup killed at {at:?} (killed: {killed})");
        assert!(killed || o.status.success(), "{what}: {}", String::from_utf8_lossy(&o.stderr));
        check_ok(&repo, &what);
        exp.assert_restore(&repo, Some(("disk", &h0)), d, &what);
        // The next backup completes (the killed one's lock is stale: its process is gone).
        ferry(&["backup", s(&img), &t]);
        exp.assert_restore(&repo, Some(("disk", &h0)), d, &format!("{what}, then a backup"));
        // Incremental, from an --extents-from map: 10 MiB read at 8 MiB/s (one round per
        // seed: each round costs a few seconds of restores).
        for round in 0..1u64 {
            let map = change(&img, &mut data, seed * 10 + round, d);
            let h = hash_of(s(&img));
            let at = Duration::from_millis(50 + rng.below(1400));
            let base = crate::repo_base::latest_id(&repo, "disk");
            let (killed, o) = kill_after(
                spawn(&["backup", "--rate", "8M", "--extents-from", s(&map), "--since", &base, s(&img), &t]),
                at,
            );
            let what = format!("seed {seed}: incremental {round} killed at {at:?} (killed: {killed})");
            assert!(killed || o.status.success(), "{what}: {}", String::from_utf8_lossy(&o.stderr));
            check_ok(&repo, &what);
            exp.assert_restore(&repo, Some(("disk", &h)), d, &what);
            // The change again, as the next backup would read it: completes (onto the
            // killed one's snapshot where it was committed: it holds the change already).
            let base = crate::repo_base::latest_id(&repo, "disk");
            ferry(&["backup", "--extents-from", s(&map), "--since", &base, s(&img), &t]);
            exp.assert_restore(&repo, Some(("disk", &h)), d, &format!("{what}, then a backup"));
        }
        let before = du(&repo_p);
        ferry(&["repo", "gc", &repo]);
        let after = du(&repo_p);
        assert!(after <= before, "seed {seed}: gc grew the repository: {before} -> {after}");
        assert_clean(&repo_p, &format!("seed {seed}: gc after killed backups"));
        exp.assert_restore(&repo, None, d, &format!("seed {seed}: gc after killed backups"));
    }
}

/// A repository of `n` snapshots of one 4 MiB disk, each changing a quarter.
fn many_snapshots(d: &Path, repo: &str, n: u64, exp: &mut Expect) {
    ferry(&["repo", "init", repo]);
    let (img, mut data) = disk(d, "small.raw", 4 << 20, 5);
    let t = format!("{repo}::small");
    for i in 0..n {
        if i > 0 {
            change(&img, &mut data, 1000 + i, d);
        }
        let snap = Json::must_parse(&ferry(&["backup", "--json", s(&img), &t]).stdout);
        exp.known.insert(snap.at("id").as_str().unwrap().to_string(), hash_of(s(&img)));
    }
}

/// (b) kill -9 during forget: the snapshots left restore; forget again completes.
#[test]
fn kill_during_forget() {
    let dir = tempfile::Builder::new().prefix("ferry-crash-f").tempdir().unwrap();
    let d = dir.path();
    let base = d.join("base");
    let mut exp0 = Expect::default();
    many_snapshots(d, s(&base), 12, &mut exp0);
    // How long a whole forget takes here, on a copy.
    let probe = d.join("probe");
    run_ok(&mut cmd("cp", ["-a", s(&base), s(&probe)]));
    let t0 = Instant::now();
    ferry(&["repo", "forget", "--keep-last", "1", s(&probe)]);
    let took = t0.elapsed().as_millis() as u64;
    for seed in SEEDS {
        let repo_p = d.join(format!("r{seed}"));
        let repo = s(&repo_p).to_string();
        run_ok(&mut cmd("cp", ["-a", s(&base), &repo]));
        let mut exp = Expect { known: exp0.known.clone(), mk: ferry_cmd };
        let mut rng = Rng::new(seed);
        let at = Duration::from_millis(rng.below(took + 5));
        let (killed, o) = kill_after(spawn(&["repo", "forget", "--keep-last", "1", &repo]), at);
        let what = format!("seed {seed}: forget killed at {at:?} of {took} ms (killed: {killed})");
        assert!(killed || o.status.success(), "{what}: {}", String::from_utf8_lossy(&o.stderr));
        check_ok(&repo, &what);
        exp.forget(&repo);
        exp.assert_restore(&repo, None, d, &what);
        ferry(&["repo", "forget", "--keep-last", "1", &repo]);
        assert_eq!(listed(ferry_cmd, &repo).len(), 1, "{what}, then forget");
        exp.forget(&repo);
        let before = du(&repo_p);
        ferry(&["repo", "gc", &repo]);
        assert!(du(&repo_p) < before, "{what}: gc freed nothing after forget");
        assert_clean(&repo_p, &what);
        exp.assert_restore(&repo, None, d, &format!("{what}, then gc"));
    }
}

/// (c) kill -9 during gc, with packs to repack: every snapshot left restores, a gc
/// afterwards completes and leaves nothing behind.
#[test]
fn kill_during_gc() {
    let dir = tempfile::Builder::new().prefix("ferry-crash-g").tempdir().unwrap();
    let d = dir.path();
    let base_p = d.join("base");
    let base = s(&base_p).to_string();
    ferry(&["repo", "init", &base]);
    let mut exp0 = Expect::default();
    // Two disks; three snapshots of the big one, each changing a quarter, the first two
    // forgotten: their packs are partly live (repacked) and partly dead.
    let (img, mut data) = disk(d, "disk.raw", DISK, 77);
    let (small, _) = disk(d, "small.raw", 4 << 20, 78);
    let sid = Json::must_parse(&ferry(&["backup", "--json", s(&small), &format!("{base}::small")]).stdout);
    exp0.known.insert(sid.at("id").as_str().unwrap().to_string(), hash_of(s(&small)));
    for i in 0..3u64 {
        if i > 0 {
            change(&img, &mut data, 700 + i, d);
        }
        let snap = Json::must_parse(&ferry(&["backup", "--json", s(&img), &format!("{base}::disk")]).stdout);
        exp0.known.insert(snap.at("id").as_str().unwrap().to_string(), hash_of(s(&img)));
    }
    ferry(&["repo", "forget", "--keep-last", "1", &format!("{base}::disk")]);
    exp0.forget(&base);
    assert_eq!(exp0.known.len(), 2);
    let probe = d.join("probe");
    run_ok(&mut cmd("cp", ["-a", &base, s(&probe)]));
    let t0 = Instant::now();
    let out = ferry(&["repo", "gc", s(&probe)]);
    let took = t0.elapsed().as_millis() as u64;
    assert!(!out.stdout.contains(" 0 repacked"), "nothing to repack: {}", out.describe());
    let full_gc = du(&probe);
    for seed in SEEDS.iter().chain(&[44, 55]) {
        let repo_p = d.join(format!("r{seed}"));
        let repo = s(&repo_p).to_string();
        run_ok(&mut cmd("cp", ["-a", &base, &repo]));
        let before = du(&repo_p);
        let mut exp = Expect { known: exp0.known.clone(), mk: ferry_cmd };
        let mut rng = Rng::new(*seed);
        let at = Duration::from_millis(rng.below(took + 5));
        let (killed, o) = kill_after(spawn(&["repo", "gc", &repo]), at);
        let what = format!("seed {seed}: gc killed at {at:?} of {took} ms (killed: {killed})");
        assert!(killed || o.status.success(), "{what}: {}", String::from_utf8_lossy(&o.stderr));
        check_ok(&repo, &what);
        exp.assert_restore(&repo, None, d, &what);
        ferry(&["repo", "gc", &repo]);
        let after = du(&repo_p);
        assert!(after < before, "{what}, then gc: {before} -> {after}");
        assert!(after <= full_gc + full_gc / 20, "{what}, then gc: {after} bytes, a gc alone leaves {full_gc}");
        assert_clean(&repo_p, &format!("{what}, then gc"));
        exp.assert_restore(&repo, None, d, &format!("{what}, then gc"));
    }
}

/// A tmpfs mounted on a new directory, unmounted when dropped.
struct Tmpfs(PathBuf);

impl Tmpfs {
    fn mount(at: &Path, size: &str) -> Tmpfs {
        fs::create_dir_all(at).unwrap();
        let out =
            run(Command::new("mount").args(["-t", "tmpfs", "-o", &format!("size={size},mode=0700"), "tmpfs"]).arg(at));
        assert!(
            out.status.success(),
            "cannot mount a tmpfs (this test needs root: it fills a small file system)\n{}",
            out.describe()
        );
        Tmpfs(at.to_path_buf())
    }

    fn resize(&self, size: &str) {
        run_ok(Command::new("mount").args(["-o", &format!("remount,size={size}")]).arg(&self.0));
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).output();
    }
}

/// A full disk under the repository: the backup fails saying so, the repository stays
/// whole and unlocked, and with room again (or after a gc) the next backup works.
#[test]
fn full_disk() {
    let dir = tempfile::Builder::new().prefix("ferry-crash-full").tempdir().unwrap();
    let d = dir.path();
    let mnt = Tmpfs::mount(&d.join("mnt"), "8m");
    let repo_p = mnt.0.join("repo");
    let repo = s(&repo_p).to_string();
    ferry(&["repo", "init", &repo]);
    let mut exp = Expect::default();
    let (small, _) = disk(d, "small.raw", 2 << 20, 1);
    let snap = Json::must_parse(&ferry(&["backup", "--json", s(&small), &format!("{repo}::small")]).stdout);
    exp.known.insert(snap.at("id").as_str().unwrap().to_string(), hash_of(s(&small)));
    // 16 MiB of incompressible data into what is left of 8 MiB.
    let (big, _) = disk(d, "big.raw", 16 << 20, 2);
    let t = format!("{repo}::big");
    let out = run_fails(&mut ferry_cmd(&["backup", s(&big), &t]));
    assert!(
        out.stderr.contains("No space left on device"),
        "the error does not say the disk is full\n{}",
        out.describe()
    );
    assert!(!out.stderr.contains("panicked"), "{}", out.describe());
    check_ok(&repo, "a backup that hit a full disk");
    exp.assert_restore(&repo, None, d, "a backup that hit a full disk");
    assert!(files(&repo_p).iter().all(|p| !p.starts_with("locks")), "a lock was left: {:?}", files(&repo_p));
    // A smaller backup fits after gc frees what the failed one left.
    ferry(&["repo", "gc", &repo]);
    assert_clean(&repo_p, "gc after a full disk");
    let (mid, _) = disk(d, "mid.raw", 3 << 20, 3);
    let snap = Json::must_parse(&ferry(&["backup", "--json", s(&mid), &format!("{repo}::mid")]).stdout);
    exp.known.insert(snap.at("id").as_str().unwrap().to_string(), hash_of(s(&mid)));
    // With room, the big one.
    mnt.resize("64m");
    let snap = Json::must_parse(&ferry(&["backup", "--json", s(&big), &t]).stdout);
    exp.known.insert(snap.at("id").as_str().unwrap().to_string(), hash_of(s(&big)));
    check_ok(&repo, "a backup after the disk had room again");
    exp.assert_restore(&repo, None, d, "a backup after the disk had room again");
    // The disk full again during an incremental backup and during gc's repacking.
    mnt.resize("24m");
    let mut data = fs::read(&big).unwrap();
    let map = change(&big, &mut data, 9, d);
    let h = hash_of(s(&big));
    let base = crate::repo_base::latest_id(&repo, "big");
    let out = run(&mut ferry_cmd(&["backup", "--extents-from", s(&map), "--since", &base, s(&big), &t]));
    let what = format!("an incremental backup with {} bytes free", (24 * MIB).saturating_sub(du(&repo_p)));
    if out.status.success() {
        exp.assert_restore(&repo, Some(("big", &h)), d, &what);
    } else {
        assert!(out.stderr.contains("No space left on device"), "{what}\n{}", out.describe());
    }
    check_ok(&repo, &what);
    exp.assert_restore(&repo, None, d, &what);
    // gc with no room to repack: the first big snapshot forgotten, its pack partly dead.
    ferry(&["repo", "forget", "--keep-last", "1", &t]);
    exp.forget(&repo);
    let used = du(&repo_p).div_ceil(MIB) + 2;
    mnt.resize(&format!("{used}m"));
    let out = run(&mut ferry_cmd(&["repo", "gc", &repo]));
    let what = format!("gc with {used} MiB for the repository");
    if !out.status.success() {
        assert!(out.stderr.contains("No space left on device"), "{what}\n{}", out.describe());
    }
    check_ok(&repo, &what);
    exp.assert_restore(&repo, None, d, &what);
    mnt.resize("64m");
    ferry(&["repo", "gc", &repo]);
    assert_clean(&repo_p, "gc after the disk had room again");
    exp.assert_restore(&repo, None, d, "gc after the disk had room again");
}

/// Two backups of different disks and a gc at once: gc runs beside them and removes
/// nothing (not the packs they wrote and have not indexed yet); both snapshots restore
/// exactly.
#[test]
fn gc_during_two_backups() {
    let dir = tempfile::Builder::new().prefix("ferry-crash-c").tempdir().unwrap();
    let d = dir.path();
    let repo_p = d.join("repo");
    let repo = s(&repo_p).to_string();
    ferry(&["repo", "init", &repo]);
    let mut exp = Expect::default();
    // 41 MiB of data each, about 3.5 s at 12 MiB/s: each writes a 32 MiB pack after about
    // 2.7 s, then its last pack, its index and its manifest about a second later.
    let (a, _) = disk(d, "a.raw", 48 << 20, 1);
    let (b, _) = disk(d, "b.raw", 48 << 20, 2);
    let (ta, tb) = (format!("{repo}::a"), format!("{repo}::b"));
    let ca = spawn(&["backup", "--json", "--rate", "12M", s(&a), &ta]);
    let cb = spawn(&["backup", "--json", "--rate", "12M", s(&b), &tb]);
    // The objects (not the temporary files a write renames into place).
    let objects = || -> BTreeSet<PathBuf> {
        files(&repo_p).into_iter().filter(|p| !p.file_name().unwrap().to_string_lossy().starts_with('.')).collect()
    };
    let packs = || objects().iter().filter(|p| p.starts_with("data")).count();
    assert!(wait_until(Duration::from_secs(20), || packs() >= 2), "the backups wrote no packs");
    let before = objects();
    assert!(!before.iter().any(|p| p.starts_with("index")), "the backups ended too soon: {before:?}");
    // gc runs beside them: their packs (in no index object yet) it leaves alone (a gc
    // that started beside backups condemns no orphan).
    let out = run_ok(&mut ferry_cmd(&["repo", "gc", &repo]));
    assert!(!out.stdout.contains("condemned beside running backups"), "gc condemned orphans\n{}", out.describe());
    let now = objects();
    let gone: Vec<_> = before.iter().filter(|p| !now.contains(*p) && !p.starts_with("locks")).collect();
    assert!(gone.is_empty(), "gc removed {gone:?} while backups ran");
    for (c, img, name) in [(ca, &a, "a"), (cb, &b, "b")] {
        let o = c.wait_with_output().unwrap();
        assert!(o.status.success(), "backup of {name}: {}\n{}", String::from_utf8_lossy(&o.stderr), out.describe());
        let snap = Json::must_parse(String::from_utf8_lossy(&o.stdout).trim());
        exp.known.insert(snap.at("id").as_str().unwrap().to_string(), hash_of(s(img)));
    }
    // Both done: the next gc (no margin) marks again and finds those packs in use.
    let gc = ferry(&["repo", "gc", "--condemn-margin", "0", &repo]);
    assert!(gc.stdout.contains(" 0 packs deleted"), "{}", gc.describe());
    check_ok(&repo, "gc during two backups");
    exp.assert_restore(&repo, None, d, "gc during two backups");
    assert_eq!(exp.known.len(), 2);
    assert_clean(&repo_p, "gc during two backups");
    assert!(files(&repo_p).iter().all(|p| !p.starts_with("gc/condemned/")), "a condemned record stayed");
}

/// What a writer killed between creating its temporary file and renaming it leaves (a
/// `.tmp-` file beside the objects, as kill_during_gc meets now and then): gc removes
/// it, and nothing else; listings, check and restores never see it.
#[test]
fn gc_removes_partly_written_objects() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let repo_p = d.join("repo");
    let repo = s(&repo_p).to_string();
    ferry(&["repo", "init", &repo]);
    let (img, _) = disk(d, "disk.raw", 4 << 20, 9);
    let mut exp = Expect::default();
    let snap = Json::must_parse(&ferry(&["backup", "--json", s(&img), &format!("{repo}::disk")]).stdout);
    exp.known.insert(snap.at("id").as_str().unwrap().to_string(), hash_of(s(&img)));
    let pack = files(&repo_p).into_iter().find(|p| p.starts_with("data")).unwrap();
    let half = repo_p.join(pack.parent().unwrap()).join(".tmp-00112233aabbccdd");
    fs::write(&half, Rng::new(1).bytes(3 << 20)).unwrap();
    fs::write(repo_p.join("index/.tmp-0011223344556677"), b"half an index").unwrap();
    fs::write(repo_p.join("snapshots/.tmp-8899aabbccddeeff"), b"half a manifest").unwrap();
    check_ok(&repo, "partly written objects");
    exp.assert_restore(&repo, None, d, "partly written objects");
    let before = du(&repo_p);
    let gc = ferry(&["repo", "gc", &repo]);
    let after = du(&repo_p);
    assert!(before - after >= 3 << 20, "gc left partly written objects: {before} -> {after}\n{}", gc.describe());
    assert_clean(&repo_p, "gc of partly written objects");
    exp.assert_restore(&repo, None, d, "gc of partly written objects");
}

/// gc killed after it wrote its new packs and before its index (FORMAT.md §9, between
/// steps 3 and 4), set up exactly rather than by a lucky kill: the packs a whole gc
/// writes are put into a copy of the repository as it was. They are orphans; the next
/// gc writes the same packs again, byte for byte under the same names, and must not
/// then delete them as orphans.
#[test]
fn gc_after_a_gc_killed_before_its_index() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let base = d.join("base");
    ferry(&["repo", "init", s(&base)]);
    let mut exp = Expect::default();
    let (img, mut data) = disk(d, "disk.raw", 8 << 20, 4);
    let t = format!("{}::disk", base.display());
    for i in 0..2u64 {
        if i > 0 {
            change(&img, &mut data, 40 + i, d);
        }
        let snap = Json::must_parse(&ferry(&["backup", "--json", s(&img), &t]).stdout);
        exp.known.insert(snap.at("id").as_str().unwrap().to_string(), hash_of(s(&img)));
    }
    ferry(&["repo", "forget", "--keep-last", "1", &t]);
    exp.forget(s(&base));
    let whole = d.join("whole");
    run_ok(&mut cmd("cp", ["-a", s(&base), s(&whole)]));
    let out = ferry(&["repo", "gc", s(&whole)]);
    assert!(!out.stdout.contains(" 0 repacked"), "nothing repacked: {}", out.describe());
    let old = files(&base);
    let new_packs: Vec<PathBuf> =
        files(&whole).into_iter().filter(|p| p.starts_with("data") && !old.contains(p)).collect();
    assert!(!new_packs.is_empty(), "gc wrote no pack");
    for p in &new_packs {
        fs::create_dir_all(base.join(p).parent().unwrap()).unwrap();
        fs::copy(whole.join(p), base.join(p)).unwrap();
    }
    let repo = s(&base).to_string();
    let what = "a gc killed before its index";
    let out = check_ok(&repo, what);
    assert!(
        format!("{}{}", out.stdout, out.stderr).contains("in no index object"),
        "the new packs are not orphans: {}",
        out.describe()
    );
    exp.assert_restore(&repo, None, d, what);
    ferry(&["repo", "gc", &repo]);
    check_ok(&repo, &format!("{what}, then gc"));
    assert_clean(&base, &format!("{what}, then gc"));
    exp.assert_restore(&repo, None, d, &format!("{what}, then gc"));
}
