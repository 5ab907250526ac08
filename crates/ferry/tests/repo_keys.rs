//! The keys of an encrypted repository, end to end (issue 34, items 13 to 15):
//!
//! * `ferry repo key add|passwd|list|remove`: several passphrases, the new one never on the
//!   command line; the one in use and the last one are not removed by accident; the data
//!   reads with whichever passphrase is left.
//! * Format versions: `init` makes version 2 (a key per object), `--format-version 1`
//!   still makes version 1, and each is read and written in its own version; a repository
//!   that an earlier ferry made (tests/data/repo-v1) is read, written and re-keyed.
//! * A hostile `config` asking for a huge key derivation is refused before it runs, saying
//!   how to lift the bound; `FERRY_KDF_LIMIT=off` lifts it.

use crate::common::json::{Json, JsonExt};
use crate::common::*;
use std::fs;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

/// `ferry ARGS` with none of the passphrase or KDF variables of the test's environment.
fn ferry_cmd(args: &[&str]) -> Command {
    let mut c = Command::new(ferry_bin());
    c.args(args);
    for v in [
        "FERRY_PASSWORD",
        "FERRY_PASSWORD_FILE",
        "FERRY_NEW_PASSWORD",
        "FERRY_NEW_PASSWORD_FILE",
        "FERRY_KDF_LIMIT",
        "RUST_LOG",
    ] {
        c.env_remove(v);
    }
    c
}

/// `ferry ARGS` with `FERRY_PASSWORD=pw`.
fn with_pw(pw: &str, args: &[&str]) -> Command {
    let mut c = ferry_cmd(args);
    c.env("FERRY_PASSWORD", pw);
    c
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// A raw disk of random bytes.
fn random_disk(path: &Path, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15 ^ len as u64;
    for b in v.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
    fs::write(path, &v).unwrap();
    v
}

/// Makes an encrypted repository (the cheapest KDF) with `pw` and backs `disk` up as `vm`.
fn encrypted_repo(dir: &Path, pw: &str, extra: &[&str]) -> std::path::PathBuf {
    let repo = dir.join("repo");
    let mut args = vec!["repo", "init", "--encrypt", "--kdf-memory", "8M"];
    args.extend_from_slice(extra);
    args.push(s(&repo));
    run_ok(&mut with_pw(pw, &args));
    repo
}

/// Whether `pw` opens `repo` (`ferry repo list`); a refusal must be the passphrase's.
fn opens(repo: &Path, pw: &str) -> bool {
    let out = run(&mut with_pw(pw, &["repo", "list", s(repo)]));
    if !out.status.success() {
        assert!(out.stderr.contains("passphrase does not open"), "{}", out.describe());
    }
    out.status.success()
}

fn config_version(repo: &Path) -> u64 {
    Json::must_parse(&fs::read_to_string(repo.join("config")).unwrap()).u64_at("version")
}

fn restores(repo: &Path, pw: &str, want: &[u8], out: &Path) {
    let _ = fs::remove_file(out);
    run_ok(&mut with_pw(pw, &["copy", &format!("{}::vm", repo.display()), s(out)]));
    assert!(fs::read(out).unwrap() == want, "the restored disk differs");
}

#[test]
fn passphrases_are_added_changed_listed_and_removed() {
    let t = tempfile::tempdir().unwrap();
    let repo = encrypted_repo(t.path(), "first pw", &[]);
    let disk = t.path().join("disk.raw");
    let data = random_disk(&disk, 1 << 20);
    run_ok(&mut with_pw("first pw", &["backup", "-q", s(&disk), &format!("{}::vm", repo.display())]));
    let new = t.path().join("new-pw");

    // A new passphrase is needed, never from the command line, and not the current one.
    let out = run_fails(&mut with_pw("first pw", &["repo", "key", "add", s(&repo)]));
    assert!(out.stderr.contains("FERRY_NEW_PASSWORD_FILE"), "{}", out.describe());
    fs::write(&new, "first pw\n").unwrap();
    let out = run_fails(&mut with_pw("first pw", &["repo", "key", "add", s(&repo), "--new-password-file", s(&new)]));
    assert!(out.stderr.contains("is the current one"), "{}", out.describe());
    // Nor without the current one.
    fs::write(&new, "second pw\n").unwrap();
    let out = run_fails(&mut ferry_cmd(&["repo", "key", "add", s(&repo), "--new-password-file", s(&new)]));
    assert!(out.stderr.contains("current passphrase"), "{}", out.describe());

    // Add: both open.
    let out = run_ok(&mut with_pw(
        "first pw",
        &["repo", "key", "add", s(&repo), "--new-password-file", s(&new), "--kdf-memory", "8M"],
    ));
    assert!(out.stderr.contains("master key is unchanged"), "{}", out.describe());
    assert!(opens(&repo, "first pw") && opens(&repo, "second pw"));
    let list = run_ok(&mut with_pw("second pw", &["repo", "key", "list", s(&repo), "--json"])).stdout;
    let keys = Json::must_parse(&list);
    let keys = keys.as_array().unwrap();
    assert_eq!(keys.len(), 2, "{list}");
    assert_eq!(keys[0].at("id").as_str(), Some("config"));
    assert!(!keys[0].bool_at("in_use") && keys[1].bool_at("in_use"), "{list}");
    assert_eq!(keys[1].at("kdf").u64_at("m_kib"), 8192);
    let second = keys[1].at("id").as_str().unwrap().to_string();
    let table = run_ok(&mut with_pw("first pw", &["repo", "key", "list", s(&repo)])).stdout;
    assert!(
        table.lines().any(|l| l.starts_with("config") && l.contains("opened with the passphrase given")),
        "{table}"
    );
    assert!(table.contains(&second), "{table}");

    // Passwd of the key the passphrase opens, the new one from FERRY_NEW_PASSWORD_FILE.
    fs::write(&new, "third pw\n").unwrap();
    let mut c = with_pw("second pw", &["repo", "key", "passwd", s(&repo), "--kdf-memory", "8M"]);
    run_ok(c.env("FERRY_NEW_PASSWORD_FILE", &new));
    assert!(!opens(&repo, "second pw"));
    assert!(opens(&repo, "third pw") && opens(&repo, "first pw"));
    assert_eq!(config_version(&repo), 3);

    // Remove: never the key in use (the only one known to open), so with another key's
    // passphrase; the last never.
    let out = run_fails(&mut with_pw("first pw", &["repo", "key", "remove", s(&repo), "config"]));
    assert!(out.stderr.contains("another key's passphrase"), "{}", out.describe());
    assert!(opens(&repo, "first pw"));
    run_ok(&mut with_pw("third pw", &["repo", "key", "remove", s(&repo), "config"]));
    assert!(!opens(&repo, "first pw"));
    assert!(opens(&repo, "third pw"));
    let out = run_fails(&mut with_pw("third pw", &["repo", "key", "remove", s(&repo), "config"]));
    assert!(out.stderr.contains("only key"), "{}", out.describe());
    restores(&repo, "third pw", &data, &t.path().join("out.raw"));

    // An unencrypted repository has no passphrase to change.
    let plain = t.path().join("plain");
    run_ok(&mut ferry_cmd(&["repo", "init", s(&plain)]));
    let out = run_fails(&mut ferry_cmd(&["repo", "key", "list", s(&plain)]));
    assert!(out.stderr.contains("not encrypted"), "{}", out.describe());
}

/// A key object planted from another repository (it reads as a key) never takes the
/// config's place: the config's key is removed only with another key's passphrase, and the
/// repository keeps opening.
#[test]
fn a_planted_key_object_never_replaces_the_configs_key() {
    let t = tempfile::tempdir().unwrap();
    let repo = encrypted_repo(t.path(), "mine", &[]);
    let other = t.path().join("other");
    fs::create_dir(&other).unwrap();
    let theirs = encrypted_repo(&other, "x", &[]);
    let mut c = with_pw("x", &["repo", "key", "add", s(&theirs), "--kdf-memory", "8M"]);
    run_ok(c.env("FERRY_NEW_PASSWORD", "y"));
    let planted = fs::read_dir(theirs.join("keys")).unwrap().next().unwrap().unwrap().path();
    fs::create_dir_all(repo.join("keys")).unwrap();
    fs::copy(planted, repo.join("keys/0000000000000000")).unwrap();
    let out = run_fails(&mut with_pw("mine", &["repo", "key", "remove", s(&repo), "config"]));
    assert!(out.stderr.contains("another key's passphrase"), "{}", out.describe());
    assert!(opens(&repo, "mine"));
    run_ok(&mut with_pw("mine", &["repo", "key", "remove", s(&repo), "0000000000000000"]));
    assert!(opens(&repo, "mine"));
}

#[test]
fn each_format_version_is_read_and_written_in_its_own_version() {
    for (extra, version) in [(&[][..], 3), (&["--format-version", "2"][..], 2), (&["--format-version", "1"][..], 1)] {
        let t = tempfile::tempdir().unwrap();
        let repo = encrypted_repo(t.path(), "pw", extra);
        assert_eq!(config_version(&repo), version);
        let disk = t.path().join("disk.raw");
        let mut data = random_disk(&disk, 1 << 20);
        let target = format!("{}::vm", repo.display());
        run_ok(&mut with_pw("pw", &["backup", "-q", s(&disk), &target]));
        data[300_000..400_000].fill(0x77);
        fs::write(&disk, &data).unwrap();
        run_ok(&mut with_pw("pw", &["backup", "-q", s(&disk), &target]));
        let mut c = with_pw("pw", &["repo", "key", "passwd", s(&repo), "--kdf-memory", "8M"]);
        run_ok(c.env("FERRY_NEW_PASSWORD", "pw2"));
        assert_eq!(config_version(&repo), version);
        restores(&repo, "pw2", &data, &t.path().join("out.raw"));
        run_ok(&mut with_pw("pw2", &["repo", "verify", s(&repo)]));
        let info = run_ok(&mut with_pw("pw2", &["info", &target])).stdout;
        assert!(info.contains(&format!("(encrypted, format version {version},")), "{info}");
    }
    // Unencrypted: version 3 unless asked, 1 or 2 for a ferry that reads only those.
    let t = tempfile::tempdir().unwrap();
    for (extra, version) in [(&[][..], 3), (&["--format-version", "2"][..], 2), (&["--format-version", "1"][..], 1)] {
        let r = t.path().join(format!("plain{version}"));
        let mut args = vec!["repo", "init"];
        args.extend_from_slice(extra);
        args.push(s(&r));
        run_ok(&mut ferry_cmd(&args));
        assert_eq!(config_version(&r), version);
    }
    let out = run_fails(&mut ferry_cmd(&["repo", "init", "--format-version", "4", s(&t.path().join("r"))]));
    assert!(out.stderr.contains("--format-version"), "{}", out.describe());
}

#[test]
fn a_hostile_kdf_cost_is_refused_before_it_runs() {
    let t = tempfile::tempdir().unwrap();
    let repo = encrypted_repo(t.path(), "pw", &[]);
    let good = fs::read_to_string(repo.join("config")).unwrap();
    assert!(good.contains("\"m_kib\": 8192") && good.contains("\"t\": 3"), "{good}");
    let hostile = good.replace("\"m_kib\": 8192", "\"m_kib\": 4194304").replace("\"t\": 3", "\"t\": 64");
    fs::write(repo.join("config"), hostile).unwrap();
    // Refused at once (running it would take minutes and 4 GiB), saying what it asks and
    // how to lift the bound.
    let started = Instant::now();
    let out = run_fails(&mut with_pw("pw", &["repo", "list", s(&repo)]));
    assert!(started.elapsed() < Duration::from_secs(10));
    for want in ["4096 MiB of memory and 64 passes", "FERRY_KDF_LIMIT=off"] {
        assert!(out.stderr.contains(want), "{want}\n{}", out.describe());
    }
    // FERRY_KDF_LIMIT=off lifts the bound: the derivation runs, here into an address-space
    // limit that makes it fail at once instead of taking minutes.
    let script = format!("ulimit -v 2000000; exec '{}' repo list '{}'", ferry_bin().display(), repo.display());
    let mut sh = Command::new("bash");
    sh.args(["-c", &script]).env_remove("FERRY_PASSWORD_FILE").env_remove("RUST_LOG");
    let out = run_fails(sh.env("FERRY_PASSWORD", "pw").env("FERRY_KDF_LIMIT", "off"));
    assert!(out.stderr.contains("Argon2") && !out.stderr.contains("FERRY_KDF_LIMIT"), "{}", out.describe());
    let out = run_fails(with_pw("pw", &["repo", "list", s(&repo)]).env("FERRY_KDF_LIMIT", "sometimes"));
    assert!(out.stderr.contains("give `off`"), "{}", out.describe());
    fs::write(repo.join("config"), good).unwrap();
    assert!(opens(&repo, "pw"));

    // A new key of such a cost is refused too, before anything is written.
    let other = t.path().join("other");
    let out = run_fails(&mut with_pw("pw", &["repo", "init", "--encrypt", "--kdf-memory", "2G", s(&other)]));
    assert!(out.stderr.contains("FERRY_KDF_LIMIT=off"), "{}", out.describe());
    assert!(!other.join("config").exists());
}

/// The disk that tests/data/repo-v1 holds as `vm`: 512 KiB, byte i = (7i + i / 65536) % 251.
fn fixture_disk() -> Vec<u8> {
    (0..512 * 1024usize).map(|i| ((i * 7 + i / 65536) % 251) as u8).collect()
}

fn copy_dir(from: &Path, to: &Path) {
    fs::create_dir_all(to).unwrap();
    for e in fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &to.join(e.file_name()));
        } else {
            fs::copy(e.path(), to.join(e.file_name())).unwrap();
        }
    }
}

/// tests/data/repo-v1 was made by ferry 0.1.0 before format version 2 (`ferry repo init
/// --encrypt --kdf-memory 8M` and one backup of [`fixture_disk`], passphrase `fixture-pw`).
#[test]
fn a_repository_of_an_earlier_ferry_is_read_written_and_rekeyed_in_its_version() {
    let t = tempfile::tempdir().unwrap();
    let repo = t.path().join("repo");
    copy_dir(&Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/repo-v1"), &repo);
    assert_eq!(config_version(&repo), 1);
    let mut data = fixture_disk();
    restores(&repo, "fixture-pw", &data, &t.path().join("out.raw"));
    // A backup into it, a new passphrase, another one added, gc: still version 1, whole.
    data[100_000..200_000].fill(0x42);
    let disk = t.path().join("disk.raw");
    fs::write(&disk, &data).unwrap();
    run_ok(&mut with_pw("fixture-pw", &["backup", "-q", s(&disk), &format!("{}::vm", repo.display())]));
    let mut c = with_pw("fixture-pw", &["repo", "key", "passwd", s(&repo), "--kdf-memory", "8M"]);
    run_ok(c.env("FERRY_NEW_PASSWORD", "changed"));
    let mut c = with_pw("changed", &["repo", "key", "add", s(&repo), "--kdf-memory", "8M"]);
    run_ok(c.env("FERRY_NEW_PASSWORD", "added"));
    run_ok(&mut with_pw("added", &["repo", "gc", s(&repo)]));
    assert_eq!(config_version(&repo), 1);
    assert!(!opens(&repo, "fixture-pw"));
    restores(&repo, "changed", &data, &t.path().join("out.raw"));
    restores(&repo, "added", &data, &t.path().join("out.raw"));
    let out = run_ok(&mut with_pw("added", &["repo", "verify", s(&repo)]));
    assert!(out.stdout.contains("no damage found: 2 snapshots"), "{}", out.describe());
}
