//! Everyday administration of a repository (issue 37):
//!
//! * retention against restic: a calendar of 400 days (some with two snapshots, 30 hourly
//!   ones at the end, some tagged) made by restic with faked times (the checked-in
//!   repository `data/restic-calendar`, its script beside it) is backed up into ferry
//!   with the same times (`FERRY_BACKUP_TIME`); for each policy, ferry's
//!   `repo forget --dry-run --json` keeps exactly the snapshots restic's does, both
//!   reading the calendar in Europe/Berlin;
//! * tags, notes, protection, `repo list` filters and `repo gc --dry-run` through the CLI;
//! * ferry's own tracking bitmaps in a qcow2 image: one per repository and disk, so that
//!   backups into two repositories stay incremental, and `vm1` never removes `vm1-off`'s.

use crate::common::json::{Json, JsonExt};
use crate::common::*;
use crate::incremental_backup::{qemu_img, qemu_io, s};
use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::process::Command;

const MIB: u64 = 1 << 20;
const ZONE: &str = "Europe/Berlin";

/// `ferry ARGS` in the calendar's zone, its repository state and cache under `state`.
fn ferry_in(state: &Path, args: &[&str]) -> Command {
    let mut c = Command::new(ferry_bin());
    c.args(args)
        .env("TZ", ZONE)
        .env("FERRY_CACHE_DIR", state.join("cache"))
        .env("FERRY_STATE_DIR", state.join("state"))
        .env_remove("FERRY_PASSWORD")
        .env_remove("FERRY_PASSWORD_FILE")
        .env_remove("FERRY_BACKUP_TIME")
        .env_remove("RUST_LOG");
    c
}

fn restic(repo: &Path, args: &[&str]) -> Output {
    run_ok(
        Command::new("restic")
            .args(args)
            .env("TZ", ZONE)
            .env("RESTIC_REPOSITORY", repo)
            .env("RESTIC_PASSWORD", "ferry-test")
            .env("RESTIC_CACHE_DIR", repo.with_extension("cache"))
            .env_remove("RESTIC_PASSWORD_FILE"),
    )
}

/// restic's version as (major, minor).
fn restic_version() -> (u32, u32) {
    let out = run_ok(Command::new("restic").arg("version")).stdout;
    let v = out.split_whitespace().nth(1).unwrap_or("0.0");
    let mut parts = v.split('.').map(|p| p.parse::<u32>().unwrap_or(0));
    (parts.next().unwrap_or(0), parts.next().unwrap_or(0))
}

/// The ids ferry's `repo forget --dry-run --json` keeps, and restic's (as ferry ids).
fn kept_by_both(dir: &Path, restic_repo: &Path, repo: &str, ids: &HashMap<String, String>, policy: &[&str]) {
    let mut a = vec!["forget", "--dry-run", "--json"];
    a.extend_from_slice(policy);
    let r = Json::must_parse(restic(restic_repo, &a).stdout.trim());
    let groups = r.as_array().expect("restic's groups");
    assert_eq!(groups.len(), 1, "one group (one host, one path): {r}");
    let want: BTreeSet<String> =
        groups[0].array_at("keep").iter().map(|k| ids[k.at("id").as_str().expect("an id")].clone()).collect();
    let mut a = vec!["repo", "forget", repo, "--dry-run", "--json"];
    a.extend_from_slice(policy);
    let out = run_ok(&mut ferry_in(dir, &a));
    let f = Json::must_parse(out.stdout.trim());
    let got: BTreeSet<String> = f.array_at("kept").iter().map(|k| k.as_str().unwrap().to_string()).collect();
    let removed = f.array_at("removed").len();
    assert_eq!(got.len() + removed, ids.len(), "{policy:?}: every snapshot kept or removed");
    assert!(!want.is_empty() && removed > 0, "{policy:?} keeps some and removes some");
    if got != want {
        let only_ferry: Vec<&String> = got.difference(&want).collect();
        let only_restic: Vec<&String> = want.difference(&got).collect();
        panic!("{policy:?}: ferry keeps {only_ferry:?} that restic removes, restic {only_restic:?} that ferry removes");
    }
    // Every kept snapshot says why, in restic's words for the rules restic has.
    for id in &got {
        let why = f.at("reasons").at(id).as_array().unwrap_or_else(|| panic!("{policy:?}: no reasons for {id}"));
        assert!(!why.is_empty(), "{policy:?}: no reason for {id}");
    }
}

/// (restic) ferry's retention keeps what restic's keeps, policy by policy, on a calendar of
/// 400 days and 30 hours with faked times.
#[test]
fn forget_keeps_what_restic_keeps() {
    require("restic");
    let tmp =
        tempfile::Builder::new().prefix("ferry-retention").tempdir_in("/dev/shm").expect("a directory in /dev/shm");
    let d = tmp.path();
    let restic_repo = d.join("restic");
    std::fs::create_dir(&restic_repo).unwrap();
    let tarball = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/restic-calendar/restic-calendar.tar.gz");
    run_ok(Command::new("tar").arg("-xzf").arg(&tarball).arg("-C").arg(&restic_repo));
    let snaps = Json::must_parse(restic(&restic_repo, &["snapshots", "--json"]).stdout.trim());
    let mut snaps: Vec<&Json> = snaps.as_array().expect("restic's snapshots").iter().collect();
    assert!(snaps.len() >= 430, "the calendar has {} snapshots", snaps.len());
    snaps.sort_by_key(|s| s.at("time").as_str().unwrap().to_string());
    // The same calendar in ferry: one disk, the same times and tags, oldest first.
    let repo = d.join("repo");
    run_ok(&mut ferry_in(d, &["repo", "init", s(&repo)]));
    let disk = write_sparse_file(d, "disk.raw", &Rng::new(37).bytes(64 * 1024));
    let target = format!("{}::calendar", repo.display());
    let mut ids: HashMap<String, String> = HashMap::new();
    for snap in &snaps {
        let time = snap.at("time").as_str().unwrap();
        let mut a = vec!["backup", "--json", s(&disk), &target];
        let tags: Vec<&str> = snap
            .get("tags")
            .and_then(Json::as_array)
            .map_or(Vec::new(), |t| t.iter().map(|t| t.as_str().unwrap()).collect());
        for t in &tags {
            a.extend(["--tag", t]);
        }
        let out = run_ok(ferry_in(d, &a).env("FERRY_BACKUP_TIME", time));
        let id = Json::must_parse(out.stdout.trim()).at("id").as_str().unwrap().to_string();
        ids.insert(snap.at("id").as_str().unwrap().to_string(), id);
    }
    let repo_s = s(&repo);
    let mut policies: Vec<Vec<&str>> = vec![
        vec!["--keep-last", "5"],
        vec!["--keep-hourly", "24"],
        vec!["--keep-daily", "7"],
        vec!["--keep-hourly", "40", "--keep-daily", "3"],
        vec!["--keep-daily", "30", "--keep-weekly", "8", "--keep-monthly", "12", "--keep-yearly", "1"],
        vec!["--keep-weekly", "60"],
        vec!["--keep-within", "1m15d"],
        vec!["--keep-within", "2d12h", "--keep-tag", "keep"],
        vec!["--keep-monthly", "6", "--keep-tag", "audit", "--keep-tag", "keep"],
    ];
    // restic 0.15 and later keep the oldest snapshot while a rule has counts left, as
    // ferry does; restic 0.14 did not, so only policies whose counts run out are
    // compared with it.
    if restic_version() >= (0, 15) {
        policies.push(vec!["--keep-yearly", "5"]);
        policies.push(vec!["--keep-monthly", "40", "--keep-last", "2"]);
    }
    for p in &policies {
        kept_by_both(d, &restic_repo, repo_s, &ids, p);
    }
    // The text of a dry run says why each snapshot is kept.
    let out = run_ok(&mut ferry_in(
        d,
        &["repo", "forget", repo_s, "--dry-run", "--keep-daily", "2", "--keep-within", "3h", "--keep-tag", "keep"],
    ));
    for reason in ["(within 3h", "daily snapshot)", "(tag keep)", "would remove"] {
        assert!(out.stdout.contains(reason), "no {reason:?} in:\n{}", out.stdout);
    }
    assert_eq!(ferry_list(d, repo_s, &[]).len(), ids.len(), "a dry run removes nothing");
}

/// `ferry repo list REPO ARGS --json`.
fn ferry_list(state: &Path, repo: &str, args: &[&str]) -> Vec<Json> {
    let mut a = vec!["repo", "list", repo, "--json"];
    a.extend_from_slice(args);
    let out = run_ok(&mut ferry_in(state, &a));
    Json::must_parse(out.stdout.trim()).as_array().expect("a list").clone()
}

fn ids_of(list: &[Json]) -> Vec<String> {
    list.iter().map(|s| s.at("id").as_str().unwrap()[..8].to_string()).collect()
}

/// Tags and notes are stored and shown; list filters by name pattern, tag, host and the
/// latest N; a protected snapshot survives forget, by policy and by id; gc --dry-run
/// changes nothing and says what gc then does.
#[test]
fn tags_notes_protection_filters_and_gc_dry_run() {
    let tmp = tempfile::Builder::new().prefix("ferry-retain-cli").tempdir().unwrap();
    let d = tmp.path();
    let repo = d.join("repo");
    let r = s(&repo);
    run_ok(&mut ferry_in(d, &["repo", "init", r]));
    let mut made: Vec<(String, String)> = Vec::new();
    for (i, (name, tags, note)) in [
        ("vm1", vec!["daily"], "first"),
        ("vm1", vec!["daily", "db"], ""),
        ("vm1-off", vec!["weekly"], "the stopped copy"),
        ("web", vec![], ""),
        ("vm1", vec![], "before the upgrade"),
    ]
    .into_iter()
    .enumerate()
    {
        let disk = write_sparse_file(d, &format!("{i}.raw"), &Rng::new(i as u64).bytes(256 * 1024));
        let target = format!("{r}::{name}");
        let mut a = vec!["backup", "--json", s(&disk), &target];
        for t in &tags {
            a.extend(["--tag", t]);
        }
        if !note.is_empty() {
            a.extend(["--note", note]);
        }
        let time = format!("2026-11-{:02}T10:00:00Z", 20 + i);
        let out = run_ok(ferry_in(d, &a).env("FERRY_BACKUP_TIME", &time));
        made.push((name.to_string(), Json::must_parse(out.stdout.trim()).at("id").as_str().unwrap()[..8].to_string()));
    }
    let id = |i: usize| made[i].1.clone();
    let all = ferry_list(d, r, &[]);
    assert_eq!(all.len(), 5);
    assert_eq!(all[1].array_at("tags").iter().map(|t| t.as_str().unwrap()).collect::<Vec<_>>(), ["daily", "db"]);
    assert_eq!(all[2].at("note").as_str(), Some("the stopped copy"));
    assert_eq!(all[0].at("time").as_str(), Some("2026-11-20T10:00:00Z"), "FERRY_BACKUP_TIME is recorded");
    // Filters.
    assert_eq!(ids_of(&ferry_list(d, r, &["vm1"])), [id(0), id(1), id(4)], "an exact name");
    assert_eq!(ids_of(&ferry_list(d, r, &["vm1*"])), [id(0), id(1), id(2), id(4)], "a pattern");
    assert_eq!(ids_of(&ferry_list(d, r, &["--tag", "daily"])), [id(0), id(1)]);
    assert_eq!(ids_of(&ferry_list(d, r, &["--tag", "daily,db"])), [id(1)], "both tags");
    assert_eq!(ids_of(&ferry_list(d, r, &["--tag", "db", "--tag", "weekly"])), [id(1), id(2)], "either list");
    assert_eq!(ids_of(&ferry_list(d, r, &["--latest", "1"])), [id(2), id(3), id(4)], "the latest of each disk");
    assert_eq!(ids_of(&ferry_list(d, r, &["vm1", "--latest", "2"])), [id(1), id(4)]);
    let host = all[0].at("host").as_str().unwrap().to_string();
    assert_eq!(ferry_list(d, r, &["--host", &host]).len(), 5);
    assert!(ferry_list(d, r, &["--host", "no-such-host"]).is_empty());
    let text = run_ok(&mut ferry_in(d, &["repo", "list", r])).stdout;
    assert!(text.contains("tags daily,db") && text.contains("note: before the upgrade"), "{text}");
    // Bad tags and notes are refused before anything is read.
    let disk = d.join("0.raw");
    for bad in [vec!["--tag", "a,b"], vec!["--tag", ""], vec!["--note", "two\nlines"]] {
        let mut a = vec!["backup", s(&disk)];
        let target = format!("{r}::vm1");
        a.push(&target);
        a.extend_from_slice(&bad);
        let out = run_fails(&mut ferry_in(d, &a));
        assert_eq!(out.status.code(), Some(2), "{bad:?} is a usage error: {}", out.describe());
    }
    // Usage errors: a snapshot without its id to protect, a list of the 0 latest.
    let no_id = format!("{r}::vm1");
    for bad in [vec!["repo", "protect", &no_id], vec!["repo", "list", r, "--latest", "0"]] {
        let out = run_fails(&mut ferry_in(d, &bad));
        assert_eq!(out.status.code(), Some(2), "{bad:?} is a usage error: {}", out.describe());
    }
    // Protection: forget keeps it, says so, and refuses it by id.
    let first = format!("{r}::vm1@{}", id(0));
    let out = run_ok(&mut ferry_in(d, &["repo", "protect", &first]));
    assert!(out.stdout.contains("protected snapshot"), "{}", out.describe());
    assert!(ferry_list(d, r, &["vm1"])[0].bool_at("protected"));
    let out = run_ok(&mut ferry_in(d, &["repo", "forget", &format!("{r}::vm1"), "--keep-last", "1"]));
    assert!(
        out.stdout.contains(&format!("kept          {}", id(0))) && out.stdout.contains("(protected)"),
        "{}",
        out.stdout
    );
    assert_eq!(ids_of(&ferry_list(d, r, &["vm1"])), [id(0), id(4)]);
    let out = run_fails(&mut ferry_in(d, &["repo", "forget", r, &id(0)]));
    assert!(out.stderr.contains("protected"), "{}", out.describe());
    run_ok(&mut ferry_in(d, &["repo", "unprotect", &first]));
    assert!(!ferry_list(d, r, &["vm1"])[0].bool_at("protected"));
    // gc --dry-run: nothing changes; then gc does what it said.
    run_ok(&mut ferry_in(d, &["repo", "forget", r, &id(0), &id(3)]));
    let files = |p: &Path| -> Vec<PathBuf> {
        let mut v: Vec<PathBuf> = walk(p);
        v.sort();
        v
    };
    let before = files(&repo);
    let dry = run_ok(&mut ferry_in(d, &["repo", "gc", r, "--dry-run", "--repack", "0"])).stdout;
    assert_eq!(files(&repo), before, "gc --dry-run changed the repository: {dry}");
    assert!(dry.contains("would delete") && dry.contains("nothing was changed"), "{dry}");
    let real = run_ok(&mut ferry_in(d, &["repo", "gc", r, "--repack", "0"])).stdout;
    let said = |out: &str, what: &str| -> u64 {
        let words: Vec<&str> = out.split_whitespace().collect();
        let i = words.iter().position(|w| *w == what).unwrap_or_else(|| panic!("no {what:?} in {out}"));
        words[i - 1].parse().unwrap_or_else(|_| words[i + 1].parse().unwrap())
    };
    assert_eq!(said(&dry, "packs,"), said(&real, "packs"), "dry: {dry}\nreal: {real}");
    assert_ne!(files(&repo), before, "gc itself changes it");
}

fn walk(p: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(p).unwrap().flatten() {
        let path = e.path();
        if path.is_dir() {
            out.extend(walk(&path));
        } else {
            out.push(path);
        }
    }
    out
}

/// The `read` of `ferry backup --json SRC TARGET`.
fn backup_read(state: &Path, src: &Path, target: &str) -> u64 {
    let out = run_ok(&mut ferry_in(state, &["backup", "--json", s(src), target]));
    Json::must_parse(out.stdout.trim()).u64_at("read")
}

/// A 16 MiB qcow2 image in `d` with its first 8 MiB written.
fn image(d: &Path) -> PathBuf {
    let img = d.join("vm.qcow2");
    qemu_img(&["create", "-q", "-f", "qcow2", s(&img), &(16 * MIB).to_string()]);
    qemu_io("qcow2", s(&img), &[format!("write -P 0x11 0 {}", 8 * MIB)]);
    img
}

/// (qemu-img) One qcow2 image backed up into two repositories stays incremental in both:
/// ferry keeps a bitmap per repository and disk.
#[test]
fn one_image_into_two_repositories_stays_incremental() {
    let tmp = tempfile::Builder::new().prefix("ferry-track2").tempdir().unwrap();
    let d = tmp.path();
    let img = image(d);
    let (a, b) = (d.join("a"), d.join("b"));
    run_ok(&mut ferry_in(d, &["repo", "init", s(&a)]));
    run_ok(&mut ferry_in(d, &["repo", "init", s(&b)]));
    let (ta, tb) = (format!("{}::vm", a.display()), format!("{}::vm", b.display()));
    assert!(backup_read(d, &img, &ta) >= 8 * MIB, "the first backup into a reads everything");
    assert!(backup_read(d, &img, &tb) >= 8 * MIB, "the first backup into b reads everything");
    for round in 0..2u64 {
        qemu_io("qcow2", s(&img), &[format!("write -P 0x{:02x} {} 65536", 0x20 + round, (round + 1) * MIB)]);
        let (ra, rb) = (backup_read(d, &img, &ta), backup_read(d, &img, &tb));
        assert!(ra <= MIB && rb <= MIB, "round {round}: a read {ra}, b read {rb}: both incremental");
    }
    for (repo, target) in [(&a, &ta), (&b, &tb)] {
        let hash =
            |x: &str| run_ok(&mut ferry_in(d, &["hash", x])).stdout.split_whitespace().next().unwrap().to_string();
        assert_eq!(hash(target), hash(s(&img)), "{} restores the image", repo.display());
    }
}

/// (qemu-img) Disks whose names prefix one another (`vm1`, `vm1-off`) backed up from one
/// image keep each its own bitmap: neither backup removes the other's.
#[test]
fn a_disk_name_that_prefixes_another_keeps_its_bitmap() {
    let tmp = tempfile::Builder::new().prefix("ferry-trackpfx").tempdir().unwrap();
    let d = tmp.path();
    let img = image(d);
    let repo = d.join("repo");
    run_ok(&mut ferry_in(d, &["repo", "init", s(&repo)]));
    let (t1, t2) = (format!("{}::vm1", repo.display()), format!("{}::vm1-off", repo.display()));
    backup_read(d, &img, &t2);
    backup_read(d, &img, &t1);
    for round in 0..2u64 {
        qemu_io("qcow2", s(&img), &[format!("write -P 0x{:02x} {} 65536", 0x40 + round, (round + 2) * MIB)]);
        let r1 = backup_read(d, &img, &t1);
        let r2 = backup_read(d, &img, &t2);
        assert!(r1 <= MIB && r2 <= MIB, "round {round}: vm1 read {r1}, vm1-off read {r2}: both incremental");
    }
    let info = Json::must_parse(&qemu_img(&["info", "--output=json", s(&img)]).stdout);
    let names: Vec<String> = info
        .at("format-specific")
        .at("data")
        .array_at("bitmaps")
        .iter()
        .map(|b| b.at("name").as_str().unwrap().to_string())
        .collect();
    assert_eq!(names.len(), 2, "one bitmap for each disk: {names:?}");
}

/// README's "One example per job", run in order in an empty directory as a new user would
/// (`/backup` moved under it): every command that needs no server, no mount and no network must
/// succeed, in order (the first makes the image the others use).
#[test]
fn readme_examples_run_in_order() {
    let readme = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../README.md")).unwrap();
    let start = readme.find("## One example per job").expect("README has its examples");
    let end = start + readme[start..].find("\n## ").expect("a section after the examples");
    let mut commands: Vec<String> = Vec::new();
    let mut in_block = false;
    let mut line = String::new();
    for l in readme[start..end].lines() {
        if l.starts_with("```") {
            in_block = l == "```sh";
            continue;
        }
        if !in_block {
            continue;
        }
        // Comments after two spaces and a #, as the README writes them.
        let code = l.split("  #").next().unwrap_or(l).trim_end();
        match code.strip_suffix('\\') {
            Some(more) => line.push_str(more),
            None => {
                line.push_str(code);
                commands.push(std::mem::take(&mut line));
            }
        }
    }
    let runnable: Vec<&String> = commands
        .iter()
        .filter(|c| !c.trim().is_empty())
        .filter(|c| {
            !["ferry serve", "ferry mount", "https://", "nbd://", "libvirt:", "ferry restore"]
                .iter()
                .any(|skip| c.contains(skip))
        })
        .collect();
    assert!(runnable.len() >= 10, "too few README commands to run: {runnable:?}");
    let tmp = tempfile::Builder::new().prefix("ferry-readme").tempdir().unwrap();
    let d = tmp.path();
    let bin_dir = ferry_bin().parent().unwrap().to_path_buf();
    let path = format!("{}:{}", bin_dir.display(), std::env::var("PATH").unwrap_or_default());
    let backup = d.join("backup");
    for c in runnable {
        let c = c.replace("/backup", s(&backup));
        let out = run(Command::new("bash")
            .args(["-euo", "pipefail", "-c", &c])
            .current_dir(d)
            .env("PATH", &path)
            .envs([("FERRY_CACHE_DIR", d.join("cache")), ("FERRY_STATE_DIR", d.join("state"))]));
        assert!(out.status.success(), "README's `{c}` failed:\n{}", out.describe());
    }
    // The hash line printed one digest three times.
    let out = run_ok(Command::new(ferry_bin()).args(["hash", "vm.qcow2", "restored.qcow2"]).current_dir(d));
    let digests: BTreeSet<&str> = out.stdout.lines().filter_map(|l| l.split_whitespace().next()).collect();
    assert_eq!(digests.len(), 1, "{}", out.stdout);
}

/// Completion scripts offer the values of --format/-O and --digest and ferry bitmap's
/// operations; `ferry completions zsh | head` ends quietly.
#[test]
fn completions_offer_values_and_end_quietly_on_a_closed_pipe() {
    let bash = run_ok(Command::new(ferry_bin()).args(["completions", "bash"])).stdout;
    for want in ["raw qcow2", "sha256 sha512 sha1 md5 blake3", "--add", "--merge", "--granularity"] {
        assert!(bash.contains(want), "the bash completion has no {want:?}");
    }
    let mut child = Command::new(ferry_bin())
        .args(["completions", "zsh"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Closed before the script (tens of KiB, less than a pipe holds) is written.
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.is_empty(), "a closed pipe printed {err:?}");
    assert_eq!(out.status.code(), Some(141), "the status of a program SIGPIPE stopped");
}
