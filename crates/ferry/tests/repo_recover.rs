//! Healing and recovery of a backup repository, through the CLI (issue 34, items 2 and 5):
//!
//! * a chunk copy damaged in its pack: `verify` records it, the next full backup stores
//!   it again, readers use the good copy, `gc` drops the damaged copy and its record; a
//!   snapshot that still needs a damaged copy is listed damaged until it is forgotten;
//! * a damaged index object: `check` sends to `ferry repo repair` (not to gc, which would
//!   delete the only copy), gc refuses, repair rebuilds the index from the packs'
//!   trailers (plain and encrypted) and everything restores;
//! * unreadable manifests dropped by repair only with `--drop-damaged`;
//! * `ferry repo forget REPO ID...` and `--wait`; `ferry repo unlock`.

use crate::common::json::{Json, JsonExt};
use crate::common::*;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant, SystemTime};

const PASS: &str = "recover-test-passphrase";

/// How ferry is run for one repository: with its passphrase when it is encrypted.
#[derive(Clone, Copy)]
struct Ferry {
    encrypted: bool,
}

impl Ferry {
    fn cmd(&self, args: &[&str]) -> Command {
        let mut c = Command::new(ferry_bin());
        c.args(args).env_remove("FERRY_PASSWORD").env_remove("FERRY_PASSWORD_FILE").env_remove("RUST_LOG");
        if self.encrypted {
            c.env("FERRY_PASSWORD", PASS);
        }
        c
    }
    fn ok(&self, args: &[&str]) -> Output {
        run_ok(&mut self.cmd(args))
    }
    fn fails(&self, args: &[&str]) -> Output {
        run_fails(&mut self.cmd(args))
    }

    /// A new repository `dir/repo`, format version 2: these tests count packs and index
    /// objects, and a version 3 backup stores its located pages in a pack of their own
    /// (after its data packs: FORMAT.md §7c), which tests/repo_located.rs covers.
    fn init(&self, dir: &Path) -> String {
        let repo = dir.join("repo").to_str().unwrap().to_string();
        if self.encrypted {
            self.ok(&["repo", "init", "--format-version", "2", "--encrypt", "--kdf-memory", "8M", &repo]);
        } else {
            self.ok(&["repo", "init", "--format-version", "2", &repo]);
        }
        repo
    }

    /// `ferry backup --json FILE REPO::NAME`: the new snapshot's id and new chunks.
    fn backup(&self, disk: &Path, repo: &str, name: &str) -> (String, u64) {
        let out = self.ok(&["backup", "--json", disk.to_str().unwrap(), &format!("{repo}::{name}")]);
        let j = Json::must_parse(out.stdout.trim());
        (j.at("id").as_str().unwrap().to_string(), j.at("new_chunks").as_u64().unwrap())
    }

    /// Restores `REPO::NAME@ID` and compares it with `want`, byte for byte.
    fn assert_restores(&self, repo: &str, name: &str, id: &str, want: &Path) {
        let out = want.with_extension("restored");
        let _ = fs::remove_file(&out);
        self.ok(&["copy", &format!("{repo}::{name}@{}", &id[..8]), out.to_str().unwrap()]);
        assert!(fs::read(&out).unwrap() == fs::read(want).unwrap(), "{name}@{id} does not restore to {want:?}");
        fs::remove_file(&out).unwrap();
    }

    /// (id, damaged) of every snapshot `ferry repo list --json` shows.
    fn listed(&self, repo: &str) -> Vec<(String, bool)> {
        let out = self.ok(&["repo", "list", "--json", repo]);
        Json::must_parse(&out.stdout)
            .as_array()
            .unwrap()
            .iter()
            .map(|v| (v.at("id").as_str().unwrap().to_string(), v.at("damaged").as_bool().unwrap()))
            .collect()
    }

    /// `check` and `verify` both find nothing wrong, and say nothing of damage.
    fn assert_clean(&self, repo: &str) {
        for c in ["check", "verify"] {
            let out = self.ok(&["repo", c, repo]);
            assert!(out.stdout.contains("no damage found"), "{}", out.describe());
            assert!(!out.stderr.contains("damage"), "{}", out.describe());
        }
    }
}

const PLAIN: Ferry = Ferry { encrypted: false };

/// A disk image of `mib` MiB of incompressible bytes.
fn disk(dir: &Path, name: &str, mib: usize, seed: u64) -> PathBuf {
    let p = dir.join(name);
    fs::write(&p, Rng::new(seed).bytes(mib << 20)).unwrap();
    p
}

/// The objects under `repo/sub`, sorted (temporary files left out).
fn objects(repo: &str, sub: &str) -> Vec<PathBuf> {
    crate::repo_backup::objects(Path::new(repo), sub)
}

/// Flips one bit of byte `at` of `file`.
fn flip(file: &Path, at: usize) {
    let mut b = fs::read(file).unwrap();
    b[at] ^= 0x40;
    fs::write(file, b).unwrap();
}

fn tmp(prefix: &str) -> tempfile::TempDir {
    tempfile::Builder::new().prefix(prefix).tempdir().unwrap()
}

/// The chunk a flipped byte damaged is stored again by the next full backup ("1 new
/// chunk", not 0), every snapshot then restores (they share the chunk), and gc removes
/// the damaged copy and its record; plain and encrypted.
#[test]
fn damaged_chunk_is_stored_again_and_collected() {
    damaged_chunk_heals(PLAIN);
    damaged_chunk_heals(Ferry { encrypted: true });
}

fn damaged_chunk_heals(f: Ferry) {
    let dir = tmp("ferry-recover-heal");
    let repo = f.init(dir.path());
    let a = disk(dir.path(), "a.raw", 8, 1);
    let (s1, _) = f.backup(&a, &repo, "a");
    let packs = objects(&repo, "data");
    assert_eq!(packs.len(), 1);
    flip(&packs[0], 1000); // inside the first blob
                           // verify finds it and records it in the repository.
    let out = f.fails(&["repo", "verify", &repo]);
    assert!(out.stdout.contains("damaged: data/"), "{}", out.describe());
    assert!(out.stdout.contains(&format!("snapshot {}", &s1[..8])), "{}", out.describe());
    assert!(out.stderr.contains("recorded in damage/"), "{}", out.describe());
    assert_eq!(objects(&repo, "damage").len(), 1);
    // Found again, it is said once, and not recorded twice.
    let out = f.fails(&["repo", "verify", &repo]);
    assert_eq!(out.stdout.matches("damaged: data/").count(), 1, "{}", out.describe());
    assert_eq!(objects(&repo, "damage").len(), 1);
    // check (no data read) knows it now, and list marks the snapshot.
    let out = f.fails(&["repo", "check", &repo]);
    assert!(out.stdout.contains("recorded damaged by `ferry repo verify`"), "{}", out.describe());
    assert_eq!(f.listed(&repo), vec![(s1.clone(), true)]);
    let out = f.ok(&["repo", "list", &repo]);
    assert!(out.stdout.contains("DAMAGED"), "{}", out.describe());

    // A full backup of the unchanged disk stores the damaged chunk again.
    let (s2, new_chunks) = f.backup(&a, &repo, "a");
    assert_eq!(new_chunks, 1, "the damaged chunk is stored again, the rest deduplicated");
    f.assert_restores(&repo, "a", &s2, &a);
    // The old snapshot has the same chunk: it reads the good copy now.
    f.assert_restores(&repo, "a", &s1, &a);
    assert_eq!(f.listed(&repo), vec![(s1.clone(), false), (s2.clone(), false)]);
    let out = f.ok(&["repo", "verify", &repo]);
    assert!(out.stderr.contains("good copy elsewhere"), "{}", out.describe());

    // gc copies the good chunks of the damaged pack out and removes it, and the record.
    f.ok(&["repo", "gc", &repo]);
    assert!(!packs[0].exists(), "the damaged pack is gone");
    assert!(objects(&repo, "damage").is_empty(), "the record is gone");
    f.assert_clean(&repo);
    f.assert_restores(&repo, "a", &s1, &a);
    f.assert_restores(&repo, "a", &s2, &a);
}

/// Two present copies of every chunk (a lost pack came back after a backup stored its
/// chunks again), bit rot in the pack gc meets first, nothing recorded: gc checks the copy
/// it keeps, so it frees the damaged one, never the only good one; both snapshots restore.
#[test]
fn gc_never_frees_the_good_copy_for_a_damaged_one() {
    let f = Ferry { encrypted: true };
    let dir = tmp("ferry-recover-copies");
    let repo = f.init(dir.path());
    let a = disk(dir.path(), "a.raw", 2, 5);
    let (s1, _) = f.backup(&a, &repo, "a");
    let packs = objects(&repo, "data");
    assert_eq!(packs.len(), 1);
    let saved = dir.path().join("saved");
    fs::rename(&packs[0], &saved).unwrap();
    let (s2, _) = f.backup(&a, &repo, "a");
    fs::rename(&saved, &packs[0]).unwrap();
    let both = objects(&repo, "data");
    assert_eq!(both.len(), 2, "{both:?}");
    flip(&both[0], 100); // inside the first blob of the lower-named pack
    f.ok(&["repo", "gc", &repo]);
    f.assert_restores(&repo, "a", &s1, &a);
    f.assert_restores(&repo, "a", &s2, &a);
    f.assert_clean(&repo);
}

/// A damaged pack trailer (its blobs read well): verify records the pack, and gc writes
/// it again from its blobs, each checked; then nothing is damaged and the record is gone.
#[test]
fn damaged_trailer_is_rewritten_by_gc() {
    let dir = tmp("ferry-recover-trailer");
    let f = PLAIN;
    let repo = f.init(dir.path());
    let a = disk(dir.path(), "a.raw", 2, 11);
    let (s1, _) = f.backup(&a, &repo, "a");
    let pack = objects(&repo, "data").remove(0);
    let len = fs::metadata(&pack).unwrap().len() as usize;
    flip(&pack, len - 13); // the trailer's last byte
    let out = f.fails(&["repo", "verify", &repo]);
    assert!(out.stdout.contains("its trailer is damaged"), "{}", out.describe());
    assert_eq!(objects(&repo, "damage").len(), 1);
    // No chunk is damaged: no snapshot is, and check only notes it.
    assert_eq!(f.listed(&repo), vec![(s1.clone(), false)]);
    let out = f.ok(&["repo", "check", &repo]);
    assert!(out.stderr.contains("its chunks read well"), "{}", out.describe());
    let out = f.ok(&["repo", "gc", &repo]);
    assert!(out.stdout.contains("1 repacked"), "{}", out.describe());
    assert!(objects(&repo, "damage").is_empty());
    f.assert_clean(&repo);
    f.assert_restores(&repo, "a", &s1, &a);
}

/// A snapshot whose damaged chunk is no longer on the disk stays listed damaged (gc
/// keeps the only copy) until it is forgotten; then gc removes the damaged pack.
#[test]
fn damaged_snapshot_is_listed_until_forgotten() {
    let dir = tmp("ferry-recover-listed");
    let f = PLAIN;
    let repo = f.init(dir.path());
    let a = disk(dir.path(), "a.raw", 4, 2);
    let (s1, _) = f.backup(&a, &repo, "a");
    let packs = objects(&repo, "data");
    flip(&packs[0], 1000);
    f.fails(&["repo", "verify", &repo]);
    // The disk changed everywhere: nothing of the old snapshot is read again.
    let a2 = disk(dir.path(), "a2.raw", 4, 3);
    let (s2, new_chunks) = f.backup(&a2, &repo, "a");
    assert_eq!(new_chunks, 64);
    assert_eq!(f.listed(&repo), vec![(s1.clone(), true), (s2.clone(), false)]);
    let out = f.fails(&["repo", "check", &repo]);
    assert!(out.stdout.contains(&format!("snapshot {} of a", &s1[..8])), "{}", out.describe());
    assert!(!out.stdout.contains(&format!("snapshot {}", &s2[..8])), "{}", out.describe());
    // gc keeps the only copy while a snapshot uses it.
    f.ok(&["repo", "gc", &repo]);
    assert!(packs[0].exists());
    assert_eq!(objects(&repo, "damage").len(), 1);
    assert_eq!(f.listed(&repo), vec![(s1.clone(), true), (s2.clone(), false)]);
    // Forgotten, the damaged snapshot's data goes, and the record with it.
    let out = f.ok(&["repo", "forget", &repo, &s1[..8]]);
    assert!(out.stdout.contains("removed"), "{}", out.describe());
    f.ok(&["repo", "gc", &repo]);
    assert!(!packs[0].exists());
    assert!(objects(&repo, "damage").is_empty());
    f.assert_clean(&repo);
    f.assert_restores(&repo, "a", &s2, &a2);
}

/// The review's r8: an index object cut short. check says that `ferry repo repair`
/// rebuilds it (not that gc removes the packs), gc refuses, repair indexes the packs again
/// from their trailers, and every snapshot restores; plain and encrypted.
#[test]
fn repair_rebuilds_a_damaged_index() {
    for f in [PLAIN, Ferry { encrypted: true }] {
        let dir = tmp("ferry-recover-repair");
        let repo = f.init(dir.path());
        let a = disk(dir.path(), "a.raw", 4, 4);
        let b = disk(dir.path(), "b.raw", 4, 5);
        let (sa, _) = f.backup(&a, &repo, "a");
        let (sb, _) = f.backup(&b, &repo, "b");
        let index = objects(&repo, "index");
        assert_eq!(index.len(), 2);
        fs::File::options().write(true).open(&index[0]).unwrap().set_len(100).unwrap();
        let out = f.fails(&["repo", "check", &repo]);
        let all = format!("{}{}", out.stdout, out.stderr);
        assert!(all.contains("ferry repo repair"), "{}", out.describe());
        assert!(!all.contains("`ferry repo gc` removes them"), "{}", out.describe());
        let out = f.fails(&["repo", "gc", &repo]);
        assert!(out.stderr.contains("ferry repo repair"), "{}", out.describe());
        assert_eq!(objects(&repo, "data").len(), 2, "gc deleted nothing");
        // --dry-run changes nothing.
        let out = f.ok(&["repo", "repair", "--dry-run", &repo]);
        assert!(out.stdout.contains("would index data/"), "{}", out.describe());
        assert_eq!(fs::metadata(&index[0]).unwrap().len(), 100);
        let out = f.ok(&["repo", "repair", &repo]);
        assert!(out.stdout.contains("1 of 2 packs indexed again"), "{}", out.describe());
        assert!(out.stdout.contains("the damaged index object index/"), "{}", out.describe());
        // Rebuilt unencrypted, the index object has its old bytes again, and its name.
        assert_eq!(index[0].exists(), !f.encrypted);
        f.assert_clean(&repo);
        f.assert_restores(&repo, "a", &sa, &a);
        f.assert_restores(&repo, "b", &sb, &b);
        // Nothing is an orphan any more: gc frees nothing and check stays clean.
        let out = f.ok(&["repo", "gc", &repo]);
        assert!(out.stdout.contains("0 packs deleted"), "{}", out.describe());
        f.assert_clean(&repo);
        // A second repair finds nothing to do.
        let out = f.ok(&["repo", "repair", &repo]);
        assert!(out.stdout.contains("0 of 2 packs indexed again"), "{}", out.describe());
    }
}

/// A deleted index object: its packs look like orphans, but check does not send to gc
/// (which refuses), and repair indexes them again.
#[test]
fn repair_reindexes_packs_of_a_lost_index_object() {
    let dir = tmp("ferry-recover-lost");
    let f = PLAIN;
    let repo = f.init(dir.path());
    let a = disk(dir.path(), "a.raw", 4, 6);
    let (sa, _) = f.backup(&a, &repo, "a");
    fs::remove_file(&objects(&repo, "index")[0]).unwrap();
    let out = f.fails(&["repo", "check", &repo]);
    assert!(out.stderr.contains("`ferry repo repair` indexes them again"), "{}", out.describe());
    let out = f.fails(&["repo", "gc", &repo]);
    assert!(out.stderr.contains("ferry repo repair"), "{}", out.describe());
    f.ok(&["repo", "repair", &repo]);
    f.assert_clean(&repo);
    f.assert_restores(&repo, "a", &sa, &a);
}

/// An unreadable manifest is listed by repair, and removed only with --drop-damaged.
#[test]
fn repair_drops_damaged_manifests_only_when_asked() {
    let dir = tmp("ferry-recover-manifest");
    let f = PLAIN;
    let repo = f.init(dir.path());
    let a = disk(dir.path(), "a.raw", 1, 7);
    let b = disk(dir.path(), "b.raw", 1, 8);
    let (sa, _) = f.backup(&a, &repo, "a");
    let (sb, _) = f.backup(&b, &repo, "b");
    let bad = Path::new(&repo).join("snapshots").join(&sa);
    fs::write(&bad, b"").unwrap();
    let out = f.fails(&["repo", "repair", &repo]);
    assert!(out.stdout.contains(&format!("damaged manifest snapshots/{sa}")), "{}", out.describe());
    assert!(out.stdout.contains("--drop-damaged removes it"), "{}", out.describe());
    assert!(bad.exists());
    let out = f.ok(&["repo", "repair", "--drop-damaged", &repo]);
    assert!(out.stdout.contains(&format!("remove the damaged manifest snapshots/{sa}")), "{}", out.describe());
    assert!(!bad.exists());
    assert_eq!(f.listed(&repo), vec![(sb.clone(), false)]);
    f.assert_restores(&repo, "b", &sb, &b);
}

/// `ferry repo forget REPO ID...`: ids resolved before anything goes, of the disk given,
/// not mixed with a policy; an unreadable manifest forgotten by its id; `--wait`.
#[test]
fn forget_by_id() {
    let dir = tmp("ferry-recover-forget");
    let f = PLAIN;
    let repo = f.init(dir.path());
    let a = disk(dir.path(), "a.raw", 1, 9);
    let b = disk(dir.path(), "b.raw", 1, 10);
    let (s1, _) = f.backup(&a, &repo, "a");
    let (s2, _) = f.backup(&a, &repo, "a");
    let (s3, _) = f.backup(&b, &repo, "b");
    let ids = |f: &Ferry| f.listed(&repo).into_iter().map(|(id, _)| id).collect::<Vec<_>>();
    let out = f.fails(&["repo", "forget", &repo, "xyz1"]);
    assert!(out.stderr.contains("is not a snapshot id"), "{}", out.describe());
    f.fails(&["repo", "forget", &repo, &s1[..3]]);
    let out = f.fails(&["repo", "forget", &repo, &s1[..8], "ffff0000"]);
    assert!(out.stderr.contains("no snapshot whose id starts with"), "{}", out.describe());
    let out = f.fails(&["repo", "forget", &format!("{repo}::b"), &s1[..8]]);
    assert!(out.stderr.contains("is not of b but of a"), "{}", out.describe());
    let out = f.fails(&["repo", "forget", &repo, &s1[..8], "--keep-last", "1"]);
    assert!(out.stderr.contains("not both"), "{}", out.describe());
    assert_eq!(ids(&f).len(), 3, "nothing was forgotten");
    let out = f.ok(&["repo", "forget", "--dry-run", &repo, &s1[..8]]);
    assert!(out.stdout.contains(&format!("would remove  {}", &s1[..8])), "{}", out.describe());
    assert_eq!(ids(&f).len(), 3);
    let out = f.ok(&["repo", "forget", "--json", &repo, &s1[..8], &s3[..6]]);
    let j = Json::must_parse(&out.stdout);
    let removed: Vec<&str> = j.at("removed").as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
    assert_eq!(removed, vec![s1.as_str(), s3.as_str()]);
    assert_eq!(ids(&f), vec![s2.clone()]);
    f.assert_restores(&repo, "a", &s2, &a);

    // --wait: a live gc lock of another host holds forget off until it goes.
    let lock = Path::new(&repo).join("locks").join("0123456789abcdef0123456789abcdef");
    let now = shell_date("now");
    fs::write(&lock, format!(r#"{{"kind":"gc","host":"elsewhere","pid":77,"time":"{now}","refreshed":"{now}"}}"#))
        .unwrap();
    let t = Instant::now();
    let out = f.fails(&["repo", "forget", "--wait", "1", &repo, &s2[..8]]);
    assert!(t.elapsed() >= Duration::from_secs(1), "{}", out.describe());
    assert!(out.stderr.contains("is locked by"), "{}", out.describe());
    let remover = {
        let lock = lock.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(1500));
            fs::remove_file(lock).unwrap();
        })
    };
    // An unreadable manifest is forgotten by its id.
    fs::write(Path::new(&repo).join("snapshots").join(&s2), b"not a manifest").unwrap();
    let out = f.ok(&["repo", "forget", "--wait", "30", &repo, &s2[..8]]);
    remover.join().unwrap();
    assert!(out.stdout.contains("its manifest cannot be read"), "{}", out.describe());
    assert!(ids(&f).is_empty());
}

/// `date -u -d WHEN` as RFC 3339.
fn shell_date(when: &str) -> String {
    let out = run_ok(&mut cmd("date", ["-u", "-d", when, "+%Y-%m-%dT%H:%M:%SZ"]));
    out.stdout.trim().to_string()
}

/// `ferry repo unlock`: stale locks go, each printed with its holder and age; live and
/// unreadable ones stay unless --force.
#[test]
fn unlock_removes_stale_locks_only() {
    let dir = tmp("ferry-recover-unlock");
    let f = PLAIN;
    let repo = f.init(dir.path());
    let locks = Path::new(&repo).join("locks");
    fs::create_dir_all(&locks).unwrap();
    let (old, now) = (shell_date("2 hours ago"), shell_date("now"));
    let tag = "ab".repeat(32);
    let stale = locks.join("11111111111111111111111111111111");
    fs::write(
        &stale,
        format!(
            r#"{{"kind":"backup","disk":"{tag}","host":"gone-host","pid":4242,"time":"{old}","refreshed":"{old}"}}"#
        ),
    )
    .unwrap();
    let two_hours = SystemTime::now() - Duration::from_secs(7200);
    fs::File::options().write(true).open(&stale).unwrap().set_modified(two_hours).unwrap();
    let live = locks.join("22222222222222222222222222222222");
    fs::write(&live, format!(r#"{{"kind":"gc","host":"other-host","pid":77,"time":"{now}","refreshed":"{now}"}}"#))
        .unwrap();
    let junk = locks.join("33333333333333333333333333333333");
    fs::write(&junk, b"garbage").unwrap();

    let out = f.ok(&["repo", "unlock", &repo]);
    let removed = out.stdout.lines().find(|l| l.starts_with("removed locks/1111")).unwrap_or_default();
    assert!(removed.contains("backup by process 4242 on gone-host, taken 2h00m ago"), "{}", out.describe());
    assert!(out.stdout.contains("kept locks/2222"), "{}", out.describe());
    assert!(out.stdout.contains("kept locks/3333"), "{}", out.describe());
    assert!(out.stdout.contains("1 lock(s) removed, 2 kept"), "{}", out.describe());
    assert!(!stale.exists() && live.exists() && junk.exists());
    let out = f.ok(&["repo", "unlock", "--force", &repo]);
    assert!(out.stdout.contains("2 lock(s) removed, 0 kept"), "{}", out.describe());
    assert!(!live.exists() && !junk.exists());
    // With the locks gone, a gc runs.
    f.ok(&["repo", "gc", &repo]);
}
