//! Everyday administration from scripts (issue 37), through the CLI:
//!
//! * exit statuses a script can tell apart: no repository (10), locked (11), no or wrong
//!   passphrase (12), damage found (13), as restic 0.17's 10, 11 and 12; else 1, usage 2;
//! * `ferry repo verify --read-data` reads about the share asked (at least one pack), and
//!   restic's `N/T` subsets cover every pack once;
//! * `ferry serve --fork` returns once the server listens: a client run right after it
//!   connects every time;
//! * `ferry compare` answers as `qemu-img compare` does on the same pairs (identical,
//!   different, zero tail, strict, error).

use crate::common::*;
use crate::repo_crash::{ferry_cmd, s};
use crate::repo_locks::{hostname, proc_stat, this_boot};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Stdio;

fn code(out: &Output) -> i32 {
    out.status.code().unwrap_or_else(|| panic!("killed\n{}", out.describe()))
}

/// A file of `mib` MiB of random bytes.
fn random_file(d: &Path, name: &str, mib: usize, seed: u64) -> PathBuf {
    let p = d.join(name);
    fs::write(&p, Rng::new(seed).bytes(mib << 20)).unwrap();
    p
}

/// `ferry backup SRC REPO::NAME`.
fn backup(src: &Path, repo: &Path, name: &str) {
    run_ok(&mut ferry_cmd(&["backup", s(src), &format!("{}::{name}", repo.display())]));
}

#[test]
fn repository_failures_have_exit_statuses_of_their_own() {
    let d = tempfile::tempdir().unwrap();
    let img = random_file(d.path(), "a.raw", 1, 1);
    let out = d.path().join("out.raw");

    // No repository: no directory, or a directory without a config.
    let missing = d.path().join("missing");
    for args in
        [vec!["repo", "list", s(&missing)], vec!["repo", "check", s(&missing)], vec!["repo", "verify", s(&missing)]]
    {
        let o = run(&mut ferry_cmd(&args));
        assert_eq!(code(&o), 10, "{}", o.describe());
    }
    let o = run(&mut ferry_cmd(&["copy", &format!("{}::a", missing.display()), s(&out)]));
    assert_eq!(code(&o), 10, "{}", o.describe());
    let o = run(&mut ferry_cmd(&["backup", s(&img), &format!("{}::a", missing.display())]));
    assert_eq!(code(&o), 10, "{}", o.describe());
    let o = run(&mut ferry_cmd(&["hash", &format!("{}::a", missing.display())]));
    assert_eq!(code(&o), 10, "{}", o.describe());
    // A server that cannot start says so through --fork's parent too.
    let sock = d.path().join("s.sock");
    let o = run(&mut ferry_cmd(&["serve", "--fork", "-r", "-U", s(&sock), &format!("{}::a", missing.display())]));
    assert_eq!(code(&o), 10, "{}", o.describe());
    let empty = d.path().join("empty");
    fs::create_dir(&empty).unwrap();
    let o = run(&mut ferry_cmd(&["repo", "stats", s(&empty)]));
    assert_eq!(code(&o), 10, "{}", o.describe());

    // No passphrase, or a wrong one.
    let enc = d.path().join("enc");
    run_ok(ferry_cmd(&["repo", "init", "--encrypt", "--kdf-memory", "8M", s(&enc)]).env("FERRY_PASSWORD", "right"));
    let o = run(&mut ferry_cmd(&["repo", "list", s(&enc)]));
    assert_eq!(code(&o), 12, "{}", o.describe());
    let o = run(ferry_cmd(&["repo", "list", s(&enc)]).env("FERRY_PASSWORD", "wrong"));
    assert_eq!(code(&o), 12, "{}", o.describe());
    let o = run(ferry_cmd(&["backup", s(&img), &format!("{}::a", enc.display())]).env("FERRY_PASSWORD", "wrong"));
    assert_eq!(code(&o), 12, "{}", o.describe());

    // Locked: a live gc's lock (held by a process of this host that runs).
    let repo = d.path().join("repo");
    run_ok(&mut ferry_cmd(&["repo", "init", s(&repo)]));
    backup(&img, &repo, "a");
    let mut holder = cmd("sleep", ["60"]).spawn().unwrap();
    let (_, start) = proc_stat(holder.id()).unwrap();
    let now = run_ok(&mut cmd("date", ["-u", "+%Y-%m-%dT%H:%M:%S.%NZ"])).stdout.trim().to_string();
    let lock = serde_json::json!({
        "kind": "gc", "host": hostname(), "pid": holder.id(), "time": now, "refreshed": now,
        "boot": this_boot(), "pid_start": start,
    });
    let lock_p = repo.join("locks/0123456789abcdef0123456789abcdef");
    fs::write(&lock_p, lock.to_string()).unwrap();
    let locked = [
        run(&mut ferry_cmd(&["backup", s(&img), &format!("{}::a", repo.display())])),
        run(&mut ferry_cmd(&["repo", "gc", s(&repo)])),
        run(&mut ferry_cmd(&["repo", "forget", s(&repo), "--keep-last", "1"])),
    ];
    let _ = holder.kill();
    let _ = holder.wait();
    fs::remove_file(&lock_p).unwrap();
    for o in &locked {
        assert_eq!(code(o), 11, "{}", o.describe());
    }

    // Damage found: by verify and check, and by a restore that reads it.
    let pack = fs::read_dir(repo.join("data"))
        .unwrap()
        .flat_map(|e| fs::read_dir(e.unwrap().path()).unwrap())
        .map(|e| e.unwrap().path())
        .max_by_key(|p| fs::metadata(p).unwrap().len())
        .unwrap();
    let mut bytes = fs::read(&pack).unwrap();
    bytes[100] ^= 1;
    fs::write(&pack, &bytes).unwrap();
    let o = run(&mut ferry_cmd(&["copy", &format!("{}::a", repo.display()), s(&out)]));
    assert_eq!(code(&o), 13, "a restore that read damage\n{}", o.describe());
    let o = run(&mut ferry_cmd(&["repo", "verify", s(&repo)]));
    assert_eq!(code(&o), 13, "{}", o.describe());
    let o = run(&mut ferry_cmd(&["repo", "check", s(&repo)]));
    assert_eq!(code(&o), 13, "check after verify recorded the damage\n{}", o.describe());

    // Anything else stays 1 (a disk with no snapshot), a usage error 2.
    let o = run(&mut ferry_cmd(&["copy", &format!("{}::nosuch", repo.display()), s(&out)]));
    assert_eq!(code(&o), 1, "{}", o.describe());
    let o = run(&mut ferry_cmd(&["repo", "verify", s(&repo), "--read-data", "0"]));
    assert_eq!(code(&o), 2, "{}", o.describe());
}

/// The `(read, total)` packs of verify's summary line.
fn packs_read(out: &Output) -> (usize, usize) {
    let line = out.stdout.lines().last().unwrap_or("");
    let words: Vec<&str> = line.split_whitespace().collect();
    let at = words.iter().position(|w| *w == "packs").unwrap_or_else(|| panic!("{}", out.describe()));
    // "... N chunks in R of T packs read (...)"
    (words[at - 3].parse().unwrap(), words[at - 1].parse().unwrap())
}

#[test]
fn verify_read_data_reads_the_share_asked() {
    let d = tempfile::tempdir().unwrap();
    let repo = d.path().join("repo");
    // Version 2: one pack per backup (version 3 stores a backup's located pages in a pack
    // of their own, after its data packs).
    run_ok(&mut ferry_cmd(&["repo", "init", "--format-version", "2", s(&repo)]));
    // One pack: 10% reads it (rounded up), not none.
    backup(&random_file(d.path(), "a.raw", 1, 2), &repo, "a");
    let o = run_ok(&mut ferry_cmd(&["repo", "verify", s(&repo), "--read-data", "10"]));
    assert_eq!(packs_read(&o), (1, 1), "{}", o.describe());
    assert!(o.stdout.contains(" chunks in 1 of 1 packs read (") && o.stdout.contains(", 100.0%)"), "{}", o.stdout);
    let o = run_ok(&mut ferry_cmd(&["repo", "verify", s(&repo), "--read-data", "10%"]));
    assert_eq!(packs_read(&o), (1, 1), "{}", o.describe());
    // Three packs (a backup's last pack is its own): N/3 reads one each, all together.
    backup(&random_file(d.path(), "b.raw", 1, 3), &repo, "b");
    backup(&random_file(d.path(), "c.raw", 1, 4), &repo, "c");
    for n in 1..=3 {
        let o = run_ok(&mut ferry_cmd(&["repo", "verify", s(&repo), "--read-data", &format!("{n}/3")]));
        assert_eq!(packs_read(&o), (1, 3), "{}", o.describe());
    }
    let o = run_ok(&mut ferry_cmd(&["repo", "verify", s(&repo), "--read-data", "50"]));
    assert_eq!(packs_read(&o), (2, 3), "{}", o.describe());
    let o = run_ok(&mut ferry_cmd(&["repo", "verify", s(&repo)]));
    assert_eq!(packs_read(&o), (3, 3), "{}", o.describe());
    assert!(o.stdout.contains(" chunks in 3 of 3 packs read (") && o.stdout.contains(", 100.0%)"), "{}", o.stdout);
    for bad in ["0", "101", "4/3", "0/3", "1/0", "x"] {
        let o = run(&mut ferry_cmd(&["repo", "verify", s(&repo), "--read-data", bad]));
        assert_eq!(code(&o), 2, "{bad}\n{}", o.describe());
    }
}

#[test]
fn serve_fork_returns_once_the_server_listens() {
    require("nbdinfo");
    let d = tempfile::tempdir().unwrap();
    let sock = d.path().join("s.sock");
    let pid_p = d.path().join("s.pid");
    let errors = d.path().join("stderr");
    for i in 0..20 {
        // The server keeps this stderr: a file, not the pipe a test would wait on.
        let o = std::process::Command::new(ferry_bin())
            .args(["serve", "--fork", "-P", s(&pid_p), "-U", s(&sock), "memory:1M"])
            .stdin(Stdio::null())
            .stderr(fs::File::create(&errors).unwrap())
            .output()
            .unwrap();
        assert!(o.status.success(), "round {i}: {:?}\n{}", o, fs::read_to_string(&errors).unwrap());
        let uri = format!("nbd+unix:///?socket={}", sock.display());
        let info = run(&mut cmd("nbdinfo", ["--size", &uri]));
        let pid: i32 = fs::read_to_string(&pid_p).unwrap().trim().parse().unwrap();
        run_ok(&mut cmd("kill", [pid.to_string()]));
        assert!(wait_until(std::time::Duration::from_secs(10), || proc_stat(pid as u32).is_none()), "still running");
        assert!(info.status.success() && info.stdout.trim() == "1048576", "round {i}\n{}", info.describe());
    }
    // A server that cannot start: the error and a failure, at once.
    let o = std::process::Command::new(ferry_bin())
        .args(["serve", "--fork", "-U", s(&d.path().join("no/such/dir/s.sock")), "memory:1M"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("cannot listen on"), "{err}");
}

/// `qemu-img compare ARGS` and `ferry compare ARGS`: their exit statuses and outputs.
fn both_compare(args: &[&str]) -> ((i32, String), (i32, String)) {
    let q = run(&mut cmd("qemu-img", [&["compare"], args].concat()));
    let f = run(&mut ferry_cmd(&[&["compare"], args].concat()));
    ((code(&q), q.stdout), (code(&f), f.stdout))
}

#[test]
fn compare_answers_as_qemu_img_compare() {
    require("qemu-img");
    let d = tempfile::tempdir().unwrap();
    let a = random_file(d.path(), "a.raw", 4, 5);
    let data = fs::read(&a).unwrap();
    let same = d.path().join("same.raw");
    fs::write(&same, &data).unwrap();
    let mut changed = data.clone();
    changed[(3 << 20) + 700] ^= 1;
    changed[(3 << 20) + 9000] ^= 1;
    let diff = d.path().join("diff.raw");
    fs::write(&diff, &changed).unwrap();
    let mut longer = data.clone();
    longer.resize(6 << 20, 0);
    let zero_tail = d.path().join("zero-tail.raw");
    fs::write(&zero_tail, &longer).unwrap();
    longer[(5 << 20) + 3] = 7;
    let data_tail = d.path().join("data-tail.raw");
    fs::write(&data_tail, &longer).unwrap();
    let qcow2 = d.path().join("a.qcow2");
    run_ok(&mut cmd("qemu-img", ["convert", "-f", "raw", "-O", "qcow2", s(&a), s(&qcow2)]));
    let missing = d.path().join("missing.raw");

    let pairs: Vec<(Vec<&str>, i32)> = vec![
        (vec![s(&a), s(&same)], 0),
        (vec![s(&a), s(&diff)], 1),
        (vec![s(&a), s(&zero_tail)], 0),
        (vec![s(&zero_tail), s(&a)], 0),
        (vec![s(&a), s(&data_tail)], 1),
        (vec!["-s", s(&a), s(&zero_tail)], 1),
        (vec!["-s", s(&a), s(&same)], 0),
        (vec![s(&qcow2), s(&a)], 0),
        (vec![s(&qcow2), s(&diff)], 1),
        (vec![s(&a), s(&missing)], 2),
    ];
    for (args, want) in &pairs {
        let ((qc, qout), (fc, fout)) = both_compare(args);
        assert_eq!(qc, *want, "qemu-img compare {args:?}: {qout}");
        assert_eq!(fc, qc, "ferry compare {args:?}: {fout}; qemu-img: {qout}");
        if qc != 2 {
            assert_eq!(fout, qout, "ferry compare {args:?}");
        }
    }

    // A snapshot in a repository, against a file and over NBD.
    let repo = d.path().join("repo");
    run_ok(&mut ferry_cmd(&["repo", "init", s(&repo)]));
    backup(&a, &repo, "a");
    let snap = format!("{}::a", repo.display());
    let o = run(&mut ferry_cmd(&["compare", &snap, s(&same)]));
    assert_eq!((code(&o), o.stdout.as_str()), (0, "Images are identical.\n"), "{}", o.describe());
    let o = run(&mut ferry_cmd(&["compare", s(&diff), &snap]));
    assert_eq!(code(&o), 1, "{}", o.describe());
    assert_eq!(o.stdout, format!("Content mismatch at offset {}!\n", (3 << 20) + 512), "{}", o.describe());
    // Two snapshots: from their chunk digests, then the bytes where those differ.
    backup(&diff, &repo, "d");
    backup(&zero_tail, &repo, "z");
    backup(&data_tail, &repo, "t");
    let snaps = |n: &str| format!("{}::{n}", repo.display());
    for (x, y, want) in [
        ("a", "a", "Images are identical.\n".to_string()),
        ("a", "d", format!("Content mismatch at offset {}!\n", (3 << 20) + 512)),
        ("a", "z", "Warning: Image size mismatch!\nImages are identical.\n".to_string()),
        ("t", "a", format!("Warning: Image size mismatch!\nContent mismatch at offset {}!\n", 5 << 20)),
    ] {
        let o = run(&mut ferry_cmd(&["compare", &snaps(x), &snaps(y)]));
        assert_eq!(o.stdout, want, "{x} {y}: {}", o.describe());
        assert_eq!(code(&o), if want.ends_with("identical.\n") { 0 } else { 1 }, "{}", o.describe());
    }
    let server = Server::unix(s(&diff), &["-r"]);
    let o = run(&mut ferry_cmd(&["compare", &server.uri(), &snap]));
    assert_eq!(code(&o), 1, "{}", o.describe());
    assert_eq!(o.stdout, format!("Content mismatch at offset {}!\n", (3 << 20) + 512), "{}", o.describe());
    let o = run(&mut ferry_cmd(&["compare", "-q", &server.uri(), s(&diff)]));
    assert_eq!((code(&o), o.stdout.as_str()), (0, ""), "{}", o.describe());
}

/// `ferry ARGS` with none of the repository and passphrase variables of the test's
/// environment.
fn ferry_clean(args: &[&str]) -> std::process::Command {
    let mut c = ferry_cmd(args);
    c.env_remove("FERRY_REPOSITORY").env_remove("FERRY_PASSWORD_COMMAND");
    c
}

#[test]
fn repository_and_passphrase_from_the_environment_a_command_or_the_terminal() {
    require("script");
    let d = tempfile::tempdir().unwrap();
    let repo = d.path().join("repo");
    run_ok(ferry_clean(&["repo", "init", "--encrypt", "--kdf-memory", "8M", s(&repo)]).env("FERRY_PASSWORD", "pw"));
    let img = random_file(d.path(), "a.raw", 1, 6);
    let t = format!("{}::a", repo.display());
    run_ok(ferry_clean(&["backup", s(&img), &t]).env("FERRY_PASSWORD", "pw"));

    // FERRY_REPOSITORY where REPO is not written.
    for args in [vec!["repo", "list"], vec!["repo", "check"], vec!["repo", "forget", "--keep-last", "1", "--dry-run"]] {
        let o = run(ferry_clean(&args).env("FERRY_REPOSITORY", &repo).env("FERRY_PASSWORD", "pw"));
        assert_eq!(code(&o), 0, "{}", o.describe());
    }
    let o = run(ferry_clean(&["repo", "list"]).env("FERRY_PASSWORD", "pw"));
    assert_eq!(code(&o), 2, "no REPO and no FERRY_REPOSITORY\n{}", o.describe());

    // A passphrase command: its first line; the flag, or the variable for any command.
    let o = run(&mut ferry_clean(&["repo", "list", s(&repo), "--password-command", "printf 'pw\\nnot this'"]));
    assert_eq!(code(&o), 0, "{}", o.describe());
    let out = d.path().join("out.raw");
    let o = run(ferry_clean(&["copy", &t, s(&out)]).env("FERRY_PASSWORD_COMMAND", "echo pw"));
    assert_eq!(code(&o), 0, "{}", o.describe());
    assert_eq!(fs::read(&out).unwrap(), fs::read(&img).unwrap());
    // A failing command fails, and what it printed is not shown.
    let o = run(&mut ferry_clean(&["repo", "list", s(&repo), "--password-command", "echo s3cret; exit 3"]));
    assert_eq!(code(&o), 1, "{}", o.describe());
    assert!(o.stderr.contains("passphrase command") && o.stderr.contains("3"), "{}", o.describe());
    assert!(!o.stderr.contains("s3cret") && !o.stdout.contains("s3cret"), "{}", o.describe());
    let o = run(&mut ferry_clean(&["repo", "list", s(&repo), "--password-command", "echo wrong"]));
    assert_eq!(code(&o), 12, "{}", o.describe());
    let o = run(&mut ferry_clean(&["repo", "key", "list", s(&repo), "--password-command", "echo pw"]));
    assert_eq!(code(&o), 0, "{}", o.describe());
    // The order: FERRY_PASSWORD before FERRY_PASSWORD_COMMAND (not run), a file and a
    // command together are a usage error.
    let o = run(ferry_clean(&["repo", "list", s(&repo)])
        .env("FERRY_PASSWORD", "pw")
        .env("FERRY_PASSWORD_COMMAND", "exit 1"));
    assert_eq!(code(&o), 0, "{}", o.describe());
    let pw = d.path().join("pw");
    fs::write(&pw, "pw\n").unwrap();
    let o = run(&mut ferry_clean(&["repo", "list", s(&repo), "--password-file", s(&pw), "--password-command", "true"]));
    assert_eq!(code(&o), 2, "{}", o.describe());

    // Nothing given, on a terminal: a prompt, the passphrase typed not echoed.
    let on_tty = |typed: &str| {
        let line = format!("{} repo list {}", ferry_bin().display(), repo.display());
        let mut c = cmd("script", ["-qec", &line, "/dev/null"]);
        c.env_remove("FERRY_PASSWORD").env_remove("FERRY_PASSWORD_FILE").env_remove("FERRY_PASSWORD_COMMAND");
        // Typed once the prompt is up (the terminal echoes what comes before).
        let mut child = c.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
        let mut stdin = child.stdin.take().unwrap();
        std::thread::sleep(std::time::Duration::from_secs(2));
        use std::io::Write;
        stdin.write_all(format!("{typed}\n").as_bytes()).unwrap();
        let o = child.wait_with_output().unwrap();
        (o.status.code(), String::from_utf8_lossy(&o.stdout).to_string())
    };
    let (rc, text) = on_tty("Pass-Typed");
    assert!(text.contains("passphrase of"), "{text}");
    assert!(!text.contains("Pass-Typed"), "the passphrase was echoed: {text}");
    assert_eq!(rc, Some(12), "{text}");
    let (rc, text) = on_tty("pw");
    assert_eq!(rc, Some(0), "{text}");
    assert!(text.contains(" a ") || text.contains("\ta") || text.lines().count() >= 2, "{text}");
}

#[test]
fn copy_n_writes_into_an_existing_target_as_qemu_img_convert_n() {
    require("qemu-img");
    let d = tempfile::tempdir().unwrap();
    // The source: 512 KiB of data, then a 512 KiB hole.
    let mut src_data = Rng::new(7).bytes(512 << 10);
    src_data.resize(1 << 20, 0);
    let src = write_sparse_file(d.path(), "src.raw", &src_data);
    let old = vec![0xabu8; 2 << 20];
    let (t_ferry, t_qemu) = (d.path().join("t1.raw"), d.path().join("t2.raw"));
    for t in [&t_ferry, &t_qemu] {
        fs::write(t, &old).unwrap();
    }
    run_ok(&mut ferry_cmd(&["copy", "-n", s(&src), s(&t_ferry)]));
    run_ok(&mut cmd("qemu-img", ["convert", "-n", "-f", "raw", "-O", "raw", s(&src), s(&t_qemu)]));
    let got = fs::read(&t_ferry).unwrap();
    assert_eq!(got, fs::read(&t_qemu).unwrap(), "ferry copy -n and qemu-img convert -n differ");
    assert_eq!(got.len(), 2 << 20, "the target was resized");
    assert!(got[..1 << 20] == src_data[..] && got[1 << 20..].iter().all(|b| *b == 0xab));

    // A qcow2 target is written through its format.
    let q = d.path().join("t.qcow2");
    run_ok(&mut cmd("qemu-img", ["create", "-q", "-f", "qcow2", s(&q), "2M"]));
    run_ok(&mut cmd("qemu-io", ["-f", "qcow2", "-c", "write -P 0xab 0 2M", s(&q)]));
    run_ok(&mut ferry_cmd(&["copy", "-n", s(&src), s(&q)]));
    let o = run(&mut cmd("qemu-img", ["compare", "-f", "qcow2", "-F", "raw", s(&q), s(&t_qemu)]));
    assert_eq!(code(&o), 0, "{}", o.describe());

    // A target that is missing is not made; one too small is left as it was.
    let missing = d.path().join("missing.raw");
    let o = run(&mut ferry_cmd(&["copy", "-n", s(&src), s(&missing)]));
    assert_eq!(code(&o), 1, "{}", o.describe());
    assert!(o.stderr.contains("does not exist") && !missing.exists(), "{}", o.describe());
    let small = d.path().join("small.raw");
    fs::write(&small, vec![0xcdu8; 4096]).unwrap();
    let o = run(&mut ferry_cmd(&["copy", "-n", s(&src), s(&small)]));
    assert_eq!(code(&o), 1, "{}", o.describe());
    assert!(o.stderr.contains("smaller than"), "{}", o.describe());
    assert_eq!(fs::read(&small).unwrap(), vec![0xcdu8; 4096]);
}

#[test]
fn info_json_has_what_scripts_read_from_qemu_img_info() {
    require("qemu-img");
    let d = tempfile::tempdir().unwrap();
    let q = d.path().join("x.qcow2");
    run_ok(&mut cmd("qemu-img", ["create", "-q", "-f", "qcow2", s(&q), "4M"]));
    run_ok(&mut cmd("qemu-io", ["-f", "qcow2", "-c", "write -P 1 64k 128k", s(&q)]));
    run_ok(&mut cmd("qemu-img", ["bitmap", "--add", s(&q), "b0"]));
    run_ok(&mut cmd("qemu-img", ["bitmap", "--add", "--disable", s(&q), "b1"]));
    let raw = write_sparse_file(d.path(), "y.raw", &data_with_holes(2 << 20, 8));
    let json = |o: Output| -> serde_json::Value { serde_json::from_str(&o.stdout).unwrap() };
    for img in [&q, &raw] {
        let want = json(run_ok(&mut cmd("qemu-img", ["info", "--output=json", s(img)])));
        let got = json(run_ok(&mut ferry_cmd(&["info", "--output=json", s(img)])));
        for field in ["virtual-size", "format", "actual-size", "dirty-flag", "format-specific"] {
            assert_eq!(
                got.get(field),
                want.get(field),
                "{field} of {}: ferry {got:#}\nqemu-img {want:#}",
                img.display()
            );
        }
    }
    let got = json(run_ok(&mut ferry_cmd(&["info", "--output=json", s(&q)])));
    let bitmaps = &got["format-specific"]["data"]["bitmaps"];
    assert_eq!(bitmaps.as_array().map(Vec::len), Some(2), "{got:#}");
}

#[test]
fn copy_offset_length_copies_a_byte_range_of_a_snapshot_or_file() {
    let d = tempfile::tempdir().unwrap();
    let img = random_file(d.path(), "a.raw", 3, 9);
    let data = fs::read(&img).unwrap();
    let repo = d.path().join("repo");
    run_ok(&mut ferry_cmd(&["repo", "init", s(&repo)]));
    backup(&img, &repo, "a");
    let snap = format!("{}::a", repo.display());
    let out = d.path().join("part.raw");
    // Unaligned, inside one chunk and across many; from a file and from the snapshot.
    for (src, offset, length) in
        [(s(&img), 100_001u64, Some(777_777u64)), (&snap, 70_000, Some(1000)), (&snap, 1 << 20, None)]
    {
        let mut args = vec!["copy".to_string(), "--offset".into(), offset.to_string(), src.to_string(), s(&out).into()];
        if let Some(l) = length {
            args.extend(["--length".into(), l.to_string()]);
        }
        run_ok(&mut ferry_cmd(&args.iter().map(String::as_str).collect::<Vec<_>>()));
        let end = length.map_or(data.len(), |l| (offset + l) as usize);
        assert!(fs::read(&out).unwrap() == data[offset as usize..end], "{src} at {offset} ({length:?})");
    }
    let o = run(&mut ferry_cmd(&["copy", "--offset", "2M", "--length", "2M", &snap, s(&out)]));
    assert_eq!(code(&o), 1, "{}", o.describe());
    assert!(o.stderr.contains("is not inside"), "{}", o.describe());
}
