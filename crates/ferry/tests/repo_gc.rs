//! gc beside backups (issue 35, FORMAT.md §8a), end to end through the CLI: `ferry repo
//! gc` runs while four `ferry backup`s run (none waits for it), all of them finish, every
//! snapshot restores byte-exact, and a second gc deletes what the first condemned.

use crate::common::*;
use crate::repo_crash::{ferry_cmd, s};
use std::fs;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

const MIB: usize = 1 << 20;

/// The number before `what` in a gc's report.
fn count(out: &str, what: &str) -> u64 {
    let at = out.find(what).unwrap_or_else(|| panic!("no {what:?} in {out}"));
    out[..at].split_whitespace().last().and_then(|n| n.parse().ok()).unwrap_or_else(|| panic!("{out}"))
}

fn objects(dir: &Path) -> usize {
    fs::read_dir(dir).map_or(0, |rd| rd.flatten().filter(|e| !e.file_name().to_string_lossy().starts_with('.')).count())
}

#[test]
fn gc_runs_while_four_backups_run_and_a_second_gc_deletes_what_it_condemned() {
    let dir = tempfile::Builder::new().prefix("ferry-repo-gc").tempdir().unwrap();
    let repo_p = dir.path().join("repo");
    let repo = s(&repo_p).to_string();
    run_ok(&mut ferry_cmd(&["repo", "init", &repo]));
    // Four disks backed up once, then forgotten: their chunks are unused. The new data
    // keeps half of them, so that the backups running beside gc deduplicate against
    // packs that gc condemns meanwhile.
    let mut imgs = Vec::new();
    for i in 0..4u64 {
        let old = Rng::new(i + 1).bytes(8 * MIB);
        let p = dir.path().join(format!("old{i}.raw"));
        fs::write(&p, &old).unwrap();
        let out = run_ok(&mut ferry_cmd(&["backup", "--json", s(&p), &format!("{repo}::d{i}")]));
        let v: serde_json::Value = serde_json::from_str(out.stdout.trim()).unwrap();
        run_ok(&mut ferry_cmd(&["repo", "forget", &repo, v["id"].as_str().unwrap()]));
        let mut new = old;
        Rng::new(i + 100).fill(&mut new[4 * MIB..]);
        let p = dir.path().join(format!("new{i}.raw"));
        fs::write(&p, &new).unwrap();
        imgs.push((p, new));
    }
    // Slow backups (2 MiB/s): each runs for seconds.
    let mut backups = Vec::new();
    for (i, (p, _)) in imgs.iter().enumerate() {
        let mut c = ferry_cmd(&["backup", "--rate", "2M", s(p), &format!("{repo}::d{i}")]);
        c.stdout(Stdio::piped()).stderr(Stdio::piped());
        backups.push(spawn_serialized(&mut c).unwrap());
    }
    // Once every backup holds its lock (and has read the index).
    let locks = repo_p.join("locks");
    let t0 = std::time::Instant::now();
    while objects(&locks) < 4 && t0.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(500));
    let gc1 = run_ok(&mut ferry_cmd(&["repo", "gc", "--condemn-margin", "0", &repo]));
    let still = backups.iter_mut().map(|b| b.try_wait().unwrap().is_none()).filter(|running| *running).count();
    assert!(still > 0, "no backup ran beside gc; make them slower\n{}", gc1.describe());
    let condemned = count(&gc1.stdout, "packs condemned beside running backups");
    assert!(condemned > 0 && count(&gc1.stdout, "packs deleted") == 0, "{}", gc1.describe());
    assert_eq!(objects(&repo_p.join("gc/condemned")), 1);
    for b in backups {
        let out = b.wait_with_output().unwrap();
        assert!(out.status.success(), "a backup failed beside gc: {}", String::from_utf8_lossy(&out.stderr));
    }
    // Every backup has ended: the next gc marks again and deletes what is still unused.
    let gc2 = run_ok(&mut ferry_cmd(&["repo", "gc", "--condemn-margin", "0", &repo]));
    let deleted = count(&gc2.stdout, "packs deleted");
    assert!(deleted > 0 && deleted <= condemned, "{}", gc2.describe());
    assert_eq!(objects(&repo_p.join("gc/condemned")), 0, "{}", gc2.describe());
    let check = run_ok(&mut ferry_cmd(&["repo", "check", &repo]));
    assert!(check.stdout.contains("no damage"), "{}", check.describe());
    for (i, (_, want)) in imgs.iter().enumerate() {
        let out = dir.path().join(format!("restored{i}.raw"));
        run_ok(&mut ferry_cmd(&["copy", &format!("{repo}::d{i}"), s(&out)]));
        assert!(fs::read(&out).unwrap() == *want, "d{i} does not restore byte-exact");
    }
}
