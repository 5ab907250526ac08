//! What someone who can write a repository's store, without its passphrase, can no longer
//! do unnoticed (issue 34, items 7, 8 and 15; the security review's
//! `02-store-tampering.sh`, `05-encryption-downgrade.sh` and `03-passphrase.sh`):
//!
//! * a passphrase given to an unencrypted repository is refused, and a repository this
//!   host knew as encrypted is refused once unencrypted: the review's swap of `config`
//!   makes neither a backup in plain text nor a restore of the attacker's disk;
//! * a disk's newest snapshot deleted from the store: the latest is not restored in its
//!   place, backups, forgets and gcs refuse, lists warn, `--accept-rollback` accepts;
//! * a forgotten snapshot put back with its objects is refused;
//! * another host's forget is no rollback, nor are this host's commands side by side,
//!   nor another host's snapshot on top of the newest though its clock is behind;
//! * a disk's newest snapshot damaged (not deleted): the older one that can be read is not
//!   taken as its latest;
//! * a repository made again at a location replaces the record; a damaged record is said
//!   and made again;
//! * a passphrase file others may read is warned about.
//!
//! Each test has its own state directories (`FERRY_STATE_DIR`), one per simulated host.

use crate::common::json::{Json, JsonExt};
use crate::common::*;
use crate::incremental_backup::s;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// `ferry ARGS` on the host whose state directory is `host`, with no passphrase from the
/// test's environment.
pub(crate) fn on(host: &Path, args: &[&str]) -> Command {
    let mut c = Command::new(ferry_bin());
    c.args(args)
        .env("FERRY_STATE_DIR", host)
        .env_remove("FERRY_PASSWORD")
        .env_remove("FERRY_PASSWORD_FILE")
        .env_remove("RUST_LOG");
    c
}

pub(crate) fn ok(host: &Path, args: &[&str]) -> Output {
    run_ok(&mut on(host, args))
}

fn fails(host: &Path, args: &[&str]) -> Output {
    run_fails(&mut on(host, args))
}

/// A 1 MiB disk whose every byte is `b`.
fn day(d: &Path, b: u8) -> PathBuf {
    write_sparse_file(d, &format!("day{b}.raw"), &vec![b; MIB as usize])
}

/// `ferry backup --json --no-bitmap SRC TARGET` on `host`: the new snapshot's id.
fn backup(host: &Path, src: &Path, target: &str) -> String {
    let out = ok(host, &["backup", "--json", "--no-bitmap", s(src), target]);
    Json::must_parse(out.stdout.trim()).at("id").as_str().unwrap().to_string()
}

/// Whether `ferry copy SPEC` on `host` restores exactly `want`.
fn restores(host: &Path, spec: &str, want: &Path, d: &Path) -> bool {
    let out = d.join("restored.raw");
    let _ = fs::remove_file(&out);
    ok(host, &["copy", spec, s(&out)]);
    fs::read(&out).unwrap() == fs::read(want).unwrap()
}

/// How many files under `dir` hold `probe` verbatim.
fn files_holding(dir: &Path, probe: &[u8]) -> usize {
    let mut n = 0;
    let Ok(rd) = fs::read_dir(dir) else { return 0 };
    for e in rd {
        let p = e.unwrap().path();
        if p.is_dir() {
            n += files_holding(&p, probe);
        } else if fs::read(&p).unwrap().windows(probe.len()).any(|w| w == probe) {
            n += 1;
        }
    }
    n
}

/// Item 8, first half: a passphrase from any of its sources, given to an unencrypted
/// repository, is refused before anything is read or written.
#[test]
fn a_passphrase_for_an_unencrypted_repository_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let host = d.join("host");
    let repo = d.join("repo");
    ok(&host, &["repo", "init", s(&repo)]);
    let pw = d.join("pw");
    fs::write(&pw, "correct horse\n").unwrap();
    fs::set_permissions(&pw, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let src = day(d, 7);
    let target = format!("{}::vm1", repo.display());
    let tries: Vec<(Command, &str)> = vec![
        ({ on(&host, &["backup", "--no-bitmap", "--password-file", s(&pw), s(&src), &target]) }, "--password-file"),
        (
            {
                let mut c = on(&host, &["backup", "--no-bitmap", s(&src), &target]);
                c.env("FERRY_PASSWORD", "correct horse");
                c
            },
            "FERRY_PASSWORD",
        ),
        (
            {
                let mut c = on(&host, &["backup", "--no-bitmap", s(&src), &target]);
                c.env("FERRY_PASSWORD_FILE", &pw);
                c
            },
            "FERRY_PASSWORD_FILE",
        ),
        (
            {
                let mut c = on(&host, &["repo", "list", s(&repo)]);
                c.env("FERRY_PASSWORD", "correct horse");
                c
            },
            "FERRY_PASSWORD",
        ),
    ];
    for (mut c, source) in tries {
        let out = run_fails(&mut c);
        assert!(
            out.stderr.contains("is not encrypted, yet a passphrase was given") && out.stderr.contains(source),
            "{}",
            out.describe()
        );
        assert!(out.stderr.contains("run without a passphrase"), "{}", out.describe());
    }
    assert!(fs::read_dir(repo.join("snapshots")).map_or(true, |mut r| r.next().is_none()), "a snapshot was written");
    // Without a passphrase it works as ever.
    backup(&host, &src, &target);
}

/// Item 8, the review's swap: `config` replaced by an unencrypted one with the same id,
/// `snapshots/` and `index/` moved aside. The victim's next backup (passphrase file as
/// usual, or none) writes nothing in plain text, and the victim's restore does not return
/// the disk the attacker planted, on this host or (passphrase given) on a new one.
#[test]
fn the_reviews_encryption_downgrade_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (victim, attacker, new_host) = (d.join("victim"), d.join("attacker"), d.join("new-host"));
    let repo = d.join("repo");
    let pw = d.join("pw");
    fs::write(&pw, "correct horse battery staple\n").unwrap();
    fs::set_permissions(&pw, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let with_pw = |host: &Path, args: &[&str]| {
        let mut c = on(host, args);
        c.env("FERRY_PASSWORD_FILE", &pw);
        c
    };
    run_ok(&mut with_pw(&victim, &["repo", "init", "--encrypt", "--kdf-memory", "8M", s(&repo)]));
    let disk = write_sparse_file(d, "disk.raw", &Rng::new(8).bytes(4 * MIB as usize));
    let probe = fs::read(&disk).unwrap()[2 * MIB as usize..2 * MIB as usize + 64].to_vec();
    let target = format!("{}::vm1", repo.display());
    run_ok(&mut with_pw(&victim, &["backup", "-q", "--no-bitmap", s(&disk), &target]));
    assert_eq!(files_holding(&repo, &probe), 0, "the encrypted repository holds the disk in plain text");

    // The store's attacker: an unencrypted config of the same id, the objects hidden.
    let hidden = d.join("hidden");
    fs::create_dir(&hidden).unwrap();
    for sub in ["snapshots", "index"] {
        fs::rename(repo.join(sub), hidden.join(sub)).unwrap();
    }
    let mut config = Json::must_parse(&fs::read_to_string(repo.join("config")).unwrap());
    config["encryption"] = Json::Null;
    fs::write(repo.join("config"), config.to_string()).unwrap();

    // The victim's next backup, passphrase file as usual: refused, nothing in plain text.
    let out = run_fails(&mut with_pw(&victim, &["backup", "--no-bitmap", s(&disk), &target]));
    assert!(out.stderr.contains("is not encrypted, yet a passphrase was given"), "{}", out.describe());
    // Without the passphrase (a script that lost it): this host knew it encrypted.
    let out = fails(&victim, &["backup", "--no-bitmap", s(&disk), &target]);
    assert!(out.stderr.contains("it was when this host last used it"), "{}", out.describe());
    assert!(out.stderr.contains("plain text"), "{}", out.describe());
    assert_eq!(files_holding(&repo, &probe), 0, "a backup stored the disk in plain text");

    // The attacker plants a disk of its own (from its own host: it can).
    let evil = write_sparse_file(d, "evil.raw", &vec![b'E'; 4 * MIB as usize]);
    ok(&attacker, &["backup", "-q", "--no-bitmap", s(&evil), &target]);
    let restored = d.join("restored.raw");
    for host in [&victim, &new_host] {
        let out = run_fails(&mut with_pw(host, &["copy", &target, s(&restored)]));
        assert!(out.stderr.contains("not encrypted"), "{}", out.describe());
    }
    let out = fails(&victim, &["copy", &target, s(&restored)]);
    assert!(out.stderr.contains("it was when this host last used it"), "{}", out.describe());
    assert!(!restored.exists(), "the attacker's disk was restored");
}

/// Three snapshots of vm1 (days 1-3) and one of vm2 on `host`; their ids, vm1's oldest first.
fn three_days(host: &Path, repo: &Path, d: &Path) -> (Vec<String>, String) {
    ok(host, &["repo", "init", s(repo)]);
    let vm1 = format!("{}::vm1", repo.display());
    let ids = (1..=3).map(|b| backup(host, &day(d, b), &vm1)).collect();
    let vm2 = backup(host, &day(d, 9), &format!("{}::vm2", repo.display()));
    (ids, vm2)
}

/// Item 7, the review's rollback (02 A): the newest manifest of vm1 deleted. The latest of
/// vm1 is not restored in its place, backups of vm1, forgets and gcs are refused, lists
/// warn; the snapshot the store has is read by its id, other disks work, and
/// --accept-rollback makes the store's state the known one.
#[test]
fn a_deleted_newest_snapshot_is_a_rollback_not_the_latest() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let host = d.join("host");
    let repo = d.join("repo");
    let (ids, _) = three_days(&host, &repo, d);
    fs::remove_file(repo.join("snapshots").join(&ids[2])).unwrap();
    let vm1 = format!("{}::vm1", repo.display());
    let restored = d.join("restored.raw");

    for args in [
        vec!["copy", vm1.as_str(), s(&restored)],
        vec!["hash", vm1.as_str()],
        vec!["info", vm1.as_str()],
        vec!["backup", "--no-bitmap", s(&d.join("day3.raw")), vm1.as_str()],
        vec!["repo", "gc", s(&repo)],
        vec!["repo", "forget", "--keep-last", "1", s(&repo)],
    ] {
        let out = fails(&host, &args);
        assert!(out.stderr.contains(&format!("snapshot {} of vm1", &ids[2][..8])), "{args:?}: {}", out.describe());
        assert!(out.stderr.contains("the store went back"), "{args:?}: {}", out.describe());
        assert!(out.stderr.contains(&ids[1][..8]), "{args:?}: the latest there is not named: {}", out.describe());
    }
    let out = fails(&host, &["copy", &vm1, s(&restored)]);
    assert!(out.stderr.contains("@ID"), "no way out: {}", out.describe());
    let out = ok(&host, &["repo", "forget", "--dry-run", "--keep-last", "1", s(&repo)]);
    assert!(out.stderr.contains("the store went back"), "{}", out.describe());
    let out = fails(&host, &["backup", "--no-bitmap", s(&d.join("day3.raw")), &vm1]);
    assert!(out.stderr.contains("--accept-rollback"), "no way out: {}", out.describe());
    // Read-only commands warn and go on (check and verify exit 1, as for damage); a
    // snapshot named by id reads.
    let out = ok(&host, &["repo", "list", s(&repo)]);
    assert!(out.stderr.contains("the store went back") && out.stderr.contains("going on"), "{}", out.describe());
    for what in ["check", "verify"] {
        let out = fails(&host, &["repo", what, s(&repo)]);
        assert!(out.stderr.contains("the store went back") && out.stdout.contains("went back"), "{}", out.describe());
        assert!(out.stdout.contains("no damage found"), "{}", out.describe());
    }
    assert!(restores(&host, &format!("{vm1}@{}", &ids[1][..8]), &d.join("day2.raw"), d));
    // Other disks work.
    backup(&host, &day(d, 10), &format!("{}::vm2", repo.display()));
    // Accepted: the backup is made, and the store's state is the known one from now on.
    let out = ok(&host, &["backup", "--json", "--no-bitmap", "--accept-rollback", s(&d.join("day3.raw")), &vm1]);
    assert!(out.stderr.contains("accepted"), "{}", out.describe());
    assert!(restores(&host, &vm1, &d.join("day3.raw"), d));
    let out = ok(&host, &["repo", "list", s(&repo)]);
    assert!(!out.stderr.contains("went back"), "{}", out.describe());
    ok(&host, &["repo", "gc", s(&repo)]);
}

/// Item 7, the review's resurrection (02 B): a snapshot forgotten and collected comes back
/// with its old objects. Refused by id (and as a disk's latest); a list and a backup warn;
/// forgetting it again is the remedy.
#[test]
fn a_forgotten_snapshot_put_back_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let host = d.join("host");
    let repo = d.join("repo");
    let (ids, _) = three_days(&host, &repo, d);
    let saved = d.join("saved");
    run_ok(&mut cmd("cp", ["-a", s(&repo), s(&saved)]));
    let vm1 = format!("{}::vm1", repo.display());
    ok(&host, &["repo", "forget", "--keep-last", "1", &vm1]);
    ok(&host, &["repo", "gc", s(&repo)]);
    let first = format!("{vm1}@{}", &ids[0][..8]);
    let restored = d.join("restored.raw");
    fails(&host, &["copy", &first, s(&restored)]);
    // The store puts the old objects back.
    for sub in ["snapshots", "data", "index"] {
        run_ok(&mut cmd("cp", ["-rn", &format!("{}/.", saved.join(sub).display()), s(&repo.join(sub))]));
    }
    let out = fails(&host, &["copy", &first, s(&restored)]);
    assert!(out.stderr.contains("though this host forgot it"), "{}", out.describe());
    assert!(!restored.exists());
    let out = ok(&host, &["backup", "--no-bitmap", s(&d.join("day3.raw")), &vm1]);
    assert!(out.stderr.contains("though this host forgot it"), "{}", out.describe());
    let out = ok(&host, &["repo", "list", s(&repo)]);
    assert!(out.stderr.contains(&format!("snapshot {} of vm1", &ids[0][..8])), "{}", out.describe());
    // The newest still reads: it is no snapshot that came back.
    assert!(restores(&host, &vm1, &d.join("day3.raw"), d));
    // Forgotten again: all is as this host left it.
    ok(&host, &["repo", "forget", "--keep-last", "1", &vm1]);
    let out = ok(&host, &["repo", "list", s(&repo)]);
    assert!(!out.stderr.contains("forgot"), "{}", out.describe());
    fails(&host, &["copy", &first, s(&restored)]);
    backup(&host, &d.join("day3.raw"), &vm1);
}

/// Several hosts share one repository: a snapshot another host forgot (its policy keeps
/// the newest, which is newer) is no rollback, and neither are its backups.
#[test]
fn another_hosts_backups_and_forgets_are_no_rollback() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (a, b) = (d.join("host-a"), d.join("host-b"));
    let repo = d.join("repo");
    let (ids, _) = three_days(&a, &repo, d);
    let vm1 = format!("{}::vm1", repo.display());
    let newer = backup(&b, &day(d, 4), &vm1);
    ok(&b, &["repo", "forget", "--keep-last", "1", s(&repo)]);
    ok(&b, &["repo", "gc", s(&repo)]);
    assert!(!repo.join("snapshots").join(&ids[2]).exists());
    let out = ok(&a, &["repo", "list", s(&repo)]);
    assert!(!out.stderr.contains("went back") && out.stdout.contains(&newer[..8]), "{}", out.describe());
    assert!(restores(&a, &vm1, &d.join("day4.raw"), d));
    backup(&a, &day(d, 5), &vm1);
}

/// Flips a byte of the manifest of snapshot `id` (a store writer damaging it rather than
/// deleting it).
fn damage(repo: &Path, id: &str) {
    let m = repo.join("snapshots").join(id);
    let mut bytes = fs::read(&m).unwrap();
    bytes[10] ^= 0x20;
    fs::write(&m, bytes).unwrap();
}

/// The newest manifest of vm1 damaged instead of deleted: the latest of vm1 is not the
/// older snapshot that can be read. Restores, hashes and infos of `REPO::vm1` and a change
/// map's backup refuse, naming the damaged snapshot and the ways out (an older one by id,
/// forgetting the damaged one); a full backup goes on; a damaged manifest that is not the
/// newest this host saw is only skipped.
#[test]
fn a_damaged_newest_snapshot_is_not_replaced_by_an_older_one() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let host = d.join("host");
    let repo = d.join("repo");
    let (ids, _) = three_days(&host, &repo, d);
    damage(&repo, &ids[2]);
    let vm1 = format!("{}::vm1", repo.display());
    let restored = d.join("restored.raw");
    let map = d.join("map.json");
    fs::write(&map, format!(r#"[{{"offset": 0, "length": {MIB}, "type": 1}}]"#)).unwrap();
    let day3 = d.join("day3.raw");
    for args in [
        vec!["copy", vm1.as_str(), s(&restored)],
        vec!["hash", vm1.as_str()],
        vec!["info", vm1.as_str()],
        vec!["backup", "--extents-from", s(&map), "--since", &ids[1], s(&day3), vm1.as_str()],
    ] {
        let out = fails(&host, &args);
        let e = &out.stderr;
        assert!(
            e.contains(&format!("snapshot {} of vm1", ids[2])) && e.contains("cannot be read"),
            "{args:?}: {}",
            out.describe()
        );
        assert!(e.contains(&ids[1][..8]), "{args:?}: the older one is not named: {}", out.describe());
        assert!(e.contains(&format!("{vm1}@ID")), "{args:?}: {}", out.describe());
        assert!(
            e.contains(&format!("ferry repo forget {} {}", repo.display(), ids[2])),
            "{args:?}: {}",
            out.describe()
        );
    }
    assert!(!restored.exists());
    // Named by id, the older one reads; list goes on as for any damage.
    assert!(restores(&host, &format!("{vm1}@{}", &ids[1][..8]), &d.join("day2.raw"), d));
    let out = ok(&host, &["repo", "list", s(&repo)]);
    assert!(!out.stderr.contains("went back"), "{}", out.describe());
    // Forgotten by id: this host's record follows, the latest left is the latest.
    ok(&host, &["repo", "forget", s(&repo), &ids[2][..8]]);
    assert!(restores(&host, &vm1, &d.join("day2.raw"), d));
    // Damaged again (now ids[1], the newest): a full backup reads everything and goes on.
    damage(&repo, &ids[1]);
    let out = ok(&host, &["backup", "--no-bitmap", s(&day3), &vm1]);
    assert!(out.stderr.contains("cannot be read"), "{}", out.describe());
    // The damaged one is no longer the newest: skipped with a warning.
    let out = ok(&host, &["copy", &vm1, s(&restored)]);
    assert!(out.stderr.contains(&format!("skipping snapshots/{}", ids[1])), "{}", out.describe());
    assert_eq!(fs::read(&restored).unwrap(), fs::read(&day3).unwrap());
}

/// Host B's clock is behind host A's: B's snapshot on top of A's newest has an earlier
/// time, and B's forget removes A's. A's next restore and backup go on (B's snapshot
/// descends from what A saw); the store going back from there is still refused.
#[test]
fn a_snapshot_continuing_the_newest_is_no_rollback_whatever_its_clock() {
    require("sha256sum");
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (a, b) = (d.join("host-a"), d.join("host-b"));
    let repo = d.join("repo");
    ok(&a, &["repo", "init", s(&repo)]);
    let vm1 = format!("{}::vm1", repo.display());
    let s1 = backup(&a, &day(d, 1), &vm1);
    // B, its clock years behind, backs up on top of S1 (the same data). A retention
    // policy keeps both (S2 as the disk's latest, S1 as the newest by time): B then
    // forgets S1 by its id.
    let s2 = crate::repo_base::plant(&repo, &s1, "2000-01-01T00:00:00Z", d);
    let out = ok(&b, &["repo", "forget", "--json", "--keep-last", "1", s(&repo)]);
    assert!(out.stdout.contains(&s2) && repo.join("snapshots").join(&s1).exists(), "{}", out.describe());
    ok(&b, &["repo", "forget", s(&repo), &s1[..16]]);
    assert!(!repo.join("snapshots").join(&s1).exists());
    // A: no rollback.
    let out = ok(&a, &["repo", "list", s(&repo)]);
    assert!(!out.stderr.contains("went back"), "{}", out.describe());
    assert!(restores(&a, &vm1, &d.join("day1.raw"), d));
    let s3 = backup(&a, &day(d, 2), &vm1);
    assert!(restores(&a, &vm1, &d.join("day2.raw"), d));
    // The newest gone, nothing descending from it: refused, though S2's time is old.
    fs::remove_file(repo.join("snapshots").join(&s3)).unwrap();
    let out = fails(&a, &["copy", &vm1, s(&d.join("restored.raw"))]);
    assert!(out.stderr.contains("the store went back") && out.stderr.contains(&s3[..8]), "{}", out.describe());
}

/// The record: in FERRY_STATE_DIR, private; a damaged one is said and made again.
#[test]
fn this_hosts_record_is_private_and_never_trusted_blindly() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let host = d.join("state");
    let repo = d.join("repo");
    three_days(&host, &repo, d);
    assert_eq!(fs::metadata(&host).unwrap().permissions().mode() & 0o777, 0o700);
    let records: Vec<PathBuf> = fs::read_dir(host.join("repositories")).unwrap().map(|e| e.unwrap().path()).collect();
    assert_eq!(records.len(), 1, "{records:?}");
    assert_eq!(fs::metadata(&records[0]).unwrap().permissions().mode() & 0o777, 0o600);
    let rec = Json::must_parse(&fs::read_to_string(&records[0]).unwrap());
    assert_eq!(rec.at("encrypted").as_bool(), Some(false));
    assert!(rec.at("disks").get("vm1").is_some() && rec.at("disks").get("vm2").is_some(), "{rec}");
    fs::write(&records[0], b"{\"version\": 1, \"disks\": ").unwrap();
    let out = ok(&host, &["repo", "list", s(&repo)]);
    assert!(out.stderr.contains("is damaged") && out.stderr.contains("made again"), "{}", out.describe());
    Json::must_parse(&fs::read_to_string(&records[0]).unwrap());
    let out = ok(&host, &["repo", "list", s(&repo)]);
    assert!(!out.stderr.contains("damaged"), "{}", out.describe());
}

/// Item 15: a passphrase file the group or others may read is warned about, as ssh does.
#[test]
fn a_passphrase_file_others_can_read_is_warned_about() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let host = d.join("host");
    let repo = d.join("repo");
    let pw = d.join("pw");
    fs::write(&pw, "correct horse\n").unwrap();
    fs::set_permissions(&pw, fs::Permissions::from_mode(0o644)).unwrap();
    let out = ok(&host, &["repo", "init", "--encrypt", "--kdf-memory", "8M", "--password-file", s(&pw), s(&repo)]);
    assert!(out.stderr.contains("can be read by every user") && out.stderr.contains("chmod 600"), "{}", out.describe());
    fs::set_permissions(&pw, fs::Permissions::from_mode(0o640)).unwrap();
    let out = ok(&host, &["repo", "list", "--password-file", s(&pw), s(&repo)]);
    assert!(out.stderr.contains("can be read by its group"), "{}", out.describe());
    fs::set_permissions(&pw, fs::Permissions::from_mode(0o600)).unwrap();
    let out = ok(&host, &["repo", "list", "--password-file", s(&pw), s(&repo)]);
    assert!(!out.stderr.contains("can be read"), "{}", out.describe());
}

/// Backups of several disks side by side, and restores of a disk while it is backed up,
/// on one host: each command holds the store's listing to the record as it was before
/// it listed, so what another process committed meanwhile is no rollback.
#[test]
fn commands_side_by_side_on_one_host_see_no_rollback() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let host = d.join("host");
    let repo = d.join("repo");
    ok(&host, &["repo", "init", s(&repo)]);
    let vm0 = format!("{}::vm0", repo.display());
    backup(&host, &day(d, 1), &vm0);
    let mut running: Vec<(String, std::process::Child)> = Vec::new();
    for i in 0..4u8 {
        let src = day(d, 20 + i);
        let target = format!("{}::vm{}", repo.display(), 10 + i);
        let mut c = on(&host, &["backup", "-q", "--no-bitmap", s(&src), &target]);
        running.push((target, c.stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap()));
    }
    let done = |what: &str, c: std::process::Child| {
        let o = c.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(o.status.success() && !err.contains("went back"), "{what}: {err}");
    };
    for round in 0..3u8 {
        let mut c = on(&host, &["backup", "-q", "--no-bitmap", s(&day(d, 30 + round)), &vm0]);
        let b = c.stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap();
        for _ in 0..4 {
            let out = ok(&host, &["info", &vm0]);
            assert!(!out.stderr.contains("went back"), "{}", out.describe());
        }
        done(&format!("{vm0}, round {round}"), b);
    }
    for (what, c) in running {
        done(&what, c);
    }
    let out = ok(&host, &["repo", "check", s(&repo)]);
    assert!(!out.stderr.contains("went back"), "{}", out.describe());
}

/// A repository made again at a location (`rm -r`, then `repo init`, even unencrypted
/// where an encrypted one was) is this host's new repository there.
#[test]
fn a_repository_made_again_replaces_the_record() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let host = d.join("host");
    let repo = d.join("repo");
    let mut c = on(&host, &["repo", "init", "--encrypt", "--kdf-memory", "8M", s(&repo)]);
    run_ok(c.env("FERRY_PASSWORD", "correct horse"));
    fs::remove_dir_all(&repo).unwrap();
    ok(&host, &["repo", "init", s(&repo)]);
    let vm1 = format!("{}::vm1", repo.display());
    backup(&host, &day(d, 1), &vm1);
    assert!(restores(&host, &vm1, &d.join("day1.raw"), d));
}
